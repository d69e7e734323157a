/*
 * test_replay.c - gmb-replay, run as a user runs it: a small trace written
 * here, replayed through the real broker it starts, its figures read back
 * from --json and --series.
 *
 * The traces are tiny and their outcome is decided by the pool's segment
 * policy (small requests share 2 MiB segments of one tenant; a large one
 * needs a segment of its own), so every count below is exact: a quota
 * refusal is a failure but not a fragmentation failure, a GMB_E_NOMEM is
 * a fragmentation failure only when the free total could hold it, and an
 * operation on a key whose alloc failed is skipped.  The counting cases
 * run with compaction off, so they do not depend on what compaction does;
 * one case runs the classic half-empty-segments scenario with compaction
 * auto and requires the request served and every stamp intact.
 */
#include <check.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "harness.h"

#define OUT_CAP 65536

struct replay_run {
  char trace[64];
  char series[64];
  char out[OUT_CAP];
  int status;
  json_t *json; /* NULL unless the output held a JSON object */
};

/* Writes `text` as a trace and runs gmb-replay on it with `mode`, with
 * --cache when `cache` and -v when `verbose`. */
static void replay_ex_v(struct replay_run *r, const char *text,
                        const char *mode, int series, int cache,
                        int verbose) {
  memset(r, 0, sizeof *r);
  snprintf(r->trace, sizeof r->trace, "/tmp/gmbt-trace-%d", (int)getpid());
  snprintf(r->series, sizeof r->series, "/tmp/gmbt-series-%d", (int)getpid());
  harness_write_file(r->trace, text);
  char bin[256];
  snprintf(bin, sizeof bin, "%s/gmb-replay", harness_build_dir());
  char *argv[10] = {bin, "--trace", r->trace, "--compaction", (char *)mode,
                    "--json"};
  int n = 6;
  if (series) {
    argv[n++] = "--series";
    argv[n++] = r->series;
  }
  if (cache) argv[n++] = "--cache";
  if (verbose) argv[n++] = "-v";
  /* The broker it starts checks its pool after every request. */
  setenv("GMB_BROKER_CHECKS", "1", 1);
  r->status = harness_run(argv, r->out, sizeof r->out);
  const char *brace = strchr(r->out, '{');
  if (brace) {
    json_error_t err;
    r->json = json_loads(brace, JSON_DISABLE_EOF_CHECK, &err);
  }
  unlink(r->trace);
}

/* Writes `text` as a trace and runs gmb-replay on it with `mode`, and
 * with --cache when `cache`. */
static void replay_ex(struct replay_run *r, const char *text, const char *mode,
                      int series, int cache) {
  replay_ex_v(r, text, mode, series, cache, 0);
}

static void replay(struct replay_run *r, const char *text, const char *mode,
                   int series) {
  replay_ex(r, text, mode, series, 0);
}

static void replay_done(struct replay_run *r) {
  json_decref(r->json);
  unlink(r->series);
}

static long long jint(const struct replay_run *r, const char *key) {
  json_t *v = json_object_get(r->json, key);
  ck_assert_msg(v != NULL && json_is_integer(v),
                "key '%s' missing or not an integer in:\n%s", key, r->out);
  return (long long)json_integer_value(v);
}

/*
 * Tenant a: four 512KiB blocks share one 2MiB segment; two are freed.
 * Tenant q (quota 1MiB): 768KiB, then 512KiB more is over its quota.
 * Tenant b: 14MiB needs a segment of its own; 12MiB are outside segments
 * but 16 - 1 - 0.75 = 14.25MiB are free in total: fragmentation.  15MiB
 * more than the free total: no memory, not fragmentation.
 */
static const char counting_trace[] =
    "# test_replay: counting\n"
    "capacity 16MiB\n"
    "quota q 1MiB\n"
    "alloc a k1 512KiB movable\n"
    "alloc a k2 512KiB movable\n"
    "alloc a k3 512KiB movable\n"
    "alloc a k4 512KiB\n"
    "alloc q s1 768KiB\n"
    "alloc q s2 512KiB      # over the quota\n"
    "lock a k1\n"
    "unlock a k1\n"
    "free a k2\n"
    "free a k3\n"
    "alloc b big 14MiB movable   # fragmentation\n"
    "alloc b huge 15MiB          # more than is free at all\n"
    "free q s2   # skipped: its alloc failed\n"
    "free b big  # skipped\n"
    "free q s1\n";

START_TEST(replay_quota_failure_is_not_fragmentation) {
  struct replay_run r;
  replay(&r, counting_trace, "off", 1);
  ck_assert_msg(r.status == 0, "gmb-replay exited %d:\n%s", r.status, r.out);
  ck_assert_msg(r.json != NULL, "no JSON in:\n%s", r.out);
  ck_assert_int_eq(jint(&r, "operations"), 15);
  ck_assert_int_eq(jint(&r, "skipped"), 2);
  ck_assert_int_eq(jint(&r, "failures"), 3);
  ck_assert_int_eq(jint(&r, "quota_failures"), 1);
  ck_assert_int_eq(jint(&r, "nomem_failures"), 2);
  ck_assert_int_eq(jint(&r, "fragmentation_failures"), 1);
  ck_assert_int_eq(jint(&r, "other_failures"), 0);
  ck_assert_int_eq(jint(&r, "corrupted"), 0);
  ck_assert_int_eq(jint(&r, "accounting_mismatches"), 0);
  ck_assert_int_eq(jint(&r, "tenants"), 3);
  /* 4 x 512KiB + 768KiB before anything was freed. */
  ck_assert_int_eq(jint(&r, "peak_bytes_in_use"), 4 * 524288 + 786432);
  ck_assert_int_eq(jint(&r, "bytes_moved"), 0);
  json_t *cs = json_object_get(r.json, "compaction_seconds");
  ck_assert_msg(cs && json_is_number(cs), "compaction_seconds: %s", r.out);
  ck_assert_msg(json_is_number(json_object_get(r.json, "wall_seconds")),
                "wall_seconds missing");
  ck_assert_str_eq(json_string_value(json_object_get(r.json, "compaction")),
                   "off");
  replay_done(&r);
}
END_TEST

/*
 * Three tenants of 512KiB each on a 4MiB device: 1.5MiB in use, but each
 * tenant needs a 2MiB page of its own, so the third is refused whatever
 * the allocator (page bound).  The floor (one byte-exact pool) refuses
 * nothing; the paged floor refuses exactly that one, and so does the
 * broker, with compaction off and auto.
 */
static const char paged_trace[] =
    "# test_replay: paged floor\n"
    "capacity 4MiB\n"
    "alloc a k1 512KiB movable\n"
    "alloc b k1 512KiB movable\n"
    "alloc c k1 512KiB movable   # page bound\n"
    "free a k1\n"
    "alloc c k2 512KiB movable   # a's page went back: served\n";

START_TEST(replay_page_bound_meets_paged_floor) {
  const char *modes[2] = {"off", "auto"};
  for (int m = 0; m < 2; m++) {
    struct replay_run r;
    replay(&r, paged_trace, modes[m], 0);
    ck_assert_msg(r.status == 0, "gmb-replay exited %d:\n%s", r.status, r.out);
    ck_assert_msg(r.json != NULL, "no JSON in:\n%s", r.out);
    ck_assert_int_eq(jint(&r, "failures"), 1);
    ck_assert_int_eq(jint(&r, "fragmentation_failures"), 1);
    ck_assert_int_eq(jint(&r, "page_bound_failures"), 1);
    ck_assert_int_eq(jint(&r, "baseline_shared_failures"), 0);
    ck_assert_int_eq(jint(&r, "baseline_paged_failures"), 1);
    ck_assert_int_eq(jint(&r, "baseline_paged_quota_failures"), 0);
    ck_assert_int_eq(jint(&r, "corrupted"), 0);
    replay_done(&r);
  }
}
END_TEST

/* --series: a row per operation on a trace this short, plus the end;
 * columns op, in use, largest free, in segments, free total. */
START_TEST(replay_series_rows) {
  struct replay_run r;
  replay(&r, counting_trace, "off", 1);
  ck_assert_msg(r.status == 0, "gmb-replay exited %d:\n%s", r.status, r.out);
  FILE *f = fopen(r.series, "r");
  ck_assert_msg(f != NULL, "no series file");
  char line[256];
  long rows = 0, last_op = -1;
  unsigned long long op, in_use, largest, segs, free_total, max_use = 0;
  while (fgets(line, sizeof line, f)) {
    if (line[0] == '#') continue;
    ck_assert_int_eq(sscanf(line, "%llu %llu %llu %llu %llu", &op, &in_use,
                            &largest, &segs, &free_total), 5);
    ck_assert_int_gt((long)op, last_op);
    ck_assert_uint_le(in_use, segs);
    ck_assert_uint_le(free_total, 16ull << 20);
    if (in_use > max_use) max_use = in_use;
    last_op = (long)op;
    rows++;
  }
  fclose(f);
  ck_assert_int_eq(rows, 16); /* before ops 0..14, and 15 at the end */
  ck_assert_int_eq(last_op, 15);
  ck_assert_uint_eq(max_use, 4 * 524288 + 786432);
  replay_done(&r);
}
END_TEST

/* A mistake in the trace is named with its line, before any broker runs. */
START_TEST(replay_bad_trace_line) {
  struct replay_run r;
  replay(&r,
         "capacity 16MiB\n"
         "alloc a k1 1MiB\n"
         "free a k2\n",
         "off", 0);
  ck_assert_int_eq(r.status, 2);
  char want[96];
  snprintf(want, sizeof want, "%s:3:", r.trace);
  ck_assert_msg(strstr(r.out, want) != NULL, "no '%s' in:\n%s", want, r.out);
  replay_done(&r);
  replay(&r, "alloc a k1 1MiB\n", "off", 0);
  ck_assert_int_eq(r.status, 2);
  ck_assert_msg(strstr(r.out, "capacity") != NULL, "%s", r.out);
  replay_done(&r);
  replay(&r, "capacity 16MiB\nalloc a k1 1MiB\nalloc a k1 1MiB\n", "off", 0);
  ck_assert_int_eq(r.status, 2);
  ck_assert_msg(strstr(r.out, "already allocated") != NULL, "%s", r.out);
  replay_done(&r);
}
END_TEST

/*
 * Seven segments of four 512KiB movable blocks; every other block freed
 * leaves 7MiB in 14MiB of segments, 2MiB outside.  6MiB fits the 9MiB free
 * total but no hole: compaction auto must gather the holes, and every
 * moved block must keep its stamps (a corrupted one makes gmb-replay exit
 * 1).
 */
START_TEST(replay_auto_serves_fragmented_request) {
  char text[8192];
  size_t n = (size_t)snprintf(text, sizeof text, "capacity 16MiB\n");
  for (int i = 0; i < 28; i++)
    n += (size_t)snprintf(text + n, sizeof text - n,
                          "alloc a k%d 512KiB movable\n", i);
  for (int i = 1; i < 28; i += 2)
    n += (size_t)snprintf(text + n, sizeof text - n, "free a k%d\n", i);
  snprintf(text + n, sizeof text - n, "alloc a big 6MiB\n");
  struct replay_run off, on;
  replay(&off, text, "off", 0);
  ck_assert_msg(off.status == 0 && off.json, "off: %d\n%s", off.status,
                off.out);
  ck_assert_int_eq(jint(&off, "fragmentation_failures"), 1);
  replay(&on, text, "auto", 0);
  ck_assert_msg(on.status == 0 && on.json, "auto: %d\n%s", on.status, on.out);
  ck_assert_int_eq(jint(&on, "failures"), 0);
  ck_assert_int_eq(jint(&on, "fragmentation_failures"), 0);
  ck_assert_int_eq(jint(&on, "corrupted"), 0);
  ck_assert_int_eq(jint(&on, "accounting_mismatches"), 0);
  ck_assert_int_gt(jint(&on, "bytes_moved"), 0);
  replay_done(&off);
  replay_done(&on);
}
END_TEST

/*
 * --cache: the same trace through each client's cache gives the same
 * figures (operations, failures, peak in use) and the broker's bytes for
 * each tenant are the pages its cache holds.  Tenant a: two 512 KiB
 * blocks share a 2 MiB page, and 3 MiB starts in that page's rest and
 * takes one page more; b's 1 MiB gets a page.  Every later request is
 * served from what was freed (k4 in k1's place, j2 in j1's, k5 in k3's):
 * 4 hits, 3 misses, 3 broker requests instead of 11 (7 allocs, 4 frees),
 * and the pages held peak at 6 MiB for 4.75 MiB in use.
 */
static const char cache_trace[] =
    "capacity 64MiB\n"
    "alloc a k1 512KiB\n"
    "alloc a k2 512KiB movable\n"
    "alloc a k3 3MiB\n"
    "free a k1\n"
    "alloc a k4 256KiB\n"
    "alloc b j1 1MiB\n"
    "free b j1\n"
    "alloc b j2 1MiB\n"
    "lock a k3\n"
    "unlock a k3\n"
    "free a k3\n"
    "alloc a k5 3MiB\n"
    "free a k2\n";

START_TEST(replay_cache_same_accounting) {
  struct replay_run plain, cached;
  replay_ex(&plain, cache_trace, "off", 0, 0);
  ck_assert_msg(plain.status == 0 && plain.json, "%d:\n%s", plain.status,
                plain.out);
  replay_ex(&cached, cache_trace, "off", 0, 1);
  ck_assert_msg(cached.status == 0 && cached.json, "%d:\n%s", cached.status,
                cached.out);
  static const char *const same[] = {"operations", "skipped", "failures",
                                     "peak_bytes_in_use", "corrupted",
                                     "accounting_mismatches",
                                     "uncached_requests"};
  for (size_t i = 0; i < sizeof same / sizeof same[0]; i++)
    ck_assert_msg(jint(&plain, same[i]) == jint(&cached, same[i]),
                  "%s: %lld without the cache, %lld with it", same[i],
                  jint(&plain, same[i]), jint(&cached, same[i]));
  ck_assert_int_eq(jint(&cached, "operations"), 13);
  ck_assert_int_eq(jint(&cached, "failures"), 0);
  ck_assert_int_eq(jint(&cached, "accounting_mismatches"), 0);
  ck_assert_int_eq(jint(&cached, "peak_bytes_in_use"), 4980736);
  ck_assert(json_is_true(json_object_get(cached.json, "cache")));
  ck_assert(json_is_false(json_object_get(plain.json, "cache")));
  ck_assert_int_eq(jint(&cached, "cache_hits"), 4);
  ck_assert_int_eq(jint(&cached, "cache_misses"), 3);
  ck_assert_int_eq(jint(&cached, "cache_slab_allocs"), 3);
  ck_assert_int_eq(jint(&cached, "broker_requests"), 3);
  ck_assert_int_eq(jint(&cached, "uncached_requests"), 11);
  ck_assert_int_eq(jint(&plain, "broker_requests"), 11);
  ck_assert_int_eq(jint(&cached, "peak_bytes_held"), 6 << 20);
  ck_assert_int_eq(jint(&plain, "peak_bytes_held"), 4980736);
  replay_done(&plain);
  replay_done(&cached);
}
END_TEST

/* What the cache costs: its slabs count against the quota, so a tenant
 * whose quota is below a small slab (2 MiB) cannot have 768 KiB through
 * it, which it can without. */
START_TEST(replay_cache_slab_counts_against_quota) {
  static const char text[] = "capacity 16MiB\n"
                             "quota q 1MiB\n"
                             "alloc q s1 768KiB\n"
                             "free q s1\n";
  struct replay_run plain, cached;
  replay_ex(&plain, text, "off", 0, 0);
  replay_ex(&cached, text, "off", 0, 1);
  ck_assert_msg(plain.status == 0 && cached.status == 0 && plain.json &&
                    cached.json, "%s\n%s", plain.out, cached.out);
  ck_assert_int_eq(jint(&plain, "failures"), 0);
  ck_assert_int_eq(jint(&cached, "failures"), 1);
  ck_assert_int_eq(jint(&cached, "quota_failures"), 1);
  ck_assert_int_eq(jint(&cached, "skipped"), 1);
  ck_assert_int_eq(jint(&cached, "accounting_mismatches"), 0);
  replay_done(&plain);
  replay_done(&cached);
}
END_TEST

/* The peak held is the bytes all caches hold at one moment, never more
 * than the device.  Tenant a's cache keeps 12 MiB of pages after its block
 * is freed, and reports them to the broker within its library thread's
 * tick (20 ms), which a's many small hits after it leave time for.  b's
 * five pages then need 6 MiB of a's, which the broker asks a's cache to
 * give back: a's library thread does, with no operation of a's in the
 * trace after it.  The caches peak at different times (a at 12 MiB, b at
 * 10 MiB), together never over 16 MiB; summing each tenant's last answer
 * counted a's 12 MiB beside b's pages: 22 MiB on a 16 MiB device.  (Were
 * a's report late, b's request would be refused: the bound holds too.) */
START_TEST(replay_cache_peak_held_within_capacity) {
  size_t cap = 256 * 1024, n = 0;
  char *text = malloc(cap);
  ck_assert_ptr_nonnull(text);
  n += (size_t)snprintf(text + n, cap - n,
                        "capacity 16MiB\nalloc a k1 12MiB\nfree a k1\n");
  for (int i = 0; i < 5000; i++)
    n += (size_t)snprintf(text + n, cap - n, "alloc a s%d 4KiB\nfree a s%d\n",
                          i, i);
  for (int j = 0; j < 5; j++)
    n += (size_t)snprintf(text + n, cap - n, "alloc b j%d 2MiB\n", j);
  for (int j = 0; j < 5; j++)
    n += (size_t)snprintf(text + n, cap - n, "free b j%d\n", j);
  ck_assert_uint_lt(n, cap);
  struct replay_run r;
  replay_ex(&r, text, "auto", 0, 1);
  free(text);
  ck_assert_msg(r.status == 0 && r.json, "%d:\n%s", r.status, r.out);
  ck_assert_int_eq(jint(&r, "accounting_mismatches"), 0);
  ck_assert_int_eq(jint(&r, "corrupted"), 0);
  ck_assert_int_eq(jint(&r, "peak_bytes_in_use"), 12 << 20);
  ck_assert_msg(jint(&r, "peak_bytes_held") >= 12 << 20 &&
                    jint(&r, "peak_bytes_held") <= 16 << 20,
                "peak_bytes_held %lld on a 16 MiB device (a peaked at 12 "
                "MiB):\n%s", jint(&r, "peak_bytes_held"), r.out);
  replay_done(&r);
}
END_TEST

/* Tenant a frees 12 MiB into its cache on a 16 MiB device and tenant b's
 * cache asks for 10 MiB right after: a's free reported its idle pages at
 * once, so b's pages are held while a gives them back, and served (the
 * broker also counts the pages of a refused batch for b while it gives
 * them back: it aborted on that once). */
START_TEST(replay_cache_freed_pages_serve_another_tenant) {
  struct replay_run r;
  replay_ex(&r,
            "capacity 16MiB\nalloc a k1 12MiB\nfree a k1\n"
            "alloc b j1 10MiB\nfree b j1\n",
            "auto", 0, 1);
  ck_assert_msg(r.status == 0 && r.json, "%d:\n%s", r.status, r.out);
  ck_assert_msg(jint(&r, "failures") == 0, "b refused:\n%s", r.out);
  ck_assert_int_eq(jint(&r, "accounting_mismatches"), 0);
  replay_done(&r);
}
END_TEST

/* -v with --cache says why each refusal happened.  Two blocks of 1.5 MiB
 * take both pages of a 4 MiB device whatever their placement, and each
 * page holds a block: b's 512 KiB finds 1 MiB free, but only in pages
 * with blocks in use, which no trim can give back. */
START_TEST(replay_cache_refusal_cause_partial_pages) {
  struct replay_run r;
  replay_ex_v(&r,
              "capacity 4MiB\nalloc a k1 1536KiB\nalloc a k2 1536KiB\n"
              "alloc b j1 512KiB\n",
              "auto", 0, 1, 1);
  ck_assert_msg(r.status == 0 && r.json, "%d:\n%s", r.status, r.out);
  ck_assert_int_eq(jint(&r, "failures"), 1);
  ck_assert_int_eq(jint(&r, "fragmentation_failures"), 1);
  json_t *w = json_object_get(r.json, "cache_refusal_causes");
  ck_assert_msg(w != NULL, "no causes:\n%s", r.out);
  ck_assert_int_eq(json_integer_value(json_object_get(w, "partial")), 1);
  ck_assert_int_eq(json_integer_value(json_object_get(w, "idle")), 0);
  ck_assert_int_eq(json_integer_value(json_object_get(w, "full")), 0);
  ck_assert_msg(strstr(r.out, "cause: no memory, free bytes only in pages "
                              "with blocks in use") != NULL,
                "%s", r.out);
  replay_done(&r);
}
END_TEST

/* --cache is reproducible: two replays of one trace give the same figures,
 * times aside.  kv (tracegen, a fifth of its length) has the caches ask
 * each other for pages; the children's reports and their answers to the
 * broker's asks raced the next operation once, and the refusals and the
 * pages given back varied from run to run (1 or 2 refusals, 35 or 43
 * pages here). */
#define GEN_CAP (1u << 20)
START_TEST(replay_cache_reproducible) {
  char *text = malloc(GEN_CAP);
  ck_assert_ptr_nonnull(text);
  char gen[256];
  snprintf(gen, sizeof gen, "%s/bench/tracegen", harness_build_dir());
  char *argv[] = {gen, "--seed", "1", "--scale", "0.2", "kv", NULL};
  ck_assert_int_eq(harness_run(argv, text, GEN_CAP), 0);
  ck_assert_uint_lt(strlen(text), GEN_CAP - 1);
  static struct replay_run r[2];
  for (int i = 0; i < 2; i++) {
    replay_ex(&r[i], text, "auto", 0, 1);
    ck_assert_msg(r[i].status == 0 && r[i].json, "%d:\n%s", r[i].status,
                  r[i].out);
    json_object_del(r[i].json, "wall_seconds");
    json_object_del(r[i].json, "compaction_seconds");
  }
  free(text);
  /* The trace does what the check is about: pages went back. */
  ck_assert_int_gt(jint(&r[0], "cache_slab_frees"), 0);
  ck_assert_int_eq(jint(&r[0], "accounting_mismatches"), 0);
  ck_assert_msg(json_equal(r[0].json, r[1].json), "two runs differ:\n%s\n"
                "---\n%s", r[0].out, r[1].out);
  replay_done(&r[0]);
  replay_done(&r[1]);
}
END_TEST

int main(void) {
  return harness_main(HARNESS_SUITE(
      "replay", "replay", 60,
      replay_quota_failure_is_not_fragmentation,
      replay_page_bound_meets_paged_floor,
      replay_series_rows,
      replay_bad_trace_line,
      replay_auto_serves_fragmented_request,
      replay_cache_same_accounting,
      replay_cache_slab_counts_against_quota,
      replay_cache_peak_held_within_capacity,
      replay_cache_freed_pages_serve_another_tenant,
      replay_cache_refusal_cause_partial_pages,
      replay_cache_reproducible));
}
