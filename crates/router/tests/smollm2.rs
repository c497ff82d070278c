//! The router with the real SmolLM2-135M-Instruct tokenizer and chat template (the model is
//! pulled into the shared cache on first use, as `make test` does before the suite).

mod common;

use common::*;
use serde_json::json;
use std::path::PathBuf;
use std::sync::Arc;
use tandem_router::{app, MemoryGenerator, ModelAssets, RouterState};

fn model_dir() -> Option<PathBuf> {
    Some(tandem_testkit::smollm2_dir())
}

#[tokio::test]
async fn chat_round_trip_with_the_real_tokenizer() {
    let Some(dir) = model_dir() else { return };
    let model = ModelAssets::load(&dir).expect("model directory loads");
    assert!(model.context_length() >= 2048);
    let im_end = model
        .tokenizer()
        .token_to_id("<|im_end|>")
        .expect("ChatML tokens");
    assert!(model.eos_token_ids().contains(&im_end));
    // specs/smollm2.md: plain prompts get no BOS.
    assert_eq!(
        model
            .encode_prompt("The capital of France is Paris.")
            .expect("encodes"),
        [504, 3575, 282, 4649, 314, 7042, 30]
    );

    let answer = "Hello! I'm SmolLM 🤖 — ça va? 日本語もOK.";
    let mut script = model.encode_chat(answer).expect("encodes");
    script.push(im_end);
    let generator = Arc::new(MemoryGenerator::new(script).with_eos(vec![im_end]));
    let state = RouterState::with_assets(generator.clone(), "smollm2", model);
    let router = app(state.clone());

    let body = json!({"messages": [{"role": "user", "content": "Hi"}]});
    let (status, whole) = post_json(&router, "/v1/chat/completions", body.clone()).await;
    assert_eq!(status, 200, "{whole}");
    assert_eq!(whole["choices"][0]["message"]["content"], answer);
    let prompt = state
        .model()
        .tokenizer()
        .decode(&generator.requests()[0].prompt_token_ids, false)
        .expect("decodes");
    assert!(prompt.starts_with("<|im_start|>system\n"), "{prompt}");
    assert!(
        prompt.ends_with("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"),
        "{prompt}"
    );

    let mut body = body;
    body["stream"] = json!(true);
    let (_, _, data) = post_sse(&router, "/v1/chat/completions", body).await;
    assert_eq!(streamed_text(&chunks(&data)), answer);
}
