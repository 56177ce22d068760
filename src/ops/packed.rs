//! Linear layers with their weights packed once, for inference. A general matrix product packs
//! its weight operand into cache-friendly panels on every call; a decoding step multiplies a
//! few hundred rows by every weight matrix, so that packing (the whole 8 MB output projection
//! at every step) cost as much as a third of the product. Here each weight is packed once per
//! loaded model into panels of [`PANEL`] output columns stored input-major, and an AVX-512
//! kernel multiplies up to [`panels::TILE_ROWS`] rows by one panel at a time with the panel
//! in cache.
//! Elsewhere (no AVX-512, other architectures) [`Packed::new`] returns `None` and callers use
//! the general path. It owns only the packed copies: trainable weights, which change at every
//! step, must not be packed (`Linear` packs only weights loaded from a file). With
//! [`ComputeType::Int8`] the cell holds the layer quantized to int8 instead ([`super::int8`]).

use super::cpu::panels::{self, by_tiles, RowKernel, PANEL};
use super::cpu::{has_avx512, OutPtr};
use super::int8::{self, Int8Linear};
use candle_core::{DType, Result, Tensor};
use std::sync::OnceLock;

/// How the linear layers of a loaded model compute (`--compute-type`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ComputeType {
    /// In f32, through the packed AVX-512 kernel where it runs, else the general product.
    #[default]
    Float32,
    /// Weights and inputs quantized to int8 ([`super::int8`]); CPU only.
    Int8,
}

/// A loaded layer's packed weights, made on its first use where the kernel runs.
#[derive(Default)]
pub struct PackedCell {
    compute: ComputeType,
    packed: OnceLock<Option<Kernel>>,
}

/// A layer's weights in the form its kernel reads.
enum Kernel {
    F32(Packed),
    Int8(Int8Linear),
}

impl PackedCell {
    pub fn new(compute: ComputeType) -> Self {
        Self {
            compute,
            packed: OnceLock::new(),
        }
    }

    /// `x` (..., in) times `weight` (out, in) transposed plus `bias`, then ReLU when `relu`,
    /// through the packed or int8 kernel; `None` where no such kernel runs (another device or
    /// dtype, f32 without AVX-512), and the caller takes the general path.
    pub fn forward(
        &self,
        x: &Tensor,
        weight: &Tensor,
        bias: &Tensor,
        relu: bool,
    ) -> Result<Option<Tensor>> {
        if x.dtype() != DType::F32 || !x.device().is_cpu() {
            return Ok(None);
        }
        if self.packed.get().is_none() {
            let kernel = match self.compute {
                ComputeType::Float32 => Packed::new(weight, bias)?.map(Kernel::F32),
                ComputeType::Int8 => Some(Kernel::Int8(Int8Linear::new(
                    weight,
                    bias,
                    int8::Kernel::best(),
                )?)),
            };
            let _ = self.packed.set(kernel);
        }
        let Some(kernel) = self.packed.get().and_then(Option::as_ref) else {
            return Ok(None);
        };
        let mut dims = x.dims().to_vec();
        let x2 = x.reshape(((), dims[dims.len() - 1]))?;
        let (y, n_out) = match kernel {
            Kernel::F32(p) => (p.forward(&x2, relu)?, p.n_out),
            Kernel::Int8(q) => (q.forward(&x2, relu)?, q.shape().1),
        };
        *dims
            .last_mut()
            .expect("a linear layer's input has dimensions") = n_out;
        Ok(Some(y.reshape(dims)?))
    }
}

/// A weight (out, in) and its bias, packed for [`Packed::forward`].
pub struct Packed {
    n_out: usize,
    k: usize,
    /// Panel p holds columns p·PANEL.. as `[k][PANEL]`, zero-padded past `n_out`.
    panels: Vec<f32>,
    /// The bias, zero-padded to whole panels.
    bias: Vec<f32>,
}

impl Packed {
    /// Packs `weight` (out, in) and `bias` (out, or 1×out), both CPU f32; `None` where the
    /// kernel cannot run (other devices or dtypes, no AVX-512).
    pub fn new(weight: &Tensor, bias: &Tensor) -> Result<Option<Self>> {
        if !has_avx512() || !weight.device().is_cpu() || weight.dtype() != candle_core::DType::F32 {
            return Ok(None);
        }
        let (n_out, k) = weight.dims2()?;
        let w = weight.flatten_all()?.to_vec1::<f32>()?;
        let b = bias.flatten_all()?.to_vec1::<f32>()?;
        if b.len() != n_out {
            candle_core::bail!("packed linear: bias of {} for {n_out} outputs", b.len());
        }
        let panels = panels::pack(&w, n_out, k, 1);
        let mut bias = b;
        bias.resize(n_out.div_ceil(PANEL) * PANEL, 0.0);
        Ok(Some(Self {
            n_out,
            k,
            panels,
            bias,
        }))
    }

    /// All rows times panel `p`, TILE_ROWS rows at a time.
    #[cfg(target_arch = "x86_64")]
    unsafe fn panel_rows(&self, p: usize, x: &[f32], rows: usize, out: &OutPtr, relu: bool) {
        let panel = self.panels.as_ptr().add(p * self.k * PANEL);
        let bias = self.bias.as_ptr().add(p * PANEL);
        let cols = PANEL.min(self.n_out - p * PANEL);
        let y = out.at(p * PANEL);
        by_tiles!(rows, tile, |r0| Tile {
            k: self.k,
            x: x.as_ptr().add(r0 * self.k),
            panel,
            bias,
            y: y.add(r0 * self.n_out),
            y_stride: self.n_out,
            cols,
            relu,
        });
    }

    #[cfg(not(target_arch = "x86_64"))]
    unsafe fn panel_rows(&self, _: usize, _: &[f32], _: usize, _: &OutPtr, _: bool) {
        unreachable!("packed linear layers are only built where the kernel runs")
    }
}

/// One kernel call: R rows (consecutive, `k` apart) of x times one panel.
struct Tile {
    k: usize,
    x: *const f32,
    panel: *const f32,
    bias: *const f32,
    y: *mut f32,
    y_stride: usize,
    cols: usize,
    relu: bool,
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

impl RowKernel for Packed {
    const NAME: &'static str = "nmt-packed-linear";

    fn shape(&self) -> (usize, usize) {
        (self.k, self.n_out)
    }

    fn run(&self, x: &[f32], rows: usize, out: &OutPtr, relu: bool) {
        panels::for_each_block(
            self.n_out.div_ceil(PANEL),
            rows * self.n_out * self.k,
            |p| {
                // SAFETY: `has_avx512()` was checked when this value was built; x holds rows × k
                // values, each panel k × PANEL, and panel p writes only columns p·PANEL.. of y
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
            let Some(p) = Packed::new(&w, &b).unwrap() else {
                return; // no AVX-512 here: callers take the general path
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
}
