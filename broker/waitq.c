/*
 * waitq.c - allocations waiting for memory (waitq.h has the serving rules).
 *
 * A doubly linked list in serving order; inserting walks from the tail,
 * where a new waiter of equal priority ends up, so the common case is
 * O(1).  Serving walks the list behind a blocked waiter only while a
 * waiter there could still be served (a tenant has a reservation, or a
 * request waits for a compaction run); a request that joins tries the
 * head and itself only (gmb__waitq_joined); the earliest deadline is
 * cached, so the loop's timer does not walk the queue either.  Waiters
 * are capped per session and per tenant (max_waiters_per_*).
 */
#include "waitq.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "alloc.h"
#include "gmb.h"
#include "log.h"
#include "observe.h"
#include "reply.h"
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

static struct gmb_log_rl waitq_rl_add, waitq_rl_limit;

int gmb__waitq_add(struct gmb_broker *b, struct gmb_session *s,
                   uint64_t req_id, uint64_t size, uint32_t flags,
                   int timeout_ms, int after_compact) {
  struct gmb_waitq *q = &b->waitq;
  if (s->waiting >= b->cfg.max_waiters_per_session ||
      s->tenant->waiting >= b->cfg.max_waiters_per_tenant) {
    if (gmb__log_allow(&waitq_rl_limit))
      log_warn("session %" PRIu64 " (tenant %s): a request not queued: %u "
               "of the session's and %" PRIu64 " of the tenant's wait "
               "already%s", s->id, s->tenant->name, s->waiting,
               s->tenant->waiting, gmb__log_suppressed(&waitq_rl_limit));
    return GMB_E_LIMIT;
  }
  struct gmb_waiter *w = calloc(1, sizeof *w);
  if (w == NULL) return GMB_E_SYSTEM;
  w->session = s;
  w->req_id = req_id;
  w->size = size;
  w->flags = flags;
  w->after_compact = after_compact;
  w->queued_ns = gmb__now_ns();
  w->deadline_ns = timeout_ms <= 0
                       ? UINT64_MAX
                       : w->queued_ns + (uint64_t)timeout_ms * GMB_NS_PER_MS;
  w->priority = s->tenant->priority;
  /* After the last waiter of equal or higher priority: priority first,
   * then arrival. */
  struct gmb_waiter *after = q->tail;
  while (after && after->priority < w->priority) after = after->prev;
  w->prev = after;
  w->next = after ? after->next : q->head;
  if (w->next)
    w->next->prev = w;
  else
    q->tail = w;
  if (after)
    after->next = w;
  else
    q->head = w;
  q->n++;
  q->last_added = w;
  s->tenant->waiting++;
  s->waiting++;
  if (w->deadline_ns < q->next_deadline_ns)
    q->next_deadline_ns = w->deadline_ns;
  if (after_compact) {
    q->after_compact++;
    log_debug("session %" PRIu64 ": %" PRIu64 " bytes wait for a "
              "compaction run", s->id, size);
  } else if (gmb__log_allow(&waitq_rl_add)) {
    char sz[GMB_SIZE_BUFSZ];
    log_info("session %" PRIu64 " (tenant %s, priority %d): %s wait for "
             "memory (timeout %d ms); %zu requests waiting%s",
             s->id, s->tenant->name, w->priority,
             gmb__size_format(size, sz, sizeof sz), timeout_ms, q->n,
             gmb__log_suppressed(&waitq_rl_add));
  }
  return 0;
}

int gmb__waitq_ahead(const struct gmb_broker *b, int priority) {
  for (const struct gmb_waiter *w = b->waitq.head;
       w && w->priority >= priority; w = w->next)
    if (!w->after_compact) return 1;
  return 0;
}

static void waitq_remove(struct gmb_broker *b, struct gmb_waiter *w) {
  struct gmb_waitq *q = &b->waitq;
  if (w->after_compact) q->after_compact--;
  if (q->last_added == w) q->last_added = NULL;
  GMB_ASSERT(w->session->tenant->waiting > 0 && w->session->waiting > 0 &&
             "waiting count drifted");
  w->session->tenant->waiting--;
  w->session->waiting--;
  if (w->prev)
    w->prev->next = w->next;
  else
    q->head = w->next;
  if (w->next)
    w->next->prev = w->prev;
  else
    q->tail = w->prev;
  q->n--;
  free(w);
}

/* A waiter is answered at last: its reply, and its time since it came in
 * the metrics (the loop counts only the requests it answers at once). */
static void waitq_answer(struct gmb_broker *b, struct gmb_waiter *w,
                         struct wire_reply *rep) {
  gmb__reply_to_session(b, w->session, rep);
  gmb__observe_request(b->observe, WIRE_ALLOC, rep->status,
                       gmb__now_ns() - w->queued_ns);
  waitq_remove(b, w);
}

void gmb__waitq_serve(struct gmb_broker *b) {
  if (b->closing) return; /* the waiters are dropped with their sessions */
  int blocked = 0; /* a waiter ahead did not fit: hold back the rest */
  struct gmb_waiter *w = b->waitq.head, *next;
  for (; w; w = next) {
    next = w->next;
    /* Behind a blocked waiter only requests within their reservation (or
     * held for a compaction run) may be served: with none of either, the
     * rest of the queue need not be looked at. */
    if (blocked && b->waitq.after_compact == 0 &&
        gmb__tenants_reserving(b->tenants) == 0)
      break;
    struct gmb_tenant *t = w->session->tenant;
    if (blocked && !w->after_compact &&
        !gmb__tenant_within_reserve(t, gmb__alloc_round(w->size)))
      continue;
    struct wire_reply rep;
    memset(&rep, 0, sizeof rep);
    rep.id = w->req_id;
    enum gmb_nomem_why why;
    int rc = gmb__alloc_try(b, w->session, w->size, w->flags, &rep, &why);
    if (rc == GMB_E_NOMEM) {
      if (!w->after_compact) blocked = 1;
      continue;
    }
    waitq_answer(b, w, &rep);
  }
}

/* Tries waiter w: 1 when it was answered (served, or refused other than
 * for room), 0 when it still does not fit. */
static int waitq_try(struct gmb_broker *b, struct gmb_waiter *w) {
  struct wire_reply rep;
  memset(&rep, 0, sizeof rep);
  rep.id = w->req_id;
  enum gmb_nomem_why why;
  int rc = gmb__alloc_try(b, w->session, w->size, w->flags, &rep, &why);
  if (rc == GMB_E_NOMEM) return 0;
  waitq_answer(b, w, &rep);
  return 1;
}

void gmb__waitq_joined(struct gmb_broker *b) {
  struct gmb_waitq *q = &b->waitq;
  struct gmb_waiter *w = q->last_added;
  if (b->closing || w == NULL) return;
  q->last_added = NULL;
  /* Every event that gives memory back serves the whole queue, so the
   * waiters ahead of w did not fit when it came, and nothing changed since
   * but w's arrival: unless the head fits now (then serve everyone), only
   * w may be served, and only within its own reservation, as
   * gmb__waitq_serve would do.  O(1) rather than a walk per request. */
  struct gmb_waiter *head = q->head;
  while (head && head->after_compact) head = head->next;
  if (head == NULL) return;
  if (head == w) {
    waitq_try(b, w);
    return;
  }
  if (waitq_try(b, head)) {
    gmb__waitq_serve(b);
    return;
  }
  if (gmb__tenant_within_reserve(w->session->tenant, gmb__alloc_round(w->size)))
    waitq_try(b, w);
}

void gmb__waitq_compaction_over(struct gmb_broker *b) {
  if (b->waitq.after_compact == 0) return;
  struct gmb_waiter *w = b->waitq.head, *next;
  for (; w; w = next) {
    next = w->next;
    if (!w->after_compact) continue;
    struct wire_reply rep;
    memset(&rep, 0, sizeof rep);
    rep.id = w->req_id;
    enum gmb_nomem_why why;
    int rc = gmb__alloc_try(b, w->session, w->size, w->flags, &rep, &why);
    if (rc == GMB_E_NOMEM && why == GMB_NOMEM_NO_ROOM)
      gmb__alloc_explain(b, w->session, gmb__alloc_round(w->size), &rep);
    waitq_answer(b, w, &rep);
  }
}

uint64_t gmb__waitq_expire(struct gmb_broker *b, uint64_t now) {
  /* The loop asks at every round: before the earliest deadline there is
   * nothing to do and no need to walk the queue.  The cached deadline may
   * be early (its waiter was served meanwhile): then one walk finds the
   * true one. */
  if (b->waitq.next_deadline_ns > now)
    return b->waitq.next_deadline_ns == UINT64_MAX
               ? UINT64_MAX
               : b->waitq.next_deadline_ns - now;
  int expired = 0;
  struct gmb_waiter *w = b->waitq.head, *next;
  for (; w; w = next) {
    next = w->next;
    if (w->deadline_ns > now) continue;
    struct wire_reply rep;
    memset(&rep, 0, sizeof rep);
    rep.id = w->req_id;
    char sz[GMB_SIZE_BUFSZ];
    gmb__reply_fail(&rep, GMB_E_TIMEOUT, "no room for %s was freed in time",
                    gmb__size_format(w->size, sz, sizeof sz));
    expired += !w->after_compact;
    waitq_answer(b, w, &rep);
  }
  /* A waiter that gave up may have been holding back smaller ones. */
  if (expired) gmb__waitq_serve(b);
  /* The next deadline among those still waiting (none: no deadline). */
  uint64_t next_at = UINT64_MAX;
  for (w = b->waitq.head; w; w = w->next)
    if (w->deadline_ns < next_at) next_at = w->deadline_ns;
  b->waitq.next_deadline_ns = next_at;
  return next_at == UINT64_MAX ? UINT64_MAX : next_at - now;
}

void gmb__waitq_drop_session(struct gmb_broker *b, struct gmb_session *s) {
  int dropped = 0;
  struct gmb_waiter *w = b->waitq.head, *next;
  for (; w; w = next) {
    next = w->next;
    if (w->session == s) {
      dropped += !w->after_compact;
      waitq_remove(b, w);
    }
  }
  /* Its requests may have been holding back others'. */
  if (dropped) gmb__waitq_serve(b);
}
