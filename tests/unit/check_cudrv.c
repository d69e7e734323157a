/*
 * check_cudrv.c - proto/cudrv.c: loading the CUDA driver at run time.
 *
 * The loader is tested against the fake driver (tests/fakecuda/, path in
 * $FAKECUDA_SO or $GMB_BUILD_DIR/fakecuda/libcuda.so.1, on a device of the
 * suite's own: $FAKECUDA_DIR) and against no driver at all.  What the fake models
 * is tested by check_fakecuda.  Where the toolkit's cuda.h is installed, mk/cuda.mk compiles
 * tests/fakecuda/cudrv_abi.c, whose static asserts hold cudrv.h's types to
 * cuda.h's, before this suite is linked (GMB_HAVE_CUDA_H): an ABI mistake
 * fails the build rather than a GPU run.
 */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cudrv.h"
#include "gmb.h"

#ifdef GMB_HAVE_CUDA_H
#define CUDRV_TYPES_CHECKED 1 /* tests/fakecuda/cudrv_abi.c compiled */
#else
#define CUDRV_TYPES_CHECKED 0
#endif

/* $FAKECUDA_SO, else the stand-in of the build tests/run.sh runs
 * ($GMB_BUILD_DIR: build/san under SAN=1), else build/'s. */
static const char *fake_path(void) {
  static char path[4096];
  const char *p = getenv("FAKECUDA_SO");
  if (p && *p) return p;
  const char *b = getenv("GMB_BUILD_DIR");
  snprintf(path, sizeof path, "%s/fakecuda/libcuda.so.1",
           b && *b ? b : "build");
  return path;
}

START_TEST(types_match_cuda_h) {
  /* The real check happened at compile time; this case says whether it
   * did. */
  if (!CUDRV_TYPES_CHECKED)
    fprintf(stderr, "check_cudrv: cuda.h not installed: types not checked\n");
  ck_assert_uint_eq(sizeof(gmb_cu_ptr), 8);
  ck_assert_uint_eq(sizeof(gmb_cu_mem_handle), 8);
  ck_assert_uint_eq(sizeof(struct gmb_cu_mem_location), 8);
  ck_assert_uint_eq(sizeof(struct gmb_cu_access_desc), 12);
  ck_assert_uint_eq(sizeof(struct gmb_cu_mem_prop), 32);
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
  ck_assert_ptr_eq((void *)(uintptr_t)d.cuMemCreate, NULL);
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
  /* Memory calls need a current context, as with the real driver. */
  gmb_cu_ptr a = 0, b = 0;
  ck_assert_int_eq(d.cuMemAlloc(&a, 1 << 20), GMB_CU_ERROR_INVALID_CONTEXT);
  gmb_cu_ctx ctx;
  ck_assert_int_eq(d.cuDevicePrimaryCtxRetain(&ctx, 0), 0);
  ck_assert_int_eq(d.cuCtxSetCurrent(ctx), 0);
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
  /* A range past the allocation (rounded up to 2 MiB) is refused. */
  ck_assert_int_ne(d.cuMemcpyDtoD(b, a + (2 << 20) - 10, 100), 0);
  char msg[128];
  gmb__cudrv_strerror(&d, 2, msg, sizeof msg);
  ck_assert_str_eq(msg, "CUDA_ERROR_OUT_OF_MEMORY: out of memory");
  gmb__cudrv_strerror(&d, 12345, msg, sizeof msg);
  ck_assert_str_eq(msg, "CUDA error 12345");
  ck_assert_int_eq(d.cuMemFree(a), 0);
  ck_assert_int_eq(d.cuMemFree(b), 0);
  ck_assert_int_eq(d.cuCtxSetCurrent(NULL), 0);
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

/* Every entry point gmb needs is required: the one missing is named. */
START_TEST(fake_missing_entry_point_named) {
  static const char *const names[] = {
      "cuDeviceGetAttribute",          "cuMemGetAllocationGranularity",
      "cuMemCreate",                   "cuMemRelease",
      "cuMemExportToShareableHandle",  "cuMemImportFromShareableHandle",
      "cuMemAddressReserve",           "cuMemAddressFree",
      "cuMemMap",                      "cuMemUnmap",
      "cuMemSetAccess",                "cuMemcpyDtoDAsync",
      "cuLaunchHostFunc",              "cuEventRecord",
      "cuEventQuery",
  };
  setenv("GMB_LIBCUDA", fake_path(), 1);
  for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
    setenv("FAKECUDA_MISSING", names[i], 1);
    struct gmb_cudrv d;
    char err[256], want[96];
    ck_assert_int_eq(gmb__cudrv_load(&d, err, sizeof err), GMB_E_DEVICE);
    snprintf(want, sizeof want, "lacks %s ", names[i]);
    ck_assert_msg(strstr(err, want) != NULL, "%s", err);
  }
  unsetenv("FAKECUDA_MISSING");
}
END_TEST

/* The legacy IPC entry points are gone from what gmb asks for. */
START_TEST(no_legacy_ipc_required) {
  setenv("GMB_LIBCUDA", fake_path(), 1);
  static const char *const legacy[] = {"cuIpcGetMemHandle",
                                       "cuIpcOpenMemHandle",
                                       "cuIpcCloseMemHandle"};
  for (size_t i = 0; i < sizeof legacy / sizeof legacy[0]; i++) {
    setenv("FAKECUDA_MISSING", legacy[i], 1);
    struct gmb_cudrv d;
    char err[256] = "";
    ck_assert_msg(gmb__cudrv_load(&d, err, sizeof err) == 0, "%s", err);
    gmb__cudrv_unload(&d);
  }
  unsetenv("FAKECUDA_MISSING");
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
  tcase_add_test(tc, no_legacy_ipc_required);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) {
  char dir[64] = "/tmp/gmb-check-cudrv-XXXXXX", acct[96];
  if (!mkdtemp(dir)) return 2;
  setenv("FAKECUDA_DIR", dir, 1); /* the fake's device, the suite's own */
  unsetenv("FAKECUDA_TOTAL");
  SRunner *sr = srunner_create(cudrv_suite());
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  snprintf(acct, sizeof acct, "%s/device0", dir);
  unlink(acct);
  rmdir(dir);
  return failed ? 1 : 0;
}
