use std::cell::Cell;
use std::ffi::c_void;
use std::net::SocketAddr;
use std::ptr;
use std::rc::Rc;

use tandem_ucx_sys as sys;

use crate::error::{check, Result};
use crate::sockaddr::{from_storage, CSockAddr};
use crate::worker::{Worker, WorkerInner};

/// Accepts client-server connections on a socket address (UCX's sockaddr connection
/// manager). Incoming requests are queued during progress and taken with
/// [`Listener::next_conn_request`].
pub struct Listener {
    inner: Rc<ListenerInner>,
}

pub(crate) struct ListenerInner {
    handle: sys::ucp_listener_h,
    /// UCX's reference is the raw pointer given as the callback argument; reclaimed in Drop.
    queue: *const ConnQueue,
    worker: Rc<WorkerInner>,
}

#[derive(Default)]
struct ConnQueue {
    requests: Cell<Vec<sys::ucp_conn_request_h>>,
}

unsafe extern "C" fn conn_callback(conn_request: sys::ucp_conn_request_h, arg: *mut c_void) {
    // SAFETY: `arg` is the ConnQueue the listener keeps alive until after
    // ucp_listener_destroy, and callbacks run on the worker's thread only.
    let queue = unsafe { &*arg.cast_const().cast::<ConnQueue>() };
    let mut pending = queue.requests.take();
    pending.push(conn_request);
    queue.requests.set(pending);
}

/// A client asking to connect. Accept it with
/// [`Endpoint::accept`](crate::Endpoint::accept); dropping it rejects the client.
pub struct ConnRequest {
    pub(crate) handle: sys::ucp_conn_request_h,
    pub(crate) listener: Rc<ListenerInner>,
}

impl Listener {
    /// Listens on `addr` (port 0 picks a free port; see [`Listener::local_addr`]).
    pub fn bind(worker: &Worker, addr: SocketAddr) -> Result<Listener> {
        let c_addr = CSockAddr::new(addr);
        let queue = Rc::into_raw(Rc::new(ConnQueue::default()));
        let params = sys::ucp_listener_params_t {
            field_mask: u64::from(
                sys::UCP_LISTENER_PARAM_FIELD_SOCK_ADDR
                    | sys::UCP_LISTENER_PARAM_FIELD_CONN_HANDLER,
            ),
            sockaddr: c_addr.as_ucs(),
            accept_handler: Default::default(),
            conn_handler: sys::ucp_listener_conn_handler_t {
                cb: Some(conn_callback),
                arg: queue.cast_mut().cast(),
            },
        };
        let mut handle = ptr::null_mut();
        // SAFETY: worker alive; `params` and the sockaddr it points to outlive the call (UCX
        // copies the address); `queue` stays alive until after ucp_listener_destroy.
        let status = unsafe { sys::ucp_listener_create(worker.inner.handle, &params, &mut handle) };
        if let Err(err) = check("ucp_listener_create", status) {
            // SAFETY: the listener was not created, so UCX holds no reference to `queue`.
            drop(unsafe { Rc::from_raw(queue) });
            return Err(err);
        }
        Ok(Listener {
            inner: Rc::new(ListenerInner {
                handle,
                queue,
                worker: Rc::clone(&worker.inner),
            }),
        })
    }

    /// The address actually bound (with the real port when 0 was asked for).
    pub fn local_addr(&self) -> Result<SocketAddr> {
        let mut attr = sys::ucp_listener_attr_t {
            field_mask: u64::from(sys::UCP_LISTENER_ATTR_FIELD_SOCKADDR),
            ..Default::default()
        };
        // SAFETY: listener alive; `attr` is a valid, initialised out-parameter.
        let status = unsafe { sys::ucp_listener_query(self.inner.handle, &mut attr) };
        check("ucp_listener_query", status)?;
        from_storage(&attr.sockaddr)
    }

    /// The next queued connection request, if any arrived during progress.
    pub fn next_conn_request(&self) -> Option<ConnRequest> {
        // SAFETY: `queue` is alive for as long as the listener.
        let queue = unsafe { &*self.inner.queue };
        let mut pending = queue.requests.take();
        let next = if pending.is_empty() {
            None
        } else {
            Some(pending.remove(0))
        };
        queue.requests.set(pending);
        next.map(|handle| ConnRequest {
            handle,
            listener: Rc::clone(&self.inner),
        })
    }
}

impl ListenerInner {
    pub(crate) fn worker(&self) -> &Rc<WorkerInner> {
        &self.worker
    }
}

impl ConnRequest {
    /// The connecting client's address, when UCX can tell.
    pub fn client_addr(&self) -> Option<SocketAddr> {
        let mut attr = sys::ucp_conn_request_attr_t {
            field_mask: u64::from(sys::UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR),
            ..Default::default()
        };
        // SAFETY: the request is still owned by us (not accepted or rejected yet).
        let status = unsafe { sys::ucp_conn_request_query(self.handle, &mut attr) };
        if status != sys::UCS_OK {
            return None;
        }
        from_storage(&attr.client_address).ok()
    }

    /// Marks the request as handed to UCX (by `ucp_ep_create`), so Drop does not reject it.
    pub(crate) fn consume(mut self) {
        self.handle = ptr::null_mut();
    }
}

impl Drop for ConnRequest {
    fn drop(&mut self) {
        if self.handle.is_null() {
            return;
        }
        // SAFETY: an unaccepted request we own; the listener is alive (we hold an Rc).
        let status = unsafe { sys::ucp_listener_reject(self.listener.handle, self.handle) };
        if status != sys::UCS_OK {
            tracing::debug!(%status, "ucp_listener_reject failed");
        }
    }
}

impl Drop for ListenerInner {
    fn drop(&mut self) {
        // Reject whoever is still queued so clients fail fast instead of waiting.
        // SAFETY: `queue` is alive until reclaimed below.
        let pending = unsafe { &*self.queue }.requests.take();
        for req in pending {
            // SAFETY: queued requests are unaccepted and owned by this listener.
            unsafe { sys::ucp_listener_reject(self.handle, req) };
        }
        // SAFETY: created by ucp_listener_create, destroyed exactly once; after this UCX
        // calls no more connection callbacks.
        unsafe { sys::ucp_listener_destroy(self.handle) };
        // SAFETY: UCX no longer holds the pointer; this is the reference made in bind().
        drop(unsafe { Rc::from_raw(self.queue) });
    }
}
