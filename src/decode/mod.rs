//! Search: greedy and beam search over the shared model with KV-cached incremental decoding.
//! Token ids in, token ids out; tokenization and I/O are the caller's.

pub mod beam;

use crate::model::ops::{exp_sum, row_max};
use crate::model::{Dropout, Seq2Seq};
use anyhow::Result;
use candle_core::{DType, Tensor};
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

/// Output logits (rows, V) of a decoder step on the host, f32, row-major, with `<pad>` at −∞
/// in every row: it is the start token, never an output.
pub fn host_logits(logits: &Tensor, pad: usize) -> Result<Vec<f32>> {
    let mut out: Vec<f32> = logits.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
    let v = logits.dim(candle_core::D::Minus1)?;
    out.chunks_mut(v)
        .for_each(|row| row[pad] = f32::NEG_INFINITY);
    Ok(out)
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
            let max = row_max(row);
            (max, exp_sum(row, max).ln())
        })
        .collect()
}

/// Greedy search for a batch of sources (each ending in `</s>`). `max_lens[i]` bounds the
/// output length of sentence i, `</s>` included; as transformers does with a forced `</s>`, a
/// hypothesis that reaches its limit ends there. Returns ids without `</s>`.
pub fn greedy(model: &Seq2Seq, srcs: &[Vec<u32>], max_lens: &[usize]) -> Result<Vec<Vec<u32>>> {
    let cfg = &model.config;
    let n = srcs.len();
    let mut out = vec![Vec::new(); n];
    if n == 0 {
        return Ok(out);
    }
    let src = pad_batch(model, srcs)?;
    let mut bias = model.padding_bias(&src)?;
    let memory = model.encode(&src, &bias, &Dropout::off())?;
    let mut cache = model.start_decoding(&memory)?;
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
        let logits = host_logits(&model.decode_step(&tokens, &mut cache, &bias)?, pad)?;
        let next: Vec<u32> = logits.par_chunks(v).map(argmax).collect();
        let mut keep = Vec::with_capacity(active.len());
        let mut keep_tokens = Vec::with_capacity(active.len());
        for (row, (&i, &tok)) in active.iter().zip(&next).enumerate() {
            let last = step + 1 >= max_lens[i].min(cfg.max_position_embeddings);
            if tok == cfg.eos_token_id || last {
                continue;
            }
            out[i].push(tok);
            keep.push(row as u32);
            keep_tokens.push(tok);
        }
        if keep.is_empty() {
            break;
        }
        let pruned: Vec<usize> = keep.iter().map(|&r| active[r as usize]).collect();
        if keep.len() < active.len() {
            let rows = Tensor::new(keep.as_slice(), model.device())?;
            cache = cache.select(&rows)?;
            bias = bias.index_select(&rows, 0)?;
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
