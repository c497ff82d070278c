//! A fault scenario: which faults, how often, how many at most, seeded so a run can be
//! repeated. Written as YAML:
//!
//! ```yaml
//! seed: 7
//! http:                      # per HTTP/2 request through the proxy
//!   status_502: 0.05         # answer 502 instead of forwarding (a bare number: probability)
//!   status_503: {probability: 0.01, limit: 3}
//!   delay: {probability: 0.1, duration: 200ms}
//!   reset: {probability: 0.01, limit: 2}   # break the request's whole connection
//! connection:                # per accepted connection
//!   reset: {probability: 0.02, after_bytes: 4096}   # RST once this many bytes went through
//!   close: {probability: 0.0, after_bytes: 4096}    # FIN instead
//!   stall: {probability: 0.0, duration: 2s}         # stop forwarding for a while, once
//! transfer:                  # per KV push of a prefill worker started with --chaos-scenario
//!   abort: 0.02              # the push fails
//!   corrupt: 0.01            # one byte of the pushed message is flipped
//!   delay: {probability: 0.0, duration: 500ms}
//!   drop: 0.0                # nothing is sent, the push reports success
//! kill:                      # by `tandem chaos replay`, of processes it is told of with
//!   targets: [decode]        #   --process NAME=PIDFILE: SIGKILL each name in turn,
//!   every: 20s               #   the first this long into the run, then at this interval,
//!   limit: 1                 #   at most this many (a supervisor may restart them)
//! ```

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Deserialize;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

/// Errors reading a scenario.
#[derive(Debug, thiserror::Error)]
pub enum ScenarioError {
    /// The file could not be read.
    #[error("reading scenario {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The YAML is malformed or has unknown keys.
    #[error("scenario {path}: {message}")]
    Parse {
        /// The file.
        path: String,
        /// What is wrong.
        message: String,
    },
}

/// One kind of fault: how likely per occasion, and at most how many times.
#[derive(Clone, Copy, Debug, Default, PartialEq, Deserialize)]
#[serde(from = "RawFault")]
pub struct Fault {
    /// Probability per occasion, 0..=1.
    pub probability: f64,
    /// At most this many injections (`None`: no limit).
    pub limit: Option<u64>,
    /// For delays and stalls: how long.
    pub duration: Duration,
    /// For resets and closes: after how many bytes of the connection.
    pub after_bytes: u64,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum RawFault {
    Probability(f64),
    Full(FullFault),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FullFault {
    probability: f64,
    #[serde(default)]
    limit: Option<u64>,
    #[serde(default, with = "humantime_serde::option")]
    duration: Option<Duration>,
    #[serde(default)]
    after_bytes: Option<u64>,
}

impl From<RawFault> for Fault {
    fn from(r: RawFault) -> Self {
        match r {
            RawFault::Probability(p) => Fault {
                probability: p,
                ..Fault::default()
            },
            RawFault::Full(f) => Fault {
                probability: f.probability,
                limit: f.limit,
                duration: f.duration.unwrap_or_default(),
                after_bytes: f.after_bytes.unwrap_or(0),
            },
        }
    }
}

/// Faults of HTTP/2 requests through the proxy.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HttpFaults {
    /// Answer `502 Bad Gateway` without forwarding.
    pub status_502: Fault,
    /// Answer `503 Service Unavailable` without forwarding.
    pub status_503: Fault,
    /// Hold the request for `duration` before forwarding.
    pub delay: Fault,
    /// Break the whole connection the request arrived on (every request multiplexed on it
    /// fails): what one reset of a router's HTTP/2 connection to a worker does.
    pub reset: Fault,
}

/// Faults of TCP connections through the proxy.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ConnectionFaults {
    /// Reset (RST) after `after_bytes`.
    pub reset: Fault,
    /// Close (FIN) after `after_bytes`.
    pub close: Fault,
    /// Stop forwarding for `duration`, once, at the connection's start.
    pub stall: Fault,
}

/// Faults of a prefill worker's KV pushes.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TransferFaults {
    /// The push fails.
    pub abort: Fault,
    /// One byte of the message is flipped (the receiver's checksum must catch it).
    pub corrupt: Fault,
    /// The push waits `duration` first.
    pub delay: Fault,
    /// Nothing is sent but the push reports success (the decode side's lease must expire).
    pub drop: Fault,
}

/// Processes `tandem chaos replay` kills during its run (never during the baseline).
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KillFaults {
    /// Process names, as given to the replay with `--process NAME=PIDFILE`, killed in turn.
    pub targets: Vec<String>,
    /// The first kill this long into the run, then one at this interval.
    #[serde(with = "humantime_serde")]
    pub every: Duration,
    /// At most this many kills (`None`: until the run ends).
    pub limit: Option<u64>,
}

/// A whole scenario as written.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Scenario {
    /// Seed of every random choice.
    pub seed: u64,
    /// Request faults.
    pub http: HttpFaults,
    /// Connection faults.
    pub connection: ConnectionFaults,
    /// Transfer faults.
    pub transfer: TransferFaults,
    /// Process kills (the replay's; proxies and workers ignore them).
    pub kill: KillFaults,
}

impl Scenario {
    /// Parses YAML text; `what` names the source in errors.
    pub fn from_yaml(text: &str, what: &str) -> Result<Self, ScenarioError> {
        let s: Scenario = serde_yaml::from_str(text).map_err(|e| ScenarioError::Parse {
            path: what.to_string(),
            message: e.to_string(),
        })?;
        s.check().map_err(|message| ScenarioError::Parse {
            path: what.to_string(),
            message,
        })?;
        Ok(s)
    }

    /// Reads a scenario file.
    pub fn load(path: &Path) -> Result<Self, ScenarioError> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| ScenarioError::Io {
            path: shown.clone(),
            source,
        })?;
        Self::from_yaml(&text, &shown)
    }

    fn faults(&self) -> [(&'static str, &Fault); 11] {
        [
            ("http.status_502", &self.http.status_502),
            ("http.status_503", &self.http.status_503),
            ("http.delay", &self.http.delay),
            ("http.reset", &self.http.reset),
            ("connection.reset", &self.connection.reset),
            ("connection.close", &self.connection.close),
            ("connection.stall", &self.connection.stall),
            ("transfer.abort", &self.transfer.abort),
            ("transfer.corrupt", &self.transfer.corrupt),
            ("transfer.delay", &self.transfer.delay),
            ("transfer.drop", &self.transfer.drop),
        ]
    }

    fn check(&self) -> Result<(), String> {
        let mut problems = Vec::new();
        for (name, f) in self.faults() {
            if !(0.0..=1.0).contains(&f.probability) {
                problems.push(format!(
                    "{name}: probability {} is not in 0..=1",
                    f.probability
                ));
            }
        }
        for (name, f) in [
            ("http.delay", &self.http.delay),
            ("connection.stall", &self.connection.stall),
            ("transfer.delay", &self.transfer.delay),
        ] {
            if f.probability > 0.0 && f.duration.is_zero() {
                problems.push(format!("{name}: a duration is needed"));
            }
        }
        if !self.kill.targets.is_empty() && self.kill.every.is_zero() {
            problems.push("kill: `every` (the interval between kills) is needed".into());
        }
        if self.kill.limit == Some(0) {
            problems.push("kill: a limit of 0 kills nothing (leave the section out)".into());
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(problems.join("; "))
        }
    }
}

/// Draws the scenario's faults: one seeded generator, and a count per fault so limits hold
/// across every connection and request of the process.
#[derive(Debug)]
pub struct Injector {
    rng: Mutex<StdRng>,
    counts: Vec<AtomicU64>,
}

impl Injector {
    /// An injector seeded from the scenario.
    pub fn new(seed: u64) -> Self {
        Self {
            rng: Mutex::new(StdRng::seed_from_u64(seed)),
            counts: (0..16).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// Whether fault number `slot` (a stable index per fault kind) fires now.
    pub fn fires(&self, slot: usize, fault: &Fault) -> bool {
        if fault.probability <= 0.0 {
            return false;
        }
        let hit = {
            let mut rng = self.rng.lock().unwrap_or_else(|e| e.into_inner());
            rng.random_bool(fault.probability)
        };
        if !hit {
            return false;
        }
        let count = &self.counts[slot];
        match fault.limit {
            Some(limit) => count
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                    (n < limit).then_some(n + 1)
                })
                .is_ok(),
            None => {
                count.fetch_add(1, Ordering::Relaxed);
                true
            }
        }
    }

    /// How many times fault `slot` fired.
    pub fn count(&self, slot: usize) -> u64 {
        self.counts[slot].load(Ordering::Relaxed)
    }

    /// A random index below `n` (which byte to corrupt).
    pub fn index(&self, n: usize) -> usize {
        let mut rng = self.rng.lock().unwrap_or_else(|e| e.into_inner());
        rng.random_range(0..n.max(1))
    }
}

/// What a KV push should suffer, if anything.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransferFault {
    /// Fail the push.
    Abort,
    /// Flip the byte at this index (modulo the message length).
    Corrupt(usize),
    /// Wait first.
    Delay(Duration),
    /// Send nothing, report success.
    Drop,
}

/// Transfer faults drawn for a prefill worker's pushes.
#[derive(Debug)]
pub struct TransferChaos {
    faults: TransferFaults,
    injector: Injector,
}

impl TransferChaos {
    /// From a scenario's `transfer` section.
    pub fn new(scenario: &Scenario) -> Self {
        Self {
            faults: scenario.transfer.clone(),
            injector: Injector::new(scenario.seed),
        }
    }

    /// The fault for the next push (at most one).
    pub fn next(&self) -> Option<TransferFault> {
        let f = &self.faults;
        let i = &self.injector;
        if i.fires(0, &f.abort) {
            Some(TransferFault::Abort)
        } else if i.fires(1, &f.corrupt) {
            Some(TransferFault::Corrupt(i.index(usize::MAX)))
        } else if i.fires(2, &f.delay) {
            Some(TransferFault::Delay(f.delay.duration))
        } else if i.fires(3, &f.drop) {
            Some(TransferFault::Drop)
        } else {
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bare_numbers_and_full_forms_parse_and_bad_values_are_named() {
        let s = Scenario::from_yaml(
            "seed: 3\nhttp: {status_502: 0.5, delay: {probability: 0.1, duration: 20ms}}\nconnection: {reset: {probability: 1, after_bytes: 100, limit: 2}}\n",
            "s.yaml",
        )
        .expect("valid");
        assert_eq!(s.http.status_502.probability, 0.5);
        assert_eq!(s.http.delay.duration, Duration::from_millis(20));
        assert_eq!(s.connection.reset.after_bytes, 100);
        assert_eq!(s.connection.reset.limit, Some(2));
        let e = Scenario::from_yaml("http: {status_502: 1.5, delay: 0.2}\n", "bad.yaml")
            .expect_err("invalid");
        let m = e.to_string();
        assert!(
            m.contains("bad.yaml") && m.contains("http.status_502: probability 1.5"),
            "{m}"
        );
        assert!(m.contains("http.delay: a duration is needed"), "{m}");
        let e = Scenario::from_yaml("htp: {}\n", "typo.yaml").expect_err("unknown key");
        assert!(e.to_string().contains("unknown field"), "{e}");
        let s = Scenario::from_yaml(
            "kill: {targets: [decode, prefill], every: 15s, limit: 3}\n",
            "k.yaml",
        )
        .expect("valid");
        assert_eq!(s.kill.targets, ["decode", "prefill"]);
        assert_eq!(
            (s.kill.every, s.kill.limit),
            (Duration::from_secs(15), Some(3))
        );
        let e = Scenario::from_yaml("kill: {targets: [decode], limit: 0}\n", "k.yaml")
            .expect_err("no interval, no kills");
        let m = e.to_string();
        assert!(
            m.contains("kill: `every`") && m.contains("a limit of 0"),
            "{m}"
        );
    }

    #[test]
    fn limits_cap_injections_and_a_seed_repeats_the_same_draws() {
        let always = Fault {
            probability: 1.0,
            limit: Some(2),
            ..Fault::default()
        };
        let i = Injector::new(1);
        let fired: Vec<bool> = (0..5).map(|_| i.fires(0, &always)).collect();
        assert_eq!(fired, [true, true, false, false, false]);
        assert_eq!(i.count(0), 2);
        let half = Fault {
            probability: 0.5,
            ..Fault::default()
        };
        let draws = |seed| {
            let i = Injector::new(seed);
            (0..64).map(|_| i.fires(1, &half)).collect::<Vec<_>>()
        };
        assert_eq!(draws(9), draws(9));
        assert_ne!(draws(9), draws(10));
    }
}
