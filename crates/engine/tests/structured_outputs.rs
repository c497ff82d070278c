//! Structured outputs on SmolLM2 with its real weights and tokenizer: constrained output
//! parses and keeps to its schema under sampling, a resumed constrained request (how a decode
//! worker or a migrated request rebuilds the grammar: from the tokens so far) continues
//! exactly, and what cannot be enforced is refused up front with the reason.

use serde_json::{json, Value};
use tandem_core::{OutputConstraint, SamplingParams};
use tandem_engine::Error;
use tandem_engine::{CpuBackend, DType, Engine, EngineConfig, EngineEvent, LlamaModel, SeqKind};

fn engine(tokenizer: bool) -> (Engine, tokenizers::Tokenizer) {
    let dir = tandem_testkit::smollm2_dir();
    let model = LlamaModel::load(&dir, CpuBackend::new(), DType::F32).expect("load model");
    let path = dir.join("tokenizer.json");
    let config = EngineConfig {
        tokenizer: tokenizer.then(|| path.clone()),
        ..EngineConfig::default()
    };
    let tk = tokenizers::Tokenizer::from_file(&path).expect("tokenizer");
    (Engine::start(model, config), tk)
}

fn prompt(tk: &tokenizers::Tokenizer, text: &str) -> Vec<u32> {
    let chat = format!("<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n");
    tk.encode(chat, false).expect("encode").get_ids().to_vec()
}

/// The generated ids and whether the request stopped (rather than ran out of tokens).
fn run(engine: &Engine, prompt: Vec<u32>, params: SamplingParams) -> (Vec<u32>, bool) {
    let mut rx = engine
        .submit(prompt, params, SeqKind::Generate)
        .expect("submit");
    let mut out = Vec::new();
    while let Some(ev) = rx.blocking_recv() {
        match ev {
            EngineEvent::Token {
                token_id, finish, ..
            } => {
                out.push(token_id);
                if let Some(f) = finish {
                    return (out, f == tandem_core::FinishReason::Stop);
                }
            }
            other => panic!("unexpected event {other:?}"),
        }
    }
    panic!("the stream ended without finishing")
}

fn person_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "pet": {"enum": ["cat", "dog", "none"]}
        },
        "required": ["name", "age", "pet"],
        "additionalProperties": false
    })
}

fn constrained(schema: &Value, temperature: f32, seed: u64, max_tokens: u32) -> SamplingParams {
    SamplingParams {
        temperature,
        seed,
        constraint: Some(OutputConstraint::JsonSchema(schema.to_string())),
        ..SamplingParams::greedy(max_tokens)
    }
}

#[test]
fn constrained_output_parses_and_keeps_to_its_schema_under_sampling() {
    let (engine, tk) = engine(true);
    let p = prompt(&tk, "Describe a person as JSON.");
    for seed in 0..4 {
        let (ids, stopped) = run(
            &engine,
            p.clone(),
            constrained(&person_schema(), 1.0, seed, 64),
        );
        let text = tk.decode(&ids, true).expect("decode");
        assert!(
            stopped,
            "seed {seed}: the object should close within 64 tokens: {text:?}"
        );
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        let o = v.as_object().expect("an object");
        assert_eq!(o.len(), 3, "{text}");
        assert!(
            o["name"].as_str().is_some_and(|n| n.chars().count() <= 12),
            "{text}"
        );
        assert!(o["age"].as_u64().is_some_and(|a| a <= 120), "{text}");
        assert!(
            ["cat", "dog", "none"].contains(&o["pet"].as_str().expect("pet")),
            "{text}"
        );
    }
    // JSON mode: any object; unconstrained, the same prompt is prose.
    let object = SamplingParams {
        constraint: Some(OutputConstraint::JsonObject),
        ..SamplingParams::greedy(48)
    };
    let (ids, stopped) = run(
        &engine,
        prompt(&tk, "Give me a JSON object with a key a set to 1."),
        object,
    );
    let text = tk.decode(&ids, true).expect("decode");
    if stopped {
        assert!(
            serde_json::from_str::<Value>(&text)
                .expect(&text)
                .is_object(),
            "{text}"
        );
    } else {
        assert!(text.starts_with('{'), "{text}");
    }
    let (free, _) = run(&engine, p, SamplingParams::greedy(16));
    let free = tk.decode(&free, true).expect("decode");
    assert!(
        serde_json::from_str::<Value>(&free).is_err(),
        "free text: {free:?}"
    );
    assert_eq!(
        engine.allocator().free_blocks(),
        engine.allocator().total_blocks(),
        "KV blocks leaked"
    );
}

/// The grammar is rebuilt from tokens, not carried: a request resumed after `k` tokens (as a
/// decode worker sees a prefill's first token, or a migrated request its streamed ones)
/// samples what the uninterrupted request did.
#[test]
fn a_resumed_constrained_request_continues_exactly() {
    let (engine, tk) = engine(true);
    let p = prompt(&tk, "Describe a person as JSON.");
    let params = constrained(&person_schema(), 0.8, 11, 64);
    let (whole, stopped) = run(&engine, p.clone(), params.clone());
    assert!(stopped && whole.len() > 6, "{whole:?}");
    for k in [1, 5] {
        let mut resumed_prompt = p.clone();
        resumed_prompt.extend(&whole[..k]);
        let resumed = SamplingParams {
            resumed: k as u32,
            max_tokens: params.max_tokens - k as u32,
            ..params.clone()
        };
        let (rest, _) = run(&engine, resumed_prompt, resumed);
        assert_eq!(rest, whole[k..], "resumed after {k}");
    }
}

#[test]
fn what_cannot_be_enforced_is_refused_with_the_reason() {
    let (served, tk) = engine(true);
    let p = prompt(&tk, "hi");
    let refusal = |engine: &Engine, c: OutputConstraint| {
        let params = SamplingParams {
            constraint: Some(c),
            ..SamplingParams::greedy(8)
        };
        match engine.submit(p.clone(), params, SeqKind::Generate) {
            Err(Error::InvalidRequest(m)) => m,
            Err(e) => panic!("wrong error class: {e}"),
            Ok(_) => panic!("accepted"),
        }
    };
    let m = refusal(
        &served,
        OutputConstraint::JsonSchema(
            json!({"type": "object", "not": {"type": "null"}}).to_string(),
        ),
    );
    assert!(m.contains("not"), "names the keyword: {m}");
    let m = refusal(&served, OutputConstraint::JsonSchema("{".into()));
    assert!(m.contains("not JSON"), "{m}");
    let m = refusal(&served, OutputConstraint::JsonSchema("[1]".into()));
    assert!(m.contains("is an object"), "{m}");
    let (without, _) = engine(false);
    let m = refusal(&without, OutputConstraint::JsonObject);
    assert!(m.contains("structured outputs are not available"), "{m}");
    assert_eq!(
        served.allocator().free_blocks(),
        served.allocator().total_blocks(),
        "a refused request holds nothing"
    );
}
