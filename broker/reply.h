/*
 * reply.h - the sender: every reply and event leaves the broker here.
 *
 * Handlers fill a wire_reply and hand it over; services that answer later
 * (a waiting allocation, a compaction asked for by an operator) and the
 * events the broker pushes (segment retired, evicted, shutting down) go the
 * same way.  A send never blocks: the sockets use ZMQ_ROUTER_MANDATORY and
 * ZMQ_DONTWAIT, so a peer that is gone or not reading loses the message and
 * the loop goes on.  Nothing here calls back into the loop.
 */
#ifndef GMB_REPLY_H
#define GMB_REPLY_H

#include <stddef.h>
#include <stdint.h>

#include "broker.h"
#include "session.h"
#include "wire.h"

/* Sends `rep` to the peer with routing id `rid` on socket `sock` (or to
 * b->reply_tap when one is set).  Never blocks.  Nothing is sent once the
 * broker is closing (b->closing, set by gmb__core_close). */
void gmb__reply_send(struct gmb_broker *b, enum gmb_socket sock,
                     const uint8_t *rid, size_t rid_len,
                     const struct wire_reply *rep);

/* How many replies and events were handed to socket `sock` so far.  The
 * loop compares it around its wait: a send may make libzmq process that
 * socket's pending commands, taking the wake-up its descriptor would have
 * given (loop.c). */
uint64_t gmb__reply_sends(enum gmb_socket sock);

/* Sends `rep` to a session's client. */
void gmb__reply_to_session(struct gmb_broker *b, const struct gmb_session *s,
                           const struct wire_reply *rep);

/* Pushes an Event of `kind` to a session; `segment` for the kinds that name
 * one, `msg` (may be NULL) as its message. */
void gmb__reply_event(struct gmb_broker *b, const struct gmb_session *s,
                      enum wire_event kind, uint64_t segment,
                      const char *msg);

/* Makes *rep a refusal: `status`, no body, the formatted message.  Returns
 * 1, what a handler returns when the reply is to be sent now. */
int gmb__reply_fail(struct wire_reply *rep, int status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

#endif /* GMB_REPLY_H */
