/*
 * pool.h - the broker's allocator: device segments cut into 512-byte aligned
 * ranges.
 *
 * The pool owns every segment and every range.  A segment belongs to one
 * arena (one tenant) so that tenants never share a segment: a client that
 * maps a segment can read all of it.
 *
 * Placement rules (the anti-fragmentation design; docs/benchmarks.md
 * measures it):
 *   1. Large allocations never fragment, and share their last page.  A
 *      request over GMB_POOL_SMALL_MAX is pinned (large allocations never
 *      move) and cut in two: its whole 2 MiB pages get a segment of its
 *      own, released when it is freed, and the rest, its tail (under
 *      2 MiB), is a range at the start or the end of one of the tenant's
 *      small segments, whose other bytes serve its small requests.  The
 *      client maps the two segments side by side (the small one after the
 *      pages when the tail is at its start, before them when at its end;
 *      a second mapping of it beside its own: the same tenant's bytes), so
 *      the allocation is contiguous in its address space.  A request of less than one
 *      page has no segment of its own: it is all tail, and may lie
 *      anywhere in a small segment.  So a tenant's large allocations waste
 *      no more than its small ones (a 5 MiB request used to hold 6 MiB).
 *      Device memory is paged (2 MiB) and shared by descriptor, so a large
 *      segment needs free capacity, not a contiguous device range: it is
 *      served whenever the device's unsegmented capacity plus the
 *      lingering empty segments (released first) covers it.  A tail takes
 *      the best fit among the free ranges at either end of pinned small
 *      segments, else the lingering segment, else a new small segment,
 *      else (the device full) such a range of a movable segment.
 *   2. Mobility grouping (Linux's pageblock migratetypes): small requests
 *      share small segments of GMB_POOL_SMALL_SEGMENT bytes, and a pinned
 *      allocation never lands in a segment with movable ones placed by
 *      allocation: small segments are of class PINNED (it holds a pinned
 *      allocation) or MOVABLE (it holds none), each class with its own free
 *      tree per arena.  Pinned requests take the best fit among pinned
 *      segments (smallest range that fits, then lowest segment id and
 *      offset: they pack densely and low), else the best fit in a movable
 *      segment that holds a lock held across compaction runs (two runs in
 *      a row found it locked, none free in between: it counts as pinned,
 *      and the pinned allocation makes it pinned), else the arena's
 *      lingering segment, else a new one; movable requests the same among
 *      movable segments.  So a movable segment can always be emptied by moving its
 *      allocations (unless a client holds one locked), and compaction's
 *      work is never blocked by a pinned block that happened to land there.
 *      A segment whose last pinned allocation is freed becomes movable.
 *      Last resort, when the device has no room for a new segment (after
 *      the lingering ones went back): a request takes the best fit in the
 *      other class's segments rather than fail; a pinned one makes that
 *      segment pinned.  Being served beats a purer layout, and compaction
 *      (rule 3) keeps the movable allocations that land in pinned segments
 *      movable.  Grouping pays only when something is moved: with
 *      compaction off (gmb__pool_set_grouping(p, 0)) a small request takes
 *      the best fit in either class.
 *   3. Compaction may fill the holes of PINNED segments with movable
 *      allocations (the fallback direction Linux also allows): those
 *      segments cannot go back to the device anyway, so their free bytes
 *      are the cheapest place for what would otherwise keep a movable
 *      segment alive.  The reverse never happens.
 *   4. What a tenant's segments may keep empty: the free ranges of its
 *      small segments, and one lingering empty small segment, which is
 *      released before any request is refused.  When the device is full,
 *      compaction (compact.c) empties movable segments until the room a
 *      waiting request needs exists, by chains of moves or a segment packed
 *      when single moves cannot do it (repack.c); what stays free inside a tenant's
 *      segments is then less than one segment per tenant and class plus
 *      the holes between pinned and locked allocations that nothing of that
 *      tenant fits.
 * Within an arena and class the best fit is found in O(log n) in a
 * red-black tree keyed by size.  Address neighbours are a doubly linked
 * list per segment, so a freed range coalesces with both neighbours in
 * O(1).  Live allocations are found by id in O(1) through a slot table; an
 * id is (generation << 32 | slot), never 0 and never reused while the pool
 * lives.
 *
 * A segment that becomes empty goes back to the device.  The last emptied
 * small segment of each arena lingers (so a job that allocates and frees one
 * buffer in a loop does not create a segment each time) until
 * gmb__pool_trim() or device pressure releases it; it serves the next small
 * request of either class.  A segment emptied by a move (compaction) is
 * released at once: giving memory back is the point.
 *
 * Moves (for compact.c).  gmb__pool_move_begin() reserves a target range
 * for a live movable small allocation: in another small segment of the same
 * arena (either class), or lower in its own segment.  While the move is in flight the target is
 * neither free (gmb__pool_alloc never hands it out) nor live, and both its
 * segment and the source's stay (neither counts as empty).  Commit makes
 * the id name the target and frees the old range; abort frees the target.
 * Freeing the moving allocation (or its arena) drops the move too, so the
 * pool stays sound even when the mover is not told.
 *
 * Invariants, checked by gmb__pool_check(): ranges of a segment tile it with
 * no gap or overlap, in address order; no two free ranges are adjacent; the
 * free trees hold exactly the free ranges, each in its segment's class; a
 * small segment is PINNED exactly when it holds a pinned allocation (a
 * tail counts); a large segment holds exactly one allocation, pinned, and
 * its tail, if any, is a range under a page at an end of a small segment
 * of the same arena whose slot is that allocation's; per-segment,
 * per-arena and device totals add up.
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

#define GMB_RANGE_FREE 0x100u   /* internal flag; GMB_MOVABLE is 0x1 */
#define GMB_RANGE_TARGET 0x200u /* a move target in flight (pool_walk) */
#define GMB_RANGE_TAIL 0x2000u  /* a large allocation's tail (pool_walk) */

struct gmb_pool;
struct gmb_arena;
struct gmb_segment;

/* A live allocation as the broker sees it: read-only outside pool.c. */
struct gmb_alloc_info {
  uint64_t id;
  uint64_t size;    /* rounded to GMB_POOL_ALIGN */
  uint64_t offset;  /* within the segment */
  uint32_t flags;   /* GMB_MOVABLE */
  uint32_t tag;     /* the broker's, set by gmb__pool_set_tag; 0 at first */
  void *owner;
  struct gmb_segment *segment;
  const struct gmb_dseg *dseg; /* id and handle of the segment */
  /* A large allocation's tail (rule 1): `size` is then the whole
   * allocation's, the pages of its own segment (dseg) plus tail_size
   * bytes at tail_offset of segment tail_dseg.  tail_dseg is NULL and
   * tail_size 0 for one in a single segment.  A walk reports the two
   * pieces as two ranges of the same id, each with its own size, the tail
   * with GMB_RANGE_TAIL in flags. */
  const struct gmb_dseg *tail_dseg;
  uint64_t tail_offset, tail_size;
};

/* Called before a segment goes back to the device, so the broker can tell
 * the sessions that mapped it. */
typedef void (*gmb_pool_retire_fn)(void *ctx, const struct gmb_dseg *seg,
                                   void *arena_tag);

struct gmb_pool *gmb__pool_new(struct gmb_device *dev,
                               gmb_pool_retire_fn retire, void *ctx);
/* Releases every segment (calling retire for each).  Accepts NULL. */
void gmb__pool_destroy(struct gmb_pool *p);

/* Mobility grouping (rule 2) on (the default) or off: the broker turns it
 * off while compaction is off, since nothing is moved then. */
void gmb__pool_set_grouping(struct gmb_pool *p, int on);

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

/* Looks up a live allocation: 0 or GMB_E_NOENT.  During a move it is still
 * where it was until the move commits. */
int gmb__pool_find(const struct gmb_pool *p, uint64_t id,
                   struct gmb_alloc_info *out);

/* Sets the 32-bit tag of a live allocation (the broker keeps its lock-table
 * slot + 1 there; 0 = none).  The tag stays with the allocation when it
 * moves.  0 or GMB_E_NOENT. */
int gmb__pool_set_tag(struct gmb_pool *p, uint64_t id, uint32_t tag);

/* Frees every allocation of arena `a` whose owner is `owner`; returns the
 * bytes freed (rounded sizes). */
uint64_t gmb__pool_free_owner(struct gmb_pool *p, struct gmb_arena *a,
                              void *owner);

/*
 * The same in slices, for many owners at once (ending sessions, core.c):
 * visits at most about `budget` ranges of arena a from segment *cursor
 * (0: the arena's first; a cursor whose segment is gone starts there
 * too), frees every live allocation whose owner `doomed` approves and
 * tells `freed` its owner and bytes (rounded, a tail included), and
 * releases the segments that empty (the arena's last lingers, as after a
 * free).  Returns 1 when the walk reached the arena's end (*cursor 0),
 * else 0 with *cursor where the next slice goes on.  Segments added in
 * front of the cursor meanwhile are not visited: a caller whose owners
 * may still hold allocations starts a new pass.
 */
typedef int (*gmb_pool_doomed_fn)(void *ctx, void *owner);
typedef void (*gmb_pool_freed_fn)(void *ctx, void *owner, uint64_t bytes);
int gmb__pool_free_owners_step(struct gmb_pool *p, struct gmb_arena *a,
                               gmb_pool_doomed_fn doomed,
                               gmb_pool_freed_fn freed, void *ctx,
                               uint64_t *cursor, uint64_t budget);

/* Releases lingering empty segments; returns the bytes given back. */
uint64_t gmb__pool_trim(struct gmb_pool *p);

/*
 * Seals segment `seg_id` (revocation: a process that mapped it may no
 * longer see what its arena keeps): nothing new is ever placed in it, no
 * allocation, tail or move target, and it goes back to the device as soon
 * as it empties (it never lingers).  What it holds stays until freed or
 * moved out (gmb__pool_move_begin into an unsealed segment).  An empty
 * (lingering) segment is released at once.  0, or GMB_E_NOENT.
 */
int gmb__pool_seal(struct gmb_pool *p, uint64_t seg_id);

/* Seals every segment of arena a (gmb__pool_seal); returns how many that
 * hold something were sealed now. */
size_t gmb__pool_seal_arena(struct gmb_pool *p, struct gmb_arena *a);

/* Adds an empty small segment to arena a, for a move that finds no free
 * range (revocation): it lingers (releasing the arena's lingering one)
 * until a move reserves its range.  0 with *seg_id, GMB_E_NOMEM (device
 * full or host memory) or a device error. */
int gmb__pool_segment_add(struct gmb_pool *p, struct gmb_arena *a,
                          uint64_t *seg_id);

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
  uint64_t moving;        /* bytes reserved as move targets in flight;
                             used + free_total + moving = segment_bytes */
  uint64_t held_segments; /* movable segments that count as pinned: they
                             hold a lock that two compaction runs in a row
                             found held (rule 2) */
};
void gmb__pool_arena_stats(const struct gmb_arena *a,
                           struct gmb_arena_stats *out);

struct gmb_pool_stats {
  uint64_t capacity;      /* device capacity */
  uint64_t segment_bytes; /* bytes of live segments, all arenas */
  uint64_t segments;
  uint64_t used;          /* bytes of live allocations */
  uint64_t allocations;
  uint64_t free_in_segments; /* free bytes inside all segments */
  /* The largest single request that could succeed now for SOME arena,
   * ignoring quotas: the larger of the largest free range in any small
   * segment (it serves only its own arena) and `room`.
   * Device fragmentation is then 1 - largest_free / (capacity - used). */
  uint64_t largest_free;
  /* The room for new segments alone: capacity - the device's bytes in use
   * (segments, and retiring ones on cuda) plus the lingering segments,
   * rounded down to 2 MiB.  A large request of that
   * size or less succeeds (placement rule 1). */
  uint64_t room;
};
/* O(log arenas): the pool keeps the sums and each arena's largest free
 * range as they change, so that a client's Stats (or a refusal's
 * explanation) costs the same however many tenants there are. */
void gmb__pool_stats(const struct gmb_pool *p, struct gmb_pool_stats *out);

/* The same figures from a walk of every arena (O(arenas)), for the tests
 * and checks that hold gmb__pool_stats to them; gmb__pool_stats_walks
 * counts the calls. */
void gmb__pool_stats_walk(const struct gmb_pool *p,
                          struct gmb_pool_stats *out);
uint64_t gmb__pool_stats_walks(const struct gmb_pool *p);

/* 1 - largest / total, 0 when nothing is free. */
double gmb__fragmentation(uint64_t largest_free, uint64_t total_free);

/* The device's fragmentation as the pool sees it: 1 - the largest range a
 * request could get now / what is not allocated (capacity - used).  Either
 * out pointer may be NULL. */
double gmb__pool_fragmentation(const struct gmb_pool *p,
                               uint64_t *largest_free, uint64_t *free_total);

/* Visits every range of every segment in address order; `info->id` is 0 for
 * a free range.  A move target in flight is reported with is_free 0, id 0,
 * owner NULL and flags GMB_RANGE_TARGET: it is neither free nor live.
 * Stops when fn returns non-zero and returns that value. */
typedef int (*gmb_pool_walk_fn)(void *ctx, const struct gmb_alloc_info *info,
                                int is_free);
int gmb__pool_walk(const struct gmb_pool *p, gmb_pool_walk_fn fn, void *ctx);

/*
 * The same walk from a cursor, for a caller that visits the pool a slice
 * at a time between requests (the paged snapshot): it starts at the first
 * range at or above `offset` in the segment `seg_id`, or, when that
 * segment is gone, at the first range of the next segment in id order
 * ((0, 0): the beginning).  When fn returns non-zero the walk stops BEFORE
 * that range (fn's return is its refusal to take it) and *next_seg,
 * *next_offset (either may be NULL) name it, the cursor to resume from;
 * they are 0 when the walk reached the end.  Returns what fn returned, or
 * 0.  Cost: O(log segments) to find the start, the ranges of that segment
 * below `offset` (a segment holds at most size / GMB_POOL_ALIGN ranges),
 * then one step per range visited.
 */
int gmb__pool_walk_from(const struct gmb_pool *p, uint64_t seg_id,
                        uint64_t offset, gmb_pool_walk_fn fn, void *ctx,
                        uint64_t *next_seg, uint64_t *next_offset);

/* What a walk may ask about the segment of a range it visits
 * (info->segment), in O(1). */
struct gmb_segment_view {
  const struct gmb_dseg *dseg; /* id and size */
  void *arena_tag;             /* its arena's tag (the broker's tenant) */
  uint64_t used;               /* bytes of its live allocations */
  int small;                   /* a shared small-request segment; 0: one
                                  large request's own */
};
void gmb__pool_segment_view(const struct gmb_segment *s,
                            struct gmb_segment_view *out);

/* A counter that grows with every change a walk could see: an allocation
 * made, freed or moved (a move begun, committed or dropped), a segment
 * created or released.  Equal values before and after mean that nothing
 * the walk reports changed in between, except `locked`, which lives in the
 * clients' lock tables.  *last_seg_id (may be NULL) receives the highest
 * segment id issued so far (ids are 1, 2, ... and never reused; 0: none). */
uint64_t gmb__pool_changes(const struct gmb_pool *p, uint64_t *last_seg_id);

/*
 * A move in flight, filled by gmb__pool_move_begin() and read by the mover.
 * `src`/`dst` stay valid until the move commits or aborts (neither segment
 * can be released meanwhile, except with the whole arena).
 */
struct gmb_pool_move {
  uint64_t serial; /* names the move inside the pool; never 0 */
  uint64_t id;     /* the allocation */
  uint64_t size;
  struct gmb_dseg *src, *dst;
  uint64_t src_offset, dst_offset; /* where it is, where it will be */
};

/*
 * Reserves [dst_offset, dst_offset + size) of segment `seg_id` for moving
 * live allocation `id` there.  The allocation must be movable and small,
 * the segment small and of the same arena.  Either the range lies inside
 * one free range, or (a slide within the same segment) the free range just
 * below the allocation covers [dst_offset, its offset): then the two
 * overlap and the copy must go in chunks no larger than the shift, lowest
 * first.  Within its own segment
 * an allocation only moves down.  0, GMB_E_NOENT (no such allocation or
 * segment), GMB_E_INVAL (a move of it is in flight, another arena, the
 * allocation pinned or large, or the range not free), GMB_E_NOMEM (host
 * memory).
 */
int gmb__pool_move_begin(struct gmb_pool *p, uint64_t id, uint64_t seg_id,
                         uint64_t dst_offset, struct gmb_pool_move *out);

/*
 * Commits move m after its bytes were copied: the id names the target, the
 * old range is freed and coalesced, and its segment, if that emptied, is
 * released at once (retire is called).  `moved` (may be NULL) receives the
 * allocation at its new place; *released (may be NULL) the bytes of the
 * segment released, else 0.  GMB_E_NOENT when the move was dropped (its
 * allocation or arena was freed meanwhile).
 */
int gmb__pool_move_commit(struct gmb_pool *p, const struct gmb_pool_move *m,
                          struct gmb_alloc_info *moved, uint64_t *released);

/* Abandons move m: the target is freed (and its segment released or left
 * lingering if nothing else is in it).  0, or GMB_E_NOENT when it was
 * already dropped. */
int gmb__pool_move_abort(struct gmb_pool *p, const struct gmb_pool_move *m);

/* Returns the number of broken invariants (0 when sound), logging each at
 * error level. */
int gmb__pool_check(const struct gmb_pool *p);

#endif /* GMB_POOL_H */
