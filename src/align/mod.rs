//! Word alignments read from the decoder's cross-attention (Marian's `--alignment`): the
//! attention of each target piece over the source pieces, of one decoder layer and one head
//! or the heads' mean, merged into the words the user sees on both sides (a piece that starts
//! with `▁` starts a word, as in SentencePiece and nmt's tokenizers, unless it is an extra
//! space), printed as Pharaoh `s-t` pairs (0-based) or as soft rows.

pub mod guided;
pub mod heatmap;

use crate::data::tokenizer::SubwordTokenizer;
use crate::decode::pad_batch;
use crate::model::Seq2Seq;
use anyhow::{bail, Result};

/// What `--alignment` prints.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum AlignMode {
    /// Each target word with the source word it attends to most.
    Hard,
    /// Every target word's weights over the source words.
    Soft,
    /// Every (source, target) word pair whose weight is at least this.
    Threshold(f32),
}

impl std::str::FromStr for AlignMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "hard" => Ok(AlignMode::Hard),
            "soft" => Ok(AlignMode::Soft),
            _ => match s.parse::<f32>() {
                Ok(p) if p > 0.0 && p <= 1.0 => Ok(AlignMode::Threshold(p)),
                _ => Err(format!(
                    "expected hard, soft or a threshold in (0, 1], not {s:?}"
                )),
            },
        }
    }
}

/// Which attention alignments are read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionSource {
    /// A decoder layer (0-based), or `None` for the mean over layers.
    pub layer: Option<usize>,
    /// A head, or `None` for the mean over heads.
    pub head: Option<usize>,
    /// The decoder position a target token's alignment is read at.
    pub position: AlignPosition,
}

/// The decoder position a target token's alignment is read (and guided alignment trains it)
/// at.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Default,
    serde::Serialize,
    serde::Deserialize,
    clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum AlignPosition {
    /// The position that predicts the token (Marian's): its attention has not seen the token.
    #[default]
    Predict,
    /// The next position, which reads the token as its input: its attention knows which word
    /// it is aligning.
    Read,
}

impl AlignPosition {
    /// The decoder position (row of a teacher-forced pass over `<s>` + target) at which target
    /// piece `t` is aligned.
    pub fn row(self, t: usize) -> usize {
        match self {
            Self::Predict => t,
            Self::Read => t + 1,
        }
    }
}

impl AttentionSource {
    /// The default for a model with `layers` decoder layers: the last layer's heads averaged
    /// (Marian's layer for alignments). On Multi30k de→en (3 decoder layers, 10 minutes of
    /// training) it agrees best with eflomal: AER 0.60, against 0.70 for the penultimate
    /// layer and 0.63 for the mean of all layers (`scripts/bench-align.sh`).
    pub fn default_for(layers: usize) -> Self {
        Self {
            layer: Some(layers.saturating_sub(1)),
            head: None,
            position: AlignPosition::Predict,
        }
    }
}

/// A source line and its translation aligned word by word.
#[derive(Debug, Clone, PartialEq)]
pub struct WordAlignment {
    /// The source's words (split at whitespace).
    pub source_words: Vec<String>,
    /// The translation's words.
    pub target_words: Vec<String>,
    /// `weights[t][s]`: how much target word t attends to source word s; each row sums to 1.
    pub weights: Vec<Vec<f32>>,
}

/// The word (0-based, at most `words - 1`) each piece belongs to: a piece starting a word
/// opens the next one; pieces before the first word start belong to the first.
pub fn piece_words(starts_word: &[bool], words: usize) -> Vec<usize> {
    let mut word: Option<usize> = None;
    starts_word
        .iter()
        .map(|&start| {
            if start {
                word = Some(word.map_or(0, |w| w + 1));
            }
            word.unwrap_or(0).min(words.saturating_sub(1))
        })
        .collect()
}

impl WordAlignment {
    /// Merges piece-level attention `rows[t][s]` (target pieces × source pieces, `</s>` on
    /// neither side) into words: each source word gets the sum over its pieces, each target
    /// word the mean of its pieces' rows, and each row is normalised to sum to 1.
    pub fn from_pieces(
        rows: &[Vec<f32>],
        source_words: Vec<String>,
        target_words: Vec<String>,
        source_starts: &[bool],
        target_starts: &[bool],
    ) -> Result<Self> {
        if rows.len() != target_starts.len() || rows.iter().any(|r| r.len() != source_starts.len())
        {
            bail!(
                "attention rows do not match the pieces: {} rows for {} target pieces",
                rows.len(),
                target_starts.len()
            );
        }
        let (ns, nt) = (source_words.len(), target_words.len());
        let src_of = piece_words(source_starts, ns);
        let tgt_of = piece_words(target_starts, nt);
        let mut weights = vec![vec![0f32; ns]; nt];
        if ns > 0 && nt > 0 {
            for (row, &t) in rows.iter().zip(&tgt_of) {
                for (&p, &s) in row.iter().zip(&src_of) {
                    weights[t][s] += p;
                }
            }
            for row in &mut weights {
                let sum: f32 = row.iter().sum();
                if sum > 0.0 {
                    row.iter_mut().for_each(|w| *w /= sum);
                } else {
                    row.iter_mut().for_each(|w| *w = 1.0 / ns as f32);
                }
            }
        }
        Ok(Self {
            source_words,
            target_words,
            weights,
        })
    }

    /// Pharaoh pairs (source word, target word), sorted: for `Hard` each target word's most
    /// attended source word (the first on ties), for `Threshold(p)` every pair with weight ≥ p;
    /// `Soft` gives the pairs of `Hard`.
    pub fn pairs(&self, mode: AlignMode) -> Vec<(usize, usize)> {
        let mut pairs = Vec::new();
        for (t, row) in self.weights.iter().enumerate() {
            match mode {
                AlignMode::Threshold(p) => {
                    pairs.extend(
                        row.iter()
                            .enumerate()
                            .filter(|(_, &w)| w >= p)
                            .map(|(s, _)| (s, t)),
                    );
                }
                AlignMode::Hard | AlignMode::Soft => {
                    let best =
                        row.iter()
                            .enumerate()
                            .fold(None, |best: Option<(usize, f32)>, (s, &w)| match best {
                                Some((_, bw)) if bw >= w => best,
                                _ => Some((s, w)),
                            });
                    pairs.extend(best.map(|(s, _)| (s, t)));
                }
            }
        }
        pairs.sort_unstable();
        pairs
    }

    /// The text after `|||` in Marian's output: `s-t` pairs, or for `Soft` one group per
    /// target word of comma-separated weights over the source words.
    pub fn format(&self, mode: AlignMode) -> String {
        match mode {
            AlignMode::Soft => self
                .weights
                .iter()
                .map(|row| {
                    row.iter()
                        .map(|w| format!("{w:.6}"))
                        .collect::<Vec<_>>()
                        .join(",")
                })
                .collect::<Vec<_>>()
                .join(" "),
            _ => self
                .pairs(mode)
                .iter()
                .map(|(s, t)| format!("{s}-{t}"))
                .collect::<Vec<_>>()
                .join(" "),
        }
    }
}

/// Word alignments of (source ids with `</s>`, hypothesis ids without it) pairs, from one
/// teacher-forced pass of the model over the batch: the attention of each hypothesis token
/// as it was predicted, as during search.
pub fn align(
    model: &Seq2Seq,
    tokenizer: &SubwordTokenizer,
    pairs: &[(&[u32], &[u32])],
    source: AttentionSource,
) -> Result<Vec<WordAlignment>> {
    let (layers, heads) = (
        model.config.decoder_layers,
        model.config.decoder_attention_heads,
    );
    if let Some(l) = source.layer.filter(|&l| l >= layers) {
        bail!("--alignment-layer {l}: the model has {layers} decoder layers (0-based)");
    }
    if let Some(h) = source.head.filter(|&h| h >= heads) {
        bail!("--alignment-head {h}: the model has {heads} heads (0-based)");
    }
    if pairs.is_empty() {
        return Ok(Vec::new());
    }
    let start = model.config.decoder_start_token_id;
    let srcs: Vec<Vec<u32>> = pairs.iter().map(|(s, _)| s.to_vec()).collect();
    let tgts: Vec<Vec<u32>> = pairs
        .iter()
        .map(|(_, t)| std::iter::once(start).chain(t.iter().copied()).collect())
        .collect();
    let (src_ids, tgt_in) = (pad_batch(model, &srcs)?, pad_batch(model, &tgts)?);
    let probs = match source.layer {
        Some(l) => model.cross_attention(&src_ids, &tgt_in, l)?,
        None => {
            let all = (0..layers)
                .map(|l| model.cross_attention(&src_ids, &tgt_in, l))
                .collect::<Result<Vec<_>>>()?;
            (candle_core::Tensor::stack(&all, 0)?.sum(0)? / layers as f64)?
        }
    };
    let probs = match source.head {
        Some(h) => probs.narrow(1, h, 1)?.squeeze(1)?,
        None => probs.mean(1)?,
    };
    let probs = probs.to_dtype(candle_core::DType::F32)?.to_vec3::<f32>()?;
    pairs
        .iter()
        .zip(probs)
        .map(|((src, tgt), rows)| {
            // Rows of the hypothesis' tokens (not of the final `</s>`), columns of the source
            // pieces (not its `</s>`).
            let src = &src[..src.len().saturating_sub(1)];
            let rows: Vec<Vec<f32>> = (0..tgt.len())
                .map(|t| rows[source.position.row(t)][..src.len()].to_vec())
                .collect();
            let words = |ids: &[u32]| -> Result<Vec<String>> {
                Ok(tokenizer
                    .decode(ids)?
                    .split_whitespace()
                    .map(str::to_string)
                    .collect())
            };
            WordAlignment::from_pieces(
                &rows,
                words(src)?,
                words(tgt)?,
                &tokenizer.word_starts(src),
                &tokenizer.word_starts(tgt),
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(s: &str) -> Vec<String> {
        s.split_whitespace().map(str::to_string).collect()
    }

    #[test]
    fn pieces_merge_into_words() {
        // ▁Zwei ▁jung e ▁Männer .  →  Zwei | junge | Männer.
        assert_eq!(
            piece_words(&[true, true, false, true, false], 3),
            [0, 1, 1, 2, 2]
        );
        // A leading piece without ▁ joins the first word; extra word starts are clamped.
        assert_eq!(piece_words(&[false, true, true, true], 2), [0, 0, 1, 1]);
    }

    #[test]
    fn a_hand_made_matrix_gives_the_expected_alignments() {
        // Source pieces: ▁Ein ▁Hund e  (2 words); target pieces: ▁A ▁dog gie ▁runs (3 words).
        let rows = vec![
            vec![0.8, 0.1, 0.1],
            vec![0.2, 0.5, 0.3],
            vec![0.1, 0.6, 0.3],
            vec![0.5, 0.25, 0.25],
        ];
        let a = WordAlignment::from_pieces(
            &rows,
            words("Ein Hunde"),
            words("A doggie runs"),
            &[true, true, false],
            &[true, true, false, true],
        )
        .unwrap();
        let close = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-6);
        assert!(close(&a.weights[0], &[0.8, 0.2]));
        assert!(close(&a.weights[1], &[0.15, 0.85]));
        assert!(close(&a.weights[2], &[0.5, 0.5]));
        // Ties go to the first source word.
        assert_eq!(a.format(AlignMode::Hard), "0-0 0-2 1-1");
        assert_eq!(a.format(AlignMode::Threshold(0.5)), "0-0 0-2 1-1 1-2");
        assert_eq!(
            a.format(AlignMode::Soft),
            "0.800000,0.200000 0.150000,0.850000 0.500000,0.500000"
        );
        for (s, t) in a.pairs(AlignMode::Threshold(0.01)) {
            assert!(s < 2 && t < 3);
        }
    }

    #[test]
    fn modes_parse_as_marian_spells_them() {
        assert_eq!("hard".parse::<AlignMode>(), Ok(AlignMode::Hard));
        assert_eq!("soft".parse::<AlignMode>(), Ok(AlignMode::Soft));
        assert_eq!("0.3".parse::<AlignMode>(), Ok(AlignMode::Threshold(0.3)));
        assert!("1.5".parse::<AlignMode>().is_err());
        assert!("hardest".parse::<AlignMode>().is_err());
    }
}
