#!/usr/bin/env bash
# nmt serve under load, on loopback: clients (examples/serve_load.rs: one keep-alive connection
# each, all on one thread, so that the load takes little of the CPU it shares with the server)
# send single sentences of test_2016_flickr.de concurrently, 1, 8, 32 and 128 of them;
# prints sentences/s and p50/p99 latency per level next to `nmt translate`'s offline
# throughput (batch 64) and its single-sentence decode time on the same lines and model (each
# round runs the offline translation once and every level once, and each side counts its best
# round, so that a busy spell of a shared machine lands on both alike);
# checks that the libretranslatepy client gets `nmt translate`'s translations; then a soak
# run at 32 clients with the server's resident memory sampled every 10 s.
#   PEERS_PYTHON=/tmp/peers/bin/python scripts/bench-serve.sh MODEL [--data DIR] [--seconds S] [--rounds R] [--soak-minutes M]
# MODEL: a de→en model as `nmt translate --model` takes it (e.g. an nmt run on Multi30k, or
# the hf/ output of ../shared/peers/torch_marian_ref.py). libretranslatepy installs from PyPI.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PEERS_PYTHON:-/tmp/peers/bin/python}
model=${1:?usage: $0 MODEL [--data DIR] [--seconds S] [--rounds R] [--soak-minutes M]}; shift
data="" seconds=20 soak=5 rounds=3
while [ $# -gt 0 ]; do
  case "$1" in
    --data) data=$2; shift 2 ;; --seconds) seconds=$2; shift 2 ;; --soak-minutes) soak=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
data=$("$root/scripts/find-multi30k.sh" "$data")
cd "$root"; cargo build --release --quiet --bin nmt --example serve_load
nmt=$root/target/release/nmt load=$root/target/release/examples/serve_load
"$root/scripts/cpu-info.sh"
work=$(mktemp -d)
server=""
trap '[ -n "$server" ] && kill "$server" 2>/dev/null; rm -rf "$work"' EXIT
zcat -f "$data/test_2016_flickr.de.gz" > "$work/src.de"
head -n 200 "$work/src.de" > "$work/few.de"
export RAYON_NUM_THREADS=2
now() { date +%s.%N; }
# Offline: the whole file in batches of 64 (once per round, below), and 200 lines one at a
# time (start-up, measured on one word, subtracted from both; each the best of three runs).
best() { "$py" -c "import sys; print(min(float(x) for x in sys.argv[1:]))" "$@"; }
run_s() { local t0 t1; t0=$(now); "$@" > /dev/null; t1=$(now); "$py" -c "print($t1 - $t0)"; }
start=$(best $(for _ in 1 2 3; do echo Hallo | run_s $nmt translate --model "$model"; done))
one=$(best $(for _ in 1 2 3; do run_s $nmt translate --model "$model" --batch-size 1 --maxi-batch 1 < "$work/few.de"; done))
single_ms=$("$py" -c "print(round(1e3 * ($one - $start) / 200, 1))")
$nmt translate --model "$model" < "$work/src.de" > "$work/offline.en"

$nmt serve --model "de-en=$model" --port 0 2> "$work/serve.log" &
server=$!
for _ in $(seq 100); do grep -q "listening on" "$work/serve.log" && break; sleep 0.2; done
url=$(sed -n 's/^listening on \(http:[^ ]*\).*/\1/p' "$work/serve.log")
echo "server: $url (pid $server)"

"$py" - "$url" "$work/few.de" "$work/offline.en" <<'PY'
import sys
from libretranslatepy import LibreTranslateAPI
url, src, offline = sys.argv[1:]
lt = LibreTranslateAPI(url + "/")
lines = open(src, encoding="utf-8").read().split("\n")[:20]
want = open(offline, encoding="utf-8").read().split("\n")[:20]
got = [lt.translate(l, "de", "en") for l in lines]
same = sum(g == w for g, w in zip(got, want))
print(f"libretranslatepy: {same}/{len(lines)} translations equal nmt translate's; languages: {lt.languages()}")
PY

# Each round: the offline translation once, then every client level once.
: > "$work/batch.s"
for r in $(seq "$rounds"); do
  run_s $nmt translate --model "$model" --batch-size 64 < "$work/src.de" >> "$work/batch.s"
  for c in 1 8 32 128; do
    "$load" "$url" "$work/src.de" --clients "$c" --seconds "$seconds" > "$work/load.$c.$r.json"
  done
done
batch=$(best $(cat "$work/batch.s"))
offline=$("$py" -c "print(round($(wc -l < "$work/src.de") / ($batch - $start), 1))")
echo "offline nmt translate: $offline sentences/s at batch 64 (best of $rounds rounds); one sentence at a time: $single_ms ms each"
echo "clients  sentences/s  vs offline  p50 ms  p99 ms  errors   (each level: its best of $rounds rounds; errors: all rounds)"
for c in 1 8 32 128; do
  "$py" - "$offline" "$single_ms" "$work"/load.$c.*.json <<'PY'
import json, sys
offline, single = float(sys.argv[1]), float(sys.argv[2])
runs = [json.load(open(f)) for f in sys.argv[3:]]
r = max(runs, key=lambda r: r["sent_per_s"])
errors = sum(x["errors"] for x in runs)
note = f"  (p50 = {r['p50_ms'] / single:.2f}x one-sentence decode)" if r["clients"] == 1 else ""
print(f"{r['clients']:>7}  {r['sent_per_s']:>11}  {r['sent_per_s'] / offline:>9.2f}x  {r['p50_ms']:>6}  {r['p99_ms']:>6}  {errors:>6}{note}")
for x in runs:
    if x["errors"]:
        print("   first error:", x["first_error"])
        break
PY
done

if [ "$soak" != 0 ]; then
  "$load" "$url" "$work/src.de" --clients 32 --seconds "$((soak * 60))" --pid "$server" > "$work/soak.json"
  "$py" - "$work/soak.json" "$soak" <<'PY'
import json, sys
r = json.load(open(sys.argv[1])); rss = [k / 1024 for k in r["rss_kb"]]
print(f"soak, {sys.argv[2]} min at 32 clients: {r['sentences']} sentences, {r['sent_per_s']}/s, {r['errors']} errors; "
      f"server RSS MB first {rss[0]:.0f}, last {rss[-1]:.0f}, max {max(rss):.0f}")
PY
fi
kill -TERM "$server"
if wait "$server"; then echo "server: exit 0 after SIGTERM; $(tail -1 "$work/serve.log")"; else echo "server: exit $? after SIGTERM"; fi
server=""
