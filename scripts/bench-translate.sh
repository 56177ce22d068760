#!/usr/bin/env bash
# Decoding speed and parity on the same weights: nmt, transformers `generate` and CTranslate2
# (float32, 2 threads), greedy and beam 5, batch 64, over test_2016_flickr.de; prints
# sentences/s (best of --rounds runs, nmt and CTranslate2 alternating, each peer in a process of
# its own; nmt also with its start-up subtracted, as the peers' timings leave out loading), the
# speed ratios, and the share of lines where nmt's output equals each peer's.
#   PEERS_PYTHON=/tmp/peers/bin/python scripts/bench-translate.sh HF_MODEL_DIR [--data DIR] [--lines N] [--rounds R]
# HF_MODEL_DIR: an HF Marian folder, e.g. the hf/ output of ../shared/peers/torch_marian_ref.py.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PEERS_PYTHON:-/tmp/peers/bin/python}
model=${1:?usage: $0 HF_MODEL_DIR [--data DIR] [--lines N] [--rounds R]}; shift
data="" lines=1000 rounds=2
while [ $# -gt 0 ]; do
  case "$1" in
    --data) data=$2; shift 2 ;; --lines) lines=$2; shift 2 ;; --rounds) rounds=$2; shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
data=$("$root/scripts/find-multi30k.sh" "$data")
cd "$root"; cargo build --release --quiet
nmt=$root/target/release/nmt
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
zcat -f "$data/test_2016_flickr.de.gz" > "$work/all.de"
head -n "$lines" "$work/all.de" > "$work/src.de"
export OMP_NUM_THREADS=2 RAYON_NUM_THREADS=2
peer() { "$py" "$root/scripts/decode-peers.py" "$model" "$work/src.de" "$work" --engine "$1" --threads 2 --batch 64 --max-new-tokens 128 2>/dev/null | tail -1; }
# nmt's time includes starting the process and loading the model, the peers' only decoding;
# nmt's start-up (best of 3 runs translating one word) is also measured, and subtracted for
# the "decoding only" row.
# Wall seconds of a command run with stdin from $1 and stdout to $2.
secs() {
  local in=$1 out=$2 t0 t1; shift 2
  t0=$(date +%s.%N); "$@" < "$in" > "$out"; t1=$(date +%s.%N)
  "$py" -c "print($t1 - $t0)"
}
echo Hallo > "$work/one.de"
declare -A startup
for beam in 1 5; do
  startup[$beam]=$(for i in 1 2 3; do secs "$work/one.de" /dev/null $nmt translate --model "$model" --beam "$beam"; done | sort -g | head -1)
done
: > "$work/rates"
for r in $(seq "$rounds"); do
  for beam in 1 5; do
    t=$(secs "$work/src.de" "$work/nmt.beam$beam.txt" $nmt translate --model "$model" --beam "$beam" --batch-size 64 --max-len-a 0 --max-len-b 128)
    echo "{\"nmt_beam${beam}_sent_per_s\": $("$py" -c "print(round($lines / $t, 1))"), \"nmt_beam${beam}_decode_sent_per_s\": $("$py" -c "print(round($lines / ($t - ${startup[$beam]}), 1))")}" >> "$work/rates"
  done
  peer ct2 >> "$work/rates"
done
peer hf >> "$work/rates"  # transformers is slow: one run
"$py" - "$work" <<'PY'
import json, sys
work = sys.argv[1]
peers = {}
for line in open(f"{work}/rates"):
    for k, v in json.loads(line).items():
        peers[k] = max(peers.get(k, v), v) if isinstance(v, float) else v
read = lambda n: open(f"{work}/{n}", encoding="utf-8").read().split("\n")[:-1]
print("sentences/s; nmt: whole process (start-up, model load, decoding), then decoding only")
print("(start-up subtracted; the peers' timings cover decoding only)")
print(f"{'':16} {'nmt':>8} {'transformers':>13} {'CTranslate2':>12}   nmt/transformers  nmt/CT2")
for beams in (1, 5):
    hf, ct = peers.get(f"hf_beam{beams}_sent_per_s"), peers.get(f"ct2_beam{beams}_sent_per_s")
    for how, key in (("", "sent_per_s"), (" decoding", "decode_sent_per_s")):
        rate = peers[f"nmt_beam{beams}_{key}"]
        print(f"{f'beam {beams}{how}':<16} {rate:>8.1f} {hf or 0:>13.1f} {ct or 0:>12.1f}   {rate / hf if hf else 0:>16.2f}  {rate / ct if ct else 0:>7.2f}")
for beams in (1, 5):
    for peer, name in (("hf", "transformers'"), ("ct2", "CTranslate2's")):
        try:
            ours, theirs = read(f"nmt.beam{beams}.txt"), read(f"{peer}.beam{beams}.txt")
        except FileNotFoundError:
            continue
        same = sum(o == t for o, t in zip(ours, theirs))
        print(f"beam {beams}: nmt output equals {name} on {same}/{len(theirs)} lines ({100 * same / len(theirs):.1f} %)")
if "ct2_error" in peers: print("CTranslate2 failed:", peers["ct2_error"])
PY
