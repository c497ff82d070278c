//! The figures `vllm bench serve` reports, computed the same way (numpy's interpolated
//! percentiles, TPOT over multi-token outputs only, goodput under every SLO at once), under
//! its JSON keys.

use serde_json::{json, Map, Value};

/// A request's outcome.
#[derive(Clone, Debug, Default)]
pub struct RequestOutput {
    pub success: bool,
    pub error: String,
    /// Seconds to the first chunk carrying text.
    pub ttft: f64,
    /// Gaps between text-carrying chunks, seconds.
    pub itl: Vec<f64>,
    /// Seconds from sending to the stream's end.
    pub latency: f64,
    pub prompt_len: usize,
    /// The server's `completion_tokens`, else the number of text chunks.
    pub output_len: usize,
    pub text: String,
}

/// A percentile of `xs` with linear interpolation between closest ranks (numpy's default,
/// which `vllm bench serve` uses); 0 when empty.
pub fn percentile(xs: &[f64], p: f64) -> f64 {
    if xs.is_empty() {
        return 0.0;
    }
    let mut s = xs.to_vec();
    s.sort_by(f64::total_cmp);
    let rank = (p / 100.0).clamp(0.0, 1.0) * (s.len() - 1) as f64;
    let (lo, hi) = (rank.floor() as usize, rank.ceil() as usize);
    s[lo] + (s[hi] - s[lo]) * (rank - lo as f64)
}

pub fn mean(xs: &[f64]) -> f64 {
    if xs.is_empty() {
        0.0
    } else {
        xs.iter().sum::<f64>() / xs.len() as f64
    }
}

/// Population standard deviation (numpy's `std`).
pub fn std_dev(xs: &[f64]) -> f64 {
    if xs.is_empty() {
        return 0.0;
    }
    let m = mean(xs);
    (xs.iter().map(|x| (x - m).powi(2)).sum::<f64>() / xs.len() as f64).sqrt()
}

/// A latency metric goodput can bound.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SloMetric {
    Ttft,
    Tpot,
    E2el,
}

/// A bound from `--goodput`: the metric at most `ms` milliseconds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Slo {
    pub metric: SloMetric,
    pub ms: f64,
}

/// `ttft:500` and the like.
pub fn parse_slo(s: &str) -> Result<Slo, String> {
    let (name, value) = s
        .split_once(':')
        .ok_or_else(|| format!("{s}: expected METRIC:MILLISECONDS"))?;
    let metric = match name {
        "ttft" => SloMetric::Ttft,
        "tpot" => SloMetric::Tpot,
        "e2el" => SloMetric::E2el,
        _ => return Err(format!("{name}: goodput bounds ttft, tpot or e2el")),
    };
    let ms: f64 = value
        .parse()
        .map_err(|_| format!("{value}: not a number of milliseconds"))?;
    if ms.is_nan() || ms < 0.0 {
        return Err(format!("{value}: a bound is at least 0"));
    }
    Ok(Slo { metric, ms })
}

/// Mean, median, std and the asked percentiles of one latency, milliseconds.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Summary {
    pub mean: f64,
    pub median: f64,
    pub std: f64,
    pub percentiles: Vec<(f64, f64)>,
}

impl Summary {
    fn of(seconds: &[f64], ps: &[f64]) -> Self {
        let ms: Vec<f64> = seconds.iter().map(|s| s * 1000.0).collect();
        Self {
            mean: mean(&ms),
            median: percentile(&ms, 50.0),
            std: std_dev(&ms),
            percentiles: ps.iter().map(|&p| (p, percentile(&ms, p))).collect(),
        }
    }
}

/// A block's (or an arm's pooled blocks') figures.
#[derive(Clone, Debug, Default)]
pub struct Metrics {
    pub completed: usize,
    pub failed: usize,
    pub duration: f64,
    pub total_input: usize,
    pub total_output: usize,
    pub request_throughput: f64,
    pub request_goodput: Option<f64>,
    pub output_throughput: f64,
    pub total_token_throughput: f64,
    pub ttft: Summary,
    pub tpot: Summary,
    pub itl: Summary,
    pub e2el: Summary,
    /// The raw samples (seconds), for gate terms at any percentile.
    samples: Samples,
}

#[derive(Clone, Debug, Default)]
struct Samples {
    ttft: Vec<f64>,
    tpot: Vec<f64>,
    itl: Vec<f64>,
    e2el: Vec<f64>,
}

/// TPOT of a request: time after the first token over the tokens after it (0 for one token).
fn tpot(o: &RequestOutput) -> f64 {
    if o.output_len > 1 {
        (o.latency - o.ttft) / (o.output_len - 1) as f64
    } else {
        0.0
    }
}

impl Metrics {
    /// Figures of `outputs` taking `duration` seconds in all (for pooled blocks, the sum of
    /// their durations). TPOT counts requests with more than one output token only, as
    /// `vllm bench serve` does; a request is good when it meets every `slos` bound.
    pub fn of(outputs: &[RequestOutput], duration: f64, ps: &[f64], slos: &[Slo]) -> Self {
        let ok: Vec<&RequestOutput> = outputs.iter().filter(|o| o.success).collect();
        let s = Samples {
            ttft: ok.iter().map(|o| o.ttft).collect(),
            tpot: ok
                .iter()
                .filter(|o| o.output_len > 1)
                .map(|o| tpot(o))
                .collect(),
            itl: ok.iter().flat_map(|o| o.itl.iter().copied()).collect(),
            e2el: ok.iter().map(|o| o.latency).collect(),
        };
        let good = ok
            .iter()
            .filter(|o| {
                slos.iter().all(|slo| {
                    let v = match slo.metric {
                        SloMetric::Ttft => o.ttft,
                        SloMetric::Tpot => tpot(o),
                        SloMetric::E2el => o.latency,
                    };
                    v * 1000.0 <= slo.ms
                })
            })
            .count();
        let per_s = |x: f64| if duration > 0.0 { x / duration } else { 0.0 };
        let total_input: usize = ok.iter().map(|o| o.prompt_len).sum();
        let total_output: usize = ok.iter().map(|o| o.output_len).sum();
        Self {
            completed: ok.len(),
            failed: outputs.len() - ok.len(),
            duration,
            total_input,
            total_output,
            request_throughput: per_s(ok.len() as f64),
            request_goodput: (!slos.is_empty()).then(|| per_s(good as f64)),
            output_throughput: per_s(total_output as f64),
            total_token_throughput: per_s((total_input + total_output) as f64),
            ttft: Summary::of(&s.ttft, ps),
            tpot: Summary::of(&s.tpot, ps),
            itl: Summary::of(&s.itl, ps),
            e2el: Summary::of(&s.e2el, ps),
            samples: s,
        }
    }

    /// The figures under `vllm bench serve`'s result keys.
    pub fn to_json(&self) -> Map<String, Value> {
        let mut m = Map::new();
        m.insert("duration".into(), json!(self.duration));
        m.insert("completed".into(), json!(self.completed));
        m.insert("failed".into(), json!(self.failed));
        m.insert("total_input_tokens".into(), json!(self.total_input));
        m.insert("total_output_tokens".into(), json!(self.total_output));
        m.insert("request_throughput".into(), json!(self.request_throughput));
        m.insert("request_goodput".into(), json!(self.request_goodput));
        m.insert("output_throughput".into(), json!(self.output_throughput));
        m.insert(
            "total_token_throughput".into(),
            json!(self.total_token_throughput),
        );
        for (name, s) in self.summaries() {
            m.insert(format!("mean_{name}_ms"), json!(s.mean));
            m.insert(format!("median_{name}_ms"), json!(s.median));
            m.insert(format!("std_{name}_ms"), json!(s.std));
            for (p, v) in &s.percentiles {
                m.insert(format!("p{}_{name}_ms", percentile_word(*p)), json!(v));
            }
        }
        m
    }

    fn summaries(&self) -> [(&'static str, &Summary); 4] {
        [
            ("ttft", &self.ttft),
            ("tpot", &self.tpot),
            ("itl", &self.itl),
            ("e2el", &self.e2el),
        ]
    }

    /// The table `vllm bench serve` prints.
    pub fn table(&self, title: &str) -> String {
        use std::fmt::Write;
        let mut t = String::new();
        let _ = writeln!(t, "{:=^50}", format!(" {title} "));
        let mut row = |k: &str, v: String| {
            let _ = writeln!(t, "{k:<40} {v:<10}");
        };
        row("Successful requests:", self.completed.to_string());
        row("Failed requests:", self.failed.to_string());
        row("Benchmark duration (s):", format!("{:.2}", self.duration));
        row("Total input tokens:", self.total_input.to_string());
        row("Total generated tokens:", self.total_output.to_string());
        row(
            "Request throughput (req/s):",
            format!("{:.2}", self.request_throughput),
        );
        if let Some(g) = self.request_goodput {
            row("Request goodput (req/s):", format!("{g:.2}"));
        }
        row(
            "Output token throughput (tok/s):",
            format!("{:.2}", self.output_throughput),
        );
        row(
            "Total Token throughput (tok/s):",
            format!("{:.2}", self.total_token_throughput),
        );
        for (name, long, s) in [
            ("TTFT", "Time to First Token", &self.ttft),
            (
                "TPOT",
                "Time per Output Token (excl. 1st token)",
                &self.tpot,
            ),
            ("ITL", "Inter-token Latency", &self.itl),
            ("E2EL", "End-to-end Latency", &self.e2el),
        ] {
            let _ = writeln!(t, "{:-^50}", long);
            let _ = writeln!(t, "{:<40} {:<10.2}", format!("Mean {name} (ms):"), s.mean);
            let _ = writeln!(
                t,
                "{:<40} {:<10.2}",
                format!("Median {name} (ms):"),
                s.median
            );
            for (p, v) in &s.percentiles {
                let _ = writeln!(
                    t,
                    "{:<40} {:<10.2}",
                    format!("P{} {name} (ms):", percentile_word(*p)),
                    v
                );
            }
        }
        let _ = writeln!(t, "{}", "=".repeat(50));
        t
    }

    /// A figure a gate term names: `throughput` (output tok/s), `request_throughput`,
    /// `goodput`, or `{ttft,tpot,itl,e2el}_{mean,median,pNN}` in milliseconds.
    pub fn figure(&self, name: &str) -> Option<f64> {
        match name {
            "throughput" | "output_throughput" => return Some(self.output_throughput),
            "request_throughput" => return Some(self.request_throughput),
            "goodput" | "request_goodput" => return self.request_goodput,
            _ => {}
        }
        let (metric, stat) = name.split_once('_')?;
        let samples = match metric {
            "ttft" => &self.samples.ttft,
            "tpot" => &self.samples.tpot,
            "itl" => &self.samples.itl,
            "e2el" => &self.samples.e2el,
            _ => return None,
        };
        let ms: Vec<f64> = samples.iter().map(|s| s * 1000.0).collect();
        match stat {
            "mean" => Some(mean(&ms)),
            "median" => Some(percentile(&ms, 50.0)),
            p => {
                let p: f64 = p.strip_prefix('p')?.parse().ok()?;
                (0.0..=100.0).contains(&p).then(|| percentile(&ms, p))
            }
        }
    }
}

/// `99` for 99.0, `99.9` for 99.9 (the key names `vllm bench serve` writes).
fn percentile_word(p: f64) -> String {
    if p.fract() == 0.0 {
        format!("{}", p as i64)
    } else {
        format!("{p}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(ttft: f64, latency: f64, output_len: usize, text: &str) -> RequestOutput {
        RequestOutput {
            success: true,
            ttft,
            latency,
            output_len,
            prompt_len: 10,
            itl: vec![(latency - ttft) / output_len.max(2) as f64; output_len.saturating_sub(1)],
            text: text.into(),
            ..Default::default()
        }
    }

    #[test]
    fn percentiles_interpolate_between_ranks_as_numpy_does() {
        let xs = [4.0, 1.0, 3.0, 2.0];
        assert_eq!(percentile(&xs, 50.0), 2.5);
        assert!((percentile(&xs, 99.0) - 3.97).abs() < 1e-12);
        assert_eq!(percentile(&xs, 0.0), 1.0);
        assert_eq!(percentile(&xs, 100.0), 4.0);
        assert_eq!(percentile(&[7.0], 95.0), 7.0);
        assert_eq!(percentile(&[], 95.0), 0.0);
        assert_eq!(std_dev(&[1.0, 3.0]), 1.0);
    }

    #[test]
    fn metrics_count_failures_apart_and_tpot_only_over_multi_token_outputs() {
        let failed = RequestOutput {
            error: "503".into(),
            ..Default::default()
        };
        let outs = [ok(0.1, 1.1, 11, "a"), ok(0.2, 0.2, 1, "b"), failed];
        let m = Metrics::of(&outs, 2.0, &[50.0, 99.9], &[]);
        assert_eq!((m.completed, m.failed), (2, 1));
        assert_eq!((m.total_input, m.total_output), (20, 12));
        assert_eq!(m.request_throughput, 1.0);
        assert_eq!(m.output_throughput, 6.0);
        assert_eq!(m.total_token_throughput, 16.0);
        // (1.1 - 0.1) / 10 tokens: 100 ms; the one-token request has no TPOT.
        assert!((m.tpot.mean - 100.0).abs() < 1e-9, "{:?}", m.tpot);
        assert!((m.ttft.mean - 150.0).abs() < 1e-9);
        assert_eq!(m.request_goodput, None);
        let j = m.to_json();
        for key in [
            "completed",
            "duration",
            "request_throughput",
            "output_throughput",
            "mean_ttft_ms",
            "median_tpot_ms",
            "p50_itl_ms",
            "p99.9_e2el_ms",
            "std_e2el_ms",
        ] {
            assert!(j.contains_key(key), "{key} missing from {j:?}");
        }
        assert_eq!(j["request_goodput"], Value::Null);
        let table = m.table("Serving Benchmark Result");
        assert!(table.contains("P99.9 TTFT (ms):"), "{table}");
    }

    #[test]
    fn goodput_counts_requests_meeting_every_bound() {
        let slos = [
            parse_slo("ttft:500").expect("valid"),
            parse_slo("tpot:50").expect("valid"),
        ];
        // Good; TTFT too slow; TPOT too slow ((2.1 - 0.1) / 10 = 200 ms).
        let outs = [
            ok(0.1, 0.5, 11, ""),
            ok(0.6, 1.0, 11, ""),
            ok(0.1, 2.1, 11, ""),
        ];
        let m = Metrics::of(&outs, 2.0, &[99.0], &slos);
        assert_eq!(m.request_goodput, Some(0.5));
        assert!(m.table("t").contains("Request goodput (req/s):"));
        assert!(parse_slo("ttft").is_err());
        assert!(parse_slo("queue:5").is_err());
        assert!(parse_slo("ttft:fast").is_err());
        assert!(parse_slo("ttft:-1").is_err());
    }
}
