#!/usr/bin/env bash
# The Multi30k recipe: joint BPE tokenizer, Transformer from a preset (data/configs/multi30k.json,
# or --config, e.g. data/configs/multi30k-short.json for budgets under an hour), best
# checkpoint by validation BLEU plus an average of the last checkpoints (the better of the two
# on validation is kept), beam-5 translation of test_2016_flickr, BLEU and chrF with signatures.
#   scripts/multi30k.sh SRC TGT [--data DIR] [--max-time 2h] [--out DIR] [--config FILE] [-- extra nmt train flags]
# SRC and TGT are two of en, de, fr, cs.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
src=${1:?usage: $0 SRC TGT [--data DIR] [--max-time T] [--out DIR]}; tgt=${2:?usage: $0 SRC TGT}; shift 2
data="" max_time=2h out="" config=data/configs/multi30k.json
while [ $# -gt 0 ]; do
  case "$1" in
    --data) data=$2; shift 2 ;; --max-time) max_time=$2; shift 2 ;; --out) out=$2; shift 2 ;;
    --config) config=$2; shift 2 ;; --) shift; break ;; *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
for l in "$src" "$tgt"; do case "$l" in en|de|fr|cs) ;; *) echo "error: language $l is not one of en, de, fr, cs" >&2; exit 2 ;; esac; done
out=${out:-$root/runs/multi30k-$src-$tgt}
data=$("$root/scripts/find-multi30k.sh" "$data")
cd "$root"; cargo build --release --quiet
nmt=$root/target/release/nmt
mkdir -p "$out"
[ -s "$out/tokenizer.json" ] || $nmt tokenize train --input "$data/train.$src.gz" --input "$data/train.$tgt.gz" \
  --vocab-size "$(python3 -c "import json; print(json.load(open('$config'))['vocab_size'])")" --output "$out/tokenizer.json"
resume=(); [ -e "$out/model/last" ] && resume=(--resume)
start=$(date +%s)
$nmt train --src "$data/train.$src.gz" --tgt "$data/train.$tgt.gz" --valid-src "$data/val.$src.gz" --valid-tgt "$data/val.$tgt.gz" \
  --tokenizer "$out/tokenizer.json" --config "$config" --max-time "$max_time" --out "$out/model" "${resume[@]}" "$@"
echo "training took $(( $(date +%s) - start )) s"
$nmt average --run "$out/model" --last 5 --output "$out/averaged" --force
best_bleu() { zcat -f "$data/val.$src.gz" | $nmt translate --model "$1" --beam 5 | $nmt eval --ref "$data/val.$tgt.gz" --json | python3 -c "import json,sys; print(json.load(sys.stdin)[0]['score'])"; }
b1=$(best_bleu "$out/model/best"); b2=$(best_bleu "$out/averaged")
final=$out/model/best; python3 -c "import sys; sys.exit(0 if $b2 > $b1 else 1)" && final=$out/averaged
echo "validation BLEU (beam 5): best checkpoint $b1, average of last 5 $b2 -> using $final"
zcat -f "$data/test_2016_flickr.$src.gz" | $nmt translate --model "$final" --beam 5 > "$out/test_2016_flickr.hyp.$tgt"
$nmt eval --ref "$data/test_2016_flickr.$tgt.gz" --hyp "$out/test_2016_flickr.hyp.$tgt" --metrics bleu,chrf | tee "$out/test_2016_flickr.scores"
