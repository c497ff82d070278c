//! Request-state slots: every attention-DP group's states are allocated once at start-up
//! (one state per rank of the group per slot) and reused, zeroed, request after request; a
//! request's MLA latent blocks are bound from the claim its reservation made.

use crate::backend::latents::Claim;
use crate::backend::Ops;
use crate::models::kda_hybrid::{KdaHybridState, LayerState};
use crate::tensor::HostTensor;
use crate::{Error, Result};

/// Zeroes a state for its next request: KDA state and conv windows to 0 (in place: the
/// buffers keep their addresses), MLA latents (and their blocks) released.
pub(crate) fn reset_state<B: Ops>(backend: &B, st: &mut KdaHybridState<B>) -> Result<()> {
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
                    let zeros = HostTensor::from_f32(v.shape(), vec![0.0; v.len()])?;
                    backend.overwrite(v, &zeros)?;
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
    Ok(())
}

/// Binds the latent blocks `tokens` tokens need in every MLA layer of `states` out of
/// `claim` (made for exactly that by the reservation).
pub(crate) fn bind_latents<B: Ops>(
    states: &mut [KdaHybridState<B>],
    tokens: usize,
    claim: &mut Claim,
) -> Result<()> {
    for st in states.iter_mut() {
        for layer in &mut st.layers {
            if let LayerState::Mla(m) = layer {
                if !m.reserve_from(tokens, claim) {
                    return Err(Error::InvalidRequest(
                        "the reservation's latent blocks do not cover the request".into(),
                    ));
                }
            }
        }
    }
    Ok(())
}

/// Latent row sets one request of `states` (a group's fresh states) fills: every MLA
/// layer's latent and rope rows of non-zero width, on every rank of the group.
pub(crate) fn latent_sets<B: Ops>(states: &[KdaHybridState<B>]) -> usize {
    states
        .iter()
        .flat_map(|st| &st.layers)
        .map(|l| match l {
            LayerState::Mla(m) => {
                usize::from(m.kv_latent.width() > 0) + usize::from(m.k_rope.width() > 0)
            }
            LayerState::Kda(_) => 0,
        })
        .sum()
}
