/*
 * check_sleep.c - broker/sleep.c and its part in reclaim.c, driven through
 * the dispatcher with the broker fixture (no sockets): who is asked to
 * pause and in which order (lowest priority, longest idle, largest offer;
 * never a higher priority than the requester's, never the requester's
 * tenant, never below a reservation), sleep_wait_ms 0, an ask left
 * unanswered, SleepNote's account and host_quota, the 64-record bound, a
 * session that ends paused, and operators' pause and resume events.  The
 * fixture runs the consistency checks (gmb__sleep_check among them) after
 * every request.
 */
#include <check.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "admin.h"
#include "broker_fixture.h"
#include "check_main.h"
#include "observe.h"
#include "reclaim.h"
#include "sleep.h"
#include "tenant.h"
#include "util.h"

#define MIB GMB_MIB

/* `rid` holds `size` bytes (one pinned allocation); returns its id. */
static uint64_t hold(struct fx *f, const char *rid, uid_t uid,
                     uint64_t size) {
  struct wire_reply rep;
  ck_assert_int_eq(fx_alloc(f, rid, uid, size, 0, 0, &rep), 1);
  ck_assert_msg(rep.status == 0, "hold %s: %s", rid, rep.message);
  return rep.u.alloc.id;
}

/* A Heartbeat from `rid` offering `pausable` bytes, idle for `idle_ms`,
 * and answering the last ask when `answered`: the offer as sent (a
 * client's word, as a hostile one would send it). */
static void offer_raw(struct fx *f, const char *rid, uid_t uid,
                      uint64_t pausable, uint64_t idle_ms, int answered) {
  struct wire_request req;
  memset(&req, 0, sizeof req);
  req.kind = WIRE_HEARTBEAT;
  req.sleep_pausable = pausable;
  req.sleep_idle_ms = idle_ms;
  req.trim_answered = answered;
  struct wire_reply rep;
  ck_assert_int_eq(fx_request(f, rid, uid, &req, &rep), 0);
}

/* The same from an honest client: its session made at least `idle_ms`
 * ago. */
static void offer(struct fx *f, const char *rid, uid_t uid, uint64_t pausable,
                  uint64_t idle_ms, int answered) {
  fx_age(gmb__session_find(f->b.sessions, (const uint8_t *)rid, strlen(rid)),
         idle_ms);
  offer_raw(f, rid, uid, pausable, idle_ms, answered);
}

/* An Alloc held (not answered at once); returns its request id. */
static uint64_t held(struct fx *f, const char *rid, uid_t uid,
                     uint64_t size) {
  struct wire_reply rep;
  memset(&rep, 0, sizeof rep);
  ck_assert_msg(fx_alloc(f, rid, uid, size, 0, 0, &rep) == 0,
                "answered at once: status %d %s", rep.status, rep.message);
  return f->next_req - 1;
}

/* Tenants l, m (the asked) and r (the requester), uids 1001 to 1003, on
 * 16 MiB with sleep_wait_ms 500 and no other reclaim. */
static void open_lmr(struct fx *f) {
  fx_open_ini(f, "host:16MiB",
              FX_INI_OFF "sleep_wait_ms = 500\n"
              "[tenant:l]\nuids = 1001\n"
              "[tenant:m]\nuids = 1002\n"
              "[tenant:r]\nuids = 1003\n");
}

/* The session of client `rid`. */
static struct gmb_session *sess(struct fx *f, const char *rid) {
  struct gmb_session *s = gmb__session_find(f->b.sessions,
                                            (const uint8_t *)rid,
                                            strlen(rid));
  ck_assert_ptr_nonnull(s);
  return s;
}

/* The k-th EVENT_SLEEP sent (its rid and bytes), or NULL. */
static const char *sleep_ask(const struct fx *f, size_t k, uint64_t *bytes) {
  for (size_t i = 0; i < f->n_sent; i++) {
    const struct fx_sent *s = &f->sent[i];
    if (s->rep.kind != WIRE_EVENT || s->rep.u.event.kind != WIRE_EVENT_SLEEP)
      continue;
    if (k-- == 0) {
      if (bytes) *bytes = s->rep.u.event.bytes;
      ck_assert_uint_eq(s->rep.u.event.mode, WIRE_SLEEP_ASK);
      return s->rid;
    }
  }
  return NULL;
}


START_TEST(order_priority_idle_then_offer) {
  struct fx f;
  fx_open_ini(&f, "host:32MiB",
              FX_INI_OFF
              "[tenant:low]\nuids = 1001\npriority = -10\n"
              "[tenant:mid]\nuids = 1002\npriority = 0\n"
              "[tenant:high]\nuids = 1003\npriority = 10\n"
              "[tenant:req]\nuids = 1004\npriority = 5\n");
  fx_hello(&f, "a", 1003, "high");
  fx_hello(&f, "b", 1001, "low");
  fx_hello(&f, "c", 1001, "low");
  fx_hello(&f, "d", 1002, "mid");
  fx_hello(&f, "e", 1004, "req");
  fx_hello(&f, "g", 1004, "req");
  hold(&f, "a", 1003, 6 * MIB);
  hold(&f, "b", 1001, 6 * MIB);
  hold(&f, "c", 1001, 4 * MIB);
  hold(&f, "d", 1002, 6 * MIB);
  hold(&f, "g", 1004, 2 * MIB);
  offer(&f, "a", 1003, 6 * MIB, 100000, 0); /* higher priority: never */
  offer(&f, "b", 1001, 6 * MIB, 1000, 0);   /* low, idle 1 s, larger */
  offer(&f, "c", 1001, 4 * MIB, 5000, 0);   /* low, idle longer: first */
  offer(&f, "d", 1002, 6 * MIB, 100000, 0); /* mid: after the low ones */
  offer(&f, "g", 1004, 2 * MIB, 100000, 0); /* the requester's tenant */
  /* 24 MiB held, 8 of room: 20 MiB lacks 12. */
  held(&f, "e", 1004, 20 * MIB);
  uint64_t bytes;
  ck_assert_str_eq(sleep_ask(&f, 0, &bytes), "c");
  ck_assert_uint_eq(bytes, 4 * MIB);
  ck_assert_str_eq(sleep_ask(&f, 1, &bytes), "b");
  ck_assert_uint_eq(bytes, 6 * MIB);
  ck_assert_str_eq(sleep_ask(&f, 2, &bytes), "d");
  ck_assert_uint_eq(bytes, 2 * MIB);
  ck_assert_ptr_null(sleep_ask(&f, 3, NULL));
  ck_assert_uint_eq(fx_tenant(&f, "low")->sleep_asks, 2);
  ck_assert_uint_eq(fx_tenant(&f, "high")->sleep_asks, 0);
  ck_assert_uint_eq(fx_tenant(&f, "req")->sleep_asks, 0);
  fx_close(&f);
}
END_TEST

/* Never below a reservation: keep (reserve 6 MiB) holds 8 and offers 8;
 * it is asked 2. */
START_TEST(reservation_never_asked_below) {
  struct fx f;
  fx_open_ini(&f, "host:16MiB",
              FX_INI_OFF
              "[tenant:keep]\nuids = 1001\nreserve = 6MiB\n"
              "[tenant:other]\nuids = 1002\n"
              "[tenant:req]\nuids = 1003\n");
  fx_hello(&f, "a", 1001, "keep");
  fx_hello(&f, "b", 1002, "other");
  fx_hello(&f, "c", 1003, "req");
  hold(&f, "a", 1001, 8 * MIB);
  hold(&f, "b", 1002, 4 * MIB);
  offer(&f, "a", 1001, 8 * MIB, 1000, 0);
  offer(&f, "b", 1002, 4 * MIB, 10, 0);
  /* 12 held, 4 of room: 8 MiB lacks 4: a gives 2 (its reservation), b 2. */
  held(&f, "c", 1003, 8 * MIB);
  uint64_t bytes;
  ck_assert_str_eq(sleep_ask(&f, 0, &bytes), "a");
  ck_assert_uint_eq(bytes, 2 * MIB);
  ck_assert_str_eq(sleep_ask(&f, 1, &bytes), "b");
  ck_assert_uint_eq(bytes, 2 * MIB);
  fx_close(&f);
}
END_TEST

/* sleep_wait_ms 0: nobody is asked to sleep, the refusal is at once; an
 * offer that cannot cover what is missing asks nobody either. */
START_TEST(nothing_asked_when_off_or_short) {
  struct fx f;
  fx_open_ini(&f, "host:16MiB", FX_INI_OFF "sleep_wait_ms = 0\n");
  fx_hello(&f, "a", 1001, "");
  fx_hello(&f, "b", 1002, "");
  hold(&f, "a", 1001, 12 * MIB);
  offer(&f, "a", 1001, 12 * MIB, 1000, 0);
  struct wire_reply rep;
  ck_assert_int_eq(fx_alloc(&f, "b", 1002, 8 * MIB, 0, 0, &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_NOMEM);
  ck_assert_ptr_null(sleep_ask(&f, 0, NULL));
  fx_close(&f);

  fx_open_ini(&f, "host:16MiB", FX_INI_OFF);
  fx_hello(&f, "a", 1001, "");
  fx_hello(&f, "b", 1002, "");
  hold(&f, "a", 1001, 12 * MIB);
  offer(&f, "a", 1001, 2 * MIB, 1000, 0);
  ck_assert_int_eq(fx_alloc(&f, "b", 1002, 8 * MIB, 0, 0, &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_NOMEM);
  ck_assert_ptr_null(sleep_ask(&f, 0, NULL));
  fx_close(&f);
}
END_TEST

/* An ask left unanswered: the request falls through at the bound, the
 * session counts an ask ignored and is not asked again meanwhile. */
START_TEST(unanswered_ask_bounded) {
  struct fx f;
  fx_open_ini(&f, "host:16MiB", FX_INI_OFF "sleep_wait_ms = 500\n");
  fx_hello(&f, "a", 1001, "");
  fx_hello(&f, "b", 1002, "");
  hold(&f, "a", 1001, 12 * MIB);
  offer(&f, "a", 1001, 12 * MIB, 1000, 0);
  uint64_t req = held(&f, "b", 1002, 8 * MIB);
  ck_assert_str_eq(sleep_ask(&f, 0, NULL), "a");
  /* Before the bound nothing is answered; after it, b is refused. */
  gmb__reclaim_expire(&f.b, gmb__now_ns() + 100 * GMB_NS_PER_MS);
  const struct fx_sent *last = fx_last_to(&f, "b");
  ck_assert(last == NULL || last->rep.id != req);
  gmb__reclaim_expire(&f.b, gmb__now_ns() + 600 * GMB_NS_PER_MS);
  last = fx_last_to(&f, "b");
  ck_assert_ptr_nonnull(last);
  ck_assert_uint_eq(last->rep.id, req);
  ck_assert_int_eq(last->rep.status, GMB_E_NOMEM);
  struct gmb_session *a = sess(&f, "a");
  ck_assert_uint_eq(a->trim_ignored, 1);
  ck_assert_uint_eq(a->ask_bytes, 0);
  /* In its pause: a second request asks nobody. */
  struct wire_reply rep;
  ck_assert_int_eq(fx_alloc(&f, "b", 1002, 8 * MIB, 0, 0, &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_NOMEM);
  ck_assert_ptr_null(sleep_ask(&f, 1, NULL));
  fx_close(&f);
}
END_TEST

/* An ask answered short: "l" claims the longest idle and a large offer,
 * and answers each ask by freeing one small allocation (taken again
 * between asks), far less than it was asked.  Before, giving anything
 * reset its run of asks that gave nothing, so it was asked first for every
 * request and "m", which holds its offer, never was: the requester was
 * refused each time.  A short answer now counts in the run (the first in
 * a row forgiven, as for an answer that gave nothing), so the second
 * pauses "l" and the next request asks "m". */
START_TEST(short_answers_pause_the_session) {
  struct fx f;
  open_lmr(&f);
  fx_hello(&f, "l", 1001, "l");
  fx_hello(&f, "m", 1002, "m");
  fx_hello(&f, "r", 1003, "r");
  hold(&f, "l", 1001, 8 * MIB);
  uint64_t small = hold(&f, "l", 1001, MIB);
  hold(&f, "l", 1001, MIB);
  hold(&f, "m", 1002, 4 * MIB);
  struct gmb_session *l = sess(&f, "l");
  for (int round = 0; round < 2; round++) {
    offer(&f, "l", 1001, 10 * MIB, 86400000, 0);
    offer(&f, "m", 1002, 4 * MIB, 1000, 0);
    held(&f, "r", 1003, 4 * MIB);
    ck_assert_str_eq(sleep_ask(&f, (size_t)round, NULL), "l");
    ck_assert_int_eq(fx_free(&f, "l", 1001, small), 0);
    offer(&f, "l", 1001, 10 * MIB, 86400000, 1);
    ck_assert_uint_eq(l->ask_bytes, 0);
    small = hold(&f, "l", 1001, MIB);
  }
  ck_assert_uint_eq(l->ask_ignored_run, 2);
  ck_assert_uint_gt(l->ask_skip_ns, gmb__now_ns());
  offer(&f, "l", 1001, 10 * MIB, 86400000, 0);
  offer(&f, "m", 1002, 4 * MIB, 1000, 0);
  held(&f, "r", 1003, 4 * MIB);
  ck_assert_str_eq(sleep_ask(&f, 2, NULL), "m");
  ck_assert_int_eq(gmb__sleep_check(&f.b), 0);
  fx_close(&f);
}
END_TEST

/* Many sessions of one tenant, each holding a little and offering it,
 * claiming the longest idle, none answering.  The pause after an ask that
 * gave nothing was the session's own: the next request asked the
 * tenant's next session, which ignored it too, so with enough sessions
 * every request waited out sleep_wait_ms and "m", which holds its offer,
 * was never asked.  The pause now holds for the whole tenant, and its run
 * doubles across its sessions. */
START_TEST(many_sessions_of_a_tenant_share_its_pause) {
  struct fx f;
  open_lmr(&f);
  const char *liars[] = {"l0", "l1", "l2", "l3"};
  for (int i = 0; i < 4; i++) {
    fx_hello(&f, liars[i], 1001, "l");
    hold(&f, liars[i], 1001, 2 * MIB);
    offer(&f, liars[i], 1001, 2 * MIB, 86400000, 0);
  }
  fx_hello(&f, "m", 1002, "m");
  fx_hello(&f, "r", 1003, "r");
  hold(&f, "m", 1002, 6 * MIB);
  offer(&f, "m", 1002, 6 * MIB, 1000, 0);
  /* 14 MiB held, 2 of room: 4 MiB lacks 2, which l0 is asked. */
  held(&f, "r", 1003, 4 * MIB);
  ck_assert_str_eq(sleep_ask(&f, 0, NULL), "l0");
  ck_assert_ptr_null(sleep_ask(&f, 1, NULL));
  gmb__reclaim_expire(&f.b, gmb__now_ns() + 600 * GMB_NS_PER_MS);
  struct gmb_tenant *l = fx_tenant(&f, "l");
  ck_assert_uint_gt(l->ask_skip_ns, gmb__now_ns());
  /* The next request asks m, not l1. */
  held(&f, "r", 1003, 4 * MIB);
  ck_assert_str_eq(sleep_ask(&f, 1, NULL), "m");
  ck_assert_ptr_null(sleep_ask(&f, 2, NULL));
  /* After the pause, l1 is asked and ignores it too: the tenant's run is
   * 2, so the pause is 2 s (l1's own first would be 1 s). */
  offer(&f, "m", 1002, 4 * MIB, 1000, 1);
  l->ask_skip_ns = 0;
  for (int i = 0; i < 4; i++)
    sess(&f, liars[i])->ask_skip_ns = 0;
  held(&f, "r", 1003, 4 * MIB);
  const char *who = sleep_ask(&f, 2, NULL);
  ck_assert_ptr_nonnull(who);
  ck_assert_msg(who[0] == 'l', "asked %s", who);
  uint64_t t0 = gmb__now_ns();
  gmb__reclaim_expire(&f.b, t0 + 600 * GMB_NS_PER_MS);
  ck_assert_uint_ge(l->ask_skip_ns, t0 + 600 * GMB_NS_PER_MS +
                                        2 * GMB_NS_PER_S);
  ck_assert_int_eq(gmb__sleep_check(&f.b), 0);
  fx_close(&f);
}
END_TEST

/* A tenant's run counts the asks for other tenants' requests only: its
 * sessions serving one another (here l1's request, for which l0's cache
 * gives back all it was asked) neither end nor lengthen it, so a tenant
 * cannot clear the run its ignored asks built by feeding itself. */
START_TEST(own_tenant_asks_leave_its_run) {
  struct fx f;
  open_lmr(&f);
  fx_hello(&f, "l0", 1001, "l");
  fx_hello(&f, "l1", 1001, "l");
  fx_hello(&f, "m", 1002, "m");
  fx_hello(&f, "r", 1003, "r");
  uint64_t slab = hold(&f, "l0", 1001, 4 * MIB);
  hold(&f, "l1", 1001, 2 * MIB);
  hold(&f, "m", 1002, 6 * MIB);
  struct wire_request hb;
  memset(&hb, 0, sizeof hb);
  hb.kind = WIRE_HEARTBEAT;
  hb.cached_free = 4 * MIB;
  struct wire_reply rep;
  ck_assert_int_eq(fx_request(&f, "l0", 1001, &hb, &rep), 0);
  /* 12 MiB held, 4 of room: r's 6 lacks 2; l0 is asked and ignores it. */
  held(&f, "r", 1003, 6 * MIB);
  ck_assert_uint_eq(sess(&f, "l0")->ask_bytes, 2 * MIB);
  ck_assert_int_eq(sess(&f, "l0")->ask_other, 1);
  gmb__reclaim_expire(&f.b, gmb__now_ns() + 600 * GMB_NS_PER_MS);
  struct gmb_tenant *l = fx_tenant(&f, "l");
  ck_assert_uint_eq(l->ask_short_run, 1);
  /* The pauses over (as if they passed): l1's own request asks l0, which
   * gives back all of it. */
  l->ask_skip_ns = 0;
  sess(&f, "l0")->ask_skip_ns = 0;
  held(&f, "l1", 1001, 6 * MIB);
  ck_assert_uint_eq(sess(&f, "l0")->ask_bytes, 2 * MIB);
  ck_assert_int_eq(sess(&f, "l0")->ask_other, 0);
  ck_assert_int_eq(fx_free(&f, "l0", 1001, slab), 0);
  hb.cached_free = 0;
  hb.trim_answered = 1;
  ck_assert_int_eq(fx_request(&f, "l0", 1001, &hb, &rep), 0);
  ck_assert_uint_eq(sess(&f, "l0")->ask_bytes, 0);
  ck_assert_uint_eq(sess(&f, "l0")->ask_ignored_run, 0);
  ck_assert_uint_eq(l->ask_short_run, 1);
  fx_close(&f);
}
END_TEST

/* SleepNote: the account, host_quota over the tenant's sessions, a tag
 * paused twice (updated, not counted twice), a resume of a tag never
 * paused (nothing), the end of a paused session. */
START_TEST(note_account_and_host_quota) {
  struct fx f;
  fx_open_ini(&f, "host:16MiB", "[tenant:h]\nuids = 1001\n"
                                "host_quota = 6MiB\n");
  fx_hello(&f, "a", 1001, "h");
  fx_hello(&f, "b", 1001, "h");
  struct gmb_tenant *t = fx_tenant(&f, "h");
  ck_assert_uint_eq(t->host_quota, 6 * MIB);
  ck_assert_int_eq(fx_sleep_note(&f, "a", 1001, "w", 1, 4 * MIB, 4 * MIB), 0);
  ck_assert_int_eq(fx_sleep_note(&f, "b", 1001, "w", 1, 4 * MIB, 4 * MIB),
                   GMB_E_LIMIT);
  /* A discard. */
  ck_assert_int_eq(fx_sleep_note(&f, "b", 1001, "w", 1, 0, 4 * MIB), 0);
  ck_assert_int_eq(fx_sleep_note(&f, "a", 1001, "w", 1, 6 * MIB, 6 * MIB), 0);
  ck_assert_int_eq(fx_sleep_note(&f, "a", 1001, "w", 1, 7 * MIB, 6 * MIB),
                   GMB_E_LIMIT);
  ck_assert_uint_eq(t->host_bytes, 6 * MIB);
  ck_assert_uint_eq(t->paused_bytes, 10 * MIB);
  ck_assert_uint_eq(t->paused_tags, 2);
  ck_assert_uint_eq(t->pauses, 2);
  ck_assert_int_eq(fx_sleep_note(&f, "a", 1001, "never", 0, 0, 0), 0);
  ck_assert_int_eq(fx_sleep_note(&f, "a", 1001, "", 1, 0, 0), GMB_E_INVAL);
  ck_assert_int_eq(fx_sleep_note(&f, "a", 1001, "w", 0, 0, 0), 0);
  ck_assert_uint_eq(t->resumes, 1);
  ck_assert_uint_eq(t->host_bytes, 0);
  /* b ends paused: its record goes, its time is kept. */
  fx_end(&f, sess(&f, "b"));
  ck_assert_uint_eq(t->paused_tags, 0);
  ck_assert_uint_eq(t->paused_bytes, 0);
  ck_assert(gmb__sleep_tenant_seconds(t, gmb__now_ns()) >= 0.0);
  fx_close(&f);
}
END_TEST

/* At most GMB_SLEEP_TAGS_MAX records per session. */
START_TEST(note_records_bounded) {
  struct fx f;
  fx_open_ini(&f, "host:16MiB", NULL);
  fx_hello(&f, "a", 1001, "");
  char tag[16];
  for (int i = 0; i < GMB_SLEEP_TAGS_MAX; i++) {
    snprintf(tag, sizeof tag, "t%d", i);
    ck_assert_int_eq(fx_sleep_note(&f, "a", 1001, tag, 1, 0, 0), 0);
  }
  ck_assert_int_eq(fx_sleep_note(&f, "a", 1001, "one-more", 1, 0, 0),
                   GMB_E_LIMIT);
  /* An update. */
  ck_assert_int_eq(fx_sleep_note(&f, "a", 1001, "t3", 1, 0, 0), 0);
  fx_close(&f);
}
END_TEST

/* A SleepNote's figures are a client's word: a pause gives back at most
 * what the device holds, so host or device bytes past its capacity are
 * refused (GMB_E_INVAL) and the tenant's sums stay the sums of sane
 * records.  Before, UINT64_MAX (with no host_quota to bound it) wrapped
 * the tenant's sums, and the resume of that tag then tripped the broker's
 * "sleep sums drifted" assertion: any tenant could abort the broker.
 * Modes and `by` out of range are recorded as the defaults; a tag paused
 * and resumed at a high rate only counts. */
START_TEST(note_claims_bounded) {
  struct fx f;
  fx_open_ini(&f, "host:16MiB", "[tenant:h]\nuids = 1001\n");
  fx_hello(&f, "a", 1001, "h");
  fx_hello(&f, "b", 1001, "h");
  struct gmb_tenant *t = fx_tenant(&f, "h");
  ck_assert_uint_eq(t->host_quota, 0); /* named, no host_quota: no limit */
  const uint64_t cap = f.b.dev->capacity;
  ck_assert_int_eq(fx_sleep_note(&f, "a", 1001, "x", 1, UINT64_MAX,
                                 UINT64_MAX), GMB_E_INVAL);
  ck_assert_int_eq(fx_sleep_note(&f, "a", 1001, "x", 1, cap + 1, cap),
                   GMB_E_INVAL);
  ck_assert_int_eq(fx_sleep_note(&f, "a", 1001, "x", 1, cap, cap + 1),
                   GMB_E_INVAL);
  ck_assert_uint_eq(t->paused_tags, 0);
  /* The capacity itself is a figure a pause can give. */
  ck_assert_int_eq(fx_sleep_note(&f, "a", 1001, "x", 1, cap, cap), 0);
  ck_assert_int_eq(fx_sleep_note(&f, "a", 1001, "y", 1, 1, 1), 0);
  ck_assert_int_eq(fx_sleep_note(&f, "b", 1001, "x", 1, cap, cap), 0);
  /* An update of a paused tag past the bound keeps the old record. */
  ck_assert_int_eq(fx_sleep_note(&f, "a", 1001, "y", 1, UINT64_MAX, 1),
                   GMB_E_INVAL);
  ck_assert_uint_eq(t->host_bytes, 2 * cap + 1);
  ck_assert_uint_eq(t->paused_bytes, 2 * cap + 1);
  ck_assert_int_eq(fx_sleep_note(&f, "a", 1001, "x", 0, 0, 0), 0);
  ck_assert_uint_eq(t->host_bytes, cap + 1);
  /* Out of range mode and by: an offload by the application. */
  struct wire_request req;
  memset(&req, 0, sizeof req);
  req.kind = WIRE_SLEEP_NOTE;
  snprintf(req.u.sleep_note.tag, sizeof req.u.sleep_note.tag, "m");
  req.u.sleep_note.paused = 1;
  req.u.sleep_note.mode = UINT32_MAX;
  req.u.sleep_note.by = UINT32_MAX;
  struct wire_reply rep;
  ck_assert_int_eq(fx_request(&f, "a", 1001, &req, &rep), 1);
  ck_assert_int_eq(rep.status, 0);
  struct gmb_session *a = sess(&f, "a");
  struct gmb_sleep_tag *z = a->paused;
  while (z && strcmp(z->tag, "m") != 0) z = z->next;
  ck_assert_ptr_nonnull(z);
  ck_assert_uint_eq(z->mode, 0);
  ck_assert_uint_eq(z->by, WIRE_BY_APP);
  /* Flip-flop: each note is counted, nothing else grows. */
  for (int i = 0; i < 2000; i++) {
    ck_assert_int_eq(fx_sleep_note(&f, "b", 1001, "f", 1, MIB, MIB), 0);
    ck_assert_int_eq(fx_sleep_note(&f, "b", 1001, "f", 0, 0, 0), 0);
  }
  ck_assert_uint_eq(t->paused_tags, 3);
  ck_assert_int_eq(gmb__sleep_check(&f.b), 0);
  fx_end(&f, a);
  ck_assert_uint_eq(t->host_bytes, cap);
  fx_close(&f);
}
END_TEST

/* A session is asked to pause for at most what it holds: its offer is its
 * library's word, its used bytes the broker's.  Tenant l's session "a2"
 * holds nothing and offers 8 MiB, idle longest; before, it was asked the
 * 4 MiB (its tenant's other session holds 8) and could give none, while
 * "b", which holds its offer, waited its turn. */
START_TEST(ask_capped_by_what_it_holds) {
  struct fx f;
  open_lmr(&f);
  fx_hello(&f, "a1", 1001, "l");
  fx_hello(&f, "a2", 1001, "l");
  fx_hello(&f, "b", 1002, "m");
  fx_hello(&f, "r", 1003, "r");
  hold(&f, "a1", 1001, 8 * MIB);
  hold(&f, "b", 1002, 4 * MIB);
  offer(&f, "a2", 1001, 8 * MIB, 86400000, 0);
  offer(&f, "b", 1002, 4 * MIB, 1000, 0);
  /* 12 MiB held, 4 of room: 8 MiB lacks 4. */
  held(&f, "r", 1003, 8 * MIB);
  uint64_t bytes;
  ck_assert_str_eq(sleep_ask(&f, 0, &bytes), "b");
  ck_assert_uint_eq(bytes, 4 * MIB);
  ck_assert_ptr_null(sleep_ask(&f, 1, NULL));
  fx_close(&f);
}
END_TEST

/* Session s's row in the status (gmbctl status --json). */
static struct wire_session_row status_row(struct fx *f,
                                          const struct gmb_session *s) {
  struct wire_reply rep;
  memset(&rep, 0, sizeof rep);
  gmb__observe_status(&f->b, &rep);
  ck_assert_int_eq(rep.status, 0);
  struct wire_session_row row;
  memset(&row, 0, sizeof row);
  size_t i = 0;
  while (i < rep.u.admin_status.n_sessions &&
         rep.u.admin_status.session_rows[i].id != s->id)
    i++;
  ck_assert_uint_lt(i, rep.u.admin_status.n_sessions);
  row = rep.u.admin_status.session_rows[i];
  gmb__wire_reply_clear(&rep);
  return row;
}

/* A session has been idle no longer than it has existed.  "l" said Hello
 * just now and claims to have been idle for ever (UINT64_MAX ms); "m" was
 * made 5 s ago and has been idle since.  Before, l's claim was believed up
 * to a day, so it went ahead of every honestly idle session (and status
 * showed a day of idle for a session seconds old); now its idle time is
 * cut to its age and m, idle longest, is asked first. */
START_TEST(idle_claim_bounded_by_age) {
  struct fx f;
  open_lmr(&f);
  fx_hello(&f, "m", 1002, "m");
  fx_hello(&f, "l", 1001, "l");
  fx_hello(&f, "r", 1003, "r");
  hold(&f, "l", 1001, 6 * MIB);
  hold(&f, "m", 1002, 6 * MIB);
  offer(&f, "m", 1002, 6 * MIB, 5000, 0);
  struct gmb_session *l = sess(&f, "l");
  offer_raw(&f, "l", 1001, 6 * MIB, UINT64_MAX, 0);
  ck_assert_uint_ge(l->sleep_active_ns, l->born_ns);
  uint64_t age_ms = (gmb__now_ns() - l->born_ns) / GMB_NS_PER_MS;
  ck_assert_uint_le(status_row(&f, l).sleep_idle_ms, age_ms);
  offer_raw(&f, "l", 1001, 6 * MIB, 86400000, 0);
  ck_assert_uint_ge(l->sleep_active_ns, l->born_ns);
  /* 12 MiB held, 4 of room: 8 MiB lacks 4, asked of m alone. */
  held(&f, "r", 1003, 8 * MIB);
  uint64_t bytes;
  ck_assert_str_eq(sleep_ask(&f, 0, &bytes), "m");
  ck_assert_uint_eq(bytes, 4 * MIB);
  ck_assert_ptr_null(sleep_ask(&f, 1, NULL));
  fx_close(&f);
}
END_TEST

/* An offer is a pause's bytes, at most the device's capacity, as a
 * SleepNote's figures are (note_claims_bounded): past it the offer is
 * refused (recorded as none, so status never shows it and the session is
 * not asked for it), while the request it rode on is served.  Before, any
 * figure was kept and shown. */
START_TEST(offer_past_capacity_refused) {
  struct fx f;
  open_lmr(&f);
  fx_hello(&f, "l", 1001, "l");
  fx_hello(&f, "r", 1003, "r");
  hold(&f, "l", 1001, 12 * MIB);
  struct gmb_session *l = sess(&f, "l");
  const uint64_t cap = f.b.dev->capacity;
  fx_age(l, 1000);
  offer_raw(&f, "l", 1001, cap, 1000, 0);
  ck_assert_uint_eq(l->sleep_pausable, cap);
  ck_assert_uint_eq(status_row(&f, l).sleep_pausable, cap);
  offer_raw(&f, "l", 1001, cap + 1, 1000, 0);
  ck_assert_uint_eq(l->sleep_pausable, 0);
  ck_assert_uint_eq(status_row(&f, l).sleep_pausable, 0);
  offer_raw(&f, "l", 1001, UINT64_MAX, 1000, 0);
  ck_assert_uint_eq(status_row(&f, l).sleep_pausable, 0);
  ck_assert_uint_eq(status_row(&f, l).sleep_idle_ms, 0);
  /* No offer: nobody is asked, the request falls through. */
  struct wire_reply rep;
  ck_assert_int_eq(fx_alloc(&f, "r", 1003, 8 * MIB, 0, 0, &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_NOMEM);
  ck_assert_ptr_null(sleep_ask(&f, 0, NULL));
  fx_close(&f);
}
END_TEST

/* A tenant's paused tag names (/is_sleeping's list): each once over its
 * sessions, in byte order, the first `max` listed, and a name past the
 * listed ones still found. */
START_TEST(tenant_tags_listed_once) {
  struct fx f;
  fx_open_ini(&f, "host:16MiB", "[tenant:h]\nuids = 1001\n");
  fx_hello(&f, "a", 1001, "h");
  fx_hello(&f, "b", 1001, "h");
  const char *a_tags[] = {"w", "kv", "z9"}, *b_tags[] = {"kv", "aa", "w"};
  for (int i = 0; i < 3; i++) {
    ck_assert_int_eq(fx_sleep_note(&f, "a", 1001, a_tags[i], 1, 0, MIB), 0);
    ck_assert_int_eq(fx_sleep_note(&f, "b", 1001, b_tags[i], 1, 0, MIB), 0);
  }
  struct gmb_tenant *t = fx_tenant(&f, "h");
  const char *names[8];
  int found = -1;
  ck_assert_int_eq(gmb__sleep_tenant_tags(t, names, 8, "kv", &found), 4);
  ck_assert_int_eq(found, 1);
  const char *want[] = {"aa", "kv", "w", "z9"};
  for (int i = 0; i < 4; i++) ck_assert_str_eq(names[i], want[i]);
  /* Two listed; z9 is past them and still found. */
  ck_assert_int_eq(gmb__sleep_tenant_tags(t, names, 2, "z9", &found), 2);
  ck_assert_int_eq(found, 1);
  ck_assert_str_eq(names[1], "kv");
  ck_assert_int_eq(gmb__sleep_tenant_tags(t, names, 8, "nope", &found), 4);
  ck_assert_int_eq(found, 0);
  ck_assert_int_eq(gmb__sleep_tenant_tags(t, names, 8, NULL, NULL), 4);
  fx_close(&f);
}
END_TEST

/* AdminPause/admin_resume: every session of the tenant gets the event with
 * the tag and mode; an unknown tenant is refused. */
START_TEST(admin_pause_tells_sessions) {
  struct fx f;
  fx_open_ini(&f, "host:16MiB", NULL);
  fx_hello(&f, "a", 1001, "t");
  fx_hello(&f, "b", 1001, "t");
  fx_hello(&f, "c", 1002, "u");
  struct wire_request req;
  memset(&req, 0, sizeof req);
  req.kind = WIRE_ADMIN_PAUSE;
  snprintf(req.u.admin_pause.tenant, sizeof req.u.admin_pause.tenant, "t");
  snprintf(req.u.admin_pause.tag, sizeof req.u.admin_pause.tag, "kv");
  req.u.admin_pause.discard = 1;
  struct gmb_peer p = fx_peer("ctl", geteuid());
  struct wire_reply rep;
  ck_assert_int_eq(gmb__admin(&f.b, &p, &req, &rep), 1);
  ck_assert_int_eq(rep.status, 0);
  ck_assert_uint_eq(rep.u.pause.sessions, 2);
  for (const char *rid = "ab"; *rid; rid++) {
    char r[2] = {*rid, 0};
    const struct fx_sent *s = fx_last_to(&f, r);
    ck_assert_ptr_nonnull(s);
    ck_assert_int_eq(s->rep.u.event.kind, WIRE_EVENT_SLEEP);
    ck_assert_str_eq(s->rep.u.event.tag, "kv");
    ck_assert_uint_eq(s->rep.u.event.mode, GMB_PAUSE_DISCARD);
  }
  ck_assert_ptr_null(fx_last_to(&f, "c"));
  req.kind = WIRE_ADMIN_RESUME;
  req.u.admin_pause.tag[0] = '\0';
  ck_assert_int_eq(gmb__admin(&f.b, &p, &req, &rep), 1);
  ck_assert_uint_eq(rep.u.pause.sessions, 2);
  ck_assert_int_eq(fx_last_to(&f, "a")->rep.u.event.kind, WIRE_EVENT_WAKE);
  snprintf(req.u.admin_pause.tenant, sizeof req.u.admin_pause.tenant, "nope");
  ck_assert_int_eq(gmb__admin(&f.b, &p, &req, &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_NOENT);
  fx_close(&f);
}
END_TEST

static Suite *sleep_suite(void) {
  Suite *s = suite_create("sleep");
  TCase *tc = tcase_create("asks");
  tcase_add_test(tc, order_priority_idle_then_offer);
  tcase_add_test(tc, reservation_never_asked_below);
  tcase_add_test(tc, nothing_asked_when_off_or_short);
  tcase_add_test(tc, unanswered_ask_bounded);
  tcase_add_test(tc, ask_capped_by_what_it_holds);
  tcase_add_test(tc, idle_claim_bounded_by_age);
  tcase_add_test(tc, offer_past_capacity_refused);
  tcase_add_test(tc, short_answers_pause_the_session);
  tcase_add_test(tc, many_sessions_of_a_tenant_share_its_pause);
  tcase_add_test(tc, own_tenant_asks_leave_its_run);
  suite_add_tcase(s, tc);
  tc = tcase_create("account");
  tcase_add_test(tc, note_account_and_host_quota);
  tcase_add_test(tc, note_records_bounded);
  tcase_add_test(tc, note_claims_bounded);
  tcase_add_test(tc, tenant_tags_listed_once);
  tcase_add_test(tc, admin_pause_tells_sessions);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) { return check_run(sleep_suite()); }
