/*
 * tenant.c - the tenant registry, admission (who may act as whom) and
 * quota accounting.
 *
 * Tenants are kept in a red-black tree by name; a broker serves a handful
 * to a few thousand, and lookups happen once per session, not per request
 * (a session keeps its tenant pointer).  Tenants are never removed while
 * the broker runs, so a session's pointer stays valid.
 */
#include "tenant.h"


#include "rbtree.h"
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

struct gmb_tenants {
  struct tenant_tree tree;
  size_t count;
  struct gmb_pool *pool;
  uint64_t default_quota;
};

static struct gmb_tenant *tenant_add(struct gmb_tenants *ts,
                                     const char *name) {
  if (ts->count >= TENANTS_MAX) return NULL;
  struct tenant_node *n = calloc(1, sizeof *n);
  if (n == NULL) return NULL;
  snprintf(n->t.name, sizeof n->t.name, "%s", name);
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
  ts->pool = pool;
  ts->default_quota = cfg->default_quota;
  for (size_t i = 0; i < cfg->n_tenants; i++) {
    const struct gmb_tenant_conf *tc = &cfg->tenants[i];
    struct gmb_tenant *t = tenant_add(ts, tc->name);
    if (t == NULL) {
      gmb__tenants_destroy(ts);
      return NULL;
    }
    t->configured = 1;
    t->quota = tc->quota;
    t->reserve = tc->reserve;
    t->priority = tc->priority;
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
  free(ts);
}

struct gmb_tenant *gmb__tenant_find(struct gmb_tenants *ts, const char *name) {
  struct tenant_node key;
  if (strlen(name) >= sizeof key.t.name) return NULL;
  snprintf(key.t.name, sizeof key.t.name, "%s", name);
  struct tenant_node *n = RB_FIND(tenant_tree, &ts->tree, &key);
  return n ? &n->t : NULL;
}

static int tenant_uid_listed(const struct gmb_tenant *t, uid_t uid) {
  for (size_t i = 0; i < t->n_uids; i++)
    if (t->uids[i] == uid) return 1;
  return 0;
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
  if (t == NULL) {
    t = tenant_add(ts, name);
    if (t == NULL) {
      snprintf(why, whycap, "cannot create tenant %s: the broker holds %d "
               "tenants, its limit", name, TENANTS_MAX);
      return GMB_E_LIMIT;
    }
    t->quota = ts->default_quota;
    t->has_owner = 1;
    t->owner_uid = uid;
    log_info("tenant %s created on first use, owned by uid %u, quota %llu",
             t->name, (unsigned)uid, (unsigned long long)t->quota);
    *out = t;
    return 0;
  }
  if (t->n_uids > 0 || t->has_token) {
    if (tenant_uid_listed(t, uid)) {
      *out = t;
      return 0;
    }
    (void)token;
    if (t->has_token && token_len > 0) {
      /* Token proof needs the SHA-256 comparison that the operator issue
       * brings; until then a token never proves anything. */
      snprintf(why, whycap, "uid %u may not act as tenant %s, and token "
               "authentication is not supported by this broker version",
               (unsigned)uid, t->name);
      return GMB_E_AUTH;
    }
    snprintf(why, whycap, "uid %u may not act as tenant %s (not in its uids)",
             (unsigned)uid, t->name);
    return GMB_E_AUTH;
  }
  /* Neither uids nor a token: bound to the first uid that used it. */
  if (!t->has_owner) {
    t->has_owner = 1;
    t->owner_uid = uid;
  } else if (t->owner_uid != uid) {
    snprintf(why, whycap, "uid %u may not act as tenant %s: it belongs to "
             "uid %u, which used it first", (unsigned)uid, t->name,
             (unsigned)t->owner_uid);
    return GMB_E_AUTH;
  }
  *out = t;
  return 0;
}

static int tenant_over(const struct gmb_tenant *t, uint64_t size) {
  return t->quota != 0 && (t->used >= t->quota || size > t->quota - t->used);
}

int gmb__tenant_fits(struct gmb_tenant *t, uint64_t size) {
  if (tenant_over(t, size)) {
    t->refusals_quota++;
    return GMB_E_QUOTA;
  }
  return 0;
}

int gmb__tenant_charge(struct gmb_tenant *t, uint64_t size) {
  if (tenant_over(t, size)) return GMB_E_QUOTA;
  GMB_ASSERT(size <= UINT64_MAX - t->used && "tenant usage overflow");
  t->used += size;
  if (t->used > t->peak) t->peak = t->used;
  return 0;
}

void gmb__tenant_uncharge(struct gmb_tenant *t, uint64_t size) {
  GMB_ASSERT(size <= t->used && "uncharging more than the tenant holds");
  t->used -= size;
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

int gmb__tenant_check(struct gmb_tenants *ts) {
  int bad = 0;
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
    if (t->peak < t->used) {
      log_error("check: tenant %s peak %llu below used %llu", t->name,
                (unsigned long long)t->peak, (unsigned long long)t->used);
      bad++;
    }
  }
  return bad;
}
