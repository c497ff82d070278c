//! `--device cpu|cuda[:N]`: which backend a command runs its model on. Model code is generic
//! over the backend; [`Device::run`] opens the device and calls a [`WithBackend`] body with it.

use anyhow::{anyhow, Result};
use tandem_engine::backend::HybridOps;
use tandem_engine::CpuBackend;

/// A device named on the command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Device {
    /// The host CPU (always available).
    #[default]
    Cpu,
    /// CUDA device N.
    Cuda(usize),
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// clap's parser for `--device`.
pub fn parse(s: &str) -> std::result::Result<Device, String> {
    if s == "cpu" {
        return Ok(Device::Cpu);
    }
    tandem_cuda::parse_device(s)
        .map(Device::Cuda)
        .ok_or_else(|| format!("{s:?}: expected cpu, cuda or cuda:N"))
}

/// A computation written once over any backend.
pub trait WithBackend {
    /// What it produces.
    type Out;
    /// Runs on `backend`.
    fn run<B: HybridOps>(self, backend: B) -> Result<Self::Out>;
}

impl Device {
    /// Opens the device (a one-line error where it cannot be used) and runs `body` on it.
    pub fn run<W: WithBackend>(self, body: W) -> Result<W::Out> {
        match self {
            Device::Cpu => body.run(CpuBackend::new()),
            Device::Cuda(n) => {
                let backend = tandem_cuda::CudaBackend::new(n)
                    .map_err(|e| anyhow!("--device cuda:{n}: {e}"))?;
                body.run(backend)
            }
        }
    }
}
