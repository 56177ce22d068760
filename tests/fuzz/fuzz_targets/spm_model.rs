//! The SentencePiece model reader on arbitrary bytes (a corrupt or hostile `source.spm`): it
//! loads or fails with an error; a model that loads segments and decodes text without
//! panicking. The first bytes of the input choose a text; the rest is the model.
#![no_main]
use libfuzzer_sys::fuzz_target;
use nmt::data::spm::SpmModel;
use std::path::Path;

fuzz_target!(|data: &[u8]| {
    let split = data
        .first()
        .map_or(0, |&n| (n as usize).min(data.len() - 1) + 1);
    let (text, model) = data.split_at(split.min(data.len()));
    let Ok(m) = SpmModel::from_bytes(model, Path::new("fuzz.spm")) else {
        return;
    };
    let text = String::from_utf8_lossy(text);
    if let Ok(pieces) = m.encode(&text) {
        let _ = m.decode(&pieces);
    }
});
