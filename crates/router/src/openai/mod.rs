//! The OpenAI-compatible API: its wire types, how a request is checked and turned into a
//! prompt (chat template, tools, sampling fields), the completion handlers and their answers,
//! `/tokenize`, the OpenAPI document, and the served model's assets these need (tokenizer,
//! template, context length, EOS ids).
//!
//! Requests come in as [`protocol`] types, are checked and tokenized by [`validation`] into a
//! `ValidGenerateRequest` for the generator, and the tokens that come back are turned into
//! answers by `completions` (through `crate::text`).
//!
//! [`protocol`]: crate::openai::protocol
//! [`validation`]: crate::openai::validation

/// Compiling and rendering Hugging Face chat templates.
pub mod chat_template;
/// The `/v1/chat/completions` and `/v1/completions` handlers and their answers.
pub(crate) mod completions;
/// Tokenizer, chat template, context length and EOS ids loaded from a model directory.
pub mod model;
/// `GET /openapi.json`: the router's OpenAPI document.
pub mod openapi;
/// OpenAI request and response wire types.
pub mod protocol;
/// Sampling controls and log-probability fields of a request, checked.
pub mod sampling_fields;
/// `/tokenize` and `/detokenize`.
pub(crate) mod tokenize;
/// Tool calls: `tools`/`tool_choice` checked, calls read back from the model's text.
pub mod tools;
/// Parsed requests → checked, tokenized requests.
pub mod validation;
