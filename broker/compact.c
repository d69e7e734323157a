/*
 * compact.c - the compaction engine (see compact.h for the contract).
 *
 * A run is a cursor that moves through three states, one unit of work per
 * turn of gmb__compact_step()'s loop, checking the deadline between units:
 *
 *   PICK  choose the source: the least used movable small segment in
 *         scope that the run has not visited in this pass, that existed
 *         when the run began, and that has free space (a goal run first
 *         checks whether its room is there, and ends if so).  Decide how
 *         to work it: EVACUATE when no allocation of it is locked and its
 *         bytes have room in fuller small segments of its arena (the sum
 *         of their free bytes, and a place for its largest allocation), so
 *         that it can empty and be released; else SLIDE (a run without a
 *         goal, or a goal run's packing pass) or leave it (SKIP).
 *   SCAN  take the source's next allocation at or above the cursor (one
 *         decision): find its target (EVACUATE: the best fit among the
 *         holes of pinned segments, else among the free ranges of fuller
 *         movable segments; SLIDE: the lowest free range below it
 *         that holds it, else the free range just below it if the overlap
 *         is not too small a shift), claim it through the hooks, reserve
 *         the target in the pool.  An evacuation that left something
 *         behind (no room, locked) ends with one SLIDE pass over the same
 *         segment, so what stays is at least packed down.
 *   COPY  copy one chunk (at most 4 MiB, and no more than the shift for a
 *         slide that overlaps, lowest first, so no chunk overlaps its
 *         destination and nothing is overwritten before it is read); after
 *         the last, commit and publish.
 *
 * What gathers free space: emptying whole segments gives their bytes back
 * to the device (where any arena and class can use them: a large request
 * needs exactly that), and sliding packs a segment's allocations down so
 * its free ranges merge into one at the top.  A move between segments only
 * goes to a segment at least as full as its source (used + reserved over
 * size, ties by lower id: a total order), and a slide only goes down, so
 * sum(used^2 / size) or the sum of offsets strictly grows or falls with
 * every move: no ping-pong.
 *
 * Termination does not depend on the rest of the broker being quiet: each
 * segment is a source at most once per pass (at most six passes, the last
 * a bounded number of planned chains), only segments that existed at the
 * start are sources, and within a source the cursor only moves up (a
 * decision sets it past the allocation it looked at), so a run makes at
 * most about two decisions per 512 bytes of those segments per pass, plus
 * the copy chunks of the moves it decided.
 *
 * Between steps the engine keeps no pointer into the pool, only ids
 * (segment, allocation, move serial) that it looks up again, because the
 * broker allocates and frees between steps.  It reads the pool's structures
 * (pool_impl.h) and changes them only through gmb__pool_move_*.  A move in
 * flight pins its source and target segments (the pool does not count them
 * empty), and the pool drops it if its allocation is freed behind the
 * engine's back, which commit/abort then report as GMB_E_NOENT.
 */
#include "compact.h"

#include <stdlib.h>
#include <string.h>

#include "gmb.h"
#include "log.h"
#include "pool_impl.h"
#include "repack.h"
#include "util.h"

/* The largest copy between two deadline checks.  The loop gives
 * compaction slices of about a millisecond.  On the host device the broker
 * maps a segment's pages as it first copies them, which brings a copy
 * down to about 1 GB/s on the machines measured, so a 256 KiB chunk takes
 * a quarter of a millisecond and no client waits much past a slice
 * (measured with 1 MiB chunks: p99 of a client's request 3.8 ms during a
 * 1 GiB compaction; with 256 KiB: 1.5 ms).  A GPU copies a chunk this size
 * in microseconds; the CUDA device may want larger ones. */
#define COMPACT_CHUNK (UINT64_C(256) << 10)

enum compact_state { C_PICK, C_SCAN, C_COPY, C_DONE };
enum compact_mode { M_EVACUATE, M_SLIDE, M_SKIP, M_PLAN };
/* A run with a goal makes up to six passes over the segments, each
 * visiting a segment at most once: evacuate what can empty; pack every
 * segment down (slide) so its free bytes are one range at its top; then
 * evacuate again into those ranges; then evacuate into any segment of
 * the arena, emptier ones too (COMPACT_PASS_ANY), a segment whose blocks
 * all have a place there (compact_can_move); last, for a run that also
 * takes a hole in one arena as its goal (gmb__compact_add_hole), move the
 * blocks of a window of one of that arena's segments elsewhere, the same
 * way, so that the window becomes the hole (COMPACT_PASS_HOLE, the
 * cheapest windows first: compact_hole_window).  The last two passes take
 * full segments too.  Then, still short of the room, the run plans chains
 * of moves (COMPACT_PASS_REPACK, repack.c): a segment whose blocks fit no
 * hole empties when windows of their size are made for them in other
 * segments first, or the hole is made two links deep, or by packing one
 * segment (a few blocks out, the rest slid down); the plan that moves the
 * fewest bytes is carried out.  Up to COMPACT_REPACK_PLANS plans, a
 * new one after each that is done or that the broker's frees,
 * allocations and locks spoiled (a step finds its allocation gone or its
 * target taken); the run ends when it finds none.  The order "only to
 * fuller segments" keeps runs without a goal from undoing each other, but
 * it also leaves a 1 MiB block in a 1.6 MiB segment when the only 1 MiB hole
 * is in a segment holding just 1 MiB.  A goal run ends as soon as the room
 * is there, so it cannot go back and forth. */
enum { COMPACT_PASS_EVACUATE, COMPACT_PASS_SLIDE, COMPACT_PASS_AGAIN,
       COMPACT_PASS_ANY, COMPACT_PASS_HOLE, COMPACT_PASS_REPACK,
       COMPACT_PASSES };
/* COMPACT_PASS_REPACK: plans per run, at most (each planning may do
 * GMB_REPACK_BUDGET of work). */
#define COMPACT_REPACK_PLANS 16u
/* The allocations found locked that a run remembers, at most. */
#define COMPACT_LOCKED_MAX 4096u
/* What compact_can_move looks at, at most: the largest free ranges of
 * the arena (a bound on its work; fewer holes only make it say no). */
#define COMPACT_PLAN_HOLES 1024u

struct gmb_compact {
  struct gmb_pool *p;
  struct gmb_arena *arena; /* scope; NULL: every arena */
  struct gmb_compact_hooks h;
  struct gmb_compact_stats st;
  enum compact_state state;
  uint64_t max_seg; /* only segments up to this id are sources */
  uint64_t goal;    /* device room wanted (bytes); 0: a whole run */
  struct gmb_arena *hole_arena; /* or a free range of hole_size in it */
  uint64_t hole_size;
  uint64_t plan_cursor; /* where compact_plan says the scan starts */
  uint64_t plan_stop;   /* ... and ends (0: the segment's end) */
  int pass;         /* goal runs: COMPACT_PASS_* */

  /* Allocations the run found locked (compact_saw_locked). */
  uint64_t *locked_ids;
  size_t nlocked, locked_cap;

  /* COMPACT_PASS_REPACK: the plan carried out, and its next step. */
  struct gmb_repack_plan plan;
  size_t plan_next;
  unsigned plans; /* made in this run */

  /* Segments visited: an open-addressing set of ids (never 0). */
  uint64_t *seen;
  size_t seen_cap, seen_n;

  /* The source. */
  uint64_t src;
  struct gmb_arena *src_arena;
  enum compact_mode mode;
  int blocked;     /* an evacuation left something behind */
  uint64_t cursor; /* allocations below it were decided */
  uint64_t stop;   /* allocations from it on stay (0: none) */
  uint64_t hint;   /* id of the live allocation expected at the cursor */

  /* The move in flight (C_COPY). */
  struct gmb_pool_move mv;
  struct gmb_alloc_info claimed;
  uint64_t copied, chunk;
  int descending;
  int overlap; /* a slide over its own old place */
};

/* ---- the set of visited segments -------------------------------------- */

static size_t compact_hash(uint64_t id, size_t cap) {
  return (size_t)((id * UINT64_C(0x9e3779b97f4a7c15)) >> 20) & (cap - 1);
}

static int compact_seen(const struct gmb_compact *c, uint64_t id) {
  if (!c->seen_cap) return 0;
  for (size_t i = compact_hash(id, c->seen_cap);;
       i = (i + 1) & (c->seen_cap - 1)) {
    if (c->seen[i] == id) return 1;
    if (c->seen[i] == 0) return 0;
  }
}

/* Adds id to the set: 0, or GMB_E_NOMEM (compact_pick then ends the run,
 * since without the mark the segment could be picked again). */
static int compact_mark(struct gmb_compact *c, uint64_t id) {
  if (2 * (c->seen_n + 1) > c->seen_cap) {
    size_t cap = c->seen_cap ? 2 * c->seen_cap : 64;
    uint64_t *ns = calloc(cap, sizeof *ns);
    if (!ns) return GMB_E_NOMEM;
    for (size_t j = 0; j < c->seen_cap; j++) {
      if (!c->seen[j]) continue;
      size_t i = compact_hash(c->seen[j], cap);
      while (ns[i]) i = (i + 1) & (cap - 1);
      ns[i] = c->seen[j];
    }
    free(c->seen);
    c->seen = ns;
    c->seen_cap = cap;
  }
  size_t i = compact_hash(id, c->seen_cap);
  while (c->seen[i] && c->seen[i] != id) i = (i + 1) & (c->seen_cap - 1);
  if (!c->seen[i]) {
    c->seen[i] = id;
    c->seen_n++;
  }
  return 0;
}

/* ---- policy ----------------------------------------------------------- */

static uint64_t compact_free_bytes(const struct gmb_segment *s) {
  return s->dseg.size - s->used - s->reserved;
}

/* 1 when segment a is fuller than b: a pinned segment (it cannot empty),
 * or one that holds a lock held across runs (it counts as pinned), above
 * any other, then (used + reserved) / size, ties by lower id.  A total
 * order: moves between segments only go up it. */
static int compact_fuller(const struct gmb_segment *a,
                          const struct gmb_segment *b) {
  int ap = a->cls == POOL_SMALL_PINNED || a->held,
      bp = b->cls == POOL_SMALL_PINNED || b->held;
  if (ap != bp) return ap;
  unsigned __int128 x =
      (unsigned __int128)(a->used + a->reserved) * b->dseg.size;
  unsigned __int128 y =
      (unsigned __int128)(b->used + b->reserved) * a->dseg.size;
  if (x != y) return x > y;
  return a->dseg.id < b->dseg.id;
}

static int compact_accept_fuller(void *ctx, const struct gmb_segment *t) {
  const struct gmb_segment *s = ctx;
  return t != s && compact_fuller(t, s);
}

/* COMPACT_PASS_ANY: any other segment that holds something (an empty one
 * is about to go back to the device: filling it gives nothing). */
static int compact_accept_other(void *ctx, const struct gmb_segment *t) {
  const struct gmb_segment *s = ctx;
  return t != s && t->live > 0;
}

static int compact_any(const struct gmb_compact *c) {
  return c->goal &&
         (c->pass == COMPACT_PASS_ANY || c->pass == COMPACT_PASS_HOLE);
}

static int compact_live(const struct pool_range *r) {
  return !(r->flags & (GMB_RANGE_FREE | GMB_RANGE_TARGET));
}

/* Sources are movable small segments (mobility grouping keeps pinned
 * allocations out of them); large allocations have a segment each and
 * never move.  A full segment gives nothing by being packed or emptied
 * into fuller ones, but the last two passes may empty it into emptier
 * segments' holes, or make a window of it the hole. */
static int compact_candidate(const struct gmb_compact *c,
                             const struct gmb_segment *s) {
  return (!c->arena || s->arena == c->arena) && s->dseg.id <= c->max_seg &&
         s->cls == POOL_SMALL_MOVABLE && s->live > 0 &&
         (compact_free_bytes(s) > 0 || compact_any(c)) && s->targets == 0 &&
         !compact_seen(c, s->dseg.id);
}

/* What compact_fit passes its accept function. */
struct compact_fit_ctx {
  int (*accept)(void *, const struct gmb_segment *);
  struct gmb_segment *s;
};

static int compact_accept_held(void *ctx, const struct gmb_segment *t) {
  const struct compact_fit_ctx *f = ctx;
  return t->held && f->accept(f->s, t);
}

/* A free range for `size` bytes out of s in a fuller small segment of its
 * arena: pinned segments' holes first (they can never be given back), then
 * those of segments that hold a lock held across runs (nor those, as long
 * as it lasts), then the best fit among movable segments. */
static const struct pool_range *compact_fit(const struct gmb_compact *c,
                                            struct gmb_segment *s,
                                            uint64_t size) {
  struct compact_fit_ctx f = {
      compact_any(c) ? compact_accept_other : compact_accept_fuller, s};
  const struct pool_range *t =
      gmb__pool_fit(c->p, s->arena, POOL_SMALL_PINNED, size, f.accept, s);
  if (!t && s->arena->held)
    t = gmb__pool_fit(c->p, s->arena, POOL_SMALL_MOVABLE, size,
                      compact_accept_held, &f);
  if (!t)
    t = gmb__pool_fit(c->p, s->arena, POOL_SMALL_MOVABLE, size, f.accept, s);
  return t;
}

/* Remembers that the run found allocation id locked (up to
 * COMPACT_LOCKED_MAX of them): when the run ends, the pool notes it
 * (gmb__pool_note_lock), and one found locked by two runs in a row counts
 * as pinned for placement. */
static void compact_saw_locked(struct gmb_compact *c, uint64_t id) {
  if (c->nlocked == c->locked_cap) {
    size_t cap = c->locked_cap ? 2 * c->locked_cap : 16;
    uint64_t *n = cap <= COMPACT_LOCKED_MAX
                      ? realloc(c->locked_ids, cap * sizeof *n)
                      : NULL;
    if (!n) return;
    c->locked_ids = n;
    c->locked_cap = cap;
  }
  c->locked_ids[c->nlocked++] = id;
}

/* 1 when live allocation r is held locked now (its claim would be
 * refused).  Either way the pool hears of it: found free, r's lock notes
 * go at once; found locked, at the run's end. */
static int compact_locked(struct gmb_compact *c, const struct pool_range *r) {
  if (!c->h.locked) return 0;
  struct gmb_alloc_info info;
  uint64_t id = gmb__pool_range_id(c->p, r);
  if (gmb__pool_find(c->p, id, &info) != 0) return 0;
  if (!c->h.locked(c->h.ctx, &info)) {
    gmb__pool_note_lock(c->p, r, 0);
    return 0;
  }
  compact_saw_locked(c, id);
  return 1;
}

static int compact_id_cmp(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? -1 : x > y;
}

/* The run is over: each allocation it found locked, once, is noted. */
static void compact_note_locks(struct gmb_compact *c) {
  if (c->nlocked == 0) return;
  qsort(c->locked_ids, c->nlocked, sizeof *c->locked_ids, compact_id_cmp);
  for (size_t i = 0; i < c->nlocked; i++) {
    if (i > 0 && c->locked_ids[i] == c->locked_ids[i - 1]) continue;
    const struct pool_range *r = gmb__pool_range_by_id(c->p, c->locked_ids[i]);
    if (r) gmb__pool_note_lock(c->p, r, 1);
  }
}

/* 1 when a live allocation of s is held locked now: such a segment cannot
 * empty in this run, so it counts as pinned for the run's decisions. */
static int compact_has_locked(struct gmb_compact *c,
                              const struct gmb_segment *s) {
  for (const struct pool_range *r = s->first; r; r = r->next)
    if (compact_live(r) && compact_locked(c, r)) return 1;
  return 0;
}

/* EVACUATE when s can empty: nothing locked, and its bytes have room in
 * fuller small segments of its arena, its largest allocation included.
 * Otherwise SLIDE (pack it down), except in a goal run's evacuation
 * passes, where a segment that cannot empty is left alone (SKIP): sliding
 * it gives no room back. */
static int compact_desc(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? 1 : x > y ? -1 : 0;
}

/* COMPACT_PASS_ANY and _HOLE: 1 when every live allocation of s that
 * reaches into [from, to) has a place in the
 * free ranges of the arena's other non-empty small segments, placed
 * largest first, each in the smallest hole that holds it (what the moves
 * will do, near enough: compact_fit takes pinned segments' holes first).
 * Looks at the COMPACT_PLAN_HOLES largest holes at most; 0 when out of
 * host memory. */
static int compact_can_move(const struct gmb_segment *s, uint64_t from,
                            uint64_t to) {
  uint64_t *holes = malloc(COMPACT_PLAN_HOLES * sizeof *holes);
  uint64_t *blocks = malloc(s->live * sizeof *blocks + 1);
  int ok = holes != NULL && blocks != NULL;
  size_t nh = 0, nb = 0;
  const struct gmb_segment *t;
  LIST_FOREACH(t, &s->arena->segs, link) {
    if (!ok || !pool_cls_small(t->cls) || !compact_accept_other((void *)s, t))
      continue;
    for (const struct pool_range *r = t->first; r; r = r->next) {
      if (!(r->flags & GMB_RANGE_FREE)) continue;
      if (nh < COMPACT_PLAN_HOLES) {
        holes[nh++] = r->size;
        continue;
      }
      /* Full: keep the largest (replace the smallest kept). */
      size_t m = 0;
      for (size_t i = 1; i < nh; i++)
        if (holes[i] < holes[m]) m = i;
      if (r->size > holes[m]) holes[m] = r->size;
    }
  }
  for (const struct pool_range *r = s->first; ok && r; r = r->next)
    if (compact_live(r) && r->offset + r->size > from && r->offset < to &&
        nb < s->live)
      blocks[nb++] = r->size;
  if (ok) {
    qsort(holes, nh, sizeof *holes, compact_desc);
    qsort(blocks, nb, sizeof *blocks, compact_desc);
    for (size_t i = 0; ok && i < nb; i++) {
      /* The smallest hole that holds it: holes are sorted largest first. */
      size_t best = nh;
      for (size_t k = 0; k < nh && holes[k] >= blocks[i]; k++) best = k;
      if (best == nh) ok = 0;
      else holes[best] -= blocks[i];
      /* Keep the order: the shrunk hole sinks to its place. */
      for (size_t k = best; ok && k + 1 < nh && holes[k] < holes[k + 1]; k++) {
        uint64_t x = holes[k];
        holes[k] = holes[k + 1];
        holes[k + 1] = x;
      }
    }
  }
  free(holes);
  free(blocks);
  return ok;
}

/* 1 when allocation r (live) may move now: movable, not moving, and not
 * held locked. */
static int compact_may_move(struct gmb_compact *c,
                            const struct pool_range *r) {
  return (r->flags & GMB_MOVABLE) && !(r->flags & POOL_MOVING_SRC) &&
         !compact_locked(c, r);
}

/* What a range weighs in a window of the hole pass: the bytes a move of
 * it costs, or, for one that may not move (or a move's target), a block
 * of the window (*bad). */
static uint64_t compact_range_weight(struct gmb_compact *c,
                                     const struct pool_range *r, int *bad) {
  *bad = 0;
  if (r->flags & GMB_RANGE_FREE) return 0;
  if ((r->flags & GMB_RANGE_TARGET) || !compact_may_move(c, r)) {
    *bad = 1;
    return 0;
  }
  return r->size;
}

/* COMPACT_PASS_HOLE: picks where in s the hole is made.  Of the windows
 * of hole_size bytes that start where a range of s starts (or end at its
 * end) and hold nothing pinned or locked, the cheapest few (bytes to
 * move) are tried in order: the first whose allocations all have a place
 * in the arena's other segments (compact_can_move) is taken.  A KV
 * cache's segment is often full of blocks half the request's size or
 * less: two small ones somewhere in the middle may have places where the
 * top's larger one has none, and a 1 MiB block may have none where four
 * 256 KiB ones beside it have.  One walk over the ranges (the window
 * slides: what enters at its end is added, what leaves at its start
 * taken off), so a segment of thousands of small allocations costs no
 * more than a few passes over them.  Sets the scan's bounds and returns 1,
 * or 0 when no window will do. */
static int compact_hole_window(struct gmb_compact *c,
                               const struct gmb_segment *s) {
  uint64_t size = c->hole_size;
  struct gmb_repack_window best[GMB_REPACK_WINDOWS];
  size_t n = 0;
  uint64_t bytes = 0;
  unsigned bad = 0;
  int b;
  const struct pool_range *hi = s->first;
  for (const struct pool_range *lo = s->first; lo; lo = lo->next) {
    uint64_t to = lo->offset + size;
    if (to > s->dseg.size) break;
    for (; hi && hi->offset < to; hi = hi->next) {
      bytes += compact_range_weight(c, hi, &b);
      bad += (unsigned)b;
    }
    if (bad == 0 && bytes > 0) {
      struct gmb_repack_window w = {bytes, s->dseg.id, lo->offset};
      gmb__repack_window_keep(best, &n, &w);
    }
    bytes -= compact_range_weight(c, lo, &b);
    bad -= (unsigned)b;
  }
  /* The top: it may start inside a range. */
  struct gmb_repack_window top = {0, s->dseg.id, s->dseg.size - size};
  const struct pool_range *first = NULL; /* the first range that reaches in */
  bad = 0;
  for (const struct pool_range *r = s->first; r; r = r->next) {
    if (r->offset + r->size <= top.lo) continue;
    if (first == NULL) first = r;
    top.cost += compact_range_weight(c, r, &b);
    bad += (unsigned)b;
  }
  if (bad == 0 && top.cost > 0 && first->offset != top.lo)
    gmb__repack_window_keep(best, &n, &top);
  for (size_t k = 0; k < n; k++) {
    if (!compact_can_move(s, best[k].lo, best[k].lo + size)) continue;
    c->plan_cursor = gmb__pool_range_at(s, best[k].lo)->offset;
    c->plan_stop = best[k].lo + size;
    return 1;
  }
  return 0;
}

static enum compact_mode compact_plan(struct gmb_compact *c,
                                      struct gmb_segment *s) {
  if (c->goal && c->pass == COMPACT_PASS_SLIDE) return M_SLIDE;
  enum compact_mode no = c->goal ? M_SKIP : M_SLIDE;
  if (c->goal && c->pass == COMPACT_PASS_ANY) {
    if (s->pinned || compact_has_locked(c, s) ||
        !compact_can_move(s, 0, UINT64_MAX))
      return no;
    return M_EVACUATE;
  }
  if (c->goal && c->pass == COMPACT_PASS_HOLE) {
    if (s->arena != c->hole_arena || s->dseg.size < c->hole_size ||
        !compact_hole_window(c, s))
      return no;
    return M_EVACUATE;
  }
  uint64_t room = 0;
  const struct gmb_segment *t;
  LIST_FOREACH(t, &s->arena->segs, link)
  if (pool_cls_small(t->cls) && t != s && compact_fuller(t, s))
    room += compact_free_bytes(t);
  if (room < s->used) return no;
  uint64_t big = 0;
  for (const struct pool_range *r = s->first; r; r = r->next)
    if (compact_live(r) && r->size > big) big = r->size;
  if (!compact_fit(c, s, big)) return no;
  if (compact_has_locked(c, s)) return no;
  return M_EVACUATE;
}

/* 1 when a goal run has what it came for. */
static int compact_goal_met(const struct gmb_compact *c) {
  struct gmb_pool_stats ps;
  gmb__pool_stats(c->p, &ps);
  if (ps.room >= c->goal) return 1;
  if (c->hole_arena == NULL) return 0;
  struct gmb_arena_stats as;
  gmb__pool_arena_stats(c->hole_arena, &as);
  return as.largest_free >= c->hole_size;
}

/* ---- COMPACT_PASS_REPACK ------------------------------------------------ */

static int compact_movable(void *ctx, const struct pool_range *r) {
  return compact_may_move(ctx, r);
}

/* Keeps plan pl of arena a when it moves fewer bytes than the one kept. */
static void compact_repack_keep(struct gmb_compact *c, struct gmb_arena *a,
                                int rc, struct gmb_repack_plan *pl) {
  if (rc < 0) log_warn("compaction: out of host memory planning a repack");
  if (rc == 1 && (c->plan.n == 0 || pl->bytes < c->plan.bytes)) {
    gmb__repack_plan_clear(&c->plan);
    c->plan = *pl;
    c->src_arena = a;
    *pl = (struct gmb_repack_plan){0};
  } else {
    gmb__repack_plan_clear(pl);
  }
}

/* Plans the next chain (repack.c): the one that moves the fewest bytes of
 * those that empty a segment of an arena in scope and, for a run with a
 * hole goal, the one that makes the hole.  Ends the run when none is
 * found, or after COMPACT_REPACK_PLANS plans. */
static void compact_repack_pick(struct gmb_compact *c) {
  gmb__repack_plan_clear(&c->plan);
  c->plan_next = 0;
  if (c->plans == COMPACT_REPACK_PLANS) {
    c->state = C_DONE;
    return;
  }
  uint64_t budget = GMB_REPACK_BUDGET;
  struct gmb_repack_plan pl = {0};
  if (c->hole_arena) {
    int rc = gmb__repack_plan(c->p, c->hole_arena, c->max_seg, c->hole_size,
                              compact_movable, c, &budget, &pl);
    compact_repack_keep(c, c->hole_arena, rc, &pl);
  }
  struct gmb_arena *a = c->arena ? c->arena : gmb__pool_arena_next(c->p, NULL);
  for (; a; a = c->arena ? NULL : gmb__pool_arena_next(c->p, a)) {
    int rc = gmb__repack_plan(c->p, a, c->max_seg, 0, compact_movable, c,
                              &budget, &pl);
    compact_repack_keep(c, a, rc, &pl);
  }
  if (c->plan.n == 0) {
    c->state = C_DONE;
    return;
  }
  c->plans++;
  c->st.plans++;
  c->mode = M_PLAN;
  c->blocked = 0;
  c->state = C_SCAN;
}

/* The free range of s where a step moving r lands at off: it holds
 * [off, off + r's size), or r slides down within s into the free range
 * just below it (the two overlap).  NULL when the pool has no such range. */
static struct pool_range *compact_free_at(struct gmb_segment *s, uint64_t off,
                                          const struct pool_range *r) {
  struct pool_range *f = gmb__pool_range_at(s, off);
  if (!f || !(f->flags & GMB_RANGE_FREE)) return NULL;
  if (off + r->size <= f->offset + f->size) return f;
  return f->next == r ? f : NULL;
}

static void compact_begin(struct gmb_compact *c, struct pool_range *r,
                          const struct pool_range *t, uint64_t dst_offset);
static void compact_source_done(struct gmb_compact *c);

/* The plan's next step.  When the plan is done, or the pool changed under
 * it (the allocation gone or moved, its target taken, a claim refused, a
 * copy failed), back to the pick, which plans again. */
static void compact_plan_step(struct gmb_compact *c) {
  if (c->blocked || c->plan_next == c->plan.n) {
    compact_source_done(c);
    return;
  }
  const struct gmb_repack_step *st = &c->plan.steps[c->plan_next++];
  struct pool_range *r = gmb__pool_range_by_id(c->p, st->id);
  struct gmb_segment *d = gmb__pool_seg_by_id(c->p, st->dst_seg);
  struct pool_range *t = r && d ? compact_free_at(d, st->dst_offset, r) : NULL;
  if (!t || r->seg->dseg.id != st->src_seg || r->size != st->size ||
      r->seg->arena != d->arena || !compact_may_move(c, r)) {
    c->blocked = 1;
    return;
  }
  compact_begin(c, r, t, st->dst_offset);
}

static void compact_pick(struct gmb_compact *c) {
  if (c->goal && compact_goal_met(c)) {
    c->state = C_DONE;
    return;
  }
  if (c->goal && c->pass == COMPACT_PASS_REPACK) {
    compact_repack_pick(c);
    return;
  }
  struct gmb_segment *best = NULL, *s;
  if (c->arena) {
    LIST_FOREACH(s, &c->arena->segs, link)
    if (compact_candidate(c, s) && (!best || compact_fuller(best, s))) best = s;
  } else {
    for (s = gmb__pool_seg_next(c->p, NULL); s; s = gmb__pool_seg_next(c->p, s))
      if (compact_candidate(c, s) && (!best || compact_fuller(best, s)))
        best = s;
  }
  if (!best && c->goal && c->pass + 1 < COMPACT_PASSES) {
    /* Another pass: every segment may be visited again. */
    c->pass++;
    if (c->seen) memset(c->seen, 0, c->seen_cap * sizeof *c->seen);
    c->seen_n = 0;
    return;
  }
  if (!best) {
    c->state = C_DONE;
    return;
  }
  if (compact_mark(c, best->dseg.id) != 0) {
    /* Without the set the run could come back to this segment: end it
     * rather than risk not ending. */
    log_warn("compaction: out of host memory; run ended early");
    c->state = C_DONE;
    return;
  }
  c->src = best->dseg.id;
  c->src_arena = best->arena;
  c->mode = compact_plan(c, best);
  if (c->mode == M_SKIP) {
    c->src = 0;
    c->src_arena = NULL;
    return;
  }
  c->blocked = 0;
  c->cursor = c->plan_cursor;
  c->stop = c->plan_stop;
  c->plan_cursor = 0;
  c->plan_stop = 0;
  c->hint = 0;
  c->state = C_SCAN;
}

/* SLIDE: the lowest free range below r that holds it, else the free range
 * just below it when the overlap leaves a shift worth copying. */
static const struct pool_range *compact_slide_target(
    const struct pool_range *r) {
  if (r->seg->sealed) return NULL; /* it is being emptied: no slide */
  for (const struct pool_range *f = r->seg->first; f != r; f = f->next)
    if ((f->flags & GMB_RANGE_FREE) && f->size >= r->size) return f;
  const struct pool_range *f = r->prev;
  if (f && (f->flags & GMB_RANGE_FREE) &&
      f->size * GMB_REPACK_SLIDE_CHUNKS >= r->size)
    return f;
  return NULL;
}

static void compact_source_done(struct gmb_compact *c) {
  c->src = 0;
  c->src_arena = NULL;
  c->state = C_PICK;
}

/* One decision about the source's next allocation. */
static void compact_scan(struct gmb_compact *c) {
  if (c->mode == M_PLAN) {
    compact_plan_step(c);
    return;
  }
  struct gmb_segment *s = gmb__pool_seg_by_id(c->p, c->src);
  if (!s) { /* emptied by frees and released */
    compact_source_done(c);
    return;
  }
  struct pool_range *r = c->hint ? gmb__pool_range_by_id(c->p, c->hint) : NULL;
  if (r && (r->seg != s || r->offset < c->cursor)) r = NULL;
  if (!r) {
    r = s->first;
    while (r && r->offset < c->cursor) r = r->next;
  }
  while (r && !compact_live(r)) r = r->next;
  if (r && c->stop && r->offset >= c->stop) r = NULL;
  if (!r) {
    if (c->mode == M_EVACUATE && c->blocked) {
      c->mode = M_SLIDE; /* pack down what stays */
      c->cursor = 0;
      c->stop = 0;
      c->hint = 0;
      return;
    }
    compact_source_done(c);
    return;
  }
  const struct pool_range *nx = r->next;
  while (nx && !compact_live(nx)) nx = nx->next;
  c->hint = nx ? gmb__pool_range_id(c->p, nx) : 0;
  c->cursor = r->offset + r->size;
  if (!(r->flags & GMB_MOVABLE) || (r->flags & POOL_MOVING_SRC)) {
    c->blocked = 1; /* pinned (counted at the pick), or another run's */
    return;
  }
  const struct pool_range *t;
  if (c->mode == M_EVACUATE)
    t = compact_fit(c, s, r->size);
  else
    t = compact_slide_target(r);
  if (!t) {
    c->blocked = 1;
    return;
  }
  compact_begin(c, r, t, t->offset);
}

/* Claims r and reserves its target at dst_offset inside free range t, and
 * on to the copy; else marks the source blocked. */
static void compact_begin(struct gmb_compact *c, struct pool_range *r,
                          const struct pool_range *t, uint64_t dst_offset) {
  uint64_t id = gmb__pool_range_id(c->p, r);
  struct gmb_alloc_info info;
  if (gmb__pool_find(c->p, id, &info) != 0) {
    GMB_ASSERT(0 && "a live range has an id");
    return;
  }
  if (c->h.claim && !c->h.claim(c->h.ctx, &info)) {
    c->st.skipped_locked++;
    compact_saw_locked(c, id);
    c->blocked = 1;
    return;
  }
  gmb__pool_note_lock(c->p, r, 0); /* claimed: its lock is free */
  int rc = gmb__pool_move_begin_at(c->p, id, (struct pool_range *)t,
                                   dst_offset, &c->mv);
  if (rc != 0) {
    log_warn("compaction: cannot reserve a target for %#llx: %s",
             (unsigned long long)id, gmb_err_name(rc));
    if (c->h.release) c->h.release(c->h.ctx, &info);
    c->blocked = 1;
    return;
  }
  c->claimed = info;
  c->copied = 0;
  c->chunk = COMPACT_CHUNK;
  c->descending = 0;
  c->overlap = 0;
  if (c->mv.src == c->mv.dst) {
    uint64_t lo = c->mv.src_offset, hi = c->mv.dst_offset;
    int up = hi > lo;
    uint64_t shift = up ? hi - lo : lo - hi;
    if (shift < c->mv.size) { /* overlap: chunks no larger than the shift */
      if (shift < c->chunk) c->chunk = shift;
      c->overlap = 1;
      c->descending = up; /* moving up: copy the top first */
    }
  }
  c->state = C_COPY;
}

/* Ends the move in flight: abort (with release when `release`). */
static void compact_abort(struct gmb_compact *c, int release) {
  gmb__pool_move_abort(c->p, &c->mv);
  if (release && c->h.release) c->h.release(c->h.ctx, &c->claimed);
  c->state = C_SCAN;
}

static void compact_copy(struct gmb_compact *c) {
  struct gmb_pool_move *m = &c->mv;
  uint64_t len = m->size - c->copied;
  if (len > c->chunk) len = c->chunk;
  uint64_t off = c->descending ? m->size - c->copied - len : c->copied;
  int rc = gmb__device_copy(gmb__pool_device(c->p), m->dst, m->dst_offset + off,
                            m->src, m->src_offset + off, len);
  if (rc != 0) {
    log_error("compaction: copying %#llx failed (%s); it stays where it is",
              (unsigned long long)m->id, gmb_err_name(rc));
    c->blocked = 1;
    compact_abort(c, 1);
    return;
  }
  c->copied += len;
  if (c->copied < m->size) return;
  struct gmb_alloc_info moved;
  uint64_t released = 0, t0 = gmb__now_ns();
  rc = gmb__pool_move_commit(c->p, m, &moved, &released);
  c->state = C_SCAN;
  if (rc != 0) {
    /* Its allocation was freed without gmb__compact_forget(): the pool
     * dropped the move; nobody is left to tell. */
    log_warn("compaction: move of %#llx vanished before its commit",
             (unsigned long long)m->id);
    return;
  }
  c->st.moves++;
  c->st.bytes_moved += m->size;
  if (released) {
    c->st.segments_released++;
    c->st.bytes_released += released;
    c->st.ns_release += gmb__now_ns() - t0; /* mostly the device's release */
  }
  if (c->h.publish) c->h.publish(c->h.ctx, &moved);
}

/* ---- the contract ----------------------------------------------------- */

struct gmb_compact *gmb__compact_new(struct gmb_pool *p, struct gmb_arena *a,
                                     uint64_t goal,
                                     const struct gmb_compact_hooks *hooks) {
  struct gmb_compact *c = calloc(1, sizeof *c);
  if (!c) return NULL;
  c->p = p;
  c->arena = a;
  c->goal = goal;
  if (hooks) c->h = *hooks;
  c->state = C_PICK;
  for (struct gmb_segment *s = gmb__pool_seg_next(p, NULL); s;
       s = gmb__pool_seg_next(p, s)) {
    c->max_seg = s->dseg.id; /* id order: the last is the newest */
    if (!a || s->arena == a) c->st.skipped_pinned += s->pinned;
    /* A segment held by a lock (it counts as pinned) is looked at again
     * first: the lock may be free by now, and then the segment is like
     * any other in this run's order. */
    if ((!a || s->arena == a) && s->held) compact_has_locked(c, s);
  }
  return c;
}

int gmb__compact_step(struct gmb_compact *c, uint64_t deadline_ns) {
  if (c->state == C_DONE) return 0;
  uint64_t t0 = gmb__now_ns(), t = t0;
  do {
    switch (c->state) {
      case C_PICK:
        compact_pick(c);
        break;
      case C_SCAN:
        compact_scan(c);
        break;
      case C_COPY:
        compact_copy(c);
        break;
      case C_DONE:
        break;
    }
    t = gmb__now_ns();
  } while (c->state != C_DONE && t < deadline_ns);
  c->st.ns += t - t0;
  return c->state != C_DONE;
}

int gmb__compact_forget(struct gmb_compact *c, uint64_t id) {
  if (!c || c->state != C_COPY || c->mv.id != id) return 0;
  compact_abort(c, 0);
  return 1;
}

int gmb__compact_forget_owner(struct gmb_compact *c, const void *owner) {
  if (!c || c->state != C_COPY || c->claimed.owner != owner) return 0;
  compact_abort(c, 0);
  return 1;
}

void gmb__compact_forget_arena(struct gmb_compact *c, struct gmb_arena *a) {
  if (!c) return;
  if (c->src_arena == a) {
    if (c->state == C_COPY) compact_abort(c, 0);
    compact_source_done(c);
  }
  if (c->arena == a) c->state = C_DONE;
  if (c->hole_arena == a) c->hole_arena = NULL;
}

void gmb__compact_add_goal(struct gmb_compact *c, uint64_t bytes) {
  if (c->goal) c->goal += bytes;
}

void gmb__compact_add_hole(struct gmb_compact *c, struct gmb_arena *a,
                           uint64_t size) {
  if (!c->goal || c->hole_arena || a == NULL || size == 0 ||
      size > GMB_POOL_SMALL_MAX)
    return;
  c->hole_arena = a;
  c->hole_size = size;
}

void gmb__compact_stats(const struct gmb_compact *c,
                        struct gmb_compact_stats *out) {
  *out = c->st;
}

void gmb__compact_destroy(struct gmb_compact *c) {
  if (!c) return;
  /* A slide that overlaps its old place has overwritten the start of it
   * once more than the shift was copied: the old range no longer holds
   * the allocation, so the move is finished (at most a 1 MiB copy), not
   * abandoned.  Any other move leaves its source intact and is
   * abandoned. */
  while (c->state == C_COPY && c->overlap && c->copied > 0)
    compact_copy(c);
  if (c->state == C_COPY) compact_abort(c, 1);
  compact_note_locks(c);
  free(c->locked_ids);
  gmb__repack_plan_clear(&c->plan);
  free(c->seen);
  free(c);
}

