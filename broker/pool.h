/*
 * pool.h - the broker's allocator: device segments cut into 512-byte aligned
 * ranges.
 *
 * The pool owns every segment and every range.  A segment belongs to one
 * arena (one tenant) so that tenants never share a segment: a client that
 * maps a segment can read all of it.  Requests of up to GMB_POOL_SMALL_MAX
 * bytes share small segments of GMB_POOL_SMALL_SEGMENT bytes; larger ones go
 * to large segments, rounded up to the 2 MiB segment alignment.  Within an
 * arena and size class the free range chosen is the best fit (smallest that
 * fits, then lowest segment id and offset), found in O(log n) in a
 * red-black tree keyed by size.  Address neighbours are a doubly linked list
 * per segment, so a freed range coalesces with both neighbours in O(1).
 * Live allocations are found by id in O(1) through a slot table; an id is
 * (generation << 32 | slot), never 0 and never reused while the pool lives.
 *
 * A segment that becomes empty goes back to the device.  The last emptied
 * small segment of each arena lingers (so a job that allocates and frees one
 * buffer in a loop does not create a segment each time) until
 * gmb__pool_trim() or device pressure releases it.
 *
 * Invariants, checked by gmb__pool_check(): ranges of a segment tile it with
 * no gap or overlap, in address order; no two free ranges are adjacent; the
 * free tree holds exactly the free ranges; per-segment, per-arena and
 * device totals add up.
 *
 * The pool knows nothing of ZeroMQ, protobuf or sessions: an allocation
 * carries an opaque `owner` pointer that the broker uses for its session.
 */
#ifndef GMB_POOL_H
#define GMB_POOL_H

#include <stddef.h>
#include <stdint.h>

#include "device.h"

#define GMB_POOL_ALIGN 512u
#define GMB_POOL_SMALL_MAX (UINT64_C(1) << 20)      /* 1 MiB */
#define GMB_POOL_SMALL_SEGMENT (UINT64_C(2) << 20)  /* 2 MiB */

#define GMB_RANGE_FREE 0x100u /* internal flag; GMB_MOVABLE is 0x1 */

struct gmb_pool;
struct gmb_arena;
struct gmb_segment;

/* A live allocation as the broker sees it: read-only outside pool.c. */
struct gmb_alloc_info {
  uint64_t id;
  uint64_t size;    /* rounded to GMB_POOL_ALIGN */
  uint64_t offset;  /* within the segment */
  uint32_t flags;   /* GMB_MOVABLE */
  void *owner;
  struct gmb_segment *segment;
  const struct gmb_dseg *dseg; /* id and handle of the segment */
};

/* Called before a segment goes back to the device, so the broker can tell
 * the sessions that mapped it. */
typedef void (*gmb_pool_retire_fn)(void *ctx, const struct gmb_dseg *seg,
                                   void *arena_tag);

struct gmb_pool *gmb__pool_new(struct gmb_device *dev,
                               gmb_pool_retire_fn retire, void *ctx);
/* Releases every segment (calling retire for each).  Accepts NULL. */
void gmb__pool_destroy(struct gmb_pool *p);

/* An arena per tenant; `tag` is returned to the retire callback. */
struct gmb_arena *gmb__pool_arena_new(struct gmb_pool *p, void *tag);
/* Frees what the arena still holds, then the arena.  Accepts NULL. */
void gmb__pool_arena_destroy(struct gmb_pool *p, struct gmb_arena *a);

/*
 * Allocates `size` bytes in arena `a` for `owner`.  Returns 0 and fills
 * *out, GMB_E_INVAL for size 0 or one that overflows when rounded,
 * GMB_E_NOMEM when neither a free range nor a new segment can hold it (the
 * lingering empty segments of all arenas are released before giving up).
 */
int gmb__pool_alloc(struct gmb_pool *p, struct gmb_arena *a, uint64_t size,
                    uint32_t flags, void *owner, struct gmb_alloc_info *out);

/* Frees allocation `id`.  0, or GMB_E_NOENT when no such live allocation.
 * When `info` is not NULL it receives what was freed; its `segment` and
 * `dseg` are NULL when the free released the segment to the device. */
int gmb__pool_free(struct gmb_pool *p, uint64_t id,
                   struct gmb_alloc_info *info);

/* Looks up a live allocation: 0 or GMB_E_NOENT. */
int gmb__pool_find(const struct gmb_pool *p, uint64_t id,
                   struct gmb_alloc_info *out);

/* Frees every allocation of arena `a` whose owner is `owner`; returns the
 * bytes freed (rounded sizes). */
uint64_t gmb__pool_free_owner(struct gmb_pool *p, struct gmb_arena *a,
                              void *owner);

/* Releases lingering empty segments; returns the bytes given back. */
uint64_t gmb__pool_trim(struct gmb_pool *p);

/* Looks up a live segment by id: its device segment, or NULL.  *arena_tag
 * (may be NULL) receives the tag of the arena that owns it. */
const struct gmb_dseg *gmb__pool_segment(const struct gmb_pool *p,
                                         uint64_t seg_id, void **arena_tag);

struct gmb_arena_stats {
  uint64_t used;          /* bytes of live allocations */
  uint64_t allocations;   /* count */
  uint64_t segment_bytes; /* bytes of segments held */
  uint64_t segments;
  uint64_t free_total;    /* free bytes inside its segments */
  uint64_t largest_free;  /* largest free range inside its segments */
};
void gmb__pool_arena_stats(const struct gmb_arena *a,
                           struct gmb_arena_stats *out);

struct gmb_pool_stats {
  uint64_t capacity;      /* device capacity */
  uint64_t segment_bytes; /* bytes of live segments, all arenas */
  uint64_t segments;
  uint64_t used;          /* bytes of live allocations */
  uint64_t allocations;
};
void gmb__pool_stats(const struct gmb_pool *p, struct gmb_pool_stats *out);

/* Visits every range of every segment in address order; `info->id` is 0 for
 * a free range.  Stops when fn returns non-zero and returns that value. */
typedef int (*gmb_pool_walk_fn)(void *ctx, const struct gmb_alloc_info *info,
                                int is_free);
int gmb__pool_walk(const struct gmb_pool *p, gmb_pool_walk_fn fn, void *ctx);

/* Returns the number of broken invariants (0 when sound), logging each at
 * error level. */
int gmb__pool_check(const struct gmb_pool *p);

#endif /* GMB_POOL_H */
