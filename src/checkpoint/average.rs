//! Checkpoint averaging: the element-wise mean of the weights of checkpoints of one model.

use super::folder::Checkpoint;
use crate::data::store::fingerprint;
use crate::data::tokenizer::SubwordTokenizer;
use crate::model::weights::read_tensors;
use crate::model::ModelConfig;
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Averages the weights of several checkpoints (same config) into a new checkpoint folder.
pub fn average(inputs: &[PathBuf], output: &Path) -> Result<()> {
    if inputs.is_empty() {
        bail!("no checkpoints to average");
    }
    let first = &inputs[0];
    let config = ModelConfig::load(&first.join("config.json"))?;
    let tok = SubwordTokenizer::load_dir(first)?;
    let tokenizer = fingerprint(&tok)?;
    let mut sum: HashMap<String, Tensor> = HashMap::new();
    // Every field that defines the model must agree (dropout rates and the initialisation
    // scale, which only training reads, and metadata outside the model's own may differ).
    let defining = |c: &ModelConfig| -> Result<serde_json::Map<String, serde_json::Value>> {
        let mut v = serde_json::to_value(ModelConfig {
            extra: Default::default(),
            ..c.clone()
        })?;
        let map = v.as_object_mut().expect("a config is an object");
        for training_only in [
            "dropout",
            "attention_dropout",
            "activation_dropout",
            "init_std",
        ] {
            map.remove(training_only);
        }
        Ok(std::mem::take(map))
    };
    let want = defining(&config)?;
    let mut names: Option<Vec<String>> = None;
    for dir in inputs {
        let c = ModelConfig::load(&dir.join("config.json"))?;
        let got = defining(&c)?;
        if let Some((key, a)) = want.iter().find(|(k, v)| got.get(*k) != Some(v)) {
            bail!(
                "{}: its config differs from {}'s in {key} ({} vs {a}): these checkpoints are not of one model",
                dir.display(),
                first.display(),
                got.get(key).map_or("absent".into(), |v| v.to_string())
            );
        }
        if dir != first && fingerprint(&SubwordTokenizer::load_dir(dir)?)? != tokenizer {
            bail!(
                "{}: its tokenizer differs from {}'s: these checkpoints are not of one model",
                dir.display(),
                first.display()
            );
        }
        let p = dir.join("model.safetensors");
        let t = read_tensors(&p, &Device::Cpu)?;
        let mut these: Vec<String> = t.keys().cloned().collect();
        these.sort();
        match &names {
            None => names = Some(these),
            Some(n) if *n != these => bail!(
                "{}: holds other tensors than {}",
                p.display(),
                first.display()
            ),
            Some(_) => {}
        }
        for (k, v) in t {
            let v = v.to_dtype(DType::F32)?;
            let acc = match sum.remove(&k) {
                Some(a) => (a + v).with_context(|| format!("{}: tensor {k}", p.display()))?,
                None => v,
            };
            sum.insert(k, acc);
        }
    }
    let n = inputs.len() as f64;
    let tensors = sum
        .into_iter()
        .map(|(k, v)| Ok((k, (v / n)?)))
        .collect::<Result<HashMap<_, _>>>()?;
    Checkpoint {
        config: &config,
        tensors,
        tokenizer: &tok,
        tokenizer_files: Some(first),
        optimizer: None,
        state: None,
    }
    .save(output)
}
