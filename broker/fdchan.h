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
 *
 * Descriptors the broker sent that nobody received yet count against the
 * broker's user, and past its RLIMIT_NOFILE the kernel refuses every
 * further one (ETOOMANYREFS), for every tenant; a sent descriptor cannot
 * be taken back.  So what one party can leave unread is bounded, counted
 * as each descriptor is sent.  A channel "holds" the descriptors sent on
 * it since it was last seen read to the end (SIOCOUTQ 0 on the broker's
 * end), an upper bound of those its peer has not received.  A live
 * session's channel holds at most GMB_FDCHAN_UNREAD_ANSWERS; all the
 * channels of one uid together at most GMB_FDCHAN_UNREAD_PER_UID, of one
 * tenant GMB_FDCHAN_UNREAD_PER_TENANT (lowered under a low RLIMIT_NOFILE,
 * fdchan_open).  A send past a bound is refused (GMB_E_LIMIT, with the
 * reason) and the session lives; before it refuses, the broker looks
 * again at a bounded number of that uid's or tenant's channels
 * (GMB_FDCHAN_UNREAD_LOOK), forgetting those read since.  A session that
 * ends with descriptors unread leaves its channel "kept": the broker
 * keeps its end open, still counted against its uid and tenant, until
 * the peer reads it or closes its end (the loop's timer looks at
 * GMB_FDCHAN_UNREAD_SWEEP channels a tick).  A kept channel also holds a
 * session's place (max_sessions, max_sessions_per_uid): none is ever
 * closed to make room, so what it holds never leaves the count.  A Hello
 * of a uid or tenant at a bound, or whose sessions and kept channels
 * fill its places, is refused (gmb__fdchan_unread_admit).
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
/* Descriptors left unread (see above).  A live channel: libgmb asks for
 * up to 64 segments before it reads the first answer (GMB_FDCLIENT_BATCH,
 * its pages' batch), so fewer would refuse a well-behaved client. */
#define GMB_FDCHAN_UNREAD_ANSWERS 64
/* All the channels of one tenant, live and kept: eight sessions each in
 * the middle of a full batch at the same moment (the library never asks
 * for more before it reads, and a session that read its answers holds
 * none).  One uid: four tenants at their bound (root containers, each a
 * tenant, share uid 0).  Under a low RLIMIT_NOFILE a uid gets at most a
 * 16th of it, and a tenant half of that, never less than one live
 * channel's worth.  So one uid holds at most 2,048 of the broker's
 * descriptors in flight, and at most a 16th of its limit: 2% of an
 * H200's budget (about 89,000), 0.2% of the shipped units' 1,048,576. */
#define GMB_FDCHAN_UNREAD_PER_TENANT 512
#define GMB_FDCHAN_UNREAD_PER_UID 2048
#define GMB_FDCHAN_UNREAD_NOFILE_SHARE 16 /* a uid's share of the limit */
#define GMB_FDCHAN_UNREAD_LOOK 16    /* channels looked at before a refusal */
#define GMB_FDCHAN_UNREAD_SWEEP 64   /* channels checked per tick */
#define GMB_FDCHAN_UNREAD_TICK_MS 100

struct gmb_fdchan;

/* Takes the listening socket (SOCK_SEQPACKET, non-blocking, bound and
 * listening; the loop made it) into b->fdchan, and sets b->fdconn_gone:
 * a session that ends with descriptors unread leaves its channel kept.
 * 0 or GMB_E_SYSTEM. */
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
/* Closes pending connections past their deadline, and unread channels
 * that were read or whose peer is gone (a bounded number a tick); returns
 * the nanoseconds to the next deadline or tick (UINT64_MAX: none). */
uint64_t gmb__fdchan_expire(struct gmb_broker *b, uint64_t now);

/* 0 when uid `uid` may open a session of tenant t (Hello): neither is
 * at its bound of descriptors unread, and the uid's sessions and kept
 * channels, and all of them, leave a session's place; else GMB_E_LIMIT
 * with the reason in why.  May close kept channels found read. */
int gmb__fdchan_unread_admit(struct gmb_broker *b, uid_t uid,
                             struct gmb_tenant *t, char *why, size_t cap);
/* The bounds in force: descriptors unread per uid and per tenant. */
void gmb__fdchan_unread_bounds(const struct gmb_broker *b, uint32_t *per_uid,
                               uint32_t *per_tenant);
/* Descriptors uid `uid`'s channels hold unread, and (kept, when not NULL)
 * how many of its channels are kept for ended sessions.  The broker's
 * totals are b->fd_unread and b->fd_kept, a tenant's t->fd_unread and
 * t->fd_kept. */
uint64_t gmb__fdchan_unread_of_uid(const struct gmb_broker *b, uid_t uid,
                                   uint32_t *kept);
/* Checks the channels' records against every sum they make (the
 * broker's, each uid's and tenant's, each session's fd_sent); returns the
 * number of violations, each logged.  The loop runs it after each
 * request and each channel's messages under GMB_BROKER_CHECKS. */
int gmb__fdchan_check(struct gmb_broker *b);

#endif /* GMB_FDCHAN_H */
