//! A single-node etcd on loopback, started as a child process (Debian's `etcd-server`; `.ci/run`
//! installs it): its own data folder and ports, ready once it logs that it serves clients,
//! killed on drop; plain, or serving TLS and requiring client certificates
//! ([`LocalEtcd::start_tls`]). For tests (`tandem_testkit::Etcd`) and benchmarks, not for
//! deployments.

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// A running etcd.
#[derive(Debug)]
pub struct LocalEtcd {
    child: Option<Child>,
    client_port: u16,
    peer_port: u16,
    dir: tempfile::TempDir,
    tls: Option<ServerTls>,
}

/// The PEM files of an etcd serving TLS to clients that present a certificate.
#[derive(Clone, Debug)]
pub struct ServerTls {
    /// Its server certificate (valid for 127.0.0.1).
    pub cert: PathBuf,
    /// The certificate's key.
    pub key: PathBuf,
    /// The CA client certificates must be signed by.
    pub client_ca: PathBuf,
}

fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

impl LocalEtcd {
    /// Starts one and waits (up to 30 s) until it serves clients; panics with the reason
    /// when it cannot (tests).
    pub fn start() -> Self {
        Self::try_start().unwrap_or_else(|e| panic!("{e}"))
    }

    /// Starts one and waits (up to 30 s) until it serves clients.
    pub fn try_start() -> Result<Self, String> {
        Self::try_start_with(None)
    }

    /// Starts one serving its client port over TLS with `tls`, with `--client-cert-auth`
    /// (a client without a certificate signed by `tls.client_ca` is refused); panics with the
    /// reason when it cannot (tests).
    pub fn start_tls(tls: ServerTls) -> Self {
        Self::try_start_with(Some(tls)).unwrap_or_else(|e| panic!("{e}"))
    }

    fn try_start_with(tls: Option<ServerTls>) -> Result<Self, String> {
        let io = |e: std::io::Error| format!("starting etcd: {e}");
        let mut etcd = Self {
            child: None,
            client_port: free_port().map_err(io)?,
            peer_port: free_port().map_err(io)?,
            dir: tempfile::tempdir().map_err(io)?,
            tls,
        };
        etcd.spawn()?;
        Ok(etcd)
    }

    /// Its client URL, `http://127.0.0.1:PORT` (`https://` with TLS).
    pub fn url(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://127.0.0.1:{}", self.client_port)
    }

    /// Its data folder.
    pub fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// Kills it (SIGKILL: nothing is flushed that a crash would not lose either).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Kills it and starts it again on the same data and ports; panics when it cannot.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn().unwrap_or_else(|e| panic!("{e}"));
    }

    fn spawn(&mut self) -> Result<(), String> {
        let client = self.url();
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let mut command = Command::new("etcd");
        if let Some(tls) = &self.tls {
            command
                .arg("--cert-file")
                .arg(&tls.cert)
                .arg("--key-file")
                .arg(&tls.key)
                .arg("--trusted-ca-file")
                .arg(&tls.client_ca)
                .arg("--client-cert-auth");
        }
        let mut child = command
            .args(["--name", "t", "--data-dir"])
            .arg(self.data_dir())
            .args([
                "--listen-client-urls",
                &client,
                "--advertise-client-urls",
                &client,
            ])
            .args([
                "--listen-peer-urls",
                &peer,
                "--initial-advertise-peer-urls",
                &peer,
            ])
            .args(["--initial-cluster", &format!("t={peer}")])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| {
                format!("starting etcd ({e}): install it with `apt-get install etcd-server`")
            })?;
        let stderr = child.stderr.take().ok_or("etcd's stderr is not piped")?;
        let (tx, ready) = mpsc::channel();
        // Drains etcd's log for its whole life (a full pipe would stall it).
        std::thread::spawn(move || {
            let mut tx = Some(tx);
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if line.contains("ready to serve client requests") {
                    if let Some(tx) = tx.take() {
                        let _ = tx.send(());
                    }
                }
            }
        });
        if ready.recv_timeout(Duration::from_secs(30)).is_err() {
            let _ = child.kill();
            return Err(format!("etcd did not become ready on {client}"));
        }
        self.child = Some(child);
        Ok(())
    }
}

impl Drop for LocalEtcd {
    fn drop(&mut self) {
        self.kill();
    }
}
