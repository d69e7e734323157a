/*
 * bench_shim.c - what libgmb-torch.so (the allocator PyTorch's
 * CUDAPluggableAllocator calls) adds to an alloc+free pair over the
 * stream-ordered cache it rides on (gmb_malloc_async + gmb_free_async
 * called directly), on the same pattern in the same process and run.
 *
 * A real gmb-broker runs on the host device ($GMB_BUILD_DIR/gmb-broker) in
 * a temporary run dir.  The direct side is a session of this program's
 * own (libgmb.a); the shim side is libgmb-torch.so loaded as PyTorch loads
 * it (dlopen by path, the C entry points by name), with its own session of
 * the same broker (GMB_SHIM_ALLOW_HOST=1: the host device is what this
 * machine has).  Both allocate on one stream (NULL), so no event is ever
 * recorded and the figures are the allocator's bookkeeping alone.
 *
 * Two patterns, each a "step" of pairs timed as a whole (one clock read
 * per step, not per pair: a clock read costs about as much as the pair
 * itself), the direct and the shim steps alternating so that load from
 * elsewhere on the machine falls on both:
 *   - transformer: 24 layers x 3 activations of 512 B..8 MiB (log-uniform,
 *     the same every step), each with a temporary of the same size made
 *     and freed beside it, the activations freed in reverse after the step
 *     (144 pairs a step; bench_cache's pattern);
 *   - hot: 1000 pairs of one 4 KiB block made and freed at once.
 * BENCH_SHIM_STEPS (200) measured steps of each side after 20 of warm-up.
 * Printed per pattern: the median over steps of ns per pair of each side
 * and shim/direct (the goal: <= 1.2).
 *
 * Output: "key=value" lines (docs/benchmarks.md).  Exit status 0, or 1
 * when anything failed.
 */
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "gmb.h"

static char dir[64], endpoint[128];
static pid_t broker = -1;

typedef void *(*torch_alloc_fn)(ssize_t size, int device, void *stream);
typedef void (*torch_free_fn)(void *ptr, ssize_t size, int device,
                              void *stream);
typedef const char *(*torch_err_fn)(void);
static torch_alloc_fn t_alloc;
static torch_free_fn t_free;
static torch_err_fn t_err;
static gmb_client *direct;

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static long env_long(const char *name, long def) {
  const char *s = getenv(name);
  long v = s && *s ? strtol(s, NULL, 10) : def;
  return v > 0 ? v : def;
}

static void cleanup(void) {
  if (broker > 0) kill(broker, SIGTERM), waitpid(broker, NULL, 0);
  broker = -1;
  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
  if (dir[0] && system(cmd) != 0) fprintf(stderr, "could not remove %s\n", dir);
}

static void die(const char *what, const char *why) {
  fprintf(stderr, "bench_shim: %s: %s\n", what, why);
  cleanup();
  exit(1);
}

static const char *build_dir(void) {
  const char *b = getenv("GMB_BUILD_DIR");
  return b && *b ? b : "build";
}

static void broker_start(void) {
  char bin[PATH_MAX];
  snprintf(bin, sizeof bin, "%s/gmb-broker", build_dir());
  broker = fork();
  if (broker < 0) die("fork", strerror(errno));
  if (broker == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    int fd = open("/dev/null", O_WRONLY);
    if (fd >= 0) dup2(fd, 2);
    execl(bin, "gmb-broker", "--device", "host:2GiB", "--run-dir", dir,
          "--log-level", "error", (char *)NULL);
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

static void torch_load(void) {
  setenv("GMB_ENDPOINT", endpoint, 1);
  setenv("GMB_TENANT", "bench", 1);
  setenv("GMB_SHIM_ALLOW_HOST", "1", 1);
  char path[PATH_MAX];
  snprintf(path, sizeof path, "%s/libgmb-torch.so", build_dir());
  void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (h == NULL) die("dlopen", dlerror());
  *(void **)&t_alloc = dlsym(h, "gmb_torch_alloc_nothrow");
  *(void **)&t_free = dlsym(h, "gmb_torch_free");
  *(void **)&t_err = dlsym(h, "gmb_torch_last_error");
  if (!t_alloc || !t_free || !t_err) die(path, "a gmb_torch_* symbol is missing");
}

/* --- the two sides -------------------------------------------------------- */

static inline void *side_alloc(int shim, size_t n) {
  void *p = NULL;
  if (shim) {
    p = t_alloc((ssize_t)n, 0, NULL);
    if (p == NULL) die("gmb_torch_alloc", t_err());
  } else if (gmb_malloc_async(direct, n, NULL, &p) != 0) {
    die("gmb_malloc_async", gmb_last_error(direct));
  }
  return p;
}

static inline void side_free(int shim, void *p, size_t n) {
  if (shim)
    t_free(p, (ssize_t)n, 0, NULL);
  else if (gmb_free_async(direct, p, NULL) != 0)
    die("gmb_free_async", gmb_last_error(direct));
}

/* --- the patterns ----------------------------------------------------------- */

#define LAYERS 24
#define ACTS (LAYERS * 3)
#define HOT_PAIRS 1000

static size_t tf_sizes[ACTS];

static uint64_t rng_state = 7;
static uint64_t rnd(void) {
  uint64_t z = (rng_state += UINT64_C(0x9e3779b97f4a7c15));
  z = (z ^ (z >> 30)) * UINT64_C(0xbf58476d1ce4e5b9);
  z = (z ^ (z >> 27)) * UINT64_C(0x94d049bb133111eb);
  return z ^ (z >> 31);
}

/* One step; returns ns per pair. */
static double tf_step(int shim) {
  void *act[ACTS];
  uint64_t t0 = now_ns();
  for (int i = 0; i < ACTS; i++) {
    act[i] = side_alloc(shim, tf_sizes[i]);
    void *tmp = side_alloc(shim, tf_sizes[i]);
    side_free(shim, tmp, tf_sizes[i]);
  }
  for (int i = ACTS - 1; i >= 0; i--) side_free(shim, act[i], tf_sizes[i]);
  return (double)(now_ns() - t0) / (2.0 * ACTS);
}

static double hot_step(int shim) {
  uint64_t t0 = now_ns();
  for (int i = 0; i < HOT_PAIRS; i++) side_free(shim, side_alloc(shim, 4096), 4096);
  return (double)(now_ns() - t0) / HOT_PAIRS;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static void run(const char *name, double (*step)(int), long steps) {
  double *v[2];
  for (int s = 0; s < 2; s++) {
    v[s] = malloc((size_t)steps * sizeof *v[s]);
    if (v[s] == NULL) die("malloc", "out of memory");
  }
  for (long i = -20; i < steps; i++) {
    for (int s = 0; s < 2; s++) { /* direct, then the shim */
      double ns = step(s);
      if (i >= 0) v[s][i] = ns;
    }
  }
  double med[2];
  for (int s = 0; s < 2; s++) {
    qsort(v[s], (size_t)steps, sizeof *v[s], cmp_double);
    med[s] = v[s][steps / 2];
    free(v[s]);
  }
  printf("shim.%s steps=%ld direct_pair_ns=%.1f torch_pair_ns=%.1f "
         "ratio=%.3f (goal <= 1.2)\n", name, steps, med[0], med[1],
         med[1] / med[0]);
}

int main(void) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  snprintf(dir, sizeof dir, "/tmp/gmb-bench-shim-XXXXXX");
  if (mkdtemp(dir) == NULL) die("mkdtemp", strerror(errno));
  snprintf(endpoint, sizeof endpoint, "ipc://%s/broker.sock", dir);
  for (int i = 0; i < ACTS; i++) {
    double u = (double)(rnd() >> 11) / 9007199254740992.0;
    tf_sizes[i] = (size_t)exp(log(512.0) + u * (log(8 * 1048576.0) - log(512.0)));
  }
  broker_start();
  if (gmb_connect(endpoint, "bench", &direct) != 0)
    die("connect", gmb_last_error(NULL));
  torch_load();
  long steps = env_long("BENCH_SHIM_STEPS", 200);
  run("transformer", tf_step, steps);
  run("hot", hot_step, steps);
  gmb_disconnect(direct);
  cleanup();
  return 0;
}
