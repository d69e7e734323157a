/*
 * observe.h - what the broker shows of itself: the admin status (gmbctl
 * status), snapshots of every segment and range (gmbctl map and snapshot),
 * and metrics in Prometheus' text format (gmbctl metrics and the HTTP
 * endpoint, to which the loop publishes the text).
 *
 * Counters are fed by the loop and the wait queue (one call per answered
 * request); the status, the snapshot and the text are computed on demand
 * from the broker's state, on the loop thread.
 */
#ifndef GMB_OBSERVE_H
#define GMB_OBSERVE_H

#include <stddef.h>
#include <stdint.h>

#include "broker.h"

struct gmb_observe;

struct gmb_observe *gmb__observe_new(void);
void gmb__observe_destroy(struct gmb_observe *o); /* accepts NULL */

/* One client request answered: its kind, status and time in the broker
 * (receive to reply), for the latency histogram and refusal counters.
 * Accepts NULL. */
void gmb__observe_request(struct gmb_observe *o, enum wire_kind kind,
                          int status, uint64_t ns);

/* Counts a turn of the loop that worked `ns` (gmb_loop_turn_seconds);
 * returns the longest turn before it, in seconds. */
double gmb__observe_turn(struct gmb_observe *o, uint64_t ns);

/* Fills *rep (kind WIRE_ADMIN_STATUS): the device, the totals, one row
 * per tenant and one per session (by tenant, then id: every session, at
 * most max_sessions); on failure a status and a message. */
void gmb__observe_status(struct gmb_broker *b, struct wire_reply *rep);

/* One tenant's row of the status. */
void gmb__observe_tenant_row(struct gmb_tenant *t,
                             struct wire_tenant_row *row);

/* Ranges in one page of a snapshot when the request names no limit, and
 * the most one page holds whatever it asks (docs/snapshot.md). */
#define GMB_SNAPSHOT_PAGE_DEFAULT 4096u
#define GMB_SNAPSHOT_PAGE_MAX 32768u

/*
 * Fills *rep (kind WIRE_ADMIN_SNAPSHOT) with one page of the snapshot: up
 * to `limit` ranges (0: GMB_SNAPSHOT_PAGE_DEFAULT; above
 * GMB_SNAPSHOT_PAGE_MAX: that) in (segment id, offset) order, from the
 * cursor (segment, offset) on (pool.h, gmb__pool_walk_from); a segment
 * whose ranges do not all fit is split, the rest opening the next page.
 * The page names the next page's cursor (next_segment 0: none) and the
 * pool's change counter; the first page ((0, 0)) also the admin status,
 * taken at the same instant.  A cursor that no reply could have named (an
 * offset without a segment, off the 512-byte grid, past its segment's end,
 * or a segment id never issued) is refused with GMB_E_INVAL; on failure,
 * a status and a message.  What one call allocates is bounded by the
 * limit: a few hundred bytes a range, freed once the reply is sent.
 */
void gmb__observe_snapshot(struct gmb_broker *b, uint64_t segment,
                           uint64_t offset, uint32_t limit,
                           struct wire_reply *rep);

/* The metrics as Prometheus text (exposition format 0.0.4); a malloc'd
 * string the caller frees, or NULL when out of memory.  `tenants` 0
 * leaves out the per-tenant series (names, usage, sessions): what the
 * HTTP endpoint, which any local user may read, shows unless
 * metrics_tenants is set. */
char *gmb__observe_metrics(struct gmb_broker *b, int tenants);

#endif /* GMB_OBSERVE_H */
