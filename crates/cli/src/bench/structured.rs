//! `tandem bench structured`: what constrained decoding costs per token next to the decode
//! step it rides on, measured in one run. Requests are generated under JSON mode and under a
//! nested schema; their tokens are then replayed through fresh matchers to time the per-token
//! work alone (mask computation, applying it to a logits row, consuming the token), and the
//! same requests are decoded constrained and unconstrained at batch 1 and batch 16.

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use tandem_core::{OutputConstraint, SamplingParams};
use tandem_engine::constraint::Grammars;
use tandem_engine::sampling::{adjust_row, Adjustment, SampleRow};
use tandem_engine::{Engine, EngineEvent, SeqKind};

fn nested_schema() -> String {
    serde_json::json!({
        "type": "object",
        "properties": {
            "order": {"type": "integer", "minimum": 0},
            "customer": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.[a-z]{2,3}$"}
                },
                "required": ["name", "email"]
            },
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string"},
                        "quantity": {"type": "integer", "minimum": 1},
                        "price": {"type": "number"}
                    },
                    "required": ["sku", "quantity", "price"]
                }
            },
            "status": {"enum": ["open", "paid", "shipped"]}
        },
        "required": ["order", "customer", "items", "status"]
    })
    .to_string()
}

/// Generated ids of `prompts` run at once, and the decode tokens/s once all have started.
fn decode(
    engine: &Engine,
    prompts: &[Vec<u32>],
    params: &SamplingParams,
) -> Result<(Vec<Vec<u32>>, f64)> {
    let mut rxs = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        let params = SamplingParams {
            seed: i as u64,
            ..params.clone()
        };
        rxs.push(engine.submit(p.clone(), params, SeqKind::Generate)?);
    }
    let mut outs = vec![Vec::new(); prompts.len()];
    for (rx, out) in rxs.iter_mut().zip(&mut outs) {
        match rx.blocking_recv() {
            Some(EngineEvent::Token { token_id, .. }) => out.push(token_id),
            other => anyhow::bail!("unexpected engine event {other:?}"),
        }
    }
    let t = Instant::now();
    let mut tokens = 0usize;
    for (rx, out) in rxs.iter_mut().zip(&mut outs) {
        if out.len() as u32 >= params.max_tokens {
            continue;
        }
        while let Some(ev) = rx.blocking_recv() {
            match ev {
                EngineEvent::Token {
                    token_id, finish, ..
                } => {
                    out.push(token_id);
                    tokens += 1;
                    if finish.is_some() {
                        break;
                    }
                }
                other => anyhow::bail!("unexpected engine event {other:?}"),
            }
        }
    }
    Ok((outs, tokens as f64 / t.elapsed().as_secs_f64()))
}

/// Mean time per token of the grammar's own work over `outputs`: compute the mask, apply it
/// to a vocabulary-wide logits row, consume the token.
fn replay(
    grammars: &Grammars,
    c: &OutputConstraint,
    outputs: &[Vec<u32>],
    vocab: usize,
) -> Result<Duration> {
    let params = SamplingParams::greedy(1);
    let mut logits = vec![0.0f32; vocab];
    let (mut spent, mut tokens) = (Duration::ZERO, 0u32);
    for out in outputs {
        let mut m = grammars.constrain(c)?;
        for &t in out {
            let start = Instant::now();
            m.compute_mask()?;
            let row = SampleRow {
                params: &params,
                step: 0,
                prompt: &[],
                output: &[],
                stop_ids: &[],
                allowed: Some(m.mask()),
            };
            adjust_row(&mut logits, &row, Adjustment::Penalties);
            if m.is_complete() {
                spent += start.elapsed();
                tokens += 1;
                break;
            }
            m.consume(&[t])?;
            spent += start.elapsed();
            tokens += 1;
        }
    }
    Ok(spent / tokens.max(1))
}

pub fn run(model: &str, max_tokens: u32, batch: usize) -> Result<()> {
    let dir = crate::models::resolve(model)?;
    let args = crate::bench::cpu_engine_args(model, 2048, crate::DtypeArg::F32);
    let engine = args.start()?;
    let info = engine.info().clone();
    let grammars =
        Grammars::from_tokenizer_file(&dir.join("tokenizer.json"), info.vocab_size, &info.eos_ids)
            .context("structured outputs need the model's tokenizer.json")?;
    let tokenizer = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json"))
        .map_err(|e| anyhow::anyhow!("tokenizer: {e}"))?;
    let prompt = |i: usize| -> Result<Vec<u32>> {
        let text = format!(
            "<|im_start|>user\nWrite order number {i} of our shop as JSON.<|im_end|>\n<|im_start|>assistant\n"
        );
        Ok(tokenizer
            .encode(text, false)
            .map_err(|e| anyhow::anyhow!("encode: {e}"))?
            .get_ids()
            .to_vec())
    };
    let prompts: Vec<Vec<u32>> = (0..batch).map(prompt).collect::<Result<_>>()?;
    let free = SamplingParams {
        temperature: 1.0,
        ignore_eos: true,
        ..SamplingParams::greedy(max_tokens)
    };
    eprintln!("warming up…");
    decode(&engine, &prompts[..1], &SamplingParams::greedy(4))?;
    println!(
        "constrained decoding cost (SmolLM2, CPU f32, {max_tokens} tokens, sampled at temperature 1)"
    );
    println!(
        "{:<12} {:>6} {:>12} {:>12} {:>10} {:>12} {:>14}",
        "grammar", "batch", "free tok/s", "constr tok/s", "ratio", "grammar µs", "grammar/step"
    );
    for (name, c) in [
        ("json_object", OutputConstraint::JsonObject),
        ("nested", OutputConstraint::JsonSchema(nested_schema())),
    ] {
        let constrained = SamplingParams {
            constraint: Some(c.clone()),
            ..free.clone()
        };
        for n in [1, batch] {
            // A/B/B/A: the machine is shared and noisy.
            let (_, f1) = decode(&engine, &prompts[..n], &free)?;
            let (outs, c1) = decode(&engine, &prompts[..n], &constrained)?;
            let (_, c2) = decode(&engine, &prompts[..n], &constrained)?;
            let (_, f2) = decode(&engine, &prompts[..n], &free)?;
            let (free_tps, constr_tps) = ((f1 + f2) / 2.0, (c1 + c2) / 2.0);
            let per_token = replay(&grammars, &c, &outs, info.vocab_size)?;
            // A step decodes `n` tokens; the engine computes `n` masks on its thread.
            let step = Duration::from_secs_f64(n as f64 / free_tps);
            let share = per_token.as_secs_f64() * n as f64 / step.as_secs_f64();
            println!(
                "{name:<12} {n:>6} {free_tps:>12.1} {constr_tps:>12.1} {:>10.3} {:>12.1} {:>13.1}%",
                constr_tps / free_tps,
                per_token.as_secs_f64() * 1e6,
                share * 100.0
            );
            let lens: Vec<usize> = outs.iter().map(Vec::len).collect();
            eprintln!("  {name} batch {n}: constrained outputs of {lens:?} tokens");
        }
    }
    Ok(())
}
