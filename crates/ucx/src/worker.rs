use std::ffi::c_void;
use std::ptr;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use tandem_ucx_sys as sys;

use crate::context::Context;
use crate::error::{check, poll_millis, Error, Result};
use crate::request::{recv_callback, OpState, RawBuf, RecvOp};

/// A UCP worker in single-thread mode: the progress engine for its endpoints, listeners and
/// requests. Not `Send`: it lives and dies on the thread that created it.
pub struct Worker {
    pub(crate) inner: Rc<WorkerInner>,
}

pub(crate) struct WorkerInner {
    pub(crate) handle: sys::ucp_worker_h,
    efd: i32,
    waker: Arc<WakerSlot>,
    _context: Context,
}

/// Shared with every [`Waker`]: the worker handle while the worker is alive, so a late
/// `wake()` never touches a destroyed worker.
struct WakerSlot {
    worker: Mutex<Option<WorkerPtr>>,
    /// Set by `wake()` before signalling; lets [`Worker::wait`] skip sleeping when a wake-up
    /// raced with arming the event fd.
    pending: AtomicBool,
}

struct WorkerPtr(sys::ucp_worker_h);

// SAFETY: the pointer is only used for ucp_worker_signal, which UCX documents as safe to call
// from any thread whatever the worker's thread mode, and the slot's mutex keeps it from being
// used after the worker is destroyed.
unsafe impl Send for WorkerPtr {}

/// Wakes a [`Worker`] blocked in [`Worker::wait`] from any thread. Harmless after the worker
/// is gone.
#[derive(Clone)]
pub struct Waker {
    slot: Arc<WakerSlot>,
}

impl Waker {
    /// Makes the worker's current or next [`Worker::wait`] return promptly.
    pub fn wake(&self) {
        self.slot.pending.store(true, Ordering::SeqCst);
        let guard = self
            .slot
            .worker
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(worker) = guard.as_ref() {
            // SAFETY: the worker is alive while it sits in the slot (Drop empties the slot
            // under this mutex before destroying it); ucp_worker_signal is thread-safe.
            let status = unsafe { sys::ucp_worker_signal(worker.0) };
            if status != sys::UCS_OK {
                tracing::warn!(%status, "ucp_worker_signal failed");
            }
        }
    }
}

impl Worker {
    /// Creates a single-threaded worker on `context`.
    pub fn new(context: &Context) -> Result<Worker> {
        let params = sys::ucp_worker_params_t {
            field_mask: u64::from(sys::UCP_WORKER_PARAM_FIELD_THREAD_MODE),
            thread_mode: sys::UCS_THREAD_MODE_SINGLE,
            ..Default::default()
        };
        let mut handle = ptr::null_mut();
        // SAFETY: the context is alive (we keep a clone); params are initialised with only
        // thread_mode marked valid; `handle` is a valid out-pointer.
        let status = unsafe { sys::ucp_worker_create(context.handle(), &params, &mut handle) };
        check("ucp_worker_create", status)?;
        let mut efd = -1;
        // SAFETY: `handle` was just created; the context has UCP_FEATURE_WAKEUP.
        let status = unsafe { sys::ucp_worker_get_efd(handle, &mut efd) };
        if let Err(err) = check("ucp_worker_get_efd", status) {
            // SAFETY: created above and not shared yet.
            unsafe { sys::ucp_worker_destroy(handle) };
            return Err(err);
        }
        Ok(Worker {
            inner: Rc::new(WorkerInner {
                handle,
                efd,
                waker: Arc::new(WakerSlot {
                    worker: Mutex::new(Some(WorkerPtr(handle))),
                    pending: AtomicBool::new(false),
                }),
                _context: context.clone(),
            }),
        })
    }

    /// Runs one round of progress; returns how many events were processed. Completion
    /// callbacks run inside this call.
    pub fn progress(&self) -> u32 {
        self.inner.progress()
    }

    /// Progresses until there is nothing left to do right now.
    pub fn progress_all(&self) {
        while self.inner.progress() > 0 {}
    }

    /// A handle that can wake this worker from another thread.
    /// This worker's address (`ucp_worker_get_address`): every transport it can be reached
    /// on, shared memory included. A peer that has it connects with
    /// [`Endpoint::connect_to_worker`](crate::Endpoint::connect_to_worker), and UCX picks the
    /// best transport the two share (shared memory on one host, where the sockaddr connection
    /// manager only offers TCP).
    pub fn address(&self) -> Result<Vec<u8>> {
        let mut address = ptr::null_mut();
        let mut len = 0usize;
        // SAFETY: the worker is alive; both out-pointers are valid.
        let status =
            unsafe { sys::ucp_worker_get_address(self.inner.handle, &mut address, &mut len) };
        check("ucp_worker_get_address", status)?;
        // SAFETY: UCX returned `len` readable bytes at `address`, ours until released below.
        let bytes = unsafe { std::slice::from_raw_parts(address.cast::<u8>(), len) }.to_vec();
        // SAFETY: `address` came from ucp_worker_get_address on this worker, released once.
        unsafe { sys::ucp_worker_release_address(self.inner.handle, address) };
        Ok(bytes)
    }

    pub fn waker(&self) -> Waker {
        Waker {
            slot: Arc::clone(&self.inner.waker),
        }
    }

    /// Sleeps until UCX has events, a [`Waker`] fires, or `timeout` passes. Call it only
    /// after progressing until idle; returns at once if events are already pending.
    pub fn wait(&self, timeout: Duration) -> Result<()> {
        self.inner.wait(timeout)
    }

    /// Progresses (sleeping between rounds) until `done()` or `deadline`; returns `done()`.
    pub fn progress_until(&self, deadline: Instant, done: impl FnMut() -> bool) -> bool {
        WorkerInner::progress_until(&self.inner, deadline, done)
    }

    /// Takes the next unexpected message matching `tag`/`tag_mask` out of UCX's queue
    /// (`ucp_tag_probe_nb` with remove) and starts receiving it into a buffer of its exact
    /// size (`ucp_tag_msg_recv_nbx`). `Ok(None)` when no message is waiting.
    pub fn tag_probe_recv(&self, tag: u64, tag_mask: u64) -> Result<Option<RecvOp>> {
        let mut info = sys::ucp_tag_recv_info_t::default();
        // SAFETY: worker alive; `info` is a valid out-pointer; remove=1 hands the message to
        // us, and it is always received below.
        let msg = unsafe { sys::ucp_tag_probe_nb(self.inner.handle, tag, tag_mask, 1, &mut info) };
        if msg.is_null() {
            return Ok(None);
        }
        let len = info.length;
        let state = OpState::new(Some(RawBuf::uninit(len)));
        let user_data = OpState::user_data(&state);
        let mut param = request_param(user_data);
        param.op_attr_mask |= sys::UCP_OP_ATTR_FIELD_CALLBACK;
        param.cb.recv = Some(recv_callback);
        // SAFETY: the buffer holds `len` bytes and lives in `state`, which UCX keeps alive via
        // `user_data` until the callback; `msg` came from the probe above.
        let ret = unsafe {
            sys::ucp_tag_msg_recv_nbx(
                self.inner.handle,
                state.buffer_ptr().cast(),
                len,
                msg,
                &param,
            )
        };
        // SAFETY: `user_data` and `ret` belong to this call.
        unsafe { OpState::started(&state, "ucp_tag_msg_recv_nbx", user_data, ret) }?;
        Ok(Some(RecvOp {
            state,
            worker: Rc::clone(&self.inner),
            tag: info.sender_tag,
            len,
        }))
    }
}

/// Request parameters with `user_data` set (callers add the callback).
pub(crate) fn request_param(user_data: *mut c_void) -> sys::ucp_request_param_t {
    // SAFETY: ucp_request_param_t is plain C data; all-zero is its documented "nothing set"
    // state (op_attr_mask says which fields are valid).
    let mut param: sys::ucp_request_param_t = unsafe { std::mem::zeroed() };
    param.op_attr_mask = sys::UCP_OP_ATTR_FIELD_USER_DATA;
    param.user_data = user_data;
    param
}

impl WorkerInner {
    pub(crate) fn progress(&self) -> u32 {
        // SAFETY: the worker is alive and used from its own thread only (WorkerInner is !Send).
        unsafe { sys::ucp_worker_progress(self.handle) }
    }

    pub(crate) fn wait(&self, timeout: Duration) -> Result<()> {
        // SAFETY: as in progress().
        let status = unsafe { sys::ucp_worker_arm(self.handle) };
        if status == sys::UCS_ERR_BUSY {
            return Ok(());
        }
        check("ucp_worker_arm", status)?;
        if self.waker.pending.swap(false, Ordering::SeqCst) {
            return Ok(());
        }
        let mut pfd = libc::pollfd {
            fd: self.efd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd; the fd belongs to the live worker.
        let rc = unsafe { libc::poll(&mut pfd, 1, poll_millis(timeout)) };
        if rc < 0 {
            let err = std::io::Error::last_os_error();
            if err.kind() != std::io::ErrorKind::Interrupted {
                return Err(Error::Wait(err));
            }
        }
        Ok(())
    }

    pub(crate) fn progress_until(
        this: &Rc<WorkerInner>,
        deadline: Instant,
        mut done: impl FnMut() -> bool,
    ) -> bool {
        loop {
            while this.progress() > 0 {}
            if done() {
                return true;
            }
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            if let Err(err) = this.wait(deadline - now) {
                tracing::warn!(%err, "waiting on the UCX worker failed; polling instead");
                std::thread::yield_now();
            }
        }
    }
}

impl Drop for WorkerInner {
    fn drop(&mut self) {
        self.waker
            .worker
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        // SAFETY: no Waker can reach the handle any more; endpoints, listeners and receives
        // hold an Rc to this worker, so none is left. Sends still in flight are completed
        // (cancelled) by UCX here; their callbacks only touch heap state. Destroyed once.
        unsafe { sys::ucp_worker_destroy(self.handle) };
    }
}
