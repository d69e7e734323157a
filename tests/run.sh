#!/bin/sh
# Runs test binaries (Check suites) and check scripts (*.sh, run with the
# build dir as their argument), each in turn, and ends with one summary
# line: "N passed, N failed".  Usage: tests/run.sh BUILD_DIR BIN|SCRIPT...
# Every suite runs even when an earlier one fails; the exit status is 1 when
# any failed.  CK_DEFAULT_TIMEOUT guards against a hung test.
B=$1
shift
export GMB_BUILD_DIR="$B"
: "${CK_DEFAULT_TIMEOUT:=120}"
export CK_DEFAULT_TIMEOUT
passed=0
failed=0
failed_names=""
for t in "$@"; do
  echo "== $t"
  # Under the sanitizers, unit suites run in one process: in Check's fork
  # mode a leak found by LeakSanitizer in a test's child goes unreported.
  # Integration suites keep fork mode (their tests start brokers and
  # clients that must not outlive a failed test).
  fork=${CK_FORK:-}
  case "$B:$(basename "$t")" in
    */san:check_*|san:check_*) fork=no ;;
  esac
  case "$t" in
    *.sh) set -- sh "$t" "$B" ;;
    *) set -- env ${fork:+CK_FORK=$fork} "$t" ;;
  esac
  if "$@"; then
    passed=$((passed + 1))
  else
    failed=$((failed + 1))
    failed_names="$failed_names $(basename "$t")"
  fi
done
echo
[ -n "$failed_names" ] && echo "failed suites:$failed_names"
echo "suites: $passed passed, $failed failed"
[ "$failed" = 0 ]
