/*
 * test_quota_hold.c - a tenant's quota held by its own idle cache, across
 * processes, against a real broker on the host device: process A of
 * tenant qh fills the quota through its cache (gmb_malloc_async) and frees
 * every block, so the bytes stay cached, counted against the quota; then
 * process B of the same tenant asks for memory with gmb_alloc_wait or
 * gmb_alloc.  The broker asks A's cache for the bytes (EVENT_TRIM) and
 * holds B's request until A's library thread gave them back, then serves
 * it.  Bytes that A really uses (not cached) are refused at once; an A
 * that cannot answer (stopped) delays B no longer than the bound
 * (trim_wait_ms), and an A killed while B waits frees B at once.
 *
 * Each process is a real one (harness_fork); B reports its result through
 * its exit status (0, or the GMB_E_* code negated).  No test asserts a
 * duration: where promptness is the point, the bound is set far above
 * what a loaded machine needs (trim_wait_ms = 5000), so that an outcome
 * reached only at the bound would be a different outcome (GMB_E_QUOTA
 * rather than served), and every wait of the test itself is bounded
 * (HARNESS_WAIT_MS, and the suite's time limit).
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
#define QUOTA (64 * MIB)
#define BLOCK (8 * MIB)
#define ASK (32 * MIB) /* what B asks: half the quota */

/* The config of every test: tenant qh's quota, and the broker's bound on
 * asks ("" for the default). */
static void start(struct harness_broker *b, const char *trim_wait) {
  char ini[256];
  snprintf(ini, sizeof ini, "[broker]\n%s[tenant:qh]\nquota = 64MiB\n",
           trim_wait);
  harness_broker_start(b, "host:256MiB", ini);
}

/* --- process A: fills the quota through its cache -------------------------- */

struct filler_arg {
  const char *endpoint;
  int keep; /* 1: keep the blocks in use; 0: free them all (cached) */
  int ready;
};

/* Allocates BLOCK-sized blocks until the quota refuses one (the refusal
 * must be GMB_E_QUOTA), frees them or keeps them, says so, and idles:
 * from then on only its library thread acts for it. */
static int filler_child(void *arg) {
  struct filler_arg *a = arg;
  gmb_client *c;
  CHILD_CHECK(gmb_connect(a->endpoint, "qh", &c) == 0, 40, "%s",
              gmb_last_error(NULL));
  void *p[QUOTA / BLOCK + 1];
  int n = 0, rc = 0;
  while (n < (int)(sizeof p / sizeof p[0]) &&
         (rc = gmb_malloc_async(c, BLOCK, NULL, &p[n])) == 0)
    n++;
  CHILD_CHECK(rc == GMB_E_QUOTA, 41, "block %d: %s", n, gmb_last_error(c));
  CHILD_CHECK(n > 0, 42, "not one block of the quota");
  if (!a->keep)
    for (int i = 0; i < n; i++)
      CHILD_CHECK(gmb_free_async(c, p[i], NULL) == 0, 43, "%s",
                  gmb_last_error(c));
  harness_pipe_send(a->ready, 'r');
  for (;;) pause();
}

struct filler {
  pid_t pid;
  int fds[2];
  struct filler_arg arg;
};

/* The broker's view of tenant qh. */
static struct wire_tenant_row row_of(const struct harness_broker *b) {
  struct wire_tenant_row r;
  int rc = harness_tenant_row(b, "qh", &r);
  ck_assert_msg(rc == 0, "tenant row of qh: %d", rc);
  return r;
}

struct settled {
  const struct harness_broker *b;
  int keep;
};

/* A's figures reached the broker: all of its bytes cached (its library
 * thread reports them), or none when it keeps them in use. */
static int filler_settled(void *arg) {
  struct settled *s = arg;
  struct wire_tenant_row r = row_of(s->b);
  return r.used > 0 && r.cached == (s->keep ? 0 : r.used);
}

static void filler_start(struct filler *f, struct harness_broker *b,
                         int keep) {
  ck_assert_int_eq(pipe(f->fds), 0);
  f->arg = (struct filler_arg){b->endpoint, keep, f->fds[1]};
  f->pid = harness_fork(filler_child, &f->arg);
  ck_assert_int_eq(harness_pipe_wait(f->fds[0], HARNESS_WAIT_MS), 'r');
  struct settled s = {b, keep};
  ck_assert_msg(harness_poll_until(filler_settled, &s, HARNESS_WAIT_MS),
                "the broker does not see A's %s bytes",
                keep ? "used" : "cached");
  /* The premise: B's request passes the quota while A holds its bytes,
   * and fits once A's cache gave them back. */
  struct wire_tenant_row r = row_of(b);
  ck_assert_uint_gt(r.used + ASK, QUOTA);
  ck_assert_uint_le(r.used, QUOTA);
  ck_assert_uint_eq(r.trim_asks, 0);
}

/* 1 once process *pid is stopped (state T in /proc): a SIGSTOP is
 * delivered when the process next runs, not when kill() returns, and A
 * must not answer an ask after it. */
static int is_stopped(void *arg) {
  char path[64], buf[256];
  snprintf(path, sizeof path, "/proc/%d/stat", (int)*(pid_t *)arg);
  FILE *fp = fopen(path, "r");
  if (fp == NULL) return 0;
  size_t n = fread(buf, 1, sizeof buf - 1, fp);
  fclose(fp);
  buf[n] = 0;
  const char *end = strrchr(buf, ')'); /* the name may hold anything */
  return end && end[1] == ' ' && end[2] == 'T';
}

static void filler_stop(struct filler *f) {
  ck_assert_int_eq(kill(f->pid, SIGSTOP), 0);
  ck_assert_msg(harness_poll_until(is_stopped, &f->pid, HARNESS_WAIT_MS),
                "A (pid %d) did not stop", (int)f->pid);
}

static void filler_end(struct filler *f) {
  if (f->pid > 0) {
    kill(f->pid, SIGKILL);
    harness_wait(f->pid);
  }
  close(f->fds[0]);
  close(f->fds[1]);
}

/* --- process B: asks for half the quota ------------------------------------ */

struct asker_arg {
  const char *endpoint;
  int timeout_ms; /* gmb_alloc_wait's; 0: gmb_alloc */
  const char *must_say;     /* a refusal's text must contain it (or NULL) */
  const char *must_not_say; /* ... must not contain it (or NULL) */
};

/* 0 when served (and the memory is written and freed), else the GMB_E_*
 * code negated; 40 and up: the child's own setup failed. */
static int asker_child(void *arg) {
  struct asker_arg *a = arg;
  gmb_client *c;
  CHILD_CHECK(gmb_connect(a->endpoint, "qh", &c) == 0, 40, "%s",
              gmb_last_error(NULL));
  gmb_id id;
  int rc = a->timeout_ms ? gmb_alloc_wait(c, ASK, 0, a->timeout_ms, &id)
                         : gmb_alloc(c, ASK, 0, &id);
  if (rc == 0) {
    void *p;
    CHILD_CHECK(gmb_lock(c, id, &p) == 0, 41, "%s", gmb_last_error(c));
    memset(p, 0x5a, ASK);
    CHILD_CHECK(gmb_unlock(c, id) == 0, 42, "%s", gmb_last_error(c));
    CHILD_CHECK(gmb_free(c, id) == 0, 43, "%s", gmb_last_error(c));
  } else {
    const char *why = gmb_last_error(c);
    fprintf(stderr, "asker %d: %s\n", (int)getpid(), why);
    CHILD_CHECK(a->must_say == NULL || strstr(why, a->must_say), 44,
                "the refusal does not say '%s'", a->must_say);
    CHILD_CHECK(a->must_not_say == NULL || !strstr(why, a->must_not_say),
                45, "the refusal says '%s'", a->must_not_say);
  }
  gmb_disconnect(c);
  return -rc;
}

static int log_has(const struct harness_broker *b, const char *what) {
  char *log = harness_broker_log(b);
  int yes = strstr(log, what) != NULL;
  free(log);
  return yes;
}

/* --- the tests --------------------------------------------------------------- */

/* The quota sits in A's idle cache: B's request is held and served once
 * A's library thread gave the bytes back, with gmb_alloc_wait and with a
 * plain gmb_alloc alike; the quota is never passed. */
static void cached_quota_served(int timeout_ms) {
  struct harness_broker b;
  start(&b, "trim_wait_ms = 5000\n");
  struct filler a;
  filler_start(&a, &b, 0);
  struct asker_arg q = {b.endpoint, timeout_ms, NULL, NULL};
  pid_t asker = harness_fork(asker_child, &q);
  ck_assert_int_eq(harness_wait(asker), 0);
  struct wire_tenant_row r = row_of(&b);
  ck_assert_uint_ge(r.trim_asks, 1);
  ck_assert_uint_eq(r.trim_ignored, 0);
  ck_assert_uint_le(r.peak, QUOTA);
  ck_assert_uint_eq(r.waiting, 0);
  ck_assert(log_has(&b, "pass the tenant's quota"));
  filler_end(&a);
  harness_broker_stop(&b);
}

START_TEST(cached_quota_alloc_wait_served) { cached_quota_served(60000); }
END_TEST

START_TEST(cached_quota_plain_alloc_served) { cached_quota_served(0); }
END_TEST

/* A keeps its blocks in use: nothing is cached, so nothing is asked and
 * B's gmb_alloc_wait is refused GMB_E_QUOTA at once (not held: the
 * refusal does not say it was, and no ask was sent). */
START_TEST(in_use_quota_refused_at_once) {
  struct harness_broker b;
  start(&b, "trim_wait_ms = 5000\n");
  struct filler a;
  filler_start(&a, &b, 1);
  struct asker_arg q = {b.endpoint, 60000, "quota", "held"};
  pid_t asker = harness_fork(asker_child, &q);
  ck_assert_int_eq(harness_wait(asker), -GMB_E_QUOTA);
  struct wire_tenant_row r = row_of(&b);
  ck_assert_uint_eq(r.trim_asks, 0);
  ck_assert_uint_eq(r.waiting, 0);
  filler_end(&a);
  harness_broker_stop(&b);
}
END_TEST

static int b_waits(void *arg) { return row_of(arg).waiting == 1; }

/* A is stopped (its library thread cannot answer) and B's request waits
 * on it; then A is killed: its memory is freed with its session, and that
 * serves B, long before the bound would have refused it. */
START_TEST(asked_process_killed_while_b_waits) {
  struct harness_broker b;
  start(&b, "trim_wait_ms = 5000\n");
  struct filler a;
  filler_start(&a, &b, 0);
  filler_stop(&a);
  struct asker_arg q = {b.endpoint, 60000, NULL, NULL};
  pid_t asker = harness_fork(asker_child, &q);
  ck_assert_msg(harness_poll_until(b_waits, &b, HARNESS_WAIT_MS),
                "B's request is not held");
  ck_assert_uint_eq(row_of(&b).trim_asks, 1);
  ck_assert_int_eq(kill(a.pid, SIGKILL), 0);
  ck_assert_int_eq(harness_wait(a.pid), 128 + SIGKILL);
  a.pid = 0;
  ck_assert_int_eq(harness_wait(asker), 0);
  struct wire_tenant_row r = row_of(&b);
  ck_assert_uint_eq(r.trim_ignored, 0);
  ck_assert_uint_eq(r.sessions, 0);
  ck_assert(!log_has(&b, "did not give back"));
  filler_end(&a);
  harness_broker_stop(&b);
}
END_TEST

/* A reports its cached bytes but never gives them back (stopped): B's
 * gmb_alloc_wait, which would wait a minute for room, is refused
 * GMB_E_QUOTA when the ask's bound passes (the default, 100 ms), saying
 * why; the broker names A in its log and counts the ask as ignored. */
START_TEST(unanswered_ask_refused_at_bound) {
  struct harness_broker b;
  start(&b, "");
  struct filler a;
  filler_start(&a, &b, 0);
  filler_stop(&a);
  struct asker_arg q = {b.endpoint, 60000, "trim_wait_ms", NULL};
  pid_t asker = harness_fork(asker_child, &q);
  ck_assert_int_eq(harness_wait(asker), -GMB_E_QUOTA);
  struct wire_tenant_row r = row_of(&b);
  ck_assert_uint_eq(r.trim_asks, 1);
  ck_assert_uint_eq(r.trim_ignored, 1);
  ck_assert_uint_eq(r.waiting, 0);
  char who[64];
  snprintf(who, sizeof who, "pid %d) did not give back", (int)a.pid);
  ck_assert_msg(log_has(&b, who), "the log does not say '%s'", who);
  ck_assert(harness_broker_alive(&b));
  filler_end(&a);
  harness_broker_stop(&b);
}
END_TEST

int main(void) {
  return harness_main(HARNESS_SUITE(
      "quota_hold", "quota_hold", 60, cached_quota_alloc_wait_served,
      cached_quota_plain_alloc_served, in_use_quota_refused_at_once,
      asked_process_killed_while_b_waits, unanswered_ask_refused_at_bound));
}
