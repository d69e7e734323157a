/*
 * broker.h - the broker's state, owned by its one event-loop thread.
 *
 * Everything the broker knows lives in one struct gmb_broker: the config,
 * the device, the pool, the tenants, the sessions and the requests waiting
 * for memory.  Only the loop thread touches it (the Redis model), so no
 * field needs a lock.  Modules: loop.c (sockets, poll, timers, signals),
 * session.c (connected clients), dispatch.c (client requests), admin.c
 * (admin requests), main.c (command line, start and stop).
 */
#ifndef GMB_BROKER_H
#define GMB_BROKER_H

#include <limits.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "config.h"
#include "device.h"
#include "pool.h"
#include "tenant.h"
#include "wire.h"

#define GMB_MAX_MSG_SIZE (64 * 1024) /* ZMQ_MAXMSGSIZE of both sockets */

struct gmb_session;
struct gmb_sessions;
struct gmb_waiter;

/* Who sent a message: its ZeroMQ routing id and SO_PEERCRED credentials. */
struct gmb_peer {
  const uint8_t *rid;
  size_t rid_len;
  uid_t uid;
  gid_t gid;
  pid_t pid; /* 0 when the peer's pid is not visible from here */
};

struct gmb_broker {
  struct gmb_config cfg;
  char config_path[PATH_MAX]; /* "" : none */
  char run_dir[PATH_MAX];
  char client_path[PATH_MAX]; /* the socket files */
  char admin_path[PATH_MAX];
  struct gmb_device *dev;
  struct gmb_pool *pool;
  struct gmb_tenants *tenants;
  struct gmb_sessions *sessions;
  struct gmb_waiter *wait_head, *wait_tail; /* alloc requests, in order */
  size_t n_waiting;
  void *zctx, *client_sock, *admin_sock;
  int sigfd;
  volatile int stopping;
  uint64_t next_session_id;
  uint64_t start_ns;
  int checks;  /* run the consistency checks after each request (tests) */
};

/* --- loop.c ---------------------------------------------------------- */
/* Binds the sockets under b->run_dir.  0 or a GMB_E_* code, with a reason
 * in err. */
int gmb__loop_open(struct gmb_broker *b, char *err, size_t errcap);
/* Runs until SIGTERM/SIGINT; returns 0 on a clean stop. */
int gmb__loop_run(struct gmb_broker *b);
/* Closes the sockets and removes their files. */
void gmb__loop_close(struct gmb_broker *b);
/* Sends a reply (or an event) to a client; never blocks: a peer that is
 * gone or not reading loses the message. */
void gmb__loop_send(struct gmb_broker *b, void *sock, const uint8_t *rid,
                    size_t rid_len, const struct wire_reply *rep);
/* The session table changed: rebuild the poll set before the next wait. */
void gmb__loop_sessions_changed(struct gmb_broker *b);

/* --- dispatch.c ------------------------------------------------------ */
/* Handles one decoded client request.  Returns 1 when *rep is to be sent
 * now, 0 when the reply was deferred (a waiting allocation) or is not due
 * (a heartbeat). */
int gmb__dispatch(struct gmb_broker *b, const struct gmb_peer *peer,
                  const struct wire_request *req, struct wire_reply *rep);
/* Memory was freed: serve waiting allocations that fit now. */
void gmb__dispatch_serve_waiters(struct gmb_broker *b);
/* Answers GMB_E_TIMEOUT to waiters past their deadline; returns the
 * nanoseconds until the next deadline (UINT64_MAX: none). */
uint64_t gmb__dispatch_expire_waiters(struct gmb_broker *b, uint64_t now);
/* Drops the waiters of a session that ended (no reply: it is gone). */
void gmb__dispatch_drop_waiters(struct gmb_broker *b, struct gmb_session *s);
/* The pool's retire callback: tells sessions that mapped the segment. */
void gmb__dispatch_retire(void *ctx, const struct gmb_dseg *seg,
                          void *arena_tag);

/* --- admin.c ---------------------------------------------------------- */
/* Handles one admin request; always fills *rep. */
void gmb__admin(struct gmb_broker *b, const struct gmb_peer *peer,
                const struct wire_request *req, struct wire_reply *rep);
/* 1 when uid may use the admin socket. */
int gmb__admin_allowed(const struct gmb_broker *b, uid_t uid);

/* Consistency checks of pool and tenants; returns violations. */
int gmb__broker_check(struct gmb_broker *b);

#endif /* GMB_BROKER_H */
