/*
 * test_memory.c - allocations through a real broker: a quota raced by
 * several processes, waiting for memory, one client shared by threads, and
 * the bytes behind gmb_lock's pointers.
 *
 * The broker runs with GMB_BROKER_CHECKS=1 and must exit 0 at the end of
 * every test.  ITER (default 1) multiplies the rounds of the stress tests;
 * the random choices are seeded (SEED) so that a failure can be replayed.
 */
#include <check.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "gmb.h"
#include "harness.h"

#define MIB (UINT64_C(1) << 20)

/* --- quota_race ----------------------------------------------------------------- */

#define RACE_QUOTA (64 * MIB)
#define RACE_KIDS 4
#define RACE_MAX_HELD 128

struct race_child {
  const char *endpoint;
  int index;
  long rounds;
  uint64_t seed;
};

static int race_child_main(void *arg) {
  struct race_child *a = arg;
  uint64_t s = a->seed * 0x9e3779b97f4a7c15ull + (uint64_t)a->index + 1;
  gmb_client *c = NULL;
  int rc = gmb_connect(a->endpoint, "race", &c);
  CHILD_CHECK(rc == 0, 10, "connect: %s", gmb_last_error(NULL));
  gmb_id held[RACE_MAX_HELD];
  int n = 0;
  for (long r = 0; r < a->rounds; r++) {
    /* Allocate until refused.  This process alone can hold at most
     * quota / 1 MiB blocks, so a refusal must come within that many. */
    int got = 0;
    for (;;) {
      uint64_t size = (harness_rnd(&s) & 1) ? 3 * MIB : MIB;
      gmb_id id = 0;
      rc = gmb_alloc(c, size, 0, &id);
      if (rc != 0) {
        CHILD_CHECK(rc == GMB_E_QUOTA, 11, "round %ld: refusal %s, want "
                    "GMB_E_QUOTA: %s", r, gmb_err_name(rc), gmb_last_error(c));
        break;
      }
      CHILD_CHECK(n < RACE_MAX_HELD && got <= (int)(RACE_QUOTA / MIB), 12,
                  "round %ld: %d blocks held and still no refusal", r, n);
      held[n++] = id;
      got++;
      void *p = NULL;
      rc = gmb_lock(c, id, &p);
      CHILD_CHECK(rc == 0, 13, "lock: %s", gmb_last_error(c));
      *(volatile uint64_t *)p = id; /* first and last word are ours */
      *(volatile uint64_t *)((char *)p + size - 8) = id;
      gmb_stats st;
      rc = gmb_tenant_stats(c, &st);
      CHILD_CHECK(rc == 0, 14, "stats: %s", gmb_last_error(c));
      CHILD_CHECK(st.quota == RACE_QUOTA, 15, "quota %llu",
                  (unsigned long long)st.quota);
      CHILD_CHECK(st.used <= RACE_QUOTA, 16, "used %llu passes the quota",
                  (unsigned long long)st.used);
      CHILD_CHECK(st.peak <= RACE_QUOTA, 17, "peak %llu passes the quota",
                  (unsigned long long)st.peak);
    }
    /* Free about half, checking that nobody wrote into ours. */
    for (int i = 0; i < n;) {
      if (harness_rnd(&s) & 1) {
        i++;
        continue;
      }
      void *p = NULL;
      rc = gmb_lock(c, held[i], &p);
      CHILD_CHECK(rc == 0, 18, "lock: %s", gmb_last_error(c));
      CHILD_CHECK(*(volatile uint64_t *)p == held[i], 19, "block %llu was "
                  "overwritten", (unsigned long long)held[i]);
      rc = gmb_free(c, held[i]);
      CHILD_CHECK(rc == 0, 20, "free: %s", gmb_last_error(c));
      held[i] = held[--n];
    }
  }
  if (a->index == RACE_KIDS - 1) {
    /* This one dies holding its blocks: the broker must take them back. */
    _exit(0);
  }
  for (int i = 0; i < n; i++) {
    rc = gmb_free(c, held[i]);
    CHILD_CHECK(rc == 0, 21, "free: %s", gmb_last_error(c));
  }
  gmb_disconnect(c);
  return 0;
}

static int race_used_zero(void *arg) {
  gmb_stats st;
  return gmb_tenant_stats(arg, &st) == 0 && st.used == 0;
}

START_TEST(quota_race) {
  struct harness_broker b;
  harness_broker_start(&b, "host:512MiB",
                       "[tenant:race]\nquota = 64MiB\n");
  long rounds = 10 * harness_env_long("ITER", 1);
  uint64_t seed = (uint64_t)harness_env_long("SEED", 1);
  pid_t kids[RACE_KIDS];
  struct race_child args[RACE_KIDS];
  for (int i = 0; i < RACE_KIDS; i++) {
    args[i] = (struct race_child){b.endpoint, i, rounds, seed};
    kids[i] = harness_fork(race_child_main, &args[i]);
  }
  for (int i = 0; i < RACE_KIDS; i++) {
    int st = harness_wait(kids[i]);
    ck_assert_msg(st == 0, "racer %d ended with %d (its stderr says why)", i,
                  st);
  }
  gmb_client *c = harness_connect_ok(&b, "race");
  ck_assert_msg(harness_poll_until(race_used_zero, c, HARNESS_WAIT_MS),
                "tenant race still uses %llu bytes after every racer ended",
                (unsigned long long)harness_stats_ok(c).used);
  gmb_stats st = harness_stats_ok(c);
  ck_assert_uint_eq(st.quota, RACE_QUOTA);
  ck_assert_uint_le(st.peak, RACE_QUOTA);
  /* Every refusal came with used + (at most 3 MiB) > quota. */
  ck_assert_uint_gt(st.peak, RACE_QUOTA - 3 * MIB);
  gmb_disconnect(c);
  harness_broker_stop(&b);
}
END_TEST

/* --- alloc_wait ---------------------------------------------------------------------- */

struct waiter {
  gmb_client *c;
  uint64_t size;
  int timeout_ms;
  atomic_int started, done;
  int rc;
  gmb_id id;
  char why[600];
};

static void *waiter_main(void *arg) {
  struct waiter *w = arg;
  atomic_store(&w->started, 1);
  w->rc = gmb_alloc_wait(w->c, w->size, 0, w->timeout_ms, &w->id);
  snprintf(w->why, sizeof w->why, "%s", gmb_last_error(w->c));
  atomic_store(&w->done, 1);
  return NULL;
}

static int waiter_started(void *arg) {
  return atomic_load(&((struct waiter *)arg)->started);
}

static int waiter_done(void *arg) {
  return atomic_load(&((struct waiter *)arg)->done);
}

START_TEST(alloc_wait) {
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", "[tenant:w3]\nquota = 8MiB\n");
  gmb_client *w1 = harness_connect_ok(&b, "w1");
  gmb_client *w2 = harness_connect_ok(&b, "w2");
  gmb_client *w3 = harness_connect_ok(&b, "w3");

  /* 48 of 64 MiB held: 32 MiB cannot fit until they are freed. */
  gmb_id big = 0;
  ck_assert_int_eq(gmb_alloc(w1, 48 * MIB, 0, &big), 0);
  struct waiter w = {.c = w2, .size = 32 * MIB, .timeout_ms = 5000};
  pthread_t th;
  ck_assert_int_eq(pthread_create(&th, NULL, waiter_main, &w), 0);
  ck_assert(harness_poll_until(waiter_started, &w, HARNESS_WAIT_MS));
  /* Give the request time to reach the broker's queue (pacing only: the
   * outcome below is the same if it arrives after the free). */
  harness_sleep_ms(100);
  ck_assert_msg(!atomic_load(&w.done), "gmb_alloc_wait returned %s before "
                "any memory was freed: %s", gmb_err_name(w.rc), w.why);
  ck_assert_int_eq(gmb_free(w1, big), 0);
  ck_assert_msg(harness_poll_until(waiter_done, &w, HARNESS_WAIT_MS),
                "the waiter was not served after the free");
  pthread_join(th, NULL);
  ck_assert_msg(w.rc == 0, "gmb_alloc_wait = %s: %s", gmb_err_name(w.rc),
                w.why);
  ck_assert_uint_eq(harness_stats_ok(w2).used, 32 * MIB);

  /* Fill the device: 32 + 32 MiB.  A wait for more times out. */
  gmb_id w1b = 0;
  ck_assert_int_eq(gmb_alloc(w1, 32 * MIB, 0, &w1b), 0);
  gmb_id none = 0;
  int rc = gmb_alloc_wait(w2, 16 * MIB, 0, 200, &none);
  ck_assert_msg(rc == GMB_E_TIMEOUT, "wait on a full device = %s: %s",
                gmb_err_name(rc), gmb_last_error(w2));
  ck_assert_uint_eq(none, 0);

  /* Without waiting: GMB_E_NOMEM, explained with the device's figures. */
  rc = gmb_alloc(w2, 16 * MIB, 0, &none);
  ck_assert_msg(rc == GMB_E_NOMEM, "alloc on a full device = %s: %s",
                gmb_err_name(rc), gmb_last_error(w2));
  const char *why = gmb_last_error(w2);
  ck_assert_msg(strstr(why, "GMB_E_NOMEM") && strstr(why, "64MiB") &&
                    strstr(why, "free"),
                "NOMEM message lacks the free figures: %s", why);

  /* Over the quota is GMB_E_QUOTA, even on a full device, never waited. */
  rc = gmb_alloc_wait(w3, 16 * MIB, 0, 5000, &none);
  ck_assert_msg(rc == GMB_E_QUOTA, "alloc_wait over the quota = %s: %s",
                gmb_err_name(rc), gmb_last_error(w3));
  /* Within the quota but not the device: GMB_E_NOMEM. */
  rc = gmb_alloc(w3, 4 * MIB, 0, &none);
  ck_assert_msg(rc == GMB_E_NOMEM, "alloc within quota, full device = %s: %s",
                gmb_err_name(rc), gmb_last_error(w3));
  ck_assert_uint_eq(harness_stats_ok(w3).used, 0);

  /* The timed-out waiter was dropped: freeing now must not serve it late. */
  ck_assert_int_eq(gmb_free(w1, w1b), 0);
  ck_assert_uint_eq(harness_stats_ok(w2).used, 32 * MIB);
  ck_assert_uint_eq(harness_stats_ok(w1).used, 0);
  /* And a wait that can be served at once is. */
  ck_assert_int_eq(gmb_alloc_wait(w2, 16 * MIB, 0, 5000, &none), 0);
  ck_assert_uint_eq(harness_stats_ok(w2).used, 48 * MIB);

  gmb_disconnect(w1);
  gmb_disconnect(w2);
  gmb_disconnect(w3);
  harness_broker_stop(&b);
}
END_TEST

/* --- threads_share_client ----------------------------------------------------------- */

#define TS_THREADS 8
#define TS_LIVE 3

struct ts_arg {
  gmb_client *c;
  int index;
  long cycles;
};

static atomic_int ts_errors;
static pthread_mutex_t ts_mu = PTHREAD_MUTEX_INITIALIZER;
static char ts_first[512];

static void ts_fail(const char *fmt, int a, long b, int rc, const char *why) {
  atomic_fetch_add(&ts_errors, 1);
  pthread_mutex_lock(&ts_mu);
  if (!ts_first[0]) {
    char head[128];
    snprintf(head, sizeof head, fmt, a, b);
    snprintf(ts_first, sizeof ts_first, "%s: %s: %s", head, gmb_err_name(rc),
             why);
  }
  pthread_mutex_unlock(&ts_mu);
}

struct ts_block {
  gmb_id id;
  size_t size;
  uint64_t seed;
  void *ptr;
};

/* Checks a block's bytes and frees it; 0 when all was well. */
static int ts_retire(struct ts_arg *a, long cyc, struct ts_block *blk) {
  void *p = NULL;
  int rc = gmb_lock(a->c, blk->id, &p);
  if (rc) {
    ts_fail("thread %d cycle %ld: lock", a->index, cyc, rc,
            gmb_last_error(a->c));
    return -1;
  }
  if (p != blk->ptr)
    ts_fail("thread %d cycle %ld: a pinned allocation moved", a->index, cyc,
            0, "");
  long bad = harness_pattern_check(p, blk->size, blk->seed);
  if (bad >= 0)
    ts_fail("thread %d cycle %ld: corrupted bytes", a->index, cyc, 0,
            "another thread's data in this block");
  gmb_unlock(a->c, blk->id);
  rc = gmb_free(a->c, blk->id);
  if (rc)
    ts_fail("thread %d cycle %ld: free", a->index, cyc, rc,
            gmb_last_error(a->c));
  return rc;
}

static void *ts_main(void *arg) {
  struct ts_arg *a = arg;
  uint64_t s = 0x1234567ull * (uint64_t)(a->index + 1);
  struct ts_block live[TS_LIVE];
  int n = 0;
  for (long cyc = 0; cyc < a->cycles; cyc++) {
    /* Mostly small blocks (shared segments), now and then a large one. */
    size_t size = (harness_rnd(&s) % 16 == 0)
                      ? (size_t)(3 * MIB / 2)
                      : 512 + (size_t)(harness_rnd(&s) % (192 * 1024));
    struct ts_block blk = {0, size, ((uint64_t)a->index << 32) | (uint64_t)cyc,
                           NULL};
    int rc = gmb_alloc(a->c, size, 0, &blk.id);
    if (rc) {
      ts_fail("thread %d cycle %ld: alloc", a->index, cyc, rc,
              gmb_last_error(a->c));
      break;
    }
    rc = gmb_lock(a->c, blk.id, &blk.ptr);
    if (rc) {
      ts_fail("thread %d cycle %ld: lock", a->index, cyc, rc,
              gmb_last_error(a->c));
      break;
    }
    harness_pattern_fill(blk.ptr, size, blk.seed);
    if (harness_pattern_check(blk.ptr, size, blk.seed) >= 0)
      ts_fail("thread %d cycle %ld: read back differs", a->index, cyc, 0, "");
    gmb_unlock(a->c, blk.id);
    if (n == TS_LIVE) {
      if (ts_retire(a, cyc, &live[0])) break;
      memmove(live, live + 1, (TS_LIVE - 1) * sizeof live[0]);
      n--;
    }
    live[n++] = blk;
  }
  for (int i = 0; i < n; i++) ts_retire(a, a->cycles, &live[i]);
  return NULL;
}

START_TEST(threads_share_client) {
  struct harness_broker b;
  harness_broker_start(&b, "host:256MiB", NULL);
  gmb_client *c = harness_connect_ok(&b, "threads");
  long cycles = 200 * harness_env_long("ITER", 1);
  pthread_t th[TS_THREADS];
  struct ts_arg args[TS_THREADS];
  atomic_store(&ts_errors, 0);
  ts_first[0] = '\0';
  for (int i = 0; i < TS_THREADS; i++) {
    args[i] = (struct ts_arg){c, i, cycles};
    ck_assert_int_eq(pthread_create(&th[i], NULL, ts_main, &args[i]), 0);
  }
  for (int i = 0; i < TS_THREADS; i++) pthread_join(th[i], NULL);
  ck_assert_msg(atomic_load(&ts_errors) == 0, "%d failures; first: %s",
                atomic_load(&ts_errors), ts_first);
  gmb_stats st = harness_stats_ok(c);
  ck_assert_uint_eq(st.used, 0);
  ck_assert_uint_gt(st.peak, 0);
  gmb_disconnect(c);
  harness_broker_stop(&b);
}
END_TEST

/* --- data_shared_between_processes -------------------------------------------------- */

#define DATA_SIZE (64 * MIB)

struct data_shared { /* a MAP_SHARED page, visible to parent and child */
  gmb_id parent_id;
};

struct data_child {
  const char *endpoint;
  struct data_shared *sh;
  int go_r;
};

static int data_child_main(void *arg) {
  struct data_child *a = arg;
  CHILD_CHECK(harness_pipe_wait(a->go_r, HARNESS_WAIT_MS) == 'g', 10,
              "no go from the parent");
  gmb_client *c = NULL;
  int rc = gmb_connect(a->endpoint, "data", &c);
  CHILD_CHECK(rc == 0, 11, "connect: %s", gmb_last_error(NULL));
  gmb_id theirs = a->sh->parent_id;
  /* Same tenant, other session: the id means nothing here. */
  void *p = NULL;
  rc = gmb_lock(c, theirs, &p);
  CHILD_CHECK(rc == GMB_E_NOENT, 12, "lock of another session's id = %s",
              gmb_err_name(rc));
  rc = gmb_free(c, theirs);
  CHILD_CHECK(rc == GMB_E_NOENT, 13, "free of another session's id = %s: %s",
              gmb_err_name(rc), gmb_last_error(c));
  /* The tenant's figures include the parent's allocation. */
  gmb_stats st;
  rc = gmb_tenant_stats(c, &st);
  CHILD_CHECK(rc == 0 && st.used == DATA_SIZE, 14, "used %llu, want %llu",
              (unsigned long long)st.used, (unsigned long long)DATA_SIZE);
  gmb_id mine = 0;
  rc = gmb_alloc(c, DATA_SIZE, 0, &mine);
  CHILD_CHECK(rc == 0, 15, "alloc: %s", gmb_last_error(c));
  rc = gmb_lock(c, mine, &p);
  CHILD_CHECK(rc == 0, 16, "lock: %s", gmb_last_error(c));
  harness_pattern_fill(p, DATA_SIZE, 0xc0ffee);
  long bad = harness_pattern_check(p, DATA_SIZE, 0xc0ffee);
  CHILD_CHECK(bad < 0, 17, "own allocation differs at byte %ld", bad);
  gmb_unlock(c, mine);
  gmb_disconnect(c); /* frees `mine` */
  return 0;
}

START_TEST(data_shared_between_processes) {
  struct harness_broker b;
  harness_broker_start(&b, "host:256MiB", NULL);
  struct data_shared *sh = mmap(NULL, sizeof *sh, PROT_READ | PROT_WRITE,
                                MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  ck_assert_ptr_ne(sh, MAP_FAILED);
  int go[2];
  ck_assert_int_eq(pipe(go), 0);
  /* Forked before this process opens a client: it starts clean. */
  struct data_child a = {b.endpoint, sh, go[0]};
  pid_t kid = harness_fork(data_child_main, &a);

  gmb_client *c = harness_connect_ok(&b, "data");
  gmb_id id = 0;
  ck_assert_int_eq(gmb_alloc(c, DATA_SIZE, 0, &id), 0);
  void *p = NULL, *p2 = NULL;
  ck_assert_int_eq(gmb_lock(c, id, &p), 0);
  harness_pattern_fill(p, DATA_SIZE, id);
  ck_assert_int_eq(gmb_unlock(c, id), 0);
  ck_assert_int_eq(gmb_lock(c, id, &p2), 0);
  ck_assert_ptr_eq(p, p2); /* pinned: the address never changes */
  ck_assert_int_eq(harness_pattern_check(p2, DATA_SIZE, id), -1);
  ck_assert_int_eq(gmb_unlock(c, id), 0);

  sh->parent_id = id;
  ck_assert_int_eq(harness_pipe_send(go[1], 'g'), 0);
  int st = harness_wait(kid);
  ck_assert_msg(st == 0, "child ended with %d (its stderr says why)", st);

  /* The other session's work left this allocation as it was. */
  ck_assert_int_eq(gmb_lock(c, id, &p), 0);
  long bad = harness_pattern_check(p, DATA_SIZE, id);
  ck_assert_msg(bad < 0, "64MiB allocation differs at byte %ld", bad);
  ck_assert_int_eq(gmb_unlock(c, id), 0);
  /* The child said Bye. */
  ck_assert_uint_eq(harness_stats_ok(c).used, DATA_SIZE);
  ck_assert_int_eq(gmb_free(c, id), 0);
  ck_assert_uint_eq(harness_stats_ok(c).used, 0);
  ck_assert_int_eq(gmb_lock(c, id, &p), GMB_E_NOENT);
  gmb_disconnect(c);
  close(go[0]);
  close(go[1]);
  munmap(sh, sizeof *sh);
  harness_broker_stop(&b);
}
END_TEST

/* --- large_tail_shares_a_page ----------------------------------------------- */

/* A large allocation's last page is shared (the broker's pool.h, rule 1):
 * its pages are a segment of their own, its tail lies at an end of a small
 * segment that the tenant's small allocations use too, and the client maps
 * the two side by side.  Every byte written through each pointer reads
 * back, nothing overlaps, and the tenant holds fewer pages than with a
 * page-rounded segment per large allocation. */
START_TEST(large_tail_shares_a_page) {
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", NULL);
  gmb_client *c = harness_connect_ok(&b, "tails");
  struct {
    uint64_t size;
    gmb_id id;
    void *p;
  } a[] = {{64 * 1024, 0, NULL},  /* a small segment's start */
           {5 * MIB, 0, NULL},    /* 4 MiB of pages, 1 MiB at its end */
           {3 * MIB - 64 * 1024, 0, NULL}, /* 2 MiB of pages, the rest at
                                              the start of a new one */
           {128 * 1024, 0, NULL}, /* beside the first */
           {MIB + 4096, 0, NULL}, /* under a page: beside the last */
           {2 * MIB, 0, NULL}};   /* whole pages, no tail */
  const size_t n = sizeof a / sizeof a[0];
  for (size_t i = 0; i < n; i++) {
    ck_assert_msg(gmb_alloc(c, a[i].size, i == 2 ? GMB_MOVABLE : 0,
                            &a[i].id) == 0,
                  "alloc %zu: %s", i, gmb_last_error(c));
    ck_assert_int_eq(gmb_lock(c, a[i].id, &a[i].p), 0);
    harness_pattern_fill(a[i].p, a[i].size, a[i].id);
  }
  for (size_t i = 0; i < n; i++) {
    long bad = harness_pattern_check(a[i].p, a[i].size, a[i].id);
    ck_assert_msg(bad < 0, "allocation %zu differs at byte %ld", i, bad);
  }
  /* Pages: 2 (the small segment with the 5 MiB one's tail at its end)
   * + 4 + 2 + 2 (the next one's tail, then the 1 MiB + 4 KiB one) + 2 =
   * 12 MiB, where a segment rounded up per large request took
   * 2 + 6 + 4 + 2 + 2 = 16 MiB. */
  gmb_stats st = harness_stats_ok(c);
  ck_assert_uint_eq(st.segments, 12 * MIB);
  /* The large one asked movable is pinned: its address never changes. */
  void *again = NULL;
  ck_assert_int_eq(gmb_lock(c, a[2].id, &again), 0);
  ck_assert_ptr_eq(again, a[2].p);
  ck_assert_int_eq(gmb_unlock(c, a[2].id), 0);
  /* Freed one by one, the others keep their bytes. */
  for (size_t i = n; i-- > 0;) {
    ck_assert_int_eq(gmb_unlock(c, a[i].id), 0);
    ck_assert_int_eq(gmb_free(c, a[i].id), 0);
    for (size_t j = 0; j < i; j++) {
      long bad = harness_pattern_check(a[j].p, a[j].size, a[j].id);
      ck_assert_msg(bad < 0, "after freeing %zu, %zu differs at byte %ld", i,
                    j, bad);
    }
  }
  ck_assert_uint_eq(harness_stats_ok(c).used, 0);
  gmb_disconnect(c);
  harness_broker_stop(&b);
}
END_TEST

int main(void) {
  return harness_main(HARNESS_SUITE(
      "memory", "memory", 60,
      quota_race,
      alloc_wait,
      threads_share_client,
      data_shared_between_processes,
      large_tail_shares_a_page));
}
