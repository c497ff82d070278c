//! Serving KDA-hybrid models: an engine thread over [`KdaHybridModel`] with the same shape as
//! the Llama engine's — submit a sequence, get events — and a state-slot pool whose RAII
//! slots free themselves when a request ends.
//!
//! A KDA-hybrid request's "cache" is its [`KdaHybridState`]: fixed-size KDA state per KDA layer
//! and a latent per token per MLA layer. The prefill role hands the state over as bytes
//! ([`encode_state`]); the decode role checks them against a fresh state of its own model
//! ([`decode_state`]) before using them. Each decode step runs every running request of every
//! attention-DP group in one pass (their tokens share the GEMMs; convs, the delta rule and MLA
//! attention run per request on its own state); queued prompts share prefill steps, each
//! prompt whole, on the least-loaded group.
//!
//! Layout: [`model`] (one rank or a sharded layout), [`slots`] (the state-slot pool and the
//! paged latent reservations), [`state_io`] (the handoff body and resharding on receipt);
//! this file is the engine thread and its handle.

/// The served model: one rank, or a layout of ranks.
pub mod model;
/// Request-state slots (preallocated, reused) and latent-block reservations.
pub mod slots;
/// The KDA-hybrid handoff body: encoding, checking, resharding.
pub mod state_io;

pub use model::KdaModel;
pub use slots::GroupSlot;
pub use state_io::{decode_state, encode_state};

use self::slots::{overwrite_state, reserve_latents, StateFreeList};
use self::state_io::{decode_group, encode_group};
use crate::kda_hybrid::{KdaHybridState, LatentPool};
use crate::kv_pool::BlockAllocator;
use crate::sampling::sample;
use crate::{Error, Result};
use parking_lot::RwLock;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use tandem_core::{FinishReason, SamplingParams};
use tandem_topology::Layout;
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

enum Work {
    Prefill(Box<PrefillJob>),
    Decode { seq: Box<DecodeSeq> },
}

struct PrefillJob {
    prompt: Vec<u32>,
    params: SamplingParams,
    slot: GroupSlot,
    states: Vec<KdaHybridState>,
    tx: UnboundedSender<KdaEvent>,
    /// Prompt tokens already consumed into `states` (by earlier steps).
    done: usize,
}

/// Prompt tokens one prefill step takes unless set otherwise
/// ([`KdaEngine::set_prefill_step_tokens`]).
const DEFAULT_PREFILL_STEP_TOKENS: usize = 2048;

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
    /// All groups' slots, for accounting.
    all_slots: BlockAllocator,
    latents: LatentPool,
    model: Arc<RwLock<KdaModel>>,
    layout: Layout,
    eos: Vec<u32>,
    vocab: usize,
    max_context: usize,
    num_layers: usize,
    /// Prompt tokens per prefill step (read by the engine thread before each step).
    prefill_step_tokens: Arc<AtomicUsize>,
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
        let prefill_step_tokens = Arc::new(AtomicUsize::new(DEFAULT_PREFILL_STEP_TOKENS));
        let budget = prefill_step_tokens.clone();
        std::thread::Builder::new()
            .name("tandem-kda-engine".into())
            .spawn(move || run(&thread_model, rx, &eos_thread, &budget))
            .expect("spawning the KDA engine thread");
        Self {
            tx,
            slots: (0..dp).map(|_| BlockAllocator::new(slots)).collect(),
            state_lists,
            all_slots: BlockAllocator::new(slots * dp),
            latents,
            model,
            layout,
            eos,
            vocab,
            max_context,
            num_layers,
            prefill_step_tokens,
        }
    }

    /// Prompt tokens one prefill step takes (at least 1): queued prompts share a step, oldest
    /// first, and a prompt longer than what is left continues in the next step, so one long
    /// prompt does not hold up the others' first tokens for its whole length.
    pub fn set_prefill_step_tokens(&self, tokens: usize) {
        self.prefill_step_tokens
            .store(tokens.max(1), Ordering::Relaxed);
    }

    /// All state slots (for accounting).
    pub fn slots(&self) -> &BlockAllocator {
        &self.all_slots
    }

    /// The layout served.
    pub fn layout(&self) -> Layout {
        self.layout
    }

    /// Resolves once no request holds a state slot or a latent block.
    pub async fn wait_idle(&self) {
        self.all_slots.wait_all_free().await;
        self.latents.wait_all_free().await;
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

    /// Takes a state slot on `group` (or the least-loaded one) together with the MLA latent
    /// blocks of `tokens` tokens, so a request admitted here cannot run out of cache later.
    pub fn reserve_for(&self, group: Option<usize>, tokens: usize) -> Result<GroupSlot> {
        let mut slot = self.reserve_on(group)?;
        let mut states = slot.take_states();
        let reserved = reserve_latents(&mut states, tokens, &self.latents);
        slot.put_states(states);
        reserved.map(|()| slot)
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

    /// Prefill role: computes the prompt on the least-loaded attention-DP group (queued prompts
    /// share a step); one `Prefilled` event whose state is the handoff body (prefill layout +
    /// every rank's state of the group).
    pub fn submit_prefill(
        &self,
        prompt: Vec<u32>,
        params: SamplingParams,
    ) -> Result<UnboundedReceiver<KdaEvent>> {
        self.check(&prompt, &params)?;
        let mut slot = self.reserve_for(None, prompt.len())?;
        let states = slot.take_states();
        let (tx, rx) = unbounded_channel();
        self.tx
            .send(Work::Prefill(Box::new(PrefillJob {
                prompt,
                params,
                slot,
                states,
                tx,
                done: 0,
            })))
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
    prefill_step_tokens: &AtomicUsize,
) {
    let dp = shared.read().layout().dp();
    let mut running: Vec<VecDeque<Box<DecodeSeq>>> = (0..dp).map(|_| VecDeque::new()).collect();
    let mut prefills: VecDeque<Box<PrefillJob>> = VecDeque::new();
    loop {
        // Wait for work when there is nothing to step; then take everything queued, so new
        // requests join the next step together.
        if prefills.is_empty() && running.iter().all(VecDeque::is_empty) {
            match rx.recv() {
                Ok(work) => admit(work, &mut running, &mut prefills),
                Err(_) => return,
            }
        }
        while let Ok(work) = rx.try_recv() {
            admit(work, &mut running, &mut prefills);
        }
        step_prefills(
            shared,
            &mut prefills,
            eos,
            prefill_step_tokens.load(Ordering::Relaxed),
        );
        step_decodes(shared, &mut running);
    }
}

fn admit(
    work: Work,
    running: &mut [VecDeque<Box<DecodeSeq>>],
    prefills: &mut VecDeque<Box<PrefillJob>>,
) {
    match work {
        Work::Decode { seq } => running[seq.group].push_back(seq),
        Work::Prefill(job) => prefills.push_back(job),
    }
}

/// One prefill step over the queued prompts, oldest first, `budget` prompt tokens in all
/// (each on its slot's group; a prompt that does not fit continues next step). Each caller
/// whose prompt is complete hears its first token and handoff state.
fn step_prefills(
    shared: &RwLock<KdaModel>,
    queue: &mut VecDeque<Box<PrefillJob>>,
    eos: &[u32],
    budget: usize,
) {
    // Prefills cancelled anywhere in the queue give their slots and blocks back now.
    queue.retain_mut(|job| {
        if job.tx.is_closed() {
            let states = std::mem::take(&mut job.states);
            job.slot.put_states(states);
            false
        } else {
            true
        }
    });
    // (queue index, tokens this step), oldest first.
    let mut picked = Vec::new();
    let mut left = budget.max(1);
    for (i, job) in queue.iter().enumerate() {
        if left == 0 {
            break;
        }
        let take = (job.prompt.len() - job.done).min(left);
        picked.push((i, take));
        left -= take;
    }
    if picked.is_empty() {
        return;
    }
    let model = shared.read();
    let mut work: Vec<(usize, Vec<u32>, Vec<KdaHybridState>)> = picked
        .iter()
        .map(|&(i, take)| {
            let job = &mut queue[i];
            let ids = job.prompt[job.done..job.done + take].to_vec();
            (job.slot.group, ids, std::mem::take(&mut job.states))
        })
        .collect();
    let logits = model.step(&mut work);
    for (&(i, take), (_, _, states)) in picked.iter().zip(work) {
        queue[i].states = states;
        queue[i].done += take;
    }
    if let Err(e) = &logits {
        tracing::warn!(error = %e, "KDA prefill step failed; dropping its requests");
    }
    // Back to front, so the indices stay valid while finished (or failed) jobs leave.
    for (k, &(i, _)) in picked.iter().enumerate().rev() {
        let complete = queue[i].done == queue[i].prompt.len();
        let event = match &logits {
            Ok(_) if !complete => continue,
            Ok(logits) => {
                let job = &queue[i];
                let token = sample(&logits[k], &job.params, 0);
                Some(KdaEvent::Prefilled {
                    first_token: token,
                    finish: finish(token, 1, &job.params, &stop_ids(&job.params, eos)),
                    state: encode_group(model.layout(), &job.states),
                })
            }
            Err(_) => None,
        };
        let Some(job) = queue.remove(i) else {
            continue;
        };
        // The states go back to the slot pool, zeroed, before the caller hears of it.
        let PrefillJob {
            mut slot,
            mut states,
            tx,
            ..
        } = *job;
        slot.put_states(std::mem::take(&mut states));
        drop(slot);
        if let Some(ev) = event {
            let _ = tx.send(ev);
        }
    }
}

/// One decode step for every running request of every group, together (a group's requests
/// share its GEMMs; the groups share the FFN); finished requests leave, the rest requeue.
fn step_decodes(shared: &RwLock<KdaModel>, running: &mut [VecDeque<Box<DecodeSeq>>]) {
    let mut seqs: Vec<Box<DecodeSeq>> = running.iter_mut().flat_map(|q| q.drain(..)).collect();
    // Requests whose caller went away are dropped here (their slots go back).
    seqs.retain(|s| !s.tx.is_closed());
    if seqs.is_empty() {
        return;
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
            return;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kda_hybrid::{KdaHybridModel, LayerState};

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
        // The received body is unpacked on scratch memory, not the worker's bounded pool.
        let received = decode_group(&d.model.read(), &state, prompt.len(), 0).expect("unpack");
        assert_eq!(
            d.latent_blocks(),
            (64, 64),
            "received states take no pool blocks"
        );
        drop(received);
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

    /// Prompts prefilled at once on a two-group layout (sharing steps of four prompt tokens,
    /// the longer ones continuing over several), then decoding at once on another layout (two
    /// on one group, one on the other), step together and each gets the tokens it gets alone;
    /// a decode reservation larger than the latent pool is refused at admission and takes
    /// nothing.
    #[test]
    fn concurrent_decodes_step_together_and_match_one_process() {
        let (dir, model) = tiny();
        let params = SamplingParams {
            ignore_eos: true,
            ..SamplingParams::greedy(5)
        };
        let prompts: Vec<Vec<u32>> = vec![
            vec![9, 40, 7, 18, 250, 6, 91],
            vec![300, 12, 5, 77, 1],
            vec![64, 3],
        ];
        let want: Vec<Vec<u32>> = prompts
            .iter()
            .map(|p| {
                let mut st = model.new_state();
                let mut logits = model.prefill(p, &mut st);
                (0..5)
                    .map(|_| {
                        let t = crate::sampling::argmax(&logits);
                        logits = model.decode_step(t, &mut st);
                        t
                    })
                    .collect()
            })
            .collect();
        drop(model);
        // Prefill on tp4 × dp2 (the prompts, queued together, spread over both groups and
        // share steps); decode on tp2 × dp2.
        let p = KdaEngine::start(
            KdaModel::load(&dir, Layout::new(4, 2, 1).expect("tp4 dp2"), None).expect("load"),
            4,
            256,
            vec![2],
            4096,
        );
        let layout = Layout::new(2, 2, 1).expect("tp2 dp2");
        let d = KdaEngine::start(
            KdaModel::load(&dir, layout, None).expect("load tp2 dp2"),
            4,
            256,
            vec![2],
            4096,
        );
        // Four prompt tokens per prefill step: the prompts share steps and the longer ones
        // continue over several.
        p.set_prefill_step_tokens(4);
        let prefilled: Vec<_> = prompts
            .iter()
            .map(|prompt| {
                p.submit_prefill(prompt.clone(), params.clone())
                    .expect("prefill")
            })
            .collect();
        let mut streams = Vec::new();
        for ((prompt, group), mut rx) in prompts.iter().zip([0, 0, 1]).zip(prefilled) {
            let Some(KdaEvent::Prefilled {
                first_token, state, ..
            }) = rx.blocking_recv()
            else {
                panic!("no prefill event");
            };
            let slot = d.reserve_for(Some(group), prompt.len() + 5).expect("slot");
            let rx = d
                .submit_decode(prompt, params.clone(), slot, &state, first_token)
                .expect("decode");
            streams.push((first_token, rx));
        }
        for ((first, mut rx), want) in streams.into_iter().zip(want) {
            let mut got = vec![first];
            while let Some(KdaEvent::Token { token_id, finish }) = rx.blocking_recv() {
                got.push(token_id);
                if finish.is_some() {
                    break;
                }
            }
            assert_eq!(got, want);
        }
        assert_eq!(d.latent_blocks(), (256, 256), "decode latent blocks back");
        assert_eq!(p.latent_blocks(), (256, 256), "prefill latent blocks back");
        assert_eq!(p.group_free(), vec![4, 4], "prefill slots back");
        // tp2 × dp2 gives each group one rank: 2 MLA layers × latent and rope rows × 16
        // blocks (256 tokens) = 64 blocks fit; 4 × 69 (1,100 tokens) = 276 do not.
        let fits = d.reserve_for(Some(1), 256).expect("fits");
        assert_eq!(d.latent_blocks().1, 256 - 64);
        drop(fits);
        assert!(matches!(
            d.reserve_for(Some(1), 1100),
            Err(Error::CapacityExhausted {
                needed: 276,
                free: 256
            })
        ));
        assert_eq!(
            d.latent_blocks(),
            (256, 256),
            "a refused reservation takes nothing"
        );
        assert_eq!(d.group_free(), vec![4, 4]);
    }
}
