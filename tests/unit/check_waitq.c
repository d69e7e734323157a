/*
 * check_waitq.c - the wait queue: allocations waiting for memory, served
 * by priority then arrival, with a blocked head holding back the smaller
 * requests behind it except those within their tenant's reservation.
 *
 * A whole broker runs on an 8 MiB host device with compaction off
 * (broker_fixture.h).  Requests reach the queue through Alloc with a
 * timeout (fx_alloc), or are put there with gmb__waitq_add() when a test
 * needs what dispatch does not make (waiters held only for a compaction
 * run, deadlines known to the test).  Every size is a multiple of 2 MiB,
 * so each allocation has a large segment of its own and "fits" means
 * "the device has that much left".  Answers are read from the tap, by the
 * request id they carry; the queue's counters (b->waitq.n, .after_compact,
 * each tenant's `waiting`) are checked as the queue changes.  Requests
 * held while caches are asked back (gmb__waitq_hold, reclaim.c), and
 * those held for their tenant's quota (gmb__waitq_hold_quota), are
 * covered at the end; check_reclaim.c drives them through the asks.
 */
#include <check.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "broker_fixture.h"
#include "check_main.h"
#include "observe.h"
#include "tenant.h"
#include "util.h"
#include "waitq.h"

#define MIB GMB_MIB
#define DEV "host:8MiB"
#define NO_COMPACT "[broker]\ncompaction = off\n"
#define LONG_MS 60000 /* a deadline no test reaches */

/* ---- helpers ---------------------------------------------------------- */

/* An allocation answered at once; returns its id. */
static uint64_t hold(struct fx *f, const char *rid, uid_t uid,
                     uint64_t size) {
  struct wire_reply rep;
  ck_assert_int_eq(fx_alloc(f, rid, uid, size, 0, 0, &rep), 1);
  ck_assert_msg(rep.status == 0, "hold %s: %s", rid, rep.message);
  ck_assert_int_eq(rep.kind, WIRE_ALLOC);
  return rep.u.alloc.id;
}

/* An Alloc that waits (not answered now); returns its request id. */
static uint64_t wait_for(struct fx *f, const char *rid, uid_t uid,
                         uint64_t size, int timeout_ms) {
  struct wire_reply rep;
  memset(&rep, 0, sizeof rep);
  ck_assert_msg(fx_alloc(f, rid, uid, size, 0, timeout_ms, &rep) == 0,
                "answered at once: status %d %s", rep.status, rep.message);
  return f->next_req - 1;
}

/* Answers the tap recorded: replies, not events (a free that gives a
 * segment back tells its mappers with an event). */
static size_t n_answers(const struct fx *f) {
  size_t n = 0;
  for (size_t i = 0; i < f->n_sent; i++)
    n += f->sent[i].rep.kind != WIRE_EVENT;
  return n;
}

/* The i-th answer the tap recorded. */
static const struct wire_reply *answer(const struct fx *f, size_t i,
                                       const char **rid) {
  size_t left = i;
  for (size_t k = 0; k < f->n_sent; k++) {
    if (f->sent[k].rep.kind == WIRE_EVENT) continue;
    if (left-- == 0) {
      ck_assert_int_eq(f->sent[k].sock, GMB_SOCK_CLIENT);
      if (rid) *rid = f->sent[k].rid;
      return &f->sent[k].rep;
    }
  }
  ck_abort_msg("no answer %zu: %zu in all", i, n_answers(f));
  return NULL;
}

/* Answers to client `rid`. */
static size_t sent_to(const struct fx *f, const char *rid) {
  size_t n = 0;
  for (size_t i = 0; i < f->n_sent; i++)
    n += f->sent[i].rep.kind != WIRE_EVENT && strcmp(f->sent[i].rid, rid) == 0;
  return n;
}

/* The i-th answer is `rid`'s request `req_id` failing with `status`. */
static const struct wire_reply *assert_failed_at(const struct fx *f, size_t i,
                                                 const char *rid,
                                                 uint64_t req_id,
                                                 int status) {
  const char *to;
  const struct wire_reply *r = answer(f, i, &to);
  ck_assert_str_eq(to, rid);
  ck_assert_uint_eq(r->id, req_id);
  ck_assert_int_eq(r->status, status);
  return r;
}

/* The i-th answer is `rid`'s request `req_id` served with `size` bytes. */
static void assert_served_at(const struct fx *f, size_t i, const char *rid,
                             uint64_t req_id, uint64_t size) {
  const char *to;
  const struct wire_reply *r = answer(f, i, &to);
  ck_assert_str_eq(to, rid);
  ck_assert_uint_eq(r->id, req_id);
  ck_assert_msg(r->status == 0, "%s: %s", rid, r->message);
  ck_assert_int_eq(r->kind, WIRE_ALLOC);
  ck_assert_uint_eq(r->u.alloc.size, size);
  ck_assert_uint_ne(r->u.alloc.id, 0);
}

/* The 8 MiB device filled by client `rid` with four 2 MiB allocations. */
static void fill(struct fx *f, const char *rid, uid_t uid, uint64_t ids[4]) {
  for (int i = 0; i < 4; i++) ids[i] = hold(f, rid, uid, 2 * MIB);
  ck_assert_uint_eq(f->b.dev->in_use, 8 * MIB);
}

static void free_ok(struct fx *f, const char *rid, uid_t uid, uint64_t id) {
  ck_assert_int_eq(fx_free(f, rid, uid, id), 0);
}

/* A broker on DEV with lo and hi (PRIO_INI's), room for many waiters a
 * session, and the device filled by "a" (ids). */
static void open_many(struct fx *f, struct gmb_session **lo,
                      struct gmb_session **hi, uint64_t ids[4]) {
  fx_open_ini(f, DEV, "[broker]\ncompaction = off\n"
                      "max_waiters_per_session = 2048\n"
                      "max_waiters_per_tenant = 2048\n"
                      "[tenant:lo]\nuids = 1002\n"
                      "[tenant:hi]\nuids = 1003\npriority = 10\n");
  fx_hello(f, "a", 1001, "");
  *lo = fx_hello(f, "lo", 1002, "lo");
  *hi = fx_hello(f, "hi", 1003, "hi");
  fill(f, "a", 1001, ids);
}

/* n waiters of session s for 2 MiB, requests 1000 on. */
static void queue_many(struct fx *f, struct gmb_session *s, int n) {
  for (int i = 0; i < n; i++)
    ck_assert_int_eq(gmb__waitq_add(&f->b, s, 1000 + (uint64_t)i, 2 * MIB,
                                    0, 0, 0), 0);
}

/* ---- order -------------------------------------------------------------- */

START_TEST(fifo_within_priority) {
  struct fx f;
  fx_open_ini(&f, DEV, NO_COMPACT);
  struct gmb_session *a = fx_hello(&f, "a", 1001, "");
  struct gmb_session *b = fx_hello(&f, "b", 1002, "");
  fx_hello(&f, "c", 1003, "");
  uint64_t ids[4];
  fill(&f, "a", 1001, ids);
  uint64_t rb = wait_for(&f, "b", 1002, 2 * MIB, LONG_MS);
  uint64_t rc = wait_for(&f, "c", 1003, 2 * MIB, LONG_MS);
  ck_assert_uint_eq(f.b.waitq.n, 2);
  ck_assert_uint_eq(b->tenant->waiting, 1);
  ck_assert_uint_eq(a->tenant->waiting, 0);
  ck_assert_uint_eq(n_answers(&f), 0);
  free_ok(&f, "a", 1001, ids[0]); /* room for one: the first to come */
  ck_assert_uint_eq(n_answers(&f), 1);
  assert_served_at(&f, 0, "b", rb, 2 * MIB);
  ck_assert_uint_eq(b->tenant->waiting, 0);
  ck_assert_uint_eq(f.b.waitq.n, 1);
  free_ok(&f, "a", 1001, ids[1]);
  ck_assert_uint_eq(n_answers(&f), 2);
  assert_served_at(&f, 1, "c", rc, 2 * MIB);
  ck_assert_uint_eq(f.b.waitq.n, 0);
  ck_assert_ptr_null(f.b.waitq.head);
  ck_assert_ptr_null(f.b.waitq.tail);
  fx_close(&f);
}
END_TEST

START_TEST(fifo_all_served_by_one_free) {
  struct fx f;
  fx_open_ini(&f, DEV, NO_COMPACT);
  fx_hello(&f, "a", 1001, "");
  fx_hello(&f, "b", 1002, "");
  fx_hello(&f, "c", 1003, "");
  uint64_t big = hold(&f, "a", 1001, 8 * MIB);
  uint64_t rb = wait_for(&f, "b", 1002, 2 * MIB, LONG_MS);
  uint64_t rc = wait_for(&f, "c", 1003, 4 * MIB, LONG_MS);
  uint64_t rb2 = wait_for(&f, "b", 1002, 2 * MIB, LONG_MS);
  free_ok(&f, "a", 1001, big); /* 8 MiB back: all three, in order */
  ck_assert_uint_eq(n_answers(&f), 3);
  assert_served_at(&f, 0, "b", rb, 2 * MIB);
  assert_served_at(&f, 1, "c", rc, 4 * MIB);
  assert_served_at(&f, 2, "b", rb2, 2 * MIB);
  ck_assert_uint_eq(f.b.waitq.n, 0);
  fx_close(&f);
}
END_TEST

#define PRIO_INI                                                          \
  NO_COMPACT "[tenant:lo]\nuids = 1002\n"                                 \
             "[tenant:hi]\nuids = 1003\npriority = 10\n"

START_TEST(priority_higher_served_first) {
  struct fx f;
  fx_open_ini(&f, DEV, PRIO_INI);
  fx_hello(&f, "a", 1001, "");
  struct gmb_session *lo = fx_hello(&f, "lo", 1002, "lo");
  struct gmb_session *hi = fx_hello(&f, "hi", 1003, "hi");
  ck_assert_int_eq(hi->tenant->priority, 10);
  uint64_t ids[4];
  fill(&f, "a", 1001, ids);
  uint64_t rlo = wait_for(&f, "lo", 1002, 2 * MIB, LONG_MS);
  uint64_t rhi = wait_for(&f, "hi", 1003, 2 * MIB, LONG_MS);
  ck_assert_uint_eq(lo->tenant->waiting, 1);
  ck_assert_uint_eq(hi->tenant->waiting, 1);
  free_ok(&f, "a", 1001, ids[0]); /* the later, higher one goes first */
  ck_assert_uint_eq(n_answers(&f), 1);
  assert_served_at(&f, 0, "hi", rhi, 2 * MIB);
  ck_assert_uint_eq(sent_to(&f, "lo"), 0);
  free_ok(&f, "a", 1001, ids[1]);
  ck_assert_uint_eq(n_answers(&f), 2);
  assert_served_at(&f, 1, "lo", rlo, 2 * MIB);
  fx_close(&f);
}
END_TEST

START_TEST(priority_not_held_back_by_lower) {
  /* A blocked low-priority head does not hold back a higher request: it
   * is answered at once when it fits. */
  struct fx f;
  fx_open_ini(&f, DEV, PRIO_INI);
  fx_hello(&f, "a", 1001, "");
  fx_hello(&f, "lo", 1002, "lo");
  fx_hello(&f, "hi", 1003, "hi");
  uint64_t ids[4];
  fill(&f, "a", 1001, ids);
  wait_for(&f, "lo", 1002, 4 * MIB, LONG_MS);
  free_ok(&f, "a", 1001, ids[0]);
  ck_assert_uint_eq(n_answers(&f), 0); /* 2 MiB free: lo still blocked */
  ck_assert_int_eq(gmb__waitq_ahead(&f.b, 10), 0);
  struct wire_reply rep;
  ck_assert_int_eq(fx_alloc(&f, "hi", 1003, 2 * MIB, 0, LONG_MS, &rep), 1);
  ck_assert_int_eq(rep.status, 0);
  ck_assert_uint_eq(rep.id, f.next_req - 1);
  ck_assert_uint_eq(f.b.waitq.n, 1);
  fx_close(&f);
}
END_TEST

START_TEST(priority_lower_joins_behind_higher) {
  /* A low request that would fit waits while a higher one is queued. */
  struct fx f;
  fx_open_ini(&f, DEV, PRIO_INI);
  fx_hello(&f, "a", 1001, "");
  struct gmb_session *lo = fx_hello(&f, "lo", 1002, "lo");
  fx_hello(&f, "hi", 1003, "hi");
  uint64_t ids[4];
  fill(&f, "a", 1001, ids);
  uint64_t rhi = wait_for(&f, "hi", 1003, 4 * MIB, LONG_MS);
  free_ok(&f, "a", 1001, ids[0]); /* 2 MiB: not enough for hi */
  ck_assert_int_eq(gmb__waitq_ahead(&f.b, 0), 1);
  uint64_t rlo = wait_for(&f, "lo", 1002, 2 * MIB, LONG_MS);
  ck_assert_uint_eq(lo->tenant->waiting, 1);
  ck_assert_uint_eq(f.b.waitq.n, 2);
  ck_assert_uint_eq(n_answers(&f), 0);
  free_ok(&f, "a", 1001, ids[1]); /* 4 MiB: hi, then nothing for lo */
  ck_assert_uint_eq(n_answers(&f), 1);
  assert_served_at(&f, 0, "hi", rhi, 4 * MIB);
  free_ok(&f, "a", 1001, ids[2]);
  ck_assert_uint_eq(n_answers(&f), 2);
  assert_served_at(&f, 1, "lo", rlo, 2 * MIB);
  fx_close(&f);
}
END_TEST

START_TEST(priority_kept_from_arrival) {
  /* A waiter keeps the priority its tenant had when it came. */
  struct fx f;
  fx_open_ini(&f, DEV, PRIO_INI);
  fx_hello(&f, "a", 1001, "");
  struct gmb_session *lo = fx_hello(&f, "lo", 1002, "lo");
  fx_hello(&f, "hi", 1003, "hi");
  uint64_t ids[4];
  fill(&f, "a", 1001, ids);
  uint64_t rlo = wait_for(&f, "lo", 1002, 2 * MIB, LONG_MS);
  lo->tenant->priority = 20; /* an operator's change, after it queued */
  uint64_t rhi = wait_for(&f, "hi", 1003, 2 * MIB, LONG_MS);
  free_ok(&f, "a", 1001, ids[0]);
  ck_assert_uint_eq(n_answers(&f), 1);
  assert_served_at(&f, 0, "hi", rhi, 2 * MIB);
  free_ok(&f, "a", 1001, ids[1]);
  assert_served_at(&f, 1, "lo", rlo, 2 * MIB);
  fx_close(&f);
}
END_TEST

/* ---- blocking ----------------------------------------------------------- */

START_TEST(blocked_head_holds_back_smaller) {
  struct fx f;
  fx_open_ini(&f, DEV, NO_COMPACT);
  fx_hello(&f, "a", 1001, "");
  fx_hello(&f, "big", 1002, "");
  fx_hello(&f, "small", 1003, "");
  uint64_t ids[4];
  fill(&f, "a", 1001, ids);
  uint64_t rbig = wait_for(&f, "big", 1002, 4 * MIB, LONG_MS);
  uint64_t rsmall = wait_for(&f, "small", 1003, 2 * MIB, LONG_MS);
  free_ok(&f, "a", 1001, ids[0]); /* 2 MiB would do for small: held */
  ck_assert_uint_eq(n_answers(&f), 0);
  ck_assert_uint_eq(f.b.waitq.n, 2);
  ck_assert_uint_eq(f.b.dev->in_use, 6 * MIB);
  free_ok(&f, "a", 1001, ids[1]); /* 4 MiB: big first, small waits on */
  ck_assert_uint_eq(n_answers(&f), 1);
  assert_served_at(&f, 0, "big", rbig, 4 * MIB);
  free_ok(&f, "a", 1001, ids[2]);
  ck_assert_uint_eq(n_answers(&f), 2);
  assert_served_at(&f, 1, "small", rsmall, 2 * MIB);
  fx_close(&f);
}
END_TEST

START_TEST(blocked_head_new_waiter_cannot_jump) {
  /* Room for a newcomer that asks to wait: it queues behind the blocked
   * head all the same. */
  struct fx f;
  fx_open_ini(&f, DEV, NO_COMPACT);
  fx_hello(&f, "a", 1001, "");
  fx_hello(&f, "big", 1002, "");
  struct gmb_session *small = fx_hello(&f, "small", 1003, "");
  uint64_t ids[4];
  fill(&f, "a", 1001, ids);
  uint64_t rbig = wait_for(&f, "big", 1002, 4 * MIB, LONG_MS);
  free_ok(&f, "a", 1001, ids[0]);
  uint64_t rsmall = wait_for(&f, "small", 1003, 2 * MIB, LONG_MS);
  ck_assert_uint_eq(small->tenant->waiting, 1);
  ck_assert_uint_eq(n_answers(&f), 0);
  free_ok(&f, "a", 1001, ids[1]);
  assert_served_at(&f, 0, "big", rbig, 4 * MIB);
  free_ok(&f, "a", 1001, ids[2]);
  assert_served_at(&f, 1, "small", rsmall, 2 * MIB);
  fx_close(&f);
}
END_TEST

START_TEST(blocked_head_nowait_request_answered_at_once) {
  /* A request that does not wait is not held back by the queue. */
  struct fx f;
  fx_open_ini(&f, DEV, NO_COMPACT);
  fx_hello(&f, "a", 1001, "");
  fx_hello(&f, "big", 1002, "");
  fx_hello(&f, "now", 1003, "");
  uint64_t ids[4];
  fill(&f, "a", 1001, ids);
  wait_for(&f, "big", 1002, 4 * MIB, LONG_MS);
  free_ok(&f, "a", 1001, ids[0]);
  hold(&f, "now", 1003, 2 * MIB);
  ck_assert_uint_eq(n_answers(&f), 0);
  ck_assert_uint_eq(f.b.waitq.n, 1);
  fx_close(&f);
}
END_TEST

START_TEST(quota_refused_at_once_when_queue_busy) {
  /* Waiting would not help a request above the quota: refused at once,
   * even with others queued ahead. */
  struct fx f;
  fx_open_ini(&f, DEV, NO_COMPACT "[tenant:q]\nuids = 1003\nquota = 2MiB\n");
  fx_hello(&f, "a", 1001, "");
  fx_hello(&f, "big", 1002, "");
  struct gmb_session *q = fx_hello(&f, "q", 1003, "q");
  uint64_t ids[4];
  fill(&f, "a", 1001, ids);
  wait_for(&f, "big", 1002, 4 * MIB, LONG_MS);
  struct wire_reply rep;
  ck_assert_int_eq(fx_alloc(&f, "q", 1003, 4 * MIB, 0, LONG_MS, &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_QUOTA);
  ck_assert_uint_eq(q->tenant->waiting, 0);
  ck_assert_uint_eq(f.b.waitq.n, 1);
  fx_close(&f);
}
END_TEST

#define RES_INI NO_COMPACT "[tenant:res]\nuids = 1003\nreserve = 2MiB\n"

START_TEST(reserve_served_behind_blocked) {
  struct fx f;
  fx_open_ini(&f, DEV, RES_INI);
  fx_hello(&f, "a", 1001, "");
  fx_hello(&f, "big", 1002, "");
  struct gmb_session *res = fx_hello(&f, "res", 1003, "res");
  /* 6 MiB is all the others may take: 2 MiB is kept for res. */
  for (int i = 0; i < 3; i++) hold(&f, "a", 1001, 2 * MIB);
  wait_for(&f, "big", 1002, 4 * MIB, LONG_MS);
  ck_assert_int_eq(gmb__waitq_ahead(&f.b, 0), 1);
  /* res comes after big, so it joins the queue, but its request is
   * within its reservation: served behind the blocked head. */
  uint64_t rres = wait_for(&f, "res", 1003, 2 * MIB, LONG_MS);
  ck_assert_uint_eq(n_answers(&f), 1);
  assert_served_at(&f, 0, "res", rres, 2 * MIB);
  ck_assert_uint_eq(res->tenant->used, 2 * MIB);
  ck_assert_uint_eq(res->tenant->waiting, 0);
  ck_assert_uint_eq(f.b.waitq.n, 1);
  ck_assert_uint_eq(sent_to(&f, "big"), 0);
  fx_close(&f);
}
END_TEST

START_TEST(reserve_beyond_it_held_back) {
  /* The same tenant asking for more than its reservation is held back
   * like anyone else. */
  struct fx f;
  fx_open_ini(&f, DEV, RES_INI);
  fx_hello(&f, "a", 1001, "");
  fx_hello(&f, "big", 1002, "");
  struct gmb_session *res = fx_hello(&f, "res", 1003, "res");
  uint64_t ids[3];
  for (int i = 0; i < 3; i++) ids[i] = hold(&f, "a", 1001, 2 * MIB);
  uint64_t rbig = wait_for(&f, "big", 1002, 4 * MIB, LONG_MS);
  /* 4 MiB free, but 2 of it kept for res: big is still blocked. */
  free_ok(&f, "a", 1001, ids[0]);
  ck_assert_uint_eq(n_answers(&f), 0);
  /* res's 4 MiB would be allowed (past its reservation, it eats into no
   * one's) but waits behind big. */
  uint64_t rres = wait_for(&f, "res", 1003, 4 * MIB, LONG_MS);
  ck_assert_uint_eq(res->tenant->waiting, 1);
  ck_assert_uint_eq(n_answers(&f), 0);
  free_ok(&f, "a", 1001, ids[1]); /* big's turn; then 2 MiB left */
  ck_assert_uint_eq(n_answers(&f), 1);
  assert_served_at(&f, 0, "big", rbig, 4 * MIB);
  ck_assert_uint_eq(res->tenant->waiting, 1);
  free_ok(&f, "a", 1001, ids[2]); /* 4 MiB free: res at last */
  ck_assert_uint_eq(n_answers(&f), 2);
  assert_served_at(&f, 1, "res", rres, 4 * MIB);
  ck_assert_uint_eq(res->tenant->waiting, 0);
  fx_close(&f);
}
END_TEST

START_TEST(quota_lowered_while_waiting_answered_quota) {
  /* A waiter the quota no longer allows is answered with the refusal
   * when its turn comes, and holds no one back. */
  struct fx f;
  fx_open_ini(&f, DEV, NO_COMPACT);
  fx_hello(&f, "a", 1001, "");
  struct gmb_session *q = fx_hello(&f, "q", 1002, "");
  fx_hello(&f, "c", 1003, "");
  uint64_t ids[4];
  fill(&f, "a", 1001, ids);
  uint64_t rq = wait_for(&f, "q", 1002, 4 * MIB, LONG_MS);
  uint64_t rc = wait_for(&f, "c", 1003, 2 * MIB, LONG_MS);
  gmb__tenant_set_quota(f.b.tenants, q->tenant, 2 * MIB);
  free_ok(&f, "a", 1001, ids[0]);
  ck_assert_uint_eq(n_answers(&f), 2);
  const struct wire_reply *r = assert_failed_at(&f, 0, "q", rq, GMB_E_QUOTA);
  ck_assert_ptr_nonnull(strstr(r->message, "quota"));
  assert_served_at(&f, 1, "c", rc, 2 * MIB);
  ck_assert_uint_eq(q->tenant->waiting, 0);
  ck_assert_uint_eq(f.b.waitq.n, 0);
  fx_close(&f);
}
END_TEST

START_TEST(answers_counted_in_metrics) {
  /* The loop counts what it answers at once; the queue counts its own. */
  struct fx f;
  fx_open_ini(&f, DEV, NO_COMPACT);
  fx_hello(&f, "a", 1001, "");
  fx_hello(&f, "b", 1002, "");
  fx_hello(&f, "c", 1003, "");
  uint64_t ids[4];
  fill(&f, "a", 1001, ids);
  wait_for(&f, "b", 1002, 2 * MIB, LONG_MS);
  wait_for(&f, "c", 1003, 4 * MIB, 10);
  free_ok(&f, "a", 1001, ids[0]);
  gmb__waitq_expire(&f.b, gmb__now_ns() + 100 * GMB_NS_PER_MS);
  ck_assert_uint_eq(n_answers(&f), 2);
  char *m = gmb__observe_metrics(&f.b, 1);
  ck_assert_ptr_nonnull(m);
  ck_assert_ptr_nonnull(strstr(m, "\ngmb_requests_total{kind=\"alloc\"} 2\n"));
  ck_assert_ptr_nonnull(
      strstr(m, "\ngmb_refusals_total{reason=\"timeout\"} 1\n"));
  ck_assert_ptr_nonnull(strstr(m, "\ngmb_alloc_duration_seconds_count 2\n"));
  free(m);
  fx_close(&f);
}
END_TEST

/* ---- waiters held for a compaction run ---------------------------------- */

START_TEST(after_compact_never_blocks) {
  struct fx f;
  fx_open_ini(&f, DEV, NO_COMPACT);
  fx_hello(&f, "a", 1001, "");
  struct gmb_session *x = fx_hello(&f, "x", 1002, "");
  fx_hello(&f, "y", 1003, "");
  uint64_t ids[4];
  fill(&f, "a", 1001, ids);
  ck_assert_int_eq(gmb__waitq_add(&f.b, x, 77, 4 * MIB, 0, 0, 1), 0);
  ck_assert_uint_eq(f.b.waitq.after_compact, 1);
  ck_assert_uint_eq(x->tenant->waiting, 1);
  ck_assert_int_eq(gmb__waitq_ahead(&f.b, 0), 0);
  uint64_t ry = wait_for(&f, "y", 1003, 2 * MIB, LONG_MS);
  free_ok(&f, "a", 1001, ids[0]); /* x first, does not fit, blocks not */
  ck_assert_uint_eq(n_answers(&f), 1);
  assert_served_at(&f, 0, "y", ry, 2 * MIB);
  ck_assert_uint_eq(f.b.waitq.n, 1);
  ck_assert_uint_eq(f.b.waitq.after_compact, 1);
  fx_close(&f);
}
END_TEST

START_TEST(after_compact_not_held_back) {
  /* Tried as memory comes back, even behind a blocked waiter. */
  struct fx f;
  fx_open_ini(&f, DEV, NO_COMPACT);
  fx_hello(&f, "a", 1001, "");
  fx_hello(&f, "big", 1002, "");
  struct gmb_session *x = fx_hello(&f, "x", 1003, "");
  uint64_t ids[4];
  fill(&f, "a", 1001, ids);
  wait_for(&f, "big", 1002, 4 * MIB, LONG_MS);
  ck_assert_int_eq(gmb__waitq_add(&f.b, x, 78, 2 * MIB, 0, 0, 1), 0);
  ck_assert_ptr_ne(f.b.waitq.tail, f.b.waitq.head);
  free_ok(&f, "a", 1001, ids[0]);
  ck_assert_uint_eq(n_answers(&f), 1);
  assert_served_at(&f, 0, "x", 78, 2 * MIB);
  ck_assert_uint_eq(f.b.waitq.after_compact, 0);
  ck_assert_uint_eq(x->tenant->waiting, 0);
  ck_assert_uint_eq(f.b.waitq.n, 1);
  fx_close(&f);
}
END_TEST

START_TEST(after_compact_over_answers_nomem) {
  struct fx f;
  fx_open_ini(&f, DEV, NO_COMPACT);
  fx_hello(&f, "a", 1001, "");
  struct gmb_session *x = fx_hello(&f, "x", 1002, "");
  fx_hello(&f, "w", 1003, "");
  uint64_t ids[4];
  fill(&f, "a", 1001, ids);
  uint64_t rw = wait_for(&f, "w", 1003, 2 * MIB, LONG_MS);
  ck_assert_int_eq(gmb__waitq_add(&f.b, x, 79, 4 * MIB, 0, 0, 1), 0);
  gmb__waitq_compaction_over(&f.b, UINT64_MAX, NULL, NULL);
  ck_assert_uint_eq(n_answers(&f), 1);
  const struct wire_reply *r = assert_failed_at(&f, 0, "x", 79, GMB_E_NOMEM);
  ck_assert_int_eq(r->kind, WIRE_NOMEM);
  ck_assert_uint_eq(r->u.nomem.request, 4 * MIB);
  ck_assert_uint_eq(r->u.nomem.free_total, 0);
  ck_assert_uint_eq(r->u.nomem.unmovable, 8 * MIB);
  ck_assert_uint_eq(r->u.nomem.n_holders, 1);
  ck_assert_str_eq(r->u.nomem.holders[0], "uid-1001");
  ck_assert_ptr_nonnull(strstr(r->message, "no room for 4MiB"));
  ck_assert_ptr_nonnull(strstr(r->message, "compaction is off"));
  ck_assert_uint_eq(f.b.waitq.after_compact, 0);
  ck_assert_uint_eq(x->tenant->waiting, 0);
  /* The one that asked to wait is not answered by the run's end. */
  ck_assert_uint_eq(f.b.waitq.n, 1);
  ck_assert_uint_eq(sent_to(&f, "w"), 0);
  free_ok(&f, "a", 1001, ids[0]);
  ck_assert_uint_eq(n_answers(&f), 2);
  assert_served_at(&f, 1, "w", rw, 2 * MIB);
  fx_close(&f);
}
END_TEST

START_TEST(after_compact_over_serves_what_fits) {
  struct fx f;
  fx_open_ini(&f, DEV, NO_COMPACT);
  fx_hello(&f, "a", 1001, "");
  struct gmb_session *x = fx_hello(&f, "x", 1002, "");
  struct gmb_session *y = fx_hello(&f, "y", 1003, "");
  uint64_t ids[4];
  fill(&f, "a", 1001, ids);
  free_ok(&f, "a", 1001, ids[0]);
  /* Queued with room there and not served (as when a run made room):
   * the run's end tries each in order. */
  ck_assert_int_eq(gmb__waitq_add(&f.b, x, 80, 2 * MIB, 0, 0, 1), 0);
  ck_assert_int_eq(gmb__waitq_add(&f.b, y, 81, 4 * MIB, 0, 0, 1), 0);
  ck_assert_uint_eq(f.b.waitq.after_compact, 2);
  gmb__waitq_compaction_over(&f.b, UINT64_MAX, NULL, NULL);
  ck_assert_uint_eq(n_answers(&f), 2);
  assert_served_at(&f, 0, "x", 80, 2 * MIB);
  const struct wire_reply *r = assert_failed_at(&f, 1, "y", 81, GMB_E_NOMEM);
  ck_assert_int_eq(r->kind, WIRE_NOMEM);
  ck_assert_uint_eq(r->u.nomem.request, 4 * MIB);
  ck_assert_uint_eq(r->u.nomem.free_total, 0); /* x took the 2 MiB */
  ck_assert_uint_eq(f.b.waitq.n, 0);
  ck_assert_uint_eq(f.b.waitq.after_compact, 0);
  ck_assert_uint_eq(x->tenant->waiting, 0);
  ck_assert_uint_eq(y->tenant->waiting, 0);
  fx_close(&f);
}
END_TEST

START_TEST(after_compact_over_reserved_names_reservation) {
  /* Room on the device, but kept for another tenant: the answer at the
   * run's end names the reservation instead of explaining the device. */
  struct fx f;
  fx_open_ini(&f, DEV, RES_INI);
  fx_hello(&f, "a", 1001, "");
  struct gmb_session *x = fx_hello(&f, "x", 1002, "");
  fx_hello(&f, "res", 1003, "res");
  hold(&f, "a", 1001, 2 * MIB);
  hold(&f, "a", 1001, 2 * MIB);
  ck_assert_int_eq(gmb__waitq_add(&f.b, x, 82, 4 * MIB, 0, 0, 1), 0);
  gmb__waitq_compaction_over(&f.b, UINT64_MAX, NULL, NULL);
  ck_assert_uint_eq(n_answers(&f), 1);
  const struct wire_reply *r = assert_failed_at(&f, 0, "x", 82, GMB_E_NOMEM);
  ck_assert_int_ne(r->kind, WIRE_NOMEM);
  ck_assert_ptr_nonnull(strstr(r->message, "res"));
  ck_assert_ptr_nonnull(strstr(r->message, "reservation"));
  ck_assert_uint_eq(x->tenant->segment_bytes, 0); /* rolled back */
  ck_assert_uint_eq(f.b.dev->in_use, 4 * MIB);
  ck_assert_uint_eq(f.b.waitq.n, 0);
  fx_close(&f);
}
END_TEST

START_TEST(after_compact_over_with_none_is_noop) {
  struct fx f;
  fx_open_ini(&f, DEV, NO_COMPACT);
  fx_hello(&f, "a", 1001, "");
  uint64_t ids[4];
  fill(&f, "a", 1001, ids);
  fx_hello(&f, "w", 1002, "");
  wait_for(&f, "w", 1002, 2 * MIB, LONG_MS);
  gmb__waitq_compaction_over(&f.b, UINT64_MAX, NULL, NULL);
  ck_assert_uint_eq(n_answers(&f), 0);
  ck_assert_uint_eq(f.b.waitq.n, 1);
  fx_close(&f);
}
END_TEST

START_TEST(nowait_nomem_with_compaction_off_answered_at_once) {
  /* Through dispatch: no wait asked, compaction off, so no run to wait
   * for: refused at once with the explanation, nothing queued. */
  struct fx f;
  fx_open_ini(&f, DEV, NO_COMPACT);
  fx_hello(&f, "a", 1001, "");
  fx_hello(&f, "b", 1002, "");
  uint64_t ids[4];
  fill(&f, "a", 1001, ids);
  struct wire_reply rep;
  ck_assert_int_eq(fx_alloc(&f, "b", 1002, 2 * MIB, 0, 0, &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_NOMEM);
  ck_assert_int_eq(rep.kind, WIRE_NOMEM);
  ck_assert_uint_eq(f.b.waitq.n, 0);
  ck_assert_uint_eq(f.b.waitq.after_compact, 0);
  fx_close(&f);
}
END_TEST

/* ---- deadlines ---------------------------------------------------------- */

START_TEST(expire_empty_queue) {
  struct fx f;
  fx_open_ini(&f, DEV, NO_COMPACT);
  ck_assert_uint_eq(gmb__waitq_expire(&f.b, gmb__now_ns()), UINT64_MAX);
  fx_close(&f);
}
END_TEST

START_TEST(expire_answers_timeout_and_next_deadline) {
  struct fx f;
  fx_open_ini(&f, DEV, NO_COMPACT);
  fx_hello(&f, "a", 1001, "");
  struct gmb_session *b = fx_hello(&f, "b", 1002, "");
  fx_hello(&f, "c", 1003, "");
  uint64_t ids[4];
  fill(&f, "a", 1001, ids);
  uint64_t t0 = gmb__now_ns();
  uint64_t rb = wait_for(&f, "b", 1002, 2 * MIB, 1000);
  uint64_t rc = wait_for(&f, "c", 1003, 2 * MIB, 3000);
  uint64_t t1 = gmb__now_ns();
  /* Nothing is due yet: the next deadline is b's, about a second away. */
  uint64_t next = gmb__waitq_expire(&f.b, t1);
  ck_assert_uint_eq(n_answers(&f), 0);
  ck_assert_uint_le(next, 1000 * GMB_NS_PER_MS);
  ck_assert_uint_ge(next, 1000 * GMB_NS_PER_MS - (t1 - t0));
  /* Past b's deadline: b answered, c's is next, a second later. */
  next = gmb__waitq_expire(&f.b, t1 + 2000 * GMB_NS_PER_MS);
  ck_assert_uint_eq(n_answers(&f), 1);
  const struct wire_reply *r = assert_failed_at(&f, 0, "b", rb, GMB_E_TIMEOUT);
  ck_assert_ptr_nonnull(strstr(r->message, "no room for 2MiB"));
  ck_assert_uint_eq(b->tenant->waiting, 0);
  ck_assert_uint_le(next, 1000 * GMB_NS_PER_MS);
  ck_assert_uint_ge(next, 1000 * GMB_NS_PER_MS - (t1 - t0));
  /* Exactly at c's deadline: due.  None is left. */
  next = gmb__waitq_expire(&f.b, t1 + 3000 * GMB_NS_PER_MS);
  ck_assert_uint_eq(next, UINT64_MAX);
  ck_assert_uint_eq(n_answers(&f), 2);
  assert_failed_at(&f, 1, "c", rc, GMB_E_TIMEOUT);
  ck_assert_uint_eq(f.b.waitq.n, 0);
  fx_close(&f);
}
END_TEST

START_TEST(expire_no_deadline_never_due) {
  /* timeout_ms <= 0: no deadline.  It never expires, and a waiter with a
   * deadline behind it still sets the next one. */
  struct fx f;
  fx_open_ini(&f, DEV, NO_COMPACT);
  fx_hello(&f, "a", 1001, "");
  struct gmb_session *w = fx_hello(&f, "w", 1002, "");
  fx_hello(&f, "d", 1003, "");
  uint64_t ids[4];
  fill(&f, "a", 1001, ids);
  wait_for(&f, "w", 1002, 2 * MIB, -1);
  ck_assert_int_eq(gmb__waitq_add(&f.b, w, 95, 2 * MIB, 0, 0, 0), 0);
  uint64_t t0 = gmb__now_ns();
  uint64_t rd = wait_for(&f, "d", 1003, 2 * MIB, 500);
  uint64_t t1 = gmb__now_ns();
  uint64_t next = gmb__waitq_expire(&f.b, t1);
  ck_assert_uint_le(next, 500 * GMB_NS_PER_MS);
  ck_assert_uint_ge(next, 500 * GMB_NS_PER_MS - (t1 - t0));
  uint64_t year = 365ull * 24 * 3600 * 1000 * GMB_NS_PER_MS;
  next = gmb__waitq_expire(&f.b, t0 + year);
  ck_assert_uint_eq(n_answers(&f), 1);
  assert_failed_at(&f, 0, "d", rd, GMB_E_TIMEOUT);
  /* Only the two without a deadline are left: nothing due for ages
   * (waitq.h promises UINT64_MAX; see expire_no_deadline_is_none). */
  ck_assert_uint_gt(next, year);
  ck_assert_uint_eq(f.b.waitq.n, 2);
  ck_assert_uint_eq(w->tenant->waiting, 2);
  fx_close(&f);
}
END_TEST

/* A waiter without a deadline is no deadline: UINT64_MAX, as waitq.h
 * says (not UINT64_MAX - now). */
START_TEST(expire_no_deadline_is_none) {
  struct fx f;
  fx_open_ini(&f, DEV, NO_COMPACT);
  fx_hello(&f, "a", 1001, "");
  fx_hello(&f, "w", 1002, "");
  uint64_t ids[4];
  fill(&f, "a", 1001, ids);
  wait_for(&f, "w", 1002, 2 * MIB, -1);
  ck_assert_uint_eq(gmb__waitq_expire(&f.b, gmb__now_ns()), UINT64_MAX);
  fx_close(&f);
}
END_TEST

/* When expiring a blocking waiter lets the ones behind it be served, the
 * next deadline is taken after the serve: not that of a waiter just
 * served. */
START_TEST(expire_next_deadline_of_served_waiter) {
  struct fx f;
  fx_open_ini(&f, DEV, NO_COMPACT);
  fx_hello(&f, "a", 1001, "");
  fx_hello(&f, "big", 1002, "");
  fx_hello(&f, "small", 1003, "");
  uint64_t ids[4];
  fill(&f, "a", 1001, ids);
  wait_for(&f, "big", 1002, 4 * MIB, 100);
  wait_for(&f, "small", 1003, 2 * MIB, LONG_MS);
  free_ok(&f, "a", 1001, ids[0]);
  uint64_t next = gmb__waitq_expire(&f.b, gmb__now_ns() + 200 * GMB_NS_PER_MS);
  ck_assert_uint_eq(f.b.waitq.n, 0);
  ck_assert_uint_eq(next, UINT64_MAX);
  fx_close(&f);
}
END_TEST

START_TEST(expire_blocking_waiter_serves_behind) {
  struct fx f;
  fx_open_ini(&f, DEV, NO_COMPACT);
  fx_hello(&f, "a", 1001, "");
  struct gmb_session *big = fx_hello(&f, "big", 1002, "");
  fx_hello(&f, "small", 1003, "");
  uint64_t ids[4];
  fill(&f, "a", 1001, ids);
  uint64_t rbig = wait_for(&f, "big", 1002, 4 * MIB, 100);
  uint64_t rsmall = wait_for(&f, "small", 1003, 2 * MIB, LONG_MS);
  free_ok(&f, "a", 1001, ids[0]);
  ck_assert_uint_eq(n_answers(&f), 0);
  gmb__waitq_expire(&f.b, gmb__now_ns() + 200 * GMB_NS_PER_MS);
  ck_assert_uint_eq(n_answers(&f), 2);
  assert_failed_at(&f, 0, "big", rbig, GMB_E_TIMEOUT);
  assert_served_at(&f, 1, "small", rsmall, 2 * MIB);
  ck_assert_uint_eq(big->tenant->waiting, 0);
  ck_assert_uint_eq(f.b.waitq.n, 0);
  fx_close(&f);
}
END_TEST

START_TEST(expire_after_compact_waiter) {
  /* One held for a run may have a deadline too; it times out. */
  struct fx f;
  fx_open_ini(&f, DEV, NO_COMPACT);
  fx_hello(&f, "a", 1001, "");
  struct gmb_session *x = fx_hello(&f, "x", 1002, "");
  uint64_t ids[4];
  fill(&f, "a", 1001, ids);
  ck_assert_int_eq(gmb__waitq_add(&f.b, x, 91, 2 * MIB, 0, 50, 1), 0);
  gmb__waitq_expire(&f.b, gmb__now_ns() + 100 * GMB_NS_PER_MS);
  ck_assert_uint_eq(n_answers(&f), 1);
  assert_failed_at(&f, 0, "x", 91, GMB_E_TIMEOUT);
  ck_assert_uint_eq(f.b.waitq.after_compact, 0);
  ck_assert_uint_eq(f.b.waitq.n, 0);
  fx_close(&f);
}
END_TEST

/* ---- a head that only an empty device could serve ------------------------ */

/*
 * A request for the whole device, waiting for ever, used to block every
 * waiter behind it for ever: they timed out with the device nearly free.
 * A waiter holds the others back for WAITQ_BLOCK_MS (1 s) after it came,
 * no longer; the deadline timer comes then (only while someone waits
 * behind it), and the waiters behind it that fit are served.
 */
START_TEST(whole_device_waiter_blocks_a_second_only) {
  struct fx f;
  fx_open_ini(&f, DEV, NO_COMPACT);
  fx_hello(&f, "a", 1001, "");
  struct gmb_session *greedy = fx_hello(&f, "greedy", 1002, "");
  fx_hello(&f, "small", 1003, "");
  fx_hello(&f, "late", 1004, "");
  uint64_t ids[4];
  fill(&f, "a", 1001, ids);
  /* Alone in the queue it holds no one back: no reason to wake. */
  wait_for(&f, "greedy", 1002, 8 * MIB, -1);
  ck_assert_uint_eq(gmb__waitq_expire(&f.b, gmb__now_ns()), UINT64_MAX);
  uint64_t rsmall = wait_for(&f, "small", 1003, 2 * MIB, LONG_MS);
  free_ok(&f, "a", 1001, ids[0]);
  ck_assert_uint_eq(n_answers(&f), 0); /* within its second: held back */
  uint64_t next = gmb__waitq_expire(&f.b, gmb__now_ns());
  ck_assert_uint_le(next, 1000 * GMB_NS_PER_MS);
  /* Its second is over: small is served, greedy keeps its place. */
  gmb__waitq_expire(&f.b, gmb__now_ns() + 1100 * GMB_NS_PER_MS);
  ck_assert_uint_eq(n_answers(&f), 1);
  assert_served_at(&f, 0, "small", rsmall, 2 * MIB);
  ck_assert_uint_eq(greedy->tenant->waiting, 1);
  /* A newcomer is no longer queued behind it either. */
  free_ok(&f, "a", 1001, ids[1]);
  struct wire_reply rep;
  ck_assert_int_eq(fx_alloc(&f, "late", 1004, 2 * MIB, 0, LONG_MS, &rep), 1);
  ck_assert_msg(rep.status == 0, "%s", rep.message);
  /* And it still gets the device first once the device is free. */
  free_ok(&f, "a", 1001, ids[2]);
  free_ok(&f, "a", 1001, ids[3]);
  free_ok(&f, "small", 1003, answer(&f, 0, NULL)->u.alloc.id);
  ck_assert_uint_eq(n_answers(&f), 1);
  free_ok(&f, "late", 1004, rep.u.alloc.id);
  ck_assert_uint_eq(greedy->tenant->waiting, 0);
  ck_assert_uint_eq(f.b.dev->in_use, 8 * MIB);
  fx_close(&f);
}
END_TEST

/* A waiter whose deadline comes while a younger blocker holds it back is
 * tried once more, and served if it fits, rather than refused
 * GMB_E_TIMEOUT with the room there. */
START_TEST(deadline_tries_once_more_behind_blocker) {
  struct fx f;
  fx_open_ini(&f, DEV, NO_COMPACT);
  fx_hello(&f, "a", 1001, "");
  struct gmb_session *greedy = fx_hello(&f, "greedy", 1002, "");
  fx_hello(&f, "small", 1003, "");
  uint64_t ids[4];
  fill(&f, "a", 1001, ids);
  wait_for(&f, "greedy", 1002, 8 * MIB, -1);
  uint64_t rsmall = wait_for(&f, "small", 1003, 2 * MIB, 100);
  free_ok(&f, "a", 1001, ids[0]);
  ck_assert_uint_eq(n_answers(&f), 0);
  gmb__waitq_expire(&f.b, gmb__now_ns() + 200 * GMB_NS_PER_MS);
  ck_assert_uint_eq(n_answers(&f), 1);
  assert_served_at(&f, 0, "small", rsmall, 2 * MIB);
  ck_assert_uint_eq(greedy->tenant->waiting, 1);
  fx_close(&f);
}
END_TEST

/* Unblocked waiters are tried whenever memory may have come back, each
 * against the pool.  A tenant's 64 waiters of 4 MiB that cannot fit used
 * to cost 64 tries at every free on the device, anyone's (at 17 tenants a
 * uid, 17,408 waiters: milliseconds of the loop per free).  Within a
 * pass, a request of a tenant that found no room means every request of
 * that tenant at least as large finds none: only the first is tried, and
 * the order in which they are served is unchanged. */
START_TEST(unblocked_waiters_that_cannot_fit_tried_once_a_pass) {
  struct fx f;
  fx_open_ini(&f, DEV, NO_COMPACT);
  fx_hello(&f, "a", 1001, "");
  fx_hello(&f, "w", 1002, "");
  uint64_t ids[4], r[64];
  fill(&f, "a", 1001, ids);
  for (int i = 0; i < 64; i++) r[i] = wait_for(&f, "w", 1002, 4 * MIB, -1);
  gmb__waitq_expire(&f.b, gmb__now_ns() + 1100 * GMB_NS_PER_MS);
  uint64_t tries = f.b.waitq.tries;
  free_ok(&f, "a", 1001, ids[0]);
  ck_assert_uint_eq(f.b.waitq.tries - tries, 1);
  ck_assert_uint_eq(n_answers(&f), 0);
  free_ok(&f, "a", 1001, ids[1]);
  ck_assert_uint_eq(f.b.waitq.tries - tries, 3); /* served, then one */
  ck_assert_uint_eq(n_answers(&f), 1);
  assert_served_at(&f, 0, "w", r[0], 4 * MIB);
  free_ok(&f, "a", 1001, ids[2]);
  free_ok(&f, "a", 1001, ids[3]);
  ck_assert_uint_eq(n_answers(&f), 2);
  assert_served_at(&f, 1, "w", r[1], 4 * MIB);
  ck_assert_uint_eq(f.b.waitq.n, 62);
  ck_assert_uint_eq(f.b.waitq.tries - tries, 6);
  fx_close(&f);
}
END_TEST

/* Waiters due at one expiry are tried in the queue's order (priority,
 * then arrival), not in their deadlines': with room for one, the higher
 * priority gets it though the lower one's deadline came first. */
START_TEST(expire_due_together_tried_in_queue_order) {
  struct fx f;
  fx_open_ini(&f, DEV, PRIO_INI);
  fx_hello(&f, "a", 1001, "");
  struct gmb_session *lo = fx_hello(&f, "lo", 1002, "lo");
  struct gmb_session *hi = fx_hello(&f, "hi", 1003, "hi");
  for (int i = 0; i < 3; i++) hold(&f, "a", 1001, 2 * MIB);
  /* Queued without a serve: both could have had the 2 MiB left. */
  ck_assert_int_eq(gmb__waitq_add(&f.b, lo, 81, 2 * MIB, 0, 100, 0), 0);
  ck_assert_int_eq(gmb__waitq_add(&f.b, hi, 82, 2 * MIB, 0, 200, 0), 0);
  gmb__waitq_expire(&f.b, gmb__now_ns() + 300 * GMB_NS_PER_MS);
  ck_assert_uint_eq(n_answers(&f), 2);
  assert_served_at(&f, 0, "hi", 82, 2 * MIB);
  assert_failed_at(&f, 1, "lo", 81, GMB_E_TIMEOUT);
  ck_assert_uint_eq(f.b.waitq.n, 0);
  fx_close(&f);
}
END_TEST

/* The loop's timer looks only at what is due: many waiters whose
 * deadlines come one after another cost one visit each as each expires,
 * not a walk of the queue at every deadline (which took n^2/2 visits). */
START_TEST(expire_visits_only_waiters_due) {
  enum { N = 256, SESSIONS = 4, STEP_MS = 10, FIRST_MS = 2000 };
  struct fx f;
  fx_open_ini(&f, DEV, NO_COMPACT);
  fx_hello(&f, "a", 1001, "");
  struct gmb_session *s[SESSIONS];
  char rid[SESSIONS][8];
  for (int i = 0; i < SESSIONS; i++) {
    snprintf(rid[i], sizeof rid[i], "w%d", i);
    s[i] = fx_hello(&f, rid[i], 1002, "");
  }
  uint64_t ids[4];
  fill(&f, "a", 1001, ids);
  uint64_t t0 = gmb__now_ns();
  for (int i = 0; i < N; i++)
    ck_assert_int_eq(gmb__waitq_add(&f.b, s[i % SESSIONS], 1000 + i, 2 * MIB,
                                    0, FIRST_MS + i * STEP_MS, 0), 0);
  uint64_t t1 = gmb__now_ns();
  ck_assert_uint_eq(f.b.waitq.n, N);
  /* Their second of blocking ends: each is looked at once. */
  uint64_t visits = f.b.waitq.timer_visits;
  uint64_t next = gmb__waitq_expire(&f.b, t1 + 1100 * GMB_NS_PER_MS);
  ck_assert_uint_eq(f.b.waitq.timer_visits - visits, N);
  ck_assert_uint_eq(n_answers(&f), 0);
  ck_assert_uint_le(next, (FIRST_MS - 1100) * GMB_NS_PER_MS);
  /* Then a deadline every STEP_MS: the timer comes for each. */
  visits = f.b.waitq.timer_visits;
  uint64_t now = t1 + FIRST_MS * GMB_NS_PER_MS;
  int calls = 0;
  while (f.b.waitq.n > 0) {
    next = gmb__waitq_expire(&f.b, now);
    calls++;
    ck_assert_int_le(calls, N);
    if (f.b.waitq.n > 0) {
      ck_assert_uint_ne(next, UINT64_MAX);
      ck_assert_uint_le(next, STEP_MS * GMB_NS_PER_MS + (t1 - t0));
      now += next;
    }
  }
  ck_assert_uint_eq(next, UINT64_MAX);
  ck_assert_uint_eq(f.b.waitq.timer_visits - visits, N);
  ck_assert_uint_eq(n_answers(&f), N);
  for (int i = 0; i < N; i++)
    assert_failed_at(&f, (size_t)i, rid[i % SESSIONS], 1000 + (uint64_t)i,
                     GMB_E_TIMEOUT);
  fx_close(&f);
}
END_TEST

/* ---- sessions that end --------------------------------------------------- */

START_TEST(drop_session_only_its_waiters) {
  struct fx f;
  fx_open_ini(&f, DEV, NO_COMPACT);
  fx_hello(&f, "a", 1001, "");
  struct gmb_session *x = fx_hello(&f, "x", 1002, "");
  struct gmb_session *x2 = fx_hello(&f, "x2", 1002, ""); /* same tenant */
  struct gmb_session *y = fx_hello(&f, "y", 1003, "");
  ck_assert_ptr_eq(x->tenant, x2->tenant);
  uint64_t ids[4];
  fill(&f, "a", 1001, ids);
  wait_for(&f, "x", 1002, 2 * MIB, LONG_MS);
  uint64_t ry = wait_for(&f, "y", 1003, 2 * MIB, LONG_MS);
  wait_for(&f, "x", 1002, 2 * MIB, LONG_MS);
  uint64_t rx2 = wait_for(&f, "x2", 1002, 2 * MIB, LONG_MS);
  ck_assert_int_eq(gmb__waitq_add(&f.b, x, 92, 2 * MIB, 0, 0, 1), 0);
  ck_assert_int_eq(gmb__waitq_add(&f.b, y, 93, 2 * MIB, 0, 0, 1), 0);
  ck_assert_uint_eq(f.b.waitq.n, 6);
  ck_assert_uint_eq(f.b.waitq.after_compact, 2);
  ck_assert_uint_eq(x->tenant->waiting, 4);
  ck_assert_uint_eq(y->tenant->waiting, 2);
  gmb__waitq_drop_session(&f.b, x);
  ck_assert_uint_eq(n_answers(&f), 0); /* no reply: it is gone */
  ck_assert_uint_eq(f.b.waitq.n, 3);
  ck_assert_uint_eq(f.b.waitq.after_compact, 1);
  ck_assert_uint_eq(x->tenant->waiting, 1);
  ck_assert_uint_eq(y->tenant->waiting, 2);
  /* The rest still in order: y, x2, then y's held one. */
  free_ok(&f, "a", 1001, ids[0]);
  assert_served_at(&f, 0, "y", ry, 2 * MIB);
  free_ok(&f, "a", 1001, ids[1]);
  assert_served_at(&f, 1, "x2", rx2, 2 * MIB);
  free_ok(&f, "a", 1001, ids[2]);
  assert_served_at(&f, 2, "y", 93, 2 * MIB);
  ck_assert_uint_eq(f.b.waitq.n, 0);
  ck_assert_uint_eq(f.b.waitq.after_compact, 0);
  ck_assert_uint_eq(sent_to(&f, "x"), 0);
  fx_close(&f);
}
END_TEST

/* A session's end drops its waiters, and sessions end at will: each end
 * used to walk the whole queue (another tenant's 1,000 waiters here).
 * Each session links its own, so the end looks at those only. */
START_TEST(drop_session_visits_only_its_waiters) {
  enum { N = 1000 };
  struct fx f;
  struct gmb_session *big, *x;
  uint64_t ids[4];
  open_many(&f, &big, &x, ids);
  queue_many(&f, big, N);
  ck_assert_int_eq(gmb__waitq_add(&f.b, x, 1, 2 * MIB, 0, 0, 0), 0);
  ck_assert_int_eq(gmb__waitq_add(&f.b, x, 2, 2 * MIB, 0, 0, 1), 0);
  uint64_t visits = f.b.waitq.drop_visits;
  gmb__waitq_drop_session(&f.b, x);
  ck_assert_uint_eq(f.b.waitq.drop_visits - visits, 2);
  ck_assert_uint_eq(f.b.waitq.n, N);
  ck_assert_uint_eq(x->waiting, 0);
  ck_assert_ptr_null(x->waiters);
  gmb__waitq_drop_session(&f.b, x);
  ck_assert_uint_eq(f.b.waitq.drop_visits - visits, 2);
  /* The other session's are still served in order. */
  free_ok(&f, "a", 1001, ids[0]);
  assert_served_at(&f, 0, "lo", 1000, 2 * MIB);
  gmb__waitq_drop_session(&f.b, big);
  ck_assert_uint_eq(f.b.waitq.drop_visits - visits, 2 + N - 1);
  ck_assert_uint_eq(f.b.waitq.n, 0);
  fx_close(&f);
}
END_TEST

START_TEST(drop_session_without_waiters) {
  struct fx f;
  fx_open_ini(&f, DEV, NO_COMPACT);
  struct gmb_session *a = fx_hello(&f, "a", 1001, "");
  gmb__waitq_drop_session(&f.b, a); /* empty queue */
  uint64_t ids[4];
  fill(&f, "a", 1001, ids);
  fx_hello(&f, "w", 1002, "");
  wait_for(&f, "w", 1002, 2 * MIB, LONG_MS);
  gmb__waitq_drop_session(&f.b, a);
  ck_assert_uint_eq(f.b.waitq.n, 1);
  ck_assert_uint_eq(n_answers(&f), 0);
  fx_close(&f);
}
END_TEST

START_TEST(drop_session_blocking_serves_behind) {
  struct fx f;
  fx_open_ini(&f, DEV, NO_COMPACT);
  fx_hello(&f, "a", 1001, "");
  struct gmb_session *big = fx_hello(&f, "big", 1002, "");
  fx_hello(&f, "small", 1003, "");
  uint64_t ids[4];
  fill(&f, "a", 1001, ids);
  wait_for(&f, "big", 1002, 4 * MIB, LONG_MS);
  uint64_t rsmall = wait_for(&f, "small", 1003, 2 * MIB, LONG_MS);
  free_ok(&f, "a", 1001, ids[0]);
  ck_assert_uint_eq(n_answers(&f), 0);
  gmb__waitq_drop_session(&f.b, big);
  ck_assert_uint_eq(n_answers(&f), 1);
  assert_served_at(&f, 0, "small", rsmall, 2 * MIB);
  ck_assert_uint_eq(big->tenant->waiting, 0);
  ck_assert_uint_eq(f.b.waitq.n, 0);
  fx_close(&f);
}
END_TEST

START_TEST(session_end_frees_and_serves) {
  /* Through core: a session that ends gives its memory back to the queue
   * and takes its own waiters with it. */
  struct fx f;
  fx_open_ini(&f, DEV, NO_COMPACT);
  struct gmb_session *a = fx_hello(&f, "a", 1001, "");
  fx_hello(&f, "w", 1002, "");
  uint64_t ids[4];
  fill(&f, "a", 1001, ids);
  wait_for(&f, "a", 1001, 2 * MIB, LONG_MS);
  uint64_t rw = wait_for(&f, "w", 1002, 8 * MIB, LONG_MS);
  struct gmb_tenant *ta = a->tenant;
  ck_assert_uint_eq(ta->waiting, 1);
  gmb__core_session_end(&f.b, a, "test");
  ck_assert_int_eq(gmb__core_check(&f.b), 0);
  ck_assert_uint_eq(ta->waiting, 0);
  ck_assert_uint_eq(n_answers(&f), 1);
  assert_served_at(&f, 0, "w", rw, 8 * MIB);
  ck_assert_uint_eq(f.b.waitq.n, 0);
  fx_close(&f);
}
END_TEST

/* ---- ahead --------------------------------------------------------------- */

START_TEST(ahead_empty) {
  struct fx f;
  fx_open_ini(&f, DEV, NO_COMPACT);
  ck_assert_int_eq(gmb__waitq_ahead(&f.b, -100), 0);
  ck_assert_int_eq(gmb__waitq_ahead(&f.b, 0), 0);
  ck_assert_int_eq(gmb__waitq_ahead(&f.b, 100), 0);
  fx_close(&f);
}
END_TEST

START_TEST(ahead_equal_or_higher_priority) {
  struct fx f;
  fx_open_ini(&f, DEV, PRIO_INI);
  fx_hello(&f, "a", 1001, "");
  struct gmb_session *lo = fx_hello(&f, "lo", 1002, "lo");
  struct gmb_session *hi = fx_hello(&f, "hi", 1003, "hi");
  uint64_t ids[4];
  fill(&f, "a", 1001, ids);
  ck_assert_int_eq(gmb__waitq_add(&f.b, lo, 100, 2 * MIB, 0, 0, 0), 0);
  ck_assert_int_eq(gmb__waitq_ahead(&f.b, -1), 1);
  ck_assert_int_eq(gmb__waitq_ahead(&f.b, 0), 1);
  ck_assert_int_eq(gmb__waitq_ahead(&f.b, 1), 0);
  ck_assert_int_eq(gmb__waitq_ahead(&f.b, 10), 0);
  ck_assert_int_eq(gmb__waitq_add(&f.b, hi, 101, 2 * MIB, 0, 0, 0), 0);
  ck_assert_int_eq(gmb__waitq_ahead(&f.b, 10), 1);
  ck_assert_int_eq(gmb__waitq_ahead(&f.b, 11), 0);
  gmb__waitq_drop_session(&f.b, hi);
  gmb__waitq_drop_session(&f.b, lo);
  ck_assert_uint_eq(f.b.waitq.n, 0);
  fx_close(&f);
}
END_TEST

START_TEST(ahead_ignores_after_compact) {
  struct fx f;
  fx_open_ini(&f, DEV, PRIO_INI);
  fx_hello(&f, "a", 1001, "");
  struct gmb_session *lo = fx_hello(&f, "lo", 1002, "lo");
  struct gmb_session *hi = fx_hello(&f, "hi", 1003, "hi");
  uint64_t ids[4];
  fill(&f, "a", 1001, ids);
  /* Only held for a run, at any priority: nothing is ahead. */
  ck_assert_int_eq(gmb__waitq_add(&f.b, hi, 102, 2 * MIB, 0, 0, 1), 0);
  ck_assert_int_eq(gmb__waitq_ahead(&f.b, 0), 0);
  ck_assert_int_eq(gmb__waitq_ahead(&f.b, 10), 0);
  /* A real waiter behind it (lower priority) is seen past it. */
  ck_assert_int_eq(gmb__waitq_add(&f.b, lo, 103, 2 * MIB, 0, 0, 0), 0);
  ck_assert_ptr_ne(f.b.waitq.tail, f.b.waitq.head);
  ck_assert_int_eq(gmb__waitq_ahead(&f.b, 0), 1);
  ck_assert_int_eq(gmb__waitq_ahead(&f.b, 1), 0);
  ck_assert_int_eq(gmb__waitq_ahead(&f.b, 10), 0);
  fx_close(&f);
}
END_TEST

/* A request with a timeout asks whether a waiter that blocks is ahead of
 * it, and one that joins tries the first such waiter: both used to walk
 * past every unblocked waiter at the head (15,000 of them: 97 us per
 * Alloc).  The blocking waiters are kept in order apart, so each looks at
 * one waiter however many unblocked ones are queued, with the same
 * answers. */
START_TEST(ahead_and_joined_skip_unblocked_without_a_walk) {
  enum { N = 1024 };
  struct fx f;
  struct gmb_session *lo, *hi;
  uint64_t ids[4];
  open_many(&f, &lo, &hi, ids);
  queue_many(&f, hi, N);
  ck_assert_int_eq(gmb__waitq_ahead(&f.b, 10), 1);
  /* Their second is up: none blocks, none is ahead of anyone. */
  gmb__waitq_expire(&f.b, gmb__now_ns() + 1100 * GMB_NS_PER_MS);
  uint64_t visits = f.b.waitq.head_visits, tries = f.b.waitq.tries;
  ck_assert_int_eq(gmb__waitq_ahead(&f.b, -100), 0);
  ck_assert_uint_eq(f.b.waitq.head_visits - visits, 0);
  /* A blocking waiter of lower priority behind them all. */
  ck_assert_int_eq(gmb__waitq_add(&f.b, lo, 5000, 2 * MIB, 0, 0, 0), 0);
  ck_assert_int_eq(gmb__waitq_ahead(&f.b, 0), 1);
  ck_assert_int_eq(gmb__waitq_ahead(&f.b, 1), 0);
  ck_assert_int_eq(gmb__waitq_ahead(&f.b, 10), 0);
  ck_assert_uint_eq(f.b.waitq.head_visits - visits, 3);
  /* It joined: it is the first that blocks, and is tried alone. */
  gmb__waitq_joined(&f.b);
  ck_assert_uint_eq(f.b.waitq.head_visits - visits, 4);
  ck_assert_uint_eq(f.b.waitq.tries - tries, 1);
  ck_assert_uint_eq(n_answers(&f), 0);
  ck_assert_uint_eq(f.b.waitq.n, N + 1);
  /* Served in order still: a free serves the first unblocked one. */
  free_ok(&f, "a", 1001, ids[0]);
  ck_assert_uint_eq(n_answers(&f), 1);
  assert_served_at(&f, 0, "hi", 1000, 2 * MIB);
  gmb__waitq_drop_session(&f.b, lo);
  ck_assert_int_eq(gmb__waitq_ahead(&f.b, -100), 0);
  gmb__waitq_drop_session(&f.b, hi);
  ck_assert_uint_eq(f.b.waitq.n, 0);
  fx_close(&f);
}
END_TEST

/* ---- held while caches are asked back (gmb__waitq_hold) ----------------- */

static uint64_t no_compaction(void *ctx, uint64_t rounded,
                              struct gmb_tenant *t) {
  (void)rounded;
  (void)t;
  ck_abort_msg("compaction is off: no run may be asked for (%p)", ctx);
  return 0;
}

/* A held request that did not ask to wait is not ahead of anyone, does not
 * hold back the waiter behind it, and is served by a free like any
 * waiter; one that asked to wait is an ordinary waiter. */
START_TEST(held_nowait_never_blocks) {
  struct fx f;
  fx_open_ini(&f, DEV, PRIO_INI);
  fx_hello(&f, "a", 1001, "");
  struct gmb_session *lo = fx_hello(&f, "lo", 1002, "lo");
  struct gmb_session *hi = fx_hello(&f, "hi", 1003, "hi");
  uint64_t ids[4];
  fill(&f, "a", 1001, ids);
  uint64_t until = gmb__now_ns() + LONG_MS * GMB_NS_PER_MS;
  /* hi: 6 MiB, held without waiting; lo: 2 MiB, waiting behind it. */
  ck_assert_int_eq(gmb__waitq_hold(&f.b, hi, 201, 6 * MIB, 0, 0, until), 0);
  ck_assert_int_eq(gmb__waitq_ahead(&f.b, 10), 0);
  ck_assert_int_eq(gmb__waitq_add(&f.b, lo, 202, 2 * MIB, 0, LONG_MS, 0), 0);
  ck_assert_uint_eq(f.b.waitq.held, 1);
  ck_assert_uint_eq(f.b.waitq.held_nowait, 1);
  /* 2 MiB come back: lo is served past hi, which still does not fit. */
  free_ok(&f, "a", 1001, ids[0]);
  ck_assert_uint_eq(n_answers(&f), 1);
  assert_served_at(&f, 0, "lo", 202, 2 * MIB);
  /* 6 more: hi is served, and its hold is counted off. */
  for (int i = 1; i < 4; i++) free_ok(&f, "a", 1001, ids[i]);
  assert_served_at(&f, 1, "hi", 201, 6 * MIB);
  ck_assert_uint_eq(f.b.waitq.n, 0);
  ck_assert_uint_eq(f.b.waitq.held, 0);
  ck_assert_uint_eq(f.b.waitq.held_nowait, 0);
  fx_close(&f);
}
END_TEST

/* When a hold ends: one that did not ask to wait and still does not fit is
 * answered GMB_E_NOMEM with the explanation (compaction off); one that
 * asked to wait stays queued; a hold not due yet stays; `all` ends it. */
START_TEST(hold_over_falls_through) {
  struct fx f;
  fx_open_ini(&f, DEV, NO_COMPACT);
  struct gmb_session *a = fx_hello(&f, "a", 1001, "");
  struct gmb_session *b = fx_hello(&f, "b", 1002, "");
  uint64_t ids[4];
  fill(&f, "a", 1001, ids);
  uint64_t now = gmb__now_ns();
  ck_assert_int_eq(gmb__waitq_hold(&f.b, b, 301, 2 * MIB, 0, 0, now + 10), 0);
  ck_assert_int_eq(
      gmb__waitq_hold(&f.b, b, 302, 2 * MIB, 0, LONG_MS, now + 10), 0);
  ck_assert_int_eq(gmb__waitq_hold(&f.b, a, 303, 2 * MIB, 0, 0, now + 1000),
                   0);
  uint64_t next =
      gmb__waitq_hold_over(&f.b, now + 10, GMB_HOLD_DUE, no_compaction, &f);
  ck_assert_uint_eq(next, 990);
  ck_assert_uint_eq(n_answers(&f), 1);
  const struct wire_reply *r = assert_failed_at(&f, 0, "b", 301, GMB_E_NOMEM);
  ck_assert_int_eq(r->kind, WIRE_NOMEM);
  ck_assert_uint_eq(f.b.waitq.n, 2);
  ck_assert_uint_eq(f.b.waitq.held, 1);
  ck_assert_uint_eq(
      gmb__waitq_hold_over(&f.b, now + 10, GMB_HOLD_ALL, no_compaction, &f),
      UINT64_MAX);
  assert_failed_at(&f, 1, "a", 303, GMB_E_NOMEM);
  ck_assert_uint_eq(f.b.waitq.n, 1); /* b's 302 waits on */
  ck_assert_uint_eq(f.b.waitq.held, 0);
  free_ok(&f, "a", 1001, ids[0]);
  assert_served_at(&f, 2, "b", 302, 2 * MIB);
  fx_close(&f);
}
END_TEST

/* Held for the offload job (gmb__waitq_hold_job): a hold that neither
 * `all` nor its own plain bound ends while the job holds it; let go, it
 * is an ordinary hold again and ends as one; and the job's bound ends
 * another without a release.  The counts and the job's sums follow, and
 * the check (gmb__waitq_check) sees a sum that drifts. */
START_TEST(hold_job_ends_only_when_let_go) {
  struct fx f;
  fx_open_ini(&f, DEV, NO_COMPACT);
  fx_hello(&f, "a", 1001, "");
  struct gmb_session *b = fx_hello(&f, "b", 1002, "");
  uint64_t ids[4];
  fill(&f, "a", 1001, ids);
  uint64_t now = gmb__now_ns();
  ck_assert_int_eq(
      gmb__waitq_hold_job(&f.b, b, 401, 2 * MIB, 0, 0, now + 10, now + 5000, 0,
                          2 * MIB),
      0);
  ck_assert_int_eq(
      gmb__waitq_hold_job(&f.b, b, 402, 2 * MIB, 0, 0, now + 10, now + 9000, 0,
                          2 * MIB),
      0);
  ck_assert_uint_eq(f.b.waitq.held_job, 2);
  ck_assert_uint_eq(
      gmb__waitq_hold_over(&f.b, now + 100, GMB_HOLD_ALL, no_compaction, &f),
      4900);
  ck_assert_uint_eq(n_answers(&f), 0);
  ck_assert_uint_eq(f.b.waitq.held_job, 2);
  /* The job lets 401 go (the first in the queue's order). */
  struct gmb_waitq_job first;
  ck_assert_int_eq(gmb__waitq_job_first(&f.b, &first), 1);
  ck_assert_uint_eq(first.size, 2 * MIB);
  ck_assert_uint_eq(f.b.waitq.job_want, 4 * MIB);
  ck_assert_int_eq(gmb__waitq_check(&f.b), 0);
  /* The check sees a sum drift: the room wanted, a tenant's bytes. */
  f.b.waitq.job_want++;
  ck_assert_int_gt(gmb__waitq_check(&f.b), 0);
  f.b.waitq.job_want--;
  ck_assert_ptr_eq(f.b.waitq.job_tenants, b->tenant);
  ck_assert_uint_eq(b->tenant->job_n, 2);
  b->tenant->job_bytes += MIB;
  ck_assert_int_gt(gmb__waitq_check(&f.b), 0);
  b->tenant->job_bytes -= MIB;
  ck_assert_int_eq(gmb__waitq_check(&f.b), 0);
  gmb__waitq_job_release(&f.b, first.w, now + 100, 0);
  ck_assert_uint_eq(f.b.waitq.job_want, 2 * MIB);
  ck_assert_uint_eq(b->tenant->job_n, 1);
  ck_assert_int_eq(gmb__waitq_check(&f.b), 0);
  ck_assert_uint_eq(f.b.waitq.held_job, 1);
  gmb__waitq_hold_over(&f.b, now + 100, GMB_HOLD_DUE, no_compaction, &f);
  assert_failed_at(&f, 0, "b", 401, GMB_E_NOMEM);
  /* 402 at its job's bound. */
  gmb__waitq_hold_over(&f.b, now + 9000, GMB_HOLD_DUE, no_compaction, &f);
  assert_failed_at(&f, 1, "b", 402, GMB_E_NOMEM);
  ck_assert_uint_eq(f.b.waitq.held_job, 0);
  ck_assert_uint_eq(f.b.waitq.held, 0);
  ck_assert_uint_eq(f.b.waitq.n, 0);
  ck_assert_uint_eq(f.b.waitq.job_want, 0);
  ck_assert_ptr_null(f.b.waitq.job_tenants);
  ck_assert_uint_eq(b->tenant->job_n, 0);
  ck_assert_uint_eq(b->tenant->job_bytes, 0);
  fx_close(&f);
}
END_TEST

/* ---- held for a quota (gmb__waitq_hold_quota) ---------------------------- */

/* Tenant q (uid 1002, quota 4 MiB) with two sessions: q1 holds the whole
 * quota, q2's requests are held for it; a (uid 1001) holds the rest of
 * the 8 MiB device, so it is full. */
#define QUOTA_INI NO_COMPACT "[tenant:q]\nuids = 1002\nquota = 4MiB\n"

struct quota_fx {
  struct fx f;
  struct gmb_session *q2;
  uint64_t q_ids[2], a_ids[2];
};

static void quota_open(struct quota_fx *x) {
  fx_open_ini(&x->f, DEV, QUOTA_INI);
  fx_hello(&x->f, "a", 1001, "");
  fx_hello(&x->f, "q1", 1002, "q");
  x->q2 = fx_hello(&x->f, "q2", 1002, "q");
  fx_hello(&x->f, "c", 1003, "");
  for (int i = 0; i < 2; i++) {
    x->q_ids[i] = hold(&x->f, "q1", 1002, 2 * MIB);
    x->a_ids[i] = hold(&x->f, "a", 1001, 2 * MIB);
  }
  ck_assert_uint_eq(x->f.b.dev->in_use, 8 * MIB);
}

/* A request held for its quota is not ahead of anyone, even one that
 * asked to wait: another tenant's waiter behind it is served past it by
 * the device's memory; while its quota refuses it no refusal is counted;
 * its own tenant's free serves it. */
/* The end of a hold used to walk the whole queue for the held waiters
 * (1,000 unheld ones here, at every hold's end).  The held ones are kept
 * apart in the queue's order: the end looks at those only, and answers
 * them in that order. */
START_TEST(hold_over_visits_only_held_waiters) {
  enum { N = 1000 };
  struct fx f;
  struct gmb_session *lo, *hi;
  uint64_t ids[4];
  open_many(&f, &lo, &hi, ids);
  queue_many(&f, lo, N);
  uint64_t until = gmb__now_ns() + LONG_MS * GMB_NS_PER_MS;
  /* Held without waiting: lo's first, then hi's, which is ahead of it. */
  ck_assert_int_eq(gmb__waitq_hold(&f.b, lo, 301, 6 * MIB, 0, 0, until), 0);
  ck_assert_int_eq(gmb__waitq_hold(&f.b, hi, 302, 6 * MIB, 0, 0, until), 0);
  /* None due: the held ones are looked at once for the next time, not
   * the queue; then nothing until that time. */
  uint64_t visits = f.b.waitq.hold_visits;
  gmb__waitq_hold_over(&f.b, gmb__now_ns(), GMB_HOLD_DUE, no_compaction,
                       NULL);
  ck_assert_uint_le(f.b.waitq.hold_visits - visits, 2);
  visits = f.b.waitq.hold_visits;
  gmb__waitq_hold_over(&f.b, gmb__now_ns(), GMB_HOLD_DUE, no_compaction,
                       NULL);
  ck_assert_uint_eq(f.b.waitq.hold_visits - visits, 0);
  ck_assert_uint_eq(n_answers(&f), 0);
  ck_assert_uint_eq(gmb__waitq_hold_over(&f.b, gmb__now_ns(), GMB_HOLD_ALL,
                                         no_compaction, NULL), UINT64_MAX);
  ck_assert_uint_eq(f.b.waitq.hold_visits - visits, 2);
  /* Both refused for room, in the queue's order: hi, then lo. */
  ck_assert_uint_eq(n_answers(&f), 2);
  assert_failed_at(&f, 0, "hi", 302, GMB_E_NOMEM);
  assert_failed_at(&f, 1, "lo", 301, GMB_E_NOMEM);
  ck_assert_uint_eq(f.b.waitq.held, 0);
  ck_assert_uint_eq(f.b.waitq.n, N);
  gmb__waitq_drop_session(&f.b, lo);
  fx_close(&f);
}
END_TEST

START_TEST(held_quota_never_blocks) {
  struct quota_fx x;
  quota_open(&x);
  struct fx *f = &x.f;
  struct gmb_tenant *q = x.q2->tenant;
  uint64_t until = gmb__now_ns() + LONG_MS * GMB_NS_PER_MS;
  ck_assert_int_eq(
      gmb__waitq_hold_quota(&f->b, x.q2, 401, 2 * MIB, 0, LONG_MS, until), 0);
  ck_assert_uint_eq(f->b.waitq.held, 1);
  ck_assert_uint_eq(f->b.waitq.held_quota, 1);
  ck_assert_uint_eq(f->b.waitq.held_nowait, 0);
  ck_assert_int_eq(gmb__waitq_ahead(&f->b, 0), 0);
  uint64_t refusals = q->refusals_quota;
  uint64_t rc = wait_for(f, "c", 1003, 2 * MIB, LONG_MS);
  ck_assert_uint_eq(f->b.waitq.n, 2);
  /* a's 2 MiB: c is served past q2, whose quota still refuses it. */
  free_ok(f, "a", 1001, x.a_ids[0]);
  ck_assert_uint_eq(n_answers(f), 1);
  assert_served_at(f, 0, "c", rc, 2 * MIB);
  ck_assert_uint_eq(q->refusals_quota, refusals);
  /* q1's 2 MiB: q2 fits its quota and the device, and is served. */
  free_ok(f, "q1", 1002, x.q_ids[0]);
  assert_served_at(f, 1, "q2", 401, 2 * MIB);
  ck_assert_uint_eq(q->refusals_quota, refusals);
  ck_assert_uint_eq(f->b.waitq.n, 0);
  ck_assert_uint_eq(f->b.waitq.held, 0);
  ck_assert_uint_eq(f->b.waitq.held_quota, 0);
  ck_assert_uint_eq(q->waiting, 0);
  fx_close(f);
}
END_TEST

/* When the hold ends and the quota still refuses it, the request is
 * answered GMB_E_QUOTA, whether it asked to wait or not (the quota is not
 * waited on past the hold), counted as refused once, and told why. */
START_TEST(held_quota_refused_when_hold_ends) {
  struct quota_fx x;
  quota_open(&x);
  struct fx *f = &x.f;
  struct gmb_tenant *q = x.q2->tenant;
  uint64_t now = gmb__now_ns();
  ck_assert_int_eq(
      gmb__waitq_hold_quota(&f->b, x.q2, 501, 2 * MIB, 0, 0, now + 10), 0);
  ck_assert_int_eq(
      gmb__waitq_hold_quota(&f->b, x.q2, 502, 2 * MIB, 0, LONG_MS, now + 10),
      0);
  uint64_t refusals = q->refusals_quota;
  /* Not due yet: nothing happens. */
  ck_assert_uint_eq(
      gmb__waitq_hold_over(&f->b, now, GMB_HOLD_DUE, no_compaction, f), 10);
  ck_assert_uint_eq(n_answers(f), 0);
  ck_assert_uint_eq(
      gmb__waitq_hold_over(&f->b, now + 10, GMB_HOLD_DUE, no_compaction, f),
      UINT64_MAX);
  ck_assert_uint_eq(n_answers(f), 2);
  const struct wire_reply *r = assert_failed_at(f, 0, "q2", 501, GMB_E_QUOTA);
  ck_assert_ptr_nonnull(strstr(r->message, "quota"));
  ck_assert_ptr_nonnull(strstr(r->message, "trim_wait_ms"));
  ck_assert_uint_eq(r->asked_back, 0); /* nothing is on its way */
  assert_failed_at(f, 1, "q2", 502, GMB_E_QUOTA);
  ck_assert_uint_eq(q->refusals_quota, refusals + 2);
  ck_assert_uint_eq(f->b.waitq.n, 0);
  ck_assert_uint_eq(f->b.waitq.held_quota, 0);
  ck_assert_uint_eq(q->waiting, 0);
  fx_close(f);
}
END_TEST

/* GMB_HOLD_SETTLED ends a quota hold whose tenant has no ask in flight
 * (nothing it waits for can come) before its time, and leaves a hold for
 * room, and a quota hold whose tenant still has an ask out, alone. */
START_TEST(held_quota_settled_ends_early) {
  struct quota_fx x;
  quota_open(&x);
  struct fx *f = &x.f;
  uint64_t until = gmb__now_ns() + LONG_MS * GMB_NS_PER_MS;
  struct gmb_session *c = fx_hello(f, "c2", 1003, "");
  ck_assert_int_eq(gmb__waitq_hold(&f->b, c, 601, 2 * MIB, 0, 0, until), 0);
  ck_assert_int_eq(
      gmb__waitq_hold_quota(&f->b, x.q2, 602, 2 * MIB, 0, 0, until), 0);
  /* As if q1 had been asked for its cache and not answered yet. */
  x.q2->tenant->cache_asked = 2 * MIB;
  gmb__waitq_hold_over(&f->b, gmb__now_ns(), GMB_HOLD_SETTLED, no_compaction,
                       f);
  ck_assert_uint_eq(n_answers(f), 0);
  x.q2->tenant->cache_asked = 0;
  gmb__waitq_hold_over(&f->b, gmb__now_ns(), GMB_HOLD_SETTLED, no_compaction,
                       f);
  ck_assert_uint_eq(n_answers(f), 1);
  assert_failed_at(f, 0, "q2", 602, GMB_E_QUOTA);
  ck_assert_uint_eq(f->b.waitq.held, 1);
  ck_assert_uint_eq(f->b.waitq.held_quota, 0);
  gmb__waitq_hold_over(&f->b, gmb__now_ns(), GMB_HOLD_ALL, no_compaction, f);
  assert_failed_at(f, 1, "c2", 601, GMB_E_NOMEM);
  fx_close(f);
}
END_TEST

/* A deadline shorter than the hold: the quota is what refuses the request
 * then, so the answer is GMB_E_QUOTA, not GMB_E_TIMEOUT. */
START_TEST(held_quota_deadline_answers_quota) {
  struct quota_fx x;
  quota_open(&x);
  struct fx *f = &x.f;
  uint64_t now = gmb__now_ns();
  uint64_t until = now + LONG_MS * GMB_NS_PER_MS;
  ck_assert_int_eq(
      gmb__waitq_hold_quota(&f->b, x.q2, 701, 2 * MIB, 0, 5, until), 0);
  gmb__waitq_expire(&f->b, now + 10 * GMB_NS_PER_MS);
  ck_assert_uint_eq(n_answers(f), 1);
  assert_failed_at(f, 0, "q2", 701, GMB_E_QUOTA);
  ck_assert_uint_eq(f->b.waitq.n, 0);
  ck_assert_uint_eq(f->b.waitq.held, 0);
  ck_assert_uint_eq(f->b.waitq.held_quota, 0);
  fx_close(f);
}
END_TEST

/* The quota allows the request when its hold ends, but the device has no
 * room: it goes on as a held request for room does: refused GMB_E_NOMEM
 * (compaction off) when it did not ask to wait, queued for its deadline
 * when it did, and then an ordinary waiter that holds back others. */
START_TEST(held_quota_then_no_room_falls_through) {
  struct fx f;
  fx_open_ini(&f, DEV, QUOTA_INI);
  fx_hello(&f, "a", 1001, "");
  struct gmb_session *q2 = fx_hello(&f, "q2", 1002, "q");
  uint64_t a_ids[4];
  fill(&f, "a", 1001, a_ids);
  uint64_t now = gmb__now_ns();
  ck_assert_int_eq(gmb__waitq_hold_quota(&f.b, q2, 801, 2 * MIB, 0, 0, now + 1),
                   0);
  ck_assert_int_eq(
      gmb__waitq_hold_quota(&f.b, q2, 802, 2 * MIB, 0, LONG_MS, now + 1), 0);
  ck_assert_int_eq(gmb__waitq_ahead(&f.b, 0), 0);
  gmb__waitq_hold_over(&f.b, now + 1, GMB_HOLD_DUE, no_compaction, &f);
  ck_assert_uint_eq(n_answers(&f), 1);
  const struct wire_reply *r = assert_failed_at(&f, 0, "q2", 801, GMB_E_NOMEM);
  ck_assert_int_eq(r->kind, WIRE_NOMEM);
  ck_assert_uint_eq(f.b.waitq.n, 1);
  ck_assert_uint_eq(f.b.waitq.held, 0);
  ck_assert_int_eq(gmb__waitq_ahead(&f.b, 0), 1);
  free_ok(&f, "a", 1001, a_ids[0]);
  assert_served_at(&f, 1, "q2", 802, 2 * MIB);
  fx_close(&f);
}
END_TEST

static Suite *waitq_suite(void) {
  Suite *s = suite_create("waitq");
  TCase *tc = tcase_create("order");
  tcase_add_test(tc, fifo_within_priority);
  tcase_add_test(tc, fifo_all_served_by_one_free);
  tcase_add_test(tc, priority_higher_served_first);
  tcase_add_test(tc, priority_not_held_back_by_lower);
  tcase_add_test(tc, priority_lower_joins_behind_higher);
  tcase_add_test(tc, priority_kept_from_arrival);
  suite_add_tcase(s, tc);

  tc = tcase_create("blocking");
  tcase_add_test(tc, blocked_head_holds_back_smaller);
  tcase_add_test(tc, blocked_head_new_waiter_cannot_jump);
  tcase_add_test(tc, blocked_head_nowait_request_answered_at_once);
  tcase_add_test(tc, quota_refused_at_once_when_queue_busy);
  tcase_add_test(tc, reserve_served_behind_blocked);
  tcase_add_test(tc, reserve_beyond_it_held_back);
  tcase_add_test(tc, quota_lowered_while_waiting_answered_quota);
  suite_add_tcase(s, tc);

  tc = tcase_create("after_compact");
  tcase_add_test(tc, after_compact_never_blocks);
  tcase_add_test(tc, after_compact_not_held_back);
  tcase_add_test(tc, after_compact_over_answers_nomem);
  tcase_add_test(tc, after_compact_over_serves_what_fits);
  tcase_add_test(tc, after_compact_over_reserved_names_reservation);
  tcase_add_test(tc, after_compact_over_with_none_is_noop);
  tcase_add_test(tc, nowait_nomem_with_compaction_off_answered_at_once);
  suite_add_tcase(s, tc);

  tc = tcase_create("unblock");
  tcase_add_test(tc, whole_device_waiter_blocks_a_second_only);
  tcase_add_test(tc, deadline_tries_once_more_behind_blocker);
  tcase_add_test(tc, unblocked_waiters_that_cannot_fit_tried_once_a_pass);
  suite_add_tcase(s, tc);

  tc = tcase_create("expire");
  tcase_add_test(tc, expire_empty_queue);
  tcase_add_test(tc, expire_answers_timeout_and_next_deadline);
  tcase_add_test(tc, expire_no_deadline_never_due);
  tcase_add_test(tc, expire_no_deadline_is_none);
  tcase_add_test(tc, expire_next_deadline_of_served_waiter);
  tcase_add_test(tc, expire_blocking_waiter_serves_behind);
  tcase_add_test(tc, expire_after_compact_waiter);
  tcase_add_test(tc, expire_due_together_tried_in_queue_order);
  tcase_add_test(tc, expire_visits_only_waiters_due);
  suite_add_tcase(s, tc);

  tc = tcase_create("sessions");
  tcase_add_test(tc, drop_session_only_its_waiters);
  tcase_add_test(tc, drop_session_visits_only_its_waiters);
  tcase_add_test(tc, drop_session_without_waiters);
  tcase_add_test(tc, drop_session_blocking_serves_behind);
  tcase_add_test(tc, session_end_frees_and_serves);
  suite_add_tcase(s, tc);

  tc = tcase_create("ahead");
  tcase_add_test(tc, ahead_empty);
  tcase_add_test(tc, ahead_equal_or_higher_priority);
  tcase_add_test(tc, ahead_ignores_after_compact);
  tcase_add_test(tc, ahead_and_joined_skip_unblocked_without_a_walk);
  suite_add_tcase(s, tc);

  tc = tcase_create("held");
  tcase_add_test(tc, held_nowait_never_blocks);
  tcase_add_test(tc, hold_over_visits_only_held_waiters);
  tcase_add_test(tc, hold_over_falls_through);
  tcase_add_test(tc, hold_job_ends_only_when_let_go);
  suite_add_tcase(s, tc);

  tc = tcase_create("held_quota");
  tcase_add_test(tc, held_quota_never_blocks);
  tcase_add_test(tc, held_quota_refused_when_hold_ends);
  tcase_add_test(tc, held_quota_settled_ends_early);
  tcase_add_test(tc, held_quota_deadline_answers_quota);
  tcase_add_test(tc, held_quota_then_no_room_falls_through);
  suite_add_tcase(s, tc);

  tc = tcase_create("metrics");
  tcase_add_test(tc, answers_counted_in_metrics);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) { return check_run(waitq_suite()); }
