//! Two workers in one thread talking over loopback through the real UCX library.

// Registering memory for peers to write is `unsafe` (the caller keeps it alive).
#![allow(unsafe_code)]

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use tandem_ucx::{
    CloseMode, Config, Context, Endpoint, Listener, MemoryRegion, RecvOp, RemoteKey, Worker,
};

fn context() -> Context {
    let mut config = Config::read().expect("read UCX config");
    if std::env::var_os("UCX_TLS").is_none() {
        config.set("TLS", "tcp,sm,self").expect("set TLS");
    }
    if std::env::var_os("UCX_NET_DEVICES").is_none() {
        config.set("NET_DEVICES", "lo").expect("set NET_DEVICES");
    }
    Context::new(&config).expect("ucp_init")
}

/// Progresses both workers until `done` or the deadline.
fn drive(a: &Worker, b: &Worker, timeout: Duration, mut done: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        a.progress_all();
        b.progress_all();
        if done() {
            return true;
        }
    }
    false
}

#[test]
fn tagged_messages_of_unknown_size_round_trip() {
    let server_ctx = context();
    let server = Worker::new(&server_ctx).expect("server worker");
    let any: SocketAddr = "127.0.0.1:0".parse().expect("literal");
    let listener = Listener::bind(&server, any).expect("listen");
    let addr = listener.local_addr().expect("local addr");
    assert_ne!(addr.port(), 0);

    let client_ctx = context();
    let client = Worker::new(&client_ctx).expect("client worker");
    let ep = Endpoint::connect(&client, addr).expect("connect");

    let big: Vec<u8> = (0..4 << 20)
        .map(|i: u32| (i.wrapping_mul(31) >> 3) as u8)
        .collect();
    let big_send = ep.tag_send(7, big.clone()).expect("send big");
    let small_send = ep.tag_send(8, b"hello".to_vec()).expect("send small");

    let mut server_eps = Vec::new();
    let mut recvs: Vec<RecvOp> = Vec::new();
    let ok = drive(&client, &server, Duration::from_secs(20), || {
        while let Some(req) = listener.next_conn_request() {
            server_eps.push(Endpoint::accept(req).expect("accept"));
        }
        while let Some(op) = server.tag_probe_recv(0, 0).expect("probe") {
            recvs.push(op);
        }
        recvs.len() == 2 && recvs.iter().all(|r| r.result().is_some())
    });
    assert!(ok, "messages did not arrive");
    assert!(matches!(big_send.result(), Some(Ok(()))));
    assert!(matches!(small_send.result(), Some(Ok(()))));
    let mut got: Vec<(u64, Vec<u8>)> = recvs
        .into_iter()
        .map(|r| (r.tag(), r.into_data().ok().expect("receive succeeded")))
        .collect();
    got.sort_by_key(|(t, _)| *t);
    assert_eq!(got[0].0, 7);
    assert!(got[0].1 == big, "4 MiB payload corrupted");
    assert_eq!(got[1], (8, b"hello".to_vec()));

    let closing = ep.close(CloseMode::Flush);
    assert!(drive(&client, &server, Duration::from_secs(5), || closing
        .is_done()));
    drop(server_eps);
}

#[test]
fn connecting_to_a_closed_port_fails_instead_of_hanging() {
    // Bind and drop a listener to find a port nobody listens on.
    let ctx = context();
    let worker = Worker::new(&ctx).expect("worker");
    let addr = {
        let l = Listener::bind(&worker, "127.0.0.1:0".parse().expect("literal")).expect("bind");
        l.local_addr().expect("addr")
    };
    let ep = Endpoint::connect(&worker, addr).expect("connect starts");
    let send = ep.tag_send(1, vec![1, 2, 3]).expect("send queued");
    let deadline = Instant::now() + Duration::from_secs(20);
    let failed = worker.progress_until(deadline, || send.result().is_some() && ep.is_failed());
    assert!(failed, "no failure reported");
    let err = send.result().and_then(Result::err).expect("send failed");
    assert!(err.status().is_some(), "{err}");
    eprintln!(
        "closed port: send error = {err}; endpoint = {:?}",
        ep.failure()
    );
}

#[test]
fn worker_address_endpoints_carry_tags() {
    // No listener: the client connects with the server worker's address alone. (With the
    // peer-failure error mode every endpoint here uses, UCX 1.13 finds no shared-memory
    // transport that supports it: `UCX_TLS=sm,self` is "Destination is unreachable".)
    let server_ctx = context();
    let server = Worker::new(&server_ctx).expect("server worker");
    let address = server.address().expect("worker address");
    assert!(!address.is_empty());

    let client_ctx = context();
    let client = Worker::new(&client_ctx).expect("client worker");
    let ep = Endpoint::connect_to_worker(&client, &address).expect("connect by address");
    let payload: Vec<u8> = (0..(8 << 20) + 3).map(|i: u32| (i % 251) as u8).collect();
    let send = ep.tag_send(42, payload.clone()).expect("send");

    let mut recv: Option<RecvOp> = None;
    let ok = drive(&client, &server, Duration::from_secs(20), || {
        if recv.is_none() {
            recv = server.tag_probe_recv(0, 0).expect("probe");
        }
        recv.as_ref().is_some_and(|r| r.result().is_some()) && send.result().is_some()
    });
    assert!(ok, "message did not arrive");
    assert!(matches!(send.result(), Some(Ok(()))));
    let recv = recv.expect("received");
    assert_eq!(recv.tag(), 42);
    assert!(recv.into_data().ok().expect("receive succeeded") == payload);

    let closing = ep.close(CloseMode::Flush);
    assert!(drive(&client, &server, Duration::from_secs(5), || closing
        .is_done()));
}

#[test]
fn an_empty_worker_address_is_refused() {
    let ctx = context();
    let worker = Worker::new(&ctx).expect("worker");
    assert!(Endpoint::connect_to_worker(&worker, &[]).is_err());
}

/// A client endpoint to a server worker, with the wire-up done on both sides (one message
/// each way's worth: what one-sided operations need first); the server's accepted endpoints.
fn wired_up(
    client: &Worker,
    server: &Worker,
    listener: &Listener,
    addr: SocketAddr,
) -> (Endpoint, Vec<Endpoint>) {
    let ep = Endpoint::connect(client, addr).expect("connect");
    let mut server_eps = Vec::new();
    let hello = ep.tag_send(1, b"hi".to_vec()).expect("send");
    let mut recv = None;
    assert!(drive(client, server, Duration::from_secs(20), || {
        while let Some(req) = listener.next_conn_request() {
            server_eps.push(Endpoint::accept(req).expect("accept"));
        }
        if recv.is_none() {
            recv = server.tag_probe_recv(0, 0).expect("probe");
        }
        hello.result().is_some() && recv.as_ref().is_some_and(|r: &RecvOp| r.result().is_some())
    }));
    (ep, server_eps)
}

#[test]
fn puts_land_in_the_peers_registered_memory_once_flushed() {
    let server_ctx = context();
    let server = Worker::new(&server_ctx).expect("server worker");
    let any: SocketAddr = "127.0.0.1:0".parse().expect("literal");
    let listener = Listener::bind(&server, any).expect("listen");
    let addr = listener.local_addr().expect("local addr");
    // 3 MiB the peer may write, registered; only the middle MiB is written below.
    let mut target = vec![0u8; 3 << 20];
    // SAFETY: `target` outlives `region` (dropped first at the end of the test).
    let region = unsafe { MemoryRegion::map(&server_ctx, target.as_mut_ptr(), target.len()) }
        .expect("ucp_mem_map");
    assert_eq!(region.len(), 3 << 20);
    let packed = region.packed_key().expect("rkey");

    let client_ctx = context();
    let client = Worker::new(&client_ctx).expect("client worker");
    let (ep, server_eps) = wired_up(&client, &server, &listener, addr);
    let key = RemoteKey::unpack(&ep, &packed).expect("unpack rkey");
    let data: Vec<u8> = (0..1 << 20).map(|i: u32| (i % 241) as u8 + 1).collect();
    let put = ep
        .put(data.clone(), region.address() + (1 << 20), &key)
        .expect("put");
    let flush = ep.flush().expect("flush");
    assert!(
        drive(&client, &server, Duration::from_secs(20), || flush
            .result()
            .is_some()),
        "flush did not complete"
    );
    assert!(matches!(put.result(), Some(Ok(()))));
    assert!(matches!(flush.result(), Some(Ok(()))));
    drop(region);
    assert!(
        target[..1 << 20].iter().all(|&b| b == 0),
        "before the put's range untouched"
    );
    assert!(
        target[1 << 20..2 << 20] == data[..],
        "the put's bytes landed"
    );
    assert!(
        target[2 << 20..].iter().all(|&b| b == 0),
        "after the put's range untouched"
    );
    drop(key);
    let closing = ep.close(CloseMode::Flush);
    assert!(drive(&client, &server, Duration::from_secs(5), || closing
        .is_done()));
    drop(server_eps);
}

/// The fence a remote writer claims a landing slot with: a compare-and-swap that succeeds
/// only on the expected word, reports the old value either way, and leaves the neighbours be.
#[test]
fn a_compare_and_swap_changes_the_peers_word_only_when_it_holds_the_expected_value() {
    let server_ctx = context();
    let server = Worker::new(&server_ctx).expect("server worker");
    let any: SocketAddr = "127.0.0.1:0".parse().expect("literal");
    let listener = Listener::bind(&server, any).expect("listen");
    let addr = listener.local_addr().expect("local addr");
    let mut words = vec![7u64, 0x1234_5678_9abc_def1, 9u64];
    // SAFETY: `words` outlives `region` (dropped first below).
    let region =
        unsafe { MemoryRegion::map(&server_ctx, words.as_mut_ptr().cast(), words.len() * 8) }
            .expect("ucp_mem_map");
    let packed = region.packed_key().expect("rkey");
    let client_ctx = context();
    let client = Worker::new(&client_ctx).expect("client worker");
    let (ep, server_eps) = wired_up(&client, &server, &listener, addr);
    let key = RemoteKey::unpack(&ep, &packed).expect("unpack rkey");
    let middle = region.address() + 8;
    let token = 0x1234_5678_9abc_def1u64;
    let run = |compare: u64, swap: u64| {
        let op = ep.compare_swap(middle, &key, compare, swap).expect("cswap");
        assert!(
            drive(&client, &server, Duration::from_secs(20), || op
                .result()
                .is_some()),
            "the compare-and-swap did not complete"
        );
        op.result().expect("done").expect("no error")
    };
    assert_eq!(run(token, !token), token, "the claim sees the token");
    assert_eq!(
        run(token, 5),
        !token,
        "a second claim fails and sees the claimed word"
    );
    let flush = ep.flush().expect("flush");
    assert!(drive(&client, &server, Duration::from_secs(20), || flush
        .result()
        .is_some()));
    drop(region);
    assert_eq!(words, [7, !token, 9], "only the middle word changed, once");
    drop(key);
    let closing = ep.close(CloseMode::Flush);
    assert!(drive(&client, &server, Duration::from_secs(5), || closing
        .is_done()));
    drop(server_eps);
}
