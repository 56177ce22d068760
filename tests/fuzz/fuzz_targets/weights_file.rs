//! A model folder's `model.safetensors` on arbitrary bytes (damaged or hostile), next to the
//! toy fixture's config and tokenizer (see `model_file`).
#![no_main]
use libfuzzer_sys::fuzz_target;
use std::path::PathBuf;
use std::sync::LazyLock;

#[path = "../src/model_file.rs"]
mod model_file;

const FILE: &str = "model.safetensors";
static DIR: LazyLock<PathBuf> = LazyLock::new(|| model_file::folder("nmt-toy", FILE));

fuzz_target!(|data: &[u8]| model_file::check(&DIR, FILE, data, "9 8 2 5"));
