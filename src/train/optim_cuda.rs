//! Adam's CUDA half: all parameters updated in place in three launches through tables of
//! device pointers (no gathering or scattering), with the global norm and clipping on the
//! device, so that nothing waits for the GPU.

use crate::ops::cuda::prelude::*;

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
