/*
 * check_fakecuda.c - the fake CUDA driver (tests/fakecuda/fakecuda.c) is
 * faithful where gmb's code could go wrong against the real one: device
 * addresses are not CPU addresses, the context is per thread, a child
 * forked after cuInit is refused, streams are separate queues, memory is
 * counted device-wide across processes, an exported descriptor imports in
 * another process with the bytes, release is reference counted, and misuse
 * is refused and reported.
 *
 * The driver is loaded through proto/cudrv (as gmb loads it).  Cases that
 * need another process start this same program again (/proc/self/exe
 * --child ROLE ...), never a plain fork: under SAN=1 the suite runs in one
 * process, which has called cuInit by then, and a forked child of it is
 * refused by the driver (the point of one of the cases).  The suite gives
 * the fake a device of its own ($FAKECUDA_DIR, a fresh directory).
 */
#include <check.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sched.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cudrv.h"
#include "gmb.h"

#define MIB (UINT64_C(1) << 20)

extern char **environ;

static struct gmb_cudrv D;
static gmb_cu_ctx CTX;
static char self_exe[PATH_MAX];
static char fake_dir[64];
static char fake_log[96];

static const char *fake_path(void) {
  static char buf[PATH_MAX];
  const char *p = getenv("FAKECUDA_SO");
  if (p && *p) return p;
  const char *b = getenv("GMB_BUILD_DIR");
  snprintf(buf, sizeof buf, "%s/fakecuda/libcuda.so.1", b && *b ? b : "build");
  return buf;
}

/* Loads the driver and makes device 0's primary context current on the
 * calling thread.  0 or the step that failed (for children). */
static int drv_up(void) {
  char err[256];
  if (gmb__cudrv_load(&D, err, sizeof err) != 0) {
    fprintf(stderr, "load: %s\n", err);
    return 1;
  }
  gmb_cu_device dev;
  if (D.cuDeviceGet(&dev, 0) != 0) return 2;
  if (D.cuDevicePrimaryCtxRetain(&CTX, dev) != 0) return 3;
  if (D.cuCtxSetCurrent(CTX) != 0) return 4;
  return 0;
}

static void up(void) { ck_assert_int_eq(drv_up(), 0); }

static struct gmb_cu_mem_prop prop(int types) {
  struct gmb_cu_mem_prop p;
  memset(&p, 0, sizeof p);
  p.type = GMB_CU_MEM_ALLOCATION_TYPE_PINNED;
  p.requested_handle_types = types;
  p.location.type = GMB_CU_MEM_LOCATION_TYPE_DEVICE;
  p.location.id = 0;
  return p;
}

static const struct gmb_cu_access_desc RW = {
    {GMB_CU_MEM_LOCATION_TYPE_DEVICE, 0},
    GMB_CU_MEM_ACCESS_FLAGS_PROT_READWRITE};

/* Reserves, maps and opens `h` (size bytes) for read/write at *va. */
static gmb_cu_result map_handle(gmb_cu_mem_handle h, size_t size,
                                gmb_cu_ptr *va) {
  gmb_cu_result r = D.cuMemAddressReserve(va, size, 0, 0, 0);
  if (r) return r;
  r = D.cuMemMap(*va, size, 0, h, 0);
  if (!r) r = D.cuMemSetAccess(*va, size, &RW, 1);
  return r;
}

struct seg {
  gmb_cu_mem_handle h; /* 0 once released */
  gmb_cu_ptr va;
  size_t size;
};

/* Exportable memory of `size` bytes, mapped and accessible. */
static gmb_cu_result seg_make(struct seg *s, size_t size) {
  memset(s, 0, sizeof *s);
  s->size = size;
  struct gmb_cu_mem_prop p = prop(GMB_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  gmb_cu_result r = D.cuMemCreate(&s->h, size, &p, 0);
  if (!r) r = map_handle(s->h, size, &s->va);
  return r;
}

static void seg_drop(struct seg *s) {
  ck_assert_int_eq(D.cuMemUnmap(s->va, s->size), 0);
  ck_assert_int_eq(D.cuMemAddressFree(s->va, s->size), 0);
  if (s->h) ck_assert_int_eq(D.cuMemRelease(s->h), 0);
  memset(s, 0, sizeof *s);
}

static uint8_t pattern(size_t i, unsigned seed) {
  return (uint8_t)(i * 7 + 3 + seed * 101);
}

static void fill(uint8_t *b, size_t n, unsigned seed) {
  for (size_t i = 0; i < n; i++) b[i] = pattern(i, seed);
}

static long differs(const uint8_t *b, size_t n, unsigned seed) {
  for (size_t i = 0; i < n; i++)
    if (b[i] != pattern(i, seed)) return (long)i;
  return -1;
}

static uint64_t used_now(void) {
  size_t fr = 0, tot = 0;
  ck_assert_int_eq(D.cuMemGetInfo(&fr, &tot), 0);
  return (uint64_t)(tot - fr);
}

/* --- other processes ---------------------------------------------------- */

/* With spawn_pidns set, spawn starts the child in a PID namespace of its
 * own: the process returned is a go-between that waits for it (pid 1
 * there, killed when the go-between dies) and exits 126 when the
 * namespace cannot be made (not root). */
static int spawn_pidns;

/* Starts this program as `--child ROLE ARGS...` with the descriptors in
 * `keep` (-1 ends the list) open across exec and AddressSanitizer told to
 * leave SIGSEGV alone (one role dies of it on purpose). */
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
  /* The environment is built before fork: the child of a threaded parent
   * may only exec. */
  size_t n = 0;
  while (environ[n]) n++;
  char **envp = calloc(n + 2, sizeof *envp);
  ck_assert_ptr_nonnull(envp);
  char asan[512];
  const char *old = getenv("ASAN_OPTIONS");
  snprintf(asan, sizeof asan, "ASAN_OPTIONS=%s%shandle_segv=0",
           old ? old : "", old && *old ? ":" : "");
  size_t k = 0;
  for (size_t i = 0; i < n; i++)
    if (strncmp(environ[i], "ASAN_OPTIONS=", 13) != 0) envp[k++] = environ[i];
  envp[k++] = asan;
  envp[k] = NULL;
  int dups[8], nd = 0;
  for (; keep && keep[nd] >= 0 && nd < 8; nd++) {
    dups[nd] = keep[nd];
    ck_assert_int_eq(fcntl(dups[nd], F_SETFD, 0), 0); /* inherited */
  }
  fflush(NULL);
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0) {
    if (spawn_pidns) {
      if (unshare(CLONE_NEWPID) != 0) _exit(126);
      pid_t inner = fork();
      if (inner < 0) _exit(126);
      if (inner > 0) {
        int st;
        if (waitpid(inner, &st, 0) != inner) _exit(125);
        _exit(WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st));
      }
      prctl(PR_SET_PDEATHSIG, SIGKILL);
    }
    execve(self_exe, argv, envp);
    _exit(127);
  }
  for (int i = 0; i < nd; i++) fcntl(dups[i], F_SETFD, FD_CLOEXEC);
  free(envp);
  return pid;
}

static int wait_status(pid_t pid) {
  int st = 0;
  ck_assert_int_eq(waitpid(pid, &st, 0), pid);
  return st;
}

static void wait_ok(pid_t pid, const char *what) {
  int st = wait_status(pid);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "%s: status %#x", what,
                st);
}

/* --- child roles ---------------------------------------------------------- */

/* deref: a device address read from the CPU must fault. */
static int child_deref(void) {
  int rc = drv_up();
  if (rc) return 10 + rc;
  struct seg s;
  if (seg_make(&s, 2 * MIB)) return 20;
  uint8_t b[64];
  fill(b, sizeof b, 1);
  if (D.cuMemcpyHtoD(s.va, b, sizeof b)) return 21;
  volatile const uint8_t *p = (const uint8_t *)(uintptr_t)s.va;
  fprintf(stderr, "check_fakecuda: read %u from a device address\n", p[0]);
  return 0; /* it did not fault: the case fails on this status */
}

/* hold SIZE UP: makes SIZE bytes of device memory, says 'h' on UP, then
 * waits to be killed. */
static int child_hold(const char *size, const char *up_fd) {
  int rc = drv_up();
  if (rc) return 10 + rc;
  gmb_cu_mem_handle h;
  struct gmb_cu_mem_prop p = prop(0);
  if (D.cuMemCreate(&h, strtoull(size, NULL, 10), &p, 0)) return 20;
  int fd = atoi(up_fd);
  if (write(fd, "h", 1) != 1) return 21;
  for (;;) pause();
}

/* import FD SIZE: maps the allocation the descriptor names, checks the
 * pattern of seed 1, writes the pattern of seed 2, unmaps. */
static int child_import(const char *fd_s, const char *size_s) {
  int rc = drv_up();
  if (rc) return 10 + rc;
  int fd = atoi(fd_s);
  size_t size = (size_t)strtoull(size_s, NULL, 10);
  gmb_cu_mem_handle h;
  if (D.cuMemImportFromShareableHandle(
          &h, (void *)(uintptr_t)fd,
          GMB_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR))
    return 20;
  close(fd);
  gmb_cu_ptr va;
  if (map_handle(h, size, &va)) return 21;
  if (D.cuMemRelease(h)) return 22; /* the mapping keeps the memory */
  uint8_t *b = malloc(size);
  if (!b) return 23;
  if (D.cuMemcpyDtoH(b, va, size)) return 24;
  if (differs(b, size, 1) >= 0) return 25;
  fill(b, size, 2);
  /* Landed before the unmap and the exit (from pageable memory the copy
   * returns before it does). */
  if (D.cuMemcpyHtoD(va, b, size) || D.cuStreamSynchronize(NULL)) return 26;
  free(b);
  if (D.cuMemUnmap(va, size) || D.cuMemAddressFree(va, size)) return 27;
  return 0;
}

/* fork: a child forked before cuInit may use the driver; one forked
 * after is refused everything. */
static int child_fork(void) {
  pid_t pid = fork();
  if (pid < 0) return 10;
  if (pid == 0) {
    size_t fr, tot;
    _exit(drv_up() ? 1 : D.cuMemGetInfo(&fr, &tot) ? 2 : 0);
  }
  int st;
  if (waitpid(pid, &st, 0) != pid || !WIFEXITED(st) || WEXITSTATUS(st) != 0)
    return 11;
  if (drv_up()) return 12;
  pid = fork();
  if (pid < 0) return 13;
  if (pid == 0) {
    int bad = 0;
    int n = -1;
    gmb_cu_ctx c = NULL;
    size_t fr, tot;
    if (D.cuInit(0) != GMB_CU_ERROR_NOT_INITIALIZED) bad |= 1;
    if (D.cuDeviceGetCount(&n) != GMB_CU_ERROR_NOT_INITIALIZED) bad |= 2;
    if (D.cuCtxGetCurrent(&c) != GMB_CU_ERROR_NOT_INITIALIZED) bad |= 4;
    if (D.cuMemGetInfo(&fr, &tot) != GMB_CU_ERROR_NOT_INITIALIZED) bad |= 8;
    _exit(bad ? 20 + bad : 0);
  }
  if (waitpid(pid, &st, 0) != pid || !WIFEXITED(st)) return 14;
  return WEXITSTATUS(st);
}

static int child_main(int argc, char **argv) {
  const char *role = argv[2];
  if (strcmp(role, "deref") == 0) return child_deref();
  if (strcmp(role, "hold") == 0 && argc == 5)
    return child_hold(argv[3], argv[4]);
  if (strcmp(role, "import") == 0 && argc == 5)
    return child_import(argv[3], argv[4]);
  if (strcmp(role, "fork") == 0) return child_fork();
  fprintf(stderr, "check_fakecuda: unknown child role %s\n", role);
  return 99;
}

/* --- device addresses ------------------------------------------------------ */

/* Starts a process that holds an allocation of `bytes` on the device (and
 * its primary context) until killed; returns once it holds it. */
static pid_t spawn_holder(uint64_t bytes) {
  int up_pipe[2];
  ck_assert_int_eq(pipe2(up_pipe, O_CLOEXEC), 0);
  char size[32], fd[16];
  snprintf(size, sizeof size, "%llu", (unsigned long long)bytes);
  snprintf(fd, sizeof fd, "%d", up_pipe[1]);
  int keep[] = {up_pipe[1], -1};
  pid_t pid = spawn(keep, "hold", size, fd, NULL);
  close(up_pipe[1]);
  char c = 0;
  ck_assert_int_eq(read(up_pipe[0], &c, 1), 1);
  close(up_pipe[0]);
  return pid;
}

START_TEST(cpu_dereference_of_device_address_faults) {
  int st = wait_status(spawn(NULL, "deref", NULL));
  ck_assert_msg(WIFSIGNALED(st) && WTERMSIG(st) == SIGSEGV,
                "the child was not killed by SIGSEGV: status %#x", st);
}
END_TEST

START_TEST(copies_move_bytes_through_mappings) {
  up();
  struct seg a, b;
  ck_assert_int_eq(seg_make(&a, 2 * MIB), 0);
  ck_assert_int_eq(seg_make(&b, 4 * MIB), 0);
  ck_assert(a.va % (2 * MIB) == 0 && b.va % (2 * MIB) == 0);
  static uint8_t src[MIB], back[MIB];
  fill(src, sizeof src, 3);
  ck_assert_int_eq(D.cuMemcpyHtoD(a.va + 4096, src, sizeof src), 0);
  ck_assert_int_eq(D.cuMemcpyDtoD(b.va + 3 * MIB, a.va + 4096, MIB), 0);
  ck_assert_int_eq(D.cuMemcpyDtoH(back, b.va + 3 * MIB, MIB), 0);
  ck_assert_int_eq(differs(back, MIB, 3), -1);
  /* Async on a stream, then synchronised. */
  gmb_cu_stream s;
  ck_assert_int_eq(D.cuStreamCreate(&s, GMB_CU_STREAM_NON_BLOCKING), 0);
  ck_assert_int_eq(D.cuMemcpyDtoDAsync(a.va + MIB, b.va + 3 * MIB, MIB, s), 0);
  ck_assert_int_eq(D.cuStreamSynchronize(s), 0);
  memset(back, 0, sizeof back);
  ck_assert_int_eq(D.cuMemcpyDtoH(back, a.va + MIB, MIB), 0);
  ck_assert_int_eq(differs(back, MIB, 3), -1);
  ck_assert_int_eq(D.cuStreamDestroy(s), 0);
  seg_drop(&a);
  seg_drop(&b);
}
END_TEST

START_TEST(copy_outside_mapping_or_overlapping_refused) {
  up();
  struct seg a;
  ck_assert_int_eq(seg_make(&a, 2 * MIB), 0);
  uint8_t b[8192];
  /* Past the end of the mapping, an address never mapped, a host address. */
  ck_assert_int_eq(D.cuMemcpyDtoH(b, a.va + 2 * MIB - 100, 200),
                   GMB_CU_ERROR_INVALID_VALUE);
  ck_assert_int_eq(D.cuMemcpyHtoD(a.va + 2 * MIB, b, 1),
                   GMB_CU_ERROR_INVALID_VALUE);
  ck_assert_int_eq(D.cuMemcpyDtoH(b, (gmb_cu_ptr)(uintptr_t)b, 16),
                   GMB_CU_ERROR_INVALID_VALUE);
  /* Overlapping device ranges: the driver does not promise memmove. */
  ck_assert_int_eq(D.cuMemcpyDtoD(a.va + 1, a.va, 4096),
                   GMB_CU_ERROR_INVALID_VALUE);
  ck_assert_int_eq(D.cuMemcpyDtoD(a.va + 4096, a.va, 4096), 0);
  /* Mapped, but no access granted yet. */
  gmb_cu_ptr va2;
  ck_assert_int_eq(D.cuMemAddressReserve(&va2, 2 * MIB, 0, 0, 0), 0);
  ck_assert_int_eq(D.cuMemMap(va2, 2 * MIB, 0, a.h, 0), 0);
  ck_assert_int_eq(D.cuMemcpyDtoH(b, va2, 16), GMB_CU_ERROR_INVALID_VALUE);
  ck_assert_int_eq(D.cuMemSetAccess(va2, 2 * MIB, &RW, 1), 0);
  /* Two mappings of one allocation: the same bytes, and a copy between
   * them that overlaps in memory is refused too. */
  fill(b, sizeof b, 4);
  ck_assert_int_eq(D.cuMemcpyHtoD(a.va, b, sizeof b), 0);
  memset(b, 0, sizeof b);
  ck_assert_int_eq(D.cuMemcpyDtoH(b, va2, sizeof b), 0);
  ck_assert_int_eq(differs(b, sizeof b, 4), -1);
  ck_assert_int_eq(D.cuMemcpyDtoD(va2 + 100, a.va, 4096),
                   GMB_CU_ERROR_INVALID_VALUE);
  ck_assert_int_eq(D.cuMemUnmap(va2, 2 * MIB), 0);
  ck_assert_int_eq(D.cuMemAddressFree(va2, 2 * MIB), 0);
  seg_drop(&a);
}
END_TEST

/* Two allocations mapped side by side in one reservation (the cache's
 * pages): a copy across the boundary works, as on the driver; one across
 * a hole (the second page unmapped) is refused. */
START_TEST(copy_across_mappings_side_by_side) {
  up();
  struct gmb_cu_mem_prop p = prop(GMB_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  gmb_cu_mem_handle h1, h2;
  gmb_cu_ptr va;
  ck_assert_int_eq(D.cuMemCreate(&h1, 2 * MIB, &p, 0), 0);
  ck_assert_int_eq(D.cuMemCreate(&h2, 2 * MIB, &p, 0), 0);
  ck_assert_int_eq(D.cuMemAddressReserve(&va, 6 * MIB, 0, 0, 0), 0);
  ck_assert_int_eq(D.cuMemMap(va, 2 * MIB, 0, h1, 0), 0);
  ck_assert_int_eq(D.cuMemMap(va + 2 * MIB, 2 * MIB, 0, h2, 0), 0);
  ck_assert_int_eq(D.cuMemSetAccess(va, 4 * MIB, &RW, 1), 0);
  static uint8_t src[MIB], back[MIB];
  fill(src, sizeof src, 7);
  const gmb_cu_ptr at = va + 2 * MIB - MIB / 2; /* half in each */
  ck_assert_int_eq(D.cuMemcpyHtoD(at, src, MIB), 0);
  ck_assert_int_eq(D.cuMemcpyDtoH(back, at, MIB), 0);
  ck_assert_int_eq(differs(back, MIB, 7), -1);
  /* Device to device across the boundary, both ways, and async. */
  ck_assert_int_eq(D.cuMemcpyDtoD(va, at, MIB / 4), 0);
  gmb_cu_stream st;
  ck_assert_int_eq(D.cuStreamCreate(&st, GMB_CU_STREAM_NON_BLOCKING), 0);
  ck_assert_int_eq(D.cuMemcpyDtoDAsync(va + 3 * MIB, at, MIB, st), 0);
  ck_assert_int_eq(D.cuStreamSynchronize(st), 0);
  ck_assert_int_eq(D.cuStreamDestroy(st), 0);
  memset(back, 0, sizeof back);
  ck_assert_int_eq(D.cuMemcpyDtoH(back, va + 3 * MIB, MIB), 0);
  ck_assert_int_eq(differs(back, MIB, 7), -1);
  /* Into the reservation's unmapped third page: refused, nothing copied. */
  ck_assert_int_eq(D.cuMemcpyHtoD(va + 4 * MIB - 4096, src, 8192),
                   GMB_CU_ERROR_INVALID_VALUE);
  /* A hole between the two: the second page unmapped. */
  ck_assert_int_eq(D.cuMemUnmap(va + 2 * MIB, 2 * MIB), 0);
  ck_assert_int_eq(D.cuMemcpyDtoH(back, at, MIB), GMB_CU_ERROR_INVALID_VALUE);
  ck_assert_int_eq(D.cuMemUnmap(va, 2 * MIB), 0);
  ck_assert_int_eq(D.cuMemAddressFree(va, 6 * MIB), 0);
  ck_assert_int_eq(D.cuMemRelease(h1), 0);
  ck_assert_int_eq(D.cuMemRelease(h2), 0);
}
END_TEST

/* --- contexts and fork ------------------------------------------------------ */

struct ctx_probe {
  gmb_cu_ctx seen;
  gmb_cu_result info, copy, info_after;
  gmb_cu_ptr va;
};

static void *ctx_thread(void *arg) {
  struct ctx_probe *p = arg;
  size_t fr, tot;
  uint8_t b[16];
  D.cuCtxGetCurrent(&p->seen);
  p->info = D.cuMemGetInfo(&fr, &tot);
  p->copy = D.cuMemcpyDtoH(b, p->va, sizeof b);
  D.cuCtxSetCurrent(CTX);
  p->info_after = D.cuMemGetInfo(&fr, &tot);
  return NULL;
}

START_TEST(context_is_per_thread) {
  up();
  struct seg a;
  ck_assert_int_eq(seg_make(&a, 2 * MIB), 0);
  struct ctx_probe p = {.seen = CTX, .va = a.va};
  pthread_t t;
  ck_assert_int_eq(pthread_create(&t, NULL, ctx_thread, &p), 0);
  ck_assert_int_eq(pthread_join(t, NULL), 0);
  ck_assert_ptr_null(p.seen);
  ck_assert_int_eq(p.info, GMB_CU_ERROR_INVALID_CONTEXT);
  ck_assert_int_eq(p.copy, GMB_CU_ERROR_INVALID_CONTEXT);
  ck_assert_int_eq(p.info_after, 0);
  /* This thread kept its own. */
  gmb_cu_ctx cur = NULL;
  ck_assert_int_eq(D.cuCtxGetCurrent(&cur), 0);
  ck_assert_ptr_eq(cur, CTX);
  /* With none current here either, memory calls fail the same way. */
  ck_assert_int_eq(D.cuCtxSetCurrent(NULL), 0);
  size_t fr, tot;
  ck_assert_int_eq(D.cuMemGetInfo(&fr, &tot), GMB_CU_ERROR_INVALID_CONTEXT);
  ck_assert_int_eq(D.cuMemUnmap(a.va, a.size), GMB_CU_ERROR_INVALID_CONTEXT);
  /* A pointer that is no context is refused. */
  static char not_a_context;
  ck_assert_int_eq(D.cuCtxSetCurrent((gmb_cu_ctx)&not_a_context),
                   GMB_CU_ERROR_INVALID_CONTEXT);
  ck_assert_int_eq(D.cuCtxSetCurrent(CTX), 0);
  seg_drop(&a);
}
END_TEST

START_TEST(fork_after_init_is_refused) {
  /* In another process, so that "before cuInit" holds there whatever this
   * one did already. */
  pid_t pid = spawn(NULL, "fork", NULL);
  int st = wait_status(pid);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "status %#x", st);
  /* And here, the suite's own process (initialised now). */
  up();
  pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0) _exit(D.cuInit(0) == GMB_CU_ERROR_NOT_INITIALIZED ? 0 : 1);
  wait_ok(pid, "forked child's cuInit");
}
END_TEST

/* --- streams ---------------------------------------------------------------- */

static atomic_int gate, order_n, order[8];

static void gate_fn(void *arg) {
  (void)arg;
  while (!atomic_load(&gate)) {
    struct timespec ts = {0, 1000000};
    nanosleep(&ts, NULL);
  }
}

static void mark_fn(void *arg) {
  int n = atomic_fetch_add(&order_n, 1);
  if (n < 8) atomic_store(&order[n], (int)(intptr_t)arg);
}

START_TEST(streams_are_ordered_and_independent) {
  up();
  struct seg a;
  ck_assert_int_eq(seg_make(&a, 2 * MIB), 0);
  static uint8_t b[MIB];
  fill(b, MIB, 5);
  ck_assert_int_eq(D.cuMemcpyHtoD(a.va, b, MIB), 0);
  gmb_cu_stream s1, s2;
  ck_assert_int_eq(D.cuStreamCreate(&s1, GMB_CU_STREAM_NON_BLOCKING), 0);
  ck_assert_int_eq(D.cuStreamCreate(&s2, GMB_CU_STREAM_NON_BLOCKING), 0);
  atomic_store(&gate, 0);
  atomic_store(&order_n, 0);
  /* s1: blocked, then a copy, then a mark. */
  ck_assert_int_eq(D.cuLaunchHostFunc(s1, gate_fn, NULL), 0);
  ck_assert_int_eq(D.cuMemcpyDtoDAsync(a.va + MIB, a.va, MIB, s1), 0);
  ck_assert_int_eq(D.cuLaunchHostFunc(s1, mark_fn, (void *)1), 0);
  /* s2 and the NULL stream run and synchronise while s1 waits. */
  ck_assert_int_eq(D.cuLaunchHostFunc(s2, mark_fn, (void *)2), 0);
  ck_assert_int_eq(D.cuStreamSynchronize(s2), 0);
  ck_assert_int_eq(D.cuLaunchHostFunc(NULL, mark_fn, (void *)3), 0);
  ck_assert_int_eq(D.cuStreamSynchronize(NULL), 0);
  ck_assert_int_eq(atomic_load(&order_n), 2);
  ck_assert_int_eq(atomic_load(&order[0]), 2);
  ck_assert_int_eq(atomic_load(&order[1]), 3);
  atomic_store(&gate, 1);
  ck_assert_int_eq(D.cuStreamSynchronize(s1), 0);
  ck_assert_int_eq(atomic_load(&order_n), 3);
  ck_assert_int_eq(atomic_load(&order[2]), 1);
  /* The copy ran before the mark that followed it. */
  memset(b, 0, MIB);
  ck_assert_int_eq(D.cuMemcpyDtoH(b, a.va + MIB, MIB), 0);
  ck_assert_int_eq(differs(b, MIB, 5), -1);
  ck_assert_int_eq(D.cuStreamDestroy(s1), 0);
  ck_assert_int_eq(D.cuStreamDestroy(s2), 0);
  seg_drop(&a);
}
END_TEST

typedef gmb_cu_result (*gpa_fn)(const char *sym, void **pfn, int ver,
                                unsigned long long flags, int *status);

/* An entry point at version 12000; cuCtxCreate at 3020, the version
 * whose ABI (_v2) the tests call (12000 gives _v3, with other
 * arguments). */
static void *gpa(const char *name) {
  gpa_fn f = (gpa_fn)(uintptr_t)dlsym(D.lib, "cuGetProcAddress_v2");
  ck_assert_ptr_nonnull((void *)(uintptr_t)f);
  void *fn = NULL;
  int status = 0;
  int ver = strcmp(name, "cuCtxCreate") == 0 ? 3020 : 12000;
  ck_assert_int_eq(f(name, &fn, ver, 0, &status), 0);
  return fn;
}

static void *open_gate_later(void *arg) {
  (void)arg;
  struct timespec ts = {0, 200 * 1000000};
  nanosleep(&ts, NULL);
  atomic_store(&gate, 1);
  return NULL;
}

/* Streams belong to their context, and so does each legacy stream:
 * cuCtxSynchronize (and the NULL stream) of the primary context do not
 * wait for another context's work, as in the real driver; that
 * context's own cuCtxSynchronize does.  (A stand-in that waited for every
 * stream would wait here until a helper opens the gate, and fail.) */
/* A copy from pageable memory returns before the bytes land, as the
 * driver's does: this context's legacy stream is ordered after it, and a
 * read from another context is not; from pinned memory it is done when
 * it returns. */
START_TEST(htod_from_pageable_lands_later) {
  up();
  struct seg a;
  ck_assert_int_eq(seg_make(&a, 2 * MIB), 0);
  static uint8_t b[4096], got[4096];
  gmb_cu_ctx other;
  for (int pinned = 0; pinned < 2; pinned++) {
    uint8_t *src = b;
    if (pinned)
      ck_assert_int_eq(D.cuMemHostAlloc((void **)&src, sizeof b, 0), 0);
    fill(src, sizeof b, 3 + (unsigned)pinned);
    setenv("FAKECUDA_HTOD_DELAY_MS", "300", 1);
    ck_assert_int_eq(D.cuMemcpyHtoD(a.va, src, sizeof b), 0);
    unsetenv("FAKECUDA_HTOD_DELAY_MS");
    ck_assert_int_eq(D.cuCtxCreate(&other, 0, 0), 0); /* current now */
    ck_assert_int_eq(D.cuMemcpyDtoH(got, a.va, sizeof got), 0);
    if (pinned)
      ck_assert_int_eq(differs(got, sizeof got, 4), -1);
    else
      ck_assert_int_ge(differs(got, sizeof got, 3), 0); /* not there yet */
    ck_assert_int_eq(D.cuCtxDestroy(other), 0);
    ck_assert_int_eq(D.cuCtxSetCurrent(CTX), 0);
    /* A synchronous copy in the context that copied waits for it. */
    ck_assert_int_eq(D.cuMemcpyDtoH(got, a.va, sizeof got), 0);
    ck_assert_int_eq(differs(got, sizeof got, 3 + (unsigned)pinned), -1);
    if (pinned) ck_assert_int_eq(D.cuMemFreeHost(src), 0);
  }
  seg_drop(&a);
}
END_TEST

/* An event is recorded only on a stream of its own context (the legacy
 * stream is the current context's): CUDA_ERROR_INVALID_HANDLE otherwise,
 * as the driver answers. */
START_TEST(event_and_stream_of_one_context) {
  up();
  gmb_cu_event e;
  gmb_cu_stream mine, theirs;
  gmb_cu_ctx other;
  ck_assert_int_eq(D.cuEventCreate(&e, GMB_CU_EVENT_DISABLE_TIMING), 0);
  ck_assert_int_eq(D.cuStreamCreate(&mine, GMB_CU_STREAM_NON_BLOCKING), 0);
  ck_assert_int_eq(D.cuEventRecord(e, mine), 0);
  ck_assert_int_eq(D.cuEventRecord(e, NULL), 0);
  ck_assert_int_eq(D.cuCtxCreate(&other, 0, 0), 0); /* current now */
  ck_assert_int_eq(D.cuStreamCreate(&theirs, GMB_CU_STREAM_NON_BLOCKING), 0);
  ck_assert_int_eq(D.cuEventRecord(e, theirs), GMB_CU_ERROR_INVALID_HANDLE);
  ck_assert_int_eq(D.cuEventRecord(e, NULL), GMB_CU_ERROR_INVALID_HANDLE);
  ck_assert_int_eq(D.cuEventRecord(e, mine), 0); /* its stream, any thread */
  ck_assert_int_eq(D.cuStreamDestroy(theirs), 0);
  ck_assert_int_eq(D.cuCtxDestroy(other), 0);
  ck_assert_int_eq(D.cuCtxSetCurrent(CTX), 0);
  ck_assert_int_eq(D.cuStreamSynchronize(mine), 0);
  ck_assert_int_eq(D.cuEventQuery(e), 0);
  ck_assert_int_eq(D.cuStreamDestroy(mine), 0);
  ck_assert_int_eq(D.cuEventDestroy(e), 0);
}
END_TEST

START_TEST(ctx_synchronize_waits_for_its_context_only) {
  up();
  typedef gmb_cu_result (*create_fn)(gmb_cu_ctx *, unsigned, gmb_cu_device);
  typedef gmb_cu_result (*destroy_fn)(gmb_cu_ctx);
  create_fn create = (create_fn)(uintptr_t)gpa("cuCtxCreate");
  destroy_fn destroy = (destroy_fn)(uintptr_t)gpa("cuCtxDestroy");
  gmb_cu_ctx app;
  ck_assert_int_eq(create(&app, 0, 0), 0); /* current now */
  gmb_cu_stream s;
  ck_assert_int_eq(D.cuStreamCreate(&s, GMB_CU_STREAM_NON_BLOCKING), 0);
  atomic_store(&gate, 0);
  atomic_store(&order_n, 0);
  ck_assert_int_eq(D.cuLaunchHostFunc(s, gate_fn, NULL), 0);
  ck_assert_int_eq(D.cuLaunchHostFunc(s, mark_fn, (void *)1), 0);
  ck_assert_int_eq(D.cuLaunchHostFunc(NULL, gate_fn, NULL), 0);
  ck_assert_int_eq(D.cuLaunchHostFunc(NULL, mark_fn, (void *)2), 0);
  pthread_t t;
  ck_assert_int_eq(pthread_create(&t, NULL, open_gate_later, NULL), 0);
  ck_assert_int_eq(D.cuCtxSetCurrent(CTX), 0);
  ck_assert_int_eq(D.cuCtxSynchronize(), 0);
  ck_assert_int_eq(D.cuStreamSynchronize(NULL), 0);
  ck_assert_int_eq(atomic_load(&order_n), 0);
  ck_assert_int_eq(D.cuCtxSetCurrent(app), 0);
  ck_assert_int_eq(D.cuCtxSynchronize(), 0);
  ck_assert_int_eq(atomic_load(&order_n), 2);
  pthread_join(t, NULL);
  ck_assert_int_eq(D.cuStreamDestroy(s), 0);
  ck_assert_int_eq(destroy(app), 0);
  ck_assert_int_eq(D.cuCtxSetCurrent(CTX), 0);
}
END_TEST

/* $FAKECUDA_CTX_COST: a context holds device memory, here and in another
 * process, until it is destroyed or the process dies. */
START_TEST(context_costs_device_memory) {
  up();
  typedef gmb_cu_result (*create_fn)(gmb_cu_ctx *, unsigned, gmb_cu_device);
  typedef gmb_cu_result (*destroy_fn)(gmb_cu_ctx);
  create_fn create = (create_fn)(uintptr_t)gpa("cuCtxCreate");
  destroy_fn destroy = (destroy_fn)(uintptr_t)gpa("cuCtxDestroy");
  uint64_t before = used_now();
  setenv("FAKECUDA_CTX_COST", "6m", 1);
  gmb_cu_ctx app;
  ck_assert_int_eq(create(&app, 0, 0), 0);
  ck_assert_uint_eq(used_now(), before + 6 * MIB);
  ck_assert_int_eq(destroy(app), 0);
  ck_assert_int_eq(D.cuCtxSetCurrent(CTX), 0);
  ck_assert_uint_eq(used_now(), before);
  /* Another process: its primary context and a 2 MiB allocation. */
  pid_t pid = spawn_holder(2 * MIB);
  ck_assert_uint_eq(used_now(), before + 8 * MIB);
  ck_assert_int_eq(kill(pid, SIGKILL), 0);
  wait_status(pid);
  ck_assert_uint_eq(used_now(), before);
  unsetenv("FAKECUDA_CTX_COST");
}
END_TEST

/* An event is not ready until its stream ran past its last record; one
 * never recorded is ready; a record on a destroyed stream is refused; an
 * event destroyed with its record pending is harmless. */
START_TEST(events_follow_their_stream) {
  up();
  gmb_cu_stream s;
  gmb_cu_event e, e2;
  ck_assert_int_eq(D.cuStreamCreate(&s, GMB_CU_STREAM_NON_BLOCKING), 0);
  ck_assert_int_eq(D.cuEventCreate(&e, GMB_CU_EVENT_DISABLE_TIMING), 0);
  ck_assert_int_eq(D.cuEventCreate(&e2, GMB_CU_EVENT_DISABLE_TIMING), 0);
  ck_assert_int_eq(D.cuEventQuery(e), GMB_CU_SUCCESS);
  atomic_store(&gate, 0);
  ck_assert_int_eq(D.cuLaunchHostFunc(s, gate_fn, NULL), 0);
  ck_assert_int_eq(D.cuEventRecord(e, s), 0);
  ck_assert_int_eq(D.cuEventRecord(e2, s), 0);
  ck_assert_int_eq(D.cuEventQuery(e), GMB_CU_ERROR_NOT_READY);
  ck_assert_int_eq(D.cuEventDestroy(e2), 0); /* its record still queued */
  /* Another stream's record is independent of s. */
  gmb_cu_event n;
  ck_assert_int_eq(D.cuEventCreate(&n, 0), 0);
  ck_assert_int_eq(D.cuEventRecord(n, NULL), 0);
  ck_assert_int_eq(D.cuStreamSynchronize(NULL), 0);
  ck_assert_int_eq(D.cuEventQuery(n), GMB_CU_SUCCESS);
  ck_assert_int_eq(D.cuEventQuery(e), GMB_CU_ERROR_NOT_READY);
  atomic_store(&gate, 1);
  ck_assert_int_eq(D.cuStreamSynchronize(s), 0);
  ck_assert_int_eq(D.cuEventQuery(e), GMB_CU_SUCCESS);
  gmb_cu_stream dead;
  ck_assert_int_eq(D.cuStreamCreate(&dead, 0), 0);
  ck_assert_int_eq(D.cuStreamDestroy(dead), 0);
  ck_assert_int_ne(D.cuEventRecord(e, dead), 0);
  ck_assert_int_eq(D.cuEventDestroy(e), 0);
  ck_assert_int_eq(D.cuEventDestroy(n), 0);
  ck_assert_int_eq(D.cuStreamDestroy(s), 0);
}
END_TEST

/* --- memory across processes ------------------------------------------------- */

START_TEST(meminfo_is_device_wide_across_processes) {
  up();
  uint64_t before = used_now();
  pid_t pid = spawn_holder(6 * MIB);
  ck_assert_uint_eq(used_now(), before + 6 * MIB);
  /* Killed with its memory held: the kernel's lock on its slot goes with
   * it, and so does its memory. */
  ck_assert_int_eq(kill(pid, SIGKILL), 0);
  int st = wait_status(pid);
  ck_assert(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL);
  ck_assert_uint_eq(used_now(), before);
}
END_TEST

/* The same across PID namespaces (a container's client): the fake tells
 * processes apart by record locks, not pids.  Needs root to unshare. */
START_TEST(meminfo_counts_a_process_in_another_pid_namespace) {
  up();
  uint64_t before = used_now();
  int up_pipe[2];
  ck_assert_int_eq(pipe2(up_pipe, O_CLOEXEC), 0);
  char size[32], fd[16];
  snprintf(size, sizeof size, "%llu", (unsigned long long)(4 * MIB));
  snprintf(fd, sizeof fd, "%d", up_pipe[1]);
  int keep[] = {up_pipe[1], -1};
  spawn_pidns = 1;
  pid_t pid = spawn(keep, "hold", size, fd, NULL);
  spawn_pidns = 0;
  close(up_pipe[1]);
  char c = 0;
  ssize_t n = read(up_pipe[0], &c, 1);
  close(up_pipe[0]);
  if (n != 1) {
    int st = wait_status(pid);
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 126,
                  "the child in a PID namespace failed: status %#x", st);
    fprintf(stderr, "check_fakecuda: no PID namespace here (not root?): "
            "case skipped\n");
    return;
  }
  ck_assert_uint_eq(used_now(), before + 4 * MIB);
  ck_assert_int_eq(kill(pid, SIGKILL), 0); /* and its child with it */
  wait_status(pid);
  for (int i = 0; i < 2000 && used_now() != before; i++) {
    struct timespec ts = {0, 1000000};
    nanosleep(&ts, NULL);
  }
  ck_assert_uint_eq(used_now(), before);
}
END_TEST

START_TEST(import_in_other_process_sees_bytes) {
  up();
  uint64_t before = used_now();
  struct seg a;
  ck_assert_int_eq(seg_make(&a, 4 * MIB), 0);
  static uint8_t b[4 * MIB];
  fill(b, sizeof b, 1);
  ck_assert_int_eq(D.cuMemcpyHtoD(a.va, b, sizeof b), 0);
  ck_assert_int_eq(D.cuStreamSynchronize(NULL), 0); /* landed first */
  int fd = -1;
  ck_assert_int_eq(D.cuMemExportToShareableHandle(
                       &fd, a.h, GMB_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                       0),
                   0);
  ck_assert_int_ge(fd, 0);
  /* The broker's part: it releases its handle but keeps the mapping. */
  ck_assert_int_eq(D.cuMemRelease(a.h), 0);
  a.h = 0;
  char fds[16], size[32];
  snprintf(fds, sizeof fds, "%d", fd);
  snprintf(size, sizeof size, "%zu", a.size);
  int keep[] = {fd, -1};
  wait_ok(spawn(keep, "import", fds, size, NULL), "importer");
  memset(b, 0, sizeof b);
  ck_assert_int_eq(D.cuMemcpyDtoH(b, a.va, sizeof b), 0);
  ck_assert_int_eq(differs(b, sizeof b, 2), -1);
  ck_assert_uint_eq(used_now(), before + 4 * MIB);
  seg_drop(&a);
  /* Only the descriptor is left: memory the fake no longer counts (a
   * documented gap), and it still imports. */
  ck_assert_uint_eq(used_now(), before);
  gmb_cu_mem_handle h;
  ck_assert_int_eq(D.cuMemImportFromShareableHandle(
                       &h, (void *)(uintptr_t)fd,
                       GMB_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
                   0);
  ck_assert_uint_eq(used_now(), before + 4 * MIB);
  ck_assert_int_eq(D.cuMemRelease(h), 0);
  ck_assert_uint_eq(used_now(), before);
  close(fd);
}
END_TEST

START_TEST(import_of_foreign_descriptor_refused) {
  up();
  gmb_cu_mem_handle h;
  int fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  ck_assert_int_ge(fd, 0);
  ck_assert_int_eq(D.cuMemImportFromShareableHandle(
                       &h, (void *)(uintptr_t)fd,
                       GMB_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
                   GMB_CU_ERROR_INVALID_VALUE);
  close(fd);
  ck_assert_int_eq(D.cuMemImportFromShareableHandle(
                       &h, (void *)(uintptr_t)fd,
                       GMB_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
                   GMB_CU_ERROR_INVALID_VALUE);
  /* Memory created without the POSIX handle type does not export. */
  struct gmb_cu_mem_prop p = prop(0);
  ck_assert_int_eq(D.cuMemCreate(&h, 2 * MIB, &p, 0), 0);
  int out = -1;
  ck_assert_int_eq(D.cuMemExportToShareableHandle(
                       &out, h, GMB_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                       0),
                   GMB_CU_ERROR_INVALID_VALUE);
  ck_assert_int_eq(D.cuMemRelease(h), 0);
}
END_TEST

/* --- release, misuse and limits ---------------------------------------------- */

START_TEST(release_is_reference_counted) {
  up();
  uint64_t before = used_now();
  struct seg a;
  ck_assert_int_eq(seg_make(&a, 2 * MIB), 0);
  uint8_t b[4096];
  fill(b, sizeof b, 6);
  ck_assert_int_eq(D.cuMemcpyHtoD(a.va, b, sizeof b), 0);
  /* Released while mapped: the mapping keeps the memory and its bytes. */
  ck_assert_int_eq(D.cuMemRelease(a.h), 0);
  a.h = 0;
  ck_assert_uint_eq(used_now(), before + 2 * MIB);
  memset(b, 0, sizeof b);
  ck_assert_int_eq(D.cuMemcpyDtoH(b, a.va, sizeof b), 0);
  ck_assert_int_eq(differs(b, sizeof b, 6), -1);
  seg_drop(&a); /* unmapped: now it goes */
  ck_assert_uint_eq(used_now(), before);
}
END_TEST

static int log_has(const char *what) {
  FILE *f = fopen(fake_log, "r");
  if (!f) return 0;
  char line[512];
  int found = 0;
  while (!found && fgets(line, sizeof line, f))
    found = strstr(line, "FAKECUDA: misuse") && strstr(line, what);
  fclose(f);
  return found;
}

START_TEST(misuse_is_refused_and_reported) {
  up();
  unlink(fake_log);
  struct gmb_cu_mem_prop p = prop(GMB_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  gmb_cu_mem_handle h;
  ck_assert_int_eq(D.cuMemCreate(&h, 2 * MIB, &p, 0), 0);
  ck_assert_int_eq(D.cuMemRelease(h), 0);
  ck_assert_int_eq(D.cuMemRelease(h), GMB_CU_ERROR_INVALID_VALUE);
  ck_assert(log_has("cuMemRelease"));
  /* Sizes off the granularity. */
  ck_assert_int_eq(D.cuMemCreate(&h, MIB, &p, 0), GMB_CU_ERROR_INVALID_VALUE);
  ck_assert_int_eq(D.cuMemCreate(&h, 4 * MIB, &p, 0), 0);
  gmb_cu_ptr va;
  ck_assert_int_eq(D.cuMemAddressReserve(&va, 8 * MIB, 0, 0, 0), 0);
  ck_assert_int_eq(D.cuMemMap(va + 4096, 2 * MIB, 0, h, 0),
                   GMB_CU_ERROR_INVALID_VALUE);
  ck_assert_int_eq(D.cuMemMap(va, 3 * MIB, 0, h, 0),
                   GMB_CU_ERROR_INVALID_VALUE);
  ck_assert(log_has("cuMemMap"));
  /* Bigger than the allocation; an offset; outside the reservation. */
  ck_assert_int_eq(D.cuMemMap(va, 6 * MIB, 0, h, 0),
                   GMB_CU_ERROR_INVALID_VALUE);
  ck_assert_int_eq(D.cuMemMap(va, 2 * MIB, 2 * MIB, h, 0),
                   GMB_CU_ERROR_INVALID_VALUE);
  ck_assert_int_eq(D.cuMemMap(va + 6 * MIB, 4 * MIB, 0, h, 0),
                   GMB_CU_ERROR_INVALID_VALUE);
  /* Unmap of what is not mapped; mapped twice; a partial unmap. */
  ck_assert_int_eq(D.cuMemUnmap(va, 4 * MIB), GMB_CU_ERROR_INVALID_VALUE);
  ck_assert(log_has("cuMemUnmap"));
  ck_assert_int_eq(D.cuMemMap(va, 4 * MIB, 0, h, 0), 0);
  ck_assert_int_eq(D.cuMemMap(va + 2 * MIB, 2 * MIB, 0, h, 0),
                   GMB_CU_ERROR_INVALID_VALUE);
  ck_assert_int_eq(D.cuMemUnmap(va, 2 * MIB), GMB_CU_ERROR_INVALID_VALUE);
  ck_assert_int_eq(D.cuMemSetAccess(va, 2 * MIB, &RW, 1),
                   GMB_CU_ERROR_INVALID_VALUE);
  /* Freeing the addresses while mapped. */
  ck_assert_int_eq(D.cuMemAddressFree(va, 8 * MIB), GMB_CU_ERROR_INVALID_VALUE);
  ck_assert(log_has("cuMemAddressFree"));
  ck_assert_int_eq(D.cuMemUnmap(va, 4 * MIB), 0);
  ck_assert_int_eq(D.cuMemAddressFree(va, 4 * MIB), GMB_CU_ERROR_INVALID_VALUE);
  ck_assert_int_eq(D.cuMemAddressFree(va, 8 * MIB), 0);
  ck_assert_int_eq(D.cuMemRelease(h), 0);
}
END_TEST

START_TEST(out_of_memory_at_device_total) {
  up();
  uint64_t before = used_now();
  char total[32];
  snprintf(total, sizeof total, "%llu", (unsigned long long)(before + 4 * MIB));
  setenv("FAKECUDA_TOTAL", total, 1);
  struct gmb_cu_mem_prop p = prop(0);
  gmb_cu_mem_handle a, b;
  ck_assert_int_eq(D.cuMemCreate(&a, 4 * MIB, &p, 0), 0);
  ck_assert_int_eq(D.cuMemCreate(&b, 2 * MIB, &p, 0),
                   GMB_CU_ERROR_OUT_OF_MEMORY);
  size_t fr, tot;
  ck_assert_int_eq(D.cuMemGetInfo(&fr, &tot), 0);
  ck_assert_uint_eq(fr, 0);
  ck_assert_int_eq(D.cuMemRelease(a), 0);
  ck_assert_int_eq(D.cuMemCreate(&b, 2 * MIB, &p, 0), 0);
  ck_assert_int_eq(D.cuMemRelease(b), 0);
  unsetenv("FAKECUDA_TOTAL");
}
END_TEST

START_TEST(attributes_and_granularity) {
  up();
  int v = -1;
  ck_assert_int_eq(D.cuDeviceGetAttribute(
                       &v, GMB_CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                       0),
                   0);
  ck_assert_int_eq(v, 1);
  ck_assert_int_eq(
      D.cuDeviceGetAttribute(
          &v, GMB_CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
          0),
      0);
  ck_assert_int_eq(v, 1);
  struct gmb_cu_mem_prop p = prop(GMB_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  size_t g = 0;
  ck_assert_int_eq(D.cuMemGetAllocationGranularity(
                       &g, &p, GMB_CU_MEM_ALLOC_GRANULARITY_MINIMUM),
                   0);
  ck_assert_uint_eq(g, 2 * MIB);
  setenv("FAKECUDA_GRANULARITY", "64k", 1);
  ck_assert_int_eq(D.cuMemGetAllocationGranularity(
                       &g, &p, GMB_CU_MEM_ALLOC_GRANULARITY_MINIMUM),
                   0);
  ck_assert_uint_eq(g, 64 << 10);
  unsetenv("FAKECUDA_GRANULARITY");
  gmb_cu_mem_handle h;
  setenv("FAKECUDA_NO_POSIX_FD", "1", 1);
  ck_assert_int_eq(D.cuDeviceGetAttribute(
          &v, GMB_CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
          0),
      0);
  ck_assert_int_eq(v, 0);
  ck_assert_int_eq(D.cuMemCreate(&h, 2 * MIB, &p, 0),
                   GMB_CU_ERROR_NOT_SUPPORTED);
  unsetenv("FAKECUDA_NO_POSIX_FD");
  setenv("FAKECUDA_NO_VMM", "1", 1);
  ck_assert_int_eq(D.cuDeviceGetAttribute(
                       &v, GMB_CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                       0),
                   0);
  ck_assert_int_eq(v, 0);
  ck_assert_int_eq(D.cuMemCreate(&h, 2 * MIB, &p, 0),
                   GMB_CU_ERROR_NOT_SUPPORTED);
  unsetenv("FAKECUDA_NO_VMM");
  /* Attributes the fake does not model are refused, not made up. */
  ck_assert_int_eq(D.cuDeviceGetAttribute(&v, 1, 0), GMB_CU_ERROR_INVALID_VALUE);
}
END_TEST

START_TEST(scratch_alloc_is_device_memory_too) {
  up();
  uint64_t before = used_now();
  gmb_cu_ptr p;
  ck_assert_int_eq(D.cuMemAlloc(&p, 100000), 0);
  ck_assert_uint_eq(used_now(), before + 2 * MIB); /* rounded up */
  uint8_t b[100000];
  fill(b, sizeof b, 7);
  ck_assert_int_eq(D.cuMemcpyHtoD(p, b, sizeof b), 0);
  memset(b, 0, sizeof b);
  ck_assert_int_eq(D.cuMemcpyDtoH(b, p, sizeof b), 0);
  ck_assert_int_eq(differs(b, sizeof b, 7), -1);
  ck_assert_int_eq(D.cuMemFree(p + 512), GMB_CU_ERROR_INVALID_VALUE);
  ck_assert_int_eq(D.cuMemFree(p), 0);
  ck_assert_uint_eq(used_now(), before);
}
END_TEST

/* Page-locked host memory: made and freed by the driver's rules, and a
 * plain host buffer for copies to and from the device; it takes nothing
 * of the device's memory. */
START_TEST(pinned_host_memory) {
  up();
  uint64_t before = used_now();
  void *h = NULL;
  ck_assert_int_eq(D.cuMemHostAlloc(&h, 0, 0), GMB_CU_ERROR_INVALID_VALUE);
  ck_assert_int_eq(D.cuMemHostAlloc(&h, 4096, 0x100),
                   GMB_CU_ERROR_INVALID_VALUE);
  ck_assert_int_eq(D.cuMemHostAlloc(&h, 3 * 4096, 0), 0);
  ck_assert_uint_eq(used_now(), before);
  gmb_cu_ptr p;
  ck_assert_int_eq(D.cuMemAlloc(&p, 3 * 4096), 0);
  fill(h, 3 * 4096, 9);
  ck_assert_int_eq(D.cuMemcpyHtoD(p, h, 3 * 4096), 0);
  memset(h, 0, 3 * 4096);
  ck_assert_int_eq(D.cuMemcpyDtoH(h, p, 3 * 4096), 0);
  ck_assert_int_eq(differs(h, 3 * 4096, 9), -1);
  ck_assert_int_eq(D.cuMemFree(p), 0);
  static char not_pinned[64];
  ck_assert_int_eq(D.cuMemFreeHost(not_pinned), GMB_CU_ERROR_INVALID_VALUE);
  ck_assert_int_eq(D.cuMemFreeHost(h), 0);
  ck_assert_int_eq(D.cuMemFreeHost(h), GMB_CU_ERROR_INVALID_VALUE);
}
END_TEST

static Suite *fakecuda_suite(void) {
  Suite *s = suite_create("fakecuda");
  TCase *tc = tcase_create("addresses");
  tcase_add_test(tc, cpu_dereference_of_device_address_faults);
  tcase_add_test(tc, copies_move_bytes_through_mappings);
  tcase_add_test(tc, copy_outside_mapping_or_overlapping_refused);
  tcase_add_test(tc, copy_across_mappings_side_by_side);
  suite_add_tcase(s, tc);
  tc = tcase_create("threads");
  tcase_add_test(tc, context_is_per_thread);
  tcase_add_test(tc, fork_after_init_is_refused);
  tcase_add_test(tc, streams_are_ordered_and_independent);
  tcase_add_test(tc, events_follow_their_stream);
  tcase_add_test(tc, ctx_synchronize_waits_for_its_context_only);
  tcase_add_test(tc, htod_from_pageable_lands_later);
  tcase_add_test(tc, event_and_stream_of_one_context);
  suite_add_tcase(s, tc);
  tc = tcase_create("processes");
  tcase_add_test(tc, meminfo_is_device_wide_across_processes);
  tcase_add_test(tc, context_costs_device_memory);
  tcase_add_test(tc, meminfo_counts_a_process_in_another_pid_namespace);
  tcase_add_test(tc, import_in_other_process_sees_bytes);
  tcase_add_test(tc, import_of_foreign_descriptor_refused);
  suite_add_tcase(s, tc);
  tc = tcase_create("memory");
  tcase_add_test(tc, release_is_reference_counted);
  tcase_add_test(tc, misuse_is_refused_and_reported);
  tcase_add_test(tc, out_of_memory_at_device_total);
  tcase_add_test(tc, attributes_and_granularity);
  tcase_add_test(tc, scratch_alloc_is_device_memory_too);
  tcase_add_test(tc, pinned_host_memory);
  suite_add_tcase(s, tc);
  return s;
}

static void rm_dir(void) {
  char path[128];
  snprintf(path, sizeof path, "%s/device0", fake_dir);
  unlink(path);
  unlink(fake_log);
  rmdir(fake_dir);
}

int main(int argc, char **argv) {
  ssize_t n = readlink("/proc/self/exe", self_exe, sizeof self_exe - 1);
  if (n <= 0) return 2;
  self_exe[n] = '\0';
  if (argc >= 3 && strcmp(argv[1], "--child") == 0)
    return child_main(argc, argv);
  /* Absolute: the children may run elsewhere, and they inherit it. */
  char so[PATH_MAX];
  if (!realpath(fake_path(), so)) {
    fprintf(stderr, "check_fakecuda: no fake driver at %s\n", fake_path());
    return 1;
  }
  setenv("GMB_LIBCUDA", so, 1);
  snprintf(fake_dir, sizeof fake_dir, "/tmp/gmb-check-fakecuda-XXXXXX");
  if (!mkdtemp(fake_dir)) return 2;
  snprintf(fake_log, sizeof fake_log, "%s/misuse.log", fake_dir);
  setenv("FAKECUDA_DIR", fake_dir, 1);
  unsetenv("FAKECUDA_TOTAL");
  unsetenv("FAKECUDA_DEVICES");
  unsetenv("FAKECUDA_MISSING");
  unsetenv("FAKECUDA_GRANULARITY");
  unsetenv("FAKECUDA_NO_VMM");
  unsetenv("FAKECUDA_NO_POSIX_FD");
  /* Misuse reports go there (some cases misuse on purpose). */
  setenv("FAKECUDA_LOG", fake_log, 1);
  SRunner *sr = srunner_create(fakecuda_suite());
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  rm_dir();
  return failed ? 1 : 0;
}
