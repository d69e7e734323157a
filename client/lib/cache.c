/*
 * cache.c - the stream-ordered cache of gmb_malloc_async/gmb_free_async:
 * arenas of pages.
 *
 * Each arena (a part of the cache with its own lock; a thread uses the one
 * its thread number picks) reserves address space in spans (GMB_CACHE_SPAN
 * bytes each, more for a larger request) and maps physical memory behind
 * it in pages (GMB_CACHE_PAGE, the GPU's VMM granularity), as PyTorch's
 * expandable segments do.  Blocks tile each span exactly, in address
 * order, and are of four kinds:
 *  - LIVE: handed out (in the arena's hash, keyed by address), or pending
 *    (freed, waiting for other streams' work: in the pending list);
 *  - FREE: free memory in mapped pages, in one bin list;
 *  - VIRT: address space with no page mapped, page aligned at both ends,
 *    in its span's list of such ranges;
 *  - MAPPING: a range taken by a miss while its pages are being mapped
 *    with no lock held (neither free nor handed out); LOST: a page whose
 *    address another mapping of the process took (page_move), never used.
 * Blocks cross page boundaries freely: a large block is a run of pages and
 * its last page's rest serves other blocks; nothing needs contiguous
 * physical memory.  A page is mapped exactly when a LIVE, FREE or MAPPING
 * block lies on it (MAPPING: or is about to), and each page counts the
 * LIVE and MAPPING blocks on it (`users`).  A mapped page with no users
 * is *idle*: only free memory lies on it, so it can be unmapped and given
 * back whatever its neighbours hold (the range stays reserved, as VIRT,
 * and is mapped again on demand), or moved under a range that a miss
 * needs (page_move: no message, no new memory).
 *
 * Placement.  A request takes the best fit among free blocks (bins of
 * four sub-classes per power of two), preferring one on a page that holds
 * blocks in use over one that lies on idle pages only, so that live memory
 * packs into few pages and the free memory between stays in whole pages
 * that can go back; it is cut from the start of that block (address
 * order: on the fragmentation traces this refused fewer requests than
 * cutting from the end that touches a block in use, docs/benchmarks.md).
 * A request no free block serves (a miss) takes the
 * range that needs the fewest new pages: a VIRT range with the free ends
 * of its neighbours; its pages come from the arena's idle pages (moved)
 * and only then from the broker.  So the cache never asks for a page
 * while it holds an idle one (the slack rule: what it holds beyond what
 * is in use is free memory on pages with blocks in use, plus idle pages
 * nothing has needed since they went idle).  Idle pages go back on
 * gmb__cache_trim (gmb_trim, the broker's trim ask) and before a refused
 * request is tried again.
 *
 * Streams: a free block remembers the stream it was freed on and is
 * reusable at once on that stream (work on one stream runs in order).  No
 * driver call is made at the free: an event is recorded on that stream
 * only when another stream wants the block (or a trim wants its page), and
 * once it completed the block is *ready* for every stream.  The
 * per-thread default stream (0x2) is the exception: it is recorded on at
 * the free, since no other thread can record on it later.  Two free
 * neighbours merge when one is ready or both are of one stream (keeping
 * the later event when both have one, else none: a later record covers
 * both).  Without event functions (the host device) every free block is
 * ready.  Stream handles as CUDA spells them: 0x1 (CU_STREAM_LEGACY) is
 * stored as NULL.
 *
 * Other streams (gmb__cache_record_stream, torch's record_stream): a
 * handed-out block may name streams other than the one it will be freed
 * on that use it too.  Its free then records an event on each of them and
 * parks the block *pending* (LIVE, in the arena's pending list, not in the
 * hash) until every one of those events completed.
 *
 * Invariants (gmb__cache_check counts violations of each):
 *  - the blocks of a span tile it; sizes are non-zero multiples of
 *    GMB_CACHE_ALIGN; VIRT and LOST blocks are page aligned, LOST ones
 *    one page; no two VIRT blocks are neighbours, no two free neighbours
 *    are mergeable;
 *  - a page is mapped iff no VIRT or LOST block lies on it, except under
 *    a MAPPING block; its users are the LIVE and MAPPING blocks on it; the
 *    arena's counts of mapped and idle pages are the sums;
 *  - every FREE block is in exactly the bin list of its size, every VIRT
 *    block in its span's list once; every handed-out block in the hash
 *    once, every pending one in the pending list once; nothing else in
 *    any of them; the bitmap has a bit for exactly the non-empty bins;
 *  - an event's reference count is the number of blocks that name it;
 *  - the arena's byte counts are the sums of its pages and blocks, and the
 *    cache's totals the sums over its arenas.
 *
 * Locks: each arena has a mutex.  No lock is held across a message to the
 * broker (page_map, page_free): a miss marks its range MAPPING, unlocks,
 * maps, and locks again to hand the block out; a trim unmaps under the
 * lock and gives the pages back after it.  Totals are atomics, updated
 * under the arena lock.  Nothing takes two arena locks at once except the
 * checker, which takes them all in index order.
 *
 * The cache never trusts what it is given: a pointer it did not hand out,
 * or one already free, is an error that changes nothing.
 */
#include "cache.h"
#include "cache_impl.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gmb.h"

/* --- threads and streams ---------------------------------------------- */

/* The thread-local words of the hot path are of the initial-exec model:
 * a load at a fixed offset from the thread pointer.  In libgmb.so and the
 * shims (shared objects, dlopen'd by PyTorch) the default model calls
 * __tls_get_addr on every access, a few nanoseconds each on a path of a
 * hundred.  They take 24 bytes of the static TLS that glibc keeps spare
 * for such libraries. */
#define CACHE_TLS __attribute__((tls_model("initial-exec")))

static _Atomic unsigned cache_next_thread;
static _Thread_local unsigned cache_thread CACHE_TLS; /* 0: not numbered yet */

/* The calling thread's number (from 1). */
static unsigned cache_me(void) {
  if (cache_thread == 0)
    cache_thread = atomic_fetch_add(&cache_next_thread, 1) + 1;
  return cache_thread;
}

static unsigned cache_arena_of(const struct gmb_cache *k) {
  return cache_me() % k->n;
}

/* The calling thread's current tag (cache_sleep.c sets it): the arena
 * `idx` of the cache of generation `gen`; idx 0: none.  Static beside
 * cache_thread, so that the hot path reads it as cheaply. */
static _Thread_local struct {
  uint64_t gen;
  unsigned idx;
} cache_tls CACHE_TLS;

void gmb__cache_tls_set(const struct gmb_cache *k, unsigned idx) {
  cache_tls.gen = k->gen;
  cache_tls.idx = idx;
}

unsigned gmb__cache_tls_idx(const struct gmb_cache *k) {
  return cache_tls.idx && cache_tls.gen == k->gen ? cache_tls.idx : 0;
}

/* The arena that serves the calling thread's requests: its tag's, else
 * the one its number picks.  Untagged threads pay one thread-local load. */
static inline struct cache_arena *cache_arena_pick(struct gmb_cache *k) {
  if (__builtin_expect(cache_tls.idx != 0, 0) && cache_tls.gen == k->gen)
    return &k->arena[cache_tls.idx];
  return &k->arena[cache_arena_of(k)];
}

static void *cache_stream(void *stream) {
  return stream == CACHE_STREAM_LEGACY ? NULL : stream;
}

/* --- sizes, pages and bins --------------------------------------------- */

/* Counts a LIVE or MAPPING block on (d = 1) or off (d = -1) every page
 * that [lo, hi) touches, keeping the idle count. */
static void cache_users(struct gmb_cache *k, struct cache_arena *a,
                        struct cache_span *s, uintptr_t lo, uintptr_t hi,
                        int d) {
  struct cache_page *pg = cache_pg(k, s, lo), *end = cache_pg(k, s, hi - 1);
  int64_t idle = 0;
  for (; pg <= end; pg++) {
    if (d > 0) {
      if (pg->users++ == 0 && pg->pg.id) idle--;
    } else {
      if (--pg->users == 0 && pg->pg.id) idle++;
    }
  }
  if (idle) {
    a->idle += (uint64_t)idle;
    cache_totals(k, 0, idle * (int64_t)k->page, 0);
  }
}

static void cache_bin_insert(struct cache_arena *a, struct cache_block *b) {
  unsigned i = cache_bin(b->size);
  b->fprev = NULL;
  b->fnext = a->bins[i];
  if (a->bins[i]) a->bins[i]->fprev = b;
  a->bins[i] = b;
  a->bitmap[i / 64] |= UINT64_C(1) << (i % 64);
}

static void cache_bin_remove(struct cache_arena *a, struct cache_block *b) {
  unsigned i = cache_bin(b->size);
  if (b->fprev)
    b->fprev->fnext = b->fnext;
  else
    a->bins[i] = b->fnext;
  if (b->fnext) b->fnext->fprev = b->fprev;
  b->fprev = b->fnext = NULL;
  if (a->bins[i] == NULL) a->bitmap[i / 64] &= ~(UINT64_C(1) << (i % 64));
}

/* The first non-empty bin at or after i, or CACHE_BINS. */
static unsigned cache_bin_next(const struct cache_arena *a, unsigned i) {
  while (i < CACHE_BINS) {
    uint64_t w = a->bitmap[i / 64] & (~UINT64_C(0) << (i % 64));
    if (w) return (i / 64) * 64 + (unsigned)__builtin_ctzll(w);
    i = (i / 64 + 1) * 64;
  }
  return CACHE_BINS;
}

/* The last non-empty bin at or below i, or CACHE_BINS when none. */
static unsigned cache_bin_prev(const struct cache_arena *a, unsigned i) {
  for (;;) {
    uint64_t w = a->bitmap[i / 64];
    if (i % 64 != 63) w &= (UINT64_C(1) << (i % 64 + 1)) - 1;
    if (w) return (i / 64) * 64 + 63u - (unsigned)__builtin_clzll(w);
    if (i < 64) return CACHE_BINS;
    i = (i / 64) * 64 - 1;
  }
}

static void cache_virt_insert(struct cache_span *s, struct cache_block *b) {
  b->fprev = NULL;
  b->fnext = s->virt;
  if (s->virt) s->virt->fprev = b;
  s->virt = b;
}

static void cache_virt_remove(struct cache_span *s, struct cache_block *b) {
  if (b->fprev)
    b->fprev->fnext = b->fnext;
  else
    s->virt = b->fnext;
  if (b->fnext) b->fnext->fprev = b->fprev;
  b->fprev = b->fnext = NULL;
}

/* --- the address list ---------------------------------------------------- */

/* Makes the zeroed record b the block [ptr, ptr+size) of `state`, linked
 * after `at` (NULL: first of the span).  NULL when b is NULL. */
static struct cache_block *cache_block_link(struct cache_block *b,
                                            struct cache_span *s,
                                            struct cache_block *at,
                                            uintptr_t ptr, uint64_t size,
                                            int state) {
  if (b == NULL) return NULL;
  b->ptr = ptr;
  b->size = size;
  b->span = s;
  b->state = (uint8_t)state;
  b->prev = at;
  b->next = at ? at->next : s->first;
  if (b->next) b->next->prev = b;
  if (at)
    at->next = b;
  else
    s->first = b;
  return b;
}

/* A zeroed block record: one of the arena's spare records, else a new
 * one; NULL when out of memory.  Every hit that splits a free block and
 * every free that merges one takes or gives back a record, so the arena
 * keeps up to CACHE_SPARE_BLOCKS of them rather than calling malloc and
 * free on each.  Holds a's lock. */
static struct cache_block *cache_rec_get(struct cache_arena *a) {
  struct cache_block *b = a->spare_blocks;
  if (b == NULL) return calloc(1, sizeof *b);
  a->spare_blocks = b->fnext;
  a->n_spare_blocks--;
  memset(b, 0, sizeof *b);
  return b;
}

/* Gives record b (linked nowhere) back.  Holds a's lock. */
static void cache_rec_put(struct cache_arena *a, struct cache_block *b) {
  if (b->uses) free(b->uses);
  if (b->waits) free(b->waits);
  if (a->n_spare_blocks + 1 > CACHE_SPARE_BLOCKS) {
    free(b);
    return;
  }
  b->fnext = a->spare_blocks;
  a->spare_blocks = b;
  a->n_spare_blocks++;
}

/* A new block, as cache_block_link; NULL when out of memory (nothing
 * linked). */
static struct cache_block *cache_block_new(struct cache_arena *a,
                                           struct cache_span *s,
                                           struct cache_block *at,
                                           uintptr_t ptr, uint64_t size,
                                           int state) {
  return cache_block_link(cache_rec_get(a), s, at, ptr, size, state);
}

static void cache_block_unlink(struct cache_arena *a, struct cache_block *b) {
  if (b->prev)
    b->prev->next = b->next;
  else
    b->span->first = b->next;
  if (b->next) b->next->prev = b->prev;
  cache_rec_put(a, b);
}

/* --- the hash of handed-out blocks -------------------------------------- */

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

static void cache_event_unref(struct cache_arena *a, struct cache_event *e) {
  if (e == NULL || --e->refs) return;
  e->next = a->spare_events;
  a->spare_events = e;
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

/* Makes free block b ready when the work of its stream is known to be
 * done: its event completed (an event is recorded now when it has none
 * and `ask`).  1 when b became ready.  A stream that takes no event makes
 * b an orphan, ready only after a sync; one that captures into a graph
 * now leaves b as it was (a later look records).  Holds a's lock. */
static int cache_promote(struct gmb_cache *k, struct cache_arena *a,
                         struct cache_block *b, int ask) {
  if (b->ready) return 0;
  if (b->ev == NULL) {
    if (!ask || b->orphan) return 0;
    /* Another thread's per-thread stream cannot be recorded on from here;
     * its frees record at once, so such a block always has its event. */
    int rc = cache_event_record(k, a, b->stream, &b->ev);
    if (rc == GMB_CACHE_CAPTURING) return 0;
    if (rc != 0) {
      b->orphan = 1;
      return 0;
    }
  }
  if (k->ops.event_query(k->ops.ctx, b->ev->h) != 1) return 0;
  cache_event_unref(a, b->ev);
  b->ev = NULL;
  b->stream = NULL;
  b->ready = 1;
  return 1;
}

/* --- merging ----------------------------------------------------------- */

/* Merges free block y (x's next neighbour) into x; neither is in a bin.
 * The merged block is ready when both were; else of the other's stream,
 * with the later event when both have one, else none. */
static void cache_merge(struct cache_arena *a, struct cache_block *x,
                        struct cache_block *y) {
  if (x->ready && !y->ready) {
    x->ready = 0;
    x->stream = y->stream;
    x->thread = y->thread;
    x->ev = y->ev;
    y->ev = NULL;
  } else if (!x->ready && !y->ready) {
    if (x->ev && y->ev && y->ev->seq > x->ev->seq) {
      cache_event_unref(a, x->ev);
      x->ev = y->ev;
      y->ev = NULL;
    } else if (x->ev == NULL || y->ev == NULL) {
      cache_event_unref(a, x->ev);
      x->ev = NULL;
    }
  }
  cache_event_unref(a, y->ev);
  y->ev = NULL;
  x->size += y->size;
  cache_block_unlink(a, y);
}

/* Merges FREE block b (in no bin) with its mergeable neighbours, puts the
 * result into its bin and returns it. */
static struct cache_block *cache_coalesce(struct cache_arena *a,
                                          struct cache_block *b) {
  if (b->next && cache_mergeable(b, b->next)) {
    cache_bin_remove(a, b->next);
    cache_merge(a, b, b->next);
  }
  if (b->prev && cache_mergeable(b->prev, b)) {
    struct cache_block *p = b->prev;
    cache_bin_remove(a, p);
    cache_merge(a, p, b);
    b = p;
  }
  cache_bin_insert(a, b);
  return b;
}

/* Merges VIRT block b (in no list) with VIRT neighbours, puts the result
 * into its span's list and returns it. */
static struct cache_block *cache_virt_settle(struct cache_arena *a,
                                            struct cache_block *b) {
  struct cache_span *s = b->span;
  if (b->next && b->next->state == CACHE_VIRT) {
    cache_virt_remove(s, b->next);
    b->size += b->next->size;
    cache_block_unlink(a, b->next);
  }
  if (b->prev && b->prev->state == CACHE_VIRT) {
    struct cache_block *p = b->prev;
    cache_virt_remove(s, p);
    p->size += b->size;
    cache_block_unlink(a, b);
    b = p;
  }
  cache_virt_insert(s, b);
  return b;
}

/* A MAPPING block whose mapping failed becomes free memory of `stream`
 * (the request's) where its pages are mapped and VIRT where they are not, split at the page
 * boundaries where that changes; its users must already be counted off.
 * Its pages were filled lowest first, so it is at most three pieces
 * (mapped, unmapped, mapped: the free ends of its neighbours and the pages
 * mapped before the failure): the records for the two splits are given
 * (spare, taken when used), so that nothing here can fail.  Holds a's
 * lock. */
static void cache_settle(struct gmb_cache *k, struct cache_arena *a,
                         struct cache_block *b, struct cache_block **spare,
                         void *stream) {
  struct cache_span *s = b->span;
  const uintptr_t end = b->ptr + b->size;
  unsigned used = 0;
  while (b) {
    int mapped = cache_pg(k, s, b->ptr)->pg.id != 0;
    uintptr_t cut = cache_pfloor(k, b->ptr) + k->page;
    while (cut < end && (cache_pg(k, s, cut)->pg.id != 0) == mapped)
      cut += k->page;
    if (cut > end) cut = end;
    struct cache_block *rest = NULL;
    if (cut < end) {
      struct cache_block *r = used < 2 ? spare[used] : NULL;
      if (r) spare[used++] = NULL;
      rest = cache_block_link(r ? r : cache_rec_get(a), s, b, cut,
                              end - cut, CACHE_MAPPING);
    }
    b->size = (rest ? cut : end) - b->ptr;
    /* Its mapped memory may be the free ends of neighbours that were
     * usable on `stream` only: it stays `stream`'s (a later record of an
     * event covers the rest too). */
    b->ready = mapped && !cache_events(k);
    b->stream = mapped && !b->ready ? stream : NULL;
    b->thread = cache_me();
    b->ev = NULL;
    if (mapped) {
      b->state = CACHE_FREE;
      cache_coalesce(a, b);
    } else {
      b->state = CACHE_VIRT;
      cache_virt_settle(a, b);
    }
    b = rest;
  }
}

/* --- handing out ----------------------------------------------------- */

/* Cuts the rest of FREE block b (in no bin, already marked LIVE) off its
 * end as a free block of b's stream and event, leaving b `need` bytes.
 * When out of memory b keeps the rest (waste, not an error). */
static void cache_split(struct cache_arena *a, struct cache_block *b,
                        uint64_t need) {
  struct cache_block *r =
      cache_block_new(a, b->span, b, b->ptr + need, b->size - need,
                      CACHE_FREE);
  if (r == NULL) return;
  r->ready = b->ready;
  r->stream = b->stream;
  r->thread = b->thread;
  r->ev = b->ev;
  if (r->ev) r->ev->refs++;
  b->size = need;
  cache_coalesce(a, r); /* a neighbour may be free and mergeable */
}

/* Hands out block b (counted on its pages) for a request of `need` bytes
 * (b->size >= need; the rest already cut off or kept).  The hash has
 * room (cache_hash_grow). */
static void cache_hand_out(struct gmb_cache *k, struct cache_arena *a,
                           struct cache_block *b, uint64_t need) {
  b->state = CACHE_LIVE;
  cache_event_unref(a, b->ev);
  b->ev = NULL;
  b->stream = NULL;
  b->ready = 0;
  b->req = need;
  cache_hash_put(a, b);
  a->in_use_blocks += b->size;
  a->in_use_req += need;
  if (a->in_use_req > a->peak_req) a->peak_req = a->in_use_req;
  cache_totals(k, 0, 0, (int64_t)need);
}

/* Takes FREE block b (in no bin) for `need` bytes: cut from its start,
 * counted on its pages, handed out.  0 or GMB_E_SYSTEM (b back in its bin). */
static int cache_take(struct gmb_cache *k, struct cache_arena *a,
                      struct cache_block *b, uint64_t need) {
  if (a->hash_n >= a->hash_cap && cache_hash_grow(a) != 0) {
    cache_bin_insert(a, b);
    return GMB_E_SYSTEM;
  }
  b->state = CACHE_LIVE; /* before the rest is cut off: no merging back */
  if (b->size > need)
    cache_split(a, b, need);
  cache_users(k, a, b->span, b->ptr, b->ptr + b->size, 1);
  cache_hand_out(k, a, b, need);
  return 0;
}

/* 1 when free block b lies on a page that holds a block in use. */
static int cache_touches_live(const struct gmb_cache *k,
                              const struct cache_block *b) {
  return cache_pg(k, b->span, b->ptr)->users > 0 ||
         cache_pg(k, b->span, b->ptr + b->size - 1)->users > 0;
}

/* The best free block for `need` bytes usable on `stream`, taken out of
 * its bin; NULL when none.  Best: the smallest in the first bin that has
 * one among blocks on pages with blocks in use; one that lies on idle
 * pages only (the smallest that fits) only when no such block fits:
 * cutting it pins an idle page, which could otherwise go back or be
 * moved to serve a miss. */
static struct cache_block *cache_find(struct gmb_cache *k,
                                      struct cache_arena *a, uint64_t need,
                                      void *stream) {
  unsigned me = cache_me();
restart:;
  struct cache_block *whole = NULL;
  for (unsigned i = cache_bin_next(a, cache_bin(need)); i < CACHE_BINS;
       i = cache_bin_next(a, i + 1)) {
    struct cache_block *best = NULL;
    unsigned seen = 0;
    for (struct cache_block *b = a->bins[i]; b && seen < CACHE_SCAN_MAX;
         b = b->fnext, seen++) {
      if (b->size < need || (best && b->size >= best->size)) continue;
      if (!b->ready &&
          !cache_same_stream(b->stream, b->thread, stream, me)) {
        if (!cache_promote(k, a, b, 1)) continue;
        /* Now ready: it may merge with its neighbours, which changes the
         * lists being walked.  Merge, then look again (each promotion
         * makes a block ready for good, so this ends). */
        cache_bin_remove(a, b);
        cache_coalesce(a, b);
        goto restart;
      }
      if (cache_touches_live(k, b))
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

/* --- spans ------------------------------------------------------------ */

/* A new span of at least `need` bytes, one VIRT block; NULL when the
 * backend or host memory refused.  Holds a's lock. */
static struct cache_span *cache_span_new(struct gmb_cache *k,
                                         struct cache_arena *a, uint64_t need,
                                         int *rc) {
  uint64_t size = cache_round(need, k->page);
  if (size < k->span) size = k->span;
  struct cache_span *s = calloc(1, sizeof *s);
  struct cache_page *pages = s ? calloc(size >> k->shift, sizeof *pages) : NULL;
  if (pages == NULL) {
    free(s);
    *rc = GMB_E_SYSTEM;
    return NULL;
  }
  s->size = size;
  s->npages = size >> k->shift;
  s->page = pages;
  *rc = k->ops.reserve(k->ops.ctx, size, &s->base);
  struct cache_block *b = NULL;
  if (*rc == 0) {
    b = cache_block_new(a, s, NULL, s->base, size, CACHE_VIRT);
    if (b == NULL) {
      k->ops.unreserve(k->ops.ctx, s->base, size);
      *rc = GMB_E_SYSTEM;
    }
  }
  if (*rc) {
    free(pages);
    free(s);
    return NULL;
  }
  cache_virt_insert(s, b);
  s->next = a->spans;
  a->spans = s;
  return s;
}

/* --- misses ------------------------------------------------------------- */

struct cache_plan {
  struct cache_block *v; /* the VIRT block the range maps pages in */
  uintptr_t xs;          /* the block's start */
  uint64_t pages;        /* pages to map: fewest wins */
};

/* 1 when free block f (a neighbour of a VIRT block) may be part of a
 * block for `stream` now, without a driver call. */
static int cache_plan_usable(const struct cache_block *f, void *stream) {
  return f && f->state == CACHE_FREE && !f->orphan &&
         (f->ready || cache_same_stream(f->stream, f->thread, stream,
                                        cache_me()));
}

static void cache_plan_try(const struct gmb_cache *k, struct cache_block *v,
                           uint64_t need, void *stream,
                           struct cache_plan *best) {
  uint64_t lf = cache_plan_usable(v->prev, stream) ? v->prev->size : 0;
  uint64_t rf = cache_plan_usable(v->next, stream) ? v->next->size : 0;
  if (lf + v->size + rf < need) return;
  uint64_t vpages = v->size >> k->shift;
  /* From the free end of the left neighbour, or up to the free start of
   * the right one; a neighbour that alone holds the request is not a
   * miss's business (the bins serve it). */
  if (need > lf) {
    uint64_t n = cache_round(need - lf, k->page) >> k->shift;
    if (n > vpages) n = vpages;
    if (best->v == NULL || n < best->pages) {
      best->v = v;
      best->xs = v->ptr - lf;
      best->pages = n;
    }
  }
  if (need > rf) {
    uint64_t n = cache_round(need - rf, k->page) >> k->shift;
    if (n > vpages) n = vpages;
    if (best->v == NULL || n < best->pages) {
      best->v = v;
      best->xs = v->ptr + v->size + rf - need;
      best->pages = n;
    }
  }
}

/* The range that serves `need` bytes with the fewest new pages, among the
 * arena's VIRT blocks and their free neighbours.  It stops at the first
 * that needs one page (none can need fewer: the neighbours alone do not
 * serve the request). */
static void cache_plan(struct gmb_cache *k, struct cache_arena *a,
                       uint64_t need, void *stream, struct cache_plan *best) {
  memset(best, 0, sizeof *best);
  for (struct cache_span *s = a->spans; s; s = s->next)
    for (struct cache_block *v = s->virt; v; v = v->fnext) {
      cache_plan_try(k, v, need, stream, best);
      if (best->v && best->pages <= 1) return;
    }
}

/* Turns the plan's range into one MAPPING block M = the block [xs,
 * xs+need) widened to whole pages where it lies in the VIRT block: the
 * free neighbours shrink, the VIRT block's rest stays VIRT.  Returns M
 * (counted on its pages), or NULL when out of host memory (nothing
 * changed). */
static struct cache_block *cache_carve(struct gmb_cache *k,
                                       struct cache_arena *a,
                                       const struct cache_plan *pl,
                                       uint64_t need) {
  struct cache_block *v = pl->v;
  struct cache_span *s = v->span;
  uintptr_t xs = pl->xs, xe = xs + need, vs = v->ptr, ve = v->ptr + v->size;
  uintptr_t ms = xs < vs ? xs : cache_pfloor(k, xs);
  uintptr_t me = xe > ve ? xe : cache_pceil(k, xe);
  uintptr_t lo = ms > vs ? ms : vs, hi = me < ve ? me : ve; /* pages */
  /* Records for the VIRT rests first, so that a failure changes nothing. */
  struct cache_block *lv = NULL, *rv = NULL;
  if (lo > vs && (lv = cache_block_new(a, s, v->prev, vs, lo - vs,
                                       CACHE_VIRT)) == NULL)
    return NULL;
  if (hi < ve && (rv = cache_block_new(a, s, v, hi, ve - hi, CACHE_VIRT)) ==
                     NULL) {
    if (lv) cache_block_unlink(a, lv);
    return NULL;
  }
  cache_virt_remove(s, v);
  if (lv) cache_virt_insert(s, lv);
  if (rv) cache_virt_insert(s, rv);
  if (ms < vs) { /* the left neighbour's free end */
    struct cache_block *f = v->prev;
    cache_bin_remove(a, f);
    f->size -= vs - ms;
    if (f->size)
      cache_bin_insert(a, f);
    else {
      cache_event_unref(a, f->ev);
      cache_block_unlink(a, f);
    }
  }
  if (me > ve) { /* the right neighbour's free start */
    struct cache_block *f = v->next;
    cache_bin_remove(a, f);
    f->ptr += me - ve;
    f->size -= me - ve;
    if (f->size)
      cache_bin_insert(a, f);
    else {
      cache_event_unref(a, f->ev);
      cache_block_unlink(a, f);
    }
  }
  v->ptr = ms;
  v->size = me - ms;
  v->state = CACHE_MAPPING;
  cache_users(k, a, s, ms, me, 1);
  return v;
}

/* An idle page of arena a whose free memory no stream can still use,
 * detached: the page's range becomes VIRT (not merged yet, in no list)
 * and is returned with the page's address in *addr; NULL when none.  Looks
 * at free blocks of at least a page: an idle page lies inside exactly one
 * free block once its free neighbours merged, and that block must be
 * ready.  `smallest`: the smallest such blocks first (a miss moving pages:
 * a page taken out of a large free run would split the very run that
 * serves the next large request without a miss; the lone idle pages
 * between blocks in use go first), else the largest first (a trim).
 * With `ask`, a block whose stream's work is not known to be done gets an
 * event recorded, so that a later look finds out.  Holds a's lock. */
static struct cache_block *cache_idle_take(struct gmb_cache *k,
                                           struct cache_arena *a, int ask,
                                           int smallest, uintptr_t *addr) {
  if (a->idle == 0) return NULL;
  const unsigned lowest = cache_bin(k->page);
restart:
  for (unsigned i = smallest ? cache_bin_next(a, lowest)
                             : cache_bin_prev(a, CACHE_BINS - 1);
       i < CACHE_BINS && i >= lowest;
       i = smallest ? cache_bin_next(a, i + 1)
           : i      ? cache_bin_prev(a, i - 1)
                    : CACHE_BINS) {
    for (struct cache_block *b = a->bins[i]; b; b = b->fnext) {
      uintptr_t p0 = cache_pceil(k, b->ptr);
      uintptr_t p1 = cache_pfloor(k, b->ptr + b->size);
      if (p1 <= p0) continue;
      if (!b->ready) {
        if (!cache_promote(k, a, b, ask)) continue;
        /* Ready now: merge with ready neighbours first (the lists being
         * walked change), then look again. */
        cache_bin_remove(a, b);
        cache_coalesce(a, b);
        goto restart;
      }
      /* Whole pages inside a free block hold no block in use.  Records
       * first, so that a failure changes nothing. */
      uintptr_t end = b->ptr + b->size;
      struct cache_block *pv = NULL, *r = NULL;
      if (b->ptr < p0 && (pv = cache_rec_get(a)) == NULL) return NULL;
      if (end > p0 + k->page && (r = cache_rec_get(a)) == NULL) {
        if (pv) cache_rec_put(a, pv);
        return NULL;
      }
      cache_bin_remove(a, b);
      if (pv) {
        cache_block_link(pv, b->span, b, p0, end - p0, CACHE_VIRT);
        b->size = p0 - b->ptr;
        cache_bin_insert(a, b);
      } else {
        pv = b;
        pv->state = CACHE_VIRT;
        pv->ready = 0;
      }
      if (r) {
        cache_block_link(r, pv->span, pv, p0 + k->page, end - p0 - k->page,
                         CACHE_FREE);
        r->ready = 1;
        pv->size = k->page;
        cache_bin_insert(a, r);
      }
      *addr = p0;
      return pv;
    }
  }
  return NULL;
}

/* Unmaps the page at `addr` of span s (detached by cache_idle_take): its
 * physical page goes to *out, the counts drop.  Holds a's lock. */
static void cache_page_drop(struct gmb_cache *k, struct cache_arena *a,
                            struct cache_span *s, uintptr_t addr,
                            struct gmb_cache_page *out) {
  struct cache_page *pg = cache_pg(k, s, addr);
  *out = pg->pg;
  memset(&pg->pg, 0, sizeof pg->pg);
  a->mapped--;
  a->idle--;
  cache_totals(k, -(int64_t)k->page, -(int64_t)k->page, 0);
}

/* Fills the pages of MAPPING block m that are not mapped with idle pages
 * of the same arena, moved (page_move), lowest first.  Returns how many
 * pages it filled.  Holds a's lock. */
static uint64_t cache_fill_moved(struct gmb_cache *k, struct cache_arena *a,
                                 struct cache_block *m) {
  if (k->ops.page_move == NULL) return 0;
  struct cache_span *s = m->span;
  uint64_t moved = 0;
  for (uintptr_t p = cache_pfloor(k, m->ptr); p < m->ptr + m->size;
       p += k->page) {
    struct cache_page *dst = cache_pg(k, s, p);
    if (dst->pg.id) continue;
    uintptr_t from;
    struct cache_block *pv = cache_idle_take(k, a, 0, 1, &from);
    if (pv == NULL) break;
    struct cache_page *src = cache_pg(k, pv->span, from);
    struct gmb_cache_page pg = src->pg;
    int rc = k->ops.page_move(k->ops.ctx, from, p, &pg);
    if (rc < 0) {
      /* Not moved: the page stays where it was, free. */
      pv->state = CACHE_FREE;
      pv->ready = 1;
      cache_coalesce(a, pv);
      break;
    }
    memset(&src->pg, 0, sizeof src->pg);
    dst->pg = pg;
    a->idle--; /* the page under m has users: no longer idle */
    cache_totals(k, 0, -(int64_t)k->page, 0);
    if (rc == 1) {
      pv->state = CACHE_LOST;
      pv->span->lost = 1;
    } else {
      cache_virt_settle(a, pv);
    }
    a->page_moves++;
    moved++;
  }
  return moved;
}

/* The bytes of MAPPING block m on pages already mapped: what the miss
 * takes out of the holes and idle pages (its pages not mapped yet are not
 * held, so they are no holes to leave out).  Holds a's lock, or m is this
 * thread's. */
static uint64_t cache_mapping_held(const struct gmb_cache *k,
                                   const struct cache_block *m) {
  uint64_t bytes = m->size;
  for (uintptr_t p = cache_pfloor(k, m->ptr); p < m->ptr + m->size;
       p += k->page)
    if (cache_pg(k, m->span, p)->pg.id == 0) bytes -= k->page;
  return bytes;
}

/* Maps the pages of MAPPING block m that are not mapped yet, from the
 * broker, with no lock held (m is this thread's): each run of them in
 * requests of up to GMB_CACHE_BATCH pages, so that the broker sees one
 * request (its quota, its holds while caches give memory back) where the
 * miss needs many pages.  Each page mapped joins *mapping (k->mapping's
 * share of m) as it joins the bytes held, so that the holes a request
 * carries are the free bytes between blocks, none of m's.  0, or the
 * backend's code with the pages mapped so far recorded. */
static int cache_fill_mapped(struct gmb_cache *k, struct cache_arena *a,
                             struct cache_block *m, uint64_t *mapping) {
  struct cache_span *s = m->span;
  const uintptr_t end = m->ptr + m->size;
  int rc = 0;
  uintptr_t p = cache_pfloor(k, m->ptr);
  while (rc == 0 && p < end) {
    /* Safe to read unlocked: only the owner of the MAPPING block changes
     * the pages under it. */
    if (cache_pg(k, s, p)->pg.id) {
      p += k->page;
      continue;
    }
    unsigned n = 1;
    while (n < GMB_CACHE_BATCH && p + n * k->page < end &&
           cache_pg(k, s, p + n * k->page)->pg.id == 0)
      n++;
    /* What the miss asks for after these: its unmapped pages further on. */
    uint64_t ahead = 0;
    for (uintptr_t q = p + n * k->page; q < end; q += k->page)
      ahead += cache_pg(k, s, q)->pg.id ? 0 : k->page;
    struct gmb_cache_page got[GMB_CACHE_BATCH];
    memset(got, 0, n * sizeof got[0]);
    rc = k->ops.page_map(k->ops.ctx, p, n, ahead, got);
    for (unsigned i = 0; rc == 0 && i < n; i++)
      if (got[i].id == 0) rc = GMB_E_PROTO; /* a backend's bug */
    if (rc) break;
    pthread_mutex_lock(&a->mu);
    for (unsigned i = 0; i < n; i++) cache_pg(k, s, p + i * k->page)->pg = got[i];
    a->mapped += n;
    a->page_maps += n;
    cache_totals(k, (int64_t)(n * k->page), 0, 0);
    atomic_fetch_add(&k->mapping, n * k->page);
    *mapping += n * k->page;
    pthread_mutex_unlock(&a->mu);
    p += n * k->page;
  }
  return rc;
}

/* A miss: maps the fewest pages that serve `need` bytes on `stream`.
 * Takes a's lock and gives it back. */
static int cache_miss(struct gmb_cache *k, struct cache_arena *a,
                      uint64_t need, void *stream, void **ptr) {
  /* The records that cutting up the range may need later, when the lock
   * has been given up once: taken now, so that nothing fails then. */
  struct cache_block *spare[2] = {calloc(1, sizeof(struct cache_block)),
                                  calloc(1, sizeof(struct cache_block))};
  int rc = spare[0] && spare[1] ? 0 : GMB_E_SYSTEM;
  struct cache_plan pl = {0};
  struct cache_block *m = NULL;
  pthread_mutex_lock(&a->mu);
  if (rc == 0 && a->state != CACHE_RUNNING) rc = GMB_E_INVAL; /* paused */
  if (rc == 0 && a->hash_n >= a->hash_cap) rc = cache_hash_grow(a);
  if (rc == 0) {
    cache_plan(k, a, need, stream, &pl);
    if (pl.v == NULL && cache_span_new(k, a, need, &rc) != NULL)
      cache_plan(k, a, need, stream, &pl);
  }
  if (rc == 0 && (m = pl.v ? cache_carve(k, a, &pl, need) : NULL) == NULL)
    rc = GMB_E_SYSTEM;
  if (rc) {
    pthread_mutex_unlock(&a->mu);
    free(spare[0]);
    free(spare[1]);
    return rc;
  }
  cache_fill_moved(k, a, m);
  a->inflight++; /* a pause of a's tag waits for it */
  /* gmb__cache_holes leaves out m's bytes on mapped pages; its pages
   * still to map are not held (counting them would take the request's
   * own size off the holes it carries). */
  uint64_t mapping = cache_mapping_held(k, m);
  atomic_fetch_add(&k->mapping, mapping);
  pthread_mutex_unlock(&a->mu);

  rc = cache_fill_mapped(k, a, m, &mapping);

  pthread_mutex_lock(&a->mu);
  a->inflight--;
  atomic_fetch_sub(&k->mapping, mapping);
  cache_users(k, a, m->span, m->ptr, m->ptr + m->size, -1);
  if (rc) {
    cache_settle(k, a, m, spare, stream);
  } else {
    /* Every page of m is mapped: [xs, xs+need) is handed out, the rest
     * of m (in its new pages) is free memory. */
    const uintptr_t xs = pl.xs, me = m->ptr + m->size;
    struct cache_block *b = m;
    if (xs > m->ptr) {
      b = cache_block_link(spare[0], m->span, m, xs, me - xs, CACHE_MAPPING);
      spare[0] = NULL;
      m->size = xs - m->ptr;
      m->state = CACHE_FREE;
      m->ready = 1; /* in new pages */
      m->stream = NULL;
      cache_coalesce(a, m);
    }
    if (b->size > need) {
      struct cache_block *r = cache_block_link(spare[1], b->span, b, xs + need,
                                               b->size - need, CACHE_FREE);
      spare[1] = NULL;
      r->ready = 1;
      b->size = need;
      cache_coalesce(a, r);
    }
    cache_users(k, a, b->span, b->ptr, b->ptr + b->size, 1);
    cache_hand_out(k, a, b, need);
    *ptr = (void *)b->ptr;
  }
  pthread_mutex_unlock(&a->mu);
  free(spare[0]);
  free(spare[1]);
  return rc;
}

static void cache_pending_poll(struct gmb_cache *k, struct cache_arena *a);

int gmb__cache_alloc(struct gmb_cache *k, size_t size, void *stream,
                     void **ptr) {
  if (k == NULL || ptr == NULL) return GMB_E_INVAL;
  *ptr = NULL;
  if (size == 0 || (uint64_t)size > GMB_CACHE_MAX) return GMB_E_INVAL;
  /* Streams ignored without events (the host device). */
  stream = cache_events(k) ? cache_stream(stream) : NULL;
  uint64_t need = cache_round(size, GMB_CACHE_ALIGN);
  struct cache_arena *a = cache_arena_pick(k);

  pthread_mutex_lock(&a->mu);
  if (__builtin_expect(a->state != CACHE_RUNNING, 0)) {
    pthread_mutex_unlock(&a->mu);
    return GMB_E_INVAL; /* a paused tag's: gmb__cache_tag_paused says so */
  }
  if (a->pending) cache_pending_poll(k, a);
  struct cache_block *b = cache_find(k, a, need, stream);
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

  int rc = cache_miss(k, a, need, stream, ptr);
  if (rc == GMB_E_QUOTA || rc == GMB_E_NOMEM) {
    /* The idle pages of every arena go back before the request is tried
     * once more (as PyTorch frees its cache before it reports out of
     * memory). */
    uint64_t released = 0;
    gmb__cache_trim(k, 0, 0, &released);
    if (released) rc = cache_miss(k, a, need, stream, ptr);
  }
  return rc;
}

/* --- freeing ----------------------------------------------------------- */

/* 1 when p lies in free, given-back or pending memory of one of a's spans:
 * a double free or a free after a trim (the block freed first may have
 * merged since, so p need not start a block any more).  Holds a's lock. */
static int cache_is_free_block(struct cache_arena *a, uintptr_t p) {
  for (struct cache_span *s = a->spans; s; s = s->next) {
    if (p < s->base || p - s->base >= s->size) continue;
    for (struct cache_block *b = s->first; b; b = b->next)
      if (p >= b->ptr && p - b->ptr < b->size)
        return b->state == CACHE_FREE || b->state == CACHE_VIRT ||
               b->pending;
    return 0;
  }
  return 0;
}

static void cache_uses_clear(struct cache_block *b) {
  free(b->uses);
  b->uses = NULL;
  b->n_uses = b->cap_uses = 0;
}

/* LIVE block b (out of the hash and the pending list) becomes free memory
 * of `stream` (ready on a cache without events), with event e (may be
 * NULL).  Holds a's lock. */
static void cache_to_free(struct gmb_cache *k, struct cache_arena *a,
                          struct cache_block *b, void *stream,
                          unsigned thread, struct cache_event *e) {
  a->in_use_blocks -= b->size;
  a->in_use_req -= b->req;
  cache_totals(k, 0, 0, -(int64_t)b->req);
  cache_users(k, a, b->span, b->ptr, b->ptr + b->size, -1);
  b->state = CACHE_FREE;
  b->req = 0;
  b->ready = !cache_events(k);
  b->stream = b->ready ? NULL : stream;
  b->thread = thread;
  b->ev = e;
  cache_coalesce(a, b);
}

/* A pending block whose waits all completed becomes free memory of its
 * free's stream.  Holds a's lock. */
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
  struct cache_event *e = b->ev;
  b->ev = NULL;
  cache_to_free(k, a, b, b->stream, b->thread, e);
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
        cache_event_unref(a, e);
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
  unsigned me = cache_me();
  if (!cache_events(k)) {
    cache_uses_clear(b);
    cache_to_free(k, a, b, NULL, me, NULL);
    return 0;
  }
  /* The other streams that use it: an event on each.  The free's own
   * stream needs none (reuse on it is ordered; another stream records
   * when it wants the block), except the per-thread default stream,
   * which only this thread can record on. */
  struct cache_event **waits = NULL;
  struct cache_event *e = NULL;
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
  if (rc == 0 && stream == CACHE_STREAM_PER_THREAD)
    rc = cache_event_record(k, a, stream, &e);
  if (rc == GMB_CACHE_CAPTURING) rc = GMB_E_INVAL; /* the free's answer */
  if (rc) {
    for (uint32_t i = 0; i < nw; i++) cache_event_unref(a, waits[i]);
    free(waits);
    cache_hash_put(a, b);
    return rc;
  }
  cache_uses_clear(b);
  if (nw) {
    /* Pending: still counted as handed out until its other streams ran
     * past the free. */
    b->pending = 1;
    b->stream = stream;
    b->thread = me;
    b->ev = e;
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
  cache_to_free(k, a, b, stream, me, e);
  return 0;
}

/* Takes the handed-out block at p out of its arena's hash, with that
 * arena's lock held (the caller unlocks *ap).  NULL with no lock held when
 * no arena handed it out; then *dup says whether p lies in free or
 * pending memory (a double free). */
static struct cache_block *cache_lookup(struct gmb_cache *k, uintptr_t p,
                                        struct cache_arena **ap, int *dup) {
  unsigned first = cache_arena_of(k);
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
  /* Tag arenas after the others: an untagged free finds its block as
   * fast as before. */
  const unsigned all = cache_arenas(k);
  for (unsigned j = k->n; j < all; j++) {
    struct cache_arena *a = &k->arena[j];
    pthread_mutex_lock(&a->mu);
    struct cache_block *b = cache_hash_take(a, p);
    if (b) {
      *ap = a;
      return b;
    }
    pthread_mutex_unlock(&a->mu);
  }
  *dup = 0;
  for (unsigned j = 0; j < all && !*dup; j++) {
    pthread_mutex_lock(&k->arena[j].mu);
    *dup = cache_is_free_block(&k->arena[j], p);
    pthread_mutex_unlock(&k->arena[j].mu);
  }
  return NULL;
}

int gmb__cache_free(struct gmb_cache *k, void *ptr, void *stream) {
  if (k == NULL) return GMB_E_INVAL;
  if (ptr == NULL) return GMB_E_NOENT;
  stream = cache_events(k) ? cache_stream(stream) : NULL;
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
  if (cache_events(k)) {
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

/* --- trimming ----------------------------------------------------------- */

#define CACHE_TRIM_BATCH GMB_CACHE_BATCH

/* Makes ready the free blocks on idle pages whose streams' work is done,
 * recording an event on the others (a later look finds them done), and
 * merges them: an idle page covered by free blocks of several streams is
 * one free block once they are ready.  Holds a's lock. */
static void cache_promote_idle(struct gmb_cache *k, struct cache_arena *a) {
restart:
  for (unsigned i = cache_bin_next(a, 0); i < CACHE_BINS;
       i = cache_bin_next(a, i + 1))
    for (struct cache_block *b = a->bins[i]; b; b = b->fnext) {
      if (b->ready || b->orphan) continue;
      if (cache_pg(k, b->span, b->ptr)->users ||
          cache_pg(k, b->span, b->ptr + b->size - 1)->users)
        continue;
      if (!cache_promote(k, a, b, 1)) continue;
      cache_bin_remove(a, b);
      cache_coalesce(a, b);
      goto restart; /* each promotion is for good: this ends */
    }
}

/* Unmaps up to `max` idle pages of arena a whose memory no stream can
 * still use, into pg[]; returns how many.  Holds a's lock. */
unsigned gmb__cache_trim_arena(struct gmb_cache *k, struct cache_arena *a,
                               unsigned max, struct gmb_cache_page *pg) {
  unsigned n = 0;
  if (cache_events(k)) cache_promote_idle(k, a);
  while (n < max) {
    uintptr_t addr;
    struct cache_block *pv = cache_idle_take(k, a, 1, 0, &addr);
    if (pv == NULL) break;
    struct cache_span *s = pv->span;
    k->ops.page_unmap(k->ops.ctx, addr, &cache_pg(k, s, addr)->pg);
    cache_page_drop(k, a, s, addr, &pg[n++]);
    cache_virt_settle(a, pv);
    a->page_frees++;
  }
  return n;
}

int gmb__cache_trim(struct gmb_cache *k, uint64_t keep, unsigned flags,
                    uint64_t *released) {
  uint64_t done = 0;
  if (released) *released = 0;
  if (k == NULL) return GMB_E_INVAL;
  int synced = 0;
again:
  for (unsigned j = 0; j < cache_arenas(k); j++) {
    struct cache_arena *a = &k->arena[j];
    for (;;) {
      struct gmb_cache_page pg[CACHE_TRIM_BATCH];
      pthread_mutex_lock(&a->mu);
      if (a->pending) cache_pending_poll(k, a);
      uint64_t idle = atomic_load(&k->idle);
      unsigned max = 0;
      if (idle > keep) {
        uint64_t want = cache_round(idle - keep, k->page) >> k->shift;
        max = want < CACHE_TRIM_BATCH ? (unsigned)want : CACHE_TRIM_BATCH;
      }
      /* A paused tag's arena has no page mapped; one being paused or
       * resumed is cache_sleep.c's. */
      if (a->state != CACHE_RUNNING) max = 0;
      unsigned n = max ? gmb__cache_trim_arena(k, a, max, pg) : 0;
      pthread_mutex_unlock(&a->mu);
      /* The message, with no lock held. */
      if (n) k->ops.page_free(k->ops.ctx, pg, n);
      done += (uint64_t)n * k->page;
      if (n < max || n == 0) break;
    }
  }
  if ((flags & GMB_CACHE_TRIM_SYNC) && !synced && k->ops.sync &&
      atomic_load(&k->idle) > keep) {
    /* What is left waits for stream work: wait for the device once, make
     * every free block ready, and look again. */
    synced = 1;
    if (k->ops.sync(k->ops.ctx) == 0) {
      for (unsigned j = 0; j < cache_arenas(k); j++) {
        struct cache_arena *a = &k->arena[j];
        pthread_mutex_lock(&a->mu);
        if (a->pending) cache_pending_poll(k, a);
        for (unsigned i = 0; i < CACHE_BINS; i++)
          for (struct cache_block *b = a->bins[i]; b; b = b->fnext)
            if (!b->ready) {
              cache_event_unref(a, b->ev);
              b->ev = NULL;
              b->stream = NULL;
              b->orphan = 0;
              b->ready = 1;
            }
        /* Merging changes the bins: merge in a second walk over spans. */
        for (struct cache_span *s = a->spans; s; s = s->next)
          for (struct cache_block *b = s->first; b; b = b->next)
            while (b->state == CACHE_FREE && b->next &&
                   cache_mergeable(b, b->next)) {
              cache_bin_remove(a, b);
              b = cache_coalesce(a, b);
            }
        pthread_mutex_unlock(&a->mu);
      }
      goto again;
    }
  }
  if (released) *released = done;
  return 0;
}

/* --- the rest of the interface ---------------------------------------------- */

struct gmb_cache *gmb__cache_new(const struct gmb_cache_ops *ops,
                                 unsigned arenas) {
  if (ops == NULL || ops->reserve == NULL || ops->unreserve == NULL ||
      ops->page_map == NULL || ops->page_unmap == NULL ||
      ops->page_free == NULL)
    return NULL;
  int ev = (ops->event_new != NULL) + (ops->event_record != NULL) +
           (ops->event_query != NULL) + (ops->event_destroy != NULL);
  if (ev != 0 && ev != 4) return NULL;
  uint64_t page = ops->page ? ops->page : GMB_CACHE_PAGE;
  if (page < GMB_CACHE_ALIGN || (page & (page - 1))) return NULL;
  uint64_t span = ops->span ? ops->span : GMB_CACHE_SPAN;
  if (span % page) return NULL;
  struct gmb_cache *k = calloc(1, sizeof *k);
  if (k == NULL) return NULL;
  k->ops = *ops;
  k->page = page;
  k->span = span;
  k->shift = (unsigned)__builtin_ctzll(page);
  k->n = arenas ? arenas : CACHE_DEFAULT_ARENAS;
  /* Room for the tag arenas too: they are never moved, so a pointer to
   * one stays valid without a lock. */
  k->arena = calloc(k->n + CACHE_MAX_TAGS, sizeof *k->arena);
  if (k->arena == NULL) {
    free(k);
    return NULL;
  }
  static _Atomic uint64_t cache_gen;
  k->gen = atomic_fetch_add(&cache_gen, 1) + 1;
  pthread_mutex_init(&k->tag_mu, NULL);
  pthread_mutex_init(&k->sleep_mu, NULL);
  for (unsigned i = 0; i < k->n; i++) pthread_mutex_init(&k->arena[i].mu, NULL);
  return k;
}

static void cache_event_collect(struct cache_event *e,
                                struct cache_event **dead) {
  if (e && --e->refs == 0) {
    e->next = *dead;
    *dead = e;
  }
}

void gmb__cache_destroy(struct gmb_cache *k) {
  if (k == NULL) return;
  for (unsigned i = 0; i < cache_arenas(k); i++) {
    struct cache_arena *a = &k->arena[i];
    gmb__cache_sleep_free(k, a);
    struct cache_event *dead = a->spare_events;
    struct cache_span *s = a->spans;
    while (s) {
      struct cache_span *ns = s->next;
      for (uint64_t p = 0; p < s->npages; p++)
        if (s->page[p].pg.id)
          k->ops.page_unmap(k->ops.ctx, s->base + (p << k->shift),
                            &s->page[p].pg);
      if (!s->lost) {
        k->ops.unreserve(k->ops.ctx, s->base, s->size);
      }
      struct cache_block *b = s->first;
      uintptr_t run = s->base;
      while (b) {
        struct cache_block *nb = b->next;
        if (s->lost && b->state == CACHE_LOST) {
          /* Give back the reservation around addresses another mapping
           * of the process took. */
          if (b->ptr > run) k->ops.unreserve(k->ops.ctx, run, b->ptr - run);
          run = b->ptr + b->size;
        }
        cache_event_collect(b->ev, &dead);
        for (uint32_t w = 0; w < b->n_waits; w++)
          cache_event_collect(b->waits[w], &dead);
        free(b->waits);
        free(b->uses);
        free(b);
        b = nb;
      }
      if (s->lost && s->base + s->size > run)
        k->ops.unreserve(k->ops.ctx, run, s->base + s->size - run);
      free(s->page);
      free(s);
      s = ns;
    }
    while (dead) {
      struct cache_event *n = dead->next;
      if (k->ops.event_destroy) k->ops.event_destroy(k->ops.ctx, dead->h);
      free(dead);
      dead = n;
    }
    while (a->spare_blocks) {
      struct cache_block *b = a->spare_blocks;
      a->spare_blocks = b->fnext;
      free(b);
    }
    free(a->hash);
    pthread_mutex_destroy(&a->mu);
  }
  pthread_mutex_destroy(&k->tag_mu);
  pthread_mutex_destroy(&k->sleep_mu);
  free(k->arena);
  free(k);
}

uint64_t gmb__cache_cached(struct gmb_cache *k) {
  return k ? atomic_load(&k->idle) : 0;
}

uint64_t gmb__cache_holes(struct gmb_cache *k) {
  if (k == NULL) return 0;
  uint64_t held = atomic_load(&k->held), idle = atomic_load(&k->idle),
           used = atomic_load_explicit(&k->in_use, memory_order_relaxed) +
                  atomic_load(&k->mapping);
  return held > idle + used ? held - idle - used : 0;
}

uint64_t gmb__cache_in_use(struct gmb_cache *k) {
  return k ? atomic_load_explicit(&k->in_use, memory_order_relaxed) : 0;
}
