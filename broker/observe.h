/*
 * observe.h - what the broker shows of itself: snapshots of every segment
 * and range (gmbctl map and snapshot), and metrics in Prometheus' text
 * format (gmbctl metrics and the HTTP endpoint).
 *
 * Counters are fed by the loop (one call per answered request); the
 * snapshot and the text are computed on demand from the broker's state.
 */
#ifndef GMB_OBSERVE_H
#define GMB_OBSERVE_H

#include <stdint.h>

#include "broker.h"

struct gmb_observe;

struct gmb_observe *gmb__observe_new(void);
void gmb__observe_destroy(struct gmb_observe *o); /* accepts NULL */

/* One client request answered: its kind, status and time in the broker
 * (receive to reply), for the latency histogram and refusal counters. */
void gmb__observe_request(struct gmb_broker *b, enum wire_kind kind,
                          int status, uint64_t ns);

/* Fills *rep (kind WIRE_ADMIN_SNAPSHOT): the admin status and every
 * segment with its ranges in address order.  On failure, a status and a
 * message. */
void gmb__observe_snapshot(struct gmb_broker *b, struct wire_reply *rep);

/* The metrics as Prometheus text (exposition format 0.0.4); a malloc'd
 * string the caller frees, or NULL when out of memory. */
char *gmb__observe_metrics(struct gmb_broker *b);

#endif /* GMB_OBSERVE_H */
