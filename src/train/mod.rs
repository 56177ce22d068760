//! Training: the loop (teacher forcing, token-based batches, accumulation, label smoothing,
//! Adam with warm-up, clipping), validation with BLEU through the same code as `nmt eval`,
//! checkpoints, exact resume, early stopping and averaging.

pub mod config;
pub mod data;
pub mod loss;
pub mod loss_scale;
mod metrics;
pub mod optim;
#[cfg(feature = "cuda")]
mod optim_cuda;
pub mod plot;
pub mod schedule;
mod validate;

use crate::checkpoint::{self, Checkpoint, TrainerState};
use crate::cli::FreezePart;
use crate::data::batch::{epoch_order, Batch, Mixture};
use crate::data::tokenizer::SubwordTokenizer;
use crate::model::weights::Weights;
use crate::model::{Dropout, ModelConfig, Seq2Seq};
use crate::ops;
use anyhow::{anyhow, bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use config::{parse_duration, TrainConfig};
use indicatif::{ProgressBar, ProgressStyle};
use loss_scale::LossScaler;
use metrics::MetricsLog;
use optim::{Adam, AdamConfig};
use serde_json::json;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// Everything `nmt train` needs; the training corpora are in `config.corpora`.
pub struct TrainJob {
    /// Validation files (source, target).
    pub valid: Option<(PathBuf, PathBuf)>,
    /// A tokenizer.json; when absent a prepared corpus's is used, or one is trained with
    /// `config.vocab_size`.
    pub tokenizer: Option<PathBuf>,
    /// Output folder.
    pub out: PathBuf,
    /// Hyper-parameters.
    pub config: TrainConfig,
    /// Continue the run in `out`.
    pub resume: bool,
    /// Fine-tune from this model (a folder, run or Hub id).
    pub init: Option<String>,
    /// Parts held fixed.
    pub freeze: Vec<FreezePart>,
    /// `--dropout`, which also replaces a fine-tuned model's own.
    pub dropout: Option<f64>,
    /// Device and dtype.
    pub device: Device,
    /// Weight dtype.
    pub dtype: DType,
    /// Set by Ctrl-C: save `last/` and stop.
    pub interrupt: Arc<AtomicBool>,
}

/// How training ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// A stopping criterion was met.
    Finished,
    /// Validation BLEU stopped improving.
    EarlyStopped,
    /// Ctrl-C; `last/` was saved.
    Interrupted,
}

fn check_writable(out: &Path) -> Result<()> {
    std::fs::create_dir_all(out)
        .with_context(|| format!("{}: cannot create output folder", out.display()))?;
    let probe = out.join(".nmt-write-test");
    crate::io::write_atomic(&probe, b"ok")
        .with_context(|| format!("{}: output folder is not writable", out.display()))?;
    std::fs::remove_file(&probe).ok();
    Ok(())
}

fn model_config(cfg: &TrainConfig, tok: &SubwordTokenizer) -> ModelConfig {
    let mut m = ModelConfig::new(
        tok.vocab_size(),
        tok.pad_id,
        tok.eos_id,
        cfg.d_model,
        cfg.encoder_layers,
        cfg.heads,
        cfg.ffn_dim,
    );
    m.decoder_layers = cfg.decoder_layers;
    m.activation_function = cfg.activation.clone();
    m.normalize_before = cfg.normalize_before;
    m.dropout = cfg.dropout;
    m.attention_dropout = cfg.attention_dropout;
    m.activation_dropout = cfg.activation_dropout;
    m.max_position_embeddings = cfg.max_positions;
    m
}

/// The training settings for a model of `start`'s number of positions: a model read from a
/// checkpoint (fine-tuned or resumed) keeps its own, and no training or validation pair may
/// be longer, so `max_len` is lowered to it where it is longer (with a note).
fn fit_positions(cfg: &TrainConfig, start: Option<&ModelConfig>) -> TrainConfig {
    let mut cfg = cfg.clone();
    if let Some(m) = start {
        let positions = m.max_position_embeddings;
        if cfg.max_len > positions {
            eprintln!(
                "max_len {} lowered to {positions}: the model has {positions} positions",
                cfg.max_len
            );
            cfg.max_len = positions;
        }
        cfg.max_positions = positions;
    }
    cfg
}

struct Trainer<'a> {
    job: &'a TrainJob,
    cfg: &'a TrainConfig,
    model: Seq2Seq,
    model_config: ModelConfig,
    weights: Weights,
    opt: Adam,
    tok: SubwordTokenizer,
    /// A fine-tuned model's own tokenizer files, copied into every checkpoint.
    tokenizer_files: Option<PathBuf>,
    /// Guided alignment, when training with it.
    guide: Option<crate::align::guided::Guide>,
    /// Whether validation has said that it truncates sources longer than the model's
    /// positions (said once, not at every validation).
    truncation_said: std::cell::Cell<bool>,
}

impl Trainer<'_> {
    /// Forward pass of one batch: (label-smoothed loss sum, NLL sum).
    fn batch_loss(&self, b: &Batch, drop: &Dropout) -> Result<(Tensor, Tensor)> {
        let m = &self.model;
        let src_bias = m.padding_bias(&b.src)?;
        let memory = m.encode(&b.src, &src_bias, drop)?;
        let t = b.tgt_in.dim(1)?;
        let tgt_bias = m
            .causal_bias(t)?
            .broadcast_add(&m.length_bias(&b.tgt_lengths, t)?)?;
        let guide = self.guide.as_ref().filter(|_| b.alignment.is_some());
        let (h, attention) = m.decode_attending(
            &b.tgt_in,
            &tgt_bias,
            &memory,
            &src_bias,
            drop,
            guide.map(|g| g.layer),
        )?;
        let (bs, t, d) = h.dims3()?;
        let rows = ops::select_rows(&h.reshape((bs * t, d))?, &b.positions)?;
        let eps = if drop.is_on() {
            self.cfg.label_smoothing
        } else {
            0.0
        };
        let (weight, bias) = m.output_projection();
        let (loss, nll) =
            loss::label_smoothed_nll(weight, bias, &rows, &b.labels, eps, drop.is_on())?;
        match (guide, &b.alignment, attention) {
            (Some(g), Some((targets, _)), Some(probs)) => {
                let cost = crate::align::guided::cost(&probs, g.head, targets)?;
                let cost = (cost.to_dtype(loss.dtype())? * g.weight)?;
                Ok(((loss + cost)?, nll))
            }
            _ => Ok((loss, nll)),
        }
    }

    fn save(&self, step_dir: &Path, state: &TrainerState) -> Result<()> {
        Checkpoint {
            config: &self.model_config,
            tensors: self.weights.named_tensors()?.into_iter().collect(),
            tokenizer: &self.tok,
            tokenizer_files: self.tokenizer_files.as_deref(),
            optimizer: Some(self.opt.state()?),
            state: Some(state),
        }
        .save(step_dir)
    }
}

/// Runs a training job.
pub fn run(job: &TrainJob) -> Result<Outcome> {
    job.config.validate()?;
    check_writable(&job.out)?;
    let last = job.out.join("last");
    let resume_state: Option<TrainerState> = if job.resume {
        let p = last.join("trainer_state.json");
        let text = std::fs::read_to_string(&p)
            .with_context(|| format!("{}: cannot resume: no checkpoint", p.display()))?;
        Some(
            serde_json::from_str(&text)
                .with_context(|| format!("{}: corrupt trainer state", p.display()))?,
        )
    } else {
        if last.exists() {
            bail!(
                "{} already holds a training run: use --resume to continue it, or another --out",
                job.out.display()
            );
        }
        None
    };
    // Fine-tuning: the model's own tokenizer files, kept byte for byte in DIR/model-tokenizer
    // and copied into every checkpoint.
    let init_dir = job.init.as_deref().map(checkpoint::resolve).transpose()?;
    let kept_tokenizer = job.out.join("model-tokenizer");
    if let Some(dir) = &init_dir {
        std::fs::create_dir_all(&kept_tokenizer)
            .with_context(|| format!("{}: cannot create", kept_tokenizer.display()))?;
        checkpoint::folder::copy_tokenizer_files(dir, &kept_tokenizer)?;
    }
    // A resumed run continues its own model, a fine-tuned one starts from the given model's.
    let start_config = match (&init_dir, job.resume) {
        (_, true) => Some(ModelConfig::load(&last.join("config.json"))?),
        (Some(dir), false) => {
            eprintln!(
                "fine-tuning {}: architecture, dropout and tokenizer from the model, a fresh optimizer and schedule",
                dir.display()
            );
            Some(ModelConfig::load(&dir.join("config.json"))?)
        }
        (None, false) => None,
    };
    let cfg = &fit_positions(&job.config, start_config.as_ref());
    let data_start = Instant::now();
    let (tok, mixture, valid) = data::load(
        cfg,
        init_dir.as_deref().or(job.tokenizer.as_deref()),
        job.valid.as_ref(),
        &job.out,
        job.resume.then_some(last.as_path()),
    )?;
    for (name, bytes) in tok.model_files()? {
        crate::io::write_atomic(&job.out.join(name), &bytes)?;
    }
    let mut model_config = match (start_config, job.resume) {
        (Some(c), true) => c,
        (Some(mut c), false) => {
            if let Some(p) = job.dropout {
                c.dropout = p;
            }
            c
        }
        (None, _) => model_config(cfg, &tok),
    };
    if model_config.vocab_size != tok.vocab_size() {
        bail!(
            "{}: the tokenizer has {} pieces but the model config expects a vocabulary of {}",
            tok.path.display(),
            tok.vocab_size(),
            model_config.vocab_size
        );
    }
    if model_config.pad_token_id != tok.pad_id || model_config.eos_token_id != tok.eos_id {
        bail!(
            "{}: the tokenizer's <pad>/</s> ids do not match the model config",
            tok.path.display()
        );
    }
    // Model and optimizer.
    // A resumed run starts from its last weights (variables and buffers), a fine-tuned one
    // from the model's, a new one from the seed.
    let weights = match (&init_dir, job.resume) {
        (_, true) => Weights::start_from(&last.join("model.safetensors"), &job.device, job.dtype)?,
        (Some(dir), false) => {
            Weights::start_from(&checkpoint::hub::weights_file(dir), &job.device, job.dtype)?
        }
        (None, false) => Weights::init(cfg.seed, &job.device, job.dtype),
    };
    let model = Seq2Seq::new(&model_config, &weights)?;
    // Guided alignment supervises a decoder layer's first head, by default the last layer's
    // (Marian's choice); the checkpoints record it for `translate --alignment`.
    let guide = match (
        &cfg.guided_alignment,
        &cfg.corpora[0].src,
        &cfg.corpora[0].tgt,
    ) {
        (Some(path), Some(src), Some(tgt)) => {
            let last = model_config.decoder_layers - 1;
            let layer = cfg.guided_alignment_layer.unwrap_or(last);
            if layer > last {
                bail!("--guided-alignment-layer {layer}: the model has decoder layers 0 to {last}");
            }
            let head = (!cfg.guided_alignment_all_heads).then_some(0);
            let g = crate::align::guided::Guide::read(
                path,
                src,
                tgt,
                cfg.guided_alignment_weight,
                layer,
                head,
                cfg.guided_alignment_position,
            )?;
            model_config.extra.insert(
                crate::align::guided::CONFIG_KEY.into(),
                crate::align::guided::config_value(&g),
            );
            let heads = match head {
                Some(h) => format!("head {h}"),
                None => "the mean of its heads".into(),
            };
            let position = match g.position {
                crate::align::AlignPosition::Predict => "predicting",
                crate::align::AlignPosition::Read => "reading",
            };
            eprintln!(
                "guided alignment: {} supervises decoder layer {layer}, {heads}, at the positions {position} each token, weight {}",
                path.display(),
                g.weight
            );
            Some(g)
        }
        _ => None,
    };
    // Frozen parts stay out of the optimizer: never updated, bit for bit. A resumed run keeps
    // the parts it froze.
    let parts: Vec<FreezePart> = match &resume_state {
        Some(s) if job.freeze.is_empty() => s
            .frozen
            .iter()
            .map(|n| {
                <FreezePart as clap::ValueEnum>::from_str(n, false)
                    .map_err(|e| anyhow!("{}: frozen part {n:?}: {e}", last.display()))
            })
            .collect::<Result<_>>()?,
        _ => job.freeze.clone(),
    };
    let frozen: Vec<String> = parts.iter().map(|p| p.name()).collect();
    if let Some(s) = resume_state.as_ref().filter(|s| s.frozen != frozen) {
        bail!(
            "--freeze {:?} differs from the run's {:?}: a resumed run keeps what it froze",
            frozen,
            s.frozen
        );
    }
    let is_frozen = |name: &str| parts.iter().any(|p| p.holds(name));
    let trained: Vec<_> = weights
        .vars()
        .into_iter()
        .filter(|(name, _)| !is_frozen(name))
        .collect();
    if trained.is_empty() {
        bail!("--freeze holds every weight fixed: nothing is left to train");
    }
    let mut opt = Adam::new(
        trained,
        AdamConfig {
            beta1: cfg.adam_beta1,
            beta2: cfg.adam_beta2,
            eps: cfg.adam_eps,
            weight_decay: cfg.weight_decay,
        },
    )?;
    let mut state = TrainerState {
        step: 0,
        epoch: 1,
        batch_in_epoch: 0,
        tokens_seen: 0,
        elapsed_s: 0.0,
        best_bleu: None,
        best_step: None,
        bad_validations: 0,
        loss_scale: match (cfg.loss_scale, job.dtype) {
            (Some(s), _) if s > 0.0 => Some(LossScaler::new(s, cfg.loss_scale_window)),
            (None, DType::F16) => Some(LossScaler::new(65536.0, cfg.loss_scale_window)),
            _ => None,
        },
        skipped_steps: 0,
        frozen: frozen.clone(),
    };
    if let Some(s) = resume_state {
        opt.load_state(&last.join("optimizer.safetensors"), s.step)?;
        eprintln!(
            "resuming at step {} (epoch {}, batch {})",
            s.step, s.epoch, s.batch_in_epoch
        );
        state = s;
    }
    // The pad row of the shared embedding stays zero (Marian: the decoder starts from it).
    if opt.vars().any(|(name, _)| name == "model.shared.weight") {
        opt.freeze_row("model.shared.weight", model_config.pad_token_id as usize)?;
    }
    let mut trainer = Trainer {
        job,
        cfg,
        model,
        model_config,
        weights,
        opt,
        tok,
        tokenizer_files: kept_tokenizer.is_dir().then_some(kept_tokenizer),
        guide,
        truncation_said: Default::default(),
    };
    train_loop(
        &mut trainer,
        &mixture,
        valid.as_ref(),
        &mut state,
        data_start.elapsed().as_secs_f64(),
        init_dir.is_some(),
    )
}

/// Whether every gradient is finite (one reduction per tensor, one read on the host).
fn grads_finite(grads: &[Tensor]) -> Result<bool> {
    if grads.is_empty() {
        return Ok(true);
    }
    let sums = grads
        .iter()
        .map(|g| g.to_dtype(DType::F32)?.sqr()?.sum_all())
        .collect::<candle_core::Result<Vec<_>>>()?;
    let total = Tensor::stack(&sums, 0)?.sum_all()?.to_scalar::<f32>()?;
    Ok(total.is_finite())
}

fn prune_checkpoints(out: &Path, keep: usize, best_step: Option<usize>) -> Result<()> {
    let all = checkpoint::list_checkpoints(out)?;
    let best = best_step.map(|s| format!("step-{s:08}"));
    let removable: Vec<_> = all
        .iter()
        .filter(|p| best.as_deref() != p.file_name().and_then(|n| n.to_str()))
        .collect();
    for p in removable.iter().take(removable.len().saturating_sub(keep)) {
        std::fs::remove_dir_all(p)
            .with_context(|| format!("{}: cannot remove old checkpoint", p.display()))?;
    }
    Ok(())
}

fn train_loop(
    tr: &mut Trainer,
    mixture: &Mixture,
    valid: Option<&data::Valid>,
    state: &mut TrainerState,
    data_s: f64,
    validate_first: bool,
) -> Result<Outcome> {
    let cfg = tr.cfg;
    let job = tr.job;
    let out = &job.out;
    let max_time = cfg.max_time.as_deref().map(parse_duration).transpose()?;
    let mut log = MetricsLog::open(&out.join("metrics.jsonl"), job.resume.then_some(state.step))?;
    let start = Instant::now();
    let elapsed0 = state.elapsed_s;
    let tty = std::io::stderr().is_terminal();
    // NMT_PROFILE=1: wait for the device after each phase and log the forward, backward and
    // optimizer milliseconds of every step (slower; for finding where a step's time goes).
    let profile = std::env::var_os("NMT_PROFILE").is_some_and(|v| v == "1");
    let device = tr.model.device().clone();
    let bar = match (tty, cfg.max_steps) {
        (false, _) => ProgressBar::hidden(),
        (true, Some(n)) => ProgressBar::new(n as u64),
        (true, None) => ProgressBar::new_spinner(),
    };
    bar.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} {msg} [{elapsed_precise}, ETA {eta}]")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_position(state.step as u64);
    let start_id = tr.model_config.decoder_start_token_id;
    let (pad, eos) = (tr.tok.pad_id, tr.tok.eos_id);
    let first_step = state.step;
    let mut outcome = Outcome::Finished;
    let mut last_saved = job.resume.then_some(state.step);
    let warned_font = std::cell::Cell::new(false);
    let save_and_validate = |tr: &Trainer,
                             state: &mut TrainerState,
                             log: &mut MetricsLog|
     -> Result<bool> {
        let dir = out
            .join("checkpoints")
            .join(format!("step-{:08}", state.step));
        let mut improved = false;
        if let Some(valid) = valid {
            let v = tr.validate(valid)?;
            improved = state.best_bleu.is_none_or(|b| v.bleu > b);
            if improved {
                state.best_bleu = Some(v.bleu);
                state.best_step = Some(state.step);
                state.bad_validations = 0;
            } else {
                state.bad_validations += 1;
            }
            let msg = format!(
                "step {} val_loss {:.4} val_ppl {:.2} val_bleu {:.2}{}",
                state.step,
                v.loss,
                v.loss.exp(),
                v.bleu,
                if improved { " (best)" } else { "" }
            );
            if tty {
                bar.println(&msg)
            } else {
                eprintln!("{msg}")
            }
            log.write(json!({"step": state.step, "val_loss": v.loss, "val_ppl": v.loss.exp(), "val_bleu": v.bleu, "elapsed": elapsed0 + start.elapsed().as_secs_f64()}))?;
            if !plot::learning_curve(&out.join("metrics.jsonl"), &out.join("learning-curve.png"))?
                && !warned_font.replace(true)
            {
                eprintln!(
                    "note: no font found for learning-curve.png (set NMT_PLOT_FONT to a .ttf file)"
                );
            }
        }
        state.elapsed_s = elapsed0 + start.elapsed().as_secs_f64();
        tr.save(&dir, state)?;
        let rel = Path::new("checkpoints").join(dir.file_name().unwrap());
        checkpoint::point(&out.join("last"), &rel)?;
        if improved {
            checkpoint::point(&out.join("best"), &rel)?;
        }
        prune_checkpoints(out, cfg.keep_last, state.best_step)?;
        Ok(improved)
    };
    // A fine-tuned run is validated before any update: the log shows where the model starts.
    if validate_first && valid.is_some() && state.step == 0 {
        save_and_validate(tr, state, &mut log)?;
        last_saved = Some(0);
    }
    'epochs: loop {
        if cfg.max_epochs.is_some_and(|m| state.epoch > m) {
            break;
        }
        let pairs: usize = mixture
            .corpora
            .iter()
            .map(|(_, store, _)| store.len())
            .sum();
        if pairs > 5_000_000 {
            // About a second per 20 M pairs: say what the pause is.
            eprintln!("planning epoch {} over {pairs} pairs", state.epoch);
        }
        let plan = mixture.plan(cfg.max_len, cfg.max_tokens, cfg.seed, state.epoch)?;
        if plan.is_empty() {
            bail!(
                "no training pairs left after filtering (longest side at most max_len {} tokens): {}",
                cfg.max_len,
                mixture
                    .corpora
                    .iter()
                    .map(|(_, store, _)| store.summary())
                    .collect::<Vec<_>>()
                    .join("; ")
            );
        }
        let drawn: Vec<String> = mixture
            .corpora
            .iter()
            .zip(&plan.drawn)
            .map(|((name, store, w), n)| format!("{name} {n} of {} (weight {w})", store.len()))
            .collect();
        let msg = format!(
            "epoch {}: {} pairs ({}), {} batches, {:.1} % padding{}",
            state.epoch,
            plan.drawn.iter().sum::<u64>(),
            drawn.join(", "),
            plan.len(),
            100.0 * plan.padding_share(),
            if plan.too_long > 0 {
                format!(
                    ", {} pairs over max_len {} skipped",
                    plan.too_long, cfg.max_len
                )
            } else {
                String::new()
            }
        );
        if tty {
            bar.println(&msg)
        } else {
            eprintln!("{msg}")
        }
        if state.batch_in_epoch == 0 || state.step == first_step {
            let corpora: serde_json::Map<String, serde_json::Value> = mixture
                .corpora
                .iter()
                .zip(&plan.drawn)
                .map(|((name, _, _), n)| (name.clone(), json!(n)))
                .collect();
            let mut record = json!({"step": state.step, "epoch": state.epoch, "epoch_pairs": corpora, "batches": plan.len(), "padding": plan.padding_share()});
            if state.step == first_step {
                record["data_s"] = json!(data_s);
            }
            log.write(record)?;
        }
        let order = epoch_order(plan.len(), cfg.seed, state.epoch);
        while state.batch_in_epoch < order.len() {
            if cfg.max_steps.is_some_and(|m| state.step >= m)
                || max_time.is_some_and(|t| elapsed0 + start.elapsed().as_secs_f64() >= t)
            {
                break 'epochs;
            }
            let t0 = Instant::now();
            let step = state.step + 1;
            let drop = Dropout::on(cfg.seed.wrapping_mul(0x2545_F491_4F6C_DD1D) ^ step as u64);
            let mut grads: Option<Vec<Tensor>> = None;
            let (mut loss_sum, mut n_tokens) = (0f64, 0usize);
            let mut phase_ms = [0f64; 3];
            // Forward and backward passes, the pool's threads awake between their many parallel
            // sections.
            let passes = || -> Result<()> {
                for _ in 0..cfg.accum {
                    if state.batch_in_epoch >= order.len() {
                        break;
                    }
                    let exs = mixture.examples(plan.batch(order[state.batch_in_epoch]), eos);
                    state.batch_in_epoch += 1;
                    let mut b = Batch::new(&exs, pad, start_id, tr.model.device())?;
                    if let Some(g) = &tr.guide {
                        let (s, t) = (b.src.dim(1)?, b.tgt_in.dim(1)?);
                        b.alignment = Some(g.targets(&exs, &tr.tok, s, t, tr.model.device())?);
                    }
                    let t = Instant::now();
                    let (loss, _) = tr.batch_loss(&b, &drop)?;
                    loss_sum += loss.to_dtype(DType::F32)?.to_scalar::<f32>()? as f64;
                    n_tokens += b.n_tokens;
                    phase_ms[0] += t.elapsed().as_secs_f64() * 1e3;
                    let t = Instant::now();
                    let store = match state.loss_scale {
                        Some(s) => (&loss * s.scale)?.backward()?,
                        None => loss.backward()?,
                    };
                    if profile {
                        device.synchronize()?;
                    }
                    phase_ms[1] += t.elapsed().as_secs_f64() * 1e3;
                    let g: Vec<Tensor> = tr
                        .opt
                        .vars()
                        .map(|(name, v)| {
                            store
                                .get(v.as_tensor())
                                .cloned()
                                .ok_or_else(|| anyhow!("parameter {name} received no gradient"))
                        })
                        .collect::<Result<_>>()?;
                    grads = Some(match grads.take() {
                        None => g,
                        Some(acc) => acc
                            .iter()
                            .zip(&g)
                            .map(|(a, b)| a + b)
                            .collect::<candle_core::Result<_>>()?,
                    });
                }
                Ok(())
            };
            crate::runtime::with_partners_awake(&device, passes)?;
            let per_token = loss_sum / n_tokens.max(1) as f64;
            if !per_token.is_finite() {
                bail!(
                    "step {step}: the loss is {per_token}; training stopped. {}",
                    match last_saved {
                        Some(s) => format!(
                            "The last good checkpoint is {} (step {s}).",
                            out.join("last").display()
                        ),
                        None => "No checkpoint was written yet.".into(),
                    }
                );
            }
            let grads = grads.unwrap_or_default();
            let loss_scale = state.loss_scale.map_or(1.0, |s| s.scale);
            if let Some(scaler) = state.loss_scale.as_mut() {
                if !scaler.update(grads_finite(&grads)?) {
                    // The batches are used up; the update is not made and the step not counted.
                    state.skipped_steps += 1;
                    let msg = format!(
                        "step {step}: gradients overflowed at loss scale {loss_scale}; update skipped, scale now {}",
                        scaler.scale
                    );
                    if tty {
                        bar.println(&msg)
                    } else {
                        eprintln!("{msg}")
                    }
                    log.write(
                        json!({"step": state.step, "overflow": true, "loss_scale": scaler.scale}),
                    )?;
                    if job.interrupt.load(Ordering::SeqCst) {
                        outcome = Outcome::Interrupted;
                        break 'epochs;
                    }
                    continue;
                }
            }
            let lr = cfg
                .schedule
                .lr(step, cfg.lr, cfg.warmup, tr.model_config.d_model);
            // Mean over target tokens, the pad row of the shared embedding held at zero
            // (Marian: the decoder starts from it), clipped, then Adam.
            let t = Instant::now();
            tr.opt.update(
                &grads,
                1.0 / (n_tokens.max(1) as f64 * loss_scale),
                cfg.clip_norm,
                lr,
            )?;
            if profile {
                device.synchronize()?;
            }
            phase_ms[2] = t.elapsed().as_secs_f64() * 1e3;
            state.step = step;
            state.tokens_seen += n_tokens as u64;
            let dt = t0.elapsed().as_secs_f64();
            let tok_s = n_tokens as f64 / dt;
            bar.set_position(step as u64);
            bar.set_message(format!(
                "epoch {} loss {per_token:.3} lr {lr:.2e} {tok_s:.0} tok/s",
                state.epoch
            ));
            if step.is_multiple_of(cfg.log_every) {
                let elapsed = elapsed0 + start.elapsed().as_secs_f64();
                let mut record = json!({"step": step, "epoch": state.epoch, "loss": per_token, "lr": lr, "tok_s": tok_s, "elapsed": elapsed});
                if profile {
                    let [f, b, o] = phase_ms;
                    record["forward_ms"] = json!(f);
                    record["backward_ms"] = json!(b);
                    record["optimizer_ms"] = json!(o);
                }
                log.write(record)?;
                if !tty {
                    eprintln!("epoch {} step {step} loss {per_token:.4} lr {lr:.3e} tok/s {tok_s:.0} elapsed {elapsed:.0}s", state.epoch);
                }
            }
            if step.is_multiple_of(cfg.valid_every) {
                save_and_validate(tr, state, &mut log)?;
                last_saved = Some(step);
                if cfg.patience.is_some_and(|p| state.bad_validations >= p) {
                    outcome = Outcome::EarlyStopped;
                    break 'epochs;
                }
            }
            if job.interrupt.load(Ordering::SeqCst) {
                outcome = Outcome::Interrupted;
                break 'epochs;
            }
        }
        state.epoch += 1;
        state.batch_in_epoch = 0;
    }
    if last_saved != Some(state.step) {
        save_and_validate(tr, state, &mut log)?;
    }
    bar.finish_and_clear();
    eprintln!(
        "{} at step {}: checkpoints in {}{}",
        match outcome {
            Outcome::Finished => "finished",
            Outcome::EarlyStopped => "stopped early",
            Outcome::Interrupted => "interrupted; saved last/",
        },
        state.step,
        out.display(),
        state
            .best_bleu
            .map(|b| format!(
                ", best validation BLEU {b:.2} at step {}",
                state.best_step.unwrap_or(0)
            ))
            .unwrap_or_default()
    );
    Ok(outcome)
}
