/*
 * offload.h - the broker offloads movable allocations itself.
 *
 * A movable allocation (GMB_MOVABLE) is reached by its client only
 * through gmb_lock, so while it is unlocked its bytes are the broker's to
 * place, on the device or elsewhere.  When a request finds the device full
 * and the clients' caches cannot cover what is missing (reclaim.c, the
 * point where idle sessions are asked to sleep), the broker copies unlocked
 * movable allocations of the sessions that may be asked to sleep for that
 * request (gmb__sleep_askable: opted in, idle, of another tenant and of no
 * higher priority; in gmb__sleep_cmp's order) to host memory it holds, and
 * frees their device ranges: whole segments at a time (a segment of the
 * tenant's that holds only unlocked movable allocations of such sessions),
 * so that what it frees is room another tenant can use, never a tenant
 * below its reservation.  A segment goes all or nothing: the host bounds
 * are checked for all of it and every slot is claimed before any byte
 * moves, so a lock taken meanwhile leaves none of it offloaded for no
 * room.  Their lock-table slots say GMB_LT_OFFLOADED; a gmb_lock
 * sends a Lock request, and the broker brings the allocation back (a new
 * range, the tenant's quota and the device's room as an allocation; held
 * in the wait queue up to restore_wait_ms when there is none) and takes the
 * caller's hold before it answers.  The client keeps its id: the pool's new
 * id is the broker's business (an alias record maps one to the other until
 * the allocation is freed).
 *
 * Bounds: the host bytes of a tenant's offloads count against its
 * host_quota with its paused tags (sleep.c's GMB_SLEEP_MOVABLE_TAG record),
 * and the broker's host bytes for all tenants against offload_host_max
 * (0: it never offloads).  A session has at most as many records as its
 * lock table has slots.  Choosing what goes is one pool walk per request
 * slice or operator's pause, however many sessions are idle.  The copies
 * run on the loop thread, one allocation (at most 1 MiB: larger ones are
 * pinned) at a time, at most a slice (GMB_OFFLOAD_SLICE) per request or
 * loop turn: a request that needs more is held while an offload job
 * (reclaim.h) makes its room over the following turns.
 *
 * Invariants (gmb__offload_check): each session's records sum to its
 * set's figures and its "(movable)" sleep record; the sessions' sums to
 * b->offload; an offloaded record's slot is in use and its pool id is 0;
 * an alias record's pool allocation is live, the session's, at its slot;
 * each copy lies in what was cut of its chunk, a chunk's count of copies
 * is theirs, and the chunks the copies are in (the current one among
 * them) sum to b->offload.chunk_bytes.
 */
#ifndef GMB_OFFLOAD_H
#define GMB_OFFLOAD_H

#include <stdint.h>

#include "alloc.h"
#include "broker.h"
#include "session.h"
#include "wire.h"

/* What a client's allocation id means (gmb__offload_resolve). */
enum {
  GMB_OFFL_NONE = 0,  /* no record: the id is the pool's */
  GMB_OFFL_ALIAS = 1, /* brought back: the pool knows it by *pool_id */
  GMB_OFFL_AWAY = 2,  /* offloaded: its bytes are in host memory */
};

/* What one slice of the broker's offload copies at most (the last
 * segment it begins goes whole, so a slice may pass it by one small
 * segment): the copies of an offload job are spread over the loop's
 * turns, a slice a turn (reclaim.c), so that other requests, frees and
 * heartbeats are served between them. */
#ifndef GMB_OFFLOAD_SLICE
/* A fuzz build makes it 2 MiB (mk/fuzz.mk), so that inputs on its 16 MiB
 * device reach the offload job. */
#define GMB_OFFLOAD_SLICE (UINT64_C(64) << 20)
#endif

/* Makes up to `want` bytes of device room for session s's request that
 * found the device full, by offloading other sessions' movable
 * allocations (above), copying about `max` bytes at most (a slice: see
 * GMB_OFFLOAD_SLICE).  One walk of the pool chooses what goes, now, so
 * everything above is checked again at each slice.  Returns the room made,
 * in bytes (the pool's room after less before; 0 when nothing could be
 * taken); *more is 1 when it stopped at `max` with candidates left. */
uint64_t gmb__offload_for(struct gmb_broker *b, struct gmb_session *s,
                          uint64_t want, uint64_t max, int *more);

/* Operators (gmbctl pause|resume TENANT): offloads every unlocked movable
 * allocation of tenant t's sessions within the host bounds (pause), a
 * slice (GMB_OFFLOAD_SLICE) now and the rest a slice a loop turn
 * (gmb__offload_pause_step), or brings back those that fit now, unlocked
 * (resume, which also ends a pause still running; the others come back
 * at their next gmb_lock).  *n and *bytes: how many and their bytes, now.
 * Returns 1 when the pause goes on over the next turns. */
int gmb__offload_tenant(struct gmb_broker *b, struct gmb_tenant *t,
                        int pause, uint32_t *n, uint64_t *bytes);

/* One slice of an operator's pause still running (b->offload.pausing
 * tenants; the first of them in the tenants' order); *made: the
 * allocations it offloaded (the caller serves the queue then:
 * gmb__reclaim_pause_step).  Returns 1 while a pause goes on. */
int gmb__offload_pause_step(struct gmb_broker *b, uint32_t *made);

/* What id means for session s (GMB_OFFL_*); *pool_id is the pool's id
 * for NONE (id itself) and ALIAS, 0 for AWAY.  *size (may be NULL): the
 * bytes of an offloaded one. */
int gmb__offload_resolve(const struct gmb_session *s, uint64_t id,
                         uint64_t *pool_id, uint64_t *size);

/* Frees offloaded allocation id of s (GMB_OFFL_AWAY): its host copy, its
 * lock-table slot and its record. */
void gmb__offload_free(struct gmb_broker *b, struct gmb_session *s,
                       uint64_t id);

/* Pool allocation pool_id of s, at lock-table slot `slot`, was freed: an
 * alias record of it goes. */
void gmb__offload_freed(struct gmb_session *s, uint32_t slot,
                        uint64_t pool_id);

/* gmb__alloc_try, or for a request flagged GMB__ALLOC_RESTORE the restore
 * of s->restore_id: 0 with *rep a LockReply (held, or not offloaded any
 * more), else the refusal as gmb__alloc_try gives it (GMB_E_NOMEM with
 * *why; GMB_E_QUOTA; GMB_E_DEVICE when a copy failed: the allocation
 * stays offloaded), or GMB_E_NOENT when it was freed while its Lock
 * waited. */
int gmb__offload_try(struct gmb_broker *b, struct gmb_session *s,
                     uint64_t size, uint32_t flags, struct wire_reply *rep,
                     enum gmb_nomem_why *why);

/* Session s is ending: its host copies and records go. */
void gmb__offload_forget_session(struct gmb_broker *b, struct gmb_session *s);

/* The number of broken invariants (above). */
int gmb__offload_check(struct gmb_broker *b);

#endif /* GMB_OFFLOAD_H */
