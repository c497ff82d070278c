//! UCX returns either a request pointer or a status code cast to a pointer from its
//! non-blocking calls. Status codes are small negative integers, so as addresses they sit in
//! the last `-UCS_ERR_LAST` bytes of the address space.

use std::ffi::c_void;

use crate::bindings::{ucs_status_t, UCS_ERR_LAST, UCS_INPROGRESS};

/// `(uintptr_t)UCS_ERR_LAST`: the lowest address that encodes an error status.
#[inline]
fn err_last_addr() -> usize {
    // Sign-extend the (negative) status to pointer width, as the C cast does.
    UCS_ERR_LAST as isize as usize
}

/// `UCS_PTR_IS_ERR`: the pointer encodes an error status.
#[inline]
pub fn ucs_ptr_is_err(ptr: *const c_void) -> bool {
    (ptr as usize) >= err_last_addr()
}

/// `UCS_PTR_IS_PTR`: the pointer is a real request handle (neither null/`UCS_OK` nor an
/// error).
#[inline]
pub fn ucs_ptr_is_ptr(ptr: *const c_void) -> bool {
    (ptr as usize).wrapping_sub(1) < err_last_addr() - 1
}

/// `UCS_PTR_RAW_STATUS`: reinterprets the pointer as a status, whatever it holds.
#[inline]
pub fn ucs_ptr_raw_status(ptr: *const c_void) -> ucs_status_t {
    // Truncation is the point: status codes fit in ucs_status_t, as in the C macro.
    ptr as isize as ucs_status_t
}

/// `UCS_PTR_STATUS`: `UCS_INPROGRESS` for a request handle, otherwise the encoded status
/// (`UCS_OK` for null).
#[inline]
pub fn ucs_ptr_status(ptr: *const c_void) -> ucs_status_t {
    if ucs_ptr_is_ptr(ptr) {
        UCS_INPROGRESS
    } else {
        ucs_ptr_raw_status(ptr)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bindings::{UCS_ERR_NO_MEMORY, UCS_ERR_UNREACHABLE, UCS_OK};

    fn status_ptr(s: ucs_status_t) -> *const c_void {
        s as isize as *const c_void
    }

    #[test]
    fn null_is_ok_and_not_a_pointer() {
        let p = std::ptr::null();
        assert!(!ucs_ptr_is_err(p));
        assert!(!ucs_ptr_is_ptr(p));
        assert_eq!(ucs_ptr_status(p), UCS_OK);
    }

    #[test]
    fn error_codes_round_trip() {
        for s in [UCS_ERR_NO_MEMORY, UCS_ERR_UNREACHABLE] {
            let p = status_ptr(s);
            assert!(ucs_ptr_is_err(p));
            assert!(!ucs_ptr_is_ptr(p));
            assert_eq!(ucs_ptr_status(p), s);
        }
    }

    #[test]
    fn real_pointers_are_in_progress() {
        let x = 5u64;
        let p = (&x as *const u64).cast::<c_void>();
        assert!(ucs_ptr_is_ptr(p));
        assert!(!ucs_ptr_is_err(p));
        assert_eq!(ucs_ptr_status(p), UCS_INPROGRESS);
    }
}
