#!/bin/bash
# unit-check.sh - runs INSIDE a booted systemd (a container that
# deploy/check/units.sh boots), as the oneshot service gmb-unit-check,
# after gmb was installed as docs/operations.md says: gmb-broker.service,
# gmb-broker@.service, the sysusers file, deploy/gmb.ini.example as
# /etc/gmb/gmb.ini.  For each unit: start (and readiness: the broker
# answers as soon as `systemctl start` returns, since the unit is
# Type=notify), a client allocates through it, the broker runs as gmb,
# restart after SIGSEGV and after SIGKILL, reload (a quota changed in the
# config file is served), stop (clean exit, sockets removed).
#
# Prints "check-deploy: systemd: NAME: ok" or "... FAILED: why" per check
# (the journal's last lines with a failure), then asks systemd to exit
# with status 0 (all passed) or 1, which systemd-nspawn returns.
# Every wait is a bounded poll of a condition.
set -u
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
fails=0
ok() { echo "check-deploy: systemd: $1: ok${2:+ ($2)}"; }
bad() {
  echo "check-deploy: systemd: $1: FAILED: $2"
  journalctl --no-pager -n 15 -u "$unit" 2>&1 | sed 's/^/    /'
  fails=$((fails + 1))
}
# until_ok SECONDS CMD...: polls CMD every 0.1 s until it succeeds.
until_ok() {
  local n=$(($1 * 10)) i
  shift
  for ((i = 0; i < n; i++)); do
    "$@" >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  return 1
}
prop() { systemctl show -p "$2" --value "$1"; }
mainpid() { prop "$unit" MainPID; }
active() { [ "$(systemctl is-active "$unit")" = active ]; }
ctl() { gmbctl --run-dir "$dir" "$@"; }
answers() { ctl status >/dev/null 2>&1; }
restarted_from() { # OLD-PID: active again under another pid
  local p
  p=$(mainpid)
  active && [ "$p" != 0 ] && [ "$p" != "$1" ] && answers
}
quota_is() { ctl quota get batch 2>/dev/null | grep -q "$1"; }

# check_unit UNIT DIR: the checks for one unit whose broker serves DIR.
check_unit() {
  unit=$1
  dir=$2
  local t0 out pid uid n st
  t0=$(date +%s%N)
  if ! out=$(systemctl start "$unit" 2>&1); then
    bad "$unit: start" "systemctl start: $out"
    return
  fi
  # Readiness: no waiting here.  READY=1 came once the sockets listened.
  if [ -z "$dir" ]; then
    dir=$(ls -d /run/gmb/GPU-* 2>/dev/null | head -n 1)
  fi
  if active && out=$(ctl status 2>&1); then
    ok "$unit: start, ready when systemctl start returns" \
       "$(( ($(date +%s%N) - t0) / 1000000 )) ms; $(echo "$out" | grep -m1 '^device' | tr -s ' ')"
  else
    bad "$unit: start, ready when systemctl start returns" \
        "is-active $(systemctl is-active "$unit"); gmbctl status: $out"
    systemctl stop "$unit"
    return
  fi
  pid=$(mainpid)
  uid=$(awk '/^Uid:/ { print $2 }' "/proc/$pid/status")
  if [ "$uid" = "$(id -u gmb)" ]; then
    ok "$unit: runs as the user gmb" "uid $uid, from gmb.sysusers"
  else
    bad "$unit: runs as the user gmb" "uid '$uid'"
  fi
  # A client through the sandbox: sockets, memfds, the descriptor channel.
  if out=$(GMB_RUN_DIR=$dir gmb-job --touch 4MiB 4MiB 2>&1); then
    ok "$unit: a job allocates, writes and reads back through it"
  else
    bad "$unit: a job allocates, writes and reads back through it" "$out"
  fi
  # A crash: systemd starts it again (Restart=on-failure).
  for sig in SEGV KILL; do
    pid=$(mainpid)
    n=$(prop "$unit" NRestarts)
    kill -s "$sig" "$pid"
    if until_ok 30 restarted_from "$pid" &&
       [ "$(prop "$unit" NRestarts)" -gt "$n" ]; then
      ok "$unit: restarted after SIG$sig" "pid $pid -> $(mainpid)"
    else
      bad "$unit: restarted after SIG$sig" \
          "is-active $(systemctl is-active "$unit"), MainPID $(mainpid), NRestarts $(prop "$unit" NRestarts)"
    fi
  done
  # Reload: a quota changed in the file is served, by the same process.
  pid=$(mainpid)
  sed -i 's/^quota = 8GiB$/quota = 6GiB/' /etc/gmb/gmb.ini
  if systemctl reload "$unit" && until_ok 10 quota_is 6GiB &&
     [ "$(mainpid)" = "$pid" ]; then
    ok "$unit: systemctl reload re-reads the config" "batch's quota 8GiB -> 6GiB, pid $pid kept"
  else
    bad "$unit: systemctl reload re-reads the config" \
        "quota get batch: $(ctl quota get batch 2>&1); pid $pid -> $(mainpid)"
  fi
  sed -i 's/^quota = 6GiB$/quota = 8GiB/' /etc/gmb/gmb.ini
  # Stop: SIGTERM, a clean exit, its sockets removed.  systemd may unload
  # a stopped unit (and forget its exit status), so the journal tells: the
  # broker's own last line, "stopped", comes only after a clean shutdown,
  # and systemd logs "Main process exited" only for a non-zero status or a
  # signal it does not count as clean.
  local since
  since=$(date '+%Y-%m-%d %H:%M:%S')
  sleep 1 # journalctl --since has a resolution of seconds
  systemctl stop "$unit"
  out=$(journalctl --no-pager -o cat -u "$unit" --since "$since")
  if echo "$out" | grep -q 'info: stopped$' &&
     ! echo "$out" | grep -q 'Main process exited' &&
     [ ! -e "$dir/broker.sock" ] && [ ! -e "$dir/admin.sock" ] &&
     [ ! -e "$dir/fd.sock" ]; then
    ok "$unit: systemctl stop: clean exit" "the broker logged 'stopped', sockets removed"
  else
    bad "$unit: systemctl stop: clean exit" \
        "journal: $(echo "$out" | tail -n 3 | tr '\n' ' '); left in $dir: $(ls "$dir" 2>&1 | tr '\n' ' ')"
  fi
}

echo "check-deploy: systemd: $(systemctl --version | head -n 1)"
check_unit gmb-broker.service /run/gmb
# The template on the fake CUDA driver (the drop-in units.sh added), two
# instances side by side; each makes /run/gmb/UUID.
check_unit gmb-broker@0.service ""
dir0=$dir
if systemctl start gmb-broker@1.service gmb-broker@0.service; then
  n=$(ls -d /run/gmb/GPU-*/broker.sock 2>/dev/null | wc -l)
  if [ "$n" = 2 ]; then
    ok "gmb-broker@0 and @1 side by side" "two run dirs in /run/gmb"
  else
    unit=gmb-broker@1.service
    bad "gmb-broker@0 and @1 side by side" "$n sockets: $(ls /run/gmb)"
  fi
  systemctl stop gmb-broker@0.service
  [ -S "$dir0/broker.sock" ] && { unit=gmb-broker@0.service; bad "@0 stopped" "its socket is left"; }
  if [ "$(ls -d /run/gmb/GPU-*/broker.sock 2>/dev/null | wc -l)" = 1 ]; then
    ok "stopping gmb-broker@0 leaves @1's sockets"
  else
    unit=gmb-broker@1.service
    bad "stopping gmb-broker@0 leaves @1's sockets" "$(ls -R /run/gmb)"
  fi
  systemctl stop gmb-broker@1.service
else
  unit=gmb-broker@1.service
  bad "gmb-broker@0 and @1 side by side" "systemctl start failed"
fi
echo "check-deploy: systemd: $fails failed"
systemctl --no-block exit $((fails > 0))
