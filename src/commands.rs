//! What each subcommand does, given its parsed arguments. Glue between the command line and the
//! library modules; no algorithm lives here.

use crate::cli::{EncodeArgs, TokenizeCommand, TokenizeTrainArgs};
use crate::data::corpus::LineReader;
use crate::data::tokenizer::{self, SubwordTokenizer, TrainOptions};
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
