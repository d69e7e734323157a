/*
 * check_cudrv.c - proto/cudrv.c: loading the CUDA driver at run time.
 *
 * The loader is tested against the fake driver (tests/fakecuda/, path in
 * $FAKECUDA_SO or build/fakecuda/libcuda.so.1) and against no driver at
 * all.  Where the toolkit's cuda.h is installed, mk/cuda.mk compiles
 * tests/fakecuda/cudrv_abi.c, whose static asserts hold cudrv.h's types to
 * cuda.h's, before this suite is linked (GMB_HAVE_CUDA_H): an ABI mistake
 * fails the build rather than a GPU run.
 */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cudrv.h"
#include "gmb.h"

#ifdef GMB_HAVE_CUDA_H
#define CUDRV_TYPES_CHECKED 1 /* tests/fakecuda/cudrv_abi.c compiled */
#else
#define CUDRV_TYPES_CHECKED 0
#endif

static const char *fake_path(void) {
  const char *p = getenv("FAKECUDA_SO");
  return p && *p ? p : "build/fakecuda/libcuda.so.1";
}

START_TEST(types_match_cuda_h) {
  /* The real check happened at compile time; this case says whether it
   * did. */
  if (!CUDRV_TYPES_CHECKED)
    fprintf(stderr, "check_cudrv: cuda.h not installed: types not checked\n");
  ck_assert_uint_eq(sizeof(gmb_cu_ipc_handle), 64);
  ck_assert_uint_eq(sizeof(gmb_cu_ptr), 8);
}
END_TEST

START_TEST(no_driver_names_library) {
  setenv("GMB_LIBCUDA", "/nonexistent/libcuda.so.1", 1);
  struct gmb_cudrv d;
  char err[256];
  int rc = gmb__cudrv_load(&d, err, sizeof err);
  ck_assert_int_eq(rc, GMB_E_DEVICE);
  ck_assert_msg(strstr(err, "no CUDA driver") != NULL, "%s", err);
  ck_assert_msg(strstr(err, "/nonexistent/libcuda.so.1") != NULL, "%s", err);
  ck_assert_ptr_eq(strchr(err, '\n'), NULL);
  ck_assert_ptr_eq(d.lib, NULL);
  ck_assert_ptr_eq((void *)(uintptr_t)d.cuMemAlloc, NULL);
  gmb__cudrv_unload(&d); /* a zeroed struct is accepted */
}
END_TEST

START_TEST(library_without_get_proc_address) {
  /* libm loads but is no CUDA driver. */
  setenv("GMB_LIBCUDA", "libm.so.6", 1);
  struct gmb_cudrv d;
  char err[256];
  ck_assert_int_eq(gmb__cudrv_load(&d, err, sizeof err), GMB_E_DEVICE);
  ck_assert_msg(strstr(err, "cuGetProcAddress") != NULL, "%s", err);
}
END_TEST

START_TEST(fake_loads_and_works) {
  setenv("GMB_LIBCUDA", fake_path(), 1);
  unsetenv("FAKECUDA_DEVICES");
  unsetenv("FAKECUDA_MISSING");
  struct gmb_cudrv d;
  char err[256] = "";
  int rc = gmb__cudrv_load(&d, err, sizeof err);
  ck_assert_msg(rc == 0, "load %s: %s", fake_path(), err);
  ck_assert_str_eq(d.path, fake_path());
  ck_assert_int_eq(d.version, 12000);
  int n = -1;
  ck_assert_int_eq(d.cuDeviceGetCount(&n), 0);
  ck_assert_int_eq(n, 1);
  gmb_cu_ptr a = 0, b = 0;
  ck_assert_int_eq(d.cuMemAlloc(&a, 1 << 20), 0);
  ck_assert_int_eq(d.cuMemAlloc(&b, 1 << 20), 0);
  char src[4096], back[4096];
  for (size_t i = 0; i < sizeof src; i++) src[i] = (char)(i * 7 + 1);
  ck_assert_int_eq(d.cuMemcpyHtoD(a + 100, src, sizeof src), 0);
  ck_assert_int_eq(d.cuMemcpyDtoD(b, a + 100, sizeof src), 0);
  ck_assert_int_eq(d.cuMemcpyDtoH(back, b, sizeof back), 0);
  ck_assert_int_eq(memcmp(src, back, sizeof src), 0);
  /* Overlapping ranges are refused, as the design assumes of the driver. */
  ck_assert_int_ne(d.cuMemcpyDtoD(a + 1, a, 4096), 0);
  /* A range past the allocation is refused. */
  ck_assert_int_ne(d.cuMemcpyDtoD(b, a + (1 << 20) - 10, 100), 0);
  char msg[128];
  gmb__cudrv_strerror(&d, 2, msg, sizeof msg);
  ck_assert_str_eq(msg, "CUDA_ERROR_OUT_OF_MEMORY: out of memory");
  gmb__cudrv_strerror(&d, 12345, msg, sizeof msg);
  ck_assert_str_eq(msg, "CUDA error 12345");
  ck_assert_int_eq(d.cuMemFree(a), 0);
  ck_assert_int_eq(d.cuMemFree(b), 0);
  gmb__cudrv_unload(&d);
  ck_assert_ptr_eq(d.lib, NULL);
}
END_TEST

START_TEST(fake_no_device_fails_cuinit) {
  setenv("GMB_LIBCUDA", fake_path(), 1);
  setenv("FAKECUDA_DEVICES", "0", 1);
  struct gmb_cudrv d;
  char err[256];
  ck_assert_int_eq(gmb__cudrv_load(&d, err, sizeof err), GMB_E_DEVICE);
  unsetenv("FAKECUDA_DEVICES");
  ck_assert_msg(strstr(err, "cuInit: CUDA_ERROR_NO_DEVICE") == err, "%s", err);
}
END_TEST

START_TEST(fake_missing_entry_point_named) {
  setenv("GMB_LIBCUDA", fake_path(), 1);
  setenv("FAKECUDA_MISSING", "cuIpcGetMemHandle", 1);
  struct gmb_cudrv d;
  char err[256];
  ck_assert_int_eq(gmb__cudrv_load(&d, err, sizeof err), GMB_E_DEVICE);
  unsetenv("FAKECUDA_MISSING");
  ck_assert_msg(strstr(err, "lacks cuIpcGetMemHandle") != NULL, "%s", err);
}
END_TEST

/* Imports across processes: the child opens the parent's handle, sees its
 * bytes, a second open in one process is refused, and the child closes. */
START_TEST(fake_ipc_across_processes) {
  setenv("GMB_LIBCUDA", fake_path(), 1);
  struct gmb_cudrv d;
  char err[256];
  ck_assert_msg(gmb__cudrv_load(&d, err, sizeof err) == 0, "%s", err);
  gmb_cu_ptr a;
  ck_assert_int_eq(d.cuMemAlloc(&a, 2 << 20), 0);
  memset((void *)(uintptr_t)a, 0x5a, 2 << 20);
  gmb_cu_ipc_handle h;
  ck_assert_int_eq(d.cuIpcGetMemHandle(&h, a), 0);
  /* Its own allocation cannot be opened by the allocating process. */
  gmb_cu_ptr self;
  ck_assert_int_ne(d.cuIpcOpenMemHandle(&self, h, 1), 0);
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0) {
    gmb_cu_ptr p, q;
    int bad = 0;
    if (d.cuIpcOpenMemHandle(&p, h, 1) != 0) _exit(10);
    if (d.cuIpcOpenMemHandle(&q, h, 1) != 208) bad |= 1;
    unsigned char byte;
    if (d.cuMemcpyDtoH(&byte, p + 12345, 1) != 0 || byte != 0x5a) bad |= 2;
    memset((void *)(uintptr_t)p, 0x33, 4096);
    if (d.cuIpcCloseMemHandle(p) != 0) bad |= 4;
    _exit(bad ? 20 + bad : 0);
  }
  int st;
  ck_assert_int_eq(waitpid(pid, &st, 0), pid);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "child status %d", st);
  ck_assert_uint_eq(((unsigned char *)(uintptr_t)a)[100], 0x33);
  ck_assert_int_eq(d.cuMemFree(a), 0);
  gmb__cudrv_unload(&d);
}
END_TEST

/* The fake's alarm: freeing what a live process still has open makes the
 * freeing process exit 86 (in a child here, so the suite survives). */
START_TEST(fake_free_while_open_is_loud) {
  setenv("GMB_LIBCUDA", fake_path(), 1);
  int go[2], done[2];
  ck_assert_int_eq(pipe(go), 0);
  ck_assert_int_eq(pipe(done), 0);
  pid_t freer = fork();
  ck_assert_int_ge(freer, 0);
  if (freer == 0) {
    struct gmb_cudrv d;
    char err[256];
    if (gmb__cudrv_load(&d, err, sizeof err) != 0) _exit(10);
    gmb_cu_ptr a;
    gmb_cu_ipc_handle h;
    if (d.cuMemAlloc(&a, 2 << 20) || d.cuIpcGetMemHandle(&h, a)) _exit(11);
    pid_t opener = fork();
    if (opener == 0) {
      gmb_cu_ptr p;
      char c = d.cuIpcOpenMemHandle(&p, h, 1) == 0 ? 'y' : 'n';
      if (write(go[1], &c, 1) != 1) _exit(1);
      if (read(done[0], &c, 1) < 0) _exit(1); /* stays open until told */
      _exit(0);
    }
    char c = 0;
    if (read(go[0], &c, 1) != 1 || c != 'y') _exit(12);
    d.cuMemFree(a); /* while the opener lives: the fake must object */
    if (write(done[1], &c, 1) != 1) _exit(13);
    waitpid(opener, NULL, 0);
    exit(0); /* runs the fake's exit check */
  }
  close(go[1]);
  close(done[0]);
  int st;
  ck_assert_int_eq(waitpid(freer, &st, 0), freer);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 86, "status %d", st);
}
END_TEST

static Suite *cudrv_suite(void) {
  Suite *s = suite_create("cudrv");
  TCase *tc = tcase_create("load");
  tcase_add_test(tc, types_match_cuda_h);
  tcase_add_test(tc, no_driver_names_library);
  tcase_add_test(tc, library_without_get_proc_address);
  tcase_add_test(tc, fake_loads_and_works);
  tcase_add_test(tc, fake_no_device_fails_cuinit);
  tcase_add_test(tc, fake_missing_entry_point_named);
  tcase_add_test(tc, fake_ipc_across_processes);
  tcase_add_test(tc, fake_free_while_open_is_loud);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) {
  SRunner *sr = srunner_create(cudrv_suite());
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? 1 : 0;
}
