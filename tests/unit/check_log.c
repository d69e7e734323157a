/*
 * check_log.c - the broker's log (log.h): one line per message whatever
 * the message holds, and the rate limits for what clients can make the
 * broker log at will.
 *
 * The log goes to stderr; the tests point stderr at a pipe for the time of
 * one call and read back what was written.
 */
#include <check.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "check_main.h"
#include "log.h"

/* Logs `text` as one message ("%s") at warn and returns what was written. */
static void log_capture(const char *text, char *out, size_t cap) {
  int p[2];
  ck_assert_int_eq(pipe(p), 0);
  int saved = dup(STDERR_FILENO);
  ck_assert_int_ge(saved, 0);
  ck_assert_int_ge(dup2(p[1], STDERR_FILENO), 0);
  log_warn("client said: %s", text);
  ck_assert_int_ge(dup2(saved, STDERR_FILENO), 0);
  close(saved);
  close(p[1]);
  ssize_t n = read(p[0], out, cap - 1);
  close(p[0]);
  ck_assert_int_gt(n, 0);
  out[n] = '\0';
}

/* Control characters a client chose (Hello.client, a
 * tenant name) were logged verbatim, so a newline forged a log line and an
 * escape sequence reached the operator's terminal. */
START_TEST(control_characters_escaped) {
  char out[2048];
  log_capture("x\n2026-01-01T00:00:00.000Z gmb-broker[1] error: forged\x1b[2J"
              "\r\t\x7f end",
              out, sizeof out);
  /* One line, ending in the one newline the log adds. */
  ck_assert_ptr_eq(strchr(out, '\n'), out + strlen(out) - 1);
  ck_assert_ptr_null(strchr(out, '\x1b'));
  ck_assert_ptr_null(strchr(out, '\r'));
  ck_assert_ptr_null(strchr(out, '\x7f'));
  ck_assert_ptr_nonnull(
      strstr(out, "client said: x\\x0a2026-01-01T00:00:00.000Z"));
  ck_assert_ptr_nonnull(strstr(out, "forged\\x1b[2J\\x0d\\x09\\x7f end\n"));
  /* Printable text, UTF-8 included, is left as it is. */
  log_capture("caf\xc3\xa9 \"q\" \\ ok", out, sizeof out);
  ck_assert_ptr_nonnull(strstr(out, "client said: caf\xc3\xa9 \"q\" \\ ok\n"));
}
END_TEST

/* Bytes from 0x80 up reached the log raw: 0x9b is CSI to a terminal
 * that reads 8-bit controls, and UTF-8 can carry C1 controls, line
 * separators and bidirectional overrides, or be no UTF-8 at all.  Each
 * such byte is now written as \xHH; printable UTF-8 (2, 3 and 4 bytes)
 * passes. */
START_TEST(high_bytes_escaped_unless_printable_utf8) {
  char out[2048];
  log_capture("a\x9b" "2Jb", out, sizeof out);
  ck_assert_ptr_nonnull(strstr(out, "client said: a\\x9b2Jb\n"));
  log_capture("c1 \xc2\x9b x", out, sizeof out); /* U+009B */
  ck_assert_ptr_nonnull(strstr(out, "c1 \\xc2\\x9b x\n"));
  log_capture("rlo \xe2\x80\xae x", out, sizeof out); /* U+202E */
  ck_assert_ptr_nonnull(strstr(out, "rlo \\xe2\\x80\\xae x\n"));
  log_capture("ls \xe2\x80\xa8 x", out, sizeof out); /* U+2028 */
  ck_assert_ptr_nonnull(strstr(out, "ls \\xe2\\x80\\xa8 x\n"));
  log_capture("bad \xff \xc0\x8a \xed\xa0\x80 \xc3", out, sizeof out);
  ck_assert_ptr_nonnull(strstr(out, "bad \\xff \\xc0\\x8a "
                                    "\\xed\\xa0\\x80 \\xc3\n"));
  log_capture("ok \xe2\x82\xac \xf0\x9f\x98\x80 \xe4\xb8\xad", out, sizeof out);
  ck_assert_ptr_nonnull(
      strstr(out, "ok \xe2\x82\xac \xf0\x9f\x98\x80 \xe4\xb8\xad\n"));
}
END_TEST

START_TEST(long_message_cut_still_one_line) {
  char big[3000], out[4096];
  memset(big, '\n', sizeof big - 1);
  big[sizeof big - 1] = '\0';
  log_capture(big, out, sizeof out);
  ck_assert_ptr_eq(strchr(out, '\n'), out + strlen(out) - 1);
  ck_assert_uint_le(strlen(out), 1024);
}
END_TEST

/* A flood of waiting requests wrote one log line each. */
START_TEST(rate_limit_burst_then_count) {
  struct gmb_log_rl rl;
  memset(&rl, 0, sizeof rl);
  int allowed = 0;
  for (int i = 0; i < 1000; i++) allowed += gmb__log_allow(&rl);
  /* Within one second (the loop is far faster than that)... */
  ck_assert_int_eq(allowed, GMB_LOG_RL_BURST);
  ck_assert_uint_eq(rl.suppressed, 1000 - GMB_LOG_RL_BURST);
  ck_assert_str_eq(gmb__log_suppressed(&rl), "");
  /* ...and the next window's first line says how many were left out. */
  rl.window_ns -= 2000000000ull;
  ck_assert_int_eq(gmb__log_allow(&rl), 1);
  ck_assert_str_eq(gmb__log_suppressed(&rl),
                   " (and 990 more like it, not logged)");
  ck_assert_str_eq(gmb__log_suppressed(&rl), ""); /* said once */
}
END_TEST

static Suite *log_suite(void) {
  Suite *s = suite_create("log");
  TCase *tc = tcase_create("log");
  tcase_add_test(tc, control_characters_escaped);
  tcase_add_test(tc, high_bytes_escaped_unless_printable_utf8);
  tcase_add_test(tc, long_message_cut_still_one_line);
  tcase_add_test(tc, rate_limit_burst_then_count);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) { return check_run(log_suite()); }
