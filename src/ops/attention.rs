//! Multi-head attention over whole sequences as one differentiable op with its own backward
//! (CPU, f32; Candle's primitives elsewhere and with attention dropout, the composite that is
//! also the oracle): training, validation and teacher-forced scoring. Queries, keys and values are
//! read in place from the projections' outputs, (B, T, ·) with the heads side by side, and the
//! context comes back as (B, T, d): no head transposes, no score tensors in the graph, and one
//! gradient for the projections instead of one per intermediate. Decoding one step at a time
//! has kernels of its own, in `step_attention`.

use super::cpu::matmul::*;
use super::cpu::*;
use super::step_attention::{attend_row, heads_composite};
use super::*;
use anyhow::Result;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Shape, Tensor};
use rayon::prelude::*;
use std::sync::Mutex;

/// Where queries, keys and values sit in their (B, rows, cols) inputs, and the problem's size.
#[derive(Clone, Copy)]
struct Geometry {
    batch: usize,
    /// Query and key positions.
    t: usize,
    s: usize,
    heads: usize,
    head_dim: usize,
    /// Columns of the query input and of the key/value input (the same tensor for
    /// self-attention), and where q, k and v start in them.
    q_cols: usize,
    kv_cols: usize,
    q_off: usize,
    k_off: usize,
    v_off: usize,
}

impl Geometry {
    fn d(&self) -> usize {
        self.heads * self.head_dim
    }
}

/// Additive key bias (Bb, Tb, S), Bb ∈ {1, B} and Tb ∈ {1, T} broadcast: 0 for visible keys,
/// a large negative value for hidden ones.
struct Bias {
    data: Vec<f32>,
    b: usize,
    t: usize,
}

impl Bias {
    /// From a (Bb, 1, Tb, S) tensor, or none.
    fn new(bias: Option<&Tensor>, s: usize) -> Result<Self> {
        let Some(bias) = bias else {
            return Ok(Self {
                data: vec![0.0; s],
                b: 1,
                t: 1,
            });
        };
        let (b, _, t, bs) = bias.dims4()?;
        anyhow::ensure!(bs == s, "attention bias has {bs} keys, expected {s}");
        let data = with_host_f32(bias, <[f32]>::to_vec)?;
        Ok(Self { data, b, t })
    }

    fn row(&self, b: usize, i: usize, s: usize) -> &[f32] {
        let r = (if self.b == 1 { 0 } else { b }) * self.t + if self.t == 1 { 0 } else { i };
        &self.data[r * s..(r + 1) * s]
    }
}

/// The op: context and, kept for the backward pass, the attention probabilities (B, H, T, S).
/// Without a gradient to compute (`rows`: inference), one query row at a time instead.
struct Mha {
    g: Geometry,
    bias: Bias,
    probs: Mutex<Vec<f32>>,
    rows: bool,
}

/// The (T|S, d_k) block of head h in batch row b of an input: rows `rows`, `cols` wide,
/// the block starting at column `off`.
fn head<'a>(
    data: &'a [f32],
    g: &Geometry,
    b: usize,
    h: usize,
    rows: usize,
    cols: usize,
    off: usize,
) -> &'a [f32] {
    &data[b * rows * cols + off + h * g.head_dim..]
}

/// Forward for batch row b: probabilities `p` (H, T, S) and context `ctx` (T, d).
fn forward_row(
    g: &Geometry,
    bias: &Bias,
    b: usize,
    q: &[f32],
    kv: &[f32],
    p: &mut [f32],
    ctx: &mut [f32],
) {
    let (t, s, dk, d) = (g.t, g.s, g.head_dim, g.d());
    let scale = (dk as f32).powf(-0.5);
    for h in 0..g.heads {
        let qh = Strided::rows(head(q, g, b, h, t, g.q_cols, g.q_off), g.q_cols);
        let kh = head(kv, g, b, h, s, g.kv_cols, g.k_off);
        let vh = Strided::rows(head(kv, g, b, h, s, g.kv_cols, g.v_off), g.kv_cols);
        let ph = &mut p[h * t * s..(h + 1) * t * s];
        // Scores q·kᵀ/√d_k (T, S), then the bias and a softmax per row.
        gemm_serial(
            (t, s, dk),
            ph,
            s,
            false,
            qh,
            Strided::transposed(kh, g.kv_cols),
            scale,
        );
        for (i, row) in ph.chunks_mut(s).enumerate() {
            let mut max = f32::NEG_INFINITY;
            for (x, bias) in row.iter_mut().zip(bias.row(b, i, s)) {
                *x += bias;
                max = max.max(*x);
            }
            let mut sum = 0f32;
            for x in row.iter_mut() {
                *x = fast_exp(*x - max);
                sum += *x;
            }
            let inv = 1.0 / sum;
            row.iter_mut().for_each(|x| *x *= inv);
        }
        let ph = Strided::rows(ph, s);
        gemm_serial((t, dk, s), &mut ctx[h * dk..], d, false, ph, vh, 1.0);
    }
}

/// Backward for batch row b: from the context gradient `dctx` (T, d) and probabilities `p`
/// (H, T, S), the gradients of batch row b of the inputs: `dq` (T, q_cols) and `dkv`
/// (S, kv_cols), or both in `dq` for self-attention (`dkv` none), in the columns the
/// forward pass read.
#[allow(clippy::too_many_arguments)]
fn backward_row(
    g: &Geometry,
    b: usize,
    q: &[f32],
    kv: &[f32],
    p: &[f32],
    dctx: &[f32],
    dq: &mut [f32],
    mut dkv: Option<&mut [f32]>,
) {
    let (t, s, hd, d) = (g.t, g.s, g.head_dim, g.d());
    let scale = (hd as f32).powf(-0.5);
    let mut ds = vec![0f32; t * s];
    for h in 0..g.heads {
        let qh = Strided::rows(head(q, g, b, h, t, g.q_cols, g.q_off), g.q_cols);
        let kh = head(kv, g, b, h, s, g.kv_cols, g.k_off);
        let vh = head(kv, g, b, h, s, g.kv_cols, g.v_off);
        let ph = &p[h * t * s..(h + 1) * t * s];
        let dch = Strided::rows(&dctx[h * hd..], d);
        // dP = dctx · vᵀ, then dS = P ⊙ (dP − Σⱼ P·dP) with the score scale folded in.
        let vt = Strided::transposed(vh, g.kv_cols);
        gemm_serial((t, s, hd), &mut ds, s, false, dch, vt, 1.0);
        for (dr, pr) in ds.chunks_mut(s).zip(ph.chunks(s)) {
            let r: f32 = dr.iter().zip(pr).map(|(a, b)| a * b).sum();
            dr.iter_mut()
                .zip(pr)
                .for_each(|(x, p)| *x = p * (*x - r) * scale);
        }
        let dsh = Strided::rows(&ds, s);
        let dst = Strided::transposed(&ds, s);
        let pt = Strided::transposed(ph, s);
        let k = Strided::rows(kh, g.kv_cols);
        let at = g.q_off + h * hd;
        gemm_serial((t, hd, s), &mut dq[at..], g.q_cols, false, dsh, k, 1.0);
        let dkv: &mut [f32] = match dkv.as_deref_mut() {
            Some(c) => c,
            None => &mut *dq,
        };
        let (k_at, v_at) = (g.k_off + h * hd, g.v_off + h * hd);
        gemm_serial((s, hd, t), &mut dkv[k_at..], g.kv_cols, false, dst, qh, 1.0);
        gemm_serial((s, hd, t), &mut dkv[v_at..], g.kv_cols, false, pt, dch, 1.0);
    }
}

impl Mha {
    /// `rows`: no gradient will be asked for.
    fn new(g: Geometry, bias: Option<&Tensor>, rows: bool) -> Result<Self> {
        Ok(Self {
            bias: Bias::new(bias, g.s)?,
            g,
            probs: Mutex::new(Vec::new()),
            rows,
        })
    }

    fn forward(&self, q: &[f32], kv: &[f32]) -> (CpuStorage, Shape) {
        let g = &self.g;
        let (t, s, d) = (g.t, g.s, g.d());
        if self.rows {
            return (
                CpuStorage::F32(self.forward_rows(q, kv)),
                Shape::from((g.batch, t, d)),
            );
        }
        let mut probs = zeros(g.batch * g.heads * t * s);
        let mut ctx = zeros(g.batch * t * d);
        probs
            .par_chunks_mut(g.heads * t * s)
            .zip(ctx.par_chunks_mut(t * d))
            .enumerate()
            .for_each(|(b, (p, c))| forward_row(g, &self.bias, b, q, kv, p, c));
        *self.probs.lock().unwrap_or_else(|e| e.into_inner()) = probs;
        (CpuStorage::F32(ctx), Shape::from((g.batch, t, d)))
    }

    /// The context, one (sentence, position, head) row at a time over its keys, as the
    /// decoding kernels attend: each row's result depends on its own sentence only, not on
    /// the batch's size and padding as a matrix product's blocking does, so a sentence
    /// translates alike in any batch (`translate`'s windows, `serve`'s merged requests).
    fn forward_rows(&self, q: &[f32], kv: &[f32]) -> Vec<f32> {
        let g = &self.g;
        let (t, s, dk) = (g.t, g.s, g.head_dim);
        let scale = (dk as f32).powf(-0.5);
        let mut ctx = zeros(g.batch * t * g.d());
        ctx.par_chunks_mut(dk).enumerate().for_each(|(r, o)| {
            let (b, i, h) = (r / (t * g.heads), (r / g.heads) % t, r % g.heads);
            let qr: Vec<f32> = head(q, g, b, h, t, g.q_cols, g.q_off)[i * g.q_cols..][..dk]
                .iter()
                .map(|x| x * scale)
                .collect();
            let keys = head(kv, g, b, h, s, g.kv_cols, g.k_off);
            let values = head(kv, g, b, h, s, g.kv_cols, g.v_off);
            wide(
                #[inline(always)]
                || {
                    attend_row(
                        &qr,
                        s,
                        |j| &keys[j * g.kv_cols..][..dk],
                        |j| &values[j * g.kv_cols..][..dk],
                        Some(self.bias.row(b, i, s)),
                        o,
                    )
                },
            );
        });
        ctx
    }

    /// Gradients for the query input and the key/value input, laid out as those inputs
    /// (zero in the columns the op does not read); one buffer when they are the same tensor.
    fn backward(&self, q: &Tensor, kv: Option<&Tensor>, dctx: &Tensor) -> Result<Vec<Tensor>> {
        let g = &self.g;
        let (t, s, d) = (g.t, g.s, g.d());
        let probs = self.probs.lock().unwrap_or_else(|e| e.into_inner());
        let kv_t = kv.unwrap_or(q);
        let mut dq = zeros(g.batch * t * g.q_cols);
        let mut dkv = zeros(if kv.is_some() {
            g.batch * s * g.kv_cols
        } else {
            0
        });
        with_host_f32(q, |qd| {
            with_host_f32(kv_t, |kvd| {
                with_host_f32(dctx, |dc| {
                    let row = |b: usize, dq: &mut [f32], dkv: Option<&mut [f32]>| {
                        let p = &probs[b * g.heads * t * s..(b + 1) * g.heads * t * s];
                        let dc = &dc[b * t * d..(b + 1) * t * d];
                        backward_row(g, b, qd, kvd, p, dc, dq, dkv);
                    };
                    let dq = dq.par_chunks_mut(t * g.q_cols).enumerate();
                    if kv.is_some() {
                        dq.zip(dkv.par_chunks_mut(s * g.kv_cols))
                            .for_each(|((b, dq), dkv)| row(b, dq, Some(dkv)));
                    } else {
                        dq.for_each(|(b, dq)| row(b, dq, None));
                    }
                })
            })
        })???;
        let dev = q.device();
        let mut grads = vec![Tensor::from_vec(dq, (g.batch, t, g.q_cols), dev)?];
        if kv.is_some() {
            grads.push(Tensor::from_vec(dkv, (g.batch, s, g.kv_cols), dev)?);
        }
        Ok(grads)
    }
}

/// Self-attention: q, k and v side by side in one input.
struct SelfAttention(Mha);

/// Cross-attention: queries in one input, keys and values side by side in another.
struct CrossAttention(Mha);

impl CustomOp1 for SelfAttention {
    fn name(&self) -> &'static str {
        "nmt-self-attention"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let qkv = slice(s1, l1)?;
        Ok(self.0.forward(qkv, qkv))
    }

    fn bwd(
        &self,
        qkv: &Tensor,
        _res: &Tensor,
        dctx: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        let mut g = self.0.backward(qkv, None, dctx).map_err(wrap)?;
        Ok(g.pop())
    }
}

impl CustomOp2 for CrossAttention {
    fn name(&self) -> &'static str {
        "nmt-cross-attention"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        Ok(self.0.forward(slice(s1, l1)?, slice(s2, l2)?))
    }

    fn bwd(
        &self,
        q: &Tensor,
        kv: &Tensor,
        _res: &Tensor,
        dctx: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let mut g = self.0.backward(q, Some(kv), dctx).map_err(wrap)?;
        let dkv = g.pop();
        Ok((g.pop(), dkv))
    }
}

fn wrap(e: anyhow::Error) -> candle_core::Error {
    candle_core::Error::Msg(format!("{e:#}"))
}

/// softmax(q·kᵀ/√d_k + bias)·v over `heads` heads, with q, k and v the three (d)-wide column
/// blocks of `qkv` (B, T, 3d), and `bias` (B|1, 1, T|1, T) additive; with `dropout` (training)
/// the probabilities are dropped before they weight the values. Returns (B, T, d). One fused
/// op on the CPU in f32 without dropout; elsewhere Candle's primitives.
pub fn self_attention(
    qkv: &Tensor,
    heads: usize,
    bias: Option<&Tensor>,
    dropout: Option<DropoutMask>,
) -> Result<Tensor> {
    let (batch, t, cols) = qkv.dims3()?;
    let d = cols / 3;
    if dropout.is_some() || !fused(qkv) {
        let part = |i: usize| qkv.narrow(2, i * d, d);
        return composite(&part(0)?, &part(1)?, &part(2)?, heads, bias, dropout);
    }
    let g = Geometry {
        batch,
        t,
        s: t,
        heads,
        head_dim: d / heads,
        q_cols: cols,
        kv_cols: cols,
        q_off: 0,
        k_off: d,
        v_off: 2 * d,
    };
    let op = SelfAttention(Mha::new(g, bias, !qkv.track_op())?);
    Ok(qkv.contiguous()?.apply_op1(op)?)
}

/// Attention of queries `q` (B, T, d) over keys and values, the two (d)-wide column blocks of
/// `kv` (B, S, 2d), with `bias` (B|1, 1, T|1, S) additive and `dropout` as in
/// [`self_attention`]. Returns (B, T, d).
pub fn cross_attention(
    q: &Tensor,
    kv: &Tensor,
    heads: usize,
    bias: Option<&Tensor>,
    dropout: Option<DropoutMask>,
) -> Result<Tensor> {
    let (batch, t, d) = q.dims3()?;
    let s = kv.dim(1)?;
    if dropout.is_some() || !fused(q) {
        let part = |i: usize| kv.narrow(2, i * d, d);
        return composite(q, &part(0)?, &part(1)?, heads, bias, dropout);
    }
    let g = Geometry {
        batch,
        t,
        s,
        heads,
        head_dim: d / heads,
        q_cols: d,
        kv_cols: 2 * d,
        q_off: 0,
        k_off: 0,
        v_off: d,
    };
    let op = CrossAttention(Mha::new(g, bias, !(q.track_op() || kv.track_op()))?);
    Ok(q.contiguous()?.apply_op2(&kv.contiguous()?, op)?)
}

/// The Candle composite of multi-head attention, for any device and dtype, and the oracle of
/// the fused kernels: queries `q` (B, T, d) unscaled, keys and values (B, S, d) → (B, T, d).
fn composite(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    heads: usize,
    bias: Option<&Tensor>,
    dropout: Option<DropoutMask>,
) -> Result<Tensor> {
    let (b, t, d) = q.dims3()?;
    let s = k.dim(1)?;
    let split = |x: &Tensor, n: usize| -> Result<Tensor> {
        Ok(x.reshape((b, n, heads, d / heads))?
            .transpose(1, 2)?
            .contiguous()?)
    };
    let q = split(&(q * ((d / heads) as f64).powf(-0.5))?, t)?;
    let ctx = heads_composite(&q, &split(k, s)?, &split(v, s)?, bias, dropout)?;
    Ok(ctx.transpose(1, 2)?.reshape((b, t, d))?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::tests::max_diff;
    use candle_core::{Device, Var, D};

    /// The same attention from Candle's primitives: (B, T, d) inputs.
    fn composite(q: &Tensor, k: &Tensor, v: &Tensor, heads: usize, bias: &Tensor) -> Tensor {
        let split = |x: &Tensor| {
            let (b, t, d) = x.dims3().unwrap();
            x.reshape((b, t, heads, d / heads))
                .unwrap()
                .transpose(1, 2)
                .unwrap()
                .contiguous()
                .unwrap()
        };
        let dk = q.dim(2).unwrap() / heads;
        let scores = (split(q).matmul(&split(k).t().unwrap()).unwrap() * (dk as f64).powf(-0.5))
            .unwrap()
            .broadcast_add(bias)
            .unwrap();
        let p = candle_nn::ops::softmax(&scores, D::Minus1).unwrap();
        let ctx = p.matmul(&split(v)).unwrap();
        let (b, _, t, _) = ctx.dims4().unwrap();
        ctx.transpose(1, 2).unwrap().reshape((b, t, ())).unwrap()
    }

    fn close(a: &Tensor, b: &Tensor) {
        let diff = max_diff(a, b);
        assert!(diff < 1e-4, "max difference {diff}");
    }

    #[test]
    fn self_attention_matches_the_composite_and_its_gradient() {
        let dev = Device::Cpu;
        let (b, t, d, heads) = (3, 5, 8, 2);
        let qkv = Var::from_tensor(&Tensor::randn(0f32, 1., (b, t, 3 * d), &dev).unwrap()).unwrap();
        // Causal and a padded last key in row 1.
        let mut bias = vec![0f32; b * t * t];
        for r in 0..b {
            for i in 0..t {
                for j in 0..t {
                    if j > i || (r == 1 && j == t - 1) {
                        bias[(r * t + i) * t + j] = -1e9;
                    }
                }
            }
        }
        let bias = Tensor::from_vec(bias, (b, 1, t, t), &dev).unwrap();
        let w = Tensor::randn(0f32, 1., (b, t, d), &dev).unwrap();
        let fused = self_attention(qkv.as_tensor(), heads, Some(&bias), None).unwrap();
        let part = |i: usize| qkv.as_tensor().narrow(2, i * d, d).unwrap();
        let plain = composite(&part(0), &part(1), &part(2), heads, &bias);
        close(&fused, &plain);
        // Other dtypes (and devices) take the op's own composite path: the same values.
        let f64s = |t: &Tensor| t.to_dtype(candle_core::DType::F64).unwrap();
        let general = self_attention(&f64s(qkv.as_tensor()), heads, Some(&f64s(&bias)), None);
        close(
            &general.unwrap().to_dtype(candle_core::DType::F32).unwrap(),
            &plain,
        );
        let grad = |y: &Tensor| {
            (y * &w)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap()
                .get(qkv.as_tensor())
                .unwrap()
                .clone()
        };
        close(&grad(&fused), &grad(&plain));
    }

    /// Without a gradient (translation), a sentence's attention is the same, bit for bit, alone
    /// or padded in a batch: its translation does not depend on what it is batched with.
    #[test]
    fn inference_attention_does_not_depend_on_the_batch() {
        let dev = Device::Cpu;
        let (t, pad, heads, d) = (12, 30, 2, 128);
        let alone = Tensor::randn(0f32, 1., (1, t, 3 * d), &dev).unwrap();
        let rest = Tensor::randn(0f32, 1., (1, pad - t, 3 * d), &dev).unwrap();
        let other = Tensor::randn(0f32, 1., (1, pad, 3 * d), &dev).unwrap();
        let batch = Tensor::cat(&[&Tensor::cat(&[&alone, &rest], 1).unwrap(), &other], 0).unwrap();
        let keys = |n: usize, width: usize| -> Vec<f32> {
            (0..width).map(|j| if j < n { 0.0 } else { -1e9 }).collect()
        };
        let bias_alone = Tensor::from_vec(keys(t, t), (1, 1, 1, t), &dev).unwrap();
        let bias_batch = Tensor::from_vec(
            [keys(t, pad), keys(pad, pad)].concat(),
            (2, 1, 1, pad),
            &dev,
        )
        .unwrap();
        let one = self_attention(&alone, heads, Some(&bias_alone), None).unwrap();
        let both = self_attention(&batch, heads, Some(&bias_batch), None).unwrap();
        let bits = |x: &Tensor| -> Vec<u32> {
            let v: Vec<f32> = x.flatten_all().unwrap().to_vec1().unwrap();
            v.iter().map(|f| f.to_bits()).collect()
        };
        assert_eq!(
            bits(&one),
            bits(&both.narrow(0, 0, 1).unwrap().narrow(1, 0, t).unwrap())
        );
    }

    #[test]
    fn cross_attention_matches_the_composite_and_its_gradient() {
        let dev = Device::Cpu;
        let (b, t, s, d, heads) = (2, 4, 6, 8, 4);
        let q = Var::from_tensor(&Tensor::randn(0f32, 1., (b, t, d), &dev).unwrap()).unwrap();
        let kv = Var::from_tensor(&Tensor::randn(0f32, 1., (b, s, 2 * d), &dev).unwrap()).unwrap();
        let bias = Tensor::from_vec(
            (0..b * s)
                .map(|i| if i == 5 || i == 10 { -1e9f32 } else { 0.0 })
                .collect::<Vec<_>>(),
            (b, 1, 1, s),
            &dev,
        )
        .unwrap();
        let w = Tensor::randn(0f32, 1., (b, t, d), &dev).unwrap();
        let fused =
            cross_attention(q.as_tensor(), kv.as_tensor(), heads, Some(&bias), None).unwrap();
        let part = |i: usize| kv.as_tensor().narrow(2, i * d, d).unwrap();
        let plain = composite(q.as_tensor(), &part(0), &part(1), heads, &bias);
        close(&fused, &plain);
        let f64s = |t: &Tensor| t.to_dtype(candle_core::DType::F64).unwrap();
        let general = cross_attention(
            &f64s(q.as_tensor()),
            &f64s(kv.as_tensor()),
            heads,
            Some(&f64s(&bias)),
            None,
        );
        close(
            &general.unwrap().to_dtype(candle_core::DType::F32).unwrap(),
            &plain,
        );
        let grads = |y: &Tensor| {
            let g = (y * &w).unwrap().sum_all().unwrap().backward().unwrap();
            (
                g.get(q.as_tensor()).unwrap().clone(),
                g.get(kv.as_tensor()).unwrap().clone(),
            )
        };
        let (a, b) = (grads(&fused), grads(&plain));
        close(&a.0, &b.0);
        close(&a.1, &b.1);
    }
}
