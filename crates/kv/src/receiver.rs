use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc as std_mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tandem_ucx::{
    CloseMode, Closing, Context, Endpoint, Listener, MemoryRegion, RecvOp, Waker, Worker,
};
use tokio::sync::mpsc;

use crate::error::{Error, Result};
use crate::landing::{LandingArena, RemoteArena};
use crate::message::KvMessage;
use crate::peer_address::resolve;
use crate::transport_config::ucx_config;

/// Longest the thread sleeps without checking for shutdown (a safety net; wake-ups are
/// normally event-driven).
const IDLE_WAIT: Duration = Duration::from_millis(100);
/// How long shutdown waits for endpoints to close gracefully.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(1);

/// Receiving side (decode worker). Owns a background thread that runs a UCX worker +
/// listener and accepts any number of senders. Dropping it stops the thread, which blocks
/// briefly (at most a couple of seconds) while messages already arriving are finished and
/// senders are disconnected; the incoming channel then ends.
pub struct UcxReceiver {
    address: String,
    incoming: Option<mpsc::UnboundedReceiver<KvMessage>>,
    bytes_received: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    waker: Waker,
    thread: Option<JoinHandle<()>>,
}

impl UcxReceiver {
    /// Binds on `bind` ("127.0.0.1:0" picks a free port). Returns once listening.
    pub fn listen(bind: &str) -> Result<UcxReceiver> {
        Self::listen_with_arena(bind, None)
    }

    /// [`UcxReceiver::listen`], registering `arena` with this transport for one-sided writes
    /// from senders that cannot map it (its descriptors then carry the remote key). A failed
    /// registration is logged and leaves the arena to local writers.
    pub fn listen_with_arena(bind: &str, arena: Option<Arc<LandingArena>>) -> Result<UcxReceiver> {
        let bind_addr = resolve(bind)?;
        let (incoming_tx, incoming_rx) = mpsc::unbounded_channel();
        let bytes_received = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (ready_tx, ready_rx) = std_mpsc::sync_channel(1);

        let thread_bytes = Arc::clone(&bytes_received);
        let thread_stop = Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name("kv-ucx-recv".into())
            .spawn(move || {
                type Setup = (Worker, Listener, SocketAddr, Option<MemoryRegion>);
                let setup = || -> tandem_ucx::Result<Setup> {
                    let context = Context::new(&ucx_config()?)?;
                    let worker = Worker::new(&context)?;
                    let listener = Listener::bind(&worker, bind_addr)?;
                    let addr = listener.local_addr()?;
                    let region = arena.as_ref().and_then(|a| register(&context, a));
                    Ok((worker, listener, addr, region))
                };
                let (worker, listener, region) = match setup() {
                    Ok((worker, listener, addr, region)) => {
                        if ready_tx.send(Ok((addr, worker.waker()))).is_err() {
                            return;
                        }
                        (worker, listener, region)
                    }
                    Err(err) => {
                        // If the caller is gone there is no one left to tell.
                        let _ = ready_tx.send(Err(err));
                        return;
                    }
                };
                ReceiverLoop {
                    _region: region,
                    _arena: arena,
                    worker,
                    listener: Some(listener),
                    endpoints: Vec::new(),
                    receiving: Vec::new(),
                    closing: Vec::new(),
                    incoming: incoming_tx,
                    bytes_received: thread_bytes,
                    stop: thread_stop,
                }
                .run();
            })
            .map_err(Error::Spawn)?;

        let ((addr, waker), thread) = crate::error::await_setup(ready_rx, thread)?;
        tracing::info!(%addr, "KV receiver listening");
        Ok(UcxReceiver {
            address: addr.to_string(),
            incoming: Some(incoming_rx),
            bytes_received,
            stop,
            waker,
            thread: Some(thread),
        })
    }

    /// The "host:port" peers connect to.
    pub fn address(&self) -> String {
        self.address.clone()
    }

    /// Every complete message received, in the order receives completed. Call once (takes
    /// the receiver).
    pub fn take_incoming(&mut self) -> Option<mpsc::UnboundedReceiver<KvMessage>> {
        self.incoming.take()
    }

    /// Total payload bytes received so far.
    pub fn bytes_received(&self) -> u64 {
        self.bytes_received.load(Ordering::Relaxed)
    }
}

impl Drop for UcxReceiver {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        self.waker.wake();
        if let Some(thread) = self.thread.take() {
            if thread.join().is_err() {
                tracing::error!("KV receiver thread panicked");
            }
        }
    }
}

/// Registers `arena`'s memory with `context` and records the remote key in it.
#[allow(unsafe_code)]
fn register(context: &Context, arena: &Arc<LandingArena>) -> Option<MemoryRegion> {
    let (ptr, len) = arena.region();
    // SAFETY: the receiver loop holds the arena (an `Arc`) for as long as the region, and
    // drops the region first; the arena's mapping lives as long as the arena.
    let region = match unsafe { MemoryRegion::map(context, ptr, len) } {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!(error = %e, "KV landing arena not registered for remote writes");
            return None;
        }
    };
    match region.packed_key() {
        Ok(rkey) => {
            arena.set_remote(RemoteArena {
                rkey,
                base: region.address(),
            });
            tracing::info!(
                bytes = len,
                "KV landing arena registered for one-sided writes"
            );
            Some(region)
        }
        Err(e) => {
            tracing::warn!(error = %e, "KV landing arena's remote key not packed");
            None
        }
    }
}

/// The receiver thread's state; everything UCX lives here, on one thread.
struct ReceiverLoop {
    /// The landing arena's registration (dropped before the arena it covers).
    _region: Option<MemoryRegion>,
    _arena: Option<Arc<LandingArena>>,
    worker: Worker,
    /// `None` once shutting down.
    listener: Option<Listener>,
    endpoints: Vec<Endpoint>,
    receiving: Vec<RecvOp>,
    closing: Vec<Closing>,
    incoming: mpsc::UnboundedSender<KvMessage>,
    bytes_received: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
}

impl ReceiverLoop {
    fn run(mut self) {
        while !self.stop.load(Ordering::SeqCst) {
            self.worker.progress_all();
            let busy = self.accept() | self.start_receives();
            self.deliver();
            self.drop_failed_endpoints();
            if busy {
                continue;
            }
            if let Err(err) = self.worker.wait(IDLE_WAIT) {
                tracing::warn!(%err, "KV receiver: waiting for UCX events failed");
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        self.shutdown();
    }

    /// Accepts queued connection requests; returns whether there were any.
    fn accept(&mut self) -> bool {
        let mut any = false;
        let Some(listener) = &self.listener else {
            return false;
        };
        while let Some(request) = listener.next_conn_request() {
            any = true;
            let client = request.client_addr();
            match Endpoint::accept(request) {
                Ok(ep) => {
                    tracing::debug!(?client, "KV receiver accepted a sender");
                    self.endpoints.push(ep);
                }
                Err(err) => tracing::warn!(?client, %err, "KV receiver could not accept"),
            }
        }
        any
    }

    /// Starts receiving every message UCX has matched; returns whether there were any.
    fn start_receives(&mut self) -> bool {
        let mut any = false;
        loop {
            match self.worker.tag_probe_recv(0, 0) {
                Ok(Some(op)) => {
                    any = true;
                    self.receiving.push(op);
                }
                Ok(None) => return any,
                Err(err) => {
                    tracing::warn!(%err, "KV receiver: starting a receive failed");
                    return any;
                }
            }
        }
    }

    /// Hands completed messages to the consumer, in completion order.
    fn deliver(&mut self) {
        let mut i = 0;
        while i < self.receiving.len() {
            let Some(result) = self.receiving[i].result() else {
                i += 1;
                continue;
            };
            let op = self.receiving.remove(i);
            let tag = op.tag();
            if let Err(err) = result {
                tracing::warn!(tag, len = op.len(), %err, "KV receive failed");
                continue;
            }
            match op.into_data() {
                Ok(payload) => {
                    self.bytes_received
                        .fetch_add(payload.len() as u64, Ordering::Relaxed);
                    // A consumer that dropped its end no longer wants messages.
                    let _ = self.incoming.send(KvMessage { tag, payload });
                }
                Err(op) => tracing::warn!(tag = op.tag(), "KV receive completed without data"),
            }
        }
    }

    fn drop_failed_endpoints(&mut self) {
        let mut i = 0;
        while i < self.endpoints.len() {
            if self.endpoints[i].is_failed() {
                let ep = self.endpoints.swap_remove(i);
                tracing::debug!(peer = ?ep.peer_addr(), reason = ?ep.failure(), "KV sender disconnected");
                self.closing.push(ep.close(CloseMode::Force));
            } else {
                i += 1;
            }
        }
        self.closing.retain(|c| !c.is_done());
    }

    fn shutdown(mut self) {
        // Stop accepting (queued clients are rejected), finish what has already arrived,
        // then close the senders' endpoints. Each step is bounded.
        self.listener = None;
        let deadline = Instant::now() + SHUTDOWN_GRACE;
        loop {
            self.worker.progress_all();
            self.start_receives();
            self.deliver();
            let now = Instant::now();
            if self.receiving.is_empty() || now >= deadline {
                break;
            }
            if self.worker.wait((deadline - now).min(IDLE_WAIT)).is_err() {
                break;
            }
        }
        for op in &self.receiving {
            op.cancel();
        }
        for ep in self.endpoints.drain(..) {
            let mode = if ep.is_failed() {
                CloseMode::Force
            } else {
                CloseMode::Flush
            };
            self.closing.push(ep.close(mode));
        }
        let deadline = Instant::now() + SHUTDOWN_GRACE;
        let (closing, receiving) = (&self.closing, &self.receiving);
        let all_closed = self.worker.progress_until(deadline, || {
            closing.iter().all(Closing::is_done) && receiving.iter().all(|r| r.result().is_some())
        });
        if !all_closed {
            tracing::warn!("KV receiver: some endpoints did not close in time");
        }
        // Messages that arrived complete during the close are still handed out.
        self.start_receives();
        self.deliver();
        for op in &self.receiving {
            op.cancel();
        }
        self.worker.progress_all();
        tracing::debug!("KV receiver stopped");
        // Operations and closes go before the worker (and with it the context).
        drop(self.receiving);
        drop(self.closing);
        drop(self.worker);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handle_can_move_between_tasks() {
        fn send_sync<T: Send + Sync>() {}
        send_sync::<UcxReceiver>();
    }
}
