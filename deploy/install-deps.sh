#!/bin/sh
# Installs the Debian packages gmb needs to build and test, when they are
# missing.  As root it runs apt-get; otherwise it names what to install and
# fails.  `make` runs it before building; it is quiet when all is there.
#
#   sh deploy/install-deps.sh           what `make` and `make check` need
#   sh deploy/install-deps.sh --slurm   and Slurm, munge and spank.h, for
#                                       gmb_spank.so and `make check-slurm`
#                                       (docs/slurm.md)
#
# Packages installed with --slurm start no service (a policy-rc.d says so
# while apt-get runs, when the machine has none): check-slurm runs its own
# munged, slurmctld and slurmd from a private directory.
set -eu

PKGS="build-essential pkg-config libzmq3-dev libprotobuf-c-dev protobuf-c-compiler
check libsubunit-dev libinih-dev libbsd-dev libjansson-dev libssl-dev
libmicrohttpd-dev libgrpc-dev python3-grpcio python3-protobuf patchelf"
SLURM_PKGS="slurm-wlm slurm-client munge libslurm-dev"

services=""
for a in "$@"; do
  case $a in
    --slurm) PKGS="$PKGS $SLURM_PKGS"; services=1 ;;
    *) echo "usage: sh deploy/install-deps.sh [--slurm]" >&2; exit 2 ;;
  esac
done

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
policy=""
if [ -n "$services" ] && [ ! -e /usr/sbin/policy-rc.d ]; then
  printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
  chmod 0755 /usr/sbin/policy-rc.d
  policy=1
  trap 'rm -f /usr/sbin/policy-rc.d' EXIT
fi
# Another engineer's or CI's apt may hold the lock: wait for it (up to
# ten minutes) rather than fail.
apt_run() {
  n=0
  until apt-get -o DPkg::Lock::Timeout=600 "$@" >&2; do
    n=$((n + 1))
    [ "$n" -ge 3 ] && return 1
    sleep 10
  done
}
apt_run update -qq
# shellcheck disable=SC2086
apt_run install -y -qq --no-install-recommends $missing
[ -n "$policy" ] && rm -f /usr/sbin/policy-rc.d
exit 0
