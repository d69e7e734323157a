#!/bin/bash
# run.sh [BUILD] - the GPU tests (GPU.md step 3), for the device machine:
#
#   set -o pipefail; bash tests/gpu/run.sh 2>&1 | tee $OUT/gpu.log
#
# after `make gpu-bundle` here and `run` with carry ["build"].  Starts
# gmb-broker --device cuda:0 (and cuda:1 when there is one), runs the
# driver-level figures
# (build/gpu/gpu_figures: cuMemAlloc latency, a VMM segment's cost, the
# import + map of an exported descriptor in another process at 2 MiB,
# 256 MiB and 8 GiB with checked bytes, cuMemcpyDtoD GB/s), clients of two
# tenants with quotas, a kill -9 reclaim, a compaction, the PyTorch and
# preload parts when their libraries exist, and stops the broker; then
# checks the broker's log for device errors.  Prints FIGURE lines and one
# PASS/FAIL/SKIP line per part; exits 0 only when nothing failed.
# Without a GPU it says "no GPU" and exits 2 at once.  REHEARSE=1 with
# GMB_LIBCUDA=build/fakecuda/libcuda.so.1 rehearses it on the fake driver.
set -u
B=${1:-build}
export LD_LIBRARY_PATH="$PWD/$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# REHEARSE=1: a dry run here on the fake driver ($GMB_LIBCUDA kept, no
# nvidia-smi); figures are then meaningless.
[ "${REHEARSE:-0}" = 1 ] || unset GMB_LIBCUDA
fails=0
pass() { echo "PASS $*"; }
fail() { echo "FAIL $*"; fails=$((fails + 1)); }
skip() { echo "SKIP $*"; }

if [ "${REHEARSE:-0}" = 1 ]; then nvidia-smi() { echo "fake GPU (rehearsal)"; }
elif ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "run.sh: no GPU (nvidia-smi finds none): nothing to test here" >&2
  exit 2
fi
for f in gmb-broker gmbctl gpu/gpu_figures examples/job; do
  [ -x "$B/$f" ] || { echo "run.sh: $B/$f missing: run make gpu-bundle first" >&2; exit 1; }
done
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv
echo "FIGURE nvidia-smi $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1)"

# 1. The driver itself, without the broker.
if "$B/gpu/gpu_figures"; then pass "driver figures and descriptor imports"; else fail "gpu_figures"; fi

# 2. A broker on cuda:0 with two tenants.
RUN=$(mktemp -d /tmp/gmb-gpu-XXXXXX)
cat > "$RUN/gmb.ini" <<INI
[broker]
device = cuda:0
capacity = 8GiB
device_reserve = 1GiB
run_dir = $RUN

[tenant:a]
quota = 4GiB

[tenant:b]
quota = 2GiB

[tenant:tiny]
quota = 128MiB
INI
"$B/gmb-broker" --config "$RUN/gmb.ini" --log-level info >"$RUN/broker.log" 2>&1 &
BROKER=$!
for _ in $(seq 100); do [ -S "$RUN/broker.sock" ] && break; sleep 0.1; done
if ! kill -0 $BROKER 2>/dev/null; then
  fail "broker did not start:"; cat "$RUN/broker.log"; exit 1
fi
ctl() { "$B/gmbctl" --run-dir "$RUN" "$@"; }
ctl status && pass "broker status" || fail "gmbctl status"
ctl status | grep -q "cuda:0" && pass "status names cuda:0" || fail "status does not name cuda:0"
# Identity: the broker names the GPU by the UUID nvidia-smi gives it.
uuid0=$(nvidia-smi --query-gpu=uuid --format=csv,noheader -i 0 2>/dev/null | head -1)
if [ -n "$uuid0" ] && grep -q "$uuid0" "$RUN/broker.log"; then pass "broker names $uuid0"
else fail "broker log does not name the GPU's UUID ($uuid0)"; fi
export GMB_ENDPOINT="ipc://$RUN/broker.sock"

# Several clients of two tenants allocating real device memory at once.
pids=()
# --touch writes and reads every byte by copies (gmb_write/gmb_read).
for i in 1 2 3; do "$B/examples/job" --tenant a --touch --hold-ms 500 256MiB 64MiB 1MiB & pids+=($!); done
for i in 1 2; do "$B/examples/job" --tenant b --touch --hold-ms 500 512MiB 4MiB & pids+=($!); done
ok=1; for p in "${pids[@]}"; do wait "$p" || ok=0; done
[ $ok = 1 ] && pass "5 clients, 2 tenants" || fail "concurrent clients"

# Quota: tenant b (2GiB) is refused 3GiB (exit 3).
"$B/examples/job" --tenant b 3GiB; rc=$?
[ $rc = 3 ] && pass "quota refuses 3GiB to b" || fail "quota: job exited $rc, want 3"

# kill -9 reclaim: a job holding 1GiB dies; its memory comes back.
"$B/examples/job" --tenant a --hold-ms -1 1GiB & victim=$!
sleep 1; kill -9 $victim; wait $victim 2>/dev/null
sleep 1
ctl tenants 2>/dev/null | tee "$RUN/tenants.txt"
"$B/examples/job" --tenant a 3GiB && pass "kill -9 reclaim (3GiB fits again)" || fail "reclaim after kill -9"

# Compaction over real device memory: frag fills movable blocks by copies,
# frees every other one, asks for a large range and reads every surviving
# block back by copies after the moves.
if [ -x "$B/examples/frag" ]; then
  "$B/examples/frag" --tenant a >"$RUN/frag.txt" 2>&1 && pass "frag example" || { fail "frag example"; cat "$RUN/frag.txt"; }
fi
ctl compact && pass "gmbctl compact" || fail "gmbctl compact"

# Client-side CUDA tests of the other modules, when built.
for t in "$B"/gpu/gpu_client*; do
  [ -x "$t" ] || continue
  "$t" && pass "$(basename "$t")" || fail "$(basename "$t")"
done
# PyTorch through the allocator: math in broker memory, the OOM path as a
# RuntimeError, a graph capture (tests/gpu/torch_job.py).
if [ -f "$B/libgmb-torch.so" ] && python3 -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null; then
  GMB_TENANT=a timeout 180 python3 tests/gpu/torch_job.py "$PWD/$B/libgmb-torch.so" && pass "PyTorch job" || fail "PyTorch job"
  # What the pluggable allocator cannot do (memory stats, multiprocessing
  # sharing): its own broker, in a run dir of its own.
  GMB_TENANT=pytest timeout 120 python3 -B tests/python/test_gmb_torch.py "$B" && pass "PyTorch unsupported features" || fail "PyTorch unsupported features"
else skip "PyTorch: libgmb-torch.so or torch.cuda missing"; fi
# An unmodified program built with nvcc -cudart shared under the preload.
APP="$RUN/preload_app"
if command -v nvcc >/dev/null 2>&1; then nvcc -cudart shared -o "$APP" tests/gpu/preload_app.cu || fail "nvcc preload_app"; fi
if [ -f "$B/libgmb-preload.so" ] && [ -x "$APP" ]; then
  GMB_TENANT=a GMB_PRELOAD_VERBOSE=1 LD_PRELOAD="$PWD/$B/libgmb-preload.so" "$APP" && pass "preload app" || fail "preload app"
else skip "preload: libgmb-preload.so or nvcc missing"; fi
# The same program as nvcc builds it by default, on the static runtime
# (no dynamic cudaMalloc: the runtime reaches the driver through
# cuGetProcAddress, docs/preload.md).  Under tenant a it runs in broker
# memory; under tenant tiny (128MiB) its 256MiB cudaMalloc must be refused,
# which only happens when the allocation reached gmb.
SAPP="$RUN/preload_app_static"
if command -v nvcc >/dev/null 2>&1; then nvcc -o "$SAPP" tests/gpu/preload_app.cu || fail "nvcc preload_app (static cudart)"; fi
if [ -f "$B/libgmb-preload.so" ] && [ -x "$SAPP" ]; then
  if nm -D "$SAPP" 2>/dev/null | grep -q ' U cudaMalloc'; then fail "preload_app_static links a dynamic cudart"; fi
  GMB_TENANT=a GMB_PRELOAD_VERBOSE=1 LD_PRELOAD="$PWD/$B/libgmb-preload.so" "$SAPP" && pass "preload app, static cudart" || fail "preload app, static cudart"
  if GMB_TENANT=tiny GMB_PRELOAD_VERBOSE=1 LD_PRELOAD="$PWD/$B/libgmb-preload.so" "$SAPP" 2>"$RUN/static_tiny.err"; then
    fail "static cudart under a 128MiB quota got 256MiB: the preload was bypassed"
  elif grep -q "GMB_E_QUOTA" "$RUN/static_tiny.err"; then pass "static cudart held to its quota"
  else fail "static cudart under tenant tiny failed otherwise:"; cat "$RUN/static_tiny.err"; fi
  # NVML under the preload (nvidia-smi loads libnvidia-ml.so.1): the
  # tenant's quota as total.  Reported, not required: an nvidia-smi that
  # reaches NVML another way is out of the preload's reach.
  echo "FIGURE nvidia-smi memory.total under the preload, tenant tiny: $(GMB_TENANT=tiny LD_PRELOAD="$PWD/$B/libgmb-preload.so" nvidia-smi --query-gpu=memory.total --format=csv,noheader -i 0 2>&1 | head -1) (128 MiB when NVML is interposed)"
else skip "preload, static cudart: libgmb-preload.so or nvcc missing"; fi

# A second GPU, if any: its own broker and run dir; a client that sees it
# as its ordinal 0 (CUDA_VISIBLE_DEVICES=1) finds it by UUID.
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  RUN1=$(mktemp -d /tmp/gmb-gpu1-XXXXXX)
  "$B/gmb-broker" --device cuda:1 --run-dir "$RUN1" >"$RUN1/broker.log" 2>&1 & B1=$!
  for _ in $(seq 100); do [ -S "$RUN1/broker.sock" ] && break; sleep 0.1; done
  CUDA_VISIBLE_DEVICES=1 GMB_ENDPOINT="ipc://$RUN1/broker.sock" "$B/examples/job" --touch 256MiB \
    && pass "second GPU by UUID under CUDA_VISIBLE_DEVICES=1" || fail "second GPU"
  CUDA_VISIBLE_DEVICES=0 GMB_ENDPOINT="ipc://$RUN1/broker.sock" "$B/examples/job" 1MiB; rc=$?
  [ $rc = 1 ] && pass "GPU 1's broker refused where only GPU 0 is visible" || fail "wrong-GPU client: exit $rc, want 1"
  kill -TERM $B1; wait $B1 || fail "second broker exit status"
  rm -rf "$RUN1"
else skip "second GPU: only one"; fi

nvidia-smi --query-gpu=memory.used --format=csv,noheader | sed 's/^/FIGURE memory.used_with_broker /'
kill -TERM $BROKER; wait $BROKER; rc=$?
[ $rc = 0 ] && pass "broker stopped cleanly" || fail "broker exit status $rc"
if grep -E "error|ASSERT" "$RUN/broker.log"; then fail "errors in the broker log"; else pass "broker log clean"; fi
tail -n 20 "$RUN/broker.log"
echo "run.sh: $fails failure(s)"
[ $fails = 0 ]
