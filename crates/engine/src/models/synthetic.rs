//! A model that computes nothing: each step takes a set time and every token is a pure
//! function of the sequence's position and its previous token. It serves the control plane's
//! load tests and benchmarks (`tandem worker --engine synthetic`): the router, the workers'
//! RPCs, the KV handoff, admission and draining all run for real, at any request rate, with
//! no model compute; a P/D pair gives exactly what an aggregated worker gives.

use crate::batch::ForwardBatch;
use crate::handoff::{Handoff, Segment, SegmentKind};
use crate::kv_pool::BlockAllocator;
use crate::sampling::SampleRow;
use crate::served::{HandoffSpec, Pools, Reservation, ServedInfo, ServedModel};
use crate::tensor::{DType, HostTensor};
use crate::{EngineConfig, Error, Result};
use std::sync::Arc;
use std::time::Duration;
use tandem_core::TokenLogprobs;

/// What a synthetic model answers like.
#[derive(Clone, Debug)]
pub struct SyntheticSpec {
    /// Vocabulary size (token ids are below it).
    pub vocab_size: usize,
    /// Longest prompt + generation.
    pub max_context: usize,
    /// Tokens never produced (so generation runs to `max_tokens`), and what a request may
    /// list to stop on.
    pub eos_ids: Vec<u32>,
    /// Time one step takes (the rate tokens come at, per running sequence).
    pub step_time: Duration,
}

/// The synthetic [`ServedModel`].
pub struct SyntheticServed {
    spec: SyntheticSpec,
    layout: tandem_topology::Layout,
    pools: Pools,
    /// The step's sampled rows: (position of the next token, the token before it).
    rows: Vec<(u32, u32)>,
}

/// The token after `prev` at `position`: deterministic, never an EOS id.
pub fn synthetic_token(spec: &SyntheticSpec, position: u32, prev: u32) -> u32 {
    let vocab = spec.vocab_size.max(2) as u64;
    let mut t = (u64::from(prev).wrapping_mul(2_654_435_761)
        ^ u64::from(position).wrapping_mul(40_503))
        % vocab;
    while spec.eos_ids.contains(&(t as u32)) {
        t = (t + 1) % vocab;
    }
    t as u32
}

impl SyntheticServed {
    /// A synthetic model with `config.num_blocks` paged blocks of `config.block_size`.
    pub fn new(spec: SyntheticSpec, config: &EngineConfig) -> Result<Self> {
        Ok(Self {
            spec,
            layout: tandem_topology::Layout::new(1, 1, 1)
                .map_err(|e| Error::InvalidRequest(format!("layout tp1: {e}")))?,
            pools: Pools {
                kv: Some((BlockAllocator::new(config.num_blocks), config.block_size)),
                ..Pools::default()
            },
            rows: Vec::new(),
        })
    }

    /// Starts the engine for it.
    pub fn start(spec: SyntheticSpec, config: EngineConfig) -> Result<crate::Engine> {
        let c = config.clone();
        crate::Engine::start_served(move || Self::new(spec, &c), config)
    }
}

/// The handoff: the prompt's token ids, one u32 segment.
fn segments(tokens: usize) -> Vec<Segment> {
    vec![Segment {
        kind: SegmentKind::KvLayer,
        layer: 0,
        shard: 0,
        dtype: DType::U32,
        shape: vec![tokens as u32],
    }]
}

struct SyntheticHandoff;

impl HandoffSpec for SyntheticHandoff {
    fn prepare(&self, h: Handoff, tokens: usize, _: &Reservation) -> Result<Handoff> {
        if h.segments != segments(tokens) {
            return Err(Error::InvalidRequest(format!(
                "a synthetic worker takes the prompt's ids as its handoff, got {} segments",
                h.segments.len()
            )));
        }
        h.check_sizes()?;
        Ok(h)
    }
}

impl ServedModel for SyntheticServed {
    fn info(&self) -> ServedInfo {
        ServedInfo {
            family: "synthetic",
            vocab_size: self.spec.vocab_size,
            eos_ids: self.spec.eos_ids.clone(),
            max_context: self.spec.max_context,
            num_layers: 1,
            weight_bytes: 0,
            layout: self.layout,
            kv: None,
            state_handoff: None,
            score_rows: 0,
        }
    }

    fn pools(&self) -> Pools {
        self.pools.clone()
    }

    fn handoff_spec(&self) -> Arc<dyn HandoffSpec> {
        Arc::new(SyntheticHandoff)
    }

    fn step(&mut self, batch: &ForwardBatch) -> Result<()> {
        if !self.spec.step_time.is_zero() {
            // Stands for the forward pass this engine does not compute.
            std::thread::sleep(self.spec.step_time);
        }
        self.rows.clear();
        for &r in &batch.logits_rows {
            self.rows.push((batch.positions[r] + 1, batch.token_ids[r]));
        }
        Ok(())
    }

    fn sample(
        &mut self,
        rows: &[SampleRow<'_>],
        out: &mut Vec<u32>,
        logprobs: &mut Vec<Option<TokenLogprobs>>,
    ) {
        out.clear();
        logprobs.clear();
        for (r, &(position, prev)) in rows.iter().zip(&self.rows) {
            let t = synthetic_token(&self.spec, position, prev);
            out.push(t);
            logprobs.push(r.params.logprobs.map(|_| TokenLogprobs {
                logprob: 0.0,
                top: vec![(t, 0.0)],
            }));
        }
    }

    fn export(&mut self, _: &Reservation, prompt_len: usize) -> Result<Handoff> {
        // What travels is only the shape: the decode side needs no state to continue.
        let mut h = Handoff::default();
        h.push(
            SegmentKind::KvLayer,
            0,
            0,
            &HostTensor::from_u32(vec![0; prompt_len]),
        );
        Ok(h)
    }

    fn import(&mut self, _: &Reservation, _: usize, _: &Handoff) -> Result<()> {
        Ok(())
    }

    fn refresh(&mut self, _: &std::path::Path) -> Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{blocking_tokens, EngineEvent, SeqKind};
    use tandem_core::SamplingParams;

    fn spec() -> SyntheticSpec {
        SyntheticSpec {
            vocab_size: 1000,
            max_context: 4096,
            eos_ids: vec![2],
            step_time: Duration::ZERO,
        }
    }

    #[test]
    fn pd_through_two_synthetic_engines_equals_one() {
        let config = EngineConfig {
            num_blocks: 64,
            ..EngineConfig::default()
        };
        let p = SyntheticServed::start(spec(), config.clone()).expect("start");
        let d = SyntheticServed::start(spec(), config).expect("start");
        let prompt: Vec<u32> = (0..37).map(|i| 10 + i).collect();
        let params = SamplingParams::greedy(9);
        let alone = blocking_tokens(
            p.submit(prompt.clone(), params.clone(), SeqKind::Generate)
                .expect("generate"),
        );
        assert_eq!(alone.len(), 9, "runs to max_tokens: no EOS is produced");
        let mut rx = p
            .submit(prompt.clone(), params.clone(), SeqKind::Prefill)
            .expect("prefill");
        let Some(EngineEvent::Prefilled {
            first_token,
            handoff,
            ..
        }) = rx.blocking_recv()
        else {
            panic!("no prefill event");
        };
        let reservation = d.reserve(prompt.len() + 9).expect("reserve");
        let rest = blocking_tokens(
            d.submit(
                prompt.clone(),
                params,
                SeqKind::Decode {
                    reservation,
                    handoff,
                    first_token,
                    forks: Vec::new(),
                },
            )
            .expect("decode"),
        );
        let mut got = vec![first_token];
        got.extend(rest);
        assert_eq!(got, alone);
        assert_eq!(got[0], synthetic_token(&spec(), 37, 46));
        for e in [&p, &d] {
            assert_eq!(e.pools().paged_blocks(), (64, 64), "blocks back");
        }
    }
}
