//! Search: greedy and beam search over the shared model with KV-cached incremental decoding.
//! Token ids in, token ids out; tokenization and I/O are the caller's.

pub mod beam;

use crate::model::{Dropout, Seq2Seq};
use crate::ops::{self, exp_sum, row_max, with_host_f32};
use anyhow::Result;
use candle_core::{CpuStorage, DType, InplaceOp1, Layout, Tensor};
use rayon::prelude::*;

/// Right-pads id sequences into a (B, S) tensor.
pub fn pad_batch(model: &Seq2Seq, seqs: &[Vec<u32>]) -> Result<Tensor> {
    let pad = model.config.pad_token_id;
    let width = seqs.iter().map(Vec::len).max().unwrap_or(1).max(1);
    let mut flat = Vec::with_capacity(seqs.len() * width);
    for s in seqs {
        flat.extend_from_slice(s);
        flat.extend(std::iter::repeat_n(pad, width - s.len()));
    }
    Ok(Tensor::from_vec(flat, (seqs.len(), width), model.device())?)
}

/// Output logits (rows, V) of a decoder step, readable on the host as f32, row-major, with
/// `<pad>` at −∞ in every row: it is the start token, never an output.
pub struct HostLogits(Logits);

enum Logits {
    /// CPU f32 logits, read where they are (masked in place): no copy of rows × V floats.
    InPlace(Tensor),
    /// A host copy of logits from another device or dtype.
    Copied(Vec<f32>),
}

/// Sets one column of a (rows, V) CPU f32 tensor to −∞, in place.
struct HideColumn(usize);

impl InplaceOp1 for HideColumn {
    fn name(&self) -> &'static str {
        "nmt-hide-column"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let v = *layout.dims().last().unwrap_or(&0);
        let (CpuStorage::F32(data), Some((a, b))) = (storage, layout.contiguous_offsets()) else {
            candle_core::bail!("hide-column: expected contiguous f32 logits");
        };
        data[a..b]
            .chunks_mut(v)
            .for_each(|row| row[self.0] = f32::NEG_INFINITY);
        Ok(())
    }
}

/// Takes the logits of a decoder step (a fresh tensor: CPU logits are masked in place).
pub fn host_logits(logits: Tensor, pad: usize) -> Result<HostLogits> {
    if logits.device().is_cpu() && logits.dtype() == DType::F32 && logits.is_contiguous() {
        logits.inplace_op1(&HideColumn(pad))?;
        return Ok(HostLogits(Logits::InPlace(logits)));
    }
    let mut out: Vec<f32> = logits.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
    let v = logits.dim(candle_core::D::Minus1)?;
    out.chunks_mut(v)
        .for_each(|row| row[pad] = f32::NEG_INFINITY);
    Ok(HostLogits(Logits::Copied(out)))
}

impl HostLogits {
    /// Runs `f` on the logits, rows × V floats.
    pub fn read<R>(&self, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
        match &self.0 {
            Logits::Copied(data) => Ok(f(data)),
            Logits::InPlace(t) => Ok(with_host_f32(t, f)?),
        }
    }
}

/// Index of the largest entry of `row`, the first one on ties.
pub fn argmax(row: &[f32]) -> u32 {
    let mut best = (f32::NEG_INFINITY, 0usize);
    for (i, &x) in row.iter().enumerate() {
        if x > best.0 {
            best = (x, i);
        }
    }
    best.1 as u32
}

/// Per row of `logits` (rows of length `v`), the max and log Σ e^(x − max): the
/// log-probability of token t is (x_t − max) − that log, a log-softmax's arithmetic.
pub fn log_normalisers(logits: &[f32], v: usize) -> Vec<(f32, f32)> {
    logits
        .par_chunks(v)
        .map(|row| {
            ops::wide(
                #[inline(always)]
                || {
                    let max = row_max(row);
                    (max, exp_sum(row, max).ln())
                },
            )
        })
        .collect()
}

/// Greedy search for a batch of sources (each ending in `</s>`). `max_lens[i]` bounds the
/// output length of sentence i, `</s>` included; as transformers does with a forced `</s>`, a
/// hypothesis that reaches its limit ends there. Returns ids without `</s>` and, when
/// `scores` is set, each output's summed log-probability (its tokens and a chosen `</s>`; a
/// forced `</s>` has log-probability 0, as in beam search), else 0.
pub fn greedy(
    model: &Seq2Seq,
    srcs: &[Vec<u32>],
    max_lens: &[usize],
    scores: bool,
) -> Result<Vec<(Vec<u32>, f64)>> {
    let cfg = &model.config;
    let n = srcs.len();
    let mut out = vec![(Vec::new(), 0.0); n];
    if n == 0 {
        return Ok(out);
    }
    let src = pad_batch(model, srcs)?;
    let bias = model.padding_bias(&src)?;
    let memory = model.encode(&src, &bias, &Dropout::off())?;
    let mut cache = model.start_decoding(&memory, &bias, 1)?;
    let (v, pad) = (cfg.vocab_size, cfg.pad_token_id as usize);
    let mut active: Vec<usize> = (0..n).collect();
    let mut tokens = Tensor::full(cfg.decoder_start_token_id, (n, 1), model.device())?;
    let limit = max_lens
        .iter()
        .copied()
        .max()
        .unwrap_or(0)
        .min(cfg.max_position_embeddings);
    for step in 0..limit {
        let logits = host_logits(model.decode_step(&tokens, &mut cache)?, pad)?;
        let next: Vec<u32> = logits.read(|l| l.par_chunks(v).map(argmax).collect())?;
        // The chosen token is the row's max: its log-probability is −log Σ e^(x − max).
        let log_probs: Vec<f64> = if scores {
            logits.read(|l| {
                log_normalisers(l, v)
                    .iter()
                    .map(|&(_, ln)| -ln as f64)
                    .collect()
            })?
        } else {
            Vec::new()
        };
        let mut keep = Vec::with_capacity(active.len());
        let mut keep_tokens = Vec::with_capacity(active.len());
        for (row, (&i, &tok)) in active.iter().zip(&next).enumerate() {
            let last = step + 1 >= max_lens[i].min(cfg.max_position_embeddings);
            if tok == cfg.eos_token_id || last {
                if scores && !last {
                    out[i].1 += log_probs[row];
                }
                continue;
            }
            out[i].0.push(tok);
            if scores {
                out[i].1 += log_probs[row];
            }
            keep.push(row as u32);
            keep_tokens.push(tok);
        }
        if keep.is_empty() {
            break;
        }
        let pruned: Vec<usize> = keep.iter().map(|&r| active[r as usize]).collect();
        if keep.len() < active.len() {
            cache = cache.select(&keep)?;
        }
        active = pruned;
        tokens = Tensor::from_vec(keep_tokens, (active.len(), 1), model.device())?;
    }
    Ok(out)
}

/// The output length limit `a·src_len + b`, within the model's positions.
pub fn max_len(model: &Seq2Seq, src_len: usize, a: f64, b: usize) -> usize {
    ((a * src_len as f64) as usize + b).clamp(1, model.config.max_position_embeddings)
}
