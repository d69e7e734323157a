/*
 * test_sleep_ask.c - sleep and wake across processes, against a real
 * broker on the host device with real client processes: the broker asks an
 * idle job that opted in (its sleep policy) to pause a tag when another
 * job's request finds the device full, serves that request from the pages
 * given back, and the paused job resumes by itself at its next allocation
 * with every byte at its old address; a job of higher priority is not
 * asked; a session that offers bytes and never pauses holds others no
 * longer than the broker's bound; operators pause and resume a tenant
 * (gmbctl pause|resume), and status, tenants, snapshots and metrics show
 * it; the tenant's host_quota refuses an offload past it across its
 * processes; a job killed while paused leaves nothing counted.
 */
#include <check.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gmb.h"
#include "harness.h"
#include "wire.h"

#define MIB (UINT64_C(1) << 20)
#define WEIGHTS (40 * MIB)

/* The child's own checks: a failure exits with the line number. */
#define JOB_CHECK(cond) HARNESS_JOB_CHECK(cond)

/* A job: connects as `tenant`, sets `policy` (NULL: none), puts WEIGHTS
 * bytes in tag "weights" (blocks of several sizes, a pattern each) and
 * says 'r'.  On 'a' it allocates once more with the tag current (which
 * resumes it when it was paused), checks every byte and address, and
 * says 'k' (or 'x' when a byte differs); on 'q' it frees and exits. */
struct job {
  const char *endpoint, *tenant, *policy;
  int in, out;
};

static const size_t job_sz[] = {512, 3 * MIB + 100, 16 * MIB, 70000,
                                WEIGHTS - 19 * MIB - 70612};
#define JOB_N (sizeof job_sz / sizeof job_sz[0])

static int job_main(void *arg) {
  struct job *j = arg;
  gmb_client *c;
  JOB_CHECK(gmb_connect(j->endpoint, j->tenant, &c) == 0);
  if (j->policy) JOB_CHECK(gmb_sleep_policy_set(c, j->policy) == 0);
  void *w[JOB_N];
  JOB_CHECK(gmb_cache_tag(c, "weights") == 0);
  for (size_t i = 0; i < JOB_N; i++) {
    JOB_CHECK(gmb_malloc_async(c, job_sz[i], NULL, &w[i]) == 0);
    harness_pattern_fill(w[i], job_sz[i], i + 7);
  }
  harness_pipe_send(j->out, 'r');
  for (;;) {
    int cmd = harness_pipe_wait(j->in, 60000);
    if (cmd == 'a') {
      void *more;
      int rc = gmb_malloc_async(c, 4096, NULL, &more);
      if (rc) fprintf(stderr, "job %s: %s\n", j->tenant, gmb_last_error(c));
      int bad = rc != 0;
      for (size_t i = 0; !bad && i < JOB_N; i++)
        bad = harness_pattern_check(w[i], job_sz[i], i + 7) >= 0;
      if (rc == 0) gmb_free_async(c, more, NULL);
      harness_pipe_send(j->out, bad ? 'x' : 'k');
    } else {
      break;
    }
  }
  for (size_t i = 0; i < JOB_N; i++) gmb_free_async(c, w[i], NULL);
  gmb_disconnect(c);
  return 0;
}

struct jobrun {
  struct job j;
  int to[2], from[2];
  pid_t pid;
};

/* Starts `fn` (job_main or another job's) and waits for its 'r'. */
static void job_start_main(struct jobrun *r, const struct harness_broker *b,
                           const char *tenant, const char *policy,
                           int (*fn)(void *)) {
  ck_assert_int_eq(pipe(r->to), 0);
  ck_assert_int_eq(pipe(r->from), 0);
  r->j = (struct job){b->endpoint, tenant, policy, r->to[0], r->from[1]};
  r->pid = harness_fork(fn, &r->j);
  ck_assert_int_eq(harness_pipe_wait(r->from[0], HARNESS_WAIT_MS), 'r');
}

static void job_start(struct jobrun *r, const struct harness_broker *b,
                      const char *tenant, const char *policy) {
  job_start_main(r, b, tenant, policy, job_main);
}

static int job_ask(struct jobrun *r, char cmd) {
  harness_pipe_send(r->to[1], cmd);
  return harness_pipe_wait(r->from[0], HARNESS_WAIT_MS);
}

static void job_end(struct jobrun *r) {
  harness_pipe_send(r->to[1], 'q');
  ck_assert_int_eq(harness_wait(r->pid), 0);
  for (int i = 0; i < 2; i++) {
    close(r->to[i]);
    close(r->from[i]);
  }
}

/* The admin status row of `tenant` (fails the test when there is none). */
static struct wire_tenant_row row_of(const struct harness_broker *b,
                                     const char *tenant) {
  struct wire_tenant_row r;
  int rc = harness_tenant_row(b, tenant, &r);
  ck_assert_msg(rc == 0, "no row for tenant %s: %s", tenant,
                gmb_err_name(rc));
  return r;
}

/* Polls until a session of `tenant` offers [lo, hi] bytes to sleep. */
struct offer_wait {
  const struct harness_broker *b;
  const char *tenant;
  uint64_t lo, hi;
};

static int offer_seen(void *arg) {
  struct offer_wait *o = arg;
  struct wire_reply rep;
  if (harness_admin_status(o->b, &rep)) return 0;
  int seen = 0;
  for (size_t i = 0; i < rep.u.admin_status.n_sessions; i++) {
    const struct wire_session_row *s = &rep.u.admin_status.session_rows[i];
    if (strcmp(s->tenant, o->tenant) == 0 && s->sleep_pausable >= o->lo &&
        s->sleep_pausable <= o->hi)
      seen = 1;
  }
  gmb__wire_reply_clear(&rep);
  return seen;
}

static void wait_offer_of(const struct harness_broker *b, const char *tenant,
                          uint64_t lo, uint64_t hi) {
  struct offer_wait o = {b, tenant, lo, hi};
  ck_assert_msg(harness_poll_until(offer_seen, &o, HARNESS_WAIT_MS),
                "tenant %s never offered %llu to %llu bytes", tenant,
                (unsigned long long)lo, (unsigned long long)hi);
}

static void wait_offer(const struct harness_broker *b, const char *tenant) {
  wait_offer_of(b, tenant, WEIGHTS, UINT64_MAX);
}

/* Polls until `tenant` has `tags` paused tags and holds `used` bytes on
 * the device (a pause is reported before its pages go back). */
struct tags_wait {
  const struct harness_broker *b;
  const char *tenant;
  uint32_t tags;
  uint64_t used;
};

static int tags_seen(void *arg) {
  struct tags_wait *t = arg;
  struct wire_tenant_row r;
  return harness_tenant_row(t->b, t->tenant, &r) == 0 &&
         r.paused_tags == t->tags && r.used == t->used;
}

static void wait_tags(const struct harness_broker *b, const char *tenant,
                      uint32_t tags, uint64_t used) {
  struct tags_wait t = {b, tenant, tags, used};
  ck_assert_msg(harness_poll_until(tags_seen, &t, HARNESS_WAIT_MS),
                "tenant %s never had %u paused tags and %llu bytes used",
                tenant, tags, (unsigned long long)used);
}

static const char *const two_tenants =
    "[broker]\n"
    "sleep_wait_ms = 5000\n"
    "[tenant:idle]\n"
    "priority = 0\n"
    "[tenant:busy]\n"
    "priority = 10\n"
    "[tenant:vip]\n"
    "priority = 20\n";

/* The broker asks an idle job (`fn`, run as job_main is: tag "weights"
 * holds WEIGHTS bytes, 'a' touches the tag and checks every byte) that
 * offers WEIGHTS to offer_hi bytes: the busy job's 48 MiB, which fits
 * only in the pages the weights hold, is served once the job paused, and
 * the job's touch resumes the tag, waiting for the room the busy job
 * frees meanwhile. */
static void ask_idle_job(int (*fn)(void *), uint64_t offer_hi) {
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", two_tenants);
  struct jobrun a;
  job_start_main(&a, &b, "idle", "idle=0,weights", fn);
  wait_offer_of(&b, "idle", WEIGHTS, offer_hi);
  uint64_t idle_used = row_of(&b, "idle").used;
  ck_assert_uint_ge(idle_used, WEIGHTS);

  gmb_client *c = harness_connect_ok(&b, "busy");
  gmb_id big;
  int rc = gmb_alloc(c, 48 * MIB, 0, &big);
  ck_assert_msg(rc == 0, "the busy job was refused: %s", gmb_last_error(c));
  struct wire_tenant_row r = row_of(&b, "idle");
  ck_assert_uint_eq(r.paused_tags, 1);
  ck_assert_uint_ge(r.host_bytes, WEIGHTS);
  ck_assert_uint_ge(r.paused_bytes, WEIGHTS);
  ck_assert_uint_eq(r.sleep_asks, 1);
  ck_assert_uint_eq(r.trim_ignored, 0);
  ck_assert_uint_eq(r.pauses, 1);
  ck_assert_uint_lt(r.used, idle_used);

  harness_pipe_send(a.to[1], 'a');
  harness_sleep_ms(50); /* pace only: the resume may start before or after */
  ck_assert_int_eq(gmb_free(c, big), 0);
  ck_assert_int_eq(harness_pipe_wait(a.from[0], HARNESS_WAIT_MS), 'k');
  r = row_of(&b, "idle");
  ck_assert_uint_eq(r.paused_tags, 0);
  ck_assert_uint_eq(r.host_bytes, 0);
  ck_assert_uint_eq(r.resumes, 1);
  ck_assert_uint_ge(r.used, WEIGHTS);
  gmb_disconnect(c);
  job_end(&a);
  harness_broker_stop(&b);
}

/* Blocks of its cache: the allocation of 'a' resumes the tag. */
START_TEST(broker_asks_idle_job_to_pause) {
  ask_idle_job(job_main, UINT64_MAX);
}
END_TEST

START_TEST(higher_priority_job_not_asked) {
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", two_tenants);
  struct jobrun a;
  job_start(&a, &b, "vip", "idle=0");
  wait_offer(&b, "vip");
  gmb_client *c = harness_connect_ok(&b, "busy");
  gmb_id big;
  ck_assert_int_eq(gmb_alloc(c, 48 * MIB, 0, &big), GMB_E_NOMEM);
  struct wire_tenant_row r = row_of(&b, "vip");
  ck_assert_uint_eq(r.sleep_asks, 0);
  ck_assert_uint_eq(r.paused_tags, 0);
  ck_assert_int_eq(job_ask(&a, 'a'), 'k');
  gmb_disconnect(c);
  job_end(&a);
  harness_broker_stop(&b);
}
END_TEST

/* A session that offers 40 MiB to sleep, holds them, and never answers. */
struct raw {
  void *sock;
  uint64_t next_id;
};

static void raw_request(struct raw *r, struct wire_request *req,
                        struct wire_reply *rep) {
  req->id = ++r->next_id;
  ck_assert_int_eq(harness_raw_call(r->sock, req, rep), 0);
  ck_assert_msg(rep->status == 0, "%s: %s", gmb__wire_kind_name(req->kind),
                rep->message);
  gmb__wire_reply_clear(rep);
}

START_TEST(liar_holds_others_within_the_bound) {
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB",
                       "[broker]\nsleep_wait_ms = 400\n"
                       "[tenant:idle]\npriority = 0\n"
                       "[tenant:busy]\npriority = 10\n");
  struct raw liar = {harness_raw_open(b.endpoint), 0};
  struct wire_request req;
  struct wire_reply rep;
  memset(&req, 0, sizeof req);
  req.kind = WIRE_HELLO;
  req.u.hello.version = WIRE_PROTOCOL_VERSION;
  snprintf(req.u.hello.tenant, sizeof req.u.hello.tenant, "idle");
  raw_request(&liar, &req, &rep);
  memset(&req, 0, sizeof req);
  req.kind = WIRE_ALLOC;
  req.u.alloc.size = WEIGHTS;
  raw_request(&liar, &req, &rep);
  /* The offer rides on a Stats request (a Heartbeat has no reply). */
  memset(&req, 0, sizeof req);
  req.kind = WIRE_STATS;
  req.sleep_pausable = WEIGHTS;
  req.sleep_idle_ms = 3600 * 1000;
  memset(&rep, 0, sizeof rep);
  req.id = ++liar.next_id;
  ck_assert_int_eq(harness_raw_call(liar.sock, &req, &rep), 0);
  gmb__wire_reply_clear(&rep);

  gmb_client *c = harness_connect_ok(&b, "busy");
  gmb_id big;
  /* Asked, held for the bound, then refused: the liar gave nothing. */
  ck_assert_int_eq(gmb_alloc(c, 48 * MIB, 0, &big), GMB_E_NOMEM);
  struct wire_tenant_row r = row_of(&b, "idle");
  ck_assert_uint_eq(r.sleep_asks, 1);
  ck_assert_uint_eq(r.trim_ignored, 1);
  /* In its pause after an ask that gave nothing: not asked again. */
  ck_assert_int_eq(gmb_alloc(c, 48 * MIB, 0, &big), GMB_E_NOMEM);
  ck_assert_uint_eq(row_of(&b, "idle").sleep_asks, 1);
  char *log = harness_broker_log(&b);
  ck_assert_ptr_nonnull(strstr(log, "asked to pause tags"));
  free(log);
  gmb_disconnect(c);
  harness_raw_close(liar.sock);
  harness_broker_stop(&b);
}
END_TEST

/* gmbctl pause/resume: a tenant's tags pause (offload, or discard) and
 * resume from its library's thread; status, tenants, sessions, snapshot
 * and metrics show it. */
struct tagged {
  const char *endpoint;
  int in, out;
};

static int tagged_main(void *arg) {
  struct tagged *t = arg;
  gmb_client *c;
  JOB_CHECK(gmb_connect(t->endpoint, "ops", &c) == 0);
  void *w, *kv;
  JOB_CHECK(gmb_cache_tag(c, "w") == 0);
  JOB_CHECK(gmb_malloc_async(c, 6 * MIB, NULL, &w) == 0);
  harness_pattern_fill(w, 6 * MIB, 3);
  JOB_CHECK(gmb_cache_tag(c, "kv") == 0);
  JOB_CHECK(gmb_malloc_async(c, 4 * MIB, NULL, &kv) == 0);
  harness_pattern_fill(kv, 4 * MIB, 4);
  harness_pipe_send(t->out, 'r');
  /* 'a': an allocation in kv, which an operator paused: refused. */
  JOB_CHECK(harness_pipe_wait(t->in, 60000) == 'a');
  void *x;
  int rc = gmb_malloc_async(c, 512, NULL, &x);
  int said = rc == GMB_E_INVAL && strstr(gmb_last_error(c), "operator");
  harness_pipe_send(t->out, said ? 'i' : 'x');
  /* 'c': after gmbctl resume, w's bytes are all there. */
  JOB_CHECK(harness_pipe_wait(t->in, 60000) == 'c');
  harness_pipe_send(t->out,
                    harness_pattern_check(w, 6 * MIB, 3) < 0 ? 'k' : 'x');
  JOB_CHECK(harness_pipe_wait(t->in, 60000) == 'q');
  gmb_disconnect(c);
  return 0;
}

START_TEST(operator_pause_and_resume) {
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", NULL);
  int to[2], from[2];
  ck_assert_int_eq(pipe(to), 0);
  ck_assert_int_eq(pipe(from), 0);
  struct tagged t = {b.endpoint, to[0], from[1]};
  pid_t kid = harness_fork(tagged_main, &t);
  ck_assert_int_eq(harness_pipe_wait(from[0], HARNESS_WAIT_MS), 'r');
  char out[16384];

  /* Bad arguments: exit 2, nothing sent. */
  ck_assert_int_eq(harness_ctl(&b, out, sizeof out, "pause", NULL), 2);
  ck_assert_int_eq(harness_ctl(&b, out, sizeof out, "pause", "ops", "--tag",
                               NULL), 2);
  ck_assert_int_eq(harness_ctl(&b, out, sizeof out, "resume", "ops",
                               "--discard", NULL), 2);
  ck_assert_int_eq(harness_ctl(&b, out, sizeof out, "pause", "nobody", NULL),
                   1);

  int rc = harness_ctl(&b, out, sizeof out, "pause", "ops", "--tag", "kv",
                       "--discard", NULL);
  ck_assert_msg(rc == 0, "gmbctl pause: %s", out);
  ck_assert_ptr_nonnull(strstr(out, "1 session"));
  wait_tags(&b, "ops", 1, 6 * MIB);
  struct wire_tenant_row r = row_of(&b, "ops");
  ck_assert_uint_eq(r.host_bytes, 0); /* discarded */
  ck_assert_uint_ge(r.paused_bytes, 4 * MIB);
  harness_pipe_send(to[1], 'a');
  ck_assert_int_eq(harness_pipe_wait(from[0], HARNESS_WAIT_MS), 'i');

  /* Every tag: w offloads too. */
  ck_assert_int_eq(harness_ctl(&b, out, sizeof out, "pause", "ops", NULL), 0);
  wait_tags(&b, "ops", 2, 0);
  r = row_of(&b, "ops");
  ck_assert_uint_ge(r.host_bytes, 6 * MIB);
  ck_assert_uint_eq(r.used, 0);
  ck_assert_int_eq(harness_ctl(&b, out, sizeof out, "tenants", NULL), 0);
  ck_assert_ptr_nonnull(strstr(out, "PAUSED-TAGS"));
  ck_assert_int_eq(harness_ctl(&b, out, sizeof out, "status", NULL), 0);
  ck_assert_ptr_nonnull(strstr(out, "paused: kv,w"));
  ck_assert_int_eq(harness_ctl(&b, out, sizeof out, "--json", "sessions",
                               NULL), 0);
  ck_assert_ptr_nonnull(strstr(out, "\"paused\": \"kv,w\""));
  ck_assert_int_eq(harness_ctl(&b, out, sizeof out, "snapshot", NULL), 0);
  ck_assert_ptr_nonnull(strstr(out, "\"paused_tags\": 2"));
  ck_assert_int_eq(harness_ctl(&b, out, sizeof out, "map", NULL), 0);
  ck_assert_ptr_nonnull(strstr(out, "paused: tenant ops, 2 tags"));
  ck_assert_int_eq(harness_ctl(&b, out, sizeof out, "metrics", NULL), 0);
  ck_assert_ptr_nonnull(strstr(out, "gmb_pauses_total{tenant=\"ops\"} 2"));
  ck_assert_ptr_nonnull(strstr(out, "gmb_tenant_host_bytes{tenant=\"ops\"}"));

  ck_assert_int_eq(harness_ctl(&b, out, sizeof out, "resume", "ops", NULL),
                   0);
  wait_tags(&b, "ops", 0, 10 * MIB);
  harness_pipe_send(to[1], 'c');
  ck_assert_int_eq(harness_pipe_wait(from[0], HARNESS_WAIT_MS), 'k');
  ck_assert_int_eq(harness_ctl(&b, out, sizeof out, "metrics", NULL), 0);
  ck_assert_ptr_nonnull(strstr(out, "gmb_resumes_total{tenant=\"ops\"} 2"));
  harness_pipe_send(to[1], 'q');
  ck_assert_int_eq(harness_wait(kid), 0);
  for (int i = 0; i < 2; i++) {
    close(to[i]);
    close(from[i]);
  }
  harness_broker_stop(&b);
}
END_TEST

/* host_quota is the tenant's, over all its processes: two sessions of it
 * offload 4 MiB each against a quota of 6 MiB; the second is refused,
 * nothing lost, and a discard still passes. */
START_TEST(host_quota_across_sessions) {
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", "[tenant:h]\nhost_quota = 6MiB\n");
  gmb_client *c[2];
  void *p[2];
  for (int i = 0; i < 2; i++) {
    c[i] = harness_connect_ok(&b, "h");
    ck_assert_int_eq(gmb_cache_tag(c[i], "t"), 0);
    ck_assert_int_eq(gmb_malloc_async(c[i], 3 * MIB, NULL, &p[i]), 0);
    harness_pattern_fill(p[i], 3 * MIB, (uint64_t)i + 1);
  }
  ck_assert_int_eq(gmb_pause(c[0], "t", GMB_PAUSE_OFFLOAD), 0);
  int rc = gmb_pause(c[1], "t", GMB_PAUSE_OFFLOAD);
  ck_assert_msg(rc == GMB_E_LIMIT, "second offload: %s (%s)",
                gmb_err_name(rc), gmb_last_error(c[1]));
  ck_assert_ptr_nonnull(strstr(gmb_last_error(c[1]), "host_quota"));
  /* Refused before anything moved: its bytes are where they were. */
  ck_assert_int_lt(harness_pattern_check(p[1], 3 * MIB, 2), 0);
  struct wire_tenant_row r = row_of(&b, "h");
  ck_assert_uint_eq(r.host_quota, 6 * MIB);
  ck_assert_uint_eq(r.host_bytes, 4 * MIB);
  ck_assert_uint_eq(r.paused_tags, 1);
  ck_assert_int_eq(gmb_pause(c[1], "t", GMB_PAUSE_DISCARD), 0);
  ck_assert_uint_eq(row_of(&b, "h").paused_tags, 2);
  ck_assert_int_eq(gmb_resume(c[0], "t"), 0);
  ck_assert_int_lt(harness_pattern_check(p[0], 3 * MIB, 1), 0);
  ck_assert_int_eq(gmb_resume(c[1], "t"), 0);
  r = row_of(&b, "h");
  ck_assert_uint_eq(r.paused_tags, 0);
  ck_assert_uint_eq(r.host_bytes, 0);
  for (int i = 0; i < 2; i++) gmb_disconnect(c[i]);
  harness_broker_stop(&b);
}
END_TEST

/* A job killed while paused: the broker forgets its paused tags and the
 * tenant holds nothing. */
static int paused_then_wait(void *arg) {
  struct tagged *t = arg;
  gmb_client *c;
  JOB_CHECK(gmb_connect(t->endpoint, "k", &c) == 0);
  void *w;
  JOB_CHECK(gmb_cache_tag(c, "w") == 0);
  JOB_CHECK(gmb_malloc_async(c, 8 * MIB, NULL, &w) == 0);
  JOB_CHECK(gmb_pause(c, "w", GMB_PAUSE_OFFLOAD) == 0);
  harness_pipe_send(t->out, 'p');
  harness_pipe_wait(t->in, 60000); /* killed meanwhile */
  return 0;
}

START_TEST(killed_while_paused) {
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", NULL);
  int to[2], from[2];
  ck_assert_int_eq(pipe(to), 0);
  ck_assert_int_eq(pipe(from), 0);
  struct tagged t = {b.endpoint, to[0], from[1]};
  pid_t kid = harness_fork(paused_then_wait, &t);
  ck_assert_int_eq(harness_pipe_wait(from[0], HARNESS_WAIT_MS), 'p');
  struct wire_tenant_row r = row_of(&b, "k");
  ck_assert_uint_eq(r.paused_tags, 1);
  ck_assert_uint_ge(r.host_bytes, 8 * MIB);
  kill(kid, SIGKILL);
  ck_assert_int_eq(harness_wait(kid), 128 + SIGKILL);
  wait_tags(&b, "k", 0, 0);
  r = row_of(&b, "k");
  ck_assert_uint_eq(r.host_bytes, 0);
  ck_assert_uint_eq(r.paused_bytes, 0);
  ck_assert_uint_eq(r.used, 0);
  ck_assert_uint_eq(r.pauses, 1);
  for (int i = 0; i < 2; i++) {
    close(to[i]);
    close(from[i]);
  }
  harness_broker_stop(&b);
}
END_TEST

/* The broker restarts while a tag is paused: the host bytes are the
 * client's and are not persisted (docs/sleep.md); the session is over, a
 * resume fails GMB_E_CONN, and the host copy is kept until disconnect. */
START_TEST(broker_restart_while_paused) {
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", NULL);
  gmb_client *c = harness_connect_ok(&b, "r");
  void *p;
  ck_assert_int_eq(gmb_cache_tag(c, "w"), 0);
  ck_assert_int_eq(gmb_malloc_async(c, 3 * MIB, NULL, &p), 0);
  ck_assert_int_eq(gmb_cache_tag(c, NULL), 0);
  ck_assert_int_eq(gmb_pause(c, "w", GMB_PAUSE_OFFLOAD), 0);
  harness_broker_stop(&b);
  harness_broker_start(&b, "host:64MiB", NULL);
  int rc = gmb_resume(c, "w");
  ck_assert_msg(rc == GMB_E_CONN, "resume after a restart: %s (%s)",
                gmb_err_name(rc), gmb_last_error(c));
  gmb_cache_stats cs;
  ck_assert_int_eq(gmb_cache_stats_get(c, &cs), 0);
  ck_assert_uint_eq(cs.host, 4 * MIB);
  gmb_disconnect(c);
  struct wire_reply rep;
  ck_assert_int_eq(harness_admin_status(&b, &rep), 0);
  ck_assert_uint_eq(rep.u.admin_status.host_bytes, 0);
  gmb__wire_reply_clear(&rep);
  harness_broker_stop(&b);
}
END_TEST

/* A bad policy is refused with its reason, and the client is not made. */
START_TEST(bad_policy_refused) {
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", NULL);
  static const char *const bad[] = {"idle=", "idle=-1", "idle=x", "w:nap",
                                    ":discard", "idle=100000"};
  gmb_client *c = harness_connect_ok(&b, "p");
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    ck_assert_int_eq(gmb_sleep_policy_set(c, bad[i]), GMB_E_INVAL);
    ck_assert_ptr_nonnull(strstr(gmb_last_error(c), "sleep policy"));
  }
  ck_assert_int_eq(gmb_sleep_policy_set(c, "idle=0.5,w,kv:discard"), 0);
  ck_assert_int_eq(gmb_sleep_policy_set(c, "off"), 0);
  gmb_disconnect(c);
  setenv("GMB_SLEEP_POLICY", "w:sometimes", 1);
  ck_assert_int_eq(gmb_connect(b.endpoint, "p", &c), GMB_E_INVAL);
  ck_assert_ptr_nonnull(strstr(gmb_last_error(NULL), "GMB_SLEEP_POLICY"));
  unsetenv("GMB_SLEEP_POLICY");
  harness_broker_stop(&b);
}
END_TEST

/* --- gmb_alloc allocations under a tag -------------------------------- */

/* A job whose memory is gmb_alloc allocations tagged "weights" (sizes
 * summing to WEIGHTS, one movable, a pattern each, written with
 * gmb_write); says 'r'.  On 'a' it locks the first (which resumes the tag
 * when the broker paused it, waiting for room), checks every byte through
 * that pointer and the others with gmb_read, under the ids it was given,
 * and says 'k' (or 'x'); on 'q' it frees and exits. */
static const size_t ajob_sz[] = {24 * MIB, 8 * MIB, 3 * MIB + 100, 70000,
                                 5 * MIB - 70100};
#define AJOB_N (sizeof ajob_sz / sizeof ajob_sz[0])

/* Allocation `i` of n bytes holds pattern `seed`: 1 when every byte
 * matches (read back with gmb_read). */
static int alloc_holds(gmb_client *c, gmb_id id, size_t n, uint64_t seed) {
  char *buf = malloc(n);
  int ok = buf && gmb_read(c, id, 0, buf, n) == 0 &&
           harness_pattern_check(buf, n, seed) < 0;
  free(buf);
  return ok;
}

static int alloc_fill(gmb_client *c, gmb_id id, size_t n, uint64_t seed) {
  char *buf = malloc(n);
  if (buf == NULL) return -1;
  harness_pattern_fill(buf, n, seed);
  int rc = gmb_write(c, id, 0, buf, n);
  free(buf);
  return rc;
}

/* A job's last words: 'k' when ok (else 'x'), then it waits for 'q' and
 * disconnects.  Its exit status. */
static int job_finish(struct job *j, gmb_client *c, int ok) {
  harness_pipe_send(j->out, ok ? 'k' : 'x');
  JOB_CHECK(harness_pipe_wait(j->in, 60000) == 'q');
  gmb_disconnect(c);
  return 0;
}

static int ajob_main(void *arg) {
  struct job *j = arg;
  gmb_client *c;
  JOB_CHECK(gmb_connect(j->endpoint, j->tenant, &c) == 0);
  JOB_CHECK(gmb_sleep_policy_set(c, j->policy) == 0);
  gmb_id w[AJOB_N];
  JOB_CHECK(gmb_cache_tag(c, "weights") == 0);
  for (size_t i = 0; i < AJOB_N; i++) {
    JOB_CHECK(gmb_alloc(c, ajob_sz[i], i == 1 ? GMB_MOVABLE : 0, &w[i]) == 0);
    JOB_CHECK(alloc_fill(c, w[i], ajob_sz[i], i + 40) == 0);
  }
  JOB_CHECK(gmb_cache_tag(c, NULL) == 0);
  harness_pipe_send(j->out, 'r');
  while (harness_pipe_wait(j->in, 60000) == 'a') {
    void *p;
    int rc = gmb_lock(c, w[0], &p);
    if (rc) fprintf(stderr, "job %s: %s\n", j->tenant, gmb_last_error(c));
    int bad = rc != 0 || harness_pattern_check(p, ajob_sz[0], 40) >= 0;
    if (rc == 0) gmb_unlock(c, w[0]);
    for (size_t i = 1; !bad && i < AJOB_N; i++)
      bad = !alloc_holds(c, w[i], ajob_sz[i], i + 40);
    gmb_cache_stats cs;
    bad |= gmb_cache_stats_get(c, &cs) != 0 || cs.host != 0 || cs.paused;
    harness_pipe_send(j->out, bad ? 'x' : 'k');
  }
  for (size_t i = 0; i < AJOB_N; i++) JOB_CHECK(gmb_free(c, w[i]) == 0);
  gmb_disconnect(c);
  return 0;
}

/* The broker asks a job whose memory is tagged gmb_alloc allocations: its
 * library thread offloads and frees them, the other tenant is served from
 * the freed bytes, and the job's gmb_lock resumes the tag by itself, every
 * byte back under the same ids. */
START_TEST(broker_asks_job_of_tagged_allocations) {
  /* The offer is the allocations' bytes (as the broker rounded them):
   * the tag has no cache part. */
  ask_idle_job(ajob_main, WEIGHTS + AJOB_N * 512);
}
END_TEST

/* A job that holds tag "a" (24 MiB) locked and tag "b" (24 MiB) not: it
 * offers only b, and the broker's ask pauses b alone; a's pointer stays
 * good throughout.  'v' checks a through its locked pointer and unlocks
 * it, then locks b (which resumes it) and checks it: 'k' or 'x'. */
static int locked_job_main(void *arg) {
  struct job *j = arg;
  gmb_client *c;
  JOB_CHECK(gmb_connect(j->endpoint, j->tenant, &c) == 0);
  JOB_CHECK(gmb_sleep_policy_set(c, "idle=0,a,b") == 0);
  gmb_id a, bb;
  void *pa, *pb;
  JOB_CHECK(gmb_cache_tag(c, "a") == 0);
  JOB_CHECK(gmb_alloc(c, 24 * MIB, 0, &a) == 0);
  JOB_CHECK(gmb_cache_tag(c, "b") == 0);
  JOB_CHECK(gmb_alloc(c, 24 * MIB, 0, &bb) == 0);
  JOB_CHECK(gmb_cache_tag(c, NULL) == 0);
  JOB_CHECK(gmb_lock(c, a, &pa) == 0);
  harness_pattern_fill(pa, 24 * MIB, 5);
  JOB_CHECK(alloc_fill(c, bb, 24 * MIB, 6) == 0);
  harness_pipe_send(j->out, 'r');
  JOB_CHECK(harness_pipe_wait(j->in, 60000) == 'v');
  int bad = harness_pattern_check(pa, 24 * MIB, 5) >= 0;
  JOB_CHECK(gmb_unlock(c, a) == 0);
  int rc = gmb_lock(c, bb, &pb);
  if (rc) fprintf(stderr, "job %s: %s\n", j->tenant, gmb_last_error(c));
  bad |= rc != 0 || harness_pattern_check(pb, 24 * MIB, 6) >= 0;
  if (rc == 0) gmb_unlock(c, bb);
  return job_finish(j, c, !bad);
}

START_TEST(locked_allocation_during_ask) {
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", two_tenants);
  struct jobrun a;
  job_start_main(&a, &b, "idle", NULL, locked_job_main);
  /* b only: a tag with a locked allocation would refuse its pause. */
  wait_offer_of(&b, "idle", 24 * MIB, 24 * MIB);
  gmb_client *c = harness_connect_ok(&b, "busy");
  gmb_id big;
  int rc = gmb_alloc(c, 24 * MIB, 0, &big);
  ck_assert_msg(rc == 0, "the busy job was refused: %s", gmb_last_error(c));
  struct wire_tenant_row r = row_of(&b, "idle");
  ck_assert_uint_eq(r.paused_tags, 1);
  ck_assert_uint_eq(r.host_bytes, 24 * MIB);
  ck_assert_uint_eq(r.used, 24 * MIB); /* a's */
  harness_pipe_send(a.to[1], 'v');
  harness_sleep_ms(50); /* pace only */
  ck_assert_int_eq(gmb_free(c, big), 0);
  ck_assert_int_eq(harness_pipe_wait(a.from[0], HARNESS_WAIT_MS), 'k');
  ck_assert_uint_eq(row_of(&b, "idle").paused_tags, 0);
  gmb_disconnect(c);
  job_end(&a);
  harness_broker_stop(&b);
}
END_TEST

/* gmbctl pause and resume of a tenant whose tags hold gmb_alloc
 * allocations: "w" (6 MiB and a movable 1 MiB) and "kv" (4 MiB).  'l':
 * a lock of kv's allocation, which an operator paused, is refused ('i');
 * 'c': after gmbctl resume, every byte of w under its ids, kv usable:
 * 'k' or 'x'. */
static int opjob_main(void *arg) {
  struct job *t = arg;
  gmb_client *c;
  JOB_CHECK(gmb_connect(t->endpoint, t->tenant, &c) == 0);
  gmb_id w, wm, kv;
  JOB_CHECK(gmb_cache_tag(c, "w") == 0);
  JOB_CHECK(gmb_alloc(c, 6 * MIB, 0, &w) == 0);
  JOB_CHECK(gmb_alloc(c, 1 * MIB, GMB_MOVABLE, &wm) == 0);
  JOB_CHECK(gmb_cache_tag(c, "kv") == 0);
  JOB_CHECK(gmb_alloc(c, 4 * MIB, 0, &kv) == 0);
  JOB_CHECK(gmb_cache_tag(c, NULL) == 0);
  JOB_CHECK(alloc_fill(c, w, 6 * MIB, 1) == 0);
  JOB_CHECK(alloc_fill(c, wm, 1 * MIB, 2) == 0);
  JOB_CHECK(alloc_fill(c, kv, 4 * MIB, 3) == 0);
  harness_pipe_send(t->out, 'r');
  JOB_CHECK(harness_pipe_wait(t->in, 60000) == 'l');
  void *p;
  int rc = gmb_lock(c, kv, &p);
  int said = rc == GMB_E_INVAL && strstr(gmb_last_error(c), "operator");
  harness_pipe_send(t->out, said ? 'i' : 'x');
  JOB_CHECK(harness_pipe_wait(t->in, 60000) == 'c');
  int ok = alloc_holds(c, w, 6 * MIB, 1) && alloc_holds(c, wm, 1 * MIB, 2) &&
           gmb_lock(c, kv, &p) == 0 && gmb_unlock(c, kv) == 0;
  return job_finish(t, c, ok);
}

START_TEST(operator_pauses_tagged_allocations) {
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", NULL);
  struct jobrun a;
  job_start_main(&a, &b, "opa", NULL, opjob_main);
  char out[16384];
  int rc = harness_ctl(&b, out, sizeof out, "pause", "opa", "--tag", "kv",
                       "--discard", NULL);
  ck_assert_msg(rc == 0, "gmbctl pause: %s", out);
  wait_tags(&b, "opa", 1, 7 * MIB);
  struct wire_tenant_row r = row_of(&b, "opa");
  ck_assert_uint_eq(r.host_bytes, 0); /* discarded */
  ck_assert_uint_eq(r.paused_bytes, 4 * MIB);
  ck_assert_int_eq(job_ask(&a, 'l'), 'i');

  /* Every tag: the broker offloads the movable wm itself first, and the
   * library's pause of w leaves it there (the broker's "(movable)" record
   * is the third paused tag), pausing w's pinned 6 MiB. */
  ck_assert_int_eq(harness_ctl(&b, out, sizeof out, "pause", "opa", NULL), 0);
  wait_tags(&b, "opa", 3, 0);
  r = row_of(&b, "opa");
  ck_assert_uint_eq(r.host_bytes, 7 * MIB);
  ck_assert_uint_eq(r.paused_bytes, 11 * MIB);
  ck_assert_int_eq(harness_ctl(&b, out, sizeof out, "status", NULL), 0);
  ck_assert_msg(strstr(out, "paused: kv,(movable),w") != NULL, "%s", out);

  ck_assert_int_eq(harness_ctl(&b, out, sizeof out, "resume", "opa", NULL),
                   0);
  wait_tags(&b, "opa", 0, 11 * MIB);
  r = row_of(&b, "opa");
  ck_assert_uint_eq(r.host_bytes, 0);
  ck_assert_uint_eq(r.resumes, 2);
  ck_assert_int_eq(job_ask(&a, 'c'), 'k');
  job_end(&a);
  harness_broker_stop(&b);
}
END_TEST

/* Two tags of c's cache: z with a block of 512 bytes (*zp), then w, left
 * current, with a block of 1 MiB (*p) holding pattern 8.  Each has a page,
 * and c's library thread runs (it carries out an operator's asks). */
static void tags_z_and_w(gmb_client *c, void **zp, void **p) {
  ck_assert_int_eq(gmb_cache_tag(c, "z"), 0);
  ck_assert_int_eq(gmb_malloc_async(c, 512, NULL, zp), 0);
  ck_assert_int_eq(gmb_cache_tag(c, "w"), 0);
  ck_assert_int_eq(gmb_malloc_async(c, 1 * MIB, NULL, p), 0);
  harness_pattern_fill(*p, 1 * MIB, 8);
}

/* An operator paused tag w's cache part; the application then allocated
 * in w with gmb_alloc and paused w itself, which host_quota refuses for
 * the allocations: undoing its own pause must leave the operator's alone
 * (the cache part stays paused until gmbctl resume), every byte kept. */
START_TEST(failed_pause_keeps_an_operators_pause) {
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", "[tenant:q]\nhost_quota = 4MiB\n");
  gmb_client *c = harness_connect_ok(&b, "q");
  void *p, *zp;
  tags_z_and_w(c, &zp, &p);
  char out[16384];
  int rc = harness_ctl(&b, out, sizeof out, "pause", "q", "--tag", "w", NULL);
  ck_assert_msg(rc == 0, "gmbctl pause: %s", out);
  /* The library thread pauses w's cache part, tells the broker, then
   * pauses w's allocations (none yet): an allocation in w made between
   * the two would be paused with the operator's pause (past host_quota,
   * refused whole).  A pause of z asked after w's is carried out after
   * it, so once the broker sees z paused, w's pause is done. */
  rc = harness_ctl(&b, out, sizeof out, "pause", "q", "--tag", "z",
                   "--discard", NULL);
  ck_assert_msg(rc == 0, "gmbctl pause: %s", out);
  wait_tags(&b, "q", 2, 0);
  ck_assert_uint_eq(row_of(&b, "q").host_bytes, 2 * MIB); /* w's page */

  gmb_id id;
  rc = gmb_alloc(c, 8 * MIB, 0, &id);
  ck_assert_msg(rc == 0, "alloc in w: %s", gmb_last_error(c));
  ck_assert_int_eq(alloc_fill(c, id, 8 * MIB, 9), 0);
  rc = gmb_pause(c, "w", GMB_PAUSE_OFFLOAD);
  ck_assert_msg(rc == GMB_E_LIMIT, "pause past host_quota: %s (%s)",
                gmb_err_name(rc), gmb_last_error(c));
  /* The operator's pause stands: the cache part is still paused. */
  struct wire_tenant_row r = row_of(&b, "q");
  ck_assert_uint_eq(r.paused_tags, 2);
  ck_assert_uint_eq(r.host_bytes, 2 * MIB);
  ck_assert_uint_eq(r.used, 8 * MIB);
  void *x;
  ck_assert_int_eq(gmb_malloc_async(c, 512, NULL, &x), GMB_E_INVAL);
  ck_assert_ptr_nonnull(strstr(gmb_last_error(c), "operator"));
  ck_assert(alloc_holds(c, id, 8 * MIB, 9));

  ck_assert_int_eq(harness_ctl(&b, out, sizeof out, "resume", "q", NULL), 0);
  wait_tags(&b, "q", 0, 12 * MIB);
  ck_assert_int_lt(harness_pattern_check(p, 1 * MIB, 8), 0);
  ck_assert_int_eq(gmb_free(c, id), 0);
  ck_assert_int_eq(gmb_free_async(c, p, NULL), 0);
  ck_assert_int_eq(gmb_free_async(c, zp, NULL), 0);
  gmb_disconnect(c);
  harness_broker_stop(&b);
}
END_TEST

/* The application pauses a tag an operator paused first: gmb_pause
 * answers 0, and the pause is the application's from then on, so gmbctl
 * resume of every tag leaves it (a lock of its allocation is refused
 * naming gmb_resume, not the operator) until the application's own
 * gmb_resume, which brings every byte back. */
START_TEST(app_pause_claims_an_operators_pause) {
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", NULL);
  gmb_client *c = harness_connect_ok(&b, "q");
  void *p, *zp;
  tags_z_and_w(c, &zp, &p);
  gmb_id id;
  ck_assert_int_eq(gmb_alloc(c, 4 * MIB, 0, &id), 0);
  ck_assert_int_eq(alloc_fill(c, id, 4 * MIB, 9), 0);
  char out[16384];
  int rc = harness_ctl(&b, out, sizeof out, "pause", "q", "--tag", "w", NULL);
  ck_assert_msg(rc == 0, "gmbctl pause: %s", out);
  /* w's page and allocation are off the device; z's page stays. */
  wait_tags(&b, "q", 1, 2 * MIB);
  rc = gmb_pause(c, "w", GMB_PAUSE_OFFLOAD);
  ck_assert_msg(rc == 0, "pause of a paused tag: %s", gmb_last_error(c));

  /* Every tag resumed, then z paused: the library carries out the
   * operator's asks in order, so once the broker sees z paused the resume
   * was carried out, and w, the application's now, is still paused. */
  ck_assert_int_eq(harness_ctl(&b, out, sizeof out, "resume", "q", NULL), 0);
  rc = harness_ctl(&b, out, sizeof out, "pause", "q", "--tag", "z",
                   "--discard", NULL);
  ck_assert_msg(rc == 0, "gmbctl pause: %s", out);
  wait_tags(&b, "q", 2, 0);
  void *x;
  ck_assert_int_eq(gmb_lock(c, id, &x), GMB_E_INVAL);
  ck_assert_msg(strstr(gmb_last_error(c), "gmb_resume") != NULL &&
                    strstr(gmb_last_error(c), "operator") == NULL,
                "%s", gmb_last_error(c));

  ck_assert_int_eq(gmb_resume(c, "w"), 0);
  ck_assert_int_lt(harness_pattern_check(p, 1 * MIB, 8), 0);
  ck_assert(alloc_holds(c, id, 4 * MIB, 9));
  ck_assert_int_eq(gmb_free(c, id), 0);
  ck_assert_int_eq(gmb_free_async(c, p, NULL), 0);
  gmb_disconnect(c);
  harness_broker_stop(&b);
}
END_TEST

/* An operator's pause that comes while a thread of the process waits for
 * memory in gmb_alloc_wait: carried out while the wait is pending (the
 * waiting thread does not hold the connection, which the pause needs),
 * without serving or ending the wait, and the bytes are intact after the
 * resume.  The job holds 8 MiB in tag w; on 'w' a thread waits for 30 MiB
 * ('g' once started, then 's' when served or 'x'); on 'c' it checks w's
 * bytes ('k' or 'x'). */
struct waiter {
  gmb_client *c;
  gmb_id id;
  int rc;
};

static void *waiter_main(void *arg) {
  struct waiter *w = arg;
  w->rc = gmb_alloc_wait(w->c, 30 * MIB, 0, 60000, &w->id);
  return NULL;
}

static int waitjob_main(void *arg) {
  struct job *t = arg;
  gmb_client *c;
  JOB_CHECK(gmb_connect(t->endpoint, t->tenant, &c) == 0);
  gmb_id w;
  JOB_CHECK(gmb_cache_tag(c, "w") == 0);
  JOB_CHECK(gmb_alloc(c, 8 * MIB, 0, &w) == 0);
  JOB_CHECK(gmb_cache_tag(c, NULL) == 0);
  JOB_CHECK(alloc_fill(c, w, 8 * MIB, 12) == 0);
  harness_pipe_send(t->out, 'r');
  JOB_CHECK(harness_pipe_wait(t->in, 60000) == 'w');
  struct waiter wt = {c, 0, -1};
  pthread_t th;
  JOB_CHECK(pthread_create(&th, NULL, waiter_main, &wt) == 0);
  harness_pipe_send(t->out, 'g');
  pthread_join(th, NULL);
  harness_pipe_send(t->out, wt.rc == 0 ? 's' : 'x');
  JOB_CHECK(harness_pipe_wait(t->in, 60000) == 'c');
  return job_finish(t, c, alloc_holds(c, w, 8 * MIB, 12));
}

static int wt_waits(void *arg) { return row_of(arg, "wt").waiting == 1; }

START_TEST(operator_pause_while_alloc_waits) {
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", NULL);
  struct jobrun a;
  job_start_main(&a, &b, "wt", NULL, waitjob_main);
  gmb_client *c = harness_connect_ok(&b, "other");
  gmb_id big;
  ck_assert_int_eq(gmb_alloc(c, 40 * MIB, 0, &big), 0);
  ck_assert_int_eq(job_ask(&a, 'w'), 'g');
  ck_assert_msg(harness_poll_until(wt_waits, &b, HARNESS_WAIT_MS),
                "the job's request does not wait at the broker");
  char out[16384];
  int rc = harness_ctl(&b, out, sizeof out, "pause", "wt", NULL);
  ck_assert_msg(rc == 0, "gmbctl pause: %s", out);
  /* Paused with the wait still pending: w's 8 MiB went to the host, and
   * the 24 MiB free are still short of the 30 MiB waited for. */
  wait_tags(&b, "wt", 1, 0);
  struct wire_tenant_row r = row_of(&b, "wt");
  ck_assert_uint_eq(r.host_bytes, 8 * MIB);
  ck_assert_uint_eq(r.waiting, 1);
  ck_assert_int_eq(gmb_free(c, big), 0);
  ck_assert_int_eq(harness_pipe_wait(a.from[0], HARNESS_WAIT_MS), 's');
  wait_tags(&b, "wt", 1, 30 * MIB);
  ck_assert_int_eq(harness_ctl(&b, out, sizeof out, "resume", "wt", NULL),
                   0);
  wait_tags(&b, "wt", 0, 38 * MIB);
  ck_assert_int_eq(job_ask(&a, 'c'), 'k');
  job_end(&a);
  gmb_disconnect(c);
  harness_broker_stop(&b);
}
END_TEST

int main(void) {
  return harness_main(HARNESS_SUITE(
      "sleep_ask", "sleep_ask", 90, broker_asks_idle_job_to_pause,
      higher_priority_job_not_asked, liar_holds_others_within_the_bound,
      operator_pause_and_resume, host_quota_across_sessions,
      killed_while_paused, broker_restart_while_paused, bad_policy_refused,
      broker_asks_job_of_tagged_allocations, locked_allocation_during_ask,
      operator_pauses_tagged_allocations,
      failed_pause_keeps_an_operators_pause,
      app_pause_claims_an_operators_pause, operator_pause_while_alloc_waits));
}
