#!/bin/sh
# Installs the Debian packages gmb needs to build and test, when they are
# missing.  As root it runs apt-get; otherwise it names what to install and
# fails.  `make` runs it before building; it is quiet when all is there.
set -eu

PKGS="build-essential pkg-config libzmq3-dev libprotobuf-c-dev protobuf-c-compiler
check libsubunit-dev libinih-dev libbsd-dev libjansson-dev libssl-dev
libmicrohttpd-dev libgrpc-dev python3-grpcio python3-protobuf"

missing=""
for p in $PKGS; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed"; then
    missing="$missing $p"
  fi
done
[ -z "$missing" ] && exit 0

if [ "$(id -u)" != 0 ]; then
  echo "gmb: missing Debian packages:$missing" >&2
  echo "gmb: install them with: sudo apt-get install -y$missing" >&2
  exit 1
fi
echo "gmb: installing missing Debian packages:$missing" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >&2
# shellcheck disable=SC2086
apt-get install -y -qq --no-install-recommends $missing >&2
