#!/usr/bin/env bash
# check-fresh.sh BUILD_DIR - `make check-fresh`: the README's first lines,
# verbatim, on a fresh Debian 12 as a new user would run them.
#
# A minimal Debian 12 root (`debootstrap --variant=minbase bookworm`, from
# this machine's own apt mirror: deploy/check/lib.sh; kept a day in
# $GMB_DEPLOY_STORE) gets a copy of this tree (the files git tracks or
# does not ignore, as they are now in the work tree; no build/), and each
# command line of the README's first ```sh block runs there as root, in
# turn, from the tree's top: `sh deploy/install-deps.sh && make demo`,
# then `make check`.  Each is timed and must exit 0.  The root runs in a
# mount and PID namespace of its own (unshare): its /proc, /dev, /sys and
# /run mounts vanish with it, and nothing of the machine is changed; its
# /dev/shm is its own (tests count what is named there); it shares the
# machine's network, for apt-get.
#
# Prints "check-fresh: LINE: ok (N s)" or "... FAILED: why" per line, or
# "check-fresh: SKIPPED: why" (not root, no debootstrap, no mirror); the
# exit status is 1 when a line failed.  Needs root, debootstrap and
# unshare (util-linux).  The root is removed afterwards; GMB_FRESH_KEEP=1
# keeps it (in BUILD_DIR/check-fresh/root) to look into.
set -uo pipefail

B=${1:-build}
cd "$(dirname "$0")/../.."
TOP=$PWD
W=$TOP/$B/check-fresh
STORE=${GMB_DEPLOY_STORE:-/var/tmp/gmb-check-deploy}
# shellcheck source=deploy/check/lib.sh
. deploy/check/lib.sh
mkdir -p "$W"

skip() {
  echo "check-fresh: SKIPPED: $1"
  exit 0
}
[ "$(id -u)" = 0 ] || skip "not root: a chroot needs root"
command -v unshare >/dev/null 2>&1 || skip "unshare is not installed (util-linux)"
if ! command -v debootstrap >/dev/null 2>&1; then
  echo "check-fresh: installing debootstrap"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    debootstrap >"$W/apt.log" 2>&1 || skip "debootstrap cannot be installed (log: $W/apt.log)"
fi
tar=$(debian_root bookworm-minbase "$W/debootstrap.log" 2>"$W/why") ||
  skip "$(tail -n 1 "$W/why")"
cat "$W/why"

root=$W/root
cleanup() {
  [ "${GMB_FRESH_KEEP:-0}" = 1 ] || rm -rf "$root"
}
trap cleanup EXIT
rm -rf "$root"
mkdir -p "$root"
tar -C "$root" -xf "$tar"

# The tree as it is now, without build outputs: git's list when this is a
# checkout, else everything but build/ and .git.
mkdir -p "$root/root/gmb"
if git rev-parse --show-toplevel >/dev/null 2>&1; then
  git ls-files -z --cached --others --exclude-standard |
    while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done |
    tar --null -T - -cf - | tar -C "$root/root/gmb" -xf -
else
  tar --exclude=./build --exclude=./.git -cf - . | tar -C "$root/root/gmb" -xf -
fi

# The README's first ```sh block, line by line.
mapfile -t lines < <(awk '/^```sh$/ { n++; next } /^```$/ && n == 1 { exit }
                          n == 1 && NF { print }' README.md)
[ ${#lines[@]} -gt 0 ] || { echo "check-fresh: FAILED: no \`\`\`sh block in README.md"; exit 1; }

failed=0
n=0
total0=$(date +%s)
for line in "${lines[@]}"; do
  n=$((n + 1))
  log=$W/line$n.log
  echo "check-fresh: \$ $line"
  t0=$(date +%s)
  # In namespaces of their own: the mounts below go when it ends.  A
  # clean environment, as a login would give.
  timeout --kill-after=30 3600 unshare --mount --pid --fork --kill-child \
    --propagation private \
    /bin/sh -c '
      r=$1; shift
      mount --rbind /dev "$r/dev" &&
      mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs "$r/dev/shm" &&
      mount -t proc proc "$r/proc" &&
      mount -t sysfs -o ro sysfs "$r/sys" &&
      mount -t tmpfs tmpfs "$r/run" || exit 99
      exec chroot "$r" /usr/bin/env -i HOME=/root TERM=dumb LANG=C.UTF-8 \
        PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        /bin/sh -c "cd /root/gmb && $1"' sh "$root" "$line" >"$log" 2>&1 </dev/null
  rc=$?
  secs=$(( $(date +%s) - t0 ))
  if [ $rc = 0 ]; then
    sum=$(grep -E '^suites: ' "$log" | tail -n 1)
    echo "check-fresh: $line: ok ($secs s${sum:+; $sum})"
  else
    echo "check-fresh: $line: FAILED: exit status $rc after $secs s (log: $log):"
    tail -n 25 "$log" | sed 's/^/    /'
    failed=$((failed + 1))
    break
  fi
done
echo "check-fresh: README's lines in a minbase Debian 12 root: $(( $(date +%s) - total0 )) s in all, $failed failed"
[ $failed = 0 ]
