use std::fmt;
use std::time::Duration;

/// A topology failure: a layout that cannot serve a model, a shard that does not exist, or a
/// collective that cannot complete.
///
/// Layout and shape errors are start-up errors; their messages name the numbers involved and
/// the rule they break, so the operator can fix the configuration without reading code.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A size that must be at least one is zero.
    #[error("{what} must be at least 1, got 0")]
    ZeroSize {
        /// Which size (`tp`, `dp`, `ep`, `kda.head_dim`, …).
        what: &'static str,
    },
    /// `tp` is not a multiple of `dp`, so there is no whole attention-TP size.
    #[error(
        "tp={tp} is not divisible by dp={dp}: the attention-TP size A = tp/dp must be a whole \
         number (each of the dp attention-DP groups has A ranks)"
    )]
    TpNotDivisibleByDp {
        /// Tensor-parallel size of the worker group.
        tp: usize,
        /// Attention data-parallel size.
        dp: usize,
    },
    /// `ep` does not divide `tp`.
    #[error(
        "ep={ep} does not divide tp={tp}: expert-parallel ranks are the TP group split into ep \
         equal parts (each expert shard is tensor-parallel over tp/ep ranks), so tp must be a \
         multiple of ep"
    )]
    EpNotDividingTp {
        /// Tensor-parallel size of the worker group.
        tp: usize,
        /// Expert-parallel size.
        ep: usize,
    },
    /// A head count is not a multiple of the attention-TP size.
    #[error(
        "{what}={count} is not divisible by the attention-TP size A = tp/dp = {tp}/{dp} = \
         {attn_tp}: attention is sharded by heads over the attention-TP group (never the global \
         TP group), and every rank must hold the same whole number of heads"
    )]
    HeadsNotDivisible {
        /// Which head count (`num_attention_heads`, `num_kv_heads`, `kda.num_heads`, …).
        what: &'static str,
        /// The head count.
        count: usize,
        /// Tensor-parallel size of the layout.
        tp: usize,
        /// Attention data-parallel size of the layout.
        dp: usize,
        /// Attention-TP size `tp / dp`.
        attn_tp: usize,
    },
    /// GQA query heads are not a whole multiple of the KV heads.
    #[error(
        "num_attention_heads={num_attention_heads} is not a multiple of \
         num_kv_heads={num_kv_heads}: each KV head must serve a whole group of query heads"
    )]
    GqaGroupNotWhole {
        /// Query heads.
        num_attention_heads: usize,
        /// Key/value heads.
        num_kv_heads: usize,
    },
    /// The expert count is not a multiple of `ep`.
    #[error(
        "num_experts={num_experts} is not divisible by ep={ep}: each expert-parallel rank must \
         hold the same whole number of experts"
    )]
    ExpertsNotDivisible {
        /// Routed experts in each MoE layer.
        num_experts: usize,
        /// Expert-parallel size.
        ep: usize,
    },
    /// `ep > 1` for a model without MoE layers.
    #[error("ep={ep} but the model has no MoE experts: use ep=1 (the default) for dense models")]
    EpWithoutExperts {
        /// Expert-parallel size.
        ep: usize,
    },
    /// An MLP intermediate size is not a multiple of the ranks it is split over.
    #[error(
        "{what}={size} is not divisible by {parts} ({rule}): every rank must hold the same \
         whole number of intermediate channels"
    )]
    IntermediateNotDivisible {
        /// Which size (`dense_intermediate_size`, `moe.intermediate_size`).
        what: &'static str,
        /// The intermediate size.
        size: usize,
        /// How many ranks it is split over.
        parts: usize,
        /// Where `parts` comes from, e.g. `"dense MLP is split over the full TP group, tp"`.
        rule: &'static str,
    },
    /// A length cannot be split into equal shards.
    #[error("cannot split {len} into {count} equal shards: {len} is not divisible by {count}")]
    NotDivisible {
        /// The length being split.
        len: usize,
        /// Number of shards.
        count: usize,
    },
    /// A rank or shard index is outside its group.
    #[error("{what}={index} is out of range for a group of {size}")]
    OutOfRange {
        /// Which index (`rank`, `attn_dp_rank`, `shard`, …).
        what: &'static str,
        /// The index given.
        index: usize,
        /// The group size.
        size: usize,
    },
    /// A communicator does not match the layout it is meant to serve.
    #[error("communicator has {actual} ranks but the layout needs {expected} ({what})")]
    GroupSizeMismatch {
        /// Which group.
        what: &'static str,
        /// Size the layout requires.
        expected: usize,
        /// Size of the communicator.
        actual: usize,
    },
    /// Ranks called a collective with arguments that do not fit together.
    #[error("collective {op} called inconsistently: {detail}")]
    CollectiveMismatch {
        /// The collective (`all_reduce_sum`, …) this rank called.
        op: &'static str,
        /// What did not fit (lengths, a different collective on another rank).
        detail: String,
    },
    /// A peer left the group (dropped its communicator, panicked or timed out), so the
    /// collective can never complete.
    #[error("rank {rank} of the group {failure}; collectives on this group cannot complete")]
    PeerFailed {
        /// The failed rank, in this group's numbering.
        rank: usize,
        /// How it failed.
        failure: PeerFailure,
    },
    /// This rank waited longer than the group's timeout for its peers.
    #[error("collective {op} timed out after {after:?} waiting for peers")]
    Timeout {
        /// The collective.
        op: &'static str,
        /// The configured timeout.
        after: Duration,
    },
}

/// How a peer left a communicator group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum PeerFailure {
    /// It dropped its communicator (its thread finished or gave up).
    Dropped,
    /// Its thread panicked while holding the communicator.
    Panicked,
    /// It gave up waiting for the others.
    TimedOut,
}

impl fmt::Display for PeerFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PeerFailure::Dropped => "dropped its communicator",
            PeerFailure::Panicked => "panicked",
            PeerFailure::TimedOut => "timed out",
        })
    }
}

/// `Result` with this crate's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;
