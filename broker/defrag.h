/*
 * defrag.h - when the broker compacts, and how a run is driven (the
 * policy; compact.c is the engine that moves allocations).
 *
 * One run at a time, in b->compacting.  Admin requests to compact queue in
 * b->compact_reqs and are answered when the run they started (or joined)
 * ends.  Requests that wait for a run are in the wait queue (waitq.h).
 */
#ifndef GMB_DEFRAG_H
#define GMB_DEFRAG_H

#include <stddef.h>
#include <stdint.h>

#include "broker.h"
#include "session.h"

/* Starts a run (unless one is running) over `scope` (NULL: all);
 * `reason` is a GMB_DEFRAG_*. */
void gmb__defrag_start(struct gmb_broker *b, struct gmb_tenant *scope,
                       int reason);
/* A request of `rounded` bytes of tenant `t` (NULL: not known) found no
 * room: starts a run (or widens the one in progress) whose goal is the
 * device room a segment for it needs, or, for a small request, a free
 * range of its size in t's own segments; the run ends as soon as either
 * is there.  Returns the number of the run that will have tried for it
 * (for gmb__waitq_compact_run): this one when it began it, else the
 * next, which a request that joined part-way gets when this one ends and
 * it still does not fit; 0 when no run could start. */
uint64_t gmb__defrag_request(struct gmb_broker *b, uint64_t rounded,
                             struct gmb_tenant *t);
/* Works on the run in progress until `deadline_ns`; finishes it when it is
 * over (answers its admin requests and the allocations that waited for
 * it).  Returns 1 while a run is in progress. */
int gmb__defrag_tick(struct gmb_broker *b, uint64_t deadline_ns);
/* 1 when compaction has work: a run, or admin requests not yet started. */
int gmb__defrag_busy(const struct gmb_broker *b);
/* The background trigger, called about once a second. */
void gmb__defrag_timer(struct gmb_broker *b, uint64_t now);
/* An admin request to compact: answered when its run ends. */
void gmb__defrag_admin(struct gmb_broker *b, const struct gmb_peer *peer,
                       const struct wire_request *req);
/* Allocation `id` is about to be freed: stop moving it. */
void gmb__defrag_forget(struct gmb_broker *b, uint64_t id);
/* A session is about to end (its memory will be freed): no move of it may
 * be in flight. */
void gmb__defrag_forget_session(struct gmb_broker *b,
                                const struct gmb_session *s);
/* Revocation: some process that proved tenant t no longer does, and may
 * still map any of its segments.  Every segment t has now is sealed
 * (nothing new lands in it) and the loop's ticks move their live movable
 * bytes out (evacuate.h), trying again for locked ones for a few seconds;
 * pinned ones stay.  The end is logged with what it moved, what stays and
 * the time it took. */
void gmb__defrag_revoke(struct gmb_broker *b, struct gmb_tenant *t);
/* Ends a run at shutdown (its waiters get no answer: the sessions are
 * being told the broker stops). */
void gmb__defrag_shutdown(struct gmb_broker *b);

#endif /* GMB_DEFRAG_H */
