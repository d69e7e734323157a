#!/bin/sh
# tests/k8s/device_plugin.sh BUILD_DIR - gmb-device-plugin against the test
# kubelet (test_device_plugin.py): Debian's python3 with python3-grpcio and
# python3-protobuf (deploy/install-deps.sh installs them).  Debian's
# interpreter is asked for by path: another python3 first on PATH (pyenv)
# does not see Debian's modules.
set -eu
PY=/usr/bin/python3
if ! "$PY" -c 'import grpc, google.protobuf' 2>/dev/null; then
  echo "device_plugin.sh: skipped: $PY lacks python3-grpcio or python3-protobuf"
  exit 0
fi
exec "$PY" -B "$(dirname "$0")/test_device_plugin.py" "$1"
