//! Shared by the weights-file targets: a model folder of this process holding a fixture's
//! files, one of which each run replaces with the fuzzer's bytes. Loading it, float32 or int8,
//! fails with an error naming that file, or gives a model that translates a line into one
//! line; nothing panics.
use candle_core::{DType, Device};
use nmt::data::corpus::LineReader;
use nmt::ops::packed::ComputeType;
use nmt::translate::{stream, OutputFormat, SearchOptions};
use std::io::Cursor;
use std::path::{Path, PathBuf};

/// A copy of the fixture `name`'s files other than `file`, in a folder of this process.
pub fn folder(name: &str, file: &str) -> PathBuf {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures").join(name);
    let dir = std::env::temp_dir().join(format!("nmt-fuzz-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for e in std::fs::read_dir(&fixture).unwrap() {
        let e = e.unwrap();
        if e.file_name() != file {
            std::fs::copy(e.path(), dir.join(e.file_name())).unwrap();
        }
    }
    dir
}

/// Writes `data` as `dir/file`, loads the model and translates `line`.
pub fn check(dir: &Path, file: &str, data: &[u8], line: &str) {
    std::fs::write(dir.join(file), data).unwrap();
    let compute = if data.len() % 2 == 0 {
        ComputeType::Float32
    } else {
        ComputeType::Int8
    };
    let model = match nmt::checkpoint::load_as(dir, &Device::Cpu, DType::F32, compute) {
        Ok(m) => m,
        Err(e) => {
            assert!(format!("{e:#}").contains(file), "{e:#}");
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
    let input = format!("{line}\n").into_bytes();
    let reader = LineReader::from_reader(Path::new("<stdin>"), Box::new(Cursor::new(input)));
    let mut out = Vec::new();
    stream(&model, reader, &mut out, 2, false, &opts, &format).unwrap();
    assert_eq!(out.iter().filter(|&&b| b == b'\n').count(), 1);
}
