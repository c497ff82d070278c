//! The KV handoff message a prefill worker sends to a decode worker over the transport: a
//! fixed header (reservation, fencing epoch, first token, tokens covered, the sending model's
//! identity, body size, the manifest's CRC32), a typed manifest saying what each byte range
//! of the body is (segment kind, layer, dtype, shape, for state the shard it came from, and
//! the segment's own CRC32), then the body. The decode side rejects a message whose epoch, size, checksum, model identity or
//! manifest does not match what it reserved and runs, so a stale, corrupted or foreign
//! transfer can never reach the running batch.

use tandem_core::{Epoch, ReservationId};
use tandem_engine::handoff::{dtype_code, dtype_from_code};
pub use tandem_engine::handoff::{Segment, SegmentKind};

const MAGIC: u32 = 0x5456_4B34; // "TVK4": the manifest ends with the other choices' first tokens
/// Bytes of the fixed header (before the manifest).
pub const HEADER_LEN: usize = 4 + 8 + 8 + 4 + 4 + 8 + 8 + 8 + 4;

/// Parsed header of a handoff message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HandoffHeader {
    /// The decode reservation this KV belongs to.
    pub reservation: ReservationId,
    /// The reservation's epoch when the prefill was sent.
    pub epoch: Epoch,
    /// The token the prefill worker sampled.
    pub first_token: u32,
    /// Prompt tokens covered.
    pub num_tokens: u32,
    /// Identity of the sending worker's model (see `crate::identity`).
    pub model_id: u64,
    /// Bytes in the body.
    pub body_len: u64,
    /// CRC32 of the manifest (which holds every segment's CRC32).
    pub checksum: u64,
    /// Segments of the body, in order (empty until [`decode_bytes`] parses them).
    pub segments: Vec<Segment>,
    /// The first tokens of the prompt's other choices (n > 1), in order (empty until
    /// [`decode_bytes`] parses them).
    pub others: Vec<u32>,
}

/// Why a handoff message was rejected.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum HandoffError {
    /// Shorter than a header, wrong magic, or an unreadable manifest.
    #[error("not a KV handoff message")]
    Malformed,
    /// The body's length does not match the header.
    #[error("KV body has {got} bytes, header says {expected}")]
    Truncated {
        /// Bytes the header announced.
        expected: u64,
        /// Bytes present.
        got: u64,
    },
    /// The manifest's checksum does not match the header.
    #[error("KV manifest checksum mismatch")]
    Checksum,
    /// A segment's bytes do not match its checksum.
    #[error("KV segment {index} ({segment}) checksum mismatch")]
    SegmentChecksum {
        /// Its position in the manifest.
        index: usize,
        /// What it holds.
        segment: String,
    },
    /// The manifest's segments do not add up to the body.
    #[error("KV manifest describes {described} bytes, the body has {body}")]
    Manifest {
        /// Bytes the segments describe.
        described: u64,
        /// Bytes in the body.
        body: u64,
    },
}

/// CRC32 (IEEE) of `bytes`, SIMD-accelerated where the CPU has it.
pub fn checksum(bytes: &[u8]) -> u32 {
    crc32fast::hash(bytes)
}

fn encode_manifest(segments: &[Segment], body: &[u8], others: &[u32]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut at = 0usize;
    for s in segments {
        let n = (s.len_bytes() as usize).min(body.len().saturating_sub(at));
        out.push(s.kind.code());
        out.push(dtype_code(s.dtype));
        out.extend_from_slice(&s.layer.to_le_bytes());
        out.extend_from_slice(&s.shard.to_le_bytes());
        out.push(s.shape.len() as u8);
        for d in &s.shape {
            out.extend_from_slice(&d.to_le_bytes());
        }
        out.extend_from_slice(&checksum(&body[at..at + n]).to_le_bytes());
        at += n;
    }
    out.extend_from_slice(&(others.len() as u32).to_le_bytes());
    for t in others {
        out.extend_from_slice(&t.to_le_bytes());
    }
    out
}

/// What a handoff message's header says besides sizes and checksums.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Head {
    /// The decode reservation the KV belongs to.
    pub reservation: ReservationId,
    /// The reservation's epoch when the prefill was sent.
    pub epoch: Epoch,
    /// The token the prefill worker sampled.
    pub first_token: u32,
    /// Prompt tokens covered.
    pub num_tokens: u32,
    /// Identity of the sending worker's model.
    pub model_id: u64,
    /// The first tokens of the prompt's other choices, in order (empty for one).
    pub others: Vec<u32>,
}

/// Serialises a handoff message: header, manifest of `segments`, `body`.
pub fn encode(head: &Head, segments: &[Segment], body: &[u8]) -> Vec<u8> {
    let mut out = encode_head(head, segments, body);
    out.reserve_exact(body.len());
    out.extend_from_slice(body);
    out
}

/// The part of a handoff message before its body (header and manifest, whose checksums
/// cover `body`): the message is these bytes followed by `body`.
pub fn encode_head(head: &Head, segments: &[Segment], body: &[u8]) -> Vec<u8> {
    let manifest = encode_manifest(segments, body, &head.others);
    let sum = u64::from(checksum(&manifest));
    let mut out = Vec::with_capacity(HEADER_LEN + manifest.len());
    out.extend_from_slice(&MAGIC.to_le_bytes());
    out.extend_from_slice(&head.reservation.0.to_le_bytes());
    out.extend_from_slice(&head.epoch.0.to_le_bytes());
    out.extend_from_slice(&head.first_token.to_le_bytes());
    out.extend_from_slice(&head.num_tokens.to_le_bytes());
    out.extend_from_slice(&head.model_id.to_le_bytes());
    out.extend_from_slice(&(body.len() as u64).to_le_bytes());
    out.extend_from_slice(&sum.to_le_bytes());
    out.extend_from_slice(&(segments.len() as u32).to_le_bytes());
    out.extend_from_slice(&manifest);
    out
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(w)
}

/// Reads only the fixed header (cheap; used to route a message to its reservation).
pub fn decode_header(msg: &[u8]) -> Result<HandoffHeader, HandoffError> {
    if msg.len() < HEADER_LEN || u32_at(msg, 0) != MAGIC {
        return Err(HandoffError::Malformed);
    }
    Ok(HandoffHeader {
        reservation: ReservationId(u64_at(msg, 4)),
        epoch: Epoch(u64_at(msg, 12)),
        first_token: u32_at(msg, 20),
        num_tokens: u32_at(msg, 24),
        model_id: u64_at(msg, 28),
        body_len: u64_at(msg, 36),
        checksum: u64_at(msg, 44),
        segments: Vec::new(),
        others: Vec::new(),
    })
}

const LANDED_MAGIC: u32 = 0x5456_4B4C; // "TVKL"
const LANDED_LEN: usize = 4 + 8 + 8 + 8 + 8;

/// The completion record of a handoff written into a shared-memory landing slot: the whole
/// handoff message (as [`encode`] makes it) lies at `offset`, `len` bytes long.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Landed {
    /// The reservation the handoff belongs to.
    pub reservation: ReservationId,
    /// Its epoch when the prefill wrote it.
    pub epoch: Epoch,
    /// The slot's offset in the decode worker's arena.
    pub offset: u64,
    /// Bytes written.
    pub len: u64,
}

/// Serialises a [`Landed`] record.
pub fn encode_landed(l: &Landed) -> Vec<u8> {
    let mut out = Vec::with_capacity(LANDED_LEN);
    out.extend_from_slice(&LANDED_MAGIC.to_le_bytes());
    out.extend_from_slice(&l.reservation.0.to_le_bytes());
    out.extend_from_slice(&l.epoch.0.to_le_bytes());
    out.extend_from_slice(&l.offset.to_le_bytes());
    out.extend_from_slice(&l.len.to_le_bytes());
    out
}

const EXTEND_MAGIC: u32 = 0x5456_4B58; // "TVKX"
const EXTEND_LEN: usize = 4 + 8 + 8;

/// A lease extension for reservation `(id, epoch)`: its prefill is still computing.
pub fn encode_extend(reservation: ReservationId, epoch: Epoch) -> Vec<u8> {
    let mut out = Vec::with_capacity(EXTEND_LEN);
    out.extend_from_slice(&EXTEND_MAGIC.to_le_bytes());
    out.extend_from_slice(&reservation.0.to_le_bytes());
    out.extend_from_slice(&epoch.0.to_le_bytes());
    out
}

/// Parses an [`encode_extend`] record; `None` when `msg` is not one.
pub fn decode_extend(msg: &[u8]) -> Option<(ReservationId, Epoch)> {
    if msg.len() != EXTEND_LEN || u32_at(msg, 0) != EXTEND_MAGIC {
        return None;
    }
    Some((ReservationId(u64_at(msg, 4)), Epoch(u64_at(msg, 12))))
}

/// Parses a [`Landed`] record; `None` when `msg` is not one (e.g. a whole handoff message).
pub fn decode_landed(msg: &[u8]) -> Option<Landed> {
    if msg.len() != LANDED_LEN || u32_at(msg, 0) != LANDED_MAGIC {
        return None;
    }
    Some(Landed {
        reservation: ReservationId(u64_at(msg, 4)),
        epoch: Epoch(u64_at(msg, 12)),
        offset: u64_at(msg, 20),
        len: u64_at(msg, 28),
    })
}

/// Checks a whole message and returns its header (with the manifest) and body bytes.
pub fn decode_bytes(msg: &[u8]) -> Result<(HandoffHeader, &[u8]), HandoffError> {
    let mut header = decode_header(msg)?;
    let count = u32_at(msg, 52) as usize;
    let mut at = HEADER_LEN;
    let mut segments = Vec::with_capacity(count.min(1 << 16));
    let mut crcs = Vec::with_capacity(count.min(1 << 16));
    for _ in 0..count {
        if msg.len() < at + 11 {
            return Err(HandoffError::Malformed);
        }
        let kind = SegmentKind::from_code(msg[at]).ok_or(HandoffError::Malformed)?;
        let dtype = dtype_from_code(msg[at + 1]).ok_or(HandoffError::Malformed)?;
        let layer = u32_at(msg, at + 2);
        let shard = u32_at(msg, at + 6);
        let ndim = msg[at + 10] as usize;
        at += 11;
        if msg.len() < at + 4 * ndim {
            return Err(HandoffError::Malformed);
        }
        if msg.len() < at + 4 * ndim + 4 {
            return Err(HandoffError::Malformed);
        }
        let shape = (0..ndim).map(|d| u32_at(msg, at + 4 * d)).collect();
        at += 4 * ndim;
        crcs.push(u32_at(msg, at));
        at += 4;
        segments.push(Segment {
            kind,
            layer,
            shard,
            dtype,
            shape,
        });
    }
    if msg.len() < at + 4 {
        return Err(HandoffError::Malformed);
    }
    let choices = u32_at(msg, at) as usize;
    at += 4;
    if choices > 1 << 16 || msg.len() < at + 4 * choices {
        return Err(HandoffError::Malformed);
    }
    let others = (0..choices).map(|j| u32_at(msg, at + 4 * j)).collect();
    at += 4 * choices;
    let (manifest, body) = msg[HEADER_LEN..].split_at(at - HEADER_LEN);
    if body.len() as u64 != header.body_len {
        return Err(HandoffError::Truncated {
            expected: header.body_len,
            got: body.len() as u64,
        });
    }
    if u64::from(checksum(manifest)) != header.checksum {
        return Err(HandoffError::Checksum);
    }
    let described: u64 = segments.iter().map(Segment::len_bytes).sum();
    if described != header.body_len {
        return Err(HandoffError::Manifest {
            described,
            body: header.body_len,
        });
    }
    let mut from = 0usize;
    for (index, (s, &crc)) in segments.iter().zip(&crcs).enumerate() {
        let n = s.len_bytes() as usize;
        if checksum(&body[from..from + n]) != crc {
            return Err(HandoffError::SegmentChecksum {
                index,
                segment: s.describe(),
            });
        }
        from += n;
    }
    header.segments = segments;
    header.others = others;
    Ok((header, body))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_engine::DType;

    fn head(
        reservation: u64,
        epoch: u64,
        first_token: u32,
        num_tokens: u32,
        model_id: u64,
    ) -> Head {
        Head {
            reservation: ReservationId(reservation),
            epoch: Epoch(epoch),
            first_token,
            num_tokens,
            model_id,
            others: Vec::new(),
        }
    }

    #[test]
    fn landed_records_round_trip_and_are_not_handoffs() {
        let l = Landed {
            reservation: ReservationId(9),
            epoch: Epoch(4),
            offset: 8192,
            len: 1 << 30,
        };
        let bytes = encode_landed(&l);
        assert_eq!(decode_landed(&bytes), Some(l));
        let x = encode_extend(ReservationId(7), Epoch(9));
        assert_eq!(decode_extend(&x), Some((ReservationId(7), Epoch(9))));
        assert_eq!(
            decode_extend(&bytes),
            None,
            "a landing record is no extension"
        );
        assert_eq!(decode_landed(&x), None, "an extension is no landing record");
        assert_eq!(decode_header(&bytes), Err(HandoffError::Malformed));
        let handoff = encode(&head(9, 4, 1, 1, 7), &[], &[]);
        assert_eq!(decode_landed(&handoff), None);
        assert_eq!(decode_landed(&bytes[..bytes.len() - 1]), None);
    }

    fn kv_segments(layers: u32, tokens: u32, kv_dim: u32, dtype: DType) -> Vec<Segment> {
        (0..layers)
            .map(|layer| Segment {
                kind: SegmentKind::KvLayer,
                layer,
                shard: 0,
                dtype,
                shape: vec![2, tokens, kv_dim],
            })
            .collect()
    }

    #[test]
    fn round_trip_with_manifest() {
        let segs = kv_segments(3, 5, 8, DType::BF16);
        let body: Vec<u8> = (0..3 * 2 * 5 * 8 * 2).map(|i| i as u8).collect();
        let msg = encode(&head(9, 4, 77, 5, 0xabc), &segs, &body);
        let (h, back) = decode_bytes(&msg).expect("valid message");
        assert_eq!(h.reservation, ReservationId(9));
        assert_eq!(h.epoch, Epoch(4));
        assert_eq!((h.first_token, h.num_tokens, h.model_id), (77, 5, 0xabc));
        assert_eq!(h.segments, segs);
        assert!(h.others.is_empty());
        assert_eq!(back, &body[..]);
        assert_eq!(
            decode_header(&msg).expect("header").reservation,
            ReservationId(9)
        );
        // Several choices: their first tokens travel in the manifest, under its checksum.
        let choices = Head {
            others: vec![5, 6, 7],
            ..head(9, 4, 77, 5, 0xabc)
        };
        let mut msg = encode(&choices, &segs, &body);
        let (h, back) = decode_bytes(&msg).expect("valid message");
        assert_eq!((h.first_token, h.others), (77, vec![5, 6, 7]));
        assert_eq!(back, &body[..]);
        let at = msg.len() - body.len() - 4;
        msg[at] ^= 1;
        assert_eq!(decode_bytes(&msg).err(), Some(HandoffError::Checksum));
    }

    #[test]
    fn corruption_truncation_and_bad_manifests_are_caught() {
        let segs = kv_segments(2, 1, 16, DType::F32);
        let body = vec![7u8; 2 * 2 * 16 * 4];
        let mut msg = encode(&head(1, 1, 0, 1, 1), &segs, &body);
        let last = msg.len() - 1;
        msg[last] ^= 0x40;
        match decode_bytes(&msg) {
            Err(HandoffError::SegmentChecksum { index, segment }) => {
                assert_eq!(index, 1, "the corrupted byte is in the last segment");
                assert!(segment.contains("layer 1"), "{segment}");
            }
            other => panic!("a flipped body byte gave {other:?}"),
        }
        msg.truncate(last);
        assert!(matches!(
            decode_bytes(&msg),
            Err(HandoffError::Truncated { .. })
        ));
        assert_eq!(
            decode_bytes(&msg[..10]).map(|_| ()),
            Err(HandoffError::Malformed)
        );
        // A manifest that describes less than the body.
        let short = kv_segments(1, 1, 16, DType::F32);
        let msg = encode(&head(1, 1, 0, 1, 1), &short, &body);
        assert!(matches!(
            decode_bytes(&msg),
            Err(HandoffError::Manifest { .. })
        ));
        // A flipped manifest byte (the layer) breaks the checksum.
        let mut msg = encode(&head(1, 1, 0, 1, 1), &segs, &body);
        msg[HEADER_LEN + 2] ^= 1;
        assert_eq!(decode_bytes(&msg).map(|_| ()), Err(HandoffError::Checksum));
    }
}
