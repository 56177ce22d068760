//! Candle's own fused GPU kernels (softmax, LayerNorm), which have no backward, with the
//! backward supplied here.

use candle_core::{CpuStorage, CustomOp2, Layout, Result, Shape, Tensor, D};

/// Where Candle's own fused softmax and LayerNorm kernels serve: devices other than the CPU
/// (there the fused ops above serve f32). They have no backward in Candle, so [`WithGrad`]
/// supplies it; the compositions they replace cost several kernel launches each way.
pub(crate) fn gpu_kernels(t: &Tensor) -> bool {
    !t.device().is_cpu()
}

/// `(x, y) → y` where `y` was computed from `x` by a kernel without a backward: passes `y`
/// through and gives `x` the gradient of that computation, from `x`, `y` and dL/dy.
pub(crate) enum WithGrad {
    /// y = softmax(x) over the last dimension.
    Softmax,
    /// y = (x − mean) / √(var + eps) over the last dimension.
    LayerNorm { eps: f64 },
}

impl WithGrad {
    fn pass<S: candle_core::backend::BackendStorage>(y: &S, l: &Layout) -> Result<(S, Shape)> {
        if !l.is_contiguous() || l.start_offset() != 0 {
            candle_core::bail!("WithGrad: the result must be a fresh contiguous tensor");
        }
        Ok((y.try_clone(l)?, l.shape().clone()))
    }
}

impl CustomOp2 for WithGrad {
    fn name(&self) -> &'static str {
        match self {
            Self::Softmax => "softmax-with-grad",
            Self::LayerNorm { .. } => "layer-norm-with-grad",
        }
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        y: &CpuStorage,
        l: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        Self::pass(y, l)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
        y: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Self::pass(y, l)
    }

    fn bwd(
        &self,
        x: &Tensor,
        _: &Tensor,
        y: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let dx = match self {
            // dx = y ⊙ (g − Σ g ⊙ y)
            Self::Softmax => {
                let gy = (grad * y)?;
                let s = gy.sum_keepdim(D::Minus1)?;
                (gy - y.broadcast_mul(&s)?)?
            }
            // dx = (g − mean(g) − x̂ ⊙ mean(g ⊙ x̂)) / √(var + eps)
            Self::LayerNorm { eps } => {
                let centred = x.broadcast_sub(&x.mean_keepdim(D::Minus1)?)?;
                let rstd = (centred.sqr()?.mean_keepdim(D::Minus1)? + *eps)?
                    .sqrt()?
                    .recip()?;
                let m1 = grad.mean_keepdim(D::Minus1)?;
                let m2 = (grad * y)?.mean_keepdim(D::Minus1)?;
                grad.broadcast_sub(&m1)?
                    .sub(&y.broadcast_mul(&m2)?)?
                    .broadcast_mul(&rstd)?
            }
        };
        Ok((Some(dx), None))
    }
}

/// LayerNorm from Candle's fused kernel (for x̂) and the affine part.
pub(crate) fn layer_norm_kernels(x: &Tensor, w: &Tensor, b: &Tensor, eps: f64) -> Result<Tensor> {
    let x = x.contiguous()?;
    let xhat = candle_nn::ops::layer_norm(&x, &w.ones_like()?, &w.zeros_like()?, eps as f32)?;
    let xhat = x.apply_op2(&xhat, WithGrad::LayerNorm { eps })?;
    xhat.broadcast_mul(w)?.broadcast_add(b)
}

/// Softmax over the last dimension from Candle's fused kernel.
pub(crate) fn softmax_kernels(x: &Tensor) -> Result<Tensor> {
    let x = x.contiguous()?;
    let y = candle_nn::ops::softmax_last_dim(&x)?;
    x.apply_op2(&y, WithGrad::Softmax)
}
