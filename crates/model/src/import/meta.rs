//! Typed access to GGUF metadata, with errors that name the key.

use crate::gguf::{Gguf, MetadataValue};
use crate::{Error, Result};

fn missing(key: &str, expected: &'static str) -> Error {
    Error::GgufMetadata {
        key: key.to_string(),
        expected,
    }
}

/// A required string.
pub(crate) fn string<'a>(gguf: &'a Gguf, key: &str) -> Result<&'a str> {
    gguf.get(key)
        .and_then(MetadataValue::as_str)
        .ok_or_else(|| missing(key, "a string"))
}

/// A required non-negative integer.
pub(crate) fn uint(gguf: &Gguf, key: &str) -> Result<usize> {
    gguf.get(key)
        .and_then(MetadataValue::as_u64)
        .and_then(|v| usize::try_from(v).ok())
        .ok_or_else(|| missing(key, "a non-negative integer"))
}

/// An optional non-negative integer (present with another type is an error).
pub(crate) fn opt_u64(gguf: &Gguf, key: &str) -> Result<Option<u64>> {
    gguf.get(key)
        .map(|v| {
            v.as_u64()
                .ok_or_else(|| missing(key, "a non-negative integer"))
        })
        .transpose()
}

/// A required float.
pub(crate) fn float(gguf: &Gguf, key: &str) -> Result<f32> {
    gguf.get(key)
        .and_then(MetadataValue::as_f64)
        .map(|v| v as f32)
        .ok_or_else(|| missing(key, "a float"))
}

/// An optional bool.
pub(crate) fn opt_bool(gguf: &Gguf, key: &str) -> Result<Option<bool>> {
    match gguf.get(key) {
        None => Ok(None),
        Some(MetadataValue::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(missing(key, "a bool")),
    }
}

/// A required array of strings.
pub(crate) fn strings(gguf: &Gguf, key: &str) -> Result<Vec<String>> {
    gguf.get(key)
        .and_then(MetadataValue::as_array)
        .and_then(|items| {
            items
                .iter()
                .map(|v| v.as_str().map(str::to_string))
                .collect()
        })
        .ok_or_else(|| missing(key, "an array of strings"))
}

/// A required array of integers.
pub(crate) fn ints(gguf: &Gguf, key: &str) -> Result<Vec<i64>> {
    gguf.get(key)
        .and_then(MetadataValue::as_array)
        .and_then(|items| items.iter().map(MetadataValue::as_i64).collect())
        .ok_or_else(|| missing(key, "an array of integers"))
}
