/*
 * reclaim.h - asking the clients' caches for memory back.
 *
 * Every session reports the free bytes of its cache (Request.cached_free,
 * on whatever it sends).  When memory is short the broker asks sessions to
 * give some back: the event EVENT_TRIM with a number of bytes, which the
 * client's library thread answers without the application calling in, by
 * freeing wholly free slabs (ordinary Free requests) and then a Heartbeat
 * with `trim_answered` set.
 *
 *   - The device is full (a request found no room): the sessions of every
 *     tenant, the requester's other sessions included, are candidates,
 *     lowest tenant priority first, then the largest cache.  Another
 *     tenant is never asked below its reservation (its used minus what it
 *     was asked stays >= its reserve).  The request is held in the wait
 *     queue (waitq.h) and served as the memory comes back; when every ask
 *     was answered, or b->cfg.trim_wait_ms passed, it falls through to
 *     what it would have met without the asks (a compaction run, the
 *     queue, or GMB_E_NOMEM).  Nothing is asked, and nothing held, unless
 *     the candidates can cover what is missing.
 *   - A quota is held by the tenant's other sessions' caches (the request
 *     would pass the tenant's quota, and the cached bytes its other
 *     sessions report, with those asked already and not answered yet,
 *     cover what it lacks): they are asked, in the order of the tenant's
 *     list, for what is missing, and the request is held the same way
 *     (gmb__waitq_hold_quota), whatever its timeout_ms, and served as the
 *     bytes come back (the quota stays exact at every moment: it is
 *     served only when it fits).  Its hold ends when the asks it waits
 *     for were all answered, ran out, or ended with their sessions, or
 *     after trim_wait_ms at most; it is then refused GMB_E_QUOTA if the
 *     bytes did not come.  When they cannot cover it (the bytes are in
 *     use, not cached), nothing is asked and the refusal is immediate, as
 *     it is for a request larger than the quota or the device.  Held
 *     requests for a quota never hold back other waiters.
 *
 * A Vmm increase (dispatch.c: cuMemCreate under the preload shim; flag
 * GMB__ALLOC_VMM, `size` its bytes, never rounded) goes through both
 * holds the same way, never asking to wait: its room is the device's
 * (capacity less what is in use), not a pool segment's; when its hold
 * ends it is answered, served or refused, never queued on.  A tenant's
 * VMM bytes count as held when a quota's missing bytes are reckoned.
 *
 * Bounds a client cannot lift: at most one ask in flight per session (a
 * session asked already is not asked again until it answered or its ask
 * ran out); an ask runs out after trim_wait_ms, and the session is then
 * counted (trim_ignored) and logged, and not asked again for a pause that
 * doubles with each ask it leaves unanswered in a row (1 s to 60 s); an
 * answer that gave nothing back counts the same, except that the first in
 * a row pauses nothing (a report can be one request old: a page reported
 * idle may have served the session's own next block since); a
 * session that has requests in the wait queue is not asked (its library
 * is blocked in that very call and could not answer); held requests count
 * against max_waiters_per_session/_per_tenant like any waiter (a request
 * that cannot be held is not held, and nothing is asked for it); a session
 * that ends with an ask in flight closes it, so that what waited for it is
 * served from its freed memory, or falls through, at once.
 *
 * The state is b->reclaim (broker.h), the sessions' ask_* fields
 * (session.h) and each tenant's cache_asked (tenant.h): cache_asked is
 * the sum of its sessions' ask_bytes, b->reclaim.asks and .ask_bytes the
 * count and sum over all sessions, b->reclaim.caching the number of
 * sessions whose cached_free is not 0.
 */
#ifndef GMB_RECLAIM_H
#define GMB_RECLAIM_H

#include <stdint.h>

#include "broker.h"
#include "session.h"

/* A request of session s arrived carrying `cached_free` and, when
 * `answered`, the answer to the last ask.  Records the figure; closes the
 * ask in flight when answered.  Returns 1 when an ask was closed: the
 * caller calls gmb__reclaim_settle once it handled the request. */
int gmb__reclaim_heard(struct gmb_broker *b, struct gmb_session *s,
                       uint64_t cached_free, int answered);

/* When no ask is in flight any more, the held requests fall through now
 * rather than at the end of their bound; so does a request held for its
 * quota when its tenant's other sessions have no ask in flight any more. */
void gmb__reclaim_settle(struct gmb_broker *b);

/* Session s's request `req_id` of `size` bytes found no room on the
 * device (GMB_NOMEM_NO_ROOM).  Asks other sessions' caches for what is
 * missing and holds the request (gmb__waitq_hold) for trim_wait_ms at
 * most.  When the caches cannot cover it, the broker first offloads idle
 * sessions' movable allocations itself (offload.h: a slice now; when more
 * is needed and candidates are left, the request is held for the offload
 * job instead, below, which makes the rest a slice a loop turn; a request
 * that comes while a job runs joins it), then asks idle sessions to
 * sleep.  Returns 1 when it is held (answered later), 2 when
 * the offloads made all the room it lacked (the caller tries it again
 * now), 0 when nothing was asked or it could not be held: the caller goes
 * on as without.  `ahead`
 * (a cache's pages: Alloc.ahead, else 0): bytes the same miss asks for
 * next; as much more is asked for now where the caches have it (clipped
 * to the device and to what the tenant's quota leaves beside what it
 * holds), but the hold waits only for what
 * this request lacks.  Both holds below take it so. */
int gmb__reclaim_hold(struct gmb_broker *b, struct gmb_session *s,
                      uint64_t req_id, uint64_t size, uint32_t flags,
                      int timeout_ms, uint64_t ahead);

/* One slice of the broker's offload job (reclaim.c has how it runs):
 * for the requests held for it (gmb__waitq_hold_job), offloads up to
 * GMB_OFFLOAD_SLICE of idle sessions' movable allocations, serves the
 * queue, and lets go the requests it can do nothing more for (the
 * sessions that opted in are asked to pause tags for them, as without
 * the job, or they fall through).  The loop runs it through
 * gmb__reclaim_slice while b->waitq.held_job is not 0.  Returns 1 while
 * the job goes on. */
int gmb__reclaim_offload_step(struct gmb_broker *b);

/* One slice of an operator's pause still running (gmb__offload_pause_step),
 * then the queue is served when it made room.  Returns 1 while a pause
 * goes on. */
int gmb__reclaim_pause_step(struct gmb_broker *b);

/* The turn's offload slice: the job's (gmb__reclaim_offload_step) or an
 * operator's pause's (gmb__reclaim_pause_step).  When both have work they
 * take turns, the job's first (b->offload.job_last), so that neither
 * waits for the other to end.  The loop calls it once a turn, in a turn
 * that ran no other slice (a request's own first slice), while
 * b->waitq.held_job or b->offload.pausing is not 0.  Returns 1 while
 * either goes on. */
int gmb__reclaim_slice(struct gmb_broker *b);

/* Session s's request `req_id` of `size` bytes: when it would pass its
 * tenant's quota and the tenant's other sessions' caches can cover what
 * it lacks, asks them and holds the request (gmb__waitq_hold_quota) for
 * trim_wait_ms at most.  Returns 1 when it is held (answered later), 0
 * otherwise (the quota allows it, or no cache can help, or it could not be
 * held): the caller goes on as without, and a refusal stays immediate.
 * O(1) when the quota allows it; else O(the tenant's sessions). */
int gmb__reclaim_quota_hold(struct gmb_broker *b, struct gmb_session *s,
                            uint64_t req_id, uint64_t size, uint32_t flags,
                            int timeout_ms, uint64_t ahead);

/* The loop's timer: asks that ran out (counted in their session's
 * trim_ignored unless its cached_free went down meanwhile, and logged),
 * and held requests whose hold ended.  Returns the nanoseconds until the
 * next of either (UINT64_MAX: none). */
uint64_t gmb__reclaim_expire(struct gmb_broker *b, uint64_t now);

/* Session s is ending: its ask in flight and its cached bytes are
 * forgotten (not counted as ignored: its memory comes back anyway).  Call
 * gmb__reclaim_settle once its memory was freed. */
void gmb__reclaim_forget_session(struct gmb_broker *b, struct gmb_session *s);

/* The number of broken invariants: the asks' count and bytes, each
 * tenant's cache_asked and the count of caching sessions against a
 * recount from the sessions, and an ask without a deadline. */
int gmb__reclaim_check(struct gmb_broker *b);

#endif /* GMB_RECLAIM_H */
