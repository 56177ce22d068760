//! The model configuration: HF `MarianConfig`'s keys, read from and written to `config.json`
//! unchanged, so our checkpoints and transformers' Marian checkpoints are the same thing.

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;

fn default_activation() -> String {
    "relu".into()
}
fn yes() -> bool {
    true
}
fn default_max_positions() -> usize {
    512
}
fn default_init_std() -> f64 {
    0.02
}

/// An encoder–decoder Transformer as HF's MarianMT defines it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ModelConfig {
    /// Vocabulary size (shared by source and target).
    pub vocab_size: usize,
    /// Target vocabulary size; equal to `vocab_size` for shared vocabularies.
    #[serde(default)]
    pub decoder_vocab_size: Option<usize>,
    /// Model width.
    pub d_model: usize,
    /// Encoder layers.
    pub encoder_layers: usize,
    /// Decoder layers.
    pub decoder_layers: usize,
    /// Encoder attention heads.
    pub encoder_attention_heads: usize,
    /// Decoder attention heads.
    pub decoder_attention_heads: usize,
    /// Encoder feed-forward width.
    pub encoder_ffn_dim: usize,
    /// Decoder feed-forward width.
    pub decoder_ffn_dim: usize,
    /// Longest sequence (positions), source or target, `</s>` included.
    #[serde(default = "default_max_positions")]
    pub max_position_embeddings: usize,
    /// `relu`, `gelu` or `swish`/`silu`.
    #[serde(default = "default_activation")]
    pub activation_function: String,
    /// Multiply token embeddings by √d_model.
    #[serde(default = "yes")]
    pub scale_embedding: bool,
    /// Dropout on embeddings, attention output and FFN output.
    #[serde(default)]
    pub dropout: f64,
    /// Dropout on attention probabilities.
    #[serde(default)]
    pub attention_dropout: f64,
    /// Dropout after the FFN activation.
    #[serde(default)]
    pub activation_dropout: f64,
    /// Id of `<pad>`.
    pub pad_token_id: u32,
    /// Id of `</s>`.
    pub eos_token_id: u32,
    /// First decoder input (Marian: the pad id).
    pub decoder_start_token_id: u32,
    /// Encoder and decoder share one embedding matrix.
    #[serde(default = "yes")]
    pub share_encoder_decoder_embeddings: bool,
    /// The output projection is the embedding matrix.
    #[serde(default = "yes")]
    pub tie_word_embeddings: bool,
    /// Std of the normal initialisation transformers uses (kept for round trips).
    #[serde(default = "default_init_std")]
    pub init_std: f64,
    /// Pre-norm layers (LayerNorm before each sub-layer, plus a final one). An nmt extension:
    /// transformers' Marian is post-norm only, so such checkpoints load in nmt alone.
    #[serde(default)]
    pub normalize_before: bool,
    /// Everything else transformers wrote (kept when we rewrite the file).
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

/// Feed-forward activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// max(0, x)
    Relu,
    /// x·Φ(x), exact (erf) form as transformers' "gelu".
    Gelu,
    /// x·σ(x)
    Swish,
}

impl ModelConfig {
    /// A configuration for a given vocabulary and size, with Marian's conventions.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        vocab_size: usize,
        pad: u32,
        eos: u32,
        d_model: usize,
        layers: usize,
        heads: usize,
        ffn: usize,
    ) -> Self {
        Self {
            vocab_size,
            decoder_vocab_size: Some(vocab_size),
            d_model,
            encoder_layers: layers,
            decoder_layers: layers,
            encoder_attention_heads: heads,
            decoder_attention_heads: heads,
            encoder_ffn_dim: ffn,
            decoder_ffn_dim: ffn,
            max_position_embeddings: 256,
            activation_function: "relu".into(),
            scale_embedding: true,
            dropout: 0.1,
            attention_dropout: 0.0,
            activation_dropout: 0.0,
            pad_token_id: pad,
            eos_token_id: eos,
            decoder_start_token_id: pad,
            share_encoder_decoder_embeddings: true,
            tie_word_embeddings: true,
            init_std: 0.02,
            normalize_before: false,
            extra: serde_json::Map::new(),
        }
    }

    /// Reads and checks a `config.json`.
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("{}: cannot read model config", path.display()))?;
        Self::from_json(&text, path)
    }

    /// Parses and checks the text of a `config.json` read from `path`.
    pub fn from_json(text: &str, path: &Path) -> Result<Self> {
        let cfg: Self = serde_json::from_str(text)
            .with_context(|| format!("{}: not a valid Marian config.json", path.display()))?;
        cfg.validate()
            .with_context(|| format!("{}: unsupported model", path.display()))?;
        Ok(cfg)
    }

    /// Checks that nmt can build this model.
    pub fn validate(&self) -> Result<()> {
        // Another architecture's config can parse as a Marian one (serde fills the defaults);
        // building it would silently make a different model.
        if let Some(kind) = self.extra.get("model_type").and_then(|v| v.as_str()) {
            if kind != "marian" {
                bail!("model_type {kind:?}: nmt builds Marian models (MarianMTModel) only");
            }
        }
        if self.d_model == 0 || self.vocab_size == 0 || self.max_position_embeddings == 0 {
            bail!("d_model, vocab_size and max_position_embeddings must be positive");
        }
        for heads in [self.encoder_attention_heads, self.decoder_attention_heads] {
            if heads == 0 || !self.d_model.is_multiple_of(heads) {
                bail!(
                    "d_model {} is not divisible by {} attention heads",
                    self.d_model,
                    heads
                );
            }
        }
        if self
            .decoder_vocab_size
            .is_some_and(|v| v != self.vocab_size)
        {
            bail!("separate source and target vocabularies are not supported");
        }
        if !self.share_encoder_decoder_embeddings {
            bail!("unshared encoder and decoder embeddings are not supported");
        }
        if self.pad_token_id as usize >= self.vocab_size
            || self.eos_token_id as usize >= self.vocab_size
        {
            bail!(
                "pad or eos id outside the vocabulary of {}",
                self.vocab_size
            );
        }
        self.activation()?;
        Ok(())
    }

    /// The feed-forward activation.
    pub fn activation(&self) -> Result<Activation> {
        Ok(match self.activation_function.as_str() {
            "relu" => Activation::Relu,
            "gelu" => Activation::Gelu,
            "swish" | "silu" => Activation::Swish,
            other => bail!("activation_function {other:?} is not supported (relu, gelu, swish)"),
        })
    }

    /// The JSON written next to a checkpoint: every MarianConfig key transformers needs.
    pub fn to_hf_json(&self) -> Result<String> {
        let mut v = serde_json::to_value(self)?;
        let obj = v.as_object_mut().unwrap();
        obj.insert("model_type".into(), "marian".into());
        obj.insert("architectures".into(), serde_json::json!(["MarianMTModel"]));
        obj.entry("decoder_vocab_size")
            .or_insert(self.vocab_size.into());
        if obj.get("decoder_vocab_size").is_some_and(|x| x.is_null()) {
            obj.insert("decoder_vocab_size".into(), self.vocab_size.into());
        }
        obj.entry("forced_eos_token_id")
            .or_insert(self.eos_token_id.into());
        obj.entry("is_encoder_decoder").or_insert(true.into());
        obj.entry("encoder_layerdrop").or_insert(0.0.into());
        obj.entry("decoder_layerdrop").or_insert(0.0.into());
        Ok(serde_json::to_string_pretty(&v)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Keys we do not know are carried through config.json unchanged, floats bit for bit
    /// (found by fuzzing: without serde_json's float_roundtrip a value moved by one ulp).
    #[test]
    fn config_json_round_trips_exactly() {
        let mut v: serde_json::Value = serde_json::from_str(
            &ModelConfig::new(100, 99, 0, 16, 1, 2, 32)
                .to_hf_json()
                .unwrap(),
        )
        .unwrap();
        v["some_scale"] = serde_json::json!(2.2222222222222227e60);
        let path = Path::new("config.json");
        let cfg = ModelConfig::from_json(&v.to_string(), path).unwrap();
        let again: serde_json::Value = serde_json::from_str(&cfg.to_hf_json().unwrap()).unwrap();
        assert_eq!(again["some_scale"].as_f64(), Some(2.2222222222222227e60));
        assert_eq!(
            ModelConfig::from_json(&cfg.to_hf_json().unwrap(), path)
                .unwrap()
                .to_hf_json()
                .unwrap(),
            cfg.to_hf_json().unwrap()
        );
    }
}
