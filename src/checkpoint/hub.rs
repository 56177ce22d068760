//! Resolving a model: a checkpoint folder, a training run folder (its best/ or last/), or a
//! Hugging Face Hub repo id fetched into the standard HF cache (offline with HF_HUB_OFFLINE=1).
//! Loading the resolved folder into a model and tokenizer is also here.

use super::folder::resolve_model_dir;
use crate::data::opus;
use crate::data::tokenizer::SubwordTokenizer;
use crate::model::weights::Weights;
use crate::model::{ModelConfig, Seq2Seq};
use crate::ops::packed::ComputeType;
use anyhow::{anyhow, bail, Result};
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
    if !looks_like_repo_id(spec) {
        bail!("{spec}: no such model folder (nor a Hub repo id like org/name)");
    }
    from_hub(spec)
}

fn looks_like_repo_id(spec: &str) -> bool {
    let id = spec.split('@').next().unwrap_or("");
    let parts: Vec<&str> = id.split('/').collect();
    parts.len() == 2
        && parts.iter().all(|p| {
            !p.is_empty()
                && p.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        })
        && !spec.starts_with('.')
}

/// Weight files we read, in order of preference.
const WEIGHT_FILES: &[&str] = &["model.safetensors", "pytorch_model.bin"];

/// The weights file of a model folder.
pub fn weights_file(dir: &Path) -> PathBuf {
    WEIGHT_FILES
        .iter()
        .map(|f| dir.join(f))
        .find(|p| p.is_file())
        .unwrap_or_else(|| dir.join(WEIGHT_FILES[0]))
}

/// The standard Hugging Face cache folder: $HF_HUB_CACHE, $HUGGINGFACE_HUB_CACHE, $HF_HOME/hub,
/// or ~/.cache/huggingface/hub.
pub fn hub_cache_dir() -> PathBuf {
    for var in ["HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"] {
        if let Some(dir) = std::env::var_os(var).filter(|v| !v.is_empty()) {
            return PathBuf::from(dir);
        }
    }
    if let Some(home) = std::env::var_os("HF_HOME").filter(|v| !v.is_empty()) {
        return PathBuf::from(home).join("hub");
    }
    hf_hub::Cache::default().path().clone()
}

/// Whether HF_HUB_OFFLINE asks for no network access.
pub fn offline() -> bool {
    std::env::var("HF_HUB_OFFLINE")
        .is_ok_and(|v| matches!(v.to_ascii_lowercase().as_str(), "1" | "true" | "yes" | "on"))
}

/// Fetches one file of a repo, or says why it could not.
type Fetch = dyn Fn(&str) -> Result<PathBuf, String>;

/// Fetches (or, offline, finds in the cache) a model repo `org/name[@revision]`; returns the
/// snapshot folder holding its files.
fn from_hub(spec: &str) -> Result<PathBuf> {
    let (id, revision) = match spec.split_once('@') {
        Some((id, rev)) => (id, rev.to_string()),
        None => (spec, "main".to_string()),
    };
    let cache = hf_hub::Cache::new(hub_cache_dir());
    let repo = hf_hub::Repo::with_revision(id.to_string(), hf_hub::RepoType::Model, revision);
    let fetch: Box<Fetch> = if offline() {
        let cached = cache.repo(repo);
        let at = cache.path().display().to_string();
        Box::new(move |f| {
            cached.get(f).ok_or_else(|| {
                format!("not in the Hugging Face cache at {at} and HF_HUB_OFFLINE is set")
            })
        })
    } else {
        let api = hf_hub::api::sync::ApiBuilder::from_cache(cache)
            .with_progress(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .build()
            .map_err(|e| anyhow!("{spec}: cannot reach the Hugging Face Hub: {e}"))?;
        let repo = api.repo(repo);
        Box::new(move |f| repo.get(f).map_err(|e| e.to_string()))
    };
    let config = fetch("config.json").map_err(|e| anyhow!("{spec}: config.json: {e}"))?;
    // The first of `alternatives` (each a set of files) that the repo has.
    let first_of = |alternatives: &[&[&str]], what: &str| -> Result<()> {
        let mut why = Vec::new();
        for files in alternatives {
            match files
                .iter()
                .map(|f| fetch(f))
                .collect::<Result<Vec<_>, _>>()
            {
                Ok(_) => return Ok(()),
                Err(e) => why.push(format!("{}: {e}", files.join(" + "))),
            }
        }
        bail!("{spec}: no {what} ({})", why.join("; "))
    };
    first_of(&[&["tokenizer.json"], opus::FILES], "tokenizer")?;
    let weights: Vec<&[&str]> = WEIGHT_FILES.iter().map(std::slice::from_ref).collect();
    first_of(&weights, "weights")?;
    if opus::is_opus_dir(config.parent().unwrap_or(Path::new("."))) {
        // Optional: says whether the vocabularies are separate.
        let _ = fetch("tokenizer_config.json");
    }
    config
        .parent()
        .map(Path::to_path_buf)
        .ok_or_else(|| anyhow!("{spec}: empty repo"))
}

/// Loads model and tokenizer from a resolved folder, its linear layers in f32.
pub fn load(dir: &Path, device: &Device, dtype: DType) -> Result<LoadedModel> {
    load_as(dir, device, dtype, ComputeType::Float32)
}

/// Loads model and tokenizer from a resolved folder, its linear layers computing as `compute`.
pub fn load_as(
    dir: &Path,
    device: &Device,
    dtype: DType,
    compute: ComputeType,
) -> Result<LoadedModel> {
    if compute == ComputeType::Int8 && (!device.is_cpu() || dtype != DType::F32) {
        bail!("int8 computes on the CPU from f32 weights, not on {device:?} in {dtype:?}");
    }
    let config = ModelConfig::load(&dir.join("config.json"))?;
    let tokenizer = SubwordTokenizer::load_dir(dir)?;
    if tokenizer.vocab_size() != config.vocab_size {
        bail!(
            "{}: the tokenizer has {} pieces but {} declares vocab_size {}",
            tokenizer.path.display(),
            tokenizer.vocab_size(),
            dir.join("config.json").display(),
            config.vocab_size
        );
    }
    let weights = Weights::load(&weights_file(dir), device, dtype)?.computing(compute);
    let model = Seq2Seq::new(&config, &weights)?;
    Ok(LoadedModel {
        model,
        tokenizer,
        dir: dir.to_path_buf(),
    })
}
