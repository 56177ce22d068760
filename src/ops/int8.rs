//! Linear layers in int8, for inference (`--compute-type int8`), in CTranslate2's scheme: each
//! weight row (one output) is quantized once to int8 with its own scale, max |w| / 127; each
//! input row is quantized when the layer runs, with its own scale; the products are summed
//! exactly in i32 and scaled back to f32, and the bias is added.
//!
//! Four kernels give the same integers, so the same outputs bit for bit:
//! - AVX-512 VNNI (Ice Lake and later Xeons, Zen 4): `vpdpbusd` multiplies unsigned by signed
//!   bytes four at a time into i32 lanes. Inputs are stored shifted by +128 (as unsigned
//!   bytes) and the shift's share, 128 · Σₖ w, is subtracted per output. Weights are packed
//!   once into panels of [`PANEL`] outputs × 4 inputs per 64-byte row pair, as the instruction
//!   reads them, and [`panels::TILE_ROWS`] input rows are multiplied by one panel at a time.
//! - AVX-VNNI (Intel cores since Alder Lake without AVX-512, Sierra Forest): the same
//!   instruction on 256-bit registers, the same panels, three input rows at a time.
//! - AVX2 (every x86-64 CPU since Haswell and Zen 1): the same panels, two input rows at a
//!   time; `vpmaddubsw` multiplies |x| by w carrying x's sign (`vpsignb`), exact in i16 since
//!   2 · 127 · 127 < 2¹⁵, and `vpmaddwd` sums the pairs into i32 lanes (intgemm's scheme).
//! - Everywhere else, a plain i8 dot product per (row, output), which the compiler vectorises
//!   (`vpmaddwd`) as wide as the CPU allows, chosen at run time by [`super::cpu::wide`].

use super::cpu::panels::{self, by_tiles, RowKernel, PANEL};
use super::cpu::OutPtr;
use super::with_host_f32;
use candle_core::{Result, Tensor};
use rayon::prelude::*;

/// Whether this CPU has the AVX-512 VNNI kernel's instructions.
pub(crate) fn has_vnni() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        super::cpu::has_avx512() && std::arch::is_x86_feature_detected!("avx512vnni")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Which kernel multiplies: the VNNI one, the AVX2 one, or the portable one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    Vnni,
    AvxVnni,
    Avx2,
    Portable,
}

impl Kernel {
    /// The fastest kernel this CPU runs.
    pub fn best() -> Self {
        if has_vnni() {
            Self::Vnni
        } else if super::cpu::has_avx_vnni() {
            Self::AvxVnni
        } else if super::cpu::has_avx2() {
            Self::Avx2
        } else {
            Self::Portable
        }
    }

    /// Whether the kernel reads weights packed in panels (and inputs padded to 4 bytes).
    fn panelled(self) -> bool {
        self != Self::Portable
    }

    /// Whether the kernel reads inputs as unsigned bytes, shifted by +128 (`vpdpbusd`).
    fn shifted(self) -> bool {
        matches!(self, Self::Vnni | Self::AvxVnni)
    }
}

/// A weight (out, in) and its bias, quantized for [`Int8Linear::forward`].
pub struct Int8Linear {
    n_out: usize,
    k: usize,
    kernel: Kernel,
    /// Panelled kernels: panel p holds outputs p·PANEL.. as `[k/4][PANEL][4]` (k padded to a
    /// multiple of 4, outputs past `n_out` zero). Portable: the rows `[n_out][k]`.
    weights: Vec<i8>,
    /// Per output: the weight scale and, for the panels, 128 · Σₖ w (zero-padded to whole
    /// panels; the VNNI kernels' correction).
    scales: Vec<f32>,
    shift: Vec<i32>,
    bias: Vec<f32>,
}

/// Quantizes `x` to int8 with the scale max |x| / 127 (1 for an all-zero row), rounding to
/// nearest, ties to even; writes `q.len()` values (past `x.len()` zeros) and returns the scale.
/// Plain arithmetic, so that it vectorises at any target: adding and subtracting 1.5 · 2²³
/// rounds a float below 2²² to an integer in the default rounding mode.
#[inline(always)]
fn quantize_row(x: &[f32], q: &mut [i8]) -> f32 {
    const ROUND: f32 = 12_582_912.0;
    let amax = super::cpu::lanes_fold(x, 0.0, |m, v| m.max(v.abs()))
        .into_iter()
        .fold(0f32, f32::max);
    if amax == 0.0 || !amax.is_finite() {
        q.fill(0);
        // A non-finite input has no scale that represents it: let it show in the output.
        return if amax == 0.0 { 1.0 } else { amax };
    }
    let inv = 127.0 / amax;
    for (q, &v) in q.iter_mut().zip(x) {
        let r = ((v * inv + ROUND) - ROUND).clamp(-127.0, 127.0);
        // The integer from the bits of r + 1.5 · 2²³ (exact; its unit is one ulp), which
        // vectorises where `r as i8`, a saturating conversion, took scalar code per value.
        let n = (r + ROUND).to_bits().wrapping_sub(ROUND.to_bits()) as i32;
        *q = if r.is_nan() { 0 } else { n as i8 };
    }
    q[x.len()..].fill(0);
    amax / 127.0
}

impl Int8Linear {
    /// Quantizes `weight` (out, in) and keeps `bias` (out, or 1×out), both CPU f32, for
    /// `kernel`.
    pub fn new(weight: &Tensor, bias: &Tensor, kernel: Kernel) -> Result<Self> {
        let (n_out, k) = weight.dims2()?;
        let b = bias.flatten_all()?.to_vec1::<f32>()?;
        if b.len() != n_out {
            candle_core::bail!("int8 linear: bias of {} for {n_out} outputs", b.len());
        }
        let mut rows = vec![0i8; n_out * k];
        let mut scales: Vec<f32> = with_host_f32(weight, |w| {
            rows.par_chunks_mut(k.max(1))
                .zip(w.par_chunks(k.max(1)))
                .map(|(q, w)| quantize_row(w, q))
                .collect()
        })?;
        scales.truncate(n_out);
        let (weights, shift, padded) = match kernel {
            Kernel::Portable => (rows, Vec::new(), n_out),
            Kernel::Vnni | Kernel::AvxVnni | Kernel::Avx2 => {
                let n_panels = n_out.div_ceil(PANEL);
                let panels = panels::pack(&rows, n_out, k, 4, PANEL);
                let mut shift: Vec<i32> = rows
                    .chunks(k.max(1))
                    .take(n_out)
                    .map(|r| 128 * r.iter().map(|&v| v as i32).sum::<i32>())
                    .collect();
                shift.resize(n_panels * PANEL, 0);
                (panels, shift, n_panels * PANEL)
            }
        };
        scales.resize(padded, 0.0);
        let mut bias = b;
        bias.resize(padded, 0.0);
        Ok(Self {
            n_out,
            k,
            kernel,
            weights,
            scales,
            shift,
            bias,
        })
    }

    /// The kernel call for rows r0.. of `q` times panel `p`.
    #[cfg(target_arch = "x86_64")]
    unsafe fn tile_at(&self, p: usize, q: &Quantized, out: &OutPtr, r0: usize, relu: bool) -> Tile {
        let k4 = self.k.div_ceil(4);
        Tile {
            k4,
            x: q.x.as_ptr().add(r0 * q.stride),
            x_stride: q.stride,
            x_scales: q.scales.as_ptr().add(r0),
            panel: self.weights.as_ptr().add(p * k4 * PANEL * 4),
            scales: self.scales.as_ptr().add(p * PANEL),
            shift: self.shift.as_ptr().add(p * PANEL),
            bias: self.bias.as_ptr().add(p * PANEL),
            y: out.at(r0 * self.n_out + p * PANEL),
            y_stride: self.n_out,
            cols: PANEL.min(self.n_out - p * PANEL),
            relu,
            next: panels::next_panel(&self.weights, p, k4 * PANEL * 4, self.n_out),
        }
    }

    /// All rows times panel `p`: TILE_ROWS rows at a time with AVX-512 VNNI, three with
    /// AVX-VNNI, two with AVX2.
    #[cfg(target_arch = "x86_64")]
    unsafe fn panel_rows(&self, p: usize, q: &Quantized, out: &OutPtr, relu: bool) {
        if self.kernel == Kernel::Vnni {
            by_tiles!(q.rows, tile, |r0| self.tile_at(p, q, out, r0, relu));
            return;
        }
        if self.kernel == Kernel::AvxVnni {
            let vex = std::arch::is_x86_feature_detected!("avxvnni");
            let mut r0 = 0;
            while r0 < q.rows {
                let t = self.tile_at(p, q, out, r0, relu);
                let n = (q.rows - r0).min(3);
                match (n, vex) {
                    (3, true) => tile_avx_vnni::<3>(&t),
                    (2, true) => tile_avx_vnni::<2>(&t),
                    (_, true) => tile_avx_vnni::<1>(&t),
                    (3, false) => tile_evex256::<3>(&t),
                    (2, false) => tile_evex256::<2>(&t),
                    (_, false) => tile_evex256::<1>(&t),
                }
                r0 += n;
            }
            return;
        }
        let mut r0 = 0;
        while r0 < q.rows {
            let t = self.tile_at(p, q, out, r0, relu);
            if q.rows - r0 >= 2 {
                tile_avx2::<2>(&t);
                r0 += 2;
            } else {
                tile_avx2::<1>(&t);
                r0 += 1;
            }
        }
    }

    #[cfg(not(target_arch = "x86_64"))]
    unsafe fn panel_rows(&self, _: usize, _: &Quantized, _: &OutPtr, _: bool) {
        unreachable!("panelled layers are only built where their kernel runs")
    }
}

impl RowKernel for Int8Linear {
    const NAME: &'static str = "nmt-int8-linear";

    fn shape(&self) -> (usize, usize) {
        (self.k, self.n_out)
    }

    fn run(&self, x: &[f32], rows: usize, out: &OutPtr, relu: bool) {
        let stride = if self.kernel.panelled() {
            self.k.div_ceil(4) * 4
        } else {
            self.k
        };
        let mut xq = vec![0i8; rows * stride];
        let mut xs = vec![0f32; rows];
        // The VNNI kernels read inputs as unsigned bytes: flipping the sign bit adds 128.
        quantize_rows(x, self.k, &mut xq, &mut xs, self.kernel.shifted());
        let q = Quantized {
            x: &xq,
            scales: &xs,
            rows,
            stride,
        };
        let work = rows * self.n_out * self.k;
        match self.kernel {
            Kernel::Vnni | Kernel::AvxVnni | Kernel::Avx2 => {
                panels::for_each_block(self.n_out.div_ceil(PANEL), work, |p| {
                    // SAFETY: a Vnni (AvxVnni, Avx2) layer is only built where `has_vnni()`
                    // (`has_avx_vnni()`, `has_avx2()`) holds; panel p writes only columns
                    // p·PANEL.. of y, disjoint from every other panel's.
                    unsafe { self.panel_rows(p, &q, out, relu) }
                })
            }
            Kernel::Portable => {
                const COLS: usize = 16;
                panels::for_each_block(self.n_out.div_ceil(COLS), work, |c| {
                    let cols = c * COLS..((c + 1) * COLS).min(self.n_out);
                    widest!(portable_block(self, cols, &q, out, relu));
                });
            }
        }
    }
}

/// Calls `f(args)` compiled for AVX-512 where the CPU has it, else for AVX2, else for the
/// baseline: the integer and rounding loops of this file vectorise as wide as the CPU allows.
/// (A function called in it, unlike a closure handed to [`super::cpu::wide`], is surely
/// compiled inside; one passed in as a value is called through a shim compiled for the
/// baseline: pass an `#[inline(always)]` closure instead.)
macro_rules! widest {
    ($f:ident($($a:expr),*)) => {{
        #[cfg(target_arch = "x86_64")]
        {
            if super::cpu::has_avx512() {
                #[target_feature(enable = "avx512f,avx512dq,avx512bw,avx512vl")]
                unsafe fn avx512(f: impl FnOnce()) { f() }
                // SAFETY: the CPU has the enabled features.
                unsafe { avx512(#[inline(always)] || $f($($a),*)) }
            } else if super::cpu::has_avx2() {
                #[target_feature(enable = "avx2,fma")]
                unsafe fn avx2(f: impl FnOnce()) { f() }
                // SAFETY: the CPU has the enabled features.
                unsafe { avx2(#[inline(always)] || $f($($a),*)) }
            } else {
                $f($($a),*)
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        $f($($a),*)
    }};
}
use widest;

/// Quantizes each row of `x` (rows of `k`) into a row of `q`, its scale into `scales`: blocks
/// of rows in parallel, each row in AVX-512 where the CPU has it, else the plain loop compiled
/// for the widest vectors there are (the same values either way).
/// With `flip`, each value's sign bit flipped (+128 as an unsigned byte), in the same pass.
fn quantize_rows(x: &[f32], k: usize, q: &mut [i8], scales: &mut [f32], flip: bool) {
    let (k, stride) = (k.max(1), (q.len() / scales.len().max(1)).max(1));
    let rows = super::rows_per_task(k);
    q.par_chunks_mut(stride * rows)
        .zip(scales.par_chunks_mut(rows))
        .zip(x.par_chunks(k * rows))
        .for_each(|((q, scales), x)| {
            #[cfg(target_arch = "x86_64")]
            if super::cpu::has_avx512() {
                // SAFETY: the CPU has AVX-512; each q row holds at least its x row's values.
                let row = |x: &[f32], q: &mut [i8]| unsafe { quantize_row_avx512(x, q, flip) };
                return quantize_block(x, k, q, stride, scales, row);
            }
            // A closure, inlined: `quantize_row` passed as a value ran in SSE2 (see `widest`).
            widest!(quantize_block(
                x,
                k,
                q,
                stride,
                scales,
                #[inline(always)]
                |x: &[f32], q: &mut [i8]| quantize_row(x, q)
            ));
            if flip {
                q.iter_mut().for_each(|v| *v ^= i8::MIN);
            }
        });
}

/// `row` (a row quantizer) for each row of a block.
#[inline(always)]
fn quantize_block(
    x: &[f32],
    k: usize,
    q: &mut [i8],
    stride: usize,
    scales: &mut [f32],
    row: impl Fn(&[f32], &mut [i8]) -> f32,
) {
    for ((q, s), x) in q.chunks_mut(stride).zip(scales).zip(x.chunks(k)) {
        *s = row(x, q);
    }
}

/// [`quantize_row`] in AVX-512: the same values (conversion rounds to nearest even in the
/// default rounding mode; the values are within ±127 already, so saturation changes none),
/// with `flip` each with its sign bit flipped as it is stored.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn quantize_row_avx512(x: &[f32], q: &mut [i8], flip: bool) -> f32 {
    use std::arch::x86_64::*;
    let n = x.len();
    let tail = |i: usize| -> __mmask16 { ((1u32 << (n - i).min(16)) - 1) as __mmask16 };
    let mut m = _mm512_setzero_ps();
    let mut i = 0;
    while i < n {
        let v = _mm512_maskz_loadu_ps(tail(i), x.as_ptr().add(i));
        m = _mm512_max_ps(m, _mm512_abs_ps(v));
        i += 16;
    }
    let amax = _mm512_reduce_max_ps(m);
    let (zero, sign) = if flip {
        (i8::MIN, _mm_set1_epi8(i8::MIN))
    } else {
        (0, _mm_setzero_si128())
    };
    if amax == 0.0 || !amax.is_finite() {
        q.fill(zero);
        return if amax == 0.0 { 1.0 } else { amax };
    }
    let inv = _mm512_set1_ps(127.0 / amax);
    let mut i = 0;
    while i < n {
        let v = _mm512_maskz_loadu_ps(tail(i), x.as_ptr().add(i));
        let r = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v, inv)));
        _mm_mask_storeu_epi8(
            q.as_mut_ptr().add(i).cast(),
            tail(i),
            _mm_xor_si128(r, sign),
        );
        i += 16;
    }
    q[n..].fill(zero);
    amax / 127.0
}

/// y[r][j] for every row r and the outputs `cols`, one i8 dot product each.
#[inline(always)]
fn portable_block(
    w: &Int8Linear,
    cols: std::ops::Range<usize>,
    q: &Quantized,
    out: &OutPtr,
    relu: bool,
) {
    for j in cols {
        let wr = &w.weights[j * w.k..(j + 1) * w.k];
        for r in 0..q.rows {
            let x = &q.x[r * q.stride..r * q.stride + w.k];
            let acc: i32 = x.iter().zip(wr).map(|(&a, &b)| a as i32 * b as i32).sum();
            let mut v = acc as f32 * (q.scales[r] * w.scales[j]) + w.bias[j];
            if relu {
                v = v.max(0.0);
            }
            // SAFETY: element (r, j) lies in y and only this block writes column j.
            unsafe { *out.at(r * w.n_out + j) = v };
        }
    }
}

/// Input rows quantized for one product: `rows` rows of `stride` values, and their scales.
/// For the VNNI kernel the values are stored as unsigned bytes shifted by +128.
struct Quantized<'a> {
    x: &'a [i8],
    scales: &'a [f32],
    rows: usize,
    stride: usize,
}

/// One VNNI kernel call: R rows of x times one panel.
struct Tile {
    k4: usize,
    x: *const i8,
    x_stride: usize,
    x_scales: *const f32,
    panel: *const i8,
    scales: *const f32,
    shift: *const i32,
    bias: *const f32,
    y: *mut f32,
    y_stride: usize,
    cols: usize,
    relu: bool,
    /// The next panel (null for the last), fetched into L2 while this one is multiplied (as
    /// the f32 kernel does: see `packed`).
    next: *const i8,
}

/// y[r][0..cols] = (Σₖ (x[r][k] + 128) · w[k] − 128 · Σₖ w[k]) · (sₓ[r] · s_w) + b for R rows,
/// then ReLU when asked: the portable kernel's integers, scaled in its order.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn tile<const R: usize>(t: &Tile) {
    use std::arch::x86_64::*;
    let mut lo = [_mm512_setzero_si512(); R];
    let mut hi = [_mm512_setzero_si512(); R];
    for g in 0..t.k4 {
        if !t.next.is_null() {
            _mm_prefetch::<_MM_HINT_T1>(t.next.add(g * PANEL * 4));
            _mm_prefetch::<_MM_HINT_T1>(t.next.add(g * PANEL * 4 + 64));
        }
        let w0 = _mm512_loadu_si512(t.panel.add(g * PANEL * 4).cast());
        let w1 = _mm512_loadu_si512(t.panel.add(g * PANEL * 4 + 64).cast());
        for r in 0..R {
            let four =
                t.x.add(r * t.x_stride + g * 4)
                    .cast::<i32>()
                    .read_unaligned();
            let xv = _mm512_set1_epi32(four);
            lo[r] = _mm512_dpbusd_epi32(lo[r], xv, w0);
            hi[r] = _mm512_dpbusd_epi32(hi[r], xv, w1);
        }
    }
    let (s0, s1) = (_mm512_loadu_ps(t.scales), _mm512_loadu_ps(t.scales.add(16)));
    let (c0, c1) = (
        _mm512_loadu_si512(t.shift.cast()),
        _mm512_loadu_si512(t.shift.add(16).cast()),
    );
    let (b0, b1) = (_mm512_loadu_ps(t.bias), _mm512_loadu_ps(t.bias.add(16)));
    for r in 0..R {
        let sx = _mm512_set1_ps(*t.x_scales.add(r));
        let f0 = _mm512_cvtepi32_ps(_mm512_sub_epi32(lo[r], c0));
        let f1 = _mm512_cvtepi32_ps(_mm512_sub_epi32(hi[r], c1));
        let v0 = _mm512_add_ps(_mm512_mul_ps(f0, _mm512_mul_ps(sx, s0)), b0);
        let v1 = _mm512_add_ps(_mm512_mul_ps(f1, _mm512_mul_ps(sx, s1)), b1);
        panels::store_row(t.y.add(r * t.y_stride), t.cols, v0, v1, t.relu);
    }
}

/// [`tile`] on 256-bit registers for R (≤ 3) rows, with `$dpbusd` compiled for `$features`:
/// AVX-VNNI's encoding of `vpdpbusd`, or AVX-512 VNNI's (the same instruction on the same
/// registers, for `NMT_CPU_ISA=avx_vnni` on a CPU without AVX-VNNI).
macro_rules! tile_vnni256 {
    ($name:ident, $features:literal, $dpbusd:ident) => {
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $features)]
        unsafe fn $name<const R: usize>(t: &Tile) {
            use std::arch::x86_64::*;
            let mut acc = [[_mm256_setzero_si256(); 4]; R];
            for g in 0..t.k4 {
                if !t.next.is_null() {
                    _mm_prefetch::<_MM_HINT_T1>(t.next.add(g * PANEL * 4));
                    _mm_prefetch::<_MM_HINT_T1>(t.next.add(g * PANEL * 4 + 64));
                }
                // R inputs, then one weight register at a time: 4R + R + 1 ≤ 16 registers.
                let xv: [__m256i; R] = std::array::from_fn(|r| {
                    let four = t.x.add(r * t.x_stride + g * 4).cast::<i32>();
                    _mm256_set1_epi32(four.read_unaligned())
                });
                let w = t.panel.add(g * PANEL * 4);
                for i in 0..4 {
                    let wv = _mm256_loadu_si256(w.add(32 * i).cast());
                    for r in 0..R {
                        acc[r][i] = $dpbusd(acc[r][i], xv[r], wv);
                    }
                }
            }
            for (r, acc) in acc.iter().enumerate() {
                let sx = _mm256_set1_ps(*t.x_scales.add(r));
                let v = [0, 1, 2, 3].map(|i| {
                    let c = _mm256_loadu_si256(t.shift.add(8 * i).cast());
                    let s = _mm256_loadu_ps(t.scales.add(8 * i));
                    let b = _mm256_loadu_ps(t.bias.add(8 * i));
                    let f = _mm256_cvtepi32_ps(_mm256_sub_epi32(acc[i], c));
                    _mm256_add_ps(_mm256_mul_ps(f, _mm256_mul_ps(sx, s)), b)
                });
                panels::store_row_avx2(t.y.add(r * t.y_stride), t.cols, v, t.relu);
            }
        }
    };
}
tile_vnni256!(tile_avx_vnni, "avx2,fma,avxvnni", _mm256_dpbusd_avx_epi32);
tile_vnni256!(
    tile_evex256,
    "avx2,fma,avx512vnni,avx512vl",
    _mm256_dpbusd_epi32
);

/// [`tile`]'s result with AVX2 for R (≤ 2) rows: x · w summed exactly in i32 as
/// |x| · (w with x's sign), then scaled in the portable kernel's order.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn tile_avx2<const R: usize>(t: &Tile) {
    use std::arch::x86_64::*;
    let ones = _mm256_set1_epi16(1);
    let mut acc = [[_mm256_setzero_si256(); 4]; R];
    for g in 0..t.k4 {
        let w = t.panel.add(g * PANEL * 4);
        let wv = [0, 1, 2, 3].map(|i| _mm256_loadu_si256(w.add(32 * i).cast()));
        for (r, acc) in acc.iter_mut().enumerate() {
            let four =
                t.x.add(r * t.x_stride + g * 4)
                    .cast::<i32>()
                    .read_unaligned();
            let xv = _mm256_set1_epi32(four);
            let ax = _mm256_abs_epi8(xv);
            for (a, &wv) in acc.iter_mut().zip(&wv) {
                let pairs = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(wv, xv));
                *a = _mm256_add_epi32(*a, _mm256_madd_epi16(pairs, ones));
            }
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        let sx = _mm256_set1_ps(*t.x_scales.add(r));
        let v = [0, 1, 2, 3].map(|i| {
            let s = _mm256_loadu_ps(t.scales.add(8 * i));
            let b = _mm256_loadu_ps(t.bias.add(8 * i));
            _mm256_add_ps(
                _mm256_mul_ps(_mm256_cvtepi32_ps(acc[i]), _mm256_mul_ps(sx, s)),
                b,
            )
        });
        panels::store_row_avx2(t.y.add(r * t.y_stride), t.cols, v, t.relu);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::tests::randn;

    /// The int8 product against the exact one, computed in f64, within the bound that
    /// per-row quantization guarantees: rounding moves each x by at most sₓ/2 and each w by
    /// at most s_w/2, so |y − ŷ| ≤ Σₖ (|x|·s_w/2 + |w|·sₓ/2 + sₓ·s_w/4), plus f32 rounding.
    #[test]
    fn int8_product_is_within_the_quantization_bound_of_the_exact_product() {
        for &(rows, n_out, k) in &[(1, 5, 3), (7, 33, 16), (9, 64, 256), (21, 100, 41)] {
            let x = randn(&[rows, k], 1);
            let w = randn(&[n_out, k], 2);
            let b = randn(&[1, n_out], 3);
            let (xv, wv, bv) = (
                x.to_vec2::<f32>().unwrap(),
                w.to_vec2::<f32>().unwrap(),
                b.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            );
            let amax = |v: &[f32]| v.iter().fold(0f64, |m, a| m.max(a.abs() as f64));
            let mut kernels = vec![Kernel::Portable, Kernel::best()];
            if super::super::cpu::has_avx_vnni() {
                kernels.push(Kernel::AvxVnni);
            }
            if super::super::cpu::has_avx2() {
                kernels.push(Kernel::Avx2);
            }
            for kernel in kernels {
                let layer = Int8Linear::new(&w, &b, kernel).unwrap();
                let got = layer.forward(&x, false).unwrap().to_vec2::<f32>().unwrap();
                for r in 0..rows {
                    let sx = amax(&xv[r]) / 127.0;
                    for j in 0..n_out {
                        let sw = amax(&wv[j]) / 127.0;
                        let (mut exact, mut bound) = (bv[j] as f64, 0f64);
                        for kk in 0..k {
                            let (a, c) = (xv[r][kk] as f64, wv[j][kk] as f64);
                            exact += a * c;
                            bound += a.abs() * sw / 2.0 + c.abs() * sx / 2.0 + sx * sw / 4.0;
                        }
                        let err = (got[r][j] as f64 - exact).abs();
                        assert!(
                            err <= bound + 1e-4 * (1.0 + exact.abs()),
                            "{kernel:?} {rows}×{k}·{k}×{n_out} at ({r},{j}): {} vs {exact}, \
                             error {err} > bound {bound}",
                            got[r][j]
                        );
                    }
                }
            }
        }
    }

    /// The kernels sum the same integers and scale them in the same order: equal outputs.
    #[test]
    fn the_simd_kernels_equal_the_portable_one_bit_for_bit() {
        let mut kernels = Vec::new();
        if has_vnni() {
            kernels.push(Kernel::Vnni);
        } else {
            eprintln!("not compared: this CPU has no AVX-512 VNNI");
        }
        if super::super::cpu::has_avx_vnni() {
            kernels.push(Kernel::AvxVnni);
        } else {
            eprintln!("not compared: this CPU has no AVX-VNNI (nor AVX-512 VNNI)");
        }
        if super::super::cpu::has_avx2() {
            kernels.push(Kernel::Avx2);
        } else {
            eprintln!("not compared: this CPU has no AVX2");
        }
        for &(rows, n_out, k) in &[
            (1, 5, 3),
            (8, 32, 256),
            (13, 70, 1024),
            (64, 31, 9),
            (3, 40, 7),
            (70, 1000, 256),
        ] {
            let x = randn(&[rows, k], 4);
            let w = randn(&[n_out, k], 5);
            let b = randn(&[1, n_out], 6);
            for relu in [false, true] {
                let f = |kernel| {
                    Int8Linear::new(&w, &b, kernel)
                        .unwrap()
                        .forward(&x, relu)
                        .unwrap()
                        .flatten_all()
                        .unwrap()
                        .to_vec1::<f32>()
                        .unwrap()
                };
                let want = f(Kernel::Portable);
                for &kernel in &kernels {
                    let got = f(kernel);
                    assert!(
                        got.iter()
                            .zip(&want)
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{kernel:?} {rows}×{k}·{k}×{n_out} relu {relu}"
                    );
                }
                if relu {
                    assert!(want.iter().all(|&v| v >= 0.0));
                }
            }
        }
    }

    #[test]
    fn quantization_in_avx512_equals_the_portable_loop() {
        #[cfg(target_arch = "x86_64")]
        if super::super::cpu::has_avx512() {
            for (n, pad) in [(1, 3), (16, 0), (37, 3), (256, 0)] {
                let x = randn(&[1, n], n as u64).flatten_all().unwrap();
                let x = x.to_vec1::<f32>().unwrap();
                let (mut a, mut b) = (vec![1i8; n + pad], vec![1i8; n + pad]);
                let sa = quantize_row(&x, &mut a);
                // SAFETY: the CPU has AVX-512; b holds n + pad values.
                let sb = unsafe { quantize_row_avx512(&x, &mut b, false) };
                let mut c = vec![1i8; n + pad];
                // SAFETY: as above.
                let sc = unsafe { quantize_row_avx512(&x, &mut c, true) };
                let flipped: Vec<i8> = c.iter().map(|v| v ^ i8::MIN).collect();
                assert_eq!((sc, &flipped), (sa, &a), "{n} values, flipped");
                assert_eq!((sa, &a), (sb, &b), "{n} values");
            }
            return;
        }
        eprintln!("skipped: this CPU has no AVX-512, only the portable quantization runs");
    }

    #[test]
    fn quantization_rounds_to_the_nearest_step_and_keeps_zero_rows() {
        let mut q = [0i8; 6];
        let s = quantize_row(&[127.0, -63.5, 62.5, 0.4], &mut q);
        assert_eq!(s, 1.0);
        assert_eq!(q, [127, -64, 62, 0, 0, 0]); // ties to even; padding zero
        assert_eq!(quantize_row(&[0.0, 0.0], &mut q[..2]), 1.0);
        assert_eq!(q[..2], [0, 0]);
    }
}
