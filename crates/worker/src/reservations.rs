//! Decode-side reservations waiting for their KV. The transport's receive loop looks a
//! message up here by reservation id; the epoch fences out stale senders.

use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tandem_core::{Epoch, ReservationId};
use tokio::sync::oneshot;

/// A reservation's epoch and where its KV message goes.
type Waiting = (Epoch, oneshot::Sender<Vec<u8>>);

/// Pending reservations of a decode worker.
#[derive(Debug, Default)]
pub struct Reservations {
    next: AtomicU64,
    pending: Mutex<HashMap<ReservationId, Waiting>>,
    rejected: AtomicU64,
}

/// A registered reservation; unregisters itself when dropped.
#[derive(Debug)]
pub struct Pending {
    owner: Arc<Reservations>,
    /// The reservation's id (the transfer tag).
    pub id: ReservationId,
    /// Its epoch.
    pub epoch: Epoch,
    /// Resolves with the raw handoff message.
    pub kv: oneshot::Receiver<Vec<u8>>,
}

impl Drop for Pending {
    fn drop(&mut self) {
        self.owner.pending.lock().remove(&self.id);
    }
}

impl Reservations {
    /// Registers a new reservation.
    pub fn register(self: &Arc<Self>) -> Pending {
        let n = self.next.fetch_add(1, Ordering::Relaxed) + 1;
        let id = ReservationId(n);
        // One epoch per reservation id here; a retried prefill gets a fresh reservation.
        let epoch = Epoch(n);
        let (tx, rx) = oneshot::channel();
        self.pending.lock().insert(id, (epoch, tx));
        Pending {
            owner: self.clone(),
            id,
            epoch,
            kv: rx,
        }
    }

    /// Hands a received message to its reservation. Returns false (and counts a rejection)
    /// when no reservation with that id and epoch is waiting.
    pub fn deliver(&self, id: ReservationId, epoch: Epoch, message: Vec<u8>) -> bool {
        let mut pending = self.pending.lock();
        let ok = match pending.get(&id) {
            Some((e, _)) if *e == epoch => pending
                .remove(&id)
                .is_some_and(|(_, tx)| tx.send(message).is_ok()),
            _ => false,
        };
        if !ok {
            self.rejected.fetch_add(1, Ordering::Relaxed);
        }
        ok
    }

    /// Reservations waiting for KV.
    pub fn len(&self) -> usize {
        self.pending.lock().len()
    }

    /// Whether none is waiting.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Messages rejected (unknown reservation or stale epoch).
    pub fn rejected(&self) -> u64 {
        self.rejected.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stale_epochs_and_unknown_ids_are_rejected() {
        let r = Arc::new(Reservations::default());
        let mut p = r.register();
        assert!(!r.deliver(p.id, Epoch(p.epoch.0 + 1), vec![1]));
        assert!(!r.deliver(ReservationId(999), p.epoch, vec![1]));
        assert_eq!(r.rejected(), 2);
        assert!(r.deliver(p.id, p.epoch, vec![7]));
        assert_eq!(p.kv.try_recv().expect("delivered"), vec![7]);
        assert!(!r.deliver(p.id, p.epoch, vec![8]), "delivered only once");
    }

    #[test]
    fn dropping_a_pending_reservation_unregisters_it() {
        let r = Arc::new(Reservations::default());
        let p = r.register();
        let id = p.id;
        assert_eq!(r.len(), 1);
        drop(p);
        assert!(r.is_empty());
        assert!(!r.deliver(id, Epoch(id.0), vec![]));
    }
}
