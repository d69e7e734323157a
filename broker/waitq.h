/*
 * waitq.h - allocations waiting for memory.
 *
 * The queue holds gmb_alloc_wait requests that found no room, ordered by
 * tenant priority (higher first; the priority when the request came), then
 * arrival.  Whenever memory may have come back (a free, a session's end, a
 * compaction, a smaller reservation, an expired or dead waiter) it is
 * served from the head:
 *   - a waiter that fits is served;
 *   - the first waiter that does not fit BLOCKS the waiters behind it, so a
 *     large request is never starved by a stream of smaller ones of equal
 *     or lower priority; higher priorities are ahead of it anyway;
 *   - except that a request within its own tenant's reservation is served
 *     even behind a blocked one: that memory is kept for its tenant, the
 *     blocked request could never have had it;
 *   - and that a waiter blocks the others for WAITQ_BLOCK_MS (1 s) after it
 *     came, no longer: then it keeps its place and is tried first whenever
 *     memory comes back, but the waiters behind it that fit are served.  A
 *     request that only an empty device could serve, waiting for ever,
 *     would otherwise make everyone behind it time out with the device
 *     nearly free.  The price: a large request may wait while smaller ones
 *     keep taking what is freed (it still gets the memory whenever enough
 *     is free at once when it is tried, first);
 *   - a waiter whose deadline comes is tried once more before it is
 *     answered GMB_E_TIMEOUT: held back by a younger blocker, it is served
 *     if it fits rather than refused with the room there.
 * A new waiting request joins the queue at its place (and the queue is
 * served) when a waiter of equal or higher priority is already there, so it
 * cannot jump the queue either.  Requests queued only until a compaction
 * run ends (`after_compact`: they did not ask to wait) never block others:
 * they are tried as memory comes back and answered GMB_E_NOMEM when the run
 * ends.  Requests held while caches are asked back (reclaim.c) are
 * served as memory comes back like the others; held ones that did not ask
 * to wait never block either, nor do ones held for their tenant's quota
 * (gmb__waitq_hold_quota), which are skipped while the quota still refuses
 * them and answered GMB_E_QUOTA when their hold ends without the bytes.
 * A held Vmm increase (alloc.h, GMB__ALLOC_VMM) is served or refused like
 * the others, through gmb__alloc_vmm, and answered when its hold ends.
 * Requests held for the broker's offload job (gmb__waitq_hold_job,
 * reclaim.h) are held requests too, whose hold the asks settling does not
 * end: the job lets them go (reclaim.c, at their job bound at the
 * latest).  The queue keeps the job's sums (broker.h) as they come and
 * go.  While there are any, the room they want is fenced for them
 * (alloc.h, gmb__alloc_fence): a waiter tried here that is not one of
 * them, of no higher priority than the first, finds no room in it, and a
 * waiter that goes (answered, expired, dropped with its session) gives
 * up its part of the fence, so the queue is served.
 * A waiter's answer leaves through the sender (reply.c) and is counted in
 * the metrics with its time in the queue.
 *
 * The queue itself is b->waitq (broker.h); every waiter belongs to a live
 * session and is counted in its tenant's `waiting`.
 */
#ifndef GMB_WAITQ_H
#define GMB_WAITQ_H

#include <stdint.h>

#include "broker.h"
#include "session.h"

/* Queues request `req_id` of session s.  timeout_ms <= 0: no deadline.
 * `after_compact`: answered (GMB_E_NOMEM if it still does not fit) when the
 * compaction run in progress ends.  0, GMB_E_LIMIT when the session or its
 * tenant has max_waiters_per_session / _per_tenant queued already, or
 * GMB_E_SYSTEM out of host memory. */
int gmb__waitq_add(struct gmb_broker *b, struct gmb_session *s,
                   uint64_t req_id, uint64_t size, uint32_t flags,
                   int timeout_ms, int after_compact);

/* Queues request `req_id` of session s held while other sessions' caches
 * are asked to give memory back (reclaim.c), until `until_ns` at most
 * (gmb__waitq_hold_over ends the hold).  timeout_ms 0: the request did not
 * ask to wait, and never holds back others while held; else it is an
 * ordinary waiter with its deadline.  0, GMB_E_LIMIT or GMB_E_SYSTEM as
 * gmb__waitq_add. */
int gmb__waitq_hold(struct gmb_broker *b, struct gmb_session *s,
                    uint64_t req_id, uint64_t size, uint32_t flags,
                    int timeout_ms, uint64_t until_ns);

/* As gmb__waitq_hold, for a request that passes its tenant's quota while
 * the tenant's other sessions are asked for the cached bytes it lacks:
 * it never holds back others while held (whatever timeout_ms), is served
 * as soon as its quota and the device allow, and is refused GMB_E_QUOTA
 * (counted once, then) if its hold ends and the quota still refuses it;
 * if the quota allows it then but the device has no room, it goes on as
 * a held request for room does.  A deadline (timeout_ms > 0) that comes
 * first while the quota refuses it answers GMB_E_QUOTA too.  0,
 * GMB_E_LIMIT or GMB_E_SYSTEM as gmb__waitq_add. */
int gmb__waitq_hold_quota(struct gmb_broker *b, struct gmb_session *s,
                          uint64_t req_id, uint64_t size, uint32_t flags,
                          int timeout_ms, uint64_t until_ns);

/* As gmb__waitq_hold, for a request whose room the broker's offload job
 * makes over the loop's turns (reclaim.h): served as memory comes back
 * like any held request, but its hold does not end when the asks settle,
 * only when the job lets it go (gmb__waitq_job_release: then it is an
 * ordinary hold, to until_ns), which reclaim.c does at job_until_ns at
 * the latest (gmb__waitq_job_due).  `asked`: the bytes the caches were
 * asked for it (the job counts them as on their way); `want`: the device
 * room it takes (the segment it needs; the job's sums add it up).  Each
 * request's job_until_ns is no earlier than the one held before it.  0,
 * GMB_E_LIMIT or GMB_E_SYSTEM as gmb__waitq_add. */
int gmb__waitq_hold_job(struct gmb_broker *b, struct gmb_session *s,
                        uint64_t req_id, uint64_t size, uint32_t flags,
                        int timeout_ms, uint64_t until_ns,
                        uint64_t job_until_ns, uint64_t asked,
                        uint64_t want);

/* A request held for the offload job, as its step and its let-go read it. */
struct gmb_waitq_job {
  struct gmb_waiter *w;
  struct gmb_session *s;
  uint64_t size;
  uint32_t flags;
  uint64_t asked; /* what the caches were asked for it */
};

/* The first request held for the job in the queue's order, in *out:
 * returns 0 when there is none.  O(1): the queue keeps it, with the
 * job's sums (broker.h: held_job, job_asked, job_want, job_tenants). */
int gmb__waitq_job_first(struct gmb_broker *b, struct gmb_waitq_job *out);

/* The oldest request held for the job when its job bound is past at
 * `now`, in *out; 0 when none is due.  O(1). */
int gmb__waitq_job_due(struct gmb_broker *b, uint64_t now,
                       struct gmb_waitq_job *out);

/* The offload job lets w go (NULL: every one it holds): its hold is an
 * ordinary one again, ending at its own bound (now at the earliest), or
 * at until_ns when later (the bound of asks made for w as it is let go;
 * 0: none).  O(log n) a request. */
void gmb__waitq_job_release(struct gmb_broker *b, struct gmb_waiter *w,
                            uint64_t now, uint64_t until_ns);

/* 1 when waiter w passes the room fenced for the offload job (alloc.h,
 * gmb__alloc_fence): it is one of the job's requests, or ahead of the
 * first of them in the queue's order.  O(1). */
int gmb__waitq_passes_fence(const struct gmb_broker *b,
                            const struct gmb_waiter *w);

/* w's ordinary hold lasts to until_ns at least (asks made for it). */
void gmb__waitq_hold_until(struct gmb_broker *b, struct gmb_waiter *w,
                           uint64_t until_ns);

/* Which holds gmb__waitq_hold_over ends. */
enum gmb_hold_end {
  GMB_HOLD_DUE = 0,     /* those whose time is up */
  GMB_HOLD_ALL = 1,     /* every one: no ask is in flight any more */
  GMB_HOLD_SETTLED = 2, /* those due, and quota holds whose tenant's other
                           sessions have no ask in flight any more */
};

/* How the queue asks for a compaction run for a waiter of `rounded` bytes
 * of tenant t (defrag.c is above the queue): returns the number of the run
 * that will have tried for it (b->compact_begun's count), 0 when none
 * could start. */
typedef uint64_t (*gmb_waitq_compact_fn)(void *ctx, uint64_t rounded,
                                         struct gmb_tenant *t);

/* Ends the holds that `how` names at `now`.  A held request for its quota
 * is tried first: served, or GMB_E_QUOTA; one the quota allows then goes
 * on as below.  A held request that did not ask to wait is tried
 * once more, then falls through as it would have without the hold: it
 * waits for a compaction run when compaction is on and it fits the
 * device's free total (compact(ctx, rounded) is called, and the caller
 * starts the run), else it is answered GMB_E_NOMEM with the explanation.
 * One that asked to wait stays queued (compact() called likewise).
 * Returns the nanoseconds until the next hold ends (UINT64_MAX: none). */
uint64_t gmb__waitq_hold_over(struct gmb_broker *b, uint64_t now,
                              enum gmb_hold_end how,
                              gmb_waitq_compact_fn compact, void *ctx);

/* 1 when a request that asked to wait (not one held only for a compaction
 * run or, without waiting, for cache asks, nor one held for its quota) of
 * priority >= `priority` is queued, and holds back those behind it.
 * O(log n). */
int gmb__waitq_ahead(struct gmb_broker *b, int priority);

/* A request just queued (gmb__waitq_add) behind others of equal or
 * higher priority: serves it if the rules allow now, without walking the
 * queue (and the whole queue if memory came back unnoticed). */
void gmb__waitq_joined(struct gmb_broker *b);

/* Memory may have come back: serve what fits, in order. */
void gmb__waitq_serve(struct gmb_broker *b);

/* The request just queued (gmb__waitq_add) is tried for by compaction run
 * number `run` (what gmb__defrag_request returned; 0: none). */
void gmb__waitq_compact_run(struct gmb_broker *b, uint64_t run);

/* Compaction run number `done` ended (UINT64_MAX: none could start).  A
 * waiter that joined it part-way (its run is later) and still does not
 * fit gets a run of its own: again(ctx, ...) starts it or widens the one
 * it just started, once per waiter (again NULL: none).  Then the waiters
 * that waited only for a run up to `done` are answered: served if they
 * fit now, else GMB_E_NOMEM with the explanation. */
void gmb__waitq_compaction_over(struct gmb_broker *b, uint64_t done,
                                gmb_waitq_compact_fn again, void *ctx);

/* Answers GMB_E_TIMEOUT to waiters past their deadline; returns the
 * nanoseconds until the next deadline (UINT64_MAX: none). */
uint64_t gmb__waitq_expire(struct gmb_broker *b, uint64_t now);

/* Drops the waiters of a session that is ending (no reply: it is gone). */
void gmb__waitq_drop_session(struct gmb_broker *b, struct gmb_session *s);

/* The number of broken invariants: the held counts, and the offload job's
 * sums (what was asked, the room wanted, the first request, the tenants'
 * counts and bytes, the list by arrival) against a recount from the
 * waiters.  O(waiters). */
int gmb__waitq_check(struct gmb_broker *b);

#endif /* GMB_WAITQ_H */
