/*
 * test_torch.c - libgmb-torch.so driven the way PyTorch's
 * CUDAPluggableAllocator drives it: dlopen the library, look up
 * gmb_torch_alloc / gmb_torch_free / gmb_torch_last_error, allocate and
 * free with sizes, devices and streams, against a real broker on the host
 * device.
 *
 * Each scenario runs in a child process (harness_fork): the library keeps
 * one session per device, made at its first allocation, so a fresh
 * process per scenario is what a fresh PyTorch job is.  The child checks
 * the broker's figures through a session of its own of the same tenant
 * (gmb_tenant_stats counts the tenant, not the session).  What needs a GPU
 * (PyTorch itself, device pointers, stream synchronisation) is named in
 * docs/pytorch.md.
 */
#include <check.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include "gmb.h"
#include "harness.h"

#define MIB (UINT64_C(1) << 20)
#define TORCH_QUOTA (8 * MIB)

typedef void *(*torch_alloc_fn)(ssize_t size, int device, void *stream);
typedef void (*torch_free_fn)(void *ptr, ssize_t size, int device,
                              void *stream);
typedef const char *(*torch_err_fn)(void);
typedef int (*torch_empty_fn)(void);

struct torch_lib {
  void *h;
  torch_alloc_fn alloc;
  torch_free_fn free;
  torch_err_fn last_error;
  torch_empty_fn empty_cache; /* gmb_torch.empty_cache() */
};

struct torch_args {
  const char *endpoint; /* NULL: a broker that is not there */
  const char *tenant;
  long iter;
  int no_host; /* leave GMB_SHIM_ALLOW_HOST unset */
};

/* In a child: loads the library (as CUDAPluggableAllocator does, by path
 * and symbol names).  0, or a message on stderr and -1. */
static int torch_load(struct torch_lib *t, const struct torch_args *a) {
  if (a->endpoint)
    setenv("GMB_ENDPOINT", a->endpoint, 1);
  else
    setenv("GMB_ENDPOINT", "ipc:///nonexistent-gmb/broker.sock", 1);
  setenv("GMB_TENANT", a->tenant, 1);
  /* The brokers here serve the host device, which the library refuses
   * unless told it is a test (torch_host_broker_refused unsets it). */
  if (!a->no_host) setenv("GMB_SHIM_ALLOW_HOST", "1", 1);
  char path[PATH_MAX];
  snprintf(path, sizeof path, "%s/libgmb-torch.so", harness_build_dir());
  t->h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (t->h == NULL) {
    fprintf(stderr, "dlopen %s: %s\n", path, dlerror());
    return -1;
  }
  /* The C entry point: gmb_torch_alloc itself throws (C++) on a refusal,
   * which a C caller cannot catch; torch_alloc_throws runs it. */
  *(void **)&t->alloc = dlsym(t->h, "gmb_torch_alloc_nothrow");
  *(void **)&t->free = dlsym(t->h, "gmb_torch_free");
  *(void **)&t->last_error = dlsym(t->h, "gmb_torch_last_error");
  *(void **)&t->empty_cache = dlsym(t->h, "gmb_torch_empty_cache");
  if (!t->alloc || !t->free || !t->last_error || !t->empty_cache) {
    fprintf(stderr, "%s lacks a gmb_torch_* symbol\n", path);
    return -1;
  }
  return 0;
}

/* The tenant's bytes in use, through a session of the child's own. */
static long long torch_used(const struct torch_args *a) {
  gmb_client *c = NULL;
  if (gmb_connect(a->endpoint, a->tenant, &c)) return -1;
  gmb_stats st;
  long long r = gmb_tenant_stats(c, &st) ? -1 : (long long)st.used;
  gmb_disconnect(c);
  return r;
}

static void torch_run(int (*fn)(void *), struct torch_args *a) {
  pid_t pid = harness_fork(fn, a);
  ck_assert_int_eq(harness_wait(pid), 0);
}

static const char *torch_config =
    "[tenant:torch]\nquota = 8MiB\n";

/* --- sizes -------------------------------------------------------------- */

static int sizes_main(void *arg) {
  struct torch_args *a = arg;
  struct torch_lib t;
  CHILD_CHECK(torch_load(&t, a) == 0, 10, "load");
  void *stream = (void *)0x1234; /* PyTorch passes its current stream */
  /* Size 0: NULL, as PyTorch's own allocator; its DataPtr is then empty
   * and free is never called with it. */
  CHILD_CHECK(t.alloc(0, 0, stream) == NULL, 11, "alloc(0) gave memory");
  CHILD_CHECK(t.alloc(-5, 0, stream) == NULL, 11, "alloc(-5) gave memory");
  static const ssize_t sizes[] = {1, 511, 512, 513, 4096, (ssize_t)MIB + 1};
  enum { N = sizeof sizes / sizeof sizes[0] };
  void *p[N];
  uint64_t want = 0;
  for (int i = 0; i < N; i++) {
    p[i] = t.alloc(sizes[i], 0, stream);
    CHILD_CHECK(p[i] != NULL, 12, "alloc(%zd): %s", sizes[i], t.last_error());
    CHILD_CHECK(((uintptr_t)p[i] & 511) == 0, 13, "%p not 512-aligned", p[i]);
    for (int j = 0; j < i; j++)
      CHILD_CHECK(p[j] != p[i], 14, "alloc %d and %d both gave %p", j, i, p[i]);
    want += ((uint64_t)sizes[i] + 511) & ~UINT64_C(511);
    harness_pattern_fill(p[i], (size_t)sizes[i], (uint64_t)i + 1);
  }
  /* The cache's pages: one 2 MiB page holds them all, the large one
   * included. */
  long long used = torch_used(a);
  CHILD_CHECK(used == (long long)(2 * MIB), 15,
              "broker says %lld used (%llu asked)", used,
              (unsigned long long)want);
  for (int i = 0; i < N; i++) {
    long bad = harness_pattern_check(p[i], (size_t)sizes[i], (uint64_t)i + 1);
    CHILD_CHECK(bad < 0, 16, "allocation %d differs at byte %ld", i, bad);
  }
  t.free(NULL, 0, 0, stream); /* nothing happens */
  for (int i = 0; i < N; i++) t.free(p[i], sizes[i], 0, stream);
  /* Freed into the cache: still the tenant's until empty_cache. */
  used = torch_used(a);
  CHILD_CHECK(used == (long long)(2 * MIB), 17,
              "broker says %lld used after freeing all into the cache", used);
  CHILD_CHECK(t.empty_cache() == 0, 19, "empty_cache");
  used = torch_used(a);
  CHILD_CHECK(used == 0, 17, "broker says %lld used after empty_cache", used);
  CHILD_CHECK(strcmp(t.last_error(), "no error") == 0, 18,
              "a failure was recorded: %s", t.last_error());
  return 0;
}

START_TEST(torch_sizes_and_zero) {
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", torch_config);
  struct torch_args a = {b.endpoint, "torch", 1, 0};
  torch_run(sizes_main, &a);
  harness_broker_stop(&b);
}
END_TEST

/* --- quota --------------------------------------------------------------- */

static int quota_main(void *arg) {
  struct torch_args *a = arg;
  struct torch_lib t;
  CHILD_CHECK(torch_load(&t, a) == 0, 10, "load");
  void *big = t.alloc((ssize_t)(6 * MIB), 0, NULL);
  CHILD_CHECK(big != NULL, 11, "alloc 6MiB: %s", t.last_error());
  CHILD_CHECK(t.alloc((ssize_t)(4 * MIB), 0, NULL) == NULL, 12,
              "4MiB more than an 8MiB quota allows was given");
  CHILD_CHECK(strstr(t.last_error(), "GMB_E_QUOTA") != NULL, 13,
              "last error: %s", t.last_error());
  /* Exactly up to the quota is allowed. */
  void *rest = t.alloc((ssize_t)(2 * MIB), 0, NULL);
  CHILD_CHECK(rest != NULL, 14, "the last 2MiB of the quota: %s",
              t.last_error());
  t.free(big, (ssize_t)(6 * MIB), 0, NULL);
  /* From the cached 6 MiB, with no message: its other 2 MiB stay cached
   * (the tenant's), so the quota is still full. */
  void *again = t.alloc((ssize_t)(4 * MIB), 0, NULL);
  CHILD_CHECK(again != NULL, 15, "4MiB after freeing 6MiB: %s",
              t.last_error());
  long long used = torch_used(a);
  CHILD_CHECK(used == (long long)(8 * MIB), 16, "used %lld, want 8MiB", used);
  /* 3 MiB more: the cached 2 MiB are one idle page, 3 MiB needs two,
   * and the quota has no room for the second. */
  CHILD_CHECK(t.alloc((ssize_t)(3 * MIB), 0, NULL) == NULL, 17,
              "3MiB over a full quota");
  return 0; /* exits holding 6MiB: the broker must take it back */
}

START_TEST(torch_quota_returns_null) {
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", torch_config);
  struct torch_args a = {b.endpoint, "torch", 1, 0};
  torch_run(quota_main, &a);
  /* The child died holding memory: its session's allocations go back. */
  struct wire_tenant_row row;
  int freed = 0;
  for (int i = 0; i < HARNESS_WAIT_MS / 20 && !freed; i++) {
    ck_assert_int_eq(harness_tenant_row(&b, "torch", &row), 0);
    freed = row.used == 0;
    if (!freed) harness_sleep_ms(20);
  }
  ck_assert_msg(freed, "tenant torch still uses %llu bytes after its "
                "process exited", (unsigned long long)row.used);
  harness_broker_stop(&b);
}
END_TEST

/* --- no broker, foreign pointers ------------------------------------------ */

static int nobroker_main(void *arg) {
  struct torch_args *a = arg;
  struct torch_lib t;
  CHILD_CHECK(torch_load(&t, a) == 0, 10, "load");
  CHILD_CHECK(t.alloc(4096, 0, NULL) == NULL, 11, "memory without a broker");
  CHILD_CHECK(strstr(t.last_error(), "no broker") != NULL, 12,
              "last error: %s", t.last_error());
  return 0;
}

START_TEST(torch_no_broker_returns_null) {
  struct torch_args a = {NULL, "torch", 1, 0};
  torch_run(nobroker_main, &a);
}
END_TEST

static int foreign_main(void *arg) {
  struct torch_args *a = arg;
  struct torch_lib t;
  CHILD_CHECK(torch_load(&t, a) == 0, 10, "load");
  void *p = t.alloc(4096, 0, NULL);
  CHILD_CHECK(p != NULL, 11, "alloc: %s", t.last_error());
  char local[64];
  t.free(local, sizeof local, 0, NULL); /* not ours: ignored, recorded */
  CHILD_CHECK(strstr(t.last_error(), "not a pointer") != NULL, 12,
              "last error: %s", t.last_error());
  t.free(p, 4096, 0, NULL);
  t.free(p, 4096, 0, NULL); /* twice: not ours any more: ignored, recorded */
  CHILD_CHECK(strstr(t.last_error(), "gmb_torch_free(4096)") != NULL &&
                  strstr(t.last_error(), "freed already") != NULL,
              14, "last error: %s", t.last_error());
  CHILD_CHECK(t.empty_cache() == 0, 15, "empty_cache");
  CHILD_CHECK(torch_used(a) == 0, 13, "used after free");
  return 0;
}

START_TEST(torch_free_foreign_and_twice) {
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", torch_config);
  struct torch_args a = {b.endpoint, "torch", 1, 0};
  torch_run(foreign_main, &a);
  harness_broker_stop(&b);
}
END_TEST

/* --- fork ---------------------------------------------------------------------- */

/* In a grandchild: what a fork() child of the test's process may do with
 * the library, as exit codes (0: what the test expects). */
static int fork_child_refused(struct torch_lib *t, void *parents) {
  if (t->alloc(4096, 0, NULL) != NULL) return 1; /* served: wrong */
  if (strstr(t->last_error(), "fork() child") == NULL) return 2;
  t->free(parents, 4096, 0, NULL);
  if (strstr(t->last_error(), "gmb_torch_free(4096)") == NULL ||
      strstr(t->last_error(), "fork() child") == NULL)
    return 3;
  return 0;
}

static int fork_wait(pid_t pid) {
  int st;
  if (pid < 0 || waitpid(pid, &st, 0) != pid) return -1;
  return WIFEXITED(st) ? WEXITSTATUS(st) : 100 + WTERMSIG(st);
}

/* A child forked before the library made its session makes one of its
 * own; one forked after may not use the parent's (its ZeroMQ context and,
 * on a GPU, CUDA's): refused with the reason, and the parent's memory is
 * untouched by what the child asked. */
static int fork_main(void *arg) {
  struct torch_args *a = arg;
  struct torch_lib t;
  CHILD_CHECK(torch_load(&t, a) == 0, 10, "load");
  pid_t early = fork();
  if (early == 0) {
    void *q = t.alloc(4096, 0, NULL);
    if (q == NULL) _exit(1);
    t.free(q, 4096, 0, NULL);
    _exit(strcmp(t.last_error(), "no error") == 0 ? 0 : 2);
  }
  int rc = fork_wait(early);
  CHILD_CHECK(rc == 0, 11, "a child forked before any session: %d", rc);
  void *p = t.alloc(4096, 0, NULL);
  CHILD_CHECK(p != NULL, 12, "alloc: %s", t.last_error());
  harness_pattern_fill(p, 4096, 77);
  pid_t late = fork();
  if (late == 0) _exit(fork_child_refused(&t, p));
  rc = fork_wait(late);
  CHILD_CHECK(rc == 0, 13, "a child forked after the session: %d", rc);
  /* The child's refused free did not give the block back: still ours,
   * intact, and freed once here. */
  CHILD_CHECK(harness_pattern_check(p, 4096, 77) < 0, 14, "block changed");
  void *other = t.alloc(4096, 0, NULL);
  CHILD_CHECK(other != NULL && other != p, 15, "the block was handed out "
              "again while the parent holds it");
  t.free(other, 4096, 0, NULL);
  t.free(p, 4096, 0, NULL);
  CHILD_CHECK(strcmp(t.last_error(), "no error") == 0, 16, "last error: %s",
              t.last_error());
  CHILD_CHECK(t.empty_cache() == 0, 17, "empty_cache");
  CHILD_CHECK(torch_used(a) == 0, 18, "used after free");
  return 0;
}

START_TEST(torch_fork_child_refused) {
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", torch_config);
  struct torch_args a = {b.endpoint, "torch", 1, 0};
  torch_run(fork_main, &a);
  harness_broker_stop(&b);
}
END_TEST

/* --- threads ------------------------------------------------------------------ */

#define TH_THREADS 4
#define TH_HELD 8

struct th_arg {
  struct torch_lib *t;
  int index;
  long rounds;
  atomic_int *fail;
};

/* Each thread keeps up to TH_HELD allocations, each filled with a pattern
 * of its own, and checks every one before freeing it: two threads given
 * the same bytes, or a map that returned the wrong id, shows as a
 * mismatch or as a tenant that does not end at 0. */
static void *th_main(void *arg) {
  struct th_arg *a = arg;
  uint64_t s = 0x5eedu + (uint64_t)a->index * 7919u;
  void *p[TH_HELD] = {0};
  size_t sz[TH_HELD] = {0};
  uint64_t seed[TH_HELD] = {0};
  for (long r = 0; r < a->rounds; r++) {
    int k = (int)(harness_rnd(&s) % TH_HELD);
    if (p[k]) {
      if (harness_pattern_check(p[k], sz[k], seed[k]) >= 0) atomic_store(a->fail, 1);
      a->t->free(p[k], (ssize_t)sz[k], 0, NULL);
      p[k] = NULL;
    } else {
      sz[k] = 1 + harness_rnd(&s) % (64 * 1024);
      p[k] = a->t->alloc((ssize_t)sz[k], 0, NULL);
      if (p[k] == NULL) {
        atomic_store(a->fail, 2);
        break;
      }
      seed[k] = harness_rnd(&s) | 1;
      harness_pattern_fill(p[k], sz[k], seed[k]);
    }
  }
  for (int k = 0; k < TH_HELD; k++)
    if (p[k]) {
      if (harness_pattern_check(p[k], sz[k], seed[k]) >= 0) atomic_store(a->fail, 1);
      a->t->free(p[k], (ssize_t)sz[k], 0, NULL);
    }
  return NULL;
}

static int threads_main(void *arg) {
  struct torch_args *a = arg;
  struct torch_lib t;
  CHILD_CHECK(torch_load(&t, a) == 0, 10, "load");
  atomic_int fail = 0;
  pthread_t th[TH_THREADS];
  struct th_arg ta[TH_THREADS];
  for (int i = 0; i < TH_THREADS; i++) {
    ta[i] = (struct th_arg){&t, i, 200 * a->iter, &fail};
    CHILD_CHECK(pthread_create(&th[i], NULL, th_main, &ta[i]) == 0, 11,
                "pthread_create");
  }
  for (int i = 0; i < TH_THREADS; i++) pthread_join(th[i], NULL);
  CHILD_CHECK(atomic_load(&fail) == 0, 12, "failure %d: %s",
              atomic_load(&fail), t.last_error());
  CHILD_CHECK(t.empty_cache() == 0, 14, "empty_cache");
  long long used = torch_used(a);
  CHILD_CHECK(used == 0, 13, "used %lld after every thread freed all", used);
  return 0;
}

START_TEST(torch_threads_share_session) {
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", "[tenant:torch]\nquota = 32MiB\n");
  struct torch_args a = {b.endpoint, "torch", harness_env_long("ITER", 1), 0};
  torch_run(threads_main, &a);
  harness_broker_stop(&b);
}
END_TEST

/* What PyTorch calls: a refusal is an exception naming the reason, never a
 * NULL pointer (PyTorch would make a tensor at address 0 of it). */
START_TEST(torch_refusal_throws) {
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", torch_config);
  char lib[PATH_MAX], prog[PATH_MAX], big[32];
  snprintf(lib, sizeof lib, "%s/libgmb-torch.so", harness_build_dir());
  snprintf(prog, sizeof prog, "%s/preload/torch_throw_prog",
           harness_build_dir());
  snprintf(big, sizeof big, "%llu", (unsigned long long)(TORCH_QUOTA + 512));
  setenv("GMB_ENDPOINT", b.endpoint, 1);
  setenv("GMB_TENANT", "torch", 1);
  setenv("GMB_SHIM_ALLOW_HOST", "1", 1);
  char out[2048];
  char *argv[] = {prog, lib, big, "GMB_E_QUOTA", NULL};
  int rc = harness_run(argv, out, sizeof out);
  ck_assert_msg(rc == 0, "%d: %s", rc, out);
  /* PyTorch's own words first (what users match on), then gmb's reason. */
  ck_assert_msg(strstr(out, "threw: CUDA out of memory. Tried to allocate "
                            "8.00 MiB on GPU 0. gmb: gmb_torch_alloc(") !=
                    NULL,
                "%s", out);
  /* With torch.OutOfMemoryError registered (gmb_torch.enable() does it):
   * the exception PyTorch's bindings raise as the type it names, caught
   * by its base as they catch it, with the same words. */
  char *typed[] = {prog, lib, big, "GMB_E_QUOTA", "oom-type", NULL};
  rc = harness_run(typed, out, sizeof out);
  ck_assert_msg(rc == 0, "%d: %s", rc, out);
  ck_assert_msg(strstr(out, "python_error oom: CUDA out of memory. Tried to "
                            "allocate 8.00 MiB on GPU 0. gmb: "
                            "gmb_torch_alloc(") != NULL,
                "%s", out);
  /* A success returns the pointer (exit 1: "returned"). */
  char *ok[] = {prog, lib, "4096", "GMB_E_QUOTA", NULL};
  rc = harness_run(ok, out, sizeof out);
  ck_assert_msg(rc == 1 && strstr(out, "returned 0x"), "%d: %s", rc, out);
  unsetenv("GMB_SHIM_ALLOW_HOST");
  unsetenv("GMB_ENDPOINT");
  harness_broker_stop(&b);
}
END_TEST

/* A broker on the host device gives host memory, which PyTorch's kernels
 * cannot use: refused, with the reason. */
static int host_main(void *arg) {
  struct torch_args *a = arg;
  struct torch_lib t;
  unsetenv("GMB_SHIM_ALLOW_HOST");
  CHILD_CHECK(torch_load(&t, a) == 0, 10, "load");
  CHILD_CHECK(t.alloc(4096, 0, NULL) == NULL, 11, "host memory handed out");
  CHILD_CHECK(strstr(t.last_error(), "not a GPU") != NULL, 12,
              "last error: %s", t.last_error());
  CHILD_CHECK(torch_used(a) == 0, 13, "used");
  return 0;
}

START_TEST(torch_host_broker_refused) {
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", torch_config);
  struct torch_args a = {b.endpoint, "torch", 1, 1};
  torch_run(host_main, &a);
  harness_broker_stop(&b);
}
END_TEST

/* --- several GPUs: one broker each -------------------------------------------- */

static const struct harness_broker *mg_b[2];

static long long mg_used(int i) {
  struct wire_tenant_row row;
  int rc = harness_tenant_row(mg_b[i], "torch", &row);
  return rc == GMB_E_NOENT ? 0 : rc ? -1 : (long long)row.used;
}

/* empty_cache until physical GPU `i` holds `want` for the tenant: a free
 * records an event on the (fake) GPU's stream and a trim never waits for
 * it, so the slab comes back once that stream ran past it.  0 or -1. */
static int mg_trim_until(const struct torch_lib *t, int i, long long want) {
  /* The fake GPU's stream thread runs when the machine lets it: wait as
   * long as any harness wait (a loaded machine made 5 s too short). */
  for (int n = 0; n < HARNESS_WAIT_MS / 20; n++) {
    int rc = t->empty_cache();
    if (rc != 0) {
      fprintf(stderr, "empty_cache returned %d: %s\n", rc, t->last_error());
      return -1;
    }
    if (mg_used(i) == want) return 0;
    harness_sleep_ms(20);
  }
  fprintf(stderr, "physical %d still holds %lld, not %lld\n", i, mg_used(i),
          want);
  return -1;
}

/* PyTorch names the device of every allocation: each goes to the broker
 * of that GPU (the process sees the two renumbered, "1,0"), through the
 * cache of that device's session, each free to the cache of the session
 * that gave it, and empty_cache trims every session; a device with no
 * broker is refused. */
static int devices_main(void *arg) {
  struct torch_args *a = arg;
  struct torch_lib t;
  setenv("FAKECUDA_VISIBLE", "1,0,2", 1);
  CHILD_CHECK(torch_load(&t, a) == 0, 10, "load");
  void *p0 = t.alloc(4096, 0, NULL); /* physical 1 */
  CHILD_CHECK(p0 != NULL, 11, "alloc on 0: %s", t.last_error());
  void *p1 = t.alloc(8192, 1, NULL); /* physical 0 */
  CHILD_CHECK(p1 != NULL, 12, "alloc on 1: %s", t.last_error());
  /* Each through the cache of its device's session: a 2 MiB shared slab
   * from each GPU's broker. */
  CHILD_CHECK(mg_used(1) == (long long)(2 * MIB) &&
                  mg_used(0) == (long long)(2 * MIB),
              13, "physical 0 holds %lld, physical 1 %lld", mg_used(0),
              mg_used(1));
  CHILD_CHECK(t.alloc(4096, 2, NULL) == NULL, 14, "memory on a GPU without "
              "a broker");
  CHILD_CHECK(strstr(t.last_error(), "no broker for cuda:2") &&
                  strstr(t.last_error(), HARNESS_FAKE_UUID(2)),
              15, "last error: %s", t.last_error());
  /* p0 freed into device 0's cache (whatever device is current), then
   * every session's free slabs given back: physical 1's only. */
  t.free(p0, 4096, 0, NULL);
  CHILD_CHECK(mg_used(1) == (long long)(2 * MIB), 18, "cached after a free");
  CHILD_CHECK(mg_trim_until(&t, 1, 0) == 0, 19, "empty_cache: %s",
              t.last_error());
  CHILD_CHECK(mg_used(1) == 0 && mg_used(0) == (long long)(2 * MIB), 16,
              "after a free and empty_cache: physical 0 holds %lld, "
              "physical 1 %lld", mg_used(0), mg_used(1));
  t.free(p1, 8192, 1, NULL);
  CHILD_CHECK(mg_trim_until(&t, 0, 0) == 0, 17, "after both frees and "
              "empty_cache: physical 0 holds %lld", mg_used(0));
  CHILD_CHECK(strstr(t.last_error(), "no broker for cuda:2") != NULL, 21,
              "a failure was recorded: %s", t.last_error());
  return 0;
}

START_TEST(torch_routes_by_device) {
  struct harness_gpus g;
  harness_fake_gpus(&g, 3);
  struct harness_broker b0, b1;
  harness_broker_start_gpu(&b0, g.base, "cuda:0", HARNESS_FAKE_UUID(0),
                           torch_config);
  harness_broker_start_gpu(&b1, g.base, "cuda:1", HARNESS_FAKE_UUID(1),
                           torch_config);
  mg_b[0] = &b0;
  mg_b[1] = &b1;
  struct torch_args a = {NULL, "torch", 1, 1};
  torch_run(devices_main, &a);
  harness_broker_stop(&b0);
  harness_broker_stop(&b1);
  harness_fake_gpus_done(&g);
}
END_TEST

/* --- PyTorch's other hooks, on a (fake) GPU --------------------------------- */

/* The fake driver, through the child's own handle (the library loaded the
 * same one): streams in the primary context, a gate that holds a stream. */
struct hk_drv {
  int (*stream_create)(void **s, unsigned flags);
  int (*stream_sync)(void *s);
  int (*host_func)(void *s, void (*fn)(void *), void *arg);
};

static atomic_int hk_gate;

static void hk_gate_fn(void *arg) {
  (void)arg;
  while (!atomic_load(&hk_gate)) harness_sleep_ms(1);
}

typedef int (*hk_gpa_fn)(const char *sym, void **pfn, int ver,
                         unsigned long long flags, int *status);

/* 0 with the primary context of ordinal 0 current in this thread. */
static int hk_drv_load(struct hk_drv *d) {
  const char *lib = getenv("GMB_LIBCUDA");
  void *h = lib ? dlopen(lib, RTLD_NOW | RTLD_LOCAL) : NULL;
  hk_gpa_fn gpa = NULL;
  if (h) *(void **)&gpa = dlsym(h, "cuGetProcAddress_v2");
  if (gpa == NULL) return -1;
  int (*init)(unsigned) = NULL, (*get)(int *, int) = NULL;
  int (*retain)(void **, int) = NULL, (*set)(void *) = NULL;
  if (gpa("cuInit", (void **)&init, 12000, 0, NULL) ||
      gpa("cuDeviceGet", (void **)&get, 12000, 0, NULL) ||
      gpa("cuDevicePrimaryCtxRetain", (void **)&retain, 12000, 0, NULL) ||
      gpa("cuCtxSetCurrent", (void **)&set, 12000, 0, NULL) ||
      gpa("cuStreamCreate", (void **)&d->stream_create, 12000, 0, NULL) ||
      gpa("cuStreamSynchronize", (void **)&d->stream_sync, 12000, 0, NULL) ||
      gpa("cuLaunchHostFunc", (void **)&d->host_func, 12000, 0, NULL))
    return -1;
  int dev;
  void *ctx;
  if (init(0) || get(&dev, 0) || retain(&ctx, dev) || set(ctx)) return -1;
  return 0;
}

struct hk_lib {
  struct torch_lib t;
  void (*init)(int);
  void (*reset)(void);
  void (*fraction)(double, int);
  void (*record)(void *, void *);
  unsigned long long (*kept)(void);
};

static const struct harness_broker *hk_b;

/* The tenant's bytes in use on the GPU's broker. */
static long long hk_used(void) {
  struct wire_tenant_row row;
  int rc = harness_tenant_row(hk_b, "torch", &row);
  return rc == GMB_E_NOENT ? 0 : rc ? -1 : (long long)row.used;
}

/*
 * What PyTorch calls, in its order: init at CUDA's lazy initialisation,
 * alloc on the current stream, record_stream when a tensor is used on a
 * second stream, free with the allocation's stream, empty_cache (the
 * reset hook), set_per_process_memory_fraction, and an allocation during
 * a graph capture.
 */
static int hooks_main(void *arg) {
  struct torch_args *a = arg;
  struct hk_lib k;
  struct hk_drv d;
  CHILD_CHECK(torch_load(&k.t, a) == 0, 10, "load");
  *(void **)&k.init = dlsym(k.t.h, "gmb_torch_init");
  *(void **)&k.reset = dlsym(k.t.h, "gmb_torch_reset");
  *(void **)&k.fraction = dlsym(k.t.h, "gmb_torch_set_memory_fraction");
  *(void **)&k.record = dlsym(k.t.h, "gmb_torch_record_stream");
  *(void **)&k.kept = dlsym(k.t.h, "gmb_torch_kept");
  CHILD_CHECK(k.init && k.reset && k.fraction && k.record && k.kept, 11,
              "a hook's symbol is missing");
  CHILD_CHECK(hk_drv_load(&d) == 0, 12, "the fake driver");
  void *s1, *s2;
  CHILD_CHECK(d.stream_create(&s1, 1) == 0 && d.stream_create(&s2, 1) == 0,
              13, "cuStreamCreate");
  k.init(1); /* CUDA's lazy init: one device */

  /* record_stream: used on s2, freed on s1, while s2 is held. */
  atomic_store(&hk_gate, 0);
  CHILD_CHECK(d.host_func(s2, hk_gate_fn, NULL) == 0, 14, "host func");
  void *p = k.t.alloc(64 * 1024, 0, s1);
  CHILD_CHECK(p != NULL, 15, "alloc: %s", k.t.last_error());
  k.record(p, s2);
  k.t.free(p, 64 * 1024, 0, s1);
  CHILD_CHECK(strcmp(k.t.last_error(), "no error") == 0, 16, "%s",
              k.t.last_error());
  void *q = k.t.alloc(64 * 1024, 0, s1);
  CHILD_CHECK(q != NULL && q != p, 17, "a block s2 may still use was "
              "reused on s1 (%p, %p)", p, q);
  atomic_store(&hk_gate, 1);
  CHILD_CHECK(d.stream_sync(s2) == 0, 18, "sync s2");
  void *r = k.t.alloc(64 * 1024, 0, s1);
  CHILD_CHECK(r == p, 19, "once s2 ran past the free the block is s1's "
              "again (%p, not %p)", r, p);
  k.t.free(q, 64 * 1024, 0, s1);
  k.t.free(r, 64 * 1024, 0, s1);
  k.record((char *)p + 512, s2); /* not ours: ignored, recorded */
  CHILD_CHECK(strstr(k.t.last_error(), "gmb_torch_record_stream"), 20, "%s",
              k.t.last_error());

  /* torch.cuda.empty_cache(): the reset hook gives the slab back once the
   * streams ran past the frees. */
  CHILD_CHECK(d.stream_sync(s1) == 0, 21, "sync s1");
  CHILD_CHECK(hk_used() == (long long)(2 * MIB), 22, "used %lld", hk_used());
  k.reset();
  CHILD_CHECK(hk_used() == 0, 23, "after the reset hook: used %lld",
              hk_used());

  /* set_per_process_memory_fraction: 0 refuses everything, with the
   * reason; a fraction of 6 MiB of the capacity lets 4 MiB in, not 4 MiB
   * more, until the first is freed. */
  gmb_client *own = NULL;
  gmb_device_stats ds;
  CHILD_CHECK(gmb_connect_gpu("cuda:0", a->tenant, &own) == 0 &&
                  gmb_device_stats_get(own, &ds) == 0 && ds.capacity > 0,
              24, "device stats: %s", gmb_last_error(own));
  gmb_disconnect(own);
  k.fraction(0.0, 0);
  CHILD_CHECK(k.t.alloc(4096, 0, s1) == NULL &&
                  strstr(k.t.last_error(), "memory fraction of cuda:0"),
              25, "fraction 0: %s", k.t.last_error());
  k.fraction((double)(6 * MIB) / (double)ds.capacity, 0);
  p = k.t.alloc((ssize_t)(4 * MIB), 0, s1);
  CHILD_CHECK(p != NULL, 26, "4MiB under the fraction: %s", k.t.last_error());
  CHILD_CHECK(k.t.alloc((ssize_t)(4 * MIB), 0, s1) == NULL, 27,
              "8MiB over a 6MiB fraction");
  k.t.free(p, (ssize_t)(4 * MIB), 0, s1);
  p = k.t.alloc((ssize_t)(4 * MIB), 0, s1);
  CHILD_CHECK(p != NULL, 28, "4MiB after the free: %s", k.t.last_error());
  /* A free that claims more than was allocated (1 TiB) wrapped the
   * process's count below 0, to near 2^64, and every later allocation was
   * refused as past the fraction: the count stops at 0 now. */
  k.t.free(p, (ssize_t)1 << 40, 0, s1);
  p = k.t.alloc((ssize_t)(4 * MIB), 0, s1);
  CHILD_CHECK(p != NULL, 32, "4MiB after a free that claimed 1 TiB: %s",
              k.t.last_error());
  k.t.free(p, (ssize_t)(4 * MIB), 0, s1);
  k.fraction(1.0, 0);

  /* Allocated during a graph capture, freed after it: the graph may still
   * use it at every replay, so it is kept, never reused. */
  setenv("FAKECUDA_CAPTURING", "all", 1);
  void *g = k.t.alloc(8192, 0, s1);
  unsetenv("FAKECUDA_CAPTURING");
  CHILD_CHECK(g != NULL, 29, "alloc during a capture: %s", k.t.last_error());
  k.t.free(g, 8192, 0, s1);
  CHILD_CHECK(k.kept() == 8192 &&
                  strstr(k.t.last_error(), "allocated during a CUDA graph"),
              30, "kept %llu: %s", k.kept(), k.t.last_error());
  void *h2 = k.t.alloc(8192, 0, s1);
  CHILD_CHECK(h2 != NULL && h2 != g, 31, "a graph's block was reused");
  k.t.free(h2, 8192, 0, s1);
  return 0;
}

START_TEST(torch_hooks_in_pytorch_order) {
  struct harness_gpus g;
  harness_fake_gpus(&g, 1);
  struct harness_broker b;
  harness_broker_start_gpu(&b, g.base, "cuda:0", HARNESS_FAKE_UUID(0),
                           torch_config);
  hk_b = &b;
  struct torch_args a = {NULL, "torch", 1, 1};
  torch_run(hooks_main, &a);
  harness_broker_stop(&b);
  harness_fake_gpus_done(&g);
}
END_TEST

/* --- PyTorch's view of memory ---------------------------------------------- */

/* struct gmb_torch_stats (client/shim/torch.c), as gmb_torch.py reads it. */
struct torch_stats {
  uint64_t allocated_current, allocated_peak, allocated_total, freed_total;
  uint64_t requested_current, requested_total, requested_freed;
  uint64_t allocs_current, allocs_total, frees_total;
  uint64_t reserved_current, reserved_peak;
  uint64_t segments_current, segments_total, segments_freed;
  uint64_t num_ooms;
  uint64_t inactive_current;
  uint64_t kept;
};

typedef int (*torch_stats_fn)(int, struct torch_stats *, size_t);

/* One allocation and its free on a thread of its own. */
static void *stats_thread(void *arg) {
  struct torch_lib *t = arg;
  void *p = t->alloc(512, 0, (void *)0x1234);
  if (p) t->free(p, 512, 0, (void *)0x1234);
  return p;
}

static int stats_main(void *arg) {
  struct torch_args *a = arg;
  struct torch_lib t;
  CHILD_CHECK(torch_load(&t, a) == 0, 10, "load");
  torch_stats_fn stats;
  int (*reset)(int);
  int (*info)(int, unsigned long long *, unsigned long long *);
  *(void **)&stats = dlsym(t.h, "gmb_torch_memory_stats");
  *(void **)&reset = dlsym(t.h, "gmb_torch_reset_peak");
  *(void **)&info = dlsym(t.h, "gmb_torch_mem_get_info");
  CHILD_CHECK(stats && reset && info, 11, "missing statistics functions");
  void *stream = (void *)0x1234;
  struct torch_stats st;
  CHILD_CHECK(stats(0, &st, sizeof st) == 0, 12, "stats");
  CHILD_CHECK(st.allocs_total == 0 && st.allocated_current == 0 &&
                  st.num_ooms == 0,
              12, "figures before any allocation");
  CHILD_CHECK(stats(-1, &st, sizeof st) == GMB_E_INVAL, 12, "device -1");
  CHILD_CHECK(stats(0, &st, sizeof st - 8) == GMB_E_INVAL, 12, "short size");
  void *p1 = t.alloc(1000, 0, stream), *p2 = t.alloc(4096, 0, stream);
  void *p3 = t.alloc((ssize_t)MIB + 1, 0, stream);
  CHILD_CHECK(p1 && p2 && p3, 13, "alloc: %s", t.last_error());
  const uint64_t all3 = 1024 + 4096 + MIB + 512, req3 = 1000 + 4096 + MIB + 1;
  CHILD_CHECK(stats(0, &st, sizeof st) == 0, 14, "stats");
  CHILD_CHECK(st.allocated_current == all3 && st.allocated_peak == all3 &&
                  st.allocated_total == all3 && st.freed_total == 0,
              14, "allocated %llu/%llu/%llu/%llu",
              (unsigned long long)st.allocated_current,
              (unsigned long long)st.allocated_peak,
              (unsigned long long)st.allocated_total,
              (unsigned long long)st.freed_total);
  CHILD_CHECK(st.requested_current == req3 && st.requested_total == req3 &&
                  st.requested_freed == 0,
              15, "requested %llu", (unsigned long long)st.requested_current);
  CHILD_CHECK(st.allocs_current == 3 && st.allocs_total == 3 &&
                  st.frees_total == 0,
              16, "counts %llu", (unsigned long long)st.allocs_current);
  /* Reserved: the pages the cache mapped, what the tenant holds. */
  long long used = torch_used(a);
  CHILD_CHECK(st.reserved_current >= all3 &&
                  st.reserved_current == (uint64_t)used &&
                  st.reserved_peak >= st.reserved_current &&
                  st.segments_current >= 1 &&
                  st.inactive_current == st.reserved_current - all3,
              17, "reserved %llu (tenant %lld), inactive %llu",
              (unsigned long long)st.reserved_current, used,
              (unsigned long long)st.inactive_current);
  /* torch.cuda.mem_get_info: the quota as total, the rest as free. */
  unsigned long long fr = 0, tot = 0;
  CHILD_CHECK(info(0, &fr, &tot) == 0, 18, "mem_get_info: %s",
              t.last_error());
  CHILD_CHECK(tot == TORCH_QUOTA && fr == TORCH_QUOTA - (uint64_t)used, 18,
              "mem_get_info %llu %llu", fr, tot);
  t.free(p2, 4096, 0, stream);
  CHILD_CHECK(stats(0, &st, sizeof st) == 0, 19, "stats");
  CHILD_CHECK(st.allocated_current == all3 - 4096 &&
                  st.allocated_peak == all3 && st.freed_total == 4096 &&
                  st.requested_current == req3 - 4096 &&
                  st.requested_freed == 4096 && st.allocs_current == 2 &&
                  st.frees_total == 1,
              19, "after a free: allocated %llu",
              (unsigned long long)st.allocated_current);
  CHILD_CHECK(reset(0) == 0, 20, "reset");
  CHILD_CHECK(stats(0, &st, sizeof st) == 0, 20, "stats");
  CHILD_CHECK(st.allocated_peak == all3 - 4096 &&
                  st.allocated_total == all3 && st.allocs_current == 2,
              20, "peaks after reset %llu",
              (unsigned long long)st.allocated_peak);
  /* Counted on another thread: summed in. */
  pthread_t th;
  void *tp = NULL;
  CHILD_CHECK(pthread_create(&th, NULL, stats_thread, &t) == 0, 20, "thread");
  pthread_join(th, &tp);
  CHILD_CHECK(tp != NULL, 20, "thread's alloc: %s", t.last_error());
  CHILD_CHECK(stats(0, &st, sizeof st) == 0, 20, "stats");
  CHILD_CHECK(st.allocs_total == 4 && st.frees_total == 2 &&
                  st.allocated_current == all3 - 4096 &&
                  st.freed_total == 4096 + 512,
              20, "with a thread's: %llu allocations",
              (unsigned long long)st.allocs_total);
  /* A refusal is an OOM, and changes nothing else. */
  CHILD_CHECK(t.alloc((ssize_t)(TORCH_QUOTA + 512), 0, stream) == NULL, 21,
              "over the quota");
  CHILD_CHECK(stats(0, &st, sizeof st) == 0, 21, "stats");
  CHILD_CHECK(st.num_ooms == 1 && st.allocs_total == 4 &&
                  st.allocated_current == all3 - 4096,
              21, "ooms %llu", (unsigned long long)st.num_ooms);
  t.free(p1, 1000, 0, stream);
  t.free(p3, (ssize_t)MIB + 1, 0, stream);
  t.free(p3, (ssize_t)MIB + 1, 0, stream); /* twice: ignored, not counted */
  CHILD_CHECK(stats(0, &st, sizeof st) == 0, 22, "stats");
  CHILD_CHECK(st.allocated_current == 0 && st.requested_current == 0 &&
                  st.allocs_current == 0 && st.frees_total == 4 &&
                  st.freed_total == all3 + 512,
              22, "after every free: %llu",
              (unsigned long long)st.allocated_current);
  return 0;
}

/* gmb_torch.memory_stats()'s figures, driven as PyTorch drives the
 * allocator: counts, bytes (rounded and as asked), peaks and their reset,
 * the cache's pages as reserved, OOMs; mem_get_info as the quota. */
START_TEST(torch_memory_stats_as_pytorch) {
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", torch_config);
  struct torch_args a = {b.endpoint, "torch", 1, 0};
  torch_run(stats_main, &a);
  harness_broker_stop(&b);
}
END_TEST

/* --- the memory fraction across threads ------------------------------------ */

#define FR_THREADS 8
#define FR_BLOCK (64 * 1024)
#define FR_MAX 256 /* allocations a thread tries, at most */

struct fr_thread {
  struct torch_lib *t;
  pthread_barrier_t *go;
  void *p[FR_MAX];
  int n; /* allocations it got before its first refusal */
};

/* Allocates FR_BLOCK at a time until refused, all threads at once. */
static void *fr_main(void *arg) {
  struct fr_thread *f = arg;
  pthread_barrier_wait(f->go);
  for (f->n = 0; f->n < FR_MAX; f->n++) {
    f->p[f->n] = f->t->alloc(FR_BLOCK, 0, NULL);
    if (f->p[f->n] == NULL) break;
  }
  return NULL;
}

static int fraction_main(void *arg) {
  struct torch_args *a = arg;
  struct torch_lib t;
  CHILD_CHECK(torch_load(&t, a) == 0, 10, "load");
  void (*fraction)(double, int);
  torch_stats_fn stats;
  *(void **)&fraction = dlsym(t.h, "gmb_torch_set_memory_fraction");
  *(void **)&stats = dlsym(t.h, "gmb_torch_memory_stats");
  CHILD_CHECK(fraction && stats, 11, "missing functions");
  gmb_client *own = NULL;
  gmb_device_stats ds;
  CHILD_CHECK(gmb_connect(a->endpoint, a->tenant, &own) == 0 &&
                  gmb_device_stats_get(own, &ds) == 0 && ds.capacity > 0,
              12, "device stats: %s", gmb_last_error(own));
  gmb_disconnect(own);
  double f = (double)(4 * MIB) / (double)ds.capacity;
  const uint64_t limit = (uint64_t)((double)ds.capacity * f); /* torch.c's */
  fraction(f, 0);
  pthread_barrier_t go;
  pthread_barrier_init(&go, NULL, FR_THREADS);
  static struct fr_thread fr[FR_THREADS];
  pthread_t th[FR_THREADS];
  for (int i = 0; i < FR_THREADS; i++) {
    fr[i] = (struct fr_thread){.t = &t, .go = &go};
    CHILD_CHECK(pthread_create(&th[i], NULL, fr_main, &fr[i]) == 0, 13,
                "pthread_create");
  }
  uint64_t got = 0;
  for (int i = 0; i < FR_THREADS; i++) {
    pthread_join(th[i], NULL);
    CHILD_CHECK(fr[i].n < FR_MAX, 14, "thread %d was never refused", i);
    got += (uint64_t)fr[i].n * FR_BLOCK;
  }
  pthread_barrier_destroy(&go);
  /* Together never past the limit; and each refusal came with at most the
   * other threads' in-flight allocations counted twice, so the last one
   * left less than all threads' blocks of room. */
  CHILD_CHECK(got <= limit, 15, "%llu bytes allocated past a limit of %llu",
              (unsigned long long)got, (unsigned long long)limit);
  CHILD_CHECK(got + (uint64_t)FR_THREADS * FR_BLOCK > limit, 16,
              "only %llu bytes allocated under a limit of %llu",
              (unsigned long long)got, (unsigned long long)limit);
  CHILD_CHECK(strstr(t.last_error(), "memory fraction of cuda:0") != NULL, 17,
              "refusal: %s", t.last_error());
  struct torch_stats st;
  CHILD_CHECK(stats(0, &st, sizeof st) == 0 && st.allocated_current == got &&
                  st.allocated_peak == got && st.num_ooms == FR_THREADS,
              18, "allocated %llu, peak %llu, ooms %llu (got %llu)",
              (unsigned long long)st.allocated_current,
              (unsigned long long)st.allocated_peak,
              (unsigned long long)st.num_ooms, (unsigned long long)got);
  for (int i = 0; i < FR_THREADS; i++)
    for (int j = 0; j < fr[i].n; j++) t.free(fr[i].p[j], FR_BLOCK, 0, NULL);
  CHILD_CHECK(stats(0, &st, sizeof st) == 0 && st.allocated_current == 0, 19,
              "after the frees: %llu", (unsigned long long)st.allocated_current);
  /* Room again: the fraction counts what is in use now. */
  void *p = t.alloc((ssize_t)(4 * MIB) - FR_BLOCK, 0, NULL);
  CHILD_CHECK(p != NULL, 20, "under the fraction after the frees: %s",
              t.last_error());
  t.free(p, (ssize_t)(4 * MIB) - FR_BLOCK, 0, NULL);
  return 0;
}

/* set_per_process_memory_fraction with threads allocating at once: their
 * allocations together stay under the limit (none slips past between
 * another's check and its count), and fill it to within one block each. */
START_TEST(torch_fraction_threads_never_pass) {
  struct harness_broker b;
  harness_broker_start(&b, "host:256MiB", "[tenant:torch]\nquota = 128MiB\n");
  struct torch_args a = {b.endpoint, "torch", 1, 0};
  torch_run(fraction_main, &a);
  harness_broker_stop(&b);
}
END_TEST

int main(void) {
  return harness_main(HARNESS_SUITE(
      "torch", "torch", 60,
      torch_hooks_in_pytorch_order,
      torch_memory_stats_as_pytorch, torch_fraction_threads_never_pass,
      torch_routes_by_device,
      torch_sizes_and_zero,
      torch_quota_returns_null,
      torch_no_broker_returns_null,
      torch_free_foreign_and_twice, torch_fork_child_refused,
      torch_threads_share_session, torch_refusal_throws,
      torch_host_broker_refused));
}
