/*
 * check_tenant.c - the tenant registry: who may act as a tenant (uids and
 * tokens), default tenancy, exact quota accounting, and the reservation
 * rule with its running sum.
 */
#include <check.h>
#include <time.h>
#include <openssl/evp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "check_main.h"
#include "config.h"
#include "device.h"
#include "gmb.h"
#include "pool.h"
#include "tenant.h"

static struct gmb_device *dev;
static struct gmb_pool *pool;
static struct gmb_tenants *ts;
static struct gmb_config cfg;

#define MIB (UINT64_C(1) << 20)
#define N_CONFIGURED 5

/* sha256("abc"), the FIPS 180-2 test vector. */
static const uint8_t SHA256_ABC[32] = {
    0xba, 0x78, 0x16, 0xbf, 0x8f, 0x01, 0xcf, 0xea, 0x41, 0x41, 0x40,
    0xde, 0x5d, 0xae, 0x22, 0x23, 0xb0, 0x03, 0x61, 0xa3, 0x96, 0x17,
    0x7a, 0x9c, 0xb4, 0x10, 0xff, 0x61, 0xf2, 0x00, 0x15, 0xad};

static void sha256(const char *s, uint8_t out[32]) {
  unsigned int n = 0;
  ck_assert_int_eq(EVP_Digest(s, strlen(s), out, &n, EVP_sha256(), NULL), 1);
  ck_assert_uint_eq(n, 32);
}

/* The pool's retire callback, as the broker's: segments going back to the
 * device are counted off their tenant. */
static void on_retire(void *ctx, const struct gmb_dseg *seg, void *tag) {
  (void)ctx;
  if (ts && tag) gmb__tenant_segment_retired(ts, tag, seg->size);
}

static void setup_with(uint64_t default_quota) {
  char err[256];
  ck_assert_int_eq(gmb__device_open("host:64MiB", 0, 0, &dev, err, sizeof err),
                   0);
  pool = gmb__pool_new(dev, on_retire, NULL);
  ck_assert_ptr_nonnull(pool);
  gmb__config_defaults(&cfg);
  cfg.default_quota = default_quota;
  cfg.tenants = calloc(N_CONFIGURED, sizeof *cfg.tenants);
  cfg.n_tenants = N_CONFIGURED;
  /* "tok": a token only.  "both": uid 1001 or the token "s3cret".
   * "res": 32 MiB kept for it on the 64 MiB device. */
  strcpy(cfg.tenants[2].name, "tok");
  cfg.tenants[2].has_token = 1;
  memcpy(cfg.tenants[2].token_sha256, SHA256_ABC, 32);
  strcpy(cfg.tenants[3].name, "both");
  cfg.tenants[3].uids[0] = 1001;
  cfg.tenants[3].n_uids = 1;
  cfg.tenants[3].has_token = 1;
  sha256("s3cret", cfg.tenants[3].token_sha256);
  strcpy(cfg.tenants[4].name, "res");
  cfg.tenants[4].reserve = 32 * MIB;
  strcpy(cfg.tenants[0].name, "llm-a");
  cfg.tenants[0].quota = 4096;
  cfg.tenants[0].uids[0] = 1001;
  cfg.tenants[0].uids[1] = 1002;
  cfg.tenants[0].n_uids = 2;
  strcpy(cfg.tenants[1].name, "open");
  cfg.tenants[1].quota = 0;
  ts = gmb__tenants_new(pool, &cfg);
  ck_assert_ptr_nonnull(ts);
}

static void setup(void) { setup_with(0); }

static void teardown(void) {
  ck_assert_int_eq(gmb__tenant_check(ts), 0);
  gmb__tenants_destroy(ts);
  ts = NULL;
  ck_assert_int_eq(gmb__pool_check(pool), 0);
  gmb__pool_destroy(pool);
  ck_assert_uint_eq(dev->in_use, 0);
  gmb__device_close(dev);
  gmb__config_free(&cfg);
}

static int admit(const char *name, uid_t uid, struct gmb_tenant **t) {
  char why[256];
  return gmb__tenant_admit(ts, name, uid, NULL, 0, t, why, sizeof why);
}

START_TEST(configured_uid_admitted) {
  struct gmb_tenant *t = NULL;
  ck_assert_int_eq(admit("llm-a", 1001, &t), 0);
  ck_assert_str_eq(t->name, "llm-a");
  ck_assert_int_eq(admit("llm-a", 1002, &t), 0);
}
END_TEST

START_TEST(configured_uid_refused) {
  struct gmb_tenant *t = NULL;
  char why[256];
  ck_assert_int_eq(
      gmb__tenant_admit(ts, "llm-a", 0, NULL, 0, &t, why, sizeof why),
      GMB_E_AUTH);
  ck_assert_ptr_nonnull(strstr(why, "uid 0"));
}
END_TEST

static int admit_tok(const char *name, uid_t uid, const char *token,
                     char *why, size_t whycap) {
  struct gmb_tenant *t = NULL;
  why[0] = '\0';
  int rc = gmb__tenant_admit(ts, name, uid, (const uint8_t *)token,
                             token ? strlen(token) : 0, &t, why, whycap);
  if (rc == 0) ck_assert_str_eq(t->name, name);
  return rc;
}

START_TEST(token_right_admits_any_uid) {
  char why[256];
  ck_assert_int_eq(admit_tok("tok", 7, "abc", why, sizeof why), 0);
  ck_assert_int_eq(admit_tok("tok", 0, "abc", why, sizeof why), 0);
  /* A token tenant is not bound to the first uid that proved it. */
  ck_assert_int_eq(admit_tok("tok", 8, "abc", why, sizeof why), 0);
}
END_TEST

START_TEST(token_wrong_refused_without_echo) {
  char why[256];
  const char *bad = "abd-wrong-secret";
  ck_assert_int_eq(admit_tok("tok", 7, bad, why, sizeof why), GMB_E_AUTH);
  ck_assert_ptr_null(strstr(why, bad));
  ck_assert_ptr_nonnull(strstr(why, "does not match"));
  /* A prefix or an extension of the right token is not the token. */
  ck_assert_int_eq(admit_tok("tok", 7, "ab", why, sizeof why), GMB_E_AUTH);
  ck_assert_int_eq(admit_tok("tok", 7, "abcd", why, sizeof why), GMB_E_AUTH);
}
END_TEST

START_TEST(token_empty_refused) {
  char why[256];
  ck_assert_int_eq(admit_tok("tok", 7, NULL, why, sizeof why), GMB_E_AUTH);
  ck_assert_ptr_nonnull(strstr(why, "GMB_TOKEN"));
  ck_assert_int_eq(admit_tok("tok", 7, "", why, sizeof why), GMB_E_AUTH);
}
END_TEST

START_TEST(token_or_uid_for_tenant_with_both) {
  char why[256];
  ck_assert_int_eq(admit_tok("both", 1001, NULL, why, sizeof why), 0);
  ck_assert_int_eq(admit_tok("both", 7, "s3cret", why, sizeof why), 0);
  /* A listed uid is enough, whatever token it sends. */
  ck_assert_int_eq(admit_tok("both", 1001, "nope", why, sizeof why), 0);
  ck_assert_int_eq(admit_tok("both", 7, "s3cret\n", why, sizeof why),
                   GMB_E_AUTH);
  ck_assert_ptr_null(strstr(why, "s3cret"));
  ck_assert_int_eq(admit_tok("both", 7, NULL, why, sizeof why), GMB_E_AUTH);
  ck_assert_ptr_nonnull(strstr(why, "not in its uids"));
  /* Another tenant's token proves nothing here. */
  ck_assert_int_eq(admit_tok("both", 7, "abc", why, sizeof why), GMB_E_AUTH);
}
END_TEST

/* A uid could try 15,000 tokens a second (one Hello each).  Wrong tokens
 * now fill a bucket per uid (10, one drained a second): past it the uid's
 * next token, right or wrong, is refused unchecked with GMB_E_LIMIT,
 * while another uid's right token and a listed uid still get in. */
START_TEST(token_guessing_rate_limited_per_uid) {
  char why[256];
  for (int i = 0; i < 10; i++)
    ck_assert_int_eq(admit_tok("tok", 7, "guess", why, sizeof why), GMB_E_AUTH);
  ck_assert_int_eq(admit_tok("tok", 7, "guess", why, sizeof why), GMB_E_LIMIT);
  ck_assert_ptr_nonnull(strstr(why, "wrong tokens"));
  ck_assert_int_eq(admit_tok("tok", 7, "abc", why, sizeof why), GMB_E_LIMIT);
  ck_assert_int_eq(admit_tok("tok", 8, "abc", why, sizeof why), 0);
  ck_assert_int_eq(admit_tok("both", 1001, "nope", why, sizeof why), 0);
  /* The bucket drains: the right token gets in again (within 5 s). */
  int rc = GMB_E_LIMIT;
  for (int i = 0; i < 50 && rc == GMB_E_LIMIT; i++) {
    struct timespec ts100 = {0, 100 * 1000 * 1000};
    nanosleep(&ts100, NULL);
    rc = admit_tok("tok", 7, "abc", why, sizeof why);
  }
  ck_assert_int_eq(rc, 0);
}
END_TEST

START_TEST(token_proves_nothing_without_token_sha256) {
  char why[256];
  /* llm-a lists uids and no token: a token from another uid is refused,
   * a listed uid needs none. */
  ck_assert_int_eq(admit_tok("llm-a", 7, "abc", why, sizeof why),
                   GMB_E_AUTH);
  ck_assert_ptr_nonnull(strstr(why, "not in its uids"));
  ck_assert_ptr_null(strstr(why, "abc"));
  ck_assert_int_eq(admit_tok("llm-a", 1002, NULL, why, sizeof why), 0);
}
END_TEST

START_TEST(unnamed_tenant_is_uid_name) {
  struct gmb_tenant *t = NULL;
  ck_assert_int_eq(admit("", 4242, &t), 0);
  ck_assert_str_eq(t->name, "uid-4242");
  ck_assert_int_eq(admit(NULL, 4242, &t), 0);
  ck_assert_str_eq(t->name, "uid-4242");
}
END_TEST

START_TEST(auto_tenant_owned_by_first_uid) {
  struct gmb_tenant *t = NULL;
  ck_assert_int_eq(admit("batch", 500, &t), 0);
  ck_assert_int_eq(t->configured, 0);
  ck_assert_int_eq(admit("batch", 500, &t), 0);
  ck_assert_int_eq(admit("batch", 501, &t), GMB_E_AUTH);
  /* A configured tenant with no uids binds the same way. */
  ck_assert_int_eq(admit("open", 9, &t), 0);
  ck_assert_int_eq(admit("open", 10, &t), GMB_E_AUTH);
}
END_TEST

START_TEST(bad_names_refused) {
  struct gmb_tenant *t = NULL;
  ck_assert_int_eq(admit("../etc", 1, &t), GMB_E_INVAL);
  ck_assert_int_eq(admit("-x", 1, &t), GMB_E_INVAL);
  ck_assert_int_eq(admit("a b", 1, &t), GMB_E_INVAL);
  char longname[80];
  memset(longname, 'a', 64);
  longname[64] = '\0';
  ck_assert_int_eq(admit(longname, 1, &t), GMB_E_INVAL);
  ck_assert_uint_eq(gmb__tenants_count(ts), N_CONFIGURED);
}
END_TEST

START_TEST(quota_exact_limit) {
  struct gmb_tenant *t = NULL;
  ck_assert_int_eq(admit("llm-a", 1001, &t), 0);
  ck_assert_int_eq(gmb__tenant_charge(t, 4096), 0);
  ck_assert_uint_eq(t->used, 4096);
  ck_assert_int_eq(gmb__tenant_fits(t, 1), GMB_E_QUOTA);
  ck_assert_int_eq(gmb__tenant_charge(t, 1), GMB_E_QUOTA);
  ck_assert_uint_eq(t->used, 4096); /* a refusal charges nothing */
  gmb__tenant_uncharge(t, 4096);
  ck_assert_int_eq(gmb__tenant_fits(t, 4096), 0);
  ck_assert_int_eq(gmb__tenant_fits(t, 4097), GMB_E_QUOTA);
  ck_assert_int_eq(gmb__tenant_charge(t, 4097), GMB_E_QUOTA);
  ck_assert_uint_eq(t->used, 0);
  ck_assert_uint_eq(t->peak, 4096);
  ck_assert_uint_eq(t->refusals_quota, 2); /* counted by fits() only */
}
END_TEST

START_TEST(quota_zero_is_unlimited) {
  struct gmb_tenant *t = NULL;
  ck_assert_int_eq(admit("open", 1, &t), 0);
  ck_assert_int_eq(gmb__tenant_charge(t, UINT64_C(1) << 62), 0);
  ck_assert_int_eq(gmb__tenant_charge(t, UINT64_C(1) << 62), 0);
  gmb__tenant_uncharge(t, UINT64_C(1) << 63);
  ck_assert_uint_eq(t->used, 0);
}
END_TEST

START_TEST(quota_overflow_refused) {
  struct gmb_tenant *t = NULL;
  ck_assert_int_eq(admit("llm-a", 1001, &t), 0);
  ck_assert_int_eq(gmb__tenant_charge(t, 100), 0);
  /* used + size wraps around 2^64: must be refused, not wrapped. */
  ck_assert_int_eq(gmb__tenant_fits(t, UINT64_MAX - 50), GMB_E_QUOTA);
  ck_assert_int_eq(gmb__tenant_charge(t, UINT64_MAX - 50), GMB_E_QUOTA);
  ck_assert_uint_eq(t->used, 100);
  gmb__tenant_uncharge(t, 100);
}
END_TEST

START_TEST(quota_lowered_below_used) {
  struct gmb_tenant *t = NULL;
  ck_assert_int_eq(admit("llm-a", 1001, &t), 0);
  ck_assert_int_eq(gmb__tenant_charge(t, 4000), 0);
  t->quota = 1000; /* an operator lowered it */
  ck_assert_int_eq(gmb__tenant_charge(t, 1), GMB_E_QUOTA);
  gmb__tenant_uncharge(t, 4000);
}
END_TEST

/* The free bytes between blocks in a tenant's caches' pages (each
 * session's report, at most what that session holds) are not charged to
 * its quota up to cache_holes of it (an eighth by default); a reload that
 * sets 0 charges pages whole again. */
START_TEST(quota_holes_forgiven_up_to_a_part) {
  struct gmb_tenant *t = NULL;
  char why[512];
  ck_assert_int_eq(admit("llm-a", 1001, &t), 0); /* quota 4096 */
  ck_assert_int_eq(gmb__tenant_charge(t, 4096), 0);
  ck_assert_int_eq(gmb__tenant_fits(t, 1), GMB_E_QUOTA);
  uint64_t s1 = 0, s2 = 0; /* two sessions' figures */
  gmb__tenant_holes_heard(t, &s1, 300, 4000);
  ck_assert_uint_eq(t->cache_holes, 300);
  ck_assert_uint_eq(gmb__tenant_charged(t), 4096 - 300);
  ck_assert_int_eq(gmb__tenant_fits(t, 300), 0);
  ck_assert_int_eq(gmb__tenant_fits(t, 301), GMB_E_QUOTA);
  gmb__tenant_quota_why(t, 301, why, sizeof why);
  ck_assert_ptr_nonnull(strstr(why, "less 300B free between blocks in its "
                                    "caches' pages, not charged"));
  /* A report above what its session holds counts what it holds. */
  gmb__tenant_holes_heard(t, &s2, 1000, 96);
  ck_assert_uint_eq(s2, 96);
  ck_assert_uint_eq(t->cache_holes, 396);
  /* However large the reports, an eighth of the quota at most. */
  gmb__tenant_holes_heard(t, &s1, UINT64_MAX, 4000);
  ck_assert_uint_eq(t->cache_holes, 4096);
  ck_assert_uint_eq(gmb__tenant_charged(t), 4096 - 512);
  ck_assert_int_eq(gmb__tenant_fits(t, 512), 0);
  ck_assert_int_eq(gmb__tenant_fits(t, 513), GMB_E_QUOTA);
  ck_assert_int_eq(gmb__tenant_charge(t, 512), 0);
  ck_assert_int_eq(gmb__tenant_charge(t, 1), GMB_E_QUOTA);
  gmb__tenant_uncharge(t, 512);
  /* A reload with cache_holes = 0: pages charged whole. */
  cfg.cache_holes = 0.0;
  gmb__tenants_set_limits(ts, &cfg);
  ck_assert_uint_eq(gmb__tenant_charged(t), 4096);
  ck_assert_int_eq(gmb__tenant_fits(t, 1), GMB_E_QUOTA);
  cfg.cache_holes = 0.125;
  gmb__tenants_set_limits(ts, &cfg);
  ck_assert_int_eq(gmb__tenant_fits(t, 512), 0);
  /* Sessions ending report nothing. */
  gmb__tenant_holes_heard(t, &s1, 0, 0);
  gmb__tenant_holes_heard(t, &s2, 0, 0);
  ck_assert_uint_eq(t->cache_holes, 0);
  ck_assert_int_eq(gmb__tenant_fits(t, 1), GMB_E_QUOTA);
  /* No quota: nothing to forgive, nothing refused. */
  struct gmb_tenant *o = NULL;
  uint64_t s3 = 0;
  ck_assert_int_eq(admit("open", 1, &o), 0);
  ck_assert_int_eq(gmb__tenant_charge(o, 1000), 0);
  gmb__tenant_holes_heard(o, &s3, 500, 1000);
  ck_assert_uint_eq(gmb__tenant_charged(o), 1000);
  gmb__tenant_holes_heard(o, &s3, 0, 0);
  gmb__tenant_uncharge(o, 1000);
  gmb__tenant_uncharge(t, 4096);
}
END_TEST

/* The edges of the holes rule: a quota whose part is past 2^64 as a
 * double (any size is taken) forgives what is reported, not 0; a part of
 * 1 forgives at most the quota and charges nothing below 0; a session
 * that holds less keeps at most that as holes; reports on and on, of 0
 * and of UINT64_MAX, leave the tenant's sum the sessions' own. */
START_TEST(quota_holes_edges) {
  struct gmb_tenant *t = NULL;
  ck_assert_int_eq(admit("llm-a", 1001, &t), 0);
  ck_assert_int_eq(gmb__tenant_charge(t, 4096), 0);
  uint64_t s1 = 0, s2 = 0;
  cfg.cache_holes = 1.0;
  gmb__tenants_set_limits(ts, &cfg);
  t->quota = UINT64_MAX; /* an operator's gmbctl quota set */
  gmb__tenant_holes_heard(t, &s1, 1000, 4096);
  ck_assert_uint_eq(gmb__tenant_holes_uncharged(t), 1000);
  ck_assert_uint_eq(gmb__tenant_charged(t), 4096 - 1000);
  t->quota = UINT64_MAX - 1024; /* rounds to 2^64 too */
  ck_assert_uint_eq(gmb__tenant_holes_uncharged(t), 1000);
  t->quota = UINT64_C(1) << 63; /* exact: the part is the quota */
  ck_assert_uint_eq(gmb__tenant_holes_uncharged(t), 1000);
  /* All of it a hole, the part 1: nothing charged, never below 0. */
  t->quota = 4096;
  gmb__tenant_holes_heard(t, &s1, UINT64_MAX, 4096);
  ck_assert_uint_eq(gmb__tenant_charged(t), 0);
  ck_assert_int_eq(gmb__tenant_fits(t, 4096), 0);
  ck_assert_int_eq(gmb__tenant_fits(t, 4097), GMB_E_QUOTA);
  /* Held less: the figure follows it down, never up. */
  gmb__tenant_holes_held(t, &s1, 100);
  ck_assert_uint_eq(s1, 100);
  ck_assert_uint_eq(t->cache_holes, 100);
  gmb__tenant_holes_held(t, &s1, 4096);
  ck_assert_uint_eq(s1, 100);
  /* Many reports from two sessions: the sum is theirs. */
  for (int i = 0; i < 1000; i++) {
    gmb__tenant_holes_heard(t, &s1, i & 1 ? UINT64_MAX : 0, 2048);
    gmb__tenant_holes_heard(t, &s2, (uint64_t)i, 2048);
    ck_assert_uint_eq(t->cache_holes, s1 + s2);
  }
  ck_assert_uint_eq(t->cache_holes, 2048 + 999);
  gmb__tenant_holes_heard(t, &s1, 0, 0);
  gmb__tenant_holes_heard(t, &s2, 0, 0);
  ck_assert_uint_eq(t->cache_holes, 0);
  t->quota = 4096;
  cfg.cache_holes = 0.125;
  gmb__tenants_set_limits(ts, &cfg);
  gmb__tenant_uncharge(t, 4096);
}
END_TEST

START_TEST(default_quota_applies_to_new_tenants) {
  gmb__tenants_destroy(ts);
  gmb__pool_destroy(pool);
  gmb__device_close(dev);
  gmb__config_free(&cfg);
  setup_with(8192);
  struct gmb_tenant *t = NULL;
  ck_assert_int_eq(admit("newbie", 3, &t), 0);
  ck_assert_uint_eq(t->quota, 8192);
  /* Configured tenants keep their own quota. */
  ck_assert_int_eq(admit("llm-a", 1001, &t), 0);
  ck_assert_uint_eq(t->quota, 4096);
}
END_TEST

START_TEST(check_sees_drift) {
  struct gmb_tenant *t = NULL;
  ck_assert_int_eq(admit("open", 1, &t), 0);
  struct gmb_alloc_info info;
  ck_assert_int_eq(gmb__pool_alloc(pool, t->arena, 1000, 0, NULL, &info), 0);
  /* Neither charged nor its segment counted yet: two violations. */
  ck_assert_int_eq(gmb__tenant_check(ts), 2);
  gmb__tenant_segments_sync(ts, t);
  ck_assert_int_eq(gmb__tenant_charge(t, info.size), 0);
  ck_assert_int_eq(gmb__tenant_check(ts), 0);
  t->used += 512; /* what a missed uncharge would look like */
  ck_assert_int_gt(gmb__tenant_check(ts), 0);
  t->used -= 512;
  ck_assert_int_eq(gmb__pool_free(pool, info.id, NULL), 0);
  gmb__tenant_uncharge(t, info.size);
}
END_TEST

/* --- the shared budget of a uid's first-use tenants --------------------- */

static void reopen_with(uint64_t default_quota) {
  gmb__tenants_destroy(ts);
  gmb__pool_destroy(pool);
  gmb__device_close(dev);
  gmb__config_free(&cfg);
  setup_with(default_quota);
}

/* With default_quota = 0 (the default) there is no budget: a tenant made
 * by first use has no limit (see docs/security.md for what that leaves). */
START_TEST(adhoc_default_config_no_budget) {
  ck_assert_uint_eq(gmb__tenants_uid_budget(ts), 0);
  struct gmb_tenant *t = NULL;
  ck_assert_int_eq(admit("grab", 7, &t), 0);
  ck_assert_int_eq(gmb__tenant_charge(t, 64 * MIB), 0);
  uint64_t limit = 1;
  ck_assert_uint_eq(gmb__tenant_budget_used(t, &limit), 64 * MIB);
  ck_assert_uint_eq(limit, 0);
  gmb__tenant_uncharge(t, 64 * MIB);
}
END_TEST

/* Inventing names used to multiply a uid's budget: each new name came
 * with a fresh default_quota. */
START_TEST(adhoc_names_share_one_budget_per_uid) {
  reopen_with(8192);
  struct gmb_tenant *a = NULL, *b = NULL, *c = NULL, *other = NULL;
  ck_assert_int_eq(admit("a", 7, &a), 0);
  ck_assert_int_eq(admit("b", 7, &b), 0);
  ck_assert_int_eq(admit("c", 8, &c), 0);
  ck_assert_int_eq(gmb__tenant_charge(a, 6144), 0);
  ck_assert_int_eq(gmb__tenant_charge(b, 2048), 0);
  ck_assert_int_eq(gmb__tenant_charge(b, 512), GMB_E_QUOTA);
  ck_assert_int_eq(gmb__tenant_fits(a, 512), GMB_E_QUOTA);
  uint64_t limit = 0;
  ck_assert_uint_eq(gmb__tenant_budget_used(b, &limit), 8192);
  ck_assert_uint_eq(limit, 8192);
  /* Another uid's budget is its own. */
  ck_assert_int_eq(gmb__tenant_charge(c, 8192), 0);
  /* A configured tenant is outside every budget. */
  ck_assert_int_eq(admit("open", 7, &other), 0);
  ck_assert_int_eq(gmb__tenant_charge(other, 64 * MIB), 0);
  gmb__tenant_uncharge(other, 64 * MIB);
  /* Freeing in one tenant makes room in the other. */
  gmb__tenant_uncharge(a, 6144);
  ck_assert_int_eq(gmb__tenant_charge(b, 6144), 0);
  ck_assert_uint_eq(gmb__tenant_budget_used(a, &limit), 8192);
  gmb__tenant_uncharge(b, 8192);
  gmb__tenant_uncharge(c, 8192);
}
END_TEST

/* An operator's quota (gmbctl quota set, the state file) is a tenant's
 * whole rule: it leaves the shared budget, keeping the bytes it charged
 * there until they are freed. */
START_TEST(adhoc_operator_quota_leaves_budget) {
  reopen_with(8192);
  struct gmb_tenant *a = NULL, *b = NULL;
  ck_assert_int_eq(admit("a", 7, &a), 0);
  ck_assert_int_eq(admit("b", 7, &b), 0);
  ck_assert_int_eq(gmb__tenant_charge(a, 8192), 0);
  gmb__tenant_set_quota(ts, a, 32 * MIB);
  ck_assert_int_eq(gmb__tenant_charge(a, 16 * MIB), 0);
  ck_assert_int_eq(gmb__tenant_fits(b, 512), GMB_E_QUOTA); /* still held */
  gmb__tenant_uncharge(a, 16 * MIB + 8192);
  ck_assert_int_eq(gmb__tenant_charge(b, 8192), 0);
  gmb__tenant_uncharge(b, 8192);
}
END_TEST

/* VMM bytes its sessions reported count against the uid's budget and the
 * tenant's quota as allocations do, and give the room back when less is
 * reported; the peak counts them. */
START_TEST(adhoc_vmm_counts_in_budget_and_quota) {
  reopen_with(8192);
  struct gmb_tenant *a = NULL, *b = NULL;
  ck_assert_int_eq(admit("a", 7, &a), 0);
  ck_assert_int_eq(admit("b", 7, &b), 0);
  ck_assert_int_eq(gmb__tenant_fits(a, 6144), 0);
  gmb__tenant_vmm(a, 6144);
  ck_assert_uint_eq(a->vmm, 6144);
  ck_assert_uint_eq(a->peak, 6144);
  ck_assert_int_eq(gmb__tenant_fits(b, 4096), GMB_E_QUOTA);
  ck_assert_int_eq(gmb__tenant_charge(b, 2048), 0);
  ck_assert_int_eq(gmb__tenant_fits(a, 512), GMB_E_QUOTA);
  char why[256];
  gmb__tenant_quota_why(a, 512, why, sizeof why);
  ck_assert_ptr_nonnull(strstr(why, "budget"));
  gmb__tenant_vmm(a, -4096);
  ck_assert_uint_eq(a->vmm, 2048);
  ck_assert_int_eq(gmb__tenant_charge(b, 4096), 0);
  gmb__tenant_uncharge(b, 6144);
  /* Its own quota, set by an operator, holds the VMM bytes too. */
  gmb__tenant_set_quota(ts, a, 4096);
  ck_assert_int_eq(gmb__tenant_fits(a, 4096), GMB_E_QUOTA);
  gmb__tenant_quota_why(a, 4096, why, sizeof why);
  ck_assert_ptr_nonnull(strstr(why, "through cuMemCreate"));
  ck_assert_int_eq(gmb__tenant_charge(a, 2048), 0);
  gmb__tenant_uncharge(a, 2048);
  gmb__tenant_vmm(a, -2048);
  ck_assert_uint_eq(a->vmm, 0);
  ck_assert_int_eq(gmb__tenant_check(ts), 0);
}
END_TEST

/* The budget goes with the uid's last tenant (teardown checks the rest;
 * ASan would see a leak). */
START_TEST(adhoc_budget_freed_with_last_tenant) {
  reopen_with(8192);
  struct gmb_tenant *t = NULL;
  ck_assert_int_eq(admit(NULL, 9, &t), 0);
  ck_assert_int_eq(gmb__tenant_charge(t, 4096), 0);
  ck_assert_uint_eq(gmb__tenants_reap(ts, 0), 0); /* it holds bytes */
  gmb__tenant_uncharge(t, 4096);
  ck_assert_uint_eq(gmb__tenants_reap(ts, 0), 1);
  ck_assert_int_eq(gmb__tenant_check(ts), 0);
  ck_assert_int_eq(admit(NULL, 9, &t), 0);
  uint64_t limit = 0;
  ck_assert_uint_eq(gmb__tenant_budget_used(t, &limit), 0);
  ck_assert_uint_eq(limit, 8192);
  ck_assert_int_eq(gmb__tenant_charge(t, 8192), 0);
  gmb__tenant_uncharge(t, 8192);
}
END_TEST

/* --- reservations ---------------------------------------------------- */

/* What the broker does for an allocation: pool, segments, the rule (when
 * the tenant's segments grew), charge.  Returns 0 with *id, or
 * GMB_E_NOMEM (from the pool or the rule, rolled back). */
static int res_alloc(struct gmb_tenant *t, uint64_t size, uint64_t *id,
                     char *why, size_t whycap) {
  struct gmb_alloc_info info;
  uint64_t before = t->segment_bytes;
  int rc = gmb__pool_alloc(pool, t->arena, size, 0, NULL, &info);
  gmb__tenant_segments_sync(ts, t);
  if (rc) return rc;
  if (t->segment_bytes > before) {
    rc = gmb__tenant_reserve_allows(ts, t, info.size,
                                    dev->capacity - dev->in_use, why, whycap);
    if (rc) {
      ck_assert_int_eq(gmb__pool_free(pool, info.id, NULL), 0);
      gmb__pool_trim(pool);
      gmb__tenant_segments_sync(ts, t);
      return rc;
    }
  }
  ck_assert_int_eq(gmb__tenant_charge(t, info.size), 0);
  *id = info.id;
  ck_assert_int_eq(gmb__tenant_check(ts), 0);
  return 0;
}

static void res_free(struct gmb_tenant *t, uint64_t id) {
  struct gmb_alloc_info info;
  ck_assert_int_eq(gmb__pool_free(pool, id, &info), 0);
  gmb__tenant_uncharge(t, info.size);
  ck_assert_int_eq(gmb__tenant_check(ts), 0);
}

START_TEST(reserve_kept_from_others) {
  struct gmb_tenant *res = NULL, *open = NULL;
  ck_assert_int_eq(admit("res", 1, &res), 0);
  ck_assert_int_eq(admit("open", 2, &open), 0);
  ck_assert_uint_eq(gmb__tenants_reserve_short(ts), 32 * MIB);
  uint64_t ids[4], id, mine;
  char why[512];
  for (int i = 0; i < 4; i++)
    ck_assert_int_eq(res_alloc(open, 8 * MIB, &ids[i], why, sizeof why), 0);
  ck_assert_int_eq(res_alloc(open, 8 * MIB, &id, why, sizeof why),
                   GMB_E_NOMEM);
  ck_assert_ptr_nonnull(strstr(why, "tenant res's reservation of 32MiB"));
  ck_assert_ptr_nonnull(strstr(why, "32MiB still unused"));
  ck_assert_uint_eq(open->refusals_reserve, 1);
  ck_assert_uint_eq(open->used, 32 * MIB);
  ck_assert_uint_eq(dev->in_use, 32 * MIB); /* the refusal was rolled back */
  /* Small requests make a 2 MiB segment: refused the same way, and the
   * segment made for the attempt does not linger. */
  ck_assert_int_eq(res_alloc(open, 4096, &id, why, sizeof why), GMB_E_NOMEM);
  ck_assert_uint_eq(open->segment_bytes, 32 * MIB);
  /* The reservation's owner gets all of it. */
  ck_assert_int_eq(res_alloc(res, 32 * MIB, &mine, why, sizeof why), 0);
  ck_assert_uint_eq(gmb__tenants_reserve_short(ts), 0);
  res_free(res, mine);
  for (int i = 0; i < 4; i++) res_free(open, ids[i]);
}
END_TEST

START_TEST(reserve_own_never_refused) {
  /* Reservations adding up to the capacity: each owner still gets its
   * own, in any order, even though the other's is unused. */
  struct gmb_tenant *res = NULL, *open = NULL;
  ck_assert_int_eq(admit("res", 1, &res), 0);
  ck_assert_int_eq(admit("open", 2, &open), 0);
  gmb__tenant_set_reserve(ts, open, 32 * MIB);
  char why[512];
  ck_assert_int_eq(gmb__tenants_check_reservations(ts, dev->capacity, why,
                                                   sizeof why), 0);
  uint64_t a, b, c;
  ck_assert_int_eq(res_alloc(open, 32 * MIB, &a, why, sizeof why), 0);
  ck_assert_int_eq(res_alloc(res, 16 * MIB, &b, why, sizeof why), 0);
  ck_assert_int_eq(res_alloc(res, 16 * MIB, &c, why, sizeof why), 0);
  res_free(open, a);
  res_free(res, b);
  res_free(res, c);
}
END_TEST

START_TEST(reserve_counts_free_space_in_own_segments) {
  struct gmb_tenant *res = NULL, *open = NULL;
  ck_assert_int_eq(admit("res", 1, &res), 0);
  ck_assert_int_eq(admit("open", 2, &open), 0);
  gmb__tenant_set_reserve(ts, res, 8 * MIB);
  char why[512];
  /* res fills one small segment, then keeps one 512 KiB allocation: 2 MiB
   * of segments of which 1.5 MiB free, that it alone can use. */
  uint64_t small[4];
  for (int i = 0; i < 4; i++)
    ck_assert_int_eq(res_alloc(res, 512 * 1024, &small[i], why, sizeof why),
                     0);
  ck_assert_uint_eq(res->segment_bytes, 2 * MIB);
  for (int i = 1; i < 4; i++) res_free(res, small[i]);
  ck_assert_uint_eq(res->segment_bytes, 2 * MIB);
  /* 7.5 MiB unused, 6 MiB of it not in res's segments: the others may
   * have 64 - 2 - 6 = 56 MiB, not 54.5. */
  ck_assert_uint_eq(gmb__tenants_reserve_short(ts), 6 * MIB);
  uint64_t ids[7], id;
  for (int i = 0; i < 7; i++)
    ck_assert_int_eq(res_alloc(open, 8 * MIB, &ids[i], why, sizeof why), 0);
  ck_assert_int_eq(res_alloc(open, 2 * MIB, &id, why, sizeof why),
                   GMB_E_NOMEM);
  ck_assert_ptr_nonnull(strstr(why, "7680KiB still unused"));
  /* res gets its 7.5 MiB: 1.5 in its segment, 6 from the device. */
  uint64_t r1, r2;
  ck_assert_int_eq(res_alloc(res, 6 * MIB, &r1, why, sizeof why), 0);
  ck_assert_int_eq(res_alloc(res, 1024 * 1024, &r2, why, sizeof why), 0);
  res_free(res, r1);
  res_free(res, r2);
  res_free(res, small[0]);
  for (int i = 0; i < 7; i++) res_free(open, ids[i]);
}
END_TEST

START_TEST(reserve_exact_limit) {
  struct gmb_tenant *res = NULL, *open = NULL;
  ck_assert_int_eq(admit("res", 1, &res), 0);
  ck_assert_int_eq(admit("open", 2, &open), 0);
  char why[512];
  /* The rule itself: room equal to the others' need is enough. */
  ck_assert_int_eq(gmb__tenant_reserve_allows(ts, open, 512, 32 * MIB, why,
                                              sizeof why), 0);
  ck_assert_int_eq(gmb__tenant_reserve_allows(ts, open, 512, 32 * MIB - 1,
                                              why, sizeof why), GMB_E_NOMEM);
  /* Its own reservation does not count against it. */
  ck_assert_int_eq(gmb__tenant_reserve_allows(ts, res, 64 * MIB, 0, why,
                                              sizeof why), 0);
  ck_assert_int_eq(gmb__tenant_within_reserve(res, 32 * MIB), 1);
  ck_assert_int_eq(gmb__tenant_within_reserve(res, 32 * MIB + 1), 0);
}
END_TEST

START_TEST(reserve_set_keeps_the_sum) {
  struct gmb_tenant *res = NULL, *open = NULL;
  ck_assert_int_eq(admit("res", 1, &res), 0);
  ck_assert_int_eq(admit("open", 2, &open), 0);
  uint64_t id;
  char why[512];
  ck_assert_int_eq(res_alloc(res, 8 * MIB, &id, why, sizeof why), 0);
  ck_assert_uint_eq(gmb__tenants_reserve_short(ts), 24 * MIB);
  gmb__tenant_set_reserve(ts, res, 4 * MIB); /* below what it holds */
  ck_assert_uint_eq(gmb__tenants_reserve_short(ts), 0);
  gmb__tenant_set_reserve(ts, open, 10 * MIB);
  ck_assert_uint_eq(gmb__tenants_reserve_short(ts), 10 * MIB);
  ck_assert_int_eq(gmb__tenant_check(ts), 0);
  res_free(res, id); /* its segment goes: the sum follows */
  ck_assert_uint_eq(gmb__tenants_reserve_short(ts), 14 * MIB);
  gmb__tenant_set_reserve(ts, open, 0);
  gmb__tenant_set_quota(ts, open, 123);
  ck_assert_uint_eq(open->quota, 123);
  ck_assert_uint_eq(gmb__tenants_reserve_short(ts), 4 * MIB);
}
END_TEST

START_TEST(reservations_above_capacity_reported) {
  struct gmb_tenant *open = NULL;
  char msg[512];
  ck_assert_int_eq(admit("open", 2, &open), 0);
  gmb__tenant_set_reserve(ts, open, 32 * MIB);
  ck_assert_int_eq(gmb__tenants_check_reservations(ts, 64 * MIB, msg,
                                                   sizeof msg), 0);
  ck_assert_str_eq(msg, "");
  gmb__tenant_set_reserve(ts, open, 32 * MIB + 512);
  ck_assert_int_eq(gmb__tenants_check_reservations(ts, 64 * MIB, msg,
                                                   sizeof msg), GMB_E_INVAL);
  ck_assert_ptr_nonnull(strstr(msg, "2 tenants"));
}
END_TEST

START_TEST(check_sees_reserve_drift) {
  struct gmb_tenant *res = NULL;
  ck_assert_int_eq(admit("res", 1, &res), 0);
  res->reserve = 16 * MIB; /* changed behind the registry's back */
  ck_assert_int_gt(gmb__tenant_check(ts), 0);
  res->reserve = 32 * MIB;
  ck_assert_int_eq(gmb__tenant_check(ts), 0);
}
END_TEST

/* A uid at max_tenants_per_uid can send Hellos naming new tenants at will:
 * each refusal used to walk every tenant to count the uid's (66 us with
 * 4,017 of them).  The count is kept per uid as tenants are made,
 * configured and removed: one lookup per refusal, however many tenants
 * the registry holds, and the check recounts it. */
START_TEST(made_by_uid_counted_without_a_walk) {
  enum { OTHERS = 2000 };
  struct gmb_tenant *t = NULL, *mine[16];
  char name[32];
  for (int i = 0; i < OTHERS; i++) {
    snprintf(name, sizeof name, "o%d", i);
    ck_assert_int_eq(admit(name, 3000 + (uid_t)i, &t), 0);
  }
  ck_assert_uint_eq(cfg.max_tenants_per_uid, 16);
  for (int i = 0; i < 16; i++) {
    snprintf(name, sizeof name, "m%d", i);
    ck_assert_int_eq(admit(name, 2000, &mine[i]), 0);
  }
  ck_assert_int_eq(gmb__tenant_check(ts), 0);
  uint64_t lookups = gmb__tenants_made_lookups(ts);
  for (int i = 0; i < 100; i++) {
    snprintf(name, sizeof name, "x%d", i);
    ck_assert_int_eq(admit(name, 2000, &t), GMB_E_LIMIT);
  }
  ck_assert_uint_eq(gmb__tenants_made_lookups(ts) - lookups, 100);
  /* Its default name never counts. */
  ck_assert_int_eq(admit("uid-2000", 2000, &t), 0);
  ck_assert_int_eq(admit("x0", 2000, &t), GMB_E_LIMIT);
  /* One of them configured (a reload): no longer counted. */
  mine[0]->configured = 1;
  ck_assert_int_gt(gmb__tenant_check(ts), 0); /* behind the count's back */
  gmb__tenant_owner_sync(ts, mine[0]);
  ck_assert_int_eq(gmb__tenant_check(ts), 0);
  ck_assert_int_eq(admit("x0", 2000, &t), 0);
  ck_assert_int_eq(admit("x1", 2000, &t), GMB_E_LIMIT);
  /* One removed (idle): room for one more. */
  gmb__tenant_remove(ts, mine[1]);
  ck_assert_int_eq(gmb__tenant_check(ts), 0);
  ck_assert_int_eq(admit("x1", 2000, &t), 0);
  ck_assert_int_eq(admit("x2", 2000, &t), GMB_E_LIMIT);
  /* Configured no more: its first user's again, and counted. */
  mine[0]->configured = 0;
  gmb__tenant_owner_sync(ts, mine[0]);
  ck_assert_int_eq(gmb__tenant_check(ts), 0);
  ck_assert_int_eq(admit("x2", 2000, &t), GMB_E_LIMIT);
}
END_TEST

static Suite *tenant_suite(void) {
  Suite *s = suite_create("tenant");
  TCase *tc = tcase_create("core");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_add_test(tc, configured_uid_admitted);
  tcase_add_test(tc, quota_holes_forgiven_up_to_a_part);
  tcase_add_test(tc, quota_holes_edges);
  tcase_add_test(tc, configured_uid_refused);
  tcase_add_test(tc, token_right_admits_any_uid);
  tcase_add_test(tc, token_guessing_rate_limited_per_uid);
  tcase_add_test(tc, token_wrong_refused_without_echo);
  tcase_add_test(tc, token_empty_refused);
  tcase_add_test(tc, token_or_uid_for_tenant_with_both);
  tcase_add_test(tc, token_proves_nothing_without_token_sha256);
  tcase_add_test(tc, unnamed_tenant_is_uid_name);
  tcase_add_test(tc, auto_tenant_owned_by_first_uid);
  tcase_add_test(tc, made_by_uid_counted_without_a_walk);
  tcase_add_test(tc, bad_names_refused);
  tcase_add_test(tc, quota_exact_limit);
  tcase_add_test(tc, quota_zero_is_unlimited);
  tcase_add_test(tc, quota_overflow_refused);
  tcase_add_test(tc, quota_lowered_below_used);
  tcase_add_test(tc, default_quota_applies_to_new_tenants);
  tcase_add_test(tc, adhoc_default_config_no_budget);
  tcase_add_test(tc, adhoc_names_share_one_budget_per_uid);
  tcase_add_test(tc, adhoc_operator_quota_leaves_budget);
  tcase_add_test(tc, adhoc_budget_freed_with_last_tenant);
  tcase_add_test(tc, adhoc_vmm_counts_in_budget_and_quota);
  tcase_add_test(tc, check_sees_drift);
  tcase_add_test(tc, reserve_kept_from_others);
  tcase_add_test(tc, reserve_own_never_refused);
  tcase_add_test(tc, reserve_counts_free_space_in_own_segments);
  tcase_add_test(tc, reserve_exact_limit);
  tcase_add_test(tc, reserve_set_keeps_the_sum);
  tcase_add_test(tc, reservations_above_capacity_reported);
  tcase_add_test(tc, check_sees_reserve_drift);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) { return check_run(tenant_suite()); }
