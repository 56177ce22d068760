//! Training hyper-parameters: one JSON file (presets in data/configs/), every key optional,
//! unknown keys rejected; command-line flags override single keys.

use super::schedule::Schedule;
use crate::data::store::Filters;
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// One training corpus of the `corpora` list: raw text (`src` and `tgt`, prepared into the
/// run folder the first time) or a store made by `nmt prepare` (`store`), and its weight.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct CorpusConfig {
    /// A short name for the log and the run folder's `data/NAME` (letters, digits, `.-_`).
    pub name: Option<String>,
    /// Source text file (plain or gzip).
    pub src: Option<PathBuf>,
    /// Target text file, line-aligned with `src`.
    pub tgt: Option<PathBuf>,
    /// A prepared store folder instead of `src`/`tgt`.
    pub store: Option<PathBuf>,
    /// How often the corpus is sampled per epoch: each pair ⌊w⌋ times, and once more with
    /// probability w − ⌊w⌋ (default 1).
    #[serde(default = "one", deserialize_with = "weight")]
    pub weight: f64,
}

fn one() -> f64 {
    1.0
}

/// A corpus weight: a positive number, with an error that says so for anything else.
fn weight<'de, D: serde::Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    let v = serde_json::Value::deserialize(d)?;
    match v.as_f64() {
        Some(w) if w.is_finite() && w > 0.0 => Ok(w),
        _ => Err(serde::de::Error::custom(format!(
            "corpus weight {v} is not a positive number"
        ))),
    }
}

impl CorpusConfig {
    /// A text corpus of weight 1.
    pub fn text(name: &str, src: PathBuf, tgt: PathBuf) -> Self {
        Self {
            name: Some(name.into()),
            src: Some(src),
            tgt: Some(tgt),
            store: None,
            weight: 1.0,
        }
    }

    /// A prepared store of weight 1.
    pub fn store(name: &str, store: PathBuf) -> Self {
        Self {
            name: Some(name.into()),
            src: None,
            tgt: None,
            store: Some(store),
            weight: 1.0,
        }
    }
}

/// Model and training hyper-parameters. Defaults are the yardstick configuration.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct TrainConfig {
    /// Training corpora with weights; `--src`/`--tgt` or `--data` on the command line
    /// replace the list with one corpus of weight 1.
    pub corpora: Vec<CorpusConfig>,
    /// Vocabulary size when nmt trains the tokenizer itself.
    pub vocab_size: usize,
    /// Model width.
    pub d_model: usize,
    /// Encoder layers.
    pub encoder_layers: usize,
    /// Decoder layers.
    pub decoder_layers: usize,
    /// Attention heads.
    pub heads: usize,
    /// Feed-forward width.
    pub ffn_dim: usize,
    /// `relu`, `gelu` or `swish`.
    pub activation: String,
    /// Pre-norm instead of Marian's post-norm.
    pub normalize_before: bool,
    /// Dropout on embeddings and sub-layer outputs.
    pub dropout: f64,
    /// Dropout on attention probabilities.
    pub attention_dropout: f64,
    /// Dropout after the FFN activation.
    pub activation_dropout: f64,
    /// Positions the model supports.
    pub max_positions: usize,
    /// Longest training sentence in tokens (`</s>` included); longer pairs are skipped.
    pub max_len: usize,
    /// Skip pairs whose longer side has more than this many times the tokens of the shorter
    /// (absent: no ratio filter, as Marian and fairseq).
    pub max_len_ratio: Option<f64>,
    /// Lines sampled (seeded) from the training text when nmt trains the tokenizer itself.
    pub tokenizer_max_lines: usize,
    /// Padded tokens per batch.
    pub max_tokens: usize,
    /// Batches per update (gradient accumulation).
    pub accum: usize,
    /// Peak learning rate (Noam: the scale factor).
    pub lr: f64,
    /// Warm-up steps.
    pub warmup: usize,
    /// Learning-rate schedule.
    pub schedule: Schedule,
    /// Label smoothing ε.
    pub label_smoothing: f64,
    /// Adam β₁.
    pub adam_beta1: f64,
    /// Adam β₂.
    pub adam_beta2: f64,
    /// Adam ε.
    pub adam_eps: f64,
    /// Decoupled weight decay on weight matrices.
    pub weight_decay: f64,
    /// Clip the global gradient norm to this (0: off).
    pub clip_norm: f64,
    /// Dynamic loss scaling's initial scale: absent, 65,536 for `--dtype f16` and off
    /// otherwise; 0 turns it off.
    pub loss_scale: Option<f64>,
    /// Good steps in a row after which the loss scale doubles.
    pub loss_scale_window: usize,
    /// Stop after this many updates.
    pub max_steps: Option<usize>,
    /// Stop after this many epochs.
    pub max_epochs: Option<usize>,
    /// Stop after this much training time, e.g. "90s", "30m", "2h".
    pub max_time: Option<String>,
    /// Validate (and save a checkpoint) every N updates.
    pub valid_every: usize,
    /// Stop when validation BLEU has not improved for this many validations.
    pub patience: Option<usize>,
    /// Training checkpoints kept (the best one is always kept).
    pub keep_last: usize,
    /// Print a progress line every N updates when stderr is not a terminal.
    pub log_every: usize,
    /// Seed for initialisation, data order and dropout.
    pub seed: u64,
    /// Word alignments of the (one, text) training corpus supervising the last decoder
    /// layer's first cross-attention head (Pharaoh lines, one per corpus line).
    pub guided_alignment: Option<PathBuf>,
    /// The guided-alignment cost's weight (Marian's default).
    pub guided_alignment_weight: f64,
    /// The decoder layer guided alignment supervises (0-based); `None`: the last.
    pub guided_alignment_layer: Option<usize>,
    /// Supervise the mean of the layer's cross-attention heads (OpenNMT-py's default,
    /// `-alignment_heads 0`) rather than its first head (Marian's).
    pub guided_alignment_all_heads: bool,
    /// The decoder position each target token's alignment is supervised at.
    pub guided_alignment_position: crate::align::AlignPosition,
}

impl Default for TrainConfig {
    fn default() -> Self {
        Self {
            corpora: Vec::new(),
            vocab_size: 8000,
            d_model: 256,
            encoder_layers: 3,
            decoder_layers: 3,
            heads: 4,
            ffn_dim: 1024,
            activation: "relu".into(),
            normalize_before: false,
            dropout: 0.1,
            attention_dropout: 0.0,
            activation_dropout: 0.0,
            max_positions: 256,
            max_len: 128,
            max_len_ratio: None,
            tokenizer_max_lines: crate::data::tokenizer::DEFAULT_MAX_LINES,
            max_tokens: 4096,
            accum: 1,
            lr: 1e-3,
            warmup: 1000,
            schedule: Schedule::InverseSqrt,
            label_smoothing: 0.1,
            adam_beta1: 0.9,
            adam_beta2: 0.98,
            adam_eps: 1e-9,
            weight_decay: 0.0,
            clip_norm: 1.0,
            loss_scale: None,
            loss_scale_window: 2000,
            max_steps: None,
            max_epochs: None,
            max_time: None,
            valid_every: 500,
            patience: None,
            keep_last: 5,
            log_every: 100,
            seed: 1,
            guided_alignment: None,
            guided_alignment_weight: 0.1,
            guided_alignment_layer: None,
            guided_alignment_all_heads: false,
            guided_alignment_position: crate::align::AlignPosition::Predict,
        }
    }
}

/// Parses a duration: a number with an optional unit s, m or h (seconds by default).
pub fn parse_duration(text: &str) -> Result<f64> {
    let t = text.trim();
    let (num, mult) = match t.chars().last() {
        Some('s') => (&t[..t.len() - 1], 1.0),
        Some('m') => (&t[..t.len() - 1], 60.0),
        Some('h') => (&t[..t.len() - 1], 3600.0),
        _ => (t, 1.0),
    };
    match num.trim().parse::<f64>() {
        Ok(v) if v > 0.0 && v.is_finite() => Ok(v * mult),
        _ => bail!("invalid duration {text:?}: use e.g. 90s, 30m or 2h"),
    }
}

impl TrainConfig {
    /// The filters training applies to its corpora.
    pub fn filters(&self) -> Filters {
        Filters {
            max_len: self.max_len,
            max_len_ratio: self.max_len_ratio,
        }
    }

    /// Reads a JSON preset.
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("{}: cannot read config", path.display()))?;
        Self::from_json(&text, path)
    }

    /// Parses the text of a preset read from `path`.
    pub fn from_json(text: &str, path: &Path) -> Result<Self> {
        serde_json::from_str(text)
            .with_context(|| format!("{}: invalid training config", path.display()))
    }

    /// Checks values that would otherwise fail deep inside training.
    pub fn validate(&self) -> Result<()> {
        if self.heads == 0 || !self.d_model.is_multiple_of(self.heads) {
            bail!(
                "d_model {} must be divisible by heads {}",
                self.d_model,
                self.heads
            );
        }
        if self.max_len > self.max_positions {
            bail!(
                "max_len {} exceeds max_positions {}",
                self.max_len,
                self.max_positions
            );
        }
        if self.max_tokens == 0 || self.accum == 0 || self.valid_every == 0 || self.log_every == 0 {
            bail!("max_tokens, accum, valid_every and log_every must be positive");
        }
        if !(0.0..1.0).contains(&self.dropout) || !(0.0..1.0).contains(&self.label_smoothing) {
            bail!("dropout and label_smoothing must be in [0, 1)");
        }
        if let Some(t) = &self.max_time {
            parse_duration(t)?;
        }
        if self.max_len > crate::data::batch::MAX_LEN_LIMIT {
            bail!(
                "max_len {} is above the supported {}",
                self.max_len,
                crate::data::batch::MAX_LEN_LIMIT
            );
        }
        self.filters().check()?;
        if self
            .loss_scale
            .is_some_and(|s| !(s.is_finite() && s >= 0.0))
        {
            bail!("loss_scale must be a non-negative number (0: off)");
        }
        if self.loss_scale_window == 0 {
            bail!("loss_scale_window must be positive");
        }
        if self.tokenizer_max_lines == 0 {
            bail!("tokenizer_max_lines must be positive");
        }
        if self.guided_alignment.is_some()
            && !(self.corpora.len() == 1 && self.corpora[0].src.is_some())
        {
            bail!("guided alignment needs one training corpus given as text (--src and --tgt), whose lines the alignments follow");
        }
        if !(self.guided_alignment_weight.is_finite() && self.guided_alignment_weight > 0.0) {
            bail!("guided_alignment_weight must be a positive number");
        }
        let mut names = std::collections::HashSet::new();
        for (i, c) in self.corpora.iter().enumerate() {
            let label = format!("corpora[{i}]");
            let name = c.name.as_deref().unwrap_or("");
            if !(c.weight.is_finite() && c.weight > 0.0) {
                bail!(
                    "{label} {name}: weight {} is not a positive number",
                    c.weight
                );
            }
            match (&c.src, &c.tgt, &c.store) {
                (Some(_), Some(_), None) | (None, None, Some(_)) => {}
                _ => bail!("{label} {name}: give either src and tgt, or store"),
            }
            if let Some(n) = &c.name {
                if n.is_empty()
                    || !n
                        .chars()
                        .all(|ch| ch.is_ascii_alphanumeric() || "._-".contains(ch))
                    || n.starts_with('.')
                {
                    bail!("{label}: name {n:?} must be letters, digits, '.', '-' or '_'");
                }
                if !names.insert(n.clone()) {
                    bail!("{label}: the name {n:?} is used twice");
                }
            }
        }
        if self.max_steps.is_none() && self.max_epochs.is_none() && self.max_time.is_none() {
            bail!("no stopping criterion: set max_steps, max_epochs or max_time");
        }
        Ok(())
    }
}
