//! A model folder's `pytorch_model.bin` (as older OPUS-MT repositories publish: a zip holding
//! a pickle, read without executing it) on arbitrary bytes, next to the tiny OPUS-MT fixture's
//! config and SentencePiece files (see `model_file`).
#![no_main]
use libfuzzer_sys::fuzz_target;
use std::path::PathBuf;
use std::sync::LazyLock;

#[path = "../src/model_file.rs"]
mod model_file;

const FILE: &str = "pytorch_model.bin";
static DIR: LazyLock<PathBuf> = LazyLock::new(|| model_file::folder("opus-tiny", FILE));

fuzz_target!(|data: &[u8]| model_file::check(&DIR, FILE, data, "Ein Haus."));
