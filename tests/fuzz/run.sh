#!/bin/sh
# tests/fuzz/run.sh - runs libFuzzer targets one after another, each for a
# fixed time, and says what each did.  Usage:
#
#   sh tests/fuzz/run.sh FUZZ_BUILD_DIR SECONDS TARGET...
#
# Each target FUZZ_BUILD_DIR/fuzz_TARGET starts from its seed corpus,
# tests/fuzz/corpus/TARGET/ (read only), and keeps what it finds in
# FUZZ_BUILD_DIR/corpus/TARGET/ (so a later run goes on from there).  A
# crash, a leak or a broken invariant leaves the input as
# FUZZ_BUILD_DIR/crashes/TARGET-crash-* (reproduce: FUZZ_BUILD_DIR/fuzz_TARGET
# FILE) and counts as a failure.  One line per target:
#
#   fuzz: TARGET: N executions in S s, C crashes (corpus M inputs)
#
# and a last line "fuzz: N targets, N failed"; exit status 1 when any
# failed.  The runs are niced (the machine is shared); FUZZ_JOBS is not
# used: one target at a time.
FZ=$1
SECS=$2
shift 2
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
: "${ASAN_OPTIONS:=detect_leaks=1}"
: "${UBSAN_OPTIONS:=print_stacktrace=1:halt_on_error=1}"
export ASAN_OPTIONS UBSAN_OPTIONS
targets=0
failed=0
for t in "$@"; do
  targets=$((targets + 1))
  bin="$FZ/fuzz_$t"
  seeds="$ROOT/tests/fuzz/corpus/$t"
  work="$FZ/corpus/$t"
  log="$FZ/fuzz_$t.log"
  mkdir -p "$work" "$FZ/crashes"
  if [ ! -x "$bin" ]; then
    echo "fuzz: $t: no program $bin (build it with make fuzz-build)"
    failed=$((failed + 1))
    continue
  fi
  if [ ! -d "$seeds" ]; then
    echo "fuzz: $t: no seed corpus $seeds"
    failed=$((failed + 1))
    continue
  fi
  # -close_fd_mask=3: the code under test may print (parse errors); the
  # fuzzer's own output and any crash report still come through.
  rc=0
  nice -n 10 "$bin" -max_total_time="$SECS" -print_final_stats=1 \
    -close_fd_mask=3 -artifact_prefix="$FZ/crashes/$t-" -max_len=4096 \
    "$work" "$seeds" > "$log" 2>&1 || rc=$?
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)
  secs=$(sed -n 's/^stat::peak_rss_mb.*//;s/^Done [0-9]* runs in \([0-9]*\) second.*/\1/p' "$log" | tail -n 1)
  crashes=$(ls "$FZ/crashes" 2>/dev/null | grep -c "^$t-" || true)
  inputs=$(ls "$work" | wc -l)
  if [ "$rc" -ne 0 ] || [ -z "$execs" ]; then
    failed=$((failed + 1))
    echo "fuzz: $t: FAILED (exit status $rc); the fuzzer's report:"
    grep -v '^#[0-9]' "$log" | tail -n 60
  fi
  echo "fuzz: $t: ${execs:-?} executions in ${secs:-?} s, $crashes crashes" \
    "(corpus $inputs inputs)"
done
echo "fuzz: $targets targets, $failed failed"
[ "$failed" -eq 0 ]
