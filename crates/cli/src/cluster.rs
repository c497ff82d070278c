//! `tandem run`: a whole cluster on one machine — a prefill worker, a decode worker and a
//! router, each its own process (this same binary), on loopback. Waits until all three are
//! ready, prints how to talk to it, and on Ctrl-C (or SIGTERM) stops all three.

use anyhow::{bail, Context, Result};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};
use tokio::process::{Child, Command};

#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// Model directory or known name.
    #[arg(long, default_value = crate::models::DEFAULT_MODEL, env = "TANDEM_MODEL")]
    model: String,
    /// Router HTTP port on 127.0.0.1.
    #[arg(long, default_value_t = 8000, env = "TANDEM_PORT")]
    port: u16,
    /// KV blocks per worker.
    #[arg(long, default_value_t = 1024)]
    kv_blocks: usize,
    /// How long to wait for the processes to become ready.
    #[arg(long, default_value = "180s", value_parser = humantime::parse_duration)]
    ready_timeout: Duration,
    /// Router + one worker serving prefill and decode in one process (no KV transfer): what
    /// a small deployment or a 2-core machine needs.
    #[arg(long)]
    aggregated: bool,
    /// Weights and K/V dtype of the workers.
    #[arg(long, value_enum, default_value_t = crate::DtypeArg::F32)]
    dtype: crate::DtypeArg,
    /// Device of every worker: cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu", value_parser = crate::device::parse)]
    device: crate::device::Device,
    /// Device of the prefill worker (overrides --device).
    #[arg(long, value_parser = crate::device::parse)]
    prefill_device: Option<crate::device::Device>,
    /// Device of the decode worker (overrides --device).
    #[arg(long, value_parser = crate::device::parse)]
    decode_device: Option<crate::device::Device>,
    /// Chat template instead of the model's own: a Jinja file, or `chatml-tools` (built in:
    /// ChatML with tool calling, for SmolLM2 and other models whose template has none).
    #[arg(long)]
    chat_template: Option<String>,
}

/// The `127.0.0.1:PORT` after `listen` in a worker's ready line.
fn listen_addr(line: &str) -> Option<String> {
    const HOST: &str = "127.0.0.1:";
    let rest = line.split("listen").nth(1)?;
    let at = rest.find(HOST)? + HOST.len();
    let digits: String = rest[at..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    (!digits.is_empty()).then(|| format!("{HOST}{digits}"))
}

/// Starts a worker that binds a port of its own choosing (so nothing can take it between a
/// pick and the bind); its log passes through to ours, and the address from its ready line
/// arrives on the returned channel (closed if it exits first).
fn spawn_worker(
    exe: &Path,
    args: &[String],
    name: &'static str,
) -> Result<(Child, tokio::sync::oneshot::Receiver<String>)> {
    use tokio::io::AsyncBufReadExt;
    eprintln!("starting {name}: tandem {}", args.join(" "));
    // The address comes from the worker's "worker ready" log line: keep this binary's own
    // info lines on whatever level the user chose for the rest.
    let filter = std::env::var("TANDEM_LOG").unwrap_or_else(|_| "info".into());
    let filter = if filter.contains("tandem=") {
        filter
    } else {
        format!("{filter},tandem=info")
    };
    let mut child = Command::new(exe)
        .args(args)
        .env("TANDEM_LOG", filter)
        .stdin(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("spawning {name}"))?;
    let stderr = child.stderr.take().context("worker stderr")?;
    let (tx, rx) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        let mut tx = Some(tx);
        let mut lines = tokio::io::BufReader::new(stderr).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            eprintln!("{line}");
            if line.contains("worker ready") {
                if let (Some(tx), Some(addr)) = (tx.take(), listen_addr(&line)) {
                    let _ = tx.send(addr);
                }
            }
        }
    });
    Ok((child, rx))
}

/// The worker's address once it is ready; an error if it exits or the deadline passes first.
async fn worker_addr(
    name: &str,
    child: &mut Child,
    ready: tokio::sync::oneshot::Receiver<String>,
    deadline: Instant,
) -> Result<String> {
    tokio::select! {
        addr = ready => addr.map_err(|_| anyhow::anyhow!("{name} exited during start-up")),
        status = child.wait() => bail!("{name} exited during start-up ({status:?})"),
        () = tokio::time::sleep_until(deadline.into()) => bail!("{name} not ready in time"),
    }
}

fn http_get_ok(port: u16, path: &str) -> bool {
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    let req = format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
    if s.write_all(req.as_bytes()).is_err() {
        return false;
    }
    let mut buf = [0u8; 12];
    s.read_exact(&mut buf).is_ok() && buf.starts_with(b"HTTP/1.1 200")
}

fn spawn(exe: &Path, args: &[String], name: &str) -> Result<Child> {
    eprintln!("starting {name}: tandem {}", args.join(" "));
    Command::new(exe)
        .args(args)
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("spawning {name}"))
}

fn terminate(child: &Child) {
    if let Some(pid) = child.id() {
        // SIGTERM so each process shuts down cleanly; kill_on_drop is the backstop.
        let _ = std::process::Command::new("kill")
            .arg("-TERM")
            .arg(pid.to_string())
            .status();
    }
}

pub fn run(args: RunArgs) -> Result<()> {
    let dir = crate::models::resolve(&args.model)?;
    let dir_s = dir.display().to_string();
    let exe = std::env::current_exe().context("locating the tandem binary")?;
    if TcpListener::bind(("127.0.0.1", args.port)).is_err() {
        bail!(
            "port {} is busy: pass --port (or TANDEM_PORT) to use another",
            args.port
        );
    }
    let config_path = std::env::temp_dir().join(format!("tandem-run-{}.yaml", std::process::id()));
    let kv = args.kv_blocks.to_string();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let result = rt.block_on(async {
        let deadline = Instant::now() + args.ready_timeout;
        let dtype = match args.dtype {
            crate::DtypeArg::F32 => "f32",
            crate::DtypeArg::Bf16 => "bf16",
        };
        let worker = |role: &str| -> Vec<String> {
            let device = match role {
                "prefill" => args.prefill_device.unwrap_or(args.device),
                "decode" => args.decode_device.unwrap_or(args.device),
                _ => args.device,
            }
            .to_string();
            ["worker", "--role", role, "--listen", "127.0.0.1:0", "--model", &dir_s, "--kv-blocks", &kv, "--dtype", dtype, "--device", &device]
                .map(String::from)
                .to_vec()
        };
        let name = dir.file_name().map_or("model".into(), |n| n.to_string_lossy().to_string());
        let mut workers = Vec::new();
        let lists = if args.aggregated {
            let (mut both, ready) = spawn_worker(&exe, &worker("both"), "worker")?;
            let addr = worker_addr("worker", &mut both, ready, deadline).await?;
            eprintln!("worker (prefill + decode) listening on {addr}");
            workers.push(("worker", both));
            format!("aggregated:\n  - id: worker-0\n    address: http://{addr}\n")
        } else {
            let (mut prefill, p_ready) = spawn_worker(&exe, &worker("prefill"), "prefill worker")?;
            let (mut decode, d_ready) = spawn_worker(&exe, &worker("decode"), "decode worker")?;
            let p_addr = worker_addr("prefill worker", &mut prefill, p_ready, deadline).await?;
            let d_addr = worker_addr("decode worker", &mut decode, d_ready, deadline).await?;
            eprintln!("prefill worker listening on {p_addr}");
            eprintln!("decode worker listening on {d_addr}");
            workers.push(("prefill", prefill));
            workers.push(("decode", decode));
            format!("prefill:\n  - id: prefill-0\n    address: http://{p_addr}\ndecode:\n  - id: decode-0\n    address: http://{d_addr}\n")
        };
        let config = format!("listen: 127.0.0.1:{port}\nmodel:\n  served_name: {name}\n{lists}", port = args.port);
        std::fs::write(&config_path, &config)?;
        let mut children = workers;
        let mut router_args = vec!["router".into(), "--config".into(), config_path.display().to_string(), "--model".into(), dir_s.clone()];
        if let Some(template) = &args.chat_template {
            router_args.extend(["--chat-template".into(), template.clone()]);
        }
        children.push(("router", spawn(&exe, &router_args, "router")?));
        // Readiness: the router answers /health only once it can reach both workers.
        let deadline = Instant::now() + args.ready_timeout;
        loop {
            for (name, child) in children.iter_mut() {
                if let Some(status) = child.try_wait()? {
                    bail!("{name} exited during start-up ({status})");
                }
            }
            if http_get_ok(args.port, "/health") && http_get_ok(args.port, "/ready") {
                break;
            }
            if Instant::now() > deadline {
                bail!("cluster not ready after {:?}", args.ready_timeout);
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        println!("\ntandem is ready: http://127.0.0.1:{}/v1 (Ctrl-C stops the cluster)\n", args.port);
        println!("  curl http://127.0.0.1:{}/v1/chat/completions -H 'Content-Type: application/json' \\", args.port);
        println!("    -d '{{\"messages\":[{{\"role\":\"user\",\"content\":\"What is the capital of France?\"}}],\"max_tokens\":32,\"temperature\":0}}'\n");
        let exited = {
            let waits = children.iter_mut().map(|(name, c)| {
                let name = *name;
                Box::pin(async move { (name, c.wait().await) })
            });
            tokio::select! {
                (res, _, _) = futures_select_all(waits) => Some(res),
                _ = crate::shutdown_signal() => None,
            }
        };
        if let Some((name, status)) = exited {
            eprintln!("{name} exited ({status:?}); stopping the cluster");
        } else {
            eprintln!("stopping the cluster…");
        }
        for (_, child) in &children {
            terminate(child);
        }
        for (name, child) in children.iter_mut() {
            match tokio::time::timeout(Duration::from_secs(10), child.wait()).await {
                Ok(_) => {}
                Err(_) => {
                    eprintln!("{name} did not stop in 10s; killing it");
                    let _ = child.kill().await;
                }
            }
        }
        Ok(())
    });
    let _ = std::fs::remove_file(&config_path);
    result
}

async fn futures_select_all<F: std::future::Future + Unpin>(
    futs: impl IntoIterator<Item = F>,
) -> (F::Output, usize, Vec<F>) {
    futures::future::select_all(futs).await
}
