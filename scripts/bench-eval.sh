#!/usr/bin/env bash
# Scoring speed: BLEU and chrF of N hypothesis/reference pairs (default 1,000,000, built from
# Multi30k train.en with words dropped) with nmt eval and with the sacrebleu command line in one
# run; checks that both print the same scores.
#   PEERS_PYTHON=/tmp/peers/bin/python scripts/bench-eval.sh [--data DIR] [--lines N]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/cpu-info.sh"
py=${PEERS_PYTHON:-/tmp/peers/bin/python}
data="" lines=1000000
while [ $# -gt 0 ]; do
  case "$1" in --data) data=$2; shift 2 ;; --lines) lines=$2; shift 2 ;; *) echo "unknown option $1" >&2; exit 2 ;; esac
done
data=$("$root/scripts/find-multi30k.sh" "$data")
cd "$root"; cargo build --release --quiet
nmt=$root/target/release/nmt
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
zcat "$data/train.en.gz" > "$work/one"
awk -v n="$lines" '{ a[NR] = $0 } END { for (i = 0; i < n; i++) print a[i % NR + 1] }' "$work/one" > "$work/ref"
awk '{ out = ""; for (i = 1; i <= NF; i++) if ((i + NR) % 4) out = out (out == "" ? "" : " ") $i; print out }' "$work/ref" > "$work/hyp"
t() { local s e; s=$(date +%s.%N); "$@" > "$work/out.$2" 2>/dev/null; e=$(date +%s.%N); "$py" -c "print(round($e - $s, 2))"; }
for metric in bleu chrf; do
  ours=$(t $nmt eval --metrics "$metric" --ref "$work/ref" --hyp "$work/hyp")
  cp "$work/out.eval" "$work/nmt.$metric"
  theirs=$(t "$py" -m sacrebleu "$work/ref" -i "$work/hyp" -m "$metric" -w 2 -f text)
  cp "$work/out.-m" "$work/sb.$metric"
  s1=$(awk '{print $3}' "$work/nmt.$metric"); s2=$(awk -F' = ' '{print $2}' "$work/sb.$metric" | awk '{print $1}')
  echo "$metric on $lines pairs: nmt ${ours}s, sacreBLEU ${theirs}s, speed-up $("$py" -c "print(round($theirs / $ours, 1))")x; scores nmt $s1, sacreBLEU $s2 $([ "$s1" = "$s2" ] && echo '(equal)' || echo '(DIFFER)')"
done
