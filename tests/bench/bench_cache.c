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
 * free's), the hit rate in the measured phase, and the peak of the cache's
 * slab bytes over the peak of the bytes handed out (what the cache
 * wastes).  The uncached path runs the transformer pattern for
 * BENCH_STEPS/4 steps; the raw round trip is BENCH_RTT (20000) messages of
 * a bare DEALER to a ROUTER in a forked process that answers at once.
 * Last, the elastic cases.  Through a quota (run_elastic): job A caches
 * 1.5 GiB and idles, job B of the same 2 GiB tenant asks 1 GiB; printed:
 * the time until B is served.  Through a full device (run_elastic_device,
 * on a broker of its own on host:2GiB): job A of one tenant caches 1.5 GiB
 * and idles, job B of another asks 1 GiB, through gmb_alloc and through
 * gmb_malloc_async; BENCH_ELASTIC_RUNS (7) runs of each, a fresh A each
 * time; printed: the median, least and most time until B is served, and
 * the median over the raw round trip of the same run.
 *
 * Output: "key=value" lines (docs/benchmarks.md).  Exit status 0, or 1
 * when anything failed.
 */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "cache.h"
#include "gmb.h"

static char dir[64], endpoint[128];
static pid_t broker = -1, echo = -1;

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
  gmb_id ids[256]; /* uncached: the id of each live slot */
};

static void *p_alloc(struct path *p, int slot, size_t n) {
  void *ptr = NULL;
  if (p->cached) {
    if (gmb_malloc_async(p->c, n, NULL, &ptr)) die("malloc_async", gmb_last_error(p->c));
  } else {
    if (gmb_alloc(p->c, n, 0, &p->ids[slot]) || gmb_lock(p->c, p->ids[slot], &ptr))
      die("alloc", gmb_last_error(p->c));
  }
  return ptr;
}

static void p_free(struct path *p, int slot, void *ptr) {
  int rc = p->cached ? gmb_free_async(p->c, ptr, NULL)
                     : gmb_free(p->c, p->ids[slot]);
  if (rc) die("free", gmb_last_error(p->c));
}

/* --- the patterns ------------------------------------------------------------ */

#define LAYERS 24
#define ACTS (LAYERS * 3)

static size_t tf_sizes[ACTS];

/* One step: alloc each activation and a temporary beside it (freed at
 * once); then the activations in reverse.  Pairs are timed. */
static size_t tf_step(struct path *p, uint64_t *v, size_t at) {
  void *act[ACTS];
  uint64_t ta[ACTS];
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

static void run_transformer(int cached, long steps, double rtt) {
  struct path p = {.cached = cached};
  if (gmb_connect(endpoint, "bench", &p.c)) die("connect", gmb_last_error(NULL));
  for (int w = 0; w < 2; w++) tf_step(&p, NULL, 0);
  struct gmb_cache_counters k0, k1;
  counters(p.c, &k0);
  uint64_t *v = malloc((size_t)steps * 2 * ACTS * sizeof *v);
  size_t n = 0;
  for (long s = 0; s < steps; s++) n = tf_step(&p, v, n);
  counters(p.c, &k1);
  double med, p99;
  stats(v, n, &med, &p99);
  const char *name = cached ? "cache" : "uncached";
  printf("transformer.%s pairs=%zu median_ns=%.0f p99_ns=%.0f "
         "median_over_rtt=%.4f\n", name, n, med, p99, med / rtt);
  if (cached) {
    uint64_t h = k1.hits - k0.hits, m = k1.misses - k0.misses;
    printf("transformer.cache hit_rate=%.4f peak_slab_bytes=%llu "
           "peak_in_use=%llu peak_ratio=%.3f\n",
           (double)h / (double)(h + m ? h + m : 1),
           (unsigned long long)k1.peak_slab_bytes,
           (unsigned long long)k1.peak_in_use,
           (double)k1.peak_slab_bytes / (double)k1.peak_in_use);
  }
  free(v);
  gmb_disconnect(p.c);
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
         "median_over_rtt=%.4f hit_rate=%.4f peak_slab_bytes=%llu "
         "peak_in_use=%llu peak_ratio=%.3f\n",
         n, med, p99, med / rtt, (double)h / (double)(h + m ? h + m : 1),
         (unsigned long long)k1.peak_slab_bytes,
         (unsigned long long)k1.peak_in_use,
         (double)k1.peak_slab_bytes / (double)k1.peak_in_use);
  free(v);
  gmb_disconnect(p.c);
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
  if (rc) die("elastic: job B", gmb_last_error(b));
  printf("elastic.quota a_cached=1.5GiB b_asks=1GiB quota=2GiB served_ms=%.1f\n",
         ms);
  gmb_free_async(b, p, NULL);
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
    for (long i = 0; i < runs; i++) {
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
      if (rc) die("elastic.device: job B", gmb_last_error(b));
      /* Everything back, for the next run: B's memory, and A. */
      if (cached) {
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
  run_transformer(1, steps, rtt);
  run_transformer(0, steps / 4 > 0 ? steps / 4 : 1, rtt);
  run_serving(ops, rtt);
  run_elastic();
  /* The full-device case on a device of its own size, with the broker's
   * defaults (trim_wait_ms 100). */
  broker_stop();
  broker_start("host:2GiB", "");
  run_elastic_device(rtt);
  cleanup();
  return 0;
}
