//! Training batches: tokenized sentence pairs grouped by length into batches of at most
//! `max_tokens` (padded) tokens, shuffled per epoch with a seed, and turned into tensors with
//! teacher forcing (decoder input = start token + target shifted right).

use crate::data::tokenizer::SubwordTokenizer;
use crate::rng::Rng;
use anyhow::{bail, Result};
use candle_core::{Device, Tensor};

/// One tokenized sentence pair; both sides end with `</s>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Example {
    /// Source ids.
    pub src: Vec<u32>,
    /// Target ids.
    pub tgt: Vec<u32>,
}

/// What `encode_pairs` dropped.
#[derive(Debug, Default, Clone, Copy)]
pub struct Filtered {
    /// Pairs with an empty side.
    pub empty: usize,
    /// Pairs with a side longer than the limit.
    pub too_long: usize,
}

/// Tokenizes parallel lines, appends `</s>`, and drops pairs with an empty side or a side
/// longer than `max_len` tokens (`</s>` included).
pub fn encode_pairs(
    tok: &SubwordTokenizer,
    src: &[String],
    tgt: &[String],
    max_len: usize,
) -> Result<(Vec<Example>, Filtered)> {
    let s = tok.encode_batch(src)?;
    let t = tok.encode_batch(tgt)?;
    let mut out = Vec::with_capacity(s.len());
    let mut filtered = Filtered::default();
    for (mut s, mut t) in s.into_iter().zip(t) {
        if s.is_empty() || t.is_empty() {
            filtered.empty += 1;
            continue;
        }
        s.push(tok.eos_id);
        t.push(tok.eos_id);
        if s.len() > max_len || t.len() > max_len {
            filtered.too_long += 1;
            continue;
        }
        out.push(Example { src: s, tgt: t });
    }
    Ok((out, filtered))
}

/// Groups example indices into batches of at most `max_tokens` padded tokens: sorted by
/// (source, target) length, then filled greedily so that longest side × size ≤ max_tokens.
pub fn make_batches(examples: &[Example], max_tokens: usize) -> Result<Vec<Vec<usize>>> {
    let mut idx: Vec<usize> = (0..examples.len()).collect();
    idx.sort_by_key(|&i| (examples[i].src.len(), examples[i].tgt.len(), i));
    let mut batches = Vec::new();
    let mut cur: Vec<usize> = Vec::new();
    let mut longest = 0;
    for i in idx {
        let len = examples[i].src.len().max(examples[i].tgt.len());
        if len > max_tokens {
            bail!("--max-tokens {max_tokens} is smaller than a {len}-token sentence: raise it or lower max_len");
        }
        if !cur.is_empty() && longest.max(len) * (cur.len() + 1) > max_tokens {
            batches.push(std::mem::take(&mut cur));
            longest = 0;
        }
        cur.push(i);
        longest = longest.max(len);
    }
    if !cur.is_empty() {
        batches.push(cur);
    }
    Ok(batches)
}

/// The batch order of `epoch` (1-based): a permutation that depends only on seed and epoch,
/// so a resumed run sees the same order.
pub fn epoch_order(n_batches: usize, seed: u64, epoch: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n_batches).collect();
    let mut rng = Rng::new(seed ^ (epoch as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    rng.shuffle(&mut order);
    order
}

/// A batch as tensors.
pub struct Batch {
    /// Source ids, right-padded, (B, S).
    pub src: Tensor,
    /// Decoder inputs: start token + target without its last token, (B, T).
    pub tgt_in: Tensor,
    /// Target lengths (`</s>` included).
    pub tgt_lengths: Vec<usize>,
    /// Flat indices b·T + t of the real (non-pad) target positions, (N,).
    pub positions: Tensor,
    /// Their labels, (N,).
    pub labels: Tensor,
    /// N: the number of target tokens.
    pub n_tokens: usize,
}

fn pad_to(rows: impl Iterator<Item = Vec<u32>>, pad: u32, device: &Device) -> Result<Tensor> {
    let rows: Vec<Vec<u32>> = rows.collect();
    let width = rows.iter().map(Vec::len).max().unwrap_or(0);
    let mut flat = Vec::with_capacity(rows.len() * width);
    for r in &rows {
        flat.extend_from_slice(r);
        flat.extend(std::iter::repeat_n(pad, width - r.len()));
    }
    Ok(Tensor::from_vec(flat, (rows.len(), width), device)?)
}

impl Batch {
    /// Tensors for the examples `idx`; `start` is the decoder start id (Marian: pad).
    pub fn new(
        examples: &[Example],
        idx: &[usize],
        pad: u32,
        start: u32,
        device: &Device,
    ) -> Result<Self> {
        let exs: Vec<&Example> = idx.iter().map(|&i| &examples[i]).collect();
        let src = pad_to(exs.iter().map(|e| e.src.clone()), pad, device)?;
        let tgt_in = pad_to(
            exs.iter().map(|e| {
                std::iter::once(start)
                    .chain(e.tgt[..e.tgt.len() - 1].iter().copied())
                    .collect()
            }),
            pad,
            device,
        )?;
        let t = tgt_in.dim(1)?;
        let mut positions = Vec::new();
        let mut labels = Vec::new();
        for (b, e) in exs.iter().enumerate() {
            for (i, &y) in e.tgt.iter().enumerate() {
                positions.push((b * t + i) as u32);
                labels.push(y);
            }
        }
        let n_tokens = labels.len();
        Ok(Self {
            src,
            tgt_in,
            tgt_lengths: exs.iter().map(|e| e.tgt.len()).collect(),
            positions: Tensor::from_vec(positions, n_tokens, device)?,
            labels: Tensor::from_vec(labels, n_tokens, device)?,
            n_tokens,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ex(s: usize, t: usize) -> Example {
        Example {
            src: vec![5; s],
            tgt: vec![6; t],
        }
    }

    #[test]
    fn batches_respect_the_token_budget_and_cover_everything() {
        let exs: Vec<Example> = (1..60).map(|i| ex(i % 17 + 1, i % 11 + 1)).collect();
        let batches = make_batches(&exs, 40).unwrap();
        let mut seen: Vec<usize> = batches.concat();
        seen.sort();
        assert_eq!(seen, (0..exs.len()).collect::<Vec<_>>());
        for b in &batches {
            let longest = b
                .iter()
                .map(|&i| exs[i].src.len().max(exs[i].tgt.len()))
                .max()
                .unwrap();
            assert!(longest * b.len() <= 40);
        }
        assert_eq!(epoch_order(10, 3, 2), epoch_order(10, 3, 2));
        assert_ne!(epoch_order(10, 3, 1), epoch_order(10, 3, 2));
    }

    #[test]
    fn teacher_forcing_shifts_the_target_right() {
        let exs = vec![
            Example {
                src: vec![7, 0],
                tgt: vec![8, 9, 0],
            },
            Example {
                src: vec![7, 7, 7, 0],
                tgt: vec![4, 0],
            },
        ];
        let b = Batch::new(&exs, &[0, 1], 99, 99, &Device::Cpu).unwrap();
        assert_eq!(
            b.tgt_in.to_vec2::<u32>().unwrap(),
            vec![vec![99, 8, 9], vec![99, 4, 99]]
        );
        assert_eq!(
            b.src.to_vec2::<u32>().unwrap(),
            vec![vec![7, 0, 99, 99], vec![7, 7, 7, 0]]
        );
        assert_eq!(b.labels.to_vec1::<u32>().unwrap(), vec![8, 9, 0, 4, 0]);
        assert_eq!(b.positions.to_vec1::<u32>().unwrap(), vec![0, 1, 2, 3, 4]);
        assert_eq!(b.n_tokens, 5);
    }
}
