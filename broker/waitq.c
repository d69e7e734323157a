/*
 * waitq.c - allocations waiting for memory (waitq.h has the serving rules).
 *
 * A doubly linked list in serving order; inserting walks from the tail,
 * where a new waiter of equal priority ends up, so the common case is
 * O(1).  Serving walks the list behind a blocked waiter only while a
 * waiter there could still be served (a tenant has a reservation, or a
 * request waits for a compaction run); a request that joins tries the
 * head and itself only (gmb__waitq_joined).  The loop's timer does not
 * walk the queue either: the waiters with a deadline are also in a
 * red-black tree by (deadline, arrival), and the ones that may still block
 * others in a list by arrival (when each stops blocking: it came
 * WAITQ_BLOCK_MS before), so finding the next time costs O(log n) and
 * expiring O(log n) per waiter due, however many wait.  The waiters that
 * block now are in a third tree, in the queue's order (q->blocking), so
 * that a request finds the first of them (gmb__waitq_ahead, _joined) in
 * O(log n) however many unblocked ones are ahead.  A serving
 * pass tries a tenant's waiters that cannot fit once, not each of them
 * (the memo, below).  Waiters
 * are capped per session and per tenant (max_waiters_per_*).
 *
 * A request may also be held while other sessions' caches are asked to
 * give memory back (reclaim.c): `held` until hold_until_ns at most.  One
 * that did not ask to wait (`nowait`) never blocks others, like a waiter
 * of a compaction run; when its hold ends it falls through to what it
 * would have met without the hold (a compaction run, or GMB_E_NOMEM).
 * One held for its tenant's quota (`quota`: the tenant's other sessions'
 * caches hold the bytes it lacks) never blocks others either, whether it
 * asked to wait or not: what it waits for is its own tenant's memory, not
 * the device's.  While its quota is still passed it is skipped without a
 * call into the pool, and no refusal is counted (gmb__tenant_over); it is
 * answered GMB_E_QUOTA only when its hold ends and the bytes did not come.
 * A Vmm increase (GMB__ALLOC_VMM: `size` more bytes of its session's VMM
 * memory) is held the same ways, never asked to wait: it is tried with
 * gmb__alloc_vmm instead of the pool, and answered (served or refused
 * with the reason) when its hold ends.
 * Invariants: held counts the waiters with `held` set, held_nowait those of
 * them with `nowait`, held_quota those with `quota`, held_job those with
 * `job` (only a held waiter has it: its hold's end clears it); the job's
 * waiters are in q->jobs (the queue's order: job_first is its first, and
 * job_priority its priority) and in the list from job_oldest (arrival,
 * which is the order of their job bounds), job_asked and job_want are
 * their sums, and each tenant's job_n and job_bytes count its own, the
 * tenants with any linked from job_tenants (gmb__waitq_check recounts
 * them all).  Each try of a waiter sets q->trying for the fence
 * (gmb__alloc_fence); a try the fence refused is no memo (below).
 *
 * A blocking waiter blocks for WAITQ_BLOCK_MS after it came (waitq.h), then
 * it is `unblocked` for good.  The flag is set when a serve or the
 * deadline timer finds it past that age; the blockers list (broker.h)
 * makes the timer come when the first one is due (only while someone
 * waits behind it: a lone waiter holds no one back).
 * Invariants: the blockers list holds, in arrival order, every waiter
 * neither `after_compact` nor `unblocked`, except a held one that does not
 * block (nowait or quota) whose time came while it was held: the timer
 * takes it off, and the end of its hold puts it back first (it is older
 * than all there).  `timed` says which tree a waiter is in: the queue's
 * deadlines (every waiter with a deadline but those being expired), or
 * the timer's own list of those due.  Each session links its own waiters
 * (s->waiters), so that its end drops them without a walk of the queue,
 * and the held waiters are in a tree of their own in the queue's order
 * (q->holds), so that a hold's end looks at those only.
 */
#include "waitq.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "alloc.h"
#include "gmb.h"
#include "log.h"
#include "offload.h"
#include "rbtree.h"
#include "observe.h"
#include "reply.h"
#include "util.h"

/* How long a waiter that does not fit may hold back the ones behind it. */
#define WAITQ_BLOCK_MS 1000
#define WAITQ_BLOCK_NS ((uint64_t)WAITQ_BLOCK_MS * GMB_NS_PER_MS)

struct gmb_waiter {
  struct gmb_waiter *next, *prev;
  RB_ENTRY(gmb_waiter) tlink; /* in the deadlines, or those due */
  RB_ENTRY(gmb_waiter) hlink; /* in q->blocking */
  RB_ENTRY(gmb_waiter) olink; /* in q->holds, while held */
  RB_ENTRY(gmb_waiter) jlink; /* in q->jobs, while job */
  struct gmb_waiter *jnext, *jprev; /* q->job_oldest's list, while job */
  int in_blocking;            /* in q->blocking */
  struct gmb_waiter *bnext, *bprev; /* in the blockers list */
  struct gmb_waiter *snext, *sprev; /* in its session's (s->waiters) */
  uint64_t seq;         /* arrival number: the queue's order is (priority
                           descending, seq) */
  int timed;            /* WAITQ_IN_* */
  int blocker;          /* in the blockers list */
  struct gmb_session *session;
  uint64_t req_id;
  uint64_t size;
  uint32_t flags;
  uint64_t deadline_ns; /* UINT64_MAX: for ever */
  uint64_t queued_ns;   /* when it came, for the latency metrics */
  int after_compact;    /* answer GMB_E_NOMEM when the run ends */
  uint64_t run;         /* the compaction run that tries for it; 0: none */
  int held;             /* held while caches are asked back */
  int nowait;           /* held: the request did not ask to wait */
  int quota;            /* held (or was) for its tenant's quota, not for
                           the device's room */
  uint64_t hold_until_ns; /* held: the hold ends then at the latest */
  int job;              /* held for the broker's offload job (reclaim.c):
                           its hold ends when the job lets it go, or at
                           hold_until_ns, not when the asks settle */
  uint64_t plain_until_ns; /* job: the hold's bound without the job */
  uint64_t job_asked;   /* job: bytes the caches were asked for it */
  uint64_t job_want;    /* job: the device room it takes (q->job_want) */
  uint64_t job_until_ns; /* job: the job lets it go then at the latest */
  int priority;         /* its tenant's, when it came */
  int unblocked;        /* blocked others for WAITQ_BLOCK_MS: no longer */
};

/* A waiter that never holds back those behind it: it did not ask to wait
 * (held for a compaction run, or while caches are asked back), or it is
 * held for its tenant's quota. */
static int waitq_nonblocking(const struct gmb_waiter *w) {
  return w->after_compact || w->unblocked ||
         (w->held && (w->nowait || w->quota));
}

/* When w stops holding back the waiters behind it. */
static uint64_t waitq_block_end(const struct gmb_waiter *w) {
  return w->queued_ns + WAITQ_BLOCK_NS;
}

/* Which of the timer's trees a waiter is in. */
enum { WAITQ_IN_NONE = 0, WAITQ_IN_DEADLINES, WAITQ_IN_DUE };

/* The deadlines: by deadline, then arrival. */
static int waitq_deadline_cmp(const struct gmb_waiter *a,
                              const struct gmb_waiter *b) {
  if (a->deadline_ns != b->deadline_ns)
    return a->deadline_ns < b->deadline_ns ? -1 : 1;
  return a->seq < b->seq ? -1 : a->seq > b->seq;
}
RB_GENERATE_STATIC(gmb_waiter_tree, gmb_waiter, tlink, waitq_deadline_cmp)

/* Those due at one expiry, in the queue's order, so that they are tried
 * and answered as a walk of the queue would. */
RB_HEAD(waitq_due_tree, gmb_waiter);
static int waitq_order_cmp(const struct gmb_waiter *a,
                           const struct gmb_waiter *b) {
  if (a->priority != b->priority) return a->priority > b->priority ? -1 : 1;
  return a->seq < b->seq ? -1 : a->seq > b->seq;
}
RB_GENERATE_STATIC(waitq_due_tree, gmb_waiter, tlink, waitq_order_cmp)

/* The waiters that block now, in the queue's order (q->blocking). */
RB_GENERATE_STATIC(gmb_waiter_order, gmb_waiter, hlink, waitq_order_cmp)

/* The held waiters, in the queue's order (q->holds). */
RB_GENERATE_STATIC(gmb_waiter_holds, gmb_waiter, olink, waitq_order_cmp)

/* Those held for the offload job, in the queue's order (q->jobs). */
RB_GENERATE_STATIC(gmb_waiter_jobs, gmb_waiter, jlink, waitq_order_cmp)

/* Puts w in q->blocking or takes it out, as waitq_nonblocking(w) now says:
 * called wherever a field it reads changes, and as w leaves. */
static void waitq_blocking_sync(struct gmb_waitq *q, struct gmb_waiter *w,
                                int gone) {
  int want = !gone && !waitq_nonblocking(w);
  if (want == w->in_blocking) return;
  if (want)
    RB_INSERT(gmb_waiter_order, &q->blocking, w);
  else
    RB_REMOVE(gmb_waiter_order, &q->blocking, w);
  w->in_blocking = want;
}

/* The first waiter in the queue that blocks now; NULL: none. */
static struct gmb_waiter *waitq_first_blocking(struct gmb_waitq *q) {
  return RB_MIN(gmb_waiter_order, &q->blocking);
}

/* w may block others (now, or once its hold ends): the timer must come
 * when it stops.  At the tail: it is the youngest. */
static void waitq_blocker_add(struct gmb_waitq *q, struct gmb_waiter *w) {
  w->blocker = 1;
  w->bnext = NULL;
  w->bprev = q->blockers_tail;
  if (q->blockers_tail)
    q->blockers_tail->bnext = w;
  else
    q->blockers_head = w;
  q->blockers_tail = w;
}

/* w blocks no one any more (unblocked, or a compaction run's, or gone). */
static void waitq_blocker_drop(struct gmb_waitq *q, struct gmb_waiter *w) {
  if (!w->blocker) return;
  if (w->bprev)
    w->bprev->bnext = w->bnext;
  else
    q->blockers_head = w->bnext;
  if (w->bnext)
    w->bnext->bprev = w->bprev;
  else
    q->blockers_tail = w->bprev;
  w->blocker = 0;
  w->bnext = w->bprev = NULL;
}

/* w's hold ended after its time to block did: it may block now, and is
 * due at once.  At the head: it came before every waiter there. */
static void waitq_blocker_again(struct gmb_waitq *q, struct gmb_waiter *w) {
  if (w->blocker || w->after_compact || w->unblocked) return;
  GMB_ASSERT((q->blockers_head == NULL ||
              q->blockers_head->queued_ns >= w->queued_ns) &&
             "the blockers list is in arrival order");
  w->blocker = 1;
  w->bprev = NULL;
  w->bnext = q->blockers_head;
  if (q->blockers_head)
    q->blockers_head->bprev = w;
  else
    q->blockers_tail = w;
  q->blockers_head = w;
}

/* w stops blocking others for good. */
static void waitq_unblock(struct gmb_waitq *q, struct gmb_waiter *w) {
  w->unblocked = 1;
  waitq_blocker_drop(q, w);
  waitq_blocking_sync(q, w, 0);
}

/* The bytes w asks of its quota: a Vmm increase's are exact. */
static uint64_t waitq_bytes(const struct gmb_waiter *w) {
  return w->flags & GMB__ALLOC_VMM ? w->size : gmb__alloc_round(w->size);
}

/* --- the offload job's sums ---------------------------------------------- */

/* w is held for the job from now: it joins the job's sums (q's and its
 * tenant's), the job's tree and its list by arrival. */
static void waitq_job_mark(struct gmb_waitq *q, struct gmb_waiter *w) {
  struct gmb_tenant *t = w->session->tenant;
  GMB_ASSERT((q->job_youngest == NULL ||
              q->job_youngest->job_until_ns <= w->job_until_ns) &&
             "the job's bounds come in arrival order");
  w->job = 1;
  q->held_job++;
  q->job_asked += w->job_asked;
  q->job_want += w->job_want;
  if (t->job_n++ == 0) {
    t->job_prev = NULL;
    t->job_next = q->job_tenants;
    if (q->job_tenants) q->job_tenants->job_prev = t;
    q->job_tenants = t;
  }
  t->job_bytes += waitq_bytes(w);
  RB_INSERT(gmb_waiter_jobs, &q->jobs, w);
  if (q->job_first == NULL || waitq_order_cmp(w, q->job_first) < 0) {
    q->job_first = w;
    q->job_priority = w->priority;
  }
  w->jnext = NULL;
  w->jprev = q->job_youngest;
  if (q->job_youngest)
    q->job_youngest->jnext = w;
  else
    q->job_oldest = w;
  q->job_youngest = w;
}

/* w leaves the job's sums (let go, its hold over, or gone). */
static void waitq_job_drop(struct gmb_waitq *q, struct gmb_waiter *w) {
  struct gmb_tenant *t = w->session->tenant;
  const uint64_t bytes = waitq_bytes(w);
  GMB_ASSERT(w->job && q->held_job > 0 && q->job_asked >= w->job_asked &&
             q->job_want >= w->job_want && t->job_n > 0 &&
             t->job_bytes >= bytes && "job sums drifted");
  if (q->job_first == w) {
    q->job_first = RB_NEXT(gmb_waiter_jobs, &q->jobs, w);
    q->job_priority = q->job_first ? q->job_first->priority : 0;
  }
  RB_REMOVE(gmb_waiter_jobs, &q->jobs, w);
  if (w->jprev)
    w->jprev->jnext = w->jnext;
  else
    q->job_oldest = w->jnext;
  if (w->jnext)
    w->jnext->jprev = w->jprev;
  else
    q->job_youngest = w->jprev;
  w->jnext = w->jprev = NULL;
  q->held_job--;
  q->job_asked -= w->job_asked;
  q->job_want -= w->job_want;
  t->job_bytes -= bytes;
  if (--t->job_n == 0) {
    if (t->job_prev)
      t->job_prev->job_next = t->job_next;
    else
      q->job_tenants = t->job_next;
    if (t->job_next) t->job_next->job_prev = t->job_prev;
    t->job_next = t->job_prev = NULL;
  }
  if (q->held_job == 0) q->job_kept = 0; /* the fence is down */
  w->job = 0;
}

/* A request held for its quota that its quota still refuses: nothing to
 * try (and no refusal to count) until its tenant's memory comes back. */
static int waitq_quota_blocked(const struct gmb_waiter *w) {
  return w->held && w->quota &&
         gmb__tenant_over(w->session->tenant, waitq_bytes(w));
}

/* Tries w once: an allocation (gmb__alloc_try) or a Vmm increase
 * (gmb__alloc_vmm, whose refusals come with their message). */
static int waitq_attempt(struct gmb_broker *b, struct gmb_waiter *w,
                         struct wire_reply *rep, enum gmb_nomem_why *why) {
  struct gmb_waitq *q = &b->waitq;
  memset(rep, 0, sizeof *rep);
  rep->id = w->req_id;
  q->tries++;
  /* The room fenced for the job (gmb__alloc_fence) lets its own requests
   * through, and those ahead of its first in the queue's order (a higher
   * priority, or one that came first at its priority): the queue serves
   * them first anyway. */
  q->trying = 1;
  q->trying_passes = gmb__waitq_passes_fence(b, w);
  int rc;
  if (w->flags & GMB__ALLOC_VMM) {
    rc = gmb__alloc_vmm(b, w->session, w->size, rep, why);
  } else {
    /* An allocation, or a Lock bringing an offloaded one back. */
    const uint32_t queued =
        w->flags & GMB__ALLOC_RESTORE ? GMB__ALLOC_QUEUED : 0;
    rc = gmb__offload_try(b, w->session, w->size, w->flags | queued, rep,
                          why);
  }
  q->trying = q->trying_passes = 0;
  return rc;
}

/*
 * The memo of a serving pass.  Within one pass of gmb__waitq_serve nothing
 * is freed (waiters are only served or answered), so the device's room and
 * the free ranges of a tenant's arena only shrink.  When a plain
 * allocation of tenant t found no room in the pool, so does any later one
 * of t in the same pass that is at least as large: a small one (whatever
 * its class: with the device full the pool looks in both) needs a free
 * range at least as large or a new small segment; a large one needs a new
 * segment of its pages, then room for its tail; and no room for a small
 * segment is no room for any segment.  Such waiters are counted as not
 * fitting without a try, so that a tenant's many waiters that cannot fit
 * cost one try a pass, not one each.  Not for a request its quota now
 * refuses: that one is tried, and answered GMB_E_QUOTA.
 */
static int waitq_plain(const struct gmb_waiter *w) {
  return !(w->flags & (GMB__ALLOC_VMM | GMB__ALLOC_RESTORE | GMB__ALLOC_PAGES));
}

/* 1 when w cannot fit in this pass, by its tenant's memo. */
static int waitq_missed(const struct gmb_waitq *q, const struct gmb_waiter *w) {
  const struct gmb_tenant *t = w->session->tenant;
  if (t->wq_pass != q->pass || !waitq_plain(w)) return 0;
  const uint64_t need = gmb__alloc_round(w->size);
  const uint64_t pages = need & ~(GMB_SEGMENT_ALIGN - 1);
  int miss = t->wq_small && (need > GMB_POOL_SMALL_MAX || need >= t->wq_small);
  miss |= need > GMB_POOL_SMALL_MAX && t->wq_pages && pages >= t->wq_pages &&
          need - pages >= t->wq_tail;
  return miss && !gmb__tenant_over(t, need);
}

/* w found no room in the pool in this pass: its tenant's memo. */
static void waitq_miss_note(const struct gmb_waitq *q,
                            const struct gmb_waiter *w) {
  struct gmb_tenant *t = w->session->tenant;
  if (!waitq_plain(w)) return;
  if (t->wq_pass != q->pass) {
    t->wq_pass = q->pass;
    t->wq_small = t->wq_pages = t->wq_tail = 0;
  }
  const uint64_t need = gmb__alloc_round(w->size);
  if (need <= GMB_POOL_SMALL_MAX) {
    if (t->wq_small == 0 || need < t->wq_small) t->wq_small = need;
    return;
  }
  const uint64_t pages = need & ~(GMB_SEGMENT_ALIGN - 1);
  if (t->wq_pages == 0 ||
      (pages <= t->wq_pages && need - pages <= t->wq_tail)) {
    t->wq_pages = pages;
    t->wq_tail = need - pages;
  }
}

/* A quota hold may end early: none of the bytes it waits for are on their
 * way any more (every ask of its tenant's other sessions was answered, ran
 * out, or ended with its session). */
static int waitq_quota_settled(const struct gmb_waiter *w) {
  const struct gmb_session *s = w->session;
  return w->quota && s->tenant->cache_asked == s->ask_bytes;
}

/* The refusal of a request that was held for its quota and still passes
 * it: says so, and what is still on its way (Reply.asked_back). */
static void waitq_quota_note(struct gmb_broker *b, const struct gmb_waiter *w,
                             struct wire_reply *rep) {
  if (!w->quota || rep->status != GMB_E_QUOTA) return;
  size_t n = strlen(rep->message);
  snprintf(rep->message + n, sizeof rep->message - n, "; held while the "
           "tenant's other sessions were asked for cached memory, which did "
           "not free enough in time (trim_wait_ms %u)", b->cfg.trim_wait_ms);
  gmb__alloc_asked_back(w->session, rep);
}

static struct gmb_log_rl waitq_rl_add, waitq_rl_limit;

/* gmb__waitq_add and gmb__waitq_hold: hold_until_ns 0 is no hold. */
static int waitq_insert(struct gmb_broker *b, struct gmb_session *s,
                        uint64_t req_id, uint64_t size, uint32_t flags,
                        int timeout_ms, int after_compact,
                        uint64_t hold_until_ns, int hold_quota,
                        uint64_t job_until_ns, uint64_t job_asked,
                        uint64_t job_want) {
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
  w->seq = ++q->seq;
  if (hold_until_ns) {
    w->held = 1;
    w->nowait = timeout_ms == 0;
    w->quota = hold_quota;
    w->hold_until_ns = hold_until_ns;
    if (job_until_ns) {
      w->plain_until_ns = hold_until_ns;
      w->job_asked = job_asked;
      w->job_want = job_want;
      w->job_until_ns = job_until_ns;
      if (job_until_ns > hold_until_ns) w->hold_until_ns = job_until_ns;
      waitq_job_mark(q, w);
    }
    /* The first hold: no other's end can come before its. */
    if (q->held == 0 || w->hold_until_ns < q->next_hold_ns)
      q->next_hold_ns = w->hold_until_ns;
    q->held++;
    q->held_nowait += (size_t)w->nowait;
    q->held_quota += (size_t)w->quota;
    RB_INSERT(gmb_waiter_holds, &q->holds, w);
  }
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
  w->snext = s->waiters;
  if (s->waiters) s->waiters->sprev = w;
  s->waiters = w;
  s->tenant->waiting++;
  s->waiting++;
  if (w->deadline_ns != UINT64_MAX) {
    RB_INSERT(gmb_waiter_tree, &q->deadlines, w);
    w->timed = WAITQ_IN_DEADLINES;
  }
  if (!after_compact) waitq_blocker_add(q, w);
  waitq_blocking_sync(q, w, 0);
  if (after_compact) {
    q->after_compact++;
    log_debug("session %" PRIu64 ": %" PRIu64 " bytes wait for a "
              "compaction run", s->id, size);
  } else if (hold_until_ns) {
    log_debug("session %" PRIu64 ": %" PRIu64 " bytes held while caches "
              "are asked back (for %s)", s->id, size,
              hold_quota ? "its quota" : "room");
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

int gmb__waitq_add(struct gmb_broker *b, struct gmb_session *s,
                   uint64_t req_id, uint64_t size, uint32_t flags,
                   int timeout_ms, int after_compact) {
  return waitq_insert(b, s, req_id, size, flags, timeout_ms, after_compact,
                      0, 0, 0, 0, 0);
}

int gmb__waitq_hold(struct gmb_broker *b, struct gmb_session *s,
                    uint64_t req_id, uint64_t size, uint32_t flags,
                    int timeout_ms, uint64_t until_ns) {
  GMB_ASSERT(until_ns != 0 && "a hold ends some time");
  return waitq_insert(b, s, req_id, size, flags, timeout_ms, 0, until_ns, 0,
                      0, 0, 0);
}

int gmb__waitq_hold_job(struct gmb_broker *b, struct gmb_session *s,
                        uint64_t req_id, uint64_t size, uint32_t flags,
                        int timeout_ms, uint64_t until_ns,
                        uint64_t job_until_ns, uint64_t asked,
                        uint64_t want) {
  GMB_ASSERT(until_ns != 0 && job_until_ns != 0 && "a hold ends some time");
  return waitq_insert(b, s, req_id, size, flags, timeout_ms, 0, until_ns, 0,
                      job_until_ns, asked, want);
}

/* What the job's step and its let-go read of w. */
static int waitq_job_out(struct gmb_waiter *w, struct gmb_waitq_job *out) {
  memset(out, 0, sizeof *out);
  if (w == NULL) return 0;
  out->w = w;
  out->s = w->session;
  out->size = w->size;
  out->flags = w->flags;
  out->asked = w->job_asked;
  return 1;
}

int gmb__waitq_job_first(struct gmb_broker *b, struct gmb_waitq_job *out) {
  b->waitq.hold_visits += b->waitq.job_first != NULL;
  return waitq_job_out(b->waitq.job_first, out);
}

int gmb__waitq_job_due(struct gmb_broker *b, uint64_t now,
                       struct gmb_waitq_job *out) {
  struct gmb_waiter *w = b->waitq.job_oldest;
  if (w == NULL || w->job_until_ns > now) return 0;
  b->waitq.hold_visits++;
  return waitq_job_out(w, out);
}

/* w is no longer held for the job: an ordinary hold, to its own bound or
 * until_ns, the later. */
static void waitq_job_unmark(struct gmb_waitq *q, struct gmb_waiter *w,
                             uint64_t now, uint64_t until_ns) {
  GMB_ASSERT(w->job && w->held && "let go while not held for the job");
  waitq_job_drop(q, w);
  uint64_t until = w->plain_until_ns > until_ns ? w->plain_until_ns : until_ns;
  w->hold_until_ns = until > now ? until : now;
  /* Sooner than its job's bound: the next end may be its. */
  if (w->hold_until_ns < q->next_hold_ns) q->next_hold_ns = w->hold_until_ns;
}

void gmb__waitq_job_release(struct gmb_broker *b, struct gmb_waiter *w,
                            uint64_t now, uint64_t until_ns) {
  struct gmb_waitq *q = &b->waitq;
  if (w) {
    waitq_job_unmark(q, w, now, until_ns);
    return;
  }
  /* The job's own list: not the other holds. */
  while ((w = q->job_oldest) != NULL) waitq_job_unmark(q, w, now, until_ns);
}

int gmb__waitq_passes_fence(const struct gmb_broker *b,
                            const struct gmb_waiter *w) {
  const struct gmb_waiter *first = b->waitq.job_first;
  return w->job || (first && waitq_order_cmp(w, first) < 0);
}

void gmb__waitq_hold_until(struct gmb_broker *b, struct gmb_waiter *w,
                           uint64_t until_ns) {
  (void)b;
  GMB_ASSERT(w->held && !w->job && "an ordinary hold");
  /* Later: next_hold_ns may be early now, which costs a look, no more. */
  if (until_ns > w->hold_until_ns) w->hold_until_ns = until_ns;
}

int gmb__waitq_hold_quota(struct gmb_broker *b, struct gmb_session *s,
                          uint64_t req_id, uint64_t size, uint32_t flags,
                          int timeout_ms, uint64_t until_ns) {
  GMB_ASSERT(until_ns != 0 && "a hold ends some time");
  return waitq_insert(b, s, req_id, size, flags, timeout_ms, 0, until_ns, 1,
                      0, 0, 0);
}

int gmb__waitq_ahead(struct gmb_broker *b, int priority) {
  /* The first waiter that blocks has the highest priority of them. */
  struct gmb_waiter *w = waitq_first_blocking(&b->waitq);
  b->waitq.head_visits += w != NULL;
  return w && w->priority >= priority;
}

/* w's hold is over (it stays queued, or is about to be answered). */
static void waitq_unhold(struct gmb_waitq *q, struct gmb_waiter *w) {
  if (!w->held) return;
  GMB_ASSERT(q->held > 0 && q->held_nowait >= (size_t)w->nowait &&
             q->held_quota >= (size_t)w->quota && "held counts drifted");
  q->held--;
  q->held_nowait -= (size_t)w->nowait;
  q->held_quota -= (size_t)w->quota;
  if (w->job) waitq_job_drop(q, w);
  w->held = 0;
  RB_REMOVE(gmb_waiter_holds, &q->holds, w);
  /* Taken off the blockers while held (gmb__waitq_expire)? */
  waitq_blocker_again(q, w);
  waitq_blocking_sync(q, w, 0);
}

static void waitq_remove(struct gmb_broker *b, struct gmb_waiter *w) {
  struct gmb_waitq *q = &b->waitq;
  if (w->after_compact) q->after_compact--;
  waitq_unhold(q, w);
  if (q->last_added == w) q->last_added = NULL;
  if (w->flags & GMB__ALLOC_VMM) w->session->vmm_held = 0;
  if (w->flags & GMB__ALLOC_RESTORE) w->session->restore_id = 0;
  waitq_blocker_drop(q, w);
  waitq_blocking_sync(q, w, 1);
  GMB_ASSERT(w->timed != WAITQ_IN_DUE && "the timer answers those due");
  if (w->timed == WAITQ_IN_DEADLINES)
    RB_REMOVE(gmb_waiter_tree, &q->deadlines, w);
  GMB_ASSERT(w->session->tenant->waiting > 0 && w->session->waiting > 0 &&
             "waiting count drifted");
  w->session->tenant->waiting--;
  w->session->waiting--;
  if (w->sprev)
    w->sprev->snext = w->snext;
  else
    w->session->waiters = w->snext;
  if (w->snext) w->snext->sprev = w->sprev;
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
  gmb__observe_request(b->observe,
                       w->flags & GMB__ALLOC_VMM       ? WIRE_VMM
                       : w->flags & GMB__ALLOC_RESTORE ? WIRE_LOCK
                                                       : WIRE_ALLOC,
                       rep->status,
                       gmb__now_ns() - w->queued_ns);
  waitq_remove(b, w);
}

void gmb__waitq_serve(struct gmb_broker *b) {
  if (b->closing) return; /* the waiters are dropped with their sessions */
  struct gmb_waitq *q = &b->waitq;
  q->pass++; /* the tenants' memos of the last pass are stale now */
  int blocked = 0; /* a waiter ahead did not fit: hold back the rest */
  uint64_t now = 0;  /* read once, when a waiter that blocks is found */
  struct gmb_waiter *w = b->waitq.head, *next;
  for (; w; w = next) {
    next = w->next;
    /* Behind a blocked waiter only requests within their reservation (or
     * held for a compaction run) may be served: with none of either, the
     * rest of the queue need not be looked at. */
    if (blocked && b->waitq.after_compact == 0 &&
        b->waitq.held_nowait == 0 && b->waitq.held_quota == 0 &&
        gmb__tenants_reserving(b->tenants) == 0)
      break;
    if (waitq_quota_blocked(w)) continue;
    struct gmb_tenant *t = w->session->tenant;
    if (blocked && !waitq_nonblocking(w) &&
        !gmb__tenant_within_reserve(t, gmb__alloc_round(w->size)))
      continue;
    struct wire_reply rep;
    enum gmb_nomem_why why = GMB_NOMEM_NO_ROOM;
    int rc = GMB_E_NOMEM;
    if (!waitq_missed(q, w)) {
      /* A refusal by the job's fence (gmb__alloc_fence) is no memo for
       * the tenant's other waiters: the job's own requests pass it. */
      const uint64_t fenced = q->fenced;
      rc = waitq_attempt(b, w, &rep, &why);
      if (rc == GMB_E_NOMEM && why == GMB_NOMEM_NO_ROOM && q->fenced == fenced)
        waitq_miss_note(q, w);
    }
    if (rc == GMB_E_NOMEM) {
      if (!waitq_nonblocking(w)) {
        if (now == 0) now = gmb__now_ns();
        if (waitq_block_end(w) <= now)
          waitq_unblock(q, w); /* it has held the others back long enough */
        else
          blocked = 1;
      }
      continue;
    }
    waitq_quota_note(b, w, &rep);
    waitq_answer(b, w, &rep);
  }
}

/* Tries waiter w: 1 when it was answered (served, or refused other than
 * for room), 0 when it still does not fit (or, held for its quota, the
 * quota still refuses it). */
static int waitq_try(struct gmb_broker *b, struct gmb_waiter *w) {
  if (waitq_quota_blocked(w)) return 0;
  struct wire_reply rep;
  enum gmb_nomem_why why;
  int rc = waitq_attempt(b, w, &rep, &why);
  if (rc == GMB_E_NOMEM) return 0;
  waitq_quota_note(b, w, &rep);
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
  struct gmb_waiter *head = waitq_first_blocking(q);
  if (head == NULL) return;
  q->head_visits++;
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

void gmb__waitq_compact_run(struct gmb_broker *b, uint64_t run) {
  if (b->waitq.last_added) b->waitq.last_added->run = run;
}

void gmb__waitq_compaction_over(struct gmb_broker *b, uint64_t done,
                                gmb_waitq_compact_fn again, void *ctx) {
  struct gmb_waiter *w, *next;
  /* A request that joined a run part-way may have come after the passes
   * that would have made its room, or the run had no goal (an operator's,
   * or the background trigger's, which never move blocks to emptier
   * segments or make holes): it gets one run of its own, begun now,
   * before it is answered.  Each waiter at most once (its run is then the
   * new one), so a stream of requests cannot keep the others from their
   * answers for more than the next run. */
  if (again) {
    for (w = b->waitq.head; w; w = next) {
      next = w->next;
      if (w->run <= done || w->held) continue;
      if (w->after_compact && waitq_try(b, w)) continue;
      w->run = again(ctx, gmb__alloc_round(w->size), w->session->tenant);
      if (w->run == 0) w->run = done; /* none could start: answered below */
    }
  }
  if (b->waitq.after_compact == 0) return;
  for (w = b->waitq.head; w; w = next) {
    next = w->next;
    if (!w->after_compact || w->run > done) continue;
    struct wire_reply rep;
    memset(&rep, 0, sizeof rep);
    rep.id = w->req_id;
    enum gmb_nomem_why why;
    int rc = waitq_attempt(b, w, &rep, &why);
    if (rc == GMB_E_NOMEM && why == GMB_NOMEM_NO_ROOM)
      gmb__alloc_explain(b, w->session, gmb__alloc_round(w->size), &rep);
    waitq_answer(b, w, &rep);
  }
}

/* When the timer must come next: the earliest deadline, or the first
 * blocker's end when someone waits behind it (UINT64_MAX: never). */
static uint64_t waitq_due(struct gmb_waitq *q) {
  struct gmb_waiter *w = RB_MIN(gmb_waiter_tree, &q->deadlines);
  uint64_t due = w ? w->deadline_ns : UINT64_MAX;
  /* A blocker's time is up only for those behind it: none behind, no
   * reason to wake. */
  if (q->n >= 2 && q->blockers_head &&
      waitq_block_end(q->blockers_head) < due)
    due = waitq_block_end(q->blockers_head);
  return due;
}

uint64_t gmb__waitq_expire(struct gmb_broker *b, uint64_t now) {
  /* The loop asks at every round: before the first time due there is
   * nothing to do, and what is due is at the front of the deadlines and
   * of the blockers. */
  struct gmb_waitq *q = &b->waitq;
  uint64_t due = waitq_due(q);
  if (due > now) return due == UINT64_MAX ? UINT64_MAX : due - now;
  int expired = 0;
  struct gmb_waiter *w;
  while ((w = q->blockers_head) != NULL && waitq_block_end(w) <= now) {
    q->timer_visits++;
    /* Held, it blocks no one now: it comes back at the head of the list
     * when its hold ends (waitq_unhold), due at once. */
    if (waitq_nonblocking(w)) {
      waitq_blocker_drop(q, w);
      continue;
    }
    waitq_unblock(q, w);
    expired++;
  }
  /* Those past their deadline, taken out to be answered in the queue's
   * order. */
  struct waitq_due_tree due_now = RB_INITIALIZER(&due_now);
  while ((w = RB_MIN(gmb_waiter_tree, &q->deadlines)) != NULL &&
         w->deadline_ns <= now) {
    q->timer_visits++;
    RB_REMOVE(gmb_waiter_tree, &q->deadlines, w);
    RB_INSERT(waitq_due_tree, &due_now, w);
    w->timed = WAITQ_IN_DUE;
  }
  while ((w = RB_MIN(waitq_due_tree, &due_now)) != NULL) {
    RB_REMOVE(waitq_due_tree, &due_now, w);
    w->timed = WAITQ_IN_NONE;
    /* One more try first: a younger blocker may have held it back while
     * there was room for it.  (A waiter served here frees nothing, so
     * the others due stay queued.) */
    /* One held for the offload job fenced room for itself: gone, it may
     * have held back others too. */
    int blocking = !waitq_nonblocking(w) || w->job;
    if (waitq_try(b, w)) {
      expired += blocking;
      continue;
    }
    struct wire_reply rep;
    memset(&rep, 0, sizeof rep);
    rep.id = w->req_id;
    char sz[GMB_SIZE_BUFSZ];
    if (waitq_quota_blocked(w)) {
      /* Its deadline came first while its tenant's caches were asked: the
       * quota is what refuses it, not the device. */
      gmb__alloc_quota(w->session->tenant, gmb__alloc_round(w->size), &rep);
      waitq_quota_note(b, w, &rep);
    } else {
      gmb__reply_fail(&rep, GMB_E_TIMEOUT, "no room for %s was freed in time",
                      gmb__size_format(w->size, sz, sizeof sz));
    }
    expired += blocking;
    waitq_answer(b, w, &rep);
  }
  /* A waiter that gave up, or stopped blocking, may have been holding
   * back smaller ones. */
  if (expired) gmb__waitq_serve(b);
  due = waitq_due(q);
  if (due == UINT64_MAX) return UINT64_MAX;
  return due > now ? due - now : 0;
}

void gmb__waitq_drop_session(struct gmb_broker *b, struct gmb_session *s) {
  /* Its own waiters only, not the queue's: they are answered to no one,
   * so their order does not matter. */
  int dropped = 0;
  struct gmb_waiter *w;
  while ((w = s->waiters) != NULL) {
    GMB_ASSERT(w->session == s && "a waiter in another session's list");
    b->waitq.drop_visits++;
    dropped += !waitq_nonblocking(w) || w->job; /* or fenced room */
    waitq_remove(b, w);
  }
  /* Its requests may have been holding back others'. */
  if (dropped) gmb__waitq_serve(b);
}

uint64_t gmb__waitq_hold_over(struct gmb_broker *b, uint64_t now,
                              enum gmb_hold_end how,
                              gmb_waitq_compact_fn compact, void *ctx) {
  struct gmb_waitq *q = &b->waitq;
  if (q->held == 0) return UINT64_MAX;
  if (how == GMB_HOLD_DUE && q->next_hold_ns > now)
    return q->next_hold_ns - now;
  uint64_t total = 0, next_at = UINT64_MAX;
  gmb__pool_fragmentation(b->pool, NULL, &total);
  /* The held ones only, in the queue's order, not the whole queue. */
  struct gmb_waiter *w = RB_MIN(gmb_waiter_holds, &q->holds), *next;
  for (; w; w = next) {
    next = RB_NEXT(gmb_waiter_holds, &q->holds, w);
    q->hold_visits++;
    GMB_ASSERT(w->held && "an unheld waiter among the holds");
    int settled = how == GMB_HOLD_SETTLED && waitq_quota_settled(w);
    /* Held for the offload job: the asks settling do not end it; the job
     * lets it go, or its bound comes. */
    if (w->job && w->hold_until_ns > now) {
      if (w->hold_until_ns < next_at) next_at = w->hold_until_ns;
      continue;
    }
    if (how != GMB_HOLD_ALL && !settled && w->hold_until_ns > now) {
      if (w->hold_until_ns < next_at) next_at = w->hold_until_ns;
      continue;
    }
    waitq_unhold(q, w);
    if (w->flags & GMB__ALLOC_VMM) {
      /* A Vmm increase never waits on: one more try, then its answer,
       * served or refused with the reason (and, for its quota, what is
       * still on its way). */
      struct wire_reply rep;
      enum gmb_nomem_why why;
      waitq_attempt(b, w, &rep, &why);
      waitq_quota_note(b, w, &rep);
      waitq_answer(b, w, &rep);
      continue;
    }
    /* Held for its quota: served if the bytes came (and the device has
     * room), refused GMB_E_QUOTA if they did not; only a request whose
     * quota now fits but that finds no room goes on below, as any
     * request that found no room. */
    if (w->quota && waitq_try(b, w)) continue;
    uint64_t rounded = gmb__alloc_round(w->size);
    /* What the request would have met without the hold (dispatch.c):
     * compaction when it fits the device's free total. */
    int may_compact = b->cfg.compaction && total >= rounded;
    if (!w->nowait) {
      /* It waits on, in its place, for its own deadline. */
      if (may_compact) w->run = compact(ctx, rounded, w->session->tenant);
      continue;
    }
    /* Memory may have come back without a serve (the pool's lingering
     * segments released by its timer): one more try. */
    if (!w->quota && waitq_try(b, w)) continue;
    if (may_compact) {
      w->after_compact = 1;
      q->after_compact++;
      waitq_blocker_drop(q, w);
      waitq_blocking_sync(q, w, 0);
      w->run = compact(ctx, rounded, w->session->tenant);
      continue;
    }
    struct wire_reply rep;
    memset(&rep, 0, sizeof rep);
    rep.id = w->req_id;
    gmb__alloc_explain(b, w->session, rounded, &rep);
    waitq_answer(b, w, &rep);
  }
  q->next_hold_ns = next_at;
  return next_at == UINT64_MAX ? UINT64_MAX : next_at - now;
}

/* --- the consistency check ---------------------------------------------- */

int gmb__waitq_check(struct gmb_broker *b) {
  const struct gmb_waitq *q = &b->waitq;
  size_t n = 0, held = 0, nowait = 0, quota = 0, job = 0;
  uint64_t asked = 0, want = 0;
  const struct gmb_waiter *first = NULL;
  int bad = 0;
  for (const struct gmb_waiter *w = q->head; w; w = w->next) {
    n++;
    held += (size_t)w->held;
    nowait += (size_t)(w->held && w->nowait);
    quota += (size_t)(w->held && w->quota);
    bad += w->job && !w->held; /* only a held waiter is the job's */
    if (!w->job) continue;
    job++;
    asked += w->job_asked;
    want += w->job_want;
    if (first == NULL || waitq_order_cmp(w, first) < 0) first = w;
  }
  bad += n != q->n;
  bad += held != q->held || nowait != q->held_nowait ||
         quota != q->held_quota;
  bad += job != q->held_job || asked != q->job_asked || want != q->job_want;
  bad += first != q->job_first;
  bad += first != NULL && first->priority != q->job_priority;
  bad += job == 0 && q->job_kept != 0;
  /* The list by arrival holds them all, their bounds in order. */
  size_t listed = 0;
  for (const struct gmb_waiter *w = q->job_oldest; w; w = w->jnext) {
    listed++;
    bad += !w->job;
    bad += w->jnext != NULL && w->jnext->job_until_ns < w->job_until_ns;
  }
  bad += listed != job;
  /* Each tenant's count and bytes, recounted from its sessions' waiters;
   * every tenant with such a request is in the list. */
  size_t tenants_n = 0;
  for (const struct gmb_tenant *t = q->job_tenants; t; t = t->job_next) {
    size_t tn = 0;
    uint64_t tb = 0;
    for (const struct gmb_session *s = t->sessions; s; s = s->tenant_next)
      for (const struct gmb_waiter *w = s->waiters; w; w = w->snext)
        if (w->job) {
          tn++;
          tb += waitq_bytes(w);
        }
    bad += tn == 0 || tn != t->job_n || tb != t->job_bytes;
    tenants_n += t->job_n;
  }
  bad += tenants_n != job;
  if (bad)
    log_error("waitq: %d violations of the held counts and the offload "
              "job's sums", bad);
  return bad;
}
