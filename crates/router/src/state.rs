//! [`RouterState`]: what every handler shares (the generator, the served model's assets,
//! metrics, admission, readiness). It lives apart from the routes so that handlers import it
//! without importing the application that mounts them.

use crate::admission::Admission;
use crate::config::AdmissionConfig;
use crate::error::Result;
use crate::generator::Generator;
use crate::metrics::Metrics;
use crate::openai::model::{ModelAssets, ModelInfo};
use crate::openai::protocol::unix_now;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Everything the handlers share. Cheap to clone.
#[derive(Clone)]
pub struct RouterState {
    inner: Arc<Inner>,
}

struct Inner {
    generator: Arc<dyn Generator>,
    served_name: String,
    model: Arc<ModelAssets>,
    metrics: Arc<Metrics>,
    admission: Arc<Admission>,
    ready: AtomicBool,
    created: u64,
}

impl std::fmt::Debug for RouterState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RouterState")
            .field("served_name", &self.inner.served_name)
            .field("context_length", &self.inner.model.context_length())
            .field("ready", &self.is_ready())
            .finish_non_exhaustive()
    }
}

impl RouterState {
    /// Loads the model's tokenizer, template and limits from `model.dir` and serves it as
    /// `model.served_name` through `generator`.
    pub fn new(generator: Arc<dyn Generator>, model: &ModelInfo) -> Result<Self> {
        Ok(Self::with_assets(
            generator,
            model.served_name.clone(),
            model.load()?,
        ))
    }

    /// Like [`Self::new`] with assets already loaded (e.g. because building the generator
    /// needed them too).
    pub fn with_assets(
        generator: Arc<dyn Generator>,
        served_name: impl Into<String>,
        model: ModelAssets,
    ) -> Self {
        let served_name = served_name.into();
        let metrics = Arc::new(Metrics::new(&served_name));
        let admission = Arc::new(Admission::new(
            AdmissionConfig::default(),
            metrics.registry(),
        ));
        Self {
            inner: Arc::new(Inner {
                generator,
                served_name,
                model: Arc::new(model),
                metrics,
                admission,
                ready: AtomicBool::new(true),
                created: unix_now(),
            }),
        }
    }

    /// The served model's name.
    pub fn served_name(&self) -> &str {
        &self.inner.served_name
    }

    /// The served model's tokenizer, template and limits.
    pub fn model(&self) -> &Arc<ModelAssets> {
        &self.inner.model
    }

    /// The router's metrics (its registry accepts more collectors).
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.inner.metrics
    }

    /// Admission control (rate limits, the priority queue); admits everything until
    /// configured.
    pub fn admission(&self) -> &Arc<Admission> {
        &self.inner.admission
    }

    /// The generator.
    pub fn generator(&self) -> &Arc<dyn Generator> {
        &self.inner.generator
    }

    /// Whether `/health` answers 200 (true from construction; set false while draining).
    pub fn is_ready(&self) -> bool {
        self.inner.ready.load(Ordering::Relaxed)
    }

    /// Sets what `/health` reports.
    pub fn set_ready(&self, ready: bool) {
        self.inner.ready.store(ready, Ordering::Relaxed);
    }

    /// When this state was made, in seconds since the Unix epoch (the model card's `created`).
    pub(crate) fn created(&self) -> u64 {
        self.inner.created
    }
}
