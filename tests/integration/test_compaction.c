/*
 * test_compaction.c - movable allocations under real compaction: client
 * processes lock, write and verify their memory from several threads while
 * the broker moves it underneath them, and nothing is ever read or written
 * through a stale address.
 *
 * The moves are asked for by the test on the admin socket (AdminCompact,
 * answered when the run ends); the broker runs with `compaction = off` so
 * that those runs are the only ones and their `moves` add up to what
 * happened.  Children report through a shared anonymous mapping and their
 * exit code; the broker runs with GMB_BROKER_CHECKS=1 and must exit 0.
 *
 * Knobs: MOVES (moves the stress test waits for, default 10000), SCALE
 * (allocations per child, default 1 = 192), SEED, COMPACT_MAX (AdminCompact
 * requests before the stress test gives up, default 200000).
 */
#include <check.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "gmb.h"
#include "harness.h"

#define KIB (UINT64_C(1) << 10)
#define MIB (UINT64_C(1) << 20)
#define CONFIG "[broker]\ncompaction = off\n"

/* Bytes of buf that differ from the pattern of `seed` (0 when intact). */
static long bad_bytes(const void *buf, size_t len, uint64_t seed) {
  if (harness_pattern_check(buf, len, seed) < 0) return 0;
  uint8_t *want = malloc(len);
  if (want == NULL) return (long)len;
  harness_pattern_fill(want, len, seed);
  long n = 0;
  for (size_t i = 0; i < len; i++) n += ((const uint8_t *)buf)[i] != want[i];
  free(want);
  return n;
}

/* --- the children of the stress tests -------------------------------------- */

#define MAX_KIDS 8
#define THREADS 4 /* per child: THREADS-1 lockers and one churner */

/* What the test and its children share. */
struct shared {
  atomic_int stop;        /* the test has seen enough moves */
  atomic_int ready;       /* children that allocated everything */
  struct {
    atomic_long locks, writes, corrupt, ptr_changed, errors, churns;
    atomic_long final_checked;
  } kid[MAX_KIDS];
};

struct kid_entry {
  pthread_rwlock_t rw; /* read: lockers that only verify; write: rewrites */
  gmb_id id;
  size_t size;
  uint64_t seed; /* the pattern it holds now */
};

struct kid {
  const char *endpoint;
  const char *tenant;
  int index, n;
  uint64_t seed;
  struct shared *sh;
  gmb_client *c;
  struct kid_entry *e;
  atomic_uint_fast64_t next_seed;
};

struct kid_thread {
  struct kid *k;
  int tid;
};

static size_t kid_size(uint64_t *s) {
  /* 512 B .. 32 KiB, all small-class: they share 2 MiB segments. */
  return (size_t)(1 + harness_rnd(s) % 64) * 512;
}

/* Allocates entry i anew (movable) and fills it with a fresh pattern.
 * Caller holds the entry's write lock (or is alone).  0 or a GMB_E_*. */
static int kid_fill(struct kid *k, struct kid_entry *e, uint64_t *s) {
  e->size = kid_size(s);
  int rc = gmb_alloc(k->c, e->size, GMB_MOVABLE, &e->id);
  if (rc) return rc;
  void *p;
  rc = gmb_lock(k->c, e->id, &p);
  if (rc) return rc;
  e->seed = atomic_fetch_add(&k->next_seed, 1);
  harness_pattern_fill(p, e->size, e->seed);
  return gmb_unlock(k->c, e->id);
}

/*
 * One verification under a hold: the contents match, a nested lock gives
 * the same address, and (when `write`) a fresh pattern unique to this
 * entry and iteration is written and read back through the same hold.
 */
static void kid_check(struct kid *k, struct kid_entry *e, int write) {
  struct shared *sh = k->sh;
  void *p, *q;
  int rc = gmb_lock(k->c, e->id, &p);
  if (rc) {
    fprintf(stderr, "child %d: gmb_lock(%llu): %s\n", k->index,
            (unsigned long long)e->id, gmb_last_error(k->c));
    atomic_fetch_add(&sh->kid[k->index].errors, 1);
    return;
  }
  long bad = bad_bytes(p, e->size, e->seed);
  if (write) {
    e->seed = atomic_fetch_add(&k->next_seed, 1);
    harness_pattern_fill(p, e->size, e->seed);
    sched_yield(); /* keep the hold across a compaction step or two */
    bad += bad_bytes(p, e->size, e->seed);
    atomic_fetch_add(&sh->kid[k->index].writes, 1);
  }
  if (gmb_lock(k->c, e->id, &q) != 0) {
    atomic_fetch_add(&sh->kid[k->index].errors, 1);
  } else {
    if (q != p) atomic_fetch_add(&sh->kid[k->index].ptr_changed, 1);
    gmb_unlock(k->c, e->id);
  }
  if (bad) {
    fprintf(stderr, "child %d: allocation %llu: %ld bad bytes of %zu\n",
            k->index, (unsigned long long)e->id, bad, e->size);
    atomic_fetch_add(&sh->kid[k->index].corrupt, bad);
  }
  if (gmb_unlock(k->c, e->id) != 0)
    atomic_fetch_add(&sh->kid[k->index].errors, 1);
  atomic_fetch_add(&sh->kid[k->index].locks, 1);
}

static void *kid_thread_main(void *arg) {
  struct kid_thread *t = arg;
  struct kid *k = t->k;
  uint64_t s = k->seed * 0x9e3779b97f4a7c15ull + (uint64_t)k->index * 131 +
               (uint64_t)t->tid + 1;
  while (!atomic_load(&k->sh->stop)) {
    struct kid_entry *e = &k->e[harness_rnd(&s) % (uint64_t)k->n];
    if (t->tid == 0) {
      /* The churner: free and allocate again with another size, which
       * leaves holes for the next compaction to close. */
      pthread_rwlock_wrlock(&e->rw);
      int rc = gmb_free(k->c, e->id);
      if (rc == 0) rc = kid_fill(k, e, &s);
      pthread_rwlock_unlock(&e->rw);
      if (rc) {
        fprintf(stderr, "child %d: churn: %s\n", k->index,
                gmb_last_error(k->c));
        atomic_fetch_add(&k->sh->kid[k->index].errors, 1);
        break;
      }
      atomic_fetch_add(&k->sh->kid[k->index].churns, 1);
      if (harness_rnd(&s) % 4 == 0) sched_yield();
    } else if (harness_rnd(&s) % 4 == 0) {
      pthread_rwlock_wrlock(&e->rw);
      kid_check(k, e, 1);
      pthread_rwlock_unlock(&e->rw);
    } else {
      /* Readers of one entry hold it together: several threads lock the
       * same id at once. */
      pthread_rwlock_rdlock(&e->rw);
      kid_check(k, e, 0);
      pthread_rwlock_unlock(&e->rw);
    }
  }
  return NULL;
}

static int kid_main(void *arg) {
  struct kid *k = arg;
  struct shared *sh = k->sh;
  int rc = gmb_connect(k->endpoint, k->tenant, &k->c);
  CHILD_CHECK(rc == 0, 10, "connect: %s", gmb_last_error(NULL));
  k->e = calloc((size_t)k->n, sizeof *k->e);
  CHILD_CHECK(k->e != NULL, 11, "calloc");
  atomic_init(&k->next_seed, ((uint64_t)k->index + 1) << 40);
  uint64_t s = k->seed + (uint64_t)k->index * 7919 + 1;
  for (int i = 0; i < k->n; i++) {
    pthread_rwlock_init(&k->e[i].rw, NULL);
    rc = kid_fill(k, &k->e[i], &s);
    CHILD_CHECK(rc == 0, 12, "alloc %d: %s", i, gmb_last_error(k->c));
  }
  /* Every other one freed and allocated again: holes from the start. */
  for (int i = 0; i < k->n; i += 2) {
    CHILD_CHECK(gmb_free(k->c, k->e[i].id) == 0, 13, "free: %s",
                gmb_last_error(k->c));
    rc = kid_fill(k, &k->e[i], &s);
    CHILD_CHECK(rc == 0, 14, "alloc: %s", gmb_last_error(k->c));
  }
  atomic_fetch_add(&sh->ready, 1);
  pthread_t th[THREADS];
  struct kid_thread ta[THREADS];
  for (int t = 0; t < THREADS; t++) {
    ta[t] = (struct kid_thread){k, t};
    CHILD_CHECK(pthread_create(&th[t], NULL, kid_thread_main, &ta[t]) == 0,
                15, "pthread_create");
  }
  for (int t = 0; t < THREADS; t++) pthread_join(th[t], NULL);
  /* The end: every allocation still holds its last pattern. */
  for (int i = 0; i < k->n; i++) {
    kid_check(k, &k->e[i], 0);
    atomic_fetch_add(&sh->kid[k->index].final_checked, 1);
  }
  gmb_disconnect(k->c);
  return 0;
}

/* Sends AdminCompact until `target` moves were reported, `max` requests
 * were sent, or stop_early() says so.  Returns the moves counted. */
static uint64_t compact_until(const struct harness_broker *b, uint64_t target,
                              long max, struct wire_compact_stats *sum) {
  void *admin = harness_raw_open(b->admin_endpoint);
  memset(sum, 0, sizeof *sum);
  for (long i = 0; i < max && sum->moves < target; i++) {
    struct wire_compact_stats st;
    int rc = harness_admin_compact(admin, "", &st);
    ck_assert_msg(rc == 0, "AdminCompact: %s", gmb_err_name(rc));
    sum->moves += st.moves;
    sum->bytes_moved += st.bytes_moved;
    sum->segments_released += st.segments_released;
    sum->skipped_locked += st.skipped_locked;
    sum->runs++;
    if (st.moves == 0) harness_sleep_ms(1); /* let the churners make holes */
  }
  harness_raw_close(admin);
  return sum->moves;
}

static struct shared *shared_new(void) {
  struct shared *sh = mmap(NULL, sizeof *sh, PROT_READ | PROT_WRITE,
                           MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  ck_assert_ptr_ne(sh, MAP_FAILED);
  memset(sh, 0, sizeof *sh);
  return sh;
}

struct ready_wait {
  struct shared *sh;
  int n;
};

static int ready_all(void *arg) {
  struct ready_wait *w = arg;
  return atomic_load(&w->sh->ready) >= w->n;
}

/* Waits for `n` children to be ready (their first allocations made). */
static void wait_ready(struct shared *sh, int n) {
  struct ready_wait w = {sh, n};
  ck_assert_msg(harness_poll_until(ready_all, &w, HARNESS_WAIT_MS),
                "only %d of %d children got their memory",
                atomic_load(&sh->ready), n);
}

/* --- the stress test ---------------------------------------------------------- */

START_TEST(locks_hold_under_compaction) {
  enum { KIDS = 3 };
  uint64_t target = (uint64_t)harness_env_long("MOVES", 10000);
  long max = harness_env_long("COMPACT_MAX", 200000);
  int n = (int)(192 * harness_env_long("SCALE", 1));
  uint64_t seed = (uint64_t)harness_env_long("SEED", 1);
  struct harness_broker b;
  harness_broker_start(&b, "host:256MiB", CONFIG);
  struct shared *sh = shared_new();
  struct kid kids[KIDS];
  pid_t pids[KIDS];
  for (int i = 0; i < KIDS; i++) {
    kids[i] = (struct kid){.endpoint = b.endpoint, .tenant = "compact",
                           .index = i, .n = n, .seed = seed, .sh = sh};
    pids[i] = harness_fork(kid_main, &kids[i]);
  }
  wait_ready(sh, KIDS);

  struct wire_compact_stats sum;
  uint64_t moves = compact_until(&b, target, max, &sum);
  atomic_store(&sh->stop, 1);
  for (int i = 0; i < KIDS; i++)
    ck_assert_int_eq(harness_wait(pids[i]), 0);

  long locks = 0, writes = 0, churns = 0;
  for (int i = 0; i < KIDS; i++) {
    locks += atomic_load(&sh->kid[i].locks);
    writes += atomic_load(&sh->kid[i].writes);
    churns += atomic_load(&sh->kid[i].churns);
    long corrupt = atomic_load(&sh->kid[i].corrupt);
    long changed = atomic_load(&sh->kid[i].ptr_changed);
    long errors = atomic_load(&sh->kid[i].errors);
    long checked = atomic_load(&sh->kid[i].final_checked);
    ck_assert_int_eq(corrupt, 0);
    ck_assert_int_eq(changed, 0);
    ck_assert_int_eq(errors, 0);
    ck_assert_int_eq(checked, n);
  }
  fprintf(stderr, "locks_hold_under_compaction: %llu moves (%llu bytes) in "
          "%llu runs, %llu skipped locked, %llu segments released; %ld "
          "locks, %ld writes, %ld churns\n",
          (unsigned long long)moves, (unsigned long long)sum.bytes_moved,
          (unsigned long long)sum.runs, (unsigned long long)sum.skipped_locked,
          (unsigned long long)sum.segments_released, locks, writes, churns);
  ck_assert_uint_ge(moves, target);
  munmap(sh, sizeof *sh);
  harness_broker_stop(&b);
}
END_TEST

/* --- a holder killed ------------------------------------------------------------ */

struct victim {
  const char *endpoint;
  int ready_fd;
  int n;
};

/* Allocates, locks everything (some twice), says so, and waits to die. */
static int victim_main(void *arg) {
  struct victim *v = arg;
  gmb_client *c = NULL;
  CHILD_CHECK(gmb_connect(v->endpoint, "victim", &c) == 0, 20, "connect: %s",
              gmb_last_error(NULL));
  for (int i = 0; i < v->n; i++) {
    gmb_id id;
    void *p;
    CHILD_CHECK(gmb_alloc(c, 64 * KIB, GMB_MOVABLE, &id) == 0, 21, "alloc: %s",
                gmb_last_error(c));
    CHILD_CHECK(gmb_lock(c, id, &p) == 0, 22, "lock: %s", gmb_last_error(c));
    memset(p, 0x5A, 64 * KIB);
    if (i % 2) CHILD_CHECK(gmb_lock(c, id, &p) == 0, 23, "lock");
    if (i % 3 == 0) { /* some unlocked: those may move, the rest not */
      gmb_unlock(c, id);
      if (i % 2) gmb_unlock(c, id);
    }
  }
  harness_pipe_send(v->ready_fd, 'r');
  for (;;) pause();
}

static int victim_gone(void *arg) {
  const struct harness_broker *b = arg;
  struct wire_tenant_row row;
  int rc = harness_tenant_row(b, "victim", &row);
  return rc == GMB_E_NOENT || (rc == 0 && row.used == 0 && row.sessions == 0);
}

START_TEST(kill_9_holder_memory_returns) {
  enum { KIDS = 2 };
  uint64_t seed = (uint64_t)harness_env_long("SEED", 1);
  struct harness_broker b;
  harness_broker_start(&b, "host:256MiB", CONFIG);
  struct shared *sh = shared_new();
  struct kid kids[KIDS];
  pid_t pids[KIDS];
  for (int i = 0; i < KIDS; i++) {
    kids[i] = (struct kid){.endpoint = b.endpoint, .tenant = "compact",
                           .index = i, .n = 96, .seed = seed + 17, .sh = sh};
    pids[i] = harness_fork(kid_main, &kids[i]);
  }
  int pfd[2];
  ck_assert_int_eq(pipe(pfd), 0);
  struct victim v = {b.endpoint, pfd[1], 48};
  pid_t vp = harness_fork(victim_main, &v);
  ck_assert_int_eq(harness_pipe_wait(pfd[0], HARNESS_WAIT_MS), 'r');
  wait_ready(sh, KIDS);
  struct wire_tenant_row row;
  ck_assert_int_eq(harness_tenant_row(&b, "victim", &row), 0);
  ck_assert_uint_eq(row.used, 48 * 64 * KIB);

  struct wire_compact_stats before, after;
  compact_until(&b, 200, 2000, &before);
  ck_assert_int_eq(kill(vp, SIGKILL), 0);
  ck_assert_int_eq(harness_wait(vp), 128 + SIGKILL);
  /* The session ends with its process: every allocation, locked or not,
   * goes back. */
  ck_assert_msg(harness_poll_until(victim_gone, &b, HARNESS_WAIT_MS),
                "the killed holder's memory did not come back");
  /* Compaction goes on, and the others never noticed. */
  uint64_t moved = compact_until(&b, 200, 20000, &after);
  atomic_store(&sh->stop, 1);
  for (int i = 0; i < KIDS; i++)
    ck_assert_int_eq(harness_wait(pids[i]), 0);
  for (int i = 0; i < KIDS; i++) {
    long corrupt = atomic_load(&sh->kid[i].corrupt);
    long errors = atomic_load(&sh->kid[i].errors);
    long changed = atomic_load(&sh->kid[i].ptr_changed);
    ck_assert_int_eq(corrupt, 0);
    ck_assert_int_eq(errors, 0);
    ck_assert_int_eq(changed, 0);
  }
  ck_assert_uint_ge(moved, 200);
  close(pfd[0]);
  close(pfd[1]);
  munmap(sh, sizeof *sh);
  harness_broker_stop(&b);
}
END_TEST

/* --- one process: a locked allocation stays put ----------------------------------- */

#define PIN_N 512

START_TEST(locked_address_survives_compaction) {
  struct harness_broker b;
  harness_broker_start(&b, "host:256MiB", CONFIG);
  gmb_client *c = harness_connect_ok(&b, "still");
  static gmb_id ids[PIN_N];
  static void *before[PIN_N];
  for (int i = 0; i < PIN_N; i++) {
    ck_assert_int_eq(gmb_alloc(c, 16 * KIB, GMB_MOVABLE, &ids[i]), 0);
    void *p;
    ck_assert_int_eq(gmb_lock(c, ids[i], &p), 0);
    harness_pattern_fill(p, 16 * KIB, ids[i]);
    ck_assert_int_eq(gmb_unlock(c, ids[i]), 0);
  }
  /* Free three of four: the segments are a quarter used, so compaction
   * gathers them.  Of the rest, lock every other one. */
  int locked = 0;
  for (int i = 0; i < PIN_N; i++) {
    if (i % 4 != 3) {
      ck_assert_int_eq(gmb_free(c, ids[i]), 0);
      ids[i] = 0;
    } else if (i % 8 == 3) {
      ck_assert_int_eq(gmb_lock(c, ids[i], &before[i]), 0);
      locked++;
    } else {
      ck_assert_int_eq(gmb_lock(c, ids[i], &before[i]), 0);
      ck_assert_int_eq(gmb_unlock(c, ids[i]), 0);
    }
  }
  ck_assert_int_gt(locked, 0);
  void *admin = harness_raw_open(b.admin_endpoint);
  struct wire_compact_stats st;
  ck_assert_int_eq(harness_admin_compact(admin, "still", &st), 0);
  ck_assert_uint_gt(st.moves, 0);
  ck_assert_uint_gt(st.skipped_locked, 0);
  int moved = 0;
  for (int i = 3; i < PIN_N; i += 4) {
    void *now;
    ck_assert_int_eq(gmb_lock(c, ids[i], &now), 0);
    ck_assert_int_eq(harness_pattern_check(now, 16 * KIB, ids[i]), -1);
    if (i % 8 == 3) {
      ck_assert_ptr_eq(now, before[i]); /* locked: never moved */
      ck_assert_int_eq(gmb_unlock(c, ids[i]), 0);
    } else if (now != before[i]) {
      moved++;
    }
    ck_assert_int_eq(gmb_unlock(c, ids[i]), 0);
  }
  ck_assert_int_gt(moved, 0);
  /* Unlocked now: the next compaction may move them, and the bytes go
   * with them. */
  ck_assert_int_eq(harness_admin_compact(admin, "still", &st), 0);
  for (int i = 3; i < PIN_N; i += 4) {
    void *now;
    ck_assert_int_eq(gmb_lock(c, ids[i], &now), 0);
    ck_assert_int_eq(harness_pattern_check(now, 16 * KIB, ids[i]), -1);
    ck_assert_int_eq(gmb_unlock(c, ids[i]), 0);
  }
  harness_raw_close(admin);
  gmb_disconnect(c);
  harness_broker_stop(&b);
}
END_TEST

int main(void) {
  return harness_main(HARNESS_SUITE(
      "compaction", "locks", 300,
      locked_address_survives_compaction,
      kill_9_holder_memory_returns,
      locks_hold_under_compaction));
}
