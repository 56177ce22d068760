//! THE model definition, shared by training and decoding, CPU and CUDA: the encoder–decoder
//! Transformer of "Attention Is All You Need" laid out exactly as HF's MarianMT (tied
//! embeddings scaled by √d, sinusoidal positions with sin in the first half and cos in the
//! second, `final_logits_bias`, post-norm residual blocks). Batching, losses and search live
//! elsewhere; this module only maps token ids to hidden states and logits.

pub mod attention;
pub mod cache;
pub mod config;
pub mod weights;

use crate::ops;
use crate::ops::packed::ComputeType;
use crate::rng::Rng;
use anyhow::Result;
pub use attention::Attention;
pub use cache::{DecoderCache, LayerCache};
use candle_core::{DType, Device, Tensor};
pub use config::{Activation, ModelConfig};
use std::cell::RefCell;
use weights::{Init, Weights};

/// LayerNorm epsilon (PyTorch's default, as transformers uses).
const LN_EPS: f64 = 1e-5;
/// Added to attention scores of hidden keys: large and finite so a row never becomes NaN.
const MASK_VALUE: f64 = -1e9;

/// [`MASK_VALUE`] in a dtype that holds it; f16 (largest magnitude 65,504) gets its most
/// negative finite value instead, as transformers masks with `finfo(dtype).min`: −1e9 would
/// round to −∞ there, and the padding mask's 0 · −∞ is NaN.
pub fn mask_value(dtype: DType) -> f64 {
    match dtype {
        DType::F16 => -65504.0,
        _ => MASK_VALUE,
    }
}

/// Dropout with masks drawn from our own generator, seeded per step (so training and its
/// resumption are reproducible bit for bit). A CUDA GPU computes the same masks in its kernels,
/// from the generator's state: GPU and CPU runs drop the same elements.
pub struct Dropout {
    rng: Option<RefCell<Rng>>,
}

impl Dropout {
    /// No dropout (evaluation, decoding).
    pub fn off() -> Self {
        Self { rng: None }
    }

    /// Dropout driven by `seed`.
    pub fn on(seed: u64) -> Self {
        Self {
            rng: Some(RefCell::new(Rng::new(seed))),
        }
    }

    /// Whether dropout is active (training).
    pub fn is_on(&self) -> bool {
        self.rng.is_some()
    }

    /// The mask for the next `n` elements (advancing the stream past them), or `None` where
    /// nothing is dropped.
    fn mask(&self, n: usize, p: f64) -> Option<ops::DropoutMask> {
        let rng = self.rng.as_ref().filter(|_| p > 0.0)?;
        let mut rng = rng.borrow_mut();
        let mask = ops::DropoutMask {
            rng: *rng,
            threshold: (p * (1u64 << 32) as f64) as u64,
            keep: 1.0 / (1.0 - p) as f32,
        };
        rng.skip(n.div_ceil(2) as u64);
        Some(mask)
    }

    /// Zeroes each element with probability `p` and scales the rest by 1/(1-p).
    pub fn apply(&self, x: &Tensor, p: f64) -> Result<Tensor> {
        match self.mask(x.elem_count(), p) {
            Some(mask) => Ok(ops::dropout(x, mask)?),
            None => Ok(x.clone()),
        }
    }

    /// x + dropout(f): a residual connection.
    pub fn add(&self, x: &Tensor, f: &Tensor, p: f64) -> Result<Tensor> {
        Ok(ops::add_dropout(x, f, self.mask(f.elem_count(), p))?)
    }
}

/// y = x Wᵀ + b, with W of shape (out, in) as in PyTorch.
pub struct Linear(Repr);

enum Repr {
    /// The weight and bias of the general product: trainable layers, and loaded ones that no
    /// CPU kernel takes (another device or dtype).
    Plain { weight: Tensor, bias: Tensor },
    /// A loaded layer packed for the inference kernel of the model's compute type when the
    /// model loads; the packed copy is the only one kept.
    Packed(Box<ops::packed::PackedLinear>),
}

impl Linear {
    fn new(w: &Weights, name: &str, d_in: usize, d_out: usize) -> Result<Self> {
        let (weight, bias) = Self::parameters(w, name, d_in, d_out)?;
        Self::from_tensors(weight, bias, w.packing())
    }

    /// The weight (out, in) and bias of layer `name` in `w`.
    fn parameters(w: &Weights, name: &str, d_in: usize, d_out: usize) -> Result<(Tensor, Tensor)> {
        Ok((
            w.get(
                &format!("{name}.weight"),
                &[d_out, d_in],
                Init::XavierUniform,
            )?,
            w.get(&format!("{name}.bias"), &[d_out], Init::Zeros)?,
        ))
    }

    /// `packing`: how a loaded layer computes, packed here where its kernel runs; `None` for
    /// trainable weights.
    fn from_tensors(weight: Tensor, bias: Tensor, packing: Option<ComputeType>) -> Result<Self> {
        if let Some(compute) = packing {
            if let Some(packed) = ops::packed::PackedLinear::new(compute, &weight, &bias)? {
                return Ok(Self(Repr::Packed(Box::new(packed))));
            }
        }
        Ok(Self(Repr::Plain { weight, bias }))
    }

    /// The layers side by side applied to `x`, their outputs concatenated along the last
    /// dimension: one product of the stacked weights where all are plain (differentiable:
    /// gradients flow back to each layer's own weights), else one product per layer.
    fn forward_stacked(layers: &[&Linear], x: &Tensor) -> Result<Tensor> {
        let plain: Option<(Vec<&Tensor>, Vec<&Tensor>)> = layers
            .iter()
            .map(|l| match &l.0 {
                Repr::Plain { weight, bias } => Some((weight, bias)),
                Repr::Packed(_) => None,
            })
            .collect();
        match plain {
            Some((weights, biases)) => Ok(ops::linear(
                x,
                &Tensor::cat(&weights, 0)?,
                &Tensor::cat(&biases, 0)?,
                false,
            )?),
            None => {
                let ys = layers
                    .iter()
                    .map(|l| l.forward(x))
                    .collect::<Result<Vec<_>>>()?;
                Ok(Tensor::cat(&ys, candle_core::D::Minus1)?)
            }
        }
    }

    /// Whether the layer is packed for a CPU kernel.
    fn is_packed(&self) -> bool {
        matches!(self.0, Repr::Packed(_))
    }

    /// Applies the layer to (..., in).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_act(x, false)
    }

    /// Applies the layer, then ReLU when `relu` (fused on the CPU).
    pub fn forward_act(&self, x: &Tensor, relu: bool) -> Result<Tensor> {
        match &self.0 {
            Repr::Packed(packed) => Ok(packed.forward(x, relu)?),
            Repr::Plain { weight, bias } => Ok(ops::linear(x, weight, bias, relu)?),
        }
    }
}

/// LayerNorm over the last dimension, built from differentiable primitives.
pub struct LayerNorm {
    weight: Tensor,
    bias: Tensor,
}

impl LayerNorm {
    fn new(w: &Weights, name: &str, d: usize) -> Result<Self> {
        Ok(Self {
            weight: w.get(&format!("{name}.weight"), &[d], Init::Ones)?,
            bias: w.get(&format!("{name}.bias"), &[d], Init::Zeros)?,
        })
    }

    /// Normalises (..., d).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(ops::layer_norm(x, &self.weight, &self.bias, LN_EPS)?)
    }
}

struct FeedForward {
    fc1: Linear,
    fc2: Linear,
    activation: Activation,
}

impl FeedForward {
    fn forward(&self, x: &Tensor, p_act: f64, drop: &Dropout) -> Result<Tensor> {
        let h = match self.activation {
            Activation::Relu => self.fc1.forward_act(x, true)?,
            Activation::Gelu => self.fc1.forward(x)?.gelu_erf()?,
            Activation::Swish => candle_nn::ops::silu(&self.fc1.forward(x)?)?,
        };
        self.fc2.forward(&drop.apply(&h, p_act)?)
    }
}

/// Residual + LayerNorm around a sub-layer, post-norm (Marian) or pre-norm.
fn residual(
    x: &Tensor,
    ln: &LayerNorm,
    pre_norm: bool,
    p: f64,
    drop: &Dropout,
    f: impl FnOnce(&Tensor) -> Result<Tensor>,
) -> Result<Tensor> {
    if pre_norm {
        return drop.add(x, &f(&ln.forward(x)?)?, p);
    }
    let y = f(x)?;
    let mask = drop.mask(y.elem_count(), p);
    Ok(ops::residual_norm(
        x, &y, &ln.weight, &ln.bias, LN_EPS, mask,
    )?)
}

struct EncoderLayer {
    self_attn: Attention,
    self_attn_layer_norm: LayerNorm,
    ffn: FeedForward,
    final_layer_norm: LayerNorm,
}

struct DecoderLayer {
    self_attn: Attention,
    self_attn_layer_norm: LayerNorm,
    encoder_attn: Attention,
    encoder_attn_layer_norm: LayerNorm,
    ffn: FeedForward,
    final_layer_norm: LayerNorm,
}

/// The encoder–decoder Transformer.
pub struct Seq2Seq {
    /// Its configuration.
    pub config: ModelConfig,
    shared: Tensor,
    final_logits_bias: Tensor,
    /// The tied output projection as a linear layer: `shared` and `final_logits_bias`.
    output: Linear,
    positions: Tensor,
    encoder_layers: Vec<EncoderLayer>,
    decoder_layers: Vec<DecoderLayer>,
    encoder_norm: Option<LayerNorm>,
    decoder_norm: Option<LayerNorm>,
    embed_scale: f64,
    device: Device,
}

/// Marian's sinusoidal table: (positions, d), sin(pos/10000^(2i/d)) in the first half, cos
/// in the second.
pub fn sinusoidal_positions(n_pos: usize, d: usize, device: &Device) -> Result<Tensor> {
    let sentinel = d.div_ceil(2);
    let mut table = vec![0f32; n_pos * d];
    for pos in 0..n_pos {
        for j in 0..d {
            // Column j of the "position_enc" matrix uses exponent 2*(j/2)/d.
            let angle = pos as f64 / 10000f64.powf(2.0 * (j / 2) as f64 / d as f64);
            let (col, value) = if j % 2 == 0 {
                (j / 2, angle.sin())
            } else {
                (sentinel + j / 2, angle.cos())
            };
            table[pos * d + col] = value as f32;
        }
    }
    Ok(Tensor::from_vec(table, (n_pos, d), device)?)
}

impl Seq2Seq {
    /// Builds the model from `w`; tensor names are transformers' MarianMTModel names.
    pub fn new(config: &ModelConfig, w: &Weights) -> Result<Self> {
        config.validate()?;
        let d = config.d_model;
        let act = config.activation()?;
        let shared = w.get(
            "model.shared.weight",
            &[config.vocab_size, d],
            Init::Normal {
                std: (d as f64).powf(-0.5),
                zero_row: Some(config.pad_token_id as usize),
            },
        )?;
        let ffn = |p: &str, dim: usize| -> Result<FeedForward> {
            Ok(FeedForward {
                fc1: Linear::new(w, &format!("{p}.fc1"), d, dim)?,
                fc2: Linear::new(w, &format!("{p}.fc2"), dim, d)?,
                activation: act,
            })
        };
        let encoder_layers = (0..config.encoder_layers)
            .map(|i| {
                let p = format!("model.encoder.layers.{i}");
                Ok(EncoderLayer {
                    self_attn: Attention::new(
                        w,
                        &format!("{p}.self_attn"),
                        d,
                        config.encoder_attention_heads,
                        Some(match w.compute() {
                            // Quantized to int8, these projections cost the demo model 0.4
                            // BLEU in greedy search and took the lines equal to float32's
                            // below 90 %; bfloat16 keeps them, at twice f32's speed.
                            ComputeType::Int8 => ComputeType::Bf16,
                            compute => compute,
                        }),
                    )?,
                    self_attn_layer_norm: LayerNorm::new(
                        w,
                        &format!("{p}.self_attn_layer_norm"),
                        d,
                    )?,
                    ffn: ffn(&p, config.encoder_ffn_dim)?,
                    final_layer_norm: LayerNorm::new(w, &format!("{p}.final_layer_norm"), d)?,
                })
            })
            .collect::<Result<_>>()?;
        let decoder_layers = (0..config.decoder_layers)
            .map(|i| {
                let p = format!("model.decoder.layers.{i}");
                Ok(DecoderLayer {
                    self_attn: Attention::new(
                        w,
                        &format!("{p}.self_attn"),
                        d,
                        config.decoder_attention_heads,
                        Some(w.compute()),
                    )?,
                    self_attn_layer_norm: LayerNorm::new(
                        w,
                        &format!("{p}.self_attn_layer_norm"),
                        d,
                    )?,
                    encoder_attn: Attention::new(
                        w,
                        &format!("{p}.encoder_attn"),
                        d,
                        config.decoder_attention_heads,
                        None,
                    )?,
                    encoder_attn_layer_norm: LayerNorm::new(
                        w,
                        &format!("{p}.encoder_attn_layer_norm"),
                        d,
                    )?,
                    ffn: ffn(&p, config.decoder_ffn_dim)?,
                    final_layer_norm: LayerNorm::new(w, &format!("{p}.final_layer_norm"), d)?,
                })
            })
            .collect::<Result<_>>()?;
        let (encoder_norm, decoder_norm) = if config.normalize_before {
            (
                Some(LayerNorm::new(w, "model.encoder.layer_norm", d)?),
                Some(LayerNorm::new(w, "model.decoder.layer_norm", d)?),
            )
        } else {
            (None, None)
        };
        let final_logits_bias = w.buffer("final_logits_bias", &[1, config.vocab_size])?;
        Ok(Self {
            config: config.clone(),
            output: Linear::from_tensors(
                shared.clone(),
                final_logits_bias.flatten_all()?,
                w.packing(),
            )?,
            final_logits_bias,
            positions: sinusoidal_positions(config.max_position_embeddings, d, w.device())?
                .to_dtype(shared.dtype())?,
            shared,
            encoder_layers,
            decoder_layers,
            encoder_norm,
            decoder_norm,
            embed_scale: if config.scale_embedding {
                (d as f64).sqrt()
            } else {
                1.0
            },
            device: w.device().clone(),
        })
    }

    /// The device the model lives on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The dtype of its weights.
    pub fn dtype(&self) -> DType {
        self.shared.dtype()
    }

    /// Whether decodings started apart can join one search ([`DecoderCache::join`]): where
    /// the step kernels run (the CPU, in f32), as [`Self::start_decoding`] lays them out.
    pub fn decodings_join(&self) -> bool {
        ops::step_attention::step_kernels(&self.shared)
    }

    /// Scaled token embeddings plus positions `offset..offset+T`: (B, T) ids → (B, T, d).
    fn embed(&self, ids: &Tensor, offset: usize, drop: &Dropout) -> Result<Tensor> {
        let (b, t) = ids.dims2()?;
        let positions = self.config.max_position_embeddings;
        if offset + t > positions {
            anyhow::bail!(
                "a sequence of {} positions is longer than the model's {positions} (max_position_embeddings)",
                offset + t
            );
        }
        let pos = self.positions.narrow(0, offset, t)?;
        let mask = drop.mask(b * t * self.config.d_model, self.config.dropout);
        Ok(ops::embed(&self.shared, ids, &pos, self.embed_scale, mask)?)
    }

    /// Scaled token embeddings of the next tokens (B, 1), row b at target position
    /// `positions[b]` → (B, 1, d) (decoding).
    fn embed_at(&self, ids: &Tensor, positions: &[usize]) -> Result<Tensor> {
        let b = ids.dim(0)?;
        let at: Vec<u32> = positions.iter().map(|&p| p as u32).collect();
        let pos = self
            .positions
            .index_select(&Tensor::new(at.as_slice(), &self.device)?, 0)?;
        // One row of b steps, each at its own position.
        let ids = ids.reshape((1, b))?;
        let h = ops::embed(&self.shared, &ids, &pos, self.embed_scale, None)?;
        Ok(h.reshape((b, 1, self.config.d_model))?)
    }

    /// Additive key-padding mask (B, 1, 1, S) from ids: [`mask_value`] where the id is `<pad>`.
    pub fn padding_bias(&self, ids: &Tensor) -> Result<Tensor> {
        let (b, s) = ids.dims2()?;
        let is_pad = ids.eq(self.config.pad_token_id)?.to_dtype(self.dtype())?;
        Ok((is_pad * mask_value(self.dtype()))?.reshape((b, 1, 1, s))?)
    }

    /// Additive key-padding mask (B, 1, 1, T) from sequence lengths: positions ≥ length hidden.
    /// Used for targets, whose first token (Marian's start token) is the pad id itself.
    pub fn length_bias(&self, lengths: &[usize], t: usize) -> Result<Tensor> {
        let hidden = mask_value(self.dtype()) as f32;
        let data: Vec<f32> = lengths
            .iter()
            .flat_map(|&len| (0..t).map(move |i| if i < len { 0.0 } else { hidden }))
            .collect();
        Ok(
            Tensor::from_vec(data, (lengths.len(), 1, 1, t), &self.device)?
                .to_dtype(self.dtype())?,
        )
    }

    /// Causal mask (1, 1, T, T): position t sees positions ≤ t.
    pub fn causal_bias(&self, t: usize) -> Result<Tensor> {
        let hidden = mask_value(self.dtype()) as f32;
        let data: Vec<f32> = (0..t * t)
            .map(|i| if i % t > i / t { hidden } else { 0.0 })
            .collect();
        Ok(Tensor::from_vec(data, (1, 1, t, t), &self.device)?.to_dtype(self.dtype())?)
    }

    /// Encodes source ids (B, S) with key-padding bias (B, 1, 1, S) → (B, S, d).
    pub fn encode(&self, src: &Tensor, src_bias: &Tensor, drop: &Dropout) -> Result<Tensor> {
        let c = &self.config;
        let mut h = self.embed(src, 0, drop)?;
        for l in &self.encoder_layers {
            h = residual(
                &h,
                &l.self_attn_layer_norm,
                c.normalize_before,
                c.dropout,
                drop,
                |x| {
                    l.self_attn
                        .self_attend(x, src_bias, c.attention_dropout, drop)
                },
            )?;
            h = residual(
                &h,
                &l.final_layer_norm,
                c.normalize_before,
                c.dropout,
                drop,
                |x| l.ffn.forward(x, c.activation_dropout, drop),
            )?;
        }
        match &self.encoder_norm {
            Some(ln) => ln.forward(&h),
            None => Ok(h),
        }
    }

    /// Teacher-forced decoder: inputs (B, T), self-attention bias (B|1, 1, T, T), encoder output
    /// (B, S, d) and its bias → hidden states (B, T, d).
    pub fn decode(
        &self,
        tgt_in: &Tensor,
        tgt_bias: &Tensor,
        memory: &Tensor,
        src_bias: &Tensor,
        drop: &Dropout,
    ) -> Result<Tensor> {
        Ok(self
            .decode_attending(tgt_in, tgt_bias, memory, src_bias, drop, None)?
            .0)
    }

    /// [`Seq2Seq::decode`], also returning the cross-attention probabilities (B, H, T, S) of
    /// decoder layer `layer` (0-based) when one is named.
    pub fn decode_attending(
        &self,
        tgt_in: &Tensor,
        tgt_bias: &Tensor,
        memory: &Tensor,
        src_bias: &Tensor,
        drop: &Dropout,
        layer: Option<usize>,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let c = &self.config;
        let mut h = self.embed(tgt_in, 0, drop)?;
        let mut attention = None;
        for (i, l) in self.decoder_layers.iter().enumerate() {
            h = residual(
                &h,
                &l.self_attn_layer_norm,
                c.normalize_before,
                c.dropout,
                drop,
                |x| {
                    l.self_attn
                        .self_attend(x, tgt_bias, c.attention_dropout, drop)
                },
            )?;
            h = residual(
                &h,
                &l.encoder_attn_layer_norm,
                c.normalize_before,
                c.dropout,
                drop,
                |x| {
                    if layer == Some(i) {
                        attention = Some(l.encoder_attn.probabilities(x, memory, src_bias)?);
                    }
                    l.encoder_attn
                        .cross_attend(x, memory, src_bias, c.attention_dropout, drop)
                },
            )?;
            h = residual(
                &h,
                &l.final_layer_norm,
                c.normalize_before,
                c.dropout,
                drop,
                |x| l.ffn.forward(x, c.activation_dropout, drop),
            )?;
        }
        let h = match &self.decoder_norm {
            Some(ln) => ln.forward(&h)?,
            None => h,
        };
        Ok((h, attention))
    }

    /// Output logits for hidden states (N, d) → (N, V): tied projection plus final_logits_bias.
    pub fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        self.output.forward(hidden)
    }

    /// The tied output projection's weight (V, d) and bias (1, V): logits = hidden Wᵀ + bias.
    pub fn output_projection(&self) -> (&Tensor, &Tensor) {
        (&self.shared, &self.final_logits_bias)
    }

    /// Full teacher-forced forward pass to logits (B, T, V), for tests and parity checks.
    pub fn forward(&self, src: &Tensor, tgt_in: &Tensor) -> Result<Tensor> {
        let drop = Dropout::off();
        let src_bias = self.padding_bias(src)?;
        let memory = self.encode(src, &src_bias, &drop)?;
        let tgt_bias = self.target_bias(tgt_in)?;
        let h = self.decode(tgt_in, &tgt_bias, &memory, &src_bias, &drop)?;
        let (b, t, d) = h.dims3()?;
        Ok(self.logits(&h.reshape((b * t, d))?)?.reshape((b, t, ()))?)
    }

    /// The cross-attention probabilities (B, H, T, S) of decoder layer `layer` for sources
    /// (B, S) and teacher-forced target inputs (B, T): what the decoder attended to while
    /// predicting each target token, as during search.
    pub fn cross_attention(&self, src: &Tensor, tgt_in: &Tensor, layer: usize) -> Result<Tensor> {
        let drop = Dropout::off();
        let src_bias = self.padding_bias(src)?;
        let memory = self.encode(src, &src_bias, &drop)?;
        let tgt_bias = self.target_bias(tgt_in)?;
        let (_, attention) =
            self.decode_attending(tgt_in, &tgt_bias, &memory, &src_bias, &drop, Some(layer))?;
        attention.ok_or_else(|| {
            anyhow::anyhow!(
                "decoder layer {layer} does not exist: the model has {}",
                self.decoder_layers.len()
            )
        })
    }

    /// Causal and length mask (B, 1, T, T) of right-padded target inputs (B, T), whose
    /// length is one past the last non-pad id (the start token is the pad id itself).
    fn target_bias(&self, tgt_in: &Tensor) -> Result<Tensor> {
        let t = tgt_in.dim(1)?;
        let pad = self.config.pad_token_id;
        let lengths: Vec<usize> = tgt_in
            .to_vec2::<u32>()?
            .iter()
            .map(|row| row.iter().rposition(|&id| id != pad).map_or(1, |i| i + 1))
            .collect();
        Ok(self
            .causal_bias(t)?
            .broadcast_add(&self.length_bias(&lengths, t)?)?)
    }

    /// Starts incremental decoding of `beams` hypotheses per source sentence, batch rows
    /// sentence-major (sentence i owns rows i·beams..(i+1)·beams): cross-attention keys/values
    /// computed once per sentence from `memory` (N, S, d), with its padding bias (N, 1, 1, S).
    pub fn start_decoding(
        &self,
        memory: &Tensor,
        src_bias: &Tensor,
        beams: usize,
    ) -> Result<DecoderCache> {
        let n = memory.dim(0)?;
        let beams = beams.max(1);
        let sentences: Vec<(u32, u32)> = (0..n as u32)
            .flat_map(|i| std::iter::repeat_n((0, i), beams))
            .collect();
        // The CPU kernel reads each sentence's keys for all its beams; elsewhere the rows are
        // laid out per hypothesis.
        let shared_cross = ops::step_attention::step_kernels(memory);
        let expand = |t: Tensor| -> Result<Tensor> {
            if shared_cross || beams == 1 {
                return Ok(t);
            }
            let rows: Vec<u32> = sentences.iter().map(|&(_, i)| i).collect();
            Ok(t.index_select(&Tensor::new(rows.as_slice(), t.device())?, 0)?)
        };
        let layers = self
            .decoder_layers
            .iter()
            .map(|l| {
                let (k, v) = l.encoder_attn.keys_values(memory)?;
                Ok(LayerCache {
                    self_kv: None,
                    steps: Vec::new(),
                    cross_kv: vec![(expand(k)?, expand(v)?)],
                })
            })
            .collect::<Result<_>>()?;
        Ok(DecoderCache {
            layers,
            src_bias: vec![expand(src_bias.clone())?],
            history: if shared_cross {
                vec![Vec::new(); sentences.len()]
            } else {
                Vec::new()
            },
            sentences,
            shared_cross,
            len: 0,
        })
    }

    /// One decoder step for the last tokens (B, 1) → logits (B, V); appends to the cache.
    pub fn decode_step(&self, tokens: &Tensor, cache: &mut DecoderCache) -> Result<Tensor> {
        let c = &self.config;
        let drop = Dropout::off();
        let mut h = self.embed_at(tokens, &cache.positions())?;
        let shared = cache.shared_cross;
        let kv_rows = shared.then_some(cache.sentences.as_slice());
        // Each hypothesis writes this step's keys at its own row.
        for (r, past) in cache.history.iter_mut().enumerate() {
            past.push(r as u32);
        }
        let history = &cache.history;
        let src_bias = &cache.src_bias;
        for (l, lc) in self.decoder_layers.iter().zip(cache.layers.iter_mut()) {
            h = residual(
                &h,
                &l.self_attn_layer_norm,
                c.normalize_before,
                0.0,
                &drop,
                |x| lc.self_attend(&l.self_attn, x, shared.then_some(history.as_slice())),
            )?;
            h = residual(
                &h,
                &l.encoder_attn_layer_norm,
                c.normalize_before,
                0.0,
                &drop,
                |x| lc.cross_attend(&l.encoder_attn, x, src_bias, kv_rows),
            )?;
            h = residual(
                &h,
                &l.final_layer_norm,
                c.normalize_before,
                0.0,
                &drop,
                |x| l.ffn.forward(x, 0.0, &drop),
            )?;
        }
        if let Some(ln) = &self.decoder_norm {
            h = ln.forward(&h)?;
        }
        cache.len += 1;
        let (b, _, d) = h.dims3()?;
        self.logits(&h.reshape((b, d))?)
    }
}
