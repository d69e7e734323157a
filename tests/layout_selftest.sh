#!/bin/sh
# layout_selftest.sh - shows that each check of tests/layout.sh can fail.
#
# Usage: sh tests/layout_selftest.sh
#
# It builds a small fake tree that follows the layout (a few files in proto/,
# broker/, client/lib/, client/examples/ and include/), checks that
# layout.sh passes it, then breaks it one way at a time in a copy and checks
# that layout.sh fails with the expected reason and nothing else.  When a C
# compiler is at hand it also compiles a few fake objects and archives them,
# to break the symbol, upward-call and archive checks.  It prints one line
# per case and exits 1 if the checker missed anything.  It takes about a
# second.

set -u
LAYOUT=$(cd "$(dirname "$0")" && pwd)/layout.sh
work=$(mktemp -d "${TMPDIR:-/tmp}/layout-selftest.XXXXXX") || exit 2
trap 'rm -rf "$work"' EXIT
trap 'exit 2' HUP INT TERM

passed=0
failed=0

# Writes file $1 (relative to tree $T) with the lines given after it.
put() {
  f=$T/$1
  shift
  mkdir -p "$(dirname "$f")"
  printf '%s\n' "$@" > "$f"
}

# The clean tree: broker modules main (8), session and tenant (3, state),
# pool (2), device (1), log, config and rbtree (0); every edge points down.
T=$work/clean
put include/gmb.h     'int gmb_version(void);'
put proto/util.h      'int util_now(void);'
put proto/util.c      '#include "util.h"' '#include "gmb.h"' 'int util_now(void) { return 1; }'
put proto/wire.c      '#include "gmb.pb-c.h"' '#include <stdio.h>'
put broker/log.h      'void log_msg(void);'
put broker/log.c      '#include "log.h"'
put broker/config.h   'int config_x;'
put broker/config.c   '#include "config.h"' '#include "log.h"'
put broker/rbtree.h   '#define RB_ENTRY(t) struct { t *l, *r; }'
put broker/device.h   'struct device;'
put broker/device.c   '#include "device.h"' '#include "log.h"'
put broker/pool.h     '#include "device.h"' 'int pool_get(void);'
put broker/pool_impl.h '#include "pool.h"' '#include "rbtree.h"'
put broker/pool.c     '#include "pool.h"' '#include "pool_impl.h"' '#include "util.h"' \
                      'int pool_get(void) { return util_now(); }'
put broker/session.h  '#include "pool.h"' '#include "rbtree.h"'
put broker/session.c  '#include "session.h"' '#include "log.h"'
put broker/tenant.h   '#include "pool.h"' '#include "config.h"'
put broker/tenant.c   '#include "tenant.h"'
put broker/main.c     '#include "session.h"' '#include "tenant.h"' '#include "gmb.h"' \
                      '#include <stdlib.h>'
put client/lib/segmap.h '#include "util.h"' 'int segmap_find(int);'
put client/lib/segmap.c '#include "segmap.h"' '#include "gmb.h"' \
                        'int segmap_find(int x) { return x + util_now(); }'
put client/examples/job.c '#include "gmb.h"' 'int main(void) { return gmb_version(); }'
put client/python/README.md 'not C: the checker leaves it alone'
put tests/unit/check_pool.c '#include "../../client/lib/segmap.h"'
mkdir -p "$work/nobuild"

# Compiles the three fake objects of tree $1 into build directory $2 and
# archives them the way the Makefile does.
CC=${CC:-cc}
have_cc=0
command -v "$CC" > /dev/null 2>&1 && command -v ar > /dev/null 2>&1 && have_cc=1
build() {
  mkdir -p "$2/obj/broker" "$2/obj/client/lib" "$2/obj/proto" &&
  "$CC" -c -I"$1/proto" -I"$1/include" "$1/broker/pool.c" -o "$2/obj/broker/pool.o" &&
  "$CC" -c -I"$1/proto" -I"$1/include" "$1/client/lib/segmap.c" -o "$2/obj/client/lib/segmap.o" &&
  "$CC" -c -I"$1/proto" -I"$1/include" "$1/proto/util.c" -o "$2/obj/proto/util.o" &&
  ar rc "$2/libgmb.a" "$2/obj/client/lib/segmap.o" "$2/obj/proto/util.o" &&
  ar rc "$2/libgmb-broker.a" "$2/obj/broker/pool.o" &&
  ar rc "$2/libgmb-common.a" "$2/obj/proto/util.o"
}
if [ "$have_cc" = 1 ]; then
  build "$work/clean" "$work/build" || { echo "selftest: cannot build the fake objects"; exit 2; }
else
  echo "selftest: note: no C compiler ($CC) or ar; the symbol and archive cases are skipped"
fi

# Copies the clean tree for a case and points T at the copy.
copy() {
  T=$work/case-$1
  cp -R "$work/clean" "$T"
}

# Runs layout.sh on tree $T with build directory $2 and expects, for case $1,
# either "pass" ($3) or exactly one violation matching the extended regex $3.
expect() {
  out=$(sh "$LAYOUT" "$2" "$T" 2>&1)
  rc=$?
  if [ "$3" = pass ]; then
    if [ "$rc" = 0 ] && printf '%s\n' "$out" | grep -q '^layout: [0-9]* files follow the include rule'; then
      ok=1
    else
      ok=0
    fi
  elif [ "$rc" = 1 ] && printf '%s\n' "$out" | grep -Eq "$3" &&
       printf '%s\n' "$out" | grep -q '^layout: 1 violation(s)'; then
    ok=1
  else
    ok=0
  fi
  if [ "$ok" = 1 ]; then
    echo "ok   $1"
    passed=$((passed + 1))
  else
    echo "FAIL $1: expected $3, got (exit $rc):"
    printf '%s\n' "$out" | sed 's/^/    /'
    failed=$((failed + 1))
  fi
}

T=$work/clean
expect "a clean tree passes" "$work/nobuild" pass

copy client-header
put broker/session.c '#include "session.h"' '#include "segmap.h"'
expect "a broker file including a client/lib header fails" "$work/nobuild" \
  '^layout: broker/session\.c:2 includes segmap\.h, which is not in broker/, proto/ or include/ \(it is in client/lib/\)$'

copy dotdot
put broker/session.c '#include "session.h"' '#include "../client/lib/segmap.h"'
expect "an include with ../ fails" "$work/nobuild" \
  '^layout: broker/session\.c:2 includes \.\./client/lib/segmap\.h; a path with \.\./'

copy examples
put client/examples/job.c '#include "gmb.h"' '#include "util.h"'
expect "an example including more than gmb.h fails" "$work/nobuild" \
  'client/examples/job\.c:2 includes util\.h, which is not in client/examples/ or include/gmb\.h'

copy generated
put broker/pool.c '#include "pool.h"' '#include "gmb.pb-c.h"'
expect "the generated header outside proto/*.c fails" "$work/nobuild" \
  'broker/pool\.c:2 includes the generated gmb\.pb-c\.h, which only proto/\*\.c may include'

copy no-part
put client/tool.c '#include "gmb.h"'
expect "a file in a directory with no part fails" "$work/nobuild" \
  '^layout: client/tool\.c is in no part of the include rule'

copy cycle
put broker/tenant.c '#include "tenant.h"' '#include "session.h"'
put broker/session.c '#include "session.h"' '#include "tenant.h"'
expect "a two-module cycle fails" "$work/nobuild" \
  'dependency cycle: (session -> tenant -> session|tenant -> session -> tenant) \('

copy upward
put broker/config.c '#include "config.h"' '#include "device.h"'
expect "an upward edge fails" "$work/nobuild" \
  '^layout: broker/config\.c:2 includes device\.h: config \(layer 0, base\) must not depend on device \(layer 1, device\), a higher layer$'

copy unknown
put broker/wibble.c '#include "log.h"'
expect "a module missing from the layer table fails" "$work/nobuild" \
  'broker module wibble \(broker/wibble\.c\) is not in the layer table; add it to the layer table in tests/layout\.sh and docs/architecture\.md'

if [ "$have_cc" = 1 ]; then
  T=$work/clean
  expect "clean objects and archives pass" "$work/build" pass

  copy symbol
  put broker/pool.c '#include "pool.h"' 'int segmap_find(int);' \
                    'int pool_get(void) { return segmap_find(1); }'
  build "$T" "$work/build-symbol" || exit 2
  expect "a broker object using a client symbol fails" "$work/build-symbol" \
    'obj/broker/pool\.o uses segmap_find, which .*/obj/client/lib/segmap\.o defines'

  # pool (layer 2) calls into session (layer 3) through a declaration of its
  # own, so no include shows the edge; the linker's view does.
  copy upward-call
  put broker/pool.c '#include "pool.h"' 'int session_count(void);' \
                    'int pool_get(void) { return session_count(); }'
  put broker/session.c '#include "session.h"' 'int session_count(void) { return 0; }'
  build "$T" "$work/build-upcall" &&
    "$CC" -c -I"$T/proto" -I"$T/include" "$T/broker/session.c" \
      -o "$work/build-upcall/obj/broker/session.o" || exit 2
  expect "an upward call hidden from the includes fails" "$work/build-upcall" \
    'obj/broker/pool\.o uses session_count, which .*/obj/broker/session\.o defines: pool \(layer 2, pool\) must not depend on session \(layer 3, state\), a higher layer$'

  T=$work/clean
  cp -R "$work/build" "$work/build-lib"
  ar rc "$work/build-lib/libgmb.a" "$work/build-lib/obj/broker/pool.o"
  expect "libgmb.a holding a broker object fails" "$work/build-lib" \
    'libgmb\.a holds pool\.o, an object built only in obj/broker/'

  cp -R "$work/build" "$work/build-common"
  ar rc "$work/build-common/libgmb-common.a" "$work/build-common/obj/client/lib/segmap.o"
  expect "libgmb-common.a holding a client object fails" "$work/build-common" \
    'libgmb-common\.a holds segmap\.o, which is not an object from obj/proto/ or obj/gen/ \(it is built in obj/client/lib/\)'
fi

echo "selftest: $passed passed, $failed failed"
[ "$failed" = 0 ]
