//! API keys: `Authorization: Bearer KEY` on every route but the probes (and, unless asked,
//! `/metrics` and `/version`), answered 401 in OpenAI's shape otherwise. Keys come from the
//! config, an environment variable and a file; the file is read again whenever it changes,
//! so keys rotate without a restart.
//!
//! An entry is `KEY` or `KEY NAME`: the name says whose key it is, so a tenant's limits and
//! default priority (`admission.keys.NAME`) follow it across rotations. The accepted key's
//! [`Caller`] goes with the request for admission to read.

use crate::error::ApiError;
use axum::extract::{Request, State};
use axum::http::header::AUTHORIZATION;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::Mutex;
use std::time::SystemTime;

/// The router config's `auth` section (absent: no keys, every route open).
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct AuthConfig {
    /// Keys accepted, inline (prefer a file or an environment variable for secrets); each
    /// `KEY` or `KEY NAME`.
    pub api_keys: Vec<String>,
    /// A file of keys, one per line (`KEY` or `KEY NAME`; blank lines and `#` comments
    /// skipped), read again whenever it changes.
    pub api_keys_file: Option<PathBuf>,
    /// An environment variable holding comma-separated keys (`KEY` or `KEY NAME`).
    pub api_keys_env: Option<String>,
    /// Require a key on `/health` and `/ready` too (default: open, for orchestrator probes).
    pub protect_health: bool,
    /// Require a key on `/metrics` too (default: open, for scrapers).
    pub protect_metrics: bool,
}

impl AuthConfig {
    /// Whether any key source is configured.
    pub fn enabled(&self) -> bool {
        !self.api_keys.is_empty() || self.api_keys_file.is_some() || self.api_keys_env.is_some()
    }
}

/// Who sent a request: the name of the API key it carried, or the key itself for a key
/// without a name. Put in the request's extensions by [`require`]; never logged or used as a
/// metric label.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Caller(pub Arc<str>);

/// One accepted key.
#[derive(Clone, Debug)]
struct Key {
    secret: String,
    caller: Caller,
}

#[derive(Debug, Default)]
struct FileKeys {
    /// (modified, length) of the file when last read.
    seen: Option<(SystemTime, u64)>,
    keys: Arc<Vec<Key>>,
}

/// The keys a router accepts. Clones share them.
#[derive(Clone, Debug)]
pub struct ApiKeys {
    fixed: Arc<Vec<Key>>,
    file: Option<(PathBuf, Arc<Mutex<FileKeys>>)>,
    protect_health: bool,
    protect_metrics: bool,
}

/// Entries separated by `sep`, each `KEY` or `KEY NAME`.
fn parse_keys(text: &str, sep: char) -> Vec<Key> {
    text.split(sep)
        .map(str::trim)
        .filter(|k| !k.is_empty() && !k.starts_with('#'))
        .map(|entry| {
            let mut words = entry.split_whitespace();
            let secret = words.next().unwrap_or_default().to_owned();
            let caller = Caller(words.next().unwrap_or(&secret).into());
            Key { secret, caller }
        })
        .collect()
}

impl ApiKeys {
    /// The keys of `config`, or `None` when it configures none. Fails when a source is
    /// configured but unreadable or empty (a router that meant to be keyed must not start
    /// open).
    pub fn from_config(config: &AuthConfig) -> Result<Option<Self>, String> {
        if !config.enabled() {
            return Ok(None);
        }
        let mut fixed: Vec<Key> = config
            .api_keys
            .iter()
            .flat_map(|k| parse_keys(k, '\n'))
            .collect();
        if let Some(var) = &config.api_keys_env {
            let value =
                std::env::var(var).map_err(|_| format!("auth.api_keys_env: ${var} is not set"))?;
            fixed.extend(parse_keys(&value, ','));
        }
        let keys = Self {
            fixed: Arc::new(fixed),
            file: config
                .api_keys_file
                .clone()
                .map(|p| (p, Arc::new(Mutex::new(FileKeys::default())))),
            protect_health: config.protect_health,
            protect_metrics: config.protect_metrics,
        };
        if let Some((path, _)) = &keys.file {
            std::fs::metadata(path)
                .map_err(|e| format!("auth.api_keys_file {}: {e}", path.display()))?;
        }
        if keys.count() == 0 {
            return Err("auth: the configured key sources hold no key".into());
        }
        Ok(Some(keys))
    }

    /// Keys accepted now.
    pub fn count(&self) -> usize {
        self.fixed.len() + self.file_keys().len()
    }

    fn file_keys(&self) -> Arc<Vec<Key>> {
        let Some((path, cache)) = &self.file else {
            return Arc::default();
        };
        let mut c = cache
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let now = std::fs::metadata(path)
            .ok()
            .and_then(|m| Some((m.modified().ok()?, m.len())));
        if now != c.seen {
            match std::fs::read_to_string(path) {
                Ok(text) => {
                    c.keys = Arc::new(parse_keys(&text, '\n'));
                    c.seen = now;
                    tracing::info!(file = %path.display(), keys = c.keys.len(), "API keys read");
                }
                // Keep the last good keys while the file is being replaced.
                Err(e) => tracing::warn!(file = %path.display(), error = %e, "reading API keys"),
            }
        }
        c.keys.clone()
    }

    /// Whether `presented` is a key accepted now (compared in constant time per key).
    pub fn accepts(&self, presented: &str) -> bool {
        self.caller(presented).is_some()
    }

    /// Who `presented` belongs to, when it is a key accepted now (compared in constant time
    /// per key).
    pub fn caller(&self, presented: &str) -> Option<Caller> {
        let eq = |k: &Key| {
            k.secret.len() == presented.len()
                && k.secret
                    .bytes()
                    .zip(presented.bytes())
                    .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                    == 0
        };
        // Every key is compared, so the time does not tell which one matched.
        let file = self.file_keys();
        self.fixed
            .iter()
            .chain(file.iter())
            .fold(None, |hit, k| if eq(k) { Some(k) } else { hit })
            .map(|k| k.caller.clone())
    }

    /// Whether requests to `path` need a key.
    pub fn guards(&self, path: &str) -> bool {
        match path {
            "/health" | "/ready" => self.protect_health,
            "/metrics" | "/version" => self.protect_metrics,
            _ => true,
        }
    }
}

/// Middleware: answers 401 unless the request carries an accepted key (where one is needed).
/// The accepted key's [`Caller`] goes into the request's extensions.
pub async fn require(State(keys): State<ApiKeys>, mut request: Request, next: Next) -> Response {
    if !keys.guards(request.uri().path()) {
        return next.run(request).await;
    }
    let presented = request
        .headers()
        .get(AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    match presented.map(|k| keys.caller(k)) {
        Some(Some(caller)) => {
            request.extensions_mut().insert(caller);
            next.run(request).await
        }
        Some(None) => ApiError::unauthorized("Incorrect API key provided.").into_response(),
        None => ApiError::unauthorized("Missing API key: send it as `Authorization: Bearer KEY`.")
            .into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_from_every_source_and_the_file_rotates() {
        let dir = tempfile::tempdir().expect("tmp");
        let file = dir.path().join("keys");
        std::fs::write(&file, "# rotated daily\nsk-file-1\n\n").expect("write");
        std::env::set_var("TANDEM_TEST_AUTH_KEYS", "sk-env-1, sk-env-2");
        let keys = ApiKeys::from_config(&AuthConfig {
            api_keys: vec!["sk-inline".into()],
            api_keys_file: Some(file.clone()),
            api_keys_env: Some("TANDEM_TEST_AUTH_KEYS".into()),
            ..AuthConfig::default()
        })
        .expect("valid")
        .expect("enabled");
        for k in ["sk-inline", "sk-env-1", "sk-env-2", "sk-file-1"] {
            assert!(keys.accepts(k), "{k}");
        }
        assert!(
            !keys.accepts("sk-file-2") && !keys.accepts("") && !keys.accepts("# rotated daily")
        );
        std::fs::write(&file, "sk-file-2-longer\n").expect("rotate");
        assert!(
            keys.accepts("sk-file-2-longer"),
            "the new key works at once"
        );
        assert!(!keys.accepts("sk-file-1"), "the old one is gone");
        assert!(keys.guards("/v1/chat/completions") && keys.guards("/admin/workers"));
        assert!(!keys.guards("/health") && !keys.guards("/metrics"));
    }

    #[test]
    fn a_named_key_carries_its_name_and_an_unnamed_one_itself() {
        let dir = tempfile::tempdir().expect("tmp");
        let file = dir.path().join("keys");
        std::fs::write(&file, "sk-old team-a\nsk-new   team-a\nsk-solo\n").expect("write");
        let keys = ApiKeys::from_config(&AuthConfig {
            api_keys: vec!["sk-inline batch".into()],
            api_keys_file: Some(file),
            ..AuthConfig::default()
        })
        .expect("valid")
        .expect("enabled");
        let name = |k: &str| keys.caller(k).map(|c| c.0.to_string());
        assert_eq!(name("sk-inline").as_deref(), Some("batch"));
        assert_eq!(name("sk-old"), name("sk-new"), "two keys of one tenant");
        assert_eq!(name("sk-new").as_deref(), Some("team-a"));
        assert_eq!(name("sk-solo").as_deref(), Some("sk-solo"));
        assert_eq!(name("team-a"), None, "a name is not a key");
        assert_eq!(name("sk-inline batch"), None);
    }

    #[test]
    fn a_configured_source_without_keys_refuses_to_start() {
        assert!(ApiKeys::from_config(&AuthConfig::default())
            .expect("ok")
            .is_none());
        let missing = AuthConfig {
            api_keys_env: Some("TANDEM_TEST_AUTH_UNSET".into()),
            ..AuthConfig::default()
        };
        assert!(ApiKeys::from_config(&missing).is_err());
        let empty = AuthConfig {
            api_keys: vec![],
            api_keys_file: Some("/nonexistent/keys".into()),
            ..AuthConfig::default()
        };
        assert!(ApiKeys::from_config(&empty).is_err());
    }
}
