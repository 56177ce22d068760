//! Dropout and x + dropout(f) from SplitMix64 masks that are recomputed, not stored: the
//! same masks on every device and in a resumed run.

use super::cpu::*;
use super::*;
use crate::rng::Rng;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

/// A dropout mask drawn from a SplitMix64 stream: element i is zeroed when the (i mod 2)-th
/// 32-bit half of draw ⌊i/2⌋ + 1 after `rng` is below `threshold`, else scaled by `keep`.
/// Any element can be computed on its own, so masks are made in parallel (and the backward
/// pass recomputes them instead of storing them), equal to drawing them in sequence.
#[derive(Clone, Copy)]
pub struct DropoutMask {
    /// The stream's state before this mask's first draw.
    pub rng: Rng,
    /// Drop probability × 2³².
    pub threshold: u64,
    /// 1 / (1 − p).
    pub keep: f32,
}

impl DropoutMask {
    /// Elements per parallel task (even: a draw covers two elements).
    pub(crate) const CHUNK: usize = 16_384;

    /// out = [base +] x · mask, for the elements `start..start + x.len()` of the mask (`start`
    /// even). Draws are made a block at a time into an array and the elements then read their
    /// halves from it: two loops without branches or cross-iteration state, which vectorise
    /// (64-bit multiplies included, under [`wide`]).
    #[inline(always)]
    fn apply_at(&self, start: usize, x: &[f32], base: Option<&[f32]>, out: &mut [f32]) {
        const PAIRS: usize = 32;
        debug_assert!(start.is_multiple_of(2));
        let mut halves = [0u32; 2 * PAIRS];
        let (threshold, keep) = (self.threshold, self.keep);
        for (blk, o) in out.chunks_mut(2 * PAIRS).enumerate() {
            let first = (start / 2 + blk * PAIRS) as u64 + 1;
            for (t, h) in halves.chunks_exact_mut(2).enumerate() {
                let r = self.rng.draw_at(first + t as u64);
                h[0] = r as u32;
                h[1] = (r >> 32) as u32;
            }
            let at = blk * 2 * PAIRS;
            let xs = &x[at..at + o.len()];
            let factor = |h: u32| if (h as u64) < threshold { 0.0 } else { keep };
            match base {
                Some(b) => {
                    let bs = &b[at..at + o.len()];
                    for i in 0..o.len() {
                        o[i] = bs[i] + xs[i] * factor(halves[i]);
                    }
                }
                None => {
                    for i in 0..o.len() {
                        o[i] = xs[i] * factor(halves[i]);
                    }
                }
            }
        }
    }

    /// [base +] x · mask, in parallel.
    pub(crate) fn apply(&self, x: &[f32], base: Option<&[f32]>) -> Vec<f32> {
        let mut out = zeros(x.len());
        out.par_chunks_mut(Self::CHUNK)
            .enumerate()
            .for_each(|(c, o)| {
                let at = c * Self::CHUNK;
                let b = base.map(|b| &b[at..at + o.len()]);
                wide(
                    #[inline(always)]
                    || self.apply_at(at, &x[at..at + o.len()], b, o),
                );
            });
        out
    }

    /// The mask's first `n` values (0 or `keep`).
    pub fn values(&self, n: usize) -> Vec<f32> {
        self.apply(&vec![1f32; n], None)
    }
}

pub(crate) struct DropoutOp(DropoutMask);

pub(crate) struct AddDropoutOp(DropoutMask);

impl CustomOp1 for DropoutOp {
    fn name(&self) -> &'static str {
        "nmt-dropout"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout) -> Result<(CpuStorage, Shape)> {
        let y = self.0.apply(slice(s1, l1)?, None);
        Ok((CpuStorage::F32(y), l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let y = gpu::dropout(s1, l1, None, &self.0)?;
        Ok((y, l1.shape().clone()))
    }

    fn bwd(&self, _x: &Tensor, _y: &Tensor, dy: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(dy.contiguous()?.apply_op1_no_bwd(self)?))
    }
}

impl CustomOp2 for AddDropoutOp {
    fn name(&self) -> &'static str {
        "nmt-add-dropout"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let y = self.0.apply(slice(s2, l2)?, Some(slice(s1, l1)?));
        Ok((CpuStorage::F32(y), l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let y = gpu::dropout(s2, l2, Some((s1, l1)), &self.0)?;
        Ok((y, l1.shape().clone()))
    }

    fn bwd(
        &self,
        _x: &Tensor,
        _f: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let df = dy.contiguous()?.apply_op1_no_bwd(&DropoutOp(self.0))?;
        Ok((Some(dy.clone()), Some(df)))
    }
}

/// x · mask: each element dropped or scaled as `mask` says. One op on the CPU in f32 and on
/// CUDA; elsewhere the mask as a tensor (the composite the ops are tested against).
pub fn dropout(x: &Tensor, mask: DropoutMask) -> Result<Tensor> {
    if fused(x) || cuda_kernels(x) {
        return x.contiguous()?.apply_op1(DropoutOp(mask));
    }
    let n = x.elem_count();
    let m = Tensor::from_vec(mask.values(n), x.shape(), x.device())?.to_dtype(x.dtype())?;
    x * m
}

/// Whether the residual `x` and the sub-layer output `f` go through one fused op together.
pub(crate) fn same_kernels(x: &Tensor, f: &Tensor) -> bool {
    x.dtype() == f.dtype() && x.device().same_device(f.device()) && (fused(f) || cuda_kernels(f))
}

/// x + f · mask (x + f without a mask), the residual connection around a sub-layer with
/// output `f`: one op on the CPU in f32 and on CUDA, else x + [`dropout`](f).
pub fn add_dropout(x: &Tensor, f: &Tensor, mask: Option<DropoutMask>) -> Result<Tensor> {
    if x.shape() != f.shape() {
        candle_core::bail!(
            "add_dropout: shapes {:?} and {:?} differ",
            x.shape(),
            f.shape()
        );
    }
    let Some(mask) = mask else {
        return x + f;
    };
    if !same_kernels(x, f) {
        return x + dropout(f, mask)?;
    }
    x.contiguous()?
        .apply_op2(&f.contiguous()?, AddDropoutOp(mask))
}

/// The CUDA half: the same masks, drawn inside the kernel.
#[cfg(feature = "cuda")]
pub(crate) mod gpu {
    use crate::ops::cuda::prelude::*;

    /// y = [base +] x · mask over contiguous inputs of one dtype.
    pub(crate) fn dropout(
        x: &CudaStorage,
        xl: &Layout,
        base: Option<(&CudaStorage, &Layout)>,
        mask: &DropoutMask,
    ) -> Result<CudaStorage> {
        let dev = x.device().clone();
        let n = xl.shape().elem_count();
        with_elem!(x.dtype(), T => {
            let xs = input::<T>(x, xl)?;
            let bs = base.map(|(s, l)| input::<T>(s, l)).transpose()?;
            let out = unsafe { dev.alloc::<T>(n)? };
            let null = 0u64;
            let (state, threshold, keep) = mask_args(&Some(*mask));
            let n64 = n as u64;
            launch!(dev, &format!("dropout_{}", T::NAME), cfg(blocks(n, 256).min(65_535), 256, 0), |b| {
                b.arg(&xs);
                match &bs {
                    Some(v) => b.arg(v),
                    None => b.arg(&null),
                };
                b.arg(&out).arg(&n64).arg(&state).arg(&threshold).arg(&keep);
            });
            Ok(T::wrap_cuda_slice(out, dev))
        })
    }
}
