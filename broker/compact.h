/*
 * compact.h - defragmentation: moving movable allocations so that free
 * space is gathered again and emptied segments go back to the device.
 *
 * A compaction run is an explicit cursor (struct gmb_compact) that the
 * broker's loop drives with gmb__compact_step(c, deadline): each step does
 * work until the deadline and returns, so the loop answers other clients
 * between steps, even while a large allocation is being copied (copies are
 * chunked; a chunk never overlaps its destination).  A run covers one
 * arena or all of them.
 *
 * Policy: allocations move out of the least used movable small segments
 * of an arena into free ranges of fuller small segments of the same arena
 * (the holes of pinned segments first: those can never be given back), or
 * to lower offsets of their own segment, so that the least used segments
 * empty and are released.  A move never goes to a segment that is less
 * used than its source, so a run ends.  Pinned allocations never move, and
 * mobility grouping (pool.h) keeps them out of movable segments; movable
 * ones move only when the broker's `claim` hook takes them (their
 * lock-table slot went 0 -> MOVING, i.e. nobody holds them locked).  A
 * segment that holds a locked allocation when the run looks at it counts
 * as pinned for that run: it is not emptied (its other allocations would
 * move for nothing), only packed down in a run without a goal.  When a
 * second run in a row finds the same allocation locked, the pool notes
 * the lock as held (gmb__pool_note_lock) and the segment counts as pinned
 * beyond the run (pool.h rule 2): it ranks with the pinned ones, fullest,
 * and moves fill its holes first, until a run (each looks at such
 * segments when it starts) finds the lock free.  Large
 * allocations have a segment each and never move.
 *
 * A run with a goal (a request waits for that much device room) stops as
 * soon as the room is there, emptying the least used segments first, so
 * it moves the fewest bytes that give the room back; before it gives up it
 * packs every segment down (a slide within the segment, for allocations
 * larger than the holes between them) and tries to empty segments again,
 * into any segment, and last by planned chains of moves (repack.h: a
 * block that fits no hole goes into a window that moves of smaller blocks
 * clear first).  A planning is one step of bounded work
 * (GMB_REPACK_BUDGET), not a slice of the deadline.
 * A run without a goal (an operator's, the background one) visits every
 * segment once.
 *
 * A move either did not happen (target released, allocation where it was)
 * or is committed: the allocation's id names the new range, the old range
 * is free (and its segment released if it emptied), and `publish` has told
 * the owner where it is now.  Between steps the rest of the broker may free
 * the allocation being moved or end its session: it calls
 * gmb__compact_forget() first, which abandons that move.
 */
#ifndef GMB_COMPACT_H
#define GMB_COMPACT_H

#include <stdint.h>

#include "pool.h"

struct gmb_compact;

struct gmb_compact_hooks {
  void *ctx;
  /* Takes allocation `a` for a move: 1 when taken, 0 when it is locked
   * (skipped this run). */
  int (*claim)(void *ctx, const struct gmb_alloc_info *a);
  /* The move is committed: `moved` is the allocation at its new place.
   * Publish the new position and let go of the claim. */
  void (*publish)(void *ctx, const struct gmb_alloc_info *moved);
  /* The move was abandoned: let go of the claim; nothing moved. */
  void (*release)(void *ctx, const struct gmb_alloc_info *a);
  /* 1 when `a` is held locked now (a claim would be refused); takes
   * nothing.  NULL: locks are found out only by claiming. */
  int (*locked)(void *ctx, const struct gmb_alloc_info *a);
};

struct gmb_compact_stats {
  uint64_t moves;             /* committed moves */
  uint64_t bytes_moved;
  uint64_t segments_released; /* segments that emptied and went back */
  uint64_t bytes_released;
  uint64_t skipped_locked;    /* claims refused (an allocation refused in
                                 both passes over its segment, evacuate
                                 then slide, counts twice) */
  uint64_t skipped_pinned;    /* pinned allocations in its scope when it
                                 began (they never move) */
  uint64_t plans;             /* repack plans begun (COMPACT_PASS_REPACK) */
  uint64_t ns;                /* time spent inside gmb__compact_step */
  uint64_t ns_release;        /* of which committing moves that released a
                                 segment (the device's release dominates) */
};

/* Starts a run over arena `a`, or over every arena when `a` is NULL.
 * `goal`: the device room (gmb_pool_stats.room) the run is for; it ends
 * once that much is there; 0: a whole run.  NULL on ENOMEM.  The hooks are
 * copied; any may be NULL (no claim: every movable allocation is taken).
 * Only segments that exist now are emptied or packed by this run (new ones
 * may receive moves). */
struct gmb_compact *gmb__compact_new(struct gmb_pool *p, struct gmb_arena *a,
                                     uint64_t goal,
                                     const struct gmb_compact_hooks *hooks);

/* Another request waits for this run: it wants `bytes` more room.  No-op
 * for a run without a goal, which never makes room for one request (a
 * request that joins it gets a goal run of its own when it ends: defrag.c,
 * gmb__waitq_compaction_over). */
void gmb__compact_add_goal(struct gmb_compact *c, uint64_t bytes);

/* A goal run may also end when arena `a` has a small free range of `size`
 * bytes (a small request of a tenant whose segments have room in total
 * but no hole for it): the run's last pass (COMPACT_PASS_HOLE) moves the
 * blocks of the cheapest window of one of a's segments (fewest bytes,
 * nothing pinned or locked, every block with a place) elsewhere to make
 * that hole.
 * One such goal per run (the first kept); no-op without a goal. */
void gmb__compact_add_hole(struct gmb_compact *c, struct gmb_arena *a,
                           uint64_t size);

/* Works until `deadline_ns` (gmb__now_ns clock); always makes some progress
 * (at least one chunk of a copy, or one decision).  Returns 1 while there
 * is more to do, 0 when the run is over. */
int gmb__compact_step(struct gmb_compact *c, uint64_t deadline_ns);

/* The allocation `id` is about to be freed (or its session ended): if it is
 * being moved, the move is abandoned (release is NOT called: the caller is
 * freeing it anyway).  Returns 1 when a move was abandoned. */
int gmb__compact_forget(struct gmb_compact *c, uint64_t id);

/* Every allocation of `owner` is about to be freed (its session ended): if
 * one of them is being moved, the move is abandoned as by
 * gmb__compact_forget().  Returns 1 when a move was abandoned. */
int gmb__compact_forget_owner(struct gmb_compact *c, const void *owner);

/* The arena is about to be destroyed: stop touching it.  A move out of it
 * is abandoned without calling release (its allocations are all going). */
void gmb__compact_forget_arena(struct gmb_compact *c, struct gmb_arena *a);

void gmb__compact_stats(const struct gmb_compact *c,
                        struct gmb_compact_stats *out);

/* Ends a run; a move in flight is abandoned (release is called).  Accepts
 * NULL. */
void gmb__compact_destroy(struct gmb_compact *c);

#endif /* GMB_COMPACT_H */
