//! One-sided puts: memory a peer may write ([`MemoryRegion`], packed into a remote key for
//! it), the peer's view of that key ([`RemoteKey`]), and puts, flushes and 64-bit
//! compare-and-swaps on an [`Endpoint`].

use std::ffi::c_void;
use std::ptr;
use std::rc::Rc;

use tandem_ucx_sys as sys;

use crate::context::Context;
use crate::endpoint::Endpoint;
use crate::error::{check, Result};
use crate::request::{start_send, SendOp};
use crate::worker::WorkerInner;

/// Memory registered with a context (`ucp_mem_map`) so peers can put into it; unregistered
/// when dropped. The memory itself belongs to whoever registered it.
pub struct MemoryRegion {
    handle: sys::ucp_mem_h,
    address: u64,
    len: usize,
    context: Context,
}

impl MemoryRegion {
    /// Registers `len` bytes at `address`.
    ///
    /// # Safety
    /// The memory must stay allocated (and not be registered for another purpose that frees
    /// it) for as long as the region lives; peers holding its remote key may write into it at
    /// any time until then.
    pub unsafe fn map(context: &Context, address: *mut u8, len: usize) -> Result<MemoryRegion> {
        let params = sys::ucp_mem_map_params {
            field_mask: u64::from(
                sys::UCP_MEM_MAP_PARAM_FIELD_ADDRESS | sys::UCP_MEM_MAP_PARAM_FIELD_LENGTH,
            ),
            address: address.cast(),
            length: len,
            ..Default::default()
        };
        let mut handle = ptr::null_mut();
        // SAFETY: the context is alive; `params` marks only address and length valid; the
        // caller keeps the memory alive for the region's lifetime.
        let status = unsafe { sys::ucp_mem_map(context.handle(), &params, &mut handle) };
        check("ucp_mem_map", status)?;
        Ok(MemoryRegion {
            handle,
            address: address as u64,
            len,
            context: context.clone(),
        })
    }

    /// The remote key a peer unpacks ([`RemoteKey::unpack`]) to put into this region.
    pub fn packed_key(&self) -> Result<Vec<u8>> {
        let mut buffer: *mut c_void = ptr::null_mut();
        let mut size = 0usize;
        // SAFETY: the context and the memory handle are alive; both out-pointers are valid.
        let status = unsafe {
            sys::ucp_rkey_pack(self.context.handle(), self.handle, &mut buffer, &mut size)
        };
        check("ucp_rkey_pack", status)?;
        // SAFETY: UCX returned `size` readable bytes at `buffer`, ours until released below.
        let key = unsafe { std::slice::from_raw_parts(buffer.cast::<u8>(), size) }.to_vec();
        // SAFETY: `buffer` came from ucp_rkey_pack and is released once.
        unsafe { sys::ucp_rkey_buffer_release(buffer) };
        Ok(key)
    }

    /// The region's first address (what a peer puts to, plus an offset).
    pub fn address(&self) -> u64 {
        self.address
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        // SAFETY: the handle came from ucp_mem_map on this context, unmapped once.
        let status = unsafe { sys::ucp_mem_unmap(self.context.handle(), self.handle) };
        if status != sys::UCS_OK {
            tracing::warn!(status = %crate::status_text(status), "ucp_mem_unmap failed");
        }
    }
}

/// A peer's [`MemoryRegion`] as seen through one endpoint (`ucp_ep_rkey_unpack`). Drop it
/// before the endpoint it was unpacked on.
pub struct RemoteKey {
    handle: sys::ucp_rkey_h,
    _worker: Rc<WorkerInner>,
}

impl RemoteKey {
    /// Unpacks `packed` (from [`MemoryRegion::packed_key`]) for puts through `ep`.
    pub fn unpack(ep: &Endpoint, packed: &[u8]) -> Result<RemoteKey> {
        let mut handle = ptr::null_mut();
        // SAFETY: the endpoint is open; `packed` is read during the call only.
        let status =
            unsafe { sys::ucp_ep_rkey_unpack(ep.handle(), packed.as_ptr().cast(), &mut handle) };
        check("ucp_ep_rkey_unpack", status)?;
        Ok(RemoteKey {
            handle,
            _worker: ep.worker_inner(),
        })
    }
}

impl Drop for RemoteKey {
    fn drop(&mut self) {
        // SAFETY: the handle came from ucp_ep_rkey_unpack, destroyed once.
        unsafe { sys::ucp_rkey_destroy(self.handle) };
    }
}

impl Endpoint {
    /// Writes `data` to `remote_address` in the peer's region that `key` describes
    /// (`ucp_put_nbx`). Completion means the data left this side's buffer; a
    /// [`Endpoint::flush`] after it completes once the data is in the peer's memory.
    pub fn put(&self, data: Vec<u8>, remote_address: u64, key: &RemoteKey) -> Result<SendOp> {
        // SAFETY: endpoint open and key alive; UCX gets the operation's own buffer and
        // parameters.
        unsafe {
            start_send("ucp_put_nbx", Some(data), |buf, len, param| {
                sys::ucp_put_nbx(self.handle(), buf, len, remote_address, key.handle, param)
            })
        }
    }

    /// Atomically replaces the 8-byte word at `remote_address` (8-aligned, in the peer's
    /// region that `key` describes) with `swap` if it holds `compare`
    /// (`ucp_atomic_op_nbx`, `UCP_ATOMIC_OP_CSWAP`); the operation yields the word's old
    /// value, so it succeeded exactly when that equals `compare`. Native byte order on both
    /// sides (one architecture per cluster).
    pub fn compare_swap(
        &self,
        remote_address: u64,
        key: &RemoteKey,
        compare: u64,
        swap: u64,
    ) -> Result<AtomicOp> {
        // One buffer: the compare value (UCX's operand), then the reply word (the value to
        // write going in, the old value coming back): `Result = Y; if (X == Y) Y = Z`.
        let mut buf = compare.to_ne_bytes().to_vec();
        buf.extend_from_slice(&swap.to_ne_bytes());
        // SAFETY: endpoint open and key alive; UCX reads the operand at `value`, and reads and
        // writes the reply word at `value + 8`, both inside the operation's 16-byte buffer
        // that lives until the callback.
        let op = unsafe {
            start_send("ucp_atomic_op_nbx", Some(buf), |value, _len, param| {
                let mut param = *param;
                param.op_attr_mask |=
                    sys::UCP_OP_ATTR_FIELD_DATATYPE | sys::UCP_OP_ATTR_FIELD_REPLY_BUFFER;
                param.datatype = (8 << sys::UCP_DATATYPE_SHIFT) | sys::UCP_DATATYPE_CONTIG as u64;
                param.reply_buffer = value.cast::<u8>().add(8).cast_mut().cast();
                sys::ucp_atomic_op_nbx(
                    self.handle(),
                    sys::UCP_ATOMIC_OP_CSWAP,
                    value,
                    1,
                    remote_address,
                    key.handle,
                    &param,
                )
            })
        }?;
        Ok(AtomicOp { op })
    }

    /// Completes once every put issued on this endpoint before it is in the peer's memory
    /// (`ucp_ep_flush_nbx`).
    pub fn flush(&self) -> Result<SendOp> {
        // SAFETY: endpoint open; UCX gets the operation's parameters (no buffer).
        unsafe {
            start_send("ucp_ep_flush_nbx", None, |_, _, param| {
                sys::ucp_ep_flush_nbx(self.handle(), param)
            })
        }
    }
}

/// A compare-and-swap in flight ([`Endpoint::compare_swap`]).
pub struct AtomicOp {
    op: SendOp,
}

impl AtomicOp {
    /// `None` while in flight; then the word's value before the operation, or the error UCX
    /// completed it with.
    pub fn result(&self) -> Option<Result<u64>> {
        let done = self.op.state.status()?;
        Some(
            crate::request::status_result("ucp_atomic_op_nbx", done).map(|()| {
                let p = self.op.state.buffer_ptr();
                // SAFETY: the operation completed, so UCX wrote the reply word, the second
                // 8 bytes of the operation's own 16-byte buffer (still held by its state).
                unsafe { std::ptr::read_unaligned(p.add(8).cast::<u64>()) }
            }),
        )
    }
}
