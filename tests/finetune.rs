//! Fine-tuning with `nmt train --init MODEL`: the model's weights, architecture and tokenizer
//! carry over, validation runs before the first update, the tokenizer files stay byte for
//! byte, frozen parts stay bit for bit, and contradictions are clear errors.

mod common;
use common::{losses, nmt_err, nmt_ok, s, toy_corpus, TINY};
use std::path::Path;

/// Tensors of a checkpoint's model.safetensors.
fn tensors(dir: &Path) -> std::collections::HashMap<String, candle_core::Tensor> {
    candle_core::safetensors::load(dir.join("model.safetensors"), &candle_core::Device::Cpu)
        .unwrap()
}

fn same(a: &candle_core::Tensor, b: &candle_core::Tensor) -> bool {
    a.flatten_all().unwrap().to_vec1::<f32>().unwrap()
        == b.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

#[test]
fn fine_tuning_starts_from_the_model_and_keeps_its_tokenizer() {
    let dir = tempfile::tempdir().unwrap();
    let (src, tgt) = toy_corpus(dir.path(), "train", 5, 600);
    let (vsrc, vtgt) = toy_corpus(dir.path(), "valid", 6, 50);
    let cfg = dir.path().join("cfg.json");
    std::fs::write(&cfg, r#"{"log_every": 1, "lr": 0.003, "warmup": 50}"#).unwrap();
    let data = [
        "--src",
        s(&src),
        "--tgt",
        s(&tgt),
        "--valid-src",
        s(&vsrc),
        "--valid-tgt",
        s(&vtgt),
        "--config",
        s(&cfg),
    ];
    // The pretrained model: a tiny one trained for a while.
    let base = dir.path().join("base");
    let mut args = vec!["train", "--out", s(&base), "--max-steps", "150"];
    args.extend_from_slice(&data);
    args.extend_from_slice(TINY);
    nmt_ok(&args, b"");
    let model = base.join("last");
    // Fine-tuned, and from scratch for comparison (same data, same steps).
    let tuned = dir.path().join("tuned");
    let mut args = vec![
        "train",
        "--out",
        s(&tuned),
        "--init",
        s(&model),
        "--max-steps",
        "5",
        "--valid-every",
        "5",
        "--max-tokens",
        "512",
    ];
    args.extend_from_slice(&data);
    let said = common::nmt(&args, b"");
    let err = String::from_utf8_lossy(&said.stderr);
    assert!(said.status.success(), "{err}");
    assert!(err.contains("fine-tuning"), "{err}");
    let scratch = dir.path().join("scratch");
    let mut args = vec!["train", "--out", s(&scratch), "--max-steps", "5"];
    args.extend_from_slice(&data);
    args.extend_from_slice(TINY);
    nmt_ok(&args, b"");
    // The first loss shows the pretrained weights carried over.
    let (first, from_scratch) = (losses(&tuned)[0].1, losses(&scratch)[0].1);
    assert!(first < 0.5 * from_scratch, "{first} vs {from_scratch}");
    // Validation before any update: a step-0 record and checkpoint.
    let text = std::fs::read_to_string(tuned.join("metrics.jsonl")).unwrap();
    let v0: serde_json::Value = text
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .find(|v| v["step"] == 0 && !v["val_bleu"].is_null())
        .expect("a validation at step 0");
    assert!(v0["val_bleu"].as_f64().unwrap() > 0.0, "{v0}");
    assert!(tuned.join("checkpoints/step-00000000").is_dir());
    // The step-0 checkpoint is the model itself; the tokenizer files are byte-identical.
    for ckpt in ["checkpoints/step-00000000", "last"] {
        for f in ["tokenizer.json", "tokenizer_config.json"] {
            assert_eq!(
                std::fs::read(tuned.join(ckpt).join(f)).unwrap(),
                std::fs::read(model.join(f)).unwrap(),
                "{ckpt}/{f}"
            );
        }
    }
    let (a, b) = (
        tensors(&model),
        tensors(&tuned.join("checkpoints/step-00000000")),
    );
    assert!(a.iter().all(|(k, t)| same(t, &b[k])));
    // The fine-tuned model translates.
    nmt_ok(&["translate", "--model", s(&tuned)], b"1 2 3\n");

    // --freeze encoder: every encoder weight stays bit for bit, the decoder moves.
    let frozen = dir.path().join("frozen");
    let mut args = vec![
        "train",
        "--out",
        s(&frozen),
        "--init",
        s(&model),
        "--freeze",
        "encoder",
        "--max-steps",
        "3",
    ];
    args.extend_from_slice(&data[..4]);
    args.extend_from_slice(&data[8..]);
    nmt_ok(&args, b"");
    let after = tensors(&frozen.join("last"));
    let enc: Vec<&String> = a
        .keys()
        .filter(|k| k.starts_with("model.encoder."))
        .collect();
    assert!(!enc.is_empty());
    assert!(enc.iter().all(|k| same(&a[*k], &after[*k])));
    assert!(a
        .keys()
        .filter(|k| k.starts_with("model.decoder.layers"))
        .any(|k| !same(&a[k], &after[k])));
    // Resuming keeps the freeze.
    let mut resumed = args.clone();
    resumed.retain(|x| !["--init", s(&model), "--freeze", "encoder"].contains(x));
    let n = resumed.iter().position(|x| *x == "--max-steps").unwrap();
    resumed[n + 1] = "5";
    resumed.push("--resume");
    nmt_ok(&resumed, b"");
    let again = tensors(&frozen.join("last"));
    assert!(enc.iter().all(|k| same(&a[*k], &again[*k])));

    // Contradictions.
    let bad_out = dir.path().join("bad");
    let bad = |extra: &[&str]| {
        let mut args = vec![
            "train",
            "--out",
            s(&bad_out),
            "--max-steps",
            "1",
            "--init",
            s(&model),
        ];
        args.extend_from_slice(&data[..4]);
        args.extend_from_slice(extra);
        nmt_err(&args, b"")
    };
    let err = bad(&["--d-model", "64"]);
    assert!(err.contains("--d-model contradicts --init"), "{err}");
    let err = bad(&["--resume"]);
    assert!(err.contains("--resume") && err.contains("--init"), "{err}");
    let err = bad(&[
        "--freeze",
        "embeddings",
        "--freeze",
        "encoder",
        "--freeze",
        "decoder",
    ]);
    assert!(err.contains("nothing is left to train"), "{err}");
    // Another architecture's config parses with Marian's defaults; it must not be built.
    let other = dir.path().join("t5");
    std::fs::create_dir(&other).unwrap();
    for f in ["model.safetensors", "tokenizer.json"] {
        std::fs::copy(model.join(f), other.join(f)).unwrap();
    }
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(model.join("config.json")).unwrap()).unwrap();
    config["model_type"] = "t5".into();
    std::fs::write(other.join("config.json"), config.to_string()).unwrap();
    let mut args = vec![
        "train",
        "--out",
        s(&bad_out),
        "--max-steps",
        "1",
        "--init",
        s(&other),
    ];
    args.extend_from_slice(&data[..4]);
    let err = nmt_err(&args, b"");
    assert!(
        err.contains("model_type \"t5\": nmt builds Marian models"),
        "{err}"
    );
}

/// An OPUS-MT model (SentencePiece models and vocab.json, no tokenizer.json) fine-tunes: the
/// source side is segmented with source.spm, the target side with target.spm, and every
/// checkpoint carries the model's files byte for byte, so it loads and translates as before.
#[test]
fn an_opus_mt_model_fine_tunes_with_its_own_sentencepiece_files() {
    let dir = tempfile::tempdir().unwrap();
    let de = [
        "Zwei junge Männer spielen Fußball.",
        "Ein Hund läuft über die Straße.",
        "Eine Frau trägt einen Hut.",
    ];
    let en = [
        "Two young men play football.",
        "A dog runs across the street.",
        "A woman wears a hat.",
    ];
    let (src, tgt) = (dir.path().join("t.de"), dir.path().join("t.en"));
    // Plus one pair longer than the model's 64 positions, which training must leave out and
    // validation truncate (as translate does), not fail on.
    let many = |lines: &[&str]| {
        let mut text: String = lines
            .iter()
            .cycle()
            .take(60)
            .map(|l| format!("{l}\n"))
            .collect();
        text.push_str(&(lines.join(" ").repeat(4) + "\n"));
        text
    };
    std::fs::write(&src, many(&de)).unwrap();
    std::fs::write(&tgt, many(&en)).unwrap();
    let opus = common::fixture("opus-tiny");
    let run = dir.path().join("run");
    let said = common::nmt(
        &[
            "train",
            "--init",
            s(&opus),
            "--src",
            s(&src),
            "--tgt",
            s(&tgt),
            "--valid-src",
            s(&src),
            "--valid-tgt",
            s(&tgt),
            "--out",
            s(&run),
            "--max-steps",
            "3",
            "--valid-every",
            "1",
            "--max-tokens",
            "256",
        ],
        b"",
    );
    let err = String::from_utf8_lossy(&said.stderr);
    assert!(said.status.success(), "{err}");
    assert!(err.contains("max_len 128 lowered to 64"), "{err}");
    assert!(
        err.contains("(1 dropped: 0 empty, 1 longer than 64 tokens"),
        "{err}"
    );
    let truncated = "(1 in all) is longer than the model's 64 positions and is truncated";
    assert_eq!(err.matches(truncated).count(), 1, "{err}");
    for ckpt in ["checkpoints/step-00000000", "last"] {
        for f in [
            "source.spm",
            "target.spm",
            "vocab.json",
            "tokenizer_config.json",
        ] {
            assert_eq!(
                std::fs::read(run.join(ckpt).join(f)).unwrap(),
                std::fs::read(opus.join(f)).unwrap(),
                "{ckpt}/{f}"
            );
        }
        assert!(!run.join(ckpt).join("tokenizer.json").exists());
    }
    // The store carries the model's tokenizer files (its fingerprint covers all of them).
    assert!(run.join("data/train/target.spm").is_file());
    let out = nmt_ok(
        &["translate", "--model", s(&run.join("last"))],
        de[0].as_bytes(),
    );
    assert_eq!(out.lines().count(), 1);
    // The step-0 checkpoint is the model: it translates exactly as the model does.
    let before = nmt_ok(&["translate", "--model", s(&opus)], de[1].as_bytes());
    let step0 = nmt_ok(
        &[
            "translate",
            "--model",
            s(&run.join("checkpoints/step-00000000")),
        ],
        de[1].as_bytes(),
    );
    assert_eq!(before, step0);
    // Its checkpoints average into a model with the same files, which translates.
    let avg = dir.path().join("avg");
    nmt_ok(&["average", "--run", s(&run), "--output", s(&avg)], b"");
    for f in ["source.spm", "target.spm", "vocab.json"] {
        assert_eq!(
            std::fs::read(avg.join(f)).unwrap(),
            std::fs::read(opus.join(f)).unwrap(),
            "{f}"
        );
    }
    let out = nmt_ok(&["translate", "--model", s(&avg)], de[0].as_bytes());
    assert_eq!(out.lines().count(), 1);
}

/// An OPUS-MT checkpoint fine-tuned by nmt (tests/fixtures/opus-tiny-finetuned: its weights
/// and config, the SentencePiece files being opus-tiny's, recorded by
/// `scripts/gen-finetune-fixture.py --finetuned`) is loaded by transformers (MarianTokenizer,
/// MarianMTModel.from_pretrained) and decoded exactly as nmt decodes it, greedy and beam 4;
/// CTranslate2 converts it and decodes it greedily as nmt does. The same fine-tuning run here
/// writes those weights again (bit for bit on the recording machine, to rounding elsewhere)
/// and the SentencePiece files unchanged.
#[test]
fn an_opus_mt_checkpoint_fine_tuned_by_nmt_decodes_as_transformers_decodes_it() {
    let dir = tempfile::tempdir().unwrap();
    let opus = common::fixture("opus-tiny");
    let fixture = common::fixture("opus-tiny-finetuned");
    let recorded: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture.join("finetuned.json")).unwrap())
            .unwrap();
    let model = dir.path().join("model");
    std::fs::create_dir(&model).unwrap();
    for f in [
        "source.spm",
        "target.spm",
        "vocab.json",
        "tokenizer_config.json",
    ] {
        std::fs::copy(opus.join(f), model.join(f)).unwrap();
    }
    for f in ["model.safetensors", "config.json"] {
        std::fs::copy(fixture.join(f), model.join(f)).unwrap();
    }
    let sources: Vec<String> = serde_json::from_value(recorded["sources"].clone()).unwrap();
    let input = format!("{}\n", sources.join("\n"));
    for beam in ["1", "4"] {
        let got = nmt_ok(
            &[
                "translate",
                "--model",
                s(&model),
                "--beam",
                beam,
                "--max-len-a",
                "0",
                "--max-len-b",
                "64",
            ],
            input.as_bytes(),
        );
        let got = serde_json::json!(got.lines().collect::<Vec<_>>());
        assert_eq!(
            got,
            recorded[format!("beam{beam}")],
            "transformers, beam {beam}"
        );
        if beam == "1" {
            assert_eq!(got, recorded["ct2_beam1"], "CTranslate2, greedy");
        }
    }

    // The recorded fine-tuning, again.
    let (src, tgt) = (dir.path().join("t.de"), dir.path().join("t.en"));
    let first_batch: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(opus.join("finetune.json")).unwrap())
            .unwrap();
    let pairs: Vec<(String, String)> =
        serde_json::from_value(first_batch["pairs"].clone()).unwrap();
    let side = |k: usize| -> String {
        (0..60)
            .map(|i| {
                let p = &pairs[i % pairs.len()];
                format!("{}\n", if k == 0 { &p.0 } else { &p.1 })
            })
            .collect()
    };
    std::fs::write(&src, side(0)).unwrap();
    std::fs::write(&tgt, side(1)).unwrap();
    let run = dir.path().join("run");
    let flags: Vec<String> = serde_json::from_value(recorded["finetune_flags"].clone()).unwrap();
    let mut args = vec![
        "train",
        "--init",
        s(&opus),
        "--src",
        s(&src),
        "--tgt",
        s(&tgt),
        "--valid-src",
        s(&src),
        "--valid-tgt",
        s(&tgt),
        "--out",
        s(&run),
    ];
    args.extend(flags.iter().map(String::as_str));
    nmt_ok(&args, b"");
    let (ours, theirs) = (tensors(&run.join("last")), tensors(&fixture));
    assert_eq!(ours.len(), theirs.len());
    for (name, t) in &theirs {
        let rel = common::max_rel_diff(&ours[name], t);
        assert!(rel < 1e-2, "{name}: relative difference {rel}");
    }
    for f in [
        "source.spm",
        "target.spm",
        "vocab.json",
        "tokenizer_config.json",
    ] {
        assert_eq!(
            std::fs::read(run.join("last").join(f)).unwrap(),
            std::fs::read(opus.join(f)).unwrap(),
            "{f}"
        );
    }
}

/// The first loss of `--init` equals what transformers computes for the same batch
/// (tests/fixtures/*/finetune.json, from scripts/gen-finetune-fixture.py), and the prepared
/// ids equal transformers' tokenizers' (MarianTokenizer with text_target for OPUS-MT): the
/// weights, both sides' tokenization and the label layout all carried over.
#[test]
fn the_first_fine_tuning_loss_equals_transformers() {
    for name in ["nmt-toy", "opus-tiny"] {
        let fixture = common::fixture(name);
        let want: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(fixture.join("finetune.json")).unwrap())
                .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let (src, tgt) = (dir.path().join("s.txt"), dir.path().join("t.txt"));
        let side = |i: usize| -> String {
            want["pairs"]
                .as_array()
                .unwrap()
                .iter()
                .map(|p| p[i].as_str().unwrap().to_string() + "\n")
                .collect()
        };
        std::fs::write(&src, side(0)).unwrap();
        std::fs::write(&tgt, side(1)).unwrap();
        let cfg = dir.path().join("cfg.json");
        std::fs::write(&cfg, r#"{"log_every": 1}"#).unwrap();
        let run = dir.path().join("run");
        nmt_ok(
            &[
                "train",
                "--init",
                s(&fixture),
                "--src",
                s(&src),
                "--tgt",
                s(&tgt),
                "--out",
                s(&run),
                "--config",
                s(&cfg),
                "--dropout",
                "0",
                "--label-smoothing",
                "0",
                "--max-tokens",
                "4096",
                "--max-steps",
                "1",
            ],
            b"",
        );
        let store = nmt::data::store::Store::open(&run.join("data/train")).unwrap();
        for (i, (s_ids, t_ids)) in want["src_ids"]
            .as_array()
            .unwrap()
            .iter()
            .zip(want["tgt_ids"].as_array().unwrap())
            .enumerate()
        {
            let (mut a, mut b) = (Vec::new(), Vec::new());
            store.read_pair(i, &mut a, &mut b);
            a.push(0);
            b.push(0);
            assert_eq!(serde_json::json!(a), *s_ids, "{name}: source {i}");
            assert_eq!(serde_json::json!(b), *t_ids, "{name}: target {i}");
        }
        let got = losses(&run)[0].1;
        let expected = want["loss"].as_f64().unwrap();
        assert!(
            (got - expected).abs() <= 1e-5 * expected.abs().max(1.0),
            "{name}: nmt {got} vs transformers {expected}"
        );
    }
}
