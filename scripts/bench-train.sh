#!/usr/bin/env bash
# Training speed: target tokens/s of `nmt train` and of the PyTorch yardstick
# (../shared/peers/torch_marian_ref.py) on the same configuration — vocab 8000, d_model 256, 3+3
# layers, 4 heads, FFN 1024, --max-tokens 2048, Multi30k de→en — run alternately, plus peak RSS,
# the machine's f32 matmul peak (torch, 2 threads) and nmt's model-FLOPs utilisation.
#   PEERS_PYTHON=/tmp/peers/bin/python scripts/bench-train.sh [--data DIR] [--steps N] [--rounds R]
# Needs a Python with torch, transformers, tokenizers, sacrebleu, ctranslate2 (../shared/peers/README.md).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/cpu-info.sh"
py=${PEERS_PYTHON:-/tmp/peers/bin/python}
peer=${PEER_SCRIPT:-$root/../shared/peers/torch_marian_ref.py}
data="" steps=60 rounds=2 max_tokens=2048
while [ $# -gt 0 ]; do
  case "$1" in
    --data) data=$2; shift 2 ;; --steps) steps=$2; shift 2 ;; --rounds) rounds=$2; shift 2 ;;
    --max-tokens) max_tokens=$2; shift 2 ;; *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
data=$("$root/scripts/find-multi30k.sh" "$data")
cd "$root"; cargo build --release --quiet
nmt=$root/target/release/nmt
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
$nmt tokenize train --input "$data/train.de.gz" --input "$data/train.en.gz" --vocab-size 8000 --output "$work/tok.json" 2>/dev/null
printf '{"log_every": 1, "valid_every": 1000000, "max_tokens": %s}\n' "$max_tokens" > "$work/cfg.json"
export OMP_NUM_THREADS=2 MKL_NUM_THREADS=2 RAYON_NUM_THREADS=2
peak=$("$py" - <<'PY'
import time, torch
torch.set_num_threads(2)
a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
for _ in range(3): a @ b
best, n = 0.0, 10
for _ in range(5):  # best of 5: one slow repetition on a shared machine is not the peak
    t = time.time()
    for _ in range(n): a @ b
    best = max(best, 2 * 2048**3 * n / (time.time() - t) / 1e9)
print(round(best, 1))
PY
)
median() { "$py" -c "import statistics,sys; print(round(statistics.median(float(x) for x in sys.stdin.read().split())))"; }
echo "machine f32 matmul peak (torch, 2 threads): $peak GFLOP/s"
printf '%-6s %-8s %12s %12s\n' round system "tgt tok/s" "peak RSS MB"
nmt_rates=() peer_rates=() nmt_rss=() peer_rss=()
for r in $(seq "$rounds"); do
  rm -rf "$work/nmt"
  /usr/bin/time -f '%M' -o "$work/rss" $nmt train --src "$data/train.de.gz" --tgt "$data/train.en.gz" \
    --tokenizer "$work/tok.json" --config "$work/cfg.json" --max-steps "$steps" --out "$work/nmt" 2>/dev/null
  rate=$("$py" -c "import json; [print(json.loads(l)['tok_s']) for l in open('$work/nmt/metrics.jsonl') if '\"tok_s\"' in l and json.loads(l)['step'] > 10]" | median)
  rss=$(( $(cat "$work/rss") / 1024 )); nmt_rates+=("$rate"); nmt_rss+=("$rss")
  printf '%-6s %-8s %12s %12s\n' "$r" nmt "$rate" "$rss"
  tokens=$("$py" -c "import json; print(max(json.loads(l).get('step',0) for l in open('$work/nmt/metrics.jsonl')))")
  rm -rf "$work/peer"
  /usr/bin/time -f '%M' -o "$work/rss" "$py" "$peer" --data "$data" --src de --tgt en --max-tokens "$max_tokens" \
    --tokens $(( steps * max_tokens * 6 / 10 )) --minutes 30 --decode-limit 1 --out "$work/peer" > /dev/null 2>&1
  rate=$("$py" -c "import json; print(json.load(open('$work/peer/result.json'))['train_tgt_tok_per_s_median'])")
  rss=$(( $(cat "$work/rss") / 1024 )); peer_rates+=("$rate"); peer_rss+=("$rss")
  printf '%-6s %-8s %12s %12s\n' "$r" pytorch "$rate" "$rss"
done
n=$(printf '%s\n' "${nmt_rates[@]}" | median); p=$(printf '%s\n' "${peer_rates[@]}" | median)
nr=$(printf '%s\n' "${nmt_rss[@]}" | median); pr=$(printf '%s\n' "${peer_rss[@]}" | median)
"$py" - "$n" "$p" "$nr" "$pr" "$peak" <<'PY'
import sys
n, p, nr, pr, peak = map(float, sys.argv[1:])
flops = 6 * 7.7e6  # 6 x parameters per target token (forward + backward), the usual estimate
print(f"nmt {n:.0f} tok/s, PyTorch {p:.0f} tok/s: ratio {n / p:.2f}x")
print(f"peak RSS nmt {nr:.0f} MB, PyTorch {pr:.0f} MB: ratio {nr / pr:.2f}")
print(f"model-FLOPs utilisation: nmt {n * flops / 1e9:.1f} GFLOP/s = {100 * n * flops / 1e9 / peak:.0f}% of {peak:.0f}; "
      f"PyTorch {100 * p * flops / 1e9 / peak:.0f}%")
PY
