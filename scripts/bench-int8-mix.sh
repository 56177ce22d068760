#!/usr/bin/env bash
# The AVX2 int8 product's ceiling on this core, below any kernel: G instructions/s of each
# instruction the AVX2 int8 kernel (src/ops/int8.rs, `tile_avx2`) issues, alone in 12
# independent register chains, then its inner step as a mix, in G multiply-adds/s per form:
#   exact, as nmt:  vpsignb (x's sign onto w), vpmaddubsw, vpmaddwd, vpaddd
#   exact, the sign as vpxor + vpsubb with a mask (off the multiply pipes, one op more)
#   lossy, as CTranslate2's AVX2 int8: no sign step, vpmaddubsw saturating its pair sums
# One thread, best of 5, inline assembly compiled with the system C compiler (cc). Printed with
# the CPU it ran on: the ratio exact / lossy is what bounds nmt's exact int8 against a lossy
# one on AVX2-only CPUs.
#   scripts/bench-int8-mix.sh
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/cpu-info.sh"
if [ "$(uname -m)" != x86_64 ] || ! grep -qw avx2 /proc/cpuinfo; then
  echo "bench-int8-mix: needs an x86-64 CPU with AVX2" >&2
  exit 2
fi
command -v cc >/dev/null || { echo "bench-int8-mix: needs a C compiler (cc)" >&2; exit 2; }
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
cat > "$work/mix.c" <<'C'
#include <stdio.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
#define N 100000000L
#define CLOBBER "xmm0","xmm1","xmm2","xmm3","xmm4","xmm5","xmm6","xmm7","xmm8","xmm9","xmm10","xmm11","xmm12","xmm13","xmm14","xmm15"
/* Times `body` N times; `per` units of work each; prints G units/s. */
#define RUN(name, unit, per, body) { double best = 1e9; \
  for (int r = 0; r < 5; r++) { double t = now(); long n = N; \
    __asm__ volatile("1:\n" body "dec %0\n jnz 1b\n" : "+r"(n) :: CLOBBER); \
    double d = now() - t; if (d < best) best = d; } \
  printf("  %-44s %6.1f G %s/s\n", name, (per) * (double)N / best / 1e9, unit); }
#define ONE(ins, i) ins " %%ymm15, %%ymm" #i ", %%ymm" #i "\n"
#define CHAINS(ins) ONE(ins,0) ONE(ins,1) ONE(ins,2) ONE(ins,3) ONE(ins,4) ONE(ins,5) \
  ONE(ins,6) ONE(ins,7) ONE(ins,8) ONE(ins,9) ONE(ins,10) ONE(ins,11)
#define SIGN(a,b,c,d) ONE("vpsignb",a) ONE("vpmaddubsw",b) ONE("vpmaddwd",c) ONE("vpaddd",d)
#define XOR(a,b,c,d,e) ONE("vpxor",a) ONE("vpsubb",e) ONE("vpmaddubsw",b) ONE("vpmaddwd",c) ONE("vpaddd",d)
#define LOSSY(b,c,d) ONE("vpmaddubsw",b) ONE("vpmaddwd",c) ONE("vpaddd",d)
int main(void) {
  printf("each instruction alone, 12 independent chains:\n");
  RUN("vfmadd231ps", "instructions", 12, CHAINS("vfmadd231ps"))
  RUN("vpmaddwd", "instructions", 12, CHAINS("vpmaddwd"))
  RUN("vpmaddubsw", "instructions", 12, CHAINS("vpmaddubsw"))
  RUN("vpsignb", "instructions", 12, CHAINS("vpsignb"))
  RUN("vpaddd", "instructions", 12, CHAINS("vpaddd"))
  printf("the int8 kernel's inner step, per 32 multiply-adds:\n");
  RUN("exact (vpsignb, vpmaddubsw, vpmaddwd, vpaddd)", "multiply-adds", 3 * 32,
      SIGN(0,1,2,3) SIGN(4,5,6,7) SIGN(8,9,10,11))
  RUN("exact, sign as vpxor + vpsubb", "multiply-adds", 3 * 32,
      XOR(0,1,2,3,12) XOR(4,5,6,7,13) XOR(8,9,10,11,14))
  RUN("lossy (vpmaddubsw, vpmaddwd, vpaddd)", "multiply-adds", 4 * 32,
      LOSSY(0,1,2) LOSSY(4,5,6) LOSSY(8,9,10) LOSSY(3,7,11))
  return 0;
}
C
cc -O2 -o "$work/mix" "$work/mix.c"
"$work/mix"
