//! Attention for incremental decoding, one query row per hypothesis and no gradient: over
//! the encoder's keys, shared by a sentence's beams ([`attend_one`]), and over the decoder's
//! own keys kept one tensor per step ([`attend_steps`]). Each row attends on its own
//! ([`attend_row`]), so its result does not depend on what it is batched with.

use super::cpu::matmul::*;
use super::cpu::*;
use super::*;
use candle_core::{CpuStorage, CustomOp3, Layout, Shape, Tensor};
use rayon::prelude::*;

/// softmax(q·kᵀ + bias)·v from Candle's primitives with the heads apart, for other devices
/// and dtypes (and, through `ops::attention`, the whole-sequence ops' composite): q
/// (B, H, T, d_k) scaled, k and v (B, H, S, d_k) → (B, H, T, d_k); with `dropout` (training)
/// the probabilities are dropped before they weight the values.
pub(super) fn heads_composite(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    bias: Option<&Tensor>,
    dropout: Option<DropoutMask>,
) -> Result<Tensor> {
    let mut probs = masked_softmax(&q.matmul(&k.t()?)?, bias)?;
    if let Some(mask) = dropout {
        probs = super::dropout(&probs, mask)?;
    }
    probs.matmul(v)
}

pub(crate) struct AttendOne {
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
    ) -> candle_core::Result<(CpuStorage, Shape)> {
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

/// Whether the decoding-step kernels ([`attend_one`], [`attend_steps`]) run for tensors like
/// `memory`: a decoder cache then keeps one copy of each sentence's cross-attention keys for
/// all its beams, and self-attention keys step by step.
pub fn step_kernels(memory: &Tensor) -> bool {
    fused(memory)
}

/// Attention of one query position per row, for incremental decoding (no gradient): q
/// (B, H, 1, d) already scaled, k and v (B_kv, H, S, d), bias (B_kv|1, 1, 1, S) or none.
/// `kv_rows` (length B) names the key/value row of each query row, so that the beams of a
/// sentence share one copy of its encoder keys; `None` pairs row b with row b. A fused kernel
/// on the CPU in f32; elsewhere the rows are gathered and Candle's primitives attend.
pub fn attend_one(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    bias: Option<&Tensor>,
    kv_rows: Option<&[u32]>,
) -> candle_core::Result<Tensor> {
    let (b, h, t, _) = q.dims4()?;
    let (b_kv, _, s, _) = k.dims4()?;
    match kv_rows {
        Some(rows) if rows.len() != b || rows.iter().any(|&r| r as usize >= b_kv) => {
            candle_core::bail!("attend_one: bad key/value rows for {b} queries over {b_kv} rows")
        }
        None if b != b_kv => candle_core::bail!("attend_one: {b} queries, {b_kv} key rows"),
        _ => {}
    }
    let one_row_bias = match bias {
        Some(t) => matches!(t.dims4()?, (n, _, 1, _) if n == b_kv || n == 1),
        None => true,
    };
    if !fused(q) || t != 1 || !one_row_bias {
        let Some(rows) = kv_rows else {
            return heads_composite(q, k, v, bias, None);
        };
        let idx = Tensor::new(rows, k.device())?;
        let bias = match bias {
            Some(t) if t.dim(0)? > 1 => Some(t.index_select(&idx, 0)?),
            other => other.cloned(),
        };
        let (k, v) = (k.index_select(&idx, 0)?, v.index_select(&idx, 0)?);
        return heads_composite(q, &k, &v, bias.as_ref(), None);
    }
    let bias = match bias {
        Some(t) if t.dim(0)? == b_kv => t.flatten_all()?.to_vec1::<f32>()?,
        Some(t) => t.flatten_all()?.to_vec1::<f32>()?.repeat(b_kv),
        None => Vec::new(),
    };
    debug_assert!(bias.is_empty() || bias.len() == b_kv * s);
    q.contiguous()?.apply_op3_no_bwd(
        &k.contiguous()?,
        &v.contiguous()?,
        &AttendOne {
            heads: h,
            bias,
            kv_rows: kv_rows.map(<[u32]>::to_vec).unwrap_or_default(),
        },
    )
}

/// softmax(q·kⱼ + biasⱼ)-weighted sum of the values vⱼ for one query row `qr` over `n` keys
/// and values given by `key(j)` and `value(j)`, into `o` (zeroed).
#[inline(always)]
pub(crate) fn attend_row<'a>(
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
) -> candle_core::Result<Tensor> {
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
        .collect::<candle_core::Result<_>>()?;
    let values: Vec<&[f32]> = guards
        .iter()
        .map(|(_, v)| guarded_f32(v))
        .collect::<candle_core::Result<_>>()?;
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
