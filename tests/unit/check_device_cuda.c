/*
 * check_device_cuda.c - broker/device_cuda.c and the two-step retirement
 * in broker/device.c, on the fake driver (tests/fakecuda/).
 *
 * The suite points $GMB_LIBCUDA at the fake itself ($FAKECUDA_SO, else
 * build/fakecuda/libcuda.so.1), gives it a device of its own
 * ($FAKECUDA_DIR, a fresh directory) and sets the device's size with
 * $FAKECUDA_TOTAL before each open.  Device memory cannot be touched from
 * the CPU (the fake faults like a GPU would), so the cases see segment
 * bytes the way a client does: they import the segment's descriptor
 * (seg->fd) and map it, then copy with cuMemcpyHtoD/DtoH through their own
 * handle on the same driver.
 *
 * Other processes (a client holding a segment, another user of the GPU)
 * are this program started again (/proc/self/exe --child ROLE): under
 * SAN=1 the suite runs in one process that has called cuInit, and the
 * driver refuses a child forked after that.
 */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check_main.h"
#include "cudrv.h"
#include "device.h"
#include "gmb.h"
#include "util.h"

#define MIB (UINT64_C(1) << 20)

extern char **environ;

static char self_exe[PATH_MAX];
static char fake_dir[64];

static const char *fake_path(void) {
  static char buf[PATH_MAX];
  const char *p = getenv("FAKECUDA_SO");
  if (p && *p) return p;
  const char *b = getenv("GMB_BUILD_DIR");
  snprintf(buf, sizeof buf, "%s/fakecuda/libcuda.so.1", b && *b ? b : "build");
  return buf;
}

static void use_fake(const char *total) {
  setenv("GMB_LIBCUDA", fake_path(), 1);
  setenv("FAKECUDA_TOTAL", total, 1);
  unsetenv("FAKECUDA_DEVICES");
  unsetenv("FAKECUDA_MISSING");
  unsetenv("FAKECUDA_NO_VMM");
  unsetenv("FAKECUDA_NO_POSIX_FD");
  unsetenv("FAKECUDA_GRANULARITY");
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

/* --- the client's view of a segment ----------------------------------------- */

/* The test's own handle on the driver the device loaded (the same library
 * instance: one driver per process), used after a device is open, with
 * the context the device made current on this thread. */
static struct gmb_cudrv T;

static void t_load(void) {
  char err[256];
  ck_assert_msg(gmb__cudrv_load(&T, err, sizeof err) == 0, "%s", err);
}

static const struct gmb_cu_access_desc RW = {
    {GMB_CU_MEM_LOCATION_TYPE_DEVICE, 0},
    GMB_CU_MEM_ACCESS_FLAGS_PROT_READWRITE};

/* Maps the allocation descriptor fd names, as a client does; 0 or the
 * failing step. */
static int map_fd(struct gmb_cudrv *drv, int fd, size_t size,
                  gmb_cu_ptr *va) {
  gmb_cu_mem_handle h;
  if (drv->cuMemImportFromShareableHandle(
          &h, (void *)(uintptr_t)fd,
          GMB_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR))
    return 1;
  if (drv->cuMemAddressReserve(va, size, 0, 0, 0)) return 2;
  if (drv->cuMemMap(*va, size, 0, h, 0)) return 3;
  if (drv->cuMemSetAccess(*va, size, &RW, 1)) return 4;
  if (drv->cuMemRelease(h)) return 5;
  return 0;
}

static gmb_cu_ptr client_map(const struct gmb_dseg *s) {
  ck_assert_int_ge(s->fd, 0);
  gmb_cu_ptr va = 0;
  ck_assert_int_eq(map_fd(&T, s->fd, (size_t)s->size, &va), 0);
  return va;
}

static void client_unmap(gmb_cu_ptr va, const struct gmb_dseg *s) {
  ck_assert_int_eq(T.cuMemUnmap(va, (size_t)s->size), 0);
  ck_assert_int_eq(T.cuMemAddressFree(va, (size_t)s->size), 0);
}

static uint8_t pattern(uint64_t i, unsigned seed) {
  return (uint8_t)(i % 251 + seed * 37);
}

static void put(gmb_cu_ptr va, uint64_t off, uint64_t n, unsigned seed) {
  uint8_t *b = malloc(n);
  ck_assert_ptr_nonnull(b);
  for (uint64_t i = 0; i < n; i++) b[i] = pattern(i, seed);
  ck_assert_int_eq(T.cuMemcpyHtoD(va + off, b, n), 0);
  /* From pageable memory the copy returns before the bytes land: landed
   * before the broker's copies or another process read them. */
  ck_assert_int_eq(T.cuStreamSynchronize(NULL), 0);
  free(b);
}

/* Bytes the fake device holds, for every process (cuMemGetInfo). */
static uint64_t device_used(void) {
  size_t fr = 0, tot = 0;
  ck_assert_int_eq(T.cuMemGetInfo(&fr, &tot), 0);
  return (uint64_t)(tot - fr);
}

/* --- other processes ---------------------------------------------------------- */

/* Starts `self --child ROLE ARGS...` with the descriptors of `keep` (-1
 * ends it) inherited. */
static pid_t spawn(const int *keep, const char *role, ...) {
  char *argv[12];
  int argc = 0;
  argv[argc++] = self_exe;
  argv[argc++] = "--child";
  argv[argc++] = (char *)role;
  va_list ap;
  va_start(ap, role);
  const char *a;
  while (argc < 11 && (a = va_arg(ap, const char *)) != NULL)
    argv[argc++] = (char *)a;
  va_end(ap);
  argv[argc] = NULL;
  int n = 0;
  for (; keep && keep[n] >= 0; n++)
    ck_assert_int_eq(fcntl(keep[n], F_SETFD, 0), 0);
  fflush(NULL);
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0) {
    execve(self_exe, argv, environ);
    _exit(127);
  }
  for (int i = 0; i < n; i++) fcntl(keep[i], F_SETFD, FD_CLOEXEC);
  return pid;
}

static int child_drv(struct gmb_cudrv *drv) {
  char err[256];
  gmb_cu_ctx ctx;
  if (gmb__cudrv_load(drv, err, sizeof err)) return 1;
  if (drv->cuDevicePrimaryCtxRetain(&ctx, 0)) return 2;
  if (drv->cuCtxSetCurrent(ctx)) return 3;
  return 0;
}

/* use SIZE UP: another user of the GPU holds SIZE bytes until killed. */
static int child_use(const char *size, const char *up) {
  struct gmb_cudrv drv;
  if (child_drv(&drv)) return 10;
  gmb_cu_ptr p;
  if (drv.cuMemAlloc(&p, (size_t)strtoull(size, NULL, 10))) return 11;
  if (write(atoi(up), "u", 1) != 1) return 12;
  for (;;) pause();
}

/* map FD SIZE SEED UP DOWN: a client that maps the segment, checks its
 * bytes, says 'y', and when told (DOWN) checks them again, unmaps, and
 * says how that went in its exit status. */
static int child_map(char **arg) {
  struct gmb_cudrv drv;
  if (child_drv(&drv)) return 10;
  int fd = atoi(arg[0]);
  size_t size = (size_t)strtoull(arg[1], NULL, 10);
  unsigned seed = (unsigned)atoi(arg[2]);
  int up = atoi(arg[3]), down = atoi(arg[4]);
  gmb_cu_ptr va;
  if (map_fd(&drv, fd, size, &va)) return 11;
  close(fd);
  uint8_t *b = malloc(size);
  if (!b) return 12;
  for (int round = 0; round < 2; round++) {
    if (drv.cuMemcpyDtoH(b, va, size)) return 13;
    for (size_t i = 0; i < size; i++)
      if (b[i] != pattern(i, seed)) return 14 + round;
    if (round == 0) {
      char c = 'y', x;
      if (write(up, &c, 1) != 1) return 16;
      if (read(down, &x, 1) < 0) return 17;
    }
  }
  free(b);
  if (drv.cuMemUnmap(va, size) || drv.cuMemAddressFree(va, size)) return 18;
  return 0;
}

static int child_main(int argc, char **argv) {
  if (strcmp(argv[2], "use") == 0 && argc == 5)
    return child_use(argv[3], argv[4]);
  if (strcmp(argv[2], "map") == 0 && argc == 8) return child_map(argv + 3);
  fprintf(stderr, "check_device_cuda: unknown child role %s\n", argv[2]);
  return 99;
}

struct holder {
  pid_t pid;
  int up, down;
};

/* A client process that maps segment s (whose bytes are the pattern of
 * `seed`) and keeps it mapped until holder_release. */
static struct holder holder_start(const struct gmb_dseg *s, unsigned seed) {
  int up[2], down[2];
  ck_assert_int_eq(pipe2(up, O_CLOEXEC), 0);
  ck_assert_int_eq(pipe2(down, O_CLOEXEC), 0);
  char a[5][32];
  snprintf(a[0], sizeof a[0], "%d", s->fd);
  snprintf(a[1], sizeof a[1], "%llu", (unsigned long long)s->size);
  snprintf(a[2], sizeof a[2], "%u", seed);
  snprintf(a[3], sizeof a[3], "%d", up[1]);
  snprintf(a[4], sizeof a[4], "%d", down[0]);
  int keep[] = {s->fd, up[1], down[0], -1};
  struct holder h;
  h.pid = spawn(keep, "map", a[0], a[1], a[2], a[3], a[4], NULL);
  close(up[1]);
  close(down[0]);
  h.up = up[0];
  h.down = down[1];
  char c = 0;
  ck_assert_int_eq(read(h.up, &c, 1), 1);
  ck_assert_int_eq(c, 'y');
  close(h.up);
  return h;
}

static void holder_release(struct holder *h) {
  ck_assert_int_eq(write(h->down, "x", 1), 1);
  close(h->down);
  int st;
  ck_assert_int_eq(waitpid(h->pid, &st, 0), h->pid);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0,
                "the client saw wrong bytes or failed: status %#x", st);
}

/* --- open ---------------------------------------------------------------------- */

START_TEST(open_capacity_is_free_minus_reserve) {
  struct gmb_device *d = open_fake("64m", 0, 8 * MIB);
  ck_assert_str_eq(d->ops->kind, "cuda");
  ck_assert_uint_eq(d->capacity, 56 * MIB);
  ck_assert_msg(strncmp(d->desc, "cuda:0 (fakecuda 0)", 19) == 0, "%s",
                d->desc);
  gmb__device_close(d);
}
END_TEST

/* The broker's context cannot be made current again after the throwaway
 * one measured the cost (the stand-in fails the second cuCtxSetCurrent of
 * the open, the first being the open's own): the open fails and says
 * which step; without device_reserve auto there is no second call, and
 * once the driver answers again the device opens. */
START_TEST(open_fails_when_context_not_restored) {
  setenv("FAKECUDA_CTX_COST", "4m", 1);
  use_fake("64m");
  setenv("FAKECUDA_FAIL_SET_CURRENT", "2", 1);
  struct gmb_device *d = NULL;
  char err[256] = "";
  ck_assert_int_eq(gmb__device_open("cuda:0", 0,
                                    GMB_DEVICE_RESERVE_CONTEXTS | 3, &d, err,
                                    sizeof err),
                   GMB_E_DEVICE);
  ck_assert_ptr_null(d);
  ck_assert_msg(strstr(err, "cuCtxSetCurrent (the broker's context again") &&
                    strstr(err, "CUDA_ERROR_INVALID_CONTEXT"),
                "%s", err);
  unsetenv("FAKECUDA_FAIL_SET_CURRENT");
  d = open_fake("64m", 0, GMB_DEVICE_RESERVE_CONTEXTS | 3);
  gmb__device_close(d); /* its calls saw the variable unset: counted anew */
  setenv("FAKECUDA_FAIL_SET_CURRENT", "2", 1);
  d = open_fake("64m", 0, 8 * MIB);
  gmb__device_close(d);
  unsetenv("FAKECUDA_FAIL_SET_CURRENT");
  unsetenv("FAKECUDA_CTX_COST");
}
END_TEST

/* device_reserve auto: n client contexts of what one costs here, measured
 * at open ($FAKECUDA_CTX_COST on the stand-in); the throwaway context it
 * measured with is gone after, and the broker's own is current. */
START_TEST(open_reserve_counts_measured_contexts) {
  setenv("FAKECUDA_CTX_COST", "4m", 1);
  struct gmb_device *d = open_fake("64m", 0, 0);
  uint64_t all = d->capacity;
  gmb__device_close(d);
  d = open_fake("64m", 0, GMB_DEVICE_RESERVE_CONTEXTS | 3);
  ck_assert_uint_eq(d->capacity, all - 12 * MIB);
  gmb__device_close(d);
  d = open_fake("64m", 0, GMB_DEVICE_RESERVE_CONTEXTS | 0);
  ck_assert_uint_eq(d->capacity, all);
  gmb__device_close(d);
  unsetenv("FAKECUDA_CTX_COST");
  d = open_fake("64m", 0, GMB_DEVICE_RESERVE_CONTEXTS | 3);
  ck_assert_uint_le(all, d->capacity); /* a context that costs nothing */
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

START_TEST(open_capacity_is_device_wide) {
  /* Another process on the GPU holds 16 MiB: cuMemGetInfo says so, and
   * the broker does not offer it. */
  use_fake("64m");
  int up[2];
  ck_assert_int_eq(pipe2(up, O_CLOEXEC), 0);
  char size[32], fd[16];
  snprintf(size, sizeof size, "%llu", (unsigned long long)(16 * MIB));
  snprintf(fd, sizeof fd, "%d", up[1]);
  int keep[] = {up[1], -1};
  pid_t pid = spawn(keep, "use", size, fd, NULL);
  close(up[1]);
  char c = 0;
  ck_assert_int_eq(read(up[0], &c, 1), 1);
  close(up[0]);
  struct gmb_device *d = open_fake("64m", 0, 0);
  ck_assert_uint_eq(d->capacity, 48 * MIB);
  gmb__device_close(d);
  kill(pid, SIGKILL);
  waitpid(pid, NULL, 0);
  d = open_fake("64m", 0, 0);
  ck_assert_uint_eq(d->capacity, 64 * MIB); /* its memory died with it */
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

/* Opens cuda:0 with env NAME=VALUE set; must fail with GMB_E_DEVICE and a
 * one-line reason containing `want`. */
static void open_refused(const char *name, const char *value,
                         const char *want) {
  use_fake("64m");
  setenv(name, value, 1);
  struct gmb_device *d = NULL;
  char err[256] = "";
  int rc = gmb__device_open("cuda:0", 0, 0, &d, err, sizeof err);
  unsetenv(name);
  ck_assert_msg(rc == GMB_E_DEVICE, "%s=%s: %d %s", name, value, rc, err);
  ck_assert_ptr_eq(d, NULL);
  ck_assert_msg(strstr(err, want) != NULL, "%s", err);
  ck_assert_msg(strstr(err, "cuda:0 (fakecuda 0)") == err, "%s", err);
  ck_assert_ptr_eq(strchr(err, '\n'), NULL);
}

START_TEST(open_refused_without_vmm) {
  open_refused("FAKECUDA_NO_VMM", "1",
               "CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED is 0");
}
END_TEST

START_TEST(open_refused_without_posix_fd) {
  open_refused(
      "FAKECUDA_NO_POSIX_FD", "1",
      "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED is 0");
}
END_TEST

START_TEST(open_refused_when_granularity_does_not_divide_2mib) {
  open_refused("FAKECUDA_GRANULARITY", "4m",
               "allocation granularity 4MiB does not divide the 2MiB "
               "segment unit");
  open_refused("FAKECUDA_GRANULARITY", "384k", "granularity");
}
END_TEST

START_TEST(finer_granularity_is_fine) {
  use_fake("64m");
  setenv("FAKECUDA_GRANULARITY", "64k", 1);
  struct gmb_device *d = NULL;
  char err[256] = "";
  int rc = gmb__device_open("cuda:0", 0, 0, &d, err, sizeof err);
  ck_assert_msg(rc == 0, "%s", err);
  struct gmb_dseg a;
  ck_assert_int_eq(gmb__device_seg_new(d, 1, 2 * MIB, &a), 0);
  gmb__device_seg_free(d, &a);
  gmb__device_close(d);
  unsetenv("FAKECUDA_GRANULARITY");
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

/* --- segments -------------------------------------------------------------------- */

START_TEST(seg_new_exports_a_descriptor) {
  struct gmb_device *d = open_fake("64m", 0, 0);
  t_load();
  uint64_t before = device_used();
  struct gmb_dseg a;
  ck_assert_int_eq(gmb__device_seg_new(d, 1, 4 * MIB, &a), 0);
  ck_assert_ptr_eq(a.host, NULL);
  ck_assert_int_ge(a.fd, 0);
  ck_assert_int_ne(fcntl(a.fd, F_GETFD), -1);
  ck_assert_uint_eq(device_used(), before + 4 * MIB);
  /* A second segment has a descriptor of its own. */
  struct gmb_dseg b;
  ck_assert_int_eq(gmb__device_seg_new(d, 2, 2 * MIB, &b), 0);
  ck_assert_int_ge(b.fd, 0);
  ck_assert_int_ne(a.fd, b.fd);
  /* seg_free closes the descriptor and gives the memory back. */
  int fd = a.fd;
  gmb__device_seg_free(d, &a);
  errno = 0;
  ck_assert_int_eq(fcntl(fd, F_GETFD), -1);
  ck_assert_int_eq(errno, EBADF);
  gmb__device_seg_free(d, &b);
  ck_assert_uint_eq(device_used(), before);
  ck_assert_uint_eq(d->in_use, 0);
  gmb__device_close(d);
  gmb__cudrv_unload(&T);
}
END_TEST

START_TEST(seg_copy_moves_bytes) {
  struct gmb_device *d = open_fake("64m", 0, 0);
  t_load();
  struct gmb_dseg a, b;
  ck_assert_int_eq(gmb__device_seg_new(d, 1, 2 * MIB, &a), 0);
  ck_assert_int_eq(gmb__device_seg_new(d, 2, 4 * MIB, &b), 0);
  ck_assert_uint_eq(d->in_use, 6 * MIB);
  gmb_cu_ptr va = client_map(&a), vb = client_map(&b);
  put(va, 0, 2 * MIB, 1);
  ck_assert_int_eq(gmb__device_copy(d, &b, 3 * MIB, &a, 4096, MIB), 0);
  /* What the broker copied is what the client sees in the other segment. */
  uint8_t *want = malloc(MIB), *got = malloc(MIB);
  ck_assert_ptr_nonnull(want);
  ck_assert_ptr_nonnull(got);
  for (uint64_t i = 0; i < MIB; i++) want[i] = pattern(i + 4096, 1);
  ck_assert_int_eq(T.cuMemcpyDtoH(got, vb + 3 * MIB, MIB), 0);
  ck_assert_int_eq(memcmp(want, got, MIB), 0);
  /* Within one segment, apart: allowed; overlapping: refused. */
  ck_assert_int_eq(gmb__device_copy(d, &a, 0, &a, MIB, MIB), 0);
  ck_assert_int_eq(T.cuMemcpyDtoH(got, va, MIB), 0);
  for (uint64_t i = 0; i < MIB; i++) want[i] = pattern(i + MIB, 1);
  ck_assert_int_eq(memcmp(want, got, MIB), 0);
  ck_assert_int_eq(gmb__device_copy(d, &a, 0, &a, 4096, MIB), GMB_E_INVAL);
  ck_assert_int_eq(gmb__device_copy(d, &a, MIB + 1, &b, 0, MIB), GMB_E_INVAL);
  free(want);
  free(got);
  client_unmap(va, &a);
  client_unmap(vb, &b);
  gmb__device_seg_free(d, &a);
  gmb__device_seg_free(d, &b);
  ck_assert_uint_eq(d->in_use, 0);
  ck_assert_uint_eq(d->segments, 0);
  gmb__device_close(d);
  gmb__cudrv_unload(&T);
}
END_TEST

/* A GPU's new memory may hold what another tenant or process left there
 * (the driver promises no zeros; the fake one holds 0xa5 bytes with
 * FAKECUDA_GARBAGE=1): every segment is cleared before a client maps it. */
START_TEST(seg_new_cleared_before_a_tenant_gets_it) {
  setenv("FAKECUDA_GARBAGE", "1", 1);
  struct gmb_device *d = open_fake("64m", 0, 0);
  t_load();
  enum { N = 4096 };
  static uint8_t got[N], zero[N], junk[N];
  memset(junk, 0xa5, N);
  gmb_cu_ptr raw = 0; /* the stand-in's memory as the driver gives it */
  ck_assert_int_eq(T.cuMemAlloc(&raw, 2 * MIB), 0);
  ck_assert_int_eq(T.cuMemcpyDtoH(got, raw + MIB, N), 0);
  ck_assert_int_eq(memcmp(got, junk, N), 0);
  ck_assert_int_eq(T.cuMemFree(raw), 0);
  struct gmb_dseg a;
  /* The clearing is a device memset, which returns before it ran (held
   * back here): the segment is cleared for a reader in a context of its
   * own, which the broker's legacy stream does not order, once seg_new
   * returns. */
  setenv("FAKECUDA_HTOD_DELAY_MS", "300", 1);
  ck_assert_int_eq(gmb__device_seg_new(d, 1, 4 * MIB, &a), 0);
  unsetenv("FAKECUDA_HTOD_DELAY_MS");
  gmb_cu_ctx prev = NULL, own = NULL;
  ck_assert_int_eq(T.cuCtxGetCurrent(&prev), 0);
  gmb_cu_ptr va = client_map(&a);
  ck_assert_int_eq(T.cuCtxCreate(&own, 0, 0), 0); /* current now */
  for (uint64_t off = 0; off < 4 * MIB; off += MIB - N) {
    ck_assert_int_eq(T.cuMemcpyDtoH(got, va + off, N), 0);
    ck_assert_msg(memcmp(got, zero, N) == 0, "not cleared at %llu",
                  (unsigned long long)off);
  }
  ck_assert_int_eq(T.cuCtxDestroy(own), 0);
  ck_assert_int_eq(T.cuCtxSetCurrent(prev), 0);
  client_unmap(va, &a);
  gmb__device_seg_free(d, &a);
  gmb__device_close(d);
  gmb__cudrv_unload(&T);
  unsetenv("FAKECUDA_GARBAGE");
}
END_TEST

START_TEST(seg_new_beyond_driver_memory_is_nomem) {
  /* The configured capacity promises more than the driver has left:
   * cuMemCreate's out-of-memory is NOMEM, not a device fault. */
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

/* --- retirement ----------------------------------------------------------------- */

START_TEST(retirement_waits_for_every_holder) {
  struct gmb_device *d = open_fake("64m", 8 * MIB, 0);
  t_load();
  uint64_t before = device_used();
  struct gmb_dseg a;
  ck_assert_int_eq(gmb__device_seg_new(d, 7, 4 * MIB, &a), 0);
  gmb_cu_ptr va = client_map(&a);
  put(va, 0, 4 * MIB, 3);
  client_unmap(va, &a);
  struct holder h = holder_start(&a, 3);
  ck_assert_int_eq(gmb__device_seg_hold(d, 7, 101, NULL), 0);
  ck_assert_int_eq(gmb__device_seg_hold(d, 7, 102, NULL), 0);
  ck_assert_int_eq(gmb__device_seg_hold(d, 7, 102, NULL), 0); /* told twice */
  int fd = a.fd;
  gmb__device_seg_free(d, &a);
  memset(&a, 0xee, sizeof a); /* the pool's record is gone */
  /* Parked: still counted, so the device cannot promise its bytes, and
   * the descriptor is still the device's. */
  ck_assert_uint_eq(d->retiring, 1);
  ck_assert_uint_eq(d->retiring_bytes, 4 * MIB);
  ck_assert_uint_eq(d->in_use, 4 * MIB);
  ck_assert_uint_eq(d->segments, 1);
  ck_assert_int_ne(fcntl(fd, F_GETFD), -1);
  struct gmb_dseg b;
  ck_assert_int_eq(gmb__device_seg_new(d, 8, 6 * MIB, &b), GMB_E_NOMEM);
  /* Unknown segment, unknown holder: ignored. */
  ck_assert_int_eq(gmb__device_seg_closed(d, 99, 101), 0);
  ck_assert_int_eq(gmb__device_seg_closed(d, 7, 555), 0);
  ck_assert_int_eq(gmb__device_seg_closed(d, 7, 101), 0);
  ck_assert_uint_eq(d->retiring, 1);
  /* The last session says it closed: the broker's references go (and its
   * descriptor), the count with them.  A client that still maps it (here
   * one that has not unmapped yet, as an evicted process might) keeps the
   * memory and its bytes: the driver counts its mapping. */
  ck_assert_int_eq(gmb__device_seg_closed(d, 7, 102), 1);
  ck_assert_uint_eq(d->retiring, 0);
  ck_assert_uint_eq(d->retiring_bytes, 0);
  ck_assert_uint_eq(d->in_use, 0);
  ck_assert_uint_eq(d->segments, 0);
  errno = 0;
  ck_assert_int_eq(fcntl(fd, F_GETFD), -1);
  ck_assert_uint_eq(device_used(), before + 4 * MIB);
  holder_release(&h); /* it read its bytes again after the free */
  ck_assert_uint_eq(device_used(), before);
  ck_assert_int_eq(gmb__device_seg_closed(d, 7, 102), 0); /* late repeat */
  ck_assert_int_eq(gmb__device_seg_new(d, 8, 6 * MIB, &b), 0);
  gmb__device_seg_free(d, &b);
  gmb__device_close(d);
  gmb__cudrv_unload(&T);
}
END_TEST

START_TEST(retirement_holder_gone_frees_all_it_held) {
  struct gmb_device *d = open_fake("64m", 0, 0);
  struct gmb_dseg a, b, c;
  ck_assert_int_eq(gmb__device_seg_new(d, 1, 2 * MIB, &a), 0);
  ck_assert_int_eq(gmb__device_seg_new(d, 2, 2 * MIB, &b), 0);
  ck_assert_int_eq(gmb__device_seg_new(d, 3, 2 * MIB, &c), 0);
  ck_assert_int_eq(gmb__device_seg_hold(d, 1, 5, NULL), 0);
  gmb__device_seg_free(d, &a);
  ck_assert_int_eq(gmb__device_seg_hold(d, 2, 5, NULL), 0);
  ck_assert_int_eq(gmb__device_seg_hold(d, 2, 6, NULL), 0);
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
  ck_assert_int_eq(gmb__device_seg_hold(d, 1, 5, NULL), 0);
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
  ck_assert_int_eq(gmb__device_seg_hold(d, 1, 5, NULL), 0);
  int fd = a.fd;
  gmb__device_seg_free(d, &a);
  ck_assert_uint_eq(d->retiring, 1);
  gmb__device_close(d); /* must not leak nor abort (ASan checks the leak) */
  errno = 0;
  ck_assert_int_eq(fcntl(fd, F_GETFD), -1); /* nor keep the descriptor */
}
END_TEST

START_TEST(host_device_frees_at_once) {
  struct gmb_device *d = NULL;
  char err[256];
  ck_assert_int_eq(gmb__device_open("host:8MiB", 0, 0, &d, err, sizeof err), 0);
  struct gmb_dseg a;
  ck_assert_int_eq(gmb__device_seg_new(d, 1, 2 * MIB, &a), 0);
  ck_assert_int_eq(gmb__device_seg_hold(d, 1, 5, NULL), 0);
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
  tcase_add_test(tc, open_reserve_counts_measured_contexts);
  tcase_add_test(tc, open_fails_when_context_not_restored);
  tcase_add_test(tc, open_capacity_is_device_wide);
  tcase_add_test(tc, open_reserve_above_free);
  tcase_add_test(tc, open_no_such_gpu);
  tcase_add_test(tc, open_no_driver);
  tcase_add_test(tc, open_refused_without_vmm);
  tcase_add_test(tc, open_refused_without_posix_fd);
  tcase_add_test(tc, open_refused_when_granularity_does_not_divide_2mib);
  tcase_add_test(tc, finer_granularity_is_fine);
  tcase_add_test(tc, auto_falls_back_to_host);
  tcase_add_test(tc, auto_picks_cuda_when_it_answers);
  suite_add_tcase(s, tc);
  tc = tcase_create("segments");
  tcase_add_test(tc, seg_new_exports_a_descriptor);
  tcase_add_test(tc, seg_copy_moves_bytes);
  tcase_add_test(tc, seg_new_cleared_before_a_tenant_gets_it);
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

int main(int argc, char **argv) {
  ssize_t n = readlink("/proc/self/exe", self_exe, sizeof self_exe - 1);
  if (n <= 0) return 2;
  self_exe[n] = '\0';
  if (argc >= 3 && strcmp(argv[1], "--child") == 0)
    return child_main(argc, argv);
  snprintf(fake_dir, sizeof fake_dir, "/tmp/gmb-check-devcuda-XXXXXX");
  if (!mkdtemp(fake_dir)) return 2;
  setenv("FAKECUDA_DIR", fake_dir, 1); /* a fake device of the suite's own */
  int rc = check_run(device_cuda_suite());
  char acct[96];
  snprintf(acct, sizeof acct, "%s/device0", fake_dir);
  unlink(acct);
  rmdir(fake_dir);
  return rc;
}
