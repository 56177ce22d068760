#!/usr/bin/env bash
# Word alignments of nmt against eflomal, on Multi30k de→en: each model translates
# test_2016_flickr with `--alignment hard` (or a threshold P); eflomal (trained on the training corpus plus the
# test sources and that model's translations, grow-diag-final-and) aligns the same pairs;
# prints precision, recall, F1 and AER of nmt's links against eflomal's, and BLEU (beam 5).
#   PEERS_PYTHON=/tmp/peers/bin/python scripts/bench-align.sh MODEL [MODEL2 ...] [--data DIR] [--layer N|avg] [--head N|avg] [--position predict|read] [--alignment hard|P]
#   PEERS_PYTHON=/tmp/peers/bin/python scripts/bench-align.sh --train MINUTES [--config FILE] [--weight W] [--guided-layer N] [--all-heads] [--guided-position predict|read] [--data DIR]
# MODEL: de→en models as `nmt translate --model` takes them. --train M first trains two for M
# minutes each with --config (default data/configs/yardstick.json), one without and one with
# guided alignment (eflomal's links of the training corpus, --guided-alignment, cost weight W,
# default the config's or 0.1, on decoder layer N, default the last), and compares those.
# eflomal installs from PyPI (pip install eflomal).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PEERS_PYTHON:-/tmp/peers/bin/python}
models=() data="" flags=() minutes="" mode=hard config=data/configs/yardstick.json weight=()
while [ $# -gt 0 ]; do
  case "$1" in
    --data) data=$2; shift 2 ;;
    --train) minutes=$2; shift 2 ;;
    --config) config=$2; shift 2 ;;
    --weight) weight+=(--guided-alignment-weight "$2"); shift 2 ;;
    --guided-layer) weight+=(--guided-alignment-layer "$2"); shift 2 ;;
    --all-heads) weight+=(--guided-alignment-all-heads); shift ;;
    --guided-position) weight+=(--guided-alignment-position "$2"); shift 2 ;;
    --position) flags+=(--alignment-position "$2"); shift 2 ;;
    --layer) flags+=(--alignment-layer "$2"); shift 2 ;;
    --head) flags+=(--alignment-head "$2"); shift 2 ;;
    --alignment) mode=$2; shift 2 ;;
    --*) echo "unknown option $1" >&2; exit 2 ;;
    *) models+=("$1"); shift ;;
  esac
done
[ ${#models[@]} -gt 0 ] || [ -n "$minutes" ] || { echo "usage: $0 MODEL [MODEL2 ...] [--data DIR] [--layer N|avg] [--head N|avg]" >&2; exit 2; }
data=$("$root/scripts/find-multi30k.sh" "$data")
cd "$root"; cargo build --release --quiet
nmt=$root/target/release/nmt
"$root/scripts/cpu-info.sh"
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
zcat -f "$data/test_2016_flickr.de.gz" > "$work/test.de"
if [ -n "$minutes" ]; then
  runs=${NMT_ALIGN_RUNS:-/tmp/nmt-bench-align}
  rm -rf "$runs"; mkdir -p "$runs"
  "$py" "$root/scripts/align-score.py" --write-links "$data/train.de.gz" "$data/train.en.gz" "$runs/train.align"
  train=(--src "$data/train.de.gz" --tgt "$data/train.en.gz" --valid-src "$data/val.de.gz" --valid-tgt "$data/val.en.gz"
         --config "$config" --max-time "${minutes}m")
  $nmt train "${train[@]}" --out "$runs/plain" 2> "$runs/plain.log"
  $nmt train "${train[@]}" --guided-alignment "$runs/train.align" "${weight[@]}" --out "$runs/guided" 2> "$runs/guided.log"
  models+=("$runs/plain" "$runs/guided")
fi
for m in "${models[@]}"; do
  $nmt translate --model "$m" --alignment "$mode" "${flags[@]}" < "$work/test.de" > "$work/aligned.txt"
  sed 's/ ||| .*//' "$work/aligned.txt" > "$work/hyp.en"
  $nmt translate --model "$m" --beam 5 < "$work/test.de" > "$work/beam5.en"
  bleu=$($nmt eval --ref "$data/test_2016_flickr.en.gz" --hyp "$work/beam5.en" --metrics bleu --json | "$py" -c "import json,sys; print(round(json.load(sys.stdin)[0]['score'], 2))")
  score=$("$py" "$root/scripts/align-score.py" "$data/train.de.gz" "$data/train.en.gz" "$work/test.de" "$work/aligned.txt")
  echo "$m: BLEU (beam 5) $bleu; against eflomal: $score"
done
