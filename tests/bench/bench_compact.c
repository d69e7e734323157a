/*
 * bench_compact.c - migration throughput of compaction on the host device,
 * against plain memcpy/memmove of the same sizes in the same run.
 *
 * For each allocation size, an arena is filled with movable allocations
 * (every byte written, so no page is first touched by the copy), every
 * other one is freed, and a run compacts it with 2 ms steps as the broker
 * drives it.  Two throughputs: migration, bytes moved over the time spent
 * inside gmb__compact_step less the commits that released a segment
 * (decisions, claims, copies, commits); and end to end, with those
 * releases (on the host device a release unmaps and frees the shm pages,
 * which costs more than copying them).  The baseline
 * copies the same number of blocks of the same size between two buffers
 * that were written beforehand and are read afterwards (so the compiler
 * cannot drop the copies), best of three; a second baseline copies them
 * with gmb__device_copy between two written host segments (shm pages:
 * what the memory itself allows).  The ratios are migration and
 * end to end over memcpy; the goal for migration is >= 0.70.
 *
 * Then the repack planner's worst case (repack.c, the last goal pass): an
 * arena of 4 KiB blocks beside one 1 MiB block per segment, with a 4 KiB
 * hole every 32 blocks, where the plan for the 1 MiB block of the least
 * used segment would need a window's 224 blocks each placed by a scan of
 * every range: the planning spends its whole budget (GMB_REPACK_BUDGET)
 * and gives up; the same for a 512 KiB hole (windows, and segments
 * packed).  Their times against one walk of the pool (gmb__pool_walk,
 * every range once): what one goal run may add to the loop's latency.
 * Then revocation's evacuation (evacuate.h): MIB/4 of 64 KiB movable
 * allocations in sealed segments, all moved out in 1 ms steps (wall and
 * CPU time, every target a fresh segment's pages), against memcpy and the
 * device's copy.
 * Knobs: MIB (bytes of allocations per size before the frees, default 256).
 * Output: one "name value" line per figure.  Runs in a few seconds.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "compact.h"
#include "device.h"
#include "evacuate.h"
#include "gmb.h"
#include "log.h"
#include "pool.h"
#include "pool_impl.h"
#include "repack.h"
#include "util.h"

static uint64_t env_u64(const char *name, uint64_t dflt) {
  const char *s = getenv(name);
  return s && *s ? strtoull(s, NULL, 0) : dflt;
}

static int claim_all(void *ctx, const struct gmb_alloc_info *a) {
  (void)ctx;
  (void)a;
  return 1;
}

/* memcpy of n blocks of `size` bytes between touched buffers; GB/s, best
 * of three.  `sink` keeps the copies observable. */
static double baseline(uint64_t size, uint64_t n, int overlap,
                       volatile uint64_t *sink) {
  size_t len = (size_t)(size * n + size);
  char *src = malloc(len), *dst = malloc(len);
  if (!src || !dst) abort();
  memset(src, 1, len);
  memset(dst, 2, len);
  double best = 0;
  for (int rep = 0; rep < 3; rep++) {
    uint64_t t0 = gmb__now_ns();
    for (uint64_t i = 0; i < n; i++) {
      if (overlap) /* a slide down by size/8 inside one buffer */
        memmove(src + i * size, src + i * size + size / 8, (size_t)size);
      else
        memcpy(dst + i * size, src + i * size, (size_t)size);
    }
    uint64_t t1 = gmb__now_ns();
    uint64_t acc = 0;
    for (size_t off = 0; off < len; off += 4096)
      acc += (uint64_t)(unsigned char)dst[off] + (unsigned char)src[off];
    *sink += acc;
    double gbs = (double)(size * n) / (double)(t1 - t0);
    if (gbs > best) best = gbs;
  }
  free(src);
  free(dst);
  return best;
}

/* gmb__device_copy of n blocks between two touched host segments: what
 * the copies alone cost on shm pages; GB/s, best of three. */
static double baseline_device(struct gmb_device *dev, uint64_t size,
                              uint64_t n) {
  uint64_t bytes =
      (size * n + GMB_SEGMENT_ALIGN - 1) & ~(GMB_SEGMENT_ALIGN - 1);
  struct gmb_dseg a, b;
  if (gmb__device_seg_new(dev, 1u << 30, bytes, &a) != 0 ||
      gmb__device_seg_new(dev, (1u << 30) + 1, bytes, &b) != 0)
    return 0;
  memset(a.host, 1, (size_t)bytes);
  memset(b.host, 2, (size_t)bytes);
  double best = 0;
  for (int rep = 0; rep < 3; rep++) {
    uint64_t t0 = gmb__now_ns();
    for (uint64_t i = 0; i < n; i++)
      gmb__device_copy(dev, &b, i * size, &a, i * size, size);
    double gbs = (double)(size * n) / (double)(gmb__now_ns() - t0);
    if (gbs > best) best = gbs;
  }
  gmb__device_seg_free(dev, &a);
  gmb__device_seg_free(dev, &b);
  return best;
}

static void bench_size(uint64_t size, uint64_t total, volatile uint64_t *sink) {
  char err[256];
  struct gmb_device *dev;
  if (gmb__device_host_open(2 * total + (64u << 20), &dev, err, sizeof err) !=
      0) {
    fprintf(stderr, "bench_compact: %s\n", err);
    exit(1);
  }
  struct gmb_pool *pool = gmb__pool_new(dev, NULL, NULL);
  struct gmb_arena *a = gmb__pool_arena_new(pool, NULL);
  uint64_t n = total / size;
  uint64_t *ids = malloc(n * sizeof *ids);
  for (uint64_t i = 0; i < n; i++) {
    struct gmb_alloc_info info;
    if (gmb__pool_alloc(pool, a, size, GMB_MOVABLE, NULL, &info) != 0) abort();
    memset((char *)info.dseg->host + info.offset, (int)(i & 0xff),
           (size_t)size);
    ids[i] = info.id;
  }
  for (uint64_t i = 1; i < n; i += 2) gmb__pool_free(pool, ids[i], NULL);
  struct gmb_compact_hooks hooks = {.claim = claim_all};
  struct gmb_compact *c = gmb__compact_new(pool, a, 0, &hooks);
  while (gmb__compact_step(c, gmb__now_ns() + 2000000)) {
  }
  struct gmb_compact_stats st;
  gmb__compact_stats(c, &st);
  gmb__compact_destroy(c);
  if (gmb__pool_check(pool) != 0) abort();
  uint64_t mig_ns = st.ns - st.ns_release;
  double gbs = mig_ns ? (double)st.bytes_moved / (double)mig_ns : 0;
  double e2e = st.ns ? (double)st.bytes_moved / (double)st.ns : 0;
  uint64_t blocks = st.bytes_moved / size;
  double cpy = baseline(size, blocks ? blocks : 1, 0, sink);
  double mov = baseline(size, blocks ? blocks : 1, 1, sink);
  double dcp = baseline_device(dev, size, blocks ? blocks : 1);
  char name[32];
  gmb__size_format(size, name, sizeof name);
  printf("compact_%s_moves %llu\n", name, (unsigned long long)st.moves);
  printf("compact_%s_mib_moved %.1f\n", name,
         (double)st.bytes_moved / (1u << 20));
  printf("compact_%s_segments_released %llu\n", name,
         (unsigned long long)st.segments_released);
  printf("compact_%s_release_ms %.2f\n", name, (double)st.ns_release / 1e6);
  printf("compact_%s_migration_gbs %.2f\n", name, gbs);
  printf("compact_%s_end_to_end_gbs %.2f\n", name, e2e);
  printf("memcpy_%s_gbs %.2f\n", name, cpy);
  printf("memmove_%s_gbs %.2f\n", name, mov);
  printf("device_copy_%s_gbs %.2f\n", name, dcp);
  printf("compact_%s_migration_ratio_to_memcpy %.2f\n", name,
         cpy > 0 ? gbs / cpy : 0);
  printf("compact_%s_end_to_end_ratio_to_memcpy %.2f\n", name,
         cpy > 0 ? e2e / cpy : 0);
  free(ids);
  gmb__pool_destroy(pool);
  gmb__device_close(dev);
}

static int movable_all(void *ctx, const struct pool_range *r) {
  (void)ctx;
  return (r->flags & GMB_MOVABLE) != 0;
}

static int walk_count(void *ctx, const struct gmb_alloc_info *info,
                      int is_free) {
  (void)info;
  (void)is_free;
  ++*(uint64_t *)ctx;
  return 0;
}

static void bench_repack(uint64_t total) {
  struct gmb_device *dev;
  char err[256];
  if (gmb__device_host_open(total, &dev, err, sizeof err) != 0) {
    fprintf(stderr, "bench_compact: %s\n", err);
    exit(1);
  }
  struct gmb_pool *p = gmb__pool_new(dev, NULL, NULL);
  struct gmb_arena *a = p ? gmb__pool_arena_new(p, NULL) : NULL;
  if (!a) exit(1);
  uint64_t segs = total / GMB_POOL_SMALL_SEGMENT;
  struct gmb_alloc_info info;
  for (uint64_t s = 0; s < segs; s++) {
    if (gmb__pool_alloc(p, a, 1 << 20, GMB_MOVABLE, NULL, &info) != 0) exit(1);
    for (unsigned k = 0; k < 256; k++) {
      if (gmb__pool_alloc(p, a, 4096, GMB_MOVABLE, NULL, &info) != 0) exit(1);
      /* A hole every 32 blocks, one fewer in the last segment (the least
       * used, the victim). */
      if (k % 32 == 31 || (s + 1 == segs && k == 0))
        gmb__pool_free(p, info.id, NULL);
    }
  }
  uint64_t ranges = 0;
  uint64_t t0 = gmb__now_ns();
  gmb__pool_walk(p, walk_count, &ranges);
  uint64_t walk = gmb__now_ns() - t0;
  printf("repack_ranges %llu\n", (unsigned long long)ranges);
  printf("repack_walk_ms %.2f\n", (double)walk / 1e6);
  /* Emptying a segment, then a 512 KiB hole (windows, and segments
   * packed). */
  static const char *const what[] = {"repack", "repack_hole"};
  static const uint64_t hole[] = {0, 512 * 1024};
  for (int i = 0; i < 2; i++) {
    uint64_t budget = GMB_REPACK_BUDGET;
    struct gmb_repack_plan plan = {0};
    t0 = gmb__now_ns();
    int rc = gmb__repack_plan(p, a, UINT64_MAX, hole[i], movable_all, NULL,
                              &budget, &plan);
    uint64_t ns = gmb__now_ns() - t0;
    printf("%s_plan_found %d\n", what[i], rc);
    printf("%s_budget_left %llu\n", what[i], (unsigned long long)budget);
    printf("%s_plan_ms %.2f\n", what[i], (double)ns / 1e6);
    printf("%s_plan_ratio_to_walk %.1f\n", what[i],
           (double)ns / (double)(walk ? walk : 1));
    gmb__repack_plan_clear(&plan);
  }
  gmb__pool_destroy(p);
  gmb__device_close(dev);
}

/* This thread's CPU time: what a loaded machine's preemption leaves out. */
static uint64_t thread_cpu_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Revocation (evacuate.h): an arena of 64 KiB movable allocations (every
 * byte written) whose segments are all sealed, evacuated with 1 ms steps
 * as the loop drives it: the time inside the steps, the largest step, and
 * the rate against memcpy and the device's own copy in the same run. */
static void bench_revoke(uint64_t total, volatile uint64_t *sink) {
  const uint64_t size = 65536;
  char err[256];
  struct gmb_device *dev;
  if (gmb__device_host_open(2 * total + (64u << 20), &dev, err, sizeof err) !=
      0) {
    fprintf(stderr, "bench_compact: %s\n", err);
    exit(1);
  }
  struct gmb_pool *pool = gmb__pool_new(dev, NULL, NULL);
  struct gmb_arena *a = gmb__pool_arena_new(pool, NULL);
  uint64_t n = total / size, last_seg = 0;
  for (uint64_t i = 0; i < n; i++) {
    struct gmb_alloc_info info;
    if (gmb__pool_alloc(pool, a, size, GMB_MOVABLE, NULL, &info) != 0) abort();
    memset((char *)info.dseg->host + info.offset, (int)(i & 0xff),
           (size_t)size);
  }
  gmb__pool_changes(pool, &last_seg);
  for (uint64_t id = 1; id <= last_seg; id++) gmb__pool_seal(pool, id);
  struct gmb_compact_hooks hooks = {.claim = claim_all};
  struct gmb_evac_stats st;
  memset(&st, 0, sizeof st);
  uint64_t spent = 0, max_step = 0, steps = 0, cpu = 0, cpu_max = 0;
  for (;;) {
    uint64_t t0 = gmb__now_ns(), c0 = thread_cpu_ns();
    int more = gmb__evac_step(pool, a, &hooks, t0 + 1000000, &st);
    uint64_t d = gmb__now_ns() - t0, c = thread_cpu_ns() - c0;
    spent += d;
    cpu += c;
    if (d > max_step) max_step = d;
    if (c > cpu_max) cpu_max = c;
    steps++;
    if (!more) break;
  }
  if (gmb__pool_check(pool) != 0 || st.locked || st.pinned) abort();
  double gbs = spent ? (double)st.bytes_moved / (double)spent : 0;
  uint64_t blocks = st.bytes_moved / size;
  double cpy = baseline(size, blocks ? blocks : 1, 0, sink);
  double dcp = baseline_device(dev, size, blocks ? blocks : 1);
  printf("revoke_64KiB_mib_moved %.1f\n", (double)st.bytes_moved / (1u << 20));
  printf("revoke_64KiB_moves %llu\n", (unsigned long long)st.moves);
  printf("revoke_64KiB_ms %.1f (%llu steps of 1 ms, the largest %.2f ms)\n",
         (double)spent / 1e6, (unsigned long long)steps,
         (double)max_step / 1e6);
  printf("revoke_64KiB_cpu_ms %.1f (the largest step %.2f ms)\n",
         (double)cpu / 1e6, (double)cpu_max / 1e6);
  printf("revoke_64KiB_gbs %.2f (CPU time: %.2f)\n", gbs,
         cpu ? (double)st.bytes_moved / (double)cpu : 0);
  printf("revoke_64KiB_ratio_to_memcpy %.2f (memcpy %.2f GB/s)\n",
         cpy > 0 ? gbs / cpy : 0, cpy);
  printf("revoke_64KiB_ratio_to_device_copy %.2f (device copy %.2f GB/s)\n",
         dcp > 0 ? gbs / dcp : 0, dcp);
  gmb__pool_destroy(pool);
  gmb__device_close(dev);
}

int main(void) {
  gmb__log_set_level(GMB_LOG_WARN);
  uint64_t total = env_u64("MIB", 256) << 20;
  volatile uint64_t sink = 0;
  const uint64_t sizes[] = {4096, 65536, 512 * 1024, 1024 * 1024};
  for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++)
    bench_size(sizes[i], total, &sink);
  bench_repack(total);
  bench_revoke(total / 4, &sink);
  return sink == 42 ? 1 : 0;
}
