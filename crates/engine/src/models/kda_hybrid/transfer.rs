//! Moving one request's state from a prefill layout to a decode layout with a
//! [`TransferPlan`]: KDA recurrent state by heads, KDA conv windows per q/k/v block by
//! channels (never as one concatenated block: with different attention-TP sizes the rows of a
//! concatenated window would land in the wrong block), the replicated MLA latent once per
//! decode rank. In-process here; across machines the same plan drives the transport.

use super::model::{KdaHybridState, LayerState};
use std::ops::Range;
use tandem_topology::{ConvBlock, TransferKind, TransferPlan};

/// Copies `len`-wide units `src` of `from` into units `dst` of `to`.
fn copy_units(from: &[f32], to: &mut [f32], src: &Range<usize>, dst: &Range<usize>, len: usize) {
    to[dst.start * len..dst.end * len].copy_from_slice(&from[src.start * len..src.end * len]);
}

/// Applies `plan`: `prefill[r]` is prefill rank `r`'s state of the request, `decode[r]` decode
/// rank `r`'s state (fresh, from its model's `new_state`), for every rank of both sides.
/// `head_dim` and `conv_kernel` are the KDA layers' `D` and `W`.
///
/// # Panics
/// If the states do not have the plan's layouts (wrong rank count, layer kinds, or sizes).
pub fn apply_transfer_plan(
    plan: &TransferPlan,
    prefill: &[KdaHybridState],
    decode: &mut [KdaHybridState],
    head_dim: usize,
    conv_kernel: usize,
) {
    let hist = conv_kernel - 1;
    for t in plan.transfers() {
        let from = &prefill[t.from_prefill_rank.0];
        let to = &mut decode[t.to_decode_rank.0];
        to.tokens = from.tokens;
        for (src, dst) in from.layers.iter().zip(to.layers.iter_mut()) {
            match (&t.kind, src, dst) {
                (TransferKind::KdaState { .. }, LayerState::Kda(s), LayerState::Kda(d)) => {
                    copy_units(
                        s.recurrent.f32s(),
                        d.recurrent.f32s_mut(),
                        &t.src_range,
                        &t.dst_range,
                        head_dim * head_dim,
                    );
                }
                (TransferKind::KdaConv { block, .. }, LayerState::Kda(s), LayerState::Kda(d)) => {
                    let (sb, db) = match block {
                        ConvBlock::Q => (&s.conv.q, &mut d.conv.q),
                        ConvBlock::K => (&s.conv.k, &mut d.conv.k),
                        ConvBlock::V => (&s.conv.v, &mut d.conv.v),
                    };
                    copy_units(sb.f32s(), db.f32s_mut(), &t.src_range, &t.dst_range, hist);
                }
                (TransferKind::MlaLatent, LayerState::Mla(s), LayerState::Mla(d)) => {
                    *d = s.clone();
                }
                _ => {}
            }
        }
    }
}
