//! How the matrix kernels split a call over rayon: blocks of activation rows (so a block
//! stays cache-resident while weight tiles stream past it) × chunks of output units (weight
//! rows or panels), enough tasks to balance, each a whole multiple of the tile width; tiny
//! calls stay on the calling thread.

use rayon::prelude::*;

/// An output pointer that may cross to rayon tasks. Each user documents why its tasks write
/// disjoint parts of the output (which is mutably borrowed for the whole call).
#[derive(Clone, Copy)]
pub(crate) struct OutPtr(pub(crate) *mut f32);
// SAFETY: only handed to tasks that write disjoint regions (see each use).
unsafe impl Send for OutPtr {}
// SAFETY: as above.
unsafe impl Sync for OutPtr {}

/// Calls `run(i0, rows, u0, u1)` for every task: rows `i0..i0+rows` of `m`, output units
/// `u0..u1` of `units`, where unit chunks are multiples of `multiple`. `work` (multiply-adds)
/// decides whether threading pays.
pub(crate) fn split(
    m: usize,
    units: usize,
    multiple: usize,
    row_block: usize,
    work: usize,
    run: impl Fn(usize, usize, usize, usize) + Sync,
) {
    let row_blocks = m.div_ceil(row_block);
    let col_tasks = if work < (1 << 17) {
        1
    } else {
        (rayon::current_num_threads() * 4).div_ceil(row_blocks)
    };
    let chunk = units.div_ceil(col_tasks).div_ceil(multiple) * multiple;
    let col_chunks = units.div_ceil(chunk);
    let task = |t: usize| {
        let (rb, cc) = (t / col_chunks, t % col_chunks);
        let (i0, u0) = (rb * row_block, cc * chunk);
        run(i0, row_block.min(m - i0), u0, (u0 + chunk).min(units));
    };
    let tasks = row_blocks * col_chunks;
    if tasks == 1 {
        task(0);
    } else {
        (0..tasks).into_par_iter().for_each(task);
    }
}
