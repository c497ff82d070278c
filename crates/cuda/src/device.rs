//! The device: context, stream, cuBLAS handle, the compiled kernels, and the
//! [`Backend`] half of the traits (allocation and typed transfers).

use crate::{Error, Result};
use cudarc::cublas::CudaBlas;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, LaunchConfig,
};
use parking_lot::Mutex;
use std::sync::Arc;
use tandem_engine::{Backend, DType, HostTensor, Tensor};

/// cuBLAS workspace bytes (what it asks for on Hopper).
const BLAS_WORKSPACE: usize = 32 << 20;

/// One tensor's bytes in device memory, with its address kept at hand for kernel arguments.
pub struct CudaStorage {
    /// The allocation it owns; `None` for a traced step's temporary, which borrows the step
    /// arena (trace.rs) until the next traced step begins.
    _owner: Option<CudaSlice<u8>>,
    ptr: u64,
    bytes: usize,
}

impl CudaStorage {
    /// The device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
    /// Bytes allocated.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
    /// `bytes` at `ptr` of memory someone else owns (a traced step's arena or staging).
    pub(crate) fn borrowed(ptr: u64, bytes: usize) -> Self {
        Self {
            _owner: None,
            ptr,
            bytes,
        }
    }
}

macro_rules! kernels {
    ($($name:ident),* $(,)?) => {
        /// Every kernel of `kernels.cu`, looked up once.
        pub(crate) struct Kernels { $(pub(crate) $name: CudaFunction,)* }
        impl Kernels {
            fn load(module: &Arc<CudaModule>) -> Result<Self> {
                Ok(Self { $($name: module.load_function(stringify!($name))?,)* })
            }
            /// The kernels' names.
            const NAMES: &'static [&'static str] = &[$(stringify!($name),)*];
        }
    };
}

kernels!(
    embed_f32,
    embed_bf16,
    rms_norm,
    rms_norm_to_bf16,
    rope,
    silu_mul,
    silu_mul_bf16,
    gather_rows,
    f32_to_bf16,
    write_kv_f32,
    write_kv_bf16,
    rope_write_kv_f32,
    rope_write_kv_bf16,
    copy_slots,
    gemv_bf16_1,
    gemv_bf16_2,
    gemv_bf16_3,
    gemv_bf16_4,
    gemv_bf16_5,
    gemv_bf16_6,
    gemv_bf16_7,
    gemv_bf16_8,
    gemv_norm_bf16_1,
    gemv_norm_bf16_2,
    gemv_norm_bf16_3,
    gemv_norm_bf16_4,
    gemv_norm_bf16_5,
    gemv_norm_bf16_6,
    gemv_norm_bf16_7,
    gemv_norm_bf16_8,
    gemv_norm_silu_bf16_1,
    gemv_norm_silu_bf16_2,
    gemv_norm_silu_bf16_3,
    gemv_norm_silu_bf16_4,
    gemv_norm_silu_bf16_5,
    gemv_norm_silu_bf16_6,
    gemv_norm_silu_bf16_7,
    gemv_norm_silu_bf16_8,
    gemv_fp8_1,
    gemv_fp8_2,
    gemv_fp8_3,
    gemv_fp8_4,
    gemv_fp8_5,
    gemv_fp8_6,
    gemv_fp8_7,
    gemv_fp8_8,
    pdl_probe,
    argmax_partial,
    sample_rows,
    prefill_attention_bf16_d64,
    prefill_attention_bf16_d128,
    prefill_attention_bf16_d64_b16,
    prefill_attention_bf16_d128_b16,
    copy_block,
    add_assign,
    sum_ranks,
    sigmoid_in_place,
    rms_norm_in_place_f32,
    rms_norm_in_place_bf16,
    layer_norm_in_place,
    l2_norm_in_place,
    kda_decay,
    gated_rms_norm_f32,
    gated_rms_norm_bf16,
    swiglu,
    scatter_add_rows,
    moe_route,
    moe_sort,
    moe_gate_up,
    moe_down,
    moe_gate_up_fp8,
    moe_down_fp8,
    fp8_to_bf16,
    moe_combine,
    mla_append,
    mla_attention,
    mla_attention_h4,
    hc_expand,
    hc_collapse,
    hc_merge,
    hc_mean,
    short_conv_f32,
    short_conv_bf16,
    delta_rule_d16,
    delta_rule_d32,
    delta_rule_d64,
    delta_rule_d128,
    delta_rule_d128_q2,
    delta_chunk_prep_d16,
    delta_chunk_prep_d32,
    delta_chunk_prep_d64,
    delta_chunk_prep_d128,
    delta_chunk_state_d16,
    delta_chunk_state_d32,
    delta_chunk_state_d64,
    delta_chunk_state_d128,
);

/// The fewest tokens of a step that takes the tensor-core prefill attention.
pub(crate) const PREFILL_TILE: usize = 64;
/// Dynamic shared memory the RMSNorm-fused GEMVs may use for their normalised rows.
const GEMV_SMEM: usize = 96 << 10;

/// Query heads per KV head the attention kernels are built for (1..=this).
pub(crate) const MAX_GROUP: usize = 8;
/// Head widths the attention kernels are built for.
pub(crate) const HEAD_DIMS: [usize; 2] = [64, 128];

/// The attention kernels, one per (cache dtype, group size, head width).
pub(crate) struct AttentionKernels(std::collections::HashMap<(DType, usize, usize), CudaFunction>);

impl AttentionKernels {
    fn variants() -> impl Iterator<Item = ((DType, usize, usize), String)> {
        [DType::F32, DType::BF16].into_iter().flat_map(|dtype| {
            (1..=MAX_GROUP).flat_map(move |group| {
                HEAD_DIMS.into_iter().map(move |d| {
                    (
                        (dtype, group, d),
                        format!("attention_{}_g{group}_d{d}", dtype.name()),
                    )
                })
            })
        })
    }

    fn load(module: &Arc<CudaModule>) -> Result<Self> {
        let mut map = std::collections::HashMap::new();
        for (key, name) in Self::variants() {
            map.insert(key, module.load_function(&name)?);
        }
        Ok(Self(map))
    }

    /// The kernel for a cache dtype, query heads per KV head and head width, if built.
    pub(crate) fn get(&self, dtype: DType, group: usize, head_dim: usize) -> Option<&CudaFunction> {
        self.0.get(&(dtype, group, head_dim))
    }
}

/// Every kernel the backend looks up in the compiled module.
pub fn kernel_names() -> Vec<String> {
    Kernels::NAMES
        .iter()
        .map(|n| n.to_string())
        .chain(AttentionKernels::variants().map(|(_, name)| name))
        .collect()
}

/// Buffers operations borrow for one call (bf16 copies of activations for cuBLAS, attention
/// partials and split counters, sampling parameters and ids); they grow to the largest use
/// and are then reused.
#[derive(Default)]
pub(crate) struct Scratch {
    pub(crate) bf16: Option<CudaStorage>,
    /// A prompt step's MLP: [gate | up] rows in bf16, and silu(gate)·up in bf16.
    pub(crate) mlp_gate_up: Option<CudaStorage>,
    pub(crate) mlp_act: Option<CudaStorage>,
    pub(crate) params: Option<CudaStorage>,
    pub(crate) ids: Option<CudaStorage>,
    pub(crate) attention: Option<CudaStorage>,
    /// Zeroed u32 per (token, kv head); the attention kernel leaves them zero.
    pub(crate) split_counters: Option<CudaStorage>,
    pub(crate) best: Option<CudaStorage>,
    /// A hybrid operation's host-built table (its sequences, an expert's rows and weights).
    pub(crate) hybrid_table: Option<CudaStorage>,
    /// The chunked delta rule's per-(chunk, head) workspace (delta_rule.rs).
    pub(crate) delta_work: Option<CudaStorage>,
    pub(crate) host_params: Vec<f32>,
    /// Buffers outgrown: recorded graphs of smaller shapes still use their addresses.
    pub(crate) retired: Vec<CudaStorage>,
}

pub(crate) struct Inner {
    pub(crate) ordinal: usize,
    pub(crate) device_name: String,
    pub(crate) arch: (i32, i32),
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
    pub(crate) blas: CudaBlas,
    _blas_workspace: CudaSlice<u8>,
    pub(crate) kernels: Kernels,
    pub(crate) attention: AttentionKernels,
    pub(crate) scratch: Mutex<Scratch>,
    /// Traced steps: the recording, its arena and staging, and the graphs replayed.
    pub(crate) trace: Mutex<crate::trace::Tracer>,
    /// Whether a traced step is under way (what every launch and allocation checks first).
    pub(crate) tracing: std::sync::atomic::AtomicBool,
    /// Whether steps may be traced and replayed (`TANDEM_CUDA_TRACED_STEPS`, or
    /// [`CudaBackend::set_traced_steps`]).
    pub(crate) trace_enabled: std::sync::atomic::AtomicBool,
    /// Whether block-FP8 weights are taken as FP8 ([`CudaBackend::set_fp8_weights`]).
    pub(crate) fp8_weights: std::sync::atomic::AtomicBool,
    /// Streaming multiprocessors.
    pub(crate) sms: usize,
    /// Dynamic shared memory the RMSNorm-fused GEMVs may take.
    pub(crate) gemv_smem: usize,
    /// Row counts up to this take the GEMV kernels for bf16 weights.
    pub(crate) gemv_rows: usize,
    /// GEMV blocks per SM (0: a warp per feature).
    pub(crate) gemv_blocks_per_sm: usize,
    /// Decode attention blocks per SM that splitting aims at.
    pub(crate) attention_blocks_per_sm: usize,
    /// Whether kernels launch with programmatic dependencies (see kernels.cu).
    pdl: bool,
    /// Whether decode attention does the step's RoPE and K/V write itself.
    pub(crate) decode_rope: bool,
    /// MoE steps of up to this many tokens run their experts as one grouped product.
    pub(crate) moe_grouped_rows: usize,
    /// Whether the chunked delta-rule kernels could be set up (they need more than the
    /// default 48 KiB of shared memory; see delta_rule.rs): sequences asking for the chunked
    /// form take them.
    pub(crate) delta_chunks: bool,
    /// Whether prompts ask for the chunked form ([`tandem_engine::backend::HybridOps::prompt_form`]).
    pub(crate) chunked_prompts: bool,
}

/// A CUDA device running tandem's kernels. Cheap to clone (clones share the device).
#[derive(Clone)]
pub struct CudaBackend {
    pub(crate) inner: Arc<Inner>,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name())
    }
}

/// Panics with the operation's name on a driver error: inside a forward pass there is no
/// caller to hand it to, and a failed launch leaves the stream unusable anyway.
pub(crate) fn check<T, E: std::fmt::Display>(r: std::result::Result<T, E>, what: &str) -> T {
    match r {
        Ok(v) => v,
        Err(e) => panic!("CUDA {what}: {e}"),
    }
}

/// Why no CUDA device can be used here, if so: the driver and libraries load at run time.
pub fn unavailable() -> Option<String> {
    // SAFETY: these only try to open the shared libraries.
    let (driver, nvrtc, blas) = unsafe {
        (
            cudarc::driver::sys::is_culib_present(),
            cudarc::nvrtc::sys::is_culib_present(),
            cudarc::cublas::sys::is_culib_present(),
        )
    };
    if !driver {
        return Some("no CUDA driver on this machine (libcuda.so not found)".into());
    }
    let missing: Vec<&str> = [(nvrtc, "libnvrtc"), (blas, "libcublas")]
        .into_iter()
        .filter(|(present, _)| !present)
        .map(|(_, name)| name)
        .collect();
    (!missing.is_empty()).then(|| {
        format!(
            "the CUDA driver is here but {} is not (install the CUDA toolkit libraries)",
            missing.join(" and ")
        )
    })
}

impl CudaBackend {
    /// This backend with bf16 products of up to `rows` (1..=8) activation rows on the GEMV
    /// kernels and larger ones on cuBLAS (the default comes from `TANDEM_CUDA_GEMV_ROWS`).
    /// Only a backend not yet cloned can be changed; a clone is returned unchanged.
    pub fn with_gemv_rows(mut self, rows: usize) -> Self {
        if let Some(inner) = Arc::get_mut(&mut self.inner) {
            inner.gemv_rows = rows.clamp(1, 8);
        }
        self
    }

    /// Opens device `ordinal`: creates a stream, a cuBLAS handle and compiles (or loads
    /// cached) kernels for its architecture.
    pub fn new(ordinal: usize) -> Result<Self> {
        if let Some(why) = unavailable() {
            return Err(Error::Unavailable(why));
        }
        let count = CudaContext::device_count()? as usize;
        if ordinal >= count {
            return Err(Error::NoSuchDevice { ordinal, count });
        }
        let ctx = CudaContext::new(ordinal)?;
        // One stream per device and no cross-stream sharing: cudarc's per-buffer events
        // would only add work (and cannot be recorded inside a graph capture).
        // SAFETY: every buffer of this backend is used on `stream` only.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream()?;
        let blas = CudaBlas::new(stream.clone())?;
        // A workspace of its own, so cuBLAS never allocates inside a graph capture.
        let blas_workspace = stream.alloc_zeros::<u8>(BLAS_WORKSPACE)?;
        {
            let (ws, _) = blas_workspace.device_ptr(&stream);
            // SAFETY: the handle and buffer are live; the buffer outlives the handle (both
            // are fields of `Inner`, the buffer declared after it is dropped after it).
            let status = unsafe {
                cudarc::cublas::sys::cublasSetWorkspace_v2(
                    *blas.handle(),
                    ws as *mut std::ffi::c_void,
                    BLAS_WORKSPACE,
                )
            };
            status.result()?;
        }
        let arch = ctx.compute_capability()?;
        let source = match crate::env::kernels_file() {
            None => std::borrow::Cow::Borrowed(crate::compile::KERNELS),
            Some(path) => {
                let text = std::fs::read_to_string(&path).map_err(|e| {
                    Error::Compile(format!("TANDEM_CUDA_KERNELS_FILE {}: {e}", path.display()))
                })?;
                tracing::warn!(file = %path.display(), "CUDA kernels from TANDEM_CUDA_KERNELS_FILE, not the built-in source");
                std::borrow::Cow::Owned(text)
            }
        };
        let bin = crate::compile::cubin(&source, arch)?;
        let module = ctx.load_module(cudarc::nvrtc::Ptx::from_binary(bin))?;
        let kernels = Kernels::load(&module)?;
        let attention = AttentionKernels::load(&module)?;
        let device_name = ctx.name()?;
        let sms = ctx.attribute(
            cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        )? as usize;
        let gemv_smem = gemv_shared_memory(&kernels);
        let delta_chunks = crate::delta_rule::chunk_shared_memory(&kernels);
        let chunked_prompts = delta_chunks && crate::env::chunked_prompts();
        let pdl = crate::env::programmatic_launches() && arch.0 >= 9 && {
            match probe_programmatic_launches(&ctx, &stream, &kernels.pdl_probe) {
                Ok(()) => true,
                Err(why) => {
                    tracing::warn!(%why, "programmatic dependent launches unavailable");
                    false
                }
            }
        };
        tracing::debug!(sms, gemv_smem, pdl, "CUDA device ready");
        Ok(Self {
            inner: Arc::new(Inner {
                ordinal,
                device_name,
                arch,
                ctx,
                stream,
                blas,
                _blas_workspace: blas_workspace,
                kernels,
                attention,
                scratch: Mutex::new(Scratch::default()),
                trace: Mutex::new(crate::trace::Tracer::default()),
                tracing: std::sync::atomic::AtomicBool::new(false),
                trace_enabled: std::sync::atomic::AtomicBool::new(crate::env::traced_steps()),
                fp8_weights: std::sync::atomic::AtomicBool::new(crate::env::fp8_weights()),
                sms,
                gemv_smem,
                gemv_rows: crate::env::gemv_rows(),
                gemv_blocks_per_sm: crate::env::gemv_blocks_per_sm(),
                attention_blocks_per_sm: crate::env::attention_blocks_per_sm(),
                decode_rope: crate::env::decode_rope(),
                moe_grouped_rows: crate::env::moe_grouped_rows(),
                delta_chunks,
                chunked_prompts,
                pdl,
            }),
        })
    }

    /// Whether kernels launch with programmatic dependencies.
    pub fn programmatic_launches(&self) -> bool {
        self.inner.pdl
    }

    /// The device's compute capability.
    pub fn arch(&self) -> (i32, i32) {
        self.inner.arch
    }

    /// The stream every operation runs on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.inner.stream
    }

    /// `(free, total)` device memory in bytes.
    pub fn memory(&self) -> (usize, usize) {
        check(self.inner.ctx.mem_get_info(), "memory info")
    }

    pub(crate) fn alloc(&self, bytes: usize) -> CudaStorage {
        // Never zero bytes: every tensor has an address (and 16-byte vector loads stay in
        // bounds of something allocated).
        let buf = check(
            self.inner.stream.alloc_zeros::<u8>(bytes.max(16)),
            "allocation",
        );
        let (ptr, _) = buf.device_ptr(&self.inner.stream);
        assert!(
            ptr % 16 == 0,
            "device allocation at {ptr:#x} not 16-byte aligned"
        );
        CudaStorage {
            bytes: buf.len(),
            _owner: Some(buf),
            ptr,
        }
    }

    /// A zeroed buffer for a tensor: from the step arena inside a traced step, else its own
    /// allocation.
    fn alloc_tensor(&self, bytes: usize) -> CudaStorage {
        if self.traced() {
            return self.arena_zeros(bytes);
        }
        self.alloc(bytes)
    }

    /// A scratch buffer of at least `bytes` (zeroed when new), reallocated only when it must
    /// grow. An outgrown buffer is kept: graphs recorded over it replay later.
    pub(crate) fn ensure(
        &self,
        retired: &mut Vec<CudaStorage>,
        slot: &mut Option<CudaStorage>,
        bytes: usize,
    ) -> u64 {
        if slot.as_ref().is_none_or(|s| s.bytes() < bytes) {
            if let Some(old) = slot.replace(self.alloc(bytes.next_power_of_two())) {
                retired.push(old);
            }
        }
        slot.as_ref().map_or(0, CudaStorage::ptr)
    }

    pub(crate) fn htod(&self, dst: &mut CudaStorage, bytes: &[u8]) {
        assert!(
            bytes.len() <= dst.bytes(),
            "host copy larger than its buffer"
        );
        if self.traced() {
            return self.staged_copy(dst.ptr(), bytes);
        }
        self.htod_now(dst.ptr(), bytes);
    }

    /// Copies `bytes` to device address `dst` on the stream (the host buffer may be reused as
    /// soon as this returns: pageable memory is staged by the driver before the call returns).
    pub(crate) fn htod_now(&self, dst: u64, bytes: &[u8]) {
        if bytes.is_empty() {
            return;
        }
        check(self.inner.ctx.bind_to_thread(), "context");
        // SAFETY: the caller's buffer at `dst` holds at least `bytes.len()` bytes.
        let r = unsafe {
            cudarc::driver::result::memcpy_htod_async(dst, bytes, self.inner.stream.cu_stream())
        };
        check(r, "host-to-device copy");
    }

    pub(crate) fn dtoh(&self, src: &CudaStorage, bytes: usize) -> Vec<u8> {
        assert!(bytes <= src.bytes(), "device copy larger than its buffer");
        // A traced step's deferred work must run before its results are read.
        self.break_trace("a download");
        let mut out = vec![0u8; bytes];
        if bytes == 0 {
            return out;
        }
        check(self.inner.ctx.bind_to_thread(), "context");
        // SAFETY: `src` holds at least `bytes` bytes and `out` is `bytes` long; the stream is
        // synchronised before `out` is read.
        let r = unsafe {
            cudarc::driver::result::memcpy_dtoh_async(
                &mut out[..],
                src.ptr(),
                self.inner.stream.cu_stream(),
            )
        };
        check(r, "device-to-host copy");
        check(self.inner.stream.synchronize(), "synchronize");
        out
    }

    /// Launches `f` on the stream with `args`, in the order of the kernel's parameters (or
    /// records the launch, inside a traced step).
    pub(crate) fn launch(&self, f: &CudaFunction, cfg: LaunchConfig, args: &[Arg]) {
        self.submit(crate::trace::Op::Kernel(crate::trace::KernelOp::new(
            f.cu_function(),
            cfg,
            args,
            self.inner.pdl,
        )));
    }

    /// Queues a kernel launch on the stream now.
    pub(crate) fn launch_now(&self, k: &crate::trace::KernelOp) {
        check(self.inner.ctx.bind_to_thread(), "context");
        // SAFETY: every kernel op was made from a call site passing the argument list of its
        // kernel's signature in kernels.cu, with buffers sized by the callers' assertions.
        let r = unsafe { launch_words(&self.inner.stream, k) };
        check(r, "kernel launch");
    }
}

/// Launches `f` on `stream`; with `programmatic`, it may start before the kernel ahead of it
/// has finished (every kernel waits for that in `pdl_start`, kernels.cu).
///
/// # Safety
/// `args` must be the kernel's parameters in order, and the memory they point to sized for
/// the launch.
unsafe fn launch_on(
    stream: &CudaStream,
    f: &CudaFunction,
    cfg: LaunchConfig,
    args: &[Arg],
    programmatic: bool,
) -> std::result::Result<(), cudarc::driver::DriverError> {
    let k = crate::trace::KernelOp::new(f.cu_function(), cfg, args, programmatic);
    // SAFETY: as the caller promises.
    unsafe { launch_words(stream, &k) }
}

/// Launches the kernel `k` describes on `stream`.
///
/// # Safety
/// `k`'s words must be its kernel's parameters in order, and the memory they point to sized
/// for the launch.
unsafe fn launch_words(
    stream: &CudaStream,
    k: &crate::trace::KernelOp,
) -> std::result::Result<(), cudarc::driver::DriverError> {
    use cudarc::driver::sys;
    // Each argument lives in a 64-bit word; the driver reads as many bytes as the
    // parameter's type has (little-endian, so 32-bit values sit in the low half).
    let mut words = k.words;
    let mut params: [*mut std::ffi::c_void; crate::trace::MAX_ARGS] =
        [std::ptr::null_mut(); crate::trace::MAX_ARGS];
    for (p, w) in params.iter_mut().zip(words.iter_mut()) {
        *p = (w as *mut u64).cast();
    }
    let f = k.function();
    let n = usize::from(k.args);
    if !k.programmatic {
        // SAFETY: as the caller promises.
        return unsafe {
            cudarc::driver::result::launch_kernel(
                f,
                k.grid,
                k.block,
                k.shared_mem_bytes,
                stream.cu_stream(),
                &mut params[..n],
            )
        };
    }
    // SAFETY: a plain-data C struct (an id and a union of plain values); all zeros is valid.
    let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.programmaticStreamSerializationAllowed = 1;
    let config = sys::CUlaunchConfig {
        gridDimX: k.grid.0,
        gridDimY: k.grid.1,
        gridDimZ: k.grid.2,
        blockDimX: k.block.0,
        blockDimY: k.block.1,
        blockDimZ: k.block.2,
        sharedMemBytes: k.shared_mem_bytes,
        hStream: stream.cu_stream(),
        attrs: &mut attr,
        numAttrs: 1,
    };
    // SAFETY: `config` and `attr` outlive the call; the parameters as the caller promises.
    unsafe { sys::cuLaunchKernelEx(&config, f, params.as_mut_ptr(), std::ptr::null_mut()) }.result()
}

/// Lets the RMSNorm-fused GEMVs take up to [`GEMV_SMEM`] of dynamic shared memory; where the
/// device refuses, they keep the default 48 KiB.
fn gemv_shared_memory(k: &Kernels) -> usize {
    use cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES as MAX_DYNAMIC;
    let all = [
        &k.gemv_norm_bf16_1,
        &k.gemv_norm_bf16_2,
        &k.gemv_norm_bf16_3,
        &k.gemv_norm_bf16_4,
        &k.gemv_norm_bf16_5,
        &k.gemv_norm_bf16_6,
        &k.gemv_norm_bf16_7,
        &k.gemv_norm_bf16_8,
        &k.gemv_norm_silu_bf16_1,
        &k.gemv_norm_silu_bf16_2,
        &k.gemv_norm_silu_bf16_3,
        &k.gemv_norm_silu_bf16_4,
        &k.gemv_norm_silu_bf16_5,
        &k.gemv_norm_silu_bf16_6,
        &k.gemv_norm_silu_bf16_7,
        &k.gemv_norm_silu_bf16_8,
    ];
    if all
        .iter()
        .all(|f| f.set_attribute(MAX_DYNAMIC, GEMV_SMEM as i32).is_ok())
    {
        GEMV_SMEM
    } else {
        48 << 10
    }
}

/// Two programmatic launches of a counting kernel, eagerly and captured in a graph: whether
/// the driver takes them (CUDA 12.3 or later for graphs) and they count to four.
fn probe_programmatic_launches(
    ctx: &Arc<CudaContext>,
    stream: &Arc<CudaStream>,
    probe: &CudaFunction,
) -> std::result::Result<(), String> {
    use cudarc::driver::sys;
    let e = |what: &str, err: cudarc::driver::DriverError| format!("{what}: {err}");
    ctx.bind_to_thread().map_err(|err| e("context", err))?;
    let count = stream
        .alloc_zeros::<u32>(1)
        .map_err(|err| e("allocation", err))?;
    let (ptr, _) = count.device_ptr(stream);
    let cfg = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (32, 1, 1),
        shared_mem_bytes: 0,
    };
    let twice = || -> std::result::Result<(), cudarc::driver::DriverError> {
        for _ in 0..2 {
            // SAFETY: `pdl_probe(u32*)` gets a live one-word buffer.
            unsafe { launch_on(stream, probe, cfg, &[Arg::Ptr(ptr)], true) }?;
        }
        Ok(())
    };
    twice().map_err(|err| e("launch", err))?;
    stream
        .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(|err| e("begin capture", err))?;
    let launched = twice();
    let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0));
    launched.map_err(|err| e("launch in a capture", err))?;
    let graph = graph
        .map_err(|err| e("end capture", err))?
        .ok_or("the capture recorded nothing")?;
    graph.launch().map_err(|err| e("graph launch", err))?;
    stream.synchronize().map_err(|err| e("synchronize", err))?;
    let seen = stream
        .clone_dtoh(&count)
        .map_err(|err| e("copy back", err))?;
    match seen.first() {
        Some(4) => Ok(()),
        other => Err(format!("the probe counted {other:?}, not 4")),
    }
}

/// One kernel argument: a device address or a scalar.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Arg {
    /// A device pointer.
    Ptr(u64),
    /// `int`.
    I32(i32),
    /// `long`.
    I64(i64),
    /// `float`.
    F32(f32),
}

impl Arg {
    pub(crate) fn word(self) -> u64 {
        match self {
            Arg::Ptr(p) => p,
            Arg::I32(v) => u64::from(v as u32),
            Arg::I64(v) => v as u64,
            Arg::F32(v) => u64::from(v.to_bits()),
        }
    }
}

impl From<u64> for Arg {
    fn from(v: u64) -> Self {
        Arg::Ptr(v)
    }
}
impl From<i32> for Arg {
    fn from(v: i32) -> Self {
        Arg::I32(v)
    }
}
impl From<i64> for Arg {
    fn from(v: i64) -> Self {
        Arg::I64(v)
    }
}
impl From<f32> for Arg {
    fn from(v: f32) -> Self {
        Arg::F32(v)
    }
}

impl Backend for CudaBackend {
    type Storage = CudaStorage;
    type Graphs = crate::graph::StepGraphs;

    fn name(&self) -> String {
        format!(
            "cuda:{} ({}, sm_{}{})",
            self.inner.ordinal, self.inner.device_name, self.inner.arch.0, self.inner.arch.1
        )
    }

    /// A second backend on the same device: its own stream, cuBLAS handle, scratch buffers
    /// and module (the kernels come from the on-disk cache), so a rank thread never shares
    /// a stream's scratch with another.
    fn new_stream(&self) -> tandem_engine::Result<Self> {
        Self::new(self.inner.ordinal).map_err(|e| tandem_engine::Error::Device(e.to_string()))
    }

    /// Inside a traced step, from the step arena (valid until the next traced step begins).
    fn zeros(&self, dtype: DType, shape: &[usize]) -> Tensor<Self> {
        let n: usize = shape.iter().product();
        Tensor::from_storage(self.alloc_tensor(n * dtype.size()), dtype, shape)
    }

    /// Ranks sharing the GPU meet in device memory ([`crate::device_comm::SameDevice`]), or
    /// through host memory with `TANDEM_CUDA_DEVICE_COLLECTIVES=0`.
    fn in_process_comm(
        comm: tandem_topology::InProcessCommunicator,
    ) -> Box<dyn tandem_engine::backend::TensorComm<Self>> {
        if crate::env::device_collectives() {
            Box::new(crate::device_comm::SameDevice::new(comm))
        } else {
            Box::new(tandem_engine::backend::HostStaged(comm))
        }
    }

    /// Ranks all on one GPU meet as [`Backend::in_process_comm`] says; ranks with a GPU each
    /// through NCCL where it is installed; any other group (NCCL missing, or some ranks
    /// sharing a GPU and some not) through host memory.
    fn group_comms(
        members: &[Self],
        comms: Vec<tandem_topology::InProcessCommunicator>,
    ) -> Vec<Box<dyn tandem_engine::backend::TensorComm<Self>>> {
        crate::nccl::group_comms(members, comms)
    }

    fn zeros_lasting(&self, dtype: DType, shape: &[usize]) -> Tensor<Self> {
        let n: usize = shape.iter().product();
        Tensor::from_storage(self.alloc(n * dtype.size()), dtype, shape)
    }

    /// Inside a traced step, into the step's staging (valid until the next traced step).
    fn upload(&self, host: &HostTensor) -> Tensor<Self> {
        let bytes = host.to_le_bytes();
        if self.traced() {
            let s = CudaStorage::borrowed(self.stage(&bytes), bytes.len().max(16));
            return Tensor::from_storage(s, host.dtype(), host.shape());
        }
        let mut s = self.alloc(bytes.len());
        self.htod(&mut s, &bytes);
        Tensor::from_storage(s, host.dtype(), host.shape())
    }

    /// One buffer: the codes (padded to 16 bytes), then the tile scales, as the FP8 kernels
    /// read it (kernels.cu, "Block-FP8 weights"). 128-wide tiles and rows of whole 8-byte
    /// loads only; off with [`CudaBackend::set_fp8_weights`] or `TANDEM_CUDA_FP8_WEIGHTS=0`.
    fn upload_fp8_weight(&self, w: &tandem_engine::BlockFp8) -> Option<Tensor<Self>> {
        let fits = w.block == crate::moe::FP8_TILE
            && w.cols.is_multiple_of(8)
            && w.codes.len() == w.rows * w.cols
            && w.scales.len() == w.rows.div_ceil(w.block) * w.cols.div_ceil(w.block);
        if !fits || !self.fp8_weights() {
            return None;
        }
        let at = w.codes.len().next_multiple_of(16);
        let mut bytes = w.codes.clone();
        bytes.resize(at, 0);
        bytes.extend(w.scales.iter().flat_map(|s| s.to_le_bytes()));
        let mut s = self.alloc(bytes.len());
        self.htod(&mut s, &bytes);
        Some(Tensor::from_storage(s, DType::F8E4M3, &[w.rows, w.cols]))
    }

    fn download(&self, t: &Tensor<Self>) -> HostTensor {
        let bytes = self.dtoh(t.storage(), t.size_bytes());
        match HostTensor::from_le_bytes(t.dtype(), t.shape(), &bytes) {
            Ok(h) => h,
            Err(e) => panic!("download of {:?}: {e}", t.shape()),
        }
    }

    fn overwrite(&self, dst: &mut Tensor<Self>, src: &HostTensor) -> tandem_engine::Result<()> {
        if dst.dtype() != src.dtype() || dst.len() != src.len() {
            return Err(tandem_engine::Error::InvalidRequest(format!(
                "overwrite of a {} tensor of {} values with {} {}",
                dst.dtype(),
                dst.len(),
                src.len(),
                src.dtype()
            )));
        }
        self.htod(dst.storage_mut(), &src.to_le_bytes());
        Ok(())
    }

    fn write_u32(&self, dst: &mut Tensor<Self>, src: &[u32]) {
        assert!(src.len() <= dst.len(), "metadata larger than its buffer");
        self.htod(dst.storage_mut(), bytemuck::cast_slice(src));
    }

    fn synchronize(&self) {
        self.break_trace("a synchronize");
        check(self.inner.stream.synchronize(), "synchronize");
    }

    fn run_traced(&self, step: &mut dyn FnMut()) {
        self.trace_step(step);
    }

    fn run_step(
        &self,
        graphs: &mut Self::Graphs,
        shape: Option<tandem_engine::StepShape>,
        step: &mut dyn FnMut(),
    ) {
        self.run_recorded(graphs, shape, step);
    }
}
