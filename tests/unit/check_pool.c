/*
 * check_pool.c - the broker's allocator on a real host device.
 *
 * Every test builds a 64 MiB host device and a pool over it; teardown
 * requires gmb__pool_check() == 0 and, after the pool is destroyed, that the
 * device holds no segment.  The stress test keeps a shadow model of every
 * live allocation and compares it with the pool after each step.
 * Knobs: SCALE (multiplies stress sizes), ITER (stress steps), SEED.
 */
#include <check.h>
#include <malloc.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check_main.h"
#include "device.h"
#include "gmb.h"
#include "pool.h"
#include "util.h"

#define CAP (64 * GMB_MIB)
#define SEG GMB_POOL_SMALL_SEGMENT

struct retired {
  uint64_t seg_id;
  void *tag;
};

static struct gmb_device *dev;
static struct gmb_pool *pool;
static struct retired retired[4096];
static unsigned nretired;
static int tag_a, tag_b, tag_c; /* addresses used as arena tags */

static void on_retire(void *ctx, const struct gmb_dseg *seg, void *tag) {
  ck_assert_ptr_eq(ctx, &nretired);
  if (nretired < sizeof retired / sizeof retired[0]) {
    retired[nretired].seg_id = seg->id;
    retired[nretired].tag = tag;
  }
  nretired++;
}

static void setup(void) {
  char err[256];
  ck_assert_int_eq(gmb__device_host_open(CAP, &dev, err, sizeof err), 0);
  pool = gmb__pool_new(dev, on_retire, &nretired);
  ck_assert_ptr_nonnull(pool);
  nretired = 0;
}

static void teardown(void) {
  ck_assert_int_eq(gmb__pool_check(pool), 0);
  gmb__pool_destroy(pool);
  ck_assert_uint_eq(dev->in_use, 0);
  ck_assert_uint_eq(dev->segments, 0);
  gmb__device_close(dev);
}

static uint64_t alloc_ok(struct gmb_arena *a, uint64_t size, void *owner,
                         struct gmb_alloc_info *info) {
  struct gmb_alloc_info tmp;
  if (!info) info = &tmp;
  int rc = gmb__pool_alloc(pool, a, size, 0, owner, info);
  ck_assert_msg(rc == 0, "alloc %llu: %s", (unsigned long long)size,
                gmb_err_name(rc));
  ck_assert_uint_ne(info->id, 0);
  ck_assert_int_eq(gmb__pool_check(pool), 0);
  return info->id;
}

static void free_ok(uint64_t id) {
  ck_assert_int_eq(gmb__pool_free(pool, id, NULL), 0);
  ck_assert_int_eq(gmb__pool_check(pool), 0);
}

START_TEST(alloc_zero) {
  struct gmb_arena *a = gmb__pool_arena_new(pool, &tag_a);
  struct gmb_alloc_info info;
  ck_assert_int_eq(gmb__pool_alloc(pool, a, 0, 0, NULL, &info), GMB_E_INVAL);
  struct gmb_pool_stats st;
  gmb__pool_stats(pool, &st);
  ck_assert_uint_eq(st.allocations, 0);
  ck_assert_uint_eq(st.segments, 0);
  ck_assert_uint_eq(dev->in_use, 0);
}
END_TEST

START_TEST(alloc_overflow) {
  struct gmb_arena *a = gmb__pool_arena_new(pool, &tag_a);
  struct gmb_alloc_info info;
  const uint64_t bad[] = {UINT64_MAX, UINT64_MAX - 510, UINT64_MAX - 511,
                          UINT64_MAX - GMB_SEGMENT_ALIGN + 2};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
    ck_assert_int_eq(gmb__pool_alloc(pool, a, bad[i], 0, NULL, &info),
                     GMB_E_INVAL);
  /* Rounds fine but no device has it: NOMEM, not INVAL. */
  ck_assert_int_eq(gmb__pool_alloc(pool, a, UINT64_MAX - GMB_SEGMENT_ALIGN + 1,
                                   0, NULL, &info),
                   GMB_E_NOMEM);
  ck_assert_int_eq(gmb__pool_alloc(pool, a, UINT64_C(1) << 62, 0, NULL, &info),
                   GMB_E_NOMEM);
  ck_assert_uint_eq(dev->in_use, 0);
}
END_TEST

START_TEST(align_512) {
  struct gmb_arena *a = gmb__pool_arena_new(pool, &tag_a);
  const uint64_t sizes[] = {1, 511, 512, 513, 1000, 1024, 4095};
  const uint64_t want[] = {512, 512, 512, 1024, 1024, 1024, 4096};
  uint64_t expect_off = 0;
  for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
    struct gmb_alloc_info info;
    alloc_ok(a, sizes[i], NULL, &info);
    ck_assert_uint_eq(info.size, want[i]);
    ck_assert_uint_eq(info.offset % GMB_POOL_ALIGN, 0);
    ck_assert_uint_eq(info.offset, expect_off); /* packed, in order */
    expect_off += info.size;
  }
  struct gmb_arena_stats as;
  gmb__pool_arena_stats(a, &as);
  ck_assert_uint_eq(as.used, expect_off);
  ck_assert_uint_eq(as.free_total, SEG - expect_off);
  ck_assert_uint_eq(as.largest_free, SEG - expect_off);
}
END_TEST

START_TEST(small_share_segment) {
  struct gmb_arena *a = gmb__pool_arena_new(pool, &tag_a);
  struct gmb_alloc_info x, y, z;
  alloc_ok(a, GMB_POOL_SMALL_MAX, NULL, &x); /* exactly 1 MiB is small */
  alloc_ok(a, GMB_POOL_SMALL_MAX, NULL, &y);
  ck_assert_uint_eq(x.dseg->id, y.dseg->id);
  ck_assert_uint_eq(x.dseg->size, SEG);
  ck_assert_uint_eq(y.offset, GMB_POOL_SMALL_MAX);
  alloc_ok(a, 512, NULL, &z); /* the first segment is full */
  ck_assert_uint_ne(z.dseg->id, x.dseg->id);
  ck_assert_uint_eq(z.dseg->size, SEG);
  ck_assert_uint_eq(dev->in_use, 2 * SEG);
}
END_TEST

START_TEST(large_rounded_segment) {
  struct gmb_arena *a = gmb__pool_arena_new(pool, &tag_a);
  struct gmb_alloc_info x, y, s, z;
  /* Under a page: all tail, a pinned range of a small segment (a movable
   * request too: large allocations never move). */
  alloc_ok(a, GMB_POOL_SMALL_MAX + 1, NULL, &x);
  ck_assert_uint_eq(x.size, GMB_POOL_SMALL_MAX + 512);
  ck_assert_uint_eq(x.dseg->size, SEG);
  ck_assert_uint_eq(x.offset, 0);
  ck_assert_ptr_null(x.tail_dseg);
  /* 3 MiB: a page of its own and a 1 MiB tail, which x's segment has no
   * room for at either end: a new small segment, tail at its start. */
  struct gmb_alloc_info ym;
  uint64_t yid = 0;
  ck_assert_int_eq(gmb__pool_alloc(pool, a, 3 * GMB_MIB, GMB_MOVABLE, NULL,
                                   &ym), 0);
  yid = ym.id;
  y = ym;
  ck_assert_uint_eq(y.flags & GMB_MOVABLE, 0);
  ck_assert_uint_eq(y.size, 3 * GMB_MIB);
  ck_assert_uint_eq(y.dseg->size, 2 * GMB_MIB);
  ck_assert_uint_eq(y.offset, 0);
  ck_assert_ptr_nonnull(y.tail_dseg);
  ck_assert_uint_ne(y.tail_dseg->id, x.dseg->id);
  ck_assert_uint_eq(y.tail_offset, 0);
  ck_assert_uint_eq(y.tail_size, GMB_MIB);
  struct gmb_alloc_info found;
  ck_assert_int_eq(gmb__pool_find(pool, yid, &found), 0);
  ck_assert_uint_eq(found.size, 3 * GMB_MIB);
  ck_assert_uint_eq(found.tail_dseg->id, y.tail_dseg->id);
  /* A small request takes the best fit among the two remainders: x's. */
  alloc_ok(a, 4096, NULL, &s);
  ck_assert_uint_eq(s.dseg->id, x.dseg->id);
  ck_assert_uint_eq(dev->in_use, SEG + 2 * GMB_MIB + SEG);
  /* 5 MiB: its tail fits the end of y's tail segment exactly. */
  alloc_ok(a, 5 * GMB_MIB, NULL, &z);
  ck_assert_uint_eq(z.dseg->size, 4 * GMB_MIB);
  ck_assert_uint_eq(z.tail_dseg->id, y.tail_dseg->id);
  ck_assert_uint_eq(z.tail_offset, GMB_MIB);
  ck_assert_uint_eq(z.tail_size, GMB_MIB);
  /* Six pages used to be ten: 2 (x) + 4 (y) + 2 (s) + 6 (z) - 4. */
  ck_assert_uint_eq(dev->in_use, 10 * GMB_MIB);
  /* A walk reports each piece under the allocation's id. */
  ck_assert_int_eq(gmb__pool_check(pool), 0);
  /* y goes: its page back at once, its tail's segment kept by z's. */
  struct gmb_alloc_info freed;
  ck_assert_int_eq(gmb__pool_free(pool, yid, &freed), 0);
  ck_assert_uint_eq(freed.size, 3 * GMB_MIB);
  ck_assert_ptr_null(freed.dseg);
  ck_assert_ptr_nonnull(freed.tail_dseg);
  ck_assert_uint_eq(dev->in_use, 8 * GMB_MIB);
  ck_assert_int_eq(gmb__pool_check(pool), 0);
  /* z goes: its pages back, its tail's segment empty: it lingers. */
  ck_assert_int_eq(gmb__pool_free(pool, z.id, &freed), 0);
  ck_assert_uint_eq(dev->in_use, 2 * SEG);
  ck_assert_int_eq(gmb__pool_check(pool), 0);
}
END_TEST

/* A walk sees a large allocation as two ranges of one id: its pages, and
 * its tail flagged GMB_RANGE_TAIL, with their sizes adding up. */
struct tail_walk {
  uint64_t id, bytes;
  int pieces, tails;
};

static int tail_walk_fn(void *ctx, const struct gmb_alloc_info *info,
                        int is_free) {
  struct tail_walk *w = ctx;
  if (is_free || info->id != w->id) return 0;
  w->pieces++;
  w->bytes += info->size;
  w->tails += (info->flags & GMB_RANGE_TAIL) != 0;
  return 0;
}

START_TEST(large_tail_walk_and_owner) {
  struct gmb_arena *a = gmb__pool_arena_new(pool, &tag_a);
  int owner;
  struct gmb_alloc_info x, small;
  ck_assert_int_eq(gmb__pool_alloc(pool, a, 5 * GMB_MIB / 2, 0, &owner, &x),
                   0);
  struct tail_walk w = {.id = x.id};
  ck_assert_int_eq(gmb__pool_walk(pool, tail_walk_fn, &w), 0);
  ck_assert_int_eq(w.pieces, 2);
  ck_assert_int_eq(w.tails, 1);
  ck_assert_uint_eq(w.bytes, 5 * GMB_MIB / 2);
  /* Another owner's small request shares the tail's segment. */
  alloc_ok(a, 4096, NULL, &small);
  ck_assert_uint_eq(small.dseg->id, x.tail_dseg->id);
  /* The owner's end frees the whole allocation, once. */
  ck_assert_uint_eq(gmb__pool_free_owner(pool, a, &owner), 5 * GMB_MIB / 2);
  ck_assert_int_eq(gmb__pool_check(pool), 0);
  ck_assert_uint_eq(dev->in_use, SEG);
  struct gmb_arena_stats as;
  gmb__pool_arena_stats(a, &as);
  ck_assert_uint_eq(as.allocations, 1);
  ck_assert_uint_eq(as.used, 4096);
  /* A whole arena's end with a tail live. */
  ck_assert_int_eq(gmb__pool_alloc(pool, a, 7 * GMB_MIB, 0, &owner, &x), 0);
  gmb__pool_arena_destroy(pool, a);
  ck_assert_int_eq(gmb__pool_check(pool), 0);
  ck_assert_uint_eq(dev->in_use, 0);
}
END_TEST

/* Placement rule 1: a large allocation's pages are a segment of their
 * own; freeing it gives that segment back, and the slack of a small one
 * that held its tail serves small requests. */
START_TEST(large_own_segment) {
  struct gmb_arena *a = gmb__pool_arena_new(pool, &tag_a);
  struct gmb_alloc_info x, y;
  alloc_ok(a, 5 * GMB_MIB / 2, NULL, &x); /* a page and a 0.5 MiB tail */
  alloc_ok(a, GMB_POOL_SMALL_MAX + 512, NULL, &y); /* beside that tail */
  ck_assert_uint_ne(y.dseg->id, x.dseg->id);
  ck_assert_uint_eq(y.dseg->id, x.tail_dseg->id);
  ck_assert_uint_eq(dev->in_use, 4 * GMB_MIB);
  struct gmb_arena_stats as;
  gmb__pool_arena_stats(a, &as);
  ck_assert_uint_eq(as.free_total, 4 * GMB_MIB - x.size - y.size);
  free_ok(x.id);
  ck_assert_uint_eq(dev->in_use, 2 * GMB_MIB);
  ck_assert_uint_eq(nretired, 1);
}
END_TEST

/* Placement rule 1, seeded: large allocations of many sizes come and go in
 * two arenas beside small ones; whenever the room the pool reports covers
 * a request's segment, the request succeeds, and a refusal is only ever
 * GMB_E_NOMEM with the room short of it. */
START_TEST(large_never_refused_with_room) {
  unsigned seed = (unsigned)gmb__now_ns();
  const char *e = getenv("SEED");
  if (e && *e) seed = (unsigned)strtoul(e, NULL, 0);
  uint64_t st = seed;
  printf("pool large_never_refused_with_room: SEED=%u\n", seed);
  struct gmb_arena *ar[2] = {gmb__pool_arena_new(pool, &tag_a),
                             gmb__pool_arena_new(pool, &tag_b)};
  enum { N = 256 };
  uint64_t ids[N] = {0};
  unsigned served = 0, refused = 0;
  for (unsigned step = 0; step < 4000; step++) {
    unsigned k = (unsigned)(gmb__splitmix64(&st) % N);
    if (ids[k]) {
      free_ok(ids[k]);
      ids[k] = 0;
      continue;
    }
    int small = gmb__splitmix64(&st) % 3 == 0;
    uint64_t size = small ? 512 + gmb__splitmix64(&st) % GMB_POOL_SMALL_MAX
                          : GMB_POOL_SMALL_MAX + 1 +
                                gmb__splitmix64(&st) % (9 * GMB_MIB);
    uint32_t flags = gmb__splitmix64(&st) & 1 ? GMB_MOVABLE : 0;
    struct gmb_pool_stats ps;
    gmb__pool_stats(pool, &ps);
    uint64_t seg = (size + GMB_SEGMENT_ALIGN - 1) & ~(GMB_SEGMENT_ALIGN - 1);
    struct gmb_alloc_info info;
    int rc = gmb__pool_alloc(pool, ar[k & 1], size, flags, NULL, &info);
    ck_assert_int_eq(gmb__pool_check(pool), 0);
    if (rc == 0) {
      ids[k] = info.id;
      served++;
      continue;
    }
    ck_assert_int_eq(rc, GMB_E_NOMEM);
    refused++;
    if (!small)
      ck_assert_msg(ps.room < seg, "seed %u: %llu refused with room %llu",
                    seed, (unsigned long long)size,
                    (unsigned long long)ps.room);
  }
  ck_assert_uint_gt(served, 0);
  ck_assert_uint_gt(refused, 0); /* the device did fill up */
}
END_TEST

/* Placement rule 2: pinned and movable small allocations never share a
 * segment by allocation; a segment whose last pinned allocation goes takes
 * movable ones again; a pinned request takes over the lingering segment. */
START_TEST(mobility_grouping) {
  struct gmb_arena *a = gmb__pool_arena_new(pool, &tag_a);
  struct gmb_alloc_info m1, p1, m2, p2, m3;
  ck_assert_int_eq(gmb__pool_alloc(pool, a, 4096, GMB_MOVABLE, NULL, &m1), 0);
  ck_assert_int_eq(gmb__pool_alloc(pool, a, 4096, 0, NULL, &p1), 0);
  ck_assert_int_eq(gmb__pool_alloc(pool, a, 4096, GMB_MOVABLE, NULL, &m2), 0);
  ck_assert_int_eq(gmb__pool_alloc(pool, a, 8192, 0, NULL, &p2), 0);
  ck_assert_int_eq(gmb__pool_check(pool), 0);
  ck_assert_uint_ne(p1.dseg->id, m1.dseg->id);
  ck_assert_uint_eq(m2.dseg->id, m1.dseg->id);
  ck_assert_uint_eq(p2.dseg->id, p1.dseg->id);
  ck_assert_uint_eq(p2.offset, 4096); /* packed low */
  /* The pinned segment empties and lingers; the next pinned request takes
   * it over rather than making a segment. */
  uint64_t pseg = p1.dseg->id;
  free_ok(p1.id);
  free_ok(p2.id);
  ck_assert_uint_eq(dev->in_use, 2 * SEG);
  ck_assert_int_eq(gmb__pool_alloc(pool, a, 4096, 0, NULL, &p1), 0);
  ck_assert_uint_eq(p1.dseg->id, pseg);
  ck_assert_uint_eq(dev->in_use, 2 * SEG);
  /* Fill the movable segment; the next movable request makes a new
   * segment, never the pinned one's free space. */
  uint64_t fill[16];
  unsigned nf = 0;
  struct gmb_alloc_info f;
  while (gmb__pool_alloc(pool, a, 128 * 1024, GMB_MOVABLE, NULL, &f) == 0 &&
         f.dseg->id == m1.dseg->id)
    fill[nf++] = f.id;
  ck_assert_uint_ne(f.dseg->id, pseg);
  ck_assert_uint_ne(f.dseg->id, m1.dseg->id);
  fill[nf++] = f.id;
  /* The pinned one goes: its segment lingers as a movable one, and the
   * next movable request that does not fit elsewhere finds it. */
  free_ok(p1.id);
  struct gmb_alloc_info m4;
  ck_assert_int_eq(gmb__pool_alloc(pool, a, GMB_POOL_SMALL_MAX, GMB_MOVABLE,
                                   NULL, &m3), 0);
  ck_assert_uint_eq(m3.dseg->id, f.dseg->id); /* best fit: the new one */
  ck_assert_int_eq(gmb__pool_alloc(pool, a, GMB_POOL_SMALL_MAX, GMB_MOVABLE,
                                   NULL, &m4), 0);
  ck_assert_uint_eq(m4.dseg->id, pseg);
  ck_assert_int_eq(gmb__pool_check(pool), 0);
  for (unsigned i = 0; i < nf; i++) free_ok(fill[i]);
}
END_TEST

/* Without compaction (grouping off) nothing is moved, so a small request
 * takes the best fit in either class: pinned and movable share a segment,
 * which then counts as pinned, and no second segment is made. */
START_TEST(grouping_off_shares_segments) {
  gmb__pool_set_grouping(pool, 0);
  struct gmb_arena *a = gmb__pool_arena_new(pool, &tag_a);
  struct gmb_alloc_info m1, p1, m2;
  ck_assert_int_eq(gmb__pool_alloc(pool, a, 4096, GMB_MOVABLE, NULL, &m1), 0);
  ck_assert_int_eq(gmb__pool_alloc(pool, a, 4096, 0, NULL, &p1), 0);
  ck_assert_int_eq(gmb__pool_alloc(pool, a, 4096, GMB_MOVABLE, NULL, &m2), 0);
  ck_assert_int_eq(gmb__pool_check(pool), 0);
  ck_assert_uint_eq(p1.dseg->id, m1.dseg->id);
  ck_assert_uint_eq(m2.dseg->id, m1.dseg->id);
  ck_assert_uint_eq(dev->in_use, SEG);
  /* The pinned one goes: the segment is movable again, still shared. */
  free_ok(p1.id);
  ck_assert_int_eq(gmb__pool_check(pool), 0);
  free_ok(m1.id);
  free_ok(m2.id);
  gmb__pool_set_grouping(pool, 1);
}
END_TEST

START_TEST(free_twice) {
  struct gmb_arena *a = gmb__pool_arena_new(pool, &tag_a);
  uint64_t id = alloc_ok(a, 4096, NULL, NULL);
  uint64_t keep = alloc_ok(a, 4096, NULL, NULL);
  free_ok(id);
  ck_assert_int_eq(gmb__pool_free(pool, id, NULL), GMB_E_NOENT);
  ck_assert_int_eq(gmb__pool_find(pool, id, NULL), GMB_E_NOENT);
  struct gmb_pool_stats st;
  gmb__pool_stats(pool, &st);
  ck_assert_uint_eq(st.allocations, 1);
  ck_assert_uint_eq(st.used, 4096);
  free_ok(keep);
}
END_TEST

START_TEST(free_unknown_id) {
  struct gmb_arena *a = gmb__pool_arena_new(pool, &tag_a);
  uint64_t id = alloc_ok(a, 4096, NULL, NULL);
  const uint64_t bad[] = {0,
                          id + (UINT64_C(1) << 32), /* next generation */
                          id - (UINT64_C(1) << 32), /* generation 0 */
                          id + 1,                   /* slot never used */
                          UINT64_MAX,
                          (UINT64_C(1) << 32) | 0xffffffffu};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    ck_assert_int_eq(gmb__pool_free(pool, bad[i], NULL), GMB_E_NOENT);
    ck_assert_int_eq(gmb__pool_find(pool, bad[i], NULL), GMB_E_NOENT);
  }
  struct gmb_alloc_info info;
  ck_assert_int_eq(gmb__pool_find(pool, id, &info), 0);
  ck_assert_uint_eq(info.id, id);
  ck_assert_uint_eq(info.size, 4096);
}
END_TEST

static int cmp_u64(const void *x, const void *y) {
  uint64_t a = *(const uint64_t *)x, b = *(const uint64_t *)y;
  return a < b ? -1 : a > b;
}

START_TEST(ids_never_reused) {
  struct gmb_arena *a = gmb__pool_arena_new(pool, &tag_a);
  enum { N = 3000 };
  uint64_t *ids = malloc(N * sizeof *ids);
  uint64_t held[4] = {0};
  for (int i = 0; i < N; i++) {
    /* A few live at a time so slots are reused in varied orders. */
    int k = i % 4;
    if (held[k]) free_ok(held[k]);
    ids[i] = held[k] = alloc_ok(a, 512u * (1u + (unsigned)(i % 7)), NULL, NULL);
  }
  qsort(ids, N, sizeof *ids, cmp_u64);
  for (int i = 1; i < N; i++) ck_assert_uint_ne(ids[i], ids[i - 1]);
  ck_assert_uint_ne(ids[0], 0);
  free(ids);
}
END_TEST

struct walk_acc {
  uint64_t ranges, free_ranges, live, bytes, live_bytes;
  uint64_t first_free_off, first_free_size;
  int stop_after;
};

static int walk_count(void *ctx, const struct gmb_alloc_info *info,
                      int is_free) {
  struct walk_acc *w = ctx;
  w->ranges++;
  w->bytes += info->size;
  if (is_free) {
    ck_assert_uint_eq(info->id, 0);
    if (w->free_ranges++ == 0) {
      w->first_free_off = info->offset;
      w->first_free_size = info->size;
    }
  } else {
    ck_assert_uint_ne(info->id, 0);
    w->live++;
    w->live_bytes += info->size;
  }
  if (w->stop_after && (int)w->ranges == w->stop_after) return 42;
  return 0;
}

START_TEST(coalesce_both_neighbours) {
  struct gmb_arena *a = gmb__pool_arena_new(pool, &tag_a);
  uint64_t A = alloc_ok(a, 1024, NULL, NULL);
  uint64_t B = alloc_ok(a, 2048, NULL, NULL);
  uint64_t C = alloc_ok(a, 4096, NULL, NULL);
  uint64_t D = alloc_ok(a, 512, NULL, NULL); /* keeps C off the tail */
  free_ok(A);
  free_ok(C);
  struct walk_acc w = {0};
  gmb__pool_walk(pool, walk_count, &w);
  ck_assert_uint_eq(w.free_ranges, 3); /* A, C, tail */
  free_ok(B);                          /* merges with A before and C after */
  memset(&w, 0, sizeof w);
  gmb__pool_walk(pool, walk_count, &w);
  ck_assert_uint_eq(w.free_ranges, 2);
  ck_assert_uint_eq(w.first_free_off, 0);
  ck_assert_uint_eq(w.first_free_size, 1024 + 2048 + 4096);
  ck_assert_uint_eq(w.ranges, 3);
  struct gmb_arena_stats as;
  gmb__pool_arena_stats(a, &as);
  ck_assert_uint_eq(as.largest_free, SEG - 1024 - 2048 - 4096 - 512);
  free_ok(D); /* merges with both sides: segment empty, lingers whole */
  memset(&w, 0, sizeof w);
  gmb__pool_walk(pool, walk_count, &w);
  ck_assert_uint_eq(w.ranges, 1);
  ck_assert_uint_eq(w.first_free_size, SEG);
}
END_TEST

START_TEST(best_fit_picks_smallest) {
  struct gmb_arena *a = gmb__pool_arena_new(pool, &tag_a);
  /* Holes of 4 KiB, 2 KiB and 8 KiB, separated by live 512-byte ranges. */
  const uint64_t hole[] = {4096, 2048, 8192};
  uint64_t hole_id[3], hole_off[3];
  for (int i = 0; i < 3; i++) {
    struct gmb_alloc_info info;
    hole_id[i] = alloc_ok(a, hole[i], NULL, &info);
    hole_off[i] = info.offset;
    alloc_ok(a, 512, NULL, NULL);
  }
  for (int i = 0; i < 3; i++) free_ok(hole_id[i]);
  struct gmb_alloc_info info;
  alloc_ok(a, 2048, NULL, &info);
  ck_assert_uint_eq(info.offset, hole_off[1]); /* exact fit */
  alloc_ok(a, 3000, NULL, &info);
  ck_assert_uint_eq(info.offset, hole_off[0]); /* 4 KiB beats 8 KiB */
  alloc_ok(a, 5000, NULL, &info);
  ck_assert_uint_eq(info.offset, hole_off[2]); /* 8 KiB beats the tail */
  /* 1 KiB is left of the 4 KiB hole, 3 KiB of the 8 KiB one. */
  alloc_ok(a, 1024, NULL, &info);
  ck_assert_uint_eq(info.offset, hole_off[0] + 3072);

  /* Equal sizes in one segment: the lowest offset wins. */
  struct gmb_arena *b = gmb__pool_arena_new(pool, &tag_b);
  struct gmb_alloc_info P, R;
  alloc_ok(b, 2048, NULL, &P);
  alloc_ok(b, 512, NULL, NULL);
  alloc_ok(b, 2048, NULL, &R);
  alloc_ok(b, 512, NULL, NULL);
  free_ok(R.id);
  free_ok(P.id);
  alloc_ok(b, 2048, NULL, &info);
  ck_assert_uint_eq(info.offset, P.offset);

  /* Equal sizes in two segments: the lowest segment id wins. */
  struct gmb_arena *c = gmb__pool_arena_new(pool, &tag_c);
  struct gmb_alloc_info A1, B1;
  alloc_ok(c, GMB_POOL_SMALL_MAX, NULL, &A1);
  alloc_ok(c, GMB_POOL_SMALL_MAX, NULL, NULL);
  alloc_ok(c, GMB_POOL_SMALL_MAX, NULL, &B1);
  alloc_ok(c, GMB_POOL_SMALL_MAX, NULL, NULL);
  ck_assert_uint_lt(A1.dseg->id, B1.dseg->id);
  uint64_t low_seg = A1.dseg->id;
  free_ok(B1.id);
  free_ok(A1.id);
  alloc_ok(c, GMB_POOL_SMALL_MAX, NULL, &info);
  ck_assert_uint_eq(info.dseg->id, low_seg);
  ck_assert_uint_eq(info.offset, 0);
}
END_TEST

START_TEST(empty_segment_released) {
  struct gmb_arena *a = gmb__pool_arena_new(pool, &tag_a);
  struct gmb_alloc_info info;
  uint64_t id = alloc_ok(a, 4 * GMB_MIB, NULL, &info); /* pages, no tail */
  uint64_t seg_id = info.dseg->id;
  ck_assert_uint_eq(dev->in_use, 4 * GMB_MIB);
  ck_assert_ptr_nonnull(gmb__pool_segment(pool, seg_id, NULL));
  struct gmb_alloc_info freed;
  ck_assert_int_eq(gmb__pool_free(pool, id, &freed), 0);
  ck_assert_uint_eq(freed.id, id);
  ck_assert_uint_eq(freed.size, 4 * GMB_MIB);
  ck_assert_ptr_null(freed.dseg); /* the segment is gone */
  ck_assert_uint_eq(dev->in_use, 0);
  ck_assert_uint_eq(nretired, 1);
  ck_assert_uint_eq(retired[0].seg_id, seg_id);
  ck_assert_ptr_null(gmb__pool_segment(pool, seg_id, NULL));
  struct gmb_arena_stats as;
  gmb__pool_arena_stats(a, &as);
  ck_assert_uint_eq(as.segments, 0);
  ck_assert_uint_eq(as.segment_bytes, 0);
  ck_assert_uint_eq(as.free_total, 0);
}
END_TEST

START_TEST(small_segment_lingers_then_trim) {
  struct gmb_arena *a = gmb__pool_arena_new(pool, &tag_a);
  struct gmb_alloc_info info;
  uint64_t id = alloc_ok(a, 4096, NULL, &info);
  uint64_t seg1 = info.dseg->id;
  free_ok(id);
  ck_assert_uint_eq(dev->in_use, SEG); /* lingers */
  ck_assert_uint_eq(nretired, 0);
  ck_assert_ptr_nonnull(gmb__pool_segment(pool, seg1, NULL));
  /* The next small allocation reuses it rather than making a segment. */
  id = alloc_ok(a, 8192, NULL, &info);
  ck_assert_uint_eq(info.dseg->id, seg1);
  ck_assert_uint_eq(dev->in_use, SEG);
  /* Two segments emptied: only the last one lingers. */
  uint64_t big = alloc_ok(a, GMB_POOL_SMALL_MAX, NULL, NULL);
  uint64_t other = alloc_ok(a, GMB_POOL_SMALL_MAX, NULL, &info);
  uint64_t seg2 = info.dseg->id;
  ck_assert_uint_ne(seg2, seg1);
  ck_assert_uint_eq(dev->in_use, 2 * SEG);
  free_ok(id);
  free_ok(big); /* seg1 empty: lingers */
  ck_assert_uint_eq(dev->in_use, 2 * SEG);
  free_ok(other); /* seg2 empty: lingers, seg1 released */
  ck_assert_uint_eq(dev->in_use, SEG);
  ck_assert_uint_eq(nretired, 1);
  ck_assert_uint_eq(retired[0].seg_id, seg1);
  ck_assert_ptr_eq(retired[0].tag, &tag_a);
  ck_assert_uint_eq(gmb__pool_trim(pool), SEG);
  ck_assert_uint_eq(dev->in_use, 0);
  ck_assert_uint_eq(nretired, 2);
  ck_assert_uint_eq(retired[1].seg_id, seg2);
  ck_assert_uint_eq(gmb__pool_trim(pool), 0);
}
END_TEST

static size_t heap_in_use(void) {
  struct mallinfo2 mi = mallinfo2();
  return mi.uordblks + mi.hblkhd;
}

START_TEST(trim_releases_range_chunks) {
  struct gmb_arena *a = gmb__pool_arena_new(pool, &tag_a);
  enum { N = 9000 }; /* several chunks of range structs */
  uint64_t *ids = malloc(N * sizeof *ids);
  for (int i = 0; i < N; i++) ids[i] = alloc_ok(a, 512, NULL, NULL);
  for (int i = 0; i < N; i += 2) free_ok(ids[i]); /* N/2 holes */
  for (int i = 1; i < N; i += 2) free_ok(ids[i]);
  size_t before = heap_in_use();
  ck_assert_uint_eq(gmb__pool_trim(pool), SEG);
  size_t after = heap_in_use();
  /* mallinfo2 reads 0 under AddressSanitizer: only compare real figures. */
  if (before) ck_assert_uint_ge(before - after, 4 * 2000 * 64);
  ck_assert_uint_eq(dev->in_use, 0);
  /* The pool works as before once the chunks are gone. */
  for (int i = 0; i < 3000; i++) ids[i] = alloc_ok(a, 1024, NULL, NULL);
  for (int i = 0; i < 3000; i += 3) free_ok(ids[i]);
  gmb__pool_trim(pool); /* partly used chunks stay */
  for (int i = 0; i < 3000; i++)
    if (i % 3) ck_assert_int_eq(gmb__pool_find(pool, ids[i], NULL), 0);
  free(ids);
}
END_TEST

START_TEST(nomem_exact_capacity) {
  struct gmb_arena *a = gmb__pool_arena_new(pool, &tag_a);
  struct gmb_alloc_info info;
  uint64_t id = alloc_ok(a, CAP, NULL, &info);
  ck_assert_uint_eq(dev->in_use, CAP);
  ck_assert_int_eq(gmb__pool_alloc(pool, a, 512, 0, NULL, &info), GMB_E_NOMEM);
  free_ok(id);
  ck_assert_int_eq(gmb__pool_alloc(pool, a, CAP + 1, 0, NULL, &info),
                   GMB_E_NOMEM);
  /* Small segments fill the device exactly too. */
  uint64_t ids[CAP / SEG];
  for (unsigned i = 0; i < CAP / SEG; i++) {
    ids[i] = alloc_ok(a, GMB_POOL_SMALL_MAX, NULL, NULL);
    alloc_ok(a, GMB_POOL_SMALL_MAX, NULL, NULL);
  }
  ck_assert_uint_eq(dev->in_use, CAP);
  ck_assert_int_eq(gmb__pool_alloc(pool, a, 512, 0, NULL, &info), GMB_E_NOMEM);
  free_ok(ids[3]);
  alloc_ok(a, GMB_POOL_SMALL_MAX, NULL, &info); /* the hole is reused */
  ck_assert_uint_eq(dev->in_use, CAP);
  struct gmb_pool_stats st;
  gmb__pool_stats(pool, &st);
  ck_assert_uint_eq(st.capacity, CAP);
  ck_assert_uint_eq(st.used, CAP);
  ck_assert_uint_eq(st.segments, CAP / SEG);
}
END_TEST

START_TEST(lingering_released_under_pressure) {
  struct gmb_arena *a = gmb__pool_arena_new(pool, &tag_a);
  struct gmb_arena *b = gmb__pool_arena_new(pool, &tag_b);
  struct gmb_alloc_info info;
  uint64_t id = alloc_ok(a, 4096, NULL, &info);
  uint64_t seg_a = info.dseg->id;
  free_ok(id);
  ck_assert_uint_eq(dev->in_use, SEG);
  /* b needs the whole device: a's lingering segment must go. */
  id = alloc_ok(b, CAP, NULL, &info);
  ck_assert_uint_eq(nretired, 1);
  ck_assert_uint_eq(retired[0].seg_id, seg_a);
  ck_assert_ptr_eq(retired[0].tag, &tag_a);
  ck_assert_uint_eq(dev->in_use, CAP);
  /* With nothing lingering, pressure is a plain NOMEM. */
  ck_assert_int_eq(gmb__pool_alloc(pool, a, 512, 0, NULL, &info), GMB_E_NOMEM);
  free_ok(id);
}
END_TEST

START_TEST(arenas_never_share_segment) {
  struct gmb_arena *a = gmb__pool_arena_new(pool, &tag_a);
  struct gmb_arena *b = gmb__pool_arena_new(pool, &tag_b);
  struct gmb_alloc_info x, y;
  alloc_ok(a, 512, NULL, &x);
  alloc_ok(b, 512, NULL, &y);
  ck_assert_uint_ne(x.dseg->id, y.dseg->id);
  void *tag = NULL;
  ck_assert_ptr_eq(gmb__pool_segment(pool, x.dseg->id, &tag), x.dseg);
  ck_assert_ptr_eq(tag, &tag_a);
  ck_assert_ptr_eq(gmb__pool_segment(pool, y.dseg->id, &tag), y.dseg);
  ck_assert_ptr_eq(tag, &tag_b);
  /* A large free range in a does not serve b either. */
  struct gmb_alloc_info big;
  uint64_t big_id = alloc_ok(a, 3 * GMB_MIB, NULL, &big);
  uint64_t big_seg = big.dseg->id;
  uint64_t keep = alloc_ok(a, GMB_POOL_SMALL_MAX + 512, NULL, NULL);
  (void)keep;
  free_ok(big_id);
  struct gmb_alloc_info z;
  alloc_ok(b, 2 * GMB_MIB, NULL, &z);
  ck_assert_uint_ne(z.dseg->id, big_seg);
  struct gmb_arena_stats sa, sb;
  gmb__pool_arena_stats(a, &sa);
  gmb__pool_arena_stats(b, &sb);
  ck_assert_uint_eq(sa.used, 512 + GMB_POOL_SMALL_MAX + 512);
  ck_assert_uint_eq(sb.used, 512 + 2 * GMB_MIB);
}
END_TEST

START_TEST(free_owner_frees_only_that_owner) {
  struct gmb_arena *a = gmb__pool_arena_new(pool, &tag_a);
  struct gmb_arena *b = gmb__pool_arena_new(pool, &tag_b);
  int x, y;
  enum { N = 600 };
  uint64_t ids[N];
  uint64_t x_bytes = 0;
  for (int i = 0; i < N; i++) {
    void *owner = (i % 3 == 0) ? (void *)&x : (void *)&y;
    /* Mixed sizes over several small and large segments. */
    uint64_t size =
        (i % 50 == 0) ? 3 * GMB_MIB / 2 : 512u * (1u + (unsigned)(i % 17));
    struct gmb_alloc_info info;
    ids[i] = alloc_ok(a, size, owner, &info);
    if (owner == &x) x_bytes += info.size;
  }
  uint64_t other = alloc_ok(b, 4096, &x, NULL); /* x in another arena */
  ck_assert_uint_eq(gmb__pool_free_owner(pool, a, &x), x_bytes);
  ck_assert_int_eq(gmb__pool_check(pool), 0);
  for (int i = 0; i < N; i++) {
    struct gmb_alloc_info info;
    int rc = gmb__pool_find(pool, ids[i], &info);
    if (i % 3 == 0) {
      ck_assert_int_eq(rc, GMB_E_NOENT);
    } else {
      ck_assert_int_eq(rc, 0);
      ck_assert_ptr_eq(info.owner, &y);
    }
  }
  ck_assert_int_eq(gmb__pool_find(pool, other, NULL), 0);
  ck_assert_uint_eq(gmb__pool_free_owner(pool, a, &x), 0);
  /* Freeing every range of y empties the segments: all released except
   * one lingering small segment. */
  gmb__pool_free_owner(pool, a, &y);
  ck_assert_int_eq(gmb__pool_check(pool), 0);
  struct gmb_arena_stats as;
  gmb__pool_arena_stats(a, &as);
  ck_assert_uint_eq(as.allocations, 0);
  ck_assert_uint_eq(as.used, 0);
  ck_assert_uint_eq(as.segments, 1);
  ck_assert_uint_eq(as.segment_bytes, SEG);
}
END_TEST

START_TEST(retire_callback_called) {
  struct gmb_arena *a = gmb__pool_arena_new(pool, &tag_a);
  struct gmb_arena *b = gmb__pool_arena_new(pool, &tag_b);
  struct gmb_alloc_info x, y, z;
  alloc_ok(a, 512, NULL, &x);
  alloc_ok(a, 4 * GMB_MIB, NULL, &y);
  alloc_ok(b, 512, NULL, &z);
  uint64_t xs = x.dseg->id, ys = y.dseg->id, zs = z.dseg->id;
  gmb__pool_arena_destroy(pool, a);
  ck_assert_int_eq(gmb__pool_check(pool), 0);
  ck_assert_uint_eq(nretired, 2);
  int seen_x = 0, seen_y = 0;
  for (unsigned i = 0; i < nretired; i++) {
    ck_assert_ptr_eq(retired[i].tag, &tag_a);
    seen_x += retired[i].seg_id == xs;
    seen_y += retired[i].seg_id == ys;
  }
  ck_assert_int_eq(seen_x, 1);
  ck_assert_int_eq(seen_y, 1);
  ck_assert_int_eq(gmb__pool_find(pool, x.id, NULL), GMB_E_NOENT);
  ck_assert_uint_eq(dev->in_use, SEG);
  /* The pool's destroy retires what is left. */
  gmb__pool_destroy(pool);
  ck_assert_uint_eq(nretired, 3);
  ck_assert_uint_eq(retired[2].seg_id, zs);
  ck_assert_ptr_eq(retired[2].tag, &tag_b);
  ck_assert_uint_eq(dev->in_use, 0);
  pool = gmb__pool_new(dev, on_retire, &nretired); /* for teardown */
}
END_TEST

START_TEST(walk_visits_all) {
  struct gmb_arena *a = gmb__pool_arena_new(pool, &tag_a);
  struct gmb_arena *b = gmb__pool_arena_new(pool, &tag_b);
  uint64_t live_bytes = 0;
  for (int i = 0; i < 40; i++) {
    struct gmb_alloc_info info;
    uint64_t id =
        alloc_ok(i & 1 ? a : b, 512u * (unsigned)(1 + i * 7), NULL, &info);
    live_bytes += info.size;
    if (i % 5 == 0) {
      free_ok(id);
      live_bytes -= info.size;
    }
  }
  struct gmb_pool_stats st;
  gmb__pool_stats(pool, &st);
  struct walk_acc w = {0};
  ck_assert_int_eq(gmb__pool_walk(pool, walk_count, &w), 0);
  ck_assert_uint_eq(w.bytes, st.segment_bytes);
  ck_assert_uint_eq(w.live, st.allocations);
  ck_assert_uint_eq(w.live_bytes, live_bytes);
  ck_assert_uint_eq(st.used, live_bytes);
  struct walk_acc w2 = {.stop_after = 3};
  ck_assert_int_eq(gmb__pool_walk(pool, walk_count, &w2), 42);
  ck_assert_uint_eq(w2.ranges, 3);
}
END_TEST

/* Where a walk was: (segment id, offset) of each range it visited. */
struct walk_trace {
  uint64_t seg[512], off[512];
  int n, limit; /* limit: take this many, then refuse (0: no limit) */
};

static int walk_trace_fn(void *ctx, const struct gmb_alloc_info *info,
                         int is_free) {
  (void)is_free;
  struct walk_trace *t = ctx;
  if (t->limit && t->n == t->limit) return 7;
  ck_assert_int_lt(t->n, 512);
  t->seg[t->n] = info->dseg->id;
  t->off[t->n] = info->offset;
  t->n++;
  return 0;
}

/* Sliced walks, each from the cursor where the last one stopped, visit
 * every range exactly once and in the order of one whole walk; the cursor
 * names the first range not visited. */
START_TEST(walk_from_resumes_where_it_stopped) {
  struct gmb_arena *a = gmb__pool_arena_new(pool, &tag_a);
  struct gmb_arena *b = gmb__pool_arena_new(pool, &tag_b);
  for (int i = 0; i < 60; i++) {
    uint64_t id = alloc_ok(i % 3 ? a : b, 512u * (unsigned)(1 + i % 9 * 50),
                           NULL, NULL);
    if (i % 4 == 1) free_ok(id); /* free ranges between live ones */
  }
  alloc_ok(a, 3 * SEG, NULL, NULL); /* a large segment too */
  struct walk_trace all = {.n = 0};
  ck_assert_int_eq(gmb__pool_walk(pool, walk_trace_fn, &all), 0);
  ck_assert_int_gt(all.n, 20);
  static const int slices[] = {1, 3, 7, 1000};
  for (size_t k = 0; k < sizeof slices / sizeof slices[0]; k++) {
    uint64_t seg = 0, off = 0;
    int seen = 0, walks = 0;
    do {
      struct walk_trace t = {.limit = slices[k]};
      int rc = gmb__pool_walk_from(pool, seg, off, walk_trace_fn, &t, &seg,
                                   &off);
      walks++;
      for (int i = 0; i < t.n; i++, seen++) {
        ck_assert_int_lt(seen, all.n);
        ck_assert_uint_eq(t.seg[i], all.seg[seen]);
        ck_assert_uint_eq(t.off[i], all.off[seen]);
      }
      if (rc == 0) {
        ck_assert_uint_eq(seg, 0);
        ck_assert_uint_eq(off, 0);
        break;
      }
      ck_assert_int_eq(rc, 7);
      ck_assert_int_eq(t.n, slices[k]);
      ck_assert_int_lt(seen, all.n); /* stopped before a range: it exists */
      ck_assert_uint_eq(seg, all.seg[seen]);
      ck_assert_uint_eq(off, all.off[seen]);
    } while (walks < 1000);
    ck_assert_int_eq(seen, all.n);
  }
}
END_TEST

/* A cursor in a segment that went away resumes at the next segment; one
 * past every segment visits nothing. */
START_TEST(walk_from_released_segment_goes_on) {
  struct gmb_arena *a = gmb__pool_arena_new(pool, &tag_a);
  struct gmb_alloc_info x, y, z;
  alloc_ok(a, 4096, NULL, &x);
  alloc_ok(a, 3 * SEG, NULL, &y); /* a large segment of its own */
  alloc_ok(a, 5 * SEG, NULL, &z);
  uint64_t gone = y.dseg->id;
  free_ok(y.id); /* a large segment is released at once */
  ck_assert_ptr_null(gmb__pool_segment(pool, gone, NULL));
  struct walk_trace t = {.n = 0};
  ck_assert_int_eq(
      gmb__pool_walk_from(pool, gone, 4096, walk_trace_fn, &t, NULL, NULL), 0);
  ck_assert_int_ge(t.n, 1);
  ck_assert_uint_eq(t.seg[0], z.dseg->id);
  ck_assert_uint_eq(t.off[0], 0);
  /* An offset in the middle of a range skips that range. */
  struct walk_trace u = {.n = 0};
  gmb__pool_walk_from(pool, x.dseg->id, 512, walk_trace_fn, &u, NULL, NULL);
  ck_assert_uint_eq(u.seg[0], x.dseg->id);
  ck_assert_uint_eq(u.off[0], 4096);
  uint64_t last = 0;
  gmb__pool_changes(pool, &last);
  ck_assert_uint_ge(last, z.dseg->id);
  struct walk_trace v = {.n = 0};
  ck_assert_int_eq(gmb__pool_walk_from(pool, last + 1, 0, walk_trace_fn, &v,
                                       NULL, NULL), 0);
  ck_assert_int_eq(v.n, 0);
}
END_TEST

/* The change counter moves with every change a walk could see, and only
 * then. */
START_TEST(changes_count_what_a_walk_sees) {
  struct gmb_arena *a = gmb__pool_arena_new(pool, &tag_a);
  uint64_t last = 99, c0 = gmb__pool_changes(pool, &last);
  ck_assert_uint_eq(last, 0); /* no segment yet */
  struct gmb_alloc_info x, y;
  alloc_ok(a, 4096, NULL, &x);
  uint64_t c1 = gmb__pool_changes(pool, &last);
  ck_assert_uint_gt(c1, c0);
  ck_assert_uint_eq(last, x.dseg->id);
  alloc_ok(a, 8192, NULL, &y);
  uint64_t c2 = gmb__pool_changes(pool, NULL);
  ck_assert_uint_gt(c2, c1);
  /* Reading changes nothing. */
  struct gmb_alloc_info got;
  struct gmb_pool_stats st;
  struct walk_trace t = {.n = 0};
  ck_assert_int_eq(gmb__pool_find(pool, x.id, &got), 0);
  gmb__pool_stats(pool, &st);
  gmb__pool_walk(pool, walk_trace_fn, &t);
  ck_assert_int_eq(gmb__pool_set_tag(pool, x.id, 3), 0);
  ck_assert_int_eq(gmb__pool_alloc(pool, a, 0, 0, NULL, NULL), GMB_E_INVAL);
  ck_assert_int_eq(gmb__pool_free(pool, 12345, NULL), GMB_E_NOENT);
  ck_assert_uint_eq(gmb__pool_changes(pool, NULL), c2);
  free_ok(x.id);
  uint64_t c3 = gmb__pool_changes(pool, NULL);
  ck_assert_uint_gt(c3, c2);
  free_ok(y.id); /* the segment empties and lingers */
  uint64_t c4 = gmb__pool_changes(pool, NULL);
  ck_assert_uint_gt(c4, c3);
  ck_assert_uint_eq(gmb__pool_trim(pool), SEG); /* released */
  ck_assert_uint_gt(gmb__pool_changes(pool, NULL), c4);
}
END_TEST

/* A walk's segment view: its id and size, tenant tag, used bytes, class. */
START_TEST(segment_view_of_small_and_large) {
  struct gmb_arena *a = gmb__pool_arena_new(pool, &tag_a);
  struct gmb_arena *b = gmb__pool_arena_new(pool, &tag_b);
  struct gmb_alloc_info x, y, big;
  alloc_ok(a, 1000, NULL, &x); /* rounded to 1024 */
  alloc_ok(a, 4096, NULL, &y);
  alloc_ok(b, 3 * GMB_MIB, NULL, &big); /* a page of its own, and a tail */
  struct gmb_segment_view v;
  gmb__pool_segment_view(x.segment, &v);
  ck_assert_uint_eq(v.dseg->id, x.dseg->id);
  ck_assert_uint_eq(v.dseg->size, SEG);
  ck_assert_ptr_eq(v.arena_tag, &tag_a);
  ck_assert_uint_eq(v.used, 1024 + 4096);
  ck_assert_int_eq(v.small, 1);
  gmb__pool_segment_view(big.segment, &v);
  ck_assert_ptr_eq(v.arena_tag, &tag_b);
  ck_assert_uint_eq(v.dseg->size, SEG);
  ck_assert_uint_eq(v.used, SEG); /* the page; the tail is elsewhere */
  ck_assert_int_eq(v.small, 0);
}
END_TEST

START_TEST(tag_set_and_found) {
  struct gmb_arena *a = gmb__pool_arena_new(pool, &tag_a);
  struct gmb_alloc_info x, y, got;
  alloc_ok(a, 4096, NULL, &x);
  alloc_ok(a, 4096, NULL, &y);
  ck_assert_uint_eq(x.tag, 0);
  ck_assert_int_eq(gmb__pool_set_tag(pool, x.id, UINT32_MAX), 0);
  ck_assert_int_eq(gmb__pool_find(pool, x.id, &got), 0);
  ck_assert_uint_eq(got.tag, UINT32_MAX);
  ck_assert_int_eq(gmb__pool_find(pool, y.id, &got), 0);
  ck_assert_uint_eq(got.tag, 0);
  free_ok(x.id);
  ck_assert_int_eq(gmb__pool_set_tag(pool, x.id, 5), GMB_E_NOENT);
  ck_assert_int_eq(gmb__pool_set_tag(pool, 0, 5), GMB_E_NOENT);
  /* The slot comes back with a new generation and no tag. */
  struct gmb_alloc_info z;
  alloc_ok(a, 4096, NULL, &z);
  ck_assert_uint_eq(z.tag, 0);
}
END_TEST

/* free_in_segments and largest_free, device-wide, over two arenas. */
START_TEST(device_free_figures) {
  struct gmb_arena *a = gmb__pool_arena_new(pool, &tag_a);
  struct gmb_arena *b = gmb__pool_arena_new(pool, &tag_b);
  struct gmb_pool_stats st;
  gmb__pool_stats(pool, &st);
  ck_assert_uint_eq(st.free_in_segments, 0);
  ck_assert_uint_eq(st.largest_free, CAP);
  ck_assert_uint_eq(st.room, CAP);
  struct gmb_alloc_info x, y, big;
  alloc_ok(a, 100 * 1024, NULL, &x); /* small segment: 2 MiB */
  /* 30 MiB of pages, and a 512-byte tail in a small segment of b's */
  alloc_ok(b, 30 * GMB_MIB + 512, NULL, &big);
  alloc_ok(b, GMB_MIB + 1024, NULL, &y); /* beside that tail */
  ck_assert_uint_ne(y.dseg->id, big.dseg->id);
  ck_assert_uint_eq(y.dseg->id, big.tail_dseg->id);
  gmb__pool_stats(pool, &st);
  ck_assert_uint_eq(st.free_in_segments,
                    (SEG - x.size) + (SEG - big.tail_size - y.size));
  ck_assert_uint_eq(st.largest_free, CAP - 34 * GMB_MIB);
  ck_assert_uint_eq(st.room, CAP - 34 * GMB_MIB);
  free_ok(big.id); /* its segment goes back at once */
  gmb__pool_stats(pool, &st);
  ck_assert_uint_eq(st.room, CAP - 4 * GMB_MIB);
  ck_assert_uint_eq(st.largest_free, st.room);
  struct gmb_arena_stats as;
  gmb__pool_arena_stats(b, &as);
  /* b's one small segment: y, above where the tail was */
  ck_assert_uint_eq(as.largest_free, SEG - big.tail_size - y.size);
  ck_assert_uint_eq(as.moving, 0);
  ck_assert_uint_eq(as.used + as.free_total, as.segment_bytes);
  /* What largest_free promises, some arena can have: b, here. */
  struct gmb_alloc_info got;
  ck_assert_int_eq(gmb__pool_alloc(pool, b, st.largest_free, 0, NULL, &got),
                   0);
  gmb__pool_stats(pool, &st);
  ck_assert_uint_eq(st.room, 0);
  ck_assert_uint_eq(st.largest_free, SEG - x.size);
}
END_TEST

/* ---- seeded random stress against a shadow model ---------------------- */

static unsigned env_uint(const char *name, unsigned dflt) {
  const char *s = getenv(name);
  if (!s || !*s) return dflt;
  return (unsigned)strtoul(s, NULL, 0);
}

static uint64_t rng_state;
static uint64_t rng(void) { return gmb__splitmix64(&rng_state); }

static uint64_t random_size(void) {
  uint64_t r = rng() % 100;
  if (r < 70) return 1 + rng() % 8192;
  if (r < 90) return 1 + rng() % GMB_POOL_SMALL_MAX;
  return GMB_POOL_SMALL_MAX + 1 + rng() % (6 * GMB_MIB);
}

struct shadow {
  uint64_t id, size;
  int arena, owner;
};

START_TEST(random_stress) {
  unsigned scale = env_uint("SCALE", 1), iter = env_uint("ITER", 3000) * scale;
  unsigned seed = env_uint("SEED", (unsigned)gmb__now_ns());
  rng_state = seed;
  printf("pool random_stress: SEED=%u ITER=%u\n", seed, iter);
  fflush(stdout);
  enum { NA = 3, NO = 4 };
  struct gmb_arena *ar[NA];
  int owners[NO];
  for (int i = 0; i < NA; i++) ar[i] = gmb__pool_arena_new(pool, &owners[i]);
  size_t cap = 1024 * scale, n = 0;
  struct shadow *live = malloc(cap * sizeof *live);
  unsigned nomem = 0;
  for (unsigned step = 0; step < iter; step++) {
    uint64_t op = rng() % 100;
    if (op < 55 && n < cap) {
      int ai = (int)(rng() % NA), oi = (int)(rng() % NO);
      uint64_t size = random_size();
      struct gmb_alloc_info info;
      int rc = gmb__pool_alloc(pool, ar[ai], size, 0, &owners[oi], &info);
      if (rc == GMB_E_NOMEM) {
        nomem++;
      } else {
        ck_assert_msg(rc == 0, "seed %u step %u: alloc %llu: %s", seed, step,
                      (unsigned long long)size, gmb_err_name(rc));
        ck_assert_uint_eq(info.size, (size + 511) & ~UINT64_C(511));
        ck_assert_uint_le(info.offset + info.size - info.tail_size,
                          info.dseg->size);
        if (info.tail_dseg)
          ck_assert_uint_le(info.tail_offset + info.tail_size,
                            info.tail_dseg->size);
        live[n++] = (struct shadow){info.id, info.size, ai, oi};
      }
    } else if (op < 95 && n > 0) {
      size_t k = rng() % n;
      struct gmb_alloc_info info;
      ck_assert_int_eq(gmb__pool_free(pool, live[k].id, &info), 0);
      ck_assert_uint_eq(info.size, live[k].size);
      ck_assert_ptr_eq(info.owner, &owners[live[k].owner]);
      live[k] = live[--n];
    } else if (op < 97) {
      int ai = (int)(rng() % NA), oi = (int)(rng() % NO);
      uint64_t want = 0;
      for (size_t k = 0; k < n;) {
        if (live[k].arena == ai && live[k].owner == oi) {
          want += live[k].size;
          live[k] = live[--n];
        } else {
          k++;
        }
      }
      ck_assert_uint_eq(gmb__pool_free_owner(pool, ar[ai], &owners[oi]), want);
    } else {
      gmb__pool_trim(pool);
    }
    ck_assert_msg(gmb__pool_check(pool) == 0, "seed %u step %u: check", seed,
                  step);
    /* Accounting against the shadow model. */
    uint64_t used[NA] = {0}, cnt[NA] = {0}, total = 0;
    for (size_t k = 0; k < n; k++) {
      used[live[k].arena] += live[k].size;
      cnt[live[k].arena]++;
      total += live[k].size;
    }
    uint64_t seg_bytes = 0;
    for (int i = 0; i < NA; i++) {
      struct gmb_arena_stats as;
      gmb__pool_arena_stats(ar[i], &as);
      ck_assert_uint_eq(as.used, used[i]);
      ck_assert_uint_eq(as.allocations, cnt[i]);
      ck_assert_uint_eq(as.free_total + as.used, as.segment_bytes);
      ck_assert_uint_le(as.largest_free, as.free_total);
      seg_bytes += as.segment_bytes;
    }
    struct gmb_pool_stats st;
    gmb__pool_stats(pool, &st);
    ck_assert_uint_eq(st.used, total);
    ck_assert_uint_eq(st.allocations, n);
    ck_assert_uint_eq(st.segment_bytes, seg_bytes);
    ck_assert_uint_eq(dev->in_use, seg_bytes);
    if (step % 64 == 0)
      for (size_t k = 0; k < n; k++)
        ck_assert_int_eq(gmb__pool_find(pool, live[k].id, NULL), 0);
  }
  printf("pool random_stress: %u steps, %zu live at end, %u NOMEM\n", iter, n,
         nomem);
  free(live);
}
END_TEST

/* The figures gmb__pool_stats keeps as the pool changes (the free bytes
 * in segments, the largest free range) against a walk of every arena,
 * after each step of a seeded mix of allocations, frees, moves begun,
 * committed and aborted, an owner's frees and trims: a client's Stats
 * costs no walk of the tenants, and must not drift from one. */
struct stats_dst {
  void *tag;
  uint64_t need, not_seg, seg, offset;
};

static int stats_find_dst(void *ctx, const struct gmb_alloc_info *info,
                          int is_free) {
  struct stats_dst *d = ctx;
  if (!is_free || info->size < d->need || info->dseg->id == d->not_seg)
    return 0;
  struct gmb_segment_view v;
  gmb__pool_segment_view(info->segment, &v);
  if (!v.small || v.arena_tag != d->tag) return 0;
  d->seg = info->dseg->id;
  d->offset = info->offset;
  return 1;
}

static void stats_same_as_walk(unsigned seed, unsigned step) {
  struct gmb_pool_stats kept, walked;
  gmb__pool_stats(pool, &kept);
  gmb__pool_stats_walk(pool, &walked);
  ck_assert_msg(kept.free_in_segments == walked.free_in_segments &&
                    kept.largest_free == walked.largest_free &&
                    kept.room == walked.room && kept.used == walked.used &&
                    kept.segment_bytes == walked.segment_bytes,
                "seed %u step %u: kept free %llu largest %llu, walked %llu "
                "%llu", seed, step, (unsigned long long)kept.free_in_segments,
                (unsigned long long)kept.largest_free,
                (unsigned long long)walked.free_in_segments,
                (unsigned long long)walked.largest_free);
}

START_TEST(stats_kept_equal_to_a_walk) {
  unsigned scale = env_uint("SCALE", 1), iter = env_uint("ITER", 3000) * scale;
  unsigned seed = env_uint("SEED", (unsigned)gmb__now_ns());
  rng_state = seed;
  printf("pool stats_kept_equal_to_a_walk: SEED=%u ITER=%u\n", seed, iter);
  fflush(stdout);
  enum { NA = 6 };
  struct gmb_arena *ar[NA];
  int tags[NA];
  for (int i = 0; i < NA; i++) ar[i] = gmb__pool_arena_new(pool, &tags[i]);
  size_t cap = 1024 * scale, n = 0;
  struct shadow *live = malloc(cap * sizeof *live);
  unsigned moves = 0, committed = 0;
  for (unsigned step = 0; step < iter; step++) {
    uint64_t op = rng() % 100;
    if (op < 50 && n < cap) {
      int ai = (int)(rng() % NA);
      uint64_t size = random_size();
      uint32_t flags = rng() % 4 ? GMB_MOVABLE : 0;
      struct gmb_alloc_info info;
      int rc = gmb__pool_alloc(pool, ar[ai], size, flags, &tags[ai], &info);
      ck_assert_msg(rc == 0 || rc == GMB_E_NOMEM, "seed %u step %u: %s",
                    seed, step, gmb_err_name(rc));
      if (rc == 0) live[n++] = (struct shadow){info.id, info.size, ai, 0};
    } else if (op < 80 && n > 0) {
      size_t k = rng() % n;
      ck_assert_int_eq(gmb__pool_free(pool, live[k].id, NULL), 0);
      live[k] = live[--n];
    } else if (op < 96 && n > 0) {
      /* A move of a movable small allocation to another segment of its
       * arena, committed or aborted, the figures checked in flight. */
      size_t k = rng() % n;
      struct gmb_alloc_info info;
      ck_assert_int_eq(gmb__pool_find(pool, live[k].id, &info), 0);
      if (!(info.flags & GMB_MOVABLE) || info.size > GMB_POOL_SMALL_MAX)
        continue;
      struct stats_dst d = {&tags[live[k].arena], info.size, info.dseg->id,
                            0, 0};
      if (!gmb__pool_walk(pool, stats_find_dst, &d)) continue;
      struct gmb_pool_move m;
      ck_assert_int_eq(gmb__pool_move_begin(pool, info.id, d.seg, d.offset,
                                            &m), 0);
      moves++;
      stats_same_as_walk(seed, step);
      ck_assert_int_eq(gmb__pool_check(pool), 0);
      if (rng() % 2) {
        ck_assert_int_eq(gmb__pool_move_commit(pool, &m, NULL, NULL), 0);
        committed++;
      } else {
        ck_assert_int_eq(gmb__pool_move_abort(pool, &m), 0);
      }
    } else if (op < 98) {
      int ai = (int)(rng() % NA);
      for (size_t k = 0; k < n;)
        if (live[k].arena == ai)
          live[k] = live[--n];
        else
          k++;
      gmb__pool_free_owner(pool, ar[ai], &tags[ai]);
    } else {
      gmb__pool_trim(pool);
    }
    ck_assert_msg(gmb__pool_check(pool) == 0, "seed %u step %u: check", seed,
                  step);
    stats_same_as_walk(seed, step);
  }
  ck_assert_uint_gt(moves, 0);
  ck_assert_uint_gt(committed, 0);
  printf("pool stats_kept_equal_to_a_walk: %u steps, %u moves (%u "
         "committed), %zu live at end\n", iter, moves, committed, n);
  free(live);
}
END_TEST

START_TEST(oom_loop_only_nomem) {
  unsigned scale = env_uint("SCALE", 1);
  unsigned seed = env_uint("SEED", (unsigned)gmb__now_ns()) + 1;
  rng_state = seed;
  printf("pool oom_loop_only_nomem: SEED=%u\n", seed - 1);
  struct gmb_arena *a = gmb__pool_arena_new(pool, &tag_a);
  struct gmb_arena *b = gmb__pool_arena_new(pool, &tag_b);
  size_t cap = 200000, n = 0;
  uint64_t *ids = malloc(cap * sizeof *ids);
  for (unsigned round = 0; round < 4 * scale; round++) {
    unsigned failures = 0;
    while (failures < 200 && n < cap) {
      struct gmb_alloc_info info;
      int rc = gmb__pool_alloc(pool, rng() & 1 ? a : b, random_size(), 0, NULL,
                               &info);
      if (rc == 0) {
        ids[n++] = info.id;
        continue;
      }
      ck_assert_msg(rc == GMB_E_NOMEM, "seed %u: failure %s, not NOMEM", seed,
                    gmb_err_name(rc));
      failures++;
      /* Whatever failed, the device really had no room for a segment of
       * that class, or the request is larger than what is left. */
    }
    ck_assert_int_eq(gmb__pool_check(pool), 0);
    /* Free a random half and go again. */
    for (size_t k = 0; k < n;) {
      if (rng() & 1) {
        ck_assert_int_eq(gmb__pool_free(pool, ids[k], NULL), 0);
        ids[k] = ids[--n];
      } else {
        k++;
      }
    }
    ck_assert_int_eq(gmb__pool_check(pool), 0);
  }
  while (n) ck_assert_int_eq(gmb__pool_free(pool, ids[--n], NULL), 0);
  gmb__pool_trim(pool);
  ck_assert_uint_eq(dev->in_use, 0);
  free(ids);
}
END_TEST

static Suite *pool_suite(void) {
  Suite *s = suite_create("pool");
  TCase *tc = tcase_create("pool");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, alloc_zero);
  tcase_add_test(tc, alloc_overflow);
  tcase_add_test(tc, align_512);
  tcase_add_test(tc, small_share_segment);
  tcase_add_test(tc, large_rounded_segment);
  tcase_add_test(tc, large_own_segment);
  tcase_add_test(tc, large_tail_walk_and_owner);
  tcase_add_test(tc, large_never_refused_with_room);
  tcase_add_test(tc, mobility_grouping);
  tcase_add_test(tc, grouping_off_shares_segments);
  tcase_add_test(tc, free_twice);
  tcase_add_test(tc, free_unknown_id);
  tcase_add_test(tc, ids_never_reused);
  tcase_add_test(tc, coalesce_both_neighbours);
  tcase_add_test(tc, best_fit_picks_smallest);
  tcase_add_test(tc, empty_segment_released);
  tcase_add_test(tc, small_segment_lingers_then_trim);
  tcase_add_test(tc, trim_releases_range_chunks);
  tcase_add_test(tc, nomem_exact_capacity);
  tcase_add_test(tc, lingering_released_under_pressure);
  tcase_add_test(tc, arenas_never_share_segment);
  tcase_add_test(tc, free_owner_frees_only_that_owner);
  tcase_add_test(tc, retire_callback_called);
  tcase_add_test(tc, walk_visits_all);
  tcase_add_test(tc, walk_from_resumes_where_it_stopped);
  tcase_add_test(tc, walk_from_released_segment_goes_on);
  tcase_add_test(tc, changes_count_what_a_walk_sees);
  tcase_add_test(tc, segment_view_of_small_and_large);
  tcase_add_test(tc, tag_set_and_found);
  tcase_add_test(tc, device_free_figures);
  tcase_add_test(tc, random_stress);
  tcase_add_test(tc, stats_kept_equal_to_a_walk);
  tcase_add_test(tc, oom_loop_only_nomem);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) { return check_run(pool_suite()); }
