//! Search: greedy and beam search over the shared model with KV-cached incremental decoding.
//! Token ids in, token ids out; tokenization and I/O are the caller's.

pub mod beam;

use crate::model::{DecoderCache, Dropout, Seq2Seq};
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

/// Indices of `seqs` grouped by length, shortest first. A batch pads every sentence to its
/// longest, in the encoder and in every step's cross-attention; sentences of one length need
/// no padding (measured: greedy decoding of sorted batches of 64 ~10 % faster, encoding a
/// server's arrivals ~12 %). Each sentence's encoding is the same in any group, bit for bit:
/// rows are computed apart and padding is masked.
pub fn length_groups(seqs: &[Vec<u32>]) -> Vec<Vec<usize>> {
    let mut order: Vec<usize> = (0..seqs.len()).collect();
    order.sort_by_key(|&i| seqs[i].len());
    order
        .chunk_by(|&a, &b| seqs[a].len() == seqs[b].len())
        .map(<[usize]>::to_vec)
        .collect()
}

/// Encodes `srcs` (at least one) and starts decoding them with `width` rows each: one
/// encoding per length where decodings join ([`length_groups`]), else one padded batch.
/// Returns the cache and the sentence of each run of `width` rows, in row order.
pub fn start(
    model: &Seq2Seq,
    srcs: &[Vec<u32>],
    width: usize,
) -> Result<(DecoderCache, Vec<usize>)> {
    let groups = if model.decodings_join() {
        length_groups(srcs)
    } else {
        vec![(0..srcs.len()).collect()]
    };
    let mut cache: Option<DecoderCache> = None;
    for group in &groups {
        let sources: Vec<Vec<u32>> = group.iter().map(|&i| srcs[i].clone()).collect();
        let src = pad_batch(model, &sources)?;
        let bias = model.padding_bias(&src)?;
        let memory = model.encode(&src, &bias, &Dropout::off())?;
        let fresh = model.start_decoding(&memory, &bias, width)?;
        match &mut cache {
            Some(cache) => cache.join(fresh)?,
            None => cache = Some(fresh),
        }
    }
    let cache = cache.ok_or_else(|| anyhow::anyhow!("no sentences to decode"))?;
    Ok((cache, groups.concat()))
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

/// Index of the largest entry of `row`, the first one on ties (0 when no entry is above −∞):
/// the maximum in vectorised partial maxima, then the first entry equal to it, found by
/// comparing whole vectors of entries before searching the one that holds it (a search entry
/// by entry does not vectorise: it stops at the first match).
pub fn argmax(row: &[f32]) -> u32 {
    ops::wide(
        #[inline(always)]
        || {
            let max = row_max(row);
            if max == f32::NEG_INFINITY {
                return 0;
            }
            use crate::ops::cpu::LANES;
            let holds = |c: &[f32]| c.iter().fold(false, |found, &x| found | (x == max));
            let Some(block) = row.chunks(LANES).position(holds) else {
                return 0;
            };
            let at = row[block * LANES..].iter().position(|&x| x == max);
            (block * LANES + at.unwrap_or(0)) as u32
        },
    )
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
    let mut out = vec![(Vec::new(), 0.0); srcs.len()];
    let mut search = Greedy::new(model, scores);
    search.add(srcs, max_lens)?;
    while !search.is_empty() {
        for done in search.step()? {
            out[done.id] = (done.ids, done.log_prob);
        }
    }
    Ok(out)
}

/// A greedy search that sentences can join between steps (on the CPU, where the decoder
/// cache allows it: see [`Greedy::can_add`]) and that hands each sentence back as soon as it
/// ends: a server's continuous batching. Each row's arithmetic does not depend on the others,
/// so a sentence gets the same output, bit for bit, whenever it joins and whatever it decodes
/// with; [`greedy`] is this search with every sentence added at once.
pub struct Greedy<'m> {
    model: &'m Seq2Seq,
    scores: bool,
    cache: Option<DecoderCache>,
    /// Per batch row: its sentence's output so far.
    rows: Vec<Running>,
    /// The next token of each row.
    tokens: Vec<u32>,
    /// Ids handed out so far.
    added: usize,
}

/// A sentence being decoded.
struct Running {
    id: usize,
    max_len: usize,
    ids: Vec<u32>,
    log_prob: f64,
}

/// A sentence whose search ended.
#[derive(Debug, Clone)]
pub struct Finished {
    /// Its number: sentences are numbered from 0 in the order they were added.
    pub id: usize,
    /// Its output, `</s>` not included.
    pub ids: Vec<u32>,
    /// Summed log-probability (as [`greedy`] says), when scoring; else 0.
    pub log_prob: f64,
}

impl<'m> Greedy<'m> {
    /// An empty search; with `scores`, outputs are scored.
    pub fn new(model: &'m Seq2Seq, scores: bool) -> Self {
        Self {
            model,
            scores,
            cache: None,
            rows: Vec::new(),
            tokens: Vec::new(),
            added: 0,
        }
    }

    /// Whether no sentence is being decoded.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Sentences being decoded.
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    /// Whether sentences can be added now: always when the search is empty; while it runs,
    /// where the decoder cache lets sentences join (the CPU).
    pub fn can_add(&self) -> bool {
        self.cache.as_ref().is_none_or(DecoderCache::joinable)
    }

    /// Encodes `srcs` (each ending in `</s>`, with output limits `max_lens` as [`greedy`]
    /// takes them) and adds them to the search; they are numbered in order from the number
    /// returned (sentences are numbered from 0 in the order they are added).
    pub fn add(&mut self, srcs: &[Vec<u32>], max_lens: &[usize]) -> Result<usize> {
        let first = self.added;
        if srcs.is_empty() {
            return Ok(first);
        }
        if max_lens.len() != srcs.len() {
            anyhow::bail!(
                "{} sources with {} output limits",
                srcs.len(),
                max_lens.len()
            );
        }
        if !self.can_add() {
            anyhow::bail!("sentences cannot join a running search on this device");
        }
        let cfg = &self.model.config;
        let (fresh, order) = start(self.model, srcs, 1)?;
        match &mut self.cache {
            Some(cache) => cache.join(fresh)?,
            None => self.cache = Some(fresh),
        }
        for i in order {
            self.rows.push(Running {
                id: first + i,
                max_len: max_lens[i].min(cfg.max_position_embeddings),
                ids: Vec::new(),
                log_prob: 0.0,
            });
        }
        self.added += srcs.len();
        self.tokens
            .extend(std::iter::repeat_n(cfg.decoder_start_token_id, srcs.len()));
        Ok(first)
    }

    /// Decodes one token of every sentence; returns the sentences that ended, which leave.
    pub fn step(&mut self) -> Result<Vec<Finished>> {
        let (Some(cache), false) = (self.cache.as_mut(), self.rows.is_empty()) else {
            return Ok(Vec::new());
        };
        let model = self.model;
        let cfg = &model.config;
        let (v, pad) = (cfg.vocab_size, cfg.pad_token_id as usize);
        let n = self.rows.len();
        let tokens = Tensor::from_vec(std::mem::take(&mut self.tokens), (n, 1), model.device())?;
        let logits = host_logits(model.decode_step(&tokens, cache)?, pad)?;
        let next: Vec<u32> = logits.read(|l| l.par_chunks(v).map(argmax).collect())?;
        // The chosen token is the row's max: its log-probability is −log Σ e^(x − max).
        let log_probs: Vec<f64> = if self.scores {
            logits.read(|l| {
                log_normalisers(l, v)
                    .iter()
                    .map(|&(_, ln)| -ln as f64)
                    .collect()
            })?
        } else {
            Vec::new()
        };
        let mut keep = Vec::with_capacity(n);
        let mut rows = Vec::with_capacity(n);
        let mut finished = Vec::new();
        for (row, (mut r, tok)) in std::mem::take(&mut self.rows)
            .into_iter()
            .zip(next)
            .enumerate()
        {
            let last = r.ids.len() + 1 >= r.max_len;
            if tok == cfg.eos_token_id || last {
                // A chosen `</s>` is scored; one forced by the limit is not.
                if self.scores && !last {
                    r.log_prob += log_probs[row];
                }
                finished.push(Finished {
                    id: r.id,
                    ids: r.ids,
                    log_prob: r.log_prob,
                });
                continue;
            }
            if self.scores {
                r.log_prob += log_probs[row];
            }
            r.ids.push(tok);
            keep.push(row as u32);
            self.tokens.push(tok);
            rows.push(r);
        }
        self.rows = rows;
        if self.rows.is_empty() {
            self.cache = None;
        } else if keep.len() < n {
            *cache = cache.select(&keep)?;
        }
        Ok(finished)
    }
}

/// The output length limit `a·src_len + b`, within the model's positions.
pub fn max_len(model: &Seq2Seq, src_len: usize, a: f64, b: usize) -> usize {
    ((a * src_len as f64) as usize)
        .saturating_add(b)
        .clamp(1, model.config.max_position_embeddings)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argmax_is_the_first_largest_entry() {
        let first = |row: &[f32]| {
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            row.iter()
                .position(|&x| x == max && max > f32::NEG_INFINITY)
                .unwrap_or(0) as u32
        };
        let mut rng = crate::rng::Rng::new(7);
        for len in [1, 5, 16, 17, 40, 8000] {
            for _ in 0..20 {
                // Few distinct values: ties everywhere, the first of them wins.
                let row: Vec<f32> = (0..len).map(|_| (rng.below(5) as f32) - 2.0).collect();
                assert_eq!(argmax(&row), first(&row), "{row:?}");
            }
        }
        assert_eq!(argmax(&[f32::NEG_INFINITY; 20]), 0);
        assert_eq!(argmax(&[f32::NEG_INFINITY, f32::NAN, 1.0, 1.0]), 2);
    }

    #[test]
    fn length_groups_hold_every_sentence_once_one_length_each_shortest_first() {
        let seqs: Vec<Vec<u32>> = [3, 1, 3, 2, 1, 5].iter().map(|&n| vec![7; n]).collect();
        assert_eq!(
            length_groups(&seqs),
            vec![vec![1, 4], vec![3], vec![0, 2], vec![5]]
        );
        assert!(length_groups(&[]).is_empty());
    }
}
