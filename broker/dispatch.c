/*
 * dispatch.c - what the broker does with each client request, and the queue
 * of allocations waiting for memory.
 *
 * Every handler checks its input, acts on the pool and the tenant, and fills
 * a reply; none blocks.  The order for an allocation is: arguments, quota
 * (refused at once, never waited on), device (refused, or queued when the
 * caller asked to wait).  The quota is asked before the pool and charged
 * once the pool said yes; the loop is single-threaded, so nothing can come
 * between the two, and `used` and `peak` count only memory handed out.
 *
 * Reservations (tenant.h has the rule): an allocation that made its
 * tenant's segments grow is checked once the pool said yes, and rolled
 * back (GMB_E_NOMEM, naming the reservation) when it would leave the
 * device unable to give another tenant the unused part of its
 * reservation.  Checking after the pool is exact (the pool decides whether
 * a segment is made and how large); the rollback releases the segment.
 *
 * The wait queue holds gmb_alloc_wait requests that found no room, ordered
 * by tenant priority (higher first; the priority when the request came),
 * then arrival.  Whenever memory may have come back (a free, a session's
 * end, a compaction, a smaller reservation, an expired or dead waiter) it
 * is served from the head:
 *   - a waiter that fits is served;
 *   - the first waiter that does not fit BLOCKS the waiters behind it, so a
 *     large request is never starved by a stream of smaller ones of equal
 *     or lower priority; higher priorities are ahead of it anyway;
 *   - except that a request within its own tenant's reservation is served
 *     even behind a blocked one: that memory is kept for its tenant, the
 *     blocked request could never have had it.
 * A new waiting request joins the queue at its place (and the queue is
 * served) when a waiter of equal or higher priority is already there, so
 * it cannot jump the queue either.  A request that does not wait
 * (timeout 0) is answered at once and is not held back by the queue.
 * Requests queued only until a compaction run ends (`after_compact`: they
 * did not ask to wait) never block others: they are tried as memory comes
 * back and answered GMB_E_NOMEM when the run ends.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "broker.h"
#include "compact.h"
#include "gmb.h"
#include "locktab.h"
#include "log.h"
#include "observe.h"
#include "session.h"
#include "util.h"

struct gmb_waiter {
  struct gmb_waiter *next, *prev;
  struct gmb_session *session;
  uint64_t req_id;
  uint64_t size;
  uint32_t flags;
  uint64_t deadline_ns; /* UINT64_MAX: for ever */
  uint64_t queued_ns;   /* when it came, for the latency metrics */
  int after_compact;    /* answer GMB_E_NOMEM when the run ends */
  int priority;         /* its tenant's, when it came */
};

/* Why an allocation was refused GMB_E_NOMEM. */
enum {
  DISPATCH_NO_ROOM = 1,  /* the device has no room (rep's message unset) */
  DISPATCH_RESERVED,     /* another tenant's reservation (message set) */
};

static uint64_t dispatch_round(uint64_t size) {
  return (size + GMB_POOL_ALIGN - 1) & ~(uint64_t)(GMB_POOL_ALIGN - 1);
}

static void dispatch_fail(struct wire_reply *rep, int status, const char *fmt,
                          ...) __attribute__((format(printf, 3, 4)));

static void dispatch_fail(struct wire_reply *rep, int status, const char *fmt,
                          ...) {
  va_list ap;
  rep->status = status;
  rep->kind = WIRE_NONE;
  va_start(ap, fmt);
  vsnprintf(rep->message, sizeof rep->message, fmt, ap);
  va_end(ap);
}

static void dispatch_handle(struct wire_handle *h, const struct gmb_dseg *d) {
  h->segment = d->id;
  h->size = d->size;
  h->len = d->handle_len;
  memcpy(h->bytes, d->handle, d->handle_len);
}

/*
 * A host segment is a shm object of mode 0600.  A broker running as root
 * gives it to the uid of each session about to open it, so that a job that
 * is not root can map it; the client opens it right after the reply, and
 * opening is the only moment the owner matters.  (Two sessions of one
 * tenant under different uids, handed the same new segment in the same
 * instant, could still race; the cuda device has no such issue.)
 */
static void dispatch_grant(struct gmb_broker *b, struct gmb_session *s,
                           const struct gmb_dseg *d) {
  if (geteuid() != 0 || s->uid == 0 || strcmp(b->dev->ops->kind, "host"))
    return;
  gmb__device_host_chown(b->dev, d, s->uid, s->gid);
}

/* --- hello ------------------------------------------------------------ */

static int dispatch_hello(struct gmb_broker *b, struct gmb_session *s,
                          const struct gmb_peer *peer,
                          const struct wire_request *req,
                          struct wire_reply *rep) {
  if (s != NULL) {
    dispatch_fail(rep, GMB_E_PROTO, "this connection already said Hello "
                  "(session %" PRIu64 ")", s->id);
    return 1;
  }
  if (req->u.hello.version != WIRE_PROTOCOL_VERSION) {
    dispatch_fail(rep, GMB_E_PROTO, "protocol version %u is not spoken "
                  "here; this broker speaks %d", req->u.hello.version,
                  WIRE_PROTOCOL_VERSION);
    return 1;
  }
  struct gmb_tenant *t = NULL;
  char why[WIRE_MESSAGE_MAX];
  int rc = gmb__tenant_admit(b->tenants, req->u.hello.tenant, peer->uid,
                             req->u.hello.token, req->u.hello.token_len, &t,
                             why, sizeof why);
  if (rc) {
    log_warn("hello from uid %u pid %d refused: %s", (unsigned)peer->uid,
             (int)peer->pid, why);
    dispatch_fail(rep, rc, "%s", why);
    return 1;
  }
  s = gmb__session_new(b, peer, t, req->u.hello.client);
  if (s == NULL) {
    if (errno == ESRCH) return 0; /* the process is gone already */
    dispatch_fail(rep, GMB_E_SYSTEM, "cannot create a session: %s",
                  strerror(errno));
    return 1;
  }
  char err[256];
  s->lt = gmb__locktab_new(s->id, s->uid, s->gid, GMB_LT_DEFAULT_SLOTS, err,
                           sizeof err);
  if (s->lt == NULL) {
    dispatch_fail(rep, GMB_E_SYSTEM, "cannot create the lock table: %s", err);
    gmb__session_end(b, s, "no lock table");
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
  rep->u.hello.heartbeat_ms = s->pidfd < 0 ? b->cfg.heartbeat_ms : 0;
  snprintf(rep->u.hello.lock_table, sizeof rep->u.hello.lock_table, "%s",
           gmb__locktab_name(s->lt));
  rep->u.hello.lock_slots = GMB_LT_DEFAULT_SLOTS;
  return 1;
}

/* --- alloc ------------------------------------------------------------ */

struct dispatch_unmovable {
  struct gmb_broker *b;
  uint64_t bytes;
  struct {
    struct gmb_tenant *t;
    uint64_t bytes;
  } by[WIRE_HOLDERS_MAX];
  size_t n;
};

/* Counts the bytes compaction cannot move: pinned, or movable and locked
 * now; and which tenants hold the most of them. */
static int dispatch_count_unmovable(void *ctx, const struct gmb_alloc_info *a,
                                    int is_free) {
  struct dispatch_unmovable *u = ctx;
  if (is_free || a->id == 0) return 0;
  struct gmb_session *s = a->owner;
  int stuck = !(a->flags & GMB_MOVABLE);
  if (!stuck && s && s->lt && a->tag)
    stuck = gmb__locktab_holders(s->lt, a->tag - 1) != 0;
  if (!stuck || s == NULL) return 0;
  u->bytes += a->size;
  size_t i;
  for (i = 0; i < u->n; i++)
    if (u->by[i].t == s->tenant) break;
  if (i == u->n) {
    if (u->n == WIRE_HOLDERS_MAX) return 0; /* the total still counts */
    u->by[u->n].t = s->tenant;
    u->by[u->n].bytes = 0;
    u->n++;
  }
  u->by[i].bytes += a->size;
  return 0;
}

static void dispatch_nomem(struct gmb_broker *b, struct gmb_session *s,
                           uint64_t size, struct wire_reply *rep) {
  uint64_t largest = 0, total = 0;
  gmb__defrag_device_fragmentation(b, &largest, &total);
  struct dispatch_unmovable u;
  memset(&u, 0, sizeof u);
  u.b = b;
  gmb__pool_walk(b->pool, dispatch_count_unmovable, &u);
  char req_s[GMB_SIZE_BUFSZ], tot_s[GMB_SIZE_BUFSZ], big_s[GMB_SIZE_BUFSZ],
      stuck_s[GMB_SIZE_BUFSZ], one[GMB_SIZE_BUFSZ];
  char holders[256] = "";
  size_t off = 0;
  for (size_t i = 0; i < u.n && off < sizeof holders; i++) {
    int n = snprintf(holders + off, sizeof holders - off, "%s%s %s",
                     i ? ", " : "", u.by[i].t->name,
                     gmb__size_format(u.by[i].bytes, one, sizeof one));
    if (n < 0) break;
    off += (size_t)n;
  }
  /* cuda: retired segments still occupy the device until every client
   * that mapped them said it closed them; say so rather than leave a
   * "free" figure the device cannot honour. */
  char retiring[96] = "";
  if (b->dev->retiring_bytes)
    snprintf(retiring, sizeof retiring,
             "; %s in %llu retired segment(s) waits for clients to close it",
             gmb__size_format(b->dev->retiring_bytes, one, sizeof one),
             (unsigned long long)b->dev->retiring);
  dispatch_fail(rep, GMB_E_NOMEM,
                "no room for %s on %s (tenant %s): %s free in total, the "
                "largest free range is %s; %s cannot be moved (pinned or "
                "locked)%s%s%s%s",
                gmb__size_format(size, req_s, sizeof req_s), b->dev->desc,
                s->tenant->name, gmb__size_format(total, tot_s, sizeof tot_s),
                gmb__size_format(largest, big_s, sizeof big_s),
                gmb__size_format(u.bytes, stuck_s, sizeof stuck_s),
                u.n ? ", held by " : "", holders,
                b->cfg.compaction ? "" : "; compaction is off", retiring);
  rep->kind = WIRE_NOMEM;
  rep->u.nomem.request = size;
  rep->u.nomem.free_total = total;
  rep->u.nomem.largest_free = largest;
  rep->u.nomem.unmovable = u.bytes;
  rep->u.nomem.n_holders = u.n;
  for (size_t i = 0; i < u.n; i++)
    snprintf(rep->u.nomem.holders[i], sizeof rep->u.nomem.holders[i], "%s",
             u.by[i].t->name);
}

/* 0 when `rounded` more bytes fit t's quota, else GMB_E_QUOTA with *rep
 * filled (and the refusal counted). */
static int dispatch_quota(struct gmb_tenant *t, uint64_t rounded,
                          struct wire_reply *rep) {
  int rc = gmb__tenant_fits(t, rounded);
  if (rc) {
    char q[GMB_SIZE_BUFSZ], u[GMB_SIZE_BUFSZ], r[GMB_SIZE_BUFSZ];
    dispatch_fail(rep, rc, "tenant %s: %s more would pass its quota of %s "
                  "(%s in use)", t->name,
                  gmb__size_format(rounded, r, sizeof r),
                  gmb__size_format(t->quota, q, sizeof q),
                  gmb__size_format(t->used, u, sizeof u));
  }
  return rc;
}

/*
 * Tries to allocate for session s.  Returns 0 with *rep filled, or the
 * refusal.  GMB_E_NOMEM comes with *nomem_why: DISPATCH_NO_ROOM leaves
 * *rep's message alone so the caller may queue the request or explain
 * with dispatch_nomem(); DISPATCH_RESERVED has the message set.
 */
static int dispatch_try_alloc(struct gmb_broker *b, struct gmb_session *s,
                              uint64_t size, uint32_t flags,
                              struct wire_reply *rep, int *nomem_why) {
  struct gmb_tenant *t = s->tenant;
  uint64_t rounded = dispatch_round(size);
  *nomem_why = 0;
  int rc = dispatch_quota(t, rounded, rep);
  if (rc) return rc;
  struct gmb_alloc_info info;
  uint64_t seg_before = t->segment_bytes;
  rc = gmb__pool_alloc(b->pool, t->arena, size, flags, s, &info);
  /* The pool may have made a segment for t, or released lingering ones
   * (the retire callback counted those). */
  gmb__tenant_segments_sync(b->tenants, t);
  if (rc) {
    if (rc != GMB_E_NOMEM)
      dispatch_fail(rep, rc, "allocation of %" PRIu64 " bytes failed: %s",
                    size, gmb_strerror(rc));
    else
      *nomem_why = DISPATCH_NO_ROOM;
    return rc;
  }
  if (t->segment_bytes > seg_before) {
    uint64_t room = b->dev->capacity > b->dev->in_use
                        ? b->dev->capacity - b->dev->in_use
                        : 0;
    char why[WIRE_MESSAGE_MAX];
    rc = gmb__tenant_reserve_allows(b->tenants, t, rounded, room, why,
                                    sizeof why);
    if (rc) {
      gmb__pool_free(b->pool, info.id, NULL);
      /* A small segment made for it would linger, counted as t's and
       * taking room from the reservations: give it back now. */
      gmb__pool_trim(b->pool);
      gmb__tenant_segments_sync(b->tenants, t);
      dispatch_fail(rep, rc, "%s", why);
      *nomem_why = DISPATCH_RESERVED;
      return rc;
    }
  }
  GMB_ASSERT(info.size == rounded && "pool and broker round differently");
  uint32_t slot = 0;
  if (flags & GMB_MOVABLE) {
    rc = gmb__locktab_slot_new(s->lt, info.id, info.dseg->id, info.offset,
                               &slot);
    if (rc) {
      gmb__pool_free(b->pool, info.id, NULL);
      dispatch_fail(rep, rc, "this session holds as many movable "
                    "allocations as its lock table has slots (%u)",
                    GMB_LT_DEFAULT_SLOTS);
      return rc;
    }
    gmb__pool_set_tag(b->pool, info.id, slot + 1);
  }
  rc = gmb__tenant_charge(t, rounded);
  GMB_ASSERT(rc == 0 && "a size that fit the quota a moment ago");
  s->allocations++;
  b->pool_ops++;
  rep->status = 0;
  rep->kind = WIRE_ALLOC;
  rep->u.alloc.id = info.id;
  rep->u.alloc.size = info.size;
  rep->u.alloc.segment = info.dseg->id;
  rep->u.alloc.offset = info.offset;
  rep->u.alloc.handle.len = 0;
  rep->u.alloc.slot = slot;
  int seen = gmb__session_seg_seen(s, info.dseg->id);
  if (seen == 0) {
    dispatch_grant(b, s, info.dseg);
    dispatch_handle(&rep->u.alloc.handle, info.dseg);
  }
  /* seen < 0 (no memory to remember it): the client asks with Segment. */
  return 0;
}

/* 1 when a request that asked to wait (not one held only for a
 * compaction run) of priority >= `priority` is queued. */
static int dispatch_waits_ahead(const struct gmb_broker *b, int priority) {
  for (const struct gmb_waiter *w = b->wait_head; w && w->priority >= priority;
       w = w->next)
    if (!w->after_compact) return 1;
  return 0;
}

static int dispatch_alloc(struct gmb_broker *b, struct gmb_session *s,
                          const struct wire_request *req,
                          struct wire_reply *rep) {
  uint64_t size = req->u.alloc.size;
  uint32_t flags = req->u.alloc.flags;
  if (size == 0 || size > UINT64_MAX - GMB_POOL_ALIGN) {
    dispatch_fail(rep, GMB_E_INVAL, "bad allocation size %" PRIu64, size);
    return 1;
  }
  if (flags & ~GMB_MOVABLE) {
    dispatch_fail(rep, GMB_E_INVAL, "unknown allocation flags 0x%x",
                  flags & ~GMB_MOVABLE);
    return 1;
  }
  int timeout_ms = req->u.alloc.timeout_ms;
  if (timeout_ms != 0 && dispatch_waits_ahead(b, s->tenant->priority)) {
    /* Others of equal or higher priority wait already: join the queue at
     * this request's place, then serve it, so no request jumps it.  The
     * quota is still refused at once: waiting would not help. */
    if (dispatch_quota(s->tenant, dispatch_round(size), rep)) return 1;
    if (gmb__dispatch_queue(b, s, req->id, size, flags, timeout_ms, 0) != 0) {
      dispatch_fail(rep, GMB_E_SYSTEM, "cannot queue the request: out of "
                    "host memory");
      return 1;
    }
    gmb__dispatch_serve_waiters(b);
    return 0;
  }
  int why = 0;
  int rc = dispatch_try_alloc(b, s, size, flags, rep, &why);
  if (rc != GMB_E_NOMEM) return 1;
  if (why == DISPATCH_RESERVED) {
    /* Compaction cannot help: the room is there, it is kept for others.
     * Only freed memory (or a smaller reservation) can. */
    if (timeout_ms == 0) return 1;
    if (gmb__dispatch_queue(b, s, req->id, size, flags, timeout_ms, 0) != 0) {
      dispatch_fail(rep, GMB_E_SYSTEM, "cannot queue the request: out of "
                    "host memory");
      return 1;
    }
    return 0;
  }
  /* It fits the device's free total but no free range: compaction can
   * make room, so the request waits for a run (started now, unless one is
   * in progress) before it is answered. */
  uint64_t total = 0, rounded = dispatch_round(size);
  gmb__defrag_device_fragmentation(b, NULL, &total);
  int compact = b->cfg.compaction && total >= rounded;
  if (timeout_ms == 0 && !compact) {
    dispatch_nomem(b, s, rounded, rep);
    return 1;
  }
  if (gmb__dispatch_queue(b, s, req->id, size, flags, timeout_ms,
                          timeout_ms == 0) != 0) {
    dispatch_fail(rep, GMB_E_SYSTEM, "cannot queue the request: out of "
                  "host memory");
    return 1;
  }
  if (compact) gmb__defrag_start(b, NULL, GMB_DEFRAG_REQUEST);
  if (timeout_ms == 0 && b->compacting == NULL) {
    /* No run could start: answer now rather than never. */
    gmb__dispatch_compaction_over(b);
  }
  return 0;
}

int gmb__dispatch_queue(struct gmb_broker *b, struct gmb_session *s,
                        uint64_t req_id, uint64_t size, uint32_t flags,
                        int timeout_ms, int after_compact) {
  struct gmb_waiter *w = calloc(1, sizeof *w);
  if (w == NULL) return GMB_E_SYSTEM;
  w->session = s;
  w->req_id = req_id;
  w->size = size;
  w->flags = flags;
  w->after_compact = after_compact;
  w->queued_ns = gmb__now_ns();
  w->deadline_ns = timeout_ms <= 0 ? UINT64_MAX
                                   : gmb__now_ns() +
                                         (uint64_t)timeout_ms * 1000000u;
  w->priority = s->tenant->priority;
  /* After the last waiter of equal or higher priority: priority first,
   * then arrival.  Walks from the tail, where equal priorities end. */
  struct gmb_waiter *after = b->wait_tail;
  while (after && after->priority < w->priority) after = after->prev;
  w->prev = after;
  w->next = after ? after->next : b->wait_head;
  if (w->next)
    w->next->prev = w;
  else
    b->wait_tail = w;
  if (after)
    after->next = w;
  else
    b->wait_head = w;
  b->n_waiting++;
  s->tenant->waiting++;
  if (after_compact) {
    b->n_after_compact++;
    log_debug("session %" PRIu64 ": %" PRIu64 " bytes wait for a "
              "compaction run", s->id, size);
  } else {
    char sz[GMB_SIZE_BUFSZ];
    log_info("session %" PRIu64 " (tenant %s, priority %d): %s wait for "
             "memory (timeout %d ms); %zu requests waiting",
             s->id, s->tenant->name, w->priority,
             gmb__size_format(size, sz, sizeof sz), timeout_ms, b->n_waiting);
  }
  return 0;
}

static void dispatch_unqueue(struct gmb_broker *b, struct gmb_waiter *w) {
  if (w->after_compact) b->n_after_compact--;
  GMB_ASSERT(w->session->tenant->waiting > 0 && "waiting count drifted");
  w->session->tenant->waiting--;
  if (w->prev)
    w->prev->next = w->next;
  else
    b->wait_head = w->next;
  if (w->next)
    w->next->prev = w->prev;
  else
    b->wait_tail = w->prev;
  b->n_waiting--;
  free(w);
}

static void dispatch_answer(struct gmb_broker *b, struct gmb_session *s,
                            struct wire_reply *rep) {
  gmb__loop_send(b, b->client_sock, s->rid, s->rid_len, rep);
}

/* A waiter is answered at last: its reply, and its time since it came in
 * the metrics (the loop counts only the requests it answers at once). */
static void dispatch_answer_waiter(struct gmb_broker *b,
                                   const struct gmb_waiter *w,
                                   struct wire_reply *rep) {
  dispatch_answer(b, w->session, rep);
  gmb__observe_request(b, WIRE_ALLOC, rep->status,
                       gmb__now_ns() - w->queued_ns);
}

void gmb__dispatch_serve_waiters(struct gmb_broker *b) {
  int blocked = 0; /* a waiter ahead did not fit: hold back the rest */
  struct gmb_waiter *w = b->wait_head, *next;
  for (; w; w = next) {
    next = w->next;
    struct gmb_tenant *t = w->session->tenant;
    if (blocked && !w->after_compact &&
        !gmb__tenant_within_reserve(t, dispatch_round(w->size)))
      continue;
    struct wire_reply rep;
    memset(&rep, 0, sizeof rep);
    rep.id = w->req_id;
    int why = 0;
    int rc = dispatch_try_alloc(b, w->session, w->size, w->flags, &rep, &why);
    if (rc == GMB_E_NOMEM) {
      if (!w->after_compact) blocked = 1;
      continue;
    }
    dispatch_answer_waiter(b, w, &rep);
    dispatch_unqueue(b, w);
  }
}

void gmb__dispatch_compaction_over(struct gmb_broker *b) {
  if (b->n_after_compact == 0) return;
  struct gmb_waiter *w = b->wait_head, *next;
  for (; w; w = next) {
    next = w->next;
    if (!w->after_compact) continue;
    struct wire_reply rep;
    memset(&rep, 0, sizeof rep);
    rep.id = w->req_id;
    int why = 0;
    int rc = dispatch_try_alloc(b, w->session, w->size, w->flags, &rep, &why);
    if (rc == GMB_E_NOMEM && why == DISPATCH_NO_ROOM)
      dispatch_nomem(b, w->session, dispatch_round(w->size), &rep);
    dispatch_answer_waiter(b, w, &rep);
    dispatch_unqueue(b, w);
  }
}

uint64_t gmb__dispatch_expire_waiters(struct gmb_broker *b, uint64_t now) {
  uint64_t next_in = UINT64_MAX;
  int expired = 0;
  struct gmb_waiter *w = b->wait_head, *next;
  for (; w; w = next) {
    next = w->next;
    if (w->deadline_ns <= now) {
      struct wire_reply rep;
      memset(&rep, 0, sizeof rep);
      rep.id = w->req_id;
      char sz[GMB_SIZE_BUFSZ];
      dispatch_fail(&rep, GMB_E_TIMEOUT, "no room for %s was freed in time",
                    gmb__size_format(w->size, sz, sizeof sz));
      dispatch_answer_waiter(b, w, &rep);
      expired += !w->after_compact;
      dispatch_unqueue(b, w);
    } else if (w->deadline_ns - now < next_in) {
      next_in = w->deadline_ns - now;
    }
  }
  /* A waiter that gave up may have been holding back smaller ones. */
  if (expired) gmb__dispatch_serve_waiters(b);
  return next_in;
}

void gmb__dispatch_drop_waiters(struct gmb_broker *b, struct gmb_session *s) {
  int dropped = 0;
  struct gmb_waiter *w = b->wait_head, *next;
  for (; w; w = next) {
    next = w->next;
    if (w->session == s) {
      dropped += !w->after_compact;
      dispatch_unqueue(b, w);
    }
  }
  /* Its requests may have been holding back others'. */
  if (dropped) gmb__dispatch_serve_waiters(b);
}

/* --- free, stats, segment ------------------------------------------- */

static int dispatch_free(struct gmb_broker *b, struct gmb_session *s,
                         const struct wire_request *req,
                         struct wire_reply *rep) {
  struct gmb_alloc_info info;
  /* Another session's id gets the same answer as no id at all, so ids
   * tell a client nothing about other tenants. */
  if (gmb__pool_find(b->pool, req->u.free.id, &info) != 0 || info.owner != s) {
    dispatch_fail(rep, GMB_E_NOENT, "no allocation %" PRIu64 " in this "
                  "session", req->u.free.id);
    return 1;
  }
  gmb__defrag_forget(b, req->u.free.id);
  if (info.tag) gmb__locktab_slot_free(s->lt, info.tag - 1);
  int rc = gmb__pool_free(b->pool, req->u.free.id, &info);
  GMB_ASSERT(rc == 0 && "an allocation found a moment ago cannot be freed");
  b->pool_ops++;
  gmb__tenant_uncharge(s->tenant, info.size);
  s->allocations--;
  rep->status = 0;
  gmb__dispatch_serve_waiters(b);
  return 1;
}

static int dispatch_stats(struct gmb_broker *b, struct gmb_session *s,
                          struct wire_reply *rep) {
  (void)b;
  struct gmb_arena_stats as;
  gmb__pool_arena_stats(s->tenant->arena, &as);
  rep->kind = WIRE_STATS;
  rep->u.stats.quota = s->tenant->quota;
  rep->u.stats.used = s->tenant->used;
  rep->u.stats.peak = s->tenant->peak;
  rep->u.stats.segments = as.segment_bytes;
  return 1;
}

static int dispatch_segment(struct gmb_broker *b, struct gmb_session *s,
                            const struct wire_request *req,
                            struct wire_reply *rep) {
  void *tag = NULL;
  const struct gmb_dseg *d =
      gmb__pool_segment(b->pool, req->u.segment.segment, &tag);
  if (d == NULL || tag != s->tenant) {
    dispatch_fail(rep, GMB_E_NOENT, "no segment %" PRIu64 " for tenant %s",
                  req->u.segment.segment, s->tenant->name);
    return 1;
  }
  if (gmb__session_seg_seen(s, d->id) < 0) {
    dispatch_fail(rep, GMB_E_SYSTEM, "out of host memory");
    return 1;
  }
  dispatch_grant(b, s, d);
  rep->kind = WIRE_SEGMENT;
  dispatch_handle(&rep->u.segment, d);
  return 1;
}

void gmb__dispatch_retire(void *ctx, const struct gmb_dseg *seg,
                          void *arena_tag) {
  struct gmb_broker *b = ctx;
  struct gmb_tenant *t = arena_tag;
  if (b == NULL || t == NULL) return;
  if (b->tenants) gmb__tenant_segment_retired(b->tenants, t, seg->size);
  for (struct gmb_session *s = t->sessions; s; s = s->tenant_next) {
    if (!gmb__session_seg_forget(s, seg->id)) continue;
    struct wire_reply ev;
    memset(&ev, 0, sizeof ev);
    ev.kind = WIRE_EVENT;
    ev.u.event.kind = WIRE_EVENT_SEGMENT_RETIRED;
    ev.u.event.segment = seg->id;
    dispatch_answer(b, s, &ev);
    /* Two-step retirement: a cuda segment is freed only once s closed
     * it (SegmentClosed) or ended; the host device ignores this. */
    if (gmb__device_seg_hold(b->dev, seg->id, s->id) != 0)
      log_error("segment %llu: out of host memory recording that session "
                "%llu holds it: it is freed at once",
                (unsigned long long)seg->id, (unsigned long long)s->id);
  }
}

/* --- entry ------------------------------------------------------------ */

int gmb__dispatch(struct gmb_broker *b, const struct gmb_peer *peer,
                  const struct wire_request *req, struct wire_reply *rep) {
  memset(rep, 0, sizeof *rep);
  rep->id = req->id;
  struct gmb_session *s =
      gmb__session_find(b->sessions, peer->rid, peer->rid_len);
  if (req->kind == WIRE_HELLO) return dispatch_hello(b, s, peer, req, rep);
  if (s == NULL) {
    dispatch_fail(rep, GMB_E_CONN, "no session on this connection: say "
                  "Hello first (did the broker restart?)");
    return 1;
  }
  s->last_seen_ns = gmb__now_ns();
  /* The client maps its lock table before its first request after Hello,
   * so the name can go: nobody else can open it from now on. */
  if (!s->lt_unlinked) {
    gmb__locktab_unlink(s->lt);
    s->lt_unlinked = 1;
  }
  switch (req->kind) {
    case WIRE_ALLOC:
      return dispatch_alloc(b, s, req, rep);
    case WIRE_FREE:
      return dispatch_free(b, s, req, rep);
    case WIRE_STATS:
      return dispatch_stats(b, s, rep);
    case WIRE_SEGMENT:
      return dispatch_segment(b, s, req, rep);
    case WIRE_HEARTBEAT:
      return 0;
    case WIRE_SEGMENT_CLOSED:
      /* Only the cuda device waits for these before freeing a retired
       * segment (the host device freed it already); the free makes room. */
      if (gmb__device_seg_closed(b->dev, req->u.segment.segment, s->id))
        gmb__dispatch_serve_waiters(b);
      return 0;
    case WIRE_BYE:
      gmb__session_end(b, s, "said goodbye");
      return 1;
    default:
      dispatch_fail(rep, GMB_E_PROTO, "%s is not a client request",
                    gmb__wire_kind_name(req->kind));
      return 1;
  }
}
