/*
 * test_alloc_wait.c - the threads of one process while one of them waits
 * for memory (gmb_alloc_wait), against a real broker on the host device.
 *
 * A waiting request does not hold the client's connection while it waits:
 * another thread's gmb_free (which may be what frees the memory waited
 * for), a cache miss and a second wait all go through meanwhile, a broker
 * that dies wakes every waiter with GMB_E_CONN, and the broker's
 * max_waiters_per_session (and the library's own table, 64) bound how
 * many wait at once.  The same holds for gmb_lock of an offloaded
 * allocation that waits at the broker for room, where the library sends
 * one such Lock at a time.
 *
 * Ordering is asserted by state, never by time: a thread waits at the
 * broker once the tenant's row counts it (`waiting`), and is still waiting
 * while its `done` flag is clear.  The waits themselves are long
 * (WAIT_MS), so that a thread served only when its wait runs out returns
 * GMB_E_TIMEOUT, a different outcome, rather than a slower one.
 */
#include <check.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gmb.h"
#include "harness.h"

#define MIB (UINT64_C(1) << 20)
/* Long enough that no loaded machine reaches it, short enough that a
 * regression (a free blocked behind the wait) fails within the suite's
 * limit rather than hanging it. */
#define WAIT_MS 20000

static struct wire_tenant_row row_of(const struct harness_broker *b,
                                     const char *tenant) {
  struct wire_tenant_row r;
  int rc = harness_tenant_row(b, tenant, &r);
  ck_assert_msg(rc == 0, "tenant row of %s: %d", tenant, rc);
  return r;
}

struct waits_n {
  const struct harness_broker *b;
  uint64_t n;
};

/* n requests of tenant "w" wait at the broker. */
static int waiting_is(void *arg) {
  struct waits_n *w = arg;
  return row_of(w->b, "w").waiting == w->n;
}

static void wait_for_waiters(const struct harness_broker *b, uint64_t n) {
  struct waits_n w = {b, n};
  ck_assert_msg(harness_poll_until(waiting_is, &w, HARNESS_WAIT_MS),
                "not %llu requests waiting at the broker (%llu)",
                (unsigned long long)n,
                (unsigned long long)row_of(b, "w").waiting);
}

/* A thread in gmb_alloc_wait. */
struct waiter {
  gmb_client *c;
  size_t size;
  int timeout_ms;
  gmb_id id;
  int rc;
  char why[256];
  atomic_int done;
  pthread_t th;
};

static void *waiter_main(void *arg) {
  struct waiter *w = arg;
  w->rc = gmb_alloc_wait(w->c, w->size, 0, w->timeout_ms, &w->id);
  snprintf(w->why, sizeof w->why, "%s", gmb_last_error(w->c));
  atomic_store(&w->done, 1);
  return NULL;
}

static void waiter_start(struct waiter *w, gmb_client *c, size_t size) {
  memset(w, 0, sizeof *w);
  w->c = c;
  w->size = size;
  w->timeout_ms = WAIT_MS;
  w->rc = -1;
  ck_assert_int_eq(pthread_create(&w->th, NULL, waiter_main, w), 0);
}

static void waiter_join(struct waiter *w) {
  ck_assert_int_eq(pthread_join(w->th, NULL), 0);
}

/* The allocation's bytes can be written and read back. */
static void check_bytes(gmb_client *c, gmb_id id, size_t n, uint64_t seed) {
  void *p;
  ck_assert_int_eq(gmb_lock(c, id, &p), 0);
  harness_pattern_fill(p, n, seed);
  ck_assert_int_lt(harness_pattern_check(p, n, seed), 0);
  ck_assert_int_eq(gmb_unlock(c, id), 0);
}

/* A broker on host:64MiB; client c of tenant "w" holds `held` bytes (*x)
 * and thread a waits for `want` more, at the broker. */
static gmb_client *one_waits(struct harness_broker *b, uint64_t held,
                             size_t want, struct waiter *a, gmb_id *x) {
  harness_broker_start(b, "host:64MiB", NULL);
  gmb_client *c = harness_connect_ok(b, "w");
  *x = harness_alloc_ok(c, held);
  waiter_start(a, c, want);
  wait_for_waiters(b, 1);
  return c;
}

/* Thread a was served: its allocation's bytes work; then freed. */
static void served(gmb_client *c, struct waiter *a, uint64_t seed) {
  waiter_join(a);
  ck_assert_msg(a->rc == 0, "the wait: %s", a->why);
  check_bytes(c, a->id, a->size, seed);
  ck_assert_int_eq(gmb_free(c, a->id), 0);
}

/* The device is full with allocation X of this very process; thread A
 * waits for room; the main thread frees X, which must go through while A
 * waits (it once blocked behind A's wait, and A then timed out) and
 * serve A. */
START_TEST(free_on_another_thread_serves_the_wait) {
  struct harness_broker b;
  struct waiter a;
  gmb_id x;
  gmb_client *c = one_waits(&b, 48 * MIB, 32 * MIB, &a, &x);
  ck_assert_int_eq(gmb_free(c, x), 0);
  served(c, &a, 7);
  ck_assert_uint_eq(row_of(&b, "w").used, 0);
  gmb_disconnect(c);
  harness_broker_stop(&b);
}
END_TEST

/* While A waits, a cache miss on the main thread (a page from the broker)
 * and a plain allocation complete, and A is still waiting after both;
 * then the free serves it. */
START_TEST(cache_miss_while_a_thread_waits) {
  struct harness_broker b;
  struct waiter a;
  gmb_id x;
  gmb_client *c = one_waits(&b, 40 * MIB, 40 * MIB, &a, &x);
  void *p;
  ck_assert_msg(gmb_malloc_async(c, 4096, NULL, &p) == 0, "cache miss: %s",
                gmb_last_error(c));
  harness_pattern_fill(p, 4096, 3);
  gmb_id y = harness_alloc_ok(c, 1 * MIB);
  ck_assert_int_eq(atomic_load(&a.done), 0);
  ck_assert_uint_eq(row_of(&b, "w").waiting, 1);
  ck_assert_int_eq(gmb_free(c, y), 0);
  ck_assert_int_eq(gmb_free(c, x), 0);
  served(c, &a, 8);
  ck_assert_int_lt(harness_pattern_check(p, 4096, 3), 0);
  ck_assert_int_eq(gmb_free_async(c, p, NULL), 0);
  gmb_disconnect(c);
  harness_broker_stop(&b);
}
END_TEST

/* A session that lives on heartbeats (the broker in a PID namespace of
 * its own cannot watch the client's pid; 3 missed periods of 100 ms end
 * it) stays alive through a wait of many periods: heartbeats go out while
 * the wait is pending, and the wait is then served. */
START_TEST(heartbeats_go_on_during_a_wait) {
  if (geteuid() != 0 || !harness_pidns_possible()) {
    printf("heartbeats_go_on_during_a_wait: skipped: making a PID "
           "namespace needs root\n");
    return;
  }
  struct harness_broker b;
  harness_broker_start_opts(&b, "host:64MiB", "[broker]\nheartbeat_ms = 100\n",
                            HARNESS_PIDNS);
  gmb_client *c = harness_connect_ok(&b, "w");
  gmb_id x = harness_alloc_ok(c, 48 * MIB);
  struct waiter a;
  waiter_start(&a, c, 32 * MIB);
  wait_for_waiters(&b, 1);
  harness_sleep_ms(1000); /* pace only: ten periods of silence would end it */
  ck_assert_uint_eq(row_of(&b, "w").waiting, 1);
  ck_assert_int_eq(gmb_free(c, x), 0);
  served(c, &a, 9);
  char *log = harness_broker_log(&b);
  ck_assert_msg(strstr(log, "heartbeats stopped") == NULL, "log:\n%s", log);
  free(log);
  gmb_disconnect(c);
  harness_broker_stop(&b);
}
END_TEST

/* The broker dies (SIGKILL, no last word) while two threads wait: both
 * return GMB_E_CONN, neither hangs, and the client stays dead. */
START_TEST(broker_killed_while_two_threads_wait) {
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", NULL);
  gmb_client *c = harness_connect_ok(&b, "w");
  harness_alloc_ok(c, 48 * MIB);
  struct waiter a, a2;
  waiter_start(&a, c, 32 * MIB);
  waiter_start(&a2, c, 24 * MIB);
  wait_for_waiters(&b, 2);
  harness_broker_kill(&b);
  waiter_join(&a);
  waiter_join(&a2);
  ck_assert_msg(a.rc == GMB_E_CONN, "first: %s", a.why);
  ck_assert_msg(a2.rc == GMB_E_CONN, "second: %s", a2.why);
  gmb_id id;
  ck_assert_int_eq(gmb_alloc(c, 4096, 0, &id), GMB_E_CONN);
  gmb_disconnect(c);
}
END_TEST

/* A device of `dev` bytes (config `ini`) full with X of client c; n
 * threads of c wait for `each` bytes at once, none holding the
 * connection; one more is refused GMB_E_LIMIT, explained with `why`, and
 * the others, still waiting, are all served once X is freed.  Nothing is
 * left: no allocation, no waiter at the broker, and the client still
 * serves a wait of its own afterwards. */
#define WAITERS_MAX 64
static void past_the_limit(uint64_t dev, const char *ini, int n, size_t each,
                           const char *why) {
  struct harness_broker b;
  char spec[64];
  snprintf(spec, sizeof spec, "host:%lluMiB", (unsigned long long)(dev / MIB));
  harness_broker_start(&b, spec, ini);
  gmb_client *c = harness_connect_ok(&b, "w");
  gmb_id x = harness_alloc_ok(c, dev);
  static struct waiter w[WAITERS_MAX];
  ck_assert_int_le(n, WAITERS_MAX);
  for (int i = 0; i < n; i++) waiter_start(&w[i], c, each);
  wait_for_waiters(&b, (uint64_t)n);
  gmb_id id;
  int rc = gmb_alloc_wait(c, each, 0, WAIT_MS, &id);
  ck_assert_msg(rc == GMB_E_LIMIT, "one more: %s", gmb_last_error(c));
  ck_assert_msg(strstr(gmb_last_error(c), why), "%s", gmb_last_error(c));
  for (int i = 0; i < n; i++) ck_assert_int_eq(atomic_load(&w[i].done), 0);
  ck_assert_uint_eq(row_of(&b, "w").waiting, (uint64_t)n);
  ck_assert_int_eq(gmb_free(c, x), 0);
  for (int i = 0; i < n; i++) served(c, &w[i], 20 + (uint64_t)i);
  struct wire_tenant_row r = row_of(&b, "w");
  ck_assert_uint_eq(r.used, 0);
  ck_assert_uint_eq(r.waiting, 0);
  ck_assert_int_eq(gmb_alloc_wait(c, dev, 0, WAIT_MS, &id), 0);
  ck_assert_int_eq(gmb_free(c, id), 0);
  gmb_disconnect(c);
  harness_broker_stop(&b);
}

/* The broker's max_waiters_per_session (6 here). */
START_TEST(waiters_up_to_the_limit_and_one_more) {
  past_the_limit(64 * MIB, "[broker]\nmax_waiters_per_session = 6\n", 6,
                 8 * MIB, "max_waiters_per_session");
}
END_TEST

/* The client's own bound, 64 (the broker's default
 * max_waiters_per_session, raised here so that the client's is the one
 * reached): the 65th is refused before it is sent. */
START_TEST(client_waiter_table_full) {
  past_the_limit(128 * MIB, "[broker]\nmax_waiters_per_session = 100\n",
                 WAITERS_MAX, 1 * MIB, "wait for the broker already");
}
END_TEST

/* A thread in gmb_lock. */
struct locker {
  gmb_client *c;
  gmb_id id;
  void *p;
  int rc;
  char why[256];
  pthread_t th;
};

static void *locker_main(void *arg) {
  struct locker *l = arg;
  l->rc = gmb_lock(l->c, l->id, &l->p);
  snprintf(l->why, sizeof l->why, "%s", gmb_last_error(l->c));
  return NULL;
}

/* Two movable allocations offloaded by an operator's pause, and no room
 * on the device: thread A's gmb_lock waits at the broker to bring its
 * allocation back, and thread B's gmb_lock of the other one waits behind
 * it in the library (the broker takes one such Lock per session at a
 * time and would refuse B's), without holding the connection: a free on
 * the main thread goes through, and both are served, bytes intact. */
#define FILL 80
START_TEST(two_threads_lock_offloaded_allocations) {
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB",
                       "[broker]\nsleep_wait_ms = 0\n"
                       "restore_wait_ms = 20000\n");
  gmb_client *c = harness_connect_ok(&b, "w");
  gmb_id id[2];
  for (int i = 0; i < 2; i++) {
    void *p;
    ck_assert_int_eq(gmb_alloc(c, 1 * MIB, GMB_MOVABLE, &id[i]), 0);
    ck_assert_int_eq(gmb_lock(c, id[i], &p), 0);
    harness_pattern_fill(p, 1 * MIB, 50 + i);
    ck_assert_int_eq(gmb_unlock(c, id[i]), 0);
  }
  char out[4096];
  int rc = harness_ctl(&b, out, sizeof out, "pause", "w", "--tag",
                       "(movable)", NULL);
  ck_assert_msg(rc == 0, "gmbctl pause: %s", out);
  ck_assert_uint_eq(row_of(&b, "w").host_bytes, 2 * MIB);
  gmb_client *o = harness_connect_ok(&b, "other");
  gmb_id fill[FILL];
  int n = 0;
  while (n < FILL && gmb_alloc(o, 1 * MIB, 0, &fill[n]) == 0) n++;
  ck_assert_int_gt(n, 2);
  ck_assert_int_lt(n, FILL);
  struct locker l[2];
  for (int i = 0; i < 2; i++)
    l[i] = (struct locker){.c = c, .id = id[i], .rc = -1};
  ck_assert_int_eq(pthread_create(&l[0].th, NULL, locker_main, &l[0]), 0);
  wait_for_waiters(&b, 1);
  ck_assert_int_eq(pthread_create(&l[1].th, NULL, locker_main, &l[1]), 0);
  gmb_id y;
  ck_assert_int_eq(gmb_alloc(c, 4096, 0, &y), GMB_E_NOMEM);
  for (int i = 0; i < 4; i++) ck_assert_int_eq(gmb_free(o, fill[--n]), 0);
  for (int i = 0; i < 2; i++) {
    ck_assert_int_eq(pthread_join(l[i].th, NULL), 0);
    ck_assert_msg(l[i].rc == 0, "lock %d: %s", i, l[i].why);
    ck_assert_int_lt(harness_pattern_check(l[i].p, 1 * MIB, 50 + i), 0);
    ck_assert_int_eq(gmb_unlock(c, id[i]), 0);
    ck_assert_int_eq(gmb_free(c, id[i]), 0);
  }
  ck_assert_uint_eq(row_of(&b, "w").host_bytes, 0);
  while (n > 0) ck_assert_int_eq(gmb_free(o, fill[--n]), 0);
  gmb_disconnect(o);
  gmb_disconnect(c);
  harness_broker_stop(&b);
}
END_TEST

/* A thread in gmb_alloc_wait with tag "t" current. */
static void *tagged_waiter_main(void *arg) {
  struct waiter *w = arg;
  if (gmb_cache_tag(w->c, "t") != 0) {
    snprintf(w->why, sizeof w->why, "gmb_cache_tag: %s", gmb_last_error(w->c));
    atomic_store(&w->done, 1);
    return NULL;
  }
  return waiter_main(w);
}

/* Tag "t" of client c (tenant "w", on host:64MiB beside tenant "other"
 * holding 40 MiB) holds 8 MiB of known bytes (*first), and thread *a waits
 * at the broker for 30 MiB with "t" current; then the tag is paused with
 * `pause` (the application's gmb_pause or an operator's) while the wait
 * is pending, and the room comes: the wait completes after the pause.
 * Treated as an allocation asked after the pause: given back, and the
 * call fails as one made into the paused tag would (`why` in its
 * message); nothing of it stays at the broker, and the tag's bytes come
 * back whole at its resume. */
static void wait_outlives_its_tags_pause(int by_operator, const char *why) {
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", NULL);
  gmb_client *c = harness_connect_ok(&b, "w");
  gmb_client *o = harness_connect_ok(&b, "other");
  gmb_id big = harness_alloc_ok(o, 40 * MIB), first;
  ck_assert_int_eq(gmb_cache_tag(c, "t"), 0);
  ck_assert_int_eq(gmb_alloc(c, 8 * MIB, 0, &first), 0);
  ck_assert_int_eq(gmb_cache_tag(c, NULL), 0);
  check_bytes(c, first, 8 * MIB, 61);
  struct waiter a;
  memset(&a, 0, sizeof a);
  a = (struct waiter){.c = c, .size = 30 * MIB, .timeout_ms = WAIT_MS,
                      .rc = -1};
  ck_assert_int_eq(pthread_create(&a.th, NULL, tagged_waiter_main, &a), 0);
  wait_for_waiters(&b, 1);
  if (by_operator) {
    char out[4096];
    int rc = harness_ctl(&b, out, sizeof out, "pause", "w", "--tag", "t",
                         NULL);
    ck_assert_msg(rc == 0, "gmbctl pause: %s", out);
    struct wire_tenant_row r = row_of(&b, "w");
    for (int i = 0; i < HARNESS_WAIT_MS / 5; i++) {
      r = row_of(&b, "w");
      if (r.host_bytes == 8 * MIB && r.used == 0) break;
      harness_sleep_ms(5);
    }
    ck_assert_uint_eq(r.host_bytes, 8 * MIB);
  } else {
    ck_assert_msg(gmb_pause(c, "t", GMB_PAUSE_OFFLOAD) == 0, "pause: %s",
                  gmb_last_error(c));
  }
  /* Paused with the wait still pending: 24 MiB free, 30 waited for. */
  struct wire_tenant_row r = row_of(&b, "w");
  ck_assert_uint_eq(r.used, 0);
  ck_assert_uint_eq(r.waiting, 1);
  ck_assert_int_eq(atomic_load(&a.done), 0);
  ck_assert_int_eq(gmb_free(o, big), 0);
  waiter_join(&a);
  ck_assert_msg(a.rc == GMB_E_INVAL && strstr(a.why, why),
                "the wait that completed after its tag paused: %s (%s)",
                gmb_err_name(a.rc), a.why);
  ck_assert_uint_eq(a.id, 0);
  r = row_of(&b, "w");
  ck_assert_uint_eq(r.used, 0);
  ck_assert_uint_eq(r.waiting, 0);
  ck_assert_uint_eq(r.host_bytes, 8 * MIB);
  if (by_operator) {
    char out[4096];
    ck_assert_int_eq(harness_ctl(&b, out, sizeof out, "resume", "w", NULL),
                     0);
  } else {
    ck_assert_msg(gmb_resume(c, "t") == 0, "resume: %s", gmb_last_error(c));
  }
  void *p = NULL;
  int rc = -1;
  for (int i = 0; i < HARNESS_WAIT_MS / 5 && rc != 0; i++) {
    rc = gmb_lock(c, first, &p);
    if (rc) harness_sleep_ms(5);
  }
  ck_assert_msg(rc == 0, "lock after the resume: %s", gmb_last_error(c));
  ck_assert_int_lt(harness_pattern_check(p, 8 * MIB, 61), 0);
  ck_assert_int_eq(gmb_unlock(c, first), 0);
  ck_assert_int_eq(gmb_free(c, first), 0);
  ck_assert_uint_eq(row_of(&b, "w").used, 0);
  gmb_disconnect(o);
  gmb_disconnect(c);
  harness_broker_stop(&b);
}

START_TEST(tagged_wait_completes_after_gmb_pause) {
  wait_outlives_its_tags_pause(0, "gmb_resume it first");
}
END_TEST

START_TEST(tagged_wait_completes_after_operator_pause) {
  wait_outlives_its_tags_pause(1, "paused by an operator");
}
END_TEST

int main(void) {
  return harness_main(HARNESS_SUITE(
      "alloc_wait", "alloc_wait", 90, free_on_another_thread_serves_the_wait,
      cache_miss_while_a_thread_waits, heartbeats_go_on_during_a_wait,
      broker_killed_while_two_threads_wait,
      waiters_up_to_the_limit_and_one_more, client_waiter_table_full,
      two_threads_lock_offloaded_allocations,
      tagged_wait_completes_after_gmb_pause,
      tagged_wait_completes_after_operator_pause));
}
