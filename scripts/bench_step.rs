//! One training step of the yardstick model (vocab 8000, d_model 256, 3+3 layers, 4 heads, FFN
//! 1024) on a fixed synthetic batch: 72 sentence pairs, sources of 21–26 and targets of 23–27
//! positions, 1,803 target tokens, dropout on. Prints the fastest forward and backward pass over
//! the steps (default 12): on a shared machine the minimum is the figure least disturbed by
//! other load. Used through `scripts/bench-step.sh`, to compare builds of nmt with each other.
//! Each step runs as the trainer runs it, with the pool's other threads kept awake.

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use nmt::model::{weights::Weights, Dropout, ModelConfig, Seq2Seq};
use nmt::rng::Rng;
use nmt::runtime::{keep_freed_memory, on_worker, one_candle_pool_thread};
use std::collections::BTreeMap;
use std::time::Instant;

fn main() -> Result<()> {
    keep_freed_memory();
    one_candle_pool_thread();
    let steps = match std::env::args().nth(1) {
        Some(s) => s.parse()?,
        None => 12,
    };
    on_worker(|| run(steps))
}

fn run(steps: usize) -> Result<()> {
    let dev = Device::Cpu;
    let cfg = ModelConfig::new(8000, 0, 1, 256, 3, 4, 1024);
    let model = Seq2Seq::new(&cfg, &Weights::init(1, &dev, DType::F32))?;
    let (batch, s, t) = (72usize, 26usize, 27usize);
    let mut rng = Rng::new(5);
    let mut token = || 2 + rng.below(7990) as u32;
    let (mut src, mut tgt_in) = (vec![0u32; batch * s], vec![0u32; batch * t]);
    let (mut lengths, mut labels, mut positions) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..batch {
        let (ls, lt) = (s - i % 6, t - i % 5);
        for j in 0..ls {
            src[i * s + j] = token();
        }
        for j in 0..lt {
            if j > 0 {
                tgt_in[i * t + j] = token();
            }
            labels.push(token());
            positions.push((i * t + j) as u32);
        }
        lengths.push(lt);
    }
    let src = Tensor::from_vec(src, (batch, s), &dev)?;
    let tgt_in = Tensor::from_vec(tgt_in, (batch, t), &dev)?;
    let (labels, positions) = (Tensor::new(labels, &dev)?, Tensor::new(positions, &dev)?);
    let tokens = labels.dim(0)?;
    let (mut forward, mut backward) = (f64::MAX, f64::MAX);
    let mut since_first = None;
    for step in 0..steps {
        if step == 1 {
            since_first = Some((Instant::now(), thread_run_ns()));
        }
        let dropout = Dropout::on(step as u64);
        nmt::runtime::with_partners_awake(&dev, || -> Result<()> {
            let t0 = Instant::now();
            let src_bias = model.padding_bias(&src)?;
            let memory = model.encode(&src, &src_bias, &dropout)?;
            let tgt_bias = model
                .causal_bias(t)?
                .broadcast_add(&model.length_bias(&lengths, t)?)?;
            let h = model.decode(&tgt_in, &tgt_bias, &memory, &src_bias, &dropout)?;
            let rows = h.reshape((batch * t, ()))?.index_select(&positions, 0)?;
            let (w, b) = model.output_projection();
            let (loss, _) = nmt::train::loss::label_smoothed_nll(w, b, &rows, &labels, 0.1, true)?;
            loss.to_scalar::<f32>()?;
            forward = forward.min(t0.elapsed().as_secs_f64());
            let t1 = Instant::now();
            let grads = loss.backward()?;
            backward = backward.min(t1.elapsed().as_secs_f64());
            // Freed before the next step starts, as in the trainer.
            drop(grads);
            Ok(())
        })?;
    }
    let busy = since_first.map(|(t, start)| busy_threads(t.elapsed().as_secs_f64(), &start));
    let total = forward + backward;
    // 6 FLOPs per parameter per target token, as bench-train.sh counts them.
    let gflops = 6.0 * 7.7e6 * tokens as f64 / total / 1e9;
    println!(
        "{tokens} target tokens: forward {:.1} ms, backward {:.1} ms, total {:.1} ms, {:.0} tok/s, {gflops:.0} GFLOP/s{}",
        forward * 1e3,
        backward * 1e3,
        total * 1e3,
        tokens as f64 / total,
        busy.unwrap_or_default(),
    );
    Ok(())
}

/// Nanoseconds each thread of this process has run so far, by thread id (Linux's
/// `/proc/self/task/*/schedstat`; empty elsewhere).
fn thread_run_ns() -> BTreeMap<String, u64> {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return BTreeMap::new();
    };
    tasks
        .flatten()
        .filter_map(|t| {
            let stat = std::fs::read_to_string(t.path().join("schedstat")).ok()?;
            let ns = stat.split_whitespace().next()?.parse().ok()?;
            Some((t.file_name().to_string_lossy().into_owned(), ns))
        })
        .collect()
}

/// How busy each thread that worked was over the steps after the first (whose fresh memory
/// is faulted in), busiest first: `; threads busy 98 %, 93 %`. A thread below 100 % slept.
/// The step runs as in the trainer, its partner kept awake (`runtime::with_partners_awake`),
/// and that spinning counts as busy: the partner's share says little here, and
/// `scripts/step-waits.sh` shows where the step's own thread still sleeps.
fn busy_threads(wall: f64, start: &BTreeMap<String, u64>) -> String {
    let mut busy: Vec<f64> = thread_run_ns()
        .iter()
        .map(|(tid, ns)| {
            ns.saturating_sub(start.get(tid).copied().unwrap_or(0)) as f64 / 1e9 / wall
        })
        .filter(|&b| b > 0.01)
        .collect();
    if busy.is_empty() {
        return String::new();
    }
    busy.sort_by(|a, b| b.total_cmp(a));
    let shares: Vec<String> = busy.iter().map(|b| format!("{:.0} %", 100.0 * b)).collect();
    format!("; threads busy {}", shares.join(", "))
}
