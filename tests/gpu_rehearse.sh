#!/bin/sh
# gpu_rehearse.sh BUILD - tests/gpu/run.sh rehearsed on the stand-in driver
# (GMB_GPU_REHEARSE=1), as `make gpu-rehearse` does but lighter: the nvcc
# builds are left to that target (GMB_GPU_REHEARSE_NVCC=0).  Makes the
# bundle first (tests/gpu/bundle.sh: it must fit the 64 MiB that may
# travel); passes when run.sh says "0 failed".  The log is in
# BUILD/gpu-rehearsal/gpu.log.  Skipped under SAN=1: what travels to the
# GPU is the plain build.
set -u
B=${1:-build}
case "$B" in
  */san|san) echo "gpu_rehearse.sh: skipped: the GPU bundle is the plain build's"; exit 0 ;;
esac
sh tests/gpu/bundle.sh "$B" || exit 1
GMB_GPU_REHEARSE=1 GMB_GPU_REHEARSE_NVCC=0 \
  GMB_LIBCUDA="$PWD/$B/fakecuda/libcuda.so.1" GMB_GPU_BUNDLE="$B/gpu-bundle" \
  bash tests/gpu/run.sh "$B/gpu-rehearsal" >/dev/null 2>&1
rc=$?
grep -E "^(PASS|FAIL|NOTRUN|run.sh:)" "$B/gpu-rehearsal/gpu.log"
tail -n 1 "$B/gpu-rehearsal/gpu.log" | grep -q " 0 failed" && [ $rc = 0 ]
