//! Helpers shared by the end-to-end tests: run the built binary, find Multi30k.
#![allow(dead_code)]

use candle_core::Tensor;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

/// Tiny model flags shared by the tests (seconds per run on 2 cores).
pub const TINY: &[&str] = &[
    "--vocab-size",
    "400",
    "--d-model",
    "32",
    "--layers",
    "1",
    "--heads",
    "2",
    "--ffn-dim",
    "64",
    "--max-tokens",
    "512",
];

/// Runs `nmt` with `args`, feeding `stdin`.
pub fn nmt(args: &[&str], stdin: &[u8]) -> Output {
    nmt_env(args, stdin, &[])
}

/// Runs `nmt` with `args` and extra environment variables, feeding `stdin`.
pub fn nmt_env(args: &[&str], stdin: &[u8], env: &[(&str, &str)]) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_nmt"))
        .args(args)
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("nmt runs");
    let mut input = child.stdin.take().unwrap();
    let data = stdin.to_vec();
    let writer = std::thread::spawn(move || {
        let _ = input.write_all(&data);
    });
    let out = child.wait_with_output().expect("nmt finishes");
    writer.join().unwrap();
    out
}

/// Runs `nmt`, asserts success and returns stdout.
pub fn nmt_ok(args: &[&str], stdin: &[u8]) -> String {
    let out = nmt(args, stdin);
    assert!(
        out.status.success(),
        "nmt {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Runs `nmt`, asserts a clean failure (exit code 1, no panic) and returns stderr.
pub fn nmt_err(args: &[&str], stdin: &[u8]) -> String {
    let out = nmt(args, stdin);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "nmt {args:?} should fail");
    assert!(
        !stderr.contains("panicked"),
        "nmt {args:?} panicked: {stderr}"
    );
    assert!(matches!(out.status.code(), Some(1) | Some(2)), "{stderr}");
    stderr
}

/// The Multi30k folder: `$NMT_MULTI30K`, else `../shared/data/multi30k` beside the checkout.
/// `None` (with a message) when it is absent, so that data tests skip cleanly.
pub fn multi30k() -> Option<PathBuf> {
    let dir = std::env::var_os("NMT_MULTI30K")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/data/multi30k"));
    if dir.join("train.de.gz").is_file() {
        Some(dir)
    } else {
        eprintln!(
            "skipped: Multi30k not found at {} (set NMT_MULTI30K)",
            dir.display()
        );
        None
    }
}

/// A folder under tests/fixtures.
/// A fixture folder. Test binaries carried to another machine (scripts/build-cuda.sh --tests)
/// find the fixtures under the working directory when the build's checkout is not there.
pub fn fixture(name: &str) -> PathBuf {
    let built = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let root = if built.is_dir() {
        built
    } else {
        PathBuf::from("tests/fixtures")
    };
    root.join(name)
}

/// The `transformers.json` a fixture generator recorded next to a model fixture.
pub fn recorded(model: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(model.join("transformers.json")).unwrap())
        .unwrap()
}

/// Rows of token ids from a JSON array of arrays.
pub fn id_rows(v: &serde_json::Value) -> Vec<Vec<u32>> {
    serde_json::from_value(v.clone()).unwrap()
}

/// A path as &str.
pub fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// A deterministic toy parallel corpus: digit sequences → English number words
/// ("4 0 9" → "four zero nine"). Writes `{name}.src` and `{name}.tgt` into `dir`.
pub fn toy_corpus(dir: &Path, name: &str, seed: u64, n: usize) -> (PathBuf, PathBuf) {
    const WORDS: [&str; 10] = [
        "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
    ];
    let mut rng = nmt::rng::Rng::new(seed);
    let (mut src, mut tgt) = (String::new(), String::new());
    for _ in 0..n {
        let len = 4 + rng.below(6);
        let digits: Vec<usize> = (0..len).map(|_| rng.below(10)).collect();
        src += &digits
            .iter()
            .map(|d| d.to_string())
            .collect::<Vec<_>>()
            .join(" ");
        tgt += &digits
            .iter()
            .map(|&d| WORDS[d])
            .collect::<Vec<_>>()
            .join(" ");
        src.push('\n');
        tgt.push('\n');
    }
    let (s, t) = (
        dir.join(format!("{name}.src")),
        dir.join(format!("{name}.tgt")),
    );
    std::fs::write(&s, src).unwrap();
    std::fs::write(&t, tgt).unwrap();
    (s, t)
}

/// max |ours − theirs| / max |theirs|
pub fn max_rel_diff(ours: &Tensor, theirs: &Tensor) -> f32 {
    max_abs(&(ours - theirs).unwrap()) / max_abs(theirs)
}

/// The largest absolute value of an f32 tensor.
pub fn max_abs(t: &Tensor) -> f32 {
    t.abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

/// The training losses a run logged: (step, loss) from its metrics.jsonl.
pub fn losses(run: &Path) -> Vec<(u64, f64)> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| !v["loss"].is_null())
        .map(|v| (v["step"].as_u64().unwrap(), v["loss"].as_f64().unwrap()))
        .collect()
}

/// A tmpfs mounted for a test, unmounted when dropped (also when the test fails).
pub struct Mount(PathBuf);

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

/// Mounts a tmpfs of `size` bytes on the folder `dir` (a small disk to fill). `None`, with a
/// message saying the test is skipped, where mounting is not permitted (needs root).
pub fn mount_tmpfs(dir: &Path, size: u64) -> Option<Mount> {
    let mounted = Command::new("mount")
        .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
        .arg(dir)
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|st| st.success());
    if !mounted {
        eprintln!("skipped: cannot mount a tmpfs here (needs root)");
    }
    mounted.then(|| Mount(dir.to_path_buf()))
}
