//! The fault-injecting proxy: accepts HTTP/2 (gRPC) connections, opens one upstream
//! connection per accepted one, and forwards each request — unless the scenario says to
//! answer `502`/`503` itself (as an Envoy-style sidecar does to a gRPC client), to hold it
//! for a while, or the connection is to be reset, closed or stalled. Malformed traffic only
//! ends its own connection.

use crate::scenario::{ConnectionFaults, HttpFaults, Injector, Scenario};
use bytes::Bytes;
use http_body_util::{combinators::BoxBody, BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo};
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};

type Body = BoxBody<Bytes, hyper::Error>;

/// Injector slots of the proxy's faults.
mod slot {
    pub const S502: usize = 0;
    pub const S503: usize = 1;
    pub const DELAY: usize = 2;
    pub const RESET: usize = 3;
    pub const CLOSE: usize = 4;
    pub const STALL: usize = 5;
    pub const HTTP_RESET: usize = 6;
}

/// Counts of what went through and what was injected.
#[derive(Debug, Default)]
pub struct ProxyCounters {
    /// Connections accepted.
    pub connections: AtomicU64,
    /// Requests seen.
    pub requests: AtomicU64,
}

/// The faults in force, swapped whole when the scenario changes.
#[derive(Debug)]
struct Faults {
    http: HttpFaults,
    connection: ConnectionFaults,
    injector: Injector,
}

/// A proxy from a listener to `upstream` (`host:port`) under a scenario that can be replaced
/// while it runs ([`Proxy::set_scenario`], or `PUT /scenario` on its admin port).
#[derive(Debug)]
pub struct Proxy {
    upstream: String,
    faults: std::sync::RwLock<Arc<Faults>>,
    /// What went through.
    pub counters: ProxyCounters,
}

impl Proxy {
    /// A proxy to `upstream` (`host:port`).
    pub fn new(upstream: &str, scenario: &Scenario) -> Arc<Self> {
        let p = Arc::new(Self {
            upstream: upstream
                .trim_start_matches("http://")
                .trim_end_matches('/')
                .to_string(),
            faults: std::sync::RwLock::new(Arc::new(Faults {
                http: HttpFaults::default(),
                connection: ConnectionFaults::default(),
                injector: Injector::new(0),
            })),
            counters: ProxyCounters::default(),
        });
        p.set_scenario(scenario);
        p
    }

    /// Puts `scenario` in force for new connections and requests (its counts start at 0).
    pub fn set_scenario(&self, scenario: &Scenario) {
        let f = Arc::new(Faults {
            http: scenario.http.clone(),
            connection: scenario.connection.clone(),
            injector: Injector::new(scenario.seed),
        });
        match self.faults.write() {
            Ok(mut g) => *g = f,
            Err(e) => *e.into_inner() = f,
        }
    }

    fn faults(&self) -> Arc<Faults> {
        self.faults
            .read()
            .map(|g| g.clone())
            .unwrap_or_else(|e| e.into_inner().clone())
    }

    /// Injections under the current scenario, by fault name.
    pub fn injected(&self) -> Vec<(&'static str, u64)> {
        let f = self.faults();
        [
            ("http.status_502", slot::S502),
            ("http.status_503", slot::S503),
            ("http.delay", slot::DELAY),
            ("connection.reset", slot::RESET),
            ("connection.close", slot::CLOSE),
            ("connection.stall", slot::STALL),
            ("http.reset", slot::HTTP_RESET),
        ]
        .into_iter()
        .map(|(n, s)| (n, f.injector.count(s)))
        .collect()
    }

    /// Counters and injections as JSON (the admin port's `GET /stats`).
    pub fn stats_json(&self) -> serde_json::Value {
        let injected: serde_json::Map<String, serde_json::Value> = self
            .injected()
            .into_iter()
            .map(|(k, n)| (k.to_string(), n.into()))
            .collect();
        serde_json::json!({
            "upstream": self.upstream,
            "connections": self.counters.connections.load(Ordering::Relaxed),
            "requests": self.counters.requests.load(Ordering::Relaxed),
            "injected": injected,
        })
    }

    /// Accepts connections until `shutdown` resolves.
    pub async fn serve(
        self: Arc<Self>,
        listener: TcpListener,
        shutdown: impl std::future::Future<Output = ()>,
    ) -> io::Result<()> {
        tokio::pin!(shutdown);
        loop {
            let (stream, peer) = tokio::select! {
                r = listener.accept() => r?,
                _ = &mut shutdown => return Ok(()),
            };
            self.counters.connections.fetch_add(1, Ordering::Relaxed);
            let proxy = self.clone();
            tokio::spawn(async move {
                if let Err(e) = proxy.connection(stream).await {
                    tracing::debug!(%peer, error = %e, "proxied connection ended");
                }
            });
        }
    }

    fn connection_fault(&self) -> Wrapped {
        let f = self.faults();
        let (c, i) = (&f.connection, &f.injector);
        let mut w = Wrapped::default();
        if i.fires(slot::RESET, &c.reset) {
            w.end = Some((c.reset.after_bytes, End::Reset));
        } else if i.fires(slot::CLOSE, &c.close) {
            w.end = Some((c.close.after_bytes, End::Close));
        }
        if i.fires(slot::STALL, &c.stall) {
            w.stall = Some(Box::pin(tokio::time::sleep(c.stall.duration)));
        }
        w
    }

    async fn connection(
        self: Arc<Self>,
        stream: TcpStream,
    ) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        let _ = stream.set_nodelay(true);
        let mut faulty = self.connection_fault();
        if faulty.end.is_some_and(|(_, e)| e == End::Reset) {
            // Closing a socket with a zero linger sends RST instead of FIN.
            socket2::SockRef::from(&stream).set_linger(Some(Duration::ZERO))?;
        }
        // A second handle on the socket, for breaking the connection from a request.
        let std = stream.into_std()?;
        let breaker = Arc::new(std.try_clone()?);
        let stream = TcpStream::from_std(std)?;
        faulty.inner = Some(stream);
        let upstream = match TcpStream::connect(&self.upstream).await {
            Ok(up) => {
                let _ = up.set_nodelay(true);
                let (sender, conn) =
                    hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(up))
                        .await?;
                tokio::spawn(async move {
                    if let Err(e) = conn.await {
                        tracing::debug!(error = %e, "upstream connection ended");
                    }
                });
                Some(sender)
            }
            Err(e) => {
                tracing::warn!(upstream = %self.upstream, error = %e, "upstream connect failed: answering 502");
                None
            }
        };
        let proxy = self.clone();
        let service = hyper::service::service_fn(move |req: Request<Incoming>| {
            let (proxy, upstream, breaker) = (proxy.clone(), upstream.clone(), breaker.clone());
            async move { Ok::<_, hyper::Error>(proxy.request(req, upstream, &breaker).await) }
        });
        hyper::server::conn::http2::Builder::new(TokioExecutor::new())
            .serve_connection(TokioIo::new(faulty), service)
            .await?;
        Ok(())
    }

    async fn request(
        &self,
        req: Request<Incoming>,
        upstream: Option<hyper::client::conn::http2::SendRequest<Incoming>>,
        connection: &std::net::TcpStream,
    ) -> Response<Body> {
        self.counters.requests.fetch_add(1, Ordering::Relaxed);
        let f = self.faults();
        let (h, i) = (&f.http, &f.injector);
        if i.fires(slot::HTTP_RESET, &h.reset) {
            // Zero linger: the close is an RST; shutting down now breaks every stream on it.
            let _ = socket2::SockRef::from(connection).set_linger(Some(Duration::ZERO));
            let _ = connection.shutdown(std::net::Shutdown::Both);
            return status(StatusCode::BAD_GATEWAY, "chaos: connection reset");
        }
        if i.fires(slot::S502, &h.status_502) {
            return status(StatusCode::BAD_GATEWAY, "chaos: injected 502");
        }
        if i.fires(slot::S503, &h.status_503) {
            return status(StatusCode::SERVICE_UNAVAILABLE, "chaos: injected 503");
        }
        if i.fires(slot::DELAY, &h.delay) {
            tokio::time::sleep(h.delay.duration).await;
        }
        let Some(mut sender) = upstream else {
            return status(StatusCode::BAD_GATEWAY, "upstream connect error");
        };
        match sender.send_request(req).await {
            Ok(resp) => resp.map(BodyExt::boxed),
            Err(e) => {
                tracing::debug!(error = %e, "upstream request failed: answering 502");
                status(StatusCode::BAD_GATEWAY, "upstream request failed")
            }
        }
    }
}

fn status(code: StatusCode, text: &'static str) -> Response<Body> {
    let mut r = Response::new(
        Full::new(Bytes::from_static(text.as_bytes()))
            .map_err(|never| match never {})
            .boxed(),
    );
    *r.status_mut() = code;
    r.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("text/plain"),
    );
    r
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum End {
    Reset,
    Close,
}

/// The accepted connection with its faults: it ends (reset or closed) once `end.0` bytes
/// went through either way, and its first read waits for `stall`.
#[derive(Default)]
struct Wrapped {
    inner: Option<TcpStream>,
    end: Option<(u64, End)>,
    passed: u64,
    stall: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl Wrapped {
    fn ended(&self) -> Option<End> {
        self.end
            .and_then(|(after, e)| (self.passed >= after).then_some(e))
    }

    fn stream(&mut self) -> io::Result<Pin<&mut TcpStream>> {
        self.inner
            .as_mut()
            .map(Pin::new)
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotConnected, "no stream"))
    }
}

fn ended_error(e: End) -> io::Error {
    match e {
        End::Reset => io::Error::new(io::ErrorKind::ConnectionReset, "chaos: connection reset"),
        End::Close => io::Error::new(io::ErrorKind::BrokenPipe, "chaos: connection closed"),
    }
}

impl AsyncRead for Wrapped {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if let Some(s) = self.stall.as_mut() {
            if s.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            self.stall = None;
        }
        match self.ended() {
            Some(End::Close) => return Poll::Ready(Ok(())),
            Some(e) => return Poll::Ready(Err(ended_error(e))),
            None => {}
        }
        let before = buf.filled().len();
        let r = self.stream()?.poll_read(cx, buf);
        let n = buf.filled().len() - before;
        self.passed += n as u64;
        r
    }
}

use std::future::Future as _;

impl AsyncWrite for Wrapped {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        if let Some(e) = self.ended() {
            return Poll::Ready(Err(ended_error(e)));
        }
        // Let through at most what is left before the end, so it lands mid-stream.
        let cap = match self.end {
            Some((after, _)) => data.len().min((after - self.passed).max(1) as usize),
            None => data.len(),
        };
        let r = self.stream()?.poll_write(cx, &data[..cap]);
        if let Poll::Ready(Ok(n)) = r {
            self.passed += n as u64;
        }
        r
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.stream()?.poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.stream()?.poll_shutdown(cx)
    }
}

/// Serves the proxy's admin endpoints on `listener` (HTTP/1.1): `GET /stats` (counters and
/// injections, JSON) and `PUT /scenario` (a scenario's YAML: it takes effect at once, with its
/// counts at 0; an empty body turns every fault off).
pub async fn serve_admin(proxy: Arc<Proxy>, listener: TcpListener) -> io::Result<()> {
    loop {
        let (stream, _) = listener.accept().await?;
        let proxy = proxy.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req: Request<Incoming>| {
                let proxy = proxy.clone();
                async move { Ok::<_, hyper::Error>(admin(&proxy, req).await) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

async fn admin(proxy: &Proxy, req: Request<Incoming>) -> Response<Body> {
    let json = |code: StatusCode, v: serde_json::Value| {
        let mut r = Response::new(
            Full::new(Bytes::from(v.to_string()))
                .map_err(|never| match never {})
                .boxed(),
        );
        *r.status_mut() = code;
        r.headers_mut().insert(
            hyper::header::CONTENT_TYPE,
            hyper::header::HeaderValue::from_static("application/json"),
        );
        r
    };
    match (req.method().as_str(), req.uri().path()) {
        ("GET", "/stats") => json(StatusCode::OK, proxy.stats_json()),
        ("PUT", "/scenario") => {
            let body = match req.into_body().collect().await {
                Ok(b) => b.to_bytes(),
                Err(e) => {
                    return json(
                        StatusCode::BAD_REQUEST,
                        serde_json::json!({"error": e.to_string()}),
                    )
                }
            };
            let text = String::from_utf8_lossy(&body);
            let scenario = if text.trim().is_empty() {
                Ok(Scenario::default())
            } else {
                Scenario::from_yaml(&text, "PUT /scenario")
            };
            match scenario {
                Ok(s) => {
                    proxy.set_scenario(&s);
                    tracing::info!("scenario replaced");
                    json(StatusCode::OK, serde_json::json!({"ok": true}))
                }
                Err(e) => json(
                    StatusCode::BAD_REQUEST,
                    serde_json::json!({"error": e.to_string()}),
                ),
            }
        }
        _ => json(
            StatusCode::NOT_FOUND,
            serde_json::json!({"error": "GET /stats or PUT /scenario"}),
        ),
    }
}
