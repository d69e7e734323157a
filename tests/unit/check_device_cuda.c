/*
 * check_device_cuda.c - broker/device_cuda.c and the two-step retirement
 * in broker/device.c, on the fake driver (tests/fakecuda/).
 *
 * The suite points $GMB_LIBCUDA at the fake itself ($FAKECUDA_SO, else
 * build/fakecuda/libcuda.so.1) and sets the fake's memory with
 * $FAKECUDA_TOTAL before each open.  The fake's device pointers are host
 * addresses, so the cases write and read segment bytes directly (the
 * pointer is the first member of the segment's private state).  The fake
 * makes a process exit 86 when it frees memory another live process has
 * open: the retirement cases hold a segment open in a child while it is
 * parked, so a premature cuMemFree fails the case.
 */
#include <check.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cudrv.h"
#include "device.h"
#include "gmb.h"
#include "util.h"

#define MIB (UINT64_C(1) << 20)

static const char *fake_path(void) {
  const char *p = getenv("FAKECUDA_SO");
  return p && *p ? p : "build/fakecuda/libcuda.so.1";
}

static void use_fake(const char *total) {
  setenv("GMB_LIBCUDA", fake_path(), 1);
  setenv("FAKECUDA_TOTAL", total, 1);
  unsetenv("FAKECUDA_DEVICES");
  unsetenv("FAKECUDA_MISSING");
}

static struct gmb_device *open_fake(const char *total, uint64_t capacity,
                                    uint64_t reserve) {
  use_fake(total);
  struct gmb_device *d = NULL;
  char err[256] = "";
  int rc = gmb__device_open("cuda:0", capacity, reserve, &d, err, sizeof err);
  ck_assert_msg(rc == 0, "open cuda:0 on %s: %d %s", fake_path(), rc, err);
  return d;
}

static unsigned char *seg_bytes(const struct gmb_dseg *s) {
  gmb_cu_ptr p;
  memcpy(&p, s->priv, sizeof p);
  return (unsigned char *)(uintptr_t)p;
}

START_TEST(open_capacity_is_free_minus_reserve) {
  struct gmb_device *d = open_fake("64m", 0, 8 * MIB);
  ck_assert_str_eq(d->ops->kind, "cuda");
  ck_assert_uint_eq(d->capacity, 56 * MIB);
  ck_assert_msg(strncmp(d->desc, "cuda:0 (fakecuda 0)", 19) == 0, "%s",
                d->desc);
  gmb__device_close(d);
}
END_TEST

START_TEST(open_capacity_capped_by_config) {
  struct gmb_device *d = open_fake("64m", 20 * MIB, 8 * MIB);
  ck_assert_uint_eq(d->capacity, 20 * MIB);
  gmb__device_close(d);
  /* Rounded down to whole 2 MiB segments. */
  d = open_fake("64m", 0, 8 * MIB + 12345);
  ck_assert_uint_eq(d->capacity, 54 * MIB);
  gmb__device_close(d);
}
END_TEST

START_TEST(open_reserve_above_free) {
  use_fake("64m");
  struct gmb_device *d = NULL;
  char err[256];
  ck_assert_int_eq(gmb__device_open("cuda:0", 0, 63 * MIB, &d, err, sizeof err),
                   GMB_E_NOMEM);
  ck_assert_ptr_eq(d, NULL);
  ck_assert_msg(strstr(err, "reserve") != NULL, "%s", err);
}
END_TEST

START_TEST(open_no_such_gpu) {
  use_fake("64m");
  struct gmb_device *d = NULL;
  char err[256];
  ck_assert_int_eq(gmb__device_open("cuda:3", 0, 0, &d, err, sizeof err),
                   GMB_E_DEVICE);
  ck_assert_msg(strstr(err, "no GPU 3") != NULL, "%s", err);
}
END_TEST

START_TEST(open_no_driver) {
  setenv("GMB_LIBCUDA", "/nonexistent/libcuda.so.1", 1);
  struct gmb_device *d = NULL;
  char err[256];
  ck_assert_int_eq(gmb__device_open("cuda:0", 0, 0, &d, err, sizeof err),
                   GMB_E_DEVICE);
  ck_assert_msg(strstr(err, "no CUDA driver") == err, "%s", err);
  ck_assert_msg(strstr(err, "/nonexistent/libcuda.so.1") != NULL, "%s", err);
  ck_assert_ptr_eq(strchr(err, '\n'), NULL);
}
END_TEST

START_TEST(auto_falls_back_to_host) {
  setenv("GMB_LIBCUDA", "/nonexistent/libcuda.so.1", 1);
  struct gmb_device *d = NULL;
  char err[256] = "";
  ck_assert_int_eq(gmb__device_open("auto", 0, 0, &d, err, sizeof err), 0);
  ck_assert_str_eq(d->ops->kind, "host");
  ck_assert_str_eq(d->desc, "host:1GiB");
  gmb__device_close(d);
}
END_TEST

START_TEST(auto_picks_cuda_when_it_answers) {
  use_fake("64m");
  struct gmb_device *d = NULL;
  char err[256] = "";
  ck_assert_int_eq(gmb__device_open("auto", 0, 0, &d, err, sizeof err), 0);
  ck_assert_str_eq(d->ops->kind, "cuda");
  gmb__device_close(d);
}
END_TEST

START_TEST(seg_new_copy_free) {
  struct gmb_device *d = open_fake("64m", 0, 0);
  struct gmb_dseg a, b;
  ck_assert_int_eq(gmb__device_seg_new(d, 1, 2 * MIB, &a), 0);
  ck_assert_int_eq(gmb__device_seg_new(d, 2, 4 * MIB, &b), 0);
  ck_assert_uint_eq(a.handle_len, 64);
  ck_assert_ptr_eq(a.host, NULL);
  ck_assert_uint_eq(d->in_use, 6 * MIB);
  for (size_t i = 0; i < 2 * MIB; i++) seg_bytes(&a)[i] = (unsigned char)(i % 251);
  ck_assert_int_eq(gmb__device_copy(d, &b, 3 * MIB, &a, 4096, MIB), 0);
  for (size_t i = 0; i < MIB; i++)
    ck_assert_uint_eq(seg_bytes(&b)[3 * MIB + i], (i + 4096) % 251);
  /* Within one segment, apart: allowed; overlapping: refused. */
  ck_assert_int_eq(gmb__device_copy(d, &a, 0, &a, MIB, MIB), 0);
  ck_assert_int_eq(gmb__device_copy(d, &a, 0, &a, 4096, MIB), GMB_E_INVAL);
  ck_assert_int_eq(gmb__device_copy(d, &a, MIB + 1, &b, 0, MIB), GMB_E_INVAL);
  /* The fake's free memory shrank by what the segments took. */
  gmb__device_seg_free(d, &a);
  gmb__device_seg_free(d, &b);
  ck_assert_uint_eq(d->in_use, 0);
  ck_assert_uint_eq(d->segments, 0);
  gmb__device_close(d);
}
END_TEST

START_TEST(seg_new_beyond_driver_memory_is_nomem) {
  /* The configured capacity promises more than the driver has left:
   * cuMemAlloc's out-of-memory is NOMEM, not a device fault. */
  struct gmb_device *d = open_fake("8m", 0, 0);
  struct gmb_dseg a, b;
  ck_assert_int_eq(gmb__device_seg_new(d, 1, 6 * MIB, &a), 0);
  setenv("FAKECUDA_TOTAL", "7m", 1); /* another user took some */
  ck_assert_int_eq(gmb__device_seg_new(d, 2, 2 * MIB, &b), GMB_E_NOMEM);
  ck_assert_uint_eq(d->in_use, 6 * MIB);
  gmb__device_seg_free(d, &a);
  gmb__device_close(d);
}
END_TEST

/* A child that opens segment s's handle and keeps it open until told
 * (a byte on *release), reporting through *ready. */
static pid_t holder_start(const struct gmb_dseg *s, int *release, int *ready) {
  int go[2], rel[2];
  ck_assert_int_eq(pipe(go), 0);
  ck_assert_int_eq(pipe(rel), 0);
  gmb_cu_ipc_handle h;
  memcpy(&h, s->handle, sizeof h);
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0) {
    struct gmb_cudrv drv;
    char err[256], c = 'n';
    gmb_cu_ptr p = 0;
    if (gmb__cudrv_load(&drv, err, sizeof err) == 0 &&
        drv.cuIpcOpenMemHandle(&p, h, GMB_CU_IPC_LAZY_ENABLE_PEER_ACCESS) == 0)
      c = 'y';
    if (write(go[1], &c, 1) != 1) _exit(1);
    if (read(rel[0], &c, 1) < 0) _exit(1);
    if (p) drv.cuIpcCloseMemHandle(p);
    _exit(0);
  }
  close(go[1]);
  close(rel[0]);
  *release = rel[1];
  *ready = go[0];
  return pid;
}

static char holder_ready(int ready) {
  char c = 0;
  ck_assert_int_eq(read(ready, &c, 1), 1);
  close(ready);
  return c;
}

static void holder_release(pid_t pid, int release) {
  ck_assert_int_eq(write(release, "x", 1), 1);
  close(release);
  int st;
  ck_assert_int_eq(waitpid(pid, &st, 0), pid);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "holder status %d",
                st);
}

START_TEST(retirement_waits_for_every_holder) {
  struct gmb_device *d = open_fake("64m", 8 * MIB, 0);
  struct gmb_dseg a;
  ck_assert_int_eq(gmb__device_seg_new(d, 7, 4 * MIB, &a), 0);
  int rel, ready;
  pid_t pid = holder_start(&a, &rel, &ready);
  ck_assert_int_eq(holder_ready(ready), 'y');
  ck_assert_int_eq(gmb__device_seg_hold(d, 7, 101), 0);
  ck_assert_int_eq(gmb__device_seg_hold(d, 7, 102), 0);
  ck_assert_int_eq(gmb__device_seg_hold(d, 7, 102), 0); /* told twice */
  gmb__device_seg_free(d, &a);
  memset(&a, 0xee, sizeof a); /* the pool's record is gone */
  /* Parked: still counted, so the device cannot promise its bytes. */
  ck_assert_uint_eq(d->retiring, 1);
  ck_assert_uint_eq(d->retiring_bytes, 4 * MIB);
  ck_assert_uint_eq(d->in_use, 4 * MIB);
  ck_assert_uint_eq(d->segments, 1);
  struct gmb_dseg b;
  ck_assert_int_eq(gmb__device_seg_new(d, 8, 6 * MIB, &b), GMB_E_NOMEM);
  /* Unknown segment, unknown holder: ignored. */
  ck_assert_int_eq(gmb__device_seg_closed(d, 99, 101), 0);
  ck_assert_int_eq(gmb__device_seg_closed(d, 7, 555), 0);
  ck_assert_int_eq(gmb__device_seg_closed(d, 7, 101), 0);
  ck_assert_uint_eq(d->retiring, 1);
  /* The client process closes its import, then its session says so. */
  holder_release(pid, rel);
  ck_assert_int_eq(gmb__device_seg_closed(d, 7, 102), 1);
  ck_assert_uint_eq(d->retiring, 0);
  ck_assert_uint_eq(d->retiring_bytes, 0);
  ck_assert_uint_eq(d->in_use, 0);
  ck_assert_uint_eq(d->segments, 0);
  ck_assert_int_eq(gmb__device_seg_closed(d, 7, 102), 0); /* late repeat */
  ck_assert_int_eq(gmb__device_seg_new(d, 8, 6 * MIB, &b), 0);
  gmb__device_seg_free(d, &b);
  gmb__device_close(d);
}
END_TEST

START_TEST(retirement_holder_gone_frees_all_it_held) {
  struct gmb_device *d = open_fake("64m", 0, 0);
  struct gmb_dseg a, b, c;
  ck_assert_int_eq(gmb__device_seg_new(d, 1, 2 * MIB, &a), 0);
  ck_assert_int_eq(gmb__device_seg_new(d, 2, 2 * MIB, &b), 0);
  ck_assert_int_eq(gmb__device_seg_new(d, 3, 2 * MIB, &c), 0);
  ck_assert_int_eq(gmb__device_seg_hold(d, 1, 5), 0);
  gmb__device_seg_free(d, &a);
  ck_assert_int_eq(gmb__device_seg_hold(d, 2, 5), 0);
  ck_assert_int_eq(gmb__device_seg_hold(d, 2, 6), 0);
  gmb__device_seg_free(d, &b);
  ck_assert_uint_eq(d->retiring, 2);
  /* Session 5 ends: segment 1 goes, segment 2 still waits for 6. */
  ck_assert_int_eq(gmb__device_holder_gone(d, 5), 1);
  ck_assert_uint_eq(d->retiring, 1);
  ck_assert_uint_eq(d->in_use, 4 * MIB);
  ck_assert_int_eq(gmb__device_holder_gone(d, 6), 1);
  ck_assert_uint_eq(d->in_use, 2 * MIB);
  /* No holder: freed at once. */
  gmb__device_seg_free(d, &c);
  ck_assert_uint_eq(d->in_use, 0);
  ck_assert_uint_eq(d->retiring, 0);
  gmb__device_close(d);
}
END_TEST

START_TEST(retirement_holder_closed_before_free) {
  /* The hold is recorded, the client answers before the pool frees (not
   * the broker's order, but nothing may be lost): freed at once then. */
  struct gmb_device *d = open_fake("64m", 0, 0);
  struct gmb_dseg a;
  ck_assert_int_eq(gmb__device_seg_new(d, 1, 2 * MIB, &a), 0);
  ck_assert_int_eq(gmb__device_seg_hold(d, 1, 5), 0);
  ck_assert_int_eq(gmb__device_seg_closed(d, 1, 5), 0);
  gmb__device_seg_free(d, &a);
  ck_assert_uint_eq(d->in_use, 0);
  ck_assert_uint_eq(d->retiring, 0);
  gmb__device_close(d);
}
END_TEST

START_TEST(close_frees_parked_segments) {
  struct gmb_device *d = open_fake("64m", 0, 0);
  struct gmb_dseg a;
  ck_assert_int_eq(gmb__device_seg_new(d, 1, 2 * MIB, &a), 0);
  ck_assert_int_eq(gmb__device_seg_hold(d, 1, 5), 0);
  gmb__device_seg_free(d, &a);
  ck_assert_uint_eq(d->retiring, 1);
  gmb__device_close(d); /* must not leak nor abort (ASan checks the leak) */
}
END_TEST

START_TEST(host_device_frees_at_once) {
  struct gmb_device *d = NULL;
  char err[256];
  ck_assert_int_eq(gmb__device_open("host:8MiB", 0, 0, &d, err, sizeof err), 0);
  struct gmb_dseg a;
  ck_assert_int_eq(gmb__device_seg_new(d, 1, 2 * MIB, &a), 0);
  ck_assert_int_eq(gmb__device_seg_hold(d, 1, 5), 0);
  gmb__device_seg_free(d, &a);
  ck_assert_uint_eq(d->in_use, 0);
  ck_assert_uint_eq(d->retiring, 0);
  ck_assert_ptr_eq(d->retire_head, NULL);
  ck_assert_int_eq(gmb__device_seg_closed(d, 1, 5), 0);
  gmb__device_close(d);
}
END_TEST

static Suite *device_cuda_suite(void) {
  Suite *s = suite_create("device_cuda");
  TCase *tc = tcase_create("open");
  tcase_add_test(tc, open_capacity_is_free_minus_reserve);
  tcase_add_test(tc, open_capacity_capped_by_config);
  tcase_add_test(tc, open_reserve_above_free);
  tcase_add_test(tc, open_no_such_gpu);
  tcase_add_test(tc, open_no_driver);
  tcase_add_test(tc, auto_falls_back_to_host);
  tcase_add_test(tc, auto_picks_cuda_when_it_answers);
  suite_add_tcase(s, tc);
  tc = tcase_create("segments");
  tcase_add_test(tc, seg_new_copy_free);
  tcase_add_test(tc, seg_new_beyond_driver_memory_is_nomem);
  suite_add_tcase(s, tc);
  tc = tcase_create("retirement");
  tcase_add_test(tc, retirement_waits_for_every_holder);
  tcase_add_test(tc, retirement_holder_gone_frees_all_it_held);
  tcase_add_test(tc, retirement_holder_closed_before_free);
  tcase_add_test(tc, close_frees_parked_segments);
  tcase_add_test(tc, host_device_frees_at_once);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) {
  SRunner *sr = srunner_create(device_cuda_suite());
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? 1 : 0;
}
