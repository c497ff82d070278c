//! A per-worker circuit breaker: after `threshold` consecutive failures that are the worker's
//! fault (unavailable, transfer failures, stalls — never a client's bad request) the worker
//! is ejected from new routing for `cooldown`; after that one request is let through as a
//! probe (half-open): success closes the breaker, failure opens it again. A pure state
//! machine over explicit instants, so it is tested without waiting.

use std::time::{Duration, Instant};
use tandem_core::ErrorClass;

/// Breaker settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BreakerPolicy {
    /// Consecutive failures that open the breaker.
    pub threshold: u32,
    /// How long an open breaker keeps the worker out of rotation.
    pub cooldown: Duration,
}

impl Default for BreakerPolicy {
    fn default() -> Self {
        Self {
            threshold: 3,
            cooldown: Duration::from_secs(5),
        }
    }
}

/// Whether a failure of this class counts against the worker that produced it.
pub fn counts_against_worker(class: ErrorClass) -> bool {
    matches!(
        class,
        ErrorClass::Unavailable
            | ErrorClass::TransferFailed
            | ErrorClass::Internal
            | ErrorClass::DeadlineExceeded
    )
}

/// One worker's breaker.
#[derive(Clone, Debug, Default)]
pub struct Breaker {
    failures: u32,
    open_until: Option<Instant>,
    /// A probe is out (half-open): no further request until it reports.
    probing: bool,
    /// Times this breaker opened since the router started.
    ejections: u64,
}

/// What the breaker says about sending a request now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admit {
    /// Closed: route normally.
    Yes,
    /// Half-open: this request is the probe.
    Probe,
    /// Open: route elsewhere.
    No,
}

impl Breaker {
    /// Whether a request may go to this worker at `now` (a `Probe` answer marks the probe
    /// as sent).
    pub fn admit(&mut self, now: Instant) -> Admit {
        match self.open_until {
            None => Admit::Yes,
            Some(until) if now < until || self.probing => Admit::No,
            Some(_) => {
                self.probing = true;
                Admit::Probe
            }
        }
    }

    /// Whether the worker is out of rotation at `now` (open, or its probe is out).
    pub fn is_open(&self, now: Instant) -> bool {
        self.open_until
            .is_some_and(|until| now < until || self.probing)
    }

    /// The breaker's state at `now`: `closed` (routing normally), `open` (cooling down) or
    /// `half_open` (the cooldown ended: the next request, or the one out, is the probe).
    pub fn state(&self, now: Instant) -> &'static str {
        match self.open_until {
            None => "closed",
            Some(until) if now < until && !self.probing => "open",
            Some(_) => "half_open",
        }
    }

    /// Times the breaker opened (the worker was taken out of rotation) so far.
    pub fn ejections(&self) -> u64 {
        self.ejections
    }

    /// A request on this worker succeeded.
    pub fn on_success(&mut self) {
        *self = Self {
            ejections: self.ejections,
            ..Self::default()
        };
    }

    /// The worker answers again (its health check) at `now`: an open breaker lets the next
    /// request through as a probe instead of waiting out its cooldown.
    pub fn on_recovered(&mut self, now: Instant) {
        if self.open_until.is_some() {
            self.open_until = Some(now);
            self.probing = false;
        }
    }

    /// A request was routed here but never reached the worker (the other leg failed first):
    /// a pending probe is withdrawn so the next request probes again.
    pub fn on_untested(&mut self) {
        self.probing = false;
    }

    /// A request on this worker failed with `class` at `now`.
    pub fn on_failure(&mut self, class: ErrorClass, now: Instant, policy: BreakerPolicy) {
        if !counts_against_worker(class) {
            return;
        }
        self.failures += 1;
        if self.probing || self.failures >= policy.threshold.max(1) {
            if !self.is_open(now) {
                self.ejections += 1;
            }
            self.open_until = Some(now + policy.cooldown);
            self.probing = false;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opens_after_the_threshold_and_probes_after_the_cooldown() {
        let p = BreakerPolicy {
            threshold: 2,
            cooldown: Duration::from_secs(5),
        };
        let t0 = Instant::now();
        let mut b = Breaker::default();
        assert_eq!(b.admit(t0), Admit::Yes);
        assert_eq!(b.state(t0), "closed");
        b.on_failure(ErrorClass::Unavailable, t0, p);
        assert_eq!(
            b.admit(t0),
            Admit::Yes,
            "one failure is below the threshold"
        );
        assert_eq!(b.ejections(), 0);
        b.on_failure(ErrorClass::DeadlineExceeded, t0, p);
        assert_eq!(b.admit(t0), Admit::No, "open");
        assert_eq!(b.state(t0), "open");
        assert_eq!(b.ejections(), 1);
        b.on_failure(ErrorClass::Unavailable, t0, p);
        assert_eq!(b.ejections(), 1, "a failure while open is no new ejection");
        assert!(b.is_open(t0 + Duration::from_secs(4)));
        let later = t0 + Duration::from_secs(5);
        assert_eq!(
            b.state(later),
            "half_open",
            "cooldown over, no probe out yet"
        );
        assert_eq!(b.admit(later), Admit::Probe, "half-open after the cooldown");
        assert_eq!(b.state(later), "half_open", "the probe is out");
        assert_eq!(b.admit(later), Admit::No, "one probe at a time");
        b.on_failure(ErrorClass::Unavailable, later, p);
        assert_eq!(
            b.admit(later + Duration::from_secs(1)),
            Admit::No,
            "the probe failed"
        );
        let again = later + Duration::from_secs(5);
        assert_eq!(b.admit(again), Admit::Probe);
        assert_eq!(
            b.ejections(),
            1,
            "a failed probe keeps it out: no new ejection"
        );
        b.on_success();
        assert_eq!(b.admit(again), Admit::Yes, "closed after a good probe");
        b.on_failure(ErrorClass::Unavailable, again, p);
        b.on_failure(ErrorClass::Unavailable, again, p);
        assert_eq!(b.ejections(), 2, "the count outlives a success");
    }

    #[test]
    fn a_recovered_worker_is_probed_before_its_cooldown_ends() {
        let policy = BreakerPolicy {
            threshold: 1,
            cooldown: Duration::from_secs(60),
        };
        let t0 = Instant::now();
        let mut b = Breaker::default();
        b.on_recovered(t0);
        assert_eq!(b.admit(t0), Admit::Yes, "a closed breaker stays closed");
        b.on_failure(ErrorClass::Unavailable, t0, policy);
        assert_eq!(b.admit(t0), Admit::No);
        let t1 = t0 + Duration::from_secs(1);
        b.on_recovered(t1);
        assert_eq!(b.admit(t1), Admit::Probe, "one request probes at once");
        assert_eq!(b.admit(t1), Admit::No, "and only one");
        b.on_success();
        assert_eq!(b.admit(t1), Admit::Yes);
    }

    #[test]
    fn client_errors_never_count() {
        let p = BreakerPolicy {
            threshold: 1,
            cooldown: Duration::from_secs(5),
        };
        let now = Instant::now();
        let mut b = Breaker::default();
        for class in [
            ErrorClass::InvalidRequest,
            ErrorClass::CapacityExhausted,
            ErrorClass::Cancelled,
        ] {
            b.on_failure(class, now, p);
        }
        assert_eq!(b.admit(now), Admit::Yes);
        b.on_failure(ErrorClass::TransferFailed, now, p);
        assert_eq!(b.admit(now), Admit::No);
    }

    #[test]
    fn a_success_resets_the_count() {
        let p = BreakerPolicy::default();
        let now = Instant::now();
        let mut b = Breaker::default();
        b.on_failure(ErrorClass::Unavailable, now, p);
        b.on_failure(ErrorClass::Unavailable, now, p);
        b.on_success();
        b.on_failure(ErrorClass::Unavailable, now, p);
        b.on_failure(ErrorClass::Unavailable, now, p);
        assert_eq!(
            b.admit(now),
            Admit::Yes,
            "two failures since the last success"
        );
    }
}
