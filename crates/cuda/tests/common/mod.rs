//! What the CUDA test executables share.

use tandem_cuda::CudaBackend;

/// Helpers of the KDA-hybrid op tests.
pub mod hybrid;

/// The GPU, or `None` (the test passes) where this machine has none. Any other failure to
/// start fails the test, and `TANDEM_REQUIRE_GPU=1` (set by the GPU run) fails it there too.
pub fn gpu() -> Option<CudaBackend> {
    match CudaBackend::new(0) {
        Ok(b) => Some(b),
        Err(e @ (tandem_cuda::Error::Unavailable(_) | tandem_cuda::Error::NoSuchDevice { .. }))
            if std::env::var_os("TANDEM_REQUIRE_GPU").is_none() =>
        {
            eprintln!("skipping: no usable GPU ({e})");
            None
        }
        Err(e) => panic!("CUDA backend did not start: {e}"),
    }
}
