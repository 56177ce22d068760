#!/usr/bin/env bash
# The kernels alone (scripts/bench_kernels.rs): G multiply-adds/s of the float32, bfloat16 and
# int8 decoding layers at the yardstick model's shapes, 64 rows, on one thread and on all; then
# a training linear layer's three products alone on one thread (gemm, and the packed f32 kernel
# on y with the weights packed per call); then that layer's forward + backward pass on 2,048
# rows, GFLOP/s on all threads, beside PyTorch's on the same shapes and threads (when
# PEERS_PYTHON has torch): whether a training step's products are what a CPU holds back.
# Printed with the CPU they ran on.
# `NMT_CPU_ISA=avx2 scripts/bench-kernels.sh` measures the AVX2 decoding kernels on a wider CPU.
#   PEERS_PYTHON=/tmp/peers/bin/python scripts/bench-kernels.sh
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/cpu-info.sh"
(cd "$root" && cargo build --release --quiet --example bench-kernels)
out=$("$root/target/release/examples/bench-kernels")
echo "$out"
py=${PEERS_PYTHON:-/tmp/peers/bin/python}
if ! "$py" -c "import torch" 2>/dev/null; then
  echo "  (no PyTorch at $py: set PEERS_PYTHON for its figures beside nmt's)"
  exit 0
fi
"$py" - "$(grep '^  nmt ' <<<"$out")" <<'PY'
import sys, time, torch
import torch.nn.functional as F
torch.set_num_threads(torch.get_num_threads())
fields = sys.argv[1].split()[1:]
shapes, ours = fields[0::2], [float(v) for v in fields[1::2]]
line, ratios = "  PyTorch", "  nmt / PyTorch"
for shape, mine in zip(shapes, ours):
    rows, k, n = map(int, shape.split("x"))
    x = torch.randn(rows, k, requires_grad=True)
    w = (torch.randn(n, k) * 0.05).requires_grad_()
    b = (torch.randn(n) * 0.05).requires_grad_()
    flops = 3 * 2 * rows * k * n
    reps = -(-15e9 // flops)
    best = float("inf")
    for _ in range(5):
        t = time.time()
        for _ in range(int(reps)):
            x.grad = w.grad = b.grad = None
            F.linear(x, w, b).sum().backward()
        best = min(best, time.time() - t)
    theirs = flops * reps / best / 1e9
    line += f"  {shape} {theirs:.1f}"
    ratios += f"  {shape} {mine / theirs:.2f}x"
print(f"{line}   ({torch.get_num_threads()} threads)")
print(ratios)
PY
