/*
 * check_tenant.c - the tenant registry: who may act as a tenant, default
 * tenancy, and exact quota accounting.
 */
#include <check.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"
#include "device.h"
#include "gmb.h"
#include "pool.h"
#include "tenant.h"

static struct gmb_device *dev;
static struct gmb_pool *pool;
static struct gmb_tenants *ts;
static struct gmb_config cfg;

static void setup_with(uint64_t default_quota) {
  char err[256];
  ck_assert_int_eq(gmb__device_open("host:64MiB", 0, 0, &dev, err, sizeof err),
                   0);
  pool = gmb__pool_new(dev, NULL, NULL);
  ck_assert_ptr_nonnull(pool);
  gmb__config_defaults(&cfg);
  cfg.default_quota = default_quota;
  cfg.tenants = calloc(2, sizeof *cfg.tenants);
  cfg.n_tenants = 2;
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

START_TEST(token_alone_proves_nothing_yet) {
  struct gmb_tenant *t = NULL;
  char why[256];
  const uint8_t tok[] = "secret";
  ck_assert_int_eq(
      gmb__tenant_admit(ts, "llm-a", 7, tok, 6, &t, why, sizeof why),
      GMB_E_AUTH);
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
  ck_assert_uint_eq(gmb__tenants_count(ts), 2);
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
  ck_assert_int_eq(gmb__tenant_charge(t, info.size), 0);
  ck_assert_int_eq(gmb__tenant_check(ts), 0);
  t->used += 512; /* what a missed uncharge would look like */
  ck_assert_int_gt(gmb__tenant_check(ts), 0);
  t->used -= 512;
  ck_assert_int_eq(gmb__pool_free(pool, info.id, NULL), 0);
  gmb__tenant_uncharge(t, info.size);
}
END_TEST

static Suite *tenant_suite(void) {
  Suite *s = suite_create("tenant");
  TCase *tc = tcase_create("core");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_add_test(tc, configured_uid_admitted);
  tcase_add_test(tc, configured_uid_refused);
  tcase_add_test(tc, token_alone_proves_nothing_yet);
  tcase_add_test(tc, unnamed_tenant_is_uid_name);
  tcase_add_test(tc, auto_tenant_owned_by_first_uid);
  tcase_add_test(tc, bad_names_refused);
  tcase_add_test(tc, quota_exact_limit);
  tcase_add_test(tc, quota_zero_is_unlimited);
  tcase_add_test(tc, quota_overflow_refused);
  tcase_add_test(tc, quota_lowered_below_used);
  tcase_add_test(tc, default_quota_applies_to_new_tenants);
  tcase_add_test(tc, check_sees_drift);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) {
  SRunner *sr = srunner_create(tenant_suite());
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
