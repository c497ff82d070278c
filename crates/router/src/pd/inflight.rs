//! The router's table of requests in flight: what `/admin/requests` shows. Each request's
//! [`Tracker`] holds its place from admission to its end (dropping it removes the entry,
//! however the request ends); each attempt on workers gets an [`AttemptTracker`], which the
//! code that drives the attempt moves through the handoff's phases
//!
//! admitted → decode_reserved → prefilling → kv_ready → decoding → done | failed(class)
//!
//! recording when each was entered, so an operator can see where a request is stuck and how
//! its earlier attempts ended. An attempt on an aggregated worker skips `decode_reserved` and
//! `kv_ready`. A phase entered after the attempt ended (a late event of a stream already
//! given up) is ignored: a finished attempt's record does not change.
//!
//! The code that ends a request enters its last phase before the tracker drops (`done`, or
//! `failed` with the class: a worker's error, the request's deadline); a tracker dropped with
//! its latest attempt still running belongs to a request whose client went away, and that
//! attempt ends `failed(cancelled)`. The latest [`ENDED_KEPT`] requests that left stay listed,
//! with their final phases, so how a request ended can be read after it has.

use serde::Serialize;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tandem_core::ErrorClass;

/// Where an attempt is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "phase", rename_all = "snake_case")]
pub enum Phase {
    /// Started (workers picked); asking the decode worker to reserve the prompt's KV. A
    /// request before its first attempt (waiting for room) is shown in this phase too.
    Admitted,
    /// The decode worker reserved the KV and answered with where to write it.
    DecodeReserved,
    /// The prefill (or aggregated) worker was sent the prompt.
    Prefilling,
    /// The prefill worker answered with the first token, having pushed the KV to the decode
    /// worker; waiting for the decode worker's first token.
    KvReady,
    /// The decode (or aggregated) worker is streaming tokens.
    Decoding,
    /// The last token reached the client.
    Done,
    /// The attempt failed, classified once where it happened.
    Failed {
        /// How.
        class: ErrorClass,
    },
}

impl Phase {
    /// Every phase's name (metric label values).
    pub const NAMES: [&'static str; 7] = [
        "admitted",
        "decode_reserved",
        "prefilling",
        "kv_ready",
        "decoding",
        "done",
        "failed",
    ];

    /// The phase's name, as `/admin/requests` and the metric label show it.
    pub fn name(self) -> &'static str {
        match self {
            Phase::Admitted => "admitted",
            Phase::DecodeReserved => "decode_reserved",
            Phase::Prefilling => "prefilling",
            Phase::KvReady => "kv_ready",
            Phase::Decoding => "decoding",
            Phase::Done => "done",
            Phase::Failed { .. } => "failed",
        }
    }

    /// Whether the attempt has ended.
    pub fn is_final(self) -> bool {
        matches!(self, Phase::Done | Phase::Failed { .. })
    }
}

/// A phase and when it was entered.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Transition {
    /// The phase (and, for `failed`, its `class`).
    #[serde(flatten)]
    pub phase: Phase,
    /// Milliseconds after the request's admission.
    pub at_ms: u64,
}

/// One attempt as the table shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct AttemptRecord {
    /// Its number in the request, from 1.
    pub attempt: u32,
    /// The prefill (or aggregated) worker.
    pub prefill: String,
    /// The decode worker (none on an aggregated worker).
    pub decode: Option<String>,
    /// Tokens the client already had when it started (non-zero: a migration).
    pub resumed_after: usize,
    /// The phases it went through, in order, from `admitted`.
    pub phases: Vec<Transition>,
}

impl AttemptRecord {
    fn phase(&self) -> Phase {
        self.phases.last().map_or(Phase::Admitted, |t| t.phase)
    }
}

/// Attempts kept per request (the latest); `attempts` counts them all.
pub const ATTEMPTS_KEPT: usize = 8;

/// Requests that left the table kept listed (the latest), with their final phases.
pub const ENDED_KEPT: usize = 32;

/// One request as the table shows it.
#[derive(Clone, Debug, Serialize)]
pub struct Entry {
    /// The request id.
    pub id: String,
    /// The phase of its latest attempt (`admitted` before the first).
    #[serde(flatten)]
    pub phase: Phase,
    /// Milliseconds it has been in that phase: where it is stuck, if it is.
    pub phase_ms: u64,
    /// The prefill (or aggregated) worker of the latest attempt.
    pub prefill: Option<String>,
    /// The decode worker of the latest attempt.
    pub decode: Option<String>,
    /// Attempts so far (retries before the first token, and migrations, each start one).
    pub attempts: u32,
    /// The latest [`ATTEMPTS_KEPT`] attempts, oldest first, with their phases.
    pub history: Vec<AttemptRecord>,
    /// Moves to another pair after tokens were sent.
    pub migrations: u32,
    /// Tokens sent to the client.
    pub tokens: usize,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Milliseconds since admission.
    pub age_ms: u64,
}

/// A request's state in the table.
#[derive(Debug)]
struct Request {
    /// Which opening of the id this is (a client may reuse an id while the first still runs).
    serial: u64,
    started: Instant,
    attempts: u32,
    history: Vec<AttemptRecord>,
    migrations: u32,
    tokens: usize,
    prompt_tokens: usize,
}

impl Request {
    fn phase(&self) -> Phase {
        self.history
            .last()
            .map_or(Phase::Admitted, AttemptRecord::phase)
    }

    /// When the current phase was entered, after admission.
    fn phase_at_ms(&self) -> u64 {
        self.history
            .last()
            .and_then(|a| a.phases.last())
            .map_or(0, |t| t.at_ms)
    }

    fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    /// As the table shows it.
    fn entry(&self, id: &str) -> Entry {
        let age_ms = self.now_ms();
        let latest = self.history.last();
        Entry {
            id: id.to_string(),
            phase: self.phase(),
            phase_ms: age_ms.saturating_sub(self.phase_at_ms()),
            prefill: latest.map(|a| a.prefill.clone()),
            decode: latest.and_then(|a| a.decode.clone()),
            attempts: self.attempts,
            history: self.history.clone(),
            migrations: self.migrations,
            tokens: self.tokens,
            prompt_tokens: self.prompt_tokens,
            age_ms,
        }
    }
}

/// Every request in flight.
#[derive(Debug)]
pub struct InFlightTable {
    entries: Mutex<HashMap<String, Request>>,
    /// The next request's serial.
    serials: std::sync::atomic::AtomicU64,
    /// The latest requests that left, newest last.
    ended: Mutex<VecDeque<Entry>>,
    /// Moves after tokens were sent, all requests together (`tandem_migrations_total`).
    migrations_total: prometheus::IntCounter,
    /// Requests by the phase of their latest attempt (`tandem_requests_in_phase`).
    in_phase: prometheus::IntGaugeVec,
    /// Failed P/D attempts by the side blamed and the error class
    /// (`tandem_handoff_failures_total`).
    handoff_failures: prometheus::IntCounterVec,
}

impl Default for InFlightTable {
    fn default() -> Self {
        let in_phase = prometheus::IntGaugeVec::new(
            prometheus::Opts::new(
                "tandem_requests_in_phase",
                "Requests in flight by the phase of their latest attempt (as /admin/requests shows them)",
            ),
            &["phase"],
        )
        .expect("a valid metric name");
        for name in Phase::NAMES {
            in_phase.with_label_values(&[name]).set(0);
        }
        let handoff_failures = prometheus::IntCounterVec::new(
            prometheus::Opts::new(
                "tandem_handoff_failures_total",
                "Failed prefill/decode attempts by the side blamed (prefill, decode, or both: \
                 a failed KV transfer or a stall) and error class",
            ),
            &["side", "class"],
        )
        .expect("a valid metric name");
        for side in crate::pd::attempt::Leg::NAMES {
            for class in crate::metrics::ALL_CLASSES {
                handoff_failures.with_label_values(&[side, class.as_str()]);
            }
        }
        Self {
            entries: Mutex::default(),
            serials: std::sync::atomic::AtomicU64::new(0),
            ended: Mutex::default(),
            migrations_total: prometheus::IntCounter::new(
                "tandem_migrations_total",
                "Requests moved to another pair after their stream broke mid-generation",
            )
            .expect("a valid metric name"),
            in_phase,
            handoff_failures,
        }
    }
}

impl InFlightTable {
    /// The migrations counter, to register in the router's registry.
    pub fn migrations_counter(&self) -> prometheus::IntCounter {
        self.migrations_total.clone()
    }

    /// The handoff-failure counters, to register in the router's registry.
    pub fn handoff_failures_counter(&self) -> prometheus::IntCounterVec {
        self.handoff_failures.clone()
    }

    /// Counts a failed P/D attempt, blamed on `side`.
    pub(crate) fn handoff_failed(&self, side: crate::pd::attempt::Leg, class: ErrorClass) {
        self.handoff_failures
            .with_label_values(&[side.as_str(), class.as_str()])
            .inc();
    }

    /// The requests-by-phase gauges, to register in the router's registry.
    pub fn phase_gauges(&self) -> prometheus::IntGaugeVec {
        self.in_phase.clone()
    }

    /// Adds a request; the returned tracker removes it when dropped.
    pub fn open(self: &Arc<Self>, id: &str, prompt_tokens: usize) -> Tracker {
        let serial = self
            .serials
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let request = Request {
            serial,
            started: Instant::now(),
            attempts: 0,
            history: Vec::new(),
            migrations: 0,
            tokens: 0,
            prompt_tokens,
        };
        let replaced = self.lock().insert(id.to_string(), request);
        self.count(Phase::Admitted, 1);
        if let Some(old) = replaced {
            // A client reusing a request id: the table shows the newer request; the older
            // one's tracker no longer reaches it (serials differ) and it is listed as ended.
            self.count(old.phase(), -1);
            self.push_ended(old.entry(id));
        }
        Tracker {
            table: self.clone(),
            id: id.to_string(),
            serial,
        }
    }

    fn push_ended(&self, entry: Entry) {
        let mut ended = self.ended.lock().unwrap_or_else(|e| e.into_inner());
        if ended.len() == ENDED_KEPT {
            ended.pop_front();
        }
        ended.push_back(entry);
    }

    /// The requests now, oldest first.
    pub fn snapshot(&self) -> Vec<Entry> {
        let mut v: Vec<Entry> = self.lock().iter().map(|(id, r)| r.entry(id)).collect();
        v.sort_by(|a, b| b.age_ms.cmp(&a.age_ms).then_with(|| a.id.cmp(&b.id)));
        v
    }

    /// The latest [`ENDED_KEPT`] requests that left the table, newest first, as they were
    /// when they left (`age_ms`: how long each ran).
    pub fn ended(&self) -> Vec<Entry> {
        let ended = self.ended.lock().unwrap_or_else(|e| e.into_inner());
        ended.iter().rev().cloned().collect()
    }

    /// Requests in flight.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Request>> {
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn count(&self, phase: Phase, delta: i64) {
        self.in_phase.with_label_values(&[phase.name()]).add(delta);
    }

    /// Enters `phase` on attempt `attempt` of request `id` opened as `serial` (its latest
    /// attempt with `None`), unless that attempt has ended.
    fn enter(&self, id: &str, serial: u64, attempt: Option<u32>, phase: Phase) {
        let mut entries = self.lock();
        let Some(r) = entries.get_mut(id).filter(|r| r.serial == serial) else {
            return;
        };
        let before = r.phase();
        let at_ms = r.now_ms();
        let record = match attempt {
            None => r.history.last_mut(),
            Some(n) => r.history.iter_mut().rev().find(|a| a.attempt == n),
        };
        let Some(record) = record.filter(|a| !a.phase().is_final()) else {
            return;
        };
        record.phases.push(Transition { phase, at_ms });
        let after = r.phase();
        drop(entries);
        if before != after {
            self.count(before, -1);
            self.count(after, 1);
        }
    }
}

/// One request's place in the table.
#[derive(Debug)]
pub struct Tracker {
    table: Arc<InFlightTable>,
    id: String,
    serial: u64,
}

impl Tracker {
    fn update(&self, f: impl FnOnce(&mut Request)) {
        if let Some(r) = self
            .table
            .lock()
            .get_mut(&self.id)
            .filter(|r| r.serial == self.serial)
        {
            f(r);
        }
    }

    /// Starts an attempt of the requests of `trackers` (the choices of one prompt, which
    /// share an attempt) on these workers, in phase `admitted`.
    pub fn attempt(trackers: &[Tracker], prefill: &str, decode: Option<&str>) -> AttemptTracker {
        let mut slots = Vec::with_capacity(trackers.len());
        for t in trackers {
            let mut entries = t.table.lock();
            let Some(r) = entries.get_mut(&t.id).filter(|r| r.serial == t.serial) else {
                continue;
            };
            let before = r.phase();
            r.attempts += 1;
            let record = AttemptRecord {
                attempt: r.attempts,
                prefill: prefill.to_string(),
                decode: decode.map(str::to_string),
                resumed_after: r.tokens,
                phases: vec![Transition {
                    phase: Phase::Admitted,
                    at_ms: r.now_ms(),
                }],
            };
            if r.history.len() == ATTEMPTS_KEPT {
                r.history.remove(0);
            }
            r.history.push(record);
            slots.push((t.table.clone(), t.id.clone(), t.serial, r.attempts));
            drop(entries);
            if before != Phase::Admitted {
                t.table.count(before, -1);
                t.table.count(Phase::Admitted, 1);
            }
        }
        AttemptTracker { slots }
    }

    /// Enters `phase` on the latest attempt (unless it has ended).
    pub fn enter(&self, phase: Phase) {
        self.table.enter(&self.id, self.serial, None, phase);
    }

    /// A move after tokens were sent (the next attempt records where it goes).
    pub fn migration(&self) {
        self.table.migrations_total.inc();
        self.update(|r| r.migrations += 1);
    }

    /// A token reached the client.
    pub fn token(&self) {
        self.update(|r| r.tokens += 1);
    }
}

impl Drop for Tracker {
    fn drop(&mut self) {
        // Whoever ended the request entered its last phase; one still running was dropped
        // with its client.
        self.enter(Phase::Failed {
            class: ErrorClass::Cancelled,
        });
        let removed = {
            let mut entries = self.table.lock();
            // Only its own request: a newer one under the same id stays.
            match entries.get(&self.id) {
                Some(r) if r.serial == self.serial => entries.remove(&self.id),
                _ => None,
            }
        };
        if let Some(r) = removed {
            self.table.count(r.phase(), -1);
            self.table.push_ended(r.entry(&self.id));
        }
    }
}

/// One attempt's place in the table, for the code that drives it (cheap to clone, and free
/// of the request's lifetime, so a worker's stream can carry it).
#[derive(Clone, Debug)]
pub struct AttemptTracker {
    /// Per request of the attempt: its table, id, serial and attempt number.
    slots: Vec<(Arc<InFlightTable>, String, u64, u32)>,
}

impl AttemptTracker {
    /// Enters `phase`, unless the attempt has ended.
    pub fn enter(&self, phase: Phase) {
        for (table, id, serial, attempt) in &self.slots {
            table.enter(id, *serial, Some(*attempt), phase);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn phases(e: &Entry, attempt: usize) -> Vec<&'static str> {
        e.history[attempt]
            .phases
            .iter()
            .map(|t| t.phase.name())
            .collect()
    }

    fn in_phase(table: &InFlightTable, phase: &str) -> i64 {
        table.phase_gauges().with_label_values(&[phase]).get()
    }

    /// A client reusing a request id while the first request runs: the table shows the newer
    /// one, the older one's tracker neither moves nor removes it, and the gauges stay whole.
    #[test]
    fn a_reused_request_id_leaves_the_newer_request_in_place() {
        let table = Arc::new(InFlightTable::default());
        let old = table.open("dup", 5);
        let new = table.open("dup", 9);
        assert_eq!(table.len(), 1);
        assert_eq!(in_phase(&table, "admitted"), 1);
        let old_attempt = Tracker::attempt(std::slice::from_ref(&old), "p0", Some("d0"));
        old_attempt.enter(Phase::Prefilling);
        old.enter(Phase::Decoding);
        let newer = Tracker::attempt(std::slice::from_ref(&new), "p1", Some("d1"));
        newer.enter(Phase::DecodeReserved);
        drop(old);
        let now = table.snapshot();
        assert_eq!(now.len(), 1, "the newer request is still in flight");
        assert_eq!(now[0].prompt_tokens, 9);
        assert_eq!(now[0].history.len(), 1, "only the newer request's attempt");
        assert_eq!(phases(&now[0], 0), vec!["admitted", "decode_reserved"]);
        assert_eq!(in_phase(&table, "decode_reserved"), 1);
        assert_eq!(
            table.ended()[0].prompt_tokens,
            5,
            "the replaced one is listed as ended"
        );
        drop(new);
        assert!(table.is_empty());
        let total: i64 = Phase::NAMES.iter().map(|p| in_phase(&table, p)).sum();
        assert_eq!(total, 0, "every gauge back to zero");
    }

    #[test]
    fn attempts_move_through_the_handoff_and_the_request_leaves_when_its_tracker_drops() {
        let table = Arc::new(InFlightTable::default());
        let t = table.open("r1", 12);
        let other = table.open("r2", 3);
        assert_eq!(in_phase(&table, "admitted"), 2);
        let first = Tracker::attempt(std::slice::from_ref(&t), "p0", Some("d0"));
        for phase in [
            Phase::DecodeReserved,
            Phase::Prefilling,
            Phase::KvReady,
            Phase::Decoding,
        ] {
            first.enter(phase);
        }
        assert_eq!(
            (in_phase(&table, "admitted"), in_phase(&table, "decoding")),
            (1, 1)
        );
        t.token();
        t.token();
        // The stream breaks: the attempt fails, the request migrates to another pair.
        t.enter(Phase::Failed {
            class: ErrorClass::Unavailable,
        });
        t.migration();
        let second = Tracker::attempt(std::slice::from_ref(&t), "p1", Some("d1"));
        second.enter(Phase::DecodeReserved);
        // A late event of the first attempt's stream does not reopen it.
        first.enter(Phase::Decoding);

        let snap = table.snapshot();
        let e = snap.iter().find(|e| e.id == "r1").expect("listed");
        assert_eq!(e.phase, Phase::DecodeReserved);
        assert_eq!((e.attempts, e.migrations, e.tokens), (2, 1, 2));
        assert_eq!(
            phases(e, 0),
            [
                "admitted",
                "decode_reserved",
                "prefilling",
                "kv_ready",
                "decoding",
                "failed"
            ]
        );
        assert_eq!(phases(e, 1), ["admitted", "decode_reserved"]);
        assert_eq!(
            (e.history[0].resumed_after, e.history[1].resumed_after),
            (0, 2),
            "the second attempt is a migration"
        );
        let times: Vec<u64> = e
            .history
            .iter()
            .flat_map(|a| &a.phases)
            .map(|t| t.at_ms)
            .collect();
        assert!(times.windows(2).all(|w| w[0] <= w[1]), "{times:?}");
        assert!(e.phase_ms <= e.age_ms);
        assert_eq!(e.decode.as_deref(), Some("d1"));
        assert_eq!(
            table.migrations_counter().get(),
            1,
            "counted for the metric"
        );
        assert_eq!(
            (
                in_phase(&table, "decode_reserved"),
                in_phase(&table, "decoding"),
                in_phase(&table, "failed")
            ),
            (1, 0, 0),
            "the gauges follow the latest attempt"
        );

        let json = serde_json::to_value(e).expect("serialises");
        assert_eq!(json["phase"], "decode_reserved");
        assert_eq!(json["attempts"], 2);
        assert_eq!(json["history"][0]["phases"][5]["phase"], "failed");
        assert_eq!(json["history"][0]["phases"][5]["class"], "unavailable");
        assert!(json["history"][0]["phases"][5]["at_ms"].is_u64());
        assert!(json.get("class").is_none(), "{json}");

        second.enter(Phase::Failed {
            class: ErrorClass::TransferFailed,
        });
        let json = serde_json::to_value(&table.snapshot()[0]).expect("serialises");
        assert_eq!(
            (&json["phase"], &json["class"]),
            (&"failed".into(), &"transfer_failed".into())
        );

        drop(t);
        assert_eq!(table.len(), 1);
        assert_eq!(in_phase(&table, "failed"), 0);
        drop(other);
        assert!(table.is_empty());
        for name in Phase::NAMES {
            assert_eq!(in_phase(&table, name), 0, "{name} left counted");
        }
    }

    #[test]
    fn the_metric_label_and_the_json_name_a_phase_alike() {
        let every = [
            Phase::Admitted,
            Phase::DecodeReserved,
            Phase::Prefilling,
            Phase::KvReady,
            Phase::Decoding,
            Phase::Done,
            Phase::Failed {
                class: ErrorClass::Internal,
            },
        ];
        let names: Vec<&str> = every.iter().map(|p| p.name()).collect();
        assert_eq!(names, Phase::NAMES);
        for p in every {
            let json = serde_json::to_value(p).expect("serialises");
            assert_eq!(json["phase"], p.name());
            assert_eq!(p.is_final(), matches!(p.name(), "done" | "failed"));
        }
    }

    #[test]
    fn the_choices_of_one_prompt_share_an_attempt_and_end_on_their_own() {
        let table = Arc::new(InFlightTable::default());
        let choices = [table.open("r-0", 4), table.open("r-1", 4)];
        let attempt = Tracker::attempt(&choices, "both-0", None);
        attempt.enter(Phase::Prefilling);
        attempt.enter(Phase::Decoding);
        choices[0].enter(Phase::Done);
        let snap = table.snapshot();
        let phase_of = |id: &str| snap.iter().find(|e| e.id == id).expect("listed").phase;
        assert_eq!(
            (phase_of("r-0"), phase_of("r-1")),
            (Phase::Done, Phase::Decoding)
        );
        assert_eq!(snap[0].decode, None);
        assert_eq!(in_phase(&table, "done") + in_phase(&table, "decoding"), 2);
    }

    #[test]
    fn only_the_latest_attempts_are_kept_and_all_are_counted() {
        let table = Arc::new(InFlightTable::default());
        let t = table.open("r", 1);
        for i in 0..ATTEMPTS_KEPT + 3 {
            Tracker::attempt(std::slice::from_ref(&t), &format!("p{i}"), Some("d")).enter(
                Phase::Failed {
                    class: ErrorClass::Unavailable,
                },
            );
        }
        let e = &table.snapshot()[0];
        assert_eq!(e.attempts as usize, ATTEMPTS_KEPT + 3);
        assert_eq!(e.history.len(), ATTEMPTS_KEPT);
        assert_eq!(e.history[0].attempt, 4);
        assert_eq!(
            e.prefill.as_deref(),
            Some(format!("p{}", ATTEMPTS_KEPT + 2).as_str())
        );
        assert_eq!(in_phase(&table, "failed"), 1);
    }
}
