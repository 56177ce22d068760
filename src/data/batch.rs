//! Training batches: pairs of one or more prepared corpora (`data::store`), each sampled as
//! often as its weight says, grouped by length into batches of at most `max_tokens` (padded)
//! tokens, shuffled per epoch with a seed, and turned into tensors with teacher forcing
//! (decoder input = start token + target shifted right).
//!
//! An epoch's plan holds four bytes per sampled pair (its id, in length order) and the batch
//! boundaries; the ids themselves stay in the memory-mapped stores until a batch is built.

use crate::data::store::Store;
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
    /// Its corpus (in the mixture's order) and the line of its files it came from, when the
    /// store keeps line numbers.
    pub origin: (usize, Option<u64>),
}

/// The longest `max_len` an epoch plan sorts by (its counting sort has `max_len²` buckets).
pub const MAX_LEN_LIMIT: usize = 1024;

/// Prepared corpora and how often each is sampled per epoch. A weight `w` puts every pair
/// of its corpus ⌊w⌋ times into an epoch and once more with probability w − ⌊w⌋, drawn anew
/// each epoch from the seed: weight 3 triples a small in-domain corpus, 0.5 takes a random
/// half of a large one.
pub struct Mixture {
    /// The corpora: a name for the log, the store, the weight.
    pub corpora: Vec<(String, Store, f64)>,
    /// Id of each corpus's first pair in the mixture's numbering.
    first: Vec<u64>,
}

/// One epoch: which pairs, in which batches.
pub struct EpochPlan {
    /// Pair ids in (source length, target length) order, each as often as sampled.
    items: Vec<u32>,
    /// Where each batch starts in `items`, and a last entry at its end.
    bounds: Vec<usize>,
    /// Pairs drawn from each corpus.
    pub drawn: Vec<u64>,
    /// Pairs left out for a side longer than the run's `max_len` (a store prepared with a
    /// larger one).
    pub too_long: u64,
    /// Real and padded tokens over all batches, both sides (`</s>` included).
    pub real_tokens: u64,
    /// Tokens the batches hold, padding included.
    pub padded_tokens: u64,
}

impl Mixture {
    /// Combines stores with their weights (each positive and finite).
    pub fn new(corpora: Vec<(String, Store, f64)>) -> Result<Self> {
        let mut first = Vec::with_capacity(corpora.len());
        let mut n = 0u64;
        for (name, store, w) in &corpora {
            if !(w.is_finite() && *w > 0.0) {
                bail!("corpus {name}: weight {w} is not a positive number");
            }
            first.push(n);
            n += store.len() as u64;
        }
        if n * corpora.iter().map(|c| c.2.ceil() as u64).max().unwrap_or(1) > u32::MAX as u64 {
            bail!("{n} pairs (times their weights) are more than one epoch plan can hold (2³²)");
        }
        Ok(Self { corpora, first })
    }

    /// The pairs with these ids, `eos` appended to both sides.
    pub fn examples(&self, ids: &[u32], eos: u32) -> Vec<Example> {
        ids.iter()
            .map(|&id| {
                let c = self.first.partition_point(|&f| f <= id as u64) - 1;
                let (mut src, mut tgt) = (Vec::new(), Vec::new());
                let i = (id as u64 - self.first[c]) as usize;
                self.corpora[c].1.read_pair(i, &mut src, &mut tgt);
                src.push(eos);
                tgt.push(eos);
                Example {
                    src,
                    tgt,
                    origin: (c, self.corpora[c].1.line(i)),
                }
            })
            .collect()
    }

    /// Calls `f(corpus, id, key, copies)` for every pair, in corpus order; `key` is 0 for a
    /// pair with a side longer than `max_len` (with `</s>`), which is never sampled.
    fn sample(
        &self,
        max_len: usize,
        seed: u64,
        epoch: usize,
        mut f: impl FnMut(usize, u32, usize, u64),
    ) {
        for (c, (_, store, w)) in self.corpora.iter().enumerate() {
            let whole = w.floor() as u64;
            // Once more with probability w − ⌊w⌋: a draw below this cut-off.
            let cut = ((w - w.floor()) * 2f64.powi(64)) as u64;
            let rng = Rng::new(
                seed ^ (epoch as u64).wrapping_mul(0xD1B5_4A32_D192_ED03)
                    ^ (c as u64 + 1).wrapping_mul(0x8CB9_2BA7_2F3D_8DD7),
            );
            for i in 0..store.len() {
                let (s, t) = store.lengths(i);
                let id = (self.first[c] + i as u64) as u32;
                if s >= max_len || t >= max_len {
                    f(c, id, 0, 0);
                    continue;
                }
                let extra = cut > 0 && rng.draw_at(i as u64 + 1) < cut;
                f(c, id, (s + 1) * (max_len + 1) + t + 1, whole + extra as u64);
            }
        }
    }

    /// The plan of `epoch` (1-based): sampled pairs sorted by (source, target) length, ties
    /// in corpus order, then filled greedily into batches whose longest side × size ≤
    /// `max_tokens`. Depends only on the stores, the weights, `seed` and `epoch`, so a
    /// resumed run sees the same batches.
    pub fn plan(
        &self,
        max_len: usize,
        max_tokens: usize,
        seed: u64,
        epoch: usize,
    ) -> Result<EpochPlan> {
        if max_len > MAX_LEN_LIMIT {
            bail!("max_len {max_len} is above the supported {MAX_LEN_LIMIT}");
        }
        // Counting sort by key = (source length, target length), stable in corpus order.
        let keys = (max_len + 1) * (max_len + 1);
        let mut count = vec![0u64; keys + 1];
        let mut drawn = vec![0u64; self.corpora.len()];
        let mut too_long = 0;
        self.sample(max_len, seed, epoch, |c, _, key, copies| {
            if key == 0 {
                too_long += 1;
            } else {
                count[key + 1] += copies;
                drawn[c] += copies;
            }
        });
        for k in 1..=keys {
            count[k] += count[k - 1];
        }
        let mut items = vec![0u32; count[keys] as usize];
        let mut next = count;
        self.sample(max_len, seed, epoch, |_, id, key, copies| {
            for _ in 0..copies {
                items[next[key] as usize] = id;
                next[key] += 1;
            }
        });
        // Batches: `next[key]` is now where bucket `key` ends.
        let mut bounds = vec![0];
        let (mut longest, mut size) = (0, 0);
        let (mut real, mut padded) = (0u64, 0u64);
        let (mut sum, mut max_s, mut max_t) = (0u64, 0, 0);
        let mut close = |size: usize, max_s: usize, max_t: usize, sum: u64| {
            real += sum;
            padded += (size * (max_s + max_t)) as u64;
        };
        let mut at = 0usize;
        for (key, &end) in next.iter().enumerate().take(keys) {
            let end = end as usize;
            let (s, t) = (key / (max_len + 1), key % (max_len + 1));
            let len = s.max(t);
            if at < end && len > max_tokens {
                bail!("--max-tokens {max_tokens} is smaller than a {len}-token sentence: raise it or lower max_len");
            }
            while at < end {
                if size > 0 && longest.max(len) * (size + 1) > max_tokens {
                    close(size, max_s, max_t, sum);
                    bounds.push(at);
                    (longest, size, sum, max_s, max_t) = (0, 0, 0, 0, 0);
                }
                size += 1;
                longest = longest.max(len);
                (max_s, max_t) = (max_s.max(s), max_t.max(t));
                sum += (s + t) as u64;
                at += 1;
            }
        }
        if size > 0 {
            close(size, max_s, max_t, sum);
            bounds.push(at);
        }
        Ok(EpochPlan {
            items,
            bounds,
            drawn,
            too_long,
            real_tokens: real,
            padded_tokens: padded,
        })
    }
}

impl EpochPlan {
    /// Number of batches.
    pub fn len(&self) -> usize {
        self.bounds.len() - 1
    }

    /// Whether the epoch has no batch.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The pair ids of batch `k` (in length order, not shuffled).
    pub fn batch(&self, k: usize) -> &[u32] {
        &self.items[self.bounds[k]..self.bounds[k + 1]]
    }

    /// The share of batch tokens that are padding.
    pub fn padding_share(&self) -> f64 {
        1.0 - self.real_tokens as f64 / self.padded_tokens.max(1) as f64
    }
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
    /// Guided alignment's targets (B, T, S) and the target tokens they cover, when training
    /// with it.
    pub alignment: Option<(Tensor, usize)>,
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
    /// Tensors for `exs`; `start` is the decoder start id (Marian: pad).
    pub fn new(exs: &[Example], pad: u32, start: u32, device: &Device) -> Result<Self> {
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
            alignment: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::data::prepare::testing::store_of;

    /// A toy corpus of `n` pairs of varied lengths (words "w0".."w9").
    fn lines(n: usize, seed: u64) -> Vec<(String, String)> {
        let mut rng = Rng::new(seed);
        (0..n)
            .map(|_| {
                let mut side = || {
                    let len = 1 + rng.below(12);
                    (0..len)
                        .map(|_| format!("w{}", rng.below(10)))
                        .collect::<Vec<_>>()
                        .join(" ")
                };
                (side(), side())
            })
            .collect()
    }

    #[test]
    fn batches_respect_the_token_budget_and_cover_every_pair_once() {
        let dir = tempfile::tempdir().unwrap();
        let store = store_of(dir.path(), "a", &lines(300, 1));
        let n = store.len();
        let mix = Mixture::new(vec![("a".into(), store, 1.0)]).unwrap();
        let plan = mix.plan(128, 60, 7, 1).unwrap();
        let mut seen: Vec<u32> = (0..plan.len())
            .flat_map(|k| plan.batch(k).to_vec())
            .collect();
        seen.sort();
        assert_eq!(seen, (0..n as u32).collect::<Vec<_>>());
        assert_eq!(plan.drawn, vec![n as u64]);
        let mut previous = (0, 0);
        for k in 0..plan.len() {
            let exs = mix.examples(plan.batch(k), 0);
            let longest = exs
                .iter()
                .map(|e| e.src.len().max(e.tgt.len()))
                .max()
                .unwrap();
            assert!(longest * exs.len() <= 60);
            // Sorted by (source, target) length across batches.
            for e in &exs {
                assert!((e.src.len(), e.tgt.len()) >= previous);
                previous = (e.src.len(), e.tgt.len());
                assert_eq!((e.src.last(), e.tgt.last()), (Some(&0), Some(&0)));
            }
        }
        // A shorter max_len leaves the longer pairs out and counts them.
        let short = mix.plan(6, 60, 7, 1).unwrap();
        let kept: usize = (0..short.len()).map(|k| short.batch(k).len()).sum();
        assert_eq!(kept as u64 + short.too_long, n as u64);
        assert!(short.too_long > 0);
        // A sentence longer than the batch budget is an error.
        let err = mix.plan(128, 8, 7, 1).err().unwrap().to_string();
        assert!(err.contains("smaller than a"), "{err}");
        assert_eq!(epoch_order(10, 3, 2), epoch_order(10, 3, 2));
        assert_ne!(epoch_order(10, 3, 1), epoch_order(10, 3, 2));
    }

    #[test]
    fn weights_set_how_often_each_corpus_is_sampled() {
        let dir = tempfile::tempdir().unwrap();
        let small = store_of(dir.path(), "small", &lines(100, 2));
        let large = store_of(dir.path(), "large", &lines(2000, 3));
        let mix = Mixture::new(vec![
            ("small".into(), small, 3.0),
            ("large".into(), large, 0.5),
        ])
        .unwrap();
        let one = mix.plan(128, 200, 1, 1).unwrap();
        let two = mix.plan(128, 200, 1, 2).unwrap();
        // Weight 3: every pair exactly three times, every epoch.
        assert_eq!((one.drawn[0], two.drawn[0]), (300, 300));
        let count = |plan: &EpochPlan, id: u32| {
            (0..plan.len())
                .flat_map(|k| plan.batch(k).to_vec())
                .filter(|&x| x == id)
                .count()
        };
        assert!((0..100).all(|id| count(&one, id) == 3));
        // Weight 0.5: about half, a different half each epoch, the same for the same seed.
        for d in [one.drawn[1], two.drawn[1]] {
            assert!((900..=1100).contains(&d), "{d}");
        }
        let picked = |plan: &EpochPlan| (100..2100).map(|id| count(plan, id)).collect::<Vec<_>>();
        assert_ne!(picked(&one), picked(&two));
        assert_eq!(picked(&one), picked(&mix.plan(128, 200, 1, 1).unwrap()));
        assert!(picked(&one).iter().all(|&c| c <= 1));
        // Weights must be positive numbers.
        let dir2 = tempfile::tempdir().unwrap();
        for w in [0.0, -1.0, f64::NAN] {
            let store = store_of(dir2.path(), "x", &lines(5, 4));
            let err = Mixture::new(vec![("x".into(), store, w)]).err().unwrap();
            assert!(err.to_string().contains("not a positive number"), "{err}");
        }
    }

    #[test]
    fn teacher_forcing_shifts_the_target_right() {
        let exs = vec![
            Example {
                src: vec![7, 0],
                tgt: vec![8, 9, 0],
                origin: (0, None),
            },
            Example {
                src: vec![7, 7, 7, 0],
                tgt: vec![4, 0],
                origin: (0, None),
            },
        ];
        let b = Batch::new(&exs, 99, 99, &Device::Cpu).unwrap();
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
