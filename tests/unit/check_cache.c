/*
 * check_cache.c - the client's stream-ordered cache alone (cache.c), over
 * a backend of host memory and of events that the test completes by hand.
 *
 * The backend counts its calls (a hit must make none), holds a quota of
 * slab bytes (refusing with GMB_E_QUOTA past it, as the broker does) and
 * models streams: a stream is a counter of records and a counter of what
 * completed; an event is done once its stream completed past its record.
 * gmb__cache_check runs after every step and must find nothing.  The
 * random stress writes a pattern into every block it holds and checks it
 * at the free, so two live blocks that overlap are caught.
 *
 * Knobs: SEED, ITER (stress steps, default 20000), SCALE (multiplies the
 * sizes' range).
 */
#include <check.h>
#include <malloc.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cache.h"
#include "check_main.h"
#include "gmb.h"
#include "util.h"

#define MIB (UINT64_C(1) << 20)

/* --- the backend ------------------------------------------------------ */

#define MAX_SLABS 4096
struct fake_stream {
  uint64_t recorded, completed;
  int destroyed;
};
struct fake_event {
  struct fake_stream *s;
  uint64_t at;
};
static struct {
  pthread_mutex_t mu;
  void *slab[MAX_SLABS];
  uint64_t size[MAX_SLABS];
  uint64_t quota, held;
  unsigned allocs, frees, records, queries;
  int events_live;
} be = {.mu = PTHREAD_MUTEX_INITIALIZER};

static int be_alloc(void *ctx, uint64_t size, uint64_t *id, uintptr_t *base) {
  (void)ctx;
  pthread_mutex_lock(&be.mu);
  int rc = 0;
  if (be.quota && be.held + size > be.quota) {
    rc = GMB_E_QUOTA;
  } else {
    uint64_t i = 1;
    while (i < MAX_SLABS && be.slab[i]) i++;
    void *p = i < MAX_SLABS ? aligned_alloc(4096, (size_t)size) : NULL;
    if (p == NULL) {
      rc = GMB_E_NOMEM;
    } else {
      be.slab[i] = p;
      be.size[i] = size;
      be.held += size;
      be.allocs++;
      *id = i;
      *base = (uintptr_t)p;
    }
  }
  pthread_mutex_unlock(&be.mu);
  return rc;
}

static void be_free(void *ctx, uint64_t id) {
  (void)ctx;
  pthread_mutex_lock(&be.mu);
  if (id > 0 && id < MAX_SLABS && be.slab[id]) {
    free(be.slab[id]);
    be.slab[id] = NULL;
    be.held -= be.size[id];
    be.frees++;
  }
  pthread_mutex_unlock(&be.mu);
}

static int ev_new(void *ctx, void **ev) {
  (void)ctx;
  *ev = calloc(1, sizeof(struct fake_event));
  if (*ev) be.events_live++;
  return *ev ? 0 : GMB_E_SYSTEM;
}
/* The legacy default stream (NULL) and the per-thread one (0x2; one
 * stands for every thread's here: the tests complete it as a whole). */
static struct fake_stream legacy, per_thread;

static int ev_record(void *ctx, void *ev, void *stream) {
  (void)ctx;
  struct fake_stream *s = stream == NULL                  ? &legacy
                          : stream == (void *)(uintptr_t)2 ? &per_thread
                                                           : stream;
  struct fake_event *e = ev;
  if (s == NULL || s->destroyed) return GMB_E_INVAL;
  be.records++;
  e->s = s;
  e->at = ++s->recorded;
  return 0;
}
static int ev_query(void *ctx, void *ev) {
  (void)ctx;
  struct fake_event *e = ev;
  be.queries++;
  return e->s->completed >= e->at;
}
static void ev_destroy(void *ctx, void *ev) {
  (void)ctx;
  be.events_live--;
  free(ev);
}

static const struct gmb_cache_ops host_ops = {.slab_alloc = be_alloc,
                                              .slab_free = be_free};
static const struct gmb_cache_ops stream_ops = {
    .slab_alloc = be_alloc,
    .slab_free = be_free,
    .event_new = ev_new,
    .event_record = ev_record,
    .event_query = ev_query,
    .event_destroy = ev_destroy};

static void be_reset(void) {
  be.quota = 0;
  be.allocs = be.frees = be.records = be.queries = 0;
}

/* Destroys the cache after giving every slab back; nothing may leak. */
static void done(struct gmb_cache *k) {
  ck_assert_int_eq(gmb__cache_check(k), 0);
  gmb__cache_destroy(k);
  for (int i = 1; i < MAX_SLABS; i++)
    if (be.slab[i]) be_free(NULL, (uint64_t)i);
  ck_assert_int_eq(be.events_live, 0);
  be.held = 0;
}

static uint64_t env_u64(const char *name, uint64_t def) {
  const char *s = getenv(name);
  return s && *s ? strtoull(s, NULL, 0) : def;
}

/* --- bad input --------------------------------------------------------- */

START_TEST(alloc_zero_and_too_big) {
  be_reset();
  struct gmb_cache *k = gmb__cache_new(&host_ops, 2);
  void *p = (void *)1;
  ck_assert_int_eq(gmb__cache_alloc(k, 0, NULL, &p), GMB_E_INVAL);
  ck_assert_ptr_null(p);
  ck_assert_int_eq(gmb__cache_alloc(k, (size_t)GMB_CACHE_MAX + 1, NULL, &p),
                   GMB_E_INVAL);
  ck_assert_uint_eq(be.allocs, 0);
  done(k);
}
END_TEST

START_TEST(free_unknown_twice_and_inside) {
  be_reset();
  struct gmb_cache *k = gmb__cache_new(&host_ops, 2);
  void *p, *q;
  ck_assert_int_eq(gmb__cache_alloc(k, 1000, NULL, &p), 0);
  ck_assert_int_eq(gmb__cache_alloc(k, 1000, NULL, &q), 0);
  int x;
  ck_assert_int_eq(gmb__cache_free(k, &x, NULL), GMB_E_NOENT);
  ck_assert_int_eq(gmb__cache_free(k, NULL, NULL), GMB_E_NOENT);
  /* Inside a handed-out block: not a block's start. */
  ck_assert_int_eq(gmb__cache_free(k, (char *)p + 512, NULL), GMB_E_NOENT);
  ck_assert_int_eq(gmb__cache_check(k), 0);
  ck_assert_int_eq(gmb__cache_free(k, q, NULL), 0);
  ck_assert_int_eq(gmb__cache_free(k, q, NULL), GMB_E_INVAL);
  ck_assert_int_eq(gmb__cache_check(k), 0);
  ck_assert_int_eq(gmb__cache_free(k, p, NULL), 0);
  ck_assert_int_eq(gmb__cache_free(k, p, NULL), GMB_E_INVAL);
  ck_assert_int_eq(gmb__cache_check(k), 0);
  done(k);
}
END_TEST

/* A stream that takes no event (destroyed): the block stays handed out,
 * and a free on a live stream then works. */
START_TEST(free_on_destroyed_stream) {
  be_reset();
  struct gmb_cache *k = gmb__cache_new(&stream_ops, 1);
  struct fake_stream s = {0}, dead = {.destroyed = 1};
  void *p;
  ck_assert_int_eq(gmb__cache_alloc(k, 4096, &s, &p), 0);
  ck_assert_int_eq(gmb__cache_free(k, p, &dead), GMB_E_INVAL);
  ck_assert_int_eq(gmb__cache_check(k), 0);
  struct gmb_cache_counters c;
  gmb__cache_counters(k, &c);
  ck_assert_uint_eq(c.in_use, 4096);
  ck_assert_int_eq(gmb__cache_free(k, p, &s), 0);
  ck_assert_int_eq(gmb__cache_check(k), 0);
  done(k);
}
END_TEST

/* --- slabs, hits, split and coalesce ---------------------------------- */

START_TEST(small_share_a_slab) {
  be_reset();
  struct gmb_cache *k = gmb__cache_new(&host_ops, 1);
  void *p[8];
  for (int i = 0; i < 8; i++) {
    ck_assert_int_eq(gmb__cache_alloc(k, 100 * 1024, NULL, &p[i]), 0);
    ck_assert_int_eq(gmb__cache_check(k), 0);
  }
  ck_assert_uint_eq(be.allocs, 1);
  for (int i = 1; i < 8; i++) ck_assert_ptr_ne(p[i], p[i - 1]);
  for (int i = 0; i < 8; i++) ck_assert_int_eq(gmb__cache_free(k, p[i], NULL), 0);
  ck_assert_int_eq(gmb__cache_check(k), 0);
  /* Wholly free again: one block, given back by a trim. */
  uint64_t rel = 0;
  ck_assert_int_eq(gmb__cache_trim(k, 0, &rel), 0);
  ck_assert_uint_eq(rel, GMB_CACHE_SMALL_SLAB);
  ck_assert_uint_eq(be.frees, 1);
  done(k);
}
END_TEST

START_TEST(large_own_slab_cached_and_split) {
  be_reset();
  struct gmb_cache *k = gmb__cache_new(&host_ops, 1);
  void *p, *q, *r;
  ck_assert_int_eq(gmb__cache_alloc(k, 8 * MIB, NULL, &p), 0);
  ck_assert_uint_eq(be.allocs, 1);
  ck_assert_uint_eq(be.size[1], 8 * MIB);
  ck_assert_int_eq(gmb__cache_free(k, p, NULL), 0);
  ck_assert_uint_eq(be.frees, 0); /* cached */
  ck_assert_uint_eq(gmb__cache_cached(k), 8 * MIB);
  /* Two large requests from the cached slab, no message; the second is
   * cut from the end of the rest, which follows q (cut_rest_beside_...). */
  ck_assert_int_eq(gmb__cache_alloc(k, 3 * MIB, NULL, &q), 0);
  ck_assert_int_eq(gmb__cache_alloc(k, 4 * MIB, NULL, &r), 0);
  ck_assert_int_eq(gmb__cache_check(k), 0);
  ck_assert_uint_eq(be.allocs, 1);
  ck_assert_ptr_eq(q, p);
  ck_assert_ptr_eq(r, (char *)p + 4 * MIB);
  /* A small request never takes from the large pool. */
  void *s;
  ck_assert_int_eq(gmb__cache_alloc(k, 4096, NULL, &s), 0);
  ck_assert_uint_eq(be.allocs, 2);
  ck_assert_int_eq(gmb__cache_free(k, r, NULL), 0);
  ck_assert_int_eq(gmb__cache_free(k, q, NULL), 0);
  ck_assert_int_eq(gmb__cache_free(k, s, NULL), 0);
  ck_assert_int_eq(gmb__cache_check(k), 0);
  struct gmb_cache_counters c;
  gmb__cache_counters(k, &c);
  ck_assert_uint_eq(c.hits, 2);
  ck_assert_uint_eq(c.misses, 2);
  ck_assert_uint_eq(c.in_use, 0);
  ck_assert_uint_eq(c.cached, 8 * MIB + GMB_CACHE_SMALL_SLAB);
  ck_assert_uint_eq(c.peak_in_use, 8 * MIB); /* the first request */
  done(k);
}
END_TEST

/* A large request no cached slab can serve gives back the wholly free
 * large slabs smaller than it before asking for its own. */
START_TEST(large_miss_drops_smaller_free_slabs) {
  be_reset();
  struct gmb_cache *k = gmb__cache_new(&host_ops, 1);
  void *a, *b, *c;
  ck_assert_int_eq(gmb__cache_alloc(k, 2 * MIB, NULL, &a), 0);
  ck_assert_int_eq(gmb__cache_alloc(k, 3 * MIB, NULL, &b), 0);
  ck_assert_int_eq(gmb__cache_free(k, a, NULL), 0);
  /* b's slab is in use: it stays; a's is free and smaller than 4 MiB. */
  ck_assert_int_eq(gmb__cache_alloc(k, 4 * MIB, NULL, &c), 0);
  ck_assert_int_eq(gmb__cache_check(k), 0);
  ck_assert_uint_eq(be.frees, 1);
  ck_assert_uint_eq(be.held, 7 * MIB);
  /* A request the cache can serve drops nothing. */
  ck_assert_int_eq(gmb__cache_free(k, b, NULL), 0);
  void *d;
  ck_assert_int_eq(gmb__cache_alloc(k, 2 * MIB, NULL, &d), 0);
  ck_assert_uint_eq(be.frees, 1);
  ck_assert_int_eq(gmb__cache_free(k, c, NULL), 0);
  ck_assert_int_eq(gmb__cache_free(k, d, NULL), 0);
  done(k);
}
END_TEST

/* A block cut from a free block that ends its slab after a block in use
 * takes the slab's end, so that the rest lies beside that block: when it
 * is freed, the two make one hole, which serves a request neither could
 * alone. */
START_TEST(cut_rest_beside_the_block_in_use) {
  be_reset();
  struct gmb_cache *k = gmb__cache_new(&host_ops, 1);
  void *p, *q, *r, *s;
  ck_assert_int_eq(gmb__cache_alloc(k, 8 * MIB, NULL, &p), 0);
  ck_assert_int_eq(gmb__cache_free(k, p, NULL), 0);
  ck_assert_int_eq(gmb__cache_alloc(k, 3 * MIB, NULL, &q), 0);
  ck_assert_int_eq(gmb__cache_alloc(k, 4 * MIB, NULL, &r), 0);
  /* [q 3][rest 1][r 4], not [q 3][r 4][rest 1]. */
  ck_assert_ptr_eq(q, p);
  ck_assert_ptr_eq(r, (char *)p + 4 * MIB);
  ck_assert_int_eq(gmb__cache_free(k, q, NULL), 0);
  ck_assert_int_eq(gmb__cache_check(k), 0);
  /* q's 3 MiB and the rest's 1 MiB: one free block of 4 MiB. */
  ck_assert_int_eq(gmb__cache_alloc(k, 4 * MIB, NULL, &s), 0);
  ck_assert_ptr_eq(s, p);
  ck_assert_uint_eq(be.allocs, 1);
  ck_assert_int_eq(gmb__cache_free(k, r, NULL), 0);
  ck_assert_int_eq(gmb__cache_free(k, s, NULL), 0);
  done(k);
}
END_TEST

/* A request that fits both a hole of a slab in use and a wholly free slab
 * takes the hole, even when the free slab fits it better: the free slab
 * stays whole, to be given back. */
START_TEST(slab_in_use_before_wholly_free) {
  be_reset();
  struct gmb_cache *k = gmb__cache_new(&host_ops, 1);
  void *x, *y, *z, *w;
  ck_assert_int_eq(gmb__cache_alloc(k, 8 * MIB, NULL, &x), 0);
  ck_assert_int_eq(gmb__cache_alloc(k, 4 * MIB, NULL, &z), 0);
  ck_assert_int_eq(gmb__cache_free(k, x, NULL), 0);
  ck_assert_int_eq(gmb__cache_alloc(k, 3 * MIB, NULL, &y), 0);
  ck_assert_ptr_eq(y, x); /* x's slab was the only one free */
  ck_assert_int_eq(gmb__cache_free(k, z, NULL), 0);
  /* 4 MiB: z's slab (wholly free, 4 MiB) or x's hole (5 MiB). */
  ck_assert_int_eq(gmb__cache_alloc(k, 4 * MIB, NULL, &w), 0);
  ck_assert_ptr_eq(w, (char *)x + 4 * MIB);
  ck_assert_uint_eq(be.allocs, 2);
  ck_assert_int_eq(gmb__cache_check(k), 0);
  /* z's slab is still whole: the trim gives it back. */
  uint64_t rel = 0;
  ck_assert_int_eq(gmb__cache_trim(k, 0, &rel), 0);
  ck_assert_uint_eq(rel, 4 * MIB);
  ck_assert_int_eq(gmb__cache_free(k, y, NULL), 0);
  ck_assert_int_eq(gmb__cache_free(k, w, NULL), 0);
  done(k);
}
END_TEST

/* The slack (GMB_CACHE_SLACK_PCT, GMB_CACHE_SLACK_FLOOR): after every
 * miss, while wholly free slabs are left, the cache holds at most the
 * slack over its peak of bytes in use.  64 MiB of large slabs are cached
 * and free; then small requests, which they cannot serve, ask for new
 * slabs: the large ones go back, largest first, as the small pool
 * grows past the slack, and only as far as it must. */
START_TEST(miss_gives_back_past_the_slack) {
  be_reset();
  struct gmb_cache *k = gmb__cache_new(&host_ops, 1);
  void *big[8], *small[40];
  for (int i = 0; i < 8; i++)
    ck_assert_int_eq(gmb__cache_alloc(k, 8 * MIB, NULL, &big[i]), 0);
  for (int i = 0; i < 8; i++)
    ck_assert_int_eq(gmb__cache_free(k, big[i], NULL), 0);
  struct gmb_cache_counters c;
  gmb__cache_counters(k, &c);
  ck_assert_uint_eq(c.peak_in_use, 64 * MIB);
  ck_assert_uint_eq(c.cached, 64 * MIB);
  const uint64_t cap = 64 * MIB + 64 * MIB / 100 * GMB_CACHE_SLACK_PCT +
                       GMB_CACHE_SLACK_FLOOR;
  for (int i = 0; i < 40; i++) {
    unsigned frees = be.frees;
    ck_assert_int_eq(gmb__cache_alloc(k, 1 * MIB, NULL, &small[i]), 0);
    gmb__cache_counters(k, &c);
    ck_assert_uint_eq(c.peak_in_use, 64 * MIB);
    ck_assert_uint_le(c.slab_bytes, cap);
    /* No more went back than needed: one slab fewer would not do. */
    if (be.frees > frees) {
      ck_assert_uint_eq(be.frees, frees + 1);
      ck_assert_uint_gt(c.slab_bytes + 8 * MIB, cap);
    }
    ck_assert_int_eq(gmb__cache_check(k), 0);
  }
  /* 40 MiB of small slabs beside 64 MiB: 3 of the 8 large went back. */
  ck_assert_uint_eq(c.slab_bytes, 40 * MIB + 5 * 8 * MIB);
  ck_assert_uint_eq(be.frees, 3);
  for (int i = 0; i < 40; i++)
    ck_assert_int_eq(gmb__cache_free(k, small[i], NULL), 0);
  done(k);
}
END_TEST

/* Steady state: the same pattern again makes no backend call. */
START_TEST(hit_makes_no_backend_call) {
  be_reset();
  struct gmb_cache *k = gmb__cache_new(&host_ops, 1);
  static const size_t sizes[] = {512, 3000, 65536, 1 << 20, 3 << 20, 777};
  void *p[6];
  for (int round = 0; round < 3; round++) {
    for (int i = 0; i < 6; i++)
      ck_assert_int_eq(gmb__cache_alloc(k, sizes[i], NULL, &p[i]), 0);
    for (int i = 5; i >= 0; i--) ck_assert_int_eq(gmb__cache_free(k, p[i], NULL), 0);
    ck_assert_int_eq(gmb__cache_check(k), 0);
    if (round == 0) be_reset();
  }
  ck_assert_uint_eq(be.allocs, 0);
  ck_assert_uint_eq(be.frees, 0);
  done(k);
}
END_TEST

/* --- streams ------------------------------------------------------------ */

START_TEST(same_stream_reuses_at_once) {
  be_reset();
  struct gmb_cache *k = gmb__cache_new(&stream_ops, 1);
  struct fake_stream s = {0};
  void *p, *q;
  ck_assert_int_eq(gmb__cache_alloc(k, 8192, &s, &p), 0);
  ck_assert_int_eq(gmb__cache_free(k, p, &s), 0);
  ck_assert_uint_eq(be.records, 1);
  /* Not completed, but the same stream: reused at once, no query. */
  ck_assert_int_eq(gmb__cache_alloc(k, 8192, &s, &q), 0);
  ck_assert_ptr_eq(q, p);
  ck_assert_uint_eq(be.queries, 0);
  ck_assert_int_eq(gmb__cache_free(k, q, &s), 0);
  done(k);
}
END_TEST

START_TEST(other_stream_waits_for_event) {
  be_reset();
  struct gmb_cache *k = gmb__cache_new(&stream_ops, 1);
  struct fake_stream s1 = {0}, s2 = {0};
  void *p, *q, *r;
  ck_assert_int_eq(gmb__cache_alloc(k, 4 * MIB, &s1, &p), 0);
  ck_assert_int_eq(gmb__cache_free(k, p, &s1), 0);
  /* s1's work is not done: s2 must not get the block. */
  ck_assert_int_eq(gmb__cache_alloc(k, 4 * MIB, &s2, &q), 0);
  ck_assert_ptr_ne(q, p);
  ck_assert_uint_eq(be.allocs, 2);
  ck_assert_int_eq(gmb__cache_check(k), 0);
  /* Once it completed, s2 may. */
  s1.completed = s1.recorded;
  ck_assert_int_eq(gmb__cache_alloc(k, 4 * MIB, &s2, &r), 0);
  ck_assert_ptr_eq(r, p);
  ck_assert_uint_eq(be.allocs, 2);
  ck_assert_int_eq(gmb__cache_free(k, q, &s2), 0);
  ck_assert_int_eq(gmb__cache_free(k, r, &s2), 0);
  ck_assert_int_eq(gmb__cache_check(k), 0);
  /* A trim gives back only what no stream may still use. */
  uint64_t rel = 0;
  ck_assert_int_eq(gmb__cache_trim(k, 0, &rel), 0);
  ck_assert_uint_eq(rel, 0);
  s2.completed = s2.recorded;
  ck_assert_int_eq(gmb__cache_trim(k, 0, &rel), 0);
  ck_assert_uint_eq(rel, 8 * MIB);
  done(k);
}
END_TEST

/* Neighbours freed on different streams do not merge while both wait;
 * once one completed they do. */
START_TEST(merge_across_streams_after_event) {
  be_reset();
  struct gmb_cache *k = gmb__cache_new(&stream_ops, 1);
  struct fake_stream s1 = {0}, s2 = {0};
  void *a, *b;
  ck_assert_int_eq(gmb__cache_alloc(k, 64 * 1024, &s1, &a), 0);
  ck_assert_int_eq(gmb__cache_alloc(k, 64 * 1024, &s1, &b), 0);
  ck_assert_int_eq(gmb__cache_free(k, a, &s1), 0);
  ck_assert_int_eq(gmb__cache_free(k, b, &s2), 0);
  ck_assert_int_eq(gmb__cache_check(k), 0);
  s1.completed = s1.recorded;
  s2.completed = s2.recorded;
  uint64_t rel = 0;
  ck_assert_int_eq(gmb__cache_trim(k, 0, &rel), 0);
  ck_assert_uint_eq(rel, GMB_CACHE_SMALL_SLAB);
  done(k);
}
END_TEST

/* CUDA's names for the default streams (cuda.h). */
#define LEGACY ((void *)(uintptr_t)0x1)
#define PER_THREAD ((void *)(uintptr_t)0x2)

/* NULL and CU_STREAM_LEGACY are one stream: freed on one, reused at once
 * on the other. */
START_TEST(legacy_stream_is_null) {
  be_reset();
  struct gmb_cache *k = gmb__cache_new(&stream_ops, 1);
  void *p, *q;
  ck_assert_int_eq(gmb__cache_alloc(k, 8192, NULL, &p), 0);
  ck_assert_int_eq(gmb__cache_free(k, p, LEGACY), 0);
  ck_assert_int_eq(gmb__cache_alloc(k, 8192, NULL, &q), 0);
  ck_assert_ptr_eq(q, p);
  ck_assert_uint_eq(be.queries, 0);
  ck_assert_int_eq(gmb__cache_free(k, q, NULL), 0);
  legacy.completed = legacy.recorded;
  done(k);
}
END_TEST

/* The per-thread default stream is another stream on every thread: a
 * block freed on it by one thread waits for its event before another
 * thread's per-thread stream may have it; the freeing thread reuses it at
 * once. */
static void *other_thread_alloc(void *arg) {
  void **out = arg;
  if (gmb__cache_alloc(out[0], 4 * MIB, PER_THREAD, &out[1])) out[1] = NULL;
  return NULL;
}

START_TEST(per_thread_stream_is_per_thread) {
  be_reset();
  struct gmb_cache *k = gmb__cache_new(&stream_ops, 1);
  void *p, *q;
  ck_assert_int_eq(gmb__cache_alloc(k, 4 * MIB, PER_THREAD, &p), 0);
  ck_assert_int_eq(gmb__cache_free(k, p, PER_THREAD), 0);
  void *arg[2] = {k, NULL};
  pthread_t t;
  pthread_create(&t, NULL, other_thread_alloc, arg);
  pthread_join(t, NULL);
  ck_assert_ptr_nonnull(arg[1]);
  ck_assert_ptr_ne(arg[1], p); /* this thread's stream has not run yet */
  ck_assert_int_eq(gmb__cache_alloc(k, 4 * MIB, PER_THREAD, &q), 0);
  ck_assert_ptr_eq(q, p); /* its own stream: at once */
  ck_assert_int_eq(gmb__cache_free(k, q, PER_THREAD), 0);
  ck_assert_int_eq(gmb__cache_free(k, arg[1], PER_THREAD), 0);
  ck_assert_int_eq(gmb__cache_check(k), 0);
  per_thread.completed = per_thread.recorded;
  done(k);
}
END_TEST

/* record_stream: a block used on s2 too is reused by no stream, its own
 * included, until s2 ran past the free; then as any block freed on s1. */
START_TEST(record_stream_waits_for_other_stream) {
  be_reset();
  struct gmb_cache *k = gmb__cache_new(&stream_ops, 1);
  struct fake_stream s1 = {0}, s2 = {0};
  void *p, *q, *r;
  ck_assert_int_eq(gmb__cache_alloc(k, 64 * 1024, &s1, &p), 0);
  ck_assert_int_eq(gmb__cache_record_stream(k, p, &s2), 0);
  ck_assert_int_eq(gmb__cache_record_stream(k, p, &s2), 0); /* once */
  ck_assert_int_eq(gmb__cache_record_stream(k, p, &s1), 0); /* its own */
  ck_assert_int_eq(gmb__cache_free(k, p, &s1), 0);
  ck_assert_uint_eq(be.records, 2); /* s2, then the free's on s1 */
  ck_assert_int_eq(gmb__cache_check(k), 0);
  /* Pending: counted as in use, not as cached, not given back. */
  struct gmb_cache_counters c;
  gmb__cache_counters(k, &c);
  ck_assert_uint_eq(c.in_use, 64 * 1024);
  ck_assert_uint_eq(gmb__cache_cached(k), GMB_CACHE_SMALL_SLAB - 64 * 1024);
  ck_assert_int_eq(gmb__cache_free(k, p, &s1), GMB_E_INVAL); /* twice */
  ck_assert_int_eq(gmb__cache_record_stream(k, p, &s2), GMB_E_INVAL);
  ck_assert_int_eq(gmb__cache_alloc(k, 64 * 1024, &s1, &q), 0);
  ck_assert_ptr_ne(q, p); /* not even on s1 */
  ck_assert_int_eq(gmb__cache_alloc(k, 64 * 1024, &s2, &r), 0);
  ck_assert_ptr_ne(r, p);
  ck_assert_int_eq(gmb__cache_free(k, r, &s2), 0);
  /* s1 done is not enough. */
  s1.completed = s1.recorded;
  ck_assert_int_eq(gmb__cache_alloc(k, 64 * 1024, &s1, &r), 0);
  ck_assert_ptr_ne(r, p);
  ck_assert_int_eq(gmb__cache_free(k, r, &s1), 0);
  /* s2 ran past the free: p is a block freed on s1 like any other. */
  s2.completed = s2.recorded;
  ck_assert_int_eq(gmb__cache_alloc(k, 64 * 1024, &s1, &r), 0);
  ck_assert_ptr_eq(r, p);
  ck_assert_int_eq(gmb__cache_check(k), 0);
  ck_assert_int_eq(gmb__cache_free(k, r, &s1), 0);
  ck_assert_int_eq(gmb__cache_free(k, q, &s1), 0);
  s1.completed = s1.recorded;
  s2.completed = s2.recorded;
  ck_assert_int_eq(gmb__cache_trim(k, 0, NULL), 0);
  ck_assert_uint_eq(be.held, 0);
  done(k);
}
END_TEST

/* The trim gives back a slab whose pending block's streams ran, and not
 * one whose did not; destroying a cache with a pending block leaks no
 * event. */
START_TEST(record_stream_trim_and_destroy) {
  be_reset();
  struct gmb_cache *k = gmb__cache_new(&stream_ops, 1);
  struct fake_stream s1 = {0}, s2 = {0}, s3 = {0};
  void *p, *q;
  ck_assert_int_eq(gmb__cache_alloc(k, 4 * MIB, &s1, &p), 0);
  ck_assert_int_eq(gmb__cache_alloc(k, 4 * MIB, &s1, &q), 0);
  ck_assert_int_eq(gmb__cache_record_stream(k, p, &s2), 0);
  ck_assert_int_eq(gmb__cache_record_stream(k, p, &s3), 0);
  ck_assert_int_eq(gmb__cache_record_stream(k, q, &s2), 0);
  ck_assert_int_eq(gmb__cache_free(k, p, &s1), 0);
  ck_assert_int_eq(gmb__cache_free(k, q, &s1), 0);
  s1.completed = s1.recorded;
  s2.completed = s2.recorded;
  uint64_t rel = 0;
  ck_assert_int_eq(gmb__cache_trim(k, 0, &rel), 0);
  ck_assert_uint_eq(rel, 4 * MIB); /* q's; p still waits for s3 */
  ck_assert_int_eq(gmb__cache_check(k), 0);
  done(k); /* p pending: its events freed all the same */
}
END_TEST

/* record_stream's refusals change nothing; on a cache without events it
 * is accepted and means nothing. */
START_TEST(record_stream_errors) {
  be_reset();
  struct gmb_cache *k = gmb__cache_new(&stream_ops, 1);
  struct fake_stream s1 = {0}, dead = {.destroyed = 1};
  void *p;
  int x;
  ck_assert_int_eq(gmb__cache_record_stream(k, &x, &s1), GMB_E_NOENT);
  ck_assert_int_eq(gmb__cache_alloc(k, 4096, &s1, &p), 0);
  ck_assert_int_eq(gmb__cache_record_stream(k, p, PER_THREAD), GMB_E_INVAL);
  /* A recorded stream that takes no event at the free: the block stays
   * handed out (its free's own event is not recorded either). */
  ck_assert_int_eq(gmb__cache_record_stream(k, p, &dead), 0);
  ck_assert_int_eq(gmb__cache_free(k, p, &s1), GMB_E_INVAL);
  ck_assert_uint_eq(be.records, 0);
  ck_assert_int_eq(gmb__cache_check(k), 0);
  struct gmb_cache_counters c;
  gmb__cache_counters(k, &c);
  ck_assert_uint_eq(c.in_use, 4096);
  dead.destroyed = 0; /* (a stream the test revives: the free goes on) */
  ck_assert_int_eq(gmb__cache_free(k, p, &s1), 0);
  done(k);
  struct gmb_cache *h = gmb__cache_new(&host_ops, 1);
  ck_assert_int_eq(gmb__cache_alloc(h, 4096, NULL, &p), 0);
  ck_assert_int_eq(gmb__cache_record_stream(h, p, &s1), 0);
  ck_assert_int_eq(gmb__cache_free(h, p, NULL), 0);
  ck_assert_int_eq(gmb__cache_alloc(h, 4096, NULL, &p), 0); /* at once */
  ck_assert_int_eq(gmb__cache_free(h, p, NULL), 0);
  done(h);
}
END_TEST

/* --- quotas ------------------------------------------------------------ */

START_TEST(quota_trims_and_retries_once) {
  be_reset();
  be.quota = 10 * MIB;
  struct gmb_cache *k = gmb__cache_new(&host_ops, 1);
  void *p, *q;
  ck_assert_int_eq(gmb__cache_alloc(k, 8 * MIB, NULL, &p), 0);
  ck_assert_int_eq(gmb__cache_free(k, p, NULL), 0);
  /* 8 MiB cached and free; 9 MiB needs a new slab, which passes the quota
   * until the cached one is given back. */
  ck_assert_int_eq(gmb__cache_alloc(k, 9 * MIB, NULL, &q), 0);
  ck_assert_uint_eq(be.frees, 1);
  ck_assert_uint_eq(be.held, 9 * MIB);
  ck_assert_int_eq(gmb__cache_check(k), 0);
  /* Nothing to give back: the quota's refusal is the answer. */
  void *r = (void *)1;
  ck_assert_int_eq(gmb__cache_alloc(k, 2 * MIB, NULL, &r), GMB_E_QUOTA);
  ck_assert_ptr_null(r);
  ck_assert_int_eq(gmb__cache_check(k), 0);
  ck_assert_int_eq(gmb__cache_free(k, q, NULL), 0);
  done(k);
}
END_TEST

START_TEST(trim_keeps_what_is_asked) {
  be_reset();
  struct gmb_cache *k = gmb__cache_new(&host_ops, 1);
  void *p[4];
  for (int i = 0; i < 4; i++)
    ck_assert_int_eq(gmb__cache_alloc(k, (size_t)(i + 2) * MIB, NULL, &p[i]), 0);
  for (int i = 0; i < 4; i++) ck_assert_int_eq(gmb__cache_free(k, p[i], NULL), 0);
  ck_assert_uint_eq(gmb__cache_cached(k), 14 * MIB);
  uint64_t rel = 0;
  /* Largest first: 5 MiB then 4 MiB go, leaving 5 MiB <= 6 MiB. */
  ck_assert_int_eq(gmb__cache_trim(k, 6 * MIB, &rel), 0);
  ck_assert_uint_eq(rel, 9 * MIB);
  ck_assert_uint_eq(gmb__cache_cached(k), 5 * MIB);
  ck_assert_int_eq(gmb__cache_check(k), 0);
  done(k);
}
END_TEST

/* Check reports every assertion that passes to its parent process (a
 * write per call): the stress loop asserts only when something failed. */
#define QUIET_MSG(cond, ...) \
  do {                       \
    if (!(cond)) ck_abort_msg(__VA_ARGS__); \
  } while (0)
#define QUIET_EQ(a, b) \
  QUIET_MSG((a) == (b), "%s:%d: %s != %s", __FILE__, __LINE__, #a, #b)
#define QUIET_LE(a, b) \
  QUIET_MSG((a) <= (b), "%s:%d: %s > %s", __FILE__, __LINE__, #a, #b)

/* --- seeded random stress ------------------------------------------------ */

struct live {
  unsigned char *p;
  size_t n;
  unsigned char tag;
  struct fake_stream *s;
  unsigned uses; /* streams recorded with gmb__cache_record_stream, a bit each */
};

/* Memory a stream's queued work may still touch: [p, p+n) until the
 * stream completed past `at`.  A block handed out on another stream must
 * not overlap one (the model of the GPU the events stand for). */
struct shadow {
  uintptr_t p;
  size_t n;
  struct fake_stream *s;
  uint64_t at;
};
#define NSHADOWS 4096
static struct shadow shadows[NSHADOWS];
static unsigned nshadows;

static void shadow_add(void *p, size_t n, struct fake_stream *s) {
  if (nshadows < NSHADOWS)
    shadows[nshadows++] = (struct shadow){(uintptr_t)p, n, s, s->recorded};
}

/* Drops what completed; returns the index of a shadow that forbids
 * handing [p, p+n) out on stream s, or -1. */
static int shadow_conflict(void *p, size_t n, struct fake_stream *s) {
  int hit = -1;
  unsigned k = 0;
  for (unsigned i = 0; i < nshadows; i++) {
    struct shadow *x = &shadows[i];
    if (x->s->completed >= x->at) continue;
    shadows[k++] = *x;
    if (x->s != s && x->p < (uintptr_t)p + n && (uintptr_t)p < x->p + x->n)
      hit = (int)k - 1;
  }
  nshadows = k;
  return hit;
}

static size_t stress_size(uint64_t *rng, uint64_t scale) {
  uint64_t r = gmb__splitmix64(rng);
  switch (r % 4) {
    case 0: return 1 + (size_t)(r >> 8) % 4096;
    case 1: return 1 + (size_t)(r >> 8) % (256 * 1024);
    case 2: return 1 + (size_t)(r >> 8) % (1 << 20);
    default: return 1 + (size_t)(r >> 8) % (size_t)(6 * MIB * scale);
  }
}

static void stress(const struct gmb_cache_ops *ops, uint64_t quota) {
  uint64_t seed = env_u64("SEED", 11), iter = env_u64("ITER", 20000);
  uint64_t scale = env_u64("SCALE", 1);
  be_reset();
  be.quota = quota;
  struct gmb_cache *k = gmb__cache_new(ops, 3);
  enum { NLIVE = 96, NSTREAMS = 3 };
  struct live live[NLIVE] = {{0}};
  struct fake_stream streams[NSTREAMS] = {{0}};
  int events = ops->event_record != NULL;
  uint64_t rng = seed;
  nshadows = 0;
  for (uint64_t step = 0; step < iter; step++) {
    uint64_t r = gmb__splitmix64(&rng);
    struct live *l = &live[r % NLIVE];
    struct fake_stream *s = &streams[(r >> 8) % NSTREAMS];
    unsigned op = (unsigned)(r >> 16) % 16;
    if (op == 0) {
      for (int i = 0; i < NSTREAMS; i++) streams[i].completed = streams[i].recorded;
    } else if (op == 1) {
      uint64_t keep = (r >> 24) % (32 * MIB);
      QUIET_EQ(gmb__cache_trim(k, keep, NULL), 0);
    } else if (l->p == NULL) {
      size_t n = stress_size(&rng, scale);
      void *p = NULL;
      int rc = gmb__cache_alloc(k, n, s, &p);
      if (rc) {
        QUIET_MSG(quota && rc == GMB_E_QUOTA, "step %llu: alloc %zu: %s",
                      (unsigned long long)step, n, gmb_err_name(rc));
        QUIET_EQ(p, NULL);
      } else {
        int c = events ? shadow_conflict(p, n, s) : -1;
        QUIET_MSG(c < 0, "step %llu: %p+%zu handed out on stream %d while "
                  "stream %d's work may use %#lx+%zu", (unsigned long long)step,
                  p, n, (int)(s - streams),
                  c < 0 ? -1 : (int)(shadows[c].s - streams),
                  c < 0 ? 0ul : (unsigned long)shadows[c].p,
                  c < 0 ? (size_t)0 : shadows[c].n);
        l->p = p;
        l->n = n;
        l->tag = (unsigned char)(step | 1);
        l->s = s;
        l->uses = 0;
        memset(p, l->tag, n);
      }
    } else if (events && op == 2) {
      /* Another stream uses it too (record_stream). */
      QUIET_EQ(gmb__cache_record_stream(k, l->p, s), 0);
      l->uses |= 1u << (s - streams);
      for (size_t i = 0; i < l->n; i += 509)
        QUIET_MSG(l->p[i] == l->tag, "step %llu: block %p overwritten",
                      (unsigned long long)step, (void *)l->p);
      QUIET_EQ(l->p[l->n - 1], l->tag);
      /* Usually on the stream it was used on, sometimes on another. */
      struct fake_stream *fs = (r >> 40) % 4 ? l->s : s;
      QUIET_EQ(gmb__cache_free(k, l->p, fs), 0);
      if (events) {
        shadow_add(l->p, l->n, fs);
        for (int i = 0; i < NSTREAMS; i++)
          if (l->uses & (1u << i)) shadow_add(l->p, l->n, &streams[i]);
      }
      if ((r >> 44) % 8 == 0)
        QUIET_EQ(gmb__cache_free(k, l->p, fs), GMB_E_INVAL);
      l->p = NULL;
    }
    int bad = gmb__cache_check(k);
    QUIET_MSG(bad == 0, "step %llu (seed %llu): %d violations",
                  (unsigned long long)step, (unsigned long long)seed, bad);
    if (quota) QUIET_LE(be.held, quota);
  }
  for (int i = 0; i < NLIVE; i++)
    if (live[i].p) QUIET_EQ(gmb__cache_free(k, live[i].p, live[i].s), 0);
  for (int i = 0; i < NSTREAMS; i++) streams[i].completed = streams[i].recorded;
  uint64_t rel = 0;
  QUIET_EQ(gmb__cache_trim(k, 0, &rel), 0);
  QUIET_EQ(gmb__cache_cached(k), 0);
  QUIET_EQ(gmb__cache_check(k), 0);
  done(k);
}

START_TEST(stress_host) { stress(&host_ops, 0); }
END_TEST

START_TEST(stress_streams) { stress(&stream_ops, 0); }
END_TEST

/* Every refusal under a quota is GMB_E_QUOTA, and the backend never
 * holds more than the quota. */
START_TEST(stress_quota) { stress(&host_ops, 40 * MIB); }
END_TEST

/* --- threads ----------------------------------------------------------- */

static struct gmb_cache *tk;
static atomic_int thread_bad;

static void *worker(void *arg) {
  uint64_t rng = (uint64_t)(uintptr_t)arg;
  void *held[32] = {0};
  size_t n[32] = {0};
  for (int i = 0; i < 20000; i++) {
    uint64_t r = gmb__splitmix64(&rng);
    int j = (int)(r % 32);
    if (held[j]) {
      if (((unsigned char *)held[j])[n[j] - 1] != (unsigned char)j)
        atomic_fetch_add(&thread_bad, 1);
      if (gmb__cache_free(tk, held[j], NULL)) atomic_fetch_add(&thread_bad, 1);
      held[j] = NULL;
    } else {
      n[j] = 1 + (size_t)(r >> 20) % (r % 7 == 0 ? 3 * MIB : 64 * 1024);
      if (gmb__cache_alloc(tk, n[j], NULL, &held[j]))
        atomic_fetch_add(&thread_bad, 1);
      else
        memset(held[j], j, n[j]);
    }
  }
  for (int j = 0; j < 32; j++)
    if (held[j] && gmb__cache_free(tk, held[j], NULL))
      atomic_fetch_add(&thread_bad, 1);
  return NULL;
}

START_TEST(threads_share_one_cache) {
  be_reset();
  tk = gmb__cache_new(&host_ops, 4);
  pthread_t t[4];
  for (uintptr_t i = 0; i < 4; i++)
    pthread_create(&t[i], NULL, worker, (void *)(i + 1));
  for (int i = 0; i < 4; i++) pthread_join(t[i], NULL);
  ck_assert_int_eq(atomic_load(&thread_bad), 0);
  struct gmb_cache_counters c;
  gmb__cache_counters(tk, &c);
  ck_assert_uint_eq(c.in_use, 0);
  ck_assert_uint_gt(c.hits, c.misses);
  done(tk);
}
END_TEST

static Suite *suite(void) {
  Suite *s = suite_create("cache");
  TCase *t = tcase_create("cache");
  tcase_set_timeout(t, 120);
  tcase_add_test(t, alloc_zero_and_too_big);
  tcase_add_test(t, free_unknown_twice_and_inside);
  tcase_add_test(t, free_on_destroyed_stream);
  tcase_add_test(t, small_share_a_slab);
  tcase_add_test(t, large_own_slab_cached_and_split);
  tcase_add_test(t, hit_makes_no_backend_call);
  tcase_add_test(t, large_miss_drops_smaller_free_slabs);
  tcase_add_test(t, cut_rest_beside_the_block_in_use);
  tcase_add_test(t, slab_in_use_before_wholly_free);
  tcase_add_test(t, miss_gives_back_past_the_slack);
  tcase_add_test(t, same_stream_reuses_at_once);
  tcase_add_test(t, other_stream_waits_for_event);
  tcase_add_test(t, merge_across_streams_after_event);
  tcase_add_test(t, legacy_stream_is_null);
  tcase_add_test(t, per_thread_stream_is_per_thread);
  tcase_add_test(t, record_stream_waits_for_other_stream);
  tcase_add_test(t, record_stream_trim_and_destroy);
  tcase_add_test(t, record_stream_errors);
  tcase_add_test(t, quota_trims_and_retries_once);
  tcase_add_test(t, trim_keeps_what_is_asked);
  tcase_add_test(t, stress_host);
  tcase_add_test(t, stress_streams);
  tcase_add_test(t, stress_quota);
  tcase_add_test(t, threads_share_one_cache);
  suite_add_tcase(s, t);
  return s;
}

int main(void) {
  /* Slabs stay in malloc's heap once freed: without this, every large
   * slab is a fresh mmap whose pages fault in again (seconds of system
   * time over the stress). */
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  return check_run(suite());
}
