//! Per-pool gauges from the workers' stats (polled each second): the signals an autoscaler
//! (HPA through a metrics adapter, or KEDA) reads to size the prefill and decode pools.
//! Beside them, per-worker families from the same poll: the breaker's state, the KV bytes
//! each worker moved by path (shared-memory landing or the transport), each prefill
//! worker's push histograms (seconds and bytes by path, as the worker reports them), and
//! vLLM's `vllm:kv_cache_usage_perc` with the worker as vLLM's `engine` label.

use prometheus::core::{Collector, Desc};
use prometheus::proto::{self, LabelPair, MetricFamily, MetricType};
use prometheus::{GaugeVec, IntCounterVec, IntGaugeVec, Opts, Registry};
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

/// The pool gauges, registered in the router's registry.
#[derive(Clone, Debug)]
pub struct PoolMetrics {
    workers: IntGaugeVec,
    in_flight: IntGaugeVec,
    running: IntGaugeVec,
    kv_free: IntGaugeVec,
    kv_total: IntGaugeVec,
    breaker: IntGaugeVec,
    kv_bytes: IntCounterVec,
    kv_usage: GaugeVec,
    /// Per worker: its role, and the KV byte counts (landed, total) its last answer gave.
    seen: Arc<Mutex<HashMap<String, Seen>>>,
}

#[derive(Clone, Debug, Default)]
struct Seen {
    role: &'static str,
    landed: u64,
    transferred: u64,
    /// The worker's KV push histograms at its last answer.
    pushes: Vec<tandem_proto::v1::KvTransferHistogram>,
}

/// `tandem_kv_transfer_seconds` and `tandem_kv_transfer_bytes`: the prefill workers' push
/// histograms, re-exported as the last poll found them.
struct PushHistograms {
    seen: Arc<Mutex<HashMap<String, Seen>>>,
    descs: Vec<Desc>,
}

const PUSH_SECONDS: &str = "tandem_kv_transfer_seconds";
const PUSH_BYTES: &str = "tandem_kv_transfer_bytes";

impl PushHistograms {
    fn new(seen: Arc<Mutex<HashMap<String, Seen>>>) -> Self {
        let labels = || vec!["path".to_string(), "role".into(), "worker".into()];
        let descs = vec![
            Desc::new(
                PUSH_SECONDS.into(),
                "Time a prefill worker took to push one handoff's KV (encoding included), by \
                 path: shm (shared memory, same host), put (one-sided writes), send (a message)."
                    .into(),
                labels(),
                HashMap::new(),
            )
            .expect("a valid metric description"),
            Desc::new(
                PUSH_BYTES.into(),
                "Size of each handoff a prefill worker pushed, by path.".into(),
                labels(),
                HashMap::new(),
            )
            .expect("a valid metric description"),
        ];
        Self { seen, descs }
    }
}

/// One histogram series from a worker's cumulative counts.
fn histogram_metric(
    labels: [(&str, &str); 3],
    count: u64,
    sum: f64,
    bounds: &[f64],
    cumulative: &[u64],
) -> proto::Metric {
    let mut h = proto::Histogram::default();
    h.set_sample_count(count);
    h.set_sample_sum(sum);
    h.set_bucket(
        bounds
            .iter()
            .zip(cumulative)
            .map(|(bound, n)| {
                let mut b = proto::Bucket::default();
                b.set_upper_bound(*bound);
                b.set_cumulative_count(*n);
                b
            })
            .collect(),
    );
    let mut m = proto::Metric::from_label(
        labels
            .iter()
            .map(|(name, value)| {
                let mut l = LabelPair::default();
                l.set_name((*name).to_string());
                l.set_value((*value).to_string());
                l
            })
            .collect(),
    );
    m.set_histogram(h);
    m
}

impl Collector for PushHistograms {
    fn desc(&self) -> Vec<&Desc> {
        self.descs.iter().collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        self.descs
            .iter()
            .map(|desc| {
                let mut family = MetricFamily::default();
                family.set_name(desc.fq_name.clone());
                family.set_help(desc.help.clone());
                family.set_field_type(MetricType::HISTOGRAM);
                let mut workers: Vec<_> = seen.iter().collect();
                workers.sort_by(|a, b| a.0.cmp(b.0));
                for (worker, last) in workers {
                    for p in &last.pushes {
                        let labels = [
                            ("path", p.path.as_str()),
                            ("role", last.role),
                            ("worker", worker),
                        ];
                        family.mut_metric().push(if desc.fq_name == PUSH_SECONDS {
                            histogram_metric(
                                labels,
                                p.count,
                                p.seconds_sum,
                                &p.seconds_bounds,
                                &p.seconds_cumulative,
                            )
                        } else {
                            histogram_metric(
                                labels,
                                p.count,
                                p.bytes_sum,
                                &p.bytes_bounds,
                                &p.bytes_cumulative,
                            )
                        });
                    }
                }
                family
            })
            .collect()
    }
}

/// What one poll learned about one worker.
#[derive(Clone, Debug)]
pub struct WorkerSample {
    /// The worker's id.
    pub worker: String,
    /// Its breaker's state: `closed`, `open` or `half_open`.
    pub breaker: &'static str,
    /// `prefill`, `decode` or `both`.
    pub role: &'static str,
    /// `active`, `draining` or `ejected`.
    pub state: &'static str,
    /// Its stats, when it answered.
    pub stats: Option<tandem_proto::v1::StatsResponse>,
}

const ROLES: [&str; 3] = ["prefill", "decode", "both"];
const STATES: [&str; 4] = ["active", "draining", "ejected", "unreachable"];
const BREAKER_STATES: [&str; 3] = ["closed", "open", "half_open"];
const KV_PATHS: [&str; 2] = ["landing", "transport"];

fn gauge(registry: &Registry, name: &str, help: &str, labels: &[&str]) -> IntGaugeVec {
    let g =
        IntGaugeVec::new(Opts::new(name, help), labels).expect("static gauge options are valid");
    registry
        .register(Box::new(g.clone()))
        .expect("metric names are unique within this registry");
    g
}

impl PoolMetrics {
    /// Registers the gauges in `registry`, the vLLM-named one in `vllm` (the router's
    /// registry whose metrics carry `model_name`).
    pub fn register(registry: &Registry, vllm: &Registry) -> Self {
        let kv_bytes = IntCounterVec::new(
            Opts::new(
                "tandem_kv_transfer_bytes_total",
                "KV bytes a worker moved in handoffs (prefill: sent, decode: received), by path: \
                 landing (shared-memory slots on one host) or transport (UCX).",
            ),
            &["worker", "role", "path"],
        )
        .expect("static counter options are valid");
        registry
            .register(Box::new(kv_bytes.clone()))
            .expect("metric names are unique within this registry");
        let kv_usage = GaugeVec::new(
            Opts::new(
                "vllm:kv_cache_usage_perc",
                "Fraction of the worker's KV blocks (or state slots) in use, 0 to 1.",
            ),
            &["engine"],
        )
        .expect("static gauge options are valid");
        vllm.register(Box::new(kv_usage.clone()))
            .expect("metric names are unique within this registry");
        let seen = Arc::default();
        registry
            .register(Box::new(PushHistograms::new(Arc::clone(&seen))))
            .expect("metric names are unique within this registry");
        Self {
            breaker: gauge(
                registry,
                "tandem_worker_breaker_state",
                "1 for each worker's circuit-breaker state now (closed: routed to; open: out of \
                 rotation for its cooldown; half_open: the next request is a probe), 0 for the others.",
                &["worker", "role", "state"],
            ),
            kv_bytes,
            kv_usage,
            seen,
            workers: gauge(
                registry,
                "tandem_pool_workers",
                "Workers known to the router by role and state (unreachable: did not answer the last stats poll).",
                &["role", "state"],
            ),
            in_flight: gauge(
                registry,
                "tandem_pool_in_flight",
                "Requests in the pool's workers' hands (RPCs not finished, streams included).",
                &["role"],
            ),
            running: gauge(
                registry,
                "tandem_pool_running_requests",
                "Requests the pool's engines are running or have queued.",
                &["role"],
            ),
            kv_free: gauge(
                registry,
                "tandem_pool_kv_blocks_free",
                "Free KV blocks (or state slots) over the pool's reachable workers.",
                &["role"],
            ),
            kv_total: gauge(
                registry,
                "tandem_pool_kv_blocks_total",
                "KV blocks (or state slots) over the pool's reachable workers.",
                &["role"],
            ),
        }
    }

    /// Sets every gauge from one poll of every worker.
    pub fn observe(&self, samples: &[WorkerSample]) {
        self.observe_workers(samples);
        for role in ROLES {
            let mine = || samples.iter().filter(move |s| s.role == role);
            for state in STATES {
                let n = mine()
                    // An ejected worker counts as ejected whether or not it answered (failed
                    // health polls eject it); others that did not answer as unreachable.
                    .filter(|s| match (&s.stats, state) {
                        _ if s.state == "ejected" => state == "ejected",
                        (None, st) => st == "unreachable",
                        (Some(_), st) => s.state == st,
                    })
                    .count();
                self.workers.with_label_values(&[role, state]).set(n as i64);
            }
            let sum = |f: fn(&tandem_proto::v1::StatsResponse) -> u32| -> i64 {
                mine()
                    .filter_map(|s| s.stats.as_ref())
                    .map(|s| i64::from(f(s)))
                    .sum()
            };
            self.in_flight
                .with_label_values(&[role])
                .set(sum(|s| s.in_flight));
            self.running
                .with_label_values(&[role])
                .set(sum(|s| s.running_requests));
            self.kv_free
                .with_label_values(&[role])
                .set(sum(|s| s.kv_blocks_free));
            self.kv_total
                .with_label_values(&[role])
                .set(sum(|s| s.kv_blocks_total));
        }
    }

    /// The per-worker families; a worker no longer listed loses its series.
    fn observe_workers(&self, samples: &[WorkerSample]) {
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        let listed: HashSet<&str> = samples.iter().map(|s| s.worker.as_str()).collect();
        seen.retain(|worker, last| {
            if listed.contains(worker.as_str()) {
                return true;
            }
            for state in BREAKER_STATES {
                let _ = self
                    .breaker
                    .remove_label_values(&[worker, last.role, state]);
            }
            for path in KV_PATHS {
                let _ = self
                    .kv_bytes
                    .remove_label_values(&[worker, last.role, path]);
            }
            let _ = self.kv_usage.remove_label_values(&[worker]);
            false
        });
        for s in samples {
            let worker = s.worker.as_str();
            for state in BREAKER_STATES {
                self.breaker
                    .with_label_values(&[worker, s.role, state])
                    .set(i64::from(state == s.breaker));
            }
            let last = seen.entry(s.worker.clone()).or_insert_with(|| Seen {
                role: s.role,
                ..Seen::default()
            });
            let Some(stats) = &s.stats else { continue };
            if stats.kv_blocks_total > 0 {
                let used = stats.kv_blocks_total.saturating_sub(stats.kv_blocks_free);
                self.kv_usage
                    .with_label_values(&[worker])
                    .set(f64::from(used) / f64::from(stats.kv_blocks_total));
            }
            // The worker's counts are cumulative since it started: add what is new (all of
            // it after a restart, when they went down).
            let grown = |now: u64, before: u64| if now >= before { now - before } else { now };
            let landed = grown(stats.kv_bytes_landed, last.landed);
            let transport_now = stats
                .kv_bytes_transferred
                .saturating_sub(stats.kv_bytes_landed);
            let transport_before = last.transferred.saturating_sub(last.landed);
            let transport = grown(transport_now, transport_before);
            self.kv_bytes
                .with_label_values(&[worker, s.role, "landing"])
                .inc_by(landed);
            self.kv_bytes
                .with_label_values(&[worker, s.role, "transport"])
                .inc_by(transport);
            last.landed = stats.kv_bytes_landed;
            last.transferred = stats.kv_bytes_transferred;
            last.pushes.clone_from(&stats.kv_transfers);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_proto::v1::StatsResponse;

    #[test]
    fn pools_sum_their_workers_and_count_them_by_state() {
        let registry = Registry::new();
        let m = PoolMetrics::register(&registry, &Registry::new());
        let stats = |in_flight, free| StatsResponse {
            in_flight,
            kv_blocks_free: free,
            kv_blocks_total: 100,
            running_requests: in_flight,
            ..StatsResponse::default()
        };
        m.observe(&[
            WorkerSample {
                worker: "w0".into(),
                breaker: "closed",
                role: "decode",
                state: "active",
                stats: Some(stats(3, 40)),
            },
            WorkerSample {
                worker: "w1".into(),
                breaker: "closed",
                role: "decode",
                state: "draining",
                stats: Some(stats(1, 90)),
            },
            WorkerSample {
                worker: "w2".into(),
                breaker: "closed",
                role: "decode",
                state: "active",
                stats: None,
            },
            WorkerSample {
                worker: "w3".into(),
                breaker: "closed",
                role: "prefill",
                state: "active",
                stats: Some(stats(2, 100)),
            },
        ]);
        let text = prometheus::TextEncoder::new()
            .encode_to_string(&registry.gather())
            .expect("encodes");
        for line in [
            "tandem_pool_in_flight{role=\"decode\"} 4",
            "tandem_pool_kv_blocks_free{role=\"decode\"} 130",
            "tandem_pool_kv_blocks_total{role=\"decode\"} 200",
            "tandem_pool_workers{role=\"decode\",state=\"active\"} 1",
            "tandem_pool_workers{role=\"decode\",state=\"draining\"} 1",
            "tandem_pool_workers{role=\"decode\",state=\"unreachable\"} 1",
            "tandem_pool_workers{role=\"prefill\",state=\"active\"} 1",
            "tandem_pool_workers{role=\"both\",state=\"active\"} 0",
            "tandem_pool_running_requests{role=\"prefill\"} 2",
        ] {
            assert!(text.contains(line), "missing {line}:\n{text}");
        }
    }

    #[test]
    fn workers_report_breaker_state_kv_usage_and_bytes_by_path() {
        let registry = Registry::new();
        let vllm = Registry::new();
        let m = PoolMetrics::register(&registry, &vllm);
        let sample = |breaker, landed, transferred| WorkerSample {
            worker: "d0".into(),
            breaker,
            role: "decode",
            state: "active",
            stats: Some(StatsResponse {
                kv_blocks_total: 100,
                kv_blocks_free: 75,
                kv_bytes_landed: landed,
                kv_bytes_transferred: transferred,
                ..StatsResponse::default()
            }),
        };
        let text = |r: &Registry| {
            prometheus::TextEncoder::new()
                .encode_to_string(&r.gather())
                .expect("encodes")
        };
        m.observe(&[sample("closed", 10, 30)]);
        m.observe(&[sample("open", 15, 50)]);
        let ours = text(&registry);
        for line in [
            r#"tandem_worker_breaker_state{role="decode",state="open",worker="d0"} 1"#,
            r#"tandem_worker_breaker_state{role="decode",state="closed",worker="d0"} 0"#,
            r#"tandem_kv_transfer_bytes_total{path="landing",role="decode",worker="d0"} 15"#,
            r#"tandem_kv_transfer_bytes_total{path="transport",role="decode",worker="d0"} 35"#,
        ] {
            assert!(ours.contains(line), "missing {line}:\n{ours}");
        }
        assert!(text(&vllm).contains(r#"vllm:kv_cache_usage_perc{engine="d0"} 0.25"#));
        // A restarted worker counts from zero again: its new bytes are added, not subtracted.
        m.observe(&[sample("closed", 4, 4)]);
        assert!(text(&registry).contains(
            r#"tandem_kv_transfer_bytes_total{path="landing",role="decode",worker="d0"} 19"#
        ));
        // A worker that left the pool leaves the metrics.
        m.observe(&[]);
        assert!(!text(&registry).contains("worker=\"d0\""));
        assert!(!text(&vllm).contains("d0"));
    }

    #[test]
    fn prefill_push_histograms_are_exported_as_the_worker_reports_them() {
        let registry = Registry::new();
        let m = PoolMetrics::register(&registry, &Registry::new());
        let text = || {
            prometheus::TextEncoder::new()
                .encode_to_string(&registry.gather())
                .expect("encodes")
        };
        let shm = tandem_proto::v1::KvTransferHistogram {
            path: "shm".into(),
            count: 3,
            seconds_sum: 0.004,
            seconds_bounds: vec![0.001, 0.01],
            seconds_cumulative: vec![1, 3],
            bytes_sum: 3000.0,
            bytes_bounds: vec![1024.0],
            bytes_cumulative: vec![2],
        };
        let sample = |pushes: Vec<_>| WorkerSample {
            worker: "p0".into(),
            breaker: "closed",
            role: "prefill",
            state: "active",
            stats: Some(StatsResponse {
                kv_transfers: pushes,
                ..StatsResponse::default()
            }),
        };
        m.observe(&[sample(Vec::new())]);
        assert!(
            !text().contains("tandem_kv_transfer_seconds_bucket"),
            "no push yet"
        );
        m.observe(&[sample(vec![shm])]);
        let ours = text();
        for line in [
            r#"tandem_kv_transfer_seconds_bucket{path="shm",role="prefill",worker="p0",le="0.001"} 1"#,
            r#"tandem_kv_transfer_seconds_bucket{path="shm",role="prefill",worker="p0",le="+Inf"} 3"#,
            r#"tandem_kv_transfer_seconds_count{path="shm",role="prefill",worker="p0"} 3"#,
            r#"tandem_kv_transfer_bytes_bucket{path="shm",role="prefill",worker="p0",le="1024"} 2"#,
            r#"tandem_kv_transfer_bytes_sum{path="shm",role="prefill",worker="p0"} 3000"#,
        ] {
            assert!(ours.contains(line), "missing {line}:\n{ours}");
        }
        m.observe(&[]);
        assert!(
            !text().contains("worker=\"p0\""),
            "a worker that left is gone"
        );
    }
}
