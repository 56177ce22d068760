#!/usr/bin/env bash
# Print the Multi30k folder to use: $1 if given, else $NMT_MULTI30K, else ../shared/data/multi30k
# beside the checkout, else data/multi30k (downloading it there when missing).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
for d in "${1:-}" "${NMT_MULTI30K:-}" "$root/../shared/data/multi30k" "$root/data/multi30k"; do
  if [ -n "$d" ] && [ -s "$d/train.de.gz" ]; then echo "$d"; exit 0; fi
done
if [ -n "${1:-}" ]; then echo "error: $1 holds no Multi30k (train.de.gz missing)" >&2; exit 1; fi
"$root/scripts/get-multi30k.sh" "$root/data/multi30k"
