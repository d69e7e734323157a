/*
 * reclaim.c - asking the clients' caches for memory back (reclaim.h has
 * the rules and the bounds).
 *
 * An ask is opened (reclaim_open) and closed (reclaim_close) in one place
 * each, which keep the three sums in step: the session's ask_bytes, its
 * tenant's cache_asked, and b->reclaim's count and bytes.  Choosing whom
 * to ask for a full device walks the sessions once and sorts those that
 * qualify (O(s log s) per request that found no room, beside the pool
 * walk that explaining a refusal costs anyway); the timer walks them only
 * when an ask runs out.
 */
#include "reclaim.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "alloc.h"
#include "defrag.h"
#include "gmb.h"
#include "log.h"
#include "offload.h"
#include "pool.h"
#include "reply.h"
#include "sleep.h"
#include "util.h"
#include "waitq.h"

/* A session that leaves an ask unanswered is not asked again for this
 * long, doubled for each further one in a row, up to the maximum. */
#define RECLAIM_PAUSE_NS GMB_NS_PER_S
#define RECLAIM_PAUSE_MAX_NS (60 * GMB_NS_PER_S)

static struct gmb_log_rl reclaim_rl_ask, reclaim_rl_ignored;

static void reclaim_gave(struct gmb_broker *b, struct gmb_session *o,
                         uint64_t asked, uint64_t gave, uint64_t now,
                         int answered, int other);
static uint64_t reclaim_hold_over(struct gmb_broker *b, uint64_t now,
                                  enum gmb_hold_end how);

/* --- one ask --------------------------------------------------------------- */

/* An ask of `bytes` to o for session s's request, answered by until_ns:
 * EVENT_TRIM, or EVENT_SLEEP when o->ask_sleep was set for it (the
 * plan's). */
static void reclaim_open(struct gmb_broker *b, struct gmb_session *o,
                         const struct gmb_session *s, uint64_t bytes,
                         uint64_t until_ns) {
  GMB_ASSERT(o->ask_bytes == 0 && bytes > 0 && "one ask per session");
  struct gmb_reclaim *r = &b->reclaim;
  o->ask_bytes = bytes;
  o->ask_other = o->tenant != s->tenant;
  o->ask_until_ns = until_ns;
  o->ask_cached = o->cached_free;
  o->ask_used = o->used;
  o->trim_asks++;
  o->tenant->cache_asked += bytes;
  if (r->asks == 0 || until_ns < r->next_ns) r->next_ns = until_ns;
  r->asks++;
  r->ask_bytes += bytes;
  r->asks_total++;
  struct wire_reply ev;
  memset(&ev, 0, sizeof ev);
  ev.kind = WIRE_EVENT;
  ev.u.event.kind = WIRE_EVENT_TRIM;
  if (o->ask_sleep) {
    ev.u.event.kind = WIRE_EVENT_SLEEP;
    ev.u.event.mode = WIRE_SLEEP_ASK;
    o->tenant->sleep_asks++;
  }
  ev.u.event.bytes = bytes;
  gmb__reply_to_session(b, o, &ev);
}

static void reclaim_close(struct gmb_broker *b, struct gmb_session *o) {
  struct gmb_reclaim *r = &b->reclaim;
  GMB_ASSERT(o->ask_bytes > 0 && r->asks > 0 && r->ask_bytes >= o->ask_bytes &&
             o->tenant->cache_asked >= o->ask_bytes && "ask sums drifted");
  o->tenant->cache_asked -= o->ask_bytes;
  r->asks--;
  r->ask_bytes -= o->ask_bytes;
  o->ask_bytes = 0;
  o->ask_until_ns = 0;
  o->ask_sleep = 0;
  o->ask_other = 0;
}

/* May o be asked for the sake of session s now?  Its tenant's pause
 * (reclaim_gave) keeps it from other tenants' asks; for its own tenant's
 * quota only its own pause counts, since a tenant's sessions that ignore
 * each other harm none but it. */
static int reclaim_askable(const struct gmb_session *o,
                           const struct gmb_session *s, uint64_t now) {
  /* A session with requests in the wait queue is not asked: libraries
   * before reply routing held their connection for the whole wait and
   * could not answer (the ask would run out, and pause the session), and
   * the broker cannot tell a library's age. */
  return o != s && o->cached_free > 0 && o->ask_bytes == 0 &&
         now >= o->ask_skip_ns &&
         (o->tenant == s->tenant || now >= o->tenant->ask_skip_ns) &&
         o->waiting == 0;
}

/* --- a full device ------------------------------------------------------- */

/* The device room that a request of `rounded` bytes takes: the segment
 * it needs (a Vmm increase, `vmm`: its bytes, which take the room as a
 * segment does).  Its size alone decides it, so the wait queue keeps the
 * offload job's sum of it exact (b->waitq.job_want). */
static uint64_t reclaim_segment(uint64_t rounded, int vmm) {
  if (vmm) return rounded;
  if (rounded > GMB_POOL_SMALL_MAX)
    return (rounded + GMB_SEGMENT_ALIGN - 1) & ~(GMB_SEGMENT_ALIGN - 1);
  return GMB_POOL_SMALL_SEGMENT;
}

/* What the other tenants' reservations keep beside `rounded` more bytes
 * of tenant t (0 when t stays within its own).  It reads t's use and the
 * reservations now, which change without the wait queue hearing of it:
 * the offload job reckons it anew each turn, for the bytes each tenant's
 * held requests take together (gmb_tenant.job_bytes). */
static uint64_t reclaim_kept(struct gmb_broker *b, const struct gmb_tenant *t,
                             uint64_t rounded) {
  if (gmb__tenant_within_reserve(t, rounded)) return 0;
  uint64_t all = gmb__tenants_reserve_short(b->tenants);
  uint64_t own = t->reserve > t->segment_bytes ? t->reserve - t->segment_bytes
                                               : 0;
  return all > own ? all - own : 0;
}

/* reclaim_segment, and *kept: reclaim_kept. */
static uint64_t reclaim_want(struct gmb_broker *b, const struct gmb_tenant *t,
                             uint64_t rounded, int vmm, uint64_t *kept) {
  *kept = reclaim_kept(b, t, rounded);
  return reclaim_segment(rounded, vmm);
}

static uint64_t reclaim_room(struct gmb_broker *b) {
  struct gmb_pool_stats ps;
  gmb__pool_stats(b->pool, &ps);
  return ps.room;
}

/* The device room that session s's request of `rounded` bytes lacks:
 * what it takes (reclaim_want) less the room for new segments now beyond
 * `fence`, the room fenced for the offload job's requests against it
 * (gmb__alloc_fence; 0 for one that passes). */
static uint64_t reclaim_missing(struct gmb_broker *b,
                                const struct gmb_session *s, uint64_t rounded,
                                int vmm, uint64_t fence) {
  uint64_t kept, want = reclaim_want(b, s->tenant, rounded, vmm, &kept);
  want += kept;
  uint64_t room = reclaim_room(b);
  room = room > fence ? room - fence : 0;
  return want > room ? want - room : 0;
}

struct reclaim_pick {
  struct gmb_session **v;
  size_t n, cap;
  const struct gmb_session *s;
  uint64_t now;
};

static void reclaim_collect(void *ctx, struct gmb_session *o) {
  struct reclaim_pick *p = ctx;
  if (p->n < p->cap && reclaim_askable(o, p->s, p->now)) p->v[p->n++] = o;
}

/* Lowest tenant priority first, then the largest cache (as far as its
 * session holds it: a report can be any number); the session id makes the
 * order total. */
static int reclaim_cmp(const void *x, const void *y) {
  const struct gmb_session *a = *(struct gmb_session *const *)x;
  const struct gmb_session *c = *(struct gmb_session *const *)y;
  if (a->tenant->priority != c->tenant->priority)
    return a->tenant->priority < c->tenant->priority ? -1 : 1;
  uint64_t ac = gmb__session_cached(a), cc = gmb__session_cached(c);
  if (ac != cc) return ac > cc ? -1 : 1;
  return (a->id > c->id) - (a->id < c->id);
}

/* What may be asked of o now for session s: its cached bytes as far as o
 * holds them (a session that reports its tenant's other sessions' bytes
 * would be asked for what it cannot give, and the caches that could were
 * not asked), within what its tenant holds and has not been asked for,
 * and for another tenant never below that tenant's reservation. */
static uint64_t reclaim_allowance(const struct gmb_session *o,
                                  const struct gmb_session *s) {
  const struct gmb_tenant *t = o->tenant;
  uint64_t held = t->used > t->cache_asked ? t->used - t->cache_asked : 0;
  uint64_t floor = t == s->tenant ? 0 : t->reserve;
  uint64_t allow = held > floor ? held - floor : 0;
  uint64_t cached = gmb__session_cached(o);
  return cached < allow ? cached : allow;
}

/* What of `ahead` (reclaim.h) session s's tenant could still use after
 * a request of `rounded` bytes: within the device, and within what its
 * quota leaves beside what it holds, once its other sessions' caches gave
 * back (asked, they free its quota too).  `ahead` is the client's word:
 * unclipped, a tenant at its quota had every other cache asked for as
 * much as its whole quota for one page it could barely hold. */
static uint64_t reclaim_ahead(const struct gmb_broker *b,
                              const struct gmb_session *s, uint64_t rounded,
                              uint64_t ahead) {
  const struct gmb_tenant *t = s->tenant;
  uint64_t room = b->dev->capacity > rounded ? b->dev->capacity - rounded : 0;
  if (t->quota) {
    uint64_t cached = gmb__tenant_cached(t), mine = gmb__session_cached(s);
    uint64_t others = cached > mine ? cached - mine : 0;
    uint64_t charged = gmb__tenant_charged(t);
    uint64_t held = charged > others ? charged - others : 0;
    uint64_t q = t->quota > held && t->quota - held > rounded
                     ? t->quota - held - rounded
                     : 0;
    if (q < room) room = q;
  }
  return ahead < room ? ahead : room;
}

/* Adds to the plan p (bytes[], sleep[] beside p->v) sessions that may be
 * asked to pause (gmb__sleep_askable), in gmb__sleep_cmp's order, for up
 * to `want` bytes: a session the plan has already (for its cache) is asked
 * to sleep instead, for its offer on top.  Charged to the tenants as the
 * plan is (the caller undoes it).  Returns the bytes added. */
static uint64_t reclaim_plan_sleep(struct gmb_broker *b,
                                   struct reclaim_pick *p, uint64_t *bytes,
                                   uint8_t *sleep, uint64_t want) {
  size_t cap = p->cap, n;
  struct gmb_session **v = gmb__sleep_candidates(b, p->s, &n);
  if (v == NULL) return 0;
  uint64_t added = 0;
  for (size_t i = 0; i < n && added < want; i++) {
    struct gmb_session *o = v[i];
    /* Its tenant in a pause after asks that fell short (reclaim_gave):
     * not asked, though the broker's own offload may still take its
     * movable allocations (offload.c needs no answer). */
    if (p->now < o->tenant->ask_skip_ns) continue;
    size_t at = 0;
    while (at < p->n && p->v[at] != o) at++;
    /* Its tenant's bytes not yet asked for, above its reservation, and
     * never more than o holds: its offer is its library's word, and a
     * session that offers its tenant's bytes it does not hold would be
     * asked for what it cannot give while others wait their turn. */
    const struct gmb_tenant *t = o->tenant;
    uint64_t held = t->used > t->cache_asked ? t->used - t->cache_asked : 0;
    uint64_t allow = held > t->reserve ? held - t->reserve : 0;
    uint64_t own = at < p->n ? bytes[at] : 0; /* asked of its cache */
    uint64_t holds = o->used > own ? o->used - own : 0;
    if (allow > holds) allow = holds;
    uint64_t x = o->sleep_pausable < allow ? o->sleep_pausable : allow;
    if (x > want - added) x = want - added;
    if (x == 0) continue;
    if (at == p->n) {
      if (p->n == cap) break;
      p->v[p->n] = o;
      bytes[p->n] = 0;
      p->n++;
    }
    bytes[at] += x;
    sleep[at] = 1;
    o->tenant->cache_asked += x;
    added += x;
  }
  free(v);
  return added;
}

/* Sends the plan p's asks for session p->s's request of `rounded` bytes:
 * each session o of it to give back bytes[] by `until`, of its cache or,
 * with sleep[], by pausing tags.  `because` ends the log line's account
 * of the requester. */
static void reclaim_ask(struct gmb_broker *b, const struct reclaim_pick *p,
                        const uint64_t *bytes, const uint8_t *sleep,
                        uint64_t rounded, uint64_t until,
                        const char *because) {
  const struct gmb_session *s = p->s;
  char sz[GMB_SIZE_BUFSZ], req_sz[GMB_SIZE_BUFSZ];
  for (size_t i = 0; i < p->n; i++) {
    struct gmb_session *o = p->v[i];
    o->ask_sleep = sleep[i];
    reclaim_open(b, o, s, bytes[i], until);
    if (gmb__log_allow(&reclaim_rl_ask))
      log_info("session %" PRIu64 " (tenant %s, priority %d) asked to %s "
               "%s for session %" PRIu64 " (tenant %s)%s: the device has no "
               "room for %s%s", o->id, o->tenant->name, o->tenant->priority,
               sleep[i] ? "pause tags and give back" : "give back of its cache",
               gmb__size_format(bytes[i], sz, sizeof sz), s->id,
               s->tenant->name, because,
               gmb__size_format(rounded, req_sz, sizeof req_sz),
               gmb__log_suppressed(&reclaim_rl_ask));
  }
}

/* --- the offload job --------------------------------------------------- */

/*
 * The broker's own offloads (offload.h) copy a slice at a time.  A request
 * whose lack the first slice (run at once, in its own turn) does not
 * cover, while candidates are left, is held for the job
 * (gmb__waitq_hold_job); the loop then runs one slice a turn
 * (gmb__reclaim_slice, taking turns with an operator's pause when both
 * have work) and serves the queue after each.  The job is the set of
 * requests held for it: each slice makes the room they lack together
 * (what each takes, with what the other tenants' reservations keep beside
 * them, less the room there now and the bytes asked of caches and on
 * their way), chosen for the first of them in the queue's order, from
 * what one walk of the pool finds now (so a segment locked, taken or no
 * longer idle since is left).  The wait queue keeps the sums as requests
 * are held and let go (broker.h: job_want, job_asked, job_first, and per
 * tenant job_n and job_bytes), so a turn costs the first request and one
 * look per tenant with requests held, not a walk of them; what the
 * reservations keep reads the tenants' use, which the queue does not hear
 * of, so it is reckoned each turn from each tenant's bytes together
 * (job_kept).
 *
 * The room the job makes is fenced for its requests (gmb__alloc_fence): a
 * request that is not one of them, of no higher priority than the first,
 * makes a new segment only in the room beyond what they still want, so a
 * stream of small requests cannot keep a held one waiting to its bound.
 * A request that comes while the job runs and lacks room (the fenced room
 * counts as none for it, reclaim_missing) joins it (its want adds to the
 * sums) when it has candidates of its own, else goes on as without room.
 * The fence lifts as requests are let go and when the job ends, and the
 * queue is served then.
 *
 * When a slice can make nothing more for the first of them (no candidate
 * left for it, locked, or the host bounds), or when any of them reaches
 * its bound (RECLAIM_JOB_HOLD_NS after it was held: reclaim_job_due, from
 * the timer and each turn), that request is let go, its hold an ordinary
 * one, and it goes on to the remedy that follows the broker's offload, as
 * a request that never went through a job does: the idle sessions that
 * opted in are asked to pause tags for it (reclaim_job_let_go), and it is
 * held within the asks' bound; else, or when they give too little, it
 * ends as it would have (a compaction run, or GMB_E_NOMEM explained).
 * The next slice works for the next.  A requester that ends takes its
 * held request with it.
 */
#define RECLAIM_JOB_HOLD_NS (10 * GMB_NS_PER_S)

/* Offloads for session s's request, which lacks `lack` bytes beyond what
 * the caches were asked: a first slice now, unless a job runs (then s
 * joins it when it has candidates).  *made: the room made now.  Returns 1
 * when the request is to be held for the job. */
static int reclaim_offload(struct gmb_broker *b, struct gmb_session *s,
                           uint64_t lack, uint64_t *made) {
  *made = 0;
  if (b->cfg.offload_host_max == 0 || b->closing) return 0;
  if (b->waitq.held_job > 0) {
    size_t n = 0;
    struct gmb_session **v = gmb__sleep_candidates(b, s, &n);
    free(v);
    return n > 0;
  }
  int more = 0;
  *made = gmb__offload_for(b, s, lack, GMB_OFFLOAD_SLICE, &more);
  return *made < lack && more;
}

/* The offload job lets go request j (its step can make nothing more
 * for it, or its job bound came): its hold is an ordinary one from now,
 * and the remedy after the broker's offload is tried for it, as for a
 * request that never went through a job (gmb__reclaim_hold): the idle
 * sessions that opted in are asked to pause tags (sleep.h: who, in which
 * order, never below their tenants' reservations) when they can cover
 * what it still lacks, and the request is held within the asks' bound.
 * Else nobody is asked and it ends as it would have without the asks (a
 * compaction run, or GMB_E_NOMEM explained).  `because` ends the asks'
 * log line.  The request is still queued when it returns. */
static void reclaim_job_let_go(struct gmb_broker *b,
                               const struct gmb_waitq_job *j, uint64_t now,
                               const char *because) {
  gmb__waitq_job_release(b, j->w, now, 0);
  struct gmb_session *s = j->s;
  if (b->cfg.sleep_wait_ms == 0 || b->closing) return;
  const int vmm = (j->flags & GMB__ALLOC_VMM) != 0;
  uint64_t rounded = vmm ? j->size : gmb__alloc_round(j->size);
  /* The fence of the requests the job still holds, as the queue will
   * read it when it tries this one. */
  uint64_t fence =
      gmb__waitq_passes_fence(b, j->w) ? 0 : gmb__alloc_fence(b, s);
  uint64_t missing = reclaim_missing(b, s, rounded, vmm, fence);
  /* Bytes on their way count for it, except s's own ask and what was
   * asked for the requests the job still holds. */
  uint64_t coming = b->reclaim.ask_bytes - s->ask_bytes;
  coming = coming > b->waitq.job_asked ? coming - b->waitq.job_asked : 0;
  uint64_t need = missing > coming ? missing - coming : 0;
  if (need == 0) return;
  struct reclaim_pick p = {.s = s, .now = now};
  p.cap = gmb__sessions_count(b->sessions);
  p.v = malloc(p.cap * sizeof *p.v);
  uint64_t *bytes = malloc(p.cap * sizeof *bytes);
  uint8_t *sleep = calloc(p.cap, 1);
  if (p.v && bytes && sleep) {
    uint64_t planned = reclaim_plan_sleep(b, &p, bytes, sleep, need);
    for (size_t i = 0; i < p.n; i++) p.v[i]->tenant->cache_asked -= bytes[i];
    if (planned >= need) {
      uint64_t until =
          now + (uint64_t)(b->cfg.sleep_wait_ms > b->cfg.trim_wait_ms
                               ? b->cfg.sleep_wait_ms
                               : b->cfg.trim_wait_ms) *
                    GMB_NS_PER_MS;
      reclaim_ask(b, &p, bytes, sleep, rounded, until, because);
      gmb__waitq_hold_until(b, j->w, until);
    }
  }
  free(p.v);
  free(bytes);
  free(sleep);
}

/* The job lets go the requests whose job bound (RECLAIM_JOB_HOLD_NS) came
 * by `now`, as a slice that can make nothing more does.  Returns how
 * many. */
static int reclaim_job_due(struct gmb_broker *b, uint64_t now) {
  struct gmb_waitq_job j;
  int n = 0;
  while (gmb__waitq_job_due(b, now, &j)) {
    reclaim_job_let_go(b, &j, now, ", held for the offload job for as "
                       "long as it may (10 s)");
    n++;
  }
  return n;
}

/* What the other tenants' reservations keep beside the job's requests:
 * the most that any of their tenants' requests, together, keep.  O(the
 * tenants with requests held for the job); the figure of this turn
 * (b->waitq.job_kept), which the fence reads too. */
static uint64_t reclaim_job_kept(struct gmb_broker *b) {
  struct gmb_waitq *q = &b->waitq;
  uint64_t kept = 0;
  for (const struct gmb_tenant *t = q->job_tenants; t; t = t->job_next) {
    q->hold_visits++;
    uint64_t k = reclaim_kept(b, t, t->job_bytes);
    if (k > kept) kept = k;
  }
  q->job_kept = kept;
  return kept;
}

int gmb__reclaim_offload_step(struct gmb_broker *b) {
  struct gmb_waitq *q = &b->waitq;
  if (q->held_job == 0) return 0;
  uint64_t now = gmb__now_ns();
  /* The job's sums, kept by the queue: no walk of its requests. */
  struct gmb_waitq_job first;
  gmb__waitq_job_first(b, &first);
  uint64_t want = q->job_want + reclaim_job_kept(b);
  /* The caches' bytes on their way count as far as they were asked for
   * the job's requests: asks for other requests are theirs. */
  uint64_t coming = b->reclaim.ask_bytes < q->job_asked ? b->reclaim.ask_bytes
                                                        : q->job_asked;
  uint64_t have = reclaim_room(b) + coming;
  uint64_t lack = want > have ? want - have : 0;
  int more = 0, let_go = 0;
  uint64_t made = 0;
  if (lack > 0 && !b->closing)
    made = gmb__offload_for(b, first.s, lack, GMB_OFFLOAD_SLICE, &more);
  if (lack == 0) {
    /* The room they lack is there, or on its way from the caches: the
     * job has nothing left to do for them. */
    gmb__waitq_job_release(b, NULL, now, 0);
  } else if (made == 0 && !more) {
    /* Nothing more for the first of them: it is let go (still queued:
     * nothing was served since it was read), the sessions that opted in
     * asked to pause tags for it where they can cover its lack. */
    reclaim_job_let_go(b, &first, now,
                       ", which the offload job could make no more room for");
    let_go = 1;
  }
  /* Room made, or the room fenced for the job's requests given up (the
   * job over, or one let go): the queue is served. */
  if (made || let_go || q->held_job == 0) gmb__waitq_serve(b);
  if (q->held_job == 0)
    log_info("offload job done: %" PRIu64 " slices since start; the broker "
             "holds %" PRIu64 " bytes offloaded", b->offload.slices,
             b->offload.host_bytes);
  /* Those let go end now, unless asks they wait for are still out (a
   * look at the holds, only when the job let some go). */
  if (lack == 0 || let_go) gmb__reclaim_settle(b);
  reclaim_hold_over(b, now, GMB_HOLD_DUE);
  return q->held_job > 0;
}

int gmb__reclaim_pause_step(struct gmb_broker *b) {
  uint32_t made = 0;
  int more = gmb__offload_pause_step(b, &made);
  if (made) gmb__waitq_serve(b);
  return more;
}

int gmb__reclaim_slice(struct gmb_broker *b) {
  const int job = b->waitq.held_job > 0, pause = b->offload.pausing > 0;
  if (!job && !pause) return 0;
  /* Both have work: they take turns, the job's first, so that neither
   * waits for the other to end (a job up to its requests' 10 s, a pause
   * for a tenant's gigabytes). */
  const int run_job = job && (!pause || !b->offload.job_last);
  b->offload.job_last = run_job;
  if (run_job)
    gmb__reclaim_offload_step(b);
  else
    gmb__reclaim_pause_step(b);
  return b->waitq.held_job > 0 || b->offload.pausing > 0;
}

int gmb__reclaim_hold(struct gmb_broker *b, struct gmb_session *s,
                      uint64_t req_id, uint64_t size, uint32_t flags,
                      int timeout_ms, uint64_t ahead) {
  struct gmb_reclaim *r = &b->reclaim;
  if ((b->cfg.trim_wait_ms == 0 && b->cfg.sleep_wait_ms == 0 &&
       b->cfg.offload_host_max == 0) ||
      b->closing)
    return 0;
  const int vmm = (flags & GMB__ALLOC_VMM) != 0;
  uint64_t rounded = vmm ? size : gmb__alloc_round(size);
  /* More than the whole device: no cache can make room for it. */
  if (rounded > b->dev->capacity) return 0;
  uint64_t missing =
      reclaim_missing(b, s, rounded, vmm, gmb__alloc_fence(b, s));
  if (missing == 0) return 0; /* not for want of room: nothing to ask */
  /* Bytes asked already and not answered yet are on their way, except
   * what s itself was asked: it cannot answer while this request waits,
   * and what was asked for the requests the offload job holds: theirs. */
  uint64_t coming = r->ask_bytes - s->ask_bytes;
  coming = coming > b->waitq.job_asked ? coming - b->waitq.job_asked : 0;
  uint64_t need = missing > coming ? missing - coming : 0;
  /* What the plan reaches for: this request's lack and the rest of its
   * miss; what it must reach to hold the request: the lack. */
  uint64_t want =
      need ? need + reclaim_ahead(b, s, rounded, ahead) : 0;
  uint64_t now = gmb__now_ns();
  struct reclaim_pick p = {.s = s, .now = now};
  uint64_t *bytes = NULL;
  uint8_t *sleep = NULL;
  uint64_t planned = 0;
  int sleeping = 0;
  uint64_t offloaded = 0;
  int job = 0; /* held for the offload job (below) */
  if (need > 0) {
    if (r->caching == 0 && b->cfg.sleep_wait_ms == 0 &&
        b->cfg.offload_host_max == 0)
      return 0;
    p.cap = gmb__sessions_count(b->sessions);
    p.v = malloc(p.cap * sizeof *p.v);
    bytes = malloc(p.cap * sizeof *bytes);
    sleep = calloc(p.cap, 1);
    if (p.v == NULL || bytes == NULL || sleep == NULL) {
      free(p.v);
      free(bytes);
      free(sleep);
      return 0;
    }
    if (b->cfg.trim_wait_ms > 0)
      gmb__sessions_each(b->sessions, reclaim_collect, &p);
    qsort(p.v, p.n, sizeof *p.v, reclaim_cmp);
    /* The plan, charged to the tenants as it is made so that two sessions
     * of one tenant are not both asked down to its reservation; undone
     * when it cannot cover what is missing. */
    size_t k = 0;
    for (size_t i = 0; i < p.n && planned < want; i++) {
      uint64_t x = reclaim_allowance(p.v[i], s);
      if (x > want - planned) x = want - planned;
      if (x == 0) continue;
      p.v[k] = p.v[i];
      bytes[k++] = x;
      p.v[i]->tenant->cache_asked += x;
      planned += x;
    }
    p.n = k;
    /* The caches cannot cover it: the broker offloads the unlocked
     * movable allocations of the idle sessions that opted in to sleep
     * (offload.h: the same who and order as the asks below), which makes
     * room now, without their help; then those sessions are asked to
     * pause tags (sleep.h: who, in which order), each never below its
     * tenant's reservation. */
    if (planned < need)
      job = reclaim_offload(b, s, need - planned, &offloaded);
    need = offloaded < need ? need - offloaded : 0;
    want = offloaded < want ? want - offloaded : 0;
    /* The job offloads those very sessions' allocations: they are not
     * asked to sleep meanwhile (they are when it lets this request go,
     * reclaim_job_let_go). */
    if (!job && planned < need && b->cfg.sleep_wait_ms > 0)
      planned += reclaim_plan_sleep(b, &p, bytes, sleep, want - planned);
    for (size_t i = 0; i < p.n; i++) {
      p.v[i]->tenant->cache_asked -= bytes[i];
      sleeping |= sleep[i];
    }
  }
  uint64_t until = now + (uint64_t)b->cfg.trim_wait_ms * GMB_NS_PER_MS;
  /* An offload copies the bytes before it gives the pages back: the hold
   * waits as long as the longer bound of its asks. */
  if (sleeping)
    until = now + (uint64_t)(b->cfg.sleep_wait_ms > b->cfg.trim_wait_ms
                                 ? b->cfg.sleep_wait_ms
                                 : b->cfg.trim_wait_ms) *
                      GMB_NS_PER_MS;
  /* Nothing is asked, and nobody disturbed, unless the caches can cover
   * what is missing; nor when the request cannot be held (its session's
   * or tenant's waiters are at their limit). */
  int held;
  if (job)
    held = gmb__waitq_hold_job(b, s, req_id, size, flags, timeout_ms, until,
                               now + RECLAIM_JOB_HOLD_NS, planned,
                               reclaim_segment(rounded, vmm)) == 0;
  else
    held = planned >= need && (need > 0 || coming > 0) &&
           gmb__waitq_hold(b, s, req_id, size, flags, timeout_ms, until) == 0;
  if (job && held) {
    /* The reservations kept beside its tenant's held requests, as the
     * fence reads them until the job's next turn. */
    uint64_t kept = reclaim_kept(b, s->tenant, s->tenant->job_bytes);
    if (kept > b->waitq.job_kept) b->waitq.job_kept = kept;
  }
  if (job && held && b->waitq.held_job == 1) {
    b->offload.jobs++;
    char sz[GMB_SIZE_BUFSZ];
    log_info("offload job for session %" PRIu64 " (tenant %s): %s of device "
             "room still lacking after its first slice; the rest a slice "
             "(%u MiB) a loop turn", s->id, s->tenant->name,
             gmb__size_format(need, sz, sizeof sz),
             (unsigned)(GMB_OFFLOAD_SLICE >> 20));
  }
  /* The offloads made all the room it lacked: try it again now. */
  if (!held && offloaded > 0 && need == 0) {
    free(p.v);
    free(bytes);
    free(sleep);
    return 2;
  }
  if (held) reclaim_ask(b, &p, bytes, sleep, rounded, until, "");
  free(p.v);
  free(bytes);
  free(sleep);
  return held;
}

/* --- a quota ------------------------------------------------------------- */

/* What may be asked of o now for session s's quota: its cached bytes, as
 * far as it holds them (a report never counts memory it does not have). */
static uint64_t reclaim_quota_allowance(const struct gmb_session *o,
                                        const struct gmb_session *s,
                                        uint64_t now) {
  return reclaim_askable(o, s, now) ? gmb__session_cached(o) : 0;
}

int gmb__reclaim_quota_hold(struct gmb_broker *b, struct gmb_session *s,
                            uint64_t req_id, uint64_t size, uint32_t flags,
                            int timeout_ms, uint64_t ahead) {
  struct gmb_tenant *t = s->tenant;
  uint64_t rounded = flags & GMB__ALLOC_VMM ? size : gmb__alloc_round(size);
  if (!gmb__tenant_over(t, rounded)) return 0; /* the common case: O(1) */
  if (b->cfg.trim_wait_ms == 0 || b->closing) return 0;
  /* More than the whole quota, or the whole device: no cache can help,
   * and held it could only be refused later. */
  if (rounded > t->quota || rounded > b->dev->capacity) return 0;
  /* Retired segments its processes still map, and the VMM memory they
   * made, count as held (tenant.h); over its uid's budget, not its quota:
   * no cache of its own can help. */
  uint64_t held = gmb__tenant_charged(t);
  if (held + rounded <= t->quota) return 0;
  uint64_t missing = held + rounded - t->quota;
  /* Bytes asked of its other sessions and not answered yet are on their
   * way, whoever asked (a full device's ask frees the tenant's quota as
   * well); s's own ask is not: it cannot answer while this request waits. */
  uint64_t coming = t->cache_asked - s->ask_bytes;
  uint64_t need = missing > coming ? missing - coming : 0;
  uint64_t want = need ? need + reclaim_ahead(b, s, rounded, ahead) : 0;
  uint64_t now = gmb__now_ns();
  /* The plan first: nobody is asked, and nothing held, unless the cached
   * bytes of its other sessions can cover what is missing; bytes in use
   * are never waited for. */
  uint64_t planned = 0;
  for (const struct gmb_session *o = t->sessions; o && planned < need;
       o = o->tenant_next)
    planned += reclaim_quota_allowance(o, s, now);
  if (planned < need) return 0;
  /* A hold lasts while what it waits for may come: its own asks' bound
   * (trim_wait_ms from now), or, when asks already out cover it, the
   * latest of their bounds. */
  uint64_t until = 0;
  if (need > 0) {
    until = now + (uint64_t)b->cfg.trim_wait_ms * GMB_NS_PER_MS;
  } else {
    for (const struct gmb_session *o = t->sessions; o; o = o->tenant_next)
      if (o != s && o->ask_bytes > 0 && o->ask_until_ns > until)
        until = o->ask_until_ns;
  }
  GMB_ASSERT(until > 0 && "bytes on their way come from some ask");
  if (gmb__waitq_hold_quota(b, s, req_id, size, flags, timeout_ms, until))
    return 0; /* its session or tenant waits for as much as it may */
  uint64_t asked = 0;
  for (struct gmb_session *o = t->sessions; o && asked < want;
       o = o->tenant_next) {
    uint64_t x = reclaim_quota_allowance(o, s, now);
    if (x > want - asked) x = want - asked;
    if (x == 0) continue;
    reclaim_open(b, o, s, x, until);
    asked += x;
    if (gmb__log_allow(&reclaim_rl_ask)) {
      char sz[GMB_SIZE_BUFSZ], req_sz[GMB_SIZE_BUFSZ];
      log_info("session %" PRIu64 " (tenant %s) asked to give back %s of its "
               "cache for session %" PRIu64 ": %s more would pass the "
               "tenant's quota%s", o->id, t->name,
               gmb__size_format(x, sz, sizeof sz), s->id,
               gmb__size_format(rounded, req_sz, sizeof req_sz),
               gmb__log_suppressed(&reclaim_rl_ask));
    }
  }
  return 1;
}

/* --- answers, ends and the timer --------------------------------------- */

int gmb__reclaim_heard(struct gmb_broker *b, struct gmb_session *s,
                       uint64_t cached_free, int answered) {
  b->reclaim.caching -= s->cached_free > 0;
  b->reclaim.caching += cached_free > 0;
  s->cached_free = cached_free;
  if (!answered || s->ask_bytes == 0) return 0;
  /* What it gave is what it no longer holds (the library's Frees come
   * before its answer), whatever it reports: a cache that claims bytes
   * and gives none (every page with a block in use, stream work not done,
   * or a liar) made everyone's refusals wait for its answer.  So an
   * answer that freed nothing counts as an ask ignored, and the pause
   * before the next ask doubles with each. */
  uint64_t asked = s->ask_bytes;
  uint64_t gave = s->used < s->ask_used ? s->ask_used - s->used : 0;
  int other = s->ask_other;
  reclaim_close(b, s);
  reclaim_gave(b, s, asked, gave, gmb__now_ns(), 1, other);
  return 1;
}

/* The holds' compaction runs (gmb__waitq_hold_over's callback). */
struct reclaim_runs {
  struct gmb_broker *b;
  int n;
};

static uint64_t reclaim_compact(void *ctx, uint64_t rounded,
                                struct gmb_tenant *t) {
  struct reclaim_runs *c = ctx;
  c->n++;
  return gmb__defrag_request(c->b, rounded, t);
}

static uint64_t reclaim_hold_over(struct gmb_broker *b, uint64_t now,
                                  enum gmb_hold_end how) {
  /* Requests whose job bound came go the way of those a slice can make
   * nothing more for; the room fenced for them is given up. */
  if (reclaim_job_due(b, now)) {
    gmb__waitq_serve(b);
    /* Asks made for them are in flight now: not every hold ends. */
    if (how == GMB_HOLD_ALL && b->reclaim.asks > 0) how = GMB_HOLD_SETTLED;
  }
  struct reclaim_runs c = {b, 0};
  uint64_t next = gmb__waitq_hold_over(b, now, how, reclaim_compact, &c);
  /* No run could start: answer now rather than never (as dispatch.c). */
  if (c.n && b->compacting == NULL)
    gmb__waitq_compaction_over(b, UINT64_MAX, NULL, NULL);
  return next;
}

void gmb__reclaim_settle(struct gmb_broker *b) {
  if (b->waitq.held == 0 || b->closing) return;
  if (b->reclaim.asks == 0)
    reclaim_hold_over(b, gmb__now_ns(), GMB_HOLD_ALL);
  else if (b->waitq.held_quota > 0)
    /* Other tenants' asks are still out, but a quota hold waits only for
     * its own tenant's. */
    reclaim_hold_over(b, gmb__now_ns(), GMB_HOLD_SETTLED);
}

/* The pause after `run` asks in a row that fell short, the last
 * `answered` or not. */
static uint64_t reclaim_pause(uint32_t run, int answered) {
  /* An answer that fell short ended its holds at once, and the first in
   * a row is forgiven: a report may be one request old (a page the cache
   * reported idle was taken since by its own next block), which looks the
   * same.  An ask left unanswered held requests for the whole bound:
   * paused from the first. */
  uint32_t steps = run - (answered ? 1 : 0);
  uint64_t pause = steps ? RECLAIM_PAUSE_NS : 0;
  for (uint32_t i = 1; i < steps && pause < RECLAIM_PAUSE_MAX_NS; i++)
    pause *= 2;
  return pause > RECLAIM_PAUSE_MAX_NS ? RECLAIM_PAUSE_MAX_NS : pause;
}

/* o's ask ran out: counted and logged unless it gave what it was asked
 * (a library that gave back without saying so). */
static void reclaim_ran_out(struct gmb_broker *b, struct gmb_session *o,
                            uint64_t now) {
  uint64_t asked = o->ask_bytes;
  uint64_t gave = o->used < o->ask_used ? o->ask_used - o->used : 0;
  int other = o->ask_other;
  reclaim_close(b, o);
  reclaim_gave(b, o, asked, gave, now, 0, other);
}

/* o's ask of `asked` bytes ended having given `gave` (what o stopped
 * holding; `answered`: o said so, else its ask ran out; `other`: it was
 * for another tenant's request).  All of it: o's run of short asks ends.
 * Less: the ask counts in the run, and o is paused, the longer the more
 * asks in a row fell short; one that gave nothing is also counted as
 * ignored and logged.  A short ask is not
 * forgiven for what it gave: a session that frees one small allocation
 * for each ask (and takes it again between asks) would otherwise be asked
 * first for every request, and the sessions after it never. */
static void reclaim_gave(struct gmb_broker *b, struct gmb_session *o,
                         uint64_t asked, uint64_t gave, uint64_t now,
                         int answered, int other) {
  struct gmb_tenant *t = o->tenant;
  /* The tenant's run counts only asks for other tenants' requests, which
   * its pause is about: its sessions answering its own quota's asks (its
   * own bytes, to itself) neither end nor lengthen it. */
  if (gave >= asked) {
    o->ask_ignored_run = 0;
    if (other) t->ask_short_run = 0;
    return;
  }
  /* The session's run and its tenant's, whichever is longer: a tenant
   * whose sessions fall short in turn is paused as one session would be,
   * and the pause holds for all of them. */
  if (o->ask_ignored_run < 63) o->ask_ignored_run++;
  uint32_t run = o->ask_ignored_run;
  if (other) {
    if (t->ask_short_run < 63) t->ask_short_run++;
    if (t->ask_short_run > run) run = t->ask_short_run;
  }
  uint64_t pause = reclaim_pause(run, answered);
  o->ask_skip_ns = now + pause;
  if (other && t->ask_skip_ns < o->ask_skip_ns) t->ask_skip_ns = o->ask_skip_ns;
  if (gave > 0) return;
  const char *how = answered ? "answered, but freed" : "did not give back";
  o->trim_ignored++;
  b->reclaim.ignored_total++;
  if (gmb__log_allow(&reclaim_rl_ignored)) {
    char a[GMB_SIZE_BUFSZ], c[GMB_SIZE_BUFSZ];
    log_warn("session %" PRIu64 " (tenant %s, uid %u, pid %d) %s no "
             "cached memory within %u ms (asked %s of the %s it reports "
             "cached; %" PRIu64 " of %" PRIu64 " asks gave nothing): not asked "
             "again for %" PRIu64 " s%s", o->id, o->tenant->name,
             (unsigned)o->uid, (int)o->pid, how, b->cfg.trim_wait_ms,
             gmb__size_format(asked, a, sizeof a),
             gmb__size_format(o->cached_free, c, sizeof c), o->trim_ignored,
             o->trim_asks, pause / GMB_NS_PER_S,
             gmb__log_suppressed(&reclaim_rl_ignored));
  }
}

struct reclaim_due {
  struct gmb_broker *b;
  uint64_t now, next;
  int ran_out;
};

static void reclaim_expire_one(void *ctx, struct gmb_session *o) {
  struct reclaim_due *d = ctx;
  if (o->ask_bytes == 0) return;
  if (o->ask_until_ns <= d->now) {
    reclaim_ran_out(d->b, o, d->now);
    d->ran_out++;
  } else if (o->ask_until_ns < d->next) {
    d->next = o->ask_until_ns;
  }
}

uint64_t gmb__reclaim_expire(struct gmb_broker *b, uint64_t now) {
  struct gmb_reclaim *r = &b->reclaim;
  int ran_out = 0;
  if (r->asks && r->next_ns <= now) {
    struct reclaim_due d = {b, now, UINT64_MAX, 0};
    gmb__sessions_each(b->sessions, reclaim_expire_one, &d);
    r->next_ns = d.next;
    ran_out = d.ran_out;
  }
  uint64_t next = r->asks ? (r->next_ns > now ? r->next_ns - now : 0)
                          : UINT64_MAX;
  /* An ask that ran out may have been the last a quota hold waited for,
   * though the hold's own bound is later (it waited for younger asks too,
   * answered since). */
  enum gmb_hold_end how = r->asks == 0 ? GMB_HOLD_ALL
                          : ran_out     ? GMB_HOLD_SETTLED
                                        : GMB_HOLD_DUE;
  uint64_t hold = reclaim_hold_over(b, now, how);
  return hold < next ? hold : next;
}

void gmb__reclaim_forget_session(struct gmb_broker *b, struct gmb_session *s) {
  b->reclaim.caching -= s->cached_free > 0;
  s->cached_free = 0;
  gmb__tenant_holes_heard(s->tenant, &s->cached_holes, 0, 0);
  if (s->ask_bytes) reclaim_close(b, s);
}

/* --- the consistency check ---------------------------------------------- */

struct reclaim_count {
  uint32_t asks, caching;
  uint64_t bytes;
  int bad;
};

static void reclaim_count_one(void *ctx, struct gmb_session *o) {
  struct reclaim_count *c = ctx;
  c->asks += o->ask_bytes > 0;
  c->bytes += o->ask_bytes;
  c->caching += o->cached_free > 0;
  c->bad += (o->ask_bytes > 0) != (o->ask_until_ns > 0);
}

static int reclaim_tenant_sum(void *ctx, struct gmb_tenant *t) {
  struct reclaim_count *c = ctx;
  uint64_t sum = 0, holes = 0;
  for (const struct gmb_session *o = t->sessions; o; o = o->tenant_next) {
    sum += o->ask_bytes;
    holes += o->cached_holes;
    c->bad += o->cached_holes > o->used; /* what it holds bounds them */
  }
  c->bad += sum != t->cache_asked;
  c->bad += holes != t->cache_holes; /* the reports' holes (tenant.h) */
  return 0;
}

int gmb__reclaim_check(struct gmb_broker *b) {
  struct reclaim_count c = {0, 0, 0, 0};
  if (b->sessions == NULL || b->tenants == NULL) return 0;
  gmb__sessions_each(b->sessions, reclaim_count_one, &c);
  gmb__tenants_each(b->tenants, reclaim_tenant_sum, &c);
  c.bad += c.asks != b->reclaim.asks;
  c.bad += c.bytes != b->reclaim.ask_bytes;
  c.bad += c.caching != b->reclaim.caching;
  if (c.bad)
    log_error("reclaim: %d violations of the ask and holes sums", c.bad);
  return c.bad;
}
