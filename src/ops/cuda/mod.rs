//! nmt's CUDA kernels (`kernels.cu`, built into PTX by build.rs) behind Candle ops: dropout
//! drawn from the CPU's mask stream, the post-norm residual block LayerNorm(x + dropout(f)),
//! LayerNorm alone, the gradient of row gathers (embeddings), label-smoothed cross-entropy,
//! and Adam over all parameters in place. Each is one to three launches where Candle's generic
//! kernels took five to several hundred (Adam gathered and scattered every parameter).
//!
//! Every `unsafe` here is an allocation left uninitialised for a kernel that writes all of it,
//! or a launch whose arguments follow the kernel's signature in kernels.cu.

use super::DropoutMask;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{
    CudaDevice, CudaStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor,
};

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/kernels.ptx"));

/// A storage type the kernels are instantiated for.
trait Elem: CudaDType + DeviceRepr {
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
            DType::F32 => {
                type $t = f32;
                $body
            }
            DType::BF16 => {
                type $t = half::bf16;
                $body
            }
            DType::F16 => {
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
fn input<'a, T: CudaDType + DeviceRepr>(
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
        let func = $dev.get_or_load_custom_func($name, "nmt", PTX)?;
        let mut $b = func.builder();
        $push
        // SAFETY: the arguments follow the kernel's signature in kernels.cu.
        unsafe { $b.launch($config) }.w()?;
    }};
}

/// Runs `f` on the CUDA storage and layout of `t`, a tensor an op holds rather than receives
/// (its output gradient, say); `what` names it in the error when `t` is elsewhere.
fn with_cuda<R>(
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
fn mask_args(mask: &Option<DropoutMask>) -> (u64, u64, f32) {
    match mask {
        Some(m) => (m.rng.state, m.threshold, m.keep),
        None => (0, 0, 1.0),
    }
}

fn blocks(n: usize, per_block: usize) -> u32 {
    n.div_ceil(per_block).max(1) as u32
}

fn cfg(grid: u32, block: u32, shared: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid, 1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: shared,
    }
}

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

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &Layout,
        _: &candle_core::CpuStorage,
        _: &Layout,
        _: &candle_core::CpuStorage,
        _: &Layout,
    ) -> Result<(candle_core::CpuStorage, Shape)> {
        candle_core::bail!("{} runs on CUDA devices only", self.name())
    }

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

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &Layout,
        _: &candle_core::CpuStorage,
        _: &Layout,
        _: &candle_core::CpuStorage,
        _: &Layout,
    ) -> Result<(candle_core::CpuStorage, Shape)> {
        candle_core::bail!("{} runs on CUDA devices only", self.name())
    }

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

/// Rows `ids` (u32, N) of a table `w` (V, d) → (N, d) (an embedding lookup), whose gradient
/// for `w` the kernels sum in the order of the ids.
pub struct SelectRows;

/// ∂L/∂w (V, d) of [`SelectRows`] from the output gradient (N, d) and the ids.
struct SelectRowsGrad {
    vocab: usize,
}

impl CustomOp2 for SelectRows {
    fn name(&self) -> &'static str {
        "nmt-select-rows-cuda"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &Layout,
        _: &candle_core::CpuStorage,
        _: &Layout,
    ) -> Result<(candle_core::CpuStorage, Shape)> {
        candle_core::bail!("{} runs on CUDA devices only", self.name())
    }

    fn cuda_fwd(
        &self,
        w: &CudaStorage,
        wl: &Layout,
        ids: &CudaStorage,
        idl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let d = wl.dims()[1];
        let out = w.index_select(ids, wl, idl, 0)?;
        Ok((out, Shape::from((idl.shape().elem_count(), d))))
    }

    fn bwd(
        &self,
        w: &Tensor,
        ids: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let grad = SelectRowsGrad { vocab: w.dim(0)? };
        Ok((Some(dy.contiguous()?.apply_op2_no_bwd(ids, &grad)?), None))
    }
}

impl CustomOp2 for SelectRowsGrad {
    fn name(&self) -> &'static str {
        "nmt-select-rows-grad-cuda"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &Layout,
        _: &candle_core::CpuStorage,
        _: &Layout,
    ) -> Result<(candle_core::CpuStorage, Shape)> {
        candle_core::bail!("{} runs on CUDA devices only", self.name())
    }

    fn cuda_fwd(
        &self,
        g: &CudaStorage,
        gl: &Layout,
        ids: &CudaStorage,
        idl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let dev = g.device().clone();
        let n = idl.shape().elem_count();
        let d = gl.shape().elem_count() / n.max(1);
        let idv = input::<u32>(ids, idl)?;
        let links = dev.alloc_zeros::<i32>(2 * n.max(1))?;
        let next = links.slice(0..n);
        let first = links.slice(n..);
        let n32 = n as i32;
        launch!(
            dev,
            "embedding_links_u32",
            cfg(blocks(n, 128), 128, 0),
            |b| {
                b.arg(&idv).arg(&n32).arg(&next).arg(&first);
            }
        );
        with_elem!(g.dtype(), T => {
            let gs = input::<T>(g, gl)?;
            let out = dev.alloc_zeros::<T>(self.vocab * d)?;
            let (d32, vocab32) = (d as i32, self.vocab as u32);
            launch!(dev, &format!("embedding_grad_{}", T::NAME), cfg(blocks(n * d, 256), 256, 0), |b| {
                b.arg(&idv).arg(&gs).arg(&next).arg(&first).arg(&out).arg(&n32).arg(&d32).arg(&vocab32);
            });
            Ok((T::wrap_cuda_slice(out, dev), Shape::from((self.vocab, d))))
        })
    }
}

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

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &Layout,
        _: &candle_core::CpuStorage,
        _: &Layout,
    ) -> Result<(candle_core::CpuStorage, Shape)> {
        candle_core::bail!("{} runs on CUDA devices only", self.name())
    }

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

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &Layout,
        _: &candle_core::CpuStorage,
        _: &Layout,
    ) -> Result<(candle_core::CpuStorage, Shape)> {
        candle_core::bail!("{} runs on CUDA devices only", self.name())
    }

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

/// Elements per chunk of the Adam kernels (`ADAM_CHUNK` in kernels.cu).
const ADAM_CHUNK: usize = 4096;

/// What the Adam kernels need to know of the parameters, on the device: made once (again
/// after the masks change).
pub struct AdamTables {
    chunk_param: CudaSlice<u32>,
    chunk_start: CudaSlice<u32>,
    offsets: CudaSlice<u64>,
    lens: CudaSlice<u64>,
    decay: CudaSlice<u8>,
    grad_mask: Option<CudaSlice<u8>>,
    chunks: usize,
}

impl AdamTables {
    /// For parameters of `lens` elements laid out one after the other, with per-element
    /// decay (0/1) and gradient (0: frozen) masks.
    pub fn new(
        dev: &CudaDevice,
        lens: &[usize],
        decay: &[u8],
        grad_mask: Option<&[u8]>,
    ) -> Result<Self> {
        let (mut chunk_param, mut chunk_start, mut offsets) = (Vec::new(), Vec::new(), Vec::new());
        let mut offset = 0u64;
        for (p, &len) in lens.iter().enumerate() {
            for start in (0..len).step_by(ADAM_CHUNK) {
                chunk_param.push(p as u32);
                chunk_start.push(start as u32);
            }
            offsets.push(offset);
            offset += len as u64;
        }
        let lens: Vec<u64> = lens.iter().map(|&l| l as u64).collect();
        Ok(Self {
            chunks: chunk_param.len(),
            chunk_param: dev.clone_htod(&chunk_param)?,
            chunk_start: dev.clone_htod(&chunk_start)?,
            offsets: dev.clone_htod(&offsets)?,
            lens: dev.clone_htod(&lens)?,
            decay: dev.clone_htod(decay)?,
            grad_mask: grad_mask.map(|m| dev.clone_htod(m)).transpose()?,
        })
    }
}

/// Adam's scalars for one update.
pub struct AdamArgs {
    pub scale: f64,
    pub clip_norm: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub bc1: f64,
    pub bc2: f64,
    pub lr: f64,
    pub weight_decay: f64,
}

/// The device address of a contiguous tensor's first element.
fn address<T: CudaDType + DeviceRepr>(t: &Tensor) -> Result<u64> {
    use candle_core::cuda_backend::cudarc::driver::DevicePtr;
    with_cuda(t, "Adam on CUDA: a tensor", |s, layout| {
        if !layout.is_contiguous() {
            candle_core::bail!("Adam on CUDA: a tensor is not contiguous");
        }
        let slice = s.as_cuda_slice::<T>()?;
        let stream = s.device().cuda_stream();
        let (ptr, _) = slice.device_ptr(&stream);
        Ok(ptr + (layout.start_offset() * std::mem::size_of::<T>()) as u64)
    })
}

/// One Adam update of `params` (written in place) from `grads` (same order and dtype) and the
/// flat f32 `state` [m | v | master] (updated in place), in three launches. Returns the
/// device's (clip factor, gradient norm) as a (2,) f32 tensor; nothing waits for the GPU.
pub fn adam_update(
    tables: &AdamTables,
    grads: &[Tensor],
    params: &[&Tensor],
    state: &Tensor,
    a: &AdamArgs,
) -> Result<Tensor> {
    let Some(first) = params.first() else {
        candle_core::bail!("Adam on CUDA: no parameters")
    };
    let candle_core::Device::Cuda(dev) = first.device() else {
        candle_core::bail!("Adam on CUDA: the parameters are not on the GPU")
    };
    let n = (state.elem_count() / 3) as u64;
    let grads: Vec<Tensor> = grads
        .iter()
        .map(|g| g.contiguous())
        .collect::<Result<_>>()?;
    let partial = unsafe { dev.alloc::<f32>(tables.chunks)? };
    let clip = unsafe { dev.alloc::<f32>(2)? };
    let state_ptr = address::<f32>(state)?;
    let null = 0u64;
    let n_params = params.len() as i32;
    with_elem!(first.dtype(), T => {
        let mut ptrs = Vec::with_capacity(2 * params.len());
        for g in &grads {
            ptrs.push(address::<T>(g)?);
        }
        for p in params {
            ptrs.push(address::<T>(p)?);
        }
        let ptrs = dev.clone_htod(&ptrs)?;
        let grid = cfg(tables.chunks as u32, 256, 0);
        let (scale, clip_norm) = (a.scale as f32, a.clip_norm as f32);
        launch!(dev, &format!("adam_norm_{}", T::NAME), grid, |b| {
            b.arg(&ptrs).arg(&tables.chunk_param).arg(&tables.chunk_start).arg(&tables.offsets).arg(&tables.lens);
            match &tables.grad_mask { Some(m) => b.arg(m), None => b.arg(&null) };
            b.arg(&scale).arg(&partial);
        });
        let chunks = tables.chunks as i32;
        launch!(dev, "adam_clip", cfg(1, 256, 0), |b| {
            b.arg(&partial).arg(&chunks).arg(&clip_norm).arg(&clip);
        });
        let f = |x: f64| x as f32;
        let scalars = [f(a.beta1), f(1.0 - a.beta1), f(a.beta2), f(1.0 - a.beta2), f(a.eps), f(a.bc1), f(a.bc2), f(a.lr), f(a.lr * a.weight_decay)];
        launch!(dev, &format!("adam_step_{}", T::NAME), grid, |b| {
            b.arg(&ptrs).arg(&n_params).arg(&tables.chunk_param).arg(&tables.chunk_start).arg(&tables.offsets).arg(&tables.lens);
            match &tables.grad_mask { Some(m) => b.arg(m), None => b.arg(&null) };
            b.arg(&tables.decay).arg(&state_ptr).arg(&n).arg(&clip).arg(&scale);
            for x in &scalars {
                b.arg(x);
            }
        });
        Ok::<(), candle_core::Error>(())
    })?;
    // The gradients and pointer table are freed in stream order, after the kernels ran.
    let clip = CudaStorage::wrap_cuda_slice(clip, dev.clone());
    Ok(Tensor::from_storage(
        candle_core::Storage::Cuda(clip),
        2,
        candle_core::op::BackpropOp::none(),
        false,
    ))
}

/// Stops cudarc from recording CUDA events around every kernel launch and allocation. Candle
/// works on one stream, where they order nothing, yet cost several driver calls per op.
pub fn single_stream(device: &CudaDevice) {
    // SAFETY: everything nmt runs on the device goes through Candle's one stream (cuBLAS and
    // cuRAND are bound to it too), so no cross-stream ordering is needed.
    unsafe { device.disable_event_tracking() }
}
