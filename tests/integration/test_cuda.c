/*
 * test_cuda.c - a real broker on `--device cuda:0` over the fake CUDA
 * driver (tests/fakecuda/, loaded through $GMB_LIBCUDA, which the broker
 * inherits from this process), and the device choices a broker makes at
 * start-up without a driver.
 *
 * End to end (the cuda_* tests): real client processes map the broker's
 * segments through the fake driver, which behaves like a GPU where it
 * matters: a device address is not a CPU address, so the tests write and
 * read device memory with cuMemcpyHtoD/DtoH through the pointers gmb_lock
 * gives.  Each broker gets a fake device of its own ($FAKECUDA_DIR); the
 * fake reports misuse of the driver (a bad unmap, a copy outside mapped
 * memory, ...) to $FAKECUDA_LOG, so every end-to-end test ends with that
 * log empty, and with nothing left on the device once the broker and its
 * clients are gone (cuMemGetInfo is device-wide).  What the broker holds
 * is counted from outside: the fake maps each mapping's bytes as
 * "memfd:fakecuda-<id>" in its process, and the broker maps each of its
 * segments once (for copies) until seg_free, so a segment the pool
 * released but the device parked (a client has not said it unmapped it)
 * is still in /proc/<broker>/maps, and one freed is not.
 *
 * Clients run in forked children, forked before the test process touches
 * CUDA (the driver, real or fake, refuses a child forked after cuInit).
 * Children wait on pipes, never on time; a segment's retirement is made to
 * wait by SIGSTOPping the child that holds it (the broker, which watches
 * the pid, keeps its session, and the stopped child never says it
 * unmapped).  An evicted client that still runs keeps its mapping, and
 * its bytes, whatever the broker hands out afterwards.
 */
#include <check.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cudrv.h"
#include "cuimport.h"
#include "gmb.h"
#include "harness.h"
#include "hostbuf.h"

#define KIB (UINT64_C(1) << 10)
#define MIB (UINT64_C(1) << 20)

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

/* --- end to end: real clients on the fake driver ------------------------ */

static char cuda_log_path[64];
static char cuda_dev_dir[64];

/* A broker on cuda:0 over a fake device of its own with `total` bytes of
 * memory, and an empty $FAKECUDA_LOG that the broker and every client
 * (forked from this process) append to. */
static void cuda_start(struct harness_broker *b, const char *total,
                       const char *config) {
  use_fake();
  setenv("FAKECUDA_TOTAL", total, 1);
  snprintf(cuda_dev_dir, sizeof cuda_dev_dir, "/tmp/gmbt-fakedev-XXXXXX");
  ck_assert_ptr_nonnull(mkdtemp(cuda_dev_dir));
  setenv("FAKECUDA_DIR", cuda_dev_dir, 1);
  snprintf(cuda_log_path, sizeof cuda_log_path, "/tmp/gmbt-fakelog-XXXXXX");
  int fd = mkstemp(cuda_log_path);
  ck_assert_msg(fd >= 0, "mkstemp %s", cuda_log_path);
  close(fd);
  setenv("FAKECUDA_LOG", cuda_log_path, 1);
  harness_broker_start(b, "cuda:0", config);
}

/* How many segments broker `pid` holds on the device now: the distinct
 * fake allocations it maps (see the top); -1 when it is gone. */
static int cuda_device_objects(pid_t pid) {
  char path[64], line[512];
  snprintf(path, sizeof path, "/proc/%ld/maps", (long)pid);
  FILE *f = fopen(path, "r");
  if (f == NULL) return -1;
  unsigned long long seen[256];
  int count = 0;
  while (fgets(line, sizeof line, f)) {
    const char *m = strstr(line, "memfd:fakecuda-");
    if (m == NULL) continue;
    unsigned long long id = strtoull(m + 15, NULL, 10);
    int dup = 0;
    for (int i = 0; i < count && !dup; i++) dup = seen[i] == id;
    if (!dup && count < 256) seen[count++] = id;
  }
  fclose(f);
  return count;
}

/* The test process's own handle on the driver, loaded at its first use in
 * a process (the test process only after it forked its last client). */
static struct gmb_cudrv cuda_drv;

static struct gmb_cudrv *cuda_driver(void) {
  static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
  pthread_mutex_lock(&mu);
  if (cuda_drv.lib == NULL) {
    char err[256];
    if (gmb__cudrv_load(&cuda_drv, err, sizeof err) != 0) {
      fprintf(stderr, "test_cuda: %s\n", err);
      memset(&cuda_drv, 0, sizeof cuda_drv);
    }
  }
  pthread_mutex_unlock(&mu);
  if (cuda_drv.lib == NULL) return NULL;
  /* As a program's CUDA runtime would, on each thread: the library makes
   * no context current behind the program's back. */
  gmb_cu_ctx cur = NULL, ctx;
  if (cuda_drv.cuCtxGetCurrent(&cur) != 0) return NULL;
  if (cur == NULL && (cuda_drv.cuDevicePrimaryCtxRetain(&ctx, 0) != 0 ||
                      cuda_drv.cuCtxSetCurrent(ctx) != 0))
    return NULL;
  return &cuda_drv;
}

/* Bytes the fake device holds for every process, or -1. */
static long long cuda_device_used(void) {
  struct gmb_cudrv *d = cuda_driver();
  gmb_cu_ctx ctx, cur = NULL;
  size_t fr, tot;
  if (d == NULL || d->cuCtxGetCurrent(&cur) != 0) return -1;
  if (cur == NULL && (d->cuDevicePrimaryCtxRetain(&ctx, 0) != 0 ||
                      d->cuCtxSetCurrent(ctx) != 0))
    return -1;
  if (d->cuMemGetInfo(&fr, &tot) != 0) return -1;
  return (long long)(tot - fr);
}

/* $FAKECUDA_LOG so far (NUL-terminated; the caller frees it). */
static char *cuda_log(void) {
  FILE *f = fopen(cuda_log_path, "r");
  ck_assert_msg(f != NULL, "no %s", cuda_log_path);
  char *buf = calloc(1, 8192);
  ck_assert_ptr_nonnull(buf);
  size_t n = fread(buf, 1, 8191, f);
  buf[n] = '\0';
  fclose(f);
  return buf;
}

static void cuda_assert_log_empty(void) {
  char *log = cuda_log();
  ck_assert_msg(log[0] == '\0', "the fake driver saw memory freed while a "
                "process still had it open:\n%s", log);
  free(log);
}

struct cuda_want {
  struct harness_broker *b;
  int objects;        /* device regions the broker should hold */
  uint64_t segments;  /* and bytes in the pool's segments */
};

static int cuda_device_is(void *arg) {
  struct cuda_want *w = arg;
  if (cuda_device_objects(w->b->pid) != w->objects) return 0;
  struct wire_reply rep;
  if (harness_admin_status(w->b, &rep) != 0) return 0;
  int ok = rep.u.admin_status.in_segments == w->segments;
  gmb__wire_reply_clear(&rep);
  return ok;
}

/* Waits until the broker holds `objects` device regions and `segments`
 * bytes of pool segments; fails the test, saying what it saw, if not. */
static void cuda_wait_device(struct harness_broker *b, int objects,
                             uint64_t segments) {
  struct cuda_want w = {b, objects, segments};
  if (harness_poll_until(cuda_device_is, &w, HARNESS_WAIT_MS)) return;
  struct wire_reply rep;
  ck_assert_int_eq(harness_admin_status(b, &rep), 0);
  uint64_t in = rep.u.admin_status.in_segments;
  gmb__wire_reply_clear(&rep);
  ck_abort_msg("want %d device regions and %llu bytes in segments, have %d "
               "and %llu", objects, (unsigned long long)segments,
               cuda_device_objects(b->pid), (unsigned long long)in);
}

static int cuda_settled(void *arg) {
  struct harness_broker *b = arg;
  struct wire_reply rep;
  if (harness_admin_status(b, &rep) != 0) return 0;
  uint64_t in = rep.u.admin_status.in_segments;
  int ok = rep.u.admin_status.in_use == 0 &&
           (uint64_t)cuda_device_objects(b->pid) * 2 * MIB == in;
  gmb__wire_reply_clear(&rep);
  return ok;
}

/* Waits until nothing is allocated and the device holds exactly the
 * pool's segments, all 2 MiB ones: nothing parked for a client any more
 * (the broker's trim may or may not have taken the lingering small ones
 * yet, and the test need not wait for it). */
static void cuda_wait_settled(struct harness_broker *b) {
  if (harness_poll_until(cuda_settled, b, HARNESS_WAIT_MS)) return;
  struct wire_reply rep;
  ck_assert_int_eq(harness_admin_status(b, &rep), 0);
  uint64_t in = rep.u.admin_status.in_segments;
  uint64_t used = rep.u.admin_status.in_use;
  gmb__wire_reply_clear(&rep);
  ck_abort_msg("want nothing allocated and every device region in a pool "
               "segment: %llu bytes allocated, %llu in segments, %d device "
               "regions", (unsigned long long)used, (unsigned long long)in,
               cuda_device_objects(b->pid));
}

/* Once the broker and every client are gone: nothing is left on the
 * device and nobody misused the driver; the fake device goes. */
static void cuda_device_done(void) {
  ck_assert_int_eq(cuda_device_used(), 0);
  cuda_assert_log_empty();
  unlink(cuda_log_path);
  char acct[96];
  snprintf(acct, sizeof acct, "%s/device0", cuda_dev_dir);
  unlink(acct);
  rmdir(cuda_dev_dir);
}

/* Stops the broker (which fails unless it exits 0), then checks that
 * nothing is left on the device and that nobody misused the driver.
 * Every client of the test has ended by then. */
static void cuda_finish(struct harness_broker *b) {
  char *log = harness_broker_log(b);
  ck_assert_msg(strstr(log, "never said they closed") == NULL, "%s", log);
  free(log);
  harness_broker_stop(b);
  cuda_device_done();
}

/* Locks `id`, fills it with the pattern of `seed` by a copy to the
 * pointer (cuMemcpyHtoD: it is a device address) and unlocks it. */
static int cuda_fill(gmb_client *c, gmb_id id, uint64_t size, uint64_t seed) {
  struct gmb_cudrv *d = cuda_driver();
  uint8_t *buf = malloc(size);
  if (d == NULL || buf == NULL) {
    free(buf);
    return GMB_E_DEVICE;
  }
  harness_pattern_fill(buf, size, seed);
  void *p = NULL;
  int rc = gmb_lock(c, id, &p);
  if (rc == 0 && p == NULL) rc = GMB_E_PROTO;
  if (rc == 0) {
    gmb_cu_result r = d->cuMemcpyHtoD((gmb_cu_ptr)(uintptr_t)p, buf, size);
    /* From pageable memory the copy returns before the bytes land: they
     * are in place before the unlock lets the broker move them. */
    if (r == GMB_CU_SUCCESS) r = d->cuStreamSynchronize(NULL);
    if (r != GMB_CU_SUCCESS) {
      fprintf(stderr, "allocation %llu: cuMemcpyHtoD: error %d\n",
              (unsigned long long)id, r);
      rc = GMB_E_DEVICE;
    }
    int urc = gmb_unlock(c, id);
    if (rc == 0) rc = urc;
  }
  free(buf);
  return rc;
}

/* Locks `id` and checks the pattern of `seed` by a copy from the pointer:
 * 0, the lock's or the copy's error, or 1 on a mismatch (said on
 * stderr). */
static int cuda_check(gmb_client *c, gmb_id id, uint64_t size, uint64_t seed,
                      void **where) {
  struct gmb_cudrv *d = cuda_driver();
  uint8_t *buf = malloc(size);
  if (d == NULL || buf == NULL) {
    free(buf);
    return GMB_E_DEVICE;
  }
  void *p = NULL;
  int rc = gmb_lock(c, id, &p);
  if (rc) {
    free(buf);
    return rc;
  }
  gmb_cu_result r = d->cuMemcpyDtoH(buf, (gmb_cu_ptr)(uintptr_t)p, size);
  if (where) *where = p;
  gmb_unlock(c, id);
  if (r != GMB_CU_SUCCESS) {
    fprintf(stderr, "allocation %llu: cuMemcpyDtoH: error %d\n",
            (unsigned long long)id, r);
    free(buf);
    return GMB_E_DEVICE;
  }
  long bad = harness_pattern_check(buf, size, seed);
  free(buf);
  if (bad >= 0) {
    fprintf(stderr, "allocation %llu (seed %llu) differs at byte %ld\n",
            (unsigned long long)id, (unsigned long long)seed, bad);
    return 1;
  }
  return 0;
}

/* The parent's side of a step: waits for `want` from the children's pipe;
 * on anything else, fails with child `pid`'s end. */
static void cuda_step(int fd, char want, pid_t pid) {
  int got = harness_pipe_wait(fd, HARNESS_WAIT_MS);
  if (got == want) return;
  int rc = harness_wait(pid);
  ck_abort_msg("waited for '%c' from child %d, got %d; the child ended with "
               "%d (its stderr is above)", want, (int)pid, got, rc);
}

/* --- cuda_clients_share_memory -------------------------------------------- */

struct share {
  char endpoint[128];
  int up[2];      /* children -> test: one byte a step */
  int go[3][2];   /* test -> child i */
  gmb_id a_pinned, a_movable, b_movable;
};

#define SHARE_A_PINNED (4 * MIB)
#define SHARE_SMALL (256 * KIB)

/* Each session of `c` other than the owner: none of `ids` is usable. */
static int share_foreign(gmb_client *c, const gmb_id *ids, int n) {
  for (int i = 0; i < n; i++) {
    void *p = NULL;
    CHILD_CHECK(gmb_lock(c, ids[i], &p) == GMB_E_NOENT, 20, "lock %d", i);
    CHILD_CHECK(p == NULL, 21, "lock %d set a pointer", i);
    CHILD_CHECK(gmb_unlock(c, ids[i]) == GMB_E_NOENT, 22, "unlock %d", i);
    CHILD_CHECK(gmb_unlock_on_stream(c, ids[i], NULL) == GMB_E_NOENT, 23,
                "unlock_on_stream %d", i);
    CHILD_CHECK(gmb_free(c, ids[i]) == GMB_E_NOENT, 24, "free %d: %s", i,
                gmb_last_error(c));
  }
  return 0;
}

static int share_child_a(void *arg) {
  struct share *s = arg;
  gmb_client *c = NULL;
  CHILD_CHECK(gmb_connect(s->endpoint, "alpha", &c) == 0, 2, "%s",
              gmb_last_error(NULL));
  CHILD_CHECK(gmb_alloc(c, SHARE_A_PINNED, 0, &s->a_pinned) == 0, 3, "%s",
              gmb_last_error(c));
  CHILD_CHECK(gmb_alloc(c, SHARE_SMALL, GMB_MOVABLE, &s->a_movable) == 0, 4,
              "%s", gmb_last_error(c));
  CHILD_CHECK(cuda_fill(c, s->a_pinned, SHARE_A_PINNED, 11) == 0, 5, "%s",
              gmb_last_error(c));
  CHILD_CHECK(cuda_fill(c, s->a_movable, SHARE_SMALL, 12) == 0, 6, "%s",
              gmb_last_error(c));
  harness_pipe_send(s->up[1], 'a');
  CHILD_CHECK(harness_pipe_wait(s->go[0][0], HARNESS_WAIT_MS) == 'v', 7,
              "no go");
  /* B wrote its block next to ours, in the segment we have open too. */
  CHILD_CHECK(cuda_check(c, s->a_pinned, SHARE_A_PINNED, 11, NULL) == 0, 8,
              "pinned");
  CHILD_CHECK(cuda_check(c, s->a_movable, SHARE_SMALL, 12, NULL) == 0, 9,
              "movable");
  /* B may have freed its block by now: only ours are sure to count. */
  gmb_stats st;
  CHILD_CHECK(gmb_tenant_stats(c, &st) == 0, 10, "%s", gmb_last_error(c));
  CHILD_CHECK(st.used >= SHARE_A_PINNED + SHARE_SMALL, 11, "used %llu",
              (unsigned long long)st.used);
  CHILD_CHECK(gmb_free(c, s->a_pinned) == 0, 12, "%s", gmb_last_error(c));
  CHILD_CHECK(gmb_free(c, s->a_movable) == 0, 13, "%s", gmb_last_error(c));
  gmb_disconnect(c);
  return 0;
}

static int share_child_b(void *arg) {
  struct share *s = arg;
  gmb_client *c = NULL;
  CHILD_CHECK(gmb_connect(s->endpoint, "alpha", &c) == 0, 2, "%s",
              gmb_last_error(NULL));
  gmb_id theirs[] = {s->a_pinned, s->a_movable};
  int rc = share_foreign(c, theirs, 2);
  if (rc) return rc;
  CHILD_CHECK(gmb_alloc(c, SHARE_SMALL, GMB_MOVABLE, &s->b_movable) == 0, 3,
              "%s", gmb_last_error(c));
  CHILD_CHECK(cuda_fill(c, s->b_movable, SHARE_SMALL, 21) == 0, 4, "%s",
              gmb_last_error(c));
  gmb_stats st;
  CHILD_CHECK(gmb_tenant_stats(c, &st) == 0, 5, "%s", gmb_last_error(c));
  CHILD_CHECK(st.used == SHARE_A_PINNED + 2 * SHARE_SMALL, 6, "used %llu",
              (unsigned long long)st.used);
  /* One small segment holds A's block and ours. */
  CHILD_CHECK(st.segments == SHARE_A_PINNED + 2 * MIB, 7, "segments %llu",
              (unsigned long long)st.segments);
  harness_pipe_send(s->up[1], 'b');
  CHILD_CHECK(harness_pipe_wait(s->go[1][0], HARNESS_WAIT_MS) == 'v', 8,
              "no go");
  CHILD_CHECK(cuda_check(c, s->b_movable, SHARE_SMALL, 21, NULL) == 0, 9,
              "movable");
  CHILD_CHECK(gmb_free(c, s->b_movable) == 0, 10, "%s", gmb_last_error(c));
  gmb_disconnect(c);
  return 0;
}

static int share_child_c(void *arg) {
  struct share *s = arg;
  gmb_client *c = NULL;
  CHILD_CHECK(gmb_connect(s->endpoint, "beta", &c) == 0, 2, "%s",
              gmb_last_error(NULL));
  gmb_stats st;
  CHILD_CHECK(gmb_tenant_stats(c, &st) == 0, 3, "%s", gmb_last_error(c));
  CHILD_CHECK(st.used == 0 && st.segments == 0, 4, "used %llu segments %llu",
              (unsigned long long)st.used, (unsigned long long)st.segments);
  gmb_id theirs[] = {s->a_pinned, s->a_movable, s->b_movable};
  int rc = share_foreign(c, theirs, 3);
  if (rc) return rc;
  gmb_id mine = 0;
  CHILD_CHECK(gmb_alloc(c, MIB, GMB_MOVABLE, &mine) == 0, 5, "%s",
              gmb_last_error(c));
  CHILD_CHECK(cuda_fill(c, mine, MIB, 31) == 0, 6, "%s", gmb_last_error(c));
  CHILD_CHECK(gmb_tenant_stats(c, &st) == 0, 7, "%s", gmb_last_error(c));
  /* A segment of its own: tenants never share one. */
  CHILD_CHECK(st.used == MIB && st.segments == 2 * MIB, 8,
              "used %llu segments %llu", (unsigned long long)st.used,
              (unsigned long long)st.segments);
  harness_pipe_send(s->up[1], 'c');
  CHILD_CHECK(harness_pipe_wait(s->go[2][0], HARNESS_WAIT_MS) == 'v', 9,
              "no go");
  CHILD_CHECK(cuda_check(c, mine, MIB, 31, NULL) == 0, 10, "movable");
  CHILD_CHECK(gmb_free(c, mine) == 0, 11, "%s", gmb_last_error(c));
  gmb_disconnect(c);
  return 0;
}

START_TEST(cuda_clients_share_memory) {
  struct harness_broker b;
  cuda_start(&b, "256m", NULL);
  struct share *s = mmap(NULL, sizeof *s, PROT_READ | PROT_WRITE,
                         MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  ck_assert_ptr_ne(s, MAP_FAILED);
  memset(s, 0, sizeof *s);
  snprintf(s->endpoint, sizeof s->endpoint, "%s", b.endpoint);
  ck_assert_int_eq(pipe(s->up), 0);
  for (int i = 0; i < 3; i++) ck_assert_int_eq(pipe(s->go[i]), 0);
  /* One after the other: B and C are handed the ids A made. */
  pid_t a = harness_fork(share_child_a, s);
  cuda_step(s->up[0], 'a', a);
  pid_t bb = harness_fork(share_child_b, s);
  cuda_step(s->up[0], 'b', bb);
  pid_t c = harness_fork(share_child_c, s);
  cuda_step(s->up[0], 'c', c);

  struct wire_tenant_row row;
  ck_assert_int_eq(harness_tenant_row(&b, "alpha", &row), 0);
  ck_assert_uint_eq(row.used, SHARE_A_PINNED + 2 * SHARE_SMALL);
  ck_assert_uint_eq(row.segments, SHARE_A_PINNED + 2 * MIB);
  ck_assert_uint_eq(row.sessions, 2);
  ck_assert_uint_eq(row.allocations, 3);
  ck_assert_int_eq(harness_tenant_row(&b, "beta", &row), 0);
  ck_assert_uint_eq(row.used, MIB);
  ck_assert_uint_eq(row.segments, 2 * MIB);
  ck_assert_uint_eq(row.sessions, 1);
  /* Three segments on the device: A's large one, alpha's small, beta's. */
  ck_assert_int_eq(cuda_device_objects(b.pid), 3);

  pid_t kids[] = {a, bb, c};
  for (int i = 0; i < 3; i++) harness_pipe_send(s->go[i][1], 'v');
  for (int i = 0; i < 3; i++)
    ck_assert_msg(harness_wait(kids[i]) == 0, "child %d failed", i);
  /* Everything freed and closed: nothing parked (the small segments may
   * linger until the broker trims them). */
  cuda_wait_settled(&b);
  munmap(s, sizeof *s);
  cuda_finish(&b);
}
END_TEST

/* --- cuda_compaction_moves_bytes ------------------------------------------ */

#define N_BLOCKS 64

static int compaction_ran(void *arg) {
  struct wire_reply rep;
  if (harness_admin_status(arg, &rep) != 0) return 0;
  int ran = rep.u.admin_status.compaction.runs > 0;
  gmb__wire_reply_clear(&rep);
  return ran;
}

START_TEST(cuda_compaction_moves_bytes) {
  /* test_defrag's seed on the GPU: 64 MiB of device filled with 1 MiB
   * movable blocks, every other one freed, then 8 MiB asked for. */
  struct harness_broker b;
  cuda_start(&b, "64m",
             "[broker]\ncompaction = auto\ncompaction_threshold = 0.99\n"
             "[tenant:frag]\nquota = 1GiB\n");
  struct wire_reply rep;
  ck_assert_int_eq(harness_admin_status(&b, &rep), 0);
  ck_assert_uint_eq(rep.u.admin_status.capacity, 64 * MIB);
  gmb__wire_reply_clear(&rep);
  gmb_client *c = harness_connect_ok(&b, "frag");
  gmb_id all[N_BLOCKS], ids[N_BLOCKS / 2];
  void *before[N_BLOCKS / 2];
  for (int i = 0; i < N_BLOCKS; i++) {
    int rc = gmb_alloc(c, MIB, GMB_MOVABLE, &all[i]);
    ck_assert_msg(rc == 0, "fill %d: %s", i, gmb_last_error(c));
    ck_assert_int_eq(cuda_fill(c, all[i], MIB, (uint64_t)i + 1), 0);
  }
  ck_assert_int_eq(cuda_device_objects(b.pid), N_BLOCKS / 2);
  int kept = 0;
  for (int i = 0; i < N_BLOCKS; i++) {
    if (i % 2 == 0) ck_assert_int_eq(gmb_free(c, all[i]), 0);
    else ids[kept++] = all[i];
  }
  for (int k = 0; k < kept; k++)
    ck_assert_int_eq(cuda_check(c, ids[k], MIB, (uint64_t)(2 * k + 1) + 1,
                                &before[k]),
                     0);
  /* With a wait: the segments compaction empties are retired until this
   * client's library thread closes its mappings (SegmentClosed), and a
   * request that needs their bytes can come before that. */
  gmb_id big = 0;
  int rc = gmb_alloc_wait(c, 8 * MIB, 0, HARNESS_WAIT_MS, &big);
  ck_assert_msg(rc == 0, "8 MiB after fragmentation: %s", gmb_last_error(c));
  /* The request may be served before the run ends (when this client's
   * SegmentClosed frees parked segments), and the totals come at its end. */
  ck_assert(harness_poll_until(compaction_ran, &b, HARNESS_WAIT_MS));
  ck_assert_int_eq(harness_admin_status(&b, &rep), 0);
  ck_assert_uint_ge(rep.u.admin_status.compaction.moves, 1);
  ck_assert_uint_ge(rep.u.admin_status.compaction.segments_released, 4);
  gmb__wire_reply_clear(&rep);
  /* Every block where the broker now says it is, with its bytes: the
   * moves copied device memory, not just the pool's records. */
  int moved = 0;
  for (int k = 0; k < kept; k++) {
    void *p = NULL;
    ck_assert_int_eq(cuda_check(c, ids[k], MIB, (uint64_t)(2 * k + 1) + 1,
                                &p),
                     0);
    moved += p != before[k];
  }
  ck_assert_int_ge(moved, 1);
  ck_assert_int_eq(cuda_fill(c, big, 8 * MIB, 99), 0);
  ck_assert_int_eq(cuda_check(c, big, 8 * MIB, 99, NULL), 0);
  ck_assert_int_eq(gmb_free(c, big), 0);
  for (int k = 0; k < kept; k++) ck_assert_int_eq(gmb_free(c, ids[k]), 0);
  gmb_disconnect(c);
  cuda_wait_settled(&b);
  cuda_finish(&b);
}
END_TEST

/* --- cuda_retirement_waits_for_close -------------------------------------- */

struct ret {
  char endpoint[128];
  int up[2], go[2];
};

#define RET_BLOCKS 6

static int ret_child(void *arg) {
  struct ret *s = arg;
  gmb_client *c = NULL;
  CHILD_CHECK(gmb_connect(s->endpoint, "ret", &c) == 0, 2, "%s",
              gmb_last_error(NULL));
  /* A segment emptied by a free, while this process has it open. */
  gmb_id big = 0;
  CHILD_CHECK(gmb_alloc(c, 4 * MIB, 0, &big) == 0, 3, "%s",
              gmb_last_error(c));
  CHILD_CHECK(cuda_fill(c, big, 4 * MIB, 1) == 0, 4, "%s", gmb_last_error(c));
  CHILD_CHECK(gmb_free(c, big) == 0, 5, "%s", gmb_last_error(c));
  harness_pipe_send(s->up[1], 'f');
  CHILD_CHECK(harness_pipe_wait(s->go[0], HARNESS_WAIT_MS) == 'n', 6,
              "no go");
  /* Three small segments of two blocks; one hole in each of the first
   * two, so that a compaction empties one of them. */
  gmb_id id[RET_BLOCKS];
  for (int i = 0; i < RET_BLOCKS; i++) {
    CHILD_CHECK(gmb_alloc(c, MIB, GMB_MOVABLE, &id[i]) == 0, 7, "%s",
                gmb_last_error(c));
    CHILD_CHECK(cuda_fill(c, id[i], MIB, 10 + (uint64_t)i) == 0, 8, "%s",
                gmb_last_error(c));
  }
  CHILD_CHECK(gmb_free(c, id[0]) == 0, 9, "%s", gmb_last_error(c));
  CHILD_CHECK(gmb_free(c, id[3]) == 0, 9, "%s", gmb_last_error(c));
  harness_pipe_send(s->up[1], 'r');
  CHILD_CHECK(harness_pipe_wait(s->go[0], HARNESS_WAIT_MS) == 'g', 10,
              "no go");
  /* Moved while this process was stopped: the bytes moved with them. */
  for (int i = 1; i < RET_BLOCKS; i++) {
    if (i == 3) continue;
    CHILD_CHECK(cuda_check(c, id[i], MIB, 10 + (uint64_t)i, NULL) == 0, 11,
                "block %d: %s", i, gmb_last_error(c));
  }
  /* One block left in each of two segments: another compaction empties
   * one, which this process then never closes (it is killed). */
  CHILD_CHECK(gmb_free(c, id[2]) == 0, 12, "%s", gmb_last_error(c));
  CHILD_CHECK(gmb_free(c, id[4]) == 0, 12, "%s", gmb_last_error(c));
  harness_pipe_send(s->up[1], 'v');
  harness_pipe_wait(s->go[0], HARNESS_WAIT_MS * 3); /* killed meanwhile */
  return 99;
}

/* Stops child `pid` and waits until it is stopped. */
static void ret_stop(pid_t pid) {
  ck_assert_int_eq(kill(pid, SIGSTOP), 0);
  int st = 0;
  ck_assert_int_eq(waitpid(pid, &st, WUNTRACED), pid);
  ck_assert_msg(WIFSTOPPED(st), "child %d: status %#x", (int)pid, st);
}

static struct wire_compact_stats ret_compact(struct harness_broker *b) {
  void *adm = harness_raw_open(b->admin_endpoint);
  struct wire_compact_stats cs;
  memset(&cs, 0, sizeof cs);
  int rc = harness_admin_compact(adm, "ret", &cs);
  harness_raw_close(adm);
  ck_assert_msg(rc == 0, "AdminCompact: %s", gmb_err_name(rc));
  return cs;
}

START_TEST(cuda_retirement_waits_for_close) {
  struct harness_broker b;
  cuda_start(&b, "256m", "[broker]\ncompaction = off\n");
  struct ret *s = mmap(NULL, sizeof *s, PROT_READ | PROT_WRITE,
                       MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  ck_assert_ptr_ne(s, MAP_FAILED);
  memset(s, 0, sizeof *s);
  snprintf(s->endpoint, sizeof s->endpoint, "%s", b.endpoint);
  ck_assert_int_eq(pipe(s->up), 0);
  ck_assert_int_eq(pipe(s->go), 0);
  pid_t y = harness_fork(ret_child, s);

  /* 1. The large segment its free emptied goes once the client closed it
   * (SegmentClosed): its session lives on, so nothing else frees it. */
  cuda_step(s->up[0], 'f', y);
  cuda_wait_device(&b, 0, 0);
  ck_assert_int_eq(waitpid(y, NULL, WNOHANG), 0);
  ck_assert_int_eq(harness_pipe_send(s->go[1], 'n'), 0);

  /* 2. A segment emptied by compaction while the client that has it open
   * is stopped: released by the pool, still on the device. */
  cuda_step(s->up[0], 'r', y);
  ck_assert_int_eq(cuda_device_objects(b.pid), 3);
  ret_stop(y);
  struct wire_compact_stats cs = ret_compact(&b);
  ck_assert_uint_ge(cs.moves, 1);
  ck_assert_uint_eq(cs.segments_released, 1);
  struct wire_reply rep;
  ck_assert_int_eq(harness_admin_status(&b, &rep), 0);
  ck_assert_uint_eq(rep.u.admin_status.in_segments, 4 * MIB);
  /* The parked segment is reported to operators as retiring. */
  ck_assert_uint_eq(rep.u.admin_status.retiring, 2 * MIB);
  gmb__wire_reply_clear(&rep);
  ck_assert_int_eq(cuda_device_objects(b.pid), 3); /* parked, not freed */
  cuda_assert_log_empty();
  /* Running again, it reads the retirement, closes, says so: freed. */
  ck_assert_int_eq(kill(y, SIGCONT), 0);
  cuda_wait_device(&b, 2, 4 * MIB);

  /* 3. Parked again, and then the holder is killed: its session's end
   * frees what it never closed. */
  ck_assert_int_eq(harness_pipe_send(s->go[1], 'g'), 0);
  cuda_step(s->up[0], 'v', y);
  ret_stop(y);
  cs = ret_compact(&b);
  ck_assert_uint_ge(cs.moves, 1);
  ck_assert_uint_eq(cs.segments_released, 1);
  ck_assert_int_eq(cuda_device_objects(b.pid), 2);
  ck_assert_int_eq(kill(y, SIGKILL), 0);
  ck_assert_int_eq(harness_wait(y), 128 + SIGKILL);
  cuda_wait_device(&b, 0, 0);
  struct wire_tenant_row row;
  ck_assert_int_eq(harness_tenant_row(&b, "ret", &row), 0);
  ck_assert_uint_eq(row.sessions, 0);
  ck_assert_uint_eq(row.used, 0);
  munmap(s, sizeof *s);
  cuda_finish(&b);
}
END_TEST

/* --- cuda_unlock_on_stream ------------------------------------------------ */

static atomic_int stream_gate;

/* Work on the stream that ends only when the test says so (or after the
 * bound, so that a failing test cannot hang the driver's thread). */
static void stream_blocker(void *user) {
  (void)user;
  double end = harness_now_ms() + 3 * HARNESS_WAIT_MS;
  while (!atomic_load(&stream_gate) && harness_now_ms() < end)
    harness_sleep_ms(1);
}

START_TEST(cuda_unlock_on_stream) {
  struct harness_broker b;
  cuda_start(&b, "256m", "[broker]\ncompaction = off\n");
  gmb_client *c = harness_connect_ok(&b, "st");
  /* Two small segments with one block each after the frees: a compaction
   * moves one block into the other's segment, unless both are locked. */
  gmb_id id[4];
  for (int i = 0; i < 4; i++) {
    id[i] = 0;
    ck_assert_int_eq(gmb_alloc(c, MIB, GMB_MOVABLE, &id[i]), 0);
    ck_assert_int_eq(cuda_fill(c, id[i], MIB, 40 + (uint64_t)i), 0);
  }
  ck_assert_int_eq(gmb_free(c, id[0]), 0);
  ck_assert_int_eq(gmb_free(c, id[3]), 0);
  /* Not locked, not ours: refused. */
  ck_assert_int_eq(gmb_unlock_on_stream(c, id[1], NULL), GMB_E_INVAL);
  ck_assert_int_eq(gmb_unlock_on_stream(c, id[0], NULL), GMB_E_NOENT);

  struct gmb_cudrv *drv = cuda_driver();
  ck_assert_ptr_nonnull(drv);
  atomic_store(&stream_gate, 0);
  ck_assert_int_eq(drv->cuLaunchHostFunc(NULL, stream_blocker, NULL),
                   GMB_CU_SUCCESS);
  void *p1 = NULL, *p2 = NULL;
  ck_assert_int_eq(gmb_lock(c, id[1], &p1), 0);
  ck_assert_int_eq(gmb_lock(c, id[2], &p2), 0);
  ck_assert_int_eq(gmb_unlock_on_stream(c, id[1], NULL), 0);
  ck_assert_int_eq(gmb_unlock_on_stream(c, id[2], NULL), 0);
  ck_assert_uint_eq(gmb__cuda_pending(), 2);

  /* The stream has not reached the releases: both still locked. */
  struct wire_compact_stats cs = {0};
  void *adm = harness_raw_open(b.admin_endpoint);
  ck_assert_int_eq(harness_admin_compact(adm, "st", &cs), 0);
  ck_assert_uint_eq(cs.moves, 0);
  ck_assert_uint_ge(cs.skipped_locked, 1);
  ck_assert_uint_eq(gmb__cuda_pending(), 2);

  atomic_store(&stream_gate, 1);
  ck_assert_int_eq(drv->cuStreamSynchronize(NULL), GMB_CU_SUCCESS);
  ck_assert_uint_eq(gmb__cuda_pending(), 0);
  ck_assert_int_eq(harness_admin_compact(adm, "st", &cs), 0);
  ck_assert_uint_ge(cs.moves, 1);
  ck_assert_uint_eq(cs.segments_released, 1);
  harness_raw_close(adm);
  void *q1 = NULL, *q2 = NULL;
  ck_assert_int_eq(cuda_check(c, id[1], MIB, 41, &q1), 0);
  ck_assert_int_eq(cuda_check(c, id[2], MIB, 42, &q2), 0);
  ck_assert_msg(q1 != p1 || q2 != p2, "nothing moved");
  /* The holds are all given back: one more unlock is refused. */
  ck_assert_int_eq(gmb_unlock(c, id[1]), GMB_E_INVAL);
  ck_assert_int_eq(gmb_unlock(c, id[2]), GMB_E_INVAL);
  gmb_disconnect(c);
  cuda_wait_settled(&b);
  cuda_finish(&b);
}
END_TEST

/* --- cuda_evicted_process_keeps_its_bytes -------------------------------- */

struct evict_kid {
  char endpoint[128];
  int up_w, go_r;
};

/* The victim: writes its memory, keeps the device pointer, is evicted
 * meanwhile, and then reads its memory through that pointer: its own
 * bytes, whatever the broker gave to others since. */
static int evict_child(void *arg) {
  struct evict_kid *k = arg;
  gmb_client *c = NULL;
  CHILD_CHECK(gmb_connect(k->endpoint, "victim", &c) == 0, 10, "connect: %s",
              gmb_last_error(NULL));
  gmb_id id = 0;
  CHILD_CHECK(gmb_alloc(c, 32 * MIB, 0, &id) == 0, 11, "alloc: %s",
              gmb_last_error(c));
  CHILD_CHECK(cuda_fill(c, id, 32 * MIB, 11) == 0, 12, "fill");
  void *p = NULL;
  CHILD_CHECK(gmb_lock(c, id, &p) == 0, 13, "lock: %s", gmb_last_error(c));
  CHILD_CHECK(harness_pipe_send(k->up_w, 'a') == 0, 14, "pipe");
  CHILD_CHECK(harness_pipe_wait(k->go_r, HARNESS_WAIT_MS) == 'g', 15,
              "no go");
  struct gmb_cudrv *d = cuda_driver();
  uint8_t *buf = malloc(32 * MIB);
  CHILD_CHECK(d && buf, 16, "no driver or memory");
  gmb_cu_result r = d->cuMemcpyDtoH(buf, (gmb_cu_ptr)(uintptr_t)p, 32 * MIB);
  CHILD_CHECK(r == GMB_CU_SUCCESS, 17, "cuMemcpyDtoH: %d", r);
  long bad = harness_pattern_check(buf, 32 * MIB, 11);
  CHILD_CHECK(bad < 0, 18, "byte %ld of its memory changed under it", bad);
  free(buf);
  gmb_stats st;
  CHILD_CHECK(gmb_tenant_stats(c, &st) == GMB_E_EVICTED, 19,
              "not told it was evicted: %s", gmb_last_error(c));
  gmb_disconnect(c);
  return 0;
}

START_TEST(cuda_evicted_process_keeps_its_bytes) {
  struct harness_broker b;
  cuda_start(&b, "256m", NULL);
  int up[2], go[2];
  ck_assert_int_eq(pipe(up), 0);
  ck_assert_int_eq(pipe(go), 0);
  struct evict_kid k = {.up_w = up[1], .go_r = go[0]};
  snprintf(k.endpoint, sizeof k.endpoint, "%s", b.endpoint);
  pid_t kid = harness_fork(evict_child, &k);
  cuda_step(up[0], 'a', kid);
  ck_assert_int_eq(harness_ctl(&b, out, sizeof out, "evict", "victim", NULL),
                   0);
  /* The broker released the victim's segment; another tenant takes memory
   * and writes every byte of it. */
  gmb_client *c = harness_connect_ok(&b, "next");
  gmb_id id = harness_alloc_ok(c, 64 * MIB);
  ck_assert_int_eq(cuda_fill(c, id, 64 * MIB, 99), 0);
  ck_assert_int_eq(harness_pipe_send(go[1], 'g'), 0);
  ck_assert_msg(harness_wait(kid) == 0, "the evicted child failed (its "
                "stderr says why)");
  ck_assert_int_eq(gmb_free(c, id), 0);
  gmb_disconnect(c);
  close(up[0]);
  close(up[1]);
  close(go[0]);
  close(go[1]);
  cuda_wait_settled(&b);
  cuda_finish(&b);
}
END_TEST

/* --- cuda_stop_waits_for_clients ----------------------------------------- */

struct stop_kid {
  char endpoint[128];
  int up_w, go_r;
};

/* Holds 8 MiB (mapped) until told to go, then disconnects (unmaps, Bye). */
static int stop_child(void *arg) {
  struct stop_kid *k = arg;
  gmb_client *c = NULL;
  CHILD_CHECK(gmb_connect(k->endpoint, "stay", &c) == 0, 10, "connect: %s",
              gmb_last_error(NULL));
  gmb_id id = 0;
  CHILD_CHECK(gmb_alloc(c, 8 * MIB, 0, &id) == 0, 11, "alloc: %s",
              gmb_last_error(c));
  CHILD_CHECK(cuda_fill(c, id, 8 * MIB, 5) == 0, 12, "fill");
  CHILD_CHECK(harness_pipe_send(k->up_w, 'a') == 0, 13, "pipe");
  if (harness_pipe_wait(k->go_r, HARNESS_WAIT_MS) == 'g') gmb_disconnect(c);
  else for (;;) pause(); /* killed with the test */
  return 0;
}

struct log_has {
  const struct harness_broker *b;
  const char *what;
};

static int log_has(void *arg) {
  struct log_has *h = arg;
  char *log = harness_broker_log(h->b);
  int yes = strstr(log, h->what) != NULL;
  free(log);
  return yes;
}

/* At SIGTERM the broker waits (shutdown_grace_ms) for the sessions that
 * still map its segments, serving their goodbyes meanwhile, and refuses
 * new sessions; a second SIGTERM ends the wait, and it exits 0. */
START_TEST(cuda_stop_waits_for_clients) {
  struct harness_broker b;
  cuda_start(&b, "256m", "[broker]\nshutdown_grace_ms = 60000\n");
  struct stop_kid k[2];
  int up[2], go[2][2];
  ck_assert_int_eq(pipe(up), 0);
  pid_t kids[2];
  for (int i = 0; i < 2; i++) {
    ck_assert_int_eq(pipe(go[i]), 0);
    snprintf(k[i].endpoint, sizeof k[i].endpoint, "%s", b.endpoint);
    k[i].up_w = up[1];
    k[i].go_r = go[i][0];
    kids[i] = harness_fork(stop_child, &k[i]);
    cuda_step(up[0], 'a', kids[i]);
  }
  ck_assert_int_eq(kill(b.pid, SIGTERM), 0);
  struct log_has h = {&b, "waiting up to 60000 ms for 2 sessions"};
  ck_assert_msg(harness_poll_until(log_has, &h, HARNESS_WAIT_MS),
                "the broker did not wait for its sessions");
  /* Nothing new while it stops. */
  gmb_client *late = NULL;
  ck_assert_int_ne(gmb_connect(b.endpoint, "late", &late), 0);
  /* One client leaves; its goodbye is served during the wait. */
  ck_assert_int_eq(harness_pipe_send(go[0][1], 'g'), 0);
  ck_assert_int_eq(harness_wait(kids[0]), 0);
  h.what = "said goodbye";
  ck_assert_msg(harness_poll_until(log_has, &h, HARNESS_WAIT_MS),
                "the goodbye was not served while stopping");
  ck_assert(harness_broker_alive(&b)); /* still waiting for the other */
  /* The second SIGTERM (harness_broker_stop's) ends the wait. */
  harness_broker_stop_keep_dir(&b);
  h.what = "1 sessions still hold segments";
  ck_assert_msg(log_has(&h), "no word of the session left behind");
  harness_broker_rm_dir(&b);
  /* It kept its mapping past the broker; once it unmaps, all is back. */
  ck_assert_int_eq(harness_pipe_send(go[1][1], 'g'), 0);
  ck_assert_int_eq(harness_wait(kids[1]), 0);
  cuda_device_done();
  for (int i = 0; i < 2; i++) {
    close(go[i][0]);
    close(go[i][1]);
  }
  close(up[0]);
  close(up[1]);
}
END_TEST

/* The examples write and read their allocations with gmb_write/gmb_read:
 * on a GPU (here the fake, where a device address faults from the CPU)
 * job --touch and frag must run as on the host device. */
START_TEST(cuda_examples_touch_device_memory) {
  struct harness_broker b;
  cuda_start(&b, "64m",
             "[broker]\ncompaction = auto\n[tenant:demo]\nquota = 1GiB\n");
  setenv("GMB_ENDPOINT", b.endpoint, 1);
  int rc = harness_tool("examples/job", out, sizeof out, "--tenant", "demo",
                        "--touch", "4MiB", "100000", NULL);
  ck_assert_msg(rc == 0, "job --touch: %d\n%s", rc, out);
  ck_assert_int_eq((int)harness_count(out, "(touched)"), 2);
  rc = harness_tool("examples/frag", out, sizeof out, "--tenant", "demo",
                    "--fill", "40MiB", "--big", "16MiB", NULL);
  ck_assert_msg(rc == 0, "frag: %d\n%s", rc, out);
  ck_assert_msg(strstr(out, "all bytes intact") != NULL, "%s", out);
  unsetenv("GMB_ENDPOINT");
  cuda_wait_settled(&b);
  cuda_finish(&b);
}
END_TEST

/* gmb_write/gmb_read copy through the driver, inside the allocation only,
 * and gmb_device_get names the GPU by its UUID and this process's
 * ordinal.  In a child: the test process must not start CUDA. */
static int rw_child(void *arg) {
  struct harness_broker *b = arg;
  gmb_client *c = NULL;
  if (gmb_connect(b->endpoint, "rw", &c) != 0) return 2;
  gmb_device_info di;
  if (gmb_device_get(c, &di) != 0 || strcmp(di.kind, "cuda") != 0 ||
      di.ordinal != 0 ||
      strcmp(di.uuid, "GPU-46414b45-4355-4441-0000-000000000000") != 0 ||
      strcmp(di.pci_bus_id, "0000:10:00.0") != 0)
    return 3;
  gmb_id id;
  if (gmb_alloc(c, 3 * KIB, GMB_MOVABLE, &id) != 0) return 4;
  char in[1024], back[1024];
  for (size_t i = 0; i < sizeof in; i++) in[i] = (char)(i * 7 + 1);
  if (gmb_write(c, id, 2 * KIB, in, sizeof in) != 0) return 5;
  memset(back, 0, sizeof back);
  if (gmb_read(c, id, 2 * KIB, back, sizeof back) != 0) return 6;
  if (memcmp(in, back, sizeof in) != 0) return 7;
  /* One byte past the end: refused, nothing copied. */
  if (gmb_write(c, id, 2 * KIB + 1, in, sizeof in) != GMB_E_INVAL) return 8;
  void *p;
  if (gmb_lock(c, id, &p) != 0) return 9;
  /* Unlocked again by the copies: the lock count is the caller's. */
  if (gmb_unlock(c, id) != 0 || gmb_unlock(c, id) != GMB_E_INVAL) return 10;
  if (gmb_free(c, id) != 0) return 11;
  gmb_disconnect(c);
  return 0;
}

START_TEST(cuda_read_write_copy) {
  struct harness_broker b;
  cuda_start(&b, "64m", "[tenant:rw]\nquota = 1GiB\n");
  pid_t pid = harness_fork(rw_child, &b);
  ck_assert_int_eq(harness_wait(pid), 0);
  cuda_wait_settled(&b);
  cuda_finish(&b);
}
END_TEST

/* A large allocation on a GPU: its pages and its tail's small segment are
 * imported side by side (two cuMemMap calls in one reservation), and a
 * copy across the seam reads back what was written, next to small
 * allocations that share the tail's segment. */
static int tail_child(void *arg) {
  struct harness_broker *b = arg;
  gmb_client *c = NULL;
  if (gmb_connect(b->endpoint, "rw", &c) != 0) return 2;
  const size_t small = 64 * KIB, big = 5 * MIB;
  gmb_id s, l;
  if (gmb_alloc(c, small, 0, &s) != 0 || gmb_alloc(c, big, 0, &l) != 0) {
    fprintf(stderr, "%s\n", gmb_last_error(c));
    return 3;
  }
  gmb_stats st;
  /* the small segment, whose end holds the tail, and 4 MiB of pages */
  if (gmb_tenant_stats(c, &st) != 0 || st.segments != 6 * MIB) return 4;
  unsigned char *in = malloc(big), *back = malloc(big);
  if (in == NULL || back == NULL) return 5;
  for (size_t i = 0; i < big; i++) in[i] = (unsigned char)(i * 13 + 5);
  unsigned char mark[64 * KIB];
  memset(mark, 0x5a, sizeof mark);
  if (gmb_write(c, s, 0, mark, small) != 0 || gmb_write(c, l, 0, in, big) != 0)
    return 6;
  memset(back, 0, big);
  if (gmb_read(c, l, 0, back, big) != 0 || memcmp(in, back, big) != 0)
    return 7;
  /* A copy across the seam between the pages and the tail. */
  if (gmb_read(c, l, 4 * MIB - 100, back, 200) != 0 ||
      memcmp(in + 4 * MIB - 100, back, 200) != 0)
    return 8;
  memset(back, 0, small);
  if (gmb_read(c, s, 0, back, small) != 0 || memcmp(mark, back, small) != 0)
    return 9;
  if (gmb_free(c, l) != 0) return 10;
  memset(back, 0, small);
  if (gmb_read(c, s, 0, back, small) != 0 || memcmp(mark, back, small) != 0)
    return 11;
  free(in);
  free(back);
  gmb_disconnect(c);
  return 0;
}

START_TEST(cuda_large_tail_shares_a_page) {
  struct harness_broker b;
  cuda_start(&b, "64m", "[tenant:rw]\nquota = 1GiB\n");
  pid_t pid = harness_fork(tail_child, &b);
  ck_assert_int_eq(harness_wait(pid), 0);
  cuda_wait_settled(&b);
  cuda_finish(&b);
}
END_TEST

/* Containers renumber GPUs: with physical GPUs 0 and 1, a broker on its
 * cuda:0 (physical 0) and a client that sees them as "1,0" imports on its
 * ordinal 1; a client that sees only physical 1 is refused, naming the
 * broker's GPU and the ones it sees. */
static int visible_child(void *arg) {
  struct harness_broker *b = arg;
  setenv("FAKECUDA_VISIBLE", "1,0", 1);
  gmb_client *c = NULL;
  if (gmb_connect(b->endpoint, "rw", &c) != 0) {
    fprintf(stderr, "%s\n", gmb_last_error(NULL));
    return 2;
  }
  gmb_device_info di;
  if (gmb_device_get(c, &di) != 0 || di.ordinal != 1) return 3;
  gmb_id id;
  char in[512] = "renumbered", back[512] = "";
  if (gmb_alloc(c, 512, 0, &id) != 0 || gmb_write(c, id, 0, in, 512) != 0 ||
      gmb_read(c, id, 0, back, 512) != 0 || strcmp(back, in) != 0)
    return 4;
  gmb_disconnect(c);
  return 0;
}

static int invisible_child(void *arg) {
  struct harness_broker *b = arg;
  setenv("FAKECUDA_VISIBLE", "1", 1);
  gmb_client *c = NULL;
  int rc = gmb_connect(b->endpoint, "rw", &c);
  const char *why = gmb_last_error(NULL);
  if (rc != GMB_E_DEVICE) return 2;
  if (!strstr(why, "GPU-46414b45-4355-4441-0000-000000000000 is not visible") ||
      !strstr(why, "0=GPU-46414b45-4355-4441-0000-000000000001")) {
    fprintf(stderr, "%s\n", why);
    return 3;
  }
  return 0;
}

START_TEST(cuda_client_finds_gpu_by_uuid) {
  struct harness_broker b;
  setenv("FAKECUDA_DEVICES", "2", 1);
  cuda_start(&b, "64m", "[tenant:rw]\nquota = 1GiB\n");
  setenv("FAKECUDA_DEVICES", "2", 1); /* use_fake unset it */
  ck_assert_int_eq(harness_wait(harness_fork(visible_child, &b)), 0);
  ck_assert_int_eq(harness_wait(harness_fork(invisible_child, &b)), 0);
  cuda_wait_settled(&b);
  cuda_finish(&b);
  unsetenv("FAKECUDA_DEVICES");
}
END_TEST

/* EXCLUSIVE_PROCESS would lock every client out: the broker refuses to
 * start, naming the mode. */
START_TEST(exclusive_process_refused_at_start) {
  use_fake();
  setenv("FAKECUDA_COMPUTE_MODE", "3", 1);
  int rc = harness_tool("gmb-broker", out, sizeof out, "--run-dir",
                        "/nonexistent-run-dir", "--device", "cuda:0", NULL);
  unsetenv("FAKECUDA_COMPUTE_MODE");
  ck_assert_int_ne(rc, 0);
  ck_assert_msg(strstr(out, "EXCLUSIVE_PROCESS") != NULL, "%s", out);
}
END_TEST

/* --- cuda_pause_resume_keeps_bytes --------------------------------------- */

/* A client on the stand-in GPU: a tag's block (device memory, written with
 * cuMemcpyHtoD) is paused (offloaded with cuMemcpyDtoH into pinned host
 * memory, its pages unmapped from the reserved range and given back) and
 * resumed at the same address, where cuMemcpyDtoH reads its bytes back;
 * a gmb_alloc allocation of the tag too (read back with gmb_read).
 * With `pinned_limit` the stand-in refuses to pin that much, and the
 * offload goes to pageable memory instead, bytes intact. */
struct pause_arg {
  char endpoint[128];
  const char *pinned_limit;
};

static int pause_child(void *arg) {
  const struct pause_arg *pa = arg;
  const char *endpoint = pa->endpoint;
  if (pa->pinned_limit) setenv("FAKECUDA_PINNED_LIMIT", pa->pinned_limit, 1);
  gmb_client *c = NULL;
  CHILD_CHECK(gmb_connect(endpoint, "sleepy", &c) == 0, 10, "connect: %s",
              gmb_last_error(NULL));
  CHILD_CHECK(gmb_cache_tag(c, "weights") == 0, 11, "tag");
  void *p = NULL;
  const size_t n = 5 * MIB + 4096;
  CHILD_CHECK(gmb_malloc_async(c, n, NULL, &p) == 0, 12, "malloc_async: %s",
              gmb_last_error(c));
  struct gmb_cudrv *d = cuda_driver();
  uint8_t *buf = malloc(n);
  CHILD_CHECK(d && buf, 13, "no driver or memory");
  harness_pattern_fill(buf, n, 77);
  CHILD_CHECK(d->cuMemcpyHtoD((gmb_cu_ptr)(uintptr_t)p, buf, n) ==
                      GMB_CU_SUCCESS &&
                  d->cuStreamSynchronize(NULL) == GMB_CU_SUCCESS,
              14, "cuMemcpyHtoD");
  /* A gmb_alloc allocation under the tag too: its copy is pinned alike. */
  gmb_id w;
  CHILD_CHECK(gmb_alloc(c, MIB, 0, &w) == 0 && gmb_write(c, w, 0, buf, MIB) == 0,
              26, "tagged gmb_alloc: %s", gmb_last_error(c));
  CHILD_CHECK(gmb_pause(c, "weights", GMB_PAUSE_OFFLOAD) == 0, 15,
              "pause: %s", gmb_last_error(c));
  gmb_stats st;
  CHILD_CHECK(gmb_tenant_stats(c, &st) == 0 && st.used == 0, 16,
              "the tenant holds %llu bytes while paused",
              (unsigned long long)st.used);
  gmb_cache_stats cs;
  CHILD_CHECK(gmb_cache_stats_get(c, &cs) == 0 && cs.host == 7 * MIB, 17,
              "host bytes %llu", (unsigned long long)cs.host);
  struct gmb_hostbuf_stats hs;
  gmb__hostbuf_stats(&hs);
  if (pa->pinned_limit)
    CHILD_CHECK(hs.refused >= 1 && hs.pinned == 0 && hs.pageable >= 7 * MIB,
                25, "pinning past the limit: refused %llu, pinned %llu, "
                "pageable %llu", (unsigned long long)hs.refused,
                (unsigned long long)hs.pinned,
                (unsigned long long)hs.pageable);
  else
    CHILD_CHECK(hs.refused == 0 && hs.pinned >= 7 * MIB && hs.pageable == 0,
                25, "the offload's copy is not pinned: pinned %llu, "
                "pageable %llu", (unsigned long long)hs.pinned,
                (unsigned long long)hs.pageable);
  CHILD_CHECK(gmb_resume(c, "weights") == 0, 18, "resume: %s",
              gmb_last_error(c));
  memset(buf, 0, n);
  CHILD_CHECK(d->cuMemcpyDtoH(buf, (gmb_cu_ptr)(uintptr_t)p, n) ==
                  GMB_CU_SUCCESS, 19, "cuMemcpyDtoH");
  long bad = harness_pattern_check(buf, n, 77);
  CHILD_CHECK(bad < 0, 20, "byte %ld changed across the pause", bad);
  memset(buf, 0, MIB);
  CHILD_CHECK(gmb_read(c, w, 0, buf, MIB) == 0, 27, "read: %s",
              gmb_last_error(c));
  bad = harness_pattern_check(buf, MIB, 77);
  CHILD_CHECK(bad < 0, 28, "allocation byte %ld changed across the pause", bad);
  CHILD_CHECK(gmb_free(c, w) == 0, 29, "free: %s", gmb_last_error(c));
  CHILD_CHECK(gmb_tenant_stats(c, &st) == 0 && st.used == 6 * MIB, 21,
              "the tenant holds %llu bytes after the resume",
              (unsigned long long)st.used);
  /* A discard gives the pages back with no copy. */
  CHILD_CHECK(gmb_pause(c, "weights", GMB_PAUSE_DISCARD) == 0, 22,
              "discard: %s", gmb_last_error(c));
  CHILD_CHECK(gmb_resume(c, "weights") == 0, 23, "resume: %s",
              gmb_last_error(c));
  CHILD_CHECK(gmb_free_async(c, p, NULL) == 0, 24, "free");
  free(buf);
  gmb_disconnect(c);
  return 0;
}

static void pause_run(const char *pinned_limit) {
  struct harness_broker b;
  cuda_start(&b, "64m", NULL);
  static struct pause_arg pa;
  snprintf(pa.endpoint, sizeof pa.endpoint, "%s", b.endpoint);
  pa.pinned_limit = pinned_limit;
  pid_t kid = harness_fork(pause_child, &pa);
  ck_assert_msg(harness_wait(kid) == 0, "the pausing child failed (its "
                "stderr says why)");
  cuda_wait_settled(&b);
  cuda_finish(&b);
}

START_TEST(cuda_pause_resume_keeps_bytes) { pause_run(NULL); }
END_TEST

START_TEST(cuda_pause_pinning_refused_falls_back) { pause_run("512k"); }
END_TEST

/* Across processes on the stand-in GPU: an idle job with a sleep policy
 * holds 40 MiB of weights (written with cuMemcpyHtoD); another job's
 * request that needs them is served once the broker asked the idle job to
 * pause, which its library thread does (its own CUDA context: the sync
 * and the copies run on that thread); the idle job's next allocation
 * resumes the tag by itself, waiting until the other job freed, and every
 * byte is back (cuMemcpyDtoH). */
struct ask_pipes {
  const char *endpoint;
  int in, out;
};

/* The idle job's start: connected as "idle", its policy offering tag
 * "weights", which is current.  0 or the child's exit code. */
static int ask_idle_start(const struct ask_pipes *a, gmb_client **c) {
  CHILD_CHECK(gmb_connect(a->endpoint, "idle", c) == 0, 10, "connect: %s",
              gmb_last_error(NULL));
  CHILD_CHECK(gmb_sleep_policy_set(*c, "idle=0,weights") == 0, 11, "policy");
  CHILD_CHECK(gmb_cache_tag(*c, "weights") == 0, 12, "tag");
  return 0;
}

static int ask_idle_child(void *arg) {
  struct ask_pipes *a = arg;
  gmb_client *c = NULL;
  int start = ask_idle_start(a, &c);
  if (start) return start;
  const size_t n = 40 * MIB;
  void *p = NULL;
  CHILD_CHECK(gmb_malloc_async(c, n, NULL, &p) == 0, 13, "malloc_async: %s",
              gmb_last_error(c));
  struct gmb_cudrv *d = cuda_driver();
  uint8_t *buf = malloc(n);
  CHILD_CHECK(d && buf, 14, "no driver or memory");
  harness_pattern_fill(buf, n, 91);
  CHILD_CHECK(d->cuMemcpyHtoD((gmb_cu_ptr)(uintptr_t)p, buf, n) ==
                      GMB_CU_SUCCESS &&
                  d->cuStreamSynchronize(NULL) == GMB_CU_SUCCESS,
              15, "cuMemcpyHtoD");
  harness_pipe_send(a->out, 'r');
  CHILD_CHECK(harness_pipe_wait(a->in, 60000) == 'a', 16, "no 'a'");
  void *x = NULL;
  CHILD_CHECK(gmb_malloc_async(c, 512, NULL, &x) == 0, 17,
              "the allocation that resumes: %s", gmb_last_error(c));
  memset(buf, 0, n);
  CHILD_CHECK(d->cuMemcpyDtoH(buf, (gmb_cu_ptr)(uintptr_t)p, n) ==
                  GMB_CU_SUCCESS, 18, "cuMemcpyDtoH");
  long bad = harness_pattern_check(buf, n, 91);
  CHILD_CHECK(bad < 0, 19, "byte %ld changed across the broker's pause", bad);
  CHILD_CHECK(gmb_free_async(c, x, NULL) == 0 &&
                  gmb_free_async(c, p, NULL) == 0, 20, "free");
  free(buf);
  harness_pipe_send(a->out, 'k');
  gmb_disconnect(c);
  return 0;
}

static int ask_busy_child(void *arg) {
  struct ask_pipes *a = arg;
  gmb_client *c = NULL;
  CHILD_CHECK(gmb_connect(a->endpoint, "busy", &c) == 0, 30, "connect: %s",
              gmb_last_error(NULL));
  gmb_id id;
  int rc = gmb_alloc(c, 40 * MIB, 0, &id);
  if (rc) fprintf(stderr, "busy: %s\n", gmb_last_error(c));
  harness_pipe_send(a->out, rc ? 'n' : 'h');
  CHILD_CHECK(harness_pipe_wait(a->in, 60000) == 'f', 31, "no 'f'");
  if (rc == 0) CHILD_CHECK(gmb_free(c, id) == 0, 32, "free");
  gmb_disconnect(c);
  return rc ? 33 : 0;
}

static int ask_offered(void *arg) {
  struct harness_broker *b = arg;
  struct wire_reply rep;
  if (harness_admin_status(b, &rep)) return 0;
  int seen = 0;
  for (size_t i = 0; i < rep.u.admin_status.n_sessions; i++)
    seen |= strcmp(rep.u.admin_status.session_rows[i].tenant, "idle") == 0 &&
            rep.u.admin_status.session_rows[i].sleep_pausable >= 40 * MIB;
  gmb__wire_reply_clear(&rep);
  return seen;
}

/* An idle job (`idle_child`) offers 40 MiB, the busy job's request is
 * served once the broker asked it to pause, and its next touch of the tag
 * resumes it with every byte back ('k'). */
static void ask_idle_run(int (*idle_child)(void *)) {
  struct harness_broker b;
  cuda_start(&b, "64m", "[tenant:idle]\npriority = 0\n"
                        "[tenant:busy]\npriority = 10\n");
  int ti[2], fi[2], tb[2], fb[2];
  ck_assert(pipe(ti) == 0 && pipe(fi) == 0 && pipe(tb) == 0 && pipe(fb) == 0);
  struct ask_pipes idle = {b.endpoint, ti[0], fi[1]};
  struct ask_pipes busy = {b.endpoint, tb[0], fb[1]};
  pid_t ki = harness_fork(idle_child, &idle);
  ck_assert_int_eq(harness_pipe_wait(fi[0], HARNESS_WAIT_MS), 'r');
  ck_assert_msg(harness_poll_until(ask_offered, &b, HARNESS_WAIT_MS),
                "the idle job never offered its weights");
  pid_t kb = harness_fork(ask_busy_child, &busy);
  ck_assert_int_eq(harness_pipe_wait(fb[0], HARNESS_WAIT_MS), 'h');
  struct wire_tenant_row r;
  ck_assert_int_eq(harness_tenant_row(&b, "idle", &r), 0);
  ck_assert_uint_eq(r.paused_tags, 1);
  ck_assert_uint_eq(r.sleep_asks, 1);
  ck_assert_uint_ge(r.host_bytes, 40 * MIB);
  harness_pipe_send(ti[1], 'a');
  harness_sleep_ms(50); /* pace only: the resume waits for room either way */
  harness_pipe_send(tb[1], 'f');
  ck_assert_int_eq(harness_pipe_wait(fi[0], HARNESS_WAIT_MS), 'k');
  ck_assert_int_eq(harness_wait(kb), 0);
  ck_assert_int_eq(harness_wait(ki), 0);
  ck_assert_int_eq(harness_tenant_row(&b, "idle", &r), 0);
  ck_assert_uint_eq(r.paused_tags, 0);
  ck_assert_uint_eq(r.resumes, 1);
  int *fds[] = {ti, fi, tb, fb};
  for (int i = 0; i < 4; i++) {
    close(fds[i][0]);
    close(fds[i][1]);
  }
  cuda_wait_settled(&b);
  cuda_finish(&b);
}

START_TEST(cuda_broker_asks_idle_job_to_pause) {
  ask_idle_run(ask_idle_child);
}
END_TEST

/* The same with the weights in gmb_alloc allocations under the tag (32
 * MiB pinned, 8 MiB movable), written with cuMemcpyHtoD through gmb_lock's
 * pointers: the library thread copies them out (cuMemcpyDtoH on its own
 * context) and frees them; the job's gmb_lock resumes the tag under the
 * same ids, and cuMemcpyDtoH reads every byte back. */
static int ask_alloc_child(void *arg) {
  struct ask_pipes *a = arg;
  gmb_client *c = NULL;
  int start = ask_idle_start(a, &c);
  if (start) return start;
  const size_t n[2] = {32 * MIB, 8 * MIB};
  gmb_id id[2];
  struct gmb_cudrv *d = cuda_driver();
  uint8_t *buf = malloc(n[0]);
  CHILD_CHECK(d && buf, 13, "no driver or memory");
  for (int i = 0; i < 2; i++) {
    void *p;
    CHILD_CHECK(gmb_alloc(c, n[i], i ? GMB_MOVABLE : 0, &id[i]) == 0 &&
                    gmb_lock(c, id[i], &p) == 0, 14, "alloc: %s",
                gmb_last_error(c));
    harness_pattern_fill(buf, n[i], 60 + (uint64_t)i);
    CHILD_CHECK(d->cuMemcpyHtoD((gmb_cu_ptr)(uintptr_t)p, buf, n[i]) ==
                        GMB_CU_SUCCESS &&
                    d->cuStreamSynchronize(NULL) == GMB_CU_SUCCESS &&
                    gmb_unlock(c, id[i]) == 0,
                15,
                "cuMemcpyHtoD");
  }
  CHILD_CHECK(gmb_cache_tag(c, NULL) == 0, 16, "untag");
  harness_pipe_send(a->out, 'r');
  CHILD_CHECK(harness_pipe_wait(a->in, 60000) == 'a', 17, "no 'a'");
  for (int i = 0; i < 2; i++) {
    void *p;
    CHILD_CHECK(gmb_lock(c, id[i], &p) == 0, 18, "the lock that resumes: %s",
                gmb_last_error(c));
    memset(buf, 0, n[i]);
    CHILD_CHECK(d->cuMemcpyDtoH(buf, (gmb_cu_ptr)(uintptr_t)p, n[i]) ==
                    GMB_CU_SUCCESS && gmb_unlock(c, id[i]) == 0, 19,
                "cuMemcpyDtoH");
    long bad = harness_pattern_check(buf, n[i], 60 + (uint64_t)i);
    CHILD_CHECK(bad < 0, 20, "byte %ld of allocation %d changed across the "
                "broker's pause", bad, i);
  }
  CHILD_CHECK(gmb_free(c, id[0]) == 0 && gmb_free(c, id[1]) == 0, 21, "free");
  free(buf);
  harness_pipe_send(a->out, 'k');
  gmb_disconnect(c);
  return 0;
}

START_TEST(cuda_broker_asks_job_of_tagged_allocations) {
  ask_idle_run(ask_alloc_child);
}
END_TEST

/* The broker offloads movable allocations itself on the stand-in GPU: an
 * operator's pause copies them to page-locked host memory
 * (cuMemHostAlloc, cuMemcpyDtoH) and frees their device ranges; the job's
 * gmb_lock of each brings it back (cuMemcpyHtoD) and every byte is there
 * (checked through device copies). */
#define OFFL_N 4

static int offload_child(void *arg) {
  struct ask_pipes *a = arg;
  gmb_client *c = NULL;
  CHILD_CHECK(gmb_connect(a->endpoint, "mov", &c) == 0, 10, "connect: %s",
              gmb_last_error(NULL));
  gmb_id id[OFFL_N];
  for (int i = 0; i < OFFL_N; i++) {
    CHILD_CHECK(gmb_alloc(c, MIB, GMB_MOVABLE, &id[i]) == 0, 11, "alloc: %s",
                gmb_last_error(c));
    CHILD_CHECK(cuda_fill(c, id[i], MIB, 40 + (uint64_t)i) == 0, 12, "fill");
  }
  harness_pipe_send(a->out, 'r');
  CHILD_CHECK(harness_pipe_wait(a->in, 60000) == 'l', 13, "no 'l'");
  for (int i = 0; i < OFFL_N; i++)
    CHILD_CHECK(cuda_check(c, id[i], MIB, 40 + (uint64_t)i, NULL) == 0, 14,
                "allocation %d after the offload: %s", i, gmb_last_error(c));
  harness_pipe_send(a->out, 'k');
  for (int i = 0; i < OFFL_N; i++)
    CHILD_CHECK(gmb_free(c, id[i]) == 0, 15, "free");
  gmb_disconnect(c);
  return 0;
}

START_TEST(cuda_offload_movable_keeps_bytes) {
  struct harness_broker b;
  cuda_start(&b, "64m", NULL);
  int to[2], from[2];
  ck_assert(pipe(to) == 0 && pipe(from) == 0);
  struct ask_pipes ap = {b.endpoint, to[0], from[1]};
  pid_t kid = harness_fork(offload_child, &ap);
  cuda_step(from[0], 'r', kid);
  char said[4096];
  ck_assert_int_eq(harness_ctl(&b, said, sizeof said, "pause", "mov", NULL),
                   0);
  ck_assert_msg(strstr(said, "4 movable allocations") != NULL, "%s", said);
  struct wire_tenant_row r;
  ck_assert_int_eq(harness_tenant_row(&b, "mov", &r), 0);
  ck_assert_uint_eq(r.host_bytes, OFFL_N * MIB);
  ck_assert_uint_eq(r.used, 0);
  harness_pipe_send(to[1], 'l');
  cuda_step(from[0], 'k', kid);
  ck_assert_int_eq(harness_tenant_row(&b, "mov", &r), 0);
  ck_assert_uint_eq(r.host_bytes, 0); /* its frees may have come too */
  ck_assert_int_eq(harness_wait(kid), 0);
  for (int i = 0; i < 2; i++) {
    close(to[i]);
    close(from[i]);
  }
  cuda_wait_settled(&b);
  cuda_finish(&b);
}
END_TEST

int main(void) {
  return harness_main(HARNESS_SUITE(
      "cuda", "broker", 30, no_driver_exits_with_one_line,
      no_gpu_exits_with_one_line, auto_without_driver_says_host,
      cuda0_on_fake_driver_status, auto_picks_fake_gpu,
      cuda_clients_share_memory, cuda_compaction_moves_bytes,
      cuda_retirement_waits_for_close, cuda_unlock_on_stream,
      cuda_evicted_process_keeps_its_bytes, cuda_stop_waits_for_clients,
      cuda_examples_touch_device_memory, cuda_read_write_copy,
      cuda_large_tail_shares_a_page, cuda_client_finds_gpu_by_uuid, exclusive_process_refused_at_start,
      cuda_pause_resume_keeps_bytes, cuda_pause_pinning_refused_falls_back,
      cuda_broker_asks_idle_job_to_pause,
      cuda_broker_asks_job_of_tagged_allocations,
      cuda_offload_movable_keeps_bytes));
}
