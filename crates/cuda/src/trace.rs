//! Traced steps: a step whose host code must run every time (the KDA-hybrid forward builds
//! per-step tables of state and latent addresses as it goes, and advances host-side row
//! counts) but whose device work repeats, replayed as a CUDA graph.
//!
//! Inside [`CudaBackend::trace_step`] nothing reaches the stream while the step's host code
//! runs. Each kernel launch, cuBLAS product, memset and copy is recorded as an [`Op`]; tensors
//! the step allocates come from a bump arena of device memory, so the same step makes the same
//! allocations at the same addresses every time; host tables and uploads are written into a
//! staging area whose device twin is filled with one copy when the step ends. Then:
//!
//! - the recorded ops equal those of a graph captured before (compared in full, not only by
//!   hash): the staging copy and one graph launch;
//! - they were seen once before: captured as a graph now and launched;
//! - otherwise: issued one by one, as an eager step would have.
//!
//! Equal ops mean equal work: the same kernels with the same arguments on the same addresses,
//! reading the tables the staging copy just wrote, so a replay is the eager step exactly, and
//! a step whose shape or addresses changed simply does not match. A step that must read the
//! device midway (a download, a synchronize, a host-staged collective) stops recording there:
//! what was recorded runs at once and the rest of the step runs eagerly.
//!
//! Arena tensors live until the next traced step begins (the step's logits are read before
//! that); what must outlive the step (latent blocks a step adds) is allocated with
//! [`tandem_engine::Backend::zeros_lasting`].

use crate::device::{check, Arg, CudaBackend, CudaStorage};
use crate::gemm::GemmOp;
use crate::mla::BatchedGemm;
use cudarc::driver::{sys, CudaGraph, LaunchConfig};
use std::collections::{HashMap, HashSet};
use std::hash::{Hash, Hasher};
use std::sync::atomic::Ordering;

/// Most parameters a kernel takes.
pub(crate) const MAX_ARGS: usize = 24;
/// Alignment of arena and staging allocations.
const ALIGN: usize = 256;
/// The smallest arena or staging chunk.
const MIN_CHUNK: usize = 1 << 20;
/// Graphs kept; past this every recording is dropped and steps are captured afresh.
const MAX_GRAPHS: usize = 64;
/// Fingerprints remembered as seen once.
const MAX_SEEN: usize = 4096;

/// One kernel launch: the function, its launch shape and each parameter as a 64-bit word.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct KernelOp {
    function: usize,
    pub(crate) grid: (u32, u32, u32),
    pub(crate) block: (u32, u32, u32),
    pub(crate) shared_mem_bytes: u32,
    pub(crate) programmatic: bool,
    pub(crate) args: u8,
    pub(crate) words: [u64; MAX_ARGS],
}

impl KernelOp {
    /// The driver's function handle.
    pub(crate) fn function(&self) -> sys::CUfunction {
        self.function as sys::CUfunction
    }
}

/// One unit of device work a step queues.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Op {
    Kernel(KernelOp),
    Gemm(GemmOp),
    Batched(BatchedGemm),
    /// Zero `bytes` at `at`.
    Memset {
        at: u64,
        bytes: usize,
    },
    /// Device-to-device copy (staged host data into its destination).
    Copy {
        dst: u64,
        src: u64,
        bytes: usize,
    },
}

impl KernelOp {
    /// A launch of `function` with `args` in the order of its parameters.
    pub(crate) fn new(
        function: sys::CUfunction,
        cfg: LaunchConfig,
        args: &[Arg],
        programmatic: bool,
    ) -> Self {
        assert!(
            args.len() <= MAX_ARGS,
            "kernel with more than {MAX_ARGS} arguments"
        );
        let mut words = [0u64; MAX_ARGS];
        for (w, a) in words.iter_mut().zip(args) {
            *w = a.word();
        }
        KernelOp {
            function: function as usize,
            grid: cfg.grid_dim,
            block: cfg.block_dim,
            shared_mem_bytes: cfg.shared_mem_bytes,
            programmatic,
            args: args.len() as u8,
            words,
        }
    }
}

/// How traced steps went, counted since the backend opened.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TraceStats {
    /// Steps that replayed a graph.
    pub replayed: u64,
    /// Steps captured as a graph (then launched).
    pub captured: u64,
    /// Steps seen for the first time, issued op by op.
    pub eager: u64,
    /// Steps that had to read the device midway, so ran eagerly from there.
    pub broken: u64,
}

/// A captured graph. It refers to device memory and the stream only; it is launched from the
/// thread that owns the backend's stream.
struct Recorded(CudaGraph);

// SAFETY: a CUDA graph exec may be launched from any thread as long as launches are not
// concurrent, which the tracer's mutex guarantees.
unsafe impl Send for Recorded {}

struct Graph {
    ops: Vec<Op>,
    exec: Recorded,
}

/// Device memory handed out front to back and taken back all at once.
#[derive(Default)]
struct Bump {
    chunks: Vec<Chunk>,
}

struct Chunk {
    dev: CudaStorage,
    used: usize,
    /// Staging only: what the device twin must hold once the step's copy lands.
    host: Vec<u8>,
}

impl Bump {
    /// Everything back; chunks grown during the last step merge into one.
    fn reset(&mut self, b: &CudaBackend) {
        if self.chunks.len() > 1 {
            let total: usize = self.chunks.iter().map(|c| c.dev.bytes()).sum();
            self.chunks.clear();
            self.chunks.push(Chunk {
                dev: b.alloc(total.next_power_of_two()),
                used: 0,
                host: Vec::new(),
            });
        }
        for c in &mut self.chunks {
            c.used = 0;
            c.host.clear();
        }
    }

    /// `bytes` more (rounded up to [`ALIGN`]): (chunk, offset in it, device address).
    fn take(&mut self, b: &CudaBackend, bytes: usize) -> (usize, usize, u64) {
        let bytes = bytes.max(1).next_multiple_of(ALIGN);
        let fits = self
            .chunks
            .last()
            .is_some_and(|c| c.used + bytes <= c.dev.bytes());
        if !fits {
            let last = self.chunks.last().map_or(0, |c| c.dev.bytes());
            let size = bytes.max(2 * last).max(MIN_CHUNK).next_power_of_two();
            self.chunks.push(Chunk {
                dev: b.alloc(size),
                used: 0,
                host: Vec::new(),
            });
        }
        let i = self.chunks.len() - 1;
        let c = &mut self.chunks[i];
        let at = c.used;
        c.used += bytes;
        (i, at, c.dev.ptr() + at as u64)
    }
}

/// A backend's traced-step state (see the module docs).
#[derive(Default)]
pub(crate) struct Tracer {
    /// Ops are being deferred (false outside a step and once a step has broken).
    recording: bool,
    broken: bool,
    ops: Vec<Op>,
    arena: Bump,
    staging: Bump,
    graphs: HashMap<u64, Vec<Graph>>,
    seen: HashSet<u64>,
    stats: TraceStats,
}

fn fingerprint(ops: &[Op]) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    ops.hash(&mut h);
    h.finish()
}

impl CudaBackend {
    /// Whether a traced step is under way on this backend.
    pub(crate) fn traced(&self) -> bool {
        self.inner.tracing.load(Ordering::Relaxed)
    }

    /// Turns tracing of steps on or off (the default comes from `TANDEM_CUDA_TRACED_STEPS`);
    /// off, a traced step runs eagerly.
    pub fn set_traced_steps(&self, on: bool) {
        self.inner.trace_enabled.store(on, Ordering::Relaxed);
    }

    /// How traced steps went so far.
    pub fn trace_stats(&self) -> TraceStats {
        self.inner.trace.lock().stats
    }

    /// Queues `op` on the stream, or records it inside a traced step.
    pub(crate) fn submit(&self, op: Op) {
        if self.traced() {
            let mut t = self.inner.trace.lock();
            if t.recording {
                t.ops.push(op);
                return;
            }
        }
        self.exec(&op);
    }

    /// Queues `op` on the stream now.
    pub(crate) fn exec(&self, op: &Op) {
        match op {
            Op::Kernel(k) => self.launch_now(k),
            Op::Gemm(g) => self.gemm_now(g),
            Op::Batched(g) => self.batched_gemm_now(g),
            Op::Memset { at, bytes } => {
                check(self.inner.ctx.bind_to_thread(), "context");
                // SAFETY: the op was made for a live buffer of at least `bytes` bytes.
                let r = unsafe {
                    cudarc::driver::result::memset_d8_async(
                        *at,
                        0,
                        *bytes,
                        self.inner.stream.cu_stream(),
                    )
                };
                check(r, "memset");
            }
            Op::Copy { dst, src, bytes } => {
                check(self.inner.ctx.bind_to_thread(), "context");
                // SAFETY: the op was made for live buffers of at least `bytes` bytes each.
                let r = unsafe {
                    cudarc::driver::result::memcpy_dtod_async(
                        *dst,
                        *src,
                        *bytes,
                        self.inner.stream.cu_stream(),
                    )
                };
                check(r, "device copy");
            }
        }
    }

    /// A zeroed temporary of `bytes` from the step arena (inside a traced step).
    pub(crate) fn arena_zeros(&self, bytes: usize) -> CudaStorage {
        let at = {
            let mut t = self.inner.trace.lock();
            t.arena.take(self, bytes).2
        };
        let bytes = bytes.max(16);
        self.submit(Op::Memset { at, bytes });
        CudaStorage::borrowed(at, bytes)
    }

    /// Puts `bytes` in the step's staging and returns their device address (inside a traced
    /// step). Sizes are rounded up to a power of two so a table that grows a little (one more
    /// latent block) leaves every later table where it was.
    pub(crate) fn stage(&self, bytes: &[u8]) -> u64 {
        let (at, now) = {
            let mut t = self.inner.trace.lock();
            let room = bytes.len().max(16).next_power_of_two();
            let (chunk, offset, at) = t.staging.take(self, room);
            let host = &mut t.staging.chunks[chunk].host;
            if host.len() < offset + bytes.len() {
                host.resize(offset + bytes.len(), 0);
            }
            host[offset..offset + bytes.len()].copy_from_slice(bytes);
            (at, !t.recording)
        };
        if now {
            // The step broke: what follows runs eagerly, so the data goes up now.
            self.htod_now(at, bytes);
        }
        at
    }

    /// `bytes` for device address `dst` through the staging: one copy op from there (inside a
    /// traced step).
    pub(crate) fn staged_copy(&self, dst: u64, bytes: &[u8]) {
        let src = self.stage(bytes);
        self.submit(Op::Copy {
            dst,
            src,
            bytes: bytes.len(),
        });
    }

    /// Inside a recording traced step, runs what was recorded now and the rest of the step
    /// eagerly: something is about to read the device (or use the stream directly).
    pub(crate) fn break_trace(&self, why: &str) {
        if !self.traced() {
            return;
        }
        let ops = {
            let mut t = self.inner.trace.lock();
            if !t.recording {
                return;
            }
            t.recording = false;
            t.broken = true;
            std::mem::take(&mut t.ops)
        };
        tracing::debug!(
            why,
            recorded = ops.len(),
            "a traced step runs eagerly from here"
        );
        self.upload_staging();
        for op in &ops {
            self.exec(op);
        }
    }

    /// Copies the staging's host side to its device twin.
    fn upload_staging(&self) {
        let t = self.inner.trace.lock();
        for c in &t.staging.chunks {
            self.htod_now(c.dev.ptr(), &c.host);
        }
    }

    /// Runs `step` traced (see the module docs); nested calls and a backend with tracing off
    /// run it eagerly.
    pub(crate) fn trace_step(&self, step: &mut dyn FnMut()) {
        if !self.inner.trace_enabled.load(Ordering::Relaxed) || self.traced() {
            return step();
        }
        {
            let mut t = self.inner.trace.lock();
            t.recording = true;
            t.broken = false;
            t.ops.clear();
            let Tracer { arena, staging, .. } = &mut *t;
            arena.reset(self);
            staging.reset(self);
        }
        /// Ends the step even if `step` panics.
        struct Finish<'a>(&'a CudaBackend);
        impl Drop for Finish<'_> {
            fn drop(&mut self) {
                self.0.inner.tracing.store(false, Ordering::Relaxed);
                self.0.inner.trace.lock().recording = false;
            }
        }
        self.inner.tracing.store(true, Ordering::Relaxed);
        let finish = Finish(self);
        step();
        let (ops, broken) = {
            let mut t = self.inner.trace.lock();
            (std::mem::take(&mut t.ops), t.broken)
        };
        drop(finish);
        if broken {
            self.inner.trace.lock().stats.broken += 1;
            return;
        }
        self.upload_staging();
        self.run_ops(ops);
    }

    /// A finished recording: replayed, captured or issued (see the module docs).
    fn run_ops(&self, ops: Vec<Op>) {
        let key = fingerprint(&ops);
        let mut t = self.inner.trace.lock();
        if let Some(g) = t
            .graphs
            .get(&key)
            .and_then(|gs| gs.iter().find(|g| g.ops == ops))
        {
            check(g.exec.0.launch(), "graph launch");
            t.stats.replayed += 1;
            return;
        }
        if t.seen.len() >= MAX_SEEN {
            t.seen.clear();
        }
        if t.seen.insert(key) {
            t.stats.eager += 1;
            drop(t);
            for op in &ops {
                self.exec(op);
            }
            return;
        }
        drop(t);
        let stream = self.stream();
        check(
            stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
            "begin graph capture",
        );
        for op in &ops {
            self.exec(op);
        }
        let graph = check(
            stream.end_capture(sys::CUgraphInstantiate_flags(0)),
            "end graph capture",
        );
        let mut t = self.inner.trace.lock();
        match graph {
            Some(g) => {
                check(g.launch(), "graph launch");
                if t.graphs.values().map(Vec::len).sum::<usize>() >= MAX_GRAPHS {
                    t.graphs.clear();
                }
                t.stats.captured += 1;
                tracing::debug!(ops = ops.len(), "captured a traced step as a CUDA graph");
                t.graphs.entry(key).or_default().push(Graph {
                    ops,
                    exec: Recorded(g),
                });
            }
            None => {
                t.stats.eager += 1;
                drop(t);
                for op in &ops {
                    self.exec(op);
                }
            }
        }
    }
}
