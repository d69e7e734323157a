/*
 * test_offload.c - the broker offloads movable allocations itself, against
 * a real broker on the host device with real client processes: an idle job
 * that opted in (its sleep policy) holds movable allocations (gmb_alloc
 * with GMB_MOVABLE) with a pattern each; a job of higher priority asks for
 * more than is free and is served from the pages the broker freed by
 * copying the idle job's allocations to its own host memory; the idle
 * job's gmb_lock then waits for room (restore_wait_ms) and fails cleanly
 * while there is none, its bytes kept, and brings every allocation back
 * byte for byte once the other job frees; a job killed while offloaded
 * leaves no host bytes counted, and so does one killed while its lock
 * waits at the broker for room; gmbctl pause and resume offload and bring
 * back a tenant's movable allocations; two requests that together lack
 * more than a slice of the broker's offload (64 MiB) are both served.
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
#include "wire.h"

#define MIB (UINT64_C(1) << 20)
#define NM 24 /* the idle job's movable allocations, 1 MiB each */
#define NM_MAX 160 /* ... when a test asks for more (job.n) */

/* What a job needs: where, as whom, its sleep policy, its pipes. */
struct job {
  const char *tenant, *policy, *endpoint;
  int in, out;
  int untagged; /* no cache block: its movable allocations only */
  int tag_all;  /* its allocations in tag "w" too, and a pinned one there */
  int n;        /* its movable allocations; 0: NM */
};

/* Locks every allocation, checks its pattern, unlocks: 'k', 'x' when a
 * byte differs, 't' / 'n' / 'e' when a lock failed with GMB_E_TIMEOUT /
 * GMB_E_NOMEM / another code. */
static char job_check_all(gmb_client *c, const gmb_id *id, int n) {
  for (int i = 0; i < n; i++) {
    void *p;
    int rc = gmb_lock(c, id[i], &p);
    if (rc == GMB_E_TIMEOUT) return 't';
    if (rc == GMB_E_NOMEM) return 'n';
    if (rc) {
      fprintf(stderr, "job: lock %d: %s\n", i, gmb_last_error(c));
      return 'e';
    }
    long bad = harness_pattern_check(p, MIB, (uint64_t)i + 3);
    gmb_unlock(c, id[i]);
    if (bad >= 0) return 'x';
  }
  return 'k';
}

/* A job: connects as `tenant` with `policy` (NULL: none), a 4 KiB block
 * in cache tag "w" (what its policy offers; none when `untagged`), NM
 * movable allocations with a pattern each; says 'r'.  'l': job_check_all;
 * 'q': frees and exits. */
static int job_main(void *arg) {
  struct job *j = arg;
  gmb_client *c;
  HARNESS_JOB_CHECK(gmb_connect(j->endpoint, j->tenant, &c) == 0);
  if (j->policy) HARNESS_JOB_CHECK(gmb_sleep_policy_set(c, j->policy) == 0);
  void *w = NULL;
  if (!j->untagged) {
    HARNESS_JOB_CHECK(gmb_cache_tag(c, "w") == 0);
    HARNESS_JOB_CHECK(gmb_malloc_async(c, 4096, NULL, &w) == 0);
    HARNESS_JOB_CHECK(gmb_cache_tag(c, NULL) == 0);
  }
  if (j->tag_all) HARNESS_JOB_CHECK(gmb_cache_tag(c, "w") == 0);
  const int n = j->n ? j->n : NM;
  gmb_id id[NM_MAX], pin = 0;
  HARNESS_JOB_CHECK(n <= NM_MAX);
  for (int i = 0; i < n; i++) {
    void *p;
    HARNESS_JOB_CHECK(gmb_alloc(c, MIB, GMB_MOVABLE, &id[i]) == 0);
    HARNESS_JOB_CHECK(gmb_lock(c, id[i], &p) == 0);
    harness_pattern_fill(p, MIB, (uint64_t)i + 3);
    HARNESS_JOB_CHECK(gmb_unlock(c, id[i]) == 0);
  }
  if (j->tag_all) {
    void *p;
    HARNESS_JOB_CHECK(gmb_alloc(c, 4 * MIB, 0, &pin) == 0);
    HARNESS_JOB_CHECK(gmb_lock(c, pin, &p) == 0);
    harness_pattern_fill(p, 4 * MIB, 77);
    HARNESS_JOB_CHECK(gmb_unlock(c, pin) == 0);
    HARNESS_JOB_CHECK(gmb_cache_tag(c, NULL) == 0);
  }
  harness_pipe_send(j->out, 'r');
  for (;;) {
    int cmd = harness_pipe_wait(j->in, 60000);
    if (cmd != 'l') break;
    char got = job_check_all(c, id, n);
    void *p;
    if (got == 'k' && pin) {
      if (gmb_lock(c, pin, &p) != 0) {
        got = 'e';
      } else {
        if (harness_pattern_check(p, 4 * MIB, 77) >= 0) got = 'x';
        gmb_unlock(c, pin);
      }
    }
    harness_pipe_send(j->out, got);
  }
  for (int i = 0; i < n; i++) HARNESS_JOB_CHECK(gmb_free(c, id[i]) == 0);
  if (pin) HARNESS_JOB_CHECK(gmb_free(c, pin) == 0);
  if (w) gmb_free_async(c, w, NULL);
  gmb_disconnect(c);
  return 0;
}

static struct wire_tenant_row row_of(const struct harness_broker *b,
                                     const char *tenant) {
  struct wire_tenant_row r;
  int rc = harness_tenant_row(b, tenant, &r);
  ck_assert_msg(rc == 0, "no row for tenant %s: %s", tenant, gmb_err_name(rc));
  return r;
}

struct jobrun {
  struct job j;
  struct harness_job h;
};

static void job_start_n(struct jobrun *r, const struct harness_broker *b,
                        const char *tenant, const char *policy, int untagged,
                        int tag_all, int n) {
  harness_job_open(&r->h);
  r->j = (struct job){tenant,   policy,   b->endpoint, harness_job_in(&r->h),
                      harness_job_out(&r->h), untagged, tag_all, n};
  harness_job_start(&r->h, job_main, &r->j);
}

static void job_start_as(struct jobrun *r, const struct harness_broker *b,
                         const char *tenant, const char *policy,
                         int untagged, int tag_all) {
  job_start_n(r, b, tenant, policy, untagged, tag_all, 0);
}

static void job_start(struct jobrun *r, const struct harness_broker *b,
                      const char *tenant, const char *policy) {
  job_start_as(r, b, tenant, policy, 0, 0);
}

struct offer_wait {
  const struct harness_broker *b;
  const char *tenant;
};

static int offer_seen(void *arg) {
  const struct offer_wait *o = arg;
  return harness_sleep_offer(o->b, o->tenant) > 0;
}

struct host_wait {
  const struct harness_broker *b;
  const char *tenant;
  uint64_t host;
};

static int host_seen(void *arg) {
  struct host_wait *h = arg;
  struct wire_tenant_row r;
  return harness_tenant_row(h->b, h->tenant, &r) == 0 &&
         r.host_bytes == h->host;
}

/* Kills job a; its tenant "idle" then holds no host bytes. */
static void kill_job_host_gone(const struct harness_broker *b,
                               struct jobrun *a) {
  ck_assert_int_eq(kill(a->h.pid, SIGKILL), 0);
  harness_wait(a->h.pid);
  harness_job_close(&a->h);
  struct host_wait h = {b, "idle", 0};
  ck_assert_msg(harness_poll_until(host_seen, &h, HARNESS_WAIT_MS),
                "the killed job's host bytes stayed counted");
}

/* The idle job holds its NM MiB (*idle_used, its bytes on the device);
 * the busy tenant then asks for 48 MiB, more than is free (64 less the
 * idle job's), and is served from what the broker offloaded: whatever
 * went to host memory left the device, byte for byte. */
static gmb_client *busy_takes_room(const struct harness_broker *b,
                                   uint64_t *idle_used, gmb_id *big) {
  *idle_used = row_of(b, "idle").used;
  ck_assert_uint_ge(*idle_used, NM * MIB);
  gmb_client *c = harness_connect_ok(b, "busy");
  int rc = gmb_alloc(c, 48 * MIB, 0, big);
  ck_assert_msg(rc == 0, "the busy job was refused: %s", gmb_last_error(c));
  struct wire_tenant_row r = row_of(b, "idle");
  ck_assert_uint_eq(r.used + r.host_bytes, *idle_used);
  return c;
}

/* Nothing asks idle jobs to pause their tags here: what moves is the
 * broker's own doing. */
static const char *const tenants =
    "[broker]\n"
    "sleep_wait_ms = 0\n"
    "restore_wait_ms = 300\n"
    "[tenant:idle]\n"
    "priority = 0\n"
    "[tenant:busy]\n"
    "priority = 10\n";

START_TEST(broker_offloads_and_lock_brings_back) {
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", tenants);
  struct jobrun a;
  job_start(&a, &b, "idle", "idle=0,w");
  struct offer_wait o = {&b, "idle"};
  ck_assert_msg(harness_poll_until(offer_seen, &o, HARNESS_WAIT_MS),
                "the idle job never offered to sleep");
  uint64_t idle_used;
  gmb_id big;
  gmb_client *c = busy_takes_room(&b, &idle_used, &big);
  struct wire_tenant_row r = row_of(&b, "idle");
  ck_assert_uint_ge(r.host_bytes, 10 * MIB);
  ck_assert_uint_eq(r.paused_bytes, r.host_bytes);
  ck_assert_uint_ge(r.paused_tags, 1);
  /* The busy job uses the pages: every byte of them is its own. */
  void *p;
  ck_assert_int_eq(gmb_lock(c, big, &p), 0);
  harness_pattern_fill(p, 48 * MIB, 99);
  ck_assert_int_lt(harness_pattern_check(p, 48 * MIB, 99), 0);
  ck_assert_int_eq(gmb_unlock(c, big), 0);
  static char out[1 << 16];
  ck_assert_int_eq(harness_ctl(&b, out, sizeof out, "status", NULL), 0);
  ck_assert_msg(strstr(out, "(movable)") != NULL, "status: %s", out);

  /* No room to bring them back: the lock waits restore_wait_ms, then
   * fails; nothing is lost. */
  ck_assert_int_eq(harness_job_ask(&a.h, 'l'), 't');
  ck_assert_uint_eq(row_of(&b, "idle").host_bytes, r.host_bytes);

  /* Room again: every allocation comes back byte for byte. */
  ck_assert_int_eq(gmb_free(c, big), 0);
  ck_assert_int_eq(harness_job_ask(&a.h, 'l'), 'k');
  r = row_of(&b, "idle");
  ck_assert_uint_eq(r.host_bytes, 0);
  ck_assert_uint_eq(r.used, idle_used);

  /* Offloaded again, then killed: the broker's host copies go. */
  int rc = gmb_alloc(c, 48 * MIB, 0, &big);
  ck_assert_msg(rc == 0, "the busy job was refused: %s", gmb_last_error(c));
  ck_assert_uint_ge(row_of(&b, "idle").host_bytes, 10 * MIB);
  kill_job_host_gone(&b, &a);
  ck_assert_int_eq(harness_ctl(&b, out, sizeof out, "metrics", NULL), 0);
  ck_assert_ptr_nonnull(strstr(out, "gmb_offload_host_bytes 0"));
  ck_assert_ptr_nonnull(strstr(out, "gmb_offload_host_chunk_bytes 0"));
  ck_assert_ptr_nonnull(strstr(out, "gmb_offloads_total "));
  ck_assert_int_eq(gmb_free(c, big), 0);
  gmb_disconnect(c);
  harness_broker_stop(&b);
}
END_TEST

/* 1 when a session of o's tenant has a row that `ok` accepts. */
static int session_seen(const struct offer_wait *o,
                        int (*ok)(const struct wire_session_row *)) {
  struct wire_reply rep;
  if (harness_admin_status(o->b, &rep)) return 0;
  int seen = 0;
  for (size_t i = 0; i < rep.u.admin_status.n_sessions; i++) {
    const struct wire_session_row *s = &rep.u.admin_status.session_rows[i];
    if (strcmp(s->tenant, o->tenant) == 0 && ok(s)) seen = 1;
  }
  gmb__wire_reply_clear(&rep);
  return seen;
}

static int row_idle(const struct wire_session_row *s) {
  return s->sleep_idle_ms > 0;
}

/* The policy's idle flag (sessions' rows show how long it idled) without
 * any tagged bytes to offer. */
static int idle_seen(void *arg) { return session_seen(arg, row_idle); }

/* Job a holds only movable allocations (untagged) and says it is idle;
 * the busy tenant then takes room (busy_takes_room): its client. */
static gmb_client *untagged_job_offloaded(const struct harness_broker *b,
                                          struct jobrun *a,
                                          uint64_t *idle_used, gmb_id *big) {
  job_start_as(a, b, "idle", "idle=0", 1, 0);
  struct offer_wait o = {b, "idle"};
  ck_assert_msg(harness_poll_until(idle_seen, &o, HARNESS_WAIT_MS),
                "the idle job never said it was idle");
  ck_assert_uint_eq(harness_sleep_offer(b, "idle"), 0);
  return busy_takes_room(b, idle_used, big);
}

/* A job that holds only movable gmb_alloc allocations (nothing tagged, so
 * its policy offers no bytes to pause) is still offloaded by the broker
 * once its policy deems it idle; its locks bring every byte back. */
START_TEST(untagged_movable_job_offloaded) {
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", tenants);
  struct jobrun a;
  uint64_t idle_used;
  gmb_id big;
  gmb_client *c = untagged_job_offloaded(&b, &a, &idle_used, &big);
  struct wire_tenant_row r = row_of(&b, "idle");
  ck_assert_uint_ge(r.host_bytes, 8 * MIB);
  ck_assert_int_eq(gmb_free(c, big), 0);
  ck_assert_int_eq(harness_job_ask(&a.h, 'l'), 'k');
  r = row_of(&b, "idle");
  ck_assert_uint_eq(r.host_bytes, 0);
  ck_assert_uint_eq(r.used, idle_used);
  gmb_disconnect(c);
  harness_job_end(&a.h);
  harness_broker_stop(&b);
}
END_TEST

/* gmbctl pause offloads the tenant's unlocked movable allocations (no
 * sleep policy needed: the operator decides); resume brings them back. */
START_TEST(operator_pause_offloads_movable) {
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", tenants);
  struct jobrun a;
  job_start(&a, &b, "idle", NULL);
  const uint64_t idle_used = row_of(&b, "idle").used;
  char out[4096];
  /* The job's library pauses its cache tag "w" as well, from its own
   * thread (host bytes of its own); the movable allocations go at once. */
  ck_assert_int_eq(harness_ctl(&b, out, sizeof out, "pause", "idle", NULL), 0);
  ck_assert_msg(strstr(out, "24 movable allocations") != NULL, "%s", out);
  struct wire_tenant_row r = row_of(&b, "idle");
  ck_assert_uint_ge(r.host_bytes, NM * MIB);
  ck_assert_uint_le(r.used, idle_used - NM * MIB);
  ck_assert_int_eq(harness_ctl(&b, out, sizeof out, "resume", "idle", NULL),
                   0);
  ck_assert_msg(strstr(out, "24 movable allocations") != NULL, "%s", out);
  struct host_wait h = {&b, "idle", 0};
  ck_assert_msg(harness_poll_until(host_seen, &h, HARNESS_WAIT_MS),
                "tenant idle still holds host bytes after resume");
  ck_assert_int_eq(harness_job_ask(&a.h, 'l'), 'k');
  /* Paused again and locked lazily: each lock brings one back. */
  ck_assert_int_eq(harness_ctl(&b, out, sizeof out, "pause", "idle", "--tag",
                               "(movable)", NULL),
                   0);
  ck_assert_uint_eq(row_of(&b, "idle").host_bytes, NM * MIB);
  ck_assert_int_eq(harness_job_ask(&a.h, 'l'), 'k');
  ck_assert_uint_eq(row_of(&b, "idle").host_bytes, 0);
  ck_assert_uint_eq(row_of(&b, "idle").used, idle_used);
  harness_job_end(&a.h);
  harness_broker_stop(&b);
}
END_TEST

static int row_w_paused(const struct wire_session_row *s) {
  return strstr(s->paused, "w") != NULL;
}

/* A session's tag "w" in its sessions' rows (paused, whoever paused it). */
static int tag_w_paused(void *arg) { return session_seen(arg, row_w_paused); }

/* gmbctl pause of every tag, where the tag's allocations are movable: the
 * broker offloads them first, and the library's pause of the tag leaves
 * them with the broker (bringing them back only to copy them again would
 * double the work and need room the offload just gave away); it pauses
 * the rest of the tag, a pinned allocation. */
START_TEST(operator_pause_leaves_offloaded_to_the_broker) {
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", tenants);
  struct jobrun a;
  job_start_as(&a, &b, "idle", NULL, 1, 1);
  char out[1 << 16];
  ck_assert_int_eq(harness_ctl(&b, out, sizeof out, "pause", "idle", NULL), 0);
  ck_assert_msg(strstr(out, "24 movable allocations") != NULL, "%s", out);
  struct offer_wait o = {&b, "idle"};
  ck_assert_msg(harness_poll_until(tag_w_paused, &o, HARNESS_WAIT_MS),
                "the job never paused tag w");
  ck_assert_int_eq(harness_ctl(&b, out, sizeof out, "metrics", NULL), 0);
  ck_assert_msg(strstr(out, "\ngmb_offload_restores_total 0\n") != NULL,
                "the library brought offloaded allocations back to pause "
                "them:%s", strstr(out, "\ngmb_offload_restores_total "));
  struct wire_tenant_row r = row_of(&b, "idle");
  ck_assert_uint_eq(r.host_bytes, NM * MIB + 4 * MIB);
  ck_assert_int_eq(harness_ctl(&b, out, sizeof out, "resume", "idle", NULL),
                   0);
  struct host_wait h = {&b, "idle", 0};
  ck_assert_msg(harness_poll_until(host_seen, &h, HARNESS_WAIT_MS),
                "tenant idle still holds host bytes after resume");
  ck_assert_int_eq(harness_job_ask(&a.h, 'l'), 'k');
  harness_job_end(&a.h);
  harness_broker_stop(&b);
}
END_TEST

/* 1 when tenant o->tenant has a request waiting (its Lock, here). */
static int waiting_seen(void *arg) {
  const struct offer_wait *o = arg;
  struct wire_tenant_row r;
  return harness_tenant_row(o->b, o->tenant, &r) == 0 && r.waiting > 0;
}

/* The idle job's gmb_lock waits in the broker's queue for room
 * (restore_wait_ms long) when the job is killed: the waiter, the host
 * copies and the (movable) record go with its session; the busy job's
 * bytes are untouched and the broker serves on. */
START_TEST(killed_while_its_lock_waits) {
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB",
                       "[broker]\n"
                       "sleep_wait_ms = 0\n"
                       "restore_wait_ms = 8000\n"
                       "[tenant:idle]\n"
                       "priority = 0\n"
                       "[tenant:busy]\n"
                       "priority = 10\n");
  struct jobrun a;
  uint64_t idle_used;
  gmb_id big;
  gmb_client *c = untagged_job_offloaded(&b, &a, &idle_used, &big);
  struct offer_wait o = {&b, "idle"};
  void *p;
  ck_assert_int_eq(gmb_lock(c, big, &p), 0);
  harness_pattern_fill(p, 48 * MIB, 41);
  ck_assert_int_eq(gmb_unlock(c, big), 0);
  ck_assert_uint_ge(row_of(&b, "idle").host_bytes, 8 * MIB);
  /* 'l' without waiting for its answer: the job's first offloaded lock
   * waits at the broker. */
  ck_assert_int_eq(harness_pipe_send(a.h.to[1], 'l'), 0);
  ck_assert_msg(harness_poll_until(waiting_seen, &o, HARNESS_WAIT_MS),
                "the idle job's Lock never waited");
  kill_job_host_gone(&b, &a);
  struct wire_tenant_row r = row_of(&b, "idle");
  ck_assert_uint_eq(r.waiting, 0);
  ck_assert_uint_eq(r.paused_bytes, 0);
  ck_assert_uint_eq(r.paused_tags, 0);
  ck_assert_uint_eq(r.used, 0);
  static char out[1 << 16];
  ck_assert_int_eq(harness_ctl(&b, out, sizeof out, "metrics", NULL), 0);
  ck_assert_ptr_nonnull(strstr(out, "gmb_offload_host_bytes 0"));
  ck_assert_ptr_nonnull(strstr(out, "gmb_offload_host_chunk_bytes 0"));
  ck_assert_ptr_nonnull(strstr(out, "gmb_offload_allocations 0"));
  /* The broker serves on, and the busy job's bytes are its own. */
  ck_assert_int_eq(gmb_lock(c, big, &p), 0);
  ck_assert_int_lt(harness_pattern_check(p, 48 * MIB, 41), 0);
  ck_assert_int_eq(gmb_unlock(c, big), 0);
  ck_assert_int_eq(gmb_free(c, big), 0);
  gmb_disconnect(c);
  harness_broker_stop(&b);
}
END_TEST

/* --- the offload job: more than a slice -------------------------------- */

/* A requester: connects as `tenant`, says 'r'; 'a': gmb_alloc of `size`
 * pinned bytes, which it fills and checks: 'k', or 'n' when refused;
 * 'q': frees, exits. */
struct asker {
  const char *tenant, *endpoint;
  uint64_t size;
  int in, out;
};

static int asker_main(void *arg) {
  struct asker *k = arg;
  gmb_client *c;
  HARNESS_JOB_CHECK(gmb_connect(k->endpoint, k->tenant, &c) == 0);
  harness_pipe_send(k->out, 'r');
  gmb_id id = 0;
  for (;;) {
    int cmd = harness_pipe_wait(k->in, 60000);
    if (cmd != 'a') break;
    void *p;
    char got = 'k';
    if (gmb_alloc(c, k->size, 0, &id) != 0) {
      fprintf(stderr, "asker %s: %s\n", k->tenant, gmb_last_error(c));
      got = 'n';
      id = 0;
    } else if (gmb_lock(c, id, &p) != 0) {
      got = 'e';
    } else {
      harness_pattern_fill(p, k->size, 5);
      if (harness_pattern_check(p, k->size, 5) >= 0) got = 'x';
      gmb_unlock(c, id);
    }
    harness_pipe_send(k->out, got);
  }
  if (id) HARNESS_JOB_CHECK(gmb_free(c, id) == 0);
  gmb_disconnect(c);
  return 0;
}

struct askrun {
  struct asker k;
  struct harness_job h;
};

static void asker_start(struct askrun *r, const struct harness_broker *b,
                        const char *tenant, uint64_t size) {
  harness_job_open(&r->h);
  r->k = (struct asker){tenant, b->endpoint, size, harness_job_in(&r->h),
                        harness_job_out(&r->h)};
  harness_job_start(&r->h, asker_main, &r->k);
}

/* A counter of the broker's metrics, or UINT64_MAX when not there. */
static uint64_t metric_of(const struct harness_broker *b, const char *name) {
  static char out[1 << 16];
  ck_assert_int_eq(harness_ctl(b, out, sizeof out, "metrics", NULL), 0);
  char key[128];
  snprintf(key, sizeof key, "\n%s ", name);
  const char *at = strstr(out, key);
  return at ? strtoull(at + strlen(key), NULL, 10) : UINT64_MAX;
}

/* An idle job holds 160 movable MiB of a 256 MiB device; two jobs of
 * higher priority, of two tenants, ask at once for 160 and 64 MiB, more
 * together than is free: whichever comes first, the broker's offload
 * makes the room over more than one slice (64 MiB each), and both are
 * served, neither counting on room made for the other; the idle job
 * then gets every byte back. */
static const char *const job_tenants =
    "[broker]\n"
    "sleep_wait_ms = 0\n"
    "restore_wait_ms = 3000\n"
    "[tenant:idle]\n"
    "priority = 0\n"
    "[tenant:busy]\n"
    "priority = 10\n"
    "[tenant:busy2]\n"
    "priority = 10\n";

START_TEST(two_requesters_served_over_slices) {
  struct harness_broker b;
  harness_broker_start(&b, "host:256MiB", job_tenants);
  struct jobrun a;
  job_start_n(&a, &b, "idle", "idle=0,w", 0, 0, NM_MAX);
  struct offer_wait o = {&b, "idle"};
  ck_assert_msg(harness_poll_until(offer_seen, &o, HARNESS_WAIT_MS),
                "the idle job never offered to sleep");
  struct askrun x, y;
  asker_start(&x, &b, "busy", 160 * MIB);
  asker_start(&y, &b, "busy2", 64 * MIB);
  harness_pipe_send(x.h.to[1], 'a');
  harness_pipe_send(y.h.to[1], 'a');
  ck_assert_int_eq(harness_pipe_wait(x.h.from[0], HARNESS_WAIT_MS), 'k');
  ck_assert_int_eq(harness_pipe_wait(y.h.from[0], HARNESS_WAIT_MS), 'k');
  ck_assert_uint_ge(metric_of(&b, "gmb_offload_slices_total"), 2);
  ck_assert_uint_ge(metric_of(&b, "gmb_offload_jobs_total"), 1);
  ck_assert_uint_eq(metric_of(&b, "gmb_offload_job_requests"), 0);
  ck_assert_uint_ge(row_of(&b, "idle").host_bytes, 128 * MIB);
  harness_job_end(&x.h);
  harness_job_end(&y.h);
  ck_assert_int_eq(harness_job_ask(&a.h, 'l'), 'k');
  ck_assert_uint_eq(row_of(&b, "idle").host_bytes, 0);
  harness_job_end(&a.h);
  harness_broker_stop(&b);
}
END_TEST

/* 1 when the broker holds `bytes` of offloaded copies (the metric). */
struct metric_wait {
  const struct harness_broker *b;
  const char *name;
  uint64_t value;
};

static int metric_seen(void *arg) {
  const struct metric_wait *m = arg;
  return metric_of(m->b, m->name) == m->value;
}

/* gmbctl pause of a tenant holding more than two slices' worth of movable
 * memory (160 MiB): the command copies one slice and answers, the
 * broker's loop copies the rest a slice a turn, and status says so until
 * it is done; resume brings every byte back. */
START_TEST(operator_pause_runs_in_slices) {
  struct harness_broker b;
  harness_broker_start(&b, "host:256MiB", job_tenants);
  struct jobrun a;
  job_start_n(&a, &b, "idle", NULL, 0, 0, NM_MAX);
  const uint64_t slices0 = metric_of(&b, "gmb_offload_slices_total");
  static char out[1 << 16];
  ck_assert_int_eq(harness_ctl(&b, out, sizeof out, "pause", "idle", NULL), 0);
  ck_assert_msg(strstr(out, "64 movable allocations (64MiB)") != NULL, "%s",
                out);
  ck_assert_msg(strstr(out, "the rest a slice a loop turn") != NULL, "%s",
                out);
  struct metric_wait m = {&b, "gmb_offload_host_bytes", NM_MAX * MIB};
  ck_assert_msg(harness_poll_until(metric_seen, &m, HARNESS_WAIT_MS),
                "the pause never offloaded all 160 MiB");
  /* The command's slice and two turns' at least (64 + 64 + 32 MiB). */
  ck_assert_uint_ge(metric_of(&b, "gmb_offload_slices_total"), slices0 + 3);
  ck_assert_int_eq(harness_ctl(&b, out, sizeof out, "status", NULL), 0);
  ck_assert_msg(strstr(out, "offload pause") == NULL, "%s", out);
  ck_assert_int_eq(harness_ctl(&b, out, sizeof out, "resume", "idle", NULL),
                   0);
  struct host_wait h = {&b, "idle", 0};
  ck_assert_msg(harness_poll_until(host_seen, &h, HARNESS_WAIT_MS),
                "tenant idle still holds host bytes after resume");
  ck_assert_int_eq(harness_job_ask(&a.h, 'l'), 'k');
  harness_job_end(&a.h);
  harness_broker_stop(&b);
}
END_TEST

int main(void) {
  return harness_main(HARNESS_SUITE("offload", "offload", 90,
                                    broker_offloads_and_lock_brings_back,
                                    operator_pause_offloads_movable,
                                    untagged_movable_job_offloaded,
                                    operator_pause_leaves_offloaded_to_the_broker,
                                    killed_while_its_lock_waits,
                                    two_requesters_served_over_slices,
                                    operator_pause_runs_in_slices));
}
