//! The end-to-end harness: starts a real prefill worker, decode worker and router as separate
//! `tandem` processes on loopback (the debug binary `make test` builds), waits until the
//! router reports every worker reachable, and stops them all on drop.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// The `tandem` binary under test.
pub fn tandem_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("TANDEM_BIN") {
        return PathBuf::from(p);
    }
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let target =
        std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root.join("target"), PathBuf::from);
    let bin = target.join("debug/tandem");
    assert!(
        bin.exists(),
        "{} missing: run `cargo build --bin tandem` first (make test does)",
        bin.display()
    );
    bin
}

/// A blocking HTTP/1.1 POST of a JSON body to `url` (`http://host:port/path`); returns the
/// response body. Enough for tests that need no async runtime.
pub fn post_json(url: &str, body: &str) -> String {
    use std::io::{Read, Write};
    let rest = url.strip_prefix("http://").expect("http URL");
    let (host, path) = rest
        .split_once('/')
        .map_or((rest, "/".to_string()), |(h, p)| (h, format!("/{p}")));
    let mut s = std::net::TcpStream::connect(host).unwrap();
    let req = format!(
        "POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out.split_once("\r\n\r\n")
        .map_or(String::new(), |(_, b)| b.to_string())
}

/// `/admin/workers` once every live worker holds no KV or state (the workers wait for it
/// themselves, up to 20 s), parsed.
pub async fn workers_when_idle(client: &reqwest::Client, url: &str) -> serde_json::Value {
    client
        .get(format!("{url}/admin/workers?wait_idle_ms=20000"))
        .send()
        .await
        .expect("GET /admin/workers")
        .json()
        .await
        .expect("JSON from /admin/workers")
}

/// A free TCP port on loopback.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Options of a test cluster.
#[derive(Clone, Debug)]
pub struct ClusterOptions {
    /// KV blocks per worker.
    pub kv_blocks: usize,
    /// Extra environment for the workers (e.g. `UCX_TLS`).
    pub worker_env: Vec<(String, String)>,
    /// Model directory; SmolLM2 when `None`. Served under the name `test-model`.
    pub model: Option<PathBuf>,
    /// Extra arguments of the prefill worker (e.g. `--tp 2`).
    pub prefill_args: Vec<String>,
    /// Also list a prefill and a decode worker that are not running.
    pub dead_workers: bool,
    /// Extra arguments of the decode worker (e.g. `--tp 2 --dp 2`).
    pub decode_args: Vec<String>,
}

impl Default for ClusterOptions {
    fn default() -> Self {
        Self {
            kv_blocks: 512,
            worker_env: vec![("UCX_TLS".into(), "tcp".into())],
            model: None,
            prefill_args: Vec::new(),
            decode_args: Vec::new(),
            dead_workers: false,
        }
    }
}

/// A running router + prefill + decode.
pub struct Cluster {
    children: Vec<(String, Child)>,
    /// Router base URL, `http://127.0.0.1:PORT`.
    pub url: String,
    /// Prefill worker's gRPC address, `http://127.0.0.1:PORT`.
    pub prefill_addr: String,
    /// Decode worker's gRPC address.
    pub decode_addr: String,
    _dir: tempfile::TempDir,
}

impl Cluster {
    /// Starts the cluster on the reference model and waits until it is ready.
    pub fn start(opts: ClusterOptions) -> Self {
        let (model, served) = match &opts.model {
            Some(dir) => (dir.clone(), "test-model"),
            None => (tandem_testkit::smollm2_dir(), "smollm2-135m-instruct"),
        };
        let bin = tandem_bin();
        let dir = tempfile::tempdir().unwrap();
        let (p, d, r) = (free_port(), free_port(), free_port());
        // Dead workers: listed in the router's config, nothing listening on their ports.
        let (dead_p, dead_d) = if opts.dead_workers {
            (
                format!(
                    "  - id: prefill-dead\n    address: http://127.0.0.1:{}\n",
                    free_port()
                ),
                format!(
                    "  - id: decode-dead\n    address: http://127.0.0.1:{}\n",
                    free_port()
                ),
            )
        } else {
            (String::new(), String::new())
        };
        let config = format!(
            "listen: 127.0.0.1:{r}\nmodel:\n  served_name: {served}\nprefill:\n{dead_p}  - id: prefill-0\n    address: http://127.0.0.1:{p}\ndecode:\n  - id: decode-0\n    address: http://127.0.0.1:{d}\n{dead_d}"
        );
        let config_path = dir.path().join("router.yaml");
        std::fs::write(&config_path, config).unwrap();
        let model_s = model.display().to_string();
        let kv = opts.kv_blocks.to_string();
        let mut children = Vec::new();
        for (role, port) in [("prefill", p), ("decode", d)] {
            let child = Command::new(&bin)
                .args([
                    "worker",
                    "--role",
                    role,
                    "--listen",
                    &format!("127.0.0.1:{port}"),
                    "--model",
                    &model_s,
                    "--kv-blocks",
                    &kv,
                ])
                .args(if role == "prefill" {
                    &opts.prefill_args
                } else {
                    &opts.decode_args
                })
                .envs(
                    opts.worker_env
                        .iter()
                        .map(|(k, v)| (k.as_str(), v.as_str())),
                )
                .env("UCX_NET_DEVICES", "lo")
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap();
            children.push((role.to_string(), child));
        }
        let router = Command::new(&bin)
            .args([
                "router",
                "--config",
                &config_path.display().to_string(),
                "--model",
                &model_s,
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        children.push(("router".into(), router));
        // Each process's log is teed to a file; its "… ready" line (logged once its listener is
        // bound) or the end of its output (it exited) arrives on `events`.
        let (tx, events) = mpsc::channel();
        for (name, child) in &mut children {
            let stderr = child.stderr.take().expect("stderr is piped");
            let log = std::fs::File::create(dir.path().join(format!("{name}.log"))).unwrap();
            let (name, tx) = (name.clone(), tx.clone());
            std::thread::spawn(move || tee_log(stderr, log, &name, &tx));
        }
        let cluster = Self {
            children,
            url: format!("http://127.0.0.1:{r}"),
            prefill_addr: format!("http://127.0.0.1:{p}"),
            decode_addr: format!("http://127.0.0.1:{d}"),
            _dir: dir,
        };
        cluster.wait_ready(&events, Duration::from_secs(120));
        cluster
    }

    fn logs(&self) -> String {
        let mut out = String::new();
        for name in ["prefill", "decode", "router"] {
            let text = std::fs::read_to_string(self._dir.path().join(format!("{name}.log")))
                .unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(30).collect();
            out.push_str(&format!("--- {name} log (last lines) ---\n"));
            for l in tail.into_iter().rev() {
                out.push_str(l);
                out.push('\n');
            }
        }
        out
    }

    fn wait_ready(&self, events: &mpsc::Receiver<StartEvent>, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        let mut ready = 0;
        while ready < self.children.len() {
            let left = deadline.saturating_duration_since(Instant::now());
            match events.recv_timeout(left) {
                Ok(StartEvent::Ready) => ready += 1,
                Ok(StartEvent::Exited(name)) => {
                    panic!("{name} exited during start-up\n{}", self.logs())
                }
                Err(_) => panic!("cluster not ready in {timeout:?}\n{}", self.logs()),
            }
        }
        // Every listener is bound: the router must now reach both workers.
        let client = probe::blocking_free_client();
        assert!(
            client(&format!("{}/ready", self.url)),
            "router not ready\n{}",
            self.logs()
        );
    }

    /// Prints the processes' logs (for failing tests).
    pub fn dump_logs(&self) {
        eprintln!("{}", self.logs());
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let pids: Vec<String> = self
            .children
            .iter()
            .map(|(_, c)| c.id().to_string())
            .collect();
        for pid in &pids {
            let _ = Command::new("kill").arg("-TERM").arg(pid).status();
        }
        // Reap them on a thread; kill whatever has not exited when the grace period ends.
        let mut children = std::mem::take(&mut self.children);
        let (tx, done) = mpsc::channel();
        std::thread::spawn(move || {
            for (_, child) in &mut children {
                let _ = child.wait();
            }
            let _ = tx.send(());
        });
        if done.recv_timeout(Duration::from_secs(10)).is_err() {
            for pid in &pids {
                let _ = Command::new("kill").arg("-KILL").arg(pid).status();
            }
            let _ = done.recv_timeout(Duration::from_secs(5));
        }
    }
}

/// What a starting process reported.
enum StartEvent {
    /// Its "… ready" log line.
    Ready,
    /// Its output ended: it exited.
    Exited(String),
}

/// Copies a process's stderr into its log file, reporting its ready line and its end.
fn tee_log(
    stderr: std::process::ChildStderr,
    mut log: std::fs::File,
    name: &str,
    tx: &mpsc::Sender<StartEvent>,
) {
    use std::io::{BufRead, Write};
    let mut announced = false;
    for line in std::io::BufReader::new(stderr)
        .lines()
        .map_while(Result::ok)
    {
        let _ = writeln!(log, "{line}");
        if !announced && (line.contains("worker ready") || line.contains("router ready")) {
            announced = true;
            let _ = tx.send(StartEvent::Ready);
        }
    }
    let _ = tx.send(StartEvent::Exited(name.to_string()));
}

mod probe {
    /// A tiny blocking GET that says whether the answer was 200 (readiness polling without
    /// needing an async runtime).
    pub fn blocking_free_client() -> impl Fn(&str) -> bool {
        |url: &str| {
            use std::io::{Read, Write};
            let Some(rest) = url.strip_prefix("http://") else {
                return false;
            };
            let (host, path) = rest
                .split_once('/')
                .map_or((rest, "/".to_string()), |(h, p)| (h, format!("/{p}")));
            let Ok(mut s) = std::net::TcpStream::connect(host) else {
                return false;
            };
            let _ = s.set_read_timeout(Some(std::time::Duration::from_secs(5)));
            let req = format!("GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
            if s.write_all(req.as_bytes()).is_err() {
                return false;
            }
            let mut buf = [0u8; 12];
            s.read_exact(&mut buf).is_ok() && buf.starts_with(b"HTTP/1.1 200")
        }
    }
}
