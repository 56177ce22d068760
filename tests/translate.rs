//! `nmt translate` and search against transformers: a checkpoint trained by nmt
//! (tests/fixtures/nmt-toy) was loaded by `MarianMTModel.from_pretrained`, whose logits and
//! `generate()` outputs are recorded in transformers.json; nmt must reproduce them exactly.

mod common;
use candle_core::{DType, Device, Tensor};
use common::{nmt_err, nmt_ok, s};
use nmt::decode::{self, beam};
use std::path::PathBuf;

fn toy() -> PathBuf {
    common::fixture("nmt-toy")
}

fn recorded() -> serde_json::Value {
    common::recorded(&toy())
}

#[test]
fn transformers_loads_our_checkpoint_and_computes_the_same_logits() {
    let f = recorded();
    assert_eq!(f["loaded_with"], "MarianMTModel.from_pretrained");
    let m = nmt::checkpoint::load(&toy(), &Device::Cpu, DType::F32).unwrap();
    let tensor = |rows: Vec<Vec<u32>>| {
        let (b, t) = (rows.len(), rows[0].len());
        Tensor::from_vec(rows.concat(), (b, t), &Device::Cpu).unwrap()
    };
    let got = m
        .model
        .forward(
            &tensor(common::id_rows(&f["logits_src"])),
            &tensor(common::id_rows(&f["logits_tgt_in"])),
        )
        .unwrap();
    let want: Vec<Vec<Vec<f32>>> = serde_json::from_value(f["logits"].clone()).unwrap();
    let want = Tensor::new(want, &Device::Cpu).unwrap();
    let rel = common::max_rel_diff(&got, &want);
    assert!(rel < 1e-4, "relative difference {rel}");
}

#[test]
fn greedy_and_beam_search_equal_transformers_generate() {
    let f = recorded();
    let sources = common::id_rows(&f["sources"]);
    // f32 takes the CPU's decoding kernels (shared encoder keys, keys kept per step); f64
    // takes the general path other devices take (keys copied per hypothesis).
    for dtype in [DType::F32, DType::F64] {
        let m = nmt::checkpoint::load(&toy(), &Device::Cpu, dtype).unwrap();
        search_cases(&f, &m.model, &sources, dtype);
    }
}

fn search_cases(
    f: &serde_json::Value,
    model: &nmt::model::Seq2Seq,
    sources: &[Vec<u32>],
    dtype: DType,
) {
    for case in f["cases"].as_array().unwrap() {
        let beam_size = case["beam"].as_u64().unwrap() as usize;
        let lp = case["length_penalty"].as_f64().unwrap();
        let max_new = case["max_new_tokens"].as_u64().unwrap() as usize;
        let want = common::id_rows(&case["outputs"]);
        let lens = vec![max_new; sources.len()];
        // Whole batch at once (exercises padding and pruning) and in uneven chunks.
        for chunk in [sources.len(), 7] {
            let mut got = Vec::new();
            for part in sources.chunks(chunk) {
                if beam_size == 1 {
                    got.extend(
                        decode::greedy(model, part, &lens[..part.len()], false)
                            .unwrap()
                            .into_iter()
                            .map(|(ids, _)| ids),
                    );
                } else {
                    let opts = beam::BeamOptions {
                        beam: beam_size,
                        length_penalty: lp,
                        gnmt: false,
                    };
                    got.extend(
                        beam::beam_search(model, part, &lens[..part.len()], opts)
                            .unwrap()
                            .into_iter()
                            .map(|h| h[0].tokens.clone()),
                    );
                }
            }
            let same = got.iter().zip(&want).filter(|(a, b)| a == b).count();
            assert_eq!(
                same,
                want.len(),
                "{dtype:?} beam {beam_size} lp {lp} max {max_new} chunk {chunk}: {got:?} vs {want:?}"
            );
        }
    }
}

/// A server's continuous batching: sentences that join a running greedy search a few steps
/// apart, and leave as they end, get transformers' outputs and the bits of their scores
/// decoded alone.
#[test]
fn sentences_joining_a_running_greedy_search_get_what_they_get_alone() {
    let f = recorded();
    let m = nmt::checkpoint::load(&toy(), &Device::Cpu, DType::F32).unwrap();
    let sources = common::id_rows(&f["sources"]);
    let case = f["cases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["beam"] == 1)
        .expect("a greedy case");
    let want = common::id_rows(&case["outputs"]);
    let max_new = case["max_new_tokens"].as_u64().unwrap() as usize;
    let alone: Vec<(Vec<u32>, f64)> = sources
        .iter()
        .map(|src| {
            let one = decode::greedy(&m.model, std::slice::from_ref(src), &[max_new], true);
            one.unwrap()[0].clone()
        })
        .collect();
    let mut search = decode::Greedy::new(&m.model, true);
    let mut got = vec![None; sources.len()];
    let (mut next, mut steps, mut most) = (0, 0, 0);
    while next < sources.len() || !search.is_empty() {
        // One, then two, then three sentences join, a step apart, while others run.
        let take = (steps % 3 + 1).min(sources.len() - next);
        if take > 0 {
            assert!(search.can_add());
            search
                .add(&sources[next..next + take], &vec![max_new; take])
                .unwrap();
            next += take;
        }
        most = most.max(search.len());
        for done in search.step().unwrap() {
            assert!(
                got[done.id].is_none(),
                "sentence {} finished twice",
                done.id
            );
            got[done.id] = Some((done.ids, done.log_prob));
        }
        steps += 1;
    }
    assert!(most > 3, "sentences of several joins decoded together");
    for (i, (got, alone)) in got.into_iter().zip(&alone).enumerate() {
        let got = got.expect("every sentence finishes");
        assert_eq!(got.0, want[i], "sentence {i}: transformers' output");
        assert_eq!(got.0, alone.0, "sentence {i}");
        assert_eq!(got.1.to_bits(), alone.1.to_bits(), "sentence {i}: score");
    }
}

#[test]
fn translate_streams_keeps_alignment_and_handles_odd_input() {
    let model = toy();
    let input = "1 2 3\n\n4 5 6 7\n   \n";
    let out = nmt_ok(
        &["translate", "--model", s(&model), "--batch-size", "2"],
        input.as_bytes(),
    );
    let lines: Vec<&str> = out.split('\n').collect();
    assert_eq!(lines.len(), 5, "{out:?}");
    assert_eq!((lines[1], lines[3]), ("", ""));
    assert!(!lines[0].is_empty() && !lines[2].is_empty());
    // n-best in Moses format.
    let out = nmt_ok(
        &[
            "translate",
            "--model",
            s(&model),
            "--beam",
            "4",
            "--nbest",
            "3",
        ],
        b"1 2\n3\n",
    );
    let rows: Vec<&str> = out.lines().collect();
    assert_eq!(rows.len(), 6);
    assert!(
        rows[0].starts_with("0 ||| ") && rows[5].starts_with("1 ||| "),
        "{out}"
    );
    let scores: Vec<f64> = rows[..3]
        .iter()
        .map(|r| r.rsplit(" ||| ").next().unwrap().parse().unwrap())
        .collect();
    assert!(scores.windows(2).all(|w| w[0] >= w[1]), "{scores:?}");
    // JSON lines.
    let out = nmt_ok(&["translate", "--model", s(&model), "--json"], b"1 2\n");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["source"], "1 2");
    // A byte-order mark at the start of the input is not text to translate.
    let plain = nmt_ok(&["translate", "--model", s(&model)], b"1 2 3\n1 2 3\n");
    let bom = nmt_ok(
        &["translate", "--model", s(&model)],
        b"\xef\xbb\xbf1 2 3\n1 2 3\n",
    );
    assert_eq!(bom, plain);
    // A very long line is truncated with a warning, not a failure.
    let long = "1 ".repeat(2000) + "\n";
    let o = common::nmt(&["translate", "--model", s(&model)], long.as_bytes());
    assert!(o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("truncated"));
    // Bad input.
    let err = nmt_err(&["translate", "--model", s(&model)], b"1 2\n\xff\xfe\n");
    assert!(err.contains("<stdin>:2: invalid UTF-8"), "{err}");
    let err = nmt_err(&["translate", "--model", "/no/such/model"], b"1\n");
    assert!(err.contains("no such model"), "{err}");
    let err = nmt_err(
        &[
            "translate",
            "--model",
            s(&model),
            "--beam",
            "2",
            "--nbest",
            "3",
        ],
        b"1\n",
    );
    assert!(
        err.contains("--nbest must be between 1 and --beam"),
        "{err}"
    );
}

#[test]
fn a_translation_is_one_line_whatever_pieces_the_model_emits() {
    // The toy model made to emit the byte pieces of a line break and a tab (<0x0A>, <0x09>):
    // written as they are, one input line would come out as several.
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("m");
    std::fs::create_dir(&model).unwrap();
    for f in ["config.json", "tokenizer.json"] {
        std::fs::copy(toy().join(f), model.join(f)).unwrap();
    }
    let dev = Device::Cpu;
    let mut tensors =
        candle_core::safetensors::load(toy().join("model.safetensors"), &dev).unwrap();
    let mut bias = vec![0f32; 330];
    (bias[12], bias[11]) = (40.0, 39.5);
    tensors.insert(
        "final_logits_bias".into(),
        Tensor::from_vec(bias, (1, 330), &dev).unwrap(),
    );
    candle_core::safetensors::save(&tensors, model.join("model.safetensors")).unwrap();
    for beam in ["1", "3"] {
        let out = nmt_ok(
            &[
                "translate",
                "--model",
                s(&model),
                "--beam",
                beam,
                "--scores",
            ],
            b"1 2 3\n4 5\n",
        );
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines.len(), 2, "beam {beam}: {out:?}");
        for line in lines {
            let (text, score) = line.rsplit_once('\t').unwrap();
            score.parse::<f64>().unwrap();
            assert!(
                !text.is_empty() && text.trim().is_empty(),
                "beam {beam}: {line:?}"
            );
        }
    }
}

#[test]
fn sorting_a_window_of_lines_into_batches_keeps_the_output_order() {
    let model = toy();
    let input = "1 2 3 4 5 6 7 8\n9\n\n10 11 12 13\n14 15\n16 17 18 19 20 21\n22\n";
    let run = |maxi: &str| {
        nmt_ok(
            &[
                "translate",
                "--model",
                s(&model),
                "--beam",
                "3",
                "--batch-size",
                "2",
                "--maxi-batch",
                maxi,
            ],
            input.as_bytes(),
        )
    };
    let (one, sorted) = (run("1"), run("4"));
    assert_eq!(one.lines().count(), 7, "{one:?}");
    assert_eq!(one, sorted);
    let err = nmt_err(
        &["translate", "--model", s(&model), "--maxi-batch", "0"],
        b"1\n",
    );
    assert!(
        err.contains("--maxi-batch") && err.contains("at least 1"),
        "{err}"
    );
}

/// Batches decoded by searches side by side (`--workers`) translate as one search does,
/// byte for byte with scores, in both compute types and both searches.
#[test]
fn searches_side_by_side_translate_as_one_search() {
    let model = toy();
    let sources = std::fs::read(model.join("sources.txt")).unwrap();
    for (beam, ct) in [
        ("1", "float32"),
        ("3", "float32"),
        ("1", "int8"),
        ("3", "int8"),
    ] {
        let run = |workers: &str| {
            nmt_ok(
                &[
                    "translate",
                    "--model",
                    s(&model),
                    "--beam",
                    beam,
                    "--compute-type",
                    ct,
                    "--scores",
                    "--batch-size",
                    "2",
                    "--workers",
                    workers,
                ],
                &sources,
            )
        };
        let one = run("1");
        assert_eq!(
            one.lines().count(),
            sources.split(|&b| b == b'\n').count() - 1
        );
        assert_eq!(one, run("2"), "beam {beam}, {ct}: 2 workers");
        assert_eq!(one, run("3"), "beam {beam}, {ct}: 3 workers");
    }
    let err = nmt_err(
        &["translate", "--model", s(&model), "--workers", "0"],
        b"1\n",
    );
    assert!(err.contains("--workers must be at least 1"), "{err}");
}

/// Arbitrary bytes on stdin never make translate panic: they translate or fail cleanly.
#[test]
fn translate_input_path_never_panics() {
    let model = toy();
    let mut rng = nmt::rng::Rng::new(42);
    for _ in 0..30 {
        let n = rng.below(300);
        let bytes: Vec<u8> = (0..n)
            .map(|_| match rng.below(4) {
                0 => b'\n',
                1 => b' ',
                2 => b"0123456789"[rng.below(10)],
                _ => rng.below(256) as u8,
            })
            .collect();
        let out = common::nmt(
            &[
                "translate",
                "--model",
                s(&model),
                "--beam",
                "2",
                "--batch-size",
                "3",
            ],
            &bytes,
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!stderr.contains("panicked"), "{stderr}");
        if out.status.success() {
            let lines = bytes.split(|&b| b == b'\n').count()
                - usize::from(bytes.last() == Some(&b'\n') || bytes.is_empty());
            assert_eq!(String::from_utf8_lossy(&out.stdout).lines().count(), lines);
        } else {
            assert!(stderr.contains("invalid UTF-8"), "{stderr}");
        }
    }
}

/// A repo id resolves through the standard Hugging Face cache layout, without network when
/// HF_HUB_OFFLINE=1.
#[test]
fn a_hub_repo_id_loads_from_the_cache_offline() {
    let cache = tempfile::tempdir().unwrap();
    let repo = cache.path().join("models--nmt-tests--toy");
    let snapshot = repo.join("snapshots/0123456789abcdef");
    std::fs::create_dir_all(&snapshot).unwrap();
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), "0123456789abcdef").unwrap();
    for f in ["config.json", "model.safetensors", "tokenizer.json"] {
        std::fs::copy(toy().join(f), snapshot.join(f)).unwrap();
    }
    let env = [("HF_HUB_CACHE", s(cache.path())), ("HF_HUB_OFFLINE", "1")];
    let local = nmt_ok(&["translate", "--model", s(&toy())], b"1 2 3\n");
    let out = common::nmt_env(&["translate", "--model", "nmt-tests/toy"], b"1 2 3\n", &env);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8(out.stdout).unwrap(), local);
    let out = common::nmt_env(&["translate", "--model", "nmt-tests/missing"], b"1\n", &env);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && err.contains("not in the Hugging Face cache")
            && err.contains("HF_HUB_OFFLINE"),
        "{err}"
    );
}

/// Greedy search scores its output as beam search does (summed log-probability over the
/// length penalty): where both find the same translation, the scores agree, and `--scores`
/// and `--json` print them instead of 0.
#[test]
fn greedy_scores_are_log_probabilities_as_in_beam_search() {
    let model = toy();
    let sources = std::fs::read(model.join("sources.txt")).unwrap();
    let json = |beam: &str| -> Vec<(String, f64)> {
        nmt_ok(
            &["translate", "--model", s(&model), "--beam", beam, "--json"],
            &sources,
        )
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (
                v["translation"].as_str().unwrap().to_string(),
                v["score"].as_f64().unwrap(),
            )
        })
        .collect()
    };
    let (greedy, beam) = (json("1"), json("2"));
    assert!(greedy.iter().all(|(_, sc)| *sc < 0.0), "{greedy:?}");
    let same: Vec<_> = greedy
        .iter()
        .zip(&beam)
        .filter(|(g, b)| g.0 == b.0)
        .collect();
    assert!(same.len() >= 3, "{greedy:?} {beam:?}");
    for (g, b) in same {
        assert!((g.1 - b.1).abs() < 1e-4, "{g:?} vs {b:?}");
    }
    let scored = nmt_ok(&["translate", "--model", s(&model), "--scores"], &sources);
    for (line, (text, score)) in scored.lines().zip(&greedy) {
        assert_eq!(line, format!("{text}\t{score:.6}"));
    }
}

/// `--compute-type int8` (weights and inputs of every linear layer quantized): the same output
/// on every run, and the float32 model's translations with scores close to its own.
#[test]
fn int8_translations_are_stable_and_close_to_float32() {
    let model = toy();
    let sources = std::fs::read(model.join("sources.txt")).unwrap();
    let run = |ct: &str| -> Vec<(String, f64)> {
        nmt_ok(
            &[
                "translate",
                "--model",
                s(&model),
                "--beam",
                "5",
                "--scores",
                "--compute-type",
                ct,
            ],
            &sources,
        )
        .lines()
        .map(|l| {
            let (text, score) = l.rsplit_once('\t').unwrap();
            (text.to_string(), score.parse().unwrap())
        })
        .collect()
    };
    let (f32s, int8) = (run("float32"), run("int8"));
    assert_eq!(int8, run("int8"), "int8 output changed between runs");
    let same: Vec<_> = f32s.iter().zip(&int8).filter(|(a, b)| a.0 == b.0).collect();
    assert!(
        same.len() * 10 >= f32s.len() * 9,
        "only {}/{} lines equal float32's",
        same.len(),
        f32s.len()
    );
    for (a, b) in &same {
        assert!((a.1 - b.1).abs() < 0.05, "{a:?} vs {b:?}");
    }
    // The scores show that the quantized layers ran.
    assert!(same.iter().any(|(a, b)| a.1 != b.1));
}

/// `NMT_CPU_ISA=avx2` runs the AVX2 kernels on an AVX-512 CPU (`avx_vnni`, the AVX2 ones with
/// the 256-bit VNNI int8 kernel), and they give the AVX-512 kernels' bits: the same
/// translations and scores, float32 and int8, greedy and beam 5. An invalid value is refused.
#[test]
fn the_avx2_kernels_translate_as_the_avx512_ones() {
    #[cfg(target_arch = "x86_64")]
    if !std::arch::is_x86_feature_detected!("avx512f") {
        eprintln!("compared AVX2 with AVX2 only: this CPU has no AVX-512");
    }
    let model = toy();
    let sources = std::fs::read(model.join("sources.txt")).unwrap();
    for ct in ["float32", "int8"] {
        for beam in ["1", "5"] {
            let args = [
                "translate",
                "--model",
                s(&model),
                "--beam",
                beam,
                "--scores",
                "--compute-type",
                ct,
            ];
            let run = |isa: &str| {
                let out = common::nmt_env(&args, &sources, &[("NMT_CPU_ISA", isa)]);
                assert!(
                    out.status.success(),
                    "{}",
                    String::from_utf8_lossy(&out.stderr)
                );
                out.stdout
            };
            let widest = run("");
            assert_eq!(run("avx2"), widest, "{ct}, beam {beam}");
            assert_eq!(run("avx_vnni"), widest, "{ct}, beam {beam}, avx_vnni");
        }
    }
    let out = common::nmt_env(
        &["translate", "--model", s(&model)],
        b"1\n",
        &[("NMT_CPU_ISA", "avx1024")],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("NMT_CPU_ISA=avx1024: expected baseline, avx2, avx_vnni or avx512"),
        "{err}"
    );
}

/// Lines from a file or pipe are translated in whole windows, however they arrive: input
/// that pauses half way gives byte for byte what the same input at once gives, and nothing is
/// written before the window is full or the input ends. (Sentences batched together share
/// padding and kernel shapes, so windows made of whatever had arrived changed scores, and
/// int8 translations, from run to run.)
#[test]
fn piped_input_is_translated_in_windows_that_do_not_depend_on_its_timing() {
    use std::io::{Read, Write};
    use std::process::{Command, Stdio};
    use std::sync::{Arc, Mutex};
    let model = toy();
    let sources = std::fs::read_to_string(model.join("sources.txt")).unwrap();
    let lines: Vec<&str> = sources.lines().collect();
    assert!(lines.len() >= 4, "the fixture has too few lines");
    let args = [
        "translate",
        "--model",
        s(&model),
        "--scores",
        "--compute-type",
        "int8",
    ];
    let at_once = nmt_ok(&args, sources.as_bytes());
    let mut child = Command::new(env!("CARGO_BIN_EXE_nmt"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let got = Arc::new(Mutex::new(Vec::new()));
    let reader = {
        let got = got.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = stdout.read(&mut buf) {
                if n == 0 {
                    break;
                }
                got.lock().unwrap().extend_from_slice(&buf[..n]);
            }
        })
    };
    let mut stdin = child.stdin.take().unwrap();
    let half = lines.len() / 2;
    for l in &lines[..half] {
        writeln!(stdin, "{l}").unwrap();
    }
    stdin.flush().unwrap();
    std::thread::sleep(std::time::Duration::from_millis(1500));
    assert!(
        got.lock().unwrap().is_empty(),
        "translations were written before the window was full"
    );
    for l in &lines[half..] {
        writeln!(stdin, "{l}").unwrap();
    }
    drop(stdin);
    assert!(child.wait().unwrap().success());
    reader.join().unwrap();
    assert_eq!(
        String::from_utf8(got.lock().unwrap().clone()).unwrap(),
        at_once
    );
}
