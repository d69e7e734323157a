/*
 * bench_snapshot.c - what `gmbctl snapshot FILE` costs on a broker that
 * holds a million small allocations, measured against what the same run
 * paid to make them.
 *
 * The bench starts $GMB_BUILD_DIR/gmb-broker (default build/) on
 * BENCH_SNAP_DEVICE (default host:16GiB; host segments are sparse memfds,
 * so untouched bytes cost nothing) in a temporary run dir.  One session
 * (the wire protocol spoken directly, with up to 128 requests in flight)
 * makes BENCH_SNAP_ALLOCS (1000000) allocations of 512 B to 4 KiB, random
 * sizes, one in 20 movable (at most 60000: a session's lock table has
 * 65536 slots), and holds them.  Then a probe process
 * (libgmb, its own tenant) times gmb_alloc(4 KiB) + gmb_free pairs in a
 * loop, first alone for a second, then while $GMB_BUILD_DIR/gmbctl
 * snapshot FILE runs (with --page BENCH_SNAP_PAGE when that is set), and
 * the bench samples the broker's RssAnon every 2 ms meanwhile.
 *
 * Printed (key=value lines; docs/benchmarks.md):
 *   snap.allocs, alloc_s        the allocations and the time to make them
 *   snap.wall_s                 gmbctl's run, start to exit; ratio_vs_alloc
 *                               = wall_s / alloc_s
 *   snap.json_bytes             the file; bytes_per_alloc
 *   snap.ctl_maxrss_bytes       gmbctl's peak RSS (wait4's ru_maxrss);
 *                               ratio_vs_json = maxrss / json_bytes
 *   snap.broker_growth_bytes    the broker's RssAnon peak during the
 *                               snapshot minus before it; ratio_vs_held =
 *                               growth / the RssAnon that holding the
 *                               allocations cost
 *   snap.probe_max_us, p99_us   the probe's slowest pair during the
 *                               snapshot, beside the same before it
 *                               (ratio_max = during / before): the longest
 *                               stall of the broker's loop a client saw
 * and, as a check that the file is whole, the number of "allocated"
 * ranges in it (snap.file_allocs, to equal snap.allocs plus the probe's
 * one at most).  Last, snap.page_rtt: the whole snapshot read again over
 * a bare admin socket, each page timed from request to reply (median and
 * worst): what one page costs the broker's loop, at most.  Nothing is
 * asserted about times.
 *
 * The same binary measures an older build: GMB_BUILD_DIR=DIR runs DIR's
 * broker and gmbctl (leave BENCH_SNAP_PAGE unset for a gmbctl without
 * --page).  Every process it forks gets PR_SET_PDEATHSIG; the run dir is
 * removed at the end.  Exit status 0, or 1 when anything failed.
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
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "gmb.h"
#include "wire.h"

#define SNAP_WINDOW 128 /* pipelined requests in flight (< HWM) */
#define SNAP_PROBE_MAX (1u << 21)

static char snap_dir[64];
static char snap_endpoint[128];
static pid_t snap_broker = -1, snap_probe = -1;
static const char *snap_bdir = "build";

static uint64_t snap_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void snap_cleanup(void) {
  pid_t *pids[] = {&snap_probe, &snap_broker};
  for (int i = 0; i < 2; i++)
    if (*pids[i] > 0) {
      kill(*pids[i], SIGTERM);
      waitpid(*pids[i], NULL, 0);
      *pids[i] = -1;
    }
  if (snap_dir[0]) {
    char path[128];
    const char *names[] = {"broker.log", "broker.sock", "admin.sock",
                           "fd.sock", "snap.json", "snap.json.tmp"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
      snprintf(path, sizeof path, "%s/%s", snap_dir, names[i]);
      unlink(path);
    }
    rmdir(snap_dir);
    snap_dir[0] = '\0';
  }
}

static void snap_die(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void snap_die(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "bench_snapshot: ");
  vfprintf(stderr, fmt, ap);
  fprintf(stderr, "\n");
  va_end(ap);
  char cmd[192];
  snprintf(cmd, sizeof cmd, "tail -n 20 %s/broker.log >&2 2>/dev/null",
           snap_dir);
  if (snap_dir[0] && system(cmd) != 0) { /* nothing more to say */ }
  snap_cleanup();
  exit(1);
}

static long snap_env(const char *name, long def) {
  const char *s = getenv(name);
  if (s == NULL || *s == '\0') return def;
  char *end;
  long v = strtol(s, &end, 10);
  if (*end != '\0' || v <= 0) {
    fprintf(stderr, "bench_snapshot: %s=%s is not a positive number\n", name,
            s);
    exit(2);
  }
  return v;
}

static void snap_child_setup(void) {
  prctl(PR_SET_PDEATHSIG, SIGTERM);
  if (getppid() == 1) _exit(1);
}

/* --- the broker ------------------------------------------------------------ */

static void snap_broker_start(const char *device) {
  char bin[512], logp[128];
  snprintf(bin, sizeof bin, "%s/gmb-broker", snap_bdir);
  if (access(bin, X_OK) != 0)
    snap_die("%s: %s (set GMB_BUILD_DIR)", bin, strerror(errno));
  snprintf(logp, sizeof logp, "%s/broker.log", snap_dir);
  snap_broker = fork();
  if (snap_broker < 0) snap_die("fork: %s", strerror(errno));
  if (snap_broker == 0) {
    snap_child_setup();
    int fd = open(logp, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
      dup2(fd, 1);
      dup2(fd, 2);
      close(fd);
    }
    execl(bin, "gmb-broker", "--device", device, "--run-dir", snap_dir,
          "--log-level", "warn", (char *)NULL);
    _exit(127);
  }
  uint64_t deadline = snap_now() + 10000000000u;
  for (;;) {
    int st;
    if (waitpid(snap_broker, &st, WNOHANG) == snap_broker) {
      snap_broker = -1;
      snap_die("gmb-broker exited at start-up (status 0x%x)", st);
    }
    gmb_client *c;
    if (gmb_connect(snap_endpoint, "bench", &c) == 0) {
      gmb_disconnect(c);
      return;
    }
    if (snap_now() > deadline) snap_die("gmb-broker did not start in 10 s");
    usleep(20000);
  }
}

/* The broker's RssAnon in bytes. */
static uint64_t snap_broker_anon(void) {
  char path[64], line[256];
  snprintf(path, sizeof path, "/proc/%d/status", (int)snap_broker);
  FILE *f = fopen(path, "r");
  if (f == NULL) snap_die("%s: %s", path, strerror(errno));
  unsigned long long kb = 0, v;
  while (fgets(line, sizeof line, f))
    if (sscanf(line, "RssAnon: %llu kB", &v) == 1) kb = v;
  fclose(f);
  return (uint64_t)kb * 1024;
}

/* --- the million ---------------------------------------------------------- */

static void snap_send(void *d, struct wire_request *req) {
  uint8_t *buf;
  size_t len;
  if (gmb__wire_request_encode(req, &buf, &len) != 0)
    snap_die("cannot encode a request");
  if (zmq_send(d, buf, len, 0) < 0) snap_die("send: %s", zmq_strerror(errno));
  free(buf);
}

static void snap_recv(void *d, struct wire_reply *rep) {
  uint8_t buf[8192];
  int n = zmq_recv(d, buf, sizeof buf, 0);
  if (n < 0) snap_die("recv: %s (did the broker die?)", zmq_strerror(errno));
  if ((size_t)n > sizeof buf) snap_die("reply of %d bytes", n);
  if (gmb__wire_reply_decode(buf, (size_t)n, rep) != 0)
    snap_die("a reply did not decode");
}

/* Makes `count` allocations in one session that stays open (its socket is
 * returned in *sock); returns the seconds it took. */
static double snap_fill(long count, void **ctx_out, void **sock) {
  void *ctx = zmq_ctx_new();
  void *d = zmq_socket(ctx, ZMQ_DEALER);
  int zero = 0, tmo = 30000;
  zmq_setsockopt(d, ZMQ_LINGER, &zero, sizeof zero);
  zmq_setsockopt(d, ZMQ_RCVTIMEO, &tmo, sizeof tmo);
  if (zmq_connect(d, snap_endpoint) != 0)
    snap_die("connect %s: %s", snap_endpoint, zmq_strerror(errno));
  struct wire_request req = {.id = 1, .kind = WIRE_HELLO};
  struct wire_reply rep;
  req.u.hello.version = WIRE_PROTOCOL_VERSION;
  snprintf(req.u.hello.tenant, sizeof req.u.hello.tenant, "bench-million");
  req.u.hello.pid = (int32_t)getpid();
  snprintf(req.u.hello.client, sizeof req.u.hello.client, "bench_snapshot");
  snap_send(d, &req);
  snap_recv(d, &rep);
  if (rep.status != 0) snap_die("hello: %s", rep.message);
  if (rep.u.hello.heartbeat_ms)
    snap_die("the broker wants heartbeats (it cannot see this pid)");
  gmb__wire_reply_clear(&rep);
  uint64_t rnd = 0x2545f4914f6cdd1du, next_id = 2;
  long sent = 0, got = 0;
  uint64_t t0 = snap_now();
  while (got < count) {
    while (sent < count && sent - got < SNAP_WINDOW) {
      rnd ^= rnd >> 12;
      rnd ^= rnd << 25;
      rnd ^= rnd >> 27;
      struct wire_request a = {.id = next_id++, .kind = WIRE_ALLOC};
      a.u.alloc.size = 512 + (rnd * 2685821657736338717u >> 40) % 3585;
      /* Every 20th movable, below the session's lock-table slots. */
      a.u.alloc.flags = sent % 20 == 0 && sent / 20 < 60000 ? GMB_MOVABLE : 0;
      snap_send(d, &a);
      sent++;
    }
    snap_recv(d, &rep);
    if (rep.id == 0) { /* an event */
      gmb__wire_reply_clear(&rep);
      continue;
    }
    if (rep.status != 0)
      snap_die("allocation %ld refused: %s (%s)", got, gmb_err_name(rep.status),
               rep.message);
    gmb__wire_reply_clear(&rep);
    got++;
  }
  *ctx_out = ctx;
  *sock = d;
  return (double)(snap_now() - t0) / 1e9;
}

/* --- the probe ------------------------------------------------------------- */

struct snap_probe {
  _Atomic int stop;
  _Atomic uint32_t n;
  uint64_t at[SNAP_PROBE_MAX]; /* when each pair ended */
  uint64_t ns[SNAP_PROBE_MAX]; /* how long it took */
};

static void snap_probe_main(struct snap_probe *pr) {
  gmb_client *c;
  if (gmb_connect(snap_endpoint, "probe", &c) != 0) _exit(3);
  while (!atomic_load(&pr->stop)) {
    uint32_t i = atomic_load(&pr->n);
    if (i >= SNAP_PROBE_MAX) break;
    uint64_t t0 = snap_now();
    gmb_id id;
    if (gmb_alloc(c, 4096, 0, &id) != 0) _exit(4);
    if (gmb_free(c, id) != 0) _exit(4);
    uint64_t t1 = snap_now();
    pr->at[i] = t1;
    pr->ns[i] = t1 - t0;
    atomic_store(&pr->n, i + 1);
  }
  gmb_disconnect(c);
  _exit(0);
}

static int snap_cmp_u64(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? -1 : x > y;
}

/* Worst and p99 (µs) of the pairs that ended within [from, to), or with
 * `overlap`, of those that ran at some time within it (a pair the
 * snapshot stalled may end after gmbctl exits: it still counts). */
static void snap_probe_stats(const struct snap_probe *pr, uint64_t from,
                             uint64_t to, int overlap, uint32_t *count,
                             double *max_us, double *p99_us) {
  uint32_t n = atomic_load(&pr->n), k = 0;
  uint64_t *v = malloc((n ? n : 1) * sizeof *v);
  if (v == NULL) snap_die("out of memory");
  for (uint32_t i = 0; i < n; i++) {
    uint64_t end = pr->at[i], start = end - pr->ns[i];
    if (overlap ? end >= from && start < to : end >= from && end < to)
      v[k++] = pr->ns[i];
  }
  qsort(v, k, sizeof *v, snap_cmp_u64);
  *count = k;
  *max_us = k ? (double)v[k - 1] / 1000.0 : 0;
  *p99_us = k ? (double)v[(size_t)((double)k * 0.99)] / 1000.0 : 0;
  free(v);
}

/* --- the snapshot ---------------------------------------------------------- */

/* Reads the whole snapshot over a bare admin DEALER, pages of `limit`
 * (0: the broker's default), timing each request to its reply: an upper
 * bound of the loop's time per page (the transport and this decoder
 * included).  A broker without pages answers everything at once: one
 * "page".  Prints the pages, the median and the worst. */
static void snap_raw_pages(uint32_t limit) {
  void *ctx = zmq_ctx_new();
  void *d = zmq_socket(ctx, ZMQ_DEALER);
  int zero = 0, tmo = 60000;
  zmq_setsockopt(d, ZMQ_LINGER, &zero, sizeof zero);
  zmq_setsockopt(d, ZMQ_RCVTIMEO, &tmo, sizeof tmo);
  char ep[160];
  snprintf(ep, sizeof ep, "ipc://%s/admin.sock", snap_dir);
  if (zmq_connect(d, ep) != 0) snap_die("connect %s", ep);
  size_t cap = 1024, n = 0;
  uint64_t *ns = malloc(cap * sizeof *ns), seg = 0, off = 0, id = 1;
  if (ns == NULL) snap_die("out of memory");
  do {
    struct wire_request req = {.id = id++, .kind = WIRE_ADMIN_SNAPSHOT};
    req.u.admin_snapshot.segment = seg;
    req.u.admin_snapshot.offset = off;
    req.u.admin_snapshot.limit = limit;
    uint64_t t0 = snap_now();
    snap_send(d, &req);
    zmq_msg_t m;
    zmq_msg_init(&m);
    if (zmq_msg_recv(&m, d, 0) < 0) snap_die("admin recv: %s", zmq_strerror(errno));
    struct wire_reply rep;
    if (gmb__wire_reply_decode(zmq_msg_data(&m), zmq_msg_size(&m), &rep) != 0)
      snap_die("a page did not decode");
    zmq_msg_close(&m);
    if (n == cap) {
      cap *= 2;
      ns = realloc(ns, cap * sizeof *ns);
      if (ns == NULL) snap_die("out of memory");
    }
    ns[n++] = snap_now() - t0;
    if (rep.status != 0) snap_die("page refused: %s", rep.message);
    seg = rep.u.snapshot.next_segment;
    off = rep.u.snapshot.next_offset;
    gmb__wire_reply_clear(&rep);
  } while (seg);
  qsort(ns, n, sizeof *ns, snap_cmp_u64);
  printf("snap.page_rtt pages=%zu median_ms=%.3f max_ms=%.3f (limit %u, bare "
         "admin requests: the loop's time per page and the transport)\n",
         n, (double)ns[n / 2] / 1e6, (double)ns[n - 1] / 1e6, limit);
  free(ns);
  zmq_close(d);
  zmq_ctx_term(ctx);
}

/* Counts "allocated" ranges in the file, reading it in blocks. */
static uint64_t snap_count_allocated(const char *path) {
  FILE *f = fopen(path, "r");
  if (f == NULL) snap_die("%s: %s", path, strerror(errno));
  static char buf[1 << 20];
  const char *needle = "\"allocated\"";
  size_t nl = strlen(needle), keep = 0;
  uint64_t n = 0;
  for (;;) {
    size_t got = fread(buf + keep, 1, sizeof buf - 1 - keep, f);
    if (got == 0) break;
    size_t len = keep + got;
    buf[len] = '\0';
    for (char *p = buf; (p = memmem(p, len - (size_t)(p - buf), needle, nl));
         p += nl)
      n++;
    keep = len < nl - 1 ? len : nl - 1; /* a needle across two blocks */
    memmove(buf, buf + len - keep, keep);
  }
  fclose(f);
  return n;
}

int main(void) {
  long count = snap_env("BENCH_SNAP_ALLOCS", 1000000);
  const char *device = getenv("BENCH_SNAP_DEVICE");
  if (device == NULL || *device == '\0') device = "host:16GiB";
  const char *page = getenv("BENCH_SNAP_PAGE");
  if (page && *page == '\0') page = NULL;
  const char *bd = getenv("GMB_BUILD_DIR");
  if (bd && *bd) snap_bdir = bd;
  char ctl[512];
  snprintf(ctl, sizeof ctl, "%s/gmbctl", snap_bdir);
  if (access(ctl, X_OK) != 0) snap_die("%s: %s", ctl, strerror(errno));

  snprintf(snap_dir, sizeof snap_dir, "/tmp/gmb-bsnap-XXXXXX");
  if (mkdtemp(snap_dir) == NULL) {
    snap_dir[0] = '\0';
    snap_die("mkdtemp: %s", strerror(errno));
  }
  chmod(snap_dir, 0755);
  snprintf(snap_endpoint, sizeof snap_endpoint, "ipc://%s/broker.sock",
           snap_dir);
  snap_broker_start(device);
  printf("snap.build=%s device=%s page=%s\n", snap_bdir, device,
         page ? page : "(gmbctl's default)");

  uint64_t anon0 = snap_broker_anon();
  void *zctx, *sock;
  double alloc_s = snap_fill(count, &zctx, &sock);
  uint64_t anon1 = snap_broker_anon();
  printf("snap.allocs=%ld alloc_s=%.3f allocs_s=%.0f broker_anon_held=%.1fMiB\n",
         count, alloc_s, (double)count / alloc_s,
         (double)(anon1 - anon0) / 1048576.0);
  fflush(stdout);

  struct snap_probe *pr = mmap(NULL, sizeof *pr, PROT_READ | PROT_WRITE,
                               MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (pr == MAP_FAILED) snap_die("mmap: %s", strerror(errno));
  snap_probe = fork();
  if (snap_probe < 0) snap_die("fork: %s", strerror(errno));
  if (snap_probe == 0) {
    snap_child_setup();
    snap_probe_main(pr);
  }
  uint64_t tb = snap_now();
  usleep(1000000); /* the probe alone: the baseline */

  char path[128];
  snprintf(path, sizeof path, "%s/snap.json", snap_dir);
  uint64_t ts = snap_now();
  pid_t pid = fork();
  if (pid < 0) snap_die("fork: %s", strerror(errno));
  if (pid == 0) {
    snap_child_setup();
    int fd = open("/dev/null", O_WRONLY);
    if (fd >= 0) dup2(fd, 1);
    if (page)
      execl(ctl, "gmbctl", "--run-dir", snap_dir, "snapshot", "--page", page,
            path, (char *)NULL);
    else
      execl(ctl, "gmbctl", "--run-dir", snap_dir, "snapshot", path,
            (char *)NULL);
    _exit(127);
  }
  uint64_t peak = anon1;
  int st = 0;
  struct rusage ru;
  for (;;) {
    pid_t w = wait4(pid, &st, WNOHANG, &ru);
    if (w == pid) break;
    if (w < 0) snap_die("wait4: %s", strerror(errno));
    uint64_t a = snap_broker_anon();
    if (a > peak) peak = a;
    usleep(2000);
  }
  uint64_t te = snap_now();
  usleep(300000); /* pairs that were stalled end now */
  atomic_store(&pr->stop, 1);
  int pst;
  waitpid(snap_probe, &pst, 0);
  snap_probe = -1;
  if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
    snap_die("gmbctl snapshot failed (status 0x%x)", st);
  if (!WIFEXITED(pst) || WEXITSTATUS(pst) != 0)
    snap_die("the probe failed (status 0x%x)", pst);

  struct stat sb;
  if (stat(path, &sb) != 0) snap_die("%s: %s", path, strerror(errno));
  double wall = (double)(te - ts) / 1e9;
  uint64_t maxrss = (uint64_t)ru.ru_maxrss * 1024;
  uint64_t in_file = snap_count_allocated(path);
  uint32_t nb, nd;
  double maxb, p99b, maxd, p99d;
  snap_probe_stats(pr, tb, ts, 0, &nb, &maxb, &p99b);
  snap_probe_stats(pr, ts, te, 1, &nd, &maxd, &p99d);
  printf("snap.wall_s=%.3f ratio_vs_alloc=%.3f\n", wall, wall / alloc_s);
  printf("snap.json_bytes=%lld bytes_per_alloc=%.1f file_allocs=%" PRIu64 "\n",
         (long long)sb.st_size, (double)sb.st_size / (double)count, in_file);
  printf("snap.ctl_maxrss_bytes=%" PRIu64 " (%.1fMiB) ratio_vs_json=%.4f\n",
         maxrss, (double)maxrss / 1048576.0,
         (double)maxrss / (double)sb.st_size);
  printf("snap.broker_growth_bytes=%" PRIu64 " (%.1fMiB) ratio_vs_held=%.3f\n",
         peak - anon1, (double)(peak - anon1) / 1048576.0,
         (double)(peak - anon1) / (double)(anon1 - anon0));
  printf("snap.probe_max_us=%.0f p99_us=%.0f pairs=%u (before: max_us=%.0f "
         "p99_us=%.0f pairs=%u) ratio_max=%.1f\n",
         maxd, p99d, nd, maxb, p99b, nb, maxb > 0 ? maxd / maxb : 0);
  if (in_file < (uint64_t)count || in_file > (uint64_t)count + 1)
    snap_die("the file holds %" PRIu64 " allocated ranges, not %ld", in_file,
             count);
  snap_raw_pages(page ? (uint32_t)atol(page) : 0);
  munmap(pr, sizeof *pr);
  zmq_close(sock);
  zmq_ctx_term(zctx);
  snap_cleanup();
  return 0;
}
