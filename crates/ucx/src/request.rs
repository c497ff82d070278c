//! Non-blocking operations. Each one owns an `Rc<OpState>`; when UCX returns a request handle,
//! one extra strong reference is handed to UCX as the callback's `user_data` and taken back in
//! the callback. The data buffer lives inside the state, so it stays valid for as long as UCX
//! may touch it, whoever lets go first.

use std::cell::Cell;
use std::ffi::c_void;
use std::ptr;
use std::rc::Rc;
use std::time::{Duration, Instant};

use tandem_ucx_sys as sys;

use crate::endpoint::EpState;
use crate::error::{Error, Result};
use crate::worker::WorkerInner;

/// A heap buffer in raw parts, so UCX can write into it while shared references to the
/// surrounding state exist.
pub(crate) struct RawBuf {
    ptr: *mut u8,
    len: usize,
    cap: usize,
}

impl RawBuf {
    /// Takes ownership of an initialised buffer (for sends).
    pub(crate) fn from_vec(v: Vec<u8>) -> RawBuf {
        let mut v = std::mem::ManuallyDrop::new(v);
        RawBuf {
            ptr: v.as_mut_ptr(),
            len: v.len(),
            cap: v.capacity(),
        }
    }

    /// Allocates `n` uninitialised bytes (for receives); [`RawBuf::into_vec`] reports them
    /// initialised only after [`RawBuf::set_filled`].
    pub(crate) fn uninit(n: usize) -> RawBuf {
        let mut v = std::mem::ManuallyDrop::new(Vec::<u8>::with_capacity(n));
        RawBuf {
            ptr: v.as_mut_ptr(),
            len: 0,
            cap: v.capacity(),
        }
    }

    pub(crate) fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// # Safety
    /// The first `n <= cap` bytes must have been written.
    pub(crate) unsafe fn set_filled(&mut self, n: usize) {
        debug_assert!(n <= self.cap);
        self.len = n;
    }

    pub(crate) fn into_vec(self) -> Vec<u8> {
        let this = std::mem::ManuallyDrop::new(self);
        // SAFETY: the parts came from a Vec<u8> that was never freed, and `len` only counts
        // initialised bytes.
        unsafe { Vec::from_raw_parts(this.ptr, this.len, this.cap) }
    }
}

impl Drop for RawBuf {
    fn drop(&mut self) {
        // SAFETY: as in into_vec; length 0 because u8 needs no drop and the bytes may be
        // uninitialised.
        drop(unsafe { Vec::from_raw_parts(self.ptr, 0, self.cap) });
    }
}

/// Shared between an operation handle and UCX's completion callback.
pub(crate) struct OpState {
    /// `None` while in flight, then the final status.
    status: Cell<Option<sys::ucs_status_t>>,
    /// The UCX request while in flight (for cancel / free); null once completed.
    request: Cell<*mut c_void>,
    /// The data buffer, if the operation has one.
    buffer: Cell<Option<RawBuf>>,
}

impl OpState {
    pub(crate) fn new(buffer: Option<RawBuf>) -> Rc<OpState> {
        Rc::new(OpState {
            status: Cell::new(None),
            request: Cell::new(ptr::null_mut()),
            buffer: Cell::new(buffer),
        })
    }

    pub(crate) fn status(&self) -> Option<sys::ucs_status_t> {
        self.status.get()
    }

    fn complete(&self, status: sys::ucs_status_t) {
        self.status.set(Some(status));
        self.request.set(ptr::null_mut());
    }

    /// The buffer's address (null when there is none); the buffer itself stays in place.
    pub(crate) fn buffer_ptr(&self) -> *mut u8 {
        let buf = self.buffer.take();
        let p = buf.as_ref().map_or(ptr::null_mut(), RawBuf::ptr);
        self.buffer.set(buf);
        p
    }

    fn take_buffer(&self) -> Option<RawBuf> {
        self.buffer.take()
    }

    /// Hands a strong reference to UCX as `user_data`.
    pub(crate) fn user_data(this: &Rc<OpState>) -> *mut c_void {
        Rc::into_raw(Rc::clone(this)).cast_mut().cast()
    }

    /// Resolves what a `*_nbx` call returned. On immediate completion or error the callback
    /// will not run, so UCX's reference is taken back here.
    ///
    /// # Safety
    /// `user_data` must be the value [`OpState::user_data`] produced for this call, and
    /// `ret` what the call returned.
    pub(crate) unsafe fn started(
        this: &Rc<OpState>,
        op: &'static str,
        user_data: *mut c_void,
        ret: sys::ucs_status_ptr_t,
    ) -> Result<()> {
        if sys::ucs_ptr_is_ptr(ret) {
            this.request.set(ret);
            return Ok(());
        }
        // SAFETY: the callback will not run for a non-request return; this is the reference
        // created for it.
        drop(unsafe { Rc::from_raw(user_data.cast_const().cast::<OpState>()) });
        let status = sys::ucs_ptr_status(ret);
        this.complete(status);
        if status == sys::UCS_OK {
            Ok(())
        } else {
            Err(Error::from_status(op, status))
        }
    }

    /// Stops waiting for the callback: frees the request (no callback runs afterwards) and
    /// leaks UCX's reference on purpose, since it can no longer be taken back safely.
    fn abandon(&self) {
        let req = self.request.replace(ptr::null_mut());
        if !req.is_null() {
            // SAFETY: `req` is an in-flight request returned by UCX and not yet freed (the
            // callback nulls the field before freeing). After this no callback runs, so
            // UCX's `user_data` reference is never reclaimed: a bounded, deliberate leak.
            unsafe { sys::ucp_request_free(req) };
        }
    }
}

/// Completion of send and close requests: take UCX's reference back, record, free.
pub(crate) unsafe extern "C" fn send_callback(
    request: *mut c_void,
    status: sys::ucs_status_t,
    user_data: *mut c_void,
) {
    // SAFETY: `user_data` is the reference made by OpState::user_data for this request and
    // the callback runs once.
    let state = unsafe { Rc::from_raw(user_data.cast_const().cast::<OpState>()) };
    state.complete(status);
    // SAFETY: the request is complete and released exactly once, here.
    unsafe { sys::ucp_request_free(request) };
}

/// Completion of tag receives.
pub(crate) unsafe extern "C" fn recv_callback(
    request: *mut c_void,
    status: sys::ucs_status_t,
    _info: *const sys::ucp_tag_recv_info_t,
    user_data: *mut c_void,
) {
    // SAFETY: see send_callback.
    unsafe { send_callback(request, status, user_data) }
}

/// Starts an operation that completes through the send callback (a send, a put, a flush)
/// over `data` (owned by the operation until UCX is done with it). `call` issues it with the
/// buffer's address and length and the request parameters.
///
/// # Safety
/// `call` must pass UCX the parameters it is given and only the buffer it is given, for the
/// length it is given, on a live endpoint.
pub(crate) unsafe fn start_send(
    op: &'static str,
    data: Option<Vec<u8>>,
    call: impl FnOnce(*const c_void, usize, &sys::ucp_request_param_t) -> sys::ucs_status_ptr_t,
) -> Result<SendOp> {
    let len = data.as_ref().map_or(0, Vec::len);
    let state = OpState::new(data.map(RawBuf::from_vec));
    let user_data = OpState::user_data(&state);
    let mut param = crate::worker::request_param(user_data);
    param.op_attr_mask |= sys::UCP_OP_ATTR_FIELD_CALLBACK;
    param.cb.send = Some(send_callback);
    // The buffer lives in `state`, which UCX's `user_data` reference keeps alive until the
    // callback.
    let ret = call(state.buffer_ptr().cast_const().cast(), len, &param);
    // SAFETY: `user_data` and `ret` belong to this call.
    unsafe { OpState::started(&state, op, user_data, ret) }?;
    Ok(SendOp { state, len })
}

/// A tagged send in flight. Dropping it does not cancel the send; the payload stays alive
/// until UCX is done with it.
pub struct SendOp {
    pub(crate) state: Rc<OpState>,
    pub(crate) len: usize,
}

impl SendOp {
    /// `None` while in flight; then `Ok(())` or the error UCX completed it with.
    pub fn result(&self) -> Option<Result<()>> {
        self.state
            .status()
            .map(|s| status_result("ucp_tag_send_nbx", s))
    }

    /// Payload size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the payload is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// A tagged receive in flight (started by [`Worker::tag_probe_recv`](crate::Worker::tag_probe_recv)).
pub struct RecvOp {
    pub(crate) state: Rc<OpState>,
    pub(crate) worker: Rc<WorkerInner>,
    pub(crate) tag: u64,
    pub(crate) len: usize,
}

impl RecvOp {
    /// The sender's tag.
    pub fn tag(&self) -> u64 {
        self.tag
    }

    /// Message size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the message is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// `None` while in flight; then the data or the error UCX completed it with.
    pub fn result(&self) -> Option<Result<()>> {
        self.state
            .status()
            .map(|s| status_result("ucp_tag_msg_recv_nbx", s))
    }

    /// The received bytes, once the receive completed successfully; otherwise `Err(self)`.
    pub fn into_data(self) -> std::result::Result<Vec<u8>, RecvOp> {
        if self.state.status() != Some(sys::UCS_OK) {
            return Err(self);
        }
        match self.state.take_buffer() {
            Some(mut buf) => {
                // SAFETY: the receive completed with UCS_OK into a buffer of exactly the
                // probed message length, so all `len` bytes were written.
                unsafe { buf.set_filled(self.len) };
                Ok(buf.into_vec())
            }
            None => Err(self),
        }
    }

    /// Asks UCX to cancel the receive; it then completes with `UCS_ERR_CANCELED`.
    pub fn cancel(&self) {
        let req = self.state.request.get();
        if !req.is_null() {
            // SAFETY: `req` is in flight on this worker (the callback nulls it on completion).
            unsafe { sys::ucp_request_cancel(self.worker.handle, req) };
        }
    }
}

/// An endpoint close in flight ([`Endpoint::close`](crate::Endpoint::close)).
///
/// Dropping it before it completes stops tracking it: UCX finishes the close internally and
/// the endpoint's small callback state is leaked rather than risk a use-after-free.
pub struct Closing {
    pub(crate) state: Rc<OpState>,
    pub(crate) worker: Rc<WorkerInner>,
    /// UCX's reference to the endpoint's error-callback state, released once closed.
    pub(crate) ep_state: *const EpState,
}

impl Closing {
    /// Whether the close has completed (successfully or not).
    pub fn is_done(&self) -> bool {
        self.state.status().is_some()
    }

    /// The close's outcome, once done.
    pub fn result(&self) -> Option<Result<()>> {
        self.state
            .status()
            .map(|s| status_result("ucp_ep_close_nbx", s))
    }

    /// Progresses the worker until the close completes or `timeout` passes; returns whether
    /// it completed.
    pub fn wait(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        WorkerInner::progress_until(&self.worker, deadline, || self.is_done())
    }
}

impl Drop for Closing {
    fn drop(&mut self) {
        if self.is_done() {
            if !self.ep_state.is_null() {
                // SAFETY: the endpoint is closed, so UCX will never call its error handler
                // again; this is the reference handed to UCX at creation.
                drop(unsafe { Rc::from_raw(self.ep_state) });
            }
        } else {
            tracing::debug!("abandoning an endpoint close that has not completed");
            self.state.abandon();
        }
    }
}

pub(crate) fn status_result(op: &'static str, status: sys::ucs_status_t) -> Result<()> {
    if status == sys::UCS_OK {
        Ok(())
    } else {
        Err(Error::from_status(op, status))
    }
}
