//! Checkpoint folders: a transformers-loadable Marian folder (config.json, model.safetensors,
//! tokenizer.json) plus, for training, optimizer.safetensors and trainer_state.json. Each is
//! written under a temporary name, synced and renamed, and `last`/`best` are symbolic links
//! swapped atomically, so a crash at any moment leaves the previous checkpoint intact.

use crate::data::tokenizer::SubwordTokenizer;
use crate::model::ModelConfig;
use anyhow::{anyhow, Context, Result};
use candle_core::Tensor;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::fs::{self, File};
use std::path::{Path, PathBuf};

/// Where the trainer is, saved with every checkpoint so `--resume` continues exactly.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct TrainerState {
    /// Optimizer updates done.
    pub step: usize,
    /// Current epoch (1-based).
    pub epoch: usize,
    /// Batches of the current epoch already used.
    pub batch_in_epoch: usize,
    /// Target tokens trained on.
    pub tokens_seen: u64,
    /// Training seconds so far (excluding validation).
    pub elapsed_s: f64,
    /// Best validation BLEU and its step.
    pub best_bleu: Option<f64>,
    /// Step of the best checkpoint.
    pub best_step: Option<usize>,
    /// Validations since BLEU last improved.
    pub bad_validations: usize,
    /// Dynamic loss scaling, when the run uses it (f16).
    #[serde(default)]
    pub loss_scale: Option<crate::train::loss_scale::LossScaler>,
    /// Updates skipped because the scaled gradients overflowed.
    #[serde(default)]
    pub skipped_steps: usize,
    /// The parts held frozen (`--freeze`).
    #[serde(default)]
    pub frozen: Vec<String>,
}

/// Writes `tensors` as safetensors with the `format: pt` metadata transformers expects.
pub fn save_safetensors(tensors: &HashMap<String, Tensor>, path: &Path) -> Result<()> {
    let mut sorted: Vec<(&String, &Tensor)> = tensors.iter().collect();
    sorted.sort_by(|a, b| a.0.cmp(b.0));
    let contiguous: Vec<(String, Tensor)> = sorted
        .into_iter()
        .map(|(k, t)| Ok((k.clone(), t.contiguous()?)))
        .collect::<Result<_>>()?;
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    let bytes = safetensors::serialize(
        contiguous.iter().map(|(k, t)| (k.as_str(), t)),
        Some(metadata),
    )
    .map_err(|e| anyhow!("serialising {}: {e}", path.display()))?;
    crate::io::write_atomic(path, &bytes)
}

fn sync_dir(dir: &Path) {
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
}

/// What goes into a checkpoint folder.
pub struct Checkpoint<'a> {
    /// Model configuration.
    pub config: &'a ModelConfig,
    /// Model tensors by checkpoint name.
    pub tensors: HashMap<String, Tensor>,
    /// The tokenizer.
    pub tokenizer: &'a SubwordTokenizer,
    /// A folder whose tokenizer files ([`TOKENIZER_FILES`]) are copied byte for byte instead
    /// of writing `tokenizer`'s: a fine-tuned model keeps its original files.
    pub tokenizer_files: Option<&'a Path>,
    /// Optimizer moments, for training checkpoints.
    pub optimizer: Option<HashMap<String, Tensor>>,
    /// Trainer state, for training checkpoints.
    pub state: Option<&'a TrainerState>,
}

impl Checkpoint<'_> {
    /// Writes the folder `dir` atomically: everything goes to a temporary sibling first.
    pub fn save(&self, dir: &Path) -> Result<()> {
        let parent = dir
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        fs::create_dir_all(parent)
            .with_context(|| format!("{}: cannot create folder", parent.display()))?;
        let name = dir.file_name().unwrap().to_string_lossy();
        let tmp = parent.join(format!(".{name}.tmp"));
        if tmp.exists() {
            fs::remove_dir_all(&tmp)
                .with_context(|| format!("{}: cannot remove", tmp.display()))?;
        }
        fs::create_dir(&tmp).with_context(|| format!("{}: cannot create folder", tmp.display()))?;
        let result = (|| -> Result<()> {
            crate::io::write_atomic(
                &tmp.join("config.json"),
                self.config.to_hf_json()?.as_bytes(),
            )?;
            save_safetensors(&self.tensors, &tmp.join("model.safetensors"))?;
            match self.tokenizer_files {
                Some(from) => copy_tokenizer_files(from, &tmp)?,
                None => {
                    self.tokenizer.save(&tmp.join("tokenizer.json"))?;
                    // Without it transformers' AutoTokenizer (and converters built on it, such as
                    // CTranslate2's) would look for Marian's SentencePiece files.
                    let tokenizer_config = serde_json::json!({
                        "tokenizer_class": "PreTrainedTokenizerFast",
                        "eos_token": crate::data::tokenizer::EOS,
                        "unk_token": crate::data::tokenizer::UNK,
                        "pad_token": crate::data::tokenizer::PAD,
                        "model_max_length": self.config.max_position_embeddings,
                    });
                    crate::io::write_atomic(
                        &tmp.join("tokenizer_config.json"),
                        serde_json::to_string_pretty(&tokenizer_config)?.as_bytes(),
                    )?;
                }
            }
            if let Some(opt) = &self.optimizer {
                save_safetensors(opt, &tmp.join("optimizer.safetensors"))?;
            }
            if let Some(state) = self.state {
                crate::io::write_atomic(
                    &tmp.join("trainer_state.json"),
                    serde_json::to_string_pretty(state)?.as_bytes(),
                )?;
            }
            sync_dir(&tmp);
            if dir.exists() {
                fs::remove_dir_all(dir)
                    .with_context(|| format!("{}: cannot replace", dir.display()))?;
            }
            fs::rename(&tmp, dir)
                .with_context(|| format!("{}: cannot rename into place", dir.display()))?;
            sync_dir(parent);
            Ok(())
        })();
        if result.is_err() {
            let _ = fs::remove_dir_all(&tmp);
        }
        result
    }
}

/// The files that make up a model folder's tokenizer (nmt's and transformers' tokenizer.json,
/// OPUS-MT's SentencePiece models and vocabulary).
pub const TOKENIZER_FILES: [&str; 6] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "source.spm",
    "target.spm",
    "vocab.json",
];

/// Copies the tokenizer files that `from` has into `to`, byte for byte.
pub fn copy_tokenizer_files(from: &Path, to: &Path) -> Result<()> {
    for name in TOKENIZER_FILES {
        let src = from.join(name);
        if src.is_file() {
            let bytes = crate::io::read_input(&src, "tokenizer")?;
            crate::io::write_atomic(&to.join(name), &bytes)?;
        }
    }
    Ok(())
}

/// Points the symbolic link `link` at `target` (relative to the link's folder) atomically.
pub fn point(link: &Path, target: &Path) -> Result<()> {
    let parent = link.parent().unwrap_or(Path::new("."));
    let tmp = parent.join(format!(
        ".{}.link.tmp",
        link.file_name().unwrap().to_string_lossy()
    ));
    let _ = fs::remove_file(&tmp);
    std::os::unix::fs::symlink(target, &tmp)
        .with_context(|| format!("{}: cannot create link", tmp.display()))?;
    fs::rename(&tmp, link).with_context(|| format!("{}: cannot update link", link.display()))?;
    sync_dir(parent);
    Ok(())
}

/// The model folder a user named: a checkpoint folder itself, or a training run folder, in
/// which case its `best/` (else `last/`) checkpoint.
pub fn resolve_model_dir(path: &Path) -> PathBuf {
    if path.join("config.json").is_file() {
        return path.to_path_buf();
    }
    for sub in ["best", "last"] {
        if path.join(sub).join("config.json").is_file() {
            return path.join(sub);
        }
    }
    path.to_path_buf()
}

/// The training checkpoints of a run, oldest first.
pub fn list_checkpoints(run: &Path) -> Result<Vec<PathBuf>> {
    let dir = run.join("checkpoints");
    let mut all: Vec<PathBuf> = match fs::read_dir(&dir) {
        Ok(entries) => entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with("step-"))
            })
            .filter(|p| p.join("model.safetensors").is_file())
            .collect(),
        Err(_) => Vec::new(),
    };
    all.sort();
    Ok(all)
}
