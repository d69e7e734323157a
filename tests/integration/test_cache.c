/*
 * test_cache.c - the stream-ordered cache (gmb_malloc_async,
 * gmb_free_async, gmb_trim) against a real broker on the host device:
 * what the broker sees of it (slabs count as the tenant's memory), that
 * a hit asks the broker nothing, that a quota makes the cache give its
 * own memory back and try again, that bad pointers change nothing, and
 * that a process killed with a full cache is reclaimed like any other.
 */
#include <check.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cache.h"
#include "gmb.h"
#include "harness.h"

#define MIB (UINT64_C(1) << 20)

static struct gmb_cache_counters counters(gmb_client *c) {
  struct gmb_cache_counters k;
  gmb__client_cache_counters(c, &k);
  return k;
}

/* The transformer-like round: activations of 512 B..8 MiB, freed in
 * reverse.  The memory is written and read back through the pointers. */
static void round_trip(gmb_client *c, uint64_t seed) {
  static const size_t sizes[] = {512, 4096, 70000, 1 << 20, 3 << 20,
                                 8 << 20, 600, 2 << 20};
  enum { N = sizeof sizes / sizeof sizes[0] };
  void *p[N];
  for (int i = 0; i < N; i++) {
    ck_assert_int_eq(gmb_malloc_async(c, sizes[i], NULL, &p[i]), 0);
    harness_pattern_fill(p[i], sizes[i], seed + (uint64_t)i);
  }
  for (int i = N - 1; i >= 0; i--) {
    long bad = harness_pattern_check(p[i], sizes[i], seed + (uint64_t)i);
    ck_assert_msg(bad < 0, "block %d differs at byte %ld", i, bad);
    ck_assert_int_eq(gmb_free_async(c, p[i], NULL), 0);
  }
}

START_TEST(hits_send_nothing_and_count_as_used) {
  struct harness_broker b;
  harness_broker_start(&b, "host:256MiB", NULL);
  gmb_client *c = harness_connect_ok(&b, "cache");
  round_trip(c, 1);
  struct gmb_cache_counters k1 = counters(c);
  gmb_stats s1 = harness_stats_ok(c);
  ck_assert_uint_gt(k1.slab_allocs, 0);
  /* The slabs are the tenant's: held, and cached free. */
  ck_assert_uint_eq(s1.used, k1.slab_bytes);
  ck_assert_uint_eq(s1.cached, k1.slab_bytes);
  for (uint64_t r = 2; r < 12; r++) round_trip(c, r);
  struct gmb_cache_counters k2 = counters(c);
  ck_assert_uint_eq(k2.slab_allocs, k1.slab_allocs);
  ck_assert_uint_eq(k2.misses, k1.misses);
  ck_assert_uint_eq(k2.hits, k1.hits + 10 * 8);
  ck_assert_uint_eq(harness_stats_ok(c).used, s1.used);
  /* A trim gives every slab back. */
  ck_assert_int_eq(gmb_trim(c, 0), 0);
  gmb_stats s3 = harness_stats_ok(c);
  ck_assert_uint_eq(s3.used, 0);
  ck_assert_uint_eq(s3.cached, 0);
  gmb_disconnect(c);
  harness_broker_stop(&b);
}
END_TEST

/* gmb_cache_stats_get tells what the cache's own counters say, and the
 * broker agrees on the bytes held; gmb_record_stream's refusals (the
 * host device ignores streams, so it is otherwise a no-op here). */
START_TEST(cache_stats_and_record_stream) {
  struct harness_broker b;
  harness_broker_start(&b, "host:256MiB", NULL);
  gmb_client *c = harness_connect_ok(&b, "cache");
  gmb_cache_stats cs;
  ck_assert_int_eq(gmb_cache_stats_get(c, NULL), GMB_E_INVAL);
  ck_assert_int_eq(gmb_cache_stats_get(NULL, &cs), GMB_E_INVAL);
  round_trip(c, 7);
  round_trip(c, 8);
  void *p;
  ck_assert_int_eq(gmb_malloc_async(c, 3000, NULL, &p), 0);
  ck_assert_int_eq(gmb_cache_stats_get(c, &cs), 0);
  struct gmb_cache_counters k = counters(c);
  ck_assert_uint_eq(cs.hits, k.hits);
  ck_assert_uint_eq(cs.misses, k.misses);
  ck_assert_uint_eq(cs.hits + cs.misses, 17);
  ck_assert_uint_eq(cs.slab_allocs, k.slab_allocs);
  ck_assert_uint_eq(cs.held, k.slab_bytes);
  ck_assert_uint_eq(cs.in_use, 3072);
  ck_assert_uint_eq(cs.cached, k.cached);
  ck_assert_uint_eq(cs.peak_held, k.peak_slab_bytes);
  ck_assert_uint_ge(cs.peak_in_use, (uint64_t)(8 + 3 + 2 + 1) * MIB);
  ck_assert_uint_eq(harness_stats_ok(c).used, cs.held);
  int x;
  ck_assert_int_eq(gmb_record_stream(c, &x, NULL), GMB_E_NOENT);
  ck_assert_int_eq(gmb_record_stream(c, p, (void *)(uintptr_t)2),
                   GMB_E_INVAL);
  ck_assert_int_eq(gmb_record_stream(c, p, (void *)(uintptr_t)0x1234), 0);
  ck_assert_int_eq(gmb_free_async(c, p, NULL), 0);
  ck_assert_int_eq(gmb_record_stream(c, p, NULL), GMB_E_INVAL);
  ck_assert_int_eq(gmb_trim(c, 0), 0);
  ck_assert_int_eq(gmb_cache_stats_get(c, &cs), 0);
  ck_assert_uint_eq(cs.held, 0);
  ck_assert_uint_eq(cs.slab_frees, cs.slab_allocs);
  gmb_disconnect(c);
  harness_broker_stop(&b);
}
END_TEST

START_TEST(bad_pointers_change_nothing) {
  struct harness_broker b;
  harness_broker_start(&b, "host:256MiB", NULL);
  gmb_client *c = harness_connect_ok(&b, "cache");
  void *p, *q;
  ck_assert_int_eq(gmb_malloc_async(c, 1000, NULL, &p), 0);
  ck_assert_int_eq(gmb_malloc_async(c, 0, NULL, &q), GMB_E_INVAL);
  int x;
  ck_assert_int_eq(gmb_free_async(c, &x, NULL), GMB_E_NOENT);
  ck_assert_ptr_nonnull(strstr(gmb_last_error(c), "not a block"));
  ck_assert_int_eq(gmb_free_async(c, (char *)p + 512, NULL), GMB_E_NOENT);
  ck_assert_int_eq(gmb_free_async(c, NULL, NULL), 0);
  ck_assert_int_eq(gmb_free_async(c, p, NULL), 0);
  ck_assert_int_eq(gmb_free_async(c, p, NULL), GMB_E_INVAL);
  ck_assert_ptr_nonnull(strstr(gmb_last_error(c), "double free"));
  /* The cache still works and is whole. */
  ck_assert_int_eq(gmb_malloc_async(c, 1000, NULL, &q), 0);
  ck_assert_ptr_eq(q, p);
  ck_assert_int_eq(gmb_free_async(c, q, NULL), 0);
  gmb_disconnect(c);
  harness_broker_stop(&b);
}
END_TEST

/* Cached bytes count against the quota; a request that needs a new slab
 * beyond it makes the cache give its free slabs back and try again. */
START_TEST(quota_with_cache) {
  struct harness_broker b;
  harness_broker_start(&b, "host:256MiB", "[tenant:q]\nquota = 16MiB\n");
  gmb_client *c = harness_connect_ok(&b, "q");
  void *p, *q, *r;
  ck_assert_int_eq(gmb_malloc_async(c, 12 * MIB, NULL, &p), 0);
  ck_assert_int_eq(gmb_free_async(c, p, NULL), 0);
  gmb_stats s = harness_stats_ok(c);
  ck_assert_uint_eq(s.used, 12 * MIB);
  ck_assert_uint_eq(s.cached, 12 * MIB);
  /* 14 MiB: no cached block fits, and 12 + 14 > 16: trimmed, retried. */
  ck_assert_int_eq(gmb_malloc_async(c, 14 * MIB, NULL, &q), 0);
  s = harness_stats_ok(c);
  ck_assert_uint_eq(s.used, 14 * MIB);
  ck_assert_uint_eq(s.cached, 0);
  /* In use, not cached: the quota's refusal stands, explained. */
  ck_assert_int_eq(gmb_malloc_async(c, 4 * MIB, NULL, &r), GMB_E_QUOTA);
  ck_assert_ptr_nonnull(strstr(gmb_last_error(c), "GMB_E_QUOTA"));
  ck_assert_uint_le(harness_stats_ok(c).peak, 16 * MIB);
  ck_assert_int_eq(gmb_free_async(c, q, NULL), 0);
  /* And the freed 14 MiB serve a 4 MiB request without a message. */
  struct gmb_cache_counters k1 = counters(c);
  ck_assert_int_eq(gmb_malloc_async(c, 4 * MIB, NULL, &r), 0);
  ck_assert_uint_eq(counters(c).slab_allocs, k1.slab_allocs);
  ck_assert_int_eq(gmb_free_async(c, r, NULL), 0);
  gmb_disconnect(c);
  harness_broker_stop(&b);
}
END_TEST

/* A session's cached free bytes reach the broker on what it sends anyway
 * (its heartbeats, here): another session of the tenant sees them in its
 * stats, without the first one making a call. */
static int other_sees_cached(void *arg) {
  return harness_stats_ok(arg).cached == 12 * MIB;
}

START_TEST(cached_reported_to_the_broker) {
  struct harness_broker b;
  harness_broker_start(&b, "host:256MiB", NULL);
  gmb_client *a = harness_connect_ok(&b, "shared");
  gmb_client *o = harness_connect_ok(&b, "shared");
  void *p;
  ck_assert_int_eq(gmb_malloc_async(a, 12 * MIB, NULL, &p), 0);
  ck_assert_int_eq(gmb_free_async(a, p, NULL), 0);
  ck_assert_msg(harness_poll_until(other_sees_cached, o, HARNESS_WAIT_MS),
                "the other session sees %llu cached bytes",
                (unsigned long long)harness_stats_ok(o).cached);
  ck_assert_uint_eq(harness_stats_ok(o).used, 12 * MIB);
  gmb_disconnect(a);
  ck_assert_uint_eq(harness_stats_ok(o).cached, 0);
  gmb_disconnect(o);
  harness_broker_stop(&b);
}
END_TEST

/* A tenant's quota held by another process's cache: the broker asks that
 * session to give it back, its library thread does (while it makes no
 * call), and the cache's request is served on a retry. */
static int quota_sees_cached(void *arg) {
  return harness_stats_ok(arg).cached == 12 * MIB;
}

START_TEST(quota_held_by_other_cache_asked_back) {
  setenv("GMB_CACHE_ASK_WAIT_MS", "5000", 1); /* a bound, not a figure */
  struct harness_broker b;
  harness_broker_start(&b, "host:256MiB", "[tenant:q2]\nquota = 16MiB\n");
  gmb_client *a = harness_connect_ok(&b, "q2");
  gmb_client *o = harness_connect_ok(&b, "q2");
  void *p, *q;
  ck_assert_int_eq(gmb_malloc_async(a, 12 * MIB, NULL, &p), 0);
  ck_assert_int_eq(gmb_free_async(a, p, NULL), 0);
  ck_assert(harness_poll_until(quota_sees_cached, o, HARNESS_WAIT_MS));
  /* 12 + 8 > 16: refused at first, a's cache asked, then served. */
  int rc = gmb_malloc_async(o, 8 * MIB, NULL, &q);
  ck_assert_msg(rc == 0, "%s", gmb_last_error(o));
  gmb_stats st = harness_stats_ok(o);
  ck_assert_uint_le(st.used, 16 * MIB);
  ck_assert_uint_le(st.peak, 16 * MIB);
  struct gmb_cache_counters ka;
  gmb__client_cache_counters(a, &ka);
  ck_assert_uint_eq(ka.slab_frees, 1);
  /* A plain gmb_alloc is refused at once, the reason saying what was done
   * (nothing cached is left to ask for here). */
  gmb_id id;
  ck_assert_int_eq(gmb_alloc(a, 12 * MIB, 0, &id), GMB_E_QUOTA);
  ck_assert_int_eq(gmb_free_async(o, q, NULL), 0);
  gmb_disconnect(a);
  gmb_disconnect(o);
  harness_broker_stop(&b);
  unsetenv("GMB_CACHE_ASK_WAIT_MS");
}
END_TEST

struct killed_arg {
  const char *endpoint;
  int ready;
};

static int killed_child(void *arg) {
  struct killed_arg *a = arg;
  gmb_client *c;
  if (gmb_connect(a->endpoint, "doomed", &c)) return 2;
  void *p[8];
  for (int i = 0; i < 8; i++)
    if (gmb_malloc_async(c, 4 * MIB, NULL, &p[i])) return 3;
  for (int i = 0; i < 4; i++) gmb_free_async(c, p[i], NULL);
  harness_pipe_send(a->ready, 'r');
  for (;;) pause();
}

static int doomed_empty(void *arg) {
  gmb_stats s = harness_stats_ok(arg);
  return s.used == 0;
}

START_TEST(killed_client_with_cache_reclaimed) {
  struct harness_broker b;
  harness_broker_start(&b, "host:256MiB", NULL);
  int fds[2];
  ck_assert_int_eq(pipe(fds), 0);
  struct killed_arg a = {b.endpoint, fds[1]};
  pid_t kid = harness_fork(killed_child, &a);
  ck_assert_int_eq(harness_pipe_wait(fds[0], HARNESS_WAIT_MS), 'r');
  gmb_client *c = harness_connect_ok(&b, "doomed");
  ck_assert_uint_eq(harness_stats_ok(c).used, 32 * MIB);
  kill(kid, SIGKILL);
  ck_assert_int_eq(harness_wait(kid), 128 + SIGKILL);
  ck_assert_msg(harness_poll_until(doomed_empty, c, HARNESS_WAIT_MS),
                "the killed client's cache still holds %llu bytes",
                (unsigned long long)harness_stats_ok(c).used);
  gmb_disconnect(c);
  close(fds[0]);
  close(fds[1]);
  harness_broker_stop(&b);
}
END_TEST

int main(void) {
  return harness_main(HARNESS_SUITE(
      "cache", "cache", 60,
      hits_send_nothing_and_count_as_used, cache_stats_and_record_stream,
      bad_pointers_change_nothing,
      quota_with_cache,
      cached_reported_to_the_broker,
      quota_held_by_other_cache_asked_back,
      killed_client_with_cache_reclaimed));
}
