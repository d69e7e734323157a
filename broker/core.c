/*
 * core.c - the broker's life cycle (core.h).
 *
 * Order matters when a session ends: it leaves its tenant's list first, so
 * that segments retired while its memory is freed are not announced to a
 * session that is going away; its moves are abandoned before its memory is
 * freed, so compaction never commits a move of freed memory.
 */
#include "core.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include "connguard.h"
#include "defrag.h"
#include "gmb.h"
#include "locktab.h"
#include "log.h"
#include "observe.h"
#include "offload.h"
#include "reclaim.h"
#include "reply.h"
#include "session.h"
#include "sleep.h"
#include "statefile.h"
#include "util.h"
#include "waitq.h"

/* The pool's retire callback: a segment of tenant `arena_tag` goes back to
 * the device.  Sessions that mapped it are told, and on a device that frees
 * only once every holder closed it (cuda), recorded as holders. */
static void core_retire(void *ctx, const struct gmb_dseg *seg,
                        void *arena_tag) {
  struct gmb_broker *b = ctx;
  struct gmb_tenant *t = arena_tag;
  if (b == NULL || t == NULL) return;
  if (b->tenants) gmb__tenant_segment_retired(b->tenants, t, seg->size);
  for (struct gmb_session *s = t->sessions; s; s = s->tenant_next) {
    if (!gmb__session_seg_forget(s, seg->id)) continue;
    gmb__reply_event(b, s, WIRE_EVENT_SEGMENT_RETIRED, seg->id, NULL);
    if (gmb__device_seg_hold(b->dev, seg->id, s->id, t) != 0)
      log_error("segment %llu: out of host memory recording that session "
                "%llu holds it: it is freed at once",
                (unsigned long long)seg->id, (unsigned long long)s->id);
  }
}

/* The device's retire_note: a retired segment of tenant `owner` parked
 * (delta > 0) or freed at last. */
static void core_retire_note(void *ctx, void *owner, int64_t delta) {
  (void)ctx;
  if (owner) gmb__tenant_retiring(owner, delta);
}

void gmb__core_fd_split(uint64_t have, uint64_t segs, uint32_t max_sessions,
                        uint32_t *sessions, uint64_t *seg_max) {
  uint64_t reserve = have / 4 < GMB_FDS_RESERVED ? have / 4 : GMB_FDS_RESERVED;
  uint64_t avail = have - reserve;
  uint64_t n = max_sessions;
  if (segs > avail || n > (avail - segs) / GMB_FDS_PER_SESSION) {
    uint64_t after_segs = segs < avail ? (avail - segs) / GMB_FDS_PER_SESSION
                                       : 0;
    uint64_t half = avail / 2 / GMB_FDS_PER_SESSION;
    uint64_t fit = after_segs > half ? after_segs : half;
    if (fit < n) n = fit;
  }
  if (n < 1) n = 1;
  uint64_t left = avail > n * GMB_FDS_PER_SESSION
                      ? avail - n * GMB_FDS_PER_SESSION
                      : 1;
  *sessions = (uint32_t)n;
  *seg_max = left >= segs ? 0 : left;
}

/* Raises RLIMIT_NOFILE to what the broker may need: every session's
 * descriptors, one per segment the device can hold, and a reserve; then
 * shares out what it got (gmb__core_fd_split).  Running out of
 * descriptors must never happen: libzmq aborts when accept() fails with
 * EMFILE. */
static void core_fd_budget(struct gmb_broker *b) {
  uint64_t segs = b->dev->capacity / GMB_SEGMENT_ALIGN + 1;
  uint64_t want = GMB_FDS_RESERVED + segs +
                  (uint64_t)b->cfg.max_sessions * GMB_FDS_PER_SESSION;
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) != 0) {
    log_warn("getrlimit(RLIMIT_NOFILE): %s", strerror(errno));
    return;
  }
  if (rl.rlim_cur != RLIM_INFINITY && rl.rlim_cur < want) {
    struct rlimit nl = rl;
    nl.rlim_cur = want;
    if (nl.rlim_max != RLIM_INFINITY && nl.rlim_max < want)
      nl.rlim_max = want; /* allowed with CAP_SYS_RESOURCE */
    if (setrlimit(RLIMIT_NOFILE, &nl) != 0 && rl.rlim_cur < rl.rlim_max) {
      nl = rl;
      nl.rlim_cur = rl.rlim_max; /* as far as the hard limit goes */
      if (setrlimit(RLIMIT_NOFILE, &nl) != 0)
        log_warn("setrlimit(RLIMIT_NOFILE, %llu): %s",
                 (unsigned long long)nl.rlim_cur, strerror(errno));
    }
    getrlimit(RLIMIT_NOFILE, &rl);
  }
  uint64_t have = rl.rlim_cur == RLIM_INFINITY ? want : rl.rlim_cur;
  uint32_t sessions;
  uint64_t seg_max;
  gmb__core_fd_split(have, segs, b->cfg.max_sessions, &sessions, &seg_max);
  b->fd_sessions_max = sessions;
  b->dev->seg_max = seg_max;
  if (sessions < b->cfg.max_sessions || seg_max) {
    char segcap[64] = "";
    if (seg_max)
      snprintf(segcap, sizeof segcap, ", and at most %llu segments at a time",
               (unsigned long long)seg_max);
    log_warn("RLIMIT_NOFILE is %llu, less than the %llu that %u sessions "
             "(max_sessions, %d descriptors each) and %llu segments (%s in "
             "2 MiB pieces) need: %u sessions admitted%s; raise the limit "
             "(LimitNOFILE=, --ulimit nofile=) to serve more",
             (unsigned long long)have, (unsigned long long)want,
             b->cfg.max_sessions, GMB_FDS_PER_SESSION,
             (unsigned long long)segs, b->dev->desc, sessions, segcap);
  }
}

void gmb__core_conn_limits(struct gmb_broker *b) {
  uint64_t total = (uint64_t)gmb__core_max_sessions(b) + GMB_CONN_UNNAMED;
  uint64_t per_uid =
      (uint64_t)b->cfg.max_sessions_per_uid + GMB_CONN_UNNAMED_PER_UID;
  /* Under a low descriptor limit, one uid must not take every place. */
  if (per_uid > total / 2) per_uid = total / 2 ? total / 2 : 1;
  gmb__connguard_admins(b->cfg.admin_uids, b->cfg.n_admin_uids);
  gmb__connguard_limits(total > UINT32_MAX ? UINT32_MAX : (uint32_t)total,
                        per_uid > UINT32_MAX ? UINT32_MAX : (uint32_t)per_uid);
}

uint32_t gmb__core_max_sessions(const struct gmb_broker *b) {
  uint32_t m = b->cfg.max_sessions;
  if (b->fd_sessions_max && b->fd_sessions_max < m) m = b->fd_sessions_max;
  return m;
}

size_t gmb__core_reap(struct gmb_broker *b, int named) {
  if ((!b->reap_pending && !named) || b->closing) return 0;
  /* A compaction run or an admin request may name a tenant: wait. */
  if (b->compacting || b->compact_reqs) return 0;
  b->reap_pending = 0;
  /* Unnamed, only the tenants that may have gone idle since the last
   * reap: this comes after every session's end. */
  size_t n = named ? gmb__tenants_reap(b->tenants, named)
                   : gmb__tenants_reap_listed(b->tenants);
  if (n) log_debug("%zu idle tenants made by first use went away", n);
  return n;
}

size_t gmb__core_reap_full(struct gmb_broker *b) {
  if (b->closing || b->compacting || b->compact_reqs) return 0;
  struct gmb_reap_full *r = &b->reap_full;
  const uint64_t now = gmb__now_ns();
  if (now - r->window_ns >= GMB_NS_PER_S) {
    r->window_ns = now;
    r->in_window = 0;
  }
  if (!r->hint && r->in_window >= GMB_REAP_FULL_WALKS) {
    r->skipped++;
    return 0;
  }
  r->hint = 0;
  r->in_window++;
  r->walks++;
  return gmb__core_reap(b, 1);
}

int gmb__core_reservations(struct gmb_broker *b, char *msg, size_t cap) {
  return gmb__tenants_check_reservations(b->tenants, b->dev->capacity, msg,
                                         cap);
}

int gmb__core_open(struct gmb_broker *b, char *err, size_t errcap) {
  char why[512];
  uint64_t reserve = b->cfg.device_reserve == GMB_DEVICE_RESERVE_AUTO
                         ? GMB_DEVICE_RESERVE_CONTEXTS | b->cfg.client_contexts
                         : b->cfg.device_reserve &
                               (GMB_DEVICE_RESERVE_CONTEXTS - 1);
  int rc = gmb__device_open(b->cfg.device, b->cfg.capacity, reserve, &b->dev,
                            why, sizeof why);
  if (rc) {
    snprintf(err, errcap, "device %s: %s", b->cfg.device, why);
    return rc;
  }
  b->cfg.default_quota = gmb__config_default_quota(&b->cfg, b->dev->capacity);
  char dq[GMB_SIZE_BUFSZ];
  if (b->cfg.default_quota == 0)
    log_warn("default_quota is 0: a tenant the config does not name may "
             "take the whole device; on a broker that serves users who do "
             "not trust each other, set default_quota (auto: a quarter of "
             "the device)");
  else
    log_info("default_quota: %s for each uid's tenants made by first use",
             gmb__size_format(b->cfg.default_quota, dq, sizeof dq));
  if (geteuid() == gmb__config_overflow_uid())
    log_warn("the broker runs as uid %u, the overflow uid that every peer "
             "without a uid in its user namespace shows as: its own uid is "
             "no operator, so only admin_uids are", (unsigned)geteuid());
  uint64_t dh = gmb__config_default_host_quota(&b->cfg);
  if (dh == 0)
    log_warn("default_host_quota is 0: one tenant the config does not name "
             "may take all of offload_host_max, and no one else is "
             "offloaded then");
  else
    log_info("default_host_quota: %s of host memory for each tenant the "
             "config does not name", gmb__size_format(dh, dq, sizeof dq));
  b->dev->retire_note = core_retire_note;
  b->dev->retire_ctx = b;
  b->pool = gmb__pool_new(b->dev, core_retire, b);
  if (b->pool) gmb__pool_set_grouping(b->pool, b->cfg.compaction);
  b->tenants = b->pool ? gmb__tenants_new(b->pool, &b->cfg) : NULL;
  b->sessions = gmb__sessions_new();
  b->observe = gmb__observe_new();
  if (b->pool == NULL || b->tenants == NULL || b->sessions == NULL ||
      b->observe == NULL) {
    snprintf(err, errcap, "out of memory at start-up");
    return GMB_E_SYSTEM;
  }
  core_fd_budget(b);
  return 0;
}

static void core_end_stopping(void *ctx, struct gmb_session *s) {
  gmb__core_session_end(ctx, s, "the broker is stopping");
}

void gmb__core_close(struct gmb_broker *b) {
  /* Waiters get no answer and mapped segments no retirement events: the
   * sessions were told the broker stops, and are ended one by one. */
  b->closing = 1;
  while (b->reap_head) gmb__core_reap_tenant(b, b->reap_head->tenant);
  if (b->sessions) gmb__sessions_each(b->sessions, core_end_stopping, b);
  gmb__sessions_destroy(b->sessions);
  b->sessions = NULL;
  gmb__tenants_destroy(b->tenants);
  b->tenants = NULL;
  gmb__pool_destroy(b->pool);
  b->pool = NULL;
  gmb__device_close(b->dev);
  b->dev = NULL;
  gmb__observe_destroy(b->observe);
  b->observe = NULL;
  gmb__statefile_free(b->statefile);
  b->statefile = NULL;
}

/* The VMM memory an ending session's process made died with it (the
 * driver frees a process's allocations at its exit), or it released it
 * before Bye: uncounted at once, sliced ending or not.  Returns the bytes. */
static uint64_t core_session_vmm_gone(struct gmb_broker *b,
                                      struct gmb_session *s) {
  uint64_t vmm = s->vmm;
  if (vmm) {
    gmb__tenant_vmm(s->tenant, -(int64_t)vmm);
    if (b->dev) gmb__device_external(b->dev, -(int64_t)vmm);
    s->vmm = 0;
  }
  return vmm;
}

/* Before its descriptor channel is closed: the channel's handler may keep
 * it while the peer has descriptors unread (fdchan.h). */
static void core_fdconn_gone(struct gmb_broker *b, struct gmb_session *s) {
  if (b->fdconn_gone && s->fdconn >= 0) b->fdconn_gone(b, s);
}

void gmb__core_session_end(struct gmb_broker *b, struct gmb_session *s,
                           const char *why) {
  struct gmb_tenant *t = s->tenant;
  gmb__reclaim_forget_session(b, s);
  gmb__offload_forget_session(b, s); /* before its sleep records */
  gmb__sleep_forget_session(s);
  gmb__waitq_drop_session(b, s);
  gmb__session_detach(s);
  gmb__defrag_forget_session(b, s);
  uint64_t freed = gmb__pool_free_owner(b->pool, t->arena, s);
  gmb__tenant_uncharge(t, freed);
  if (freed) b->pool_ops++;
  uint64_t vmm = core_session_vmm_gone(b, s);
  freed += vmm; /* room for waiters, below */
  /* Locks it held die with it: the table goes, and so do its slots. */
  gmb__locktab_destroy(s->lt);
  s->lt = NULL;
  log_info("session %" PRIu64 " (tenant %s, uid %u, pid %d) ended: %s; %"
           PRIu64 " bytes in %" PRIu64 " allocations freed%s", s->id,
           t->name, (unsigned)s->uid, (int)s->pid, why, freed - vmm,
           s->allocations, vmm ? " (and its VMM memory)" : "");
  /* Retired cuda segments it had yet to close: its process's mappings died
   * with it (or it closed them before Bye), so it holds them no longer. */
  int unparked = b->dev ? gmb__device_holder_gone(b->dev, s->id) : 0;
  core_fdconn_gone(b, s);
  gmb__session_free(b->sessions, s);
  gmb__broker_tenant_idled(b, t);
  if (freed || unparked) gmb__waitq_serve(b);
  /* Its ask was the last in flight: held requests need not wait on. */
  gmb__reclaim_settle(b);
}

/* --- ending in slices ---------------------------------------------------- */

void gmb__core_session_end_sliced(struct gmb_broker *b, struct gmb_session *s,
                                  const char *why) {
  if (s->reaping) return;
  struct gmb_tenant *t = s->tenant;
  /* Ending at once walks the tenant's arena once: cheap while it holds
   * few allocations (the walk is what a slice bounds). */
  struct gmb_arena_stats as;
  gmb__pool_arena_stats(t->arena, &as);
  if (b->closing || s->allocations == 0 ||
      as.allocations + as.segments <= GMB_CORE_REAP_RANGES / 2) {
    gmb__core_session_end(b, s, why);
    return;
  }
  gmb__reclaim_forget_session(b, s);
  gmb__offload_forget_session(b, s); /* before its sleep records */
  gmb__sleep_forget_session(s);
  gmb__waitq_drop_session(b, s);
  gmb__defrag_forget_session(b, s);
  uint64_t vmm = core_session_vmm_gone(b, s);
  /* No gmb_lock can claim its movable allocations from now on, and no
   * move starts: the broker claims through this table (defrag.c). */
  gmb__locktab_destroy(s->lt);
  s->lt = NULL;
  core_fdconn_gone(b, s);
  gmb__session_unlink(b->sessions, s);
  s->reaping = 1;
  s->reap_next = NULL;
  if (b->reap_tail)
    b->reap_tail->reap_next = s;
  else
    b->reap_head = s;
  b->reap_tail = s;
  t->reaping++;
  t->reaping_bytes += s->used;
  log_info("session %" PRIu64 " (tenant %s, uid %u, pid %d) ended: %s; %"
           PRIu64 " bytes in %" PRIu64 " allocations freed in slices", s->id,
           t->name, (unsigned)s->uid, (int)s->pid, why, s->used,
           s->allocations);
  int unparked = b->dev ? gmb__device_holder_gone(b->dev, s->id) : 0;
  if (unparked || vmm) gmb__waitq_serve(b);
  gmb__reclaim_settle(b);
}

static int core_doomed(void *ctx, void *owner) {
  (void)ctx;
  return ((const struct gmb_session *)owner)->reaping;
}

static void core_freed(void *ctx, void *owner, uint64_t bytes) {
  (void)ctx;
  struct gmb_session *s = owner;
  struct gmb_tenant *t = s->tenant;
  GMB_ASSERT(s->allocations > 0 && s->used >= bytes &&
             t->reaping_bytes >= bytes && "a reaped session's sums");
  s->allocations--;
  s->used -= bytes;
  t->reaping_bytes -= bytes;
  gmb__tenant_uncharge(t, bytes);
}

/* Frees the sessions of the reap list that hold nothing any more;
 * returns how many. */
static size_t core_reap_done(struct gmb_broker *b) {
  size_t n = 0;
  struct gmb_session **pp = &b->reap_head, *prev = NULL;
  while (*pp) {
    struct gmb_session *s = *pp;
    if (s->allocations != 0) {
      prev = s;
      pp = &s->reap_next;
      continue;
    }
    GMB_ASSERT(s->used == 0 && "a reaped session holds no bytes");
    *pp = s->reap_next;
    if (b->reap_tail == s) b->reap_tail = prev;
    struct gmb_tenant *t = s->tenant;
    t->reaping--;
    if (t->reaping == 0) t->reap_cursor = 0;
    gmb__session_free(b->sessions, s);
    gmb__broker_tenant_idled(b, t);
    n++;
  }
  return n;
}

int gmb__core_reap_step(struct gmb_broker *b, uint64_t deadline_ns) {
  int freed_any = 0;
  while (b->reap_head) {
    /* The oldest ended session's tenant: one walk of its arena frees what
     * every ended session of that tenant holds. */
    struct gmb_tenant *t = b->reap_head->tenant;
    uint64_t before = t->reaping_bytes, n_before = t->reaping;
    int fresh = t->reap_cursor == 0;
    if (fresh) t->reap_pass_freed = 0;
    int end = gmb__pool_free_owners_step(b->pool, t->arena, core_doomed,
                                         core_freed, b, &t->reap_cursor,
                                         GMB_CORE_REAP_RANGES);
    if (t->reaping_bytes != before) {
      freed_any = 1;
      b->pool_ops++;
      t->reap_pass_freed += before - t->reaping_bytes;
    }
    core_reap_done(b);
    /* A whole pass over the arena that freed nothing while the same
     * sessions still hold memory: their allocations are not where the
     * walk looks, which is a bug.  Free them the slow way rather than
     * walk for ever. */
    if (end && t->reaping && t->reaping == n_before &&
        t->reap_pass_freed == 0 && t->reaping_bytes == before) {
      log_error("tenant %s: %u ended sessions hold %" PRIu64 " bytes that "
                "a whole walk of its arena did not find; freed at once",
                t->name, t->reaping, t->reaping_bytes);
      for (struct gmb_session *s = b->reap_head; s; s = s->reap_next) {
        if (s->tenant != t) continue;
        uint64_t f = gmb__pool_free_owner(b->pool, t->arena, s);
        gmb__tenant_uncharge(t, f);
        t->reaping_bytes -= f < t->reaping_bytes ? f : t->reaping_bytes;
        s->allocations = 0;
        s->used = 0;
      }
      core_reap_done(b);
    }
    if (gmb__now_ns() >= deadline_ns) break;
  }
  if (freed_any) {
    gmb__waitq_serve(b);
    gmb__reclaim_settle(b);
  }
  return b->reap_head != NULL;
}

void gmb__core_reap_tenant(struct gmb_broker *b, struct gmb_tenant *t) {
  if (t->reaping == 0) return;
  uint64_t cursor = 0;
  while (!gmb__pool_free_owners_step(b->pool, t->arena, core_doomed,
                                     core_freed, b, &cursor, UINT64_MAX)) {
  }
  t->reap_cursor = 0;
  core_reap_done(b);
  b->pool_ops++;
  GMB_ASSERT(t->reaping == 0 && "one whole walk frees every ended session");
}

static int core_check_sessions(void *ctx, struct gmb_tenant *t) {
  *(int *)ctx += gmb__tenant_sessions_check(t);
  return 0;
}

static int core_sum_reaping(void *ctx, struct gmb_tenant *t) {
  *(uint64_t *)ctx += t->reaping_bytes;
  return 0;
}

static int core_sum_retiring(void *ctx, struct gmb_tenant *t) {
  *(uint64_t *)ctx += t->retiring;
  return 0;
}

static int core_sum_vmm(void *ctx, struct gmb_tenant *t) {
  *(uint64_t *)ctx += t->vmm;
  return 0;
}

int gmb__core_check(struct gmb_broker *b) {
  int bad = gmb__pool_check(b->pool) + gmb__tenant_check(b->tenants) +
            gmb__reclaim_check(b) + gmb__waitq_check(b) +
            gmb__sleep_check(b) + gmb__offload_check(b);
  gmb__tenants_each(b->tenants, core_check_sessions, &bad);
  /* The ended sessions being freed hold what their tenants count. */
  uint64_t reaping = 0, counted = 0;
  for (const struct gmb_session *s = b->reap_head; s; s = s->reap_next)
    reaping += s->used;
  gmb__tenants_each(b->tenants, core_sum_reaping, &counted);
  if (reaping != counted) {
    log_error("check: ended sessions hold %llu bytes, their tenants count "
              "%llu", (unsigned long long)reaping,
              (unsigned long long)counted);
    bad++;
  }
  /* Every parked segment is counted against its tenant (retire_note). */
  uint64_t retiring = 0;
  gmb__tenants_each(b->tenants, core_sum_retiring, &retiring);
  if (b->dev && retiring != b->dev->retiring_bytes) {
    log_error("check: tenants count %llu retiring bytes, the device %llu",
              (unsigned long long)retiring,
              (unsigned long long)b->dev->retiring_bytes);
    bad++;
  }
  /* Every external byte the device counts is a session's VMM memory. */
  uint64_t vmm = 0;
  gmb__tenants_each(b->tenants, core_sum_vmm, &vmm);
  if (b->dev && vmm != b->dev->external) {
    log_error("check: tenants count %llu VMM bytes, the device %llu",
              (unsigned long long)vmm, (unsigned long long)b->dev->external);
    bad++;
  }
  return bad;
}
