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
#[derive(Debug, Clone, Copy, PartialEq)]
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
    /// Batches decoded at once, each by its own search on its share of the cores
    /// ([`crate::runtime::worker_pools`]); 1 decodes one batch at a time on every core.
    pub workers: usize,
}

impl SearchOptions {
    /// Checks the settings against the model they will decode with, naming the command-line
    /// flag of the one that cannot work: a beam wider than half the vocabulary (each step
    /// keeps the best 2·beam continuations), an n-best list longer than the beam, or a
    /// length penalty or output limit that is not a finite number.
    pub fn check(&self, model: &crate::model::ModelConfig) -> Result<()> {
        if self.beam == 0 || self.batch_size == 0 {
            anyhow::bail!("--beam and --batch-size must be at least 1");
        }
        if self.nbest == 0 || self.nbest > self.beam {
            anyhow::bail!("--nbest must be between 1 and --beam ({})", self.beam);
        }
        let widest = Self::widest_beam(model);
        if self.beam > widest {
            anyhow::bail!(
                "--beam {}: at most {widest} for this model (half its vocabulary of {})",
                self.beam,
                model.vocab_size
            );
        }
        if !self.length_penalty.is_finite() {
            anyhow::bail!(
                "--length-penalty {}: expected a number",
                self.length_penalty
            );
        }
        if !(self.max_len_a.is_finite() && self.max_len_a >= 0.0) {
            anyhow::bail!(
                "--max-len-a {}: expected a number of at least 0",
                self.max_len_a
            );
        }
        Ok(())
    }

    /// The widest beam a model allows: each step keeps the best 2·beam continuations, which
    /// the vocabulary must hold.
    pub fn widest_beam(model: &crate::model::ModelConfig) -> usize {
        model.vocab_size / 2
    }
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
            workers: 1,
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

impl Default for Translation {
    /// An empty line's translation: one empty hypothesis.
    fn default() -> Self {
        Self {
            hypotheses: vec![Hypothesis::default()],
        }
    }
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
    let mut out = vec![Translation::default(); sources.len()];
    let mut todo: Vec<(usize, &[u32])> = sources
        .iter()
        .enumerate()
        .filter_map(|(i, ids)| Some((i, ids.as_deref()?)))
        .collect();
    todo.sort_by_key(|(_, ids)| ids.len());
    // Batches of similar lengths: less padding, and sentences that end at about the same step.
    let batches: Vec<&[(usize, &[u32])]> = todo.chunks(opts.batch_size.max(1)).collect();
    let done = if opts.workers <= 1 || batches.len() <= 1 {
        crate::runtime::with_partners_awake(model.device(), || -> Result<_> {
            let mut done = Vec::with_capacity(todo.len());
            for batch in batches {
                done.extend(decode_sorted(model, tokenizer, batch, opts)?);
            }
            Ok(done)
        })?
    } else {
        decode_by_workers(model, tokenizer, &batches, opts)?
    };
    for (i, t) in done {
        out[i] = t;
    }
    Ok(out)
}

/// Decodes `batches` on `opts.workers` searches at once, each taking the next batch when it is
/// done, longest first (so that no search is left with a long batch at the end). A sentence's
/// translation does not depend on its batch or its search: the results are the sequential
/// loop's, bit for bit.
fn decode_by_workers(
    model: &Seq2Seq,
    tokenizer: &SubwordTokenizer,
    batches: &[&[(usize, &[u32])]],
    opts: &SearchOptions,
) -> Result<Vec<(usize, Translation)>> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let pools = crate::runtime::worker_pools(opts.workers)?;
    let next = AtomicUsize::new(0);
    std::thread::scope(|s| {
        let searches: Vec<_> = pools
            .iter()
            .map(|pool| {
                let next = &next;
                s.spawn(move || -> Result<Vec<(usize, Translation)>> {
                    let mut done = Vec::new();
                    loop {
                        let n = next.fetch_add(1, Ordering::Relaxed);
                        let Some(batch) = batches.len().checked_sub(n + 1).map(|b| batches[b])
                        else {
                            return Ok(done);
                        };
                        match pool.install(|| {
                            crate::runtime::with_partners_awake(model.device(), || {
                                decode_sorted(model, tokenizer, batch, opts)
                            })
                        }) {
                            Ok(d) => done.extend(d),
                            Err(e) => {
                                // The other searches stop after their current batch.
                                next.store(batches.len(), Ordering::Relaxed);
                                return Err(e);
                            }
                        }
                    }
                })
            })
            .collect();
        let mut done = Vec::new();
        for search in searches {
            match search.join() {
                Ok(d) => done.extend(d?),
                Err(panic) => std::panic::resume_unwind(panic),
            }
        }
        Ok(done)
    })
}

/// Decodes one batch of (line index, source ids): (line index, translation) for each.
fn decode_sorted(
    model: &Seq2Seq,
    tokenizer: &SubwordTokenizer,
    todo: &[(usize, &[u32])],
    opts: &SearchOptions,
) -> Result<Vec<(usize, Translation)>> {
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
                let score = greedy_score(opts, ids.len(), log_prob);
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
    todo.iter()
        .zip(found)
        .map(|((i, _), hyps)| {
            let hypotheses = hyps
                .into_iter()
                .map(|(ids, score)| hypothesis(tokenizer, &ids, score, alignments.next().flatten()))
                .collect::<Result<_>>()?;
            Ok((*i, Translation { hypotheses }))
        })
        .collect()
}

/// A greedy output's score as beam search ranks (its summed log-probability over the length
/// penalty, `</s>` counted).
fn greedy_score(opts: &SearchOptions, tokens: usize, log_prob: f64) -> f64 {
    let bo = beam::BeamOptions {
        beam: opts.beam,
        length_penalty: opts.length_penalty,
        gnmt: opts.gnmt,
    };
    log_prob / bo.penalty(tokens + 1)
}

/// A hypothesis from its ids.
fn hypothesis(
    tokenizer: &SubwordTokenizer,
    ids: &[u32],
    score: f64,
    alignment: Option<WordAlignment>,
) -> Result<Hypothesis> {
    Ok(Hypothesis {
        text: one_line(tokenizer.decode(ids)?),
        score,
        tokens: ids.len(),
        alignment,
    })
}

/// `text` with each control character (line breaks, tabs; Unicode's Cc) and each line or
/// paragraph separator (U+2028, U+2029) made a space. A model can emit them as byte pieces
/// (`<0x0A>`) however it was trained; written as they are, a line break would split a
/// translation over two output lines and misalign every line after it, a tab the `--scores`
/// columns.
fn one_line(text: String) -> String {
    let breaks = |c: char| c.is_control() || c == '\u{2028}' || c == '\u{2029}';
    if !text.contains(breaks) {
        return text;
    }
    text.chars()
        .map(|c| if breaks(c) { ' ' } else { c })
        .collect()
}

/// Whether [`GreedyTranslator`] serves searches with `opts`: greedy, without alignments.
pub fn continuous(opts: &SearchOptions) -> bool {
    opts.beam <= 1 && opts.alignment.is_none()
}

/// Greedy translation that sentences join and leave between steps (a server's continuous
/// batching), on the same search as [`translate_sources`]: each sentence's translation is
/// the one `translate_sources` gives it, bit for bit, whenever it joins.
pub struct GreedyTranslator<'m> {
    search: decode::Greedy<'m>,
    model: &'m Seq2Seq,
    tokenizer: &'m SubwordTokenizer,
    opts: SearchOptions,
}

impl<'m> GreedyTranslator<'m> {
    /// An empty search with `opts` (greedy: see [`continuous`]).
    pub fn new(model: &'m Seq2Seq, tokenizer: &'m SubwordTokenizer, opts: SearchOptions) -> Self {
        Self {
            search: decode::Greedy::new(model, opts.scores),
            model,
            tokenizer,
            opts,
        }
    }

    /// Sentences being decoded.
    pub fn len(&self) -> usize {
        self.search.len()
    }

    /// Whether no sentence is being decoded.
    pub fn is_empty(&self) -> bool {
        self.search.is_empty()
    }

    /// The search settings.
    pub fn options(&self) -> &SearchOptions {
        &self.opts
    }

    /// Drops every sentence (after a failure).
    pub fn clear(&mut self) {
        self.search = decode::Greedy::new(self.model, self.opts.scores);
    }

    /// Whether sentences can join now (see [`decode::Greedy::can_add`]).
    pub fn can_add(&self) -> bool {
        self.search.can_add()
    }

    /// Adds sources made by [`encode_sources`] (none empty); they are numbered in order from
    /// the number returned.
    pub fn add(&mut self, sources: &[Vec<u32>]) -> Result<usize> {
        let lens: Vec<usize> = sources
            .iter()
            .map(|s| {
                decode::max_len(
                    self.model,
                    s.len(),
                    self.opts.max_len_a,
                    self.opts.max_len_b,
                )
            })
            .collect();
        self.search.add(sources, &lens)
    }

    /// Decodes one token of every sentence; returns (number, translation) of those that ended.
    pub fn step(&mut self) -> Result<Vec<(usize, Translation)>> {
        self.search
            .step()?
            .into_iter()
            .map(|done| {
                let score = greedy_score(&self.opts, done.ids.len(), done.log_prob);
                let hypotheses = vec![hypothesis(self.tokenizer, &done.ids, score, None)?];
                Ok((done.id, Translation { hypotheses }))
            })
            .collect()
    }
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
