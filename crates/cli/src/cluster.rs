//! `tandem run`: a whole cluster on one machine — prefill workers, decode workers (one each
//! by default) and a router, each its own process (this same binary), on loopback. Waits
//! until all are ready, prints how to talk to it, and supervises: a worker that dies (a
//! crash, or `tandem chaos replay` killing it by its pid file) is started again at its
//! address; on Ctrl-C (or SIGTERM) it stops them all.

use anyhow::{bail, Context, Result};
use std::net::TcpListener;
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
    /// Device of every worker: cpu, cuda, cuda:N or a list of GPUs (cuda:0,cuda:1).
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
    /// Prefill workers (each its own process; the router spreads requests over them).
    #[arg(long, default_value_t = 1)]
    prefill_workers: usize,
    /// Decode workers.
    #[arg(long, default_value_t = 1)]
    decode_workers: usize,
    /// Where the router's config and each process's pid file (`prefill-0.pid`,
    /// `decode-0.pid`, `router.pid`, …) go; default `$TMPDIR/tandem-run-PORT`.
    #[arg(long)]
    state_dir: Option<std::path::PathBuf>,
    /// Restarts of one worker within `--restart-window` after which it counts as crash-looping
    /// and the cluster stops (a worker that dies is otherwise started again at its address).
    #[arg(long, default_value_t = 5)]
    max_restarts: u32,
    /// The window `--max-restarts` counts over.
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    restart_window: Duration,
    /// HTTPS on the router and mutual TLS between the router and the workers, with a
    /// throwaway CA and a certificate per process generated into `STATE_DIR/tls` (and an
    /// `admin` one for `tandem admin`); removed when the cluster stops.
    #[arg(long)]
    tls: bool,
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
    name: &str,
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
        status = child.wait() => bail!("{name} exited during start-up ({})", ended(&status)),
        () = tokio::time::sleep_until(deadline.into()) => bail!("{name} not ready in time"),
    }
}

/// Whether `GET url` answers 200.
async fn get_ok(client: &reqwest::Client, url: &str) -> bool {
    client
        .get(url)
        .send()
        .await
        .is_ok_and(|r| r.status().is_success())
}

/// A client for the router's readiness probes: trusting the cluster's CA with `tls`.
fn probe_client(tls: Option<&Path>) -> Result<reqwest::Client> {
    let mut builder = reqwest::Client::builder().timeout(Duration::from_secs(2));
    if let Some(dir) = tls {
        let pem = std::fs::read(dir.join("ca.crt")).context("reading the generated CA")?;
        builder = builder.add_root_certificate(reqwest::Certificate::from_pem(&pem)?);
    }
    Ok(builder.build()?)
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

fn terminate(pid: u32) {
    // SIGTERM so each process shuts down cleanly (a worker drains); kill_on_drop is the
    // backstop.
    let _ = std::process::Command::new("kill")
        .arg("-TERM")
        .arg(pid.to_string())
        .status();
}

/// One process of the cluster: how to start it again, and the pid file naming it.
struct Member {
    /// Its id (`prefill-0`, `decode-1`, `worker-0`, `router`): the router's id for it too.
    id: String,
    /// Arguments it was started with (a restarted worker keeps its first address).
    args: Vec<String>,
    /// Its current pid.
    pid: Option<u32>,
    /// When it was restarted (the last `--restart-window` of them).
    restarts: std::collections::VecDeque<Instant>,
}

/// What a member's waiter reports: its id, its pid, and how it ended.
type Exit = (
    String,
    Option<u32>,
    std::io::Result<std::process::ExitStatus>,
);

/// Waits for `child` in a task of its own and reports its end on `exits`.
fn watch(id: &str, mut child: Child, exits: &tokio::sync::mpsc::UnboundedSender<Exit>) {
    let (id, pid, exits) = (id.to_string(), child.id(), exits.clone());
    tokio::spawn(async move {
        let status = child.wait().await;
        let _ = exits.send((id, pid, status));
    });
}

/// How a process ended, in words: `exit code 1`, `killed by signal 9`.
fn ended(status: &std::io::Result<std::process::ExitStatus>) -> String {
    use std::os::unix::process::ExitStatusExt;
    match status {
        Ok(s) => match (s.code(), s.signal()) {
            (Some(code), _) => format!("exit code {code}"),
            (None, Some(sig)) => format!("killed by signal {sig}"),
            _ => s.to_string(),
        },
        Err(e) => format!("its status is unknown: {e}"),
    }
}

fn write_pid(dir: &Path, m: &Member) -> Result<()> {
    let path = dir.join(format!("{}.pid", m.id));
    std::fs::write(&path, m.pid.map(|p| p.to_string()).unwrap_or_default())
        .with_context(|| format!("writing {}", path.display()))
}

/// `--listen` of `args` set to `addr` (a restarted worker comes back where the router
/// expects it).
fn with_listen(args: &[String], addr: &str) -> Vec<String> {
    let mut out = args.to_vec();
    if let Some(i) = out.iter().position(|a| a == "--listen") {
        if let Some(v) = out.get_mut(i + 1) {
            *v = addr.to_string();
        }
    }
    out
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
    if args.prefill_workers == 0 || args.decode_workers == 0 {
        bail!("--prefill-workers and --decode-workers must be at least 1");
    }
    let own_dir = args.state_dir.is_none();
    let state_dir = args
        .state_dir
        .clone()
        .unwrap_or_else(|| std::env::temp_dir().join(format!("tandem-run-{}", args.port)));
    std::fs::create_dir_all(&state_dir)
        .with_context(|| format!("creating {}", state_dir.display()))?;
    let config_path = state_dir.join("router.yaml");
    let tls_dir = args.tls.then(|| state_dir.join("tls"));
    // Every process of the plan by id and role (workers first, in start order).
    let plan: Vec<(String, &str)> = if args.aggregated {
        vec![("worker-0".into(), "both")]
    } else {
        (0..args.prefill_workers)
            .map(|i| (format!("prefill-{i}"), "prefill"))
            .chain((0..args.decode_workers).map(|i| (format!("decode-{i}"), "decode")))
            .collect()
    };
    if let Some(dir) = &tls_dir {
        use tandem_core::PeerRole;
        let mut components = vec![
            ("router".to_string(), PeerRole::Router),
            ("admin".to_string(), PeerRole::Admin),
        ];
        components.extend(plan.iter().map(|(id, role)| {
            let role = match *role {
                "prefill" => PeerRole::Prefill,
                "decode" => PeerRole::Decode,
                _ => PeerRole::Worker,
            };
            (id.clone(), role)
        }));
        let hosts = ["localhost".to_string(), "127.0.0.1".to_string()];
        crate::certs::generate(dir, None, &hosts, &components)
            .context("generating the cluster's certificates")?;
    }
    let scheme = if args.tls { "https" } else { "http" };
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
        let worker = |id: &str, role: &str| -> Vec<String> {
            let device = match role {
                "prefill" => args.prefill_device.unwrap_or(args.device),
                "decode" => args.decode_device.unwrap_or(args.device),
                _ => args.device,
            }
            .to_string();
            let mut a: Vec<String> = ["worker", "--role", role, "--listen", "127.0.0.1:0", "--model", &dir_s, "--kv-blocks", &kv, "--dtype", dtype, "--device", &device]
                .map(String::from)
                .to_vec();
            if let Some(t) = &tls_dir {
                let file = |name: String| t.join(name).display().to_string();
                a.extend([
                    "--tls-cert".into(), file(format!("{id}.crt")),
                    "--tls-key".into(), file(format!("{id}.key")),
                    "--tls-client-ca".into(), file("ca.crt".into()),
                ]);
            }
            a
        };
        let name = dir.file_name().map_or("model".into(), |n| n.to_string_lossy().to_string());
        let (exits_tx, mut exits) = tokio::sync::mpsc::unbounded_channel::<Exit>();
        // Every worker starts at once; their ready lines give their addresses.
        let mut starting = Vec::new();
        for (id, role) in &plan {
            let a = worker(id, role);
            let (child, ready) = spawn_worker(&exe, &a, id)?;
            starting.push((id.clone(), *role, a, child, ready));
        }
        let mut members = Vec::new();
        let mut lists: std::collections::BTreeMap<&str, String> = Default::default();
        for (id, role, a, mut child, ready) in starting {
            let addr = worker_addr(&id, &mut child, ready, deadline).await?;
            eprintln!("{id} ({role}) listening on {addr}");
            let section = match role {
                "both" => "aggregated",
                r => r,
            };
            lists
                .entry(section)
                .or_default()
                .push_str(&format!("  - id: {id}\n    address: {scheme}://{addr}\n"));
            let m = Member { id: id.clone(), args: with_listen(&a, &addr), pid: child.id(), restarts: Default::default() };
            write_pid(&state_dir, &m)?;
            watch(&id, child, &exits_tx);
            members.push(m);
        }
        let lists: String = lists.iter().map(|(k, v)| format!("{k}:\n{v}")).collect();
        let mut config = format!("listen: 127.0.0.1:{port}\nmodel:\n  served_name: {name}\n{lists}", port = args.port);
        if let Some(t) = &tls_dir {
            let file = |name: &str| t.join(name).display().to_string();
            let (ca, cert, key) = (file("ca.crt"), file("router.crt"), file("router.key"));
            config.push_str(&format!(
                "tls: {{cert: '{cert}', key: '{key}'}}\nworker_tls: {{ca: '{ca}', cert: '{cert}', key: '{key}'}}\n"
            ));
        }
        std::fs::write(&config_path, &config)?;
        let mut router_args = vec!["router".into(), "--config".into(), config_path.display().to_string(), "--model".into(), dir_s.clone()];
        if let Some(template) = &args.chat_template {
            router_args.extend(["--chat-template".into(), template.clone()]);
        }
        let router = spawn(&exe, &router_args, "router")?;
        let router_member = Member { id: "router".into(), args: router_args, pid: router.id(), restarts: Default::default() };
        write_pid(&state_dir, &router_member)?;
        watch("router", router, &exits_tx);
        members.push(router_member);
        // Readiness: the router answers /ready only once it can reach its workers.
        let deadline = Instant::now() + args.ready_timeout;
        let probe = probe_client(tls_dir.as_deref())?;
        let base = format!("{scheme}://127.0.0.1:{}", args.port);
        loop {
            if let Ok((id, _, status)) = exits.try_recv() {
                bail!("{id} exited during start-up ({})", ended(&status));
            }
            if get_ok(&probe, &format!("{base}/health")).await && get_ok(&probe, &format!("{base}/ready")).await {
                break;
            }
            if Instant::now() > deadline {
                bail!("cluster not ready after {:?}", args.ready_timeout);
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        println!("\ntandem is ready: {base}/v1 (Ctrl-C stops the cluster)\n");
        let cacert = tls_dir.as_ref().map_or(String::new(), |t| format!("--cacert {} ", t.join("ca.crt").display()));
        println!("  curl {cacert}{base}/v1/chat/completions -H 'Content-Type: application/json' \\");
        println!("    -d '{{\"messages\":[{{\"role\":\"user\",\"content\":\"What is the capital of France?\"}}],\"max_tokens\":32,\"temperature\":0}}'\n");
        if let Some(t) = &tls_dir {
            println!("certificates in {} (ca.crt, router, admin and one per worker; `tandem admin drain --worker {scheme}://… --tls-ca {0}/ca.crt --tls-cert {0}/admin.crt --tls-key {0}/admin.key`)\n", t.display());
        }
        println!("pid files in {} (a worker that dies is restarted at its address, up to {} times in {:?})\n", state_dir.display(), args.max_restarts, args.restart_window);
        // Supervise: a worker that exits comes back at its address; the router exiting, a
        // worker past its restarts, or Ctrl-C stops the cluster.
        let shutdown = crate::shutdown_signal();
        tokio::pin!(shutdown);
        loop {
            let (id, pid, status) = tokio::select! {
                Some(exit) = exits.recv() => exit,
                _ = &mut shutdown => {
                    eprintln!("stopping the cluster…");
                    break;
                }
            };
            let Some(i) = members.iter().position(|m| m.id == id && m.pid == pid) else {
                continue;
            };
            let m = &mut members[i];
            m.pid = None;
            let now = Instant::now();
            while m.restarts.front().is_some_and(|t| now.duration_since(*t) > args.restart_window) {
                m.restarts.pop_front();
            }
            if m.id == "router" || m.restarts.len() >= args.max_restarts as usize {
                eprintln!("{id} exited ({}); stopping the cluster", ended(&status));
                break;
            }
            m.restarts.push_back(now);
            eprintln!(
                "{id} exited ({}); restarting it ({} of at most {} in {:?})",
                ended(&status),
                m.restarts.len(),
                args.max_restarts,
                args.restart_window
            );
            let (mut child, ready) = spawn_worker(&exe, &m.args, &m.id)?;
            m.pid = child.id();
            write_pid(&state_dir, m)?;
            let back = Instant::now() + args.ready_timeout;
            let outcome = tokio::select! {
                r = worker_addr(&m.id, &mut child, ready, back) => Some(r),
                _ = &mut shutdown => None,
            };
            watch(&id, child, &exits_tx);
            match outcome {
                Some(Ok(addr)) => eprintln!("{id} is back on {addr}"),
                Some(Err(e)) => {
                    eprintln!("{id} did not come back ({e:#}); stopping the cluster");
                    break;
                }
                None => {
                    eprintln!("stopping the cluster…");
                    break;
                }
            }
        }
        for m in &members {
            if let Some(pid) = m.pid {
                terminate(pid);
            }
        }
        let stop_by = tokio::time::Instant::now() + Duration::from_secs(10);
        while members.iter().any(|m| m.pid.is_some()) {
            match tokio::time::timeout_at(stop_by, exits.recv()).await {
                Ok(Some((id, pid, _))) => {
                    if let Some(m) = members.iter_mut().find(|m| m.id == id && m.pid == pid) {
                        m.pid = None;
                    }
                }
                _ => break,
            }
        }
        for m in members.iter().filter(|m| m.pid.is_some()) {
            eprintln!("{} did not stop in 10s; killing it", m.id);
            if let Some(pid) = m.pid {
                let _ = std::process::Command::new("kill").args(["-KILL", &pid.to_string()]).status();
            }
        }
        Ok(())
    });
    // What this run wrote: the router's config and the pid files (and the directory, when
    // it was this run's own).
    let _ = std::fs::remove_file(&config_path);
    if let Some(t) = &tls_dir {
        let _ = std::fs::remove_dir_all(t);
    }
    if let Ok(entries) = std::fs::read_dir(&state_dir) {
        for e in entries.flatten() {
            if e.path().extension().is_some_and(|x| x == "pid") {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
    if own_dir {
        let _ = std::fs::remove_dir(&state_dir);
    }
    result
}
