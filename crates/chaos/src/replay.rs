//! Replaying a request trace against a router and judging the result against a fault-free
//! run of the same trace: what was lost, hung, answered with tokens repeated (a stream that
//! re-sent what the client already had), answered differently otherwise, and whether the
//! workers hold anything afterwards.
//!
//! A trace is JSON lines, one request each: `{"path": "/v1/completions", "body": {...}}`
//! (the body as a client sends it). `tandem chaos trace` writes a synthetic one.

use futures::StreamExt;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

/// One request of a trace.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TraceEntry {
    /// `/v1/completions` or `/v1/chat/completions`.
    pub path: String,
    /// The request body.
    pub body: Value,
}

/// Reads a JSON-lines trace, naming the line of any problem.
pub fn read_trace(path: &Path) -> Result<Vec<TraceEntry>, String> {
    let text =
        std::fs::read_to_string(path).map_err(|e| format!("reading {}: {e}", path.display()))?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let e: TraceEntry = serde_json::from_str(line)
            .map_err(|e| format!("{}:{}: not a trace entry ({e})", path.display(), i + 1))?;
        if !matches!(e.path.as_str(), "/v1/completions" | "/v1/chat/completions") {
            return Err(format!(
                "{}:{}: path {} is not /v1/completions or /v1/chat/completions",
                path.display(),
                i + 1,
                e.path
            ));
        }
        out.push(e);
    }
    if out.is_empty() {
        return Err(format!("{}: no requests", path.display()));
    }
    Ok(out)
}

/// A synthetic trace of `n` greedy requests for `model`: completions and chats, streamed
/// and not, of a few lengths (deterministic for a seed).
pub fn synth_trace(n: usize, seed: u64, model: &str) -> Vec<TraceEntry> {
    const PROMPTS: [&str; 6] = [
        "Once upon a time",
        "The capital of France is",
        "Write a haiku about the sea.",
        "List three prime numbers.",
        "Explain what a hash table is.",
        "The weather today",
    ];
    (0..n)
        .map(|i| {
            let k = (i as u64).wrapping_mul(2654435761).wrapping_add(seed) as usize;
            let prompt = PROMPTS[k % PROMPTS.len()];
            let stream = (k / 7).is_multiple_of(2);
            let max_tokens = [4, 8, 16, 24][(k / 3) % 4];
            if (k / 5).is_multiple_of(2) {
                TraceEntry {
                    path: "/v1/completions".into(),
                    body: json!({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                 "temperature": 0, "stream": stream}),
                }
            } else {
                TraceEntry {
                    path: "/v1/chat/completions".into(),
                    body: json!({"model": model, "messages": [{"role": "user", "content": prompt}],
                                 "max_tokens": max_tokens, "temperature": 0, "stream": stream}),
                }
            }
        })
        .collect()
}

/// How one request ended.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Outcome {
    /// Its place in the trace.
    pub index: usize,
    /// HTTP status (0: no response).
    pub status: u16,
    /// The error's class or type, for a failure (`http_502`, `transfer_failed`, `hung`, …).
    pub error: Option<String>,
    /// The generated text of a success.
    pub text: Option<String>,
    /// Milliseconds to the end of the response.
    pub millis: u64,
}

impl Outcome {
    /// Answered in full with a 2xx.
    pub fn completed(&self) -> bool {
        self.error.is_none() && self.text.is_some()
    }
}

fn text_of_json(v: &Value) -> Option<String> {
    let c = &v["choices"][0];
    c["text"]
        .as_str()
        .or_else(|| c["message"]["content"].as_str())
        .map(str::to_owned)
}

fn error_of(v: &Value) -> Option<String> {
    let e = v.get("error")?;
    Some(
        e["code"]
            .as_str()
            .or_else(|| e["type"].as_str())
            .unwrap_or("error")
            .to_string(),
    )
}

async fn one(
    client: &reqwest::Client,
    target: &str,
    index: usize,
    e: &TraceEntry,
    limit: Duration,
) -> Outcome {
    let started = Instant::now();
    let stream = e.body["stream"].as_bool().unwrap_or(false);
    let attempt = async {
        let resp = match client
            .post(format!("{target}{}", e.path))
            .json(&e.body)
            .send()
            .await
        {
            Ok(r) => r,
            Err(err) => return (0, Some(format!("connection: {}", short(&err))), None),
        };
        let status = resp.status().as_u16();
        if !resp.status().is_success() {
            let body: Value = resp.json().await.unwrap_or(Value::Null);
            return (
                status,
                Some(error_of(&body).unwrap_or_else(|| format!("http_{status}"))),
                None,
            );
        }
        if !stream {
            return match resp.json::<Value>().await {
                Ok(v) => match text_of_json(&v) {
                    Some(t) => (status, None, Some(t)),
                    None => (status, Some("malformed_response".into()), None),
                },
                Err(_) => (status, Some("malformed_response".into()), None),
            };
        }
        let mut raw = Vec::new();
        let mut body = resp.bytes_stream();
        while let Some(chunk) = body.next().await {
            match chunk {
                Ok(c) => raw.extend_from_slice(&c),
                Err(_) => return (status, Some("stream_broken".into()), None),
            }
        }
        let raw = String::from_utf8_lossy(&raw).to_string();
        let mut text = String::new();
        let mut done = false;
        for data in raw.lines().filter_map(|l| l.strip_prefix("data: ")) {
            if data == "[DONE]" {
                done = true;
                continue;
            }
            let Ok(v) = serde_json::from_str::<Value>(data) else {
                return (status, Some("malformed_event".into()), None);
            };
            if let Some(err) = error_of(&v) {
                return (status, Some(err), None);
            }
            let c = &v["choices"][0];
            if let Some(t) = c["text"]
                .as_str()
                .or_else(|| c["delta"]["content"].as_str())
            {
                text.push_str(t);
            }
        }
        if done {
            (status, None, Some(text))
        } else {
            (status, Some("stream_without_done".into()), None)
        }
    };
    let (status, error, text) = match tokio::time::timeout(limit, attempt).await {
        Ok(r) => r,
        Err(_) => (0, Some("hung".into()), None),
    };
    Outcome {
        index,
        status,
        error,
        text,
        millis: started.elapsed().as_millis() as u64,
    }
}

fn short(e: &reqwest::Error) -> String {
    if e.is_connect() {
        "connect".into()
    } else if e.is_timeout() {
        "timeout".into()
    } else {
        "request".into()
    }
}

/// Sends every entry to `target` (`http://host:port`), `concurrency` at a time; a request
/// still unanswered after `limit` counts as hung.
pub async fn replay(
    target: &str,
    entries: &[TraceEntry],
    concurrency: usize,
    limit: Duration,
) -> Vec<Outcome> {
    let client = reqwest::Client::new();
    let target = target.trim_end_matches('/');
    let mut outcomes: Vec<Outcome> = futures::stream::iter(entries.iter().enumerate())
        .map(|(i, e)| {
            let client = client.clone();
            async move { one(&client, target, i, e, limit).await }
        })
        .buffer_unordered(concurrency.max(1))
        .collect()
        .await;
    outcomes.sort_by_key(|o| o.index);
    outcomes
}

/// What the workers hold after a run, from the router's `/admin/workers` once they are idle.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Leaks {
    /// Workers that answered.
    pub workers: usize,
    /// Of those, the ones still holding KV blocks, state slots, reservations or requests.
    pub leaking: Vec<String>,
    /// Set when the router could not be asked.
    pub error: Option<String>,
}

/// Asks `target`'s `/admin/workers` (waiting up to 20 s for idle workers) what is held.
pub async fn leaks(target: &str) -> Leaks {
    let url = format!(
        "{}/admin/workers?wait_idle_ms=20000",
        target.trim_end_matches('/')
    );
    let v: Value = match reqwest::Client::new().get(&url).send().await {
        Ok(r) => match r.json().await {
            Ok(v) => v,
            Err(e) => {
                return Leaks {
                    error: Some(format!("{url}: {e}")),
                    ..Leaks::default()
                }
            }
        },
        Err(e) => {
            return Leaks {
                error: Some(format!("{url}: {e}")),
                ..Leaks::default()
            }
        }
    };
    let list = v["workers"].as_array().cloned().unwrap_or_default();
    let live: Vec<&Value> = list.iter().filter(|w| w["error"].is_null()).collect();
    let leaking = live
        .iter()
        .filter(|w| {
            w["kv_blocks_free"] != w["kv_blocks_total"]
                || w["pending_reservations"].as_u64().unwrap_or(0) > 0
                || w["running_requests"].as_u64().unwrap_or(0) > 0
                || w["dp_free_slots"].as_array().is_some_and(|s| {
                    // KDA state slots: every group's free count equal to the first's at rest.
                    s.windows(2).any(|p| p[0] != p[1])
                })
        })
        .map(|w| w["id"].as_str().unwrap_or("?").to_string())
        .collect();
    Leaks {
        workers: live.len(),
        leaking,
        error: None,
    }
}

/// The judgement of a run against its fault-free baseline.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Verdict {
    /// Requests sent.
    pub sent: usize,
    /// Answered in full.
    pub completed: usize,
    /// Failed (not hung), by error class or status.
    pub failed: BTreeMap<String, usize>,
    /// Not answered within the limit.
    pub hung: usize,
    /// Completed with the baseline's text with some stretch of it repeated ([`compare`]):
    /// tokens sent twice, as by a retried or migrated stream that re-sent what the client
    /// already had.
    #[serde(default)]
    pub duplicated: usize,
    /// Indices of the requests with repeated tokens (at most 20).
    #[serde(default)]
    pub duplicated_examples: Vec<usize>,
    /// Completed with a text that differs from the baseline's otherwise (skipped, corrupted
    /// or other tokens).
    pub differ: usize,
    /// Indices of the requests that differ (at most 20).
    pub differ_examples: Vec<usize>,
    /// Requests the baseline itself did not complete (not judged).
    pub baseline_failed: usize,
    /// What the workers held afterwards.
    pub leaks: Leaks,
    /// Faults injected by the proxies during the run, by kind.
    pub injected: BTreeMap<String, u64>,
}

impl Verdict {
    /// Judges `run` against `baseline` (same trace, same order).
    pub fn judge(run: &[Outcome], baseline: &[Outcome], leaks: Leaks) -> Self {
        let mut v = Verdict {
            sent: run.len(),
            leaks,
            ..Verdict::default()
        };
        for (o, b) in run.iter().zip(baseline) {
            if !b.completed() {
                v.baseline_failed += 1;
            }
            match &o.error {
                Some(e) if e == "hung" => v.hung += 1,
                Some(e) => *v.failed.entry(e.clone()).or_default() += 1,
                None => {
                    v.completed += 1;
                    let (Some(text), Some(expected)) = (&o.text, &b.text) else {
                        continue;
                    };
                    if !b.completed() {
                        continue;
                    }
                    let (count, examples) = match compare(text, expected) {
                        Comparison::Same => continue,
                        Comparison::Duplicated => (&mut v.duplicated, &mut v.duplicated_examples),
                        Comparison::Differs => (&mut v.differ, &mut v.differ_examples),
                    };
                    *count += 1;
                    if examples.len() < 20 {
                        examples.push(o.index);
                    }
                }
            }
        }
        v
    }

    /// Requests lost: failed or hung.
    pub fn lost(&self) -> usize {
        self.failed.values().sum::<usize>() + self.hung
    }

    /// Nothing lost, hung, duplicated, different or leaked (and the baseline itself
    /// complete).
    pub fn passed(&self) -> bool {
        self.lost() == 0
            && self.duplicated == 0
            && self.differ == 0
            && self.baseline_failed == 0
            && self.leaks.leaking.is_empty()
            && self.leaks.error.is_none()
    }

    /// The verdict as a table.
    pub fn table(&self) -> String {
        let failed = if self.failed.is_empty() {
            String::new()
        } else {
            let by: Vec<String> = self
                .failed
                .iter()
                .map(|(k, n)| format!("{k}: {n}"))
                .collect();
            format!("   ({})", by.join(", "))
        };
        let injected: Vec<String> = self
            .injected
            .iter()
            .filter(|(_, n)| **n > 0)
            .map(|(k, n)| format!("{k} {n}"))
            .collect();
        let leaks = match (&self.leaks.error, self.leaks.leaking.is_empty()) {
            (Some(e), _) => format!("unknown ({e})"),
            (None, true) => format!("none ({} workers idle, pools whole)", self.leaks.workers),
            (None, false) => format!("on {}", self.leaks.leaking.join(", ")),
        };
        format!(
            "  sent            {}\n  completed       {}\n  failed          {}{}\n  hung            {}\n  duplicated      {}{}\n  differ          {}{}\n  baseline failed {}\n  leaked          {}\n  injected        {}\nverdict: {}\n",
            self.sent,
            self.completed,
            self.failed.values().sum::<usize>(),
            failed,
            self.hung,
            self.duplicated,
            examples(&self.duplicated_examples),
            self.differ,
            examples(&self.differ_examples),
            self.baseline_failed,
            leaks,
            if injected.is_empty() { "nothing".to_string() } else { injected.join(", ") },
            if self.passed() { "PASS" } else { "FAIL" },
        )
    }
}

fn examples(indices: &[usize]) -> String {
    if indices.is_empty() {
        String::new()
    } else {
        format!("   (requests {indices:?})")
    }
}

/// How a completed answer compares with the fault-free one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Comparison {
    /// The same text.
    Same,
    /// The fault-free text with one or more stretches of it repeated: read from the start,
    /// the answer follows the fault-free text, at times going back to an earlier point and
    /// following it again from there, and ends where it ends. Tokens re-sent by a retried
    /// stream look like this (the text cannot tell which repeated characters were meant as a
    /// repeat, so an answer that merely happens to have this shape counts here too).
    Duplicated,
    /// Any other difference: tokens skipped, corrupted or replaced, or an answer cut short.
    Differs,
}

/// Compares `answer` with the fault-free `expected` answer to the same request.
pub fn compare(answer: &str, expected: &str) -> Comparison {
    if answer == expected {
        return Comparison::Same;
    }
    let expected: Vec<char> = expected.chars().collect();
    let Some(last) = expected.len().checked_sub(1) else {
        return Comparison::Differs;
    };
    // How far into `expected` the answer so far can have got. Going back to any earlier
    // point is allowed, so every position up to it is reachable too, and the furthest one
    // is all there is to keep: the next character continues from the latest position at or
    // before it where `expected` has that character.
    let mut reach = 0usize;
    for c in answer.chars() {
        match (0..=reach.min(last)).rev().find(|&q| expected[q] == c) {
            Some(q) => reach = q + 1,
            None => return Comparison::Differs,
        }
    }
    // Ending at the end after having gone back at least once (the texts are not equal).
    if reach == expected.len() {
        Comparison::Duplicated
    } else {
        Comparison::Differs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(index: usize, text: &str) -> Outcome {
        Outcome {
            index,
            status: 200,
            error: None,
            text: Some(text.into()),
            millis: 1,
        }
    }

    fn failed(index: usize, error: &str) -> Outcome {
        Outcome {
            index,
            status: 503,
            error: Some(error.into()),
            text: None,
            millis: 1,
        }
    }

    #[test]
    fn a_verdict_counts_every_way_a_request_can_go_wrong() {
        let baseline = vec![
            ok(0, "a"),
            ok(1, "b"),
            ok(2, "c"),
            ok(3, "d"),
            failed(4, "x"),
            ok(5, "The sky is blue."),
        ];
        let run = vec![
            ok(0, "a"),
            ok(1, "bc"),
            failed(2, "unavailable"),
            failed(3, "hung"),
            ok(4, "e"),
            ok(5, "The sky is sky is blue."),
        ];
        let v = Verdict::judge(
            &run,
            &baseline,
            Leaks {
                workers: 2,
                leaking: vec!["decode".into()],
                error: None,
            },
        );
        assert_eq!((v.sent, v.completed, v.hung), (6, 4, 1));
        assert_eq!((v.duplicated, v.differ), (1, 1), "{v:?}");
        assert_eq!(v.failed["unavailable"], 1);
        assert_eq!(
            (&v.duplicated_examples[..], &v.differ_examples[..]),
            (&[5][..], &[1][..])
        );
        assert_eq!(v.baseline_failed, 1);
        assert_eq!(v.lost(), 2);
        assert!(!v.passed());
        let t = v.table();
        assert!(
            t.contains("verdict: FAIL") && t.contains("on decode") && t.contains("unavailable: 1"),
            "{t}"
        );
        assert!(
            t.contains("duplicated      1   (requests [5])")
                && t.contains("differ          1   (requests [1])"),
            "{t}"
        );
        // Repeated tokens alone fail a run.
        let only_repeats = Verdict::judge(
            &[ok(0, "The sky is blue. blue.")],
            &baseline[5..],
            Leaks::default(),
        );
        assert_eq!((only_repeats.duplicated, only_repeats.differ), (1, 0));
        assert!(!only_repeats.passed());
        // A verdict written before the count existed still reads.
        let mut old = serde_json::to_value(clean_of(&baseline)).expect("json");
        old.as_object_mut().expect("object").remove("duplicated");
        old.as_object_mut()
            .expect("object")
            .remove("duplicated_examples");
        let read: Verdict = serde_json::from_value(old).expect("reads");
        assert_eq!(read.duplicated, 0);
        let clean = Verdict::judge(
            &baseline[..4],
            &baseline[..4],
            Leaks {
                workers: 2,
                ..Leaks::default()
            },
        );
        assert!(clean.passed(), "{}", clean.table());
    }

    fn clean_of(baseline: &[Outcome]) -> Verdict {
        Verdict::judge(baseline, baseline, Leaks::default())
    }

    #[test]
    fn repeated_tokens_are_told_from_other_differences() {
        let expected = "The capital of France is Paris.";
        let cases = [
            (expected, Comparison::Same),
            // A retried stream that re-sent a run of tokens, in the middle, at the start,
            // at the end, twice.
            (
                "The capital of France is capital of France is Paris.",
                Comparison::Duplicated,
            ),
            (
                "The The capital of France is Paris.",
                Comparison::Duplicated,
            ),
            (
                "The capital of France is Paris. Paris.",
                Comparison::Duplicated,
            ),
            (
                "The capital of France is Paris.Paris.",
                Comparison::Duplicated,
            ),
            (
                "The capital of capital of France is France is Paris.",
                Comparison::Duplicated,
            ),
            // Tokens skipped, replaced, cut short, or repeated and then wrong.
            ("The capital of is Paris.", Comparison::Differs),
            ("The capital of Spain is Paris.", Comparison::Differs),
            ("The capital of France is", Comparison::Differs),
            ("", Comparison::Differs),
            (
                "The capital of France is France is Madrid.",
                Comparison::Differs,
            ),
            ("The capital of France is Paris. Lyon.", Comparison::Differs),
            // Repeated in the wrong order: not the fault-free text read again.
            (
                "The capital of France is Paris.capital The",
                Comparison::Differs,
            ),
        ];
        for (answer, want) in cases {
            assert_eq!(compare(answer, expected), want, "{answer:?}");
        }
        assert_eq!(compare("héllo héllo", "héllo"), Comparison::Differs);
        assert_eq!(compare("hélhéllo", "héllo"), Comparison::Duplicated);
        assert_eq!(compare("x", ""), Comparison::Differs);
    }

    #[test]
    fn traces_round_trip_and_bad_lines_are_named() {
        let dir = std::env::temp_dir().join(format!("tandem-trace-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("t.jsonl");
        let entries = synth_trace(12, 3, "m");
        let text: Vec<String> = entries
            .iter()
            .map(|e| serde_json::to_string(e).expect("json"))
            .collect();
        std::fs::write(&path, text.join("\n")).expect("write");
        assert_eq!(read_trace(&path).expect("reads"), entries);
        assert!(entries.iter().any(|e| e.path == "/v1/chat/completions"));
        assert!(entries.iter().any(|e| e.body["stream"] == true));
        std::fs::write(
            &path,
            "{\"path\": \"/v1/completions\", \"body\": {}}\nnot json\n",
        )
        .expect("write");
        let e = read_trace(&path).expect_err("bad line");
        assert!(e.contains("t.jsonl:2"), "{e}");
        std::fs::write(&path, "{\"path\": \"/admin\", \"body\": {}}\n").expect("write");
        assert!(read_trace(&path).expect_err("bad path").contains("/admin"));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
