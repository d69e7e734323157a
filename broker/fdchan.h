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
 * be taken back.  So what one party can leave unread is bounded.  A live
 * session's channel holds at most GMB_FDCHAN_UNREAD_ANSWERS descriptors
 * sent since it was last seen read to the end (SIOCOUTQ 0); past that its
 * requests are refused (GMB_E_LIMIT) and it lives.  A session that ends
 * with descriptors unread leaves its channel "unread": the broker keeps
 * its end open, weighed by the descriptors it may still hold, until the
 * peer reads them or closes its end (checked on the loop's timer,
 * GMB_FDCHAN_UNREAD_SWEEP channels a tick).  A Hello or AUTH of a tenant
 * or uid whose unread channels weigh GMB_FDCHAN_UNREAD_PER_TENANT or
 * GMB_FDCHAN_UNREAD_PER_UID is refused, and the list weighs at most
 * GMB_FDCHAN_UNREAD in all: past that, the oldest channel of the uid that
 * weighs most is closed (its descriptors stay in flight, untracked).
 * Under a low RLIMIT_NOFILE the three are lowered with it (fdchan_open).
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
/* Ended sessions' channels, weighed in descriptors (each weighs at least
 * 1, and holds one of the broker's descriptors): in all at most this, and
 * at most a 32nd of the broker's RLIMIT_NOFILE (the shipped units'
 * 1,048,576 leave the 1,024 the bound); one uid a quarter of that,
 * one tenant an eighth and at most one live channel's worth. */
#define GMB_FDCHAN_UNREAD 1024
#define GMB_FDCHAN_UNREAD_PER_UID 256
#define GMB_FDCHAN_UNREAD_PER_TENANT 64
#define GMB_FDCHAN_UNREAD_SWEEP 64   /* channels checked per tick */
#define GMB_FDCHAN_UNREAD_TICK_MS 100

struct gmb_fdchan;

/* Takes the listening socket (SOCK_SEQPACKET, non-blocking, bound and
 * listening; the loop made it) into b->fdchan, and sets b->fdconn_gone:
 * a session that ends with descriptors unread leaves its channel to the
 * unread list.  0 or GMB_E_SYSTEM. */
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

/* 0 when uid `uid` and tenant `tenant` may open a session (Hello) or its
 * channel (AUTH); else GMB_E_LIMIT with the reason in why. */
int gmb__fdchan_unread_admit(const struct gmb_broker *b, uid_t uid,
                             const char *tenant, char *why, size_t cap);
/* The unread channels now and the descriptors they may hold; the bounds
 * in force (descriptors: in all, per uid, per tenant).  For tests and
 * logs. */
void gmb__fdchan_unread_stats(const struct gmb_broker *b, size_t *channels,
                              uint64_t *descriptors, uint64_t *evicted);
void gmb__fdchan_unread_bounds(const struct gmb_broker *b, uint32_t *all,
                               uint32_t *per_uid, uint32_t *per_tenant);

#endif /* GMB_FDCHAN_H */
