//! The command line: one clap struct per subcommand, every flag documented here and only here.

use crate::data::tokenizer::SubwordModel;
use clap::{Args, Parser, Subcommand};
use std::path::PathBuf;

/// Neural machine translation: subword tokenizers, Transformer training, beam search and
/// sacreBLEU-exact scoring in one binary.
#[derive(Debug, Parser)]
#[command(name = "nmt", version, about, long_about = None)]
pub struct Cli {
    /// The subcommand to run.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Train a subword vocabulary; encode or decode text with one.
    #[command(subcommand)]
    Tokenize(TokenizeCommand),
}

/// `nmt tokenize ...`
#[derive(Debug, Subcommand)]
pub enum TokenizeCommand {
    /// Train one joint subword vocabulary (BPE or unigram) over all inputs.
    Train(TokenizeTrainArgs),
    /// Encode stdin to stdout, one line per line, pieces separated by spaces (or ids).
    Encode(EncodeArgs),
    /// Decode stdin (pieces or ids separated by spaces) to text on stdout, one line per line.
    Decode(EncodeArgs),
}

/// `nmt tokenize train`
#[derive(Debug, Args)]
pub struct TokenizeTrainArgs {
    /// A training text file, plain or gzip (repeat for several; all share one vocabulary).
    #[arg(long = "input", required = true, value_name = "FILE")]
    pub inputs: Vec<PathBuf>,
    /// Total vocabulary size, including `</s>`, `<unk>`, `<pad>` and the 256 byte pieces.
    #[arg(long, default_value_t = 8000)]
    pub vocab_size: usize,
    /// Where to write the tokenizer (a HF `tokenizer.json`).
    #[arg(long, value_name = "FILE")]
    pub output: PathBuf,
    /// The subword algorithm.
    #[arg(long, value_enum, default_value_t = SubwordModel::Bpe)]
    pub model: SubwordModel,
    /// BPE only: never merge a pair seen fewer times than this.
    #[arg(long, value_name = "N")]
    pub min_frequency: Option<u64>,
}

/// `nmt tokenize encode|decode`
#[derive(Debug, Args)]
pub struct EncodeArgs {
    /// The tokenizer.json to use (or a model folder holding one).
    #[arg(long, value_name = "FILE")]
    pub tokenizer: PathBuf,
    /// Write (encode) or read (decode) numeric ids instead of pieces.
    #[arg(long)]
    pub ids: bool,
}
