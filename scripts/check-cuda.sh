#!/usr/bin/env bash
# Type-checks the CUDA build (`cargo check --features cuda --all-targets`, or clippy) on a machine without
# a CUDA toolkit, so that a change that breaks the GPU code fails here and in CI rather than on
# the next GPU. Where no nvcc is found, the CUDA C++ kernels (Candle's and src/ops/cuda's) are
# not compiled: a stand-in nvcc answers the build scripts' questions and writes empty PTX and
# object files. `cargo check` links nothing and runs nothing, so what is checked is exactly the
# Rust side: types, traits, cfg(feature = "cuda") code. To build for a GPU, see
# scripts/build-cuda.sh.
#   scripts/check-cuda.sh [--clippy] [extra cargo arguments]     (--clippy: cargo clippy, not check)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
cmd=check
if [ "${1:-}" = --clippy ]; then cmd=clippy; shift; fi
if command -v nvcc > /dev/null || [ -x "${CUDA_HOME:-/nonexistent}/bin/nvcc" ]; then
  echo "check-cuda: using the installed nvcc"
  exec cargo "$cmd" --features cuda --all-targets "$@"
fi
stub=$(mktemp -d)
trap 'rm -rf "$stub"' EXIT
cat > "$stub/nvcc" <<'NVCC'
#!/usr/bin/env bash
# Stand-in nvcc for type-checking only: reports a version and the GPU codes, and writes an
# empty file wherever an output is asked for.
set -euo pipefail
out="" dir="" src=""
while [ $# -gt 0 ]; do
  case "$1" in
    --version) echo "Cuda compilation tools, release 12.4, V12.4.131 (stand-in for type-checking)"; exit 0 ;;
    --list-gpu-code) printf 'sm_80\nsm_90\n'; exit 0 ;;
    -o|--output-file) out=$2; shift 2 ;;
    --output-directory|-odir) dir=$2; shift 2 ;;
    *.cu) src=$1; shift ;;
    *) shift ;;
  esac
done
if [ -n "$out" ]; then : > "$out"; fi
if [ -n "$dir" ] && [ -n "$src" ]; then b=$(basename "$src" .cu); : > "$dir/$b.ptx"; fi
NVCC
chmod +x "$stub/nvcc"
echo "check-cuda: no nvcc here; type-checking with a stand-in (kernels not compiled)"
PATH="$stub:$PATH" NVCC="$stub/nvcc" CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-80} \
  CUDARC_CUDA_VERSION=${CUDARC_CUDA_VERSION:-12040} \
  cargo "$cmd" --features cuda --all-targets "$@"
