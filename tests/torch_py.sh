#!/bin/sh
# torch_py.sh - runs tests/python/test_gmb_torch.py (client/python/
# gmb_torch.py, and the PyTorch features the pluggable allocator cannot
# provide).  Where PyTorch with CUDA is missing, the tests that need it are
# skipped and the reason printed.  Usage: sh tests/torch_py.sh BUILD_DIR
if ! command -v python3 >/dev/null 2>&1; then
  echo "torch_py.sh: skipped: no python3"
  exit 0
fi
exec python3 -B tests/python/test_gmb_torch.py "$1"
