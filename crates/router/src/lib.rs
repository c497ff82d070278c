//! tandem's router: the OpenAI-compatible HTTP front end of a prefill/decode cluster.
//!
//! The router owns the tokenizer. It validates a request, renders the chat template,
//! tokenizes, and hands token ids to a [`Generator`]; tokens come back as a stream, which the
//! router detokenizes incrementally (UTF-8 safe), checks against stop strings and sends to the
//! client as one JSON answer or as server-sent events. Keeping text handling here means workers
//! deal only in token ids, and routing can see token prefixes.
//!
//! Where tokens come from is behind the narrow [`Generator`] trait: the P/D implementation
//! talks gRPC to a prefill and a decode worker; [`testing::MemoryGenerator`] replays a script,
//! so the whole HTTP surface is tested without workers. Dropping a token stream cancels the
//! generation, and nothing but the response body holds it, so a client that disconnects
//! cancels its request.
//!
//! Failures are classified (`ErrorClass`) where they happen and rendered to HTTP in one place,
//! [`ApiError::status`].

/// Rate limits and the priority queue in front of the generator.
pub mod admission;
/// One attempt of a request on its workers.
mod attempt;
/// API keys on the HTTP routes.
pub mod auth;
/// Per-worker circuit breakers.
pub mod breaker;
/// Compiling and rendering Hugging Face chat templates.
pub mod chat_template;
/// The `/v1/chat/completions` and `/v1/completions` handlers and their answer shapes.
mod completions;
/// Router YAML configuration: `RawConfig` → validated `RouterConfig`.
pub mod config;
/// Token ids → UTF-8-safe text deltas.
pub mod detokenizer;
/// Start-up errors and client-facing API errors (the one `ErrorClass` → status mapping).
pub mod error;
/// The boundary to whatever produces tokens: the `Generator` trait.
pub mod generator;
/// The table of requests in flight (`/admin/requests`).
pub mod inflight;
/// Process wiring: config → workers → app; `/ready` and `/admin/workers`.
pub mod launch;
/// Prometheus metrics in a router-owned registry; per-request recording.
pub mod metrics;
/// Tokenizer, chat template, context length and EOS ids loaded from a model directory.
pub mod model;
/// `GET /openapi.json`: the router's OpenAPI document.
pub mod openapi;
/// The P/D generator: gRPC to a prefill and a decode worker per request, with retries.
pub mod pd;
/// Worker selection policies.
pub mod policy;
/// Per-pool gauges for autoscalers.
pub mod pool_metrics;
/// OpenAI request and response wire types.
pub mod protocol;
/// Sampling controls and log-probability fields of a request, checked.
pub mod sampling_fields;
/// Router state, routes, and `serve`.
pub mod server;
/// Stop-string matching across text deltas.
pub mod stop_strings;
/// In-memory test double of `Generator`.
pub mod testing;
/// Generator tokens → text events (detokenize, stop strings, limits, metrics).
mod text_stream;
/// HTTPS on the front (its certificate reloaded when it changes) and mutual TLS to workers.
pub mod tls;
/// `/tokenize` and `/detokenize`.
mod tokenize;
/// Tool calls: `tools`/`tool_choice` checked, calls read back from the model's text.
pub mod tools;
/// Recording request traces (`--record-trace`).
pub mod trace;
/// Parsed requests → checked, tokenized requests.
pub mod validation;
/// Worker handles and pools.
pub mod workers;

pub use config::{RawConfig, RouterConfig, WorkerAddress, WorkerEndpoint};
pub use error::{ApiError, Error, Result};
pub use generator::{
    GenerateError, GenerateFuture, GeneratedToken, Generator, TokenStream, ValidGenerateRequest,
};
pub use launch::{run_from_config, Overrides};
pub use metrics::Metrics;
pub use model::{ModelAssets, ModelInfo};
pub use server::{app, serve, serve_with_shutdown, RouterState};
pub use testing::MemoryGenerator;
