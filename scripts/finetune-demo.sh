#!/usr/bin/env bash
# Fine-tuning, demonstrated: a checkpoint trained elsewhere (the PyTorch yardstick,
# ../shared/peers/torch_marian_ref.py, M minutes on Multi30k de→en) is fine-tuned with nmt for
# M more minutes (`nmt train --init`, data/configs/finetune.json), next to nmt trained from
# scratch for M minutes with the same vocabulary; prints test_2016_flickr BLEU (beam 5, scored
# by nmt eval) of the three.
#   PEERS_PYTHON=/tmp/peers/bin/python scripts/finetune-demo.sh [--minutes 10] [--data DIR] [--work DIR]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PEERS_PYTHON:-/tmp/peers/bin/python}
minutes=10 data="" work=/tmp/nmt-finetune-demo
while [ $# -gt 0 ]; do
  case "$1" in
    --minutes) minutes=$2; shift 2 ;; --data) data=$2; shift 2 ;; --work) work=$2; shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
data=$("$root/scripts/find-multi30k.sh" "$data")
cd "$root"; cargo build --release --quiet
nmt=$root/target/release/nmt
"$root/scripts/cpu-info.sh"
rm -rf "$work"; mkdir -p "$work"
export OMP_NUM_THREADS=2 MKL_NUM_THREADS=2
echo "== the yardstick, $minutes minutes (PyTorch)"
(cd "$root/../shared/peers" && "$py" torch_marian_ref.py --data "$data" --src de --tgt en \
  --minutes "$minutes" --decode-limit 10 --out "$work/peer") > "$work/peer.log" 2>&1
train=(--src "$data/train.de.gz" --tgt "$data/train.en.gz" --valid-src "$data/val.de.gz" --valid-tgt "$data/val.en.gz")
echo "== its checkpoint fine-tuned with nmt, $minutes minutes"
"$nmt" train --init "$work/peer/hf" "${train[@]}" --config data/configs/finetune.json \
  --max-time "${minutes}m" --out "$work/finetuned" 2> "$work/finetuned.log"
echo "== nmt from scratch, $minutes minutes, the same vocabulary"
"$nmt" train "${train[@]}" --tokenizer "$work/peer/hf/tokenizer.json" --config data/configs/yardstick.json \
  --max-time "${minutes}m" --out "$work/scratch" 2> "$work/scratch.log"
for m in peer/hf finetuned scratch; do
  printf '%-10s ' "$m"
  "$nmt" eval --ref "$data/test_2016_flickr.en.gz" --src "$data/test_2016_flickr.de.gz" \
    --model "$work/$m" --beam 5 --metrics bleu
done
