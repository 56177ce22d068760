//! The decoder's state between incremental decoding steps: per layer the self-attention keys
//! and values so far and the cross-attention keys and values, laid out so that beam search
//! reorders hypotheses and drops finished sentences without copying (on the CPU).

use super::attention::Attention;
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
    /// Cross-attention keys and values, computed once per sentence, (N|B, H, S, d_k).
    pub(super) cross_kv: (Tensor, Tensor),
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
        let out = attn.attend_rows(x, &k, &v, None, None)?;
        self.self_kv = Some((k, v));
        Ok(out)
    }

    /// Cross-attention of this step's `x` (B, 1, d) over the cached encoder keys and values,
    /// batch row b reading row `kv_rows[b]` where the beams of a sentence share them.
    pub(super) fn cross_attend(
        &self,
        attn: &Attention,
        x: &Tensor,
        src_bias: &Tensor,
        kv_rows: Option<&[u32]>,
    ) -> Result<Tensor> {
        let (k, v) = &self.cross_kv;
        attn.attend_rows(x, k, v, Some(src_bias), kv_rows)
    }
}

/// Decoder state between steps: one cache per layer, and which sentence each batch row
/// (hypothesis) belongs to.
#[derive(Clone)]
pub struct DecoderCache {
    pub(super) layers: Vec<LayerCache>,
    /// Key-padding bias of the sources for cross-attention, one row per cross K/V row.
    pub(super) src_bias: Tensor,
    /// The sentence (row of `start_decoding`'s memory) of each batch row.
    pub(super) sentences: Vec<u32>,
    /// CPU: cross-attention K/V and `src_bias` hold one row per sentence, shared by its beams,
    /// and self-attention K/V stay where each step wrote them: nothing is copied when beams
    /// are reordered or sentences finish. Otherwise one row per batch row, copied on select.
    pub(super) shared_cross: bool,
    /// CPU: per batch row, the row of each past step's K/V that holds its ancestor.
    pub(super) history: Vec<Vec<u32>>,
    /// Number of target positions already decoded.
    pub len: usize,
}

impl DecoderCache {
    /// Keeps the batch rows `rows`, in that order: beam reordering (a row may appear several
    /// times) and pruning of finished sentences.
    pub fn select(&self, rows: &[u32]) -> Result<Self> {
        let sentences: Vec<u32> = rows.iter().map(|&r| self.sentences[r as usize]).collect();
        let idx = Tensor::new(rows, self.src_bias.device())?;
        // Per-row cross K/V only need a copy when some row now holds another sentence.
        let copy_cross = !self.shared_cross && sentences != self.sentences;
        let pick = |t: &Tensor| t.index_select(&idx, 0);
        let layers = self
            .layers
            .iter()
            .map(|l| {
                Ok(LayerCache {
                    self_kv: match &l.self_kv {
                        Some((k, v)) => Some((pick(k)?, pick(v)?)),
                        None => None,
                    },
                    steps: l.steps.clone(),
                    cross_kv: if copy_cross {
                        (pick(&l.cross_kv.0)?, pick(&l.cross_kv.1)?)
                    } else {
                        l.cross_kv.clone()
                    },
                })
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            layers,
            src_bias: if copy_cross {
                pick(&self.src_bias)?
            } else {
                self.src_bias.clone()
            },
            sentences,
            shared_cross: self.shared_cross,
            history: if self.shared_cross {
                rows.iter()
                    .map(|&r| self.history[r as usize].clone())
                    .collect()
            } else {
                Vec::new()
            },
            len: self.len,
        })
    }
}
