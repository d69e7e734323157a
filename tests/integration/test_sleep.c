/*
 * test_sleep.c - sleep and wake by tag (gmb_cache_tag, gmb_pause,
 * gmb_resume) against a real broker on the host device: a paused tag's
 * pages go back to the broker, another tenant is served from them, a
 * resume without room fails with nothing lost and succeeds once the room
 * is back, and every byte comes back at its old address; the host quota
 * (GMB_HOST_QUOTA) and a process that exits while paused; gmb_alloc
 * allocations under a tag: paused and resumed through the same ids, a
 * locked one refusing the pause, discard, and a free while paused.
 */
#include <check.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gmb.h"
#include "harness.h"

#define MIB (UINT64_C(1) << 20)

static gmb_cache_stats cstats(gmb_client *c) {
  gmb_cache_stats s;
  ck_assert_int_eq(gmb_cache_stats_get(c, &s), 0);
  return s;
}

/* Tenant B: on 'g', takes `bytes` in pinned allocations and says 'h' (or
 * 'n' when the broker refused); on 'f' frees them and says 'd'. */
struct taker {
  const char *endpoint;
  uint64_t bytes;
  int in, out;
};

static int taker_main(void *arg) {
  struct taker *t = arg;
  gmb_client *c;
  if (gmb_connect(t->endpoint, "b", &c)) return 2;
  gmb_id ids[16];
  unsigned n = 0;
  if (harness_pipe_wait(t->in, HARNESS_WAIT_MS) != 'g') return 3;
  int rc = 0;
  for (uint64_t got = 0; got < t->bytes && rc == 0; got += 8 * MIB) {
    rc = gmb_alloc(c, 8 * MIB, 0, &ids[n]);
    if (rc == 0) n++;
  }
  if (rc) fprintf(stderr, "taker: %s\n", gmb_last_error(c));
  harness_pipe_send(t->out, rc ? 'n' : 'h');
  if (harness_pipe_wait(t->in, HARNESS_WAIT_MS) != 'f') return 4;
  for (unsigned i = 0; i < n; i++)
    if (gmb_free(c, ids[i])) return 5;
  harness_pipe_send(t->out, 'd');
  gmb_disconnect(c);
  return rc ? 6 : 0;
}

START_TEST(paused_pages_serve_another_tenant) {
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", NULL);
  gmb_client *a = harness_connect_ok(&b, "a");
  /* Weights: 40 MiB in blocks of several sizes, and an untagged block. */
  static const size_t sz[] = {512, 3 * MIB + 100, 16 * MIB, 70000,
                              20 * MIB - 200000};
  enum { N = sizeof sz / sizeof sz[0] };
  void *w[N], *u;
  ck_assert_int_eq(gmb_malloc_async(a, 4096, NULL, &u), 0);
  harness_pattern_fill(u, 4096, 99);
  ck_assert_int_eq(gmb_cache_tag(a, "weights"), 0);
  for (int i = 0; i < N; i++) {
    ck_assert_int_eq(gmb_malloc_async(a, sz[i], NULL, &w[i]), 0);
    harness_pattern_fill(w[i], sz[i], (uint64_t)i + 1);
  }
  ck_assert_int_eq(gmb_cache_tag(a, NULL), 0);
  gmb_stats s0 = harness_stats_ok(a);
  ck_assert_uint_ge(s0.used, 40 * MIB);

  ck_assert_msg(gmb_pause(a, "weights", GMB_PAUSE_OFFLOAD) == 0, "%s",
                gmb_last_error(a));
  /* Only the untagged page is still the tenant's on the device. */
  gmb_stats s1 = harness_stats_ok(a);
  ck_assert_uint_eq(s1.used, 2 * MIB);
  gmb_cache_stats c1 = cstats(a);
  ck_assert_uint_eq(c1.held, 2 * MIB);
  ck_assert_uint_eq(c1.host, s0.used - 2 * MIB);
  ck_assert_uint_eq(c1.paused, s0.used - 2 * MIB);
  ck_assert_uint_le(c1.cached, c1.held); /* paused blocks are not cached */

  /* B takes 48 MiB: it fits only in the pages A gave back. */
  int to_b[2], from_b[2];
  ck_assert_int_eq(pipe(to_b), 0);
  ck_assert_int_eq(pipe(from_b), 0);
  struct taker t = {b.endpoint, 48 * MIB, to_b[0], from_b[1]};
  pid_t kid = harness_fork(taker_main, &t);
  harness_pipe_send(to_b[1], 'g');
  ck_assert_int_eq(harness_pipe_wait(from_b[0], HARNESS_WAIT_MS), 'h');

  /* No room for A's 40 MiB now: refused, nothing lost, still paused. */
  int rc = gmb_resume(a, "weights");
  ck_assert_msg(rc == GMB_E_NOMEM, "resume: %s (%s)", gmb_err_name(rc),
                gmb_last_error(a));
  ck_assert_uint_eq(cstats(a).host, c1.host);
  ck_assert_uint_eq(harness_stats_ok(a).used, 2 * MIB);
  void *x;
  ck_assert_int_eq(gmb_cache_tag(a, "weights"), 0);
  ck_assert_int_eq(gmb_malloc_async(a, 512, NULL, &x), GMB_E_INVAL);
  ck_assert_ptr_nonnull(strstr(gmb_last_error(a), "paused"));
  ck_assert_int_eq(gmb_cache_tag(a, NULL), 0);

  /* B frees; A resumes at the same addresses with every byte. */
  harness_pipe_send(to_b[1], 'f');
  ck_assert_int_eq(harness_pipe_wait(from_b[0], HARNESS_WAIT_MS), 'd');
  ck_assert_int_eq(harness_wait(kid), 0);
  rc = gmb_resume(a, "weights");
  ck_assert_msg(rc == 0, "resume: %s", gmb_last_error(a));
  for (int i = 0; i < N; i++) {
    long bad = harness_pattern_check(w[i], sz[i], (uint64_t)i + 1);
    ck_assert_msg(bad < 0, "block %d differs at byte %ld", i, bad);
  }
  ck_assert_int_lt(harness_pattern_check(u, 4096, 99), 0);
  ck_assert_uint_eq(harness_stats_ok(a).used, s0.used);
  gmb_cache_stats c2 = cstats(a);
  ck_assert_uint_eq(c2.host, 0);
  ck_assert_uint_eq(c2.paused, 0);
  for (int i = 0; i < N; i++)
    ck_assert_int_eq(gmb_free_async(a, w[i], NULL), 0);
  ck_assert_int_eq(gmb_free_async(a, u, NULL), 0);
  ck_assert_int_eq(gmb_trim(a, 0), 0);
  ck_assert_uint_eq(harness_stats_ok(a).used, 0);
  gmb_disconnect(a);
  close(to_b[0]);
  close(to_b[1]);
  close(from_b[0]);
  close(from_b[1]);
  harness_broker_stop(&b);
}
END_TEST

START_TEST(host_quota_bounds_offload) {
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", NULL);
  gmb_client *c;
  setenv("GMB_HOST_QUOTA", "lots", 1);
  ck_assert_int_eq(gmb_connect(b.endpoint, "q", &c), GMB_E_INVAL);
  ck_assert_ptr_nonnull(strstr(gmb_last_error(NULL), "GMB_HOST_QUOTA"));
  setenv("GMB_HOST_QUOTA", "4MiB", 1);
  c = harness_connect_ok(&b, "q");
  unsetenv("GMB_HOST_QUOTA");
  ck_assert_int_eq(gmb_cache_tag(c, "kv"), 0);
  void *p;
  ck_assert_int_eq(gmb_malloc_async(c, 10 * MIB, NULL, &p), 0);
  harness_pattern_fill(p, 10 * MIB, 5);
  ck_assert_int_eq(gmb_pause(c, "kv", GMB_PAUSE_OFFLOAD), GMB_E_LIMIT);
  ck_assert_ptr_nonnull(strstr(gmb_last_error(c), "GMB_HOST_QUOTA"));
  /* Refused: the tag runs on, its bytes where they were. */
  ck_assert_int_lt(harness_pattern_check(p, 10 * MIB, 5), 0);
  ck_assert_uint_eq(cstats(c).host, 0);
  /* A discard keeps nothing on the host: allowed. */
  ck_assert_int_eq(gmb_pause(c, "kv", GMB_PAUSE_DISCARD), 0);
  ck_assert_uint_eq(harness_stats_ok(c).used, 0);
  ck_assert_int_eq(gmb_resume(c, "kv"), 0);
  harness_pattern_fill(p, 10 * MIB, 6); /* the address is usable again */
  ck_assert_int_lt(harness_pattern_check(p, 10 * MIB, 6), 0);
  ck_assert_int_eq(gmb_pause(c, "nosuch", GMB_PAUSE_OFFLOAD), GMB_E_NOENT);
  ck_assert_int_eq(gmb_pause(c, "kv", 9), GMB_E_INVAL);
  ck_assert_int_eq(gmb_free_async(c, p, NULL), 0);
  gmb_disconnect(c);
  harness_broker_stop(&b);
}
END_TEST

/* A process that exits while paused: its host copy goes with it, and the
 * broker holds nothing of it. */
struct sleeper {
  const char *endpoint;
  int ready, go;
};

static int sleeper_main(void *arg) {
  struct sleeper *s = arg;
  gmb_client *c;
  if (gmb_connect(s->endpoint, "z", &c)) return 2;
  if (gmb_cache_tag(c, "w")) return 3;
  void *p;
  if (gmb_malloc_async(c, 12 * MIB, NULL, &p)) return 4;
  memset(p, 7, 12 * MIB);
  if (gmb_pause(c, "w", GMB_PAUSE_OFFLOAD)) return 5;
  harness_pipe_send(s->ready, 'p');
  if (harness_pipe_wait(s->go, HARNESS_WAIT_MS) != 'x') return 6;
  return 0; /* exits paused, without a disconnect */
}

START_TEST(exit_while_paused) {
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", NULL);
  int r[2], g[2];
  ck_assert_int_eq(pipe(r), 0);
  ck_assert_int_eq(pipe(g), 0);
  struct sleeper s = {b.endpoint, r[1], g[0]};
  pid_t kid = harness_fork(sleeper_main, &s);
  ck_assert_int_eq(harness_pipe_wait(r[0], HARNESS_WAIT_MS), 'p');
  gmb_client *c = harness_connect_ok(&b, "z");
  ck_assert_uint_eq(harness_stats_ok(c).used, 0);
  harness_pipe_send(g[1], 'x');
  ck_assert_int_eq(harness_wait(kid), 0);
  ck_assert_uint_eq(harness_stats_ok(c).used, 0);
  gmb_disconnect(c);
  close(r[0]);
  close(r[1]);
  close(g[0]);
  close(g[1]);
  harness_broker_stop(&b);
}
END_TEST

/* --- gmb_alloc allocations under a tag ------------------------------------ */

/* Writes a pattern of `seed` over allocation id of n bytes (gmb_write). */
static void alloc_fill(gmb_client *c, gmb_id id, size_t n, uint64_t seed) {
  char *buf = malloc(n);
  ck_assert_ptr_nonnull(buf);
  harness_pattern_fill(buf, n, seed);
  ck_assert_msg(gmb_write(c, id, 0, buf, n) == 0, "%s", gmb_last_error(c));
  free(buf);
}

/* The first byte where allocation id differs from the pattern, or -1. */
static long alloc_check(gmb_client *c, gmb_id id, size_t n, uint64_t seed) {
  char *buf = malloc(n);
  ck_assert_ptr_nonnull(buf);
  ck_assert_msg(gmb_read(c, id, 0, buf, n) == 0, "%s", gmb_last_error(c));
  long bad = harness_pattern_check(buf, n, seed);
  free(buf);
  return bad;
}

static struct wire_tenant_row tenant_row(struct harness_broker *b,
                                         const char *t) {
  struct wire_tenant_row r;
  ck_assert_int_eq(harness_tenant_row(b, t, &r), 0);
  return r;
}

START_TEST(tagged_allocs_serve_another_tenant) {
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", "[tenant:a]\nhost_quota = 48MiB\n");
  gmb_client *a = harness_connect_ok(&b, "a");
  /* Weights: a large pinned allocation, a large movable one (the broker
   * pins it), a small movable one, and a block of the cache, all under
   * "weights"; an allocation of no tag beside them. */
  static const size_t sz[] = {16 * MIB, 8 * MIB, 100000};
  static const unsigned fl[] = {0, GMB_MOVABLE, GMB_MOVABLE};
  enum { N = sizeof sz / sizeof sz[0] };
  gmb_id w[N], u;
  ck_assert_int_eq(gmb_alloc(a, 512 * 1024, 0, &u), 0);
  alloc_fill(a, u, 512 * 1024, 77);
  ck_assert_int_eq(gmb_cache_tag(a, "weights"), 0);
  for (int i = 0; i < N; i++) {
    ck_assert_int_eq(gmb_alloc(a, sz[i], fl[i], &w[i]), 0);
    alloc_fill(a, w[i], sz[i], (uint64_t)i + 1);
  }
  void *blk;
  ck_assert_int_eq(gmb_malloc_async(a, MIB, NULL, &blk), 0);
  harness_pattern_fill(blk, MIB, 50);
  ck_assert_int_eq(gmb_cache_tag(a, NULL), 0);
  uint64_t used0 = harness_stats_ok(a).used;
  ck_assert_uint_ge(used0, 24 * MIB + 2 * MIB);

  ck_assert_msg(gmb_pause(a, "weights", GMB_PAUSE_OFFLOAD) == 0, "%s",
                gmb_last_error(a));
  uint64_t tagged = 0;
  for (int i = 0; i < N; i++) tagged += (sz[i] + 511) / 512 * 512;
  /* Their device bytes went back; their host copies are counted by this
   * process and by the broker's one record of the tag. */
  ck_assert_uint_le(harness_stats_ok(a).used, used0 - tagged - 2 * MIB);
  gmb_cache_stats cs = cstats(a);
  ck_assert_uint_eq(cs.host, tagged + 2 * MIB);
  ck_assert_uint_eq(cs.paused, tagged + 2 * MIB);
  struct wire_tenant_row r = tenant_row(&b, "a");
  ck_assert_uint_eq(r.paused_tags, 1);
  ck_assert_uint_eq(r.host_bytes, tagged + 2 * MIB);
  ck_assert_uint_eq(r.paused_bytes, tagged + 2 * MIB);

  /* Paused ids: no lock, no copy, no allocation in the tag. */
  void *p;
  ck_assert_int_eq(gmb_lock(a, w[0], &p), GMB_E_INVAL);
  ck_assert_ptr_nonnull(strstr(gmb_last_error(a), "paused"));
  char byte;
  ck_assert_int_eq(gmb_read(a, w[2], 0, &byte, 1), GMB_E_INVAL);
  gmb_id x;
  ck_assert_int_eq(gmb_cache_tag(a, "weights"), 0);
  ck_assert_int_eq(gmb_alloc(a, 512, 0, &x), GMB_E_INVAL);
  ck_assert_int_eq(gmb_cache_tag(a, NULL), 0);
  ck_assert_int_lt(alloc_check(a, u, 512 * 1024, 77), 0); /* untouched */

  /* B takes 48 MiB: only what A gave back makes room for it. */
  int to_b[2], from_b[2];
  ck_assert_int_eq(pipe(to_b), 0);
  ck_assert_int_eq(pipe(from_b), 0);
  struct taker t = {b.endpoint, 48 * MIB, to_b[0], from_b[1]};
  pid_t kid = harness_fork(taker_main, &t);
  harness_pipe_send(to_b[1], 'g');
  ck_assert_int_eq(harness_pipe_wait(from_b[0], HARNESS_WAIT_MS), 'h');
  int rc = gmb_resume(a, "weights");
  ck_assert_msg(rc == GMB_E_NOMEM, "resume: %s (%s)", gmb_err_name(rc),
                gmb_last_error(a));
  ck_assert_uint_eq(cstats(a).host, tagged + 2 * MIB); /* nothing lost */

  harness_pipe_send(to_b[1], 'f');
  ck_assert_int_eq(harness_pipe_wait(from_b[0], HARNESS_WAIT_MS), 'd');
  ck_assert_int_eq(harness_wait(kid), 0);
  rc = gmb_resume(a, "weights");
  ck_assert_msg(rc == 0, "resume: %s", gmb_last_error(a));
  /* The same ids reach the same bytes (at new addresses). */
  for (int i = 0; i < N; i++) {
    long bad = alloc_check(a, w[i], sz[i], (uint64_t)i + 1);
    ck_assert_msg(bad < 0, "allocation %d differs at byte %ld", i, bad);
  }
  ck_assert_int_lt(harness_pattern_check(blk, MIB, 50), 0);
  ck_assert_int_eq(gmb_lock(a, w[2], &p), 0);
  ck_assert_int_eq(gmb_unlock(a, w[2]), 0);
  ck_assert_uint_eq(cstats(a).host, 0);
  ck_assert_uint_eq(cstats(a).paused, 0);
  r = tenant_row(&b, "a");
  ck_assert_uint_eq(r.paused_tags, 0);
  ck_assert_uint_eq(r.host_bytes, 0);
  ck_assert_uint_eq(harness_stats_ok(a).used, used0);
  for (int i = 0; i < N; i++) ck_assert_int_eq(gmb_free(a, w[i]), 0);
  ck_assert_int_eq(gmb_free(a, w[0]), GMB_E_NOENT);
  ck_assert_int_eq(gmb_free(a, u), 0);
  ck_assert_int_eq(gmb_free_async(a, blk, NULL), 0);
  ck_assert_int_eq(gmb_trim(a, 0), 0);
  ck_assert_uint_eq(harness_stats_ok(a).used, 0);
  gmb_disconnect(a);
  close(to_b[0]);
  close(to_b[1]);
  close(from_b[0]);
  close(from_b[1]);
  harness_broker_stop(&b);
}
END_TEST

START_TEST(tagged_alloc_locked_refuses_pause) {
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", NULL);
  gmb_client *c = harness_connect_ok(&b, "l");
  ck_assert_int_eq(gmb_cache_tag(c, "w"), 0);
  gmb_id pinned, movable;
  ck_assert_int_eq(gmb_alloc(c, 4 * MIB, 0, &pinned), 0);
  ck_assert_int_eq(gmb_alloc(c, 4096, GMB_MOVABLE, &movable), 0);
  void *blk;
  ck_assert_int_eq(gmb_malloc_async(c, 4096, NULL, &blk), 0);
  ck_assert_int_eq(gmb_cache_tag(c, NULL), 0);
  uint64_t used = harness_stats_ok(c).used;
  gmb_id ids[] = {pinned, movable};
  for (int i = 0; i < 2; i++) {
    void *p;
    ck_assert_int_eq(gmb_lock(c, ids[i], &p), 0);
    memset(p, 3 + i, 4096);
    ck_assert_int_eq(gmb_pause(c, "w", GMB_PAUSE_OFFLOAD), GMB_E_INVAL);
    ck_assert_ptr_nonnull(strstr(gmb_last_error(c), "locked"));
    /* Nothing moved: the cache's part runs again too. */
    ck_assert_uint_eq(harness_stats_ok(c).used, used);
    ck_assert_uint_eq(cstats(c).host, 0);
    ck_assert_uint_eq(cstats(c).paused, 0);
    memset(blk, 1, 4096); /* mapped */
    ck_assert_int_eq(gmb_unlock(c, ids[i]), 0);
  }
  /* GMB_UNTAGGED: no tag though one is current; locked for good, as the
   * preload shim's cudaMalloc, it does not keep the tag from pausing. */
  gmb_id keep;
  void *kp;
  ck_assert_int_eq(gmb_cache_tag(c, "w"), 0);
  ck_assert_int_eq(gmb_alloc(c, 4096, GMB_UNTAGGED, &keep), 0);
  ck_assert_int_eq(gmb_cache_tag(c, NULL), 0);
  ck_assert_int_eq(gmb_lock(c, keep, &kp), 0);
  memset(kp, 8, 4096);
  ck_assert_msg(gmb_pause(c, "w", GMB_PAUSE_OFFLOAD) == 0, "%s",
                gmb_last_error(c));
  ck_assert_int_eq(((char *)kp)[4095], 8); /* still mapped, still there */
  ck_assert_int_eq(gmb_resume(c, "w"), 0);
  char buf[4096];
  ck_assert_int_eq(gmb_read(c, pinned, 0, buf, sizeof buf), 0);
  ck_assert_int_eq(buf[4095], 3);
  ck_assert_int_eq(gmb_read(c, movable, 0, buf, sizeof buf), 0);
  ck_assert_int_eq(buf[4095], 4);
  gmb_disconnect(c);
  harness_broker_stop(&b);
}
END_TEST

START_TEST(tagged_alloc_discard_and_free_paused) {
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", NULL);
  setenv("GMB_HOST_QUOTA", "4MiB", 1);
  gmb_client *c = harness_connect_ok(&b, "d");
  unsetenv("GMB_HOST_QUOTA");
  ck_assert_int_eq(gmb_cache_tag(c, "kv"), 0);
  gmb_id kv, gone;
  ck_assert_int_eq(gmb_alloc(c, 8 * MIB, 0, &kv), 0);
  ck_assert_int_eq(gmb_alloc(c, MIB, 0, &gone), 0);
  ck_assert_int_eq(gmb_cache_tag(c, NULL), 0);
  alloc_fill(c, kv, 8 * MIB, 9);
  /* 9 MiB of copies would pass GMB_HOST_QUOTA: refused, nothing moved. */
  ck_assert_int_eq(gmb_pause(c, "kv", GMB_PAUSE_OFFLOAD), GMB_E_LIMIT);
  ck_assert_ptr_nonnull(strstr(gmb_last_error(c), "GMB_HOST_QUOTA"));
  ck_assert_int_lt(alloc_check(c, kv, 8 * MIB, 9), 0);
  /* A discard keeps no copy and passes. */
  ck_assert_int_eq(gmb_pause(c, "kv", GMB_PAUSE_DISCARD), 0);
  ck_assert_uint_eq(harness_stats_ok(c).used, 0);
  ck_assert_uint_eq(cstats(c).host, 0);
  ck_assert_uint_eq(cstats(c).paused, 9 * MIB);
  /* Freeing a paused allocation drops it: nothing comes back for it. */
  ck_assert_int_eq(gmb_free(c, gone), 0);
  ck_assert_uint_eq(cstats(c).paused, 8 * MIB);
  ck_assert_int_eq(gmb_resume(c, "kv"), 0);
  ck_assert_uint_eq(harness_stats_ok(c).used, 8 * MIB);
  ck_assert_int_eq(gmb_free(c, gone), GMB_E_NOENT);
  alloc_fill(c, kv, 8 * MIB, 10); /* usable again, through the same id */
  ck_assert_int_lt(alloc_check(c, kv, 8 * MIB, 10), 0);
  ck_assert_int_eq(gmb_free(c, kv), 0);
  ck_assert_uint_eq(harness_stats_ok(c).used, 0);
  gmb_disconnect(c);
  harness_broker_stop(&b);
}
END_TEST

int main(void) {
  return harness_main(HARNESS_SUITE("sleep", "sleep", 60,
                                    paused_pages_serve_another_tenant,
                                    host_quota_bounds_offload,
                                    exit_while_paused,
                                    tagged_allocs_serve_another_tenant,
                                    tagged_alloc_locked_refuses_pause,
                                    tagged_alloc_discard_and_free_paused));
}
