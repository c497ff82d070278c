//! Admission and draining. Every request RPC takes an [`InFlight`] guard at its start (a
//! stream's guard lives until its last token is sent); once a drain starts, or while the
//! worker is not registered in discovery, new requests are refused as `Unavailable` (the
//! router retries them elsewhere, so nothing is lost) and the serve loop waits for the
//! guards to be gone before the process exits.

use crate::{Error, Result};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// Whether and how requests are admitted.
pub(crate) struct Admission {
    /// Set to the drain deadline when a drain starts.
    drain: watch::Sender<Option<Duration>>,
    in_flight: Arc<watch::Sender<usize>>,
    /// Discovery registration state (`None`: not registered anywhere, static lists).
    registered: Option<watch::Receiver<bool>>,
}

/// One admitted request; dropping it ends the request's claim on the worker.
pub(crate) struct InFlight(Arc<watch::Sender<usize>>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.send_modify(|n| *n = n.saturating_sub(1));
    }
}

impl Admission {
    pub(crate) fn new(registered: Option<watch::Receiver<bool>>) -> Self {
        Self {
            drain: watch::Sender::new(None),
            in_flight: Arc::new(watch::Sender::new(0)),
            registered,
        }
    }

    /// Admits a request, or says why not.
    pub(crate) fn admit(&self) -> Result<InFlight> {
        if self.drain.borrow().is_some() {
            return Err(Error::NotAdmitting(
                "this worker is draining and takes no new requests".into(),
            ));
        }
        if self.registered.as_ref().is_some_and(|r| !*r.borrow()) {
            return Err(Error::NotAdmitting(
                "this worker lost its discovery registration and takes no new requests until it is registered again".into(),
            ));
        }
        self.in_flight.send_modify(|n| *n += 1);
        Ok(InFlight(self.in_flight.clone()))
    }

    /// Draining, or not taking work for want of a registration.
    pub(crate) fn is_draining(&self) -> bool {
        self.drain.borrow().is_some() || self.registered.as_ref().is_some_and(|r| !*r.borrow())
    }

    /// Requests admitted and not finished.
    pub(crate) fn in_flight(&self) -> usize {
        *self.in_flight.borrow()
    }

    /// Starts a drain with `deadline`; false when one had already started.
    pub(crate) fn start_drain(&self, deadline: Duration) -> bool {
        self.drain.send_if_modified(|d| {
            if d.is_some() {
                false
            } else {
                *d = Some(deadline);
                true
            }
        })
    }

    /// Resolves with the deadline once a drain has started.
    pub(crate) async fn drain_started(&self) -> Duration {
        let mut rx = self.drain.subscribe();
        let started = rx.wait_for(Option::is_some).await;
        started.ok().and_then(|d| *d).unwrap_or_default()
    }

    /// Resolves once no request is in flight.
    pub(crate) async fn wait_done(&self) {
        let mut rx = self.in_flight.subscribe();
        let _ = rx.wait_for(|n| *n == 0).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_drain_refuses_new_work_and_completes_when_the_last_request_ends() {
        let a = Admission::new(None);
        let first = a.admit().expect("admitted before the drain");
        assert!(a.start_drain(Duration::from_secs(5)));
        assert!(
            !a.start_drain(Duration::from_secs(1)),
            "a second drain is the same drain"
        );
        assert_eq!(a.drain_started().await, Duration::from_secs(5));
        assert!(a.is_draining());
        let refused = a.admit().map(|_| ()).expect_err("draining");
        assert_eq!(refused.class(), tandem_core::ErrorClass::Unavailable);
        assert_eq!(a.in_flight(), 1);
        let done = a.wait_done();
        tokio::pin!(done);
        assert!(
            futures::poll!(done.as_mut()).is_pending(),
            "a request is still in flight"
        );
        drop(first);
        done.await;
        assert_eq!(a.in_flight(), 0);
    }

    #[test]
    fn a_lost_registration_stops_admission_until_it_is_back() {
        let (up, rx) = watch::channel(true);
        let a = Admission::new(Some(rx));
        drop(a.admit().expect("registered"));
        up.send_replace(false);
        assert!(a.is_draining());
        assert!(a.admit().is_err());
        up.send_replace(true);
        assert!(!a.is_draining());
        assert!(a.admit().is_ok());
    }
}
