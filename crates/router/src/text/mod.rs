//! From token ids to the text a client sees: incremental, UTF-8-safe detokenization, stop
//! strings matched across deltas, and the stream of text events both answer forms (one JSON
//! document, server-sent events) are built from.

/// Token ids → UTF-8-safe text deltas.
pub mod detokenizer;
/// Stop-string matching across text deltas.
pub mod stop_strings;
/// Generator tokens → text events (detokenize, stop strings, limits, metrics).
pub(crate) mod text_stream;
