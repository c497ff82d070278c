//! A step's metadata on the device: token ids, positions, cache slots, per-sequence
//! `(start, len, cached)` and block tables, and the rows whose logits are wanted. The buffers
//! are allocated once for the largest step the engine runs and overwritten every step, so
//! a forward pass reads fixed addresses (what a captured GPU graph needs).

use crate::backend::Backend;
use crate::batch::ForwardBatch;
use crate::tensor::{DType, Tensor};
use crate::{Error, Result};

/// Largest step a [`StepMeta`] (and a model workspace) is sized for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepLimits {
    /// Tokens in one step.
    pub max_tokens: usize,
    /// Sequences in one step (also the most logits rows).
    pub max_seqs: usize,
    /// Blocks in one sequence's table.
    pub max_blocks_per_seq: usize,
}

/// The step metadata buffers, and how much of each the current step uses.
pub struct StepMeta<B: Backend> {
    limits: StepLimits,
    /// Token ids, `[max_tokens]` u32.
    pub token_ids: Tensor<B>,
    /// Positions, `[max_tokens]` u32.
    pub positions: Tensor<B>,
    /// Cache slot of each token, `[max_tokens]` u32.
    pub slot_mapping: Tensor<B>,
    /// `(start, len, cached)` per sequence, `[max_seqs * 3]` u32.
    pub seq_info: Tensor<B>,
    /// Block tables, `[max_seqs * max_blocks_per_seq]` u32.
    pub block_tables: Tensor<B>,
    /// Rows whose logits are computed, `[max_seqs]` u32.
    pub logits_rows: Tensor<B>,
    /// Tokens in this step.
    pub num_tokens: usize,
    /// Sequences in this step.
    pub num_seqs: usize,
    /// Logits rows in this step.
    pub num_logits: usize,
    /// The longest context (cached + new tokens) of a sequence in this step: what a device
    /// splits long decode attention by.
    pub max_context: usize,
    scratch: Vec<u32>,
}

impl<B: Backend> StepMeta<B> {
    /// Buffers for steps up to `limits`.
    pub fn new(backend: &B, limits: StepLimits) -> Self {
        let u32s = |n: usize| backend.zeros(DType::U32, &[n.max(1)]);
        Self {
            limits,
            token_ids: u32s(limits.max_tokens),
            positions: u32s(limits.max_tokens),
            slot_mapping: u32s(limits.max_tokens),
            seq_info: u32s(limits.max_seqs * 3),
            block_tables: u32s(limits.max_seqs * limits.max_blocks_per_seq),
            logits_rows: u32s(limits.max_seqs),
            num_tokens: 0,
            num_seqs: 0,
            num_logits: 0,
            max_context: 0,
            scratch: Vec::with_capacity(limits.max_seqs * limits.max_blocks_per_seq.max(3)),
        }
    }

    /// The limits these buffers were sized for.
    pub fn limits(&self) -> StepLimits {
        self.limits
    }

    /// The current step's shape (what recorded launches depend on).
    pub fn shape(&self) -> crate::backend::StepShape {
        crate::backend::StepShape {
            tokens: self.num_tokens,
            seqs: self.num_seqs,
            logits: self.num_logits,
            max_context: self.max_context,
        }
    }

    /// Entries per block table.
    pub fn table_stride(&self) -> usize {
        self.limits.max_blocks_per_seq
    }

    /// Uploads `batch` (one copy per buffer).
    pub fn upload(&mut self, backend: &B, batch: &ForwardBatch) -> Result<()> {
        let l = self.limits;
        let too_big = |what: &str, n: usize, max: usize| {
            Error::InvalidRequest(format!("step has {n} {what}, buffers hold {max}"))
        };
        if batch.num_tokens() > l.max_tokens {
            return Err(too_big("tokens", batch.num_tokens(), l.max_tokens));
        }
        if batch.seqs.len() > l.max_seqs {
            return Err(too_big("sequences", batch.seqs.len(), l.max_seqs));
        }
        if batch.logits_rows.len() > l.max_seqs {
            return Err(too_big("logits rows", batch.logits_rows.len(), l.max_seqs));
        }
        if let Some(s) = batch
            .seqs
            .iter()
            .find(|s| s.block_table.len() > l.max_blocks_per_seq)
        {
            return Err(too_big(
                "blocks in a sequence",
                s.block_table.len(),
                l.max_blocks_per_seq,
            ));
        }
        backend.write_u32(&mut self.token_ids, &batch.token_ids);
        backend.write_u32(&mut self.positions, &batch.positions);
        backend.write_u32(&mut self.slot_mapping, &batch.slot_mapping);
        self.scratch.clear();
        for s in &batch.seqs {
            self.scratch
                .extend([s.start as u32, s.len as u32, s.cached as u32]);
        }
        backend.write_u32(&mut self.seq_info, &self.scratch);
        self.scratch.clear();
        for s in &batch.seqs {
            self.scratch.extend(s.block_table.iter().map(|b| b.0));
            let pad = l.max_blocks_per_seq - s.block_table.len();
            self.scratch.extend(std::iter::repeat_n(0, pad));
        }
        backend.write_u32(&mut self.block_tables, &self.scratch);
        self.scratch.clear();
        self.scratch
            .extend(batch.logits_rows.iter().map(|&r| r as u32));
        backend.write_u32(&mut self.logits_rows, &self.scratch);
        self.num_tokens = batch.num_tokens();
        self.num_seqs = batch.seqs.len();
        self.num_logits = batch.logits_rows.len();
        self.max_context = batch
            .seqs
            .iter()
            .map(|s| s.context_len())
            .max()
            .unwrap_or(0);
        Ok(())
    }
}

impl<B: Backend> std::fmt::Debug for StepMeta<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StepMeta")
            .field("limits", &self.limits)
            .field("num_tokens", &self.num_tokens)
            .field("num_seqs", &self.num_seqs)
            .finish_non_exhaustive()
    }
}
