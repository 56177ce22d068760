//! The command line: one clap struct per subcommand, every flag documented here and only here.

use crate::data::tokenizer::SubwordModel;
use crate::eval::bleu::Smooth;
use crate::eval::tokenizers::MetricTokenizer;
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
    /// Score translations with BLEU and chrF, identical to sacreBLEU 2.6.
    Eval(EvalArgs),
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

/// Which metrics `nmt eval` computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum MetricName {
    /// BLEU (Papineni et al. 2002) as sacreBLEU computes it.
    Bleu,
    /// chrF (Popović 2015); chrF++ with `--chrf-word-order 2`.
    Chrf,
}

/// `nmt eval`
#[derive(Debug, Args)]
pub struct EvalArgs {
    /// Reference file, plain or gzip (repeat for several references).
    #[arg(long = "ref", required = true, value_name = "FILE")]
    pub refs: Vec<PathBuf>,
    /// Hypotheses file; read from stdin when absent.
    #[arg(long, value_name = "FILE")]
    pub hyp: Option<PathBuf>,
    /// Metrics to compute, comma-separated.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "bleu")]
    pub metrics: Vec<MetricName>,
    /// BLEU's tokenizer.
    #[arg(long, value_enum, default_value_t = MetricTokenizer::Tok13a)]
    pub tokenize: MetricTokenizer,
    /// Lowercase hypotheses and references (BLEU and chrF).
    #[arg(long)]
    pub lowercase: bool,
    /// BLEU smoothing method.
    #[arg(long, value_enum, default_value_t = Smooth::Exp)]
    pub smooth_method: Smooth,
    /// Smoothing value for `floor` (default 0.1) and `add-k` (default 1).
    #[arg(long, value_name = "X")]
    pub smooth_value: Option<f64>,
    /// BLEU: leave out n-gram orders without any hypothesis n-gram.
    #[arg(long)]
    pub effective_order: bool,
    /// chrF word n-gram order: 0 for chrF, 2 for chrF++.
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub chrf_word_order: usize,
    /// One score per hypothesis line instead of a corpus score (BLEU with effective order).
    #[arg(long)]
    pub sentence: bool,
    /// Add a 95 % bootstrap confidence interval.
    #[arg(long)]
    pub confidence: bool,
    /// Paired bootstrap resampling of this second system against the first (`--hyp`).
    #[arg(long, value_name = "FILE")]
    pub paired_bs: Option<PathBuf>,
    /// Bootstrap resamples for `--confidence` and `--paired-bs`.
    #[arg(long, default_value_t = 1000, value_name = "N")]
    pub bootstrap_samples: usize,
    /// Bootstrap seed.
    #[arg(long, default_value_t = 12345)]
    pub seed: u64,
    /// Print a JSON array, one object per metric.
    #[arg(long)]
    pub json: bool,
    /// Decimals printed for scores.
    #[arg(long, default_value_t = 2, value_name = "N")]
    pub width: usize,
}
