//! `--device cpu|cuda[:N][,cuda:M…]`: which backend a command runs its model on. Model code
//! is generic over the backend; [`Device::run`] opens the device(s) and calls a
//! [`WithBackend`] body with a [`RankDevices`] that places a layout's ranks on them.

use anyhow::{anyhow, bail, Result};
use tandem_engine::backend::HybridOps;
use tandem_engine::{Backend, CpuBackend};

/// The most GPUs one `--device` list names.
pub const MAX_GPUS: usize = 16;

/// CUDA devices in rank order: a layout's rank `r` runs on the `(r mod n)`-th.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Gpus {
    ordinals: [u16; MAX_GPUS],
    len: u8,
}

impl Gpus {
    /// One GPU.
    pub fn one(ordinal: usize) -> Self {
        let mut ordinals = [0; MAX_GPUS];
        ordinals[0] = ordinal as u16;
        Self { ordinals, len: 1 }
    }

    /// The ordinals, in rank order.
    pub fn ordinals(&self) -> impl Iterator<Item = usize> + '_ {
        self.ordinals[..self.len as usize]
            .iter()
            .map(|&o| o as usize)
    }

    fn push(&mut self, ordinal: usize) -> std::result::Result<(), String> {
        if self.ordinals().any(|o| o == ordinal) {
            return Err(format!("cuda:{ordinal} is listed twice"));
        }
        if self.len as usize == MAX_GPUS {
            return Err(format!("at most {MAX_GPUS} GPUs in one --device list"));
        }
        let ordinal =
            u16::try_from(ordinal).map_err(|_| format!("cuda:{ordinal}: no such ordinal"))?;
        self.ordinals[self.len as usize] = ordinal;
        self.len += 1;
        Ok(())
    }
}

/// A device named on the command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Device {
    /// The host CPU (always available).
    #[default]
    Cpu,
    /// One or more CUDA devices.
    Cuda(Gpus),
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(g) => {
                let names: Vec<String> = g.ordinals().map(|o| format!("cuda:{o}")).collect();
                f.write_str(&names.join(","))
            }
        }
    }
}

/// clap's parser for `--device`: `cpu`, `cuda`, `cuda:N`, or a comma-separated list of GPUs
/// (`cuda:0,cuda:1` or `cuda:0,1`) that a layout's ranks are spread over.
pub fn parse(s: &str) -> std::result::Result<Device, String> {
    if s == "cpu" {
        return Ok(Device::Cpu);
    }
    let bad = || format!("{s:?}: expected cpu, cuda, cuda:N or a list such as cuda:0,cuda:1");
    let mut gpus: Option<Gpus> = None;
    for part in s.split(',').map(str::trim) {
        let ordinal = match tandem_cuda::parse_device(part) {
            Some(o) => o,
            // A bare ordinal continues a list that began with a GPU.
            None if gpus.is_some() => part.parse().map_err(|_| bad())?,
            None => return Err(bad()),
        };
        match &mut gpus {
            None => gpus = Some(Gpus::one(ordinal)),
            Some(g) => g.push(ordinal).map_err(|e| format!("{s:?}: {e}"))?,
        }
    }
    gpus.map(Device::Cuda).ok_or_else(bad)
}

/// The opened devices a layout's ranks are placed on: rank `r` on the `(r mod n)`-th, the
/// first rank on each device on the handle opened, every later one on a stream of its own
/// there ([`Backend::new_stream`]). Ranks on distinct GPUs meet through the backend's group
/// communicators ([`Backend::group_comms`]: NCCL), ranks sharing one in its memory.
pub struct RankDevices<B> {
    devices: Vec<B>,
}

impl<B: Backend> RankDevices<B> {
    /// `devices` in rank order; at least one.
    pub fn new(devices: Vec<B>) -> Self {
        assert!(!devices.is_empty(), "a rank needs a device");
        Self { devices }
    }

    /// The one device of a command that runs on one (benchmarks of one rank's work); an
    /// error naming `what` where several were given.
    pub fn single(&self, what: &str) -> Result<B> {
        if self.devices.len() > 1 {
            bail!(
                "{what} runs on one device; give --device a single one (not {} of them)",
                self.devices.len()
            );
        }
        Ok(self.devices[0].clone())
    }

    /// Rank `r`'s backend.
    pub fn rank(&self, r: usize) -> tandem_engine::Result<B> {
        let (device, own_stream) = place(r, self.devices.len());
        if own_stream {
            self.devices[device].new_stream()
        } else {
            Ok(self.devices[device].clone())
        }
    }
}

/// Where rank `r` of a layout runs among `n` devices: the device's index, and whether it
/// needs a stream of its own (an earlier rank already holds the opened handle).
fn place(r: usize, n: usize) -> (usize, bool) {
    (r % n, r >= n)
}

/// A computation written once over any backend.
pub trait WithBackend {
    /// What it produces.
    type Out;
    /// Runs on `devices`.
    fn run<B: HybridOps>(self, devices: RankDevices<B>) -> Result<Self::Out>;
}

impl Device {
    /// Opens the device(s) (a one-line error where one cannot be used) and runs `body` on
    /// them.
    pub fn run<W: WithBackend>(self, body: W) -> Result<W::Out> {
        match self {
            Device::Cpu => body.run(RankDevices::new(vec![CpuBackend::new()])),
            Device::Cuda(gpus) => {
                let devices = gpus
                    .ordinals()
                    .map(|n| {
                        tandem_cuda::CudaBackend::new(n)
                            .map_err(|e| anyhow!("--device cuda:{n}: {e}"))
                    })
                    .collect::<Result<Vec<_>>>()?;
                body.run(RankDevices::new(devices))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_lists_parse_and_print_back() {
        assert_eq!(parse("cpu"), Ok(Device::Cpu));
        assert_eq!(parse("cuda"), Ok(Device::Cuda(Gpus::one(0))));
        for (given, printed) in [
            ("cuda:1", "cuda:1"),
            ("cuda:0,cuda:1", "cuda:0,cuda:1"),
            ("cuda:2,0, 1", "cuda:2,cuda:0,cuda:1"),
        ] {
            let d = parse(given).expect("a device list");
            assert_eq!(d.to_string(), printed);
            assert_eq!(parse(&d.to_string()), Ok(d), "{given} round-trips");
        }
        let Ok(Device::Cuda(g)) = parse("cuda:3,cuda:1") else {
            panic!("a list of two GPUs")
        };
        assert_eq!(g.ordinals().collect::<Vec<_>>(), [3, 1], "rank order kept");
        for bad in [
            "gpu",
            "cuda:x",
            "1,cuda:0",
            "cuda:0,cpu",
            "cuda:0,cuda:0",
            "",
        ] {
            assert!(parse(bad).is_err(), "{bad:?} is refused");
        }
        let seventeen: Vec<String> = (0..17).map(|o| format!("cuda:{o}")).collect();
        assert!(parse(&seventeen.join(",")).is_err());
    }

    #[test]
    fn ranks_go_round_robin_over_the_devices() {
        let placed: Vec<_> = (0..5).map(|r| place(r, 2)).collect();
        assert_eq!(
            placed,
            [(0, false), (1, false), (0, true), (1, true), (0, true)]
        );
        assert_eq!(
            place(3, 1),
            (0, true),
            "one device: every rank after the first streams"
        );
        let devices = RankDevices::new(vec![CpuBackend::new(), CpuBackend::new()]);
        devices.rank(4).expect("a CPU rank opens");
        assert!(devices.single("the bench").is_err());
        assert!(RankDevices::new(vec![CpuBackend::new()])
            .single("x")
            .is_ok());
    }
}
