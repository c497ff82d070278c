//! The worker's gRPC service: its options and start-up, the request checks and the KV
//! receiving side shared by every role; the prefill leg ([`prefill`]) and the decode leg with
//! the aggregated role ([`decode`]) in their own files.

/// The decode leg and the aggregated role.
mod decode;
/// The prefill leg.
mod prefill;

use crate::engine::WorkerEngine;
use crate::handoff;
pub use crate::push::LandingMode;
use crate::push::{landing_to_pb, Outgoing};
use crate::reservations::Reservations;
use crate::{Error, Result};
use parking_lot::Mutex;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tandem_core::SamplingParams;
use tandem_kv::landing::{LandingArena, LandingWriter};
use tandem_kv::{UcxReceiver, UcxSender};
use tandem_proto::convert::finish_to_wire;
use tandem_proto::v1 as pb;
use tokio::sync::mpsc;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tonic::{Request, Response, Status};

/// Most choices (OpenAI's `n`) one request may ask for (the router allows 16).
const MAX_CHOICES: u32 = 64;

/// What a worker process serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// Computes prompts and pushes their KV.
    Prefill,
    /// Receives KV and generates the rest.
    Decode,
    /// Both in one process with no transfer (aggregated serving): answers `Generate`.
    Both,
}

impl Role {
    /// `prefill` or `decode`.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Both => "both",
        }
    }
}

/// How a worker runs.
#[derive(Clone, Debug)]
pub struct WorkerOptions {
    /// Its role.
    pub role: Role,
    /// Decode role: where the KV transport listens ("127.0.0.1:0" picks a port).
    pub transfer_bind: String,
    /// Decode role: how long a reservation waits for its KV before it is released.
    pub kv_lease: Duration,
    /// Prefill role: how long one KV push may take.
    pub transfer_timeout: Duration,
    /// Decode role: bytes of the shared-memory landing arena prefill workers on this host
    /// write handoffs into (0: none; every handoff travels over the transport).
    pub kv_landing_bytes: usize,
    /// Prefill role: how handoffs reach a decode worker's landing slot.
    pub kv_landing: LandingMode,
    /// Identity of the served checkpoint (`tandem_model::model_identity`): handoffs between
    /// workers of different identities are refused.
    pub model_id: u64,
    /// How long a drain waits for in-flight requests before the process exits anyway.
    pub drain_deadline: Duration,
    /// Prefill role: transfer faults of a chaos scenario, injected into KV pushes (testing
    /// only; `tandem worker --chaos-scenario`).
    pub transfer_chaos: Option<Arc<tandem_chaos::TransferChaos>>,
    /// Mutual TLS on the gRPC port (callers' certificates checked against each call's
    /// roles); plain text when absent.
    pub tls: Option<crate::tls::GrpcTls>,
}

struct Shared {
    opts: WorkerOptions,
    engine: WorkerEngine,
    reservations: Arc<Reservations>,
    transfer_address: String,
    receiver: Option<Mutex<UcxReceiver>>,
    sender: Option<UcxSender>,
    /// Decode role: the landing arena, when it could be made.
    landing: Option<Arc<LandingArena>>,
    /// Prefill role: writes handoffs into landing slots on this host.
    landing_writer: Arc<LandingWriter>,
    kv_bytes_sent: AtomicU64,
    /// Prefill role: each KV push's time and size, by path.
    kv_transfers: crate::transfer_stats::KvTransferStats,
    /// Handoff bytes that went through landing slots (written here, or landed here).
    kv_bytes_landed: Arc<AtomicU64>,
    /// Decode requests whose caller went away before they finished.
    cancelled: AtomicU64,
    admission: crate::drain::Admission,
    /// This run of the process (`StatsResponse.instance_id`).
    instance_id: String,
}

/// An id for this run of the process: its start time and pid, which no earlier run at the
/// same address shares.
fn instance_id() -> String {
    let started = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("{started:x}-{}", std::process::id())
}

/// The gRPC `Worker` service over an engine.
#[derive(Clone)]
struct WorkerService {
    shared: Arc<Shared>,
}

/// Serves `engine` in `opts.role` on `listener`; when `shutdown` resolves (or a `Drain` call
/// arrives) it drains: takes no new requests, finishes those in flight (up to the drain
/// deadline), then returns.
pub async fn serve(
    engine: WorkerEngine,
    opts: WorkerOptions,
    listener: tokio::net::TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<()> {
    serve_registered(engine, opts, listener, shutdown, None).await
}

/// [`serve`] for a worker registered in discovery: it takes no work while the registration
/// is lost, announces itself draining when the drain starts, and deregisters before it
/// returns.
pub async fn serve_registered(
    engine: WorkerEngine,
    opts: WorkerOptions,
    listener: tokio::net::TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
    registration: Option<tandem_discovery::Registration>,
) -> Result<()> {
    let reservations = Arc::new(Reservations::default());
    let kv_bytes_landed = Arc::new(AtomicU64::new(0));
    let landing = match (opts.role, opts.kv_landing_bytes) {
        (Role::Decode, n) if n > 0 => match LandingArena::create(n) {
            Ok(arena) => Some(arena),
            Err(e) => {
                tracing::warn!(error = %e, bytes = n,
                    "no shared-memory KV landing arena: every handoff travels over the transport");
                None
            }
        },
        _ => None,
    };
    let (receiver, sender, transfer_address) = match opts.role {
        Role::Decode => {
            // The arena is registered with the transport too, for writers on other hosts.
            let mut receiver =
                UcxReceiver::listen_with_arena(&opts.transfer_bind, landing.clone())?;
            let address = receiver.address();
            let incoming = receiver
                .take_incoming()
                .ok_or_else(|| Error::InvalidRequest("transport receiver already taken".into()))?;
            tokio::spawn(dispatch_incoming(
                incoming,
                reservations.clone(),
                kv_bytes_landed.clone(),
            ));
            tracing::info!(%address, "KV transport listening");
            (Some(Mutex::new(receiver)), None, address)
        }
        Role::Prefill => (None, Some(UcxSender::new()?), String::new()),
        Role::Both => (None, None, String::new()),
    };
    let admission = crate::drain::Admission::new(registration.as_ref().map(|r| r.registered()));
    let shared = Arc::new(Shared {
        opts,
        engine,
        reservations,
        transfer_address,
        receiver,
        sender,
        landing,
        landing_writer: Arc::new(LandingWriter::new()),
        kv_bytes_sent: AtomicU64::new(0),
        kv_transfers: crate::transfer_stats::KvTransferStats::default(),
        kv_bytes_landed,
        cancelled: AtomicU64::new(0),
        admission,
        instance_id: instance_id(),
    });
    let service = WorkerService {
        shared: shared.clone(),
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let routes = tonic::transport::Server::builder()
        .add_service(pb::worker_server::WorkerServer::new(service));
    let stopped = async {
        let _ = stopped.await;
    };
    // With TLS the handshakes run outside tonic (each on a task of its own, the certificate
    // reloaded when its files change); tonic still reads the peer's certificates off each
    // stream for the per-call checks.
    let server: std::pin::Pin<
        Box<dyn Future<Output = std::result::Result<(), tonic::transport::Error>> + Send>,
    > = match &shared.opts.tls {
        Some(tls) => {
            let accepted = tandem_tls::accept(listener, tls.server_config()?);
            let incoming = tokio_stream::StreamExt::map(
                tokio_stream::wrappers::ReceiverStream::new(accepted),
                |(stream, _peer)| Ok::<_, std::io::Error>(stream),
            );
            Box::pin(routes.serve_with_incoming_shutdown(incoming, stopped))
        }
        None => {
            Box::pin(routes.serve_with_incoming_shutdown(TcpListenerStream::new(listener), stopped))
        }
    };
    tokio::pin!(server);
    let admission = &shared.admission;
    let deadline = tokio::select! {
        r = &mut server => return r.map_err(Into::into),
        _ = shutdown => {
            admission.start_drain(shared.opts.drain_deadline);
            shared.opts.drain_deadline
        }
        d = admission.drain_started() => d,
    };
    tracing::info!(
        in_flight = admission.in_flight(),
        ?deadline,
        "draining: no new requests; finishing those in flight"
    );
    if let Some(r) = &registration {
        r.set_state(tandem_discovery::WorkerState::Draining);
    }
    let finished = async {
        admission.wait_done().await;
        shared.engine.wait_idle().await;
    };
    tokio::select! {
        r = &mut server => return r.map_err(Into::into),
        _ = finished => tracing::info!("drained: every request finished"),
        _ = tokio::time::sleep(deadline) => tracing::warn!(
            in_flight = admission.in_flight(),
            "drain deadline reached with requests still running; stopping (the router migrates them)"
        ),
    }
    if let Some(r) = registration {
        r.deregister().await;
    }
    // Streams still open past the deadline would hold a graceful stop forever: give it a
    // moment, then return and let the process end.
    let _ = stop.send(());
    let _ = tokio::time::timeout(Duration::from_secs(2), server).await;
    Ok(())
}

/// Routes each received handoff message (or landing slot's completion record) to the
/// reservation waiting for it.
async fn dispatch_incoming(
    mut incoming: mpsc::UnboundedReceiver<tandem_kv::KvMessage>,
    reservations: Arc<Reservations>,
    kv_bytes_landed: Arc<AtomicU64>,
) {
    while let Some(msg) = incoming.recv().await {
        if let Some((id, epoch)) = handoff::decode_extend(&msg.payload) {
            // Late ones (the KV came first, or the lease ran out) find nothing: harmless.
            if id.0 != msg.tag || !reservations.extend(id, epoch) {
                tracing::debug!(tag = msg.tag, reservation = %id, "lease extension for no waiting reservation");
            }
            continue;
        }
        if let Some(l) = handoff::decode_landed(&msg.payload) {
            if l.reservation.0 != msg.tag {
                tracing::warn!(tag = msg.tag, reservation = %l.reservation, "KV landing record tag mismatch dropped");
            } else if reservations.deliver_landed(l.reservation, l.epoch, l.offset, l.len as usize)
            {
                kv_bytes_landed.fetch_add(l.len, Ordering::Relaxed);
            } else {
                tracing::warn!(reservation = %l.reservation, epoch = %l.epoch,
                    "KV landing record for an unknown or stale reservation (or another slot) dropped");
            }
            continue;
        }
        match handoff::decode_header(&msg.payload) {
            Ok(h) if h.reservation.0 == msg.tag => {
                if !reservations.deliver(h.reservation, h.epoch, msg.payload) {
                    tracing::warn!(reservation = %h.reservation, epoch = %h.epoch,
                        "KV for an unknown or stale reservation dropped");
                }
            }
            Ok(h) => {
                tracing::warn!(tag = msg.tag, reservation = %h.reservation, "KV tag/header mismatch dropped")
            }
            Err(e) => tracing::warn!(tag = msg.tag, error = %e, "malformed KV message dropped"),
        }
    }
}

/// The caller's deadline (`grpc-timeout`: at most 8 digits and a unit, H M S m u n) as an
/// instant, if it sent one. The server enforces it for unary calls; streams end here.
fn grpc_deadline(meta: &tonic::metadata::MetadataMap) -> Option<tokio::time::Instant> {
    let v = meta.get("grpc-timeout")?.to_str().ok()?;
    let (digits, unit) = v.split_at(v.len().checked_sub(1)?);
    let n: u64 = digits.parse().ok().filter(|_| digits.len() <= 8)?;
    let d = match unit {
        "H" => Duration::from_secs(n.saturating_mul(3600)),
        "M" => Duration::from_secs(n.saturating_mul(60)),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    };
    Some(tokio::time::Instant::now() + d)
}

/// Runs `work` until `deadline` (when there is one): past it the work is dropped — its
/// engine request cancelled, its reservation freed — and the stream ends with
/// `DeadlineExceeded`.
async fn until(
    deadline: Option<tokio::time::Instant>,
    work: impl std::future::Future<Output = Result<()>>,
) -> Result<()> {
    match deadline {
        None => work.await,
        Some(at) => tokio::time::timeout_at(at, work).await.unwrap_or_else(|_| {
            Err(Error::Deadline(
                "the caller's deadline passed before the request finished".into(),
            ))
        }),
    }
}

impl WorkerService {
    /// Refuses `request` unless TLS is off or its peer's certificate names a role allowed
    /// to make `rpc`.
    fn authorize<T>(
        &self,
        request: &Request<T>,
        rpc: crate::tls::Rpc,
    ) -> std::result::Result<(), Status> {
        if self.shared.opts.tls.is_none() {
            return Ok(());
        }
        let certs = request.peer_certs();
        match crate::tls::authorize(rpc, certs.as_deref().map(Vec::as_slice)) {
            Ok(_) => Ok(()),
            Err(status) => {
                tracing::warn!(?rpc, peer = ?request.remote_addr(), reason = status.message(),
                    "call refused");
                Err(status)
            }
        }
    }
}

impl Shared {
    /// Counts a decode request dropped because its caller went away; called before the
    /// request's resources are released, so whoever sees them free also sees the count.
    fn note_cancelled(&self) -> Result<()> {
        self.cancelled.fetch_add(1, Ordering::Relaxed);
        tracing::debug!("decode request cancelled by its caller");
        Ok(())
    }

    fn check_role(&self, want: Role) -> Result<()> {
        if self.opts.role == want {
            Ok(())
        } else {
            Err(Error::InvalidRequest(format!(
                "this worker serves the {} role, not {}",
                self.opts.role.as_str(),
                want.as_str()
            )))
        }
    }

    /// The prompt and each choice's sampling parameters (choice j's seed is `seed + j`).
    fn checked_request(
        &self,
        req: Option<pb::GenerateRequest>,
    ) -> Result<(Vec<u32>, Vec<SamplingParams>)> {
        let req = req.ok_or_else(|| Error::InvalidRequest("missing request".into()))?;
        let params = SamplingParams::from(req.sampling.unwrap_or_default());
        if req.choices > MAX_CHOICES {
            return Err(Error::InvalidRequest(format!(
                "{} choices exceed the {MAX_CHOICES} one request may ask for",
                req.choices
            )));
        }
        if req.prompt_token_ids.is_empty() {
            return Err(Error::InvalidRequest("empty prompt".into()));
        }
        if params.max_tokens == 0 {
            return Err(Error::InvalidRequest(
                "max_tokens must be at least 1".into(),
            ));
        }
        let total = req.prompt_token_ids.len() + params.max_tokens as usize;
        if total > self.engine.max_context() {
            return Err(Error::InvalidRequest(format!(
                "{total} tokens exceed the context length {}",
                self.engine.max_context()
            )));
        }
        let choices = (0..u64::from(req.choices.max(1)))
            .map(|j| SamplingParams {
                seed: params.seed.wrapping_add(j),
                ..params.clone()
            })
            .collect();
        Ok((req.prompt_token_ids, choices))
    }

    fn kv_layout(&self, num_tokens: usize) -> pb::KvLayout {
        pb::KvLayout {
            model_id: self.opts.model_id,
            ..self.engine.kv_layout(num_tokens)
        }
    }
}

type DecodeStream = ReceiverStream<std::result::Result<pb::DecodeEvent, Status>>;
type GenerateStream = ReceiverStream<std::result::Result<pb::TokenEvent, Status>>;

#[tonic::async_trait]
impl pb::worker_server::Worker for WorkerService {
    type DecodeStream = DecodeStream;
    type GenerateStream = GenerateStream;

    async fn generate(
        &self,
        request: Request<pb::GenerateRequest>,
    ) -> std::result::Result<Response<GenerateStream>, Status> {
        self.authorize(&request, crate::tls::Rpc::Generate)?;
        let shared = self.shared.clone();
        shared.check_role(Role::Both)?;
        let claim = shared.admission.admit()?;
        let deadline = grpc_deadline(request.metadata());
        let (prompt, params) = shared.checked_request(Some(request.into_inner()))?;
        let (tx, rx) = mpsc::channel(64);
        tokio::spawn(async move {
            let _claim = claim;
            let work = shared.generate_all(prompt, params, &tx);
            if let Err(e) = until(deadline, work).await {
                tracing::warn!(error = %e, "generate failed");
                let _ = tx.send(Err(Status::from(e))).await;
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn decode(
        &self,
        request: Request<pb::DecodeRequest>,
    ) -> std::result::Result<Response<DecodeStream>, Status> {
        self.authorize(&request, crate::tls::Rpc::Decode)?;
        let shared = self.shared.clone();
        shared.check_role(Role::Decode)?;
        let claim = shared.admission.admit()?;
        let deadline = grpc_deadline(request.metadata());
        let request = request.into_inner();
        let dp_rank = request.dp_rank.map(|r| r as usize);
        let (prompt, choices) = shared.checked_request(request.request)?;
        let tokens = prompt.len() + choices[0].max_tokens as usize;
        let reservations = shared
            .engine
            .reserve(tokens, prompt.len(), choices.len(), dp_rank)?;
        let layout = shared.kv_layout(prompt.len());
        let slot = shared
            .landing
            .as_ref()
            .zip(shared.engine.handoff_bound(prompt.len(), choices.len()))
            .and_then(|(arena, bytes)| arena.slot(bytes));
        let landing = slot.as_ref().map(|s| landing_to_pb(&s.landing()));
        let pending = shared.reservations.register_with(slot);
        let target = pb::KvTarget {
            transfer_address: shared.transfer_address.clone(),
            reservation_id: pending.id.0,
            epoch: pending.epoch.0,
            layout: Some(layout),
            landing,
            lease_ms: shared.opts.kv_lease.as_millis() as u64,
        };
        let (tx, rx) = mpsc::channel(64);
        let first = pb::DecodeEvent {
            event: Some(pb::decode_event::Event::KvTarget(target)),
        };
        tx.send(Ok(first))
            .await
            .map_err(|_| Status::cancelled("client went away"))?;
        tokio::spawn(async move {
            let _claim = claim;
            let work = shared
                .clone()
                .decode_rest(prompt, choices, reservations, pending, &tx);
            if let Err(e) = until(deadline, work).await {
                tracing::warn!(error = %e, "decode failed");
                let _ = tx.send(Err(Status::from(e))).await;
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn prefill(
        &self,
        request: Request<pb::PrefillRequest>,
    ) -> std::result::Result<Response<pb::PrefillResponse>, Status> {
        self.authorize(&request, crate::tls::Rpc::Prefill)?;
        let res = match self.shared.admission.admit() {
            Ok(_claim) => self.shared.prefill(request.into_inner()).await,
            Err(e) => Err(e),
        };
        if let Err(e) = &res {
            tracing::warn!(error = %e, "prefill failed");
        }
        Ok(Response::new(res?))
    }

    async fn refresh_weights(
        &self,
        request: Request<pb::RefreshWeightsRequest>,
    ) -> std::result::Result<Response<pb::RefreshWeightsResponse>, Status> {
        self.authorize(&request, crate::tls::Rpc::RefreshWeights)?;
        let dir = std::path::PathBuf::from(request.into_inner().model_dir);
        let engine = self.shared.engine.clone();
        let shown = dir.display().to_string();
        tokio::task::spawn_blocking(move || engine.refresh_weights(&dir))
            .await
            .map_err(|e| Status::internal(format!("refresh task failed: {e}")))??;
        tracing::info!(model_dir = %shown, "weights refreshed");
        Ok(Response::new(pb::RefreshWeightsResponse {
            message: format!("weights refreshed from {shown}"),
        }))
    }

    async fn stats(
        &self,
        request: Request<pb::StatsRequest>,
    ) -> std::result::Result<Response<pb::StatsResponse>, Status> {
        self.authorize(&request, crate::tls::Rpc::Stats)?;
        let s = &self.shared;
        let ask = request.into_inner();
        // Not idle (or busy) within the limit: report the state as it is; the caller judges.
        if ask.wait_idle_ms > 0 {
            let limit = Duration::from_millis(u64::from(ask.wait_idle_ms));
            let _ = tokio::time::timeout(limit, s.engine.wait_idle()).await;
        }
        if ask.wait_busy_ms > 0 {
            let limit = Duration::from_millis(u64::from(ask.wait_busy_ms));
            let _ = tokio::time::timeout(limit, s.engine.wait_busy()).await;
        }
        let (kv_total, kv_free) = s.engine.kv_blocks();
        let (layout, dp_size, dp_free) = s.engine.layout_info();
        let received = s.receiver.as_ref().map_or(0, |r| r.lock().bytes_received());
        Ok(Response::new(pb::StatsResponse {
            role: s.opts.role.as_str().into(),
            kv_blocks_total: kv_total as u32,
            kv_blocks_free: kv_free as u32,
            running_requests: s.engine.running() as u32,
            layout,
            dp_size: dp_size as u32,
            dp_free_slots: dp_free.into_iter().map(|f| f as u32).collect(),
            cancelled_requests: s.cancelled.load(Ordering::Relaxed),
            pending_reservations: s.reservations.len() as u32,
            kv_bytes_transferred: s.kv_bytes_sent.load(Ordering::Relaxed)
                + received
                + if s.opts.role == Role::Decode {
                    s.kv_bytes_landed.load(Ordering::Relaxed)
                } else {
                    0
                },
            kv_bytes_landed: s.kv_bytes_landed.load(Ordering::Relaxed),
            kv_lease_extensions: s.reservations.extensions(),
            draining: s.admission.is_draining(),
            in_flight: s.admission.in_flight() as u32,
            prefill_tokens: s.engine.0.stats().prefill_tokens,
            instance_id: s.instance_id.clone(),
            kv_transfers: s.kv_transfers.to_pb(),
        }))
    }

    async fn drain(
        &self,
        request: Request<pb::DrainRequest>,
    ) -> std::result::Result<Response<pb::DrainResponse>, Status> {
        self.authorize(&request, crate::tls::Rpc::Drain)?;
        let s = &self.shared;
        let ms = request.into_inner().deadline_ms;
        let deadline = if ms == 0 {
            s.opts.drain_deadline
        } else {
            Duration::from_millis(u64::from(ms))
        };
        let in_flight = s.admission.in_flight() as u32;
        let message = if s.admission.start_drain(deadline) {
            format!("draining: {in_flight} requests in flight, exiting when they finish or after {deadline:?}")
        } else {
            format!("already draining: {in_flight} requests in flight")
        };
        tracing::info!(%message, "drain requested");
        Ok(Response::new(pb::DrainResponse { in_flight, message }))
    }
}
