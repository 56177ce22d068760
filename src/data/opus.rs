//! The OPUS-MT / Marian tokenizer: `source.spm` segments the input, `vocab.json` maps pieces to
//! model ids, `target.spm` turns output pieces back into text — transformers'
//! `MarianTokenizer`, without Python. Owns the folder's vocabulary files; it does not touch the
//! model weights.

use crate::data::spm::{SpmModel, SPACE};
use crate::data::{EOS, PAD, UNK};
use crate::eval::tokenizers::is_py_space;
use anyhow::{anyhow, bail, Context, Result};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// The files that make an OPUS-MT tokenizer, beside config.json.
pub const FILES: &[&str] = &["source.spm", "target.spm", "vocab.json"];

/// A Marian vocabulary with its two SentencePiece models.
pub struct OpusVocab {
    source: SpmModel,
    target: SpmModel,
    encoder: HashMap<String, u32>,
    decoder: Vec<String>,
    /// `</s>`, `<unk>`, `<pad>` and their ids: kept whole in the input, dropped from the output.
    specials: Vec<(String, u32)>,
    unk_id: u32,
    /// The vocabulary file.
    pub path: PathBuf,
}

/// Whether `dir` holds an OPUS-MT tokenizer (and no tokenizer.json).
pub fn is_opus_dir(dir: &Path) -> bool {
    !dir.join("tokenizer.json").exists() && FILES.iter().all(|f| dir.join(f).is_file())
}

impl OpusVocab {
    /// Reads `source.spm`, `target.spm` and `vocab.json` from a model folder.
    pub fn load(dir: &Path) -> Result<Self> {
        let config = dir.join("tokenizer_config.json");
        if config.is_file() {
            let text = std::fs::read_to_string(&config)
                .with_context(|| format!("{}: cannot read", config.display()))?;
            let json: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| anyhow!("{}: not valid JSON: {e}", config.display()))?;
            if json.get("separate_vocabs") == Some(&serde_json::Value::Bool(true)) {
                bail!(
                    "{}: separate source and target vocabularies are not supported",
                    config.display()
                );
            }
        }
        let path = dir.join("vocab.json");
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("{}: cannot read vocabulary", path.display()))?;
        let encoder: HashMap<String, u32> = serde_json::from_str(&text)
            .map_err(|e| anyhow!("{}: not a JSON object of piece → id: {e}", path.display()))?;
        let size = encoder.len();
        let mut decoder = vec![None; size];
        for (piece, &id) in &encoder {
            let slot = decoder.get_mut(id as usize).ok_or_else(|| {
                anyhow!(
                    "{}: id {id} of {piece:?} is outside 0..{size}",
                    path.display()
                )
            })?;
            if let Some(other) = slot.replace(piece.clone()) {
                bail!(
                    "{}: id {id} is given to both {other:?} and {piece:?}",
                    path.display()
                );
            }
        }
        let decoder: Vec<String> = decoder.into_iter().map(Option::unwrap_or_default).collect();
        let id = |piece: &str| {
            encoder
                .get(piece)
                .copied()
                .ok_or_else(|| anyhow!("{}: no {piece} entry", path.display()))
        };
        let specials = vec![
            (EOS.to_string(), id(EOS)?),
            (UNK.to_string(), id(UNK)?),
            (PAD.to_string(), id(PAD)?),
        ];
        Ok(Self {
            source: SpmModel::load(&dir.join("source.spm"))?,
            target: SpmModel::load(&dir.join("target.spm"))?,
            unk_id: id(UNK)?,
            encoder,
            decoder,
            specials,
            path,
        })
    }

    /// Number of ids.
    pub fn vocab_size(&self) -> usize {
        self.decoder.len()
    }

    /// The id of a special token.
    pub fn special_id(&self, piece: &str) -> Option<u32> {
        self.specials
            .iter()
            .find(|(p, _)| p == piece)
            .map(|&(_, id)| id)
    }

    /// The id of a piece, if it is in the vocabulary.
    pub fn piece_to_id(&self, piece: &str) -> Option<u32> {
        self.encoder.get(piece).copied()
    }

    /// The piece of an id, if the vocabulary has one.
    pub fn id_to_piece(&self, id: u32) -> Option<&str> {
        self.decoder.get(id as usize).map(String::as_str)
    }

    /// Pieces of a source line: special tokens written in the text are kept whole, a leading
    /// `>>xx<<` language code is one piece, the rest is segmented by `source.spm`.
    pub fn encode_pieces(&self, text: &str) -> Result<Vec<String>> {
        self.pieces(text, &self.source)
    }

    /// Ids of a target line for training, as `MarianTokenizer(text_target=…)` makes them: the
    /// same rules with `target.spm` (no `</s>` appended).
    pub fn encode_target_ids(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self.ids(&self.pieces(text, &self.target)?))
    }

    fn ids(&self, pieces: &[String]) -> Vec<u32> {
        pieces
            .iter()
            .map(|p| self.piece_to_id(p).unwrap_or(self.unk_id))
            .collect()
    }

    fn pieces(&self, text: &str, spm: &SpmModel) -> Result<Vec<String>> {
        let mut out = Vec::new();
        let mut rest = text;
        while !rest.is_empty() {
            let next = self
                .specials
                .iter()
                .filter_map(|(p, _)| rest.find(p.as_str()).map(|at| (at, p)))
                .min_by_key(|&(at, p)| (at, std::cmp::Reverse(p.len())));
            let (chunk, special) = match next {
                Some((at, p)) => (&rest[..at], Some(p)),
                None => (rest, None),
            };
            if !chunk.is_empty() {
                encode_chunk(spm, chunk, &mut out)?;
            }
            match special {
                Some(p) => {
                    out.push(p.clone());
                    rest = &rest[chunk.len() + p.len()..];
                }
                None => break,
            }
        }
        Ok(out)
    }

    /// Ids of a source line (no `</s>` appended).
    pub fn encode_ids(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self.ids(&self.encode_pieces(text)?))
    }

    /// Text of output ids: special tokens dropped, pieces joined by `target.spm`, `▁` made a
    /// space and the ends stripped (as `MarianTokenizer.decode(skip_special_tokens=True)`).
    pub fn decode(&self, ids: &[u32]) -> String {
        let pieces: Vec<String> = ids
            .iter()
            .filter(|id| !self.specials.iter().any(|(_, s)| s == *id))
            .map(|&id| match self.decoder.get(id as usize) {
                Some(p) if !p.is_empty() => p.clone(),
                _ => UNK.to_string(),
            })
            .collect();
        let text = self.target.decode(&pieces).replace(SPACE, " ");
        text.trim_matches(is_py_space).to_string()
    }
}

/// Appends the pieces of a chunk without special tokens: a leading `>>xx<<` language code
/// whole, the rest as `spm` segments it.
fn encode_chunk(spm: &SpmModel, chunk: &str, out: &mut Vec<String>) -> Result<()> {
    let mut text = chunk;
    if let Some(end) = chunk.strip_prefix(">>").and_then(|r| r.find("<<")) {
        out.push(chunk[..end + 4].to_string());
        text = &chunk[end + 4..];
    }
    out.extend(spm.encode(text)?);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_are_segmented_with_target_spm() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/opus-tiny");
        let vocab = OpusVocab::load(&dir).unwrap();
        let text = "A woman wears a white hat.";
        let want: Vec<u32> = vocab
            .target
            .encode(text)
            .unwrap()
            .iter()
            .map(|p| vocab.piece_to_id(p).unwrap_or(vocab.unk_id))
            .collect();
        assert_eq!(vocab.encode_target_ids(text).unwrap(), want);
        // The two models segment differently: the source side is not what targets get.
        assert_ne!(vocab.encode_ids(text).unwrap(), want);
    }
}
