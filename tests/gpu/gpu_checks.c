/*
 * gpu_checks.c - the client-side checks and figures of tests/gpu/run.sh
 * that need a program of their own (it builds anywhere: the driver comes
 * through proto/cudrv as in gmb; run.sh rehearses it on the stand-in).
 * One subcommand a run; the broker is $GMB_ENDPOINT, the tenant
 * $GMB_TENANT.  Prints OK/FIGURE lines; exit 0 when the check held, 1
 * when it did not, 2 on usage.
 *
 *   fresh-write SIZE   allocates SIZE, writes a pattern of this tenant
 *                      into every byte (by copies), frees, disconnects
 *   fresh-read SIZE    allocates SIZE and reads every byte back: none of
 *                      fresh-write's words may show (run as another
 *                      tenant after fresh-write, on a broker whose
 *                      capacity makes the memory come round again)
 *   ctx-free SIZE N    a context of the program's own (cuCtxCreate) queues
 *                      N copies inside an allocation on a stream of its
 *                      own, then a host function that marks the work
 *                      done; gmb_free from a thread with no context must
 *                      return only after the mark (cudaFree's wait, in
 *                      every context that uses the memory)
 *   bench SIZE N       FIGURE lines: gmb_alloc+gmb_free of SIZE against
 *                      cuMemAlloc+cuMemFree of SIZE (N each, same
 *                      process), and a cache hit (gmb_malloc_async +
 *                      gmb_free_async)
 *   offload SIZE GMBCTL RUNDIR
 *                      SIZE of movable allocations (1 MiB each) with a
 *                      pattern; `GMBCTL --run-dir RUNDIR pause $GMB_TENANT
 *                      --tag (movable)` makes the broker offload them
 *                      (the tenant's used bytes must drop by SIZE); a
 *                      gmb_lock of each brings them back; every byte is
 *                      read back and checked.  FIGURE lines: the pause's
 *                      and the locks' GB/s against cuMemcpyDtoH/HtoD of
 *                      SIZE with page-locked memory (cuMemHostAlloc)
 *   sleep SIZE N       FIGURE lines: gmb_pause (offload) and gmb_resume of
 *                      SIZE in one tag (blocks of 16 MiB) against
 *                      cuMemcpyDtoH / cuMemcpyHtoD of the same blocks to
 *                      and from pinned memory allocated ahead, N runs
 *                      alternated, medians, as bandwidths and their
 *                      ratios (goal >= 0.7); every byte checked after
 *                      each resume, and the offload's host copy must be
 *                      pinned memory (the check fails otherwise)
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cudrv.h"
#include "gmb.h"
#include "hostbuf.h"

#define CHUNK ((size_t)8 << 20)
#define FRESH_TAG UINT64_C(0x5a17c0de00000000)

static struct gmb_cudrv d;

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static size_t size_arg(const char *s) {
  char *end;
  unsigned long long n = strtoull(s, &end, 10);
  switch (*end) {
    case 'k': case 'K': n <<= 10; break;
    case 'm': case 'M': n <<= 20; break;
    case 'g': case 'G': n <<= 30; break;
    default: break;
  }
  return (size_t)n;
}

static gmb_client *connect_or_die(void) {
  gmb_client *c = NULL;
  int rc = gmb_connect(NULL, NULL, &c);
  if (rc) {
    fprintf(stderr, "gpu_checks: connect: %s\n", gmb_strerror(rc));
    exit(1);
  }
  return c;
}

static int fail(gmb_client *c, const char *what, int rc) {
  fprintf(stderr, "gpu_checks: %s: %s (%s)\n", what, gmb_err_name(rc),
          c ? gmb_last_error(c) : "");
  return 1;
}

/* The word fresh-write leaves at word index i: tagged, never zero. */
static uint64_t fresh_word(uint64_t i) {
  return FRESH_TAG | ((i * 0x9E3779B97F4A7C15ull) >> 32);
}

static int fresh(int write, size_t size) {
  gmb_client *c = connect_or_die();
  gmb_id id;
  int rc = gmb_alloc(c, size, 0, &id);
  if (rc) return fail(c, "gmb_alloc", rc);
  uint64_t *w = malloc(CHUNK);
  if (!w) return 1;
  size_t seen = 0, nonzero = 0;
  for (size_t at = 0; at < size; at += CHUNK) {
    size_t n = size - at < CHUNK ? size - at : CHUNK;
    size_t words = n / sizeof *w;
    if (write) {
      for (size_t i = 0; i < words; i++) w[i] = fresh_word(at / 8 + i);
      rc = gmb_write(c, id, at, w, words * sizeof *w);
    } else {
      rc = gmb_read(c, id, at, w, words * sizeof *w);
      for (size_t i = 0; !rc && i < words; i++) {
        seen += (w[i] & UINT64_C(0xffffffff00000000)) == FRESH_TAG;
        nonzero += w[i] != 0;
      }
    }
    if (rc) return fail(c, write ? "gmb_write" : "gmb_read", rc);
  }
  free(w);
  if ((rc = gmb_free(c, id)) != 0) return fail(c, "gmb_free", rc);
  gmb_disconnect(c);
  if (write) {
    printf("OK fresh-write: %zu MiB written with the first tenant's words, "
           "freed\n", size >> 20);
    return 0;
  }
  printf("%s fresh-read: %zu MiB read: %zu words of the first tenant, %zu "
         "non-zero words\n", seen ? "BAD" : "OK", size >> 20, seen, nonzero);
  return seen ? 1 : 0;
}

/* --- ctx-free ------------------------------------------------------------------ */

static atomic_int work_done;

static void mark_done(void *arg) {
  (void)arg;
  atomic_store(&work_done, 1);
}

struct free_job {
  gmb_client *c;
  gmb_id id;
  int rc, done_at_return;
};

static void *free_thread(void *arg) {
  struct free_job *j = arg;
  j->rc = gmb_free(j->c, j->id);
  j->done_at_return = atomic_load(&work_done);
  return NULL;
}

#define CU(call, what)                                                  \
  do {                                                                  \
    gmb_cu_result r_ = (call);                                          \
    if (r_ != GMB_CU_SUCCESS) {                                         \
      char b_[160];                                                     \
      fprintf(stderr, "gpu_checks: %s: %s\n", what,                     \
              gmb__cudrv_strerror(&d, r_, b_, sizeof b_));              \
      return 1;                                                         \
    }                                                                   \
  } while (0)

static int ctx_free(size_t size, int n) {
  char err[256];
  if (gmb__cudrv_load(&d, err, sizeof err) != 0) {
    fprintf(stderr, "gpu_checks: %s\n", err);
    return 1;
  }
  gmb_cu_device dev;
  gmb_cu_ctx app;
  CU(d.cuDeviceGet(&dev, 0), "cuDeviceGet");
  CU(d.cuCtxCreate(&app, 0, dev), "cuCtxCreate"); /* current now */
  gmb_client *c = connect_or_die();
  struct free_job j = {c, 0, -100, 0};
  void *p;
  int rc = gmb_alloc(c, size, 0, &j.id);
  if (rc) return fail(c, "gmb_alloc", rc);
  if ((rc = gmb_lock(c, j.id, &p)) != 0) return fail(c, "gmb_lock", rc);
  gmb_cu_stream s;
  CU(d.cuStreamCreate(&s, GMB_CU_STREAM_NON_BLOCKING), "cuStreamCreate");
  gmb_cu_ptr base = (gmb_cu_ptr)(uintptr_t)p;
  size_t half = size / 2;
  for (int i = 0; i < n; i++)
    CU(d.cuMemcpyDtoDAsync(i % 2 ? base : base + half, i % 2 ? base + half
                                                             : base,
                           half, s),
       "cuMemcpyDtoDAsync");
  CU(d.cuLaunchHostFunc(s, mark_done, NULL), "cuLaunchHostFunc");
  gmb_unlock(c, j.id);
  pthread_t t; /* a thread with no context current */
  if (pthread_create(&t, NULL, free_thread, &j) != 0) return 1;
  pthread_join(t, NULL);
  if (j.rc) return fail(c, "gmb_free", j.rc);
  int ok = j.done_at_return;
  printf("%s ctx-free: %d copies of %zu MiB queued in the program's own "
         "context were %s when gmb_free returned\n", ok ? "OK" : "BAD", n,
         half >> 20, ok ? "done" : "NOT done");
  CU(d.cuStreamSynchronize(s), "cuStreamSynchronize");
  CU(d.cuStreamDestroy(s), "cuStreamDestroy");
  gmb_disconnect(c);
  CU(d.cuCtxDestroy(app), "cuCtxDestroy");
  return ok ? 0 : 1;
}

/* --- bench ---------------------------------------------------------------------- */

/* The driver loaded and device 0's primary context made current, as the
 * CUDA runtime would: gmb leaves a thread's context as it found it, none
 * included.  0, or 1 said on stderr. */
static int primary_current(void) {
  char err[256];
  if (gmb__cudrv_load(&d, err, sizeof err) != 0) {
    fprintf(stderr, "gpu_checks: %s\n", err);
    return 1;
  }
  gmb_cu_device dev;
  gmb_cu_ctx prim;
  CU(d.cuDeviceGet(&dev, 0), "cuDeviceGet");
  CU(d.cuDevicePrimaryCtxRetain(&prim, dev), "cuDevicePrimaryCtxRetain");
  CU(d.cuCtxSetCurrent(prim), "cuCtxSetCurrent");
  return 0;
}

static int bench(size_t size, int n) {
  if (primary_current()) return 1;
  gmb_client *c = connect_or_die();
  double t0 = now_s();
  for (int i = 0; i < n; i++) {
    gmb_cu_ptr p;
    CU(d.cuMemAlloc(&p, size), "cuMemAlloc");
    CU(d.cuMemFree(p), "cuMemFree");
  }
  double cu = (now_s() - t0) / n * 1e6;
  t0 = now_s();
  for (int i = 0; i < n; i++) {
    gmb_id id;
    int rc = gmb_alloc(c, size, 0, &id);
    if (rc) return fail(c, "gmb_alloc", rc);
    if ((rc = gmb_free(c, id)) != 0) return fail(c, "gmb_free", rc);
  }
  double g = (now_s() - t0) / n * 1e6;
  void *p;
  int rc = gmb_malloc_async(c, size, NULL, &p); /* the miss */
  if (rc || (rc = gmb_free_async(c, p, NULL)) != 0)
    return fail(c, "gmb_malloc_async", rc);
  t0 = now_s();
  for (int i = 0; i < n * 10; i++) {
    if ((rc = gmb_malloc_async(c, size, NULL, &p)) != 0)
      return fail(c, "gmb_malloc_async", rc);
    if ((rc = gmb_free_async(c, p, NULL)) != 0)
      return fail(c, "gmb_free_async", rc);
  }
  double hit = (now_s() - t0) / (n * 10) * 1e6;
  printf("FIGURE cuMemAlloc+cuMemFree_%zuMiB_us %.2f\n", size >> 20, cu);
  printf("FIGURE gmb_alloc+gmb_free_%zuMiB_us %.2f (x%.2f of cuMemAlloc+"
         "cuMemFree)\n", size >> 20, g, cu > 0 ? g / cu : 0.0);
  printf("FIGURE gmb_malloc_async+free_async_hit_%zuMiB_us %.3f (x%.3f of "
         "cuMemAlloc+cuMemFree)\n", size >> 20, hit, cu > 0 ? hit / cu : 0.0);
  gmb_disconnect(c);
  return 0;
}

/* --- sleep ---------------------------------------------------------------------- */

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static double median(double *v, int n) {
  qsort(v, (size_t)n, sizeof *v, cmp_double);
  return v[n / 2];
}

#define SLEEP_BLK ((size_t)16 << 20)

/* The byte at offset i of block b's pattern. */
static unsigned char sleep_byte(size_t b, size_t i) {
  return (unsigned char)((b * 131 + i / 4096 * 7 + i) & 0xff);
}

static int sleep_bw(size_t size, int n) {
  if (primary_current()) return 1;
  size_t nb = size / SLEEP_BLK ? size / SLEEP_BLK : 1;
  size = nb * SLEEP_BLK;
  if (n < 1) n = 1;
  gmb_client *c = connect_or_die();
  void **blk = calloc(nb, sizeof *blk);
  double *tp = calloc((size_t)n, sizeof *tp), *tr = calloc((size_t)n, sizeof *tr);
  double *co = calloc((size_t)n, sizeof *co), *ci = calloc((size_t)n, sizeof *ci);
  unsigned char *pin = NULL;
  if (!blk || !tp || !tr || !co || !ci) return 1;
  /* The baseline's host memory: pinned, allocated ahead. */
  CU(d.cuMemHostAlloc((void **)&pin, size, GMB_CU_MEMHOSTALLOC_PORTABLE),
     "cuMemHostAlloc");
  int rc = gmb_cache_tag(c, "sleep");
  for (size_t b = 0; !rc && b < nb; b++)
    rc = gmb_malloc_async(c, SLEEP_BLK, NULL, &blk[b]);
  if (rc) return fail(c, "gmb_malloc_async", rc);
  for (size_t b = 0; b < nb; b++)
    for (size_t i = 0; i < SLEEP_BLK; i++)
      pin[b * SLEEP_BLK + i] = sleep_byte(b, i);
  for (size_t b = 0; b < nb; b++)
    CU(d.cuMemcpyHtoD((gmb_cu_ptr)(uintptr_t)blk[b], pin + b * SLEEP_BLK,
                      SLEEP_BLK), "cuMemcpyHtoD");
  int pinned = 1;
  for (int r = 0; r < n; r++) {
    for (int half = 0; half < 2; half++) {
      if (half == (r & 1)) {
        double t0 = now_s();
        for (size_t b = 0; b < nb; b++)
          CU(d.cuMemcpyDtoH(pin + b * SLEEP_BLK, (gmb_cu_ptr)(uintptr_t)blk[b],
                            SLEEP_BLK), "cuMemcpyDtoH");
        double t1 = now_s();
        for (size_t b = 0; b < nb; b++)
          CU(d.cuMemcpyHtoD((gmb_cu_ptr)(uintptr_t)blk[b], pin + b * SLEEP_BLK,
                            SLEEP_BLK), "cuMemcpyHtoD");
        co[r] = t1 - t0;
        ci[r] = now_s() - t1;
        continue;
      }
      double t0 = now_s();
      if ((rc = gmb_pause(c, "sleep", GMB_PAUSE_OFFLOAD)) != 0)
        return fail(c, "gmb_pause", rc);
      double t1 = now_s();
      struct gmb_hostbuf_stats hs;
      gmb__hostbuf_stats(&hs);
      pinned &= hs.pinned >= size && hs.refused == 0;
      if ((rc = gmb_resume(c, "sleep")) != 0) return fail(c, "gmb_resume", rc);
      tp[r] = t1 - t0;
      tr[r] = now_s() - t1;
      /* Every byte back (read by copies: device memory is not the CPU's). */
      memset(pin, 0, size);
      for (size_t b = 0; b < nb; b++)
        CU(d.cuMemcpyDtoH(pin + b * SLEEP_BLK, (gmb_cu_ptr)(uintptr_t)blk[b],
                          SLEEP_BLK), "cuMemcpyDtoH");
      for (size_t b = 0; b < nb; b++)
        for (size_t i = 0; i < SLEEP_BLK; i++)
          if (pin[b * SLEEP_BLK + i] != sleep_byte(b, i)) {
            printf("BAD sleep: run %d: block %zu byte %zu changed across a "
                   "pause\n", r, b, i);
            return 1;
          }
    }
  }
  double first = tp[0];
  double gb = (double)size / 1e9, mo = median(co, n), mi = median(ci, n);
  double mp = median(tp, n), mr = median(tr, n);
  printf("FIGURE sleep_offload_%zuMiB_GBps %.2f (cuMemcpyDtoH to pinned "
         "memory %.2f GB/s: x%.2f, goal >= 0.7; first pause %.1f ms, "
         "median %.1f ms; %d runs)\n", size >> 20, gb / mp, gb / mo, mo / mp,
         first * 1e3, mp * 1e3, n);
  printf("FIGURE sleep_restore_%zuMiB_GBps %.2f (cuMemcpyHtoD from pinned "
         "memory %.2f GB/s: x%.2f, goal >= 0.7; median %.1f ms)\n",
         size >> 20, gb / mr, gb / mi, mi / mr, mr * 1e3);
  for (size_t b = 0; b < nb; b++) gmb_free_async(c, blk[b], NULL);
  d.cuMemFreeHost(pin);
  gmb_disconnect(c);
  if (!pinned) {
    printf("BAD sleep: the offload's host copy was not pinned memory\n");
    return 1;
  }
  printf("OK sleep: %zu MiB offloaded to pinned memory and restored %d "
         "times, every byte checked\n", size >> 20, n);
  return 0;
}

/* --- offload --------------------------------------------------------------- */

static uint64_t offl_word(size_t a, size_t k) {
  return (uint64_t)(a + 1) << 32 | (uint64_t)k;
}

static int offload(size_t size, const char *ctl, const char *run) {
  const char *tenant = getenv("GMB_TENANT");
  if (tenant == NULL) {
    fprintf(stderr, "gpu_checks: offload: no GMB_TENANT\n");
    return 1;
  }
  if (primary_current()) return 1;
  const size_t mib = (size_t)1 << 20, n = size / mib;
  gmb_client *c = connect_or_die();
  gmb_id *id = calloc(n, sizeof *id);
  uint64_t *w = malloc(mib);
  if (id == NULL || w == NULL || n == 0) return 1;
  int rc;
  for (size_t a = 0; a < n; a++) {
    for (size_t k = 0; k < mib / 8; k++) w[k] = offl_word(a, k);
    if ((rc = gmb_alloc(c, mib, GMB_MOVABLE, &id[a])) != 0)
      return fail(c, "gmb_alloc", rc);
    if ((rc = gmb_write(c, id[a], 0, w, mib)) != 0)
      return fail(c, "gmb_write", rc);
  }
  /* The baseline: the same bytes, one copy each way with page-locked
   * memory, as the broker's copies use. */
  gmb_cu_ptr scratch;
  void *pinned;
  CU(d.cuMemAlloc(&scratch, size), "cuMemAlloc");
  CU(d.cuMemHostAlloc(&pinned, size, 0), "cuMemHostAlloc");
  memset(pinned, 1, size);
  double t0 = now_s();
  CU(d.cuMemcpyHtoD(scratch, pinned, size), "cuMemcpyHtoD");
  double htod = now_s() - t0;
  t0 = now_s();
  CU(d.cuMemcpyDtoH(pinned, scratch, size), "cuMemcpyDtoH");
  double dtoh = now_s() - t0;
  CU(d.cuMemFreeHost(pinned), "cuMemFreeHost");
  CU(d.cuMemFree(scratch), "cuMemFree");
  gmb_stats before, after;
  if ((rc = gmb_tenant_stats(c, &before)) != 0) return fail(c, "stats", rc);
  char cmd[1024];
  snprintf(cmd, sizeof cmd, "'%s' --run-dir '%s' pause '%s' --tag "
           "'(movable)' >/dev/null", ctl, run, tenant);
  t0 = now_s();
  if (system(cmd) != 0) {
    fprintf(stderr, "gpu_checks: %s failed\n", cmd);
    return 1;
  }
  double out = now_s() - t0;
  if ((rc = gmb_tenant_stats(c, &after)) != 0) return fail(c, "stats", rc);
  if (after.used + size > before.used) {
    printf("BAD offload: the tenant still uses %llu of %llu bytes\n",
           (unsigned long long)after.used, (unsigned long long)before.used);
    return 1;
  }
  t0 = now_s();
  for (size_t a = 0; a < n; a++) {
    void *p;
    if ((rc = gmb_lock(c, id[a], &p)) != 0) return fail(c, "gmb_lock", rc);
    gmb_unlock(c, id[a]);
  }
  double in = now_s() - t0;
  size_t bad = 0;
  for (size_t a = 0; a < n; a++) {
    if ((rc = gmb_read(c, id[a], 0, w, mib)) != 0)
      return fail(c, "gmb_read", rc);
    for (size_t k = 0; k < mib / 8; k++) bad += w[k] != offl_word(a, k);
  }
  for (size_t a = 0; a < n; a++) gmb_free(c, id[a]);
  gmb_disconnect(c);
  double gb = (double)size / 1e9;
  printf("FIGURE broker_offload_GBps %.2f (gmbctl pause, with its start; "
         "cuMemcpyDtoH pinned %.2f GB/s: x%.2f)\n", gb / out, gb / dtoh,
         dtoh / out);
  printf("FIGURE broker_restore_GBps %.2f (gmb_lock of each; cuMemcpyHtoD "
         "pinned %.2f GB/s: x%.2f)\n", gb / in, gb / htod, htod / in);
  printf("%s offload: %zu MiB offloaded by the broker and locked back, %zu "
         "words wrong\n", bad ? "BAD" : "OK", n, bad);
  free(w);
  free(id);
  return bad ? 1 : 0;
}

int main(int argc, char **argv) {
  if (argc >= 3 && strcmp(argv[1], "fresh-write") == 0)
    return fresh(1, size_arg(argv[2]));
  if (argc >= 3 && strcmp(argv[1], "fresh-read") == 0)
    return fresh(0, size_arg(argv[2]));
  if (argc >= 4 && strcmp(argv[1], "ctx-free") == 0)
    return ctx_free(size_arg(argv[2]), atoi(argv[3]));
  if (argc >= 4 && strcmp(argv[1], "bench") == 0)
    return bench(size_arg(argv[2]), atoi(argv[3]));
  if (argc >= 4 && strcmp(argv[1], "sleep") == 0)
    return sleep_bw(size_arg(argv[2]), atoi(argv[3]));
  if (argc >= 5 && strcmp(argv[1], "offload") == 0)
    return offload(size_arg(argv[2]), argv[3], argv[4]);
  fprintf(stderr, "usage: gpu_checks fresh-write|fresh-read SIZE | ctx-free "
          "SIZE N | bench SIZE N | sleep SIZE N | offload SIZE GMBCTL "
          "RUNDIR\n");
  return 2;
}
