use std::ffi::CString;
use std::ptr;

use tandem_ucx_sys as sys;

use crate::error::{check, Error, Result};

/// UCX configuration: starts from the `UCX_*` environment variables (`ucp_config_read`) and
/// can be overridden field by field (`ucp_config_modify`) before creating a
/// [`Context`](crate::Context).
pub struct Config {
    handle: *mut sys::ucp_config_t,
}

impl Config {
    /// Reads the configuration from the environment.
    pub fn read() -> Result<Config> {
        let mut handle = ptr::null_mut();
        // SAFETY: null env prefix and file name mean "defaults + UCX_* environment";
        // `handle` is a valid out-pointer.
        let status = unsafe { sys::ucp_config_read(ptr::null(), ptr::null(), &mut handle) };
        check("ucp_config_read", status)?;
        Ok(Config { handle })
    }

    /// Sets one variable, named without the `UCX_` prefix (`"TLS"`, `"NET_DEVICES"`).
    pub fn set(&mut self, name: &str, value: &str) -> Result<()> {
        let invalid = || Error::InvalidConfig {
            name: name.to_owned(),
            value: value.to_owned(),
        };
        let c_name = CString::new(name).map_err(|_| invalid())?;
        let c_value = CString::new(value).map_err(|_| invalid())?;
        // SAFETY: `handle` is live (released only in Drop); both strings are NUL-terminated
        // and outlive the call, which copies them.
        let status =
            unsafe { sys::ucp_config_modify(self.handle, c_name.as_ptr(), c_value.as_ptr()) };
        check("ucp_config_modify", status)
    }

    pub(crate) fn as_ptr(&self) -> *const sys::ucp_config_t {
        self.handle
    }
}

impl Drop for Config {
    fn drop(&mut self) {
        // SAFETY: `handle` came from ucp_config_read and is released exactly once.
        unsafe { sys::ucp_config_release(self.handle) };
    }
}
