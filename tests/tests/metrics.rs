//! The router's `/metrics` end to end: a real router, prefill and decode worker on loopback,
//! requests over HTTP, then a scrape. vLLM's families are there with `model_name`, move by
//! what the requests did, and equal their `tandem_*` twins; the per-worker P/D families fill
//! in from the health polls; and every metric the chart's Grafana dashboard
//! (helm/tandem/dashboards/tandem.json) queries is one this scrape holds, so the dashboard
//! cannot name a metric nothing exports (scripts/helm/test_chart.py checks the chart ships
//! that file unchanged).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::Duration;
use tandem_e2e::{metrics_text, post, rt, Cluster, ClusterOptions};

const MODEL: &str = "smollm2-135m-instruct";

/// A scrape: each series (`name{labels}` as written) with its value.
struct Scrape(BTreeMap<String, f64>);

impl Scrape {
    async fn take(c: &reqwest::Client, url: &str) -> Self {
        let text = metrics_text(c, url).await;
        let series = text
            .lines()
            .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
            .map(|l| {
                let (series, value) = l.rsplit_once(' ').expect("`series value`");
                let value = value
                    .parse()
                    .unwrap_or_else(|_| panic!("a number in {l:?}"));
                (series.to_string(), value)
            })
            .collect();
        Self(series)
    }

    /// The value of one series, written exactly as the exposition writes it.
    fn get(&self, series: &str) -> f64 {
        *self
            .0
            .get(series)
            .unwrap_or_else(|| panic!("no series {series} in\n{}", self.dump()))
    }

    /// `name`'s series with `model_name` the served model and no other label.
    fn vllm(&self, name: &str) -> f64 {
        self.get(&format!("{name}{{model_name=\"{MODEL}\"}}"))
    }

    /// The sum over every series of `name` whose labels contain each of `labels`.
    fn sum(&self, name: &str, labels: &[&str]) -> f64 {
        self.0
            .iter()
            .filter(|(s, _)| {
                s.split('{').next() == Some(name) && labels.iter().all(|l| s.contains(l))
            })
            .map(|(_, v)| v)
            .sum()
    }

    /// The metric names the scrape holds (histograms' `_bucket`, `_sum`, `_count` each).
    fn names(&self) -> BTreeSet<&str> {
        self.0
            .keys()
            .map(|s| s.split('{').next().expect("a name"))
            .collect()
    }

    fn dump(&self) -> String {
        self.0.iter().map(|(s, v)| format!("{s} {v}\n")).collect()
    }
}

/// Scrapes until `ready` holds of the scrape (the per-worker families appear with the
/// router's next health poll after the workers answered); fails after 30 s.
async fn scrape_until(c: &reqwest::Client, url: &str, ready: impl Fn(&Scrape) -> bool) -> Scrape {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    loop {
        tick.tick().await;
        let s = Scrape::take(c, url).await;
        if ready(&s) {
            return s;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the metrics never got there:\n{}",
            s.dump()
        );
    }
}

/// PromQL's aggregation operators (written `sum by (x) (…)`, so not always before a `(`).
const AGGREGATIONS: [&str; 6] = ["sum", "max", "min", "avg", "count", "topk"];

/// The metric names a PromQL expression reads: identifiers outside label selectors, ranges
/// and strings that are neither functions, aggregations, `by (…)` groupings nor
/// `label_values`' label.
fn promql_metrics(expr: &str) -> Vec<String> {
    let chars: Vec<char> = expr.chars().collect();
    let mut names = Vec::new();
    let mut i = 0;
    let skip_to = |from: usize, close: char| {
        (from..chars.len())
            .find(|&j| chars[j] == close)
            .map_or(chars.len(), |j| j + 1)
    };
    let next_non_space = |from: usize| chars[from..].iter().copied().find(|c| !c.is_whitespace());
    let prev_non_space = |to: usize| {
        chars[..to]
            .iter()
            .rev()
            .copied()
            .find(|c| !c.is_whitespace())
    };
    while i < chars.len() {
        match chars[i] {
            '{' => i = skip_to(i + 1, '}'),
            '[' => i = skip_to(i + 1, ']'),
            '"' => i = skip_to(i + 1, '"'),
            '$' => i += 1,
            c if c.is_ascii_alphabetic() || c == '_' || c == ':' => {
                let start = i;
                while i < chars.len()
                    && (chars[i].is_ascii_alphanumeric() || chars[i] == '_' || chars[i] == ':')
                {
                    i += 1;
                }
                let word: String = chars[start..i].iter().collect();
                if start > 0 && chars[start - 1] == '$' {
                    continue; // a dashboard variable
                }
                if word == "by" {
                    let open = (i..chars.len()).find(|&j| chars[j] == '(').expect("by (…)");
                    i = skip_to(open + 1, ')');
                } else if !AGGREGATIONS.contains(&word.as_str())
                    && next_non_space(i) != Some('(')
                    && prev_non_space(start) != Some(',')
                {
                    names.push(word);
                }
            }
            _ => i += 1,
        }
    }
    names
}

/// Every query of the chart's dashboard: panels' targets and template variables.
fn dashboard_queries() -> Vec<String> {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../helm/tandem/dashboards/tandem.json");
    let text = std::fs::read_to_string(&path).expect("the dashboard file");
    let dashboard: Value = serde_json::from_str(&text).expect("dashboard JSON");
    let mut queries: Vec<String> = dashboard["panels"]
        .as_array()
        .expect("panels")
        .iter()
        .flat_map(|p| p["targets"].as_array().cloned().unwrap_or_default())
        .map(|t| t["expr"].as_str().expect("a target's expr").to_string())
        .collect();
    for v in dashboard["templating"]["list"]
        .as_array()
        .expect("variables")
    {
        if v["type"] == "query" {
            queries.push(v["query"]["query"].as_str().expect("a query").to_string());
        }
    }
    queries
}

#[test]
fn promql_metric_names_skip_labels_functions_and_variables() {
    assert_eq!(
        promql_metrics(
            r#"histogram_quantile(0.9, sum by (le) (rate(vllm:ttft_bucket{model_name=~"$m"}[$__rate_interval]))) / max by (engine) (b_total) > 0"#
        ),
        ["vllm:ttft_bucket", "b_total"]
    );
    assert_eq!(
        promql_metrics("label_values(vllm:num_requests_running, model_name)"),
        ["vllm:num_requests_running"]
    );
}

#[test]
fn vllm_families_follow_requests_and_the_dashboard_reads_only_exported_metrics() {
    let cluster = Cluster::start(ClusterOptions {
        router_config: "health: {interval: 100ms}\nadmission: {max_running: 8}\n".into(),
        ..ClusterOptions::default()
    });
    let url = cluster.url.clone();
    rt().block_on(async move {
        let c = reqwest::Client::new();
        let before = Scrape::take(&c, &url).await;
        let completions = format!("{url}/v1/completions");
        let prompt = "The capital of France is";
        let (status, stopped) = post(
            &c,
            &completions,
            json!({"prompt": prompt, "max_tokens": 32, "temperature": 0}),
        )
        .await;
        assert_eq!(status, 200, "{stopped}");
        assert_eq!(stopped["choices"][0]["finish_reason"], "stop");
        let (status, cut) = post(
            &c,
            &completions,
            json!({"prompt": prompt, "max_tokens": 3, "temperature": 0}),
        )
        .await;
        assert_eq!(status, 200, "{cut}");
        assert_eq!(cut["choices"][0]["finish_reason"], "length");
        let usage = |b: &Value, k: &str| b["usage"][k].as_f64().expect("usage");
        let prompt_tokens = usage(&stopped, "prompt_tokens") + usage(&cut, "prompt_tokens");
        let completion_tokens =
            usage(&stopped, "completion_tokens") + usage(&cut, "completion_tokens");

        // The health polls after the requests: every worker's families, and the KV the
        // prefill worker sent.
        let after = scrape_until(&c, &url, |s| {
            s.sum("tandem_kv_transfer_bytes_total", &["role=\"prefill\""]) > 0.0
                && s.sum("tandem_kv_transfer_seconds_count", &["role=\"prefill\""]) >= 2.0
                && s.sum("tandem_worker_breaker_state", &[]) == 2.0
        })
        .await;
        let delta = |name: &str| after.vllm(name) - before.vllm(name);
        let success = |s: &Scrape, reason: &str| {
            s.get(&format!(
                "vllm:request_success_total{{finished_reason=\"{reason}\",model_name=\"{MODEL}\"}}"
            ))
        };
        assert_eq!(success(&after, "stop") - success(&before, "stop"), 1.0);
        assert_eq!(success(&after, "length") - success(&before, "length"), 1.0);
        assert_eq!(success(&after, "abort"), 0.0);
        assert_eq!(delta("vllm:prompt_tokens_total"), prompt_tokens);
        assert!(
            delta("vllm:generation_tokens_total") >= completion_tokens,
            "{} tokens generated, {completion_tokens} in the answers",
            delta("vllm:generation_tokens_total")
        );
        for histogram in [
            "vllm:time_to_first_token_seconds_count",
            "vllm:e2e_request_latency_seconds_count",
            "vllm:request_queue_time_seconds_count",
        ] {
            assert_eq!(delta(histogram), 2.0, "{histogram}");
        }
        assert!(delta("vllm:time_to_first_token_seconds_sum") > 0.0);
        // Every token after a request's first is one inter-token observation.
        assert!(delta("vllm:inter_token_latency_seconds_count") >= completion_tokens - 2.0);
        assert_eq!(
            delta("vllm:time_per_output_token_seconds_count"),
            delta("vllm:inter_token_latency_seconds_count")
        );
        assert_eq!(after.vllm("vllm:num_requests_running"), 0.0);
        assert_eq!(after.vllm("vllm:num_requests_waiting"), 0.0);
        // One observation, two names.
        assert_eq!(
            after.vllm("vllm:time_to_first_token_seconds_count"),
            after.get("tandem_time_to_first_token_seconds_count")
        );
        assert_eq!(
            after.vllm("vllm:generation_tokens_total"),
            after.get("tandem_generation_tokens_total")
        );

        for worker in ["prefill-0", "decode-0"] {
            let usage = after.get(&format!(
                "vllm:kv_cache_usage_perc{{engine=\"{worker}\",model_name=\"{MODEL}\"}}"
            ));
            assert!((0.0..=1.0).contains(&usage), "{worker}: {usage}");
            assert_eq!(
                after.sum(
                    "tandem_worker_breaker_state",
                    &[&format!("worker=\"{worker}\""), "state=\"closed\""]
                ),
                1.0,
                "{worker}'s breaker is closed"
            );
            assert_eq!(
                after.sum(
                    "tandem_worker_breaker_state",
                    &[&format!("worker=\"{worker}\"")]
                ),
                1.0,
                "{worker} is in one state"
            );
        }
        // The prefill worker's pushes, timed by the worker: one per request (both sent KV).
        assert_eq!(
            after.sum("tandem_kv_transfer_seconds_count", &["role=\"prefill\""]),
            2.0
        );
        assert!(after.sum("tandem_kv_transfer_bytes_sum", &["role=\"prefill\""]) > 0.0);
        assert_eq!(after.sum("tandem_handoff_failures_total", &[]), 0.0);
        assert_eq!(after.get("tandem_migrations_total"), 0.0);

        let exported = after.names();
        let mut read = 0;
        for query in dashboard_queries() {
            let names = promql_metrics(&query);
            assert!(!names.is_empty(), "no metric in {query}");
            for name in names {
                assert!(
                    exported.contains(name.as_str()),
                    "the dashboard reads {name}, which /metrics does not export ({query})"
                );
                read += 1;
            }
        }
        assert!(read >= 20, "{read} metric reads in the dashboard");
    });
}
