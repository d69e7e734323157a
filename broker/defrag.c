/*
 * defrag.c - when the broker compacts, and how a run is driven.
 *
 * The engine (compact.c) knows how to move allocations; this module decides
 * when, and connects it to the rest of the broker:
 *   - a request that fits the device's free total but no free range starts
 *     a run with a goal (the room its segment needs: the run ends as soon
 *     as that much is free, so it moves no more than it must) and waits for
 *     its end (dispatch.c queues it in waitq.c); a second such request
 *     while the run goes adds its room to the goal;
 *   - an operator's AdminCompact starts a run and is answered at its end;
 *   - fragmentation that stays above `compaction_threshold` for a few
 *     seconds starts a background run (`compaction = auto`), but not again
 *     until allocations changed since a run that found nothing to move.
 * One run at a time.  The loop calls gmb__defrag_tick() between batches of
 * messages with a deadline a couple of milliseconds away, so clients are
 * answered while a large compaction copies.
 *
 * The engine's hooks go to the lock table of the allocation's session: a
 * move starts only after CAS 0 -> MOVING on its slot, and ends by
 * publishing the new place and storing 0.  When a run ends, its admin
 * requests are answered through the sender and the wait queue is served.
 *
 * Revocation uses the same hooks with another engine (evacuate.c): when a
 * uid or a token stops proving a tenant, the segments its processes
 * mapped are sealed and their live bytes move out, a slice per tick
 * beside compaction's.  A pass that leaves allocations held locked waits
 * for the next timer (about a second) and tries again, for at most
 * DEFRAG_REVOKE_WAIT_NS; pinned ones never move.  What stays is logged,
 * with the bytes and moves it cost and the time from start to end.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "defrag.h"

#include "compact.h"
#include "evacuate.h"
#include "gmb.h"
#include "locktab.h"
#include "log.h"
#include "reply.h"
#include "session.h"
#include "tenant.h"
#include "util.h"
#include "waitq.h"

/* How long a revocation tries again for allocations held locked. */
#define DEFRAG_REVOKE_WAIT_NS (5 * GMB_NS_PER_S)

#define DEFRAG_HIGH_FOR_NS (3 * GMB_NS_PER_S) /* background: 3 s above */

struct gmb_defrag_req {
  struct gmb_defrag_req *next;
  uint64_t req_id;
  uint8_t rid[256];
  size_t rid_len;
  uid_t uid;
  struct gmb_tenant *scope;
  int started; /* its run is the one in progress */
};

/* --- hooks into the lock tables ---------------------------------------- */

static int defrag_claim(void *ctx, const struct gmb_alloc_info *a) {
  (void)ctx;
  uint32_t slot;
  struct gmb_locktab *lt = gmb__session_slot(a, &slot);
  if (lt == NULL) return 0; /* not movable through a lock table */
  return gmb__locktab_claim(lt, slot);
}

static void defrag_publish(void *ctx, const struct gmb_alloc_info *a) {
  (void)ctx;
  uint32_t slot;
  struct gmb_locktab *lt = gmb__session_slot(a, &slot);
  GMB_ASSERT(lt != NULL && "a move committed without a claim");
  gmb__locktab_publish(lt, slot, a->dseg->id, a->offset);
}

static void defrag_release(void *ctx, const struct gmb_alloc_info *a) {
  (void)ctx;
  uint32_t slot;
  struct gmb_locktab *lt = gmb__session_slot(a, &slot);
  if (lt) gmb__locktab_release(lt, slot);
}

static int defrag_locked(void *ctx, const struct gmb_alloc_info *a) {
  (void)ctx;
  return gmb__session_alloc_locked(a);
}

/* --- runs ---------------------------------------------------------------- */

static void defrag_begin(struct gmb_broker *b, struct gmb_tenant *scope,
                         int reason, uint64_t goal) {
  if (b->compacting) return;
  struct gmb_compact_hooks hooks = {
      .ctx = b,
      .claim = defrag_claim,
      .publish = defrag_publish,
      .release = defrag_release,
      .locked = defrag_locked,
  };
  b->compacting = gmb__compact_new(b->pool, scope ? scope->arena : NULL, goal,
                                   &hooks);
  if (b->compacting == NULL) {
    log_error("cannot start compaction: out of host memory");
    return;
  }
  b->compact_begun++;
  b->compact_scope = scope;
  b->compact_reason = reason;
  b->pool_ops_at_last_run = b->pool_ops;
  static const char *why[] = {"", "a request that fits the free total",
                              "an operator", "fragmentation above threshold"};
  log_info("compaction started (%s) for %s", why[reason],
           scope ? scope->name : "every tenant");
}

void gmb__defrag_start(struct gmb_broker *b, struct gmb_tenant *scope,
                       int reason) {
  defrag_begin(b, scope, reason, 0);
}

/* Starts a goal run for a request of `rounded` bytes of tenant t, or
 * widens the run in progress (its goal and, when it has none yet, its
 * hole). */
static void defrag_for(struct gmb_broker *b, uint64_t rounded,
                       struct gmb_tenant *t) {
  /* The room a segment for it takes: its own (large) or a small one. */
  uint64_t goal = GMB_POOL_SMALL_SEGMENT;
  if (rounded > GMB_POOL_SMALL_MAX)
    goal = (rounded + GMB_SEGMENT_ALIGN - 1) & ~(GMB_SEGMENT_ALIGN - 1);
  if (b->compacting) {
    gmb__compact_add_goal(b->compacting, goal);
  } else {
    defrag_begin(b, NULL, GMB_DEFRAG_REQUEST, goal);
  }
  /* Or a hole for it in its tenant's own segments. */
  if (b->compacting && t && rounded <= GMB_POOL_SMALL_MAX)
    gmb__compact_add_hole(b->compacting, t->arena, rounded);
}

uint64_t gmb__defrag_request(struct gmb_broker *b, uint64_t rounded,
                             struct gmb_tenant *t) {
  int late = b->compacting != NULL;
  defrag_for(b, rounded, t);
  if (b->compacting == NULL) return 0;
  /* Joining a run part-way, it may not be what the run tries for: it gets
   * the next (gmb__waitq_compaction_over) if this one does not serve it. */
  return late ? b->compact_begun + 1 : b->compact_begun;
}

/* gmb__waitq_compaction_over's `again`: a run for a waiter that joined
 * the run that just ended part-way; the first begins it, the others widen
 * it, all from its start. */
static uint64_t defrag_again(void *ctx, uint64_t rounded,
                             struct gmb_tenant *t) {
  struct gmb_broker *b = ctx;
  defrag_for(b, rounded, t);
  return b->compacting ? b->compact_begun : 0;
}

static void defrag_answer_admin(struct gmb_broker *b,
                                const struct gmb_compact_stats *st) {
  struct gmb_defrag_req **pp = &b->compact_reqs;
  while (*pp) {
    struct gmb_defrag_req *r = *pp;
    if (!r->started) {
      pp = &r->next;
      continue;
    }
    struct wire_reply rep;
    memset(&rep, 0, sizeof rep);
    rep.id = r->req_id;
    rep.kind = WIRE_ADMIN_COMPACT;
    rep.u.compact.moves = st->moves;
    rep.u.compact.bytes_moved = st->bytes_moved;
    rep.u.compact.segments_released = st->segments_released;
    rep.u.compact.bytes_released = st->bytes_released;
    rep.u.compact.skipped_locked = st->skipped_locked;
    rep.u.compact.skipped_pinned = st->skipped_pinned;
    rep.u.compact.seconds = (double)st->ns / 1e9;
    rep.u.compact.runs = 1;
    gmb__reply_send(b, GMB_SOCK_ADMIN, r->rid, r->rid_len, &rep);
    *pp = r->next;
    free(r);
  }
}

/* Starts the run the first queued admin request asked for, if any. */
static void defrag_next_admin(struct gmb_broker *b) {
  if (b->compacting || b->compact_reqs == NULL) return;
  struct gmb_defrag_req *head = b->compact_reqs;
  gmb__defrag_start(b, head->scope, GMB_DEFRAG_ADMIN);
  if (b->compacting == NULL) return;
  /* Every queued request with the same scope is answered by this run. */
  for (struct gmb_defrag_req *r = head; r; r = r->next)
    if (r->scope == head->scope) r->started = 1;
}

static void defrag_finish(struct gmb_broker *b) {
  struct gmb_compact_stats st;
  gmb__compact_stats(b->compacting, &st);
  gmb__compact_destroy(b->compacting);
  b->compacting = NULL;
  struct wire_compact_stats *t = &b->compact_totals;
  t->moves += st.moves;
  t->bytes_moved += st.bytes_moved;
  t->segments_released += st.segments_released;
  t->bytes_released += st.bytes_released;
  t->skipped_locked += st.skipped_locked;
  t->skipped_pinned += st.skipped_pinned;
  t->seconds += (double)st.ns / 1e9;
  t->runs++;
  char moved[GMB_SIZE_BUFSZ], freed[GMB_SIZE_BUFSZ];
  log_info("compaction done: %" PRIu64 " moves (%" PRIu64
           " planned chains or packings), %s moved, %" PRIu64
           " segments (%s) released, %" PRIu64 " locked and %" PRIu64
           " pinned allocations left in place, %.3f ms",
           st.moves, st.plans,
           gmb__size_format(st.bytes_moved, moved, sizeof moved),
           st.segments_released,
           gmb__size_format(st.bytes_released, freed, sizeof freed),
           st.skipped_locked, st.skipped_pinned, (double)st.ns / 1e6);
  if (st.moves == 0) b->pool_ops_at_last_run = b->pool_ops;
  b->compact_scope = NULL;
  b->compact_reason = GMB_DEFRAG_NONE;
  defrag_answer_admin(b, &st);
  /* Memory came back: serve what waited, then answer what waited only for
   * this run. */
  gmb__waitq_serve(b);
  gmb__waitq_compaction_over(b, b->compact_begun, defrag_again, b);
  defrag_next_admin(b);
}

/* --- revocation ---------------------------------------------------------- */

static void defrag_hooks(struct gmb_broker *b, struct gmb_compact_hooks *h) {
  memset(h, 0, sizeof *h);
  h->ctx = b;
  h->claim = defrag_claim;
  h->publish = defrag_publish;
  h->release = defrag_release;
  h->locked = defrag_locked;
}

void gmb__defrag_revoke(struct gmb_broker *b, struct gmb_tenant *t) {
  size_t sealed = gmb__pool_seal_arena(b->pool, t->arena);
  gmb__tenant_segments_sync(b->tenants, t);
  if (sealed == 0) return;
  if (!t->revoking) {
    t->revoking = 1;
    t->revoke_since_ns = gmb__now_ns();
    t->revoke_moves = t->revoke_bytes = 0;
    b->revoking++;
    b->revoke_ready++;
  } else if (t->revoke_wait) {
    t->revoke_wait = 0;
    b->revoke_ready++;
  }
  log_info("revocation of tenant %s: its %zu segments are sealed (a "
           "revoked process may have mapped any of them); their live bytes "
           "move out", t->name, sealed);
}

static void defrag_revoke_end(struct gmb_broker *b, struct gmb_tenant *t,
                              const struct gmb_evac_stats *st, int gave_up) {
  double ms = (double)(gmb__now_ns() - t->revoke_since_ns) / 1e6;
  if (gave_up || st->pinned)
    log_warn("revocation of tenant %s done: %" PRIu64 " bytes moved in %"
             PRIu64 " moves, %.1f ms; %" PRIu64 " bytes in %" PRIu64
             " pinned and %" PRIu64 " bytes in %" PRIu64 " locked "
             "allocations stay in %" PRIu64 " segments a revoked process "
             "mapped (gmbctl evict %s takes them out of its reach)",
             t->name, t->revoke_bytes, t->revoke_moves, ms, st->pinned_bytes,
             st->pinned, st->locked_bytes, st->locked, st->sealed, t->name);
  else
    log_info("revocation of tenant %s done: %" PRIu64 " bytes moved in %"
             PRIu64 " moves, %.1f ms; nothing stays in a segment a revoked "
             "process mapped", t->name, t->revoke_bytes, t->revoke_moves, ms);
  t->revoking = 0;
  if (!t->revoke_wait) b->revoke_ready--;
  t->revoke_wait = 0;
  b->revoking--;
  gmb__tenant_segments_sync(b->tenants, t);
  gmb__broker_tenant_idled(b, t);
}

struct defrag_revoke_ctx {
  struct gmb_broker *b;
  uint64_t deadline_ns;
  int more;     /* a step ran out of time */
  int changed;  /* moves were made: waiters may fit */
};

static int defrag_revoke_one(void *ctx, struct gmb_tenant *t) {
  struct defrag_revoke_ctx *x = ctx;
  struct gmb_broker *b = x->b;
  if (!t->revoking || t->revoke_wait) return 0;
  struct gmb_compact_hooks h;
  defrag_hooks(b, &h);
  struct gmb_evac_stats st;
  memset(&st, 0, sizeof st);
  int rc = gmb__evac_step(b->pool, t->arena, &h, x->deadline_ns, &st);
  /* Segments came (targets) and went (emptied sealed ones). */
  gmb__tenant_segments_sync(b->tenants, t);
  t->revoke_moves += st.moves;
  t->revoke_bytes += st.bytes_moved;
  if (st.moves) {
    x->changed = 1;
    b->pool_ops++;
  }
  if (rc) {
    x->more = 1;
    return 1; /* out of time: the next tick goes on */
  }
  uint64_t now = gmb__now_ns();
  if (st.locked == 0)
    defrag_revoke_end(b, t, &st, 0);
  else if (now - t->revoke_since_ns >= DEFRAG_REVOKE_WAIT_NS)
    defrag_revoke_end(b, t, &st, 1);
  else {
    t->revoke_wait = 1; /* the timer lets it try again */
    b->revoke_ready--;
  }
  return 0;
}

static void defrag_revoke_tick(struct gmb_broker *b, uint64_t deadline_ns) {
  if (b->revoke_ready == 0) return;
  struct defrag_revoke_ctx x = {.b = b, .deadline_ns = deadline_ns};
  gmb__tenants_each(b->tenants, defrag_revoke_one, &x);
  if (x.changed) gmb__waitq_serve(b);
}

static int defrag_revoke_wake(void *ctx, struct gmb_tenant *t) {
  struct gmb_broker *b = ctx;
  if (t->revoking && t->revoke_wait) {
    t->revoke_wait = 0;
    b->revoke_ready++;
  }
  return 0;
}

int gmb__defrag_tick(struct gmb_broker *b, uint64_t deadline_ns) {
  defrag_revoke_tick(b, deadline_ns);
  if (b->compacting == NULL) {
    defrag_next_admin(b);
    if (b->compacting == NULL) return 0;
  }
  if (gmb__compact_step(b->compacting, deadline_ns) == 0) defrag_finish(b);
  return b->compacting != NULL;
}

int gmb__defrag_busy(const struct gmb_broker *b) {
  return b->compacting != NULL || b->compact_reqs != NULL ||
         b->revoke_ready != 0;
}

void gmb__defrag_timer(struct gmb_broker *b, uint64_t now) {
  if (b->revoking > b->revoke_ready)
    gmb__tenants_each(b->tenants, defrag_revoke_wake, b);
  if (!b->cfg.compaction || b->compacting) {
    b->frag_high_since_ns = 0;
    return;
  }
  double f = gmb__pool_fragmentation(b->pool, NULL, NULL);
  if (f <= b->cfg.compaction_threshold) {
    b->frag_high_since_ns = 0;
    return;
  }
  if (b->frag_high_since_ns == 0) {
    b->frag_high_since_ns = now;
    return;
  }
  /* A run that found nothing to move is not repeated until the pool
   * changed: pinned or locked memory does not become movable by itself. */
  if (now - b->frag_high_since_ns >= DEFRAG_HIGH_FOR_NS &&
      b->pool_ops != b->pool_ops_at_last_run) {
    log_info("fragmentation %.2f above %.2f for %llu s", f,
             b->cfg.compaction_threshold,
             (unsigned long long)(DEFRAG_HIGH_FOR_NS / GMB_NS_PER_S));
    gmb__defrag_start(b, NULL, GMB_DEFRAG_BACKGROUND);
    b->frag_high_since_ns = 0;
  }
}

void gmb__defrag_admin(struct gmb_broker *b, const struct gmb_peer *peer,
                       const struct wire_request *req) {
  struct wire_reply rep;
  memset(&rep, 0, sizeof rep);
  rep.id = req->id;
  struct gmb_tenant *scope = NULL;
  const char *name = req->u.admin_compact.tenant;
  if (name[0]) {
    scope = gmb__tenant_find(b->tenants, name);
    if (scope == NULL) {
      rep.status = GMB_E_NOENT;
      snprintf(rep.message, sizeof rep.message, "no tenant named '%s'", name);
      gmb__reply_send(b, GMB_SOCK_ADMIN, peer->rid, peer->rid_len, &rep);
      return;
    }
  }
  struct gmb_defrag_req *r = calloc(1, sizeof *r);
  if (r == NULL || peer->rid_len > sizeof r->rid) {
    free(r);
    rep.status = GMB_E_SYSTEM;
    snprintf(rep.message, sizeof rep.message, "cannot queue the request");
    gmb__reply_send(b, GMB_SOCK_ADMIN, peer->rid, peer->rid_len, &rep);
    return;
  }
  r->req_id = req->id;
  memcpy(r->rid, peer->rid, peer->rid_len);
  r->rid_len = peer->rid_len;
  r->uid = peer->uid;
  r->scope = scope;
  struct gmb_defrag_req **pp = &b->compact_reqs;
  while (*pp) pp = &(*pp)->next;
  *pp = r;
  log_info("uid %u asked to compact %s", (unsigned)peer->uid,
           scope ? scope->name : "every tenant");
  /* A run already in progress with the same scope answers this one too;
   * otherwise it starts when the current run ends. */
  if (b->compacting && b->compact_scope == scope) r->started = 1;
  defrag_next_admin(b);
}

void gmb__defrag_forget(struct gmb_broker *b, uint64_t id) {
  if (b->compacting) gmb__compact_forget(b->compacting, id);
}

void gmb__defrag_forget_session(struct gmb_broker *b,
                                const struct gmb_session *s) {
  if (b->compacting) gmb__compact_forget_owner(b->compacting, s);
}

void gmb__defrag_shutdown(struct gmb_broker *b) {
  gmb__compact_destroy(b->compacting);
  b->compacting = NULL;
  while (b->compact_reqs) {
    struct gmb_defrag_req *r = b->compact_reqs;
    b->compact_reqs = r->next;
    free(r);
  }
}
