//! The bad-input matrix: every subcommand against missing, unreadable and malformed inputs.
//! Each row runs the binary and expects either a clean failure (exit code 1 or 2, no panic, a
//! message naming the file and the problem) or, where the input is valid but extreme (a 1 MB
//! line), success — with a warning where something had to give.

mod common;
use common::{fixture, s, toy_corpus};
use std::path::{Path, PathBuf};

/// What a row expects.
enum Expect {
    /// Exit code 1 or 2 and stderr containing every string.
    Fails(Vec<String>),
    /// Exit code 0 and stderr containing every string.
    Works(Vec<String>),
}

struct Row {
    name: &'static str,
    args: Vec<String>,
    stdin: Vec<u8>,
    expect: Expect,
}

fn fails(parts: &[&str]) -> Expect {
    Expect::Fails(parts.iter().map(|p| p.to_string()).collect())
}

fn works(parts: &[&str]) -> Expect {
    Expect::Works(parts.iter().map(|p| p.to_string()).collect())
}

fn row<S: AsRef<str>>(name: &'static str, args: &[S], stdin: &[u8], expect: Expect) -> Row {
    Row {
        name,
        args: args.iter().map(|a| a.as_ref().to_string()).collect(),
        stdin: stdin.to_vec(),
        expect,
    }
}

fn write(path: PathBuf, bytes: &[u8]) -> PathBuf {
    std::fs::write(&path, bytes).unwrap();
    path
}

/// A copy of the toy checkpoint with one file replaced by `bytes` (or removed when `None`).
fn broken_model(dir: &Path, name: &str, file: &str, bytes: Option<&[u8]>) -> PathBuf {
    copy_model(&fixture("nmt-toy"), dir, name, file, bytes)
}

fn copy_model(from: &Path, dir: &Path, name: &str, file: &str, bytes: Option<&[u8]>) -> PathBuf {
    let to = dir.join(name);
    std::fs::create_dir_all(&to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
    match bytes {
        Some(b) => std::fs::write(to.join(file), b).unwrap(),
        None => std::fs::remove_file(to.join(file)).unwrap(),
    }
    to
}

fn half(path: &Path) -> Vec<u8> {
    let b = std::fs::read(path).unwrap();
    b[..b.len() / 2].to_vec()
}

/// The weights file at `path` with one value of the tensor `name` (float32) made NaN.
fn with_nan(path: &Path, name: &str) -> Vec<u8> {
    let mut b = std::fs::read(path).unwrap();
    let header = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
    let meta: serde_json::Value = serde_json::from_slice(&b[8..8 + header]).unwrap();
    assert_eq!(meta[name]["dtype"], "F32");
    let at = 8 + header + meta[name]["data_offsets"][0].as_u64().unwrap() as usize;
    b[at..at + 4].copy_from_slice(&f32::NAN.to_le_bytes());
    b
}

#[test]
fn every_subcommand_rejects_bad_input_clearly() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let (src, tgt) = toy_corpus(d, "train", 5, 60);
    let (src, tgt) = (s(&src).to_string(), s(&tgt).to_string());
    let missing = d.join("no-such-file.txt");
    let missing = s(&missing).to_string();
    let folder = d.join("a-folder");
    std::fs::create_dir(&folder).unwrap();
    let folder = s(&folder).to_string();
    let bad_utf8 = write(d.join("bad-utf8.txt"), b"1 2\n3 \xff 4\n5\n");
    let bad_utf8 = s(&bad_utf8).to_string();
    let empty = write(d.join("empty.txt"), b"");
    let empty = s(&empty).to_string();
    let short = write(d.join("short.txt"), b"1 2\n3 4\n");
    let short = s(&short).to_string();
    // 1 MB on one line, among ordinary lines.
    let huge_line = format!("{}\n", "7 ".repeat(500_000));
    let mut huge = std::fs::read_to_string(&src).unwrap();
    huge.insert_str(0, &huge_line);
    huge.truncate(huge.trim_end().rfind('\n').unwrap() + 1);
    let huge = write(d.join("huge.src"), huge.as_bytes());
    let huge = s(&huge).to_string();
    let truncated_json = write(d.join("truncated.json"), b"{\"vocab_size\": 4");
    let truncated_json = s(&truncated_json).to_string();
    let typo_config = write(d.join("typo.json"), br#"{"learning_rate": 0.1}"#);
    let typo_config = s(&typo_config).to_string();
    let no_specials = write(
        d.join("no-specials.json"),
        br#"{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],"normalizer":null,"pre_tokenizer":null,"post_processor":null,"decoder":null,"model":{"type":"WordLevel","vocab":{"a":0,"b":1},"unk_token":"a"}}"#,
    );
    let no_specials = s(&no_specials).to_string();
    let toy = fixture("nmt-toy");
    let tokenizer = toy.join("tokenizer.json");
    let tokenizer = s(&tokenizer).to_string();
    let m_weights = broken_model(
        d,
        "m-weights",
        "model.safetensors",
        Some(&half(&toy.join("model.safetensors"))),
    );
    let m_no_weights = broken_model(d, "m-no-weights", "model.safetensors", None);
    let nan_tensor = "model.decoder.layers.0.fc1.weight";
    let m_nan = broken_model(
        d,
        "m-nan",
        "model.safetensors",
        Some(&with_nan(&toy.join("model.safetensors"), nan_tensor)),
    );
    let m_config = broken_model(d, "m-config", "config.json", Some(b"{\"d_model\": 16,"));
    let m_config_type = broken_model(
        d,
        "m-config-type",
        "config.json",
        Some(br#"{"d_model": "wide"}"#),
    );
    let m_tok = broken_model(
        d,
        "m-tok",
        "tokenizer.json",
        Some(&half(&toy.join("tokenizer.json"))),
    );
    // A syntax error inside the "decoder" object (the tokenizers crate panics on it).
    let toy_tok = std::fs::read_to_string(toy.join("tokenizer.json")).unwrap();
    let at = toy_tok.find("\"decoder\"").unwrap();
    let broken_decoder = format!(
        "{}{}",
        &toy_tok[..at],
        toy_tok[at..].replacen("\"type\": \"Replace\"", "\"type\" \"Replace\"", 1)
    );
    let m_tok_decoder = broken_model(
        d,
        "m-tok-decoder",
        "tokenizer.json",
        Some(broken_decoder.as_bytes()),
    );
    // A merge making a piece the vocabulary lacks, longer than every piece (the tokenizers
    // crate indexes past a buffer on it).
    let mut bad_merge: serde_json::Value = serde_json::from_str(&toy_tok).unwrap();
    bad_merge["model"]["merges"]
        .as_array_mut()
        .unwrap()
        .push(serde_json::json!(["▁zer", "ive"]));
    let m_tok_merge = broken_model(
        d,
        "m-tok-merge",
        "tokenizer.json",
        Some(bad_merge.to_string().as_bytes()),
    );
    let other_tok = d.join("other-tok.json");
    common::nmt_ok(
        &[
            "tokenize",
            "train",
            "--input",
            &src,
            "--vocab-size",
            "300",
            "--output",
            s(&other_tok),
        ],
        b"",
    );
    let m_mismatch = broken_model(
        d,
        "m-mismatch",
        "tokenizer.json",
        Some(&std::fs::read(&other_tok).unwrap()),
    );
    let opus = fixture("opus-tiny");
    let o_spm = copy_model(
        &opus,
        d,
        "o-spm",
        "source.spm",
        Some(&half(&opus.join("source.spm"))),
    );
    let o_vocab = copy_model(&opus, d, "o-vocab", "vocab.json", Some(b"[1, 2, 3]"));
    let o_weights = copy_model(
        &opus,
        d,
        "o-weights",
        "pytorch_model.bin",
        Some(&half(&opus.join("pytorch_model.bin"))),
    );
    let train = |extra: &[&str]| -> Vec<String> {
        let mut v: Vec<String> = [
            "train",
            "--src",
            &src,
            "--tgt",
            &tgt,
            "--max-steps",
            "2",
            "--vocab-size",
            "300",
            "--d-model",
            "16",
            "--layers",
            "1",
            "--heads",
            "2",
            "--ffn-dim",
            "32",
        ]
        .iter()
        .map(|x| x.to_string())
        .collect();
        let mut i = 0;
        while i < extra.len() {
            // A flag given here replaces the default one.
            match v.iter().position(|x| x == extra[i]) {
                Some(at) if extra[i].starts_with("--") => v[at + 1] = extra[i + 1].to_string(),
                _ => {
                    v.push(extra[i].to_string());
                    v.push(extra[i + 1].to_string());
                }
            }
            i += 2;
        }
        v
    };
    let train_row = |name, extra: &[&str], expect| Row {
        name,
        args: train(extra),
        stdin: Vec::new(),
        expect,
    };
    let out = |name: &str| s(&d.join(name)).to_string();
    let translate = |model: &Path| {
        vec!["translate", "--model"]
            .into_iter()
            .map(String::from)
            .chain([s(model).to_string()])
            .collect::<Vec<_>>()
    };
    // `translate --model TOY` and `extra`.
    let translate_toy = |extra: &[&str]| -> Vec<String> {
        let mut args = translate(&toy);
        args.extend(extra.iter().map(|a| a.to_string()));
        args
    };
    // `eval --ref TGT --src SRC --model TOY` and `extra`: scoring a model's own translations.
    let eval_model = |extra: &[&str]| -> Vec<String> {
        ["eval", "--ref", &tgt, "--src", &src, "--model", s(&toy)]
            .iter()
            .chain(extra)
            .map(|a| a.to_string())
            .collect()
    };
    let translate_row = |name, model: &Path, expect| Row {
        name,
        args: translate(model),
        stdin: b"1 2 3\n".to_vec(),
        expect,
    };
    let prepare = |src: &str, tgt: &str, tok: &str, out: &str| -> Vec<String> {
        [
            "prepare",
            "--src",
            src,
            "--tgt",
            tgt,
            "--tokenizer",
            tok,
            "--out",
            out,
        ]
        .iter()
        .map(|x| x.to_string())
        .collect()
    };
    let tok_train = |input: &str, output: &str| -> Vec<String> {
        [
            "tokenize",
            "train",
            "--input",
            input,
            "--vocab-size",
            "300",
            "--output",
            output,
        ]
        .iter()
        .map(|x| x.to_string())
        .collect()
    };

    let rows = vec![
        // nmt tokenize
        row(
            "tokenize train: missing input",
            &tok_train(&missing, "/dev/null"),
            b"",
            fails(&[&missing, "No such file"]),
        ),
        row(
            "tokenize train: input is a folder",
            &tok_train(&folder, "/dev/null"),
            b"",
            fails(&[&folder, "directory"]),
        ),
        row(
            "tokenize train: invalid UTF-8",
            &tok_train(&bad_utf8, "/dev/null"),
            b"",
            fails(&[&format!("{bad_utf8}:2"), "invalid UTF-8"]),
        ),
        row(
            "tokenize train: empty corpus",
            &tok_train(&empty, "/dev/null"),
            b"",
            fails(&[&empty, "empty"]),
        ),
        row(
            "tokenize train: --output is an --input",
            &tok_train(&src, &src),
            b"",
            fails(&[&src, "would replace the text"]),
        ),
        row(
            "tokenize train: unknown --model",
            &[
                tok_train(&src, "/dev/null"),
                vec!["--model".into(), "wordpiece".into()],
            ]
            .concat(),
            b"",
            fails(&["wordpiece", "--model"]),
        ),
        row(
            "tokenize train: 1 MB line",
            &tok_train(&huge, "/dev/null"),
            b"",
            works(&[]),
        ),
        row(
            "tokenize encode: missing tokenizer",
            &["tokenize", "encode", "--tokenizer", &missing],
            b"a\n",
            fails(&[&missing, "No such file"]),
        ),
        row(
            "tokenize encode: truncated tokenizer.json",
            &["tokenize", "encode", "--tokenizer", &truncated_json],
            b"a\n",
            fails(&[&truncated_json, "not a valid tokenizer.json"]),
        ),
        row(
            "tokenize encode: invalid UTF-8 on stdin",
            &["tokenize", "encode", "--tokenizer", &tokenizer],
            b"1\n\xc3\x28\n",
            fails(&["<stdin>:2", "invalid UTF-8"]),
        ),
        row(
            "tokenize decode: unknown piece",
            &["tokenize", "decode", "--tokenizer", &tokenizer],
            b"zzzq\n",
            fails(&["<stdin>:1", "zzzq", "not in the vocabulary"]),
        ),
        row(
            "tokenize decode: id out of range",
            &["tokenize", "decode", "--ids", "--tokenizer", &tokenizer],
            b"1 99999\n",
            fails(&["<stdin>:1", "99999", "not in the vocabulary"]),
        ),
        row(
            "tokenize encode: 1 MB line",
            &["tokenize", "encode", "--tokenizer", &tokenizer],
            huge_line.as_bytes(),
            works(&[]),
        ),
        // nmt prepare
        row(
            "prepare: missing --src",
            &prepare(&missing, &tgt, &tokenizer, &out("p1")),
            b"",
            fails(&[&missing, "No such file"]),
        ),
        row(
            "prepare: invalid UTF-8",
            &prepare(&src, &bad_utf8, &tokenizer, &out("p2")),
            b"",
            fails(&[&format!("{bad_utf8}:2"), "invalid UTF-8"]),
        ),
        row(
            "prepare: mismatched line counts",
            &prepare(&src, &short, &tokenizer, &out("p3")),
            b"",
            fails(&[&short, "ends after line 2", "60 lines"]),
        ),
        row(
            "prepare: truncated tokenizer",
            &prepare(&src, &tgt, &truncated_json, &out("p4")),
            b"",
            fails(&[&truncated_json, "not a valid tokenizer.json"]),
        ),
        row(
            "prepare: --max-len 1",
            &[
                prepare(&src, &tgt, &tokenizer, &out("p5")),
                vec!["--max-len".into(), "1".into()],
            ]
            .concat(),
            b"",
            fails(&["max_len 1"]),
        ),
        row(
            "prepare: --max-len-ratio 0.5",
            &[
                prepare(&src, &tgt, &tokenizer, &out("p6")),
                vec!["--max-len-ratio".into(), "0.5".into()],
            ]
            .concat(),
            b"",
            fails(&["max_len_ratio must be at least 1"]),
        ),
        row(
            "prepare: 1 MB line",
            &prepare(&huge, &src, &tokenizer, &out("p7")),
            b"",
            works(&[]),
        ),
        row(
            "train: --data is not a store",
            &[
                "train",
                "--data",
                &folder,
                "--out",
                &out("p8"),
                "--max-steps",
                "1",
            ],
            b"",
            fails(&[&folder, "not a prepared corpus"]),
        ),
        row(
            "train: --data does not exist",
            &[
                "train",
                "--data",
                &missing,
                "--out",
                &out("p9"),
                "--max-steps",
                "1",
            ],
            b"",
            fails(&[&missing, "not a prepared corpus"]),
        ),
        // nmt train
        train_row(
            "train: missing --src",
            &["--src", &missing, "--out", &out("t1")],
            fails(&[&missing, "No such file"]),
        ),
        train_row(
            "train: --tgt is a folder",
            &["--tgt", &folder, "--out", &out("t2")],
            fails(&[&folder, "directory"]),
        ),
        train_row(
            "train: invalid UTF-8",
            &["--tgt", &bad_utf8, "--out", &out("t3")],
            fails(&[&format!("{bad_utf8}:2"), "invalid UTF-8"]),
        ),
        train_row(
            "train: mismatched line counts",
            &["--tgt", &short, "--out", &out("t4")],
            fails(&[&short, "2 lines", "60 lines"]),
        ),
        train_row(
            "train: empty corpora",
            &[
                "--src",
                &empty,
                "--tgt",
                &empty,
                "--tokenizer",
                &tokenizer,
                "--out",
                &out("t5"),
            ],
            fails(&[&empty, "no training pairs"]),
        ),
        train_row(
            "train: validation files disagree",
            &[
                "--valid-src",
                &src,
                "--valid-tgt",
                &short,
                "--out",
                &out("t6"),
            ],
            fails(&[&short, "2 lines"]),
        ),
        train_row(
            "train: truncated --config",
            &["--config", &truncated_json, "--out", &out("t7")],
            fails(&[&truncated_json, "EOF"]),
        ),
        train_row(
            "train: unknown config key",
            &["--config", &typo_config, "--out", &out("t8")],
            fails(&[&typo_config, "unknown field `learning_rate`"]),
        ),
        train_row(
            "train: tokenizer without specials",
            &["--tokenizer", &no_specials, "--out", &out("t9")],
            fails(&[&no_specials, "no </s> token"]),
        ),
        train_row(
            "train: truncated tokenizer",
            &["--tokenizer", &truncated_json, "--out", &out("t10")],
            fails(&[&truncated_json, "not a valid tokenizer.json"]),
        ),
        train_row(
            "train: unknown --device",
            &["--device", "tpu", "--out", &out("t11")],
            fails(&["tpu", "--device"]),
        ),
        train_row(
            "train: --out under a file",
            &["--out", &format!("{empty}/sub")],
            fails(&[&empty, "cannot create output folder"]),
        ),
        train_row(
            "train: 1 MB line",
            &["--src", &huge, "--out", &out("t12")],
            works(&["longer than"]),
        ),
        // nmt translate
        row(
            "translate: missing model",
            &translate(Path::new(&missing))[..],
            b"1\n",
            fails(&[&missing, "no such model"]),
        ),
        translate_row(
            "translate: truncated safetensors",
            &m_weights,
            fails(&["m-weights/model.safetensors", "not a valid safetensors"]),
        ),
        translate_row(
            "translate: a NaN weight",
            &m_nan,
            fails(&["m-nan/model.safetensors", nan_tensor, "NaN or infinite"]),
        ),
        translate_row(
            "translate: no weights",
            &m_no_weights,
            fails(&["m-no-weights/model.safetensors", "no such weights file"]),
        ),
        translate_row(
            "translate: truncated config.json",
            &m_config,
            fails(&["m-config/config.json", "EOF"]),
        ),
        translate_row(
            "translate: config.json of the wrong type",
            &m_config_type,
            fails(&["m-config-type/config.json", "invalid type"]),
        ),
        translate_row(
            "translate: truncated tokenizer.json",
            &m_tok,
            fails(&["m-tok/tokenizer.json", "not a valid tokenizer.json"]),
        ),
        translate_row(
            "translate: tokenizer.json with a syntax error in its decoder",
            &m_tok_decoder,
            fails(&["m-tok-decoder/tokenizer.json", "expected `:` at line 73"]),
        ),
        translate_row(
            "translate: tokenizer.json with a merge outside its vocabulary",
            &m_tok_merge,
            fails(&[
                "m-tok-merge/tokenizer.json",
                "(\"▁zer\" + \"ive\") makes a piece that is not in the vocabulary",
            ]),
        ),
        translate_row(
            "translate: tokenizer and model disagree",
            &m_mismatch,
            fails(&["m-mismatch/tokenizer.json", "declares vocab_size"]),
        ),
        translate_row(
            "translate: truncated source.spm",
            &o_spm,
            fails(&["o-spm/source.spm", "not a valid SentencePiece model"]),
        ),
        translate_row(
            "translate: vocab.json not an object",
            &o_vocab,
            fails(&["o-vocab/vocab.json", "not a JSON object"]),
        ),
        translate_row(
            "translate: truncated pytorch_model.bin",
            &o_weights,
            fails(&[
                "o-weights/pytorch_model.bin",
                "not a valid PyTorch weights file",
            ]),
        ),
        row(
            "translate: invalid UTF-8 on stdin",
            &translate(&toy)[..],
            b"1 2\n\xe2\x82\n",
            fails(&["<stdin>:2", "invalid UTF-8"]),
        ),
        row(
            "translate: unknown --device",
            &translate_toy(&["--device", "tpu"]),
            b"1\n",
            fails(&["tpu", "--device"]),
        ),
        row(
            "translate: 1 MB line",
            &translate(&toy)[..],
            huge_line.as_bytes(),
            works(&["truncated"]),
        ),
        row(
            "translate: --beam wider than half the vocabulary",
            &translate_toy(&["--beam", "100000"]),
            b"1\n",
            fails(&["--beam 100000: at most", "half its vocabulary"]),
        ),
        row(
            "translate: --max-len-a inf",
            &translate_toy(&["--max-len-a", "inf"]),
            b"1\n",
            fails(&["--max-len-a inf"]),
        ),
        row(
            "translate: --length-penalty NaN",
            &translate_toy(&["--length-penalty", "NaN"]),
            b"1\n",
            fails(&["--length-penalty NaN"]),
        ),
        // nmt eval
        row(
            "eval: missing hypotheses",
            &["eval", "--ref", &src, "--hyp", &missing],
            b"",
            fails(&[&missing, "No such file"]),
        ),
        row(
            "eval: references are a folder",
            &["eval", "--ref", &folder, "--hyp", &src],
            b"",
            fails(&[&folder, "directory"]),
        ),
        row(
            "eval: invalid UTF-8",
            &["eval", "--ref", &bad_utf8, "--hyp", &short],
            b"",
            fails(&[&format!("{bad_utf8}:2"), "invalid UTF-8"]),
        ),
        row(
            "eval: line counts differ",
            &["eval", "--ref", &src, "--hyp", &short],
            b"",
            fails(&[&short, "2 lines", "60 lines"]),
        ),
        row(
            "eval: unknown --tokenize",
            &["eval", "--ref", &src, "--hyp", &src, "--tokenize", "moses"],
            b"",
            fails(&["moses", "--tokenize"]),
        ),
        row(
            "eval: --src without --model",
            &["eval", "--ref", &src, "--src", &src],
            b"",
            fails(&["--model"]),
        ),
        row(
            "eval --model: bf16 on the CPU",
            &eval_model(&["--dtype", "bf16"]),
            b"",
            fails(&["--dtype bf16/f16 needs --device cuda"]),
        ),
        row(
            "eval --model: int8 in bf16",
            &eval_model(&["--compute-type", "int8", "--dtype", "bf16"]),
            b"",
            fails(&["--compute-type int8", "--dtype bf16"]),
        ),
        row(
            "translate: int8 on CUDA",
            &[
                &translate(&toy)[..],
                &[
                    "--compute-type".into(),
                    "int8".into(),
                    "--device".into(),
                    "cuda".into(),
                ],
            ]
            .concat(),
            b"1\n",
            fails(&["--compute-type int8 runs on the CPU"]),
        ),
        row(
            "eval: 1 MB line",
            &["eval", "--ref", &huge, "--hyp", &huge],
            b"",
            works(&[]),
        ),
        // nmt average
        row(
            "average: not a run folder",
            &["average", "--run", &folder, "--output", &out("avg")],
            b"",
            fails(&[&folder, "no checkpoints"]),
        ),
        row(
            "average: missing run",
            &["average", "--run", &missing, "--output", &out("avg")],
            b"",
            fails(&[&missing, "no checkpoints"]),
        ),
    ];
    // Permissions do not bind root: for root, the unreadable file is a link to itself, which
    // nobody can open.
    let unreadable = write(d.join("unreadable.txt"), b"1 2\n");
    let mut rows = rows;
    if unsafe { libc::geteuid() } == 0 {
        std::fs::remove_file(&unreadable).unwrap();
        std::os::unix::fs::symlink(&unreadable, &unreadable).unwrap();
        let unreadable = s(&unreadable).to_string();
        rows.push(row(
            "eval: unopenable hypotheses",
            &["eval", "--ref", &unreadable, "--hyp", &unreadable],
            b"",
            fails(&[&unreadable, "cannot open"]),
        ));
    } else {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&unreadable, std::fs::Permissions::from_mode(0o000)).unwrap();
        let unreadable = s(&unreadable).to_string();
        rows.push(row(
            "eval: unreadable hypotheses",
            &["eval", "--ref", &unreadable, "--hyp", &unreadable],
            b"",
            fails(&[&unreadable, "Permission denied"]),
        ));
    }

    if !candle_core::utils::cuda_is_available() {
        rows.push(row(
            "eval --model: --device cuda without CUDA",
            &eval_model(&["--device", "cuda"]),
            b"",
            fails(&["--device cuda"]),
        ));
    }

    let mut wrong = Vec::new();
    for r in &rows {
        let args: Vec<&str> = r.args.iter().map(String::as_str).collect();
        let o = common::nmt(&args, &r.stdin);
        let stderr = String::from_utf8_lossy(&o.stderr);
        let code = o.status.code();
        let (ok, parts) = match &r.expect {
            Expect::Fails(p) => (matches!(code, Some(1) | Some(2)), p),
            Expect::Works(p) => (code == Some(0), p),
        };
        let missing_parts: Vec<&String> = parts
            .iter()
            .filter(|p| !stderr.contains(p.as_str()))
            .collect();
        if !ok || !missing_parts.is_empty() || stderr.contains("panicked") {
            wrong.push(format!(
                "{}: exit {code:?}, missing {missing_parts:?}\n  stderr: {}",
                r.name,
                stderr.trim_end().replace('\n', "\n          ")
            ));
        }
    }
    assert!(
        wrong.is_empty(),
        "{} of {} rows wrong:\n{}",
        wrong.len(),
        rows.len(),
        wrong.join("\n")
    );
}
