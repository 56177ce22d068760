//! Linear layers (+ ReLU) for training: the product with the bias pre-filled, and a backward
//! that computes dx and dW side by side with the ReLU mask applied on the fly.

use super::cpu::matmul::*;
use super::cpu::*;
use super::*;
use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

pub(crate) struct LinearOp {
    relu: bool,
}

/// The backward of [`LinearOp`]; with `relu_out`, the layer's ReLU output, whose zeros mask
/// the incoming gradient (applied on the fly, not as an op of its own).
pub(crate) struct LinearGrad {
    relu_out: Option<Tensor>,
}

impl CustomOp3 for LinearOp {
    fn name(&self) -> &'static str {
        "nmt-linear"
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
        let (n_in, n_out) = (l2.dims()[1], l2.dims()[0]);
        let rows = x.len() / n_in;
        let mut y = repeat_rows(b, rows);
        if rows <= SKINNY_ROWS {
            skinny_into(rows, n_out, n_in, &mut y, x, w);
        } else {
            gemm_into(rows, n_out, n_in, &mut y, true, x, n_in, 1, w, 1, n_in);
        }
        if self.relu {
            y.par_chunks_mut(16_384).for_each(|c| {
                wide(
                    #[inline(always)]
                    || c.iter_mut().for_each(|v| *v = v.max(0.0)),
                )
            });
        }
        let mut dims = l1.dims().to_vec();
        *dims.last_mut().expect("linear input has a dimension") = n_out;
        Ok((CpuStorage::F32(y), Shape::from(dims)))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _b: &Tensor,
        y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (n_out, n_in) = w.dims2()?;
        let rows = x.elem_count() / n_in;
        let grad = LinearGrad {
            relu_out: self.relu.then(|| y.clone()),
        };
        let all = x.apply_op3_no_bwd(w, &dy.contiguous()?, &grad)?;
        let dx = all.narrow(0, 0, rows * n_in)?.reshape(x.shape())?;
        let dw = all
            .narrow(0, rows * n_in, n_out * n_in)?
            .reshape((n_out, n_in))?;
        let db = all.narrow(0, (rows + n_out) * n_in, n_out)?;
        Ok((Some(dx), Some(dw), Some(db)))
    }
}

impl CustomOp3 for LinearGrad {
    fn name(&self) -> &'static str {
        "nmt-linear-grad"
    }

    /// Flat output: dx (rows×in), dW (out×in), db (out).
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
        let (n_out, n_in) = (l2.dims()[0], l2.dims()[1]);
        let rows = x.len() / n_in;
        let mut out = zeros(rows * n_in + n_out * n_in + n_out);
        let (dx, rest) = out.split_at_mut(rows * n_in);
        let (dw, db) = rest.split_at_mut(n_out * n_in);
        // The gradient at the pre-activation (ReLU's zeros masked out) and its column sums
        // (the bias gradient), in parallel blocks of rows whose partial sums are added in
        // block order, so that results do not depend on scheduling.
        let masked;
        let g = match &self.relu_out {
            Some(y) => {
                let guard = y.storage_and_layout();
                let y = guarded_f32(&guard)?;
                let mut m = zeros(dy.len());
                m.par_chunks_mut(16_384)
                    .zip(dy.par_chunks(16_384).zip(y.par_chunks(16_384)))
                    .for_each(|(m, (d, y))| {
                        wide(
                            #[inline(always)]
                            || {
                                let (d, y) = (&d[..m.len()], &y[..m.len()]);
                                for i in 0..m.len() {
                                    m[i] = if y[i] > 0.0 { d[i] } else { 0.0 };
                                }
                            },
                        )
                    });
                masked = m;
                &masked[..]
            }
            None => dy,
        };
        let block = rows_per_task(n_out) * n_out;
        let partial: Vec<Vec<f32>> = g
            .par_chunks(block)
            .map(|c| {
                wide(
                    #[inline(always)]
                    || {
                        let mut s = vec![0f32; n_out];
                        for row in c.chunks(n_out) {
                            s.iter_mut().zip(row).for_each(|(a, b)| *a += b);
                        }
                        s
                    },
                )
            })
            .collect();
        for p in partial {
            db.iter_mut().zip(p).for_each(|(a, b)| *a += b);
        }
        // dx = g·W and dW = gᵀ·x take the same FLOPs: one per thread, side by side, rather
        // than each split across the threads in turn.
        let (gr, gt) = (Strided::rows(g, n_out), Strided::transposed(g, n_out));
        let (wr, xr) = (Strided::rows(w, n_in), Strided::rows(x, n_in));
        rayon::join(
            || gemm_serial((rows, n_in, n_out), dx, n_in, false, gr, wr, 1.0),
            || gemm_serial((n_out, n_in, rows), dw, n_in, false, gt, xr, 1.0),
        );
        Ok((
            CpuStorage::F32(out),
            Shape::from(rows * n_in + n_out * n_in + n_out),
        ))
    }
}

/// y = x Wᵀ + b (then ReLU when `relu`), x (..., in), W (out, in), b (out) → (..., out). The
/// fused op takes x in its own shape: a reshape around it would be two more graph nodes, each
/// costing a zero-filled gradient buffer and an addition in the backward pass.
pub fn linear(x: &Tensor, w: &Tensor, b: &Tensor, relu: bool) -> Result<Tensor> {
    if fused(x) {
        return x.contiguous()?.apply_op3(w, b, LinearOp { relu });
    }
    let mut out = x.dims().to_vec();
    let d_in = out.pop().expect("linear input has a dimension");
    out.push(w.dim(0)?);
    let y = x.reshape(((), d_in))?.matmul(&w.t()?)?.broadcast_add(b)?;
    let y = if relu { y.relu()? } else { y };
    y.reshape(out)
}
