//! nmt's kernel library: one file per op, each holding its CPU kernel (with its own backward
//! where training needs one), its CUDA path, the Candle composite it must agree with (the test
//! oracle), and the choice between them. CPU building blocks (SIMD dispatch, reductions,
//! matrix products) are in `cpu/`, nmt's CUDA kernels and their launch helpers in `cuda/`.
//! The model calls these functions and never branches on device or dtype itself.

pub mod attention;
pub mod bf16;
pub mod cpu;
pub mod cross_entropy;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod dropout;
pub mod embedding;
pub mod int8;
pub mod layer_norm;
pub mod linear;
pub mod packed;
pub mod residual_norm;
pub mod softmax;
pub mod step_attention;
#[cfg(test)]
pub(crate) mod tests;
pub mod with_grad;

pub use cpu::{exp_sum, fast_exp, row_max, wide};
pub use cross_entropy::{projected_cross_entropy, smoothed_cross_entropy};
pub use dropout::{add_dropout, dropout, DropoutMask};
pub use embedding::{embed, select_rows};
pub use layer_norm::layer_norm;
pub use linear::linear;
pub use residual_norm::residual_norm;
pub use softmax::masked_softmax;
pub use step_attention::{attend_one, attend_steps, SourceKeys};

use candle_core::{CpuStorage, DType, Layout, Result, Tensor};

pub(crate) fn fused(t: &Tensor) -> bool {
    t.device().is_cpu() && t.dtype() == DType::F32
}

/// Whether nmt's CUDA kernels (`ops/cuda`) apply to `t`.
pub(crate) fn cuda_kernels(t: &Tensor) -> bool {
    #[cfg(feature = "cuda")]
    {
        cuda::serves(t)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = t;
        false
    }
}

pub(crate) fn slice<'a>(s: &'a CpuStorage, l: &Layout) -> Result<&'a [f32]> {
    let data = s.as_slice::<f32>()?;
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&data[a..b]),
        None => candle_core::bail!("fused op: input is not contiguous"),
    }
}

pub(crate) fn u32_slice<'a>(s: &'a CpuStorage, l: &Layout) -> Result<&'a [u32]> {
    let data = s.as_slice::<u32>()?;
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&data[a..b]),
        None => candle_core::bail!("fused op: input is not contiguous"),
    }
}

/// Rows per parallel task: enough work per task to amortise scheduling.
pub(crate) fn rows_per_task(width: usize) -> usize {
    (16_384 / width.max(1)).max(1)
}

/// Runs `f` on a CPU f32 tensor's data in row-major order: read in place where the tensor is
/// contiguous (the usual case), else from a contiguous copy.
pub fn with_host_f32<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
    let t = t.contiguous()?;
    let guard = t.storage_and_layout();
    Ok(f(guarded_f32(&guard)?))
}

/// The data of a contiguous CPU f32 tensor held under its storage guard.
pub(crate) fn guarded_f32<'a>(
    (storage, layout): &'a (candle_core::StorageRef<'_>, &Layout),
) -> Result<&'a [f32]> {
    match &**storage {
        candle_core::Storage::Cpu(cpu) => slice(cpu, layout),
        _ => candle_core::bail!("expected a contiguous f32 tensor on the CPU"),
    }
}
