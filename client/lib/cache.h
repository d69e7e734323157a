/*
 * cache.h - the client's stream-ordered cache: gmb_malloc_async and
 * gmb_free_async are served from pinned broker allocations ("slabs") kept
 * in this process, so that a hit sends no message.
 *
 * Internal to the client library.  The cache knows nothing of sockets or
 * drivers: it is given a backend (struct gmb_cache_ops) that allocates and
 * frees slabs and, on a GPU, records and queries events.  client.c gives
 * it the broker and cuimport.c; tests/unit/check_cache.c gives it host
 * memory and events it completes by hand.  Thread-safe (see cache.c for
 * the locks).
 */
#ifndef GMB_CACHE_H
#define GMB_CACHE_H

#include <stddef.h>
#include <stdint.h>

struct gmb_cache;

struct gmb_cache_ops {
  void *ctx; /* passed to every function below */
  /* A pinned allocation of exactly `size` bytes (a multiple of 512): 0
   * with *id and *base (its address in this process), or a GMB_E_* code
   * the backend has explained (gmb_last_error). */
  int (*slab_alloc)(void *ctx, uint64_t size, uint64_t *id, uintptr_t *base);
  /* Gives a slab back.  Called only when no work of any stream can still
   * use it.  A failure is dropped: the session's end frees it anyway. */
  void (*slab_free)(void *ctx, uint64_t id);
  /* Events; all four NULL when streams are ignored (the host device).
   * Streams are CUstream handles: NULL and 0x1 name the legacy default
   * stream, 0x2 the calling thread's per-thread default stream.
   * event_new: 0 with *ev, or a GMB_E_* code.  event_record: 0, or
   * GMB_E_INVAL when the stream cannot take it (destroyed, capturing).
   * event_query: 1 when the work before the record finished, 0 when not
   * yet, negative when the driver cannot tell (treated as not yet). */
  int (*event_new)(void *ctx, void **ev);
  int (*event_record)(void *ctx, void *ev, void *stream);
  int (*event_query)(void *ctx, void *ev);
  void (*event_destroy)(void *ctx, void *ev);
};

/* Block sizes are multiples of this; blocks start at multiples of it
 * within their slab. */
#define GMB_CACHE_ALIGN 512u
/* Requests up to this size share slabs of GMB_CACHE_SMALL_SLAB bytes;
 * larger ones get a slab of their own (rounded to GMB_CACHE_LARGE_ROUND),
 * which is cached after the free and split for later large requests. */
#define GMB_CACHE_SMALL_MAX (UINT64_C(1) << 20)
#define GMB_CACHE_SMALL_SLAB (UINT64_C(2) << 20)
#define GMB_CACHE_LARGE_ROUND (UINT64_C(512) << 10)
/* The slack: on a miss, before asking for a new slab, the cache gives
 * back wholly free slabs while its slabs (the new one counted) would pass
 * the most it ever handed out by more than GMB_CACHE_SLACK_PCT percent
 * plus GMB_CACHE_SLACK_FLOOR (a floor, so that a small cache is not
 * churned). */
#define GMB_CACHE_SLACK_PCT 20
#define GMB_CACHE_SLACK_FLOOR (4 * GMB_CACHE_SMALL_SLAB)
/* The largest request: past it, sizes would overflow the rounding. */
#define GMB_CACHE_MAX (UINT64_C(1) << 46)

struct gmb_cache_counters {
  uint64_t hits;        /* requests served without a new slab */
  uint64_t misses;      /* requests that needed one */
  uint64_t slab_allocs, slab_frees;
  uint64_t slabs;       /* slabs held now */
  uint64_t slab_bytes;  /* bytes of the slabs held now */
  uint64_t in_use;      /* bytes handed out now (requests rounded to 512) */
  uint64_t cached;      /* slab_bytes - bytes of blocks handed out */
  uint64_t peak_in_use, peak_slab_bytes;
};

/* A new, empty cache over `ops` (copied).  `arenas`: independent parts,
 * each with its own lock (0: 4).  NULL when out of memory. */
struct gmb_cache *gmb__cache_new(const struct gmb_cache_ops *ops,
                                 unsigned arenas);

/* Frees the cache's host records and events.  Slabs are not given back
 * (the session's end frees them): call gmb__cache_trim first for that.
 * Accepts NULL. */
void gmb__cache_destroy(struct gmb_cache *k);

/*
 * A block of at least `size` bytes usable on `stream` at once: a free block
 * freed on the same stream, or one whose free's event completed, or a new
 * slab (after giving back, for a large request, the wholly free large
 * slabs smaller than it, and any wholly free slabs past the slack).  0
 * with *ptr; GMB_E_INVAL for size 0 or past GMB_CACHE_MAX; the slab_alloc's
 * code when no slab could be had even after giving every wholly free slab
 * back and trying again once (GMB_E_QUOTA, GMB_E_NOMEM).
 */
int gmb__cache_alloc(struct gmb_cache *k, size_t size, void *stream,
                     void **ptr);

/*
 * Frees a block: reusable at once on `stream`, on others once the event
 * recorded now on `stream` completed; a block that other streams use
 * (gmb__cache_record_stream) first waits, pending, until the events
 * recorded now on each of them completed.  Never waits.  GMB_E_NOENT for a
 * pointer the cache did not hand out; GMB_E_INVAL for one already free
 * (it lies in free cached memory: a double free) or for a stream that
 * takes no event (the block then stays handed out).  Nothing changes on an error.
 */
int gmb__cache_free(struct gmb_cache *k, void *ptr, void *stream);

/*
 * Says that work queued on `stream` (besides the stream the block will be
 * freed on) uses the handed-out block at ptr, as torch's record_stream:
 * its free then keeps it pending, reusable by no stream, until that work
 * (as queued at the free) finished.  0 (also on a cache without events,
 * where streams do not count); GMB_E_NOENT for a pointer the cache did
 * not hand out, GMB_E_INVAL for one already free or for the per-thread
 * default stream (0x2: which thread's it is cannot be told at the free),
 * GMB_E_SYSTEM when out of memory.  Nothing changes on an error.
 */
int gmb__cache_record_stream(struct gmb_cache *k, void *ptr, void *stream);

/*
 * Gives back to the backend every slab that is wholly free and that no
 * stream's work can still use, largest first, until at most `keep` cached
 * bytes remain.  Never waits for a stream.  *released (may be NULL): the
 * bytes given back.  0.
 */
int gmb__cache_trim(struct gmb_cache *k, uint64_t keep, uint64_t *released);

/* Bytes cached and free now (slabs minus blocks handed out). */
uint64_t gmb__cache_cached(struct gmb_cache *k);

void gmb__cache_counters(struct gmb_cache *k, struct gmb_cache_counters *out);

/* The counters of a client's cache (client.c; tests and benchmarks). */
struct gmb_client;
void gmb__client_cache_counters(struct gmb_client *c,
                                struct gmb_cache_counters *out);

/* Checks every invariant of cache.c's opening paragraph (taking every
 * arena's lock in turn); returns the number of violations, each described
 * on stderr. */
int gmb__cache_check(struct gmb_cache *k);

#endif /* GMB_CACHE_H */
