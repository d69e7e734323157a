/*
 * bench_alloc.c - what one allocation costs through the broker, measured
 * against the cost of the transport it rides on.
 *
 * The bench starts a real gmb-broker ($GMB_BUILD_DIR/gmb-broker, default
 * build/) on the host device in a temporary run dir, then, for 1, 4 and 16
 * client processes:
 *   - alloc_free: each process connects with libgmb and times BENCH_ITER
 *     pairs of gmb_alloc(4 KiB, pinned) + gmb_free;
 *   - raw_rtt: each process times BENCH_ITER round trips of a bare ZeroMQ
 *     DEALER to a ROUTER (in a forked process) that answers every message at
 *     once; the messages have the byte sizes of an encoded Alloc request and
 *     of its reply, so the only difference from alloc_free is what gmb adds
 *     (encoding, the broker's work, the library's bookkeeping).
 * An alloc+free pair is two round trips, so the figure of merit is
 * ratio_vs_2rtt = median(alloc+free) / (2 x median(raw round trip)) at the
 * same number of processes; the goal is <= 1.2.  The two kinds run in
 * alternating rounds (BENCH_ROUNDS, default 4), so that load from
 * elsewhere on the machine falls on both.
 *
 * Finally it measures the broker's memory per live allocation: one session
 * (speaking the wire protocol directly, with requests pipelined so that it
 * takes seconds, not minutes) holds BENCH_RSS_ALLOCS (200000) allocations of
 * 512 bytes, and the growth of the broker's RssAnon (anonymous resident
 * memory: its heap, from /proc/PID/status) is divided by their number.
 * RssAnon rather than VmRSS because the broker maps every host segment;
 * VmRSS is printed too for reference.
 *
 * Then gmb_lock + gmb_unlock of a movable allocation (no message: a CAS on
 * the session's lock table) beside a bare atomic increment + decrement of
 * one word, in the same run (lock_unlock_ns, atomic_pair_ns; goal: lock +
 * unlock <= 30 ns).
 *
 * Last, compaction under load: the broker is restarted on host:3GiB; one
 * session holds BENCH_COMPACT_MIB (1024) MiB of movable 1 MiB blocks, half
 * of them freed in a scattered way first, and an operator's AdminCompact
 * moves them while a probe process times the alloc and free requests of
 * another tenant.  Printed: the probe's worst and p99 request during it
 * beside the same before it (goal: no request waits more than 5 ms), and
 * the migration rate (bytes moved / compaction time) beside memcpy of the
 * same block size in this process (goal >= 70%).
 *
 * Every process the bench forks gets PR_SET_PDEATHSIG, so nothing outlives
 * it even when it crashes; the run dir is removed at the end.
 *
 * Output: plain "key=value" lines, one per figure (docs/benchmarks.md).
 * Exit status: 0, or 1 when anything failed (a refused allocation, a broker
 * that did not start, a worker that crashed).
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "gmb.h"
#include "wire.h"

#define BENCH_SIZE 4096        /* bytes of each timed allocation */
#define BENCH_RSS_SIZE 512     /* bytes of each allocation held for RSS */
#define BENCH_WINDOW 128       /* pipelined requests in flight (< HWM) */
#define BENCH_MAX_PROCS 16

static char bench_dir[64];     /* the temporary run dir */
static char bench_endpoint[128];
static char bench_echo_ep[128];
static pid_t bench_broker = -1, bench_echo = -1;
static uint8_t *bench_req_msg, *bench_rep_msg; /* sample Alloc messages */
static size_t bench_req_len, bench_rep_len;

/* What a worker writes back: its pairs' times and its span. */
struct bench_shared {
  uint64_t t_start[BENCH_MAX_PROCS], t_end[BENCH_MAX_PROCS];
  uint32_t ns[]; /* procs * iter */
};

static uint64_t bench_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Nanoseconds since t0, saturated: a sample over 4 s is still the worst. */
static uint32_t bench_ns32(uint64_t t0) {
  uint64_t d = bench_now() - t0;
  return d > UINT32_MAX ? UINT32_MAX : (uint32_t)d;
}

static long bench_env(const char *name, long def) {
  const char *s = getenv(name);
  if (s == NULL || *s == '\0') return def;
  char *end;
  long v = strtol(s, &end, 10);
  if (*end != '\0' || v <= 0) {
    fprintf(stderr, "bench_alloc: %s=%s is not a positive number\n", name, s);
    exit(2);
  }
  return v;
}

/* Children die with the bench, whatever happens to it. */
static void bench_child_setup(void) {
  prctl(PR_SET_PDEATHSIG, SIGTERM);
  if (getppid() == 1) _exit(1); /* the parent died before prctl */
}

static void bench_cleanup(void) {
  if (bench_echo > 0) {
    kill(bench_echo, SIGKILL);
    waitpid(bench_echo, NULL, 0);
    bench_echo = -1;
  }
  if (bench_broker > 0) {
    kill(bench_broker, SIGTERM);
    waitpid(bench_broker, NULL, 0);
    bench_broker = -1;
  }
  if (bench_dir[0]) {
    char path[128];
    const char *names[] = {"broker.log", "broker.sock", "admin.sock",
                           "echo.sock", "compact.ini"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
      snprintf(path, sizeof path, "%s/%s", bench_dir, names[i]);
      unlink(path);
    }
    rmdir(bench_dir);
    bench_dir[0] = '\0';
  }
}

static void bench_die(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void bench_die(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "bench_alloc: ");
  vfprintf(stderr, fmt, ap);
  fprintf(stderr, "\n");
  va_end(ap);
  char logp[128];
  snprintf(logp, sizeof logp, "%s/broker.log", bench_dir);
  struct stat st;
  if (bench_dir[0] && stat(logp, &st) == 0 && st.st_size > 0) {
    /* The broker's last words explain most failures. */
    char cmd[192];
    fprintf(stderr, "bench_alloc: the broker's last log lines:\n");
    snprintf(cmd, sizeof cmd, "tail -n 20 %s >&2", logp);
    if (system(cmd) != 0) { /* nothing more to say */ }
  }
  bench_cleanup();
  exit(1);
}

/* --- the broker --------------------------------------------------------- */

static const char *bench_device = "host:1GiB";
static const char *bench_config = NULL; /* a config file, or NULL */

static void bench_broker_start(void) {
  const char *bdir = getenv("GMB_BUILD_DIR");
  if (bdir == NULL || *bdir == '\0') bdir = "build";
  char bin[512], logp[128];
  snprintf(bin, sizeof bin, "%s/gmb-broker", bdir);
  if (access(bin, X_OK) != 0)
    bench_die("%s: %s (set GMB_BUILD_DIR)", bin, strerror(errno));
  snprintf(logp, sizeof logp, "%s/broker.log", bench_dir);
  bench_broker = fork();
  if (bench_broker < 0) bench_die("fork: %s", strerror(errno));
  if (bench_broker == 0) {
    bench_child_setup();
    int fd = open(logp, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
      dup2(fd, 1);
      dup2(fd, 2);
      close(fd);
    }
    if (bench_config)
      execl(bin, "gmb-broker", "--device", bench_device, "--run-dir",
            bench_dir, "--config", bench_config, "--log-level", "warn",
            (char *)NULL);
    else
      execl(bin, "gmb-broker", "--device", bench_device, "--run-dir",
            bench_dir, "--log-level", "warn", (char *)NULL);
    fprintf(stderr, "exec %s: %s\n", bin, strerror(errno));
    _exit(127);
  }
  /* Ready when a client gets a session; give it 10 s. */
  uint64_t deadline = bench_now() + 10000000000u;
  for (;;) {
    int st;
    if (waitpid(bench_broker, &st, WNOHANG) == bench_broker) {
      bench_broker = -1;
      bench_die("gmb-broker exited at start-up (status 0x%x)", st);
    }
    char sock[128];
    snprintf(sock, sizeof sock, "%s/broker.sock", bench_dir);
    if (access(sock, F_OK) == 0) {
      gmb_client *c;
      if (gmb_connect(bench_endpoint, "bench", &c) == 0) {
        gmb_disconnect(c);
        return;
      }
    }
    if (bench_now() > deadline) bench_die("gmb-broker did not start in 10 s");
    usleep(20000);
  }
}

/* --- lock + unlock -------------------------------------------------------- */

/* The best of five runs of `n` pairs: the figure least disturbed by the
 * rest of the machine. */
static void bench_lock(long n) {
  gmb_client *c;
  if (gmb_connect(bench_endpoint, "bench-lock", &c) != 0)
    bench_die("connect: %s", gmb_last_error(NULL));
  gmb_id id;
  if (gmb_alloc(c, BENCH_SIZE, GMB_MOVABLE, &id) != 0)
    bench_die("movable alloc: %s", gmb_last_error(c));
  void *p;
  if (gmb_lock(c, id, &p) != 0 || gmb_unlock(c, id) != 0) /* maps it */
    bench_die("lock: %s", gmb_last_error(c));
  static _Atomic uint32_t word;
  double best_lock = 1e30, best_atomic = 1e30;
  for (int r = 0; r < 5; r++) {
    uint64_t t0 = bench_now();
    for (long i = 0; i < n; i++) {
      if (gmb_lock(c, id, &p) != 0 || gmb_unlock(c, id) != 0)
        bench_die("lock: %s", gmb_last_error(c));
    }
    uint64_t t1 = bench_now();
    for (long i = 0; i < n; i++) {
      atomic_fetch_add_explicit(&word, 1, memory_order_acq_rel);
      atomic_fetch_sub_explicit(&word, 1, memory_order_release);
    }
    uint64_t t2 = bench_now();
    double l = (double)(t1 - t0) / (double)n;
    double a = (double)(t2 - t1) / (double)n;
    if (l < best_lock) best_lock = l;
    if (a < best_atomic) best_atomic = a;
  }
  printf("lock_unlock_ns=%.1f atomic_pair_ns=%.1f ratio=%.2f (movable, "
         "uncontended, best of 5 x %ld; goal lock_unlock_ns <= 30)\n",
         best_lock, best_atomic, best_lock / best_atomic, n);
  gmb_free(c, id);
  gmb_disconnect(c);
}

/* --- compaction under load ------------------------------------------------ */

static void bench_wire_send(void *d, struct wire_request *req);
static void bench_wire_recv(void *d, struct wire_reply *rep);
static int bench_cmp_u32(const void *a, const void *b);

#define BENCH_PROBE_MAX (1u << 20)

struct bench_probe {
  _Atomic int stop;
  _Atomic uint32_t n;
  uint64_t at[BENCH_PROBE_MAX]; /* when each request was answered */
  uint32_t ns[BENCH_PROBE_MAX]; /* how long it waited */
};

static void bench_probe_main(struct bench_probe *pr) {
  gmb_client *c;
  if (gmb_connect(bench_endpoint, "probe", &c) != 0) _exit(3);
  while (!atomic_load(&pr->stop)) {
    uint32_t i = atomic_load(&pr->n);
    if (i >= BENCH_PROBE_MAX) break;
    /* Each request on its own: the goal is about one request's wait. */
    uint64_t t0 = bench_now();
    gmb_id id;
    if (gmb_alloc(c, BENCH_SIZE, 0, &id) != 0) _exit(4);
    uint64_t t1 = bench_now();
    if (gmb_free(c, id) != 0) _exit(4);
    uint64_t t2 = bench_now();
    if (i + 1 >= BENCH_PROBE_MAX) break;
    pr->at[i] = t1;
    pr->ns[i] = (uint32_t)(t1 - t0 > UINT32_MAX ? UINT32_MAX : t1 - t0);
    pr->at[i + 1] = t2;
    pr->ns[i + 1] = (uint32_t)(t2 - t1 > UINT32_MAX ? UINT32_MAX : t2 - t1);
    atomic_store(&pr->n, i + 2);
  }
  gmb_disconnect(c);
  _exit(0);
}

/* Worst and p99 (µs) of the probe's requests answered within [from, to). */
static void bench_probe_stats(const struct bench_probe *pr, uint32_t n,
                              uint64_t from, uint64_t to, uint32_t *count,
                              double *max_us, double *p99_us) {
  uint32_t *v = malloc((n ? n : 1) * sizeof *v), k = 0;
  if (v == NULL) bench_die("out of memory");
  for (uint32_t i = 0; i < n; i++)
    if (pr->at[i] >= from && pr->at[i] < to) v[k++] = pr->ns[i];
  qsort(v, k, sizeof *v, bench_cmp_u32);
  *count = k;
  *max_us = k ? v[k - 1] / 1000.0 : 0;
  *p99_us = k ? v[(size_t)((double)k * 0.99)] / 1000.0 : 0;
  free(v);
}

/*
 * The host device's own copy bandwidth: memcpy between shm objects that a
 * client wrote through its mapping, from fresh mappings in this process,
 * as the broker meets segments (each 4 KiB page mapped on first touch).
 * Anonymous memory (the memcpy figure) is faster: it is already mapped,
 * often in 2 MiB pages.
 */
static double bench_shm_copy_gbs(size_t vol, size_t blk) {
  char name[2][64];
  int fd[2];
  for (int k = 0; k < 2; k++) {
    snprintf(name[k], sizeof name[k], "/gmb-bench-%d-%d", (int)getpid(), k);
    fd[k] = shm_open(name[k], O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd[k] < 0 || ftruncate(fd[k], (off_t)vol) != 0)
      bench_die("shm %s: %s", name[k], strerror(errno));
    void *w = mmap(NULL, vol, PROT_READ | PROT_WRITE, MAP_SHARED, fd[k], 0);
    if (w == MAP_FAILED) bench_die("mmap: %s", strerror(errno));
    memset(w, k + 1, vol); /* the "client" writes it */
    munmap(w, vol);
  }
  char *src = mmap(NULL, vol, PROT_READ, MAP_SHARED, fd[0], 0);
  char *dst = mmap(NULL, vol, PROT_READ | PROT_WRITE, MAP_SHARED, fd[1], 0);
  if (src == MAP_FAILED || dst == MAP_FAILED)
    bench_die("mmap: %s", strerror(errno));
  uint64_t t0 = bench_now();
  for (size_t o = 0; o + blk <= vol; o += blk) memcpy(dst + o, src + o, blk);
  uint64_t t1 = bench_now();
  munmap(src, vol);
  munmap(dst, vol);
  for (int k = 0; k < 2; k++) {
    close(fd[k]);
    shm_unlink(name[k]);
  }
  return (double)vol / (double)(t1 - t0);
}

static void bench_compact(long mib) {
  char cfg[128];
  snprintf(cfg, sizeof cfg, "%s/compact.ini", bench_dir);
  FILE *f = fopen(cfg, "w");
  if (f == NULL) bench_die("%s: %s", cfg, strerror(errno));
  /* Off: only the operator's request compacts, so the timing is ours. */
  fprintf(f, "[broker]\ncompaction = off\n");
  fclose(f);
  bench_device = "host:3GiB";
  bench_config = cfg;
  bench_broker_start();

  /* Twice the live size in 1 MiB movable blocks, every other one freed:
   * each 2 MiB segment half full, nothing free outside them. */
  gmb_client *c;
  if (gmb_connect(bench_endpoint, "big", &c) != 0)
    bench_die("connect: %s", gmb_last_error(NULL));
  long n = 2 * mib;
  gmb_id *ids = calloc((size_t)n, sizeof *ids);
  if (ids == NULL) bench_die("out of memory");
  for (long i = 0; i < n; i++) {
    void *p;
    if (gmb_alloc(c, 1u << 20, GMB_MOVABLE, &ids[i]) != 0 ||
        gmb_lock(c, ids[i], &p) != 0)
      bench_die("fill %ld: %s", i, gmb_last_error(c));
    memset(p, (int)(i & 0xff), 1u << 20);
    gmb_unlock(c, ids[i]);
  }
  for (long i = 0; i < n; i += 2) gmb_free(c, ids[i]);

  struct bench_probe *pr = mmap(NULL, sizeof *pr, PROT_READ | PROT_WRITE,
                                MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (pr == MAP_FAILED) bench_die("mmap: %s", strerror(errno));
  pid_t probe = fork();
  if (probe < 0) bench_die("fork: %s", strerror(errno));
  if (probe == 0) {
    bench_child_setup();
    bench_probe_main(pr);
  }
  while (atomic_load(&pr->n) < 2000) usleep(1000); /* a baseline first */

  char admin[128];
  snprintf(admin, sizeof admin, "ipc://%s/admin.sock", bench_dir);
  void *zctx = zmq_ctx_new(), *d = zmq_socket(zctx, ZMQ_DEALER);
  if (zmq_connect(d, admin) != 0) bench_die("connect %s", admin);
  struct wire_request req = {.id = 1, .kind = WIRE_ADMIN_COMPACT};
  uint64_t t_start = bench_now();
  bench_wire_send(d, &req);
  struct wire_reply rep;
  bench_wire_recv(d, &rep);
  uint64_t t_end = bench_now();
  if (rep.status != 0 || rep.kind != WIRE_ADMIN_COMPACT)
    bench_die("AdminCompact: %s", rep.message);
  /* A little after, so that the probe's figures have a tail to compare. */
  uint32_t before = atomic_load(&pr->n);
  while (atomic_load(&pr->n) < before + 200) usleep(1000);
  atomic_store(&pr->stop, 1);
  int st;
  waitpid(probe, &st, 0);
  if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
    bench_die("the probe failed (status 0x%x)", st);
  uint32_t total = atomic_load(&pr->n), k_during, k_base;
  double max_during, p99_during, max_base, p99_base;
  bench_probe_stats(pr, total, t_start, t_end, &k_during, &max_during,
                    &p99_during);
  bench_probe_stats(pr, total, 0, t_start, &k_base, &max_base, &p99_base);

  /* Every block still holds its byte. */
  long bad = 0;
  for (long i = 1; i < n; i += 2) {
    unsigned char *p;
    if (gmb_lock(c, ids[i], (void **)&p) != 0)
      bench_die("lock after: %s", gmb_last_error(c));
    if (p[0] != (unsigned char)(i & 0xff) ||
        p[(1u << 20) - 1] != (unsigned char)(i & 0xff))
      bad++;
    gmb_unlock(c, ids[i]);
  }
  if (bad) bench_die("%ld blocks corrupted by compaction", bad);

  /* memcpy of the same block size over the same volume, this process. */
  size_t blk = 1u << 20, vol = (size_t)rep.u.compact.bytes_moved;
  if (vol < 64 * blk) vol = 64 * blk;
  char *src = malloc(vol), *dst = malloc(vol);
  if (src == NULL || dst == NULL) bench_die("out of memory");
  memset(src, 1, vol);
  memset(dst, 2, vol);
  uint64_t m0 = bench_now();
  for (size_t o = 0; o + blk <= vol; o += blk) memcpy(dst + o, src + o, blk);
  uint64_t m1 = bench_now();
  double memcpy_gbs = (double)vol / (double)(m1 - m0);
  free(src);
  free(dst);
  double shm_gbs = bench_shm_copy_gbs(vol, blk);
  double mig_gbs = rep.u.compact.seconds > 0
                       ? (double)rep.u.compact.bytes_moved /
                             (rep.u.compact.seconds * 1e9)
                       : 0;
  printf("compact.live_mib=%ld moves=%llu bytes_moved=%llu "
         "segments_released=%llu compaction_s=%.3f wall_s=%.3f\n",
         mib, (unsigned long long)rep.u.compact.moves,
         (unsigned long long)rep.u.compact.bytes_moved,
         (unsigned long long)rep.u.compact.segments_released,
         rep.u.compact.seconds, (double)(t_end - t_start) / 1e9);
  printf("compact.probe requests_during=%u max_us=%.1f p99_us=%.1f | "
         "before: requests=%u max_us=%.1f p99_us=%.1f (goal: max during <= "
         "5000)\n",
         k_during, max_during, p99_during, k_base, max_base, p99_base);
  printf("compact.migration_gbs=%.2f memcpy_gbs=%.2f ratio=%.2f (1 MiB "
         "blocks; goal >= 0.70)\n", mig_gbs, memcpy_gbs,
         memcpy_gbs > 0 ? mig_gbs / memcpy_gbs : 0);
  printf("compact.host_device_copy_gbs=%.2f ratio=%.2f (memcpy between shm "
         "objects written by another mapping, as the broker sees segments)\n",
         shm_gbs, shm_gbs > 0 ? mig_gbs / shm_gbs : 0);
  munmap(pr, sizeof *pr);
  zmq_close(d);
  zmq_ctx_term(zctx);
  free(ids);
  gmb_disconnect(c);
}

/* --- the bare echo ROUTER ---------------------------------------------- */

static void bench_echo_main(void) {
  void *ctx = zmq_ctx_new();
  void *r = zmq_socket(ctx, ZMQ_ROUTER);
  if (zmq_bind(r, bench_echo_ep) != 0) {
    fprintf(stderr, "bench_alloc: echo bind %s: %s\n", bench_echo_ep,
            zmq_strerror(errno));
    _exit(1);
  }
  uint8_t buf[4096];
  for (;;) {
    zmq_msg_t id;
    zmq_msg_init(&id);
    if (zmq_msg_recv(&id, r, 0) < 0) _exit(errno == EINTR ? 0 : 1);
    int n = zmq_recv(r, buf, sizeof buf, 0); /* the request */
    if (n < 0) _exit(1);
    zmq_msg_send(&id, r, ZMQ_SNDMORE);
    zmq_send(r, bench_rep_msg, bench_rep_len, 0);
  }
}

static void bench_echo_start(void) {
  bench_echo = fork();
  if (bench_echo < 0) bench_die("fork: %s", strerror(errno));
  if (bench_echo == 0) {
    bench_child_setup();
    bench_echo_main();
  }
}

/* --- workers ------------------------------------------------------------ */

enum bench_kind { BENCH_ALLOC_FREE, BENCH_RAW_RTT };

static int bench_alloc_worker(struct bench_shared *sh, int w, long iter,
                              long warm, int ready_fd, int start_fd) {
  gmb_client *c;
  if (gmb_connect(bench_endpoint, "bench", &c) != 0) {
    fprintf(stderr, "bench_alloc: worker %d: %s\n", w, gmb_last_error(NULL));
    return 1;
  }
  for (long i = 0; i < warm + iter; i++) {
    if (i == warm) {
      char b = 'r';
      if (write(ready_fd, &b, 1) != 1 || read(start_fd, &b, 1) != 0) return 1;
      sh->t_start[w] = bench_now();
    }
    uint64_t t0 = bench_now();
    gmb_id id;
    int rc = gmb_alloc(c, BENCH_SIZE, 0, &id);
    if (rc == 0) rc = gmb_free(c, id);
    if (rc) {
      fprintf(stderr, "bench_alloc: worker %d: %s\n", w, gmb_last_error(c));
      return 1;
    }
    if (i >= warm) sh->ns[(size_t)w * iter + (i - warm)] = bench_ns32(t0);
  }
  sh->t_end[w] = bench_now();
  gmb_disconnect(c);
  return 0;
}

static int bench_raw_worker(struct bench_shared *sh, int w, long iter,
                            long warm, int ready_fd, int start_fd) {
  void *ctx = zmq_ctx_new();
  void *d = zmq_socket(ctx, ZMQ_DEALER);
  int zero = 0;
  zmq_setsockopt(d, ZMQ_LINGER, &zero, sizeof zero);
  if (zmq_connect(d, bench_echo_ep) != 0) return 1;
  uint8_t buf[4096];
  for (long i = 0; i < warm + iter; i++) {
    if (i == warm) {
      char b = 'r';
      if (write(ready_fd, &b, 1) != 1 || read(start_fd, &b, 1) != 0) return 1;
      sh->t_start[w] = bench_now();
    }
    uint64_t t0 = bench_now();
    if (zmq_send(d, bench_req_msg, bench_req_len, 0) < 0 ||
        zmq_recv(d, buf, sizeof buf, 0) != (int)bench_rep_len) {
      fprintf(stderr, "bench_alloc: raw worker %d: %s\n", w,
              zmq_strerror(errno));
      return 1;
    }
    if (i >= warm) sh->ns[(size_t)w * iter + (i - warm)] = bench_ns32(t0);
  }
  sh->t_end[w] = bench_now();
  zmq_close(d);
  zmq_ctx_term(ctx);
  return 0;
}

/* Samples of one kind at one number of processes, gathered over rounds. */
struct bench_samples {
  uint32_t *ns;
  size_t n;
  double secs; /* the rounds' spans, first start to last end, summed */
};

/* Runs `procs` workers of `kind` together, each timing `iter` operations
 * after a warm-up; all start at once, released by closing a pipe.  The
 * times are appended to *out. */
static void bench_run(enum bench_kind kind, int procs, long iter,
                      struct bench_samples *out) {
  size_t n = (size_t)procs * (size_t)iter;
  size_t bytes = sizeof(struct bench_shared) + n * sizeof(uint32_t);
  struct bench_shared *sh = mmap(NULL, bytes, PROT_READ | PROT_WRITE,
                                 MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (sh == MAP_FAILED) bench_die("mmap: %s", strerror(errno));
  int ready[2], start[2];
  if (pipe(ready) || pipe(start)) bench_die("pipe: %s", strerror(errno));
  long warm = iter / 10 < 200 ? iter / 10 : 200;
  pid_t pids[BENCH_MAX_PROCS];
  for (int w = 0; w < procs; w++) {
    pids[w] = fork();
    if (pids[w] < 0) bench_die("fork: %s", strerror(errno));
    if (pids[w] == 0) {
      bench_child_setup();
      close(ready[0]);
      close(start[1]);
      int rc = kind == BENCH_ALLOC_FREE
                   ? bench_alloc_worker(sh, w, iter, warm, ready[1], start[0])
                   : bench_raw_worker(sh, w, iter, warm, ready[1], start[0]);
      _exit(rc);
    }
  }
  close(ready[1]);
  close(start[0]);
  int got = 0;
  char b;
  while (got < procs && read(ready[0], &b, 1) == 1) got++;
  close(start[1]); /* go */
  close(ready[0]);
  int failed = got < procs;
  for (int w = 0; w < procs; w++) {
    int st;
    waitpid(pids[w], &st, 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) failed = 1;
  }
  if (failed)
    bench_die("%s with %d processes: a worker failed",
              kind == BENCH_ALLOC_FREE ? "alloc_free" : "raw_rtt", procs);
  uint64_t t0 = UINT64_MAX, t1 = 0;
  for (int w = 0; w < procs; w++) {
    if (sh->t_start[w] < t0) t0 = sh->t_start[w];
    if (sh->t_end[w] > t1) t1 = sh->t_end[w];
  }
  memcpy(out->ns + out->n, sh->ns, n * sizeof sh->ns[0]);
  out->n += n;
  out->secs += (double)(t1 - t0) / 1e9;
  munmap(sh, bytes);
}

static int bench_cmp_u32(const void *a, const void *b) {
  uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
  return x < y ? -1 : x > y;
}

struct bench_result {
  double median_us, p99_us, per_s;
};

static struct bench_result bench_stats(struct bench_samples *s) {
  qsort(s->ns, s->n, sizeof s->ns[0], bench_cmp_u32);
  struct bench_result r;
  r.median_us = s->ns[s->n / 2] / 1000.0;
  r.p99_us = s->ns[(size_t)((double)s->n * 0.99)] / 1000.0;
  r.per_s = (double)s->n / s->secs;
  return r;
}

/* --- the broker's memory per allocation --------------------------------- */

/* The broker's RssAnon and VmRSS in bytes. */
static void bench_broker_rss(uint64_t *anon, uint64_t *rss) {
  char path[64], line[256];
  snprintf(path, sizeof path, "/proc/%d/status", (int)bench_broker);
  FILE *f = fopen(path, "r");
  if (f == NULL) bench_die("%s: %s", path, strerror(errno));
  *anon = *rss = 0;
  unsigned long long kb;
  while (fgets(line, sizeof line, f)) {
    if (sscanf(line, "RssAnon: %llu kB", &kb) == 1) *anon = kb * 1024;
    if (sscanf(line, "VmRSS: %llu kB", &kb) == 1) *rss = kb * 1024;
  }
  fclose(f);
  if (*rss == 0) bench_die("no VmRSS in %s", path);
}

static void bench_wire_send(void *d, struct wire_request *req) {
  uint8_t *buf;
  size_t len;
  if (gmb__wire_request_encode(req, &buf, &len) != 0)
    bench_die("cannot encode a request");
  if (zmq_send(d, buf, len, 0) < 0)
    bench_die("send: %s", zmq_strerror(errno));
  free(buf);
}

static void bench_wire_recv(void *d, struct wire_reply *rep) {
  uint8_t buf[8192];
  int n = zmq_recv(d, buf, sizeof buf, 0);
  if (n < 0) bench_die("recv: %s (did the broker die?)", zmq_strerror(errno));
  if ((size_t)n > sizeof buf) bench_die("reply of %d bytes", n);
  if (gmb__wire_reply_decode(buf, (size_t)n, rep) != 0)
    bench_die("a reply did not decode");
}

static void bench_rss(long count) {
  void *ctx = zmq_ctx_new();
  void *d = zmq_socket(ctx, ZMQ_DEALER);
  int zero = 0, tmo = 10000;
  zmq_setsockopt(d, ZMQ_LINGER, &zero, sizeof zero);
  zmq_setsockopt(d, ZMQ_RCVTIMEO, &tmo, sizeof tmo);
  if (zmq_connect(d, bench_endpoint) != 0)
    bench_die("connect %s: %s", bench_endpoint, zmq_strerror(errno));
  struct wire_request req = {.id = 1, .kind = WIRE_HELLO};
  struct wire_reply rep;
  req.u.hello.version = WIRE_PROTOCOL_VERSION;
  snprintf(req.u.hello.tenant, sizeof req.u.hello.tenant, "bench-rss");
  req.u.hello.pid = (int32_t)getpid();
  snprintf(req.u.hello.client, sizeof req.u.hello.client, "bench_alloc");
  bench_wire_send(d, &req);
  bench_wire_recv(d, &rep);
  if (rep.status != 0) bench_die("hello: %s", rep.message);
  uint32_t hb_ms = rep.u.hello.heartbeat_ms;
  gmb__wire_reply_clear(&rep);

  uint64_t anon0, rss0, anon1, rss1;
  usleep(100000);
  bench_broker_rss(&anon0, &rss0);
  uint64_t t0 = bench_now(), hb_last = t0;
  long sent = 0, got = 0;
  uint64_t next_id = 2;
  while (got < count) {
    while (sent < count && sent - got < BENCH_WINDOW) {
      struct wire_request a = {.id = next_id++, .kind = WIRE_ALLOC};
      a.u.alloc.size = BENCH_RSS_SIZE;
      bench_wire_send(d, &a);
      sent++;
    }
    bench_wire_recv(d, &rep);
    if (rep.id == 0) { /* an event */
      gmb__wire_reply_clear(&rep);
      continue;
    }
    if (rep.status != 0)
      bench_die("allocation %ld of %d bytes refused: %s (%s)", got,
                BENCH_RSS_SIZE, gmb_err_name(rep.status), rep.message);
    gmb__wire_reply_clear(&rep);
    got++;
    if (hb_ms && bench_now() - hb_last > (uint64_t)hb_ms * 500000u) {
      struct wire_request h = {.id = next_id++, .kind = WIRE_HEARTBEAT};
      bench_wire_send(d, &h);
      hb_last = bench_now();
    }
  }
  double secs = (double)(bench_now() - t0) / 1e9;
  bench_broker_rss(&anon1, &rss1);
  printf("rss.allocations=%ld alloc_size=%d pipelined_allocs_s=%.0f\n",
         count, BENCH_RSS_SIZE, (double)count / secs);
  printf("broker_rss_per_alloc_bytes=%.1f (RssAnon %.1f MiB -> %.1f MiB; "
         "VmRSS %.1f MiB -> %.1f MiB, %.1f bytes/alloc)\n",
         ((double)anon1 - (double)anon0) / (double)count,
         anon0 / 1048576.0, anon1 / 1048576.0, rss0 / 1048576.0,
         rss1 / 1048576.0, ((double)rss1 - (double)rss0) / (double)count);
  struct wire_request bye = {.id = next_id++, .kind = WIRE_BYE};
  bench_wire_send(d, &bye);
  for (;;) { /* the Bye's answer frees 200k allocations: wait for it */
    bench_wire_recv(d, &rep);
    uint64_t id = rep.id;
    gmb__wire_reply_clear(&rep);
    if (id == bye.id) break;
  }
  zmq_close(d);
  zmq_ctx_term(ctx);
}

/* --- main ---------------------------------------------------------------- */

static void bench_sample_messages(void) {
  /* An Alloc request and a reply as they are mid-run: ids in the
   * thousands, an offset inside a 2 MiB segment, no handle. */
  struct wire_request req = {.id = 12345, .kind = WIRE_ALLOC};
  req.u.alloc.size = BENCH_SIZE;
  struct wire_reply rep = {.id = 12345, .kind = WIRE_ALLOC};
  rep.u.alloc.id = 23456;
  rep.u.alloc.size = BENCH_SIZE;
  rep.u.alloc.segment = 3;
  rep.u.alloc.offset = 1u << 20;
  if (gmb__wire_request_encode(&req, &bench_req_msg, &bench_req_len) ||
      gmb__wire_reply_encode(&rep, &bench_rep_msg, &bench_rep_len))
    bench_die("cannot encode the sample messages");
}

int main(void) {
  long iter = bench_env("BENCH_ITER", 5000);
  long rounds = bench_env("BENCH_ROUNDS", 4);
  long rss_allocs = bench_env("BENCH_RSS_ALLOCS", 200000);
  setvbuf(stdout, NULL, _IOLBF, 0);
  signal(SIGPIPE, SIG_IGN);
  snprintf(bench_dir, sizeof bench_dir, "/tmp/gmb-bench-XXXXXX");
  if (mkdtemp(bench_dir) == NULL) {
    bench_dir[0] = '\0';
    bench_die("mkdtemp: %s", strerror(errno));
  }
  snprintf(bench_endpoint, sizeof bench_endpoint, "ipc://%s/broker.sock",
           bench_dir);
  snprintf(bench_echo_ep, sizeof bench_echo_ep, "ipc://%s/echo.sock",
           bench_dir);
  bench_sample_messages();
  printf("bench_alloc: %ld timed pairs per process in %ld rounds, %d-byte "
         "pinned allocations, broker on host:1GiB; Alloc request %zu bytes, "
         "reply %zu bytes\n", iter / rounds * rounds, rounds, BENCH_SIZE,
         bench_req_len, bench_rep_len);
  bench_broker_start();
  bench_echo_start();

  /* The two kinds alternate, round by round, so that a burst of load from
   * elsewhere on the machine falls on both and not on one: the ratio is
   * what matters. */
  static const int procs[] = {1, 4, 16};
  long per_round = iter / rounds > 0 ? iter / rounds : 1;
  for (size_t i = 0; i < sizeof procs / sizeof procs[0]; i++) {
    int p = procs[i];
    size_t cap = (size_t)p * (size_t)per_round * (size_t)rounds;
    struct bench_samples raw_s = {.ns = malloc(cap * sizeof(uint32_t))};
    struct bench_samples af_s = {.ns = malloc(cap * sizeof(uint32_t))};
    if (raw_s.ns == NULL || af_s.ns == NULL) bench_die("out of memory");
    for (long r = 0; r < rounds; r++) {
      bench_run(BENCH_RAW_RTT, p, per_round, &raw_s);
      bench_run(BENCH_ALLOC_FREE, p, per_round, &af_s);
    }
    struct bench_result raw = bench_stats(&raw_s), af = bench_stats(&af_s);
    free(raw_s.ns);
    free(af_s.ns);
    printf("raw_rtt.procs=%d median_us=%.1f p99_us=%.1f rtt_s=%.0f\n", p,
           raw.median_us, raw.p99_us, raw.per_s);
    printf("alloc_free.procs=%d median_us=%.1f p99_us=%.1f ops_s=%.0f "
           "ratio_vs_2rtt=%.2f\n", p, af.median_us, af.p99_us, af.per_s,
           af.median_us / (2.0 * raw.median_us));
  }
  bench_rss(rss_allocs);
  bench_lock(bench_env("BENCH_LOCK_ITER", 2000000));

  /* A clean stop is part of the result: the broker must exit 0. */
  pid_t b = bench_broker;
  bench_broker = -1;
  kill(b, SIGTERM);
  int st;
  waitpid(b, &st, 0);
  if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
    bench_broker = -1;
    bench_die("gmb-broker did not stop cleanly (status 0x%x)", st);
  }
  bench_compact(bench_env("BENCH_COMPACT_MIB", 1024));
  b = bench_broker;
  bench_broker = -1;
  kill(b, SIGTERM);
  waitpid(b, &st, 0);
  if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
    bench_die("gmb-broker did not stop cleanly (status 0x%x)", st);
  bench_cleanup();
  free(bench_req_msg);
  free(bench_rep_msg);
  return 0;
}
