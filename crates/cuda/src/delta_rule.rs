//! KDA's gated delta rule on the device, in both forms of shared/specs/kda.md.
//!
//! - Recurrent (decoding sequences, and prompts when the chunked kernels are off): one launch
//!   over every sequence, a block per (sequence, head, slice of value columns) walking the
//!   sequence's tokens with its state in registers, each warp owning a few columns across all
//!   of K (`delta_rule_d*` in kernels.cu). Its cost per token is one pass over the state, so a
//!   long prompt is a long sequential loop.
//! - Chunked (prompts): per 64-token chunk, the within-chunk work — decays, the triangular
//!   matrices M and Pm, the forward substitution for W and U — runs for every chunk of every
//!   sequence at once (`delta_chunk_prep_d*`), into a workspace; then one block per (sequence,
//!   head, 32 value columns) walks the chunks in order, three small products per chunk against
//!   the state slice it keeps in shared memory (`delta_chunk_state_d*`). The sequential part
//!   is one step per 64 tokens instead of one per token.
//!
//! The workspace holds `chunk_work_floats(d)` floats per (chunk, head) (148 KiB at d = 128).
//! A call takes at most [`WORK_BYTES`] of it: longer prompts (or many at once) run in rounds
//! of chunks, each round a prep and a state launch, every sequence's state carried from one
//! round to the next in its slot.

use crate::device::{Arg as A, CudaBackend, Kernels};
use crate::hybrid::SeqEntry;
use crate::ops::{need, ptr, T};
use cudarc::driver::{CudaFunction, LaunchConfig};
use tandem_engine::backend::hybrid::{DeltaForm, DeltaInputs, Seqs};
use tandem_engine::DType;

/// Head widths the delta-rule kernels are built for (`delta_rule_d*`, `delta_chunk_*_d*`).
pub(crate) const DELTA_HEAD_DIMS: [usize; 4] = [16, 32, 64, 128];
/// Steps of fewer sequences than this take the recurrent kernel with more warps per head
/// (`delta_rule_d128_q2`).
const FEW_SEQUENCES: usize = 8;
/// Tokens per chunk (`DC` in kernels.cu).
pub(crate) const CHUNK: usize = 64;
/// Threads per block of the chunked kernels (`DC_THREADS`).
const CHUNK_THREADS: u32 = 256;
/// Row stride of the chunked state kernel's transposed tiles (`DCP`).
const CHUNK_PADDED: usize = CHUNK + 1;
/// The most workspace one call of the chunked form uses (its rounds are sized to it).
const WORK_BYTES: usize = 128 << 20;

/// Floats of the chunked workspace per (chunk, head): W, U, Q ⊙ e^Γ and K ⊙ e^{Γn−Γ} (each
/// `[CHUNK, d]`), Pm `[CHUNK, CHUNK]` and e^{Γn} `[d]` (`ChunkWork` in kernels.cu).
pub(crate) fn chunk_work_floats(d: usize) -> usize {
    4 * CHUNK * d + CHUNK * CHUNK + d
}

/// Dynamic shared memory of `delta_chunk_prep_d{d}`: Γ, k and q tiles, M and β.
fn prep_shared_bytes(d: usize) -> usize {
    4 * (3 * CHUNK * d + CHUNK * CHUNK + CHUNK)
}

/// Value columns one `delta_chunk_state_d{d}` block owns (`ChunkCols::CW`).
fn state_columns(d: usize) -> usize {
    d.min(32)
}

/// Dynamic shared memory of `delta_chunk_state_d{d}`: the state slice, V', two tiles (one
/// in use, one filling) and Pmᵀ (`ChunkCols::SHARED`).
fn state_shared_bytes(d: usize) -> usize {
    let cw = state_columns(d);
    4 * (d * cw + CHUNK * cw + 2 * d * CHUNK_PADDED + CHUNK * CHUNK_PADDED)
}

/// Lets the chunked kernels take the shared memory they need; false (and a warning) where
/// the device refuses, and prompts then run the recurrent kernel.
pub(crate) fn chunk_shared_memory(k: &Kernels) -> bool {
    use cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES as MAX_DYNAMIC;
    let mut refused = Vec::new();
    for d in DELTA_HEAD_DIMS {
        let (prep, state) = chunk_kernels(k, d);
        for (f, bytes, name) in [
            (prep, prep_shared_bytes(d), "prep"),
            (state, state_shared_bytes(d), "state"),
        ] {
            if let Err(e) = f.set_attribute(MAX_DYNAMIC, bytes as i32) {
                refused.push(format!("delta_chunk_{name}_d{d} ({bytes} bytes): {e}"));
            }
        }
    }
    if !refused.is_empty() {
        tracing::warn!(
            refused = refused.join("; "),
            "the chunked delta-rule kernels cannot have their shared memory; prompts run the recurrent kernel"
        );
    }
    refused.is_empty()
}

/// The chunked kernels (prep, state) for heads of width `d`.
fn chunk_kernels(k: &Kernels, d: usize) -> (&CudaFunction, &CudaFunction) {
    match d {
        16 => (&k.delta_chunk_prep_d16, &k.delta_chunk_state_d16),
        32 => (&k.delta_chunk_prep_d32, &k.delta_chunk_state_d32),
        64 => (&k.delta_chunk_prep_d64, &k.delta_chunk_state_d64),
        128 => (&k.delta_chunk_prep_d128, &k.delta_chunk_state_d128),
        _ => unsupported(d),
    }
}

fn unsupported(d: usize) -> ! {
    panic!("the CUDA delta rule is built for head widths {DELTA_HEAD_DIMS:?}, not {d}")
}

/// A recurrent kernel's warps per block and blocks per head for `quads` column quads per row
/// group (`DeltaShape` in kernels.cu): a warp owns `4 · quads` columns, a block up to 4 warps.
fn delta_rule_shape(d: usize, quads: usize) -> (usize, usize) {
    let columns = 4 * quads;
    let warps = (d / columns).min(4);
    (warps, d / (columns * warps))
}

/// One sequence of the chunked form: its state and rows.
#[derive(Clone, Copy, Debug)]
struct Prompt {
    state: u64,
    first: usize,
    rows: usize,
}

impl Prompt {
    fn chunks(&self) -> usize {
        self.rows.div_ceil(CHUNK)
    }
}

/// One round of the chunked form: for each sequence with chunks left, up to `per_seq` of them
/// from chunk `from` on, as the kernels' tables — the items (`ChunkItem`: first row, rows) and
/// then the runs (`ChunkRun`: state, first item, items) — and the counts of each.
fn round_tables(prompts: &[Prompt], from: usize, per_seq: usize) -> (Vec<u8>, usize, usize) {
    let mut items: Vec<u64> = Vec::new();
    let mut runs: Vec<u64> = Vec::new();
    for p in prompts.iter().filter(|p| p.chunks() > from) {
        let first_item = items.len() / 2;
        let upto = p.chunks().min(from + per_seq);
        for c in from..upto {
            let start = c * CHUNK;
            items.push((p.first + start) as u64);
            items.push(CHUNK.min(p.rows - start) as u64);
        }
        runs.extend([p.state, first_item as u64, (upto - from) as u64]);
    }
    let (n_items, n_runs) = (items.len() / 2, runs.len() / 3);
    let bytes = items
        .iter()
        .chain(&runs)
        .flat_map(|v| v.to_le_bytes())
        .collect();
    (bytes, n_items, n_runs)
}

impl CudaBackend {
    /// [`tandem_engine::backend::HybridOps::delta_rule`]: sequences asking for the chunked
    /// form take the chunked kernels (when set up), the others one recurrent launch.
    pub(crate) fn run_delta_rule(
        &self,
        inputs: DeltaInputs<'_, Self>,
        seqs: &Seqs,
        forms: &[DeltaForm],
        states: &mut [&mut T],
        out: &mut T,
    ) {
        let (h, d) = (inputs.heads, inputs.head_dim);
        assert_eq!(
            seqs.len(),
            states.len(),
            "delta_rule: one state per sequence"
        );
        assert_eq!(seqs.len(), forms.len(), "delta_rule: one form per sequence");
        if !DELTA_HEAD_DIMS.contains(&d) {
            unsupported(d);
        }
        let rows = seqs.iter().map(|s| s.end).max().unwrap_or(0);
        for (x, name) in [
            (inputs.q, "delta_rule q"),
            (inputs.k, "delta_rule k"),
            (inputs.v, "delta_rule v"),
            (inputs.g, "delta_rule g"),
        ] {
            need(x, DType::F32, rows * h * d, name);
        }
        need(inputs.beta, DType::F32, rows * h, "delta_rule beta");
        need(out, DType::F32, rows * h * d, "delta_rule output");
        let mut recurrent = Vec::new();
        let mut chunked = Vec::new();
        for ((s, state), form) in seqs.iter().zip(states.iter()).zip(forms) {
            if s.is_empty() {
                continue;
            }
            need(state, DType::F32, h * d * d, "delta_rule state");
            if *form == DeltaForm::Chunked && self.inner.delta_chunks {
                chunked.push(Prompt {
                    state: ptr(state),
                    first: s.start,
                    rows: s.len(),
                });
            } else {
                recurrent.push(SeqEntry {
                    state: ptr(state),
                    first: s.start,
                    rows: s.len(),
                });
            }
        }
        if !recurrent.is_empty() {
            self.delta_recurrent(&inputs, &recurrent, out);
        }
        if !chunked.is_empty() {
            self.delta_chunked(&inputs, &chunked, out);
        }
    }

    /// One recurrent launch over `entries`.
    fn delta_recurrent(&self, inputs: &DeltaInputs<'_, Self>, entries: &[SeqEntry], out: &mut T) {
        let (h, d) = (inputs.heads, inputs.head_dim);
        let (f, quads) = self.delta_rule_kernel(d, entries.len());
        let (warps, slices) = delta_rule_shape(d, quads);
        let table = self.seq_table(entries);
        let cfg = LaunchConfig {
            grid_dim: (entries.len() as u32, h as u32, slices as u32),
            block_dim: (32 * warps as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        self.launch(
            f,
            cfg,
            &[
                A::from(ptr(inputs.q)),
                A::from(ptr(inputs.k)),
                A::from(ptr(inputs.v)),
                A::from(ptr(inputs.g)),
                A::from(ptr(inputs.beta)),
                A::from(h as i32),
                A::from(table),
                A::from(ptr(out)),
            ],
        );
    }

    /// The chunked form over `prompts`, in rounds that fit [`WORK_BYTES`] of workspace.
    fn delta_chunked(&self, inputs: &DeltaInputs<'_, Self>, prompts: &[Prompt], out: &mut T) {
        let (h, d) = (inputs.heads, inputs.head_dim);
        let per_item = chunk_work_floats(d) * h * 4;
        let items_cap = (WORK_BYTES / per_item).max(1);
        let per_seq = (items_cap / prompts.len()).max(1);
        let most = prompts.iter().map(Prompt::chunks).max().unwrap_or(0);
        let round_items = prompts
            .iter()
            .map(|p| p.chunks().min(per_seq))
            .sum::<usize>();
        let work = {
            let mut scratch = self.inner.scratch.lock();
            let s = &mut *scratch;
            self.ensure(&mut s.retired, &mut s.delta_work, round_items * per_item)
        };
        let (prep, state) = chunk_kernels(&self.inner.kernels, d);
        let mut from = 0;
        while from < most {
            let (bytes, n_items, n_runs) = round_tables(prompts, from, per_seq);
            let table = self.upload_table(&bytes);
            let runs = table + (n_items * 16) as u64;
            self.launch(
                prep,
                LaunchConfig {
                    grid_dim: (n_items as u32, h as u32, 1),
                    block_dim: (CHUNK_THREADS, 1, 1),
                    shared_mem_bytes: prep_shared_bytes(d) as u32,
                },
                &[
                    A::from(ptr(inputs.q)),
                    A::from(ptr(inputs.k)),
                    A::from(ptr(inputs.v)),
                    A::from(ptr(inputs.g)),
                    A::from(ptr(inputs.beta)),
                    A::from(h as i32),
                    A::from(table),
                    A::from(work),
                ],
            );
            self.launch(
                state,
                LaunchConfig {
                    grid_dim: (n_runs as u32, h as u32, (d / state_columns(d)) as u32),
                    block_dim: (CHUNK_THREADS, 1, 1),
                    shared_mem_bytes: state_shared_bytes(d) as u32,
                },
                &[
                    A::from(table),
                    A::from(runs),
                    A::from(h as i32),
                    A::from(work),
                    A::from(ptr(out)),
                ],
            );
            from += per_seq;
        }
    }

    /// The recurrent kernel for heads of width `d` over `sequences` sequences, and its column
    /// quads per row group (`VQ` in kernels.cu). Measured on an H200 (32 heads x 128): with
    /// 4 quads, 32 and 128 decoding sequences take 54 and 171 us against 62 and 207 us with 2;
    /// one prefilling sequence (32768 tokens) takes 22.2 ms with 2 quads against 26.2 ms with
    /// 4, its 128 blocks of 4 warps filling more of the device than 64.
    fn delta_rule_kernel(&self, d: usize, sequences: usize) -> (&CudaFunction, usize) {
        let k = &self.inner.kernels;
        match d {
            16 => (&k.delta_rule_d16, 4),
            32 => (&k.delta_rule_d32, 4),
            64 => (&k.delta_rule_d64, 4),
            128 if sequences < FEW_SEQUENCES => (&k.delta_rule_d128_q2, 2),
            128 => (&k.delta_rule_d128, 4),
            _ => unsupported(d),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_cover_every_chunk_of_every_prompt_once_in_order() {
        let prompts = [
            Prompt {
                state: 0xa0,
                first: 0,
                rows: 1,
            },
            Prompt {
                state: 0xb0,
                first: 1,
                rows: 2 * CHUNK + 5,
            },
            Prompt {
                state: 0xc0,
                first: 2 * CHUNK + 6,
                rows: CHUNK,
            },
        ];
        let words = |b: &[u8]| -> Vec<u64> {
            b.chunks_exact(8)
                .map(|w| u64::from_le_bytes(w.try_into().expect("8 bytes")))
                .collect()
        };
        // Two chunks per sequence per round: the second round holds only the long prompt's last.
        let (b0, items0, runs0) = round_tables(&prompts, 0, 2);
        assert_eq!((items0, runs0), (4, 3));
        assert_eq!(
            words(&b0),
            [
                0,
                1,
                1,
                CHUNK as u64,
                CHUNK as u64 + 1,
                CHUNK as u64,
                2 * CHUNK as u64 + 6,
                CHUNK as u64,
                0xa0,
                0,
                1,
                0xb0,
                1,
                2,
                0xc0,
                3,
                1,
            ]
        );
        let (b1, items1, runs1) = round_tables(&prompts, 2, 2);
        assert_eq!((items1, runs1), (1, 1));
        assert_eq!(words(&b1), [2 * CHUNK as u64 + 1, 5, 0xb0, 0, 1]);
    }

    #[test]
    fn shared_memory_fits_a_hopper_block() {
        for d in DELTA_HEAD_DIMS {
            assert!(prep_shared_bytes(d) <= 227 << 10, "prep d{d}");
            assert!(state_shared_bytes(d) <= 227 << 10, "state d{d}");
        }
        assert_eq!(chunk_work_floats(128), 36_992);
    }
}
