#!/usr/bin/env bash
# The CUDA checks, on a machine with an NVIDIA GPU, for a CUDA build of nmt
# (scripts/build-cuda.sh --tests, then carry target/cuda/release/{nmt,nmt-cuda-tests} there):
#   tests  CPU and GPU logits on the fixtures agree (nmt-cuda-tests: f32 <= 1e-4, bf16 <= 2e-2,
#          f16 <= 1e-2 relative) and incremental decoding on the GPU equals the full pass
#   speed  target tokens/s and peak GPU memory of `nmt train --device cuda` in f32 and bf16 and of
#          the PyTorch yardstick (../shared/peers/torch_marian_ref.py --device cuda) in f32 and with
#          `--amp bf16` (torch.autocast), on the same model, Multi30k de->en, alternating rounds;
#          medians over steps after the 10th. --sizes picks the models: yardstick
#          (data/configs/yardstick.json: vocab 8000, d_model 256, 3+3 layers, FFN 1024, batches of
#          <= 4096 tokens, --steps) and base (data/configs/transformer-base.json: vocab 32000,
#          d_model 512, 6+6 layers, FFN 2048, batches of <= 16384 tokens, --base-steps); both
#          clip gradients at norm 1 as the peer does. Memory is the card's peak use above idle
#          (nvidia-smi every 0.2 s: CUDA context and allocator pools included, for both).
#          --f16 adds nmt in f16 to every round (with the steps its loss scaler skipped).
#          Then where an nmt step's time goes (NMT_PROFILE=1: forward, backward, optimizer);
#          with --baseline, another CUDA build of nmt runs f32 in every round too (A/B)
#   census kernel launches and GPU time of one training step, by kind (ncu over 2 and 3 steps,
#          the difference; needs ncu, looked for in PATH and /usr/local/cuda/bin)
#   agree  trains --agree-config [data/configs/multi30k.json] on the GPU in --agree-dtype [f32]
#          for --minutes, translates test_2016_flickr greedy and beam 5 on the GPU and on the
#          CPU, and prints the share of identical lines and each BLEU
#
#   scripts/bench-cuda.sh --nmt BIN --data DIR [--tests BIN] [--baseline BIN] [--peer FILE]
#                         [--python PY] [--steps N] [--rounds R] [--minutes M]
#                         [--sizes yardstick,base] [--base-steps N] [--f16] [--agree-config FILE]
#                         [--agree-dtype f32|bf16|f16] [--stages tests,speed,census,agree] [--out DIR]
#
# cuBLAS and cuRAND are looked for in the Python install's nvidia/*/lib folders (PyTorch's
# wheels) unless LD_LIBRARY_PATH already finds them.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/cpu-info.sh"
nmt="" tests="" baseline="" data="" peer=$root/../shared/peers/torch_marian_ref.py py=${PEERS_PYTHON:-python3}
steps=200 base_steps=100 sizes=yardstick rounds=2 minutes=3 stages=tests,speed,agree out=""
agree_config=$root/data/configs/multi30k.json agree_dtype=f32 f16=""
while [ $# -gt 0 ]; do
  case "$1" in
    --nmt) nmt=$2; shift 2 ;; --tests) tests=$2; shift 2 ;; --data) data=$2; shift 2 ;;
    --baseline) baseline=$2; shift 2 ;;
    --peer) peer=$2; shift 2 ;; --python) py=$2; shift 2 ;; --steps) steps=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;; --minutes) minutes=$2; shift 2 ;; --stages) stages=$2; shift 2 ;;
    --sizes) sizes=$2; shift 2 ;; --base-steps) base_steps=$2; shift 2 ;; --f16) f16=1; shift ;;
    --agree-config) agree_config=$2; shift 2 ;; --agree-dtype) agree_dtype=$2; shift 2 ;;
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

# The model sizes the speed stage measures: name, nmt config, the peer's flags, steps.
size_config() {
  case $1 in
    yardstick) echo "$root/data/configs/yardstick.json" ;;
    base) echo "$root/data/configs/transformer-base.json" ;;
    *) echo "error: --sizes takes yardstick and base" >&2; return 2 ;;
  esac
}
size_peer() {
  case $1 in
    yardstick) echo "--vocab 8000 --max-tokens 4096" ;;
    base) echo "--vocab 32000 --d-model 512 --layers 6 --heads 8 --ff 2048 --warmup 4000 --max-tokens 16384" ;;
  esac
}
speed_config() {  # SIZE: its config with every step logged, no validation, gradients clipped as the peer clips them
  "$py" -c "import json; c=json.load(open('$(size_config "$1")')); c.update(log_every=1, valid_every=10**9, clip_norm=1.0); json.dump(c, open('$out/speed-$1.json','w'))"
  echo "$out/speed-$1.json"
}
field() {  # FILE KEY: one value of a JSON file
  "$py" -c "import json, sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])" "$1" "$2"
}
tokenizer() {  # the joint BPE of the given size, trained once per run
  local t=$out/tok$1.json
  [ -s "$t" ] || "$nmt" tokenize train --input "$data/train.de.gz" --input "$data/train.en.gz" --vocab-size "$1" --output "$t" 2>/dev/null
  echo "$t"
}
# Peak GPU memory of one command, as nvidia-smi sees the whole card (the context, allocator
# pools and caches included, the same measure for nmt and PyTorch), less the idle level.
gpu_used() { nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null | head -n 1; }
idle_mb=$(gpu_used)
with_peak_memory() {  # FILE CMD...: runs CMD, writes the peak MiB above idle to FILE
  local file=$1; shift
  ( while :; do gpu_used; sleep 0.2; done ) > "$file.samples" 2>/dev/null &
  local sampler=$! rc=0
  "$@" || rc=$?
  kill "$sampler" 2>/dev/null; wait "$sampler" 2>/dev/null
  sort -n "$file.samples" | tail -n 1 | awk -v idle="${idle_mb:-0}" '{ print ($1 ~ /^[0-9]+$/) ? $1 - idle : "n/a" }' > "$file"
  return $rc
}

if has speed; then
  for size in ${sizes//,/ }; do
    config=$(size_config "$size") || exit 2
    vocab=$(field "$config" vocab_size) max_tokens=$(field "$config" max_tokens)
    n=$steps; [ "$size" = base ] && n=$base_steps
    tok=$(tokenizer "$vocab")
    speed=$(speed_config "$size")
    echo "== speed: $size ($(basename "$config"), batches of <= $max_tokens tokens), target tokens/s on the GPU, median of steps 11-$n; GPU memory: peak above idle (nvidia-smi)"
    printf '%-6s %-16s %12s %10s\n' round system "tgt tok/s" "GPU MiB"
    declare -A rates=() mems=()
    for r in $(seq "$rounds"); do
      for run in ${baseline:+baseline} f32 bf16 ${f16:+f16}; do
        bin=$nmt dt=$run
        [ "$run" = baseline ] && bin=$baseline dt=f32
        rm -rf "$out/speed-$run"
        if with_peak_memory "$out/mem" "$bin" train --src "$data/train.de.gz" --tgt "$data/train.en.gz" --tokenizer "$tok" \
            --config "$speed" --device cuda --dtype "$dt" --max-steps "$n" --out "$out/speed-$run" \
            2> "$out/speed-$size-$run.log"; then
          rate=$(nmt_rate "$out/speed-$run/metrics.jsonl")
        else
          rate=failed; tail -3 "$out/speed-$size-$run.log"
        fi
        rates[nmt-$run]+=" $rate"; mems[nmt-$run]+=" $(cat "$out/mem")"
        printf '%-6s %-16s %12s %10s' "$r" "nmt $run" "$rate" "$(cat "$out/mem")"
        [ "$run" = f16 ] && printf '  (%s steps skipped by the loss scaler)' \
          "$(grep -c '"overflow":true' "$out/speed-$run/metrics.jsonl" 2>/dev/null)"
        echo
      done
      for amp in none bf16; do
        rm -rf "$out/peer"
        # shellcheck disable=SC2046
        with_peak_memory "$out/mem" env PYTHONUNBUFFERED=1 "$py" "$peer" --data "$data" --src de --tgt en --device cuda \
          $(size_peer "$size") --amp "$amp" --tokens $(( n * max_tokens * 6 / 10 )) --minutes 30 --decode-limit 1 \
          --out "$out/peer" > "$out/peer-$size-$amp.log" 2>&1
        rate=$(field "$out/peer/result.json" train_tgt_tok_per_s_median 2>/dev/null || echo failed)
        name="pytorch ${amp/none/f32}"; [ "$amp" = bf16 ] && name="pytorch amp bf16"
        rates[$name]+=" $rate"; mems[$name]+=" $(cat "$out/mem")"
        printf '%-6s %-16s %12s %10s\n' "$r" "$name" "$rate" "$(cat "$out/mem")"
        [ "$rate" = failed ] && tail -5 "$out/peer-$size-$amp.log"
      done
    done
    m() { echo "$1" | median; }
    "$py" - "$size" "$(m "${rates[nmt-f32]}")" "$(m "${rates[nmt-bf16]}")" "$(m "${rates[pytorch f32]}")" \
      "$(m "${rates[pytorch amp bf16]}")" "$(m "${rates[nmt-baseline]:-n/a}")" \
      "$(m "${mems[nmt-f32]}")" "$(m "${mems[nmt-bf16]}")" "$(m "${mems[pytorch f32]}")" "$(m "${mems[pytorch amp bf16]}")" \
      "$(m "${rates[nmt-f16]:-n/a}")" "$(m "${mems[nmt-f16]:-n/a}")" <<'PY'
import sys
size, f32, bf16, torch, amp, base, mf32, mbf16, mtorch, mamp, f16, mf16 = sys.argv[1:]
ratio = lambda a, b: f"{float(a) / float(b):.2f}x" if "n/a" not in (a, b) and "failed" not in (a, b) else "n/a"
print(f"{size} medians: nmt f32 {f32} tok/s = {ratio(f32, torch)} PyTorch f32 ({torch}); "
      f"nmt bf16 {bf16} tok/s = {ratio(bf16, amp)} PyTorch AMP bf16 ({amp})")
print(f"{size} GPU memory (MiB, median peak): nmt f32 {mf32} vs PyTorch f32 {mtorch} ({ratio(mf32, mtorch)}); "
      f"nmt bf16 {mbf16} vs PyTorch AMP bf16 {mamp} ({ratio(mbf16, mamp)})")
if f16 != "n/a":
    print(f"{size} nmt f16 {f16} tok/s = {ratio(f16, amp)} PyTorch AMP bf16; GPU memory {mf16} MiB")
if base != "n/a":
    print(f"{size} baseline build f32 {base} tok/s; this build / baseline: {ratio(f32, base)}")
PY
    unset rates mems
  done
  rm -rf "$out/profile"
  NMT_PROFILE=1 "$nmt" train --src "$data/train.de.gz" --tgt "$data/train.en.gz" --tokenizer "$(tokenizer 8000)" \
    --config "$(speed_config yardstick)" \
    --device cuda --max-steps 60 --out "$out/profile" 2> "$out/profile.log" \
    && "$py" - "$out/profile/metrics.jsonl" <<'PY'
import json, statistics, sys
rows = [r for r in map(json.loads, open(sys.argv[1])) if "forward_ms" in r and r["step"] > 10]
med = lambda k: statistics.median(r[k] for r in rows)
print(f"nmt f32 step, yardstick, device synchronised after each phase (NMT_PROFILE=1): forward {med('forward_ms'):.1f} ms, "
      f"backward {med('backward_ms'):.1f} ms, optimizer {med('optimizer_ms'):.1f} ms")
PY
fi

if has census; then
  echo "== census: kernel launches and GPU time of one training step (ncu: 3 steps minus 2)"
  ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  for n in 2 3; do
    rm -rf "$out/census"
    "$ncu" --metrics gpu__time_duration.sum --csv "$nmt" train --src "$data/train.de.gz" --tgt "$data/train.en.gz" \
      --tokenizer "$(tokenizer 8000)" --config "$(speed_config yardstick)" --device cuda --max-steps "$n" --out "$out/census" \
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
  echo "== agree: $(basename "$agree_config") trained on the GPU in $agree_dtype for $minutes min, then test_2016_flickr on GPU and CPU"
  rm -rf "$out/model"
  start=$(date +%s)
  "$nmt" train --src "$data/train.de.gz" --tgt "$data/train.en.gz" --valid-src "$data/val.de.gz" --valid-tgt "$data/val.en.gz" \
    --tokenizer "$(tokenizer "$(field "$agree_config" vocab_size)")" \
    --config "$agree_config" --device cuda --dtype "$agree_dtype" \
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
