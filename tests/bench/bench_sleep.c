/*
 * bench_sleep.c - sleep and wake across processes, against a real
 * gmb-broker on the host device ($GMB_BUILD_DIR/gmb-broker, a temporary
 * run dir), with real client processes.
 *
 * sleep.ask: an idle job (a forked process, sleep policy "idle=0") holds
 * BENCH_ASK_MIB (96) MiB in one tag on a device of 128 MiB; this process,
 * another tenant, asks for 64 MiB with gmb_alloc, which fits only once
 * the broker has asked the idle job to pause and it did.  Baseline of the
 * same run: the idle job's own gmb_pause of the same tag (offload) timed
 * just before (then resumed).  BENCH_ASK_RUNS (7) runs, a fresh job each;
 * printed: the medians of the request's time to served and of the
 * offload, and their difference (goal: served within offload + 50 ms).
 *
 * sleep.oversub: three jobs, each with a working set of 2.5 / 3 of the
 * device (BENCH_OVERSUB_DEV_MIB, 128) in one tag and the policy
 * "idle=0", take turns (BENCH_OVERSUB_TURNS, 9, round robin): at its
 * turn a job allocates 512 B with its tag current, which resumes the tag
 * by itself (the broker asks the idle jobs to pause for the room), checks
 * every byte of its working set against the pattern it wrote last, and
 * writes a new one.  Printed: allocations refused (OOMs), pages found
 * wrong, and the time each turn waited for its memory (median, max; the
 * first turn of each job allocates its working set instead), beside the
 * time to copy one working set in this run (memcpy into fresh memory): a
 * turn costs at least two such copies, the idle job's offload and its own
 * restore.
 *
 * sleep.broker_offload: the broker's own offload of movable allocations.  An
 * idle job (sleep policy "idle=0", a 4 KiB block in its tag "w" for the
 * offer) holds BENCH_OFFLOAD_MIB (64) MiB of movable allocations (gmb_alloc
 * GMB_MOVABLE, 1 MiB each) on a device of BENCH_OFFLOAD_MIB * 2 MiB that
 * this process (another tenant, higher priority) then fills but for one
 * request of BENCH_OFFLOAD_MIB MiB, which fits only once the broker copied
 * all of them to its host memory (sleep_wait_ms 0: nobody is asked).
 * Then this process frees, and the job locks each allocation once, which
 * brings it back, and checks its bytes.  Baseline of the same run, the
 * same bytes: the job's plain copies of its allocations into fresh host
 * memory, and of those into fresh memory again (memcpy, as the host
 * device's offload and restore copies into fresh pages).  Printed:
 * medians over BENCH_OFFLOAD_RUNS (5) runs of the offload's time (the
 * request's time to served less the same request's time in the same run
 * while there was room) and of the locks' total time, each against its
 * copy, as ratios (copy / broker; goal >= 0.7).
 *
 * sleep.bandwidth: gmb_pause (offload) and gmb_resume of one tag in one
 * process, at BENCH_BW_MIB (64,256) MiB in blocks of 16 MiB, against
 * plain copies of the same bytes between the same kinds of memory in the
 * same run, alternated (gmb's first on odd runs), BENCH_BW_RUNS (5) runs,
 * medians.  Offload's baseline: memcpy from the tag's blocks (device
 * memory) into a host buffer touched beforehand, as a cuMemcpyDtoH into
 * pinned memory allocated ahead.  Restore's: the same bytes into device
 * memory just allocated (gmb_alloc of the same size; its pages populated
 * and copied into, as a resume's new pages are), and, for the record,
 * into the blocks' own warm pages.  Printed: the medians and their ratios
 * as bandwidths (copy time over gmb's time; goal >= 0.7), and the first
 * offload on its own (its host buffer fresh; later ones reuse it).  Every
 * block's bytes are checked after each resume.
 *
 * BENCH_ONLY: a comma-separated list of the parts to run (ask, oversub,
 * bandwidth, offload); unset: all.
 *
 * Output: "key=value" lines (docs/benchmarks.md).  Exit status 0, or 1
 * when anything failed.
 */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "gmb.h"

static char dir[64], endpoint[128];
static pid_t broker = -1;
static int failed;

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
  if (broker > 0) kill(broker, SIGTERM), waitpid(broker, NULL, 0);
  broker = -1;
  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
  if (dir[0] && system(cmd) != 0) fprintf(stderr, "could not remove %s\n", dir);
}

static void die(const char *what, const char *why) {
  fprintf(stderr, "bench_sleep: %s: %s\n", what, why);
  cleanup();
  exit(1);
}

static void soft_fail(const char *what, const char *why) {
  fprintf(stderr, "bench_sleep: %s: %s\n", what, why);
  printf("%s failed: %s\n", what, why);
  failed = 1;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static double median(double *v, size_t n) {
  qsort(v, n, sizeof *v, cmp_double);
  return n ? v[n / 2] : 0;
}

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

/* Pipes between this process and a job: one byte or one double. */
static int put(int fd, const void *p, size_t n) {
  return write(fd, p, n) == (ssize_t)n ? 0 : -1;
}
static int get(int fd, void *p, size_t n) {
  size_t got = 0;
  while (got < n) {
    ssize_t r = read(fd, (char *)p + got, n - got);
    if (r <= 0) return -1;
    got += (size_t)r;
  }
  return 0;
}

static pid_t fork_job(int (*fn)(int in, int out, void *arg), void *arg,
                      int *to, int *from) {
  int a[2], b[2];
  if (pipe(a) || pipe(b)) die("pipe", strerror(errno));
  pid_t pid = fork();
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    close(a[1]);
    close(b[0]);
    _exit(fn(a[0], b[1], arg));
  }
  close(a[0]);
  close(b[1]);
  *to = a[1];
  *from = b[0];
  return pid;
}

static void fill(unsigned char *p, size_t n, unsigned seed) {
  for (size_t i = 0; i < n; i += 4096) p[i] = (unsigned char)(seed + i / 4096);
  p[n - 1] = (unsigned char)seed;
}

static long check(const unsigned char *p, size_t n, unsigned seed) {
  for (size_t i = 0; i < n; i += 4096)
    if (p[i] != (unsigned char)(seed + i / 4096)) return (long)i;
  return p[n - 1] == (unsigned char)seed ? -1 : (long)(n - 1);
}

/* --- sleep.ask ------------------------------------------------------------- */

#define BLK (UINT64_C(8) << 20)

static int ask_job(int in, int out, void *arg) {
  size_t bytes = *(size_t *)arg, n = bytes / BLK;
  gmb_client *c;
  if (gmb_connect(endpoint, "idle", &c)) return 2;
  void **b = calloc(n, sizeof *b);
  if (b == NULL || gmb_cache_tag(c, "w")) return 3;
  for (size_t i = 0; i < n; i++) {
    if (gmb_malloc_async(c, BLK, NULL, &b[i])) return 4;
    memset(b[i], (int)i + 1, BLK);
  }
  /* The baseline: the same tag's offload, by the job itself. */
  uint64_t t0 = now_ns();
  if (gmb_pause(c, "w", GMB_PAUSE_OFFLOAD)) return 5;
  double pause_ms = (double)(now_ns() - t0) / 1e6;
  if (gmb_resume(c, "w")) return 6;
  if (gmb_sleep_policy_set(c, "idle=0,w")) return 7;
  if (put(out, &pause_ms, sizeof pause_ms)) return 8;
  char cmd;
  if (get(in, &cmd, 1)) return 9;
  gmb_disconnect(c);
  return 0;
}

/* Waits until the idle job's bytes are on the device (the device's use, as
 * our own Stats shows it), then a few of its library's ticks, so that its
 * offer has been reported. */
static int offer_waited(gmb_client *c, uint64_t want_used) {
  for (int i = 0; i < 500; i++) {
    gmb_device_stats d;
    if (gmb_device_stats_get(c, &d) == 0 && d.used >= want_used) {
      usleep(60000); /* a few library ticks: the offer is reported */
      return 1;
    }
    usleep(10000);
  }
  return 0;
}

static void run_ask(void) {
  const size_t bytes = (size_t)env_long("BENCH_ASK_MIB", 96) << 20;
  const long runs = env_long("BENCH_ASK_RUNS", 7);
  broker_start("host:128MiB", "[broker]\nsleep_wait_ms = 8000\n"
                              "[tenant:idle]\npriority = 0\n"
                              "[tenant:busy]\npriority = 10\n");
  double *served = calloc((size_t)runs, sizeof *served);
  double *offload = calloc((size_t)runs, sizeof *offload);
  long ok = 0;
  for (long r = 0; r < runs; r++) {
    int to, from;
    size_t arg = bytes;
    pid_t kid = fork_job(ask_job, &arg, &to, &from);
    double pause_ms;
    gmb_client *c;
    if (get(from, &pause_ms, sizeof pause_ms) ||
        gmb_connect(endpoint, "busy", &c)) {
      soft_fail("sleep.ask", "the idle job did not start");
      kill(kid, SIGKILL);
      waitpid(kid, NULL, 0);
      break;
    }
    offer_waited(c, bytes);
    gmb_id id;
    uint64_t t0 = now_ns();
    int rc = gmb_alloc(c, 64u << 20, 0, &id);
    double ms = (double)(now_ns() - t0) / 1e6;
    if (rc) {
      soft_fail("sleep.ask", gmb_last_error(c));
    } else {
      served[ok] = ms;
      offload[ok++] = pause_ms;
      gmb_free(c, id);
    }
    gmb_disconnect(c);
    put(to, "q", 1);
    waitpid(kid, NULL, 0);
    close(to);
    close(from);
    if (rc) break;
  }
  if (ok) {
    double s = median(served, (size_t)ok), o = median(offload, (size_t)ok);
    printf("sleep.ask bytes=%zu runs=%ld served_ms=%.2f offload_ms=%.2f "
           "served_minus_offload_ms=%.2f (goal <= 50)\n", bytes, ok, s, o,
           s - o);
  }
  free(served);
  free(offload);
  broker_stop();
}

/* --- sleep.oversub ------------------------------------------------------ */

struct over {
  size_t ws; /* bytes of the working set */
  int id;
};

/* One job: on 't' a turn; answers [oom, wrong, wait_ms]. */
static int over_job(int in, int out, void *arg) {
  const struct over *o = arg;
  size_t n = o->ws / (UINT64_C(2) << 20);
  const size_t blk = UINT64_C(2) << 20;
  gmb_client *c;
  if (gmb_connect(endpoint, o->id == 0 ? "j0" : o->id == 1 ? "j1" : "j2",
                  &c))
    return 2;
  if (gmb_sleep_policy_set(c, "idle=0,ws") || gmb_cache_tag(c, "ws")) return 3;
  void **b = calloc(n, sizeof *b);
  if (b == NULL) return 4;
  unsigned seed = 0;
  for (;;) {
    char cmd;
    if (get(in, &cmd, 1) || cmd != 't') break;
    double res[3] = {0, 0, 0};
    uint64_t t0 = now_ns();
    if (seed == 0) {
      for (size_t i = 0; i < n && !res[0]; i++)
        res[0] = gmb_malloc_async(c, blk, NULL, &b[i]) != 0;
    } else {
      void *x;
      res[0] = gmb_malloc_async(c, 512, NULL, &x) != 0;
      if (!res[0]) gmb_free_async(c, x, NULL);
    }
    res[2] = (double)(now_ns() - t0) / 1e6;
    if (res[0]) fprintf(stderr, "job %d: %s\n", o->id, gmb_last_error(c));
    for (size_t i = 0; !res[0] && seed && i < n; i++)
      res[1] += check(b[i], blk, seed * 131 + (unsigned)i) >= 0;
    seed++;
    for (size_t i = 0; !res[0] && i < n; i++)
      fill(b[i], blk, seed * 131 + (unsigned)i);
    if (put(out, res, sizeof res)) break;
  }
  gmb_disconnect(c);
  return 0;
}

static void run_oversub(void) {
  const size_t dev = (size_t)env_long("BENCH_OVERSUB_DEV_MIB", 128) << 20;
  const long turns = env_long("BENCH_OVERSUB_TURNS", 9);
  /* 2.5 / 3 of the device each, in whole 2 MiB pages. */
  size_t ws = (dev * 5 / 6 + (UINT64_C(2) << 20) - 1) & ~((UINT64_C(2) << 20) - 1);
  char devs[64];
  snprintf(devs, sizeof devs, "host:%zuMiB", dev >> 20);
  broker_start(devs, "[broker]\nsleep_wait_ms = 8000\n");
  struct over o[3];
  int to[3], from[3];
  pid_t kid[3];
  for (int j = 0; j < 3; j++) {
    o[j] = (struct over){ws, j};
    kid[j] = fork_job(over_job, &o[j], &to[j], &from[j]);
  }
  double *wait = calloc((size_t)turns, sizeof *wait);
  long ooms = 0, wrong = 0, nw = 0;
  double maxw = 0;
  for (long t = 0; t < turns; t++) {
    int j = (int)(t % 3);
    double res[3];
    if (put(to[j], "t", 1) || get(from[j], res, sizeof res)) {
      soft_fail("sleep.oversub", "a job died");
      break;
    }
    ooms += res[0] != 0;
    wrong += (long)res[1];
    if (t >= 3) {
      wait[nw++] = res[2];
      if (res[2] > maxw) maxw = res[2];
    }
  }
  for (int j = 0; j < 3; j++) {
    put(to[j], "q", 1);
    waitpid(kid[j], NULL, 0);
    close(to[j]);
    close(from[j]);
  }
  /* The baseline: one working set copied into fresh memory, this run. */
  char *src = malloc(ws), *dst = malloc(ws);
  double copy_ms = 0;
  if (src && dst) {
    memset(src, 1, ws);
    uint64_t t0 = now_ns();
    memcpy(dst, src, ws);
    copy_ms = (double)(now_ns() - t0) / 1e6;
    /* Read back, so that the copy is not optimised away. */
    if (((volatile char *)dst)[ws / 2] != 1) copy_ms = -1;
  }
  free(src);
  free(dst);
  double med = nw ? median(wait, (size_t)nw) : 0;
  printf("sleep.oversub device=%zu working_set=%zu jobs=3 sum_over_device="
         "%.2f turns=%ld ooms=%ld wrong_pages=%ld wait_median_ms=%.2f "
         "wait_max_ms=%.2f copy_one_set_ms=%.2f "
         "wait_over_two_copies=%.2f\n", dev, ws,
         3.0 * (double)ws / (double)dev, turns, ooms, wrong, med, maxw,
         copy_ms, copy_ms > 0 ? med / (2 * copy_ms) : 0);
  if (ooms || wrong) failed = 1;
  free(wait);
  broker_stop();
}

/* --- sleep.broker_offload ----------------------------------------------------- */

static int offl_job(int in, int out, void *arg) {
  size_t n = *(size_t *)arg;
  gmb_client *c;
  if (gmb_connect(endpoint, "idle", &c)) return 2;
  if (gmb_sleep_policy_set(c, "idle=0,w")) return 3;
  void *w;
  if (gmb_cache_tag(c, "w") || gmb_malloc_async(c, 4096, NULL, &w) ||
      gmb_cache_tag(c, NULL))
    return 4;
  gmb_id *id = calloc(n, sizeof *id);
  unsigned char **copy = calloc(n, sizeof *copy);
  if (id == NULL || copy == NULL) return 5;
  for (size_t i = 0; i < n; i++) {
    void *p;
    if (gmb_alloc(c, 1u << 20, GMB_MOVABLE, &id[i]) || gmb_lock(c, id[i], &p))
      return 6;
    fill(p, 1u << 20, (unsigned)i);
    gmb_unlock(c, id[i]);
  }
  /* The baseline: the same bytes copied out to fresh host memory and
   * back, as plain memcpy. */
  double t[2];
  uint64_t t0 = now_ns();
  for (size_t i = 0; i < n; i++) {
    void *p;
    if ((copy[i] = malloc(1u << 20)) == NULL || gmb_lock(c, id[i], &p))
      return 7;
    memcpy(copy[i], p, 1u << 20);
    gmb_unlock(c, id[i]);
  }
  t[0] = (double)(now_ns() - t0) / 1e6;
  /* Back: into fresh memory too, as a restore writes fresh pages. */
  unsigned char **again = calloc(n, sizeof *again);
  if (again == NULL) return 8;
  t0 = now_ns();
  for (size_t i = 0; i < n; i++) {
    if ((again[i] = malloc(1u << 20)) == NULL) return 8;
    memcpy(again[i], copy[i], 1u << 20);
  }
  t[1] = (double)(now_ns() - t0) / 1e6;
  for (size_t i = 0; i < n; i++) {
    free(copy[i]);
    free(again[i]);
  }
  free(again);
  if (put(out, t, sizeof t)) return 9;
  char cmd;
  if (get(in, &cmd, 1)) return 10;
  /* 'l': every allocation locked once (brought back), bytes checked. */
  double back[2] = {0, 0};
  t0 = now_ns();
  for (size_t i = 0; i < n; i++) {
    void *p;
    if (gmb_lock(c, id[i], &p)) {
      fprintf(stderr, "bench_sleep: lock: %s\n", gmb_last_error(c));
      back[1] = 1;
      break;
    }
    gmb_unlock(c, id[i]);
  }
  back[0] = (double)(now_ns() - t0) / 1e6;
  for (size_t i = 0; i < n && back[1] == 0; i++) {
    void *p;
    if (gmb_lock(c, id[i], &p) == 0) {
      if (check(p, 1u << 20, (unsigned)i) >= 0) back[1] = 2;
      gmb_unlock(c, id[i]);
    }
  }
  if (put(out, back, sizeof back)) return 11;
  if (get(in, &cmd, 1)) return 12;
  gmb_disconnect(c);
  return 0;
}

static void run_offload(void) {
  const size_t mib = (size_t)env_long("BENCH_OFFLOAD_MIB", 64);
  const long runs = env_long("BENCH_OFFLOAD_RUNS", 5);
  char devs[64];
  snprintf(devs, sizeof devs, "host:%zuMiB", 2 * mib);
  broker_start(devs, "[broker]\nsleep_wait_ms = 0\n"
                     "[tenant:idle]\npriority = 0\n"
                     "[tenant:busy]\npriority = 10\n");
  double *out_r = calloc((size_t)runs, sizeof *out_r);
  double *in_r = calloc((size_t)runs, sizeof *in_r);
  double *out_ms = calloc((size_t)runs, sizeof *out_ms);
  double *in_ms = calloc((size_t)runs, sizeof *in_ms);
  long ok = 0;
  for (long r = 0; r < runs; r++) {
    int to, from;
    size_t n = mib;
    pid_t kid = fork_job(offl_job, &n, &to, &from);
    double base[2], back[2];
    gmb_client *c = NULL;
    int rc = get(from, base, sizeof base) || gmb_connect(endpoint, "busy", &c);
    gmb_id fill_id = 0, id = 0;
    double plain_ms = 0;
    if (rc == 0) {
      offer_waited(c, (mib + 2) << 20);
      /* The same request while there is room: what serving it costs
       * besides the offload. */
      uint64_t t0 = now_ns();
      rc = gmb_alloc(c, mib << 20, 0, &id);
      plain_ms = (double)(now_ns() - t0) / 1e6;
      if (rc == 0) gmb_free(c, id);
      id = 0;
    }
    if (rc == 0) {
      /* All but the request's room: mib - 2 MiB (the job's cache page
       * takes the rest). */
      rc = gmb_alloc(c, (mib - 2) << 20, 0, &fill_id);
    }
    double ms = 0;
    if (rc == 0) {
      uint64_t t0 = now_ns();
      rc = gmb_alloc(c, mib << 20, 0, &id);
      ms = (double)(now_ns() - t0) / 1e6;
      if (rc) soft_fail("sleep.broker_offload", gmb_last_error(c));
    } else {
      soft_fail("sleep.broker_offload", "the jobs did not start");
    }
    if (fill_id) gmb_free(c, fill_id);
    if (id) gmb_free(c, id);
    if (rc == 0 && (put(to, "l", 1) || get(from, back, sizeof back) ||
                    back[1] != 0)) {
      soft_fail("sleep.broker_offload", "the job's bytes did not come back");
      rc = 1;
    }
    if (rc == 0) {
      ms = ms > plain_ms ? ms - plain_ms : ms;
      out_r[ok] = base[0] / ms;
      in_r[ok] = base[1] / back[0];
      out_ms[ok] = ms;
      in_ms[ok++] = back[0];
    }
    if (c) gmb_disconnect(c);
    put(to, "q", 1);
    waitpid(kid, NULL, 0);
    close(to);
    close(from);
    if (rc) break;
  }
  if (ok) {
    printf("sleep.broker_offload bytes=%zu runs=%ld offload_ms=%.2f "
           "offload_ratio=%.2f restore_ms=%.2f restore_ratio=%.2f "
           "(copy / broker, goal >= 0.7)\n", mib << 20, ok,
           median(out_ms, (size_t)ok), median(out_r, (size_t)ok),
           median(in_ms, (size_t)ok), median(in_r, (size_t)ok));
  }
  free(out_r);
  free(in_r);
  free(out_ms);
  free(in_ms);
  broker_stop();
}

/* --- sleep.bandwidth ------------------------------------------------------ */

static uint64_t bw_median(uint64_t *v, size_t n) {
  double *d = calloc(n, sizeof *d);
  if (d == NULL) return 0;
  for (size_t i = 0; i < n; i++) d[i] = (double)v[i];
  uint64_t m = (uint64_t)median(d, n);
  free(d);
  return m;
}

/* The restore's baseline: `bytes` from src into device memory just
 * allocated (new pages, as a resume's), populated first as the library
 * does for a resume.  Its time, or 0 on failure. */
static uint64_t bw_copy_fresh(gmb_client *c, const char *src, size_t bytes) {
  gmb_id id;
  void *p;
  if (gmb_alloc(c, bytes, 0, &id)) return 0;
  uint64_t t = 0;
  if (gmb_lock(c, id, &p) == 0) {
    uint64_t t0 = now_ns();
#ifdef MADV_POPULATE_WRITE
    (void)madvise(p, bytes, MADV_POPULATE_WRITE);
#endif
    memcpy(p, src, bytes);
    t = now_ns() - t0;
    gmb_unlock(c, id);
  }
  gmb_free(c, id);
  return t;
}

static void bw_one(size_t mib, long runs) {
  const size_t blk = UINT64_C(16) << 20, n = mib / 16 ? mib / 16 : 1;
  const size_t bytes = n * blk;
  gmb_client *c;
  if (gmb_connect(endpoint, "bw", &c)) {
    soft_fail("sleep.bandwidth", gmb_last_error(NULL));
    return;
  }
  void **b = calloc(n, sizeof *b);
  uint64_t *tp = calloc((size_t)runs, sizeof *tp);
  uint64_t *tr = calloc((size_t)runs, sizeof *tr);
  uint64_t *co = calloc((size_t)runs, sizeof *co);
  uint64_t *cf = calloc((size_t)runs, sizeof *cf);
  uint64_t *cw = calloc((size_t)runs, sizeof *cw);
  /* The plain copy's host buffer, touched beforehand. */
  char *host = malloc(bytes);
  int ok = b && tp && tr && co && cf && cw && host &&
           gmb_cache_tag(c, "w") == 0;
  if (ok) memset(host, 0, bytes);
  for (size_t i = 0; ok && i < n; i++) {
    ok = gmb_malloc_async(c, blk, NULL, &b[i]) == 0;
    if (ok) fill(b[i], blk, (unsigned)i * 7 + 1);
  }
  const char *why = "";
  for (long r = 0; ok && r < runs; r++) {
    for (int half = 0; ok && half < 2; half++) {
      if (half == (int)(r & 1)) {
        /* The plain copies: out, back into fresh and into warm pages. */
        uint64_t t0 = now_ns();
        for (size_t i = 0; i < n; i++) memcpy(host + i * blk, b[i], blk);
        co[r] = now_ns() - t0;
        cf[r] = bw_copy_fresh(c, host, bytes);
        t0 = now_ns();
        for (size_t i = 0; i < n; i++) memcpy(b[i], host + i * blk, blk);
        cw[r] = now_ns() - t0;
        ok = cf[r] != 0;
        why = "the fresh copy's allocation";
      } else {
        uint64_t t0 = now_ns();
        ok = gmb_pause(c, "w", GMB_PAUSE_OFFLOAD) == 0;
        uint64_t t1 = now_ns();
        ok = ok && gmb_resume(c, "w") == 0;
        uint64_t t2 = now_ns();
        tp[r] = t1 - t0;
        tr[r] = t2 - t1;
        why = gmb_last_error(c);
        for (size_t i = 0; ok && i < n; i++)
          if (check(b[i], blk, (unsigned)i * 7 + 1) >= 0) {
            ok = 0;
            why = "bytes changed across a pause";
          }
      }
    }
  }
  if (!ok) {
    soft_fail("sleep.bandwidth", why);
  } else {
    double mo = (double)bw_median(co, (size_t)runs);
    double mf = (double)bw_median(cf, (size_t)runs);
    double mw = (double)bw_median(cw, (size_t)runs);
    double mp = (double)bw_median(tp, (size_t)runs);
    double mr = (double)bw_median(tr, (size_t)runs);
    double gib = (double)bytes / (double)(UINT64_C(1) << 30);
    printf("sleep.bandwidth.offload bytes=%zu runs=%ld pause_ms=%.2f "
           "copy_out_ms=%.2f offload_over_copy=%.3f (goal >= 0.7) "
           "first_pause_ms=%.2f first_over_copy=%.3f (GiB/s %.2f vs %.2f)\n",
           bytes, runs, mp / 1e6, mo / 1e6, mo / mp, (double)tp[0] / 1e6,
           mo / (double)tp[0], gib / (mp / 1e9), gib / (mo / 1e9));
    printf("sleep.bandwidth.restore bytes=%zu runs=%ld resume_ms=%.2f "
           "copy_in_fresh_ms=%.2f restore_over_copy=%.3f (goal >= 0.7) "
           "copy_in_warm_ms=%.2f restore_over_warm=%.3f (GiB/s %.2f vs "
           "%.2f)\n", bytes, runs, mr / 1e6, mf / 1e6, mf / mr, mw / 1e6,
           mw / mr, gib / (mr / 1e9), gib / (mf / 1e9));
  }
  for (size_t i = 0; b && i < n; i++)
    if (b[i]) gmb_free_async(c, b[i], NULL);
  free(b);
  free(tp);
  free(tr);
  free(co);
  free(cf);
  free(cw);
  free(host);
  gmb_disconnect(c);
}

static void run_bandwidth(void) {
  const long runs = env_long("BENCH_BW_RUNS", 5);
  const char *list = getenv("BENCH_BW_MIB");
  char sizes[128];
  snprintf(sizes, sizeof sizes, "%s", list && *list ? list : "64,256");
  size_t most = 0;
  for (char *q = sizes; *q;) {
    size_t m = strtoul(q, &q, 10);
    most = m > most ? m : most;
    while (*q == ',') q++;
  }
  if (runs < 1 || most == 0) die("sleep.bandwidth", "BENCH_BW_RUNS or "
                                 "BENCH_BW_MIB is not a number");
  /* Room for the tag and the restore baseline's allocation. */
  char dev[64];
  snprintf(dev, sizeof dev, "host:%zuMiB", 2 * ((most + 15) / 16 * 16) + 64);
  broker_start(dev, "");
  for (char *q = sizes; *q;) {
    size_t m = strtoul(q, &q, 10);
    if (m) bw_one(m, runs);
    while (*q == ',') q++;
  }
  broker_stop();
}

/* BENCH_ONLY: the parts to run (a comma-separated list); unset: all. */
static int part(const char *name) {
  const char *only = getenv("BENCH_ONLY");
  if (only == NULL || only[0] == '\0') return 1;
  size_t n = strlen(name);
  for (const char *p = only; (p = strstr(p, name)) != NULL; p += n)
    if ((p == only || p[-1] == ',') && (p[n] == ',' || p[n] == '\0'))
      return 1;
  return 0;
}

int main(void) {
  snprintf(dir, sizeof dir, "/tmp/gmb-bench-sleep-XXXXXX");
  if (mkdtemp(dir) == NULL) die("mkdtemp", strerror(errno));
  snprintf(endpoint, sizeof endpoint, "ipc://%s/broker.sock", dir);
  if (part("ask")) run_ask();
  if (part("oversub")) run_oversub();
  if (part("bandwidth")) run_bandwidth();
  if (part("offload")) run_offload();
  cleanup();
  return failed;
}
