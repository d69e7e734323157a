#!/bin/sh
# entrypoint.sh - checks deploy/container/gmb-brokers, the entrypoint that
# starts one broker per GPU, on the fake driver with two GPUs: both brokers
# come up with their sockets in RUN_DIR/UUID, gmbctl --gpu reaches each,
# SIGTERM to the entrypoint stops both cleanly (exit 0, sockets removed);
# when one broker dies, the other is stopped and the entrypoint exits
# non-zero.  Waits are bounded polls of conditions, never timings.
#
# Usage: sh tests/entrypoint.sh BUILD_DIR      (from the top of the tree)
# Prints one summary line; exits 1 on any failure, 2 on a usage error.
# Needs bash (the entrypoint's shell).

me=entrypoint.sh
if [ $# -ne 1 ]; then
  echo "usage: sh tests/entrypoint.sh BUILD_DIR" >&2
  exit 2
fi
B=$1
if ! command -v bash >/dev/null 2>&1; then
  echo "$me: skipped: no bash"
  exit 0
fi
top=$(pwd)
case "$B" in /*) bd=$B ;; *) bd=$top/$B ;; esac
tmp=$(mktemp -d) || exit 1
run=$tmp/run
mkdir -m 0755 "$run"
export GMB_LIBCUDA="$bd/fakecuda/libcuda.so.1" FAKECUDA_DEVICES=2 \
  FAKECUDA_TOTAL=64m FAKECUDA_DIR="$tmp/dev" GMB_BROKER="$bd/gmb-broker"
unset FAKECUDA_VISIBLE GMB_ENDPOINT GMB_RUN_DIR
mkdir -m 0700 "$FAKECUDA_DIR"
u0=GPU-46414b45-4355-4441-0000-000000000000
u1=GPU-46414b45-4355-4441-0000-000000000001
fails=0
fail() {
  echo "$me: FAIL: $*" >&2
  fails=$((fails + 1))
}
# Polls until "$@" succeeds, at most about 10 s; its status.
until_ok() {
  i=0
  while [ $i -lt 100 ]; do
    "$@" && return 0
    sleep 0.1
    i=$((i + 1))
  done
  return 1
}
both_up() {
  [ -S "$run/$u0/broker.sock" ] && [ -S "$run/$u1/broker.sock" ] &&
    "$bd/gmbctl" --run-dir "$run" --gpu "$u0" status >/dev/null 2>&1 &&
    "$bd/gmbctl" --run-dir "$run" --gpu "$u1" status >/dev/null 2>&1
}
gone() { ! kill -0 "$1" 2>/dev/null; }
# The brokers a process started: its children named gmb-broker, from /proc
# (no procps needed).  In /proc/PID/stat the name is in parentheses and
# the parent's pid is the second field after it.
brokers_of() {
  parent=$1
  for d in /proc/[0-9]*; do
    st=$(cat "$d/stat" 2>/dev/null) || continue
    comm=${st#*(}
    comm=${comm%)*}
    # shellcheck disable=SC2086 # split the fields on purpose
    set -- ${st##*) }
    [ "$2" = "$parent" ] && [ "$comm" = gmb-broker ] && echo "${d#/proc/}"
  done
}
# Waits for the entrypoint to exit, at most about 10 s (then kills it and
# says so); its exit status.
wait_ep() {
  if ! until_ok gone "$1"; then
    fail "the entrypoint $1 did not exit ($2); killed"
    kill -KILL "$1" 2>/dev/null
  fi
  wait "$1"
}

# 1. Both come up, each answers for its GPU, SIGTERM stops both cleanly.
bash deploy/container/gmb-brokers --run-dir "$run" >"$tmp/log1" 2>&1 &
ep=$!
if until_ok both_up; then
  out=$("$bd/gmbctl" --run-dir "$run" --gpu 1 status 2>&1)
  echo "$out" | grep -q "cuda:1 (fakecuda 1)" || fail "--gpu 1: $out"
  kids=$(brokers_of $ep)
  [ "$(echo "$kids" | wc -w)" = 2 ] || fail "want 2 brokers, have: $kids"
  kill -TERM $ep
  wait_ep $ep "after SIGTERM"
  st=$?
  [ $st = 0 ] || fail "entrypoint exited $st after SIGTERM"
  for k in $kids; do until_ok gone "$k" || fail "broker $k still runs"; done
  [ -e "$run/$u0/broker.sock" ] && fail "GPU 0's socket left behind"
  [ -e "$run/$u1/broker.sock" ] && fail "GPU 1's socket left behind"
else
  fail "the two brokers did not come up"
  kill -TERM $ep 2>/dev/null
  wait_ep $ep "after SIGTERM"
fi

# 2. One broker dies: the other is stopped, the entrypoint fails.
bash deploy/container/gmb-brokers --run-dir "$run" >"$tmp/log2" 2>&1 &
ep=$!
if until_ok both_up; then
  kids=$(brokers_of $ep)
  victim=$(echo "$kids" | head -n 1)
  if [ -n "$victim" ]; then
    kill -KILL "$victim"
  else
    fail "no broker found under the entrypoint $ep"
    kill -TERM $ep
  fi
  wait_ep $ep "after one broker was killed"
  st=$?
  [ $st != 0 ] || fail "entrypoint exited 0 after a broker was killed"
  for k in $kids; do until_ok gone "$k" || fail "broker $k still runs"; done
  grep -q "stopping the others" "$tmp/log2" || fail "no line saying why"
else
  fail "the two brokers did not come up (second run)"
  kill -TERM $ep 2>/dev/null
  wait_ep $ep "after SIGTERM"
fi

if [ $fails != 0 ]; then
  cat "$tmp/log1" "$tmp/log2" >&2
fi
rm -rf "$tmp"
if [ $fails = 0 ]; then
  echo "$me: one broker per GPU started, reached, stopped: ok"
  exit 0
fi
echo "$me: $fails failed"
exit 1
