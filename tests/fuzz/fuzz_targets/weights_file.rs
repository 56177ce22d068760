//! The weights file of a model folder on arbitrary bytes (a damaged or hostile
//! `model.safetensors`) next to the toy fixture's config and tokenizer: loading it, float32 or
//! int8, fails with an error naming the file, or gives a model that translates a line into one
//! line; nothing panics.
#![no_main]
use candle_core::{DType, Device};
use libfuzzer_sys::fuzz_target;
use nmt::data::corpus::LineReader;
use nmt::ops::packed::ComputeType;
use nmt::translate::{stream, OutputFormat, SearchOptions};
use std::io::Cursor;
use std::path::{Path, PathBuf};
use std::sync::LazyLock;

/// A model folder of this process: the toy fixture's files, the weights file written per run.
static DIR: LazyLock<PathBuf> = LazyLock::new(|| {
    let toy = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/nmt-toy");
    let dir = std::env::temp_dir().join(format!("nmt-fuzz-weights-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["config.json", "tokenizer.json"] {
        std::fs::copy(toy.join(f), dir.join(f)).unwrap();
    }
    dir
});

fuzz_target!(|data: &[u8]| {
    let weights = DIR.join("model.safetensors");
    std::fs::write(&weights, data).unwrap();
    let compute = if data.len() % 2 == 0 {
        ComputeType::Float32
    } else {
        ComputeType::Int8
    };
    let model = match nmt::checkpoint::load_as(&DIR, &Device::Cpu, DType::F32, compute) {
        Ok(m) => m,
        Err(e) => {
            assert!(format!("{e:#}").contains("model.safetensors"), "{e:#}");
            return;
        }
    };
    let opts = SearchOptions {
        beam: 2,
        length_penalty: 1.0,
        gnmt: false,
        nbest: 1,
        max_len_a: 1.0,
        max_len_b: 5,
        batch_size: 2,
        scores: true,
        alignment: None,
        workers: 1,
    };
    let format = OutputFormat {
        nbest: false,
        scores: true,
        json: false,
        alignment: None,
        attention_png: None,
    };
    let input = b"9 8 2 5\n".to_vec();
    let reader = LineReader::from_reader(Path::new("<stdin>"), Box::new(Cursor::new(input)));
    let mut out = Vec::new();
    stream(&model, reader, &mut out, 2, false, &opts, &format).unwrap();
    assert_eq!(out.iter().filter(|&&b| b == b'\n').count(), 1);
});
