/*
 * admin.c - requests on the admin socket: what operators (gmbctl) ask.
 *
 * The admin socket is a separate ROUTER so that its file mode keeps jobs
 * out; each message is still checked against the uid that sent it, since
 * the mode alone cannot express `admin_uids`.  Every admin action that
 * changes something is logged at info with the uid that asked.
 *
 * Limits (quota, reserve) change only for tenants that exist, configured or
 * seen; a change is written to the state file (statefile.c) before it is
 * applied, so what is in force is what survives a restart.  The invariant
 * kept here is reserve <= quota whenever the quota is set: a change that
 * would break it is refused.  A quota may go below what the tenant holds:
 * nothing is taken back, its new requests are refused until it frees.
 *
 * Tenants made at run time (tenant add, for a Slurm job step or a
 * Kubernetes pod) are proved by a token hash or uids, never by first use,
 * and are not written to the state file: the scheduler's component makes
 * them again.  Removal waits for the tenant's sessions (or ends them when
 * asked), and the tenant admits no new session meanwhile.
 *
 * A reload (SIGHUP or gmbctl reload) is all or nothing: the config file and
 * the state file are both read before anything is applied, and a file that
 * does not read leaves the running configuration as it was.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "admin.h"

#include "core.h"
#include "defrag.h"
#include "gmb.h"
#include "locktab.h"
#include "log.h"
#include "observe.h"
#include "offload.h"
#include "reply.h"
#include "session.h"
#include "sleep.h"
#include "statefile.h"
#include "util.h"
#include "waitq.h"

int gmb__admin_allowed(const struct gmb_broker *b, uid_t uid) {
  return gmb__config_operator(b->cfg.admin_uids, b->cfg.n_admin_uids,
                              gmb__config_overflow_uid(), uid);
}

/* --- quota and reserve ------------------------------------------------- */

/* The tenant a request names, or NULL after filling the refusal. */
static struct gmb_tenant *admin_tenant(struct gmb_broker *b, const char *name,
                                       struct wire_reply *rep) {
  if (!gmb__name_valid(name)) {
    gmb__reply_fail(rep, GMB_E_INVAL, "bad tenant name '%.63s'", name);
    return NULL;
  }
  struct gmb_tenant *t = gmb__tenant_find(b->tenants, name);
  if (t == NULL)
    gmb__reply_fail(rep, GMB_E_NOENT, "no tenant %s (a tenant exists once the "
                    "config names it or a client used it)", name);
  return t;
}

static void admin_tenant_row(struct gmb_tenant *t, struct wire_reply *rep) {
  gmb__observe_tenant_row(t, &rep->u.tenant_row);
  rep->kind = WIRE_TENANT_ROW;
}

struct admin_sum {
  const struct gmb_tenant *except;
  uint64_t total;
};

static int admin_sum_reserve(void *ctx, struct gmb_tenant *t) {
  struct admin_sum *s = ctx;
  if (t != s->except) s->total += t->reserve;
  return 0;
}

static int admin_limit(struct gmb_broker *b, const struct gmb_peer *peer,
                       const struct wire_request *req, struct wire_reply *rep,
                       enum gmb_state_field field) {
  const char *what = field == GMB_STATE_QUOTA ? "quota" : "reservation";
  struct gmb_tenant *t = admin_tenant(b, req->u.admin_limit.tenant, rep);
  if (t == NULL) return 1;
  if (!req->u.admin_limit.set) {
    admin_tenant_row(t, rep);
    return 1;
  }
  uint64_t v = req->u.admin_limit.value;
  char vs[GMB_SIZE_BUFSZ], os[GMB_SIZE_BUFSZ], xs[GMB_SIZE_BUFSZ];
  if (field == GMB_STATE_QUOTA) {
    if (v != 0 && v < t->reserve)
      return gmb__reply_fail(
          rep, GMB_E_INVAL,
          "quota %s of %s would be below its reservation %s: lower the "
          "reservation first (gmbctl reserve set %s SIZE)",
          gmb__size_format(v, vs, sizeof vs), t->name,
          gmb__size_format(t->reserve, xs, sizeof xs), t->name);
  } else {
    if (t->quota != 0 && v > t->quota)
      return gmb__reply_fail(
          rep, GMB_E_INVAL,
          "reservation %s of %s would be above its quota %s: raise the quota "
          "first (gmbctl quota set %s SIZE)",
          gmb__size_format(v, vs, sizeof vs), t->name,
          gmb__size_format(t->quota, xs, sizeof xs), t->name);
    struct gmb_pool_stats ps;
    gmb__pool_stats(b->pool, &ps);
    struct admin_sum sum = {.except = t};
    gmb__tenants_each(b->tenants, admin_sum_reserve, &sum);
    if (v > ps.capacity || sum.total > ps.capacity - v)
      return gmb__reply_fail(
          rep, GMB_E_INVAL,
          "reservation %s of %s would bring the reservations to more than "
          "the device's %s (others hold %s)",
          gmb__size_format(v, vs, sizeof vs), t->name,
          gmb__size_format(ps.capacity, xs, sizeof xs),
          gmb__size_format(sum.total, os, sizeof os));
  }
  uint64_t old = field == GMB_STATE_QUOTA ? t->quota : t->reserve;
  char err[WIRE_MESSAGE_MAX - 64];
  int persisted = 0;
  int rc =
      gmb__statefile_set(b, t->name, field, v, &persisted, err, sizeof err);
  if (rc)
    return gmb__reply_fail(rep, rc, "%s of %s not changed: cannot save the "
                           "state file: %s", what, t->name, err);
  if (field == GMB_STATE_QUOTA)
    gmb__tenant_set_quota(b->tenants, t, v);
  else
    gmb__tenant_set_reserve(b->tenants, t, v);
  if (field == GMB_STATE_QUOTA && v == 0) snprintf(vs, sizeof vs, "unlimited");
  else gmb__size_format(v, vs, sizeof vs);
  if (field == GMB_STATE_QUOTA && old == 0) snprintf(os, sizeof os, "unlimited");
  else gmb__size_format(old, os, sizeof os);
  char note[256] = "";
  if (field == GMB_STATE_QUOTA && v != 0 && t->used > v)
    snprintf(note, sizeof note, "; it holds %s, more than the new quota: "
             "nothing is taken back, its new requests are refused until it "
             "frees memory", gmb__size_format(t->used, xs, sizeof xs));
  if (!persisted)
    snprintf(note + strlen(note), sizeof note - strlen(note),
             "; not saved (no state file configured): lost at restart");
  log_info("uid %u set %s of %s to %s (was %s)%s", (unsigned)peer->uid,
           field == GMB_STATE_QUOTA ? "quota" : "reserve", t->name, vs, os,
           note);
  admin_tenant_row(t, rep);
  snprintf(rep->message, sizeof rep->message, "%s of %s set to %s (was %s)%s",
           what, t->name, vs, os, note);
  /* A smaller reservation leaves room to others that may be waiting; a
   * larger quota may let requests held for it (reclaim.h) be served now
   * rather than refused at the end of their hold. */
  if ((field == GMB_STATE_RESERVE && v < old) ||
      (field == GMB_STATE_QUOTA && old != 0 && (v == 0 || v > old)))
    gmb__waitq_serve(b);
  return 1;
}

/* --- evict --------------------------------------------------------------- */

/* Ends every session of t, each told `why`; returns how many.  The
 * evicted processes may still run and write the memory they mapped: none
 * of the tenant's segments may serve anyone again.  They are empty after;
 * the one the pool keeps lingering goes back to the device too (its pages
 * stay the evicted processes' own until they unmap them). */
static uint32_t admin_end_sessions(struct gmb_broker *b, struct gmb_tenant *t,
                                   const char *why) {
  uint32_t n = 0;
  /* session_end unlinks the session from t->sessions, so take the head
   * each time; it also drops the session's waiting allocations. */
  struct gmb_session *s;
  while ((s = t->sessions) != NULL) {
    char msg[WIRE_MESSAGE_MAX];
    snprintf(msg, sizeof msg, "tenant %s was %s", t->name, why);
    gmb__reply_event(b, s, WIRE_EVENT_EVICTED, 0, msg);
    if (s->lt) gmb__locktab_evict(s->lt);
    gmb__core_session_end(b, s, why);
    n++;
  }
  /* Sessions that ended before, still freed in slices: at once too. */
  gmb__core_reap_tenant(b, t);
  gmb__pool_trim(b->pool);
  gmb__tenant_segments_sync(b->tenants, t);
  return n;
}

static int admin_evict(struct gmb_broker *b, const struct gmb_peer *peer,
                       const struct wire_request *req, struct wire_reply *rep) {
  struct gmb_tenant *t = admin_tenant(b, req->u.admin_evict.tenant, rep);
  if (t == NULL) return 1;
  uint64_t before = t->used;
  char why[128];
  snprintf(why, sizeof why, "evicted by uid %u (gmbctl evict %s)",
           (unsigned)peer->uid, t->name);
  uint32_t n = admin_end_sessions(b, t, why);
  uint64_t freed = before - t->used;
  char fs[GMB_SIZE_BUFSZ];
  log_info("uid %u evicted tenant %s: %u sessions ended, %s freed",
           (unsigned)peer->uid, t->name, n,
           gmb__size_format(freed, fs, sizeof fs));
  rep->kind = WIRE_ADMIN_EVICT;
  rep->u.evict.sessions = n;
  rep->u.evict.bytes_freed = freed;
  snprintf(rep->message, sizeof rep->message,
           "tenant %s: %u sessions ended, %s freed", t->name, n, fs);
  return 1;
}

/* --- pause and resume (sleep.c tells the sessions) ----------------------- */

static int admin_pause(struct gmb_broker *b, const struct gmb_peer *peer,
                       const struct wire_request *req, struct wire_reply *rep) {
  struct gmb_tenant *t = admin_tenant(b, req->u.admin_pause.tenant, rep);
  if (t == NULL) return 1;
  log_info("uid %u asked tenant %s to %s %s%s%s", (unsigned)peer->uid, t->name,
           req->kind == WIRE_ADMIN_PAUSE ? "pause" : "resume",
           req->u.admin_pause.tag[0] ? "tag " : "every tag",
           req->u.admin_pause.tag,
           req->kind == WIRE_ADMIN_PAUSE && req->u.admin_pause.discard
               ? " (discard)"
               : "");
  gmb__sleep_admin(b, t, req, rep);
  /* The tenant's movable allocations are the broker's to offload (every
   * tag, or the broker's own record named): pause offloads the unlocked
   * ones, resume brings back what fits now (the rest at their gmb_lock). */
  const char *tag = req->u.admin_pause.tag;
  if (tag[0] == '\0' || strcmp(tag, GMB_SLEEP_MOVABLE_TAG) == 0) {
    int pause = req->kind == WIRE_ADMIN_PAUSE;
    /* A pause copies a slice now and the rest a slice a loop turn: the
     * reply says what went now, and that the rest is under way (gmbctl
     * status shows it until done). */
    int more = gmb__offload_tenant(b, t, pause, &rep->u.pause.movable,
                                   &rep->u.pause.movable_bytes);
    if (rep->u.pause.movable) {
      char sz[GMB_SIZE_BUFSZ];
      size_t n = strlen(rep->message);
      snprintf(rep->message + n, sizeof rep->message - n, "; %u movable "
               "allocation%s (%s) %s%s", rep->u.pause.movable,
               rep->u.pause.movable == 1 ? "" : "s",
               gmb__size_format(rep->u.pause.movable_bytes, sz, sizeof sz),
               pause ? "offloaded to the broker's host memory"
                     : "brought back",
               more ? ", the rest a slice a loop turn (gmbctl status: "
                      "offload pause)"
                    : "");
      if (pause) gmb__waitq_serve(b);
    }
  }
  return 1;
}

/* --- tenant add and remove (schedulers' node components) --------------- */

/* A tenant made at run time for a job step or a pod: proved by its token
 * hash or uids only (a tenant that proves no one would go to the first uid
 * that connects, which is what a scheduler must not allow), within the
 * device, and with its reservation kept as at `reserve set`. */
static int admin_tenant_add(struct gmb_broker *b, const struct gmb_peer *peer,
                            const struct wire_request *req,
                            struct wire_reply *rep) {
  const struct wire_tenant_add *a = &req->u.admin_tenant_add;
  char qs[GMB_SIZE_BUFSZ], rs[GMB_SIZE_BUFSZ], cs[GMB_SIZE_BUFSZ];
  if (!gmb__name_valid(a->tenant))
    return gmb__reply_fail(rep, GMB_E_INVAL, "bad tenant name '%.63s': use 1 "
                           "to 63 of A-Z a-z 0-9 . _ -, not starting with . "
                           "or -", a->tenant);
  struct gmb_tenant *t = gmb__tenant_find(b->tenants, a->tenant);
  if (t != NULL)
    return gmb__reply_fail(rep, GMB_E_INVAL, "tenant %s exists already%s",
                           t->name, t->removing ? " (its removal waits for "
                           "its sessions to end)" : "");
  if (!a->has_token && a->n_uids == 0)
    return gmb__reply_fail(rep, GMB_E_INVAL, "tenant %s would prove no one: "
                           "give a token hash or uids", a->tenant);
  if (a->n_uids > GMB_CONFIG_UIDS_MAX)
    return gmb__reply_fail(rep, GMB_E_INVAL, "too many uids");
  for (uint32_t i = 0; i < a->n_uids; i++)
    if (a->uids[i] == gmb__config_overflow_uid())
      return gmb__reply_fail(rep, GMB_E_INVAL, "uid %u is the overflow uid: "
                             "every peer without a uid in the broker's user "
                             "namespace shows as it, so it names no one",
                             (unsigned)a->uids[i]);
  struct gmb_pool_stats ps;
  gmb__pool_stats(b->pool, &ps);
  gmb__size_format(a->quota, qs, sizeof qs);
  gmb__size_format(a->reserve, rs, sizeof rs);
  gmb__size_format(ps.capacity, cs, sizeof cs);
  if (a->quota > ps.capacity)
    return gmb__reply_fail(rep, GMB_E_INVAL, "quota %s of %s is more than the "
                           "device's %s", qs, a->tenant, cs);
  if (a->quota != 0 && a->reserve > a->quota)
    return gmb__reply_fail(rep, GMB_E_INVAL, "reservation %s of %s would be "
                           "above its quota %s", rs, a->tenant, qs);
  if (a->reserve) {
    struct admin_sum sum = {.except = NULL};
    gmb__tenants_each(b->tenants, admin_sum_reserve, &sum);
    if (a->reserve > ps.capacity || sum.total > ps.capacity - a->reserve)
      return gmb__reply_fail(rep, GMB_E_NOMEM, "reservation %s of %s would "
                             "bring the reservations to more than the "
                             "device's %s (others hold %s)", rs, a->tenant,
                             cs, gmb__size_format(sum.total, qs, sizeof qs));
  }
  if (gmb__tenants_full(b->tenants) ||
      (t = gmb__tenant_create(b->tenants, a->tenant)) == NULL)
    return gmb__reply_fail(rep, GMB_E_LIMIT, "cannot create tenant %s: the "
                           "broker holds as many tenants as it may",
                           a->tenant);
  t->added = 1;
  gmb__tenant_set_quota(b->tenants, t, a->quota);
  gmb__tenant_set_reserve(b->tenants, t, a->reserve);
  t->priority = a->priority;
  /* Given, it is the tenant's own as a config section's would be: no
   * reload's default_host_quota replaces it. */
  if (a->has_host_quota) {
    t->host_quota = a->host_quota;
    t->host_quota_default = 0;
  }
  for (uint32_t i = 0; i < a->n_uids; i++) t->uids[i] = a->uids[i];
  t->n_uids = a->n_uids;
  t->has_token = a->has_token;
  memcpy(t->token_sha256, a->token_sha256, sizeof t->token_sha256);
  gmb__size_format(a->quota, qs, sizeof qs);
  char hq[GMB_SIZE_BUFSZ + 16];
  if (t->host_quota == 0) snprintf(hq, sizeof hq, "unlimited");
  else gmb__size_format(t->host_quota, hq, sizeof hq);
  if (t->host_quota_default) strcat(hq, " (default)");
  log_info("uid %u added tenant %s: quota %s, reserve %s, host_quota %s, "
           "%s%u uids", (unsigned)peer->uid, t->name,
           a->quota ? qs : "unlimited", rs, hq, a->has_token ? "a token, " : "",
           (unsigned)a->n_uids);
  admin_tenant_row(t, rep);
  snprintf(rep->message, sizeof rep->message, "tenant %s added: quota %s, "
           "host_quota %s", t->name, a->quota ? qs : "unlimited", hq);
  return 1;
}

/* Removes a tenant now when nothing holds it, else marks it: it admits no
 * new session and the reaper takes it when its last session ended
 * (gmb__tenant_idle).  A tenant the config names stays: the config is the
 * operator's word (remove it there and reload). */
static int admin_tenant_remove(struct gmb_broker *b,
                               const struct gmb_peer *peer,
                               const struct wire_request *req,
                               struct wire_reply *rep) {
  struct gmb_tenant *t =
      admin_tenant(b, req->u.admin_tenant_remove.tenant, rep);
  if (t == NULL) return 1;
  if (t->configured)
    return gmb__reply_fail(rep, GMB_E_INVAL, "tenant %s is named in the "
                           "config file: remove it there and reload", t->name);
  char name[sizeof t->name];
  snprintf(name, sizeof name, "%s", t->name);
  uint64_t before = t->used;
  uint32_t evicted = 0;
  t->removing = 1;
  if (req->u.admin_tenant_remove.evict) {
    char why[128];
    snprintf(why, sizeof why, "removed by uid %u", (unsigned)peer->uid);
    evicted = admin_end_sessions(b, t, why);
  }
  rep->kind = WIRE_ADMIN_TENANT_REMOVE;
  rep->u.tenant_remove.evicted = evicted;
  rep->u.tenant_remove.bytes_freed = before - t->used;
  /* A compaction run may hold a pointer to it: then the reaper waits. */
  if (gmb__tenant_idle(b->tenants, t, 1) && !b->compacting &&
      !b->compact_reqs) {
    gmb__tenant_remove(b->tenants, t);
    rep->u.tenant_remove.removed = 1;
    log_info("uid %u removed tenant %s%s", (unsigned)peer->uid, name,
             evicted ? " (its sessions evicted)" : "");
    snprintf(rep->message, sizeof rep->message, "tenant %s removed", name);
    return 1;
  }
  b->reap_pending = 1;
  gmb__broker_tenant_idled(b, t); /* idle once a compaction run is over */
  rep->u.tenant_remove.sessions = t->n_sessions;
  log_info("uid %u asked to remove tenant %s: it goes when its %u sessions "
           "end", (unsigned)peer->uid, name, t->n_sessions);
  snprintf(rep->message, sizeof rep->message, "tenant %s goes when its %u "
           "sessions end (it admits no new one)", name, t->n_sessions);
  return 1;
}

/* --- reload -------------------------------------------------------------- */

/* Appends to the reload summary (kept short: it goes back to gmbctl). */
static void admin_note(char *sum, size_t cap, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static void admin_note(char *sum, size_t cap, const char *fmt, ...) {
  size_t n = strlen(sum);
  if (n + 3 >= cap) return;
  if (n) {
    memcpy(sum + n, "; ", 3);
    n += 2;
  }
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(sum + n, cap - n, fmt, ap);
  va_end(ap);
}

struct admin_hb {
  size_t n;
};

static void admin_count_hb(void *ctx, struct gmb_session *s) {
  struct admin_hb *h = ctx;
  if (s->pidfd < 0) h->n++;
}

/* 1 when tenant section tc lists uid u. */
static int admin_conf_lists(const struct gmb_tenant_conf *tc, uid_t u) {
  for (uint32_t i = 0; i < tc->n_uids; i++)
    if (tc->uids[i] == u) return 1;
  return 0;
}

/* 1 when session s may still act as t under t's (new) uids or token. */
static int admin_session_admitted(const struct gmb_tenant *t,
                                  const struct gmb_session *s) {
  if (gmb__tenant_uid_listed(t, s->uid)) return 1;
  return s->by_token && t->has_token &&
         memcmp(s->token_sha256, t->token_sha256, sizeof t->token_sha256) == 0;
}

/* Copies a tenant section onto the tenant (created when new).  When the
 * section proves the tenant by uids or a token, the sessions that joined
 * it otherwise (its first user's, before an operator named it; or a uid or
 * token the section no longer lists) end: a name an operator configures
 * is the configured parties' only.  Returns the number of sessions ended,
 * or -1 when the tenant cannot be created. */
static int admin_apply_tenant(struct gmb_broker *b,
                              const struct gmb_tenant_conf *tc, int *created) {
  struct gmb_tenant *t = gmb__tenant_find(b->tenants, tc->name);
  *created = 0;
  if (t == NULL) {
    t = gmb__tenant_create(b->tenants, tc->name);
    if (t == NULL) {
      log_error("reload: cannot create tenant %s: the registry is full",
                tc->name);
      return -1;
    }
    *created = 1;
  }
  /* Whoever proved the tenant before and does not now is revoked: a uid
   * no longer listed (its first user's, for a tenant made by first use),
   * a token no longer its own.  Their processes may still map segments of
   * it, from sessions open now or ended before. */
  int revoked = 0;
  if (!*created && (tc->n_uids != 0 || tc->has_token)) {
    for (uint32_t i = 0; i < t->n_uids; i++)
      revoked |= !admin_conf_lists(tc, t->uids[i]);
    if (t->has_owner) revoked |= !admin_conf_lists(tc, t->owner_uid);
    if (t->has_token)
      revoked |= !tc->has_token || memcmp(t->token_sha256, tc->token_sha256,
                                          sizeof t->token_sha256) != 0;
  }
  t->configured = 1;
  gmb__tenant_owner_sync(b->tenants, t); /* no longer its owner's to count */
  gmb__tenant_set_quota(b->tenants, t, tc->quota);
  gmb__tenant_set_reserve(b->tenants, t, tc->reserve);
  t->priority = tc->priority;
  t->host_quota = tc->host_quota;
  t->host_quota_default = 0;
  memcpy(t->uids, tc->uids, tc->n_uids * sizeof tc->uids[0]);
  t->n_uids = tc->n_uids;
  t->has_token = tc->has_token;
  memcpy(t->token_sha256, tc->token_sha256, sizeof t->token_sha256);
  if (t->n_uids == 0 && !t->has_token) return 0;
  t->has_owner = 0;
  t->owner_uid = 0;
  int ended = 0;
  struct gmb_session *s = t->sessions, *next;
  for (; s; s = next) {
    next = s->tenant_next;
    if (admin_session_admitted(t, s)) continue;
    char msg[WIRE_MESSAGE_MAX];
    snprintf(msg, sizeof msg, "tenant %s is configured now, and this "
             "process's uid %u (or token) is not among its uids or token",
             t->name, (unsigned)s->uid);
    gmb__reply_event(b, s, WIRE_EVENT_EVICTED, 0, msg);
    if (s->lt) gmb__locktab_evict(s->lt);
    gmb__core_session_end(b, s, "reload: its uid or token no longer proves "
                          "the tenant");
    ended++;
  }
  /* As after an eviction: no emptied segment they mapped serves again.
   * And since the broker cannot tell which of the tenant's segments a
   * revoked process mapped, in a session open now or one that ended
   * before, every segment of the tenant is sealed and its live bytes move
   * out (gmb__defrag_revoke): what the tenant keeps from now on is in
   * segments made after this reload. */
  if (ended || revoked) {
    gmb__core_reap_tenant(b, t);
    gmb__pool_trim(b->pool);
    gmb__tenant_segments_sync(b->tenants, t);
    gmb__defrag_revoke(b, t);
  }
  return ended;
}

/* The reservations a reload would leave in force: each tenant's from the
 * state file if it overrides it, else from the new config if it names the
 * tenant, else what the tenant has now (tenants no longer configured keep
 * theirs).  Summed over the tenants that exist, those the new config
 * names and those the state file names. */
struct admin_resv {
  struct gmb_broker *b;
  const struct gmb_config *nc;
  uint64_t sum;
};

static uint64_t admin_resv_of(struct admin_resv *r, const char *name,
                              uint64_t now) {
  uint64_t v;
  if (gmb__statefile_lookup(r->b, name, GMB_STATE_RESERVE, &v)) return v;
  const struct gmb_tenant_conf *tc = gmb__config_tenant(r->nc, name);
  return tc ? tc->reserve : now;
}

static void admin_resv_add(struct admin_resv *r, uint64_t v) {
  r->sum = v > UINT64_MAX - r->sum ? UINT64_MAX : r->sum + v;
}

static int admin_resv_tenant(void *ctx, struct gmb_tenant *t) {
  struct admin_resv *r = ctx;
  admin_resv_add(r, admin_resv_of(r, t->name, t->reserve));
  return 0;
}

static void admin_resv_state(void *ctx, const char *name) {
  struct admin_resv *r = ctx;
  if (gmb__tenant_find(r->b->tenants, name) ||
      gmb__config_tenant(r->nc, name))
    return; /* counted already */
  admin_resv_add(r, admin_resv_of(r, name, 0));
}

static int admin_reload_reservations(struct gmb_broker *b,
                                     const struct gmb_config *nc, char *err,
                                     size_t errcap) {
  struct admin_resv r = {b, nc, 0};
  gmb__tenants_each(b->tenants, admin_resv_tenant, &r);
  for (size_t i = 0; i < nc->n_tenants; i++)
    if (gmb__tenant_find(b->tenants, nc->tenants[i].name) == NULL)
      admin_resv_add(&r, admin_resv_of(&r, nc->tenants[i].name, 0));
  gmb__statefile_each(b, admin_resv_state, &r);
  if (r.sum <= b->dev->capacity) return 0;
  char s1[GMB_SIZE_BUFSZ], s2[GMB_SIZE_BUFSZ];
  snprintf(err, errcap, "the reservations would add up to %s (config and "
           "state file), more than the device's %s: not reloaded",
           gmb__size_format(r.sum, s1, sizeof s1),
           gmb__size_format(b->dev->capacity, s2, sizeof s2));
  return GMB_E_INVAL;
}

int gmb__admin_reload(struct gmb_broker *b, char *err, size_t errcap) {
  if (b->config_path[0] == '\0') {
    snprintf(err, errcap, "the broker was started without --config");
    return GMB_E_INVAL;
  }
  struct gmb_config nc;
  int rc = gmb__config_load(b->config_path, &nc, err, errcap);
  if (rc) return rc;
  /* The state path is a restart setting too: read the running one. */
  rc = gmb__statefile_reread(b, err, errcap);
  if (rc) {
    gmb__config_free(&nc);
    return rc;
  }
  /* The same check as at start, but before anything is applied: a
   * reload is all or nothing. */
  rc = admin_reload_reservations(b, &nc, err, errcap);
  if (rc) {
    gmb__config_free(&nc);
    return rc;
  }
  struct gmb_config *oc = &b->cfg;
  char sum[WIRE_MESSAGE_MAX - 64] = "";

  /* What cannot change without a restart keeps its running value (which
   * may have come from a command-line flag rather than the file). */
  if (strcmp(nc.device, oc->device) != 0)
    admin_note(sum, sizeof sum, "device: the config says %s, %s runs until "
               "restart", nc.device, oc->device);
  if (nc.capacity != oc->capacity || nc.device_reserve != oc->device_reserve ||
      nc.client_contexts != oc->client_contexts)
    admin_note(sum, sizeof sum,
               "capacity/device_reserve/client_contexts: kept until restart");
  if (strcmp(nc.run_dir, oc->run_dir) != 0)
    admin_note(sum, sizeof sum, "run_dir: kept until restart");
  if (strcmp(nc.metrics_listen, oc->metrics_listen) != 0)
    admin_note(sum, sizeof sum, "metrics_listen: kept until restart");
  if (nc.admin_http != oc->admin_http)
    admin_note(sum, sizeof sum, "admin_http: kept until restart");
  if (strcmp(nc.state, oc->state) != 0)
    admin_note(sum, sizeof sum, "state: path kept until restart");
  memcpy(nc.device, oc->device, sizeof nc.device);
  nc.capacity = oc->capacity;
  nc.device_reserve = oc->device_reserve;
  nc.client_contexts = oc->client_contexts;
  memcpy(nc.run_dir, oc->run_dir, sizeof nc.run_dir);
  nc.run_dir_per_gpu = oc->run_dir_per_gpu;
  memcpy(nc.metrics_listen, oc->metrics_listen, sizeof nc.metrics_listen);
  nc.admin_http = oc->admin_http;
  memcpy(nc.state, oc->state, sizeof nc.state);

  /* Clients that heartbeat were told the period at Hello; a shorter one
   * now would end them for silence, so it waits for them to go. */
  if (nc.heartbeat_ms < oc->heartbeat_ms) {
    struct admin_hb h = {0};
    gmb__sessions_each(b->sessions, admin_count_hb, &h);
    if (h.n) {
      admin_note(sum, sizeof sum, "heartbeat_ms %u ignored until restart (%zu "
                 "sessions heartbeat every %u ms)", nc.heartbeat_ms, h.n,
                 oc->heartbeat_ms);
      nc.heartbeat_ms = oc->heartbeat_ms;
    }
  }
  nc.default_quota = gmb__config_default_quota(&nc, b->dev->capacity);
  if (nc.default_quota != oc->default_quota)
    admin_note(sum, sizeof sum, "default_quota: kept until restart (the "
               "tenant registry has no setter yet)");

  size_t created = 0, updated = 0, kept = 0, ended = 0;
  for (size_t i = 0; i < nc.n_tenants; i++) {
    int c = 0;
    int n = admin_apply_tenant(b, &nc.tenants[i], &c);
    if (n < 0) continue;
    ended += (size_t)n;
    if (c) created++;
    else updated++;
  }
  if (ended)
    admin_note(sum, sizeof sum, "%zu sessions ended: their uid or token no "
               "longer proves their tenant", ended);
  for (size_t i = 0; i < oc->n_tenants; i++) {
    if (gmb__config_tenant(&nc, oc->tenants[i].name)) continue;
    struct gmb_tenant *t = gmb__tenant_find(b->tenants, oc->tenants[i].name);
    if (t == NULL) continue;
    t->configured = 0;
    gmb__tenant_owner_sync(b->tenants, t); /* its first user's again */
    kept++;
    log_info("reload: tenant %s is no longer in the config; it keeps running "
             "with its current limits and uids", t->name);
  }
  if (kept)
    admin_note(sum, sizeof sum, "%zu tenants no longer configured keep their "
               "limits", kept);

  mode_t om = gmb__config_admin_mode(oc), nm = gmb__config_admin_mode(&nc);
  if (om != nm && b->admin_path[0] && chmod(b->admin_path, nm) != 0)
    log_warn("reload: chmod %s %o: %m", b->admin_path, (unsigned)nm);
  if (om != nm && b->admin_http_path[0] && chmod(b->admin_http_path, nm) != 0)
    log_warn("reload: chmod %s %o: %m", b->admin_http_path, (unsigned)nm);
  /* A --log-level flag wins over the file, at reload as at start. */
  if (b->flag_log_level >= 0) nc.log_level = b->flag_log_level;
  gmb__log_set_level(nc.log_level);

  gmb__config_free(oc);
  b->cfg = nc;
  gmb__core_conn_limits(b);
  gmb__pool_set_grouping(b->pool, b->cfg.compaction);
  gmb__tenants_set_limits(b->tenants, &b->cfg);
  int applied = gmb__statefile_apply(b);
  if (applied > 0)
    admin_note(sum, sizeof sum, "state file overrides %d tenants", applied);
  /* The summary: what happened first, then the notes. */
  int n = snprintf(err, errcap, "reloaded %.200s: %zu tenants updated, %zu "
                   "created", b->config_path, updated, created);
  if (sum[0] && n > 0 && (size_t)n < errcap)
    snprintf(err + n, errcap - (size_t)n, "; %s", sum);
  log_info("%s", err);
  /* Limits may have grown or reservations shrunk: serve who waits. */
  gmb__waitq_serve(b);
  return 0;
}

static int admin_reload(struct gmb_broker *b, const struct gmb_peer *peer,
                        struct wire_reply *rep) {
  char msg[WIRE_MESSAGE_MAX];
  log_info("uid %u asked for a reload of the configuration",
           (unsigned)peer->uid);
  int rc = gmb__admin_reload(b, msg, sizeof msg);
  if (rc) {
    log_error("reload failed, the running configuration is kept: %s", msg);
    return gmb__reply_fail(rep, rc, "%s (the running configuration is kept)",
                           msg);
  }
  rep->kind = WIRE_NONE;
  snprintf(rep->message, sizeof rep->message, "%s", msg);
  return 1;
}

int gmb__admin(struct gmb_broker *b, const struct gmb_peer *peer,
               const struct wire_request *req, struct wire_reply *rep) {
  memset(rep, 0, sizeof *rep);
  rep->id = req->id;
  if (!gmb__admin_allowed(b, peer->uid)) {
    log_warn("admin request from uid %u refused: not an admin uid",
             (unsigned)peer->uid);
    rep->status = GMB_E_AUTH;
    snprintf(rep->message, sizeof rep->message,
             "uid %u is not an admin of this broker (see admin_uids)",
             (unsigned)peer->uid);
    return 1;
  }
  switch (req->kind) {
    case WIRE_ADMIN_STATUS:
      gmb__observe_status(b, rep);
      return 1;
    case WIRE_ADMIN_COMPACT:
      gmb__defrag_admin(b, peer, req); /* answered when the run ends */
      return 0;
    case WIRE_ADMIN_QUOTA:
      return admin_limit(b, peer, req, rep, GMB_STATE_QUOTA);
    case WIRE_ADMIN_RESERVE:
      return admin_limit(b, peer, req, rep, GMB_STATE_RESERVE);
    case WIRE_ADMIN_EVICT:
      return admin_evict(b, peer, req, rep);
    case WIRE_ADMIN_RELOAD:
      return admin_reload(b, peer, rep);
    case WIRE_ADMIN_TENANT_ADD:
      return admin_tenant_add(b, peer, req, rep);
    case WIRE_ADMIN_TENANT_REMOVE:
      return admin_tenant_remove(b, peer, req, rep);
    case WIRE_ADMIN_PAUSE:
    case WIRE_ADMIN_RESUME:
      return admin_pause(b, peer, req, rep);
    case WIRE_ADMIN_SNAPSHOT:
      gmb__observe_snapshot(b, req->u.admin_snapshot.segment,
                            req->u.admin_snapshot.offset,
                            req->u.admin_snapshot.limit, rep);
      return 1;
    case WIRE_ADMIN_METRICS:
      rep->u.metrics.text = gmb__observe_metrics(b, 1);
      if (rep->u.metrics.text == NULL) {
        rep->status = GMB_E_PROTO;
        snprintf(rep->message, sizeof rep->message,
                 "metrics are not implemented by this broker yet");
      } else {
        rep->kind = WIRE_ADMIN_METRICS;
      }
      return 1;
    default:
      rep->status = GMB_E_PROTO;
      snprintf(rep->message, sizeof rep->message,
               "%s is not an admin request", gmb__wire_kind_name(req->kind));
      return 1;
  }
}
