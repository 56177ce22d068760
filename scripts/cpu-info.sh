#!/usr/bin/env bash
# One line naming this machine's CPU, its core count, the SIMD features that nmt's and the
# peers' kernels choose between and its data caches, for benchmark output (figures hold only
# for the CPU measured).
set -euo pipefail
model=$(grep -m1 '^model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')
# Hypervisors often hide the marketing name ("AMD EPYC"); family and model tell the generation
# (AMD family 25 model 1 is Zen 3, model 17 Zen 4).
family=$(grep -m1 '^cpu family' /proc/cpuinfo | cut -d: -f2 | tr -d ' ')
number=$(grep -m1 '^model[[:space:]]*:' /proc/cpuinfo | cut -d: -f2 | tr -d ' ')
flags=$(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2-)
simd=""
for f in sse4_2 avx avx2 fma avx512f avx512bw avx512vl avx512_vnni avx512_bf16 avx_vnni amx_tile amx_int8 amx_bf16; do
  case " $flags " in *" $f "*) simd="$simd $f" ;; esac
done
caps=""
for v in NMT_CPU_ISA CT2_FORCE_CPU_ISA ONEDNN_MAX_CPU_ISA MKL_ENABLE_INSTRUCTIONS; do
  [ -n "${!v:-}" ] && caps="$caps $v=${!v}"
done
# Cache sizes and ways, as the matrix-product libraries size their blocks by them.
caches=""
for d in /sys/devices/system/cpu/cpu0/cache/index*; do
  [ -r "$d/level" ] || continue
  [ "$(cat "$d/type")" = Instruction ] && continue
  name=L$(cat "$d/level"); [ "$(cat "$d/type")" = Data ] && name=${name}d
  caches="$caches $name $(cat "$d/size")/$(cat "$d/ways_of_associativity" 2>/dev/null || echo ?)-way"
done
echo "cpu: $model (family $family model $number); $(nproc) cores; simd:$simd${caps:+; kernels capped:$caps}${caches:+; caches:$caches}"
