//! `tandem bench serve` against a real P/D cluster: a single run's JSON counts every request
//! and token, and an A/B/B/A comparison (both arms the same cluster, one request at a time,
//! greedy) finds every arm's outputs byte-identical to A's and meets a lenient gate.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;
use tandem_e2e::{tandem_bin, Cluster, ClusterOptions};

/// Runs `tandem bench serve ARGS --json FILE` and returns the parsed JSON.
fn bench_serve(cluster: &Cluster, args: &[&str]) -> serde_json::Value {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let json = dir.path().join("result.json");
    let out = Command::new(tandem_bin())
        .args(["bench", "serve"])
        .args(args)
        .arg("--json")
        .arg(&json)
        .output()
        .expect("tandem bench serve runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        cluster.dump_logs();
    }
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    print!("{stdout}");
    serde_json::from_str(&std::fs::read_to_string(&json).expect("the JSON result"))
        .expect("valid JSON")
}

#[test]
fn bench_serve_counts_a_run_and_finds_abba_arms_identical() {
    let cluster = Cluster::start(ClusterOptions::default());

    let single = bench_serve(
        &cluster,
        &[
            "--base-url",
            &cluster.url,
            "--num-prompts",
            "5",
            "--random-input-len",
            "16",
            "--random-output-len",
            "4",
            "--ignore-eos",
            "--num-warmups",
            "1",
            "--goodput",
            "ttft:600000",
        ],
    );
    assert_eq!(single["completed"], 5, "{single}");
    assert_eq!(single["failed"], 0, "{single}");
    assert_eq!(single["total_input_tokens"], 80, "{single}");
    assert_eq!(single["total_output_tokens"], 20, "{single}");
    assert_eq!(single["request_goodput"], single["request_throughput"]);
    assert!(single["p99_ttft_ms"].as_f64().expect("a TTFT p99") > 0.0);

    let dir = tempfile::tempdir().expect("a temporary directory");
    let prompts = dir.path().join("prompts.jsonl");
    std::fs::write(
        &prompts,
        "{\"prompt\": \"What is the capital of France?\"}\n{\"prompt\": \"Count to five.\"}\n",
    )
    .expect("writing the prompts");
    let arms = format!("A={0},B={0}", cluster.url);
    let abba = bench_serve(
        &cluster,
        &[
            "--endpoint",
            "/v1/chat/completions",
            "--dataset-name",
            "jsonl",
            "--dataset-path",
            prompts.to_str().expect("a UTF-8 path"),
            "--output-len",
            "4",
            "--num-prompts",
            "2",
            "--max-concurrency",
            "1",
            "--arms",
            &arms,
            "--order",
            "ABBA",
            "--blocks",
            "1",
            "--gate",
            "throughput:-99%",
        ],
    );
    assert_eq!(abba["order"], serde_json::json!(["A0", "B0", "B1", "A1"]));
    for arm in ["A", "B"] {
        assert_eq!(abba["arms"][arm]["completed"], 4, "{abba}");
        assert_eq!(
            abba["arms"][arm]["blocks"].as_array().map(Vec::len),
            Some(2)
        );
        assert_eq!(abba["bitwise_identical"][arm]["identical"], true, "{abba}");
    }
    assert!(abba["drift"]["throughput_pct"].is_number(), "{abba}");
    assert_eq!(abba["verdict"], true, "{abba}");
}
