#!/bin/sh
# Runs test binaries (Check suites) and check scripts (*.sh, run with the
# build dir as their argument), each in turn, and ends with one summary
# line: "N passed, N failed".  Usage: tests/run.sh BUILD_DIR BIN|SCRIPT...
# Every suite runs even when an earlier one fails; the exit status is 1 when
# any failed.
#
# Time limits, so that a hung test fails instead of hanging `make check`:
#   - each test case of a Check suite: CK_DEFAULT_TIMEOUT seconds (120),
#     enforced by Check itself in fork mode;
#   - each suite, script or binary: GMB_SUITE_TIMEOUT seconds (900; 0 turns
#     it off).  A suite past its limit is killed with everything it started
#     (it runs as a session of its own, and every process of that session is
#     killed) and fails; before the kill, run.sh prints each of its
#     processes with its state, the kernel function it sleeps in (wchan)
#     and its command line: what it was waiting for.
# CK_RUN_CASE / CK_RUN_SUITE (Check's: run only that case or suite) set
# but empty mean every case: they are unset, since Check would otherwise
# run the cases named "" (none) and report "Checks: 0" as a pass.
# Needs only a POSIX sh, coreutils and /proc (setsid from util-linux when
# it is there); no procps.
B=$1
shift
export GMB_BUILD_DIR="$B"
: "${CK_DEFAULT_TIMEOUT:=120}"
[ -n "${CK_RUN_CASE-x}" ] || unset CK_RUN_CASE
[ -n "${CK_RUN_SUITE-x}" ] || unset CK_RUN_SUITE
export CK_DEFAULT_TIMEOUT
: "${GMB_SUITE_TIMEOUT:=900}"
passed=0
failed=0
failed_names=""

# proc_fields PID: sets STATE, PPID and SID from /proc/PID/stat (fields 3,
# 4 and 6, read after the command's name, which may hold spaces and
# parentheses); false when the process is gone.
proc_fields() {
  st=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
  # shellcheck disable=SC2086 # split the fields on purpose
  set -- ${st##*) }
  STATE=$1 PPID_=$2 SID=$4
}

# session_of PID: the session the suite PID runs as: its own when setsid
# made it a session leader, else that of its child setsid forked.
session_of() {
  proc_fields "$1" || return 1
  if [ "$SID" = "$1" ]; then
    echo "$1"
    return 0
  fi
  for d in /proc/[0-9]*; do
    p=${d#/proc/}
    proc_fields "$p" || continue
    [ "$PPID_" = "$1" ] && [ "$SID" = "$p" ] && { echo "$p"; return 0; }
  done
  return 1
}

# session_procs SID: its processes, one a line: "PID STATE WCHAN COMMAND".
session_procs() {
  for d in /proc/[0-9]*; do
    p=${d#/proc/}
    proc_fields "$p" || continue
    [ "$SID" = "$1" ] || continue
    w=$(cat "$d/wchan" 2>/dev/null)
    cmd=$(tr '\0' ' ' <"$d/cmdline" 2>/dev/null)
    echo "$p $STATE ${w:-?} ${cmd:-?}"
  done
}

# kill_session SID SIGNAL: that signal to every process of the session.
kill_session() {
  for d in /proc/[0-9]*; do
    p=${d#/proc/}
    proc_fields "$p" || continue
    [ "$SID" = "$1" ] && kill "-$2" "$p" 2>/dev/null
  done
}

# run_limited NAME CMD...: runs CMD in a session of its own under the
# suite's time limit; its exit status, or 124 when it ran out of time.
run_limited() {
  name=$1
  shift
  if [ "$GMB_SUITE_TIMEOUT" = 0 ]; then
    "$@"
    return
  fi
  # setsid(1) execs the command in place when it need not fork (a child of
  # a non-interactive sh is no process-group leader), so $! is usually the
  # session; -w keeps the exit status when it does fork.
  if command -v setsid >/dev/null 2>&1; then
    setsid -w "$@" &
  else
    "$@" &
  fi
  pid=$!
  flag=$(mktemp "${TMPDIR:-/tmp}/gmb-run.XXXXXX") || return 1
  (
    i=0
    while [ $i -lt "$GMB_SUITE_TIMEOUT" ]; do
      sleep 1
      kill -0 "$pid" 2>/dev/null || exit 0
      i=$((i + 1))
    done
    echo timeout >"$flag"
    echo "run.sh: $name: still running after ${GMB_SUITE_TIMEOUT}s" \
      "(GMB_SUITE_TIMEOUT); its processes (pid state wchan command):" >&2
    if sid=$(session_of "$pid"); then
      session_procs "$sid" | sed 's/^/run.sh:   /' >&2
      kill_session "$sid" TERM
      sleep 2
      kill_session "$sid" KILL
    fi
    kill -KILL "$pid" 2>/dev/null
  ) &
  watch=$!
  wait "$pid"
  rc=$?
  # Past the limit the watcher is killing the session: let it finish.
  [ -s "$flag" ] || kill "$watch" 2>/dev/null
  wait "$watch" 2>/dev/null
  if [ -s "$flag" ]; then
    rc=124
    echo "run.sh: $name: FAILED: killed at its time limit of ${GMB_SUITE_TIMEOUT}s" >&2
  fi
  rm -f "$flag"
  return $rc
}

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
  if run_limited "$(basename "$t")" "$@"; then
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
