/*
 * test_policy.c - the tenancy policy against a real broker: tokens (by
 * GMB_TOKEN and GMB_TOKEN_FILE) and uids, reservations kept from other
 * tenants, and the wait queue (priority then arrival, a large request at
 * the head not overtaken by smaller ones, timeouts, a waiter that dies).
 *
 * Waiters are child processes blocked in gmb_alloc_wait.  The order of
 * arrival is made certain by starting each only after the broker logged
 * that the previous one waits; the order of service by freeing room for
 * exactly one waiter at a time and reading, through a pipe, which child
 * got it.  Nothing is timed: a wrong order shows as a wrong letter.
 */
#include <check.h>
#include <openssl/evp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "gmb.h"
#include "harness.h"

#define MIB (UINT64_C(1) << 20)

static const char TOKEN[] = "policy-token-7f3a9c";

static void sha256_hex(const char *s, char out[65]) {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int n = 0;
  ck_assert_int_eq(EVP_Digest(s, strlen(s), md, &n, EVP_sha256(), NULL), 1);
  ck_assert_uint_eq(n, 32);
  for (unsigned i = 0; i < n; i++) sprintf(out + 2 * i, "%02x", md[i]);
}

/* How many times `needle` is in the broker's log. */
static int log_count(const struct harness_broker *b, const char *needle) {
  char *log = harness_broker_log(b);
  int n = (int)harness_count(log, needle);
  free(log);
  return n;
}

struct log_wait {
  const struct harness_broker *b;
  const char *needle;
  int n;
};

static int log_reached(void *arg) {
  struct log_wait *w = arg;
  return log_count(w->b, w->needle) >= w->n;
}

/* Waits until the broker logged `needle` n times; fails the test if not. */
static void log_wait_for(const struct harness_broker *b, const char *needle,
                         int n) {
  struct log_wait w = {b, needle, n};
  if (!harness_poll_until(log_reached, &w, HARNESS_WAIT_MS)) {
    harness_broker_dump_log(b);
    ck_abort_msg("the broker never logged '%s' %d times", needle, n);
  }
}

/* --- tokens and uids ------------------------------------------------------ */

struct tok_child {
  const char *endpoint;
  const char *tenant;
  const char *token;      /* GMB_TOKEN, or NULL */
  const char *token_file; /* GMB_TOKEN_FILE, or NULL */
  int expect;
};

static int tok_child_main(void *arg) {
  struct tok_child *a = arg;
  unsetenv("GMB_TOKEN");
  unsetenv("GMB_TOKEN_FILE");
  if (a->token) setenv("GMB_TOKEN", a->token, 1);
  if (a->token_file) setenv("GMB_TOKEN_FILE", a->token_file, 1);
  gmb_client *c = NULL;
  int rc = gmb_connect(a->endpoint, a->tenant, &c);
  CHILD_CHECK(rc == a->expect, 10, "gmb_connect(%s) = %s, expected %s: %s",
              a->tenant, gmb_err_name(rc), gmb_err_name(a->expect),
              gmb_last_error(NULL));
  if (rc != 0) {
    const char *why = gmb_last_error(NULL);
    CHILD_CHECK(strstr(why, "may not act as tenant") != NULL, 11,
                "refusal says: %s", why);
    /* A refusal never repeats what was sent. */
    CHILD_CHECK(a->token == NULL || strstr(why, a->token) == NULL, 12,
                "refusal echoes the token: %s", why);
    return 0;
  }
  gmb_id id = 0;
  rc = gmb_alloc(c, MIB, 0, &id);
  CHILD_CHECK(rc == 0, 13, "gmb_alloc = %s: %s", gmb_err_name(rc),
              gmb_last_error(c));
  gmb_disconnect(c);
  return 0;
}

static void tok_expect(const struct harness_broker *b, const char *tenant,
                       const char *token, const char *token_file,
                       int expect) {
  struct tok_child a = {b->endpoint, tenant, token, token_file, expect};
  int code = harness_wait(harness_fork(tok_child_main, &a));
  ck_assert_msg(code == 0, "client of %s (token %s, file %s) ended with %d",
                tenant, token ? token : "-", token_file ? token_file : "-",
                code);
}

START_TEST(token_and_uid_admission) {
  char hex[65], config[512];
  sha256_hex(TOKEN, hex);
  /* "tok": uid 4242 or the token; "byuid": this test's uid only. */
  snprintf(config, sizeof config,
           "[tenant:tok]\ntoken_sha256 = %s\nuids = 4242\n"
           "[tenant:byuid]\nuids = %u\n",
           hex, (unsigned)geteuid());
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", config);
  char right_file[128], wrong_file[128], line[128];
  snprintf(right_file, sizeof right_file, "%s/token", b.dir);
  snprintf(wrong_file, sizeof wrong_file, "%s/token.bad", b.dir);
  snprintf(line, sizeof line, "%s\n", TOKEN); /* as an editor saves it */
  harness_write_file(right_file, line);
  harness_write_file(wrong_file, "policy-token-7f3a9d\n");

  tok_expect(&b, "tok", TOKEN, NULL, 0);
  tok_expect(&b, "tok", NULL, right_file, 0);
  tok_expect(&b, "tok", "policy-token-7f3a9d", NULL, GMB_E_AUTH);
  tok_expect(&b, "tok", NULL, wrong_file, GMB_E_AUTH);
  tok_expect(&b, "tok", NULL, NULL, GMB_E_AUTH);
  /* A listed uid needs no token, and a token does not hurt it. */
  tok_expect(&b, "byuid", NULL, NULL, 0);
  tok_expect(&b, "byuid", TOKEN, NULL, 0);
  /* Nor does the broker's log ever show a token. */
  ck_assert_int_eq(log_count(&b, TOKEN), 0);
  ck_assert_int_eq(log_count(&b, "policy-token-7f3a9d"), 0);
  ck_assert_int_ge(log_count(&b, "does not match"), 2);
  harness_broker_stop(&b);
}
END_TEST

/* --- reservations ------------------------------------------------------- */

START_TEST(reservation_kept_from_others) {
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB",
                       "[tenant:keep]\nreserve = 32MiB\n[tenant:greedy]\n");
  gmb_client *g = harness_connect_ok(&b, "greedy");
  gmb_id ids[4];
  for (int i = 0; i < 4; i++) ids[i] = harness_alloc_ok(g, 8 * MIB);
  gmb_id none = 0;
  int rc = gmb_alloc(g, 8 * MIB, 0, &none);
  ck_assert_msg(rc == GMB_E_NOMEM, "a 5th 8 MiB = %s: %s", gmb_err_name(rc),
                gmb_last_error(g));
  const char *why = gmb_last_error(g);
  ck_assert_msg(strstr(why, "tenant keep's reservation of 32MiB, of which "
                       "32MiB still unused") != NULL, "message: %s", why);
  /* A small one would need a new segment too: refused the same way. */
  ck_assert_int_eq(gmb_alloc(g, 4096, 0, &none), GMB_E_NOMEM);
  gmb_stats st;
  ck_assert_int_eq(gmb_tenant_stats(g, &st), 0);
  ck_assert_uint_eq(st.used, 32 * MIB);
  ck_assert_uint_eq(st.segments, 32 * MIB); /* nothing left over */

  /* The owner gets its 32 MiB, in one piece. */
  gmb_client *k = harness_connect_ok(&b, "keep");
  gmb_id mine = harness_alloc_ok(k, 32 * MIB);
  /* Beyond its reservation it is refused like anyone: the device is
   * full. */
  ck_assert_int_eq(gmb_alloc(k, 8 * MIB, 0, &none), GMB_E_NOMEM);
  ck_assert_int_eq(gmb_free(k, mine), 0);
  for (int i = 0; i < 4; i++) ck_assert_int_eq(gmb_free(g, ids[i]), 0);
  gmb_disconnect(k);
  gmb_disconnect(g);
  harness_broker_stop(&b);
}
END_TEST

/* --- the wait queue ------------------------------------------------------ */

struct waiter_child {
  const char *endpoint;
  const char *tenant;
  uint64_t size;
  int timeout_ms;
  int expect;   /* what gmb_alloc_wait must return */
  char letter;  /* sent on out_w when it returns as expected */
  int out_w;
  int hold_r;   /* EOF: let go and exit */
  int hold_w;   /* the parent's end, closed here */
};

static int waiter_child_main(void *arg) {
  struct waiter_child *a = arg;
  close(a->hold_w);
  gmb_client *c = NULL;
  int rc = gmb_connect(a->endpoint, a->tenant, &c);
  CHILD_CHECK(rc == 0, 10, "gmb_connect(%s) = %s", a->tenant,
              gmb_err_name(rc));
  gmb_id id = 0;
  rc = gmb_alloc_wait(c, a->size, 0, a->timeout_ms, &id);
  CHILD_CHECK(rc == a->expect, 11, "%c: gmb_alloc_wait = %s, expected %s: %s",
              a->letter, gmb_err_name(rc), gmb_err_name(a->expect),
              gmb_last_error(c));
  CHILD_CHECK(harness_pipe_send(a->out_w, a->letter) == 0, 12, "pipe");
  /* Keep the memory until the parent is done: freeing it would serve the
   * next waiter out of the order under test. */
  harness_pipe_wait(a->hold_r, 6 * HARNESS_WAIT_MS);
  gmb_disconnect(c);
  return 0;
}

struct queue_test {
  struct harness_broker b;
  int out[2], hold[2];
  pid_t kids[8];
  int n_kids;
  int queued; /* "wait for memory" lines expected in the log so far */
};

static void queue_start(struct queue_test *q, const char *config) {
  memset(q, 0, sizeof *q);
  harness_broker_start(&q->b, "host:64MiB", config);
  ck_assert_int_eq(pipe(q->out), 0);
  ck_assert_int_eq(pipe(q->hold), 0);
}

/* Starts a waiter; when `queued`, returns once the broker queued it. */
static pid_t queue_waiter(struct queue_test *q, const char *tenant,
                          uint64_t size, int timeout_ms, int expect,
                          char letter, int queued) {
  struct waiter_child a = {q->b.endpoint, tenant,    size,        timeout_ms,
                           expect,        letter,    q->out[1],   q->hold[0],
                           q->hold[1]};
  pid_t pid = harness_fork(waiter_child_main, &a);
  q->kids[q->n_kids++] = pid;
  if (queued) log_wait_for(&q->b, "wait for memory", ++q->queued);
  return pid;
}

/* The letter of the next waiter served (or timed out as expected). */
static char queue_next(struct queue_test *q) {
  int c = harness_pipe_wait(q->out[0], HARNESS_WAIT_MS);
  if (c < 0) harness_broker_dump_log(&q->b);
  ck_assert_msg(c >= 0, "no waiter was served");
  return (char)c;
}

/* Lets every waiter go and checks they all ended well. */
static void queue_end(struct queue_test *q) {
  close(q->hold[1]);
  for (int i = 0; i < q->n_kids; i++) {
    if (q->kids[i] == 0) continue;
    int code = harness_wait(q->kids[i]);
    ck_assert_msg(code == 0, "waiter %d ended with %d", i, code);
  }
  close(q->hold[0]);
  close(q->out[0]);
  close(q->out[1]);
  harness_broker_stop(&q->b);
}

START_TEST(queue_priority_then_arrival) {
  struct queue_test q;
  queue_start(&q, "[tenant:lo]\npriority = 0\n[tenant:mid]\npriority = 5\n"
                  "[tenant:hi]\npriority = 10\n[tenant:fill]\n");
  gmb_client *f = harness_connect_ok(&q.b, "fill");
  gmb_id fill[4];
  for (int i = 0; i < 4; i++) fill[i] = harness_alloc_ok(f, 16 * MIB);
  /* Arrival: lo '1', lo '2', hi 'H', mid 'M'. */
  queue_waiter(&q, "lo", 16 * MIB, -1, 0, '1', 1);
  queue_waiter(&q, "lo", 16 * MIB, -1, 0, '2', 1);
  queue_waiter(&q, "hi", 16 * MIB, -1, 0, 'H', 1);
  queue_waiter(&q, "mid", 16 * MIB, -1, 0, 'M', 1);
  /* Each free makes room for exactly one of them. */
  const char order[] = "HM12";
  for (int i = 0; i < 4; i++) {
    ck_assert_int_eq(gmb_free(f, fill[i]), 0);
    char got = queue_next(&q);
    ck_assert_msg(got == order[i], "served %d: '%c', expected '%c' (order "
                  "%s)", i, got, order[i], order);
  }
  gmb_disconnect(f);
  queue_end(&q);
}
END_TEST

START_TEST(queue_head_not_starved_by_smaller) {
  struct queue_test q;
  queue_start(&q, "[tenant:big]\n[tenant:small]\nquota = 16MiB\n"
                  "[tenant:fill]\n");
  gmb_client *f = harness_connect_ok(&q.b, "fill");
  gmb_id fill[8];
  for (int i = 0; i < 8; i++) fill[i] = harness_alloc_ok(f, 8 * MIB);
  queue_waiter(&q, "big", 32 * MIB, -1, 0, 'B', 1);
  queue_waiter(&q, "small", 8 * MIB, -1, 0, '1', 1);
  /* Behind a held-back head, a request over its quota is still refused
   * at once, not queued. */
  gmb_client *sq = harness_connect_ok(&q.b, "small");
  gmb_id none = 0;
  int rc = gmb_alloc_wait(sq, 24 * MIB, 0, HARNESS_WAIT_MS, &none);
  ck_assert_msg(rc == GMB_E_QUOTA, "over the quota = %s: %s",
                gmb_err_name(rc), gmb_last_error(sq));
  gmb_disconnect(sq);
  /* 8 MiB free would serve '1'; it must not pass the big one. */
  ck_assert_int_eq(gmb_free(f, fill[0]), 0);
  /* Nor may a new waiter that finds 8 MiB free: it joins the queue. */
  queue_waiter(&q, "small", 8 * MIB, -1, 0, '2', 1);
  for (int i = 1; i < 4; i++) ck_assert_int_eq(gmb_free(f, fill[i]), 0);
  char got = queue_next(&q);
  ck_assert_msg(got == 'B', "'%c' was served before the head 'B'", got);
  ck_assert_int_eq(gmb_free(f, fill[4]), 0);
  ck_assert_int_eq(queue_next(&q), '1');
  ck_assert_int_eq(gmb_free(f, fill[5]), 0);
  ck_assert_int_eq(queue_next(&q), '2');
  gmb_disconnect(f);
  queue_end(&q);
}
END_TEST

START_TEST(queue_reserved_memory_not_held_back) {
  /* A request within its tenant's reservation is served behind a blocked
   * head: that memory is its own, the head could never have had it. */
  struct queue_test q;
  queue_start(&q, "[tenant:big]\n[tenant:keep]\nreserve = 8MiB\n"
                  "[tenant:fill]\n");
  gmb_client *f = harness_connect_ok(&q.b, "fill");
  gmb_id fill[6];
  for (int i = 0; i < 6; i++) fill[i] = harness_alloc_ok(f, 8 * MIB);
  /* 16 MiB free, 8 of them kept for keep: big waits. */
  queue_waiter(&q, "big", 16 * MIB, -1, 0, 'B', 1);
  gmb_client *k = harness_connect_ok(&q.b, "keep");
  gmb_id kid = 0;
  int rc = gmb_alloc_wait(k, 8 * MIB, 0, HARNESS_WAIT_MS, &kid);
  ck_assert_msg(rc == 0, "keep's own 8 MiB = %s: %s", gmb_err_name(rc),
                gmb_last_error(k));
  ck_assert_int_eq(gmb_free(k, kid), 0);
  ck_assert_int_eq(gmb_free(f, fill[0]), 0);
  ck_assert_int_eq(queue_next(&q), 'B');
  gmb_disconnect(k);
  gmb_disconnect(f);
  queue_end(&q);
}
END_TEST

START_TEST(queue_timeout_frees_the_way) {
  struct queue_test q;
  queue_start(&q, "[tenant:big]\n[tenant:small]\n[tenant:fill]\n");
  gmb_client *f = harness_connect_ok(&q.b, "fill");
  gmb_id fill[8];
  for (int i = 0; i < 8; i++) fill[i] = harness_alloc_ok(f, 8 * MIB);
  queue_waiter(&q, "big", 32 * MIB, 1500, GMB_E_TIMEOUT, 'T', 1);
  ck_assert_int_eq(gmb_free(f, fill[0]), 0);
  /* Queued behind the head (or, should the head be gone already, served
   * at once): either way it is served, with no further free. */
  queue_waiter(&q, "small", 8 * MIB, -1, 0, 'S', 0);
  char a = queue_next(&q), b2 = queue_next(&q);
  ck_assert_msg((a == 'T' && b2 == 'S') || (a == 'S' && b2 == 'T'),
                "got '%c' then '%c'", a, b2);
  gmb_disconnect(f);
  queue_end(&q);
}
END_TEST

START_TEST(queue_dead_waiter_leaves) {
  struct queue_test q;
  queue_start(&q, "[tenant:gone]\n[tenant:next]\n[tenant:fill]\n");
  gmb_client *f = harness_connect_ok(&q.b, "fill");
  gmb_id fill[4];
  for (int i = 0; i < 4; i++) fill[i] = harness_alloc_ok(f, 16 * MIB);
  /* The head wants 32 MiB and holds back 'N' behind it. */
  pid_t gone = queue_waiter(&q, "gone", 32 * MIB, -1, 0, 'G', 1);
  queue_waiter(&q, "next", 16 * MIB, -1, 0, 'N', 1);
  ck_assert_int_eq(gmb_free(f, fill[0]), 0);
  /* Its process dies: it leaves the queue, and the 16 MiB that were free
   * all along go to 'N' with no further free. */
  ck_assert_int_eq(kill(gone, SIGKILL), 0);
  ck_assert_int_eq(harness_wait(gone), 128 + SIGKILL);
  q.kids[0] = 0;
  ck_assert_int_eq(queue_next(&q), 'N');
  char ended[64];
  snprintf(ended, sizeof ended, "pid %d) ended", (int)gone);
  log_wait_for(&q.b, ended, 1);
  /* More room now is not given to the dead session (the broker's checks
   * would see memory charged to a session that is gone). */
  ck_assert_int_eq(gmb_free(f, fill[1]), 0);
  ck_assert_int_eq(gmb_free(f, fill[2]), 0);
  gmb_id later = harness_alloc_ok(f, 32 * MIB);
  ck_assert_int_eq(gmb_free(f, later), 0);
  gmb_disconnect(f);
  queue_end(&q);
}
END_TEST

int main(void) {
  return harness_main(HARNESS_SUITE(
      "policy", "core", 120,
      token_and_uid_admission,
      reservation_kept_from_others,
      queue_priority_then_arrival,
      queue_head_not_starved_by_smaller,
      queue_reserved_memory_not_held_back,
      queue_timeout_frees_the_way,
      queue_dead_waiter_leaves));
}
