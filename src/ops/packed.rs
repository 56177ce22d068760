//! Linear layers with their weights packed once, for inference. A general matrix product packs
//! its weight operand into cache-friendly panels on every call; a decoding step multiplies a
//! few hundred rows by every weight matrix, so that packing (the whole 8 MB output projection
//! at every step) cost as much as a third of the product. Here each weight is packed once per
//! loaded model into panels of [`PANEL`] output columns stored input-major, and a kernel
//! multiplies a few rows by one panel at a time with the panel in cache: up to
//! [`panels::TILE_ROWS`] rows with AVX-512; with AVX2 (half the registers, each half as
//! wide) six rows by half a panel. Both sum in the same order: their results are equal bit for bit.
//! Elsewhere (no AVX2, other architectures) [`Packed::new`] returns `None` and callers use
//! the general path. A [`PackedLinear`] owns the layer's only copy of its weights, packed when
//! the model loads: trainable weights, which change at every step, must not be packed
//! (`Linear` packs only weights loaded from a file). With
//! [`ComputeType::Int8`] it holds the layer quantized to int8 instead ([`super::int8`]),
//! with [`ComputeType::Bf16`] rounded to bfloat16 ([`super::bf16`]).

use super::bf16::Bf16Linear;
use super::cpu::panels::{self, by_tiles, RowKernel, PANEL};
use super::cpu::{has_avx2, has_avx512, OutPtr};
use super::int8::{self, Int8Linear};
use super::with_host_f32;
use candle_core::{DType, Result, Tensor};

/// How the linear layers of a loaded model compute (`--compute-type`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ComputeType {
    /// In f32, through the packed kernel where it runs (AVX-512 or AVX2), else the general
    /// product.
    #[default]
    Float32,
    /// Weights and inputs quantized to int8 ([`super::int8`]); CPU only.
    Int8,
    /// Weights and inputs rounded to bfloat16, products summed in f32 ([`super::bf16`]): not a
    /// `--compute-type` of its own, but how an int8 model computes its encoder's
    /// self-attention projections; CPU only.
    Bf16,
}

/// A loaded layer's weights in the form its kernel reads, packed once when the model loads.
/// It holds the layer's only copy: the f32 weight it was packed from is released.
pub struct PackedLinear(Kernel);

/// A layer's weights in the form its kernel reads.
enum Kernel {
    F32(Packed),
    Int8(Int8Linear),
    Bf16(Bf16Linear),
}

impl PackedLinear {
    /// `weight` (out, in) and `bias` (out) packed for `compute`'s kernel; `None` where none
    /// runs (another device or dtype, f32 without AVX2), and the layer keeps the general
    /// product.
    pub fn new(compute: ComputeType, weight: &Tensor, bias: &Tensor) -> Result<Option<Self>> {
        if weight.dtype() != DType::F32 || !weight.device().is_cpu() {
            return Ok(None);
        }
        let kernel = match compute {
            ComputeType::Float32 => Packed::new(weight, bias, has_avx512())?.map(Kernel::F32),
            ComputeType::Bf16 => Bf16Linear::new(weight, bias, true)?.map(Kernel::Bf16),
            ComputeType::Int8 => Some(Kernel::Int8(Int8Linear::new(
                weight,
                bias,
                int8::Kernel::best(),
            )?)),
        };
        Ok(kernel.map(Self))
    }

    /// `x` (..., in), CPU f32 as the layer, times the weight transposed plus the bias, then
    /// ReLU when `relu`.
    pub fn forward(&self, x: &Tensor, relu: bool) -> Result<Tensor> {
        if x.dtype() != DType::F32 || !x.device().is_cpu() {
            candle_core::bail!(
                "a packed linear layer takes CPU f32 inputs, not {:?} on {:?}",
                x.dtype(),
                x.device()
            );
        }
        let mut dims = x.dims().to_vec();
        let x2 = x.reshape(((), dims[dims.len() - 1]))?;
        let (y, n_out) = match &self.0 {
            Kernel::F32(p) => (p.forward(&x2, relu)?, p.n_out),
            Kernel::Int8(q) => (q.forward(&x2, relu)?, q.shape().1),
            Kernel::Bf16(h) => (h.forward(&x2, relu)?, h.shape().1),
        };
        *dims
            .last_mut()
            .expect("a linear layer's input has dimensions") = n_out;
        y.reshape(dims)
    }
}

/// A weight (out, in) and its bias, packed for [`Packed::forward`].
pub struct Packed {
    n_out: usize,
    k: usize,
    /// Panel p holds columns p·PANEL.. as `[k][PANEL]` for the AVX-512 kernel, as two halves
    /// `[2][k][HALF]` for the AVX2 one (each half it multiplies at a time contiguous in
    /// memory), zero-padded past `n_out`.
    panels: Vec<f32>,
    /// The bias, zero-padded to whole panels.
    bias: Vec<f32>,
    /// Whether the AVX-512 kernel runs (else the AVX2 one).
    avx512: bool,
}

impl Packed {
    /// Packs `weight` (out, in) and `bias` (out, or 1×out), both CPU f32, for the AVX-512
    /// kernel when `avx512` is set and the CPU has it, else for the AVX2 one; `None` where no
    /// kernel can run (other devices or dtypes, no AVX2).
    pub fn new(weight: &Tensor, bias: &Tensor, avx512: bool) -> Result<Option<Self>> {
        let avx512 = avx512 && has_avx512();
        if !(avx512 || has_avx2())
            || !weight.device().is_cpu()
            || weight.dtype() != candle_core::DType::F32
        {
            return Ok(None);
        }
        let (n_out, k) = weight.dims2()?;
        let b = bias.flatten_all()?.to_vec1::<f32>()?;
        if b.len() != n_out {
            candle_core::bail!("packed linear: bias of {} for {n_out} outputs", b.len());
        }
        // The AVX2 kernel multiplies half a panel at a time: each half packed as a panel of
        // its own, contiguous (interleaved, a half's rows lay 128 bytes apart and filled only
        // half of the L1 sets they map to, so the panel being multiplied and the next one
        // being fetched evicted each other).
        let width = if avx512 { PANEL } else { HALF };
        let panels = with_host_f32(weight, |w| panels::pack(w, n_out, k, 1, width))?;
        let mut bias = b;
        bias.resize(n_out.div_ceil(PANEL) * PANEL, 0.0);
        Ok(Some(Self {
            n_out,
            k,
            panels,
            bias,
            avx512,
        }))
    }

    /// All rows times panel `p`: TILE_ROWS rows at a time with AVX-512; with AVX2 by halves.
    #[cfg(target_arch = "x86_64")]
    unsafe fn panel_rows(&self, p: usize, x: &[f32], rows: usize, out: &OutPtr, relu: bool) {
        let tile_at = |r0: usize| Tile {
            k: self.k,
            x: x.as_ptr().add(r0 * self.k),
            panel: self.panels.as_ptr().add(p * self.k * PANEL),
            bias: self.bias.as_ptr().add(p * PANEL),
            y: out.at(p * PANEL).add(r0 * self.n_out),
            y_stride: self.n_out,
            cols: PANEL.min(self.n_out - p * PANEL),
            relu,
            next: panels::next_panel(&self.panels, p, self.k * PANEL, self.n_out),
        };
        if self.avx512 {
            by_tiles!(rows, tile, |r0| tile_at(r0));
            return;
        }
        // AVX2: each 16-column half of the panel (a quarter of L1) in turn, six rows at a time
        // from `x` as [`interleave_rows`] lays them out.
        let cols = PANEL.min(self.n_out - p * PANEL);
        for half in 0..cols.div_ceil(HALF) {
            let mut r0 = 0;
            while r0 < rows {
                let mut t = tile_at(r0);
                t.panel = t.panel.add(half * self.k * HALF);
                t.bias = t.bias.add(half * HALF);
                t.y = t.y.add(half * HALF);
                // The next panel's half is fetched once, by the first rows' pass over this one.
                t.next = match r0 {
                    0 if !t.next.is_null() => t.next.add(half * self.k * HALF),
                    _ => std::ptr::null(),
                };
                t.cols = HALF.min(cols - half * HALF);
                match (rows - r0).min(ROWS_AVX2) {
                    6 => tile_avx2::<6>(&t),
                    5 => tile_avx2::<5>(&t),
                    4 => tile_avx2::<4>(&t),
                    3 => tile_avx2::<3>(&t),
                    2 => tile_avx2::<2>(&t),
                    _ => tile_avx2::<1>(&t),
                }
                r0 += ROWS_AVX2;
            }
        }
    }

    #[cfg(not(target_arch = "x86_64"))]
    unsafe fn panel_rows(&self, _: usize, _: &[f32], _: usize, _: &OutPtr, _: bool) {
        unreachable!("packed linear layers are only built where the kernel runs")
    }
}

/// One kernel call: R rows of x times one panel.
struct Tile {
    k: usize,
    /// The first of the R rows: rows k apart for the AVX-512 kernel, interleaved for the
    /// AVX2 one ([`interleave_rows`]).
    x: *const f32,
    panel: *const f32,
    bias: *const f32,
    y: *mut f32,
    y_stride: usize,
    cols: usize,
    relu: bool,
    /// The next panel (null for the last): fetched into L2 while this one is multiplied, so
    /// that a few rows' product, which streams the weights faster than memory delivers them
    /// unasked, finds them in cache.
    next: *const f32,
}

/// y[r][0..cols] = bias + Σ_kk x[r][kk] · panel[kk][0..cols] for R rows, accumulated in kk
/// order (as the general product does), then ReLU when asked.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn tile<const R: usize>(t: &Tile) {
    use std::arch::x86_64::*;
    let mut lo = [_mm512_setzero_ps(); R];
    let mut hi = [_mm512_setzero_ps(); R];
    for kk in 0..t.k {
        if !t.next.is_null() {
            _mm_prefetch::<_MM_HINT_T1>(t.next.add(kk * PANEL).cast());
            _mm_prefetch::<_MM_HINT_T1>(t.next.add(kk * PANEL + 16).cast());
        }
        let w0 = _mm512_loadu_ps(t.panel.add(kk * PANEL));
        let w1 = _mm512_loadu_ps(t.panel.add(kk * PANEL + 16));
        for r in 0..R {
            let xv = _mm512_set1_ps(*t.x.add(r * t.k + kk));
            lo[r] = _mm512_fmadd_ps(xv, w0, lo[r]);
            hi[r] = _mm512_fmadd_ps(xv, w1, hi[r]);
        }
    }
    let (b0, b1) = (_mm512_loadu_ps(t.bias), _mm512_loadu_ps(t.bias.add(16)));
    for r in 0..R {
        let (v0, v1) = (_mm512_add_ps(b0, lo[r]), _mm512_add_ps(b1, hi[r]));
        panels::store_row(t.y.add(r * t.y_stride), t.cols, v0, v1, t.relu);
    }
}

/// Columns of a panel that the AVX2 kernel computes at a time: two 8-lane registers.
const HALF: usize = PANEL / 2;
/// Input rows the AVX2 kernel multiplies at a time: 6 × 2 accumulators, 2 weights and an input
/// in its 16 registers.
const ROWS_AVX2: usize = 6;

/// `x` (rows × k) as the AVX2 kernel reads it: each run of [`ROWS_AVX2`] rows interleaved,
/// `[k][ROWS_AVX2]` (the last run padded with zeros), so that the inputs of one step of the
/// kernel share a cache line instead of lying k apart in six. Whole runs go eight columns at a
/// time through a transpose in registers (a copy value by value, six stores apart, took 3 % of
/// a float32 beam search).
///
/// # Safety
/// The CPU has AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn interleave_rows(x: &[f32], rows: usize, k: usize) -> Vec<f32> {
    use std::arch::x86_64::*;
    assert!(
        x.len() >= rows * k,
        "interleave_rows: {} inputs for {rows} × {k}",
        x.len()
    );
    let len = rows.div_ceil(ROWS_AVX2) * ROWS_AVX2 * k;
    // Two floats of room past the end: each column goes out as eight lanes (a masked store is
    // slow on AMD cores), its last two zeros, which the next column's store overwrites.
    let mut out = vec![0f32; len + 2];
    for group in 0..rows.div_ceil(ROWS_AVX2) {
        // The group's first input and its first output: both 6 · k values per group.
        let at = group * ROWS_AVX2 * k;
        let n = (rows - group * ROWS_AVX2).min(ROWS_AVX2);
        let mut kk = 0;
        if n == ROWS_AVX2 {
            while kk + 8 <= k {
                let a: [__m256; ROWS_AVX2] =
                    std::array::from_fn(|r| _mm256_loadu_ps(x.as_ptr().add(at + r * k + kk)));
                let z = _mm256_setzero_ps();
                let t = [
                    _mm256_unpacklo_ps(a[0], a[1]),
                    _mm256_unpackhi_ps(a[0], a[1]),
                    _mm256_unpacklo_ps(a[2], a[3]),
                    _mm256_unpackhi_ps(a[2], a[3]),
                    _mm256_unpacklo_ps(a[4], a[5]),
                    _mm256_unpackhi_ps(a[4], a[5]),
                ];
                let s = [
                    _mm256_shuffle_ps::<0x44>(t[0], t[2]),
                    _mm256_shuffle_ps::<0xEE>(t[0], t[2]),
                    _mm256_shuffle_ps::<0x44>(t[1], t[3]),
                    _mm256_shuffle_ps::<0xEE>(t[1], t[3]),
                    _mm256_shuffle_ps::<0x44>(t[4], z),
                    _mm256_shuffle_ps::<0xEE>(t[4], z),
                    _mm256_shuffle_ps::<0x44>(t[5], z),
                    _mm256_shuffle_ps::<0xEE>(t[5], z),
                ];
                // Column j of the eight: rows 0..6, then two zeros.
                let columns = [
                    _mm256_permute2f128_ps::<0x20>(s[0], s[4]),
                    _mm256_permute2f128_ps::<0x20>(s[1], s[5]),
                    _mm256_permute2f128_ps::<0x20>(s[2], s[6]),
                    _mm256_permute2f128_ps::<0x20>(s[3], s[7]),
                    _mm256_permute2f128_ps::<0x31>(s[0], s[4]),
                    _mm256_permute2f128_ps::<0x31>(s[1], s[5]),
                    _mm256_permute2f128_ps::<0x31>(s[2], s[6]),
                    _mm256_permute2f128_ps::<0x31>(s[3], s[7]),
                ];
                for (j, c) in columns.into_iter().enumerate() {
                    _mm256_storeu_ps(out.as_mut_ptr().add(at + (kk + j) * ROWS_AVX2), c);
                }
                kk += 8;
            }
        }
        for r in 0..n {
            for (c, &v) in x[at + r * k..][kk..k].iter().enumerate() {
                out[at + (kk + c) * ROWS_AVX2 + r] = v;
            }
        }
    }
    out.truncate(len);
    out
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn interleave_rows(_: &[f32], _: usize, _: usize) -> Vec<f32> {
    unreachable!("packed linear layers are only built where the kernel runs")
}

/// [`tile`] with AVX2 for R (≤ 6) rows and one [`HALF`] of the panel (`t.panel`, `t.bias`
/// and `t.y` pointing at its first column; `t.x` at the rows as [`interleave_rows`] lays them
/// out): the same multiply-adds in the same order.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn tile_avx2<const R: usize>(t: &Tile) {
    use std::arch::x86_64::*;
    let mut acc = [[_mm256_setzero_ps(); 2]; R];
    for kk in 0..t.k {
        if !t.next.is_null() {
            _mm_prefetch::<_MM_HINT_T1>(t.next.add(kk * HALF).cast());
        }
        let w = t.panel.add(kk * HALF);
        let (w0, w1) = (_mm256_loadu_ps(w), _mm256_loadu_ps(w.add(8)));
        for (r, acc) in acc.iter_mut().enumerate() {
            let xv = _mm256_set1_ps(*t.x.add(kk * ROWS_AVX2 + r));
            acc[0] = _mm256_fmadd_ps(xv, w0, acc[0]);
            acc[1] = _mm256_fmadd_ps(xv, w1, acc[1]);
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        let v = [0, 1].map(|i| _mm256_add_ps(_mm256_loadu_ps(t.bias.add(8 * i)), acc[i]));
        panels::store_row_avx2(t.y.add(r * t.y_stride), t.cols, v, t.relu);
    }
}

impl RowKernel for Packed {
    const NAME: &'static str = "nmt-packed-linear";

    fn shape(&self) -> (usize, usize) {
        (self.k, self.n_out)
    }

    fn run(&self, x: &[f32], rows: usize, out: &OutPtr, relu: bool) {
        let interleaved;
        let x = match self.avx512 {
            true => x,
            false => {
                // SAFETY: a layer without AVX-512 kernels is built only where the CPU has
                // AVX2 (see the SAFETY note below).
                interleaved = unsafe { interleave_rows(x, rows, self.k) };
                &interleaved[..]
            }
        };
        panels::for_each_block(
            self.n_out.div_ceil(PANEL),
            rows * self.n_out * self.k,
            |p| {
                // SAFETY: the kernel's CPU features were checked when this value was built
                // (`has_avx512()`, else `has_avx2()`); x holds rows × k values (for AVX2
                // whole runs of six rows), each panel k × PANEL, and panel p writes only
                // columns p·PANEL.. of y
                // (rows × n_out), disjoint from every other panel's.
                unsafe { self.panel_rows(p, x, rows, out, relu) }
            },
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::tests::max_diff;
    use candle_core::Device;

    #[test]
    fn packed_linear_equals_the_general_product() {
        let dev = Device::Cpu;
        for &(rows, n_out, k) in &[
            (1, 5, 3),
            (7, 33, 16),
            (8, 64, 256),
            (21, 100, 40),
            (64, 31, 9),
        ] {
            let x = Tensor::randn(0f32, 1.0, (rows, k), &dev).unwrap();
            let w = Tensor::randn(0f32, 1.0, (n_out, k), &dev).unwrap();
            let b = Tensor::randn(0f32, 1.0, n_out, &dev).unwrap();
            let Some(p) = Packed::new(&w, &b, true).unwrap() else {
                eprintln!("not compared: this CPU has neither AVX-512 nor AVX2");
                return;
            };
            for relu in [false, true] {
                let mut want = x
                    .matmul(&w.t().unwrap())
                    .unwrap()
                    .broadcast_add(&b)
                    .unwrap();
                if relu {
                    want = want.relu().unwrap();
                }
                let got = p.forward(&x, relu).unwrap();
                let diff = max_diff(&got, &want);
                assert!(diff < 1e-4, "{rows}×{k}·{k}×{n_out} relu {relu}: {diff}");
            }
        }
    }

    /// The AVX2 kernel's input layout: value (r, k) at [r / 6][k][r % 6], zeros past the rows,
    /// for whole and partial runs of rows and of eight columns.
    #[test]
    fn interleaved_rows_hold_each_input_where_the_avx2_kernel_reads_it() {
        if !has_avx2() {
            eprintln!("not compared: this CPU lacks AVX2");
            return;
        }
        for (rows, k) in [(1, 1), (6, 8), (7, 9), (12, 16), (13, 259), (64, 256)] {
            let x: Vec<f32> = (0..rows * k).map(|i| i as f32 + 1.0).collect();
            // SAFETY: the CPU has AVX2.
            let got = unsafe { interleave_rows(&x, rows, k) };
            assert_eq!(got.len(), rows.div_ceil(ROWS_AVX2) * ROWS_AVX2 * k);
            for (i, &v) in got.iter().enumerate() {
                let (group, kk, r) = (i / (ROWS_AVX2 * k), i / ROWS_AVX2 % k, i % ROWS_AVX2);
                let row = group * ROWS_AVX2 + r;
                let want = if row < rows { x[row * k + kk] } else { 0.0 };
                assert_eq!(v, want, "{rows}×{k}: row {row}, column {kk}");
            }
        }
    }

    /// The AVX2 kernel sums as the AVX-512 one does: the same bits, so a model translates
    /// alike on both kinds of CPU.
    #[test]
    fn the_avx2_kernel_equals_the_avx512_one_bit_for_bit() {
        if !(has_avx512() && has_avx2()) {
            eprintln!("not compared: this CPU lacks AVX-512 or AVX2");
            return;
        }
        let dev = Device::Cpu;
        let x = Tensor::randn(0f32, 1.0, (11, 70), &dev).unwrap();
        let w = Tensor::randn(0f32, 1.0, (45, 70), &dev).unwrap();
        let b = Tensor::randn(0f32, 1.0, 45, &dev).unwrap();
        let run = |avx512: bool| {
            let p = Packed::new(&w, &b, avx512).unwrap().unwrap();
            p.forward(&x, true)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
        };
        let (wide, narrow) = (run(true), run(false));
        assert!(wide
            .iter()
            .zip(&narrow)
            .all(|(a, b)| a.to_bits() == b.to_bits()));
    }
}
