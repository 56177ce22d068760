//! `nmt train` end to end on a toy task: it learns, resumes exactly, is reproducible, and
//! handles bad input and interruption without losing work.

mod common;
use common::{losses, nmt_err, nmt_ok, s, toy_corpus, TINY};
use std::path::{Path, PathBuf};

/// `nmt train` arguments for a TINY model on `src`/`tgt` into `out`, plus `extra`.
fn tiny_train(src: &Path, tgt: &Path, out: &Path, extra: &[&str]) -> Vec<String> {
    let fixed = ["train", "--src", s(src), "--tgt", s(tgt), "--out", s(out)];
    fixed
        .iter()
        .chain(extra)
        .chain(TINY)
        .map(|x| x.to_string())
        .collect()
}

fn write_config(dir: &Path, json: &str) -> PathBuf {
    let p = dir.join("config.json");
    std::fs::write(&p, json).unwrap();
    p
}

/// The acceptance test: a small Transformer learns digits → number words in well under a
/// minute and translates held-out sentences at ≥ 95 BLEU (scored by `nmt eval`).
#[test]
fn toy_model_learns_to_translate() {
    let dir = tempfile::tempdir().unwrap();
    let (src, tgt) = toy_corpus(dir.path(), "train", 1, 3000);
    let (vsrc, vtgt) = toy_corpus(dir.path(), "valid", 2, 100);
    let (tsrc, tref) = toy_corpus(dir.path(), "test", 3, 200);
    let run = dir.path().join("run");
    nmt_ok(
        &[
            "train",
            "--src",
            s(&src),
            "--tgt",
            s(&tgt),
            "--valid-src",
            s(&vsrc),
            "--valid-tgt",
            s(&vtgt),
            "--out",
            s(&run),
            "--vocab-size",
            "400",
            "--d-model",
            "64",
            "--layers",
            "2",
            "--heads",
            "4",
            "--ffn-dim",
            "256",
            "--dropout",
            "0",
            "--label-smoothing",
            "0",
            "--max-tokens",
            "1024",
            "--lr",
            "5e-3",
            "--warmup",
            "100",
            "--max-steps",
            "500",
            "--valid-every",
            "200",
        ],
        b"",
    );
    assert!(run.join("best/model.safetensors").is_file() && run.join("last/config.json").is_file());
    let hyp = nmt_ok(
        &["translate", "--model", s(&run), "--beam", "4"],
        &std::fs::read(&tsrc).unwrap(),
    );
    let out = nmt_ok(&["eval", "--ref", s(&tref), "--json"], hyp.as_bytes());
    let bleu = serde_json::from_str::<serde_json::Value>(&out).unwrap()[0]["score"]
        .as_f64()
        .unwrap();
    assert!(bleu >= 95.0, "held-out BLEU {bleu}");
    // Every metrics line parses and validation was recorded.
    let text = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    assert!(text.lines().any(|l| l.contains("val_bleu")));
}

/// A run interrupted at step 10 and resumed reaches the same losses at steps 11..20 as an
/// uninterrupted one, and ends with byte-identical weights; two identical runs are identical.
#[test]
fn resume_is_exact_and_training_is_reproducible() {
    let dir = tempfile::tempdir().unwrap();
    let (src, tgt) = toy_corpus(dir.path(), "train", 5, 400);
    let cfg = write_config(
        dir.path(),
        r#"{"log_every": 1, "valid_every": 5, "warmup": 10, "lr": 0.003}"#,
    );
    let train = |out: &Path, steps: &str, resume: bool| {
        let mut args = vec![
            "train",
            "--src",
            s(&src),
            "--tgt",
            s(&tgt),
            "--out",
            s(out),
            "--config",
            s(&cfg),
            "--max-steps",
            steps,
        ];
        args.extend_from_slice(TINY);
        if resume {
            args.push("--resume");
        }
        nmt_ok(&args, b"");
    };
    let (a, b, c) = (
        dir.path().join("a"),
        dir.path().join("b"),
        dir.path().join("c"),
    );
    train(&a, "20", false);
    train(&b, "12", false);
    // Resume from step 10 (the last checkpoint), not 12: metrics after it are replaced.
    std::fs::remove_dir_all(b.join("checkpoints/step-00000012")).unwrap();
    std::os::unix::fs::symlink("checkpoints/step-00000010", b.join("last.new")).unwrap();
    std::fs::rename(b.join("last.new"), b.join("last")).unwrap();
    train(&b, "20", true);
    train(&c, "20", false);
    let (la, lb) = (losses(&a), losses(&b));
    assert_eq!(la.len(), 20);
    assert_eq!(
        lb.len(),
        20,
        "resumed metrics must not repeat steps: {lb:?}"
    );
    for ((sa, x), (sb, y)) in la.iter().zip(&lb) {
        assert_eq!(sa, sb);
        assert!((x - y).abs() <= 1e-6, "step {sa}: {x} vs {y}");
    }
    let weights = |run: &Path| std::fs::read(run.join("last/model.safetensors")).unwrap();
    assert!(weights(&a) == weights(&b), "resumed weights differ");
    assert!(weights(&a) == weights(&c), "two identical runs differ");
    // Averaging the run's checkpoints gives a loadable model.
    let avg = dir.path().join("avg");
    nmt_ok(
        &[
            "average",
            "--run",
            s(&a),
            "--last",
            "3",
            "--output",
            s(&avg),
        ],
        b"",
    );
    nmt_ok(&["translate", "--model", s(&avg)], b"1 2 3\n");
}

#[test]
fn bad_input_and_misuse_are_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let (src, tgt) = toy_corpus(dir.path(), "train", 5, 50);
    let base = |out: &Path| tiny_train(&src, &tgt, out, &["--max-steps", "2"]);
    let run_err = |args: Vec<String>| {
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        nmt_err(&refs, b"")
    };
    // An empty corpus after filtering.
    let empty = dir.path().join("empty.txt");
    std::fs::write(&empty, "\n\n").unwrap();
    let mut args = base(&dir.path().join("e"));
    args[2] = s(&empty).into();
    args[4] = s(&empty).into();
    args.extend([
        "--tokenizer".into(),
        s(&write_tokenizer(dir.path(), &src)).into(),
    ]);
    let err = run_err(args);
    assert!(err.contains("no training pairs left"), "{err}");
    // Mismatched line counts.
    let short = dir.path().join("short.txt");
    std::fs::write(&short, "1 2\n").unwrap();
    let mut args = base(&dir.path().join("m"));
    args[4] = s(&short).into();
    let err = run_err(args);
    assert!(
        err.contains("train.src has 50 lines") && err.contains("short.txt has 1 lines"),
        "{err}"
    );
    // An --out that cannot be a folder.
    let file = dir.path().join("a-file");
    std::fs::write(&file, "x").unwrap();
    let err = run_err(base(&file.join("sub")));
    assert!(err.contains("cannot create output folder"), "{err}");
    // A finished run is not overwritten without --resume.
    let out = dir.path().join("r");
    let args = base(&out);
    nmt_ok(&args.iter().map(String::as_str).collect::<Vec<_>>(), b"");
    let err = run_err(base(&out));
    assert!(err.contains("already holds a training run"), "{err}");
    // A config with a typo, and one without a stopping criterion.
    let cfg = write_config(dir.path(), r#"{"learning_rate": 1}"#);
    let err = run_err(
        [
            base(&dir.path().join("t")),
            vec!["--config".into(), s(&cfg).into()],
        ]
        .concat(),
    );
    assert!(err.contains("unknown field `learning_rate`"), "{err}");
    // A tokenizer whose vocabulary does not match the model it is paired with.
    let model = out.join("last");
    let other = write_tokenizer_sized(dir.path(), &src, 380);
    std::fs::copy(&other, model.join("tokenizer.json")).unwrap();
    let err = nmt_err(&["translate", "--model", s(&model)], b"1 2\n");
    assert!(
        err.contains("the tokenizer has") && err.contains("declares vocab_size"),
        "{err}"
    );
    // Checkpoints of two different models are not averaged: the differing field is named.
    let other = dir.path().join("other-model");
    std::fs::create_dir(&other).unwrap();
    for e in std::fs::read_dir(out.join("last")).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), other.join(e.file_name())).unwrap();
    }
    let config = std::fs::read_to_string(other.join("config.json")).unwrap();
    let changed = config.replace("\"relu\"", "\"gelu\"");
    assert_ne!(config, changed);
    std::fs::write(other.join("config.json"), changed).unwrap();
    let avg = dir.path().join("avg");
    let err = nmt_err(
        &[
            "average",
            s(&out.join("last")),
            s(&other),
            "--output",
            s(&avg),
        ],
        b"",
    );
    assert!(
        err.contains("differs") && err.contains("activation_function"),
        "{err}"
    );
    assert!(!avg.exists());
    // Nor checkpoints of one shape whose tokenizers differ: their ids mean other pieces.
    std::fs::write(other.join("config.json"), config).unwrap();
    let path = other.join("tokenizer.json");
    let mut tok: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    tok["normalizer"]["normalizers"][0]["type"] = "NFKC".into();
    std::fs::write(&path, tok.to_string()).unwrap();
    let last = out.join("last");
    let average = |output: &Path, force: bool| {
        let mut args = vec!["average", s(&last), s(&other), "--output"];
        args.push(s(output));
        if force {
            args.push("--force");
        }
        args.into_iter().map(String::from).collect::<Vec<_>>()
    };
    let err = run_err(average(&avg, false));
    assert!(err.contains("its tokenizer differs"), "{err}");
    assert!(!avg.exists());
    // The output folder is replaced whole: not a folder holding other files without
    // --force, and never a checkpoint being averaged (it would lose its optimizer state).
    std::fs::copy(out.join("last/tokenizer.json"), &path).unwrap();
    let mine = dir.path().join("mine");
    std::fs::create_dir(&mine).unwrap();
    std::fs::write(mine.join("notes.txt"), "mine").unwrap();
    let err = run_err(average(&mine, false));
    assert!(err.contains("already exists: use --force"), "{err}");
    assert!(mine.join("notes.txt").exists());
    let err = run_err(average(&other, true));
    assert!(
        err.contains("one of the checkpoints being averaged"),
        "{err}"
    );
    assert!(other.join("optimizer.safetensors").exists());
    let avg_args = average(&mine, true);
    nmt_ok(
        &avg_args.iter().map(String::as_str).collect::<Vec<_>>(),
        b"",
    );
    assert!(mine.join("model.safetensors").exists() && !mine.join("notes.txt").exists());
    // bf16 on the CPU.
    let err = run_err(
        [
            base(&dir.path().join("d")),
            vec!["--dtype".into(), "bf16".into()],
        ]
        .concat(),
    );
    assert!(err.contains("needs --device cuda"), "{err}");
}

fn write_tokenizer(dir: &Path, corpus: &Path) -> PathBuf {
    write_tokenizer_sized(dir, corpus, 400)
}

fn write_tokenizer_sized(dir: &Path, corpus: &Path, size: usize) -> PathBuf {
    let p = dir.join(format!("tok{size}.json"));
    nmt_ok(
        &[
            "tokenize",
            "train",
            "--input",
            s(corpus),
            "--vocab-size",
            &size.to_string(),
            "--output",
            s(&p),
        ],
        b"",
    );
    p
}

/// A diverging run stops at the first non-finite loss, names the step, and keeps the last good
/// checkpoint loadable.
#[test]
fn a_nan_loss_stops_training_and_keeps_the_last_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let (src, tgt) = toy_corpus(dir.path(), "train", 5, 100);
    let out = dir.path().join("run");
    let mut args = vec![
        "train",
        "--src",
        s(&src),
        "--tgt",
        s(&tgt),
        "--out",
        s(&out),
        "--max-steps",
        "50",
        "--lr",
        "1e30",
        "--warmup",
        "1",
        "--clip-norm",
        "0",
        "--valid-every",
        "1",
    ];
    args.extend_from_slice(TINY);
    let err = nmt_err(&args, b"");
    assert!(
        err.contains("the loss is NaN") || err.contains("the loss is inf"),
        "{err}"
    );
    assert!(err.contains("The last good checkpoint is"), "{err}");
    nmt_ok(&["translate", "--model", s(&out.join("last"))], b"1 2\n");
}

/// Ctrl-C (SIGINT) saves last/ and exits with 130.
#[test]
fn sigint_saves_last_and_exits_130() {
    let dir = tempfile::tempdir().unwrap();
    let (src, tgt) = toy_corpus(dir.path(), "train", 5, 400);
    let out = dir.path().join("run");
    let mut args = vec![
        "train",
        "--src",
        s(&src),
        "--tgt",
        s(&tgt),
        "--out",
        s(&out),
        "--max-steps",
        "1000000",
        "--valid-every",
        "1000000",
    ];
    args.extend_from_slice(TINY);
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_nmt"))
        .args(&args)
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // Wait until training runs (the tokenizer is written before the first step).
    let start = std::time::Instant::now();
    while !out.join("tokenizer.json").exists() && start.elapsed().as_secs() < 60 {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    std::thread::sleep(std::time::Duration::from_millis(1500));
    let status = std::process::Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let code = child.wait().unwrap().code();
    assert_eq!(code, Some(130));
    let state: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("last/trainer_state.json")).unwrap(),
    )
    .unwrap();
    assert!(state["step"].as_u64().unwrap() >= 1);
}

/// Bytes in the files under `dir` (links not followed).
fn folder_size(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            let meta = std::fs::symlink_metadata(e.path()).unwrap();
            if meta.is_dir() {
                folder_size(&e.path())
            } else {
                meta.len()
            }
        })
        .sum()
}

/// A full disk: when a checkpoint no longer fits, training stops with an error naming the
/// file and "No space left on device", the half-written checkpoint is removed, and the
/// previous one stays intact behind last/. Needs permission to mount a tmpfs (root); skipped
/// with a message otherwise.
#[test]
fn a_full_disk_is_a_clear_error_and_keeps_the_previous_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let (src, tgt) = toy_corpus(dir.path(), "train", 5, 200);
    let tok = write_tokenizer(dir.path(), &src);
    let args = |out: &Path| {
        let extra = [
            "--tokenizer",
            s(&tok),
            "--max-steps",
            "6",
            "--valid-every",
            "2",
        ];
        tiny_train(&src, &tgt, out, &extra)
    };
    // How much one checkpoint takes.
    let probe = dir.path().join("probe");
    nmt_ok(
        &args(&probe).iter().map(String::as_str).collect::<Vec<_>>(),
        b"",
    );
    let one = folder_size(&probe.join("checkpoints/step-00000002"));
    let small = dir.path().join("small");
    std::fs::create_dir(&small).unwrap();
    // Room for the tokenizer, the metrics and one checkpoint and a half: the second fails.
    let size = folder_size(&probe) - folder_size(&probe.join("checkpoints")) + one * 3 / 2;
    let Some(_unmount) = common::mount_tmpfs(&small, size) else {
        return;
    };
    let out = small.join("run");
    let err = nmt_err(
        &args(&out).iter().map(String::as_str).collect::<Vec<_>>(),
        b"",
    );
    assert!(err.contains("No space left on device"), "{err}");
    assert!(err.contains(s(&out)), "{err}");
    let last = std::fs::canonicalize(out.join("last")).unwrap();
    assert!(
        last.ends_with("checkpoints/step-00000002"),
        "{}",
        last.display()
    );
    let leftovers: Vec<_> = std::fs::read_dir(out.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("tmp"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
    let a = nmt_ok(&["translate", "--model", s(&out.join("last"))], b"1 2 3\n");
    let b = nmt_ok(
        &[
            "translate",
            "--model",
            s(&probe.join("checkpoints/step-00000002")),
        ],
        b"1 2 3\n",
    );
    assert_eq!(a, b, "the kept checkpoint is the complete step-2 one");
}

/// Validation translates through the path `nmt translate` takes: an empty line stays empty
/// (no model call), and a line longer than the model's positions is truncated with a warning
/// naming it.
#[test]
fn validation_translates_like_translate() {
    let dir = tempfile::tempdir().unwrap();
    let (src, tgt) = toy_corpus(dir.path(), "train", 5, 100);
    let (vsrc, vtgt) = (dir.path().join("v.src"), dir.path().join("v.tgt"));
    let long = "1 ".repeat(300);
    std::fs::write(&vsrc, format!("1 2 3\n\n{long}\n")).unwrap();
    std::fs::write(&vtgt, "one two three\n\none\n").unwrap();
    let run = dir.path().join("run");
    let extra = [
        "--valid-src",
        s(&vsrc),
        "--valid-tgt",
        s(&vtgt),
        "--max-steps",
        "2",
        "--valid-every",
        "2",
    ];
    let args = tiny_train(&src, &tgt, &run, &extra);
    let out = common::nmt(&args.iter().map(String::as_str).collect::<Vec<_>>(), b"");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("validation: source line 3 (1 in all) is longer than the model's")
            && err.contains("truncated"),
        "{err}"
    );
    assert!(err.contains("val_bleu"), "{err}");
}

/// Dynamic loss scaling (f16's, forced on here on the CPU): a scale so large that the scaled
/// gradients overflow skips those updates and halves the scale until they fit; training then
/// goes on to the requested step, and the scale doubles after `loss_scale_window` good steps.
#[test]
fn the_loss_scaler_skips_overflowing_steps_and_recovers() {
    let dir = tempfile::tempdir().unwrap();
    let (src, tgt) = toy_corpus(dir.path(), "train", 5, 200);
    let cfg = write_config(
        dir.path(),
        r#"{"loss_scale": 1e38, "loss_scale_window": 2, "log_every": 1}"#,
    );
    let run = dir.path().join("run");
    let args = tiny_train(
        &src,
        &tgt,
        &run,
        &[
            "--config",
            s(&cfg),
            "--max-steps",
            "4",
            "--valid-every",
            "100",
        ],
    );
    let out = common::nmt(&args.iter().map(String::as_str).collect::<Vec<_>>(), b"");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("gradients overflowed"), "{err}");
    assert_eq!(losses(&run).len(), 4);
    assert!(losses(&run).iter().all(|(_, l)| l.is_finite()));
    let records: Vec<serde_json::Value> = std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    // (steps done when it happened, the scale it left)
    let overflows: Vec<(u64, f64)> = records
        .iter()
        .filter(|v| v["overflow"] == true)
        .map(|v| {
            (
                v["step"].as_u64().unwrap(),
                v["loss_scale"].as_f64().unwrap(),
            )
        })
        .collect();
    assert!(!overflows.is_empty());
    let state: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(run.join("last/trainer_state.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(state["skipped_steps"], overflows.len());
    // After the last overflow, the scale doubled once per two good steps (window 2).
    let (at, scale) = *overflows.last().unwrap();
    let doublings = (4 - at as i32) / 2;
    assert_eq!(
        state["loss_scale"]["scale"].as_f64().unwrap(),
        scale * 2f64.powi(doublings)
    );
}

/// The Transformer-base preset builds and takes a training step on the CPU (a tiny batch).
#[test]
fn the_transformer_base_preset_trains_on_the_cpu() {
    let dir = tempfile::tempdir().unwrap();
    let (src, tgt) = toy_corpus(dir.path(), "train", 5, 50);
    let preset = Path::new(env!("CARGO_MANIFEST_DIR")).join("data/configs/transformer-base.json");
    let run = dir.path().join("run");
    nmt_ok(
        &[
            "train",
            "--src",
            s(&src),
            "--tgt",
            s(&tgt),
            "--out",
            s(&run),
            "--config",
            s(&preset),
            "--vocab-size",
            "400",
            "--max-tokens",
            "128",
            "--max-steps",
            "1",
        ],
        b"",
    );
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("last/config.json")).unwrap())
            .unwrap();
    assert_eq!(config["d_model"], 512);
    assert_eq!(config["encoder_layers"], 6);
    assert_eq!(config["decoder_attention_heads"], 8);
    assert_eq!(config["encoder_ffn_dim"], 2048);
}
