//! OPUS-MT folders (source.spm, target.spm, vocab.json, pytorch_model.bin) load without any
//! conversion, and nmt tokenizes, searches and detokenizes exactly as transformers'
//! MarianTokenizer + generate() do. tests/fixtures/opus-tiny and what transformers made of it
//! (transformers.json) come from scripts/gen-opus-fixture.py.

mod common;
use candle_core::{DType, Device};
use common::{nmt_ok, s};
use nmt::data::spm::SpmModel;
use nmt::decode::{self, beam};
use std::path::PathBuf;

fn fixture() -> PathBuf {
    common::fixture("opus-tiny")
}

fn recorded() -> serde_json::Value {
    common::recorded(&fixture())
}

#[test]
fn sentencepiece_segmentation_and_marian_ids_equal_transformers() {
    let f = recorded();
    let spm = SpmModel::load(&fixture().join("source.spm")).unwrap();
    let m = nmt::checkpoint::load(&fixture(), &Device::Cpu, DType::F32).unwrap();
    for case in f["cases"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let pieces: Vec<String> = serde_json::from_value(case["spm_pieces"].clone()).unwrap();
        assert_eq!(spm.encode(text).unwrap(), pieces, "pieces of {text:?}");
        let want: Vec<u32> = serde_json::from_value(case["ids"].clone()).unwrap();
        let mut got = m.tokenizer.encode_ids(text).unwrap();
        got.push(m.tokenizer.eos_id);
        assert_eq!(got, want, "ids of {text:?}");
    }
}

#[test]
fn detokenization_equals_marian_tokenizer_decode() {
    let f = recorded();
    let m = nmt::checkpoint::load(&fixture(), &Device::Cpu, DType::F32).unwrap();
    for case in f["decodes"].as_array().unwrap() {
        let ids: Vec<u32> = serde_json::from_value(case["ids"].clone()).unwrap();
        assert_eq!(
            m.tokenizer.decode(&ids).unwrap(),
            case["text"].as_str().unwrap(),
            "{ids:?}"
        );
    }
}

#[test]
fn greedy_and_beam_search_equal_transformers_generate() {
    let f = recorded();
    let m = nmt::checkpoint::load(&fixture(), &Device::Cpu, DType::F32).unwrap();
    let sources = common::id_rows(&f["sources"]);
    for case in f["searches"].as_array().unwrap() {
        let beam_size = case["beam"].as_u64().unwrap() as usize;
        let lp = case["length_penalty"].as_f64().unwrap();
        let lens = vec![case["max_new_tokens"].as_u64().unwrap() as usize; sources.len()];
        let got: Vec<Vec<u32>> = if beam_size == 1 {
            decode::greedy(&m.model, &sources, &lens, false)
                .unwrap()
                .into_iter()
                .map(|(ids, _)| ids)
                .collect::<Vec<_>>()
        } else {
            let opts = beam::BeamOptions {
                beam: beam_size,
                length_penalty: lp,
                gnmt: false,
            };
            beam::beam_search(&m.model, &sources, &lens, opts)
                .unwrap()
                .into_iter()
                .map(|h| h[0].tokens.clone())
                .collect()
        };
        assert_eq!(
            got,
            common::id_rows(&case["outputs"]),
            "beam {beam_size} lp {lp}"
        );
        let texts: Vec<String> = got.iter().map(|t| m.tokenizer.decode(t).unwrap()).collect();
        let want: Vec<String> = serde_json::from_value(case["texts"].clone()).unwrap();
        assert_eq!(texts, want, "beam {beam_size} lp {lp}");
    }
}

/// The command line reads the OPUS-MT folder directly and writes transformers' translations.
#[test]
fn translate_reads_an_opus_mt_folder() {
    let f = recorded();
    let lines: Vec<&str> = f["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["text"].as_str().unwrap())
        .filter(|t| !t.trim().is_empty())
        .collect();
    let greedy = &f["searches"][0];
    assert_eq!(greedy["beam"], 1);
    let want: Vec<String> = f["cases"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| !c["text"].as_str().unwrap().trim().is_empty())
        .zip(greedy["texts"].as_array().unwrap())
        .map(|(_, t)| t.as_str().unwrap().to_string())
        .collect();
    let input = lines.join("\n") + "\n";
    let out = nmt_ok(
        &[
            "translate",
            "--model",
            s(&fixture()),
            "--max-len-a",
            "0",
            "--max-len-b",
            "20",
        ],
        input.as_bytes(),
    );
    let got: Vec<&str> = out.lines().collect();
    assert_eq!(got, want);
}

/// An OPUS-MT repo id resolves offline from the Hugging Face cache, with its SentencePiece
/// files and PyTorch weights (what `Helsinki-NLP/opus-mt-*` repos hold).
#[test]
fn an_opus_mt_repo_id_loads_from_the_cache_offline() {
    let cache = tempfile::tempdir().unwrap();
    let repo = cache.path().join("models--Helsinki-NLP--opus-mt-tiny");
    let snapshot = repo.join("snapshots/fedcba9876543210");
    std::fs::create_dir_all(&snapshot).unwrap();
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), "fedcba9876543210").unwrap();
    for f in [
        "config.json",
        "pytorch_model.bin",
        "source.spm",
        "target.spm",
        "vocab.json",
        "tokenizer_config.json",
    ] {
        std::fs::copy(fixture().join(f), snapshot.join(f)).unwrap();
    }
    let input = b"Zwei junge M\xc3\xa4nner spielen.\n\nEin Hund.\n";
    let local = nmt_ok(&["translate", "--model", s(&fixture())], input);
    let env = [("HF_HUB_CACHE", s(cache.path())), ("HF_HUB_OFFLINE", "1")];
    let out = common::nmt_env(
        &["translate", "--model", "Helsinki-NLP/opus-mt-tiny"],
        input,
        &env,
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8(out.stdout).unwrap(), local);
    assert_eq!(local.lines().count(), 3);
}
