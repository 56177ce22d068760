#!/usr/bin/env bash
# Fixed-batch training step (scripts/bench_step.rs): forward and backward milliseconds of the
# yardstick model on one synthetic batch, best of 12 steps, for each nmt build given, run
# alternately ROUNDS times; prints every run and the minimum and median per build. Use it to
# compare two versions of the code on a noisy machine (build each with
# `cargo build --release --example bench-step` and copy target/release/examples/bench-step).
#   scripts/bench-step.sh [--rounds R] [BINARY...]      (default: this checkout's build)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/cpu-info.sh"
rounds=3
if [ "${1:-}" = "--rounds" ]; then rounds=$2; shift 2; fi
if [ $# -eq 0 ]; then
  (cd "$root" && cargo build --release --quiet --example bench-step)
  set -- "$root/target/release/examples/bench-step"
fi
declare -A totals
for r in $(seq "$rounds"); do
  for bin in "$@"; do
    line=$("$bin")
    echo "round $r $bin: $line"
    totals[$bin]="${totals[$bin]:-} $(sed -E 's/.*total ([0-9.]+) ms.*/\1/' <<<"$line")"
  done
done
for bin in "$@"; do
  tr ' ' '\n' <<<"${totals[$bin]}" | sed '/^$/d' | sort -n |
    awk -v b="$bin" '{v[NR]=$1} END {printf "%s: total ms min %.1f, median %.1f over %d runs\n", b, v[1], v[int((NR+1)/2)], NR}'
done
