//! The ranks of one Llama engine: rank 0 runs in the engine thread, the others (tensor
//! parallelism) each in a thread of their own with their shard, KV cache (their KV heads),
//! step metadata, workspace and recorded steps. Every step goes to all ranks at once; the
//! ranks' collectives join them inside the forward pass; rank 0's logits are sampled. K/V
//! leaving or entering the engine (P/D handoffs) is gathered from and scattered to the ranks
//! in the full layout, so a handoff does not depend on either side's tensor parallelism.

use crate::backend::Ops;
use crate::batch::ForwardBatch;
use crate::handoff::{Handoff, Segment, SegmentKind};
use crate::kv_pool::{BlockAllocator, KvCache, KvLayout};
use crate::models::llama::{LlamaModel, LlamaWorkspace};
use crate::sampling::SampleRow;
use crate::scheduler::EngineConfig;
use crate::served::{
    sample_logits, score_logits, HandoffSpec, Pools, Reservation, ServedInfo, ServedModel,
};
use crate::step::{StepLimits, StepMeta};
use crate::tensor::{HostTensor, Tensor};
use crate::{Error, Result};
use std::ops::Range;
use std::sync::{mpsc, Arc};
use tandem_core::BlockId;
use tandem_core::TokenLogprobs;

/// One rank's model and buffers.
struct Rank<B: Ops> {
    model: LlamaModel<B>,
    cache: KvCache<B>,
    meta: StepMeta<B>,
    ws: LlamaWorkspace<B>,
    graphs: B::Graphs,
}

impl<B: Ops> Rank<B> {
    fn new(model: LlamaModel<B>, limits: StepLimits, block_size: usize, num_blocks: usize) -> Self {
        let cache = KvCache::new(model.backend(), model.kv_layout(block_size, num_blocks));
        let meta = StepMeta::new(model.backend(), limits);
        let ws = model.workspace(limits);
        Self {
            model,
            cache,
            meta,
            ws,
            graphs: B::Graphs::default(),
        }
    }

    fn step(&mut self, batch: &ForwardBatch) -> Result<()> {
        let b = self.model.backend();
        self.meta.upload(b, batch)?;
        // Decode-only steps repeat their shape step after step: those a backend may record
        // once and replay (CUDA graphs), unless the rank's collectives go through the host.
        let shape = (self.model.replayable() && batch.seqs.iter().all(|s| s.len == 1))
            .then(|| self.meta.shape());
        let Rank {
            model,
            cache,
            meta,
            ws,
            graphs,
        } = self;
        let model = &*model;
        let mut result = Ok(());
        model.backend().run_step(graphs, shape, &mut || {
            result = model.forward(meta, cache, ws)
        });
        result
    }

    fn read_kv(&self, blocks: &[BlockId], tokens: usize) -> HostTensor {
        self.model.backend().read_kv(&self.cache, blocks, tokens)
    }

    fn write_kv(&mut self, blocks: &[BlockId], tokens: usize, kv: &HostTensor) -> Result<()> {
        self.model
            .backend()
            .write_kv_host(&mut self.cache, blocks, tokens, kv)
    }
}

enum Job {
    Step(Arc<ForwardBatch>),
    Refresh(Arc<std::path::PathBuf>),
    ReadKv(Arc<Vec<BlockId>>, usize),
    WriteKv(Arc<Vec<BlockId>>, usize, HostTensor),
}

enum Reply {
    Done(Result<()>),
    Kv(HostTensor),
}

struct Peer {
    jobs: mpsc::Sender<Job>,
    replies: mpsc::Receiver<Reply>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Peer {
    fn drop(&mut self) {
        // Closing the job channel ends the rank's loop.
        let (closed, _) = mpsc::channel();
        drop(std::mem::replace(&mut self.jobs, closed));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// All ranks of one engine.
pub struct LlamaRanks<B: Ops> {
    lead: Rank<B>,
    peers: Vec<Peer>,
    /// The K/V layout of the whole model (every KV head): what handoffs carry.
    layout: KvLayout,
    /// The KV heads each rank holds.
    heads: Vec<Range<usize>>,
}

fn peer_gone() -> Error {
    Error::Collective("a tensor-parallel rank's thread is gone".into())
}

impl<B: Ops> LlamaRanks<B> {
    /// Starts the ranks of `shards` (rank order; rank 0 stays in the calling thread), each
    /// with a cache of `num_blocks` blocks of `block_size` and buffers for steps up to
    /// `limits`.
    pub fn new(
        shards: Vec<LlamaModel<B>>,
        limits: StepLimits,
        block_size: usize,
        num_blocks: usize,
    ) -> Result<Self> {
        let mut shards = shards.into_iter();
        let lead = shards
            .next()
            .ok_or_else(|| Error::InvalidRequest("no ranks".into()))?;
        let c = lead.config();
        let size = lead.shard().size;
        let mut heads = Vec::with_capacity(size);
        for r in 0..size {
            heads.push(crate::models::llama::TpShard { rank: r, size }.kv_heads(
                c.num_attention_heads,
                c.num_key_value_heads,
                c.intermediate_size,
            )?);
        }
        let layout = KvLayout {
            num_kv_heads: c.num_key_value_heads,
            ..lead.kv_layout(block_size, num_blocks)
        };
        let mut peers = Vec::new();
        for (i, model) in shards.enumerate() {
            if model.shard().rank != i + 1 || model.shard().size != size {
                return Err(Error::InvalidRequest(format!(
                    "shard {} of {} given as rank {} of {size}",
                    model.shard().rank,
                    model.shard().size,
                    i + 1
                )));
            }
            let (jobs, job_rx) = mpsc::channel::<Job>();
            let (reply_tx, replies) = mpsc::channel();
            let thread = std::thread::Builder::new()
                .name(format!("tandem-rank-{}", i + 1))
                .spawn(move || {
                    let mut rank = Rank::new(model, limits, block_size, num_blocks);
                    for job in job_rx {
                        let reply = match job {
                            Job::Step(batch) => Reply::Done(rank.step(&batch)),
                            Job::Refresh(dir) => Reply::Done(rank.model.refresh(&dir)),
                            Job::ReadKv(blocks, tokens) => Reply::Kv(rank.read_kv(&blocks, tokens)),
                            Job::WriteKv(blocks, tokens, kv) => {
                                Reply::Done(rank.write_kv(&blocks, tokens, &kv))
                            }
                        };
                        if reply_tx.send(reply).is_err() {
                            break;
                        }
                    }
                })
                .map_err(|e| Error::Collective(format!("starting a rank thread: {e}")))?;
            peers.push(Peer {
                jobs,
                replies,
                thread: Some(thread),
            });
        }
        if peers.len() + 1 != size {
            return Err(Error::InvalidRequest(format!(
                "{} shards for tensor parallelism {size}",
                peers.len() + 1
            )));
        }
        Ok(Self {
            lead: Rank::new(lead, limits, block_size, num_blocks),
            peers,
            layout,
            heads,
        })
    }

    /// Rank 0's model (configuration, backend, dtype).
    pub fn model(&self) -> &LlamaModel<B> {
        &self.lead.model
    }

    /// Rank 0's backend: where the logits are sampled.
    pub fn backend(&self) -> &B {
        self.lead.model.backend()
    }

    /// Ranks.
    pub fn size(&self) -> usize {
        self.peers.len() + 1
    }

    /// The whole model's K/V layout (what handoffs carry).
    pub fn layout(&self) -> KvLayout {
        self.layout
    }

    /// Weight bytes every rank together reads per decode step.
    pub fn weight_bytes(&self) -> usize {
        self.lead.model.weight_bytes() * self.size()
    }

    /// The logits of the last step's sampled rows, on rank 0.
    pub fn logits(&self) -> &Tensor<B> {
        &self.lead.ws.logits
    }

    /// [`LlamaRanks::logits`], to adjust before sampling.
    pub fn logits_mut(&mut self) -> &mut Tensor<B> {
        &mut self.lead.ws.logits
    }

    fn send_all(&self, job: impl Fn() -> Job) -> Result<()> {
        for p in &self.peers {
            p.jobs.send(job()).map_err(|_| peer_gone())?;
        }
        Ok(())
    }

    fn done_all(&self) -> Result<()> {
        let mut first = Ok(());
        for p in &self.peers {
            let r = match p.replies.recv() {
                Ok(Reply::Done(r)) => r,
                Ok(Reply::Kv(_)) => Err(Error::Collective("a rank answered out of turn".into())),
                Err(_) => Err(peer_gone()),
            };
            if first.is_ok() {
                first = r;
            }
        }
        first
    }

    /// Runs one step on every rank.
    pub fn step(&mut self, batch: &ForwardBatch) -> Result<()> {
        if self.peers.is_empty() {
            return self.lead.step(batch);
        }
        let shared = Arc::new(batch.clone());
        self.send_all(|| Job::Step(shared.clone()))?;
        let lead = self.lead.step(batch);
        let peers = self.done_all();
        lead.and(peers)
    }

    /// Overwrites every rank's weights in place with those of `dir` (same configuration).
    pub fn refresh(&mut self, dir: &std::path::Path) -> Result<()> {
        let shared = Arc::new(dir.to_path_buf());
        self.send_all(|| Job::Refresh(shared.clone()))?;
        let lead = self.lead.model.refresh(dir);
        let peers = self.done_all();
        lead.and(peers)
    }

    /// The K/V of the first `tokens` positions of `blocks` in the transfer layout of the
    /// whole model (`[layer][k, v][token][kv_heads * head_dim]`), gathered from the ranks.
    pub fn read_kv(&mut self, blocks: &[BlockId], tokens: usize) -> Result<HostTensor> {
        let own = self.lead.read_kv(blocks, tokens);
        if self.peers.is_empty() {
            return Ok(own);
        }
        let shared = Arc::new(blocks.to_vec());
        self.send_all(|| Job::ReadKv(shared.clone(), tokens))?;
        let mut parts = vec![own];
        for p in &self.peers {
            match p.replies.recv() {
                Ok(Reply::Kv(kv)) => parts.push(kv),
                _ => return Err(peer_gone()),
            }
        }
        let l = self.layout;
        let esize = l.dtype.size();
        let head = l.head_dim * esize;
        let rows = l.num_layers * 2 * tokens;
        let bytes: Vec<Vec<u8>> = parts.iter().map(HostTensor::to_le_bytes).collect();
        let mut out = Vec::with_capacity(rows * l.kv_dim() * esize);
        for row in 0..rows {
            for h in 0..l.num_kv_heads {
                // The first rank holding head h (heads are replicated when ranks > heads).
                let (r, range) = self
                    .heads
                    .iter()
                    .enumerate()
                    .find(|(_, range)| range.contains(&h))
                    .ok_or_else(|| Error::Collective(format!("no rank holds KV head {h}")))?;
                let local = (h - range.start) * head;
                let at = row * range.len() * head + local;
                out.extend_from_slice(&bytes[r][at..at + head]);
            }
        }
        HostTensor::from_le_bytes(l.dtype, &l.transfer_shape(tokens), &out)
    }

    /// The inverse of [`LlamaRanks::read_kv`]: each rank takes its KV heads of `kv`.
    pub fn write_kv_host(
        &mut self,
        blocks: &[BlockId],
        tokens: usize,
        kv: &HostTensor,
    ) -> Result<()> {
        if self.peers.is_empty() {
            return self.lead.write_kv(blocks, tokens, kv);
        }
        let l = self.layout;
        l.check_transfer(kv, tokens, blocks.len())?;
        let esize = l.dtype.size();
        let head = l.head_dim * esize;
        let rows = l.num_layers * 2 * tokens;
        let all = kv.to_le_bytes();
        let local = |range: &Range<usize>| -> Result<HostTensor> {
            let mut out = Vec::with_capacity(rows * range.len() * head);
            for row in 0..rows {
                let at = row * l.kv_dim() * esize + range.start * head;
                out.extend_from_slice(&all[at..at + range.len() * head]);
            }
            HostTensor::from_le_bytes(
                l.dtype,
                &[l.num_layers, 2, tokens, range.len() * l.head_dim],
                &out,
            )
        };
        let shared = Arc::new(blocks.to_vec());
        for (p, range) in self.peers.iter().zip(&self.heads[1..]) {
            p.jobs
                .send(Job::WriteKv(shared.clone(), tokens, local(range)?))
                .map_err(|_| peer_gone())?;
        }
        let lead = local(&self.heads[0]).and_then(|kv| self.lead.write_kv(blocks, tokens, &kv));
        let peers = self.done_all();
        lead.and(peers)
    }
}

/// How long a CPU rank waits for its peers in one collective before failing the step.
pub const CPU_COLLECTIVE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(120);

/// Loads the `tp` tensor-parallel shards of a checkpoint as CPU ranks (threads of this
/// process) joined by in-process communicators; `tp = 1` is the whole model.
pub fn cpu_shards(
    dir: &std::path::Path,
    dtype: crate::DType,
    tp: usize,
) -> Result<Vec<LlamaModel<crate::CpuBackend>>> {
    in_process_shards(dir, dtype, tp, |_| Ok(crate::CpuBackend::new()))
}

/// Loads the `tp` tensor-parallel shards of a checkpoint as ranks that are threads of this
/// process, rank `r` on the backend `backend(r)` opens (ranks may share a device, each with
/// a stream of its own), joined by the communicators the backend makes for them
/// ([`crate::Backend::group_comms`]: in-process over their tensors, NCCL across GPUs);
/// `tp = 1` is the whole model.
pub fn in_process_shards<B: Ops>(
    dir: &std::path::Path,
    dtype: crate::DType,
    tp: usize,
    mut backend: impl FnMut(usize) -> Result<B>,
) -> Result<Vec<LlamaModel<B>>> {
    if tp <= 1 {
        return Ok(vec![LlamaModel::load(dir, backend(0)?, dtype)?]);
    }
    let backends = (0..tp).map(&mut backend).collect::<Result<Vec<B>>>()?;
    let comms = B::group_comms(
        &backends,
        tandem_topology::InProcessCommunicator::group(tp, Some(CPU_COLLECTIVE_TIMEOUT)),
    );
    backends
        .into_iter()
        .zip(comms)
        .enumerate()
        .map(|(rank, (backend, comm))| {
            LlamaModel::load_shard(
                dir,
                backend,
                dtype,
                crate::models::llama::TpShard { rank, size: tp },
                Some(comm),
            )
        })
        .collect()
}

/// A Llama-family model as the engine serves it: its ranks and the paged K/V pool.
pub struct LlamaServed<B: Ops> {
    ranks: LlamaRanks<B>,
    pools: Pools,
    info: ServedInfo,
}

impl<B: Ops> LlamaServed<B> {
    /// Starts the ranks of `shards` (see [`LlamaRanks::new`]) with buffers and a K/V pool
    /// sized by `config`.
    pub fn new(shards: Vec<LlamaModel<B>>, config: &EngineConfig) -> Result<Self> {
        let first = shards
            .first()
            .ok_or_else(|| Error::InvalidRequest("no model shards".into()))?;
        let c = first.config();
        let max_context = c.max_position_embeddings;
        let (vocab_size, eos_ids, num_layers) =
            (c.vocab_size, c.eos_token_ids(), c.num_hidden_layers);
        let weight_bytes = first.weight_bytes() * shards.len();
        let tp = shards.len();
        // As many logits rows again as sequences: prompt tokens scored beside the samples.
        let score_rows = config.max_running;
        let limits = StepLimits {
            max_tokens: config.max_batch_tokens + config.max_running,
            max_seqs: config.max_running + score_rows,
            max_blocks_per_seq: max_context.div_ceil(config.block_size),
        };
        let ranks = LlamaRanks::new(shards, limits, config.block_size, config.num_blocks)?;
        let info = ServedInfo {
            family: "llama",
            vocab_size,
            eos_ids,
            max_context,
            num_layers,
            weight_bytes,
            layout: tandem_topology::Layout::new(tp, 1, 1)
                .map_err(|e| Error::InvalidRequest(format!("layout tp{tp}: {e}")))?,
            kv: Some(ranks.layout()),
            state_handoff: None,
            score_rows,
        };
        Ok(Self {
            ranks,
            pools: Pools {
                kv: Some((BlockAllocator::new(config.num_blocks), config.block_size)),
                // Blocks depend on the weights and the K/V layout: a worker serving the same
                // checkpoint in the same layout names them alike.
                prefix: config.prefix_cache.then(|| {
                    tandem_core::CacheSalt::of(&format!(
                        "llama {num_layers} {vocab_size} {weight_bytes} {:?}",
                        info.kv
                    ))
                }),
                ..Pools::default()
            },
            info,
        })
    }
}

/// The segments of `tokens` tokens' K/V in `layout`: one `[2][tokens][kv_dim]` per layer.
pub fn kv_segments(layout: &KvLayout, tokens: usize) -> Vec<Segment> {
    (0..layout.num_layers as u32)
        .map(|layer| Segment {
            kind: SegmentKind::KvLayer,
            layer,
            shard: 0,
            dtype: layout.dtype,
            shape: vec![2, tokens as u32, layout.kv_dim() as u32],
        })
        .collect()
}

struct KvHandoffSpec(KvLayout);

impl HandoffSpec for KvHandoffSpec {
    fn prepare(&self, h: Handoff, tokens: usize, reservation: &Reservation) -> Result<Handoff> {
        let want = kv_segments(&self.0, tokens);
        if h.segments != want {
            let describe = |s: &[Segment]| match s.first() {
                Some(f) => format!("{} segments, the first {}", s.len(), f.describe()),
                None => "no segments".to_string(),
            };
            return Err(Error::InvalidRequest(format!(
                "the handoff does not match this worker's K/V cache: got {}, expected {}",
                describe(&h.segments),
                describe(&want)
            )));
        }
        h.check_sizes()?;
        if reservation.blocks().len() < self.0.blocks_for(tokens) {
            return Err(Error::InvalidRequest(
                "reservation too small for the request".into(),
            ));
        }
        Ok(h)
    }
}

impl<B: Ops> ServedModel for LlamaServed<B> {
    fn info(&self) -> ServedInfo {
        self.info.clone()
    }

    fn pools(&self) -> Pools {
        self.pools.clone()
    }

    fn handoff_spec(&self) -> Arc<dyn HandoffSpec> {
        Arc::new(KvHandoffSpec(self.ranks.layout()))
    }

    fn step(&mut self, batch: &ForwardBatch) -> Result<()> {
        self.ranks.step(batch)
    }

    fn sample(
        &mut self,
        rows: &[SampleRow<'_>],
        out: &mut Vec<u32>,
        logprobs: &mut Vec<Option<TokenLogprobs>>,
    ) {
        let backend = self.ranks.backend().clone();
        let logits = self.ranks.logits_mut();
        sample_logits(&backend, logits, self.info.vocab_size, rows, out, logprobs);
    }

    fn score(&mut self, first: usize, targets: &[(u32, u32)]) -> Result<Vec<TokenLogprobs>> {
        let (backend, vocab) = (self.ranks.backend(), self.info.vocab_size);
        Ok(score_logits(
            backend,
            self.ranks.logits(),
            vocab,
            first,
            targets,
        ))
    }

    fn export(&mut self, r: &Reservation, prompt_len: usize) -> Result<Handoff> {
        let kv = self.ranks.read_kv(r.blocks(), prompt_len)?;
        Ok(Handoff {
            segments: kv_segments(&self.ranks.layout(), prompt_len),
            body: kv.to_le_bytes().into(),
        })
    }

    fn import(&mut self, r: &Reservation, prompt_len: usize, h: &Handoff) -> Result<()> {
        let l = self.ranks.layout();
        let kv = HostTensor::from_le_bytes(l.dtype, &l.transfer_shape(prompt_len), &h.body)?;
        self.ranks.write_kv_host(r.blocks(), prompt_len, &kv)
    }

    fn fork(&mut self, from: &Reservation, to: &Reservation, prompt_len: usize) -> Result<()> {
        // The full blocks are shared; only the prompt's part of its last, partial block is
        // copied (copy on write: every choice writes its own tokens after it).
        let bs = self.ranks.layout().block_size;
        let shared = to.shared_blocks();
        let sharing = shared == prompt_len / bs
            && from.shared_blocks() == shared
            && from.blocks()[..shared] == to.blocks()[..shared];
        if !sharing {
            let h = self.export(from, prompt_len)?;
            return self.import(to, prompt_len, &h);
        }
        let partial = prompt_len % bs;
        if partial == 0 {
            return Ok(());
        }
        let at = shared..shared + 1;
        let kv = self.ranks.read_kv(&from.blocks()[at.clone()], partial)?;
        self.ranks.write_kv_host(&to.blocks()[at], partial, &kv)
    }

    fn refresh(&mut self, dir: &std::path::Path) -> Result<()> {
        self.ranks.refresh(dir)
    }
}

/// The Llama family's ways into the engine.
impl crate::Engine {
    /// Starts the engine thread for a whole Llama-family `model`.
    pub fn start<B: Ops>(model: LlamaModel<B>, config: EngineConfig) -> Self {
        match Self::start_sharded(vec![model], config) {
            Ok(engine) => engine,
            // One whole model always makes one rank.
            Err(e) => panic!("starting the engine: {e}"),
        }
    }

    /// Starts the engine thread for the tensor-parallel shards of one Llama-family model
    /// (rank order, joined by communicators): rank 0 runs in the engine thread, each other
    /// rank in its own.
    pub fn start_sharded<B: Ops>(shards: Vec<LlamaModel<B>>, config: EngineConfig) -> Result<Self> {
        let c = config.clone();
        Self::start_served(move || LlamaServed::new(shards, &c), config)
    }
}
