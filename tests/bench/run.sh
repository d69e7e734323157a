#!/bin/sh
# run.sh - the benchmarks, as `make bench` runs them.
#
# Usage: tests/bench/run.sh BUILD_DIR
# Prints the machine first (figures mean little without it), then runs
# BUILD_DIR/bench/bench_pool (the allocator alone, in-process),
# BUILD_DIR/bench/bench_alloc (allocations through a real broker),
# BUILD_DIR/bench/bench_import (a host segment's import: descriptor + map),
# BUILD_DIR/bench/bench_cache (the client cache beside a round trip),
# BUILD_DIR/bench/bench_shim (libgmb-torch.so beside the cache it calls),
# BUILD_DIR/bench/bench_sleep (sleep across processes: a request served
# from an idle job's paused tag, three jobs taking turns on 2.5x the device),
# BUILD_DIR/bench/bench_reap (the loop's stall when sessions end: at once
# against in slices), BUILD_DIR/bench/bench_lockwait (a gmb_lock mid-move:
# the futex wake against the sleeps it replaced),
# BUILD_DIR/bench/bench_compact (compaction's copy throughput, when built),
# BUILD_DIR/bench/bench_snapshot (gmbctl snapshot of a million allocations)
# and the fragmentation suite (tests/bench/frag.sh: traces replayed with
# gmb-replay, compaction off and auto, and the plot docs/img/frag.png).
# Each runs even when an earlier one fails; the exit status is non-zero
# when any failed or crashed.  Knobs: BENCH_ITER and BENCH_RSS_ALLOCS
# (bench_alloc; see docs/benchmarks.md), whatever bench_pool and
# bench_compact read, BENCH_SNAP_* (bench_snapshot), FRAG_* (frag.sh), BENCH_SKIP (names to leave out,
# e.g. "bench_alloc frag").
set -u
B=${1:-build}
GMB_BUILD_DIR=$B
export GMB_BUILD_DIR

cpu=$(sed -n 's/^model name[[:space:]]*:[[:space:]]*//p' /proc/cpuinfo | head -n 1)
echo "machine: cpu=\"${cpu:-unknown}\" cores=$(nproc) kernel=$(uname -r)"
echo "date: $(date -u '+%Y-%m-%d %H:%M UTC')"

HERE=$(cd "$(dirname "$0")" && pwd)
status=0
for bench in bench_pool bench_alloc bench_import bench_cache bench_shim \
    bench_sleep bench_reap bench_lockwait bench_compact bench_snapshot frag; do
  case " ${BENCH_SKIP:-} " in
    *" $bench "*) echo; echo "== $bench (skipped: BENCH_SKIP)"; continue ;;
  esac
  if [ "$bench" = frag ]; then
    set -- sh "$HERE/frag.sh" "$B"
  else
    bin=$B/bench/$bench
    # bench_compact is built only once the compaction engine is in the tree.
    if [ "$bench" = bench_compact ] && [ ! -e tests/bench/bench_compact.c ] &&
       [ ! -x "$bin" ]; then
      continue
    fi
    if [ ! -x "$bin" ]; then
      echo
      echo "== $bench"
      echo "bench: $bin is missing" >&2
      status=1
      continue
    fi
    set -- "$bin"
  fi
  echo
  echo "== $bench"
  start=$(date +%s)
  "$@"
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
