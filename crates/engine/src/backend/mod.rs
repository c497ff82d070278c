//! The backend boundary. Every operation works on a whole step's flattened tokens at once
//! (no per-request loop on the host's hot path); per-sequence structure reaches the backend
//! only as metadata (`positions`, `slot_mapping`, block tables) that a GPU backend uploads
//! once per step. Model code ([`crate::llama`]) is written once over these operations.

mod cpu;

pub(crate) use cpu::dot;
pub use cpu::CpuBackend;

use crate::batch::ForwardBatch;
use crate::kv_pool::KvLayout;

/// A weight matrix `(out, in)`, row-major, as the model uses it: `y = x · Wᵀ`.
#[derive(Debug)]
pub struct Linear<T> {
    /// The weights, `out * in` elements.
    pub weight: T,
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

/// Operations a device must provide to run the models.
pub trait Backend: Send + 'static {
    /// A buffer of `f32` in device memory.
    type Tensor: Send;
    /// Paged K/V storage for every layer.
    type KvCache: Send;

    /// Short name for logs (`cpu`, `cuda:0`).
    fn name(&self) -> String;
    /// Copies host data to the device.
    fn upload(&self, data: Vec<f32>) -> Self::Tensor;
    /// A zero-filled buffer of `len` floats.
    fn zeros(&self, len: usize) -> Self::Tensor;
    /// Copies a buffer back to the host.
    fn download(&self, t: &Self::Tensor) -> Vec<f32>;
    /// Allocates the paged cache.
    fn kv_cache(&self, layout: KvLayout) -> Self::KvCache;

    /// `out[i] = table[ids[i]]`, rows of `dim`.
    fn embed(&self, table: &Self::Tensor, dim: usize, ids: &[u32], out: &mut Self::Tensor);
    /// Row-wise RMSNorm of `rows` rows of `dim`: `out = x / rms(x) * weight`.
    fn rms_norm(
        &self,
        x: &Self::Tensor,
        weight: &Self::Tensor,
        rows: usize,
        eps: f32,
        out: &mut Self::Tensor,
    );
    /// `out = x · Wᵀ` (or `out += x · Wᵀ` when `accumulate`), `x` has `rows` rows and `w`
    /// is `(out_features, in_features)` row-major.
    #[allow(clippy::too_many_arguments)]
    fn matmul_raw(
        &self,
        x: &Self::Tensor,
        rows: usize,
        w: &Self::Tensor,
        out_features: usize,
        in_features: usize,
        out: &mut Self::Tensor,
        accumulate: bool,
    );
    /// [`Backend::matmul_raw`] with a [`Linear`].
    fn matmul(
        &self,
        x: &Self::Tensor,
        rows: usize,
        w: &Linear<Self::Tensor>,
        out: &mut Self::Tensor,
        accumulate: bool,
    ) {
        self.matmul_raw(
            x,
            rows,
            &w.weight,
            w.out_features,
            w.in_features,
            out,
            accumulate,
        );
    }
    /// Rotary embedding (rotate-half convention) applied in place to Q and K of a fused
    /// QKV activation.
    fn rope(&self, qkv: &mut Self::Tensor, layout: QkvLayout, positions: &[u32], theta: f32);
    /// Writes each token's K and V from the fused activation into the cache at its slot.
    fn write_kv(
        &self,
        qkv: &Self::Tensor,
        layout: QkvLayout,
        cache: &mut Self::KvCache,
        layer: usize,
        slot_mapping: &[u32],
    );
    /// Causal attention of each sequence's new queries over its cached keys and values.
    /// `out` has one row of `num_heads * head_dim` per token.
    fn attention(
        &self,
        qkv: &Self::Tensor,
        layout: QkvLayout,
        cache: &Self::KvCache,
        layer: usize,
        batch: &ForwardBatch,
        out: &mut Self::Tensor,
    );
    /// `out = silu(gate) * up` where each row of `gate_up` is `[gate | up]`.
    fn silu_mul(&self, gate_up: &Self::Tensor, rows: usize, out: &mut Self::Tensor);
    /// `out[i] = x[rows[i]]`, rows of `dim`.
    fn gather_rows(&self, x: &Self::Tensor, dim: usize, rows: &[usize], out: &mut Self::Tensor);

    /// Reads the K/V of the first `tokens` positions of a block table into the transfer
    /// layout `[layer][k, v][token][kv_dim]`.
    fn export_kv(
        &self,
        cache: &Self::KvCache,
        blocks: &[tandem_core::BlockId],
        tokens: usize,
    ) -> Vec<f32>;
    /// The inverse of [`Backend::export_kv`].
    fn import_kv(
        &self,
        cache: &mut Self::KvCache,
        blocks: &[tandem_core::BlockId],
        tokens: usize,
        data: &[f32],
    );
}
