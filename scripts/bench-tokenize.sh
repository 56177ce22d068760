#!/usr/bin/env bash
# Tokenizer speed: train the 8,000-piece BPE on Multi30k de+en train and encode both files, with
# nmt and with Python `tokenizers` (the same HF library, through its Python binding) in one run.
#   PEERS_PYTHON=/tmp/peers/bin/python scripts/bench-tokenize.sh [--data DIR]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/cpu-info.sh"
py=${PEERS_PYTHON:-/tmp/peers/bin/python}
data=""; [ "${1:-}" = --data ] && data=$2
data=$("$root/scripts/find-multi30k.sh" "$data")
cd "$root"; cargo build --release --quiet
nmt=$root/target/release/nmt
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
zcat "$data/train.de.gz" > "$work/de"; zcat "$data/train.en.gz" > "$work/en"
t() { local s e; s=$(date +%s.%N); "$@"; e=$(date +%s.%N); "$py" -c "print(round($e - $s, 2))"; }
nmt_train=$(t $nmt tokenize train --input "$work/de" --input "$work/en" --vocab-size 8000 --output "$work/tok.json" 2>/dev/null)
nmt_enc=$(t sh -c "$nmt tokenize encode --ids --tokenizer $work/tok.json < $work/de > $work/de.ids && $nmt tokenize encode --ids --tokenizer $work/tok.json < $work/en > $work/en.ids")
"$py" - "$work" "$nmt_train" "$nmt_enc" <<'PY'
import sys, time
from tokenizers import Tokenizer, models, trainers, pre_tokenizers, decoders, normalizers
work, nt, ne = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
t = time.time()
tok = Tokenizer(models.BPE(unk_token="<unk>"))
tok.normalizer = normalizers.NFC(); tok.pre_tokenizer = pre_tokenizers.Metaspace(); tok.decoder = decoders.Metaspace()
tok.train([f"{work}/de", f"{work}/en"], trainers.BpeTrainer(vocab_size=8000, special_tokens=["</s>", "<unk>"], show_progress=False))
pt = time.time() - t
t = time.time()
for f in ("de", "en"):
    with open(f"{work}/{f}", encoding="utf-8") as fh, open(f"{work}/{f}.py.ids", "w") as out:
        for e in tok.encode_batch([l.rstrip("\n") for l in fh]):
            out.write(" ".join(map(str, e.ids)) + "\n")
pe = time.time() - t
print(f"{'':22} {'nmt':>8} {'python tokenizers':>18} {'ratio (python/nmt)':>19}")
print(f"{'train 8k BPE (s)':22} {nt:>8.2f} {pt:>18.2f} {pt / nt:>19.2f}")
print(f"{'encode de+en (s)':22} {ne:>8.2f} {pe:>18.2f} {pe / ne:>19.2f}")
PY
