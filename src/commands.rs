//! What each subcommand does, given its parsed arguments. Glue between the command line and the
//! library modules; no algorithm lives here.

use crate::cli::{
    AverageArgs, ComputeArg, DeviceArg, DtypeArg, EncodeArgs, EvalArgs, MetricName, PrepareArgs,
    ServeArgs, TokenizeCommand, TokenizeTrainArgs, TrainArgs, TranslateArgs,
};
use crate::data::corpus::{read_corpus, Corpus, LineReader};
use crate::data::store::Filters;
use crate::data::tokenizer::{self, SubwordTokenizer, TrainOptions};
use crate::eval::bleu::Bleu;
use crate::eval::chrf::Chrf;
use crate::eval::tokenizers::py_rstrip;
use crate::eval::{paired_bootstrap, Bootstrap, Metric};
use crate::ops::packed::ComputeType;
use crate::train::config::{CorpusConfig, TrainConfig};
use crate::train::{Outcome, TrainJob};
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device};
use std::io::{BufWriter, IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

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
        max_lines: args.max_lines,
        seed: args.seed,
    };
    if let Some(input) = args
        .inputs
        .iter()
        .find(|i| crate::io::lies_within(i, &args.output))
    {
        bail!(
            "--output {} is the --input {}: writing the tokenizer would replace the text; give another --output",
            args.output.display(),
            input.display()
        );
    }
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
/// removed from every line, a byte-order mark kept.
fn read_scored(path: &Path) -> Result<Corpus> {
    let mut c = Corpus::read(LineReader::open(path)?.keeping_bom())?;
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
            for line in stdin_lines().keeping_bom() {
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

/// Translates a whole file with a model (`nmt eval --model --src`).
fn translate_file(model: &str, src: &Path, args: &EvalArgs) -> Result<Corpus> {
    let (device, dtype, compute) = select_compute(args.device, args.dtype, args.compute_type)?;
    let beam = args.beam;
    let source = read_corpus(src)?;
    let loaded =
        crate::checkpoint::load_as(&crate::checkpoint::resolve(model)?, &device, dtype, compute)?;
    crate::runtime::keep_freed_memory_after_load();
    let opts = crate::translate::SearchOptions {
        beam,
        workers: search_workers(args.workers, &device)?,
        ..Default::default()
    };
    opts.check(&loaded.model.config)?;
    let mut lines = Vec::with_capacity(source.lines.len());
    for (i, chunk) in source.lines.chunks(640).enumerate() {
        for t in crate::translate::translate_batch(
            &loaded.model,
            &loaded.tokenizer,
            chunk,
            i * 640 + 1,
            &opts,
        )? {
            lines.push(py_rstrip(t.text()).to_string());
        }
    }
    let empty = lines.iter().filter(|l| l.is_empty()).count();
    Ok(Corpus {
        path: PathBuf::from(format!("{model} on {}", src.display())),
        lines,
        empty,
    })
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
    let hyps = match (&args.model, &args.src) {
        (Some(model), Some(src)) => translate_file(model, src, &args)?,
        _ => read_hypotheses(args.hyp.as_deref())?,
    };
    let refs = args
        .refs
        .iter()
        .map(|p| read_scored(p))
        .collect::<Result<Vec<_>>>()?;
    for r in &refs {
        hyps.check_aligned(r, "hypotheses and references must align line by line")?;
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
        hyps.check_aligned(&sys, "the two systems must align line by line")?;
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

/// Checks that the CUDA libraries Candle loads at run time can be found: the driver, cuBLAS,
/// cuBLASLt and cuRAND. Candle's loader would panic instead of returning an error.
fn cuda_libraries() -> Result<()> {
    let loadable = |name: &str| {
        ["", ".13", ".12", ".11", ".10", ".1"].iter().any(|v| {
            let file = std::ffi::CString::new(format!("lib{name}.so{v}")).expect("no NUL");
            // SAFETY: dlopen with a valid C string; the handle is kept, as the library will be
            // used right after.
            !unsafe { libc::dlopen(file.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL) }.is_null()
        })
    };
    let missing: Vec<&str> = ["cuda", "cublas", "cublasLt", "curand"]
        .into_iter()
        .filter(|n| !loadable(n))
        .collect();
    match missing.as_slice() {
        [] => Ok(()),
        ["cuda", ..] => bail!("the NVIDIA driver (libcuda.so.1) cannot be loaded: is there a GPU and its driver?"),
        libs => bail!(
            "cannot load {}: add their folder to LD_LIBRARY_PATH (a PyTorch install has them in site-packages/nvidia/cu13/lib)",
            libs.iter().map(|l| format!("lib{l}.so")).collect::<Vec<_>>().join(", ")
        ),
    }
}

/// A new CUDA device set up as nmt runs it (see [`crate::ops::cuda::configure`]).
fn configured(device: Device) -> Device {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = &device {
        crate::ops::cuda::configure(d);
    }
    device
}

/// The device and dtype a user asked for.
/// Device, dtype and compute type for decoding with a loaded model: int8 runs on the CPU
/// from f32 weights, and says so when other flags ask for something else.
fn select_compute(
    device: DeviceArg,
    dtype: DtypeArg,
    compute: ComputeArg,
) -> Result<(Device, DType, ComputeType)> {
    if compute == ComputeArg::Float32 {
        let (device, dtype) = select_device(device, dtype)?;
        return Ok((device, dtype, ComputeType::Float32));
    }
    if device == DeviceArg::Cuda {
        bail!("--compute-type int8 runs on the CPU; on CUDA use --dtype bf16 or f16 instead");
    }
    if dtype != DtypeArg::F32 {
        bail!("--compute-type int8 quantizes f32 weights on the CPU; it cannot be combined with --dtype bf16 or f16");
    }
    Ok((Device::Cpu, DType::F32, ComputeType::Int8))
}

pub fn select_device(device: DeviceArg, dtype: DtypeArg) -> Result<(Device, DType)> {
    let device = match device {
        DeviceArg::Cpu => Device::Cpu,
        DeviceArg::Cuda => {
            if !candle_core::utils::cuda_is_available() {
                bail!("--device cuda: this nmt was built without CUDA (rebuild with --features cuda, see scripts/build-cuda.sh)");
            }
            cuda_libraries().context("--device cuda")?;
            configured(Device::new_cuda(0).context("--device cuda: no usable CUDA GPU")?)
        }
        DeviceArg::Auto if candle_core::utils::cuda_is_available() => match cuda_libraries() {
            Ok(()) => Device::new_cuda(0).map_or(Device::Cpu, configured),
            Err(e) => {
                eprintln!("note: --device auto: using the CPU ({e})");
                Device::Cpu
            }
        },
        DeviceArg::Auto => Device::Cpu,
    };
    let dtype = match dtype {
        DtypeArg::F32 => DType::F32,
        DtypeArg::Bf16 | DtypeArg::F16 if device.is_cpu() => {
            bail!("--dtype bf16/f16 needs --device cuda; the CPU trains in f32")
        }
        DtypeArg::Bf16 => DType::BF16,
        DtypeArg::F16 => DType::F16,
    };
    Ok((device, dtype))
}

fn train_config(args: &TrainArgs) -> Result<TrainConfig> {
    let mut c = match &args.config {
        Some(p) => TrainConfig::load(p)?,
        None => TrainConfig::default(),
    };
    macro_rules! set {
        ($($field:ident),*) => { $(if let Some(v) = args.$field.clone() { c.$field = v; })* };
    }
    set!(
        vocab_size,
        d_model,
        heads,
        ffn_dim,
        dropout,
        max_tokens,
        max_len,
        accum,
        lr,
        warmup,
        schedule,
        label_smoothing,
        weight_decay,
        clip_norm,
        valid_every,
        keep_last,
        seed,
        guided_alignment_weight
    );
    if args.guided_alignment.is_some() {
        c.guided_alignment = args.guided_alignment.clone();
    }
    if args.guided_alignment_layer.is_some() {
        c.guided_alignment_layer = args.guided_alignment_layer;
    }
    if args.guided_alignment_all_heads {
        c.guided_alignment_all_heads = true;
    }
    if let Some(p) = args.guided_alignment_position {
        c.guided_alignment_position = p;
    }
    if let Some(l) = args.layers {
        c.encoder_layers = l;
        c.decoder_layers = l;
    }
    if args.max_steps.is_some() {
        c.max_steps = args.max_steps;
    }
    if args.max_epochs.is_some() {
        c.max_epochs = args.max_epochs;
    }
    if args.max_time.is_some() {
        c.max_time = args.max_time.clone();
    }
    if args.patience.is_some() {
        c.patience = args.patience;
    }
    if let (Some(src), Some(tgt)) = (&args.src, &args.tgt) {
        c.corpora = vec![CorpusConfig::text("train", src.clone(), tgt.clone())];
    } else if let Some(store) = &args.data {
        c.corpora = vec![CorpusConfig::store("train", store.clone())];
    }
    if c.corpora.is_empty() {
        bail!("no training data: give --src and --tgt, --data STORE, or `corpora` in the config");
    }
    Ok(c)
}

/// `nmt prepare`
pub fn prepare(args: PrepareArgs) -> Result<()> {
    if args.out.exists() && !args.force {
        bail!(
            "{} already exists: use --force to replace it, or another --out",
            args.out.display()
        );
    }
    // Replacing --out removes what it holds: never the text being prepared.
    for (flag, input) in [("--src", &args.src), ("--tgt", &args.tgt)] {
        if crate::io::lies_within(input, &args.out) {
            bail!(
                "{}: the {flag} file {} is inside it, and replacing the folder would delete it: choose another --out",
                args.out.display(),
                input.display()
            );
        }
    }
    let tok = SubwordTokenizer::load_any(&args.tokenizer)?;
    let filters = Filters {
        max_len: args.max_len,
        max_len_ratio: args.max_len_ratio,
    };
    let store = crate::data::prepare::prepare(&args.src, &args.tgt, &tok, &filters, &args.out)?;
    let m = &store.manifest;
    eprintln!(
        "{}\nprepared in {:.1} s ({:.0} pairs/s)",
        store.summary(),
        m.seconds,
        m.lines as f64 / m.seconds.max(1e-9)
    );
    Ok(())
}

/// `nmt train`; returns the exit code (130 after Ctrl-C, with `last/` saved).
pub fn train(args: TrainArgs) -> Result<i32> {
    let (device, dtype) = select_device(args.device, args.dtype)?;
    let interrupt = Arc::new(AtomicBool::new(false));
    let flag = interrupt.clone();
    ctrlc::set_handler(move || {
        if flag.swap(true, Ordering::SeqCst) {
            std::process::exit(130);
        }
        eprintln!("\ninterrupted: saving last/ after this step (Ctrl-C again to quit at once)");
    })
    .context("installing the Ctrl-C handler")?;
    if args.init.is_some() {
        let given = [
            ("--d-model", args.d_model.is_some()),
            ("--layers", args.layers.is_some()),
            ("--heads", args.heads.is_some()),
            ("--ffn-dim", args.ffn_dim.is_some()),
            ("--vocab-size", args.vocab_size.is_some()),
            ("--tokenizer", args.tokenizer.is_some()),
        ];
        if let Some((flag, _)) = given.iter().find(|(_, set)| *set) {
            bail!("{flag} contradicts --init: the architecture and tokenizer come from the model being fine-tuned");
        }
    }
    let job = TrainJob {
        init: args.init.clone(),
        dropout: args.dropout,
        freeze: args.freeze.clone(),
        config: train_config(&args)?,
        valid: args.valid_src.zip(args.valid_tgt),
        tokenizer: args.tokenizer,
        out: args.out,
        resume: args.resume,
        device,
        dtype,
        interrupt,
    };
    Ok(match crate::train::run(&job)? {
        Outcome::Interrupted => 130,
        Outcome::Finished | Outcome::EarlyStopped => 0,
    })
}

/// `nmt average`
pub fn average(args: AverageArgs) -> Result<()> {
    let inputs = match &args.run {
        Some(run) => {
            let all = crate::checkpoint::list_checkpoints(run)?;
            if all.is_empty() {
                bail!("{}: no checkpoints found under checkpoints/", run.display());
            }
            all[all.len().saturating_sub(args.last)..].to_vec()
        }
        None => args.checkpoints.clone(),
    };
    // The output folder is replaced whole: it must not hold what a user wrote, nor a
    // checkpoint being averaged (a run's own, with its optimizer state).
    let out = &args.output;
    if let Some(input) = inputs.iter().find(|i| crate::io::lies_within(i, out)) {
        bail!(
            "--output {} holds {}, one of the checkpoints being averaged: give another folder",
            out.display(),
            input.display()
        );
    }
    let holds_files = out.is_file() || std::fs::read_dir(out).is_ok_and(|mut d| d.next().is_some());
    if holds_files && !args.force {
        bail!(
            "{} already exists: use --force to replace it, or another --output",
            out.display()
        );
    }
    crate::checkpoint::average(&inputs, out)?;
    let asked = match &args.run {
        Some(_) if inputs.len() < args.last => {
            format!(" (--last {}: the run has no more)", args.last)
        }
        _ => String::new(),
    };
    eprintln!(
        "averaged {} checkpoint{}{asked} into {}",
        inputs.len(),
        if inputs.len() == 1 { "" } else { "s" },
        out.display()
    );
    Ok(())
}

/// `nmt translate`
pub fn translate(args: TranslateArgs) -> Result<()> {
    if args.maxi_batch == 0 {
        bail!("--maxi-batch must be at least 1");
    }
    let aligning = args.alignment.is_some() || args.attention_png.is_some();
    if !aligning && (args.alignment_layer.is_some() || args.alignment_head.is_some()) {
        bail!("--alignment-layer and --alignment-head need --alignment or --attention-png");
    }
    let (device, dtype, compute) = select_compute(args.device, args.dtype, args.compute_type)?;
    let dir = crate::checkpoint::resolve(&args.model)?;
    let model = crate::checkpoint::load_as(&dir, &device, dtype, compute)?;
    crate::runtime::keep_freed_memory_after_load();
    let alignment = aligning
        .then(|| attention_source(&args, &model.model.config))
        .transpose()?;
    if let Some(png) = &args.attention_png {
        std::fs::create_dir_all(png)
            .with_context(|| format!("--attention-png {}: cannot create", png.display()))?;
    }
    let opts = crate::translate::SearchOptions {
        beam: args.beam,
        length_penalty: args.length_penalty,
        gnmt: args.gnmt_penalty,
        nbest: args.nbest.unwrap_or(1),
        max_len_a: args.max_len_a,
        max_len_b: args.max_len_b,
        batch_size: args.batch_size,
        scores: args.scores || args.json || args.nbest.is_some(),
        alignment,
        workers: search_workers(args.workers, &device)?,
    };
    opts.check(&model.model.config)?;
    let format = crate::translate::OutputFormat {
        nbest: args.nbest.is_some(),
        scores: args.scores,
        json: args.json,
        alignment: args.alignment,
        attention_png: args.attention_png.clone(),
    };
    let mut out = BufWriter::new(std::io::stdout().lock());
    crate::translate::stream(
        &model,
        stdin_lines(),
        &mut out,
        args.batch_size.saturating_mul(args.maxi_batch),
        std::io::stdin().is_terminal(),
        &opts,
        &format,
    )
}

/// `--workers` of `translate` and `eval --model`: at least 1; by default one per core (up
/// to 4) on the CPU; on a GPU one search has the whole device.
fn search_workers(workers: Option<usize>, device: &Device) -> Result<usize> {
    match workers {
        Some(0) => bail!("--workers must be at least 1"),
        Some(n) if n > 1 && !device.is_cpu() => {
            bail!("--workers {n}: searches side by side share the CPU's cores; on a GPU one search has the whole device (leave --workers out)")
        }
        Some(n) => Ok(n),
        None if device.is_cpu() => Ok(crate::runtime::default_workers()),
        None => Ok(1),
    }
}

/// The attention `--alignment-layer` and `--alignment-head` name, checked against the model.
fn attention_source(
    args: &TranslateArgs,
    config: &crate::model::config::ModelConfig,
) -> Result<crate::align::AttentionSource> {
    let pick = |flag: &str,
                value: &Option<String>,
                count: usize,
                what: &str|
     -> Result<Option<Option<usize>>> {
        let Some(v) = value else { return Ok(None) };
        if v == "avg" {
            return Ok(Some(None));
        }
        match v.parse::<usize>() {
            Ok(n) if n < count => Ok(Some(Some(n))),
            _ => bail!(
                "{flag} {v}: expected avg or a number below {count} (the model has {count} {what})"
            ),
        }
    };
    // A model trained with guided alignment is read where it was supervised.
    let mut source = crate::align::guided::recorded(&config.extra)
        .unwrap_or_else(|| crate::align::AttentionSource::default_for(config.decoder_layers));
    if let Some(position) = args.alignment_position {
        source.position = position;
    }
    if let Some(layer) = pick(
        "--alignment-layer",
        &args.alignment_layer,
        config.decoder_layers,
        "decoder layers",
    )? {
        source.layer = layer;
    }
    if let Some(head) = pick(
        "--alignment-head",
        &args.alignment_head,
        config.decoder_attention_heads,
        "heads",
    )? {
        source.head = head;
    }
    Ok(source)
}

/// `nmt serve`
pub fn serve(args: ServeArgs) -> Result<()> {
    if args.batch_tokens == 0 {
        bail!("--batch-tokens must be at least 1");
    }
    if args.max_body == 0
        || args.max_sentences == 0
        || args.max_chars == 0
        || args.max_requests == 0
    {
        bail!("--max-body, --max-sentences, --max-chars and --max-requests must be at least 1");
    }
    if args.read_timeout == 0 {
        bail!("--read-timeout must be at least 1 second");
    }
    if args.workers == Some(0) {
        bail!("--workers must be at least 1");
    }
    let (device, dtype, compute) = select_compute(args.device, args.dtype, args.compute_type)?;
    let mut models = Vec::new();
    for spec in &args.models {
        let parsed = spec
            .split_once('=')
            .and_then(|(pair, model)| Some((pair.split_once('-')?, model)))
            .filter(|((s, t), m)| !s.is_empty() && !t.is_empty() && !m.is_empty());
        let Some(((source, target), model)) = parsed else {
            bail!("--model {spec}: expected SRC-TGT=MODEL, e.g. de-en=runs/de-en");
        };
        let pair = (source.to_string(), target.to_string());
        if models.iter().any(|(p, _)| *p == pair) {
            bail!("--model {spec}: {source}-{target} is given twice");
        }
        let dir = crate::checkpoint::resolve(model).with_context(|| format!("--model {spec}"))?;
        let loaded = crate::checkpoint::load_as(&dir, &device, dtype, compute)
            .with_context(|| format!("--model {spec}"))?;
        eprintln!("{source}-{target}: {}", dir.display());
        models.push((pair, loaded));
    }
    crate::runtime::keep_freed_memory_after_load();
    let search = crate::translate::SearchOptions {
        beam: args.beam,
        length_penalty: args.length_penalty,
        max_len_a: args.max_len_a,
        max_len_b: args.max_len_b,
        batch_size: args.batch_size,
        ..Default::default()
    };
    for ((source, target), loaded) in &models {
        let config = &loaded.model.config;
        search
            .check(config)
            .with_context(|| format!("the {source}-{target} model"))?;
        // A request's alternatives widen its beam to alternatives + 1.
        let widest = crate::translate::SearchOptions::widest_beam(config);
        if args.max_alternatives >= widest {
            bail!(
                "--max-alternatives {}: at most {} for the {source}-{target} model (half its vocabulary of {}, less one)",
                args.max_alternatives,
                widest - 1,
                config.vocab_size
            );
        }
    }
    let limits = crate::serve::api::Limits {
        body_bytes: args.max_body,
        sentences: args.max_sentences,
        chars: args.max_chars,
        alternatives: args.max_alternatives,
        requests: args.max_requests,
        read_timeout: std::time::Duration::from_secs(args.read_timeout),
    };
    crate::serve::run(
        models,
        crate::serve::ServeOptions {
            addr: (args.host, args.port),
            api: crate::serve::ApiSettings {
                search,
                limits,
                api_key: args.api_key,
            },
            policy: crate::serve::batcher::BatchPolicy {
                tokens: args.batch_tokens,
                wait: std::time::Duration::from_millis(args.batch_wait),
                workers: args.workers.unwrap_or_else(crate::runtime::default_workers),
            },
        },
    )
}
