//! Embedding lookups: the input embedding (gather, scale, positions, dropout) as one CPU op,
//! and row gathers whose CUDA gradient is summed by nmt's kernel.

use super::cpu::*;
use super::*;
use candle_core::{CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

/// (table[ids] · scale + positions) · mask as one op: the scaled token embeddings plus the
/// positions, with dropout. In Candle's primitives that is a row gather, a reshape, a scaling,
/// a broadcast addition and the dropout: five graph nodes, each costing the backward pass a
/// zero-filled gradient buffer and an addition. The gradient reaches only the table.
pub(crate) struct EmbedOp {
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
        let mut y = zeros(b * t * d);
        y.par_chunks_mut(rows_per_task(d) * d)
            .enumerate()
            .for_each(|(c, yc)| {
                let r0 = c * rows_per_task(d);
                wide(
                    #[inline(always)]
                    || {
                        for (r, yr) in yc.chunks_mut(d).enumerate() {
                            let (id, step) = (ids[r0 + r] as usize, (r0 + r) % t);
                            let e = &table[id * d..(id + 1) * d];
                            let p = &pos[step * d..(step + 1) * d];
                            for j in 0..d {
                                yr[j] = e[j] * self.scale + p[j];
                            }
                        }
                    },
                )
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
        let mut grad = zeros(v * d);
        with_host_f32(dy, |dy| {
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

/// Scaled embeddings of `ids` (B, T) from `table` (V, d) plus `positions` (T, d), then
/// dropout with `mask`: (B, T, d); the gradient reaches the table only. One op for a CPU f32
/// table and u32 ids; elsewhere row gathers ([`select_rows`]) and Candle's ops.
pub fn embed(
    table: &Tensor,
    ids: &Tensor,
    positions: &Tensor,
    scale: f64,
    mask: Option<DropoutMask>,
) -> Result<Tensor> {
    if !embeds_fused(table, ids) {
        let (b, t) = ids.dims2()?;
        let rows = select_rows(table, &ids.flatten_all()?)?.reshape((b, t, table.dim(1)?))?;
        let y = (rows * scale)?.broadcast_add(positions)?;
        return match mask {
            Some(m) => dropout(&y, m),
            None => Ok(y),
        };
    }
    let op = EmbedOp {
        scale: scale as f32,
        mask,
    };
    table
        .contiguous()?
        .apply_op3(&ids.contiguous()?, &positions.contiguous()?, op)
}

/// Whether [`embed`]'s fused op serves this table and these ids.
fn embeds_fused(table: &Tensor, ids: &Tensor) -> bool {
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
            .apply_op2(&ids.contiguous()?, gpu::SelectRows);
    }
    w.embedding(ids)
}

/// The CUDA half: row gathers whose gradient nmt's kernel sums in the order of the ids.
#[cfg(feature = "cuda")]
pub(crate) mod gpu {
    use crate::ops::cuda::prelude::*;

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

        cuda_only!(2);

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

        cuda_only!(2);

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
}
