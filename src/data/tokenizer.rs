//! The subword tokenizer: training a joint BPE or unigram vocabulary with HF `tokenizers`, and
//! loading, encoding and decoding with one. Special tokens follow the Marian/OPUS-MT convention
//! (`</s>` = 0, `<unk>` = 1, `<pad>` = the last id) so that checkpoints interoperate.
//!
//! Whitespace: the pipeline preserves text exactly up to Unicode NFC. Every space is kept
//! (leading, trailing and repeated ones too: Multi30k has all three), a `▁` is prepended to the
//! line as SentencePiece does, and characters never seen in training (tabs, emoji, other
//! scripts) fall back to byte tokens `<0x00>`..`<0xFF>` rather than `<unk>`. So
//! `decode(encode(x)) == NFC(x)` for any line `x` that does not itself contain `▁` (U+2581).
//! We chose exactness over SentencePiece's whitespace collapsing because a translation toolkit
//! must never silently change what a user wrote; punctuation is split off words before subword
//! training so that "young," and "young" share a piece.

use crate::data::corpus::LineReader;
use crate::data::opus::{self, OpusVocab};
use crate::progress::Progress;
use crate::rng::Rng;
use anyhow::{anyhow, bail, Result};
use rayon::prelude::*;
use serde_json::json;
use std::cell::RefCell;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::models::unigram::{Unigram, UnigramTrainerBuilder};
use tokenizers::models::TrainerWrapper;
use tokenizers::{AddedToken, DecoderWrapper, NormalizerWrapper, PreTokenizerWrapper, Tokenizer};

pub use super::{EOS, PAD, UNK};
/// How many ids the specials and byte-fallback pieces take: `</s>`, `<unk>`, 256 bytes, `<pad>`.
pub const RESERVED: usize = 2 + 256 + 1;

/// Which subword algorithm to train.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SubwordModel {
    /// Byte-pair encoding (merges learned bottom-up).
    Bpe,
    /// SentencePiece's unigram language model (pieces pruned top-down).
    Unigram,
}

/// Options for [`train`].
#[derive(Debug, Clone)]
pub struct TrainOptions {
    /// Total vocabulary size, specials and byte pieces included.
    pub vocab_size: usize,
    /// BPE or unigram.
    pub model: SubwordModel,
    /// BPE only: pairs seen fewer times are never merged.
    pub min_frequency: Option<u64>,
    /// Draw a progress bar on stderr.
    pub show_progress: bool,
    /// Train on at most this many lines, sampled uniformly (seeded) from all inputs, so that
    /// huge corpora train in bounded memory and time (SentencePiece's
    /// `input_sentence_size`, Marian's `--sentencepiece-max-lines`). Inputs with fewer
    /// lines are used whole, in order.
    pub max_lines: usize,
    /// Seed of the sample.
    pub seed: u64,
}

/// Lines sampled for tokenizer training unless told otherwise (Marian's default).
pub const DEFAULT_MAX_LINES: usize = 2_000_000;

/// Reads every line of `readers` and keeps a uniform sample of at most `max` of them
/// (reservoir sampling), returned in input order.
fn sample_lines(readers: &mut [LineReader], max: usize, seed: u64) -> Result<Vec<String>> {
    let total: u64 = readers
        .iter()
        .map(|r| std::fs::metadata(r.path()).map_or(0, |m| m.len()))
        .sum();
    let progress = Progress::bytes("reading tokenizer training text", total);
    let mut rng = Rng::new(seed);
    let mut kept: Vec<(usize, String)> = Vec::new();
    let (mut seen, mut done_bytes) = (0usize, 0u64);
    for r in readers.iter_mut() {
        while let Some(line) = r.next_line()? {
            if kept.len() < max {
                kept.push((seen, line));
            } else {
                let j = rng.below(seen + 1);
                if j < max {
                    kept[j] = (seen, line);
                }
            }
            seen += 1;
            if seen.is_multiple_of(1 << 16) {
                progress.set(done_bytes + r.file_bytes_read(), || format!("{seen} lines"));
            }
        }
        done_bytes += r.file_bytes_read();
    }
    progress.finish();
    if seen > max {
        eprintln!("training the tokenizer on {max} of {seen} lines (sampled, seed {seed})");
    }
    kept.sort_unstable_by_key(|(i, _)| *i);
    Ok(kept.into_iter().map(|(_, l)| l).collect())
}

/// A loaded subword tokenizer with the ids of its special tokens.
#[derive(Clone)]
pub struct SubwordTokenizer {
    backend: Backend,
    /// Set when a line's ids are its space-separated words' ids one after the other.
    words: Option<WordSplit>,
    /// Where it was loaded from (for error messages).
    pub path: PathBuf,
    /// Id of `</s>`.
    pub eos_id: u32,
    /// Id of `<unk>`.
    pub unk_id: u32,
    /// Id of `<pad>`.
    pub pad_id: u32,
}

/// What does the work: a HF `tokenizer.json` (ours, or any Marian one), or an OPUS-MT folder's
/// SentencePiece models and `vocab.json`.
#[derive(Clone)]
enum Backend {
    Hf(Box<Tokenizer>),
    Opus(Arc<OpusVocab>),
}

/// What [`SubwordTokenizer::encode_ids_cached`] needs: nmt's own pipeline encodes a line as
/// the concatenation of its space-separated words (each space becomes the `▁` that starts
/// the next piece; an empty word, between two spaces, is a lone `▁`).
#[derive(Clone)]
struct WordSplit {
    /// Identifies the tokenizer in the per-thread caches.
    id: u64,
    /// The ids of a lone `▁`.
    lone_space: Vec<u32>,
    /// The added tokens' texts: a line holding one is encoded whole (they split words).
    added: Vec<String>,
}

/// Tokenizers get distinct cache ids.
static NEXT_TOKENIZER_ID: AtomicU64 = AtomicU64::new(1);

/// A per-thread cache holds at most this many words before it starts over.
const WORD_CACHE_LIMIT: usize = 1 << 20;

thread_local! {
    /// Words already encoded on this thread, and the tokenizer they belong to.
    static WORDS: RefCell<(u64, HashMap<String, Vec<u32>>)> = RefCell::new((0, HashMap::new()));
}

fn byte_pieces() -> impl Iterator<Item = String> {
    (0..=255u8).map(|b| format!("<0x{b:02X}>"))
}

fn pipeline() -> Result<(NormalizerWrapper, PreTokenizerWrapper, DecoderWrapper)> {
    let normalizer = serde_json::from_value(json!({"type": "Sequence", "normalizers": [
        {"type": "NFC"},
        {"type": "Prepend", "prepend": "▁"},
        {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]}))?;
    let pre_tokenizer = serde_json::from_value(json!({"type": "Sequence", "pretokenizers": [
        {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "never", "split": true},
        {"type": "Punctuation", "behavior": "Isolated"}]}))?;
    let decoder = serde_json::from_value(json!({"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
        {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}))?;
    Ok((normalizer, pre_tokenizer, decoder))
}

/// Trains one joint vocabulary over all `inputs` (plain or gzip), streaming their lines.
pub fn train(inputs: &[PathBuf], opts: &TrainOptions) -> Result<SubwordTokenizer> {
    if inputs.is_empty() {
        bail!("no --input files given");
    }
    if opts.vocab_size <= RESERVED {
        bail!(
            "--vocab-size {} is too small: the special and byte-fallback pieces alone take {RESERVED}",
            opts.vocab_size
        );
    }
    if opts.min_frequency.is_some() && opts.model == SubwordModel::Unigram {
        bail!("--min-frequency applies to --model bpe only");
    }
    // Open every file first so that a missing one fails before minutes of work.
    let mut readers = inputs
        .iter()
        .map(|p| LineReader::open(p))
        .collect::<Result<Vec<_>>>()?;
    let specials: Vec<AddedToken> = [EOS.to_string(), UNK.to_string()]
        .into_iter()
        .chain(byte_pieces())
        .map(|s| AddedToken::from(s, true))
        .collect();
    let trained_size = opts.vocab_size - 1; // <pad> is added after training
    let (mut tok, mut trainer): (Tokenizer, TrainerWrapper) = match opts.model {
        SubwordModel::Bpe => (
            Tokenizer::new(BPE::default()),
            BpeTrainerBuilder::new()
                .vocab_size(trained_size)
                .min_frequency(opts.min_frequency.unwrap_or(0))
                .special_tokens(specials)
                .show_progress(opts.show_progress)
                .build()
                .into(),
        ),
        SubwordModel::Unigram => (
            Tokenizer::new(Unigram::default()),
            UnigramTrainerBuilder::default()
                .vocab_size(trained_size as u32)
                .special_tokens(specials)
                .unk_token(Some(UNK.into()))
                .show_progress(opts.show_progress)
                .build()
                .map_err(|e| anyhow!("unigram trainer: {e}"))?
                .into(),
        ),
    };
    let (normalizer, pre_tokenizer, decoder) = pipeline()?;
    tok.with_normalizer(Some(normalizer))
        .map_err(|e| anyhow!("tokenizer normalizer: {e}"))?;
    tok.with_pre_tokenizer(Some(pre_tokenizer))
        .with_decoder(Some(decoder));
    if opts.max_lines == 0 {
        bail!("--max-lines must be at least 1");
    }
    let lines = sample_lines(&mut readers, opts.max_lines, opts.seed)?;
    tok.train(&mut trainer, lines.into_iter())
        .map_err(|e| anyhow!("training the tokenizer failed: {e}"))?;
    if readers.iter().all(|r| r.empty_lines() == r.line_no()) {
        let names: Vec<String> = inputs.iter().map(|p| p.display().to_string()).collect();
        bail!(
            "{}: the corpus is empty (no non-empty lines); nothing to train on",
            names.join(", ")
        );
    }
    for r in &readers {
        if r.empty_lines() > 0 {
            eprintln!(
                "note: {}: {} of {} lines are empty",
                r.path().display(),
                r.empty_lines(),
                r.line_no()
            );
        }
    }
    let got = tok.get_vocab_size(false);
    if got > trained_size {
        bail!(
            "--vocab-size {} is smaller than the corpus alphabet plus {} special and byte pieces: \
             use at least {}",
            opts.vocab_size,
            RESERVED,
            got + 1
        );
    }
    // Byte pieces are ordinary vocabulary entries used by byte fallback, not special tokens
    // that would match literal "<0x41>" in the input.
    let mut value: serde_json::Value = serde_json::from_str(
        &tok.to_string(false)
            .map_err(|e| anyhow!("serialising the tokenizer: {e}"))?,
    )?;
    value["model"]["byte_fallback"] = json!(true);
    if let Some(added) = value["added_tokens"].as_array_mut() {
        added.retain(|t| t["content"] == EOS || t["content"] == UNK);
    }
    let mut tok = Tokenizer::from_str(&value.to_string())
        .map_err(|e| anyhow!("rebuilding the tokenizer: {e}"))?;
    tok.add_special_tokens([AddedToken::from(PAD, true)])
        .map_err(|e| anyhow!("adding {PAD}: {e}"))?;
    SubwordTokenizer::from_tokenizer(tok, Path::new("<trained>"))
}

/// Fails on a BPE merge (of `tokenizer.json`'s model) that makes a piece the vocabulary lacks,
/// joined as the tokenizers crate joins it (the second part without the model's
/// `continuing_subword_prefix`). Merges in a form the crate does not read are left to it.
fn check_merges(tokenizer: &serde_json::Value) -> std::result::Result<(), String> {
    let model = &tokenizer["model"];
    let (Some(vocab), Some(merges)) = (model["vocab"].as_object(), model["merges"].as_array())
    else {
        return Ok(());
    };
    if model["type"] != "BPE" {
        return Ok(());
    }
    let prefix = model["continuing_subword_prefix"]
        .as_str()
        .unwrap_or("")
        .len();
    for (i, merge) in merges.iter().enumerate() {
        let (a, b) = match merge {
            serde_json::Value::Array(p) if p.len() == 2 => match (p[0].as_str(), p[1].as_str()) {
                (Some(a), Some(b)) => (a, b),
                _ => continue,
            },
            serde_json::Value::String(s) => match s.split_once(' ') {
                Some(pair) => pair,
                None => continue,
            },
            _ => continue,
        };
        let piece = b.get(prefix..).map(|rest| format!("{a}{rest}"));
        if !piece.is_some_and(|p| vocab.contains_key(&p)) {
            return Err(format!(
                "merge {} ({a:?} + {b:?}) makes a piece that is not in the vocabulary",
                i + 1
            ));
        }
    }
    Ok(())
}

impl SubwordTokenizer {
    /// Loads a `tokenizer.json` and finds its special tokens.
    pub fn load(path: &Path) -> Result<Self> {
        let bytes = crate::io::read_input(path, "tokenizer.json")?;
        let text = String::from_utf8(bytes)
            .map_err(|_| anyhow!("{}: not a valid tokenizer.json (not UTF-8)", path.display()))?;
        let invalid = |e: &dyn std::fmt::Display| {
            anyhow!("{}: not a valid tokenizer.json: {e}", path.display())
        };
        // JSON syntax and BPE merges first: the tokenizers crate panics on a syntax error
        // inside its "decoder" object, and on a merge whose piece is not in the vocabulary
        // and longer than every piece that is, instead of returning an error.
        let value: serde_json::Value = serde_json::from_str(&text).map_err(|e| invalid(&e))?;
        check_merges(&value).map_err(|e| invalid(&e))?;
        // Any other panic of its checks of a malformed file becomes this file's error.
        let tok = std::panic::catch_unwind(|| Tokenizer::from_str(&text))
            .map_err(|panic| {
                let what = panic
                    .downcast_ref::<String>()
                    .map(String::as_str)
                    .or_else(|| panic.downcast_ref::<&str>().copied())
                    .unwrap_or("a panic");
                invalid(&format!("the tokenizers library failed on it ({what})"))
            })?
            .map_err(|e| invalid(&e))?;
        Self::from_tokenizer(tok, path)
    }

    /// A `tokenizer.json` file, or the tokenizer of a model folder ([`Self::load_dir`]).
    pub fn load_any(path: &Path) -> Result<Self> {
        if path.is_dir() {
            Self::load_dir(path)
        } else {
            Self::load(path)
        }
    }

    /// Loads the tokenizer of a model folder: its `tokenizer.json`, or else OPUS-MT's
    /// `source.spm`, `target.spm` and `vocab.json`.
    pub fn load_dir(dir: &Path) -> Result<Self> {
        if !opus::is_opus_dir(dir) {
            return Self::load(&dir.join("tokenizer.json"));
        }
        let vocab = OpusVocab::load(dir)?;
        let id = |piece| {
            vocab
                .special_id(piece)
                .expect("OpusVocab checks its specials")
        };
        Ok(Self {
            eos_id: id(EOS),
            unk_id: id(UNK),
            pad_id: id(PAD),
            path: vocab.path.clone(),
            backend: Backend::Opus(Arc::new(vocab)),
            words: None,
        })
    }

    /// Wraps a tokenizer, checking that it has `</s>`, `<unk>` and `<pad>`.
    pub fn from_tokenizer(inner: Tokenizer, path: &Path) -> Result<Self> {
        let id = |piece: &str| {
            inner
                .token_to_id(piece)
                .ok_or_else(|| anyhow!("{}: tokenizer has no {piece} token", path.display()))
        };
        let (normalizer, pre_tokenizer, _) = pipeline()?;
        let ours = serde_json::to_value(inner.get_normalizer())?
            == serde_json::to_value(Some(&normalizer))?
            && serde_json::to_value(inner.get_pre_tokenizer())?
                == serde_json::to_value(Some(&pre_tokenizer))?;
        let mut tok = Self {
            eos_id: id(EOS)?,
            unk_id: id(UNK)?,
            pad_id: id(PAD)?,
            path: path.to_path_buf(),
            backend: Backend::Hf(Box::new(inner)),
            words: None,
        };
        if ours {
            let two = tok.encode_ids(" ")?;
            let (a, b) = two.split_at(two.len() / 2);
            let Backend::Hf(inner) = &tok.backend else {
                unreachable!("built above")
            };
            let added = inner
                .get_added_tokens_decoder()
                .values()
                .map(|t| t.content.clone())
                .collect();
            if !a.is_empty() && a == b {
                tok.words = Some(WordSplit {
                    id: NEXT_TOKENIZER_ID.fetch_add(1, Ordering::Relaxed),
                    lone_space: a.to_vec(),
                    added,
                });
            }
        }
        Ok(tok)
    }

    /// The ids of one line, equal to [`Self::encode_ids`]'s, but each distinct word is
    /// encoded once per thread and then looked up: preparing a large corpus spends its time
    /// on new words only. Other tokenizers than nmt's own pipeline take the plain path.
    pub fn encode_ids_cached(&self, text: &str) -> Result<Vec<u32>> {
        let Some(split) = self
            .words
            .as_ref()
            .filter(|w| !w.added.iter().any(|a| text.contains(a.as_str())))
        else {
            return self.encode_ids(text);
        };
        WORDS.with_borrow_mut(|(owner, cache)| {
            if *owner != split.id || cache.len() >= WORD_CACHE_LIMIT {
                cache.clear();
                *owner = split.id;
            }
            let mut ids = Vec::new();
            if text.is_empty() {
                return Ok(ids);
            }
            for word in text.split(' ') {
                if word.is_empty() {
                    ids.extend_from_slice(&split.lone_space);
                } else if let Some(known) = cache.get(word) {
                    ids.extend_from_slice(known);
                } else {
                    let new = self.encode_ids(word)?;
                    ids.extend_from_slice(&new);
                    cache.insert(word.to_owned(), new);
                }
            }
            Ok(ids)
        })
    }

    /// Ids of a target line for training (no `</s>` appended): as [`Self::encode_ids_cached`]
    /// for one joint vocabulary; OPUS-MT segments targets with its `target.spm`.
    pub fn encode_target_ids(&self, text: &str) -> Result<Vec<u32>> {
        match &self.backend {
            Backend::Hf(_) => self.encode_ids_cached(text),
            Backend::Opus(vocab) => vocab.encode_target_ids(text),
        }
    }

    /// The files that define the tokenizer, by name and content: a `tokenizer.json`, or
    /// OPUS-MT's SentencePiece models and vocabulary (with its tokenizer_config.json).
    pub fn model_files(&self) -> Result<Vec<(String, Vec<u8>)>> {
        match &self.backend {
            Backend::Hf(_) => Ok(vec![(
                "tokenizer.json".into(),
                self.to_json()?.into_bytes(),
            )]),
            Backend::Opus(vocab) => {
                let dir = vocab.path.parent().unwrap_or(Path::new("."));
                let mut files = Vec::new();
                for name in opus::FILES.iter().chain(&["tokenizer_config.json"]) {
                    let p = dir.join(name);
                    if p.is_file() {
                        files.push((name.to_string(), crate::io::read_input(&p, "tokenizer")?));
                    }
                }
                Ok(files)
            }
        }
    }

    /// The tokenizer as the text of a `tokenizer.json`.
    pub fn to_json(&self) -> Result<String> {
        let Backend::Hf(inner) = &self.backend else {
            bail!(
                "{}: an OPUS-MT vocabulary cannot be written as tokenizer.json",
                self.path.display()
            );
        };
        inner
            .to_string(true)
            .map_err(|e| anyhow!("serialising the tokenizer: {e}"))
    }

    /// Writes `tokenizer.json` atomically.
    pub fn save(&self, path: &Path) -> Result<()> {
        crate::io::write_atomic(path, self.to_json()?.as_bytes())
    }

    /// Number of ids, specials included.
    pub fn vocab_size(&self) -> usize {
        match &self.backend {
            Backend::Hf(inner) => inner.get_vocab_size(true),
            Backend::Opus(vocab) => vocab.vocab_size(),
        }
    }

    /// Subword ids of one line (no `</s>` appended).
    pub fn encode_ids(&self, text: &str) -> Result<Vec<u32>> {
        match &self.backend {
            Backend::Hf(_) => Ok(self.encode(text)?.get_ids().to_vec()),
            Backend::Opus(vocab) => vocab.encode_ids(text),
        }
    }

    /// Subword pieces of one line.
    pub fn encode_pieces(&self, text: &str) -> Result<Vec<String>> {
        match &self.backend {
            Backend::Hf(_) => Ok(self.encode(text)?.get_tokens().to_vec()),
            Backend::Opus(vocab) => vocab.encode_pieces(text),
        }
    }

    /// Ids of many lines at once, in parallel.
    pub fn encode_batch(&self, texts: &[String]) -> Result<Vec<Vec<u32>>> {
        match &self.backend {
            Backend::Hf(inner) => {
                let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
                let encodings = inner
                    .encode_batch(refs, false)
                    .map_err(|e| anyhow!("{}: encoding failed: {e}", self.path.display()))?;
                Ok(encodings
                    .into_iter()
                    .map(|e| e.get_ids().to_vec())
                    .collect())
            }
            Backend::Opus(vocab) => texts.par_iter().map(|t| vocab.encode_ids(t)).collect(),
        }
    }

    fn encode(&self, text: &str) -> Result<tokenizers::Encoding> {
        let Backend::Hf(inner) = &self.backend else {
            unreachable!("only called for tokenizer.json backends")
        };
        inner
            .encode(text, false)
            .map_err(|e| anyhow!("{}: encoding failed: {e}", self.path.display()))
    }

    /// Text of a sequence of ids; special tokens are dropped.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        match &self.backend {
            Backend::Hf(inner) => inner
                .decode(ids, true)
                .map_err(|e| anyhow!("{}: decoding failed: {e}", self.path.display())),
            Backend::Opus(vocab) => Ok(vocab.decode(ids)),
        }
    }

    /// Which pieces of `ids` start a word of the text (a whitespace-separated word): those
    /// beginning with `▁`, except a lone `▁` followed by another such piece or by nothing,
    /// which is an extra space and starts no word.
    pub fn word_starts(&self, ids: &[u32]) -> Vec<bool> {
        let pieces: Vec<Option<String>> = ids
            .iter()
            .map(|&id| match &self.backend {
                Backend::Hf(inner) => inner.id_to_token(id),
                Backend::Opus(vocab) => vocab.id_to_piece(id).map(str::to_string),
            })
            .collect();
        let opens = |p: &Option<String>| p.as_deref().is_some_and(|p| p.starts_with('\u{2581}'));
        (0..pieces.len())
            .map(|i| {
                let lone = pieces[i].as_deref() == Some("\u{2581}");
                opens(&pieces[i]) && !(lone && pieces.get(i + 1).is_none_or(opens))
            })
            .collect()
    }

    /// The id of a piece, if it is in the vocabulary.
    pub fn piece_to_id(&self, piece: &str) -> Option<u32> {
        match &self.backend {
            Backend::Hf(inner) => inner.token_to_id(piece),
            Backend::Opus(vocab) => vocab.piece_to_id(piece),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use unicode_normalization::UnicodeNormalization;

    /// Accents (decomposed and composed), CJK, emoji, tabs, repeated, leading and trailing spaces.
    pub const SAMPLE: &[&str] = &[
        "Zwei junge weiße Männer sind im Freien.",
        "Cafe\u{301} crème, déjà vu — «naïve» façade!",
        "  leading spaces and trailing ones   ",
        "tabs\tin\t\tthe middle\t",
        "repeated    spaces  here",
        "東京で寿司を食べました。",
        "emoji 🙂👍🏽 and ZWJ 👩‍👩‍👧",
        "",
        " ",
        "Příliš žluťoučký kůň úpěl ďábelské ódy.",
        "numbers 3.14, 1,000 and (brackets) [x] {y} \"quotes\" 'single'",
    ];

    fn sample_corpus(dir: &Path) -> PathBuf {
        let p = dir.join("sample.txt");
        let mut text = String::new();
        for _ in 0..20 {
            text.push_str("Ein Mann fährt Fahrrad. A man rides a bike, quickly.\n");
            text.push_str("Zwei Hunde spielen im Schnee. Two dogs play in the snow!\n");
        }
        std::fs::write(&p, text).unwrap();
        p
    }

    /// BPE options for the tests' small corpora.
    fn options(vocab_size: usize) -> TrainOptions {
        TrainOptions {
            vocab_size,
            model: SubwordModel::Bpe,
            min_frequency: None,
            show_progress: false,
            max_lines: DEFAULT_MAX_LINES,
            seed: 1,
        }
    }

    fn round_trip(model: SubwordModel) {
        let dir = tempfile::tempdir().unwrap();
        let corpus = sample_corpus(dir.path());
        let opts = TrainOptions {
            model,
            ..options(400)
        };
        let tok = train(&[corpus], &opts).unwrap();
        assert_eq!((tok.eos_id, tok.unk_id), (0, 1));
        assert_eq!(tok.pad_id as usize, tok.vocab_size() - 1);
        for line in SAMPLE {
            let ids = tok.encode_ids(line).unwrap();
            assert!(!ids.contains(&tok.unk_id), "{line:?} produced <unk>");
            let back = tok.decode(&ids).unwrap();
            assert_eq!(back, line.nfc().collect::<String>(), "{model:?}");
        }
        // Saved and reloaded, it is the same tokenizer.
        let saved = dir.path().join("tokenizer.json");
        tok.save(&saved).unwrap();
        let again = SubwordTokenizer::load(&saved).unwrap();
        assert_eq!(
            again.encode_ids(SAMPLE[1]).unwrap(),
            tok.encode_ids(SAMPLE[1]).unwrap()
        );
    }

    #[test]
    fn bpe_round_trips_the_sample_exactly() {
        round_trip(SubwordModel::Bpe);
    }

    #[test]
    fn unigram_round_trips_the_sample_exactly() {
        round_trip(SubwordModel::Unigram);
    }

    #[test]
    fn cached_word_encoding_equals_whole_line_encoding() {
        let dir = tempfile::tempdir().unwrap();
        let corpus = sample_corpus(dir.path());
        let opts = options(400);
        let tok = train(&[corpus], &opts).unwrap();
        assert!(
            tok.words.is_some(),
            "nmt's own pipeline takes the cached path"
        );
        let extra = ["a </s> b", "x\u{2581}y", "a \u{301}b", "  ", "end "];
        for line in SAMPLE.iter().chain(&extra) {
            // Twice: the second time every word comes from the cache.
            for _ in 0..2 {
                assert_eq!(
                    tok.encode_ids_cached(line).unwrap(),
                    tok.encode_ids(line).unwrap(),
                    "{line:?}"
                );
            }
        }
    }

    #[test]
    fn a_line_budget_samples_the_training_text() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("lines.txt");
        std::fs::write(&p, (0..100).map(|i| format!("{i}\n")).collect::<String>()).unwrap();
        let sample = |max, seed| {
            let mut r = [LineReader::open(&p).unwrap()];
            sample_lines(&mut r, max, seed).unwrap()
        };
        let all = sample(1000, 1);
        assert_eq!(all, (0..100).map(|i| i.to_string()).collect::<Vec<_>>());
        let ten = sample(10, 1);
        assert_eq!(ten.len(), 10);
        let nums: Vec<usize> = ten.iter().map(|l| l.parse().unwrap()).collect();
        assert!(nums.windows(2).all(|w| w[0] < w[1]), "kept in input order");
        assert_eq!(ten, sample(10, 1));
        assert_ne!(ten, sample(10, 2));
    }

    #[test]
    fn punctuation_is_split_from_words() {
        let dir = tempfile::tempdir().unwrap();
        let corpus = sample_corpus(dir.path());
        let opts = options(400);
        let tok = train(&[corpus], &opts).unwrap();
        let pieces = tok.encode_pieces("bike,").unwrap();
        assert_eq!(pieces.last().map(String::as_str), Some(","), "{pieces:?}");
    }

    #[test]
    fn a_vocabulary_smaller_than_the_alphabet_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let corpus = sample_corpus(dir.path());
        let opts = options(RESERVED + 3);
        let err = train(&[corpus], &opts).err().unwrap().to_string();
        assert!(err.contains("smaller than the corpus alphabet"), "{err}");
    }
}
