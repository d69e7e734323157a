/*
 * locktab.h - the broker's side of a session's lock table (the layout and
 * the protocol are in proto/locktab_layout.h).
 *
 * One table per session, created at Hello and destroyed when the session
 * ends.  The broker hands out one slot per movable allocation, claims a
 * slot (0 -> MOVING) before it moves the allocation, publishes the new
 * position when the move is committed and releases the claim when it is
 * abandoned.  Nothing here includes zmq or protobuf.
 *
 * The shared words can be written by the session's process, which may be
 * buggy or hostile: nothing read from the mapping is trusted beyond the
 * single CAS that decides whether a move may start, and no such value ever
 * triggers an assertion.  The free list lives in the broker's private
 * memory for that reason.  A slot index the broker passes that it never
 * handed out is a broker bug (GMB_ASSERT).
 */
#ifndef GMB_BROKER_LOCKTAB_H
#define GMB_BROKER_LOCKTAB_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "locktab_layout.h" /* the shared layout (proto/) */

struct gmb_locktab;

/* The pool tag of a movable allocation names its slot: tag 0 is "no slot"
 * (a pinned allocation), slot n is tag n + 1.  Only these two convert. */
static inline uint32_t gmb__locktab_tag(uint32_t slot) { return slot + 1; }

/* 1 with *slot set when `tag` names a slot; 0 for a pinned allocation. */
static inline int gmb__locktab_tag_slot(uint32_t tag, uint32_t *slot) {
  if (tag == 0) return 0;
  *slot = tag - 1;
  return 1;
}

/*
 * Creates a session's table with `slots` slots: a memfd sealed against
 * shrinking and growing, mapped, its header filled.  The session's process
 * gets it only as a descriptor (the descriptor channel), so no other
 * process can open it.  Returns the table, or NULL with the reason in err
 * (slots 0 or too many, a failed system call).
 */
struct gmb_locktab *gmb__locktab_new(uint64_t session_id, uint32_t slots,
                                     char *err, size_t errcap);

/* The table's memfd (owned by the table), to send to its client. */
int gmb__locktab_fd(const struct gmb_locktab *lt);

/* The table's size in bytes: gmb__lt_bytes(slots). */
uint64_t gmb__locktab_bytes(const struct gmb_locktab *lt);

/* Number of slots (HelloReply.lock_slots). */
uint32_t gmb__locktab_slots(const struct gmb_locktab *lt);

/* Number of slots handed out and not freed. */
uint32_t gmb__locktab_used(const struct gmb_locktab *lt);

/*
 * Takes a free slot for allocation `id` (not 0) at (segment, offset), with
 * no holders.  O(1) amortized.  Returns 0 with *slot set, GMB_E_LIMIT when
 * every slot is taken, or GMB_E_SYSTEM out of host memory.
 */
int gmb__locktab_slot_new(struct gmb_locktab *lt, uint64_t id,
                          uint64_t segment, uint64_t offset, uint32_t *slot);

/* Gives a slot back (the allocation was freed): state 0, id 0.  O(1).
 * Whatever the client still holds on it is void. */
void gmb__locktab_slot_free(struct gmb_locktab *lt, uint32_t slot);

/* CAS state 0 -> MOVING: 1 when taken (the allocation may be moved), 0
 * when somebody holds it locked (or the state is anything but 0). */
int gmb__locktab_claim(struct gmb_locktab *lt, uint32_t slot);

/* Ends a claim after a committed move: writes the new position, then
 * stores state 0 with release, so that the next gmb_lock reads it. */
void gmb__locktab_publish(struct gmb_locktab *lt, uint32_t slot,
                          uint64_t segment, uint64_t offset);

/* Ends a claim after an abandoned move: state 0, position unchanged. */
void gmb__locktab_release(struct gmb_locktab *lt, uint32_t slot);

/* Marks the table's session evicted (the header's `evicted` word), for
 * its process to see in gmb_lock without a message.  Before the session
 * ends: the client keeps its own mapping of the table afterwards. */
void gmb__locktab_evict(struct gmb_locktab *lt);

/* The number of holders of the slot now (0 when unlocked or MOVING); for
 * explaining why memory could not be moved. */
uint32_t gmb__locktab_holders(const struct gmb_locktab *lt, uint32_t slot);

/* The allocation id the slot serves (0: free), as the broker wrote it. */
uint64_t gmb__locktab_slot_id(const struct gmb_locktab *lt, uint32_t slot);

/* Unmaps, closes the memfd (the client's mapping stays its own), frees.
 * Accepts NULL. */
void gmb__locktab_destroy(struct gmb_locktab *lt);

/* Offloads (offload.c), on a slot claimed (MOVING) by this broker: the
 * allocation's bytes went to host memory; stores GMB_LT_OFFLOADED and
 * wakes the sleepers, who then ask the broker for it. */
void gmb__locktab_offloaded(struct gmb_locktab *lt, uint32_t slot);
/* Starts a restore of an offloaded slot: stores MOVING (whatever the
 * client wrote there: the broker's record says it is offloaded), so a
 * gmb_lock meanwhile waits as for a move. */
void gmb__locktab_restoring(struct gmb_locktab *lt, uint32_t slot);
/* Ends a restore: the new position, then state 1, the hold of the client
 * whose Lock request brought it back (released with its gmb_unlock), and
 * the sleepers woken.  `held` 0: state 0 (nobody's hold; an operator's
 * resume). */
void gmb__locktab_restored(struct gmb_locktab *lt, uint32_t slot,
                           uint64_t segment, uint64_t offset, int held);
/* A restore that failed: back to GMB_LT_OFFLOADED, sleepers woken. */
#define gmb__locktab_unrestored gmb__locktab_offloaded

#endif /* GMB_BROKER_LOCKTAB_H */
