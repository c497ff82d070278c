//! The router's table of requests in flight, by phase: what `/admin/requests` shows. Each
//! request's [`Tracker`] moves it through admitted (waiting for room and for a decode
//! worker's KV reservation) → prefilling → decoding (→ migrating → decoding …) and removes it
//! when the request ends, however it ends.

use serde::Serialize;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Where a request is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Accepted; waiting for room, or for a decode worker's KV reservation.
    Admitted,
    /// A decode worker reserved the KV; the prefill worker is computing the prompt and pushing the KV.
    Prefilling,
    /// Tokens are streaming.
    Decoding,
    /// Its stream broke after tokens were sent; it is being moved to another pair.
    Migrating,
}

/// One request as the table shows it.
#[derive(Clone, Debug, Serialize)]
pub struct Entry {
    /// The request id.
    pub id: String,
    /// Its phase.
    pub phase: Phase,
    /// The prefill (or aggregated) worker of the current attempt.
    pub prefill: Option<String>,
    /// The decode worker of the current attempt.
    pub decode: Option<String>,
    /// Attempts so far (retries before the first token, and migrations, each start one).
    pub attempts: u32,
    /// Moves to another pair after tokens were sent.
    pub migrations: u32,
    /// Tokens sent to the client.
    pub tokens: usize,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Milliseconds since admission (filled in by [`InFlightTable::snapshot`]).
    pub age_ms: u64,
    #[serde(skip)]
    started: Option<Instant>,
}

/// Every request in flight.
#[derive(Debug)]
pub struct InFlightTable {
    entries: Mutex<HashMap<String, Entry>>,
    /// Moves after tokens were sent, all requests together (`tandem_migrations_total`).
    migrations_total: prometheus::IntCounter,
}

impl Default for InFlightTable {
    fn default() -> Self {
        Self {
            entries: Mutex::default(),
            migrations_total: prometheus::IntCounter::new(
                "tandem_migrations_total",
                "Requests moved to another pair after their stream broke mid-generation",
            )
            .expect("a valid metric name"),
        }
    }
}

impl InFlightTable {
    /// The migrations counter, to register in the router's registry.
    pub fn migrations_counter(&self) -> prometheus::IntCounter {
        self.migrations_total.clone()
    }

    /// Adds a request; the returned tracker removes it when dropped.
    pub fn open(self: &Arc<Self>, id: &str, prompt_tokens: usize) -> Tracker {
        let entry = Entry {
            id: id.to_string(),
            phase: Phase::Admitted,
            prefill: None,
            decode: None,
            attempts: 0,
            migrations: 0,
            tokens: 0,
            prompt_tokens,
            age_ms: 0,
            started: Some(Instant::now()),
        };
        self.lock().insert(id.to_string(), entry);
        Tracker {
            table: self.clone(),
            id: id.to_string(),
        }
    }

    /// The requests now, oldest first.
    pub fn snapshot(&self) -> Vec<Entry> {
        let mut v: Vec<Entry> = self
            .lock()
            .values()
            .map(|e| Entry {
                age_ms: e.started.map_or(0, |s| s.elapsed().as_millis() as u64),
                ..e.clone()
            })
            .collect();
        v.sort_by(|a, b| b.age_ms.cmp(&a.age_ms).then_with(|| a.id.cmp(&b.id)));
        v
    }

    /// Requests in flight.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Entry>> {
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// One request's place in the table.
#[derive(Debug)]
pub struct Tracker {
    table: Arc<InFlightTable>,
    id: String,
}

impl Tracker {
    fn update(&self, f: impl FnOnce(&mut Entry)) {
        if let Some(e) = self.table.lock().get_mut(&self.id) {
            f(e);
        }
    }

    /// Moves to `phase`.
    pub fn phase(&self, phase: Phase) {
        self.update(|e| e.phase = phase);
    }

    /// A new attempt on these workers.
    pub fn attempt(&self, prefill: &str, decode: Option<&str>) {
        self.update(|e| {
            e.attempts += 1;
            e.prefill = Some(prefill.to_string());
            e.decode = decode.map(str::to_string);
        });
    }

    /// A move after tokens were sent.
    pub fn migration(&self) {
        self.table.migrations_total.inc();
        self.update(|e| {
            e.migrations += 1;
            e.phase = Phase::Migrating;
        });
    }

    /// A token reached the client.
    pub fn token(&self) {
        self.update(|e| e.tokens += 1);
    }
}

impl Drop for Tracker {
    fn drop(&mut self) {
        self.table.lock().remove(&self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_moves_through_its_phases_and_leaves_when_its_tracker_drops() {
        let table = Arc::new(InFlightTable::default());
        let t = table.open("r1", 12);
        let other = table.open("r2", 3);
        t.attempt("p0", Some("d0"));
        t.phase(Phase::Prefilling);
        t.phase(Phase::Decoding);
        t.token();
        t.token();
        t.migration();
        t.attempt("p1", Some("d1"));
        let snap = table.snapshot();
        let e = snap.iter().find(|e| e.id == "r1").expect("listed");
        assert_eq!(e.phase, Phase::Migrating);
        assert_eq!((e.attempts, e.migrations, e.tokens), (2, 1, 2));
        assert_eq!(
            table.migrations_counter().get(),
            1,
            "counted for the metric"
        );
        assert_eq!(e.decode.as_deref(), Some("d1"));
        let json = serde_json::to_value(e).expect("serialises");
        assert_eq!(json["phase"], "migrating");
        assert!(json.get("started").is_none());
        drop(t);
        assert_eq!(table.len(), 1);
        drop(other);
        assert!(table.is_empty());
    }
}
