/*
 * cache.c - the stream-ordered cache of gmb_malloc_async/gmb_free_async.
 *
 * Memory comes from the backend in slabs (pinned broker allocations).  A
 * slab is cut into blocks that tile it exactly, in address order; a block
 * is either handed out (in its arena's hash, keyed by address) or free (in
 * one bin list of its pool).  Requests up to GMB_CACHE_SMALL_MAX share
 * small slabs of GMB_CACHE_SMALL_SLAB bytes (the small pool); larger ones
 * get a slab of their own (the large pool), which stays cached after the
 * free and is split for later large requests.  Allocation is best fit
 * within a size class (bins of four sub-classes per power of two, so a
 * block is at most 25% above the best one), splitting what is left over;
 * a free coalesces with free neighbours of its slab.
 *
 * What the cache holds beyond what is handed out is free memory in two
 * forms: wholly free ("idle") slabs, which can go back to the broker, and
 * holes beside blocks in use, which cannot.  Three rules keep the holes
 * few and the idle slabs within a bound (docs/benchmarks.md, bench_cache,
 * has what each gave):
 *  - a block comes from a slab that has blocks in use when one fits, and
 *    cuts a wholly free slab only when none does (cache_find): the idle
 *    slab stays whole, able to serve a request as large as itself or to
 *    go back;
 *  - the rest of a block cut from a free block lies beside the neighbour
 *    in use, not against the slab's edge (cache_split), so that the
 *    neighbour's free makes one hole of the two;
 *  - a request no cached block can serve first gives back idle slabs
 *    (cache_shed): for a large request, the large ones smaller than
 *    itself (they could never serve it; a cache of growing requests
 *    would otherwise keep every slab it outgrew); then, largest first,
 *    any while the slabs with the new one would pass the arena's peak of
 *    bytes in use by more than the slack (GMB_CACHE_SLACK_PCT percent
 *    plus GMB_CACHE_SLACK_FLOOR).  Only a miss grows the slab bytes, so a
 *    miss is where their peak is bounded; a hit and a free send nothing.
 *
 * Streams: a free block remembers the stream it was freed on and, where
 * streams count (a GPU), an event recorded on that stream at the free.
 * It is reusable at once on that stream (work on one stream runs in
 * order), and on other streams once the event completed; the event is then
 * dropped and the block is ready for everyone.  Two free neighbours merge
 * when one is ready, or both wait on the same stream (the merged block
 * keeps the later event, which completes last).  Events are recorded under
 * the arena's lock, so the sequence numbers that say which is later follow
 * the order of the records on each stream.  Without event functions (the
 * host device) every free block is ready.
 *
 * Stream handles as CUDA spells them: 0x1 (CU_STREAM_LEGACY) is the
 * legacy default stream, the same as NULL, and is stored as NULL; 0x2
 * (CU_STREAM_PER_THREAD) names a different stream on every thread, so a
 * block freed on it remembers the freeing thread too, and is "the same
 * stream" only for that thread.
 *
 * Other streams (gmb__cache_record_stream, torch's record_stream): a
 * handed-out block may name streams other than the one it will be freed
 * on that use it too.  Its free then records an event on each of them as
 * well and parks the block *pending* (in its arena's pending list, not in
 * the hash, not in a bin, still counted as handed out) until every one of
 * those events completed; it then becomes a free block of its free's
 * stream and event as any other.  Pending blocks are looked at before each
 * allocation of their arena and by the trim.
 *
 * Invariants (gmb__cache_check counts violations of each):
 *  - the blocks of a slab tile it: the first starts at its base, each
 *    starts where the previous ends, the last ends at its end; sizes are
 *    non-zero multiples of GMB_CACHE_ALIGN;
 *  - no two neighbours are free and mergeable (they would have merged);
 *  - every free block is in exactly the bin list of its size in its
 *    slab's pool, and bin lists hold nothing else; the bitmap has a bit
 *    for exactly the non-empty bins;
 *  - every handed-out block is in its arena's hash once, or (pending) in
 *    its arena's pending list once, and nothing else is in either; only
 *    a pending block has an event while not free;
 *  - an event's reference count is the number of free or pending blocks
 *    that name it (a pending block's waits name their own events once);
 *  - the arena's byte counts are the sums of its slabs and blocks, and the
 *    cache's totals the sums over its arenas.
 *
 * Locks: each arena has a mutex; a thread uses the arena its thread number
 * picks, so threads rarely meet on one.  No lock is held across a backend
 * slab call (a message to the broker): a miss unlocks, asks for a slab,
 * and locks again to carve it.  Totals are atomics, updated under the
 * arena lock.  gmb__cache_check and the trim take the arenas' locks one at
 * a time, in index order; nothing takes two at once except the checker,
 * which takes them all in that order.
 *
 * The cache never trusts what it is given: a pointer it did not hand out,
 * or one already free, is an error that changes nothing.
 */
#include "cache.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gmb.h"

#define CACHE_BINS 160
#define CACHE_BITMAP_WORDS ((CACHE_BINS + 63) / 64)
#define CACHE_POOL_SMALL 0
#define CACHE_POOL_LARGE 1
/* Scanning a bin for the best fit stops after this many blocks. */
#define CACHE_SCAN_MAX 64
#define CACHE_DEFAULT_ARENAS 4
#define CACHE_HASH_MIN 64
/* CUDA's pseudo handles (cuda.h CU_STREAM_LEGACY, CU_STREAM_PER_THREAD). */
#define CACHE_STREAM_LEGACY ((void *)(uintptr_t)0x1)
#define CACHE_STREAM_PER_THREAD ((void *)(uintptr_t)0x2)

struct cache_event {
  void *h;     /* the backend's event */
  uint32_t refs; /* free blocks that name it */
  uint64_t seq;  /* the order of records in this arena */
  struct cache_event *next; /* the arena's spare events */
};

struct cache_slab;

struct cache_block {
  uintptr_t ptr;
  uint64_t size;
  uint64_t req; /* handed out: the request, rounded to 512 */
  struct cache_slab *slab;
  struct cache_block *prev, *next;   /* the slab's blocks, address order */
  struct cache_block *fprev, *fnext; /* free: its bin list;
                                        pending: the arena's pending list */
  struct cache_block *hnext;         /* handed out: its hash chain */
  void *stream;                      /* free, pending: the stream of the free */
  unsigned thread;                   /* ... its thread, for 0x2 */
  struct cache_event *ev;            /* free and not ready, pending: its event */
  /* Handed out: other streams that use it (record_stream); pending: the
   * events recorded on them at the free that have not completed yet. */
  void **uses;
  struct cache_event **waits;
  uint32_t n_uses, cap_uses, n_waits;
  int free;
  int pending;
};

struct cache_slab {
  uint64_t id;
  uintptr_t base;
  uint64_t size;
  int pool;
  struct cache_block *first;
  struct cache_slab *prev, *next; /* the arena's slabs */
};

struct cache_pool {
  struct cache_block *bins[CACHE_BINS];
  uint64_t bitmap[CACHE_BITMAP_WORDS];
};

struct cache_arena {
  pthread_mutex_t mu;
  struct cache_pool pool[2];
  struct cache_slab *slabs;
  struct cache_block **hash; /* handed-out blocks by address */
  size_t hash_cap, hash_n;
  struct cache_block *pending; /* freed, waiting for their other streams */
  size_t pending_n;
  struct cache_event *spare_events;
  uint64_t seq;
  uint64_t slab_bytes, slabs_n, in_use_blocks, in_use_req;
  uint64_t peak_req; /* the most in_use_req ever was: the slack's measure */
  uint64_t hits, misses, slab_allocs, slab_frees;
};

struct gmb_cache {
  struct gmb_cache_ops ops;
  unsigned n;
  struct cache_arena *arena;
  /* Totals over the arenas, updated under the arena's lock. */
  _Atomic uint64_t slab_bytes, in_use, blocks_out;
  _Atomic uint64_t peak_in_use, peak_slab_bytes;
};

/* --- threads and streams ---------------------------------------------- */

static _Atomic unsigned cache_next_thread;
static _Thread_local unsigned cache_thread; /* 0: not numbered yet */

/* The calling thread's number (from 1). */
static unsigned cache_me(void) {
  if (cache_thread == 0)
    cache_thread = atomic_fetch_add(&cache_next_thread, 1) + 1;
  return cache_thread;
}

static unsigned cache_arena_of(const struct gmb_cache *k) {
  return cache_me() % k->n;
}

/* The handle the cache keeps for `stream`: the legacy stream is NULL
 * whichever way it was named. */
static void *cache_stream(void *stream) {
  return stream == CACHE_STREAM_LEGACY ? NULL : stream;
}

/* 1 when (s1 of thread t1) and (s2 of thread t2) are one stream: the
 * per-thread default stream is a different one on every thread. */
static int cache_same_stream(void *s1, unsigned t1, void *s2, unsigned t2) {
  return s1 == s2 && (s1 != CACHE_STREAM_PER_THREAD || t1 == t2);
}

/* --- sizes and bins --------------------------------------------------- */

static uint64_t cache_round(uint64_t v, uint64_t to) {
  return (v + to - 1) / to * to;
}

static unsigned cache_bin(uint64_t size) {
  uint64_t u = size / GMB_CACHE_ALIGN;
  if (u < 4) return (unsigned)u;
  unsigned fl = 63u - (unsigned)__builtin_clzll(u);
  unsigned sl = (unsigned)(u >> (fl - 2)) & 3u;
  unsigned b = 4u * fl + sl;
  return b < CACHE_BINS ? b : CACHE_BINS - 1;
}

static void cache_bin_insert(struct cache_arena *a, struct cache_block *b) {
  struct cache_pool *p = &a->pool[b->slab->pool];
  unsigned i = cache_bin(b->size);
  b->fprev = NULL;
  b->fnext = p->bins[i];
  if (p->bins[i]) p->bins[i]->fprev = b;
  p->bins[i] = b;
  p->bitmap[i / 64] |= UINT64_C(1) << (i % 64);
}

static void cache_bin_remove(struct cache_arena *a, struct cache_block *b) {
  struct cache_pool *p = &a->pool[b->slab->pool];
  unsigned i = cache_bin(b->size);
  if (b->fprev)
    b->fprev->fnext = b->fnext;
  else
    p->bins[i] = b->fnext;
  if (b->fnext) b->fnext->fprev = b->fprev;
  b->fprev = b->fnext = NULL;
  if (p->bins[i] == NULL) p->bitmap[i / 64] &= ~(UINT64_C(1) << (i % 64));
}

/* The first non-empty bin at or after i, or CACHE_BINS. */
static unsigned cache_bin_next(const struct cache_pool *p, unsigned i) {
  while (i < CACHE_BINS) {
    uint64_t w = p->bitmap[i / 64] & (~UINT64_C(0) << (i % 64));
    if (w) return (i / 64) * 64 + (unsigned)__builtin_ctzll(w);
    i = (i / 64 + 1) * 64;
  }
  return CACHE_BINS;
}

/* --- the hash of handed-out blocks ---------------------------------- */

static size_t cache_hash_of(uintptr_t p, size_t cap) {
  return (size_t)(((uint64_t)p / GMB_CACHE_ALIGN) *
                  UINT64_C(0x9e3779b97f4a7c15) >> 20) & (cap - 1);
}

/* 0, or GMB_E_SYSTEM when the table could not grow (it stays valid). */
static int cache_hash_grow(struct cache_arena *a) {
  size_t cap = a->hash_cap ? a->hash_cap * 2 : CACHE_HASH_MIN;
  struct cache_block **t = calloc(cap, sizeof *t);
  if (t == NULL) return GMB_E_SYSTEM;
  for (size_t i = 0; i < a->hash_cap; i++) {
    struct cache_block *b = a->hash[i];
    while (b) {
      struct cache_block *nx = b->hnext;
      size_t h = cache_hash_of(b->ptr, cap);
      b->hnext = t[h];
      t[h] = b;
      b = nx;
    }
  }
  free(a->hash);
  a->hash = t;
  a->hash_cap = cap;
  return 0;
}

static void cache_hash_put(struct cache_arena *a, struct cache_block *b) {
  size_t h = cache_hash_of(b->ptr, a->hash_cap);
  b->hnext = a->hash[h];
  a->hash[h] = b;
  a->hash_n++;
}

/* Removes and returns the handed-out block at p, or NULL. */
static struct cache_block *cache_hash_take(struct cache_arena *a,
                                           uintptr_t p) {
  if (a->hash_cap == 0) return NULL;
  struct cache_block **pp = &a->hash[cache_hash_of(p, a->hash_cap)];
  while (*pp && (*pp)->ptr != p) pp = &(*pp)->hnext;
  struct cache_block *b = *pp;
  if (b) {
    *pp = b->hnext;
    b->hnext = NULL;
    a->hash_n--;
  }
  return b;
}

/* --- events ------------------------------------------------------------ */

static void cache_event_unref(struct gmb_cache *k, struct cache_arena *a,
                              struct cache_event *e) {
  (void)k;
  if (e == NULL || --e->refs) return;
  e->next = a->spare_events;
  a->spare_events = e;
}

/* 1 when free block b waited for an event that has now completed: the
 * event is dropped and b is ready for every stream. */
static int cache_promote(struct gmb_cache *k, struct cache_arena *a,
                         struct cache_block *b) {
  if (b->ev == NULL || k->ops.event_query(k->ops.ctx, b->ev->h) != 1) return 0;
  cache_event_unref(k, a, b->ev);
  b->ev = NULL;
  b->stream = NULL;
  return 1;
}

/* 1 when a free block may be used on `stream` now.  A block whose event
 * completed is made ready (its event dropped); *promoted says so, since
 * it may now merge with its neighbours. */
static int cache_usable(struct gmb_cache *k, struct cache_arena *a,
                        struct cache_block *b, void *stream, int *promoted) {
  if (b->ev == NULL || cache_same_stream(b->stream, b->thread, stream,
                                         cache_me()))
    return 1;
  if (!cache_promote(k, a, b)) return 0;
  *promoted = 1;
  return 1;
}

/* --- merging --------------------------------------------------------- */

static int cache_mergeable(const struct cache_block *x,
                           const struct cache_block *y) {
  if (!x->free || !y->free) return 0;
  if (x->ev == NULL || y->ev == NULL) return 1;
  return cache_same_stream(x->stream, x->thread, y->stream, y->thread);
}

/* Merges free block `y` (x's next neighbour) into x; neither is in a bin.
 * The merged block waits for the later of the two events. */
static void cache_merge(struct gmb_cache *k, struct cache_arena *a,
                        struct cache_block *x, struct cache_block *y) {
  if (y->ev && (x->ev == NULL || y->ev->seq > x->ev->seq)) {
    cache_event_unref(k, a, x->ev);
    x->ev = y->ev;
    x->stream = y->stream;
    x->thread = y->thread;
  } else {
    cache_event_unref(k, a, y->ev);
  }
  x->size += y->size;
  x->next = y->next;
  if (y->next) y->next->prev = x;
  free(y);
}

/* Merges free block b (in no bin) with its mergeable neighbours, puts the
 * result into its bin and returns it. */
static struct cache_block *cache_coalesce(struct gmb_cache *k,
                                          struct cache_arena *a,
                                          struct cache_block *b) {
  if (b->next && cache_mergeable(b, b->next)) {
    cache_bin_remove(a, b->next);
    cache_merge(k, a, b, b->next);
  }
  if (b->prev && cache_mergeable(b->prev, b)) {
    struct cache_block *p = b->prev;
    cache_bin_remove(a, p);
    cache_merge(k, a, p, b);
    b = p;
  }
  cache_bin_insert(a, b);
  return b;
}

/* --- slabs ------------------------------------------------------------- */

static void cache_totals(struct gmb_cache *k, int64_t d_slab, int64_t d_req,
                         int64_t d_out) {
  uint64_t s = atomic_fetch_add(&k->slab_bytes, (uint64_t)d_slab) +
               (uint64_t)d_slab;
  uint64_t u = atomic_fetch_add(&k->in_use, (uint64_t)d_req) +
               (uint64_t)d_req;
  atomic_fetch_add(&k->blocks_out, (uint64_t)d_out);
  uint64_t p = atomic_load(&k->peak_slab_bytes);
  while (s > p && !atomic_compare_exchange_weak(&k->peak_slab_bytes, &p, s)) {
  }
  p = atomic_load(&k->peak_in_use);
  while (u > p && !atomic_compare_exchange_weak(&k->peak_in_use, &p, u)) {
  }
}

/* Links a new slab, as one ready free block in no bin; returns that
 * block, or NULL when out of memory (the slab is then not linked). */
static struct cache_block *cache_slab_link(struct gmb_cache *k,
                                           struct cache_arena *a, uint64_t id,
                                           uintptr_t base, uint64_t size,
                                           int pool) {
  struct cache_slab *s = calloc(1, sizeof *s);
  struct cache_block *b = calloc(1, sizeof *b);
  if (s == NULL || b == NULL) {
    free(s);
    free(b);
    return NULL;
  }
  s->id = id;
  s->base = base;
  s->size = size;
  s->pool = pool;
  s->first = b;
  s->next = a->slabs;
  if (a->slabs) a->slabs->prev = s;
  a->slabs = s;
  b->ptr = base;
  b->size = size;
  b->slab = s;
  b->free = 1;
  a->slab_bytes += size;
  a->slabs_n++;
  a->slab_allocs++;
  cache_totals(k, (int64_t)size, 0, 0);
  return b;
}

static void cache_slab_unlink(struct gmb_cache *k, struct cache_arena *a,
                              struct cache_slab *s) {
  if (s->prev)
    s->prev->next = s->next;
  else
    a->slabs = s->next;
  if (s->next) s->next->prev = s->prev;
  a->slab_bytes -= s->size;
  a->slabs_n--;
  a->slab_frees++;
  cache_totals(k, -(int64_t)s->size, 0, 0);
  free(s->first);
  free(s);
}

/* 1 when slab s is one free block that waits for no stream work: it can
 * go back to the backend. */
static int cache_slab_idle(const struct cache_slab *s) {
  const struct cache_block *b = s->first;
  return b->free && b->next == NULL && b->ev == NULL;
}

/* Gives idle slab s of arena a (whose lock is held) back to the backend:
 * unlinks it, drops the lock, and frees it with no lock held (a message
 * to the broker).  Returns its size. */
static uint64_t cache_slab_give_back(struct gmb_cache *k,
                                     struct cache_arena *a,
                                     struct cache_slab *s) {
  uint64_t id = s->id, size = s->size;
  cache_bin_remove(a, s->first);
  cache_slab_unlink(k, a, s);
  pthread_mutex_unlock(&a->mu);
  k->ops.slab_free(k->ops.ctx, id);
  return size;
}

/* --- handing out ------------------------------------------------------- */

/* Splits the rest of free block b (in no bin, already marked handed out)
 * off as a free block that keeps b's stream and event, leaving b `need`
 * bytes.  The rest goes beside the neighbour in use, not against the
 * slab's edge: when b ends its slab after a block in use, b is cut from
 * the end ([in use][rest][b]), so that the neighbour's free merges with
 * the rest into one hole; cut from the start ([in use][b][rest]) the two
 * would stay apart until b too is freed.  When out of memory b keeps the
 * rest (waste, not an error). */
static void cache_split(struct gmb_cache *k, struct cache_arena *a,
                        struct cache_block *b, uint64_t need) {
  struct cache_block *r = calloc(1, sizeof *r);
  if (r == NULL) return;
  r->size = b->size - need;
  r->slab = b->slab;
  r->free = 1;
  r->stream = b->stream;
  r->thread = b->thread;
  r->ev = b->ev;
  if (r->ev) r->ev->refs++;
  if (b->prev && b->next == NULL) {
    r->ptr = b->ptr;
    b->ptr += r->size;
    r->prev = b->prev;
    r->next = b;
    b->prev->next = r;
    b->prev = r;
  } else {
    r->ptr = b->ptr + need;
    r->prev = b;
    r->next = b->next;
    if (b->next) b->next->prev = r;
    b->next = r;
  }
  b->size = need;
  cache_coalesce(k, a, r); /* a neighbour may be free and ready */
}

/* Takes free block b (in no bin) for a request of `req` bytes (need:
 * rounded to 512): splits off the rest (cache_split; b may then start
 * further on) and records b as handed out.  0 or GMB_E_SYSTEM. */
static int cache_take(struct gmb_cache *k, struct cache_arena *a,
                      struct cache_block *b, uint64_t need) {
  if (a->hash_n >= a->hash_cap && cache_hash_grow(a) != 0) {
    cache_bin_insert(a, b);
    return GMB_E_SYSTEM;
  }
  b->free = 0; /* before the rest is split off: it must not merge back */
  /* A large block keeps a small rest: it could serve only large
   * requests, and in the large pool a sliver is waste either way. */
  uint64_t min_rest = b->slab->pool == CACHE_POOL_SMALL
                          ? GMB_CACHE_ALIGN
                          : GMB_CACHE_LARGE_ROUND;
  if (b->size - need >= min_rest) cache_split(k, a, b, need);
  cache_event_unref(k, a, b->ev);
  b->ev = NULL;
  b->stream = NULL;
  b->req = need;
  cache_hash_put(a, b);
  a->in_use_blocks += b->size;
  a->in_use_req += need;
  if (a->in_use_req > a->peak_req) a->peak_req = a->in_use_req;
  cache_totals(k, 0, (int64_t)need, (int64_t)b->size);
  return 0;
}

/* 1 when free block b is its slab's only block: the slab is wholly free. */
static int cache_block_whole(const struct cache_block *b) {
  return b->prev == NULL && b->next == NULL;
}

/* The best free block of `pool` for `need` bytes usable on `stream`,
 * taken out of its bin; NULL when none.  Best: the smallest in the first
 * bin that has one, among blocks of slabs that have a block in use; a
 * wholly free slab (the smallest that fits) only when no such block
 * fits.  Cutting a wholly free slab pins it for as long as the block
 * lives, while one left whole can serve a request as large as itself or
 * go back (cache_shed, the trim); a hole beside blocks in use can do
 * neither. */
static struct cache_block *cache_find(struct gmb_cache *k,
                                      struct cache_arena *a, int pool,
                                      uint64_t need, void *stream) {
  struct cache_pool *p = &a->pool[pool];
restart:;
  struct cache_block *whole = NULL;
  for (unsigned i = cache_bin_next(p, cache_bin(need)); i < CACHE_BINS;
       i = cache_bin_next(p, i + 1)) {
    struct cache_block *best = NULL;
    unsigned seen = 0;
    for (struct cache_block *b = p->bins[i]; b && seen < CACHE_SCAN_MAX;
         b = b->fnext, seen++) {
      if (b->size < need || (best && b->size >= best->size)) continue;
      int promoted = 0;
      if (!cache_usable(k, a, b, stream, &promoted)) continue;
      if (promoted) {
        /* Now ready: it may merge with its neighbours, which changes the
         * lists being walked.  Merge, then look again (each promotion
         * drops an event, so this ends). */
        cache_bin_remove(a, b);
        cache_coalesce(k, a, b);
        goto restart;
      }
      if (!cache_block_whole(b))
        best = b;
      else if (whole == NULL || b->size < whole->size)
        whole = b;
    }
    if (best) {
      cache_bin_remove(a, best);
      return best;
    }
  }
  if (whole) cache_bin_remove(a, whole);
  return whole;
}

/* The largest idle slab of arena a smaller than `below`, of `pool` or,
 * for -1, of either; NULL when none.  Holds a's lock. */
static struct cache_slab *cache_largest_idle(struct cache_arena *a, int pool,
                                             uint64_t below) {
  struct cache_slab *pick = NULL;
  for (struct cache_slab *s = a->slabs; s; s = s->next)
    if ((pool < 0 || s->pool == pool) && s->size < below &&
        cache_slab_idle(s) && (pick == NULL || s->size > pick->size))
      pick = s;
  return pick;
}

/* 1 when arena a, grown by a slab of `slab` bytes for a request of `need`
 * bytes, would hold more than its slack allows: GMB_CACHE_SLACK_PCT
 * percent over the most it ever handed out (this request counted), plus
 * GMB_CACHE_SLACK_FLOOR.  Holds a's lock. */
static int cache_over_slack(const struct cache_arena *a, uint64_t need,
                            uint64_t slab) {
  uint64_t peak = a->in_use_req + need;
  if (a->peak_req > peak) peak = a->peak_req;
  return a->slab_bytes + slab >
         peak + peak / 100 * GMB_CACHE_SLACK_PCT + GMB_CACHE_SLACK_FLOOR;
}

/* On a miss, before asking for a slab of `slab` bytes for `need`: gives
 * back this arena's idle slabs, first (a large request) the large ones
 * smaller than `need`, up to `slab` bytes: none of them could serve it,
 * and without this a pattern of growing requests would keep every
 * smaller slab it ever made; then, largest first, any while the arena
 * is over its slack (cache_over_slack).  The slack bounds the cache's
 * peak directly, as a fraction of the program's own peak: the peak of
 * slab bytes is made on a miss, so a miss is where to look.  A cap on
 * the free bytes after each free, against the bytes in use at that
 * moment, would give back what a program that frees everything between
 * steps (a training loop) needs again at once.  Takes and releases a's
 * lock; each slab goes back with no lock held. */
static void cache_shed(struct gmb_cache *k, struct cache_arena *a, int pool,
                       uint64_t need, uint64_t slab) {
  uint64_t dropped = 0;
  for (;;) {
    pthread_mutex_lock(&a->mu);
    struct cache_slab *pick = NULL;
    if (pool == CACHE_POOL_LARGE && dropped < slab)
      pick = cache_largest_idle(a, CACHE_POOL_LARGE, need);
    int drop = pick != NULL;
    if (pick == NULL && cache_over_slack(a, need, slab))
      pick = cache_largest_idle(a, -1, UINT64_MAX);
    if (pick == NULL) {
      pthread_mutex_unlock(&a->mu);
      return;
    }
    uint64_t size = cache_slab_give_back(k, a, pick);
    if (drop) dropped += size;
  }
}

static void cache_pending_poll(struct gmb_cache *k, struct cache_arena *a);

int gmb__cache_alloc(struct gmb_cache *k, size_t size, void *stream,
                     void **ptr) {
  if (k == NULL || ptr == NULL) return GMB_E_INVAL;
  *ptr = NULL;
  if (size == 0 || (uint64_t)size > GMB_CACHE_MAX) return GMB_E_INVAL;
  /* Streams ignored without events (the host device). */
  stream = k->ops.event_query == NULL ? NULL : cache_stream(stream);
  uint64_t need = cache_round(size, GMB_CACHE_ALIGN);
  int pool = need <= GMB_CACHE_SMALL_MAX ? CACHE_POOL_SMALL : CACHE_POOL_LARGE;
  struct cache_arena *a = &k->arena[cache_arena_of(k)];

  pthread_mutex_lock(&a->mu);
  if (a->pending) cache_pending_poll(k, a);
  struct cache_block *b = cache_find(k, a, pool, need, stream);
  if (b) {
    int rc = cache_take(k, a, b, need);
    if (rc == 0) {
      a->hits++;
      *ptr = (void *)b->ptr;
    }
    pthread_mutex_unlock(&a->mu);
    return rc;
  }
  a->misses++;
  pthread_mutex_unlock(&a->mu);

  /* A miss: a new slab, with no lock held while the broker answers.  On a
   * quota or a full device, the cache's own wholly free slabs go back
   * first and the request is tried once more (as PyTorch frees its
   * cache before it reports out of memory). */
  uint64_t slab = pool == CACHE_POOL_SMALL
                      ? GMB_CACHE_SMALL_SLAB
                      : cache_round(need, GMB_CACHE_LARGE_ROUND);
  uint64_t id = 0;
  uintptr_t base = 0;
  cache_shed(k, a, pool, need, slab);
  int rc = k->ops.slab_alloc(k->ops.ctx, slab, &id, &base);
  if (rc == GMB_E_QUOTA || rc == GMB_E_NOMEM) {
    uint64_t released = 0;
    gmb__cache_trim(k, 0, &released);
    if (released) rc = k->ops.slab_alloc(k->ops.ctx, slab, &id, &base);
  }
  if (rc) return rc;
  pthread_mutex_lock(&a->mu);
  b = cache_slab_link(k, a, id, base, slab, pool);
  if (b == NULL) {
    pthread_mutex_unlock(&a->mu);
    k->ops.slab_free(k->ops.ctx, id);
    return GMB_E_SYSTEM;
  }
  rc = cache_take(k, a, b, need);
  if (rc == 0) *ptr = (void *)b->ptr;
  pthread_mutex_unlock(&a->mu);
  return rc;
}

/* --- freeing ----------------------------------------------------------- */

/* 1 when p lies in a free or pending block of one of a's slabs: a double
 * free (the block freed first may have merged with a neighbour since, so
 * p need not start a block any more).  Holds a's lock. */
static int cache_is_free_block(struct cache_arena *a, uintptr_t p) {
  for (struct cache_slab *s = a->slabs; s; s = s->next) {
    if (p < s->base || p - s->base >= s->size) continue;
    for (struct cache_block *b = s->first; b; b = b->next)
      if (p >= b->ptr && p - b->ptr < b->size) return b->free || b->pending;
    return 0;
  }
  return 0;
}

/* An event of the arena recorded on `stream` now: 0 with *out (one
 * reference, the next sequence number), or the backend's code with
 * nothing changed.  Holds a's lock. */
static int cache_event_record(struct gmb_cache *k, struct cache_arena *a,
                              void *stream, struct cache_event **out) {
  struct cache_event *e = a->spare_events;
  if (e) {
    a->spare_events = e->next;
  } else {
    e = calloc(1, sizeof *e);
    int rc = e ? k->ops.event_new(k->ops.ctx, &e->h) : GMB_E_SYSTEM;
    if (rc) {
      free(e);
      return rc;
    }
  }
  int rc = k->ops.event_record(k->ops.ctx, e->h, stream);
  if (rc) {
    e->next = a->spare_events;
    a->spare_events = e;
    return rc;
  }
  e->refs = 1;
  e->seq = ++a->seq;
  e->next = NULL;
  *out = e;
  return 0;
}

static void cache_uses_clear(struct cache_block *b) {
  free(b->uses);
  b->uses = NULL;
  b->n_uses = b->cap_uses = 0;
}

/* A pending block whose waits all completed becomes a free block of its
 * free's stream and event.  Holds a's lock. */
static void cache_pending_release(struct gmb_cache *k, struct cache_arena *a,
                                  struct cache_block *b) {
  if (b->fprev)
    b->fprev->fnext = b->fnext;
  else
    a->pending = b->fnext;
  if (b->fnext) b->fnext->fprev = b->fprev;
  b->fprev = b->fnext = NULL;
  a->pending_n--;
  free(b->waits);
  b->waits = NULL;
  b->n_waits = 0;
  b->pending = 0;
  a->in_use_blocks -= b->size;
  a->in_use_req -= b->req;
  cache_totals(k, 0, -(int64_t)b->req, -(int64_t)b->size);
  b->free = 1;
  b->req = 0;
  cache_coalesce(k, a, b);
}

/* Looks at a's pending blocks: drops the waits that completed and
 * releases the blocks that wait for nothing more.  Never waits.  Holds
 * a's lock. */
static void cache_pending_poll(struct gmb_cache *k, struct cache_arena *a) {
  struct cache_block *b = a->pending;
  while (b) {
    struct cache_block *next = b->fnext;
    uint32_t n = 0;
    for (uint32_t i = 0; i < b->n_waits; i++) {
      struct cache_event *e = b->waits[i];
      if (k->ops.event_query(k->ops.ctx, e->h) == 1)
        cache_event_unref(k, a, e);
      else
        b->waits[n++] = e;
    }
    b->n_waits = n;
    if (n == 0) cache_pending_release(k, a, b);
    b = next;
  }
}

/* Frees block b (taken out of the hash) of arena a on `stream` (as the
 * cache keeps it).  Holds a's lock.  0, or an event's failure with b put
 * back in the hash and nothing else changed. */
static int cache_release(struct gmb_cache *k, struct cache_arena *a,
                         struct cache_block *b, void *stream) {
  struct cache_event *e = NULL;
  unsigned me = cache_me();
  if (k->ops.event_record == NULL) cache_uses_clear(b);
  /* The other streams that use it first: an event on each (the free's
   * own stream needs none beyond the free's). */
  struct cache_event **waits = NULL;
  uint32_t nw = 0;
  int rc = 0;
  if (b->n_uses) {
    waits = calloc(b->n_uses, sizeof *waits);
    if (waits == NULL) rc = GMB_E_SYSTEM;
    for (uint32_t i = 0; rc == 0 && i < b->n_uses; i++) {
      if (cache_same_stream(b->uses[i], me, stream, me)) continue;
      rc = cache_event_record(k, a, b->uses[i], &waits[nw]);
      if (rc == 0) nw++;
    }
  }
  if (rc == 0 && k->ops.event_record) rc = cache_event_record(k, a, stream, &e);
  if (rc) {
    for (uint32_t i = 0; i < nw; i++) cache_event_unref(k, a, waits[i]);
    free(waits);
    cache_hash_put(a, b);
    return rc;
  }
  cache_uses_clear(b);
  b->stream = e ? stream : NULL;
  b->thread = me;
  b->ev = e;
  if (nw) {
    /* Pending: still counted as handed out until its other streams ran
     * past the free. */
    b->pending = 1;
    b->waits = waits;
    b->n_waits = nw;
    b->fprev = NULL;
    b->fnext = a->pending;
    if (a->pending) a->pending->fprev = b;
    a->pending = b;
    a->pending_n++;
    return 0;
  }
  free(waits);
  a->in_use_blocks -= b->size;
  a->in_use_req -= b->req;
  cache_totals(k, 0, -(int64_t)b->req, -(int64_t)b->size);
  b->free = 1;
  b->req = 0;
  cache_coalesce(k, a, b);
  return 0;
}

/* Takes the handed-out block at p out of its arena's hash, with that
 * arena's lock held (the caller unlocks *ap).  NULL with no lock held when
 * no arena handed it out; then *dup says whether p lies in free or
 * pending memory (a double free). */
static struct cache_block *cache_lookup(struct gmb_cache *k, uintptr_t p,
                                        struct cache_arena **ap, int *dup) {
  unsigned first = cache_arena_of(k);
  /* The calling thread's arena first: most blocks are freed by the thread
   * that took them. */
  for (unsigned j = 0; j < k->n; j++) {
    struct cache_arena *a = &k->arena[(first + j) % k->n];
    pthread_mutex_lock(&a->mu);
    struct cache_block *b = cache_hash_take(a, p);
    if (b) {
      *ap = a;
      return b;
    }
    pthread_mutex_unlock(&a->mu);
  }
  /* Not handed out: say whether it is a double free (slow; errors only). */
  *dup = 0;
  for (unsigned j = 0; j < k->n && !*dup; j++) {
    pthread_mutex_lock(&k->arena[j].mu);
    *dup = cache_is_free_block(&k->arena[j], p);
    pthread_mutex_unlock(&k->arena[j].mu);
  }
  return NULL;
}

int gmb__cache_free(struct gmb_cache *k, void *ptr, void *stream) {
  if (k == NULL) return GMB_E_INVAL;
  if (ptr == NULL) return GMB_E_NOENT;
  stream = k->ops.event_query == NULL ? NULL : cache_stream(stream);
  struct cache_arena *a;
  int dup;
  struct cache_block *b = cache_lookup(k, (uintptr_t)ptr, &a, &dup);
  if (b == NULL) return dup ? GMB_E_INVAL : GMB_E_NOENT;
  int rc = cache_release(k, a, b, stream);
  pthread_mutex_unlock(&a->mu);
  return rc;
}

int gmb__cache_record_stream(struct gmb_cache *k, void *ptr, void *stream) {
  if (k == NULL) return GMB_E_INVAL;
  if (ptr == NULL) return GMB_E_NOENT;
  stream = cache_stream(stream);
  if (stream == CACHE_STREAM_PER_THREAD) return GMB_E_INVAL;
  struct cache_arena *a;
  int dup;
  struct cache_block *b = cache_lookup(k, (uintptr_t)ptr, &a, &dup);
  if (b == NULL) return dup ? GMB_E_INVAL : GMB_E_NOENT;
  int rc = 0;
  /* Streams do not count on the host device: nothing to remember. */
  if (k->ops.event_record) {
    uint32_t i = 0;
    while (i < b->n_uses && b->uses[i] != stream) i++;
    if (i == b->n_uses) {
      if (b->n_uses == b->cap_uses) {
        uint32_t cap = b->cap_uses ? b->cap_uses * 2 : 2;
        void **u = realloc(b->uses, cap * sizeof *u);
        if (u == NULL) {
          rc = GMB_E_SYSTEM;
        } else {
          b->uses = u;
          b->cap_uses = cap;
        }
      }
      if (rc == 0) b->uses[b->n_uses++] = stream;
    }
  }
  cache_hash_put(a, b);
  pthread_mutex_unlock(&a->mu);
  return rc;
}

/* --- trimming ------------------------------------------------------------ */

int gmb__cache_trim(struct gmb_cache *k, uint64_t keep, uint64_t *released) {
  uint64_t done = 0;
  if (released) *released = 0;
  if (k == NULL) return GMB_E_INVAL;
  for (unsigned j = 0; j < k->n; j++) {
    struct cache_arena *a = &k->arena[j];
    for (;;) {
      /* The largest wholly free, ready slab of this arena; its id is
       * given back with no lock held. */
      pthread_mutex_lock(&a->mu);
      if (a->pending) cache_pending_poll(k, a);
      uint64_t cached = atomic_load(&k->slab_bytes) -
                        atomic_load(&k->blocks_out);
      struct cache_slab *best = NULL;
      for (struct cache_slab *s = a->slabs; s; s = s->next) {
        /* A slab of blocks whose events all completed is one block once
         * they are made ready: promote, then look at the whole. */
        for (struct cache_block *x = s->first; x; x = x->next) {
          /* Merging may give x a neighbour's event that completed
           * too: promote until it waits for nothing or for work that is
           * not done. */
          while (x->free && cache_promote(k, a, x)) {
            cache_bin_remove(a, x);
            x = cache_coalesce(k, a, x);
          }
        }
        if (cache_slab_idle(s) && (best == NULL || s->size > best->size))
          best = s;
      }
      if (best == NULL || cached <= keep) {
        pthread_mutex_unlock(&a->mu);
        break;
      }
      done += cache_slab_give_back(k, a, best);
    }
  }
  if (released) *released = done;
  return 0;
}

/* --- the rest of the interface ---------------------------------------------- */

struct gmb_cache *gmb__cache_new(const struct gmb_cache_ops *ops,
                                 unsigned arenas) {
  if (ops == NULL || ops->slab_alloc == NULL || ops->slab_free == NULL)
    return NULL;
  int ev = (ops->event_new != NULL) + (ops->event_record != NULL) +
           (ops->event_query != NULL) + (ops->event_destroy != NULL);
  if (ev != 0 && ev != 4) return NULL;
  struct gmb_cache *k = calloc(1, sizeof *k);
  if (k == NULL) return NULL;
  k->ops = *ops;
  k->n = arenas ? arenas : CACHE_DEFAULT_ARENAS;
  k->arena = calloc(k->n, sizeof *k->arena);
  if (k->arena == NULL) {
    free(k);
    return NULL;
  }
  for (unsigned i = 0; i < k->n; i++) pthread_mutex_init(&k->arena[i].mu, NULL);
  return k;
}

void gmb__cache_destroy(struct gmb_cache *k) {
  if (k == NULL) return;
  for (unsigned i = 0; i < k->n; i++) {
    struct cache_arena *a = &k->arena[i];
    /* Events are named by free blocks (each once per reference) and by
     * the spare list; collect each once. */
    struct cache_event *dead = a->spare_events;
    struct cache_slab *s = a->slabs;
    while (s) {
      struct cache_slab *ns = s->next;
      struct cache_block *b = s->first;
      while (b) {
        struct cache_block *nb = b->next;
        if (b->ev && --b->ev->refs == 0) {
          b->ev->next = dead;
          dead = b->ev;
        }
        for (uint32_t w = 0; w < b->n_waits; w++)
          if (--b->waits[w]->refs == 0) {
            b->waits[w]->next = dead;
            dead = b->waits[w];
          }
        free(b->waits);
        free(b->uses);
        free(b);
        b = nb;
      }
      free(s);
      s = ns;
    }
    while (dead) {
      struct cache_event *n = dead->next;
      if (k->ops.event_destroy) k->ops.event_destroy(k->ops.ctx, dead->h);
      free(dead);
      dead = n;
    }
    free(a->hash);
    pthread_mutex_destroy(&a->mu);
  }
  free(k->arena);
  free(k);
}

uint64_t gmb__cache_cached(struct gmb_cache *k) {
  if (k == NULL) return 0;
  uint64_t s = atomic_load(&k->slab_bytes), o = atomic_load(&k->blocks_out);
  return s > o ? s - o : 0;
}

void gmb__cache_counters(struct gmb_cache *k, struct gmb_cache_counters *out) {
  memset(out, 0, sizeof *out);
  if (k == NULL) return;
  for (unsigned i = 0; i < k->n; i++) {
    struct cache_arena *a = &k->arena[i];
    pthread_mutex_lock(&a->mu);
    out->hits += a->hits;
    out->misses += a->misses;
    out->slab_allocs += a->slab_allocs;
    out->slab_frees += a->slab_frees;
    out->slabs += a->slabs_n;
    out->slab_bytes += a->slab_bytes;
    out->in_use += a->in_use_req;
    out->cached += a->slab_bytes - a->in_use_blocks;
    pthread_mutex_unlock(&a->mu);
  }
  out->peak_in_use = atomic_load(&k->peak_in_use);
  out->peak_slab_bytes = atomic_load(&k->peak_slab_bytes);
}

/* --- the checker ------------------------------------------------------------ */

#define CACHE_BAD(...)                                 \
  do {                                                 \
    fprintf(stderr, "cache_check: " __VA_ARGS__);     \
    fputc('\n', stderr);                               \
    bad++;                                             \
  } while (0)

static int cache_check_arena(struct cache_arena *a, unsigned ai,
                             uint64_t *slab_sum, uint64_t *req_sum,
                             uint64_t *out_sum) {
  int bad = 0;
  uint64_t slab_bytes = 0, slabs = 0, in_blocks = 0, in_req = 0, nfree = 0,
           nout = 0, npend = 0;
  for (struct cache_slab *s = a->slabs; s; s = s->next) {
    if (s->next && s->next->prev != s) CACHE_BAD("arena %u: slab list links", ai);
    slab_bytes += s->size;
    slabs++;
    uintptr_t at = s->base;
    struct cache_block *prev = NULL;
    for (struct cache_block *b = s->first; b; prev = b, b = b->next) {
      if (b->prev != prev) CACHE_BAD("arena %u: block %#lx: prev link", ai,
                                     (unsigned long)b->ptr);
      if (b->slab != s) CACHE_BAD("arena %u: block %#lx: wrong slab", ai,
                                  (unsigned long)b->ptr);
      if (b->ptr != at) CACHE_BAD("arena %u: block %#lx: gap or overlap at "
                                  "%#lx", ai, (unsigned long)b->ptr,
                                  (unsigned long)at);
      if (b->size == 0 || b->size % GMB_CACHE_ALIGN)
        CACHE_BAD("arena %u: block %#lx: size %llu", ai,
                  (unsigned long)b->ptr, (unsigned long long)b->size);
      at = b->ptr + b->size;
      if (prev && cache_mergeable(prev, b))
        CACHE_BAD("arena %u: free blocks %#lx and %#lx not merged", ai,
                  (unsigned long)prev->ptr, (unsigned long)b->ptr);
      if (b->free) {
        nfree++;
        if (b->req) CACHE_BAD("arena %u: free block with a request", ai);
        /* In its bin? */
        struct cache_block *x = a->pool[s->pool].bins[cache_bin(b->size)];
        while (x && x != b) x = x->fnext;
        if (x == NULL) CACHE_BAD("arena %u: free block %#lx in no bin", ai,
                                 (unsigned long)b->ptr);
        if (b->ev && b->ev->refs == 0)
          CACHE_BAD("arena %u: event with no references", ai);
        if (b->pending || b->n_waits || b->n_uses)
          CACHE_BAD("arena %u: free block %#lx with waits or uses", ai,
                    (unsigned long)b->ptr);
      } else {
        nout++;
        in_blocks += b->size;
        in_req += b->req;
        if (b->req == 0 || b->req > b->size)
          CACHE_BAD("arena %u: block %#lx: request %llu of %llu", ai,
                    (unsigned long)b->ptr, (unsigned long long)b->req,
                    (unsigned long long)b->size);
        if (b->pending) {
          npend++;
          struct cache_block *x = a->pending;
          while (x && x != b) x = x->fnext;
          if (x == NULL) CACHE_BAD("arena %u: pending block %#lx not in the "
                                   "pending list", ai, (unsigned long)b->ptr);
          if (b->n_waits == 0 || b->n_uses)
            CACHE_BAD("arena %u: pending block %#lx waits for %u, uses %u",
                      ai, (unsigned long)b->ptr, b->n_waits, b->n_uses);
          for (uint32_t w = 0; w < b->n_waits; w++)
            if (b->waits[w] == NULL || b->waits[w]->refs != 1)
              CACHE_BAD("arena %u: pending block %#lx: wait %u", ai,
                        (unsigned long)b->ptr, w);
          continue;
        }
        if (b->ev) CACHE_BAD("arena %u: handed-out block with an event", ai);
        if (b->n_waits) CACHE_BAD("arena %u: handed-out block with waits", ai);
        size_t h = a->hash_cap ? cache_hash_of(b->ptr, a->hash_cap) : 0;
        struct cache_block *x = a->hash_cap ? a->hash[h] : NULL;
        while (x && x != b) x = x->hnext;
        if (x == NULL) CACHE_BAD("arena %u: handed-out block %#lx not in the "
                                 "hash", ai, (unsigned long)b->ptr);
      }
    }
    if (at != s->base + s->size)
      CACHE_BAD("arena %u: slab %llu: blocks end at %#lx, not %#lx", ai,
                (unsigned long long)s->id, (unsigned long)at,
                (unsigned long)(s->base + s->size));
  }
  /* Bins: only free blocks of the right size and pool; bitmap matches. */
  uint64_t inbins = 0;
  for (int p = 0; p < 2; p++)
    for (unsigned i = 0; i < CACHE_BINS; i++) {
      int bit = !!(a->pool[p].bitmap[i / 64] & (UINT64_C(1) << (i % 64)));
      if (bit != (a->pool[p].bins[i] != NULL))
        CACHE_BAD("arena %u: pool %d bin %u: bitmap bit %d", ai, p, i, bit);
      struct cache_block *prev = NULL;
      for (struct cache_block *b = a->pool[p].bins[i]; b;
           prev = b, b = b->fnext) {
        inbins++;
        if (b->fprev != prev) CACHE_BAD("arena %u: bin %u: links", ai, i);
        if (!b->free || cache_bin(b->size) != i || b->slab->pool != p)
          CACHE_BAD("arena %u: bin %u holds block %#lx (free %d, size %llu)",
                    ai, i, (unsigned long)b->ptr, b->free,
                    (unsigned long long)b->size);
        if (inbins > nfree + 1) break; /* a cycle: counted below */
      }
    }
  if (inbins != nfree)
    CACHE_BAD("arena %u: %llu blocks in bins, %llu free", ai,
              (unsigned long long)inbins, (unsigned long long)nfree);
  if (a->hash_n != nout - npend)
    CACHE_BAD("arena %u: hash holds %zu, %llu handed out, %llu of them "
              "pending", ai, a->hash_n, (unsigned long long)nout,
              (unsigned long long)npend);
  uint64_t inlist = 0;
  for (struct cache_block *b = a->pending; b && inlist <= npend; b = b->fnext)
    inlist++;
  if (inlist != npend || a->pending_n != npend)
    CACHE_BAD("arena %u: pending list holds %llu (counted %zu), %llu pending",
              ai, (unsigned long long)inlist, a->pending_n,
              (unsigned long long)npend);
  /* Event references: count the blocks naming each event. */
  for (struct cache_slab *s = a->slabs; s; s = s->next)
    for (struct cache_block *b = s->first; b; b = b->next) {
      if (!(b->free || b->pending) || b->ev == NULL) continue;
      uint32_t n = 0;
      for (struct cache_slab *t = a->slabs; t; t = t->next)
        for (struct cache_block *c = t->first; c; c = c->next)
          n += (c->free || c->pending) && c->ev == b->ev;
      if (n != b->ev->refs)
        CACHE_BAD("arena %u: event named by %u blocks has %u references",
                  ai, n, b->ev->refs);
    }
  for (struct cache_event *e = a->spare_events; e; e = e->next)
    if (e->refs) CACHE_BAD("arena %u: spare event with references", ai);
  if (slab_bytes != a->slab_bytes || slabs != a->slabs_n)
    CACHE_BAD("arena %u: %llu slabs of %llu bytes, counted %llu of %llu", ai,
              (unsigned long long)slabs, (unsigned long long)slab_bytes,
              (unsigned long long)a->slabs_n,
              (unsigned long long)a->slab_bytes);
  if (a->peak_req < a->in_use_req)
    CACHE_BAD("arena %u: peak in use %llu below in use %llu", ai,
              (unsigned long long)a->peak_req,
              (unsigned long long)a->in_use_req);
  if (in_blocks != a->in_use_blocks || in_req != a->in_use_req)
    CACHE_BAD("arena %u: handed out %llu (%llu asked), counted %llu (%llu)",
              ai, (unsigned long long)in_blocks, (unsigned long long)in_req,
              (unsigned long long)a->in_use_blocks,
              (unsigned long long)a->in_use_req);
  *slab_sum += slab_bytes;
  *req_sum += in_req;
  *out_sum += in_blocks;
  return bad;
}

int gmb__cache_check(struct gmb_cache *k) {
  if (k == NULL) return 0;
  int bad = 0;
  uint64_t slab = 0, req = 0, out = 0;
  for (unsigned i = 0; i < k->n; i++) pthread_mutex_lock(&k->arena[i].mu);
  for (unsigned i = 0; i < k->n; i++)
    bad += cache_check_arena(&k->arena[i], i, &slab, &req, &out);
  if (slab != atomic_load(&k->slab_bytes) || req != atomic_load(&k->in_use) ||
      out != atomic_load(&k->blocks_out))
    CACHE_BAD("totals: slabs %llu, in use %llu, out %llu; arenas sum to "
              "%llu, %llu, %llu",
              (unsigned long long)atomic_load(&k->slab_bytes),
              (unsigned long long)atomic_load(&k->in_use),
              (unsigned long long)atomic_load(&k->blocks_out),
              (unsigned long long)slab, (unsigned long long)req,
              (unsigned long long)out);
  if (atomic_load(&k->peak_in_use) < req ||
      atomic_load(&k->peak_slab_bytes) < slab)
    CACHE_BAD("a peak is below the current figure");
  for (unsigned i = k->n; i-- > 0;) pthread_mutex_unlock(&k->arena[i].mu);
  return bad;
}
