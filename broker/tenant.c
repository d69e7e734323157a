/*
 * tenant.c - the tenant registry, admission (who may act as whom), quota
 * accounting and the reservation rule (see tenant.h for the rule).
 *
 * Tenants are kept in a red-black tree by name; a broker serves a handful
 * to a few thousand, and lookups happen once per session, not per request
 * (a session keeps its tenant pointer).  A default tenant (uid-N) is
 * removed (gmb__tenant_remove, driven by core.c) once it is idle: no
 * session, no memory, no waiter, no limit an operator set; nothing else
 * points to it then, so a session's pointer stays valid.  Other tenants
 * made by first use stay (their first uid owns them), unless the registry
 * is full: then idle ones go too.
 *
 * The registry keeps `reserve_short`, the sum over tenants of
 * max(0, reserve - segment_bytes), updated whenever either term of a
 * tenant changes, so that the reservation rule costs O(1) per allocation.
 * Every change of `reserve` or `segment_bytes` goes through
 * tenant_short_update(); gmb__tenant_check() recounts the sum.
 *
 * Uid budgets (tenant.h) live in a short list, one record per uid that has
 * an ad-hoc tenant, counted by the tenants pointing to it and freed with
 * the last.  A tenant joins its owner's budget when it gets its owner and
 * leaves it when it is configured or an operator sets its quota; bytes it
 * charged while a member stay charged to the budget until freed, so the
 * budget's sum never drifts.
 *
 * The tenants each uid made by first use (max_tenants_per_uid) are counted
 * per uid in a small tree, kept as a tenant's owner or `configured`
 * changes (gmb__tenant_owner_sync) and as it goes, so that a Hello that
 * would make one more reads a count rather than walking every tenant: a
 * uid at its limit can send such Hellos at will.  gmb__tenant_check
 * recounts them.
 */
#include "tenant.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>

#include "rbtree.h"
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gmb.h"
#include "log.h"
#include "util.h"

#define TENANTS_MAX 4096

struct tenant_node {
  RB_ENTRY(tenant_node) link;
  struct gmb_tenant t;
};

static int tenant_cmp(const struct tenant_node *a, const struct tenant_node *b) {
  return strcmp(a->t.name, b->t.name);
}

RB_HEAD(tenant_tree, tenant_node);
RB_GENERATE_STATIC(tenant_tree, tenant_node, link, tenant_cmp)

/* The shared budget of one uid's ad-hoc tenants. */
struct gmb_uid_budget {
  struct gmb_uid_budget *next;
  uid_t uid;
  unsigned refs;   /* tenants pointing to it */
  uint64_t used;   /* sum of their budget_charged */
  uint64_t retiring; /* sum of their `retiring` */
  uint64_t vmm;      /* sum of their `vmm` */
  uint64_t limit;  /* gmb__tenants_uid_budget(), fixed at start; 0: none */
};

/* Wrong tokens of one uid lately (tenant_guess_*): a leaky bucket of
 * TENANT_GUESS_BURST, one drained per TENANT_GUESS_NS.  A uid whose bucket
 * is full has its next token refused unchecked, so guessing runs at one
 * try a second per uid, not at the loop's 15,000 Hellos a second. */
#define TENANT_GUESS_UIDS 64
#define TENANT_GUESS_BURST 10
#define TENANT_GUESS_NS GMB_NS_PER_S
struct tenant_guess {
  uid_t uid;
  uint32_t n;     /* wrong tokens in the bucket; 0: a free slot */
  uint64_t at_ns; /* when the bucket last drained one */
};

/* How many tenants one uid made by first use (tenant_made_now). */
struct tenant_made {
  RB_ENTRY(tenant_made) link;
  uid_t uid;
  uint32_t n;
  uint32_t seen; /* gmb__tenant_check's recount */
};

static int tenant_made_cmp(const struct tenant_made *a,
                           const struct tenant_made *b) {
  return a->uid < b->uid ? -1 : a->uid > b->uid;
}

RB_HEAD(tenant_made_tree, tenant_made);
RB_GENERATE_STATIC(tenant_made_tree, tenant_made, link, tenant_made_cmp)

struct gmb_tenants {
  struct tenant_tree tree;
  struct tenant_made_tree made; /* uids with a tenant made by first use */
  struct tenant_guess guesses[TENANT_GUESS_UIDS];
  size_t count;
  struct gmb_pool *pool;
  uint64_t default_quota;
  uint64_t uid_budget;    /* default_quota (0: no budget) */
  struct gmb_uid_budget *budgets;
  uint64_t reserve_short; /* sum of max(0, reserve - segment_bytes) */
  uint32_t max_per_uid;   /* tenants a uid may make by first use; 0: any */
  double holes_frac;      /* the config's cache_holes */
  uint64_t default_host_quota; /* resolved (gmb__config_default_host_quota) */
  size_t reserving;       /* tenants with a reservation */
  uint64_t made_lookups;  /* lookups of a uid's count (tenant_made_of) */
  struct gmb_tenant *idle_head; /* gmb__tenant_may_idle's list */
  uint64_t reap_visits;   /* tenants gmb__tenants_reap_listed looked at */
};

static uint64_t tenant_short(const struct gmb_tenant *t) {
  return t->reserve > t->segment_bytes ? t->reserve - t->segment_bytes : 0;
}

/* Sets t's reserve and segment_bytes, keeping the registry's sum. */
static void tenant_short_update(struct gmb_tenants *ts, struct gmb_tenant *t,
                                uint64_t reserve, uint64_t segment_bytes) {
  uint64_t before = tenant_short(t);
  GMB_ASSERT(before <= ts->reserve_short && "reservation sum drifted");
  ts->reserving = ts->reserving - (t->reserve > 0) + (reserve > 0);
  t->reserve = reserve;
  t->segment_bytes = segment_bytes;
  ts->reserve_short = ts->reserve_short - before + tenant_short(t);
}

/* Makes ad-hoc t (owned, not configured, quota not set) a member of its
 * owner's budget.  0, or -1 out of host memory (then t has no budget and
 * only its own quota limits it: the log says so). */
static int tenant_budget_join(struct gmb_tenants *ts, struct gmb_tenant *t) {
  GMB_ASSERT(t->has_owner && t->budget == NULL && "budget joined twice");
  if (t->configured || t->quota_set) return 0;
  struct gmb_uid_budget *bu = ts->budgets;
  while (bu && bu->uid != t->owner_uid) bu = bu->next;
  if (bu == NULL) {
    bu = calloc(1, sizeof *bu);
    if (bu == NULL) {
      log_error("tenant %s: out of host memory for uid %u's budget",
                t->name, (unsigned)t->owner_uid);
      return -1;
    }
    bu->uid = t->owner_uid;
    bu->limit = ts->uid_budget;
    bu->next = ts->budgets;
    ts->budgets = bu;
  }
  bu->refs++;
  t->budget = bu;
  return 0;
}

/* Drops t's pointer to its budget as t is removed (holding nothing, so
 * it has no bytes charged there), freeing the budget with its last. */
static void tenant_budget_leave(struct gmb_tenants *ts, struct gmb_tenant *t) {
  struct gmb_uid_budget *bu = t->budget;
  if (bu == NULL) return;
  GMB_ASSERT(t->budget_charged == 0 && "a tenant left its budget holding");
  /* Its retiring bytes: none, as it has no session left to hold them. */
  bu->retiring -= t->retiring < bu->retiring ? t->retiring : bu->retiring;
  t->retiring = 0;
  bu->vmm -= t->vmm < bu->vmm ? t->vmm : bu->vmm;
  t->vmm = 0;
  t->budget = NULL;
  GMB_ASSERT(bu->refs > 0 && "uid budget count drifted");
  if (--bu->refs) return;
  GMB_ASSERT(bu->used == 0 && "a uid budget freed while it holds bytes");
  struct gmb_uid_budget **pp = &ts->budgets;
  while (*pp != bu) pp = &(*pp)->next;
  *pp = bu->next;
  free(bu);
}

/* 1 when t's new bytes are charged to its uid's budget. */
static int tenant_budget_member(const struct gmb_tenant *t) {
  return t->budget != NULL && !t->configured && !t->quota_set;
}

static struct gmb_tenant *tenant_add(struct gmb_tenants *ts,
                                     const char *name) {
  if (ts->count >= TENANTS_MAX) return NULL;
  struct tenant_node *n = calloc(1, sizeof *n);
  if (n == NULL) return NULL;
  snprintf(n->t.name, sizeof n->t.name, "%s", name);
  n->t.holes_frac = ts->holes_frac;
  /* Until the config names it (gmb__tenants_new, a reload). */
  n->t.host_quota = ts->default_host_quota;
  n->t.host_quota_default = 1;
  n->t.arena = gmb__pool_arena_new(ts->pool, &n->t);
  if (n->t.arena == NULL) {
    free(n);
    return NULL;
  }
  RB_INSERT(tenant_tree, &ts->tree, n);
  ts->count++;
  return &n->t;
}

struct gmb_tenants *gmb__tenants_new(struct gmb_pool *pool,
                                     const struct gmb_config *cfg) {
  struct gmb_tenants *ts = calloc(1, sizeof *ts);
  if (ts == NULL) return NULL;
  RB_INIT(&ts->tree);
  RB_INIT(&ts->made);
  ts->pool = pool;
  ts->default_quota = cfg->default_quota;
  ts->uid_budget = ts->default_quota;
  ts->max_per_uid = cfg->max_tenants_per_uid;
  ts->holes_frac = cfg->cache_holes;
  ts->default_host_quota = gmb__config_default_host_quota(cfg);
  for (size_t i = 0; i < cfg->n_tenants; i++) {
    const struct gmb_tenant_conf *tc = &cfg->tenants[i];
    struct gmb_tenant *t = tenant_add(ts, tc->name);
    if (t == NULL) {
      gmb__tenants_destroy(ts);
      return NULL;
    }
    t->configured = 1;
    t->quota = tc->quota;
    gmb__tenant_set_reserve(ts, t, tc->reserve);
    t->priority = tc->priority;
    t->host_quota = tc->host_quota;
    t->host_quota_default = 0;
    memcpy(t->uids, tc->uids, tc->n_uids * sizeof tc->uids[0]);
    t->n_uids = tc->n_uids;
    t->has_token = tc->has_token;
    memcpy(t->token_sha256, tc->token_sha256, sizeof t->token_sha256);
    if (t->n_uids == 0 && !t->has_token)
      log_warn("tenant %s names no uids and no token: the first uid to "
               "connect as it will own it", t->name);
  }
  return ts;
}

void gmb__tenants_destroy(struct gmb_tenants *ts) {
  if (ts == NULL) return;
  struct tenant_node *n, *next;
  RB_FOREACH_SAFE(n, tenant_tree, &ts->tree, next) {
    RB_REMOVE(tenant_tree, &ts->tree, n);
    gmb__pool_arena_destroy(ts->pool, n->t.arena);
    free(n);
  }
  struct tenant_made *m, *mnext;
  RB_FOREACH_SAFE(m, tenant_made_tree, &ts->made, mnext) {
    RB_REMOVE(tenant_made_tree, &ts->made, m);
    free(m);
  }
  while (ts->budgets) {
    struct gmb_uid_budget *bu = ts->budgets;
    ts->budgets = bu->next;
    free(bu);
  }
  free(ts);
}

struct gmb_tenant *gmb__tenant_create(struct gmb_tenants *ts,
                                      const char *name) {
  struct gmb_tenant *t = gmb__tenant_find(ts, name);
  if (t) return t;
  t = tenant_add(ts, name);
  if (t) t->quota = ts->default_quota;
  return t;
}

struct gmb_tenant *gmb__tenant_find(struct gmb_tenants *ts, const char *name) {
  struct tenant_node key;
  if (strlen(name) >= sizeof key.t.name) return NULL;
  snprintf(key.t.name, sizeof key.t.name, "%s", name);
  struct tenant_node *n = RB_FIND(tenant_tree, &ts->tree, &key);
  return n ? &n->t : NULL;
}

int gmb__tenant_uid_listed(const struct gmb_tenant *t, uid_t uid) {
  /* The config and tenant add refuse it; were it listed all the same,
   * every unmapped peer would be the tenant's. */
  if (uid == gmb__config_overflow_uid()) return 0;
  for (size_t i = 0; i < t->n_uids; i++)
    if (t->uids[i] == uid) return 1;
  return 0;
}

int gmb__tenant_default_uid(const char *name, uid_t *uid) {
  if (strncmp(name, "uid-", 4) != 0) return 0;
  const char *d = name + 4;
  /* Canonical decimal only: "uid-01001" is not uid 1001's name, and is
   * nobody's default either. */
  if (d[0] < '0' || d[0] > '9' || (d[0] == '0' && d[1] != '\0')) return 0;
  uint64_t v = 0;
  for (; *d; d++) {
    if (*d < '0' || *d > '9') return 0;
    v = v * 10 + (uint64_t)(*d - '0');
    if (v > UINT32_MAX) return 0;
  }
  *uid = (uid_t)v;
  return 1;
}

/* Drains g's bucket up to now. */
static void tenant_guess_drain(struct tenant_guess *g, uint64_t now) {
  if (g->n == 0 || now <= g->at_ns) return;
  uint64_t k = (now - g->at_ns) / TENANT_GUESS_NS;
  if (k >= g->n) {
    g->n = 0;
    return;
  }
  g->n -= (uint32_t)k;
  g->at_ns += k * TENANT_GUESS_NS;
}

/* uid's bucket (drained up to now), or NULL when it has none; with
 * `make`, one is made, in a free slot or in place of the emptiest. */
static struct tenant_guess *tenant_guess_of(struct gmb_tenants *ts, uid_t uid,
                                            uint64_t now, int make) {
  struct tenant_guess *least = &ts->guesses[0];
  for (size_t i = 0; i < TENANT_GUESS_UIDS; i++) {
    struct tenant_guess *g = &ts->guesses[i];
    tenant_guess_drain(g, now);
    if (g->n && g->uid == uid) return g;
    if (g->n < least->n) least = g;
  }
  if (!make) return NULL;
  least->uid = uid;
  least->n = 0;
  least->at_ns = now;
  return least;
}

/* 1 when the token's SHA-256 is t's token hash.  The comparison takes the
 * same time whatever the bytes, so it tells an attacker nothing about how
 * close a guess was. */
static int tenant_token_proves(const struct gmb_tenant *t,
                               const uint8_t *token, size_t token_len) {
  if (!t->has_token || token == NULL || token_len == 0) return 0;
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int md_len = 0;
  if (EVP_Digest(token, token_len, md, &md_len, EVP_sha256(), NULL) != 1 ||
      md_len != sizeof t->token_sha256) {
    log_error("SHA-256 of a Hello token failed: token refused");
    return 0;
  }
  int same = CRYPTO_memcmp(md, t->token_sha256, sizeof t->token_sha256) == 0;
  OPENSSL_cleanse(md, sizeof md);
  return same;
}

/* 1 when t counts among the tenants its owner made by first use: made
 * by it and not configured since, its own default name aside. */
static int tenant_made_now(const struct gmb_tenant *t) {
  uid_t named;
  return !t->configured && t->has_owner &&
         !gmb__tenant_default_uid(t->name, &named);
}

static struct tenant_made *tenant_made_of(struct gmb_tenants *ts, uid_t uid) {
  struct tenant_made key;
  key.uid = uid;
  ts->made_lookups++;
  return RB_FIND(tenant_made_tree, &ts->made, &key);
}

/* Counts t (gone: not any more) as tenant_made_now says.  0, or -1 out of
 * host memory (then t is not counted, and its uid may make one more). */
static int tenant_made_sync(struct gmb_tenants *ts, struct gmb_tenant *t,
                            int gone) {
  int want = !gone && tenant_made_now(t);
  if (t->made_counted && (!want || t->made_uid != t->owner_uid)) {
    struct tenant_made *m = tenant_made_of(ts, t->made_uid);
    GMB_ASSERT(m && m->n > 0 && "a uid's count of tenants drifted");
    t->made_counted = 0;
    if (--m->n == 0) {
      RB_REMOVE(tenant_made_tree, &ts->made, m);
      free(m);
    }
  }
  if (!want || t->made_counted) return 0;
  struct tenant_made *m = tenant_made_of(ts, t->owner_uid);
  if (m == NULL) {
    m = calloc(1, sizeof *m);
    if (m == NULL) {
      log_error("tenant %s: out of host memory to count it as uid %u's",
                t->name, (unsigned)t->owner_uid);
      return -1;
    }
    m->uid = t->owner_uid;
    RB_INSERT(tenant_made_tree, &ts->made, m);
  }
  m->n++;
  t->made_counted = 1;
  t->made_uid = t->owner_uid;
  return 0;
}

void gmb__tenant_owner_sync(struct gmb_tenants *ts, struct gmb_tenant *t) {
  tenant_made_sync(ts, t, 0);
  gmb__tenant_may_idle(ts, t); /* configured no more, say */
}

/* Tenants made by uid's first use and not configured since, its own
 * default name aside.  O(log uids). */
static uint32_t tenant_made_by(struct gmb_tenants *ts, uid_t uid) {
  const struct tenant_made *m = tenant_made_of(ts, uid);
  return m ? m->n : 0;
}

void gmb__tenants_set_limits(struct gmb_tenants *ts,
                             const struct gmb_config *cfg) {
  ts->max_per_uid = cfg->max_tenants_per_uid;
  ts->holes_frac = cfg->cache_holes;
  ts->default_host_quota = gmb__config_default_host_quota(cfg);
  struct tenant_node *n;
  RB_FOREACH(n, tenant_tree, &ts->tree) {
    n->t.holes_frac = ts->holes_frac;
    /* Host bytes held above a lowered one stay; new pauses and offloads
     * are refused until they fit (sleep.c, offload.c). */
    if (n->t.host_quota_default) n->t.host_quota = ts->default_host_quota;
  }
}

int gmb__tenant_idle(const struct gmb_tenants *ts, const struct gmb_tenant *t,
                     int named) {
  uid_t u;
  if (t->n_sessions != 0 || t->used != 0 || t->waiting != 0) return 0;
  if (t->fd_kept != 0) return 0; /* a kept channel names it (fdchan.c) */
  if (t->revoking || t->reaping) return 0; /* still counted elsewhere */
  if (t->removing) return 1;
  if (t->added) return 0;
  if (!named && !gmb__tenant_default_uid(t->name, &u)) return 0;
  return !t->configured && t->n_sessions == 0 && t->used == 0 &&
         t->waiting == 0 && t->reserve == 0 && t->priority == 0 &&
         t->quota == ts->default_quota;
}

static void tenant_idle_unlist(struct gmb_tenants *ts, struct gmb_tenant *t) {
  if (!t->idle_listed) return;
  if (t->idle_prev)
    t->idle_prev->idle_next = t->idle_next;
  else
    ts->idle_head = t->idle_next;
  if (t->idle_next) t->idle_next->idle_prev = t->idle_prev;
  t->idle_next = t->idle_prev = NULL;
  t->idle_listed = 0;
}

void gmb__tenant_may_idle(struct gmb_tenants *ts, struct gmb_tenant *t) {
  if (t->idle_listed) return;
  t->idle_listed = 1;
  t->idle_prev = NULL;
  t->idle_next = ts->idle_head;
  if (ts->idle_head) ts->idle_head->idle_prev = t;
  ts->idle_head = t;
}

size_t gmb__tenants_reap_listed(struct gmb_tenants *ts) {
  size_t n = 0;
  struct gmb_tenant *t;
  while ((t = ts->idle_head) != NULL) {
    ts->reap_visits++;
    tenant_idle_unlist(ts, t);
    if (!gmb__tenant_idle(ts, t, 0)) continue;
    gmb__tenant_remove(ts, t);
    n++;
  }
  return n;
}

uint64_t gmb__tenants_reap_visits(const struct gmb_tenants *ts) {
  return ts->reap_visits;
}

void gmb__tenant_remove(struct gmb_tenants *ts, struct gmb_tenant *t) {
  GMB_ASSERT(t->n_sessions == 0 && t->sessions == NULL && t->used == 0 &&
             t->waiting == 0 && t->fd_kept == 0 && t->fd_holds.first == NULL &&
             "a tenant removed while it holds something");
  struct tenant_node *n =
      (struct tenant_node *)((char *)t - offsetof(struct tenant_node, t));
  /* A removed tenant's reservation (tenant add) is no one's any more. */
  if (t->reserve) gmb__tenant_set_reserve(ts, t, 0);
  /* Its empty segments go back to the device (the retire callback counts
   * them off t while it still exists). */
  gmb__pool_arena_destroy(ts->pool, t->arena);
  t->arena = NULL;
  GMB_ASSERT(tenant_short(t) == 0 && "an idle tenant has no reservation");
  tenant_budget_leave(ts, t);
  tenant_made_sync(ts, t, 1);
  tenant_idle_unlist(ts, t);
  RB_REMOVE(tenant_tree, &ts->tree, n);
  ts->count--;
  free(n);
}

size_t gmb__tenants_reap(struct gmb_tenants *ts, int named) {
  size_t n = 0;
  struct tenant_node *nd, *next;
  RB_FOREACH_SAFE(nd, tenant_tree, &ts->tree, next) {
    if (!gmb__tenant_idle(ts, &nd->t, named)) continue;
    gmb__tenant_remove(ts, &nd->t);
    n++;
  }
  return n;
}

/* The refusal of a new tenant when the registry is full. */
static int tenant_full(const char *name, char *why, size_t whycap) {
  snprintf(why, whycap, "cannot create tenant %s: the broker holds %d "
           "tenants, its limit", name, TENANTS_MAX);
  return GMB_E_LIMIT;
}

int gmb__tenant_admit(struct gmb_tenants *ts, const char *name, uid_t uid,
                      const uint8_t *token, size_t token_len,
                      struct gmb_tenant **out, char *why, size_t whycap) {
  char deflt[64];
  if (name == NULL || name[0] == '\0') {
    snprintf(deflt, sizeof deflt, "uid-%u", (unsigned)uid);
    name = deflt;
  }
  if (!gmb__name_valid(name)) {
    snprintf(why, whycap,
             "bad tenant name '%.63s': use 1 to 63 of A-Z a-z 0-9 . _ -, "
             "not starting with . or -", name);
    return GMB_E_INVAL;
  }
  struct gmb_tenant *t = gmb__tenant_find(ts, name);
  /* A default name belongs to its uid: uid-N is nobody's but uid N's
   * unless the config says otherwise (then its uids or token decide). */
  uid_t named;
  if ((t == NULL || !t->configured) && gmb__tenant_default_uid(name, &named) &&
      named != uid) {
    snprintf(why, whycap, "uid %u may not act as tenant %s: that name is the "
             "default tenant of uid %u", (unsigned)uid, name,
             (unsigned)named);
    return GMB_E_AUTH;
  }
  if (t == NULL) {
    /* A full registry refuses before the uid's tenants are counted (a walk
     * of every tenant): the caller makes room and asks again, at most a
     * few times a second (core.c, gmb__core_reap_full). */
    if (gmb__tenants_full(ts)) return tenant_full(name, why, whycap);
    /* A uid's own default name never counts: it can always connect. */
    if (ts->max_per_uid && !gmb__tenant_default_uid(name, &named) &&
        tenant_made_by(ts, uid) >= ts->max_per_uid) {
      snprintf(why, whycap, "cannot create tenant %s: uid %u made %u tenants "
               "by first use, its limit (max_tenants_per_uid); they go away "
               "once they have no session and no memory", name,
               (unsigned)uid, ts->max_per_uid);
      return GMB_E_LIMIT;
    }
    t = tenant_add(ts, name);
    if (t == NULL) return tenant_full(name, why, whycap);
    t->quota = ts->default_quota;
    t->has_owner = 1;
    t->owner_uid = uid;
    if (tenant_made_sync(ts, t, 0) != 0) {
      gmb__tenant_remove(ts, t);
      snprintf(why, whycap, "cannot create tenant %s: out of host memory",
               name);
      return GMB_E_SYSTEM;
    }
    tenant_budget_join(ts, t);
    log_info("tenant %s created on first use, owned by uid %u, quota %llu",
             t->name, (unsigned)uid, (unsigned long long)t->quota);
    *out = t;
    return 0;
  }
  if (t->removing) {
    snprintf(why, whycap, "tenant %s is being removed (its job or pod "
             "ended): it admits no new session", t->name);
    return GMB_E_AUTH;
  }
  if (t->n_uids > 0 || t->has_token) {
    if (gmb__tenant_uid_listed(t, uid)) {
      *out = t;
      return 0;
    }
    uint64_t now = gmb__now_ns();
    struct tenant_guess *g = NULL;
    if (t->has_token && token_len > 0) {
      g = tenant_guess_of(ts, uid, now, 0);
      if (g && g->n >= TENANT_GUESS_BURST) {
        uint64_t wait = g->at_ns + TENANT_GUESS_NS - now;
        snprintf(why, whycap, "uid %u sent %u wrong tokens lately: its next "
                 "token is checked in %llu ms", (unsigned)uid, g->n,
                 (unsigned long long)(wait / GMB_NS_PER_MS + 1));
        return GMB_E_LIMIT;
      }
      if (tenant_token_proves(t, token, token_len)) {
        *out = t;
        return 0;
      }
      g = tenant_guess_of(ts, uid, now, 1);
      if (g->n == 0) g->at_ns = now;
      g->n++;
    }
    /* Never echo the token: a refusal is logged, and a token sent to the
     * wrong tenant may well be another tenant's secret. */
    if (t->has_token && token_len > 0)
      snprintf(why, whycap, "uid %u may not act as tenant %s: the token "
               "sent does not match its token_sha256%s", (unsigned)uid,
               t->name, t->n_uids ? ", and the uid is not in its uids" : "");
    else if (t->has_token)
      snprintf(why, whycap, "uid %u may not act as tenant %s: %sno token "
               "was sent (set GMB_TOKEN or GMB_TOKEN_FILE)", (unsigned)uid,
               t->name, t->n_uids ? "the uid is not in its uids, and " : "");
    else
      snprintf(why, whycap, "uid %u may not act as tenant %s (not in its "
               "uids)", (unsigned)uid, t->name);
    return GMB_E_AUTH;
  }
  /* Neither uids nor a token: bound to the first uid that used it. */
  if (!t->has_owner) {
    t->has_owner = 1;
    t->owner_uid = uid;
    tenant_made_sync(ts, t, 0);
    tenant_budget_join(ts, t);
  } else if (t->owner_uid != uid) {
    snprintf(why, whycap, "uid %u may not act as tenant %s: it belongs to "
             "uid %u, which used it first", (unsigned)uid, t->name,
             (unsigned)t->owner_uid);
    return GMB_E_AUTH;
  }
  *out = t;
  return 0;
}

void gmb__tenant_set_owner(struct gmb_tenants *ts, struct gmb_tenant *t,
                           uid_t uid) {
  GMB_ASSERT(!t->has_owner && t->n_uids == 0 && !t->has_token &&
             "an owner for a tenant that proves no one yet");
  t->has_owner = 1;
  t->owner_uid = uid;
  tenant_made_sync(ts, t, 0);
  tenant_budget_join(ts, t);
}

uint64_t gmb__tenants_uid_budget(const struct gmb_tenants *ts) {
  return ts->uid_budget;
}

uint64_t gmb__tenant_budget_used(const struct gmb_tenant *t, uint64_t *limit) {
  *limit = t->budget ? t->budget->limit : 0;
  return t->budget ? t->budget->used : 0;
}

/* a + b, at most UINT64_MAX. */
static uint64_t tenant_sum(uint64_t a, uint64_t b) {
  return a > UINT64_MAX - b ? UINT64_MAX : a + b;
}

/* 1 when `size` more bytes pass t's uid budget (an ad-hoc tenant's);
 * retiring and VMM bytes count with those in use. */
static int tenant_budget_over(const struct gmb_tenant *t, uint64_t size) {
  const struct gmb_uid_budget *bu = t->budget;
  if (!tenant_budget_member(t) || bu->limit == 0) return 0;
  uint64_t held = tenant_sum(tenant_sum(bu->used, bu->retiring), bu->vmm);
  return held >= bu->limit || size > bu->limit - held;
}

/* The holes of t's caches not charged to its quota (tenant.h). */
uint64_t gmb__tenant_holes_uncharged(const struct gmb_tenant *t) {
  if (t->quota == 0 || t->holes_frac <= 0.0) return 0;
  /* A quota near UINT64_MAX (any size is taken) rounds up to 2^64 as a
   * double, which no uint64_t holds: converting it is undefined (0 on
   * x86-64, which would forgive nothing). */
  double c = (double)t->quota * t->holes_frac;
  uint64_t cap = c >= 18446744073709551616.0 ? UINT64_MAX : (uint64_t)c;
  return t->cache_holes < cap ? t->cache_holes : cap;
}

uint64_t gmb__tenant_charged(const struct gmb_tenant *t) {
  uint64_t held = tenant_sum(tenant_sum(t->used, t->retiring), t->vmm);
  uint64_t f = gmb__tenant_holes_uncharged(t);
  return held > f ? held - f : 0;
}

void gmb__tenant_holes_heard(struct gmb_tenant *t, uint64_t *mine,
                             uint64_t reported, uint64_t held) {
  uint64_t h = reported < held ? reported : held;
  GMB_ASSERT(*mine <= t->cache_holes && "tenant holes drifted");
  t->cache_holes = t->cache_holes - *mine + h;
  *mine = h;
}

void gmb__tenant_holes_held(struct gmb_tenant *t, uint64_t *mine,
                            uint64_t held) {
  if (*mine > held) gmb__tenant_holes_heard(t, mine, held, held);
}

static int tenant_quota_over(const struct gmb_tenant *t, uint64_t size) {
  uint64_t held = gmb__tenant_charged(t);
  return t->quota != 0 && (held >= t->quota || size > t->quota - held);
}

/* Moves a figure kept per tenant and per uid budget (retiring, vmm) by
 * delta: up saturating, down never below 0. */
static void tenant_move(uint64_t *x, uint64_t *bx, int64_t delta) {
  uint64_t d = delta < 0 ? (uint64_t)0 - (uint64_t)delta : (uint64_t)delta;
  if (delta >= 0) {
    *x = tenant_sum(*x, d);
    if (bx) *bx = tenant_sum(*bx, d);
    return;
  }
  *x -= d < *x ? d : *x;
  if (bx) *bx -= d < *bx ? d : *bx;
}

void gmb__tenant_retiring(struct gmb_tenant *t, int64_t delta) {
  tenant_move(&t->retiring, t->budget ? &t->budget->retiring : NULL, delta);
}

void gmb__tenant_vmm(struct gmb_tenant *t, int64_t delta) {
  GMB_ASSERT((delta >= 0 || (uint64_t)0 - (uint64_t)delta <= t->vmm) &&
             "uncounting VMM bytes the tenant does not hold");
  tenant_move(&t->vmm, t->budget ? &t->budget->vmm : NULL, delta);
  uint64_t held = tenant_sum(t->used, t->vmm);
  if (held > t->peak) t->peak = held;
}

int gmb__tenant_over(const struct gmb_tenant *t, uint64_t size) {
  return tenant_quota_over(t, size) || tenant_budget_over(t, size);
}

void gmb__tenant_quota_why(const struct gmb_tenant *t, uint64_t size,
                           char *why, size_t whycap) {
  char q[GMB_SIZE_BUFSZ], u[GMB_SIZE_BUFSZ], r[GMB_SIZE_BUFSZ];
  if (tenant_quota_over(t, size) || !tenant_budget_over(t, size)) {
    char ret[3 * GMB_SIZE_BUFSZ + 192] = "";
    if (t->retiring) {
      char x[GMB_SIZE_BUFSZ];
      snprintf(ret, sizeof ret, ", %s in retired segments its processes "
               "have not closed", gmb__size_format(t->retiring, x, sizeof x));
    }
    if (t->vmm) {
      char x[GMB_SIZE_BUFSZ];
      size_t at = strlen(ret);
      snprintf(ret + at, sizeof ret - at, ", %s made by its processes "
               "through cuMemCreate", gmb__size_format(t->vmm, x, sizeof x));
    }
    uint64_t forgiven = gmb__tenant_holes_uncharged(t);
    if (forgiven) {
      char x[GMB_SIZE_BUFSZ];
      size_t at = strlen(ret);
      snprintf(ret + at, sizeof ret - at, ", less %s free between blocks "
               "in its caches' pages, not charged",
               gmb__size_format(forgiven, x, sizeof x));
    }
    snprintf(why, whycap, "tenant %s: %s more would pass its quota of %s "
             "(%s in use%s)", t->name, gmb__size_format(size, r, sizeof r),
             gmb__size_format(t->quota, q, sizeof q),
             gmb__size_format(t->used, u, sizeof u), ret);
    return;
  }
  snprintf(why, whycap, "tenant %s: %s more would pass the budget of %s "
           "that uid %u's tenants made by first use share (%s in use); "
           "name the tenant in the config, or set its quota with gmbctl, "
           "to give it its own", t->name,
           gmb__size_format(size, r, sizeof r),
           gmb__size_format(t->budget->limit, q, sizeof q),
           (unsigned)t->budget->uid,
           gmb__size_format(t->budget->used, u, sizeof u));
}

int gmb__tenant_fits(struct gmb_tenant *t, uint64_t size) {
  if (gmb__tenant_over(t, size)) {
    t->refusals_quota++;
    return GMB_E_QUOTA;
  }
  return 0;
}

int gmb__tenant_charge(struct gmb_tenant *t, uint64_t size) {
  if (gmb__tenant_over(t, size)) return GMB_E_QUOTA;
  GMB_ASSERT(size <= UINT64_MAX - t->used && "tenant usage overflow");
  t->used += size;
  if (t->used > t->peak) t->peak = t->used;
  if (tenant_budget_member(t)) {
    t->budget->used += size;
    t->budget_charged += size;
  }
  return 0;
}

void gmb__tenant_uncharge(struct gmb_tenant *t, uint64_t size) {
  GMB_ASSERT(size <= t->used && "uncharging more than the tenant holds");
  t->used -= size;
  uint64_t b = size < t->budget_charged ? size : t->budget_charged;
  if (b) {
    GMB_ASSERT(b <= t->budget->used && "uid budget drifted");
    t->budget->used -= b;
    t->budget_charged -= b;
  }
}

void gmb__tenant_set_quota(struct gmb_tenants *ts, struct gmb_tenant *t,
                           uint64_t quota) {
  t->quota = quota;
  gmb__tenant_may_idle(ts, t); /* set back to the default, say */
  /* An operator's quota is the tenant's whole rule from now on. */
  if (!t->configured) t->quota_set = 1;
}

void gmb__tenant_set_reserve(struct gmb_tenants *ts, struct gmb_tenant *t,
                             uint64_t reserve) {
  tenant_short_update(ts, t, reserve, t->segment_bytes);
  gmb__tenant_may_idle(ts, t);
}

void gmb__tenant_segments_sync(struct gmb_tenants *ts, struct gmb_tenant *t) {
  struct gmb_arena_stats st;
  gmb__pool_arena_stats(t->arena, &st);
  tenant_short_update(ts, t, t->reserve, st.segment_bytes);
}

void gmb__tenant_segment_retired(struct gmb_tenants *ts, struct gmb_tenant *t,
                                 uint64_t bytes) {
  GMB_ASSERT(bytes <= t->segment_bytes &&
             "a segment retired that the tenant was not counted for");
  tenant_short_update(ts, t, t->reserve, t->segment_bytes - bytes);
}

int gmb__tenant_within_reserve(const struct gmb_tenant *t, uint64_t size) {
  return t->used <= t->reserve && size <= t->reserve - t->used;
}

struct tenant_worst {
  const struct gmb_tenant *except, *worst;
  uint64_t short_bytes;
};

static int tenant_find_worst(void *ctx, struct gmb_tenant *t) {
  struct tenant_worst *w = ctx;
  if (t != w->except && tenant_short(t) > w->short_bytes) {
    w->worst = t;
    w->short_bytes = tenant_short(t);
  }
  return 0;
}

int gmb__tenant_reserve_allows(struct gmb_tenants *ts, struct gmb_tenant *t,
                               uint64_t size, uint64_t room, char *why,
                               size_t whycap) {
  if (gmb__tenant_within_reserve(t, size)) return 0;
  uint64_t mine = tenant_short(t);
  GMB_ASSERT(mine <= ts->reserve_short && "reservation sum drifted");
  uint64_t others = ts->reserve_short - mine;
  if (room >= others) return 0;
  t->refusals_reserve++;
  /* Name the tenant whose reservation is the least backed: that is the
   * one an operator will want to look at. */
  struct tenant_worst w = {.except = t, .worst = NULL, .short_bytes = 0};
  gmb__tenants_each(ts, tenant_find_worst, &w);
  GMB_ASSERT(w.worst != NULL && "a reservation short with no tenant short");
  char sz[GMB_SIZE_BUFSZ], res[GMB_SIZE_BUFSZ], un[GMB_SIZE_BUFSZ],
      rm[GMB_SIZE_BUFSZ], ot[GMB_SIZE_BUFSZ];
  uint64_t unused =
      w.worst->reserve > w.worst->used ? w.worst->reserve - w.worst->used : 0;
  snprintf(why, whycap,
           "%s more for tenant %s would eat into tenant %s's reservation "
           "of %s, of which %s still unused (the device would have %s left "
           "for %s of reservations not yet in segments)",
           gmb__size_format(size, sz, sizeof sz), t->name, w.worst->name,
           gmb__size_format(w.worst->reserve, res, sizeof res),
           gmb__size_format(unused, un, sizeof un),
           gmb__size_format(room, rm, sizeof rm),
           gmb__size_format(others, ot, sizeof ot));
  return GMB_E_NOMEM;
}

size_t gmb__tenants_reserving(const struct gmb_tenants *ts) {
  return ts->reserving;
}

uint64_t gmb__tenants_reserve_short(const struct gmb_tenants *ts) {
  return ts->reserve_short;
}

int gmb__tenants_check_reservations(struct gmb_tenants *ts, uint64_t capacity,
                                    char *msg, size_t cap) {
  uint64_t sum = 0;
  size_t n = 0;
  struct tenant_node *nd;
  RB_FOREACH(nd, tenant_tree, &ts->tree) {
    if (nd->t.reserve == 0) continue;
    n++;
    sum = nd->t.reserve > UINT64_MAX - sum ? UINT64_MAX : sum + nd->t.reserve;
  }
  if (msg && cap) msg[0] = '\0';
  if (sum <= capacity) return 0;
  char s1[GMB_SIZE_BUFSZ], s2[GMB_SIZE_BUFSZ];
  if (msg && cap)
    snprintf(msg, cap, "the reservations of %zu tenants add up to %s, more "
             "than the device's %s: they cannot all be kept, and the first "
             "tenants to use theirs get them", n,
             gmb__size_format(sum, s1, sizeof s1),
             gmb__size_format(capacity, s2, sizeof s2));
  return GMB_E_INVAL;
}

int gmb__tenants_each(struct gmb_tenants *ts,
                      int (*fn)(void *ctx, struct gmb_tenant *t), void *ctx) {
  struct tenant_node *n;
  RB_FOREACH(n, tenant_tree, &ts->tree) {
    int rc = fn(ctx, &n->t);
    if (rc) return rc;
  }
  return 0;
}

size_t gmb__tenants_count(const struct gmb_tenants *ts) { return ts->count; }

uint64_t gmb__tenants_made_lookups(const struct gmb_tenants *ts) {
  return ts->made_lookups;
}

int gmb__tenants_full(const struct gmb_tenants *ts) {
  return ts->count >= TENANTS_MAX;
}

int gmb__tenant_check(struct gmb_tenants *ts) {
  int bad = 0;
  uint64_t short_sum = 0;
  struct tenant_node *n;
  RB_FOREACH(n, tenant_tree, &ts->tree) {
    struct gmb_tenant *t = &n->t;
    struct gmb_arena_stats st;
    gmb__pool_arena_stats(t->arena, &st);
    if (st.used != t->used) {
      log_error("check: tenant %s counts %llu bytes used, its arena holds "
                "%llu", t->name, (unsigned long long)t->used,
                (unsigned long long)st.used);
      bad++;
    }
    if (st.segment_bytes != t->segment_bytes) {
      log_error("check: tenant %s counts %llu bytes of segments, its arena "
                "holds %llu", t->name, (unsigned long long)t->segment_bytes,
                (unsigned long long)st.segment_bytes);
      bad++;
    }
    short_sum += tenant_short(t);
    if (t->peak < t->used) {
      log_error("check: tenant %s peak %llu below used %llu", t->name,
                (unsigned long long)t->peak, (unsigned long long)t->used);
      bad++;
    }
  }
  for (struct gmb_uid_budget *bu = ts->budgets; bu; bu = bu->next) {
    uint64_t sum = 0;
    unsigned refs = 0;
    RB_FOREACH(n, tenant_tree, &ts->tree) {
      if (n->t.budget != bu) continue;
      refs++;
      sum += n->t.budget_charged;
    }
    if (refs != bu->refs || sum != bu->used || refs == 0) {
      log_error("check: uid %u's budget counts %u tenants and %llu bytes; "
                "they are %u and %llu", (unsigned)bu->uid, bu->refs,
                (unsigned long long)bu->used, refs,
                (unsigned long long)sum);
      bad++;
    }
  }
  RB_FOREACH(n, tenant_tree, &ts->tree) {
    if (n->t.budget_charged > n->t.used) {
      log_error("check: tenant %s charged %llu bytes to its uid budget, "
                "more than the %llu it holds", n->t.name,
                (unsigned long long)n->t.budget_charged,
                (unsigned long long)n->t.used);
      bad++;
    }
  }
  /* The uids' counts of tenants made by first use, recounted. */
  struct tenant_made *m;
  RB_FOREACH(m, tenant_made_tree, &ts->made) m->seen = 0;
  RB_FOREACH(n, tenant_tree, &ts->tree) {
    const struct gmb_tenant *t = &n->t;
    if (t->made_counted != tenant_made_now(t) ||
        (t->made_counted && t->made_uid != t->owner_uid)) {
      log_error("check: tenant %s is %scounted as made by uid %u's first "
                "use", t->name, t->made_counted ? "" : "not ",
                (unsigned)t->owner_uid);
      bad++;
    }
    if (!t->made_counted) continue;
    struct tenant_made key;
    key.uid = t->made_uid;
    m = RB_FIND(tenant_made_tree, &ts->made, &key);
    if (m) m->seen++;
    else bad++;
  }
  RB_FOREACH(m, tenant_made_tree, &ts->made) {
    if (m->seen == m->n && m->n > 0) continue;
    log_error("check: uid %u counts %u tenants made by first use; they are "
              "%u", (unsigned)m->uid, m->n, m->seen);
    bad++;
  }
  if (short_sum != ts->reserve_short) {
    log_error("check: unbacked reservations add up to %llu, the registry "
              "counts %llu", (unsigned long long)short_sum,
              (unsigned long long)ts->reserve_short);
    bad++;
  }
  return bad;
}
