//! How a prefill worker's handoff reaches the decode worker: copied into the reservation's
//! landing slot through shared memory (same host), written into it with one-sided UCX
//! operations (another host, or `--kv-landing put`), or sent whole as a message; the first
//! two send only a completion record after the bytes (ADR 0002).

use crate::handoff;
use crate::transfer_stats::TransferPath;
use crate::{Error, Result};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tandem_kv::landing::{Landing, LandingWriter};
use tandem_kv::UcxSender;
use tandem_proto::v1 as pb;

/// How a prefill worker puts a handoff into the decode worker's landing slot, when it is
/// offered one.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LandingMode {
    /// Copy into the slot's shared memory when the arena can be mapped here (same host),
    /// else write it with one-sided UCX operations when the arena is registered, else send
    /// the whole handoff as a message.
    #[default]
    Auto,
    /// One-sided UCX writes only (never shared memory), else a message: what a prefill
    /// worker on another host does, on one host.
    Put,
    /// Always a message.
    Off,
}

/// What one push needs from its worker.
pub(crate) struct Push<'a> {
    pub(crate) sender: &'a UcxSender,
    pub(crate) writer: &'a Arc<LandingWriter>,
    /// Handoff bytes that went into landing slots.
    pub(crate) landed: &'a Arc<AtomicU64>,
    pub(crate) mode: LandingMode,
    pub(crate) timeout: Duration,
}

impl Push<'_> {
    /// Delivers `message` to `target` (nothing at all when `dropped`: a chaos fault); returns
    /// the handoff's size in bytes and the path it took (none when dropped).
    pub(crate) async fn push(
        &self,
        target: &pb::KvTarget,
        message: Outgoing,
        dropped: bool,
    ) -> Result<(u64, Option<TransferPath>)> {
        let (reservation, epoch) = (message.head.reservation, message.head.epoch);
        // A dropped push (chaos) writes nowhere.
        let mode = self.mode;
        let landing = target
            .landing
            .as_ref()
            .filter(|_| !dropped && mode != LandingMode::Off)
            .map(landing_from_pb);
        let local = landing.clone().filter(|_| mode == LandingMode::Auto);
        let (writer, landed) = (self.writer.clone(), self.landed.clone());
        let (message, len, in_place) = tokio::task::spawn_blocking(move || {
            message.encode(local.as_ref().map(|l| (l, &*writer, &*landed)))
        })
        .await
        .map_err(|e| Error::InvalidRequest(format!("encoding task failed: {e}")))?;
        let remote =
            landing.filter(|l| !in_place && l.remote.is_some() && len as u64 <= l.capacity);
        let path = match remote {
            _ if dropped => None,
            _ if in_place => Some(TransferPath::Shm),
            Some(_) => Some(TransferPath::Put),
            None => Some(TransferPath::Send),
        };
        match remote {
            _ if dropped => {}
            Some(to) => {
                // Another host (or `--kv-landing put`): claim the slot and write it with
                // one-sided operations; the completion record follows the flush.
                let record = handoff::encode_landed(&handoff::Landed {
                    reservation,
                    epoch,
                    offset: to.offset,
                    len: len as u64,
                });
                let put = self
                    .sender
                    .put_landing(
                        &target.transfer_address,
                        target.reservation_id,
                        &to,
                        message,
                        record,
                        self.timeout,
                    )
                    .await;
                match put {
                    Ok(()) => {
                        self.landed.fetch_add(len as u64, Ordering::Relaxed);
                    }
                    // The reservation let go before the write: it waits for nothing.
                    Err(e @ tandem_kv::Error::SlotReleased { .. }) => {
                        tracing::debug!(error = %e, reservation = %reservation,
                            "KV landing slot released before the one-sided write; nothing written");
                    }
                    Err(e) => return Err(e.into()),
                }
            }
            None => {
                self.sender
                    .send(
                        &target.transfer_address,
                        target.reservation_id,
                        message,
                        self.timeout,
                    )
                    .await?;
            }
        }
        Ok((len as u64, path))
    }
}

pub(crate) fn landing_to_pb(l: &Landing) -> pb::KvLanding {
    pb::KvLanding {
        shm_name: l.name.clone(),
        nonce: l.nonce,
        arena_len: l.arena_len,
        offset: l.offset,
        capacity: l.capacity,
        fence: l.fence,
        fence_offset: l.fence_offset,
        rkey: l
            .remote
            .as_ref()
            .map(|r| r.rkey.clone())
            .unwrap_or_default(),
        remote_base: l.remote.as_ref().map_or(0, |r| r.base),
    }
}

fn landing_from_pb(l: &pb::KvLanding) -> Landing {
    Landing {
        name: l.shm_name.clone(),
        nonce: l.nonce,
        arena_len: l.arena_len,
        offset: l.offset,
        capacity: l.capacity,
        fence: l.fence,
        fence_offset: l.fence_offset,
        remote: (!l.rkey.is_empty()).then(|| tandem_kv::landing::RemoteArena {
            rkey: l.rkey.clone(),
            base: l.remote_base,
        }),
    }
}

/// A handoff on its way out of a prefill worker.
pub(crate) struct Outgoing {
    pub(crate) head: handoff::Head,
    pub(crate) handoff: tandem_engine::Handoff,
    /// Chaos: flip the byte at this index of the body (modulo its length).
    pub(crate) corrupt: Option<usize>,
}

impl Outgoing {
    /// Encodes the handoff message straight into the landing slot when one is offered and
    /// mappable here (returning the completion record to send), or into a message of its
    /// own; returns it with the handoff message's length and whether it went in place.
    fn encode(
        self,
        landing: Option<(&Landing, &LandingWriter, &AtomicU64)>,
    ) -> (Vec<u8>, usize, bool) {
        let h = &self.handoff;
        let head = handoff::encode_head(&self.head, &h.segments, &h.body);
        let len = head.len() + h.body.len();
        let fill = |out: &mut [u8]| {
            out[..head.len()].copy_from_slice(&head);
            out[head.len()..].copy_from_slice(&h.body);
            if let Some(i) = self.corrupt {
                // In the body, past the header and manifest: what the checksums cover.
                let n = h.body.len().max(1);
                out[len - n + i % n] ^= 0x5a;
            }
        };
        if let Some((to, writer, landed)) = landing {
            match writer.write_with(to, len, fill) {
                Ok(()) => {
                    landed.fetch_add(len as u64, Ordering::Relaxed);
                    let record = handoff::encode_landed(&handoff::Landed {
                        reservation: self.head.reservation,
                        epoch: self.head.epoch,
                        offset: to.offset,
                        len: len as u64,
                    });
                    return (record, len, true);
                }
                Err(e) => tracing::debug!(error = %e,
                    "KV landing slot not used; sending the handoff over the transport"),
            }
        }
        let mut message = vec![0u8; len];
        fill(&mut message);
        (message, len, false)
    }
}
