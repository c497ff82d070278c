//! The end-to-end harness: starts a real prefill worker, decode worker and router as separate
//! `tandem` processes on loopback (the debug binary `make test` builds), waits until the
//! router reports every worker reachable, and stops them all on drop.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// The processes' logs: the tee from each one's stderr, and reading and waiting on them.
mod logs;

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
/// A multi-threaded Tokio runtime for a test's async part.
pub fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a runtime")
}

/// POSTs JSON; returns the status and the JSON answer.
pub async fn post(
    client: &reqwest::Client,
    url: &str,
    body: serde_json::Value,
) -> (u16, serde_json::Value) {
    let resp = client.post(url).json(&body).send().await.expect("sent");
    let status = resp.status().as_u16();
    (status, resp.json().await.expect("a JSON answer"))
}

/// Runs a Python script (the official `openai` client's tests) and fails the test with its
/// output — and `cluster`'s logs — unless it exits 0.
pub fn python(script: &str, cluster: &Cluster) {
    let out = Command::new("python3")
        .arg("-c")
        .arg(script)
        .output()
        .expect("python3");
    if !out.status.success() {
        cluster.dump_logs();
    }
    // What the script reports shows with the test's output (`--no-capture`, or on failure).
    print!("{}", String::from_utf8_lossy(&out.stdout));
    assert!(
        out.status.success(),
        "python failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A blocking HTTP/1.1 request with `Connection: close`; the response body.
fn http_close(method: &str, url: &str, body: &str) -> String {
    use std::io::{Read, Write};
    let rest = url.strip_prefix("http://").expect("http URL");
    let (host, path) = rest
        .split_once('/')
        .map_or((rest, "/".to_string()), |(h, p)| (h, format!("/{p}")));
    let mut s = std::net::TcpStream::connect(host).unwrap();
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out.split_once("\r\n\r\n")
        .map_or(String::new(), |(_, b)| b.to_string())
}

/// POSTs `body` (JSON) to `url`; the response body.
pub fn post_json(url: &str, body: &str) -> String {
    http_close("POST", url, body)
}

/// GETs `url`; the response body.
pub fn get_json(url: &str) -> String {
    http_close("GET", url, "")
}

/// The router's Prometheus text (`GET /metrics`).
pub async fn metrics_text(client: &reqwest::Client, url: &str) -> String {
    client
        .get(format!("{url}/metrics"))
        .send()
        .await
        .expect("GET /metrics")
        .text()
        .await
        .expect("metrics body")
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

/// Reads a streamed response until more than `bytes` bytes arrived, then drops it (the
/// client disconnects mid-stream).
pub async fn read_then_disconnect(resp: reqwest::Response, bytes: usize) {
    use futures::StreamExt;
    let mut stream = resp.bytes_stream();
    let mut seen = 0;
    while let Some(chunk) = stream.next().await {
        seen += chunk.expect("a chunk of the stream").len();
        if seen > bytes {
            break;
        }
    }
}

/// Whether every live worker in an `/admin/workers` answer has its whole KV (or latent) pool
/// free and, when `slots` is given, that many free state slots on every DP group.
pub fn pools_full(workers: &serde_json::Value, slots: Option<u64>) -> bool {
    workers["workers"]
        .as_array()
        .expect("workers list")
        .iter()
        .filter(|w| w["error"].is_null())
        .all(|w| {
            w["kv_blocks_free"] == w["kv_blocks_total"]
                && slots.is_none_or(|n| {
                    w["dp_free_slots"]
                        .as_array()
                        .expect("dp_free_slots")
                        .iter()
                        .all(|f| *f == n)
                })
        })
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
    /// A different model directory for the decode worker (mismatch tests).
    pub decode_model: Option<PathBuf>,
    /// Start a prefill and a decode worker (the P/D pair).
    pub pd_pair: bool,
    /// Also start an aggregated worker (`--role both`) and list it.
    pub aggregated: bool,
    /// Extra YAML appended to the router's config (e.g. a `timeouts:` section).
    pub router_config: String,
    /// Start a second decode worker (process name `decode2`), listed after the first.
    pub second_decode: bool,
    /// Start an etcd; workers register there and the router finds them through it (no
    /// static lists).
    pub discovery: bool,
    /// Put a `tandem chaos proxy` (no faults until its admin port says so) between the
    /// router and each of the prefill and decode workers.
    pub proxies: bool,
    /// Extra arguments of the router (e.g. `--record-trace FILE`).
    pub router_args: Vec<String>,
    /// HTTPS on the router and mutual TLS between it and the workers, with certificates
    /// from `tandem tls generate` in [`Cluster::tls_dir`]; with `discovery`, etcd serves TLS
    /// too and requires client certificates (each process presents its own).
    pub tls: bool,
}

impl Default for ClusterOptions {
    fn default() -> Self {
        Self {
            kv_blocks: 512,
            // Landing arenas small enough for many test clusters at once (long prompts then
            // fall back to the transport).
            worker_env: vec![
                ("UCX_TLS".into(), "tcp".into()),
                ("TANDEM_KV_LANDING_MIB".into(), "8".into()),
            ],
            model: None,
            prefill_args: Vec::new(),
            decode_args: Vec::new(),
            dead_workers: false,
            decode_model: None,
            router_config: String::new(),
            second_decode: false,
            pd_pair: true,
            aggregated: false,
            discovery: false,
            proxies: false,
            router_args: Vec::new(),
            tls: false,
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
    /// Aggregated worker's gRPC address (empty without one).
    pub aggregated_addr: String,
    /// Admin URLs of the chaos proxies (`proxies`), prefill's then decode's.
    pub proxy_admins: Vec<String>,
    admin_addrs: std::collections::HashMap<String, String>,
    _dead: Vec<DeadPort>,
    /// The etcd of a discovery cluster.
    pub etcd: Option<tandem_testkit::Etcd>,
    /// Arguments every worker gets (model, KV blocks, discovery).
    worker_args: Vec<String>,
    worker_env: Vec<(String, String)>,
    tx: mpsc::Sender<StartEvent>,
    events: mpsc::Receiver<StartEvent>,
    /// Lines the log tees have written, all processes together: [`Cluster::wait_log`] waits
    /// on it.
    written: logs::LinesWritten,
    /// Processes whose exit was seen while waiting for another's.
    exited: std::collections::HashSet<String>,
    /// With `tls`: `ca.crt`, and `NAME.crt`/`NAME.key` for `router`, `admin` and each
    /// worker process (`prefill`, `decode`, `decode2`, `both`).
    pub tls_dir: Option<PathBuf>,
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
        let model_s = model.display().to_string();
        let kv = opts.kv_blocks.to_string();
        // Every process binds port 0 and names its address in its ready line, so concurrent
        // tests never race for a port.
        let (tx, events) = mpsc::channel();
        let tls_dir = opts.tls.then(|| {
            let out = dir.path().join("tls");
            generate_certs(
                &out,
                None,
                &[
                    "router",
                    "admin",
                    "prefill",
                    "decode",
                    "decode2=decode",
                    "both=worker",
                    // etcd's server certificate: etcd checks only the chain and the address,
                    // not the role it names.
                    "etcd=admin",
                ],
            );
            out
        });
        let etcd = opts.discovery.then(|| match &tls_dir {
            Some(t) => tandem_testkit::Etcd::start_tls(tandem_testkit::EtcdServerTls {
                cert: t.join("etcd.crt"),
                key: t.join("etcd.key"),
                client_ca: t.join("ca.crt"),
            }),
            None => tandem_testkit::Etcd::start(),
        });
        let mut worker_args = vec![
            "--listen".to_string(),
            "127.0.0.1:0".into(),
            "--kv-blocks".into(),
            kv,
        ];
        if let Some(e) = &etcd {
            worker_args.extend([
                "--discovery".to_string(),
                e.url(),
                "--discovery-prefix".into(),
                "/e2e".into(),
                "--lease-ttl".into(),
                "3s".into(),
            ]);
        }
        let scheme = if opts.tls { "https" } else { "http" };
        let mut cluster = Self {
            tls_dir,
            children: Vec::new(),
            url: String::new(),
            prefill_addr: String::new(),
            decode_addr: String::new(),
            aggregated_addr: String::new(),
            proxy_admins: Vec::new(),
            admin_addrs: std::collections::HashMap::new(),
            _dead: Vec::new(),
            etcd,
            worker_args,
            worker_env: opts.worker_env.clone(),
            tx,
            events,
            written: logs::LinesWritten::default(),
            exited: std::collections::HashSet::new(),
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(120);
        let decode_model_s = opts.decode_model.as_ref().map(|d| d.display().to_string());
        let mut roles = Vec::new();
        if opts.pd_pair {
            roles.extend(["prefill", "decode"]);
            if opts.second_decode {
                roles.push("decode2");
            }
        }
        if opts.aggregated {
            roles.push("both");
        }
        for &role in &roles {
            let model_s = match (role, &decode_model_s) {
                ("decode", Some(d)) => d,
                _ => &model_s,
            };
            let extra = match role {
                "prefill" => &opts.prefill_args,
                "decode" | "decode2" => &opts.decode_args,
                _ => &[][..],
            };
            let mut args = vec!["--model".to_string(), model_s.clone()];
            args.extend(extra.iter().cloned());
            if cluster.etcd.is_some() {
                args.extend(["--worker-id".to_string(), role.to_string()]);
            }
            cluster.spawn_worker(role, if role == "decode2" { "decode" } else { role }, &args);
        }
        let mut addrs = cluster.wait_ready(roles.len(), deadline);
        let mut addr = |role: &str| {
            addrs
                .remove(role)
                .map(|a| format!("{scheme}://{a}"))
                .unwrap_or_default()
        };
        cluster.prefill_addr = addr("prefill");
        cluster.decode_addr = addr("decode");
        let decode2_addr = addr("decode2");
        cluster.aggregated_addr = addr("both");
        if opts.proxies {
            for (name, upstream) in [
                ("proxy-prefill", cluster.prefill_addr.clone()),
                ("proxy-decode", cluster.decode_addr.clone()),
            ] {
                let child = Command::new(&bin)
                    .args([
                        "chaos",
                        "proxy",
                        "--listen",
                        "127.0.0.1:0",
                        "--admin",
                        "127.0.0.1:0",
                    ])
                    .args(["--upstream", &upstream])
                    .stdout(Stdio::null())
                    .stderr(Stdio::piped())
                    .spawn()
                    .unwrap();
                cluster.adopt(name, child);
            }
            let mut addrs = cluster.wait_ready(2, deadline);
            for (name, field) in [("proxy-prefill", "prefill"), ("proxy-decode", "decode")] {
                let addr = format!("http://{}", addrs.remove(name).unwrap_or_default());
                match field {
                    "prefill" => cluster.prefill_addr = addr,
                    _ => cluster.decode_addr = addr,
                }
                let admin = cluster.admin_addrs.remove(name).unwrap_or_default();
                cluster.proxy_admins.push(format!("http://{admin}"));
            }
        }
        // Dead workers: listed in the router's config; their ports are bound here but never
        // listened on, so connecting is refused and no other process can take them.
        let (dead_p, dead_d) = if opts.dead_workers {
            let (a, b) = (DeadPort::new(), DeadPort::new());
            let entries = (
                format!(
                    "  - id: prefill-dead\n    address: http://127.0.0.1:{}\n",
                    a.port
                ),
                format!(
                    "  - id: decode-dead\n    address: http://127.0.0.1:{}\n",
                    b.port
                ),
            );
            cluster._dead = vec![a, b];
            entries
        } else {
            (String::new(), String::new())
        };
        let mut config = format!("listen: 127.0.0.1:0\nmodel:\n  served_name: {served}\n");
        if let Some(e) = &cluster.etcd {
            config.push_str(&format!(
                "discovery:\n  etcd:\n    endpoints: ['{}']\n    prefix: /e2e\n",
                e.url()
            ));
            if let Some(t) = &cluster.tls_dir {
                let file = |name: &str| t.join(name).display().to_string();
                config.push_str(&format!(
                    "    tls: {{ca: '{}', cert: '{}', key: '{}'}}\n",
                    file("ca.crt"),
                    file("router.crt"),
                    file("router.key")
                ));
            }
        } else if opts.pd_pair {
            config.push_str(&format!(
                "prefill:\n{dead_p}  - id: prefill-0\n    address: {}\ndecode:\n  - id: decode-0\n    address: {}\n{dead_d}",
                cluster.prefill_addr, cluster.decode_addr
            ));
            if !decode2_addr.is_empty() {
                config.push_str(&format!("  - id: decode-1\n    address: {decode2_addr}\n"));
            }
        }
        if opts.aggregated && cluster.etcd.is_none() {
            config.push_str(&format!(
                "aggregated:\n  - id: both-0\n    address: {}\n",
                cluster.aggregated_addr
            ));
        }
        if let Some(t) = &cluster.tls_dir {
            let file = |name: &str| t.join(name).display().to_string();
            let (ca, cert, key) = (file("ca.crt"), file("router.crt"), file("router.key"));
            config.push_str(&format!(
                "tls: {{cert: '{cert}', key: '{key}'}}\nworker_tls: {{ca: '{ca}', cert: '{cert}', key: '{key}'}}\n"
            ));
        }
        config.push_str(&opts.router_config);
        let config_path = cluster._dir.path().join("router.yaml");
        std::fs::write(&config_path, config).unwrap();
        let router = Command::new(&bin)
            .args([
                "router",
                "--config",
                &config_path.display().to_string(),
                "--model",
                &model_s,
            ])
            .args(&opts.router_args)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        cluster.adopt("router", router);
        let mut addrs = cluster.wait_ready(1, deadline);
        cluster.url = format!("{scheme}://{}", addrs.remove("router").unwrap_or_default());
        // Every listener is bound: the router must now reach both workers.
        let ready = format!("{}/ready", cluster.url);
        let ready = if opts.tls {
            let client = cluster.https_client();
            rt().block_on(async {
                client
                    .get(&ready)
                    .send()
                    .await
                    .is_ok_and(|r| r.status() == 200)
            })
        } else {
            probe::blocking_free_client()(&ready)
        };
        assert!(ready, "router not ready\n{}", cluster.logs());
        cluster
    }

    /// An HTTP client trusting the cluster's CA (a new one has no pooled connections).
    pub fn https_client(&self) -> reqwest::Client {
        let dir = self.tls_dir.as_ref().expect("a cluster started with tls");
        let ca = std::fs::read(dir.join("ca.crt")).expect("the cluster's CA");
        reqwest::Client::builder()
            .add_root_certificate(reqwest::Certificate::from_pem(&ca).expect("a PEM CA"))
            .tls_info(true)
            .build()
            .expect("a client")
    }

    /// Sends `signal` (e.g. `"STOP"`, `"CONT"`) to the process started as `name` (`prefill`,
    /// `decode`, `both`, `router`): how tests stall a worker without killing it.
    pub fn signal(&self, name: &str, signal: &str) {
        let (_, child) = self
            .children
            .iter()
            .find(|(n, _)| n == name)
            .unwrap_or_else(|| panic!("no process {name}"));
        let status = Command::new("kill")
            .args([format!("-{signal}"), child.id().to_string()])
            .status()
            .expect("kill");
        assert!(status.success(), "kill -{signal} {name}");
    }

    /// A file holding the pid of the process started as `name` (what `tandem chaos replay
    /// --process NAME=PIDFILE` reads), written on the first call.
    pub fn pid_file(&self, name: &str) -> PathBuf {
        let (_, child) = self
            .children
            .iter()
            .find(|(n, _)| n == name)
            .unwrap_or_else(|| panic!("no process {name}"));
        let path = self._dir.path().join(format!("{name}.pid"));
        std::fs::write(&path, child.id().to_string()).unwrap();
        path
    }

    /// Starts a worker process named `name` in `role` with the cluster's common arguments
    /// and `args` (it is adopted; wait for it with [`Cluster::wait_ready`]).
    fn spawn_worker(&mut self, name: &str, role: &str, args: &[String]) {
        let mut tls: Vec<String> = Vec::new();
        if let Some(t) = &self.tls_dir {
            let file = |n: String| t.join(n).display().to_string();
            tls.extend([
                "--tls-cert".to_string(),
                file(format!("{name}.crt")),
                "--tls-key".into(),
                file(format!("{name}.key")),
                "--tls-client-ca".into(),
                file("ca.crt".into()),
            ]);
            if self.etcd.is_some() {
                tls.extend([
                    "--etcd-ca".to_string(),
                    file("ca.crt".into()),
                    "--etcd-cert".into(),
                    file(format!("{name}.crt")),
                    "--etcd-key".into(),
                    file(format!("{name}.key")),
                ]);
            }
        }
        let child = Command::new(tandem_bin())
            .args(["worker", "--role", role])
            .args(&self.worker_args)
            .args(args)
            .args(tls)
            .envs(
                self.worker_env
                    .iter()
                    .map(|(k, v)| (k.as_str(), v.as_str())),
            )
            .env("UCX_NET_DEVICES", "lo")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        self.adopt(name, child);
    }

    /// Starts one more worker (`role` `prefill`, `decode` or `both`) on the reference model,
    /// registered in the cluster's etcd under id `name`; returns its gRPC URL once it is
    /// ready (registered).
    pub fn add_worker(&mut self, name: &str, role: &str) -> String {
        assert!(self.etcd.is_some(), "add_worker needs a discovery cluster");
        let model = tandem_testkit::smollm2_dir().display().to_string();
        let args = [
            "--model".to_string(),
            model,
            "--worker-id".into(),
            name.into(),
        ];
        self.spawn_worker(name, role, &args);
        let mut addrs = self.wait_ready(1, Instant::now() + Duration::from_secs(120));
        let scheme = if self.tls_dir.is_some() {
            "https"
        } else {
            "http"
        };
        format!("{scheme}://{}", addrs.remove(name).unwrap_or_default())
    }

    /// Waits (up to `limit`) until the process started as `name` exits; its exit status.
    pub fn wait_exit(&mut self, name: &str, limit: Duration) -> std::process::ExitStatus {
        let deadline = Instant::now() + limit;
        while !self.exited.contains(name) {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.events.recv_timeout(left) {
                Ok(StartEvent::Exited(n)) => {
                    self.exited.insert(n);
                }
                Ok(_) => {}
                Err(_) => panic!("{name} did not exit within {limit:?}\n{}", self.logs()),
            }
        }
        let (_, child) = self
            .children
            .iter_mut()
            .find(|(n, _)| n == name)
            .unwrap_or_else(|| panic!("no process {name}"));
        child.wait().expect("wait")
    }

    /// Keeps `child` (its stderr piped) as process `name`; its log is teed to a file
    /// ([`Cluster::log`]) and its "… ready" line (logged once its listener is bound, with the
    /// address) or the end of its output arrives on the cluster's event channel
    /// ([`Cluster::wait_exit`] waits for the latter).
    pub fn adopt(&mut self, name: &str, mut child: Child) {
        let stderr = child.stderr.take().expect("stderr is piped");
        let log = std::fs::File::create(self._dir.path().join(format!("{name}.log"))).unwrap();
        let (owned, tx, written) = (name.to_string(), self.tx.clone(), self.written.clone());
        std::thread::spawn(move || logs::tee_log(stderr, log, &owned, &tx, &written));
        self.children.push((name.to_string(), child));
    }

    /// Waits for `count` ready lines; returns each process's bound address by name.
    fn wait_ready(
        &mut self,
        count: usize,
        deadline: Instant,
    ) -> std::collections::HashMap<String, String> {
        let mut addrs = std::collections::HashMap::new();
        while addrs.len() < count {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.events.recv_timeout(left) {
                Ok(StartEvent::Ready(name, addr, admin)) => {
                    if !admin.is_empty() {
                        self.admin_addrs.insert(name.clone(), admin);
                    }
                    addrs.insert(name, addr);
                }
                Ok(StartEvent::Exited(name)) => {
                    panic!("{name} exited during start-up\n{}", self.logs())
                }
                Err(_) => panic!("cluster not ready in time\n{}", self.logs()),
            }
        }
        addrs
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
    /// Its "… ready" log line: (name, the `host:port` it listens on, its admin `host:port`
    /// if it has one).
    Ready(String, String, String),
    /// Its output ended: it exited.
    Exited(String),
}

/// Runs `tandem tls generate --out OUT [--ca CA] COMPONENTS…` (a new CA unless `ca` names
/// a directory holding one).
pub fn generate_certs(out: &std::path::Path, ca: Option<&std::path::Path>, components: &[&str]) {
    let mut cmd = Command::new(tandem_bin());
    cmd.args(["tls", "generate", "--out"]).arg(out);
    if let Some(ca) = ca {
        cmd.arg("--ca").arg(ca);
    }
    let done = cmd.args(components).output().expect("tandem tls generate");
    assert!(
        done.status.success(),
        "tandem tls generate failed: {}",
        String::from_utf8_lossy(&done.stderr)
    );
}

/// A loopback port bound for the life of the value but never listened on: connecting to it
/// is refused, and no other process can take it.
pub struct DeadPort {
    _socket: socket2::Socket,
    /// The port.
    pub port: u16,
}

impl DeadPort {
    /// Binds a fresh one.
    pub fn new() -> Self {
        let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)
            .expect("socket");
        let any: std::net::SocketAddr = "127.0.0.1:0".parse().expect("address");
        socket.bind(&any.into()).expect("bind");
        let port = socket
            .local_addr()
            .ok()
            .and_then(|a| a.as_socket())
            .map(|a| a.port())
            .expect("bound port");
        Self {
            _socket: socket,
            port,
        }
    }
}

impl Default for DeadPort {
    fn default() -> Self {
        Self::new()
    }
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

/// Free bytes of /dev/shm (0 when it cannot be read): tests of the shared-memory landing
/// path skip when a small /dev/shm (e.g. a container's 64 MB) cannot hold their arenas.
pub fn shm_free_bytes() -> u64 {
    let out = std::process::Command::new("df")
        .args(["-B1", "--output=avail", "/dev/shm"])
        .output();
    out.ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|t| t.lines().nth(1).and_then(|l| l.trim().parse().ok()))
        .unwrap_or(0)
}
