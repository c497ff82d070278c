//! `tandem run` as `make run` starts it: its processes come up, the printed curl works, a
//! worker killed by its pid file is started again at its address, and an interrupt stops all
//! of them.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::Duration;
use tandem_e2e::{free_port, tandem_bin};

#[test]
fn run_serves_restarts_a_killed_worker_and_an_interrupt_stops_every_process() {
    let model = tandem_testkit::smollm2_dir();
    let port = free_port();
    let state = tempfile::tempdir().unwrap();
    let mut child = Command::new(tandem_bin())
        .args([
            "run",
            "--port",
            &port.to_string(),
            "--model",
            model.to_str().unwrap(),
            "--kv-blocks",
            "128",
            "--decode-workers",
            "2",
            "--state-dir",
            state.path().to_str().unwrap(),
        ])
        .env("UCX_TLS", "tcp")
        .env("UCX_NET_DEVICES", "lo")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The launcher logs each worker's address ("decode-0 (decode) listening on
    // 127.0.0.1:PORT") and its restarts on stderr; lines also arrive on `said`.
    let stderr = child.stderr.take().unwrap();
    let log = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
    let log_writer = log.clone();
    let (said_tx, said) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let mut l = log_writer.lock().unwrap();
            l.push_str(&line);
            l.push('\n');
            let _ = said_tx.send(line);
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
    // The curl the banner prints, answered.
    let answers_france = || {
        let answer = tandem_e2e::post_json(
            &format!("http://127.0.0.1:{port}/v1/chat/completions"),
            r#"{"messages":[{"role":"user","content":"What is the capital of France?"}],"max_tokens":32,"temperature":0}"#,
        );
        assert!(
            answer.contains("The capital of France is Paris."),
            "{answer}"
        );
    };
    answers_france();
    for id in ["prefill-0", "decode-0", "decode-1", "router"] {
        assert!(
            state.path().join(format!("{id}.pid")).exists(),
            "no pid file for {id}"
        );
    }

    // SIGKILL decode-0 by its pid file: the launcher starts it again at its address.
    let pid_file = state.path().join("decode-0.pid");
    let killed = std::fs::read_to_string(&pid_file).unwrap();
    Command::new("kill")
        .args(["-KILL", killed.trim()])
        .status()
        .unwrap();
    let back = loop {
        match said.recv_timeout(Duration::from_secs(120)) {
            Ok(line) if line.contains("decode-0 is back on") => break line,
            Ok(_) => continue,
            Err(_) => panic!("decode-0 did not come back:\n{}", log.lock().unwrap()),
        }
    };
    let restarted = std::fs::read_to_string(&pid_file).unwrap();
    assert_ne!(restarted.trim(), killed.trim(), "{back}");
    assert!(
        log.lock()
            .unwrap()
            .contains("decode-0 exited (killed by signal 9)"),
        "{back}"
    );
    // Every worker answers again, decode-0 at the address the router has for it.
    let workers = tandem_e2e::get_json(&format!(
        "http://127.0.0.1:{port}/admin/workers?wait_idle_ms=10000"
    ));
    let v: serde_json::Value = serde_json::from_str(&workers).unwrap();
    let list = v["workers"].as_array().unwrap();
    assert_eq!(list.len(), 3, "{v}");
    assert!(list.iter().all(|w| w["error"].is_null()), "{v}");
    answers_france();
    answers_france();

    // Interrupt the launcher only; it must stop its children and exit.
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
        .filter_map(|l| l.split(") listening on 127.0.0.1:").nth(1))
        .filter_map(|port| port.trim().parse().ok())
        .collect();
    assert_eq!(worker_ports.len(), 3, "launcher log:\n{log}");
    assert!(
        std::fs::read_dir(state.path()).unwrap().next().is_none(),
        "the launcher leaves its pid files and config behind"
    );
    for p in worker_ports {
        assert!(
            TcpStream::connect(("127.0.0.1", p)).is_err(),
            "worker on {p} still listening"
        );
    }
}
