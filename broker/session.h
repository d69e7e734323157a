/*
 * session.h - connected clients.
 *
 * A session is born from a successful Hello and belongs to one tenant.  It
 * is found by the ZeroMQ routing id of its connection.  The broker watches
 * the client's process through a pidfd when it can see the pid, else it
 * asks for heartbeats.  A session remembers which segments' handles it was
 * given, so that a retired segment is announced only to those that mapped
 * it.  This module keeps the table; ending a session (freeing its memory,
 * dropping its waiters, telling the device) is core.c's, which calls
 * gmb__session_detach and gmb__session_free at the right moments.  The
 * table's generation changes whenever a session comes or goes, so the loop
 * knows when to rebuild its poll set without being called from here.
 */
#ifndef GMB_SESSION_H
#define GMB_SESSION_H

#include <stddef.h>
#include <stdint.h>

#include <sys/types.h>

#include "broker.h"
#include "fdpass.h"
#include "pool.h"
#include "rbtree.h"

struct gmb_locktab;
struct gmb_fdhold;
struct gmb_sleep_tag;

struct gmb_waiter;

struct gmb_session {
  uint64_t id;
  uint8_t *rid;
  size_t rid_len;
  uid_t uid;
  gid_t gid;
  pid_t pid;        /* in the broker's pid namespace; 0: unknown */
  int pidfd;        /* -1: heartbeat mode (unless fdconn watches it) */
  int fdconn;       /* its descriptor channel (fdchan.c); -1: none yet */
  uint32_t fd_sent; /* descriptors sent on it since it was last seen read
                       to the end (SIOCOUTQ 0): at least those it left
                       unread (fdchan.c) */
  struct gmb_fdhold *fd_hold; /* fdchan.c's record of them (NULL: none) */
  uint64_t fd_refused; /* its descriptor requests refused at a bound of
                          unread descriptors (fdchan.c) */
  uint8_t secret[GMB_FD_SECRET_LEN]; /* proves it on the channel */
  uint64_t last_seen_ns;
  uint64_t born_ns; /* when its Hello made it: it has been idle no longer */
  struct gmb_tenant *tenant;
  struct gmb_session *tenant_next, *tenant_prev;
  uint64_t *segs;   /* segment ids whose handle it was given, sorted */
  size_t n_segs, cap_segs;
  uint64_t allocations; /* live allocation count */
  uint64_t used;        /* bytes of them (rounded), charged to its tenant */
  uint64_t cached_free; /* free in its cache, as its last request said */
  uint64_t cached_holes; /* free between blocks in its cache's pages, as
                            its last request said, at most `used` (kept
                            so when used falls: gmb__tenant_holes_held;
                            in its tenant's cache_holes) */
  /* Bytes its process made itself through the VMM API and reported
   * (WIRE_VMM), charged to its tenant (gmb_tenant.vmm) and the device
   * (external) until it reports less or ends: one counter, never above
   * the device's capacity, whatever the process sends. */
  uint64_t vmm;
  /* A Vmm increase of it is held in the wait queue while caches are asked
   * back (dispatch.c): at most one, and no other Vmm is taken meanwhile,
   * so that `vmm` stays what the held request's difference was made on. */
  int vmm_held;
  /* Asks to give cached memory back (EVENT_TRIM): how many were sent,
   * and how many gave nothing back (unanswered past the broker's wait
   * bound, or answered while it held as much as before), for gmbctl and
   * metrics. */
  uint64_t trim_asks, trim_ignored;
  /* The ask in flight, at most one (reclaim.c): its bytes (0: none), when
   * the broker stops waiting for it, the cached_free the session had
   * reported then and the bytes it held then (ask_used: what it gave is
   * checked against what it holds, never taken from its report).  A
   * session whose asks gave nothing is not asked again before ask_skip_ns
   * (ask_ignored_run asks in a row: the pause doubles). */
  uint64_t ask_bytes, ask_until_ns, ask_cached, ask_used, ask_skip_ns;
  uint32_t ask_ignored_run;
  uint32_t waiting; /* its requests in the wait queue (waitq.c) */
  struct gmb_waiter *waiters; /* those requests, linked (waitq.c) */
  /* Sleep and wake (sleep.h): its policy's offer and when it was last
   * active, as its last request said; whether the ask in flight is an
   * EVENT_SLEEP; its paused tags as its library reported them, and their
   * sums. */
  uint64_t sleep_pausable, sleep_active_ns;
  int sleep_idle; /* its policy deems it idle: its movable may be offloaded */
  int ask_sleep;
  int ask_other; /* the ask in flight is for another tenant's request */
  struct gmb_sleep_tag *paused;
  uint32_t n_paused;
  uint64_t host_bytes, paused_bytes;
  /* The movable allocations of it the broker offloaded, or brought back
   * under a new pool id (offload.c; NULL until the first), and the id a
   * Lock request of it waits to bring back (0: none; one at a time). */
  struct gmb_offload_set *offl;
  uint64_t restore_id;
  int by_token;     /* its Hello proved the tenant with a token, not a uid */
  uint8_t token_sha256[32]; /* the hash it matched (by_token only) */
  char client[64];
  struct gmb_locktab *lt; /* its movable allocations' slots */
  RB_ENTRY(gmb_session) link; /* the session table, by routing id */
  /* Ended, its memory still being freed in slices (core.c): out of the
   * table and of its tenant's list, on the broker's reap list. */
  int reaping, unlinked;
  struct gmb_session *reap_next;
};

struct gmb_sessions *gmb__sessions_new(void);
/* Frees the table, which must be empty (core.c ends every session first).
 * Accepts NULL. */
void gmb__sessions_destroy(struct gmb_sessions *ss);

struct gmb_session *gmb__session_find(struct gmb_sessions *ss,
                                      const uint8_t *rid, size_t rid_len);
/* The session with id `id`, or NULL.  O(sessions). */
struct gmb_session *gmb__session_by_id(struct gmb_sessions *ss, uint64_t id);
/* Creates a session for `peer` in `tenant`, with a fresh random secret for
 * its descriptor channel.  NULL with errno on failure (ESRCH: the peer's
 * process is already gone). */
struct gmb_session *gmb__session_new(struct gmb_broker *b,
                                     const struct gmb_peer *peer,
                                     struct gmb_tenant *tenant,
                                     const char *client);
/* Takes s out of its tenant's list of sessions (the first step of ending
 * it: segments retired from now on are not announced to it).  Its trim
 * counters join the tenant's totals of ended sessions. */
void gmb__session_detach(struct gmb_session *s);
/* Gives s its descriptor channel `fd` (the session owns it from now on). */
void gmb__session_set_fdconn(struct gmb_sessions *ss, struct gmb_session *s,
                             int fd);
/* Takes s out of the table and of its tenant's list, and closes its pidfd
 * and descriptor channel: no message, hang-up or heartbeat reaches it any
 * more, but the struct stays (its allocations still name it as owner
 * while they are freed in slices).  Idempotent. */
void gmb__session_unlink(struct gmb_sessions *ss, struct gmb_session *s);
/* Unlinks s (if not yet) and frees it. */
void gmb__session_free(struct gmb_sessions *ss, struct gmb_session *s);

size_t gmb__sessions_count(const struct gmb_sessions *ss);
/* The sessions of uid `uid` now (max_sessions_per_uid).  O(log uids). */
uint32_t gmb__sessions_of_uid(const struct gmb_sessions *ss, uid_t uid);

/* The free bytes in s's cache, as it last reported them, capped at what
 * it holds: a report can never count memory the session does not have. */
uint64_t gmb__session_cached(const struct gmb_session *s);
/* The free bytes in the caches of tenant t's sessions (the sum of
 * gmb__session_cached); never more than the tenant uses. */
uint64_t gmb__tenant_cached(const struct gmb_tenant *t);
/* The asks to give cached memory back (EVENT_TRIM) that tenant t's
 * sessions were sent, and those they left unanswered, since the broker
 * started: its live sessions' counters plus those its ended sessions
 * left in the tenant (gmb__session_detach folds them in), so the totals
 * never go down while the tenant exists. */
void gmb__tenant_trim_totals(const struct gmb_tenant *t, uint64_t *asks,
                             uint64_t *ignored);
/* Number of broken invariants of tenant t's sessions: the bytes they hold
 * add up to the tenant's `used`, their count to its n_sessions. */
int gmb__tenant_sessions_check(const struct gmb_tenant *t);
/* Changes whenever a session is added or removed. */
uint64_t gmb__sessions_gen(const struct gmb_sessions *ss);
/* Visits every session; fn may end the session it is given. */
void gmb__sessions_each(struct gmb_sessions *ss,
                        void (*fn)(void *ctx, struct gmb_session *s),
                        void *ctx);

/* The lock table and slot of a movable allocation (its owner is the
 * session), or NULL when it has none: pinned, or no table. */
struct gmb_locktab *gmb__session_slot(const struct gmb_alloc_info *a,
                                      uint32_t *slot);
/* 1 when a movable allocation is locked by its client right now. */
int gmb__session_alloc_locked(const struct gmb_alloc_info *a);

/* 1 when the session was already given segment `seg`'s handle; else
 * records it and returns 0.  -1 on ENOMEM. */
int gmb__session_seg_seen(struct gmb_session *s, uint64_t seg);
/* Forgets segment `seg`; returns 1 when it was recorded. */
int gmb__session_seg_forget(struct gmb_session *s, uint64_t seg);

#endif /* GMB_SESSION_H */
