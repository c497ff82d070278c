//! Collectives over device tensors: what tensor-parallel model code calls between its
//! ranks. [`TensorComm`] is generic over the backend so a GPU communicator (NCCL) implements
//! it over device memory; CPU ranks (threads of one process) use
//! [`tandem_topology::InProcessCommunicator`] on the tensors' host memory directly.

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
                        let comm: &dyn TensorComm<CpuBackend> = &comm;
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
