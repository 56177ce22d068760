//! The one path from text to translation, used by `nmt translate`, `nmt eval --model` and
//! validation during training: lines tokenized, sorted by length into batches, searched
//! (greedy or beam), detokenized, returned in input order; and `nmt translate`'s streaming of
//! lines from a reader in windows filled from what is available.

use crate::checkpoint::LoadedModel;
use crate::data::corpus::LineReader;
use crate::data::tokenizer::SubwordTokenizer;
use crate::decode::{self, beam};
use crate::model::Seq2Seq;
use anyhow::Result;
use std::io::Write;
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
        }
    }
}

/// One translated sentence: its hypotheses, best first.
#[derive(Debug, Clone)]
pub struct Translation {
    /// (text, score, token count) per hypothesis; greedy has one, scored only when asked.
    /// A score is the summed log-probability over the length penalty, as in beam search.
    pub hypotheses: Vec<(String, f64, usize)>,
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
    let max_src = model.config.max_position_embeddings;
    let mut out: Vec<Translation> = vec![
        Translation {
            hypotheses: vec![(String::new(), 0.0, 0)]
        };
        lines.len()
    ];
    let mut todo: Vec<(usize, Vec<u32>)> = Vec::new();
    let encoded = tokenizer.encode_batch(lines)?;
    for (i, (line, mut ids)) in lines.iter().zip(encoded).enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        if ids.len() > max_src - 1 {
            eprintln!(
                "warning: line {}: {} tokens, truncated to the model's {} positions",
                first_line_no + i,
                ids.len(),
                max_src - 1
            );
            ids.truncate(max_src - 1);
        }
        ids.push(tokenizer.eos_id);
        todo.push((i, ids));
    }
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
    todo: &[(usize, Vec<u32>)],
    opts: &SearchOptions,
    out: &mut [Translation],
) -> Result<()> {
    let srcs: Vec<Vec<u32>> = todo.iter().map(|(_, ids)| ids.clone()).collect();
    let lens: Vec<usize> = srcs
        .iter()
        .map(|s| decode::max_len(model, s.len(), opts.max_len_a, opts.max_len_b))
        .collect();
    let bo = beam::BeamOptions {
        beam: opts.beam,
        length_penalty: opts.length_penalty,
        gnmt: opts.gnmt,
    };
    if opts.beam <= 1 {
        let found = decode::greedy(model, &srcs, &lens, opts.scores)?;
        for ((i, _), (ids, log_prob)) in todo.iter().zip(found) {
            out[*i] = Translation {
                hypotheses: vec![(
                    tokenizer.decode(&ids)?,
                    log_prob / bo.penalty(ids.len() + 1),
                    ids.len(),
                )],
            };
        }
    } else {
        for ((i, _), hyps) in todo.iter().zip(beam::beam_search(model, &srcs, &lens, bo)?) {
            let hypotheses = hyps
                .iter()
                .take(opts.nbest.max(1))
                .map(|h| Ok((tokenizer.decode(&h.tokens)?, h.score, h.tokens.len())))
                .collect::<Result<_>>()?;
            out[*i] = Translation { hypotheses };
        }
    }
    Ok(())
}

/// How to print translations.
#[derive(Debug, Clone, Copy)]
pub struct OutputFormat {
    /// `i ||| hypothesis ||| score` lines for every hypothesis.
    pub nbest: bool,
    /// Append a tab and the score.
    pub scores: bool,
    /// JSON lines.
    pub json: bool,
}

fn write_translation(
    out: &mut impl Write,
    index: usize,
    source: &str,
    t: &Translation,
    f: OutputFormat,
) -> Result<()> {
    if f.json {
        let hyps: Vec<_> = t.hypotheses.iter().map(|(text, score, n)| serde_json::json!({"translation": text, "score": score, "tokens": n})).collect();
        let best = &t.hypotheses[0];
        writeln!(
            out,
            "{}",
            serde_json::json!({"line": index + 1, "source": source, "translation": best.0, "score": best.1, "hypotheses": hyps})
        )?;
    } else if f.nbest {
        for (text, score, _) in &t.hypotheses {
            writeln!(out, "{index} ||| {text} ||| {score:.6}")?;
        }
    } else if f.scores {
        writeln!(out, "{}\t{:.6}", t.hypotheses[0].0, t.hypotheses[0].1)?;
    } else {
        writeln!(out, "{}", t.hypotheses[0].0)?;
    }
    Ok(())
}

/// Reads `input` to the end, translating windows of at most `window` lines made of the lines
/// already available (so an interactive line is translated when Enter is pressed; a file is
/// read `window` lines at a time, like Marian's maxi-batch), and writes one result per input
/// line, in order, flushing after each window.
pub fn stream(
    m: &LoadedModel,
    mut input: LineReader,
    out: &mut impl Write,
    window: usize,
    opts: &SearchOptions,
    f: OutputFormat,
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
                match rx.try_recv() {
                    Ok(Ok(l)) => batch.push(l),
                    Ok(Err(e)) => {
                        failure = Some(e);
                        break;
                    }
                    Err(_) => break,
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
