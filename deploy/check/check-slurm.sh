#!/usr/bin/env bash
# check-slurm.sh BUILD_DIR - `make check-slurm`: gmb_spank.so under a real
# Slurm on this machine (docs/slurm.md).
#
# Installs Debian's slurm-wlm, slurm-client, munge and libslurm-dev when
# missing (deploy/install-deps.sh --slurm), then starts, from a private
# directory and with a config of its own (no systemd, no /etc/slurm):
# munged, slurmctld and slurmd for one node, and gmb brokers on the host
# device.  The node counts its GPU memory as the generic resource gmbmem in
# units of 64MiB (gres.conf Count=4: the 256MiB of its broker), and has
# two GPUs for Slurm (character devices made in the private directory;
# their driver's information files too, under gpus/, which gmb_spank.so
# reads through gpu_info= instead of /proc/driver/nvidia/gpus).
#
#   phase 1, one broker for the node (plugstack: run_dir=DIR):
#     held      srun --gpu-mem=64MiB: the step is tenant slurm-JOB.0 and is
#               refused (GMB_E_QUOTA) past 64MiB
#     two       two steps at once are two tenants, each with its session
#     scancel   a held job's tenant goes, and its memory comes back
#     queue     a job asking more gmbmem than is left waits (Resources)
#               until the earlier one ends, then runs
#     refused   more gmbmem than the node has is refused at submission
#     bad       a malformed --gpu-mem, --gpu-mem and --gres that disagree,
#               and a quota the broker refuses: each step fails with the
#               reason in its output, leaves no tenant, and slurmd serves
#               the next job
#     escaped   a process that leaves its step (setsid: proctrack/linuxproc
#               loses it) loses its session and memory at the step's end,
#               and the tenant goes with the step
#   phase 2, one broker per GPU (run_dir_per_gpu gpu_info=DIR), slurmd
#   started again; a broker for GPU 0 only:
#     per-gpu   --gres=gpu:1: the step's GPU (SLURM_STEP_GPUS 0, device
#               minor 0) is mapped to its UUID and the broker in RUN/UUID
#     no-broker a step bound to GPU 1, which has no broker, fails with the
#               reason; so does a step of two GPUs
#     batch-env a batch job's broker is its GPU's (SLURM_JOB_GPUS), never
#               the one SLURM_STEP_GPUS or CUDA_VISIBLE_DEVICES exported by
#               the submitting user names (sbatch passes them on)
#   cleanup   every process it started is gone at the end
#
# Each check prints "check-slurm: NAME: ok", "... FAILED: why" or "...
# SKIPPED: why"; the last line is "check-slurm: N passed, N failed, N
# skipped", exit status 1 when one failed.  The figures (srun to the job's
# first allocation, scancel to the tenant's removal) are printed as
# "check-slurm: figure: ...": they are measured, never asserted.
set -uo pipefail
# has PATTERN...: grep for a pipeline's end.  grep -q stops at the first
# match, and the writer's SIGPIPE then fails the pipeline (pipefail) when
# its output was longer than a pipe takes at once: has reads it all.
has() { grep "$@" >/dev/null; }

B=${1:-build}
cd "$(dirname "$0")/../.."
TOP=$PWD
passed=0
failed=0
skipped=0
ok() { echo "check-slurm: $1: ok"; passed=$((passed + 1)); }
fail() { echo "check-slurm: $1: FAILED: $2"; failed=$((failed + 1)); }
skip() { echo "check-slurm: $1: SKIPPED: $2"; skipped=$((skipped + 1)); }
summary() {
  echo "check-slurm: $passed passed, $failed failed, $skipped skipped"
  [ "$failed" -eq 0 ]
  exit
}
ALL="held two scancel queue refused bad escaped per-gpu no-broker batch-env cleanup"
skip_all() {
  local c
  for c in $ALL; do skip "$c" "$1"; done
  summary
}

[ "$(id -u)" = 0 ] || skip_all "needs root (slurmd, slurmctld and munged run as root)"
if ! sh deploy/install-deps.sh --slurm; then
  skip_all "the Debian packages slurm-wlm, slurm-client, munge and libslurm-dev cannot be installed here"
fi
for t in munged slurmctld slurmd srun sbatch squeue scancel; do
  command -v "$t" >/dev/null 2>&1 || skip_all "$t is not installed"
done
# gmb_spank.so is built when spank.h is there: the packages may be new.
make -s "$B/gmb_spank.so" >/dev/null 2>&1 || true
for f in gmb-broker gmbctl gmb_spank.so examples/job; do
  [ -e "$B/$f" ] || skip_all "$B/$f is not built (make first)"
done

# Socket paths must stay short (108 bytes): the state lives under /tmp.
W=$(mktemp -d /tmp/gmb-slurm.XXXXXX)
RUN=$W/gmb
LOG=$W/log
mkdir -p "$RUN" "$LOG" "$W/state" "$W/spool" "$W/dev" "$W/gpus" "$W/out"
chmod 0755 "$W" "$RUN"
export SLURM_CONF=$W/slurm.conf
PIDS=()
JOB="$TOP/$B/examples/job"
CTL="$TOP/$B/gmbctl"
UUID0=GPU-5a1e0000-0000-4000-8000-000000000000
UUID1=GPU-5a1e0001-0000-4000-8000-000000000001

cleanup() {
  scancel --full --quiet -u root >/dev/null 2>&1 || true
  local p
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null; done
  for p in "${PIDS[@]}"; do
    for _ in $(seq 50); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$p" 2>/dev/null
  done
  # slurmstepd processes of our node, if any outlived slurmd.
  pkill_ours
  rm -rf "$W"
}
# The step daemons started for our node (their command line names it).
pkill_ours() {
  local p
  for p in $(pgrep -f "slurmstepd: \[" 2>/dev/null); do
    if tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null |
      grep -qx "SLURM_CONF=$SLURM_CONF"; then
      kill -9 "$p" 2>/dev/null
    fi
  done
  return 0
}
trap 'cleanup' EXIT
trap 'exit 130' INT TERM

# A free TCP port on the loopback, above 20000.
free_port() {
  local p
  while :; do
    p=$((20000 + RANDOM % 30000))
    ss -ltnH "sport = :$p" 2>/dev/null | has . || { echo "$p"; return; }
  done
}

# wait_for SECONDS CMD...: true once CMD succeeds, false after SECONDS
# (of the clock: a slow CMD does not stretch it).
wait_for() {
  local end=$(($(date +%s) + $1))
  shift
  while :; do
    "$@" >/dev/null 2>&1 && return 0
    [ "$(date +%s)" -ge "$end" ] && return 1
    sleep 0.1
  done
}

# --- munge, slurmctld, slurmd ---------------------------------------------

dd if=/dev/urandom of="$W/munge.key" bs=1024 count=1 status=none
chmod 0400 "$W/munge.key"
MUNGE_SOCK=$W/munge.sock
munged --force --key-file="$W/munge.key" --socket="$MUNGE_SOCK" \
  --pid-file="$W/munged.pid" --log-file="$LOG/munged.log" \
  --seed-file="$W/munge.seed" >"$LOG/munged.out" 2>&1 ||
  skip_all "munged did not start ($(tail -n 1 "$LOG/munged.out"))"
PIDS+=("$(cat "$W/munged.pid")")

HOST=$(hostname -s)
CTLD_PORT=$(free_port)
D_PORT=$(free_port)
# Two character devices that stand in for /dev/nvidia0 and 1 (Slurm
# requires one per GPU in gres.conf; it never opens them here).
gpus_made=1
for i in 0 1; do
  mknod "$W/dev/nvidia$i" c 1 3 2>/dev/null || gpus_made=0
done
for i in 0 1; do
  u=UUID$i
  mkdir -p "$W/gpus/0000:0$i:00.0"
  printf 'Model: \t\t gmb test GPU\nGPU UUID: \t\t %s\nBus Type: \t\t PCIe\nDevice Minor: \t\t %d\n' \
    "${!u}" "$i" >"$W/gpus/0000:0$i:00.0/information"
done
GPU_GRES=""
GPU_CONF=""
if [ "$gpus_made" = 1 ]; then
  GPU_GRES=",gpu:2"
  GPU_CONF="Name=gpu File=$W/dev/nvidia[0-1]"
fi
CPUS=$(nproc)
[ "$CPUS" -ge 2 ] || CPUS=2
cat >"$W/slurm.conf" <<EOF
ClusterName=gmbcheck
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCK
CredType=cred/munge
SlurmctldPort=$CTLD_PORT
SlurmdPort=$D_PORT
StateSaveLocation=$W/state
SlurmdSpoolDir=$W/spool
SlurmctldPidFile=$W/slurmctld.pid
SlurmdPidFile=$W/slurmd.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
PlugStackConfig=$W/plugstack.conf
GresTypes=gmbmem,gpu
KillWait=5
NodeName=gmbnode NodeHostname=$HOST NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=1000 Gres=gmbmem:4$GPU_GRES State=UNKNOWN
PartitionName=gmb Nodes=gmbnode Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
cat >"$W/gres.conf" <<EOF
NodeName=gmbnode Name=gmbmem Count=4
${GPU_CONF:+NodeName=gmbnode $GPU_CONF}
EOF
SPANK="$TOP/$B/gmb_spank.so"
echo "required $SPANK run_dir=$RUN/node unit=64MiB" >"$W/plugstack.conf"

slurmctld -c -f "$W/slurm.conf" >"$LOG/slurmctld.out" 2>&1 ||
  skip_all "slurmctld did not start ($(tail -n 1 "$LOG/slurmctld.out"))"
wait_for 10 test -s "$W/slurmctld.pid"
PIDS+=("$(cat "$W/slurmctld.pid")")

start_slurmd() {
  rm -f "$W/slurmd.pid"
  slurmd -N gmbnode -f "$W/slurm.conf" >"$LOG/slurmd.out" 2>&1 || return 1
  wait_for 10 test -s "$W/slurmd.pid" || return 1
  SLURMD_PID=$(cat "$W/slurmd.pid")
  PIDS+=("$SLURMD_PID")
  wait_for 30 sh -c 'sinfo -h -n gmbnode -o %t | grep -Eq "^(idle|mix|alloc)"'
}
start_slurmd || skip_all "slurmd did not come up ($(tail -n 2 "$LOG/slurmd.log" 2>/dev/null | tr '\n' ' '))"

# broker DIR: a gmb broker on a 256MiB host device serving run dir DIR.
start_broker() {
  mkdir -p "$1"
  "$TOP/$B/gmb-broker" --device host:256MiB --run-dir "$1" \
    >>"$LOG/broker-$(basename "$1").log" 2>&1 &
  PIDS+=("$!")
  wait_for 10 test -S "$1/admin.sock"
}
start_broker "$RUN/node" || skip_all "gmb-broker did not start"

# tenants DIR: the broker's tenants as "NAME SESSIONS USED" lines
# (gmbctl tenants: NAME QUOTA USED CACHED PEAK SEGMENTS SESSIONS ...).
tenants() {
  "$CTL" --run-dir "$1" tenants 2>/dev/null | awk 'NR > 1 { print $1, $7, $3 }'
}
no_slurm_tenant() { ! tenants "$1" | has "^slurm-"; }
# in_use DIR: the broker's bytes in use, as gmbctl status prints them.
in_use() {
  "$CTL" --run-dir "$1" status 2>/dev/null | awk '$1 == "in" && $2 == "use" { print $3 }'
}
ms_since() { echo $((($(date +%s%N) - $1) / 1000000)); }

# --- phase 1: one broker for the node -------------------------------------

# held: 48MiB fits the 64MiB quota, 32MiB more does not.
t0=$(date +%s%N)
out=$(timeout 120 srun --gpu-mem=64MiB bash -c \
  "echo tenant=\$GMB_TENANT run_dir=\$GMB_RUN_DIR; $JOB 48MiB 32MiB; echo exit=\$?" 2>&1)
# The figure: srun's start to the session's opening in the broker's log
# (its first allocation is the job's next request).
first_alloc_ms=""
tn=$(sed -n 's/^tenant=\(slurm-[0-9]*\.0\) .*/\1/p' <<<"$out")
opened=$(grep "opened: tenant $tn," "$LOG/broker-node.log" 2>/dev/null | tail -n 1 | cut -d' ' -f1)
if [ -n "$tn" ] && [ -n "$opened" ]; then
  first_alloc_ms=$((($(date -d "$opened" +%s%N) - t0) / 1000000))
fi
if grep -q "tenant=slurm-[0-9]*\.0 run_dir=$RUN/node" <<<"$out" &&
   grep -q "alloc 48MiB -> id=[0-9]* ok" <<<"$out" &&
   grep -q "alloc 32MiB -> GMB_E_QUOTA: .*quota of 64MiB" <<<"$out" &&
   grep -q "exit=3" <<<"$out"; then
  ok held
else
  fail held "$(tr '\n' '|' <<<"$out" | cut -c1-400)"
fi
if wait_for 10 no_slurm_tenant "$RUN/node"; then :; else
  fail held "its tenant was not removed at the step's end: $(tenants "$RUN/node" | tr '\n' '|')"
fi

# two: two steps at once, two tenants, each with a session.
two_pids=()
for i in 1 2; do
  timeout 120 srun --gpu-mem=64MiB "$JOB" --hold-ms 4000 16MiB \
    >"$W/out/two$i" 2>&1 &
  two_pids+=("$!")
done
two_seen() { [ "$(tenants "$RUN/node" | grep -c '^slurm-[0-9]*\.0 1 ')" = 2 ]; }
if wait_for 60 two_seen; then ok two; else
  fail two "never two tenants with a session each: $(tenants "$RUN/node" | tr '\n' '|')"
fi
wait "${two_pids[@]}"
wait_for 10 no_slurm_tenant "$RUN/node" ||
  fail two "tenants left after both steps ended: $(tenants "$RUN/node" | tr '\n' '|')"

# scancel: a job that holds 32MiB until killed.
jid=$(sbatch --parsable -o "$W/out/held.%j" --gpu-mem=64MiB \
  --wrap "srun $JOB --hold-ms -1 32MiB")
holds() { tenants "$RUN/node" | has "^slurm-$jid\.0 1 32MiB$"; }
if [ -n "$jid" ] && wait_for 60 holds; then
  t0=$(date +%s%N)
  scancel "$jid"
  gone() { ! tenants "$RUN/node" | has "^slurm-$jid\." && [ "$(in_use "$RUN/node")" = 0B ]; }
  if wait_for 60 gone; then
    scancel_ms=$(ms_since "$t0")
    ok scancel
  else
    fail scancel "after scancel: $(tenants "$RUN/node" | tr '\n' '|') in use $(in_use "$RUN/node")"
  fi
else
  fail scancel "job ${jid:-?} never held 32MiB as tenant slurm-$jid.0 ($(tenants "$RUN/node" | tr '\n' '|'); $(cat "$W/out/held.$jid" 2>/dev/null | tr '\n' '|'))"
fi

# queue: 3 of the node's 4 units taken; 2 more wait until they are back.
ja=$(sbatch --parsable -o "$W/out/a.%j" --gres=gmbmem:3 \
  --wrap "srun $JOB --hold-ms 8000 16MiB")
running() { [ "$(squeue -h -j "$1" -o %T)" = RUNNING ]; }
if [ -n "$ja" ] && wait_for 60 running "$ja"; then
  jb=$(sbatch --parsable -o "$W/out/b.%j" --gres=gmbmem:2 \
    --wrap "srun $JOB 16MiB")
  # The scheduler looks at it within its next pass; until then its reason
  # is None.
  waits() { [ "$(squeue -h -j "$jb" -o '%T %r')" = "PENDING Resources" ]; }
  wait_for 30 waits
  st=$(squeue -h -j "$jb" -o "%T %r")
  done_b() { [ -z "$(squeue -h -j "$jb" -o %T 2>/dev/null)" ]; }
  if [ "$st" != "PENDING Resources" ]; then
    fail queue "the second job is '$st' while the first runs, not PENDING Resources"
  elif ! running "$ja"; then
    fail queue "the first job ended before the second was looked at"
  elif ! wait_for 120 done_b; then
    fail queue "the second job never ran: $(squeue -h -j "$jb" -o '%T %r')"
  elif ! grep -q "alloc 16MiB -> id=[0-9]* ok" "$W/out/b.$jb" 2>/dev/null; then
    fail queue "the second job ran but did not allocate: $(tr '\n' '|' <"$W/out/b.$jb" 2>/dev/null)"
  else
    ok queue
  fi
else
  fail queue "the first job never ran: $(squeue -h -j "${ja:-0}" -o '%T %r' 2>&1)"
fi

# refused: 5 units on a node of 4.
out=$(sbatch --gres=gmbmem:5 --wrap true 2>&1)
if [ $? -ne 0 ] && grep -q "Requested node configuration is not available" <<<"$out"; then
  ok refused
else
  fail refused "sbatch --gres=gmbmem:5 said: $out"
fi

# bad: each fails, with its reason, and leaves nothing.
bad_ok=1
bad_try() { # WANT ARGS...
  local want=$1 rc
  shift
  out=$(timeout 120 srun "$@" true 2>&1)
  rc=$?
  if [ "$rc" -eq 0 ] || ! grep -q -- "$want" <<<"$out"; then
    fail bad "srun $* exited $rc without '$want': $(tr '\n' '|' <<<"$out" | cut -c1-300)"
    bad_ok=0
  fi
}
bad_try "gmb: --gpu-mem=12XB: want a size" --gpu-mem=12XB
bad_try "disagree: with units of 64MiB, 64MiB is --gres=gmbmem:1" \
  --gres=gmbmem:2 --gpu-mem=64MiB
bad_try "the broker did not make tenant slurm-[0-9]*.0 of 1GiB: GMB_E_INVAL: quota 1GiB" \
  --gpu-mem=1GiB
if ! no_slurm_tenant "$RUN/node"; then
  fail bad "tenants left: $(tenants "$RUN/node" | tr '\n' '|')"
  bad_ok=0
fi
out=$(timeout 60 srun --gpu-mem=64MiB "$JOB" 1MiB 2>&1)
if ! grep -q "alloc 1MiB -> id=[0-9]* ok" <<<"$out"; then
  fail bad "slurmd did not serve the next job: $(tr '\n' '|' <<<"$out")"
  bad_ok=0
fi
[ "$bad_ok" = 1 ] && ok bad

# escaped: the step's task starts a process in a session of its own, which
# allocates and holds 16MiB, and exits.  slurmstepd's process tracking
# (proctrack/linuxproc: the descendants of slurmstepd) no longer finds it
# once it is init's, so it outlives the step; its session must not keep
# the step's tenant, its quota and its memory after Slurm gave the step's
# gmbmem back.
esc=$W/out/escaped
out=$(timeout 120 srun --gpu-mem=64MiB bash -c \
  "setsid bash -c 'echo \$\$ >$esc.pid; exec $JOB --hold-ms -1 16MiB' >$esc 2>&1 </dev/null &
   for i in \$(seq 200); do grep -q 'alloc 16MiB -> id=[0-9]* ok' $esc && break; sleep 0.1; done
   echo tenant=\$GMB_TENANT" 2>&1)
esc_pid=$(cat "$esc.pid" 2>/dev/null)
[ -n "$esc_pid" ] && PIDS+=("$esc_pid")
tn=$(sed -n 's/^tenant=\(slurm-[0-9]*\.0\)$/\1/p' <<<"$out")
esc_gone() { ! tenants "$RUN/node" | has "^$tn " && [ "$(in_use "$RUN/node")" = 0B ]; }
if [ -z "$tn" ] || ! grep -q 'alloc 16MiB -> id=[0-9]* ok' "$esc" 2>/dev/null; then
  fail escaped "the escaped process never allocated: $(tr '\n' '|' <<<"$out" | cut -c1-200) / $(tr '\n' '|' <"$esc" 2>/dev/null | cut -c1-200)"
elif ! kill -0 "$esc_pid" 2>/dev/null; then
  fail escaped "the escaped process $esc_pid did not outlive its step"
elif wait_for 10 esc_gone; then
  ok escaped
else
  fail escaped "after its step ended, with process $esc_pid still running: $(tenants "$RUN/node" | tr '\n' '|') in use $(in_use "$RUN/node")"
fi
[ -n "$esc_pid" ] && kill "$esc_pid" 2>/dev/null

# --- phase 2: one broker per GPU -----------------------------------------

if [ "$gpus_made" = 1 ]; then
  echo "required $SPANK run_dir=$RUN run_dir_per_gpu gpu_info=$W/gpus unit=64MiB" \
    >"$W/plugstack.conf"
  kill "$SLURMD_PID"
  wait_for 20 sh -c "! kill -0 $SLURMD_PID"
  if ! start_slurmd; then
    fail per-gpu "slurmd did not come up again"
    fail no-broker "slurmd did not come up again"
    fail batch-env "slurmd did not come up again"
  elif ! start_broker "$RUN/$UUID0"; then
    fail per-gpu "the broker of $UUID0 did not start"
    fail no-broker "the broker of $UUID0 did not start"
    fail batch-env "the broker of $UUID0 did not start"
  else
    out=$(timeout 120 srun --gres=gpu:1 --gpu-mem=64MiB bash -c \
      "echo gpus=\$SLURM_STEP_GPUS run_dir=\$GMB_RUN_DIR; $JOB 16MiB" 2>&1)
    if grep -q "gpus=0 run_dir=$RUN/$UUID0\$" <<<"$out" &&
       grep -q "alloc 16MiB -> id=[0-9]* ok" <<<"$out"; then
      ok per-gpu
    else
      fail per-gpu "$(tr '\n' '|' <<<"$out" | cut -c1-400)"
    fi
    # GPU 0 taken by a step without gmb memory: the next one gets GPU 1.
    timeout 120 srun --gres=gpu:1 sleep 8 >/dev/null 2>&1 &
    holder=$!
    busy() { [ -n "$(squeue -h -t R -o %i)" ]; }
    wait_for 30 busy
    out=$(timeout 120 srun --gres=gpu:1 --gpu-mem=64MiB bash -c \
      'echo ran=$SLURM_STEP_GPUS' 2>&1)
    rc=$?
    out2=$(timeout 60 srun --gres=gpu:2 --gpu-mem=64MiB true 2>&1)
    rc2=$?
    wait "$holder"
    if [ "$rc" -ne 0 ] &&
       grep -q "no broker at ipc://$RUN/$UUID1/admin.sock" <<<"$out" &&
       ! grep -q "ran=" <<<"$out" &&
       [ "$rc2" -ne 0 ] && grep -q "the step has several GPUs" <<<"$out2" &&
       no_slurm_tenant "$RUN/$UUID0"; then
      ok no-broker
    else
      fail no-broker "GPU 1 (rc $rc): $(tr '\n' '|' <<<"$out" | cut -c1-300); two GPUs (rc $rc2): $(tr '\n' '|' <<<"$out2" | cut -c1-200)"
    fi

    # batch-env: the user exports another GPU's number (or UUID) in the
    # variables the plugin used to read.  The first job is given GPU 0
    # (free again) and must reach GPU 0's broker; the second has no GPU
    # and must be refused, not placed on the GPU the user named.
    jb1=$(SLURM_STEP_GPUS=1 CUDA_VISIBLE_DEVICES=1 sbatch --parsable \
      -o "$W/out/benv1.%j" --gres=gpu:1 --gpu-mem=64MiB \
      --wrap 'echo job_gpus=$SLURM_JOB_GPUS run_dir=$GMB_RUN_DIR' 2>&1)
    jb2=$(SLURM_STEP_GPUS=0 CUDA_VISIBLE_DEVICES=$UUID0 sbatch --parsable \
      -o "$W/out/benv2.%j" --gpu-mem=64MiB \
      --wrap 'echo run_dir=$GMB_RUN_DIR' 2>&1)
    ended() { [ -z "$(squeue -h -j "$1" -o %T 2>/dev/null)" ]; }
    wait_for 60 ended "$jb1"
    wait_for 60 ended "$jb2"
    o1=$(cat "$W/out/benv1.$jb1" 2>/dev/null)
    o2=$(cat "$W/out/benv2.$jb2" 2>/dev/null)
    if grep -q "^job_gpus=0 run_dir=$RUN/$UUID0\$" <<<"$o1" &&
       grep -q "bound to no GPU" <<<"$o2" && ! grep -q "run_dir=" <<<"$o2" &&
       no_slurm_tenant "$RUN/$UUID0"; then
      ok batch-env
    else
      fail batch-env "GPU 0's job: $(tr '\n' '|' <<<"$o1" | cut -c1-300); no GPU's: $(tr '\n' '|' <<<"$o2" | cut -c1-300)"
    fi
  fi
else
  skip per-gpu "mknod is not allowed here: Slurm needs a character device per GPU"
  skip no-broker "mknod is not allowed here: Slurm needs a character device per GPU"
  skip batch-env "mknod is not allowed here: Slurm needs a character device per GPU"
fi

[ -n "$first_alloc_ms" ] &&
  echo "check-slurm: figure: srun --gpu-mem to the job's session (its first allocation follows): $first_alloc_ms ms"
[ -n "${scancel_ms:-}" ] &&
  echo "check-slurm: figure: scancel to the tenant's removal and its memory back: $scancel_ms ms"

# cleanup: stop everything, then look for what survived.
left=$(printf '%s\n' "${PIDS[@]}")
trap - EXIT
cleanup
survivors=""
for p in $left; do kill -0 "$p" 2>/dev/null && survivors="$survivors $p"; done
if [ -z "$survivors" ]; then ok cleanup; else fail cleanup "still running:$survivors"; fi
summary
