#!/usr/bin/env bash
# Start-up latency: wall time of `echo Hallo | nmt translate --model MODEL` (load the model and
# tokenizer, translate one line, exit), median of N alternating runs, against a fresh Python process doing
# the same with transformers and with CTranslate2 (converted once beforehand, not timed).
#   PEERS_PYTHON=/tmp/peers/bin/python scripts/bench-startup.sh HF_MODEL_DIR [--runs N]
#       [--compute-type int8] [--baseline NMT_BINARY]
# HF_MODEL_DIR: an HF Marian folder with tokenizer.json (nmt's checkpoints, the peer's hf/).
# --compute-type int8: nmt quantizes the float32 checkpoint as it loads; CTranslate2 loads a
# model converted with `--quantization int8` (its saved int8 deployment form) and runs int8.
# --baseline: another nmt build timed in the same alternation (before/after a change).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/cpu-info.sh"
py=${PEERS_PYTHON:-/tmp/peers/bin/python}
model=${1:?usage: $0 HF_MODEL_DIR [--runs N] [--compute-type int8] [--baseline NMT_BINARY]}; shift
runs=10 compute=float32 baseline=
while [ $# -gt 0 ]; do
  case "$1" in
    --runs) runs=$2; shift 2 ;;
    --compute-type) compute=$2; shift 2 ;;
    --baseline) baseline=$2; shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
case "$compute" in float32|int8) ;; *) echo "--compute-type is float32 or int8" >&2; exit 2 ;; esac
cd "$root"; cargo build --release --quiet
nmt=$root/target/release/nmt
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
quantize=(); [ "$compute" = int8 ] && quantize=(--quantization int8)
"$(dirname "$py")/ct2-transformers-converter" --model "$model" --output_dir "$work/ct2" \
  "${quantize[@]}" --force >/dev/null 2>&1
echo "model: $model ($(du -shL "$model" | cut -f1)); CTranslate2's converted copy $(du -sh "$work/ct2" | cut -f1); compute type $compute"
cat > "$work/hf.py" <<'PY'
import sys, torch
from tokenizers import Tokenizer
from transformers import MarianMTModel
torch.set_num_threads(2)
tok = Tokenizer.from_file(sys.argv[1] + "/tokenizer.json")
model = MarianMTModel.from_pretrained(sys.argv[1]).eval()
ids = torch.tensor([tok.encode(sys.stdin.readline().rstrip("\n"), add_special_tokens=False).ids + [model.config.eos_token_id]])
with torch.no_grad():
    # nmt's default length limit, 1.5 · source tokens + 10, so that an untrained model's
    # endless output costs every engine alike.
    out = model.generate(input_ids=ids, num_beams=1, max_new_tokens=int(1.5 * ids.shape[1]) + 10)
print(tok.decode(out[0].tolist(), skip_special_tokens=True))
PY
cat > "$work/ct2.py" <<'PY'
import sys, ctranslate2
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[1] + "/tokenizer.json")
tr = ctranslate2.Translator(sys.argv[2], device="cpu", intra_threads=2, compute_type=sys.argv[3])
src = tok.encode(sys.stdin.readline().rstrip("\n"), add_special_tokens=False).tokens + ["</s>"]
hyp = tr.translate_batch([src], beam_size=1, max_decoding_length=int(1.5 * len(src)) + 10)[0].hypotheses[0]
print(tok.decode([tok.token_to_id(t) for t in hyp], skip_special_tokens=True))
PY
# Wall milliseconds of `echo Hallo | CMD...`, one line "NAME MS" per run.
time_ms() {
  local name=$1 t0 t1; shift
  t0=$(date +%s%N)
  if ! echo Hallo | "$@" >/dev/null 2>"$work/err"; then
    echo "bench-startup.sh: $name failed: $*" >&2; cat "$work/err" >&2; exit 1
  fi
  t1=$(date +%s%N)
  echo "$name $(( (t1 - t0) / 1000000 ))"
}
median() { awk -v n="$1" '$1 == n {print $2}' "$work/times" | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
export OMP_NUM_THREADS=2 RAYON_NUM_THREADS=2
ours=("$nmt" translate --model "$model" --compute-type "$compute")
base=("$baseline" translate --model "$model" --compute-type "$compute")
hf=("$py" "$work/hf.py" "$model")
ct2=("$py" "$work/ct2.py" "$model" "$work/ct2" "$compute")
# One warm-up run each (page cache, Python bytecode), then the engines alternate run by run.
time_ms warm "${ours[@]}" >/dev/null; time_ms warm "${hf[@]}" >/dev/null; time_ms warm "${ct2[@]}" >/dev/null
for _ in $(seq "$runs"); do
  time_ms nmt "${ours[@]}"; time_ms hf "${hf[@]}"; time_ms ct2 "${ct2[@]}"
done > "$work/times"
# The two builds in a loop of their own, so that each follows the other and not a Python peer
# (on a virtual machine a run can pay a host fault per fresh page, more so after another
# process freed much memory; see docs/performance.md, Start-up).
if [ -n "$baseline" ]; then
  for _ in $(seq "$runs"); do
    time_ms mine "${ours[@]}"; time_ms base "${base[@]}"
  done >> "$work/times"
fi
ours=$(median nmt); hf=$(median hf); ct2=$(median ct2)
printf '%-16s %8s\n' "" "ms (median of $runs)"
printf '%-16s %8d\n' nmt "$ours" transformers "$hf" CTranslate2 "$ct2"
awk -v a="$ours" -v b="$hf" -v c="$ct2" 'BEGIN { printf "nmt/transformers time %.3f, nmt/CTranslate2 time %.3f\n", a / b, a / c }'
if [ -n "$baseline" ]; then
  a=$(median mine); b=$(median base)
  printf '%-16s %8d\n' "nmt, then" "$a" "nmt (baseline)" "$b"
  awk -v a="$a" -v b="$b" 'BEGIN { printf "nmt/baseline time %.3f (their own alternation)\n", a / b }'
fi
