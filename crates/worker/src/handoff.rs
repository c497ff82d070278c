//! The KV handoff message a prefill worker sends to a decode worker over the transport:
//! a fixed header (reservation, fencing epoch, first token, sizes, checksum) followed by the
//! prompt's K/V as little-endian f32 in the transfer layout `[layer][k, v][token][kv_dim]`.
//! The decode side rejects a message whose epoch, size or checksum does not match what it
//! reserved, so a stale or corrupted transfer can never reach the running batch.

use tandem_core::{Epoch, ReservationId};

const MAGIC: u32 = 0x5456_4B31; // "TVK1"
/// Bytes of the fixed header.
pub const HEADER_LEN: usize = 4 + 8 + 8 + 4 + 4 + 8 + 8;

/// Parsed header of a handoff message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HandoffHeader {
    /// The decode reservation this KV belongs to.
    pub reservation: ReservationId,
    /// The reservation's epoch when the prefill was sent.
    pub epoch: Epoch,
    /// The token the prefill worker sampled.
    pub first_token: u32,
    /// Prompt tokens covered.
    pub num_tokens: u32,
    /// Floats in the body.
    pub num_floats: u64,
    /// FNV-1a 64 of the body bytes.
    pub checksum: u64,
}

/// Why a handoff message was rejected.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum HandoffError {
    /// Shorter than a header, or wrong magic.
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
    /// The body's checksum does not match the header.
    #[error("KV checksum mismatch")]
    Checksum,
}

/// FNV-1a, 64 bit: cheap and good enough to catch torn or misdirected transfers.
pub fn checksum(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for chunk in bytes.chunks(8) {
        for &b in chunk {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

/// Serialises a handoff message whose body is K/V floats.
pub fn encode(
    reservation: ReservationId,
    epoch: Epoch,
    first_token: u32,
    num_tokens: u32,
    kv: &[f32],
) -> Vec<u8> {
    encode_bytes(
        reservation,
        epoch,
        first_token,
        num_tokens,
        bytemuck::cast_slice(kv),
    )
}

/// Serialises a handoff message with an opaque body (a whole number of 4-byte words).
pub fn encode_bytes(
    reservation: ReservationId,
    epoch: Epoch,
    first_token: u32,
    num_tokens: u32,
    body: &[u8],
) -> Vec<u8> {
    debug_assert_eq!(body.len() % 4, 0, "handoff bodies are whole 4-byte words");
    let kv_len = body.len() / 4;
    let mut out = Vec::with_capacity(HEADER_LEN + body.len());
    out.extend_from_slice(&MAGIC.to_le_bytes());
    out.extend_from_slice(&reservation.0.to_le_bytes());
    out.extend_from_slice(&epoch.0.to_le_bytes());
    out.extend_from_slice(&first_token.to_le_bytes());
    out.extend_from_slice(&num_tokens.to_le_bytes());
    out.extend_from_slice(&(kv_len as u64).to_le_bytes());
    out.extend_from_slice(&checksum(body).to_le_bytes());
    out.extend_from_slice(body);
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

/// Reads only the header (cheap; used to route a message to its reservation).
pub fn decode_header(msg: &[u8]) -> Result<HandoffHeader, HandoffError> {
    if msg.len() < HEADER_LEN || u32_at(msg, 0) != MAGIC {
        return Err(HandoffError::Malformed);
    }
    Ok(HandoffHeader {
        reservation: ReservationId(u64_at(msg, 4)),
        epoch: Epoch(u64_at(msg, 12)),
        first_token: u32_at(msg, 20),
        num_tokens: u32_at(msg, 24),
        num_floats: u64_at(msg, 28),
        checksum: u64_at(msg, 36),
    })
}

/// Checks a whole message and returns its header and body bytes.
pub fn decode_bytes(msg: &[u8]) -> Result<(HandoffHeader, &[u8]), HandoffError> {
    let header = decode_header(msg)?;
    let body = &msg[HEADER_LEN..];
    let expected = header.num_floats.saturating_mul(4);
    if body.len() as u64 != expected {
        return Err(HandoffError::Truncated {
            expected,
            got: body.len() as u64,
        });
    }
    if checksum(body) != header.checksum {
        return Err(HandoffError::Checksum);
    }
    Ok((header, body))
}

/// Checks a whole message and returns its header and K/V floats.
pub fn decode(msg: &[u8]) -> Result<(HandoffHeader, Vec<f32>), HandoffError> {
    let (header, body) = decode_bytes(msg)?;
    let kv = body
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    Ok((header, kv))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let kv: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5 - 3.0).collect();
        let msg = encode(ReservationId(9), Epoch(4), 77, 5, &kv);
        let (h, back) = decode(&msg).expect("valid message");
        assert_eq!(h.reservation, ReservationId(9));
        assert_eq!(h.epoch, Epoch(4));
        assert_eq!((h.first_token, h.num_tokens, h.num_floats), (77, 5, 1000));
        assert_eq!(back, kv);
    }

    #[test]
    fn corruption_and_truncation_are_caught() {
        let kv = vec![1.0f32; 64];
        let mut msg = encode(ReservationId(1), Epoch(1), 0, 1, &kv);
        let last = msg.len() - 1;
        msg[last] ^= 0x40;
        assert_eq!(decode(&msg), Err(HandoffError::Checksum));
        msg.truncate(last);
        assert!(matches!(decode(&msg), Err(HandoffError::Truncated { .. })));
        assert_eq!(decode(&msg[..10]), Err(HandoffError::Malformed));
    }
}
