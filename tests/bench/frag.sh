#!/bin/sh
# frag.sh - the fragmentation suite: six traces, each replayed through a
# real broker with compaction off and auto, and once more through each
# client's cache (gmb-replay --cache, compaction auto: what the torch
# allocator and cudaMallocAsync do), beside three baselines computed from the
# same trace with a perfect allocator (gmb-replay): static slices per
# tenant, one shared pool with quotas and no fragmentation (the floor), and
# that pool with each tenant in 2 MiB pages of its own (paged: the floor of
# a broker that isolates tenants, as this one must on a GPU).
# The cache's rows add the peak of the bytes all the caches' pages held at
# one moment (held_MiB, against peak_MiB in use), the hit rate and the
# broker requests they made (reqs; one per alloc and free without it).
#
# Usage: tests/bench/frag.sh BUILD_DIR
#
# Writes the traces with BUILD_DIR/bench/tracegen into BUILD_DIR/traces
# (deterministic: same seed, same bytes), replays each with
# BUILD_DIR/gmb-replay --json, and prints one table row per replay.  Then,
# for one trace ($FRAG_PLOT, default adversarial when unset), plots bytes in
# use and the largest free range along the trace, off against auto, with
# gnuplot into $FRAG_PNG (default docs/img/frag.png).  FRAG_PLOT set but
# empty (FRAG_PLOT=) means no plot.  gnuplot comes from Debian's
# gnuplot-nox: installed when missing and we are root, else the plot is
# skipped with a message (the table still counts).
#
# Knobs: FRAG_SEED (default 1), FRAG_SCALE (operations, default 1),
# FRAG_TRACES (default "llm train mixed adversarial kv serving"), FRAG_PLOT
# (the trace to plot; unset: adversarial; empty: no plot), FRAG_PNG.
# Exit status: non-zero when a replay did not run (a failure inside a
# replay is a figure, not an error) or the plot was asked for and failed.
set -u
B=${1:-build}
SEED=${FRAG_SEED:-1}
SCALE=${FRAG_SCALE:-1}
TRACES=${FRAG_TRACES:-llm train mixed adversarial kv serving}
PLOT=${FRAG_PLOT-adversarial} # set but empty: no plot
PNG=${FRAG_PNG:-docs/img/frag.png}
REPLAY=$B/gmb-replay
GEN=$B/bench/tracegen

for f in "$REPLAY" "$GEN" "$B/gmb-broker"; do
  if [ ! -x "$f" ]; then
    echo "frag: $f is missing; run 'make' first" >&2
    exit 1
  fi
done
OUT=$B/traces
mkdir -p "$OUT" || exit 1

# The value of "key" in gmb-replay's pretty-printed JSON (one key a line).
jget() {
  sed -n "s/^ *\"$2\": *\"*\([^\",]*\)\"*,*$/\1/p" "$1" | head -n 1
}

# Bytes as MiB with one decimal.
mib() {
  awk -v b="$1" 'BEGIN { printf "%.1f", b / 1048576 }'
}

status=0
printf '%-12s %-5s %7s %9s %9s %6s %7s %6s %6s %10s %10s %6s %7s %12s %13s\n' \
  trace mode ops failures frag_fail page static floor paged peak_MiB held_MiB \
  hit% reqs moved_MiB compaction_s
for t in $TRACES; do
  trace=$OUT/$t.trace
  if ! "$GEN" --seed "$SEED" --scale "$SCALE" "$t" >"$trace"; then
    echo "frag: tracegen $t failed" >&2
    status=1
    continue
  fi
  for mode in off auto cache; do
    json=$OUT/$t.$mode.json
    series=$OUT/$t.$mode.series
    if [ "$mode" = cache ]; then
      set -- --compaction auto --cache
    else
      set -- --compaction "$mode"
    fi
    if ! "$REPLAY" --trace "$trace" "$@" --json \
        --series "$series" >"$json" 2>"$OUT/$t.$mode.err"; then
      echo "frag: gmb-replay $t ($mode) failed:" >&2
      sed 's/^/  | /' "$OUT/$t.$mode.err" >&2
      status=1
      continue
    fi
    if [ "$mode" = cache ]; then
      hit=$(jget "$json" cache_hit_rate | awk '{ printf "%.1f", 100 * $1 }')
    else
      hit=-
    fi
    printf '%-12s %-5s %7s %9s %9s %6s %7s %6s %6s %10s %10s %6s %7s %12s %13s\n' \
      "$t" "$mode" \
      "$(jget "$json" operations)" "$(jget "$json" failures)" \
      "$(jget "$json" fragmentation_failures)" \
      "$(jget "$json" page_bound_failures)" \
      "$(jget "$json" baseline_static_failures)" \
      "$(jget "$json" baseline_shared_failures)" \
      "$(jget "$json" baseline_paged_failures)" \
      "$(mib "$(jget "$json" peak_bytes_in_use)")" \
      "$(mib "$(jget "$json" peak_bytes_held)")" "$hit" \
      "$(jget "$json" broker_requests)" \
      "$(mib "$(jget "$json" bytes_moved)")" \
      "$(jget "$json" compaction_seconds | awk '{ printf "%.3f", $1 }')"
  done
done
echo "(failures include quota refusals; frag_fail: GMB_E_NOMEM while the"
echo " free total was enough; page: of those, the ones no allocator with"
echo " per-tenant 2 MiB pages could serve; static, floor, paged: the"
echo " baselines' failures (paged: the floor with each tenant in 2 MiB"
echo " pages of its own, what a broker that isolates tenants can reach);"
echo " held: the peak of the bytes of the caches' pages at one moment (in"
echo " use without the cache); hit%: requests served with no page mapped;"
echo " reqs: alloc/free requests to the broker; JSON and series in $OUT)"

# --- the plot ----------------------------------------------------------------
if [ -z "$PLOT" ]; then
  echo "frag: FRAG_PLOT is empty: no plot"
  exit $status
fi
off=$OUT/$PLOT.off.series
auto=$OUT/$PLOT.auto.series
if [ ! -s "$off" ] || [ ! -s "$auto" ]; then
  echo "frag: no series for trace '$PLOT': no plot" >&2
  exit $status
fi
if ! command -v gnuplot >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "frag: installing gnuplot-nox for the plot"
    apt-get install -y -q gnuplot-nox >/dev/null 2>&1 ||
      { apt-get update -q >/dev/null 2>&1 &&
        apt-get install -y -q gnuplot-nox >/dev/null 2>&1; }
  fi
fi
if ! command -v gnuplot >/dev/null 2>&1; then
  echo "frag: gnuplot is not installed (Debian: apt-get install gnuplot-nox):" \
    "no plot"
  exit $status
fi
mkdir -p "$(dirname "$PNG")"
cap=$(sed -n 's/^capacity \(.*\)$/\1/p' "$OUT/$PLOT.trace" | head -n 1)
# Columns of a series: op bytes_in_use largest_free in_segments free_total.
if gnuplot <<EOF
set terminal pngcairo size 1100,760 font "sans,11"
set output "$PNG"
set multiplot layout 2,1 title "gmb-replay, trace '$PLOT' (capacity $cap): compaction off vs auto"
set grid
set key outside right top box
set autoscale xfix
set yrange [0:*]
set ylabel "bytes in use (MiB)"
set format x ""
set lmargin 10
set rmargin 14
plot "$off"  using 1:(\$2/1048576) with lines lw 4 lc rgb "#f4a582" title "off", \
     "$auto" using 1:(\$2/1048576) with lines lw 1.5 lc rgb "#2166ac" title "auto"
set ylabel "largest free range (MiB)"
set xlabel "operation"
set format x "%g"
plot "$off"  using 1:(\$3/1048576) with lines lw 4 lc rgb "#f4a582" title "off", \
     "$auto" using 1:(\$3/1048576) with lines lw 1.5 lc rgb "#2166ac" title "auto"
unset multiplot
EOF
then
  echo "plot: $PNG"
else
  echo "frag: gnuplot failed" >&2
  status=1
fi
exit $status
