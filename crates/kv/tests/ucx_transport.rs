//! Real UCX on loopback: a receiver and a sender in one process.
//!
//! The tests run under whatever `UCX_TLS` the environment sets (the crate default when
//! unset); `tcp_only_and_default_transports_pass_in_child_processes` re-runs them in child
//! processes with `UCX_TLS=tcp` and with the default, since a test cannot safely change the
//! environment of its own process.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use tandem_core::ErrorClass;
use tandem_kv::{KvMessage, UcxReceiver, UcxSender};
use tokio::sync::mpsc::UnboundedReceiver;
use tokio::time::timeout;

const SEND_TIMEOUT: Duration = Duration::from_secs(10);
/// Outer bound on anything a test awaits, so a regression fails instead of hanging CI.
const TEST_BOUND: Duration = Duration::from_secs(30);

fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

async fn next(incoming: &mut UnboundedReceiver<KvMessage>) -> KvMessage {
    timeout(TEST_BOUND, incoming.recv())
        .await
        .expect("message arrived in time")
        .expect("receiver still running")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_and_small_messages_arrive_intact() {
    let mut receiver = UcxReceiver::listen("127.0.0.1:0").expect("listen");
    let mut incoming = receiver.take_incoming().expect("first take");
    assert!(
        receiver.take_incoming().is_none(),
        "incoming can be taken once"
    );
    let address = receiver.address();
    assert!(
        !address.ends_with(":0"),
        "a real port was picked: {address}"
    );
    let sender = UcxSender::new().expect("sender");

    let big = pattern(4 << 20, 42);
    timeout(
        TEST_BOUND,
        sender.send(&address, 1_000_000, big.clone(), SEND_TIMEOUT),
    )
    .await
    .expect("bounded")
    .expect("4 MiB send");
    let got = next(&mut incoming).await;
    assert_eq!(got.tag, 1_000_000);
    assert_eq!(got.payload.len(), big.len());
    assert!(got.payload == big, "4 MiB payload corrupted");

    // 100 small messages in flight at once, from clones of one sender.
    let mut tasks = tokio::task::JoinSet::new();
    for tag in 0..100u64 {
        let sender = sender.clone();
        let address = address.clone();
        let payload = pattern(1 + (tag as usize * 37) % 3000, tag);
        tasks.spawn(async move { sender.send(&address, tag, payload, SEND_TIMEOUT).await });
    }
    while let Some(done) = timeout(TEST_BOUND, tasks.join_next())
        .await
        .expect("bounded")
    {
        done.expect("task").expect("small send");
    }
    let mut by_tag = BTreeMap::new();
    for _ in 0..100 {
        let msg = next(&mut incoming).await;
        assert!(
            by_tag.insert(msg.tag, msg.payload).is_none(),
            "duplicate tag"
        );
    }
    assert_eq!(by_tag.len(), 100);
    for (tag, payload) in &by_tag {
        assert_eq!(
            payload,
            &pattern(1 + (*tag as usize * 37) % 3000, *tag),
            "tag {tag}"
        );
    }
    let small_bytes: usize = by_tag.values().map(Vec::len).sum();
    let total = (big.len() + small_bytes) as u64;
    assert_eq!(sender.bytes_sent(), total);
    assert_eq!(receiver.bytes_received(), total);
    assert!(incoming.try_recv().is_err(), "no extra messages");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sequential_sends_arrive_in_order() {
    let mut receiver = UcxReceiver::listen("127.0.0.1:0").expect("listen");
    let mut incoming = receiver.take_incoming().expect("incoming");
    let sender = UcxSender::new().expect("sender");
    // Alternate large and small so eager and rendezvous protocols interleave.
    for tag in 0..8u64 {
        let len = if tag % 2 == 0 { 1 << 20 } else { 16 };
        sender
            .send(&receiver.address(), tag, pattern(len, tag), SEND_TIMEOUT)
            .await
            .expect("send");
    }
    for tag in 0..8u64 {
        let msg = next(&mut incoming).await;
        assert_eq!(msg.tag, tag, "completed sends are delivered in order");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sending_to_a_closed_port_fails_fast() {
    let address = {
        let receiver = UcxReceiver::listen("127.0.0.1:0").expect("listen");
        receiver.address()
    }; // dropped: nobody listens there any more
    let sender = UcxSender::new().expect("sender");
    let started = Instant::now();
    let result = timeout(
        TEST_BOUND,
        sender.send(&address, 7, vec![1; 1024], SEND_TIMEOUT),
    )
    .await
    .expect("the send resolved instead of hanging");
    let err = result.expect_err("nobody is listening");
    assert_eq!(err.class(), ErrorClass::Unavailable, "{err:?}");
    assert!(
        started.elapsed() < SEND_TIMEOUT,
        "refusal is detected, not timed out"
    );
    assert_eq!(sender.bytes_sent(), 0);

    let bad = sender
        .send("not an address", 1, vec![1], SEND_TIMEOUT)
        .await
        .expect_err("invalid address");
    assert_eq!(bad.class(), ErrorClass::Unavailable);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_never_answers_times_out() {
    // A plain TCP socket: the kernel accepts the connection, but nothing ever answers
    // UCX's connection request, so the send stalls until its deadline.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let address = silent.local_addr().expect("addr").to_string();
    let sender = UcxSender::new().expect("sender");
    let deadline = Duration::from_millis(300);
    let started = Instant::now();
    let err = timeout(
        TEST_BOUND,
        sender.send(&address, 1, vec![0; 4096], deadline),
    )
    .await
    .expect("the send resolved instead of hanging")
    .expect_err("nobody answers");
    assert!(matches!(err, tandem_kv::Error::Timeout { .. }), "{err:?}");
    assert_eq!(err.class(), ErrorClass::TransferFailed);
    assert!(started.elapsed() >= deadline);

    // The stalled endpoint was evicted; the sender still works for others.
    let mut receiver = UcxReceiver::listen("127.0.0.1:0").expect("listen");
    let mut incoming = receiver.take_incoming().expect("incoming");
    sender
        .send(&receiver.address(), 5, vec![5; 10], SEND_TIMEOUT)
        .await
        .expect("healthy peer");
    assert_eq!(next(&mut incoming).await.tag, 5);
    drop(silent);
}

/// Sends until one succeeds; every failure on the way must be classified as retryable.
async fn send_with_retries(sender: &UcxSender, address: &str, tag: u64, payload: &[u8]) -> usize {
    let mut attempts = 0;
    loop {
        attempts += 1;
        let result = timeout(
            TEST_BOUND,
            sender.send(address, tag, payload.to_vec(), SEND_TIMEOUT),
        )
        .await
        .expect("bounded");
        match result {
            Ok(()) => return attempts,
            Err(err) => {
                assert!(err.class().is_retryable(), "{err:?}");
                assert!(attempts < 3, "sender did not recover: {err:?}");
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sender_recovers_after_the_receiver_restarts() {
    let sender = UcxSender::new().expect("sender");
    let first = UcxReceiver::listen("127.0.0.1:0").expect("listen");
    let old_address = first.address();
    sender
        .send(&old_address, 1, pattern(4096, 1), SEND_TIMEOUT)
        .await
        .expect("first receiver");
    drop(first);

    // The cached endpoint is dead. Sending there again must fail promptly (whether on the
    // stale endpoint or on a fresh connection that is refused), never hang.
    let started = Instant::now();
    for _ in 0..2 {
        let err = timeout(
            TEST_BOUND,
            sender.send(&old_address, 3, vec![3; 64], SEND_TIMEOUT),
        )
        .await
        .expect("bounded")
        .expect_err("nobody listens there");
        assert!(err.class().is_retryable(), "{err:?}");
    }
    assert!(
        started.elapsed() < SEND_TIMEOUT,
        "failures were detected, not timed out"
    );

    // A restarted decode worker. Rebinding the very same port needs SO_REUSEADDR, which UCX
    // 1.13 only takes from the environment (`UCX_TCP_CM_REUSEADDR=y`, which the child runs
    // below set); otherwise the new receiver gets a new port.
    let rebind_same_port = std::env::var("UCX_TCP_CM_REUSEADDR").is_ok_and(|v| v == "y");
    let bind = if rebind_same_port {
        old_address.clone()
    } else {
        "127.0.0.1:0".to_owned()
    };
    let mut second = UcxReceiver::listen(&bind).expect("restarted receiver");
    let mut incoming = second.take_incoming().expect("incoming");
    let address = second.address();
    if rebind_same_port {
        assert_eq!(address, old_address);
    }
    send_with_retries(&sender, &address, 2, &pattern(4096, 2)).await;
    let msg = next(&mut incoming).await;
    assert_eq!((msg.tag, msg.payload), (2, pattern(4096, 2)));
    assert_eq!(second.bytes_received(), 4096);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_with_sends_in_flight_does_not_hang() {
    let receiver = UcxReceiver::listen("127.0.0.1:0").expect("listen");
    let sender = UcxSender::new().expect("sender");
    let address = receiver.address();
    let in_flight = {
        let sender = sender.clone();
        tokio::spawn(async move {
            sender
                .send(&address, 9, pattern(8 << 20, 9), SEND_TIMEOUT)
                .await
        })
    };
    let started = Instant::now();
    drop(receiver);
    let result = timeout(TEST_BOUND, in_flight)
        .await
        .expect("send resolved")
        .expect("task");
    if let Err(err) = result {
        assert!(err.class().is_retryable(), "{err:?}");
    }
    drop(sender);
    assert!(started.elapsed() < TEST_BOUND);
}

const ALL_TESTS: [&str; 6] = [
    "large_and_small_messages_arrive_intact",
    "sequential_sends_arrive_in_order",
    "sending_to_a_closed_port_fails_fast",
    "sender_recovers_after_the_receiver_restarts",
    "dropping_with_sends_in_flight_does_not_hang",
    "a_peer_that_never_answers_times_out",
];

/// Runs the tests above in a child process with `env` applied; panics unless all pass.
fn run_child(env: &[(&str, Option<&str>)]) {
    let exe = std::env::current_exe().expect("test binary path");
    let mut child = std::process::Command::new(exe);
    child
        .args(["--exact", "--test-threads=1"])
        .args(ALL_TESTS)
        .env("TANDEM_KV_TEST_CHILD", "1");
    for (name, value) in env {
        match value {
            Some(v) => child.env(name, v),
            None => child.env_remove(name),
        };
    }
    let output = child.output().expect("run the test binary again");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "child run with {env:?} failed:\n{stdout}\n{stderr}"
    );
    let expected = format!("{} passed", ALL_TESTS.len());
    assert!(stdout.contains(&expected), "expected {expected}:\n{stdout}");
}

/// A test cannot safely change its own process's environment, so the transport variants run
/// in child processes: TCP only, and the crate's default transports, both with
/// `UCX_TCP_CM_REUSEADDR=y` so the restart test rebinds the same port.
/// The cross-host landing path: a sender that does not map the receiver's arena claims a
/// slot by a remote compare-and-swap of its fence, puts the handoff into it, flushes, and
/// sends only the completion record; the bytes are in the slot when the record arrives. A
/// write through the descriptor of a slot its reservation let go of — even once the same
/// range belongs to another reservation — claims nothing and writes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_sided_writes_land_in_a_held_slot_and_never_in_a_released_one() {
    use tandem_kv::landing::LandingArena;
    let arena = LandingArena::with_quarantine(8 << 20, Duration::ZERO).expect("arena");
    let mut receiver =
        UcxReceiver::listen_with_arena("127.0.0.1:0", Some(arena.clone())).expect("listen");
    let mut incoming = receiver.take_incoming().expect("incoming");
    let address = receiver.address();
    let sender = UcxSender::new().expect("sender");

    let mut slot = arena.slot(4 << 20).expect("slot");
    let to = slot.landing();
    assert!(to.remote.is_some(), "the arena was registered: {to:?}");
    let payload = pattern(3 << 20, 9);
    timeout(
        TEST_BOUND,
        sender.put_landing(
            &address,
            77,
            &to,
            payload.clone(),
            b"landed".to_vec(),
            SEND_TIMEOUT,
        ),
    )
    .await
    .expect("bounded")
    .expect("one-sided write");
    let record = next(&mut incoming).await;
    assert_eq!((record.tag, &record.payload[..]), (77, &b"landed"[..]));
    assert!(
        slot.landed(payload.len()).expect("fits") == &payload[..],
        "the bytes landed"
    );
    // A second write through the same descriptor: the slot was claimed already.
    let again = sender
        .put_landing(
            &address,
            78,
            &to,
            pattern(100, 1),
            b"x".to_vec(),
            SEND_TIMEOUT,
        )
        .await;
    assert!(
        matches!(again, Err(tandem_kv::Error::SlotReleased { .. })),
        "{again:?}"
    );

    // Released, then the same range handed to another reservation.
    let stale = {
        let s = arena.slot(4 << 20).expect("another slot");
        let d = s.landing();
        drop(s);
        d
    };
    let mut reused = arena.slot(4 << 20).expect("the range again");
    assert_eq!(
        reused.landing().offset,
        stale.offset,
        "the test reuses the range"
    );
    let late = timeout(
        TEST_BOUND,
        sender.put_landing(
            &address,
            79,
            &stale,
            pattern(4 << 20, 3),
            b"late".to_vec(),
            SEND_TIMEOUT,
        ),
    )
    .await
    .expect("bounded");
    assert!(
        matches!(late, Err(tandem_kv::Error::SlotReleased { .. })),
        "{late:?}"
    );
    assert_eq!(
        late.map_err(|e| e.class()).expect_err("refused"),
        ErrorClass::TransferFailed
    );
    assert!(
        reused
            .landed(4 << 20)
            .expect("fits")
            .iter()
            .all(|&b| b == 0),
        "the late writer touched the new reservation's bytes"
    );
    assert!(
        incoming.try_recv().is_err(),
        "no record followed a refused write"
    );
}

#[test]
fn tcp_only_and_default_transports_pass_in_child_processes() {
    if std::env::var_os("TANDEM_KV_TEST_CHILD").is_some() {
        return;
    }
    run_child(&[
        ("UCX_TLS", Some("tcp")),
        ("UCX_TCP_CM_REUSEADDR", Some("y")),
    ]);
    run_child(&[("UCX_TLS", None), ("UCX_TCP_CM_REUSEADDR", Some("y"))]);
}
