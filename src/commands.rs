//! What each subcommand does, given its parsed arguments. Glue between the command line and the
//! library modules; no algorithm lives here.

use crate::cli::{EncodeArgs, EvalArgs, MetricName, TokenizeCommand, TokenizeTrainArgs};
use crate::data::corpus::{read_corpus, Corpus, LineReader};
use crate::data::tokenizer::{self, SubwordTokenizer, TrainOptions};
use crate::eval::bleu::Bleu;
use crate::eval::chrf::Chrf;
use crate::eval::tokenizers::py_rstrip;
use crate::eval::{paired_bootstrap, Bootstrap, Metric};
use anyhow::{bail, Context, Result};
use std::io::{BufWriter, IsTerminal, Write};
use std::path::{Path, PathBuf};

/// The tokenizer inside a model folder, or the file itself.
pub fn tokenizer_path(path: &Path) -> PathBuf {
    if path.is_dir() {
        path.join("tokenizer.json")
    } else {
        path.to_path_buf()
    }
}

/// Standard input as a corpus reader named `<stdin>` in errors.
pub fn stdin_lines() -> LineReader {
    LineReader::from_reader(
        Path::new("<stdin>"),
        Box::new(std::io::BufReader::new(std::io::stdin())),
    )
}

/// `nmt tokenize ...`
pub fn tokenize(cmd: TokenizeCommand) -> Result<()> {
    match cmd {
        TokenizeCommand::Train(args) => tokenize_train(args),
        TokenizeCommand::Encode(args) => tokenize_encode(args),
        TokenizeCommand::Decode(args) => tokenize_decode(args),
    }
}

fn tokenize_train(args: TokenizeTrainArgs) -> Result<()> {
    let opts = TrainOptions {
        vocab_size: args.vocab_size,
        model: args.model,
        min_frequency: args.min_frequency,
        show_progress: std::io::stderr().is_terminal(),
    };
    let tok = tokenizer::train(&args.inputs, &opts)?;
    tok.save(&args.output)?;
    eprintln!(
        "wrote {} ({} pieces, {:?})",
        args.output.display(),
        tok.vocab_size(),
        args.model
    );
    Ok(())
}

fn tokenize_encode(args: EncodeArgs) -> Result<()> {
    let tok = SubwordTokenizer::load(&tokenizer_path(&args.tokenizer))?;
    let mut out = BufWriter::new(std::io::stdout().lock());
    for line in stdin_lines() {
        let line = line?;
        let text = if args.ids {
            let ids = tok.encode_ids(&line)?;
            ids.iter().map(u32::to_string).collect::<Vec<_>>().join(" ")
        } else {
            tok.encode_pieces(&line)?.join(" ")
        };
        writeln!(out, "{text}").context("writing to stdout")?;
    }
    out.flush().context("writing to stdout")
}

fn tokenize_decode(args: EncodeArgs) -> Result<()> {
    let tok = SubwordTokenizer::load(&tokenizer_path(&args.tokenizer))?;
    let mut out = BufWriter::new(std::io::stdout().lock());
    let mut input = stdin_lines();
    while let Some(line) = input.next_line()? {
        let n = input.line_no();
        let ids = line
            .split(' ')
            .filter(|s| !s.is_empty())
            .map(|s| {
                let id = if args.ids {
                    s.parse::<u32>()
                        .ok()
                        .filter(|&i| (i as usize) < tok.vocab_size())
                } else {
                    tok.piece_to_id(s)
                };
                match id {
                    Some(i) => Ok(i),
                    None => bail!(
                        "<stdin>:{n}: {s:?} is not in the vocabulary of {}",
                        tok.path.display()
                    ),
                }
            })
            .collect::<Result<Vec<u32>>>()?;
        writeln!(out, "{}", tok.decode(&ids)?).context("writing to stdout")?;
    }
    out.flush().context("writing to stdout")
}

/// A hypothesis or reference file as sacreBLEU's command line reads it: trailing whitespace
/// removed from every line.
fn read_scored(path: &Path) -> Result<Corpus> {
    let mut c = read_corpus(path)?;
    for line in &mut c.lines {
        line.truncate(py_rstrip(line).len());
    }
    Ok(c)
}

fn read_hypotheses(path: Option<&Path>) -> Result<Corpus> {
    let c = match path {
        Some(p) => read_scored(p)?,
        None => {
            let mut lines = Vec::new();
            for line in stdin_lines() {
                lines.push(py_rstrip(&line?).to_string());
            }
            let empty = lines.iter().filter(|l| l.is_empty()).count();
            Corpus {
                path: PathBuf::from("<stdin>"),
                lines,
                empty,
            }
        }
    };
    if c.lines.is_empty() {
        bail!("{}: no hypotheses (the input is empty)", c.path.display());
    }
    Ok(c)
}

fn eval_metrics(args: &EvalArgs, sentence: bool) -> Vec<Metric> {
    let mut metrics: Vec<MetricName> = args.metrics.clone();
    metrics.dedup();
    metrics
        .into_iter()
        .map(|m| match m {
            MetricName::Bleu => Metric::Bleu(Bleu {
                tokenizer: args.tokenize,
                lowercase: args.lowercase,
                smooth: args.smooth_method,
                smooth_value: args.smooth_value,
                effective_order: args.effective_order || sentence,
            }),
            MetricName::Chrf => Metric::Chrf(Chrf {
                word_order: args.chrf_word_order,
                lowercase: args.lowercase,
                ..Chrf::default()
            }),
        })
        .collect()
}

/// `nmt eval`
pub fn eval(args: EvalArgs) -> Result<()> {
    if args.sentence && (args.confidence || args.paired_bs.is_some()) {
        bail!("--sentence cannot be combined with --confidence or --paired-bs");
    }
    if args.bootstrap_samples < 2 {
        bail!("--bootstrap-samples must be at least 2");
    }
    let hyps = read_hypotheses(args.hyp.as_deref())?;
    let refs = args
        .refs
        .iter()
        .map(|p| read_scored(p))
        .collect::<Result<Vec<_>>>()?;
    for r in &refs {
        if r.lines.len() != hyps.lines.len() {
            bail!(
                "{} has {} lines but {} has {}: hypotheses and references must align line by line",
                hyps.path.display(),
                hyps.lines.len(),
                r.path.display(),
                r.lines.len()
            );
        }
    }
    let ref_lines: Vec<Vec<String>> = refs.into_iter().map(|r| r.lines).collect();
    let metrics = eval_metrics(&args, args.sentence);
    let bootstrap = Bootstrap {
        samples: args.bootstrap_samples,
        seed: args.seed,
    };
    let mut out = BufWriter::new(std::io::stdout().lock());
    let w = args.width;
    if let Some(other) = &args.paired_bs {
        let sys = read_scored(other)?;
        if sys.lines.len() != hyps.lines.len() {
            bail!(
                "{} has {} lines but {} has {}",
                hyps.path.display(),
                hyps.lines.len(),
                sys.path.display(),
                sys.lines.len()
            );
        }
        let mut results = Vec::new();
        for m in &metrics {
            let base = m.corpus_stats(&hyps.lines, &ref_lines);
            let stats = m.corpus_stats(&sys.lines, &ref_lines);
            let r = paired_bootstrap(m, &base, &stats, bootstrap);
            if !args.json {
                writeln!(
                    out,
                    "{}: baseline {} = {:.w$} (μ = {:.w$} ± {:.w$}); system {} = {:.w$} (μ = {:.w$} ± {:.w$}); p-value = {:.4} {}",
                    r.name,
                    hyps.path.display(),
                    r.baseline,
                    r.baseline_confidence.mean,
                    r.baseline_confidence.ci,
                    sys.path.display(),
                    r.system,
                    r.system_confidence.mean,
                    r.system_confidence.ci,
                    r.p_value,
                    m.signature(ref_lines.len(), Some(bootstrap))
                )?;
            }
            results.push(r);
        }
        if args.json {
            writeln!(out, "{}", serde_json::to_string_pretty(&results)?)?;
        }
        return Ok(out.flush()?);
    }
    if args.sentence {
        for m in &metrics {
            for stats in m.corpus_stats(&hyps.lines, &ref_lines) {
                let r = m.report(&[stats], ref_lines.len(), None);
                if args.json {
                    writeln!(out, "{}", serde_json::to_string(&r)?)?;
                } else {
                    writeln!(out, "{}", r.format(w))?;
                }
            }
        }
        return Ok(out.flush()?);
    }
    let reports: Vec<_> = metrics
        .iter()
        .map(|m| {
            let stats = m.corpus_stats(&hyps.lines, &ref_lines);
            m.report(
                &stats,
                ref_lines.len(),
                args.confidence.then_some(bootstrap),
            )
        })
        .collect();
    if args.json {
        writeln!(out, "{}", serde_json::to_string_pretty(&reports)?)?;
    } else {
        for r in &reports {
            writeln!(out, "{}", r.format(w))?;
        }
    }
    Ok(out.flush()?)
}
