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
    pub(super) q_proj: Linear,
    pub(super) k_proj: Linear,
    pub(super) v_proj: Linear,
    pub(super) out_proj: Linear,
    /// Self-attention with loaded weights: q, k and v projections stacked into one (3d, d)
    /// layer, packed once for the inference kernels, so that a decoding step makes one product
    /// (one parallel region) instead of three and the encoder stacks no weights per call.
    /// The encoder's computes in bfloat16 under `--compute-type int8` (see `Seq2Seq::new`).
    /// Cross-attention and trainable weights have none.
    pub(super) qkv_proj: Option<Linear>,
    pub(super) heads: usize,
    pub(super) head_dim: usize,
}

impl Attention {
    /// With `stack_qkv`, loaded weights also get the stacked `qkv_proj` layer, computing as
    /// `stack_qkv` says.
    pub(super) fn new(
        w: &Weights,
        name: &str,
        d: usize,
        heads: usize,
        stack_qkv: Option<ComputeType>,
    ) -> Result<Self> {
        let (q_proj, k_proj, v_proj) = (
            Linear::new(w, &format!("{name}.q_proj"), d, d)?,
            Linear::new(w, &format!("{name}.k_proj"), d, d)?,
            Linear::new(w, &format!("{name}.v_proj"), d, d)?,
        );
        let qkv_proj = match stack_qkv {
            Some(compute) if w.is_loaded() => {
                let stack = |f: fn(&Linear) -> &Tensor| {
                    Tensor::cat(&[f(&q_proj), f(&k_proj), f(&v_proj)], 0)
                };
                Some(Linear::from_tensors(
                    stack(|l| &l.weight)?,
                    stack(|l| &l.bias)?,
                    Some(compute),
                ))
            }
            _ => None,
        };
        Ok(Self {
            q_proj,
            k_proj,
            v_proj,
            out_proj: Linear::new(w, &format!("{name}.out_proj"), d, d)?,
            qkv_proj,
            heads,
            head_dim: d / heads,
        })
    }

    /// Scaled queries, keys and values of `x` (B, T, d), each (B, H, T, d_k).
    pub fn queries_keys_values(&self, x: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        let Some(qkv) = &self.qkv_proj else {
            let (k, v) = self.keys_values(x)?;
            return Ok((self.queries(x)?, k, v));
        };
        let y = qkv.forward(x)?;
        let d = self.heads * self.head_dim;
        let part = |i: usize| y.narrow(candle_core::D::Minus1, i * d, d);
        Ok((
            self.split_heads(&(part(0)? * (self.head_dim as f64).powf(-0.5))?)?,
            self.split_heads(&part(1)?)?,
            self.split_heads(&part(2)?)?,
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
        Ok((
            self.split_heads(&self.k_proj.forward(x)?)?,
            self.split_heads(&self.v_proj.forward(x)?)?,
        ))
    }

    /// Scaled queries of `x` (B, T, d), (B, H, T, d_k).
    pub(super) fn queries(&self, x: &Tensor) -> Result<Tensor> {
        self.split_heads(&(self.q_proj.forward(x)? * (self.head_dim as f64).powf(-0.5))?)
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
        let qkv = match &self.qkv_proj {
            Some(l) => l.forward(x)?,
            None => Linear::stack(&[&self.q_proj, &self.k_proj, &self.v_proj])?.forward(x)?,
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
        let q = self.q_proj.forward(x)?;
        let kv = Linear::stack(&[&self.k_proj, &self.v_proj])?.forward(memory)?;
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
        let k = self.split_heads(&self.k_proj.forward(memory)?)?;
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
