//! config.json (model) and training presets from arbitrary text: parsed and validated or
//! rejected with an error; a model config that validates survives the round trip through the
//! config.json nmt writes.
#![no_main]
use libfuzzer_sys::fuzz_target;
use nmt::model::ModelConfig;
use nmt::train::config::TrainConfig;
use std::path::Path;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(cfg) = ModelConfig::from_json(text, Path::new("config.json")) {
        let written = cfg.to_hf_json().unwrap();
        let again = ModelConfig::from_json(&written, Path::new("config.json")).unwrap();
        assert_eq!(again.to_hf_json().unwrap(), written);
    }
    if let Ok(cfg) = TrainConfig::from_json(text, Path::new("preset.json")) {
        let _ = cfg.validate();
    }
});
