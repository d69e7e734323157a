/*
 * cache.h - the client's stream-ordered cache: gmb_malloc_async and
 * gmb_free_async are served from arenas of pages kept in this process, so
 * that a hit sends no message.
 *
 * Internal to the client library.  The cache knows nothing of sockets or
 * drivers: it is given a backend (struct gmb_cache_ops) that reserves
 * address space, maps pages of physical memory from the broker at chosen
 * addresses in it and unmaps them, and, on a GPU, records and queries
 * events.  client.c gives it the broker (memfd pages on the host device,
 * VMM imports on a GPU: cuimport.c); tests/unit/check_cache.c gives it
 * host memory and events it completes by hand.  Thread-safe (see cache.c
 * for the locks).
 */
#ifndef GMB_CACHE_H
#define GMB_CACHE_H

#include <stddef.h>
#include <stdint.h>

struct gmb_cache;

/* One page of physical memory as the backend knows it. */
struct gmb_cache_page {
  uint64_t id; /* the broker's allocation (never 0 for a mapped page) */
  uint64_t h;  /* the backend's own handle (cuda: the imported handle) */
};

/* event_record's answer for a stream that captures into a CUDA graph:
 * no event now, but not a stream that never takes one (see below). */
#define GMB_CACHE_CAPTURING 1

struct gmb_cache_ops {
  void *ctx; /* passed to every function below */
  /* The page size (a power of two, a multiple of GMB_CACHE_ALIGN; 0:
   * GMB_CACHE_PAGE) and the size of each address range reserved (a
   * multiple of the page; 0: GMB_CACHE_SPAN).  A request larger than a
   * span gets a span of its own. */
  uint64_t page, span;
  /* Reserves `size` bytes of address space aligned to the page, mapped to
   * nothing: 0 with *base, or a GMB_E_* code the backend explained. */
  int (*reserve)(void *ctx, uint64_t size, uintptr_t *base);
  /* Gives back [base, base+size) of a reservation (nothing mapped in it
   * any more); the cache calls it with whole reservations only, except
   * around addresses lost by page_move. */
  void (*unreserve)(void *ctx, uintptr_t base, uint64_t size);
  /* Gets `n` pages (1 to GMB_CACHE_BATCH) of physical memory from the
   * broker, as one request, and maps them at addr, addr + page, ...
   * (page aligned, reserved, mapped to nothing): 0 with pg[0..n), or a
   * GMB_E_* code the backend explained (GMB_E_QUOTA, GMB_E_NOMEM, ...)
   * with nothing mapped.  `ahead`: the bytes of pages the same miss asks
   * for after these (the broker may ask other caches for them at once).
   * Called with no lock of the cache held. */
  int (*page_map)(void *ctx, uintptr_t addr, unsigned n, uint64_t ahead,
                  struct gmb_cache_page *pg);
  /* Unmaps the page at `addr` (the address stays reserved).  Cheap (no
   * message); called with the arena's lock held. */
  void (*page_unmap)(void *ctx, uintptr_t addr, const struct gmb_cache_page *pg);
  /* Gives `n` unmapped pages (1 to GMB_CACHE_BATCH) back to the broker, in
   * one message.  Called with no lock held.  A failure is dropped: the
   * session's end frees them anyway. */
  void (*page_free)(void *ctx, const struct gmb_cache_page *pg, unsigned n);
  /* Optional (NULL: pages are given back and new ones asked for instead).
   * Moves the mapping of the page at `from` to `to` (both page aligned
   * and reserved; `to` mapped to nothing), with the arena's lock held:
   * 0 when moved and `from` is reserved again; 1 when moved but `from`
   * could not be reserved again (another mapping of the process took the
   * hole: the cache never uses that address again); a negative GMB_E_*
   * code with nothing changed.  *pg may be updated. */
  int (*page_move)(void *ctx, uintptr_t from, uintptr_t to,
                   struct gmb_cache_page *pg);
  /* Events; all four NULL when streams are ignored (the host device).
   * Streams are CUstream handles: NULL and 0x1 name the legacy default
   * stream, 0x2 the calling thread's per-thread default stream.
   * event_new: 0 with *ev, or a GMB_E_* code.  event_record: 0, or
   * GMB_E_INVAL when the stream cannot take it (destroyed), or
   * GMB_CACHE_CAPTURING when it cannot now: it is being captured into a
   * CUDA graph (a record would be a node of the graph), and a record
   * after the capture may take one.
   * event_query: 1 when the work before the record finished, 0 when not
   * yet, negative when the driver cannot tell (treated as not yet). */
  int (*event_new)(void *ctx, void **ev);
  int (*event_record)(void *ctx, void *ev, void *stream);
  int (*event_query)(void *ctx, void *ev);
  void (*event_destroy)(void *ctx, void *ev);
  /* Optional: waits for all work of the device (gmb_trim's last resort
   * for memory freed on a stream that no longer takes events).  0 or a
   * GMB_E_* code. */
  int (*sync)(void *ctx);
  /* Optional (NULL: memcpy, for address space the CPU can touch): copies
   * n bytes between the mapped range at `dev` and host memory (to_device:
   * host to dev, else dev to host), for gmb__cache_pause/resume.  0 or a
   * GMB_E_* code the backend explained. */
  int (*copy)(void *ctx, uintptr_t dev, void *host, uint64_t n,
              int to_device);
  /* Optional: tells the broker a tag paused (`paused`, before the copy:
   * `host` bytes will hold it, `device` bytes of pages go back; `by` who
   * asked, GMB_CACHE_BY_*) or runs again (after a resume, or a pause that
   * failed after it was told).  0, or a GMB_E_* code the backend
   * explained: a pause then does not happen (GMB_E_LIMIT: past the
   * tenant's host_quota).  Called with no lock of the cache held. */
  int (*note)(void *ctx, const char *tag, int paused, int mode,
              uint64_t host, uint64_t device, int by);
};

/* Block sizes are multiples of this; blocks start at multiples of it. */
#define GMB_CACHE_ALIGN 512u
/* The page: the unit of physical memory the cache maps, gives back and
 * moves (the GPU's VMM granularity).  Each page is one allocation of the
 * broker with a device segment of its own. */
#define GMB_CACHE_PAGE (UINT64_C(2) << 20)
/* Pages asked for, or given back, in one message at most. */
#define GMB_CACHE_BATCH 64u
/* Address space reserved at a time per arena: no physical memory, only
 * room for blocks to be cut from and pages to be mapped into. */
#define GMB_CACHE_SPAN (UINT64_C(64) << 30)
/* The largest request: past it, sizes would overflow the rounding. */
#define GMB_CACHE_MAX (UINT64_C(1) << 46)

struct gmb_cache_counters {
  uint64_t hits;        /* requests served without a new page mapped */
  uint64_t misses;      /* requests that needed pages mapped */
  uint64_t slab_allocs; /* pages the broker gave (one request each) */
  uint64_t slab_frees;  /* pages given back to it */
  uint64_t page_moves;  /* idle pages moved to serve a miss instead */
  uint64_t slabs;       /* pages mapped now */
  uint64_t slab_bytes;  /* bytes of the pages mapped now: the tenant's */
  uint64_t in_use;      /* bytes handed out now (requests rounded to 512) */
  uint64_t cached;      /* slab_bytes - bytes of blocks handed out */
  uint64_t idle;        /* of cached: bytes of pages that hold no block
                           handed out, what a trim can give back */
  uint64_t peak_in_use, peak_slab_bytes;
  uint64_t host;        /* bytes of host memory holding paused tags' pages */
  uint64_t paused;      /* bytes of pages paused (offloaded or discarded) */
};

/* A new, empty cache over `ops` (copied).  `arenas`: independent parts,
 * each with its own lock and address spans (0: 4).  NULL when out of
 * memory or when ops lack a required function or give a bad page size. */
struct gmb_cache *gmb__cache_new(const struct gmb_cache_ops *ops,
                                 unsigned arenas);

/* Unmaps every page, gives back every reservation and frees the cache's
 * host records and events.  Pages are not given back to the broker (the
 * session's end frees them): call gmb__cache_trim first for that.
 * Accepts NULL. */
void gmb__cache_destroy(struct gmb_cache *k);

/*
 * A block of at least `size` bytes usable on `stream` at once: a free block
 * in mapped pages freed on the same stream or whose stream's work is known
 * to be done, else a range of the arena that needs the fewest new pages,
 * mapped from idle pages moved there first, then from the broker.  0 with
 * *ptr; GMB_E_INVAL for size 0 or past GMB_CACHE_MAX; the backend's code
 * when pages could not be had even after giving the idle ones back and
 * trying again once (GMB_E_QUOTA, GMB_E_NOMEM).
 */
int gmb__cache_alloc(struct gmb_cache *k, size_t size, void *stream,
                     void **ptr);

/*
 * Frees a block: reusable at once on `stream`, on other streams once the
 * work queued on `stream` up to the moment another stream wants it
 * finished (an event is recorded then, not at the free); a block that
 * other streams use (gmb__cache_record_stream) first waits, pending,
 * until the events recorded now on each of them completed.  Never waits.
 * GMB_E_NOENT for a pointer the cache did not hand out (the inside of a
 * block included); GMB_E_INVAL for one already free (it lies in free or
 * given-back memory: a double free, or a free after a trim) or for a
 * stream that takes no event (the block then stays handed out).  Nothing
 * changes on an error.
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

/* gmb__cache_trim's flags. */
#define GMB_CACHE_TRIM_SYNC 0x1u /* wait for the device when that frees more */

/*
 * Gives back to the broker idle pages (pages that hold no block handed
 * out, whatever their neighbours hold) whose free memory no stream's work
 * can still use, until at most `keep` idle bytes remain.  Without
 * GMB_CACHE_TRIM_SYNC it never waits for a stream: a page whose stream's
 * work is not known to be done stays (an event is recorded so that a
 * later trim finds out).  *released (may be NULL): the bytes given back.
 * 0.
 */
int gmb__cache_trim(struct gmb_cache *k, uint64_t keep, unsigned flags,
                    uint64_t *released);

/* Bytes of idle pages now: what a trim could give back. */
uint64_t gmb__cache_cached(struct gmb_cache *k);

/* The bytes of its pages that hold blocks in use less those blocks' bytes
 * (requests rounded to GMB_CACHE_ALIGN) and less the ranges of misses
 * still mapping their pages: the holes between blocks, which no trim can
 * give back; read without a lock, so a snapshot (erring low while a miss
 * maps).  0 for NULL. */
uint64_t gmb__cache_holes(struct gmb_cache *k);

/* Bytes handed out now (each request rounded to 512; gmb_cache_stats's
 * in_use), read with one atomic load and no lock: exact at the moment
 * it is read, though another thread's allocation or free may change it
 * the next.  0 for NULL. */
uint64_t gmb__cache_in_use(struct gmb_cache *k);

void gmb__cache_counters(struct gmb_cache *k, struct gmb_cache_counters *out);

/* --- tags: sleep and wake --------------------------------------------- */

/* A tag's longest name. */
#define GMB_CACHE_TAG_MAX 63
/* gmb__cache_pause's modes (gmb.h's GMB_PAUSE_*). */
#define GMB_CACHE_OFFLOAD 0
#define GMB_CACHE_DISCARD 1
/* Who paused a tag (gmb__cache_pause_by; the wire's SleepNote.by). */
#define GMB_CACHE_BY_APP 0
#define GMB_CACHE_BY_BROKER 1
#define GMB_CACHE_BY_OPERATOR 2

/*
 * Makes `tag` the calling thread's current tag on this cache (NULL or "":
 * none): its gmb__cache_alloc calls are served by the tag's own arena,
 * made at the first use of the name.  0; GMB_E_INVAL for a name longer
 * than GMB_CACHE_TAG_MAX; GMB_E_LIMIT past CACHE_MAX_TAGS (64) names;
 * GMB_E_SYSTEM when out of memory.  A thread has one current tag, for the
 * last cache it named one on.
 */
int gmb__cache_tag_set(struct gmb_cache *k, const char *tag);

/* The calling thread's current tag on k when that tag is paused (its
 * allocations then fail with GMB_E_INVAL), else NULL. */
const char *gmb__cache_tag_paused(struct gmb_cache *k);

/*
 * Pauses a tag: waits for misses in flight in its arena and for the
 * device (ops.sync), gives back its idle pages, copies the bytes of every
 * other mapped page to host memory (GMB_CACHE_OFFLOAD; not with
 * GMB_CACHE_DISCARD), unmaps them all and gives them back to the broker.
 * The arena's address ranges and its blocks stay as they were: frees are
 * taken while paused, allocations fail with GMB_E_INVAL.  0 (also for a
 * tag already paused: nothing changes); GMB_E_NOENT for a tag never set;
 * GMB_E_LIMIT when the host copy would pass the host quota, GMB_E_SYSTEM
 * when host memory is short, or the backend's code for a failed sync or
 * copy: then nothing changed (the tag runs on).
 */
int gmb__cache_pause(struct gmb_cache *k, const char *tag, int mode);
/* The same, saying who asked (GMB_CACHE_BY_*: the application, the
 * broker's ask, an operator): ops.note passes it on, and
 * gmb__cache_tag_info reports it while the tag is paused.  *paused_now
 * (may be NULL) is 1 only when this call paused it: 0 for a tag that was
 * paused already, whoever paused it, so that a caller undoing its own
 * pause leaves another's alone. */
int gmb__cache_pause_by(struct gmb_cache *k, const char *tag, int mode,
                        int by, int *paused_now);

/* Who keeps a paused tag paused, as a rank: the application (2), whose
 * pause only its gmb_resume ends, over an operator (1), whose pause
 * gmbctl resume ends, over the broker's ask (0), which resumes by itself
 * at the tag's next use. */
int gmb__cache_by_rank(int by);

/* Tag `tag` is paused and a pause by `by` was asked again: when `by`
 * ranks higher than who paused it (gmb__cache_by_rank), the pause is
 * `by`'s from now on, nothing else changes (the caller tells the broker).
 * A tag running, pausing or resuming is left alone.  1 when it was
 * claimed, 0 when not, GMB_E_NOENT for a tag never set. */
int gmb__cache_claim(struct gmb_cache *k, const char *tag, int by);

/* One tag as gmb__cache_tag_info sees it. */
struct gmb_cache_tag_info {
  char tag[GMB_CACHE_TAG_MAX + 1];
  int running;      /* not paused, pausing or resuming */
  int by;           /* not running: who paused it (GMB_CACHE_BY_*) */
  uint64_t mapped;  /* bytes of pages mapped now */
};
/* Fills out[0..cap) with the tags of k, in the order they were made;
 * returns how many there are. */
unsigned gmb__cache_tag_info(struct gmb_cache *k,
                             struct gmb_cache_tag_info *out, unsigned cap);

/*
 * Resumes a paused tag: maps new pages from the broker at the addresses
 * the pause gave back (its idle pages of other arenas are given back and
 * the request tried once more when refused) and copies back the offloaded
 * bytes.  0 (also for a tag not paused); GMB_E_NOENT for a tag never set;
 * the backend's code (GMB_E_QUOTA, GMB_E_NOMEM, a copy's failure) with
 * the tag still paused and its host copy kept: a later call may succeed.
 */
int gmb__cache_resume(struct gmb_cache *k, const char *tag);

/* The host quota of pauses' copies in bytes (0: no limit). */
void gmb__cache_host_quota_set(struct gmb_cache *k, uint64_t bytes);

/* Host bytes held outside the cache's arenas (gmb_alloc allocations'
 * copies, alloc_tags.c), counted in the same figure and quota: take gives
 * 0 or GMB_E_LIMIT with nothing taken; give returns them. */
int gmb__cache_host_take(struct gmb_cache *k, uint64_t bytes);
void gmb__cache_host_give(struct gmb_cache *k, uint64_t bytes);

/* Tags by number (0..63, in the order they were first set): the calling
 * thread's current tag (-1: none), the number of `tag` (GMB_E_NOENT for
 * one never set), and the name of number `ord` (NULL past the tags). */
int gmb__cache_tag_now(struct gmb_cache *k);
int gmb__cache_tag_find(struct gmb_cache *k, const char *tag);
const char *gmb__cache_tag_name(struct gmb_cache *k, int ord);

/* The counters of a client's cache (client.c; tests and benchmarks). */
struct gmb_client;
void gmb__client_cache_counters(struct gmb_client *c,
                                struct gmb_cache_counters *out);

/* Visits every page mapped now (address and page), arena by arena, under
 * each arena's lock in turn; stops when fn returns non-zero (tests compare
 * them with the broker's allocations). */
typedef int (*gmb_cache_page_fn)(void *arg, uintptr_t addr,
                                 const struct gmb_cache_page *pg);
int gmb__cache_pages(struct gmb_cache *k, gmb_cache_page_fn fn, void *arg);

/* One block for a snapshot (gmb__cache_blocks): its piece within one run
 * of consecutive mapped pages, the run being the snapshot's "segment".
 * A free block across unmapped pages is cut at them; unmapped (VIRT)
 * blocks are not visited. */
enum { GMB_CACHE_BLOCK_FREE, GMB_CACHE_BLOCK_LIVE, GMB_CACHE_BLOCK_PENDING };
struct gmb_cache_block_info {
  uintptr_t seg_base; /* the run of mapped pages it lies in */
  uint64_t seg_size;
  uintptr_t ptr;      /* the block, or its piece in this run */
  uint64_t size;
  uint64_t req;       /* LIVE, PENDING: the request, rounded to 512 */
  void *stream;       /* FREE, PENDING: the stream of the free */
  int state;          /* GMB_CACHE_BLOCK_* */
  unsigned arena;
};
typedef int (*gmb_cache_block_fn)(void *arg,
                                  const struct gmb_cache_block_info *b);
/* Visits every block on mapped pages, arena by arena (under each arena's
 * lock in turn), span by span, in address order; stops when fn returns
 * non-zero and returns that.  GMB_E_SYSTEM when out of host memory for
 * the walk. */
int gmb__cache_blocks(struct gmb_cache *k, gmb_cache_block_fn fn, void *arg);

/* Checks every invariant of cache.c's opening paragraph (taking every
 * arena's lock in turn); returns the number of violations, each described
 * on stderr. */
int gmb__cache_check(struct gmb_cache *k);

#endif /* GMB_CACHE_H */
