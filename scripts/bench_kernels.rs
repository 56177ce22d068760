//! The linear-layer kernels alone: multiply-adds per second of one inference layer
//! (`Linear` with packed weights) for each compute type, at the yardstick model's shapes and 64
//! input rows (a decoding step of a full batch, or an encoder batch), on one thread and on all.
//! Prints the best of 5 timings of about 0.2 s each. Used through `scripts/bench-kernels.sh`;
//! `NMT_CPU_ISA=avx2` measures the AVX2 kernels on a wider CPU.

use anyhow::Result;
use candle_core::{Device, Tensor};
use nmt::ops::packed::{ComputeType, PackedLinear};
use std::time::Instant;

/// (rows, in, out): a projection of d_model 256, the FFN's two layers, the output layer.
const SHAPES: [(usize, usize, usize); 4] = [
    (64, 256, 256),
    (64, 256, 1024),
    (64, 1024, 256),
    (64, 256, 8000),
];

fn main() -> Result<()> {
    nmt::ops::cpu::Isa::cap_from_env().map_err(anyhow::Error::msg)?;
    nmt::runtime::keep_freed_memory();
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
            let rate = |pool: Option<&rayon::ThreadPool>| -> Result<f64> {
                let reps = (4e8 / (rows * k * n) as f64).ceil() as usize;
                let mut best = f64::MAX;
                for _ in 0..5 {
                    let t = Instant::now();
                    for _ in 0..reps {
                        match pool {
                            Some(p) => p.install(|| layer.forward(&x, false))?,
                            None => layer.forward(&x, false)?,
                        };
                    }
                    best = best.min(t.elapsed().as_secs_f64());
                }
                Ok((rows * k * n * reps) as f64 / best / 1e9)
            };
            line += &format!(
                "  {rows}x{k}x{n} {:.1} / {:.1}",
                rate(Some(&one))?,
                rate(None)?
            );
        }
        println!("{line}");
    }
    Ok(())
}
