//! Timings and sizes of a prefill worker's KV pushes by path, as cumulative histograms the
//! stats RPC reports and the router exports (`tandem_kv_transfer_seconds`,
//! `tandem_kv_transfer_bytes`). The worker serves no metrics of its own, so the histograms
//! travel with the stats the router polls anyway; the bounds travel with them.

use std::sync::Mutex;
use std::time::Duration;
use tandem_proto::v1 as pb;

/// The way a handoff reached the decode worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransferPath {
    /// Copied into the landing slot through shared memory (same host).
    Shm,
    /// Written into the landing slot with one-sided operations.
    Put,
    /// Sent whole as a transport message.
    Send,
}

impl TransferPath {
    const ALL: [TransferPath; 3] = [TransferPath::Shm, TransferPath::Put, TransferPath::Send];

    /// The `path` label value.
    pub fn as_str(self) -> &'static str {
        match self {
            TransferPath::Shm => "shm",
            TransferPath::Put => "put",
            TransferPath::Send => "send",
        }
    }
}

const SECONDS_BOUNDS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];
/// 64 KiB to 4 GiB by factors of four.
const BYTES_BOUNDS: &[f64] = &[
    65536.0,
    262144.0,
    1048576.0,
    4194304.0,
    16777216.0,
    67108864.0,
    268435456.0,
    1073741824.0,
    4294967296.0,
];

#[derive(Clone, Debug, Default)]
struct Histogram {
    /// Observations at or under each bound (not yet cumulative).
    buckets: Vec<u64>,
    sum: f64,
}

impl Histogram {
    fn observe(&mut self, bounds: &[f64], value: f64) {
        if self.buckets.is_empty() {
            self.buckets = vec![0; bounds.len()];
        }
        if let Some(i) = bounds.iter().position(|b| value <= *b) {
            self.buckets[i] += 1;
        }
        self.sum += value;
    }

    fn cumulative(&self, bounds: &[f64]) -> Vec<u64> {
        let mut total = 0;
        (0..bounds.len())
            .map(|i| {
                total += self.buckets.get(i).copied().unwrap_or(0);
                total
            })
            .collect()
    }
}

#[derive(Clone, Debug, Default)]
struct PathStats {
    count: u64,
    seconds: Histogram,
    bytes: Histogram,
}

/// The pushes of one worker, by path.
#[derive(Debug, Default)]
pub struct KvTransferStats {
    paths: Mutex<[PathStats; 3]>,
}

impl KvTransferStats {
    /// Records one push of `bytes` over `path` that took `took`.
    pub fn observe(&self, path: TransferPath, bytes: u64, took: Duration) {
        let mut paths = self.paths.lock().unwrap_or_else(|e| e.into_inner());
        let p = &mut paths[path as usize];
        p.count += 1;
        p.seconds.observe(SECONDS_BOUNDS, took.as_secs_f64());
        p.bytes.observe(BYTES_BOUNDS, bytes as f64);
    }

    /// The stats RPC's entries: one per path used so far.
    pub fn to_pb(&self) -> Vec<pb::KvTransferHistogram> {
        let paths = self.paths.lock().unwrap_or_else(|e| e.into_inner());
        TransferPath::ALL
            .iter()
            .zip(paths.iter())
            .filter(|(_, p)| p.count > 0)
            .map(|(path, p)| pb::KvTransferHistogram {
                path: path.as_str().into(),
                count: p.count,
                seconds_sum: p.seconds.sum,
                seconds_bounds: SECONDS_BOUNDS.to_vec(),
                seconds_cumulative: p.seconds.cumulative(SECONDS_BOUNDS),
                bytes_sum: p.bytes.sum,
                bytes_bounds: BYTES_BOUNDS.to_vec(),
                bytes_cumulative: p.bytes.cumulative(BYTES_BOUNDS),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pushes_land_in_cumulative_buckets_of_their_path() {
        let stats = KvTransferStats::default();
        assert!(stats.to_pb().is_empty(), "no path before a push");
        stats.observe(TransferPath::Shm, 100_000, Duration::from_millis(2));
        stats.observe(TransferPath::Shm, 10, Duration::from_secs(60));
        let pb = stats.to_pb();
        assert_eq!(pb.len(), 1);
        let shm = &pb[0];
        assert_eq!((shm.path.as_str(), shm.count), ("shm", 2));
        assert_eq!(shm.bytes_sum, 100_010.0);
        // 10 bytes is under the first bound, 100 000 under the second.
        assert_eq!(&shm.bytes_cumulative[..3], &[1, 2, 2]);
        // 2 ms is under the 2.5 ms bound; a minute is past the last (only in count).
        let at = |b: f64| {
            SECONDS_BOUNDS
                .iter()
                .position(|x| *x == b)
                .expect("a bound")
        };
        assert_eq!(shm.seconds_cumulative[at(0.001)], 0);
        assert_eq!(shm.seconds_cumulative[at(0.0025)], 1);
        assert_eq!(*shm.seconds_cumulative.last().expect("buckets"), 1);
        assert!((shm.seconds_sum - 60.002).abs() < 1e-9);
    }
}
