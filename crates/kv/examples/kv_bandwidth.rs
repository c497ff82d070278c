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
//!
//! `--landing`: the shared-memory path of two workers on one host instead: each message is
//! copied into a landing slot of the receiver's arena and only its 36-byte completion record
//! travels over UCX (compare with `ucx_perftest -t ucp_put_bw` over `UCX_TLS=sm`).
//!
//! `--put`: the path of a prefill worker on another host: the receiver registers its arena
//! with UCX, and each message claims a slot by a remote compare-and-swap, is put into it,
//! flushed, and followed by its completion record (compare with `ucx_perftest -t ucp_put_bw`
//! on the same transport).

use std::time::{Duration, Instant};

use tandem_kv::{UcxReceiver, UcxSender, DEFAULT_NET_DEVICES, DEFAULT_TLS};
use tokio::task::JoinSet;

struct Args {
    messages: usize,
    size: usize,
    window: usize,
    landing: bool,
    put: bool,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        messages: 200,
        size: 4 << 20,
        window: 4,
        landing: false,
        put: false,
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
            "--landing" => args.landing = true,
            "--put" => args.put = true,
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

    if args.put {
        println!(
            "UCX {} | UCX_TLS={tls} UCX_NET_DEVICES={devices}",
            tandem_ucx::version()
        );
        return put(&args).await;
    }
    let mut receiver = UcxReceiver::listen("127.0.0.1:0")?;
    let mut incoming = receiver.take_incoming().ok_or("incoming already taken")?;
    let address = receiver.address();
    let sender = UcxSender::new()?;
    let timeout = Duration::from_secs(30);
    let payload: Vec<u8> = (0..args.size).map(|i| (i % 251) as u8).collect();
    println!(
        "UCX {} | UCX_TLS={tls} UCX_NET_DEVICES={devices}",
        tandem_ucx::version()
    );
    if args.landing {
        return landing(&args, &sender, &address, &mut incoming, payload).await;
    }

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

/// The landing path: copy into a slot of the receiver's arena (window slots in rotation),
/// then a completion record over UCX; done when every record has arrived.
async fn landing(
    args: &Args,
    sender: &UcxSender,
    address: &str,
    incoming: &mut tokio::sync::mpsc::UnboundedReceiver<tandem_kv::KvMessage>,
    payload: Vec<u8>,
) -> Result<(), Box<dyn std::error::Error>> {
    use std::sync::Arc;
    use tandem_kv::landing::{LandingArena, LandingWriter};
    let arena = LandingArena::create(args.window * args.size)?;
    let slots: Vec<_> = (0..args.window)
        .map(|_| arena.slot(args.size).ok_or("arena too small"))
        .collect::<Result<_, _>>()?;
    // Each write re-arms its slot (a slot takes one writer per token), holding the slot for
    // the write: a write of the next rotation waits for the one before it.
    type Slots = [std::sync::Mutex<tandem_kv::landing::LandingSlot>];
    let targets: Arc<Vec<_>> = Arc::new(slots.into_iter().map(std::sync::Mutex::new).collect());
    fn write_slot(
        writer: &LandingWriter,
        t: &Slots,
        i: usize,
        payload: &[u8],
    ) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        let mut slot = t[i].lock().map_err(|_| "slot lock poisoned")?;
        writer.write(&slot.rearm(), payload)?;
        Ok(())
    }
    let writer = Arc::new(LandingWriter::new());
    let payload = Arc::new(payload);
    let timeout = Duration::from_secs(30);
    let send_one = |tag: u64| {
        let (writer, targets, payload, sender) = (
            writer.clone(),
            targets.clone(),
            payload.clone(),
            sender.clone(),
        );
        let address = address.to_owned();
        async move {
            let slot = tag as usize % targets.len();
            let t = targets.clone();
            let p = payload.clone();
            tokio::task::spawn_blocking(move || write_slot(&writer, &t, slot, &p)).await??;
            sender.send(&address, tag, vec![0u8; 36], timeout).await?;
            Ok::<(), Box<dyn std::error::Error + Send + Sync>>(())
        }
    };
    // Warm-up: the mapping, the connection and first touches stay out of the timing.
    for tag in 0..args.window as u64 {
        send_one(tag).await.map_err(|e| e.to_string())?;
        incoming.recv().await.ok_or("receiver stopped")?;
    }
    // The copies alone (no completion records), the same slots in the same rotation.
    let copies = Instant::now();
    for i in 0..args.messages {
        write_slot(&writer, &targets, i % targets.len(), &payload).map_err(|e| e.to_string())?;
    }
    let copies = copies.elapsed();

    let started = Instant::now();
    let mut in_flight = JoinSet::new();
    let mut records = 0usize;
    for tag in 0..args.messages as u64 {
        // A slot is reused only after its previous record arrived (what a decode worker
        // does): at most `window` writes outstanding.
        while tag as usize >= records + args.window {
            incoming.recv().await.ok_or("receiver stopped")?;
            records += 1;
        }
        in_flight.spawn(send_one(tag));
        while in_flight.len() > args.window {
            if let Some(done) = in_flight.join_next().await {
                done?.map_err(|e| e.to_string())?;
            }
        }
    }
    while let Some(done) = in_flight.join_next().await {
        done?.map_err(|e| e.to_string())?;
    }
    while records < args.messages {
        incoming.recv().await.ok_or("receiver stopped")?;
        records += 1;
    }
    let elapsed = started.elapsed();
    let mib = (args.messages * args.size) as f64 / (1024.0 * 1024.0);
    println!(
        "landing: {} messages x {} MiB, window {}: {:.1} MiB/s end-to-end ({:.3} s); the copies alone {:.1} MiB/s",
        args.messages,
        args.size >> 20,
        args.window,
        mib / elapsed.as_secs_f64(),
        elapsed.as_secs_f64(),
        mib / copies.as_secs_f64(),
    );
    Ok(())
}

/// The one-sided path: `window` lanes, each writing its own slot of the receiver's
/// registered arena in turn (re-armed before every write); done when every completion
/// record has arrived.
async fn put(args: &Args) -> Result<(), Box<dyn std::error::Error>> {
    use std::sync::Arc;
    use tandem_kv::landing::LandingArena;
    let arena = LandingArena::create(args.window * args.size + (1 << 20))?;
    let mut receiver = UcxReceiver::listen_with_arena("127.0.0.1:0", Some(arena.clone()))?;
    let mut incoming = receiver.take_incoming().ok_or("incoming already taken")?;
    let address = receiver.address();
    let sender = UcxSender::new()?;
    let slots: Vec<_> = (0..args.window)
        .map(|_| arena.slot(args.size).ok_or("arena too small"))
        .collect::<Result<_, _>>()?;
    let payload = Arc::new((0..args.size).map(|i| (i % 251) as u8).collect::<Vec<u8>>());
    let timeout = Duration::from_secs(30);
    let lanes = |count: usize, slots: Vec<tandem_kv::landing::LandingSlot>| {
        let mut set = JoinSet::new();
        for (lane, mut slot) in slots.into_iter().enumerate() {
            let (sender, address, payload) = (sender.clone(), address.clone(), payload.clone());
            let window = args.window;
            set.spawn(async move {
                let mut tag = lane;
                while tag < count {
                    let to = slot.rearm();
                    sender
                        .put_landing(
                            &address,
                            tag as u64,
                            &to,
                            payload.to_vec(),
                            vec![0u8; 36],
                            timeout,
                        )
                        .await
                        .map_err(|e| e.to_string())?;
                    tag += window;
                }
                Ok::<_, String>(slot)
            });
        }
        set
    };
    // Warm-up: one message a lane (connection, remote key, first touches).
    let mut warm = lanes(args.window, slots);
    let mut slots = Vec::new();
    while let Some(done) = warm.join_next().await {
        slots.push(done??);
    }
    for _ in 0..args.window {
        incoming.recv().await.ok_or("receiver stopped")?;
    }
    let started = Instant::now();
    let mut run = lanes(args.messages, slots);
    while let Some(done) = run.join_next().await {
        done??;
    }
    for _ in 0..args.messages {
        incoming.recv().await.ok_or("receiver stopped")?;
    }
    let elapsed = started.elapsed();
    let mib = (args.messages * args.size) as f64 / (1024.0 * 1024.0);
    println!(
        "put: {} messages x {} MiB, window {}: {:.1} MiB/s end-to-end ({:.3} s)",
        args.messages,
        args.size >> 20,
        args.window,
        mib / elapsed.as_secs_f64(),
        elapsed.as_secs_f64(),
    );
    Ok(())
}
