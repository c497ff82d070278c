//! NCCL communicators on the one GPU lent: a one-rank group runs every collective of the
//! tensor-parallel trait over device memory, and a group whose ranks share a GPU is refused
//! (NCCL takes one rank per device; such ranks keep the in-process communicator). Without a
//! GPU each test passes saying why; on the GPU run (`TANDEM_REQUIRE_GPU=1`) a missing NCCL
//! fails the first.

mod common;
use common::gpu;

use tandem_cuda::nccl::{unavailable, NcclComm, NcclId};
use tandem_cuda::CudaBackend;
use tandem_engine::backend::TensorComm;
use tandem_engine::{Backend, DType, HostTensor};

fn values(g: &CudaBackend, t: &tandem_engine::Tensor<CudaBackend>) -> Vec<f32> {
    g.download(t).to_f32_vec()
}

#[test]
fn a_one_rank_group_runs_every_collective_on_device_memory() {
    let Some(g) = gpu() else { return };
    if let Some(why) = unavailable() {
        assert!(
            std::env::var_os("TANDEM_REQUIRE_GPU").is_none(),
            "the GPU run needs NCCL: {why}"
        );
        eprintln!("skipping: {why}");
        return;
    }
    let id = NcclId::new().expect("id");
    assert_eq!(
        NcclId::from_bytes(&id.to_bytes())
            .expect("round trip")
            .to_bytes(),
        id.to_bytes()
    );
    let comm = NcclComm::join(&g, &id, 0, 1).expect("join a group of one");
    assert_eq!((comm.rank(), comm.size()), (0, 1));
    assert!(comm.replayable());
    let data: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5 - 7.0).collect();
    let x = g.upload(&HostTensor::from_f32(&[1000], data.clone()).expect("shape"));
    // Each collective writes into a zeroed buffer, so one that did nothing would show.
    let mut out = g.zeros(DType::F32, &[1000]);
    comm.all_gather(&g, &x, 600, &mut out).expect("all_gather");
    assert_eq!(&values(&g, &out)[..600], &data[..600]);
    assert!(values(&g, &out)[600..].iter().all(|&v| v == 0.0));
    let mut out = g.zeros(DType::F32, &[1000]);
    comm.reduce_scatter_sum(&g, &x, 700, &mut out)
        .expect("reduce_scatter_sum");
    assert_eq!(&values(&g, &out)[..700], &data[..700]);
    let mut out = g.zeros(DType::F32, &[1000]);
    comm.all_to_all(&g, &x, 900, &mut out).expect("all_to_all");
    assert_eq!(&values(&g, &out)[..900], &data[..900]);
    let mut y = g.upload(&HostTensor::from_f32(&[1000], data.clone()).expect("shape"));
    comm.all_reduce_sum(&g, &mut y, 1000)
        .expect("all_reduce_sum");
    assert_eq!(values(&g, &y), data);
    // A buffer too small is an error, not a write out of bounds.
    let err = comm
        .all_gather(&g, &x, 600, &mut g.zeros(DType::F32, &[100]))
        .expect_err("output too small");
    assert!(err.to_string().contains("600"), "{err}");
}

#[test]
fn ranks_sharing_a_gpu_are_refused_and_keep_their_in_process_communicator() {
    let Some(g) = gpu() else { return };
    let second = g.new_stream().expect("a second stream");
    let Err(err) = NcclComm::group(&[g.clone(), second.clone()]) else {
        panic!("two ranks on one GPU formed an NCCL group")
    };
    assert!(
        err.to_string().contains("one rank per GPU"),
        "unexpected refusal: {err}"
    );
    assert!(CudaBackend::nccl_group(&[g, second]).is_none());
}

/// What a layout's loader asks for ([`Backend::group_comms`]): ranks sharing the GPU get
/// communicators over its memory that sum across the ranks' threads (NCCL is not tried for
/// them), and a group of one is a group of one.
#[test]
fn the_backend_joins_ranks_sharing_a_gpu_without_nccl() {
    let Some(g) = gpu() else { return };
    let members = vec![g.clone(), g.new_stream().expect("a second stream")];
    let comms = CudaBackend::group_comms(
        &members,
        tandem_topology::InProcessCommunicator::group(2, Some(std::time::Duration::from_secs(30))),
    );
    assert_eq!(comms.len(), 2);
    let sums: Vec<Vec<f32>> = std::thread::scope(|s| {
        let handles: Vec<_> = members
            .iter()
            .zip(&comms)
            .enumerate()
            .map(|(r, (b, comm))| {
                s.spawn(move || {
                    assert_eq!((comm.rank(), comm.size()), (r, 2));
                    let data: Vec<f32> = (0..300).map(|i| (i * (r + 1)) as f32).collect();
                    let mut t = b.upload(&HostTensor::from_f32(&[300], data).expect("shape"));
                    comm.all_reduce_sum(b, &mut t, 300).expect("all_reduce_sum");
                    values(b, &t)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank"))
            .collect()
    });
    let want: Vec<f32> = (0..300).map(|i| (3 * i) as f32).collect();
    assert_eq!(sums[0], want);
    assert_eq!(sums[1], want);
    let one = CudaBackend::group_comms(
        &members[..1],
        tandem_topology::InProcessCommunicator::group(1, None),
    );
    assert_eq!((one[0].rank(), one[0].size()), (0, 1));
}
