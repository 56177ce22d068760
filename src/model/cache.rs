//! The decoder's state between incremental decoding steps: per layer the self-attention keys
//! and values so far and the cross-attention keys and values, laid out so that beam search
//! reorders hypotheses and drops finished sentences without copying, and new sentences join a
//! running search (on the CPU).

use super::attention::Attention;
use crate::ops::SourceKeys;
use anyhow::Result;
use candle_core::Tensor;

/// The cached state of one decoder layer during incremental decoding.
#[derive(Clone)]
pub struct LayerCache {
    /// Self-attention keys and values so far, (B, H, t, d_k) (devices other than the CPU).
    pub(super) self_kv: Option<(Tensor, Tensor)>,
    /// On the CPU: the self-attention keys and values of each step, (B_t, H, 1, d_k), never
    /// copied; `DecoderCache::history` says which row of each step a hypothesis reads.
    pub(super) steps: Vec<(Tensor, Tensor)>,
    /// Cross-attention keys and values, computed once per sentence, one pair per group of
    /// sentences that started decoding together: (N|B, H, S, d_k).
    pub(super) cross_kv: Vec<(Tensor, Tensor)>,
}

impl LayerCache {
    /// Self-attention of this step's `x` (B, 1, d) over the steps so far, its own keys and
    /// values kept: step by step as `history` (CPU) says, else concatenated per row.
    pub(super) fn self_attend(
        &mut self,
        attn: &Attention,
        x: &Tensor,
        history: Option<&[Vec<u32>]>,
    ) -> Result<Tensor> {
        if let Some(history) = history {
            let (q, k, v) = attn.queries_keys_values(x)?;
            self.steps.push((k, v));
            return attn.attend_steps(&q, &self.steps, history);
        }
        let (k, v) = attn.keys_values(x)?;
        let (k, v) = match &self.self_kv {
            Some((pk, pv)) => (Tensor::cat(&[pk, &k], 2)?, Tensor::cat(&[pv, &v], 2)?),
            None => (k, v),
        };
        let keys = SourceKeys {
            k: &k,
            v: &v,
            bias: None,
        };
        let out = attn.attend_rows(x, &[keys], None)?;
        self.self_kv = Some((k, v));
        Ok(out)
    }

    /// Cross-attention of this step's `x` (B, 1, d) over the cached encoder keys and values:
    /// batch row b reads sentence `rows[b]` = (group, index), where the beams of a sentence
    /// share them (`None`: row b of the only group).
    pub(super) fn cross_attend(
        &self,
        attn: &Attention,
        x: &Tensor,
        src_bias: &[Tensor],
        rows: Option<&[(u32, u32)]>,
    ) -> Result<Tensor> {
        let groups: Vec<SourceKeys> = self
            .cross_kv
            .iter()
            .zip(src_bias)
            .map(|((k, v), bias)| SourceKeys {
                k,
                v,
                bias: Some(bias),
            })
            .collect();
        attn.attend_rows(x, &groups, rows)
    }
}

/// Decoder state between steps: one cache per layer, and which sentence each batch row
/// (hypothesis) belongs to.
#[derive(Clone)]
pub struct DecoderCache {
    pub(super) layers: Vec<LayerCache>,
    /// Key-padding bias of the sources for cross-attention, per group one row per cross K/V
    /// row.
    pub(super) src_bias: Vec<Tensor>,
    /// The sentence of each batch row: (group, row of the group's memory).
    pub(super) sentences: Vec<(u32, u32)>,
    /// CPU: cross-attention K/V and `src_bias` hold one row per sentence, shared by its beams,
    /// and self-attention K/V stay where each step wrote them: nothing is copied when beams
    /// are reordered or sentences finish, and sentences can join ([`Self::join`]).
    /// Otherwise one group, one row per batch row, copied on select.
    pub(super) shared_cross: bool,
    /// CPU: per batch row, the row of each step's K/V that holds its ancestor, for the steps
    /// since its sentence started (the last ones).
    pub(super) history: Vec<Vec<u32>>,
    /// Number of decoding steps taken.
    pub len: usize,
}

impl DecoderCache {
    /// Number of batch rows (hypotheses).
    pub fn rows(&self) -> usize {
        self.sentences.len()
    }

    /// The target position each batch row decodes next.
    pub(super) fn positions(&self) -> Vec<usize> {
        if self.shared_cross {
            self.history.iter().map(Vec::len).collect()
        } else {
            vec![self.len; self.rows()]
        }
    }

    /// Whether sentences that start later can [`Self::join`] this decoding (the CPU layout).
    pub fn joinable(&self) -> bool {
        self.shared_cross
    }

    /// Adds the rows of `fresh`, a decoding that has not taken a step, after this one's: its
    /// sentences decode from their first position alongside this cache's.
    pub fn join(&mut self, fresh: DecoderCache) -> Result<()> {
        if !self.shared_cross || !fresh.shared_cross || fresh.len > 0 {
            anyhow::bail!("only a fresh decoding on the CPU can join another");
        }
        let groups = self.src_bias.len() as u32;
        for (l, f) in self.layers.iter_mut().zip(fresh.layers) {
            l.cross_kv.extend(f.cross_kv);
        }
        self.src_bias.extend(fresh.src_bias);
        self.sentences
            .extend(fresh.sentences.iter().map(|&(g, i)| (g + groups, i)));
        self.history.extend(fresh.history);
        Ok(())
    }

    /// Keeps the batch rows `rows`, in that order: beam reordering (a row may appear several
    /// times) and pruning of finished sentences. On the CPU, what no row reads any more (a
    /// group's encoder keys, the keys of steps before every row's sentence) is let go.
    pub fn select(&self, rows: &[u32]) -> Result<Self> {
        let mut sentences: Vec<(u32, u32)> =
            rows.iter().map(|&r| self.sentences[r as usize]).collect();
        if !self.shared_cross {
            // One row per hypothesis: copy what changes.
            let idx = Tensor::new(rows, self.src_bias[0].device())?;
            let pick = |t: &Tensor| t.index_select(&idx, 0);
            let copy_cross = sentences != self.sentences;
            let layers = self
                .layers
                .iter()
                .map(|l| {
                    Ok(LayerCache {
                        self_kv: match &l.self_kv {
                            Some((k, v)) => Some((pick(k)?, pick(v)?)),
                            None => None,
                        },
                        steps: Vec::new(),
                        cross_kv: if copy_cross {
                            let (k, v) = &l.cross_kv[0];
                            vec![(pick(k)?, pick(v)?)]
                        } else {
                            l.cross_kv.clone()
                        },
                    })
                })
                .collect::<Result<_>>()?;
            return Ok(Self {
                layers,
                src_bias: if copy_cross {
                    vec![pick(&self.src_bias[0])?]
                } else {
                    self.src_bias.clone()
                },
                sentences,
                shared_cross: false,
                history: Vec::new(),
                len: self.len,
            });
        }
        let history: Vec<Vec<u32>> = rows
            .iter()
            .map(|&r| self.history[r as usize].clone())
            .collect();
        // Groups still read, renumbered in order.
        let mut kept = vec![None; self.src_bias.len()];
        for &(g, _) in &sentences {
            kept[g as usize] = Some(0);
        }
        for (next, k) in kept.iter_mut().flatten().enumerate() {
            *k = next as u32;
        }
        for s in &mut sentences {
            s.0 = kept[s.0 as usize].unwrap_or_default();
        }
        let keep = |g: &usize| kept[*g].is_some();
        let steps_read = history.iter().map(Vec::len).max().unwrap_or(0);
        let layers = self
            .layers
            .iter()
            .map(|l| LayerCache {
                self_kv: None,
                steps: l.steps[l.steps.len() - steps_read..].to_vec(),
                cross_kv: (0..l.cross_kv.len())
                    .filter(keep)
                    .map(|g| l.cross_kv[g].clone())
                    .collect(),
            })
            .collect();
        Ok(Self {
            layers,
            src_bias: (0..self.src_bias.len())
                .filter(keep)
                .map(|g| self.src_bias[g].clone())
                .collect(),
            sentences,
            shared_cross: true,
            history,
            len: self.len,
        })
    }
}
