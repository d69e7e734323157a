#!/bin/sh
# demo.sh - a short tour of gmb on the host device (no GPU needed).
#
# Usage: deploy/demo/demo.sh BUILD_DIR    (what `make demo` runs)
#
# Starts a broker on a 1 GiB host device with deploy/demo/demo.ini (three
# tenants: llm-a 512MiB, llm-b 256MiB, batch 128MiB) in a temporary run
# dir, then shows jobs allocating, a quota refusal, a job killed with
# kill -9 whose memory comes back, and the per-tenant table.  Then the
# fragmentation scenario: two small brokers (64 MiB), one with compaction
# off and one with auto, each given the same fragmented device by
# examples/frag; off refuses a large request that the free total could
# hold, auto moves allocations and serves it with every byte intact.
# Everything it starts is stopped and its files removed on the way out,
# whether the demo passed or not.  Exit status 0 when every step did what
# it says.
set -u

B=${1:-build}
HERE=$(cd "$(dirname "$0")" && pwd)
BROKER=$B/gmb-broker
CTL=$B/gmbctl
JOB=$B/examples/job
FRAG=$B/examples/frag
for f in "$BROKER" "$CTL" "$JOB" "$FRAG"; do
  if [ ! -x "$f" ]; then
    echo "demo: $f is missing; run 'make' first" >&2
    exit 1
  fi
done

RUN=$(mktemp -d /tmp/gmb-demo-XXXXXX) || exit 1
LOG=$RUN/broker.log
# Clients and gmbctl find the broker through GMB_RUN_DIR.
GMB_RUN_DIR=$RUN
export GMB_RUN_DIR
unset GMB_ENDPOINT GMB_TENANT GMB_TOKEN GMB_TOKEN_FILE
BROKER_PID=
HOLD_PID=
KEEP_PID=
FRAG_PIDS=

# Stops whatever is still running, in reverse order, and removes the run
# dir.  Runs on every exit.
cleanup() {
  for p in $HOLD_PID $KEEP_PID; do
    kill -KILL "$p" 2>/dev/null
    wait "$p" 2>/dev/null
  done
  if [ -n "$BROKER_PID" ]; then
    kill -TERM "$BROKER_PID" 2>/dev/null
    i=0
    while kill -0 "$BROKER_PID" 2>/dev/null && [ $i -lt 30 ]; do
      sleep 0.1
      i=$((i + 1))
    done
    kill -KILL "$BROKER_PID" 2>/dev/null
    wait "$BROKER_PID" 2>/dev/null
  fi
  for p in $FRAG_PIDS; do
    kill -TERM "$p" 2>/dev/null
    wait "$p" 2>/dev/null
  done
  rm -rf "$RUN"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

fail() {
  echo
  echo "demo: FAILED: $*" >&2
  if [ -s "$LOG" ]; then
    echo "demo: the broker's last log lines:" >&2
    tail -n 15 "$LOG" | sed 's/^/  | /' >&2
  fi
  exit 1
}

step() {
  printf '\n== %s\n' "$*"
}

# Shows a command as a user would type it, then runs it (10 s at most).
show() {
  printf '$ %s\n' "$*"
  timeout 10 "$@"
}

# Waits up to $2 tenths of a second for a line matching $3 in file $1.
wait_for() {
  i=0
  until grep -q -- "$3" "$1" 2>/dev/null; do
    [ $i -ge "$2" ] && return 1
    sleep 0.1
    i=$((i + 1))
  done
  return 0
}

# --------------------------------------------------------------------------
step "Start a broker: 1 GiB host device, tenants llm-a (512MiB), llm-b (256MiB), batch (128MiB)"
printf '$ %s/gmb-broker --config deploy/demo/demo.ini --run-dir %s &\n' "$B" "$RUN"
"$BROKER" --config "$HERE/demo.ini" --run-dir "$RUN" >"$LOG" 2>&1 &
BROKER_PID=$!
i=0
until [ -S "$RUN/broker.sock" ] && [ -S "$RUN/admin.sock" ] &&
  [ -S "$RUN/fd.sock" ]; do
  kill -0 "$BROKER_PID" 2>/dev/null || fail "gmb-broker exited at start-up"
  [ $i -ge 50 ] && fail "gmb-broker did not create its sockets in 5 s"
  sleep 0.1
  i=$((i + 1))
done
echo "broker running (pid $BROKER_PID), log in $LOG"

# --------------------------------------------------------------------------
step "Jobs of each tenant allocate memory and write every byte (--touch)"
show "$JOB" --tenant llm-a --touch 128MiB 64MiB || fail "llm-a's job failed"
show "$JOB" --tenant llm-b --touch 96MiB || fail "llm-b's job failed"
show "$JOB" --tenant batch --touch 32MiB 32MiB || fail "batch's job failed"
echo "(each job freed its memory when it exited)"

# --------------------------------------------------------------------------
step "A request past the tenant's quota is refused at once (exit status 3)"
show "$JOB" --tenant batch 100MiB 64MiB
rc=$?
[ $rc -eq 3 ] || fail "expected job to exit 3 (refused), it exited $rc"
echo "(exit status 3: refused, as expected: 100MiB + 64MiB > batch's 128MiB)"

# --------------------------------------------------------------------------
step "A job killed with kill -9 while holding memory gives it back"
# llm-b keeps 192MiB for the rest of the demo; llm-a's job is the victim.
printf '$ %s/examples/job --tenant llm-b --hold-ms -1 --touch 192MiB &\n' "$B"
"$JOB" --tenant llm-b --hold-ms -1 --touch 192MiB \
  >"$RUN/keep.out" 2>&1 &
KEEP_PID=$!
printf '$ %s/examples/job --tenant llm-a --hold-ms -1 --touch 256MiB 128MiB &\n' "$B"
"$JOB" --tenant llm-a --hold-ms -1 --touch 256MiB 128MiB \
  >"$RUN/hold.out" 2>&1 &
HOLD_PID=$!
# A job prints its tenant's figures ("stats") once it holds everything.
wait_for "$RUN/keep.out" 50 ' stats ' || fail "llm-b's job did not allocate in 5 s"
wait_for "$RUN/hold.out" 50 ' stats ' || fail "llm-a's job did not allocate in 5 s"
sed 's/^/  /' "$RUN/keep.out" "$RUN/hold.out"
show "$CTL" tenants || fail "gmbctl tenants failed"
printf '$ kill -9 %s\n' "$HOLD_PID"
kill -KILL "$HOLD_PID"
wait "$HOLD_PID" 2>/dev/null
HOLD_PID=
# The broker watches each client's pid (pidfd) and its descriptor channel
# and ends a dead one's session at once, freeing what it held; poll (for at
# most 5 s) until gmbctl shows llm-a's USED back at 0B.
i=0
while :; do
  used=$("$CTL" tenants 2>&1 |
    awk 'NR == 1 { for (c = 1; c <= NF; c++) if ($c == "USED") u = c }
         $1 == "llm-a" && u { print $u }')
  [ "$used" = 0B ] && break
  [ $i -ge 50 ] && fail "llm-a still uses '$used' 5 s after its job was killed"
  sleep 0.1
  i=$((i + 1))
done
echo "(llm-a's 384MiB came back without the job's help)"
show "$CTL" tenants || fail "gmbctl tenants failed"

# --------------------------------------------------------------------------
step "The device and every tenant (llm-b's job still holds its memory)"
show "$CTL" status || fail "gmbctl status failed"

# --------------------------------------------------------------------------
step "Fragmentation: a large request while enough is free in total"
# Two brokers on 64 MiB host devices, the same but for compaction.  frag
# fills each with movable 512KiB blocks (pattern in every byte), frees
# every other one, then asks for 24MiB: 36MiB are free in total, but in
# 512KiB holes.
for mode in off auto; do
  mkdir -p "$RUN/$mode"
  printf '[broker]\ncompaction = %s\nlog_level = warn\n' "$mode" \
    >"$RUN/$mode/gmb.ini"
  "$BROKER" --config "$RUN/$mode/gmb.ini" --run-dir "$RUN/$mode" \
    --device host:64MiB >"$RUN/$mode/broker.log" 2>&1 &
  FRAG_PIDS="$FRAG_PIDS $!"
done
for mode in off auto; do
  i=0
  until [ -S "$RUN/$mode/broker.sock" ] && [ -S "$RUN/$mode/fd.sock" ]; do
    [ $i -ge 50 ] && LOG=$RUN/$mode/broker.log &&
      fail "the compaction=$mode broker did not start in 5 s"
    sleep 0.1
    i=$((i + 1))
  done
done
echo "(brokers on host:64MiB with compaction = off and compaction = auto)"
echo
echo "compaction = off:"
show "$FRAG" --endpoint "ipc://$RUN/off/broker.sock" --tenant demo
rc=$?
[ $rc -eq 3 ] || { LOG=$RUN/off/broker.log;
  fail "with compaction off, frag should be refused (exit 3); it exited $rc"; }
echo "(refused although 36MiB are free: no hole holds 24MiB)"
echo
echo "compaction = auto:"
show "$FRAG" --endpoint "ipc://$RUN/auto/broker.sock" --tenant demo \
  >"$RUN/auto/frag.out" 2>&1
rc=$?
cat "$RUN/auto/frag.out"
[ $rc -eq 0 ] || { LOG=$RUN/auto/broker.log;
  fail "with compaction auto, frag should succeed (exit 0); it exited $rc"; }
grep -q ' [1-9][0-9]* allocations moved, all bytes intact' "$RUN/auto/frag.out" ||
  { LOG=$RUN/auto/broker.log; fail "with compaction auto, nothing was moved"; }
echo "(the broker moved blocks while nobody held them locked, released the"
echo " emptied segments and served the request; every block kept its bytes)"
for p in $FRAG_PIDS; do
  kill -TERM "$p" 2>/dev/null
  wait "$p" 2>/dev/null
done
FRAG_PIDS=

# --------------------------------------------------------------------------
step "Stop: the last job, then the broker (SIGTERM)"
kill -TERM "$KEEP_PID" 2>/dev/null
wait "$KEEP_PID" 2>/dev/null
KEEP_PID=
printf '$ kill -TERM %s\n' "$BROKER_PID"
kill -TERM "$BROKER_PID"
i=0
while kill -0 "$BROKER_PID" 2>/dev/null; do
  [ $i -ge 50 ] && fail "gmb-broker did not stop within 5 s of SIGTERM"
  sleep 0.1
  i=$((i + 1))
done
wait "$BROKER_PID"
rc=$?
BROKER_PID=
[ $rc -eq 0 ] || fail "gmb-broker exited with status $rc after SIGTERM"
for s in broker.sock admin.sock fd.sock; do
  [ -e "$RUN/$s" ] && fail "gmb-broker left $RUN/$s behind"
done
echo "broker stopped cleanly (exit status 0, sockets removed)"
echo
echo "demo: done"
