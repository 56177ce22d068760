//! The command line: one clap struct per subcommand, every flag documented here and only here.

use crate::align::AlignMode;
use crate::data::tokenizer::SubwordModel;
use crate::eval::bleu::Smooth;
use crate::eval::tokenizers::MetricTokenizer;
use crate::train::schedule::Schedule;
use crate::translate::SearchOptions;
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
    /// Tokenize a parallel corpus once into a store that `nmt train --data` reads.
    Prepare(PrepareArgs),
    /// Train a Transformer translation model.
    Train(Box<TrainArgs>),
    /// Translate sentences from stdin to stdout, one per line.
    Translate(TranslateArgs),
    /// Average the weights of checkpoints (the last k of a run, or named folders).
    Average(AverageArgs),
    /// Score translations with BLEU and chrF, identical to sacreBLEU 2.6.
    Eval(EvalArgs),
    /// Serve models over HTTP with LibreTranslate's API, batching sentences across requests.
    Serve(ServeArgs),
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
    /// Train on at most N lines sampled uniformly from all inputs (bounded memory and time on
    /// huge corpora); smaller inputs are used whole.
    #[arg(long, value_name = "N", default_value_t = crate::data::tokenizer::DEFAULT_MAX_LINES)]
    pub max_lines: usize,
    /// Seed of the --max-lines sample.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

/// `nmt prepare`
#[derive(Debug, Args)]
pub struct PrepareArgs {
    /// Source text file (plain or gzip).
    #[arg(long, value_name = "FILE")]
    pub src: PathBuf,
    /// Target text file, line-aligned with --src.
    #[arg(long, value_name = "FILE")]
    pub tgt: PathBuf,
    /// The tokenizer.json to tokenize with, or a model folder (its tokenizer.json, or an
    /// OPUS-MT model's SentencePiece files, the target side with target.spm).
    #[arg(long, value_name = "FILE")]
    pub tokenizer: PathBuf,
    /// The store folder to create.
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    /// Drop pairs with a side longer than N tokens (`</s>` included).
    #[arg(long, value_name = "N", default_value_t = crate::train::config::TrainConfig::default().max_len)]
    pub max_len: usize,
    /// Drop pairs whose longer side has more than R times the tokens of the shorter.
    #[arg(long, value_name = "R")]
    pub max_len_ratio: Option<f64>,
    /// Replace an existing store at --out.
    #[arg(long)]
    pub force: bool,
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
    #[arg(long, value_name = "FILE", conflicts_with = "model")]
    pub hyp: Option<PathBuf>,
    /// Translate --src with this model (beam 5) and score the translations.
    #[arg(long, value_name = "MODEL", requires = "src")]
    pub model: Option<String>,
    /// Source file translated with --model.
    #[arg(long, value_name = "FILE", requires = "model")]
    pub src: Option<PathBuf>,
    /// Beam size when translating with --model.
    #[arg(long, default_value_t = 5)]
    pub beam: usize,
    /// Device for translating with --model.
    #[arg(long, value_enum, default_value_t = DeviceArg::Cpu, requires = "model")]
    pub device: DeviceArg,
    /// Weight dtype for translating with --model on CUDA.
    #[arg(long, value_enum, default_value_t = DtypeArg::F32, requires = "model")]
    pub dtype: DtypeArg,
    /// How the linear layers compute when translating with --model on the CPU.
    #[arg(long, value_enum, default_value_t = ComputeArg::Float32, requires = "model")]
    pub compute_type: ComputeArg,
    /// Batches translated at once with --model, each by its own search on a share of the
    /// cores (default: one per core, up to 4; CPU only).
    #[arg(long, value_name = "N", requires = "model")]
    pub workers: Option<usize>,
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

/// Where tensors live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DeviceArg {
    /// The CPU.
    Cpu,
    /// The first CUDA GPU (needs a build with `--features cuda`).
    Cuda,
    /// CUDA when available, else the CPU.
    Auto,
}

/// Floating-point type of weights and activations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DtypeArg {
    /// 32-bit floats (CPU and CUDA).
    F32,
    /// bfloat16 (CUDA only).
    Bf16,
    /// float16 (CUDA only).
    F16,
}

/// How a loaded model's linear layers compute (CTranslate2's `compute_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ComputeArg {
    /// 32-bit floats.
    Float32,
    /// 8-bit integers, CPU only.
    Int8,
}

/// A part of the model `--freeze` holds fixed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum FreezePart {
    /// The shared token embeddings (tied with the output layer).
    Embeddings,
    /// Every encoder layer.
    Encoder,
    /// Every decoder layer.
    Decoder,
}

impl FreezePart {
    /// Whether the parameter `name` belongs to this part.
    pub fn holds(self, name: &str) -> bool {
        match self {
            Self::Embeddings => name == "model.shared.weight",
            Self::Encoder => name.starts_with("model.encoder."),
            Self::Decoder => name.starts_with("model.decoder."),
        }
    }

    /// The part's name on the command line (and in trainer_state.json).
    pub fn name(self) -> String {
        clap::ValueEnum::to_possible_value(&self)
            .expect("every part has a name")
            .get_name()
            .to_string()
    }
}

/// `nmt train`
#[derive(Debug, Args)]
pub struct TrainArgs {
    /// Training source file (plain or gzip); prepared into DIR/data/train the first time.
    #[arg(long, value_name = "FILE", requires = "tgt")]
    pub src: Option<PathBuf>,
    /// Training target file, line-aligned with --src.
    #[arg(long, value_name = "FILE", requires = "src")]
    pub tgt: Option<PathBuf>,
    /// A corpus prepared by `nmt prepare`, instead of --src/--tgt. Several weighted corpora
    /// go in the config's `corpora` list.
    #[arg(long, value_name = "STORE", conflicts_with_all = ["src", "tgt"])]
    pub data: Option<PathBuf>,
    /// Validation source file.
    #[arg(long, value_name = "FILE", requires = "valid_tgt")]
    pub valid_src: Option<PathBuf>,
    /// Validation target file.
    #[arg(long, value_name = "FILE", requires = "valid_src")]
    pub valid_tgt: Option<PathBuf>,
    /// A tokenizer.json; without it, a prepared corpus's own is used, or one is trained on the
    /// training text with --vocab-size.
    #[arg(long, value_name = "FILE")]
    pub tokenizer: Option<PathBuf>,
    /// Output folder: checkpoints/, last/, best/, metrics.jsonl.
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    /// JSON file of hyper-parameters (see data/configs/); flags below override it.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Continue the run in --out from its last checkpoint, exactly where it stopped.
    #[arg(long, conflicts_with = "init")]
    pub resume: bool,
    /// Fine-tune: start from this model (anything `translate --model` takes) with its
    /// architecture, weights and tokenizer, and a fresh optimizer and schedule.
    #[arg(long, value_name = "MODEL")]
    pub init: Option<String>,
    /// Hold these weights fixed (repeatable): the shared embeddings (and so the tied output
    /// layer), the encoder, or the decoder.
    #[arg(long, value_enum, value_name = "PART")]
    pub freeze: Vec<FreezePart>,
    /// Device.
    #[arg(long, value_enum, default_value_t = DeviceArg::Cpu)]
    pub device: DeviceArg,
    /// Weight dtype; bf16 and f16 need CUDA.
    #[arg(long, value_enum, default_value_t = DtypeArg::F32)]
    pub dtype: DtypeArg,
    /// Vocabulary size when training the tokenizer on the fly.
    #[arg(long)]
    pub vocab_size: Option<usize>,
    /// Model width.
    #[arg(long)]
    pub d_model: Option<usize>,
    /// Encoder and decoder layers.
    #[arg(long)]
    pub layers: Option<usize>,
    /// Attention heads.
    #[arg(long)]
    pub heads: Option<usize>,
    /// Feed-forward width.
    #[arg(long)]
    pub ffn_dim: Option<usize>,
    /// Dropout.
    #[arg(long)]
    pub dropout: Option<f64>,
    /// Padded tokens per batch.
    #[arg(long)]
    pub max_tokens: Option<usize>,
    /// Longest training sentence in tokens (`</s>` included); longer pairs are skipped.
    #[arg(long)]
    pub max_len: Option<usize>,
    /// Batches per update (gradient accumulation).
    #[arg(long)]
    pub accum: Option<usize>,
    /// Peak learning rate.
    #[arg(long)]
    pub lr: Option<f64>,
    /// Warm-up steps.
    #[arg(long)]
    pub warmup: Option<usize>,
    /// Learning-rate schedule.
    #[arg(long, value_enum)]
    pub schedule: Option<Schedule>,
    /// Label smoothing.
    #[arg(long)]
    pub label_smoothing: Option<f64>,
    /// Decoupled weight decay.
    #[arg(long)]
    pub weight_decay: Option<f64>,
    /// Gradient-norm clipping threshold (0: off).
    #[arg(long)]
    pub clip_norm: Option<f64>,
    /// Word alignments of the training corpus (Pharaoh `s-t` lines, 0-based, one per line of
    /// --src/--tgt, e.g. from eflomal) supervising one decoder layer's first
    /// cross-attention head (Marian's guided alignment; the last layer unless
    /// --guided-alignment-layer says otherwise).
    #[arg(long, value_name = "FILE")]
    pub guided_alignment: Option<PathBuf>,
    /// Weight of the guided-alignment cost (default 0.1).
    #[arg(long, value_name = "W")]
    pub guided_alignment_weight: Option<f64>,
    /// Decoder layer whose first cross-attention head guided alignment supervises (0-based;
    /// default: the last).
    #[arg(long, value_name = "N")]
    pub guided_alignment_layer: Option<usize>,
    /// Guided alignment supervises the mean of the layer's cross-attention heads
    /// (OpenNMT-py's default) rather than its first head (Marian's); `translate --alignment`
    /// then reads that mean.
    #[arg(long)]
    pub guided_alignment_all_heads: bool,
    /// Decoder position guided alignment supervises each target token's alignment at: the
    /// one that predicts it (Marian's), or the next, which reads it and so knows which word it
    /// aligns; `translate --alignment` then reads there.
    #[arg(long, value_name = "predict|read")]
    pub guided_alignment_position: Option<crate::align::AlignPosition>,
    /// Stop after N updates.
    #[arg(long)]
    pub max_steps: Option<usize>,
    /// Stop after N epochs.
    #[arg(long)]
    pub max_epochs: Option<usize>,
    /// Stop after this long, e.g. 90s, 30m, 2h.
    #[arg(long)]
    pub max_time: Option<String>,
    /// Validate and checkpoint every N updates.
    #[arg(long)]
    pub valid_every: Option<usize>,
    /// Early stopping: validations without BLEU improvement.
    #[arg(long)]
    pub patience: Option<usize>,
    /// Training checkpoints to keep.
    #[arg(long)]
    pub keep_last: Option<usize>,
    /// Seed for initialisation, data order and dropout.
    #[arg(long)]
    pub seed: Option<u64>,
}

/// `nmt average`
#[derive(Debug, Args)]
pub struct AverageArgs {
    /// Checkpoint folders to average.
    #[arg(value_name = "CHECKPOINT")]
    pub checkpoints: Vec<PathBuf>,
    /// A training run folder: average its last --last checkpoints.
    #[arg(long, value_name = "DIR", conflicts_with = "checkpoints")]
    pub run: Option<PathBuf>,
    /// How many of the run's latest checkpoints.
    #[arg(long, default_value_t = 5)]
    pub last: usize,
    /// Output checkpoint folder.
    #[arg(long, value_name = "DIR")]
    pub output: PathBuf,
    /// Replace an existing folder at --output (never one of the checkpoints averaged).
    #[arg(long)]
    pub force: bool,
}

/// `nmt translate`
#[derive(Debug, Args)]
pub struct TranslateArgs {
    /// A checkpoint folder, a training run folder (uses best/, else last/), or a Hub repo id.
    #[arg(long, value_name = "MODEL")]
    pub model: String,
    /// Beam size; 1 is greedy search.
    #[arg(long, default_value_t = 1)]
    pub beam: usize,
    /// Length penalty α: hypotheses are ranked by sum log-prob / length^α.
    #[arg(long, default_value_t = SearchOptions::default().length_penalty)]
    pub length_penalty: f64,
    /// Use GNMT's ((5+len)/6)^α instead of len^α.
    #[arg(long)]
    pub gnmt_penalty: bool,
    /// Print the K best hypotheses as `i ||| hypothesis ||| score` (K ≤ beam).
    #[arg(long, value_name = "K")]
    pub nbest: Option<usize>,
    /// Output length limit a·source_length + b (tokens): a.
    #[arg(long, default_value_t = SearchOptions::default().max_len_a)]
    pub max_len_a: f64,
    /// Output length limit a·source_length + b (tokens): b.
    #[arg(long, default_value_t = SearchOptions::default().max_len_b)]
    pub max_len_b: usize,
    /// Sentences per batch.
    #[arg(long, default_value_t = SearchOptions::default().batch_size)]
    pub batch_size: usize,
    /// Lines read ahead, in batches, and sorted by length before batching (Marian's
    /// --maxi-batch): batches of similar lengths decode faster. Output order is unchanged.
    /// Input from a file or pipe is read in whole windows (a program that writes one line
    /// and waits for its translation sets --batch-size 1 --maxi-batch 1); lines typed at a
    /// terminal are translated as they come.
    #[arg(long, default_value_t = 10, value_name = "BATCHES")]
    pub maxi_batch: usize,
    /// Batches translated at once, each by its own search on a share of the cores, as
    /// Marian's and CTranslate2's CPU workers (default: one per core, up to 4; CPU only).
    /// Translations do not depend on it.
    #[arg(long, value_name = "N")]
    pub workers: Option<usize>,
    /// Device.
    #[arg(long, value_enum, default_value_t = DeviceArg::Cpu)]
    pub device: DeviceArg,
    /// Weight dtype on CUDA.
    #[arg(long, value_enum, default_value_t = DtypeArg::F32)]
    pub dtype: DtypeArg,
    /// How the linear layers compute on the CPU: float32, or int8 (weights quantized per
    /// output row, inputs per row as the layer runs; AVX-512 VNNI where the CPU has it).
    #[arg(long, value_enum, default_value_t = ComputeArg::Float32)]
    pub compute_type: ComputeArg,
    /// Append the hypothesis score (tab-separated).
    #[arg(long)]
    pub scores: bool,
    /// One JSON object per line: source, translation, score, tokens.
    #[arg(long)]
    pub json: bool,
    /// Word alignments (Marian's format, ` ||| s-t …` after each translation; a field of
    /// --json): hard (each target word's most attended source word), soft (each target word's
    /// weights over the source words) or a threshold in (0, 1] (every pair at least that).
    #[arg(long, value_name = "hard|soft|P", value_parser = clap::value_parser!(AlignMode))]
    pub alignment: Option<AlignMode>,
    /// Decoder layer alignments are read from (0-based), or avg for the mean of all layers;
    /// default: the last layer.
    #[arg(long, value_name = "N|avg")]
    pub alignment_layer: Option<String>,
    /// Attention head alignments are read from (0-based), or avg (the default) for the mean
    /// of the heads.
    #[arg(long, value_name = "N|avg")]
    pub alignment_head: Option<String>,
    /// Decoder position a target word's alignment is read at: the one that predicts it, or
    /// the next, which reads it; default: where the model was trained to align (guided
    /// alignment), else predict.
    #[arg(long, value_name = "predict|read")]
    pub alignment_position: Option<crate::align::AlignPosition>,
    /// Draw each line's attention (best hypothesis, words on both axes) into
    /// DIR/line-NNNNNN.png; the layer and head as for --alignment.
    #[arg(long, value_name = "DIR")]
    pub attention_png: Option<PathBuf>,
}

/// `nmt serve`
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// A language pair and its model, `SRC-TGT=MODEL` (MODEL as `translate --model` takes
    /// it); repeat for more pairs.
    #[arg(long = "model", value_name = "SRC-TGT=MODEL", required = true)]
    pub models: Vec<String>,
    /// Address to listen on; 0.0.0.0 opens the server to the network.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0: any free port; the log says which).
    #[arg(long, default_value_t = 5000)]
    pub port: u16,
    /// Require this key in each translation request's `api_key` field.
    #[arg(long, value_name = "KEY")]
    pub api_key: Option<String>,
    /// Beam size; 1 is greedy search. A request asking for k alternatives is searched with a
    /// beam of at least k + 1.
    #[arg(long, default_value_t = 1)]
    pub beam: usize,
    /// Length penalty α: hypotheses are ranked by sum log-prob / length^α.
    #[arg(long, default_value_t = SearchOptions::default().length_penalty)]
    pub length_penalty: f64,
    /// Output length limit a·source_length + b (tokens): a.
    #[arg(long, default_value_t = SearchOptions::default().max_len_a)]
    pub max_len_a: f64,
    /// Output length limit a·source_length + b (tokens): b.
    #[arg(long, default_value_t = SearchOptions::default().max_len_b)]
    pub max_len_b: usize,
    /// Sentences decoded together, after sorting the pending sentences by length.
    #[arg(long, default_value_t = SearchOptions::default().batch_size)]
    pub batch_size: usize,
    /// Source tokens decoded at once: requests join a running search while its sentences hold
    /// fewer (beam-search requests are gathered into batches up to it).
    #[arg(long, default_value_t = 2048, value_name = "TOKENS")]
    pub batch_tokens: usize,
    /// Milliseconds to wait for more requests after the first one reaches an idle model, while
    /// requests come together (a lone client is answered without waiting).
    #[arg(long, default_value_t = 5, value_name = "MS")]
    pub batch_wait: u64,
    /// Searches of a model run at once under load, each on its share of the cores, a request
    /// joining the one that takes it (default: one per core, up to 4); 1 runs one search on
    /// all cores.
    #[arg(long, value_name = "N")]
    pub workers: Option<usize>,
    /// Largest request body in bytes (413 above).
    #[arg(long, default_value_t = 1 << 20, value_name = "BYTES")]
    pub max_body: usize,
    /// Most sentences (lines of all `q` texts) in one request.
    #[arg(long, default_value_t = 1000, value_name = "N")]
    pub max_sentences: usize,
    /// Most characters in one `q` text.
    #[arg(long, default_value_t = 5000, value_name = "N")]
    pub max_chars: usize,
    /// Most alternatives a request may ask for.
    #[arg(long, default_value_t = 4, value_name = "N")]
    pub max_alternatives: usize,
    /// Translation requests in progress at once; more are answered 429.
    #[arg(long, default_value_t = 256, value_name = "N")]
    pub max_requests: usize,
    /// Seconds a client may take to send a request's headers, and again its body (408 or a
    /// closed connection after).
    #[arg(long, default_value_t = 10, value_name = "SECONDS")]
    pub read_timeout: u64,
    /// Device.
    #[arg(long, value_enum, default_value_t = DeviceArg::Cpu)]
    pub device: DeviceArg,
    /// Weight dtype on CUDA.
    #[arg(long, value_enum, default_value_t = DtypeArg::F32)]
    pub dtype: DtypeArg,
    /// How the linear layers compute on the CPU: float32, or int8 (weights quantized per
    /// output row, inputs per row as the layer runs; AVX-512 VNNI where the CPU has it).
    #[arg(long, value_enum, default_value_t = ComputeArg::Float32)]
    pub compute_type: ComputeArg,
}
