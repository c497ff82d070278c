use std::ptr;
use std::rc::Rc;

use tandem_ucx_sys as sys;

use crate::config::Config;
use crate::error::{check, Result};

/// A UCP application context with the tag-matching, RMA (one-sided put) and wakeup features.
///
/// Cheap to clone (reference-counted); the context is cleaned up when the last clone and the
/// last [`Worker`](crate::Worker) made from it are gone.
#[derive(Clone)]
pub struct Context {
    inner: Rc<ContextInner>,
}

struct ContextInner {
    handle: sys::ucp_context_h,
}

impl Context {
    /// Initialises UCP with `config` (which may be dropped afterwards).
    pub fn new(config: &Config) -> Result<Context> {
        let params = sys::ucp_params_t {
            field_mask: u64::from(sys::UCP_PARAM_FIELD_FEATURES),
            features: u64::from(
                sys::UCP_FEATURE_TAG
                    | sys::UCP_FEATURE_RMA
                    | sys::UCP_FEATURE_AMO64
                    | sys::UCP_FEATURE_WAKEUP,
            ),
            ..Default::default()
        };
        let mut handle = ptr::null_mut();
        // SAFETY: `params` is initialised and only the features field is marked valid;
        // `config` is a live ucp_config_t; `handle` is a valid out-pointer.
        let status = unsafe { sys::ucp_init(&params, config.as_ptr(), &mut handle) };
        check("ucp_init", status)?;
        tracing::debug!(version = %crate::version(), "UCX context created");
        Ok(Context {
            inner: Rc::new(ContextInner { handle }),
        })
    }

    pub(crate) fn handle(&self) -> sys::ucp_context_h {
        self.inner.handle
    }
}

impl Drop for ContextInner {
    fn drop(&mut self) {
        // SAFETY: the handle came from ucp_init; every worker holds a Context clone, so none
        // is left when the last reference drops and this runs exactly once.
        unsafe { sys::ucp_cleanup(self.handle) };
    }
}
