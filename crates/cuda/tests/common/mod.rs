//! What the CUDA test executables share.

use tandem_cuda::CudaBackend;

/// Helpers of the KDA-hybrid op tests.
pub mod hybrid;

/// The tokens `engine` generates for `prompt` under `params`, each with its log-probabilities
/// (when asked for), up to the one that finishes.
#[allow(dead_code)] // only the engine tests use it
pub fn generated(
    engine: &tandem_engine::Engine,
    prompt: &[u32],
    params: &tandem_core::SamplingParams,
) -> Vec<(u32, Option<tandem_core::TokenLogprobs>)> {
    let mut rx = engine
        .submit(
            prompt.to_vec(),
            params.clone(),
            tandem_engine::SeqKind::Generate,
        )
        .expect("submitted");
    let mut out = Vec::new();
    while let Some(ev) = rx.blocking_recv() {
        if let tandem_engine::EngineEvent::Token {
            token_id,
            finish,
            logprobs,
        } = ev
        {
            out.push((token_id, logprobs));
            if finish.is_some() {
                break;
            }
        }
    }
    out
}

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
