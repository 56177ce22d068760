//! nmt's CUDA kernels (`kernels.cu`, built into PTX by build.rs) and what every op's CUDA half
//! uses to launch them: the element types, the launch macro, input views and launch shapes.
//! The ops' CUDA halves live beside their CPU halves (`ops/dropout.rs`, `residual_norm.rs`,
//! `embedding.rs`, `cross_entropy.rs`; Adam's in `train/optim_cuda.rs`); each is one to three
//! launches where Candle's generic kernels took five to several hundred.
//!
//! Every `unsafe` in a CUDA half is an allocation left uninitialised for a kernel that writes
//! all of it, or a launch whose arguments follow the kernel's signature in kernels.cu.

use super::DropoutMask;
use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig};
use candle_core::cuda_backend::CudaDType;
use candle_core::{CudaDevice, CudaStorage, DType, Layout, Result, Tensor};

pub(crate) const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/kernels.ptx"));

/// A storage type the kernels are instantiated for.
pub(crate) trait Elem: CudaDType + DeviceRepr {
    const NAME: &'static str;
}

impl Elem for f32 {
    const NAME: &'static str = "f32";
}

impl Elem for half::bf16 {
    const NAME: &'static str = "bf16";
}

impl Elem for half::f16 {
    const NAME: &'static str = "f16";
}

/// Runs `$body` with `$t` the element type of `$dtype` (f32, bf16 or f16).
macro_rules! with_elem {
    ($dtype:expr, $t:ident => $body:expr) => {
        match $dtype {
            candle_core::DType::F32 => {
                type $t = f32;
                $body
            }
            candle_core::DType::BF16 => {
                type $t = half::bf16;
                $body
            }
            candle_core::DType::F16 => {
                type $t = half::f16;
                $body
            }
            other => candle_core::bail!("nmt's CUDA kernels do not take {other:?}"),
        }
    };
}

/// Whether the kernels serve a tensor: on a CUDA device, in f32, bf16 or f16.
pub fn serves(t: &Tensor) -> bool {
    t.device().is_cuda() && matches!(t.dtype(), DType::F32 | DType::BF16 | DType::F16)
}

/// The contiguous data of an input, from its offset on.
pub(crate) fn input<'a, T: CudaDType + DeviceRepr>(
    s: &'a CudaStorage,
    l: &Layout,
) -> Result<candle_core::cuda_backend::cudarc::driver::CudaView<'a, T>> {
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(s.as_cuda_slice::<T>()?.slice(a..b)),
        None => candle_core::bail!("nmt CUDA op: input is not contiguous"),
    }
}

/// Launches kernel `$name` of kernels.cu on `$dev`'s stream with `$config`, once `$push` has
/// pushed the arguments onto the builder `$b`, in the order of the kernel's parameters.
macro_rules! launch {
    ($dev:expr, $name:expr, $config:expr, |$b:ident| $push:block) => {{
        let func = $dev.get_or_load_custom_func($name, "nmt", $crate::ops::cuda::PTX)?;
        let mut $b = func.builder();
        $push
        // SAFETY: the arguments follow the kernel's signature in kernels.cu.
        candle_core::cuda_backend::WrapErr::w(unsafe { $b.launch($config) })?;
    }};
}

/// Runs `f` on the CUDA storage and layout of `t`, a tensor an op holds rather than receives
/// (its output gradient, say); `what` names it in the error when `t` is elsewhere.
pub(crate) fn with_cuda<R>(
    t: &Tensor,
    what: &str,
    f: impl FnOnce(&CudaStorage, &Layout) -> Result<R>,
) -> Result<R> {
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        candle_core::Storage::Cuda(s) => f(s, layout),
        _ => candle_core::bail!("{what} is not on the GPU"),
    }
}

/// Mask parameters for the kernels: (state, threshold, keep); none keeps everything.
pub(crate) fn mask_args(mask: &Option<DropoutMask>) -> (u64, u64, f32) {
    match mask {
        Some(m) => (m.rng.state, m.threshold, m.keep),
        None => (0, 0, 1.0),
    }
}

pub(crate) fn blocks(n: usize, per_block: usize) -> u32 {
    n.div_ceil(per_block).max(1) as u32
}

pub(crate) fn cfg(grid: u32, block: u32, shared: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid, 1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: shared,
    }
}

/// The `cpu_fwd` of an op that has only a CUDA half (on the CPU its callers take another op):
/// an error naming the op. `cuda_only!(2)` in a `CustomOp2`, `cuda_only!(3)` in a `CustomOp3`.
macro_rules! cuda_only {
    (2) => {
        cuda_only!(_a _al, _b _bl);
    };
    (3) => {
        cuda_only!(_a _al, _b _bl, _c _cl);
    };
    ($($s:ident $l:ident),+) => {
        fn cpu_fwd(
            &self,
            $($s: &candle_core::CpuStorage, $l: &Layout),+
        ) -> Result<(candle_core::CpuStorage, Shape)> {
            candle_core::bail!("{} runs on CUDA devices only", self.name())
        }
    };
}

pub(crate) use cuda_only;
pub(crate) use launch;
pub(crate) use with_elem;

/// What an op's CUDA half imports.
pub(crate) mod prelude {
    pub(crate) use super::{
        blocks, cfg, cuda_only, input, launch, mask_args, with_cuda, with_elem, Elem,
    };
    pub(crate) use crate::ops::DropoutMask;
    pub(crate) use candle_core::backend::BackendStorage;
    pub(crate) use candle_core::cuda_backend::cudarc::driver::{
        CudaSlice, DeviceRepr, PushKernelArg,
    };
    pub(crate) use candle_core::cuda_backend::CudaDType;
    pub(crate) use candle_core::{
        CudaDevice, CudaStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor,
    };
}

/// Sets a new device up as nmt runs it:
/// - cudarc records no CUDA events around every kernel launch and allocation. Candle works on
///   one stream, where they order nothing, yet they cost several driver calls per op.
/// - The device's memory pool keeps what it frees. Its default release threshold, 0, hands
///   freed memory back to the driver at every synchronisation, and a training step
///   synchronises to read its loss, so each step mapped its working memory afresh; PyTorch's
///   caching allocator keeps it too. The peak is unchanged: only what a step already used
///   stays reserved for the next. Where the pool cannot be set, allocation works as before.
pub fn configure(device: &CudaDevice) {
    use candle_core::cuda_backend::cudarc::driver::{result, sys};
    // SAFETY: everything nmt runs on the device goes through Candle's one stream (cuBLAS and
    // cuRAND are bound to it too), so no cross-stream ordering is needed.
    unsafe { device.disable_event_tracking() }
    let stream = device.cuda_stream();
    let ctx = stream.context();
    if !ctx.has_async_alloc() {
        return; // cudarc allocates with cuMemAlloc: no pool
    }
    let mut keep_all = u64::MAX;
    // SAFETY: `cu_device` is the context's own device handle; the attribute's value is a u64
    // (cuMemPoolSetAttribute, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD), alive across the call.
    let _ = unsafe {
        result::device::get_default_mem_pool(ctx.cu_device()).and_then(|pool| {
            result::mem_pool::set_attribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&mut keep_all as *mut u64).cast(),
            )
        })
    };
}
