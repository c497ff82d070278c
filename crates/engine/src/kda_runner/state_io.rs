//! The handoff body of a KDA-hybrid request and its checks: per-rank states serialised as
//! length-prefixed f32 arrays, the prefill layout in front, MLA latents once; on receipt the
//! blocks are checked against the receiving model and resharded to the decode group.

use super::model::KdaModel;
use crate::kda_hybrid::sharded::model_shape;
use crate::kda_hybrid::{apply_transfer_plan, KdaHybridState, LatentPool, LayerState};
use crate::{Error, Result};
use tandem_topology::{Layout, TransferPlan};

fn put(out: &mut Vec<u8>, v: &[f32]) {
    out.extend_from_slice(&(v.len() as u64).to_le_bytes());
    out.extend_from_slice(bytemuck::cast_slice(v));
}

/// Serialises a request state (a whole number of 4-byte words): per layer a kind word, then length-prefixed f32 arrays
/// (KDA: recurrent, conv q, conv k, conv v; MLA: latent, rope key, indexer keys, pool gate).
pub fn encode_state(state: &KdaHybridState) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&(state.tokens as u64).to_le_bytes());
    out.extend_from_slice(&(state.layers.len() as u64).to_le_bytes());
    for layer in &state.layers {
        match layer {
            LayerState::Kda(k) => {
                out.extend_from_slice(&0u32.to_le_bytes());
                for v in [&k.recurrent, &k.conv.q, &k.conv.k, &k.conv.v] {
                    put(&mut out, v);
                }
            }
            LayerState::Mla(m) => {
                out.extend_from_slice(&1u32.to_le_bytes());
                let (keys, gate) = m
                    .indexer
                    .as_ref()
                    .map_or((&[][..], &[][..]), |i| (&i.keys[..], &i.pool_gate[..]));
                let (latent, rope) = (m.kv_latent.to_vec(), m.k_rope.to_vec());
                for v in [&latent[..], &rope[..], keys, gate] {
                    put(&mut out, v);
                }
                out.extend_from_slice(&u32::from(m.indexer.is_some()).to_le_bytes());
            }
        }
    }
    out
}

struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn bytes(&mut self, n: usize) -> Result<&[u8]> {
        if self.0.len() < n {
            return Err(Error::InvalidRequest("KDA state truncated".into()));
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u64(&mut self) -> Result<u64> {
        let b = self.bytes(8)?;
        Ok(u64::from_le_bytes(
            b.try_into()
                .map_err(|_| Error::InvalidRequest("bad length".into()))?,
        ))
    }
    fn u32(&mut self) -> Result<u32> {
        let b = self.bytes(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn floats(&mut self, expected: Option<usize>) -> Result<Vec<f32>> {
        let n =
            usize::try_from(self.u64()?).map_err(|_| Error::InvalidRequest("bad length".into()))?;
        if expected.is_some_and(|e| e != n) {
            return Err(Error::InvalidRequest(format!(
                "KDA state block has {n} values, expected {expected:?}"
            )));
        }
        let b = self.bytes(
            n.checked_mul(4)
                .ok_or_else(|| Error::InvalidRequest("bad length".into()))?,
        )?;
        Ok(b.chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }
}

/// Rebuilds a state from [`encode_state`] bytes, checking every block against `template`
/// (a fresh state of the receiving model): layer kinds, KDA sizes, and per-token MLA widths.
pub fn decode_state(
    bytes: &[u8],
    template: &KdaHybridState,
    prompt_len: usize,
) -> Result<KdaHybridState> {
    let mut r = Reader(bytes);
    let tokens =
        usize::try_from(r.u64()?).map_err(|_| Error::InvalidRequest("bad token count".into()))?;
    if tokens != prompt_len {
        return Err(Error::InvalidRequest(format!(
            "state covers {tokens} tokens, the prompt has {prompt_len}"
        )));
    }
    let n = r.u64()? as usize;
    if n != template.layers.len() {
        return Err(Error::InvalidRequest(format!(
            "state has {n} layers, the model {}",
            template.layers.len()
        )));
    }
    let mut state = template.clone();
    state.tokens = tokens;
    for layer in &mut state.layers {
        let kind = r.u32()?;
        match (kind, layer) {
            (0, LayerState::Kda(k)) => {
                k.recurrent = r.floats(Some(k.recurrent.len()))?;
                k.conv.q = r.floats(Some(k.conv.q.len()))?;
                k.conv.k = r.floats(Some(k.conv.k.len()))?;
                k.conv.v = r.floats(Some(k.conv.v.len()))?;
            }
            (1, LayerState::Mla(m)) => {
                for (rows, data) in [
                    (&mut m.kv_latent, r.floats(None)?),
                    (&mut m.k_rope, r.floats(None)?),
                ] {
                    // Empty is allowed: ranks other than 0 send no latents (they are replicated).
                    if !data.is_empty()
                        && (rows.width() == 0 || data.len() != tokens * rows.width())
                    {
                        return Err(Error::InvalidRequest(format!(
                            "MLA cache has {} values, expected {tokens} tokens of {}",
                            data.len(),
                            rows.width()
                        )));
                    }
                    rows.clear();
                    rows.extend_from_slice(&data);
                }
                let keys = r.floats(None)?;
                let pool_gate = r.floats(None)?;
                let has_indexer = r.u32()? == 1;
                if has_indexer != m.indexer.is_some() {
                    return Err(Error::InvalidRequest(
                        "MLA indexer presence differs from the model".into(),
                    ));
                }
                if let Some(ix) = m.indexer.as_mut() {
                    ix.keys = keys;
                    ix.pool_gate = pool_gate;
                }
            }
            _ => {
                return Err(Error::InvalidRequest(
                    "state layer kinds differ from the model's".into(),
                ))
            }
        }
    }
    if !r.0.is_empty() {
        return Err(Error::InvalidRequest(
            "trailing bytes after the KDA state".into(),
        ));
    }
    Ok(state)
}

/// The handoff body of a KDA-hybrid request: the prefill layout, then the state of every rank
/// of the prefill attention-DP group that served it — KDA state by heads from each rank, the MLA
/// latents (replicated across attention TP) once, from rank 0.
pub(crate) fn encode_group(layout: Layout, states: &[KdaHybridState]) -> Vec<u8> {
    let mut out = Vec::new();
    for v in [layout.tp(), layout.dp(), layout.ep(), states.len()] {
        out.extend_from_slice(&(v as u32).to_le_bytes());
    }
    for (k, st) in states.iter().enumerate() {
        // MLA latents are replicated across attention TP: only rank 0 carries them.
        let bytes = if k == 0 {
            encode_state(st)
        } else {
            encode_state(&without_mla(st))
        };
        out.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
        out.extend_from_slice(&bytes);
    }
    out
}

/// `st` with its MLA layers emptied (what ranks other than 0 send).
fn without_mla(st: &KdaHybridState) -> KdaHybridState {
    let mut out = st.clone();
    for layer in &mut out.layers {
        if let LayerState::Mla(m) = layer {
            m.kv_latent.clear();
            m.k_rope.clear();
            if let Some(ix) = m.indexer.as_mut() {
                ix.keys.clear();
                ix.pool_gate.clear();
            }
        }
    }
    out
}

/// A state of the same model for attention-TP size `a_to`, made from one for `a_from`: KDA
/// blocks scale with the heads a rank holds; MLA latents are replicated.
fn rescale_template(t: &KdaHybridState, a_from: usize, a_to: usize) -> Result<KdaHybridState> {
    let mut out = t.clone();
    // Received states are scratch: their latents are copied into the request's reserved
    // blocks and dropped, so they must not draw on (or be refused by) the worker's bounded
    // pool meanwhile.
    let scratch = LatentPool::default();
    for layer in &mut out.layers {
        if let LayerState::Mla(m) = layer {
            m.kv_latent = m.kv_latent.copy_into(&scratch);
            m.k_rope = m.k_rope.copy_into(&scratch);
        }
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
                *v = vec![0.0; full / a_to];
            }
        }
    }
    Ok(out)
}

/// Rebuilds the decode group's states from a prefill group's handoff body, resharding from the
/// prefill layout to `model`'s layout for decode group `group`.
pub(crate) fn decode_group(
    model: &KdaModel,
    body: &[u8],
    prompt_len: usize,
    group: usize,
) -> Result<Vec<KdaHybridState>> {
    let mut r = Reader(body);
    let (tp, dp, ep, n) = (
        r.u32()? as usize,
        r.u32()? as usize,
        r.u32()? as usize,
        r.u32()? as usize,
    );
    let prefill = Layout::new(tp, dp, ep)
        .map_err(|e| Error::InvalidRequest(format!("prefill layout: {e}")))?;
    if n != prefill.attn_tp() {
        return Err(Error::InvalidRequest(format!(
            "{n} rank states for prefill attention TP {}",
            prefill.attn_tp()
        )));
    }
    let decode = model.layout();
    let mine = model.group_states();
    let template = rescale_template(&mine[0], decode.attn_tp(), prefill.attn_tp())?;
    let mut received = Vec::with_capacity(n);
    for _ in 0..n {
        let len =
            usize::try_from(r.u64()?).map_err(|_| Error::InvalidRequest("bad length".into()))?;
        received.push(decode_state(r.bytes(len)?, &template, prompt_len)?);
    }
    if !r.0.is_empty() {
        return Err(Error::InvalidRequest(
            "trailing bytes after the rank states".into(),
        ));
    }
    // The MLA latents came once, with rank 0: give every rank its replica.
    if let Some((first, rest)) = received.split_first_mut() {
        for st in rest {
            for (dst, src) in st.layers.iter_mut().zip(&first.layers) {
                if let (LayerState::Mla(d), LayerState::Mla(s)) = (dst, src) {
                    *d = s.clone();
                }
            }
        }
    }
    if prefill.attn_tp() == decode.attn_tp() && decode.dp() == 1 {
        return Ok(received);
    }
    let shape = model_shape(model.config());
    let plan = TransferPlan::new(&prefill, &decode, &shape, 0, group)
        .map_err(|e| Error::InvalidRequest(format!("reshard plan: {e}")))?;
    // The plan indexes whole layouts; ranks outside the two groups are never read or written.
    let mut from = vec![template; prefill.tp()];
    for (k, st) in received.into_iter().enumerate() {
        from[k] = st;
    }
    let mut to: Vec<KdaHybridState> = (0..decode.tp()).map(|_| mine[0].clone()).collect();
    let kda = model.config().kda;
    apply_transfer_plan(&plan, &from, &mut to, kda.head_dim, kda.conv_kernel);
    let a = decode.attn_tp();
    Ok(to.drain(group * a..(group + 1) * a).collect())
}
