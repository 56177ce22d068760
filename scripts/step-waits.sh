#!/usr/bin/env bash
# Where the threads of a training step wait (Linux perf): records the fixed-batch step of
# scripts/bench_step.rs (STEPS steps, default 6) with CPU-time samples and scheduler switches,
# then prints, after the first sixth of the run (model set-up and the first step's page faults),
# each thread's share of the time asleep (until a wake-up), where it fell asleep (how often and
# how long each time: many short sleeps are wake-up costs, long ones the other thread's work
# being waited for), and what the step's own thread ran while its partner slept: the work
# that holds the other core idle. perf's own recording takes CPU time too (its preemptions
# are listed as state R), so compare shares within one run, not against bench-step's timings.
#   scripts/step-waits.sh [STEPS] [BINARY]        (default: this checkout's bench-step)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/cpu-info.sh"
steps=${1:-6}
bin=${2:-}
if [ -z "$bin" ]; then
  (cd "$root" && cargo build --release --quiet --example bench-step)
  bin="$root/target/release/examples/bench-step"
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
perf record -q -e cpu-clock -F 1000 -e sched:sched_switch -e sched:sched_wakeup --call-graph dwarf,8192 \
  -o "$work/perf.data" "$bin" "$steps"
perf script -i "$work/perf.data" -F tid,time,event,ip,sym,trace 2>/dev/null >"$work/script.txt"
python3 - "$work/script.txt" <<'EOF'
import bisect, collections, re, sys

events = []
for block in open(sys.argv[1]).read().split("\n\n"):
    lines = block.strip().split("\n")
    m = re.match(r"\s*(\d+)\s+([\d.]+):\s+(\S+):\s*(.*)", lines[0])
    if m:
        frames = [l.strip().split(" ", 1)[-1] for l in lines[1:]]
        events.append((float(m.group(2)), int(m.group(1)), m.group(3), m.group(4), frames))
events.sort(key=lambda e: e[0])
samples = collections.Counter(e[1] for e in events if e[2] == "cpu-clock")
step = next(e[1] for e in events if e[2] == "cpu-clock" and any("bench_step::run" in f for f in e[4]))
partner = next(t for t, _ in samples.most_common() if t != step)
start = events[0][0] + (events[-1][0] - events[0][0]) / 6
span = events[-1][0] - start


def first_frame(frames, keys=("nmt::", "candle_core::", "gemm"), skip=()):
    for f in frames:
        if any(k in f for k in keys) and not any(k in f for k in ("on_worker",) + skip):
            return f[:110]
    return "(outside nmt, Candle and gemm: the idle worker loop)"


def off_cpu(tid):
    """(from, to, state, frames): from a switch away to the wake-up that ends a sleep (sent
    by a thread of this process), else to the thread's next event of its own."""
    out, pending = [], None
    for t, who, kind, rest, frames in events:
        woken = kind == "sched:sched_wakeup" and re.search(rf"\bpid={tid}\b", rest)
        if who != tid and not woken:
            continue
        if pending:
            out.append((pending[0], t, pending[1], pending[2]))
            pending = None
        m = re.search(r"prev_pid=(\d+) prev_prio=\d+ prev_state=(\S+)", rest)
        if who == tid and kind == "sched:sched_switch" and m and int(m.group(1)) == tid:
            pending = (t, m.group(2), frames)
    return [o for o in out if o[0] >= start]


for name, tid in (("step thread", step), ("partner", partner)):
    offs = off_cpu(tid)
    asleep = sum(b - a for a, b, s, _ in offs if s.startswith("S"))
    preempted = sum(b - a for a, b, s, _ in offs if s.startswith("R"))
    print(f"{name}: asleep {100 * asleep / span:.1f} % of the time, preempted {100 * preempted / span:.1f} %; asleep in")
    where, count = collections.Counter(), collections.Counter()
    for a, b, s, frames in offs:
        if s.startswith("S"):
            place = first_frame(frames)
            where[place] += b - a
            count[place] += 1
    for f, d in where.most_common(6):
        print(f"  {100 * d / span:5.1f} %  {count[f]:5d} sleeps, {1e6 * d / count[f]:6.0f} us each  {f}")

sleeps = [(a, b) for a, b, s, _ in off_cpu(partner) if s.startswith("S")]
starts = [a for a, _ in sleeps]
total, alone = 0, collections.Counter()
for t, who, kind, _, frames in events:
    if kind != "cpu-clock" or who != step or t < start:
        continue
    total += 1
    i = bisect.bisect_right(starts, t) - 1
    if i >= 0 and sleeps[i][0] <= t <= sleeps[i][1]:
        alone[first_frame(frames, ("nmt::", "candle_core::"), ("cpu::wide", "cpu::zeros"))] += 1
print(f"the step thread's samples while its partner sleeps: {100 * sum(alone.values()) / total:.1f} % of its samples")
for f, n in alone.most_common(15):
    print(f"  {100 * n / total:5.2f} %  {f}")
EOF
