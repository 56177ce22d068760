//! LayerNorm over the last dimension: a fused CPU kernel with its own backward, nmt's CUDA
//! kernel, Candle's GPU kernel with our backward, or the composite (the test oracle).

use super::cpu::*;
use super::with_grad::*;
use super::*;
use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Tensor, D};
use rayon::prelude::*;

pub(crate) struct LayerNormOp {
    eps: f32,
}

pub(crate) struct LayerNormGrad {
    eps: f32,
}

/// Mean and 1/√(variance + eps) of a row, each sum in `LANES` partial sums: a left-to-right
/// sum cannot be vectorised, and two of them per row were most of a decoding step's layer norms.
#[inline(always)]
pub(crate) fn row_stats(x: &[f32], eps: f32) -> (f32, f32) {
    let n = x.len() as f32;
    let mean = row_sum(x) / n;
    let var = lanes_fold(x, 0.0, |a, v| a + (v - mean) * (v - mean))
        .into_iter()
        .sum::<f32>()
        / n;
    (mean, 1.0 / (var + eps).sqrt())
}

impl CustomOp3 for LayerNormOp {
    fn name(&self) -> &'static str {
        "nmt-layer-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (x, w, b) = (slice(s1, l1)?, slice(s2, l2)?, slice(s3, l3)?);
        let y = layer_norm_rows(x, w, b, self.eps);
        Ok((CpuStorage::F32(y), l1.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _b: &Tensor,
        _res: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let d = w.dim(0)?;
        let n = x.elem_count() / d;
        let all = x.apply_op3_no_bwd(
            &w.contiguous()?,
            &dy.contiguous()?,
            &LayerNormGrad { eps: self.eps },
        )?;
        let dx = all.narrow(0, 0, n)?.reshape(x.shape())?;
        let dw = all.get(n)?;
        let db = all.get(n + 1)?;
        Ok((Some(dx), Some(dw), Some(db)))
    }
}

impl CustomOp3 for LayerNormGrad {
    fn name(&self) -> &'static str {
        "nmt-layer-norm-grad"
    }

    /// Output (N + 2, D): dx rows, then dw, then db.
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (x, w, dy) = (slice(s1, l1)?, slice(s2, l2)?, slice(s3, l3)?);
        let d = w.len();
        let n = x.len() / d;
        let mut out = vec![0f32; (n + 2) * d];
        let (dx, rest) = out.split_at_mut(n * d);
        let (dw, db) = layer_norm_backward_rows(x, w, dy, self.eps, dx);
        rest[..d].copy_from_slice(&dw);
        rest[d..].copy_from_slice(&db);
        Ok((CpuStorage::F32(out), Shape::from((n + 2, d))))
    }
}

/// LayerNorm of each `w.len()`-wide row of `x`, in parallel.
pub(crate) fn layer_norm_rows(x: &[f32], w: &[f32], b: &[f32], eps: f32) -> Vec<f32> {
    let d = w.len();
    let mut y = vec![0f32; x.len()];
    let rows = rows_per_task(d);
    y.par_chunks_mut(d * rows)
        .zip(x.par_chunks(d * rows))
        .for_each(|(yc, xc)| {
            wide(
                #[inline(always)]
                || {
                    for (yr, xr) in yc.chunks_mut(d).zip(xc.chunks(d)) {
                        let (mean, rstd) = row_stats(xr, eps);
                        for i in 0..d {
                            yr[i] = (xr[i] - mean) * rstd * w[i] + b[i];
                        }
                    }
                },
            )
        });
    y
}

/// LayerNorm's backward for inputs `x` and output gradient `dy`: dx into `dx`, and (dw, db).
pub(crate) fn layer_norm_backward_rows(
    x: &[f32],
    w: &[f32],
    dy: &[f32],
    eps: f32,
    dx: &mut [f32],
) -> (Vec<f32>, Vec<f32>) {
    let d = w.len();
    let rows = rows_per_task(d);
    dx.par_chunks_mut(d * rows)
        .zip(x.par_chunks(d * rows).zip(dy.par_chunks(d * rows)))
        .map(|(dxc, (xc, dyc))| {
            wide(
                #[inline(always)]
                || {
                    let mut dw = vec![0f32; d];
                    let mut db = vec![0f32; d];
                    let mut xhat = vec![0f32; d];
                    for ((dxr, xr), dyr) in dxc.chunks_mut(d).zip(xc.chunks(d)).zip(dyc.chunks(d)) {
                        let (mean, rstd) = row_stats(xr, eps);
                        let (mut s1, mut s2) = (0f32, 0f32);
                        for i in 0..d {
                            xhat[i] = (xr[i] - mean) * rstd;
                            let g = dyr[i] * w[i];
                            s1 += g;
                            s2 += g * xhat[i];
                            dw[i] += dyr[i] * xhat[i];
                            db[i] += dyr[i];
                        }
                        let (m1, m2) = (s1 / d as f32, s2 / d as f32);
                        for i in 0..d {
                            dxr[i] = rstd * (dyr[i] * w[i] - m1 - xhat[i] * m2);
                        }
                    }
                    (dw, db)
                },
            )
        })
        // Partials summed in chunk order, not in the shape of whichever split tree the
        // scheduler made: the same inputs give the same gradients on every run.
        .collect::<Vec<_>>()
        .into_iter()
        .fold((vec![0f32; d], vec![0f32; d]), |(mut a, mut b), (c, e)| {
            a.iter_mut().zip(c).for_each(|(p, q)| *p += q);
            b.iter_mut().zip(e).for_each(|(p, q)| *p += q);
            (a, b)
        })
}

/// LayerNorm over the last dimension: (x − mean) / √(var + eps) · w + b.
pub fn layer_norm(x: &Tensor, w: &Tensor, b: &Tensor, eps: f64) -> Result<Tensor> {
    if fused(x) {
        return x
            .contiguous()?
            .apply_op3(w, b, LayerNormOp { eps: eps as f32 });
    }
    #[cfg(feature = "cuda")]
    if cuda_kernels(x) && w.dim(0)? <= super::residual_norm::gpu::MAX_WIDTH {
        let x = x.contiguous()?;
        let op = super::residual_norm::gpu::ResidualNorm {
            mask: None,
            eps: eps as f32,
            has_f: false,
        };
        return x.apply_op3(&x, &Tensor::cat(&[w, b], 0)?, op);
    }
    if gpu_kernels(x) {
        return layer_norm_kernels(x, w, b, eps);
    }
    let mean = x.mean_keepdim(D::Minus1)?;
    let centred = x.broadcast_sub(&mean)?;
    let var = centred.sqr()?.mean_keepdim(D::Minus1)?;
    let normed = centred.broadcast_div(&(var + eps)?.sqrt()?)?;
    normed.broadcast_mul(w)?.broadcast_add(b)
}
