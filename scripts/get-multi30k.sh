#!/usr/bin/env bash
# Download the Multi30k task-1 corpus (train, val, test_2016_flickr; en, de, fr, cs) from its
# public repository into DIR (default: data/multi30k). Files stay gzipped; nmt reads them as is.
set -euo pipefail
dir=${1:-data/multi30k}
base=https://raw.githubusercontent.com/multi30k/dataset/master/data/task1/raw
mkdir -p "$dir"
for split in train val test_2016_flickr; do
  for lang in en de fr cs; do
    f=$split.$lang.gz
    [ -s "$dir/$f" ] && continue
    echo "downloading $f" >&2
    curl -fsSL --retry 3 -o "$dir/$f.part" "$base/$f" && mv "$dir/$f.part" "$dir/$f"
  done
done
echo "$dir"
