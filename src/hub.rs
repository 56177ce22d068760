//! Resolving a model: a checkpoint folder, a training run folder (its best/ or last/), or a
//! Hugging Face Hub repo id fetched into the standard HF cache (offline with HF_HUB_OFFLINE=1).
//! Loading the resolved folder into a model and tokenizer is also here.

use crate::data::tokenizer::SubwordTokenizer;
use crate::model::weights::Weights;
use crate::model::{ModelConfig, Seq2Seq};
use crate::train::checkpoint::resolve_model_dir;
use anyhow::{bail, Result};
use candle_core::{DType, Device};
use std::path::{Path, PathBuf};

/// A loaded translation model with its tokenizer.
pub struct LoadedModel {
    /// The model.
    pub model: Seq2Seq,
    /// Its tokenizer.
    pub tokenizer: SubwordTokenizer,
    /// The folder it came from.
    pub dir: PathBuf,
}

/// Finds the model folder for `spec`: an existing path, else a Hub repo id.
pub fn resolve(spec: &str) -> Result<PathBuf> {
    let path = Path::new(spec);
    if path.exists() {
        let dir = resolve_model_dir(path);
        if !dir.join("config.json").is_file() {
            bail!(
                "{}: not a model folder (no config.json, best/ or last/)",
                path.display()
            );
        }
        return Ok(dir);
    }
    bail!("{spec}: no such model folder")
}

/// Loads model and tokenizer from a resolved folder.
pub fn load(dir: &Path, device: &Device, dtype: DType) -> Result<LoadedModel> {
    let config = ModelConfig::load(&dir.join("config.json"))?;
    let tok_path = dir.join("tokenizer.json");
    let tokenizer = SubwordTokenizer::load(&tok_path)?;
    if tokenizer.vocab_size() != config.vocab_size {
        bail!(
            "{}: the tokenizer has {} pieces but {} declares vocab_size {}",
            tok_path.display(),
            tokenizer.vocab_size(),
            dir.join("config.json").display(),
            config.vocab_size
        );
    }
    let weights = Weights::load(&dir.join("model.safetensors"), device, dtype)?;
    let model = Seq2Seq::new(&config, &weights)?;
    Ok(LoadedModel {
        model,
        tokenizer,
        dir: dir.to_path_buf(),
    })
}
