#!/usr/bin/env bash
# The yardstick at the Multi30k recipe's budget: ../shared/peers/torch_marian_ref.py trains the
# same model (vocabulary size, d_model, layers, heads, FFN, batch tokens, learning rate and
# warm-up read from data/configs/multi30k.json) for the same wall time, then its beam-5 test BLEU
# (transformers generate + sacreBLEU) is printed, with nmt's beam-5 decoding and scoring of the
# same weights, next to the nmt recipe's result when runs/multi30k-SRC-TGT has one.
#   PEERS_PYTHON=/tmp/peers/bin/python scripts/multi30k-peer.sh SRC TGT [--minutes 110] [--data DIR] [--out DIR]
#                                                              [--decode-limit N]
# --decode-limit: test sentences the peer decodes itself with transformers (default all 1000;
# nmt always decodes all of them).
# The peer keeps its own dropout (0.1) and uses its final weights: no validation, no averaging.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PEERS_PYTHON:-/tmp/peers/bin/python}
peer=${PEER_SCRIPT:-$root/../shared/peers/torch_marian_ref.py}
src=${1:?usage: $0 SRC TGT [--minutes M] [--data DIR] [--out DIR]}; tgt=${2:?usage: $0 SRC TGT}; shift 2
data="" minutes=110 out="" limit=1000
while [ $# -gt 0 ]; do
  case "$1" in
    --data) data=$2; shift 2 ;; --minutes) minutes=$2; shift 2 ;; --out) out=$2; shift 2 ;;
    --decode-limit) limit=$2; shift 2 ;; *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
out=${out:-$root/runs/multi30k-peer-$src-$tgt}
data=$("$root/scripts/find-multi30k.sh" "$data")
cd "$root"; cargo build --release --quiet
nmt=$root/target/release/nmt
# The preset's values as peer flags (the peer has one layer count for encoder and decoder).
flags=$(python3 - <<'PY'
import json
c = json.load(open("data/configs/multi30k.json"))
assert c["encoder_layers"] == c["decoder_layers"], "the peer needs equal encoder and decoder layers"
print(f'--vocab {c["vocab_size"]} --d-model {c["d_model"]} --layers {c["encoder_layers"]} --heads {c["heads"]} '
      f'--ff {c["ffn_dim"]} --max-tokens {c["max_tokens"]} --lr {c["lr"]} --warmup {c["warmup"]}')
PY
)
export OMP_NUM_THREADS=2 MKL_NUM_THREADS=2
start=$(date +%s)
# shellcheck disable=SC2086
"$py" "$peer" --data "$data" --src "$src" --tgt "$tgt" $flags --minutes "$minutes" --threads 2 \
  --decode-limit "$limit" --out "$out"
echo "peer run took $(( $(date +%s) - start )) s (training $minutes min, then decoding)"
zcat -f "$data/test_2016_flickr.$src.gz" | $nmt translate --model "$out/hf" --beam 5 > "$out/test_2016_flickr.nmt-beam5.$tgt"
echo "peer weights, nmt beam 5:"
$nmt eval --ref "$data/test_2016_flickr.$tgt.gz" --hyp "$out/test_2016_flickr.nmt-beam5.$tgt" --metrics bleu,chrf
if [ -s "$root/runs/multi30k-$src-$tgt/test_2016_flickr.scores" ]; then
  echo "nmt recipe (runs/multi30k-$src-$tgt):"
  cat "$root/runs/multi30k-$src-$tgt/test_2016_flickr.scores"
fi
