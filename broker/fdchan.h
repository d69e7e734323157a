/*
 * fdchan.h - the descriptor channel's handler: fd.sock, where sessions get
 * the descriptors of their lock table and of their tenant's segments
 * (the messages are in proto/fdpass.h).
 *
 * The loop owns the listening socket and polls it, every connection that
 * has not proved a session yet ("pending") and every session's connection;
 * this module accepts, authenticates and answers.  Every resource a peer
 * can make it hold is bounded: at most GMB_FDCHAN_PENDING connections wait
 * to authenticate, at most GMB_FDCHAN_PENDING_PER_UID of one uid (so that
 * one local user cannot take every place and keep every other client
 * out), each for at most GMB_FDCHAN_AUTH_MS; a session has one
 * connection; at most GMB_FDCHAN_BATCH messages of one connection are read
 * per round; a reply that cannot be sent at once (the peer does not read)
 * ends the session rather than wait.  A session's connection closing means
 * its process is gone, in whatever PID namespace it runs: the session ends.
 */
#ifndef GMB_FDCHAN_H
#define GMB_FDCHAN_H

#include <stdint.h>

#include "broker.h"
#include "session.h"

#define GMB_FDCHAN_PENDING 256  /* connections not yet authenticated */
#define GMB_FDCHAN_PENDING_PER_UID 16 /* of them, one uid's (root: no cap) */
#define GMB_FDCHAN_AUTH_MS 2000 /* how long one may take to authenticate */
#define GMB_FDCHAN_BATCH 16     /* messages read per connection per round */

struct gmb_fdchan;

/* Takes the listening socket (SOCK_SEQPACKET, non-blocking, bound and
 * listening; the loop made it) into b->fdchan.  0 or GMB_E_SYSTEM. */
int gmb__fdchan_open(struct gmb_broker *b, int listen_fd);
/* Closes the listener and the pending connections (sessions close their
 * own).  Accepts a broker without a channel. */
void gmb__fdchan_close(struct gmb_broker *b);

/* The listening socket (-1: none), and a number that changes whenever the
 * set of pending connections does (the loop rebuilds its poll set). */
int gmb__fdchan_listener(const struct gmb_broker *b);
uint64_t gmb__fdchan_gen(const struct gmb_broker *b);

/* Visits each pending connection: its descriptor and an opaque handle for
 * gmb__fdchan_pending_ready. */
void gmb__fdchan_each_pending(struct gmb_broker *b,
                             void (*fn)(void *ctx, int fd, void *conn),
                             void *ctx);

/* The listener is readable: accepts what waits (bounded). */
void gmb__fdchan_accept(struct gmb_broker *b, uint64_t now);
/* A pending connection is readable: its AUTH, or its end. */
void gmb__fdchan_pending_ready(struct gmb_broker *b, void *conn);
/* Session s's connection is readable or hung up: its requests, or the end
 * of the session. */
void gmb__fdchan_session_ready(struct gmb_broker *b, struct gmb_session *s);
/* Closes pending connections past their deadline; returns the nanoseconds
 * to the next deadline (UINT64_MAX: none). */
uint64_t gmb__fdchan_expire(struct gmb_broker *b, uint64_t now);

#endif /* GMB_FDCHAN_H */
