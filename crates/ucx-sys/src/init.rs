use crate::bindings::{
    ucp_config_t, ucp_context_h, ucp_init_version, ucp_params_t, ucs_status_t, UCP_API_MAJOR,
    UCP_API_MINOR,
};

/// Creates a UCP context, checking that the library is compatible with the API version these
/// bindings were generated from (what the C `ucp_init` does inline).
///
/// # Safety
///
/// Same contract as C `ucp_init`: `params` must point to a valid, initialised
/// `ucp_params_t`; `config` must be null or come from `ucp_config_read` and still be alive;
/// `context_p` must be valid for a write.
pub unsafe fn ucp_init(
    params: *const ucp_params_t,
    config: *const ucp_config_t,
    context_p: *mut ucp_context_h,
) -> ucs_status_t {
    // SAFETY: the caller upholds ucp_init's contract, which is ucp_init_version's.
    unsafe { ucp_init_version(UCP_API_MAJOR, UCP_API_MINOR, params, config, context_p) }
}
