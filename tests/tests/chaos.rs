//! `tandem chaos` as an SRE uses it: proxies between the router and each worker, transfer
//! faults in the prefill worker's KV pushes, and `tandem chaos replay` judging a trace run
//! under faults against a fault-free run: nothing lost, hung, changed or leaked.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use serde_json::Value;
use std::process::Command;
use tandem_e2e::{tandem_bin, Cluster, ClusterOptions};

fn tandem(args: &[&str]) -> std::process::Output {
    Command::new(tandem_bin()).args(args).output().unwrap()
}

#[test]
fn a_trace_replayed_under_502s_resets_and_transfer_faults_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let transfer = dir.path().join("transfer.yaml");
    // The prefill worker's pushes: some aborted, some corrupted (the checksum must catch
    // every one), some lost outright (the decode side's KV lease must expire and the request
    // move on).
    std::fs::write(
        &transfer,
        "seed: 5\ntransfer: {abort: 0.04, corrupt: 0.04, drop: {probability: 0.03, limit: 1}}\n",
    )
    .unwrap();
    let transfer_s = transfer.display().to_string();
    let cluster = Cluster::start(ClusterOptions {
        proxies: true,
        prefill_args: vec!["--chaos-scenario".into(), transfer_s],
        decode_args: vec!["--kv-lease".into(), "3s".into()],
        ..ClusterOptions::default()
    });
    let trace = dir.path().join("trace.jsonl");
    let out = tandem(&[
        "chaos",
        "trace",
        "--out",
        trace.to_str().unwrap(),
        "--requests",
        "64",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // 502s as a sidecar answers them, and resets of the router's connection to a worker
    // (every stream multiplexed on it breaks), on both legs.
    let scenario = dir.path().join("proxies.yaml");
    std::fs::write(
        &scenario,
        "seed: 11\nhttp: {status_502: 0.06, reset: {probability: 0.03, limit: 2}}\n",
    )
    .unwrap();
    let verdict_path = dir.path().join("verdict.json");
    let mut args = vec![
        "chaos",
        "replay",
        "--trace",
        trace.to_str().unwrap(),
        "--target",
        &cluster.url,
        "--scenario",
        scenario.to_str().unwrap(),
        "--concurrency",
        "8",
        "--timeout",
        "60s",
        "--json",
        verdict_path.to_str().unwrap(),
    ];
    for a in &cluster.proxy_admins {
        args.extend(["--proxy-admin", a.as_str()]);
    }
    let out = tandem(&args);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("verdict: PASS"), "{stdout}");
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&verdict_path).unwrap()).unwrap();
    assert_eq!(v["sent"], 64, "{v}");
    assert_eq!(v["completed"], 64, "{v}");
    assert!(
        v["injected"]["http.status_502"].as_u64().unwrap() > 0,
        "no 502 was injected, the run proves nothing: {v}"
    );
    assert!(
        v["injected"]["http.reset"].as_u64().unwrap() > 0,
        "no connection was reset: {v}"
    );
    let prefill_log = cluster.log("prefill");
    assert!(
        prefill_log.contains("injecting a transfer fault"),
        "no transfer fault was injected"
    );
}

#[test]
fn bad_scenario_and_trace_files_are_refused_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.yaml");
    std::fs::write(&bad, "http: {status_502: 7}\n").unwrap();
    let out = tandem(&[
        "chaos",
        "proxy",
        "--listen",
        "127.0.0.1:0",
        "--upstream",
        "127.0.0.1:9",
        "--scenario",
        bad.to_str().unwrap(),
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("http.status_502: probability 7"), "{err}");
    let trace = dir.path().join("t.jsonl");
    std::fs::write(
        &trace,
        "{\"path\": \"/v1/completions\", \"body\": {}}\n{oops\n",
    )
    .unwrap();
    let out = tandem(&[
        "chaos",
        "replay",
        "--trace",
        trace.to_str().unwrap(),
        "--target",
        "http://127.0.0.1:9",
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("t.jsonl:2"), "{err}");
}
