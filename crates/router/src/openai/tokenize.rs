//! `POST /tokenize` and `POST /detokenize` in vLLM's shapes: the served model's own
//! tokenizer and chat template, exactly as the completion endpoints apply them, so a client
//! can count a prompt's tokens before sending it.

use crate::error::ApiError;
use crate::openai::protocol::ChatMessage;
use crate::openai::validation;
use crate::state::RouterState;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// `POST /tokenize` body: a completion `prompt` or chat `messages`.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct TokenizeRequest {
    model: Option<String>,
    prompt: Option<String>,
    messages: Option<Vec<ChatMessage>>,
}

/// `POST /tokenize` answer.
#[derive(Debug, Serialize)]
struct TokenizeResponse {
    count: usize,
    max_model_len: u32,
    tokens: Vec<u32>,
}

/// `POST /detokenize` body.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct DetokenizeRequest {
    model: Option<String>,
    tokens: Option<Vec<i64>>,
}

fn parse<T: serde::de::DeserializeOwned>(
    body: Result<Bytes, BytesRejection>,
) -> Result<T, ApiError> {
    let body = body.map_err(|r| ApiError::invalid(r.body_text(), None))?;
    validation::parse_body(&body)
}

/// `POST /tokenize`.
pub(crate) async fn tokenize(
    State(state): State<RouterState>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let answer = async {
        let req: TokenizeRequest = parse(body)?;
        validation::check_model(req.model.as_deref(), state.served_name())?;
        let model = state.model().clone();
        tokio::task::spawn_blocking(move || match (req.prompt, req.messages) {
            (Some(text), None) => validation::text_prompt(&model, &text),
            (None, Some(messages)) => validation::chat_prompt(&model, Some(&messages), None),
            _ => Err(ApiError::invalid(
                "send exactly one of `prompt` and `messages`",
                None,
            )),
        })
        .await
        .map_err(|e| ApiError::internal(format!("tokenizing failed: {e}")))?
        .map(|tokens| TokenizeResponse {
            count: tokens.len(),
            max_model_len: state.model().context_length(),
            tokens,
        })
    };
    match answer.await {
        Ok(r) => Json(r).into_response(),
        Err(e) => e.into_response(),
    }
}

/// `POST /detokenize`.
pub(crate) async fn detokenize(
    State(state): State<RouterState>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let answer = || -> Result<Value, ApiError> {
        let req: DetokenizeRequest = parse(body)?;
        validation::check_model(req.model.as_deref(), state.served_name())?;
        let ids = req
            .tokens
            .ok_or_else(|| ApiError::invalid("`tokens` is required", Some("tokens")))?;
        let ids = validation::client_token_ids(&ids, state.model(), "tokens")?;
        let text = state
            .model()
            .tokenizer()
            .decode(&ids, false)
            .map_err(|e| ApiError::internal(format!("decoding failed: {e}")))?;
        Ok(serde_json::json!({ "prompt": text }))
    };
    match answer() {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}
