//! Word alignments and attention heatmaps of `nmt translate`: pieces merge exactly into the
//! words the user sees, every printed index is in range of the words printed, in every
//! output format and search, and heatmaps are PNGs of the size their layout says.

mod common;
use candle_core::{DType, Device};
use common::{nmt_err, nmt_ok, s};
use nmt::align::{piece_words, AttentionSource};
use nmt::translate::{translate_batch, SearchOptions};

fn sources() -> Vec<String> {
    std::fs::read_to_string(common::fixture("nmt-toy").join("sources.txt"))
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect()
}

#[test]
fn pieces_merge_exactly_into_the_words_of_the_line() {
    let lines = [
        "Zwei junge Männer spielen Fußball.",
        "Ein Hund läuft über die Straße, schnell!",
        "Eine Frau trägt einen Hut.",
    ];
    for fixture in ["opus-tiny", "nmt-toy"] {
        let m = nmt::checkpoint::load(&common::fixture(fixture), &Device::Cpu, DType::F32).unwrap();
        // Extra spaces (Multi30k has leading, trailing and repeated ones) start no word.
        for line in lines
            .iter()
            .copied()
            .chain(["9 8 2 5", "7 9 1 9 0 7 4", " 9  8 2 ", "9 , 8"])
        {
            let ids = m.tokenizer.encode_ids(line).unwrap();
            let starts = m.tokenizer.word_starts(&ids);
            let want: Vec<&str> = line.split_whitespace().collect();
            let of = piece_words(&starts, want.len());
            // Each word's pieces decode to exactly that word (byte pieces included).
            let got: Vec<String> = (0..want.len())
                .map(|w| {
                    let own: Vec<u32> = ids
                        .iter()
                        .zip(&of)
                        .filter(|(_, &o)| o == w)
                        .map(|(&id, _)| id)
                        .collect();
                    m.tokenizer.decode(&own).unwrap().trim().to_string()
                })
                .collect();
            // A piece the vocabulary lacks is <unk>, which decodes to nothing.
            if !ids.contains(&m.tokenizer.unk_id) {
                assert_eq!(got, want, "{fixture}: {line}");
            }
            assert_eq!(
                of.last().copied(),
                Some(want.len() - 1),
                "{fixture}: {line}"
            );
        }
    }
}

/// (source words, target words, pairs) of a `translation ||| s-t …` line.
fn parse(source: &str, line: &str) -> (usize, usize, Vec<(usize, usize)>) {
    let (text, pairs) = line
        .split_once(" ||| ")
        .unwrap_or_else(|| panic!("no alignment: {line:?}"));
    let pairs = pairs
        .split_whitespace()
        .map(|p| {
            let (s, t) = p.split_once('-').unwrap();
            (s.parse().unwrap(), t.parse().unwrap())
        })
        .collect();
    (
        source.split_whitespace().count(),
        text.split_whitespace().count(),
        pairs,
    )
}

#[test]
fn alignment_indices_are_in_range_in_every_format_and_search() {
    let model = common::fixture("nmt-toy");
    let lines = sources();
    let input = format!("{}\n\n", lines.join("\n"));
    for beam in ["1", "3"] {
        let out = nmt_ok(
            &[
                "translate",
                "--model",
                s(&model),
                "--beam",
                beam,
                "--alignment",
                "hard",
            ],
            input.as_bytes(),
        );
        let out: Vec<&str> = out.lines().collect();
        assert_eq!(out.len(), lines.len() + 1);
        for (src, line) in lines.iter().zip(&out) {
            let (ns, nt, pairs) = parse(src, line);
            // Hard: one pair per target word.
            assert_eq!(pairs.len(), nt, "{line}");
            for (s, t) in pairs {
                assert!(s < ns && t < nt, "{line}");
            }
        }
        assert_eq!(out[lines.len()], " ||| ", "an empty line aligns to nothing");
    }
    // n-best: every hypothesis aligned; thresholds give pairs in range too.
    let out = nmt_ok(
        &[
            "translate",
            "--model",
            s(&model),
            "--beam",
            "3",
            "--nbest",
            "3",
            "--alignment",
            "0.2",
        ],
        input.as_bytes(),
    );
    for line in out.lines().filter(|l| !l.is_empty()) {
        let parts: Vec<&str> = line.split(" ||| ").collect();
        assert_eq!(parts.len(), 4, "{line}");
        let i: usize = parts[0].parse().unwrap();
        if i >= lines.len() {
            continue;
        }
        let (ns, nt, pairs) = parse(&lines[i], &format!("{} ||| {}", parts[1], parts[2]));
        for (s, t) in pairs {
            assert!(s < ns && t < nt, "{line}");
        }
    }
    // Soft rows as JSON: one row per target word over the source words, each summing to 1.
    let out = nmt_ok(
        &[
            "translate",
            "--model",
            s(&model),
            "--alignment",
            "soft",
            "--json",
            "--alignment-layer",
            "avg",
            "--alignment-head",
            "0",
        ],
        format!("{}\n", lines[..5].join("\n")).as_bytes(),
    );
    for (src, line) in lines.iter().zip(out.lines()) {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        let words: Vec<String> = serde_json::from_value(v["source_words"].clone()).unwrap();
        assert_eq!(words.join(" "), *src);
        let rows: Vec<Vec<f64>> = serde_json::from_value(v["attention"].clone()).unwrap();
        assert_eq!(
            rows.len(),
            v["translation"]
                .as_str()
                .unwrap()
                .split_whitespace()
                .count()
        );
        for row in &rows {
            assert_eq!(row.len(), words.len());
            assert!((row.iter().sum::<f64>() - 1.0).abs() < 1e-4, "{row:?}");
        }
        assert_eq!(v["hypotheses"][0]["attention"], v["attention"]);
    }
}

#[test]
fn heatmaps_are_pngs_of_their_layout_size() {
    if nmt::plot::font().is_none() {
        eprintln!("skipped: no font on this system (set NMT_PLOT_FONT)");
        return;
    }
    let model = common::fixture("nmt-toy");
    let dir = tempfile::tempdir().unwrap();
    let lines = sources();
    nmt_ok(
        &[
            "translate",
            "--model",
            s(&model),
            "--attention-png",
            s(dir.path()),
        ],
        format!("{}\n{}\n", lines[0], lines[1]).as_bytes(),
    );
    let m = nmt::checkpoint::load(&model, &Device::Cpu, DType::F32).unwrap();
    let opts = SearchOptions {
        alignment: Some(AttentionSource::default_for(m.model.config.decoder_layers)),
        ..Default::default()
    };
    let translations = translate_batch(&m.model, &m.tokenizer, &lines[..2], 1, &opts).unwrap();
    for (i, t) in translations.iter().enumerate() {
        let png = std::fs::read(dir.path().join(format!("line-{:06}.png", i + 1))).unwrap();
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
        assert_eq!(&png[12..16], b"IHDR");
        let width = u32::from_be_bytes(png[16..20].try_into().unwrap());
        let height = u32::from_be_bytes(png[20..24].try_into().unwrap());
        let a = t.hypotheses[0].alignment.as_ref().unwrap();
        assert_eq!((width, height), nmt::align::heatmap::size(a));
    }
}

#[test]
fn unsupported_alignment_requests_are_clear_errors() {
    let model = common::fixture("nmt-toy");
    let err = nmt_err(
        &[
            "translate",
            "--model",
            s(&model),
            "--alignment",
            "hard",
            "--alignment-layer",
            "9",
        ],
        b"1 2\n",
    );
    assert!(
        err.contains("--alignment-layer 9: expected avg or a number below"),
        "{err}"
    );
    let err = nmt_err(
        &["translate", "--model", s(&model), "--alignment-head", "0"],
        b"1 2\n",
    );
    assert!(err.contains("need --alignment or --attention-png"), "{err}");
    let err = nmt_err(
        &["translate", "--model", s(&model), "--alignment", "1.5"],
        b"1 2\n",
    );
    assert!(err.contains("expected hard, soft or a threshold"), "{err}");
}

/// Share of `translate --alignment hard` links on the diagonal, for the toy task where
/// digit i translates to word i.
fn diagonal_share(model: &std::path::Path, src: &std::path::Path) -> f64 {
    let out = nmt_ok(
        &["translate", "--model", s(model), "--alignment", "hard"],
        &std::fs::read(src).unwrap(),
    );
    let (mut on, mut all) = (0, 0);
    for line in out.lines() {
        let (_, links) = line.split_once(" ||| ").unwrap();
        for p in links.split_whitespace() {
            let (a, b) = p.split_once('-').unwrap();
            on += usize::from(a == b);
            all += 1;
        }
    }
    on as f64 / all.max(1) as f64
}

/// What a run's best checkpoint records as supervised by guided alignment.
fn supervision(run: &std::path::Path) -> serde_json::Value {
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("best/config.json")).unwrap())
            .unwrap();
    config["nmt_guided_alignment"].clone()
}

#[test]
fn guided_alignment_teaches_the_supervised_head_the_alignment() {
    let dir = tempfile::tempdir().unwrap();
    let (src, tgt) = common::toy_corpus(dir.path(), "train", 3, 600);
    let (vsrc, vtgt) = common::toy_corpus(dir.path(), "valid", 4, 50);
    let links: String = std::fs::read_to_string(&src)
        .unwrap()
        .lines()
        .map(|l| {
            let n = l.split_whitespace().count();
            (0..n)
                .map(|i| format!("{i}-{i}"))
                .collect::<Vec<_>>()
                .join(" ")
                + "\n"
        })
        .collect();
    let align = dir.path().join("train.align");
    std::fs::write(&align, links).unwrap();
    let train = |out: &str, guided: &[&str]| {
        let run = dir.path().join(out);
        let mut args = vec![
            "train",
            "--src",
            s(&src),
            "--tgt",
            s(&tgt),
            "--valid-src",
            s(&vsrc),
            "--valid-tgt",
            s(&vtgt),
            "--out",
            s(&run),
            "--max-steps",
            "300",
            "--lr",
            "0.003",
            "--warmup",
            "50",
            "--valid-every",
            "300",
        ];
        args.extend_from_slice(common::TINY);
        args.extend_from_slice(guided);
        nmt_ok(&args, b"");
        run
    };
    let guide = [
        "--guided-alignment",
        s(&align),
        "--guided-alignment-weight",
        "1",
        "--guided-alignment-layer",
        "0",
    ];
    let (plain, guided) = (train("plain", &[]), train("guided", &guide));
    let (before, after) = (
        diagonal_share(&plain, &vsrc),
        diagonal_share(&guided, &vsrc),
    );
    eprintln!("links on the diagonal: {before:.3} without guided alignment, {after:.3} with");
    assert!(after > 0.95 && after > before, "{before} → {after}");
    // The checkpoint says which head was supervised; translate reads that one by default.
    assert_eq!(
        supervision(&guided),
        serde_json::json!({"layer": 0, "head": 0})
    );
    // Supervising the mean of the layer's heads (OpenNMT-py's way) teaches that mean, which
    // translate then reads.
    let all = train(
        "all-heads",
        &[&guide[..], &["--guided-alignment-all-heads"]].concat(),
    );
    let share = diagonal_share(&all, &vsrc);
    eprintln!("links on the diagonal, mean of the heads supervised: {share:.3}");
    assert!(share > 0.9 && share > before, "{before} → {share}");
    assert_eq!(
        supervision(&all),
        serde_json::json!({"layer": 0, "head": "avg"})
    );
    // Supervised at the positions that read each token, and read there by translate.
    let read = train(
        "read",
        &[&guide[..], &["--guided-alignment-position", "read"]].concat(),
    );
    let share = diagonal_share(&read, &vsrc);
    eprintln!("links on the diagonal, supervised where each token is read: {share:.3}");
    assert!(share > 0.95 && share > before, "{before} → {share}");
    assert_eq!(
        supervision(&read),
        serde_json::json!({"layer": 0, "head": 0, "position": "read"})
    );
}

#[test]
fn alignment_files_that_do_not_match_the_corpus_are_errors_naming_the_line() {
    let dir = tempfile::tempdir().unwrap();
    let (src, tgt) = common::toy_corpus(dir.path(), "train", 3, 20);
    let (align, run) = (dir.path().join("a.align"), dir.path().join("run"));
    let cases = [
        (
            "0-0\n99-0\n".to_string(),
            "a.align:2: 99-0: source word 99 is out of range",
        ),
        (
            "0-0\n0-99\n".to_string(),
            "a.align:2: 0-99: target word 99 is out of range",
        ),
        (
            "0-0 1:1\n".to_string(),
            "a.align:1: \"1:1\" is not a source-target pair",
        ),
        (
            "0-0\n".repeat(21),
            "21 lines of alignments for a corpus of 20 lines",
        ),
    ];
    // `nmt train` guided by the file `a.align`, plus `extra`: its error message.
    let train_err = |extra: &[&str]| {
        let mut args = vec![
            "train",
            "--src",
            s(&src),
            "--tgt",
            s(&tgt),
            "--out",
            s(&run),
            "--max-steps",
            "1",
            "--guided-alignment",
            s(&align),
        ];
        args.extend_from_slice(extra);
        args.extend_from_slice(common::TINY);
        nmt_err(&args, b"")
    };
    for (text, want) in cases {
        std::fs::write(&align, text).unwrap();
        let err = train_err(&[]);
        assert!(err.contains(want), "{err}");
    }
    // A supervised layer the model does not have.
    std::fs::write(&align, "0-0\n".repeat(20)).unwrap();
    let err = train_err(&["--guided-alignment-layer", "5"]);
    assert!(
        err.contains("--guided-alignment-layer 5: the model has decoder layers 0 to 0"),
        "{err}"
    );
}
