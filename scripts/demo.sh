#!/usr/bin/env bash
# The demo: build nmt, train a subword tokenizer and a small de→en Transformer on Multi30k for a
# few minutes on the CPU, translate test_2016_flickr with beam search, and score it with BLEU and chrF.
#   scripts/demo.sh [--data DIR] [--minutes N] [--out DIR]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
data="" minutes=5 out="$root/runs/demo"
while [ $# -gt 0 ]; do
  case "$1" in
    --data) data=$2; shift 2 ;;
    --minutes) minutes=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    *) echo "usage: $0 [--data DIR] [--minutes N] [--out DIR]" >&2; exit 2 ;;
  esac
done
data=$("$root/scripts/find-multi30k.sh" "$data")
cd "$root"
cargo build --release --quiet
nmt=$root/target/release/nmt
rm -rf "$out"; mkdir -p "$out"
echo "== tokenizer: 8,000-piece joint BPE on de+en ($data)"
$nmt tokenize train --input "$data/train.de.gz" --input "$data/train.en.gz" --vocab-size 8000 --output "$out/tokenizer.json"
echo "Zwei Männer stehen am Herd und bereiten Essen zu." | $nmt tokenize encode --tokenizer "$out/tokenizer.json"
echo "== training de→en for $minutes minutes"
$nmt train --src "$data/train.de.gz" --tgt "$data/train.en.gz" \
  --valid-src "$data/val.de.gz" --valid-tgt "$data/val.en.gz" \
  --tokenizer "$out/tokenizer.json" --config data/configs/demo.json \
  --max-time "${minutes}m" --out "$out/model"
echo "== translating test_2016_flickr (beam 5)"
zcat -f "$data/test_2016_flickr.de.gz" | $nmt translate --model "$out/model" --beam 5 > "$out/test.hyp.en"
head -3 "$out/test.hyp.en"
echo "== scoring"
$nmt eval --ref "$data/test_2016_flickr.en.gz" --hyp "$out/test.hyp.en" --metrics bleu,chrf
