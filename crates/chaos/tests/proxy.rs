//! The proxy between a real HTTP/2 client and a real HTTP/2 server on loopback.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use std::sync::Arc;
use tandem_chaos::{Proxy, Scenario};
use tokio::net::{TcpListener, TcpStream};

/// An HTTP/2 server answering every request with `upstream says hi`.
async fn upstream() -> String {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        loop {
            let (s, _) = l.accept().await.unwrap();
            tokio::spawn(async move {
                let svc =
                    hyper::service::service_fn(|_req: Request<hyper::body::Incoming>| async {
                        Ok::<_, hyper::Error>(Response::new(Full::new(Bytes::from_static(
                            b"upstream says hi",
                        ))))
                    });
                let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(s), svc)
                    .await;
            });
        }
    });
    addr
}

async fn proxy(scenario: &str) -> (Arc<Proxy>, String) {
    let up = upstream().await;
    let p = Proxy::new(&up, &Scenario::from_yaml(scenario, "test").unwrap());
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    tokio::spawn(p.clone().serve(l, std::future::pending()));
    (p, addr)
}

/// One request on a fresh HTTP/2 connection: (status, body), or the error text.
async fn get(addr: &str) -> Result<(u16, String), String> {
    let s = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
    let (mut send, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(s))
            .await
            .map_err(|e| e.to_string())?;
    tokio::spawn(conn);
    let req = Request::post(format!("http://{addr}/tandem.v1.Worker/Stats"))
        .body(Full::new(Bytes::from_static(b"ping")))
        .unwrap();
    let resp = send.send_request(req).await.map_err(|e| e.to_string())?;
    let status = resp.status().as_u16();
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    Ok((status, String::from_utf8_lossy(&body).into()))
}

#[tokio::test]
async fn requests_pass_until_the_scenario_answers_502_for_exactly_its_limit() {
    let (p, addr) = proxy("seed: 1\nhttp: {status_502: {probability: 1, limit: 2}}\n").await;
    let mut answers = Vec::new();
    for _ in 0..4 {
        answers.push(get(&addr).await.unwrap());
    }
    let statuses: Vec<u16> = answers.iter().map(|a| a.0).collect();
    assert_eq!(statuses, [502, 502, 200, 200]);
    assert_eq!(answers[2].1, "upstream says hi");
    assert!(p.injected().contains(&("http.status_502", 2)));
    assert_eq!(p.stats_json()["requests"], 4);
}

#[tokio::test]
async fn a_reset_connection_fails_its_requests_and_the_next_connection_is_clean() {
    let (p, addr) =
        proxy("connection: {reset: {probability: 1, limit: 1, after_bytes: 0}}\n").await;
    let first = get(&addr).await;
    assert!(first.is_err(), "the reset connection answered: {first:?}");
    assert_eq!(get(&addr).await.unwrap().0, 200);
    assert!(p.injected().contains(&("connection.reset", 1)));
}

#[tokio::test]
async fn the_admin_port_replaces_the_scenario_and_reports_counts() {
    let (p, addr) = proxy("").await;
    let admin = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let admin_url = format!("http://{}", admin.local_addr().unwrap());
    tokio::spawn(tandem_chaos::serve_admin(p.clone(), admin));
    assert_eq!(get(&addr).await.unwrap().0, 200);
    let c = reqwest::Client::new();
    let put = |body: &'static str| c.put(format!("{admin_url}/scenario")).body(body).send();
    assert_eq!(
        put("http: {status_503: 1}\n")
            .await
            .unwrap()
            .status()
            .as_u16(),
        200
    );
    assert_eq!(get(&addr).await.unwrap().0, 503);
    let bad = put("http: {status_503: 2}\n").await.unwrap();
    assert_eq!(bad.status().as_u16(), 400, "a probability of 2 is refused");
    assert_eq!(
        get(&addr).await.unwrap().0,
        503,
        "the refused scenario changed nothing"
    );
    let stats: serde_json::Value = c
        .get(format!("{admin_url}/stats"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(stats["injected"]["http.status_503"], 2, "{stats}");
    assert_eq!(put("").await.unwrap().status().as_u16(), 200);
    assert_eq!(
        get(&addr).await.unwrap().0,
        200,
        "an empty scenario turns faults off"
    );
}

#[tokio::test]
async fn garbage_ends_only_its_own_connection() {
    use tokio::io::AsyncWriteExt;
    let (_p, addr) = proxy("").await;
    let mut s = TcpStream::connect(&addr).await.unwrap();
    s.write_all(b"this is not HTTP/2 at all\r\n\r\n")
        .await
        .unwrap();
    drop(s);
    assert_eq!(get(&addr).await.unwrap().0, 200);
}

#[tokio::test]
async fn a_request_level_reset_breaks_its_connection_for_every_stream_on_it() {
    let (p, addr) = proxy("http: {reset: {probability: 1, limit: 1}}\n").await;
    let first = get(&addr).await;
    assert!(
        !matches!(first, Ok((200, _))),
        "the reset request was answered: {first:?}"
    );
    assert!(p.injected().contains(&("http.reset", 1)));
    assert_eq!(
        get(&addr).await.unwrap().0,
        200,
        "the next connection is clean"
    );
}
