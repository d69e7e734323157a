/*
 * broker.h - the broker's state, owned by its one event-loop thread.
 *
 * Everything the broker knows hangs off one struct gmb_broker: the config,
 * the device, the pool, the tenants, the sessions, the requests waiting
 * for memory and the compaction in progress.  Only the loop thread touches
 * it (the Redis model), so no field needs a lock.  This header only
 * declares the state; what acts on it lives in the modules of each layer
 * (docs/architecture.md): core.c starts, stops and ends sessions, loop.c
 * owns the sockets, the handlers answer requests, the services (waitq,
 * defrag, alloc, observe) act for them.
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
struct gmb_loop;
struct gmb_statefile;
struct gmb_fdchan;

/* Who sent a message: its ZeroMQ routing id and SO_PEERCRED credentials. */
struct gmb_peer {
  const uint8_t *rid;
  size_t rid_len;
  uid_t uid;
  gid_t gid;
  pid_t pid; /* 0 when the peer's pid is not visible from here */
};

/* The waiters with a deadline, by deadline (a red-black tree of
 * sys/tree.h, whose functions waitq.c generates for this head). */
struct gmb_waiter_tree {
  struct gmb_waiter *rbh_root;
};

/* The waiters that block now, in serving order (likewise). */
struct gmb_waiter_order {
  struct gmb_waiter *rbh_root;
};

/* The waiters held while caches are asked back, in serving order
 * (likewise, with links of their own). */
struct gmb_waiter_holds {
  struct gmb_waiter *rbh_root;
};

/* The waiters held for the broker's offload job, in serving order
 * (likewise, with links of their own). */
struct gmb_waiter_jobs {
  struct gmb_waiter *rbh_root;
};

/* The allocations waiting for memory (waitq.c), in serving order. */
struct gmb_waitq {
  struct gmb_waiter *head, *tail;
  size_t n;             /* all of them */
  size_t after_compact; /* of n, those held only until a compaction ends */
  struct gmb_waiter_tree deadlines; /* those with one, soonest first */
  /* The waiters that hold back those behind them now (waitq.c,
   * waitq_nonblocking false), in serving order: the first is the head a
   * joining request tries, and gmb__waitq_ahead reads its priority. */
  struct gmb_waiter_order blocking;
  struct gmb_waiter_holds holds; /* the held ones, in serving order */
  struct gmb_waiter *last_added; /* for gmb__waitq_joined; NULL: none */
  size_t held;          /* of n, those held while caches are asked back */
  size_t held_nowait;   /* of held, requests that did not ask to wait */
  size_t held_quota;    /* of held, requests held for their tenant's quota */
  size_t held_job;      /* of held, requests held for the broker's offload
                           job (reclaim.c): the job runs while there is one */
  uint64_t job_asked;   /* what the caches were asked for those, summed */
  /* The job's other sums (waitq.c keeps them as its requests come and go,
   * so that neither the job's step nor a request that meets its fence
   * walks the requests it holds): the device room they take (each the
   * segment it needs, which its size alone decides), summed; the first of
   * them in serving order and its priority; and the tenants they belong
   * to, linked through gmb_tenant.job_next, each with the count and the
   * bytes (rounded) of its requests held for the job. */
  struct gmb_waiter_jobs jobs;
  uint64_t job_want;
  struct gmb_waiter *job_first;
  int job_priority;
  struct gmb_tenant *job_tenants;
  /* The same waiters by arrival, which is the order their job bounds
   * come in (each is held for the same time from its arrival): the
   * oldest's is the next (reclaim.c lets it go then). */
  struct gmb_waiter *job_oldest, *job_youngest;
  /* What the other tenants' reservations keep beside the job's requests,
   * as the job's step last reckoned it (reclaim.c; a request that joins
   * may raise it): it depends on the tenants' use, which changes without
   * the queue hearing of it, so it is a figure of the turn, not a sum. */
  uint64_t job_kept;
  /* A waiter is being tried now (waitq.c, around each try), and whether
   * it passes the room fenced for the job (gmb__alloc_fence): it is one of
   * the job's requests, or ahead of the first of them in the queue's
   * order.  trying 0: the request being handled is a new one. */
  int trying, trying_passes;
  uint64_t fenced; /* new segments refused by the job's fence, since start */
  uint64_t next_hold_ns; /* no hold ends before (0: look) */
  /* The waiters that may still block others for WAITQ_BLOCK_MS
   * (waitq.c), oldest first: the first is the next to stop. */
  struct gmb_waiter *blockers_head, *blockers_tail;
  uint64_t seq;   /* waiters queued so far: each one's arrival number */
  uint64_t pass;  /* serving passes so far: names the tenants' memos of
                     requests that found no room (gmb_tenant.wq_*) */
  uint64_t tries; /* waiters tried against the pool, since start */
  uint64_t timer_visits; /* waiters the deadline timer looked at */
  uint64_t head_visits;  /* waiters gmb__waitq_ahead and _joined looked at */
  uint64_t drop_visits;  /* waiters gmb__waitq_drop_session looked at */
  uint64_t hold_visits;  /* waiters gmb__waitq_hold_over looked at */
};

/* The walks of the tenant registry for idle tenants when a Hello finds
 * it full (core.c, gmb__core_reap_full).  Each visits every tenant, and
 * a client can send refused Hellos at will: a walk comes when a tenant
 * may have gone idle since the last one (`hint`: a session ended, a
 * reaped session's memory was freed, a revocation ended), else at most
 * GMB_REAP_FULL_WALKS a second (for what changes no hint notes, an
 * operator's quota set back to the default). */
#define GMB_REAP_FULL_WALKS 4
struct gmb_reap_full {
  int hint;            /* a tenant may have gone idle since the last walk */
  uint64_t window_ns;  /* start of the current second */
  uint32_t in_window;  /* walks in it */
  uint64_t walks;      /* since start */
  uint64_t skipped;    /* full registries met without a walk */
};

/* What cannot be moved, as the last walk of the pool for a refusal's
 * explanation counted it (alloc.c, gmb__alloc_explain).  The walk visits
 * every range of every tenant, and a client can be refused for want of
 * room at will: at most GMB_EXPLAIN_WALKS walks a second, and the
 * refusals past them reuse these figures, saying how old they are. */
#define GMB_EXPLAIN_WALKS 16
struct gmb_explain {
  uint64_t window_ns;  /* start of the current second */
  uint32_t in_window;  /* walks in it */
  uint64_t walks;      /* since start */
  uint64_t at_ns;      /* of the last walk; 0: none yet */
  uint64_t unmovable;  /* bytes pinned, or movable and locked */
  size_t n;            /* tenants holding the most of them */
  char holders[WIRE_HOLDERS_MAX][WIRE_NAME_MAX + 1];
  uint64_t bytes[WIRE_HOLDERS_MAX];
};

/* Cached memory asked back from the clients' caches (reclaim.c). */
struct gmb_reclaim {
  uint32_t caching;     /* sessions whose cached_free is not 0 */
  uint32_t asks;        /* asks in flight (sessions with ask_bytes) */
  uint64_t ask_bytes;   /* the bytes they ask */
  uint64_t next_ns;     /* no ask ends before (UINT64_MAX: none) */
  uint64_t asks_total, ignored_total; /* since start */
};

/* The movable allocations the broker offloaded to its own host memory
 * (offload.c): the host bytes it holds now for all sessions (never above
 * cfg.offload_host_max), and totals since start. */
struct gmb_offl_chunk;
struct gmb_offload {
  uint64_t host_bytes;                 /* of the allocations' copies */
  uint64_t chunk_bytes;                /* of the chunks holding them */
  struct gmb_offl_chunk *chunk;        /* the one new copies are cut from */
  uint32_t held;                       /* allocations offloaded now */
  uint64_t offloads, restores;         /* allocations, since start */
  uint64_t bytes_out, bytes_in;        /* bytes copied to / from host */
  uint64_t refused;                    /* offloads host bounds refused */
  uint64_t walks;                      /* pool walks made to choose what
                                          goes: one per slice or pause */
  uint64_t slices;                     /* slices run (gmb__offload_for) */
  uint64_t jobs;                       /* offload jobs begun (reclaim.c):
                                          requests held for more than one
                                          slice, since start */
  uint32_t pausing;                    /* tenants whose operator's pause
                                          still offloads, a slice a turn
                                          (gmb_tenant.offl_pausing) */
  int job_last;                        /* the last turn's slice was the
                                          job's, not a pause's (reclaim.c,
                                          gmb__reclaim_slice: they take
                                          turns) */
};

/* Which socket a reply leaves by (reply.c). */
enum gmb_socket { GMB_SOCK_CLIENT = 0, GMB_SOCK_ADMIN = 1 };

/* Where replies go instead of a socket when set (unit tests drive the
 * handlers and services without ZeroMQ). */
typedef void (*gmb_reply_tap)(void *ctx, enum gmb_socket sock,
                              const uint8_t *rid, size_t rid_len,
                              const struct wire_reply *rep);

struct gmb_broker {
  struct gmb_config cfg;
  char config_path[PATH_MAX]; /* "" : none */
  char run_dir[PATH_MAX];
  char client_path[PATH_MAX]; /* the socket files */
  char admin_path[PATH_MAX];
  char fd_path[PATH_MAX];     /* the descriptor channel (fdchan.c) */
  char admin_http_path[PATH_MAX]; /* HTTP for operators (http_admin.c);
                                     "": not served */
  struct gmb_device *dev;
  struct gmb_pool *pool;
  struct gmb_tenants *tenants;
  struct gmb_sessions *sessions;
  struct gmb_statefile *statefile; /* the overrides an operator set */
  struct gmb_waitq waitq;
  struct gmb_reclaim reclaim;
  struct gmb_explain explain;
  struct gmb_offload offload;
  void *zctx, *client_sock, *admin_sock;
  gmb_reply_tap reply_tap;
  void *reply_tap_ctx;
  struct gmb_loop *loop; /* the poll set and timers (loop.c) */
  struct gmb_fdchan *fdchan; /* descriptor channel connections (fdchan.c) */
  /* Called as a session ends, before its descriptor channel would be
   * closed: fdchan.c keeps a channel whose peer left descriptors unread
   * (it sets this while open; NULL: none). */
  void (*fdconn_gone)(struct gmb_broker *b, struct gmb_session *s);
  /* What the broker's descriptors in flight look like (fdchan.c keeps
   * them; status and metrics show them): descriptors sent on every
   * channel and not seen read (live sessions' and kept channels'), the
   * channels kept for ended sessions, the sends refused at a bound since
   * start, and the bounds in force (descriptors per live channel, per uid
   * and per tenant, all their channels together; 0: no channel). */
  uint64_t fd_unread, fd_refused;
  uint32_t fd_kept, fd_bound_channel, fd_bound_uid, fd_bound_tenant;
  volatile int stopping;
  int closing; /* core.c is tearing down: nothing is sent any more */
  uint64_t next_session_id;
  uint64_t start_ns;
  int checks;  /* run the consistency checks after each request (tests) */
  int flag_log_level; /* --log-level, or -1: the config's applies */

  /* Compaction (defrag.c): the run in progress, what asked for it, and
   * the totals since start. */
  struct gmb_compact *compacting;
  uint64_t compact_begun;             /* runs begun; the last one's number */
  struct gmb_tenant *compact_scope;   /* NULL: every tenant */
  int compact_reason;                 /* GMB_DEFRAG_* */
  struct gmb_defrag_req *compact_reqs; /* admin requests, in order */
  struct wire_compact_stats compact_totals;
  uint64_t frag_high_since_ns;        /* background trigger: 0 = below */
  uint64_t pool_ops;                  /* allocs + frees, to see change */
  uint64_t pool_ops_at_last_run;
  /* Revocations (defrag.c): tenants revoking, and of them those whose
   * next pass may run now (not waiting for the timer). */
  uint32_t revoking, revoke_ready;

  struct gmb_observe *observe;        /* counters for metrics (observe.c) */

  /* Limits.  fd_sessions_max: the sessions RLIMIT_NOFILE leaves
   * room for (core.c; 0: not computed, no limit of its own). */
  uint32_t fd_sessions_max;
  int reap_pending; /* a session ended: idle tenants may go (core.c) */
  struct gmb_reap_full reap_full;
  /* Ended sessions whose memory is freed in slices (core.c), oldest
   * first, through gmb_session.reap_next. */
  struct gmb_session *reap_head, *reap_tail;
};

/* Descriptors a session costs the broker: its ZeroMQ connection, its
 * pidfd, its descriptor channel and its lock table's memfd. */
#define GMB_FDS_PER_SESSION 4
/* Descriptors kept for everything else: sockets, listeners, signalfd,
 * the metrics thread, pending descriptor-channel connections, files. */
#define GMB_FDS_RESERVED 512

enum {
  GMB_DEFRAG_NONE = 0,
  GMB_DEFRAG_REQUEST,    /* a request fits the free total, not a range */
  GMB_DEFRAG_ADMIN,      /* gmbctl compact */
  GMB_DEFRAG_BACKGROUND, /* fragmentation stayed above the threshold */
};

/* Tenant t may have become idle (its last session ended, its memory was
 * freed, a revocation or a compaction run that named it ended): the
 * reapers are told, the loop's (reap_pending, and t listed for it) and a
 * full registry's walk (reap_full.hint).  Here rather than in core.c so
 * that defrag.c, a layer below, tells them the same way. */
static inline void gmb__broker_tenant_idled(struct gmb_broker *b,
                                            struct gmb_tenant *t) {
  if (gmb__tenant_idle(b->tenants, t, 0)) {
    b->reap_pending = 1;
    gmb__tenant_may_idle(b->tenants, t);
  }
  if (gmb__tenant_idle(b->tenants, t, 1)) b->reap_full.hint = 1;
}

#endif /* GMB_BROKER_H */
