//! The handoff of a KDA-hybrid request as typed segments: the sender's layout, then per
//! attention-TP rank of its group and per layer the KDA recurrent state and conv windows,
//! and the MLA latents (replicated over attention TP, so sent once, by rank 0). On receipt
//! every segment is checked against the receiving model and the state resharded to the
//! decode group's ranks.

use crate::backend::latents::LatentPool;
use crate::backend::{CpuBackend, Ops};
use crate::handoff::{Handoff, SegmentKind, SegmentReader};
use crate::models::kda_hybrid::sharded::model_shape;
use crate::models::kda_hybrid::{
    apply_transfer_plan, ConvWindow, KdaHybridConfig, KdaHybridState, KdaState, LayerState,
};
use crate::served::{HandoffSpec, Reservation};
use crate::tensor::{DType, HostTensor};
use crate::{Error, Result};
use tandem_topology::{Layout, TransferPlan};

/// The handoff of one attention-DP group's states (`states[k]` on attention-TP rank `k`, on
/// `backends[k]`) sent from `layout`; `head_dim` shapes the KDA state segments.
pub(crate) fn encode_group<B: Ops>(
    backends: &[B],
    layout: Layout,
    states: &[KdaHybridState<B>],
    head_dim: usize,
) -> Handoff {
    let mut h = Handoff::default();
    let dims = vec![layout.tp() as u32, layout.dp() as u32, layout.ep() as u32];
    h.push(SegmentKind::Layout, 0, 0, &HostTensor::from_u32(dims));
    for (k, (st, backend)) in states.iter().zip(backends).enumerate() {
        for (li, layer) in st.layers.iter().enumerate() {
            match layer {
                LayerState::Kda(s) => {
                    let heads = s.recurrent.len() / (head_dim * head_dim).max(1);
                    h.push_f32(
                        SegmentKind::KdaRecurrent,
                        li,
                        k,
                        &[heads, head_dim, head_dim],
                        &backend.download(&s.recurrent).to_f32_vec(),
                    );
                    let w = s.conv.q.len();
                    let conv: Vec<f32> = [&s.conv.q, &s.conv.k, &s.conv.v]
                        .into_iter()
                        .flat_map(|t| backend.download(t).to_f32_vec())
                        .collect();
                    h.push_f32(SegmentKind::KdaConv, li, k, &[3, w], &conv);
                }
                // MLA latents are replicated across attention TP: only rank 0 sends them.
                LayerState::Mla(m) if k == 0 => {
                    for (kind, rows) in [
                        (SegmentKind::MlaLatent, &m.kv_latent),
                        (SegmentKind::MlaRope, &m.k_rope),
                    ] {
                        h.push_f32(kind, li, 0, &[rows.rows(), rows.width()], &rows.to_vec());
                    }
                    if let Some(ix) = &m.indexer {
                        for (kind, rows) in [
                            (SegmentKind::IndexerKeys, &ix.keys),
                            (SegmentKind::IndexerGate, &ix.pool_gate),
                        ] {
                            h.push_f32(kind, li, 0, &[rows.len()], &rows.to_vec());
                        }
                    }
                }
                LayerState::Mla(_) => {}
            }
        }
    }
    h
}

/// The sender's layout, the first segment.
fn read_layout(r: &mut SegmentReader<'_>) -> Result<Layout> {
    let (_, bytes) = r.next(SegmentKind::Layout, 0, 0, DType::U32, Some(3))?;
    let d: Vec<usize> = bytes
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as usize)
        .collect();
    Layout::new(d[0], d[1], d[2]).map_err(|e| Error::InvalidRequest(format!("sender layout: {e}")))
}

/// Fills `states` (one per attention-TP rank of the sending group, shaped like the
/// sender's) from the rest of a handoff for `tokens` prompt tokens, checking each segment;
/// every rank gets its replica of rank 0's MLA latents. MLA rows keep the blocks they hold.
fn read_group<B: Ops>(
    backends: &[B],
    r: &mut SegmentReader<'_>,
    states: &mut [KdaHybridState<B>],
    tokens: usize,
) -> Result<()> {
    for (k, (st, backend)) in states.iter_mut().zip(backends).enumerate() {
        // Overwritten in place: the state's buffers keep their addresses.
        let put = |t: &mut crate::tensor::Tensor<B>, values: &[f32]| -> Result<()> {
            backend.overwrite(t, &HostTensor::from_f32(t.shape(), values.to_vec())?)
        };
        st.tokens = tokens;
        for (li, layer) in st.layers.iter_mut().enumerate() {
            match layer {
                LayerState::Kda(s) => {
                    let rec = r.f32s(SegmentKind::KdaRecurrent, li, k, Some(s.recurrent.len()))?;
                    put(&mut s.recurrent, &rec)?;
                    let w = s.conv.q.len();
                    let conv = r.f32s(SegmentKind::KdaConv, li, k, Some(3 * w))?;
                    put(&mut s.conv.q, &conv[..w])?;
                    put(&mut s.conv.k, &conv[w..2 * w])?;
                    put(&mut s.conv.v, &conv[2 * w..])?;
                }
                LayerState::Mla(m) if k == 0 => {
                    for (kind, rows) in [
                        (SegmentKind::MlaLatent, &mut m.kv_latent),
                        (SegmentKind::MlaRope, &mut m.k_rope),
                    ] {
                        let data = r.f32s(kind, li, 0, Some(tokens * rows.width()))?;
                        rows.rewind();
                        rows.extend_from_slice(&data);
                    }
                    if let Some(ix) = m.indexer.as_mut() {
                        for (kind, rows) in [
                            (SegmentKind::IndexerKeys, &mut ix.keys),
                            (SegmentKind::IndexerGate, &mut ix.pool_gate),
                        ] {
                            let data = r.f32s(kind, li, 0, Some(tokens * rows.width()))?;
                            rows.rewind();
                            rows.extend_from_slice(&data);
                        }
                    }
                }
                LayerState::Mla(_) => {}
            }
        }
    }
    if let Some((first, rest)) = states.split_first_mut() {
        for st in rest {
            for (dst, src) in st.layers.iter_mut().zip(&first.layers) {
                if let (LayerState::Mla(d), LayerState::Mla(s)) = (dst, src) {
                    // Rewritten through the host: each rank's blocks stay on its own backend.
                    let mut pairs =
                        vec![(&mut d.kv_latent, &s.kv_latent), (&mut d.k_rope, &s.k_rope)];
                    if let (Some(di), Some(si)) = (d.indexer.as_mut(), s.indexer.as_ref()) {
                        pairs.push((&mut di.keys, &si.keys));
                        pairs.push((&mut di.pool_gate, &si.pool_gate));
                    }
                    for (d, s) in pairs {
                        d.rewind();
                        d.extend_from_slice(&s.to_vec());
                    }
                }
            }
        }
    }
    Ok(())
}

/// Writes a handoff already in this group's layout (see [`KdaHandoffSpec`]) into the
/// group's slot states.
pub(crate) fn import_group<B: Ops>(
    backends: &[B],
    h: &Handoff,
    states: &mut [KdaHybridState<B>],
    tokens: usize,
) -> Result<()> {
    let mut r = SegmentReader::new(h)?;
    read_layout(&mut r)?;
    read_group(backends, &mut r, states, tokens)?;
    r.finish()
}

/// The CPU backend for each of `n` host states.
fn host_backends(n: usize) -> Vec<CpuBackend> {
    vec![CpuBackend::new(); n]
}

/// A host (CPU) copy of a state on `backend`, its MLA latent rows on a scratch pool (see
/// [`on_scratch`]): what handoff templates and resharding work on.
pub(crate) fn host_copy<B: Ops>(backend: &B, st: &KdaHybridState<B>) -> KdaHybridState {
    let host = |t: &crate::tensor::Tensor<B>| {
        crate::tensor::Tensor::from_f32s(t.shape(), backend.download(t).to_f32_vec())
    };
    let scratch = LatentPool::default();
    let layers = st
        .layers
        .iter()
        .map(|layer| match layer {
            LayerState::Kda(k) => LayerState::Kda(KdaState {
                recurrent: host(&k.recurrent),
                conv: ConvWindow {
                    q: host(&k.conv.q),
                    k: host(&k.conv.k),
                    v: host(&k.conv.v),
                },
            }),
            LayerState::Mla(m) => LayerState::Mla(m.copy_into(&scratch, &CpuBackend::new())),
        })
        .collect();
    KdaHybridState {
        layers,
        tokens: st.tokens,
    }
}

/// `st` with its MLA latent rows on a scratch pool of their own: received and template
/// states must not draw on (or be refused by) the worker's bounded pool.
pub(crate) fn on_scratch(mut st: KdaHybridState) -> KdaHybridState {
    let scratch = LatentPool::default();
    for layer in &mut st.layers {
        if let LayerState::Mla(m) = layer {
            *m = m.copy_into(&scratch, &CpuBackend::new());
        }
    }
    st
}

/// A state of the same model for attention-TP size `a_to`, made from one for `a_from`: KDA
/// blocks scale with the heads a rank holds; MLA latents are replicated. Its latent rows
/// draw on a scratch pool, never on the worker's bounded one.
fn rescale_template(t: &KdaHybridState, a_from: usize, a_to: usize) -> Result<KdaHybridState> {
    let mut out = on_scratch(t.clone());
    for layer in &mut out.layers {
        if let LayerState::Kda(k) = layer {
            for v in [
                &mut k.recurrent,
                &mut k.conv.q,
                &mut k.conv.k,
                &mut k.conv.v,
            ] {
                let full = v.len() * a_from;
                if !full.is_multiple_of(a_to) {
                    return Err(Error::InvalidRequest(format!(
                        "KDA state does not split over attention TP {a_to}"
                    )));
                }
                // Heads (KDA state) and channels (conv windows) are the leading dimension.
                let mut shape = v.shape().to_vec();
                shape[0] = shape[0] * a_from / a_to;
                *v = crate::tensor::Tensor::from_f32s(&shape, vec![0.0; full / a_to]);
            }
        }
    }
    Ok(out)
}

/// What a decode worker of a KDA-hybrid model accepts: handoffs of its own model from any
/// layout, resharded to the reserved group's ranks.
pub(crate) struct KdaHandoffSpec {
    /// The receiving layout.
    pub(crate) layout: Layout,
    /// The receiving model's configuration.
    pub(crate) config: KdaHybridConfig,
    /// A fresh state of one rank of a receiving group (latents on a scratch pool: see
    /// [`on_scratch`]).
    pub(crate) template: KdaHybridState,
}

impl KdaHandoffSpec {
    /// Reads a handoff from any layout into the states of group `group` of this one.
    pub(crate) fn receive(
        &self,
        h: &Handoff,
        tokens: usize,
        group: usize,
    ) -> Result<Vec<KdaHybridState>> {
        let decode = self.layout;
        let mut r = SegmentReader::new(h)?;
        let prefill = read_layout(&mut r)?;
        let a_from = prefill.attn_tp();
        let template = rescale_template(&self.template, decode.attn_tp(), a_from)?;
        let mut received = vec![template.clone(); a_from];
        read_group(&host_backends(a_from), &mut r, &mut received, tokens)?;
        r.finish()?;
        if a_from == decode.attn_tp() && decode.dp() == 1 {
            return Ok(received);
        }
        let shape = model_shape(&self.config);
        let plan = TransferPlan::new(&prefill, &decode, &shape, 0, group)
            .map_err(|e| Error::InvalidRequest(format!("reshard plan: {e}")))?;
        // The plan indexes whole layouts; ranks outside the two groups are never read or
        // written.
        let mut from = vec![template; prefill.tp()];
        for (k, st) in received.into_iter().enumerate() {
            from[k] = st;
        }
        let mut to: Vec<KdaHybridState> = vec![self.template.clone(); decode.tp()];
        let kda = self.config.kda;
        apply_transfer_plan(&plan, &from, &mut to, kda.head_dim, kda.conv_kernel);
        let a = decode.attn_tp();
        Ok(to.drain(group * a..(group + 1) * a).collect())
    }
}

impl HandoffSpec for KdaHandoffSpec {
    fn prepare(&self, h: Handoff, tokens: usize, reservation: &Reservation) -> Result<Handoff> {
        let group = reservation.group();
        let states = self.receive(&h, tokens, group)?;
        Ok(encode_group(
            &host_backends(states.len()),
            self.layout,
            &states,
            self.config.kda.head_dim,
        ))
    }
}
