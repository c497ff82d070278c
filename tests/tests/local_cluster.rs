//! `tandem run` as `make run` starts it: three processes come up, the printed curl works,
//! and an interrupt stops all of them.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::Duration;
use tandem_e2e::{free_port, tandem_bin};

#[test]
fn run_serves_and_an_interrupt_stops_every_process() {
    let model = tandem_testkit::smollm2_dir();
    let port = free_port();
    let mut child = Command::new(tandem_bin())
        .args([
            "run",
            "--port",
            &port.to_string(),
            "--model",
            model.to_str().unwrap(),
            "--kv-blocks",
            "128",
        ])
        .env("UCX_TLS", "tcp")
        .env("UCX_NET_DEVICES", "lo")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The launcher logs each worker's address ("… worker listening on 127.0.0.1:PORT") on
    // stderr.
    let stderr = child.stderr.take().unwrap();
    let log = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
    let log_writer = log.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let mut l = log_writer.lock().unwrap();
            l.push_str(&line);
            l.push('\n');
        }
    });
    let stdout = child.stdout.take().unwrap();
    let mut lines = BufReader::new(stdout).lines();
    let mut banner = String::new();
    for line in lines.by_ref() {
        let line = line.unwrap();
        banner.push_str(&line);
        banner.push('\n');
        if line.contains("curl") {
            break;
        }
    }
    assert!(banner.contains("tandem is ready"), "{banner}");
    assert!(
        banner.contains(&format!("http://127.0.0.1:{port}/v1/chat/completions")),
        "{banner}"
    );
    let answer = tandem_e2e::post_json(
        &format!("http://127.0.0.1:{port}/v1/chat/completions"),
        r#"{"messages":[{"role":"user","content":"What is the capital of France?"}],"max_tokens":32,"temperature":0}"#,
    );
    assert!(
        answer.contains("The capital of France is Paris."),
        "{answer}"
    );

    // Interrupt the launcher only; it must stop its three children and exit.
    let pid = child.id().to_string();
    Command::new("kill").args(["-INT", &pid]).status().unwrap();
    // Wait for the launcher's exit on a thread, bounded by a deadline.
    let (tx, exited) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait());
    });
    let status = match exited.recv_timeout(Duration::from_secs(30)) {
        Ok(status) => status.unwrap(),
        Err(_) => {
            let _ = Command::new("kill").args(["-KILL", &pid]).status();
            panic!("tandem run did not exit after SIGINT");
        }
    };
    assert!(status.success(), "exit status {status}");
    // Nobody listens on the router port any more.
    assert!(
        TcpStream::connect(("127.0.0.1", port)).is_err(),
        "router still listening"
    );
    // Neither worker listens any more.
    let log = log.lock().unwrap().clone();
    let worker_ports: Vec<u16> = log
        .lines()
        .filter_map(|l| l.split(" worker listening on 127.0.0.1:").nth(1))
        .filter_map(|port| port.trim().parse().ok())
        .collect();
    assert_eq!(worker_ports.len(), 2, "launcher log:\n{log}");
    for p in worker_ports {
        assert!(
            TcpStream::connect(("127.0.0.1", p)).is_err(),
            "worker on {p} still listening"
        );
    }
}
