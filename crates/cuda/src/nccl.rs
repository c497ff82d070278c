//! NCCL communicators: the [`TensorComm`] for tensor-parallel ranks on distinct GPUs. Each
//! collective is one NCCL call on the calling rank's stream over device memory (nothing goes
//! through the host), so a step holding them can be recorded into a CUDA graph
//! ([`TensorComm::replayable`]).
//!
//! NCCL is loaded at run time, like the driver: `libnccl.so` must be on the library path
//! (Debian/Ubuntu's `libnccl-dev`, or a symlink named `libnccl.so` to the `libnccl.so.2` of
//! the `nvidia-nccl` wheel). NCCL takes one rank per GPU: ranks sharing a device meet through
//! the in-process communicator instead ([`tandem_engine::Backend::in_process_comm`]).

use crate::device::CudaBackend;
use crate::ops::ptr;
use cudarc::nccl::{result as nccl, sys};
use std::ffi::c_void;
use tandem_engine::backend::TensorComm;
use tandem_engine::{DType, Error, Result, Tensor};

/// The identity every rank of one NCCL group joins with (made once, by any rank or the
/// process that starts them, and handed to all).
#[derive(Clone, Copy)]
pub struct NcclId(sys::ncclUniqueId);

impl NcclId {
    /// A fresh group identity.
    pub fn new() -> Result<Self> {
        if let Some(why) = unavailable() {
            return Err(Error::Device(why));
        }
        nccl::get_uniqueid()
            .map(Self)
            .map_err(|e| Error::Device(format!("NCCL unique id: {e:?}")))
    }

    /// The identity's bytes, to send to ranks in other processes.
    pub fn to_bytes(&self) -> Vec<u8> {
        self.0.internal.iter().map(|&c| c as u8).collect()
    }

    /// An identity from [`NcclId::to_bytes`].
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let mut id = sys::ncclUniqueId { internal: [0; 128] };
        if bytes.len() != id.internal.len() {
            return Err(Error::InvalidRequest(format!(
                "an NCCL id is {} bytes, not {}",
                id.internal.len(),
                bytes.len()
            )));
        }
        for (d, &b) in id.internal.iter_mut().zip(bytes) {
            *d = b as std::ffi::c_char;
        }
        Ok(Self(id))
    }
}

/// Why NCCL cannot be used here, if so.
pub fn unavailable() -> Option<String> {
    // SAFETY: only tries to open the shared library.
    let present = unsafe { sys::is_culib_present() };
    (!present).then(|| {
        "NCCL is not installed here (libnccl.so not found on the library path)".to_string()
    })
}

/// One rank's membership of an NCCL group.
pub struct NcclComm {
    comm: sys::ncclComm_t,
    rank: usize,
    size: usize,
}

// SAFETY: an NCCL communicator may be used from any thread, one call at a time; a rank's
// collectives are issued by the one thread that runs its steps (the model's ranks own their
// communicators), and NCCL's own calls are thread-safe for distinct communicators.
unsafe impl Send for NcclComm {}
// SAFETY: as above: `&self` methods only enqueue work on the caller's stream.
unsafe impl Sync for NcclComm {}

impl NcclComm {
    /// Joins group `id` as rank `rank` of `size`, on `backend`'s device. Blocks until every
    /// rank has joined, so the ranks of one process call it from threads of their own (see
    /// [`NcclComm::group`]).
    pub fn join(backend: &CudaBackend, id: &NcclId, rank: usize, size: usize) -> Result<Self> {
        if let Some(why) = unavailable() {
            return Err(Error::Device(why));
        }
        if rank >= size {
            return Err(Error::InvalidRequest(format!(
                "NCCL rank {rank} of a group of {size}"
            )));
        }
        backend
            .inner
            .ctx
            .bind_to_thread()
            .map_err(|e| Error::Device(format!("CUDA context: {e}")))?;
        let mut comm = std::ptr::null_mut();
        // SAFETY: `comm` is a valid out-pointer; the id is a group's identity.
        unsafe { nccl::comm_init_rank(&mut comm, size as i32, id.0, rank as i32) }
            .map_err(|e| Error::Device(format!("NCCL rank {rank} of {size}: {e:?}")))?;
        Ok(Self { comm, rank, size })
    }

    /// A group over `backends` (rank `r` on `backends[r]`), for ranks that are threads of
    /// this process: each joins on a thread of its own. Refused when two ranks share a GPU
    /// (NCCL takes one rank per device).
    pub fn group(backends: &[CudaBackend]) -> Result<Vec<Self>> {
        for (i, a) in backends.iter().enumerate() {
            if let Some(j) = backends[..i]
                .iter()
                .position(|b| b.inner.ordinal == a.inner.ordinal)
            {
                return Err(Error::InvalidRequest(format!(
                    "NCCL takes one rank per GPU: ranks {j} and {i} are both on cuda:{}",
                    a.inner.ordinal
                )));
            }
        }
        let id = NcclId::new()?;
        let size = backends.len();
        std::thread::scope(|s| {
            let joins: Vec<_> = backends
                .iter()
                .enumerate()
                .map(|(rank, b)| s.spawn(move || Self::join(b, &id, rank, size)))
                .collect();
            joins
                .into_iter()
                .map(|j| {
                    j.join()
                        .unwrap_or_else(|_| Err(Error::Device("an NCCL rank panicked".into())))
                })
                .collect()
        })
    }

    /// The rank's stream, for a collective queued on it now (a traced step stops recording:
    /// NCCL calls cannot be deferred).
    fn stream(backend: &CudaBackend) -> sys::cudaStream_t {
        backend.break_trace("an NCCL collective");
        backend.stream().cu_stream() as sys::cudaStream_t
    }

    fn check(t: &Tensor<CudaBackend>, elems: usize, what: &str) -> Result<*mut c_void> {
        if t.dtype() != DType::F32 || t.len() < elems {
            return Err(Error::Collective(format!(
                "{what}: needs {elems} f32 values, has {} {}",
                t.len(),
                t.dtype()
            )));
        }
        Ok(ptr(t) as *mut c_void)
    }

    fn done(r: std::result::Result<nccl::NcclStatus, nccl::NcclError>, what: &str) -> Result<()> {
        r.map(|_| ())
            .map_err(|e| Error::Collective(format!("NCCL {what}: {e:?}")))
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        // SAFETY: the communicator is ours and no call of it is in flight on the host.
        if let Err(e) = unsafe { nccl::comm_destroy(self.comm) } {
            tracing::warn!(error = ?e, "NCCL communicator teardown failed");
        }
    }
}

impl TensorComm<CudaBackend> for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    /// Every collective is a call on the step's stream over device memory.
    fn replayable(&self) -> bool {
        true
    }

    fn all_reduce_sum(
        &self,
        backend: &CudaBackend,
        t: &mut Tensor<CudaBackend>,
        elems: usize,
    ) -> Result<()> {
        let p = Self::check(t, elems, "all_reduce_sum")?;
        // SAFETY: `p` holds `elems` f32 values on this rank's device; in place is allowed.
        let r = unsafe {
            nccl::all_reduce(
                p,
                p,
                elems,
                sys::ncclDataType_t::ncclFloat32,
                sys::ncclRedOp_t::ncclSum,
                self.comm,
                Self::stream(backend),
            )
        };
        Self::done(r, "all_reduce_sum")
    }

    fn all_gather(
        &self,
        backend: &CudaBackend,
        local: &Tensor<CudaBackend>,
        elems: usize,
        out: &mut Tensor<CudaBackend>,
    ) -> Result<()> {
        let src = Self::check(local, elems, "all_gather input")?;
        let dst = Self::check(out, elems * self.size, "all_gather output")?;
        // SAFETY: both buffers hold what the call reads and writes on this rank's device.
        let r = unsafe {
            nccl::all_gather(
                src,
                dst,
                elems,
                sys::ncclDataType_t::ncclFloat32,
                self.comm,
                Self::stream(backend),
            )
        };
        Self::done(r, "all_gather")
    }

    fn reduce_scatter_sum(
        &self,
        backend: &CudaBackend,
        input: &Tensor<CudaBackend>,
        elems: usize,
        out: &mut Tensor<CudaBackend>,
    ) -> Result<()> {
        let src = Self::check(input, elems * self.size, "reduce_scatter_sum input")?;
        let dst = Self::check(out, elems, "reduce_scatter_sum output")?;
        // SAFETY: both buffers hold what the call reads and writes on this rank's device.
        let r = unsafe {
            nccl::reduce_scatter(
                src,
                dst,
                elems,
                sys::ncclDataType_t::ncclFloat32,
                sys::ncclRedOp_t::ncclSum,
                self.comm,
                Self::stream(backend),
            )
        };
        Self::done(r, "reduce_scatter_sum")
    }

    fn all_to_all(
        &self,
        backend: &CudaBackend,
        send: &Tensor<CudaBackend>,
        elems: usize,
        recv: &mut Tensor<CudaBackend>,
    ) -> Result<()> {
        let src = Self::check(send, elems * self.size, "all_to_all input")? as *const f32;
        let dst = Self::check(recv, elems * self.size, "all_to_all output")? as *mut f32;
        let stream = Self::stream(backend);
        Self::done(nccl::group_start(), "group start")?;
        for peer in 0..self.size {
            // SAFETY: chunk `peer` of each buffer is in bounds (checked above).
            let (s, r) = unsafe {
                let at = peer * elems;
                (
                    nccl::send(
                        src.add(at) as *const c_void,
                        elems,
                        sys::ncclDataType_t::ncclFloat32,
                        peer as i32,
                        self.comm,
                        stream,
                    ),
                    nccl::recv(
                        dst.add(at) as *mut c_void,
                        elems,
                        sys::ncclDataType_t::ncclFloat32,
                        peer as i32,
                        self.comm,
                        stream,
                    ),
                )
            };
            if let Err(e) = Self::done(s, "send").and(Self::done(r, "recv")) {
                let _ = nccl::group_end();
                return Err(e);
            }
        }
        Self::done(nccl::group_end(), "all_to_all")
    }
}

/// [`tandem_engine::Backend::group_comms`] for CUDA ranks: see there.
pub(crate) fn group_comms(
    members: &[CudaBackend],
    comms: Vec<tandem_topology::InProcessCommunicator>,
) -> Vec<Box<dyn TensorComm<CudaBackend>>> {
    use tandem_engine::Backend;
    let one_device = members
        .windows(2)
        .all(|w| w[0].inner.ordinal == w[1].inner.ordinal);
    if one_device {
        return comms
            .into_iter()
            .map(CudaBackend::in_process_comm)
            .collect();
    }
    match CudaBackend::nccl_group(members) {
        Some(nccl) => nccl
            .into_iter()
            .map(|c| Box::new(c) as Box<dyn TensorComm<CudaBackend>>)
            .collect(),
        None => comms
            .into_iter()
            .map(|c| {
                Box::new(tandem_engine::backend::HostStaged(c)) as Box<dyn TensorComm<CudaBackend>>
            })
            .collect(),
    }
}

impl CudaBackend {
    /// NCCL communicators for tensor-parallel ranks on `backends` when every rank has a GPU
    /// of its own and NCCL is installed; `None` (the caller keeps its in-process
    /// communicator) otherwise, saying why in the log for groups of several ranks.
    pub fn nccl_group(backends: &[CudaBackend]) -> Option<Vec<NcclComm>> {
        if backends.len() < 2 {
            return None;
        }
        match NcclComm::group(backends) {
            Ok(g) => Some(g),
            Err(e) => {
                tracing::info!(reason = %e, "tensor-parallel ranks meet through host memory, not NCCL");
                None
            }
        }
    }
}
