//! Multi-head attention as the model uses it: projections and heads around the attention ops
//! of `ops::attention` (whole sequences in training and encoding, one query row per decoding
//! step), which choose their kernels by device and dtype.

use super::weights::Weights;
use super::{Dropout, Linear};
use crate::ops;
use crate::ops::packed::ComputeType;
use anyhow::Result;
use candle_core::Tensor;

/// Multi-head scaled dot-product attention, softmax(QKᵀ/√d_k)V.
pub struct Attention {
    proj: Projections,
    pub(super) out_proj: Linear,
    pub(super) heads: usize,
    pub(super) head_dim: usize,
}

/// The query, key and value projections of an attention layer.
enum Projections {
    /// Three layers: trainable weights and cross-attention. Loaded self-attention that no CPU
    /// kernel packs also has them stacked into one (3d, d) layer, `qkv`: one product per call.
    Apart {
        q: Linear,
        k: Linear,
        v: Linear,
        qkv: Option<Linear>,
    },
    /// Loaded self-attention on the CPU: the three stacked into one (3d, d) layer packed for
    /// the inference kernels, their only copy, so that a decoding step makes one product (one
    /// parallel region) instead of three. The encoder's computes in bfloat16 under
    /// `--compute-type int8` (see `Seq2Seq::new`).
    Stacked(Linear),
}

impl Attention {
    /// With `stack_qkv`, loaded weights get the stacked q, k and v layer, computing as
    /// `stack_qkv` says.
    pub(super) fn new(
        w: &Weights,
        name: &str,
        d: usize,
        heads: usize,
        stack_qkv: Option<ComputeType>,
    ) -> Result<Self> {
        let layer = |p: &str| Linear::new(w, &format!("{name}.{p}"), d, d);
        let proj = match stack_qkv {
            Some(compute) if w.is_loaded() => {
                let [q, k, v] = ["q_proj", "k_proj", "v_proj"]
                    .map(|p| Linear::parameters(w, &format!("{name}.{p}"), d, d));
                let (q, k, v) = (q?, k?, v?);
                let qkv = Linear::from_tensors(
                    Tensor::cat(&[&q.0, &k.0, &v.0], 0)?,
                    Tensor::cat(&[&q.1, &k.1, &v.1], 0)?,
                    Some(compute),
                )?;
                if qkv.is_packed() {
                    Projections::Stacked(qkv)
                } else {
                    Projections::Apart {
                        q: Linear::from_tensors(q.0, q.1, w.packing())?,
                        k: Linear::from_tensors(k.0, k.1, w.packing())?,
                        v: Linear::from_tensors(v.0, v.1, w.packing())?,
                        qkv: Some(qkv),
                    }
                }
            }
            _ => Projections::Apart {
                q: layer("q_proj")?,
                k: layer("k_proj")?,
                v: layer("v_proj")?,
                qkv: None,
            },
        };
        Ok(Self {
            proj,
            out_proj: layer("out_proj")?,
            heads,
            head_dim: d / heads,
        })
    }

    /// The stacked q, k and v layer, where there is one.
    fn stacked(&self) -> Option<&Linear> {
        match &self.proj {
            Projections::Stacked(qkv) | Projections::Apart { qkv: Some(qkv), .. } => Some(qkv),
            Projections::Apart { qkv: None, .. } => None,
        }
    }

    /// `x` (B, T, d) through the stacked layer: (queries, keys, values), each (B, T, d).
    fn stacked_parts(&self, qkv: &Linear, x: &Tensor) -> Result<[Tensor; 3]> {
        let y = qkv.forward(x)?;
        let d = self.heads * self.head_dim;
        let part = |i: usize| y.narrow(candle_core::D::Minus1, i * d, d);
        Ok([part(0)?, part(1)?, part(2)?])
    }

    /// Scales queries (B, T, d) by 1/√d_k and splits them into heads.
    fn scaled_heads(&self, q: &Tensor) -> Result<Tensor> {
        self.split_heads(&(q * (self.head_dim as f64).powf(-0.5))?)
    }

    /// Scaled queries, keys and values of `x` (B, T, d), each (B, H, T, d_k).
    pub fn queries_keys_values(&self, x: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        let Some(qkv) = self.stacked() else {
            let (k, v) = self.keys_values(x)?;
            return Ok((self.queries(x)?, k, v));
        };
        let [q, k, v] = self.stacked_parts(qkv, x)?;
        Ok((
            self.scaled_heads(&q)?,
            self.split_heads(&k)?,
            self.split_heads(&v)?,
        ))
    }

    /// (B, T, d) → (B, H, T, d_k)
    pub(super) fn split_heads(&self, x: &Tensor) -> Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        Ok(x.reshape((b, t, self.heads, self.head_dim))?
            .transpose(1, 2)?
            .contiguous()?)
    }

    /// Keys and values of `x` (B, S, d), each (B, H, S, d_k): computed once per sentence for
    /// cross-attention.
    pub fn keys_values(&self, x: &Tensor) -> Result<(Tensor, Tensor)> {
        match &self.proj {
            Projections::Apart { k, v, .. } => Ok((
                self.split_heads(&k.forward(x)?)?,
                self.split_heads(&v.forward(x)?)?,
            )),
            Projections::Stacked(qkv) => {
                let [_, k, v] = self.stacked_parts(qkv, x)?;
                Ok((self.split_heads(&k)?, self.split_heads(&v)?))
            }
        }
    }

    /// Scaled queries of `x` (B, T, d), (B, H, T, d_k).
    pub(super) fn queries(&self, x: &Tensor) -> Result<Tensor> {
        match &self.proj {
            Projections::Apart { q, .. } => self.scaled_heads(&q.forward(x)?),
            Projections::Stacked(qkv) => {
                let [q, _, _] = self.stacked_parts(qkv, x)?;
                self.scaled_heads(&q)
            }
        }
    }

    /// (B, H, T, d_k) → out_proj of (B, T, d).
    pub(super) fn merge(&self, ctx: &Tensor) -> Result<Tensor> {
        let (b, _, t, _) = ctx.dims4()?;
        let ctx = ctx.transpose(1, 2)?.reshape((b, t, ()))?;
        self.out_proj.forward(&ctx)
    }

    /// Self-attention over whole sequences `x` (B, T, d) with `bias` (B|1, 1, T|1, T), its
    /// probabilities dropped with `p_attn` in training: one projection to stacked q, k and v,
    /// and one op.
    pub fn self_attend(
        &self,
        x: &Tensor,
        bias: &Tensor,
        p_attn: f64,
        drop: &Dropout,
    ) -> Result<Tensor> {
        let qkv = match &self.proj {
            Projections::Stacked(qkv) | Projections::Apart { qkv: Some(qkv), .. } => {
                qkv.forward(x)?
            }
            Projections::Apart { q, k, v, qkv: None } => Linear::forward_stacked(&[q, k, v], x)?,
        };
        let (b, t, _) = x.dims3()?;
        let mask = drop.mask(b * self.heads * t * t, p_attn);
        let ctx = ops::attention::self_attention(&qkv, self.heads, Some(bias), mask)?;
        self.out_proj.forward(&ctx)
    }

    /// Attention of `x` (B, T, d) over the encoder output `memory` (B, S, d) with `bias`
    /// (B|1, 1, 1, S), as `self_attend`.
    pub fn cross_attend(
        &self,
        x: &Tensor,
        memory: &Tensor,
        bias: &Tensor,
        p_attn: f64,
        drop: &Dropout,
    ) -> Result<Tensor> {
        let (q, kv) = match &self.proj {
            Projections::Apart { q, k, v, .. } => {
                (q.forward(x)?, Linear::forward_stacked(&[k, v], memory)?)
            }
            Projections::Stacked(qkv) => {
                let [q, ..] = self.stacked_parts(qkv, x)?;
                let [_, k, v] = self.stacked_parts(qkv, memory)?;
                (q, Tensor::cat(&[k, v], candle_core::D::Minus1)?)
            }
        };
        let (b, t, _) = x.dims3()?;
        let mask = drop.mask(b * self.heads * t * memory.dim(1)?, p_attn);
        let ctx = ops::attention::cross_attention(&q, &kv, self.heads, Some(bias), mask)?;
        self.out_proj.forward(&ctx)
    }

    /// Attention probabilities softmax(QKᵀ/√d_k) of queries `x` (B, T, d) over `memory`
    /// (B, S, d) with `bias` (B|1, 1, T|1, S), before any dropout: (B, H, T, S). What word
    /// alignments are read from, and what guided alignment trains.
    pub fn probabilities(&self, x: &Tensor, memory: &Tensor, bias: &Tensor) -> Result<Tensor> {
        let q = self.queries(x)?;
        let k = match &self.proj {
            Projections::Apart { k, .. } => k.forward(memory)?,
            Projections::Stacked(qkv) => {
                let [_, k, _] = self.stacked_parts(qkv, memory)?;
                k
            }
        };
        let k = self.split_heads(&k)?;
        Ok(ops::masked_softmax(&q.matmul(&k.t()?)?, Some(bias))?)
    }

    /// Single-query self-attention of decoding step t, for scaled queries `q` (B, H, 1, d_k),
    /// over the keys/values of steps 0..=t, one (B_j, H, 1, d_k) pair per step: row b reads
    /// row `history[b][j]` of step j.
    pub fn attend_steps(
        &self,
        q: &Tensor,
        steps: &[(Tensor, Tensor)],
        history: &[Vec<u32>],
    ) -> Result<Tensor> {
        self.merge(&ops::attend_steps(q, steps, history)?)
    }

    /// Attention of one query row per batch row (decoding), for `x` (B, 1, d), over groups
    /// of sentences' keys and values: row b attends over sentence `rows[b]` = (group, index)
    /// (`None`: sentence b of the only group), so that the beams of a sentence read one copy
    /// of its encoder keys.
    pub fn attend_rows(
        &self,
        x: &Tensor,
        groups: &[ops::SourceKeys],
        rows: Option<&[(u32, u32)]>,
    ) -> Result<Tensor> {
        self.merge(&ops::attend_one(&self.queries(x)?, groups, rows)?)
    }
}
