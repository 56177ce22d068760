//! translate's input path: arbitrary bytes on "stdin" through line reading, tokenizing (our
//! tokenizer.json and an OPUS-MT SentencePiece vocabulary), greedy and beam search and output
//! formatting (word alignments too), with the toy fixture models. Every run either writes one line per input line or
//! stops with an error naming the input line; nothing panics.
#![no_main]
use candle_core::{DType, Device};
use libfuzzer_sys::fuzz_target;
use nmt::data::corpus::LineReader;
use nmt::align::{AlignMode, AttentionSource};
use nmt::checkpoint::LoadedModel;
use nmt::translate::{stream, OutputFormat, SearchOptions};
use std::io::Cursor;
use std::path::Path;
use std::sync::LazyLock;

static MODELS: LazyLock<Vec<LoadedModel>> = LazyLock::new(|| {
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures");
    ["nmt-toy", "opus-tiny"]
        .iter()
        .map(|m| nmt::checkpoint::load(&fixtures.join(m), &Device::Cpu, DType::F32).unwrap())
        .collect()
});

fuzz_target!(|data: &[u8]| {
    let Some((&knobs, input)) = data.split_first() else {
        return;
    };
    let model = &MODELS[usize::from(knobs & 1)];
    let beam = 1 + usize::from((knobs >> 1) & 3);
    let opts = SearchOptions {
        beam,
        length_penalty: 1.0,
        gnmt: knobs & 8 != 0,
        nbest: 1,
        max_len_a: 1.0,
        max_len_b: 5,
        batch_size: 1 + usize::from(knobs >> 6) % 4,
        scores: knobs & 48 != 0,
        // Alignments with beams of 2 and 4.
        alignment: (knobs & 2 != 0).then_some(AttentionSource {
            layer: Some(0),
            head: None,
            position: Default::default(),
        }),
        // One search, or two side by side.
        workers: 1 + input.len() % 2,
    };
    let format = OutputFormat {
        nbest: false,
        scores: knobs & 16 != 0,
        json: knobs & 32 != 0,
        alignment: (knobs & 2 != 0).then_some(AlignMode::Hard),
        attention_png: None,
    };
    let reader =
        LineReader::from_reader(Path::new("<stdin>"), Box::new(Cursor::new(input.to_vec())));
    let mut out = Vec::new();
    let batch = 1 + usize::from(knobs >> 6);
    match stream(model, reader, &mut out, batch, false, &opts, &format) {
        Ok(()) => {
            let lines = input.split(|&b| b == b'\n').count()
                - usize::from(input.last() == Some(&b'\n') || input.is_empty());
            assert_eq!(out.iter().filter(|&&b| b == b'\n').count(), lines);
        }
        Err(e) => assert!(format!("{e:#}").contains("<stdin>:"), "{e:#}"),
    }
});
