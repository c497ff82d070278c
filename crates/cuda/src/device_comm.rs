//! Collectives between the ranks of a layout that share one GPU (threads of this process, a
//! stream each): [`SameDevice`], what [`tandem_engine::Backend::in_process_comm`] gives CUDA
//! ranks. The values never leave the device and no rank waits for the GPU.
//!
//! A collective is two meetings of the ranks on the host (through the in-process
//! communicator), each exchanging a few 64-bit words:
//!
//! 1. each rank records an event on its stream after the work that produced its buffer and
//!    hands out the buffer's address and the event; every rank's stream then waits for every
//!    other's event and reads the others' buffers directly (they are all in one context's
//!    memory), writing only its own output;
//! 2. each rank records a second event after those reads and every stream waits for all of
//!    them, so no rank's later work overwrites a buffer another rank is still reading.
//!
//! Events are made once per communicator and recorded again each call: a rank records its
//! event for the next call only after the next first meeting, which every other rank reaches
//! only after queuing its waits on the previous recording.

use crate::device::{check, Arg as A, CudaBackend, CudaStorage};
use crate::ops::{flat_cfg, ptr};
use cudarc::driver::result::{event, stream};
use cudarc::driver::sys;
use parking_lot::Mutex;
use tandem_engine::backend::TensorComm;
use tandem_engine::{DType, Error, Result, Tensor};
use tandem_topology::{Communicator, InProcessCommunicator};

/// Sources the summing kernel takes in one launch (`sum_ranks` in kernels.cu).
const SUM_SOURCES: usize = 8;

/// One rank's handle on a group of ranks sharing its GPU.
pub struct SameDevice {
    host: InProcessCommunicator,
    state: Mutex<Option<State>>,
}

/// Made on the first collective, on the rank's backend.
struct State {
    backend: CudaBackend,
    /// Recorded after the rank's input is ready.
    ready: sys::CUevent,
    /// Recorded after the rank has read the others' buffers.
    done: sys::CUevent,
    /// The all-reduce's sum, before it replaces the rank's buffer.
    scratch: Option<CudaStorage>,
}

// SAFETY: the events are driver handles of the one context every rank shares; they are used
// under the mutex, and recorded and waited on through the driver, which is thread-safe.
unsafe impl Send for State {}

impl Drop for State {
    fn drop(&mut self) {
        if self.backend.inner.ctx.bind_to_thread().is_ok() {
            for e in [self.ready, self.done] {
                // SAFETY: made by `event::create` and no longer used; a wait still pending on
                // a stream lets the driver free it when it completes.
                let _ = unsafe { event::destroy(e) };
            }
        }
    }
}

fn collective(e: tandem_topology::Error) -> Error {
    Error::Collective(e.to_string())
}

impl SameDevice {
    /// The rank `host` names, meeting its peers through `host`.
    pub fn new(host: InProcessCommunicator) -> Self {
        Self {
            host,
            state: Mutex::new(None),
        }
    }

    fn check_len(t: &Tensor<CudaBackend>, elems: usize, what: &str) -> Result<()> {
        if t.dtype() != DType::F32 || t.len() < elems {
            return Err(Error::Collective(format!(
                "{what}: needs {elems} f32 values, has {} {}",
                t.len(),
                t.dtype()
            )));
        }
        Ok(())
    }

    /// Every rank's `words`, in rank order (a host meeting: 64-bit words travel as pairs of
    /// f32 bit patterns, which the in-process communicator copies unchanged).
    fn exchange(&self, words: &[u64]) -> Result<Vec<Vec<u64>>> {
        let mine: Vec<f32> = words
            .iter()
            .flat_map(|&w| [f32::from_bits(w as u32), f32::from_bits((w >> 32) as u32)])
            .collect();
        let all = Communicator::all_gather(&self.host, &mine).map_err(collective)?;
        Ok(all
            .chunks_exact(2 * words.len().max(1))
            .map(|rank| {
                rank.chunks_exact(2)
                    .map(|p| u64::from(p[0].to_bits()) | (u64::from(p[1].to_bits()) << 32))
                    .collect()
            })
            .collect())
    }

    /// Runs `body` with this rank's state (made on `backend` the first time).
    fn with_state<R>(
        &self,
        backend: &CudaBackend,
        body: impl FnOnce(&mut State) -> Result<R>,
    ) -> Result<R> {
        // A traced step cannot defer event records and waits: it runs eagerly from here.
        backend.break_trace("a collective between ranks on one GPU");
        let mut guard = self.state.lock();
        if guard.is_none() {
            check(backend.inner.ctx.bind_to_thread(), "context");
            let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING;
            let made = event::create(flags)
                .and_then(|ready| event::create(flags).map(|done| (ready, done)));
            let (ready, done) =
                made.map_err(|e| Error::Device(format!("collective events: {e}")))?;
            *guard = Some(State {
                backend: backend.clone(),
                ready,
                done,
                scratch: None,
            });
        }
        match guard.as_mut() {
            Some(state) => body(state),
            None => Err(Error::Device("collective state missing".into())),
        }
    }

    /// Meeting 1: records `ready`, hands out `addr` (and the device), waits for every peer's
    /// `ready`; returns every rank's address.
    fn meet_ready(&self, s: &State, addr: u64) -> Result<Vec<u64>> {
        let b = &s.backend;
        record(b, s.ready)?;
        let ordinal = b.inner.ordinal as u64;
        let all = self.exchange(&[addr, s.ready as u64, ordinal])?;
        if let Some(other) = all.iter().find(|w| w[2] != ordinal) {
            return Err(Error::Collective(format!(
                "ranks on cuda:{ordinal} and cuda:{} cannot meet in device memory (that takes NCCL)",
                other[2]
            )));
        }
        for (r, w) in all.iter().enumerate() {
            if r != Communicator::rank(&self.host) {
                wait(b, w[1] as sys::CUevent)?;
            }
        }
        Ok(all.iter().map(|w| w[0]).collect())
    }

    /// Meeting 2: records `done` and waits for every peer's.
    fn meet_done(&self, s: &State) -> Result<()> {
        let b = &s.backend;
        record(b, s.done)?;
        let all = self.exchange(&[s.done as u64])?;
        for (r, w) in all.iter().enumerate() {
            if r != Communicator::rank(&self.host) {
                wait(b, w[0] as sys::CUevent)?;
            }
        }
        Ok(())
    }
}

fn record(b: &CudaBackend, e: sys::CUevent) -> Result<()> {
    check(b.inner.ctx.bind_to_thread(), "context");
    // SAFETY: `e` is a live event of this context; the stream is the backend's.
    unsafe { event::record(e, b.stream().cu_stream()) }
        .map_err(|err| Error::Device(format!("event record: {err}")))
}

fn wait(b: &CudaBackend, e: sys::CUevent) -> Result<()> {
    // SAFETY: `e` is a live event of a peer rank in this context (kept until its rank's
    // communicator drops, after every collective).
    unsafe {
        stream::wait_event(
            b.stream().cu_stream(),
            e,
            sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
        )
    }
    .map_err(|err| Error::Device(format!("event wait: {err}")))
}

impl CudaBackend {
    /// `out[..n] (+)= Σ sources[j][..n]`, eight sources a launch.
    fn sum_sources(&self, out: u64, sources: &[u64], n: usize) {
        for (i, group) in sources.chunks(SUM_SOURCES).enumerate() {
            let mut args = vec![
                A::from(out),
                A::from(n as i64),
                A::from(group.len() as i32),
                A::from(i32::from(i > 0)),
            ];
            args.extend((0..SUM_SOURCES).map(|j| A::from(group.get(j).copied().unwrap_or(0))));
            self.launch(&self.inner.kernels.sum_ranks, flat_cfg(n), &args);
        }
    }

    /// Copies `bytes` from `src` to `dst` on the stream.
    fn copy_device(&self, dst: u64, src: u64, bytes: usize) {
        if bytes > 0 {
            self.submit(crate::trace::Op::Copy { dst, src, bytes });
        }
    }
}

impl TensorComm<CudaBackend> for SameDevice {
    fn rank(&self) -> usize {
        Communicator::rank(&self.host)
    }

    fn size(&self) -> usize {
        Communicator::size(&self.host)
    }

    fn all_reduce_sum(
        &self,
        backend: &CudaBackend,
        t: &mut Tensor<CudaBackend>,
        elems: usize,
    ) -> Result<()> {
        Self::check_len(t, elems, "all_reduce")?;
        if Communicator::size(&self.host) == 1 || elems == 0 {
            return Ok(());
        }
        self.with_state(backend, |s| {
            let bytes = elems * 4;
            if s.scratch.as_ref().is_none_or(|b| b.bytes() < bytes) {
                s.scratch = Some(s.backend.alloc(bytes.next_power_of_two()));
            }
            let scratch = s.scratch.as_ref().map_or(0, CudaStorage::ptr);
            let addrs = self.meet_ready(s, ptr(t))?;
            s.backend.sum_sources(scratch, &addrs, elems);
            self.meet_done(s)?;
            s.backend.copy_device(ptr(t), scratch, bytes);
            Ok(())
        })
    }

    fn all_gather(
        &self,
        backend: &CudaBackend,
        local: &Tensor<CudaBackend>,
        elems: usize,
        out: &mut Tensor<CudaBackend>,
    ) -> Result<()> {
        let size = Communicator::size(&self.host);
        Self::check_len(local, elems, "all_gather")?;
        Self::check_len(out, elems * size, "all_gather output")?;
        self.with_state(backend, |s| {
            let addrs = self.meet_ready(s, ptr(local))?;
            for (j, a) in addrs.iter().enumerate() {
                s.backend
                    .copy_device(ptr(out) + (j * elems * 4) as u64, *a, elems * 4);
            }
            self.meet_done(s)
        })
    }

    fn reduce_scatter_sum(
        &self,
        backend: &CudaBackend,
        input: &Tensor<CudaBackend>,
        elems: usize,
        out: &mut Tensor<CudaBackend>,
    ) -> Result<()> {
        let size = Communicator::size(&self.host);
        Self::check_len(input, elems * size, "reduce_scatter")?;
        Self::check_len(out, elems, "reduce_scatter output")?;
        self.with_state(backend, |s| {
            let addrs = self.meet_ready(s, ptr(input))?;
            let at = (Communicator::rank(&self.host) * elems * 4) as u64;
            let mine: Vec<u64> = addrs.iter().map(|a| a + at).collect();
            s.backend.sum_sources(ptr(out), &mine, elems);
            self.meet_done(s)
        })
    }

    fn all_to_all(
        &self,
        backend: &CudaBackend,
        send: &Tensor<CudaBackend>,
        elems: usize,
        recv: &mut Tensor<CudaBackend>,
    ) -> Result<()> {
        let size = Communicator::size(&self.host);
        Self::check_len(send, elems * size, "all_to_all")?;
        Self::check_len(recv, elems * size, "all_to_all output")?;
        self.with_state(backend, |s| {
            let addrs = self.meet_ready(s, ptr(send))?;
            let chunk = (elems * 4) as u64;
            let me = Communicator::rank(&self.host) as u64;
            for (j, a) in addrs.iter().enumerate() {
                s.backend
                    .copy_device(ptr(recv) + j as u64 * chunk, a + me * chunk, elems * 4);
            }
            self.meet_done(s)
        })
    }
}
