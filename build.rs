//! With the `cuda` feature: compiles src/ops/cuda/kernels.cu to PTX with nvcc (CUDA_HOME/bin or
//! PATH; the host compiler from NVCC_CCBIN; the architecture from CUDA_COMPUTE_CAP, default 80,
//! whose PTX newer GPUs also run). Without it, nothing: the CPU build needs no CUDA toolkit.

use std::env;
use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-changed=src/ops/cuda/kernels.cu");
    println!("cargo::rerun-if-env-changed=CUDA_COMPUTE_CAP");
    if env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out = PathBuf::from(env::var("OUT_DIR").unwrap()).join("kernels.ptx");
    let nvcc = env::var_os("CUDA_HOME")
        .map(|h| PathBuf::from(h).join("bin").join("nvcc"))
        .filter(|p| p.exists())
        .unwrap_or_else(|| PathBuf::from("nvcc"));
    let cap = env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "80".into());
    let mut cmd = Command::new(&nvcc);
    cmd.args(["--ptx", "-O3", "-std=c++17"])
        .arg(format!("-arch=sm_{cap}"))
        .arg("src/ops/cuda/kernels.cu")
        .arg("-o")
        .arg(&out);
    if let Some(ccbin) = env::var_os("NVCC_CCBIN") {
        cmd.arg("-ccbin").arg(ccbin);
    }
    let status = cmd
        .status()
        .unwrap_or_else(|e| panic!("--features cuda needs nvcc ({}): {e}", nvcc.display()));
    assert!(status.success(), "nvcc failed on src/ops/cuda/kernels.cu");
}
