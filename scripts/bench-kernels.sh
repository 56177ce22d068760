#!/usr/bin/env bash
# The linear-layer kernels alone (scripts/bench_kernels.rs): G multiply-adds/s of float32,
# bfloat16 and int8 layers at the yardstick model's shapes, 64 rows, on one thread and on all,
# with the CPU they ran on. `NMT_CPU_ISA=avx2 scripts/bench-kernels.sh` measures the AVX2
# kernels on a wider CPU.
#   scripts/bench-kernels.sh
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/cpu-info.sh"
(cd "$root" && cargo build --release --quiet --example bench-kernels)
"$root/target/release/examples/bench-kernels"
