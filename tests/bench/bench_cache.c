/*
 * bench_cache.c - what an alloc+free pair costs through the client's
 * stream-ordered cache (gmb_malloc_async + gmb_free_async), beside a raw
 * ZeroMQ round trip and beside the uncached path the shims took before
 * the cache (gmb_alloc + gmb_lock ... gmb_free: two requests).
 *
 * A real gmb-broker runs on the host device ($GMB_BUILD_DIR/gmb-broker) in
 * a temporary run dir.  Two patterns, each through a fresh session:
 *   - transformer: 24 layers x 3 activations of 512 B..8 MiB (log-uniform,
 *     fixed per layer: every step asks the same sizes), each with a
 *     temporary of the same size made and freed beside it; the
 *     activations are freed in reverse after the step.  BENCH_STEPS (20)
 *     steps after 2 of warm-up;
 *   - serving: requests that come and go: up to 64 live, each holding a
 *     block of 64 KiB..16 MiB (log-uniform), BENCH_OPS (20000) arrivals
 *     or departures after 2000 of warm-up.
 * For each: the median and p99 of a pair (the alloc's time plus its
 * free's), the hit rate in the measured phase (requests served without a
 * page mapped), and the peak of the bytes of the cache's pages (slabs,
 * before the cache was made of pages) over the peak of the bytes handed
 * out (what the cache wastes).  The transformer pattern's mean pair is
 * timed apart: 10 * BENCH_STEPS steps timed as a whole, with no clock
 * read per pair (a read costs a third of a pair).  The uncached path runs
 * the transformer pattern for BENCH_STEPS/4 steps; the raw round trip is
 * BENCH_RTT (20000) messages of a bare DEALER to a ROUTER in a forked
 * process that answers at once.
 * Scattered free, then trim (run_trim): 1024 blocks of 16 KiB..8 MiB (the
 * third such burst, the first two wholly freed), 90 %
 * of them freed in random order, then gmb_trim(c, 0): the bytes it gave
 * back against the bytes held in 2 MiB pages that hold no live block.
 * Then the elastic cases.  Through a quota (run_elastic): job A caches
 * 1.5 GiB and idles, job B of the same 2 GiB tenant asks 1 GiB; printed:
 * the time until B is served.  Through a full device (run_elastic_device,
 * on a broker of its own on host:2GiB): job A of one tenant caches 1.5 GiB
 * and idles, job B of another asks 1 GiB, through gmb_alloc and through
 * gmb_malloc_async; BENCH_ELASTIC_RUNS (7) runs of each, a fresh A each
 * time; printed: the median, least and most time until B is served, and
 * the median over the raw round trip of the same run.
 * Last, the stand-in driver (run_fakecuda): a broker on cuda:0 over
 * $GMB_BUILD_DIR/fakecuda/libcuda.so.1, this process its client, the
 * transformer pattern and the scattered trim again ("fakecuda." lines),
 * and its mean pair over the host device's of the same run.
 *
 * Output: "key=value" lines (docs/benchmarks.md).  Exit status 0, or 1
 * when anything failed.
 */
#include <errno.h>
#include <fcntl.h>
#include <malloc.h>
#include <math.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "cache.h"
#include "gmb.h"

static char dir[64], endpoint[128];
static pid_t broker = -1, echo = -1;
static int failed; /* a measure that failed and let the others run */

/* A measure failed in a way that leaves the broker usable: said, counted
 * (exit status 1), and the run goes on. */
static void soft_fail(const char *what, const char *why) {
  fprintf(stderr, "bench_cache: %s: %s\n", what, why);
  printf("%s failed: %s\n", what, why);
  failed = 1;
}

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static long env_long(const char *name, long def) {
  const char *s = getenv(name);
  return s && *s ? strtol(s, NULL, 10) : def;
}

static void cleanup(void) {
  if (echo > 0) kill(echo, SIGKILL), waitpid(echo, NULL, 0);
  if (broker > 0) kill(broker, SIGTERM), waitpid(broker, NULL, 0);
  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
  if (dir[0] && system(cmd) != 0) fprintf(stderr, "could not remove %s\n", dir);
}

static void die(const char *what, const char *why) {
  fprintf(stderr, "bench_cache: %s: %s\n", what, why);
  cleanup();
  exit(1);
}

static uint64_t rng_state = 7;
static uint64_t rnd(void) {
  uint64_t z = (rng_state += UINT64_C(0x9e3779b97f4a7c15));
  z = (z ^ (z >> 30)) * UINT64_C(0xbf58476d1ce4e5b9);
  z = (z ^ (z >> 27)) * UINT64_C(0x94d049bb133111eb);
  return z ^ (z >> 31);
}
static size_t log_uniform(double lo, double hi) {
  double u = (double)(rnd() >> 11) / 9007199254740992.0;
  return (size_t)exp(log(lo) + u * (log(hi) - log(lo)));
}

static int cmp_u64(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? -1 : x > y;
}
static void stats(uint64_t *v, size_t n, double *med, double *p99) {
  qsort(v, n, sizeof *v, cmp_u64);
  *med = (double)v[n / 2];
  *p99 = (double)v[(size_t)((double)n * 0.99)];
}

/* A broker on `device` with the config text `ini`, in the run dir. */
static void broker_start(const char *device, const char *ini) {
  const char *b = getenv("GMB_BUILD_DIR");
  char bin[512];
  snprintf(bin, sizeof bin, "%s/gmb-broker", b && *b ? b : "build");
  broker = fork();
  if (broker == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    int fd = open("/dev/null", O_WRONLY);
    if (fd >= 0) dup2(fd, 2);
    char cfg[128];
    snprintf(cfg, sizeof cfg, "%s/gmb.ini", dir);
    FILE *f = fopen(cfg, "w");
    if (f) {
      fputs(ini, f);
      fclose(f);
    }
    execl(bin, "gmb-broker", "--device", device, "--run-dir", dir,
          "--config", cfg, "--log-level", "error", (char *)NULL);
    _exit(127);
  }
  for (int i = 0; i < 500; i++) {
    gmb_client *c;
    if (gmb_connect(endpoint, "bench", &c) == 0) {
      gmb_disconnect(c);
      return;
    }
    usleep(20000);
  }
  die("gmb-broker", "did not start");
}

static void broker_stop(void) {
  kill(broker, SIGTERM);
  waitpid(broker, NULL, 0);
  broker = -1;
}

/* --- the raw round trip --------------------------------------------------- */

static double raw_rtt(long n, double *p99) {
  char ep[160];
  snprintf(ep, sizeof ep, "ipc://%s/echo.sock", dir);
  echo = fork();
  if (echo == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    void *ctx = zmq_ctx_new(), *r = zmq_socket(ctx, ZMQ_ROUTER);
    if (zmq_bind(r, ep) != 0) _exit(1);
    for (;;) {
      zmq_msg_t id, m;
      zmq_msg_init(&id);
      zmq_msg_init(&m);
      if (zmq_msg_recv(&id, r, 0) < 0 || zmq_msg_recv(&m, r, 0) < 0) _exit(1);
      zmq_msg_send(&id, r, ZMQ_SNDMORE);
      zmq_msg_send(&m, r, 0);
    }
  }
  void *ctx = zmq_ctx_new(), *d = zmq_socket(ctx, ZMQ_DEALER);
  zmq_connect(d, ep);
  char buf[64] = {0};
  uint64_t *v = malloc((size_t)n * sizeof *v);
  for (long i = -1000; i < n; i++) {
    uint64_t t0 = now_ns();
    if (zmq_send(d, buf, 24, 0) < 0 || zmq_recv(d, buf, sizeof buf, 0) < 0)
      die("raw round trip", zmq_strerror(errno));
    if (i >= 0) v[i] = now_ns() - t0;
  }
  int zero = 0;
  zmq_setsockopt(d, ZMQ_LINGER, &zero, sizeof zero);
  zmq_close(d);
  zmq_ctx_term(ctx);
  double med;
  stats(v, (size_t)n, &med, p99);
  free(v);
  kill(echo, SIGKILL);
  waitpid(echo, NULL, 0);
  echo = -1;
  return med;
}

/* --- the two paths ---------------------------------------------------------- */

struct path {
  gmb_client *c;
  int cached;
  int libc; /* the baseline: malloc/free of the C library */
  gmb_id ids[256]; /* uncached: the id of each live slot */
};

static void *p_alloc(struct path *p, int slot, size_t n) {
  void *ptr = NULL;
  if (p->libc) {
    if ((ptr = malloc(n)) == NULL) die("malloc", strerror(errno));
  } else if (p->cached) {
    if (gmb_malloc_async(p->c, n, NULL, &ptr)) die("malloc_async", gmb_last_error(p->c));
  } else {
    if (gmb_alloc(p->c, n, 0, &p->ids[slot]) || gmb_lock(p->c, p->ids[slot], &ptr))
      die("alloc", gmb_last_error(p->c));
  }
  return ptr;
}

static void p_free(struct path *p, int slot, void *ptr) {
  if (p->libc) {
    free(ptr);
    return;
  }
  int rc = p->cached ? gmb_free_async(p->c, ptr, NULL)
                     : gmb_free(p->c, p->ids[slot]);
  if (rc) die("free", gmb_last_error(p->c));
}

/* --- the patterns ------------------------------------------------------------ */

#define LAYERS 24
#define ACTS (LAYERS * 3)

static size_t tf_sizes[ACTS];

/* One step: alloc each activation and a temporary beside it (freed at
 * once); then the activations in reverse.  Pairs are timed into v, one by
 * one; with v NULL no clock is read (the step is timed as a whole). */
static size_t tf_step(struct path *p, uint64_t *v, size_t at) {
  void *act[ACTS];
  uint64_t ta[ACTS];
  if (v == NULL) {
    for (int i = 0; i < ACTS; i++) {
      act[i] = p_alloc(p, i, tf_sizes[i]);
      p_free(p, ACTS + i, p_alloc(p, ACTS + i, tf_sizes[i]));
    }
    for (int i = ACTS - 1; i >= 0; i--) p_free(p, i, act[i]);
    return at + 2 * ACTS;
  }
  for (int i = 0; i < ACTS; i++) {
    uint64_t t0 = now_ns();
    act[i] = p_alloc(p, i, tf_sizes[i]);
    ta[i] = now_ns() - t0;
    t0 = now_ns();
    void *tmp = p_alloc(p, ACTS + i, tf_sizes[i]);
    uint64_t tt = now_ns() - t0;
    t0 = now_ns();
    p_free(p, ACTS + i, tmp);
    if (v) v[at++] = tt + (now_ns() - t0);
  }
  for (int i = ACTS - 1; i >= 0; i--) {
    uint64_t t0 = now_ns();
    p_free(p, i, act[i]);
    if (v) v[at++] = ta[i] + (now_ns() - t0);
  }
  return at;
}

static void counters(gmb_client *c, struct gmb_cache_counters *k) {
  gmb__client_cache_counters(c, k);
}

#define MEAN_STEPS_PER 10

/* `n` steps of the pattern, each timed whole (two clock reads per step of
 * 144 pairs): the mean pair over all of them, and the median over the
 * steps of each step's mean pair (*step_med), which a step stretched by
 * another process taking the CPU (this VM is shared) does not move. */
static double tf_timed(struct path *p, long n, double *step_med) {
  uint64_t *per = malloc((size_t)n * sizeof *per), total = 0;
  if (per == NULL) die("malloc", strerror(errno));
  for (long s = 0; s < n; s++) {
    uint64_t t0 = now_ns();
    tf_step(p, NULL, 0);
    per[s] = now_ns() - t0;
    total += per[s];
  }
  double x;
  stats(per, (size_t)n, step_med, &x);
  *step_med /= 2.0 * ACTS;
  free(per);
  return (double)total / (double)n / (2.0 * ACTS);
}
/* The transformer pattern through one session: `steps` steps with each
 * pair timed, then (cached) `steps` * MEAN_STEPS_PER more, each step timed
 * as a whole, for the mean pair without the clock's cost in it (tf_timed).
 * `label` prefixes the lines ("" on the host device).  Returns the step
 * median of the mean pair in ns (cached), or the median pair. */
static double run_transformer(const char *label, int cached, long steps,
                              double rtt) {
  struct path p = {.cached = cached};
  if (gmb_connect(endpoint, "bench", &p.c)) die("connect", gmb_last_error(NULL));
  for (int w = 0; w < 2; w++) tf_step(&p, NULL, 0);
  struct gmb_cache_counters k0, k1;
  counters(p.c, &k0);
  uint64_t *v = malloc((size_t)steps * 2 * ACTS * sizeof *v);
  size_t n = 0;
  for (long s = 0; s < steps; s++) n = tf_step(&p, v, n);
  double mean = 0, step_med = 0;
  if (cached) mean = tf_timed(&p, steps * MEAN_STEPS_PER, &step_med);
  counters(p.c, &k1);
  double med, p99;
  stats(v, n, &med, &p99);
  const char *name = cached ? "cache" : "uncached";
  printf("%stransformer.%s pairs=%zu median_ns=%.0f p99_ns=%.0f "
         "median_over_rtt=%.4f\n", label, name, n, med, p99, med / rtt);
  if (cached) {
    uint64_t h = k1.hits - k0.hits, m = k1.misses - k0.misses;
    printf("%stransformer.cache mean_ns=%.1f step_median_ns=%.1f (%ld steps "
           "timed whole)\n", label, mean, step_med, steps * MEAN_STEPS_PER);
    printf("%stransformer.cache hit_rate=%.4f peak_held_bytes=%llu "
           "peak_in_use=%llu peak_ratio=%.3f\n",
           label, (double)h / (double)(h + m ? h + m : 1),
           (unsigned long long)k1.peak_slab_bytes,
           (unsigned long long)k1.peak_in_use,
           (double)k1.peak_slab_bytes / (double)k1.peak_in_use);
  }
  free(v);
  gmb_disconnect(p.c);
  return cached ? step_med : med;
}

/* The baseline of the mean pair, measured in the same run: the
 * transformer pattern through the C library's malloc/free (host memory,
 * never touched), timed whole as run_transformer's mean.  glibc serves
 * blocks of 128 KiB and more with mmap and trims its heap on free until
 * its thresholds adapted; both are fixed here (every block from the heap,
 * no trim), so that the baseline is the allocator's work and not system
 * calls.  Returns the mean pair in ns. */
static double run_malloc(long steps) {
  struct path p = {.libc = 1};
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  for (int w = 0; w < 2; w++) tf_step(&p, NULL, 0);
  double step_med, mean = tf_timed(&p, steps * MEAN_STEPS_PER, &step_med);
  printf("transformer.malloc mean_ns=%.1f step_median_ns=%.1f (%ld steps "
         "timed whole)\n", mean, step_med, steps * MEAN_STEPS_PER);
  return step_med;
}

static void run_serving(long ops, double rtt) {
  struct path p = {.cached = 1};
  if (gmb_connect(endpoint, "bench", &p.c)) die("connect", gmb_last_error(NULL));
  enum { LIVE = 64 };
  void *live[LIVE] = {0};
  uint64_t born[LIVE] = {0};
  uint64_t *v = malloc((size_t)ops * sizeof *v);
  size_t n = 0;
  struct gmb_cache_counters k0 = {0}, k1;
  for (long i = -2000; i < ops; i++) {
    if (i == 0) counters(p.c, &k0);
    int j = (int)(rnd() % LIVE);
    if (live[j]) {
      uint64_t t0 = now_ns();
      p_free(&p, j, live[j]);
      if (i >= 0 && n < (size_t)ops) v[n++] = born[j] + (now_ns() - t0);
      live[j] = NULL;
    } else {
      size_t sz = log_uniform(64 * 1024.0, 16 * 1048576.0);
      uint64_t t0 = now_ns();
      live[j] = p_alloc(&p, j, sz);
      born[j] = now_ns() - t0;
    }
  }
  counters(p.c, &k1);
  double med, p99;
  stats(v, n, &med, &p99);
  uint64_t h = k1.hits - k0.hits, m = k1.misses - k0.misses;
  printf("serving.cache pairs=%zu median_ns=%.0f p99_ns=%.0f "
         "median_over_rtt=%.4f hit_rate=%.4f peak_held_bytes=%llu "
         "peak_in_use=%llu peak_ratio=%.3f\n",
         n, med, p99, med / rtt, (double)h / (double)(h + m ? h + m : 1),
         (unsigned long long)k1.peak_slab_bytes,
         (unsigned long long)k1.peak_in_use,
         (double)k1.peak_slab_bytes / (double)k1.peak_in_use);
  free(v);
  gmb_disconnect(p.c);
}

/* Scattered free, then trim: a burst of TRIM_BLOCKS blocks of 16 KiB..8 MiB
 * (log-uniform, ~1.3 GiB in all: small blocks and blocks of many pages),
 * the third of its kind (the first two wholly freed), 90 % of them freed in random order, then gmb_trim(c, 0).
 * What a trim could give back is the bytes held in pages that hold no live
 * block; the pages here are the 2 MiB pages of the address space
 * (TRIM_PAGE-aligned), counted from the live blocks' addresses, so the
 * figure does not depend on how the cache counts (a cache of slabs maps
 * them wherever the kernel puts them, so for it this is what pages would
 * give back, not what its slabs could).  Printed: held before, the live
 * blocks' pages, the difference (what a trim could give back), what the
 * trim gave back (held before - after), the ratio of the two, and what
 * the cache still holds after the trim, also over the live bytes. */
#define TRIM_BLOCKS 1024
#define TRIM_PAGE ((uintptr_t)2 << 20)
static int cmp_uptr(const void *a, const void *b) {
  uintptr_t x = *(const uintptr_t *)a, y = *(const uintptr_t *)b;
  return x < y ? -1 : x > y;
}
static void run_trim(const char *label) {
  uint64_t saved = rng_state;
  rng_state = 1; /* the same blocks in every run and on every device */
  gmb_client *c;
  if (gmb_connect(endpoint, "bench", &c)) die("connect", gmb_last_error(NULL));
  void **ptr = malloc(TRIM_BLOCKS * sizeof *ptr);
  size_t *len = malloc(TRIM_BLOCKS * sizeof *len);
  int *order = malloc(TRIM_BLOCKS * sizeof *order);
  /* Two bursts made and wholly freed first, so that the measured one is
   * cut from memory the cache already holds (as a job's later steps are),
   * not laid out fresh. */
  for (int round = 0; round < 3; round++) {
    if (round > 0)
      for (int i = 0; i < TRIM_BLOCKS; i++)
        if (gmb_free_async(c, ptr[i], NULL))
          die("trim: free_async", gmb_last_error(c));
    for (int i = 0; i < TRIM_BLOCKS; i++) {
      len[i] = log_uniform(16384.0, 8 * 1048576.0);
      if (gmb_malloc_async(c, len[i], NULL, &ptr[i]))
        die("trim: malloc_async", gmb_last_error(c));
      order[i] = i;
    }
  }
  for (int i = TRIM_BLOCKS - 1; i > 0; i--) { /* Fisher-Yates */
    int j = (int)(rnd() % (uint64_t)(i + 1)), t = order[i];
    order[i] = order[j];
    order[j] = t;
  }
  int freed = TRIM_BLOCKS * 9 / 10;
  for (int i = 0; i < freed; i++)
    if (gmb_free_async(c, ptr[order[i]], NULL))
      die("trim: free_async", gmb_last_error(c));
  /* The 2 MiB pages the live blocks touch, each counted once. */
  size_t np = 0, cap = 1024;
  uintptr_t *pg = malloc(cap * sizeof *pg);
  uint64_t live = 0;
  for (int i = freed; i < TRIM_BLOCKS; i++) {
    uintptr_t a = (uintptr_t)ptr[order[i]];
    live += len[order[i]];
    for (uintptr_t q = a & ~(TRIM_PAGE - 1); q < a + len[order[i]];
         q += TRIM_PAGE) {
      if (np == cap) pg = realloc(pg, (cap *= 2) * sizeof *pg);
      pg[np++] = q;
    }
  }
  qsort(pg, np, sizeof *pg, cmp_uptr);
  size_t pages = 0;
  for (size_t i = 0; i < np; i++) pages += i == 0 || pg[i] != pg[i - 1];
  gmb_cache_stats st0, st1;
  gmb_cache_stats_get(c, &st0);
  uint64_t live_pages = (uint64_t)pages * TRIM_PAGE;
  uint64_t could = st0.held > live_pages ? st0.held - live_pages : 0;
  uint64_t t0 = now_ns();
  if (gmb_trim(c, 0)) die("trim", gmb_last_error(c));
  double ms = (double)(now_ns() - t0) / 1e6;
  gmb_cache_stats_get(c, &st1);
  uint64_t gave = st0.held - st1.held;
  printf("%strim.scattered blocks=%d freed=%d live_bytes=%llu held=%llu "
         "live_pages_bytes=%llu free_pages_bytes=%llu returned=%llu "
         "returned_over_free_pages=%.3f held_after=%llu "
         "held_after_over_live=%.2f trim_ms=%.2f\n",
         label, TRIM_BLOCKS, freed, (unsigned long long)live,
         (unsigned long long)st0.held, (unsigned long long)live_pages,
         (unsigned long long)could, (unsigned long long)gave,
         could ? (double)gave / (double)could : 1.0,
         (unsigned long long)st1.held,
         (double)st1.held / (double)(live ? live : 1), ms);
  for (int i = freed; i < TRIM_BLOCKS; i++) gmb_free_async(c, ptr[order[i]], NULL);
  gmb_trim(c, 0);
  free(pg);
  free(ptr);
  free(len);
  free(order);
  gmb_disconnect(c);
  rng_state = saved;
}

/* The stand-in driver: a broker on cuda:0 over the fake CUDA driver
 * ($GMB_BUILD_DIR/fakecuda/libcuda.so.1, tests/fakecuda/), this process
 * its client through the same driver, and the transformer pattern and
 * the scattered trim again.  Last in the run: a process that called cuInit
 * must not fork (the fake refuses a child, as the driver does).  Returns
 * the mean pair, or 0 when the fake driver is not built. */
static double run_fakecuda(long steps, double rtt) {
  const char *b = getenv("GMB_BUILD_DIR");
  char lib[512], fdir[128];
  snprintf(lib, sizeof lib, "%s/fakecuda/libcuda.so.1", b && *b ? b : "build");
  if (access(lib, R_OK) != 0) {
    printf("fakecuda: %s is missing: skipped\n", lib);
    return 0;
  }
  snprintf(fdir, sizeof fdir, "%s/fakecuda", dir);
  if (mkdir(fdir, 0700) != 0) die("mkdir", strerror(errno));
  setenv("GMB_LIBCUDA", lib, 1);
  setenv("FAKECUDA_DIR", fdir, 1);
  setenv("FAKECUDA_TOTAL", "3g", 1);
  unsetenv("FAKECUDA_DEVICES");
  broker_start("cuda:0", "");
  double mean = run_transformer("fakecuda.", 1, steps, rtt);
  run_trim("fakecuda.");
  return mean;
}

/* Job A of the elastic cases: a process of tenant `tenant` that caches
 * 1.5 GiB and then idles (it never calls the library again). */
static pid_t elastic_job_a(const char *tenant) {
  int fds[2];
  if (pipe(fds)) die("pipe", strerror(errno));
  pid_t a = fork();
  if (a == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    gmb_client *c;
    void *p;
    char ok = 'x';
    if (gmb_connect(endpoint, tenant, &c) == 0 &&
        gmb_malloc_async(c, (size_t)3 << 29, NULL, &p) == 0 &&
        gmb_free_async(c, p, NULL) == 0)
      ok = 'r';
    if (write(fds[1], &ok, 1) != 1) _exit(1);
    for (;;) pause();
  }
  char r = 0;
  if (read(fds[0], &r, 1) != 1 || r != 'r') die("elastic", "job A failed");
  close(fds[0]);
  close(fds[1]);
  return a;
}

/* The elastic case, through a quota: job A (a process) caches 1.5 GiB
 * and idles; job B, of the same tenant with a 2 GiB quota, asks 1 GiB.
 * Timed: B's gmb_malloc_async, from the call to its return. */
static void run_elastic(void) {
  pid_t a = elastic_job_a("elastic");
  gmb_client *b;
  if (gmb_connect(endpoint, "elastic", &b)) die("connect", gmb_last_error(NULL));
  gmb_stats st;
  for (int i = 0; i < 500; i++) { /* until A's report reached the broker */
    if (gmb_tenant_stats(b, &st) == 0 && st.cached >= (UINT64_C(3) << 29)) break;
    usleep(2000);
  }
  void *p;
  uint64_t t0 = now_ns();
  int rc = gmb_malloc_async(b, (size_t)1 << 30, NULL, &p);
  double ms = (double)(now_ns() - t0) / 1e6;
  if (rc) {
    char why[512];
    snprintf(why, sizeof why, "%s (after %.1f ms)", gmb_last_error(b), ms);
    soft_fail("elastic.quota", why);
  } else {
    printf("elastic.quota a_cached=1.5GiB b_asks=1GiB quota=2GiB "
           "served_ms=%.1f\n", ms);
    gmb_free_async(b, p, NULL);
  }
  gmb_disconnect(b);
  kill(a, SIGKILL);
  waitpid(a, NULL, 0);
}


/* The elastic case through a full device: A (tenant job-a) caches 1.5 GiB
 * of the 2 GiB device and idles; B (tenant job-b) asks 1 GiB.  Timed: B's
 * call, from the call to its return, once the broker knows A's cache. */
static void run_elastic_device(double rtt) {
  long runs = env_long("BENCH_ELASTIC_RUNS", 7);
  if (runs < 1) runs = 1;
  gmb_client *b, *watch;
  if (gmb_connect(endpoint, "job-b", &b) ||
      gmb_connect(endpoint, "job-a", &watch))
    die("connect", gmb_last_error(NULL));
  uint64_t *v = malloc((size_t)runs * sizeof *v);
  for (int cached = 0; cached < 2; cached++) {
    int bad = 0;
    for (long i = 0; i < runs && !bad; i++) {
      pid_t a = elastic_job_a("job-a");
      gmb_stats st;
      int seen = 0;
      for (int k = 0; k < 2500 && !seen; k++) { /* A's report arrived */
        seen = gmb_tenant_stats(watch, &st) == 0 &&
               st.cached >= (UINT64_C(3) << 29);
        if (!seen) usleep(2000);
      }
      if (!seen) die("elastic.device", "A's cache never reached the broker");
      void *p = NULL;
      gmb_id id = 0;
      uint64_t t0 = now_ns();
      int rc = cached ? gmb_malloc_async(b, (size_t)1 << 30, NULL, &p)
                      : gmb_alloc(b, (size_t)1 << 30, 0, &id);
      v[i] = now_ns() - t0;
      if (rc) {
        char what[64], why[512];
        snprintf(what, sizeof what, "elastic.device via=%s",
                 cached ? "malloc_async" : "alloc");
        snprintf(why, sizeof why, "%s (run %ld, after %.1f ms)",
                 gmb_last_error(b), i + 1, (double)v[i] / 1e6);
        soft_fail(what, why);
        bad = 1;
        if (cached) gmb_trim(b, 0);
      } else if (cached) { /* Everything back, for the next run: B's
                              memory, and A. */
        gmb_free_async(b, p, NULL);
        gmb_trim(b, 0);
      } else {
        gmb_free(b, id);
      }
      kill(a, SIGKILL);
      waitpid(a, NULL, 0);
      for (int k = 0; k < 2500; k++) { /* A's session ended */
        if (gmb_tenant_stats(watch, &st) == 0 && st.used == 0) break;
        usleep(2000);
      }
    }
    if (bad) continue;
    qsort(v, (size_t)runs, sizeof *v, cmp_u64);
    double med = (double)v[runs / 2];
    printf("elastic.device a_cached=1.5GiB b_asks=1GiB device=2GiB via=%s "
           "runs=%ld served_median_ms=%.1f min_ms=%.1f max_ms=%.1f "
           "median_over_rtt=%.0f\n",
           cached ? "malloc_async" : "alloc", runs, med / 1e6,
           (double)v[0] / 1e6, (double)v[runs - 1] / 1e6, med / rtt);
  }
  free(v);
  gmb_disconnect(watch);
  gmb_disconnect(b);
}

/* BENCH_ONLY: a comma-separated list of the parts to run (transformer,
 * uncached, serving, trim, elastic, fakecuda); unset: all. */
static int part(const char *name) {
  const char *only = getenv("BENCH_ONLY");
  if (only == NULL || *only == '\0') return 1;
  size_t n = strlen(name);
  for (const char *s = only; (s = strstr(s, name)) != NULL; s += n)
    if ((s == only || s[-1] == ',') && (s[n] == '\0' || s[n] == ','))
      return 1;
  return 0;
}

int main(void) {
  snprintf(dir, sizeof dir, "/tmp/gmb-bench-cache-XXXXXX");
  if (mkdtemp(dir) == NULL) die("mkdtemp", strerror(errno));
  snprintf(endpoint, sizeof endpoint, "ipc://%s/broker.sock", dir);
  rng_state = (uint64_t)env_long("BENCH_SEED", 7); /* the sizes drawn */
  long steps = env_long("BENCH_STEPS", 20), ops = env_long("BENCH_OPS", 20000);
  long rtt_n = env_long("BENCH_RTT", 20000);
  for (int i = 0; i < ACTS; i++) tf_sizes[i] = log_uniform(512.0, 8 * 1048576.0);
  broker_start("host:3GiB", "[tenant:elastic]\nquota = 2GiB\n");
  double rtt_p99, rtt = raw_rtt(rtt_n, &rtt_p99);
  printf("raw_rtt median_ns=%.0f p99_ns=%.0f\n", rtt, rtt_p99);
  double host = 0;
  if (part("transformer") || part("fakecuda")) {
    double base = run_malloc(steps);
    host = run_transformer("", 1, steps, rtt);
    printf("transformer.cache step_median_over_malloc=%.3f (malloc %.1f ns, "
           "cache %.1f ns, this run)\n", host / base, base, host);
  }
  if (part("uncached"))
    run_transformer("", 0, steps / 4 > 0 ? steps / 4 : 1, rtt);
  if (part("serving")) run_serving(ops, rtt);
  if (part("trim")) run_trim("");
  if (part("elastic")) {
    run_elastic();
    /* The full-device case on a device of its own size, with the broker's
     * defaults (trim_wait_ms 100). */
    broker_stop();
    broker_start("host:2GiB", "");
    run_elastic_device(rtt);
  }
  broker_stop();
  if (part("fakecuda")) {
    double fake = run_fakecuda(steps, rtt);
    if (fake > 0)
      printf("fakecuda.transformer.cache step_median_over_host=%.3f (host %.1f "
             "ns, this run)\n", fake / host, host);
  }
  cleanup();
  return failed;
}
