/*
 * check_util.c - proto/util.c: sizes as people write them, tenant names
 * and the run directory.
 *
 * Sizes are the operator's interface to quotas, so both directions are
 * pinned down: what parses (and to exactly how many bytes), what is refused
 * (signs, bare units, half bytes, overflow), and how gmb__size_format
 * prints so that "gmbctl quota get" output can be pasted back.
 */
#include <check.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check_main.h"
#include "gmb.h"
#include "util.h"

static uint64_t parse_ok(const char *s) {
  uint64_t v = 0xdeadbeef;
  int rc = gmb__size_parse(s, &v);
  ck_assert_msg(rc == 0, "gmb__size_parse(\"%s\") = %d, want 0", s, rc);
  return v;
}

static void parse_refused(const char *s) {
  uint64_t v = 0xdeadbeef;
  int rc = gmb__size_parse(s, &v);
  ck_assert_msg(rc == GMB_E_INVAL, "gmb__size_parse(\"%s\") = %d, want %d", s,
                rc, GMB_E_INVAL);
  ck_assert_uint_eq(v, 0xdeadbeef); /* *out untouched on failure */
}

START_TEST(size_parse_plain_bytes) {
  ck_assert_uint_eq(parse_ok("0"), 0);
  ck_assert_uint_eq(parse_ok("512"), 512);
  ck_assert_uint_eq(parse_ok("512B"), 512);
  ck_assert_uint_eq(parse_ok("18446744073709551615"), UINT64_MAX);
  ck_assert_uint_eq(parse_ok("  4096  "), 4096);
}
END_TEST

START_TEST(size_parse_units) {
  ck_assert_uint_eq(parse_ok("512MiB"), 512 * GMB_MIB);
  ck_assert_uint_eq(parse_ok("20GiB"), 20 * GMB_GIB);
  ck_assert_uint_eq(parse_ok("2 MiB"), 2 * GMB_MIB);
  ck_assert_uint_eq(parse_ok("4k"), 4 * GMB_KIB);
  ck_assert_uint_eq(parse_ok("4K"), 4 * GMB_KIB);
  ck_assert_uint_eq(parse_ok("1TB"), GMB_TIB);
  ck_assert_uint_eq(parse_ok("1TiB"), GMB_TIB);
  ck_assert_uint_eq(parse_ok("3G"), 3 * GMB_GIB);
  ck_assert_uint_eq(parse_ok("0GiB"), 0);
  /* GB means GiB: GPU memory is counted in powers of two. */
  ck_assert_uint_eq(parse_ok("8GB"), 8 * GMB_GIB);
  ck_assert_uint_eq(parse_ok("16777215TiB"), 16777215 * GMB_TIB);
}
END_TEST

START_TEST(size_parse_lowercase_units) {
  ck_assert_uint_eq(parse_ok("512mib"), 512 * GMB_MIB);
  ck_assert_uint_eq(parse_ok("20gib"), 20 * GMB_GIB);
  ck_assert_uint_eq(parse_ok("1tb"), GMB_TIB);
  ck_assert_uint_eq(parse_ok("7kb"), 7 * GMB_KIB);
  ck_assert_uint_eq(parse_ok("9b"), 9);
  ck_assert_uint_eq(parse_ok("2m"), 2 * GMB_MIB);
}
END_TEST

START_TEST(size_parse_fractions) {
  ck_assert_uint_eq(parse_ok("1.5GiB"), GMB_GIB + GMB_GIB / 2);
  ck_assert_uint_eq(parse_ok("0.5MiB"), GMB_MIB / 2);
  ck_assert_uint_eq(parse_ok("0.25 KiB"), 256);
  ck_assert_uint_eq(parse_ok("1.50GiB"), GMB_GIB + GMB_GIB / 2);
  /* A fraction that is not a whole byte is cut, not rounded up. */
  ck_assert_uint_eq(parse_ok("0.1KiB"), 102);
  /* The largest whole TiB plus a half still fits in 64 bits. */
  ck_assert_uint_eq(parse_ok("16777215.5TiB"),
                    16777215 * GMB_TIB + GMB_TIB / 2);
}
END_TEST

START_TEST(size_parse_refusals) {
  parse_refused("");
  parse_refused("   ");
  parse_refused("-1");
  parse_refused("+1");
  parse_refused("MiB");
  parse_refused("1.5");     /* a fraction of a byte */
  parse_refused("1.5B");
  parse_refused("1.GiB");   /* a point needs digits after it */
  parse_refused(".5GiB");
  parse_refused("12XB");
  parse_refused("12 MiB extra");
  parse_refused("12MiBs");
  parse_refused("1e3");
  parse_refused("0x10");
  parse_refused("18446744073709551616"); /* 2^64 */
  parse_refused("99999999999999999999999");
  parse_refused("17179869184GiB");       /* 2^34 GiB = 2^64 */
  parse_refused("16777216TiB");          /* 2^24 TiB = 2^64 */
  ck_assert_int_eq(gmb__size_parse(NULL, &(uint64_t){0}), GMB_E_INVAL);
}
END_TEST

static const char *fmt(uint64_t v) {
  static char buf[GMB_SIZE_BUFSZ];
  return gmb__size_format(v, buf, sizeof buf);
}

START_TEST(size_format_exact_powers_roundtrip) {
  static const uint64_t vals[] = {
      0,           1,           512,         1023,        GMB_KIB,
      4 * GMB_KIB, 512 * GMB_MIB, 3 * GMB_GIB, 20 * GMB_GIB, GMB_TIB,
      1536 * GMB_MIB, 1024 * GMB_TIB, 16777215 * GMB_TIB};
  static const char *want[] = {
      "0B",     "1B",     "512B",    "1023B",  "1KiB",
      "4KiB",   "512MiB", "3GiB",    "20GiB",  "1TiB",
      "1536MiB", "1024TiB", "16777215TiB"};
  for (size_t i = 0; i < sizeof vals / sizeof vals[0]; i++) {
    char buf[GMB_SIZE_BUFSZ];
    ck_assert_ptr_eq(gmb__size_format(vals[i], buf, sizeof buf), buf);
    ck_assert_str_eq(buf, want[i]);
    ck_assert_uint_eq(parse_ok(buf), vals[i]);
  }
}
END_TEST

START_TEST(size_format_odd_values_two_decimals) {
  ck_assert_str_eq(fmt(1536), "1.50KiB");
  ck_assert_str_eq(fmt(GMB_GIB + GMB_GIB / 2 + 1), "1.50GiB");
  ck_assert_str_eq(fmt(GMB_MIB + 1), "1.00MiB");
  ck_assert_str_eq(fmt(1025), "1.00KiB");
  ck_assert_str_eq(fmt(UINT64_MAX), "16777216.00TiB");
  /* Just under a unit rounds to "1.00" of the next one, not "1024.00" of
   * this one. */
  ck_assert_str_eq(fmt(GMB_GIB - 1), "1.00GiB");
  ck_assert_str_eq(fmt(GMB_MIB - 1), "1.00MiB");
  ck_assert_str_eq(fmt(GMB_TIB - 512), "1.00TiB");
}
END_TEST

START_TEST(size_format_small_buffer) {
  char buf[4];
  memset(buf, 'x', sizeof buf);
  gmb__size_format(512 * GMB_MIB, buf, sizeof buf);
  ck_assert_uint_eq(strnlen(buf, sizeof buf), 3); /* cut, NUL-terminated */
}
END_TEST

START_TEST(name_valid_edges) {
  char name[80];
  memset(name, 'a', sizeof name);
  name[63] = '\0';
  ck_assert_int_eq(gmb__name_valid(name), 1); /* 63: the longest */
  name[63] = 'a';
  name[64] = '\0';
  ck_assert_int_eq(gmb__name_valid(name), 0); /* 64: too long */
  ck_assert_int_eq(gmb__name_valid("a"), 1);
  ck_assert_int_eq(gmb__name_valid("llm-a"), 1);
  ck_assert_int_eq(gmb__name_valid("uid-1000"), 1);
  ck_assert_int_eq(gmb__name_valid("A.b_c-9"), 1);
  ck_assert_int_eq(gmb__name_valid("_x"), 1);
  ck_assert_int_eq(gmb__name_valid("9"), 1);
  ck_assert_int_eq(gmb__name_valid("a."), 1);
  ck_assert_int_eq(gmb__name_valid(".hidden"), 0);
  ck_assert_int_eq(gmb__name_valid(".."), 0);
  ck_assert_int_eq(gmb__name_valid("-flag"), 0);
  ck_assert_int_eq(gmb__name_valid("a/b"), 0);
  ck_assert_int_eq(gmb__name_valid("/"), 0);
  ck_assert_int_eq(gmb__name_valid("a b"), 0);
  ck_assert_int_eq(gmb__name_valid(" a"), 0);
  ck_assert_int_eq(gmb__name_valid("a:b"), 0);
  ck_assert_int_eq(gmb__name_valid("caf\xc3\xa9"), 0);
  ck_assert_int_eq(gmb__name_valid("a\n"), 0);
  ck_assert_int_eq(gmb__name_valid(""), 0);
  ck_assert_int_eq(gmb__name_valid(NULL), 0);
}
END_TEST

START_TEST(run_dir_env_wins) {
  char buf[256];
  setenv("GMB_RUN_DIR", "/srv/gmb-test", 1);
  setenv("XDG_RUNTIME_DIR", "/run/user/4242", 1);
  ck_assert_ptr_eq(gmb__run_dir(buf, sizeof buf), buf);
  ck_assert_str_eq(buf, "/srv/gmb-test");
  /* An empty GMB_RUN_DIR is unset, not "". */
  setenv("GMB_RUN_DIR", "", 1);
  ck_assert_ptr_nonnull(gmb__run_dir(buf, sizeof buf));
  ck_assert_str_ne(buf, "");
  /* Too small a buffer: NULL, not a cut path. */
  setenv("GMB_RUN_DIR", "/a/rather/long/run/directory", 1);
  ck_assert_ptr_null(gmb__run_dir(buf, 8));
}
END_TEST

/* gmb__run_dir() with GMB_RUN_DIR unset and XDG_RUNTIME_DIR set, empty and
 * unset, in that order, written one a line into buf. */
static void run_dir_defaults(char *buf, size_t cap) {
  char one[256];
  size_t n = 0;
  unsetenv("GMB_RUN_DIR");
  for (int i = 0; i < 3; i++) {
    if (i == 0) setenv("XDG_RUNTIME_DIR", "/run/user/4242", 1);
    if (i == 1) setenv("XDG_RUNTIME_DIR", "", 1);
    if (i == 2) unsetenv("XDG_RUNTIME_DIR");
    const char *r = gmb__run_dir(one, sizeof one);
    n += (size_t)snprintf(buf + n, cap - n, "%s\n", r ? r : "(null)");
  }
}

static void run_dir_expect(const char *got, unsigned uid) {
  char want[256];
  if (uid == 0)
    /* root ignores XDG_RUNTIME_DIR */
    snprintf(want, sizeof want, "/run/gmb\n/run/gmb\n/run/gmb\n");
  else
    snprintf(want, sizeof want, "/run/user/4242/gmb\n/tmp/gmb-%u\n/tmp/gmb-%u\n",
             uid, uid);
  ck_assert_str_eq(got, want);
}

/* The order below GMB_RUN_DIR depends on the euid; as root, a child that
 * drops to an unprivileged uid checks the other branches too.  The child
 * only computes and reports through a pipe: the asserts stay here. */
START_TEST(run_dir_defaults_by_uid) {
  char got[1024];
  run_dir_defaults(got, sizeof got);
  run_dir_expect(got, (unsigned)geteuid());
  if (geteuid() != 0) return;
  int fds[2];
  ck_assert_int_eq(pipe(fds), 0);
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0) {
    close(fds[0]);
    if (setgid(65534) != 0 || setuid(65534) != 0) _exit(3);
    run_dir_defaults(got, sizeof got);
    ssize_t w = write(fds[1], got, strlen(got));
    _exit(w == (ssize_t)strlen(got) ? 0 : 4);
  }
  close(fds[1]);
  size_t n = 0;
  ssize_t r;
  while ((r = read(fds[0], got + n, sizeof got - 1 - n)) > 0) n += (size_t)r;
  got[n] = '\0';
  close(fds[0]);
  int st = 0;
  ck_assert_int_eq(waitpid(pid, &st, 0), pid);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0,
                "unprivileged child failed (status %d)", st);
  run_dir_expect(got, 65534);
}
END_TEST

START_TEST(now_ns_monotonic) {
  uint64_t a = gmb__now_ns(), b = gmb__now_ns();
  ck_assert_uint_ge(b, a);
  ck_assert_uint_gt(a, 0);
}
END_TEST

static Suite *util_suite(void) {
  Suite *s = suite_create("util");
  TCase *tc = tcase_create("size");
  tcase_add_test(tc, size_parse_plain_bytes);
  tcase_add_test(tc, size_parse_units);
  tcase_add_test(tc, size_parse_lowercase_units);
  tcase_add_test(tc, size_parse_fractions);
  tcase_add_test(tc, size_parse_refusals);
  tcase_add_test(tc, size_format_exact_powers_roundtrip);
  tcase_add_test(tc, size_format_odd_values_two_decimals);
  tcase_add_test(tc, size_format_small_buffer);
  suite_add_tcase(s, tc);
  tc = tcase_create("names");
  tcase_add_test(tc, name_valid_edges);
  tcase_add_test(tc, run_dir_env_wins);
  tcase_add_test(tc, run_dir_defaults_by_uid);
  tcase_add_test(tc, now_ns_monotonic);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) { return check_run(util_suite()); }
