# units.sh - sourced by check-deploy.sh (bash): the systemd units under a
# booted systemd.  A Debian 12 root (debootstrap minbase with systemd and
# gmb's run-time libraries, deploy/check/lib.sh) gets gmb as
# docs/operations.md installs it: `make install PREFIX=/usr` (DESTDIR), the
# sysusers file, both units, deploy/gmb.ini.example as /etc/gmb/gmb.ini;
# the template unit gets a drop-in that points the broker at the fake CUDA
# driver (tests/fakecuda), since no GPU is here.  systemd-nspawn boots it
# (--private-network: a network namespace with only loopback, nothing
# added to the host's network; no registration with machined), its
# gmb-unit-check service runs deploy/check/unit-check.sh and makes systemd
# exit with that status.  Uses ok/bad/skip, $W, $B, $STORE of
# check-deploy.sh.

units_in_systemd() {
  local why="" tar root log rc line
  if [ "$(id -u)" != 0 ]; then
    why="not root: systemd-nspawn needs root"
  elif ! have systemd-nspawn; then
    why="systemd-nspawn is not installed (Debian package systemd-container)"
  elif [ ! -x "$B/fakecuda/libcuda.so.1" ] || [ ! -x "$B/examples/job" ]; then
    why="$B/fakecuda/libcuda.so.1 or $B/examples/job is not built (make)"
  elif ! tar=$(debian_root bookworm-systemd "$W/debootstrap-systemd.log" \
      systemd,systemd-sysv,dbus,libzmq5,libprotobuf-c1,libinih1,libjansson4,libmicrohttpd12,libssl3,libbsd0 \
      2>"$W/units.why"); then
    why="no Debian root with systemd: $(tail -n 1 "$W/units.why")"
  fi
  if [ -n "$why" ]; then
    skip "systemd units under a booted systemd" "$why"
    return
  fi
  root=$W/units-root
  rm -rf "$root"
  mkdir -p "$root"
  tar -C "$root" -xf "$tar"
  # As docs/operations.md says.
  if ! make -s install DESTDIR="$root" PREFIX=/usr >"$W/units-install.log" 2>&1; then
    bad "systemd units under a booted systemd" "make install DESTDIR: $W/units-install.log"
    return
  fi
  install -m 0755 "$B/examples/job" "$root/usr/bin/gmb-job"
  install -D -m 0644 deploy/systemd/gmb.sysusers "$root/usr/lib/sysusers.d/gmb.conf"
  install -D -m 0644 deploy/gmb.ini.example "$root/etc/gmb/gmb.ini"
  install -m 0644 deploy/systemd/gmb-broker.service deploy/systemd/gmb-broker@.service \
    "$root/etc/systemd/system/"
  # The fake driver for the template's --device cuda:%i.
  install -D -m 0755 "$B/fakecuda/libcuda.so.1" "$root/usr/lib/gmb-check/libcuda.so.1"
  mkdir -p "$root/etc/systemd/system/gmb-broker@.service.d"
  cat >"$root/etc/systemd/system/gmb-broker@.service.d/fakecuda.conf" <<'EOF'
# make check-deploy: no GPU here; the fake driver stands in (tests/fakecuda).
[Service]
Environment=GMB_LIBCUDA=/usr/lib/gmb-check/libcuda.so.1 FAKECUDA_DEVICES=2 FAKECUDA_TOTAL=2g
EOF
  # The check, run once the system is up.
  install -D -m 0755 deploy/check/unit-check.sh "$root/usr/local/sbin/gmb-unit-check"
  cat >"$root/etc/systemd/system/gmb-unit-check.service" <<'EOF'
[Unit]
Description=make check-deploy: gmb's systemd units
After=multi-user.target
[Service]
Type=oneshot
Environment=GMB_LIBCUDA=/usr/lib/gmb-check/libcuda.so.1
ExecStart=/usr/local/sbin/gmb-unit-check
StandardOutput=file:/var/log/gmb-unit-check.log
StandardError=inherit
[Install]
WantedBy=multi-user.target
EOF
  mkdir -p "$root/etc/systemd/system/multi-user.target.wants"
  ln -sf ../gmb-unit-check.service "$root/etc/systemd/system/multi-user.target.wants/"
  # Nothing else needs to start in the container.
  for u in systemd-timesyncd.service apt-daily.timer apt-daily-upgrade.timer \
           e2scrub_all.timer fstrim.timer; do
    ln -sf /dev/null "$root/etc/systemd/system/$u"
  done
  log=$W/units-nspawn.log
  timeout --kill-after=30 900 systemd-nspawn --quiet --register=no --keep-unit \
    --private-network --boot --directory="$root" >"$log" 2>&1 </dev/null
  rc=$?
  if [ -f "$root/var/log/gmb-unit-check.log" ]; then
    while IFS= read -r line; do
      case "$line" in
        "check-deploy: systemd: "*": ok"*)
          line=${line#check-deploy: }
          ok "${line%%: ok*}" "$(echo "${line#*: ok}" | sed 's/^ (//; s/)$//')" ;;
        "check-deploy: systemd: "*": FAILED: "*)
          line=${line#check-deploy: }
          bad "${line%%: FAILED: *}" "${line#*: FAILED: }" ;;
        *) echo "$line" ;;
      esac
    done <"$root/var/log/gmb-unit-check.log"
  fi
  if [ $rc -ne 0 ] && [ $rc -ne 1 ]; then
    bad "systemd-nspawn --boot" "exit status $rc (124: the boot or the checks did not end in 900 s); log: $log: $(tail -n 5 "$log")"
  elif [ ! -s "$root/var/log/gmb-unit-check.log" ]; then
    bad "systemd units under a booted systemd" "the check did not run (log: $log): $(tail -n 5 "$log")"
  fi
  rm -rf "$root"
}
