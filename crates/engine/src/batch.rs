use crate::served::StateSlot;
use tandem_core::BlockId;

/// One sequence's slice of a [`ForwardBatch`].
#[derive(Clone, Debug)]
pub struct SeqSlice {
    /// First row of this sequence in the flattened token dimension.
    pub start: usize,
    /// New tokens of this sequence in this step.
    pub len: usize,
    /// Tokens already in the cache before this step.
    pub cached: usize,
    /// The sequence's KV blocks, in order (empty for a model without paged K/V).
    pub block_table: Vec<BlockId>,
    /// The sequence's state slot, for models with per-request state.
    pub state: Option<StateSlot>,
}

impl SeqSlice {
    /// Tokens in the cache after this step.
    pub fn context_len(&self) -> usize {
        self.cached + self.len
    }
}

/// A step's input: every sequence's new tokens flattened into one dimension.
#[derive(Clone, Debug, Default)]
pub struct ForwardBatch {
    /// Token ids, all sequences concatenated.
    pub token_ids: Vec<u32>,
    /// Position of each token.
    pub positions: Vec<u32>,
    /// Cache slot (block * block_size + offset) each token's K/V is written to.
    pub slot_mapping: Vec<u32>,
    /// Per-sequence slices.
    pub seqs: Vec<SeqSlice>,
    /// Rows whose logits are wanted (the last new token of sequences that sample).
    pub logits_rows: Vec<usize>,
}

impl ForwardBatch {
    /// Appends `tokens` of a sequence that already has `cached` tokens in `block_table`.
    pub fn push(
        &mut self,
        tokens: &[u32],
        cached: usize,
        block_table: &[BlockId],
        block_size: usize,
        want_logits: bool,
    ) {
        let start = self.token_ids.len();
        for (i, &t) in tokens.iter().enumerate() {
            let pos = cached + i;
            self.token_ids.push(t);
            self.positions.push(pos as u32);
            let block = block_table[pos / block_size];
            self.slot_mapping
                .push(block.0 * block_size as u32 + (pos % block_size) as u32);
        }
        self.seqs.push(SeqSlice {
            start,
            len: tokens.len(),
            cached,
            block_table: block_table.to_vec(),
            state: None,
        });
        if want_logits && !tokens.is_empty() {
            self.logits_rows.push(start + tokens.len() - 1);
        }
    }

    /// Appends `tokens` of a sequence whose state lives in `slot` (no paged K/V: its slot
    /// mapping entries are unused).
    pub fn push_state(
        &mut self,
        tokens: &[u32],
        cached: usize,
        slot: StateSlot,
        want_logits: bool,
    ) {
        let start = self.token_ids.len();
        for (i, &t) in tokens.iter().enumerate() {
            self.token_ids.push(t);
            self.positions.push((cached + i) as u32);
            self.slot_mapping.push(u32::MAX);
        }
        self.seqs.push(SeqSlice {
            start,
            len: tokens.len(),
            cached,
            block_table: Vec::new(),
            state: Some(slot),
        });
        if want_logits && !tokens.is_empty() {
            self.logits_rows.push(start + tokens.len() - 1);
        }
    }

    /// Tokens in the batch.
    pub fn num_tokens(&self) -> usize {
        self.token_ids.len()
    }
}
