//! Raw FFI bindings to the UCX library installed on the system (`libucx-dev`).
//!
//! The crates.io `ucx-sys` vendors a 2018 UCX that no longer builds, so tandem generates its
//! own bindings with bindgen at build time against whatever UCX `pkg-config` finds (Debian 12
//! ships 1.13.1, the GPU machines 1.16). Only the `ucp_*` / `ucs_*` API is bound. Enum
//! constants keep their C names (`UCS_OK`, `UCP_FEATURE_TAG`) because bindgen runs with
//! `prepend_enum_name(false)`.
//!
//! C macros and `static inline` functions have no symbol to bind to, so the few tandem needs
//! are written here by hand: [`ucp_init`] and the `UCS_PTR_*` status-pointer helpers.
//!
//! Everything here is `unsafe` and unopinionated; the safe wrapper is `tandem-ucx`.

// This crate exists to declare C functions; the generated bindings and the hand-written
// macro equivalents need `unsafe`. Callers still have to uphold UCX's contracts.
#![allow(unsafe_code)]

/// The bindgen output (generated into `OUT_DIR`, never committed).
mod bindings;
/// `ucp_init`: the `static inline` wrapper around `ucp_init_version`.
mod init;
/// `UCS_PTR_IS_ERR` / `UCS_PTR_IS_PTR` / `UCS_PTR_STATUS`, reimplemented.
mod ptr_status;

pub use bindings::*;
pub use init::ucp_init;
pub use ptr_status::{ucs_ptr_is_err, ucs_ptr_is_ptr, ucs_ptr_raw_status, ucs_ptr_status};
