//! The router's OpenAPI document against the running router: schemathesis (PyPI) generates
//! requests from `GET /openapi.json`, valid and invalid, for every operation, and sends them to
//! a real P/D cluster (router, prefill and decode processes). Every answer must be no server
//! error, of a documented status and content type, and valid against the document's schema.
//! Bounded in count: SmolLM2 is served with its context cut to 96 tokens (same weights), so
//! no generated request can ask for long generations.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;
use tandem_e2e::{Cluster, ClusterOptions};

/// SmolLM2's files with `max_position_embeddings` cut to `context`.
fn short_context_model(dir: &std::path::Path, context: u32) {
    let smol = tandem_testkit::smollm2_dir();
    std::fs::create_dir_all(dir).unwrap();
    for f in std::fs::read_dir(&smol).unwrap() {
        let f = f.unwrap();
        let name = f.file_name();
        if name != "config.json" {
            std::os::unix::fs::symlink(f.path(), dir.join(&name)).unwrap();
        }
    }
    let mut config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(smol.join("config.json")).unwrap()).unwrap();
    config["max_position_embeddings"] = context.into();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
}

#[test]
fn schemathesis_finds_no_server_error_and_no_answer_off_the_document() {
    let model = tempfile::tempdir().unwrap();
    short_context_model(model.path(), 96);
    let cluster = Cluster::start(ClusterOptions {
        model: Some(model.path().to_owned()),
        ..ClusterOptions::default()
    });
    let out = Command::new("python3")
        .args([
            "-m",
            "schemathesis.cli",
            "run",
            &format!("{}/openapi.json", cluster.url),
            "--checks",
            "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance",
            "--phases",
            "examples,fuzzing",
            "--max-examples",
            "20",
            "--workers",
            "2",
            "--request-timeout",
            "60",
            "--generation-deterministic",
            "--suppress-health-check",
            "all",
        ])
        .env("NO_COLOR", "1")
        .output()
        .expect("python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    print!("{stdout}");
    if !out.status.success() {
        cluster.dump_logs();
    }
    assert!(
        out.status.success(),
        "schemathesis found problems (or is not installed: python3 -m pip install schemathesis):\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    tandem_e2e::rt().block_on(async {
        let c = reqwest::Client::new();
        // The run really generated: answered 200s on both generation endpoints.
        let metrics = tandem_e2e::metrics_text(&c, &cluster.url).await;
        for endpoint in ["chat_completions", "completions"] {
            let served: f64 = metrics
                .lines()
                .filter(|l| {
                    l.starts_with("tandem_requests_total{")
                        && l.contains(&format!("endpoint=\"{endpoint}\""))
                        && l.contains("status=\"200\"")
                })
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .sum();
            assert!(served >= 3.0, "{endpoint}: {served} answered\n{metrics}");
        }
        // Nothing leaked: every KV block came back.
        let workers = tandem_e2e::workers_when_idle(&c, &cluster.url).await;
        assert!(tandem_e2e::pools_full(&workers, None), "{workers}");
    });
}
