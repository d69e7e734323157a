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

/* Fills *rep (kind WIRE_ADMIN_STATUS): the device, the totals, one row
 * per tenant and one per session (by tenant, then id: every session, at
 * most max_sessions); on failure a status and a message. */
void gmb__observe_status(struct gmb_broker *b, struct wire_reply *rep);

/* One tenant's row of the status. */
void gmb__observe_tenant_row(struct gmb_tenant *t,
                             struct wire_tenant_row *row);

/* Fills *rep (kind WIRE_ADMIN_SNAPSHOT): the admin status and every
 * segment with its ranges in address order.  On failure, a status and a
 * message. */
void gmb__observe_snapshot(struct gmb_broker *b, struct wire_reply *rep);

/* The metrics as Prometheus text (exposition format 0.0.4); a malloc'd
 * string the caller frees, or NULL when out of memory. */
char *gmb__observe_metrics(struct gmb_broker *b);

#endif /* GMB_OBSERVE_H */
