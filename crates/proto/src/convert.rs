//! The wire types that have a twin in `tandem_core`, converted in one place: sampling
//! parameters (with their output constraint and logit bias), a token's log-probabilities and
//! a finish reason. The router writes requests with these and reads token events back; the
//! worker does the opposite, so both sides agree by construction.

use crate::v1 as pb;
use tandem_core::{FinishReason, OutputConstraint, SamplingParams, TokenLogprobs};

impl From<&SamplingParams> for pb::SamplingParams {
    fn from(s: &SamplingParams) -> Self {
        Self {
            temperature: s.temperature,
            top_k: s.top_k,
            top_p: s.top_p,
            seed: s.seed,
            max_tokens: s.max_tokens,
            stop_token_ids: s.stop_token_ids.clone(),
            ignore_eos: s.ignore_eos,
            presence_penalty: s.presence_penalty,
            frequency_penalty: s.frequency_penalty,
            repetition_penalty: s.repetition_penalty,
            min_p: s.min_p,
            min_tokens: s.min_tokens,
            logprobs: s.logprobs,
            prompt_logprobs: s.prompt_logprobs,
            resumed: s.resumed,
            constraint: s.constraint.as_ref().map(pb::OutputConstraint::from),
            logit_bias: s
                .logit_bias
                .iter()
                .map(|&(token_id, bias)| pb::LogitBias { token_id, bias })
                .collect(),
        }
    }
}

/// Fields a sender left at protobuf's zero where zero means nothing sensible take their
/// neutral value: `top_p` 1 (no cut) and `repetition_penalty` 1 (none).
impl From<pb::SamplingParams> for SamplingParams {
    fn from(p: pb::SamplingParams) -> Self {
        Self {
            temperature: p.temperature,
            top_k: p.top_k,
            top_p: if p.top_p <= 0.0 { 1.0 } else { p.top_p },
            seed: p.seed,
            max_tokens: p.max_tokens,
            stop_token_ids: p.stop_token_ids,
            ignore_eos: p.ignore_eos,
            presence_penalty: p.presence_penalty,
            frequency_penalty: p.frequency_penalty,
            repetition_penalty: if p.repetition_penalty <= 0.0 {
                1.0
            } else {
                p.repetition_penalty
            },
            min_p: p.min_p,
            min_tokens: p.min_tokens,
            logprobs: p.logprobs,
            prompt_logprobs: p.prompt_logprobs,
            resumed: p.resumed,
            // A constraint of a kind this side does not know is no constraint.
            constraint: p
                .constraint
                .and_then(|c| OutputConstraint::try_from(c).ok()),
            logit_bias: p
                .logit_bias
                .into_iter()
                .map(|b| (b.token_id, b.bias))
                .collect(),
        }
    }
}

impl From<&OutputConstraint> for pb::OutputConstraint {
    fn from(c: &OutputConstraint) -> Self {
        use pb::output_constraint::Kind;
        Self {
            kind: Some(match c {
                OutputConstraint::JsonObject => Kind::JsonObject(true),
                OutputConstraint::JsonSchema(schema) => Kind::JsonSchema(schema.clone()),
            }),
        }
    }
}

/// A constraint message without a kind (a newer sender's kind this build does not know).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UnknownConstraint;

impl TryFrom<pb::OutputConstraint> for OutputConstraint {
    type Error = UnknownConstraint;
    fn try_from(c: pb::OutputConstraint) -> Result<Self, UnknownConstraint> {
        use pb::output_constraint::Kind;
        match c.kind.ok_or(UnknownConstraint)? {
            Kind::JsonObject(_) => Ok(OutputConstraint::JsonObject),
            Kind::JsonSchema(schema) => Ok(OutputConstraint::JsonSchema(schema)),
        }
    }
}

impl From<TokenLogprobs> for pb::Logprobs {
    fn from(l: TokenLogprobs) -> Self {
        Self {
            logprob: l.logprob,
            top: l
                .top
                .into_iter()
                .map(|(token_id, logprob)| pb::TopLogprob { token_id, logprob })
                .collect(),
        }
    }
}

impl From<pb::Logprobs> for TokenLogprobs {
    fn from(l: pb::Logprobs) -> Self {
        Self {
            logprob: l.logprob,
            top: l.top.into_iter().map(|t| (t.token_id, t.logprob)).collect(),
        }
    }
}

/// A finish reason as the wire's enum value (`Unspecified` while the request goes on).
pub fn finish_to_wire(f: Option<FinishReason>) -> i32 {
    let wire = match f {
        None => pb::FinishReason::Unspecified,
        Some(FinishReason::Stop) => pb::FinishReason::Stop,
        Some(FinishReason::Length) => pb::FinishReason::Length,
    };
    wire as i32
}

/// The finish reason a wire enum value names (`None`: unspecified or unknown).
pub fn finish_from_wire(v: i32) -> Option<FinishReason> {
    match pb::FinishReason::try_from(v) {
        Ok(pb::FinishReason::Stop) => Some(FinishReason::Stop),
        Ok(pb::FinishReason::Length) => Some(FinishReason::Length),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every field set away from its default survives the trip router → wire → worker, and
    /// so do log-probabilities, constraints and finish reasons.
    #[test]
    fn core_types_round_trip_through_the_wire() {
        for constraint in [
            None,
            Some(OutputConstraint::JsonObject),
            Some(OutputConstraint::JsonSchema(r#"{"type":"integer"}"#.into())),
        ] {
            let s = SamplingParams {
                temperature: 0.7,
                top_k: 40,
                top_p: 0.9,
                seed: 1234,
                max_tokens: 77,
                stop_token_ids: vec![2, 7],
                ignore_eos: true,
                presence_penalty: 0.25,
                frequency_penalty: -0.5,
                repetition_penalty: 1.1,
                min_p: 0.05,
                min_tokens: 3,
                logit_bias: vec![(5, -100.0), (9, 2.5)],
                logprobs: Some(4),
                prompt_logprobs: Some(1),
                resumed: 6,
                constraint,
            };
            let back = SamplingParams::from(pb::SamplingParams::from(&s));
            assert_eq!(back, s);
        }
        let l = TokenLogprobs {
            logprob: -0.25,
            top: vec![(3, -0.25), (8, -1.5)],
        };
        assert_eq!(TokenLogprobs::from(pb::Logprobs::from(l.clone())), l);
        for f in [None, Some(FinishReason::Stop), Some(FinishReason::Length)] {
            assert_eq!(finish_from_wire(finish_to_wire(f)), f);
        }
    }

    /// What a sender leaves at zero reads as the neutral value, and an empty constraint as
    /// none.
    #[test]
    fn zeros_from_the_wire_read_as_neutral() {
        let wire = pb::SamplingParams {
            constraint: Some(pb::OutputConstraint { kind: None }),
            ..pb::SamplingParams::default()
        };
        let s = SamplingParams::from(wire);
        assert_eq!(s.top_p, 1.0);
        assert_eq!(s.repetition_penalty, 1.0);
        assert_eq!(s.constraint, None);
        assert_eq!(finish_from_wire(99), None);
    }
}
