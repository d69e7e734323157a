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
struct gmb_compact;
struct gmb_defrag_req;
struct gmb_observe;

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
  int flag_log_level; /* --log-level, or -1: the config's applies */

  /* Compaction (defrag.c): the run in progress, what asked for it, and
   * the totals since start. */
  struct gmb_compact *compacting;
  struct gmb_tenant *compact_scope;   /* NULL: every tenant */
  int compact_reason;                 /* GMB_DEFRAG_* */
  struct gmb_defrag_req *compact_reqs; /* admin requests, in order */
  size_t n_after_compact;             /* waiters answered when it ends */
  struct wire_compact_stats compact_totals;
  uint64_t frag_high_since_ns;        /* background trigger: 0 = below */
  uint64_t pool_ops;                  /* allocs + frees, to see change */
  uint64_t pool_ops_at_last_run;

  struct gmb_observe *observe;        /* counters for metrics (observe.c) */
};

enum {
  GMB_DEFRAG_NONE = 0,
  GMB_DEFRAG_REQUEST,    /* a request fits the free total, not a range */
  GMB_DEFRAG_ADMIN,      /* gmbctl compact */
  GMB_DEFRAG_BACKGROUND, /* fragmentation stayed above the threshold */
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
/* Queues an allocation that failed for want of room; `after_compact`: it
 * is answered GMB_E_NOMEM when the compaction run in progress ends, if it
 * still does not fit then. */
int gmb__dispatch_queue(struct gmb_broker *b, struct gmb_session *s,
                        uint64_t req_id, uint64_t size, uint32_t flags,
                        int timeout_ms, int after_compact);
/* The compaction run ended: answer the waiters that waited only for it. */
void gmb__dispatch_compaction_over(struct gmb_broker *b);
/* Answers GMB_E_TIMEOUT to waiters past their deadline; returns the
 * nanoseconds until the next deadline (UINT64_MAX: none). */
uint64_t gmb__dispatch_expire_waiters(struct gmb_broker *b, uint64_t now);
/* Drops the waiters of a session that ended (no reply: it is gone). */
void gmb__dispatch_drop_waiters(struct gmb_broker *b, struct gmb_session *s);
/* The pool's retire callback: tells sessions that mapped the segment. */
void gmb__dispatch_retire(void *ctx, const struct gmb_dseg *seg,
                          void *arena_tag);

/* --- admin.c ---------------------------------------------------------- */
/* Handles one admin request.  Returns 1 when *rep is to be sent now, 0
 * when the answer comes later (a compaction). */
int gmb__admin(struct gmb_broker *b, const struct gmb_peer *peer,
               const struct wire_request *req, struct wire_reply *rep);
/* Reads the config file again (SIGHUP, gmbctl reload): 0, or an error
 * with the reason in err, in which case the running config is kept. */
int gmb__admin_reload(struct gmb_broker *b, char *err, size_t errcap);
/* 1 when uid may use the admin socket. */
int gmb__admin_allowed(const struct gmb_broker *b, uid_t uid);

/* --- defrag.c --------------------------------------------------------- */
/* Starts a run (unless one is running) over `scope` (NULL: all). */
void gmb__defrag_start(struct gmb_broker *b, struct gmb_tenant *scope,
                       int reason);
/* Works on the run in progress until `deadline_ns`; finishes it when it is
 * over (answers its admin requests and the allocations that waited for
 * it).  Returns 1 while a run is in progress. */
int gmb__defrag_tick(struct gmb_broker *b, uint64_t deadline_ns);
/* The background trigger, called about once a second. */
void gmb__defrag_timer(struct gmb_broker *b, uint64_t now);
/* An admin request to compact: answered when its run ends. */
void gmb__defrag_admin(struct gmb_broker *b, const struct gmb_peer *peer,
                       const struct wire_request *req);
/* Allocation `id` is about to be freed: stop moving it. */
void gmb__defrag_forget(struct gmb_broker *b, uint64_t id);
/* A session is about to end (its memory will be freed): no move of it may
 * be in flight. */
void gmb__defrag_forget_session(struct gmb_broker *b, struct gmb_session *s);
/* Device fragmentation: 1 - largest free / free total. */
double gmb__defrag_device_fragmentation(struct gmb_broker *b,
                                        uint64_t *largest_free,
                                        uint64_t *free_total);
/* Ends a run at shutdown (its waiters get no answer: the sessions are
 * being told the broker stops). */
void gmb__defrag_shutdown(struct gmb_broker *b);

/* Consistency checks of pool and tenants; returns violations. */
int gmb__broker_check(struct gmb_broker *b);

#endif /* GMB_BROKER_H */
