//! KV transport bandwidth on one host: a `UcxReceiver` and a `UcxSender` in one process send
//! N messages of S MiB (default 200 × 4 MiB, 4 in flight) and print MiB/s.
//!
//! ```text
//! cargo run -p tandem-kv --example kv_bandwidth -- [--messages N] [--size-mib S] [--window W]
//! UCX_TLS=tcp cargo run -p tandem-kv --example kv_bandwidth
//! ```
//!
//! Compare with `ucx_perftest -t tag_bw -s 4194304` on the same transport in the same run.
//! The figure includes one 4 MiB copy per message on the sending side (the API takes an owned
//! `Vec<u8>`), which `ucx_perftest` does not do.

use std::time::{Duration, Instant};

use tandem_kv::{UcxReceiver, UcxSender, DEFAULT_NET_DEVICES, DEFAULT_TLS};
use tokio::task::JoinSet;

struct Args {
    messages: usize,
    size: usize,
    window: usize,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        messages: 200,
        size: 4 << 20,
        window: 4,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || {
            it.next()
                .ok_or_else(|| format!("{flag} needs a value"))?
                .parse::<usize>()
                .map_err(|e| format!("{flag}: {e}"))
        };
        match flag.as_str() {
            "--messages" => args.messages = value()?.max(1),
            "--size-mib" => args.size = value()?.max(1) << 20,
            "--window" => args.window = value()?.max(1),
            other => return Err(format!("unknown argument {other}")),
        }
    }
    Ok(args)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .init();
    let args = parse_args()?;
    let tls = std::env::var("UCX_TLS").unwrap_or_else(|_| format!("{DEFAULT_TLS} (default)"));
    let devices = std::env::var("UCX_NET_DEVICES")
        .unwrap_or_else(|_| format!("{DEFAULT_NET_DEVICES} (default)"));

    let mut receiver = UcxReceiver::listen("127.0.0.1:0")?;
    let mut incoming = receiver.take_incoming().ok_or("incoming already taken")?;
    let address = receiver.address();
    let sender = UcxSender::new()?;
    let timeout = Duration::from_secs(30);
    let payload: Vec<u8> = (0..args.size).map(|i| (i % 251) as u8).collect();

    // Warm-up: connection establishment and first-touch allocations stay out of the timing.
    sender.send(&address, 0, payload.clone(), timeout).await?;
    incoming.recv().await.ok_or("receiver stopped")?;
    let sent_before = sender.bytes_sent();
    let received_before = receiver.bytes_received();

    let started = Instant::now();
    let mut in_flight = JoinSet::new();
    let mut received = 0usize;
    for tag in 1..=args.messages as u64 {
        while in_flight.len() >= args.window {
            if let Some(done) = in_flight.join_next().await {
                done??;
            }
        }
        let sender = sender.clone();
        let address = address.clone();
        let payload = payload.clone();
        in_flight.spawn(async move { sender.send(&address, tag, payload, timeout).await });
        while let Ok(msg) = incoming.try_recv() {
            received += msg.payload.len();
        }
    }
    while let Some(done) = in_flight.join_next().await {
        done??;
    }
    let send_done = started.elapsed();
    let total = args.messages * args.size;
    while received < total {
        let msg = incoming.recv().await.ok_or("receiver stopped")?;
        received += msg.payload.len();
    }
    let all_received = started.elapsed();

    let mib = total as f64 / (1024.0 * 1024.0);
    println!(
        "UCX {} | UCX_TLS={tls} UCX_NET_DEVICES={devices}",
        tandem_ucx::version()
    );
    println!(
        "{} messages x {} MiB, window {}: {:.1} MiB/s end-to-end ({:.3} s), sender done after {:.3} s",
        args.messages,
        args.size >> 20,
        args.window,
        mib / all_received.as_secs_f64(),
        all_received.as_secs_f64(),
        send_done.as_secs_f64(),
    );
    assert_eq!(sender.bytes_sent() - sent_before, total as u64);
    assert_eq!(receiver.bytes_received() - received_before, total as u64);
    Ok(())
}
