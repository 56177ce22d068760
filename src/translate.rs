//! The one path from text to translation, used by `nmt translate`, `nmt eval --model`,
//! validation during training and `nmt serve`: lines tokenized, sorted by length into
//! batches, searched (greedy or beam), detokenized, returned in input order; and
//! `nmt translate`'s streaming of lines from a reader in windows filled from what is available.

use crate::align::{self, AlignMode, AttentionSource, WordAlignment};
use crate::checkpoint::LoadedModel;
use crate::data::corpus::LineReader;
use crate::data::tokenizer::SubwordTokenizer;
use crate::decode::{self, beam};
use crate::model::Seq2Seq;
use anyhow::Result;
use std::io::Write;
use std::path::PathBuf;
use std::sync::mpsc;

/// Search settings for a translation run; `Default` is greedy search with the output limit
/// 1.5 · source length + 10 in batches of 64, the defaults of `nmt translate`.
#[derive(Debug, Clone, Copy)]
pub struct SearchOptions {
    /// Beam size (1: greedy).
    pub beam: usize,
    /// Length penalty α.
    pub length_penalty: f64,
    /// GNMT length normalisation.
    pub gnmt: bool,
    /// Hypotheses per sentence to return (≤ beam).
    pub nbest: usize,
    /// Output length limit a·src_len + b: a.
    pub max_len_a: f64,
    /// Output length limit a·src_len + b: b.
    pub max_len_b: usize,
    /// Sentences decoded together (after sorting by length).
    pub batch_size: usize,
    /// Score greedy hypotheses too (beam search always does); it costs a pass over the
    /// vocabulary per step.
    pub scores: bool,
    /// Align every hypothesis with its source, word by word, from this attention.
    pub alignment: Option<AttentionSource>,
}

impl Default for SearchOptions {
    fn default() -> Self {
        Self {
            beam: 1,
            length_penalty: 1.0,
            gnmt: false,
            nbest: 1,
            max_len_a: 1.5,
            max_len_b: 10,
            batch_size: 64,
            scores: false,
            alignment: None,
        }
    }
}

/// One translated sentence: its hypotheses, best first (greedy search has one).
#[derive(Debug, Clone)]
pub struct Translation {
    /// The hypotheses.
    pub hypotheses: Vec<Hypothesis>,
}

/// One translation of a sentence.
#[derive(Debug, Clone, Default)]
pub struct Hypothesis {
    /// The text.
    pub text: String,
    /// Summed log-probability over the length penalty, as beam search ranks; greedy search
    /// scores only when asked.
    pub score: f64,
    /// Its tokens, `</s>` not counted.
    pub tokens: usize,
    /// Its word alignment with the source, when asked for.
    pub alignment: Option<WordAlignment>,
}

impl Translation {
    /// The best hypothesis' text.
    pub fn text(&self) -> &str {
        &self.hypotheses[0].text
    }
}

/// Translates lines, sorted by length into batches of `opts.batch_size`; empty lines give
/// empty translations without touching the model, and lines longer than the model's
/// positions are truncated with a warning. Results come back in the order of `lines`.
pub fn translate_batch(
    model: &Seq2Seq,
    tokenizer: &SubwordTokenizer,
    lines: &[String],
    first_line_no: usize,
    opts: &SearchOptions,
) -> Result<Vec<Translation>> {
    let sources = encode_sources(model, tokenizer, lines, |i, n, max| {
        eprintln!(
            "warning: line {}: {n} tokens, truncated to the model's {max} positions",
            first_line_no + i
        )
    })?;
    translate_sources(model, tokenizer, &sources, opts)
}

/// Source ids as the model reads them, `</s>` appended; `None` for an empty line. A line
/// longer than the model's positions is truncated, and `truncated(index, tokens, kept)` is
/// called for it.
pub fn encode_sources(
    model: &Seq2Seq,
    tokenizer: &SubwordTokenizer,
    lines: &[String],
    mut truncated: impl FnMut(usize, usize, usize),
) -> Result<Vec<Option<Vec<u32>>>> {
    let keep = model.config.max_position_embeddings - 1;
    let encoded = tokenizer.encode_batch(lines)?;
    Ok(lines
        .iter()
        .zip(encoded)
        .enumerate()
        .map(|(i, (line, mut ids))| {
            if line.trim().is_empty() {
                return None;
            }
            if ids.len() > keep {
                truncated(i, ids.len(), keep);
                ids.truncate(keep);
            }
            ids.push(tokenizer.eos_id);
            Some(ids)
        })
        .collect())
}

/// Translates sources made by [`encode_sources`], sorted by length into batches of
/// `opts.batch_size`; results in the order of `sources`, an empty translation for `None`.
pub fn translate_sources(
    model: &Seq2Seq,
    tokenizer: &SubwordTokenizer,
    sources: &[Option<Vec<u32>>],
    opts: &SearchOptions,
) -> Result<Vec<Translation>> {
    let mut out: Vec<Translation> = vec![
        Translation {
            hypotheses: vec![Hypothesis::default()]
        };
        sources.len()
    ];
    let mut todo: Vec<(usize, &[u32])> = sources
        .iter()
        .enumerate()
        .filter_map(|(i, ids)| Some((i, ids.as_deref()?)))
        .collect();
    todo.sort_by_key(|(_, ids)| ids.len());
    // Batches of similar lengths: less padding, and sentences that end at about the same step.
    for chunk in todo.chunks(opts.batch_size.max(1)) {
        decode_sorted(model, tokenizer, chunk, opts, &mut out)?;
    }
    Ok(out)
}

/// Decodes one batch of (line index, source ids) into `out`.
fn decode_sorted(
    model: &Seq2Seq,
    tokenizer: &SubwordTokenizer,
    todo: &[(usize, &[u32])],
    opts: &SearchOptions,
    out: &mut [Translation],
) -> Result<()> {
    let srcs: Vec<Vec<u32>> = todo.iter().map(|(_, ids)| ids.to_vec()).collect();
    let lens: Vec<usize> = srcs
        .iter()
        .map(|s| decode::max_len(model, s.len(), opts.max_len_a, opts.max_len_b))
        .collect();
    let bo = beam::BeamOptions {
        beam: opts.beam,
        length_penalty: opts.length_penalty,
        gnmt: opts.gnmt,
    };
    // Token ids of each sentence's hypotheses, with their scores.
    let found: Vec<Vec<(Vec<u32>, f64)>> = if opts.beam <= 1 {
        decode::greedy(model, &srcs, &lens, opts.scores)?
            .into_iter()
            .map(|(ids, log_prob)| {
                let score = log_prob / bo.penalty(ids.len() + 1);
                vec![(ids, score)]
            })
            .collect()
    } else {
        beam::beam_search(model, &srcs, &lens, bo)?
            .into_iter()
            .map(|hyps| {
                hyps.into_iter()
                    .take(opts.nbest.max(1))
                    .map(|h| (h.tokens, h.score))
                    .collect()
            })
            .collect()
    };
    let mut alignments = match opts.alignment {
        Some(source) => {
            let pairs: Vec<(&[u32], &[u32])> = srcs
                .iter()
                .zip(&found)
                .flat_map(|(src, hyps)| {
                    hyps.iter()
                        .map(move |(ids, _)| (src.as_slice(), ids.as_slice()))
                })
                .collect();
            align::align(model, tokenizer, &pairs, source)?
                .into_iter()
                .map(Some)
                .collect()
        }
        None => Vec::new(),
    }
    .into_iter();
    for ((i, _), hyps) in todo.iter().zip(found) {
        let hypotheses = hyps
            .into_iter()
            .map(|(ids, score)| {
                Ok(Hypothesis {
                    text: tokenizer.decode(&ids)?,
                    score,
                    tokens: ids.len(),
                    alignment: alignments.next().flatten(),
                })
            })
            .collect::<Result<_>>()?;
        out[*i] = Translation { hypotheses };
    }
    Ok(())
}

/// How to print translations.
#[derive(Debug, Clone, Default)]
pub struct OutputFormat {
    /// `i ||| hypothesis ||| score` lines for every hypothesis.
    pub nbest: bool,
    /// Append a tab and the score.
    pub scores: bool,
    /// JSON lines.
    pub json: bool,
    /// Append ` ||| ` and the word alignment (Marian's format).
    pub alignment: Option<AlignMode>,
    /// Draw each line's attention (best hypothesis) as `line-NNNNNN.png` in this folder.
    pub attention_png: Option<PathBuf>,
}

fn write_translation(
    out: &mut impl Write,
    index: usize,
    source: &str,
    t: &Translation,
    f: &OutputFormat,
) -> Result<()> {
    // An empty line (no hypothesis to align) gets an empty alignment.
    let aligned = |h: &Hypothesis| match (f.alignment, &h.alignment) {
        (Some(mode), Some(a)) => format!(" ||| {}", a.format(mode)),
        (Some(_), None) => " ||| ".to_string(),
        (None, _) => String::new(),
    };
    if f.json {
        let hyps: Vec<_> = t
            .hypotheses
            .iter()
            .map(|h| {
                let mut v = serde_json::json!({"translation": h.text, "score": h.score, "tokens": h.tokens});
                if let (Some(mode), Some(a)) = (f.alignment, &h.alignment) {
                    v["source_words"] = serde_json::json!(a.source_words);
                    v["target_words"] = serde_json::json!(a.target_words);
                    v["alignment"] = serde_json::json!(a.pairs(mode));
                    if mode == AlignMode::Soft {
                        v["attention"] = serde_json::json!(a.weights);
                    }
                }
                v
            })
            .collect();
        let mut line = serde_json::json!({"line": index + 1, "source": source, "translation": t.text(), "score": t.hypotheses[0].score});
        if f.alignment.is_some() {
            for key in ["source_words", "target_words", "alignment", "attention"] {
                if let Some(v) = hyps[0].get(key) {
                    line[key] = v.clone();
                }
            }
        }
        line["hypotheses"] = serde_json::Value::Array(hyps);
        writeln!(out, "{line}")?;
    } else if f.nbest {
        for h in &t.hypotheses {
            writeln!(
                out,
                "{index} ||| {}{} ||| {:.6}",
                h.text,
                aligned(h),
                h.score
            )?;
        }
    } else if f.scores {
        writeln!(
            out,
            "{}{}\t{:.6}",
            t.text(),
            aligned(&t.hypotheses[0]),
            t.hypotheses[0].score
        )?;
    } else {
        writeln!(out, "{}{}", t.text(), aligned(&t.hypotheses[0]))?;
    }
    if let (Some(dir), Some(a)) = (&f.attention_png, &t.hypotheses[0].alignment) {
        if !a.target_words.is_empty() && !a.source_words.is_empty() {
            crate::align::heatmap::draw(a, &dir.join(format!("line-{:06}.png", index + 1)))?;
        }
    }
    Ok(())
}

/// Reads `input` to the end, translating windows of `window` lines (the last one shorter),
/// like Marian's maxi-batch, and writes one result per input line, in order, flushing after
/// each window. The windows do not depend on how fast the input arrives, so a file translates
/// alike every time (sentences batched together share padding and kernel shapes, which can
/// move a score in its last bits and, through int8 rounding, a word). `interactive` input (a
/// terminal) is translated as it comes instead: a window holds the lines already typed.
pub fn stream(
    m: &LoadedModel,
    mut input: LineReader,
    out: &mut impl Write,
    window: usize,
    interactive: bool,
    opts: &SearchOptions,
    f: &OutputFormat,
) -> Result<()> {
    let (tx, rx) = mpsc::sync_channel::<Result<String>>(window.max(1) * 2);
    let reader = std::thread::spawn(move || {
        for line in input.by_ref() {
            let stop = line.is_err();
            if tx.send(line).is_err() || stop {
                break;
            }
        }
    });
    let mut index = 0;
    let result = (|| -> Result<()> {
        while let Ok(first) = rx.recv() {
            let mut batch = vec![first?];
            let mut failure = None;
            while batch.len() < window.max(1) {
                let next = if interactive {
                    rx.try_recv().ok()
                } else {
                    rx.recv().ok()
                };
                match next {
                    Some(Ok(l)) => batch.push(l),
                    Some(Err(e)) => {
                        failure = Some(e);
                        break;
                    }
                    None => break,
                }
            }
            let translations = translate_batch(&m.model, &m.tokenizer, &batch, index + 1, opts)?;
            for (src, t) in batch.iter().zip(&translations) {
                write_translation(out, index, src, t, f)?;
                index += 1;
            }
            out.flush()?;
            if let Some(e) = failure {
                return Err(e);
            }
        }
        Ok(())
    })();
    drop(rx);
    let _ = reader.join();
    result
}
