//! Fused CPU kernels with their own backward passes for the three hot spots of training:
//! LayerNorm, attention softmax with an additive mask, and label-smoothed cross-entropy over
//! the vocabulary. Each replaces a chain of generic ops whose backward allocates and sweeps
//! memory once per op. On a CUDA GPU, dropout, the residual LayerNorm, the embedding gradient
//! and the cross-entropy run nmt's own kernels (`model/cuda.rs`), and softmax Candle's with a
//! backward supplied here; elsewhere the same functions fall back to differentiable
//! compositions of Candle ops, so results agree everywhere.

use crate::rng::Rng;
use candle_core::{
    CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor, D,
};
use rayon::prelude::*;

/// Whether the CPU f32 kernels of this crate apply to `t`.
pub(crate) fn fused(t: &Tensor) -> bool {
    t.device().is_cpu() && t.dtype() == DType::F32
}

/// Whether nmt's CUDA kernels (`model/cuda.rs`) apply to `t`.
pub(crate) fn cuda_kernels(t: &Tensor) -> bool {
    #[cfg(feature = "cuda")]
    {
        super::cuda::serves(t)
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

fn u32_slice<'a>(s: &'a CpuStorage, l: &Layout) -> Result<&'a [u32]> {
    let data = s.as_slice::<u32>()?;
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&data[a..b]),
        None => candle_core::bail!("fused op: input is not contiguous"),
    }
}

/// Whether this CPU has AVX-512 F, DQ, BW and VL (every AVX-512 CPU since Skylake-SP and
/// Zen 4; detected once, the standard library caches it).
pub(crate) fn has_avx512() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512dq")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vl")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Runs `f` inside a function compiled for AVX-512 where the CPU has it, so that the loops
/// inlined into it vectorise 16 lanes wide rather than the baseline x86-64 target's 4. Results
/// are the same either way: element-wise arithmetic is unchanged (no fused multiply-add is
/// formed) and the reductions keep their `LANES` partial sums.
#[inline(always)]
pub fn wide<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f,avx512dq,avx512bw,avx512vl")]
        unsafe fn run<R>(f: impl FnOnce() -> R) -> R {
            f()
        }
        if has_avx512() {
            // SAFETY: the CPU supports the enabled feature.
            return unsafe { run(f) };
        }
    }
    f()
}

/// Rows per parallel task: enough work per task to amortise scheduling.
fn rows_per_task(width: usize) -> usize {
    (16_384 / width.max(1)).max(1)
}

// ---------------------------------------------------------------- LayerNorm

struct LayerNormOp {
    eps: f32,
}

struct LayerNormGrad {
    eps: f32,
}

fn row_stats(x: &[f32], eps: f32) -> (f32, f32) {
    let n = x.len() as f32;
    let mean = x.iter().sum::<f32>() / n;
    let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / n;
    (mean, 1.0 / (var + eps).sqrt())
}

impl CustomOp3 for LayerNormOp {
    fn name(&self) -> &'static str {
        "nmt-layer-norm"
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
        let y = layer_norm_rows(x, w, b, self.eps);
        Ok((CpuStorage::F32(y), l1.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _b: &Tensor,
        _res: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let d = w.dim(0)?;
        let n = x.elem_count() / d;
        let all = x.apply_op3_no_bwd(
            &w.contiguous()?,
            &dy.contiguous()?,
            &LayerNormGrad { eps: self.eps },
        )?;
        let dx = all.narrow(0, 0, n)?.reshape(x.shape())?;
        let dw = all.get(n)?;
        let db = all.get(n + 1)?;
        Ok((Some(dx), Some(dw), Some(db)))
    }
}

impl CustomOp3 for LayerNormGrad {
    fn name(&self) -> &'static str {
        "nmt-layer-norm-grad"
    }

    /// Output (N + 2, D): dx rows, then dw, then db.
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
        let d = w.len();
        let n = x.len() / d;
        let mut out = vec![0f32; (n + 2) * d];
        let (dx, rest) = out.split_at_mut(n * d);
        let (dw, db) = layer_norm_backward_rows(x, w, dy, self.eps, dx);
        rest[..d].copy_from_slice(&dw);
        rest[d..].copy_from_slice(&db);
        Ok((CpuStorage::F32(out), Shape::from((n + 2, d))))
    }
}

/// LayerNorm of each `w.len()`-wide row of `x`, in parallel.
fn layer_norm_rows(x: &[f32], w: &[f32], b: &[f32], eps: f32) -> Vec<f32> {
    let d = w.len();
    let mut y = vec![0f32; x.len()];
    let rows = rows_per_task(d);
    y.par_chunks_mut(d * rows)
        .zip(x.par_chunks(d * rows))
        .for_each(|(yc, xc)| {
            wide(
                #[inline(always)]
                || {
                    for (yr, xr) in yc.chunks_mut(d).zip(xc.chunks(d)) {
                        let (mean, rstd) = row_stats(xr, eps);
                        for i in 0..d {
                            yr[i] = (xr[i] - mean) * rstd * w[i] + b[i];
                        }
                    }
                },
            )
        });
    y
}

/// LayerNorm's backward for inputs `x` and output gradient `dy`: dx into `dx`, and (dw, db).
fn layer_norm_backward_rows(
    x: &[f32],
    w: &[f32],
    dy: &[f32],
    eps: f32,
    dx: &mut [f32],
) -> (Vec<f32>, Vec<f32>) {
    let d = w.len();
    let rows = rows_per_task(d);
    dx.par_chunks_mut(d * rows)
        .zip(x.par_chunks(d * rows).zip(dy.par_chunks(d * rows)))
        .map(|(dxc, (xc, dyc))| {
            wide(
                #[inline(always)]
                || {
                    let mut dw = vec![0f32; d];
                    let mut db = vec![0f32; d];
                    let mut xhat = vec![0f32; d];
                    for ((dxr, xr), dyr) in dxc.chunks_mut(d).zip(xc.chunks(d)).zip(dyc.chunks(d)) {
                        let (mean, rstd) = row_stats(xr, eps);
                        let (mut s1, mut s2) = (0f32, 0f32);
                        for i in 0..d {
                            xhat[i] = (xr[i] - mean) * rstd;
                            let g = dyr[i] * w[i];
                            s1 += g;
                            s2 += g * xhat[i];
                            dw[i] += dyr[i] * xhat[i];
                            db[i] += dyr[i];
                        }
                        let (m1, m2) = (s1 / d as f32, s2 / d as f32);
                        for i in 0..d {
                            dxr[i] = rstd * (dyr[i] * w[i] - m1 - xhat[i] * m2);
                        }
                    }
                    (dw, db)
                },
            )
        })
        // Partials summed in chunk order, not in the shape of whichever split tree the
        // scheduler made: the same inputs give the same gradients on every run.
        .collect::<Vec<_>>()
        .into_iter()
        .fold((vec![0f32; d], vec![0f32; d]), |(mut a, mut b), (c, e)| {
            a.iter_mut().zip(c).for_each(|(p, q)| *p += q);
            b.iter_mut().zip(e).for_each(|(p, q)| *p += q);
            (a, b)
        })
}

/// LayerNorm(x + f · mask) in one op (the post-norm residual block): `wb` holds the norm's
/// weight then its bias. The sum is kept for the backward pass.
struct ResidualNorm {
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

/// LayerNorm over the last dimension: (x − mean) / √(var + eps) · w + b.
pub fn layer_norm(x: &Tensor, w: &Tensor, b: &Tensor, eps: f64) -> Result<Tensor> {
    if fused(x) {
        return x
            .contiguous()?
            .apply_op3(w, b, LayerNormOp { eps: eps as f32 });
    }
    #[cfg(feature = "cuda")]
    if cuda_kernels(x) && w.dim(0)? <= super::cuda::MAX_WIDTH {
        let x = x.contiguous()?;
        let op = super::cuda::ResidualNorm {
            mask: None,
            eps: eps as f32,
            has_f: false,
        };
        return x.apply_op3(&x, &Tensor::cat(&[w, b], 0)?, op);
    }
    if gpu_kernels(x) {
        return layer_norm_kernels(x, w, b, eps);
    }
    let mean = x.mean_keepdim(D::Minus1)?;
    let centred = x.broadcast_sub(&mean)?;
    let var = centred.sqr()?.mean_keepdim(D::Minus1)?;
    let normed = centred.broadcast_div(&(var + eps)?.sqrt()?)?;
    normed.broadcast_mul(w)?.broadcast_add(b)
}

/// (table[ids] · scale + positions) · mask as one op: the scaled token embeddings plus the
/// positions, with dropout. In Candle's primitives that is a row gather, a reshape, a scaling,
/// a broadcast addition and the dropout: five graph nodes, each costing the backward pass a
/// zero-filled gradient buffer and an addition. The gradient reaches only the table.
struct EmbedOp {
    scale: f32,
    mask: Option<DropoutMask>,
}

impl CustomOp3 for EmbedOp {
    fn name(&self) -> &'static str {
        "nmt-embed"
    }

    /// table (V, d), ids (B, T), positions (T, d) → (B, T, d).
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (table, ids, pos) = (slice(s1, l1)?, u32_slice(s2, l2)?, slice(s3, l3)?);
        let (v, d) = (l1.dims()[0], l1.dims()[1]);
        let (b, t) = (l2.dims()[0], l2.dims()[1]);
        if pos.len() != t * d {
            candle_core::bail!("embed: positions for {} of {t} steps", pos.len() / d.max(1));
        }
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= v) {
            candle_core::bail!("embed: id {id} is outside the vocabulary of {v}");
        }
        let mut y = vec![0f32; b * t * d];
        y.par_chunks_mut(rows_per_task(d) * d)
            .enumerate()
            .for_each(|(c, yc)| {
                let r0 = c * rows_per_task(d);
                for (r, yr) in yc.chunks_mut(d).enumerate() {
                    let (id, step) = (ids[r0 + r] as usize, (r0 + r) % t);
                    let (e, p) = (&table[id * d..(id + 1) * d], &pos[step * d..(step + 1) * d]);
                    for j in 0..d {
                        yr[j] = e[j] * self.scale + p[j];
                    }
                }
            });
        let y = match &self.mask {
            Some(m) => m.apply(&y, None),
            None => y,
        };
        Ok((CpuStorage::F32(y), Shape::from((b, t, d))))
    }

    fn bwd(
        &self,
        table: &Tensor,
        ids: &Tensor,
        _pos: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (v, d) = table.dims2()?;
        let ids = ids.flatten_all()?.to_vec1::<u32>()?;
        let dy = dy.contiguous()?;
        let mut grad = vec![0f32; v * d];
        with_host_f32(&dy, |dy| {
            let dy = match &self.mask {
                Some(m) => std::borrow::Cow::Owned(m.apply(dy, None)),
                None => std::borrow::Cow::Borrowed(dy),
            };
            // Threads own column ranges of the table; each walks the ids in order, so every
            // entry sums its contributions in one fixed order (an index-add's).
            let cols = d.div_ceil(rayon::current_num_threads().max(1)).max(16);
            let grad = OutPtr(grad.as_mut_ptr());
            (0..d.div_ceil(cols)).into_par_iter().for_each(|c| {
                let (j0, j1) = (c * cols, ((c + 1) * cols).min(d));
                for (i, &id) in ids.iter().enumerate() {
                    let at = id as usize * d;
                    for (j, s) in dy[i * d..(i + 1) * d].iter().enumerate().take(j1).skip(j0) {
                        // SAFETY: ids were checked against the vocabulary in the forward
                        // pass, so at + j < v·d; tasks write disjoint column ranges.
                        unsafe { *grad.at(at + j) += s * self.scale };
                    }
                }
            });
        })?;
        let grad = Tensor::from_vec(grad, (v, d), table.device())?;
        Ok((Some(grad), None, None))
    }
}

/// An output shared by parallel tasks, each writing its own disjoint elements.
pub(crate) struct OutPtr(pub(crate) *mut f32);
// SAFETY: every user hands each task disjoint elements of the output.
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// The element at `i`.
    ///
    /// # Safety
    /// `i` lies inside the output, and no other task touches that element meanwhile.
    pub(crate) unsafe fn at(&self, i: usize) -> *mut f32 {
        unsafe { self.0.add(i) }
    }
}

/// Scaled embeddings of `ids` (B, T) from `table` (V, d) plus `positions` (T, d), then
/// dropout with `mask`: (B, T, d), as one op; the gradient reaches the table only. For a CPU
/// f32 table and u32 ids (see [`embeds_fused`]); elsewhere the caller composes Candle's ops.
pub fn embed(
    table: &Tensor,
    ids: &Tensor,
    positions: &Tensor,
    scale: f64,
    mask: Option<DropoutMask>,
) -> Result<Tensor> {
    if !embeds_fused(table, ids) {
        candle_core::bail!("embed: needs a CPU f32 table and u32 ids");
    }
    let op = EmbedOp {
        scale: scale as f32,
        mask,
    };
    table
        .contiguous()?
        .apply_op3(&ids.contiguous()?, &positions.contiguous()?, op)
}

/// Whether [`embed`] serves this table and these ids.
pub fn embeds_fused(table: &Tensor, ids: &Tensor) -> bool {
    fused(table) && ids.dtype() == DType::U32
}

/// Rows `ids` (N,) of a table `w` (V, d) → (N, d): an embedding lookup, or a gather of
/// hidden states. On CUDA with u32 ids the gradient is summed by nmt's kernels (Candle's
/// index_add walks all ids once per column, milliseconds for a batch).
pub fn select_rows(w: &Tensor, ids: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if cuda_kernels(w) && ids.dtype() == DType::U32 && ids.elem_count() > 0 {
        return w
            .contiguous()?
            .apply_op2(&ids.contiguous()?, super::cuda::SelectRows);
    }
    w.embedding(ids)
}

// ---------------------------------------------------------------- GPU: Candle's kernels, our backward

/// Where Candle's own fused softmax and LayerNorm kernels serve: devices other than the CPU
/// (there the fused ops above serve f32). They have no backward in Candle, so [`WithGrad`]
/// supplies it; the compositions they replace cost several kernel launches each way.
fn gpu_kernels(t: &Tensor) -> bool {
    !t.device().is_cpu()
}

/// `(x, y) → y` where `y` was computed from `x` by a kernel without a backward: passes `y`
/// through and gives `x` the gradient of that computation, from `x`, `y` and dL/dy.
enum WithGrad {
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
fn layer_norm_kernels(x: &Tensor, w: &Tensor, b: &Tensor, eps: f64) -> Result<Tensor> {
    let x = x.contiguous()?;
    let xhat = candle_nn::ops::layer_norm(&x, &w.ones_like()?, &w.zeros_like()?, eps as f32)?;
    let xhat = x.apply_op2(&xhat, WithGrad::LayerNorm { eps })?;
    xhat.broadcast_mul(w)?.broadcast_add(b)
}

/// Softmax over the last dimension from Candle's fused kernel.
fn softmax_kernels(x: &Tensor) -> Result<Tensor> {
    let x = x.contiguous()?;
    let y = candle_nn::ops::softmax_last_dim(&x)?;
    x.apply_op2(&y, WithGrad::Softmax)
}

// ---------------------------------------------------------------- masked softmax

struct MaskedSoftmax {
    /// (B, H, T, S) of the scores and (Bb, Tb) of the bias.
    dims: [usize; 4],
    bias_b: usize,
    bias_t: usize,
}

struct SoftmaxGrad;

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

// ---------------------------------------------------------------- label-smoothed cross-entropy

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
            super::cuda::SmoothedCrossEntropy {
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

/// Lanes of the vectorisable reductions below: independent partial sums the compiler can keep
/// in SIMD registers (a plain left-to-right float sum cannot be reordered, so it runs serially).
const LANES: usize = 16;

#[inline(always)]
fn lanes_fold(x: &[f32], init: f32, f: impl Fn(f32, f32) -> f32) -> [f32; LANES] {
    let mut acc = [init; LANES];
    let mut chunks = x.chunks_exact(LANES);
    for c in &mut chunks {
        for i in 0..LANES {
            acc[i] = f(acc[i], c[i]);
        }
    }
    for (i, &v) in chunks.remainder().iter().enumerate() {
        acc[i] = f(acc[i], v);
    }
    acc
}

/// Maximum of a row (−∞ for an empty one).
#[inline(always)]
pub fn row_max(x: &[f32]) -> f32 {
    lanes_fold(x, f32::NEG_INFINITY, f32::max)
        .into_iter()
        .fold(f32::NEG_INFINITY, f32::max)
}

/// Sum of a row, in `LANES` partial sums.
#[inline(always)]
fn row_sum(x: &[f32]) -> f32 {
    lanes_fold(x, 0.0, |a, b| a + b).into_iter().sum()
}

/// e^x in f32 without a libm call, so loops over it vectorise: Cephes' `expf` (range reduction
/// by n·ln 2 split in two parts, degree-6 polynomial), within 2 ulp of the exact value for
/// −87 ≤ x ≤ 88; smaller x give 0, larger saturate at e^88 (e^−87 ≈ 1.6e−38, the end of the normal range).
#[inline(always)]
pub fn fast_exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const ROUND: f32 = 12_582_912.0; // 1.5 · 2^23: adding it rounds to an integer
    let underflow = x < -87.0;
    let x = x.clamp(-87.0, 88.0);
    let n = (x * LOG2E + ROUND) - ROUND;
    let r = x - n * 0.693_359_4 + n * 2.121_944_4e-4;
    let z = r * r;
    let p = (((((1.987_569_2e-4 * r + 1.398_2e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r
        + 0.166_666_65)
        * r
        + 0.5)
        * z
        + r
        + 1.0;
    let scale = f32::from_bits(((n as i32 + 127) as u32) << 23);
    let y = p * scale;
    if underflow {
        0.0
    } else {
        y
    }
}

/// Σ e^(x − shift) over `row`, in `LANES` partial sums.
#[inline(always)]
pub fn exp_sum(row: &[f32], shift: f32) -> f32 {
    lanes_fold(row, 0.0, |a, x| a + fast_exp(x - shift))
        .into_iter()
        .sum()
}

/// Replaces each x of `row` by e^(x − shift) and returns their sum.
#[inline(always)]
fn exp_shifted_sum(row: &mut [f32], shift: f32) -> f32 {
    row.iter_mut().for_each(|x| *x = fast_exp(*x - shift));
    row_sum(row)
}

// ------------------------------------------ output projection + cross-entropy, fused

/// Rows of logits materialised at a time by [`projected_cross_entropy`]: bounds its memory
/// for large batches. Smaller blocks measured slower (each gemm re-packs the whole weight).
const LOGIT_ROWS: usize = 2048;

struct ProjectedCrossEntropy {
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
            (vec![0f32; n * d], vec![0f32; v * d])
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

// ---------------------------------------------------------------- linear (+ ReLU)

struct LinearOp {
    relu: bool,
}

/// The backward of [`LinearOp`]; with `relu_out`, the layer's ReLU output, whose zeros mask
/// the incoming gradient (applied on the fly, not as an op of its own).
struct LinearGrad {
    relu_out: Option<Tensor>,
}

/// A matrix in a slice: element (r, c) at `data[r·rs + c·cs]`.
#[derive(Clone, Copy)]
pub(crate) struct Strided<'a> {
    pub data: &'a [f32],
    pub rs: usize,
    pub cs: usize,
}

impl<'a> Strided<'a> {
    /// Row-major, rows `stride` elements apart.
    pub fn rows(data: &'a [f32], stride: usize) -> Self {
        Self {
            data,
            rs: stride,
            cs: 1,
        }
    }

    /// The transpose of a row-major matrix whose rows are `stride` elements apart.
    pub fn transposed(data: &'a [f32], stride: usize) -> Self {
        Self {
            data,
            rs: 1,
            cs: stride,
        }
    }
}

/// dst (m×n, row stride `dst_rs`) = [dst +] scale · lhs (m×k) · rhs (k×n), on the calling
/// thread: for the many small products inside a kernel that is parallel on its own, and for
/// pairs of independent products run side by side (`rayon::join`).
pub(crate) fn gemm_serial(
    (m, n, k): (usize, usize, usize),
    dst: &mut [f32],
    dst_rs: usize,
    accumulate: bool,
    lhs: Strided,
    rhs: Strided,
    scale: f32,
) {
    let last =
        |s: &Strided, rows: usize, cols: usize| (rows.max(1) - 1) * s.rs + (cols.max(1) - 1) * s.cs;
    assert!(
        m == 0
            || n == 0
            || (last(&lhs, m, k) < lhs.data.len()
                && last(&rhs, k, n) < rhs.data.len()
                && (m - 1) * dst_rs + n <= dst.len()),
        "gemm_serial: operands too short for a {m}×{k}·{k}×{n} product"
    );
    // SAFETY: the assertion above keeps every element the product touches inside its slice,
    // and dst, a unique borrow, cannot alias the inputs.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            dst_rs as isize,
            accumulate,
            lhs.data.as_ptr(),
            lhs.cs as isize,
            lhs.rs as isize,
            rhs.data.as_ptr(),
            rhs.cs as isize,
            rhs.rs as isize,
            if accumulate { 1.0 } else { 0.0 },
            scale,
            false,
            false,
            false,
            gemm::Parallelism::None,
        )
    }
}

/// `rows` copies of `row` one after another (a bias for each row of a product), copied in
/// parallel.
fn repeat_rows(row: &[f32], rows: usize) -> Vec<f32> {
    let mut out = vec![0f32; rows * row.len()];
    if !row.is_empty() {
        out.par_chunks_mut(rows_per_task(row.len()) * row.len())
            .for_each(|c| c.chunks_mut(row.len()).for_each(|r| r.copy_from_slice(row)));
    }
    out
}

/// dst (m×n) = [dst +] lhs (m×k) · rhs (k×n), strides in elements (row, column).
#[allow(clippy::too_many_arguments)]
fn gemm_into(
    m: usize,
    n: usize,
    k: usize,
    dst: &mut [f32],
    accumulate: bool,
    lhs: &[f32],
    lhs_rs: usize,
    lhs_cs: usize,
    rhs: &[f32],
    rhs_rs: usize,
    rhs_cs: usize,
) {
    let par = if m * n * k > 32 * 1024 {
        gemm::Parallelism::Rayon(rayon::current_num_threads())
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: the slices hold m×n, m×k and k×n elements at the given strides (checked by callers
    // through the tensor shapes), and dst does not alias the inputs.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n as isize,
            accumulate,
            lhs.as_ptr(),
            lhs_cs as isize,
            lhs_rs as isize,
            rhs.as_ptr(),
            rhs_cs as isize,
            rhs_rs as isize,
            if accumulate { 1.0 } else { 0.0 },
            1.0,
            false,
            false,
            false,
            par,
        )
    }
}

/// Up to this many rows, [`skinny_into`] beats gemm: decoding steps with few live rows
/// (the last sentences of a batch) would otherwise re-pack every weight matrix at every step.
/// Measured on greedy decoding (2 threads): 8 or 16 rows best, 84 → 117 sentences/s.
const SKINNY_ROWS: usize = 8;

/// Σ a·b in `LANES` partial sums.
#[inline(always)]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..LANES {
            acc[i] += x[i] * y[i];
        }
    }
    let tail: f32 = ra.iter().zip(rb).map(|(x, y)| x * y).sum();
    acc.into_iter().sum::<f32>() + tail
}

/// dst (m×n) += x (m×k) · wᵀ for a few rows m, w (n×k) row-major: a dot product per output,
/// reading each weight row once for all m rows, in parallel over output columns.
fn skinny_into(m: usize, n: usize, k: usize, dst: &mut [f32], x: &[f32], w: &[f32]) {
    const COLS: usize = 128;
    let col_block = |j0: usize, out: &mut [f32]| {
        for (jj, wr) in w[j0 * k..].chunks(k).take(out.len() / m).enumerate() {
            for r in 0..m {
                out[jj * m + r] = dot(&x[r * k..(r + 1) * k], wr);
            }
        }
    };
    // Column-major scratch (n×m) so that parallel blocks own disjoint slices.
    let mut t = vec![0f32; n * m];
    if m * n * k > 1 << 18 {
        t.par_chunks_mut(COLS * m)
            .enumerate()
            .for_each(|(blk, out)| col_block(blk * COLS, out));
    } else {
        t.chunks_mut(COLS * m)
            .enumerate()
            .for_each(|(blk, out)| col_block(blk * COLS, out));
    }
    for r in 0..m {
        for j in 0..n {
            dst[r * n + j] += t[j * m + r];
        }
    }
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
        let mut out = vec![0f32; rows * n_in + n_out * n_in + n_out];
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
                let mut m = vec![0f32; dy.len()];
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

// ---------------------------------------------------------------- dropout

/// A dropout mask drawn from a SplitMix64 stream: element i is zeroed when the (i mod 2)-th
/// 32-bit half of draw ⌊i/2⌋ + 1 after `rng` is below `threshold`, else scaled by `keep`.
/// Any element can be computed on its own, so masks are made in parallel (and the backward
/// pass recomputes them instead of storing them), equal to drawing them in sequence.
#[derive(Clone, Copy)]
pub struct DropoutMask {
    /// The stream's state before this mask's first draw.
    pub rng: Rng,
    /// Drop probability × 2³².
    pub threshold: u64,
    /// 1 / (1 − p).
    pub keep: f32,
}

impl DropoutMask {
    /// Elements per parallel task (even: a draw covers two elements).
    const CHUNK: usize = 16_384;

    /// out = [base +] x · mask, for the elements `start..start + x.len()` of the mask (`start`
    /// even). Draws are made a block at a time into an array and the elements then read their
    /// halves from it: two loops without branches or cross-iteration state, which vectorise
    /// (64-bit multiplies included, under [`wide`]).
    #[inline(always)]
    fn apply_at(&self, start: usize, x: &[f32], base: Option<&[f32]>, out: &mut [f32]) {
        const PAIRS: usize = 32;
        debug_assert!(start.is_multiple_of(2));
        let mut halves = [0u32; 2 * PAIRS];
        let (threshold, keep) = (self.threshold, self.keep);
        for (blk, o) in out.chunks_mut(2 * PAIRS).enumerate() {
            let first = (start / 2 + blk * PAIRS) as u64 + 1;
            for (t, h) in halves.chunks_exact_mut(2).enumerate() {
                let r = self.rng.draw_at(first + t as u64);
                h[0] = r as u32;
                h[1] = (r >> 32) as u32;
            }
            let at = blk * 2 * PAIRS;
            let xs = &x[at..at + o.len()];
            let factor = |h: u32| if (h as u64) < threshold { 0.0 } else { keep };
            match base {
                Some(b) => {
                    let bs = &b[at..at + o.len()];
                    for i in 0..o.len() {
                        o[i] = bs[i] + xs[i] * factor(halves[i]);
                    }
                }
                None => {
                    for i in 0..o.len() {
                        o[i] = xs[i] * factor(halves[i]);
                    }
                }
            }
        }
    }

    /// [base +] x · mask, in parallel.
    fn apply(&self, x: &[f32], base: Option<&[f32]>) -> Vec<f32> {
        let mut out = vec![0f32; x.len()];
        out.par_chunks_mut(Self::CHUNK)
            .enumerate()
            .for_each(|(c, o)| {
                let at = c * Self::CHUNK;
                let b = base.map(|b| &b[at..at + o.len()]);
                wide(
                    #[inline(always)]
                    || self.apply_at(at, &x[at..at + o.len()], b, o),
                );
            });
        out
    }

    /// The mask's first `n` values (0 or `keep`).
    pub fn values(&self, n: usize) -> Vec<f32> {
        self.apply(&vec![1f32; n], None)
    }
}

struct DropoutOp(DropoutMask);

struct AddDropoutOp(DropoutMask);

impl CustomOp1 for DropoutOp {
    fn name(&self) -> &'static str {
        "nmt-dropout"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout) -> Result<(CpuStorage, Shape)> {
        let y = self.0.apply(slice(s1, l1)?, None);
        Ok((CpuStorage::F32(y), l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let y = super::cuda::dropout(s1, l1, None, &self.0)?;
        Ok((y, l1.shape().clone()))
    }

    fn bwd(&self, _x: &Tensor, _y: &Tensor, dy: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(dy.contiguous()?.apply_op1_no_bwd(self)?))
    }
}

impl CustomOp2 for AddDropoutOp {
    fn name(&self) -> &'static str {
        "nmt-add-dropout"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let y = self.0.apply(slice(s2, l2)?, Some(slice(s1, l1)?));
        Ok((CpuStorage::F32(y), l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let y = super::cuda::dropout(s2, l2, Some((s1, l1)), &self.0)?;
        Ok((y, l1.shape().clone()))
    }

    fn bwd(
        &self,
        _x: &Tensor,
        _f: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let df = dy.contiguous()?.apply_op1_no_bwd(&DropoutOp(self.0))?;
        Ok((Some(dy.clone()), Some(df)))
    }
}

/// x · mask (CPU in f32, or CUDA).
pub fn dropout(x: &Tensor, mask: DropoutMask) -> Result<Tensor> {
    x.contiguous()?.apply_op1(DropoutOp(mask))
}

/// x + f · mask, the residual connection around a sub-layer with output `f` (CPU in f32, or
/// CUDA).
pub fn add_dropout(x: &Tensor, f: &Tensor, mask: DropoutMask) -> Result<Tensor> {
    if x.shape() != f.shape() {
        candle_core::bail!(
            "add_dropout: shapes {:?} and {:?} differ",
            x.shape(),
            f.shape()
        );
    }
    x.contiguous()?
        .apply_op2(&f.contiguous()?, AddDropoutOp(mask))
}

// ---------------------------------------------------------------- single-query attention

struct AttendOne {
    heads: usize,
    /// Additive key bias per key/value row, (B_kv, S) flattened; empty for none.
    bias: Vec<f32>,
    /// The key/value row each query row reads; empty for row b ↔ row b.
    kv_rows: Vec<u32>,
}

impl CustomOp3 for AttendOne {
    fn name(&self) -> &'static str {
        "nmt-attend-one"
    }

    /// q (B, H, 1, d), k and v (B_kv, H, S, d) → softmax(q·kᵀ + bias)·v, (B, H, 1, d).
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (q, k, v) = (slice(s1, l1)?, slice(s2, l2)?, slice(s3, l3)?);
        let dims = l2.dims();
        let (s, d) = (dims[2], dims[3]);
        let mut out = vec![0f32; q.len()];
        out.par_chunks_mut(d).enumerate().for_each(|(r, o)| {
            wide(
                #[inline(always)]
                || {
                    let qr = &q[r * d..(r + 1) * d];
                    let (row, head) = (r / self.heads, r % self.heads);
                    let row = match self.kv_rows.get(row) {
                        Some(&kv) => kv as usize,
                        None => row,
                    };
                    let at = (row * self.heads + head) * s * d;
                    let kr = &k[at..at + s * d];
                    let vr = &v[at..at + s * d];
                    let bias = if self.bias.is_empty() {
                        None
                    } else {
                        Some(&self.bias[row * s..(row + 1) * s])
                    };
                    attend_row(
                        qr,
                        s,
                        |j| &kr[j * d..(j + 1) * d],
                        |j| &vr[j * d..(j + 1) * d],
                        bias,
                        o,
                    );
                },
            )
        });
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }
}

/// Attention of one query position per row, for incremental decoding (no gradient): q
/// (B, H, 1, d) already scaled, k and v (B_kv, H, S, d), bias (B_kv|1, 1, 1, S) or none.
/// `kv_rows` (length B) names the key/value row of each query row, so that the beams of a
/// sentence share one copy of its encoder keys; `None` pairs row b with row b. Returns `None`
/// when this device or dtype has no fused kernel; the caller then uses the general path.
pub fn attend_one(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    bias: Option<&Tensor>,
    kv_rows: Option<&[u32]>,
) -> Result<Option<Tensor>> {
    if !fused(q) || q.dim(2)? != 1 {
        return Ok(None);
    }
    let (b, h, _, _) = q.dims4()?;
    let (b_kv, _, s, _) = k.dims4()?;
    match kv_rows {
        Some(rows) if rows.len() != b || rows.iter().any(|&r| r as usize >= b_kv) => {
            candle_core::bail!("attend_one: bad key/value rows for {b} queries over {b_kv} rows")
        }
        None if b != b_kv => candle_core::bail!("attend_one: {b} queries, {b_kv} key rows"),
        _ => {}
    }
    let bias = match bias {
        Some(t) if t.dims4()?.0 == b_kv && t.dims4()?.2 == 1 => {
            t.flatten_all()?.to_vec1::<f32>()?
        }
        Some(t) if t.dims4()?.0 == 1 && t.dims4()?.2 == 1 => {
            t.flatten_all()?.to_vec1::<f32>()?.repeat(b_kv)
        }
        Some(_) => return Ok(None),
        None => Vec::new(),
    };
    debug_assert!(bias.is_empty() || bias.len() == b_kv * s);
    Ok(Some(q.contiguous()?.apply_op3_no_bwd(
        &k.contiguous()?,
        &v.contiguous()?,
        &AttendOne {
            heads: h,
            bias,
            kv_rows: kv_rows.map(<[u32]>::to_vec).unwrap_or_default(),
        },
    )?))
}

/// Runs `f` on a contiguous CPU f32 tensor's data, read in place.
pub fn with_host_f32<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
    let guard = t.storage_and_layout();
    Ok(f(guarded_f32(&guard)?))
}

/// The data of a contiguous CPU f32 tensor held under its storage guard.
fn guarded_f32<'a>(
    (storage, layout): &'a (candle_core::StorageRef<'_>, &Layout),
) -> Result<&'a [f32]> {
    match &**storage {
        candle_core::Storage::Cpu(cpu) => slice(cpu, layout),
        _ => candle_core::bail!("expected a contiguous f32 tensor on the CPU"),
    }
}

/// softmax(q·kⱼ + biasⱼ)-weighted sum of the values vⱼ for one query row `qr` over `n` keys
/// and values given by `key(j)` and `value(j)`, into `o` (zeroed).
#[inline(always)]
fn attend_row<'a>(
    qr: &[f32],
    n: usize,
    key: impl Fn(usize) -> &'a [f32],
    value: impl Fn(usize) -> &'a [f32],
    bias: Option<&[f32]>,
    o: &mut [f32],
) {
    let mut scores: Vec<f32> = (0..n).map(|j| dot(key(j), qr)).collect();
    if let Some(b) = bias {
        scores.iter_mut().zip(b).for_each(|(x, y)| *x += y);
    }
    let max = scores.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f32;
    scores.iter_mut().for_each(|x| {
        *x = (*x - max).exp();
        sum += *x;
    });
    for (j, p) in scores.iter().enumerate() {
        let w = p / sum;
        o.iter_mut().zip(value(j)).for_each(|(a, b)| *a += w * b);
    }
}

/// Single-query attention for decoding step t on the CPU, over keys/values kept one tensor
/// per step: q (B, H, 1, d) already scaled; `steps[j]` = (k, v), each (B_j, H, 1, d); query
/// row b reads row `history[b][j]` of step j, for j = 0..=t. Beam reordering and pruning only
/// rewrite `history`: no key or value is copied. Returns (B, H, 1, d).
pub fn attend_steps(
    q: &Tensor,
    steps: &[(Tensor, Tensor)],
    history: &[Vec<u32>],
) -> Result<Tensor> {
    let (b, h, _, d) = q.dims4()?;
    let n = steps.len();
    if history.len() != b || history.iter().any(|past| past.len() != n) {
        candle_core::bail!("attend_steps: history does not match {b} rows and {n} steps");
    }
    for (j, (k, v)) in steps.iter().enumerate() {
        let rows = k.dim(0)?;
        if k.dims4()? != (rows, h, 1, d) || v.dims4()? != (rows, h, 1, d) {
            candle_core::bail!(
                "attend_steps: step keys {:?} for queries {:?}",
                k.dims(),
                q.dims()
            );
        }
        if history.iter().any(|past| past[j] as usize >= rows) {
            candle_core::bail!("attend_steps: history names a row past step {j}'s {rows}");
        }
    }
    let guards: Vec<_> = steps
        .iter()
        .map(|(k, v)| (k.storage_and_layout(), v.storage_and_layout()))
        .collect();
    let keys: Vec<&[f32]> = guards
        .iter()
        .map(|(k, _)| guarded_f32(k))
        .collect::<Result<_>>()?;
    let values: Vec<&[f32]> = guards
        .iter()
        .map(|(_, v)| guarded_f32(v))
        .collect::<Result<_>>()?;
    let out = with_host_f32(&q.contiguous()?, |q| {
        let mut out = vec![0f32; b * h * d];
        out.par_chunks_mut(d).enumerate().for_each(|(r, o)| {
            let (row, head) = (r / h, r % h);
            let past = &history[row];
            let at = |j: usize| (past[j] as usize * h + head) * d;
            wide(
                #[inline(always)]
                || {
                    attend_row(
                        &q[r * d..(r + 1) * d],
                        n,
                        |j| &keys[j][at(j)..at(j) + d],
                        |j| &values[j][at(j)..at(j) + d],
                        None,
                        o,
                    )
                },
            );
        });
        out
    })?;
    Tensor::from_vec(out, (b, h, 1, d), q.device())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use candle_core::{Device, Var};

    fn randn(shape: &[usize], seed: u64) -> Tensor {
        let mut rng = crate::rng::Rng::new(seed);
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|_| crate::model::weights::normal(&mut rng) as f32)
            .collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    /// The largest absolute difference between two tensors of one shape.
    pub(crate) fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
        (a - b)
            .unwrap()
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    }

    /// Values and gradients of a fused op equal those of the composite fallback (run on the
    /// same inputs converted to f64, which takes the composite path).
    fn check(f: impl Fn(&[Tensor]) -> Tensor, inputs: &[Tensor], weights: &Tensor) {
        let run = |dtype: DType| {
            let vars: Vec<Var> = inputs
                .iter()
                .map(|t| Var::from_tensor(&t.to_dtype(dtype).unwrap()).unwrap())
                .collect();
            let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
            let y = f(&ts);
            let loss = (y.to_dtype(DType::F32).unwrap() * weights)
                .unwrap()
                .sum_all()
                .unwrap();
            let grads = loss.backward().unwrap();
            let g: Vec<Tensor> = vars
                .iter()
                .map(|v| {
                    grads
                        .get(v.as_tensor())
                        .unwrap()
                        .to_dtype(DType::F32)
                        .unwrap()
                })
                .collect();
            (y.to_dtype(DType::F32).unwrap(), g)
        };
        let (y1, g1) = run(DType::F32);
        let (y2, g2) = run(DType::F64);
        assert!(
            max_diff(&y1, &y2) < 1e-4,
            "values differ by {}",
            max_diff(&y1, &y2)
        );
        for (a, b) in g1.iter().zip(&g2) {
            assert!(
                max_diff(a, b) < 1e-4,
                "gradients differ by {}",
                max_diff(a, b)
            );
        }
    }

    /// Values and gradients of `f` and `g` on the same f32 inputs agree.
    fn same_grads(f: impl Fn(&Tensor) -> Tensor, g: impl Fn(&Tensor) -> Tensor, x: &Tensor) {
        let wts = randn(x.dims(), 99);
        let run = |h: &dyn Fn(&Tensor) -> Tensor| {
            let v = Var::from_tensor(x).unwrap();
            let y = h(v.as_tensor());
            let grads = (&y * &wts).unwrap().sum_all().unwrap().backward().unwrap();
            (y, grads.get(v.as_tensor()).unwrap().clone())
        };
        let ((y1, g1), (y2, g2)) = (run(&f), run(&g));
        assert!(
            max_diff(&y1, &y2) < 1e-5,
            "values differ by {}",
            max_diff(&y1, &y2)
        );
        assert!(
            max_diff(&g1, &g2) < 1e-5,
            "gradients differ by {}",
            max_diff(&g1, &g2)
        );
    }

    #[test]
    fn gpu_paths_have_the_composites_gradients() {
        // The kernels the GPU path uses also run on the CPU, so their backward is checked here.
        let x = randn(&[3, 5, 8], 7);
        let (w, b) = (randn(&[8], 8), randn(&[8], 9));
        let composite = |x: &Tensor| {
            let mean = x.mean_keepdim(D::Minus1)?;
            let centred = x.broadcast_sub(&mean)?;
            let var = centred.sqr()?.mean_keepdim(D::Minus1)?;
            let normed = centred.broadcast_div(&(var + 1e-5)?.sqrt()?)?;
            normed.broadcast_mul(&w)?.broadcast_add(&b)
        };
        same_grads(
            |x| layer_norm_kernels(x, &w, &b, 1e-5).unwrap(),
            |x| composite(x).unwrap(),
            &x,
        );
        same_grads(
            |x| softmax_kernels(x).unwrap(),
            |x| candle_nn::ops::softmax(x, D::Minus1).unwrap(),
            &x,
        );
    }

    #[test]
    fn layer_norm_matches_the_composite() {
        let (x, w, b) = (randn(&[3, 5, 8], 1), randn(&[8], 2), randn(&[8], 3));
        check(
            |t| layer_norm(&t[0], &t[1], &t[2], 1e-5).unwrap(),
            &[x, w, b],
            &randn(&[3, 5, 8], 4),
        );
    }

    /// A dropout mask with p = 0.3 and its values for `n` elements.
    fn test_mask(n: usize) -> (DropoutMask, Tensor) {
        let mask = DropoutMask {
            rng: Rng::new(5),
            threshold: (0.3 * (1u64 << 32) as f64) as u64,
            keep: 1.0 / 0.7,
        };
        let values = Tensor::from_vec(mask.values(n), n, &Device::Cpu).unwrap();
        (mask, values)
    }

    #[test]
    fn dropout_masks_follow_the_sequential_stream() {
        // Element 2j uses the low half of draw j + 1, element 2j + 1 its high half; an odd
        // length and more than one parallel block.
        let n = 2 * DropoutMask::CHUNK + 7;
        let (mask, values) = test_mask(n);
        let values = values.to_vec1::<f32>().unwrap();
        let mut rng = mask.rng;
        for j in 0..n.div_ceil(2) {
            let r = rng.next_u64();
            for (k, half) in [r & 0xffff_ffff, r >> 32].into_iter().enumerate() {
                if let Some(&v) = values.get(2 * j + k) {
                    assert_eq!(
                        v,
                        if half < mask.threshold {
                            0.0
                        } else {
                            mask.keep
                        }
                    );
                }
            }
        }
        let kept = values.iter().filter(|&&v| v > 0.0).count() as f64 / n as f64;
        assert!((kept - 0.7).abs() < 0.01, "kept {kept}");
    }

    #[test]
    fn embedding_with_positions_and_dropout_matches_the_composite() {
        // Repeated ids (their gradients add up) and an id that never occurs (zero gradient).
        let (b, t, d, v) = (3, 4, 8, 7);
        let ids: Vec<u32> = vec![1, 2, 2, 0, 5, 1, 1, 3, 6, 0, 2, 5];
        let ids = Tensor::from_vec(ids, (b, t), &Device::Cpu).unwrap();
        let pos = randn(&[t, d], 26);
        let (mask, values) = test_mask(b * t * d);
        let values = values.reshape((b, t, d)).unwrap();
        for m in [None, Some(mask)] {
            check(
                |x| match x[0].dtype() {
                    DType::F32 => embed(&x[0], &ids, &pos, 2.5, m).unwrap(),
                    dt => {
                        let e = x[0]
                            .embedding(&ids.flatten_all().unwrap())
                            .unwrap()
                            .reshape((b, t, d))
                            .unwrap();
                        let y = (e * 2.5)
                            .unwrap()
                            .broadcast_add(&pos.to_dtype(dt).unwrap())
                            .unwrap();
                        match m {
                            Some(_) => (y * values.to_dtype(dt).unwrap()).unwrap(),
                            None => y,
                        }
                    }
                },
                &[randn(&[v, d], 27)],
                &randn(&[b, t, d], 28),
            );
        }
        let bad = Tensor::from_vec(vec![0u32, 7], (1, 2), &Device::Cpu).unwrap();
        let err = embed(&randn(&[v, d], 27), &bad, &randn(&[2, d], 29), 1.0, None).unwrap_err();
        assert!(err.to_string().contains("outside the vocabulary"), "{err}");
    }

    #[test]
    fn residual_dropout_and_norm_match_the_composite() {
        let shape = [3, 5, 8];
        let (mask, values) = test_mask(120);
        let values = values.reshape(&shape[..]).unwrap();
        let masked = |f: &Tensor| (f * values.to_dtype(f.dtype()).unwrap()).unwrap();
        let (x, f, w, b) = (
            randn(&shape, 21),
            randn(&shape, 22),
            randn(&[8], 23),
            randn(&[8], 24),
        );
        let weights = randn(&shape, 25);
        check(
            |t| match t[0].dtype() {
                DType::F32 => add_dropout(&t[0], &t[1], mask).unwrap(),
                _ => (&t[0] + masked(&t[1])).unwrap(),
            },
            &[x.clone(), f.clone()],
            &weights,
        );
        for m in [None, Some(mask)] {
            check(
                |t| match t[0].dtype() {
                    DType::F32 => residual_norm(&t[0], &t[1], &t[2], &t[3], 1e-5, m).unwrap(),
                    _ => {
                        let f = if m.is_some() {
                            masked(&t[1])
                        } else {
                            t[1].clone()
                        };
                        layer_norm(&(&t[0] + f).unwrap(), &t[2], &t[3], 1e-5).unwrap()
                    }
                },
                &[x.clone(), f.clone(), w.clone(), b.clone()],
                &weights,
            );
        }
    }

    #[test]
    fn masked_softmax_matches_the_composite() {
        let mut bias = vec![0f32; 2 * 6];
        bias[5] = -1e9;
        bias[10] = -1e9;
        let bias = Tensor::from_vec(bias, (2, 1, 1, 6), &Device::Cpu).unwrap();
        let x = randn(&[2, 3, 4, 6], 5);
        let wts = randn(&[2, 3, 4, 6], 6);
        check(
            |t| masked_softmax(&t[0], Some(&bias.to_dtype(t[0].dtype()).unwrap())).unwrap(),
            std::slice::from_ref(&x),
            &wts,
        );
        let causal = Tensor::from_vec(
            (0..24)
                .map(|i| if i % 6 > i / 6 { -1e9f32 } else { 0.0 })
                .collect::<Vec<_>>(),
            (1, 1, 4, 6),
            &Device::Cpu,
        )
        .unwrap();
        check(
            |t| masked_softmax(&t[0], Some(&causal.to_dtype(t[0].dtype()).unwrap())).unwrap(),
            std::slice::from_ref(&x),
            &wts,
        );
        check(|t| masked_softmax(&t[0], None).unwrap(), &[x], &wts);
    }

    #[test]
    fn linear_matches_the_composite() {
        // 3 rows take the few-rows kernel, 9 the gemm; 40 inputs span several dot lanes.
        for rows in [3, 9] {
            let (x, w, b) = (randn(&[rows, 40], 11), randn(&[5, 40], 12), randn(&[5], 13));
            for relu in [false, true] {
                check(
                    |t| linear(&t[0], &t[1], &t[2], relu).unwrap(),
                    &[x.clone(), w.clone(), b.clone()],
                    &randn(&[rows, 5], 14),
                );
            }
        }
    }

    #[test]
    fn projected_cross_entropy_matches_the_composite() {
        // More rows than one block of logits, so the blocked weight gradient is exercised.
        let n = LOGIT_ROWS + 37;
        let (h, w, b) = (randn(&[n, 6], 21), randn(&[11, 6], 22), randn(&[1, 11], 23));
        let ids: Vec<u32> = (0..n as u32).map(|i| (i * 7) % 11).collect();
        let labels = Tensor::new(ids.as_slice(), &Device::Cpu).unwrap();
        let wts = Tensor::new(&[0.5f32, 0.0], &Device::Cpu).unwrap();
        let bias = b.clone();
        check(
            |t| {
                let b = bias.to_dtype(t[0].dtype()).unwrap();
                // Per row, so that the f32 sum's rounding stays under the tolerance.
                (projected_cross_entropy(&t[0], &t[1], &b, &labels, 0.1, true).unwrap() / n as f64)
                    .unwrap()
            },
            &[h.clone(), w.clone()],
            &wts,
        );
        // Without gradients it reports the same sums.
        let a = projected_cross_entropy(&h, &w, &b, &labels, 0.1, true).unwrap();
        let z = projected_cross_entropy(&h, &w, &b, &labels, 0.1, false).unwrap();
        assert!(max_diff(&a, &z) == 0.0);
        let bad = Tensor::new(&[11u32], &Device::Cpu).unwrap();
        let err = projected_cross_entropy(&h.narrow(0, 0, 1).unwrap(), &w, &b, &bad, 0.1, true);
        assert!(err
            .unwrap_err()
            .to_string()
            .contains("outside the vocabulary"));
    }

    #[test]
    fn fast_exp_is_within_two_ulp_of_exp() {
        let mut worst = 0f64;
        for i in -870_000..=880_000 {
            let x = i as f32 * 1e-4;
            let (got, want) = (fast_exp(x) as f64, (x as f64).exp());
            worst = worst.max(((got - want) / want).abs());
        }
        assert!(worst < 2.5e-7, "relative error {worst}");
        assert_eq!(fast_exp(-1e9), 0.0);
        assert_eq!(fast_exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(fast_exp(0.0), 1.0);
    }

    /// Shared encoder rows (`kv_rows`) give what copying them per query row gives.
    #[test]
    fn attend_one_with_shared_rows_equals_copied_rows() {
        let (h, s, d) = (2, 5, 4);
        let q = randn(&[3, h, 1, d], 31);
        let (k, v) = (randn(&[2, h, s, d], 32), randn(&[2, h, s, d], 33));
        let bias = Tensor::new(
            &[0f32, 0., 0., -1e9, -1e9, 0., 0., 0., 0., -1e9],
            &Device::Cpu,
        )
        .unwrap()
        .reshape((2, 1, 1, s))
        .unwrap();
        let rows = [1u32, 0, 1];
        let idx = Tensor::new(&rows, &Device::Cpu).unwrap();
        let shared = attend_one(&q, &k, &v, Some(&bias), Some(&rows))
            .unwrap()
            .unwrap();
        let pick = |t: &Tensor| t.index_select(&idx, 0).unwrap();
        let copied = attend_one(&q, &pick(&k), &pick(&v), Some(&pick(&bias)), None)
            .unwrap()
            .unwrap();
        assert_eq!(max_diff(&shared, &copied), 0.0);
        // Rows out of range are an error, not a read past the keys.
        assert!(attend_one(&q, &k, &v, None, Some(&[0, 2, 1])).is_err());
    }

    /// Keys kept per step and read through a reordering history give exactly what the
    /// concatenated, reordered cache gives.
    #[test]
    fn attend_steps_equals_attention_over_the_gathered_cache() {
        let (h, d) = (2, 4);
        // Three steps; rows 3, 3, 2 (a hypothesis dropped before the last step).
        let steps: Vec<(Tensor, Tensor)> = [3usize, 3, 2]
            .iter()
            .enumerate()
            .map(|(j, &rows)| {
                let seed = 40 + 2 * j as u64;
                (
                    randn(&[rows, h, 1, d], seed),
                    randn(&[rows, h, 1, d], seed + 1),
                )
            })
            .collect();
        let history = vec![vec![2u32, 0, 0], vec![2, 2, 1]];
        let q = randn(&[2, h, 1, d], 50);
        let got = attend_steps(&q, &steps, &history).unwrap();
        // The same keys gathered into (B, H, t, d) for the general kernel.
        let gather = |which: usize| {
            let per_step: Vec<Tensor> = (0..3)
                .map(|j| {
                    let idx: Vec<u32> = history.iter().map(|past| past[j]).collect();
                    let t = if which == 0 { &steps[j].0 } else { &steps[j].1 };
                    t.index_select(&Tensor::new(idx.as_slice(), &Device::Cpu).unwrap(), 0)
                        .unwrap()
                })
                .collect();
            Tensor::cat(&per_step, 2).unwrap()
        };
        let want = attend_one(&q, &gather(0), &gather(1), None, None)
            .unwrap()
            .unwrap();
        assert_eq!(max_diff(&got, &want), 0.0);
        // A history naming a row a step does not have is an error.
        let bad = vec![vec![0u32, 0, 2], vec![0, 0, 0]];
        assert!(attend_steps(&q, &steps, &bad).is_err());
    }
}
