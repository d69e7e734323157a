/*
 * check_cache.c - the client's stream-ordered cache alone (cache.c), over
 * a backend of host memory and of events that the test completes by hand.
 *
 * The backend plays the broker and the process's address space: it
 * reserves ranges (PROT_NONE), maps pages of anonymous memory at the
 * addresses the cache asks for, moves them (mremap) and unmaps them, and
 * keeps its own table of every page it handed out: where it is mapped and
 * whether it was given back.  It counts its calls (a hit must make none),
 * holds a quota of page bytes (refusing with GMB_E_QUOTA past it, as the
 * broker does) and checks each call against its table (a page unmapped at
 * the wrong address, freed while mapped, moved onto a mapped page, is a
 * failure).  Streams: a stream is a counter of records and a counter of
 * what completed; an event is done once its stream completed past its
 * record.
 *
 * gmb__cache_check runs after every step and must find nothing, and the
 * pages the cache says it maps must be exactly the backend's.  The random
 * stress writes a pattern into every block it holds and checks it at the
 * free, so two live blocks that overlap, or a page moved or given back
 * from under a live block, are caught.
 *
 * Knobs: SEED, ITER (stress steps, default 20000), SCALE (multiplies the
 * sizes' range).
 */
#include <check.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "cache.h"
#include "check_main.h"
#include "gmb.h"
#include "util.h"

#define MIB (UINT64_C(1) << 20)
#define PAGE GMB_CACHE_PAGE
/* Small spans, so that the stress also crosses from one span to another
 * and meets requests larger than a span. */
#define TEST_SPAN (64 * MIB)

/* --- the backend ------------------------------------------------------ */

#define MAX_PAGES 8192
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
  uintptr_t at[MAX_PAGES]; /* id -> where it is mapped (0: not mapped) */
  int live[MAX_PAGES];     /* id handed out and not given back */
  uint64_t quota, held;
  unsigned max_pages; /* 0: none; else GMB_E_NOMEM past it (seg_max) */
  unsigned maps, unmaps, frees, moves, records, queries, syncs;
  unsigned requests; /* messages: a batch of maps or frees is one */
  uint64_t ahead[8];  /* the first requests' `ahead`, in order */
  unsigned reserves, unreserves;
  int events_live;
  int bad; /* calls that broke the backend's contract */
  struct gmb_cache *watch; /* when set: its holes at each page request */
  uint64_t holes_seen;
} be = {.mu = PTHREAD_MUTEX_INITIALIZER};

static void be_misuse(const char *what, uint64_t id, uintptr_t addr) {
  fprintf(stderr, "backend misuse: %s (page %llu at %#lx)\n", what,
          (unsigned long long)id, (unsigned long)addr);
  be.bad++;
}

static int be_reserve(void *ctx, uint64_t size, uintptr_t *base) {
  (void)ctx;
  char *p = mmap(NULL, size + PAGE, PROT_NONE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return GMB_E_NOMEM;
  uintptr_t b = ((uintptr_t)p + PAGE - 1) & ~(uintptr_t)(PAGE - 1);
  if (b > (uintptr_t)p) munmap(p, b - (uintptr_t)p);
  uintptr_t e = (uintptr_t)p + size + PAGE;
  if (e > b + size) munmap((void *)(b + size), e - (b + size));
  *base = b;
  pthread_mutex_lock(&be.mu);
  be.reserves++;
  pthread_mutex_unlock(&be.mu);
  return 0;
}

static void be_unreserve(void *ctx, uintptr_t base, uint64_t size) {
  (void)ctx;
  pthread_mutex_lock(&be.mu);
  for (int i = 1; i < MAX_PAGES; i++)
    if (be.at[i] >= base && be.at[i] < base + size)
      be_misuse("reservation given back with a page mapped", (uint64_t)i,
                be.at[i]);
  be.unreserves++;
  pthread_mutex_unlock(&be.mu);
  munmap((void *)base, size);
}

/* One page at addr: 0, or the broker's refusal with nothing mapped.
 * Under be.mu. */
static int be_map_one(uintptr_t addr, struct gmb_cache_page *pg) {
  if (addr % PAGE) be_misuse("map at a misaligned address", 0, addr);
  for (int i = 1; i < MAX_PAGES; i++)
    if (be.at[i] == addr) be_misuse("map over a mapped page", (uint64_t)i, addr);
  if (be.quota && be.held + PAGE > be.quota) return GMB_E_QUOTA;
  /* the broker's segment cap (its descriptor budget) */
  if (be.max_pages && be.held / PAGE >= be.max_pages) return GMB_E_NOMEM;
  int i = 1;
  while (i < MAX_PAGES && be.live[i]) i++;
  if (i == MAX_PAGES ||
      mmap((void *)addr, PAGE, PROT_READ | PROT_WRITE,
           MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) == MAP_FAILED)
    return GMB_E_NOMEM;
  be.live[i] = 1;
  be.at[i] = addr;
  be.held += PAGE;
  be.maps++;
  pg->id = (uint64_t)i;
  pg->h = (uint64_t)i * 7; /* a handle of the backend's own */
  return 0;
}

static void be_unmap_locked(uintptr_t addr, const struct gmb_cache_page *pg);
static void be_free_locked(const struct gmb_cache_page *pg);

/* n pages in one request, all or none, as the broker gives them. */
static int be_map(void *ctx, uintptr_t addr, unsigned n, uint64_t ahead,
                  struct gmb_cache_page *pg) {
  (void)ctx;
  pthread_mutex_lock(&be.mu);
  if (be.requests < 8) be.ahead[be.requests] = ahead;
  be.requests++;
  if (be.watch) be.holes_seen = gmb__cache_holes(be.watch);
  if (n == 0 || n > GMB_CACHE_BATCH) be_misuse("a batch of pages", n, addr);
  int rc = 0;
  unsigned i = 0;
  for (; i < n && rc == 0; i++) rc = be_map_one(addr + i * PAGE, &pg[i]);
  if (rc)
    for (unsigned j = 0; j + 1 < i; j++) {
      be_unmap_locked(addr + j * PAGE, &pg[j]);
      be_free_locked(&pg[j]);
    }
  pthread_mutex_unlock(&be.mu);
  return rc;
}

static void be_unmap_locked(uintptr_t addr, const struct gmb_cache_page *pg) {
  uint64_t i = pg->id;
  if (i == 0 || i >= MAX_PAGES || !be.live[i] || be.at[i] != addr ||
      pg->h != i * 7)
    be_misuse("unmap of a page not mapped there", i, addr);
  else
    be.at[i] = 0;
  be.unmaps++;
  mmap((void *)addr, PAGE, PROT_NONE,
       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
}

static void be_unmap(void *ctx, uintptr_t addr,
                     const struct gmb_cache_page *pg) {
  (void)ctx;
  pthread_mutex_lock(&be.mu);
  be_unmap_locked(addr, pg);
  pthread_mutex_unlock(&be.mu);
}

static void be_free_locked(const struct gmb_cache_page *pg) {
  uint64_t i = pg->id;
  if (i == 0 || i >= MAX_PAGES || !be.live[i] || be.at[i])
    be_misuse("free of a page not live or still mapped", i, 0);
  else {
    be.live[i] = 0;
    be.held -= PAGE;
    be.frees++;
  }
}

/* n pages in one message. */
static void be_free(void *ctx, const struct gmb_cache_page *pg, unsigned n) {
  (void)ctx;
  pthread_mutex_lock(&be.mu);
  be.requests++;
  if (n == 0 || n > GMB_CACHE_BATCH) be_misuse("a batch of pages", n, 0);
  for (unsigned i = 0; i < n; i++) be_free_locked(&pg[i]);
  pthread_mutex_unlock(&be.mu);
}

static int be_move(void *ctx, uintptr_t from, uintptr_t to,
                   struct gmb_cache_page *pg) {
  (void)ctx;
  pthread_mutex_lock(&be.mu);
  uint64_t i = pg->id;
  if (i == 0 || i >= MAX_PAGES || !be.live[i] || be.at[i] != from)
    be_misuse("move of a page not mapped there", i, from);
  for (int j = 1; j < MAX_PAGES; j++)
    if (be.at[j] == to) be_misuse("move onto a mapped page", (uint64_t)j, to);
  be.at[i] = to;
  be.moves++;
  pthread_mutex_unlock(&be.mu);
  if (mremap((void *)from, PAGE, PAGE, MREMAP_MAYMOVE | MREMAP_FIXED,
             (void *)to) == MAP_FAILED)
    return GMB_E_SYSTEM;
  mmap((void *)from, PAGE, PROT_NONE,
       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
  return 0;
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
static int be_sync(void *ctx) {
  (void)ctx;
  be.syncs++;
  return 0;
}

#define BACKEND                                                        \
  .span = TEST_SPAN, .reserve = be_reserve, .unreserve = be_unreserve, \
  .page_map = be_map, .page_unmap = be_unmap, .page_free = be_free
static const struct gmb_cache_ops host_ops = {BACKEND, .page_move = be_move};
/* Without page_move: idle pages go back and new ones are asked for. */
static const struct gmb_cache_ops nomove_ops = {BACKEND};
static const struct gmb_cache_ops stream_ops = {
    BACKEND, .page_move = be_move, .event_new = ev_new,
    .event_record = ev_record, .event_query = ev_query,
    .event_destroy = ev_destroy, .sync = be_sync};

#define LEGACY ((void *)(uintptr_t)1)
#define PER_THREAD ((void *)(uintptr_t)2)

static void be_reset(void) {
  be.quota = 0;
  be.max_pages = 0;
  be.maps = be.unmaps = be.frees = be.moves = be.records = be.queries = 0;
  be.requests = 0;
  be.syncs = be.reserves = be.unreserves = 0;
  be.bad = 0;
  be.watch = NULL;
}

/* The cache's pages against the backend's table: every page the cache
 * says it maps is live and mapped there, and the backend maps no other. */
struct page_seen {
  unsigned n, wrong;
};
static int page_seen_fn(void *arg, uintptr_t addr,
                        const struct gmb_cache_page *pg) {
  struct page_seen *ps = arg;
  ps->n++;
  if (pg->id == 0 || pg->id >= MAX_PAGES || !be.live[pg->id] ||
      be.at[pg->id] != addr)
    ps->wrong++;
  return 0;
}

/* 0 when the cache and the backend agree on every page. */
static int pages_agree(struct gmb_cache *k) {
  struct page_seen ps = {0, 0};
  gmb__cache_pages(k, page_seen_fn, &ps);
  unsigned mapped = 0;
  for (int i = 1; i < MAX_PAGES; i++) mapped += be.at[i] != 0;
  return ps.wrong + (ps.n != mapped) + be.bad;
}

static struct gmb_cache_counters counters(struct gmb_cache *k) {
  struct gmb_cache_counters c;
  gmb__cache_counters(k, &c);
  return c;
}

/* Destroys the cache after giving every idle page back; nothing may leak:
 * every page unmapped, every reservation given back, every event freed. */
static void done(struct gmb_cache *k) {
  ck_assert_int_eq(gmb__cache_check(k), 0);
  ck_assert_int_eq(pages_agree(k), 0);
  gmb__cache_destroy(k);
  for (int i = 1; i < MAX_PAGES; i++) {
    ck_assert_uint_eq(be.at[i], 0);
    be.live[i] = 0; /* what the session's end frees in the broker */
  }
  ck_assert_uint_eq(be.reserves, be.unreserves);
  ck_assert_int_eq(be.events_live, 0);
  ck_assert_int_eq(be.bad, 0);
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
  ck_assert_uint_eq(be.maps, 0);
  done(k);
}
END_TEST

/* A backend without its functions, or a page size that is not a power of
 * two, makes no cache. */
START_TEST(new_refuses_bad_ops) {
  struct gmb_cache_ops o = host_ops;
  o.page_free = NULL;
  ck_assert_ptr_null(gmb__cache_new(&o, 1));
  o = host_ops;
  o.page = 3 * MIB;
  ck_assert_ptr_null(gmb__cache_new(&o, 1));
  o = host_ops;
  o.span = PAGE + 512;
  ck_assert_ptr_null(gmb__cache_new(&o, 1));
  o = stream_ops;
  o.event_query = NULL;
  ck_assert_ptr_null(gmb__cache_new(&o, 1));
}
END_TEST

/* A pointer inside a block, one never handed out, a second free and a
 * free after the block's page went back: errors that change nothing. */
START_TEST(free_unknown_twice_inside_and_after_trim) {
  be_reset();
  struct gmb_cache *k = gmb__cache_new(&host_ops, 2);
  void *p, *q, *big;
  int x;
  ck_assert_int_eq(gmb__cache_alloc(k, 1000, NULL, &p), 0);
  ck_assert_int_eq(gmb__cache_alloc(k, 1000, NULL, &q), 0);
  ck_assert_int_eq(gmb__cache_free(k, &x, NULL), GMB_E_NOENT);
  ck_assert_int_eq(gmb__cache_free(k, NULL, NULL), GMB_E_NOENT);
  ck_assert_int_eq(gmb__cache_free(k, (char *)p + 512, NULL), GMB_E_NOENT);
  ck_assert_int_eq(gmb__cache_check(k), 0);
  ck_assert_int_eq(gmb__cache_free(k, q, NULL), 0);
  ck_assert_int_eq(gmb__cache_free(k, q, NULL), GMB_E_INVAL);
  ck_assert_int_eq(gmb__cache_check(k), 0);
  ck_assert_int_eq(gmb__cache_free(k, p, NULL), 0);
  ck_assert_int_eq(gmb__cache_free(k, p, NULL), GMB_E_INVAL);
  /* A block of many pages, freed and trimmed: its address is given-back
   * memory now, and freeing it again is a double free, not a crash. */
  ck_assert_int_eq(gmb__cache_alloc(k, 9 * MIB, NULL, &big), 0);
  ck_assert_int_eq(gmb__cache_free(k, big, NULL), 0);
  uint64_t rel = 0;
  ck_assert_int_eq(gmb__cache_trim(k, 0, 0, &rel), 0);
  ck_assert_uint_gt(rel, 0);
  ck_assert_int_eq(gmb__cache_free(k, big, NULL), GMB_E_INVAL);
  ck_assert_int_eq(gmb__cache_free(k, (char *)big + 4 * MIB, NULL),
                   GMB_E_INVAL);
  ck_assert_int_eq(gmb__cache_check(k), 0);
  done(k);
}
END_TEST

/* --- pages ------------------------------------------------------------- */

/* Small blocks share a page; every page goes back once nothing lies on
 * it. */
START_TEST(small_blocks_share_a_page) {
  be_reset();
  struct gmb_cache *k = gmb__cache_new(&host_ops, 1);
  void *p[8];
  for (int i = 0; i < 8; i++) {
    ck_assert_int_eq(gmb__cache_alloc(k, 100 * 1024, NULL, &p[i]), 0);
    ck_assert_int_eq(gmb__cache_check(k), 0);
  }
  ck_assert_uint_eq(be.maps, 1);
  for (int i = 0; i < 8; i++) ck_assert_int_eq(gmb__cache_free(k, p[i], NULL), 0);
  ck_assert_int_eq(gmb__cache_check(k), 0);
  ck_assert_uint_eq(gmb__cache_cached(k), PAGE);
  uint64_t rel = 0;
  ck_assert_int_eq(gmb__cache_trim(k, 0, 0, &rel), 0);
  ck_assert_uint_eq(rel, PAGE);
  ck_assert_uint_eq(be.held, 0);
  done(k);
}
END_TEST

/* A large block is a run of pages, and the rest of its last page serves
 * other blocks: a 5 MiB block takes three pages, and 1 MiB more takes
 * none. */
START_TEST(large_block_shares_its_tail_page) {
  be_reset();
  struct gmb_cache *k = gmb__cache_new(&host_ops, 1);
  void *big, *small;
  ck_assert_int_eq(gmb__cache_alloc(k, 5 * MIB, NULL, &big), 0);
  ck_assert_uint_eq(be.maps, 3);
  ck_assert_int_eq(gmb__cache_alloc(k, 1 * MIB, NULL, &small), 0);
  ck_assert_uint_eq(be.maps, 3);
  ck_assert_int_eq(gmb__cache_check(k), 0);
  /* The whole run is usable memory. */
  memset(big, 0xab, 5 * MIB);
  memset(small, 0xcd, 1 * MIB);
  ck_assert_uint_eq(((unsigned char *)big)[5 * MIB - 1], 0xab);
  ck_assert_int_eq(gmb__cache_free(k, big, NULL), 0);
  ck_assert_int_eq(gmb__cache_free(k, small, NULL), 0);
  done(k);
}
END_TEST

/* The point of pages: after scattered frees, every page that holds no
 * live block goes back, whatever its neighbours hold.  Blocks of 1.5 MiB
 * straddle pages; freeing every other one leaves no wholly free slab in
 * a slab design, but pages of their own under the freed ones. */
START_TEST(page_goes_back_whatever_neighbours_hold) {
  be_reset();
  struct gmb_cache *k = gmb__cache_new(&host_ops, 1);
  enum { N = 16 };
  void *p[N];
  for (int i = 0; i < N; i++)
    ck_assert_int_eq(gmb__cache_alloc(k, 3 * MIB / 2 * (i % 2 ? 1 : 4), NULL,
                                      &p[i]),
                     0);
  for (int i = 0; i < N; i += 2) ck_assert_int_eq(gmb__cache_free(k, p[i], NULL), 0);
  ck_assert_int_eq(gmb__cache_check(k), 0);
  /* Count the pages with no live block on them, as the test sees it. */
  uint64_t held = counters(k).slab_bytes, live_pages = 0;
  struct page_count {
    uintptr_t lo, hi;
  } live[N];
  for (int i = 1; i < N; i += 2)
    live[i] = (struct page_count){(uintptr_t)p[i] & ~(PAGE - 1),
                                  ((uintptr_t)p[i] + 3 * MIB / 2 + PAGE - 1) &
                                      ~(PAGE - 1)};
  uintptr_t last = 0;
  for (int i = 1; i < N; i += 2) { /* blocks in address order */
    uintptr_t lo = live[i].lo > last ? live[i].lo : last;
    if (live[i].hi > lo) live_pages += (live[i].hi - lo) / PAGE;
    if (live[i].hi > last) last = live[i].hi;
  }
  uint64_t free_pages = held / PAGE - live_pages;
  ck_assert_uint_eq(gmb__cache_cached(k), free_pages * PAGE);
  uint64_t rel = 0;
  ck_assert_int_eq(gmb__cache_trim(k, 0, 0, &rel), 0);
  ck_assert_uint_eq(rel, free_pages * PAGE);
  ck_assert_uint_eq(counters(k).slab_bytes, live_pages * PAGE);
  ck_assert_int_eq(gmb__cache_check(k), 0);
  ck_assert_int_eq(pages_agree(k), 0);
  for (int i = 1; i < N; i += 2) ck_assert_int_eq(gmb__cache_free(k, p[i], NULL), 0);
  done(k);
}
END_TEST


/* gmb__cache_blocks: the blocks on mapped pages, each cut into its pieces
 * in runs of consecutive mapped pages ("segments"), which they tile in
 * address order; the runs add up to the pages held; live blocks whole,
 * with their requests; a non-zero return stops the walk. */
struct block_walk {
  uintptr_t seg, seg_end, at; /* the run being tiled, and where */
  uint64_t segs_bytes, live, live_bytes, pieces, bad;
  int stop_after;
};
static int block_walk_fn(void *arg, const struct gmb_cache_block_info *b) {
  struct block_walk *w = arg;
  w->pieces++;
  if (b->seg_base != w->seg) { /* a new run starts where its first block is */
    if (w->at != w->seg_end) w->bad++;
    w->seg = b->seg_base;
    w->seg_end = b->seg_base + b->seg_size;
    w->at = b->seg_base;
    w->segs_bytes += b->seg_size;
    if (b->seg_size == 0 || b->seg_size % PAGE) w->bad++;
  }
  if (b->ptr != w->at || b->ptr + b->size > w->seg_end || b->size == 0)
    w->bad++;
  w->at = b->ptr + b->size;
  if (b->state == GMB_CACHE_BLOCK_LIVE) {
    w->live++;
    w->live_bytes += b->size;
    if (b->req == 0 || b->req > b->size) w->bad++;
  }
  return w->stop_after && (int)w->pieces == w->stop_after ? 7 : 0;
}

static struct block_walk walk_blocks(struct gmb_cache *k) {
  struct block_walk w = {0};
  ck_assert_int_eq(gmb__cache_blocks(k, block_walk_fn, &w), 0);
  if (w.at != w.seg_end) w.bad++; /* the last run tiled to its end */
  return w;
}

START_TEST(blocks_walk_tiles_mapped_pages) {
  be_reset();
  struct gmb_cache *k = gmb__cache_new(&host_ops, 1);
  enum { N = 16 };
  void *p[N];
  for (int i = 0; i < N; i++)
    ck_assert_int_eq(gmb__cache_alloc(k, 3 * MIB / 2 * (i % 2 ? 1 : 4), NULL,
                                      &p[i]),
                     0);
  struct block_walk w = walk_blocks(k);
  ck_assert_uint_eq(w.bad, 0);
  ck_assert_uint_eq(w.live, N);
  ck_assert_uint_eq(w.segs_bytes, counters(k).slab_bytes);
  for (int i = 0; i < N; i += 2) ck_assert_int_eq(gmb__cache_free(k, p[i], NULL), 0);
  /* Free pages between the live blocks go back: the free blocks over
   * them are cut, and the runs are what is left mapped. */
  uint64_t rel = 0;
  ck_assert_int_eq(gmb__cache_trim(k, 0, 0, &rel), 0);
  ck_assert_uint_gt(rel, 0);
  w = walk_blocks(k);
  ck_assert_uint_eq(w.bad, 0);
  ck_assert_uint_eq(w.live, N / 2);
  ck_assert_uint_eq(w.live_bytes, N / 2 * (3 * MIB / 2));
  ck_assert_uint_eq(w.segs_bytes, counters(k).slab_bytes);
  ck_assert_uint_gt(w.pieces, w.live); /* free pieces on the live pages */
  /* A non-zero return stops the walk and is returned. */
  struct block_walk stop = {0};
  stop.stop_after = 2;
  ck_assert_int_eq(gmb__cache_blocks(k, block_walk_fn, &stop), 7);
  ck_assert_uint_eq(stop.pieces, 2);
  for (int i = 1; i < N; i += 2) ck_assert_int_eq(gmb__cache_free(k, p[i], NULL), 0);
  w = walk_blocks(k);
  ck_assert_uint_eq(w.bad, 0);
  ck_assert_uint_eq(w.live, 0);
  ck_assert_int_eq(gmb__cache_blocks(NULL, block_walk_fn, &w), 0);
  done(k);
}
END_TEST

/* A miss that needs contiguous pages takes idle pages moved there before
 * it asks the broker: scattered idle pages serve a large request without
 * a message, and the pages held do not grow. */
START_TEST(miss_moves_idle_pages) {
  be_reset();
  struct gmb_cache *k = gmb__cache_new(&host_ops, 1);
  enum { N = 12 };
  void *p[N], *big;
  for (int i = 0; i < N; i++)
    ck_assert_int_eq(gmb__cache_alloc(k, PAGE, NULL, &p[i]), 0);
  for (int i = 0; i < N; i += 2) ck_assert_int_eq(gmb__cache_free(k, p[i], NULL), 0);
  unsigned maps = be.maps;
  uint64_t held = be.held;
  ck_assert_int_eq(gmb__cache_alloc(k, 5 * PAGE, NULL, &big), 0);
  ck_assert_uint_eq(be.maps, maps);
  ck_assert_uint_eq(be.moves, 5);
  ck_assert_uint_eq(be.held, held);
  ck_assert_uint_eq(counters(k).page_moves, 5);
  memset(big, 0x5a, 5 * PAGE);
  for (int i = 1; i < N; i += 2) memset(p[i], i, PAGE);
  ck_assert_uint_eq(((unsigned char *)big)[5 * PAGE - 1], 0x5a);
  ck_assert_int_eq(gmb__cache_check(k), 0);
  ck_assert_int_eq(pages_agree(k), 0);
  ck_assert_int_eq(gmb__cache_free(k, big, NULL), 0);
  for (int i = 1; i < N; i += 2) {
    ck_assert_uint_eq(((unsigned char *)p[i])[PAGE - 1], (unsigned char)i);
    ck_assert_int_eq(gmb__cache_free(k, p[i], NULL), 0);
  }
  done(k);
}
END_TEST

/* A miss moves the lone idle pages between blocks in use before it
 * breaks up a run of idle pages: the run stays whole and serves the next
 * large request without a miss (taking the run's pages first made that
 * request miss in turn, and move pages again). */
START_TEST(miss_moves_lone_idle_pages_first) {
  be_reset();
  struct gmb_cache *k = gmb__cache_new(&host_ops, 1);
  enum { N = 16 };
  void *p[N], *big, *run;
  for (int i = 0; i < N; i++)
    ck_assert_int_eq(gmb__cache_alloc(k, PAGE, NULL, &p[i]), 0);
  for (int i = 1; i < N; i++) /* one run of pages, in address order */
    ck_assert_ptr_eq(p[i], (char *)p[i - 1] + PAGE);
  for (int i = 1; i <= 9; i += 2) /* five lone idle pages */
    ck_assert_int_eq(gmb__cache_free(k, p[i], NULL), 0);
  for (int i = 11; i <= 14; i++) /* and a run of four */
    ck_assert_int_eq(gmb__cache_free(k, p[i], NULL), 0);
  ck_assert_int_eq(gmb__cache_check(k), 0);
  unsigned maps = be.maps;
  ck_assert_int_eq(gmb__cache_alloc(k, 5 * PAGE, NULL, &big), 0);
  ck_assert_uint_eq(be.maps, maps);
  ck_assert_uint_eq(be.moves, 5);
  ck_assert_int_eq(gmb__cache_check(k), 0);
  struct gmb_cache_counters c0 = counters(k);
  ck_assert_int_eq(gmb__cache_alloc(k, 4 * PAGE, NULL, &run), 0);
  ck_assert_ptr_eq(run, p[11]);
  ck_assert_uint_eq(be.moves, 5);
  ck_assert_uint_eq(be.maps, maps);
  ck_assert_uint_eq(counters(k).hits, c0.hits + 1);
  ck_assert_uint_eq(counters(k).misses, c0.misses);
  memset(big, 0x5a, 5 * PAGE);
  memset(run, 0xa5, 4 * PAGE);
  ck_assert_int_eq(gmb__cache_check(k), 0);
  ck_assert_int_eq(pages_agree(k), 0);
  ck_assert_int_eq(gmb__cache_free(k, big, NULL), 0);
  ck_assert_int_eq(gmb__cache_free(k, run, NULL), 0);
  for (int i = 0; i <= 10; i += 2)
    ck_assert_int_eq(gmb__cache_free(k, p[i], NULL), 0);
  ck_assert_int_eq(gmb__cache_free(k, p[15], NULL), 0);
  done(k);
}
END_TEST

/* Without page_move the same miss gives the idle pages back first: the
 * pages held never pass what the program's blocks need plus the partly
 * used pages. */
START_TEST(miss_without_move_gives_back_first) {
  be_reset();
  struct gmb_cache *k = gmb__cache_new(&nomove_ops, 1);
  enum { N = 12 };
  void *p[N], *big;
  for (int i = 0; i < N; i++)
    ck_assert_int_eq(gmb__cache_alloc(k, PAGE, NULL, &p[i]), 0);
  for (int i = 0; i < N; i += 2) ck_assert_int_eq(gmb__cache_free(k, p[i], NULL), 0);
  be.quota = be.held; /* no room for one page more */
  ck_assert_int_eq(gmb__cache_alloc(k, 5 * PAGE, NULL, &big), 0);
  ck_assert_uint_le(be.held, be.quota);
  ck_assert_int_eq(gmb__cache_check(k), 0);
  ck_assert_int_eq(gmb__cache_free(k, big, NULL), 0);
  for (int i = 1; i < N; i += 2) ck_assert_int_eq(gmb__cache_free(k, p[i], NULL), 0);
  done(k);
}
END_TEST

/* A request larger than a span gets a span of its own. */
START_TEST(larger_than_a_span) {
  be_reset();
  struct gmb_cache *k = gmb__cache_new(&host_ops, 1);
  void *small, *huge;
  ck_assert_int_eq(gmb__cache_alloc(k, 4096, NULL, &small), 0);
  ck_assert_int_eq(gmb__cache_alloc(k, TEST_SPAN + 3 * MIB, NULL, &huge), 0);
  ck_assert_uint_eq(be.reserves, 2);
  ((char *)huge)[TEST_SPAN + 3 * MIB - 1] = 1;
  ck_assert_int_eq(gmb__cache_check(k), 0);
  ck_assert_int_eq(gmb__cache_free(k, huge, NULL), 0);
  ck_assert_int_eq(gmb__cache_free(k, small, NULL), 0);
  uint64_t rel;
  ck_assert_int_eq(gmb__cache_trim(k, 0, 0, &rel), 0);
  ck_assert_uint_eq(be.held, 0);
  done(k);
}
END_TEST

/* A miss of many pages asks for them in batches of GMB_CACHE_BATCH, one
 * message each (the broker sees one request for the quota and its
 * holds), and a trim gives them back the same way. */
START_TEST(many_pages_one_message_a_batch) {
  be_reset();
  struct gmb_cache *k = gmb__cache_new(&host_ops, 1);
  void *p, *q;
  ck_assert_int_eq(gmb__cache_alloc(k, 40 * MIB, NULL, &p), 0);
  ck_assert_uint_eq(be.maps, 20);
  ck_assert_uint_eq(be.requests, 1);
  ck_assert_int_eq(gmb__cache_alloc(k, 60 * MIB, NULL, &q), 0); /* 30 more */
  ck_assert_uint_eq(be.requests, 2);
  ck_assert_int_eq(gmb__cache_free(k, p, NULL), 0);
  ck_assert_int_eq(gmb__cache_free(k, q, NULL), 0);
  uint64_t rel;
  be.requests = 0;
  ck_assert_int_eq(gmb__cache_trim(k, 0, 0, &rel), 0);
  ck_assert_uint_eq(rel, 100 * MIB);
  ck_assert_uint_eq(be.requests, 1);
  /* 100 pages: two batches, the first telling what the second asks. */
  be.requests = 0;
  ck_assert_int_eq(gmb__cache_alloc(k, 200 * MIB - 4096, NULL, &p), 0);
  ck_assert_uint_eq(be.requests, 2);
  ck_assert_uint_eq(be.ahead[0], 36 * PAGE);
  ck_assert_uint_eq(be.ahead[1], 0);
  ck_assert_int_eq(gmb__cache_check(k), 0);
  ck_assert_int_eq(gmb__cache_free(k, p, NULL), 0);
  be.requests = 0;
  ck_assert_int_eq(gmb__cache_trim(k, 0, 0, &rel), 0);
  ck_assert_uint_eq(be.requests, 2);
  done(k);
}
END_TEST

/* The holes a miss's page request carries (the broker forgives them on
 * the quota) are the free bytes between blocks on the pages held: the
 * free end the miss takes is not one, nor are its pages still to map,
 * which are not held.  Page 0: a free MiB, a block, a free half MiB; 4
 * MiB then take that half MiB and two new pages. */
START_TEST(miss_carries_the_holes_it_leaves) {
  be_reset();
  struct gmb_cache *k = gmb__cache_new(&host_ops, 1);
  void *a, *b, *c;
  ck_assert_int_eq(gmb__cache_alloc(k, MIB, NULL, &a), 0);
  ck_assert_int_eq(gmb__cache_alloc(k, MIB / 2, NULL, &b), 0);
  ck_assert_int_eq(gmb__cache_free(k, a, NULL), 0);
  ck_assert_uint_eq(gmb__cache_holes(k), MIB + MIB / 2);
  be.watch = k;
  ck_assert_int_eq(gmb__cache_alloc(k, 4 * MIB, NULL, &c), 0);
  ck_assert_uint_eq(be.maps, 3);
  ck_assert_uint_eq((uintptr_t)c, (uintptr_t)b + MIB / 2);
  ck_assert_uint_eq(be.holes_seen, MIB);
  /* Afterwards: that MiB and the rest of the last new page. */
  ck_assert_uint_eq(gmb__cache_holes(k), MIB + MIB / 2);
  ck_assert_int_eq(gmb__cache_check(k), 0);
  ck_assert_int_eq(gmb__cache_free(k, b, NULL), 0);
  ck_assert_int_eq(gmb__cache_free(k, c, NULL), 0);
  done(k);
}
END_TEST

START_TEST(hit_makes_no_backend_call) {
  be_reset();
  struct gmb_cache *k = gmb__cache_new(&host_ops, 1);
  size_t sizes[] = {512, 4096, 100000, 1 << 20, 3 << 20, 700};
  void *p[6];
  unsigned calls = 0;
  for (int round = 0; round < 3; round++) {
    for (int i = 0; i < 6; i++)
      ck_assert_int_eq(gmb__cache_alloc(k, sizes[i], NULL, &p[i]), 0);
    for (int i = 5; i >= 0; i--) ck_assert_int_eq(gmb__cache_free(k, p[i], NULL), 0);
    ck_assert_int_eq(gmb__cache_check(k), 0);
    if (round == 0) calls = be.maps + be.unmaps + be.frees + be.moves;
  }
  ck_assert_uint_eq(be.maps + be.unmaps + be.frees + be.moves, calls);
  done(k);
}
END_TEST

/* --- streams ------------------------------------------------------------ */

/* A free on the stream the block is reused on makes no driver call. */
START_TEST(same_stream_reuses_without_event) {
  be_reset();
  struct gmb_cache *k = gmb__cache_new(&stream_ops, 1);
  struct fake_stream s = {0};
  void *p, *q;
  ck_assert_int_eq(gmb__cache_alloc(k, 8192, &s, &p), 0);
  ck_assert_int_eq(gmb__cache_free(k, p, &s), 0);
  ck_assert_int_eq(gmb__cache_alloc(k, 8192, &s, &q), 0);
  ck_assert_ptr_eq(p, q);
  ck_assert_int_eq(gmb__cache_free(k, q, &s), 0);
  ck_assert_uint_eq(be.records + be.queries, 0);
  done(k);
}
END_TEST

/* Another stream wants a block: an event is recorded on the freeing
 * stream then (once), and the block is the other stream's only when that
 * stream's work is done. */
START_TEST(other_stream_records_when_it_wants) {
  be_reset();
  struct gmb_cache *k = gmb__cache_new(&stream_ops, 1);
  struct fake_stream s1 = {0}, s2 = {0};
  void *p, *q, *r;
  ck_assert_int_eq(gmb__cache_alloc(k, 4 * MIB, &s1, &p), 0);
  ck_assert_int_eq(gmb__cache_free(k, p, &s1), 0);
  ck_assert_uint_eq(be.records, 0);
  ck_assert_int_eq(gmb__cache_alloc(k, 4 * MIB, &s2, &q), 0);
  ck_assert_ptr_ne(q, p);
  ck_assert_uint_eq(be.records, 1);
  ck_assert_int_eq(gmb__cache_check(k), 0);
  ck_assert_int_eq(gmb__cache_free(k, q, &s2), 0);
  /* Still not done: not p (and no second record). */
  ck_assert_int_eq(gmb__cache_alloc(k, 4 * MIB, &s2, &r), 0);
  ck_assert_ptr_ne(r, p);
  ck_assert_uint_eq(be.records, 1);
  ck_assert_int_eq(gmb__cache_free(k, r, &s2), 0);
  s1.completed = s1.recorded;
  /* s1 took more work after the record: the event covers only the work
   * queued before it, which is what the free needed. */
  s1.recorded += 5;
  ck_assert_int_eq(gmb__cache_alloc(k, 4 * MIB, &s2, &r), 0);
  ck_assert_int_eq(gmb__cache_check(k), 0);
  ck_assert_int_eq(gmb__cache_free(k, r, &s2), 0);
  s1.completed = s1.recorded;
  s2.completed = s2.recorded;
  done(k);
}
END_TEST

/* Free neighbours of two streams merge once one is ready. */
START_TEST(merge_across_streams_after_event) {
  be_reset();
  struct gmb_cache *k = gmb__cache_new(&stream_ops, 1);
  struct fake_stream s1 = {0}, s2 = {0};
  void *a, *b, *c;
  ck_assert_int_eq(gmb__cache_alloc(k, 64 * 1024, &s1, &a), 0);
  ck_assert_int_eq(gmb__cache_alloc(k, 64 * 1024, &s1, &b), 0);
  ck_assert_int_eq(gmb__cache_free(k, a, &s1), 0);
  ck_assert_int_eq(gmb__cache_free(k, b, &s2), 0);
  ck_assert_int_eq(gmb__cache_check(k), 0);
  /* s2 wants memory: a (s1's) gets an event, which completes. */
  ck_assert_int_eq(gmb__cache_alloc(k, 128 * 1024, &s2, &c), 0);
  s1.completed = s1.recorded;
  ck_assert_int_eq(gmb__cache_free(k, c, &s2), 0);
  s2.completed = s2.recorded;
  uint64_t rel = 0;
  ck_assert_int_eq(gmb__cache_trim(k, 0, 0, &rel), 0);
  ck_assert_int_eq(gmb__cache_check(k), 0);
  s1.completed = s1.recorded;
  s2.completed = s2.recorded;
  ck_assert_int_eq(gmb__cache_trim(k, 0, 0, &rel), 0);
  ck_assert_uint_eq(be.held, 0); /* one page, everything merged */
  done(k);
}
END_TEST

START_TEST(legacy_stream_is_null) {
  be_reset();
  struct gmb_cache *k = gmb__cache_new(&stream_ops, 1);
  void *p, *q;
  ck_assert_int_eq(gmb__cache_alloc(k, 8192, NULL, &p), 0);
  ck_assert_int_eq(gmb__cache_free(k, p, LEGACY), 0);
  ck_assert_int_eq(gmb__cache_alloc(k, 8192, NULL, &q), 0);
  ck_assert_ptr_eq(p, q);
  ck_assert_uint_eq(be.records, 0);
  ck_assert_int_eq(gmb__cache_free(k, q, NULL), 0);
  done(k);
}
END_TEST

static void *other_thread_alloc(void *arg) {
  void **out = arg;
  if (gmb__cache_alloc(out[0], 4 * MIB, PER_THREAD, &out[1])) out[1] = NULL;
  return NULL;
}

/* The per-thread default stream is recorded on at the free (no other
 * thread could later), and is another stream on another thread. */
START_TEST(per_thread_stream_records_at_free) {
  be_reset();
  struct gmb_cache *k = gmb__cache_new(&stream_ops, 1);
  void *p, *q;
  ck_assert_int_eq(gmb__cache_alloc(k, 4 * MIB, PER_THREAD, &p), 0);
  ck_assert_int_eq(gmb__cache_free(k, p, PER_THREAD), 0);
  ck_assert_uint_eq(be.records, 1);
  void *arg[2] = {k, NULL};
  pthread_t t;
  pthread_create(&t, NULL, other_thread_alloc, arg);
  pthread_join(t, NULL);
  ck_assert_ptr_nonnull(arg[1]);
  ck_assert_ptr_ne(arg[1], p);
  ck_assert_int_eq(gmb__cache_alloc(k, 4 * MIB, PER_THREAD, &q), 0);
  ck_assert_ptr_eq(q, p); /* this thread's own stream: at once */
  ck_assert_int_eq(gmb__cache_free(k, q, PER_THREAD), 0);
  ck_assert_int_eq(gmb__cache_free(k, arg[1], PER_THREAD), 0);
  ck_assert_int_eq(gmb__cache_check(k), 0);
  per_thread.completed = per_thread.recorded;
  done(k);
}
END_TEST

/* A block freed on a stream that no longer takes events is kept from
 * every other stream and from the trim, until gmb_trim's wait for the
 * device (GMB_CACHE_TRIM_SYNC). */
START_TEST(free_on_destroyed_stream_waits_for_sync) {
  be_reset();
  struct gmb_cache *k = gmb__cache_new(&stream_ops, 1);
  struct fake_stream dead = {0}, s2 = {0};
  void *p, *q;
  ck_assert_int_eq(gmb__cache_alloc(k, 4 * MIB, &dead, &p), 0);
  dead.destroyed = 1;
  ck_assert_int_eq(gmb__cache_free(k, p, &dead), 0);
  ck_assert_int_eq(gmb__cache_alloc(k, 4 * MIB, &s2, &q), 0);
  ck_assert_ptr_ne(q, p);
  ck_assert_int_eq(gmb__cache_free(k, q, &s2), 0);
  s2.completed = s2.recorded;
  uint64_t rel = 0;
  ck_assert_int_eq(gmb__cache_trim(k, 0, 0, &rel), 0);
  ck_assert_uint_eq(rel, 0); /* an event on s2 now: not known done */
  s2.completed = s2.recorded;
  ck_assert_int_eq(gmb__cache_trim(k, 0, 0, &rel), 0);
  ck_assert_uint_eq(rel, 4 * MIB); /* q's pages only */
  ck_assert_int_eq(gmb__cache_check(k), 0);
  ck_assert_int_eq(gmb__cache_trim(k, 0, GMB_CACHE_TRIM_SYNC, &rel), 0);
  ck_assert_uint_eq(be.syncs, 1);
  ck_assert_uint_eq(rel, 4 * MIB);
  ck_assert_uint_eq(be.held, 0);
  done(k);
}
END_TEST

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
  ck_assert_uint_eq(be.records, 1); /* s2 only */
  ck_assert_int_eq(gmb__cache_check(k), 0);
  /* Pending: counted as in use, its page not idle. */
  ck_assert_uint_eq(counters(k).in_use, 64 * 1024);
  ck_assert_uint_eq(gmb__cache_cached(k), 0);
  ck_assert_int_eq(gmb__cache_free(k, p, &s1), GMB_E_INVAL); /* twice */
  ck_assert_int_eq(gmb__cache_record_stream(k, p, &s2), GMB_E_INVAL);
  ck_assert_int_eq(gmb__cache_alloc(k, 64 * 1024, &s1, &q), 0);
  ck_assert_ptr_ne(q, p); /* not even on s1 */
  ck_assert_int_eq(gmb__cache_alloc(k, 64 * 1024, &s2, &r), 0);
  ck_assert_ptr_ne(r, p);
  ck_assert_int_eq(gmb__cache_free(k, r, &s2), 0);
  /* s2 ran past the free: p is a block freed on s1 like any other. */
  s2.completed = s2.recorded;
  ck_assert_int_eq(gmb__cache_alloc(k, 64 * 1024, &s1, &r), 0);
  ck_assert_ptr_eq(r, p);
  ck_assert_int_eq(gmb__cache_check(k), 0);
  ck_assert_int_eq(gmb__cache_free(k, r, &s1), 0);
  ck_assert_int_eq(gmb__cache_free(k, q, &s1), 0);
  uint64_t rel = 0;
  ck_assert_int_eq(gmb__cache_trim(k, 0, 0, &rel), 0); /* records on s1 */
  s1.completed = s1.recorded;
  s2.completed = s2.recorded;
  ck_assert_int_eq(gmb__cache_trim(k, 0, 0, &rel), 0);
  ck_assert_uint_eq(be.held, 0);
  done(k);
}
END_TEST

/* The trim gives back a page whose pending block's streams ran, and not
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
  s2.completed = s2.recorded;
  uint64_t rel = 0;
  ck_assert_int_eq(gmb__cache_trim(k, 0, 0, &rel), 0); /* records on s1 */
  s1.completed = s1.recorded;
  ck_assert_int_eq(gmb__cache_trim(k, 0, 0, &rel), 0);
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
   * handed out. */
  ck_assert_int_eq(gmb__cache_record_stream(k, p, &dead), 0);
  ck_assert_int_eq(gmb__cache_free(k, p, &s1), GMB_E_INVAL);
  ck_assert_uint_eq(be.records, 0);
  ck_assert_int_eq(gmb__cache_check(k), 0);
  ck_assert_uint_eq(counters(k).in_use, 4096);
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

/* --- quotas and trims ---------------------------------------------------- */

/* A page refused for the quota: the idle pages go back and the request
 * is tried once more. */
START_TEST(quota_trims_and_retries_once) {
  be_reset();
  struct gmb_cache *k = gmb__cache_new(&nomove_ops, 2);
  void *p, *q, *r;
  be.quota = 10 * MIB;
  ck_assert_int_eq(gmb__cache_alloc(k, 8 * MIB, NULL, &p), 0);
  ck_assert_int_eq(gmb__cache_free(k, p, NULL), 0);
  /* Another arena (another thread's) would need 5 pages: 4 idle ones of
   * the first arena go back first. */
  ck_assert_int_eq(gmb__cache_alloc(k, 9 * MIB, NULL, &q), 0);
  ck_assert_uint_le(be.held, be.quota);
  ck_assert_int_eq(gmb__cache_check(k), 0);
  /* Nothing idle left: the refusal stands, explained by the backend. */
  ck_assert_int_eq(gmb__cache_alloc(k, 2 * MIB, NULL, &r), GMB_E_QUOTA);
  ck_assert_ptr_null(r);
  ck_assert_int_eq(gmb__cache_check(k), 0);
  ck_assert_int_eq(gmb__cache_free(k, q, NULL), 0);
  done(k);
}
END_TEST

/* The broker's segments capped (its descriptor budget spent): a request
 * that needs a page more fails with GMB_E_NOMEM, after the idle pages
 * went back and the request was tried once more; what lived stays intact
 * and the cache stays sound. */
START_TEST(descriptor_budget_exhausted) {
  be_reset();
  struct gmb_cache *k = gmb__cache_new(&nomove_ops, 1);
  be.max_pages = 4;
  void *a, *b, *c;
  ck_assert_int_eq(gmb__cache_alloc(k, 5 * MIB, NULL, &a), 0); /* 3 pages */
  memset(a, 0x11, 5 * MIB);
  ck_assert_int_eq(gmb__cache_alloc(k, 2 * MIB, NULL, &b), 0); /* 1 more */
  ck_assert_int_eq(gmb__cache_free(k, b, NULL), 0);
  /* 5 MiB more: the idle page goes back, and 3 pages are still too many. */
  ck_assert_int_eq(gmb__cache_alloc(k, 5 * MIB, NULL, &c), GMB_E_NOMEM);
  ck_assert_ptr_null(c);
  ck_assert_uint_le(be.held, 4 * PAGE);
  ck_assert_int_eq(gmb__cache_check(k), 0);
  ck_assert_int_eq(pages_agree(k), 0);
  ck_assert_uint_eq(((unsigned char *)a)[5 * MIB - 1], 0x11);
  /* What fits still comes. */
  ck_assert_int_eq(gmb__cache_alloc(k, 2 * MIB, NULL, &c), 0);
  ck_assert_int_eq(gmb__cache_free(k, c, NULL), 0);
  ck_assert_int_eq(gmb__cache_free(k, a, NULL), 0);
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
  ck_assert_int_eq(gmb__cache_trim(k, 6 * MIB, 0, &rel), 0);
  ck_assert_uint_eq(rel, 8 * MIB);
  ck_assert_uint_eq(gmb__cache_cached(k), 6 * MIB);
  ck_assert_int_eq(gmb__cache_check(k), 0);
  done(k);
}
END_TEST

/* After a burst frees 90% of its blocks in scattered order, a trim gives
 * back every page that holds no live block (the goal is at least 90% of
 * them; the design gives all), counted here from the live blocks alone. */
START_TEST(scattered_frees_trim_every_free_page) {
  be_reset();
  struct gmb_cache *k = gmb__cache_new(&host_ops, 1);
  enum { N = 600 };
  static void *p[N];
  static size_t n[N];
  uint64_t rng = env_u64("SEED", 7);
  for (int i = 0; i < N; i++) {
    uint64_t r = gmb__splitmix64(&rng);
    n[i] = r % 3 == 0 ? 1 + (size_t)(r >> 8) % (6 * MIB)
                      : 1 + (size_t)(r >> 8) % (300 * 1024);
    ck_assert_int_eq(gmb__cache_alloc(k, n[i], NULL, &p[i]), 0);
  }
  /* Free 90% in a scattered order: a seeded shuffle. */
  int order[N];
  for (int i = 0; i < N; i++) order[i] = i;
  for (int i = N - 1; i > 0; i--) {
    int j = (int)(gmb__splitmix64(&rng) % (uint64_t)(i + 1));
    int t = order[i];
    order[i] = order[j];
    order[j] = t;
  }
  for (int i = 0; i < N * 9 / 10; i++) {
    ck_assert_int_eq(gmb__cache_free(k, p[order[i]], NULL), 0);
    p[order[i]] = NULL;
  }
  ck_assert_int_eq(gmb__cache_check(k), 0);
  /* Pages under a live block, from the blocks alone. */
  uint64_t held = counters(k).slab_bytes;
  uint64_t live_pages = 0;
  uintptr_t seen[4 * N];
  unsigned nseen = 0;
  for (int i = 0; i < N; i++) {
    if (p[i] == NULL) continue;
    uintptr_t a = (uintptr_t)p[i] & ~(PAGE - 1);
    uintptr_t e = ((uintptr_t)p[i] + n[i] + 511) / 512 * 512;
    for (; a < e; a += PAGE) {
      unsigned j = 0;
      while (j < nseen && seen[j] != a) j++;
      if (j == nseen && nseen < 4 * N) {
        seen[nseen++] = a;
        live_pages++;
      }
    }
  }
  uint64_t freeable = held - live_pages * PAGE, rel = 0;
  ck_assert_int_eq(gmb__cache_trim(k, 0, 0, &rel), 0);
  ck_assert_uint_eq(rel, freeable);
  ck_assert_uint_eq(counters(k).slab_bytes, live_pages * PAGE);
  fprintf(stderr, "scattered frees: %llu of %llu bytes held went back "
          "(every page under no live block)\n", (unsigned long long)rel,
          (unsigned long long)held);
  for (int i = 0; i < N; i++)
    if (p[i]) ck_assert_int_eq(gmb__cache_free(k, p[i], NULL), 0);
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

/* The work queued so far on s uses [p, p+n): one more record stands for
 * it (the stream's counter moves on, as the GPU's queue does). */
static void shadow_add(void *p, size_t n, struct fake_stream *s) {
  s->recorded++;
  if (nshadows < NSHADOWS)
    shadows[nshadows++] = (struct shadow){(uintptr_t)p, n, s, s->recorded};
}

/* A free on `to` of a block used on `from`: the caller promises that
 * `to` waits for `from`'s work, so what `from` may still do to the block
 * is now ordered before `to`'s next record.  Only the block's part of a
 * shadow moves: the rest of it stays `from`'s. */
static void shadow_retarget(void *p, size_t n, struct fake_stream *from,
                            struct fake_stream *to) {
  uintptr_t lo = (uintptr_t)p, hi = lo + n;
  unsigned count = nshadows;
  for (unsigned i = 0; i < count; i++) {
    struct shadow x = shadows[i];
    if (x.s != from || x.s->completed >= x.at || x.p >= hi ||
        lo >= x.p + x.n)
      continue;
    uintptr_t a = x.p > lo ? x.p : lo, b = x.p + x.n < hi ? x.p + x.n : hi;
    shadows[i] = (struct shadow){a, b - a, to, to->recorded + 1};
    if (x.p < a && nshadows < NSHADOWS)
      shadows[nshadows++] = (struct shadow){x.p, a - x.p, from, x.at};
    if (b < x.p + x.n && nshadows < NSHADOWS)
      shadows[nshadows++] = (struct shadow){b, x.p + x.n - b, from, x.at};
  }
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

static int cmp_addr(const void *a, const void *b) {
  uintptr_t x = *(const uintptr_t *)a, y = *(const uintptr_t *)b;
  return x < y ? -1 : x > y;
}

/* 1 when memory a stream's work may still touch lies on a page that is
 * not mapped any more (checked after each trim). */
static int shadow_under_unmapped(void) {
  static uintptr_t mapped[MAX_PAGES];
  size_t n = 0;
  for (int j = 1; j < MAX_PAGES; j++)
    if (be.at[j]) mapped[n++] = be.at[j];
  qsort(mapped, n, sizeof *mapped, cmp_addr);
  for (unsigned i = 0; i < nshadows; i++) {
    struct shadow *x = &shadows[i];
    if (x->s->completed >= x->at) continue;
    for (uintptr_t a = x->p & ~(PAGE - 1); a < x->p + x->n; a += PAGE)
      if (!bsearch(&a, mapped, n, sizeof *mapped, cmp_addr)) return 1;
  }
  return 0;
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
  int trace = getenv("TRACE") != NULL;
  nshadows = 0;
  for (uint64_t step = 0; step < iter; step++) {
    uint64_t r = gmb__splitmix64(&rng);
    struct live *l = &live[r % NLIVE];
    struct fake_stream *s = &streams[(r >> 8) % NSTREAMS];
    unsigned op = (unsigned)(r >> 16) % 16;
    if (op == 0) {
      if (trace) fprintf(stderr, "%llu all done\n", (unsigned long long)step);
      for (int i = 0; i < NSTREAMS; i++) streams[i].completed = streams[i].recorded;
    } else if (op == 1) {
      uint64_t keep = (r >> 24) % (32 * MIB);
      unsigned flags = (r >> 56) % 4 == 0 ? GMB_CACHE_TRIM_SYNC : 0;
      if (flags && events) /* the sync: every stream's work done */
        for (int i = 0; i < NSTREAMS; i++)
          streams[i].completed = streams[i].recorded;
      QUIET_EQ(gmb__cache_trim(k, keep, flags, NULL), 0);
      QUIET_MSG(!events || !shadow_under_unmapped(),
                "step %llu: a page given back under a stream's work",
                (unsigned long long)step);
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
                  "stream %d's work may use %#lx+%zu (until %llu; %llu of "
                  "%llu done)", (unsigned long long)step, p, n,
                  (int)(s - streams),
                  c < 0 ? -1 : (int)(shadows[c].s - streams),
                  c < 0 ? 0ul : (unsigned long)shadows[c].p,
                  c < 0 ? (size_t)0 : shadows[c].n,
                  c < 0 ? 0ull : (unsigned long long)shadows[c].at,
                  c < 0 ? 0ull : (unsigned long long)shadows[c].s->completed,
                  c < 0 ? 0ull : (unsigned long long)shadows[c].s->recorded);
        if (trace)
          fprintf(stderr, "%llu alloc %p+%zu s%d\n", (unsigned long long)step,
                  p, n, (int)(s - streams));
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
    } else {
      for (size_t i = 0; i < l->n; i += 509)
        QUIET_MSG(l->p[i] == l->tag, "step %llu: block %p overwritten",
                  (unsigned long long)step, (void *)l->p);
      QUIET_EQ(l->p[l->n - 1], l->tag);
      /* Usually on the stream it was used on, sometimes on another. */
      struct fake_stream *fs = (r >> 40) % 4 ? l->s : s;
      if (events) {
        /* Work queued on the freeing stream, and on the streams recorded
         * with record_stream, uses the block until now.  (A free on
         * another stream than the one it was used on is the caller's
         * promise that the freeing stream waits for that work.) */
        /* The whole block moves: its size rounded as the cache rounds. */
        if (fs != l->s)
          shadow_retarget(l->p, (l->n + 511) / 512 * 512, l->s, fs);
        shadow_add(l->p, l->n, fs);
        for (int i = 0; i < NSTREAMS; i++)
          if (l->uses & (1u << i)) shadow_add(l->p, l->n, &streams[i]);
      }
      if (trace)
        fprintf(stderr, "%llu free %p+%zu s%d on s%d uses %x (s%d %llu/%llu)\n",
                (unsigned long long)step, (void *)l->p, l->n,
                (int)(l->s - streams), (int)(fs - streams), l->uses,
                (int)(fs - streams), (unsigned long long)fs->completed,
                (unsigned long long)fs->recorded);
      QUIET_EQ(gmb__cache_free(k, l->p, fs), 0);
      if ((r >> 44) % 8 == 0)
        QUIET_EQ(gmb__cache_free(k, l->p, fs), GMB_E_INVAL);
      l->p = NULL;
    }
    int bad = gmb__cache_check(k);
    QUIET_MSG(bad == 0, "step %llu (seed %llu): %d violations",
              (unsigned long long)step, (unsigned long long)seed, bad);
    QUIET_MSG(pages_agree(k) == 0, "step %llu (seed %llu): the cache's pages "
              "and the backend's differ", (unsigned long long)step,
              (unsigned long long)seed);
    if (quota) QUIET_LE(be.held, quota);
  }
  for (int i = 0; i < NLIVE; i++)
    if (live[i].p) QUIET_EQ(gmb__cache_free(k, live[i].p, live[i].s), 0);
  for (int i = 0; i < NSTREAMS; i++) streams[i].completed = streams[i].recorded;
  uint64_t rel = 0;
  QUIET_EQ(gmb__cache_trim(k, 0, GMB_CACHE_TRIM_SYNC, &rel), 0);
  QUIET_EQ(gmb__cache_cached(k), 0);
  QUIET_EQ(be.held, 0);
  QUIET_EQ(gmb__cache_check(k), 0);
  struct gmb_cache_counters c = counters(k);
  fprintf(stderr, "stress (seed %llu): %llu hits, %llu misses, %llu pages "
          "mapped, %llu moved, %llu given back; peak held %llu MiB for a "
          "peak in use of %llu MiB\n", (unsigned long long)seed,
          (unsigned long long)c.hits, (unsigned long long)c.misses,
          (unsigned long long)c.slab_allocs, (unsigned long long)c.page_moves,
          (unsigned long long)c.slab_frees,
          (unsigned long long)(c.peak_slab_bytes / MIB),
          (unsigned long long)(c.peak_in_use / MIB));
  done(k);
}

START_TEST(stress_host) { stress(&host_ops, 0); }
END_TEST

START_TEST(stress_no_move) { stress(&nomove_ops, 0); }
END_TEST

START_TEST(stress_streams) { stress(&stream_ops, 0); }
END_TEST

/* Every refusal under a quota is GMB_E_QUOTA, and the backend never
 * holds more than the quota. */
START_TEST(stress_quota) { stress(&host_ops, 40 * MIB); }
END_TEST

/* The same with streams: a miss cut short by the quota leaves its range
 * free for its own stream only (the free ends of neighbours in it may be
 * another stream's work). */
START_TEST(stress_streams_quota) { stress(&stream_ops, 40 * MIB); }
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
    if (r % 997 == 0) {
      /* A trim while other threads allocate. */
      if (gmb__cache_trim(tk, 0, 0, NULL)) atomic_fetch_add(&thread_bad, 1);
    } else if (held[j]) {
      if (((unsigned char *)held[j])[n[j] - 1] != (unsigned char)j ||
          ((unsigned char *)held[j])[0] != (unsigned char)j)
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
  struct gmb_cache_counters c = counters(tk);
  ck_assert_uint_eq(c.in_use, 0);
  ck_assert_uint_gt(c.hits, c.misses);
  done(tk);
}
END_TEST

/* --- tags: sleep and wake ---------------------------------------------- */

static unsigned be_copies;
static int be_copy(void *ctx, uintptr_t dev, void *host, uint64_t n,
                   int to_device) {
  (void)ctx;
  pthread_mutex_lock(&be.mu);
  be_copies++;
  /* Only mapped pages are copied, whole ones. */
  for (uintptr_t a = dev; a < dev + n; a += PAGE) {
    int found = 0;
    for (int i = 1; i < MAX_PAGES && !found; i++) found = be.at[i] == a;
    if (!found || dev % PAGE || n % PAGE)
      be_misuse("copy of a page not mapped", 0, a);
  }
  pthread_mutex_unlock(&be.mu);
  if (to_device)
    memcpy((void *)dev, host, n);
  else
    memcpy(host, (const void *)dev, n);
  return 0;
}
static const struct gmb_cache_ops sleep_ops = {BACKEND, .page_move = be_move,
                                               .copy = be_copy};

static void fill(void *p, size_t n, unsigned seed) {
  unsigned char *b = p;
  for (size_t i = 0; i < n; i++) b[i] = (unsigned char)(seed + i * 131 + (i >> 12));
}
static int same(const void *p, size_t n, unsigned seed) {
  const unsigned char *b = p;
  for (size_t i = 0; i < n; i++)
    if (b[i] != (unsigned char)(seed + i * 131 + (i >> 12))) return 0;
  return 1;
}

/* 1 when the backend maps a page under [p, p+n). */
static int be_maps_under(const void *p, size_t n) {
  uintptr_t lo = (uintptr_t)p & ~(uintptr_t)(PAGE - 1), hi = (uintptr_t)p + n;
  for (int i = 1; i < MAX_PAGES; i++)
    if (be.at[i] >= lo && be.at[i] < hi) return 1;
  return 0;
}

#define CHECKED(k)                              \
  do {                                          \
    ck_assert_int_eq(gmb__cache_check(k), 0);   \
    ck_assert_int_eq(pages_agree(k), 0);        \
  } while (0)

START_TEST(pause_resume_keeps_bytes_and_addresses) {
  be_reset();
  be_copies = 0;
  struct gmb_cache *k = gmb__cache_new(&sleep_ops, 2);
  void *u = NULL, *w[4] = {0};
  const size_t sz[4] = {1000, 5 * MIB + 3, 300 * 1024, 70 * MIB};
  ck_assert_int_eq(gmb__cache_alloc(k, 4096, NULL, &u), 0); /* untagged */
  fill(u, 4096, 7);
  ck_assert_int_eq(gmb__cache_tag_set(k, "weights"), 0);
  for (int i = 0; i < 4; i++) {
    ck_assert_int_eq(gmb__cache_alloc(k, sz[i], NULL, &w[i]), 0);
    fill(w[i], sz[i], 11u * (unsigned)i + 1);
    CHECKED(k);
  }
  ck_assert_int_eq(gmb__cache_tag_set(k, NULL), 0);
  uint64_t held_before = be.held, untagged = PAGE;
  struct gmb_cache_counters c0 = counters(k);
  ck_assert_uint_eq(c0.host, 0);

  ck_assert_int_eq(gmb__cache_pause(k, "weights", GMB_CACHE_OFFLOAD), 0);
  CHECKED(k);
  /* Only the untagged page stays on the device; the tag's are back with
   * the broker, and the host holds their bytes. */
  ck_assert_uint_eq(be.held, untagged);
  for (int i = 0; i < 4; i++) ck_assert(!be_maps_under(w[i], sz[i]));
  struct gmb_cache_counters c1 = counters(k);
  ck_assert_uint_eq(c1.slab_bytes, untagged);
  ck_assert_uint_eq(c1.host, held_before - untagged);
  ck_assert_uint_eq(c1.paused, held_before - untagged);
  ck_assert_uint_le(c1.cached, c1.slab_bytes);
  ck_assert_uint_ge(c1.in_use, c0.in_use); /* paused blocks still handed out */
  ck_assert_uint_ge(be_copies, 1);
  ck_assert(same(u, 4096, 7)); /* untagged memory untouched */

  /* Pausing twice changes nothing. */
  unsigned unmaps = be.unmaps, copies = be_copies;
  ck_assert_int_eq(gmb__cache_pause(k, "weights", GMB_CACHE_OFFLOAD), 0);
  ck_assert_uint_eq(be.unmaps, unmaps);
  ck_assert_uint_eq(be_copies, copies);
  CHECKED(k);

  /* Allocating in the paused tag is refused; untagged works. */
  void *x = NULL;
  ck_assert_int_eq(gmb__cache_tag_set(k, "weights"), 0);
  ck_assert_int_eq(gmb__cache_alloc(k, 512, NULL, &x), GMB_E_INVAL);
  ck_assert_ptr_null(x);
  ck_assert_str_eq(gmb__cache_tag_paused(k), "weights");
  ck_assert_int_eq(gmb__cache_tag_set(k, ""), 0);
  ck_assert_ptr_null(gmb__cache_tag_paused(k));
  ck_assert_int_eq(gmb__cache_alloc(k, 512, NULL, &x), 0);
  CHECKED(k);

  /* A free while paused is taken (bookkeeping only); a second is not. */
  ck_assert_int_eq(gmb__cache_free(k, w[2], NULL), 0);
  ck_assert_int_eq(gmb__cache_free(k, w[2], NULL), GMB_E_INVAL);
  CHECKED(k);

  ck_assert_int_eq(gmb__cache_resume(k, "weights"), 0);
  CHECKED(k);
  for (int i = 0; i < 4; i++)
    if (i != 2) ck_assert_msg(same(w[i], sz[i], 11u * (unsigned)i + 1),
                              "block %d changed across the pause", i);
  struct gmb_cache_counters c2 = counters(k);
  ck_assert_uint_eq(c2.host, 0);
  ck_assert_uint_eq(c2.paused, 0);
  /* Resuming twice changes nothing. */
  unsigned maps = be.maps;
  ck_assert_int_eq(gmb__cache_resume(k, "weights"), 0);
  ck_assert_uint_eq(be.maps, maps);
  /* The tag serves again, at its own addresses. */
  ck_assert_int_eq(gmb__cache_tag_set(k, "weights"), 0);
  void *y = NULL;
  ck_assert_int_eq(gmb__cache_alloc(k, 2048, NULL, &y), 0);
  CHECKED(k);
  for (int i = 0; i < 4; i++)
    if (i != 2) ck_assert_int_eq(gmb__cache_free(k, w[i], NULL), 0);
  ck_assert_int_eq(gmb__cache_free(k, y, NULL), 0);
  ck_assert_int_eq(gmb__cache_free(k, x, NULL), 0);
  ck_assert_int_eq(gmb__cache_free(k, u, NULL), 0);
  ck_assert_int_eq(gmb__cache_trim(k, 0, 0, NULL), 0);
  ck_assert_uint_eq(be.held, 0);
  done(k);
}
END_TEST

START_TEST(pause_discard_copies_nothing) {
  be_reset();
  be_copies = 0;
  struct gmb_cache *k = gmb__cache_new(&sleep_ops, 1);
  ck_assert_int_eq(gmb__cache_tag_set(k, "kv"), 0);
  void *p = NULL;
  ck_assert_int_eq(gmb__cache_alloc(k, 9 * MIB, NULL, &p), 0);
  fill(p, 9 * MIB, 3);
  ck_assert_int_eq(gmb__cache_pause(k, "kv", GMB_CACHE_DISCARD), 0);
  CHECKED(k);
  ck_assert_uint_eq(be_copies, 0);
  ck_assert_uint_eq(counters(k).host, 0);
  ck_assert_uint_eq(be.held, 0);
  ck_assert_int_eq(gmb__cache_resume(k, "kv"), 0);
  CHECKED(k);
  ck_assert_uint_eq(be_copies, 0);
  /* The same addresses, mapped again (new pages: the old bytes gone). */
  ck_assert(!same(p, 9 * MIB, 3));
  fill(p, 9 * MIB, 4);
  ck_assert(same(p, 9 * MIB, 4));
  ck_assert_int_eq(gmb__cache_free(k, p, NULL), 0);
  ck_assert_int_eq(gmb__cache_trim(k, 0, 0, NULL), 0);
  done(k);
}
END_TEST

START_TEST(resume_without_room_loses_nothing) {
  be_reset();
  struct gmb_cache *k = gmb__cache_new(&sleep_ops, 1);
  ck_assert_int_eq(gmb__cache_tag_set(k, "w"), 0);
  void *p = NULL;
  ck_assert_int_eq(gmb__cache_alloc(k, 6 * MIB, NULL, &p), 0);
  fill(p, 6 * MIB, 9);
  ck_assert_int_eq(gmb__cache_pause(k, "w", GMB_CACHE_OFFLOAD), 0);
  /* Another tenant took the room: quota of 2 pages, 3 needed. */
  be.quota = 2 * PAGE;
  unsigned frees = be.frees;
  ck_assert_int_eq(gmb__cache_resume(k, "w"), GMB_E_QUOTA);
  CHECKED(k);
  ck_assert_uint_eq(be.held, 0); /* what it mapped went back */
  ck_assert_uint_ge(be.frees, frees);
  ck_assert_uint_eq(counters(k).host, 3 * PAGE); /* the bytes kept */
  ck_assert_str_eq(gmb__cache_tag_paused(k), "w");
  be.quota = 0;
  ck_assert_int_eq(gmb__cache_resume(k, "w"), 0);
  CHECKED(k);
  ck_assert(same(p, 6 * MIB, 9));
  ck_assert_int_eq(gmb__cache_free(k, p, NULL), 0);
  ck_assert_int_eq(gmb__cache_trim(k, 0, 0, NULL), 0);
  done(k);
}
END_TEST

START_TEST(host_quota_refuses_offload) {
  be_reset();
  struct gmb_cache *k = gmb__cache_new(&sleep_ops, 1);
  gmb__cache_host_quota_set(k, 4 * PAGE);
  ck_assert_int_eq(gmb__cache_tag_set(k, "a"), 0);
  void *a = NULL, *b = NULL;
  ck_assert_int_eq(gmb__cache_alloc(k, 3 * PAGE, NULL, &a), 0);
  fill(a, 3 * PAGE, 1);
  ck_assert_int_eq(gmb__cache_tag_set(k, "b"), 0);
  ck_assert_int_eq(gmb__cache_alloc(k, 2 * PAGE, NULL, &b), 0);
  fill(b, 2 * PAGE, 2);
  ck_assert_int_eq(gmb__cache_pause(k, "a", GMB_CACHE_OFFLOAD), 0);
  ck_assert_uint_eq(counters(k).host, 3 * PAGE);
  /* 3 + 2 pages would pass the quota of 4: refused, b runs on. */
  uint64_t held = be.held;
  ck_assert_int_eq(gmb__cache_pause(k, "b", GMB_CACHE_OFFLOAD), GMB_E_LIMIT);
  CHECKED(k);
  ck_assert_uint_eq(be.held, held);
  ck_assert_uint_eq(counters(k).host, 3 * PAGE);
  ck_assert_ptr_null(gmb__cache_tag_paused(k));
  void *c = NULL;
  ck_assert_int_eq(gmb__cache_alloc(k, 512, NULL, &c), 0);
  ck_assert(same(b, 2 * PAGE, 2));
  /* A discard needs no host memory. */
  ck_assert_int_eq(gmb__cache_pause(k, "b", GMB_CACHE_DISCARD), 0);
  CHECKED(k);
  ck_assert_int_eq(gmb__cache_resume(k, "a"), 0);
  ck_assert_int_eq(gmb__cache_resume(k, "b"), 0);
  CHECKED(k);
  ck_assert(same(a, 3 * PAGE, 1));
  ck_assert_uint_eq(counters(k).host, 0);
  ck_assert_int_eq(gmb__cache_free(k, a, NULL), 0);
  ck_assert_int_eq(gmb__cache_free(k, b, NULL), 0);
  ck_assert_int_eq(gmb__cache_free(k, c, NULL), 0);
  ck_assert_int_eq(gmb__cache_trim(k, 0, 0, NULL), 0);
  done(k);
}
END_TEST

START_TEST(tag_errors) {
  be_reset();
  struct gmb_cache *k = gmb__cache_new(&sleep_ops, 1);
  ck_assert_int_eq(gmb__cache_pause(k, "never", GMB_CACHE_OFFLOAD),
                   GMB_E_NOENT);
  ck_assert_int_eq(gmb__cache_resume(k, "never"), GMB_E_NOENT);
  ck_assert_int_eq(gmb__cache_pause(k, "", GMB_CACHE_OFFLOAD), GMB_E_INVAL);
  ck_assert_int_eq(gmb__cache_pause(k, NULL, GMB_CACHE_OFFLOAD), GMB_E_INVAL);
  char longname[GMB_CACHE_TAG_MAX + 2];
  memset(longname, 'x', sizeof longname - 1);
  longname[sizeof longname - 1] = '\0';
  ck_assert_int_eq(gmb__cache_tag_set(k, longname), GMB_E_INVAL);
  longname[GMB_CACHE_TAG_MAX] = '\0';
  ck_assert_int_eq(gmb__cache_tag_set(k, longname), 0);
  ck_assert_int_eq(gmb__cache_pause(k, longname, 7), GMB_E_INVAL);
  /* An empty tag pauses and resumes too. */
  ck_assert_int_eq(gmb__cache_pause(k, longname, GMB_CACHE_OFFLOAD), 0);
  CHECKED(k);
  ck_assert_int_eq(gmb__cache_resume(k, longname), 0);
  char name[16];
  for (int i = 1; i < 64; i++) {
    snprintf(name, sizeof name, "t%d", i);
    ck_assert_int_eq(gmb__cache_tag_set(k, name), 0);
  }
  ck_assert_int_eq(gmb__cache_tag_set(k, "one-too-many"), GMB_E_LIMIT);
  ck_assert_int_eq(gmb__cache_tag_set(k, "t5"), 0); /* known: fine */
  void *p = NULL;
  ck_assert_int_eq(gmb__cache_alloc(k, 100, NULL, &p), 0);
  CHECKED(k);
  ck_assert_int_eq(gmb__cache_free(k, p, NULL), 0);
  ck_assert_int_eq(gmb__cache_trim(k, 0, 0, NULL), 0);
  done(k);
}
END_TEST

START_TEST(pause_waits_for_the_device) {
  be_reset();
  struct gmb_cache *k = gmb__cache_new(&stream_ops, 1);
  struct fake_stream st = {0};
  ck_assert_int_eq(gmb__cache_tag_set(k, "w"), 0);
  void *p = NULL, *q = NULL;
  ck_assert_int_eq(gmb__cache_alloc(k, 3 * MIB, &st, &p), 0);
  ck_assert_int_eq(gmb__cache_alloc(k, 5 * MIB, &st, &q), 0);
  fill(p, 3 * MIB, 5);
  ck_assert_int_eq(gmb__cache_free(k, q, &st), 0); /* on a stream */
  unsigned syncs = be.syncs;
  st.completed = st.recorded; /* what the sync does on a GPU */
  ck_assert_int_eq(gmb__cache_pause(k, "w", GMB_CACHE_OFFLOAD), 0);
  ck_assert_uint_eq(be.syncs, syncs + 1);
  CHECKED(k);
  ck_assert_uint_eq(be.held, 0);
  ck_assert_int_eq(gmb__cache_resume(k, "w"), 0);
  CHECKED(k);
  ck_assert(same(p, 3 * MIB, 5));
  ck_assert_int_eq(gmb__cache_free(k, p, &st), 0);
  st.completed = st.recorded;
  ck_assert_int_eq(gmb__cache_trim(k, 0, GMB_CACHE_TRIM_SYNC, NULL), 0);
  done(k);
}
END_TEST

/* Seeded random steps over three tags and untagged memory: allocations,
 * frees, pauses (offload or discard) and resumes, with every live block's
 * bytes checked whenever its tag runs, the checker and the backend's
 * table after every step, and the pages of paused tags never mapped. */
START_TEST(stress_pauses) {
  uint64_t seed = env_u64("SEED", 23), iter = env_u64("ITER", 20000) / 4;
  be_reset();
  be.quota = 96 * MIB;
  struct gmb_cache *k = gmb__cache_new(&sleep_ops, 2);
  gmb__cache_host_quota_set(k, 16 * MIB);
  static const char *tags[4] = {NULL, "w", "kv", "x"};
  int paused[4] = {0}, discarded[4] = {0};
  enum { N = 64 };
  struct {
    unsigned char *p;
    size_t n;
    unsigned seed, tag;
  } live[N] = {{0}};
  uint64_t rng = seed;
  unsigned pauses = 0, resumes = 0, refused = 0;
  for (uint64_t step = 0; step < iter; step++) {
    uint64_t r = gmb__splitmix64(&rng);
    unsigned t = (unsigned)(r % 4), op = (unsigned)(r >> 8) % 16;
    unsigned i = (unsigned)(r >> 16) % N;
    if (op == 0 && t) {
      int mode = (r >> 32) % 3 ? GMB_CACHE_OFFLOAD : GMB_CACHE_DISCARD;
      int rc = gmb__cache_pause(k, tags[t], mode);
      if (rc == GMB_E_NOENT) continue;
      QUIET_MSG(rc == 0 || (rc == GMB_E_LIMIT && mode == GMB_CACHE_OFFLOAD),
                "step %llu: pause: %s", (unsigned long long)step,
                gmb_err_name(rc));
      if (rc == 0 && !paused[t]) {
        paused[t] = 1;
        discarded[t] = mode == GMB_CACHE_DISCARD;
        pauses++;
      }
      refused += rc != 0;
    } else if (op == 1 && t) {
      int rc = gmb__cache_resume(k, tags[t]);
      if (rc == GMB_E_NOENT) continue;
      QUIET_MSG(rc == 0 || rc == GMB_E_QUOTA, "step %llu: resume: %s",
                (unsigned long long)step, gmb_err_name(rc));
      if (rc == 0 && paused[t]) {
        paused[t] = 0;
        resumes++;
        for (unsigned j = 0; j < N; j++)
          if (live[j].p && live[j].tag == t) {
            if (discarded[t])
              fill(live[j].p, live[j].n, live[j].seed);
            else
              QUIET_MSG(same(live[j].p, live[j].n, live[j].seed),
                        "step %llu: a block of tag %s changed across its "
                        "pause", (unsigned long long)step, tags[t]);
          }
      }
      refused += rc != 0;
    } else if (live[i].p == NULL) {
      size_t n = 1 + (size_t)((r >> 24) % ((r >> 60) ? 256 * 1024 : 9 * MIB));
      QUIET_EQ(gmb__cache_tag_set(k, tags[t]), 0);
      void *p = NULL;
      int rc = gmb__cache_alloc(k, n, NULL, &p);
      if (paused[t]) {
        QUIET_EQ(rc, GMB_E_INVAL);
      } else if (rc == 0) {
        live[i].p = p;
        live[i].n = n;
        live[i].seed = (unsigned)step;
        live[i].tag = t;
        fill(p, n, live[i].seed);
      } else {
        QUIET_MSG(rc == GMB_E_QUOTA, "step %llu: alloc: %s",
                  (unsigned long long)step, gmb_err_name(rc));
      }
    } else {
      if (!paused[live[i].tag])
        QUIET_MSG(same(live[i].p, live[i].n, live[i].seed),
                  "step %llu: block overwritten", (unsigned long long)step);
      QUIET_EQ(gmb__cache_free(k, live[i].p, NULL), 0);
      live[i].p = NULL;
    }
    QUIET_MSG(gmb__cache_check(k) == 0, "step %llu (seed %llu): violations",
              (unsigned long long)step, (unsigned long long)seed);
    QUIET_MSG(pages_agree(k) == 0, "step %llu: pages differ",
              (unsigned long long)step);
    for (unsigned j = 0; j < N; j++)
      if (live[j].p && paused[live[j].tag])
        QUIET_MSG(!be_maps_under(live[j].p, live[j].n),
                  "step %llu: a paused block's page is mapped",
                  (unsigned long long)step);
  }
  be.quota = 0;
  for (unsigned t = 1; t < 4; t++)
    if (paused[t]) QUIET_EQ(gmb__cache_resume(k, tags[t]), 0);
  for (unsigned j = 0; j < N; j++)
    if (live[j].p) QUIET_EQ(gmb__cache_free(k, live[j].p, NULL), 0);
  QUIET_EQ(gmb__cache_trim(k, 0, 0, NULL), 0);
  QUIET_EQ(be.held, 0);
  QUIET_EQ(counters(k).host, 0);
  fprintf(stderr, "stress_pauses (seed %llu): %u pauses, %u resumes, %u "
          "refused\n", (unsigned long long)seed, pauses, resumes, refused);
  ck_assert_uint_gt(pauses, 0);
  ck_assert_uint_gt(resumes, 0);
  done(k);
}
END_TEST

/* Threads of a tag allocate and free (never touching the memory: a paused
 * block may not be touched) while another pauses and resumes the tag, and
 * untagged threads go on as usual: every refusal is GMB_E_INVAL while the
 * tag is not running, and the cache checks clean at the end. */
static atomic_int sleepers_done, sleepers_go;
static void *tag_worker(void *arg) {
  uint64_t rng = (uint64_t)(uintptr_t)arg;
  if (gmb__cache_tag_set(tk, "t")) atomic_fetch_add(&thread_bad, 1);
  /* Not before the tag's first pause: so that one at least comes while
   * they run, however the threads are scheduled. */
  while (!atomic_load(&sleepers_go)) sched_yield();
  void *held[16] = {0};
  for (int i = 0; i < 5000; i++) {
    uint64_t r = gmb__splitmix64(&rng);
    int j = (int)(r % 16);
    if (held[j]) {
      if (gmb__cache_free(tk, held[j], NULL)) atomic_fetch_add(&thread_bad, 1);
      held[j] = NULL;
    } else {
      size_t n = 1 + (size_t)(r >> 20) % (r % 5 == 0 ? 5 * MIB : 64 * 1024);
      int rc = gmb__cache_alloc(tk, n, NULL, &held[j]);
      if (rc && rc != GMB_E_INVAL) atomic_fetch_add(&thread_bad, 1);
    }
  }
  for (int j = 0; j < 16; j++)
    if (held[j] && gmb__cache_free(tk, held[j], NULL))
      atomic_fetch_add(&thread_bad, 1);
  atomic_fetch_add(&sleepers_done, 1);
  return NULL;
}

START_TEST(pause_while_threads_allocate) {
  be_reset();
  tk = gmb__cache_new(&sleep_ops, 2);
  atomic_store(&thread_bad, 0);
  atomic_store(&sleepers_done, 0);
  atomic_store(&sleepers_go, 0);
  ck_assert_int_eq(gmb__cache_tag_set(tk, "t"), 0); /* the tag exists */
  pthread_t t[4];
  for (uintptr_t i = 0; i < 2; i++)
    pthread_create(&t[i], NULL, tag_worker, (void *)(i + 1));
  for (uintptr_t i = 2; i < 4; i++)
    pthread_create(&t[i], NULL, worker, (void *)(i + 1));
  unsigned cycles = 0;
  do {
    int mode = cycles % 3 ? GMB_CACHE_OFFLOAD : GMB_CACHE_DISCARD;
    if (gmb__cache_pause(tk, "t", mode)) atomic_fetch_add(&thread_bad, 1);
    atomic_store(&sleepers_go, 1);
    if (gmb__cache_resume(tk, "t")) atomic_fetch_add(&thread_bad, 1);
    cycles++;
  } while (atomic_load(&sleepers_done) < 2);
  for (int i = 0; i < 4; i++) pthread_join(t[i], NULL);
  ck_assert_int_eq(atomic_load(&thread_bad), 0);
  ck_assert_uint_gt(cycles, 0);
  ck_assert_int_eq(gmb__cache_check(tk), 0);
  ck_assert_int_eq(pages_agree(tk), 0);
  struct gmb_cache_counters c = counters(tk);
  ck_assert_uint_eq(c.in_use, 0);
  ck_assert_uint_eq(c.host, 0);
  ck_assert_int_eq(gmb__cache_trim(tk, 0, 0, NULL), 0);
  ck_assert_uint_eq(be.held, 0);
  done(tk);
}
END_TEST

/* A process that exits while paused: destroying the cache frees the host
 * copy with it (and the pages were the broker's already). */
START_TEST(destroy_while_paused) {
  be_reset();
  struct gmb_cache *k = gmb__cache_new(&sleep_ops, 1);
  ck_assert_int_eq(gmb__cache_tag_set(k, "w"), 0);
  void *p = NULL;
  ck_assert_int_eq(gmb__cache_alloc(k, 5 * MIB, NULL, &p), 0);
  ck_assert_int_eq(gmb__cache_pause(k, "w", GMB_CACHE_OFFLOAD), 0);
  ck_assert_uint_eq(be.held, 0);
  done(k);
}
END_TEST

static Suite *suite(void) {
  Suite *s = suite_create("cache");
  TCase *t = tcase_create("cache");
  tcase_set_timeout(t, 120);
  tcase_add_test(t, alloc_zero_and_too_big);
  tcase_add_test(t, new_refuses_bad_ops);
  tcase_add_test(t, free_unknown_twice_inside_and_after_trim);
  tcase_add_test(t, small_blocks_share_a_page);
  tcase_add_test(t, large_block_shares_its_tail_page);
  tcase_add_test(t, page_goes_back_whatever_neighbours_hold);
  tcase_add_test(t, blocks_walk_tiles_mapped_pages);
  tcase_add_test(t, miss_moves_idle_pages);
  tcase_add_test(t, miss_moves_lone_idle_pages_first);
  tcase_add_test(t, miss_without_move_gives_back_first);
  tcase_add_test(t, larger_than_a_span);
  tcase_add_test(t, hit_makes_no_backend_call);
  tcase_add_test(t, many_pages_one_message_a_batch);
  tcase_add_test(t, miss_carries_the_holes_it_leaves);
  tcase_add_test(t, same_stream_reuses_without_event);
  tcase_add_test(t, other_stream_records_when_it_wants);
  tcase_add_test(t, merge_across_streams_after_event);
  tcase_add_test(t, legacy_stream_is_null);
  tcase_add_test(t, per_thread_stream_records_at_free);
  tcase_add_test(t, free_on_destroyed_stream_waits_for_sync);
  tcase_add_test(t, record_stream_waits_for_other_stream);
  tcase_add_test(t, record_stream_trim_and_destroy);
  tcase_add_test(t, record_stream_errors);
  tcase_add_test(t, quota_trims_and_retries_once);
  tcase_add_test(t, trim_keeps_what_is_asked);
  tcase_add_test(t, descriptor_budget_exhausted);
  tcase_add_test(t, scattered_frees_trim_every_free_page);
  tcase_add_test(t, stress_host);
  tcase_add_test(t, stress_no_move);
  tcase_add_test(t, stress_streams);
  tcase_add_test(t, stress_quota);
  tcase_add_test(t, stress_streams_quota);
  tcase_add_test(t, threads_share_one_cache);
  tcase_add_test(t, pause_resume_keeps_bytes_and_addresses);
  tcase_add_test(t, pause_discard_copies_nothing);
  tcase_add_test(t, resume_without_room_loses_nothing);
  tcase_add_test(t, host_quota_refuses_offload);
  tcase_add_test(t, tag_errors);
  tcase_add_test(t, pause_waits_for_the_device);
  tcase_add_test(t, stress_pauses);
  tcase_add_test(t, destroy_while_paused);
  tcase_add_test(t, pause_while_threads_allocate);
  suite_add_tcase(s, t);
  return s;
}

int main(void) { return check_run(suite()); }
