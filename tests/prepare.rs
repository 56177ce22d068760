//! Prepared corpora end to end: `nmt prepare`, `nmt train --data`, the store a run prepares
//! for itself, weighted corpora, and every way a store or its sources can be wrong.

mod common;
use common::{losses, nmt, nmt_err, nmt_ok, s, toy_corpus, TINY};
use std::path::{Path, PathBuf};

fn tokenizer(dir: &Path, src: &Path, tgt: &Path, size: &str) -> PathBuf {
    let p = dir.join(format!("tok{size}.json"));
    nmt_ok(
        &[
            "tokenize",
            "train",
            "--input",
            s(src),
            "--input",
            s(tgt),
            "--vocab-size",
            size,
            "--output",
            s(&p),
        ],
        b"",
    );
    p
}

/// `nmt prepare` arguments.
fn prepare_args<'a>(src: &'a Path, tgt: &'a Path, tok: &'a Path, out: &'a Path) -> Vec<&'a str> {
    let a = [
        "prepare",
        "--src",
        s(src),
        "--tgt",
        s(tgt),
        "--tokenizer",
        s(tok),
    ];
    [&a[..], &["--out", s(out)]].concat()
}

/// Runs `nmt prepare`, asserts success and returns stderr.
fn prepare(src: &Path, tgt: &Path, tok: &Path, out: &Path) -> String {
    let o = nmt(&prepare_args(src, tgt, tok, out), b"");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// `nmt train` with TINY flags and `args`; returns stderr.
fn train(args: &[&str]) -> String {
    let all: Vec<&str> = ["train"].iter().chain(args).chain(TINY).copied().collect();
    let o = nmt(&all, b"");
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "nmt {all:?} failed: {err}");
    err
}

/// A store made by `nmt prepare` trains exactly like the text it was made from; a run
/// prepares its own store once and its resumption reads no text.
#[test]
fn a_prepared_store_trains_like_its_text_and_is_reused() {
    let dir = tempfile::tempdir().unwrap();
    let (src, tgt) = toy_corpus(dir.path(), "train", 5, 300);
    let tok = tokenizer(dir.path(), &src, &tgt, "400");
    let store = dir.path().join("store");
    let said = prepare(&src, &tgt, &tok, &store);
    assert!(said.contains("300 pairs of 300 lines"), "{said}");
    assert!(said.contains("pairs/s"), "{said}");
    let cfg = dir.path().join("cfg.json");
    std::fs::write(&cfg, r#"{"log_every": 1}"#).unwrap();
    let steps = [
        "--max-steps",
        "8",
        "--valid-every",
        "4",
        "--config",
        s(&cfg),
    ];
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    let from_store = [&["--data", s(&store), "--out", s(&a)][..], &steps].concat();
    train(&from_store);
    let from_text = [
        &[
            "--src",
            s(&src),
            "--tgt",
            s(&tgt),
            "--tokenizer",
            s(&tok),
            "--out",
            s(&b),
        ][..],
        &steps,
    ]
    .concat();
    let said = train(&from_text);
    assert!(said.contains("preparing"), "{said}");
    assert!(b.join("data/train/store.json").is_file());
    assert_eq!(losses(&a), losses(&b));
    assert_eq!(losses(&a).len(), 8);
    // Resuming reuses the run's store: nothing is prepared again.
    let mut resumed = from_text.clone();
    let n = resumed.len();
    resumed[n - 5] = "12";
    resumed.push("--resume");
    let said = train(&resumed);
    assert!(!said.contains("preparing"), "{said}");
    assert_eq!(losses(&b).len(), 12);
    // The metrics record the data's time, batches, padding and per-corpus pairs.
    let text = std::fs::read_to_string(b.join("metrics.jsonl")).unwrap();
    let data: serde_json::Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
    assert!(data["data_s"].as_f64().is_some(), "{data}");
    assert_eq!(data["epoch_pairs"]["train"], 300, "{data}");
    assert!(data["padding"].as_f64().unwrap() < 0.5, "{data}");
}

/// Two corpora with weights in the config: every epoch draws the small one three times.
#[test]
fn weighted_corpora_are_sampled_as_configured() {
    let dir = tempfile::tempdir().unwrap();
    let (gs, gt) = toy_corpus(dir.path(), "general", 1, 400);
    let (is, it) = toy_corpus(dir.path(), "indomain", 2, 40);
    let cfg = dir.path().join("cfg.json");
    let json = serde_json::json!({
        "corpora": [
            {"name": "general", "src": gs, "tgt": gt},
            {"name": "indomain", "src": is, "tgt": it, "weight": 3},
        ],
        "vocab_size": 400, "max_epochs": 2, "valid_every": 1000, "log_every": 1,
    });
    std::fs::write(&cfg, json.to_string()).unwrap();
    let run = dir.path().join("run");
    let said = train(&["--config", s(&cfg), "--out", s(&run)]);
    assert!(said.contains("general 400 of 400 (weight 1)"), "{said}");
    assert!(said.contains("indomain 120 of 40 (weight 3)"), "{said}");
    assert!(run.join("data/general/store.json").is_file());
    assert!(run.join("data/indomain/store.json").is_file());
    let epochs: Vec<serde_json::Value> = std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| !v["epoch_pairs"].is_null())
        .collect();
    assert_eq!(epochs.len(), 2, "{epochs:?}");
    for e in &epochs {
        assert_eq!(e["epoch_pairs"]["indomain"], 120);
        assert_eq!(e["epoch_pairs"]["general"], 400);
    }
    // A weight that is not a positive number is refused before any work.
    for bad in [
        serde_json::json!(0),
        serde_json::json!(-2),
        serde_json::json!("x"),
    ] {
        let mut j = json.clone();
        j["corpora"][1]["weight"] = bad.clone();
        std::fs::write(&cfg, j.to_string()).unwrap();
        let err = nmt_err(
            &[
                "train",
                "--config",
                s(&cfg),
                "--out",
                s(&dir.path().join("w")),
            ],
            b"",
        );
        assert!(
            err.contains("cfg.json")
                && err.contains(&format!("weight {bad} is not a positive number")),
            "{bad}: {err}"
        );
    }
}

/// Every way a store or its sources can be wrong is a clear error naming what and saying how
/// to re-prepare; nothing half-written is left behind.
#[test]
fn a_wrong_store_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let (src, tgt) = toy_corpus(dir.path(), "train", 5, 200);
    let tok = tokenizer(dir.path(), &src, &tgt, "400");
    let store = dir.path().join("store");
    prepare(&src, &tgt, &tok, &store);
    let out = |name: &str| dir.path().join(name);
    let train_err = |args: &[&str]| {
        let all: Vec<&str> = ["train", "--max-steps", "2"]
            .iter()
            .chain(args)
            .chain(TINY)
            .copied()
            .collect();
        nmt_err(&all, b"")
    };
    // An existing store is not overwritten without --force.
    let err = nmt_err(&prepare_args(&src, &tgt, &tok, &store), b"");
    assert!(
        err.contains("already exists") && err.contains("--force"),
        "{err}"
    );
    // --force never replaces the folder holding the text being prepared.
    let inside = store.join("train.src");
    std::fs::copy(&src, &inside).unwrap();
    let mut args = prepare_args(&inside, &tgt, &tok, &store);
    args.push("--force");
    let err = nmt_err(&args, b"");
    assert!(
        err.contains("the --src file") && err.contains("choose another --out"),
        "{err}"
    );
    assert!(inside.exists() && store.join("store.json").exists());
    // Source and target of different lengths: the line where one ends.
    let short = dir.path().join("short.en");
    std::fs::write(&short, "one two\n").unwrap();
    let err = nmt_err(&prepare_args(&src, &short, &tok, &out("mismatch")), b"");
    assert!(
        err.contains("train.src has 200 lines") && err.contains("short.en ends after line 1"),
        "{err}"
    );
    assert!(!out("mismatch").exists());
    // Another tokenizer than the store's (trained on the source side only).
    let other = tokenizer(dir.path(), &src, &src, "390");
    let err = train_err(&[
        "--data",
        s(&store),
        "--tokenizer",
        s(&other),
        "--out",
        s(&out("t")),
    ]);
    assert!(
        err.contains("prepared with another tokenizer") && err.contains("re-prepare"),
        "{err}"
    );
    // A source file changed since the store was made.
    let copy = dir.path().join("copy");
    std::fs::create_dir(&copy).unwrap();
    let (csrc, ctgt) = toy_corpus(&copy, "train", 5, 200);
    let store2 = dir.path().join("store2");
    prepare(&csrc, &ctgt, &tok, &store2);
    std::fs::write(&ctgt, "changed\n".repeat(200)).unwrap();
    let err = train_err(&["--data", s(&store2), "--out", s(&out("c"))]);
    assert!(
        err.contains("train.tgt changed since it was prepared") && err.contains("re-prepare"),
        "{err}"
    );
    // A damaged store.
    let tokens = store.join("tokens.bin");
    let mut bytes = std::fs::read(&tokens).unwrap();
    bytes[10] ^= 0x40;
    std::fs::write(&tokens, &bytes).unwrap();
    let err = train_err(&["--data", s(&store), "--out", s(&out("d"))]);
    assert!(err.contains("tokens.bin: checksum mismatch"), "{err}");
    bytes.truncate(bytes.len() / 2);
    std::fs::write(&tokens, &bytes).unwrap();
    let err = train_err(&["--data", s(&store), "--out", s(&out("d"))]);
    assert!(
        err.contains("tokens.bin") && err.contains("truncated"),
        "{err}"
    );
    // A run whose text changed cannot be resumed on it.
    let run = out("r");
    let args = [
        "--src",
        s(&csrc),
        "--tgt",
        s(&ctgt),
        "--tokenizer",
        s(&tok),
        "--out",
        s(&run),
    ];
    train(&[&args[..], &["--max-steps", "2"]].concat());
    std::fs::write(&ctgt, "changed again\n".repeat(200)).unwrap();
    let err = train_err(&[&args[..], &["--resume"]].concat());
    assert!(
        err.contains("cannot resume on other data") && err.contains("train.tgt changed since"),
        "{err}"
    );
    // No data at all.
    let err = nmt_err(&["train", "--out", s(&out("n")), "--max-steps", "1"], b"");
    assert!(err.contains("no training data"), "{err}");
}

/// A full disk while preparing: an error naming the store and "No space left on device", and
/// no store, complete or partial, is visible. Needs permission to mount a tmpfs (root);
/// skipped with a message otherwise.
#[test]
fn a_full_disk_while_preparing_leaves_no_store() {
    let dir = tempfile::tempdir().unwrap();
    let (src, tgt) = toy_corpus(dir.path(), "train", 5, 20_000);
    let tok = tokenizer(dir.path(), &src, &tgt, "400");
    let small = dir.path().join("small");
    std::fs::create_dir(&small).unwrap();
    let Some(_unmount) = common::mount_tmpfs(&small, 200_000) else {
        return;
    };
    let store = small.join("store");
    let err = nmt_err(&prepare_args(&src, &tgt, &tok, &store), b"");
    assert!(err.contains("No space left on device"), "{err}");
    assert!(err.contains(s(&store)), "{err}");
    let left: Vec<_> = std::fs::read_dir(&small)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(left.is_empty(), "{left:?}");
}
