//! Request-state slots: each attention-DP group's states are allocated once at start-up and
//! reused (zeroed) request after request; MLA latent blocks are reserved from the paged pool
//! at admission.

use crate::kda_hybrid::{KdaHybridState, LatentPool, LayerState};
use crate::kv_pool::BlockAllocation;
use crate::{Error, Result};
use std::sync::Arc;

/// Takes the MLA latent blocks `tokens` tokens need in every MLA layer of `states`, from the
/// paged pool; on failure the caller drops the states, which returns what was taken.
pub(crate) fn reserve_latents(
    states: &mut [KdaHybridState],
    tokens: usize,
    pool: &LatentPool,
) -> Result<()> {
    let short = |st: &KdaHybridState| -> usize {
        st.layers
            .iter()
            .map(|l| match l {
                LayerState::Mla(m) => m.blocks_short(tokens),
                LayerState::Kda(_) => 0,
            })
            .sum()
    };
    // Every MLA layer of every rank draws on the one pool: the whole need is claimed at once
    // (all or nothing, so concurrent admissions cannot each take part and both fail), and
    // the error names it.
    let needed: usize = states.iter().map(short).sum();
    let Some(mut claim) = pool.claim(needed) else {
        return Err(Error::CapacityExhausted {
            needed,
            free: pool.free().unwrap_or(0),
        });
    };
    for st in states.iter_mut() {
        for layer in &mut st.layers {
            if let LayerState::Mla(m) = layer {
                if !m.reserve_from(tokens, &mut claim) {
                    return Err(Error::InvalidRequest(
                        "a state's latent rows are not on the worker's pool".into(),
                    ));
                }
            }
        }
    }
    Ok(())
}

/// Preallocated request states of one attention-DP group (one state per rank of the group
/// per slot), reused request after request.
pub(crate) type StateFreeList = Arc<parking_lot::Mutex<Vec<Vec<KdaHybridState>>>>;

/// Zeroes a state for its next request: KDA state and conv windows to 0, MLA latents (and
/// their blocks) released.
fn reset_state(st: &mut KdaHybridState) {
    st.tokens = 0;
    for layer in &mut st.layers {
        match layer {
            LayerState::Kda(k) => {
                for v in [
                    &mut k.recurrent,
                    &mut k.conv.q,
                    &mut k.conv.k,
                    &mut k.conv.v,
                ] {
                    v.fill(0.0);
                }
            }
            LayerState::Mla(m) => {
                m.kv_latent.clear();
                m.k_rope.clear();
                if let Some(ix) = m.indexer.as_mut() {
                    ix.keys.clear();
                    ix.pool_gate.clear();
                }
            }
        }
    }
}

/// Copies `src` into `dst` (same model and layout), reusing `dst`'s buffers.
pub(crate) fn overwrite_state(dst: &mut KdaHybridState, src: &KdaHybridState) -> Result<()> {
    dst.tokens = src.tokens;
    for (d, s) in dst.layers.iter_mut().zip(&src.layers) {
        match (d, s) {
            (LayerState::Kda(d), LayerState::Kda(s)) => {
                for (dv, sv) in [
                    (&mut d.recurrent, &s.recurrent),
                    (&mut d.conv.q, &s.conv.q),
                    (&mut d.conv.k, &s.conv.k),
                    (&mut d.conv.v, &s.conv.v),
                ] {
                    if dv.len() != sv.len() {
                        return Err(Error::InvalidRequest(
                            "KDA state sizes differ from the slot's".into(),
                        ));
                    }
                    dv.copy_from_slice(sv);
                }
            }
            (LayerState::Mla(d), LayerState::Mla(s)) => {
                // Rewind, not clear: the blocks reserved at admission stay with the request.
                d.kv_latent.rewind();
                d.kv_latent.extend_from_slice(&s.kv_latent.to_vec());
                d.k_rope.rewind();
                d.k_rope.extend_from_slice(&s.k_rope.to_vec());
                d.indexer.clone_from(&s.indexer);
            }
            _ => {
                return Err(Error::InvalidRequest(
                    "state layer kinds differ from the slot's".into(),
                ))
            }
        }
    }
    Ok(())
}

/// A reserved state slot on one attention-DP group: owns the slot's preallocated states while
/// the request runs and hands them back, zeroed, when dropped.
#[derive(Debug)]
pub struct GroupSlot {
    /// The group.
    pub group: usize,
    pub(crate) states: Option<Vec<KdaHybridState>>,
    pub(crate) free_list: StateFreeList,
    pub(crate) _slot: BlockAllocation,
    pub(crate) _total: BlockAllocation,
}

impl GroupSlot {
    pub(crate) fn take_states(&mut self) -> Vec<KdaHybridState> {
        self.states.take().unwrap_or_default()
    }

    pub(crate) fn put_states(&mut self, states: Vec<KdaHybridState>) {
        self.states = Some(states);
    }
}

impl Drop for GroupSlot {
    fn drop(&mut self) {
        // An empty set means the states were lost on a failure path; the pool then allocates
        // a replacement on demand rather than ever handing out a wrong-sized set.
        if let Some(mut states) = self.states.take().filter(|s| !s.is_empty()) {
            states.iter_mut().for_each(reset_state);
            self.free_list.lock().push(states);
        }
    }
}
