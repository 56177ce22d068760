#!/usr/bin/env bash
# Decoding speed and parity on the same weights: nmt (its default workers), transformers
# `generate` and CTranslate2 (2 threads, in whichever of its thread layouts is faster: one
# translator on both, or two side by side), greedy and beam 5, batch 64, over test_2016_flickr.de, in float32 and in int8
# (nmt --compute-type int8; CTranslate2's int8 and int8_float32); prints the CPU, sentences/s
# (best of --rounds runs, nmt and CTranslate2 alternating, each peer in a process of its own;
# nmt also with its start-up subtracted, as the peers' timings leave out loading), the speed
# ratios, nmt's peak RSS, BLEU of each output, and the share of lines where nmt's output
# equals each peer's and its int8 output its float32 output; then int8's BLEU and agreement
# again at nmt's default length limit.
#   PEERS_PYTHON=/tmp/peers/bin/python scripts/bench-translate.sh HF_MODEL_DIR [--data DIR] [--lines N] [--rounds R]
# HF_MODEL_DIR: an HF Marian folder, e.g. the hf/ output of ../shared/peers/torch_marian_ref.py.
# With NMT_CPU_ISA=avx2, nmt runs its AVX2 kernels and CTranslate2 is capped at AVX2 too: an
# AVX2-only CPU's comparison, taken on a wider one. With NMT_CPU_ISA=avx_vnni, nmt's int8
# kernel runs 256-bit VNNI (an AVX-VNNI CPU's) and CTranslate2 is capped at AVX2 and oneDNN's
# AVX2_VNNI, which oneDNN uses only where the CPU reports AVX-VNNI: on a CPU without it the
# script says that CTranslate2's int8 ran plain AVX2, and the int8 ratio is nmt's side only.
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
zcat -f "$data/test_2016_flickr.en.gz" | head -n "$lines" > "$work/ref.en"
export OMP_NUM_THREADS=2 RAYON_NUM_THREADS=2
# NMT_CPU_ISA=avx2 (nmt's AVX2 kernels on a wider CPU) caps CTranslate2 alike: its own
# kernels, and the oneDNN and MKL products it calls, which read caps of their own.
case "${NMT_CPU_ISA:-}" in
  avx2)
    export CT2_FORCE_CPU_ISA=${CT2_FORCE_CPU_ISA:-AVX2} ONEDNN_MAX_CPU_ISA=${ONEDNN_MAX_CPU_ISA:-AVX2}
    export MKL_ENABLE_INSTRUCTIONS=${MKL_ENABLE_INSTRUCTIONS:-AVX2} ;;
  avx_vnni | avxvnni)
    export CT2_FORCE_CPU_ISA=${CT2_FORCE_CPU_ISA:-AVX2} ONEDNN_MAX_CPU_ISA=${ONEDNN_MAX_CPU_ISA:-AVX2_VNNI}
    export MKL_ENABLE_INSTRUCTIONS=${MKL_ENABLE_INSTRUCTIONS:-AVX2_E1} ;;
esac
"$root/scripts/cpu-info.sh"
if [[ "${NMT_CPU_ISA:-}" = avx*vnni ]] && ! grep -qw avx_vnni /proc/cpuinfo; then
  echo "note: this CPU has no AVX-VNNI: nmt runs its 256-bit VNNI kernel in AVX-512 VNNI's encoding," \
    "CTranslate2's int8 runs plain AVX2 (oneDNN needs the AVX-VNNI bit): its int8 rows understate" \
    "CTranslate2 on a real AVX-VNNI CPU"
fi
peer() { "$py" "$root/scripts/decode-peers.py" "$model" "$work/src.de" "$work" --engine "$1" --threads 2 --batch 64 --max-new-tokens 128 "${@:2}" 2>/dev/null | tail -1; }
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
  for ct in float32 int8; do
    for beam in 1 5; do
      t=$(secs "$work/src.de" "$work/nmt-$ct.beam$beam.txt" /usr/bin/time -o "$work/rss" -f %M $nmt translate --model "$model" --beam "$beam" --batch-size 64 --max-len-a 0 --max-len-b 128 --compute-type $ct)
      echo "{\"nmt-${ct}_beam${beam}_sent_per_s\": $("$py" -c "print(round($lines / $t, 1))"), \"nmt-${ct}_beam${beam}_decode_sent_per_s\": $("$py" -c "print(round($lines / ($t - ${startup[$beam]}), 1))"), \"nmt-${ct}_beam${beam}_rss_mb\": $(($(cat "$work/rss") / 1024))}" >> "$work/rates"
    done
  done
  for ct in float32 int8 int8_float32; do peer ct2 --compute-type $ct >> "$work/rates"; done
done
peer hf >> "$work/rates"  # transformers is slow: one run
# int8's fidelity also at nmt's own length limit (1.5 · source length + 10 tokens, what
# `nmt translate` does by default): under the peers' 128-token cap above, a briefly trained
# model's repetition loops run on to 128 tokens, and where float32's and int8's loops differ
# they move BLEU by a few tenths either way.
for ct in float32 int8; do
  for beam in 1 5; do
    $nmt translate --model "$model" --beam "$beam" --batch-size 64 --compute-type $ct < "$work/src.de" > "$work/nmt-$ct.beam$beam.default.txt"
  done
done
for f in "$work"/*.beam?.txt "$work"/*.beam?.default.txt; do
  echo "{\"bleu_$(basename "$f" .txt)\": $($nmt eval --ref "$work/ref.en" --hyp "$f" --metrics bleu --json | "$py" -c "import json,sys; print(json.load(sys.stdin)[0]['score'])")}" >> "$work/rates"
done
"$py" - "$work" <<'PY'
import json, sys
work = sys.argv[1]
m = {}
for line in open(f"{work}/rates"):
    d = json.loads(line)
    for k, v in d.items():
        if k.endswith("_layout"):
            continue
        if isinstance(v, float) and "rss" not in k:
            if v >= m.get(k, 0):
                m[k] = v
                layout = k.replace("_sent_per_s", "_layout")
                if layout in d:
                    m[layout] = d[layout]
        else:
            m[k] = v
read = lambda n: open(f"{work}/{n}", encoding="utf-8").read().split("\n")[:-1]
print("sentences/s; nmt: whole process (start-up, model load, decoding), then decoding only")
print("(start-up subtracted; the peers' timings cover decoding only)")
print(f"{'':22} {'nmt':>8} {'transformers':>13} {'CTranslate2':>12}   nmt/transformers  nmt/CT2")
for beams in (1, 5):
    hf, ct = m.get(f"hf_beam{beams}_sent_per_s"), m.get(f"ct2_beam{beams}_sent_per_s")
    for how, key in (("", "sent_per_s"), (" decoding", "decode_sent_per_s")):
        rate = m[f"nmt-float32_beam{beams}_{key}"]
        print(f"{f'beam {beams}{how}':<22} {rate:>8.1f} {hf or 0:>13.1f} {ct or 0:>12.1f}   {rate / hf if hf else 0:>16.2f}  {rate / ct if ct else 0:>7.2f}")
print("CTranslate2's faster thread layout (translators x threads each): " + ", ".join(
    f"{ct} beam {b} {m[f'{ct}_beam{b}_layout']}" for ct in ("ct2", "ct2_int8", "ct2_int8_float32")
    for b in (1, 5) if f"{ct}_beam{b}_layout" in m))
print("\nint8 (nmt --compute-type int8; CTranslate2 int8 and int8_float32), sentences/s")
print(f"{'':22} {'nmt int8':>9} {'CT2 int8':>9} {'CT2 i8_f32':>11}  vs faster CT2  vs nmt float32")
for beams in (1, 5):
    ct2 = max(m.get(f"ct2_int8_beam{beams}_sent_per_s", 0), m.get(f"ct2_int8_float32_beam{beams}_sent_per_s", 0))
    for how, key in (("", "sent_per_s"), (" decoding", "decode_sent_per_s")):
        rate, f32 = m[f"nmt-int8_beam{beams}_{key}"], m[f"nmt-float32_beam{beams}_{key}"]
        print(f"{f'beam {beams}{how}':<22} {rate:>9.1f} {m.get(f'ct2_int8_beam{beams}_sent_per_s', 0):>9.1f} "
              f"{m.get(f'ct2_int8_float32_beam{beams}_sent_per_s', 0):>11.1f}  {rate / ct2 if ct2 else 0:>13.2f}  {rate / f32:>14.2f}")
for beams in (1, 5):
    print(f"beam {beams}: nmt peak RSS float32 {m[f'nmt-float32_beam{beams}_rss_mb']} MB, int8 {m[f'nmt-int8_beam{beams}_rss_mb']} MB")
print("\nBLEU (test_2016_flickr, these lines):")
for beams in (1, 5):
    print(f"beam {beams}: " + ", ".join(f"{n} {m[f'bleu_{f}.beam{beams}']:.2f}" for n, f in (
        ("nmt float32", "nmt-float32"), ("nmt int8", "nmt-int8"), ("CT2 float32", "ct2"), ("CT2 int8", "ct2-int8"),
        ("CT2 int8_float32", "ct2-int8_float32"), ("transformers", "hf")) if f"bleu_{f}.beam{beams}" in m))
for beams in (1, 5):
    for ours, theirs, name in (("nmt-float32", "hf", "nmt float32 equals transformers'"),
                               ("nmt-float32", "ct2", "nmt float32 equals CTranslate2's"),
                               ("nmt-int8", "nmt-float32", "nmt int8 equals nmt float32's"),
                               ("ct2-int8", "ct2", "CT2 int8 equals CT2 float32's")):
        try:
            a, b = read(f"{ours}.beam{beams}.txt"), read(f"{theirs}.beam{beams}.txt")
        except FileNotFoundError:
            continue
        same = sum(o == t for o, t in zip(a, b))
        print(f"beam {beams}: {name} on {same}/{len(b)} lines ({100 * same / len(b):.1f} %)")
print("\nat nmt's default length limit (1.5 · source + 10 tokens) instead of the peers' 128:")
for beams in (1, 5):
    a, b = read(f"nmt-int8.beam{beams}.default.txt"), read(f"nmt-float32.beam{beams}.default.txt")
    same = sum(o == t for o, t in zip(a, b))
    print(f"beam {beams}: BLEU nmt float32 {m[f'bleu_nmt-float32.beam{beams}.default']:.2f}, "
          f"nmt int8 {m[f'bleu_nmt-int8.beam{beams}.default']:.2f}; "
          f"nmt int8 equals nmt float32's on {same}/{len(b)} lines ({100 * same / len(b):.1f} %)")
for k in ("ct2_error",):
    if k in m: print("CTranslate2 failed:", m[k])
PY
