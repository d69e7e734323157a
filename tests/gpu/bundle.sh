#!/bin/sh
# bundle.sh BUILD - makes BUILD/gpu-bundle, the one folder that travels to
# the GPU machine with the checkout (the device tool's carry list is
# exactly ["BUILD/gpu-bundle"]; tests/gpu/run.sh runs from it):
#
#   gmb-broker gmbctl libgmb.so.0 (and a copy as libgmb.so) libgmb-torch.so
#   libgmb-preload.so
#   examples/job examples/frag gpu/gpu_figures gpu/gpu_checks
#   lib/   every shared library those need that ldd finds, but glibc's own
#          and libcuda (GPU.md: that machine has no libzmq, protobuf-c,
#          inih, jansson ...)
#
# Each binary gets an RPATH to lib/ ($ORIGIN/lib, $ORIGIN/../lib; DT_RPATH,
# which the loader also applies to the libraries they load), so nothing
# is put on LD_LIBRARY_PATH: python, nvcc and the programs under the
# preload shim keep the machine's own libstdc++, libcrypto, libffi, and a
# library of the bundle is loaded only where one of gmb's needs it.
# Prints the size of what travels (the bundle, plus the tracked and
# untracked-unignored files of the tree, which travel anyway) and fails
# past 64 MiB, the limit on what may travel.
set -eu
B=${1:-build}
OUTD="$B/gpu-bundle"
LIMIT=$((64 * 1024 * 1024))
command -v patchelf >/dev/null 2>&1 || {
  echo "bundle.sh: patchelf missing (sh deploy/install-deps.sh installs it)" >&2
  exit 1
}
rm -rf "$OUTD"
mkdir -p "$OUTD/lib" "$OUTD/examples" "$OUTD/gpu"
for f in gmb-broker gmbctl libgmb.so.0 libgmb-torch.so libgmb-preload.so \
         examples/job examples/frag gpu/gpu_figures gpu/gpu_checks; do
  [ -f "$B/$f" ] || { echo "bundle.sh: $B/$f missing: run make first" >&2; exit 1; }
  cp "$B/$f" "$OUTD/$f"
done
# A copy, not a link: what travels is plain files.
cp "$OUTD/libgmb.so.0" "$OUTD/libgmb.so"
for f in "$OUTD"/gmb-broker "$OUTD"/gmbctl "$OUTD"/lib*.so* \
         "$OUTD"/examples/* "$OUTD"/gpu/*; do
  ldd "$f" 2>/dev/null | awk '/=> \//{print $3}'
done | sort -u | while read -r lib; do
  case "$(basename "$lib")" in
    libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|ld-linux*|\
    libresolv.so*|libutil.so*|libcuda.so*|libgmb*) continue ;;
  esac
  cp -L "$lib" "$OUTD/lib/"
done
for f in "$OUTD"/gmb-broker "$OUTD"/gmbctl "$OUTD"/libgmb.so.0 \
         "$OUTD"/libgmb.so "$OUTD"/libgmb-torch.so "$OUTD"/libgmb-preload.so; do
  patchelf --force-rpath --set-rpath '$ORIGIN/lib' "$f"
done
for f in "$OUTD"/examples/* "$OUTD"/gpu/*; do
  patchelf --force-rpath --set-rpath '$ORIGIN/../lib' "$f"
done
for f in "$OUTD"/lib/*; do
  patchelf --force-rpath --set-rpath '$ORIGIN' "$f"
done

# What travels: the bundle, and the tree's files that git does not ignore.
bundle=$(du -sb "$OUTD" | cut -f1)
tree=$(git ls-files -z --cached --others --exclude-standard 2>/dev/null |
  xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
total=$((bundle + tree))
glibc=$(for f in "$OUTD"/gmb-broker "$OUTD"/lib*.so* "$OUTD"/lib/*; do
  objdump -T "$f" 2>/dev/null; done | grep -o 'GLIBC_[0-9.]*' | sort -uV | tail -1)
mib() { awk -v b="$1" 'BEGIN {printf "%.1f MiB", b / 1048576}'; }
echo "bundle: $(ls "$OUTD/lib" | wc -l) libraries in $OUTD/lib; $OUTD $(mib "$bundle"), tree $(mib "$tree"): $(mib "$total") of 64 MiB travel"
echo "bundle: the GPU machine needs glibc >= ${glibc#GLIBC_} (the build host's)"
echo "bundle: carry [\"$OUTD\"]; there: bash tests/gpu/run.sh \$OUT"
if [ "$total" -gt "$LIMIT" ]; then
  echo "bundle.sh: $(mib "$total") would travel, over the 64 MiB limit" >&2
  exit 1
fi
