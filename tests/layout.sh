#!/bin/sh
# layout.sh - checks that the tree's layout keeps every dependency pointing
# one way, so the architecture in docs/architecture.md stays true.
#
# Usage: sh tests/layout.sh BUILD_DIR [ROOT]
#   BUILD_DIR  the build directory (make's $(B)): obj/ and the archives.
#   ROOT       the source tree to check; the current directory by default.
#              (tests/layout_selftest.sh points it at small fake trees.)
#
# gmb is built from parts: shared code in proto/, the broker in broker/, the
# client-side products under client/ and the public header in include/.
# Each part compiles with its own include path, the way libuv keeps
# src/unix/internal.h private to src/unix and mimalloc keeps
# include/mimalloc/internal.h apart from the public include/mimalloc.h.  A
# file can only use what it can include, so the include rule is what keeps
# the dependency direction: the broker never sees a client header, the
# client library never sees a broker header, and both see proto/.  The
# Makefile's include paths enforce most of this already; this script states
# the rule in one place and also catches what they cannot: a "../" path that
# reaches around them, a part whose flags drift, a cycle or an upward call
# among the broker's modules, a symbol or an object that crosses sides.
#
# It checks three things and prints one line per violation:
#   1. The include rule (the PARTS table below): every quoted #include in a
#      .c/.h file under proto/, broker/, client/ and include/ resolves in the
#      places its part may use, and no include contains "../".  Tests are
#      exempt.  Angle-bracket includes are system headers and are ignored.
#   2. The broker's module graph: modules (a .c/.h pair in broker/, named by
#      its stem) must not form a dependency cycle through their includes
#      (found with tsort), and no module may depend on a higher layer (the
#      LAYERS table below), neither by an include nor by a symbol its object
#      takes from another broker object.
#   3. The objects: no symbol a broker object needs is defined by a client
#      object, and the reverse (nm); libgmb.a holds no broker object,
#      libgmb-broker.a no client object, libgmb-common.a only proto/ and
#      generated objects (ar t).
# It exits 1 if any check failed, 2 on a usage error, and otherwise prints
# one summary line and exits 0.  It needs only POSIX sh, awk, coreutils and
# binutils (nm, ar).

# --- the include rule -------------------------------------------------------
#
# One row per part: the part's directory, then the places a quoted include in
# one of its files may resolve in, in the order they are tried.  The first
# place is always the part itself, because a quoted include first resolves
# next to the including file, as the compiler does.  A place ending in "/" is
# a directory; any other place is a single header (the examples use gmb.h
# and nothing else, as a user of the installed library would).  A .c/.h file
# in a directory with no row is a violation: add a row when you add a part,
# and the same line to docs/architecture.md.
PARTS='
proto            proto/ include/
broker           broker/ proto/ include/
client/lib       client/lib/ proto/ include/
client/admin     client/admin/ proto/ include/
client/gmbctl    client/gmbctl/ client/admin/ proto/ include/
client/replay    client/replay/ client/admin/ proto/ include/
client/k8s       client/k8s/ client/admin/ proto/ include/
client/shim      client/shim/ include/
client/spank     client/spank/ client/admin/ proto/ include/
client/examples  client/examples/ include/gmb.h
include          include/
'
# The generated protobuf-c header lives in BUILD_DIR/gen.  Only the wire codec
# (proto/*.c) may include it: everything else works on plain C structs.
GEN_HEADER=gmb.pb-c.h
GEN_USERS='proto/*.c'

# --- the broker's layers ----------------------------------------------------
#
# This table mirrors the picture in docs/architecture.md; change both
# together.  One row per layer, the highest first: the layer's number, its
# name, then its modules.  A module may depend on (include, or call into)
# modules of its own layer or of lower layers, never of a higher one
# (dependencies point down).  Edges inside a layer are allowed; the cycle
# check covers them.  Every module in broker/ must appear here exactly once.
LAYERS='
8  main      main
7  loop      loop
6  handlers  dispatch admin http http_admin fdchan
5  core      core
4  services  reclaim sleep defrag observe waitq offload alloc
3  state     broker session tenant compact repack evacuate locktab statefile reply
2  pool      pool pool_check
1  device    device device_host device_cuda
0  base      config log rbtree connguard
'
# (core: the broker's life cycle - start, stop, ending a session, the checks.)

# --- the archives -----------------------------------------------------------
#
# One row per archive in BUILD_DIR: its name, the obj/ directories whose
# objects it may hold, and those whose objects it must not hold ("*": any
# object that is not from the directories it may hold).  Archive members are
# basenames, so an object counts as foreign only when its basename is built
# in a forbidden directory and nowhere else.
ARCHIVES='
libgmb.a         client/lib,proto,gen   broker
libgmb-broker.a  broker,proto,gen       client
libgmb-common.a  proto,gen              *
'

set -u

usage() {
  echo "usage: sh tests/layout.sh BUILD_DIR [ROOT]" >&2
  exit 2
}

if [ $# -lt 1 ] || [ $# -gt 2 ]; then
  usage
fi
B_SHOW=${1%/}
[ -n "$B_SHOW" ] || B_SHOW=/
ROOT=${2:-.}
if [ ! -d "$1" ]; then
  echo "layout: build directory $1 does not exist (run make first)" >&2
  exit 2
fi
if [ ! -d "$ROOT" ]; then
  echo "layout: source tree $ROOT does not exist" >&2
  exit 2
fi
# Resolve the build directory before moving into the source tree, since it
# may be given relative to where the script was started.
B=$(cd "$1" && pwd) || exit 2
cd "$ROOT" || exit 2

tmp=$(mktemp -d "${TMPDIR:-/tmp}/layout.XXXXXX") || exit 2
trap 'rm -rf "$tmp"' EXIT
trap 'exit 2' HUP INT TERM

violations=0
: > "$tmp/v"

# Each check writes its violations, one line each, to $tmp/v; report prints
# them and adds them to the total.  Notes go straight to stdout and are not
# failures.
report() {
  if [ -s "$tmp/v" ]; then
    cat "$tmp/v"
    violations=$((violations + $(wc -l < "$tmp/v")))
  fi
  : > "$tmp/v"
}

note() {
  echo "layout: note: $*"
}

# Lists every file of the checked parts, one path a line, relative to ROOT.
list_tree() {
  for d in proto broker client include; do
    [ -d "$d" ] && find "$d" -type f
  done | LC_ALL=C sort
}

# --- check 1: the include rule ----------------------------------------------
#
# Reads every .c/.h file of the checked parts and resolves each quoted
# include through the file's row of PARTS.  It also writes every resolved
# include to $tmp/includes ("file<TAB>line<TAB>header<TAB>resolved path"),
# which the module check reads, and the number of files checked to
# $tmp/nfiles.
check_includes() {
  printf '%s\n' "$PARTS" > "$tmp/parts"
  list_tree > "$tmp/tree"
  : > "$tmp/includes"
  awk -v parts="$tmp/parts" -v out="$tmp/includes" -v count="$tmp/nfiles" \
      -v gen="$GEN_HEADER" -v genusers="$GEN_USERS" '
    # "a/, b/ or c/" for the places a part may use.
    function places_text(p,    n, w, i, s) {
      n = split(places[p], w, " ")
      s = ""
      for (i = 1; i <= n; i++)
        s = s (i == 1 ? "" : (i == n ? " or " : ", ")) w[i]
      return s
    }
    # Where a header of this name does live, to make the message useful.
    function where(name,    i, g, d, s, seen) {
      s = ""
      for (i = 1; i <= nfiles; i++) {
        g = files[i]
        if (length(g) > length(name) &&
            substr(g, length(g) - length(name)) == "/" name) {
          d = substr(g, 1, length(g) - length(name))
          if (!(d in seen)) {
            seen[d] = 1
            s = s (s == "" ? "" : " and ") d
          }
        }
      }
      return s == "" ? "there is no such header in the tree" : "it is in " s
    }
    # The file the compiler would find for a quoted include, or "".
    function resolve(p, name,    n, w, i, e, d) {
      n = split(places[p], w, " ")
      for (i = 1; i <= n; i++) {
        e = w[i]
        if (e ~ /\/$/) {
          if ((e name) in exists) return e name
        } else {
          d = e
          sub(/[^\/]*$/, "", d)
          if (d name == e && (e in exists)) return e
        }
      }
      return ""
    }
    BEGIN {
      while ((getline line < parts) > 0) {
        n = split(line, w, " ")
        if (n < 2) continue
        places[w[1]] = w[2]
        for (i = 3; i <= n; i++) places[w[1]] = places[w[1]] " " w[i]
      }
      close(parts)
      # The shell pattern of the generated header'"'"'s users, as a regex.
      genre = genusers
      gsub(/\./, "\\.", genre)
      gsub(/\*/, "[^/]*", genre)
      genre = "^" genre "$"
    }
    { exists[$0] = 1; files[++nfiles] = $0 }
    END {
      checked = 0
      for (k = 1; k <= nfiles; k++) {
        f = files[k]
        if (f !~ /\.[ch]$/) continue
        p = f
        sub(/\/[^\/]*$/, "", p)
        if (!(p in places)) {
          printf "layout: %s is in no part of the include rule: move it into a part, or make %s/ a part in PARTS (tests/layout.sh) and docs/architecture.md\n", f, p
          continue
        }
        checked++
        ln = 0
        while ((getline line < f) > 0) {
          ln++
          if (line !~ /^[ \t]*#[ \t]*include[ \t]*["<]/) continue
          s = line
          sub(/^[ \t]*#[ \t]*include[ \t]*/, "", s)
          close_ch = substr(s, 1, 1) == "\"" ? "\"" : ">"
          s = substr(s, 2)
          e = index(s, close_ch)
          if (e == 0) continue
          name = substr(s, 1, e - 1)
          if (index(name, "../") > 0) {
            printf "layout: %s:%d includes %s; a path with ../ reaches around the part'"'"'s include path (the part may use %s)\n", f, ln, name, places_text(p)
            continue
          }
          if (close_ch == ">") continue
          if (substr(name, 1, 1) == "/") {
            printf "layout: %s:%d includes %s, an absolute path; use a header from %s\n", f, ln, name, places_text(p)
            continue
          }
          while (substr(name, 1, 2) == "./") name = substr(name, 3)
          while (gsub(/\/\.\//, "/", name) > 0) ;
          if (name == gen) {
            if (f !~ genre)
              printf "layout: %s:%d includes the generated %s, which only %s may include (the wire codec is the one place that touches protobuf-c)\n", f, ln, name, genusers
            continue
          }
          r = resolve(p, name)
          if (r == "") {
            printf "layout: %s:%d includes %s, which is not in %s (%s)\n", f, ln, name, places_text(p), where(name)
            continue
          }
          printf "%s\t%d\t%s\t%s\n", f, ln, name, r > out
        }
        close(f)
      }
      print checked > count
    }
  ' "$tmp/tree" > "$tmp/v"
  report
}

# --- check 2: the broker's module graph -------------------------------------
#
# A module is named by a file's stem in broker/ (pool.c, pool.h and
# pool_impl.h make the module "pool"; rbtree.h alone is the module
# "rbtree").  Module A depends on B when a file of A includes a header of B
# (these edges make the graph that must have no cycle), and also when A's
# object needs a symbol that B's object defines: a declaration in a shared
# header (such as broker.h) hides a dependency from the include graph but not
# from the linker, so these edges too must not go up a layer.  The check
# needs the includes that check_includes resolved and the symbols that
# read_objects listed.
check_modules() {
  printf '%s\n' "$LAYERS" > "$tmp/layers"
  grep '^broker/[^/]*\.[ch]$' "$tmp/tree" > "$tmp/broker_files"
  : > "$tmp/edges"
  : > "$tmp/sites"
  awk -v layers="$tmp/layers" -v brokerfiles="$tmp/broker_files" \
      -v edges="$tmp/edges" -v sites="$tmp/sites" -v count="$tmp/nmodules" \
      -v show="$B_SHOW" '
    function module(path,    m) {
      m = path
      sub(/^(obj\/)?broker\//, "", m)
      sub(/\.[cho]$/, "", m)
      sub(/_impl$/, "", m)
      return m
    }
    # Records the edge a -> b once and checks that it does not go up a
    # layer.  why is the start of the message: "FILE:LINE includes X" or
    # "OBJECT uses SYMBOL, which OBJECT defines".  Include edges (cycle = 1)
    # also go to tsort, with where they come from.  Symbol edges only face
    # the layer check: inside the device layer, device.c opens the backends
    # that implement its interface, a loop of calls that is by design.
    function edge(a, b, at, why, cycle) {
      if (a == b || ((a, b) in seen)) return
      seen[a, b] = 1
      if (cycle) {
        print a, b > edges
        printf "%s\t%s\t%s\n", a, b, at > sites
      }
      if ((a in layer) && (b in layer) && layer[b] > layer[a])
        printf "layout: %s: %s (layer %d, %s) must not depend on %s (layer %d, %s), a higher layer\n", why, a, layer[a], lname[a], b, layer[b], lname[b]
    }
    BEGIN {
      while ((getline line < layers) > 0) {
        n = split(line, w, " ")
        if (n < 2) continue
        if (w[1] !~ /^-?[0-9]+$/) {
          printf "layout: the layer table has a row that does not start with a number: %s\n", line
          continue
        }
        for (i = 3; i <= n; i++) {
          if (w[i] in layer)
            printf "layout: module %s is in the layer table twice (layers %s and %s)\n", w[i], lname[w[i]], w[2]
          layer[w[i]] = w[1] + 0
          lname[w[i]] = w[2]
        }
      }
      close(layers)
      nmod = 0
      while ((getline f < brokerfiles) > 0) {
        m = module(f)
        if (!(m in mfiles)) {
          order[++nmod] = m
          mfiles[m] = f
        } else {
          mfiles[m] = mfiles[m] ", " f
        }
      }
      close(brokerfiles)
      for (i = 1; i <= nmod; i++) {
        m = order[i]
        # tsort takes a pair of equal names as a module with no edge.
        print m, m > edges
        if (!(m in layer))
          printf "layout: broker module %s (%s) is not in the layer table; add it to the layer table in tests/layout.sh and docs/architecture.md\n", m, mfiles[m]
      }
    }
    # The first file holds the resolved includes (tab-separated); only an
    # include of one top-level broker file by another makes an edge.
    FILENAME ~ /includes$/ {
      split($0, w, "\t")
      if (w[1] ~ /^broker\/[^\/]*$/ && w[4] ~ /^broker\/[^\/]*$/)
        edge(module(w[1]), module(w[4]), w[1] ":" w[2], w[1] ":" w[2] " includes " w[3], 1)
      next
    }
    # The second holds the broker objects'"'"' symbols, as "object: name type".
    {
      obj = $1
      sub(/:$/, "", obj)
      if ($3 == "U" || $3 == "w" || $3 == "v") {
        needobj[++nneed] = obj
        needsym[nneed] = $2
      } else if (!($2 in def)) def[$2] = obj
    }
    END {
      for (i = 1; i <= nneed; i++) {
        s = needsym[i]
        if (!(s in def)) continue
        edge(module(needobj[i]), module(def[s]), needobj[i] " uses " s,
             show "/" needobj[i] " uses " s ", which " show "/" def[s] " defines", 0)
      }
      print nmod > count
    }
  ' "$tmp/includes" "$tmp/broker_syms" > "$tmp/v"
  report

  # tsort prints an order, or on a cycle "input contains a loop:" followed
  # by the modules of the loop, one a line, on stderr.  It breaks each loop
  # it finds and goes on, so one run can report several.
  tsort "$tmp/edges" > /dev/null 2> "$tmp/tsort.err"
  awk -v sites="$tmp/sites" '
    # One loop as "a -> b -> c -> a (where each edge comes from)".  tsort
    # lists a loop in edge order; if the list does not read as a path either
    # way, the modules are printed as a set.
    function flush(    i, j, k, s, at, dir, ok) {
      if (n == 0) return
      for (dir = 1; dir >= -1; dir -= 2) {
        ok = 1
        for (i = 1; i <= n; i++) {
          j = i % n + 1
          if (dir == 1 && !((m[i], m[j]) in site)) ok = 0
          if (dir == -1 && !((m[j], m[i]) in site)) ok = 0
        }
        if (ok) break
      }
      if (!ok) {
        s = m[1]
        for (i = 2; i <= n; i++) s = s ", " m[i]
        printf "layout: broker modules form a dependency cycle among %s\n", s
        n = 0
        return
      }
      s = ""
      at = ""
      for (k = 0; k < n; k++) {
        i = dir == 1 ? k + 1 : n - k
        j = dir == 1 ? i % n + 1 : (i == 1 ? n : i - 1)
        s = s m[i] " -> "
        at = at (k ? "; " : "") site[m[i], m[j]]
      }
      s = s m[dir == 1 ? 1 : n]
      printf "layout: broker modules form a dependency cycle: %s (%s)\n", s, at
      n = 0
    }
    BEGIN {
      while ((getline line < sites) > 0) {
        split(line, w, "\t")
        site[w[1], w[2]] = w[3]
      }
      close(sites)
      n = 0
    }
    /input contains a loop/ { flush(); next }
    /^tsort: / { sub(/^tsort: /, ""); m[++n] = $0; next }
    { printf "layout: tsort failed: %s\n", $0 }
    END { flush() }
  ' "$tmp/tsort.err" > "$tmp/v"
  report
}

# --- check 3: symbols and archives ------------------------------------------
#
# Lists the objects under BUILD_DIR/obj/DIR, relative to BUILD_DIR, leaving
# out stale ones whose source file (.c, or .cc for the C++ entry point of
# the torch allocator) is gone (a renamed module leaves its old
# object behind until make clean; it is no part of any product).
list_objects() {
  [ -d "$B/obj/$1" ] || return 0
  (cd "$B" && find "obj/$1" -type f -name '*.o') | LC_ALL=C sort |
  while IFS= read -r o; do
    src=${o#obj/}
    src=${src%.o}
    if [ -f "$src.c" ] || [ -f "$src.cc" ]; then
      echo "$o"
    else
      src=$src.c
      note "skipping $B_SHOW/$o: $src no longer exists (a stale object)" >> "$tmp/notes"
    fi
  done
}

# Prints the global symbols of the objects listed in file $1, one a line, as
# nm -A -P writes them: "object: name type [value size]".
symbols_of() {
  list=$1
  set --
  while IFS= read -r o; do
    set -- "$@" "$o"
  done < "$list"
  [ $# -gt 0 ] || return 0
  (cd "$B" && nm -A -P -g "$@") || echo "layout: nm failed on the objects in $B_SHOW/obj" >> "$tmp/v"
}

# Lists the broker's and the client side's objects and their symbols, for
# the module graph and the symbol check.
read_objects() {
  : > "$tmp/notes"
  list_objects broker > "$tmp/broker_objs"
  list_objects client > "$tmp/client_objs"
  symbols_of "$tmp/broker_objs" > "$tmp/broker_syms"
  symbols_of "$tmp/client_objs" > "$tmp/client_syms"
}

check_symbols() {
  sym_checked=0
  cat "$tmp/notes"
  if [ ! -s "$tmp/broker_objs" ] || [ ! -s "$tmp/client_objs" ]; then
    note "no broker or no client objects under $B_SHOW/obj; the symbol check is skipped (build first)"
    return 0
  fi
  # libc functions the broker defines for itself (broker/connguard.c:
  # libzmq's accept must not abort on EMFILE): each side gets libc's, not
  # the other's.
  awk -v show="$B_SHOW" -v interposed="accept accept4 close recv" '
    BEGIN { n = split(interposed, w, " "); for (i = 1; i <= n; i++) libc[w[i]] = 1 }
    FNR == 1 { side = FILENAME ~ /broker_syms$/ ? "broker" : "client" }
    $2 in libc { next }
    { obj = $1; sub(/:$/, "", obj) }
    # nm marks undefined symbols U, and undefined weak ones w or v; every
    # other global symbol is defined by the object.
    $3 == "U" || $3 == "w" || $3 == "v" { need[++nneed] = side SUBSEP obj SUBSEP $2; next }
    !((side, $2) in def) { def[side, $2] = obj }
    END {
      for (i = 1; i <= nneed; i++) {
        split(need[i], w, SUBSEP)
        other = w[1] == "broker" ? "client" : "broker"
        # A symbol its own side defines as well is resolved there.
        if (((other, w[3]) in def) && !((w[1], w[3]) in def))
          printf "layout: %s/%s uses %s, which %s/%s defines: a %s object must not resolve symbols from %s objects\n", show, w[2], w[3], show, def[other, w[3]], w[1], other
      }
    }
  ' "$tmp/broker_syms" "$tmp/client_syms" >> "$tmp/v"
  report
  sym_checked=1
}

check_archives() {
  ar_checked=0
  if [ -d "$B/obj" ]; then
    # Every object built outside tests/ (tests go into no archive), as its
    # path under BUILD_DIR.
    (cd "$B" && find obj -type f -name '*.o') | grep -v '^obj/tests/' |
      LC_ALL=C sort > "$tmp/all_objs"
  fi
  if [ ! -s "$tmp/all_objs" ]; then
    note "no objects under $B_SHOW/obj; the archive check is skipped (build first)"
    return 0
  fi
  printf '%s\n' "$ARCHIVES" | while read -r name allow forbid; do
    [ -n "$name" ] || continue
    if [ ! -f "$B/$name" ]; then
      note "$B_SHOW/$name does not exist; its check is skipped"
      continue
    fi
    if ! ar t "$B/$name" > "$tmp/members"; then
      echo "layout: ar cannot read $B_SHOW/$name" >> "$tmp/v"
      continue
    fi
    awk -v show="$B_SHOW" -v archive="$name" -v allow="$allow" \
        -v forbid="$forbid" '
      # Whether obj/DIR is one of the comma-separated directories in list;
      # "client" covers obj/client/lib and the other client directories.
      function under(dir, list,    n, w, i) {
        n = split(list, w, ",")
        for (i = 1; i <= n; i++)
          if (dir == w[i] || index(dir, w[i] "/") == 1) return 1
        return 0
      }
      # "obj/proto/ or obj/gen/" for the directories an archive may hold.
      function dirs_text(list,    n, w, i, s) {
        n = split(list, w, ",")
        s = ""
        for (i = 1; i <= n; i++)
          s = s (i == 1 ? "" : (i == n ? " or " : ", ")) "obj/" w[i] "/"
        return s
      }
      # The first file sorts each object basename by where it is built:
      # allowed (built in a directory the archive may hold), bad (built in a
      # forbidden one), elsewhere (built in neither), from (for "*", where
      # a basename the archive may not hold is built).
      FNR == NR {
        dir = $0
        sub(/^obj\//, "", dir)
        sub(/\/[^\/]*$/, "", dir)
        base = $0
        sub(/.*\//, "", base)
        if (under(dir, allow)) allowed[base] = 1
        else if (forbid == "*") { if (!(base in from)) from[base] = dir }
        else if (under(dir, forbid)) { if (!(base in bad)) bad[base] = dir }
        else elsewhere[base] = 1
        next
      }
      # The second file is the archive'"'"'s member list.
      forbid == "*" && !($0 in allowed) {
        printf "layout: %s/%s holds %s, which is not an object from %s (%s)\n",
          show, archive, $0, dirs_text(allow),
          ($0 in from) ? "it is built in obj/" from[$0] "/" : "no such object is built"
        next
      }
      forbid != "*" && ($0 in bad) && !($0 in allowed) && !($0 in elsewhere) {
        printf "layout: %s/%s holds %s, an object built only in obj/%s/: %s must hold no %s object\n",
          show, archive, $0, bad[$0], archive, forbid
      }
    ' "$tmp/all_objs" "$tmp/members" >> "$tmp/v"
    : > "$tmp/ar_checked"
  done
  report
  [ -f "$tmp/ar_checked" ] && ar_checked=1
}

check_includes
read_objects
check_modules
check_symbols
check_archives

if [ "$violations" -gt 0 ]; then
  echo "layout: $violations violation(s); the rule and the layers are in docs/architecture.md"
  exit 1
fi

summary="layout: $(cat "$tmp/nfiles") files follow the include rule; $(cat "$tmp/nmodules") broker modules, no cycle, layers respected"
if [ "$sym_checked" = 1 ]; then
  summary="$summary; no symbol crosses between broker and client objects"
fi
if [ "$ar_checked" = 1 ]; then
  summary="$summary; the archives hold only their own parts"
fi
echo "$summary"
exit 0
