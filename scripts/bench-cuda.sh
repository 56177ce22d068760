#!/usr/bin/env bash
# The CUDA checks, on a machine with an NVIDIA GPU, for a CUDA build of nmt
# (scripts/build-cuda.sh --tests, then carry target/cuda/release/{nmt,nmt-cuda-tests} there):
#   tests  CPU and GPU logits on the fixtures agree (nmt-cuda-tests: f32 <= 1e-4, bf16 <= 2e-2
#          relative) and incremental decoding on the GPU equals the full pass
#   speed  target tokens/s of `nmt train --device cuda` (f32, then bf16) and of the PyTorch
#          yardstick (../shared/peers/torch_marian_ref.py --device cuda) on the same configuration
#          (data/configs/yardstick.json: vocab 8000, d_model 256, 3+3 layers, FFN 1024, batches of
#          <= 4096 tokens), Multi30k de->en, alternating rounds; medians over steps after the 10th;
#          then where an nmt step's time goes (NMT_PROFILE=1: forward, backward, optimizer);
#          with --baseline, another CUDA build of nmt runs f32 in every round too (A/B)
#   census kernel launches and GPU time of one training step, by kind (ncu over 2 and 3 steps,
#          the difference; needs ncu, looked for in PATH and /usr/local/cuda/bin)
#   agree  trains data/configs/multi30k.json on the GPU for --minutes, translates
#          test_2016_flickr greedy and beam 5 on the GPU and on the CPU, and prints the share of
#          identical lines and each BLEU
#
#   scripts/bench-cuda.sh --nmt BIN --data DIR [--tests BIN] [--baseline BIN] [--peer FILE]
#                         [--python PY] [--steps N] [--rounds R] [--minutes M]
#                         [--stages tests,speed,census,agree] [--out DIR]
#
# cuBLAS and cuRAND are looked for in the Python install's nvidia/*/lib folders (PyTorch's
# wheels) unless LD_LIBRARY_PATH already finds them.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/cpu-info.sh"
nmt="" tests="" baseline="" data="" peer=$root/../shared/peers/torch_marian_ref.py py=${PEERS_PYTHON:-python3}
steps=200 rounds=2 minutes=3 stages=tests,speed,agree out=""
while [ $# -gt 0 ]; do
  case "$1" in
    --nmt) nmt=$2; shift 2 ;; --tests) tests=$2; shift 2 ;; --data) data=$2; shift 2 ;;
    --baseline) baseline=$2; shift 2 ;;
    --peer) peer=$2; shift 2 ;; --python) py=$2; shift 2 ;; --steps) steps=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;; --minutes) minutes=$2; shift 2 ;; --stages) stages=$2; shift 2 ;;
    --out) out=$2; shift 2 ;; *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
[ -x "$nmt" ] || { echo "error: --nmt must name a CUDA build of nmt" >&2; exit 2; }
data=$("$root/scripts/find-multi30k.sh" "$data") || exit 2
out=${out:-$(mktemp -d)}; mkdir -p "$out"
has() { case ",$stages," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }
libs=$("$py" - <<'PY'
import glob, os
try:
    import nvidia
    print(":".join(sorted({os.path.dirname(p) for base in nvidia.__path__
                           for p in glob.glob(os.path.join(base, "**", "libcublas.so*"), recursive=True)
                                  + glob.glob(os.path.join(base, "**", "libcurand.so*"), recursive=True)})))
except ImportError:
    pass
PY
)
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$libs"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | sed 's/^/GPU: /'
median() { "$py" -c "import statistics,sys; v=[float(x) for x in sys.stdin.read().split() if x.replace('.', '', 1).isdigit()]; print(round(statistics.median(v)) if v else 'n/a')"; }
nmt_rate() { "$py" -c "import json; [print(json.loads(l)['tok_s']) for l in open('$1') if '\"tok_s\"' in l and json.loads(l)['step'] > 10]" | median; }

if has tests && [ -n "$tests" ]; then
  echo "== tests: CPU/GPU logits and incremental decoding on the GPU"
  (cd "$root" && NMT_REQUIRE_CUDA=1 "$tests" --test-threads 1 --nocapture 2>&1) | grep -E "relative|^test |test result|panicked"
fi

tok=$out/tok8000.json
if has speed || has agree || has census; then
  "$nmt" tokenize train --input "$data/train.de.gz" --input "$data/train.en.gz" --vocab-size 8000 --output "$tok" 2>/dev/null
  "$py" -c "import json; c=json.load(open('$root/data/configs/yardstick.json')); c.update(log_every=1, valid_every=10**9); json.dump(c, open('$out/speed.json','w'))"
fi

if has speed; then
  echo "== speed: target tokens/s on the GPU, $steps steps, yardstick configuration"
  printf '%-6s %-14s %12s\n' round system "tgt tok/s"
  f32=() bf16=() torch=() base=()
  for r in $(seq "$rounds"); do
    for run in ${baseline:+baseline} f32 bf16; do
      bin=$nmt dt=$run
      [ "$run" = baseline ] && bin=$baseline dt=f32
      rm -rf "$out/speed-$run"
      if "$bin" train --src "$data/train.de.gz" --tgt "$data/train.en.gz" --tokenizer "$tok" --config "$out/speed.json" \
          --device cuda --dtype "$dt" --max-steps "$steps" --out "$out/speed-$run" 2> "$out/speed-$run.log"; then
        rate=$(nmt_rate "$out/speed-$run/metrics.jsonl")
      else
        rate=failed; tail -3 "$out/speed-$run.log"
      fi
      case $run in baseline) base+=("$rate") ;; f32) f32+=("$rate") ;; *) bf16+=("$rate") ;; esac
      printf '%-6s %-14s %12s\n' "$r" "nmt $run" "$rate"
    done
    rm -rf "$out/peer"
    PYTHONUNBUFFERED=1 "$py" "$peer" --data "$data" --src de --tgt en --device cuda --max-tokens 4096 \
      --tokens $(( steps * 4096 * 6 / 10 )) --minutes 30 --decode-limit 1 --out "$out/peer" > "$out/peer.log" 2>&1
    rate=$("$py" -c "import json; print(json.load(open('$out/peer/result.json'))['train_tgt_tok_per_s_median'])" 2>/dev/null || echo failed)
    torch+=("$rate"); printf '%-6s %-14s %12s\n' "$r" "pytorch f32" "$rate"
    [ "$rate" = failed ] && tail -5 "$out/peer.log"
  done
  rm -rf "$out/profile"
  NMT_PROFILE=1 "$nmt" train --src "$data/train.de.gz" --tgt "$data/train.en.gz" --tokenizer "$tok" --config "$out/speed.json" \
    --device cuda --max-steps 60 --out "$out/profile" 2> "$out/profile.log" \
    && "$py" - "$out/profile/metrics.jsonl" <<'PY'
import json, statistics, sys
rows = [r for r in map(json.loads, open(sys.argv[1])) if "forward_ms" in r and r["step"] > 10]
med = lambda k: statistics.median(r[k] for r in rows)
print(f"nmt f32 step, device synchronised after each phase (NMT_PROFILE=1): forward {med('forward_ms'):.1f} ms, "
      f"backward {med('backward_ms'):.1f} ms, optimizer {med('optimizer_ms'):.1f} ms")
PY
  m() { printf '%s\n' "$@" | median; }
  "$py" - "$(m "${f32[@]}")" "$(m "${bf16[@]}")" "$(m "${torch[@]}")" "$(m "${base[@]:-n/a}")" <<'PY'
import sys
f32, bf16, torch, base = sys.argv[1:]
ratio = lambda a, b=torch: f"{float(a) / float(b):.2f}x" if "n/a" not in (a, b) else "n/a"
print(f"medians: nmt f32 {f32} tok/s ({ratio(f32)} PyTorch), nmt bf16 {bf16} tok/s ({ratio(bf16)}), PyTorch f32 {torch} tok/s")
if base != "n/a":
    print(f"baseline build f32 {base} tok/s ({ratio(base)} PyTorch); this build / baseline: {ratio(f32, base)}")
PY
fi

if has census; then
  echo "== census: kernel launches and GPU time of one training step (ncu: 3 steps minus 2)"
  ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  for n in 2 3; do
    rm -rf "$out/census"
    "$ncu" --metrics gpu__time_duration.sum --csv "$nmt" train --src "$data/train.de.gz" --tgt "$data/train.en.gz" \
      --tokenizer "$tok" --config "$out/speed.json" --device cuda --max-steps "$n" --out "$out/census" \
      > "$out/ncu$n.csv" 2> "$out/ncu.log" || { echo "ncu failed:"; tail -3 "$out/ncu.log"; }
  done
  "$py" - "$out/ncu2.csv" "$out/ncu3.csv" <<'PY'
import collections, csv, sys
def load(path):
    rows = [r for r in csv.reader(open(path)) if len(r) > 10]
    if not rows:
        return {}
    head, rows = rows[0], rows[1:]
    k, v, u = head.index("Kernel Name"), head.index("Metric Value"), head.index("Metric Unit")
    scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}
    total = collections.defaultdict(lambda: [0, 0.0])
    for r in rows:
        name = r[k].split("(")[0][:70]
        total[name][0] += 1
        total[name][1] += float(r[v].replace(",", "")) * scale.get(r[u], 1.0)  # microseconds
    return total
two, three = load(sys.argv[1]), load(sys.argv[2])
step = {n: [c - two.get(n, [0, 0])[0], t - two.get(n, [0, 0])[1]] for n, (c, t) in three.items()}
print(f"one step: {sum(c for c, _ in step.values())} launches, {sum(t for _, t in step.values()) / 1e3:.2f} ms of kernel time (ncu flushes caches between kernels: times are inflated, counts exact)")
for name, (c, t) in sorted(step.items(), key=lambda x: -x[1][1])[:30]:
    print(f"{c:6d} {t / 1e3:8.3f} ms  {name}")
PY
fi

if has agree; then
  echo "== agree: data/configs/multi30k.json trained on the GPU for $minutes min, then test_2016_flickr on GPU and CPU"
  rm -rf "$out/model"
  start=$(date +%s)
  "$nmt" train --src "$data/train.de.gz" --tgt "$data/train.en.gz" --valid-src "$data/val.de.gz" --valid-tgt "$data/val.en.gz" \
    --tokenizer "$tok" --config "$root/data/configs/multi30k.json" --device cuda \
    --max-time "${minutes}m" --out "$out/model" 2> "$out/agree-train.log" || { tail -5 "$out/agree-train.log"; exit 1; }
  last=$(tail -n 1 "$out/model/metrics.jsonl")
  echo "trained $(( $(date +%s) - start )) s; last record: $last"
  grep '"val_bleu"' "$out/model/metrics.jsonl" | "$py" -c "import json,sys; print('validation BLEU by step:', ', '.join(f\"{r['step']}: {r['val_bleu']:.2f}\" for r in map(json.loads, sys.stdin)))"
  for beam in 1 5; do
    for dev in cuda cpu; do
      s=$(date +%s.%N)
      zcat "$data/test_2016_flickr.de.gz" | "$nmt" translate --model "$out/model/best" --beam "$beam" --device "$dev" \
        > "$out/test.beam$beam.$dev.en" 2> "$out/translate.log" || { tail -3 "$out/translate.log"; continue; }
      e=$(date +%s.%N)
      bleu=$("$nmt" eval --ref "$data/test_2016_flickr.en.gz" --hyp "$out/test.beam$beam.$dev.en" --json \
        | "$py" -c "import json,sys; print(round(json.load(sys.stdin)[0]['score'], 2))")
      echo "beam $beam on $dev: BLEU $bleu, $("$py" -c "print(f'{1000 / ($e - $s):.0f}')") sentences/s"
    done
    "$py" - "$out/test.beam$beam.cuda.en" "$out/test.beam$beam.cpu.en" "$beam" <<'PY'
import sys
a, b = (open(p, encoding="utf-8").read().split("\n") for p in sys.argv[1:3])
same = sum(x == y for x, y in zip(a, b)) - 1  # both end with a newline
print(f"beam {sys.argv[3]}: GPU and CPU translations identical on {same}/{len(a) - 1} lines ({100 * same / (len(a) - 1):.1f}%)")
PY
  done
fi
