//! Decode-side reservations waiting for their KV. The transport's receive loop looks a
//! message (or a landing slot's completion record) up here by reservation id; the epoch
//! fences out stale senders.

use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tandem_core::{Epoch, ReservationId};
use tandem_kv::landing::LandingSlot;
use tokio::sync::oneshot;

/// How a reservation's handoff message arrived.
#[derive(Debug)]
pub enum Arrived {
    /// Over the transport, as a message.
    Message(Vec<u8>),
    /// Written into the reservation's landing slot: its first `len` bytes.
    Landed {
        /// The slot (released when this is dropped; at once, since it landed).
        slot: LandingSlot,
        /// Bytes written.
        len: usize,
    },
}

impl Arrived {
    /// The handoff message's bytes, shareable with the handoff that reads them; `None` when a
    /// landing record claimed more bytes than its slot holds.
    pub fn into_shared(self) -> Option<Arc<dyn AsRef<[u8]> + Send + Sync>> {
        match self {
            Arrived::Message(m) => Some(Arc::new(m)),
            Arrived::Landed { slot, len } => Some(Arc::new(slot.into_landed(len)?)),
        }
    }
}

/// A reservation's epoch, its landing slot if it has one, and where its KV goes.
#[derive(Debug)]
struct Waiting {
    epoch: Epoch,
    slot: Option<LandingSlot>,
    tx: oneshot::Sender<Arrived>,
    extended: Arc<tokio::sync::Notify>,
}

/// Pending reservations of a decode worker.
#[derive(Debug, Default)]
pub struct Reservations {
    next: AtomicU64,
    pending: Mutex<HashMap<ReservationId, Waiting>>,
    rejected: AtomicU64,
    extensions: AtomicU64,
}

/// A registered reservation; unregisters itself when dropped.
#[derive(Debug)]
pub struct Pending {
    owner: Arc<Reservations>,
    /// The reservation's id (the transfer tag).
    pub id: ReservationId,
    /// Its epoch.
    pub epoch: Epoch,
    /// Resolves with the raw handoff message.
    pub kv: oneshot::Receiver<Arrived>,
    /// Notified when the prefill side extends the lease (it is still computing).
    pub extended: Arc<tokio::sync::Notify>,
}

impl Drop for Pending {
    fn drop(&mut self) {
        self.owner.pending.lock().remove(&self.id);
    }
}

impl Reservations {
    /// Registers a new reservation.
    pub fn register(self: &Arc<Self>) -> Pending {
        self.register_with(None)
    }

    /// Registers a new reservation that may receive its KV in `slot`.
    pub fn register_with(self: &Arc<Self>, slot: Option<LandingSlot>) -> Pending {
        let n = self.next.fetch_add(1, Ordering::Relaxed) + 1;
        let id = ReservationId(n);
        // One epoch per reservation id here; a retried prefill gets a fresh reservation.
        let epoch = Epoch(n);
        let (tx, rx) = oneshot::channel();
        let extended = Arc::new(tokio::sync::Notify::new());
        self.pending.lock().insert(
            id,
            Waiting {
                epoch,
                slot,
                tx,
                extended: extended.clone(),
            },
        );
        Pending {
            owner: self.clone(),
            id,
            epoch,
            kv: rx,
            extended,
        }
    }

    /// Extends the lease of reservation `(id, epoch)` (its prefill is still computing);
    /// false when no such reservation is waiting (it got its KV, expired, or is fenced).
    pub fn extend(&self, id: ReservationId, epoch: Epoch) -> bool {
        match self.pending.lock().get(&id) {
            Some(w) if w.epoch == epoch => {
                w.extended.notify_one();
                self.extensions.fetch_add(1, Ordering::Relaxed);
                true
            }
            _ => false,
        }
    }

    /// Hands a received message to its reservation. Returns false (and counts a rejection)
    /// when no reservation with that id and epoch is waiting.
    pub fn deliver(&self, id: ReservationId, epoch: Epoch, message: Vec<u8>) -> bool {
        self.hand_over(id, epoch, None, |_| Some(Arrived::Message(message)))
    }

    /// Hands a reservation its landing slot, `len` bytes of which a prefill worker wrote
    /// (announced by a completion record). Returns false (and counts a rejection) when no
    /// reservation with that id and epoch is waiting, or its slot is not at `offset`.
    pub fn deliver_landed(&self, id: ReservationId, epoch: Epoch, offset: u64, len: usize) -> bool {
        self.hand_over(id, epoch, Some(offset), |slot| {
            slot.map(|slot| Arrived::Landed { slot, len })
        })
    }

    fn hand_over(
        &self,
        id: ReservationId,
        epoch: Epoch,
        slot_offset: Option<u64>,
        arrived: impl FnOnce(Option<LandingSlot>) -> Option<Arrived>,
    ) -> bool {
        let mut pending = self.pending.lock();
        let matches = pending.get(&id).is_some_and(|w| {
            w.epoch == epoch
                && slot_offset.is_none_or(|o| w.slot.as_ref().is_some_and(|s| s.offset() == o))
        });
        let ok = matches
            && pending.remove(&id).is_some_and(|w| match arrived(w.slot) {
                Some(a) => w.tx.send(a).is_ok(),
                None => false,
            });
        if !ok {
            self.rejected.fetch_add(1, Ordering::Relaxed);
        }
        ok
    }

    /// Lease extensions that reached a waiting reservation.
    pub fn extensions(&self) -> u64 {
        self.extensions.load(Ordering::Relaxed)
    }

    /// Reservations waiting for KV.
    pub fn len(&self) -> usize {
        self.pending.lock().len()
    }

    /// Whether none is waiting.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Messages rejected (unknown reservation or stale epoch).
    pub fn rejected(&self) -> u64 {
        self.rejected.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stale_epochs_and_unknown_ids_are_rejected() {
        let r = Arc::new(Reservations::default());
        let mut p = r.register();
        assert!(!r.deliver(p.id, Epoch(p.epoch.0 + 1), vec![1]));
        assert!(!r.deliver(ReservationId(999), p.epoch, vec![1]));
        assert_eq!(r.rejected(), 2);
        assert!(r.deliver(p.id, p.epoch, vec![7]));
        let got =
            p.kv.try_recv()
                .expect("delivered")
                .into_shared()
                .expect("bytes");
        assert_eq!((*got).as_ref(), &[7u8][..]);
        assert!(!r.deliver(p.id, p.epoch, vec![8]), "delivered only once");
    }

    #[tokio::test]
    async fn extensions_reach_only_a_waiting_reservation_of_their_epoch() {
        let r = Arc::new(Reservations::default());
        let p = r.register();
        assert!(!r.extend(p.id, Epoch(p.epoch.0 + 1)), "stale epoch");
        assert!(!r.extend(ReservationId(999), p.epoch), "unknown id");
        assert!(r.extend(p.id, p.epoch));
        // The notification is kept for the waiter even if it was not yet listening.
        tokio::time::timeout(std::time::Duration::from_secs(5), p.extended.notified())
            .await
            .expect("the waiter hears of the extension");
        assert!(r.deliver(p.id, p.epoch, vec![1]));
        assert!(
            !r.extend(p.id, p.epoch),
            "KV arrived: nothing waits any more"
        );
        assert_eq!(r.rejected(), 0, "extensions are not counted as rejected KV");
        assert_eq!(r.extensions(), 1);
    }

    #[test]
    fn dropping_a_pending_reservation_unregisters_it() {
        let r = Arc::new(Reservations::default());
        let p = r.register();
        let id = p.id;
        assert_eq!(r.len(), 1);
        drop(p);
        assert!(r.is_empty());
        assert!(!r.deliver(id, Epoch(id.0), vec![]));
    }

    #[test]
    fn landing_records_need_the_reservations_own_slot() {
        use tandem_kv::landing::{LandingArena, LandingWriter};
        let arena = LandingArena::create(1 << 20).expect("arena");
        let r = Arc::new(Reservations::default());
        let plain = r.register();
        assert!(
            !r.deliver_landed(plain.id, plain.epoch, 4096, 1),
            "no slot: a landing record cannot be for it"
        );
        let slot = arena.slot(8192).expect("slot");
        let landing = slot.landing();
        let mut p = r.register_with(Some(slot));
        assert!(
            !r.deliver_landed(p.id, p.epoch, landing.offset + 4096, 3),
            "another slot's offset"
        );
        assert!(
            !r.deliver_landed(p.id, Epoch(p.epoch.0 + 1), landing.offset, 3),
            "stale epoch"
        );
        LandingWriter::new().write(&landing, b"kv!").expect("write");
        assert!(r.deliver_landed(p.id, p.epoch, landing.offset, 3));
        let got =
            p.kv.try_recv()
                .expect("delivered")
                .into_shared()
                .expect("bytes");
        assert_eq!((*got).as_ref(), &b"kv!"[..]);
        assert_eq!(r.rejected(), 3);
    }
}
