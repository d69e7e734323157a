#!/bin/sh
# tests/rebuild.sh BUILD_DIR - a second `make` right after a build does
# nothing: every rule names exactly what it makes and what it needs, so
# make has nothing left to redo.  (A rule that makes two files without a
# grouped target, or a phony prerequisite of a real file, shows up here as
# a recompile or a relink.)  Run by `make check` after `make all`.
set -eu
B=${1:?usage: tests/rebuild.sh BUILD_DIR}
case "$B" in
  */san | san) san=1 ;;
  *) san=0 ;;
esac
# `make -n` prints what it would run; the dependency check (deploy/
# install-deps.sh, a phony prerequisite by design) is the only allowed line.
# Run as a make of its own (not a sub-make of `make check`).
todo=$(env -u MAKEFLAGS -u MFLAGS -u MAKELEVEL ${MAKE:-make} \
  --no-print-directory -n all SAN="$san" 2>&1 |
  grep -v '^sh deploy/install-deps.sh$' || true)
if [ -n "$todo" ]; then
  echo "rebuild: a second make after a full build would still run:" >&2
  echo "$todo" | head -20 | sed 's/^/  /' >&2
  exit 1
fi
echo "rebuild: a second make has nothing to do"
