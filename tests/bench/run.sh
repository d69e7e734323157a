#!/bin/sh
# run.sh - the benchmarks, as `make bench` runs them.
#
# Usage: tests/bench/run.sh BUILD_DIR
# Prints the machine first (figures mean little without it), then runs
# BUILD_DIR/bench/bench_pool (the allocator alone, in-process) and
# BUILD_DIR/bench/bench_alloc (allocations through a real broker).  Both run
# even when the first fails; the exit status is non-zero when either failed
# or crashed.  Knobs: BENCH_ITER and BENCH_RSS_ALLOCS (bench_alloc; see
# docs/benchmarks.md), and whatever bench_pool reads.
set -u
B=${1:-build}
GMB_BUILD_DIR=$B
export GMB_BUILD_DIR

cpu=$(sed -n 's/^model name[[:space:]]*:[[:space:]]*//p' /proc/cpuinfo | head -n 1)
echo "machine: cpu=\"${cpu:-unknown}\" cores=$(nproc) kernel=$(uname -r)"
echo "date: $(date -u '+%Y-%m-%d %H:%M UTC')"

status=0
for bench in bench_pool bench_alloc; do
  bin=$B/bench/$bench
  echo
  echo "== $bench"
  if [ ! -x "$bin" ]; then
    echo "bench: $bin is missing" >&2
    status=1
    continue
  fi
  start=$(date +%s)
  "$bin"
  rc=$?
  echo "($bench: exit status $rc, $(( $(date +%s) - start )) s)"
  if [ $rc -ne 0 ]; then
    if [ $rc -gt 128 ]; then
      echo "bench: $bench crashed (signal $((rc - 128)))" >&2
    else
      echo "bench: $bench failed (exit status $rc)" >&2
    fi
    status=1
  fi
done
exit $status
