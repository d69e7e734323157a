/*
 * waitq.c - allocations waiting for memory (waitq.h has the serving rules).
 *
 * A doubly linked list in serving order; inserting walks from the tail,
 * where a new waiter of equal priority ends up, so the common case is
 * O(1).  Serving walks the whole list, since a waiter within its
 * reservation may be served behind a blocked one.
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

int gmb__waitq_add(struct gmb_broker *b, struct gmb_session *s,
                   uint64_t req_id, uint64_t size, uint32_t flags,
                   int timeout_ms, int after_compact) {
  struct gmb_waitq *q = &b->waitq;
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
  s->tenant->waiting++;
  if (after_compact) {
    q->after_compact++;
    log_debug("session %" PRIu64 ": %" PRIu64 " bytes wait for a "
              "compaction run", s->id, size);
  } else {
    char sz[GMB_SIZE_BUFSZ];
    log_info("session %" PRIu64 " (tenant %s, priority %d): %s wait for "
             "memory (timeout %d ms); %zu requests waiting",
             s->id, s->tenant->name, w->priority,
             gmb__size_format(size, sz, sizeof sz), timeout_ms, q->n);
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
  GMB_ASSERT(w->session->tenant->waiting > 0 && "waiting count drifted");
  w->session->tenant->waiting--;
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
  uint64_t next_in = UINT64_MAX;
  for (w = b->waitq.head; w; w = w->next)
    if (w->deadline_ns != UINT64_MAX && w->deadline_ns - now < next_in)
      next_in = w->deadline_ns - now;
  return next_in;
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
