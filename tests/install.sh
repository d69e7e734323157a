#!/bin/sh
# install.sh - checks that what `make install` puts in a prefix is enough to
# build and run a user's program: the examples (client/examples/), which
# include gmb.h alone, are compiled with nothing but the installed header,
# library and gmb.pc, and run from there.  It also checks that a program
# linked with -L BUILD_DIR -lgmb runs from the build tree.
#
# Usage: sh tests/install.sh BUILD_DIR      (from the top of the tree)
#   BUILD_DIR  build or build/san: the Makefile chooses the directory from
#              SAN, so SAN is taken from the environment, else inferred from
#              a BUILD_DIR that ends in /san, and both must agree.
#
# Steps: `make install PREFIX=P`, P a fresh directory under mktemp's; each
# example, copied alone out of the tree, compiled with `pkg-config --cflags
# --libs gmb` (PKG_CONFIG_PATH=P/lib/pkgconfig) against P/lib/libgmb.so;
# each run with LD_LIBRARY_PATH=P/lib and --help, which must exit 0; ldd
# must find libgmb.so.0 in P/lib.  Then one example linked with -L BUILD_DIR -lgmb
# runs with LD_LIBRARY_PATH=BUILD_DIR, and ldd finds libgmb.so.0 there.
# Under SAN=1 the library is built with AddressSanitizer and UBSan, so the
# examples are compiled and linked with the same sanitizers (a program that
# loads an ASan library must have the ASan runtime itself).
#
# Prints one summary line; exits 1 on any failure, after saying what failed,
# and 2 on a usage error.  The temporary prefix is removed either way.
# Needs make, a C compiler ($CC, else cc), pkg-config and ldd.

me=install.sh
if [ $# -ne 1 ]; then
  echo "usage: sh tests/install.sh BUILD_DIR" >&2
  exit 2
fi
B=${1%/}
ROOT=$(cd "$(dirname "$0")/.." && pwd -P) || exit 2
MAKE=${MAKE:-make}
CC=${CC:-cc}

case "$B" in
  */san | san) inferred=1 ;;
  *) inferred=0 ;;
esac
SAN=${SAN:-$inferred}
if [ "$SAN" = 1 ]; then
  rel=build/san
  sanflags="-fsanitize=address,undefined -fno-omit-frame-pointer"
else
  SAN=0
  rel=build
  sanflags=
fi

fail() {
  echo "$me: FAILED: $*" >&2
  exit 1
}

tmp=$(mktemp -d "${TMPDIR:-/tmp}/gmb-install.XXXXXX") || fail "mktemp"
trap 'rm -rf "$tmp"' EXIT
trap 'exit 130' INT TERM
prefix=$tmp/prefix

# The install, and the build tree's -lgmb link name (`make all` makes it;
# `make install` alone does not).
if ! "$MAKE" -C "$ROOT" SAN="$SAN" PREFIX="$prefix" DESTDIR= install \
  "$rel/libgmb.so" >"$tmp/make.log" 2>&1; then
  cat "$tmp/make.log" >&2
  fail "make install PREFIX=$prefix SAN=$SAN (its output is above)"
fi
babs=$(cd "$B" 2>/dev/null && pwd -P) || fail "no build directory $B"
[ "$babs" = "$(cd "$ROOT/$rel" && pwd -P)" ] ||
  fail "BUILD_DIR $B is not $rel, the directory make uses with SAN=$SAN"

for f in include/gmb.h lib/libgmb.so.0 lib/libgmb.so lib/libgmb.a \
  lib/pkgconfig/gmb.pc; do
  [ -e "$prefix/$f" ] || fail "make install did not write $f"
done

# ldd's line for libgmb.so.0 must name DIR/libgmb.so.0.
resolves_in() { # PROGRAM DIR
  got=$(LD_LIBRARY_PATH="$2" ldd "$1" | awk '$1 == "libgmb.so.0" { print $3 }')
  [ -n "$got" ] || fail "ldd $1: no libgmb.so.0 (is it linked dynamically?)"
  [ "$(cd "$(dirname "$got")" && pwd -P)" = "$(cd "$2" && pwd -P)" ] ||
    fail "ldd $1: libgmb.so.0 resolves to $got, not from $2"
}

# Against the installed library only: the examples are copied out of the
# tree, so that neither include/ nor proto/ can be found by accident.
pc=$(PKG_CONFIG_PATH="$prefix/lib/pkgconfig" pkg-config --cflags --libs gmb) ||
  fail "pkg-config --cflags --libs gmb with PKG_CONFIG_PATH=$prefix/lib/pkgconfig"
mkdir "$tmp/src" "$tmp/bin" || fail "mkdir in $tmp"
cp "$ROOT"/client/examples/*.[ch] "$tmp/src/" || fail "cannot copy the examples"
n=0
for src in "$tmp"/src/*.c; do
  [ -e "$src" ] || fail "no examples in client/examples/"
  name=$(basename "$src" .c)
  exe=$tmp/bin/$name
  # shellcheck disable=SC2086 # $pc and $sanflags are word lists
  $CC -Wall -Wextra -Werror $sanflags -o "$exe" "$src" $pc ||
    fail "$name.c does not build against the installed gmb ($CC ... $pc)"
  LD_LIBRARY_PATH="$prefix/lib" "$exe" --help >"$tmp/help.out" 2>&1 || {
    cat "$tmp/help.out" >&2
    fail "$name --help, linked with the installed libgmb.so, did not exit 0"
  }
  resolves_in "$exe" "$prefix/lib"
  n=$((n + 1))
done

# From the build tree: -L BUILD_DIR -lgmb, run with LD_LIBRARY_PATH=BUILD_DIR.
exe=$tmp/bin/job-build-tree
# shellcheck disable=SC2086
$CC -Wall -Wextra -Werror $sanflags -I"$ROOT/include" -o "$exe" \
  "$ROOT/client/examples/job.c" -L"$babs" -lgmb ||
  fail "job.c does not link with -L$B -lgmb"
LD_LIBRARY_PATH="$babs" "$exe" --help >"$tmp/help.out" 2>&1 || {
  cat "$tmp/help.out" >&2
  fail "job linked with -L$B -lgmb: --help with LD_LIBRARY_PATH=$B did not exit 0"
}
resolves_in "$exe" "$babs"

echo "install: $n examples built with pkg-config gmb against make install's" \
  "prefix and run from it; job linked with -L$B -lgmb runs from $B" \
  "(SAN=$SAN)"
