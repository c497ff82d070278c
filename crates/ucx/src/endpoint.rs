use std::cell::Cell;
use std::ffi::c_void;
use std::net::SocketAddr;
use std::ptr;
use std::rc::Rc;
use std::time::Duration;

use tandem_ucx_sys as sys;

use crate::error::{check, Error, Result};
use crate::listener::ConnRequest;
use crate::request::{send_callback, start_send, Closing, OpState, SendOp};
use crate::sockaddr::CSockAddr;
use crate::worker::{request_param, Worker, WorkerInner};

/// How long dropping an endpoint waits for its close to complete.
const DROP_CLOSE_TIMEOUT: Duration = Duration::from_secs(1);

/// A connection to one peer, created in peer-failure error mode: if the peer dies, its
/// operations fail instead of hanging and [`Endpoint::failure`] reports why.
///
/// Dropping it closes it (flushing pending sends, or forcibly if it already failed) and
/// waits for the close for at most a second.
pub struct Endpoint {
    handle: sys::ucp_ep_h,
    state: Rc<EpState>,
    /// UCX's reference to `state` (the error callback's argument).
    ucx_ref: *const EpState,
    worker: Rc<WorkerInner>,
    peer: Option<SocketAddr>,
}

/// What the error callback records.
pub(crate) struct EpState {
    failure: Cell<Option<sys::ucs_status_t>>,
}

unsafe extern "C" fn ep_error_callback(
    arg: *mut c_void,
    _ep: sys::ucp_ep_h,
    status: sys::ucs_status_t,
) {
    // SAFETY: `arg` is UCX's reference to the endpoint's EpState, released only after the
    // endpoint is closed; callbacks run on the worker's thread.
    let state = unsafe { &*arg.cast_const().cast::<EpState>() };
    tracing::debug!(status = %crate::status_text(status), "UCX endpoint failed");
    state.failure.set(Some(status));
}

/// How to close an [`Endpoint`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CloseMode {
    /// Flush outstanding operations and tell the peer.
    Flush,
    /// Tear down now; outstanding operations complete with `UCS_ERR_CANCELED`.
    Force,
}

impl Endpoint {
    /// Connects to a listener at `addr` (client side of client-server establishment). The
    /// connection completes in the background; sends issued meanwhile are queued, and if the
    /// peer is unreachable they fail and [`Endpoint::failure`] is set.
    pub fn connect(worker: &Worker, addr: SocketAddr) -> Result<Endpoint> {
        let c_addr = CSockAddr::new(addr);
        Endpoint::create(&worker.inner, Some(addr), |params| {
            params.field_mask |=
                u64::from(sys::UCP_EP_PARAM_FIELD_FLAGS | sys::UCP_EP_PARAM_FIELD_SOCK_ADDR);
            params.flags = sys::UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
            params.sockaddr = c_addr.as_ucs();
        })
    }

    /// Connects to the worker whose [`Worker::address`] is `address` (no listener involved).
    /// UCX reads the address during this call only. As with [`Endpoint::connect`], the
    /// connection completes in the background and failures surface on the operations.
    pub fn connect_to_worker(worker: &Worker, address: &[u8]) -> Result<Endpoint> {
        if address.is_empty() {
            return Err(Error::from_status(
                "ucp_ep_create",
                sys::UCS_ERR_INVALID_PARAM,
            ));
        }
        Endpoint::create(&worker.inner, None, |params| {
            params.field_mask |= u64::from(sys::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS);
            params.address = address.as_ptr().cast();
        })
    }

    /// Accepts a connection request from a [`Listener`](crate::Listener).
    pub fn accept(request: ConnRequest) -> Result<Endpoint> {
        let peer = request.client_addr();
        let worker = Rc::clone(request.listener.worker());
        let handle = request.handle;
        let ep = Endpoint::create(&worker, peer, |params| {
            params.field_mask |= u64::from(sys::UCP_EP_PARAM_FIELD_CONN_REQUEST);
            params.conn_request = handle;
        });
        // UCX owns the request once ucp_ep_create has seen it, even if it failed.
        request.consume();
        ep
    }

    fn create(
        worker: &Rc<WorkerInner>,
        peer: Option<SocketAddr>,
        fill: impl FnOnce(&mut sys::ucp_ep_params_t),
    ) -> Result<Endpoint> {
        let state = Rc::new(EpState {
            failure: Cell::new(None),
        });
        let ucx_ref = Rc::into_raw(Rc::clone(&state));
        // SAFETY: ucp_ep_params_t is plain C data; zero means "no field set".
        let mut params: sys::ucp_ep_params_t = unsafe { std::mem::zeroed() };
        params.field_mask = u64::from(
            sys::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | sys::UCP_EP_PARAM_FIELD_ERR_HANDLER,
        );
        params.err_mode = sys::UCP_ERR_HANDLING_MODE_PEER;
        params.err_handler = sys::ucp_err_handler_t {
            cb: Some(ep_error_callback),
            arg: ucx_ref.cast_mut().cast(),
        };
        fill(&mut params);
        let mut handle = ptr::null_mut();
        // SAFETY: worker alive; `params` and everything it points to (sockaddr, conn
        // request) are valid for the call; `ucx_ref` stays alive until the endpoint closes.
        let status = unsafe { sys::ucp_ep_create(worker.handle, &params, &mut handle) };
        if let Err(err) = check("ucp_ep_create", status) {
            // SAFETY: no endpoint was created, so UCX holds no reference.
            drop(unsafe { Rc::from_raw(ucx_ref) });
            return Err(err);
        }
        Ok(Endpoint {
            handle,
            state,
            ucx_ref,
            worker: Rc::clone(worker),
            peer,
        })
    }

    pub(crate) fn handle(&self) -> sys::ucp_ep_h {
        self.handle
    }

    pub(crate) fn worker_inner(&self) -> Rc<WorkerInner> {
        Rc::clone(&self.worker)
    }

    /// The peer's socket address, when known.
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        self.peer
    }

    /// Whether UCX reported this endpoint as failed (peer gone, unreachable, timed out).
    pub fn is_failed(&self) -> bool {
        self.state.failure.get().is_some()
    }

    /// Why UCX failed this endpoint, if it did.
    pub fn failure(&self) -> Option<Error> {
        self.state
            .failure
            .get()
            .map(|s| Error::from_status("endpoint", s))
    }

    /// Sends `data` with `tag` (`ucp_tag_send_nbx`). The returned operation owns the data
    /// until UCX is done with it.
    pub fn tag_send(&self, tag: u64, data: Vec<u8>) -> Result<SendOp> {
        // SAFETY: endpoint open; UCX gets the operation's own buffer and parameters.
        unsafe {
            start_send("ucp_tag_send_nbx", Some(data), |buf, len, param| {
                sys::ucp_tag_send_nbx(self.handle, buf, len, tag, param)
            })
        }
    }

    /// Starts closing the endpoint; progress the worker until the returned [`Closing`] is
    /// done.
    pub fn close(mut self, mode: CloseMode) -> Closing {
        self.start_close(mode)
    }

    fn start_close(&mut self, mode: CloseMode) -> Closing {
        let handle = std::mem::replace(&mut self.handle, ptr::null_mut());
        let state = OpState::new(None);
        let user_data = OpState::user_data(&state);
        let mut param = request_param(user_data);
        param.op_attr_mask |= sys::UCP_OP_ATTR_FIELD_CALLBACK;
        param.cb.send = Some(send_callback);
        if mode == CloseMode::Force {
            param.op_attr_mask |= sys::UCP_OP_ATTR_FIELD_FLAGS;
            param.flags = sys::UCP_EP_CLOSE_FLAG_FORCE;
        }
        // SAFETY: `handle` is open and closed exactly once (it was swapped out above).
        let ret = unsafe { sys::ucp_ep_close_nbx(handle, &param) };
        // SAFETY: `user_data` and `ret` belong to this call.
        let started = unsafe { OpState::started(&state, "ucp_ep_close_nbx", user_data, ret) };
        let ep_state = match started {
            Ok(()) => self.ucx_ref,
            Err(err) => {
                // Unclear whether UCX still holds the endpoint: keep its callback state
                // alive forever rather than risk a dangling callback argument.
                tracing::debug!(%err, "closing an endpoint failed");
                ptr::null()
            }
        };
        Closing {
            state,
            worker: Rc::clone(&self.worker),
            ep_state,
        }
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        if self.handle.is_null() {
            return;
        }
        let mode = if self.is_failed() {
            CloseMode::Force
        } else {
            CloseMode::Flush
        };
        let closing = self.start_close(mode);
        if !closing.wait(DROP_CLOSE_TIMEOUT) {
            tracing::warn!(peer = ?self.peer, "UCX endpoint close did not complete in time");
        }
    }
}
