#!/bin/bash
# run.sh OUT - the GPU checks (GPU.md), one command on the GPU machine:
#
#   here:  make gpu-bundle          (prints the carry list and its size)
#   there: run(command="bash tests/gpu/run.sh $OUT", carry=["build/gpu-bundle"])
#
# Everything it runs comes from build/gpu-bundle (GMB_GPU_BUNDLE), whose
# binaries find their libraries through their RPATH: nothing is put on
# LD_LIBRARY_PATH, so python, nvcc and the programs under the preload shim
# use the machine's own libraries.  It starts its brokers, runs the
# clients, stops the brokers and leaves no process behind; it writes
# OUT/gpu.log (all it prints) and OUT/figures.txt (the FIGURE lines).
# One line per check: PASS, FAIL, or (rehearsal only) NOTRUN; a check
# that must work on a GPU and cannot run there is a FAIL, never a skip.
# The last line: "run.sh: P passed, F failed, N not run"; exit 0 only
# when nothing failed.  About 8 minutes at most: each step has a time
# limit, and a step that would start past the budget fails as such.
#
# GMB_GPU_REHEARSE=1 rehearses it here, on the stand-in driver
# (build/fakecuda/libcuda.so.1, GMB_LIBCUDA) with sizes scaled down, no
# nvidia-smi, and the steps the stand-in cannot run (PyTorch, a CUDA
# runtime program) reported NOTRUN after what can be checked of them
# (the Python compiles, nvcc builds the program).  `make gpu-rehearse`;
# `make check` runs it through tests/gpu_rehearse.sh without the nvcc
# builds (GMB_GPU_REHEARSE_NVCC=0).  GMB_GPU_BUDGET_S: the time budget
# (470 s).
set -u
OUT=${1:?usage: run.sh OUT (a directory for gpu.log and figures.txt)}
mkdir -p "$OUT" || exit 1
OUT=$(cd "$OUT" && pwd)
B=${GMB_GPU_BUNDLE:-build/gpu-bundle}
REHEARSE=${GMB_GPU_REHEARSE:-0}
BUDGET=${GMB_GPU_BUDGET_S:-470}
FIG="$OUT/figures.txt"
: >"$FIG"
exec > >(tee "$OUT/gpu.log") 2>&1
T0=$(date +%s)
npass=0; nfail=0; nnot=0
pass() { echo "PASS $*"; npass=$((npass + 1)); }
fail() { echo "FAIL $*"; nfail=$((nfail + 1)); }
notrun() { echo "NOTRUN $* (rehearsal)"; nnot=$((nnot + 1)); }
figure() { echo "FIGURE $*"; echo "$*" >>"$FIG"; }
elapsed() { echo $(($(date +%s) - T0)); }
# left S: seconds a step may take, or 0 when the budget is spent.
left() { local l=$((BUDGET - $(elapsed))); [ $l -gt "$1" ] && echo "$1" || echo $((l > 0 ? l : 0)); }
# run_t S CMD...: CMD under a time limit of S seconds (less when the
# budget is nearly spent); 124 when it ran out.
run_t() {
  local s; s=$(left "$1"); shift
  [ "$s" -gt 0 ] || { echo "run.sh: out of time before: $*"; return 124; }
  timeout -k 5 "$s" "$@"
}
section() { echo; echo "== $* ($(elapsed) s)"; }

BROKERS=()
RUNDIRS=()
# stop_pid PID S: SIGTERM to a child of run.sh, SIGKILL if it is still
# there after S seconds (a broker stuck in a driver call must not hold the
# GPU machine's time), then its exit status (137 when it was killed).
stop_pid() {
  local p=$1 i
  kill -TERM "$p" 2>/dev/null
  for ((i = 0; i < $2 * 10; i++)); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$p" 2>/dev/null; then
    echo "run.sh: pid $p still there $2 s after SIGTERM: SIGKILL"
    kill -KILL "$p" 2>/dev/null
  fi
  wait "$p" 2>/dev/null
}
# Stops what run.sh started, each by its pid, and waits for each: never a
# bare `wait`, which would also wait for the log's tee (a process
# substitution reading run.sh's own output) and so forever.
cleanup() {
  local p
  for p in $(jobs -p); do
    [[ " ${BROKERS[*]} " == *" $p "* ]] || kill -KILL "$p" 2>/dev/null
  done
  for p in "${BROKERS[@]}"; do stop_pid "$p" 10; done
  for p in $(jobs -p); do wait "$p" 2>/dev/null; done
  for d in "${RUNDIRS[@]}"; do rm -rf "$d"; done
}
trap cleanup EXIT

# --- the machine ------------------------------------------------------------
MIB=$((1 << 20)); GIB=$((1 << 30))
if [ "$REHEARSE" = 1 ]; then
  # The stand-in: a device of its own, contexts that cost memory, sizes a
  # shared build machine can hold (memfd pages are its RAM).
  export GMB_LIBCUDA=${GMB_LIBCUDA:-$PWD/build/fakecuda/libcuda.so.1}
  FAKECUDA_DIR=$(mktemp -d /tmp/gmb-rehearse-XXXXXX); RUNDIRS+=("$FAKECUDA_DIR")
  export FAKECUDA_DIR FAKECUDA_TOTAL=1g FAKECUDA_CTX_COST=8m
  U=$((16 * MIB))            # the unit of the quota and reclaim cases
  SMALL_CAP=64MiB; FRESH=$((62 * MIB))
  FRAG_ARGS=""               # frag's defaults fill a 64 MiB broker
  CTXFREE="16MiB 20"; BENCH="2MiB 50"; IMPORTS=2; SLEEP="32MiB 3"; OFFLOAD=32MiB
  nvidia-smi() {
    case "$*" in
      *uuid*) echo "GPU-46414b45-4355-4441-0000-000000000000" ;;
      -L) echo "GPU 0: fakecuda 0 (rehearsal)" ;;
      *memory.used*) echo "0 MiB" ;;
      *) echo "fakecuda 0 (rehearsal), 1024 MiB, 0" ;;
    esac
  }
  echo "run.sh: REHEARSAL on the stand-in driver $GMB_LIBCUDA: figures are meaningless"
else
  unset GMB_LIBCUDA
  U=$GIB
  SMALL_CAP=1GiB; FRESH=$((1022 * MIB))
  FRAG_ARGS="--block 1MiB --fill 960MiB --big 512MiB"
  CTXFREE="1GiB 200"; BENCH="2MiB 200"; IMPORTS=2,256,8192; SLEEP="256MiB 5"
  OFFLOAD=1GiB
  if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "run.sh: no GPU (nvidia-smi finds none)"
    fail "a GPU: nvidia-smi finds none"
    echo "run.sh: $npass passed, $nfail failed, $nnot not run"
    exit 1
  fi
fi
for f in gmb-broker gmbctl libgmb-torch.so libgmb-preload.so examples/job \
         examples/frag gpu/gpu_figures gpu/gpu_checks; do
  [ -e "$B/$f" ] || { fail "bundle: $B/$f missing (make gpu-bundle, carry [\"$B\"])"; exit 1; }
done
unset GMB_ENDPOINT GMB_TENANT GMB_RUN_DIR GMB_TOKEN GMB_TOKEN_FILE LD_LIBRARY_PATH

section "machine"
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv
figure "device $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1)"
echo "glibc here: $(ldd --version 2>/dev/null | head -1)"
if "$B/gmbctl" --help >/dev/null 2>&1; then pass "bundle runs here (its libraries by RPATH)"
else fail "bundle does not run here:"; "$B/gmbctl" --help 2>&1 | head -3; fi

# --- 1. the driver alone ------------------------------------------------------
section "driver figures (gpu_figures)"
if IMPORT_MIB=$IMPORTS run_t 90 "$B/gpu/gpu_figures" >"$OUT/gpu_figures.txt" 2>&1; then
  pass "driver: cuMemAlloc, VMM segments, imports of $IMPORTS MiB in another process, bytes checked both ways"
else fail "gpu_figures:"; fi
cat "$OUT/gpu_figures.txt"
sed -n 's/^FIGURE //p' "$OUT/gpu_figures.txt" >>"$FIG"
ctx_mib=$(sed -n 's/^FIGURE context_MiB //p' "$OUT/gpu_figures.txt")
dtod=$(sed -n 's/^FIGURE cuMemcpyDtoD_[0-9]*MiB_GBps //p' "$OUT/gpu_figures.txt")

# --- brokers ----------------------------------------------------------------------
# start_broker NAME CONFIG-BODY: a broker on cuda:0 in a run dir of its own;
# sets RUN_<NAME>.
start_broker() {
  local name=$1 run; run=$(mktemp -d /tmp/gmb-gpu-XXXXXX); RUNDIRS+=("$run")
  printf '[broker]\ndevice = cuda:0\nrun_dir = %s\n%s\n' "$run" "$2" >"$run/gmb.ini"
  "$B/gmb-broker" --config "$run/gmb.ini" --log-level info >"$run/broker.log" 2>&1 &
  local pid=$!
  BROKERS+=("$pid")
  for _ in $(seq 300); do [ -S "$run/broker.sock" ] && break; kill -0 $pid 2>/dev/null || break; sleep 0.1; done
  eval "RUN_$name=$run PID_$name=$pid"
  if [ -S "$run/broker.sock" ]; then pass "broker $name started on cuda:0"
  else fail "broker $name did not start:"; cat "$run/broker.log"; return 1; fi
}
ctl() { local run=$1; shift; run_t 30 "$B/gmbctl" --run-dir "$run" "$@"; }
# used RUN TENANT: the tenant's bytes in use, as the broker counts them.
used() {
  ctl "$1" --json status | python3 -c '
import json, sys
d = json.load(sys.stdin)
print(next((t["used"] for t in d["tenants"] if t["name"] == sys.argv[1]), 0))' "$2"
}
job() { run_t 60 "$B/examples/job" "$@"; }
# until_used RUN TENANT OP BYTES: polls (10 s at most) until the tenant's
# bytes in use compare so (-ge, -eq); prints them.
until_used() {
  local end=$(($(date +%s) + 10)) u
  while :; do
    u=$(used "$1" "$2"); [ -n "$u" ] && [ "$u" "$3" "$4" ] && break
    [ "$(date +%s)" -ge $end ] && break
    sleep 0.1
  done
  echo "${u:-?}"
}

section "broker A (cuda:0, device_reserve auto)"
start_broker A "$(printf '%s\n' 'capacity = 32GiB' '[tenant:a]' 'quota = 8GiB' \
  '[tenant:b]' 'quota = 2GiB' '[tenant:tiny]' 'quota = 128MiB' \
  '[tenant:q]' "quota = $((2 * U))" '[tenant:r]' "quota = $((4 * U))")" || exit 1
A=$RUN_A
export GMB_ENDPOINT="ipc://$A/broker.sock"
ctl "$A" status | head -3
ctl "$A" status | grep -q "cuda:0" && pass "status names cuda:0" || fail "status does not name cuda:0"
uuid0=$(nvidia-smi --query-gpu=uuid --format=csv,noheader -i 0 2>/dev/null | head -1)
if [ -n "$uuid0" ] && grep -q "$uuid0" "$A/broker.log"; then pass "broker names $uuid0"
else fail "broker log does not name the GPU's UUID ($uuid0)"; fi
# device_reserve auto: the broker measured a context; on a GPU one costs
# hundreds of MiB, and 0 would mean the measurement saw nothing.
line=$(grep -o "a CUDA context costs [^:]*" "$A/broker.log" | head -1)
echo "broker: $line"
bctx=$(echo "$line" | sed -n 's/a CUDA context costs \([^ ]*\) here.*/\1/p')
figure "broker_measured_context $bctx (gpu_figures: ${ctx_mib:-?} MiB)"
case "$bctx" in
  ""|0B|0) fail "device_reserve auto measured no context cost ('$line')" ;;
  *) pass "device_reserve auto: a context measured at $bctx, 8 kept" ;;
esac
echo "NOTE for GPU.md/docs: a bare context costs ${ctx_mib:-?} MiB here; device_reserve auto keeps client_contexts (8) of them"

section "clients of two tenants"
pids=()
for i in 1 2 3; do job --tenant a --touch --hold-ms 300 $((U / 4)) $((U / 16)) $MIB & pids+=($!); done
for i in 1 2; do job --tenant b --touch --hold-ms 300 $((U / 2)) $((4 * MIB)) & pids+=($!); done
ok=1; for p in "${pids[@]}"; do wait "$p" || ok=0; done
[ $ok = 1 ] && pass "5 clients of 2 tenants wrote and read back every byte" || fail "concurrent clients"

section "quota (tenant q: $((2 * U / MIB)) MiB)"
job --tenant q $((2 * U)) >"$OUT/q1.txt" 2>&1 && pass "quota: exactly the quota is served" \
  || { fail "quota: exactly the quota refused"; cat "$OUT/q1.txt"; }
job --tenant q $((2 * U + 1)) >"$OUT/q2.txt" 2>&1; rc=$?
if [ $rc = 3 ] && grep -q GMB_E_QUOTA "$OUT/q2.txt"; then pass "quota: one byte over is GMB_E_QUOTA"
else fail "quota: one byte over: exit $rc"; cat "$OUT/q2.txt"; fi
# Held by a process of its own (not under timeout: the signal must reach
# the job itself; cleanup kills it if run.sh stops early).
"$B/examples/job" --tenant q --hold-ms -1 "$U" >"$OUT/q3h.txt" 2>&1 & holder=$!
until_used "$A" q -ge "$U" >/dev/null
job --tenant q $((3 * U / 2)) >"$OUT/q3.txt" 2>&1; rc=$?
stop_pid $holder 10
until_used "$A" q -eq 0 >/dev/null
job --tenant q $((3 * U / 2)) >"$OUT/q4.txt" 2>&1; rc2=$?
if [ $rc = 3 ] && grep -q GMB_E_QUOTA "$OUT/q3.txt" && [ $rc2 = 0 ]; then
  pass "quota: what another process of the tenant holds counts; served once it freed"
else fail "quota across processes: exit $rc then $rc2"; cat "$OUT/q3.txt" "$OUT/q4.txt"; fi

section "kill -9 reclaim (tenant r: $((4 * U / MIB)) MiB)"
"$B/examples/job" --tenant r --hold-ms -1 $((3 * U)) >"$OUT/victim.txt" 2>&1 & victim=$!
u0=$(until_used "$A" r -ge $((3 * U)))
ctl "$A" tenants >"$OUT/tenants.txt"
job --tenant r $((3 * U)) >"$OUT/r1.txt" 2>&1; rc=$?
kill -9 $victim; wait $victim 2>/dev/null; st=$?
u=$(until_used "$A" r -eq 0)
ctl "$A" tenants >>"$OUT/tenants.txt"
cat "$OUT/tenants.txt"
job --tenant r $((3 * U)) >"$OUT/r2.txt" 2>&1; rc2=$?
echo "r: $u0 bytes held; a second $((3 * U)) exit $rc; victim status $st (137: SIGKILL); then $u bytes; then exit $rc2"
if [ "$u0" -ge $((3 * U)) ] && [ $rc = 3 ] && [ $st = 137 ] && [ "$u" = 0 ] && [ $rc2 = 0 ]; then
  pass "kill -9 reclaim: $((3 * U / MIB)) MiB refused while held, used back to 0 after the kill, then served"
else fail "kill -9 reclaim: refused-while-held exit $rc (want 3), used after kill $u (want 0), then exit $rc2 (want 0)"; fi

section "gmb_free waits for the program's own context"
if GMB_TENANT=a run_t 60 "$B/gpu/gpu_checks" ctx-free $CTXFREE; then
  pass "gmb_free waited for work queued in a context of the program's own"
else fail "gmb_free returned before work in the program's context finished"; fi

section "figures: alloc+free"
if GMB_TENANT=a run_t 60 "$B/gpu/gpu_checks" bench $BENCH >"$OUT/bench.txt" 2>&1; then
  pass "alloc+free figures"; else fail "gpu_checks bench"; fi
cat "$OUT/bench.txt"; sed -n 's/^FIGURE //p' "$OUT/bench.txt" >>"$FIG"

section "figures: sleep and wake (gmb_pause offload, gmb_resume)"
if GMB_TENANT=a run_t 90 "$B/gpu/gpu_checks" sleep $SLEEP >"$OUT/sleep.txt" 2>&1; then
  pass "sleep: ${SLEEP% *} offloaded to pinned host memory and restored, every byte checked"
else fail "sleep: gpu_checks sleep $SLEEP:"; fi
cat "$OUT/sleep.txt"; sed -n 's/^FIGURE //p' "$OUT/sleep.txt" >>"$FIG"

section "the broker offloads movable allocations (tenant o: $OFFLOAD)"
if GMB_TENANT=o run_t 90 "$B/gpu/gpu_checks" offload $OFFLOAD "$B/gmbctl" "$A" \
    >"$OUT/offload.txt" 2>&1; then
  pass "broker offload: movable allocations to page-locked host memory and back at gmb_lock, every byte checked"
else fail "broker offload: gpu_checks offload (below)"; fi
cat "$OUT/offload.txt"; sed -n 's/^FIGURE //p' "$OUT/offload.txt" >>"$FIG"

# --- a small broker: memory comes round again, compaction must move -----
section "broker S (capacity $SMALL_CAP): fresh memory, compaction"
start_broker S "$(printf '%s\n' "capacity = $SMALL_CAP" 'compaction = auto' \
  '[tenant:fa]' '[tenant:fb]' '[tenant:x]')"
S=$RUN_S
if [ -n "$S" ]; then
  E="ipc://$S/broker.sock"
  if GMB_ENDPOINT=$E GMB_TENANT=fa run_t 60 "$B/gpu/gpu_checks" fresh-write $FRESH &&
     GMB_ENDPOINT=$E GMB_TENANT=fb run_t 60 "$B/gpu/gpu_checks" fresh-read $FRESH; then
    pass "fresh memory: tenant fb read $((FRESH / MIB)) MiB after fa freed its own; none of fa's bytes"
  else fail "fresh memory: the second tenant saw the first one's bytes, or a step failed"; fi
  GMB_ENDPOINT=$E run_t 120 "$B/examples/frag" --tenant x --wait-ms 10000 $FRAG_ARGS >"$OUT/frag.txt" 2>&1; rc=$?
  cat "$OUT/frag.txt"
  moved=$(sed -n 's/^frag: \([0-9]*\) allocations moved, all bytes intact$/\1/p' "$OUT/frag.txt")
  if [ $rc = 0 ] && [ "${moved:-0}" -gt 0 ]; then
    pass "compaction: $moved allocations moved to serve a request no hole could, every byte checked after"
  else fail "compaction: frag exit $rc, moved '${moved:-none}' (want > 0, bytes intact)"; fi
  ctl "$S" --json status | python3 -c '
import json, sys
c = json.load(sys.stdin)["compaction"]
gbs = c["bytes_moved"] / c["seconds"] / 1e9 if c["seconds"] > 0 else 0
print("compaction %d moves, %d bytes in %.4f s" % (c["moves"], c["bytes_moved"], c["seconds"]))
print("FIGURE compaction_GBps %.2f (cuMemcpyDtoD %s GB/s)" % (gbs, sys.argv[1] or "?"))' "${dtod:-}" | tee "$OUT/compact.txt"
  sed -n 's/^FIGURE //p' "$OUT/compact.txt" >>"$FIG"
fi

# --- PyTorch --------------------------------------------------------------------
section "PyTorch through libgmb-torch.so"
TORCH_LIB="$PWD/$B/libgmb-torch.so"
if [ "$REHEARSE" = 1 ]; then
  python3 -m py_compile tests/gpu/torch_job.py tests/python/test_gmb_torch.py \
    && pass "torch_job.py and test_gmb_torch.py compile" || fail "torch scripts do not compile"
  notrun "PyTorch: math, OOM, capture of a 256 MiB miss + replay, two streams with record_stream (the stand-in cannot run PyTorch)"
  notrun "PyTorch: what the pluggable allocator cannot do (test_gmb_torch.py)"
elif ! run_t 120 python3 -c 'import torch; assert torch.cuda.is_available(), "no CUDA"; print("torch", torch.__version__, torch.version.cuda)'; then
  fail "PyTorch: import torch / torch.cuda.is_available() failed"
else
  GMB_TENANT=a run_t 180 python3 tests/gpu/torch_job.py "$TORCH_LIB" >"$OUT/torch_job.txt" 2>&1; rc=$?
  cat "$OUT/torch_job.txt"; sed -n 's/^FIGURE //p' "$OUT/torch_job.txt" >>"$FIG"
  [ $rc = 0 ] && pass "PyTorch job (torch_job.py)" || fail "PyTorch job (torch_job.py), exit $rc"
  GMB_TENANT=pytest run_t 120 python3 -B tests/python/test_gmb_torch.py "$PWD/$B" >"$OUT/torch_py.txt" 2>&1; rc=$?
  tail -n 15 "$OUT/torch_py.txt"
  if [ $rc = 0 ] && ! grep -q "skipped=" "$OUT/torch_py.txt"; then pass "PyTorch: what the pluggable allocator cannot do"
  else fail "test_gmb_torch.py: exit $rc or tests skipped on a GPU"; fi
fi

# --- an unmodified program under the preload -------------------------------
section "preload: nvcc programs (default static runtime, and -cudart shared)"
PRE="$PWD/$B/libgmb-preload.so"
NVCC=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
APPD=$(mktemp -d /tmp/gmb-app-XXXXXX); RUNDIRS+=("$APPD")
if [ "$REHEARSE" = 1 ] && [ "${GMB_GPU_REHEARSE_NVCC:-1}" = 0 ]; then
  notrun "nvcc builds of preload_app (GMB_GPU_REHEARSE_NVCC=0; make gpu-rehearse builds them)"
elif [ -x "$NVCC" ] && run_t 120 "$NVCC" -o "$APPD/static" tests/gpu/preload_app.cu &&
   run_t 120 "$NVCC" -cudart shared -o "$APPD/shared" tests/gpu/preload_app.cu; then
  if nm -D "$APPD/static" 2>/dev/null | grep -q ' U cudaMalloc'; then
    fail "preload_app (default) links a dynamic cudart"
  else pass "nvcc built preload_app on the static runtime and with -cudart shared"; fi
  if [ "$REHEARSE" = 1 ]; then
    notrun "preload_app under the preload (the stand-in cannot run the CUDA runtime)"
  else
    for v in static shared; do
      GMB_TENANT=a GMB_PRELOAD_VERBOSE=1 LD_PRELOAD="$PRE" run_t 60 "$APPD/$v" \
        && pass "preload: $v runtime: 256 MiB from the broker, written by a kernel, read back" \
        || fail "preload app ($v runtime)"
    done
    # Under a 128 MiB quota its 256 MiB must be refused: proof that the
    # allocation reached gmb rather than the driver.
    if GMB_TENANT=tiny GMB_PRELOAD_VERBOSE=1 LD_PRELOAD="$PRE" run_t 60 "$APPD/static" 2>"$OUT/static_tiny.err"; then
      fail "static runtime under a 128 MiB quota got 256 MiB: the preload was bypassed"
    elif grep -q "GMB_E_QUOTA" "$OUT/static_tiny.err"; then pass "preload: static runtime held to its quota"
    else fail "static runtime under tenant tiny failed otherwise:"; cat "$OUT/static_tiny.err"; fi
    figure "nvidia-smi_total_under_preload_tiny $(GMB_TENANT=tiny LD_PRELOAD="$PRE" run_t 30 nvidia-smi --query-gpu=memory.total --format=csv,noheader -i 0 2>&1 | head -1) (128 MiB when NVML is interposed)"
  fi
else fail "nvcc ($NVCC) missing or failed to build tests/gpu/preload_app.cu"; fi

# --- a second GPU, if any ---------------------------------------------------------
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  section "second GPU"
  RUN1=$(mktemp -d /tmp/gmb-gpu1-XXXXXX); RUNDIRS+=("$RUN1")
  "$B/gmb-broker" --device cuda:1 --run-dir "$RUN1" >"$RUN1/broker.log" 2>&1 & B1=$!
  BROKERS+=("$B1")
  for _ in $(seq 100); do [ -S "$RUN1/broker.sock" ] && break; sleep 0.1; done
  CUDA_VISIBLE_DEVICES=1 GMB_ENDPOINT="ipc://$RUN1/broker.sock" job --touch 256MiB \
    && pass "second GPU by UUID under CUDA_VISIBLE_DEVICES=1" || fail "second GPU"
  CUDA_VISIBLE_DEVICES=0 GMB_ENDPOINT="ipc://$RUN1/broker.sock" job 1MiB; rc=$?
  [ $rc = 1 ] && pass "GPU 1's broker refused where only GPU 0 is visible" || fail "wrong-GPU client: exit $rc, want 1"
fi

# --- stop -----------------------------------------------------------------------
section "stop"
nvidia-smi --query-gpu=memory.used --format=csv,noheader | head -1 | sed 's/^/memory.used with the brokers: /'
for p in "${BROKERS[@]}"; do
  stop_pid "$p" 20; rc=$?
  [ $rc = 0 ] && pass "broker $p stopped cleanly" || fail "broker $p exit status $rc"
done
BROKERS=()
for d in "${RUNDIRS[@]}"; do
  [ -f "$d/broker.log" ] || continue
  if grep -E "error|ASSERT" "$d/broker.log"; then fail "errors in $d/broker.log"; tail -n 20 "$d/broker.log"
  else pass "broker log $(basename "$d") clean"; fi
done
echo
echo "figures ($FIG):"; cat "$FIG"
echo "run.sh: $npass passed, $nfail failed, $nnot not run, $(elapsed) s"
[ $nfail = 0 ]
