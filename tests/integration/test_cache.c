/*
 * test_cache.c - the stream-ordered cache (gmb_malloc_async,
 * gmb_free_async, gmb_trim) against a real broker on the host device:
 * what the broker sees of it (its pages count as the tenant's memory), that
 * a hit asks the broker nothing, that a quota makes the cache give its
 * own memory back and try again, that bad pointers change nothing, that
 * a process killed with a full cache is reclaimed like any other, the
 * elastic cases: a quota, or a full device, held by another process's
 * idle cache, which its library thread gives back when the broker asks
 * (and a process that cannot answer: killed, or stopped), and what the
 * operator sees of caches: cached bytes per tenant and per session in
 * `gmbctl tenants`, `sessions`, `status`, `map` and the metrics.
 */
#include <check.h>
#include <jansson.h>
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
  /* The pages are the tenant's: held, and cached free. */
  ck_assert_uint_eq(s1.used, k1.slab_bytes);
  ck_assert_uint_eq(s1.cached, k1.slab_bytes);
  for (uint64_t r = 2; r < 12; r++) round_trip(c, r);
  struct gmb_cache_counters k2 = counters(c);
  ck_assert_uint_eq(k2.slab_allocs, k1.slab_allocs);
  ck_assert_uint_eq(k2.misses, k1.misses);
  ck_assert_uint_eq(k2.hits, k1.hits + 10 * 8);
  ck_assert_uint_eq(harness_stats_ok(c).used, s1.used);
  /* A trim gives every page back. */
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

/* Cached bytes count against the quota; a request that needs a new page
 * beyond it makes the cache give its idle pages back and try again. */
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

/* The free bytes between blocks in a cache's pages (no trim can give them
 * back) are not charged to the quota, up to the broker's cache_holes part
 * of it (an eighth by default), as free bytes in the broker's own segments
 * are not; with cache_holes = 0 every page is charged whole.  Sixteen
 * 1 MiB blocks fill a 16 MiB quota in 8 pages; every other one freed
 * leaves 8 MiB of holes and no idle page; a 2 MiB request needs a ninth
 * page. */
static unsigned long long metric_of(const struct harness_broker *b,
                                    const char *name, const char *tenant);

static void holes_fill(gmb_client *c, void **blk) {
  for (int i = 0; i < 16; i++)
    ck_assert_int_eq(gmb_malloc_async(c, MIB, NULL, &blk[i]), 0);
  for (int i = 0; i < 16; i += 2)
    ck_assert_int_eq(gmb_free_async(c, blk[i], NULL), 0);
  gmb_stats s = harness_stats_ok(c);
  ck_assert_uint_eq(s.used, 16 * MIB);
  ck_assert_uint_eq(s.cached, 0); /* no page is idle */
}

static void holes_empty(gmb_client *c, void **blk) {
  for (int i = 1; i < 16; i += 2)
    ck_assert_int_eq(gmb_free_async(c, blk[i], NULL), 0);
}

START_TEST(quota_holes_not_charged) {
  struct harness_broker b;
  harness_broker_start(&b, "host:256MiB", "[tenant:h]\nquota = 16MiB\n");
  gmb_client *c = harness_connect_ok(&b, "h");
  void *blk[16], *p, *q;
  holes_fill(c, blk);
  /* 18 MiB of pages, less 2 MiB of holes (an eighth of 16): served. */
  ck_assert_int_eq(gmb_malloc_async(c, 2 * MIB, NULL, &p), 0);
  ck_assert_uint_eq(harness_stats_ok(c).used, 18 * MIB);
  /* The eighth is spent: the next page is refused, and says why. */
  ck_assert_int_eq(gmb_malloc_async(c, 2 * MIB, NULL, &q), GMB_E_QUOTA);
  ck_assert_ptr_nonnull(strstr(gmb_last_error(c), "free between blocks in "
                                                  "its caches' pages"));
  ck_assert_uint_eq(metric_of(&b, "gmb_tenant_cache_holes_bytes", "h"),
                    2 * MIB);
  ck_assert_int_eq(gmb_free_async(c, p, NULL), 0);
  holes_empty(c, blk);
  gmb_disconnect(c);
  harness_broker_stop(&b);

  harness_broker_start(&b, "host:256MiB",
                       "[broker]\ncache_holes = 0\n"
                       "[tenant:h]\nquota = 16MiB\n");
  c = harness_connect_ok(&b, "h");
  holes_fill(c, blk);
  ck_assert_int_eq(gmb_malloc_async(c, 2 * MIB, NULL, &p), GMB_E_QUOTA);
  holes_empty(c, blk);
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

/* A tenant's quota held by another process's cache: the broker holds the
 * cache's request for a page, asks that session to give back what is
 * missing, its library thread does (while it makes no call), and the
 * request is served. */
static int quota_sees_cached(void *arg) {
  return harness_stats_ok(arg).cached == 12 * MIB;
}

START_TEST(quota_held_by_other_cache_asked_back) {
  struct harness_broker b;
  /* The broker's bound: a loaded machine may take longer than the
   * default 100 ms to run the other session's library thread. */
  harness_broker_start(&b, "host:256MiB", "[broker]\ntrim_wait_ms = 5000\n"
                       "[tenant:q2]\nquota = 16MiB\n");
  gmb_client *a = harness_connect_ok(&b, "q2");
  gmb_client *o = harness_connect_ok(&b, "q2");
  void *p, *q;
  ck_assert_int_eq(gmb_malloc_async(a, 12 * MIB, NULL, &p), 0);
  ck_assert_int_eq(gmb_free_async(a, p, NULL), 0);
  ck_assert(harness_poll_until(quota_sees_cached, o, HARNESS_WAIT_MS));
  /* 12 + 8 > 16: held, a's cache asked, then served. */
  int rc = gmb_malloc_async(o, 8 * MIB, NULL, &q);
  ck_assert_msg(rc == 0, "%s", gmb_last_error(o));
  gmb_stats st = harness_stats_ok(o);
  ck_assert_uint_le(st.used, 16 * MIB);
  ck_assert_uint_le(st.peak, 16 * MIB);
  /* Page by page: what o lacked (12 + 8 - 16 = 4 MiB, two pages) went
   * back, and the rest of a's cache stayed. */
  struct gmb_cache_counters ka;
  gmb__client_cache_counters(a, &ka);
  ck_assert_uint_eq(ka.slab_frees, 2);
  ck_assert_uint_eq(ka.slab_bytes, 8 * MIB);
  /* A plain gmb_alloc is refused at once, the reason saying what was done
   * (nothing cached is left to ask for here). */
  gmb_id id;
  ck_assert_int_eq(gmb_alloc(a, 12 * MIB, 0, &id), GMB_E_QUOTA);
  ck_assert_int_eq(gmb_free_async(o, q, NULL), 0);
  gmb_disconnect(a);
  gmb_disconnect(o);
  harness_broker_stop(&b);
}
END_TEST

/* gmb_cache_report: a hit changes the cache's idle bytes without a
 * message (the library thread reports it within its tick, 20 ms); after
 * the call the broker knows the figure, without a wait.  An ask the
 * broker made of the session is answered by the thread meanwhile, and a
 * call after it finds nothing left to answer (nor waits on it). */
START_TEST(cache_report_tells_the_broker_at_once) {
  struct harness_broker b;
  harness_broker_start(&b, "host:16MiB", "[broker]\ntrim_wait_ms = 5000\n");
  gmb_client *a = harness_connect_ok(&b, "ra");
  gmb_client *w = harness_connect_ok(&b, "ra");
  void *p, *q;
  ck_assert_int_eq(gmb_malloc_async(a, 12 * MIB, NULL, &p), 0);
  ck_assert_int_eq(gmb_free_async(a, p, NULL), 0);
  ck_assert_int_eq(gmb_cache_report(a), 0);
  ck_assert_uint_eq(harness_stats_ok(w).cached, 12 * MIB);
  ck_assert_int_eq(gmb_malloc_async(a, 4 * MIB, NULL, &q), 0);
  ck_assert_int_eq(gmb_cache_report(a), 0);
  gmb_cache_stats cs;
  ck_assert_int_eq(gmb_cache_stats_get(a, &cs), 0);
  ck_assert_uint_eq(cs.misses, 1); /* the 4 MiB were a hit */
  ck_assert_uint_eq(cs.idle, 8 * MIB);
  ck_assert_uint_eq(harness_stats_ok(w).cached, 8 * MIB);
  /* Another tenant's 8 MiB on the full device: a's thread gives back the
   * 4 MiB missing (two pages), then the report has nothing to wait for. */
  gmb_client *o = harness_connect_ok(&b, "rb");
  gmb_id id;
  int rc = gmb_alloc(o, 8 * MIB, 0, &id);
  ck_assert_msg(rc == 0, "%s", gmb_last_error(o));
  ck_assert_int_eq(gmb_cache_report(a), 0);
  ck_assert_int_eq(gmb_cache_stats_get(a, &cs), 0);
  ck_assert_uint_eq(cs.slab_frees, 2);
  ck_assert_uint_eq(harness_stats_ok(w).cached, 4 * MIB);
  ck_assert_int_eq(gmb_cache_report(NULL), GMB_E_INVAL);
  ck_assert_int_eq(gmb_free(o, id), 0);
  ck_assert_int_eq(gmb_free_async(a, q, NULL), 0);
  gmb_disconnect(o);
  gmb_disconnect(a);
  gmb_disconnect(w);
  harness_broker_stop(&b);
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

/* --- what the operator sees of caches ------------------------------------ */

struct cache_kid {
  const char *endpoint, *tenant;
  uint64_t pinned; /* a gmb_alloc held (0: none) */
  uint64_t cached; /* a gmb_malloc_async block, freed: the cache keeps it */
  int ready;
};

/* A client process whose cache holds `cached` free bytes beside `pinned`
 * bytes in use; it waits to be killed. */
static int cache_kid_main(void *arg) {
  struct cache_kid *k = arg;
  gmb_client *c;
  int rc = gmb_connect(k->endpoint, k->tenant, &c);
  CHILD_CHECK(rc == 0, 2, "connect %s: %s", k->tenant, gmb_last_error(NULL));
  gmb_id id;
  if (k->pinned) {
    rc = gmb_alloc(c, k->pinned, 0, &id);
    CHILD_CHECK(rc == 0, 3, "alloc: %s", gmb_last_error(c));
  }
  if (k->cached) {
    void *p;
    rc = gmb_malloc_async(c, k->cached, NULL, &p);
    CHILD_CHECK(rc == 0, 4, "malloc_async: %s", gmb_last_error(c));
    CHILD_CHECK(gmb_free_async(c, p, NULL) == 0, 5, "free_async: %s",
                gmb_last_error(c));
  }
  harness_pipe_send(k->ready, 'r');
  for (;;) pause();
}

static char ctl_out[65536];

/* `gmbctl --json ARGS...` against b, parsed; fails the test unless it
 * exits 0 with JSON.  The caller frees the result. */
static json_t *ctl_json(const struct harness_broker *b, const char *verb,
                        const char *arg1, const char *arg2) {
  int rc = harness_ctl(b, ctl_out, sizeof ctl_out, "--json", verb, arg1, arg2,
                       NULL);
  ck_assert_msg(rc == 0, "gmbctl %s: %d: %s", verb, rc, ctl_out);
  json_error_t err;
  json_t *j = json_loads(ctl_out, 0, &err);
  ck_assert_msg(j != NULL, "gmbctl %s: not JSON (%s): %s", verb, err.text,
                ctl_out);
  return j;
}

static json_int_t jget(json_t *o, const char *key) {
  json_t *v = json_object_get(o, key);
  ck_assert_msg(json_is_integer(v), "\"%s\" is not an integer", key);
  return json_integer_value(v);
}

/* The row of `gmbctl tenants --json` named `name`, or NULL. */
static json_t *tenant_json(json_t *j, const char *name) {
  size_t i;
  json_t *t;
  json_array_foreach(json_object_get(j, "tenants"), i, t) {
    const char *n = json_string_value(json_object_get(t, "name"));
    if (n && strcmp(n, name) == 0) return t;
  }
  return NULL;
}

struct cached_want {
  const struct harness_broker *b;
  const char *tenant;
  json_int_t cached;
  size_t sessions; /* rows of gmbctl sessions --json */
};

/* Until the caches' reports (on their library threads' heartbeats) have
 * reached the broker, or a session's end has. */
static int tenant_cached_is(void *arg) {
  struct cached_want *w = arg;
  json_t *j = ctl_json(w->b, "tenants", NULL, NULL);
  json_t *t = tenant_json(j, w->tenant);
  int ok = t && jget(t, "cached") == w->cached;
  json_decref(j);
  if (!ok) return 0;
  j = ctl_json(w->b, "sessions", NULL, NULL);
  ok = json_array_size(json_object_get(j, "sessions")) == w->sessions;
  json_decref(j);
  return ok;
}

/* The sample `name{tenant="t"}` of `gmbctl metrics`; fails the test when
 * there is none. */
static unsigned long long metric_of(const struct harness_broker *b,
                                    const char *name, const char *tenant) {
  static char text[262144];
  int rc = harness_ctl(b, text, sizeof text, "metrics", NULL);
  ck_assert_msg(rc == 0, "gmbctl metrics: %d: %.2000s", rc, text);
  char want[160];
  snprintf(want, sizeof want, "\n%s{tenant=\"%s\"} ", name, tenant);
  const char *p = strstr(text, want);
  ck_assert_msg(p != NULL, "no %s{tenant=\"%s\"} in the metrics", name,
                tenant);
  return strtoull(p + strlen(want), NULL, 10);
}

START_TEST(cached_shown_per_tenant_and_session) {
  struct harness_broker b;
  harness_broker_start(&b, "host:256MiB", "[tenant:cache-a]\nquota = 64MiB\n");
  int fds[2];
  ck_assert_int_eq(pipe(fds), 0);
  /* cache-a: one process holds 4 MiB and caches 12 MiB, another caches
   * 8 MiB; cache-b: one process holds 2 MiB and caches nothing. */
  struct cache_kid kids[3] = {
      {b.endpoint, "cache-a", 4 * MIB, 12 * MIB, fds[1]},
      {b.endpoint, "cache-a", 0, 8 * MIB, fds[1]},
      {b.endpoint, "cache-b", 2 * MIB, 0, fds[1]},
  };
  pid_t pid[3];
  for (int i = 0; i < 3; i++) {
    pid[i] = harness_fork(cache_kid_main, &kids[i]);
    ck_assert_int_eq(harness_pipe_wait(fds[0], HARNESS_WAIT_MS), 'r');
  }
  struct cached_want w = {&b, "cache-a", (json_int_t)(20 * MIB), 3};
  ck_assert_msg(harness_poll_until(tenant_cached_is, &w, HARNESS_WAIT_MS),
                "cache-a never showed 20MiB cached in 3 sessions: %s",
                ctl_out);

  /* gmbctl tenants --json: cached is part of used. */
  json_t *j = ctl_json(&b, "tenants", NULL, NULL);
  json_t *ta = tenant_json(j, "cache-a"), *tb = tenant_json(j, "cache-b");
  ck_assert_ptr_nonnull(ta);
  ck_assert_ptr_nonnull(tb);
  ck_assert_int_eq(jget(ta, "used"), (json_int_t)(24 * MIB));
  ck_assert_int_eq(jget(ta, "cached"), (json_int_t)(20 * MIB));
  ck_assert_int_eq(jget(ta, "trim_asks"), 0); /* no quota was pressed */
  ck_assert_int_eq(jget(tb, "used"), (json_int_t)(2 * MIB));
  ck_assert_int_eq(jget(tb, "cached"), 0);
  json_decref(j);

  /* gmbctl sessions --json: one row per process, found by its pid. */
  j = ctl_json(&b, "sessions", NULL, NULL);
  json_t *rows = json_object_get(j, "sessions");
  ck_assert_uint_eq(json_array_size(rows), 3);
  for (int i = 0; i < 3; i++) {
    json_t *r = NULL, *x;
    size_t k;
    json_array_foreach(rows, k, x) if (jget(x, "pid") == pid[i]) r = x;
    ck_assert_msg(r != NULL, "no session of pid %d: %s", (int)pid[i], ctl_out);
    ck_assert_str_eq(json_string_value(json_object_get(r, "tenant")),
                     kids[i].tenant);
    ck_assert_int_eq(jget(r, "uid"), (json_int_t)getuid());
    ck_assert_int_eq(jget(r, "cached"), (json_int_t)kids[i].cached);
    ck_assert_int_eq(jget(r, "used"),
                     (json_int_t)(kids[i].pinned + kids[i].cached));
    /* The pinned block is one allocation, each page of the cache one. */
    ck_assert_int_eq(jget(r, "allocations"),
                     (kids[i].pinned != 0) + kids[i].cached / (2 * MIB));
    ck_assert_int_eq(jget(r, "trim_asks"), 0);
    ck_assert_int_eq(jget(r, "trim_ignored"), 0);
    const char *client = json_string_value(json_object_get(r, "client"));
    ck_assert_msg(client && strncmp(client, "libgmb", 6) == 0, "client %s",
                  client ? client : "(none)");
  }
  json_decref(j);
  /* --tenant keeps one tenant's; the status has the same rows. */
  j = ctl_json(&b, "sessions", "--tenant", "cache-b");
  rows = json_object_get(j, "sessions");
  ck_assert_uint_eq(json_array_size(rows), 1);
  ck_assert_int_eq(jget(json_array_get(rows, 0), "pid"), pid[2]);
  json_decref(j);
  j = ctl_json(&b, "status", NULL, NULL);
  ck_assert_int_eq(jget(j, "cached"), (json_int_t)(20 * MIB));
  ck_assert_uint_eq(json_array_size(json_object_get(j, "session_rows")), 3);
  json_decref(j);
  /* A snapshot's status is the same object (docs/snapshot.md). */
  j = ctl_json(&b, "snapshot", NULL, NULL);
  json_t *sst = json_object_get(j, "status");
  ck_assert_int_eq(jget(sst, "cached"), (json_int_t)(20 * MIB));
  ck_assert_uint_eq(json_array_size(json_object_get(sst, "session_rows")), 3);
  ck_assert_int_eq(jget(tenant_json(sst, "cache-a"), "cached"),
                   (json_int_t)(20 * MIB));
  json_decref(j);

  /* The text forms. */
  ck_assert_int_eq(harness_ctl(&b, ctl_out, sizeof ctl_out, "status", NULL),
                   0);
  ck_assert_msg(strstr(ctl_out, "\ncached       20MiB ") != NULL, "%s",
                ctl_out);
  ck_assert_msg(strstr(ctl_out, " CACHED ") != NULL, "%s", ctl_out);
  ck_assert_int_eq(harness_ctl(&b, ctl_out, sizeof ctl_out, "sessions",
                               "--tenant", "cache-a", NULL), 0);
  ck_assert_uint_eq(harness_count(ctl_out, "\n"), 3); /* head + 2 rows */
  ck_assert_msg(strstr(ctl_out, "12MiB") && strstr(ctl_out, "8MiB") &&
                    !strstr(ctl_out, "cache-b"),
                "%s", ctl_out);
  ck_assert_int_eq(harness_ctl(&b, ctl_out, sizeof ctl_out, "map", NULL), 0);
  const char *line = strstr(ctl_out, "\ncache-a ");
  ck_assert_msg(line != NULL, "no summary line of cache-a: %s", ctl_out);
  ck_assert_msg(strstr(line, "20MiB") != NULL &&
                    strstr(line, "20MiB") < strchr(line + 1, '\n'),
                "%s", ctl_out);

  /* The metrics, per tenant. */
  ck_assert_uint_eq(metric_of(&b, "gmb_tenant_cached_bytes", "cache-a"),
                    20 * MIB);
  ck_assert_uint_eq(metric_of(&b, "gmb_tenant_cached_bytes", "cache-b"), 0);
  ck_assert_uint_eq(metric_of(&b, "gmb_trim_asks_total", "cache-a"), 0);
  ck_assert_uint_eq(metric_of(&b, "gmb_trim_ignored_total", "cache-a"), 0);

  /* A process that dies takes its cached bytes and its row with it. */
  kill(pid[1], SIGKILL);
  ck_assert_int_eq(harness_wait(pid[1]), 128 + SIGKILL);
  w.cached = (json_int_t)(12 * MIB);
  w.sessions = 2;
  ck_assert_msg(harness_poll_until(tenant_cached_is, &w, HARNESS_WAIT_MS),
                "cache-a still shows its dead session's cache: %s", ctl_out);
  ck_assert_uint_eq(metric_of(&b, "gmb_tenant_cached_bytes", "cache-a"),
                    12 * MIB);
  for (int i = 0; i < 3; i += 2) {
    kill(pid[i], SIGKILL);
    ck_assert_int_eq(harness_wait(pid[i]), 128 + SIGKILL);
  }
  close(fds[0]);
  close(fds[1]);
  harness_broker_stop(&b);
}
END_TEST

/* --- a full device: other tenants' caches asked back ---------------------- */

/* A process of tenant `tenant` that caches `bytes` (one block, all free)
 * and then idles: it never calls the library again.  Its library thread
 * is all that can answer the broker. */
struct cacher_arg {
  const char *endpoint;
  const char *tenant;
  uint64_t bytes;
  int ready;
};

static int cacher_child(void *arg) {
  struct cacher_arg *a = arg;
  gmb_client *c;
  void *p;
  CHILD_CHECK(gmb_connect(a->endpoint, a->tenant, &c) == 0, 2, "%s",
              gmb_last_error(NULL));
  CHILD_CHECK(gmb_malloc_async(c, a->bytes, NULL, &p) == 0, 3, "%s",
              gmb_last_error(c));
  CHILD_CHECK(gmb_free_async(c, p, NULL) == 0, 4, "%s", gmb_last_error(c));
  harness_pipe_send(a->ready, 'r');
  for (;;) pause();
}

struct cacher {
  pid_t pid;
  int fds[2];
  gmb_client *watch; /* a session of its tenant: sees its figures */
};

static int watch_sees_cached(void *arg) {
  struct cacher *k = arg;
  return harness_stats_ok(k->watch).cached == 48 * MIB;
}

/* Starts a cacher of 48 MiB as tenant `tenant` and waits until the broker
 * knows its cache's figure. */
static void cacher_start(struct cacher *k, struct harness_broker *b,
                         const char *tenant) {
  ck_assert_int_eq(pipe(k->fds), 0);
  static struct cacher_arg a;
  a = (struct cacher_arg){b->endpoint, tenant, 48 * MIB, 0};
  a.ready = k->fds[1];
  k->pid = harness_fork(cacher_child, &a);
  ck_assert_int_eq(harness_pipe_wait(k->fds[0], HARNESS_WAIT_MS), 'r');
  k->watch = harness_connect_ok(b, tenant);
  ck_assert_msg(harness_poll_until(watch_sees_cached, k, HARNESS_WAIT_MS),
                "the broker sees %llu cached bytes of tenant %s",
                (unsigned long long)harness_stats_ok(k->watch).cached, tenant);
}

static void cacher_end(struct cacher *k) {
  if (k->pid > 0) {
    kill(k->pid, SIGKILL);
    harness_wait(k->pid);
  }
  gmb_disconnect(k->watch);
  close(k->fds[0]);
  close(k->fds[1]);
}

/* The cacher gave back what it was asked for (16 of its 48 MiB). */
static int watch_sees_room_made(void *arg) {
  return harness_stats_ok(((struct cacher *)arg)->watch).used <= 32 * MIB;
}

/* Two tenants on a 64 MiB device: A caches 48 MiB and idles; B's plain
 * gmb_alloc of 32 MiB finds the device full, and is served once A's
 * library thread gave the memory back (the broker held the request
 * meanwhile rather than refuse it). */
START_TEST(full_device_idle_cache_of_other_tenant_given_back) {
  struct harness_broker b;
  /* A bound no loaded machine reaches: the test proves the memory comes
   * back, not how fast (the answer ends the hold anyway). */
  harness_broker_start(&b, "host:64MiB", "[broker]\ntrim_wait_ms = 5000\n");
  struct cacher a;
  cacher_start(&a, &b, "ea");
  gmb_client *c = harness_connect_ok(&b, "eb");
  gmb_id id;
  int rc = gmb_alloc(c, 32 * MIB, 0, &id);
  ck_assert_msg(rc == 0, "%s", gmb_last_error(c));
  /* What B lacked (32 - (64 - 48) = 16 MiB) went back from A's cache,
   * page by page; the rest stays cached.  B holds its 32 MiB. */
  ck_assert_uint_eq(harness_stats_ok(a.watch).used, 32 * MIB);
  ck_assert_uint_eq(harness_stats_ok(a.watch).cached, 32 * MIB);
  ck_assert_uint_eq(harness_stats_ok(c).used, 32 * MIB);
  char *log = harness_broker_log(&b);
  ck_assert_ptr_nonnull(strstr(log, "asked to give back"));
  ck_assert_ptr_null(strstr(log, "did not give back"));
  free(log);
  ck_assert_int_eq(gmb_free(c, id), 0);
  gmb_disconnect(c);
  cacher_end(&a);
  harness_broker_stop(&b);
}
END_TEST

struct asker_arg {
  const char *endpoint;
};

/* B, in a process of its own: 0 when its 32 MiB were served. */
static int asker_child(void *arg) {
  struct asker_arg *a = arg;
  gmb_client *c;
  gmb_id id;
  CHILD_CHECK(gmb_connect(a->endpoint, "eb", &c) == 0, 2, "%s",
              gmb_last_error(NULL));
  CHILD_CHECK(gmb_alloc(c, 32 * MIB, 0, &id) == 0, 3, "%s",
              gmb_last_error(c));
  gmb_disconnect(c);
  return 0;
}

static int log_says_asked(void *arg) {
  char *log = harness_broker_log(arg);
  int yes = strstr(log, "asked to give back") != NULL;
  free(log);
  return yes;
}

/* The asked process cannot answer (stopped) and is then killed -9 with
 * its cache full while B's request is held: its memory is reclaimed as
 * any dead process's, and that serves B before the bound. */
START_TEST(full_device_asked_process_killed) {
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", "[broker]\ntrim_wait_ms = 5000\n");
  struct cacher a;
  cacher_start(&a, &b, "ea");
  ck_assert_int_eq(kill(a.pid, SIGSTOP), 0);
  struct asker_arg q = {b.endpoint};
  pid_t asker = harness_fork(asker_child, &q);
  ck_assert(harness_poll_until(log_says_asked, &b, HARNESS_WAIT_MS));
  ck_assert_int_eq(kill(a.pid, SIGKILL), 0);
  ck_assert_int_eq(harness_wait(a.pid), 128 + SIGKILL);
  a.pid = 0;
  ck_assert_int_eq(harness_wait(asker), 0);
  ck_assert_uint_eq(harness_stats_ok(a.watch).used, 0);
  char *log = harness_broker_log(&b);
  ck_assert_ptr_null(strstr(log, "did not give back"));
  free(log);
  cacher_end(&a);
  harness_broker_stop(&b);
}
END_TEST

/* A process that ignores the ask (stopped with SIGSTOP): B's request
 * falls through after the bound to the refusal it would have had, and
 * the broker names the session in its log and runs on.  Let go, the
 * process answers late, and B is served. */
START_TEST(full_device_ignored_ask_falls_through) {
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", NULL); /* the default bound */
  struct cacher a;
  cacher_start(&a, &b, "ea");
  ck_assert_int_eq(kill(a.pid, SIGSTOP), 0);
  gmb_client *c = harness_connect_ok(&b, "eb");
  gmb_id id;
  ck_assert_int_eq(gmb_alloc(c, 32 * MIB, 0, &id), GMB_E_NOMEM);
  ck_assert_ptr_nonnull(strstr(gmb_last_error(c), "no room for 32MiB"));
  ck_assert(harness_broker_alive(&b));
  char *log = harness_broker_log(&b);
  char who[64];
  snprintf(who, sizeof who, "pid %d) did not give back", (int)a.pid);
  ck_assert_msg(strstr(log, who) != NULL, "the log does not say '%s'", who);
  ck_assert_uint_eq(harness_count(log, "asked to give back"), 1);
  free(log);
  /* Still stopped: refused again, cleanly (whether the pause check_reclaim
   * tests is over by now depends on the machine's load). */
  ck_assert_int_eq(gmb_alloc(c, 32 * MIB, 0, &id), GMB_E_NOMEM);
  ck_assert(harness_broker_alive(&b));
  /* Let go, its library thread reads the ask and gives the pages back. */
  ck_assert_int_eq(kill(a.pid, SIGCONT), 0);
  ck_assert(harness_poll_until(watch_sees_room_made, &a, HARNESS_WAIT_MS));
  int rc = gmb_alloc(c, 32 * MIB, 0, &id);
  ck_assert_msg(rc == 0, "%s", gmb_last_error(c));
  ck_assert_int_eq(gmb_free(c, id), 0);
  gmb_disconnect(c);
  cacher_end(&a);
  harness_broker_stop(&b);
}
END_TEST

/* --- page by page, live neighbours kept ------------------------------------ */

/* A process that caches scattered free memory between live blocks: twelve
 * blocks of 3 MiB back to back (18 pages), every other one freed, so that
 * each freed block leaves one page with no block on it (6 idle pages, 12
 * MiB) between pages that hold live ones.  It signals 'r', idles (only its
 * library thread answers the broker), and on a byte from `go` checks that
 * every live block still holds its pattern: exit 0 when all do. */
struct scatter_arg {
  const char *endpoint;
  const char *tenant;
  int ready, go;
};

static int scatter_child(void *arg) {
  struct scatter_arg *a = arg;
  gmb_client *c;
  void *p[12];
  CHILD_CHECK(gmb_connect(a->endpoint, a->tenant, &c) == 0, 2, "%s",
              gmb_last_error(NULL));
  for (int i = 0; i < 12; i++) {
    CHILD_CHECK(gmb_malloc_async(c, 3 * MIB, NULL, &p[i]) == 0, 3, "%s",
                gmb_last_error(c));
    harness_pattern_fill(p[i], 3 * MIB, (uint64_t)i + 1);
  }
  for (int i = 1; i < 12; i += 2)
    CHILD_CHECK(gmb_free_async(c, p[i], NULL) == 0, 4, "%s", gmb_last_error(c));
  harness_pipe_send(a->ready, 'r');
  CHILD_CHECK(harness_pipe_wait(a->go, 60000) == 'g', 5, "no go");
  for (int i = 0; i < 12; i += 2)
    CHILD_CHECK(harness_pattern_check(p[i], 3 * MIB, (uint64_t)i + 1) < 0, 6,
                "live block %d changed", i);
  gmb_disconnect(c);
  return 0;
}

struct scatter {
  pid_t pid;
  int ready[2], go[2];
  gmb_client *watch;
};

static int scatter_sees_cached(void *arg) {
  return harness_stats_ok(((struct scatter *)arg)->watch).cached == 12 * MIB;
}

static void scatter_start(struct scatter *k, struct harness_broker *b,
                          const char *tenant) {
  ck_assert_int_eq(pipe(k->ready), 0);
  ck_assert_int_eq(pipe(k->go), 0);
  static struct scatter_arg a;
  a = (struct scatter_arg){b->endpoint, tenant, k->ready[1], k->go[0]};
  k->pid = harness_fork(scatter_child, &a);
  ck_assert_int_eq(harness_pipe_wait(k->ready[0], HARNESS_WAIT_MS), 'r');
  k->watch = harness_connect_ok(b, tenant);
  ck_assert_msg(harness_poll_until(scatter_sees_cached, k, HARNESS_WAIT_MS),
                "the broker sees %llu cached bytes",
                (unsigned long long)harness_stats_ok(k->watch).cached);
}

/* Lets the child check its live blocks; 0 when they were intact. */
static int scatter_end(struct scatter *k) {
  harness_pipe_send(k->go[1], 'g');
  int st = harness_wait(k->pid);
  gmb_disconnect(k->watch);
  for (int i = 0; i < 2; i++) {
    close(k->ready[i]);
    close(k->go[i]);
  }
  return st;
}

/* Another tenant's request on a full device: the pages between the
 * cacher's live blocks go back, as many as were missing, and its live
 * blocks are untouched. */
START_TEST(page_wise_trim_across_tenants) {
  struct harness_broker b;
  harness_broker_start(&b, "host:48MiB", "[broker]\ntrim_wait_ms = 5000\n");
  struct scatter a;
  scatter_start(&a, &b, "sa");
  ck_assert_uint_eq(harness_stats_ok(a.watch).used, 36 * MIB);
  gmb_client *c = harness_connect_ok(&b, "sb");
  gmb_id id;
  /* 12 MiB of the device are free: 20 MiB lack 8, four of a's pages. */
  int rc = gmb_alloc(c, 20 * MIB, 0, &id);
  ck_assert_msg(rc == 0, "%s", gmb_last_error(c));
  ck_assert_uint_eq(harness_stats_ok(a.watch).used, 28 * MIB);
  ck_assert_uint_eq(harness_stats_ok(a.watch).cached, 4 * MIB);
  ck_assert_int_eq(scatter_end(&a), 0);
  ck_assert_int_eq(gmb_free(c, id), 0);
  gmb_disconnect(c);
  harness_broker_stop(&b);
}
END_TEST

/* Two processes of one tenant: the second's request past the quota is
 * served from the first's pages between its live blocks.  Pages are
 * charged whole here (cache_holes = 0), so that the first's 6 MiB of holes
 * do not cover part of the request (quota_holes_not_charged has that). */
START_TEST(page_wise_trim_within_a_tenant) {
  struct harness_broker b;
  harness_broker_start(&b, "host:256MiB", "[broker]\ntrim_wait_ms = 5000\n"
                       "cache_holes = 0\n"
                       "[tenant:sq]\nquota = 40MiB\n");
  struct scatter a;
  scatter_start(&a, &b, "sq");
  gmb_client *c = harness_connect_ok(&b, "sq");
  void *p;
  /* 36 + 10 > 40: 6 MiB, three idle pages, come back from a. */
  int rc = gmb_malloc_async(c, 10 * MIB, NULL, &p);
  ck_assert_msg(rc == 0, "%s", gmb_last_error(c));
  gmb_stats st = harness_stats_ok(c);
  ck_assert_uint_eq(st.used, 40 * MIB);
  ck_assert_uint_le(st.peak, 40 * MIB);
  ck_assert_uint_eq(st.cached, 3 * 2 * MIB); /* a's other three pages */
  ck_assert_int_eq(scatter_end(&a), 0);
  ck_assert_int_eq(gmb_free_async(c, p, NULL), 0);
  gmb_disconnect(c);
  harness_broker_stop(&b);
}
END_TEST

int main(void) {
  return harness_main(HARNESS_SUITE(
      "cache", "cache", 60,
      hits_send_nothing_and_count_as_used, cache_stats_and_record_stream,
      bad_pointers_change_nothing,
      quota_with_cache, quota_holes_not_charged,
      cached_reported_to_the_broker,
      quota_held_by_other_cache_asked_back,
      cache_report_tells_the_broker_at_once,
      page_wise_trim_across_tenants, page_wise_trim_within_a_tenant,
      killed_client_with_cache_reclaimed,
      cached_shown_per_tenant_and_session,
      full_device_idle_cache_of_other_tenant_given_back,
      full_device_asked_process_killed,
      full_device_ignored_ask_falls_through));
}
