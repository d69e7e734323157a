/*
 * alloc.h - giving a session memory: the one path every allocation takes,
 * whether it is answered at once (dispatch.c) or after waiting (waitq.c).
 *
 * The order is: quota (refused, never waited on: a request is held for
 * its quota only while its tenant's own caches are asked for the bytes,
 * reclaim.h), then the pool, then the reservations.  The quota is asked
 * before the pool and charged once the pool said yes; the loop is
 * single-threaded, so nothing can come between the two, and `used` and
 * `peak` count only memory handed out.
 *
 * Reservations (tenant.h has the rule): an allocation that made its
 * tenant's segments grow is checked once the pool said yes, and rolled
 * back (GMB_E_NOMEM, naming the reservation) when it would leave the
 * device unable to give another tenant the unused part of its
 * reservation.  Checking after the pool is exact (the pool decides whether
 * a segment is made and how large); the rollback releases the segment.
 *
 * A movable allocation gets a slot in its session's lock table, whose
 * number the pool keeps as the allocation's tag (locktab.h).
 */
#ifndef GMB_ALLOC_H
#define GMB_ALLOC_H

#include <stdint.h>

#include "broker.h"
#include "session.h"
#include "wire.h"

/* Why an allocation was refused GMB_E_NOMEM. */
enum gmb_nomem_why {
  GMB_NOMEM_NONE = 0,
  GMB_NOMEM_NO_ROOM,  /* the device has no room (rep's message unset) */
  GMB_NOMEM_RESERVED, /* another tenant's reservation (message set) */
};

/* Internal allocation flag: the request is Alloc.pages pages for a
 * client's cache (size = pages * GMB_SEGMENT_ALIGN), each a pinned
 * allocation in a segment of its own, made or refused together.  Never on
 * the wire (dispatch.c sets it from Alloc.pages). */
#define GMB__ALLOC_PAGES 0x10000u

/* Internal flag of a request held in the wait queue: it is `size` more
 * bytes of VMM memory for its session (a Vmm increase, gmb__alloc_vmm),
 * not an allocation.  Never on the wire. */
#define GMB__ALLOC_VMM 0x20000u

/* Internal flag of a request held in the wait queue: a Lock request that
 * brings back its session's offloaded allocation s->restore_id (`size`
 * its bytes; offload.c), not an allocation.  Never on the wire. */
#define GMB__ALLOC_RESTORE 0x40000u

/* Internal flag of a GMB__ALLOC_RESTORE request tried from the wait queue
 * (waitq.c): it is one of the queue's waiters itself, which the batch of
 * a restore (offload.c) must not count as someone else waiting for
 * memory.  Never on the wire, never past gmb__offload_try. */
#define GMB__ALLOC_QUEUED 0x100000u

/* Internal flag of gmb__alloc_try: no lock-table slot for the movable
 * allocation (a restore keeps its slot).  Never on the wire. */
#define GMB__ALLOC_NOSLOT 0x80000u

/* `size` as the pool and the quota count it. */
uint64_t gmb__alloc_round(uint64_t size);

/* 0 when `rounded` more bytes fit t's quota, else GMB_E_QUOTA with *rep
 * filled. */
int gmb__alloc_quota(struct gmb_tenant *t, uint64_t rounded,
                     struct wire_reply *rep);

/* Session s's request is refused GMB_E_QUOTA in *rep: when the tenant's
 * other sessions were asked to give cached memory back (EVENT_TRIM,
 * reclaim.c) and have not answered yet, says how many bytes are on their
 * way in Reply.asked_back and in the text (the caller may try again
 * shortly).  The answer to one request held for them says so at its end. */
void gmb__alloc_asked_back(const struct gmb_session *s,
                           struct wire_reply *rep);

/* The device room fenced for the broker's offload job against session
 * s's request (0: none): while the job holds requests (reclaim.c), the
 * room they still want (each the segment it needs, with what the other
 * tenants' reservations keep beside them, less what the caches were asked
 * for them) is theirs: a request that is not one of them may make a new
 * segment only in the room beyond it, unless its priority is higher than
 * the job's first request's.  A waiter being tried from the queue
 * (b->waitq.trying) passes when it is the job's, or ahead of the job's
 * first in the queue's order (it is served first anyway).  O(1). */
uint64_t gmb__alloc_fence(const struct gmb_broker *b,
                          const struct gmb_session *s);

/*
 * Tries to allocate `size` bytes with `flags` for session s.  Returns 0 with
 * *rep the Alloc reply, or the refusal in *rep.  GMB_E_NOMEM comes with *why:
 * GMB_NOMEM_NO_ROOM leaves *rep's message alone so the caller may queue the
 * request or explain with gmb__alloc_explain(); GMB_NOMEM_RESERVED has the
 * message set.  A new segment that would eat into the room fenced for the
 * offload job (gmb__alloc_fence) is refused GMB_NOMEM_NO_ROOM, counted in
 * b->waitq.fenced.
 */
int gmb__alloc_try(struct gmb_broker *b, struct gmb_session *s, uint64_t size,
                   uint32_t flags, struct wire_reply *rep,
                   enum gmb_nomem_why *why);

/*
 * Charges `more` bytes of VMM memory (cuMemCreate under the preload shim)
 * to session s: its tenant's quota and uid budget, the device's room and
 * the other tenants' reservations, in that order, as an allocation of the
 * difference would be.  Returns 0 with s->vmm grown and *rep the tenant's
 * figures (gmb__alloc_stats), or the refusal in *rep, message set, with
 * nothing changed: GMB_E_QUOTA, or GMB_E_NOMEM with *why (NO_ROOM: the
 * device's room; RESERVED: another tenant's reservation).
 */
int gmb__alloc_vmm(struct gmb_broker *b, struct gmb_session *s, uint64_t more,
                   struct wire_reply *rep, enum gmb_nomem_why *why);

/* Fills *rep with the StatsReply of session s's tenant and the device. */
void gmb__alloc_stats(struct gmb_broker *b, const struct gmb_session *s,
                      struct wire_reply *rep);

/* Fills *rep with GMB_E_NOMEM and the broker's explanation for a request
 * of `rounded` bytes: free total, largest range, what cannot be moved and
 * which tenants hold it.  The last two take a walk of the whole pool: at
 * most GMB_EXPLAIN_WALKS a second (broker.h), past which a refusal gets
 * the last walk's figures and their age. */
void gmb__alloc_explain(struct gmb_broker *b, const struct gmb_session *s,
                        uint64_t rounded, struct wire_reply *rep);

#endif /* GMB_ALLOC_H */
