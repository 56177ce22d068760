//! The post-norm residual block LayerNorm(x + dropout(f)) as one op (CPU; CUDA in
//! `cuda`), keeping the sum for the backward pass.

use super::cpu::zeros;
use super::dropout::*;
use super::layer_norm::*;
use super::*;
use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

/// LayerNorm(x + f · mask) in one op (the post-norm residual block): `wb` holds the norm's
/// weight then its bias. The sum is kept for the backward pass.
pub(crate) struct ResidualNorm {
    mask: Option<DropoutMask>,
    eps: f32,
    sum: std::sync::Mutex<Vec<f32>>,
}

impl CustomOp3 for ResidualNorm {
    fn name(&self) -> &'static str {
        "nmt-residual-norm"
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
        let (x, f, wb) = (slice(s1, l1)?, slice(s2, l2)?, slice(s3, l3)?);
        let d = wb.len() / 2;
        let sum = match &self.mask {
            Some(m) => m.apply(f, Some(x)),
            None => x.par_iter().zip(f).map(|(a, b)| a + b).collect(),
        };
        let y = layer_norm_rows(&sum, &wb[..d], &wb[d..], self.eps);
        *self.sum.lock().unwrap_or_else(|e| e.into_inner()) = sum;
        Ok((CpuStorage::F32(y), l1.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        _f: &Tensor,
        wb: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let sum = self.sum.lock().unwrap_or_else(|e| e.into_inner());
        let d = wb.elem_count() / 2;
        let mut dsum = zeros(sum.len());
        let (dw, db) = with_host_f32(wb, |wb| {
            with_host_f32(dy, |dy| {
                layer_norm_backward_rows(&sum, &wb[..d], dy, self.eps, &mut dsum)
            })
        })??;
        let df = match &self.mask {
            Some(m) => m.apply(&dsum, None),
            None => dsum.clone(),
        };
        let dev = x.device();
        Ok((
            Some(Tensor::from_vec(dsum, x.shape(), dev)?),
            Some(Tensor::from_vec(df, x.shape(), dev)?),
            Some(Tensor::from_vec([dw, db].concat(), 2 * d, dev)?),
        ))
    }
}

/// LayerNorm(x + f · mask) (mask: dropout, or none), a post-norm residual block: one op on
/// the CPU in f32 and on CUDA, else LayerNorm([`add_dropout`]).
pub fn residual_norm(
    x: &Tensor,
    f: &Tensor,
    w: &Tensor,
    b: &Tensor,
    eps: f64,
    mask: Option<DropoutMask>,
) -> Result<Tensor> {
    if x.shape() != f.shape() {
        candle_core::bail!(
            "residual_norm: shapes {:?} and {:?} differ",
            x.shape(),
            f.shape()
        );
    }
    if !same_kernels(x, f) {
        return layer_norm(&add_dropout(x, f, mask)?, w, b, eps);
    }
    #[cfg(feature = "cuda")]
    if cuda_kernels(f) {
        if w.dim(0)? > gpu::MAX_WIDTH {
            return layer_norm(&add_dropout(x, f, mask)?, w, b, eps);
        }
        let op = gpu::ResidualNorm {
            mask,
            eps: eps as f32,
            has_f: true,
        };
        return x
            .contiguous()?
            .apply_op3(&f.contiguous()?, &Tensor::cat(&[w, b], 0)?, op);
    }
    let op = ResidualNorm {
        mask,
        eps: eps as f32,
        sum: std::sync::Mutex::new(Vec::new()),
    };
    x.contiguous()?
        .apply_op3(&f.contiguous()?, &Tensor::cat(&[w, b], 0)?, op)
}

/// The CUDA half: LayerNorm(x + dropout(f)) and LayerNorm alone, forward and backward.
#[cfg(feature = "cuda")]
pub(crate) mod gpu {
    use crate::ops::cuda::prelude::*;

    /// LayerNorm(x + f · mask) · w + b over the last dimension (post-norm residual block), or
    /// LayerNorm(x) · w + b when `has_f` is false (then the second input is ignored). Inputs:
    /// x, f (same shape), wb = [w; b].
    pub struct ResidualNorm {
        pub mask: Option<DropoutMask>,
        pub eps: f32,
        pub has_f: bool,
    }

    /// The backward of [`ResidualNorm`] for output gradient `dy`: (N·k + 2, d) holding ∂L/∂s,
    /// then ∂L/∂f when `has_f` (k = 2, else 1), then ∂L/∂w and ∂L/∂b.
    struct ResidualNormGrad {
        mask: Option<DropoutMask>,
        eps: f32,
        has_f: bool,
        dy: Tensor,
    }

    /// Warps per block of the backward kernel (its shared memory holds 2·d floats per warp).
    const BWD_WARPS: usize = 4;
    /// Blocks of the backward kernel at most: each leaves 2·d partial sums.
    const BWD_BLOCKS: usize = 264;
    /// The widest row the backward's shared memory takes (4 warps · 2 · 1,024 floats = 32 KB).
    pub const MAX_WIDTH: usize = 1024;

    impl CustomOp3 for ResidualNorm {
        fn name(&self) -> &'static str {
            "nmt-residual-norm-cuda"
        }

        cuda_only!(3);

        fn cuda_fwd(
            &self,
            x: &CudaStorage,
            xl: &Layout,
            f: &CudaStorage,
            fl: &Layout,
            wb: &CudaStorage,
            wbl: &Layout,
        ) -> Result<(CudaStorage, Shape)> {
            let dev = x.device().clone();
            let d = wbl.shape().elem_count() / 2;
            let n = xl.shape().elem_count();
            let rows = n / d;
            let (state, threshold, keep) = mask_args(&self.mask);
            with_elem!(x.dtype(), T => {
                let xs = input::<T>(x, xl)?;
                let fs = input::<T>(f, fl)?;
                let wbs = input::<T>(wb, wbl)?;
                let out = unsafe { dev.alloc::<T>(n)? };
                let null = 0u64;
                let (rows32, d32) = (rows as i32, d as i32);
                launch!(dev, &format!("residual_norm_{}", T::NAME), cfg(blocks(rows, 8), 256, 0), |b| {
                    b.arg(&xs);
                    if self.has_f { b.arg(&fs) } else { b.arg(&null) };
                    b.arg(&wbs).arg(&out).arg(&rows32).arg(&d32).arg(&self.eps);
                    b.arg(&state).arg(&threshold).arg(&keep);
                });
                Ok((T::wrap_cuda_slice(out, dev), xl.shape().clone()))
            })
        }

        fn bwd(
            &self,
            x: &Tensor,
            f: &Tensor,
            wb: &Tensor,
            _y: &Tensor,
            dy: &Tensor,
        ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
            let d = wb.elem_count() / 2;
            let n = x.elem_count() / d;
            let grad = ResidualNormGrad {
                mask: self.mask,
                eps: self.eps,
                has_f: self.has_f,
                dy: dy.contiguous()?,
            };
            let all = x.apply_op3_no_bwd(f, wb, &grad)?;
            let ds = all.narrow(0, 0, n)?.reshape(x.shape())?;
            let df = if self.has_f {
                Some(all.narrow(0, n, n)?.reshape(x.shape())?)
            } else {
                None
            };
            let k = if self.has_f { 2 } else { 1 };
            let dwb = all.narrow(0, k * n, 2)?.flatten_all()?;
            Ok((Some(ds), df, Some(dwb)))
        }
    }

    impl CustomOp3 for ResidualNormGrad {
        fn name(&self) -> &'static str {
            "nmt-residual-norm-grad-cuda"
        }

        cuda_only!(3);

        fn cuda_fwd(
            &self,
            x: &CudaStorage,
            xl: &Layout,
            f: &CudaStorage,
            fl: &Layout,
            wb: &CudaStorage,
            wbl: &Layout,
        ) -> Result<(CudaStorage, Shape)> {
            let dev = x.device().clone();
            let d = wbl.shape().elem_count() / 2;
            let n = xl.shape().elem_count();
            let rows = n / d;
            let k = if self.has_f { 2 } else { 1 };
            let (state, threshold, keep) = mask_args(&self.mask);
            let n_blocks = rows.div_ceil(BWD_WARPS).clamp(1, BWD_BLOCKS);
            with_cuda(
                &self.dy,
                "nmt-residual-norm-grad-cuda: the gradient",
                |dy, dyl| {
                    with_elem!(x.dtype(), T => {
                        let xs = input::<T>(x, xl)?;
                        let fs = input::<T>(f, fl)?;
                        let wbs = input::<T>(wb, wbl)?;
                        let dys = input::<T>(dy, dyl)?;
                        let out = unsafe { dev.alloc::<T>((k * rows + 2) * d)? };
                        let part: CudaSlice<f32> = unsafe { dev.alloc::<f32>(n_blocks * 2 * d)? };
                        let ds = out.slice(0..n);
                        let df = out.slice(n..);
                        let dwb = out.slice(k * n..);
                        let null = 0u64;
                        let (rows32, d32) = (rows as i32, d as i32);
                        let shared = (BWD_WARPS * 2 * d * 4) as u32;
                        let config = cfg(n_blocks as u32, (32 * BWD_WARPS) as u32, shared);
                        launch!(dev, &format!("residual_norm_bwd_{}", T::NAME), config, |b| {
                            b.arg(&xs);
                            if self.has_f { b.arg(&fs) } else { b.arg(&null) };
                            b.arg(&wbs).arg(&dys).arg(&ds);
                            if self.has_f { b.arg(&df) } else { b.arg(&null) };
                            b.arg(&part).arg(&rows32).arg(&d32).arg(&self.eps);
                            b.arg(&state).arg(&threshold).arg(&keep);
                        });
                        let (nb32, width32) = (n_blocks as i32, 2 * d as i32);
                        launch!(dev, &format!("sum_parts_{}", T::NAME), cfg(blocks(2 * d, 256), 256, 0), |b| {
                            b.arg(&part).arg(&dwb).arg(&nb32).arg(&width32);
                        });
                        Ok((T::wrap_cuda_slice(out, dev), Shape::from((k * rows + 2, d))))
                    })
                },
            )
        }
    }
}
