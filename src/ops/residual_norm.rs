//! The post-norm residual block LayerNorm(x + dropout(f)) as one op (CPU; CUDA in
//! `cuda`), keeping the sum for the backward pass.

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
        let dy = dy.contiguous()?;
        let d = wb.elem_count() / 2;
        let mut dsum = vec![0f32; sum.len()];
        let (dw, db) = with_host_f32(wb, |wb| {
            with_host_f32(&dy, |dy| {
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

/// LayerNorm(x + f · mask) (mask: dropout, or none), a post-norm residual block, as one op
/// (CPU in f32, or CUDA).
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
    #[cfg(feature = "cuda")]
    if cuda_kernels(f) {
        if w.dim(0)? > super::cuda::MAX_WIDTH {
            let s = match mask {
                Some(m) => add_dropout(x, f, m)?,
                None => (x + f)?,
            };
            return layer_norm(&s, w, b, eps);
        }
        let op = super::cuda::ResidualNorm {
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
