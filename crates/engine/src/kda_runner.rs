//! Serving KDA-hybrid models: an engine thread over [`KdaHybridModel`] with the same shape as
//! the Llama engine's — submit a sequence, get events — and a state-slot pool whose RAII
//! slots free themselves when a request ends.
//!
//! A KDA-hybrid request's "cache" is its [`KdaHybridState`]: fixed-size KDA state per KDA layer
//! and a latent per token per MLA layer. The prefill role hands the state over as bytes
//! ([`encode_state`]); the decode role checks them against a fresh state of its own model
//! ([`decode_state`]) before using them. Steps run one request at a time (prefills whole,
//! decodes round-robin): correct and simple; batching across requests comes with the batched
//! KDA kernels.

use crate::kda_hybrid::sharded::model_shape;
use crate::kda_hybrid::{
    apply_transfer_plan, KdaForm, KdaHybridConfig, KdaHybridModel, KdaHybridState, LatentPool,
    LayerState, LoadOptions, ShardedKdaHybrid,
};
use crate::kv_pool::{BlockAllocation, BlockAllocator};
use crate::sampling::sample;
use crate::{Error, Result};
use parking_lot::RwLock;
use std::collections::VecDeque;
use std::sync::mpsc;
use std::sync::Arc;
use tandem_core::{FinishReason, SamplingParams};
use tandem_topology::ShardBy;
use tandem_topology::{Layout, Rank, TransferPlan};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

/// What the KDA engine reports for a sequence.
#[derive(Debug)]
pub enum KdaEvent {
    /// Prefill done: the first token and the request's state as bytes.
    Prefilled {
        /// Sampled first token.
        first_token: u32,
        /// Set when the first token already ends the request.
        finish: Option<FinishReason>,
        /// [`encode_state`] of the state after the prompt.
        state: Vec<u8>,
    },
    /// A generated token.
    Token {
        /// The token.
        token_id: u32,
        /// Set on the last one.
        finish: Option<FinishReason>,
    },
}

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

/// The model on one rank or sharded over a layout (ranks are threads of this process).
#[derive(Debug)]
pub enum KdaModel {
    /// tp = 1.
    Single(Box<KdaHybridModel>),
    /// tp > 1.
    Sharded(ShardedKdaHybrid),
}

impl KdaModel {
    /// Loads `dir` for `layout`, merging the PEFT LoRA adapter in `lora` when given (layers
    /// whose projections it targets run unfused).
    pub fn load(
        dir: &std::path::Path,
        layout: Layout,
        lora: Option<&std::path::Path>,
    ) -> Result<Self> {
        let options = LoadOptions {
            lora: lora.map(std::path::Path::to_path_buf),
            ..LoadOptions::default()
        };
        Ok(if layout.tp() == 1 {
            KdaModel::Single(Box::new(KdaHybridModel::load_with(dir, &options)?))
        } else {
            KdaModel::Sharded(
                ShardedKdaHybrid::load_with(dir, layout, &options, ShardBy::AttentionTp)
                    .map_err(|e| Error::InvalidRequest(format!("layout {layout}: {e}")))?,
            )
        })
    }

    /// Makes new states take MLA latent blocks from `pool`.
    pub fn set_latent_pool(&mut self, pool: &LatentPool) {
        match self {
            KdaModel::Single(m) => m.set_latent_pool(pool),
            KdaModel::Sharded(s) => s.set_latent_pool(pool),
        }
    }

    /// Reloads the weights from `dir` into the existing buffers (fused ones in place, so
    /// captured graphs stay valid), on every rank.
    pub fn refresh_weights(&mut self, dir: &std::path::Path) -> Result<()> {
        match self {
            KdaModel::Single(m) => m.refresh_weights(dir),
            KdaModel::Sharded(s) => s
                .refresh_weights(dir)
                .map_err(|e| Error::InvalidRequest(format!("refresh: {e}"))),
        }
    }

    /// The layout served.
    pub fn layout(&self) -> Layout {
        match self {
            KdaModel::Single(_) => Layout::new(1, 1, 1).expect("tp1 is a valid layout"),
            KdaModel::Sharded(s) => *s.layout(),
        }
    }

    fn rank0(&self) -> &KdaHybridModel {
        match self {
            KdaModel::Single(m) => m,
            KdaModel::Sharded(s) => s.rank(Rank(0)).expect("a layout has rank 0"),
        }
    }

    /// The model's configuration.
    pub fn config(&self) -> &KdaHybridConfig {
        self.rank0().config()
    }

    /// Fresh states for one attention-DP group's ranks.
    fn group_states(&self) -> Vec<KdaHybridState> {
        match self {
            KdaModel::Single(m) => vec![m.new_state()],
            KdaModel::Sharded(s) => {
                let a = s.layout().attn_tp();
                s.new_states().into_iter().take(a).collect()
            }
        }
    }

    /// One step for several requests at once, at most one per attention-DP group: `work[i]` is
    /// `(group, ids, that group's rank states)`. Idle groups run a throwaway token on scratch
    /// states, because a sharded step is collective over every rank. Returns each work item's
    /// last-position logits.
    fn step(&self, work: &mut [(usize, Vec<u32>, Vec<KdaHybridState>)]) -> Result<Vec<Vec<f32>>> {
        let form = if work.iter().any(|w| w.1.len() > 1) {
            KdaForm::Chunked
        } else {
            KdaForm::Recurrent
        };
        match self {
            KdaModel::Single(m) => work
                .iter_mut()
                .map(|(_, ids, st)| Ok(m.extend(ids, &mut st[0], form, false)))
                .collect(),
            KdaModel::Sharded(s) => {
                let (dp, a) = (s.layout().dp(), s.layout().attn_tp());
                let mut ids = vec![vec![0u32]; dp];
                let mut states = s.new_states();
                for (g, group_ids, st) in work.iter_mut() {
                    ids[*g] = std::mem::take(group_ids);
                    for (k, state) in st.iter_mut().enumerate() {
                        std::mem::swap(&mut states[*g * a + k], state);
                    }
                }
                let out = s
                    .extend(&ids, &mut states, form, false)
                    .map_err(|e| Error::InvalidRequest(format!("sharded step failed: {e}")))?;
                let mut result = Vec::with_capacity(work.len());
                for (g, _, st) in work.iter_mut() {
                    for (k, state) in st.iter_mut().enumerate() {
                        std::mem::swap(&mut states[*g * a + k], state);
                    }
                    result.push(out[*g].clone());
                }
                Ok(result)
            }
        }
    }
}

/// The handoff body of a KDA-hybrid request: the prefill layout, then the state of every rank
/// of the prefill attention-DP group that served it — KDA state by heads from each rank, the MLA
/// latents (replicated across attention TP) once, from rank 0.
fn encode_group(layout: Layout, states: &[KdaHybridState]) -> Vec<u8> {
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
                *v = vec![0.0; full / a_to];
            }
        }
    }
    Ok(out)
}

/// Rebuilds the decode group's states from a prefill group's handoff body, resharding from the
/// prefill layout to `model`'s layout for decode group `group`.
fn decode_group(
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

/// Takes the MLA latent blocks `tokens` tokens need in every MLA layer of `states`, from the
/// paged pool; on failure the caller drops the states, which returns what was taken.
fn reserve_latents(states: &mut [KdaHybridState], tokens: usize, pool: &LatentPool) -> Result<()> {
    for st in states.iter_mut() {
        for layer in &mut st.layers {
            if let LayerState::Mla(m) = layer {
                if !m.reserve(tokens) {
                    return Err(Error::CapacityExhausted {
                        needed: tokens.div_ceil(crate::kda_hybrid::latent_pool::BLOCK_ROWS),
                        free: pool.free().unwrap_or(0),
                    });
                }
            }
        }
    }
    Ok(())
}

enum Work {
    Prefill {
        prompt: Vec<u32>,
        params: SamplingParams,
        slot: Box<GroupSlot>,
        states: Vec<KdaHybridState>,
        tx: UnboundedSender<KdaEvent>,
    },
    Decode {
        seq: Box<DecodeSeq>,
    },
}

struct DecodeSeq {
    group: usize,
    states: Vec<KdaHybridState>,
    last: u32,
    generated: usize,
    params: SamplingParams,
    stop: Vec<u32>,
    slot: GroupSlot,
    tx: UnboundedSender<KdaEvent>,
}

impl Drop for DecodeSeq {
    fn drop(&mut self) {
        // Hand the states back to the slot, which returns them to the pool.
        self.slot.put_states(std::mem::take(&mut self.states));
    }
}

/// Handle to a KDA-hybrid engine thread.
#[derive(Clone)]
pub struct KdaEngine {
    tx: mpsc::Sender<Work>,
    /// One slot pool per attention-DP group.
    slots: Vec<BlockAllocator>,
    /// Each group's preallocated request states.
    state_lists: Vec<StateFreeList>,
    /// Decoding requests dropped because their caller went away.
    cancelled: Arc<std::sync::atomic::AtomicU64>,
    /// All groups' slots, for accounting.
    all_slots: BlockAllocator,
    latents: LatentPool,
    model: Arc<RwLock<KdaModel>>,
    layout: Layout,
    eos: Vec<u32>,
    vocab: usize,
    max_context: usize,
    num_layers: usize,
}

impl std::fmt::Debug for KdaEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KdaEngine")
            .field("layout", &self.layout)
            .finish_non_exhaustive()
    }
}

fn stop_ids(params: &SamplingParams, eos: &[u32]) -> Vec<u32> {
    let mut s = params.stop_token_ids.clone();
    if !params.ignore_eos {
        s.extend_from_slice(eos);
    }
    s
}

fn finish(
    token: u32,
    generated: usize,
    params: &SamplingParams,
    stop: &[u32],
) -> Option<FinishReason> {
    if stop.contains(&token) {
        Some(FinishReason::Stop)
    } else if generated >= params.max_tokens as usize {
        Some(FinishReason::Length)
    } else {
        None
    }
}

/// Preallocated request states of one attention-DP group (one state per rank of the group
/// per slot), reused request after request.
type StateFreeList = Arc<parking_lot::Mutex<Vec<Vec<KdaHybridState>>>>;

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
fn overwrite_state(dst: &mut KdaHybridState, src: &KdaHybridState) -> Result<()> {
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
                d.kv_latent.clear();
                d.kv_latent.extend_from_slice(&s.kv_latent.to_vec());
                d.k_rope.clear();
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
    states: Option<Vec<KdaHybridState>>,
    free_list: StateFreeList,
    _slot: BlockAllocation,
    _total: BlockAllocation,
}

impl GroupSlot {
    fn take_states(&mut self) -> Vec<KdaHybridState> {
        self.states.take().unwrap_or_default()
    }

    fn put_states(&mut self, states: Vec<KdaHybridState>) {
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

impl KdaEngine {
    /// Starts the engine thread with `slots` request-state slots per attention-DP group and a
    /// paged MLA latent pool of `latent_blocks` blocks of 16 tokens.
    pub fn start(
        mut model: KdaModel,
        slots: usize,
        latent_blocks: usize,
        eos: Vec<u32>,
        max_context: usize,
    ) -> Self {
        let latents = LatentPool::bounded(latent_blocks);
        model.set_latent_pool(&latents);
        // The slot pool: every slot's states allocated once, here.
        let state_lists: Vec<StateFreeList> = (0..model.layout().dp())
            .map(|_| {
                Arc::new(parking_lot::Mutex::new(
                    (0..slots).map(|_| model.group_states()).collect(),
                ))
            })
            .collect();
        let (tx, rx) = mpsc::channel();
        let vocab = model.config().vocab_size;
        let num_layers = model.config().num_layers();
        let layout = model.layout();
        let dp = layout.dp();
        let model = Arc::new(RwLock::new(model));
        let (thread_model, eos_thread) = (model.clone(), eos.clone());
        let cancelled = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let thread_cancelled = cancelled.clone();
        std::thread::Builder::new()
            .name("tandem-kda-engine".into())
            .spawn(move || run(&thread_model, rx, &eos_thread, &thread_cancelled))
            .expect("spawning the KDA engine thread");
        Self {
            tx,
            slots: (0..dp).map(|_| BlockAllocator::new(slots)).collect(),
            state_lists,
            cancelled,
            all_slots: BlockAllocator::new(slots * dp),
            latents,
            model,
            layout,
            eos,
            vocab,
            max_context,
            num_layers,
        }
    }

    /// All state slots (for accounting).
    pub fn slots(&self) -> &BlockAllocator {
        &self.all_slots
    }

    /// The layout served.
    pub fn layout(&self) -> Layout {
        self.layout
    }

    /// Decoding requests dropped because their caller went away.
    pub fn cancelled(&self) -> u64 {
        self.cancelled.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Preallocated request-state sets waiting in the slot pool, over all groups (equals the
    /// slot count when no request runs).
    pub fn pooled_states(&self) -> usize {
        self.state_lists.iter().map(|l| l.lock().len()).sum()
    }

    /// The paged MLA latent pool: `(blocks in all, blocks free)`.
    pub fn latent_blocks(&self) -> (usize, usize) {
        (
            self.latents.capacity().unwrap_or(0),
            self.latents.free().unwrap_or(0),
        )
    }

    /// Rewrites the weights from `dir` in place; waits for the step in flight to finish.
    pub fn refresh_weights(&self, dir: &std::path::Path) -> Result<()> {
        self.model.write().refresh_weights(dir)
    }

    /// Free slots of each attention-DP group.
    pub fn group_free(&self) -> Vec<usize> {
        self.slots.iter().map(BlockAllocator::free_blocks).collect()
    }

    /// Layers of the model.
    pub fn num_layers(&self) -> usize {
        self.num_layers
    }

    /// Context length served.
    pub fn max_context(&self) -> usize {
        self.max_context
    }

    /// Takes a state slot on attention-DP group `group`, or on the least-loaded group.
    pub fn reserve_on(&self, group: Option<usize>) -> Result<GroupSlot> {
        let group = match group {
            Some(g) if g < self.slots.len() => g,
            Some(g) => {
                return Err(Error::InvalidRequest(format!(
                    "decode DP rank {g} does not exist (dp = {})",
                    self.slots.len()
                )))
            }
            None => (0..self.slots.len())
                .max_by_key(|&g| (self.slots[g].free_blocks(), usize::MAX - g))
                .unwrap_or(0),
        };
        let slot = self.slots[group].allocate(1)?;
        let total = self.all_slots.allocate(1)?;
        let free_list = self.state_lists[group].clone();
        let pooled = free_list.lock().pop();
        // The preallocated set is sized to the slot count, so this always finds one.
        let states = pooled.unwrap_or_else(|| self.model.read().group_states());
        Ok(GroupSlot {
            group,
            states: Some(states),
            free_list,
            _slot: slot,
            _total: total,
        })
    }

    /// Takes a state slot on the least-loaded group.
    pub fn reserve(&self) -> Result<GroupSlot> {
        self.reserve_on(None)
    }

    fn check(&self, prompt: &[u32], params: &SamplingParams) -> Result<()> {
        if prompt.is_empty() || params.max_tokens == 0 {
            return Err(Error::InvalidRequest(
                "empty prompt or max_tokens = 0".into(),
            ));
        }
        if let Some(bad) = prompt.iter().find(|&&t| t as usize >= self.vocab) {
            return Err(Error::InvalidRequest(format!(
                "token id {bad} is outside the vocabulary"
            )));
        }
        if prompt.len() + params.max_tokens as usize > self.max_context {
            return Err(Error::InvalidRequest(format!(
                "request exceeds the context length {}",
                self.max_context
            )));
        }
        Ok(())
    }

    /// Prefill role: computes the prompt on group 0; one `Prefilled` event whose state is the
    /// handoff body (prefill layout + every rank's state of the group).
    pub fn submit_prefill(
        &self,
        prompt: Vec<u32>,
        params: SamplingParams,
    ) -> Result<UnboundedReceiver<KdaEvent>> {
        self.check(&prompt, &params)?;
        let mut slot = self.reserve_on(Some(0))?;
        let mut states = slot.take_states();
        let reserved = reserve_latents(&mut states, prompt.len(), &self.latents);
        slot.put_states(states);
        reserved?;
        let states = slot.take_states();
        let (tx, rx) = unbounded_channel();
        self.tx
            .send(Work::Prefill {
                prompt,
                params,
                slot: Box::new(slot),
                states,
                tx,
            })
            .map_err(|_| Error::Stopped)?;
        Ok(rx)
    }

    /// Decode role: continues from a received handoff body with `first_token` on the slot's
    /// group (resharding from the prefill layout); `Token` events.
    pub fn submit_decode(
        &self,
        prompt: &[u32],
        params: SamplingParams,
        slot: GroupSlot,
        body: &[u8],
        first_token: u32,
    ) -> Result<UnboundedReceiver<KdaEvent>> {
        self.check(prompt, &params)?;
        let received = decode_group(&self.model.read(), body, prompt.len(), slot.group)?;
        let mut slot = slot;
        let mut states = slot.take_states();
        let filled = states
            .iter_mut()
            .zip(&received)
            .try_for_each(|(dst, src)| overwrite_state(dst, src))
            .and_then(|()| {
                reserve_latents(
                    &mut states,
                    prompt.len() + params.max_tokens as usize,
                    &self.latents,
                )
            });
        drop(received);
        if let Err(e) = filled {
            slot.put_states(states);
            return Err(e);
        }
        let (tx, rx) = unbounded_channel();
        let stop = stop_ids(&params, &self.eos);
        let seq = DecodeSeq {
            group: slot.group,
            states,
            last: first_token,
            generated: 1,
            params,
            stop,
            slot,
            tx,
        };
        self.tx
            .send(Work::Decode { seq: Box::new(seq) })
            .map_err(|_| Error::Stopped)?;
        Ok(rx)
    }
}

fn run(
    shared: &RwLock<KdaModel>,
    rx: mpsc::Receiver<Work>,
    eos: &[u32],
    cancelled: &std::sync::atomic::AtomicU64,
) {
    let dp = shared.read().layout().dp();
    let mut running: Vec<VecDeque<Box<DecodeSeq>>> = (0..dp).map(|_| VecDeque::new()).collect();
    loop {
        let idle = running.iter().all(VecDeque::is_empty);
        let next = if idle {
            rx.recv().ok()
        } else {
            rx.try_recv().ok()
        };
        match next {
            Some(Work::Prefill {
                prompt,
                params,
                slot,
                states,
                tx,
            }) => {
                if tx.is_closed() {
                    // Cancelled while queued: the states go straight back to the pool.
                    cancelled.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let mut slot = slot;
                    slot.put_states(states);
                    continue;
                }
                let model = shared.read();
                let mut work = vec![(0, prompt, states)];
                let event = match model.step(&mut work) {
                    Ok(logits) => {
                        let token = sample(&logits[0], &params, 0);
                        let f = finish(token, 1, &params, &stop_ids(&params, eos));
                        let state = encode_group(model.layout(), &work[0].2);
                        Some(KdaEvent::Prefilled {
                            first_token: token,
                            finish: f,
                            state,
                        })
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "KDA prefill failed");
                        None
                    }
                };
                // The states go back to the slot pool, zeroed, before the caller hears of it.
                let mut slot = slot;
                slot.put_states(std::mem::take(&mut work[0].2));
                drop(slot);
                if let Some(ev) = event {
                    let _ = tx.send(ev);
                }
                continue;
            }
            Some(Work::Decode { seq }) => running[seq.group].push_back(seq),
            None if idle => return,
            None => {}
        }
        // One decode step for the front request of every busy group, together.
        let mut seqs: Vec<Box<DecodeSeq>> =
            running.iter_mut().filter_map(VecDeque::pop_front).collect();
        // Count first, then drop: whoever sees the freed slots also sees the count.
        let gone: Vec<usize> = (0..seqs.len())
            .filter(|&i| seqs[i].tx.is_closed())
            .collect();
        cancelled.fetch_add(gone.len() as u64, std::sync::atomic::Ordering::Relaxed);
        for i in gone.into_iter().rev() {
            seqs.swap_remove(i);
        }
        if seqs.is_empty() {
            continue;
        }
        let mut work: Vec<(usize, Vec<u32>, Vec<KdaHybridState>)> = seqs
            .iter_mut()
            .map(|s| (s.group, vec![s.last], std::mem::take(&mut s.states)))
            .collect();
        let logits = match shared.read().step(&mut work) {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(error = %e, "KDA decode step failed; dropping its requests");
                // Their states go back to the slot pool (dropping a sequence returns them).
                for (seq, (_, _, states)) in seqs.iter_mut().zip(work) {
                    seq.states = states;
                }
                continue;
            }
        };
        for ((mut seq, (_, _, states)), row) in seqs.into_iter().zip(work).zip(logits) {
            seq.states = states;
            let token = sample(&row, &seq.params, seq.generated as u32);
            seq.generated += 1;
            seq.last = token;
            let f = finish(token, seq.generated, &seq.params, &seq.stop);
            let tx = seq.tx.clone();
            if f.is_none() {
                running[seq.group].push_back(seq);
            } else {
                drop(seq); // slot freed before the last token is reported
            }
            let _ = tx.send(KdaEvent::Token {
                token_id: token,
                finish: f,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The public tiny Kimi-Linear checkpoint: its KDA state visibly changes the output.
    fn tiny() -> (std::path::PathBuf, KdaHybridModel) {
        let dir = tandem_testkit::shared_dir().join("reference/kimi_tiny");
        let model = KdaHybridModel::load(&dir).expect("load");
        (dir, model)
    }

    #[test]
    fn mla_latents_travel_once_per_request() {
        let dir = tandem_testkit::shared_dir().join("reference/kimi_tiny");
        let layout = Layout::new(2, 1, 1).expect("tp2");
        let model = KdaModel::load(&dir, layout, None).expect("load tp2");
        let mut work = vec![(0, vec![5u32, 9, 33, 7, 120, 64, 3], model.group_states())];
        model.step(&mut work).expect("prefill");
        let states = &work[0].2;
        let body = encode_group(layout, states);
        let latent_bytes: usize = states[0]
            .layers
            .iter()
            .map(|l| match l {
                LayerState::Mla(m) => 4 * (m.kv_latent.len() + m.k_rope.len()),
                LayerState::Kda(_) => 0,
            })
            .sum();
        let kda_bytes: usize = states
            .iter()
            .flat_map(|s| &s.layers)
            .map(|l| match l {
                LayerState::Kda(k) => 4 * (k.recurrent.len() + 3 * k.conv.q.len()),
                LayerState::Mla(_) => 0,
            })
            .sum();
        assert!(latent_bytes > 0);
        // One latent copy plus every rank's KDA share, plus small headers.
        assert!(
            body.len() < kda_bytes + latent_bytes + 1024,
            "latents sent more than once"
        );
        let back = decode_group(&model, &body, 7, 0).expect("decode");
        assert_eq!(
            &back, states,
            "every rank gets its replica of the latents back"
        );
    }

    #[test]
    fn state_round_trips_and_is_checked() {
        let (_d, model) = tiny();
        let mut state = model.new_state();
        model.prefill(&[5, 6, 7, 8], &mut state);
        let bytes = encode_state(&state);
        let back = decode_state(&bytes, &model.new_state(), 4).expect("decode");
        assert_eq!(back, state);
        assert!(
            decode_state(&bytes, &model.new_state(), 5).is_err(),
            "wrong prompt length"
        );
        assert!(
            decode_state(&bytes[..bytes.len() - 3], &model.new_state(), 4).is_err(),
            "truncated"
        );
    }

    #[test]
    fn prefill_then_decode_through_the_engines_equals_one_process() {
        let (dir, model) = tiny();
        let prompt = vec![9u32, 40, 7, 300, 12, 5];
        let params = SamplingParams {
            ignore_eos: true,
            ..SamplingParams::greedy(6)
        };
        // Reference: one process.
        let mut st = model.new_state();
        let mut logits = model.prefill(&prompt, &mut st);
        let mut want = Vec::new();
        for _ in 0..6 {
            let t = crate::sampling::argmax(&logits);
            want.push(t);
            logits = model.decode_step(t, &mut st);
        }
        let p = KdaEngine::start(KdaModel::Single(Box::new(model)), 4, 64, vec![2], 4096);
        let d = KdaEngine::start(
            KdaModel::Single(Box::new(KdaHybridModel::load(&dir).expect("load"))),
            4,
            64,
            vec![2],
            4096,
        );
        let mut rx = p
            .submit_prefill(prompt.clone(), params.clone())
            .expect("prefill");
        let Some(KdaEvent::Prefilled {
            first_token,
            finish: None,
            state,
        }) = rx.blocking_recv()
        else {
            panic!("no prefill event");
        };
        let slot = d.reserve().expect("slot");
        let mut rx = d
            .submit_decode(&prompt, params, slot, &state, first_token)
            .expect("decode");
        let mut got = vec![first_token];
        while let Some(KdaEvent::Token { token_id, finish }) = rx.blocking_recv() {
            got.push(token_id);
            if finish.is_some() {
                break;
            }
        }
        assert_eq!(got, want);
        assert_eq!(p.slots().free_blocks(), 4);
        assert_eq!(d.slots().free_blocks(), 4);
        assert_eq!(p.latent_blocks(), (64, 64), "prefill latent blocks back");
        assert_eq!(p.pooled_states(), 4, "prefill states back in the slot pool");
        assert_eq!(d.pooled_states(), 4, "decode states back in the slot pool");
        assert_eq!(d.latent_blocks(), (64, 64), "decode latent blocks back");
        // A request whose latents cannot fit the pool is refused at admission.
        let tiny = KdaEngine::start(
            KdaModel::Single(Box::new(KdaHybridModel::load(&dir).expect("load"))),
            4,
            1,
            vec![2],
            4096,
        );
        let long: Vec<u32> = (0..40).map(|i| 3 + i).collect();
        assert!(matches!(
            tiny.submit_prefill(long, SamplingParams::greedy(1)),
            Err(Error::CapacityExhausted { .. })
        ));
        assert_eq!(
            tiny.latent_blocks(),
            (1, 1),
            "a refused request takes nothing"
        );
        // A weight refresh keeps the model on the same bounded pool.
        tiny.refresh_weights(&dir).expect("refresh");
        let long: Vec<u32> = (0..40).map(|i| 3 + i).collect();
        assert!(matches!(
            tiny.submit_prefill(long, SamplingParams::greedy(1)),
            Err(Error::CapacityExhausted { .. })
        ));
    }
}
