//! A run's data: the tokenizer it trains with, its corpora prepared into the run folder
//! (`DIR/data/NAME`) the first time or opened from stores made by `nmt prepare`, and the
//! validation set. Training reads only the stores after this; a resumed run re-reads no text.

use super::config::{CorpusConfig, TrainConfig};
use crate::data::batch::Mixture;
use crate::data::corpus::read_parallel;
use crate::data::prepare::prepare;
use crate::data::store::{Filters, Store, MANIFEST};
use crate::data::tokenizer::{self, SubwordTokenizer, TrainOptions};
use anyhow::{bail, Result};
use std::io::IsTerminal;
use std::path::{Path, PathBuf};

/// The validation set: a store for the loss, and the text for BLEU.
pub struct Valid {
    /// The validation pairs, for the loss.
    pub mixture: Mixture,
    /// Source lines, translated for BLEU.
    pub sources: Vec<String>,
    /// Reference lines (one reference set).
    pub refs: Vec<Vec<String>>,
}

/// The name a corpus goes by in the log and under `DIR/data/`.
pub fn corpus_name(c: &CorpusConfig, i: usize, n: usize) -> String {
    match (&c.name, n) {
        (Some(name), _) => name.clone(),
        (None, 1) => "train".into(),
        (None, _) => format!("corpus{}", i + 1),
    }
}

/// Opens each store named by the config, checking that its sources have not changed.
fn open_stores(cfg: &TrainConfig) -> Result<Vec<Option<Store>>> {
    cfg.corpora
        .iter()
        .map(|c| {
            c.store
                .as_deref()
                .map(|p| {
                    let store = Store::open(p)?;
                    store.check_sources_unchanged()?;
                    Ok(store)
                })
                .transpose()
        })
        .collect()
}

/// The run's tokenizer: the resumed run's, `--tokenizer` (a file, or a model folder when
/// fine-tuning), the first prepared store's, or one trained on (a sample of) the text corpora.
fn tokenizer(
    cfg: &TrainConfig,
    given: Option<&Path>,
    resume_dir: Option<&Path>,
    stores: &[Option<Store>],
) -> Result<SubwordTokenizer> {
    if let Some(last) = resume_dir {
        return SubwordTokenizer::load_dir(last);
    }
    if let Some(p) = given {
        return SubwordTokenizer::load_any(p);
    }
    if let Some(store) = stores.iter().flatten().next() {
        return store.tokenizer();
    }
    let inputs: Vec<PathBuf> = cfg
        .corpora
        .iter()
        .flat_map(|c| [c.src.clone(), c.tgt.clone()])
        .flatten()
        .collect();
    eprintln!(
        "training a {}-piece BPE tokenizer on the training data",
        cfg.vocab_size
    );
    let opts = TrainOptions {
        vocab_size: cfg.vocab_size,
        model: tokenizer::SubwordModel::Bpe,
        min_frequency: None,
        show_progress: std::io::stderr().is_terminal(),
        max_lines: cfg.tokenizer_max_lines,
        seed: cfg.seed,
    };
    tokenizer::train(&inputs, &opts)
}

/// The store of a text corpus in the run folder: reused when it was made from these very
/// files, with this tokenizer and these filters; else prepared (again). A resumed run
/// refuses to train on changed data.
fn prepared(
    src: &Path,
    tgt: &Path,
    tok: &SubwordTokenizer,
    filters: &Filters,
    dir: &Path,
    resume: bool,
) -> Result<Store> {
    if dir.join(MANIFEST).exists() {
        let store = Store::open(dir)?;
        match store.made_from(src, tgt, tok, filters)? {
            None => return Ok(store),
            Some(why) if resume => bail!(
                "{}: cannot resume on other data: {why}. Restore the original files, or start a new run with another --out",
                dir.display()
            ),
            Some(why) => eprintln!("note: {}: {why}; preparing it again", dir.display()),
        }
    }
    eprintln!(
        "preparing {} and {} into {}",
        src.display(),
        tgt.display(),
        dir.display()
    );
    prepare(src, tgt, tok, filters, dir)
}

/// Everything a run reads: its tokenizer, the weighted training corpora, the validation set.
pub fn load(
    cfg: &TrainConfig,
    given_tokenizer: Option<&Path>,
    valid: Option<&(PathBuf, PathBuf)>,
    out: &Path,
    resume_dir: Option<&Path>,
) -> Result<(SubwordTokenizer, Mixture, Option<Valid>)> {
    let mut stores = open_stores(cfg)?;
    let tok = tokenizer(cfg, given_tokenizer, resume_dir, &stores)?;
    let n = cfg.corpora.len();
    let mut corpora = Vec::with_capacity(n);
    for (i, (c, store)) in cfg.corpora.iter().zip(stores.iter_mut()).enumerate() {
        let name = corpus_name(c, i, n);
        let store = match (store.take(), &c.src, &c.tgt) {
            (Some(store), _, _) => {
                store.check_tokenizer(&tok)?;
                store
            }
            (None, Some(src), Some(tgt)) => prepared(
                src,
                tgt,
                &tok,
                &cfg.filters(),
                &out.join("data").join(&name),
                resume_dir.is_some(),
            )?,
            _ => unreachable!("TrainConfig::validate checks each corpus"),
        };
        eprintln!("corpus {name} (weight {}): {}", c.weight, store.summary());
        corpora.push((name, store, c.weight));
    }
    let valid = match valid {
        Some((vs, vt)) => {
            let (s, t) = read_parallel(vs, vt)?;
            let filters = Filters {
                max_len: cfg.max_positions,
                max_len_ratio: None,
            };
            let store = prepared(
                vs,
                vt,
                &tok,
                &filters,
                &out.join("data").join("valid"),
                false,
            )?;
            Some(Valid {
                mixture: Mixture::new(vec![("valid".into(), store, 1.0)])?,
                sources: s.lines,
                refs: vec![t.lines],
            })
        }
        None => None,
    };
    Ok((tok, Mixture::new(corpora)?, valid))
}
