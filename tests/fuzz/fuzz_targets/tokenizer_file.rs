//! A model folder's `tokenizer.json` on arbitrary bytes (a damaged or hostile file, or one
//! from another toolkit): it loads or fails with an error naming the file; a tokenizer that
//! loads encodes and decodes a text without panicking.
#![no_main]
use libfuzzer_sys::fuzz_target;
use nmt::data::tokenizer::SubwordTokenizer;
use std::path::PathBuf;
use std::sync::LazyLock;

/// The file of this process, written per run.
static FILE: LazyLock<PathBuf> = LazyLock::new(|| {
    std::env::temp_dir().join(format!("nmt-fuzz-tokenizer-{}.json", std::process::id()))
});

fuzz_target!(|data: &[u8]| {
    std::fs::write(&*FILE, data).unwrap();
    match SubwordTokenizer::load(&FILE) {
        Ok(tok) => {
            for text in ["9 8 2 5", "Ein Mann, der läuft.", " \u{feff}x\t\u{1F600} "] {
                if let Ok(ids) = tok.encode_ids(text) {
                    let _ = tok.decode(&ids);
                    let _ = tok.word_starts(&ids);
                }
            }
        }
        Err(e) => assert!(format!("{e:#}").contains("nmt-fuzz-tokenizer"), "{e:#}"),
    }
});
