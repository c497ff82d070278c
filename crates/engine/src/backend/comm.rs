//! Collectives over device tensors: what tensor-parallel model code (every family) calls
//! between its ranks. [`TensorComm`] is generic over the backend so a GPU communicator (NCCL)
//! implements it over device memory; ranks that are threads of one process meet through
//! [`tandem_topology::InProcessCommunicator`]: in place on the CPU's tensors, through host
//! memory ([`HostStaged`]) on a device without a communicator of its own
//! ([`super::Backend::in_process_comm`] picks).

use super::{Backend, CpuBackend};
use crate::tensor::Tensor;
use crate::{Error, Result};
use tandem_topology::{Communicator, InProcessCommunicator};

/// A group of ranks that run collectives on tensors of backend `B`. Every rank of the group
/// must make the same calls in the same order; a call fails (never hangs) when a peer has
/// failed or timed out.
pub trait TensorComm<B: Backend>: Send + Sync {
    /// This rank's index in the group.
    fn rank(&self) -> usize;
    /// Ranks in the group.
    fn size(&self) -> usize;
    /// Whether its collectives may be recorded into a step a backend replays (a CUDA graph):
    /// true only for one that works on device memory on the step's stream. One that reads
    /// tensors to the host (as [`HostStaged`] does) is not: a recorded copy would replay into
    /// a host buffer long freed, so a step with it runs eagerly.
    fn replayable(&self) -> bool {
        false
    }
    /// Replaces the first `elems` f32 values of `t` on every rank with their sum over ranks.
    fn all_reduce_sum(&self, backend: &B, t: &mut Tensor<B>, elems: usize) -> Result<()>;
    /// Writes every rank's first `elems` f32 values of `local`, in rank order, into the first
    /// `elems * size` values of `out`.
    fn all_gather(
        &self,
        backend: &B,
        local: &Tensor<B>,
        elems: usize,
        out: &mut Tensor<B>,
    ) -> Result<()>;
    /// Sums the first `elems * size` f32 values of `input` over ranks and writes this rank's
    /// `elems`-long chunk of the sum into `out`.
    fn reduce_scatter_sum(
        &self,
        backend: &B,
        input: &Tensor<B>,
        elems: usize,
        out: &mut Tensor<B>,
    ) -> Result<()>;
    /// Chunk `j` (`elems` f32 values) of `send` goes to rank `j`; chunk `i` of `recv` comes
    /// from rank `i`.
    fn all_to_all(
        &self,
        backend: &B,
        send: &Tensor<B>,
        elems: usize,
        recv: &mut Tensor<B>,
    ) -> Result<()>;
}

/// A host communicator over any backend's tensors: each collective reads the values back to
/// the host, runs there and writes the result into the tensor (two copies a call). How ranks
/// of one process on a device meet until a device communicator joins them.
pub struct HostStaged<C>(pub C);

impl<C: Communicator> HostStaged<C> {
    fn host<B: Backend>(b: &B, t: &Tensor<B>, n: usize, what: &str) -> Result<Vec<f32>> {
        let v = b.download(t).to_f32_vec();
        if v.len() < n {
            return Err(Error::Collective(format!("{what}: needs {n} f32 values")));
        }
        Ok(v)
    }

    /// Writes `values` over the first values of `t` (the rest read back to keep them).
    fn put<B: Backend>(b: &B, t: &mut Tensor<B>, values: &[f32], what: &str) -> Result<()> {
        let mut all = Self::host(b, t, values.len(), what)?;
        all[..values.len()].copy_from_slice(values);
        Self::write(b, t, all)
    }

    /// Writes all of `t`'s values.
    fn write<B: Backend>(b: &B, t: &mut Tensor<B>, all: Vec<f32>) -> Result<()> {
        let host = crate::tensor::HostTensor::from_f32(t.shape(), all)?;
        b.overwrite(t, &host)
    }
}

impl<B: Backend, C: Communicator + Send + Sync> TensorComm<B> for HostStaged<C> {
    fn rank(&self) -> usize {
        self.0.rank()
    }

    fn size(&self) -> usize {
        self.0.size()
    }

    fn all_reduce_sum(&self, b: &B, t: &mut Tensor<B>, elems: usize) -> Result<()> {
        let mut v = Self::host(b, t, elems, "all_reduce")?;
        self.0.all_reduce_sum(&mut v[..elems]).map_err(collective)?;
        // `v` holds the whole tensor already: no second read.
        Self::write(b, t, v)
    }

    fn all_gather(
        &self,
        b: &B,
        local: &Tensor<B>,
        elems: usize,
        out: &mut Tensor<B>,
    ) -> Result<()> {
        let v = Self::host(b, local, elems, "all_gather")?;
        let all = self.0.all_gather(&v[..elems]).map_err(collective)?;
        Self::put(b, out, &all, "all_gather output")
    }

    fn reduce_scatter_sum(
        &self,
        b: &B,
        input: &Tensor<B>,
        elems: usize,
        out: &mut Tensor<B>,
    ) -> Result<()> {
        let size = self.0.size();
        let v = Self::host(b, input, elems * size, "reduce_scatter")?;
        let mine = self
            .0
            .reduce_scatter_sum(&v[..elems * size])
            .map_err(collective)?;
        Self::put(b, out, &mine, "reduce_scatter output")
    }

    fn all_to_all(
        &self,
        b: &B,
        send: &Tensor<B>,
        elems: usize,
        recv: &mut Tensor<B>,
    ) -> Result<()> {
        let size = self.0.size();
        let v = Self::host(b, send, elems * size, "all_to_all")?;
        let chunks = v[..elems * size]
            .chunks_exact(elems.max(1))
            .map(<[f32]>::to_vec)
            .collect();
        let got = self.0.all_to_all(chunks).map_err(collective)?;
        Self::put(b, recv, &got.concat(), "all_to_all output")
    }
}

fn collective(e: tandem_topology::Error) -> Error {
    Error::Collective(e.to_string())
}

fn f32s<'a>(t: &'a Tensor<CpuBackend>, n: usize, what: &str) -> Result<&'a [f32]> {
    super::cpu::f32_slice(t)
        .filter(|s| s.len() >= n)
        .ok_or_else(|| Error::Collective(format!("{what}: needs {n} f32 values")))
}

fn f32s_mut<'a>(t: &'a mut Tensor<CpuBackend>, n: usize, what: &str) -> Result<&'a mut [f32]> {
    super::cpu::f32_slice_mut(t)
        .filter(|s| s.len() >= n)
        .ok_or_else(|| Error::Collective(format!("{what}: needs {n} f32 values")))
}

impl TensorComm<CpuBackend> for InProcessCommunicator {
    fn rank(&self) -> usize {
        Communicator::rank(self)
    }

    fn size(&self) -> usize {
        Communicator::size(self)
    }

    fn all_reduce_sum(
        &self,
        _: &CpuBackend,
        t: &mut Tensor<CpuBackend>,
        elems: usize,
    ) -> Result<()> {
        let buf = &mut f32s_mut(t, elems, "all_reduce")?[..elems];
        Communicator::all_reduce_sum(self, buf).map_err(collective)
    }

    fn all_gather(
        &self,
        _: &CpuBackend,
        local: &Tensor<CpuBackend>,
        elems: usize,
        out: &mut Tensor<CpuBackend>,
    ) -> Result<()> {
        let size = Communicator::size(self);
        let all = Communicator::all_gather(self, &f32s(local, elems, "all_gather")?[..elems])
            .map_err(collective)?;
        f32s_mut(out, elems * size, "all_gather output")?[..elems * size].copy_from_slice(&all);
        Ok(())
    }

    fn reduce_scatter_sum(
        &self,
        _: &CpuBackend,
        input: &Tensor<CpuBackend>,
        elems: usize,
        out: &mut Tensor<CpuBackend>,
    ) -> Result<()> {
        let size = Communicator::size(self);
        let mine = Communicator::reduce_scatter_sum(
            self,
            &f32s(input, elems * size, "reduce_scatter")?[..elems * size],
        )
        .map_err(collective)?;
        f32s_mut(out, elems, "reduce_scatter output")?[..elems].copy_from_slice(&mine);
        Ok(())
    }

    fn all_to_all(
        &self,
        _: &CpuBackend,
        send: &Tensor<CpuBackend>,
        elems: usize,
        recv: &mut Tensor<CpuBackend>,
    ) -> Result<()> {
        let size = Communicator::size(self);
        let chunks = f32s(send, elems * size, "all_to_all")?[..elems * size]
            .chunks_exact(elems.max(1))
            .map(<[f32]>::to_vec)
            .collect();
        let got = Communicator::all_to_all(self, chunks).map_err(collective)?;
        let out = f32s_mut(recv, elems * size, "all_to_all output")?;
        for (i, chunk) in got.iter().enumerate() {
            out[i * elems..(i + 1) * elems].copy_from_slice(chunk);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::HostTensor;

    #[test]
    fn cpu_tensor_collectives_match_their_definitions() {
        let size = 3;
        let comms = InProcessCommunicator::group(size, Some(std::time::Duration::from_secs(10)));
        let results: Vec<_> = std::thread::scope(|s| {
            let handles: Vec<_> = comms
                .into_iter()
                .map(|comm| {
                    s.spawn(move || {
                        let b = CpuBackend::new();
                        let r = Communicator::rank(&comm) as f32;
                        let vals: Vec<f32> = (0..6).map(|i| r * 10.0 + i as f32).collect();
                        let mut t =
                            b.upload(&HostTensor::from_f32(&[6], vals.clone()).expect("shape"));
                        let local = b.upload(&HostTensor::from_f32(&[6], vals).expect("shape"));
                        // Odd ranks stage through the host as a device's ranks do: the
                        // two kinds meet in one group.
                        let comm: Box<dyn TensorComm<CpuBackend>> =
                            if (r as usize).is_multiple_of(2) {
                                Box::new(comm)
                            } else {
                                Box::new(HostStaged(comm))
                            };
                        comm.all_reduce_sum(&b, &mut t, 4).expect("all_reduce");
                        let mut gathered = b.zeros(crate::DType::F32, &[6]);
                        comm.all_gather(&b, &local, 2, &mut gathered)
                            .expect("gather");
                        let mut mine = b.zeros(crate::DType::F32, &[2]);
                        comm.reduce_scatter_sum(&b, &local, 2, &mut mine)
                            .expect("scatter");
                        let mut recv = b.zeros(crate::DType::F32, &[6]);
                        comm.all_to_all(&b, &local, 2, &mut recv).expect("a2a");
                        [t, gathered, mine, recv].map(|t| b.download(&t).to_f32_vec())
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("rank"))
                .collect()
        });
        for (r, [reduced, gathered, mine, recv]) in results.iter().enumerate() {
            // sum over ranks of r*10 + i = 30 + 3i for the first 4; the rest untouched.
            assert_eq!(
                reduced,
                &[
                    30.0,
                    33.0,
                    36.0,
                    39.0,
                    r as f32 * 10.0 + 4.0,
                    r as f32 * 10.0 + 5.0
                ]
            );
            assert_eq!(gathered, &[0.0, 1.0, 10.0, 11.0, 20.0, 21.0]);
            let chunk = |i: usize| 30.0 + 3.0 * (2 * r + i) as f32;
            assert_eq!(mine, &[chunk(0), chunk(1)]);
            // Chunk r of every rank's row, from rank 0, 1, 2 in order.
            let want: Vec<f32> = (0..3)
                .flat_map(|src| (0..2).map(move |i| src as f32 * 10.0 + (2 * r + i) as f32))
                .collect();
            assert_eq!(recv, &want);
        }
    }
}
