/*
 * tenant.h - the tenants: named parties with a quota, the uids (or token)
 * that may act as them, and the arena of the pool that holds their memory.
 *
 * The registry owns every tenant.  A tenant named in the config exists from
 * the start; any other is created on first use, owned by the uid that
 * connected first, with the config's default_quota.  `used` is the sum of
 * the rounded sizes of the tenant's live allocations, always equal to what
 * its arena holds (gmb__tenant_check() verifies it against the pool), and
 * never above `quota` when the quota is set, except after an operator
 * lowered the quota below it.
 */
#ifndef GMB_TENANT_H
#define GMB_TENANT_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "config.h"
#include "pool.h"

struct gmb_session;

struct gmb_tenant {
  char name[64];
  uint64_t quota;    /* 0: no limit */
  uint64_t reserve;
  int priority;
  uint64_t used;     /* bytes of live allocations (rounded) */
  uint64_t peak;     /* highest `used` since start */
  uint64_t refusals_quota; /* requests refused by the quota */
  int configured;    /* named in the config */
  uid_t uids[GMB_CONFIG_UIDS_MAX];
  size_t n_uids;     /* 0 and !has_token: bound to owner_uid on first use */
  int has_token;
  uint8_t token_sha256[32];
  int has_owner;
  uid_t owner_uid;   /* the first uid that connected, for unbound tenants */
  struct gmb_arena *arena;
  unsigned n_sessions;
  struct gmb_session *sessions; /* list through gmb_session.tenant_next */
};

struct gmb_tenants;

/* Builds the registry with a tenant per config section.  NULL on ENOMEM. */
struct gmb_tenants *gmb__tenants_new(struct gmb_pool *pool,
                                     const struct gmb_config *cfg);
/* Frees every tenant and its arena.  Accepts NULL. */
void gmb__tenants_destroy(struct gmb_tenants *ts);

struct gmb_tenant *gmb__tenant_find(struct gmb_tenants *ts, const char *name);

/*
 * Finds or creates the tenant `name` for a session of uid `uid` that sent
 * `token` (may be empty), and checks that the uid or token may act as it.
 * Returns 0 with *out set, GMB_E_INVAL for a bad name, GMB_E_AUTH with a
 * reason in `why`, GMB_E_LIMIT when too many tenants exist.
 */
int gmb__tenant_admit(struct gmb_tenants *ts, const char *name, uid_t uid,
                      const uint8_t *token, size_t token_len,
                      struct gmb_tenant **out, char *why, size_t whycap);

/* 0 when `size` more bytes fit the tenant's quota, else GMB_E_QUOTA (and
 * the refusal is counted). */
int gmb__tenant_fits(struct gmb_tenant *t, uint64_t size);
/* Charges `size` bytes of a new allocation: 0, or GMB_E_QUOTA with nothing
 * charged.  The broker asks gmb__tenant_fits() before the pool, and charges
 * once the pool said yes, so `used` and `peak` only ever count memory that
 * was really handed out. */
int gmb__tenant_charge(struct gmb_tenant *t, uint64_t size);
/* Gives back `size` bytes charged before. */
void gmb__tenant_uncharge(struct gmb_tenant *t, uint64_t size);

/* Visits the tenants in name order; stops when fn returns non-zero. */
int gmb__tenants_each(struct gmb_tenants *ts,
                      int (*fn)(void *ctx, struct gmb_tenant *t), void *ctx);
size_t gmb__tenants_count(const struct gmb_tenants *ts);

/* Number of broken invariants: `used` of each tenant against its arena,
 * `peak` >= `used`, quota respected unless lowered. */
int gmb__tenant_check(struct gmb_tenants *ts);

#endif /* GMB_TENANT_H */
