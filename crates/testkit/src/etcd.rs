//! A real etcd server on loopback for tests (Debian's `etcd-server`; `.ci/run` installs it):
//! its own data folder and ports, ready once it logs that it serves clients, killed on drop.

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// A running etcd.
pub struct Etcd {
    child: Option<Child>,
    client_port: u16,
    peer_port: u16,
    dir: tempfile::TempDir,
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl Etcd {
    /// Starts one and waits (up to 30 s) until it serves clients.
    pub fn start() -> Self {
        let mut etcd = Self {
            child: None,
            client_port: free_port(),
            peer_port: free_port(),
            dir: tempfile::tempdir().unwrap(),
        };
        etcd.spawn();
        etcd
    }

    /// Its client URL, `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
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

    /// Kills it and starts it again on the same data and ports.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    fn spawn(&mut self) {
        let client = self.url();
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let mut child = Command::new("etcd")
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
            .unwrap_or_else(|e| {
                panic!("starting etcd ({e}): install it with `apt-get install etcd-server`")
            });
        let stderr = child.stderr.take().unwrap();
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
        assert!(
            ready.recv_timeout(Duration::from_secs(30)).is_ok(),
            "etcd did not become ready on {client}"
        );
        self.child = Some(child);
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.kill();
    }
}
