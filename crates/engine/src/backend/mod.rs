//! The backend boundary: a device trait ([`Backend`]: typed tensors in and out, a stream
//! notion that is a no-op on the CPU) and the operation trait models are written over
//! ([`Ops`]). Every operation works on a whole step's flattened tokens at once; per-sequence
//! structure reaches the backend only as the step's metadata ([`crate::step::StepMeta`]),
//! uploaded once per step into buffers allocated at start-up. Operations act on the leading
//! `rows` of tensors sized for the largest step, so a forward pass allocates nothing — what
//! lets a GPU backend capture a decode step as a graph.
//!
//! Model code names only these traits; the CPU backend ([`CpuBackend`]) implements them here,
//! a CUDA backend in its own crate.

/// Collectives over device tensors (tensor parallelism).
pub mod comm;
/// The CPU backend: its `Ops` and `HybridOps` bodies and their host math.
pub mod cpu;
pub mod host;
/// The KDA-hybrid family's operations.
pub mod hybrid;
/// MLA's per-request latent cache: rows in blocks on a backend, counted against a pool.
pub mod latents;

pub use comm::{HostStaged, TensorComm};
pub(crate) use cpu::{f32s as cpu_f32s, f32s_mut as cpu_f32s_mut};
pub use cpu::{CpuBackend, CpuStorage};
pub use hybrid::HybridOps;

use crate::kv_pool::KvCache;
use crate::sampling::{Adjustment, SampleRow};
use crate::step::StepMeta;
use crate::tensor::{DType, HostTensor, Tensor};
use crate::Result;
use tandem_core::{BlockId, SamplingParams};

/// A weight matrix `(out, in)` on a device, as the model uses it: `y = x · Wᵀ`.
#[derive(Debug)]
pub struct Linear<B: Backend> {
    /// The weights, `(out_features, in_features)`, in the dtype the model runs.
    pub weight: Tensor<B>,
    /// Output features.
    pub out_features: usize,
    /// Input features.
    pub in_features: usize,
}

/// Where the query, key and value columns sit in a fused QKV activation.
#[derive(Clone, Copy, Debug)]
pub struct QkvLayout {
    /// Query heads.
    pub num_heads: usize,
    /// KV heads.
    pub num_kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
}

impl QkvLayout {
    /// Columns of one row of the fused activation.
    pub fn row_width(&self) -> usize {
        (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
    }
    /// First column of K.
    pub fn k_offset(&self) -> usize {
        self.num_heads * self.head_dim
    }
    /// First column of V.
    pub fn v_offset(&self) -> usize {
        (self.num_heads + self.num_kv_heads) * self.head_dim
    }
}

/// The shape of a step as far as recorded launches depend on it: a backend that records a
/// step's work once and replays it (CUDA graphs) keys its recordings by this.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct StepShape {
    /// Tokens in the step.
    pub tokens: usize,
    /// Sequences in the step.
    pub seqs: usize,
    /// Logits rows in the step.
    pub logits: usize,
    /// The longest context of a sequence in the step.
    pub max_context: usize,
}

/// A device: allocation, typed transfers, synchronisation. Clones share the device.
pub trait Backend: Clone + Send + Sync + Sized + 'static {
    /// Device memory holding one tensor's elements.
    type Storage: Send + Sync;
    /// Recorded steps, owned by whoever owns the buffers they read (an engine's workspace
    /// and cache): `()` where the backend records nothing.
    type Graphs: Default + Send;

    /// Short name for logs (`cpu (avx512, 2 threads)`, `cuda:0`).
    fn name(&self) -> String;
    /// Another handle on the same device with a stream (and scratch buffers) of its own, for
    /// another thread's work: a rank of a layout whose ranks share the device. The CPU has no
    /// streams: a clone.
    fn new_stream(&self) -> Result<Self> {
        Ok(self.clone())
    }
    /// `comm` (one rank's handle on a group of threads of this process) over this backend's
    /// tensors: staged through host memory by default ([`comm::HostStaged`]); the CPU reads
    /// its tensors in place.
    fn in_process_comm(comm: tandem_topology::InProcessCommunicator) -> Box<dyn TensorComm<Self>> {
        Box::new(comm::HostStaged(comm))
    }
    /// The communicators of one group whose rank `r` runs on `members[r]`, from the ranks'
    /// in-process handles (`comms[r]` is rank `r`'s): [`Backend::in_process_comm`] each by
    /// default. A backend may join ranks on distinct devices through a library of its own
    /// (CUDA: NCCL, one rank per GPU).
    fn group_comms(
        members: &[Self],
        comms: Vec<tandem_topology::InProcessCommunicator>,
    ) -> Vec<Box<dyn TensorComm<Self>>> {
        debug_assert_eq!(members.len(), comms.len());
        comms.into_iter().map(Self::in_process_comm).collect()
    }
    /// A zero-filled tensor. Inside [`Backend::run_traced`] it may live only until the next
    /// traced step begins (a step's activations and logits).
    fn zeros(&self, dtype: DType, shape: &[usize]) -> Tensor<Self>;
    /// A zero-filled tensor that outlives the step it is made in (cache blocks a step adds).
    /// The default is [`Backend::zeros`].
    fn zeros_lasting(&self, dtype: DType, shape: &[usize]) -> Tensor<Self> {
        self.zeros(dtype, shape)
    }
    /// Copies host data to the device.
    fn upload(&self, host: &HostTensor) -> Tensor<Self>;
    /// Uploads a weight matrix `(out, in)` that only [`Ops::matmul`] reads: the backend may
    /// keep it in a layout of its own (the CPU packs it into column panels once, here).
    fn upload_weight(&self, host: &HostTensor) -> Tensor<Self> {
        self.upload(host)
    }
    /// [`Backend::upload_weight`] for a matrix whose products must keep their activations
    /// in f32 where the backend would otherwise round them to the weights' dtype for speed
    /// (the CPU's bf16 dot products at prefill sizes). The default is `upload_weight`.
    fn upload_exact_weight(&self, host: &HostTensor) -> Tensor<Self> {
        self.upload_weight(host)
    }
    /// A block-FP8 weight matrix kept as FP8 (an `F8E4M3` tensor of its shape whose products
    /// apply the tile scales as they read it), or `None` when this backend has no FP8 products
    /// (or not for this tile size): then the loader dequantises it to the model's dtype.
    fn upload_fp8_weight(&self, w: &crate::BlockFp8) -> Option<Tensor<Self>> {
        let _ = w;
        None
    }
    /// Copies a tensor back to the host (row-major, whatever layout the device keeps).
    fn download(&self, t: &Tensor<Self>) -> HostTensor;
    /// Rows `rows` (each `width` values) of an f32 tensor, as host values one row after
    /// another. The default downloads the whole tensor.
    fn download_rows(&self, t: &Tensor<Self>, width: usize, rows: &[usize]) -> Vec<f32> {
        let all = self.download(t).to_f32_vec();
        rows.iter()
            .flat_map(|&r| all[r * width..(r + 1) * width].iter().copied())
            .collect()
    }
    /// Overwrites an existing tensor (weights included) with row-major host data of the same
    /// dtype and element count, keeping its device address (weight refresh under captured
    /// graphs).
    fn overwrite(&self, dst: &mut Tensor<Self>, src: &HostTensor) -> Result<()>;
    /// Copies `src` into the leading elements of a u32 tensor (per-step metadata).
    fn write_u32(&self, dst: &mut Tensor<Self>, src: &[u32]);
    /// Waits for queued work to finish (no-op on the CPU, where every call is synchronous).
    fn synchronize(&self) {}
    /// Runs `step`, which queues one forward pass over fixed buffers (workspace, cache, step
    /// metadata uploaded beforehand). With a `shape`, a backend may record the work the
    /// first times it sees that shape and replay the recording afterwards, so `step` must
    /// queue the same launches for the same shape. The default runs it.
    fn run_step(
        &self,
        graphs: &mut Self::Graphs,
        shape: Option<StepShape>,
        step: &mut dyn FnMut(),
    ) {
        let _ = (graphs, shape);
        step();
    }
    /// Runs `step`, a forward pass whose host code must run every time (it builds tables as
    /// it goes) but whose device work often repeats: a backend may record that work and
    /// replay it in one launch when it equals work recorded before. Tensors `step` makes with
    /// [`Backend::zeros`] or [`Backend::upload`] may then live only until the next traced
    /// step begins. The default runs it.
    fn run_traced(&self, step: &mut dyn FnMut()) {
        step();
    }
}

/// The operations the models are written over.
pub trait Ops: Backend {
    /// Refuses, at load, an attention shape or K/V dtype this backend has no kernel for (so
    /// a model fails to start with the reason instead of failing its first step).
    fn check_attention(&self, layout: QkvLayout, kv_dtype: DType) -> Result<()> {
        let _ = (layout, kv_dtype);
        Ok(())
    }
    /// `out[i] = table[ids[i]]` for the first `rows` ids, rows of the table's width, as f32.
    fn embed(&self, table: &Tensor<Self>, ids: &Tensor<Self>, rows: usize, out: &mut Tensor<Self>);
    /// Row-wise RMSNorm of `rows` rows: `out = x / rms(x) * weight`.
    fn rms_norm(
        &self,
        x: &Tensor<Self>,
        weight: &Tensor<Self>,
        rows: usize,
        eps: f32,
        out: &mut Tensor<Self>,
    );
    /// `out = x · Wᵀ` (or `out += x · Wᵀ` when `accumulate`) for `rows` rows of `x`, where
    /// `w` is `(out_features, in_features)` row-major in any float dtype the backend runs.
    #[allow(clippy::too_many_arguments)]
    fn matmul(
        &self,
        x: &Tensor<Self>,
        rows: usize,
        w: &Tensor<Self>,
        out_features: usize,
        in_features: usize,
        out: &mut Tensor<Self>,
        accumulate: bool,
    );
    /// [`Ops::matmul`] with a [`Linear`].
    fn linear(
        &self,
        x: &Tensor<Self>,
        rows: usize,
        w: &Linear<Self>,
        out: &mut Tensor<Self>,
        accumulate: bool,
    ) {
        self.matmul(
            x,
            rows,
            &w.weight,
            w.out_features,
            w.in_features,
            out,
            accumulate,
        );
    }
    /// [`Ops::rms_norm`] of `x` into `normed`, then [`Ops::linear`] of that into `out`. A
    /// backend may fuse the two (and then need not write `normed`).
    #[allow(clippy::too_many_arguments)]
    fn rms_norm_linear(
        &self,
        x: &Tensor<Self>,
        norm: &Tensor<Self>,
        rows: usize,
        eps: f32,
        normed: &mut Tensor<Self>,
        w: &Linear<Self>,
        out: &mut Tensor<Self>,
    ) {
        self.rms_norm(x, norm, rows, eps, normed);
        self.linear(normed, rows, w, out, false);
    }
    /// A SwiGLU MLP's first half: [`Ops::rms_norm`] of `x` into `normed`, the fused gate/up
    /// product `w` (gate rows, then up rows) into `gate_up`, and [`Ops::silu_mul`] of that
    /// into `act`. A backend may fuse them (and then need not write `normed` or `gate_up`).
    #[allow(clippy::too_many_arguments)]
    fn rms_norm_gate_up(
        &self,
        x: &Tensor<Self>,
        norm: &Tensor<Self>,
        rows: usize,
        eps: f32,
        normed: &mut Tensor<Self>,
        w: &Linear<Self>,
        gate_up: &mut Tensor<Self>,
        act: &mut Tensor<Self>,
    ) {
        self.rms_norm(x, norm, rows, eps, normed);
        self.linear(normed, rows, w, gate_up, false);
        self.silu_mul(gate_up, rows, w.out_features / 2, act);
    }
    /// A SwiGLU MLP on the residual stream `x`: [`Ops::rms_norm_gate_up`] of `x` (through
    /// `normed`, `gate_up` and `act`), then the `down` product of the activation added to `x`
    /// (`accumulate`) or written over it (a tensor-parallel rank's partial sum). A backend may
    /// keep the intermediates in its own buffers and precision (and then need not write
    /// `normed`, `gate_up` or `act`).
    #[allow(clippy::too_many_arguments)]
    fn mlp(
        &self,
        x: &mut Tensor<Self>,
        norm: &Tensor<Self>,
        rows: usize,
        eps: f32,
        normed: &mut Tensor<Self>,
        gate_up_w: &Linear<Self>,
        gate_up: &mut Tensor<Self>,
        act: &mut Tensor<Self>,
        down: &Linear<Self>,
        accumulate: bool,
    ) {
        self.rms_norm_gate_up(x, norm, rows, eps, normed, gate_up_w, gate_up, act);
        self.linear(act, rows, down, x, accumulate);
    }
    /// [`Ops::rope`] at the step's positions, [`Ops::write_kv`] of the rotated keys and the
    /// values at its slots, then [`Ops::paged_attention`]: a backend may fold the first two
    /// into its attention kernel (decode steps) and then need not rotate Q in `qkv`.
    #[allow(clippy::too_many_arguments)]
    fn rope_write_kv_attention(
        &self,
        qkv: &mut Tensor<Self>,
        layout: QkvLayout,
        theta: f32,
        cache: &mut KvCache<Self>,
        layer: usize,
        meta: &StepMeta<Self>,
        out: &mut Tensor<Self>,
    ) {
        let rows = meta.num_tokens;
        self.rope(qkv, rows, layout, &meta.positions, theta);
        self.write_kv(qkv, rows, layout, cache, layer, &meta.slot_mapping);
        self.paged_attention(qkv, layout, cache, layer, meta, out);
    }
    /// Rotary embedding (rotate-half) applied in place to Q and K of the first `rows` rows
    /// of a fused QKV activation, at `positions`.
    fn rope(
        &self,
        qkv: &mut Tensor<Self>,
        rows: usize,
        layout: QkvLayout,
        positions: &Tensor<Self>,
        theta: f32,
    );
    /// Writes each of the first `rows` tokens' K and V into layer `layer` of the cache at
    /// its slot (`slot_mapping`), converting to the cache's dtype.
    fn write_kv(
        &self,
        qkv: &Tensor<Self>,
        rows: usize,
        layout: QkvLayout,
        cache: &mut KvCache<Self>,
        layer: usize,
        slot_mapping: &Tensor<Self>,
    );
    /// Causal attention of each sequence's new queries over its cached keys and values.
    /// `out` gets one row of `num_heads * head_dim` per token of the step.
    fn paged_attention(
        &self,
        qkv: &Tensor<Self>,
        layout: QkvLayout,
        cache: &KvCache<Self>,
        layer: usize,
        meta: &StepMeta<Self>,
        out: &mut Tensor<Self>,
    );
    /// `out = silu(gate) * up` for `rows` rows of `[gate | up]` (each half `width` wide).
    fn silu_mul(&self, gate_up: &Tensor<Self>, rows: usize, width: usize, out: &mut Tensor<Self>);
    /// `out[i] = x[index[i]]` for the first `rows` indices, rows `dim` wide.
    fn gather_rows(
        &self,
        x: &Tensor<Self>,
        dim: usize,
        index: &Tensor<Self>,
        rows: usize,
        out: &mut Tensor<Self>,
    );
    /// Applies `which` adjustments ([`crate::sampling::adjust_row`]) to the first
    /// `rows.len()` logits rows in place, before [`Ops::sample`]. The default body copies
    /// the logits through host memory (only steps with a request that asks for bias,
    /// penalties, `min_tokens` or `min_p` pay for it); a backend may do it on the device.
    fn adjust_logits(
        &self,
        logits: &mut Tensor<Self>,
        vocab: usize,
        rows: &[SampleRow<'_>],
        which: Adjustment,
    ) {
        if !crate::sampling::any_adjusts(rows, which) {
            return;
        }
        let host = self.download(logits);
        let shape = host.shape().to_vec();
        let mut values = host.to_f32_vec();
        for (i, r) in rows.iter().enumerate() {
            crate::sampling::adjust_row(&mut values[i * vocab..(i + 1) * vocab], r, which);
        }
        let adjusted =
            HostTensor::from_f32(&shape, values).and_then(|t| self.overwrite(logits, &t));
        if let Err(e) = adjusted {
            tracing::error!(error = %e, "adjusting logits failed; sampling them unadjusted");
        }
    }
    /// Picks one token per logits row on the device (greedy, temperature, top-k, top-p,
    /// seeded by `(params.seed, step)`); only the ids come back to the host.
    fn sample(
        &self,
        logits: &Tensor<Self>,
        vocab: usize,
        rows: &[(&SamplingParams, u32)],
        out: &mut Vec<u32>,
    );
    /// Reads the K/V of the first `tokens` positions of a block table in the transfer
    /// layout `[layer][k, v][token][kv_dim]`, in the cache's dtype.
    fn read_kv(&self, cache: &KvCache<Self>, blocks: &[BlockId], tokens: usize) -> HostTensor;
    /// The inverse of [`Ops::read_kv`]; the data must be in the cache's dtype and shape.
    fn write_kv_host(
        &self,
        cache: &mut KvCache<Self>,
        blocks: &[BlockId],
        tokens: usize,
        data: &HostTensor,
    ) -> Result<()>;
}
