/*
 * locktab_layout.h - the layout of a session's lock table, shared by the
 * broker and the client library.
 *
 * A lock table is a sealed memfd in host memory, created by the broker at
 * Hello for one session and mapped by the broker and that session's
 * process only (the process gets it as a descriptor on the descriptor
 * channel; it has no name anyone could open).  It has one slot per
 * movable allocation of the session.  `state` is the only word both sides
 * write:
 *
 *   0 .. GMB_LT_MAX_HOLDERS   that many gmb_lock holders; the allocation
 *                             is at (segment, offset) and stays there
 *   GMB_LT_MOVING             the broker is moving it; wait
 *   GMB_LT_MOVING | GMB_LT_WAITERS   the same, and a gmb_lock sleeps on
 *                             the word (a futex): the broker wakes it
 *   GMB_LT_OFFLOADED          the broker offloaded it (its bytes are in the
 *                             broker's host memory, its device range went
 *                             back): segment and offset mean nothing; a
 *                             gmb_lock asks the broker (a Lock request),
 *                             which copies it back and takes the hold for
 *                             the caller (state 1) before it answers
 *
 * Client, gmb_lock:   CAS state n -> n+1 (n not MOVING), acquire; then read
 *                     segment and offset.  gmb_unlock: atomic decrement,
 *                     release.
 * Broker, a move:     CAS state 0 -> MOVING (acquire; a locked allocation is
 *                     skipped), copy the bytes, write segment and offset,
 *                     then exchange 0 (release); when the old value had
 *                     GMB_LT_WAITERS, FUTEX_WAKE every waiter on the word.
 * Client, mid-move:   spin briefly; then CAS MOVING -> MOVING|WAITERS and
 *                     FUTEX_WAIT on MOVING|WAITERS, each wait bounded
 *                     (GMB_LT_WAIT_SLICE_NS), until the state changes or
 *                     the caller's timeout passes.  So a lock that lands
 *                     mid-move returns when the move ends plus a wake-up,
 *                     not after a sleep that happened to be running.
 * Broker, an offload: the same claim (0 -> MOVING), the copy to host
 *                     memory, then exchange GMB_LT_OFFLOADED (release),
 *                     waking the waiters as a move's end does: they see
 *                     OFFLOADED and ask the broker.  A client never
 *                     changes an OFFLOADED word: only the broker's restore
 *                     (exchange MOVING, copy, position, then store 1) or
 *                     the allocation's free does.
 * The broker never waits on the word: a wake is one system call that
 * never blocks, whatever the client wrote there.  A client that sets
 * WAITERS on a slot that is not MOVING makes it look locked to the broker
 * (no move starts): it hurts only its own allocation.  A broker that
 * predates WAITERS stores 0 without a wake; its clients' waits then end
 * at the slice.
 * The acquire/release pairs order the plain reads and writes of segment and
 * offset, so a holder never sees a half-written position, and no move can
 * start while anybody holds the lock.  Atomics on a shared mapping are
 * address-free on Linux for these lock-free 32-bit words.
 *
 * `id` names the allocation the slot serves (0: a free slot), so a client
 * can tell a reused slot from its own.
 */
#ifndef GMB_LOCKTAB_LAYOUT_H
#define GMB_LOCKTAB_LAYOUT_H

#include <errno.h>
#include <linux/futex.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define GMB_LT_MAGIC UINT64_C(0x317674626c626d67) /* "gmblbtv1" */
#define GMB_LT_VERSION 1u
#define GMB_LT_MOVING UINT32_C(0x80000000)
#define GMB_LT_WAITERS UINT32_C(0x40000000) /* with MOVING: a futex waiter */
/* With MOVING: the allocation is offloaded to the broker's host memory. */
#define GMB_LT_OFFLOAD_BIT UINT32_C(0x20000000)
#define GMB_LT_OFFLOADED (GMB_LT_MOVING | GMB_LT_OFFLOAD_BIT)
#define GMB_LT_MAX_HOLDERS (GMB_LT_OFFLOAD_BIT - 1u)
/* The longest single futex wait of a client (it checks its session and
 * its deadline between waits). */
#define GMB_LT_WAIT_SLICE_NS UINT64_C(100000000) /* 100 ms */
#define GMB_LT_DEFAULT_SLOTS 65536u /* 2 MiB of table, sparse until used */

struct gmb__lt_slot {
  _Atomic uint32_t state; /* holders, or GMB_LT_MOVING */
  uint32_t reserved;
  uint64_t id;      /* the allocation; 0 when the slot is free */
  uint64_t segment; /* where it is now */
  uint64_t offset;
};

struct gmb__lt_header {
  uint64_t magic;   /* GMB_LT_MAGIC */
  uint32_t version; /* GMB_LT_VERSION */
  uint32_t slots;   /* number of slots after the header */
  uint64_t session; /* the session it belongs to */
  _Atomic uint32_t evicted; /* GMB_LT_EVICTED once the session was evicted */
  uint32_t reserved0;
  uint8_t reserved[32];
};

/* The header's `evicted` word: the broker stores it (release) before it
 * ends a session an operator evicted, so gmb_lock, which sends no message,
 * sees the eviction at once (acquire) and fails GMB_E_EVICTED.  Zero in
 * tables of brokers that never set it. */
#define GMB_LT_EVICTED UINT32_C(1)

_Static_assert(sizeof(struct gmb__lt_slot) == 32, "lock table slot layout");
_Static_assert(sizeof(struct gmb__lt_header) == 64, "lock table header layout");

/* Bytes of a table with `slots` slots. */
static inline uint64_t gmb__lt_bytes(uint32_t slots) {
  return sizeof(struct gmb__lt_header) +
         (uint64_t)slots * sizeof(struct gmb__lt_slot);
}

static inline struct gmb__lt_slot *gmb__lt_slots(struct gmb__lt_header *h) {
  return (struct gmb__lt_slot *)(h + 1);
}

/* Sleeps while *word == expect, at most timeout_ns: 0 when woken (or the
 * word changed first: EAGAIN), -1 with errno ETIMEDOUT or EINTR.  A
 * shared futex (no FUTEX_PRIVATE_FLAG): the word lives in a mapping that
 * two processes share. */
static inline int gmb__lt_futex_wait(_Atomic uint32_t *word, uint32_t expect,
                                     uint64_t timeout_ns) {
  struct timespec ts = {(time_t)(timeout_ns / 1000000000u),
                        (long)(timeout_ns % 1000000000u)};
  long rc = syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT, expect, &ts,
                    NULL, 0);
  if (rc == 0 || errno == EAGAIN) return 0;
  return -1;
}

/* Wakes every waiter on *word; never blocks.  Returns how many woke, or
 * -1 (a word that is not mapped: a bug of the caller). */
static inline long gmb__lt_futex_wake(_Atomic uint32_t *word) {
  return syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE, INT32_MAX, NULL,
                 NULL, 0);
}

#endif /* GMB_LOCKTAB_LAYOUT_H */
