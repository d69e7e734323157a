/*
 * observe.h - what the broker shows of itself: snapshots of every segment
 * and range (gmbctl map and snapshot), and metrics in Prometheus' text
 * format (gmbctl metrics and the HTTP endpoint).
 *
 * Counters are fed by the loop (one call per answered request); the
 * snapshot and the text are computed on demand from the broker's state.
 * Everything here runs on the loop thread except the HTTP endpoint's
 * server thread (http.c), which only ever reads a copy of the text that
 * gmb__observe_tick() publishes.
 */
#ifndef GMB_OBSERVE_H
#define GMB_OBSERVE_H

#include <stddef.h>
#include <stdint.h>

#include "broker.h"

struct gmb_observe;

struct gmb_observe *gmb__observe_new(void);
/* Stops the HTTP endpoint if one was started, frees.  Accepts NULL. */
void gmb__observe_destroy(struct gmb_observe *o);

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

/*
 * Starts the HTTP endpoint on b->cfg.metrics_listen ("HOST:PORT", HOST may
 * be "[v6]"); nothing when that is empty.  Call after the loop's sockets
 * are open (the server thread never sees a signal either way).  0, or
 * GMB_E_INVAL / GMB_E_SYSTEM with the reason in err.
 */
int gmb__observe_serve(struct gmb_broker *b, char *err, size_t errcap);

/*
 * Called by the loop every round: about once a second (and at the first
 * call) computes the metrics text and publishes it to the HTTP endpoint.
 * Does nothing without an endpoint.
 */
void gmb__observe_tick(struct gmb_broker *b, uint64_t now_ns);

#endif /* GMB_OBSERVE_H */
