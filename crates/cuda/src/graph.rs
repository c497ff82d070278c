//! Decode steps recorded as CUDA graphs and replayed. A shape is run eagerly the first time
//! it is seen (which also sizes every scratch buffer it uses), captured on the backend's
//! stream the second time, and replayed from then on: one launch instead of hundreds.
//! A recording holds the addresses of the workspace, cache and step-metadata buffers, so
//! it lives with them (the engine owns the [`StepGraphs`] beside its workspace) and stays
//! valid across weight refreshes, which overwrite weights in place.

use crate::device::{check, CudaBackend};
use cudarc::driver::{sys, CudaGraph};
use std::collections::{HashMap, HashSet};
use tandem_engine::StepShape;

/// A captured graph. It refers to device memory and the stream only; replays are queued
/// from the one thread that owns the engine.
struct Recorded(CudaGraph);

// SAFETY: a CUDA graph exec may be launched from any thread as long as launches are not
// concurrent, which the owning `&mut StepGraphs` guarantees.
unsafe impl Send for Recorded {}

/// The recordings of one engine, by step shape.
#[derive(Default)]
pub struct StepGraphs {
    seen: HashSet<Key>,
    recorded: HashMap<Key, Recorded>,
    disabled: bool,
}

impl StepGraphs {
    /// Shapes recorded so far.
    pub fn len(&self) -> usize {
        self.recorded.len()
    }
    /// Whether nothing is recorded yet.
    pub fn is_empty(&self) -> bool {
        self.recorded.is_empty()
    }
}

/// What a recording depends on: the shape with the context replaced by its bucket (the
/// attention split count depends on nothing else; contexts in one bucket replay one graph).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Key {
    tokens: usize,
    seqs: usize,
    logits: usize,
    context: usize,
}

impl CudaBackend {
    pub(crate) fn run_recorded(
        &self,
        graphs: &mut StepGraphs,
        shape: Option<StepShape>,
        step: &mut dyn FnMut(),
    ) {
        let Some(shape) = shape.filter(|_| !graphs.disabled && crate::env::graphs()) else {
            return step();
        };
        let key = Key {
            tokens: shape.tokens,
            seqs: shape.seqs,
            logits: shape.logits,
            context: crate::ops::context_bucket(shape.max_context),
        };
        if let Some(g) = graphs.recorded.get(&key) {
            check(g.0.launch(), "graph launch");
            return;
        }
        if graphs.seen.insert(key) {
            return step();
        }
        let stream = self.stream();
        check(
            stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
            "begin graph capture",
        );
        step();
        let graph = check(
            stream.end_capture(sys::CUgraphInstantiate_flags(0)),
            "end graph capture",
        );
        match graph {
            Some(g) => {
                check(g.launch(), "graph launch");
                tracing::debug!(
                    tokens = key.tokens,
                    context_bucket = key.context,
                    recorded = graphs.recorded.len() + 1,
                    "captured a decode step as a CUDA graph"
                );
                graphs.recorded.insert(key, Recorded(g));
            }
            None => {
                tracing::warn!("CUDA graph capture produced nothing; running steps eagerly");
                graphs.disabled = true;
                step();
            }
        }
    }
}
