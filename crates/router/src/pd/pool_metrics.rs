//! Per-pool gauges from the workers' stats (polled each second): the signals an autoscaler
//! (HPA through a metrics adapter, or KEDA) reads to size the prefill and decode pools.

use prometheus::{IntGaugeVec, Opts, Registry};

/// The pool gauges, registered in the router's registry.
#[derive(Clone, Debug)]
pub struct PoolMetrics {
    workers: IntGaugeVec,
    in_flight: IntGaugeVec,
    running: IntGaugeVec,
    kv_free: IntGaugeVec,
    kv_total: IntGaugeVec,
}

/// What one poll learned about one worker.
#[derive(Clone, Debug)]
pub struct WorkerSample {
    /// `prefill`, `decode` or `both`.
    pub role: &'static str,
    /// `active`, `draining` or `ejected`.
    pub state: &'static str,
    /// Its stats, when it answered.
    pub stats: Option<tandem_proto::v1::StatsResponse>,
}

const ROLES: [&str; 3] = ["prefill", "decode", "both"];
const STATES: [&str; 4] = ["active", "draining", "ejected", "unreachable"];

fn gauge(registry: &Registry, name: &str, help: &str, labels: &[&str]) -> IntGaugeVec {
    let g =
        IntGaugeVec::new(Opts::new(name, help), labels).expect("static gauge options are valid");
    registry
        .register(Box::new(g.clone()))
        .expect("metric names are unique within this registry");
    g
}

impl PoolMetrics {
    /// Registers the gauges in `registry`.
    pub fn register(registry: &Registry) -> Self {
        Self {
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_proto::v1::StatsResponse;

    #[test]
    fn pools_sum_their_workers_and_count_them_by_state() {
        let registry = Registry::new();
        let m = PoolMetrics::register(&registry);
        let stats = |in_flight, free| StatsResponse {
            in_flight,
            kv_blocks_free: free,
            kv_blocks_total: 100,
            running_requests: in_flight,
            ..StatsResponse::default()
        };
        m.observe(&[
            WorkerSample {
                role: "decode",
                state: "active",
                stats: Some(stats(3, 40)),
            },
            WorkerSample {
                role: "decode",
                state: "draining",
                stats: Some(stats(1, 90)),
            },
            WorkerSample {
                role: "decode",
                state: "active",
                stats: None,
            },
            WorkerSample {
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
}
