//! `nmt tokenize` end to end: training, encode/decode round trips, and user mistakes.

mod common;
use common::{multi30k, nmt_err, nmt_ok, s};
use std::path::Path;
use unicode_normalization::UnicodeNormalization;

fn small_corpus(dir: &Path) -> std::path::PathBuf {
    let p = dir.join("c.txt");
    let line = "Ein Hund läuft über die Wiese. A dog runs across the meadow.\n";
    std::fs::write(&p, line.repeat(30)).unwrap();
    p
}

#[test]
fn encode_decode_round_trip_through_the_binary() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = small_corpus(dir.path());
    let tok = dir.path().join("tok.json");
    nmt_ok(
        &[
            "tokenize",
            "train",
            "--input",
            s(&corpus),
            "--vocab-size",
            "320",
            "--output",
            s(&tok),
        ],
        b"",
    );
    let text = "Ein Hund  läuft.\tÜber 🙂 die Wiese \n東京\n\n";
    let pieces = nmt_ok(
        &["tokenize", "encode", "--tokenizer", s(&tok)],
        text.as_bytes(),
    );
    assert_eq!(pieces.lines().count(), 3);
    let back = nmt_ok(
        &["tokenize", "decode", "--tokenizer", s(&tok)],
        pieces.as_bytes(),
    );
    assert_eq!(back, text);
    let ids = nmt_ok(
        &["tokenize", "encode", "--ids", "--tokenizer", s(&tok)],
        text.as_bytes(),
    );
    assert!(ids.split_whitespace().all(|i| i.parse::<u32>().is_ok()));
    let back = nmt_ok(
        &["tokenize", "decode", "--ids", "--tokenizer", s(&tok)],
        ids.as_bytes(),
    );
    assert_eq!(back, text);
}

#[test]
fn user_mistakes_are_one_line_errors() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = small_corpus(dir.path());
    let tok = dir.path().join("tok.json");
    let out = s(&tok);
    let missing = dir.path().join("missing.txt");
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec!["tokenize", "train", "--input", s(&missing), "--output", out],
            "missing.txt: cannot open",
        ),
        (
            vec![
                "tokenize",
                "train",
                "--input",
                s(dir.path()),
                "--output",
                out,
            ],
            "is a directory",
        ),
        (
            vec![
                "tokenize",
                "train",
                "--input",
                s(&corpus),
                "--output",
                out,
                "--model",
                "wordpiece",
            ],
            "invalid value 'wordpiece'",
        ),
        (
            vec![
                "tokenize",
                "train",
                "--input",
                s(&corpus),
                "--output",
                out,
                "--vocab-size",
                "100",
            ],
            "too small",
        ),
        (
            vec![
                "tokenize",
                "train",
                "--input",
                s(&corpus),
                "--output",
                out,
                "--vocab-size",
                "262",
            ],
            "smaller than the corpus alphabet",
        ),
        (
            vec!["tokenize", "encode", "--tokenizer", s(&corpus)],
            "not a valid tokenizer.json",
        ),
        (
            vec!["tokenize", "encode", "--tokenizer", s(&missing)],
            "cannot read tokenizer",
        ),
    ];
    for (args, expected) in cases {
        let err = nmt_err(&args, b"");
        assert!(err.contains(expected), "{args:?}: {err}");
    }
    assert!(
        !tok.exists(),
        "a failed run must not leave a tokenizer behind"
    );
}

#[test]
fn unreadable_file_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = small_corpus(dir.path());
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&corpus, std::fs::Permissions::from_mode(0o000)).unwrap();
    if std::fs::read(&corpus).is_ok() {
        // Permissions do not bind this user (root): a link to itself cannot be opened by
        // anyone, which reaches the same error path.
        eprintln!("note: permissions do not bind this user; testing with a symbolic-link loop");
        std::fs::remove_file(&corpus).unwrap();
        std::os::unix::fs::symlink(&corpus, &corpus).unwrap();
    }
    let tok = dir.path().join("tok.json");
    let err = nmt_err(
        &[
            "tokenize",
            "train",
            "--input",
            s(&corpus),
            "--output",
            s(&tok),
        ],
        b"",
    );
    assert!(err.contains("c.txt: cannot open"), "{err}");
}

#[test]
fn invalid_utf8_on_stdin_names_the_line() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = small_corpus(dir.path());
    let tok = dir.path().join("tok.json");
    nmt_ok(
        &[
            "tokenize",
            "train",
            "--input",
            s(&corpus),
            "--vocab-size",
            "320",
            "--output",
            s(&tok),
        ],
        b"",
    );
    let err = nmt_err(
        &["tokenize", "encode", "--tokenizer", s(&tok)],
        b"ok\nbad \xc3\x28\n",
    );
    assert!(err.contains("<stdin>:2: invalid UTF-8"), "{err}");
    let err = nmt_err(
        &["tokenize", "decode", "--tokenizer", s(&tok)],
        "▁Ein ▁Zebra\n".as_bytes(),
    );
    assert!(
        err.contains("<stdin>:1:") && err.contains("not in the vocabulary"),
        "{err}"
    );
}

/// decode(encode(line)) == NFC(line) for every line of every Multi30k file, with a joint
/// de+en BPE vocabulary of 8,000 pieces (cs and fr exercise the byte fallback).
#[test]
fn multi30k_round_trip_is_exact() {
    let Some(data) = multi30k() else { return };
    let dir = tempfile::tempdir().unwrap();
    let tok = dir.path().join("tok.json");
    let de = data.join("train.de.gz");
    let en = data.join("train.en.gz");
    nmt_ok(
        &[
            "tokenize",
            "train",
            "--input",
            s(&de),
            "--input",
            s(&en),
            "--vocab-size",
            "8000",
            "--output",
            s(&tok),
        ],
        b"",
    );
    let tokenizer = nmt::data::tokenizer::SubwordTokenizer::load(&tok).unwrap();
    assert_eq!(tokenizer.vocab_size(), 8000);
    let mut files: Vec<_> = std::fs::read_dir(&data)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "gz"))
        .collect();
    files.sort();
    assert!(files.len() >= 8, "{files:?}");
    for file in files {
        let corpus = nmt::data::corpus::read_corpus(&file).unwrap();
        let ids = tokenizer.encode_batch(&corpus.lines).unwrap();
        for (n, (line, ids)) in corpus.lines.iter().zip(&ids).enumerate() {
            let back = tokenizer.decode(ids).unwrap();
            assert_eq!(
                back,
                line.nfc().collect::<String>(),
                "{}:{}",
                file.display(),
                n + 1
            );
        }
    }
}

#[test]
fn empty_lines_are_counted_and_reported() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = small_corpus(dir.path());
    let with_empty = dir.path().join("with-empty.txt");
    std::fs::write(&with_empty, "one line\n\n  \nanother\n").unwrap();
    let tok = dir.path().join("tok.json");
    let out = common::nmt(
        &[
            "tokenize",
            "train",
            "--input",
            s(&corpus),
            "--input",
            s(&with_empty),
            "--vocab-size",
            "320",
            "--output",
            s(&tok),
        ],
        b"",
    );
    assert!(out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("with-empty.txt: 2 of 4 lines are empty"),
        "{stderr}"
    );
}
