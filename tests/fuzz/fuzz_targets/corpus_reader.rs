//! The corpus reader on arbitrary file contents: plain text, gzip (detected by its magic
//! bytes, so corrupt streams are reached too), any line endings, invalid UTF-8. It returns
//! lines or an error naming the file; it never panics, and valid text comes back line by line.
#![no_main]
use libfuzzer_sys::fuzz_target;
use nmt::data::corpus::LineReader;
use std::path::PathBuf;
use std::sync::LazyLock;

static FILE: LazyLock<PathBuf> = LazyLock::new(|| {
    std::env::temp_dir().join(format!("nmt-fuzz-corpus-{}.txt", std::process::id()))
});

fuzz_target!(|data: &[u8]| {
    std::fs::write(&*FILE, data).unwrap();
    let name = FILE.display().to_string();
    let mut reader = match LineReader::open(&FILE) {
        Ok(r) => r,
        Err(e) => {
            assert!(format!("{e:#}").contains(&name), "{e:#}");
            return;
        }
    };
    let mut lines = 0;
    loop {
        match reader.next_line() {
            Ok(Some(_)) => lines += 1,
            Ok(None) => break,
            Err(e) => {
                assert!(format!("{e:#}").contains(&name), "{e:#}");
                return;
            }
        }
    }
    if !data.starts_with(&[0x1f, 0x8b]) {
        if let Ok(text) = std::str::from_utf8(data) {
            assert_eq!(lines, text.lines().count(), "{text:?}");
        }
    }
});
