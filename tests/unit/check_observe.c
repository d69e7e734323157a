/*
 * check_observe.c - what the broker shows of itself (observe.h): the admin
 * status's cached bytes per tenant and its row per session, the same in a
 * snapshot's status, and the per-tenant cache and trim metrics, with a
 * whole broker on a host device (broker_fixture.h).
 *
 * The scene: two tenants, five sessions.  Sessions report their caches'
 * free bytes on whatever they send (Request.cached_free; a heartbeat
 * here), and one reports more than it holds, which the broker never
 * believes: a session's cached bytes are capped at its own, a tenant's at
 * its `used`.  Trim counters are set directly on the sessions (the broker
 * side that counts them is not this module's); what is checked is that
 * the totals per tenant add the live sessions to the ended ones, so they
 * never go down when a session ends.
 */
#include <check.h>
#include <jansson.h>
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "broker_fixture.h"
#include "check_main.h"
#include "observe.h"
#include "reclaim.h"
#include "session.h"
#include "tenant.h"
#include "util.h"

#define MIB GMB_MIB

/* Tells the broker that client rid's cache holds `cached` free bytes, on
 * a heartbeat (no answer). */
static void report_cached(struct fx *f, const char *rid, uid_t uid,
                          uint64_t cached) {
  struct wire_request req;
  memset(&req, 0, sizeof req);
  req.kind = WIRE_HEARTBEAT;
  req.cached_free = cached;
  struct wire_reply rep;
  ck_assert_int_eq(fx_request(f, rid, uid, &req, &rep), 0);
}

/* Allocates on a request that also reports `cached` (as the library's
 * slab requests do). */
static void alloc_reporting(struct fx *f, const char *rid, uid_t uid,
                            uint64_t size, uint64_t cached) {
  struct wire_request req;
  memset(&req, 0, sizeof req);
  req.kind = WIRE_ALLOC;
  req.u.alloc.size = size;
  req.cached_free = cached;
  struct wire_reply rep;
  ck_assert_int_eq(fx_request(f, rid, uid, &req, &rep), 1);
  ck_assert_msg(rep.status == 0, "alloc: %s", rep.message);
}

struct scene {
  struct fx f;
  struct gmb_session *a1, *a2, *b1, *b2, *b3;
};

/*
 * alpha (uid 1001): a1 holds 5 MiB, 3 MiB of it cached free; a2 holds
 * 2 MiB and claims 5 MiB cached (capped: 2 MiB).
 * beta (uid 1002): b1 holds 1 MiB, nothing cached; b2 holds nothing and
 * claims 1 MiB (capped: 0); b3 holds 8 MiB, all of it cached.
 * Cached: alpha 5 MiB, beta 8 MiB, 13 MiB in all.
 */
static void scene_open(struct scene *s) {
  fx_open_ini(&s->f, "host:64MiB",
              "[broker]\ncompaction = off\n"
              "[tenant:alpha]\nuids = 1001\nquota = 32MiB\n"
              "[tenant:beta]\nuids = 1002\n");
  struct fx *f = &s->f;
  s->a1 = fx_hello(f, "a1", 1001, "alpha");
  s->b1 = fx_hello(f, "b1", 1002, "beta");
  s->a2 = fx_hello(f, "a2", 1001, "alpha");
  s->b2 = fx_hello(f, "b2", 1002, "beta");
  s->b3 = fx_hello(f, "b3", 1002, "beta");
  fx_must_alloc(f, "a1", 1001, 4 * MIB, 0);
  fx_must_alloc(f, "a1", 1001, MIB, 0);
  report_cached(f, "a1", 1001, 3 * MIB);
  alloc_reporting(f, "a2", 1001, 2 * MIB, 0);
  report_cached(f, "a2", 1001, 5 * MIB);
  fx_must_alloc(f, "b1", 1002, MIB, 0);
  report_cached(f, "b2", 1002, MIB);
  alloc_reporting(f, "b3", 1002, 8 * MIB, 8 * MIB);
}

static void status(struct fx *f, struct wire_reply *rep) {
  memset(rep, 0, sizeof *rep);
  gmb__observe_status(&f->b, rep);
  ck_assert_msg(rep->status == 0, "status: %s", rep->message);
  ck_assert_int_eq(rep->kind, WIRE_ADMIN_STATUS);
}

static const struct wire_tenant_row *row_of(const struct wire_admin_status *st,
                                            const char *name) {
  for (size_t i = 0; i < st->n_tenants; i++)
    if (strcmp(st->tenants[i].name, name) == 0) return &st->tenants[i];
  ck_abort_msg("no row for tenant %s", name);
  return NULL;
}

static const struct wire_session_row *session_of(
    const struct wire_admin_status *st, const struct gmb_session *s) {
  for (size_t i = 0; i < st->n_sessions; i++)
    if (st->session_rows[i].id == s->id) return &st->session_rows[i];
  ck_abort_msg("no row for session %" PRIu64, s->id);
  return NULL;
}

START_TEST(status_cached_per_tenant_and_session) {
  struct scene s;
  scene_open(&s);
  struct wire_reply rep;
  status(&s.f, &rep);
  const struct wire_admin_status *st = &rep.u.admin_status;
  ck_assert_uint_eq(row_of(st, "alpha")->used, 7 * MIB);
  ck_assert_uint_eq(row_of(st, "alpha")->cached, 5 * MIB);
  ck_assert_uint_eq(row_of(st, "beta")->used, 9 * MIB);
  ck_assert_uint_eq(row_of(st, "beta")->cached, 8 * MIB);
  ck_assert_uint_eq(st->cached, 13 * MIB);
  /* The same figure the tenant's clients get from gmb_tenant_stats. */
  ck_assert_uint_eq(gmb__tenant_cached(s.a1->tenant), 5 * MIB);

  ck_assert_uint_eq(st->n_sessions, 5);
  ck_assert_uint_eq(st->sessions, 5);
  const struct wire_session_row *r = session_of(st, s.a1);
  ck_assert_str_eq(r->tenant, "alpha");
  ck_assert_uint_eq(r->uid, 1001);
  ck_assert_str_eq(r->client, "fixture");
  ck_assert_uint_eq(r->allocations, 2);
  ck_assert_uint_eq(r->used, 5 * MIB);
  ck_assert_uint_eq(r->cached, 3 * MIB);
  r = session_of(st, s.a2);
  ck_assert_uint_eq(r->used, 2 * MIB);
  ck_assert_uint_eq(r->cached, 2 * MIB); /* claimed 5 MiB */
  r = session_of(st, s.b1);
  ck_assert_str_eq(r->tenant, "beta");
  ck_assert_uint_eq(r->uid, 1002);
  ck_assert_uint_eq(r->allocations, 1);
  ck_assert_uint_eq(r->cached, 0);
  r = session_of(st, s.b2);
  ck_assert_uint_eq(r->allocations, 0);
  ck_assert_uint_eq(r->used, 0);
  ck_assert_uint_eq(r->cached, 0); /* claimed 1 MiB of nothing */
  r = session_of(st, s.b3);
  ck_assert_uint_eq(r->used, 8 * MIB);
  ck_assert_uint_eq(r->cached, 8 * MIB);
  gmb__wire_reply_clear(&rep);
  fx_close(&s.f);
}
END_TEST

/* Rows come by tenant (name order), then by session id, whatever order
 * the sessions connected in; a session's bytes add up to its tenant's. */
START_TEST(status_sessions_by_tenant_then_id) {
  struct scene s;
  scene_open(&s);
  struct wire_reply rep;
  status(&s.f, &rep);
  const struct wire_admin_status *st = &rep.u.admin_status;
  const struct gmb_session *want[] = {s.a1, s.a2, s.b1, s.b2, s.b3};
  ck_assert_uint_eq(st->n_sessions, 5);
  for (size_t i = 0; i < 5; i++)
    ck_assert_uint_eq(st->session_rows[i].id, want[i]->id);
  for (size_t t = 0; t < st->n_tenants; t++) {
    uint64_t used = 0, cached = 0;
    for (size_t i = 0; i < st->n_sessions; i++)
      if (strcmp(st->session_rows[i].tenant, st->tenants[t].name) == 0) {
        used += st->session_rows[i].used;
        cached += st->session_rows[i].cached;
      }
    ck_assert_uint_eq(used, st->tenants[t].used);
    ck_assert_uint_eq(cached, st->tenants[t].cached);
  }
  gmb__wire_reply_clear(&rep);
  fx_close(&s.f);
}
END_TEST

/* What a session frees leaves its bytes and its cap: a report it made
 * before cannot count memory it no longer holds. */
START_TEST(cached_capped_after_free) {
  struct scene s;
  scene_open(&s);
  struct wire_reply r4 = fx_must_alloc(&s.f, "b1", 1002, 4 * MIB, 0);
  report_cached(&s.f, "b1", 1002, 5 * MIB);
  ck_assert_uint_eq(gmb__session_cached(s.b1), 5 * MIB);
  /* A free sent by a client without a cache reports 0 on its way. */
  ck_assert_int_eq(fx_free(&s.f, "b1", 1002, r4.u.alloc.id), 0);
  ck_assert_uint_eq(s.b1->used, MIB);
  ck_assert_uint_eq(gmb__session_cached(s.b1), 0);
  /* Even a stale figure is capped at what it holds now (set as a request
   * would, so that the broker's count of caching sessions follows). */
  gmb__reclaim_heard(&s.f.b, s.b1, 5 * MIB, 0);
  ck_assert_uint_eq(gmb__session_cached(s.b1), MIB);
  struct wire_reply rep;
  status(&s.f, &rep);
  ck_assert_uint_eq(session_of(&rep.u.admin_status, s.b1)->cached, MIB);
  ck_assert_uint_eq(row_of(&rep.u.admin_status, "beta")->cached, 9 * MIB);
  gmb__wire_reply_clear(&rep);
  fx_close(&s.f);
}
END_TEST

START_TEST(no_sessions_no_rows) {
  struct fx f;
  fx_open(&f);
  struct wire_reply rep;
  status(&f, &rep);
  ck_assert_uint_eq(rep.u.admin_status.n_sessions, 0);
  ck_assert_ptr_null(rep.u.admin_status.session_rows);
  ck_assert_uint_eq(rep.u.admin_status.cached, 0);
  gmb__wire_reply_clear(&rep);
  fx_close(&f);
}
END_TEST

/* The trim counters are shown per session and summed per tenant; a
 * session's end moves its counts into its tenant's totals, which never go
 * down. */
START_TEST(trim_totals_survive_session_end) {
  struct scene s;
  scene_open(&s);
  s.a1->trim_asks = 3;
  s.a1->trim_ignored = 1;
  s.a2->trim_asks = 2;
  s.b3->trim_asks = 7;
  s.b3->trim_ignored = 4;
  struct wire_reply rep;
  status(&s.f, &rep);
  const struct wire_admin_status *st = &rep.u.admin_status;
  ck_assert_uint_eq(session_of(st, s.a1)->trim_asks, 3);
  ck_assert_uint_eq(session_of(st, s.a1)->trim_ignored, 1);
  ck_assert_uint_eq(session_of(st, s.b3)->trim_ignored, 4);
  ck_assert_uint_eq(row_of(st, "alpha")->trim_asks, 5);
  ck_assert_uint_eq(row_of(st, "alpha")->trim_ignored, 1);
  ck_assert_uint_eq(row_of(st, "beta")->trim_asks, 7);
  ck_assert_uint_eq(row_of(st, "beta")->trim_ignored, 4);
  gmb__wire_reply_clear(&rep);

  uint64_t a1 = s.a1->id;
  fx_end(&s.f, s.a1);
  s.a2->trim_asks++; /* one more ask to a session that stays */
  status(&s.f, &rep);
  st = &rep.u.admin_status;
  ck_assert_uint_eq(st->n_sessions, 4);
  for (size_t i = 0; i < st->n_sessions; i++)
    ck_assert_uint_ne(st->session_rows[i].id, a1);
  ck_assert_uint_eq(row_of(st, "alpha")->trim_asks, 6);
  ck_assert_uint_eq(row_of(st, "alpha")->trim_ignored, 1);
  /* Its cached bytes went with it. */
  ck_assert_uint_eq(row_of(st, "alpha")->cached, 2 * MIB);
  ck_assert_uint_eq(st->cached, 10 * MIB);
  gmb__wire_reply_clear(&rep);
  fx_close(&s.f);
}
END_TEST

/* Metrics per tenant (never per session): cached bytes as a gauge, asks
 * and ignored asks as counters that keep what ended sessions left. */
START_TEST(metrics_cached_and_trim_per_tenant) {
  struct scene s;
  scene_open(&s);
  s.a1->trim_asks = 3;
  s.a1->trim_ignored = 1;
  s.b3->trim_asks = 2;
  fx_end(&s.f, s.a1);
  char *m = gmb__observe_metrics(&s.f.b, 1);
  ck_assert_ptr_nonnull(m);
  static const char *want[] = {
      "\n# TYPE gmb_tenant_cached_bytes gauge\n",
      "\ngmb_tenant_cached_bytes{tenant=\"alpha\"} 2097152\n",
      "\ngmb_tenant_cached_bytes{tenant=\"beta\"} 8388608\n",
      "\n# TYPE gmb_trim_asks_total counter\n",
      "\ngmb_trim_asks_total{tenant=\"alpha\"} 3\n",
      "\ngmb_trim_asks_total{tenant=\"beta\"} 2\n",
      "\n# TYPE gmb_trim_ignored_total counter\n",
      "\ngmb_trim_ignored_total{tenant=\"alpha\"} 1\n",
      "\ngmb_trim_ignored_total{tenant=\"beta\"} 0\n",
  };
  const char *from = strstr(m, "# HELP gmb_tenant_cached");
  for (size_t i = 0; i < sizeof want / sizeof want[0]; i++)
    ck_assert_msg(strstr(m, want[i]) != NULL, "missing %s in:\n%.2000s",
                  want[i], from ? from : m);
  /* No series per session. */
  ck_assert_ptr_null(strstr(m, "session=\""));
  free(m);
  fx_close(&s.f);
}
END_TEST

/* A tenant's VMM bytes (Vmm) are in its used bytes everywhere the broker
 * shows them, and apart as vmm: its row and its metrics. */
START_TEST(vmm_in_used_row_and_metrics) {
  struct scene s;
  scene_open(&s);
  struct gmb_tenant *alpha = s.a2->tenant;
  const uint64_t pool_used = alpha->used;
  struct wire_request req;
  memset(&req, 0, sizeof req);
  req.kind = WIRE_VMM;
  req.u.vmm.bytes = 4 * MIB;
  struct wire_reply rep;
  ck_assert_int_eq(fx_request(&s.f, "a2", 1001, &req, &rep), 1);
  ck_assert_int_eq(rep.status, 0);
  status(&s.f, &rep);
  ck_assert_uint_eq(row_of(&rep.u.admin_status, "alpha")->used,
                    pool_used + 4 * MIB);
  ck_assert_uint_eq(row_of(&rep.u.admin_status, "alpha")->vmm, 4 * MIB);
  ck_assert_uint_eq(row_of(&rep.u.admin_status, "beta")->vmm, 0);
  gmb__wire_reply_clear(&rep);
  char *m = gmb__observe_metrics(&s.f.b, 1);
  ck_assert_ptr_nonnull(m);
  char want[128];
  snprintf(want, sizeof want, "\ngmb_tenant_used_bytes{tenant=\"alpha\"} %llu\n",
           (unsigned long long)(pool_used + 4 * MIB));
  ck_assert_msg(strstr(m, want) != NULL, "missing %s", want);
  ck_assert_ptr_nonnull(strstr(m, "\n# TYPE gmb_tenant_vmm_bytes gauge\n"));
  ck_assert_ptr_nonnull(
      strstr(m, "\ngmb_tenant_vmm_bytes{tenant=\"alpha\"} 4194304\n"));
  ck_assert_ptr_nonnull(
      strstr(m, "\ngmb_tenant_vmm_bytes{tenant=\"beta\"} 0\n"));
  free(m);
  fx_close(&s.f);
}
END_TEST

/* A snapshot's status is the admin status: the sessions and the cached
 * bytes are in it. */
START_TEST(snapshot_status_has_sessions_and_cached) {
  struct scene s;
  scene_open(&s);
  struct wire_reply rep;
  memset(&rep, 0, sizeof rep);
  gmb__observe_snapshot(&s.f.b, 0, 0, 0, &rep); /* the first page */
  ck_assert_msg(rep.status == 0, "snapshot: %s", rep.message);
  const struct wire_admin_status *st = &rep.u.snapshot.status;
  ck_assert_uint_eq(st->cached, 13 * MIB);
  ck_assert_uint_eq(st->n_sessions, 5);
  ck_assert_uint_eq(session_of(st, s.b3)->cached, 8 * MIB);
  ck_assert_uint_eq(row_of(st, "beta")->cached, 8 * MIB);
  /* And they survive the wire. */
  uint8_t *buf = NULL;
  size_t len = 0;
  ck_assert_int_eq(gmb__wire_reply_encode(&rep, &buf, &len), 0);
  struct wire_reply out;
  ck_assert_int_eq(gmb__wire_reply_decode(buf, len, &out), 0);
  free(buf);
  ck_assert_uint_eq(out.u.snapshot.status.n_sessions, 5);
  ck_assert_mem_eq(out.u.snapshot.status.session_rows, st->session_rows,
                   5 * sizeof *st->session_rows);
  ck_assert_uint_eq(out.u.snapshot.status.cached, 13 * MIB);
  gmb__wire_reply_clear(&out);
  gmb__wire_reply_clear(&rep);
  fx_close(&s.f);
}
END_TEST

/* The consistency check sees a session whose bytes drifted from its
 * tenant's (what the broker runs after every request under checks). */
/* 1 when s is text a terminal shows as it is: printable ASCII, or UTF-8
 * that jansson takes, and no control byte (ESC, newline, DEL). */
static int printable(const char *s) {
  for (const unsigned char *p = (const unsigned char *)s; *p; p++)
    if (*p < 0x20 || *p == 0x7f) return 0;
  json_t *j = json_string(s);
  json_decref(j);
  return j != NULL;
}

/* What a tenant's process names itself (Hello.client) and its tags are
 * any bytes but NUL; the status shows them to operators (gmbctl status,
 * its --json, snapshots).  Before, they went out as they came: an escape
 * sequence or a newline in them reached the operator's terminal as
 * gmbctl printed the table (forged rows, a repainted screen), and a
 * client name that was not UTF-8 made gmbctl --json drop the whole
 * session row, so a session could hide from the operator's tools.  Now
 * the rows carry them escaped (\xHH), as the log does. */
START_TEST(status_row_text_escaped) {
  struct fx f;
  fx_open_ini(&f, "host:16MiB", NULL);
  struct wire_request req;
  memset(&req, 0, sizeof req);
  req.kind = WIRE_HELLO;
  req.u.hello.version = WIRE_PROTOCOL_VERSION;
  snprintf(req.u.hello.client, sizeof req.u.hello.client,
           "job\x1b[2J\n\xff\xfe");
  struct wire_reply rep;
  ck_assert_int_eq(fx_request(&f, "e", 1001, &req, &rep), 1);
  ck_assert_int_eq(rep.status, 0);
  struct gmb_session *s =
      gmb__session_find(f.b.sessions, (const uint8_t *)"e", 1);
  ck_assert_ptr_nonnull(s);
  ck_assert_int_eq(fx_sleep_note(&f, "e", 1001, "kv\r\x1b]0;x\x07", 1, 0, 0),
                   0);
  ck_assert_int_eq(fx_sleep_note(&f, "e", 1001, "w\xc3\xa9", 1, 0, 0), 0);
  status(&f, &rep);
  const struct wire_session_row *row = session_of(&rep.u.admin_status, s);
  ck_assert_msg(printable(row->client), "client '%s'", row->client);
  ck_assert_msg(printable(row->paused), "paused '%s'", row->paused);
  ck_assert_str_eq(row->client, "job\\x1b[2J\\x0a\\xff\\xfe");
  ck_assert_str_eq(row->paused, "kv\\x0d\\x1b]0;x\\x07,w\xc3\xa9");
  gmb__wire_reply_clear(&rep);
  fx_close(&f);
}
END_TEST

START_TEST(sessions_check_catches_drift) {
  struct scene s;
  scene_open(&s);
  ck_assert_int_eq(gmb__tenant_sessions_check(s.a1->tenant), 0);
  s.a2->used += 512;
  ck_assert_int_eq(gmb__tenant_sessions_check(s.a1->tenant), 1);
  ck_assert_int_eq(gmb__core_check(&s.f.b), 1);
  s.a2->used -= 512;
  s.b2->tenant->n_sessions++;
  ck_assert_int_eq(gmb__tenant_sessions_check(s.b2->tenant), 1);
  s.b2->tenant->n_sessions--;
  fx_close(&s.f);
}
END_TEST

static Suite *observe_suite(void) {
  Suite *s = suite_create("observe");
  TCase *tc = tcase_create("status");
  tcase_add_test(tc, status_cached_per_tenant_and_session);
  tcase_add_test(tc, status_sessions_by_tenant_then_id);
  tcase_add_test(tc, cached_capped_after_free);
  tcase_add_test(tc, no_sessions_no_rows);
  tcase_add_test(tc, trim_totals_survive_session_end);
  tcase_add_test(tc, snapshot_status_has_sessions_and_cached);
  tcase_add_test(tc, sessions_check_catches_drift);
  tcase_add_test(tc, status_row_text_escaped);
  suite_add_tcase(s, tc);

  tc = tcase_create("metrics");
  tcase_add_test(tc, metrics_cached_and_trim_per_tenant);
  tcase_add_test(tc, vmm_in_used_row_and_metrics);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) { return check_run(observe_suite()); }
