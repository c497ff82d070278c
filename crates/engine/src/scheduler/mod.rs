//! The engine thread. One thread owns the model (any [`ServedModel`]: Llama ranks or a
//! KDA-hybrid layout) with its caches and runs steps; everything else talks to it through
//! [`Engine`], a cheap handle that sends commands over a channel and receives per-request
//! events. Each step batches one token of every running sequence with chunks of prompts
//! under a token budget (continuous batching with chunked prefill), shared among the prompts
//! in progress, so a long prompt makes progress every step without stalling the decodes or
//! the short prompts queued behind it. Prefills and decodes of every attention-DP group mix
//! in one step.

use crate::constraint::{Constrained, Grammars};
use crate::handoff::Handoff;
use crate::kv_pool::{BlockAllocator, KvLayout};
use crate::sampling::SampleRow;
use crate::served::{HandoffSpec, Pools, Reservation, ServedInfo, ServedModel};
use crate::{Error, Result};
use parking_lot::Mutex;
use std::collections::VecDeque;
use std::sync::mpsc;
use std::sync::Arc;
use tandem_core::{FinishReason, SamplingParams, TokenLogprobs};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};
use worker::Worker;

mod snapshots;
mod worker;

/// Engine tuning.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Tokens per KV block.
    pub block_size: usize,
    /// Blocks in the paged pool (K/V, or MLA latents).
    pub num_blocks: usize,
    /// Most tokens (decodes + prefill chunks) in one step.
    pub max_batch_tokens: usize,
    /// Most sequences decoding at once.
    pub max_running: usize,
    /// Request-state slots per attention-DP group (models with per-request state).
    pub state_slots: usize,
    /// The model's `tokenizer.json`, over which structured outputs are constrained; `None`
    /// refuses constrained requests.
    pub tokenizer: Option<std::path::PathBuf>,
    /// Keep full K/V blocks after their request ends and reuse them for prompts that start
    /// with the same tokens (models with a paged K/V cache); for models with per-request
    /// state, keep whole exported states instead (see `prefix_snapshot_bytes`).
    pub prefix_cache: bool,
    /// Host bytes of exported request states kept for prefix caching (models with
    /// per-request state: KDA hybrids).
    pub prefix_snapshot_bytes: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            block_size: 16,
            num_blocks: 1024,
            max_batch_tokens: 512,
            max_running: 64,
            state_slots: 64,
            tokenizer: None,
            prefix_cache: true,
            prefix_snapshot_bytes: 512 << 20,
        }
    }
}

/// What a submitted sequence is for.
#[derive(Debug)]
// Made once per request and moved straight into the engine: boxing the decode's
// reservation would buy nothing.
#[allow(clippy::large_enum_variant)]
pub enum SeqKind {
    /// Prompt in, every generated token out (single process).
    Generate,
    /// Prefill role: prompt in, first token and the prompt's state out.
    Prefill,
    /// Decode role: the prompt's state arrives from a prefill worker with the first token.
    Decode {
        /// Space reserved for this request (see [`Engine::reserve_on`]).
        reservation: Reservation,
        /// The prompt's state as the prefill side exported it.
        handoff: Handoff,
        /// The token the prefill worker sampled.
        first_token: u32,
        /// The prompt's other choices ([`Engine::submit_choices`]), in order: each one's
        /// reservation (after the first of [`crate::Pools::reserve_choices`]) and the token
        /// the prefill worker sampled for it. Empty for one choice.
        forks: Vec<(Reservation, u32)>,
    },
}

/// A token sampled for one choice, with what it means for that choice.
#[derive(Debug)]
pub struct Sampled {
    /// The token.
    pub token: u32,
    /// Set when it already ends the choice.
    pub finish: Option<FinishReason>,
    /// Its log-probabilities, when the choice asked for them.
    pub logprobs: Option<TokenLogprobs>,
}

/// What the engine reports for a sequence.
#[derive(Debug)]
pub enum EngineEvent {
    /// A generated token; `finish` set on the last one.
    Token {
        /// The token.
        token_id: u32,
        /// Why generation ended, on the last token.
        finish: Option<FinishReason>,
        /// Its log-probabilities, when the request asked for them.
        logprobs: Option<TokenLogprobs>,
    },
    /// The log-probabilities of prompt tokens 2.. (the request's `prompt_logprobs`), once
    /// its prompt is computed: right before its first token (each choice's).
    PromptLogprobs(Vec<TokenLogprobs>),
    /// Prefill role: the prompt is computed.
    Prefilled {
        /// The sampled first token.
        first_token: u32,
        /// Set when the first token already ends the request.
        finish: Option<FinishReason>,
        /// The first token's log-probabilities, when the request asked for them.
        logprobs: Option<TokenLogprobs>,
        /// The prompt's state (K/V, or KDA state and MLA latents), typed.
        handoff: Handoff,
        /// The first tokens of the prompt's other choices, in order (empty for one).
        others: Vec<Sampled>,
        /// The log-probabilities of prompt tokens 2.., when the request asked for them.
        prompt_logprobs: Vec<TokenLogprobs>,
    },
    /// The request failed inside the engine (it holds nothing any more).
    Failed(Error),
}

/// Counters read by admin endpoints and benchmarks.
#[derive(Clone, Debug, Default)]
pub struct EngineStats {
    /// Sequences waiting for admission.
    pub waiting: usize,
    /// Sequences admitted and not finished.
    pub running: usize,
    /// Steps run.
    pub steps: u64,
    /// Prompt tokens computed.
    pub prefill_tokens: u64,
    /// Tokens generated.
    pub generated_tokens: u64,
    /// Prompt tokens of requests that looked for a cached prefix.
    pub prefix_queried_tokens: u64,
    /// Of those, tokens whose K/V (or state) came from the prefix cache (not computed).
    pub prefix_hit_tokens: u64,
    /// Host bytes of kept request states (models with per-request state).
    pub prefix_snapshot_bytes: usize,
}

enum Command {
    Submit(Box<Seq>),
    Refresh(std::path::PathBuf, mpsc::Sender<Result<()>>),
    Shutdown,
}

struct Seq {
    tokens: Vec<u32>,
    prompt_len: usize,
    params: SamplingParams,
    stop_ids: Vec<u32>,
    eos_ids: Vec<u32>,
    prefill_only: bool,
    cached: usize,
    reservation: Option<Reservation>,
    import: Option<Handoff>,
    /// Structured outputs: the grammar the output follows.
    constraint: Option<Box<Constrained>>,
    /// Why the sequence cannot go on (its grammar failed); it ends with this error.
    failure: Option<Error>,
    tx: UnboundedSender<EngineEvent>,
    /// The prompt's other choices (n > 1), each started as a sequence of its own once
    /// the prompt is computed, sharing its cache.
    followers: Vec<Follower>,
    /// `prompt_logprobs`: those of the prompt tokens computed so far (after the first).
    scored: Vec<TokenLogprobs>,
}

/// Another choice of a sequence's prompt, waiting for the prompt.
struct Follower {
    params: SamplingParams,
    stop_ids: Vec<u32>,
    constraint: Option<Box<Constrained>>,
    failure: Option<Error>,
    /// Where it decodes (a generating sequence's; a decode's comes with the request).
    reservation: Option<Reservation>,
    /// Decode role: the token the prefill worker sampled for it.
    first_token: Option<u32>,
    tx: UnboundedSender<EngineEvent>,
}

impl Seq {
    /// A sequence of `tokens` (the prompt's first `prompt_len`) that holds nothing yet.
    fn new(
        tokens: Vec<u32>,
        prompt_len: usize,
        params: SamplingParams,
        eos_ids: Vec<u32>,
        prefill_only: bool,
        tx: UnboundedSender<EngineEvent>,
    ) -> Self {
        Seq {
            tokens,
            prompt_len,
            stop_ids: stop_ids(&params, &eos_ids),
            eos_ids,
            params,
            prefill_only,
            cached: 0,
            reservation: None,
            import: None,
            constraint: None,
            failure: None,
            tx,
            followers: Vec::new(),
            scored: Vec::new(),
        }
    }

    /// The sampling row of this sequence (or of a choice following it: its `params`,
    /// `stop_ids` and grammar) for its next token.
    fn sample_row<'a>(
        &'a self,
        params: &'a SamplingParams,
        stop_ids: &'a [u32],
        constraint: &'a Option<Box<Constrained>>,
    ) -> SampleRow<'a> {
        // A resumed request's last prompt tokens are output of its earlier attempt.
        let resumed = (self.params.resumed as usize).min(self.prompt_len);
        let split = self.prompt_len - resumed;
        SampleRow {
            params,
            step: (resumed + self.generated()) as u32,
            prompt: &self.tokens[..split],
            output: &self.tokens[split..],
            stop_ids,
            allowed: constraint.as_ref().map(|c| c.mask()),
        }
    }

    /// Nobody listens any more: neither the sequence's caller nor any follower's.
    fn abandoned(&self) -> bool {
        self.tx.is_closed() && self.followers.iter().all(|f| f.tx.is_closed())
    }

    /// Sends `e` to the sequence's caller and every follower's.
    fn fail(&mut self, e: Error) {
        for f in self.followers.drain(..) {
            let _ = f.tx.send(EngineEvent::Failed(e.again()));
        }
        let _ = self.tx.send(EngineEvent::Failed(e));
    }

    /// Follower `f` as a sequence of its own over `reservation`, its prompt computed.
    fn forked(&self, f: Follower, reservation: Reservation) -> Seq {
        let mut tokens = Vec::with_capacity(self.wanted() + 1);
        tokens.extend_from_slice(&self.tokens[..self.prompt_len]);
        Seq {
            tokens,
            prompt_len: self.prompt_len,
            stop_ids: f.stop_ids,
            eos_ids: self.eos_ids.clone(),
            params: f.params,
            prefill_only: false,
            cached: self.prompt_len,
            reservation: Some(reservation),
            import: None,
            constraint: f.constraint,
            failure: f.failure,
            tx: f.tx,
            followers: Vec::new(),
            scored: self.scored.clone(),
        }
    }

    fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// Tokens this sequence holds space for.
    fn wanted(&self) -> usize {
        if self.prefill_only {
            self.prompt_len
        } else {
            self.prompt_len + self.params.max_tokens as usize
        }
    }

    fn finish_reason(&self, token: u32) -> Option<FinishReason> {
        let complete = self.constraint.as_ref().is_some_and(|c| c.is_complete());
        if self.stop_ids.contains(&token) || complete {
            Some(FinishReason::Stop)
        } else if self.generated() >= self.params.max_tokens as usize {
            Some(FinishReason::Length)
        } else {
            None
        }
    }
}

/// The generated token ids of one request's event stream, until it finishes (or ends),
/// waiting on the calling thread: for command-line tools and tests, not async code.
pub fn blocking_tokens(mut events: UnboundedReceiver<EngineEvent>) -> Vec<u32> {
    let mut out = Vec::new();
    while let Some(ev) = events.blocking_recv() {
        if let EngineEvent::Token {
            token_id, finish, ..
        } = ev
        {
            out.push(token_id);
            if finish.is_some() {
                break;
            }
        }
    }
    out
}

/// Handle to a running engine thread. Cloning shares the thread.
#[derive(Clone)]
pub struct Engine {
    tx: mpsc::Sender<Command>,
    pools: Pools,
    info: ServedInfo,
    spec: Arc<dyn HandoffSpec>,
    /// Structured outputs' grammar compiler, or why there is none.
    grammars: std::result::Result<Arc<Grammars>, String>,
    stats: Arc<Mutex<EngineStats>>,
    max_running: usize,
    _thread: Arc<ThreadGuard>,
}

struct ThreadGuard {
    tx: mpsc::Sender<Command>,
    handle: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Drop for ThreadGuard {
    fn drop(&mut self) {
        let _ = self.tx.send(Command::Shutdown);
        if let Some(h) = self.handle.lock().take() {
            let _ = h.join();
        }
    }
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("info", &self.info)
            .finish_non_exhaustive()
    }
}

impl Engine {
    /// Starts the engine thread for the model `build` makes (on that thread, which then
    /// owns it and its caches).
    pub fn start_served<M, F>(build: F, config: EngineConfig) -> Result<Self>
    where
        M: ServedModel,
        F: FnOnce() -> Result<M> + Send + 'static,
    {
        let stats = Arc::new(Mutex::new(EngineStats::default()));
        let tokenizer = config.tokenizer.clone();
        let max_running = config.max_running;
        let (tx, rx) = mpsc::channel();
        let thread_stats = stats.clone();
        let (ready_tx, ready_rx) = mpsc::channel();
        let handle = std::thread::Builder::new()
            .name("tandem-engine".into())
            .stack_size(16 << 20)
            .spawn(move || {
                // The engine thread joins a compute pool of its own as worker 0, so the
                // kernels' parallel loops split work with it instead of handing every
                // operation across to the global pool and sleeping until it is done.
                let _pool = compute_pool();
                let model = match build() {
                    Ok(m) => m,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                let pools = model.pools();
                let _ = ready_tx.send(Ok((model.info(), pools.clone(), model.handoff_spec())));
                let stateful = pools.kv.is_none() && !pools.slots.is_empty();
                let snapshot_bytes = if config.prefix_cache && stateful {
                    config.prefix_snapshot_bytes
                } else {
                    0
                };
                let mut worker = Worker {
                    snapshots: snapshots::Snapshots::new(snapshot_bytes),
                    spec: model.handoff_spec(),
                    score_rows: model.info().score_rows,
                    model,
                    sampled: Vec::with_capacity(config.max_running),
                    logprobs: Vec::with_capacity(config.max_running),
                    config,
                    rx,
                    pools,
                    stats: thread_stats,
                    waiting: VecDeque::new(),
                    running: Vec::new(),
                };
                worker.run();
            })
            .map_err(|e| Error::Collective(format!("spawning the engine thread: {e}")))?;
        let (info, pools, spec) = ready_rx.recv().map_err(|_| Error::Stopped)??;
        let grammars = match &tokenizer {
            None => Err("this worker was started without a tokenizer".to_string()),
            Some(path) => Grammars::from_tokenizer_file(path, info.vocab_size, &info.eos_ids)
                .map(Arc::new)
                .map_err(|e| {
                    tracing::warn!(error = %e, "structured outputs are off");
                    e.to_string()
                }),
        };
        Ok(Self {
            tx: tx.clone(),
            pools,
            info,
            spec,
            grammars,
            stats,
            max_running,
            _thread: Arc::new(ThreadGuard {
                tx,
                handle: Mutex::new(Some(handle)),
            }),
        })
    }

    /// Replaces the weights with those of checkpoint `dir` (same configuration) between two
    /// steps, in place: requests in flight continue on the new weights, recorded steps
    /// replay with them. Blocks until done.
    pub fn refresh_weights(&self, dir: &std::path::Path) -> Result<()> {
        let (tx, rx) = mpsc::channel();
        self.tx
            .send(Command::Refresh(dir.to_path_buf(), tx))
            .map_err(|_| Error::Stopped)?;
        rx.recv().map_err(|_| Error::Stopped)?
    }

    /// Facts about the model served.
    pub fn info(&self) -> &ServedInfo {
        &self.info
    }

    /// Tensor-parallel ranks of the model.
    pub fn tp(&self) -> usize {
        self.info.layout.tp()
    }

    /// Submits a sequence. Events arrive on the returned channel; dropping it cancels the
    /// sequence and frees what it holds. A decode's handoff is checked (and resharded) here,
    /// so one that does not fit this model is refused before it reaches the engine.
    pub fn submit(
        &self,
        prompt: Vec<u32>,
        params: SamplingParams,
        kind: SeqKind,
    ) -> Result<UnboundedReceiver<EngineEvent>> {
        let mut rx = self.submit_choices(prompt, vec![params], kind)?;
        Ok(rx.remove(0))
    }

    /// Submits `choices.len()` choices of one prompt (OpenAI's `n`; the choices differ in
    /// their seeds, nothing else that sizes them): the prompt is computed once, each choice
    /// samples its first token from its logits, then decodes on its own over the prompt's
    /// cache (full K/V blocks shared, the partial one copied; state copied). One channel per
    /// choice, in order; dropping one cancels that choice. A prefill sends every choice's
    /// first token in one [`EngineEvent::Prefilled`] on the first channel; a decode's other
    /// choices come with `forks`.
    pub fn submit_choices(
        &self,
        prompt: Vec<u32>,
        choices: Vec<SamplingParams>,
        kind: SeqKind,
    ) -> Result<Vec<UnboundedReceiver<EngineEvent>>> {
        let Some(params) = choices.first() else {
            return Err(Error::InvalidRequest("no choices".into()));
        };
        if prompt.is_empty() {
            return Err(Error::InvalidRequest("empty prompt".into()));
        }
        if params.max_tokens == 0 {
            return Err(Error::InvalidRequest(
                "max_tokens must be at least 1".into(),
            ));
        }
        if choices.len() > self.max_running {
            return Err(Error::InvalidRequest(format!(
                "{} choices exceed the {} sequences this engine runs at once",
                choices.len(),
                self.max_running
            )));
        }
        if choices
            .iter()
            .any(|c| (c.max_tokens, c.resumed) != (params.max_tokens, params.resumed))
        {
            return Err(Error::InvalidRequest(
                "the choices of one prompt must share max_tokens".into(),
            ));
        }
        if params.resumed > 0 && params.resumed as usize >= prompt.len() {
            return Err(Error::InvalidRequest(format!(
                "{} resumed tokens leave no prompt of the {} given",
                params.resumed,
                prompt.len()
            )));
        }
        if params.prompt_logprobs.is_some() && self.info.score_rows == 0 {
            return Err(Error::InvalidRequest(format!(
                "prompt log-probabilities are not available for this model ({})",
                self.info.family
            )));
        }
        if let Some(&bad) = prompt.iter().find(|&&t| t as usize >= self.info.vocab_size) {
            return Err(Error::InvalidRequest(format!(
                "token id {bad} is outside the vocabulary"
            )));
        }
        let total = prompt.len() + params.max_tokens as usize;
        if total > self.info.max_context {
            return Err(Error::InvalidRequest(format!(
                "prompt ({}) + max_tokens ({}) exceeds the context length {}",
                prompt.len(),
                params.max_tokens,
                self.info.max_context
            )));
        }
        let prompt_len = prompt.len();
        let mut choices = choices.into_iter();
        let params = choices.next().expect("checked: one choice at least");
        let (tx, rx) = unbounded_channel();
        let mut receivers = vec![rx];
        let prefill_only = matches!(kind, SeqKind::Prefill);
        let eos_ids = self.info.eos_ids.clone();
        let mut seq = Seq::new(prompt, prompt_len, params, eos_ids, prefill_only, tx);
        let mut forks = Vec::new();
        match kind {
            SeqKind::Decode {
                reservation,
                handoff,
                first_token,
                forks: others,
            } => {
                if others.len() != choices.len() {
                    return Err(Error::InvalidRequest(format!(
                        "{} choices come with {} forks",
                        choices.len() + 1,
                        others.len()
                    )));
                }
                for r in std::iter::once(&reservation).chain(others.iter().map(|(r, _)| r)) {
                    if r.tokens() < total {
                        return Err(Error::InvalidRequest(format!(
                            "the reservation holds {} tokens, the request needs {total}",
                            r.tokens()
                        )));
                    }
                }
                seq.import = Some(self.spec.prepare(handoff, prompt_len, &reservation)?);
                seq.reservation = Some(reservation);
                seq.tokens.push(first_token);
                forks = others;
            }
            SeqKind::Generate | SeqKind::Prefill => self.pools.check_fits(seq.wanted())?,
        }
        // What this request already generated (resumed output, a decode's first token).
        let resumed = (seq.params.resumed as usize).min(prompt_len);
        seq.constraint = self.constrain(&seq.params, &seq.tokens[prompt_len - resumed..])?;
        let mut forks = forks.into_iter();
        for params in choices {
            let (tx, rx) = unbounded_channel();
            receivers.push(rx);
            let (reservation, first_token) = forks.next().unzip();
            let mut so_far = seq.tokens[prompt_len - resumed..prompt_len].to_vec();
            so_far.extend(first_token);
            seq.followers.push(Follower {
                constraint: self.constrain(&params, &so_far)?,
                stop_ids: stop_ids(&params, &self.info.eos_ids),
                params,
                failure: None,
                reservation,
                first_token,
                tx,
            });
        }
        self.tx
            .send(Command::Submit(Box::new(seq)))
            .map_err(|_| Error::Stopped)?;
        Ok(receivers)
    }

    /// The grammar a request's output follows, having read `so_far` of it.
    fn constrain(
        &self,
        params: &SamplingParams,
        so_far: &[u32],
    ) -> Result<Option<Box<Constrained>>> {
        let Some(c) = &params.constraint else {
            return Ok(None);
        };
        let grammars = self.grammars.as_ref().map_err(|why| {
            Error::InvalidRequest(format!("structured outputs are not available: {why}"))
        })?;
        let mut constrained = grammars.constrain(c)?;
        constrained.consume(so_far)?;
        Ok(Some(Box::new(constrained)))
    }

    /// Reserves space for a decode of `tokens` tokens (prompt + max_tokens).
    pub fn reserve(&self, tokens: usize) -> Result<Reservation> {
        self.reserve_on(tokens, None)
    }

    /// Reserves space for a decode of `tokens` tokens on attention-DP group `group` (or the
    /// one with the most room).
    pub fn reserve_on(&self, tokens: usize, group: Option<usize>) -> Result<Reservation> {
        self.pools.reserve(tokens, group)
    }

    /// The pools requests draw on (for accounting).
    pub fn pools(&self) -> &Pools {
        &self.pools
    }

    /// The paged K/V pool's allocator.
    ///
    /// # Panics
    /// For a model without paged K/V (KDA hybrids: see [`Engine::pools`]).
    pub fn allocator(&self) -> &BlockAllocator {
        &self
            .pools
            .kv
            .as_ref()
            .expect("this model has no paged K/V pool")
            .0
    }

    /// The K/V cache's shape (the whole model's).
    ///
    /// # Panics
    /// For a model without paged K/V.
    pub fn layout(&self) -> KvLayout {
        self.info.kv.expect("this model has no paged K/V cache")
    }

    /// Context length of the model.
    pub fn max_context(&self) -> usize {
        self.info.max_context
    }

    /// Bytes of weights one batch-1 decode step reads.
    pub fn weight_bytes(&self) -> usize {
        self.info.weight_bytes
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> EngineStats {
        self.stats.lock().clone()
    }
}

/// The tokens that end a request of `params` (its stop ids, and the model's end-of-sequence
/// ids unless it ignores them).
fn stop_ids(params: &SamplingParams, eos_ids: &[u32]) -> Vec<u32> {
    let mut stop = params.stop_token_ids.clone();
    if !params.ignore_eos {
        stop.extend(eos_ids);
    }
    stop
}

/// A rayon pool as wide as the global one whose worker 0 is the calling thread (kept while
/// the returned pool lives); `None` (the global pool serves) where it cannot be built.
fn compute_pool() -> Option<rayon::ThreadPool> {
    match rayon::ThreadPoolBuilder::new()
        .num_threads(rayon::current_num_threads())
        .thread_name(|i| format!("tandem-compute-{i}"))
        .use_current_thread()
        .build()
    {
        Ok(pool) => Some(pool),
        Err(e) => {
            tracing::warn!(error = %e, "no compute pool of the engine's own; the global one serves");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::compute_pool;
    use rayon::prelude::*;

    #[test]
    fn the_engine_thread_computes_as_worker_zero_of_its_own_pool() {
        std::thread::spawn(|| {
            assert_eq!(
                rayon::current_thread_index(),
                None,
                "a plain thread at first"
            );
            let pool = compute_pool().expect("a compute pool");
            assert_eq!(rayon::current_thread_index(), Some(0));
            assert_eq!(pool.current_num_threads(), rayon::current_num_threads());
            // Parallel loops from this thread run on its pool (every task sees a worker index
            // of it), with this thread taking part rather than waiting on another pool.
            let seen: Vec<Option<usize>> = (0..64)
                .into_par_iter()
                .map(|_| rayon::current_thread_index())
                .collect();
            assert!(seen
                .iter()
                .all(|i| i.is_some_and(|i| i < pool.current_num_threads())));
            assert!(
                seen.contains(&Some(0)),
                "the engine thread did none of the work"
            );
            drop(pool);
        })
        .join()
        .expect("the checks passed on their thread");
    }
}
