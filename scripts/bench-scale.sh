#!/usr/bin/env bash
# Real-size corpora: synthetic corpora built from Multi30k de-en (repeated; every copy after
# the first lightly perturbed: adjacent words swapped, numbers appended, so lines differ) at
# several sizes (with --novel-words, one word of each side of every copied line also gets a
# random six-digit suffix, so that most lines hold a word never seen before: the worst case
# for the tokenizer's word cache), and for each: `nmt prepare` time and pairs/s, store size, the time from
# starting `nmt train --data STORE` to the end of its first step, the same for a `--resume`,
# and peak memory. With --baseline OLD_NMT (a build from before prepared corpora), also that
# binary's in-memory `nmt train --src --tgt` at the sizes up to --baseline-max.
#
# Memory: "anon" is the peak of RssAnon sampled every 50 ms from /proc/PID/status (the
# process's own memory), "total" is VmHWM (anon plus the pages of mapped files that were
# touched: the memory-mapped store's pages are shared page cache the kernel can drop).
#
#   scripts/bench-scale.sh [--data DIR] [--sizes 0.29,4.5,45] [--work /tmp/nmt-scale]
#                          [--baseline OLD_NMT] [--baseline-max 0.29] [--novel-words] [--keep]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
data="" sizes="0.29,4.5,45" work=/tmp/nmt-scale baseline="" baseline_max=0.29 keep=0 novel=0
while [ $# -gt 0 ]; do
  case "$1" in
    --data) data=$2; shift 2 ;; --sizes) sizes=$2; shift 2 ;; --work) work=$2; shift 2 ;;
    --baseline) baseline=$2; shift 2 ;; --baseline-max) baseline_max=$2; shift 2 ;;
    --keep) keep=1; shift ;; --novel-words) novel=1; shift ;; *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
data=$("$root/scripts/find-multi30k.sh" "$data")
cd "$root"; cargo build --release --quiet
nmt=$root/target/release/nmt
mkdir -p "$work"
"$root/scripts/cpu-info.sh"
echo "disk: $(df -h "$work" | tail -1 | awk '{print $4 " free of " $2}') under $work"

# A given tokenizer (as a user with a vocabulary would have) and the yardstick model.
[ -s "$work/tok.json" ] || "$nmt" tokenize train --input "$data/train.de.gz" --input "$data/train.en.gz" \
  --vocab-size 8000 --output "$work/tok.json" 2>/dev/null
printf '{"max_tokens": 4096, "log_every": 1, "valid_every": 1000000}\n' > "$work/cfg.json"

# run_measured CMD...: runs CMD, sets $wall (s), $anon and $total (peak MB).
run_measured() {
  local start end pid a h peak_anon=0 total_kb=0
  start=$(date +%s.%N)
  "$@" > "$work/out.log" 2>&1 &
  pid=$!
  while kill -0 "$pid" 2>/dev/null; do
    a=$(awk '/^RssAnon/ {print $2}' "/proc/$pid/status" 2>/dev/null || true)
    [ -n "$a" ] && [ "$a" -gt "$peak_anon" ] && peak_anon=$a
    h=$(awk '/^VmHWM/ {print $2}' "/proc/$pid/status" 2>/dev/null || true)
    [ -n "$h" ] && total_kb=$h
    sleep 0.05
  done
  if ! wait "$pid"; then echo "failed: $*" >&2; tail -5 "$work/out.log" >&2; exit 1; fi
  end=$(date +%s.%N)
  wall=$(awk -v a="$start" -v b="$end" 'BEGIN { print b - a }')
  anon=$((peak_anon / 1024)); total=$((total_kb / 1024))
}

gen() {  # gen PAIRS_IN_MILLIONS -> $work/$c.{de,en}
  local size=$1 reps
  reps=$(awk -v s="$size" 'BEGIN { r = int(s * 1e6 / 29000 + 0.5); print (r < 1 ? 1 : r) }')
  [ -s "$work/$c.en" ] && return 0
  echo "building the $size M-pair corpus ($reps copies of Multi30k train)..." >&2
  paste -d $'\001' <(gzip -dc "$data/train.de.gz") <(gzip -dc "$data/train.en.gz") |
    awk -v reps="$reps" -v novel="$novel" -v outde="$work/$c.de.tmp" -v outen="$work/$c.en.tmp" '
      function mark(s,   w, n, j, out, x) {
        n = split(s, w, " "); if (n < 1) return s
        j = 1 + int(rand() * n); w[j] = w[j] int(rand() * 1000000)
        out = w[1]; for (x = 2; x <= n; x++) out = out " " w[x]; return out
      }
      function swap(s,   w, n, j, t, out, x) {
        n = split(s, w, " "); if (n < 2) return s
        j = 1 + int(rand() * (n - 1)); t = w[j]; w[j] = w[j + 1]; w[j + 1] = t
        out = w[1]; for (x = 2; x <= n; x++) out = out " " w[x]; return out
      }
      BEGIN { FS = "\001"; srand(7) }
      { de[NR] = $1; en[NR] = $2 }
      END {
        for (k = 1; k <= reps; k++) for (i = 1; i <= NR; i++) {
          d = de[i]; e = en[i]
          if (k > 1) {
            r = rand(); if (r < 0.3) d = swap(d); else if (r < 0.6) e = swap(e)
            if (rand() < 0.2) { n = int(rand() * 1000); d = d " (" n ")"; e = e " (" n ")" }
            if (novel) { d = mark(d); e = mark(e) }
          }
          print d > outde; print e > outen
        }
      }'
  mv "$work/$c.de.tmp" "$work/$c.de"; mv "$work/$c.en.tmp" "$work/$c.en"
}

printf '\n%-7s %-28s %9s %10s %9s %9s %9s %12s\n' "pairs" "what" "seconds" "pairs/s" "anon MB" "total MB" "store MB" "first step"
for size in ${sizes//,/ }; do
  c=c$size; [ "$novel" = 1 ] && c=novel$size
  gen "$size"
  lines=$(wc -l < "$work/$c.de")
  store=$work/store$size run=$work/run$size
  rm -rf "$store" "$run"
  run_measured "$nmt" prepare --src "$work/$c.de" --tgt "$work/$c.en" --tokenizer "$work/tok.json" --out "$store"
  store_mb=$(du -sm "$store" | cut -f1)
  printf '%-7s %-28s %9.1f %10.0f %9s %9s %9s %12s\n' "${size}M" "nmt prepare" "$wall" "$(awk -v n="$lines" -v w="$wall" 'BEGIN { print n / w }')" "$anon" "$total" "$store_mb" "-"
  run_measured "$nmt" train --data "$store" --config "$work/cfg.json" --out "$run" --max-steps 1
  data_s=$(grep -o '"data_s":[0-9.e-]*' "$run/metrics.jsonl" | cut -d: -f2)
  padding=$(grep -o '"padding":[0-9.e-]*' "$run/metrics.jsonl" | head -1 | cut -d: -f2)
  printf '%-7s %-28s %9.1f %10s %9s %9s %9s %12s\n' "${size}M" "train --data, 1 step" "$wall" "-" "$anon" "$total" "-" "$(printf '%.1f s' "$wall")"
  run_measured "$nmt" train --data "$store" --config "$work/cfg.json" --out "$run" --max-steps 2 --resume
  printf '%-7s %-28s %9.1f %10s %9s %9s %9s %12s\n' "${size}M" "train --resume, 1 step" "$wall" "-" "$anon" "$total" "-" "$(printf '%.1f s' "$wall")"
  echo "        (data ready in $(printf '%.2f' "$data_s") s of the first run; padding $(awk -v p="$padding" 'BEGIN { printf "%.1f", 100 * p }') % of batch tokens)"
  if [ -n "$baseline" ] && awk -v s="$size" -v m="$baseline_max" 'BEGIN { exit !(s <= m) }'; then
    rm -rf "$run.old"
    run_measured "$baseline" train --src "$work/$c.de" --tgt "$work/$c.en" --tokenizer "$work/tok.json" \
      --config "$work/cfg.json" --out "$run.old" --max-steps 1
    printf '%-7s %-28s %9.1f %10s %9s %9s %9s %12s\n' "${size}M" "baseline in-memory, 1 step" "$wall" "-" "$anon" "$total" "-" "$(printf '%.1f s' "$wall")"
    rm -rf "$run.old"
  fi
  rm -rf "$run"
  [ "$keep" = 1 ] || rm -rf "$store"
done
