//! The engine thread's loop: admitting waiting sequences into the running batch (a
//! prompt's choices together), one step of every running sequence, and what each sampled
//! token does (stream it, finish the sequence, fork a prompt's other choices).

use super::{Command, EngineConfig, EngineEvent, EngineStats, Follower, Sampled, Seq};
use crate::batch::ForwardBatch;
use crate::constraint::Constrained;
use crate::served::{Pools, ServedModel};
use crate::Error;
use parking_lot::Mutex;
use std::collections::VecDeque;
use std::sync::mpsc;
use std::sync::Arc;
use tandem_core::{FinishReason, SamplingParams, TokenLogprobs};
use tokio::sync::mpsc::unbounded_channel;

pub(super) struct Worker<M: ServedModel> {
    pub(super) model: M,
    /// Prefix caching for models with per-request state: whole exported states.
    pub(super) snapshots: super::snapshots::Snapshots,
    /// The model's handoff check (snapshots are imported through it).
    pub(super) spec: Arc<dyn crate::served::HandoffSpec>,
    /// Logits rows a step may score prompt tokens on (`ServedInfo::score_rows`).
    pub(super) score_rows: usize,
    pub(super) sampled: Vec<u32>,
    pub(super) logprobs: Vec<Option<TokenLogprobs>>,
    pub(super) config: EngineConfig,
    pub(super) rx: mpsc::Receiver<Command>,
    pub(super) pools: Pools,
    pub(super) stats: Arc<Mutex<EngineStats>>,
    pub(super) waiting: VecDeque<Box<Seq>>,
    pub(super) running: Vec<Seq>,
}

impl<M: ServedModel> Worker<M> {
    pub(super) fn run(&mut self) {
        loop {
            // Block only when there is nothing to compute.
            let idle = self.running.is_empty() && self.waiting.is_empty();
            let first = if idle {
                match self.rx.recv() {
                    Ok(c) => Some(c),
                    Err(_) => return,
                }
            } else {
                None
            };
            for cmd in first
                .into_iter()
                .chain(std::iter::from_fn(|| self.rx.try_recv().ok()))
            {
                match cmd {
                    Command::Submit(seq) => self.waiting.push_back(seq),
                    Command::Refresh(dir, reply) => {
                        let result = self.model.refresh(&dir);
                        if let Some((blocks, _)) = &self.pools.kv {
                            // Cached K/V was computed with the old weights.
                            blocks.forget_cached();
                        }
                        self.snapshots.clear();
                        match &result {
                            Ok(()) => {
                                tracing::info!(dir = %dir.display(), "weights refreshed in place")
                            }
                            Err(e) => {
                                tracing::warn!(dir = %dir.display(), error = %e, "weight refresh failed")
                            }
                        }
                        let _ = reply.send(result);
                    }
                    Command::Shutdown => return,
                }
            }
            self.admit();
            self.step();
            let mut s = self.stats.lock();
            s.waiting = self.waiting.len();
            s.running = self.running.len();
        }
    }

    /// Gives back what a sequence holds (the model's bindings, then the reservation), and
    /// takes it off the running count before its caller hears of it, so a drained engine
    /// reads as drained.
    fn release(&mut self, seq: &mut Seq, counted: bool) {
        if let Some(r) = seq.reservation.take() {
            // Its written blocks stay cached for prompts that start alike.
            self.pools
                .remember(&r, &seq.tokens[..seq.cached.min(seq.tokens.len())]);
            self.model.end(&r);
        }
        if counted {
            let mut s = self.stats.lock();
            s.running = s.running.saturating_sub(1);
        }
    }

    fn admit(&mut self) {
        self.waiting.retain(|s| !s.abandoned());
        // Rows a step may sample: a prompt still computing counts its choices waiting to fork.
        let mut rows: usize = self.running.iter().map(|s| 1 + s.followers.len()).sum();
        while let Some(mut seq) = self.waiting.pop_front() {
            // A prompt's choices all run: admit them together.
            let width = 1 + seq.followers.len();
            if !self.running.is_empty() && rows + width > self.config.max_running {
                self.waiting.push_front(seq);
                break;
            }
            if seq.reservation.is_none() {
                // A generation's choices each decode on their own; a prefill samples them all
                // from its one row of logits.
                let sharing = if seq.prefill_only { 1 } else { width };
                // A cached prefix is not computed, so it cannot be scored.
                let prefix = if seq.params.prompt_logprobs.is_some() {
                    Vec::new()
                } else {
                    self.pools.prompt_hashes(&seq.tokens[..seq.prompt_len])
                };
                match self.pools.reserve_prompt(
                    seq.wanted(),
                    seq.prompt_len,
                    sharing,
                    None,
                    &prefix,
                ) {
                    Ok(rs) => {
                        let mut rs = rs.into_iter();
                        seq.reservation = rs.next();
                        let hit = seq.reservation.as_ref().map_or(0, |r| r.cached_tokens());
                        seq.cached = hit;
                        if !prefix.is_empty() {
                            let mut s = self.stats.lock();
                            s.prefix_queried_tokens += seq.prompt_len as u64;
                            s.prefix_hit_tokens += hit as u64;
                        }
                        for (f, r) in seq.followers.iter_mut().zip(rs) {
                            f.reservation = Some(r);
                        }
                    }
                    Err(_) => {
                        // Checked at submission to fit empty pools: wait for space.
                        self.waiting.push_front(seq);
                        break;
                    }
                }
            }
            let begun = match seq.reservation.as_mut() {
                Some(r) => self.model.begin(r),
                None => Ok(()),
            };
            let imported = begun.and_then(|()| match (seq.import.take(), &seq.reservation) {
                (Some(h), Some(r)) => self.model.import(r, seq.prompt_len, &h).map(|()| {
                    seq.cached = seq.prompt_len;
                }),
                _ => Ok(()),
            });
            let imported = imported.and_then(|()| self.resume_from_snapshot(&mut seq));
            if let Err(e) = imported {
                tracing::warn!(error = %e, "a request could not start");
                self.release(&mut seq, false);
                seq.fail(e);
                continue;
            }
            rows += width;
            if seq.cached == seq.prompt_len {
                // A decode: its choices start now, each from the token sampled for it.
                let followers = std::mem::take(&mut seq.followers);
                for f in followers {
                    let first = f.first_token;
                    if let Some(child) = self.fork(&seq, f) {
                        self.start_decode(child, first);
                    }
                }
                self.start_decode(*seq, None);
            } else {
                self.running.push(*seq);
            }
        }
    }

    /// A fresh sequence of a model with per-request state whose prompt begins with a kept
    /// state's tokens starts from that state (imported into its begun reservation).
    fn resume_from_snapshot(&mut self, seq: &mut Seq) -> crate::Result<()> {
        let eligible = seq.cached == 0 && seq.params.prompt_logprobs.is_none();
        let Some(r) = seq.reservation.as_ref().filter(|_| eligible) else {
            return Ok(());
        };
        if !self.keeps_snapshots() {
            return Ok(());
        }
        let hit = match self.snapshots.longest(&seq.tokens[..seq.prompt_len]) {
            Some((n, h)) => {
                let h = self.spec.prepare(h.clone(), n, r)?;
                self.model.import(r, n, &h)?;
                n
            }
            None => 0,
        };
        seq.cached = hit;
        let mut s = self.stats.lock();
        s.prefix_queried_tokens += seq.prompt_len as u64;
        s.prefix_hit_tokens += hit as u64;
        Ok(())
    }

    /// Keeps the state of `seq`'s written tokens for later prompts that begin with them
    /// (models with per-request state; a finished generation, before its space is freed).
    fn keep_snapshot(&mut self, seq: &Seq) {
        let Some(r) = &seq.reservation else { return };
        match self.model.export(r, seq.cached) {
            Ok(h) => self.snapshots.insert(&seq.tokens[..seq.cached], h),
            Err(e) => tracing::warn!(error = %e, "keeping a finished request's state failed"),
        }
        self.stats.lock().prefix_snapshot_bytes = self.snapshots.bytes();
    }

    fn keeps_snapshots(&self) -> bool {
        self.snapshots.budget() > 0
    }

    /// Follower `f` of `leader` (whose prompt is computed) as a sequence of its own, its
    /// cache forked from the leader's; `None` when it is gone or the fork failed (it heard).
    fn fork(&mut self, leader: &Seq, mut f: Follower) -> Option<Seq> {
        let (Some(mut reservation), Some(from)) = (f.reservation.take(), &leader.reservation)
        else {
            let _ = f.tx.send(EngineEvent::Failed(Error::InvalidRequest(
                "a choice holds no space".into(),
            )));
            return None;
        };
        if f.tx.is_closed() {
            return None;
        }
        let forked = self
            .model
            .begin(&mut reservation)
            .and_then(|()| self.model.fork(from, &reservation, leader.prompt_len));
        if let Err(e) = forked {
            tracing::warn!(error = %e, "a choice could not fork from its prompt");
            self.model.end(&reservation);
            let _ = f.tx.send(EngineEvent::Failed(e));
            return None;
        }
        Some(leader.forked(f, reservation))
    }

    /// Starts decoding `seq` (its prompt imported), whose first token is the last of its
    /// tokens or `first`; one that the token already ends is answered with it and let go.
    fn start_decode(&mut self, mut seq: Seq, first: Option<u32>) {
        seq.tokens.extend(first);
        let token = *seq.tokens.last().expect("a decode holds its first token");
        if let Some(finish) = seq.finish_reason(token) {
            self.release(&mut seq, false);
            let _ = seq.tx.send(EngineEvent::Token {
                token_id: token,
                finish: Some(finish),
                logprobs: None,
            });
            return;
        }
        self.running.push(seq);
    }

    fn step(&mut self) {
        let mut k = 0;
        while k < self.running.len() {
            if self.running[k].abandoned() {
                let mut seq = self.running.swap_remove(k);
                self.release(&mut seq, true);
            } else {
                k += 1;
            }
        }
        if self.running.is_empty() {
            return;
        }
        let bs = self.pools.block_size();
        let mut batch = ForwardBatch::default();
        let mut budget = self.config.max_batch_tokens;
        let mut in_batch = Vec::new();
        // Decodes first: one token each.
        for (i, seq) in self.running.iter().enumerate() {
            if seq.cached + 1 == seq.tokens.len() && seq.cached >= seq.prompt_len {
                if let Some(r) = &seq.reservation {
                    r.push_to(&mut batch, &seq.tokens[seq.cached..], seq.cached, bs, true);
                    in_batch.push((i, 1));
                    budget = budget.saturating_sub(1);
                }
            }
        }
        // Then prompt chunks. The budget left is shared: prompts in order of what they have
        // left, each taking at most an equal share of what remains, so a short prompt queued
        // behind a long one finishes in a step while the long one still progresses every
        // step (it gets at least budget / prompts), and what a short one leaves flows on to
        // the longer ones. At least one token per step, so a prefill is never starved.
        let mut prompts: Vec<usize> = (0..self.running.len())
            .filter(|&i| self.running[i].cached < self.running[i].prompt_len)
            .collect();
        prompts.sort_by_key(|&i| self.running[i].tokens.len() - self.running[i].cached);
        let mut left = prompts.len();
        // Prompt log-probabilities: (sequence, row, the prompt token it scores, alternatives),
        // on logits rows after the sampled ones.
        let mut scores: Vec<(usize, usize, u32, u32)> = Vec::new();
        for i in prompts {
            let seq = &self.running[i];
            if budget == 0 && !in_batch.is_empty() {
                break;
            }
            let remaining = seq.tokens.len() - seq.cached;
            let mut n = remaining.min((budget / left).max(1));
            left -= 1;
            let Some(r) = &seq.reservation else { continue };
            if let Some(top) = seq.params.prompt_logprobs {
                // Each row but the prompt's last (which samples) scores the next token; a
                // chunk takes no more of them than the step has left.
                let scoring = (seq.prompt_len - 1).saturating_sub(seq.cached);
                let free = self.score_rows - scores.len();
                if n.min(scoring) > free {
                    n = free;
                }
                if n == 0 {
                    continue;
                }
                let start = batch.num_tokens();
                for p in seq.cached..(seq.cached + n).min(seq.prompt_len - 1) {
                    scores.push((i, start + p - seq.cached, seq.tokens[p + 1], top));
                }
            }
            let done = seq.cached + n == seq.tokens.len();
            r.push_to(
                &mut batch,
                &seq.tokens[seq.cached..seq.cached + n],
                seq.cached,
                bs,
                done,
            );
            if done {
                // Every choice samples from the prompt's last row.
                let last = batch.num_tokens() - 1;
                let copies = seq.followers.len();
                batch.logits_rows.extend(std::iter::repeat_n(last, copies));
            }
            in_batch.push((i, n));
            budget = budget.saturating_sub(n);
        }
        if batch.num_tokens() == 0 {
            return;
        }
        batch
            .logits_rows
            .extend(scores.iter().map(|&(_, row, _, _)| row));
        // Structured outputs: the masks of the rows about to sample, computed on a second
        // thread while the forward pass runs (they need only the tokens so far).
        let stepped = if self.running.iter().all(|seq| seq.constraint.is_none()) {
            self.model.step(&batch)
        } else {
            let mut samples = vec![false; self.running.len()];
            for &(i, n) in &in_batch {
                samples[i] = self.running[i].cached + n == self.running[i].tokens.len();
            }
            let masks: Vec<(&mut Constrained, &mut Option<Error>)> = self
                .running
                .iter_mut()
                .zip(&samples)
                .filter(|(_, &sampling)| sampling)
                .flat_map(|(seq, _)| {
                    let Seq {
                        constraint,
                        failure,
                        followers,
                        ..
                    } = seq;
                    let followers = followers
                        .iter_mut()
                        .map(|f| (&mut f.constraint, &mut f.failure));
                    std::iter::once((constraint, failure)).chain(followers)
                })
                .filter_map(|(constraint, failure)| constraint.as_deref_mut().map(|c| (c, failure)))
                .collect();
            std::thread::scope(|s| {
                let computing = s.spawn(move || {
                    for (c, failure) in masks {
                        if let Err(e) = c.compute_mask() {
                            *failure = Some(e);
                        }
                    }
                });
                let stepped = self.model.step(&batch);
                if computing.join().is_err() {
                    tracing::error!("computing grammar masks panicked");
                }
                stepped
            })
        };
        if let Err(e) = stepped {
            // A failed rank (or metadata that does not fit, which the limits rule out) fails
            // every request in flight rather than leaving them waiting.
            return self.fail_all(&e);
        }
        // Sample: one row per sequence whose prompt is complete, in batch order, and one
        // more for each choice following it.
        let sampling: Vec<_> = in_batch
            .iter()
            .map(|&(i, n)| (&self.running[i], n))
            .filter(|(seq, n)| seq.cached + n == seq.tokens.len())
            .flat_map(|(seq, _)| {
                let followers = seq
                    .followers
                    .iter()
                    .map(move |f| seq.sample_row(&f.params, &f.stop_ids, &f.constraint));
                std::iter::once(seq.sample_row(&seq.params, &seq.stop_ids, &seq.constraint))
                    .chain(followers)
            })
            .collect();
        self.model
            .sample(&sampling, &mut self.sampled, &mut self.logprobs);
        drop(sampling);
        if !scores.is_empty() {
            let first = batch.logits_rows.len() - scores.len();
            let targets: Vec<(u32, u32)> = scores.iter().map(|&(_, _, t, top)| (t, top)).collect();
            match self.model.score(first, &targets) {
                Ok(scored) => {
                    for (&(i, ..), lp) in scores.iter().zip(scored) {
                        self.running[i].scored.push(lp);
                    }
                }
                Err(e) => return self.fail_all(&e),
            }
        }
        let sampled = std::mem::take(&mut self.sampled);
        let mut logprobs = std::mem::take(&mut self.logprobs);
        let mut rows = sampled
            .iter()
            .copied()
            .zip(logprobs.drain(..).chain(std::iter::repeat(None)));
        let mut finished = Vec::new();
        let mut generated = 0u64;
        // Counted before anyone hears of the step, so a caller that reads the stats after
        // its event sees its prompt counted.
        let prefilled: u64 = in_batch
            .iter()
            .filter(|&&(i, _)| self.running[i].cached < self.running[i].prompt_len)
            .map(|&(_, n)| n as u64)
            .sum();
        self.stats.lock().prefill_tokens += prefilled;
        for (i, n) in in_batch {
            let was_prompt = self.running[i].cached < self.running[i].prompt_len;
            self.running[i].cached += n;
            if was_prompt {
                let seq = &self.running[i];
                if seq.cached >= seq.prompt_len {
                    // The whole prompt is written: later prompts may share it already.
                    if let Some(r) = &seq.reservation {
                        self.pools.remember(r, &seq.tokens[..seq.prompt_len]);
                    }
                }
            }
            if self.running[i].cached < self.running[i].tokens.len() {
                continue; // more prompt chunks to go
            }
            let Some((token, token_logprobs)) = rows.next() else {
                break;
            };
            generated += 1;
            // The prompt's other choices sampled from the same row.
            let followers = std::mem::take(&mut self.running[i].followers);
            let theirs: Vec<_> = rows.by_ref().take(followers.len()).collect();
            generated += theirs.len() as u64;
            let mut others = Vec::new();
            for (f, (token, logprobs)) in followers.into_iter().zip(theirs) {
                if self.running[i].prefill_only {
                    // The prefill answers for every choice; their decodes fork elsewhere.
                    let mut f = f;
                    let finish = f.first_finish(token);
                    if let Some(e) = f.failure.take() {
                        self.running[i].failure.get_or_insert(e);
                    }
                    others.push(Sampled {
                        token,
                        finish,
                        logprobs,
                    });
                } else {
                    let leader = std::mem::replace(&mut self.running[i], placeholder());
                    let child = self.fork(&leader, f);
                    self.running[i] = leader;
                    if let Some(child) = child {
                        self.running.push(child);
                        let j = self.running.len() - 1;
                        self.on_sampled(j, token, logprobs, Vec::new(), &mut finished);
                    }
                }
            }
            self.on_sampled(i, token, token_logprobs, others, &mut finished);
        }
        drop(rows);
        self.sampled = sampled;
        self.logprobs = logprobs;
        finished.sort_unstable();
        finished.dedup();
        for i in finished.into_iter().rev() {
            self.running.swap_remove(i);
        }
        let mut s = self.stats.lock();
        s.steps += 1;
        s.generated_tokens += generated;
    }
}

impl<M: ServedModel> Worker<M> {
    /// A step failed (`e`): every request in flight fails rather than waiting.
    fn fail_all(&mut self, e: &Error) {
        tracing::error!(error = %e, "engine step failed; failing the requests in flight");
        let mut failed: Vec<Seq> = self.running.drain(..).collect();
        failed.extend(self.waiting.drain(..).map(|b| *b));
        for seq in &mut failed {
            self.release(seq, false);
            seq.fail(Error::Collective(format!("the engine step failed: {e}")));
        }
        let mut s = self.stats.lock();
        s.running = 0;
        s.waiting = 0;
    }

    /// Running sequence `i` sampled `token`: it takes it, and its caller hears of it (a
    /// prefill's with the prompt's state and its other choices' first tokens, `others`); one
    /// that ends is let go and listed in `finished`.
    fn on_sampled(
        &mut self,
        i: usize,
        token: u32,
        token_logprobs: Option<TokenLogprobs>,
        others: Vec<Sampled>,
        finished: &mut Vec<usize>,
    ) {
        let seq = &mut self.running[i];
        seq.tokens.push(token);
        if let Some(c) = &mut seq.constraint {
            if seq.failure.is_none() && !seq.stop_ids.contains(&token) {
                seq.failure = c.consume(&[token]).err();
            }
        }
        if let Some(e) = seq.failure.take() {
            tracing::warn!(error = %e, "a constrained request cannot go on");
            let mut seq = std::mem::replace(&mut self.running[i], placeholder());
            finished.push(i);
            self.release(&mut seq, true);
            let _ = seq.tx.send(EngineEvent::Failed(e));
            return;
        }
        let finish = seq.finish_reason(token);
        if seq.prefill_only {
            let prompt_len = seq.prompt_len;
            let exported = match &seq.reservation {
                Some(r) => self.model.export(r, prompt_len),
                None => Err(Error::InvalidRequest("a prefill holds no space".into())),
            };
            if let (Ok(h), true) = (&exported, self.keeps_snapshots()) {
                let seq = &self.running[i];
                self.snapshots.insert(&seq.tokens[..prompt_len], h.clone());
                self.stats.lock().prefix_snapshot_bytes = self.snapshots.bytes();
            }
            let mut seq = std::mem::replace(&mut self.running[i], placeholder());
            finished.push(i);
            // Free the space before the caller hears of it, so accounting is exact.
            self.release(&mut seq, true);
            let event = match exported {
                Ok(handoff) => EngineEvent::Prefilled {
                    first_token: token,
                    finish,
                    logprobs: token_logprobs,
                    handoff,
                    others,
                    prompt_logprobs: std::mem::take(&mut seq.scored),
                },
                Err(e) => {
                    tracing::error!(error = %e, "exporting a prompt's state failed");
                    EngineEvent::Failed(e)
                }
            };
            let _ = seq.tx.send(event);
            return;
        }
        if !seq.scored.is_empty() {
            let scored = std::mem::take(&mut seq.scored);
            let _ = seq.tx.send(EngineEvent::PromptLogprobs(scored));
        }
        let event = EngineEvent::Token {
            token_id: token,
            finish,
            logprobs: token_logprobs,
        };
        if finish.is_some() {
            let mut seq = std::mem::replace(&mut self.running[i], placeholder());
            finished.push(i);
            if self.keeps_snapshots() {
                self.keep_snapshot(&seq);
            }
            self.release(&mut seq, true);
            let _ = seq.tx.send(event);
        } else if self.running[i].tx.send(event).is_err() {
            let mut seq = std::mem::replace(&mut self.running[i], placeholder());
            finished.push(i);
            self.release(&mut seq, true);
        }
    }
}

impl Follower {
    /// Whether `token`, sampled as this choice's first, ends it
    /// (a grammar that cannot take it is recorded as the failure).
    fn first_finish(&mut self, token: u32) -> Option<FinishReason> {
        let stop_ids = &self.stop_ids;
        if let Some(c) = &mut self.constraint {
            if !stop_ids.contains(&token) {
                self.failure = c.consume(&[token]).err();
            }
        }
        let complete = self.constraint.as_ref().is_some_and(|c| c.is_complete());
        if stop_ids.contains(&token) || complete {
            Some(FinishReason::Stop)
        } else if self.params.max_tokens <= 1 {
            Some(FinishReason::Length)
        } else {
            None
        }
    }
}

/// What a finished sequence's place in the running list holds until the list is compacted
/// at the end of the step.
fn placeholder() -> Seq {
    let (tx, _) = unbounded_channel();
    Seq::new(
        Vec::new(),
        0,
        SamplingParams::greedy(1),
        Vec::new(),
        false,
        tx,
    )
}
