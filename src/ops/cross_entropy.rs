//! Label-smoothed cross-entropy: fused with the output projection on the CPU (never holding
//! all N × V logits), nmt's CUDA kernel, or Candle's composite (the oracle).

use super::cpu::matmul::*;
use super::cpu::*;
use super::*;
use candle_core::{CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor, D};
use rayon::prelude::*;

/// Per-row (smoothed loss, NLL) for logits (N, V) and labels (N,): (N, 2). The smoothed loss
/// is (1−ε)·(−log p[y]) + ε·mean_v(−log p[v]), PyTorch's definition; only it has a gradient.
/// On CUDA nmt's kernel; elsewhere Candle's ops, which are also the oracle that the fused CPU
/// [`projected_cross_entropy`] and the CUDA kernel are tested against (training on the CPU
/// never comes here: it takes the fused projection).
pub fn smoothed_cross_entropy(logits: &Tensor, labels: &Tensor, epsilon: f64) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if cuda_kernels(logits) && labels.dtype() == DType::U32 && logits.dim(0)? > 0 {
        return logits.contiguous()?.apply_op2(
            &labels.contiguous()?,
            gpu::SmoothedCrossEntropy {
                epsilon: epsilon as f32,
            },
        );
    }
    let logits = logits.to_dtype(DType::F32)?;
    let v = logits.dim(1)?;
    let logp = candle_nn::ops::log_softmax(&logits, D::Minus1)?;
    let nll = logp.gather(&labels.unsqueeze(1)?, 1)?.neg()?;
    let smooth = (logp.sum_keepdim(1)?.neg()? / v as f64)?;
    let loss = ((&nll * (1.0 - epsilon))? + (smooth * epsilon)?)?;
    Tensor::cat(&[loss, nll.detach()], 1)
}

/// Rows of logits materialised at a time by [`projected_cross_entropy`]: bounds its memory
/// for large batches. Smaller blocks measured slower (each gemm re-packs the whole weight).
pub(crate) const LOGIT_ROWS: usize = 2048;

pub(crate) struct ProjectedCrossEntropy {
    epsilon: f32,
    labels: Vec<u32>,
    with_grad: bool,
    /// d(loss sum)/d hidden and d(loss sum)/d weight, computed during the forward pass.
    grads: std::sync::Mutex<Option<(Tensor, Tensor)>>,
}

impl CustomOp3 for ProjectedCrossEntropy {
    fn name(&self) -> &'static str {
        "nmt-projected-cross-entropy"
    }

    /// hidden (N, d), weight (V, d), bias (1|V) → (2,): the smoothed-loss sum and the NLL sum.
    /// Logits are formed `LOGIT_ROWS` rows at a time and turned into their gradient in place,
    /// which then feeds the hidden and weight gradients: the (N, V) matrix never exists whole.
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (h, w, b) = (slice(s1, l1)?, slice(s2, l2)?, slice(s3, l3)?);
        let (v, d) = (l2.dims()[0], l2.dims()[1]);
        let n = h.len() / d;
        if n != self.labels.len() || b.len() != v {
            candle_core::bail!(
                "projected cross-entropy: {n} rows, {} labels, bias of {} for {v} classes",
                self.labels.len(),
                b.len()
            );
        }
        if let Some(&y) = self.labels.iter().find(|&&y| y as usize >= v) {
            candle_core::bail!(
                "projected cross-entropy: label {y} is outside the vocabulary of {v}"
            );
        }
        let eps = self.epsilon;
        let (mut dh, mut dw) = if self.with_grad {
            (zeros(n * d), zeros(v * d))
        } else {
            (Vec::new(), Vec::new())
        };
        let mut buf = repeat_rows(b, LOGIT_ROWS.min(n));
        let mut stats = vec![[0f32; 2]; n];
        for c0 in (0..n).step_by(LOGIT_ROWS) {
            let rows = LOGIT_ROWS.min(n - c0);
            let hc = &h[c0 * d..(c0 + rows) * d];
            let lg = &mut buf[..rows * v];
            if c0 > 0 {
                lg.par_chunks_mut(v).for_each(|r| r.copy_from_slice(b));
            }
            gemm_into(rows, v, d, lg, true, hc, d, 1, w, 1, d);
            lg.par_chunks_mut(v)
                .zip(stats[c0..c0 + rows].par_iter_mut())
                .zip(self.labels[c0..c0 + rows].par_iter())
                .for_each(|((row, st), &y)| {
                    wide(
                        #[inline(always)]
                        || {
                            // One exponential per logit: e^(x − max) in place, then scaled
                            // to the softmax for the gradient.
                            let (max, mean, picked) =
                                (row_max(row), row_sum(row) / v as f32, row[y as usize]);
                            let sum = exp_shifted_sum(row, max);
                            let lse = max + sum.ln();
                            let nll = lse - picked;
                            *st = [(1.0 - eps) * nll + eps * (lse - mean), nll];
                            if self.with_grad {
                                let (inv, uniform) = (1.0 / sum, eps / v as f32);
                                row.iter_mut().for_each(|x| *x = *x * inv - uniform);
                                row[y as usize] -= 1.0 - eps;
                            }
                        },
                    )
                });
            if self.with_grad {
                gemm_into(
                    rows,
                    d,
                    v,
                    &mut dh[c0 * d..(c0 + rows) * d],
                    false,
                    lg,
                    v,
                    1,
                    w,
                    d,
                    1,
                );
                gemm_into(v, d, rows, &mut dw, c0 > 0, lg, 1, v, hc, d, 1);
            }
        }
        if self.with_grad {
            let dev = candle_core::Device::Cpu;
            let grads = (
                Tensor::from_vec(dh, (n, d), &dev)?,
                Tensor::from_vec(dw, (v, d), &dev)?,
            );
            *self.grads.lock().unwrap() = Some(grads);
        }
        let (loss, nll) = stats
            .iter()
            .fold((0f64, 0f64), |(a, b), s| (a + s[0] as f64, b + s[1] as f64));
        Ok((
            CpuStorage::F32(vec![loss as f32, nll as f32]),
            Shape::from(2),
        ))
    }

    fn bwd(
        &self,
        _h: &Tensor,
        _w: &Tensor,
        _b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let Some((dh, dw)) = self.grads.lock().unwrap().clone() else {
            candle_core::bail!("projected cross-entropy: no gradient was kept by the forward pass");
        };
        // Only the loss sum carries a gradient; the NLL sum is a report.
        let g = grad.to_dtype(DType::F32)?.to_vec1::<f32>()?[0];
        if g == 1.0 {
            Ok((Some(dh), Some(dw), None))
        } else {
            Ok((Some((dh * g as f64)?), Some((dw * g as f64)?), None))
        }
    }
}

/// Label-smoothed cross-entropy of the projection `hidden Wᵀ + bias` against `labels`, summed
/// over rows: (2,) = [smoothed loss sum, NLL sum]. hidden (N, d), weight (V, d), bias (1|V, V),
/// labels (N,). Only the loss sum has a gradient (to hidden and weight; the bias is a fixed
/// buffer). On the CPU in f32 one fused op computes the gradients alongside the loss when
/// `with_grad` (training), never holding all N × V logits; elsewhere the composite path.
pub fn projected_cross_entropy(
    hidden: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    labels: &Tensor,
    epsilon: f64,
    with_grad: bool,
) -> Result<Tensor> {
    if fused(hidden) && weight.dtype() == DType::F32 {
        let op = ProjectedCrossEntropy {
            epsilon: epsilon as f32,
            labels: labels.to_vec1::<u32>()?,
            with_grad,
            grads: std::sync::Mutex::new(None),
        };
        let (h, w, b) = (
            hidden.contiguous()?,
            weight.contiguous()?,
            bias.flatten_all()?,
        );
        return if with_grad {
            h.apply_op3(&w, &b, op)
        } else {
            h.apply_op3_no_bwd(&w, &b, &op)
        };
    }
    let logits = hidden.matmul(&weight.t()?)?.broadcast_add(bias)?;
    let per_row = smoothed_cross_entropy(&logits, labels, epsilon)?;
    let sums = per_row.sum(0)?;
    Tensor::cat(&[sums.narrow(0, 0, 1)?, sums.narrow(0, 1, 1)?.detach()], 0)
}

/// The CUDA half: label-smoothed cross-entropy per row, forward and backward.
#[cfg(feature = "cuda")]
pub(crate) mod gpu {
    use crate::ops::cuda::prelude::*;

    /// Label-smoothed cross-entropy per row of logits (N, V) with labels (N,) u32 → (N, 2) f32:
    /// (smoothed loss, NLL), as `ops::smoothed_cross_entropy`; only the first has a gradient.
    pub struct SmoothedCrossEntropy {
        pub epsilon: f32,
    }

    /// ∂L/∂logits of [`SmoothedCrossEntropy`] for the output gradient `dy` (N, 2) f32.
    struct SmoothedCrossEntropyGrad {
        epsilon: f32,
        dy: Tensor,
    }

    impl CustomOp2 for SmoothedCrossEntropy {
        fn name(&self) -> &'static str {
            "nmt-smoothed-ce-cuda"
        }

        cuda_only!(2);

        fn cuda_fwd(
            &self,
            x: &CudaStorage,
            xl: &Layout,
            labels: &CudaStorage,
            ll: &Layout,
        ) -> Result<(CudaStorage, Shape)> {
            let dev = x.device().clone();
            let (rows, v) = xl.shape().dims2()?;
            let ys = input::<u32>(labels, ll)?;
            with_elem!(x.dtype(), T => {
                let xs = input::<T>(x, xl)?;
                let out = unsafe { dev.alloc::<f32>(2 * rows)? };
                let v32 = v as i32;
                launch!(dev, &format!("smoothed_ce_{}", T::NAME), cfg(rows as u32, 256, 0), |b| {
                    b.arg(&xs).arg(&ys).arg(&out).arg(&v32).arg(&self.epsilon);
                });
                Ok((f32::wrap_cuda_slice(out, dev), Shape::from((rows, 2))))
            })
        }

        fn bwd(
            &self,
            x: &Tensor,
            labels: &Tensor,
            _y: &Tensor,
            dy: &Tensor,
        ) -> Result<(Option<Tensor>, Option<Tensor>)> {
            let grad = SmoothedCrossEntropyGrad {
                epsilon: self.epsilon,
                dy: dy.to_dtype(DType::F32)?.contiguous()?,
            };
            Ok((Some(x.apply_op2_no_bwd(labels, &grad)?), None))
        }
    }

    impl CustomOp2 for SmoothedCrossEntropyGrad {
        fn name(&self) -> &'static str {
            "nmt-smoothed-ce-grad-cuda"
        }

        cuda_only!(2);

        fn cuda_fwd(
            &self,
            x: &CudaStorage,
            xl: &Layout,
            labels: &CudaStorage,
            ll: &Layout,
        ) -> Result<(CudaStorage, Shape)> {
            let dev = x.device().clone();
            let (rows, v) = xl.shape().dims2()?;
            let ys = input::<u32>(labels, ll)?;
            with_cuda(
                &self.dy,
                "nmt-smoothed-ce-grad-cuda: the gradient",
                |dy, dyl| {
                    let dys = input::<f32>(dy, dyl)?;
                    with_elem!(x.dtype(), T => {
                        let xs = input::<T>(x, xl)?;
                        let out = unsafe { dev.alloc::<T>(rows * v)? };
                        let v32 = v as i32;
                        launch!(dev, &format!("smoothed_ce_bwd_{}", T::NAME), cfg(rows as u32, 256, 0), |b| {
                            b.arg(&xs).arg(&ys).arg(&dys).arg(&out).arg(&v32).arg(&self.epsilon);
                        });
                        Ok((T::wrap_cuda_slice(out, dev), xl.shape().clone()))
                    })
                },
            )
        }
    }
}
