//! Prefix-cache block identity: each full block of a token sequence is named by a hash chained
//! through every block before it, so equal hashes mean equal prefixes. The hash is tandem's own
//! (FNV-1a over little-endian words, then a 64-bit finaliser), stable across processes and
//! releases, so workers and the router agree on it.

/// What else changes a block's contents besides its tokens (the model, an adapter): mixed
/// into the first block's hash, so different salts never share a block.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct CacheSalt(pub u64);

impl CacheSalt {
    /// The salt of a text naming everything the blocks depend on (a model's identity).
    pub fn of(text: &str) -> Self {
        let mut h = Fnv::new();
        for b in text.bytes() {
            h.byte(b);
        }
        Self(h.finish())
    }
}

struct Fnv(u64);

impl Fnv {
    fn new() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }

    fn byte(&mut self, b: u8) {
        self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }

    fn word(&mut self, w: u64) {
        for b in w.to_le_bytes() {
            self.byte(b);
        }
    }

    /// The state through a 64-bit avalanche finaliser (FNV alone mixes its last bytes
    /// weakly).
    fn finish(&self) -> u64 {
        let mut x = self.0;
        x ^= x >> 33;
        x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
        x ^= x >> 33;
        x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
        x ^ (x >> 33)
    }
}

/// The hashes of the full `block_size`-token blocks of `tokens` (a trailing partial block has
/// none), each chained through the ones before it and `salt`.
pub fn block_hashes(tokens: &[u32], block_size: usize, salt: CacheSalt) -> Vec<u64> {
    let mut parent = salt.0;
    tokens
        .chunks_exact(block_size.max(1))
        .map(|block| {
            let mut h = Fnv::new();
            h.word(parent);
            h.word(block.len() as u64);
            for &t in block {
                h.word(u64::from(t));
            }
            parent = h.finish();
            parent
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_hash_names_its_whole_prefix_and_salt() {
        let a: Vec<u32> = (0..40).collect();
        let salt = CacheSalt::of("model-a");
        let h = block_hashes(&a, 16, salt);
        assert_eq!(h.len(), 2, "the partial third block has no hash");
        let mut b = a.clone();
        b[3] = 999;
        let hb = block_hashes(&b, 16, salt);
        assert_ne!(h[0], hb[0]);
        assert_ne!(h[1], hb[1], "a change in block 0 changes every later hash");
        let mut c = a.clone();
        c[20] = 999;
        assert_eq!(
            block_hashes(&c, 16, salt)[0],
            h[0],
            "later tokens leave earlier blocks"
        );
        assert_ne!(block_hashes(&a, 16, CacheSalt::of("model-b")), h);
        assert_eq!(
            block_hashes(&a[..32], 16, salt),
            h,
            "the same prefix, the same hashes"
        );
    }

    #[test]
    fn the_hash_is_pinned() {
        // Workers and the router compare hashes (and may run different builds): these values,
        // computed independently from the definition above, must not change.
        assert_eq!(
            block_hashes(&[1, 2, 3, 4], 2, CacheSalt(0)),
            [0x52b9_ae00_21df_568d, 0x6cc4_92b3_6e03_07da]
        );
    }
}
