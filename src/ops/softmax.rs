//! Softmax over the last dimension with an additive mask, fused on the CPU with its backward.

use super::with_grad::*;
use super::*;
use candle_core::{CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor, D};
use rayon::prelude::*;

pub(crate) struct MaskedSoftmax {
    /// (B, H, T, S) of the scores and (Bb, Tb) of the bias.
    dims: [usize; 4],
    bias_b: usize,
    bias_t: usize,
}

pub(crate) struct SoftmaxGrad;

impl CustomOp2 for MaskedSoftmax {
    fn name(&self) -> &'static str {
        "nmt-masked-softmax"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (x, bias) = (slice(s1, l1)?, slice(s2, l2)?);
        let [_, h, t, s] = self.dims;
        let mut y = vec![0f32; x.len()];
        let rows = rows_per_task(s);
        y.par_chunks_mut(s * rows)
            .zip(x.par_chunks(s * rows))
            .enumerate()
            .for_each(|(c, (yc, xc))| {
                for (k, (yr, xr)) in yc.chunks_mut(s).zip(xc.chunks(s)).enumerate() {
                    let r = c * rows + k;
                    let (bi, ti) = (r / (h * t), r % t);
                    let brow = (if self.bias_b == 1 { 0 } else { bi }) * self.bias_t
                        + if self.bias_t == 1 { 0 } else { ti };
                    let br = &bias[brow * s..(brow + 1) * s];
                    let mut max = f32::NEG_INFINITY;
                    for i in 0..s {
                        yr[i] = xr[i] + br[i];
                        max = max.max(yr[i]);
                    }
                    let mut sum = 0f32;
                    for v in yr.iter_mut() {
                        *v = (*v - max).exp();
                        sum += *v;
                    }
                    let inv = 1.0 / sum;
                    yr.iter_mut().for_each(|v| *v *= inv);
                }
            });
        Ok((CpuStorage::F32(y), l1.shape().clone()))
    }

    fn bwd(
        &self,
        _x: &Tensor,
        _bias: &Tensor,
        y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        Ok((
            Some(y.apply_op2_no_bwd(&dy.contiguous()?, &SoftmaxGrad)?),
            None,
        ))
    }
}

impl CustomOp2 for SoftmaxGrad {
    fn name(&self) -> &'static str {
        "nmt-softmax-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (y, dy) = (slice(s1, l1)?, slice(s2, l2)?);
        let s = l1.dims()[l1.dims().len() - 1];
        let mut dx = vec![0f32; y.len()];
        let rows = rows_per_task(s);
        dx.par_chunks_mut(s * rows)
            .zip(y.par_chunks(s * rows).zip(dy.par_chunks(s * rows)))
            .for_each(|(dc, (yc, gc))| {
                for ((dr, yr), gr) in dc.chunks_mut(s).zip(yc.chunks(s)).zip(gc.chunks(s)) {
                    let dot: f32 = yr.iter().zip(gr).map(|(a, b)| a * b).sum();
                    for i in 0..s {
                        dr[i] = yr[i] * (gr[i] - dot);
                    }
                }
            });
        Ok((CpuStorage::F32(dx), l1.shape().clone()))
    }
}

/// softmax(scores + bias) over the last dimension; scores (B, H, T, S), bias (B|1, 1, T|1, S)
/// additive (0 visible, large negative hidden), or no bias.
pub fn masked_softmax(scores: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let (b, h, t, s) = scores.dims4()?;
    if fused(scores) {
        let zeros;
        let bias = match bias {
            Some(bias) => bias.contiguous()?,
            None => {
                zeros = Tensor::zeros((1, 1, 1, s), DType::F32, scores.device())?;
                zeros
            }
        };
        let (bb, _, bt, _) = bias.dims4()?;
        return scores.contiguous()?.apply_op2(
            &bias,
            MaskedSoftmax {
                dims: [b, h, t, s],
                bias_b: bb,
                bias_t: bt,
            },
        );
    }
    let x = match bias {
        Some(bias) => scores.broadcast_add(bias)?,
        None => scores.clone(),
    };
    if gpu_kernels(&x) {
        return softmax_kernels(&x);
    }
    candle_nn::ops::softmax(&x, D::Minus1)
}
