//! Linear layers in bfloat16, for inference: each weight rounded to bfloat16 once, each input
//! when the layer runs, and the products, exact in f32, summed in f32. `--compute-type int8`
//! runs the encoder's self-attention projections so: in int8 they took the demo model's lines
//! equal to its float32 translations below 90 % (90.4 % / 89.4 %, greedy / beam 5), in f32
//! they were the slowest product of an int8 model, and bfloat16 runs at twice f32's rate with
//! a relative rounding error of 2⁻⁹ per value.
//!
//! Two kernels give the same bits:
//! - AVX-512 BF16 (Zen 4, Cooper Lake, Sapphire Rapids and later): `vdpbf16ps` multiplies
//!   pairs of bfloat16 and adds both products to an f32 lane, the odd element's first,
//!   rounding after each addition (as Intel's manual specifies; Zen 4 matched that order on
//!   10⁶ random cases). Weights are packed once into panels of [`PANEL`] outputs × 2 inputs,
//!   as the instruction reads them, and [`panels::TILE_ROWS`] input rows are multiplied by one
//!   panel at a time.
//! - Elsewhere with AVX2: the f32 kernel of [`super::packed`] over the rounded values, the two
//!   inputs of each pair swapped so that its fused multiply-adds take the odd one first. The
//!   product of two bfloat16 is exact in f32, so each fused multiply-add rounds once, as the
//!   instruction's addition does.
//!
//! Rounding is to nearest, ties to even; values below f32's normal range round to zero, as the
//! instruction reads them (it also flushes subnormal results to zero, which the f32 kernel
//! does not: the one case, far below the size of any activation, where the two could differ).
//! Without AVX2, [`Bf16Linear::new`] returns `None` and callers take the general f32 path.

use super::cpu::panels::{self, by_tiles, RowKernel, PANEL};
use super::cpu::{wide, OutPtr};
use super::packed::Packed;
use super::with_host_f32;
use candle_core::{Result, Tensor};

/// Whether this CPU has the AVX-512 BF16 kernel's instructions.
pub(crate) fn has_bf16() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        super::cpu::has_avx512() && std::arch::is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `x` rounded to the nearest bfloat16 (ties to even), as its 16 bits: zero and subnormals
/// become a zero of their sign, NaN a quiet NaN. Selects, not branches, so that a loop of it
/// vectorises.
#[inline(always)]
pub(crate) fn round(x: f32) -> u16 {
    let b = x.to_bits();
    let sign = (b >> 16) & 0x8000;
    let nearest = b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16;
    let r = if b & 0x7f80_0000 == 0 {
        sign
    } else if x.is_nan() {
        sign | 0x7fc0
    } else {
        nearest
    };
    r as u16
}

/// The f32 value of bfloat16 bits.
#[inline(always)]
fn widen(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

/// A weight (out, in) and its bias, rounded for [`Bf16Linear`]'s kernel.
pub struct Bf16Linear {
    n_out: usize,
    k: usize,
    kernel: Kernel,
}

enum Kernel {
    /// `vdpbf16ps`: panel p holds outputs p·PANEL.. as `[k/2][PANEL][2]` bfloat16 (k padded to
    /// even, padding and outputs past `n_out` zero); the bias zero-padded to whole panels.
    Dpbf16 { panels: Vec<u16>, bias: Vec<f32> },
    /// The f32 kernel over the rounded weights, k padded to even, each pair of inputs swapped.
    Fma(Packed),
}

impl Bf16Linear {
    /// Rounds `weight` (out, in) and keeps `bias` (out, or 1×out), both CPU f32, for the
    /// AVX-512 BF16 kernel when `native` is set and the CPU has it, else for the f32 kernel;
    /// `None` where neither runs.
    pub fn new(weight: &Tensor, bias: &Tensor, native: bool) -> Result<Option<Self>> {
        let (n_out, k) = weight.dims2()?;
        if native && has_bf16() {
            let mut b = bias.flatten_all()?.to_vec1::<f32>()?;
            if b.len() != n_out {
                candle_core::bail!("bf16 linear: bias of {} for {n_out} outputs", b.len());
            }
            b.resize(n_out.div_ceil(PANEL) * PANEL, 0.0);
            let rounded: Vec<u16> =
                with_host_f32(weight, |w| w.iter().map(|&v| round(v)).collect())?;
            return Ok(Some(Self {
                n_out,
                k,
                kernel: Kernel::Dpbf16 {
                    panels: panels::pack(&rounded, n_out, k, 2, PANEL),
                    bias: b,
                },
            }));
        }
        let kp = k.div_ceil(2) * 2;
        let mut swapped = vec![0f32; n_out * kp];
        with_host_f32(weight, |w| {
            for (row, w) in swapped.chunks_mut(kp).zip(w.chunks(k.max(1))) {
                swap_pairs(w, row);
            }
        })?;
        let swapped = Tensor::from_vec(swapped, (n_out, kp), weight.device())?;
        Ok(Packed::new(&swapped, bias, true)?.map(|p| Self {
            n_out,
            k,
            kernel: Kernel::Fma(p),
        }))
    }

    /// All rows (`x`: pairs of bfloat16, `k2` per row) times panel `p`, TILE_ROWS at a time.
    #[cfg(target_arch = "x86_64")]
    unsafe fn panel_rows(&self, p: usize, x: &[u32], rows: usize, out: &OutPtr, relu: bool) {
        let Kernel::Dpbf16 { panels, bias } = &self.kernel else {
            unreachable!("only the native kernel reads panels of pairs")
        };
        let k2 = self.k.div_ceil(2);
        let tile_at = |r0: usize| Tile {
            k2,
            x: x.as_ptr().add(r0 * k2),
            panel: panels.as_ptr().add(p * k2 * PANEL * 2),
            bias: bias.as_ptr().add(p * PANEL),
            y: out.at(r0 * self.n_out + p * PANEL),
            y_stride: self.n_out,
            cols: PANEL.min(self.n_out - p * PANEL),
            relu,
            next: panels::next_panel(panels, p, k2 * PANEL * 2, self.n_out),
        };
        by_tiles!(rows, tile, |r0| tile_at(r0));
    }

    #[cfg(not(target_arch = "x86_64"))]
    unsafe fn panel_rows(&self, _: usize, _: &[u32], _: usize, _: &OutPtr, _: bool) {
        unreachable!("the native kernel is only built where it runs")
    }
}

/// `row` (k values) rounded to bfloat16 into `out` (k padded to even, the padding zero), the
/// two values of each pair swapped: the f32 kernel's order for [`Bf16Linear`]'s products.
#[inline(always)]
fn swap_pairs(row: &[f32], out: &mut [f32]) {
    for (i, o) in out.chunks_exact_mut(2).enumerate() {
        let at = |j: usize| row.get(j).map_or(0.0, |&v| widen(round(v)));
        o[0] = at(2 * i + 1);
        o[1] = at(2 * i);
    }
}

/// `row` (k values) rounded to bfloat16 as pairs, the even value in the low half, as
/// `vdpbf16ps` reads them (k padded to even with zero).
#[inline(always)]
fn to_pairs(row: &[f32], out: &mut [u32]) {
    let (pairs, last) = row.split_at(row.len() / 2 * 2);
    for (o, p) in out.iter_mut().zip(pairs.chunks_exact(2)) {
        *o = round(p[0]) as u32 | (round(p[1]) as u32) << 16;
    }
    if let [v] = last {
        out[pairs.len() / 2] = round(*v) as u32;
    }
}

impl RowKernel for Bf16Linear {
    const NAME: &'static str = "nmt-bf16-linear";

    fn shape(&self) -> (usize, usize) {
        (self.k, self.n_out)
    }

    fn run(&self, x: &[f32], rows: usize, out: &OutPtr, relu: bool) {
        let k = self.k.max(1);
        match &self.kernel {
            Kernel::Dpbf16 { .. } => {
                let k2 = self.k.div_ceil(2);
                let mut pairs = vec![0u32; rows * k2];
                wide(|| {
                    for (o, row) in pairs.chunks_mut(k2.max(1)).zip(x.chunks(k)) {
                        to_pairs(row, o);
                    }
                });
                panels::for_each_block(self.n_out.div_ceil(PANEL), rows * self.n_out * k, |p| {
                    // SAFETY: a Dpbf16 layer is only built where `has_bf16()` holds; panel p
                    // writes only columns p·PANEL.. of y, disjoint from every other panel's.
                    unsafe { self.panel_rows(p, &pairs, rows, out, relu) }
                });
            }
            Kernel::Fma(packed) => {
                let kp = self.k.div_ceil(2) * 2;
                let mut swapped = vec![0f32; rows * kp];
                wide(|| {
                    for (o, row) in swapped.chunks_mut(kp.max(1)).zip(x.chunks(k)) {
                        swap_pairs(row, o);
                    }
                });
                packed.run(&swapped, rows, out, relu);
            }
        }
    }
}

/// One kernel call: R rows of x (pairs of bfloat16) times one panel.
struct Tile {
    k2: usize,
    x: *const u32,
    panel: *const u16,
    bias: *const f32,
    y: *mut f32,
    y_stride: usize,
    cols: usize,
    relu: bool,
    /// The next panel (null for the last), fetched into L2 while this one is multiplied.
    next: *const u16,
}

/// y[r][0..cols] = bias + Σ pairs of x[r] · panel for R rows, each pair's odd product added
/// first, then ReLU when asked.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn tile<const R: usize>(t: &Tile) {
    use std::arch::x86_64::*;
    let mut lo = [_mm512_setzero_ps(); R];
    let mut hi = [_mm512_setzero_ps(); R];
    for g in 0..t.k2 {
        if !t.next.is_null() {
            _mm_prefetch::<_MM_HINT_T1>(t.next.add(g * PANEL * 2).cast());
            _mm_prefetch::<_MM_HINT_T1>(t.next.add(g * PANEL * 2 + 32).cast());
        }
        let w0: __m512bh =
            std::mem::transmute(_mm512_loadu_si512(t.panel.add(g * PANEL * 2).cast()));
        let w1: __m512bh =
            std::mem::transmute(_mm512_loadu_si512(t.panel.add(g * PANEL * 2 + 32).cast()));
        for r in 0..R {
            let xv: __m512bh =
                std::mem::transmute(_mm512_set1_epi32(*t.x.add(r * t.k2 + g) as i32));
            lo[r] = _mm512_dpbf16_ps(lo[r], xv, w0);
            hi[r] = _mm512_dpbf16_ps(hi[r], xv, w1);
        }
    }
    let (b0, b1) = (_mm512_loadu_ps(t.bias), _mm512_loadu_ps(t.bias.add(16)));
    for r in 0..R {
        let (v0, v1) = (_mm512_add_ps(b0, lo[r]), _mm512_add_ps(b1, hi[r]));
        panels::store_row(t.y.add(r * t.y_stride), t.cols, v0, v1, t.relu);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::tests::randn;

    #[test]
    fn rounding_is_to_nearest_even_and_flushes_subnormals() {
        let b = |bits: u32| round(f32::from_bits(bits));
        assert_eq!(b(0x3f80_0000), 0x3f80); // 1.0
        assert_eq!(b(0x3f80_8000), 0x3f80); // tie, even below
        assert_eq!(b(0x3f81_8000), 0x3f82); // tie, even above
        assert_eq!(b(0x3f80_8001), 0x3f81);
        assert_eq!(b(0xbf80_7fff), 0xbf80);
        assert_eq!(b(0x0000_1234), 0x0000); // subnormal
        assert_eq!(b(0x8040_0000), 0x8000);
        assert_eq!(b(0x7f7f_ffff), 0x7f80); // rounds up to infinity
        assert_eq!(b(0xff80_0000), 0xff80);
        assert_eq!(b(0x7fc0_0001) & 0x7fc0, 0x7fc0);
        assert_eq!(b(0x7f80_0001) & 0x7fc0, 0x7fc0); // a NaN stays NaN
    }

    /// The product against the exact one in f64, within the bound rounding guarantees: each x
    /// and w moves by at most 2⁻⁹ of itself, so |y − ŷ| ≤ Σₖ |x·w| · (2⁻⁸ + 2⁻¹⁸), plus the
    /// f32 sum's rounding (≤ k · 2⁻²⁴ · Σₖ |x·w|).
    #[test]
    fn bf16_product_is_within_the_rounding_bound_of_the_exact_product() {
        for &(rows, n_out, k) in &[(1, 5, 3), (7, 33, 16), (9, 64, 256), (21, 100, 41)] {
            let (x, w, b) = (
                randn(&[rows, k], 1),
                randn(&[n_out, k], 2),
                randn(&[1, n_out], 3),
            );
            let (xv, wv) = (x.to_vec2::<f32>().unwrap(), w.to_vec2::<f32>().unwrap());
            let bv = b.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            for native in [true, false] {
                let Some(layer) = Bf16Linear::new(&w, &b, native).unwrap() else {
                    eprintln!("not compared: this CPU has no AVX2");
                    return;
                };
                let got = layer.forward(&x, false).unwrap().to_vec2::<f32>().unwrap();
                for r in 0..rows {
                    for j in 0..n_out {
                        let (mut exact, mut mass) = (bv[j] as f64, 0f64);
                        for kk in 0..k {
                            exact += xv[r][kk] as f64 * wv[j][kk] as f64;
                            mass += (xv[r][kk] as f64 * wv[j][kk] as f64).abs();
                        }
                        let bound = mass
                            * (2f64.powi(-8) + 2f64.powi(-18) + k as f64 * 2f64.powi(-24))
                            + 1e-6 * (1.0 + exact.abs());
                        let err = (got[r][j] as f64 - exact).abs();
                        assert!(
                            err <= bound,
                            "native {native} {rows}×{k}·{k}×{n_out} at ({r},{j}): {} vs {exact}, \
                             error {err} > bound {bound}",
                            got[r][j]
                        );
                    }
                }
            }
        }
    }

    /// The f32 kernel over swapped pairs adds as `vdpbf16ps` does: the same bits, so an int8
    /// model translates alike on CPUs with and without AVX-512 BF16.
    #[test]
    fn the_avx512_bf16_kernel_equals_the_f32_one_bit_for_bit() {
        if !has_bf16() {
            eprintln!("not compared: this CPU has no AVX-512 BF16");
            return;
        }
        for &(rows, n_out, k) in &[(1, 5, 3), (8, 32, 256), (13, 70, 1023), (70, 768, 256)] {
            let (x, w, b) = (
                randn(&[rows, k], 4),
                randn(&[n_out, k], 5),
                randn(&[1, n_out], 6),
            );
            for relu in [false, true] {
                let run = |native| {
                    Bf16Linear::new(&w, &b, native)
                        .unwrap()
                        .unwrap()
                        .forward(&x, relu)
                        .unwrap()
                        .flatten_all()
                        .unwrap()
                        .to_vec1::<f32>()
                        .unwrap()
                };
                let (native, fma) = (run(true), run(false));
                assert!(
                    native
                        .iter()
                        .zip(&fma)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{rows}×{k}·{k}×{n_out} relu {relu}"
                );
            }
        }
    }
}
