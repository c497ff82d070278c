//! The CPU backend: host memory tensors, the matrix, attention and vector kernels of
//! `tandem-cpu-kernels` (AVX-512, AVX2 or portable, picked at run time), element-wise work
//! split over rayon's pool. Activations are f32; weights and K/V f32 or bf16.

pub mod delta_rule;
mod hybrid;
pub(crate) mod math;
mod routing;

use super::{Backend, Ops, QkvLayout};
use crate::kv_pool::KvCache;
use crate::sampling::sample;
use crate::step::StepMeta;
use crate::tensor::{DType, HostData, HostTensor, Tensor};
use crate::{Error, Result};
use half::{bf16, f16};
use rayon::prelude::*;
use tandem_core::{BlockId, SamplingParams};
use tandem_cpu_kernels::attention::{paged_attention, AttentionShape, SeqTable};
use tandem_cpu_kernels::packed::{linear_packed, Packed};

/// A CPU tensor's elements.
#[derive(Clone, Debug)]
pub enum CpuStorage {
    /// f32.
    F32(Vec<f32>),
    /// bf16.
    BF16(Vec<bf16>),
    /// f16.
    F16(Vec<f16>),
    /// E4M3 codes.
    F8E4M3(Vec<u8>),
    /// u32.
    U32(Vec<u32>),
    /// i32.
    I32(Vec<i32>),
    /// An f32 weight matrix packed in 16-column panels (see `tandem_cpu_kernels::packed`).
    PackedF32(Packed<f32>),
    /// A bf16 weight matrix packed in 16-column panels.
    PackedBF16(Packed<bf16>),
}

/// Runs the engine on the host CPU.
#[derive(Clone, Debug, Default)]
pub struct CpuBackend;

impl CpuBackend {
    /// A CPU backend using rayon's global pool.
    pub fn new() -> Self {
        Self
    }
}

type T = Tensor<CpuBackend>;

pub(crate) fn f32s(t: &T) -> &[f32] {
    match &t.storage {
        CpuStorage::F32(v) => v,
        _ => panic!("expected an f32 tensor, got {}", t.dtype),
    }
}

pub(crate) fn f32s_mut(t: &mut T) -> &mut [f32] {
    let dtype = t.dtype;
    match &mut t.storage {
        CpuStorage::F32(v) => v,
        _ => panic!("expected an f32 tensor, got {dtype}"),
    }
}

/// The f32 values of a CPU tensor, if it holds f32.
pub(crate) fn f32_slice(t: &T) -> Option<&[f32]> {
    match &t.storage {
        CpuStorage::F32(v) => Some(v),
        _ => None,
    }
}

/// The f32 values of a CPU tensor, mutably, if it holds f32.
pub(crate) fn f32_slice_mut(t: &mut T) -> Option<&mut [f32]> {
    match &mut t.storage {
        CpuStorage::F32(v) => Some(v),
        _ => None,
    }
}

fn u32s(t: &T) -> &[u32] {
    match &t.storage {
        CpuStorage::U32(v) => v,
        _ => panic!("expected a u32 tensor, got {}", t.dtype),
    }
}

pub(super) fn u32s_mut(t: &mut T) -> &mut [u32] {
    let dtype = t.dtype;
    match &mut t.storage {
        CpuStorage::U32(v) => v,
        _ => panic!("expected a u32 tensor, got {dtype}"),
    }
}

impl CpuStorage {
    /// Address of the first element (to check that a refresh kept a buffer in place).
    pub fn address(&self) -> usize {
        match self {
            CpuStorage::F32(v) => v.as_ptr() as usize,
            CpuStorage::BF16(v) => v.as_ptr() as usize,
            CpuStorage::F16(v) => v.as_ptr() as usize,
            CpuStorage::F8E4M3(v) => v.as_ptr() as usize,
            CpuStorage::U32(v) => v.as_ptr() as usize,
            CpuStorage::I32(v) => v.as_ptr() as usize,
            CpuStorage::PackedF32(p) => p.as_ptr() as usize,
            CpuStorage::PackedBF16(p) => p.as_ptr() as usize,
        }
    }
}

/// Host access to CPU tensors, for code that reads or fills them directly (state
/// hand-off, tests).
impl Tensor<CpuBackend> {
    /// An f32 tensor holding `data`.
    ///
    /// # Panics
    /// If `data` does not have `shape`'s element count.
    pub fn from_f32s(shape: &[usize], data: Vec<f32>) -> Self {
        assert_eq!(
            shape.iter().product::<usize>(),
            data.len(),
            "shape and data differ"
        );
        Tensor::from_storage(CpuStorage::F32(data), DType::F32, shape)
    }

    /// The values of an f32 tensor.
    ///
    /// # Panics
    /// If the tensor is not f32.
    pub fn f32s(&self) -> &[f32] {
        f32s(self)
    }

    /// The values of an f32 tensor, mutably.
    ///
    /// # Panics
    /// If the tensor is not f32.
    pub fn f32s_mut(&mut self) -> &mut [f32] {
        f32s_mut(self)
    }

    /// Address of the first element.
    pub fn address(&self) -> usize {
        self.storage.address()
    }
}

impl Clone for Tensor<CpuBackend> {
    fn clone(&self) -> Self {
        Tensor::from_storage(self.storage.clone(), self.dtype, &self.shape)
    }
}

impl PartialEq for Tensor<CpuBackend> {
    fn eq(&self, other: &Self) -> bool {
        self.dtype == other.dtype
            && self.shape == other.shape
            && self.storage.to_host() == other.storage.to_host()
    }
}

impl CpuStorage {
    fn from_host(data: &HostData) -> Self {
        match data {
            HostData::F32(v) => CpuStorage::F32(v.clone()),
            HostData::BF16(v) => CpuStorage::BF16(v.clone()),
            HostData::F16(v) => CpuStorage::F16(v.clone()),
            HostData::F8E4M3(v) => CpuStorage::F8E4M3(v.clone()),
            HostData::U32(v) => CpuStorage::U32(v.clone()),
            HostData::I32(v) => CpuStorage::I32(v.clone()),
        }
    }

    fn to_host(&self) -> HostData {
        match self {
            CpuStorage::F32(v) => HostData::F32(v.clone()),
            CpuStorage::BF16(v) => HostData::BF16(v.clone()),
            CpuStorage::F16(v) => HostData::F16(v.clone()),
            CpuStorage::F8E4M3(v) => HostData::F8E4M3(v.clone()),
            CpuStorage::U32(v) => HostData::U32(v.clone()),
            CpuStorage::I32(v) => HostData::I32(v.clone()),
            CpuStorage::PackedF32(p) => HostData::F32(p.unpack()),
            CpuStorage::PackedBF16(p) => HostData::BF16(p.unpack()),
        }
    }
}

fn rotate_half(x: &mut [f32], cs: &[(f32, f32)]) {
    let half = x.len() / 2;
    for (i, &(c, s)) in cs.iter().enumerate().take(half) {
        let a = x[i];
        let b = x[i + half];
        x[i] = a * c - b * s;
        x[i + half] = b * c + a * s;
    }
}

/// Largest head the RoPE tables on the stack hold.
const MAX_HEAD_DIM: usize = 512;

/// Token-major K/V rows of one layer: `(slot, kv_dim)` for every token of a block table.
/// Whether weights are packed into panels at load (`TANDEM_CPU_PACKED=0`: not).
fn packed_weights() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("TANDEM_CPU_PACKED").map_or(true, |v| v != "0"))
}

impl Backend for CpuBackend {
    type Graphs = ();
    type Storage = CpuStorage;

    fn in_process_comm(
        comm: tandem_topology::InProcessCommunicator,
    ) -> Box<dyn crate::backend::TensorComm<Self>> {
        Box::new(comm)
    }

    fn name(&self) -> String {
        let features = tandem_cpu_kernels::isa::features();
        format!(
            "cpu ({}{}{}, {} threads)",
            tandem_cpu_kernels::isa::current(),
            if features.is_empty() { "" } else { " + " },
            features.join(" "),
            rayon::current_num_threads()
        )
    }

    fn zeros(&self, dtype: DType, shape: &[usize]) -> T {
        let n: usize = shape.iter().product();
        let storage = match dtype {
            DType::F32 => CpuStorage::F32(vec![0.0; n]),
            DType::BF16 => CpuStorage::BF16(vec![bf16::ZERO; n]),
            DType::F16 => CpuStorage::F16(vec![f16::ZERO; n]),
            DType::F8E4M3 => CpuStorage::F8E4M3(vec![0; n]),
            DType::U32 => CpuStorage::U32(vec![0; n]),
            DType::I32 => CpuStorage::I32(vec![0; n]),
        };
        Tensor::from_storage(storage, dtype, shape)
    }

    fn upload(&self, host: &HostTensor) -> T {
        Tensor::from_storage(
            CpuStorage::from_host(host.data()),
            host.dtype(),
            host.shape(),
        )
    }

    fn upload_weight(&self, host: &HostTensor) -> T {
        // Panels pay off from M = 4 on AVX2 and AVX-512 machines and about break even at
        // M = 1 (see the kernels' matmul example and docs/benchmarks.md); the portable
        // kernels' dot form is the faster one. `TANDEM_CPU_PACKED=0` keeps row-major weights.
        let packable = host.shape().len() == 2
            && tandem_cpu_kernels::isa::current() >= tandem_cpu_kernels::Isa::Avx2
            && packed_weights();
        if !packable {
            return self.upload(host);
        }
        let (n, k) = (host.shape()[0], host.shape()[1]);
        let storage = match host.data() {
            HostData::F32(w) => CpuStorage::PackedF32(Packed::pack(w, n, k)),
            HostData::BF16(w) => CpuStorage::PackedBF16(Packed::pack(w, n, k)),
            _ => return self.upload(host),
        };
        Tensor::from_storage(storage, host.dtype(), host.shape())
    }

    fn upload_exact_weight(&self, host: &HostTensor) -> T {
        let mut t = self.upload_weight(host);
        if let CpuStorage::PackedBF16(p) = &mut t.storage {
            p.keep_f32_activations();
        }
        t
    }

    fn download_rows(&self, t: &T, width: usize, rows: &[usize]) -> Vec<f32> {
        let all = f32s(t);
        rows.iter()
            .flat_map(|&r| all[r * width..(r + 1) * width].iter().copied())
            .collect()
    }

    fn download(&self, t: &T) -> HostTensor {
        HostTensor::new(&t.shape, t.storage.to_host())
            .expect("a tensor's storage matches its shape")
    }

    fn overwrite(&self, dst: &mut T, src: &HostTensor) -> Result<()> {
        if dst.dtype != src.dtype() || dst.len() != src.len() {
            return Err(Error::InvalidRequest(format!(
                "cannot overwrite a {} tensor of {} values with a {} tensor of {}",
                dst.dtype,
                dst.len(),
                src.dtype(),
                src.len()
            )));
        }
        match (&mut dst.storage, src.data()) {
            (CpuStorage::F32(d), HostData::F32(s)) => d.copy_from_slice(s),
            (CpuStorage::BF16(d), HostData::BF16(s)) => d.copy_from_slice(s),
            (CpuStorage::F16(d), HostData::F16(s)) => d.copy_from_slice(s),
            (CpuStorage::F8E4M3(d), HostData::F8E4M3(s)) => d.copy_from_slice(s),
            (CpuStorage::U32(d), HostData::U32(s)) => d.copy_from_slice(s),
            (CpuStorage::I32(d), HostData::I32(s)) => d.copy_from_slice(s),
            (CpuStorage::PackedF32(d), HostData::F32(s)) => d.repack(s),
            (CpuStorage::PackedBF16(d), HostData::BF16(s)) => d.repack(s),
            _ => unreachable!("dtypes compared above"),
        }
        Ok(())
    }

    fn write_u32(&self, dst: &mut T, src: &[u32]) {
        let dtype = dst.dtype;
        match &mut dst.storage {
            CpuStorage::U32(d) => d[..src.len()].copy_from_slice(src),
            _ => panic!("expected a u32 tensor, got {dtype}"),
        }
    }
}

impl Ops for CpuBackend {
    fn embed(&self, table: &T, ids: &T, rows: usize, out: &mut T) {
        let dim = table.shape[1];
        let ids = &u32s(ids)[..rows];
        let out = &mut f32s_mut(out)[..rows * dim];
        for (row, &id) in out.chunks_exact_mut(dim).zip(ids) {
            let at = id as usize * dim;
            match &table.storage {
                CpuStorage::F32(t) => row.copy_from_slice(&t[at..at + dim]),
                CpuStorage::BF16(t) => tandem_cpu_kernels::vector::from_bf16(&t[at..at + dim], row),
                _ => panic!("embedding tables are f32 or bf16, got {}", table.dtype),
            }
        }
    }

    fn rms_norm(&self, x: &T, weight: &T, rows: usize, eps: f32, out: &mut T) {
        let weight = f32s(weight);
        let dim = weight.len();
        let x = &f32s(x)[..rows * dim];
        let out = &mut f32s_mut(out)[..rows * dim];
        out.par_chunks_mut(dim)
            .zip(x.par_chunks(dim))
            .for_each(|(o, xi)| {
                let ms = xi.iter().map(|v| v * v).sum::<f32>() / dim as f32;
                let r = 1.0 / (ms + eps).sqrt();
                for ((o, &v), &w) in o.iter_mut().zip(xi).zip(weight) {
                    *o = v * r * w;
                }
            });
    }

    fn matmul(
        &self,
        x: &T,
        rows: usize,
        w: &T,
        out_features: usize,
        in_features: usize,
        out: &mut T,
        accumulate: bool,
    ) {
        let x = f32s(x);
        let out = f32s_mut(out);
        match &w.storage {
            CpuStorage::F32(w) => {
                tandem_cpu_kernels::linear(x, rows, w, out_features, in_features, out, accumulate)
            }
            CpuStorage::BF16(w) => {
                tandem_cpu_kernels::linear(x, rows, w, out_features, in_features, out, accumulate)
            }
            CpuStorage::PackedF32(p) => {
                assert_eq!(
                    (p.n(), p.k()),
                    (out_features, in_features),
                    "packed weight shape"
                );
                linear_packed(&x[..rows * in_features], rows, p, out, accumulate)
            }
            CpuStorage::PackedBF16(p) => {
                assert_eq!(
                    (p.n(), p.k()),
                    (out_features, in_features),
                    "packed weight shape"
                );
                linear_packed(&x[..rows * in_features], rows, p, out, accumulate)
            }
            _ => panic!("CPU matmul takes f32 or bf16 weights, got {}", w.dtype),
        }
    }

    fn rope(&self, qkv: &mut T, rows: usize, layout: QkvLayout, positions: &T, theta: f32) {
        let width = layout.row_width();
        let hd = layout.head_dim;
        assert!(hd <= MAX_HEAD_DIM, "head_dim {hd} above {MAX_HEAD_DIM}");
        let rotated = (layout.num_heads + layout.num_kv_heads) * hd;
        let positions = &u32s(positions)[..rows];
        let qkv = &mut f32s_mut(qkv)[..rows * width];
        qkv.par_chunks_mut(width)
            .zip(positions.par_iter())
            .for_each(|(row, &pos)| {
                let mut cs = [(0.0f32, 0.0f32); MAX_HEAD_DIM / 2];
                for (i, c) in cs[..hd / 2].iter_mut().enumerate() {
                    // Same arithmetic as the reference: inv_freq in f32, then pos * inv_freq.
                    let inv_freq = 1.0f32 / theta.powf((2 * i) as f32 / hd as f32);
                    let f = pos as f32 * inv_freq;
                    *c = (f.cos(), f.sin());
                }
                for head in row[..rotated].chunks_exact_mut(hd) {
                    rotate_half(head, &cs[..hd / 2]);
                }
            });
    }

    fn write_kv(
        &self,
        qkv: &T,
        rows: usize,
        layout: QkvLayout,
        cache: &mut KvCache<Self>,
        layer: usize,
        slot_mapping: &T,
    ) {
        let width = layout.row_width();
        let kv_dim = layout.num_kv_heads * layout.head_dim;
        let (ko, vo) = (layout.k_offset(), layout.v_offset());
        let qkv = f32s(qkv);
        let slots = &u32s(slot_mapping)[..rows];
        let (k, v) = (&mut cache.k[layer].storage, &mut cache.v[layer].storage);
        for (row, &slot) in qkv.chunks_exact(width).zip(slots) {
            let at = slot as usize * kv_dim;
            let (kr, vr) = (&row[ko..ko + kv_dim], &row[vo..vo + kv_dim]);
            match (&mut *k, &mut *v) {
                (CpuStorage::F32(k), CpuStorage::F32(v)) => {
                    k[at..at + kv_dim].copy_from_slice(kr);
                    v[at..at + kv_dim].copy_from_slice(vr);
                }
                (CpuStorage::BF16(k), CpuStorage::BF16(v)) => {
                    tandem_cpu_kernels::vector::to_bf16(kr, &mut k[at..at + kv_dim]);
                    tandem_cpu_kernels::vector::to_bf16(vr, &mut v[at..at + kv_dim]);
                }
                _ => panic!("K/V caches are f32 or bf16"),
            }
        }
    }

    fn paged_attention(
        &self,
        qkv: &T,
        layout: QkvLayout,
        cache: &KvCache<Self>,
        layer: usize,
        meta: &StepMeta<Self>,
        out: &mut T,
    ) {
        let shape = AttentionShape {
            num_heads: layout.num_heads,
            num_kv_heads: layout.num_kv_heads,
            head_dim: layout.head_dim,
            q_stride: layout.row_width(),
            block_size: cache.layout().block_size,
            scale: 1.0 / (layout.head_dim as f32).sqrt(),
        };
        let stride = meta.table_stride();
        let seqs = SeqTable {
            info: &u32s(&meta.seq_info)[..meta.num_seqs * 3],
            tables: &u32s(&meta.block_tables)[..meta.num_seqs * stride],
            stride,
        };
        let q = f32s(qkv);
        let out = f32s_mut(out);
        match (&cache.k[layer].storage, &cache.v[layer].storage) {
            (CpuStorage::F32(k), CpuStorage::F32(v)) => paged_attention(q, k, v, seqs, shape, out),
            (CpuStorage::BF16(k), CpuStorage::BF16(v)) => {
                paged_attention(q, k, v, seqs, shape, out)
            }
            _ => panic!("K/V caches are f32 or bf16"),
        }
    }

    fn silu_mul(&self, gate_up: &T, rows: usize, width: usize, out: &mut T) {
        let gate_up = &f32s(gate_up)[..rows * 2 * width];
        let out = &mut f32s_mut(out)[..rows * width];
        out.par_chunks_mut(width)
            .zip(gate_up.par_chunks(2 * width))
            .for_each(|(o, gu)| {
                let (g, u) = gu.split_at(width);
                for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
                    *o = g / (1.0 + (-g).exp()) * u;
                }
            });
    }

    fn gather_rows(&self, x: &T, dim: usize, index: &T, rows: usize, out: &mut T) {
        let x = f32s(x);
        let index = &u32s(index)[..rows];
        let out = &mut f32s_mut(out)[..rows * dim];
        for (o, &r) in out.chunks_exact_mut(dim).zip(index) {
            let r = r as usize;
            o.copy_from_slice(&x[r * dim..(r + 1) * dim]);
        }
    }

    fn adjust_logits(
        &self,
        logits: &mut T,
        vocab: usize,
        rows: &[crate::sampling::SampleRow<'_>],
        which: crate::sampling::Adjustment,
    ) {
        let values = f32s_mut(logits);
        for (i, r) in rows.iter().enumerate() {
            crate::sampling::adjust_row(&mut values[i * vocab..(i + 1) * vocab], r, which);
        }
    }

    fn sample(
        &self,
        logits: &T,
        vocab: usize,
        rows: &[(&SamplingParams, u32)],
        out: &mut Vec<u32>,
    ) {
        let logits = f32s(logits);
        out.clear();
        out.extend(
            rows.iter().enumerate().map(|(i, &(params, step))| {
                sample(&logits[i * vocab..(i + 1) * vocab], params, step)
            }),
        );
    }

    fn read_kv(&self, cache: &KvCache<Self>, blocks: &[BlockId], tokens: usize) -> HostTensor {
        let l = cache.layout();
        let kv_dim = l.kv_dim();
        let shape = [l.num_layers, 2, tokens, kv_dim];
        fn gather<E: Copy>(parts: [&[E]; 2], slots: &[usize], kv_dim: usize, out: &mut Vec<E>) {
            for part in parts {
                for &s in slots {
                    out.extend_from_slice(&part[s * kv_dim..(s + 1) * kv_dim]);
                }
            }
        }
        let slots: Vec<usize> = l.token_slots(blocks, tokens).collect();
        let n = l.num_layers * 2 * tokens * kv_dim;
        let data = match l.dtype {
            DType::F32 => {
                let mut out = Vec::with_capacity(n);
                for layer in 0..l.num_layers {
                    gather(
                        [f32s(&cache.k[layer]), f32s(&cache.v[layer])],
                        &slots,
                        kv_dim,
                        &mut out,
                    );
                }
                HostData::F32(out)
            }
            DType::BF16 => {
                let mut out = Vec::with_capacity(n);
                for layer in 0..l.num_layers {
                    let (CpuStorage::BF16(k), CpuStorage::BF16(v)) =
                        (&cache.k[layer].storage, &cache.v[layer].storage)
                    else {
                        panic!("a bf16 cache holds bf16 tensors")
                    };
                    gather([k, v], &slots, kv_dim, &mut out);
                }
                HostData::BF16(out)
            }
            other => panic!("K/V caches are f32 or bf16, got {other}"),
        };
        HostTensor::new(&shape, data).expect("gathered exactly the shape's values")
    }

    fn write_kv_host(
        &self,
        cache: &mut KvCache<Self>,
        blocks: &[BlockId],
        tokens: usize,
        data: &HostTensor,
    ) -> Result<()> {
        let l = cache.layout();
        let kv_dim = l.kv_dim();
        l.check_transfer(data, tokens, blocks.len())?;
        fn scatter<E: Copy>(
            parts: [&mut [E]; 2],
            slots: &[usize],
            kv_dim: usize,
            src: &mut std::slice::ChunksExact<'_, E>,
        ) {
            for part in parts {
                for &s in slots {
                    if let Some(row) = src.next() {
                        part[s * kv_dim..(s + 1) * kv_dim].copy_from_slice(row);
                    }
                }
            }
        }
        let slots: Vec<usize> = l.token_slots(blocks, tokens).collect();
        let (ks, vs) = (&mut cache.k, &mut cache.v);
        match data.data() {
            HostData::F32(d) => {
                let mut src = d.chunks_exact(kv_dim);
                for (k, v) in ks.iter_mut().zip(vs.iter_mut()) {
                    scatter([f32s_mut(k), f32s_mut(v)], &slots, kv_dim, &mut src);
                }
            }
            HostData::BF16(d) => {
                let mut src = d.chunks_exact(kv_dim);
                for (k, v) in ks.iter_mut().zip(vs.iter_mut()) {
                    let (CpuStorage::BF16(k), CpuStorage::BF16(v)) =
                        (&mut k.storage, &mut v.storage)
                    else {
                        panic!("a bf16 cache holds bf16 tensors")
                    };
                    scatter([k, v], &slots, kv_dim, &mut src);
                }
            }
            _ => unreachable!("dtype checked against the cache's"),
        }
        Ok(())
    }
}
