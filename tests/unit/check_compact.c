/*
 * check_compact.c - the compaction engine on a real host device, so the
 * bytes that move are real: every allocation a test tracks is filled with
 * a pattern derived from its id, and the pattern is checked at wherever
 * gmb__pool_find() says the allocation is now.
 *
 * The fixture builds a 256 MiB host device (sparse shm: only what a test
 * writes costs memory) and a pool; teardown requires gmb__pool_check() == 0
 * and, after the pool is destroyed, that the device holds no segment.
 * Runs are driven one unit at a time (deadline 0) with the pool checked
 * after every step.  The hooks record claims, publishes and releases, and
 * refuse claims for ids a test marks locked.
 * Knobs: SCALE (multiplies stress sizes), ITER (stress rounds), SEED.
 */
#include <check.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check_main.h"
#include "compact.h"
#include "device.h"
#include "evacuate.h"
#include "gmb.h"
#include "pool.h"
#include "util.h"

#define CAP (256 * GMB_MIB)
#define SEG GMB_POOL_SMALL_SEGMENT
#define KIB UINT64_C(1024)

static struct gmb_device *dev;
static struct gmb_pool *pool;
static int tag_a, tag_b, owner_x, owner_y;
static unsigned nretired;

/* ---- hooks -------------------------------------------------------------- */

#define MAXLOCKED 256
static struct {
  uint64_t locked[MAXLOCKED];
  unsigned nlocked;
  unsigned claims, publishes, releases;
  uint64_t in_flight;      /* id claimed and not yet published/released */
  uint64_t last_published; /* id */
  int check_publish;       /* publish must match gmb__pool_find */
} hk;

static int hk_claim(void *ctx, const struct gmb_alloc_info *a) {
  ck_assert_ptr_eq(ctx, &hk);
  ck_assert_uint_eq(hk.in_flight, 0); /* one move at a time */
  ck_assert_uint_ne(a->id, 0);
  ck_assert(a->flags & GMB_MOVABLE);
  for (unsigned i = 0; i < hk.nlocked; i++)
    if (hk.locked[i] == a->id) return 0;
  hk.claims++;
  hk.in_flight = a->id;
  return 1;
}

static void hk_publish(void *ctx, const struct gmb_alloc_info *moved) {
  ck_assert_ptr_eq(ctx, &hk);
  ck_assert_uint_eq(moved->id, hk.in_flight);
  if (hk.check_publish) {
    struct gmb_alloc_info now;
    ck_assert_int_eq(gmb__pool_find(pool, moved->id, &now), 0);
    ck_assert_uint_eq(now.offset, moved->offset);
    ck_assert_uint_eq(now.dseg->id, moved->dseg->id);
    ck_assert_uint_eq(now.tag, moved->tag);
  }
  hk.publishes++;
  hk.last_published = moved->id;
  hk.in_flight = 0;
}

static void hk_release(void *ctx, const struct gmb_alloc_info *a) {
  ck_assert_ptr_eq(ctx, &hk);
  ck_assert_uint_eq(a->id, hk.in_flight);
  hk.releases++;
  hk.in_flight = 0;
}

static int hk_locked(void *ctx, const struct gmb_alloc_info *a) {
  ck_assert_ptr_eq(ctx, &hk);
  for (unsigned i = 0; i < hk.nlocked; i++)
    if (hk.locked[i] == a->id) return 1;
  return 0;
}

static const struct gmb_compact_hooks hooks = {
    .ctx = &hk,
    .claim = hk_claim,
    .publish = hk_publish,
    .release = hk_release,
    .locked = hk_locked,
};

static void on_retire(void *ctx, const struct gmb_dseg *seg, void *tag) {
  (void)seg;
  (void)tag;
  ck_assert_ptr_eq(ctx, &nretired);
  nretired++;
}

static void open_pool(uint64_t cap) {
  char err[256];
  ck_assert_int_eq(gmb__device_host_open(cap, &dev, err, sizeof err), 0);
  pool = gmb__pool_new(dev, on_retire, &nretired);
  ck_assert_ptr_nonnull(pool);
}

static void close_pool(void) {
  ck_assert_int_eq(gmb__pool_check(pool), 0);
  gmb__pool_destroy(pool);
  ck_assert_uint_eq(dev->in_use, 0);
  ck_assert_uint_eq(dev->segments, 0);
  gmb__device_close(dev);
  pool = NULL;
  dev = NULL;
}

static void setup(void) {
  memset(&hk, 0, sizeof hk);
  hk.check_publish = 1;
  nretired = 0;
  open_pool(CAP);
}

static void teardown(void) { close_pool(); }

/* ---- tracked allocations with patterns ---------------------------------- */

struct tracked {
  uint64_t id, size;
  int pinned;
  uint64_t seg, off; /* where it was when last looked at */
};

static uint64_t pattern_word(uint64_t id, uint64_t k) {
  return (id * UINT64_C(0x9e3779b97f4a7c15)) ^
         (k * UINT64_C(0xbf58476d1ce4e5b9));
}

/* Word k of an allocation, in its segment or, past its pages, in its
 * tail's (pool.h rule 1). */
static uint64_t *word_of(const struct gmb_alloc_info *info, uint64_t k) {
  uint64_t at = k * 8, pages = info->size - info->tail_size;
  if (at >= pages)
    return (uint64_t *)((char *)info->tail_dseg->host + info->tail_offset +
                        (at - pages));
  return (uint64_t *)((char *)info->dseg->host + info->offset + at);
}

static void pattern_fill(const struct gmb_alloc_info *info) {
  for (uint64_t k = 0; k < info->size / 8; k++)
    *word_of(info, k) = pattern_word(info->id, k);
}

static void pattern_check(uint64_t id) {
  struct gmb_alloc_info info;
  ck_assert_int_eq(gmb__pool_find(pool, id, &info), 0);
  for (uint64_t k = 0; k < info.size / 8; k++)
    if (*word_of(&info, k) != pattern_word(id, k))
      ck_abort_msg(
          "allocation %#llx: word %llu of %llu wrong at seg %llu "
          "offset %llu",
          (unsigned long long)id, (unsigned long long)k,
          (unsigned long long)(info.size / 8),
          (unsigned long long)info.dseg->id, (unsigned long long)info.offset);
}

static struct tracked track(struct gmb_arena *a, uint64_t size, int movable,
                            void *owner) {
  struct gmb_alloc_info info;
  int rc =
      gmb__pool_alloc(pool, a, size, movable ? GMB_MOVABLE : 0, owner, &info);
  ck_assert_msg(rc == 0, "alloc %llu: %s", (unsigned long long)size,
                gmb_err_name(rc));
  pattern_fill(&info);
  ck_assert_int_eq(gmb__pool_check(pool), 0);
  return (struct tracked){info.id, info.size, !movable, info.dseg->id,
                          info.offset};
}

static void where(struct tracked *t) {
  struct gmb_alloc_info info;
  ck_assert_int_eq(gmb__pool_find(pool, t->id, &info), 0);
  t->seg = info.dseg->id;
  t->off = info.offset;
}

static void free_ok(uint64_t id) {
  ck_assert_int_eq(gmb__pool_free(pool, id, NULL), 0);
  ck_assert_int_eq(gmb__pool_check(pool), 0);
}

static double arena_frag(struct gmb_arena *a) {
  struct gmb_arena_stats as;
  gmb__pool_arena_stats(a, &as);
  return gmb__fragmentation(as.largest_free, as.free_total);
}

static uint64_t arena_segments(struct gmb_arena *a) {
  struct gmb_arena_stats as;
  gmb__pool_arena_stats(a, &as);
  return as.segments;
}

/* Drives a run one unit per step to its end, checking the pool after every
 * step; returns the number of steps (at most max_steps, else fails). */
static unsigned run_all(struct gmb_compact *c, unsigned max_steps) {
  unsigned steps = 0;
  for (;;) {
    int more = gmb__compact_step(c, 0);
    steps++;
    ck_assert_int_eq(gmb__pool_check(pool), 0);
    if (!more) break;
    ck_assert_msg(steps < max_steps, "run still going after %u steps", steps);
  }
  ck_assert_uint_eq(hk.in_flight, 0);
  return steps;
}

/* Steps until a move is in flight (a claim was taken); returns its id. */
static uint64_t step_until_claimed(struct gmb_compact *c) {
  for (unsigned i = 0; i < 100000 && !hk.in_flight; i++) {
    ck_assert_int_eq(gmb__compact_step(c, 0), 1);
    ck_assert_int_eq(gmb__pool_check(pool), 0);
  }
  ck_assert_uint_ne(hk.in_flight, 0);
  return hk.in_flight;
}

struct walk_acc {
  uint64_t targets, target_bytes, free_bytes, live;
};

static int walk_count(void *ctx, const struct gmb_alloc_info *info,
                      int is_free) {
  struct walk_acc *w = ctx;
  if (is_free) {
    w->free_bytes += info->size;
  } else if (info->flags & GMB_RANGE_TARGET) {
    ck_assert_uint_eq(info->id, 0);
    w->targets++;
    w->target_bytes += info->size;
  } else {
    ck_assert_uint_ne(info->id, 0);
    w->live++;
  }
  return 0;
}

static uint64_t count_targets(void) {
  struct walk_acc w = {0};
  gmb__pool_walk(pool, walk_count, &w);
  return w.targets;
}

/* ---- tests --------------------------------------------------------------- */

/* Small movable allocations of varied sizes fill 8 segments; every other
 * one is freed; a run moves the rest together, releases segments, lowers
 * fragmentation, and every pattern is intact at its new place. */
START_TEST(fragmented_arena_gets_compacted) {
  struct gmb_arena *a = gmb__pool_arena_new(pool, &tag_a);
  enum { N = 512 };
  struct tracked t[N];
  unsigned n = 0;
  const uint64_t sizes[] = {8 * KIB, 16 * KIB, 24 * KIB, 32 * KIB, 48 * KIB};
  while (n < N && arena_segments(a) <= 8) {
    t[n] = track(a, sizes[n % 5], 1, &owner_x);
    n++;
  }
  unsigned kept = 0;
  for (unsigned i = 0; i < n; i++) {
    if (i % 2)
      free_ok(t[i].id);
    else
      t[kept++] = t[i];
  }
  n = kept;
  uint64_t segs_before = arena_segments(a);
  double frag_before = arena_frag(a);
  unsigned retired_before = nretired;
  struct gmb_compact *c = gmb__compact_new(pool, a, 0, &hooks);
  ck_assert_ptr_nonnull(c);
  run_all(c, 1000000);
  struct gmb_compact_stats st;
  gmb__compact_stats(c, &st);
  gmb__compact_destroy(c);
  for (unsigned i = 0; i < n; i++) pattern_check(t[i].id);
  uint64_t segs_after = arena_segments(a);
  double frag_after = arena_frag(a);
  printf(
      "compact fragmented: %u allocations, segments %llu -> %llu, "
      "fragmentation %.3f -> %.3f, %llu moves, %llu bytes\n",
      n, (unsigned long long)segs_before, (unsigned long long)segs_after,
      frag_before, frag_after, (unsigned long long)st.moves,
      (unsigned long long)st.bytes_moved);
  ck_assert_uint_gt(st.moves, 0);
  ck_assert_uint_eq(st.moves, hk.publishes);
  ck_assert_uint_eq(hk.claims, hk.publishes + hk.releases);
  ck_assert_uint_gt(st.segments_released, 0);
  ck_assert_uint_eq(segs_after, segs_before - st.segments_released);
  ck_assert_uint_eq(st.bytes_released, st.segments_released * SEG);
  ck_assert_uint_eq(nretired - retired_before, st.segments_released);
  ck_assert(frag_after < frag_before);
  ck_assert_uint_eq(st.skipped_pinned, 0);
  ck_assert_uint_eq(st.skipped_locked, 0);
  /* A second run finds the arena already compact: nothing released. */
  c = gmb__compact_new(pool, a, 0, &hooks);
  run_all(c, 1000000);
  gmb__compact_stats(c, &st);
  gmb__compact_destroy(c);
  ck_assert_uint_eq(st.segments_released, 0);
  for (unsigned i = 0; i < n; i++) pattern_check(t[i].id);
}
END_TEST

START_TEST(pinned_never_moves) {
  struct gmb_arena *a = gmb__pool_arena_new(pool, &tag_a);
  enum { N = 400 };
  struct tracked t[N];
  for (unsigned i = 0; i < N; i++)
    t[i] = track(a, (1 + i % 7) * 8 * KIB, i % 5 != 0, &owner_x);
  unsigned n = 0;
  for (unsigned i = 0; i < N; i++) {
    if (i % 3 == 1)
      free_ok(t[i].id);
    else
      t[n++] = t[i];
  }
  struct gmb_compact *c = gmb__compact_new(pool, NULL, 0, &hooks);
  run_all(c, 1000000);
  struct gmb_compact_stats st;
  gmb__compact_stats(c, &st);
  gmb__compact_destroy(c);
  ck_assert_uint_gt(st.moves, 0);
  ck_assert_uint_gt(st.skipped_pinned, 0);
  for (unsigned i = 0; i < n; i++) {
    struct tracked now = t[i];
    where(&now);
    if (t[i].pinned) {
      ck_assert_uint_eq(now.seg, t[i].seg);
      ck_assert_uint_eq(now.off, t[i].off);
    }
    pattern_check(t[i].id);
  }
}
END_TEST

START_TEST(locked_skipped) {
  struct gmb_arena *a = gmb__pool_arena_new(pool, &tag_a);
  enum { N = 400 };
  struct tracked t[N];
  for (unsigned i = 0; i < N; i++) t[i] = track(a, 16 * KIB, 1, &owner_x);
  unsigned n = 0;
  for (unsigned i = 0; i < N; i++) {
    if (i % 2)
      free_ok(t[i].id);
    else
      t[n++] = t[i];
  }
  /* Lock every fifth survivor. */
  for (unsigned i = 0; i < n; i += 5) hk.locked[hk.nlocked++] = t[i].id;
  struct gmb_compact *c = gmb__compact_new(pool, a, 0, &hooks);
  run_all(c, 1000000);
  struct gmb_compact_stats st;
  gmb__compact_stats(c, &st);
  gmb__compact_destroy(c);
  ck_assert_uint_gt(st.moves, 0);
  ck_assert_uint_gt(st.skipped_locked, 0);
  ck_assert_uint_eq(st.skipped_pinned, 0);
  for (unsigned i = 0; i < n; i++) {
    struct tracked now = t[i];
    where(&now);
    if (i % 5 == 0) {
      ck_assert_uint_eq(now.seg, t[i].seg);
      ck_assert_uint_eq(now.off, t[i].off);
    }
    pattern_check(t[i].id);
  }
}
END_TEST

/* A small segment [free 1 MiB][X 960 KiB][D 64 KiB]: the arena has no
 * other segment, so X slides down into the free range below it, a copy of
 * four chunks (256 KiB at most each).  Returns X. */
static struct tracked build_slide(struct gmb_arena *a, struct tracked *d) {
  struct tracked h = track(a, GMB_MIB, 1, &owner_x);
  struct tracked x = track(a, 960 * KIB, 1, &owner_x);
  *d = track(a, 64 * KIB, 1, &owner_x);
  ck_assert_uint_eq(h.off, 0);
  ck_assert_uint_eq(x.off, GMB_MIB);
  ck_assert_uint_eq(d->seg, x.seg);
  free_ok(h.id);
  return x;
}

START_TEST(forget_mid_move) {
  struct gmb_arena *a = gmb__pool_arena_new(pool, &tag_a);
  struct tracked d, x = build_slide(a, &d);
  struct gmb_compact *c = gmb__compact_new(pool, a, 0, &hooks);
  ck_assert_uint_eq(step_until_claimed(c), x.id);
  /* Copy a few chunks, not all. */
  for (int i = 0; i < 2; i++) {
    ck_assert_int_eq(gmb__compact_step(c, 0), 1);
    ck_assert_int_eq(gmb__pool_check(pool), 0);
  }
  ck_assert_uint_eq(count_targets(), 1);
  struct gmb_arena_stats as;
  gmb__pool_arena_stats(a, &as);
  ck_assert_uint_gt(as.moving, 0);
  ck_assert_int_eq(gmb__compact_forget(c, d.id), 0); /* not the one moving */
  ck_assert_int_eq(gmb__compact_forget(c, x.id), 1);
  ck_assert_int_eq(gmb__pool_check(pool), 0);
  ck_assert_uint_eq(count_targets(), 0);
  gmb__pool_arena_stats(a, &as);
  ck_assert_uint_eq(as.moving, 0);
  /* It did not move. */
  struct tracked now = x;
  where(&now);
  ck_assert_uint_eq(now.off, x.off);
  pattern_check(x.id);
  free_ok(x.id);
  hk.in_flight = 0; /* forget does not call release: the caller frees it */
  run_all(c, 100000);
  struct gmb_compact_stats st;
  gmb__compact_stats(c, &st);
  gmb__compact_destroy(c);
  ck_assert_uint_eq(hk.releases, 0);
  pattern_check(d.id);
  /* D slid to the bottom of its segment once X was gone. */
  where(&d);
  ck_assert_uint_eq(d.off, 0);
  ck_assert_uint_eq(st.moves, 1);
}
END_TEST

/* The pool drops a move whose allocation is freed without the engine being
 * told: commit then finds nothing, and nothing is published. */
START_TEST(free_without_forget_is_survived) {
  struct gmb_arena *a = gmb__pool_arena_new(pool, &tag_a);
  struct tracked d, x = build_slide(a, &d);
  struct gmb_compact *c = gmb__compact_new(pool, a, 0, &hooks);
  ck_assert_uint_eq(step_until_claimed(c), x.id);
  ck_assert_int_eq(gmb__compact_step(c, 0), 1);
  free_ok(x.id);
  ck_assert_uint_eq(count_targets(), 0);
  hk.in_flight = 0;
  hk.check_publish = 0;
  run_all(c, 100000);
  gmb__compact_destroy(c);
  ck_assert_uint_eq(hk.publishes, 1); /* D only */
  ck_assert_uint_eq(hk.last_published, d.id);
  pattern_check(d.id);
}
END_TEST

static uint64_t rng_state;
static uint64_t rng(void) { return gmb__splitmix64(&rng_state); }

static unsigned env_uint(const char *name, unsigned dflt) {
  const char *s = getenv(name);
  if (!s || !*s) return dflt;
  return (unsigned)strtoul(s, NULL, 0);
}

/* Random frees and allocations between every step of a run, in the
 * arena being compacted (so in its source and target segments too). */
START_TEST(free_between_steps) {
  unsigned seed = env_uint("SEED", (unsigned)gmb__now_ns());
  rng_state = seed;
  printf("compact free_between_steps: SEED=%u\n", seed);
  struct gmb_arena *a = gmb__pool_arena_new(pool, &tag_a);
  enum { N = 1200 };
  struct tracked *t = malloc(N * sizeof *t);
  unsigned n = 0;
  for (unsigned i = 0; i < 600; i++)
    t[n++] = track(a, 512 * (1 + rng() % 96), rng() % 8 != 0, &owner_x);
  for (unsigned i = 0; i < n;) {
    if (rng() & 1) {
      free_ok(t[i].id);
      t[i] = t[--n];
    } else {
      i++;
    }
  }
  struct gmb_compact *c = gmb__compact_new(pool, a, 0, &hooks);
  unsigned steps = 0;
  hk.check_publish = 1;
  for (;;) {
    int more = gmb__compact_step(c, 0);
    steps++;
    ck_assert_int_eq(gmb__pool_check(pool), 0);
    if (!more) break;
    ck_assert_uint_lt(steps, 1000000);
    uint64_t op = rng() % 4;
    if (op == 0 && n > 0) {
      unsigned k = (unsigned)(rng() % n);
      if (gmb__compact_forget(c, t[k].id)) hk.in_flight = 0;
      free_ok(t[k].id);
      t[k] = t[--n];
    } else if (op == 1 && n < N) {
      t[n++] = track(a, 512 * (1 + rng() % 96), rng() % 8 != 0, &owner_x);
    }
  }
  gmb__compact_destroy(c);
  ck_assert_uint_eq(hk.in_flight, 0);
  for (unsigned i = 0; i < n; i++) pattern_check(t[i].id);
  free(t);
}
END_TEST

/* y is locked, so its segment cannot empty: x slides down over its own
 * old place rather than leave for another segment. */
START_TEST(overlapping_move_within_segment) {
  struct gmb_arena *a = gmb__pool_arena_new(pool, &tag_a);
  struct tracked f0 = track(a, 8 * KIB, 1, &owner_x);
  struct tracked x = track(a, 64 * KIB, 1, &owner_x);
  struct tracked y = track(a, 4 * KIB, 1, &owner_x); /* locked, above */
  hk.locked[hk.nlocked++] = y.id;
  ck_assert_uint_eq(x.off, 8 * KIB);
  ck_assert_int_eq(gmb__pool_set_tag(pool, x.id, 77), 0);
  free_ok(f0.id);
  struct gmb_compact *c = gmb__compact_new(pool, a, 0, &hooks);
  unsigned steps = run_all(c, 1000);
  struct gmb_compact_stats st;
  gmb__compact_stats(c, &st);
  gmb__compact_destroy(c);
  ck_assert_uint_eq(st.moves, 1);
  ck_assert_uint_eq(st.bytes_moved, 64 * KIB);
  ck_assert_uint_ge(steps, 8); /* 8 chunks of the 8 KiB shift */
  struct gmb_alloc_info info;
  ck_assert_int_eq(gmb__pool_find(pool, x.id, &info), 0);
  ck_assert_uint_eq(info.offset, 0);
  ck_assert_uint_eq(info.dseg->id, x.seg);
  ck_assert_uint_eq(info.tag, 77);
  pattern_check(x.id);
  pattern_check(y.id);
  /* The freed tail merged with the gap below the pinned one. */
  struct gmb_arena_stats as;
  gmb__pool_arena_stats(a, &as);
  ck_assert_uint_eq(as.largest_free, SEG - 64 * KIB - 8 * KIB - 4 * KIB);
}
END_TEST

/* A run ended in the middle of a slide that overlaps its old place: the
 * chunks already copied overwrote the start of the old range, so the move
 * is finished rather than abandoned, and the bytes are intact. */
START_TEST(destroy_mid_overlapping_slide) {
  struct gmb_arena *a = gmb__pool_arena_new(pool, &tag_a);
  struct tracked f0 = track(a, 8 * KIB, 1, &owner_x);
  struct tracked x = track(a, 64 * KIB, 1, &owner_x);
  struct tracked y = track(a, 4 * KIB, 1, &owner_x);
  hk.locked[hk.nlocked++] = y.id;
  free_ok(f0.id);
  struct gmb_compact *c = gmb__compact_new(pool, a, 0, &hooks);
  ck_assert_uint_eq(step_until_claimed(c), x.id);
  for (int i = 0; i < 3; i++) { /* 3 of the 8 chunks */
    ck_assert_int_eq(gmb__compact_step(c, 0), 1);
    ck_assert_int_eq(gmb__pool_check(pool), 0);
  }
  gmb__compact_destroy(c);
  ck_assert_int_eq(gmb__pool_check(pool), 0);
  ck_assert_uint_eq(hk.in_flight, 0);
  ck_assert_uint_eq(hk.publishes, 1);
  ck_assert_uint_eq(count_targets(), 0);
  where(&x);
  ck_assert_uint_eq(x.off, 0);
  pattern_check(x.id);
  pattern_check(y.id);
}
END_TEST

START_TEST(slide_chunked) {
  struct gmb_arena *a = gmb__pool_arena_new(pool, &tag_a);
  struct tracked d, x = build_slide(a, &d);
  struct gmb_compact *c = gmb__compact_new(pool, a, 0, &hooks);
  ck_assert_uint_eq(step_until_claimed(c), x.id);
  unsigned copy_steps = 0;
  while (hk.in_flight) {
    ck_assert_int_eq(gmb__compact_step(c, gmb__now_ns()), 1);
    ck_assert_int_eq(gmb__pool_check(pool), 0);
    copy_steps++;
    ck_assert_uint_le(copy_steps, 1000);
  }
  /* 960 KiB in chunks of at most 256 KiB: one step each at deadline =
   * now. */
  ck_assert_uint_ge(copy_steps, 4);
  ck_assert_uint_eq(hk.last_published, x.id);
  pattern_check(x.id);
  where(&x);
  ck_assert_uint_eq(x.off, 0);
  run_all(c, 100000);
  gmb__compact_destroy(c);
  pattern_check(x.id);
  pattern_check(d.id);
}
END_TEST

START_TEST(one_arena_only) {
  struct gmb_arena *ar[2] = {gmb__pool_arena_new(pool, &tag_a),
                             gmb__pool_arena_new(pool, &tag_b)};
  enum { N = 300 };
  struct tracked t[2][N];
  unsigned n[2] = {0, 0};
  for (unsigned i = 0; i < 2 * N; i++) {
    int k = i & 1;
    t[k][n[k]++] = track(ar[k], (1 + i % 5) * 8 * KIB, 1, &owner_x);
  }
  for (int k = 0; k < 2; k++) {
    unsigned m = 0;
    for (unsigned i = 0; i < n[k]; i++)
      if (i % 2)
        free_ok(t[k][i].id);
      else
        t[k][m++] = t[k][i];
    n[k] = m;
  }
  uint64_t segs_b = arena_segments(ar[1]);
  struct gmb_compact *c = gmb__compact_new(pool, ar[0], 0, &hooks);
  run_all(c, 1000000);
  struct gmb_compact_stats st;
  gmb__compact_stats(c, &st);
  gmb__compact_destroy(c);
  ck_assert_uint_gt(st.moves, 0);
  ck_assert_uint_eq(arena_segments(ar[1]), segs_b);
  for (unsigned i = 0; i < n[1]; i++) {
    struct tracked now = t[1][i];
    where(&now);
    ck_assert_uint_eq(now.seg, t[1][i].seg);
    ck_assert_uint_eq(now.off, t[1][i].off);
    pattern_check(now.id);
  }
  for (unsigned i = 0; i < n[0]; i++) pattern_check(t[0][i].id);
}
END_TEST

START_TEST(release_hook_on_destroy) {
  struct gmb_arena *a = gmb__pool_arena_new(pool, &tag_a);
  struct tracked d, x = build_slide(a, &d);
  struct gmb_compact *c = gmb__compact_new(pool, a, 0, &hooks);
  ck_assert_uint_eq(step_until_claimed(c), x.id);
  ck_assert_int_eq(gmb__compact_step(c, 0), 1);
  gmb__compact_destroy(c);
  ck_assert_uint_eq(hk.releases, 1);
  ck_assert_uint_eq(hk.publishes, 0);
  ck_assert_uint_eq(hk.in_flight, 0);
  ck_assert_uint_eq(count_targets(), 0);
  struct tracked now = x;
  where(&now);
  ck_assert_uint_eq(now.off, x.off);
  pattern_check(x.id);
  gmb__compact_destroy(NULL);
}
END_TEST

/* The arena ends during a move out of it: forget_arena, then destroy. */
START_TEST(forget_arena_mid_move) {
  struct gmb_arena *a = gmb__pool_arena_new(pool, &tag_a);
  struct gmb_arena *b = gmb__pool_arena_new(pool, &tag_b);
  struct tracked d, x = build_slide(a, &d);
  struct tracked y = track(b, 16 * KIB, 1, &owner_y);
  struct gmb_compact *c = gmb__compact_new(pool, NULL, 0, &hooks);
  ck_assert_uint_eq(step_until_claimed(c), x.id);
  ck_assert_int_eq(gmb__compact_step(c, 0), 1);
  gmb__compact_forget_arena(c, a);
  ck_assert_int_eq(gmb__pool_check(pool), 0);
  gmb__pool_arena_destroy(pool, a);
  ck_assert_int_eq(gmb__pool_check(pool), 0);
  hk.in_flight = 0;
  run_all(c, 100000);
  gmb__compact_destroy(c);
  ck_assert_uint_eq(hk.releases, 0);
  pattern_check(y.id);
}
END_TEST

/* The pool alone: an arena destroyed while a move is in flight, without
 * the engine (the pool drops the move). */
START_TEST(arena_destroy_drops_move) {
  struct gmb_arena *a = gmb__pool_arena_new(pool, &tag_a);
  struct tracked d, x = build_slide(a, &d);
  struct gmb_pool_move m;
  ck_assert_int_eq(gmb__pool_move_begin(pool, x.id, x.seg, 0, &m), 0);
  ck_assert_int_eq(gmb__pool_check(pool), 0);
  ck_assert_int_eq(gmb__pool_move_begin(pool, x.id, x.seg, 0, &m),
                   GMB_E_INVAL); /* already moving */
  gmb__pool_arena_destroy(pool, a);
  ck_assert_int_eq(gmb__pool_check(pool), 0);
  ck_assert_int_eq(gmb__pool_move_commit(pool, &m, NULL, NULL), GMB_E_NOENT);
  ck_assert_int_eq(gmb__pool_move_abort(pool, &m), GMB_E_NOENT);
}
END_TEST

/* Pool move primitives refuse what they must. */
START_TEST(move_begin_refuses) {
  struct gmb_arena *a = gmb__pool_arena_new(pool, &tag_a);
  struct gmb_arena *b = gmb__pool_arena_new(pool, &tag_b);
  struct tracked x = track(a, 16 * KIB, 1, &owner_x);
  struct tracked y = track(a, 16 * KIB, 1, &owner_x);
  struct tracked z = track(b, 16 * KIB, 1, &owner_y);
  struct tracked big = track(a, 4 * GMB_MIB, 1, &owner_x);
  struct gmb_pool_move m;
  /* another arena, another class, up within its segment, onto live bytes */
  ck_assert_int_eq(gmb__pool_move_begin(pool, x.id, z.seg, 64 * KIB, &m),
                   GMB_E_INVAL);
  ck_assert_int_eq(gmb__pool_move_begin(pool, x.id, big.seg, 0, &m),
                   GMB_E_INVAL);
  ck_assert_int_eq(gmb__pool_move_begin(pool, x.id, x.seg, 64 * KIB, &m),
                   GMB_E_INVAL);
  ck_assert_int_eq(gmb__pool_move_begin(pool, y.id, y.seg, 0, &m), GMB_E_INVAL);
  ck_assert_int_eq(gmb__pool_move_begin(pool, 12345, x.seg, 0, &m),
                   GMB_E_NOENT);
  ck_assert_int_eq(gmb__pool_move_begin(pool, x.id, 999, 0, &m), GMB_E_NOENT);
  /* A target in the middle of a free range splits it in three; abort
   * merges it back. */
  free_ok(x.id);
  struct gmb_arena_stats mid, after;
  ck_assert_int_eq(gmb__pool_move_begin(pool, y.id, y.seg, 64 * KIB, &m),
                   GMB_E_INVAL);                      /* above itself */
  struct tracked w = track(a, 16 * KIB, 1, &owner_x); /* takes x's place */
  ck_assert_uint_eq(w.off, 0);
  ck_assert_int_eq(gmb__pool_move_begin(pool, w.id, y.seg, 0, &m),
                   GMB_E_INVAL); /* onto itself */
  free_ok(y.id);
  struct tracked v = track(a, 8 * KIB, 1, &owner_x); /* lands at 16K */
  struct tracked u = track(a, 8 * KIB, 1, &owner_x); /* at 24K */
  free_ok(w.id);
  free_ok(v.id);
  /* [free 24K][u 8K][free...]: u to 4K: splits the free range */
  ck_assert_int_eq(gmb__pool_move_begin(pool, u.id, u.seg, 4 * KIB, &m), 0);
  ck_assert_int_eq(gmb__pool_check(pool), 0);
  gmb__pool_arena_stats(a, &mid);
  ck_assert_uint_eq(mid.moving, 8 * KIB);
  ck_assert_uint_eq(mid.used + mid.free_total + mid.moving, mid.segment_bytes);
  /* The reserved bytes are not handed out: a 20K request does not fit the
   * 4K and 12K pieces left below u, so it goes above u. */
  struct gmb_alloc_info q;
  ck_assert_int_eq(gmb__pool_alloc(pool, a, 20 * KIB, 0, NULL, &q), 0);
  ck_assert(q.dseg->id != u.seg || q.offset >= u.off + u.size);
  ck_assert_int_eq(gmb__pool_move_abort(pool, &m), 0);
  ck_assert_int_eq(gmb__pool_check(pool), 0);
  gmb__pool_arena_stats(a, &after);
  ck_assert_uint_eq(after.moving, 0);
  ck_assert_int_eq(gmb__pool_move_abort(pool, &m), GMB_E_NOENT);
  free_ok(q.id);
  pattern_check(u.id);
  pattern_check(big.id);
  pattern_check(z.id);
}
END_TEST

/* Seeded random workload: rounds of allocations and frees, then a run with
 * frees and allocations between its steps; every run ends within a bound
 * derived from the pool at its start, and every pattern survives. */
/* One step of a seeded stress run, the pool checked after it; fails once
 * the run passes `bound` steps.  Returns whether the run goes on. */
static int step_checked(struct gmb_compact *c, uint64_t *steps, uint64_t bound,
                        unsigned seed, unsigned round) {
  int more = gmb__compact_step(c, 0);
  ++*steps;
  ck_assert_int_eq(gmb__pool_check(pool), 0);
  if (more)
    ck_assert_msg(*steps <= bound, "seed %u round %u: %llu steps > %llu", seed,
                  round, (unsigned long long)*steps,
                  (unsigned long long)bound);
  return more;
}

START_TEST(run_terminates) {
  unsigned scale = env_uint("SCALE", 1), iter = env_uint("ITER", 12) * scale;
  unsigned seed = env_uint("SEED", (unsigned)gmb__now_ns()) + 7;
  rng_state = seed;
  printf("compact run_terminates: SEED=%u ITER=%u\n", seed - 7, iter);
  struct gmb_arena *ar[2] = {gmb__pool_arena_new(pool, &tag_a),
                             gmb__pool_arena_new(pool, &tag_b)};
  size_t cap = 1500 * scale, n = 0;
  struct tracked *t = malloc(cap * sizeof *t);
  int *arena_of = malloc(cap * sizeof *arena_of);
  unsigned total_steps = 0, total_moves = 0;
  for (unsigned round = 0; round < iter; round++) {
    for (unsigned i = 0; i < 300 * scale && n < cap; i++) {
      uint64_t r = rng() % 100;
      uint64_t size = r < 80   ? 512 * (1 + rng() % 64)
                      : r < 97 ? 512 * (1 + rng() % 2048)
                               : GMB_MIB + 512 * (1 + rng() % 4096);
      int k = (int)(rng() & 1);
      struct gmb_alloc_info info;
      int rc = gmb__pool_alloc(pool, ar[k], size, rng() % 10 ? GMB_MOVABLE : 0,
                               &owner_x, &info);
      if (rc == GMB_E_NOMEM) continue;
      ck_assert_int_eq(rc, 0);
      pattern_fill(&info);
      t[n] = (struct tracked){info.id, info.size, 0, 0, 0};
      arena_of[n++] = k;
    }
    for (size_t i = 0; i < n;) {
      if (rng() % 100 < 55) {
        free_ok(t[i].id);
        t[i] = t[n - 1];
        arena_of[i] = arena_of[n - 1];
        n--;
      } else {
        i++;
      }
    }
    /* Bound: at most two decisions per 512 bytes of each segment present
     * at the start (a cursor that only goes up, two passes), each followed
     * by at most 65 copy chunks, plus one pick per segment. */
    struct gmb_pool_stats ps;
    gmb__pool_stats(pool, &ps);
    uint64_t bound = 4 + ps.segments + (ps.segment_bytes / 512) * 2 * 66;
    struct gmb_compact *c =
        gmb__compact_new(pool, rng() % 3 ? NULL : ar[rng() & 1], 0, &hooks);
    uint64_t steps = 0;
    while (step_checked(c, &steps, bound, seed - 7, round)) {
      uint64_t op = rng() % 8;
      if (op == 0 && n > 0) {
        size_t k = rng() % n;
        if (gmb__compact_forget(c, t[k].id)) hk.in_flight = 0;
        free_ok(t[k].id);
        t[k] = t[n - 1];
        arena_of[k] = arena_of[n - 1];
        n--;
      } else if (op == 1 && n < cap) {
        int k = (int)(rng() & 1);
        struct gmb_alloc_info info;
        if (gmb__pool_alloc(pool, ar[k], 512 * (1 + rng() % 64), GMB_MOVABLE,
                            &owner_y, &info) == 0) {
          pattern_fill(&info);
          t[n] = (struct tracked){info.id, info.size, 0, 0, 0};
          arena_of[n++] = k;
        }
      }
    }
    struct gmb_compact_stats st;
    gmb__compact_stats(c, &st);
    gmb__compact_destroy(c);
    ck_assert_uint_eq(hk.in_flight, 0);
    total_steps += (unsigned)steps;
    total_moves += (unsigned)st.moves;
    for (size_t i = 0; i < n; i++) pattern_check(t[i].id);
  }
  printf("compact run_terminates: %u runs, %u steps, %u moves, %zu live\n",
         iter, total_steps, total_moves, n);
  free(t);
  free(arena_of);
}
END_TEST

/* Toggles whether t (not in flight) is locked; returns 1 if it is now. */
static int lock_toggle(uint64_t id) {
  for (unsigned i = 0; i < hk.nlocked; i++)
    if (hk.locked[i] == id) {
      hk.locked[i] = hk.locked[--hk.nlocked];
      return 0;
    }
  if (hk.nlocked == MAXLOCKED || id == hk.in_flight) return 0;
  hk.locked[hk.nlocked++] = id;
  return 1;
}

static void lock_forget(uint64_t id) {
  for (unsigned i = 0; i < hk.nlocked; i++)
    if (hk.locked[i] == id) hk.locked[i] = hk.locked[--hk.nlocked];
}

/*
 * Goal runs on a full device under churn, seeded: paged-KV-like blocks (64
 * KiB to 1 MiB, 15 % pinned, a few tiny ones) fill two tenants' arenas, a
 * third is freed, some blocks are locked; then a run for a segment's room
 * and a hole in one arena (every pass, the chains and the packing), with
 * frees, allocations, locks and unlocks between its steps.  The pool is
 * checked after every step, the run must end within its bound, and every
 * pattern must be intact after it.
 */
START_TEST(goal_runs_survive_churn) {
  close_pool();
  open_pool(24 * GMB_MIB);
  unsigned scale = env_uint("SCALE", 1), iter = env_uint("ITER", 48) * scale;
  unsigned seed = env_uint("SEED", (unsigned)gmb__now_ns()) + 11;
  rng_state = seed;
  printf("compact goal_runs_survive_churn: SEED=%u ITER=%u\n", seed - 11,
         iter);
  struct gmb_arena *ar[2] = {gmb__pool_arena_new(pool, &tag_a),
                             gmb__pool_arena_new(pool, &tag_b)};
  enum { CAPN = 2048 };
  unsigned FREE_ONE_IN = env_uint("FREE_ONE_IN", 6);
  struct tracked *t = malloc(CAPN * sizeof *t);
  size_t n = 0;
  unsigned runs_met = 0, total_moves = 0, plans = 0;
  for (unsigned round = 0; round < iter; round++) {
    for (unsigned fails = 0, left = 0; fails < 40 && n < CAPN;) {
      /* Runs of blocks of one size, as a KV cache's requests take them. */
      static uint64_t size;
      if (left == 0) {
        left = 1 + (unsigned)(rng() % 8);
        size = rng() % 20 ? 64 * KIB << (rng() % 5) : 512 * (1 + rng() % 128);
      }
      left--;
      int pinned = rng() % 100 < 15;
      struct gmb_alloc_info info;
      int rc = gmb__pool_alloc(pool, ar[rng() & 1], size,
                               pinned ? 0 : GMB_MOVABLE, &owner_x, &info);
      if (rc == GMB_E_NOMEM) {
        fails++;
        continue;
      }
      ck_assert_int_eq(rc, 0);
      pattern_fill(&info);
      t[n++] = (struct tracked){info.id, info.size, pinned, 0, 0};
    }
    for (size_t i = 0; i < n;) {
      if (rng() % FREE_ONE_IN == 0) {
        lock_forget(t[i].id);
        free_ok(t[i].id);
        t[i] = t[--n];
      } else {
        if (!t[i].pinned && rng() % 40 == 0) lock_toggle(t[i].id);
        i++;
      }
    }
    struct gmb_pool_stats ps;
    gmb__pool_stats(pool, &ps);
    uint64_t bound = 4 + 6 * ps.segments +
                     (ps.segment_bytes / 512) * 2 * 66 * 6 +
                     16 * (n + 1) * 66 + 16;
    /* A hole just larger than the arena's largest free range. */
    int k = (int)(rng() & 1);
    struct gmb_arena_stats as;
    gmb__pool_arena_stats(ar[k], &as);
    uint64_t hole =
        (as.largest_free / (64 * KIB) + 1 + rng() % 4) * 64 * KIB;
    struct gmb_compact *c = gmb__compact_new(pool, NULL, SEG, &hooks);
    if (hole <= GMB_MIB) gmb__compact_add_hole(c, ar[k], hole);
    uint64_t steps = 0;
    while (step_checked(c, &steps, bound, seed - 11, round)) {
      uint64_t op = rng() % 16;
      if (op == 0 && n > 0) {
        size_t j = rng() % n;
        if (gmb__compact_forget(c, t[j].id)) hk.in_flight = 0;
        lock_forget(t[j].id);
        free_ok(t[j].id);
        t[j] = t[--n];
      } else if (op == 1 && n < CAPN) {
        struct gmb_alloc_info info;
        if (gmb__pool_alloc(pool, ar[rng() & 1], 64 * KIB * (1 + rng() % 4),
                            GMB_MOVABLE, &owner_y, &info) == 0) {
          pattern_fill(&info);
          t[n++] = (struct tracked){info.id, info.size, 0, 0, 0};
        }
      } else if (op == 2 && n > 0) {
        size_t j = rng() % n;
        if (!t[j].pinned) lock_toggle(t[j].id);
      }
    }
    struct gmb_compact_stats st;
    gmb__compact_stats(c, &st);
    gmb__compact_destroy(c);
    ck_assert_uint_eq(hk.in_flight, 0);
    total_moves += (unsigned)st.moves;
    plans += (unsigned)st.plans;
    gmb__pool_stats(pool, &ps);
    runs_met += ps.room >= SEG;
    for (size_t i = 0; i < n; i++) pattern_check(t[i].id);
  }
  printf("compact goal_runs_survive_churn: %u runs, %u moves, %u plans, %u "
         "with the room, %zu live\n",
         iter, total_moves, plans, runs_met, n);
  hk.nlocked = 0;
  free(t);
}
END_TEST

START_TEST(publish_called_once_per_move) {
  struct gmb_arena *a = gmb__pool_arena_new(pool, &tag_a);
  enum { N = 600 };
  struct tracked t[N];
  for (unsigned i = 0; i < N; i++) {
    t[i] = track(a, (1 + i % 9) * 4 * KIB, 1, &owner_x);
    ck_assert_int_eq(gmb__pool_set_tag(pool, t[i].id, i + 1), 0);
  }
  unsigned n = 0;
  for (unsigned i = 0; i < N; i++)
    if (i % 3)
      free_ok(t[i].id);
    else
      t[n++] = t[i];
  struct gmb_compact *c = gmb__compact_new(pool, a, 0, &hooks);
  run_all(c, 1000000);
  struct gmb_compact_stats st;
  gmb__compact_stats(c, &st);
  gmb__compact_destroy(c);
  ck_assert_uint_gt(st.moves, 0);
  ck_assert_uint_eq(hk.publishes, st.moves);
  ck_assert_uint_eq(hk.claims, hk.publishes + hk.releases);
  uint64_t bytes = 0;
  for (unsigned i = 0; i < n; i++) {
    struct gmb_alloc_info info;
    ck_assert_int_eq(gmb__pool_find(pool, t[i].id, &info), 0);
    ck_assert_uint_eq(info.tag, 3 * i + 1); /* tags travel with the moves */
    bytes += info.size;
    pattern_check(t[i].id);
  }
  ck_assert_uint_le(st.bytes_moved, 2 * bytes);
}
END_TEST

/* The seed scenario: small and medium movable allocations fill the device,
 * half are freed here and there; a request larger than any free range but
 * smaller than the free total fails with GMB_E_NOMEM, and succeeds after a
 * run. */
START_TEST(nomem_before_ok_after) {
  close_pool();
  open_pool(32 * GMB_MIB);
  unsigned seed = env_uint("SEED", (unsigned)gmb__now_ns()) + 3;
  rng_state = seed;
  printf("compact nomem_before_ok_after: SEED=%u\n", seed - 3);
  struct gmb_arena *a = gmb__pool_arena_new(pool, &tag_a);
  enum { N = 4000 };
  struct tracked *t = malloc(N * sizeof *t);
  unsigned n = 0, failures = 0;
  while (n < N && failures < 50) {
    uint64_t size =
        rng() % 4 ? 512 * (1 + rng() % 32) : 512 * (1 + rng() % 512);
    struct gmb_alloc_info info;
    int rc = gmb__pool_alloc(pool, a, size, GMB_MOVABLE, &owner_x, &info);
    if (rc != 0) {
      ck_assert_int_eq(rc, GMB_E_NOMEM);
      failures++;
      continue;
    }
    pattern_fill(&info);
    t[n++] = (struct tracked){info.id, info.size, 0, 0, 0};
  }
  for (unsigned i = 0; i < n;) {
    if (rng() & 1) {
      free_ok(t[i].id);
      t[i] = t[--n];
    } else {
      i++;
    }
  }
  struct gmb_pool_stats ps;
  gmb__pool_stats(pool, &ps);
  uint64_t want = 4 * GMB_MIB;
  ck_assert_uint_lt(ps.largest_free, want);
  ck_assert_uint_gt(ps.capacity - ps.used, want);
  struct gmb_alloc_info big;
  ck_assert_int_eq(gmb__pool_alloc(pool, a, want, GMB_MOVABLE, &owner_x, &big),
                   GMB_E_NOMEM);
  double frag_before =
      gmb__fragmentation(ps.largest_free, ps.capacity - ps.used);
  struct gmb_compact *c = gmb__compact_new(pool, NULL, 0, &hooks);
  run_all(c, 1000000);
  struct gmb_compact_stats st;
  gmb__compact_stats(c, &st);
  gmb__compact_destroy(c);
  gmb__pool_stats(pool, &ps);
  double frag_after =
      gmb__fragmentation(ps.largest_free, ps.capacity - ps.used);
  printf(
      "compact nomem_before_ok_after: %u live, %llu moves, %llu segments "
      "released, device fragmentation %.3f -> %.3f\n",
      n, (unsigned long long)st.moves, (unsigned long long)st.segments_released,
      frag_before, frag_after);
  ck_assert_uint_ge(ps.largest_free, want);
  ck_assert_int_eq(gmb__pool_alloc(pool, a, want, GMB_MOVABLE, &owner_x, &big),
                   0);
  ck_assert(frag_after < frag_before);
  for (unsigned i = 0; i < n; i++) pattern_check(t[i].id);
  free(t);
}
END_TEST

START_TEST(device_stats_figures) {
  struct gmb_arena *a = gmb__pool_arena_new(pool, &tag_a);
  struct gmb_pool_stats ps;
  gmb__pool_stats(pool, &ps);
  ck_assert_uint_eq(ps.free_in_segments, 0);
  ck_assert_uint_eq(ps.largest_free, CAP);
  struct tracked x = track(a, 3 * GMB_MIB + 512, 1, &owner_x); /* 4 MiB seg */
  struct tracked y = track(a, 100 * KIB, 1, &owner_x);
  gmb__pool_stats(pool, &ps);
  ck_assert_uint_eq(ps.free_in_segments,
                    (4 * GMB_MIB - x.size) + (SEG - y.size));
  ck_assert_uint_eq(ps.largest_free, CAP - 6 * GMB_MIB);
  free_ok(y.id); /* its small segment lingers: still room */
  gmb__pool_stats(pool, &ps);
  ck_assert_uint_eq(ps.largest_free, CAP - 4 * GMB_MIB);
  ck_assert_uint_eq(gmb__fragmentation(0, 0), 0.0);
  ck_assert(gmb__fragmentation(1, 4) == 0.75);
  ck_assert(gmb__fragmentation(4, 4) == 0.0);
}
END_TEST

/* A run with a goal ends once the room is there: it empties the least
 * used segments first and leaves the rest, so it moves less than a whole
 * run; a whole run afterwards still finds work. */
START_TEST(goal_run_stops_early) {
  close_pool();
  open_pool(40 * GMB_MIB);
  struct gmb_arena *a = gmb__pool_arena_new(pool, &tag_a);
  enum { N = 512 };
  struct tracked t[N];
  unsigned n = 0;
  while (n < N && arena_segments(a) <= 16) {
    t[n] = track(a, 64 * KIB, 1, &owner_x);
    n++;
  }
  unsigned kept = 0;
  for (unsigned i = 0; i < n; i++) {
    if (i % 2)
      free_ok(t[i].id);
    else
      t[kept++] = t[i];
  }
  n = kept;
  struct gmb_pool_stats ps;
  gmb__pool_stats(pool, &ps);
  uint64_t goal = ps.room + 4 * GMB_MIB;
  struct gmb_compact *c = gmb__compact_new(pool, NULL, goal, &hooks);
  run_all(c, 1000000);
  struct gmb_compact_stats st;
  gmb__compact_stats(c, &st);
  gmb__compact_destroy(c);
  gmb__pool_stats(pool, &ps);
  ck_assert_uint_ge(ps.room, goal);
  ck_assert_uint_ge(st.segments_released, 2);
  ck_assert_uint_le(st.segments_released, 3);
  ck_assert_uint_le(st.bytes_moved, 3 * GMB_MIB);
  c = gmb__compact_new(pool, NULL, 0, &hooks);
  run_all(c, 1000000);
  struct gmb_compact_stats all;
  gmb__compact_stats(c, &all);
  gmb__compact_destroy(c);
  ck_assert_uint_gt(all.segments_released, 0);
  for (unsigned i = 0; i < n; i++) pattern_check(t[i].id);
}
END_TEST

/* Placement rule 3: the holes of a pinned segment are the first place a
 * sparse movable segment is emptied into. */
START_TEST(pinned_holes_filled_first) {
  struct gmb_arena *a = gmb__pool_arena_new(pool, &tag_a);
  struct tracked p = track(a, 64 * KIB, 0, &owner_x);
  struct tracked m[3];
  for (int i = 0; i < 3; i++) m[i] = track(a, 64 * KIB, 1, &owner_x);
  ck_assert_uint_ne(m[0].seg, p.seg);
  struct gmb_compact *c = gmb__compact_new(pool, a, 0, &hooks);
  run_all(c, 100000);
  struct gmb_compact_stats st;
  gmb__compact_stats(c, &st);
  gmb__compact_destroy(c);
  ck_assert_uint_eq(st.moves, 3);
  ck_assert_uint_eq(st.segments_released, 1);
  ck_assert_uint_eq(st.skipped_pinned, 1);
  for (int i = 0; i < 3; i++) {
    where(&m[i]);
    ck_assert_uint_eq(m[i].seg, p.seg);
    pattern_check(m[i].id);
  }
  where(&p);
  ck_assert_uint_eq(p.off, 0);
  pattern_check(p.id);
  ck_assert_uint_eq(arena_segments(a), 1);
}
END_TEST

/* A segment holding a locked allocation cannot empty: none of its
 * allocations leaves it, although the holes of a fuller segment could take
 * them all (they would move for nothing). */
START_TEST(locked_segment_not_emptied) {
  struct gmb_arena *a = gmb__pool_arena_new(pool, &tag_a);
  struct tracked fill[32], lk, sp[2];
  for (int i = 0; i < 32; i++) fill[i] = track(a, 64 * KIB, 1, &owner_x);
  lk = track(a, 64 * KIB, 1, &owner_x);
  sp[0] = track(a, 64 * KIB, 1, &owner_x);
  sp[1] = track(a, 64 * KIB, 1, &owner_x);
  ck_assert_uint_ne(lk.seg, fill[0].seg);
  ck_assert_uint_eq(sp[1].seg, lk.seg);
  for (int i = 0; i < 32; i += 2) free_ok(fill[i].id); /* 1 MiB of holes */
  hk.locked[hk.nlocked++] = lk.id;
  struct gmb_compact *c = gmb__compact_new(pool, a, 0, &hooks);
  run_all(c, 100000);
  struct gmb_compact_stats st;
  gmb__compact_stats(c, &st);
  gmb__compact_destroy(c);
  ck_assert_uint_eq(st.segments_released, 0);
  for (int i = 0; i < 2; i++) {
    struct tracked now = sp[i];
    where(&now);
    ck_assert_uint_eq(now.seg, lk.seg);
    pattern_check(sp[i].id);
  }
  pattern_check(lk.id);
  /* Unlocked, the same segment empties into the holes. */
  hk.nlocked = 0;
  c = gmb__compact_new(pool, a, 0, &hooks);
  run_all(c, 100000);
  gmb__compact_stats(c, &st);
  gmb__compact_destroy(c);
  ck_assert_uint_eq(st.segments_released, 1);
  ck_assert_uint_eq(st.moves, 3);
  for (int i = 1; i < 32; i += 2) pattern_check(fill[i].id);
  pattern_check(lk.id);
}
END_TEST

/* The last pass of a goal run may fill an emptier segment (the
 * kv trace): on a full device, S1 holds one 1 MiB block and a 1 MiB hole;
 * S2 holds 1 MiB + 256 + 256 + 64 KiB with a 448 KiB hole; S3, S4 and S5
 * each have one hole (256, 256, 64 KiB).  Moving only to fuller segments
 * empties nothing: S1's block has no hole of 1 MiB in a fuller segment,
 * nor has S2's.  S2 can empty into all the others together (its 1 MiB
 * into S1's hole), which gives the goal's 2 MiB back, and that is what the
 * run does: one segment released, S2's 1 MiB now in S1. */
START_TEST(goal_run_fills_emptier_segment) {
  close_pool();
  open_pool(5 * SEG);
  struct gmb_arena *a = gmb__pool_arena_new(pool, &tag_a);
  struct tracked s1[2], s2[5], s3[8], s4[8], s5[32];
  for (int i = 0; i < 2; i++) s1[i] = track(a, 1024 * KIB, 1, &owner_x);
  const uint64_t s2_sizes[5] = {1024 * KIB, 256 * KIB, 256 * KIB, 64 * KIB,
                                448 * KIB};
  for (int i = 0; i < 5; i++) s2[i] = track(a, s2_sizes[i], 1, &owner_x);
  for (int i = 0; i < 8; i++) s3[i] = track(a, 256 * KIB, 1, &owner_x);
  for (int i = 0; i < 8; i++) s4[i] = track(a, 256 * KIB, 1, &owner_x);
  for (int i = 0; i < 32; i++) s5[i] = track(a, 64 * KIB, 1, &owner_x);
  ck_assert_uint_eq(arena_segments(a), 5);
  ck_assert_uint_ne(s1[0].seg, s2[0].seg);
  ck_assert_uint_eq(s2[4].seg, s2[0].seg);
  free_ok(s1[1].id);
  free_ok(s2[4].id);
  free_ok(s3[3].id);
  free_ok(s4[3].id);
  free_ok(s5[5].id);
  struct gmb_pool_stats ps;
  gmb__pool_stats(pool, &ps);
  ck_assert_uint_eq(ps.room, 0);
  struct gmb_compact *c = gmb__compact_new(pool, NULL, SEG, &hooks);
  run_all(c, 1000000);
  struct gmb_compact_stats st;
  gmb__compact_stats(c, &st);
  gmb__compact_destroy(c);
  gmb__pool_stats(pool, &ps);
  ck_assert_uint_ge(ps.room, SEG);
  ck_assert_uint_eq(st.segments_released, 1);
  /* S2's 1600 KiB, and the slide pass's packing of the holes before. */
  ck_assert_uint_ge(st.bytes_moved, 1600 * KIB);
  where(&s2[0]);
  ck_assert_uint_eq(s2[0].seg, s1[0].seg); /* the 1 MiB went to S1 */
  pattern_check(s1[0].id);
  for (int i = 0; i < 4; i++) pattern_check(s2[i].id);
  for (int i = 0; i < 8; i++)
    if (i != 3) pattern_check(s3[i].id), pattern_check(s4[i].id);
  for (int i = 0; i < 32; i++)
    if (i != 5) pattern_check(s5[i].id);
}
END_TEST

/* A goal run for a segment of room and a hole of `size` bytes in arena a,
 * run to its end: its figures, and a's largest free range after it. */
static struct gmb_compact_stats hole_run(struct gmb_arena *a, uint64_t size,
                                         uint64_t *largest_free) {
  struct gmb_compact *c = gmb__compact_new(pool, NULL, SEG, &hooks);
  gmb__compact_add_hole(c, a, size);
  run_all(c, 1000000);
  struct gmb_compact_stats st;
  gmb__compact_stats(c, &st);
  gmb__compact_destroy(c);
  struct gmb_arena_stats as;
  gmb__pool_arena_stats(a, &as);
  *largest_free = as.largest_free;
  return st;
}

/* A goal run may also end with a hole in the requester's own segments
 * (gmb__compact_add_hole): on a full device, arena A's two segments each
 * hold seven 256 KiB blocks and a 256 KiB hole at the top; A wants
 * 512 KiB.  No segment can empty (2 MiB of room is out of reach), and
 * without the hole goal the run ends with A's largest hole at 256 KiB;
 * with it, the block under one segment's top hole moves into the other's
 * hole, and A has its 512 KiB. */
START_TEST(goal_run_makes_a_hole) {
  close_pool();
  open_pool(2 * SEG);
  struct gmb_arena *a = gmb__pool_arena_new(pool, &tag_a);
  struct tracked t[16];
  for (int i = 0; i < 16; i++) t[i] = track(a, 256 * KIB, 1, &owner_x);
  ck_assert_uint_eq(arena_segments(a), 2);
  free_ok(t[7].id);
  free_ok(t[15].id);
  struct gmb_arena_stats as;
  gmb__pool_arena_stats(a, &as);
  ck_assert_uint_eq(as.largest_free, 256 * KIB);
  /* Without the hole goal: nothing to gain. */
  struct gmb_compact *c = gmb__compact_new(pool, NULL, SEG, &hooks);
  run_all(c, 1000000);
  gmb__compact_destroy(c);
  gmb__pool_arena_stats(a, &as);
  ck_assert_uint_eq(as.largest_free, 256 * KIB);
  /* With it. */
  struct gmb_compact_stats st = hole_run(a, 512 * KIB, &as.largest_free);
  ck_assert_uint_ge(as.largest_free, 512 * KIB);
  ck_assert_uint_eq(st.segments_released, 0);
  ck_assert_uint_ge(st.moves, 1);
  for (int i = 0; i < 16; i++)
    if (i != 7 && i != 15) pattern_check(t[i].id);
  struct gmb_alloc_info info;
  ck_assert_int_eq(gmb__pool_alloc(pool, a, 512 * KIB, GMB_MOVABLE, &owner_x,
                                   &info),
                   0);
  ck_assert_int_eq(gmb__pool_free(pool, info.id, NULL), 0);
}
END_TEST

/*
 * The hole where it is cheapest, in a full segment.  A's movable segment
 * is full: 64 KiB, 64 KiB, 1 MiB, 896 KiB; its pinned segment has two
 * 64 KiB holes between pinned blocks; the device has no room for a third
 * segment.  A wants 128 KiB.  The top 128 KiB lie inside the 896 KiB block,
 * which has no place anywhere; the bottom two blocks fit the two holes, and
 * moving them makes the hole.  A full segment must be a source for the
 * hole pass, and the window is not only the top.
 */
START_TEST(goal_run_hole_in_the_cheapest_window) {
  close_pool();
  open_pool(2 * SEG);
  struct gmb_arena *a = gmb__pool_arena_new(pool, &tag_a);
  static const uint64_t sizes[4] = {64 * KIB, 64 * KIB, 1024 * KIB,
                                    896 * KIB};
  struct tracked mv[4], pin[32];
  for (int i = 0; i < 4; i++) mv[i] = track(a, sizes[i], 1, &owner_x);
  for (int i = 0; i < 32; i++) pin[i] = track(a, 64 * KIB, 0, &owner_x);
  ck_assert_uint_eq(arena_segments(a), 2);
  free_ok(pin[3].id);
  free_ok(pin[10].id);
  struct gmb_arena_stats as;
  gmb__pool_arena_stats(a, &as);
  ck_assert_uint_eq(as.largest_free, 64 * KIB);
  struct gmb_compact_stats st = hole_run(a, 128 * KIB, &as.largest_free);
  ck_assert_uint_ge(as.largest_free, 128 * KIB);
  /* The two small blocks, nothing else. */
  ck_assert_uint_eq(st.moves, 2);
  ck_assert_uint_eq(st.bytes_moved, 128 * KIB);
  for (int i = 0; i < 4; i++) pattern_check(mv[i].id);
  for (int i = 0; i < 32; i++)
    if (i != 3 && i != 10) pattern_check(pin[i].id);
  struct gmb_alloc_info info;
  ck_assert_int_eq(gmb__pool_alloc(pool, a, 128 * KIB, GMB_MOVABLE, &owner_x,
                                   &info),
                   0);
  ck_assert_int_eq(gmb__pool_free(pool, info.id, NULL), 0);
}
END_TEST

/*
 * Two windows that cost the same: A's full movable segment is a 1 MiB
 * block and four 256 KiB ones; A's pinned segment has four 256 KiB holes
 * between pinned blocks.  A wants 1 MiB.  The bottom window (the 1 MiB
 * block) has no place to go; the top one (the four) has: the hole pass
 * must go on to the next window of the same cost.
 */
START_TEST(goal_run_hole_tries_windows_of_equal_cost) {
  close_pool();
  open_pool(2 * SEG);
  struct gmb_arena *a = gmb__pool_arena_new(pool, &tag_a);
  struct tracked big = track(a, 1024 * KIB, 1, &owner_x), mv[4], pin[8];
  for (int i = 0; i < 4; i++) mv[i] = track(a, 256 * KIB, 1, &owner_x);
  for (int i = 0; i < 8; i++) pin[i] = track(a, 256 * KIB, 0, &owner_x);
  ck_assert_uint_eq(arena_segments(a), 2);
  for (int i = 0; i < 8; i += 2) free_ok(pin[i].id);
  uint64_t largest;
  struct gmb_compact_stats st = hole_run(a, 1024 * KIB, &largest);
  ck_assert_uint_ge(largest, 1024 * KIB);
  ck_assert_uint_eq(st.moves, 4);
  ck_assert_uint_eq(st.bytes_moved, 1024 * KIB);
  pattern_check(big.id);
  for (int i = 0; i < 4; i++) pattern_check(mv[i].id);
  for (int i = 1; i < 8; i += 2) pattern_check(pin[i].id);
}
END_TEST

/* ---- COMPACT_PASS_REPACK ------------------------------------------------ */

/* The layout of the repack tests, on a full device of five segments, all
 * of arena a (KiB): S1 and S2 hold 1024 + 512 + 64 and a 448 hole; S3, S4
 * and S5 hold 1024 + 512 and a 512 hole.  No segment can empty into holes
 * (no hole holds a 1 MiB block), so every pass before the repack ends
 * with nothing.  A chain does it: S4's 512 into S5's hole, which leaves
 * S4's top 1 MiB free for S3's 1 MiB; S1's 64 into S2's hole, which leaves
 * S1's top 512 free for S3's 512.  S3 empties and goes back. */
struct repack_layout {
  struct tracked big[5], mid[5], small[2];
};

static struct gmb_arena *repack_layout(struct repack_layout *l) {
  close_pool();
  open_pool(5 * SEG);
  struct gmb_arena *a = gmb__pool_arena_new(pool, &tag_a);
  struct tracked filler[5];
  for (int i = 0; i < 5; i++) {
    l->big[i] = track(a, 1024 * KIB, 1, &owner_x);
    l->mid[i] = track(a, 512 * KIB, 1, &owner_x);
    if (i < 2) l->small[i] = track(a, 64 * KIB, 1, &owner_x);
    filler[i] = track(a, (i < 2 ? 448 : 512) * KIB, 1, &owner_x);
    ck_assert_uint_eq(l->mid[i].seg, l->big[i].seg);
    ck_assert_uint_eq(filler[i].seg, l->big[i].seg);
    if (i > 0) ck_assert_uint_ne(l->big[i].seg, l->big[i - 1].seg);
  }
  for (int i = 0; i < 5; i++) free_ok(filler[i].id);
  struct gmb_pool_stats ps;
  gmb__pool_stats(pool, &ps);
  ck_assert_uint_eq(ps.room, 0);
  return a;
}

static void repack_layout_check(const struct repack_layout *l) {
  for (int i = 0; i < 5; i++) {
    pattern_check(l->big[i].id);
    pattern_check(l->mid[i].id);
  }
  for (int i = 0; i < 2; i++) pattern_check(l->small[i].id);
}

START_TEST(goal_run_repacks_a_chain) {
  struct repack_layout l;
  repack_layout(&l);
  struct gmb_compact *c = gmb__compact_new(pool, NULL, SEG, &hooks);
  run_all(c, 1000000);
  struct gmb_compact_stats st;
  gmb__compact_stats(c, &st);
  gmb__compact_destroy(c);
  struct gmb_pool_stats ps;
  gmb__pool_stats(pool, &ps);
  ck_assert_uint_ge(ps.room, SEG);
  ck_assert_uint_eq(st.segments_released, 1);
  /* The four moves of the chain, nothing else. */
  ck_assert_uint_eq(st.moves, 4);
  ck_assert_uint_eq(st.bytes_moved, (512 + 1024 + 64 + 512) * KIB);
  ck_assert_ptr_null(gmb__pool_segment(pool, l.big[2].seg, NULL));
  repack_layout_check(&l);
}
END_TEST

/* A locked block is never part of a chain: with S4's 512 locked, S4 has
 * no window, and the chain goes through S5's instead (S5's 512 into S4's
 * hole). */
START_TEST(goal_run_repack_leaves_locked_blocks) {
  struct repack_layout l;
  repack_layout(&l);
  hk.locked[hk.nlocked++] = l.mid[3].id;
  struct gmb_compact *c = gmb__compact_new(pool, NULL, SEG, &hooks);
  run_all(c, 1000000);
  struct gmb_compact_stats st;
  gmb__compact_stats(c, &st);
  gmb__compact_destroy(c);
  ck_assert_uint_eq(st.segments_released, 1);
  struct tracked now = l.mid[3];
  where(&now);
  ck_assert_uint_eq(now.seg, l.mid[3].seg);
  ck_assert_uint_eq(now.off, l.mid[3].off);
  repack_layout_check(&l);
}
END_TEST

/* The broker frees between steps: once the chain's first move is in
 * flight, the block of its last step (S3's 512) is freed.  The step that
 * finds it gone drops the plan; the run ends soundly, with S3 gone all
 * the same (its 1 MiB moved out, its 512 freed). */
START_TEST(goal_run_repack_survives_a_free) {
  struct repack_layout l;
  repack_layout(&l);
  struct gmb_compact *c = gmb__compact_new(pool, NULL, SEG, &hooks);
  step_until_claimed(c);
  ck_assert_int_eq(gmb__compact_forget(c, l.mid[2].id), 0);
  free_ok(l.mid[2].id);
  run_all(c, 1000000);
  gmb__compact_destroy(c);
  struct gmb_pool_stats ps;
  gmb__pool_stats(pool, &ps);
  ck_assert_uint_ge(ps.room, SEG);
  ck_assert_ptr_null(gmb__pool_segment(pool, l.big[2].seg, NULL));
  for (int i = 0; i < 5; i++) {
    pattern_check(l.big[i].id);
    if (i != 2) pattern_check(l.mid[i].id);
  }
  for (int i = 0; i < 2; i++) pattern_check(l.small[i].id);
}
END_TEST

/*
 * A hole two links deep (units of 64 KiB; P pinned, m movable, . free).
 * Three pinned segments on a full device:
 *   S1: P2 m6 .2 P16 P6   A wants 512 KiB (8): the only window without
 *                         a pinned block is [2, 10), whose m6 fits no hole
 *   S2: P2 m4 .2 P16 P8   a window of 6 for it: [2, 8), whose m4 ...
 *   S3: P2 .4 P16 P10     ... fits S3's hole
 * The hole pass takes only movable segments and one link; the repack
 * moves the m4, then the m6, and A has its 512 KiB.
 */
START_TEST(goal_run_repack_makes_a_hole_two_links_deep) {
  close_pool();
  open_pool(3 * SEG);
  struct gmb_arena *a = gmb__pool_arena_new(pool, &tag_a);
  gmb__pool_set_grouping(pool, 0); /* lay the segments out in order */
  static const int units[3][5] = {{2, 6, 2, 16, 6}, {2, 4, 2, 16, 8},
                                  {2, 4, 16, 10, 0}};
  /* Which of each row are movable blocks (1) and which are freed (2). */
  static const int kind[3][5] = {{0, 1, 2, 0, 0}, {0, 1, 2, 0, 0},
                                 {0, 2, 0, 0, 0}};
  struct tracked t[3][5];
  for (int i = 0; i < 3; i++)
    for (int j = 0; j < 5 && units[i][j]; j++) {
      t[i][j] = track(a, (uint64_t)units[i][j] * 64 * KIB, kind[i][j] != 0,
                      &owner_x);
      ck_assert_uint_eq(t[i][j].seg, t[i][0].seg);
    }
  gmb__pool_set_grouping(pool, 1);
  for (int i = 0; i < 3; i++)
    for (int j = 0; j < 5 && units[i][j]; j++)
      if (kind[i][j] == 2) free_ok(t[i][j].id);
  uint64_t largest;
  struct gmb_compact_stats st = hole_run(a, 512 * KIB, &largest);
  ck_assert_uint_ge(largest, 512 * KIB);
  ck_assert_uint_eq(st.moves, 2);
  ck_assert_uint_eq(st.bytes_moved, 10 * 64 * KIB);
  struct tracked m6 = t[0][1], m4 = t[1][1];
  where(&m6);
  where(&m4);
  ck_assert_uint_eq(m6.seg, t[1][0].seg);
  ck_assert_uint_eq(m4.seg, t[2][0].seg);
  for (int i = 0; i < 3; i++)
    for (int j = 0; j < 5 && units[i][j]; j++)
      if (kind[i][j] != 2) pattern_check(t[i][j].id);
}
END_TEST

/*
 * A hole by packing a segment (repack.c, rk_pack_hole), in 64 KiB units:
 *   S1: m16 m1 m4 m4 m4 .3    the blocks are larger than the holes
 *   S2: m16 m15 .1            between them; no window's blocks all
 * have places, and the device is full.  A waiting 256 KiB request: the
 * m1 moves to S2's hole, the three m4 slide down over their old places
 * (copies that overlap), and S1's top 256 KiB are free.
 */
START_TEST(goal_run_packs_a_segment_for_a_hole) {
  close_pool();
  open_pool(2 * SEG);
  struct gmb_arena *a = gmb__pool_arena_new(pool, &tag_a);
  static const int units[] = {16, 1, 4, 4, 4, 3, 16, 15, 1};
  struct tracked t[9];
  for (int i = 0; i < 9; i++)
    t[i] = track(a, (uint64_t)units[i] * 64 * KIB, 1, &owner_x);
  ck_assert_uint_eq(t[5].seg, t[0].seg);
  ck_assert_uint_ne(t[6].seg, t[0].seg);
  ck_assert_uint_eq(t[8].seg, t[6].seg);
  free_ok(t[5].id);
  free_ok(t[8].id);
  uint64_t largest;
  struct gmb_compact_stats st = hole_run(a, 256 * KIB, &largest);
  ck_assert_uint_ge(largest, 256 * KIB);
  ck_assert_uint_eq(st.moves, 4);
  ck_assert_uint_eq(st.bytes_moved, 13 * 64 * KIB);
  where(&t[1]);
  ck_assert_uint_eq(t[1].seg, t[6].seg);
  for (int i = 2; i <= 4; i++) {
    where(&t[i]);
    ck_assert_uint_eq(t[i].seg, t[0].seg);
    ck_assert_uint_eq(t[i].off, (uint64_t)(16 + 4 * (i - 2)) * 64 * KIB);
  }
  for (int i = 0; i < 9; i++)
    if (i != 5 && i != 8) pattern_check(t[i].id);
}
END_TEST

/*
 * The packing of goal_run_packs_a_segment_for_a_hole, seeded and under
 * churn: in 64 KiB units,
 *   S1: m16 mF m1 mW x C .(W-1)   (F fills the segment, may be 0)
 *   S2: mX .1 mY                  (X + 1 + Y = 32)
 * with W, C and X drawn; the run wants a hole of W units, and between its
 * steps blocks are freed (one in flight too), locked and unlocked, and
 * small ones allocated, so plans are spoiled part-way, slides included.
 * The pool is checked after every step and every pattern after the run.
 */
START_TEST(goal_run_pack_survives_churn) {
  unsigned seed = env_uint("SEED", (unsigned)gmb__now_ns()) + 13;
  unsigned rounds = 64 * env_uint("SCALE", 1), packed = 0;
  rng_state = seed;
  printf("compact goal_run_pack_survives_churn: SEED=%u\n", seed - 13);
  for (unsigned round = 0; round < rounds; round++) {
    close_pool();
    open_pool(2 * SEG);
    memset(&hk, 0, sizeof hk);
    hk.check_publish = 1;
    struct gmb_arena *a = gmb__pool_arena_new(pool, &tag_a);
    unsigned w = 2 + (unsigned)(rng() % 3), nc = 2 + (unsigned)(rng() % 2);
    unsigned x = 15 + (unsigned)(rng() % 2); /* blocks up to 1 MiB */
    unsigned units[16], n = 0, f = 16 - nc * w - w;
    units[n++] = 16;
    if (f) units[n++] = f;
    units[n++] = 1;
    for (unsigned i = 0; i < nc; i++) units[n++] = w;
    unsigned gap1 = n;
    units[n++] = w - 1; /* S1's top, freed */
    units[n++] = x;
    unsigned gap2 = n;
    units[n++] = 1; /* S2's hole, freed */
    units[n++] = 31 - x;
    struct tracked t[16];
    int live[16];
    for (unsigned i = 0; i < n; i++) {
      t[i] = track(a, (uint64_t)units[i] * 64 * KIB, 1, &owner_x);
      live[i] = 1;
    }
    free_ok(t[gap1].id);
    free_ok(t[gap2].id);
    live[gap1] = live[gap2] = 0;
    struct gmb_compact *c = gmb__compact_new(pool, NULL, SEG, &hooks);
    gmb__compact_add_hole(c, a, (uint64_t)w * 64 * KIB);
    uint64_t steps = 0;
    while (step_checked(c, &steps, 100000, seed - 13, round)) {
      unsigned j = (unsigned)(rng() % n), op = (unsigned)(rng() % 40);
      if (op == 0 && live[j]) {
        if (gmb__compact_forget(c, t[j].id)) hk.in_flight = 0;
        lock_forget(t[j].id);
        free_ok(t[j].id);
        live[j] = 0;
      } else if (op == 1 && live[j]) {
        lock_toggle(t[j].id);
      } else if (op == 2 && !live[j] && units[j] <= 2) {
        struct gmb_alloc_info info;
        if (gmb__pool_alloc(pool, a, (uint64_t)units[j] * 64 * KIB,
                            GMB_MOVABLE, &owner_y, &info) == 0) {
          pattern_fill(&info);
          t[j].id = info.id;
          live[j] = 1;
        }
      }
    }
    struct gmb_compact_stats st;
    gmb__compact_stats(c, &st);
    gmb__compact_destroy(c);
    ck_assert_uint_eq(hk.in_flight, 0);
    packed += st.plans > 0;
    for (unsigned i = 0; i < n; i++)
      if (live[i]) pattern_check(t[i].id);
    hk.nlocked = 0;
  }
  printf("compact goal_run_pack_survives_churn: %u layouts, %u with a plan\n",
         rounds, packed);
  ck_assert_uint_gt(packed, 0);
}
END_TEST

/* The held segments of arena a (pool.h rule 2). */
static uint64_t arena_held(struct gmb_arena *a) {
  struct gmb_arena_stats as;
  gmb__pool_arena_stats(a, &as);
  return as.held_segments;
}

/* The held-lock tests' layout in arena a: S1 holds L (locked) and A, 64
 * KiB each, and a 1920 KiB hole; S2 holds B1 and B2 (1 MiB, 640 KiB) and
 * a 384 KiB hole. */
struct held_layout {
  struct tracked l, am, b1, b2;
};

static void held_layout(struct gmb_arena *a, struct held_layout *h) {
  h->l = track(a, 64 * KIB, 1, &owner_x);
  h->am = track(a, 64 * KIB, 1, &owner_x);
  struct tracked x1 = track(a, 1024 * KIB, 1, &owner_x);
  struct tracked x2 = track(a, 896 * KIB, 1, &owner_x);
  h->b1 = track(a, 1024 * KIB, 1, &owner_x);
  h->b2 = track(a, 640 * KIB, 1, &owner_x);
  struct tracked y = track(a, 384 * KIB, 1, &owner_x);
  ck_assert_uint_eq(x2.seg, h->l.seg);
  ck_assert_uint_ne(h->b1.seg, h->l.seg);
  ck_assert_uint_eq(y.seg, h->b1.seg);
  free_ok(x1.id);
  free_ok(x2.id);
  free_ok(y.id);
  hk.locked[hk.nlocked++] = h->l.id;
}

/*
 * A lock held across runs counts as pinned.  S1 holds
 * L (locked) and A, 64 KiB each; S2 is fuller, with a 384 KiB hole.  Each
 * run would empty S1 into S2 but finds L locked.  After the first run
 * nothing is held; after the second, S1 is, and a pinned request takes
 * S1's hole rather than a segment of its own.  Then C (256 KiB) in a
 * third segment moves into S1's hole, not S2's (which fits it better),
 * and S2 empties into S1 too: S1 ranks as a pinned segment, the fullest
 * kind, which cannot go back to the device anyway.
 */
START_TEST(lock_held_across_runs_counts_as_pinned) {
  struct gmb_arena *a = gmb__pool_arena_new(pool, &tag_a);
  struct held_layout h;
  held_layout(a, &h);
  struct tracked l = h.l, am = h.am, b1 = h.b1, b2 = h.b2;
  struct tracked x1, x2, y;
  for (int run = 1; run <= 2; run++) {
    struct gmb_compact *c = gmb__compact_new(pool, NULL, 0, &hooks);
    run_all(c, 100000);
    struct gmb_compact_stats st;
    gmb__compact_stats(c, &st);
    gmb__compact_destroy(c);
    ck_assert_uint_eq(st.moves, 0);
    ck_assert_uint_eq(arena_held(a), run == 2);
  }
  struct tracked p = track(a, 64 * KIB, 0, &owner_x);
  ck_assert_uint_eq(p.seg, l.seg);
  free_ok(p.id);
  /* A third segment for C, the holes filled meanwhile. */
  x1 = track(a, 1024 * KIB, 1, &owner_x);
  x2 = track(a, 896 * KIB, 1, &owner_x);
  y = track(a, 384 * KIB, 1, &owner_x);
  ck_assert_uint_eq(x2.seg, l.seg);
  ck_assert_uint_eq(y.seg, b1.seg);
  struct tracked cm = track(a, 256 * KIB, 1, &owner_x);
  struct tracked z = track(a, 1024 * KIB, 1, &owner_x);
  ck_assert_uint_ne(cm.seg, l.seg);
  ck_assert_uint_ne(cm.seg, b1.seg);
  free_ok(x1.id);
  free_ok(x2.id);
  free_ok(y.id);
  free_ok(z.id);
  struct gmb_compact *c = gmb__compact_new(pool, NULL, 0, &hooks);
  run_all(c, 100000);
  gmb__compact_destroy(c);
  where(&cm);
  where(&b1);
  where(&b2);
  ck_assert_uint_eq(cm.seg, l.seg);
  ck_assert_uint_eq(b1.seg, l.seg);
  ck_assert_uint_eq(b2.seg, l.seg);
  ck_assert_uint_eq(arena_segments(a), 1);
  ck_assert_uint_eq(arena_held(a), 1);
  pattern_check(l.id);
  pattern_check(am.id);
  pattern_check(cm.id);
  pattern_check(b1.id);
  pattern_check(b2.id);
}
END_TEST

/* Found free by a run, a held lock is forgotten: S1 (L and A) is held
 * after two runs that found L locked; L unlocked, the third run empties
 * S1 into S2's hole as it would have at first. */
START_TEST(held_lock_found_free_is_forgotten) {
  struct gmb_arena *a = gmb__pool_arena_new(pool, &tag_a);
  struct held_layout h;
  held_layout(a, &h);
  struct tracked l = h.l, am = h.am, b1 = h.b1, b2 = h.b2;
  for (int run = 1; run <= 3; run++) {
    if (run == 3) hk.nlocked = 0;
    struct gmb_compact *c = gmb__compact_new(pool, NULL, 0, &hooks);
    run_all(c, 100000);
    struct gmb_compact_stats st;
    gmb__compact_stats(c, &st);
    gmb__compact_destroy(c);
    ck_assert_uint_eq(arena_held(a), run == 2);
    ck_assert_uint_eq(st.segments_released, run == 3);
  }
  where(&l);
  where(&am);
  ck_assert_uint_eq(l.seg, b1.seg);
  ck_assert_uint_eq(am.seg, b1.seg);
  pattern_check(l.id);
  pattern_check(am.id);
  pattern_check(b1.id);
  pattern_check(b2.id);
}
END_TEST


/* ---- revocation: sealed segments and their evacuation (evacuate.h) ---- */

/* Runs evacuation steps until a pass ends; returns the last stats. */
static struct gmb_evac_stats evac_all(struct gmb_arena *a) {
  struct gmb_evac_stats st;
  memset(&st, 0, sizeof st);
  for (int i = 0; i < 1000; i++) {
    if (gmb__evac_step(pool, a, &hooks, UINT64_MAX, &st) == 0) break;
  }
  ck_assert_int_eq(gmb__pool_check(pool), 0);
  ck_assert_uint_eq(hk.in_flight, 0);
  return st;
}

/* A sealed segment takes no allocation, tail or compaction target, and
 * goes back to the device when its last allocation goes (never lingers). */
START_TEST(sealed_segment_takes_nothing_new) {
  struct gmb_arena *a = gmb__pool_arena_new(pool, &tag_a);
  struct tracked m = track(a, 64 * KIB, 1, &owner_x);
  struct tracked q = track(a, 64 * KIB, 0, &owner_x);
  ck_assert_int_eq(gmb__pool_seal(pool, m.seg), 0);
  ck_assert_int_eq(gmb__pool_seal(pool, q.seg), 0);
  ck_assert_int_eq(gmb__pool_check(pool), 0);
  for (int i = 0; i < 20; i++) {
    struct tracked t = track(a, (uint64_t)(i + 1) * 8 * KIB, i & 1, &owner_y);
    ck_assert_uint_ne(t.seg, m.seg);
    ck_assert_uint_ne(t.seg, q.seg);
  }
  struct tracked big = track(a, 5 * GMB_MIB + 64 * KIB, 0, &owner_y);
  struct gmb_alloc_info bi;
  ck_assert_int_eq(gmb__pool_find(pool, big.id, &bi), 0);
  ck_assert_ptr_nonnull(bi.tail_dseg);
  ck_assert_uint_ne(bi.tail_dseg->id, m.seg);
  ck_assert_uint_ne(bi.tail_dseg->id, q.seg);
  /* No move may target it either. */
  struct tracked o = track(a, 4 * KIB, 1, &owner_y);
  ck_assert_int_eq(gmb__pool_move_begin(pool, o.id, m.seg, 512 * KIB, NULL),
                   GMB_E_INVAL);
  unsigned before = nretired;
  free_ok(m.id);
  ck_assert_ptr_null(gmb__pool_segment(pool, m.seg, NULL)); /* released */
  ck_assert_uint_eq(nretired, before + 1);
  free_ok(q.id);
  ck_assert_ptr_null(gmb__pool_segment(pool, q.seg, NULL));
  ck_assert_int_eq(gmb__pool_seal(pool, m.seg), GMB_E_NOENT);
}
END_TEST

/* Every movable allocation leaves the sealed segments with its bytes;
 * pinned ones and locked ones stay (counted), a locked one leaves once
 * unlocked, and the emptied segments go back to the device. */
START_TEST(evacuate_moves_movable_keeps_pinned) {
  struct gmb_arena *a = gmb__pool_arena_new(pool, &tag_a);
  struct tracked mv[6], pin = track(a, 96 * KIB, 0, &owner_x);
  for (int i = 0; i < 6; i++) mv[i] = track(a, (i + 1) * 32 * KIB, 1, &owner_x);
  uint64_t seg = mv[0].seg;
  for (int i = 1; i < 6; i++) ck_assert_uint_eq(mv[i].seg, seg);
  ck_assert_int_eq(gmb__pool_seal(pool, seg), 0);
  ck_assert_int_eq(gmb__pool_seal(pool, pin.seg), 0);
  hk.locked[hk.nlocked++] = mv[2].id;
  struct gmb_evac_stats st = evac_all(a);
  ck_assert_uint_eq(st.moves, 5);
  ck_assert_uint_eq(st.locked, 1);
  ck_assert_uint_eq(st.locked_bytes, mv[2].size);
  ck_assert_uint_eq(st.pinned, 1);
  ck_assert_uint_eq(st.pinned_bytes, pin.size);
  ck_assert_uint_eq(hk.publishes, 5);
  for (int i = 0; i < 6; i++) {
    pattern_check(mv[i].id);
    struct tracked t = mv[i];
    where(&t);
    if (i == 2)
      ck_assert_uint_eq(t.seg, seg);
    else
      ck_assert_uint_ne(t.seg, seg);
    ck_assert_uint_ne(t.seg, pin.seg);
  }
  pattern_check(pin.id);
  /* Unlocked: the next pass moves it, and the sealed segment empties. */
  hk.nlocked = 0;
  st = evac_all(a);
  ck_assert_uint_eq(st.moves, 1);
  ck_assert_uint_eq(st.locked, 0);
  ck_assert_uint_eq(st.sealed, 1); /* the pinned one's */
  pattern_check(mv[2].id);
  ck_assert_ptr_null(gmb__pool_segment(pool, seg, NULL));
  for (int i = 0; i < 6; i++) free_ok(mv[i].id);
  free_ok(pin.id);
}
END_TEST

/* With no free range outside the sealed segments, a move takes a new
 * segment; with the device full too, the allocation stays (counted). */
START_TEST(evacuate_device_full_stays) {
  gmb__pool_destroy(pool);
  gmb__device_close(dev);
  open_pool(2 * SEG);
  struct gmb_arena *a = gmb__pool_arena_new(pool, &tag_a);
  struct tracked m = track(a, 512 * KIB, 1, &owner_x);
  ck_assert_int_eq(gmb__pool_seal(pool, m.seg), 0);
  struct gmb_evac_stats st = evac_all(a); /* room for one more segment */
  ck_assert_uint_eq(st.moves, 1);
  pattern_check(m.id);
  where(&m);
  /* Now fill the device and seal the new home: nowhere to go. */
  struct tracked f1 = track(a, SEG / 2, 1, &owner_y);
  struct tracked f2 = track(a, SEG / 4, 1, &owner_y);
  ck_assert_uint_eq(f1.seg, m.seg);
  ck_assert_uint_eq(f2.seg, m.seg);
  ck_assert_int_eq(gmb__pool_seal(pool, m.seg), 0);
  struct tracked other = track(a, SEG / 2, 1, &owner_y);
  ck_assert_uint_ne(other.seg, m.seg);
  struct tracked rest = track(a, SEG / 2, 1, &owner_y);
  ck_assert_uint_eq(rest.seg, other.seg);
  st = evac_all(a);
  ck_assert_uint_eq(st.moves, 0);
  ck_assert_uint_eq(st.locked, 3); /* no room: all stay */
  ck_assert_uint_eq(hk.releases, hk.claims - hk.publishes);
  pattern_check(m.id);
  pattern_check(f1.id);
  free_ok(rest.id);
  st = evac_all(a);
  ck_assert_uint_ge(st.moves, 1);
  pattern_check(m.id);
  pattern_check(f1.id);
  pattern_check(f2.id);
  free_ok(m.id);
  free_ok(f1.id);
  free_ok(f2.id);
  free_ok(other.id);
}
END_TEST

static Suite *compact_suite(void) {
  Suite *s = suite_create("compact");
  TCase *tc = tcase_create("compact");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, fragmented_arena_gets_compacted);
  tcase_add_test(tc, pinned_never_moves);
  tcase_add_test(tc, locked_skipped);
  tcase_add_test(tc, forget_mid_move);
  tcase_add_test(tc, free_without_forget_is_survived);
  tcase_add_test(tc, free_between_steps);
  tcase_add_test(tc, overlapping_move_within_segment);
  tcase_add_test(tc, slide_chunked);
  tcase_add_test(tc, destroy_mid_overlapping_slide);
  tcase_add_test(tc, one_arena_only);
  tcase_add_test(tc, release_hook_on_destroy);
  tcase_add_test(tc, forget_arena_mid_move);
  tcase_add_test(tc, arena_destroy_drops_move);
  tcase_add_test(tc, move_begin_refuses);
  tcase_add_test(tc, run_terminates);
  tcase_add_test(tc, publish_called_once_per_move);
  tcase_add_test(tc, nomem_before_ok_after);
  tcase_add_test(tc, device_stats_figures);
  tcase_add_test(tc, goal_run_stops_early);
  tcase_add_test(tc, goal_run_fills_emptier_segment);
  tcase_add_test(tc, goal_run_makes_a_hole);
  tcase_add_test(tc, goal_run_hole_in_the_cheapest_window);
  tcase_add_test(tc, goal_run_hole_tries_windows_of_equal_cost);
  tcase_add_test(tc, goal_run_repacks_a_chain);
  tcase_add_test(tc, goal_run_repack_leaves_locked_blocks);
  tcase_add_test(tc, goal_run_repack_survives_a_free);
  tcase_add_test(tc, goal_run_repack_makes_a_hole_two_links_deep);
  tcase_add_test(tc, goal_run_packs_a_segment_for_a_hole);
  tcase_add_test(tc, goal_runs_survive_churn);
  tcase_add_test(tc, goal_run_pack_survives_churn);
  tcase_add_test(tc, lock_held_across_runs_counts_as_pinned);
  tcase_add_test(tc, held_lock_found_free_is_forgotten);
  tcase_add_test(tc, pinned_holes_filled_first);
  tcase_add_test(tc, locked_segment_not_emptied);
  tcase_add_test(tc, sealed_segment_takes_nothing_new);
  tcase_add_test(tc, evacuate_moves_movable_keeps_pinned);
  tcase_add_test(tc, evacuate_device_full_stays);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) { return check_run(compact_suite()); }
