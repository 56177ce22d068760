//! What the packed f32 and the int8 linear layers share: weights packed once into panels of
//! [`PANEL`] output columns, kernels that multiply up to [`TILE_ROWS`] input rows by one panel
//! with the panel in cache, the masked store of a panel's row, and the op that hands a
//! contiguous (rows, in) input to a kernel and gets (rows, out) back.

use super::OutPtr;
use crate::ops::slice;
use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

/// Output columns per panel: two 16-lane registers.
pub(crate) const PANEL: usize = 32;
/// Input rows per kernel call: 2 × 8 accumulators of 16 lanes.
pub(crate) const TILE_ROWS: usize = 8;

/// Packs `rows` (`n_out` rows of `k`) into panels of `width` (a divisor of [`PANEL`]) output
/// columns: panel p holds outputs p·width.. as `[k / group][width][group]` (k padded to a
/// multiple of `group`; padding, outputs past `n_out` and whole panels up to the next multiple
/// of [`PANEL`] outputs are `T::default()`), the order in which a kernel reading `group` inputs
/// of `width` outputs at a time loads them.
pub(crate) fn pack<T: Copy + Default + Send + Sync>(
    rows: &[T],
    n_out: usize,
    k: usize,
    group: usize,
    width: usize,
) -> Vec<T> {
    let kg = k.div_ceil(group);
    let mut panels = vec![T::default(); n_out.div_ceil(PANEL) * kg * PANEL * group];
    panels
        .par_chunks_mut(kg * width * group)
        .enumerate()
        .for_each(|(p, panel)| {
            for j in 0..width.min(n_out.saturating_sub(p * width)) {
                let row = &rows[(p * width + j) * k..(p * width + j + 1) * k];
                // Input group g of output j lands at [g][j][..].
                if group == 1 {
                    for (kk, &v) in row.iter().enumerate() {
                        panel[kk * width + j] = v;
                    }
                } else {
                    for (g, inputs) in row.chunks(group).enumerate() {
                        let at = g * width * group + j * group;
                        panel[at..at + inputs.len()].copy_from_slice(inputs);
                    }
                }
            }
        });
    panels
}

/// The start of panel `p + 1` of `panels` (each `panel_len` long, covering `n_out` outputs),
/// or null after the last: what a kernel fetches into L2 while it multiplies panel `p`.
pub(crate) fn next_panel<T>(panels: &[T], p: usize, panel_len: usize, n_out: usize) -> *const T {
    if (p + 1) * PANEL < n_out {
        panels[(p + 1) * panel_len..].as_ptr()
    } else {
        std::ptr::null()
    }
}

/// Runs `f(i)` for every block `i < n`, in parallel when the product (`work` multiply-adds)
/// is worth a hand-off. Blocks write disjoint columns of the output.
pub(crate) fn for_each_block(n: usize, work: usize, f: impl Fn(usize) + Sync + Send) {
    if work >= 1 << 18 {
        (0..n).into_par_iter().for_each(f);
    } else {
        (0..n).for_each(f);
    }
}

/// Calls `tile::<R>(t)` for each run of at most [`TILE_ROWS`] of `rows` rows, `next(r0)`
/// giving the tile for the rows from `r0`.
macro_rules! by_tiles {
    ($rows:expr, $tile:ident, |$r0:ident| $next:expr) => {{
        let mut $r0 = 0;
        while $r0 < $rows {
            let n = $crate::ops::cpu::panels::TILE_ROWS.min($rows - $r0);
            let t = $next;
            match n {
                8 => $tile::<8>(&t),
                7 => $tile::<7>(&t),
                6 => $tile::<6>(&t),
                5 => $tile::<5>(&t),
                4 => $tile::<4>(&t),
                3 => $tile::<3>(&t),
                2 => $tile::<2>(&t),
                _ => $tile::<1>(&t),
            }
            $r0 += n;
        }
    }};
}
pub(crate) use by_tiles;

/// Stores the first `cols` (≤ [`PANEL`]) of the row `(v0, v1)` at `row`, after ReLU when
/// `relu`; lanes of the last panel past the layer's outputs are not written.
///
/// # Safety
/// The CPU has AVX-512 F, and `row` points at `cols` writable floats.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
pub(crate) unsafe fn store_row(
    row: *mut f32,
    cols: usize,
    mut v0: std::arch::x86_64::__m512,
    mut v1: std::arch::x86_64::__m512,
    relu: bool,
) {
    use std::arch::x86_64::*;
    let mask = |n: usize| -> __mmask16 {
        match n {
            0 => 0,
            1..=15 => (1u16 << n) - 1,
            _ => 0xffff,
        }
    };
    if relu {
        v0 = _mm512_max_ps(v0, _mm512_setzero_ps());
        v1 = _mm512_max_ps(v1, _mm512_setzero_ps());
    }
    _mm512_mask_storeu_ps(row, mask(cols), v0);
    _mm512_mask_storeu_ps(row.add(16), mask(cols.saturating_sub(16)), v1);
}

/// [`store_row`] for AVX2 kernels: stores the first `cols` (≤ 8·N) lanes of the row `v` at
/// `row`, after ReLU when `relu`; lanes past `cols` are not written.
///
/// # Safety
/// The CPU has AVX2, and `row` points at `cols` writable floats.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
pub(crate) unsafe fn store_row_avx2<const N: usize>(
    row: *mut f32,
    cols: usize,
    v: [std::arch::x86_64::__m256; N],
    relu: bool,
) {
    use std::arch::x86_64::*;
    let v = v.map(|v| match relu {
        true => _mm256_max_ps(v, _mm256_setzero_ps()),
        false => v,
    });
    if cols == 8 * N {
        // A whole row, as nearly every row is: straight to the output (through a buffer and
        // `memcpy`, these stores took 3 % of a beam search).
        for (i, v) in v.into_iter().enumerate() {
            _mm256_storeu_ps(row.add(8 * i), v);
        }
        return;
    }
    let mut lanes = [[0f32; 8]; N];
    for (out, v) in lanes.iter_mut().zip(v) {
        _mm256_storeu_ps(out.as_mut_ptr(), v);
    }
    std::ptr::copy_nonoverlapping(lanes.as_ptr().cast::<f32>(), row, cols);
}

/// A linear layer's kernel: x (rows × k) → y (rows × n_out), then ReLU when asked.
pub(crate) trait RowKernel: Sync {
    /// The op's name, in candle's errors.
    const NAME: &'static str;
    /// (inputs, outputs) per row.
    fn shape(&self) -> (usize, usize);
    /// y (rows × n_out, row-major, at `y`) from x (rows × k); must write every element of y.
    fn run(&self, x: &[f32], rows: usize, y: &OutPtr, relu: bool);

    /// x (N, in) → x Wᵀ + b (N, out), then ReLU when `relu`. No gradient.
    fn forward(&self, x: &Tensor, relu: bool) -> Result<Tensor>
    where
        Self: Sized,
    {
        x.contiguous()?
            .apply_op1_no_bwd(&RowOp { kernel: self, relu })
    }
}

struct RowOp<'a, K> {
    kernel: &'a K,
    relu: bool,
}

impl<K: RowKernel> CustomOp1 for RowOp<'_, K> {
    fn name(&self) -> &'static str {
        K::NAME
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = slice(s, l)?;
        let (k, n_out) = self.kernel.shape();
        if l.dims().last() != Some(&k) {
            candle_core::bail!("{}: input {:?}, weight in {k}", K::NAME, l.dims());
        }
        let rows = x.len() / k.max(1);
        let n = rows * n_out;
        // Every element is written by the kernel: no zero-fill (10 MB per step for the
        // output projection of a beam-search step).
        let mut y: Vec<f32> = Vec::with_capacity(n);
        let out = OutPtr(y.spare_capacity_mut().as_mut_ptr().cast::<f32>());
        self.kernel.run(x, rows, &out, self.relu);
        // SAFETY: `run` wrote all rows × n_out elements.
        unsafe { y.set_len(n) };
        Ok((CpuStorage::F32(y), Shape::from((rows, n_out))))
    }
}
