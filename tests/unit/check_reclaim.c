/*
 * check_reclaim.c - asking the clients' caches for memory back
 * (reclaim.h): whom the broker asks when the device is full (lowest
 * priority first, then the largest cache; never another tenant below its
 * reservation; never a session already asked, paused, or blocked in a
 * wait), that the request is held and served when the memory comes back,
 * that it falls through when the asks are answered empty-handed or run
 * out (the ones that ran out counted in trim_ignored, and the session
 * paused), a session that ends with an ask in flight, and the quota
 * case: a request that passes its tenant's quota while the tenant's other
 * sessions cache what it lacks is held and served as they give it back,
 * refused at once when the bytes are in use, and at the bound, or at the
 * answer that ends the last ask it waits for, when they do not come.
 * A Vmm increase (cuMemCreate) is held for both the same way, bounded
 * to one per session and by the waiter limits.
 *
 * A whole broker on a host device (broker_fixture.h), compaction off
 * unless a test says otherwise.  A "cache" here is an allocation of a
 * session that reports it free (a Heartbeat with cached_free), as the
 * library's slabs are; "giving it back" is freeing it, then a Heartbeat
 * with trim_answered, as the library's thread does.  Every size is a
 * multiple of 2 MiB, so each allocation has a segment of its own and the
 * device's room is exact.  No test measures time: the bound is passed by
 * calling the loop's timer (gmb__reclaim_expire) with a `now` beyond it.
 */
#include <check.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "admin.h"
#include "broker_fixture.h"
#include "check_main.h"
#include "defrag.h"
#include "reclaim.h"
#include "tenant.h"
#include "util.h"
#include "waitq.h"

#define MIB GMB_MIB
#define LONG_MS 60000 /* a deadline no test reaches */

/* ---- helpers ---------------------------------------------------------- */

/* An allocation answered at once; returns its id. */
static uint64_t hold(struct fx *f, const char *rid, uid_t uid,
                     uint64_t size) {
  struct wire_reply rep;
  ck_assert_int_eq(fx_alloc(f, rid, uid, size, 0, 0, &rep), 1);
  ck_assert_msg(rep.status == 0, "hold %s: %s", rid, rep.message);
  return rep.u.alloc.id;
}

/* A Heartbeat from `rid` reporting `cached` free bytes in its cache and,
 * when `answered`, answering the last trim. */
static void report(struct fx *f, const char *rid, uid_t uid, uint64_t cached,
                   int answered) {
  struct wire_request req;
  memset(&req, 0, sizeof req);
  req.kind = WIRE_HEARTBEAT;
  req.cached_free = cached;
  req.trim_answered = answered;
  struct wire_reply rep;
  ck_assert_int_eq(fx_request(f, rid, uid, &req, &rep), 0);
}

/* `rid` holds `size` bytes, all free in its cache; returns the id. */
static uint64_t cache(struct fx *f, const char *rid, uid_t uid,
                      uint64_t size) {
  uint64_t id = hold(f, rid, uid, size);
  report(f, rid, uid, size, 0);
  return id;
}

/* An Alloc that is not answered at once (held or queued); returns its
 * request id. */
static uint64_t held(struct fx *f, const char *rid, uid_t uid, uint64_t size,
                     int timeout_ms) {
  struct wire_reply rep;
  memset(&rep, 0, sizeof rep);
  ck_assert_msg(fx_alloc(f, rid, uid, size, 0, timeout_ms, &rep) == 0,
                "answered at once: status %d %s", rep.status, rep.message);
  return f->next_req - 1;
}

/* The TRIM events sent to `rid`, and the bytes of the last one. */
static size_t trims_to(const struct fx *f, const char *rid, uint64_t *last) {
  size_t n = 0;
  for (size_t i = 0; i < f->n_sent; i++) {
    const struct fx_sent *s = &f->sent[i];
    if (s->rep.kind != WIRE_EVENT || s->rep.u.event.kind != WIRE_EVENT_TRIM ||
        strcmp(s->rid, rid) != 0)
      continue;
    n++;
    if (last) *last = s->rep.u.event.bytes;
  }
  return n;
}

/* The order of the TRIM events: the rid of the k-th one. */
static const char *trim_rid(const struct fx *f, size_t k) {
  for (size_t i = 0; i < f->n_sent; i++) {
    const struct fx_sent *s = &f->sent[i];
    if (s->rep.kind == WIRE_EVENT && s->rep.u.event.kind == WIRE_EVENT_TRIM &&
        k-- == 0)
      return s->rid;
  }
  ck_abort_msg("fewer TRIM events than asked for");
  return NULL;
}

/* The answer to request `req_id` of `rid`, or NULL when none was sent. */
static const struct wire_reply *answer_to(const struct fx *f, const char *rid,
                                          uint64_t req_id) {
  for (size_t i = 0; i < f->n_sent; i++) {
    const struct fx_sent *s = &f->sent[i];
    if (s->rep.kind != WIRE_EVENT && s->rep.id == req_id &&
        strcmp(s->rid, rid) == 0)
      return &s->rep;
  }
  return NULL;
}

static void assert_served(const struct fx *f, const char *rid,
                          uint64_t req_id, uint64_t size) {
  const struct wire_reply *r = answer_to(f, rid, req_id);
  ck_assert_msg(r != NULL, "%s's request %llu not answered", rid,
                (unsigned long long)req_id);
  ck_assert_msg(r->status == 0, "%s: %s", rid, r->message);
  ck_assert_int_eq(r->kind, WIRE_ALLOC);
  ck_assert_uint_eq(r->u.alloc.size, size);
}

static struct gmb_session *sess(struct fx *f, const char *rid) {
  struct gmb_session *s =
      gmb__session_find(f->b.sessions, (const uint8_t *)rid, strlen(rid));
  ck_assert_ptr_nonnull(s);
  return s;
}

/* The loop's timer, called as if `ms` milliseconds had passed. */
static void timer_after(struct fx *f, uint64_t ms) {
  gmb__reclaim_expire(&f->b, gmb__now_ns() + ms * GMB_NS_PER_MS);
}

/* Past the bound of every ask and hold made so far. */
static void timer_past_bound(struct fx *f) {
  timer_after(f, f->b.cfg.trim_wait_ms + 1);
}

/* The sums reclaim.h keeps, recounted from the sessions. */
static void check_sums(struct fx *f) {
  uint32_t asks = 0;
  uint64_t bytes = 0;
  for (size_t i = 0; i < sizeof "abcdefgh" - 1; i++) {
    char rid[2] = {"abcdefgh"[i], 0};
    struct gmb_session *s =
        gmb__session_find(f->b.sessions, (const uint8_t *)rid, 1);
    if (s == NULL) continue;
    asks += s->ask_bytes > 0;
    bytes += s->ask_bytes;
  }
  ck_assert_uint_eq(f->b.reclaim.asks, asks);
  ck_assert_uint_eq(f->b.reclaim.ask_bytes, bytes);
}

/* Two tenants on an 8 MiB device, compaction off: a (uid 1001) and b
 * (uid 1002). */
static void open_two(struct fx *f) {
  fx_open_ini(f, "host:8MiB", FX_INI_OFF);
  fx_hello(f, "a", 1001, "");
  fx_hello(f, "b", 1002, "");
}

/* ---- the device is full --------------------------------------------------- */

/* a caches 6 MiB and idles; b asks 4 MiB of the 8 MiB device: a is asked
 * for the 2 MiB missing, b's request is held (not refused), and served by
 * a's free.  a's answer then closes the ask. */
START_TEST(full_device_asks_cache_and_serves_on_free) {
  struct fx f;
  open_two(&f);
  uint64_t slab = cache(&f, "a", 1001, 6 * MIB);
  uint64_t r = held(&f, "b", 1002, 4 * MIB, 0);
  ck_assert_ptr_null(answer_to(&f, "b", r));
  uint64_t bytes = 0;
  ck_assert_uint_eq(trims_to(&f, "a", &bytes), 1);
  ck_assert_uint_eq(bytes, 2 * MIB);
  ck_assert_uint_eq(sess(&f, "a")->trim_asks, 1);
  ck_assert_uint_eq(fx_tenant(&f, "uid-1001")->cache_asked, 2 * MIB);
  ck_assert_uint_eq(f.b.waitq.held, 1);
  ck_assert_uint_eq(f.b.waitq.held_nowait, 1);
  check_sums(&f);
  /* The library gives the slab back: b is served by the free. */
  ck_assert_int_eq(fx_free(&f, "a", 1001, slab), 0);
  assert_served(&f, "b", r, 4 * MIB);
  ck_assert_uint_eq(f.b.waitq.n, 0);
  ck_assert_uint_eq(f.b.waitq.held, 0);
  report(&f, "a", 1001, 0, 1);
  ck_assert_uint_eq(f.b.reclaim.asks, 0);
  ck_assert_uint_eq(fx_tenant(&f, "uid-1001")->cache_asked, 0);
  ck_assert_uint_eq(sess(&f, "a")->trim_ignored, 0);
  ck_assert_uint_eq(sess(&f, "a")->ask_skip_ns, 0);
  check_sums(&f);
  fx_close(&f);
}
END_TEST

/* A request for one page of a cache, with `ahead` bytes of its miss still
 * to come, that is not answered at once; returns its request id. */
static uint64_t held_page(struct fx *f, const char *rid, uid_t uid,
                          uint64_t ahead) {
  struct wire_request req;
  memset(&req, 0, sizeof req);
  req.kind = WIRE_ALLOC;
  req.u.alloc.size = 2 * MIB;
  req.u.alloc.pages = 1;
  req.u.alloc.ahead = ahead;
  struct wire_reply rep;
  memset(&rep, 0, sizeof rep);
  ck_assert_int_eq(fx_request(f, rid, uid, &req, &rep), 0);
  return f->next_req - 1;
}

/* A cache's miss of several requests of pages says what comes next
 * (Alloc.ahead): a, asked for the first request's lack, is asked for the
 * rest of the miss at once (within the device), so that the next requests
 * find the room; the hold still waits only for the first one's lack. */
START_TEST(pages_ask_for_what_the_miss_asks_next) {
  struct fx f;
  open_two(&f);
  uint64_t slab = cache(&f, "a", 1001, 8 * MIB);
  uint64_t r = held_page(&f, "b", 1002, 4 * MIB);
  uint64_t bytes = 0;
  ck_assert_uint_eq(trims_to(&f, "a", &bytes), 1);
  ck_assert_uint_eq(bytes, 6 * MIB);
  ck_assert_uint_eq(f.b.waitq.held, 1);
  check_sums(&f);
  ck_assert_int_eq(fx_free(&f, "a", 1001, slab), 0);
  assert_served(&f, "b", r, 2 * MIB);
  report(&f, "a", 1001, 0, 1);
  ck_assert_uint_eq(f.b.reclaim.asks, 0);
  check_sums(&f);
  fx_close(&f);
}
END_TEST

/* Alloc.ahead is the client's word: what the broker asks for it is
 * clipped to what the tenant could still hold after the request.  q,
 * 6 MiB of its 8 MiB quota in use, asks a page with an ahead of 64 MiB on
 * a full device: a is asked for the page's 2 MiB only, not for the 6 MiB
 * of quota q could never use once it holds the page. */
START_TEST(pages_ahead_clipped_to_what_the_quota_leaves) {
  struct fx f;
  fx_open_ini(&f, "host:16MiB",
              FX_INI_OFF "[tenant:q]\nuids = 1002\nquota = 8MiB\n");
  fx_hello(&f, "a", 1001, "");
  fx_hello(&f, "b", 1002, "q");
  uint64_t slab = cache(&f, "a", 1001, 10 * MIB);
  hold(&f, "b", 1002, 6 * MIB);
  uint64_t r = held_page(&f, "b", 1002, 64 * MIB);
  uint64_t bytes = 0;
  ck_assert_uint_eq(trims_to(&f, "a", &bytes), 1);
  ck_assert_uint_eq(bytes, 2 * MIB);
  check_sums(&f);
  ck_assert_int_eq(fx_free(&f, "a", 1001, slab), 0);
  assert_served(&f, "b", r, 2 * MIB);
  report(&f, "a", 1001, 0, 1);
  check_sums(&f);
  fx_close(&f);
}
END_TEST

/* The order: lowest tenant priority first, then the largest cache; a
 * tenant of higher priority is asked only for what the lower ones could
 * not give. */
START_TEST(order_lowest_priority_then_largest_cache) {
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
  cache(&f, "a", 1003, 8 * MIB); /* high: the largest cache of all */
  cache(&f, "b", 1001, 4 * MIB); /* low */
  cache(&f, "c", 1001, 6 * MIB); /* low, larger */
  cache(&f, "d", 1002, 8 * MIB); /* mid */
  /* 26 MiB held, 6 MiB of room: 18 MiB lacks 12. */
  held(&f, "e", 1004, 18 * MIB, 0);
  ck_assert_str_eq(trim_rid(&f, 0), "c");
  ck_assert_str_eq(trim_rid(&f, 1), "b");
  ck_assert_str_eq(trim_rid(&f, 2), "d");
  uint64_t bytes = 0;
  ck_assert_uint_eq(trims_to(&f, "c", &bytes), 1);
  ck_assert_uint_eq(bytes, 6 * MIB);
  ck_assert_uint_eq(trims_to(&f, "b", &bytes), 1);
  ck_assert_uint_eq(bytes, 4 * MIB);
  ck_assert_uint_eq(trims_to(&f, "d", &bytes), 1);
  ck_assert_uint_eq(bytes, 2 * MIB);
  ck_assert_uint_eq(trims_to(&f, "a", NULL), 0);
  ck_assert_uint_eq(sess(&f, "a")->trim_asks, 0);
  check_sums(&f);
  fx_close(&f);
}
END_TEST

/* Another tenant is never asked below its reservation: keep (reserve
 * 6 MiB) holds 8 MiB of cache and gives at most 2; the rest comes from
 * the next tenant in order. */
START_TEST(reservation_never_asked_below) {
  struct fx f;
  fx_open_ini(&f, "host:16MiB",
              FX_INI_OFF
              "[tenant:keep]\nuids = 1001\nreserve = 6MiB\npriority = -10\n"
              "[tenant:other]\nuids = 1002\n"
              "[tenant:req]\nuids = 1003\n");
  fx_hello(&f, "a", 1001, "keep");
  fx_hello(&f, "b", 1002, "other");
  fx_hello(&f, "c", 1003, "req");
  cache(&f, "a", 1001, 8 * MIB);
  cache(&f, "b", 1002, 4 * MIB);
  /* 12 MiB held, 4 of room: 8 MiB lacks 4. */
  held(&f, "c", 1003, 8 * MIB, 0);
  uint64_t bytes = 0;
  ck_assert_uint_eq(trims_to(&f, "a", &bytes), 1);
  ck_assert_uint_eq(bytes, 2 * MIB); /* 8 used - 6 reserved */
  ck_assert_uint_eq(trims_to(&f, "b", &bytes), 1);
  ck_assert_uint_eq(bytes, 2 * MIB);
  struct gmb_tenant *keep = fx_tenant(&f, "keep");
  ck_assert_uint_ge(keep->used - keep->cache_asked, keep->reserve);
  check_sums(&f);
  fx_close(&f);
}
END_TEST

/* When what may be asked cannot cover what is missing, nobody is asked
 * and the request is refused at once, as without caches. */
START_TEST(nothing_asked_when_caches_cannot_cover) {
  struct fx f;
  fx_open_ini(&f, "host:16MiB",
              FX_INI_OFF
              "[tenant:keep]\nuids = 1001\nreserve = 6MiB\n"
              "[tenant:req]\nuids = 1003\n");
  fx_hello(&f, "a", 1001, "keep");
  fx_hello(&f, "c", 1003, "req");
  cache(&f, "a", 1001, 8 * MIB);
  hold(&f, "c", 1003, 4 * MIB);
  /* 12 MiB held, 4 of room: 8 MiB lacks 4, keep may give only 2. */
  struct wire_reply rep;
  ck_assert_int_eq(fx_alloc(&f, "c", 1003, 8 * MIB, 0, 0, &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_NOMEM);
  ck_assert_uint_eq(rep.asked_back, 0);
  ck_assert_uint_eq(trims_to(&f, "a", NULL), 0);
  ck_assert_uint_eq(sess(&f, "a")->trim_asks, 0);
  ck_assert_uint_eq(f.b.waitq.n, 0);
  fx_close(&f);
}
END_TEST

/* A cache figure beyond what the session's tenant holds is not believed:
 * asks are bounded by the memory there really is. */
START_TEST(cached_free_beyond_used_not_believed) {
  struct fx f;
  open_two(&f);
  hold(&f, "a", 1001, 2 * MIB);
  report(&f, "a", 1001, UINT64_MAX, 0);
  hold(&f, "b", 1002, 4 * MIB);
  /* 6 MiB held, 2 of room: 6 MiB lacks 4; a holds only 2. */
  struct wire_reply rep;
  ck_assert_int_eq(fx_alloc(&f, "b", 1002, 6 * MIB, 0, 0, &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_NOMEM);
  ck_assert_uint_eq(trims_to(&f, "a", NULL), 0);
  /* The tenant's sum is capped too (gmb_stats.cached), and does not wrap
   * with a second session's figure. */
  fx_hello(&f, "c", 1001, "");
  report(&f, "c", 1001, 1, 0);
  ck_assert_uint_eq(gmb__tenant_cached(fx_tenant(&f, "uid-1001")), 2 * MIB);
  fx_close(&f);
}
END_TEST

/* A session's cache figure is believed only up to what that session
 * holds, not its tenant: a, holding nothing while its tenant's other
 * session c holds 4 MiB in use, reports an endless cache.  It used to be
 * asked first (the largest cache) for all b lacked, so d's real cache was
 * never asked and b's request came back GMB_E_NOMEM once a's answer gave
 * nothing.  Now d is asked, and b is served. */
START_TEST(cached_free_beyond_the_sessions_own_not_believed) {
  struct fx f;
  fx_open_ini(&f, "host:8MiB", FX_INI_OFF);
  fx_hello(&f, "a", 1001, "");
  fx_hello(&f, "b", 1002, "");
  fx_hello(&f, "c", 1001, "");
  fx_hello(&f, "d", 1003, "");
  report(&f, "a", 1001, UINT64_MAX, 0);
  hold(&f, "c", 1001, 4 * MIB);
  uint64_t slab = cache(&f, "d", 1003, 2 * MIB);
  /* 6 MiB held, 2 of room: 4 MiB lacks 2, which only d can give. */
  uint64_t r = held(&f, "b", 1002, 4 * MIB, 0);
  ck_assert_uint_eq(trims_to(&f, "a", NULL), 0);
  uint64_t bytes = 0;
  ck_assert_uint_eq(trims_to(&f, "d", &bytes), 1);
  ck_assert_uint_eq(bytes, 2 * MIB);
  check_sums(&f);
  ck_assert_int_eq(fx_free(&f, "d", 1003, slab), 0);
  assert_served(&f, "b", r, 4 * MIB);
  report(&f, "d", 1003, 0, 1);
  check_sums(&f);
  fx_close(&f);
}
END_TEST

/* A Heartbeat from `rid` reporting `holes` free between its cache's
 * blocks (Request.cached_holes). */
static void report_holes(struct fx *f, const char *rid, uid_t uid,
                         uint64_t holes) {
  struct wire_request req;
  memset(&req, 0, sizeof req);
  req.kind = WIRE_HEARTBEAT;
  req.cached_holes = holes;
  struct wire_reply rep;
  ck_assert_int_eq(fx_request(f, rid, uid, &req, &rep), 0);
}

/* A Free of `id` whose report claims `holes` (heard before the free). */
static void free_holes(struct fx *f, const char *rid, uid_t uid, uint64_t id,
                       uint64_t holes) {
  struct wire_request req;
  memset(&req, 0, sizeof req);
  req.kind = WIRE_FREE;
  req.u.free.id = id;
  req.cached_holes = holes;
  struct wire_reply rep;
  ck_assert_int_eq(fx_request(f, rid, uid, &req, &rep), 1);
  ck_assert_int_eq(rep.status, 0);
}

/* A session's holes are at most what it holds, and stay so when it holds
 * less (a Free, the broker's offload) before it reports again: a Free
 * whose report claims every byte held before it (a liar, or a page freed
 * just after the figure was taken) would otherwise leave those bytes
 * uncharged for its tenant's other sessions, though no page holds them. */
START_TEST(holes_follow_what_the_session_holds) {
  struct fx f;
  fx_open_ini(&f, "host:64MiB", "[broker]\ncompaction = off\ncache_holes = 1\n"
              "[tenant:t]\nuids = 1001\nquota = 16MiB\n");
  fx_hello(&f, "a", 1001, "t");
  fx_hello(&f, "b", 1001, "t");
  uint64_t p1 = hold(&f, "a", 1001, 2 * MIB);
  uint64_t p2 = hold(&f, "a", 1001, 2 * MIB);
  report_holes(&f, "a", 1001, UINT64_MAX);
  struct gmb_tenant *t = fx_tenant(&f, "t");
  ck_assert_uint_eq(sess(&f, "a")->cached_holes, 4 * MIB);
  ck_assert_uint_eq(t->cache_holes, 4 * MIB);
  ck_assert_uint_eq(gmb__tenant_charged(t), 0);
  /* One page freed, its report claiming all: 2 MiB left to claim. */
  free_holes(&f, "a", 1001, p1, UINT64_MAX);
  ck_assert_uint_eq(sess(&f, "a")->cached_holes, 2 * MIB);
  ck_assert_uint_eq(t->cache_holes, 2 * MIB);
  ck_assert_uint_eq(gmb__tenant_charged(t), 0);
  /* The second: nothing held, nothing forgiven.  b gets the quota, not
   * the quota and a's old holes. */
  free_holes(&f, "a", 1001, p2, UINT64_MAX);
  ck_assert_uint_eq(sess(&f, "a")->cached_holes, 0);
  ck_assert_uint_eq(t->cache_holes, 0);
  hold(&f, "b", 1001, 16 * MIB);
  struct wire_reply rep;
  ck_assert_int_eq(fx_alloc(&f, "b", 1001, 2 * MIB, 0, 0, &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_QUOTA);
  fx_close(&f);
}
END_TEST

/* A session that ignores the ask: the held request falls through after the
 * bound (here GMB_E_NOMEM: compaction is off), the session's trim_ignored
 * counts it, and it is not asked again before its pause ends; a second
 * ignored ask doubles the pause. */
START_TEST(ignored_ask_falls_through_after_bound) {
  struct fx f;
  open_two(&f);
  cache(&f, "a", 1001, 6 * MIB);
  uint64_t r = held(&f, "b", 1002, 4 * MIB, 0);
  struct gmb_session *a = sess(&f, "a");
  /* Before the bound the timer changes nothing. */
  timer_after(&f, 0);
  ck_assert_ptr_null(answer_to(&f, "b", r));
  ck_assert_uint_eq(f.b.reclaim.asks, 1);
  uint64_t t0 = gmb__now_ns();
  timer_past_bound(&f);
  const struct wire_reply *rep = answer_to(&f, "b", r);
  ck_assert_ptr_nonnull(rep);
  ck_assert_int_eq(rep->status, GMB_E_NOMEM);
  ck_assert_int_eq(rep->kind, WIRE_NOMEM);
  ck_assert_uint_eq(a->trim_asks, 1);
  ck_assert_uint_eq(a->trim_ignored, 1);
  ck_assert_uint_eq(f.b.reclaim.ignored_total, 1);
  ck_assert_uint_eq(f.b.reclaim.asks, 0);
  ck_assert_uint_eq(f.b.waitq.n, 0);
  ck_assert_uint_gt(a->ask_skip_ns, t0);
  /* Paused: the next request is refused at once, a not asked. */
  struct wire_reply now;
  ck_assert_int_eq(fx_alloc(&f, "b", 1002, 4 * MIB, 0, 0, &now), 1);
  ck_assert_int_eq(now.status, GMB_E_NOMEM);
  ck_assert_uint_eq(a->trim_asks, 1);
  ck_assert_uint_eq(trims_to(&f, "a", NULL), 1);
  /* Once the pause is over (as if it passed), asked again; ignored again,
   * the pause doubles. */
  a->ask_skip_ns = 0;
  a->tenant->ask_skip_ns = 0; /* its tenant's pause: the same */
  held(&f, "b", 1002, 4 * MIB, 0);
  ck_assert_uint_eq(a->trim_asks, 2);
  uint64_t now_ns = gmb__now_ns() + (f.b.cfg.trim_wait_ms + 1) * GMB_NS_PER_MS;
  gmb__reclaim_expire(&f.b, now_ns);
  ck_assert_uint_eq(a->trim_ignored, 2);
  ck_assert_uint_eq(a->ask_ignored_run, 2);
  ck_assert_uint_eq(a->ask_skip_ns - now_ns, 2 * GMB_NS_PER_S);
  check_sums(&f);
  fx_close(&f);
}
END_TEST

/* One ask in flight per session: a second request that finds the device
 * full while a's ask is out does not ask a again.  One that lacks more
 * than is on its way is refused at once (nobody else to ask); one that
 * the bytes on their way cover is held too, and both held requests are
 * served by a's free. */
START_TEST(one_ask_in_flight_per_session) {
  struct fx f;
  open_two(&f);
  fx_hello(&f, "c", 1002, "");
  uint64_t slab = cache(&f, "a", 1001, 6 * MIB);
  uint64_t r1 = held(&f, "b", 1002, 4 * MIB, 0);
  struct wire_reply rep;
  ck_assert_int_eq(fx_alloc(&f, "c", 1002, 6 * MIB, 0, 0, &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_NOMEM);
  uint64_t r2 = held(&f, "c", 1002, 4 * MIB, 0);
  ck_assert_uint_eq(trims_to(&f, "a", NULL), 1);
  ck_assert_uint_eq(sess(&f, "a")->trim_asks, 1);
  ck_assert_uint_eq(f.b.waitq.held, 2);
  ck_assert_int_eq(fx_free(&f, "a", 1001, slab), 0);
  assert_served(&f, "b", r1, 4 * MIB);
  assert_served(&f, "c", r2, 4 * MIB);
  report(&f, "a", 1001, 0, 1);
  check_sums(&f);
  fx_close(&f);
}
END_TEST

/* An answer that gave nothing back ends the hold at once (no wait for the
 * bound); it counts as an ask ignored.  The first such answer in a row
 * pauses nothing: a cache's report may be one request old (a page it
 * reported idle was taken since by its own next block). */
START_TEST(empty_answer_ends_hold_at_once) {
  struct fx f;
  open_two(&f);
  cache(&f, "a", 1001, 6 * MIB);
  uint64_t r = held(&f, "b", 1002, 4 * MIB, 0);
  report(&f, "a", 1001, 6 * MIB, 1);
  const struct wire_reply *rep = answer_to(&f, "b", r);
  ck_assert_ptr_nonnull(rep);
  ck_assert_int_eq(rep->status, GMB_E_NOMEM);
  ck_assert_uint_eq(sess(&f, "a")->trim_ignored, 1);
  ck_assert_uint_eq(sess(&f, "a")->ask_ignored_run, 1);
  ck_assert_uint_le(sess(&f, "a")->ask_skip_ns, gmb__now_ns());
  ck_assert_uint_eq(f.b.reclaim.asks, 0);
  ck_assert_uint_eq(f.b.waitq.n, 0);
  fx_close(&f);
}
END_TEST

/* A cache that answers every ask and reports fewer cached bytes, but
 * frees nothing, made every refusal on a full device wait for its answer
 * (the report was believed).  What it gave is now what it stopped
 * holding: the lie counts as an ask ignored; the first in a row is
 * forgiven (asked again at once: a stale report looks the same), the
 * second pauses the liar for 1 s, and the pause doubles with each further
 * lie; the next request meanwhile is refused at once without asking it. */
START_TEST(lying_answer_paused_and_doubling) {
  struct fx f;
  open_two(&f);
  cache(&f, "a", 1001, 6 * MIB);
  struct gmb_session *a = sess(&f, "a");
  held(&f, "b", 1002, 4 * MIB, 0);
  report(&f, "a", 1001, 6 * MIB - 4096, 1); /* "gave 4 KiB": a lie */
  ck_assert_uint_eq(a->trim_ignored, 1);
  ck_assert_uint_le(a->ask_skip_ns, gmb__now_ns()); /* forgiven once */
  report(&f, "a", 1001, 6 * MIB, 0); /* claims it all again */
  held(&f, "b", 1002, 4 * MIB, 0);
  ck_assert_uint_eq(trims_to(&f, "a", NULL), 2);
  uint64_t t0 = gmb__now_ns();
  report(&f, "a", 1001, 6 * MIB - 4096, 1); /* the second lie in a row */
  ck_assert_uint_eq(a->trim_ignored, 2);
  ck_assert_uint_eq(a->ask_ignored_run, 2);
  ck_assert_uint_ge(a->ask_skip_ns, t0 + GMB_NS_PER_S);
  report(&f, "a", 1001, 6 * MIB, 0); /* claims it all again */
  struct wire_reply now;
  ck_assert_int_eq(fx_alloc(&f, "b", 1002, 4 * MIB, 0, 0, &now), 1);
  ck_assert_int_eq(now.status, GMB_E_NOMEM);
  ck_assert_uint_eq(trims_to(&f, "a", NULL), 2);
  /* After the pause (as if it passed), asked again; it lies again. */
  a->ask_skip_ns = 0;
  a->tenant->ask_skip_ns = 0; /* its tenant's pause: the same */
  held(&f, "b", 1002, 4 * MIB, 0);
  ck_assert_uint_eq(trims_to(&f, "a", NULL), 3);
  uint64_t t1 = gmb__now_ns();
  report(&f, "a", 1001, 6 * MIB - 4096, 1);
  ck_assert_uint_eq(a->trim_ignored, 3);
  ck_assert_uint_eq(a->ask_ignored_run, 3);
  ck_assert_uint_ge(a->ask_skip_ns, t1 + 2 * GMB_NS_PER_S);
  check_sums(&f);
  fx_close(&f);
}
END_TEST

/* A request that asked to wait, held for an ask that runs out, waits on
 * in its place for its own deadline, and is served by a later free. */
START_TEST(waiting_request_waits_on_after_bound) {
  struct fx f;
  open_two(&f);
  uint64_t slab = cache(&f, "a", 1001, 6 * MIB);
  uint64_t r = held(&f, "b", 1002, 4 * MIB, LONG_MS);
  ck_assert_uint_eq(trims_to(&f, "a", NULL), 1);
  /* It holds back others like any waiter. */
  ck_assert_int_eq(gmb__waitq_ahead(&f.b, 0), 1);
  timer_past_bound(&f);
  ck_assert_ptr_null(answer_to(&f, "b", r));
  ck_assert_uint_eq(sess(&f, "a")->trim_ignored, 1);
  ck_assert_uint_eq(f.b.waitq.n, 1);
  ck_assert_uint_eq(f.b.waitq.held, 0);
  ck_assert_int_eq(fx_free(&f, "a", 1001, slab), 0);
  assert_served(&f, "b", r, 4 * MIB);
  fx_close(&f);
}
END_TEST

/* A session with requests in the wait queue is blocked in that call (its
 * library could not answer): it is not asked. */
START_TEST(waiting_session_not_asked) {
  struct fx f;
  open_two(&f);
  fx_hello(&f, "c", 1002, "");
  cache(&f, "a", 1001, 6 * MIB);
  /* a also waits for 4 MiB: the device cannot give it. */
  uint64_t ra = held(&f, "a", 1001, 4 * MIB, LONG_MS);
  ck_assert_uint_eq(sess(&f, "a")->waiting, 1);
  /* Its figure, as its Alloc would have carried it. */
  report(&f, "a", 1001, 6 * MIB, 0);
  struct wire_reply rep;
  ck_assert_int_eq(fx_alloc(&f, "b", 1002, 4 * MIB, 0, 0, &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_NOMEM);
  ck_assert_uint_eq(trims_to(&f, "a", NULL), 0);
  (void)ra;
  fx_close(&f);
}
END_TEST

/* The session asked dies (or ends any other way) with its ask in flight:
 * its memory serves the held request, and it is not counted as ignoring
 * the ask. */
START_TEST(asked_session_ends) {
  struct fx f;
  open_two(&f);
  cache(&f, "a", 1001, 6 * MIB);
  uint64_t r = held(&f, "b", 1002, 4 * MIB, 0);
  ck_assert_uint_eq(f.b.reclaim.asks, 1);
  fx_end(&f, sess(&f, "a"));
  assert_served(&f, "b", r, 4 * MIB);
  ck_assert_uint_eq(f.b.reclaim.asks, 0);
  ck_assert_uint_eq(f.b.reclaim.ask_bytes, 0);
  ck_assert_uint_eq(f.b.reclaim.ignored_total, 0);
  ck_assert_uint_eq(f.b.reclaim.caching, 0);
  ck_assert_uint_eq(fx_tenant(&f, "uid-1001")->cache_asked, 0);
  fx_close(&f);
}
END_TEST

/* The requester ends while held: its request goes with it, and the ask
 * runs out as any other. */
START_TEST(held_requester_ends) {
  struct fx f;
  open_two(&f);
  cache(&f, "a", 1001, 6 * MIB);
  held(&f, "b", 1002, 4 * MIB, 0);
  fx_end(&f, sess(&f, "b"));
  ck_assert_uint_eq(f.b.waitq.n, 0);
  ck_assert_uint_eq(f.b.waitq.held, 0);
  ck_assert_uint_eq(f.b.reclaim.asks, 1);
  timer_past_bound(&f);
  ck_assert_uint_eq(f.b.reclaim.asks, 0);
  fx_close(&f);
}
END_TEST

/* trim_wait_ms = 0: caches are never asked, the request is refused at
 * once. */
START_TEST(trim_wait_zero_never_asks) {
  struct fx f;
  fx_open_ini(&f, "host:8MiB", "[broker]\ncompaction = off\n"
                               "trim_wait_ms = 0\n");
  fx_hello(&f, "a", 1001, "");
  fx_hello(&f, "b", 1002, "");
  cache(&f, "a", 1001, 6 * MIB);
  struct wire_reply rep;
  ck_assert_int_eq(fx_alloc(&f, "b", 1002, 4 * MIB, 0, 0, &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_NOMEM);
  ck_assert_uint_eq(trims_to(&f, "a", NULL), 0);
  fx_close(&f);
}
END_TEST

/* With compaction on, a held request that still does not fit when the
 * bound passes but fits the device's free total waits for a compaction
 * run, as it would have without the ask, and the run serves it. */
START_TEST(falls_through_to_compaction) {
  struct fx f;
  fx_open_ini(&f, "host:8MiB", NULL);
  fx_hello(&f, "a", 1001, "");
  fx_hello(&f, "b", 1002, "");
  /* b: two small segments of movable 512 KiB pieces, every other one
   * freed: 2 MiB free in holes, no room for a new segment. */
  uint64_t ids[8];
  for (int i = 0; i < 8; i++) {
    struct wire_reply rep = fx_must_alloc(&f, "b", 1002, 512 * 1024,
                                          GMB_MOVABLE);
    ids[i] = rep.u.alloc.id;
  }
  for (int i = 0; i < 8; i += 2)
    ck_assert_int_eq(fx_free(&f, "b", 1002, ids[i]), 0);
  cache(&f, "a", 1001, 4 * MIB);
  ck_assert_uint_eq(f.b.dev->in_use, 8 * MIB);
  uint64_t r = held(&f, "b", 1002, 2 * MIB, 0);
  ck_assert_uint_eq(trims_to(&f, "a", NULL), 1);
  ck_assert_ptr_null(f.b.compacting); /* asks first: cheaper than moving */
  timer_past_bound(&f);
  ck_assert_ptr_null(answer_to(&f, "b", r));
  ck_assert_ptr_nonnull(f.b.compacting);
  ck_assert_uint_eq(f.b.waitq.after_compact, 1);
  while (gmb__defrag_tick(&f.b, UINT64_MAX)) {
  }
  assert_served(&f, "b", r, 2 * MIB);
  fx_close(&f);
}
END_TEST

/* ---- the quota --------------------------------------------------------- */

/* Tenant q (uid 1001, quota 8 MiB) on a 64 MiB device, compaction off,
 * with sessions a and b; `more_ini` (NULL: none) follows its [broker]
 * lines: more of them, or other sections. */
static void open_quota(struct fx *f, const char *more_ini) {
  char ini[512];
  snprintf(ini, sizeof ini, FX_INI_OFF "%s[tenant:q]\nquota = 8MiB\n",
           more_ini ? more_ini : "");
  fx_open_ini(f, "host:64MiB", ini);
  fx_hello(f, "a", 1001, "q");
  fx_hello(f, "b", 1001, "q");
}

/* a caches 6 MiB of q's 8; b asks 4 MiB: a is asked for the 2 MiB
 * missing and b's request is held, not refused, and not counted as
 * refused; a's free serves it; a's answer closes the ask. */
START_TEST(quota_held_served_when_cache_gives_back) {
  struct fx f;
  open_quota(&f, NULL);
  struct gmb_tenant *q = fx_tenant(&f, "q");
  uint64_t slab = cache(&f, "a", 1001, 6 * MIB);
  uint64_t refusals = q->refusals_quota;
  uint64_t r = held(&f, "b", 1001, 4 * MIB, 0);
  uint64_t bytes = 0;
  ck_assert_uint_eq(trims_to(&f, "a", &bytes), 1);
  ck_assert_uint_eq(bytes, 2 * MIB);
  ck_assert_uint_eq(q->cache_asked, 2 * MIB);
  ck_assert_uint_eq(f.b.waitq.held, 1);
  ck_assert_uint_eq(f.b.waitq.held_quota, 1);
  ck_assert_uint_eq(q->refusals_quota, refusals);
  check_sums(&f);
  ck_assert_int_eq(fx_free(&f, "a", 1001, slab), 0);
  assert_served(&f, "b", r, 4 * MIB);
  ck_assert_uint_eq(q->used, 4 * MIB);
  ck_assert_uint_eq(q->refusals_quota, refusals);
  ck_assert_uint_eq(f.b.waitq.n, 0);
  report(&f, "a", 1001, 0, 1);
  ck_assert_uint_eq(f.b.reclaim.asks, 0);
  ck_assert_uint_eq(q->cache_asked, 0);
  ck_assert_uint_eq(sess(&f, "a")->trim_ignored, 0);
  check_sums(&f);
  fx_close(&f);
}
END_TEST

/* gmb_alloc_wait is held the same way, and holds back nobody meanwhile:
 * a request of another tenant that asks to wait is not queued behind it. */
START_TEST(quota_held_wait_request_blocks_nobody) {
  struct fx f;
  open_quota(&f, NULL);
  fx_hello(&f, "c", 1002, "");
  uint64_t slab = cache(&f, "a", 1001, 6 * MIB);
  uint64_t r = held(&f, "b", 1001, 4 * MIB, LONG_MS);
  ck_assert_uint_eq(trims_to(&f, "a", NULL), 1);
  ck_assert_int_eq(gmb__waitq_ahead(&f.b, 0), 0);
  struct wire_reply rep;
  ck_assert_int_eq(fx_alloc(&f, "c", 1002, 4 * MIB, 0, LONG_MS, &rep), 1);
  ck_assert_msg(rep.status == 0, "%s", rep.message);
  ck_assert_int_eq(fx_free(&f, "a", 1001, slab), 0);
  assert_served(&f, "b", r, 4 * MIB);
  ck_assert_uint_eq(f.b.waitq.n, 0);
  report(&f, "a", 1001, 0, 1);
  fx_close(&f);
}
END_TEST

/* Bytes in use are never waited for: with nothing cached, with less
 * cached than is missing, or for more than the whole quota, the refusal
 * is immediate, nobody is asked, nothing is held, and each refusal is
 * counted. */
START_TEST(quota_in_use_refused_at_once) {
  struct fx f;
  open_quota(&f, NULL);
  struct gmb_tenant *q = fx_tenant(&f, "q");
  hold(&f, "a", 1001, 6 * MIB);
  uint64_t refusals = q->refusals_quota;
  struct wire_reply rep;
  /* Nothing cached. */
  ck_assert_int_eq(fx_alloc(&f, "b", 1001, 4 * MIB, 0, 0, &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_QUOTA);
  ck_assert_uint_eq(rep.asked_back, 0);
  ck_assert_ptr_null(strstr(rep.message, "asked back"));
  /* 1 MiB cached of the 2 MiB missing: not enough, nobody asked. */
  report(&f, "a", 1001, 1 * MIB, 0);
  ck_assert_int_eq(fx_alloc(&f, "b", 1001, 4 * MIB, 0, LONG_MS, &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_QUOTA);
  ck_assert_uint_eq(rep.asked_back, 0);
  /* More than the quota itself, whatever is cached. */
  report(&f, "a", 1001, 6 * MIB, 0);
  ck_assert_int_eq(fx_alloc(&f, "b", 1001, 10 * MIB, 0, 0, &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_QUOTA);
  ck_assert_uint_eq(trims_to(&f, "a", NULL), 0);
  ck_assert_uint_eq(sess(&f, "a")->trim_asks, 0);
  ck_assert_uint_eq(f.b.waitq.n, 0);
  ck_assert_uint_eq(q->refusals_quota, refusals + 3);
  fx_close(&f);
}
END_TEST

/* A session that reports cached bytes and never gives them back: the
 * held request is refused GMB_E_QUOTA at the bound (told why), counted
 * once; the session is counted as ignoring the ask and paused, so the
 * next request is refused at once and it is not asked again. */
START_TEST(quota_ignored_ask_refused_at_bound) {
  struct fx f;
  open_quota(&f, NULL);
  struct gmb_tenant *q = fx_tenant(&f, "q");
  cache(&f, "a", 1001, 6 * MIB);
  uint64_t refusals = q->refusals_quota;
  uint64_t r = held(&f, "b", 1001, 4 * MIB, LONG_MS);
  timer_after(&f, 0);
  ck_assert_ptr_null(answer_to(&f, "b", r));
  timer_past_bound(&f);
  const struct wire_reply *rep = answer_to(&f, "b", r);
  ck_assert_ptr_nonnull(rep);
  ck_assert_int_eq(rep->status, GMB_E_QUOTA);
  ck_assert_ptr_nonnull(strstr(rep->message, "trim_wait_ms"));
  ck_assert_uint_eq(rep->asked_back, 0);
  ck_assert_uint_eq(q->refusals_quota, refusals + 1);
  ck_assert_uint_eq(sess(&f, "a")->trim_ignored, 1);
  ck_assert_uint_eq(f.b.waitq.n, 0);
  ck_assert_uint_eq(f.b.waitq.held_quota, 0);
  struct wire_reply now;
  ck_assert_int_eq(fx_alloc(&f, "b", 1001, 4 * MIB, 0, 0, &now), 1);
  ck_assert_int_eq(now.status, GMB_E_QUOTA);
  ck_assert_uint_eq(trims_to(&f, "a", NULL), 1);
  check_sums(&f);
  fx_close(&f);
}
END_TEST

/* An answer that gave nothing back ends the hold at once: the request is
 * refused without waiting for the bound, and the ask counts as ignored. */
START_TEST(quota_empty_answer_refuses_at_once) {
  struct fx f;
  open_quota(&f, NULL);
  cache(&f, "a", 1001, 6 * MIB);
  uint64_t r = held(&f, "b", 1001, 4 * MIB, 0);
  ck_assert_ptr_null(answer_to(&f, "b", r));
  report(&f, "a", 1001, 6 * MIB, 1);
  const struct wire_reply *rep = answer_to(&f, "b", r);
  ck_assert_ptr_nonnull(rep);
  ck_assert_int_eq(rep->status, GMB_E_QUOTA);
  ck_assert_uint_eq(sess(&f, "a")->trim_ignored, 1);
  ck_assert_uint_eq(f.b.waitq.n, 0);
  fx_close(&f);
}
END_TEST

/* The quota hold waits for its own tenant's asks only: an answer that
 * ends them refuses it at once, while another tenant's ask for a full
 * device, and the request held for it, are still out. */
START_TEST(quota_hold_settles_on_own_tenant_asks) {
  struct fx f;
  fx_open_ini(&f, "host:16MiB", FX_INI_OFF "[tenant:q]\nquota = 8MiB\n");
  fx_hello(&f, "a", 1001, "q");
  fx_hello(&f, "b", 1001, "q");
  fx_hello(&f, "d", 1002, "");
  fx_hello(&f, "e", 1003, "");
  cache(&f, "a", 1001, 6 * MIB);
  cache(&f, "d", 1002, 8 * MIB);
  /* 14 MiB held, 2 of room: e's 4 MiB lacks 2; d, the largest cache, is
   * asked. */
  uint64_t re = held(&f, "e", 1003, 4 * MIB, 0);
  ck_assert_uint_eq(trims_to(&f, "d", NULL), 1);
  ck_assert_uint_eq(trims_to(&f, "a", NULL), 0);
  /* b passes q's quota by 2 MiB: a is asked, b held. */
  uint64_t rb = held(&f, "b", 1001, 4 * MIB, 0);
  ck_assert_uint_eq(trims_to(&f, "a", NULL), 1);
  ck_assert_uint_eq(f.b.waitq.held, 2);
  report(&f, "a", 1001, 6 * MIB, 1); /* answered, nothing given */
  ck_assert_uint_eq(f.b.reclaim.asks, 1);
  const struct wire_reply *rep = answer_to(&f, "b", rb);
  ck_assert_ptr_nonnull(rep);
  ck_assert_int_eq(rep->status, GMB_E_QUOTA);
  ck_assert_ptr_null(answer_to(&f, "e", re));
  ck_assert_uint_eq(f.b.waitq.held, 1);
  check_sums(&f);
  fx_close(&f);
}
END_TEST

/* The session asked dies (its process killed, say) while the request
 * waits on it: its memory is freed and serves the request at once. */
START_TEST(quota_asked_session_ends_serves) {
  struct fx f;
  open_quota(&f, NULL);
  cache(&f, "a", 1001, 6 * MIB);
  uint64_t r = held(&f, "b", 1001, 4 * MIB, LONG_MS);
  fx_end(&f, sess(&f, "a"));
  assert_served(&f, "b", r, 4 * MIB);
  ck_assert_uint_eq(f.b.reclaim.asks, 0);
  ck_assert_uint_eq(f.b.reclaim.ignored_total, 0);
  ck_assert_uint_eq(fx_tenant(&f, "q")->cache_asked, 0);
  ck_assert_uint_eq(f.b.waitq.n, 0);
  fx_close(&f);
}
END_TEST

/* Two sessions are asked; one dies, and what it freed is not enough: the
 * request waits on for the other's ask, and is refused as soon as that
 * one is answered without the bytes. */
START_TEST(quota_asked_session_ends_other_ask_still_out) {
  struct fx f;
  open_quota(&f, NULL);
  fx_hello(&f, "c", 1001, "q");
  fx_hello(&f, "d", 1001, "q");
  hold(&f, "c", 1001, 4 * MIB);
  cache(&f, "a", 1001, 2 * MIB);
  cache(&f, "d", 1001, 2 * MIB);
  /* 8 of 8 used: b's 4 MiB lacks 4, a and d are asked 2 each. */
  uint64_t r = held(&f, "b", 1001, 4 * MIB, 0);
  ck_assert_uint_eq(trims_to(&f, "a", NULL), 1);
  ck_assert_uint_eq(trims_to(&f, "d", NULL), 1);
  fx_end(&f, sess(&f, "a"));
  ck_assert_ptr_null(answer_to(&f, "b", r));
  ck_assert_uint_eq(f.b.waitq.held_quota, 1);
  report(&f, "d", 1001, 2 * MIB, 1);
  const struct wire_reply *rep = answer_to(&f, "b", r);
  ck_assert_ptr_nonnull(rep);
  ck_assert_int_eq(rep->status, GMB_E_QUOTA);
  ck_assert_uint_eq(f.b.waitq.n, 0);
  check_sums(&f);
  fx_close(&f);
}
END_TEST

/* A hold waits for an older ask (made for another request) and one of
 * its own: its own is answered empty-handed, then the older one runs out
 * (the timer at that ask's bound, before the hold's own) while another
 * tenant's ask is still out: nothing is on its way to this tenant any
 * more, so the hold ends there and then. */
START_TEST(quota_hold_ends_when_last_ask_runs_out) {
  struct fx f;
  open_quota(&f, "[tenant:q2]\nquota = 8MiB\n");
  fx_hello(&f, "c", 1001, "q");
  fx_hello(&f, "d", 1001, "q");
  fx_hello(&f, "e", 1002, "q2");
  fx_hello(&f, "g", 1002, "q2");
  hold(&f, "c", 1001, 4 * MIB);
  cache(&f, "a", 1001, 2 * MIB);
  /* b's 4 MiB passes q's quota by 2: a, the only cache, is asked. */
  uint64_t r1 = held(&f, "b", 1001, 4 * MIB, 0);
  ck_assert_uint_eq(trims_to(&f, "a", NULL), 1);
  /* c's 4 MiB passes it by 4 once d caches 2 more: a's 2 are on their
   * way, d is asked for the other 2, later. */
  cache(&f, "d", 1001, 2 * MIB);
  uint64_t r2 = held(&f, "c", 1001, 4 * MIB, LONG_MS);
  ck_assert_uint_eq(trims_to(&f, "d", NULL), 1);
  ck_assert_uint_eq(trims_to(&f, "a", NULL), 1);
  /* Another tenant's ask, still out at the end. */
  cache(&f, "e", 1002, 6 * MIB);
  uint64_t r3 = held(&f, "g", 1002, 4 * MIB, 0);
  ck_assert_uint_eq(trims_to(&f, "e", NULL), 1);
  report(&f, "d", 1001, 2 * MIB, 1);
  ck_assert_ptr_null(answer_to(&f, "c", r2));
  gmb__reclaim_expire(&f.b, sess(&f, "a")->ask_until_ns);
  ck_assert_uint_eq(f.b.reclaim.asks, 1); /* e's */
  const struct wire_reply *rep = answer_to(&f, "c", r2);
  ck_assert_ptr_nonnull(rep);
  ck_assert_int_eq(rep->status, GMB_E_QUOTA);
  rep = answer_to(&f, "b", r1);
  ck_assert_ptr_nonnull(rep);
  ck_assert_int_eq(rep->status, GMB_E_QUOTA);
  ck_assert_ptr_null(answer_to(&f, "g", r3));
  ck_assert_uint_eq(f.b.waitq.n, 1);
  check_sums(&f);
  fx_close(&f);
}
END_TEST

/* An operator raises the quota while a request is held for it: it is
 * served at once, without waiting for the cache's answer or the bound. */
START_TEST(quota_raised_while_held_serves) {
  struct fx f;
  open_quota(&f, NULL);
  cache(&f, "a", 1001, 6 * MIB);
  uint64_t r = held(&f, "b", 1001, 4 * MIB, 0);
  struct wire_request req;
  memset(&req, 0, sizeof req);
  req.id = 9001;
  req.kind = WIRE_ADMIN_QUOTA;
  snprintf(req.u.admin_limit.tenant, sizeof req.u.admin_limit.tenant, "q");
  req.u.admin_limit.set = 1;
  req.u.admin_limit.value = 16 * MIB;
  struct gmb_peer admin = fx_peer("ctl", 0);
  struct wire_reply rep;
  ck_assert_int_eq(gmb__admin(&f.b, &admin, &req, &rep), 1);
  ck_assert_msg(rep.status == 0, "%s", rep.message);
  assert_served(&f, "b", r, 4 * MIB);
  ck_assert_uint_eq(f.b.waitq.n, 0);
  /* a's ask is still out (its library gives back what it can). */
  ck_assert_uint_eq(f.b.reclaim.asks, 1);
  report(&f, "a", 1001, 6 * MIB, 1);
  check_sums(&f);
  fx_close(&f);
}
END_TEST

/* Held requests count against max_waiters_per_session: one more, past
 * the limit, is not held and asks nothing more; its immediate refusal
 * says what is still on its way (Reply.asked_back), for the caller. */
START_TEST(quota_hold_bounded_per_session) {
  struct fx f;
  open_quota(&f, "max_waiters_per_session = 1\n");
  cache(&f, "a", 1001, 6 * MIB);
  uint64_t r = held(&f, "b", 1001, 4 * MIB, 0);
  struct wire_reply rep;
  ck_assert_int_eq(fx_alloc(&f, "b", 1001, 4 * MIB, 0, 0, &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_QUOTA);
  ck_assert_uint_eq(rep.asked_back, 2 * MIB);
  ck_assert_ptr_nonnull(strstr(rep.message, "asked back"));
  ck_assert_uint_eq(trims_to(&f, "a", NULL), 1);
  ck_assert_uint_eq(f.b.waitq.n, 1);
  timer_past_bound(&f);
  rep = *answer_to(&f, "b", r);
  ck_assert_int_eq(rep.status, GMB_E_QUOTA);
  check_sums(&f);
  fx_close(&f);
}
END_TEST

/* Bytes already asked for (and on their way) count: a second request
 * that they cover is held without a second ask of the same session (one
 * ask in flight per session), and both are served by the free, which
 * gives back more than was asked. */
START_TEST(quota_second_request_waits_for_bytes_on_their_way) {
  struct fx f;
  open_quota(&f, NULL);
  fx_hello(&f, "c", 1001, "q");
  uint64_t slab = cache(&f, "a", 1001, 6 * MIB);
  uint64_t r1 = held(&f, "b", 1001, 4 * MIB, 0);
  uint64_t r2 = held(&f, "c", 1001, 4 * MIB, 0);
  ck_assert_uint_eq(trims_to(&f, "a", NULL), 1);
  ck_assert_uint_eq(f.b.waitq.held_quota, 2);
  ck_assert_int_eq(fx_free(&f, "a", 1001, slab), 0);
  assert_served(&f, "b", r1, 4 * MIB);
  assert_served(&f, "c", r2, 4 * MIB);
  report(&f, "a", 1001, 0, 1);
  check_sums(&f);
  fx_close(&f);
}
END_TEST

/* ---- a Vmm increase (cuMemCreate under the preload shim) ---------------- */

/* Session rid reports `bytes` of VMM memory: 1 with *rep when answered at
 * once, 0 when held (its request id is then f->next_req - 1). */
static int vmm(struct fx *f, const char *rid, uid_t uid, uint64_t bytes,
               struct wire_reply *rep) {
  struct wire_request req;
  memset(&req, 0, sizeof req);
  req.kind = WIRE_VMM;
  req.u.vmm.bytes = bytes;
  memset(rep, 0, sizeof *rep);
  return fx_request(f, rid, uid, &req, rep);
}

/* a caches 6 MiB of q's 8; b's cuMemCreate of 4 MiB is held (not refused,
 * not counted as refused) while a is asked for the 2 MiB missing, and
 * served by a's free: b's VMM bytes are charged then, and the answer is
 * the tenant's figures. */
START_TEST(vmm_quota_held_served_when_cache_gives_back) {
  struct fx f;
  open_quota(&f, NULL);
  struct gmb_tenant *q = fx_tenant(&f, "q");
  uint64_t slab = cache(&f, "a", 1001, 6 * MIB);
  uint64_t refusals = q->refusals_quota;
  struct wire_reply rep;
  ck_assert_int_eq(vmm(&f, "b", 1001, 4 * MIB, &rep), 0);
  uint64_t r = f.next_req - 1;
  uint64_t bytes = 0;
  ck_assert_uint_eq(trims_to(&f, "a", &bytes), 1);
  ck_assert_uint_eq(bytes, 2 * MIB);
  ck_assert_uint_eq(f.b.waitq.held_quota, 1);
  ck_assert_uint_eq(sess(&f, "b")->vmm, 0);
  ck_assert_int_eq(sess(&f, "b")->vmm_held, 1);
  ck_assert_int_eq(gmb__waitq_ahead(&f.b, 0), 0);
  check_sums(&f);
  ck_assert_int_eq(fx_free(&f, "a", 1001, slab), 0);
  const struct wire_reply *a = answer_to(&f, "b", r);
  ck_assert_ptr_nonnull(a);
  ck_assert_msg(a->status == 0, "%s", a->message);
  ck_assert_int_eq(a->kind, WIRE_STATS);
  ck_assert_uint_eq(a->u.stats.vmm, 4 * MIB);
  ck_assert_uint_eq(sess(&f, "b")->vmm, 4 * MIB);
  ck_assert_int_eq(sess(&f, "b")->vmm_held, 0);
  ck_assert_uint_eq(q->vmm, 4 * MIB);
  ck_assert_uint_eq(f.b.dev->external, 4 * MIB);
  ck_assert_uint_eq(q->refusals_quota, refusals);
  ck_assert_uint_eq(f.b.waitq.n, 0);
  report(&f, "a", 1001, 0, 1);
  ck_assert_uint_eq(sess(&f, "a")->trim_ignored, 0);
  check_sums(&f);
  fx_close(&f);
}
END_TEST

/* The tenant's own VMM bytes count as held when the missing bytes are
 * reckoned: a holds 2 MiB of VMM memory and caches 4; b's 4 MiB lacks 2,
 * which a is asked for.  Ignored, the hold ends at the bound with
 * GMB_E_QUOTA that says why, nothing charged. */
START_TEST(vmm_quota_ignored_ask_refused_at_bound) {
  struct fx f;
  open_quota(&f, NULL);
  struct wire_reply rep;
  ck_assert_int_eq(vmm(&f, "a", 1001, 2 * MIB, &rep), 1);
  ck_assert_int_eq(rep.status, 0);
  cache(&f, "a", 1001, 4 * MIB);
  ck_assert_int_eq(vmm(&f, "b", 1001, 4 * MIB, &rep), 0);
  uint64_t r = f.next_req - 1;
  uint64_t bytes = 0;
  ck_assert_uint_eq(trims_to(&f, "a", &bytes), 1);
  ck_assert_uint_eq(bytes, 2 * MIB);
  timer_past_bound(&f);
  const struct wire_reply *a = answer_to(&f, "b", r);
  ck_assert_ptr_nonnull(a);
  ck_assert_int_eq(a->status, GMB_E_QUOTA);
  ck_assert_ptr_nonnull(strstr(a->message, "cuMemCreate"));
  ck_assert_ptr_nonnull(strstr(a->message, "trim_wait_ms"));
  ck_assert_uint_eq(sess(&f, "b")->vmm, 0);
  ck_assert_int_eq(sess(&f, "b")->vmm_held, 0);
  ck_assert_uint_eq(fx_tenant(&f, "q")->vmm, 2 * MIB);
  ck_assert_uint_eq(sess(&f, "a")->trim_ignored, 1);
  ck_assert_uint_eq(f.b.waitq.n, 0);
  check_sums(&f);
  fx_close(&f);
}
END_TEST

/* Bytes in use are never waited for: the refusal is immediate. */
START_TEST(vmm_quota_in_use_refused_at_once) {
  struct fx f;
  open_quota(&f, NULL);
  hold(&f, "a", 1001, 6 * MIB);
  struct wire_reply rep;
  ck_assert_int_eq(vmm(&f, "b", 1001, 4 * MIB, &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_QUOTA);
  ck_assert_uint_eq(trims_to(&f, "a", NULL), 0);
  ck_assert_uint_eq(f.b.waitq.n, 0);
  fx_close(&f);
}
END_TEST

/* The device is full: another tenant's cache is asked, as for an
 * allocation, and b's VMM bytes take the room its free made. */
START_TEST(vmm_full_device_asks_other_tenant) {
  struct fx f;
  open_two(&f);
  uint64_t slab = cache(&f, "a", 1001, 6 * MIB);
  struct wire_reply rep;
  ck_assert_int_eq(vmm(&f, "b", 1002, 4 * MIB, &rep), 0);
  uint64_t r = f.next_req - 1;
  uint64_t bytes = 0;
  ck_assert_uint_eq(trims_to(&f, "a", &bytes), 1);
  ck_assert_uint_eq(bytes, 2 * MIB);
  ck_assert_uint_eq(f.b.waitq.held_nowait, 1);
  ck_assert_int_eq(fx_free(&f, "a", 1001, slab), 0);
  const struct wire_reply *a = answer_to(&f, "b", r);
  ck_assert_ptr_nonnull(a);
  ck_assert_msg(a->status == 0, "%s", a->message);
  ck_assert_int_eq(a->kind, WIRE_STATS);
  ck_assert_uint_eq(f.b.dev->external, 4 * MIB);
  report(&f, "a", 1001, 0, 1);
  check_sums(&f);
  fx_close(&f);
}
END_TEST

/* A cache that answers without giving anything back ends the hold at
 * once: GMB_E_NOMEM with the device's room named. */
START_TEST(vmm_full_device_empty_answer_refuses) {
  struct fx f;
  open_two(&f);
  cache(&f, "a", 1001, 6 * MIB);
  struct wire_reply rep;
  ck_assert_int_eq(vmm(&f, "b", 1002, 4 * MIB, &rep), 0);
  uint64_t r = f.next_req - 1;
  report(&f, "a", 1001, 6 * MIB, 1);
  const struct wire_reply *a = answer_to(&f, "b", r);
  ck_assert_ptr_nonnull(a);
  ck_assert_int_eq(a->status, GMB_E_NOMEM);
  ck_assert_ptr_nonnull(strstr(a->message, "cuMemCreate"));
  ck_assert_uint_eq(f.b.dev->external, 0);
  ck_assert_uint_eq(sess(&f, "b")->vmm, 0);
  ck_assert_uint_eq(f.b.waitq.n, 0);
  fx_close(&f);
}
END_TEST

/* What a client can make the broker hold is bounded: one Vmm of a session
 * at a time (another meanwhile, up or down, is refused and changes
 * nothing), and held Vmm requests count against max_waiters_per_session
 * (past it the refusal is immediate and says what is on its way). */
START_TEST(vmm_hold_bounded) {
  struct fx f;
  open_quota(&f, "max_waiters_per_session = 1\n");
  cache(&f, "a", 1001, 6 * MIB);
  struct wire_reply rep;
  ck_assert_int_eq(vmm(&f, "b", 1001, 4 * MIB, &rep), 0);
  uint64_t r = f.next_req - 1;
  ck_assert_int_eq(vmm(&f, "b", 1001, 0, &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_INVAL);
  ck_assert_int_eq(vmm(&f, "b", 1001, 6 * MIB, &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_INVAL);
  ck_assert_uint_eq(f.b.waitq.n, 1);
  /* An allocation of b past its waiter limit is not held either. */
  ck_assert_int_eq(fx_alloc(&f, "b", 1001, 4 * MIB, 0, 0, &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_QUOTA);
  ck_assert_uint_eq(rep.asked_back, 2 * MIB);
  timer_past_bound(&f);
  ck_assert_int_eq(answer_to(&f, "b", r)->status, GMB_E_QUOTA);
  /* c, a third session at its limit with an allocation held: its Vmm is
   * refused at once. */
  fx_hello(&f, "c", 1001, "q");
  sess(&f, "a")->ask_skip_ns = 0;
  held(&f, "c", 1001, 4 * MIB, 0);
  ck_assert_int_eq(vmm(&f, "c", 1001, 4 * MIB, &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_QUOTA);
  ck_assert_uint_eq(sess(&f, "c")->vmm_held, 0);
  check_sums(&f);
  fx_close(&f);
}
END_TEST

/* The session of a held Vmm ends: the request is dropped unanswered, and
 * nothing of it was charged. */
START_TEST(vmm_held_requester_ends) {
  struct fx f;
  open_quota(&f, NULL);
  uint64_t slab = cache(&f, "a", 1001, 6 * MIB);
  struct wire_reply rep;
  ck_assert_int_eq(vmm(&f, "b", 1001, 4 * MIB, &rep), 0);
  fx_end(&f, sess(&f, "b"));
  ck_assert_uint_eq(f.b.waitq.n, 0);
  ck_assert_int_eq(fx_free(&f, "a", 1001, slab), 0);
  ck_assert_uint_eq(fx_tenant(&f, "q")->vmm, 0);
  ck_assert_uint_eq(f.b.dev->external, 0);
  report(&f, "a", 1001, 0, 1);
  check_sums(&f);
  fx_close(&f);
}
END_TEST

static Suite *reclaim_suite(void) {
  Suite *s = suite_create("reclaim");
  TCase *tc = tcase_create("device");
  tcase_add_test(tc, full_device_asks_cache_and_serves_on_free);
  tcase_add_test(tc, pages_ask_for_what_the_miss_asks_next);
  tcase_add_test(tc, pages_ahead_clipped_to_what_the_quota_leaves);
  tcase_add_test(tc, order_lowest_priority_then_largest_cache);
  tcase_add_test(tc, reservation_never_asked_below);
  tcase_add_test(tc, nothing_asked_when_caches_cannot_cover);
  tcase_add_test(tc, cached_free_beyond_used_not_believed);
  tcase_add_test(tc, cached_free_beyond_the_sessions_own_not_believed);
  tcase_add_test(tc, holes_follow_what_the_session_holds);
  tcase_add_test(tc, trim_wait_zero_never_asks);
  tcase_add_test(tc, falls_through_to_compaction);
  suite_add_tcase(s, tc);

  tc = tcase_create("bounds");
  tcase_add_test(tc, ignored_ask_falls_through_after_bound);
  tcase_add_test(tc, one_ask_in_flight_per_session);
  tcase_add_test(tc, empty_answer_ends_hold_at_once);
  tcase_add_test(tc, lying_answer_paused_and_doubling);
  tcase_add_test(tc, waiting_request_waits_on_after_bound);
  tcase_add_test(tc, waiting_session_not_asked);
  suite_add_tcase(s, tc);

  tc = tcase_create("sessions");
  tcase_add_test(tc, asked_session_ends);
  tcase_add_test(tc, held_requester_ends);
  suite_add_tcase(s, tc);

  tc = tcase_create("quota");
  tcase_add_test(tc, quota_held_served_when_cache_gives_back);
  tcase_add_test(tc, quota_held_wait_request_blocks_nobody);
  tcase_add_test(tc, quota_in_use_refused_at_once);
  tcase_add_test(tc, quota_ignored_ask_refused_at_bound);
  tcase_add_test(tc, quota_empty_answer_refuses_at_once);
  tcase_add_test(tc, quota_hold_settles_on_own_tenant_asks);
  tcase_add_test(tc, quota_asked_session_ends_serves);
  tcase_add_test(tc, quota_asked_session_ends_other_ask_still_out);
  tcase_add_test(tc, quota_hold_ends_when_last_ask_runs_out);
  tcase_add_test(tc, quota_raised_while_held_serves);
  tcase_add_test(tc, quota_hold_bounded_per_session);
  tcase_add_test(tc, quota_second_request_waits_for_bytes_on_their_way);
  suite_add_tcase(s, tc);

  tc = tcase_create("vmm");
  tcase_add_test(tc, vmm_quota_held_served_when_cache_gives_back);
  tcase_add_test(tc, vmm_quota_ignored_ask_refused_at_bound);
  tcase_add_test(tc, vmm_quota_in_use_refused_at_once);
  tcase_add_test(tc, vmm_full_device_asks_other_tenant);
  tcase_add_test(tc, vmm_full_device_empty_answer_refuses);
  tcase_add_test(tc, vmm_hold_bounded);
  tcase_add_test(tc, vmm_held_requester_ends);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) { return check_run(reclaim_suite()); }
