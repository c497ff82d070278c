//! The engine thread. One thread owns the model and the KV cache and runs steps; everything
//! else talks to it through [`Engine`], a cheap handle that sends commands over a channel and
//! receives per-request events. Each step batches one token of every running sequence with
//! chunks of prompts under a token budget (continuous batching with chunked prefill), shared
//! among the prompts in progress, so a long prompt makes progress every step without stalling
//! the decodes or the short prompts queued behind it.

use crate::backend::Ops;
use crate::batch::ForwardBatch;
use crate::kv_pool::{BlockAllocation, BlockAllocator, KvLayout};
use crate::llama::LlamaModel;
use crate::llama_ranks::LlamaRanks;
use crate::step::StepLimits;
use crate::tensor::HostTensor;
use crate::{Error, Result};
use parking_lot::Mutex;
use std::collections::VecDeque;
use std::sync::mpsc;
use std::sync::Arc;
use tandem_core::{FinishReason, SamplingParams};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

/// Engine tuning.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Tokens per KV block.
    pub block_size: usize,
    /// Blocks in the KV pool.
    pub num_blocks: usize,
    /// Most tokens (decodes + prefill chunks) in one step.
    pub max_batch_tokens: usize,
    /// Most sequences decoding at once.
    pub max_running: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            block_size: 16,
            num_blocks: 1024,
            max_batch_tokens: 512,
            max_running: 64,
        }
    }
}

/// What a submitted sequence is for.
#[derive(Debug)]
pub enum SeqKind {
    /// Prompt in, every generated token out (single process).
    Generate,
    /// Prefill role: prompt in, first token and the prompt's KV out.
    Prefill,
    /// Decode role: the prompt's KV arrives from a prefill worker with the first token.
    Decode {
        /// Blocks reserved for this request (see [`Engine::reserve`]).
        allocation: BlockAllocation,
        /// The prompt's K/V in the transfer layout (see `Ops::read_kv`), in the cache's dtype.
        kv: HostTensor,
        /// The token the prefill worker sampled.
        first_token: u32,
    },
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
    },
    /// Prefill role: the prompt is computed.
    Prefilled {
        /// The sampled first token.
        first_token: u32,
        /// Set when the first token already ends the request.
        finish: Option<FinishReason>,
        /// The prompt's K/V in transfer layout, in the cache's dtype.
        kv: HostTensor,
    },
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
    prefill_only: bool,
    cached: usize,
    allocation: Option<BlockAllocation>,
    import: Option<HostTensor>,
    tx: UnboundedSender<EngineEvent>,
}

impl Seq {
    fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    fn finish_reason(&self, token: u32) -> Option<FinishReason> {
        if self.stop_ids.contains(&token) {
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
        if let EngineEvent::Token { token_id, finish } = ev {
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
    allocator: BlockAllocator,
    layout: KvLayout,
    stats: Arc<Mutex<EngineStats>>,
    eos_ids: Vec<u32>,
    max_context: usize,
    vocab_size: usize,
    weight_bytes: usize,
    tp: usize,
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
            .field("layout", &self.layout)
            .finish_non_exhaustive()
    }
}

impl Engine {
    /// Starts the engine thread for `model`.
    pub fn start<B: Ops>(model: LlamaModel<B>, config: EngineConfig) -> Self {
        match Self::start_sharded(vec![model], config) {
            Ok(engine) => engine,
            // One whole model always makes one rank.
            Err(e) => panic!("starting the engine: {e}"),
        }
    }

    /// Starts the engine thread for the tensor-parallel shards of one model (rank order,
    /// joined by communicators): rank 0 runs in the engine thread, each other rank in its own.
    pub fn start_sharded<B: Ops>(shards: Vec<LlamaModel<B>>, config: EngineConfig) -> Result<Self> {
        let first = shards
            .first()
            .ok_or_else(|| Error::InvalidRequest("no model shards".into()))?;
        let allocator = BlockAllocator::new(config.num_blocks);
        let stats = Arc::new(Mutex::new(EngineStats::default()));
        let (tx, rx) = mpsc::channel();
        let eos_ids = first.config().eos_token_ids();
        let max_context = first.config().max_position_embeddings;
        let vocab_size = first.config().vocab_size;
        let weight_bytes = first.weight_bytes() * shards.len();
        let tp = shards.len();
        let limits = StepLimits {
            max_tokens: config.max_batch_tokens + config.max_running,
            max_seqs: config.max_running,
            max_blocks_per_seq: max_context.div_ceil(config.block_size),
        };
        let thread_stats = stats.clone();
        let thread_alloc = allocator.clone();
        let (ready_tx, ready_rx) = mpsc::channel();
        let handle = std::thread::Builder::new()
            .name("tandem-engine".into())
            .spawn(move || {
                let ranks =
                    match LlamaRanks::new(shards, limits, config.block_size, config.num_blocks) {
                        Ok(r) => r,
                        Err(e) => {
                            let _ = ready_tx.send(Err(e));
                            return;
                        }
                    };
                let _ = ready_tx.send(Ok(ranks.layout()));
                let mut worker = Worker {
                    ranks,
                    sampled: Vec::with_capacity(limits.max_seqs),
                    config,
                    rx,
                    allocator: thread_alloc,
                    stats: thread_stats,
                    waiting: VecDeque::new(),
                    running: Vec::new(),
                };
                worker.run();
            })
            .map_err(|e| Error::Collective(format!("spawning the engine thread: {e}")))?;
        let layout = ready_rx.recv().map_err(|_| Error::Stopped)??;
        Ok(Self {
            tx: tx.clone(),
            allocator,
            layout,
            stats,
            eos_ids,
            max_context,
            vocab_size,
            weight_bytes,
            tp,
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

    /// Tensor-parallel ranks of the model.
    pub fn tp(&self) -> usize {
        self.tp
    }

    /// Submits a sequence. Events arrive on the returned channel; dropping it cancels the
    /// sequence and frees its KV.
    pub fn submit(
        &self,
        prompt: Vec<u32>,
        params: SamplingParams,
        kind: SeqKind,
    ) -> Result<UnboundedReceiver<EngineEvent>> {
        if prompt.is_empty() {
            return Err(Error::InvalidRequest("empty prompt".into()));
        }
        if params.max_tokens == 0 {
            return Err(Error::InvalidRequest(
                "max_tokens must be at least 1".into(),
            ));
        }
        if let Some(&bad) = prompt.iter().find(|&&t| t as usize >= self.vocab_size) {
            return Err(Error::InvalidRequest(format!(
                "token id {bad} is outside the vocabulary"
            )));
        }
        let total = prompt.len() + params.max_tokens as usize;
        if total > self.max_context {
            return Err(Error::InvalidRequest(format!(
                "prompt ({}) + max_tokens ({}) exceeds the context length {}",
                prompt.len(),
                params.max_tokens,
                self.max_context
            )));
        }
        let mut stop_ids = params.stop_token_ids.clone();
        if !params.ignore_eos {
            stop_ids.extend(&self.eos_ids);
        }
        let (tx, rx) = unbounded_channel();
        let prompt_len = prompt.len();
        let mut seq = Seq {
            tokens: prompt,
            prompt_len,
            params,
            stop_ids,
            prefill_only: matches!(kind, SeqKind::Prefill),
            cached: 0,
            allocation: None,
            import: None,
            tx,
        };
        if let SeqKind::Decode {
            allocation,
            kv,
            first_token,
        } = kind
        {
            let expected = prompt_len * self.layout.values_per_token();
            if kv.dtype() != self.layout.dtype || kv.len() != expected {
                return Err(Error::InvalidRequest(format!(
                    "KV for {prompt_len} tokens must hold {expected} {} values, got {} {}",
                    self.layout.dtype,
                    kv.len(),
                    kv.dtype()
                )));
            }
            if allocation.blocks().len() < self.layout.blocks_for(total) {
                return Err(Error::InvalidRequest(
                    "reservation too small for the request".into(),
                ));
            }
            seq.allocation = Some(allocation);
            seq.import = Some(kv);
            seq.tokens.push(first_token);
        }
        self.tx
            .send(Command::Submit(Box::new(seq)))
            .map_err(|_| Error::Stopped)?;
        Ok(rx)
    }

    /// Reserves blocks for a request of `tokens` tokens (prompt + max_tokens).
    pub fn reserve(&self, tokens: usize) -> Result<BlockAllocation> {
        self.allocator.allocate(self.layout.blocks_for(tokens))
    }

    /// The KV pool's allocator (for accounting).
    pub fn allocator(&self) -> &BlockAllocator {
        &self.allocator
    }

    /// The KV cache's shape.
    pub fn layout(&self) -> KvLayout {
        self.layout
    }

    /// Context length of the model.
    pub fn max_context(&self) -> usize {
        self.max_context
    }

    /// Bytes of weights one batch-1 decode step reads.
    pub fn weight_bytes(&self) -> usize {
        self.weight_bytes
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> EngineStats {
        self.stats.lock().clone()
    }
}

struct Worker<B: Ops> {
    ranks: LlamaRanks<B>,
    sampled: Vec<u32>,
    config: EngineConfig,
    rx: mpsc::Receiver<Command>,
    allocator: BlockAllocator,
    stats: Arc<Mutex<EngineStats>>,
    waiting: VecDeque<Box<Seq>>,
    running: Vec<Seq>,
}

impl<B: Ops> Worker<B> {
    fn run(&mut self) {
        loop {
            // Block only when there is nothing to compute.
            let idle = self.running.is_empty() && self.waiting.is_empty();
            let first = if idle {
                match self.rx.recv() {
                    Ok(c) => Some(c),
                    Err(_) => return,
                }
            } else {
                None
            };
            for cmd in first
                .into_iter()
                .chain(std::iter::from_fn(|| self.rx.try_recv().ok()))
            {
                match cmd {
                    Command::Submit(seq) => self.waiting.push_back(seq),
                    Command::Refresh(dir, reply) => {
                        let result = self.ranks.refresh(&dir);
                        match &result {
                            Ok(()) => {
                                tracing::info!(dir = %dir.display(), "weights refreshed in place")
                            }
                            Err(e) => {
                                tracing::warn!(dir = %dir.display(), error = %e, "weight refresh failed")
                            }
                        }
                        let _ = reply.send(result);
                    }
                    Command::Shutdown => return,
                }
            }
            self.admit();
            self.step();
            let mut s = self.stats.lock();
            s.waiting = self.waiting.len();
            s.running = self.running.len();
        }
    }

    fn admit(&mut self) {
        self.waiting.retain(|s| !s.tx.is_closed());
        while self.running.len() < self.config.max_running {
            let Some(mut seq) = self.waiting.pop_front() else {
                break;
            };
            if seq.allocation.is_none() {
                let want = seq.prompt_len + seq.params.max_tokens as usize;
                let blocks = want.div_ceil(self.config.block_size);
                if blocks > self.config.num_blocks {
                    // Can never fit: fail now rather than wait forever. Dropping the sender
                    // ends the receiver's stream with no finish reason (an error to callers).
                    tracing::warn!(blocks, "request larger than the whole KV pool");
                    continue;
                }
                match self.allocator.allocate(blocks) {
                    Ok(a) => seq.allocation = Some(a),
                    Err(_) => {
                        self.waiting.push_front(seq);
                        break;
                    }
                }
            }
            if let (Some(kv), Some(alloc)) = (seq.import.take(), seq.allocation.as_ref()) {
                let imported = self
                    .ranks
                    .write_kv_host(alloc.blocks(), seq.prompt_len, &kv);
                if let Err(e) = imported {
                    // Checked at submission; dropping the sender fails the request.
                    tracing::warn!(error = %e, "KV import refused");
                    continue;
                }
                seq.cached = seq.prompt_len;
            }
            self.running.push(*seq);
        }
    }

    fn step(&mut self) {
        self.running.retain(|s| !s.tx.is_closed());
        if self.running.is_empty() {
            return;
        }
        let bs = self.config.block_size;
        let mut batch = ForwardBatch::default();
        let mut budget = self.config.max_batch_tokens;
        let mut in_batch = Vec::new();
        // Decodes first: one token each.
        for (i, seq) in self.running.iter().enumerate() {
            if seq.cached + 1 == seq.tokens.len() && seq.cached >= seq.prompt_len {
                let blocks = seq
                    .allocation
                    .as_ref()
                    .map(|a| a.blocks())
                    .unwrap_or_default();
                batch.push(&seq.tokens[seq.cached..], seq.cached, blocks, bs, true);
                in_batch.push((i, 1));
                budget = budget.saturating_sub(1);
            }
        }
        // Then prompt chunks. The budget left is shared: prompts in order of what they have
        // left, each taking at most an equal share of what remains, so a short prompt queued
        // behind a long one finishes in a step while the long one still progresses every
        // step (it gets at least budget / prompts), and what a short one leaves flows on to
        // the longer ones. At least one token per step, so a prefill is never starved.
        let mut prompts: Vec<usize> = (0..self.running.len())
            .filter(|&i| self.running[i].cached < self.running[i].prompt_len)
            .collect();
        prompts.sort_by_key(|&i| self.running[i].tokens.len() - self.running[i].cached);
        let mut left = prompts.len();
        for i in prompts {
            let seq = &self.running[i];
            if budget == 0 && !in_batch.is_empty() {
                break;
            }
            let remaining = seq.tokens.len() - seq.cached;
            let n = remaining.min((budget / left).max(1));
            left -= 1;
            let blocks = seq
                .allocation
                .as_ref()
                .map(|a| a.blocks())
                .unwrap_or_default();
            let done = seq.cached + n == seq.tokens.len();
            batch.push(
                &seq.tokens[seq.cached..seq.cached + n],
                seq.cached,
                blocks,
                bs,
                done,
            );
            in_batch.push((i, n));
            budget = budget.saturating_sub(n);
        }
        if batch.num_tokens() == 0 {
            return;
        }
        if let Err(e) = self.ranks.step(&batch) {
            // A failed rank (or metadata that does not fit, which the limits rule out) fails
            // every request in flight rather than leaving them waiting.
            tracing::error!(error = %e, "engine step failed; failing the requests in flight");
            self.running.clear();
            self.waiting.clear();
            let mut s = self.stats.lock();
            s.running = 0;
            s.waiting = 0;
            return;
        }
        // Sample on the device: one (params, step) per logits row, in batch order.
        let sampling: Vec<_> = in_batch
            .iter()
            .map(|&(i, n)| (&self.running[i], n))
            .filter(|(seq, n)| seq.cached + n == seq.tokens.len())
            .map(|(seq, _)| (&seq.params, seq.generated() as u32))
            .collect();
        let vocab = self.ranks.model().config().vocab_size;
        self.ranks
            .backend()
            .sample(self.ranks.logits(), vocab, &sampling, &mut self.sampled);
        drop(sampling);
        let mut rows = self.sampled.iter().copied();
        let mut finished = Vec::new();
        // Finished sequences leave the counters before their caller hears of it, like their
        // blocks, so a drained engine reads as drained.
        let stats = self.stats.clone();
        let leave = || {
            let mut s = stats.lock();
            s.running = s.running.saturating_sub(1);
        };
        let (mut prefilled, mut generated) = (0u64, 0u64);
        for (i, n) in in_batch {
            let seq = &mut self.running[i];
            let was_prompt = seq.cached < seq.prompt_len;
            seq.cached += n;
            if was_prompt {
                prefilled += n as u64;
            }
            if seq.cached < seq.tokens.len() {
                continue; // more prompt chunks to go
            }
            let Some(token) = rows.next() else { break };
            seq.tokens.push(token);
            generated += 1;
            let finish = seq.finish_reason(token);
            let sent = if seq.prefill_only {
                let blocks = seq
                    .allocation
                    .as_ref()
                    .map(|a| a.blocks())
                    .unwrap_or_default();
                let kv = match self.ranks.read_kv(blocks, seq.prompt_len) {
                    Ok(kv) => kv,
                    Err(e) => {
                        tracing::error!(error = %e, "reading a prompt's K/V failed");
                        finished.push(i);
                        continue;
                    }
                };
                // Free the blocks before the caller hears of it, so accounting is exact.
                seq.allocation = None;
                leave();
                finished.push(i);
                seq.tx.send(EngineEvent::Prefilled {
                    first_token: token,
                    finish,
                    kv,
                })
            } else {
                if finish.is_some() {
                    seq.allocation = None;
                    leave();
                    finished.push(i);
                }
                seq.tx.send(EngineEvent::Token {
                    token_id: token,
                    finish,
                })
            };
            if sent.is_err() {
                finished.push(i);
            }
        }
        finished.sort_unstable();
        finished.dedup();
        for i in finished.into_iter().rev() {
            self.running.swap_remove(i);
        }
        let mut s = self.stats.lock();
        s.steps += 1;
        s.prefill_tokens += prefilled;
        s.generated_tokens += generated;
    }
}
