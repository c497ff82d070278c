//! Prefix caching for models with per-request state (KDA hybrids): a recurrent state cannot
//! be cut at any token, so what is kept is whole states — the exported state ([`Handoff`]) of a
//! request's first N tokens, taken when a prefill exports its prompt or a generation finishes.
//! A later prompt that starts with those N tokens (and has more) imports the longest such
//! state and computes only the rest: a conversation's next turn, on the worker that served the
//! last. Bounded in bytes, least recently used dropped first.

use crate::handoff::Handoff;

struct Snapshot {
    tokens: Vec<u32>,
    handoff: Handoff,
    bytes: usize,
    used: u64,
}

/// Exported states by the tokens they hold.
pub(super) struct Snapshots {
    entries: Vec<Snapshot>,
    bytes: usize,
    budget: usize,
    clock: u64,
}

impl Snapshots {
    /// A store of at most `budget` bytes of states.
    pub(super) fn new(budget: usize) -> Self {
        Self {
            entries: Vec::new(),
            bytes: 0,
            budget,
            clock: 0,
        }
    }

    /// Bytes held.
    pub(super) fn bytes(&self) -> usize {
        self.bytes
    }

    /// The most bytes held (0: states are not kept).
    pub(super) fn budget(&self) -> usize {
        self.budget
    }

    /// Keeps `handoff`, the state of `tokens`, replacing one of the same tokens and dropping
    /// the least recently used beyond the budget (a state larger than the budget is not kept).
    pub(super) fn insert(&mut self, tokens: &[u32], handoff: Handoff) {
        let bytes = handoff.body.len() + 4 * tokens.len();
        if bytes > self.budget || tokens.is_empty() {
            return;
        }
        self.entries.retain(|e| e.tokens != tokens);
        self.clock += 1;
        self.entries.push(Snapshot {
            tokens: tokens.to_vec(),
            handoff,
            bytes,
            used: self.clock,
        });
        self.bytes = self.entries.iter().map(|e| e.bytes).sum();
        while self.bytes > self.budget {
            let Some(oldest) = (0..self.entries.len()).min_by_key(|&i| self.entries[i].used) else {
                break;
            };
            self.bytes -= self.entries.swap_remove(oldest).bytes;
        }
    }

    /// The longest kept state whose tokens begin `prompt` and leave at least one of its
    /// tokens to compute: `(tokens it holds, the state)`.
    pub(super) fn longest(&mut self, prompt: &[u32]) -> Option<(usize, &Handoff)> {
        let best = (0..self.entries.len())
            .filter(|&i| {
                let t = &self.entries[i].tokens;
                t.len() < prompt.len() && prompt.starts_with(t)
            })
            .max_by_key(|&i| self.entries[i].tokens.len())?;
        self.clock += 1;
        let e = &mut self.entries[best];
        e.used = self.clock;
        Some((e.tokens.len(), &e.handoff))
    }

    /// Forgets every state (the weights changed).
    pub(super) fn clear(&mut self) {
        self.entries.clear();
        self.bytes = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(bytes: usize) -> Handoff {
        Handoff {
            segments: Vec::new(),
            body: vec![7u8; bytes].into(),
        }
    }

    #[test]
    fn the_longest_proper_prefix_wins_and_the_budget_drops_the_least_recently_used() {
        let mut s = Snapshots::new(300);
        s.insert(&[1, 2], state(100));
        s.insert(&[1, 2, 3, 4], state(100));
        assert_eq!(s.longest(&[1, 2, 3, 4, 5]).map(|x| x.0), Some(4));
        assert_eq!(
            s.longest(&[1, 2, 3, 4]).map(|x| x.0),
            Some(2),
            "one token must compute"
        );
        assert_eq!(s.longest(&[1, 3]).map(|x| x.0), None);
        // [1, 2] was used last: a third state drops [1, 2, 3, 4].
        s.insert(&[9, 9, 9], state(100));
        assert_eq!(s.longest(&[1, 2, 3, 4, 5]).map(|x| x.0), Some(2));
        assert!(s.bytes() <= 300);
        s.insert(&[5], state(1000));
        assert_eq!(
            s.longest(&[5, 6]).map(|x| x.0),
            None,
            "larger than the budget"
        );
        s.clear();
        assert_eq!((s.bytes(), s.longest(&[1, 2, 3]).map(|x| x.0)), (0, None));
    }
}
