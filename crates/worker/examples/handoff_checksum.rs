//! What integrity costs a handoff: encoding (per-segment CRC32 into the manifest) and
//! decoding (every segment verified) of a K/V-shaped body, against a plain copy of the same
//! bytes in the same run. `cargo run --release -p tandem-worker --example handoff_checksum
//! [-- MIB]`.

use std::time::Instant;
use tandem_core::{Epoch, ReservationId};
use tandem_engine::{DType, Segment, SegmentKind};
use tandem_worker::handoff::{decode_bytes, encode, Head};

fn main() {
    let mib: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(256);
    // 32 layers of [2][tokens][kv_dim] bf16: a long prompt's K/V.
    let (layers, kv_dim) = (32u32, 1024u32);
    let tokens = ((mib << 20) / (layers as usize * 2 * kv_dim as usize * 2)) as u32;
    let segments: Vec<Segment> = (0..layers)
        .map(|layer| Segment {
            kind: SegmentKind::KvLayer,
            layer,
            shard: 0,
            dtype: DType::BF16,
            shape: vec![2, tokens, kv_dim],
        })
        .collect();
    let len: u64 = segments.iter().map(Segment::len_bytes).sum();
    let body: Vec<u8> = (0..len)
        .map(|i| ((i * 2_654_435_761) >> 13) as u8)
        .collect();
    let gib = len as f64 / f64::from(1 << 30);
    let best = |f: &mut dyn FnMut()| {
        (0..5)
            .map(|_| {
                let t = Instant::now();
                f();
                t.elapsed().as_secs_f64()
            })
            .fold(f64::INFINITY, f64::min)
    };
    let mut copy = Vec::new();
    let t_copy = best(&mut || copy = std::hint::black_box(body.clone()));
    let mut msg = Vec::new();
    let t_encode = best(&mut || {
        let head = Head {
            reservation: ReservationId(1),
            epoch: Epoch(1),
            first_token: 7,
            num_tokens: tokens,
            model_id: 42,
            others: Vec::new(),
        };
        msg = encode(&head, &segments, &body);
    });
    let t_decode = best(&mut || {
        let (h, b) = decode_bytes(&msg).expect("valid");
        std::hint::black_box((h, b.len()));
    });
    // The checksum the handoff used before (FNV-1a 64, a byte at a time), for comparison.
    let t_fnv = best(&mut || {
        let mut h = 0xcbf2_9ce4_8422_2325u64;
        for &b in &body {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        std::hint::black_box(h);
    });
    let t_crc = best(&mut || {
        std::hint::black_box(crc32fast::hash(&body));
    });
    println!("handoff of {len} bytes ({layers} segments), best of 5, one thread:");
    println!("  CRC32 (crc32fast)   : {:7.2} GiB/s", gib / t_crc);
    println!(
        "  FNV-1a 64 (before)  : {:7.2} GiB/s  ({:.1}x CRC32's time)",
        gib / t_fnv,
        t_fnv / t_crc
    );
    println!("  plain copy          : {:7.2} GiB/s", gib / t_copy);
    println!(
        "  encode (CRC32 each) : {:7.2} GiB/s  ({:.2}x the copy's time)",
        gib / t_encode,
        t_encode / t_copy
    );
    println!(
        "  decode + verify     : {:7.2} GiB/s  ({:.2}x the copy's time)",
        gib / t_decode,
        t_decode / t_copy
    );
}
