/*
 * cache_impl.h - the cache's records, shared by cache.c (the allocator)
 * and cache_check.c (its figures and its checker).  Private to those two
 * files; cache.c's opening paragraph says what the records mean and which
 * invariants hold between them.
 */
#ifndef GMB_CACHE_IMPL_H
#define GMB_CACHE_IMPL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#include "cache.h"

#define CACHE_BINS 160
#define CACHE_BITMAP_WORDS ((CACHE_BINS + 63) / 64)
/* Scanning a bin for the best fit stops after this many blocks. */
#define CACHE_SCAN_MAX 64
#define CACHE_DEFAULT_ARENAS 4
#define CACHE_HASH_MIN 64
/* Block records an arena keeps for reuse at most (cache_rec_get).  None
 * under AddressSanitizer, so that it still sees a record used after the
 * cache let it go. */
#if defined(__SANITIZE_ADDRESS__)
#define CACHE_SPARE_BLOCKS 0
#else
#define CACHE_SPARE_BLOCKS 256
#endif
/* Tag arenas a cache makes at most (each reserves its own spans). */
#define CACHE_MAX_TAGS 64
/* CUDA's pseudo handles (cuda.h CU_STREAM_LEGACY, CU_STREAM_PER_THREAD). */
#define CACHE_STREAM_LEGACY ((void *)(uintptr_t)0x1)
#define CACHE_STREAM_PER_THREAD ((void *)(uintptr_t)0x2)

enum { CACHE_VIRT, CACHE_FREE, CACHE_LIVE, CACHE_MAPPING, CACHE_LOST };

struct cache_event {
  void *h;       /* the backend's event */
  uint32_t refs; /* blocks that name it */
  uint64_t seq;  /* the order of records in this arena */
  struct cache_event *next; /* the arena's spare events */
};

struct cache_span;

struct cache_block {
  uintptr_t ptr;
  uint64_t size;
  uint64_t req; /* LIVE: the request, rounded to 512 */
  struct cache_span *span;
  struct cache_block *prev, *next;   /* the span's blocks, address order */
  struct cache_block *fprev, *fnext; /* FREE: its bin list; VIRT: the
                                        span's list; pending: the arena's */
  struct cache_block *hnext;         /* handed out: its hash chain */
  void *stream;                      /* FREE, pending: the stream of the free */
  unsigned thread;                   /* ... its thread, for 0x2 */
  struct cache_event *ev;            /* FREE not ready, pending: its event */
  /* Handed out: other streams that use it (record_stream); pending: the
   * events recorded on them at the free that have not completed yet. */
  void **uses;
  struct cache_event **waits;
  uint32_t n_uses, cap_uses, n_waits;
  uint8_t state;
  uint8_t pending;
  uint8_t ready;  /* FREE: usable by every stream */
  uint8_t orphan; /* FREE: its stream took no event; ready after a sync */
};

struct cache_page {
  struct gmb_cache_page pg; /* pg.id 0: not mapped */
  uint32_t users;
  uint32_t saved; /* paused arena: mapped before the pause, mapped again
                     at the resume (cache_sleep.c) */
};

struct cache_span {
  uintptr_t base;
  uint64_t size, npages;
  struct cache_page *page;
  struct cache_block *first;
  struct cache_block *virt; /* its VIRT blocks */
  struct cache_span *next;
  int lost; /* holds LOST pages (destroy gives back around them) */
};

/* An arena's sleep state (cache_sleep.c).  Only tag arenas leave RUNNING. */
enum { CACHE_RUNNING, CACHE_PAUSING, CACHE_PAUSED, CACHE_RESUMING };

/* What a pause kept of one page: its address and, when its bytes were
 * offloaded, where they lie in host memory (NULL: discarded, or a page
 * that held no block in use). */
struct cache_saved {
  uintptr_t addr;
  char *host;
};

struct cache_sleep {
  struct cache_saved *pages; /* address order within each span */
  uint64_t n;
  char *buf;          /* the host copy of the offloaded pages */
  uint64_t host;      /* its bytes (counted in gmb_cache.host_held) */
};

struct cache_arena {
  pthread_mutex_t mu;
  uint8_t state;     /* CACHE_RUNNING ...; under mu */
  uint8_t paused_by; /* not RUNNING: GMB_CACHE_BY_*; under mu */
  unsigned inflight; /* misses mapping pages with no lock held */
  struct cache_sleep *sleep; /* PAUSED, RESUMING: what the pause kept */
  char tag[GMB_CACHE_TAG_MAX + 1]; /* tag arenas: the tag */
  struct cache_block *bins[CACHE_BINS];
  uint64_t bitmap[CACHE_BITMAP_WORDS];
  struct cache_span *spans;
  struct cache_block **hash; /* handed-out blocks by address */
  size_t hash_cap, hash_n;
  struct cache_block *pending; /* freed, waiting for their other streams */
  size_t pending_n;
  struct cache_event *spare_events;
  struct cache_block *spare_blocks; /* records for reuse, by fnext */
  unsigned n_spare_blocks;
  uint64_t seq;
  uint64_t mapped, idle; /* pages */
  uint64_t in_use_blocks, in_use_req, peak_req;
  uint64_t hits, misses, page_maps, page_frees, page_moves;
};

struct gmb_cache {
  struct gmb_cache_ops ops;
  unsigned n;       /* untagged arenas: arena[0..n) */
  _Atomic unsigned ntags; /* tag arenas: arena[n..n+ntags), never removed */
  uint64_t gen;     /* tells this cache from an earlier one at the same
                       address (the thread's current tag) */
  pthread_mutex_t tag_mu;   /* creating tags */
  pthread_mutex_t sleep_mu; /* one pause or resume at a time */
  uint64_t host_quota;      /* 0: no limit */
  _Atomic uint64_t host_held;
  _Atomic uint64_t host_others; /* of host_held: taken by gmb__cache_host_take
                                   (gmb_alloc allocations' host copies) */
  unsigned shift; /* log2 of the page */
  uint64_t page, span;
  struct cache_arena *arena;
  /* Totals over the arenas, updated under the arena's lock.  The bytes
   * of blocks handed out are only the arenas' (in_use_blocks): the
   * checker sums them, and the hot path spares an atomic add. */
  _Atomic uint64_t held, idle, in_use;
  _Atomic uint64_t mapping; /* bytes of MAPPING blocks (misses in flight)
                               on mapped pages: neither holes nor in use
                               yet */
  _Atomic uint64_t peak_in_use, peak_held;
};

/* --- small helpers both files use ------------------------------------ */

/* Every arena, tag arenas included. */
static inline unsigned cache_arenas(struct gmb_cache *k) {
  return k->n + atomic_load_explicit(&k->ntags, memory_order_acquire);
}

static inline void cache_totals(struct gmb_cache *k, int64_t d_held,
                                int64_t d_idle, int64_t d_req) {
  if (d_held) {
    uint64_t h = atomic_fetch_add(&k->held, (uint64_t)d_held) +
                 (uint64_t)d_held;
    uint64_t p = atomic_load(&k->peak_held);
    while (h > p && !atomic_compare_exchange_weak(&k->peak_held, &p, h)) {
    }
  }
  if (d_idle) atomic_fetch_add(&k->idle, (uint64_t)d_idle);
  if (d_req) {
    uint64_t u = atomic_fetch_add(&k->in_use, (uint64_t)d_req) +
                 (uint64_t)d_req;
    uint64_t p = atomic_load(&k->peak_in_use);
    while (u > p && !atomic_compare_exchange_weak(&k->peak_in_use, &p, u)) {
    }
  }
}

/* 1 when (s1 of thread t1) and (s2 of thread t2) are one stream: the
 * per-thread default stream is a different one on every thread. */
static inline int cache_same_stream(void *s1, unsigned t1, void *s2, unsigned t2) {
  return s1 == s2 && (s1 != CACHE_STREAM_PER_THREAD || t1 == t2);
}

static inline int cache_events(const struct gmb_cache *k) {
  return k->ops.event_query != NULL;
}

static inline uint64_t cache_round(uint64_t v, uint64_t to) {
  return (v + to - 1) / to * to;
}

static inline uintptr_t cache_pfloor(const struct gmb_cache *k, uintptr_t p) {
  return p & ~(uintptr_t)(k->page - 1);
}

static inline uintptr_t cache_pceil(const struct gmb_cache *k, uintptr_t p) {
  return (p + k->page - 1) & ~(uintptr_t)(k->page - 1);
}

static inline struct cache_page *cache_pg(const struct gmb_cache *k,
                                   const struct cache_span *s, uintptr_t p) {
  return &s->page[(p - s->base) >> k->shift];
}

static inline int cache_live(const struct cache_block *b) {
  return b && (b->state == CACHE_LIVE || b->state == CACHE_MAPPING);
}

static inline unsigned cache_bin(uint64_t size) {
  uint64_t u = size / GMB_CACHE_ALIGN;
  if (u < 4) return (unsigned)u;
  unsigned fl = 63u - (unsigned)__builtin_clzll(u);
  unsigned sl = (unsigned)(u >> (fl - 2)) & 3u;
  unsigned b = 4u * fl + sl;
  return b < CACHE_BINS ? b : CACHE_BINS - 1;
}

static inline size_t cache_hash_of(uintptr_t p, size_t cap) {
  return (size_t)(((uint64_t)p / GMB_CACHE_ALIGN) *
                  UINT64_C(0x9e3779b97f4a7c15) >> 20) & (cap - 1);
}

static inline int cache_mergeable(const struct cache_block *x,
                           const struct cache_block *y) {
  if (x->state != y->state) return 0;
  if (x->state == CACHE_VIRT) return 1;
  if (x->state != CACHE_FREE) return 0;
  if (x->orphan || y->orphan) return 0;
  if (x->ready || y->ready) return 1;
  return cache_same_stream(x->stream, x->thread, y->stream, y->thread);
}

/* --- shared between cache.c and cache_sleep.c ------------------------- */

/* The calling thread's current tag arena on k (0: none), and setting it
 * (idx 0: none). */
void gmb__cache_tls_set(const struct gmb_cache *k, unsigned idx);
unsigned gmb__cache_tls_idx(const struct gmb_cache *k);

/* Unmaps up to `max` idle pages of arena a whose memory no stream can
 * still use, into pg[]; returns how many.  Holds a's lock. */
unsigned gmb__cache_trim_arena(struct gmb_cache *k, struct cache_arena *a,
                               unsigned max, struct gmb_cache_page *pg);

/* Frees a's sleep record and host copy (gmb__cache_destroy). */
void gmb__cache_sleep_free(struct gmb_cache *k, struct cache_arena *a);

#endif /* GMB_CACHE_IMPL_H */
