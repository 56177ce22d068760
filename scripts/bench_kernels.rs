//! The linear-layer kernels alone: multiply-adds per second of one inference layer
//! (`Linear` with packed weights) for each compute type, at the yardstick model's shapes and 64
//! input rows (a decoding step of a full batch, or an encoder batch), on one thread and on all.
//! Then the training side: one linear layer's forward and backward pass (its three matrix
//! products, through the op the trainer uses) on 2,048 rows, in GFLOP/s on all threads; the
//! script sets PyTorch's figures for the same shapes beside them. Before it, that layer's three
//! products alone on one thread: whether a CPU's gemm or the work around it holds training
//! back. Prints the best of 5 timings of about 0.2 s each. Used through
//! `scripts/bench-kernels.sh`; `NMT_CPU_ISA=avx2` measures the AVX2 decoding kernels on a
//! wider CPU.

use anyhow::Result;
use candle_core::{Device, Tensor, Var};
use nmt::ops::packed::{ComputeType, PackedLinear};
use std::time::Instant;

/// (rows, in, out) of a decoding step: a projection of d_model 256, the FFN's two layers, the
/// output layer.
const SHAPES: [(usize, usize, usize); 4] = [
    (64, 256, 256),
    (64, 256, 1024),
    (64, 1024, 256),
    (64, 256, 8000),
];

fn main() -> Result<()> {
    nmt::ops::cpu::Isa::cap_from_env().map_err(anyhow::Error::msg)?;
    nmt::runtime::keep_freed_memory();
    nmt::runtime::one_candle_pool_thread();
    let all = rayon::current_num_threads();
    println!("G multiply-adds/s per layer shape (rows x in x out), 1 thread and {all}:");
    let types = [
        ("float32", ComputeType::Float32),
        ("bfloat16", ComputeType::Bf16),
        ("int8", ComputeType::Int8),
    ];
    for (name, compute) in types {
        let mut line = format!("{name:<9}");
        for (rows, k, n) in SHAPES {
            let dev = Device::Cpu;
            let w = Tensor::randn(0f32, 0.05, (n, k), &dev)?;
            let b = Tensor::randn(0f32, 0.05, n, &dev)?;
            let x = Tensor::randn(0f32, 1.0, (rows, k), &dev)?;
            // None: this CPU has no kernel for the type (f32 without AVX2).
            let Some(layer) = PackedLinear::new(compute, &w, &b)? else {
                line += "  (no kernel here)";
                break;
            };
            let one = rayon::ThreadPoolBuilder::new().num_threads(1).build()?;
            let rate = |pool: Option<&rayon::ThreadPool>| {
                best_rate((rows * k * n) as f64, 4e8, || {
                    match pool {
                        Some(p) => p.install(|| layer.forward(&x, false))?,
                        None => layer.forward(&x, false)?,
                    };
                    Ok(())
                })
            };
            line += &format!(
                "  {rows}x{k}x{n} {:.1} / {:.1}",
                rate(Some(&one))?,
                rate(None)?
            );
        }
        println!("{line}");
    }
    // As `nmt train` runs its step: on a rayon worker.
    products()?;
    nmt::runtime::on_worker(|| training(all))
}

/// (rows, in, out) of a training step of `--max-tokens 2048`: the same four layers.
const TRAINING_SHAPES: [(usize, usize, usize); 4] = [
    (2048, 256, 256),
    (2048, 256, 1024),
    (2048, 1024, 256),
    (2048, 256, 8000),
];

/// GFLOP/s of `ops::linear`'s forward and backward pass (x Wᵀ + b, then dx and dW: three
/// products of 2·rows·in·out FLOPs each), the gradient of the sum of the outputs flowing back.
fn training(threads: usize) -> Result<()> {
    println!("training: linear layer forward + backward, GFLOP/s on {threads} threads (rows x in x out):");
    let mut line = "  nmt    ".to_string();
    for (rows, k, n) in TRAINING_SHAPES {
        let dev = Device::Cpu;
        let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (rows, k), &dev)?)?;
        let w = Var::from_tensor(&Tensor::randn(0f32, 0.05, (n, k), &dev)?)?;
        let b = Var::from_tensor(&Tensor::randn(0f32, 0.05, n, &dev)?)?;
        let flops = 3.0 * 2.0 * (rows * k * n) as f64;
        let gflops = best_rate(flops, 1.5e10, || {
            let y = nmt::ops::linear(x.as_tensor(), w.as_tensor(), b.as_tensor(), false)?;
            drop(y.sum_all()?.backward()?);
            Ok(())
        })?;
        line += &format!("  {rows}x{k}x{n} {gflops:.1}");
    }
    println!("{line}");
    Ok(())
}

/// G operations/s of `f`, which does `ops` operations per call: the best of 5 timings of as many
/// calls as make `budget` operations.
fn best_rate(ops: f64, budget: f64, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    let reps = (budget / ops).ceil() as usize;
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        for _ in 0..reps {
            f()?;
        }
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(ops * reps as f64 / best / 1e9)
}

/// The training layer's three products alone on one thread, through gemm as the linear op
/// calls it (y = x Wᵀ; dx = g W and dW = gᵀ x, as `LinearGrad` runs them side by side, one
/// thread each), and y through nmt's packed f32 decoding kernel with the weights packed anew
/// per call, as training would need: GFLOP/s.
fn products() -> Result<()> {
    println!("training products alone, GFLOP/s on 1 thread: gemm y = x Wt, dx = g W, dW = gt x; packed: the f32 decoding kernel on y, weights packed per call");
    let one = rayon::ThreadPoolBuilder::new().num_threads(1).build()?;
    let mut line = String::new();
    for (rows, k, n) in TRAINING_SHAPES {
        let dev = Device::Cpu;
        let w = Tensor::randn(0f32, 0.05, (n, k), &dev)?;
        let b = Tensor::zeros(n, candle_core::DType::F32, &dev)?;
        let x = Tensor::randn(0f32, 1.0, (rows, k), &dev)?;
        let g = Tensor::randn(0f32, 1.0, (rows, n), &dev)?;
        let (xv, wv, gv) = (
            x.flatten_all()?.to_vec1::<f32>()?,
            w.flatten_all()?.to_vec1::<f32>()?,
            g.flatten_all()?.to_vec1::<f32>()?,
        );
        let (mut y, mut dx, mut dw) = (
            vec![0f32; rows * n],
            vec![0f32; rows * k],
            vec![0f32; n * k],
        );
        let flops = 2.0 * (rows * k * n) as f64;
        // dst (m×n) = lhs (m×k) · rhs (k×n), with (column, row) strides for each operand.
        let product = |(m, n, k): (usize, usize, usize),
                       dst: &mut [f32],
                       lhs: (&[f32], usize, usize),
                       rhs: (&[f32], usize, usize)| {
            assert!(dst.len() >= m * n);
            // SAFETY: every operand holds the elements its strides reach for these sizes.
            unsafe {
                gemm::gemm(
                    m,
                    n,
                    k,
                    dst.as_mut_ptr(),
                    1,
                    n as isize,
                    false,
                    lhs.0.as_ptr(),
                    lhs.1 as isize,
                    lhs.2 as isize,
                    rhs.0.as_ptr(),
                    rhs.1 as isize,
                    rhs.2 as isize,
                    0.0,
                    1.0,
                    false,
                    false,
                    false,
                    gemm::Parallelism::None,
                )
            }
        };
        let gy = best_rate(flops, 4e9, || {
            product((rows, n, k), &mut y, (&xv, 1, k), (&wv, k, 1));
            Ok(())
        })?;
        let gdx = best_rate(flops, 4e9, || {
            product((rows, k, n), &mut dx, (&gv, 1, n), (&wv, 1, k));
            Ok(())
        })?;
        let gdw = best_rate(flops, 4e9, || {
            product((n, k, rows), &mut dw, (&gv, n, 1), (&xv, 1, k));
            Ok(())
        })?;
        // None: no packed f32 kernel on this CPU (no AVX2).
        let packed = match PackedLinear::new(ComputeType::Float32, &w, &b)? {
            None => "no kernel here".to_string(),
            Some(_) => format!(
                "{:.1}",
                best_rate(flops, 4e9, || {
                    one.install(|| -> Result<()> {
                        if let Some(layer) = PackedLinear::new(ComputeType::Float32, &w, &b)? {
                            layer.forward(&x, false)?;
                        }
                        Ok(())
                    })
                })?
            ),
        };
        line += &format!("  {rows}x{k}x{n} gemm {gy:.1} / {gdx:.1} / {gdw:.1}, packed {packed}");
    }
    println!("{line}");
    Ok(())
}
