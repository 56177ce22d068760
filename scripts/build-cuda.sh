#!/usr/bin/env bash
# Builds nmt with --features cuda on a machine with no GPU and no system CUDA toolkit.
#   scripts/build-cuda.sh            -> target/cuda/release/nmt
#   scripts/build-cuda.sh --tests    -> also target/cuda/release/nmt-cuda-tests, the CPU/GPU
#                                       agreement tests (tests/cuda.rs) as one binary to carry
#                                       to a GPU machine (run it from a checkout's root)
#
# CUDA's compiler and headers come from PyPI wheels installed in a venv:
#   nvidia-cuda-nvcc, nvidia-cuda-runtime, nvidia-cuda-cccl (+ nvidia-nvvm, nvidia-cuda-crt),
#   all of release $NMT_CUDA_VERSION (13.0)
# The binary does not link libcuda, cuBLAS or cuRAND: they are loaded at run time (dlopen),
# from the driver and from wherever LD_LIBRARY_PATH points (for example the nvidia/*/lib
# folders of a PyTorch install). Candle asks its CUDA bindings (cudarc) to link them at build
# time, so this script builds against a copy of candle-core with that one feature switched
# ("dynamic-linking" -> "dynamic-loading"), passed to cargo as a patch on the command line;
# Cargo.toml, Cargo.lock and the default (CPU) build are untouched. The copy has one more
# change, for speed on the GPU (scripts/patch-candle-backprop.py): the backward pass stores a
# gradient's first contribution instead of adding it to zeros, which was one kernel launch
# per graph edge, more than half of a training step's launches.
#
# Variables (defaults in brackets):
#   NMT_CUDA_VENV     the venv holding the CUDA wheels [/tmp/nmt-cuda-venv]
#   NMT_CUDA_VERSION  CUDA release of the wheels [13.0]; PTX from 13.0 runs on every CUDA 13
#                     driver, and cudarc then looks for libcublas.so.13 and friends
#   CUDA_COMPUTE_CAP  GPU architecture the kernels are compiled for [90: H100/H200]
#   NMT_CANDLE_BACKPROP  'stock' builds against Candle's own backward pass, to measure the
#                     rewrite against it [patched]
# It sets, for the build only: CUDA_HOME, CUDA_PATH and PATH (nvcc), NVCC_CCBIN (the host C++
# compiler), CUDA_COMPUTE_CAP, LIBRARY_PATH (the static CUDA runtime) and
# CARGO_TARGET_DIR=target/cuda.
set -euo pipefail
tests=0
case "${1:-}" in --tests) tests=1 ;; "") ;; *) echo "usage: $0 [--tests]" >&2; exit 2 ;; esac
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${NMT_CUDA_VENV:-/tmp/nmt-cuda-venv}
version=${NMT_CUDA_VERSION:-13.0}
export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}

if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
# nvcc's own dependencies (the NVVM compiler, crt headers) are pinned too: a newer NVVM
# writes PTX that this release's ptxas (and older drivers) reject.
"$venv/bin/pip" install --quiet --disable-pip-version-check \
  "nvidia-cuda-nvcc==$version.*" "nvidia-cuda-runtime==$version.*" "nvidia-cuda-cccl==$version.*" \
  "nvidia-nvvm==$version.*" "nvidia-cuda-crt==$version.*"
cuda=$("$venv/bin/python" - <<'PY'
import glob, os, nvidia
roots = [p for base in nvidia.__path__ for p in glob.glob(os.path.join(base, "*")) if os.path.exists(os.path.join(p, "bin", "nvcc"))]
print(roots[0] if roots else "")
PY
)
[ -n "$cuda" ] || { echo "build-cuda.sh: no nvcc in the wheels under $venv" >&2; exit 1; }
export CUDA_HOME=$cuda CUDA_PATH=$cuda PATH="$cuda/bin:$PATH"
export NVCC_CCBIN=${NVCC_CCBIN:-$(command -v g++)}
echo "nvcc: $(nvcc --version | tail -n 2 | head -n 1)  (CUDA_HOME=$CUDA_HOME, sm_$CUDA_COMPUTE_CAP)"

cd "$root"
export CARGO_TARGET_DIR=$root/target/cuda
# The candle-core that Cargo.lock pins, copied and switched to run-time loading of CUDA.
cargo fetch --quiet
core_src=$(cargo metadata --format-version 1 --features cuda | "$venv/bin/python" -c '
import json, sys, os
m = json.load(sys.stdin)
print(next(os.path.dirname(p["manifest_path"]) for p in m["packages"] if p["name"] == "candle-core"))')
patched=$CARGO_TARGET_DIR/patched/candle-core
case "${NMT_CANDLE_BACKPROP:-patched}" in
  patched) patch_version=$(md5sum < "$root/scripts/patch-candle-backprop.py" | cut -c1-12) ;;
  stock) patch_version=stock ;;
  *) echo "build-cuda.sh: NMT_CANDLE_BACKPROP is 'patched' or 'stock'" >&2; exit 2 ;;
esac
if [ "$(cat "$patched.from" 2>/dev/null)" != "$core_src $patch_version" ]; then  # else reuse (no rebuild)
  rm -rf "$patched"; mkdir -p "$(dirname "$patched")"
  cp -r "$core_src" "$patched"
  grep -q '"dynamic-linking"' "$patched/Cargo.toml" || { echo "build-cuda.sh: candle-core no longer asks for dynamic-linking; update this script" >&2; exit 1; }
  sed -i 's/"dynamic-linking"/"dynamic-loading"/' "$patched/Cargo.toml"
  if [ "$patch_version" != stock ]; then
    "$venv/bin/python" "$root/scripts/patch-candle-backprop.py" "$patched/src/backprop.rs"
  fi
  echo "$core_src $patch_version" > "$patched.from"
fi

# candle-kernels links its precompiled kernels against the CUDA runtime (-lcudart). Offer the
# wheel's static libcudart there, so the binary needs no libcudart.so at run time either
# (the runtime finds the driver by itself). LIBRARY_PATH reaches the linker without changing
# any crate's fingerprint.
linkdir=$CARGO_TARGET_DIR/cuda-link
mkdir -p "$linkdir"
ln -sf "$cuda/lib/libcudart_static.a" "$linkdir/libcudart.a"
export LIBRARY_PATH="$linkdir${LIBRARY_PATH:+:$LIBRARY_PATH}"

# The patch rewrites Cargo.lock while it is in effect; put the committed one back after.
cp Cargo.lock "$CARGO_TARGET_DIR/Cargo.lock.saved"
trap 'cp "$CARGO_TARGET_DIR/Cargo.lock.saved" "$root/Cargo.lock"' EXIT
patch=(--config "patch.crates-io.candle-core.path=\"$patched\"")
cargo build --release --features cuda "${patch[@]}"
bin=$CARGO_TARGET_DIR/release/nmt
echo "built $bin"
if readelf -d "$bin" | grep -E 'NEEDED.*lib(cuda|cudart|cublas|curand|nvrtc)' ; then
  echo "build-cuda.sh: the binary links CUDA libraries at build time" >&2; exit 1
fi
echo "links no CUDA library; the driver and cuBLAS are loaded when --device cuda is used"
if [ "$tests" = 1 ]; then
  exe=$(cargo test --release --features cuda "${patch[@]}" --test cuda --no-run --message-format=json \
    | "$venv/bin/python" -c '
import json, sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "cuda" and m.get("executable"):
        print(m["executable"])')
  cp "$exe" "$CARGO_TARGET_DIR/release/nmt-cuda-tests"
  echo "built $CARGO_TARGET_DIR/release/nmt-cuda-tests"
fi
