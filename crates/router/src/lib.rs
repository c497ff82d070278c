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
/// API keys on the HTTP routes.
pub mod auth;
/// Router YAML configuration: `RawConfig` → validated `RouterConfig`.
pub mod config;
/// Start-up errors and client-facing API errors (the one `ErrorClass` → status mapping).
pub mod error;
/// The boundary to whatever produces tokens: the `Generator` trait.
pub mod generator;
/// Process wiring: config → workers → app; `/ready` and `/admin/workers`.
pub mod launch;
/// Prometheus metrics in a router-owned registry; per-request recording.
pub mod metrics;
/// The OpenAI-compatible API: wire types, validation, chat template, tools, the handlers.
pub mod openai;
/// The P/D generator and its parts: workers, selection policy, breakers, requests in flight.
pub mod pd;
/// The routes over a `RouterState`, and `serve`.
pub mod server;
/// What every handler shares: `RouterState`.
pub mod state;
/// In-memory test double of `Generator`.
pub mod testing;
/// Token ids → text: detokenizer, stop strings, the text event stream.
pub mod text;
/// HTTPS on the front (its certificate reloaded when it changes) and mutual TLS to workers.
pub mod tls;
/// Recording request traces (`--record-trace`).
pub mod trace;

pub use config::{RawConfig, RouterConfig, WorkerAddress, WorkerEndpoint};
pub use error::{ApiError, Error, Result};
pub use generator::{
    GenerateError, GenerateFuture, GeneratedToken, Generator, TokenStream, ValidGenerateRequest,
};
pub use launch::{run_from_config, Overrides};
pub use metrics::Metrics;
pub use openai::model::{ModelAssets, ModelInfo};
pub use server::{app, serve, serve_with_shutdown};
pub use state::RouterState;
pub use testing::MemoryGenerator;
