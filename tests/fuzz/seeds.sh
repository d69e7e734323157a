#!/bin/sh
# seeds.sh - runs every seed corpus (tests/fuzz/corpus/TARGET/) through its
# fuzz target built without libFuzzer (BUILD_DIR/tests/fuzzseed_TARGET,
# tests/fuzz/standalone.c): each input once, as `make fuzz` starts from
# them, so the invariants the targets assert hold for the seeds on every
# `make check` (among them state files of an untrusted owner and
# descriptors sent on fd.sock).  Usage: sh tests/fuzz/seeds.sh BUILD_DIR
# One line per target; exit status 1 when any failed.
me=seeds.sh
B=$1
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
failed=0
n=0
for bin in "$B"/tests/fuzzseed_*; do
  [ -x "$bin" ] || continue
  t=${bin##*/fuzzseed_}
  n=$((n + 1))
  if ! "$bin" "$ROOT/tests/fuzz/corpus/$t"; then
    echo "$me: $t: FAILED"
    failed=$((failed + 1))
  fi
done
if [ "$n" -eq 0 ]; then
  echo "$me: no seed programs in $B/tests (make builds them)"
  exit 1
fi
echo "$me: $n targets, $failed failed"
[ "$failed" -eq 0 ]
