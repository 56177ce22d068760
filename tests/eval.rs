//! `nmt eval` against sacreBLEU 2.6: every statistic equal, every score to 1e-9, on the test
//! vectors that scripts/gen-eval-fixtures.py generated (tests/fixtures/eval).

mod common;
use common::{nmt_err, nmt_ok, s};
use nmt::eval::bleu::{Bleu, Smooth};
use nmt::eval::chrf::Chrf;
use nmt::eval::tokenizers::MetricTokenizer;
use nmt::eval::{Bootstrap, Metric, SIGNATURE_VERSION};
use serde_json::Value;
use std::collections::HashMap;

fn fixtures() -> Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/eval/sacrebleu-2.6.json"
    );
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

struct Set {
    hyps: Vec<String>,
    refs: Vec<Vec<String>>,
}

fn sets(f: &Value) -> HashMap<String, Set> {
    let strings = |v: &Value| -> Vec<String> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|s| s.as_str().unwrap().to_string())
            .collect()
    };
    f["sets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            let set = Set {
                hyps: strings(&s["hyps"]),
                refs: s["refs"].as_array().unwrap().iter().map(strings).collect(),
            };
            (s["name"].as_str().unwrap().to_string(), set)
        })
        .collect()
}

fn tokenizer(name: &str) -> MetricTokenizer {
    match name {
        "13a" => MetricTokenizer::Tok13a,
        "intl" => MetricTokenizer::Intl,
        "zh" => MetricTokenizer::Zh,
        "char" => MetricTokenizer::Char,
        "none" => MetricTokenizer::None,
        other => panic!("unknown tokenizer {other}"),
    }
}

fn smooth(name: &str) -> Smooth {
    match name {
        "exp" => Smooth::Exp,
        "floor" => Smooth::Floor,
        "add-k" => Smooth::AddK,
        "none" => Smooth::None,
        other => panic!("unknown smoothing {other}"),
    }
}

fn ints(v: &Value) -> Vec<u64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * b.abs().max(1.0)
}

fn our_signature(theirs: &str) -> String {
    theirs.replace("version:2.6.0", &format!("version:{SIGNATURE_VERSION}"))
}

#[test]
fn bleu_statistics_and_scores_equal_sacrebleu() {
    let f = fixtures();
    let sets = sets(&f);
    let mut checked = 0;
    for case in f["bleu"].as_array().unwrap() {
        let set = &sets[case["set"].as_str().unwrap()];
        let bleu = Bleu {
            tokenizer: tokenizer(case["tokenize"].as_str().unwrap()),
            lowercase: case["lowercase"].as_bool().unwrap(),
            smooth: smooth(case["smooth"].as_str().unwrap()),
            smooth_value: case["smooth_value"].as_f64(),
            effective_order: case["effective_order"].as_bool().unwrap(),
        };
        let metric = Metric::Bleu(bleu.clone());
        let stats = metric.corpus_stats(&set.hyps, &set.refs);
        let what = format!("{case:.200}");
        if let Some(scores) = case.get("sentence_scores") {
            for (i, (st, want)) in stats.iter().zip(scores.as_array().unwrap()).enumerate() {
                let got = metric
                    .report(std::slice::from_ref(st), set.refs.len(), None)
                    .score;
                assert!(
                    close(got, want.as_f64().unwrap()),
                    "sentence {i}: {got} vs {want} in {what}"
                );
            }
            checked += 1;
            continue;
        }
        if let Some(segments) = case.get("segments") {
            for (i, (ours, theirs)) in stats.iter().zip(segments.as_array().unwrap()).enumerate() {
                assert_eq!(
                    ours,
                    &ints(theirs),
                    "segment {i}: {:?} in {what}",
                    set.hyps[i]
                );
            }
        }
        let report = metric.report(&stats, set.refs.len(), None);
        let b = report.bleu.as_ref().unwrap();
        assert_eq!(b.sys_len, case["sys_len"].as_u64().unwrap(), "{what}");
        assert_eq!(b.ref_len, case["ref_len"].as_u64().unwrap(), "{what}");
        let summed = nmt::eval::sum_stats(&stats, 0..stats.len());
        let raw: Vec<u64> = summed.iter().map(|&v| v as u64).collect();
        assert_eq!(raw[2..6], ints(&case["correct"])[..], "{what}");
        assert_eq!(raw[6..10], ints(&case["total"])[..], "{what}");
        let want = case["score"].as_f64().unwrap();
        assert!(
            close(report.score, want),
            "{} vs {want} in {what}",
            report.score
        );
        assert!(close(b.bp, case["bp"].as_f64().unwrap()), "{what}");
        assert_eq!(
            report.signature,
            our_signature(case["signature"].as_str().unwrap())
        );
        checked += 1;
    }
    assert!(checked > 600, "only {checked} cases");
}

#[test]
fn chrf_statistics_and_scores_equal_sacrebleu() {
    let f = fixtures();
    let sets = sets(&f);
    for case in f["chrf"].as_array().unwrap() {
        let set = &sets[case["set"].as_str().unwrap()];
        let chrf = Chrf {
            word_order: case["word_order"].as_u64().unwrap() as usize,
            lowercase: case["lowercase"].as_bool().unwrap(),
            eps_smoothing: case["eps_smoothing"].as_bool().unwrap(),
            ..Chrf::default()
        };
        let metric = Metric::Chrf(chrf);
        let stats = metric.corpus_stats(&set.hyps, &set.refs);
        let what = format!("{case:.120}");
        for (i, (ours, theirs)) in stats
            .iter()
            .zip(case["segments"].as_array().unwrap())
            .enumerate()
        {
            assert_eq!(
                ours,
                &ints(theirs),
                "segment {i}: {:?} in {what}",
                set.hyps[i]
            );
        }
        let report = metric.report(&stats, set.refs.len(), None);
        let want = case["score"].as_f64().unwrap();
        assert!(
            close(report.score, want),
            "{} vs {want} in {what}",
            report.score
        );
        assert_eq!(report.name, case["name"].as_str().unwrap());
        assert_eq!(
            report.signature,
            our_signature(case["signature"].as_str().unwrap())
        );
    }
}

/// Bootstrap intervals use a different RNG than sacreBLEU's numpy, so they agree only within
/// resampling noise: with 1,000 resamples the mean's standard error is about ci/2/√1000 (well
/// under 0.1 here), and a 95 % half-width estimated from 25 tail samples varies by ~15 %. We
/// allow 0.15 points on the mean and 25 % on the half-width.
#[test]
fn bootstrap_confidence_agrees_within_resampling_noise() {
    let f = fixtures();
    let sets = sets(&f);
    for (name, metric) in [
        ("BLEU", Metric::Bleu(Bleu::default())),
        ("chrF2", Metric::Chrf(Chrf::default())),
    ] {
        let want = &f["bootstrap"][name];
        let set = &sets[want["set"].as_str().unwrap()];
        let stats = metric.corpus_stats(&set.hyps, &set.refs);
        let b = Bootstrap {
            samples: 1000,
            seed: 12345,
        };
        let report = metric.report(&stats, set.refs.len(), Some(b));
        let c = report.confidence.unwrap();
        let (mean, ci) = (want["mean"].as_f64().unwrap(), want["ci"].as_f64().unwrap());
        assert!(
            (c.mean - mean).abs() < 0.15,
            "{name}: mean {} vs {mean}",
            c.mean
        );
        assert!((c.ci - ci).abs() < 0.25 * ci, "{name}: ci {} vs {ci}", c.ci);
        assert!(
            report.signature.contains("|bs:1000|seed:12345|"),
            "{}",
            report.signature
        );
    }
}

/// `nmt eval` prints the same numbers as `sacrebleu REF -i HYP -m bleu chrf -w 2 -f text`.
#[test]
fn command_line_output_matches_sacrebleu_text_output() {
    let f = fixtures();
    let sets = sets(&f);
    let dir = tempfile::tempdir().unwrap();
    for case in f["cli"].as_array().unwrap() {
        let set = &sets[case["set"].as_str().unwrap()];
        let write = |name: &str, lines: &[String]| {
            let p = dir.path().join(name);
            let text: String = lines.iter().map(|l| l.replace('\n', " ") + "\n").collect();
            std::fs::write(&p, text).unwrap();
            p
        };
        let hyp = write("hyp", &set.hyps);
        let refs: Vec<_> = set
            .refs
            .iter()
            .enumerate()
            .map(|(i, r)| write(&format!("ref{i}"), r))
            .collect();
        let mut args = vec!["eval", "--hyp", s(&hyp), "--metrics", "bleu,chrf"];
        for r in &refs {
            args.extend(["--ref", s(r)]);
        }
        let ours = nmt_ok(&args, b"");
        let theirs = case["stdout"].as_str().unwrap();
        for (o, t) in ours.lines().zip(theirs.lines()) {
            let (t_name, t_rest) = t.trim().split_once(" = ").unwrap();
            let (name, sig) = t_name.split_once('|').unwrap();
            let want = format!("{name} = {t_rest} {}", our_signature(sig));
            assert_eq!(o, want);
        }
        assert_eq!(ours.lines().count(), theirs.lines().count());
    }
}

#[test]
fn eval_reads_stdin_and_writes_json() {
    let dir = tempfile::tempdir().unwrap();
    let r = dir.path().join("ref.txt");
    std::fs::write(&r, "the cat sat on the mat\na dog\n").unwrap();
    let out = nmt_ok(
        &["eval", "--ref", s(&r), "--json", "--metrics", "bleu,chrf"],
        b"the cat sat on the mat\na dog\n",
    );
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v[0]["name"], "BLEU");
    assert!(close(v[0]["score"].as_f64().unwrap(), 100.0));
    assert_eq!(v[0]["counts"].as_array().unwrap().len(), 4);
    for key in ["totals", "bp", "sys_len", "ref_len", "signature"] {
        assert!(!v[0][key].is_null(), "{key} missing: {out}");
    }
    assert_eq!(v[1]["name"], "chrF2");
    // Each report names its score once (a repeated key is invalid for many JSON readers).
    assert_eq!(out.matches("\"score\"").count(), 2, "{out}");
    let sent = nmt_ok(
        &["eval", "--ref", s(&r), "--sentence"],
        b"the cat sat on the mat\nno match\n",
    );
    assert_eq!(sent.lines().count(), 2);
    assert!(sent.starts_with("BLEU = 100.00"), "{sent}");
    let paired = dir.path().join("other.txt");
    std::fs::write(&paired, "the cat sat on a mat\na dog\n").unwrap();
    let hyp = dir.path().join("hyp.txt");
    std::fs::write(&hyp, "the cat sat on the mat\na dog\n").unwrap();
    let out = nmt_ok(
        &[
            "eval",
            "--ref",
            s(&r),
            "--hyp",
            s(&hyp),
            "--paired-bs",
            s(&paired),
        ],
        b"",
    );
    assert!(out.contains("p-value = "), "{out}");
}

#[test]
fn eval_bad_input_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let r = dir.path().join("ref.txt");
    std::fs::write(&r, "one\ntwo\n").unwrap();
    let bad = dir.path().join("bad.txt");
    std::fs::write(&bad, b"ok\n\xff\n").unwrap();
    let err = nmt_err(&["eval", "--ref", s(&r)], b"only one line\n");
    assert!(
        err.contains("<stdin> has 1 lines") && err.contains("ref.txt has 2"),
        "{err}"
    );
    let err = nmt_err(&["eval", "--ref", s(&r)], b"");
    assert!(err.contains("no hypotheses"), "{err}");
    let err = nmt_err(&["eval", "--ref", s(&r), "--hyp", s(&bad)], b"");
    assert!(err.contains("bad.txt:2: invalid UTF-8"), "{err}");
    let err = nmt_err(&["eval", "--ref", s(&r), "--tokenize", "moses"], b"a\nb\n");
    assert!(err.contains("invalid value 'moses'"), "{err}");
    let err = nmt_err(&["eval", "--ref", s(&dir.path().join("nope"))], b"a\nb\n");
    assert!(err.contains("nope: cannot open"), "{err}");
}

/// `--model --src` translates and scores in one go, the same as translate piped into eval.
#[test]
fn eval_translates_with_a_model_and_scores() {
    let dir = tempfile::tempdir().unwrap();
    let model = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/nmt-toy");
    let src = model.join("sources.txt");
    let hyp = nmt_ok(
        &["translate", "--model", s(&model), "--beam", "5"],
        &std::fs::read(&src).unwrap(),
    );
    let refs = dir.path().join("ref.txt");
    std::fs::write(&refs, &hyp).unwrap();
    let eval = |workers: &str| {
        nmt_ok(
            &[
                "eval",
                "--model",
                s(&model),
                "--src",
                s(&src),
                "--ref",
                s(&refs),
                "--workers",
                workers,
            ],
            b"",
        )
    };
    let out = eval("1");
    assert!(out.starts_with("BLEU = 100.00"), "{out}");
    assert_eq!(out, eval("3"));
}
