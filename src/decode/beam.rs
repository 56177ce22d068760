//! Beam search with transformers' `generate` semantics: 2·K candidates per step, finished
//! hypotheses scored by sum log-prob / length^α (or GNMT's ((5+len)/6)^α), the best K finished
//! kept, and the same early-stopping heuristic (`early_stopping=False`), so that outputs equal
//! transformers' token for token.

use super::{host_logits, log_normalisers, start};
use crate::model::Seq2Seq;
use crate::ops;
use anyhow::Result;
use candle_core::Tensor;
use rayon::prelude::*;

/// Beam search settings.
#[derive(Debug, Clone, Copy)]
pub struct BeamOptions {
    /// Beam size K.
    pub beam: usize,
    /// Length penalty α.
    pub length_penalty: f64,
    /// GNMT length normalisation instead of len^α.
    pub gnmt: bool,
}

/// A finished hypothesis: ids without `</s>` and its normalised score.
#[derive(Debug, Clone, PartialEq)]
pub struct Hypothesis {
    /// Output ids, `</s>` removed.
    pub tokens: Vec<u32>,
    /// Sum of log-probabilities divided by the length penalty.
    pub score: f64,
}

impl BeamOptions {
    /// The length penalty of a hypothesis of `len` steps (its tokens and `</s>`).
    pub fn penalty(&self, len: usize) -> f64 {
        if self.gnmt {
            ((5.0 + len as f64) / 6.0).powf(self.length_penalty)
        } else {
            (len as f64).powf(self.length_penalty)
        }
    }
}

struct Sentence {
    /// Running beams: tokens generated so far and summed log-prob.
    running: Vec<(Vec<u32>, f64)>,
    /// Finished hypotheses, best first, at most K.
    finished: Vec<(Vec<u32>, f64)>,
    max_len: usize,
    done: bool,
}

/// Beam search for a batch of sources; returns, per sentence, up to K hypotheses best first.
pub fn beam_search(
    model: &Seq2Seq,
    srcs: &[Vec<u32>],
    max_lens: &[usize],
    opts: BeamOptions,
) -> Result<Vec<Vec<Hypothesis>>> {
    let cfg = &model.config;
    let k = opts.beam.max(1);
    let n = srcs.len();
    if n == 0 {
        return Ok(Vec::new());
    }
    let v = cfg.vocab_size;
    let eos = cfg.eos_token_id;
    let max_lens: Vec<usize> = max_lens
        .iter()
        .map(|&m| m.clamp(1, cfg.max_position_embeddings))
        .collect();
    // The first step decodes one row per sentence: transformers starts K identical beams but
    // scores beams 1..K-1 at −1e9, so all of the top 2K come from beam 0. (Not when a limit of
    // one token makes the −1e9 beams' `</s>` part of the finished set.)
    let mut width = if max_lens.iter().all(|&m| m > 1) {
        1
    } else {
        k
    };
    // Rows are sentence-major: the sentence in slot j of `active` owns rows
    // j*width..(j+1)*width.
    let (mut cache, mut active) = start(model, srcs, width)?;
    let pad = cfg.pad_token_id as usize;
    let mut sents: Vec<Sentence> = (0..n)
        .map(|i| Sentence {
            running: (0..width)
                .map(|b| (Vec::new(), if b == 0 { 0.0 } else { -1e9 }))
                .collect(),
            finished: Vec::new(),
            max_len: max_lens[i],
            done: false,
        })
        .collect();
    let mut tokens = Tensor::full(cfg.decoder_start_token_id, (n * width, 1), model.device())?;
    // cur_len counts the start token, as in transformers.
    let mut cur_len = 1;
    while !active.is_empty() {
        // Log-probabilities (x − max) − log Σ e^(x − max) (`<pad>` at −∞), formed as the scan
        // below reads them: no (rows, V) log-softmax is materialised.
        let logits = host_logits(model.decode_step(&tokens, &mut cache)?, pad)?;
        // Top 2K continuations of each sentence, in parallel over sentences.
        let tops: Vec<Vec<(f64, usize, u32)>> = logits.read(|logits| {
            let norms = log_normalisers(logits, v);
            active
                .par_iter()
                .enumerate()
                .map(|(slot, &i)| {
                    let s = &sents[i];
                    let rows = slot * width..(slot + 1) * width;
                    top_candidates(
                        &logits[rows.start * v..rows.end * v],
                        &norms[rows],
                        &s.running,
                        2 * k,
                        eos,
                        // transformers: max_length = 1 + max_len; `</s>` is forced at
                        // cur_len == max_length - 1 and every candidate hits the limit there.
                        cur_len >= s.max_len,
                    )
                })
                .collect()
        })?;
        let mut next_rows: Vec<u32> = Vec::new();
        let mut next_tokens: Vec<u32> = Vec::new();
        let mut still: Vec<usize> = Vec::new();
        for ((slot, &i), top) in active.iter().enumerate().zip(tops) {
            let s = &mut sents[i];
            let at_limit = cur_len >= s.max_len;
            let hits: Vec<bool> = top.iter().map(|&(_, _, t)| t == eos || at_limit).collect();
            // Finished candidates among the top K join the finished set.
            for (r, &(score, b, t)) in top.iter().enumerate().take(k) {
                if hits[r] {
                    let mut seq = s.running[b].0.clone();
                    if t != eos {
                        seq.push(t);
                    }
                    let norm = score / opts.penalty(cur_len);
                    let pos = s.finished.partition_point(|f| f.1 >= norm);
                    s.finished.insert(pos, (seq, norm));
                    s.finished.truncate(k);
                }
            }
            // The best K unfinished candidates continue.
            let mut cont: Vec<(f64, usize, u32)> = top
                .iter()
                .zip(&hits)
                .map(|(&(sc, b, t), &h)| (if h { sc - 1e9 } else { sc }, b, t))
                .collect();
            cont.sort_by(|a, b| b.0.total_cmp(&a.0));
            cont.truncate(k);
            let all_hit = hits.iter().all(|&h| h);
            let new_running: Vec<(Vec<u32>, f64)> = cont
                .iter()
                .map(|&(sc, b, t)| {
                    let mut seq = s.running[b].0.clone();
                    seq.push(t);
                    (seq, sc)
                })
                .collect();
            // Early-stopping heuristic: stop once the best running beam, normalised at the
            // current length, cannot beat the worst of K finished hypotheses.
            let unsatisfied = if s.finished.len() < k {
                true
            } else {
                let best_running = new_running[0].1 / opts.penalty(cur_len);
                best_running > s.finished.last().unwrap().1
            };
            if all_hit || !unsatisfied {
                s.done = true;
                continue;
            }
            for &(_, b, t) in &cont {
                next_rows.push((slot * width + b) as u32);
                next_tokens.push(t);
            }
            s.running = new_running;
            still.push(i);
        }
        cur_len += 1;
        width = k;
        active = still;
        if active.is_empty() {
            break;
        }
        cache = cache.select(&next_rows)?;
        tokens = Tensor::from_vec(next_tokens, (active.len() * k, 1), model.device())?;
    }
    Ok(sents
        .into_iter()
        .map(|s| {
            s.finished
                .into_iter()
                .map(|(tokens, score)| Hypothesis { tokens, score })
                .collect()
        })
        .collect())
}

/// Logits [`top_candidates`] tests against its bound at once.
const BLOCK: usize = 64;

/// The best `want` continuations (score, beam, token) of one sentence, best first, over its
/// rows of logits (one per running beam, × V) with their log-normalisers and the running
/// beams' scores. A token's
/// score is beam score + (x − max) − log_sum; at the length limit only `</s>` (log-prob 0) is
/// finite. Ties keep scan order, as transformers' top-k does over the flattened K×V scores.
fn top_candidates(
    logits: &[f32],
    norms: &[(f32, f32)],
    running: &[(Vec<u32>, f64)],
    want: usize,
    eos: u32,
    at_limit: bool,
) -> Vec<(f64, usize, u32)> {
    let v = logits.len() / running.len().max(1);
    let mut top: Vec<(f64, usize, u32)> = Vec::with_capacity(want + 1);
    for (b, &(_, beam_score)) in running.iter().enumerate() {
        let row = &logits[b * v..(b + 1) * v];
        let (max, log_sum) = norms[b];
        // Once 2K candidates are held, a logit below `bound` cannot enter: it sits under the
        // exact threshold by far more than f32 rounding, so most of a row costs one comparison.
        let bound_of = |top: &Vec<(f64, usize, u32)>| {
            if top.len() < want {
                return f32::NEG_INFINITY;
            }
            let gap = top.last().unwrap().0 - beam_score;
            (gap as f32) + max + log_sum - (1e-3 + 1e-6 * gap.abs() as f32)
        };
        let mut bound = bound_of(&top);
        // Blocks of BLOCK logits all under the bound are passed over with one vectorised
        // comparison; the others are scanned in order, as before.
        for (c, block) in row.chunks(BLOCK).enumerate() {
            let below = ops::wide(
                #[inline(always)]
                || block.iter().fold(true, |all, &x| all & (x < bound)),
            );
            if below {
                continue;
            }
            for (i, &x) in block.iter().enumerate() {
                if x < bound {
                    continue;
                }
                let tok = c * BLOCK + i;
                let lp = match (at_limit, tok as u32 == eos) {
                    (true, true) => 0.0,
                    (true, false) => f64::NEG_INFINITY,
                    (false, _) => ((x - max) - log_sum) as f64,
                };
                let score = beam_score + lp;
                if top.len() < want || score > top.last().unwrap().0 {
                    let pos = top.partition_point(|t| t.0 >= score);
                    top.insert(pos, (score, b, tok as u32));
                    top.truncate(want);
                    if !at_limit {
                        bound = bound_of(&top);
                    }
                }
            }
        }
    }
    top
}
