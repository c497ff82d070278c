//! A forward pass allocates nothing: every activation lives in the workspace and every piece
//! of step metadata in buffers made at start-up (what lets a GPU backend capture a decode
//! step as a graph). A counting global allocator watches steps of decode and prefill shape,
//! f32 and bf16, after one warm-up step of each.

#![allow(unsafe_code)] // a counting global allocator needs `unsafe impl GlobalAlloc`

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use tandem_core::BlockId;
use tandem_engine::batch::ForwardBatch;
use tandem_engine::{Backend, CpuBackend, DType, KvCache, LlamaModel, StepLimits, StepMeta};

struct Counting;

static COUNTING: AtomicBool = AtomicBool::new(false);
static ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards every call to the system allocator unchanged; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if COUNTING.load(Ordering::Relaxed) {
            ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if COUNTING.load(Ordering::Relaxed) {
            ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

#[test]
fn forward_passes_do_not_allocate() {
    let dir = tandem_testkit::smollm2_dir();
    // Run inside a pool so rayon's work goes through worker deques (an injection from a
    // foreign thread may allocate queue blocks, which is rayon's, not the forward's).
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .expect("pool");
    for dtype in [DType::F32, DType::BF16] {
        let model = LlamaModel::load(&dir, CpuBackend::new(), dtype).expect("load model");
        let limits = StepLimits {
            max_tokens: 80,
            max_seqs: 4,
            max_blocks_per_seq: 8,
        };
        let mut meta = StepMeta::new(model.backend(), limits);
        let mut ws = model.workspace(limits);
        let mut cache = KvCache::new(model.backend(), model.kv_layout(16, 32));
        let tables: Vec<Vec<BlockId>> = (0..4)
            .map(|s| (0..8).map(|b| BlockId(s * 8 + b)).collect())
            .collect();
        // A prefill step (two prompts) and a decode step (four sequences, one token each).
        let mut prefill = ForwardBatch::default();
        prefill.push(
            &[
                1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23,
                24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40,
            ],
            0,
            &tables[0],
            16,
            true,
        );
        prefill.push(&[7; 33], 0, &tables[1], 16, true);
        let mut decode = ForwardBatch::default();
        for (s, table) in tables.iter().enumerate() {
            decode.push(&[100 + s as u32], 40, table, 16, true);
        }
        let counted = pool.install(|| {
            for batch in [&prefill, &decode] {
                meta.upload(model.backend(), batch).expect("fits");
                model.forward(&meta, &mut cache, &mut ws).expect("forward"); // warm-up
            }
            ALLOCATIONS.store(0, Ordering::SeqCst);
            COUNTING.store(true, Ordering::SeqCst);
            for _ in 0..3 {
                for batch in [&prefill, &decode] {
                    meta.upload(model.backend(), batch).expect("fits");
                    model.forward(&meta, &mut cache, &mut ws).expect("forward");
                }
            }
            COUNTING.store(false, Ordering::SeqCst);
            ALLOCATIONS.load(Ordering::SeqCst)
        });
        assert_eq!(
            counted, 0,
            "{dtype}: forward passes allocated {counted} times"
        );
        // The forwards computed something real.
        let logits = model.backend().download(&ws.logits).to_f32_vec();
        assert!(logits[..4 * model.config().vocab_size]
            .iter()
            .all(|v| v.is_finite()));
        assert!(logits.iter().any(|&v| v != 0.0));
    }
}
