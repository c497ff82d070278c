//! Stop strings matched on the text stream, across delta boundaries.
//!
//! Text that could be the beginning of a stop string is held back until the next delta decides
//! it: either the stop string completes (output ends just before it) or it cannot anymore (the
//! held text is released). Emitted text therefore never contains a stop string or any part of
//! one.

/// Outcome of [`StopMatcher::push`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Pushed {
    /// Text safe to emit now.
    pub text: String,
    /// A stop string matched; `text` ends right before it and nothing follows.
    pub stopped: bool,
}

/// Matches a request's stop strings against its text deltas.
#[derive(Clone, Debug, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
    stopped: bool,
    /// The stop string that matched.
    matched: Option<String>,
}

impl StopMatcher {
    /// A matcher for `stops`; empty strings are ignored.
    pub fn new(stops: Vec<String>) -> Self {
        Self {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            held: String::new(),
            stopped: false,
            matched: None,
        }
    }

    /// Whether a stop string matched.
    pub fn is_stopped(&self) -> bool {
        self.stopped
    }

    /// The stop string that ended the text, once one has.
    pub fn matched(&self) -> Option<&str> {
        self.matched.as_deref()
    }

    /// Feeds the next delta.
    pub fn push(&mut self, delta: &str) -> Pushed {
        if self.stopped {
            return Pushed::default();
        }
        if self.stops.is_empty() {
            return Pushed {
                text: delta.to_owned(),
                stopped: false,
            };
        }
        self.held.push_str(delta);
        let earliest = self
            .stops
            .iter()
            .filter_map(|stop| self.held.find(stop.as_str()).map(|at| (at, stop)))
            .min_by_key(|&(at, _)| at);
        if let Some((at, stop)) = earliest {
            self.matched = Some(stop.clone());
            self.held.truncate(at);
            self.stopped = true;
            return Pushed {
                text: std::mem::take(&mut self.held),
                stopped: true,
            };
        }
        let keep = self.partial_match_len();
        let text = self.held[..self.held.len() - keep].to_owned();
        self.held.drain(..self.held.len() - keep);
        Pushed {
            text,
            stopped: false,
        }
    }

    /// The stream ended without a match: releases the held-back text.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// Length of the longest suffix of `held` that is a proper prefix of some stop string.
    fn partial_match_len(&self) -> usize {
        self.stops
            .iter()
            .filter_map(|stop| {
                (1..stop.len())
                    .rev()
                    .filter(|&len| stop.is_char_boundary(len))
                    .find(|&len| self.held.ends_with(&stop[..len]))
            })
            .max()
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], deltas: &[&str]) -> (Vec<String>, bool) {
        let mut matcher = StopMatcher::new(stops.iter().map(|s| (*s).to_owned()).collect());
        let mut out = Vec::new();
        for delta in deltas {
            let pushed = matcher.push(delta);
            out.push(pushed.text);
            if pushed.stopped {
                return (out, true);
            }
        }
        out.push(matcher.finish());
        (out, false)
    }

    #[test]
    fn match_inside_one_delta_truncates() {
        let (out, stopped) = run(&["END"], &["abc", "deENDfg"]);
        assert!(stopped);
        assert_eq!(out.concat(), "abcde");
    }

    #[test]
    fn match_across_deltas_is_held_back_then_cut() {
        let (out, stopped) = run(&["STOP"], &["hello S", "T", "OP world"]);
        assert!(stopped);
        assert_eq!(out, vec!["hello ", "", ""]);
    }

    #[test]
    fn false_start_is_released() {
        let (out, stopped) = run(&["STOP"], &["a ST", "ONE"]);
        assert!(!stopped);
        assert_eq!(out, vec!["a ", "STONE", ""]);
        let (out, stopped) = run(&["STOP"], &["tail ST"]);
        assert!(!stopped);
        assert_eq!(out.concat(), "tail ST");
    }

    #[test]
    fn earliest_of_several_stops_wins() {
        let (out, stopped) = run(&["world", "lo"], &["hello world"]);
        assert!(stopped);
        assert_eq!(out.concat(), "hel");
    }

    #[test]
    fn multibyte_stops_split_on_char_boundaries() {
        let (out, stopped) = run(&["é!"], &["caf", "é", "!"]);
        assert!(stopped);
        assert_eq!(out.concat(), "caf");
    }

    #[test]
    fn no_stops_pass_through() {
        let (out, stopped) = run(&[], &["a", "b"]);
        assert!(!stopped);
        assert_eq!(out, vec!["a", "b", ""]);
    }
}
