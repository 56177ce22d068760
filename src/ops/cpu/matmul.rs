//! Matrix products on strided operands: serial gemm calls for small per-head products, the
//! threaded product with a pre-filled bias, dot products and the few-rows kernel.

use super::*;
use crate::ops::rows_per_task;
use rayon::prelude::*;

/// A matrix in a slice: element (r, c) at `data[r·rs + c·cs]`.
#[derive(Clone, Copy)]
pub(crate) struct Strided<'a> {
    pub data: &'a [f32],
    pub rs: usize,
    pub cs: usize,
}

impl<'a> Strided<'a> {
    /// Row-major, rows `stride` elements apart.
    pub fn rows(data: &'a [f32], stride: usize) -> Self {
        Self {
            data,
            rs: stride,
            cs: 1,
        }
    }

    /// The transpose of a row-major matrix whose rows are `stride` elements apart.
    pub fn transposed(data: &'a [f32], stride: usize) -> Self {
        Self {
            data,
            rs: 1,
            cs: stride,
        }
    }
}

/// dst (m×n, row stride `dst_rs`) = [dst +] scale · lhs (m×k) · rhs (k×n), on the calling
/// thread: for the many small products inside a kernel that is parallel on its own, and for
/// pairs of independent products run side by side (`rayon::join`).
pub(crate) fn gemm_serial(
    (m, n, k): (usize, usize, usize),
    dst: &mut [f32],
    dst_rs: usize,
    accumulate: bool,
    lhs: Strided,
    rhs: Strided,
    scale: f32,
) {
    let last =
        |s: &Strided, rows: usize, cols: usize| (rows.max(1) - 1) * s.rs + (cols.max(1) - 1) * s.cs;
    assert!(
        m == 0
            || n == 0
            || (last(&lhs, m, k) < lhs.data.len()
                && last(&rhs, k, n) < rhs.data.len()
                && (m - 1) * dst_rs + n <= dst.len()),
        "gemm_serial: operands too short for a {m}×{k}·{k}×{n} product"
    );
    // SAFETY: the assertion above keeps every element the product touches inside its slice,
    // and dst, a unique borrow, cannot alias the inputs.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            dst_rs as isize,
            accumulate,
            lhs.data.as_ptr(),
            lhs.cs as isize,
            lhs.rs as isize,
            rhs.data.as_ptr(),
            rhs.cs as isize,
            rhs.rs as isize,
            if accumulate { 1.0 } else { 0.0 },
            scale,
            false,
            false,
            false,
            gemm::Parallelism::None,
        )
    }
}

/// `rows` copies of `row` one after another (a bias for each row of a product), copied in
/// parallel into the new buffer (not zeroed first: the copies are its first writes).
pub(crate) fn repeat_rows(row: &[f32], rows: usize) -> Vec<f32> {
    let n = rows * row.len();
    let mut out = Vec::with_capacity(n);
    if !row.is_empty() {
        out.spare_capacity_mut()[..n]
            .par_chunks_mut(rows_per_task(row.len()) * row.len())
            .for_each(|c| {
                for r in c.chunks_mut(row.len()) {
                    r.iter_mut().zip(row).for_each(|(o, &v)| {
                        o.write(v);
                    });
                }
            });
    }
    // SAFETY: the chunks above wrote all `n` elements (none when `row` is empty).
    unsafe { out.set_len(n) };
    out
}

/// dst (m×n) = [dst +] lhs (m×k) · rhs (k×n), strides in elements (row, column).
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm_into(
    m: usize,
    n: usize,
    k: usize,
    dst: &mut [f32],
    accumulate: bool,
    lhs: &[f32],
    lhs_rs: usize,
    lhs_cs: usize,
    rhs: &[f32],
    rhs_rs: usize,
    rhs_cs: usize,
) {
    let par = if m * n * k > 32 * 1024 {
        gemm::Parallelism::Rayon(rayon::current_num_threads())
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: the slices hold m×n, m×k and k×n elements at the given strides (checked by callers
    // through the tensor shapes), and dst does not alias the inputs.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n as isize,
            accumulate,
            lhs.as_ptr(),
            lhs_cs as isize,
            lhs_rs as isize,
            rhs.as_ptr(),
            rhs_cs as isize,
            rhs_rs as isize,
            if accumulate { 1.0 } else { 0.0 },
            1.0,
            false,
            false,
            false,
            par,
        )
    }
}

/// Up to this many rows, [`skinny_into`] beats gemm: decoding steps with few live rows
/// (the last sentences of a batch) would otherwise re-pack every weight matrix at every step.
/// Measured on greedy decoding (2 threads): 8 or 16 rows best, 84 → 117 sentences/s.
pub(crate) const SKINNY_ROWS: usize = 8;

/// Σ a·b in `LANES` partial sums.
#[inline(always)]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..LANES {
            acc[i] += x[i] * y[i];
        }
    }
    let tail: f32 = ra.iter().zip(rb).map(|(x, y)| x * y).sum();
    acc.into_iter().sum::<f32>() + tail
}

/// dst (m×n) += x (m×k) · wᵀ for a few rows m, w (n×k) row-major: a dot product per output,
/// reading each weight row once for all m rows, in parallel over output columns.
pub(crate) fn skinny_into(m: usize, n: usize, k: usize, dst: &mut [f32], x: &[f32], w: &[f32]) {
    const COLS: usize = 128;
    let col_block = |j0: usize, out: &mut [f32]| {
        for (jj, wr) in w[j0 * k..].chunks(k).take(out.len() / m).enumerate() {
            for r in 0..m {
                out[jj * m + r] = dot(&x[r * k..(r + 1) * k], wr);
            }
        }
    };
    // Column-major scratch (n×m) so that parallel blocks own disjoint slices.
    let mut t = vec![0f32; n * m];
    if m * n * k > 1 << 18 {
        t.par_chunks_mut(COLS * m)
            .enumerate()
            .for_each(|(blk, out)| col_block(blk * COLS, out));
    } else {
        t.chunks_mut(COLS * m)
            .enumerate()
            .for_each(|(blk, out)| col_block(blk * COLS, out));
    }
    for r in 0..m {
        for j in 0..n {
            dst[r * n + j] += t[j * m + r];
        }
    }
}
