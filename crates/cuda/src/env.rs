//! The environment variables the CUDA backend reads (for profiling and A/B measurements; the
//! defaults are what serving runs).

/// `TANDEM_CUDA_GRAPHS=0`: run every step eagerly (no CUDA graphs), e.g. to profile kernels.
pub(crate) fn graphs() -> bool {
    std::env::var("TANDEM_CUDA_GRAPHS").map_or(true, |v| v != "0")
}

/// `TANDEM_CUDA_TRACED_STEPS=0`: KDA-hybrid decode steps run eagerly instead of being traced
/// and replayed as CUDA graphs (trace.rs); `TANDEM_CUDA_GRAPHS=0` turns tracing off too.
pub(crate) fn traced_steps() -> bool {
    graphs() && std::env::var("TANDEM_CUDA_TRACED_STEPS").map_or(true, |v| v != "0")
}

/// `TANDEM_CUDA_DEVICE_COLLECTIVES=0`: ranks of a layout sharing the GPU meet through host
/// memory instead of in device memory (device_comm.rs).
pub(crate) fn device_collectives() -> bool {
    std::env::var("TANDEM_CUDA_DEVICE_COLLECTIVES").map_or(true, |v| v != "0")
}

/// `TANDEM_CUDA_FP8_WEIGHTS=0`: block-FP8 weights (experts, MLA, dense MLPs) are dequantised
/// to the model's dtype at load instead of kept as FP8.
pub(crate) fn fp8_weights() -> bool {
    std::env::var("TANDEM_CUDA_FP8_WEIGHTS").map_or(true, |v| v != "0")
}

/// `TANDEM_CUDA_PDL=0`: launch kernels without programmatic dependencies.
pub(crate) fn programmatic_launches() -> bool {
    std::env::var("TANDEM_CUDA_PDL").map_or(true, |v| v != "0")
}

/// `TANDEM_CUDA_GEMV_ROWS=N` (1..=8, default 2): row counts up to N take the GEMV kernels for
/// bf16 weights, larger ones cuBLAS.
pub(crate) fn gemv_rows() -> usize {
    number("TANDEM_CUDA_GEMV_ROWS").map_or(DEFAULT_GEMV_ROWS, |n| n.clamp(1, 8))
}

/// Measured on an H200 (1B shape, one run): GEMV and cuBLAS tie at 2 rows, cuBLAS 1.25× faster
/// at 3 and 2.5× at 8.
const DEFAULT_GEMV_ROWS: usize = 2;

/// `TANDEM_CUDA_GEMV_BLOCKS_PER_SM=N` (default 2): GEMV grids of at most N blocks per SM,
/// each warp taking several features; 0: one warp per feature.
pub(crate) fn gemv_blocks_per_sm() -> usize {
    number("TANDEM_CUDA_GEMV_BLOCKS_PER_SM").unwrap_or(2)
}

/// `TANDEM_CUDA_ATTENTION_BLOCKS_PER_SM=N` (default 8): split decode attention until a step
/// has about N blocks per SM.
pub(crate) fn attention_blocks_per_sm() -> usize {
    number("TANDEM_CUDA_ATTENTION_BLOCKS_PER_SM")
        .unwrap_or(8)
        .max(1)
}

/// `TANDEM_CUDA_MOE_GROUPED_ROWS=N` (default 128): MoE steps of up to N tokens run their
/// experts as one grouped product on the device; larger ones (and all, with 0) gather, multiply
/// and scatter expert by expert, which reads the routing back to the host.
pub(crate) fn moe_grouped_rows() -> usize {
    number("TANDEM_CUDA_MOE_GROUPED_ROWS").unwrap_or(128)
}

fn number(name: &str) -> Option<usize> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

/// `TANDEM_CUDA_DECODE_ROPE=0`: decode steps run RoPE + the K/V write as their own kernel
/// instead of inside attention.
pub(crate) fn decode_rope() -> bool {
    std::env::var("TANDEM_CUDA_DECODE_ROPE").map_or(true, |v| v != "0")
}

/// `TANDEM_CUDA_KERNELS_FILE=PATH`: compile the kernels from this source file instead of the
/// built-in one (kernel experiments A/B'd on the GPU machine without a rebuild; the kernels'
/// names and parameters must be the built-in ones). `None` when unset.
pub(crate) fn kernels_file() -> Option<std::path::PathBuf> {
    std::env::var_os("TANDEM_CUDA_KERNELS_FILE").map(Into::into)
}

/// `TANDEM_CUDA_DELTA_CHUNKS=1|0`: whether prompts run the delta rule in its chunked form
/// (the chunked kernels) or token by token (the recurrent kernel). Default: the recurrent
/// kernel, which measured faster than the chunked kernels so far (docs/benchmarks.md,
/// session 30).
pub(crate) fn chunked_prompts() -> bool {
    std::env::var("TANDEM_CUDA_DELTA_CHUNKS").is_ok_and(|v| v == "1")
}

/// `TANDEM_CUDA_MLA_HEADS=4`: MLA decode attention takes four heads a block (reading each
/// cached latent once for the four) instead of one; not yet measured on a GPU, so off.
pub(crate) fn mla_heads_per_block() -> usize {
    match number("TANDEM_CUDA_MLA_HEADS") {
        Some(4) => 4,
        _ => 1,
    }
}
