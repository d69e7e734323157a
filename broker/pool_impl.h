/*
 * pool_impl.h - the pool's internal structures, shared by pool.c (and
 * pool_check.c, its stats, walks and invariants) and the compaction engine
 * (compact.c, and repack.c, its planner) only.  No other file includes
 * it.
 *
 * Why compact.c sees them: the compaction engine makes many small decisions
 * (which segment is least used, which free range of a fuller segment fits,
 * what lies just below an allocation) that a narrow API would either answer
 * slowly (a walk per question) or leak anyway.  The boundary is instead:
 *   - compact.c READS these structures, inside one call of
 *     gmb__compact_step(), and never keeps a pointer into them across calls:
 *     between steps it holds segment ids, allocation ids and offsets only,
 *     and looks them up again (the rest of the broker allocates and frees
 *     between steps, which recycles range structs and releases segments);
 *   - only pool.c WRITES them.  Every change compaction makes goes through
 *     gmb__pool_move_begin/commit/abort (pool.h), which keep the invariants
 *     that gmb__pool_check() verifies.
 *
 * Range kinds (pool_range.flags):
 *   GMB_RANGE_FREE     free: in its arena's tree for its class
 *   GMB_RANGE_TARGET   a move target in flight: neither free nor live, in
 *                      the pool's list of moves, `slot` names the
 *                      allocation that moves there
 *   otherwise          live: in the slot table; POOL_MOVING_SRC set while a
 *                      move of it is in flight
 *   GMB_RANGE_TAIL     live too, but the tail of a large allocation: its
 *                      slot is that allocation's, whose range (in a
 *                      segment of its own) points at it through u.live.tail
 */
#ifndef GMB_POOL_IMPL_H
#define GMB_POOL_IMPL_H

#include <bsd/sys/queue.h>
#include <stdint.h>

#include "pool.h"
#include "rbtree.h"

/* Size and mobility classes: a segment is of exactly one, and each arena
 * has a free tree per class.  A small segment is POOL_SMALL_PINNED while it
 * holds a pinned allocation, else POOL_SMALL_MOVABLE (pool.c moves its free
 * ranges between the two trees when that changes).  A large segment holds
 * one allocation. */
enum {
  POOL_SMALL_MOVABLE = 0,
  POOL_SMALL_PINNED = 1,
  POOL_LARGE = 2,
  POOL_CLASSES = 3
};

static inline int pool_cls_small(uint32_t cls) { return cls != POOL_LARGE; }

/* A live range whose move is in flight.  Never seen outside pool.c and
 * compact.c: pool_info() masks it out. */
#define POOL_MOVING_SRC 0x400u
/* What compaction runs found of a live movable range's lock
 * (gmb__pool_note_lock): POOL_LOCK_SEEN, a run found it locked;
 * POOL_LOCK_HELD, a later run found it locked again, and no run found it
 * free in between: a lock held across runs.  Such a range counts as
 * pinned for placement (its segment's `held`): pinned requests may take
 * that segment's holes, and moves fill them first.  Masked out of
 * pool_info() too. */
#define POOL_LOCK_SEEN 0x800u
#define POOL_LOCK_HELD 0x1000u

struct pool_range {
  struct pool_range *prev, *next; /* address order within the segment */
  struct gmb_segment *seg;
  uint64_t offset;
  uint64_t size;
  uint32_t flags; /* GMB_RANGE_FREE, GMB_RANGE_TARGET, or the allocation's */
  uint32_t slot;  /* live: its slot; target: the moving allocation's slot */
  union {
    RB_ENTRY(pool_range) node; /* free: in the arena's tree */
    struct {
      void *owner;
      uint32_t tag;
      /* A large allocation's tail in a small segment (GMB_RANGE_TAIL,
       * pool.h rule 1), or NULL.  The tail's own `tail` is NULL; its
       * `slot` is the allocation's, but the slot points here. */
      struct pool_range *tail;
    } live;
    struct {
      struct pool_range *next; /* the pool's list of moves in flight */
      uint64_t serial;         /* names the move (gmb_pool_move.serial) */
    } target;
  } u;
};

RB_HEAD(pool_free_tree, pool_range);

struct gmb_segment {
  struct gmb_dseg dseg;
  struct gmb_arena *arena;
  struct pool_range *first;
  RB_ENTRY(gmb_segment) by_id;  /* the pool's tree of segments */
  LIST_ENTRY(gmb_segment) link; /* the arena's segments */
  uint64_t used;                /* bytes of live ranges */
  uint64_t reserved;            /* bytes of move targets */
  uint32_t live;                /* count of live ranges */
  uint32_t pinned;              /* live ranges without GMB_MOVABLE */
  uint32_t targets;             /* count of move targets */
  uint32_t cls;
  uint32_t held;                /* live ranges with POOL_LOCK_HELD */
  uint32_t tails;               /* of `live`, tails of large allocations */
  uint32_t sealed;              /* gmb__pool_seal: its free ranges are in
                                   no tree (nothing new lands in it) */
};

RB_HEAD(pool_seg_tree, gmb_segment);

struct gmb_arena {
  void *tag;
  struct gmb_pool *pool;
  struct pool_free_tree free[POOL_CLASSES];
  LIST_HEAD(, gmb_segment) segs;
  LIST_ENTRY(gmb_arena) link;
  struct gmb_segment *linger; /* an empty small segment kept, or NULL */
  uint64_t used, allocations, segment_bytes, segments, free_total;
  uint64_t moving; /* bytes of move targets in its segments */
  uint64_t held;   /* its segments whose `held` is not 0 */
  /* The largest free range in its small classes' trees (0: none), its
   * key in the pool's by_largest, which holds the arena while it is not
   * 0: the device's largest free range is never a walk of the arenas.
   * A change of the trees that may alter it only puts the arena on the
   * pool's `unsettled` list (an allocation and a free cost no search);
   * gmb__pool_stats settles the arenas listed, O(log) each. */
  uint64_t largest;
  RB_ENTRY(gmb_arena) by_largest;
  int unsettled;
  LIST_ENTRY(gmb_arena) unsettled_link;
};
RB_HEAD(pool_arena_tree, gmb_arena);

/* A segment with neither live ranges nor move targets: it is released or
 * lingers. */
static inline int pool_seg_idle(const struct gmb_segment *s) {
  return s->live == 0 && s->targets == 0;
}

static inline int pool_is_live(const struct pool_range *r) {
  return !(r->flags & (GMB_RANGE_FREE | GMB_RANGE_TARGET));
}

/* ---- the pool itself: pool.c writes it, pool_check.c reads it (stats,
 * walks, the invariants); compaction goes through the functions below. */

#define POOL_SLOT_NONE UINT32_MAX

/* One entry of the slot table.  The pointer and the generation share a
 * cache line so that looking an id up costs one miss, not two. */
struct pool_slot {
  struct pool_range *r; /* NULL: free or retired */
  uint32_t gen;         /* generation of the id the slot hands out next/now */
  uint32_t next_free;   /* free list, when r is NULL */
};

struct pool_chunk {
  struct pool_chunk *next;
  struct pool_range r[];
};

struct gmb_pool {
  struct gmb_device *dev;
  gmb_pool_retire_fn retire;
  void *ctx;
  LIST_HEAD(, gmb_arena) arenas;
  struct pool_seg_tree segs;
  uint64_t next_seg_id;
  uint64_t segment_bytes, segments, used, allocations;
  uint64_t lingering; /* arenas whose `linger` is set */
  uint64_t free_total; /* the arenas' free_total, summed */
  struct pool_arena_tree by_largest; /* arenas with a `largest`, by it */
  LIST_HEAD(, gmb_arena) unsettled;  /* arenas whose `largest` may be stale */
  uint64_t stats_walks; /* gmb__pool_stats_walk calls (tests count them) */

  struct pool_slot *slots;
  uint32_t nslots, slot_cap, slot_free;

  struct pool_chunk *chunks;
  struct pool_range *range_free; /* linked through `next` */
  uint64_t nchunks, nrange_free;

  struct pool_range *moves; /* move targets in flight, via u.target.next */
  uint64_t nmoves, next_serial;
  uint64_t changes; /* gmb__pool_changes(): bumped by every change a walk
                       would see */
  int grouping; /* rule 2 applies (compaction on); else best fit in both */
};

RB_PROTOTYPE(pool_free_tree, pool_range, u.node, pool_free_cmp)
RB_PROTOTYPE(pool_seg_tree, gmb_segment, by_id, pool_seg_cmp)
RB_PROTOTYPE(pool_arena_tree, gmb_arena, by_largest, pool_arena_cmp)

static inline int pool_slot_live(const struct gmb_pool *p, uint32_t i) {
  return i < p->nslots && p->slots[i].r != NULL;
}

/* What gmb__pool_find() reports of range r (live, free or a target: a
 * target reports id 0, a free range is_free). */
void gmb__pool_info(const struct gmb_pool *p, const struct pool_range *r,
                    struct gmb_alloc_info *out);

/* The largest free range in arena a's small classes' trees, searched
 * (a->largest keeps it once the arena is settled). */
uint64_t gmb__pool_arena_largest(const struct gmb_arena *a);

/* Settles every arena whose largest free range may have changed since
 * (struct gmb_arena, `unsettled`): O(log) each. */
void gmb__pool_settle(struct gmb_pool *p);

/* The device the pool's segments come from. */
struct gmb_device *gmb__pool_device(const struct gmb_pool *p);

/* The segment with id `id`, or NULL. */
struct gmb_segment *gmb__pool_seg_by_id(const struct gmb_pool *p, uint64_t id);

/* The live range of allocation `id`, or NULL. */
struct pool_range *gmb__pool_range_by_id(const struct gmb_pool *p,
                                         uint64_t id);

/* The id of live range r. */
uint64_t gmb__pool_range_id(const struct gmb_pool *p,
                            const struct pool_range *r);

/* Best fit: the smallest free range of at least `size` bytes in arena a's
 * tree for class `cls` whose segment `accept` approves (ties: lowest
 * segment id, then offset), or NULL.  O(free ranges skipped). */
typedef int (*gmb_pool_seg_accept_fn)(void *ctx, const struct gmb_segment *s);
struct pool_range *gmb__pool_fit(const struct gmb_pool *p,
                                 const struct gmb_arena *a, uint32_t cls,
                                 uint64_t size, gmb_pool_seg_accept_fn accept,
                                 void *ctx);

/* gmb__pool_move_begin() for a caller that already holds the range that
 * contains dst_offset (no walk of the segment to find it). */
int gmb__pool_move_begin_at(struct gmb_pool *p, uint64_t id,
                            struct pool_range *fr, uint64_t dst_offset,
                            struct gmb_pool_move *out);

/* What a compaction run found of live range r's lock: locked 0, free at
 * that moment (POOL_LOCK_SEEN and _HELD go); 1, the run that found it
 * locked has ended (SEEN becomes HELD, else SEEN is set).  Call it once
 * per run for a range it found locked. */
void gmb__pool_note_lock(struct gmb_pool *p, const struct pool_range *r,
                         int locked);

/* The range of s that holds byte `off` (ranges tile the segment), or NULL
 * past its end.  O(ranges below it). */
struct pool_range *gmb__pool_range_at(const struct gmb_segment *s,
                                      uint64_t off);

/* The pool's arena after `a` (NULL: the first), or NULL. */
struct gmb_arena *gmb__pool_arena_next(const struct gmb_pool *p,
                                       const struct gmb_arena *a);

/* The first segment of the pool (id order) after `s` (NULL: the first). */
struct gmb_segment *gmb__pool_seg_next(const struct gmb_pool *p,
                                       const struct gmb_segment *s);

#endif /* GMB_POOL_IMPL_H */
