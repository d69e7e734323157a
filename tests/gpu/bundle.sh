#!/bin/sh
# bundle.sh BUILD - gathers into BUILD/lib the shared libraries gmb's
# binaries need that a GPU machine lacks (GPU.md): everything ldd lists
# except glibc's own libraries and libcuda.  tests/gpu/run.sh puts
# BUILD/lib on LD_LIBRARY_PATH.
set -eu
B=${1:-build}
mkdir -p "$B/lib"
for f in "$B/gmb-broker" "$B/gmbctl" "$B/gmb-replay" "$B/libgmb.so" \
         "$B"/lib*.so "$B"/gpu/* "$B"/examples/*; do
  [ -f "$f" ] || continue
  ldd "$f" 2>/dev/null | awk '/=> \//{print $3}'
done | sort -u | while read -r lib; do
  case "$(basename "$lib")" in
    libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|ld-linux*|\
    libresolv.so*|libutil.so*|libcuda.so*|libgmb*) continue ;;
  esac
  cp -L "$lib" "$B/lib/"
done
echo "bundle: $(ls "$B/lib" | wc -l) libraries in $B/lib ($(du -sh "$B/lib" | cut -f1))"
