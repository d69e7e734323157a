/*
 * repack.h - a plan of moves that empties one small segment of an arena
 * when no single round of moves into holes can (compact.c's last goal
 * pass, COMPACT_PASS_REPACK).
 *
 * The case: a tenant's segments on a full device each hold a 1 MiB or
 * 512 KiB block, a few smaller ones and a hole of 100-450 KiB.  The holes
 * add up to more than a segment, but none holds a block of 512 KiB, so no
 * segment can empty by moving its blocks into holes, and a request that
 * needs a fresh segment is refused with megabytes free.  A repack plans a
 * chain instead: for each block of the segment to empty (the victim) that
 * fits no hole, it picks a window of the block's size in another segment
 * whose smaller blocks do have places elsewhere, moves those first, then
 * the block into the window.  Victims are movable segments that hold
 * nothing pinned, locked or in flight, least used first.
 *
 * A hole for a waiting small request is made the same way (a window for a
 * block that does not exist), or by packing one segment: some of its
 * blocks move to holes elsewhere, and the rest slide down within it until
 * its free bytes are one range of the hole's size.  That serves the
 * segment whose blocks are larger than the holes elsewhere (a 64 KiB block
 * under three of 256 KiB, and 192 KiB free above them: the 64 KiB block
 * moves out, the three slide down, and the top 256 KiB are free).
 *
 * The planner works on a copy of the arena's layout (a model) and never
 * changes the pool.  The caller carries the steps out in order, each a
 * gmb__pool_move_begin() into a range that the steps before it left free
 * (a slide within a segment may overlap its old place, the free range just
 * below it); no step empties a segment other than the victim or the
 * segment a hole plan packs (so none releases a segment that a later step
 * targets).  When the pool changed in
 * between (a free, an allocation, a lock), a step finds its allocation
 * gone or its target taken, and the caller drops the rest of the plan.
 *
 * Cost: the work is counted in ranges visited against a budget the caller
 * gives; a plan that would pass it is not made (an arena of a hundred
 * thousand tiny allocations simply gets no repack).
 */
#ifndef GMB_REPACK_H
#define GMB_REPACK_H

#include <stddef.h>
#include <stdint.h>

#include "pool_impl.h"

struct gmb_repack_step {
  uint64_t id; /* the allocation */
  uint64_t size;
  uint64_t src_seg;             /* where it is */
  uint64_t dst_seg, dst_offset; /* where it goes */
};

struct gmb_repack_plan {
  struct gmb_repack_step *steps;
  size_t n, cap;
  uint64_t victim; /* the segment it empties */
  uint64_t bytes;  /* the bytes it moves */
};

/* 1 when live range r may move now (movable, not moving, not locked). */
typedef int (*gmb_repack_movable_fn)(void *ctx, const struct pool_range *r);

/*
 * hole 0: plans the emptying of one small segment of arena a, of id at
 * most max_seg; tries the least used candidates in turn (at most
 * GMB_REPACK_VICTIMS) and keeps the plan that moves the fewest bytes.
 * hole > 0: plans a free range of `hole` bytes in a's segments instead (a
 * window made as for a block of that size, or one of the
 * GMB_REPACK_VICTIMS segments with the most free bytes packed; the
 * cheapest; victim 0).  *budget loses the
 * ranges visited.  Returns 1 with *out filled (it must be empty; clear it
 * with gmb__repack_plan_clear), 0 when there is no plan or the budget ran
 * out, GMB_E_NOMEM when out of host memory.
 */
#define GMB_REPACK_VICTIMS 8u
/* A slide within a segment that overlaps its old place copies size/shift
 * chunks; past this many it is not worth it (on a GPU each chunk is a
 * copy call).  The engine's slide pass uses the same bound. */
#define GMB_REPACK_SLIDE_CHUNKS 64u
/* The budget compaction gives one planning, all arenas together (ranges
 * visited; tests/bench/bench_compact.c measures what it costs). */
#define GMB_REPACK_BUDGET (UINT64_C(1) << 18)
int gmb__repack_plan(const struct gmb_pool *p, const struct gmb_arena *a,
                     uint64_t max_seg, uint64_t hole,
                     gmb_repack_movable_fn movable, void *ctx,
                     uint64_t *budget, struct gmb_repack_plan *out);

/* A window of a segment: [lo, lo + size) of segment seg, weighed by the
 * bytes of the blocks that would move out of it.  compact.c's hole pass
 * weighs windows too. */
#define GMB_REPACK_WINDOWS 4u
struct gmb_repack_window {
  uint64_t cost, seg, lo;
};

/* Keeps w among the *n (<= GMB_REPACK_WINDOWS) cheapest in best, in order
 * of cost; of equal costs the first kept stays first. */
void gmb__repack_window_keep(struct gmb_repack_window *best, size_t *n,
                             const struct gmb_repack_window *w);

/* Frees the steps and empties the plan.  Accepts an empty one. */
void gmb__repack_plan_clear(struct gmb_repack_plan *plan);

#endif /* GMB_REPACK_H */
