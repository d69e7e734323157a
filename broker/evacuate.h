/*
 * evacuate.h - moving an arena's live bytes out of its sealed segments
 * (gmb__pool_seal), so that a process that mapped those segments (one
 * whose uid or token was revoked) no longer sees or writes what the
 * tenant keeps.
 *
 * The engine is compaction's (compact.h) with another policy: every
 * movable allocation of a sealed segment moves, to the best fit among the
 * arena's free ranges outside sealed segments (pinned segments' holes
 * first, as compaction fills them), else to a new small segment; a sealed
 * segment that empties goes back to the device at once.  A move claims
 * the allocation through the same hooks (its lock-table slot 0 ->
 * MOVING), copies it whole (a movable allocation is small: at most
 * GMB_POOL_SMALL_MAX, and never overlaps its target, another segment),
 * commits and publishes, so its owner's next gmb_lock finds it at its new
 * place.  What cannot move stays: pinned allocations (their pointers are
 * promised forever), ones held locked, and ones a compaction move holds
 * (tried again at the next step).  The caller decides how long to try
 * again (defrag.c bounds it).
 */
#ifndef GMB_EVACUATE_H
#define GMB_EVACUATE_H

#include <stdint.h>

#include "compact.h"
#include "pool.h"

struct gmb_evac_stats {
  uint64_t moves, bytes_moved;  /* committed moves (summed over steps) */
  /* What the last whole pass found in the sealed segments and left: */
  uint64_t pinned, pinned_bytes; /* pinned allocations (and tails) */
  uint64_t locked, locked_bytes; /* movable ones it could not claim, or
                                    that had no room to go to */
  uint64_t sealed;               /* sealed segments still there */
};

/*
 * Works on arena a's sealed segments until `deadline_ns` (one move at
 * least): moves every movable allocation it can claim.  Returns 1 when it ran out of time
 * (call again), 0 when a whole pass moved nothing more: then st->pinned,
 * ->locked and ->sealed say what stays.  Moves are added to st.
 */
int gmb__evac_step(struct gmb_pool *p, struct gmb_arena *a,
                   const struct gmb_compact_hooks *h, uint64_t deadline_ns,
                   struct gmb_evac_stats *st);

#endif /* GMB_EVACUATE_H */
