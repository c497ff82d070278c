use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc as std_mpsc, Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tandem_ucx::{
    AtomicOp, CloseMode, Closing, Context, Endpoint, RemoteKey, SendOp, Waker, Worker,
};
use tokio::sync::oneshot;

use crate::error::{Error, Result};
use crate::landing::{claimed, Landing};
use crate::peer_address::resolve;
use crate::transport_config::ucx_config;

/// Longest the thread sleeps without re-checking deadlines (a safety net; wake-ups are
/// normally event-driven).
const IDLE_WAIT: Duration = Duration::from_millis(100);
/// How long shutdown lets in-flight sends and endpoint closes finish.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(1);
/// Stand-in deadline for timeouts too large for `Instant` (about 30 years).
const FAR_FUTURE: Duration = Duration::from_secs(1 << 30);

/// Sending side (prefill worker). Owns a background thread with a UCX worker; caches one
/// endpoint per peer address. Clones share the thread; dropping the last one stops it, which
/// blocks briefly (at most a couple of seconds) while in-flight sends finish and endpoints
/// close.
#[derive(Clone)]
pub struct UcxSender {
    shared: Arc<SenderShared>,
}

struct SenderShared {
    commands: std_mpsc::Sender<Command>,
    waker: Waker,
    bytes_sent: Arc<AtomicU64>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

enum Command {
    Send {
        address: String,
        tag: u64,
        payload: Vec<u8>,
        timeout: Duration,
        reply: oneshot::Sender<Result<()>>,
    },
    /// Claim a landing slot remotely, put `payload` into it, flush, then send `record`.
    Put {
        address: String,
        tag: u64,
        landing: Landing,
        payload: Vec<u8>,
        record: Vec<u8>,
        timeout: Duration,
        reply: oneshot::Sender<Result<()>>,
    },
    Shutdown,
}

impl UcxSender {
    /// Starts the sending thread and its UCX worker.
    pub fn new() -> Result<UcxSender> {
        let (commands, command_rx) = std_mpsc::channel();
        let bytes_sent = Arc::new(AtomicU64::new(0));
        let (ready_tx, ready_rx) = std_mpsc::sync_channel(1);
        let thread_bytes = Arc::clone(&bytes_sent);
        let thread = std::thread::Builder::new()
            .name("kv-ucx-send".into())
            .spawn(move || {
                let setup = || -> tandem_ucx::Result<Worker> {
                    let context = Context::new(&ucx_config()?)?;
                    Worker::new(&context)
                };
                let worker = match setup() {
                    Ok(worker) => {
                        if ready_tx.send(Ok(worker.waker())).is_err() {
                            return;
                        }
                        worker
                    }
                    Err(err) => {
                        // If the caller is gone there is no one left to tell.
                        let _ = ready_tx.send(Err(err));
                        return;
                    }
                };
                SenderLoop {
                    worker,
                    commands: command_rx,
                    peers: HashMap::new(),
                    next_peer_id: 0,
                    pending: Vec::new(),
                    puts: Vec::new(),
                    closing: Vec::new(),
                    bytes_sent: thread_bytes,
                }
                .run();
            })
            .map_err(Error::Spawn)?;
        let (waker, thread) = crate::error::await_setup(ready_rx, thread)?;
        Ok(UcxSender {
            shared: Arc::new(SenderShared {
                commands,
                waker,
                bytes_sent,
                thread: Mutex::new(Some(thread)),
            }),
        })
    }

    /// Sends `payload` with `tag` to the receiver at `address`; resolves when UCX reports the
    /// send complete, or with an error: receiver unreachable, peer gone, or no completion
    /// within `timeout` (connection set-up included). Never hangs forever.
    ///
    /// A failed or timed-out endpoint is evicted (force-closed, which also fails other sends
    /// in flight to that peer); the next send reconnects.
    pub async fn send(
        &self,
        address: &str,
        tag: u64,
        payload: Vec<u8>,
        timeout: Duration,
    ) -> Result<()> {
        let (reply, outcome) = oneshot::channel();
        self.shared
            .commands
            .send(Command::Send {
                address: address.to_owned(),
                tag,
                payload,
                timeout,
                reply,
            })
            .map_err(|_| Error::Stopped)?;
        self.shared.waker.wake();
        outcome.await.unwrap_or(Err(Error::Stopped))
    }

    /// Writes `payload` into the receiver's landing slot `landing` describes with
    /// one-sided UCX operations, for a sender that cannot map the slot's arena (another
    /// host): claims the slot by a remote compare-and-swap of its fence (nothing is written
    /// when the reservation has let go: [`Error::SlotReleased`]), puts the bytes, flushes
    /// them into the receiver's memory, then sends `record` (the completion record) with
    /// `tag`. Resolves once the record's send completed, or with an error, within `timeout`.
    pub async fn put_landing(
        &self,
        address: &str,
        tag: u64,
        landing: &Landing,
        payload: Vec<u8>,
        record: Vec<u8>,
        timeout: Duration,
    ) -> Result<()> {
        if landing.remote.is_none() || payload.len() as u64 > landing.capacity {
            return Err(Error::NotRemote {
                address: address.to_owned(),
            });
        }
        let (reply, outcome) = oneshot::channel();
        self.shared
            .commands
            .send(Command::Put {
                address: address.to_owned(),
                tag,
                landing: landing.clone(),
                payload,
                record,
                timeout,
                reply,
            })
            .map_err(|_| Error::Stopped)?;
        self.shared.waker.wake();
        outcome.await.unwrap_or(Err(Error::Stopped))
    }

    /// Total payload bytes whose send UCX reported complete.
    pub fn bytes_sent(&self) -> u64 {
        self.shared.bytes_sent.load(Ordering::Relaxed)
    }
}

impl Drop for SenderShared {
    fn drop(&mut self) {
        // The thread may already be gone; then there is nothing to stop.
        let _ = self.commands.send(Command::Shutdown);
        self.waker.wake();
        let thread = self
            .thread
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(thread) = thread {
            if thread.join().is_err() {
                tracing::error!("KV sender thread panicked");
            }
        }
    }
}

/// Takes out of `items` those whose deadline has passed.
fn take_expired<T>(items: &mut Vec<T>, deadline: impl Fn(&T) -> Instant) -> Vec<T> {
    let now = Instant::now();
    let (expired, live) = std::mem::take(items)
        .into_iter()
        .partition(|t| deadline(t) <= now);
    *items = live;
    expired
}

/// One cached connection. `id` tells a replacement apart from the endpoint an old send used.
struct Peer {
    id: u64,
    ep: Endpoint,
    /// Whether any send on this endpoint completed: failures before that mean "could not
    /// reach", after it "broke mid-stream".
    delivered: bool,
}

struct PendingSend {
    op: SendOp,
    address: String,
    peer_id: u64,
    deadline: Instant,
    timeout: Duration,
    reply: oneshot::Sender<Result<()>>,
}

/// Where a one-sided write is.
enum PutStage {
    /// The fence's compare-and-swap is out.
    Claim(AtomicOp),
    /// The bytes' put and the flush behind it are out.
    Write { put: SendOp, flush: SendOp },
}

/// A one-sided write into a landing slot in flight; its completion record goes out as an
/// ordinary send when the flush completes.
struct PendingPut {
    stage: PutStage,
    key: RemoteKey,
    address: String,
    peer_id: u64,
    tag: u64,
    /// The fence's token: the claim succeeded when the swap found it.
    token: u64,
    data_address: u64,
    data_len: usize,
    payload: Option<Vec<u8>>,
    record: Vec<u8>,
    deadline: Instant,
    timeout: Duration,
    reply: oneshot::Sender<Result<()>>,
}

/// The sender thread's state; everything UCX lives here, on one thread.
struct SenderLoop {
    worker: Worker,
    commands: std_mpsc::Receiver<Command>,
    peers: HashMap<String, Peer>,
    next_peer_id: u64,
    pending: Vec<PendingSend>,
    puts: Vec<PendingPut>,
    closing: Vec<Closing>,
    bytes_sent: Arc<AtomicU64>,
}

impl SenderLoop {
    fn run(mut self) {
        loop {
            self.worker.progress_all();
            let (busy, stop) = self.take_commands();
            let advanced = self.advance_puts();
            self.complete_sends();
            self.expire_sends();
            self.expire_puts();
            self.evict_failed_peers();
            if stop {
                break;
            }
            if busy || advanced {
                continue;
            }
            let wait = self
                .pending
                .iter()
                .map(|p| p.deadline)
                .chain(self.puts.iter().map(|p| p.deadline))
                .map(|d| d.saturating_duration_since(Instant::now()))
                .min()
                .map_or(IDLE_WAIT, |d| d.min(IDLE_WAIT));
            if let Err(err) = self.worker.wait(wait) {
                tracing::warn!(%err, "KV sender: waiting for UCX events failed");
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        self.shutdown();
    }

    /// Handles queued commands; returns (whether any were handled, whether to stop).
    fn take_commands(&mut self) -> (bool, bool) {
        let mut busy = false;
        loop {
            match self.commands.try_recv() {
                Ok(Command::Send {
                    address,
                    tag,
                    payload,
                    timeout,
                    reply,
                }) => {
                    busy = true;
                    self.start_send(address, tag, payload, timeout, reply);
                }
                Ok(Command::Put {
                    address,
                    tag,
                    landing,
                    payload,
                    record,
                    timeout,
                    reply,
                }) => {
                    busy = true;
                    self.start_put(address, tag, &landing, payload, record, timeout, reply);
                }
                Ok(Command::Shutdown) | Err(std_mpsc::TryRecvError::Disconnected) => {
                    return (busy, true)
                }
                Err(std_mpsc::TryRecvError::Empty) => return (busy, false),
            }
        }
    }

    fn start_send(
        &mut self,
        address: String,
        tag: u64,
        payload: Vec<u8>,
        timeout: Duration,
        reply: oneshot::Sender<Result<()>>,
    ) {
        let Some((peer, deadline, reply)) = self.start(&address, timeout, reply) else {
            return;
        };
        let peer_id = peer.id;
        match peer.ep.tag_send(tag, payload) {
            Ok(op) => self.pending.push(PendingSend {
                op,
                address,
                peer_id,
                deadline,
                timeout,
                reply,
            }),
            Err(err) => {
                let err = self.send_failed(&address, peer_id, err);
                let _ = reply.send(Err(err));
            }
        }
    }

    /// What starting an operation to `address` needs: its peer (connecting if need be) and
    /// its deadline; `None` (the caller told, if still waiting) when it cannot start.
    fn start(
        &mut self,
        address: &str,
        timeout: Duration,
        reply: oneshot::Sender<Result<()>>,
    ) -> Option<(&mut Peer, Instant, oneshot::Sender<Result<()>>)> {
        if reply.is_closed() {
            return None; // the caller gave up before we started
        }
        // A timeout too large to represent means "no practical deadline".
        let deadline = Instant::now()
            .checked_add(timeout)
            .unwrap_or_else(|| Instant::now() + FAR_FUTURE);
        match self.peer(address) {
            Ok(peer) => Some((peer, deadline, reply)),
            Err(err) => {
                let _ = reply.send(Err(err));
                None
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn start_put(
        &mut self,
        address: String,
        tag: u64,
        landing: &Landing,
        payload: Vec<u8>,
        record: Vec<u8>,
        timeout: Duration,
        reply: oneshot::Sender<Result<()>>,
    ) {
        let Some(remote) = &landing.remote else {
            let _ = reply.send(Err(Error::NotRemote { address }));
            return;
        };
        let Some((peer, deadline, reply)) = self.start(&address, timeout, reply) else {
            return;
        };
        let peer_id = peer.id;
        let started = RemoteKey::unpack(&peer.ep, &remote.rkey).and_then(|key| {
            let fence = remote.base + landing.fence_offset;
            let op = peer
                .ep
                .compare_swap(fence, &key, landing.fence, claimed(landing.fence))?;
            Ok((key, op))
        });
        match started {
            Ok((key, op)) => self.puts.push(PendingPut {
                stage: PutStage::Claim(op),
                key,
                address,
                peer_id,
                tag,
                token: landing.fence,
                data_address: remote.base + landing.offset,
                data_len: payload.len(),
                payload: Some(payload),
                record,
                deadline,
                timeout,
                reply,
            }),
            Err(err) => {
                let err = self.send_failed(&address, peer_id, err);
                let _ = reply.send(Err(err));
            }
        }
    }

    /// Moves one-sided writes along: a claimed slot gets its put and flush, a flushed one its
    /// completion record (an ordinary send from then on). Returns whether any moved.
    fn advance_puts(&mut self) -> bool {
        let mut moved = false;
        let mut i = 0;
        while i < self.puts.len() {
            let p = &mut self.puts[i];
            let step: Option<Result<bool>> = match &p.stage {
                PutStage::Claim(op) => op.result().map(|old| {
                    let old = old.map_err(|e| (e, false));
                    match old {
                        Ok(v) if v == p.token => {
                            let ep = self.peers.get(&p.address).filter(|q| q.id == p.peer_id);
                            match ep {
                                Some(peer) => {
                                    let data = p.payload.take().unwrap_or_default();
                                    match peer
                                        .ep
                                        .put(data, p.data_address, &p.key)
                                        .and_then(|put| Ok((put, peer.ep.flush()?)))
                                    {
                                        Ok((put, flush)) => {
                                            p.stage = PutStage::Write { put, flush };
                                            Ok(false)
                                        }
                                        Err(e) => Err(Error::Transfer {
                                            address: p.address.clone(),
                                            source: e,
                                        }),
                                    }
                                }
                                None => Err(Error::Stopped),
                            }
                        }
                        Ok(_) => Err(Error::SlotReleased {
                            address: p.address.clone(),
                        }),
                        Err((e, _)) => Err(Error::Transfer {
                            address: p.address.clone(),
                            source: e,
                        }),
                    }
                }),
                PutStage::Write { put, flush } => match (put.result(), flush.result()) {
                    (Some(Err(e)), _) | (_, Some(Err(e))) => Some(Err(Error::Transfer {
                        address: p.address.clone(),
                        source: e,
                    })),
                    (Some(Ok(())), Some(Ok(()))) => Some(Ok(true)),
                    _ => None,
                },
            };
            match step {
                None => i += 1,
                Some(Ok(false)) => {
                    moved = true;
                    i += 1;
                }
                Some(Ok(true)) => {
                    moved = true;
                    let p = self.puts.swap_remove(i);
                    self.bytes_sent
                        .fetch_add(p.data_len as u64, Ordering::Relaxed);
                    let left = p.deadline.saturating_duration_since(Instant::now());
                    self.start_send(p.address, p.tag, p.record, left, p.reply);
                }
                Some(Err(err)) => {
                    moved = true;
                    let p = self.puts.swap_remove(i);
                    // The remote key goes before its endpoint may be evicted below.
                    let PendingPut {
                        key,
                        address,
                        peer_id,
                        reply,
                        ..
                    } = p;
                    drop(key);
                    let p = (address, peer_id, reply);
                    let err = match err {
                        Error::Transfer { source, .. } => self.send_failed(&p.0, p.1, source),
                        other => other,
                    };
                    let _ = p.2.send(Err(err));
                }
            }
        }
        moved
    }

    /// The cached endpoint for `address`, connecting if there is none (or it failed).
    fn peer(&mut self, address: &str) -> Result<&mut Peer> {
        if self.peers.get(address).is_some_and(|p| p.ep.is_failed()) {
            self.evict(address, None);
        }
        match self.peers.entry(address.to_owned()) {
            Entry::Occupied(cached) => Ok(cached.into_mut()),
            Entry::Vacant(slot) => {
                let addr = resolve(address)?;
                let ep =
                    Endpoint::connect(&self.worker, addr).map_err(|source| Error::Unreachable {
                        address: address.to_owned(),
                        source,
                    })?;
                tracing::debug!(%address, "KV sender connecting");
                self.next_peer_id += 1;
                Ok(slot.insert(Peer {
                    id: self.next_peer_id,
                    ep,
                    delivered: false,
                }))
            }
        }
    }

    /// Classifies a failed send on `peer_id` and evicts that endpoint.
    fn send_failed(&mut self, address: &str, peer_id: u64, op_err: tandem_ucx::Error) -> Error {
        let (delivered, reason) = match self.peers.get(address) {
            Some(p) if p.id == peer_id => (p.delivered, p.ep.failure()),
            // Already evicted (and maybe replaced): the transfer broke on that endpoint.
            _ => (true, None),
        };
        self.evict(address, Some(peer_id));
        // Prefer the endpoint's failure (why the peer is gone) over the generic op status.
        let source = reason.unwrap_or(op_err);
        let address = address.to_owned();
        if delivered {
            Error::Transfer { address, source }
        } else {
            Error::Unreachable { address, source }
        }
    }

    /// Force-closes the cached endpoint for `address` (only if it is `peer_id`, when given).
    fn evict(&mut self, address: &str, peer_id: Option<u64>) {
        let matches = self
            .peers
            .get(address)
            .is_some_and(|p| peer_id.is_none_or(|id| p.id == id));
        if !matches {
            return;
        }
        if let Some(peer) = self.peers.remove(address) {
            tracing::debug!(%address, reason = ?peer.ep.failure(), "KV sender evicting endpoint");
            self.closing.push(peer.ep.close(CloseMode::Force));
        }
    }

    fn complete_sends(&mut self) {
        let mut i = 0;
        while i < self.pending.len() {
            let Some(result) = self.pending[i].op.result() else {
                i += 1;
                continue;
            };
            let send = self.pending.swap_remove(i);
            let outcome = match result {
                Ok(()) => {
                    self.bytes_sent
                        .fetch_add(send.op.len() as u64, Ordering::Relaxed);
                    if let Some(peer) = self.peers.get_mut(&send.address) {
                        if peer.id == send.peer_id {
                            peer.delivered = true;
                        }
                    }
                    Ok(())
                }
                Err(err) => Err(self.send_failed(&send.address, send.peer_id, err)),
            };
            // The caller may have stopped waiting; that is fine.
            let _ = send.reply.send(outcome);
        }
    }

    /// Fails sends whose deadline passed and evicts their endpoints (a stalled peer).
    fn expire_sends(&mut self) {
        // Dropping a SendOp is safe: UCX keeps the payload until it is done with it.
        for send in take_expired(&mut self.pending, |s| s.deadline) {
            tracing::warn!(address = %send.address, timeout = ?send.timeout, "KV send timed out");
            self.evict(&send.address, Some(send.peer_id));
            let _ = send.reply.send(Err(Error::Timeout {
                address: send.address,
                timeout: send.timeout,
            }));
        }
    }

    /// Fails one-sided writes whose deadline passed (their endpoint is evicted: a stalled
    /// peer); a write that claimed its slot and stalled leaves the slot to the receiver's
    /// quarantine.
    fn expire_puts(&mut self) {
        for p in take_expired(&mut self.puts, |p| p.deadline) {
            tracing::warn!(address = %p.address, timeout = ?p.timeout, "KV one-sided write timed out");
            let PendingPut {
                key,
                address,
                peer_id,
                timeout,
                reply,
                ..
            } = p;
            // The remote key goes before its endpoint is evicted.
            drop(key);
            self.evict(&address, Some(peer_id));
            let _ = reply.send(Err(Error::Timeout { address, timeout }));
        }
    }

    fn evict_failed_peers(&mut self) {
        let failed: Vec<String> = self
            .peers
            .iter()
            .filter(|(_, p)| p.ep.is_failed())
            .map(|(address, _)| address.clone())
            .collect();
        for address in failed {
            self.evict(&address, None);
        }
        self.closing.retain(|c| !c.is_done());
    }

    fn shutdown(mut self) {
        // Let in-flight sends finish (bounded), then close every endpoint.
        let deadline = Instant::now() + SHUTDOWN_GRACE;
        let pending = &self.pending;
        self.worker
            .progress_until(deadline, || pending.iter().all(|p| p.op.result().is_some()));
        self.complete_sends();
        for send in self.pending.drain(..) {
            let _ = send.reply.send(Err(Error::Stopped));
        }
        for put in self.puts.drain(..) {
            let _ = put.reply.send(Err(Error::Stopped));
        }
        for (_, peer) in self.peers.drain() {
            let mode = if peer.ep.is_failed() {
                CloseMode::Force
            } else {
                CloseMode::Flush
            };
            self.closing.push(peer.ep.close(mode));
        }
        let closing = &self.closing;
        let deadline = Instant::now() + SHUTDOWN_GRACE;
        if !self
            .worker
            .progress_until(deadline, || closing.iter().all(Closing::is_done))
        {
            tracing::warn!("KV sender: some endpoints did not close in time");
        }
        tracing::debug!("KV sender stopped");
        // Closes first, then the worker (and with it the context).
        drop(self.closing);
        drop(self.worker);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_can_move_between_tasks() {
        fn send_sync<T: Send + Sync + Clone>() {}
        send_sync::<UcxSender>();
    }
}
