/*
 * dispatch.c - what the broker does with each client request.
 *
 * Every handler checks its input, acts through the layers below and fills
 * a reply; none blocks.  An allocation goes through alloc.c (quota, pool,
 * reservations); one that finds no room is refused, or queued in the wait
 * queue (waitq.c) when the caller asked to wait or when a compaction run
 * (defrag.c) may make room; one that found the device full while other
 * sessions' caches hold free memory is first held while they are asked
 * for it (reclaim.c), as is one past its tenant's quota while the
 * tenant's other sessions' caches hold what it lacks; a Vmm increase
 * refused for either is held the same way.  A request that does
 * not wait (timeout 0) is answered at once and is not held back by the
 * queue; one that waits joins the queue behind requests of equal or
 * higher priority (waitq.h has the order).
 *
 * A client's ids say nothing about other tenants: another session's
 * allocation or segment gets the same answer as one that does not exist.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "dispatch.h"

#include "alloc.h"
#include "core.h"
#include "defrag.h"
#include "fdchan.h"
#include "gmb.h"
#include "locktab.h"
#include "log.h"
#include "offload.h"
#include "reclaim.h"
#include "reply.h"
#include "session.h"
#include "sleep.h"
#include "util.h"
#include "waitq.h"

/* Warnings a client can cause at will are rate-limited (log.h). */
static struct gmb_log_rl dispatch_rl_limit, dispatch_rl_hello, dispatch_rl_cred;

/* --- hello ------------------------------------------------------------ */

static int dispatch_hello(struct gmb_broker *b, struct gmb_session *s,
                          const struct gmb_peer *peer,
                          const struct wire_request *req,
                          struct wire_reply *rep) {
  if (s != NULL) {
    gmb__reply_fail(rep, GMB_E_PROTO, "this connection already said Hello "
                    "(session %" PRIu64 ")", s->id);
    return 1;
  }
  if (req->u.hello.version != WIRE_PROTOCOL_VERSION) {
    gmb__reply_fail(rep, GMB_E_PROTO, "protocol version %u is not spoken "
                    "here; this broker speaks %d", req->u.hello.version,
                    WIRE_PROTOCOL_VERSION);
    return 1;
  }
  /* Every session costs descriptors and memory: the broker admits so
   * many in all and per uid, refuses the next with GMB_E_LIMIT, and serves
   * the others on. */
  uint32_t max = gmb__core_max_sessions(b);
  if (gmb__sessions_count(b->sessions) >= max) {
    if (gmb__log_allow(&dispatch_rl_limit))
      log_warn("hello from uid %u refused: the broker holds %u sessions, its "
               "limit%s", (unsigned)peer->uid, max,
               gmb__log_suppressed(&dispatch_rl_limit));
    gmb__reply_fail(rep, GMB_E_LIMIT, "the broker holds %u sessions, its "
                    "limit (max_sessions, and what RLIMIT_NOFILE allows)",
                    max);
    return 1;
  }
  uint32_t mine = gmb__sessions_of_uid(b->sessions, peer->uid);
  if (mine >= b->cfg.max_sessions_per_uid) {
    if (gmb__log_allow(&dispatch_rl_limit))
      log_warn("hello from uid %u refused: it holds %u sessions, its "
               "limit%s", (unsigned)peer->uid, mine,
               gmb__log_suppressed(&dispatch_rl_limit));
    gmb__reply_fail(rep, GMB_E_LIMIT, "uid %u holds %u sessions, its limit "
                    "(max_sessions_per_uid)", (unsigned)peer->uid, mine);
    return 1;
  }
  struct gmb_tenant *t = NULL;
  char why[WIRE_MESSAGE_MAX];
  int rc = gmb__tenant_admit(b->tenants, req->u.hello.tenant, peer->uid,
                             req->u.hello.token, req->u.hello.token_len, &t,
                             why, sizeof why);
  /* The registry is full: idle tenants made by first use make room (their
   * first uids lose their claim to the names), then one more try.  The
   * walk for them is rate-limited (gmb__core_reap_full): refused Hellos
   * come as fast as a client likes. */
  if (rc == GMB_E_LIMIT && gmb__tenants_full(b->tenants) &&
      gmb__core_reap_full(b) > 0)
    rc = gmb__tenant_admit(b->tenants, req->u.hello.tenant, peer->uid,
                           req->u.hello.token, req->u.hello.token_len, &t,
                           why, sizeof why);
  /* Its tenant or uid holds its bound of descriptors unread, or its
   * sessions and kept channels fill its places: no more sessions for it
   * until they are read or closed (fdchan.h). */
  if (rc == 0 &&
      (rc = gmb__fdchan_unread_admit(b, peer->uid, t, why,
                                     sizeof why)) != 0 &&
      gmb__tenant_idle(b->tenants, t, 0)) {
    b->reap_pending = 1;
    gmb__tenant_may_idle(b->tenants, t);
  }
  if (rc) {
    if (gmb__log_allow(&dispatch_rl_hello))
      log_warn("hello from uid %u pid %d refused: %s%s", (unsigned)peer->uid,
               (int)peer->pid, why, gmb__log_suppressed(&dispatch_rl_hello));
    gmb__reply_fail(rep, rc, "%s", why);
    return 1;
  }
  s = gmb__session_new(b, peer, t, req->u.hello.client);
  if (s == NULL) {
    if (errno == ESRCH) return 0; /* the process is gone already */
    gmb__reply_fail(rep, GMB_E_SYSTEM, "cannot create a session: %s",
                    strerror(errno));
    return 1;
  }
  /* How it proved the tenant, so that a reload that changes the tenant's
   * uids or token can tell whether the session still may act as it. */
  if (t->has_token && !gmb__tenant_uid_listed(t, peer->uid)) {
    s->by_token = 1;
    memcpy(s->token_sha256, t->token_sha256, sizeof s->token_sha256);
  }
  char err[256];
  s->lt = gmb__locktab_new(s->id, GMB_LT_DEFAULT_SLOTS, err, sizeof err);
  if (s->lt == NULL) {
    gmb__reply_fail(rep, GMB_E_SYSTEM, "cannot create the lock table: %s", err);
    gmb__core_session_end(b, s, "no lock table");
    return 1;
  }
  log_info("session %" PRIu64 " opened: tenant %s, uid %u, pid %d, %s%s",
           s->id, t->name, (unsigned)s->uid, (int)s->pid, s->client,
           s->pidfd < 0 ? " (heartbeats)" : "");
  rep->kind = WIRE_HELLO;
  rep->u.hello.version = WIRE_PROTOCOL_VERSION;
  rep->u.hello.session = s->id;
  snprintf(rep->u.hello.tenant, sizeof rep->u.hello.tenant, "%s", t->name);
  snprintf(rep->u.hello.device, sizeof rep->u.hello.device, "%s",
           b->dev->ops->kind);
  snprintf(rep->u.hello.device_uuid, sizeof rep->u.hello.device_uuid, "%s",
           b->dev->uuid);
  snprintf(rep->u.hello.device_pci, sizeof rep->u.hello.device_pci, "%s",
           b->dev->pci_bus_id);
  rep->u.hello.heartbeat_ms = s->pidfd < 0 ? b->cfg.heartbeat_ms : 0;
  rep->u.hello.lock_slots = GMB_LT_DEFAULT_SLOTS;
  _Static_assert(sizeof s->secret == WIRE_SECRET_MAX, "secret fits");
  rep->u.hello.fd_secret_len = sizeof s->secret;
  memcpy(rep->u.hello.fd_secret, s->secret, sizeof s->secret);
  rep->u.hello.host_quota = t->host_quota;
  return 1;
}

/* --- alloc ------------------------------------------------------------ */

/* 1 with *rep filled when `size` is more than the whole device: no free
 * can ever make room for it, and queued it would head the queue for ever,
 * holding back everyone behind it. */
static int dispatch_never_fits(struct gmb_broker *b, struct gmb_session *s,
                               uint64_t size, struct wire_reply *rep) {
  uint64_t rounded = gmb__alloc_round(size);
  if (rounded <= b->dev->capacity) return 0;
  char sz[GMB_SIZE_BUFSZ], cap[GMB_SIZE_BUFSZ];
  gmb__alloc_explain(b, s, rounded, rep);
  snprintf(rep->message, sizeof rep->message, "%s is more than the whole "
           "device (%s on %s): waiting cannot help",
           gmb__size_format(rounded, sz, sizeof sz),
           gmb__size_format(b->dev->capacity, cap, sizeof cap), b->dev->desc);
  return 1;
}

/* Queues the request (gmb__waitq_add): 0, or 1 with the refusal in *rep
 * (too many waiting: GMB_E_LIMIT; out of host memory). */
static int dispatch_queue(struct gmb_broker *b, struct gmb_session *s,
                          uint64_t req_id, uint64_t size, uint32_t flags,
                          int timeout_ms, int after_compact,
                          struct wire_reply *rep) {
  int rc = gmb__waitq_add(b, s, req_id, size, flags, timeout_ms,
                          after_compact);
  if (rc == GMB_E_LIMIT)
    gmb__reply_fail(rep, rc, "not queued: %u requests of this session and "
                    "%" PRIu64 " of tenant %s wait already (limits %u and "
                    "%u: max_waiters_per_session, max_waiters_per_tenant)",
                    s->waiting, s->tenant->waiting, s->tenant->name,
                    b->cfg.max_waiters_per_session,
                    b->cfg.max_waiters_per_tenant);
  else if (rc)
    gmb__reply_fail(rep, rc, "cannot queue the request: out of host memory");
  return rc != 0;
}

static int dispatch_alloc_flow(struct gmb_broker *b, struct gmb_session *s,
                               uint64_t req_id, uint64_t size, uint32_t flags,
                               int timeout_ms, uint64_t ahead,
                               struct wire_reply *rep);

static int dispatch_alloc(struct gmb_broker *b, struct gmb_session *s,
                          const struct wire_request *req,
                          struct wire_reply *rep) {
  uint64_t size = req->u.alloc.size;
  uint32_t flags = req->u.alloc.flags;
  if (size == 0 || size > UINT64_MAX - GMB_POOL_ALIGN) {
    gmb__reply_fail(rep, GMB_E_INVAL, "bad allocation size %" PRIu64, size);
    return 1;
  }
  if (flags & ~GMB_MOVABLE) {
    gmb__reply_fail(rep, GMB_E_INVAL, "unknown allocation flags 0x%x",
                    flags & ~GMB_MOVABLE);
    return 1;
  }
  const uint32_t pages = req->u.alloc.pages;
  if (pages) {
    /* A cache's pages: one request for their total, made or refused
     * together (alloc.c). */
    if (pages > WIRE_PAGES_MAX || flags != 0 ||
        size != (uint64_t)pages * GMB_SEGMENT_ALIGN) {
      gmb__reply_fail(rep, GMB_E_INVAL, "a request for %u pages must be "
                      "pinned, of %u pages at most and of %u * 2 MiB bytes",
                      pages, WIRE_PAGES_MAX, pages);
      return 1;
    }
    flags |= GMB__ALLOC_PAGES;
  }
  return dispatch_alloc_flow(b, s, req->id, size, flags,
                             req->u.alloc.timeout_ms,
                             pages ? req->u.alloc.ahead : 0, rep);
}

/* What an allocation meets once its arguments were checked (also a Lock
 * that brings an offloaded allocation back, GMB__ALLOC_RESTORE): 1 with
 * *rep to send now, 0 when it was queued or held (answered later). */
static int dispatch_alloc_flow(struct gmb_broker *b, struct gmb_session *s,
                               uint64_t req_id, uint64_t size, uint32_t flags,
                               int timeout_ms, uint64_t ahead,
                               struct wire_reply *rep) {
  /* Past the quota while the tenant's other sessions' caches hold what it
   * lacks: they are asked, and the request is held until the bytes come
   * or trim_wait_ms passed (reclaim.h).  Otherwise a quota refusal below
   * is immediate. */
  if (gmb__reclaim_quota_hold(b, s, req_id, size, flags, timeout_ms, ahead))
    return 0;
  if (timeout_ms != 0 && gmb__waitq_ahead(b, s->tenant->priority)) {
    /* Others of equal or higher priority wait already: join the queue at
     * this request's place, then serve it, so no request jumps it.  The
     * quota is still refused at once: waiting would not help. */
    if (gmb__alloc_quota(s->tenant, gmb__alloc_round(size), rep)) {
      gmb__alloc_asked_back(s, rep);
      return 1;
    }
    if (dispatch_never_fits(b, s, size, rep)) return 1;
    if (dispatch_queue(b, s, req_id, size, flags, timeout_ms, 0, rep))
      return 1;
    gmb__waitq_joined(b);
    return 0;
  }
  enum gmb_nomem_why why;
  int rc = gmb__offload_try(b, s, size, flags, rep, &why);
  if (rc == GMB_E_QUOTA) gmb__alloc_asked_back(s, rep);
  if (rc != GMB_E_NOMEM) return 1;
  if (why == GMB_NOMEM_RESERVED) {
    /* Compaction cannot help: the room is there, it is kept for others.
     * Only freed memory (or a smaller reservation) can. */
    if (timeout_ms == 0) return 1;
    memset(rep, 0, sizeof *rep);
    rep->id = req_id;
    if (dispatch_queue(b, s, req_id, size, flags, timeout_ms, 0, rep))
      return 1;
    return 0;
  }
  /* The device is full while other sessions' caches hold free memory:
   * they are asked for it first (cheaper than moving memory), and the
   * request is held until it comes back or trim_wait_ms passed; then it
   * meets what follows here (reclaim.h).  When the broker made the room
   * itself (offloading idle sessions' movable allocations, offload.h),
   * the request is tried again at once. */
  int held = gmb__reclaim_hold(b, s, req_id, size, flags, timeout_ms, ahead);
  if (held == 1) return 0;
  if (held == 2) {
    memset(rep, 0, sizeof *rep);
    rep->id = req_id;
    rc = gmb__offload_try(b, s, size, flags, rep, &why);
    if (rc != GMB_E_NOMEM || why != GMB_NOMEM_NO_ROOM) return 1;
  }
  /* It fits the device's free total but no free range: compaction can
   * make room, so the request waits for a run (started now, unless one is
   * in progress) before it is answered. */
  uint64_t total = 0, rounded = gmb__alloc_round(size);
  gmb__pool_fragmentation(b->pool, NULL, &total);
  int compact = b->cfg.compaction && total >= rounded;
  if (timeout_ms == 0 && !compact) {
    gmb__alloc_explain(b, s, rounded, rep);
    return 1;
  }
  if (!compact && dispatch_never_fits(b, s, size, rep)) return 1;
  if (dispatch_queue(b, s, req_id, size, flags, timeout_ms, timeout_ms == 0,
                     rep))
    return 1;
  if (compact)
    gmb__waitq_compact_run(b, gmb__defrag_request(b, rounded, s->tenant));
  if (timeout_ms == 0 && b->compacting == NULL) {
    /* No run could start: answer now rather than never. */
    gmb__waitq_compaction_over(b, UINT64_MAX, NULL, NULL);
  }
  return 0;
}

/* --- free, stats ----------------------------------------------------- */

static int dispatch_free(struct gmb_broker *b, struct gmb_session *s,
                         const struct wire_request *req,
                         struct wire_reply *rep) {
  struct gmb_alloc_info info;
  /* Another session's id gets the same answer as no id at all, so ids
   * tell a client nothing about other tenants. */
  /* Several at once (a cache's pages): each freed in order; the first
   * that is not this session's stops the rest, and the reply names it. */
  const uint32_t n = 1 + req->u.free.n_more;
  for (uint32_t i = 0; i < n; i++) {
    const uint64_t asked = i == 0 ? req->u.free.id : req->u.free.more[i - 1];
    /* An allocation the broker offloaded has no range to free; one it
     * brought back has a pool id of its own (offload.h). */
    uint64_t id;
    if (gmb__offload_resolve(s, asked, &id, NULL) == GMB_OFFL_AWAY) {
      gmb__offload_free(b, s, asked);
      continue;
    }
    if (gmb__pool_find(b->pool, id, &info) != 0 || info.owner != s) {
      gmb__reply_fail(rep, GMB_E_NOENT, "no allocation %" PRIu64 " in this "
                      "session%s", asked,
                      i ? " (those before it were freed)" : "");
      if (i) gmb__waitq_serve(b);
      return 1;
    }
    gmb__defrag_forget(b, id);
    uint32_t slot;
    if (gmb__locktab_tag_slot(info.tag, &slot)) {
      gmb__locktab_slot_free(s->lt, slot);
      gmb__offload_freed(s, slot, id);
    }
    int rc = gmb__pool_free(b->pool, id, &info);
    GMB_ASSERT(rc == 0 && "an allocation found a moment ago cannot be freed");
    b->pool_ops++;
    gmb__tenant_uncharge(s->tenant, info.size);
    s->allocations--;
    s->used -= info.size;
    gmb__tenant_holes_held(s->tenant, &s->cached_holes, s->used);
  }
  rep->status = 0;
  gmb__waitq_serve(b);
  return 1;
}

static int dispatch_stats(struct gmb_broker *b, struct gmb_session *s,
                          struct wire_reply *rep) {
  gmb__alloc_stats(b, s, rep);
  return 1;
}

/* --- the session's own VMM memory ------------------------------------- */

/*
 * The process now holds req->u.vmm.bytes of device memory it made itself
 * through the VMM API (cuMemCreate under the preload shim): the total, not
 * a change, so that a retry says the same thing twice.  More than before
 * is charged to the tenant's quota (and uid budget) and the device's room
 * as an allocation of the difference would be (gmb__alloc_vmm); less is
 * given back at once.  The reply is the tenant's figures after it
 * (StatsReply).  An increase refused for the quota or the device's room
 * is met as an allocation that does not wait is: the caches that can
 * cover the missing bytes are asked for them (the tenant's other
 * sessions' for its quota, every tenant's for the device, reclaim.h) and
 * the request is held until they come or trim_wait_ms passed, then
 * refused with the reason (GMB_E_QUOTA, GMB_E_NOMEM).  One Vmm of a
 * session is held at a time: another one meanwhile is refused, since the
 * held difference was made on the total it replaces.
 */
static int dispatch_vmm(struct gmb_broker *b, struct gmb_session *s,
                        const struct wire_request *req,
                        struct wire_reply *rep) {
  struct gmb_tenant *t = s->tenant;
  const uint64_t want = req->u.vmm.bytes, had = s->vmm;
  if (s->vmm_held)
    return gmb__reply_fail(rep, GMB_E_INVAL, "a Vmm request of this session "
                           "is held already; send the next once it is "
                           "answered");
  if (want <= had) {
    const uint64_t less = had - want;
    if (less) {
      gmb__tenant_vmm(t, -(int64_t)less);
      gmb__device_external(b->dev, -(int64_t)less);
      s->vmm = want;
      gmb__waitq_serve(b);
    }
    return dispatch_stats(b, s, rep);
  }
  const uint64_t more = want - had;
  char sz[GMB_SIZE_BUFSZ];
  if (more > b->dev->capacity)
    return gmb__reply_fail(rep, GMB_E_NOMEM, "VMM memory of %s is more than "
                           "the device's capacity", gmb__size_format(
                               want, sz, sizeof sz));
  /* Held (answered later by the wait queue) while caches are asked: for
   * the quota first, as an allocation is, then for the device's room. */
  if (gmb__reclaim_quota_hold(b, s, req->id, more, GMB__ALLOC_VMM, 0, 0)) {
    s->vmm_held = 1;
    return 0;
  }
  enum gmb_nomem_why why;
  int rc = gmb__alloc_vmm(b, s, more, rep, &why);
  if (rc == GMB_E_QUOTA) gmb__alloc_asked_back(s, rep);
  if (rc == GMB_E_NOMEM && why == GMB_NOMEM_NO_ROOM &&
      gmb__reclaim_hold(b, s, req->id, more, GMB__ALLOC_VMM, 0, 0) == 1) {
    s->vmm_held = 1;
    return 0;
  }
  return 1;
}

/* --- lock: an offloaded allocation back ------------------------------ */

/*
 * gmb_lock found the slot OFFLOADED (offload.h): the allocation comes
 * back as an allocation of its size would be made (quota, cache asks,
 * other idle sessions' offloads, compaction, the wait queue up to
 * min(timeout_ms, restore_wait_ms)), and the reply says the caller holds
 * it.  One such request of a session at a time: its library sends them
 * one by one.
 */
static int dispatch_lock(struct gmb_broker *b, struct gmb_session *s,
                         const struct wire_request *req,
                         struct wire_reply *rep) {
  const uint64_t id = req->u.lock.id;
  uint64_t pool_id, size;
  if (gmb__offload_resolve(s, id, &pool_id, &size) != GMB_OFFL_AWAY) {
    struct gmb_alloc_info info;
    if (gmb__pool_find(b->pool, pool_id, &info) != 0 || info.owner != s)
      return gmb__reply_fail(rep, GMB_E_NOENT, "no allocation %" PRIu64
                             " in this session", id);
    rep->kind = WIRE_LOCK; /* not offloaded: the caller locks it itself */
    return 1;
  }
  if (s->restore_id)
    return gmb__reply_fail(rep, GMB_E_INVAL, "a Lock request of this "
                           "session waits already (allocation %" PRIu64 ")",
                           s->restore_id);
  int timeout_ms = req->u.lock.timeout_ms;
  if (timeout_ms < 0 || (uint32_t)timeout_ms > b->cfg.restore_wait_ms)
    timeout_ms = (int)b->cfg.restore_wait_ms;
  s->restore_id = id;
  int now = dispatch_alloc_flow(b, s, req->id, size,
                                GMB_MOVABLE | GMB__ALLOC_RESTORE, timeout_ms,
                                0, rep);
  if (now) s->restore_id = 0;
  return now;
}

/* --- entry ------------------------------------------------------------ */

/* A request of session s, whose credentials were checked. */
static int dispatch_request(struct gmb_broker *b, struct gmb_session *s,
                            const struct wire_request *req,
                            struct wire_reply *rep) {
  switch (req->kind) {
    case WIRE_ALLOC:
      return dispatch_alloc(b, s, req, rep);
    case WIRE_FREE:
      return dispatch_free(b, s, req, rep);
    case WIRE_STATS:
      return dispatch_stats(b, s, rep);
    case WIRE_VMM:
      return dispatch_vmm(b, s, req, rep);
    case WIRE_HEARTBEAT:
      return 0;
    case WIRE_SEGMENT_CLOSED:
      /* Only the cuda device waits for these before freeing a retired
       * segment (the host device freed it already); the free makes room. */
      if (gmb__device_seg_closed(b->dev, req->u.segment.segment, s->id))
        gmb__waitq_serve(b);
      return 0;
    case WIRE_BYE:
      gmb__core_session_end_sliced(b, s, "said goodbye");
      return 1;
    case WIRE_SLEEP_NOTE:
      return gmb__sleep_note(b, s, req, rep);
    case WIRE_LOCK:
      return dispatch_lock(b, s, req, rep);
    default:
      gmb__reply_fail(rep, GMB_E_PROTO, "%s is not a client request",
                      gmb__wire_kind_name(req->kind));
      return 1;
  }
}

int gmb__dispatch(struct gmb_broker *b, const struct gmb_peer *peer,
                  const struct wire_request *req, struct wire_reply *rep) {
  memset(rep, 0, sizeof *rep);
  rep->id = req->id;
  /* Stopping: what is there may leave, nothing new comes. */
  if (b->stopping && (req->kind == WIRE_HELLO || req->kind == WIRE_ALLOC))
    return gmb__reply_fail(rep, GMB_E_CONN, "the broker is shutting down");
  struct gmb_session *s =
      gmb__session_find(b->sessions, peer->rid, peer->rid_len);
  if (req->kind == WIRE_HELLO) return dispatch_hello(b, s, peer, req, rep);
  if (s == NULL) {
    gmb__reply_fail(rep, GMB_E_CONN, "no session on this connection: say "
                    "Hello first (did the broker restart?)");
    return 1;
  }
  /* A routing id names a connection, and a connection one process: a
   * message whose credentials are not its session's is not the session's
   * (DESIGN.md, "Protocol and sockets"). */
  if (peer->uid != s->uid ||
      (peer->pid > 0 && s->pid > 0 && peer->pid != s->pid)) {
    if (gmb__log_allow(&dispatch_rl_cred))
      log_warn("message for session %" PRIu64 " (uid %u pid %d) from uid %u "
               "pid %d refused%s", s->id, (unsigned)s->uid, (int)s->pid,
               (unsigned)peer->uid, (int)peer->pid,
               gmb__log_suppressed(&dispatch_rl_cred));
    return gmb__reply_fail(rep, GMB_E_AUTH, "this connection's session "
                           "belongs to another process");
  }
  s->last_seen_ns = gmb__now_ns();
  gmb__sleep_heard(b, s, req->sleep_pausable, req->sleep_idle,
                   req->sleep_idle_ms, s->last_seen_ns);
  /* Piggy-backed on every request; a Heartbeat may answer a trim (or an
   * ask to sleep). */
  int answered =
      gmb__reclaim_heard(b, s, req->cached_free, req->trim_answered);
  gmb__tenant_holes_heard(s->tenant, &s->cached_holes, req->cached_holes,
                          s->used);
  int now = dispatch_request(b, s, req, rep);
  /* After the request: what it brought back is counted first. */
  if (answered) gmb__reclaim_settle(b);
  return now;
}
