#!/usr/bin/env bash
# Fuzz the input paths a user controls with cargo-fuzz (libFuzzer), each target for SECONDS
# (default 600), starting from the committed seeds in tests/fuzz/seeds/TARGET; the growing
# corpus goes to tests/fuzz/corpus/TARGET and any crash to tests/fuzz/artifacts/TARGET.
#   scripts/fuzz.sh [TARGET...] [--seconds N] [--jobs J]
# Targets: corpus_reader metric_tokenizers spm_model config translate_input weights_file
# pytorch_file tokenizer_file serve_request (default: all); the weights and tokenizer targets
# also start from the fixtures' own files.
# Needs cargo-fuzz (cargo install cargo-fuzz). It works on the stable toolchain: libFuzzer's
# coverage flags are stable, and RUSTC_BOOTSTRAP=1 admits the one unstable flag cargo-fuzz
# passes; we fuzz without a sanitizer (-s none), looking for panics, aborts and hangs. Debug
# assertions are on, so an integer overflow that release builds wrap stops a run too: known,
# candle's pickle reader on some damaged pytorch_model.bin files ("attempt to shift left with
# overflow"), which the release binary rejects with an error naming the file.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
seconds=600 jobs=1 targets=()
while [ $# -gt 0 ]; do
  case "$1" in
    --seconds) seconds=$2; shift 2 ;;
    --jobs) jobs=$2; shift 2 ;;
    -*) echo "unknown option $1" >&2; exit 2 ;;
    *) targets+=("$1"); shift ;;
  esac
done
[ ${#targets[@]} -gt 0 ] || targets=(corpus_reader metric_tokenizers spm_model config translate_input weights_file pytorch_file tokenizer_file serve_request)
cd "$root"
export RUSTC_BOOTSTRAP=1
cargo fuzz build --fuzz-dir tests/fuzz -s none
run() {
  local t=$1
  mkdir -p "tests/fuzz/corpus/$t"
  local seeds=("tests/fuzz/seeds/$t")
  local from=""
  case "$t" in
    weights_file) from=nmt-toy/model.safetensors ;;
    pytorch_file) from=opus-tiny/pytorch_model.bin ;;
    tokenizer_file) from=nmt-toy/tokenizer.json ;;
  esac
  if [ -n "$from" ]; then
    mkdir -p "tests/fuzz/seeds-fixture/$t" && cp "tests/fixtures/$from" "tests/fuzz/seeds-fixture/$t/"
    seeds+=("tests/fuzz/seeds-fixture/$t")
  fi
  cargo fuzz run --fuzz-dir tests/fuzz -s none "$t" "tests/fuzz/corpus/$t" "${seeds[@]}" -- \
    -max_total_time="$seconds" -rss_limit_mb=4096 -timeout=30 -print_final_stats=1 \
    > "tests/fuzz/$t.log" 2>&1 && local rc=0 || local rc=$?
  local execs
  execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "tests/fuzz/$t.log" | grep -o '[0-9]*$' || echo "?")
  local cov
  cov=$(grep -o 'cov: [0-9]*' "tests/fuzz/$t.log" | tail -n 1 | grep -o '[0-9]*' || echo "?")
  printf '%-18s exit %d  %s s  %s runs  coverage %s  corpus %s files\n' "$t" "$rc" "$seconds" "$execs" "$cov" \
    "$(ls "tests/fuzz/corpus/$t" | wc -l)"
  return $rc
}
status=0
running=0
for t in "${targets[@]}"; do
  run "$t" &
  running=$((running + 1))
  if [ "$running" -ge "$jobs" ]; then wait -n || status=1; running=$((running - 1)); fi
done
while [ "$running" -gt 0 ]; do wait -n || status=1; running=$((running - 1)); done
[ "$status" -eq 0 ] && echo "no crashes" || echo "crashes: see tests/fuzz/artifacts/ and tests/fuzz/*.log"
exit $status
