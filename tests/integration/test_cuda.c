/*
 * test_cuda.c - a real broker on `--device cuda:0` over the fake CUDA
 * driver (tests/fakecuda/, loaded through $GMB_LIBCUDA, which the broker
 * inherits from this process), and the device choices a broker makes at
 * start-up without a driver.
 *
 * Broker side only for now: the client's CUDA import path (another module)
 * adds the end-to-end cases (allocate, write through gmb_lock, compaction
 * moves bytes, retirement waits for SegmentClosed, $FAKECUDA_LOG stays
 * empty).
 */
#include <check.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gmb.h"
#include "harness.h"

static char out[8192];

static int lines(const char *s) {
  int n = 0;
  for (; *s; s++) n += *s == '\n';
  return n;
}

static void use_fake(void) {
  static char path[PATH_MAX];
  const char *bd = harness_build_dir();
  if (bd[0] == '/')
    snprintf(path, sizeof path, "%s/fakecuda/libcuda.so.1", bd);
  else {
    char cwd[PATH_MAX / 2];
    ck_assert_ptr_ne(getcwd(cwd, sizeof cwd), NULL);
    snprintf(path, sizeof path, "%s/%s/fakecuda/libcuda.so.1", cwd, bd);
  }
  ck_assert_msg(access(path, R_OK) == 0, "no fake driver at %s", path);
  setenv("GMB_LIBCUDA", path, 1);
  setenv("FAKECUDA_TOTAL", "256m", 1);
  unsetenv("FAKECUDA_DEVICES");
}

/* `gmb-broker --device cuda:0` without a driver: exits non-zero at once,
 * with one line that gives the reason. */
START_TEST(no_driver_exits_with_one_line) {
  setenv("GMB_LIBCUDA", "/nonexistent/libcuda.so.1", 1);
  int rc = harness_tool("gmb-broker", out, sizeof out, "--run-dir",
                        "/nonexistent-run-dir", "--device", "cuda:0", NULL);
  ck_assert_int_ne(rc, 0);
  ck_assert_msg(lines(out) == 1, "want one line, got: %s", out);
  ck_assert_msg(strstr(out, "no CUDA driver") != NULL, "%s", out);
  ck_assert_msg(strstr(out, "/nonexistent/libcuda.so.1") != NULL, "%s", out);
}
END_TEST

START_TEST(no_gpu_exits_with_one_line) {
  use_fake();
  setenv("FAKECUDA_DEVICES", "0", 1);
  int rc = harness_tool("gmb-broker", out, sizeof out, "--run-dir",
                        "/nonexistent-run-dir", "--device", "cuda:0", NULL);
  unsetenv("FAKECUDA_DEVICES");
  ck_assert_int_ne(rc, 0);
  ck_assert_msg(lines(out) == 1, "want one line, got: %s", out);
  ck_assert_msg(strstr(out, "CUDA_ERROR_NO_DEVICE") != NULL, "%s", out);
}
END_TEST

START_TEST(auto_without_driver_says_host) {
  setenv("GMB_LIBCUDA", "/nonexistent/libcuda.so.1", 1);
  struct harness_broker b;
  harness_broker_start(&b, "auto", NULL);
  int rc = harness_ctl(&b, out, sizeof out, "status", NULL);
  ck_assert_msg(rc == 0, "status: %s", out);
  ck_assert_msg(strstr(out, "host:") != NULL, "%s", out);
  char *log = harness_broker_log(&b);
  ck_assert_msg(strstr(log, "no usable CUDA device (cuda:0: no CUDA driver") !=
                    NULL,
                "%s", log);
  ck_assert_msg(strstr(log, "using the host device host:1GiB") != NULL, "%s",
                log);
  free(log);
  harness_broker_stop(&b); /* fails the test unless it exited 0 */
}
END_TEST

START_TEST(cuda0_on_fake_driver_status) {
  use_fake();
  struct harness_broker b;
  harness_broker_start(&b, "cuda:0", NULL);
  int rc = harness_ctl(&b, out, sizeof out, "status", NULL);
  ck_assert_msg(rc == 0, "status: %s", out);
  ck_assert_msg(strstr(out, "cuda:0 (fakecuda 0)") != NULL, "%s", out);
  harness_broker_stop(&b); /* fails the test unless it exited 0 */
}
END_TEST

START_TEST(auto_picks_fake_gpu) {
  use_fake();
  struct harness_broker b;
  harness_broker_start(&b, "auto", NULL);
  char *log = harness_broker_log(&b);
  ck_assert_msg(strstr(log, "device auto: using cuda:0 (fakecuda 0)") != NULL,
                "%s", log);
  free(log);
  harness_broker_stop(&b); /* fails the test unless it exited 0 */
}
END_TEST

int main(void) {
  return harness_main(HARNESS_SUITE(
      "cuda", "broker", 30, no_driver_exits_with_one_line,
      no_gpu_exits_with_one_line, auto_without_driver_says_host,
      cuda0_on_fake_driver_status, auto_picks_fake_gpu));
}
