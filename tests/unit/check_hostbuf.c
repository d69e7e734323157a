/*
 * check_hostbuf.c - the host buffers of offloads (hostbuf.c) on a process
 * with no CUDA device attached: pageable buffers, kept after a free for
 * the next allocation that fits, within GMB_HOST_KEEP (8 MiB here, set
 * before the first use), the oldest kept going first.  Each test gives
 * every kept buffer back at its end, so the figures start at 0.
 */
#include <check.h>
#include <stdlib.h>
#include <string.h>

#include "check_main.h"
#include "hostbuf.h"

#define MIB ((size_t)1 << 20)

static struct gmb_hostbuf_stats st(void) {
  struct gmb_hostbuf_stats s;
  gmb__hostbuf_stats(&s);
  return s;
}

static void teardown(void) {
  gmb__hostbuf_release();
  struct gmb_hostbuf_stats s = st();
  ck_assert_uint_eq(s.kept, 0);
  ck_assert_uint_eq(s.pageable, 0);
  ck_assert_uint_eq(s.pinned, 0);
}

START_TEST(freed_buffer_is_reused) {
  uint64_t reused = st().reused;
  char *p = gmb__hostbuf_alloc(4 * MIB);
  ck_assert_ptr_nonnull(p);
  memset(p, 7, 4 * MIB);
  ck_assert_uint_eq(st().pageable, 4 * MIB);
  gmb__hostbuf_free(p);
  ck_assert_uint_eq(st().kept, 4 * MIB);
  char *q = gmb__hostbuf_alloc(4 * MIB);
  ck_assert_ptr_eq(q, p);
  ck_assert_uint_eq(st().reused, reused + 1);
  ck_assert_uint_eq(st().kept, 0);
  gmb__hostbuf_free(q);
}
END_TEST

/* A kept buffer serves a request of at least half its size, no more. */
START_TEST(reuse_needs_a_fit) {
  char *p = gmb__hostbuf_alloc(4 * MIB);
  gmb__hostbuf_free(p);
  char *small = gmb__hostbuf_alloc(1 * MIB);
  char *big = gmb__hostbuf_alloc(5 * MIB);
  ck_assert_ptr_ne(small, p);
  ck_assert_ptr_ne(big, p);
  char *fit = gmb__hostbuf_alloc(3 * MIB);
  ck_assert_ptr_eq(fit, p);
  memset(fit, 1, 3 * MIB);
  memset(small, 2, 1 * MIB);
  memset(big, 3, 5 * MIB);
  gmb__hostbuf_free(fit);
  gmb__hostbuf_free(small);
  gmb__hostbuf_free(big);
}
END_TEST

START_TEST(keep_limit_evicts_the_oldest) {
  char *a = gmb__hostbuf_alloc(4 * MIB), *b = gmb__hostbuf_alloc(4 * MIB);
  char *c = gmb__hostbuf_alloc(4 * MIB);
  ck_assert_uint_eq(st().pageable, 12 * MIB);
  gmb__hostbuf_free(a);
  gmb__hostbuf_free(b);
  gmb__hostbuf_free(c); /* past 8 MiB: a goes */
  ck_assert_uint_eq(st().kept, 8 * MIB);
  ck_assert_uint_eq(st().pageable, 8 * MIB);
  char *x = gmb__hostbuf_alloc(4 * MIB), *y = gmb__hostbuf_alloc(4 * MIB);
  ck_assert((x == b && y == c) || (x == c && y == b));
  gmb__hostbuf_free(x);
  gmb__hostbuf_free(y);
}
END_TEST

START_TEST(larger_than_the_limit_is_freed) {
  char *p = gmb__hostbuf_alloc(16 * MIB);
  ck_assert_ptr_nonnull(p);
  memset(p, 5, 16 * MIB);
  gmb__hostbuf_free(p);
  ck_assert_uint_eq(st().kept, 0);
  ck_assert_uint_eq(st().pageable, 0);
}
END_TEST

START_TEST(small_zero_and_null) {
  char *p = gmb__hostbuf_alloc(100), *z = gmb__hostbuf_alloc(0);
  ck_assert_ptr_nonnull(p);
  ck_assert_ptr_nonnull(z);
  memset(p, 9, 100);
  gmb__hostbuf_free(NULL);
  gmb__hostbuf_free(p);
  gmb__hostbuf_free(z);
  /* No CUDA device in this process: nothing pinned, nothing refused. */
  ck_assert_uint_eq(st().pinned, 0);
  ck_assert_uint_eq(st().refused, 0);
}
END_TEST

static Suite *hostbuf_suite(void) {
  Suite *s = suite_create("hostbuf");
  TCase *tc = tcase_create("keep");
  tcase_add_checked_fixture(tc, NULL, teardown);
  tcase_add_test(tc, freed_buffer_is_reused);
  tcase_add_test(tc, reuse_needs_a_fit);
  tcase_add_test(tc, keep_limit_evicts_the_oldest);
  tcase_add_test(tc, larger_than_the_limit_is_freed);
  tcase_add_test(tc, small_zero_and_null);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) {
  setenv("GMB_HOST_KEEP", "8MiB", 1);
  return check_run(hostbuf_suite());
}
