#!/usr/bin/env bash
# Make tests/fixtures/nmt-toy: a small model trained by nmt on the toy digits→words task (partly
# trained, so its outputs are uncertain and beam search matters), then have transformers load it
# and record logits and generate() outputs (scripts/gen-model-fixtures.py --check-nmt).
#   PYTHON=/path/to/python-with-transformers scripts/gen-nmt-toy-fixture.sh
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$root"
cargo build --release --quiet
"$py" - "$work" <<'PY'
import random, sys
W = "zero one two three four five six seven eight nine".split()
for name, seed, n in [("train", 1, 3000), ("test", 3, 40)]:
    r = random.Random(seed)
    with open(f"{sys.argv[1]}/{name}.src", "w") as s, open(f"{sys.argv[1]}/{name}.tgt", "w") as t:
        for _ in range(n):
            d = [r.randrange(10) for _ in range(r.randint(3, 9))]
            s.write(" ".join(map(str, d)) + "\n"); t.write(" ".join(W[x] for x in d) + "\n")
PY
target/release/nmt train --src "$work/train.src" --tgt "$work/train.tgt" --out "$work/run" \
  --vocab-size 400 --d-model 32 --layers 2 --heads 4 --ffn-dim 64 --max-tokens 1024 --lr 5e-3 \
  --warmup 50 --max-steps 120 --valid-every 1000
out=tests/fixtures/nmt-toy
rm -rf "$out"; mkdir -p "$out"
cp "$work/run/last/config.json" "$work/run/last/model.safetensors" "$work/run/last/tokenizer.json" "$out/"
cp "$work/test.src" "$out/sources.txt"
"$py" scripts/gen-model-fixtures.py --check-nmt "$out" --sources "$out/sources.txt"
