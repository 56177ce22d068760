//! Attention for incremental decoding, one query row per hypothesis and no gradient: over
//! the encoder's keys, shared by a sentence's beams ([`attend_one`]), and over the decoder's
//! own keys kept one tensor per step ([`attend_steps`]). Each row attends on its own
//! ([`attend_row`]), so its result does not depend on what it is batched with.

use super::cpu::matmul::*;
use super::cpu::*;
use super::*;
use candle_core::Tensor;
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

/// The encoder keys and values of a group of sentences that started decoding together, for
/// single-query attention: k and v (N, H, S, d), bias (N|1, 1, 1, S) or none.
#[derive(Clone, Copy)]
pub struct SourceKeys<'a> {
    pub k: &'a Tensor,
    pub v: &'a Tensor,
    pub bias: Option<&'a Tensor>,
}

/// Whether the decoding-step kernels ([`attend_one`], [`attend_steps`]) run for tensors like
/// `memory`: a decoder cache then keeps one copy of each sentence's cross-attention keys for
/// all its beams, and self-attention keys step by step.
pub fn step_kernels(memory: &Tensor) -> bool {
    fused(memory)
}

/// Attention of one query position per row, for incremental decoding (no gradient): q
/// (B, H, 1, d) already scaled, over groups of sentences' keys and values. `rows` (length B)
/// names the (group, sentence) each query row reads, so that the beams of a sentence share
/// one copy of its encoder keys and sentences that started at different times decode
/// together; `None` pairs row b with sentence b of the only group. A fused kernel on the CPU
/// in f32; elsewhere the rows are gathered and Candle's primitives attend (one group).
pub fn attend_one(
    q: &Tensor,
    groups: &[SourceKeys],
    rows: Option<&[(u32, u32)]>,
) -> candle_core::Result<Tensor> {
    let (b, h, t, d) = q.dims4()?;
    let mut sizes = Vec::with_capacity(groups.len());
    for g in groups {
        let (n, gh, s, gd) = g.k.dims4()?;
        if (gh, gd) != (h, d) || g.v.dims4()? != (n, h, s, d) {
            candle_core::bail!(
                "attend_one: keys {:?} for queries {:?}",
                g.k.dims(),
                q.dims()
            );
        }
        sizes.push((n, s));
    }
    match rows {
        Some(rows)
            if rows.len() != b
                || rows
                    .iter()
                    .any(|&(g, i)| sizes.get(g as usize).is_none_or(|&(n, _)| i as usize >= n)) =>
        {
            candle_core::bail!("attend_one: bad key/value rows for {b} queries over {sizes:?}")
        }
        None if groups.len() != 1 || sizes[0].0 != b => {
            candle_core::bail!("attend_one: {b} queries, key rows {sizes:?}")
        }
        _ => {}
    }
    let one_row_bias = groups.iter().try_fold(true, |ok, g| {
        Ok::<_, candle_core::Error>(
            ok && match g.bias {
                Some(t) => matches!(t.dims4()?, (n, _, 1, _) if n == g.k.dim(0)? || n == 1),
                None => true,
            },
        )
    })?;
    if !fused(q) || t != 1 || !one_row_bias {
        let [g] = groups else {
            candle_core::bail!("attend_one: sentences of several groups need the CPU kernel")
        };
        let Some(rows) = rows else {
            return heads_composite(q, g.k, g.v, g.bias, None);
        };
        let idx: Vec<u32> = rows.iter().map(|&(_, i)| i).collect();
        let idx = Tensor::new(idx.as_slice(), g.k.device())?;
        let bias = match g.bias {
            Some(t) if t.dim(0)? > 1 => Some(t.index_select(&idx, 0)?),
            other => other.cloned(),
        };
        let (k, v) = (g.k.index_select(&idx, 0)?, g.v.index_select(&idx, 0)?);
        return heads_composite(q, &k, &v, bias.as_ref(), None);
    }
    let kv: Vec<(Tensor, Tensor)> = groups
        .iter()
        .map(|g| Ok((g.k.contiguous()?, g.v.contiguous()?)))
        .collect::<candle_core::Result<_>>()?;
    let biases: Vec<Vec<f32>> = groups
        .iter()
        .zip(&sizes)
        .map(|(g, &(n, _))| match g.bias {
            Some(t) if t.dim(0)? == n => t.flatten_all()?.to_vec1::<f32>(),
            Some(t) => Ok(t.flatten_all()?.to_vec1::<f32>()?.repeat(n)),
            None => Ok(Vec::new()),
        })
        .collect::<candle_core::Result<_>>()?;
    let guards: Vec<_> = kv
        .iter()
        .map(|(k, v)| (k.storage_and_layout(), v.storage_and_layout()))
        .collect();
    let slices: Vec<(&[f32], &[f32])> = guards
        .iter()
        .map(|(k, v)| Ok((guarded_f32(k)?, guarded_f32(v)?)))
        .collect::<candle_core::Result<_>>()?;
    let out = with_host_f32(q, |q| {
        let mut out = vec![0f32; q.len()];
        out.par_chunks_mut(d).enumerate().for_each(|(r, o)| {
            let (row, head) = (r / h, r % h);
            let (g, i) = match rows {
                Some(rows) => (rows[row].0 as usize, rows[row].1 as usize),
                None => (0, row),
            };
            let ((k, v), s) = (slices[g], sizes[g].1);
            let at = (i * h + head) * s * d;
            let (kr, vr) = (&k[at..at + s * d], &v[at..at + s * d]);
            let bias = (!biases[g].is_empty()).then(|| &biases[g][i * s..(i + 1) * s]);
            wide(
                #[inline(always)]
                || {
                    attend_row(
                        &q[r * d..(r + 1) * d],
                        s,
                        |j| &kr[j * d..(j + 1) * d],
                        |j| &vr[j * d..(j + 1) * d],
                        bias,
                        o,
                    )
                },
            );
        });
        out
    })?;
    Tensor::from_vec(out, (b, h, 1, d), q.device())
}

/// softmax(q·kⱼ + biasⱼ)-weighted sum of the values vⱼ for one query row `qr` over `n` keys
/// and values given by `key(j)` and `value(j)`, written to `o`. A decoding step and the
/// encoder call this for every (row, head), tens of thousands of times per batch: the scores
/// of up to [`STACK_KEYS`] keys live on the stack, and the exponentials are the vectorised
/// [`fast_exp`] (the training kernel's).
#[inline(always)]
pub(crate) fn attend_row<'a>(
    qr: &[f32],
    n: usize,
    key: impl Fn(usize) -> &'a [f32],
    value: impl Fn(usize) -> &'a [f32],
    bias: Option<&[f32]>,
    o: &mut [f32],
) {
    let mut stack = [0f32; STACK_KEYS];
    let mut heap = Vec::new();
    let scores = if n <= STACK_KEYS {
        &mut stack[..n]
    } else {
        heap.resize(n, 0f32);
        &mut heap[..]
    };
    for (j, x) in scores.iter_mut().enumerate() {
        *x = dot(key(j), qr);
    }
    if let Some(b) = bias {
        scores.iter_mut().zip(b).for_each(|(x, y)| *x += y);
    }
    let sum = exp_shifted_sum(scores, row_max(scores));
    // The weights p / Σ, divided in one vectorised pass rather than one scalar division per
    // key in the loop below (the same quotients).
    scores.iter_mut().for_each(|p| *p /= sum);
    // The weighted values summed in registers, VALUE_COLS columns at a time: summed in `o`
    // itself, each key's sum waited for the store of the one before. A whole chunk takes the
    // fixed-length loop, which the compiler keeps in registers; only a last, shorter chunk
    // does not.
    for (c, oc) in o.chunks_mut(VALUE_COLS).enumerate() {
        let mut acc = [0f32; VALUE_COLS];
        let at = c * VALUE_COLS;
        if oc.len() == VALUE_COLS {
            for (j, &w) in scores.iter().enumerate() {
                let v = &value(j)[at..at + VALUE_COLS];
                acc.iter_mut().zip(v).for_each(|(a, b)| *a += w * b);
            }
        } else {
            for (j, &w) in scores.iter().enumerate() {
                let v = &value(j)[at..at + oc.len()];
                acc.iter_mut().zip(v).for_each(|(a, b)| *a += w * b);
            }
        }
        oc.copy_from_slice(&acc[..oc.len()]);
    }
}

/// Columns of a row's output that [`attend_row`] sums in registers at a time (a head of 64,
/// the usual size, in one pass).
const VALUE_COLS: usize = 64;

/// Keys whose scores [`attend_row`] keeps on the stack (longer rows take the heap).
const STACK_KEYS: usize = 256;

/// Single-query attention for incremental decoding on the CPU, over keys/values kept one
/// tensor per step: q (B, H, 1, d) already scaled; `steps[j]` = (k, v), each (B_j, H, 1, d).
/// Query row b has decoded `m = history[b].len()` steps, the last m of `steps`, and reads row
/// `history[b][i]` of step `steps.len() - m + i`: beam reordering and pruning only rewrite
/// `history`, and sentences that started later decode alongside. No key or value is copied.
/// Returns (B, H, 1, d).
pub fn attend_steps(
    q: &Tensor,
    steps: &[(Tensor, Tensor)],
    history: &[Vec<u32>],
) -> candle_core::Result<Tensor> {
    let (b, h, _, d) = q.dims4()?;
    let n = steps.len();
    if history.len() != b || history.iter().any(|past| past.len() > n) {
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
        let reads_past = |past: &Vec<u32>| {
            (j + past.len())
                .checked_sub(n)
                .is_some_and(|i| past[i] as usize >= rows)
        };
        if history.iter().any(reads_past) {
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
    let out = with_host_f32(q, |q| {
        let mut out = vec![0f32; b * h * d];
        out.par_chunks_mut(d).enumerate().for_each(|(r, o)| {
            let (row, head) = (r / h, r % h);
            let past = &history[row];
            let first = n - past.len();
            let at = |j: usize| (past[j] as usize * h + head) * d;
            wide(
                #[inline(always)]
                || {
                    attend_row(
                        &q[r * d..(r + 1) * d],
                        past.len(),
                        |j| &keys[first + j][at(j)..at(j) + d],
                        |j| &values[first + j][at(j)..at(j) + d],
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
