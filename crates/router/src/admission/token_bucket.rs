//! A token bucket: `rate` units a second flow into a bucket holding at most `burst`; taking
//! `cost` units needs that many in the bucket. No I/O and no clock of its own: every call is
//! given the time, so tests drive it with made-up instants.

use std::time::{Duration, Instant};

/// One rate limit (requests a second, or prompt tokens a second).
#[derive(Clone, Debug)]
pub struct TokenBucket {
    /// Units added per second; > 0.
    rate: f64,
    /// The most the bucket holds; > 0.
    burst: f64,
    /// Units in the bucket at `updated`; negative after a cost above `burst` was taken.
    level: f64,
    updated: Instant,
}

impl TokenBucket {
    /// A full bucket refilled at `rate` a second, holding at most `burst`. Both must be
    /// finite and greater than zero (the config checks them).
    pub fn new(rate: f64, burst: f64, now: Instant) -> Self {
        Self {
            rate,
            burst,
            level: burst,
            updated: now,
        }
    }

    fn refill(&mut self, now: Instant) {
        // An earlier `now` (clocks read in another order) adds nothing.
        let elapsed = now.saturating_duration_since(self.updated).as_secs_f64();
        self.level = (self.level + elapsed * self.rate).min(self.burst);
        self.updated = self.updated.max(now);
    }

    /// How long until `cost` units may be taken; zero when they may be now. A cost above
    /// the burst is let through once the bucket is full (the bucket then owes the rest), so
    /// a prompt larger than the burst is slowed, never refused for good.
    pub fn wait(&mut self, cost: f64, now: Instant) -> Duration {
        self.refill(now);
        let needed = cost.min(self.burst);
        if self.level >= needed {
            Duration::ZERO
        } else {
            Duration::from_secs_f64((needed - self.level) / self.rate)
        }
    }

    /// Takes `cost` units (after [`Self::wait`] said zero).
    pub fn take(&mut self, cost: f64, now: Instant) {
        self.refill(now);
        self.level -= cost;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn a_full_bucket_passes_its_burst_then_refills_at_its_rate() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(2.0, 3.0, t0);
        for _ in 0..3 {
            assert_eq!(b.wait(1.0, t0), Duration::ZERO);
            b.take(1.0, t0);
        }
        // Empty: one unit comes in after half a second at 2/s.
        assert_eq!(b.wait(1.0, t0), ms(500));
        assert_eq!(b.wait(1.0, t0 + ms(250)), ms(250));
        assert_eq!(b.wait(1.0, t0 + ms(500)), Duration::ZERO);
        b.take(1.0, t0 + ms(500));
        // Refilling stops at the burst: ten idle seconds give three units, not twenty.
        let later = t0 + Duration::from_secs(10);
        assert_eq!(b.wait(3.0, later), Duration::ZERO);
        b.take(3.0, later);
        assert_eq!(b.wait(1.0, later), ms(500));
    }

    #[test]
    fn a_cost_above_the_burst_waits_for_a_full_bucket_and_leaves_a_debt() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(100.0, 100.0, t0);
        b.take(50.0, t0);
        // 250 tokens need the whole bucket: 50 more, half a second.
        assert_eq!(b.wait(250.0, t0), ms(500));
        let full = t0 + ms(500);
        assert_eq!(b.wait(250.0, full), Duration::ZERO);
        b.take(250.0, full);
        // 150 owed: one token is 1.51 s away.
        assert_eq!(b.wait(1.0, full), ms(1510));
    }

    #[test]
    fn an_earlier_instant_neither_refills_nor_panics() {
        let t0 = Instant::now() + Duration::from_secs(1);
        let mut b = TokenBucket::new(1.0, 1.0, t0);
        b.take(1.0, t0);
        let before = t0 - ms(300);
        assert_eq!(b.wait(1.0, before), Duration::from_secs(1));
        assert_eq!(b.wait(1.0, t0 + Duration::from_secs(1)), Duration::ZERO);
    }
}
