/*
 * check_dispatch.c - the client requests' handler, driven through
 * dispatch.h with a whole broker on a host device (broker_fixture.h).
 *
 * Covers Hello (protocol version, a second Hello on one connection, tenant
 * admission, the default uid-UID tenant, the reply's fields: a secret for
 * the descriptor channel, its own for each session, and no name of
 * anything in /dev/shm), requests before Hello and kinds that are not
 * client requests, Alloc's argument checks (size 0, sizes that overflow
 * when rounded, unknown flags), the quota at its exact limit, Alloc replies
 * that name a segment of the tenant and give nothing else (descriptors
 * come from the descriptor channel, check_fdchan.c, which also records
 * the segments a session was given), lock-table slots for movable
 * allocations (and a full table), the two kinds of GMB_E_NOMEM (no room,
 * with its NoMemory body; another tenant's reservation, with its message),
 * Free's answers for ids that are not the session's, Stats, Heartbeat and
 * SegmentClosed (no reply), Bye, and the ends of a waiting allocation
 * (served after a free, timed out, or dropped with its session, and one
 * past its quota held while its tenant's cache gives the bytes back), and
 * the sessions' own VMM memory (Vmm) charged to the tenant and the device.  Every test ends with
 * fx_close(), which requires the pool and tenants to be consistent;
 * fx_request() checks them after every request as well.  The tests of
 * the hardening cases (squatting, impossible waits, limits) are at the end.
 */
#include <check.h>
#include <errno.h>
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include "admin.h"
#include "alloc.h"
#include "broker_fixture.h"
#include "check_main.h"
#include "core.h"
#include "defrag.h"
#include "device.h"
#include "locktab.h"
#include "observe.h"
#include "pool.h"
#include "tenant.h"
#include "util.h"
#include "waitq.h"

#define MIB GMB_MIB

/* The session whose routing id is `rid`. */
static struct gmb_session *session_of(struct fx *f, const char *rid) {
  struct gmb_session *s =
      gmb__session_find(f->b.sessions, (const uint8_t *)rid, strlen(rid));
  ck_assert_ptr_nonnull(s);
  return s;
}

/* Segment `seg` must be live, `size` bytes, with a descriptor, and of
 * tenant t. */
static void check_segment_of(struct fx *f, uint64_t seg, uint64_t size,
                             const struct gmb_tenant *t) {
  void *tag = NULL;
  const struct gmb_dseg *d = gmb__pool_segment(f->b.pool, seg, &tag);
  ck_assert_ptr_nonnull(d);
  ck_assert_uint_eq(d->id, seg);
  ck_assert_uint_eq(d->size, size);
  ck_assert_ptr_eq(tag, t);
  ck_assert_int_ge(d->fd, 0);
}

/* --- hello ------------------------------------------------------------ */

START_TEST(hello_default_tenant_is_uid_name) {
  struct fx f;
  fx_open(&f);
  struct wire_reply rep;
  ck_assert_int_eq(fx_hello_as(&f, "a", 1001, "", WIRE_PROTOCOL_VERSION, &rep),
                   1);
  ck_assert_int_eq(rep.status, 0);
  ck_assert_int_eq(rep.kind, WIRE_HELLO);
  ck_assert_uint_eq(rep.u.hello.version, WIRE_PROTOCOL_VERSION);
  ck_assert_str_eq(rep.u.hello.tenant, "uid-1001");
  ck_assert_str_eq(rep.u.hello.device, "host");
  /* pid 0: the broker cannot watch the process, so it asks for beats. */
  ck_assert_uint_eq(rep.u.hello.heartbeat_ms, f.b.cfg.heartbeat_ms);
  ck_assert_uint_eq(rep.u.hello.lock_slots, GMB_LT_DEFAULT_SLOTS);
  struct gmb_session *s = session_of(&f, "a");
  ck_assert_uint_eq(rep.u.hello.session, s->id);
  /* The secret that proves the session on the descriptor channel. */
  ck_assert_uint_eq(rep.u.hello.fd_secret_len, GMB_FD_SECRET_LEN);
  ck_assert_mem_eq(rep.u.hello.fd_secret, s->secret, GMB_FD_SECRET_LEN);
  ck_assert_int_eq(s->fdconn, -1); /* no channel until it proves itself */
  ck_assert_ptr_nonnull(s->lt);
  ck_assert_ptr_eq(s->tenant, fx_tenant(&f, "uid-1001"));
  ck_assert_uint_eq(s->tenant->n_sessions, 1);
  ck_assert_str_eq(s->client, "check");
  ck_assert_int_eq(s->pidfd, -1);
  /* A second client of the same uid joins the same tenant, another
   * session. */
  ck_assert_int_eq(fx_hello_as(&f, "b", 1001, "", WIRE_PROTOCOL_VERSION, &rep),
                   1);
  ck_assert_int_eq(rep.status, 0);
  ck_assert_uint_ne(rep.u.hello.session, s->id);
  ck_assert_uint_eq(s->tenant->n_sessions, 2);
  ck_assert_uint_eq(gmb__sessions_count(f.b.sessions), 2);
  fx_close(&f);
}
END_TEST

START_TEST(hello_wrong_version) {
  struct fx f;
  fx_open(&f);
  static const uint32_t bad[] = {0, WIRE_PROTOCOL_VERSION + 1, UINT32_MAX};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    struct wire_reply rep;
    ck_assert_int_eq(fx_hello_as(&f, "a", 1001, "", bad[i], &rep), 1);
    ck_assert_int_eq(rep.status, GMB_E_PROTO);
    ck_assert_int_eq(rep.kind, WIRE_NONE);
    ck_assert_ptr_nonnull(strstr(rep.message, "protocol version"));
  }
  ck_assert_uint_eq(gmb__sessions_count(f.b.sessions), 0);
  ck_assert_uint_eq(gmb__sessions_gen(f.b.sessions), 0);
  fx_close(&f);
}
END_TEST

START_TEST(hello_twice_on_one_connection) {
  struct fx f;
  fx_open(&f);
  struct gmb_session *s = fx_hello(&f, "a", 1001, "");
  uint64_t gen = gmb__sessions_gen(f.b.sessions);
  struct wire_reply rep;
  ck_assert_int_eq(fx_hello_as(&f, "a", 1001, "", WIRE_PROTOCOL_VERSION, &rep),
                   1);
  ck_assert_int_eq(rep.status, GMB_E_PROTO);
  ck_assert_int_eq(rep.kind, WIRE_NONE);
  /* Even as another tenant: the connection has its session already. */
  ck_assert_int_eq(fx_hello_as(&f, "a", 1002, "other", WIRE_PROTOCOL_VERSION,
                            &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_PROTO);
  ck_assert_uint_eq(gmb__sessions_count(f.b.sessions), 1);
  ck_assert_uint_eq(gmb__sessions_gen(f.b.sessions), gen);
  ck_assert_ptr_eq(gmb__session_find(f.b.sessions, (const uint8_t *)"a", 1),
                   s);
  ck_assert_uint_eq(s->tenant->n_sessions, 1);
  fx_close(&f);
}
END_TEST

START_TEST(hello_uid_not_listed_refused) {
  struct fx f;
  fx_open_ini(&f, "host:64MiB", "[tenant:llm-a]\nuids = 1001,1003\n");
  struct wire_reply rep;
  ck_assert_int_eq(fx_hello_as(&f, "x", 1002, "llm-a", WIRE_PROTOCOL_VERSION,
                            &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_AUTH);
  ck_assert_int_eq(rep.kind, WIRE_NONE);
  ck_assert_uint_gt(strlen(rep.message), 0);
  ck_assert_uint_eq(gmb__sessions_count(f.b.sessions), 0);
  ck_assert_uint_eq(fx_tenant(&f, "llm-a")->n_sessions, 0);
  /* uid 0 is not special. */
  ck_assert_int_eq(fx_hello_as(&f, "r", 0, "llm-a", WIRE_PROTOCOL_VERSION, &rep),
                   1);
  ck_assert_int_eq(rep.status, GMB_E_AUTH);
  /* Listed uids are admitted. */
  ck_assert_int_eq(fx_hello_as(&f, "a", 1001, "llm-a", WIRE_PROTOCOL_VERSION,
                            &rep), 1);
  ck_assert_int_eq(rep.status, 0);
  ck_assert_str_eq(rep.u.hello.tenant, "llm-a");
  ck_assert_int_eq(fx_hello_as(&f, "c", 1003, "llm-a", WIRE_PROTOCOL_VERSION,
                            &rep), 1);
  ck_assert_int_eq(rep.status, 0);
  ck_assert_uint_eq(fx_tenant(&f, "llm-a")->n_sessions, 2);
  /* The refused connection may try again, rightly this time. */
  ck_assert_int_eq(fx_hello_as(&f, "x", 1001, "", WIRE_PROTOCOL_VERSION, &rep),
                   1);
  ck_assert_int_eq(rep.status, 0);
  ck_assert_str_eq(rep.u.hello.tenant, "uid-1001");
  fx_close(&f);
}
END_TEST

START_TEST(hello_unbound_tenant_owned_by_first_uid) {
  struct fx f;
  fx_open(&f);
  fx_hello(&f, "a", 1001, "shared");
  fx_hello(&f, "a2", 1001, "");
  struct wire_reply rep;
  ck_assert_int_eq(fx_hello_as(&f, "b", 1002, "shared", WIRE_PROTOCOL_VERSION,
                            &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_AUTH);
  /* Another uid cannot slip into uid-1001 by naming it either. */
  ck_assert_int_eq(fx_hello_as(&f, "b", 1002, "uid-1001", WIRE_PROTOCOL_VERSION,
                            &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_AUTH);
  ck_assert_uint_eq(gmb__sessions_count(f.b.sessions), 2);
  ck_assert_uint_eq(fx_tenant(&f, "shared")->n_sessions, 1);
  fx_close(&f);
}
END_TEST

START_TEST(hello_bad_tenant_name) {
  struct fx f;
  fx_open(&f);
  static const char *const bad[] = {"-x", ".x", "a b", "a/b"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    struct wire_reply rep;
    ck_assert_int_eq(fx_hello_as(&f, "a", 1001, bad[i], WIRE_PROTOCOL_VERSION,
                              &rep), 1);
    ck_assert_int_eq(rep.status, GMB_E_INVAL);
  }
  ck_assert_uint_eq(gmb__sessions_count(f.b.sessions), 0);
  ck_assert_uint_eq(gmb__tenants_count(f.b.tenants), 0);
  fx_close(&f);
}
END_TEST

/* Each session has a secret of its own (32 random bytes): knowing one's
 * own proves nothing about another's.  And a session's memory has no name
 * anybody could open: the lock table and the segments are descriptors. */
START_TEST(hello_secret_per_session_nothing_named) {
  int shm_before = fx_shm_names();
  struct fx f;
  fx_open(&f);
  enum { N = 4 };
  static const char *const rids[N] = {"a", "b", "c", "d"};
  uint8_t secret[N][GMB_FD_SECRET_LEN];
  for (int i = 0; i < N; i++) {
    struct wire_reply rep;
    /* Two of the same uid and tenant, two of another. */
    uid_t uid = i < 2 ? 1001 : 1002;
    ck_assert_int_eq(
        fx_hello_as(&f, rids[i], uid, "", WIRE_PROTOCOL_VERSION, &rep), 1);
    ck_assert_int_eq(rep.status, 0);
    ck_assert_uint_eq(rep.u.hello.fd_secret_len, GMB_FD_SECRET_LEN);
    memcpy(secret[i], rep.u.hello.fd_secret, GMB_FD_SECRET_LEN);
    struct gmb_session *s = session_of(&f, rids[i]);
    ck_assert_mem_eq(s->secret, secret[i], GMB_FD_SECRET_LEN);
    static const uint8_t zero[GMB_FD_SECRET_LEN];
    ck_assert_int_ne(memcmp(secret[i], zero, GMB_FD_SECRET_LEN), 0);
    for (int j = 0; j < i; j++)
      ck_assert_int_ne(memcmp(secret[i], secret[j], GMB_FD_SECRET_LEN), 0);
    /* The lock table is a descriptor of the broker's, for the channel. */
    ck_assert_int_ge(gmb__locktab_fd(s->lt), 0);
    ck_assert_uint_eq(gmb__locktab_bytes(s->lt),
                      gmb__lt_bytes(GMB_LT_DEFAULT_SLOTS));
  }
  /* Requests do not change a session's secret. */
  struct wire_reply rep;
  ck_assert_int_eq(fx_plain(&f, "a", 1001, WIRE_HEARTBEAT, &rep), 0);
  fx_must_alloc(&f, "a", 1001, MIB, GMB_MOVABLE);
  fx_must_alloc(&f, "c", 1002, 3 * MIB, 0);
  ck_assert_mem_eq(session_of(&f, "a")->secret, secret[0], GMB_FD_SECRET_LEN);
  /* Sessions, lock tables and segments, and nothing in /dev/shm. */
  ck_assert_int_eq(fx_shm_names(), shm_before);
  fx_close(&f);
  ck_assert_int_eq(fx_shm_names(), shm_before);
}
END_TEST

START_TEST(request_before_hello) {
  struct fx f;
  fx_open(&f);
  static const enum wire_kind kinds[] = {
      WIRE_ALLOC, WIRE_FREE,           WIRE_STATS,       WIRE_HEARTBEAT,
      WIRE_BYE,   WIRE_SEGMENT_CLOSED, WIRE_ADMIN_STATUS};
  for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++) {
    struct wire_reply rep;
    ck_assert_int_eq(fx_plain(&f, "a", 1001, kinds[i], &rep), 1);
    ck_assert_int_eq(rep.status, GMB_E_CONN);
    ck_assert_int_eq(rep.kind, WIRE_NONE);
  }
  /* Another connection's session does not count for this one. */
  fx_hello(&f, "b", 1001, "");
  struct wire_reply rep;
  ck_assert_int_eq(fx_plain(&f, "a", 1001, WIRE_STATS, &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_CONN);
  ck_assert_int_eq(fx_plain(&f, "bb", 1001, WIRE_STATS, &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_CONN);
  ck_assert_uint_eq(f.n_sent, 0);
  fx_close(&f);
}
END_TEST

START_TEST(admin_kind_is_not_a_client_request) {
  struct fx f;
  fx_open(&f);
  fx_hello(&f, "a", 1001, "");
  static const enum wire_kind kinds[] = {
      WIRE_ADMIN_STATUS, WIRE_ADMIN_COMPACT, WIRE_ADMIN_QUOTA,
      WIRE_ADMIN_EVICT,  WIRE_ADMIN_RELOAD,  WIRE_NONE, WIRE_EVENT};
  for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++) {
    struct wire_reply rep;
    ck_assert_int_eq(fx_plain(&f, "a", 1001, kinds[i], &rep), 1);
    ck_assert_int_eq(rep.status, GMB_E_PROTO);
  }
  /* The session goes on. */
  ck_assert_uint_eq(gmb__sessions_count(f.b.sessions), 1);
  fx_close(&f);
}
END_TEST

/* --- alloc ------------------------------------------------------------ */

START_TEST(alloc_zero) {
  struct fx f;
  fx_open(&f);
  struct gmb_session *s = fx_hello(&f, "a", 1001, "");
  struct wire_reply rep;
  ck_assert_int_eq(fx_alloc(&f, "a", 1001, 0, 0, 0, &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_INVAL);
  ck_assert_int_eq(rep.kind, WIRE_NONE);
  /* Not even a waiting request of size 0 is queued. */
  ck_assert_int_eq(fx_alloc(&f, "a", 1001, 0, GMB_MOVABLE, 1000, &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_INVAL);
  ck_assert_uint_eq(f.b.waitq.n, 0);
  ck_assert_uint_eq(s->tenant->used, 0);
  ck_assert_uint_eq(s->allocations, 0);
  fx_close(&f);
}
END_TEST

START_TEST(alloc_size_overflows_when_rounded) {
  struct fx f;
  fx_open(&f);
  struct gmb_session *s = fx_hello(&f, "a", 1001, "");
  /* Refused by the handler (rounding to 512 would wrap), by the pool
   * (rounding to the 2 MiB segment would wrap), and in between. */
  static const uint64_t bad[] = {UINT64_MAX, UINT64_MAX - 511,
                                 UINT64_MAX - 512, UINT64_MAX - 2 * MIB + 2};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    struct wire_reply rep;
    ck_assert_int_eq(fx_alloc(&f, "a", 1001, bad[i], 0, 0, &rep), 1);
    ck_assert_msg(rep.status == GMB_E_INVAL, "size %" PRIu64 ": %d %s",
                  bad[i], rep.status, rep.message);
    /* Waiting would not help either. */
    ck_assert_int_eq(fx_alloc(&f, "a", 1001, bad[i], 0, 1000, &rep), 1);
    ck_assert_int_eq(rep.status, GMB_E_INVAL);
  }
  ck_assert_uint_eq(f.b.waitq.n, 0);
  ck_assert_uint_eq(s->tenant->used, 0);
  ck_assert_uint_eq(s->tenant->segment_bytes, 0);
  ck_assert_uint_eq(f.b.dev->in_use, 0);
  fx_close(&f);
}
END_TEST

START_TEST(alloc_larger_than_device) {
  struct fx f;
  fx_open_small(&f);
  fx_hello(&f, "a", 1001, "");
  struct wire_reply rep;
  ck_assert_int_eq(fx_alloc(&f, "a", 1001, UINT64_C(1) << 40, 0, 0, &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_NOMEM);
  ck_assert_int_eq(rep.kind, WIRE_NOMEM);
  ck_assert_uint_eq(rep.u.nomem.request, UINT64_C(1) << 40);
  ck_assert_uint_eq(rep.u.nomem.free_total, 8 * MIB);
  ck_assert_uint_eq(rep.u.nomem.largest_free, 8 * MIB);
  /* One byte over the whole device. */
  ck_assert_int_eq(fx_alloc(&f, "a", 1001, 8 * MIB + 1, 0, 0, &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_NOMEM);
  ck_assert_uint_eq(rep.u.nomem.request, 8 * MIB + 512);
  /* The whole device, exactly. */
  rep = fx_must_alloc(&f, "a", 1001, 8 * MIB, 0);
  ck_assert_uint_eq(rep.u.alloc.size, 8 * MIB);
  fx_close(&f);
}
END_TEST

START_TEST(alloc_unknown_flags) {
  struct fx f;
  fx_open(&f);
  struct gmb_session *s = fx_hello(&f, "a", 1001, "");
  static const uint32_t bad[] = {0x2u, GMB_MOVABLE | 0x4u, GMB_RANGE_FREE,
                                 GMB_RANGE_TARGET, 0x80000000u, UINT32_MAX};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    struct wire_reply rep;
    ck_assert_int_eq(fx_alloc(&f, "a", 1001, MIB, bad[i], 0, &rep), 1);
    ck_assert_int_eq(rep.status, GMB_E_INVAL);
    ck_assert_int_eq(rep.kind, WIRE_NONE);
    ck_assert_ptr_nonnull(strstr(rep.message, "flags"));
  }
  ck_assert_uint_eq(s->tenant->used, 0);
  ck_assert_uint_eq(gmb__locktab_used(s->lt), 0);
  fx_close(&f);
}
END_TEST

START_TEST(quota_exact_limit) {
  struct fx f;
  fx_open_ini(&f, "host:64MiB",
              "[broker]\ncompaction = off\n[tenant:q]\nquota = 5MiB\n");
  struct gmb_session *s = fx_hello(&f, "a", 1001, "q");
  struct gmb_tenant *t = s->tenant;
  ck_assert_uint_eq(t->quota, 5 * MIB);
  /* 3 MiB large + 1 MiB + 1 MiB - 512 + 1 byte (rounded to 512). */
  fx_must_alloc(&f, "a", 1001, 3 * MIB, 0);
  fx_must_alloc(&f, "a", 1001, MIB, GMB_MOVABLE);
  fx_must_alloc(&f, "a", 1001, MIB - 512, 0);
  struct wire_reply last = fx_must_alloc(&f, "a", 1001, 1, 0);
  ck_assert_uint_eq(last.u.alloc.size, 512);
  ck_assert_uint_eq(t->used, 5 * MIB);
  ck_assert_uint_eq(t->peak, 5 * MIB);
  uint64_t refusals = t->refusals_quota;
  /* One byte more, pinned, movable or waiting: refused at once. */
  static const struct {
    uint32_t flags;
    int timeout_ms;
  } more[] = {{0, 0}, {GMB_MOVABLE, 0}, {0, 1000}, {0, -1}};
  for (size_t i = 0; i < sizeof more / sizeof more[0]; i++) {
    struct wire_reply rep;
    ck_assert_int_eq(
        fx_alloc(&f, "a", 1001, 1, more[i].flags, more[i].timeout_ms, &rep), 1);
    ck_assert_int_eq(rep.status, GMB_E_QUOTA);
    ck_assert_int_eq(rep.kind, WIRE_NONE);
    ck_assert_ptr_nonnull(strstr(rep.message, "quota"));
  }
  ck_assert_uint_eq(t->refusals_quota, refusals + 4);
  ck_assert_uint_eq(f.b.waitq.n, 0);
  ck_assert_uint_eq(t->waiting, 0);
  struct wire_reply rep;
  ck_assert_int_eq(fx_plain(&f, "a", 1001, WIRE_STATS, &rep), 1);
  ck_assert_uint_eq(rep.u.stats.used, 5 * MIB);
  ck_assert_uint_eq(rep.u.stats.peak, 5 * MIB);
  ck_assert_uint_eq(s->allocations, 4);
  /* Freeing the last 512 bytes makes room for exactly 512 again. */
  ck_assert_int_eq(fx_free(&f, "a", 1001, last.u.alloc.id), 0);
  ck_assert_int_eq(fx_alloc(&f, "a", 1001, 513, 0, 0, &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_QUOTA);
  fx_must_alloc(&f, "a", 1001, 512, 0);
  ck_assert_uint_eq(t->used, 5 * MIB);
  fx_close(&f);
}
END_TEST

START_TEST(quota_shared_by_sessions_of_a_tenant) {
  struct fx f;
  fx_open_ini(&f, "host:64MiB", "[tenant:q]\nquota = 2MiB\n");
  fx_hello(&f, "a", 1001, "q");
  fx_hello(&f, "b", 1001, "q");
  fx_must_alloc(&f, "a", 1001, MIB, 0);
  fx_must_alloc(&f, "b", 1001, MIB, 0);
  struct wire_reply rep;
  ck_assert_int_eq(fx_alloc(&f, "a", 1001, 512, 0, 0, &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_QUOTA);
  ck_assert_int_eq(fx_alloc(&f, "b", 1001, 512, 0, 0, &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_QUOTA);
  /* Another tenant is not held to q's quota. */
  fx_hello(&f, "c", 1002, "");
  fx_must_alloc(&f, "c", 1002, 4 * MIB, 0);
  fx_close(&f);
}
END_TEST

/* An Alloc reply names the segment and offset, and nothing else: the
 * client asks the descriptor channel for a segment it has not mapped, and
 * only that records the segment as given to the session (check_fdchan.c).
 * Segments are the tenant's own. */
START_TEST(alloc_reply_names_segment_only) {
  struct fx f;
  fx_open(&f);
  struct gmb_session *s = fx_hello(&f, "a", 1001, "");
  /* Two 1 MiB requests share one 2 MiB small segment. */
  struct wire_reply r1 = fx_must_alloc(&f, "a", 1001, MIB, 0);
  check_segment_of(&f, r1.u.alloc.segment, 2 * MIB, s->tenant);
  struct wire_reply r2 = fx_must_alloc(&f, "a", 1001, MIB, 0);
  ck_assert_uint_eq(r2.u.alloc.segment, r1.u.alloc.segment);
  ck_assert_uint_ne(r2.u.alloc.offset, r1.u.alloc.offset);
  ck_assert_uint_ne(r2.u.alloc.id, r1.u.alloc.id);
  /* The segment is full: the next one comes from another segment. */
  struct wire_reply r3 = fx_must_alloc(&f, "a", 1001, 512, 0);
  ck_assert_uint_ne(r3.u.alloc.segment, r1.u.alloc.segment);
  check_segment_of(&f, r3.u.alloc.segment, 2 * MIB, s->tenant);
  /* A large request gets its pages in a segment of their own, and its
   * tail at the end of r3's segment (pool.h rule 1). */
  struct wire_reply r4 = fx_must_alloc(&f, "a", 1001, 3 * MIB, 0);
  check_segment_of(&f, r4.u.alloc.segment, 2 * MIB, s->tenant);
  ck_assert_uint_eq(r4.u.alloc.offset, 0);
  ck_assert_uint_eq(r4.u.alloc.size, 3 * MIB);
  ck_assert_uint_eq(r4.u.alloc.tail_segment, r3.u.alloc.segment);
  ck_assert_uint_eq(r4.u.alloc.tail_offset, MIB);
  ck_assert_uint_eq(r4.u.alloc.tail_size, MIB);
  ck_assert_uint_eq(r4.u.alloc.pinned, 0);
  /* Asked movable, it is pinned all the same, with no lock-table slot. */
  struct wire_reply r4m = fx_must_alloc(&f, "a", 1001, 3 * MIB, GMB_MOVABLE);
  ck_assert_uint_eq(r4m.u.alloc.pinned, 1);
  ck_assert_uint_eq(r4m.u.alloc.slot, 0);
  ck_assert_uint_eq(gmb__locktab_used(s->lt), 0);
  ck_assert_int_eq(fx_free(&f, "a", 1001, r4m.u.alloc.id), 0);
  /* Allocating gives no descriptor, so nothing is recorded as given. */
  ck_assert_uint_eq(s->n_segs, 0);
  /* Another session of the same tenant is served from the same segment;
   * another tenant never is. */
  ck_assert_int_eq(fx_free(&f, "a", 1001, r2.u.alloc.id), 0);
  struct gmb_session *s2 = fx_hello(&f, "b", 1001, "");
  struct wire_reply r5 = fx_must_alloc(&f, "b", 1001, MIB, 0);
  ck_assert_uint_eq(r5.u.alloc.segment, r1.u.alloc.segment);
  ck_assert_uint_eq(s2->n_segs, 0);
  struct gmb_session *o = fx_hello(&f, "o", 1002, "");
  struct wire_reply r6 = fx_must_alloc(&f, "o", 1002, 512, 0);
  ck_assert_uint_ne(r6.u.alloc.segment, r1.u.alloc.segment);
  ck_assert_uint_ne(r6.u.alloc.segment, r3.u.alloc.segment);
  check_segment_of(&f, r6.u.alloc.segment, 2 * MIB, o->tenant);
  /* A segment recorded as given (by the channel) stays recorded across
   * allocations in it. */
  ck_assert_int_eq(gmb__session_seg_seen(s, r1.u.alloc.segment), 0);
  ck_assert_int_eq(fx_free(&f, "b", 1001, r5.u.alloc.id), 0);
  struct wire_reply r7 = fx_must_alloc(&f, "a", 1001, MIB, 0);
  ck_assert_uint_eq(r7.u.alloc.segment, r1.u.alloc.segment);
  ck_assert_uint_eq(s->n_segs, 1);
  ck_assert_int_eq(gmb__session_seg_seen(s, r1.u.alloc.segment), 1);
  fx_close(&f);
}
END_TEST

START_TEST(alloc_movable_gets_slot) {
  struct fx f;
  fx_open(&f);
  struct gmb_session *s = fx_hello(&f, "a", 1001, "");
  struct wire_reply pinned = fx_must_alloc(&f, "a", 1001, 4096, 0);
  ck_assert_uint_eq(gmb__locktab_used(s->lt), 0);
  struct gmb_alloc_info info;
  ck_assert_int_eq(gmb__pool_find(f.b.pool, pinned.u.alloc.id, &info), 0);
  ck_assert_uint_eq(info.tag, 0);
  uint64_t ids[3];
  uint32_t slots[3];
  for (int i = 0; i < 3; i++) {
    struct wire_reply r = fx_must_alloc(&f, "a", 1001, 4096, GMB_MOVABLE);
    ids[i] = r.u.alloc.id;
    slots[i] = r.u.alloc.slot;
    ck_assert_uint_eq(gmb__locktab_slot_id(s->lt, slots[i]), ids[i]);
    ck_assert_int_eq(gmb__pool_find(f.b.pool, ids[i], &info), 0);
    ck_assert_uint_eq(info.tag, gmb__locktab_tag(slots[i]));
    ck_assert_uint_eq(info.flags & GMB_MOVABLE, GMB_MOVABLE);
    for (int j = 0; j < i; j++) ck_assert_uint_ne(slots[j], slots[i]);
  }
  ck_assert_uint_eq(gmb__locktab_used(s->lt), 3);
  /* A freed movable allocation gives its slot back, and the slot is
   * reused for the next one. */
  ck_assert_int_eq(fx_free(&f, "a", 1001, ids[1]), 0);
  ck_assert_uint_eq(gmb__locktab_used(s->lt), 2);
  struct wire_reply r = fx_must_alloc(&f, "a", 1001, 4096, GMB_MOVABLE);
  ck_assert_uint_eq(r.u.alloc.slot, slots[1]);
  ck_assert_uint_eq(gmb__locktab_slot_id(s->lt, slots[1]), r.u.alloc.id);
  /* Freeing a pinned one leaves the slots alone. */
  ck_assert_int_eq(fx_free(&f, "a", 1001, pinned.u.alloc.id), 0);
  ck_assert_uint_eq(gmb__locktab_used(s->lt), 3);
  /* Each session has its own table: b's first slot is not a's. */
  struct gmb_session *sb = fx_hello(&f, "b", 1002, "");
  struct wire_reply rb = fx_must_alloc(&f, "b", 1002, 4096, GMB_MOVABLE);
  ck_assert_uint_eq(gmb__locktab_used(sb->lt), 1);
  ck_assert_uint_eq(gmb__locktab_slot_id(sb->lt, rb.u.alloc.slot),
                    rb.u.alloc.id);
  ck_assert_uint_eq(gmb__locktab_used(s->lt), 3);
  fx_close(&f);
}
END_TEST

START_TEST(alloc_movable_lock_table_full) {
  struct fx f;
  fx_open(&f);
  struct gmb_session *s = fx_hello(&f, "a", 1001, "");
  struct gmb_tenant *t = s->tenant;
  /* Fill every slot through the allocation path itself (fx_request checks
   * the whole pool after each request, too slow for 65536). */
  uint64_t first = 0;
  for (uint32_t i = 0; i < GMB_LT_DEFAULT_SLOTS; i++) {
    struct wire_reply rep;
    enum gmb_nomem_why why;
    memset(&rep, 0, sizeof rep);
    int rc = gmb__alloc_try(&f.b, s, 512, GMB_MOVABLE, &rep, &why);
    ck_assert_msg(rc == 0, "slot %u: %s", i, rep.message);
    if (i == 0) first = rep.u.alloc.id;
  }
  ck_assert_int_eq(gmb__core_check(&f.b), 0);
  ck_assert_uint_eq(gmb__locktab_used(s->lt), GMB_LT_DEFAULT_SLOTS);
  uint64_t used = t->used, allocs = s->allocations;
  struct gmb_pool_stats ps;
  gmb__pool_stats(f.b.pool, &ps);
  uint64_t pool_allocs = ps.allocations;
  /* One more movable: refused, and the pool gave its range back. */
  struct wire_reply rep;
  ck_assert_int_eq(fx_alloc(&f, "a", 1001, 512, GMB_MOVABLE, 0, &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_LIMIT);
  ck_assert_int_eq(rep.kind, WIRE_NONE);
  ck_assert_uint_eq(t->used, used);
  ck_assert_uint_eq(s->allocations, allocs);
  gmb__pool_stats(f.b.pool, &ps);
  ck_assert_uint_eq(ps.allocations, pool_allocs);
  /* Waiting would not help: refused at once as well. */
  ck_assert_int_eq(fx_alloc(&f, "a", 1001, MIB, GMB_MOVABLE, 1000, &rep),
                   1);
  ck_assert_int_eq(rep.status, GMB_E_LIMIT);
  ck_assert_uint_eq(f.b.waitq.n, 0);
  ck_assert_uint_eq(t->used, used);
  /* Pinned memory needs no slot; a freed movable one gives its slot. */
  fx_must_alloc(&f, "a", 1001, 512, 0);
  ck_assert_int_eq(fx_free(&f, "a", 1001, first), 0);
  fx_must_alloc(&f, "a", 1001, 512, GMB_MOVABLE);
  ck_assert_uint_eq(gmb__locktab_used(s->lt), GMB_LT_DEFAULT_SLOTS);
  fx_close(&f);
}
END_TEST

START_TEST(alloc_nomem_full_device) {
  struct fx f;
  fx_open_small(&f);
  fx_hello(&f, "a", 1001, "");
  fx_hello(&f, "b", 1002, "");
  fx_must_alloc(&f, "a", 1001, 8 * MIB, 0);
  size_t sent = f.n_sent;
  struct wire_reply rep;
  ck_assert_int_eq(fx_alloc(&f, "b", 1002, MIB, 0, 0, &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_NOMEM);
  ck_assert_int_eq(rep.kind, WIRE_NOMEM);
  ck_assert_uint_eq(rep.u.nomem.request, MIB);
  ck_assert_uint_eq(rep.u.nomem.free_total, 0);
  ck_assert_uint_eq(rep.u.nomem.largest_free, 0);
  ck_assert_uint_eq(rep.u.nomem.unmovable, 8 * MIB);
  ck_assert_uint_eq(rep.u.nomem.n_holders, 1);
  ck_assert_str_eq(rep.u.nomem.holders[0], "uid-1001");
  ck_assert_ptr_nonnull(strstr(rep.message, "compaction is off"));
  ck_assert_ptr_null(strstr(rep.message, "other tenants' segments"));
  /* Answered at once: nothing queued, nothing sent through the tap. */
  ck_assert_uint_eq(f.b.waitq.n, 0);
  ck_assert_uint_eq(f.n_sent, sent);
  ck_assert_uint_eq(fx_tenant(&f, "uid-1002")->used, 0);
  ck_assert_uint_eq(fx_tenant(&f, "uid-1002")->segment_bytes, 0);
  fx_close(&f);
}
END_TEST

/* Explaining a refusal for want of room walks the whole pool, every
 * tenant's ranges, and a client can be refused so at will (a full device,
 * or a request larger than the device): each refusal of a flood walked
 * the pool again.  Now at most GMB_EXPLAIN_WALKS a second do; the others
 * carry the last walk's figures and say how old they are. */
START_TEST(alloc_nomem_explanations_walk_a_few_times_a_second) {
  struct fx f;
  fx_open_small(&f);
  fx_hello(&f, "a", 1001, "");
  fx_hello(&f, "b", 1002, "");
  fx_must_alloc(&f, "a", 1001, 8 * MIB, 0);
  const uint64_t walks = f.b.explain.walks;
  struct wire_reply rep;
  for (int i = 0; i < 200; i++) {
    ck_assert_int_eq(fx_alloc(&f, "b", 1002, i % 2 ? MIB : 64 * MIB, 0, 0,
                              &rep), 1);
    ck_assert_int_eq(rep.status, GMB_E_NOMEM);
    ck_assert_uint_eq(rep.u.nomem.unmovable, 8 * MIB);
    ck_assert_uint_eq(rep.u.nomem.n_holders, 1);
    ck_assert_str_eq(rep.u.nomem.holders[0], "uid-1001");
  }
  ck_assert_uint_ge(f.b.explain.walks - walks, 1);
  ck_assert_uint_lt(f.b.explain.walks - walks, 200);
  ck_assert_msg(strstr(rep.message, "ms ago") != NULL, "%s", rep.message);
  fx_close(&f);
}
END_TEST

START_TEST(alloc_nomem_fragmented) {
  struct fx f;
  fx_open_small(&f);
  fx_hello(&f, "a", 1001, "");
  fx_hello(&f, "b", 1002, "");
  /* a: four 1 MiB, movable, in two small segments; b: 4 MiB.  Then a frees
   * one in each segment: 2 MiB free in total, 1 MiB in one range, and only
   * a may use either. */
  uint64_t ids[4];
  for (int i = 0; i < 4; i++)
    ids[i] = fx_must_alloc(&f, "a", 1001, MIB, GMB_MOVABLE).u.alloc.id;
  fx_must_alloc(&f, "b", 1002, 4 * MIB, 0);
  ck_assert_int_eq(fx_free(&f, "a", 1001, ids[0]), 0);
  ck_assert_int_eq(fx_free(&f, "a", 1001, ids[2]), 0);
  struct wire_reply rep;
  ck_assert_int_eq(fx_alloc(&f, "b", 1002, 2 * MIB, 0, 0, &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_NOMEM);
  ck_assert_int_eq(rep.kind, WIRE_NOMEM);
  ck_assert_uint_eq(rep.u.nomem.request, 2 * MIB);
  ck_assert_uint_eq(rep.u.nomem.free_total, 2 * MIB);
  ck_assert_uint_eq(rep.u.nomem.largest_free, MIB);
  /* a's movable memory is not locked: only b's pinned 4 MiB is stuck. */
  ck_assert_uint_eq(rep.u.nomem.unmovable, 4 * MIB);
  ck_assert_uint_eq(rep.u.nomem.n_holders, 1);
  ck_assert_str_eq(rep.u.nomem.holders[0], "uid-1002");
  /* All of it is a's: the message says so. */
  ck_assert_msg(strstr(rep.message, "; 2MiB of the free bytes lie in other "
                       "tenants' segments") != NULL, "%s", rep.message);
  ck_assert_uint_eq(f.b.waitq.n, 0);
  ck_assert_ptr_null(f.b.compacting);
  fx_close(&f);
}
END_TEST

START_TEST(alloc_nomem_names_each_holder_once) {
  /* The NoMemory body names each holding tenant once, even with several
   * sessions. */
  struct fx f;
  fx_open_small(&f);
  fx_hello(&f, "a1", 1001, "");
  fx_hello(&f, "a2", 1001, "");
  fx_hello(&f, "b", 1002, "");
  fx_hello(&f, "c", 1003, "");
  fx_must_alloc(&f, "a1", 1001, 2 * MIB + 1, 0);
  fx_must_alloc(&f, "b", 1002, 2 * MIB, 0);
  fx_must_alloc(&f, "a2", 1001, 2 * MIB, 0);
  struct wire_reply rep;
  ck_assert_int_eq(fx_alloc(&f, "c", 1003, 2 * MIB, 0, 0, &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_NOMEM);
  ck_assert_uint_eq(rep.u.nomem.n_holders, 2);
  ck_assert_uint_eq(rep.u.nomem.unmovable, 6 * MIB + 512);
  ck_assert_uint_eq(rep.u.nomem.free_total, 2 * MIB - 512);
  int saw_a = 0, saw_b = 0;
  for (size_t i = 0; i < rep.u.nomem.n_holders; i++) {
    saw_a += strcmp(rep.u.nomem.holders[i], "uid-1001") == 0;
    saw_b += strcmp(rep.u.nomem.holders[i], "uid-1002") == 0;
  }
  ck_assert_int_eq(saw_a, 1);
  ck_assert_int_eq(saw_b, 1);
  fx_close(&f);
}
END_TEST

/* A request that comes while an operator's run (no goal: it never makes
 * a hole for anyone) is under way: when that run ends and the request
 * still does not fit, it gets a goal run of its own before it is
 * answered.  a holds 4 MiB pinned; b's two segments hold seven 256 KiB
 * movable blocks each and a 256 KiB hole at the top; the 8 MiB device is
 * full.  b wants 512 KiB: only a goal run's hole pass makes it. */
START_TEST(alloc_during_operator_run_gets_a_run_of_its_own) {
  struct fx f;
  fx_open_ini(&f, "host:8MiB", NULL);
  fx_hello(&f, "a", 1001, "");
  fx_hello(&f, "b", 1002, "");
  fx_must_alloc(&f, "a", 1001, 4 * MIB, 0);
  uint64_t ids[16];
  for (int i = 0; i < 16; i++)
    ids[i] = fx_must_alloc(&f, "b", 1002, 256 * 1024, GMB_MOVABLE).u.alloc.id;
  ck_assert_int_eq(fx_free(&f, "b", 1002, ids[7]), 0);
  ck_assert_int_eq(fx_free(&f, "b", 1002, ids[15]), 0);
  gmb__defrag_start(&f.b, NULL, GMB_DEFRAG_ADMIN);
  ck_assert_ptr_nonnull(f.b.compacting);
  struct wire_reply rep;
  ck_assert_int_eq(fx_alloc(&f, "b", 1002, 512 * 1024, GMB_MOVABLE, 0, &rep),
                   0);
  size_t sent = f.n_sent;
  while (gmb__defrag_tick(&f.b, UINT64_MAX)) {
  }
  ck_assert_int_eq(gmb__core_check(&f.b), 0);
  /* The operator's run, then b's own (begun as the first ended). */
  ck_assert_uint_eq(f.b.compact_totals.runs, 2);
  const struct fx_sent *m = fx_last_to(&f, "b");
  ck_assert_uint_gt(f.n_sent, sent);
  ck_assert_ptr_nonnull(m);
  ck_assert_msg(m->rep.status == 0, "%s", m->rep.message);
  ck_assert_int_eq(m->rep.kind, WIRE_ALLOC);
  ck_assert_uint_eq(f.b.waitq.n, 0);
  fx_close(&f);
}
END_TEST

START_TEST(alloc_nomem_for_reservation) {
  /* r keeps 6 MiB of the 8: others may make segments up to 2 MiB. */
  struct fx f;
  fx_open_ini(&f, "host:8MiB",
              "[broker]\ncompaction = off\n"
              "[tenant:r]\nreserve = 6MiB\nuids = 2000\n");
  struct gmb_session *a = fx_hello(&f, "a", 1001, "");
  fx_hello(&f, "r", 2000, "r");
  fx_must_alloc(&f, "a", 1001, 2 * MIB, 0);
  uint64_t seg_bytes = a->tenant->segment_bytes;
  struct wire_reply rep;
  ck_assert_int_eq(fx_alloc(&f, "a", 1001, 512, 0, 0, &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_NOMEM);
  /* Not a NoMemory body: the room is there, kept for r, and says so. */
  ck_assert_int_eq(rep.kind, WIRE_NONE);
  ck_assert_ptr_nonnull(strstr(rep.message, "tenant r's reservation"));
  ck_assert_uint_eq(a->tenant->segment_bytes, seg_bytes);
  ck_assert_uint_eq(a->tenant->used, 2 * MIB);
  ck_assert_uint_eq(f.b.dev->in_use, 2 * MIB);
  /* Waiting for it is allowed; it ends with the timeout. */
  ck_assert_int_eq(fx_alloc(&f, "a", 1001, 512, 0, 1000, &rep), 0);
  ck_assert_uint_eq(f.b.waitq.n, 1);
  /* r takes its own in full meanwhile. */
  fx_must_alloc(&f, "r", 2000, 6 * MIB, 0);
  gmb__waitq_expire(&f.b, UINT64_MAX - 1);
  ck_assert_ptr_nonnull(fx_last_to(&f, "a"));
  ck_assert_int_eq(fx_last_to(&f, "a")->rep.status, GMB_E_TIMEOUT);
  ck_assert_uint_eq(f.b.waitq.n, 0);
  fx_close(&f);
}
END_TEST

/* --- free ------------------------------------------------------------- */

START_TEST(free_own) {
  struct fx f;
  fx_open(&f);
  struct gmb_session *s = fx_hello(&f, "a", 1001, "");
  struct wire_reply r1 = fx_must_alloc(&f, "a", 1001, MIB, 0);
  struct wire_reply r2 = fx_must_alloc(&f, "a", 1001, 3 * MIB, GMB_MOVABLE);
  ck_assert_uint_eq(s->allocations, 2);
  ck_assert_uint_eq(s->tenant->used, 4 * MIB);
  struct wire_reply rep;
  struct wire_request req;
  memset(&req, 0, sizeof req);
  req.kind = WIRE_FREE;
  req.u.free.id = r2.u.alloc.id;
  ck_assert_int_eq(fx_request(&f, "a", 1001, &req, &rep), 1);
  ck_assert_int_eq(rep.status, 0);
  ck_assert_int_eq(rep.kind, WIRE_NONE);
  ck_assert_uint_eq(rep.id, req.id);
  ck_assert_uint_eq(s->allocations, 1);
  ck_assert_uint_eq(s->tenant->used, MIB);
  ck_assert_uint_eq(s->tenant->peak, 4 * MIB);
  ck_assert_int_eq(gmb__pool_find(f.b.pool, r2.u.alloc.id, NULL),
                   GMB_E_NOENT);
  ck_assert_int_eq(fx_free(&f, "a", 1001, r1.u.alloc.id), 0);
  ck_assert_uint_eq(s->allocations, 0);
  ck_assert_uint_eq(s->tenant->used, 0);
  fx_close(&f);
}
END_TEST

START_TEST(free_others_id_is_noent) {
  struct fx f;
  fx_open(&f);
  fx_hello(&f, "a", 1001, "");
  fx_hello(&f, "a2", 1001, ""); /* a's tenant, another session */
  fx_hello(&f, "b", 1002, "");  /* another tenant */
  struct wire_reply ra = fx_must_alloc(&f, "a", 1001, MIB, 0);
  uint64_t id = ra.u.alloc.id, made_up = id ^ (UINT64_C(1) << 40);
  ck_assert_int_eq(gmb__pool_find(f.b.pool, made_up, NULL), GMB_E_NOENT);
  static const struct {
    const char *rid;
    uid_t uid;
  } others[] = {{"a2", 1001}, {"b", 1002}};
  for (size_t i = 0; i < 2; i++) {
    struct wire_request req;
    struct wire_reply rep, rep_made_up;
    memset(&req, 0, sizeof req);
    req.kind = WIRE_FREE;
    req.u.free.id = id;
    ck_assert_int_eq(fx_request(&f, others[i].rid, others[i].uid, &req, &rep),
                     1);
    req.u.free.id = made_up;
    ck_assert_int_eq(
        fx_request(&f, others[i].rid, others[i].uid, &req, &rep_made_up), 1);
    /* The same answer, but for the id it names. */
    ck_assert_int_eq(rep.status, GMB_E_NOENT);
    ck_assert_int_eq(rep_made_up.status, GMB_E_NOENT);
    ck_assert_int_eq(rep.kind, rep_made_up.kind);
    char want[WIRE_MESSAGE_MAX], want_made_up[WIRE_MESSAGE_MAX];
    snprintf(want, sizeof want, "no allocation %" PRIu64 " in this session",
             id);
    snprintf(want_made_up, sizeof want_made_up,
             "no allocation %" PRIu64 " in this session", made_up);
    ck_assert_str_eq(rep.message, want);
    ck_assert_str_eq(rep_made_up.message, want_made_up);
  }
  /* The allocation is still a's. */
  struct gmb_alloc_info info;
  ck_assert_int_eq(gmb__pool_find(f.b.pool, id, &info), 0);
  ck_assert_uint_eq(fx_tenant(&f, "uid-1001")->used, MIB);
  ck_assert_int_eq(fx_free(&f, "a", 1001, id), 0);
  fx_close(&f);
}
END_TEST

START_TEST(free_twice) {
  struct fx f;
  fx_open(&f);
  struct gmb_session *s = fx_hello(&f, "a", 1001, "");
  uint64_t keep = fx_must_alloc(&f, "a", 1001, 4096, 0).u.alloc.id;
  uint64_t id = fx_must_alloc(&f, "a", 1001, 4096, GMB_MOVABLE).u.alloc.id;
  ck_assert_int_eq(fx_free(&f, "a", 1001, id), 0);
  ck_assert_int_eq(fx_free(&f, "a", 1001, id), GMB_E_NOENT);
  /* The second free took nothing off the books. */
  ck_assert_uint_eq(s->allocations, 1);
  ck_assert_uint_eq(s->tenant->used, 4096);
  ck_assert_uint_eq(gmb__locktab_used(s->lt), 0);
  /* Neither does the id 0, never an allocation's. */
  ck_assert_int_eq(fx_free(&f, "a", 1001, 0), GMB_E_NOENT);
  /* A new allocation does not revive the old id. */
  uint64_t id2 = fx_must_alloc(&f, "a", 1001, 4096, GMB_MOVABLE).u.alloc.id;
  ck_assert_uint_ne(id2, id);
  ck_assert_int_eq(fx_free(&f, "a", 1001, id), GMB_E_NOENT);
  ck_assert_int_eq(fx_free(&f, "a", 1001, id2), 0);
  ck_assert_int_eq(fx_free(&f, "a", 1001, keep), 0);
  ck_assert_uint_eq(s->tenant->used, 0);
  fx_close(&f);
}
END_TEST

/* --- a cache's pages ------------------------------------------------------ */

/* An Alloc of pages: each page an allocation in a segment of its own, the
 * quota charged the total, all or none; a Free of several frees them all
 * in one message. */
START_TEST(pages_in_one_request_and_freed_in_one) {
  struct fx f;
  fx_open_ini(&f, "host:64MiB", "[tenant:q]\nquota = 16MiB\n");
  struct gmb_session *s = fx_hello(&f, "a", 1001, "q");
  struct wire_request req;
  struct wire_reply rep;
  memset(&req, 0, sizeof req);
  req.kind = WIRE_ALLOC;
  req.u.alloc.pages = 5;
  req.u.alloc.size = 5 * 2 * MIB;
  ck_assert_int_eq(fx_request(&f, "a", 1001, &req, &rep), 1);
  ck_assert_int_eq(rep.status, 0);
  ck_assert_uint_eq(rep.u.alloc.n_pages, 5);
  ck_assert_uint_eq(rep.u.alloc.size, 10 * MIB);
  for (unsigned i = 0; i < 5; i++) {
    check_segment_of(&f, rep.u.alloc.page_seg[i], 2 * MIB, s->tenant);
    for (unsigned j = 0; j < i; j++)
      ck_assert_uint_ne(rep.u.alloc.page_seg[i], rep.u.alloc.page_seg[j]);
  }
  ck_assert_uint_eq(s->allocations, 5);
  ck_assert_uint_eq(s->tenant->used, 10 * MIB);
  /* 4 pages more pass the 16 MiB quota: refused as one, nothing made. */
  struct wire_reply r2;
  req.u.alloc.pages = 4;
  req.u.alloc.size = 4 * 2 * MIB;
  ck_assert_int_eq(fx_request(&f, "a", 1001, &req, &r2), 1);
  ck_assert_int_eq(r2.status, GMB_E_QUOTA);
  ck_assert_uint_eq(s->allocations, 5);
  /* Bad requests: too many, movable, a size that is not the pages'. */
  static const struct {
    uint32_t pages, flags;
    uint64_t size;
  } bad[] = {{65, 0, 65 * 2 * MIB}, {1, GMB_MOVABLE, 2 * MIB},
             {2, 0, 2 * MIB}, {1, 0, 2 * MIB + 512}};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    req.u.alloc.pages = bad[i].pages;
    req.u.alloc.flags = bad[i].flags;
    req.u.alloc.size = bad[i].size;
    ck_assert_int_eq(fx_request(&f, "a", 1001, &req, &r2), 1);
    ck_assert_int_eq(r2.status, GMB_E_INVAL);
  }
  ck_assert_uint_eq(s->allocations, 5);
  /* Four freed in one message, the last on its own. */
  memset(&req, 0, sizeof req);
  req.kind = WIRE_FREE;
  req.u.free.id = rep.u.alloc.page_id[0];
  req.u.free.n_more = 3;
  for (unsigned i = 1; i < 4; i++) req.u.free.more[i - 1] = rep.u.alloc.page_id[i];
  ck_assert_int_eq(fx_request(&f, "a", 1001, &req, &r2), 1);
  ck_assert_int_eq(r2.status, 0);
  ck_assert_uint_eq(s->allocations, 1);
  ck_assert_uint_eq(s->tenant->used, 2 * MIB);
  /* A freed id in the list stops there, named; those before it go. */
  req.u.free.id = rep.u.alloc.page_id[4];
  req.u.free.n_more = 1;
  req.u.free.more[0] = rep.u.alloc.page_id[0];
  ck_assert_int_eq(fx_request(&f, "a", 1001, &req, &r2), 1);
  ck_assert_int_eq(r2.status, GMB_E_NOENT);
  ck_assert_ptr_nonnull(strstr(r2.message, "those before it were freed"));
  ck_assert_uint_eq(s->allocations, 0);
  ck_assert_uint_eq(s->tenant->used, 0);
  fx_close(&f);
}
END_TEST

/* Pages past the device's room: none is made (all or nothing), for a
 * tenant that held no segment before (the pages made and given back are
 * counted for it in between: the broker aborted on that once). */
START_TEST(pages_all_or_none) {
  struct fx f;
  fx_open_ini(&f, "host:16MiB", "");
  struct gmb_session *s = fx_hello(&f, "a", 1001, "");
  struct gmb_session *o = fx_hello(&f, "b", 1002, "");
  fx_must_alloc(&f, "a", 1001, 10 * MIB, 0);
  struct wire_request req;
  struct wire_reply rep;
  memset(&req, 0, sizeof req);
  req.kind = WIRE_ALLOC;
  req.u.alloc.pages = 4;
  req.u.alloc.size = 4 * 2 * MIB;
  ck_assert_int_eq(fx_request(&f, "b", 1002, &req, &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_NOMEM);
  ck_assert_uint_eq(o->allocations, 0);
  ck_assert_uint_eq(o->tenant->used, 0);
  ck_assert_uint_eq(o->tenant->segment_bytes, 0);
  ck_assert_int_eq(fx_request(&f, "a", 1001, &req, &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_NOMEM);
  ck_assert_uint_eq(s->allocations, 1);
  ck_assert_uint_eq(s->tenant->used, 10 * MIB);
  struct gmb_pool_stats ps;
  gmb__pool_stats(f.b.pool, &ps);
  ck_assert_uint_eq(ps.segment_bytes, 10 * MIB);
  fx_close(&f);
}
END_TEST

/* --- stats ----------------------------------------------------------- */

/* A client may send Stats as fast as it likes: its device figures come
 * from the totals the pool keeps, not from a walk of every tenant (the
 * pool counts its walks), and they are the walk's. */
START_TEST(stats_walk_no_tenant) {
  enum { TENANTS = 64, ASKS = 200 };
  struct fx f;
  fx_open_ini(&f, "host:256MiB", NULL); /* a small segment each */
  char rid[TENANTS][16];
  for (int i = 0; i < TENANTS; i++) {
    snprintf(rid[i], sizeof rid[i], "t%d", i);
    fx_hello(&f, rid[i], (uid_t)(2000 + i), "");
    fx_must_alloc(&f, rid[i], (uid_t)(2000 + i), 4096u * (unsigned)(i + 1), 0);
  }
  const uint64_t walks = gmb__pool_stats_walks(f.b.pool);
  struct wire_reply rep;
  for (int i = 0; i < ASKS; i++) {
    ck_assert_int_eq(fx_plain(&f, rid[i % TENANTS], (uid_t)(2000 + i % TENANTS),
                              WIRE_STATS, &rep), 1);
    ck_assert_int_eq(rep.status, 0);
  }
  ck_assert_uint_eq(gmb__pool_stats_walks(f.b.pool), walks);
  struct gmb_pool_stats walked;
  gmb__pool_stats_walk(f.b.pool, &walked);
  ck_assert_uint_eq(rep.u.stats.device_used, walked.used);
  ck_assert_uint_eq(rep.u.stats.device_segments,
                    walked.segment_bytes + f.b.dev->external);
  ck_assert_uint_eq(rep.u.stats.device_capacity, walked.capacity);
  struct gmb_pool_stats kept;
  gmb__pool_stats(f.b.pool, &kept);
  ck_assert_uint_eq(kept.free_in_segments, walked.free_in_segments);
  ck_assert_uint_eq(kept.largest_free, walked.largest_free);
  fx_close(&f);
}
END_TEST

START_TEST(stats_used_peak_quota) {
  struct fx f;
  fx_open_ini(&f, "host:64MiB", "[tenant:q]\nquota = 16MiB\n");
  fx_hello(&f, "a", 1001, "q");
  fx_hello(&f, "a2", 1001, "q");
  struct wire_reply rep;
  ck_assert_int_eq(fx_plain(&f, "a", 1001, WIRE_STATS, &rep), 1);
  ck_assert_int_eq(rep.status, 0);
  ck_assert_int_eq(rep.kind, WIRE_STATS);
  ck_assert_uint_eq(rep.u.stats.quota, 16 * MIB);
  ck_assert_uint_eq(rep.u.stats.used, 0);
  ck_assert_uint_eq(rep.u.stats.peak, 0);
  ck_assert_uint_eq(rep.u.stats.segments, 0);
  uint64_t small = fx_must_alloc(&f, "a", 1001, 1000, 0).u.alloc.id;
  uint64_t big = fx_must_alloc(&f, "a2", 1001, 3 * MIB, 0).u.alloc.id;
  /* The tenant's figures, whichever of its sessions asks. */
  for (int i = 0; i < 2; i++) {
    ck_assert_int_eq(fx_plain(&f, i ? "a2" : "a", 1001, WIRE_STATS, &rep), 1);
    ck_assert_uint_eq(rep.u.stats.used, 1024 + 3 * MIB);
    ck_assert_uint_eq(rep.u.stats.peak, 1024 + 3 * MIB);
    /* the small segment, whose end holds big's tail, and big's page */
    ck_assert_uint_eq(rep.u.stats.segments, 2 * MIB + 2 * MIB);
  }
  ck_assert_int_eq(fx_free(&f, "a2", 1001, big), 0);
  ck_assert_int_eq(fx_plain(&f, "a", 1001, WIRE_STATS, &rep), 1);
  ck_assert_uint_eq(rep.u.stats.used, 1024);
  ck_assert_uint_eq(rep.u.stats.peak, 1024 + 3 * MIB);
  ck_assert_uint_eq(rep.u.stats.segments, 2 * MIB); /* large: released */
  ck_assert_int_eq(fx_free(&f, "a", 1001, small), 0);
  ck_assert_int_eq(fx_plain(&f, "a", 1001, WIRE_STATS, &rep), 1);
  ck_assert_uint_eq(rep.u.stats.used, 0);
  ck_assert_uint_eq(rep.u.stats.peak, 1024 + 3 * MIB);
  /* Another tenant sees its own figures only. */
  fx_hello(&f, "b", 1002, "");
  ck_assert_int_eq(fx_plain(&f, "b", 1002, WIRE_STATS, &rep), 1);
  ck_assert_uint_eq(rep.u.stats.quota, 0);
  ck_assert_uint_eq(rep.u.stats.used, 0);
  ck_assert_uint_eq(rep.u.stats.peak, 0);
  ck_assert_uint_eq(rep.u.stats.segments, 0);
  fx_close(&f);
}
END_TEST

/* --- heartbeat, bye --------------------------------------------------- */

START_TEST(heartbeat_and_segment_closed_have_no_reply) {
  struct fx f;
  fx_open(&f);
  struct gmb_session *s = fx_hello(&f, "a", 1001, "");
  s->last_seen_ns = 1;
  struct wire_reply rep;
  ck_assert_int_eq(fx_plain(&f, "a", 1001, WIRE_HEARTBEAT, &rep), 0);
  ck_assert_uint_gt(s->last_seen_ns, 1);
  ck_assert_uint_eq(f.n_sent, 0);
  /* Any request counts as a sign of life. */
  s->last_seen_ns = 1;
  ck_assert_int_eq(fx_plain(&f, "a", 1001, WIRE_STATS, &rep), 1);
  ck_assert_uint_gt(s->last_seen_ns, 1);
  /* SegmentClosed has no reply either (the host device waits for none). */
  struct wire_request req;
  memset(&req, 0, sizeof req);
  req.kind = WIRE_SEGMENT_CLOSED;
  req.u.segment.segment = 12345;
  ck_assert_int_eq(fx_request(&f, "a", 1001, &req, &rep), 0);
  ck_assert_uint_eq(f.n_sent, 0);
  fx_close(&f);
}
END_TEST

START_TEST(bye_ends_session_and_frees) {
  struct fx f;
  fx_open_small(&f);
  struct gmb_session *s = fx_hello(&f, "a", 1001, "");
  fx_hello(&f, "a2", 1001, "");
  struct gmb_tenant *t = s->tenant;
  fx_must_alloc(&f, "a", 1001, MIB, GMB_MOVABLE);
  fx_must_alloc(&f, "a", 1001, 3 * MIB, 0);
  uint64_t other = fx_must_alloc(&f, "a2", 1001, 4096, 0).u.alloc.id;
  ck_assert_uint_eq(t->used, 4 * MIB + 4096);
  uint64_t gen = gmb__sessions_gen(f.b.sessions);
  struct wire_reply rep;
  ck_assert_int_eq(fx_plain(&f, "a", 1001, WIRE_BYE, &rep), 1);
  ck_assert_int_eq(rep.status, 0);
  ck_assert_ptr_null(gmb__session_find(f.b.sessions, (const uint8_t *)"a", 1));
  ck_assert_uint_ne(gmb__sessions_gen(f.b.sessions), gen);
  ck_assert_uint_eq(gmb__sessions_count(f.b.sessions), 1);
  ck_assert_uint_eq(t->n_sessions, 1);
  /* Only its own memory went. */
  ck_assert_uint_eq(t->used, 4096);
  ck_assert_int_eq(gmb__pool_find(f.b.pool, other, NULL), 0);
  ck_assert_int_eq(fx_plain(&f, "a2", 1001, WIRE_BYE, &rep), 1);
  ck_assert_uint_eq(t->used, 0);
  ck_assert_uint_eq(t->n_sessions, 0);
  ck_assert_ptr_null(t->sessions);
  /* The connection has no session any more: the next request must say
   * Hello again, and may. */
  ck_assert_int_eq(fx_plain(&f, "a", 1001, WIRE_STATS, &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_CONN);
  ck_assert_int_eq(fx_plain(&f, "a", 1001, WIRE_BYE, &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_CONN);
  fx_hello(&f, "a", 1001, "");
  fx_must_alloc(&f, "a", 1001, 8 * MIB, 0); /* all of the device came back */
  fx_close(&f);
}
END_TEST

/* --- waiting allocations ---------------------------------------------- */

START_TEST(wait_served_after_free) {
  struct fx f;
  fx_open_small(&f);
  fx_hello(&f, "a", 1001, "");
  struct gmb_session *sb = fx_hello(&f, "b", 1002, "");
  uint64_t big = fx_must_alloc(&f, "a", 1001, 8 * MIB, 0).u.alloc.id;
  struct wire_reply rep;
  ck_assert_int_eq(fx_alloc(&f, "b", 1002, MIB, GMB_MOVABLE, 60000, &rep), 0);
  uint64_t req_id = f.next_req - 1;
  ck_assert_uint_eq(f.b.waitq.n, 1);
  ck_assert_uint_eq(sb->tenant->waiting, 1);
  ck_assert_ptr_null(fx_last_to(&f, "b"));
  /* a frees: b is answered through the sender, with its request's id. */
  ck_assert_int_eq(fx_free(&f, "a", 1001, big), 0);
  const struct fx_sent *got = fx_last_to(&f, "b");
  ck_assert_ptr_nonnull(got);
  ck_assert_int_eq(got->sock, GMB_SOCK_CLIENT);
  ck_assert_uint_eq(got->rep.id, req_id);
  ck_assert_int_eq(got->rep.status, 0);
  ck_assert_int_eq(got->rep.kind, WIRE_ALLOC);
  ck_assert_uint_eq(got->rep.u.alloc.size, MIB);
  check_segment_of(&f, got->rep.u.alloc.segment, 2 * MIB, sb->tenant);
  ck_assert_uint_eq(gmb__locktab_slot_id(sb->lt, got->rep.u.alloc.slot),
                    got->rep.u.alloc.id);
  ck_assert_uint_eq(f.b.waitq.n, 0);
  ck_assert_uint_eq(sb->tenant->waiting, 0);
  ck_assert_uint_eq(sb->tenant->used, MIB);
  ck_assert_uint_eq(sb->allocations, 1);
  /* It is b's, to free like any other. */
  ck_assert_int_eq(fx_free(&f, "b", 1002, got->rep.u.alloc.id), 0);
  fx_close(&f);
}
END_TEST

START_TEST(wait_times_out) {
  struct fx f;
  fx_open_small(&f);
  fx_hello(&f, "a", 1001, "");
  struct gmb_session *sb = fx_hello(&f, "b", 1002, "");
  fx_must_alloc(&f, "a", 1001, 8 * MIB, 0);
  struct wire_reply rep;
  ck_assert_int_eq(fx_alloc(&f, "b", 1002, MIB, 0, 5000, &rep), 0);
  uint64_t req_id = f.next_req - 1;
  /* Before its deadline: not answered, and the time left is reported. */
  uint64_t left = gmb__waitq_expire(&f.b, gmb__now_ns());
  ck_assert_uint_gt(left, 0);
  ck_assert_uint_le(left, UINT64_C(5000) * 1000000);
  ck_assert_ptr_null(fx_last_to(&f, "b"));
  ck_assert_uint_eq(f.b.waitq.n, 1);
  /* Long after it. */
  ck_assert_uint_eq(gmb__waitq_expire(&f.b, UINT64_MAX - 1), UINT64_MAX);
  const struct fx_sent *got = fx_last_to(&f, "b");
  ck_assert_ptr_nonnull(got);
  ck_assert_uint_eq(got->rep.id, req_id);
  ck_assert_int_eq(got->rep.status, GMB_E_TIMEOUT);
  ck_assert_int_eq(got->rep.kind, WIRE_NONE);
  ck_assert_uint_eq(f.b.waitq.n, 0);
  ck_assert_uint_eq(sb->tenant->waiting, 0);
  ck_assert_uint_eq(sb->tenant->used, 0);
  ck_assert_uint_eq(sb->allocations, 0);
  /* Answered once only. */
  size_t sent = f.n_sent;
  ck_assert_uint_eq(gmb__waitq_expire(&f.b, UINT64_MAX - 1), UINT64_MAX);
  ck_assert_uint_eq(f.n_sent, sent);
  fx_close(&f);
}
END_TEST

START_TEST(wait_forever_never_expires) {
  struct fx f;
  fx_open_small(&f);
  fx_hello(&f, "a", 1001, "");
  fx_hello(&f, "b", 1002, "");
  uint64_t big = fx_must_alloc(&f, "a", 1001, 8 * MIB, 0).u.alloc.id;
  struct wire_reply rep;
  ck_assert_int_eq(fx_alloc(&f, "b", 1002, MIB, 0, -1, &rep), 0);
  uint64_t year = UINT64_C(365) * 24 * 3600 * 1000000000;
  ck_assert_uint_gt(gmb__waitq_expire(&f.b, gmb__now_ns() + year), year);
  ck_assert_ptr_null(fx_last_to(&f, "b"));
  ck_assert_uint_eq(f.b.waitq.n, 1);
  ck_assert_int_eq(fx_free(&f, "a", 1001, big), 0);
  ck_assert_ptr_nonnull(fx_last_to(&f, "b"));
  ck_assert_int_eq(fx_last_to(&f, "b")->rep.status, 0);
  ck_assert_uint_eq(f.b.waitq.n, 0);
  fx_close(&f);
}
END_TEST

START_TEST(wait_does_not_hold_back_no_wait_request) {
  /* A request that does not wait is answered at once, even while others
   * wait; one that waits joins the queue behind them. */
  struct fx f;
  fx_open_small(&f);
  fx_hello(&f, "a", 1001, "");
  fx_hello(&f, "b", 1002, "");
  fx_hello(&f, "c", 1003, "");
  uint64_t six = fx_must_alloc(&f, "a", 1001, 6 * MIB, 0).u.alloc.id;
  struct wire_reply rep;
  ck_assert_int_eq(fx_alloc(&f, "b", 1002, 4 * MIB, 0, 60000, &rep), 0);
  ck_assert_uint_eq(f.b.waitq.n, 1);
  /* 2 MiB are free: c's 1 MiB without waiting fits, and is answered. */
  ck_assert_int_eq(fx_alloc(&f, "c", 1003, MIB, 0, 0, &rep), 1);
  ck_assert_int_eq(rep.status, 0);
  ck_assert_uint_eq(f.b.waitq.n, 1);
  /* The same asked with a timeout waits behind b. */
  ck_assert_int_eq(fx_alloc(&f, "c", 1003, 512, 0, 60000, &rep), 0);
  ck_assert_uint_eq(f.b.waitq.n, 2);
  ck_assert_ptr_null(fx_last_to(&f, "c"));
  /* a frees: both are served, b first. */
  ck_assert_int_eq(fx_free(&f, "a", 1001, six), 0);
  ck_assert_uint_eq(f.b.waitq.n, 0);
  const struct fx_sent *gb = fx_last_to(&f, "b"), *gc = fx_last_to(&f, "c");
  ck_assert_ptr_nonnull(gb);
  ck_assert_ptr_nonnull(gc);
  ck_assert_int_eq(gb->rep.status, 0);
  ck_assert_int_eq(gc->rep.status, 0);
  ck_assert_uint_lt((size_t)(gb - f.sent), (size_t)(gc - f.sent));
  fx_close(&f);
}
END_TEST

START_TEST(wait_ends_with_bye_of_waiter) {
  struct fx f;
  fx_open_small(&f);
  fx_hello(&f, "a", 1001, "");
  struct gmb_session *sb = fx_hello(&f, "b", 1002, "");
  struct gmb_tenant *tb = sb->tenant;
  uint64_t big = fx_must_alloc(&f, "a", 1001, 8 * MIB, 0).u.alloc.id;
  struct wire_reply rep;
  ck_assert_int_eq(fx_alloc(&f, "b", 1002, MIB, 0, 60000, &rep), 0);
  ck_assert_int_eq(fx_plain(&f, "b", 1002, WIRE_BYE, &rep), 1);
  ck_assert_uint_eq(f.b.waitq.n, 0);
  ck_assert_uint_eq(tb->waiting, 0);
  /* The memory that comes back goes to nobody. */
  ck_assert_int_eq(fx_free(&f, "a", 1001, big), 0);
  ck_assert_ptr_null(fx_last_to(&f, "b"));
  ck_assert_uint_eq(tb->used, 0);
  fx_close(&f);
}
END_TEST

/* DESIGN.md, "Protocol and sockets": every message's peer credentials are
 * checked against its session's, not only its routing id: a message with a
 * session's routing id from another uid neither allocates in the session
 * nor frees its memory. */
START_TEST(credentials_checked_per_message) {
  struct fx f;
  fx_open(&f);
  fx_hello(&f, "a", 1001, "");
  uint64_t id = fx_must_alloc(&f, "a", 1001, MIB, 0).u.alloc.id;
  struct wire_reply rep;
  ck_assert_int_eq(fx_alloc(&f, "a", 1002, MIB, 0, 0, &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_AUTH);
  ck_assert_int_eq(fx_free(&f, "a", 1002, id), GMB_E_AUTH);
  ck_assert_uint_eq(fx_tenant(&f, "uid-1001")->used, MIB);
  fx_close(&f);
}
END_TEST


/* --- squatting and impossible waits ------------------------------ */

/* The default tenant "uid-N" was created by whoever
 * named it first, so uid 1002 saying Hello as "uid-1001" locked uid 1001
 * out.  A name of the form uid-N is admitted for uid N only. */
START_TEST(default_tenant_not_squatted) {
  struct fx f;
  fx_open(&f);
  struct wire_reply rep;
  ck_assert_int_eq(fx_hello_as(&f, "evil", 1002, "uid-1001",
                            WIRE_PROTOCOL_VERSION, &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_AUTH);
  ck_assert_int_eq(fx_hello_as(&f, "a", 1001, "", WIRE_PROTOCOL_VERSION, &rep),
                   1);
  ck_assert_int_eq(rep.status, 0);
  ck_assert_str_eq(rep.u.hello.tenant, "uid-1001");
  fx_close(&f);
}
END_TEST

/* A waiting request larger than the whole device was
 * queued (for ever with timeout -1) although no free can ever make room,
 * and, first in the queue, it blocked every later request of equal or
 * lower priority, even on an empty device.  It is refused at once. */
START_TEST(wait_larger_than_device_refused) {
  struct fx f;
  fx_open_small(&f);
  fx_hello(&f, "a", 1001, "");
  fx_hello(&f, "b", 1002, "");
  struct wire_reply rep;
  ck_assert_int_eq(fx_alloc(&f, "a", 1001, 16 * MIB, 0, -1, &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_NOMEM);
  ck_assert_uint_eq(f.b.waitq.n, 0);
  /* And b's 1 MiB on the empty device is served at once. */
  ck_assert_int_eq(fx_alloc(&f, "b", 1002, MIB, 0, 1000, &rep), 1);
  ck_assert_int_eq(rep.status, 0);
  fx_close(&f);
}
END_TEST


/* A name an operator configures at reload is the
 * configured parties' only: a session that took the name first (an unbound
 * name then) ends with an eviction event, one of a listed uid stays. */
START_TEST(reload_configured_name_ends_squatter) {
  struct fx f;
  fx_open_ini(&f, "host:64MiB", "[tenant:other]\n");
  struct gmb_session *sq = fx_hello(&f, "squat", 1003, "llm-b");
  fx_must_alloc(&f, "squat", 1003, MIB, 0);
  struct wire_reply rep;
  ck_assert_int_eq(fx_hello_as(&f, "own", 1002, "llm-b", WIRE_PROTOCOL_VERSION,
                               &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_AUTH); /* 1003 owns it now */
  ck_assert_uint_eq(gmb__sessions_count(f.b.sessions), 1);
  struct gmb_tenant *t = sq->tenant;
  ck_assert_uint_eq(t->n_sessions, 1);
  char path[256], msg[512];
  fx_write(&f, "gmb.ini", "[tenant:other]\n[tenant:llm-b]\nuids = 1002\n"
           "reserve = 8MiB\n", path, sizeof path);
  ck_assert_msg(gmb__admin_reload(&f.b, msg, sizeof msg) == 0, "%s", msg);
  ck_assert_ptr_nonnull(strstr(msg, "1 sessions ended"));
  /* The squatter is gone, told why, and its memory with it. */
  ck_assert_ptr_null(gmb__session_find(f.b.sessions, (const uint8_t *)"squat",
                                       5));
  const struct fx_sent *ev = fx_last_to(&f, "squat");
  ck_assert_ptr_nonnull(ev);
  ck_assert_int_eq(ev->rep.kind, WIRE_EVENT);
  ck_assert_ptr_eq(fx_tenant(&f, "llm-b"), t);
  ck_assert_uint_eq(t->n_sessions, 0);
  ck_assert_uint_eq(t->used, 0);
  /* The configured uid gets it; the squatter's uid no more. */
  ck_assert_int_eq(fx_hello_as(&f, "own", 1002, "llm-b", WIRE_PROTOCOL_VERSION,
                               &rep), 1);
  ck_assert_int_eq(rep.status, 0);
  ck_assert_int_eq(fx_hello_as(&f, "squat", 1003, "llm-b",
                               WIRE_PROTOCOL_VERSION, &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_AUTH);
  /* A second reload keeps the listed uid's session. */
  ck_assert_msg(gmb__admin_reload(&f.b, msg, sizeof msg) == 0, "%s", msg);
  ck_assert_ptr_null(strstr(msg, "sessions ended"));
  ck_assert_uint_eq(t->n_sessions, 1);
  fx_close(&f);
}
END_TEST

/* Sessions are capped per uid and in all; the one past
 * a cap is refused GMB_E_LIMIT with the reason, and the others are served
 * on.  Ending a session makes room again. */
START_TEST(sessions_capped_per_uid_and_total) {
  struct fx f;
  fx_open_ini(&f, "host:64MiB",
              "[broker]\nmax_sessions = 4\nmax_sessions_per_uid = 2\n");
  struct wire_reply rep;
  fx_hello(&f, "a1", 1001, "");
  fx_hello(&f, "a2", 1001, "");
  ck_assert_int_eq(fx_hello_as(&f, "a3", 1001, "", WIRE_PROTOCOL_VERSION,
                               &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_LIMIT);
  ck_assert_ptr_nonnull(strstr(rep.message, "max_sessions_per_uid"));
  /* Another tenant of the same uid counts the same: the uid holds them. */
  ck_assert_int_eq(fx_hello_as(&f, "a3", 1001, "other",
                               WIRE_PROTOCOL_VERSION, &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_LIMIT);
  fx_hello(&f, "b1", 1002, "");
  fx_hello(&f, "b2", 1002, "");
  ck_assert_int_eq(fx_hello_as(&f, "c1", 1003, "", WIRE_PROTOCOL_VERSION,
                               &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_LIMIT);
  ck_assert_ptr_nonnull(strstr(rep.message, "max_sessions"));
  ck_assert_uint_eq(gmb__sessions_count(f.b.sessions), 4);
  /* The broker serves the sessions it has. */
  fx_must_alloc(&f, "a1", 1001, MIB, 0);
  fx_must_alloc(&f, "b2", 1002, MIB, GMB_MOVABLE);
  /* One goes: its uid, and anyone, may come. */
  ck_assert_int_eq(fx_plain(&f, "a2", 1001, WIRE_BYE, &rep), 1);
  ck_assert_uint_eq(gmb__sessions_of_uid(f.b.sessions, 1001), 1);
  fx_hello(&f, "c1", 1003, "");
  ck_assert_uint_eq(gmb__sessions_of_uid(f.b.sessions, 1003), 1);
  ck_assert_uint_eq(gmb__sessions_of_uid(f.b.sessions, 1004), 0);
  fx_close(&f);
}
END_TEST

/* RLIMIT_NOFILE is raised to what max_sessions needs (4
 * descriptors each, and one per segment the device can hold), or the
 * sessions admitted are lowered to what the limit allows: running out of
 * descriptors aborts libzmq. */
START_TEST(fd_limit_raised_or_sessions_lowered) {
  struct fx f;
  fx_open_ini(&f, "host:64MiB", "[broker]\nmax_sessions = 30000\n");
  struct rlimit rl;
  ck_assert_int_eq(getrlimit(RLIMIT_NOFILE, &rl), 0);
  uint64_t segs = 64 / 2 + 1;
  uint64_t need = GMB_FDS_RESERVED + segs + 30000ull * GMB_FDS_PER_SESSION;
  if (rl.rlim_cur >= need) {
    ck_assert_uint_eq(gmb__core_max_sessions(&f.b), 30000);
  } else {
    /* Not allowed to raise it so far: fewer sessions, never more than the
     * descriptors allow. */
    uint32_t m = gmb__core_max_sessions(&f.b);
    ck_assert_uint_lt(m, 30000);
    uint64_t cap = f.b.dev->seg_max ? f.b.dev->seg_max : segs;
    ck_assert_uint_le(cap + (uint64_t)m * GMB_FDS_PER_SESSION, rl.rlim_cur);
  }
  /* Never below what it was (20000 here, unless a container forbids
   * raising the hard limit, as CAP_SYS_RESOURCE may). */
  ck_assert_uint_ge(rl.rlim_cur, 1024);
  fx_close(&f);
}
END_TEST

/* The share-out of a descriptor limit: never more than the limit, every
 * configured session when everything fits, and under docker's 1024 with
 * a 1 GiB device (513 segments at worst, CI's check-deploy) dozens of
 * sessions rather than one. */
START_TEST(fd_split_shares_out_the_limit) {
  static const struct {
    uint64_t have, segs;
    uint32_t max_sessions;
  } cases[] = {
      {1024, 513, 4096},     {1024, 33, 4096},    {1024, 33, 4},
      {20000, 513, 4096},    {1u << 20, 72000, 4096}, {1024, 72000, 4096},
      {16, 513, 4096},       {4096, 0, 1},        {65536, 513, 4096},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    uint32_t n;
    uint64_t seg_max;
    gmb__core_fd_split(cases[i].have, cases[i].segs, cases[i].max_sessions,
                       &n, &seg_max);
    uint64_t segs = seg_max ? seg_max : cases[i].segs;
    ck_assert_uint_ge(n, 1);
    ck_assert_uint_le(n, cases[i].max_sessions);
    ck_assert_msg(segs + (uint64_t)n * GMB_FDS_PER_SESSION <= cases[i].have,
                  "case %zu: %u sessions and %llu segments exceed %llu", i, n,
                  (unsigned long long)segs,
                  (unsigned long long)cases[i].have);
    uint64_t full = GMB_FDS_RESERVED + cases[i].segs +
                    (uint64_t)cases[i].max_sessions * GMB_FDS_PER_SESSION;
    if (cases[i].have >= full) {
      ck_assert_uint_eq(n, cases[i].max_sessions);
      ck_assert_uint_eq(seg_max, 0);
    }
  }
  uint32_t n;
  uint64_t seg_max;
  gmb__core_fd_split(1024, 513, 4096, &n, &seg_max);
  ck_assert_uint_ge(n, 64);
  ck_assert_uint_ge(seg_max, 256); /* 512 MiB or more in 2 MiB pieces */
}
END_TEST

/* The broker under `--ulimit nofile=1024:1024` (no CAP_SYS_RESOURCE) on a
 * 1 GiB host device: two jobs connect, and the segment cap refuses a
 * segment as out of memory instead of running out of descriptors.  In a
 * child, since a lowered hard limit cannot be raised again. */
START_TEST(fd_limit_1024_admits_many_sessions) {
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0) {
    struct rlimit rl = {1024, 1024};
    if (setrlimit(RLIMIT_NOFILE, &rl) != 0) _exit(10);
    struct fx f;
    fx_open_ini(&f, "host:1GiB", "");
    uint32_t m = gmb__core_max_sessions(&f.b);
    if (m < 64) _exit(11);
    uint64_t cap = f.b.dev->seg_max;
    if (cap == 0 || cap + (uint64_t)m * GMB_FDS_PER_SESSION > 1024) _exit(12);
    /* Fill the cap with the smallest segments; the next is refused. */
    struct gmb_dseg *segs = calloc(cap + 1, sizeof *segs);
    if (!segs) _exit(13);
    for (uint64_t i = 0; i < cap; i++)
      if (gmb__device_seg_new(f.b.dev, 1000 + i, GMB_SEGMENT_ALIGN,
                              &segs[i]) != 0)
        _exit(14);
    if (gmb__device_seg_new(f.b.dev, 1000 + cap, GMB_SEGMENT_ALIGN,
                            &segs[cap]) != GMB_E_NOMEM)
      _exit(15);
    gmb__device_seg_free(f.b.dev, &segs[0]);
    if (gmb__device_seg_new(f.b.dev, 1000 + cap, GMB_SEGMENT_ALIGN,
                            &segs[0]) != 0)
      _exit(16);
    for (uint64_t i = 0; i < cap; i++)
      gmb__device_seg_free(f.b.dev, &segs[i]);
    free(segs);
    fx_close(&f);
    _exit(0);
  }
  int st = 0;
  ck_assert_int_eq(waitpid(pid, &st, 0), pid);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0,
                "child under nofile 1024: status %d (see the _exit codes)",
                WIFEXITED(st) ? WEXITSTATUS(st) : -1);
}
END_TEST

static int tenant_exists(struct fx *f, const char *name) {
  return gmb__tenant_find(f->b.tenants, name) != NULL;
}

/* One uid filled the registry with tenants made by first
 * use, and then no new uid could get a tenant.  A uid may make
 * max_tenants_per_uid named ones (its own default name aside); a default
 * tenant (uid-N) goes away once it has no session and no memory; and when
 * the registry is full, idle named ones make room. */
START_TEST(default_tenants_reaped_and_capped) {
  struct fx f;
  fx_open_ini(&f, "host:64MiB", "[broker]\nmax_tenants_per_uid = 3\n"
              "[tenant:conf]\n");
  struct wire_reply rep;
  fx_hello(&f, "t1", 1001, "t1");
  fx_hello(&f, "t2", 1001, "t2");
  fx_hello(&f, "t3", 1001, "t3");
  ck_assert_int_eq(fx_hello_as(&f, "t4", 1001, "t4", WIRE_PROTOCOL_VERSION,
                               &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_LIMIT);
  ck_assert_ptr_nonnull(strstr(rep.message, "max_tenants_per_uid"));
  ck_assert(!tenant_exists(&f, "t4"));
  /* Its own default name and configured tenants do not count; nor does
   * another uid care. */
  fx_hello(&f, "d", 1001, "");
  fx_hello(&f, "c", 1001, "conf");
  fx_hello(&f, "o", 1002, "o1");
  /* A named tenant stays after its session (its first uid owns it). */
  ck_assert_int_eq(fx_plain(&f, "t1", 1001, WIRE_BYE, &rep), 1);
  gmb__core_reap(&f.b, 0);
  ck_assert(tenant_exists(&f, "t1"));
  /* A default tenant goes with its last session and its memory. */
  fx_hello(&f, "u", 2000, "");
  fx_must_alloc(&f, "u", 2000, 3 * MIB, GMB_MOVABLE);
  ck_assert_int_eq(fx_plain(&f, "u", 2000, WIRE_BYE, &rep), 1);
  ck_assert(tenant_exists(&f, "uid-2000")); /* removed between messages */
  gmb__core_reap(&f.b, 0);
  ck_assert(!tenant_exists(&f, "uid-2000"));
  ck_assert_int_eq(gmb__core_check(&f.b), 0);
  /* Many uids come and go: the registry does not grow. */
  size_t before = gmb__tenants_count(f.b.tenants);
  for (uid_t u = 3000; u < 3300; u++) {
    fx_hello(&f, "n", u, "");
    ck_assert_int_eq(fx_plain(&f, "n", u, WIRE_BYE, &rep), 1);
    gmb__core_reap(&f.b, 0);
  }
  ck_assert_uint_eq(gmb__tenants_count(f.b.tenants), before);
  /* A configured tenant stays without sessions. */
  ck_assert_int_eq(fx_plain(&f, "c", 1001, WIRE_BYE, &rep), 1);
  gmb__core_reap(&f.b, 1);
  ck_assert(tenant_exists(&f, "conf"));
  ck_assert(!tenant_exists(&f, "t1")); /* idle and named: asked to go */
  ck_assert(tenant_exists(&f, "t2")); /* a session holds it */
  fx_close(&f);
}
END_TEST

/* After a session's end that leaves a default tenant idle, the loop
 * reaps: that used to walk every tenant (1,000 named ones here) after
 * every such end.  The tenants that may have gone idle are listed as they
 * do, and only those are looked at. */
START_TEST(default_tenant_reap_visits_only_listed) {
  enum { N = 1000 };
  struct fx f;
  fx_open_ini(&f, "host:64MiB", "[broker]\nmax_tenants_per_uid = 4096\n");
  struct wire_reply rep;
  f.b.checks = 0;
  for (int i = 0; i < N; i++) {
    char name[16];
    snprintf(name, sizeof name, "n%d", i);
    fx_hello(&f, "n", 1001, name);
    ck_assert_int_eq(fx_plain(&f, "n", 1001, WIRE_BYE, &rep), 1);
  }
  gmb__core_reap(&f.b, 0);
  f.b.checks = 1;
  size_t before = gmb__tenants_count(f.b.tenants);
  ck_assert_uint_ge(before, N);
  for (uid_t u = 3000; u < 3010; u++) {
    fx_hello(&f, "u", u, "");
    fx_must_alloc(&f, "u", u, 3 * MIB, GMB_MOVABLE);
    uint64_t visits = gmb__tenants_reap_visits(f.b.tenants);
    ck_assert_int_eq(fx_plain(&f, "u", u, WIRE_BYE, &rep), 1);
    gmb__core_reap(&f.b, 0);
    ck_assert_uint_le(gmb__tenants_reap_visits(f.b.tenants) - visits, 2);
    ck_assert_uint_eq(gmb__tenants_count(f.b.tenants), before);
  }
  /* A named tenant stays, as it did. */
  ck_assert(tenant_exists(&f, "n0"));
  ck_assert_int_eq(gmb__core_check(&f.b), 0);
  fx_close(&f);
}
END_TEST

/* The registry full of idle named tenants (one uid's, made one by one):
 * a new uid still gets its tenant, idle ones make room. */
START_TEST(registry_full_idle_make_room) {
  struct fx f;
  fx_open_ini(&f, "host:64MiB", "[broker]\nmax_tenants_per_uid = 4096\n");
  f.b.checks = 0;
  struct wire_reply rep;
  for (int i = 0; !gmb__tenants_full(f.b.tenants); i++) {
    char name[16];
    snprintf(name, sizeof name, "n%d", i);
    ck_assert_int_le(i, 5000);
    fx_hello(&f, "n", 1001, name);
    ck_assert_int_eq(fx_plain(&f, "n", 1001, WIRE_BYE, &rep), 1);
  }
  f.b.checks = 1;
  fx_hello(&f, "new", 1002, "");
  ck_assert(tenant_exists(&f, "uid-1002"));
  ck_assert_uint_lt(gmb__tenants_count(f.b.tenants), 10);
  fx_close(&f);
}
END_TEST

/* A Hello that finds the registry full walks every tenant for idle ones,
 * and refused Hellos come as fast as a client likes: a walk comes only
 * when a tenant may have gone idle since the last one, or a few times a
 * second (GMB_REAP_FULL_WALKS); the refusals between walk nothing. */
START_TEST(registry_full_refusals_walk_a_few_times_a_second) {
  enum { HELLOS = 300 };
  struct fx f;
  fx_open_ini(&f, "host:64MiB", NULL);
  struct wire_reply rep;
  fx_hello(&f, "mine", 1003, "mine"); /* made by first use, held */
  f.b.checks = 0;
  /* The operator's tenants fill the rest: none of them is idle. */
  struct gmb_peer ctl = fx_peer("ctl", geteuid());
  for (int i = 0; !gmb__tenants_full(f.b.tenants); i++) {
    ck_assert_int_le(i, 5000);
    struct wire_request req;
    memset(&req, 0, sizeof req);
    req.kind = WIRE_ADMIN_TENANT_ADD;
    snprintf(req.u.admin_tenant_add.tenant,
             sizeof req.u.admin_tenant_add.tenant, "op%d", i);
    req.u.admin_tenant_add.n_uids = 1;
    req.u.admin_tenant_add.uids[0] = 50000;
    req.id = (uint64_t)i + 1;
    ck_assert_int_eq(gmb__admin(&f.b, &ctl, &req, &rep), 1);
    ck_assert_msg(rep.status == 0, "%s", rep.message);
  }
  f.b.checks = 1;
  const struct gmb_reap_full before = f.b.reap_full;
  const uint64_t t0 = gmb__now_ns();
  for (int i = 0; i < HELLOS; i++) {
    char name[16];
    snprintf(name, sizeof name, "new%d", i);
    ck_assert_int_eq(fx_hello_as(&f, "x", 1002, name, WIRE_PROTOCOL_VERSION,
                                 &rep), 1);
    ck_assert_int_eq(rep.status, GMB_E_LIMIT);
  }
  const uint64_t seconds = (gmb__now_ns() - t0) / GMB_NS_PER_S + 1;
  const uint64_t walks = f.b.reap_full.walks - before.walks;
  ck_assert_uint_ge(walks, 1);
  ck_assert_uint_le(walks, GMB_REAP_FULL_WALKS * (seconds + 1));
  ck_assert_uint_eq(f.b.reap_full.skipped - before.skipped, HELLOS - walks);
  /* A tenant goes idle: the next Hello walks at once, whatever this
   * second's count, and gets its room. */
  f.b.reap_full.in_window = GMB_REAP_FULL_WALKS;
  f.b.reap_full.window_ns = gmb__now_ns();
  ck_assert_int_eq(fx_plain(&f, "mine", 1003, WIRE_BYE, &rep), 1);
  ck_assert_int_eq(f.b.reap_full.hint, 1);
  fx_hello(&f, "x", 1002, "late");
  ck_assert(!tenant_exists(&f, "mine"));
  ck_assert(tenant_exists(&f, "late"));
  ck_assert_uint_eq(f.b.reap_full.walks - before.walks, walks + 1);
  ck_assert_int_eq(f.b.reap_full.hint, 0);
  fx_close(&f);
}
END_TEST

/* 177,000 queued requests in 90 s.  Waiters are capped
 * per session and per tenant: the excess is refused at once, GMB_E_LIMIT,
 * and those queued are served as before. */
START_TEST(waiters_capped_per_session_and_tenant) {
  struct fx f;
  fx_open_ini(&f, "host:8MiB", "[broker]\ncompaction = off\n"
              "max_waiters_per_session = 2\nmax_waiters_per_tenant = 3\n");
  fx_hello(&f, "a", 1001, "");
  struct gmb_session *b1 = fx_hello(&f, "b1", 1002, "");
  fx_hello(&f, "b2", 1002, "");
  fx_hello(&f, "c", 1003, "");
  uint64_t all = fx_must_alloc(&f, "a", 1001, 8 * MIB, 0).u.alloc.id;
  struct wire_reply rep;
  ck_assert_int_eq(fx_alloc(&f, "b1", 1002, MIB, 0, 60000, &rep), 0);
  ck_assert_int_eq(fx_alloc(&f, "b1", 1002, MIB, 0, 60000, &rep), 0);
  ck_assert_int_eq(fx_alloc(&f, "b1", 1002, MIB, 0, 60000, &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_LIMIT);
  ck_assert_ptr_nonnull(strstr(rep.message, "max_waiters_per_session"));
  ck_assert_uint_eq(b1->waiting, 2);
  ck_assert_int_eq(fx_alloc(&f, "b2", 1002, MIB, 0, 60000, &rep), 0);
  ck_assert_int_eq(fx_alloc(&f, "b2", 1002, MIB, 0, 60000, &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_LIMIT); /* the tenant's 3 */
  ck_assert_int_eq(fx_alloc(&f, "c", 1003, MIB, 0, 60000, &rep), 0);
  ck_assert_uint_eq(f.b.waitq.n, 4);
  /* Memory comes back: the four are served, in order. */
  ck_assert_int_eq(fx_free(&f, "a", 1001, all), 0);
  ck_assert_uint_eq(f.b.waitq.n, 0);
  ck_assert_uint_eq(b1->waiting, 0);
  ck_assert_int_eq(fx_last_to(&f, "c")->rep.status, 0);
  fx_close(&f);
}
END_TEST

/* A reload accepted reservations larger than the
 * device, silently.  It is refused (the running configuration stays), as
 * gmbctl reserve set is; the state file's overrides count too. */
START_TEST(reload_reservations_over_device_refused) {
  struct fx f;
  fx_open_ini(&f, "host:64MiB", "[broker]\nstate = @STATE@\n"
              "[tenant:a]\nreserve = 16MiB\n[tenant:b]\n");
  char path[256], msg[512], state[256];
  snprintf(state, sizeof state, "%s/state", f.dir);
  fx_write(&f, "gmb.ini", "[broker]\nstate = x\n[tenant:a]\nreserve = 48MiB\n"
           "[tenant:b]\nreserve = 32MiB\n", path, sizeof path);
  ck_assert_int_eq(gmb__admin_reload(&f.b, msg, sizeof msg), GMB_E_INVAL);
  ck_assert_ptr_nonnull(strstr(msg, "reservations"));
  ck_assert_uint_eq(fx_tenant(&f, "a")->reserve, 16 * MIB);
  ck_assert_uint_eq(fx_tenant(&f, "b")->reserve, 0);
  /* The config fits, the state file's override for b does not. */
  fx_write(&f, "gmb.ini", "[tenant:a]\nreserve = 32MiB\n[tenant:b]\n", path,
           sizeof path);
  fx_write(&f, "state", "version = 1\n[tenant:b]\nreserve = 40MiB\n", path,
           sizeof path);
  ck_assert_int_eq(gmb__admin_reload(&f.b, msg, sizeof msg), GMB_E_INVAL);
  ck_assert_uint_eq(fx_tenant(&f, "a")->reserve, 16 * MIB);
  ck_assert_uint_eq(fx_tenant(&f, "b")->reserve, 0);
  fx_write(&f, "state", "version = 1\n[tenant:b]\nreserve = 8MiB\n", path,
           sizeof path);
  ck_assert_msg(gmb__admin_reload(&f.b, msg, sizeof msg) == 0, "%s", msg);
  ck_assert_uint_eq(fx_tenant(&f, "a")->reserve, 32 * MIB);
  ck_assert_uint_eq(fx_tenant(&f, "b")->reserve, 8 * MIB);
  fx_close(&f);
}
END_TEST

/* The start-up check ran before the state file, so the
 * state's overrides escaped it.  gmb__core_reservations sees them. */
START_TEST(start_check_counts_state_file) {
  struct fx f;
  fx_open_ini(&f, "host:64MiB", "[broker]\nstate = @STATE@\n"
              "[tenant:a]\nreserve = 32MiB\n");
  char msg[512], path[256];
  ck_assert_int_eq(gmb__core_reservations(&f.b, msg, sizeof msg), 0);
  fx_write(&f, "state", "version = 1\n[tenant:b]\nreserve = 40MiB\n", path,
           sizeof path);
  ck_assert_int_eq(gmb__statefile_reread(&f.b, msg, sizeof msg), 0);
  ck_assert_int_eq(gmb__statefile_apply(&f.b), 1);
  ck_assert_int_eq(gmb__core_reservations(&f.b, msg, sizeof msg),
                   GMB_E_INVAL);
  ck_assert_ptr_nonnull(strstr(msg, "cannot all be kept"));
  fx_close(&f);
}
END_TEST

/* An evicted process kept writing its memory, and the
 * tenant's next session found its bytes overwritten: gmb_lock sends no
 * message, so the process never saw the eviction, and the segment the pool
 * kept lingering served the next session.  The lock table's `evicted`
 * word says it at once (the client's mapping outlives the broker's), and
 * none of the tenant's segments serves again. */
START_TEST(evict_sets_word_and_retires_segments) {
  struct fx f;
  fx_open(&f);
  struct gmb_session *s = fx_hello(&f, "v", 1001, "victim");
  struct gmb_tenant *t = s->tenant;
  struct gmb__lt_header *h = fx_map_locktab(s);
  ck_assert_uint_eq(atomic_load(&h->evicted), 0);
  uint64_t small = fx_must_alloc(&f, "v", 1001, MIB, GMB_MOVABLE).u.alloc.id;
  uint64_t seg = 0;
  struct gmb_alloc_info info;
  ck_assert_int_eq(gmb__pool_find(f.b.pool, small, &info), 0);
  seg = info.dseg->id;
  struct wire_request req;
  memset(&req, 0, sizeof req);
  req.id = 77;
  req.kind = WIRE_ADMIN_EVICT;
  snprintf(req.u.admin_evict.tenant, sizeof req.u.admin_evict.tenant,
           "victim");
  struct gmb_peer peer = fx_peer("ctl", geteuid());
  struct wire_reply rep;
  ck_assert_int_eq(gmb__admin(&f.b, &peer, &req, &rep), 1);
  ck_assert_int_eq(rep.status, 0);
  ck_assert_uint_eq(rep.u.evict.sessions, 1);
  /* The word, in the client's mapping, with the session gone. */
  ck_assert_ptr_null(gmb__session_find(f.b.sessions, (const uint8_t *)"v", 1));
  ck_assert_uint_eq(atomic_load(&h->evicted), GMB_LT_EVICTED);
  /* Its segment went back to the device, lingering or not. */
  ck_assert_ptr_null(gmb__pool_segment(f.b.pool, seg, NULL));
  ck_assert_uint_eq(t->segment_bytes, 0);
  ck_assert_uint_eq(f.b.dev->in_use, 0);
  /* The tenant's next session gets another segment. */
  fx_hello(&f, "v2", 1001, "victim");
  struct wire_reply r2 = fx_must_alloc(&f, "v2", 1001, MIB, 0);
  ck_assert_uint_ne(r2.u.alloc.segment, seg);
  fx_unmap_locktab(h);
  fx_close(&f);
}
END_TEST

/* The host device made to free a segment only once every session that
 * mapped it said it closed it, as the cuda device does; returns the ops
 * to put back before fx_close. */
static const struct gmb_device_ops *fx_waits_for_holders(struct fx *f) {
  static struct gmb_device_ops waits;
  const struct gmb_device_ops *host = f->b.dev->ops;
  waits = *host;
  waits.free_waits_for_holders = 1;
  f->b.dev->ops = &waits;
  return host;
}

/* Session rid says it closed retired segment `seg`. */
static void fx_seg_closed(struct fx *f, const char *rid, uid_t uid,
                          uint64_t seg) {
  struct wire_request req;
  memset(&req, 0, sizeof req);
  req.kind = WIRE_SEGMENT_CLOSED;
  req.u.segment.segment = seg;
  struct wire_reply rep;
  ck_assert_int_eq(fx_request(f, rid, uid, &req, &rep), 0);
}

/* A process that never answers SegmentClosed for its tenant's retired
 * segments (cuda: the memory stays in use on the GPU while it maps them)
 * kept 512 MiB parked while its tenant used 0 of a 64 MiB quota, and
 * others got GMB_E_NOMEM.  Retiring bytes now count against the tenant's
 * quota until closed.  The host device frees at once, so the test makes
 * it wait for holders as the cuda device does. */
START_TEST(retiring_counts_against_quota) {
  struct fx f;
  fx_open_ini(&f, "host:64MiB",
              "[broker]\ncompaction = off\n"
              "[tenant:t]\nquota = 8MiB\nuids = 1001\n");
  const struct gmb_device_ops *host = fx_waits_for_holders(&f);
  struct gmb_session *s = fx_hello(&f, "a", 1001, "t");
  struct gmb_tenant *t = s->tenant;
  struct wire_reply r = fx_must_alloc(&f, "a", 1001, 8 * MIB, 0);
  uint64_t seg = r.u.alloc.segment;
  ck_assert_int_eq(gmb__session_seg_seen(s, seg), 0);
  ck_assert_int_eq(fx_free(&f, "a", 1001, r.u.alloc.id), 0);
  ck_assert_uint_eq(f.b.dev->retiring, 1);
  ck_assert_uint_eq(t->used, 0);
  ck_assert_uint_eq(t->retiring, 8 * MIB);
  /* Parked and mapped: the quota is full. */
  struct wire_reply rep;
  ck_assert_int_eq(fx_alloc(&f, "a", 1001, 2 * MIB, 0, 0, &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_QUOTA);
  ck_assert_ptr_nonnull(strstr(rep.message, "retired segments"));
  /* Closed: the bytes are the tenant's again. */
  fx_seg_closed(&f, "a", 1001, seg);
  ck_assert_uint_eq(f.b.dev->retiring, 0);
  ck_assert_uint_eq(t->retiring, 0);
  fx_must_alloc(&f, "a", 1001, 8 * MIB, 0);
  f.b.dev->ops = host;
  fx_close(&f);
}
END_TEST

/* On a 16 MiB device: the small segment of session `mapper` (client
 * `rid`), mapped by its process, lingers empty; so does tenant u's (session "b", uid 1002),
 * which nobody mapped; tenant w's session "c" (uid 1003) holds 10 MiB.
 * 2 MiB of room are left, 4 once the lingering ones go.  Returns the
 * mapped segment. */
static uint64_t linger_mapped_and_unmapped(struct fx *f,
                                           struct gmb_session *mapper,
                                           const char *rid) {
  struct wire_reply r = fx_must_alloc(f, rid, mapper->uid, MIB, 0);
  uint64_t seg = r.u.alloc.segment;
  ck_assert_int_eq(gmb__session_seg_seen(mapper, seg), 0);
  ck_assert_int_eq(fx_free(f, rid, mapper->uid, r.u.alloc.id), 0);
  r = fx_must_alloc(f, "b", 1002, MIB, 0);
  ck_assert_int_eq(fx_free(f, "b", 1002, r.u.alloc.id), 0);
  fx_must_alloc(f, "c", 1003, 10 * MIB, 0);
  ck_assert_uint_eq(f->b.dev->in_use, 14 * MIB);
  return seg;
}

#define LINGER_INI "[tenant:u]\nuids = 1002\n[tenant:w]\nuids = 1003\n"

/* A large request that fits its tenant's quota found the device full;
 * the pool made room by releasing every arena's lingering segment, its
 * own tenant's among them, which a process of the tenant still maps (the
 * cuda device parks it: retiring, charged to the quota from then on).
 * The charge that followed passed the quota and the broker aborted on an
 * assertion.  Now the quota is asked again and the request is refused
 * GMB_E_QUOTA, nothing left allocated.  The pages of a cache's request
 * meet the same, and so does a Vmm increase, which the trim before it
 * used to grant past the quota. */
START_TEST(retired_by_the_pools_room_making_refused_not_aborted) {
  for (int kind = 0; kind < 3; kind++) { /* alloc, pages, vmm */
    struct fx f;
    fx_open_ini(&f, "host:16MiB",
                "[broker]\ncompaction = off\n"
                "[tenant:t]\nquota = 4MiB\nuids = 1001\n" LINGER_INI);
    const struct gmb_device_ops *host = fx_waits_for_holders(&f);
    struct gmb_session *s = fx_hello(&f, "a", 1001, "t");
    struct gmb_tenant *t = s->tenant;
    fx_hello(&f, "b", 1002, "u");
    fx_hello(&f, "c", 1003, "w");
    uint64_t seg = linger_mapped_and_unmapped(&f, s, "a");
    struct wire_request req;
    memset(&req, 0, sizeof req);
    req.kind = kind == 2 ? WIRE_VMM : WIRE_ALLOC;
    if (kind == 2) {
      req.u.vmm.bytes = 4 * MIB;
    } else {
      req.u.alloc.size = 4 * MIB;
      req.u.alloc.pages = kind == 1 ? 2 : 0;
    }
    struct wire_reply rep;
    ck_assert_int_eq(fx_request(&f, "a", 1001, &req, &rep), 1);
    ck_assert_int_eq(rep.status, GMB_E_QUOTA);
    ck_assert_ptr_nonnull(strstr(rep.message, "retired segments"));
    ck_assert_uint_eq(t->used, 0);
    ck_assert_uint_eq(t->vmm, 0);
    ck_assert_uint_eq(t->retiring, 2 * MIB);
    ck_assert_uint_eq(s->allocations, 0);
    /* Closed: its quota is whole again, and the room is there. */
    fx_seg_closed(&f, "a", 1001, seg);
    ck_assert_uint_eq(t->retiring, 0);
    fx_must_alloc(&f, "a", 1001, 4 * MIB, 0);
    f.b.dev->ops = host;
    fx_close(&f);
  }
}
END_TEST

/* The same through a uid's budget: the lingering segment released to
 * make room is another of the uid's tenants made by first use, parked
 * while its process maps it; the budget they share counts it, and the
 * charge that followed passed the budget (the broker aborted).  Refused
 * GMB_E_QUOTA now. */
START_TEST(retired_sibling_passes_the_uid_budget_refused_not_aborted) {
  struct fx f;
  fx_open_ini(&f, "host:16MiB",
              "[broker]\ncompaction = off\ndefault_quota = 4MiB\n"
              LINGER_INI);
  const struct gmb_device_ops *host = fx_waits_for_holders(&f);
  struct gmb_session *sib = fx_hello(&f, "s", 1001, "sibling");
  struct gmb_tenant *t = fx_hello(&f, "a", 1001, "")->tenant;
  fx_hello(&f, "b", 1002, "u");
  fx_hello(&f, "c", 1003, "w");
  uint64_t seg = linger_mapped_and_unmapped(&f, sib, "s");
  struct wire_reply rep;
  ck_assert_int_eq(fx_alloc(&f, "a", 1001, 4 * MIB, 0, 0, &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_QUOTA);
  ck_assert_uint_eq(t->used, 0);
  ck_assert_uint_eq(sib->tenant->retiring, 2 * MIB);
  fx_seg_closed(&f, "s", 1001, seg);
  fx_must_alloc(&f, "a", 1001, 4 * MIB, 0);
  f.b.dev->ops = host;
  fx_close(&f);
}
END_TEST

/* A request past its quota while another session of its tenant caches
 * what it lacks is held, not refused, also when others of its priority
 * wait already (the path where a quota used to be refused before the
 * queue): its tenant's cache is asked, and the free that answers serves
 * it past the blocked head of the queue, which still does not fit. */
START_TEST(wait_quota_held_by_cache_when_queue_busy) {
  struct fx f;
  fx_open_ini(&f, "host:8MiB",
              "[broker]\ncompaction = off\n"
              "[tenant:q]\nuids = 1001\nquota = 4MiB\n");
  fx_hello(&f, "qa", 1001, "q");
  fx_hello(&f, "qb", 1001, "q");
  fx_hello(&f, "big", 1002, "");
  fx_hello(&f, "fill", 1003, "");
  fx_must_alloc(&f, "fill", 1003, 4 * MIB, 0);
  uint64_t slab = fx_must_alloc(&f, "qa", 1001, 4 * MIB, 0).u.alloc.id;
  struct wire_reply rep;
  ck_assert_int_eq(fx_alloc(&f, "big", 1002, 6 * MIB, 0, 60000, &rep), 0);
  ck_assert_int_eq(gmb__waitq_ahead(&f.b, 0), 1);
  /* qa's slab is all free in its cache, as its library reports it. */
  struct wire_request hb;
  memset(&hb, 0, sizeof hb);
  hb.kind = WIRE_HEARTBEAT;
  hb.cached_free = 4 * MIB;
  ck_assert_int_eq(fx_request(&f, "qa", 1001, &hb, &rep), 0);
  uint64_t refusals = fx_tenant(&f, "q")->refusals_quota;
  ck_assert_int_eq(fx_alloc(&f, "qb", 1001, 2 * MIB, 0, 60000, &rep), 0);
  uint64_t req_id = f.next_req - 1;
  const struct fx_sent *ask = fx_last_to(&f, "qa");
  ck_assert_ptr_nonnull(ask);
  ck_assert_int_eq(ask->rep.kind, WIRE_EVENT);
  ck_assert_int_eq(ask->rep.u.event.kind, WIRE_EVENT_TRIM);
  ck_assert_uint_eq(ask->rep.u.event.bytes, 2 * MIB);
  ck_assert_ptr_null(fx_last_to(&f, "qb"));
  ck_assert_int_eq(fx_free(&f, "qa", 1001, slab), 0);
  const struct fx_sent *got = fx_last_to(&f, "qb");
  ck_assert_ptr_nonnull(got);
  ck_assert_uint_eq(got->rep.id, req_id);
  ck_assert_msg(got->rep.status == 0, "%s", got->rep.message);
  ck_assert_uint_eq(got->rep.u.alloc.size, 2 * MIB);
  ck_assert_uint_eq(fx_tenant(&f, "q")->refusals_quota, refusals);
  ck_assert_ptr_null(fx_last_to(&f, "big"));
  ck_assert_uint_eq(f.b.waitq.n, 1);
  fx_close(&f);
}
END_TEST


/* --- the sessions' own VMM memory (Vmm) --------------------------------- */

/* Session rid reports `bytes` of VMM memory: the reply's status. */
static int fx_vmm(struct fx *f, const char *rid, uid_t uid, uint64_t bytes,
                  struct wire_reply *rep) {
  struct wire_request req;
  memset(&req, 0, sizeof req);
  req.kind = WIRE_VMM;
  req.u.vmm.bytes = bytes;
  ck_assert_int_eq(fx_request(f, rid, uid, &req, rep), 1);
  return rep->status;
}

/* Two sessions' VMM bytes and their allocations share the tenant's quota;
 * a refusal changes nothing; a report is a total (the same twice is no
 * change); less gives back; a session's end gives back all of its. */
START_TEST(vmm_charged_to_the_tenant) {
  struct fx f;
  fx_open_ini(&f, "host:64MiB",
              "[broker]\ncompaction = off\n[tenant:q]\nquota = 8MiB\n");
  struct gmb_session *a = fx_hello(&f, "a", 1001, "q");
  struct gmb_session *b = fx_hello(&f, "b", 1001, "q");
  struct gmb_tenant *t = a->tenant;
  fx_must_alloc(&f, "a", 1001, 2 * MIB, 0);
  struct wire_reply rep;
  ck_assert_int_eq(fx_vmm(&f, "a", 1001, 4 * MIB, &rep), 0);
  ck_assert_int_eq(rep.kind, WIRE_STATS);
  ck_assert_uint_eq(rep.u.stats.used, 6 * MIB);
  ck_assert_uint_eq(rep.u.stats.vmm, 4 * MIB);
  ck_assert_uint_eq(rep.u.stats.quota, 8 * MIB);
  ck_assert_uint_eq(t->used, 2 * MIB); /* the pool's part */
  ck_assert_uint_eq(t->vmm, 4 * MIB);
  ck_assert_uint_eq(t->peak, 6 * MIB);
  ck_assert_uint_eq(f.b.dev->external, 4 * MIB);
  /* b's 4 MiB more would pass the quota: refused, nothing changed. */
  uint64_t refusals = t->refusals_quota;
  ck_assert_int_eq(fx_vmm(&f, "b", 1001, 4 * MIB, &rep), GMB_E_QUOTA);
  ck_assert_ptr_nonnull(strstr(rep.message, "cuMemCreate"));
  ck_assert_ptr_nonnull(strstr(rep.message, "quota"));
  ck_assert_uint_eq(t->refusals_quota, refusals + 1);
  ck_assert_uint_eq(b->vmm, 0);
  ck_assert_uint_eq(t->vmm, 4 * MIB);
  ck_assert_uint_eq(f.b.dev->external, 4 * MIB);
  ck_assert_int_eq(fx_vmm(&f, "b", 1001, 2 * MIB, &rep), 0);
  ck_assert_int_eq(fx_vmm(&f, "b", 1001, 2 * MIB, &rep), 0); /* a retry */
  ck_assert_uint_eq(rep.u.stats.used, 8 * MIB);
  ck_assert_uint_eq(b->vmm, 2 * MIB);
  /* The quota is full: an allocation is refused for the VMM bytes. */
  ck_assert_int_eq(fx_alloc(&f, "a", 1001, 512, 0, 0, &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_QUOTA);
  ck_assert_ptr_nonnull(strstr(rep.message, "through cuMemCreate"));
  /* The admin row: used includes them, vmm says how much. */
  struct wire_tenant_row row;
  gmb__observe_tenant_row(t, &row);
  ck_assert_uint_eq(row.used, 8 * MIB);
  ck_assert_uint_eq(row.vmm, 6 * MIB);
  /* Less gives back at once. */
  ck_assert_int_eq(fx_vmm(&f, "a", 1001, MIB, &rep), 0);
  ck_assert_uint_eq(t->vmm, 3 * MIB);
  fx_must_alloc(&f, "a", 1001, 3 * MIB, 0);
  /* b's end gives back its 2 MiB, a's Bye the rest. */
  fx_end(&f, b);
  ck_assert_uint_eq(t->vmm, MIB);
  ck_assert_uint_eq(f.b.dev->external, MIB);
  ck_assert_int_eq(fx_plain(&f, "a", 1001, WIRE_BYE, &rep), 1);
  ck_assert_uint_eq(t->vmm, 0);
  ck_assert_uint_eq(t->used, 0);
  ck_assert_uint_eq(f.b.dev->external, 0);
  fx_close(&f);
}
END_TEST

/* VMM bytes take the device's room as segments do: past the room, past
 * the capacity (whatever the number) or into another tenant's reservation
 * they are refused with GMB_E_NOMEM and nothing changed; while held, new
 * segments find less room. */
START_TEST(vmm_takes_device_room) {
  struct fx f;
  fx_open_ini(&f, "host:16MiB",
              "[broker]\ncompaction = off\n"
              "[tenant:r]\nreserve = 6MiB\nuids = 2000\n");
  fx_hello(&f, "a", 1001, "");
  fx_hello(&f, "r", 2000, "r");
  struct gmb_session *a = session_of(&f, "a");
  struct wire_reply rep;
  ck_assert_int_eq(fx_vmm(&f, "a", 1001, UINT64_MAX, &rep), GMB_E_NOMEM);
  ck_assert_int_eq(fx_vmm(&f, "a", 1001, 17 * MIB, &rep), GMB_E_NOMEM);
  /* 16 - 6 kept for r: 10 MiB for a, not 12. */
  ck_assert_int_eq(fx_vmm(&f, "a", 1001, 12 * MIB, &rep), GMB_E_NOMEM);
  ck_assert_ptr_nonnull(strstr(rep.message, "tenant r's reservation"));
  ck_assert_uint_eq(a->vmm, 0);
  ck_assert_uint_eq(f.b.dev->in_use, 0);
  ck_assert_int_eq(fx_vmm(&f, "a", 1001, 10 * MIB, &rep), 0);
  ck_assert_uint_eq(f.b.dev->in_use, 10 * MIB);
  ck_assert_uint_eq(rep.u.stats.device_segments, 10 * MIB);
  /* r's reservation is whole; a's allocation finds no room. */
  fx_must_alloc(&f, "r", 2000, 6 * MIB, 0);
  ck_assert_int_eq(fx_alloc(&f, "a", 1001, 2 * MIB, 0, 0, &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_NOMEM);
  ck_assert_int_eq(fx_vmm(&f, "a", 1001, 8 * MIB, &rep), 0);
  fx_must_alloc(&f, "a", 1001, 2 * MIB, 0);
  fx_close(&f);
}
END_TEST

/* A Vmm increase held for its tenant's quota (the tenant's other session
 * caches what it lacks, and is asked for it) is served by whatever gives
 * the quota back first: here the other session's cuMemRelease (a smaller
 * Vmm total), before its cache answered.  The answer comes through the
 * sender, with the request's id, as the tenant's figures. */
START_TEST(vmm_held_served_by_other_release) {
  struct fx f;
  fx_open_ini(&f, "host:64MiB",
              "[broker]\ncompaction = off\n[tenant:q]\nquota = 8MiB\n");
  struct gmb_session *a = fx_hello(&f, "a", 1001, "q");
  struct gmb_session *b = fx_hello(&f, "b", 1001, "q");
  struct wire_reply rep;
  ck_assert_int_eq(fx_vmm(&f, "a", 1001, 2 * MIB, &rep), 0);
  fx_must_alloc(&f, "a", 1001, 4 * MIB, 0);
  struct wire_request hb;
  memset(&hb, 0, sizeof hb);
  hb.kind = WIRE_HEARTBEAT;
  hb.cached_free = 4 * MIB;
  ck_assert_int_eq(fx_request(&f, "a", 1001, &hb, &rep), 0);
  /* 6 held of 8: b's 4 lacks 2, which a's cache is asked for. */
  struct wire_request req;
  memset(&req, 0, sizeof req);
  req.kind = WIRE_VMM;
  req.u.vmm.bytes = 4 * MIB;
  memset(&rep, 0, sizeof rep);
  ck_assert_int_eq(fx_request(&f, "b", 1001, &req, &rep), 0);
  uint64_t r = f.next_req - 1;
  ck_assert_uint_eq(a->ask_bytes, 2 * MIB);
  ck_assert_int_eq(b->vmm_held, 1);
  ck_assert_uint_eq(b->vmm, 0);
  /* a releases its VMM memory: b fits the quota now. */
  ck_assert_int_eq(fx_vmm(&f, "a", 1001, 0, &rep), 0);
  const struct fx_sent *got = fx_last_to(&f, "b");
  ck_assert_ptr_nonnull(got);
  ck_assert_uint_eq(got->rep.id, r);
  ck_assert_msg(got->rep.status == 0, "%s", got->rep.message);
  ck_assert_int_eq(got->rep.kind, WIRE_STATS);
  ck_assert_uint_eq(got->rep.u.stats.vmm, 4 * MIB);
  ck_assert_uint_eq(b->vmm, 4 * MIB);
  ck_assert_int_eq(b->vmm_held, 0);
  ck_assert_uint_eq(f.b.dev->external, 4 * MIB);
  ck_assert_uint_eq(f.b.waitq.n, 0);
  fx_close(&f);
}
END_TEST

/* An empty segment that lingers (a's small one, after its free) is
 * released for VMM bytes that need its room, as for an allocation. */
START_TEST(vmm_releases_lingering_segment) {
  struct fx f;
  fx_open_ini(&f, "host:8MiB", "[broker]\ncompaction = off\n");
  fx_hello(&f, "a", 1001, "");
  fx_hello(&f, "b", 1002, "");
  fx_must_alloc(&f, "a", 1001, 6 * MIB, 0);
  struct wire_reply rep = fx_must_alloc(&f, "a", 1001, 4096, 0);
  ck_assert_int_eq(fx_free(&f, "a", 1001, rep.u.alloc.id), 0);
  ck_assert_uint_eq(f.b.dev->in_use, 8 * MIB);
  ck_assert_int_eq(fx_vmm(&f, "b", 1002, 2 * MIB, &rep), 0);
  ck_assert_uint_eq(f.b.dev->external, 2 * MIB);
  ck_assert_uint_eq(f.b.dev->in_use, 8 * MIB);
  fx_close(&f);
}
END_TEST

static Suite *dispatch_suite(void) {
  Suite *s = suite_create("dispatch");
  TCase *tc = tcase_create("hello");
  tcase_add_test(tc, hello_default_tenant_is_uid_name);
  tcase_add_test(tc, hello_wrong_version);
  tcase_add_test(tc, hello_twice_on_one_connection);
  tcase_add_test(tc, hello_uid_not_listed_refused);
  tcase_add_test(tc, hello_unbound_tenant_owned_by_first_uid);
  tcase_add_test(tc, hello_bad_tenant_name);
  tcase_add_test(tc, hello_secret_per_session_nothing_named);
  tcase_add_test(tc, request_before_hello);
  tcase_add_test(tc, credentials_checked_per_message);
  tcase_add_test(tc, admin_kind_is_not_a_client_request);
  suite_add_tcase(s, tc);

  tc = tcase_create("alloc");
  tcase_add_test(tc, alloc_zero);
  tcase_add_test(tc, alloc_size_overflows_when_rounded);
  tcase_add_test(tc, alloc_larger_than_device);
  tcase_add_test(tc, alloc_unknown_flags);
  tcase_add_test(tc, quota_exact_limit);
  tcase_add_test(tc, quota_shared_by_sessions_of_a_tenant);
  tcase_add_test(tc, alloc_reply_names_segment_only);
  tcase_add_test(tc, alloc_movable_gets_slot);
  tcase_add_test(tc, alloc_movable_lock_table_full);
  tcase_add_test(tc, alloc_nomem_full_device);
  tcase_add_test(tc, alloc_nomem_explanations_walk_a_few_times_a_second);
  tcase_add_test(tc, alloc_nomem_fragmented);
  tcase_add_test(tc, alloc_nomem_names_each_holder_once);
  tcase_add_test(tc, alloc_nomem_for_reservation);
  tcase_add_test(tc, alloc_during_operator_run_gets_a_run_of_its_own);
  suite_add_tcase(s, tc);

  tc = tcase_create("free");
  tcase_add_test(tc, free_own);
  tcase_add_test(tc, free_others_id_is_noent);
  tcase_add_test(tc, free_twice);
  tcase_add_test(tc, pages_in_one_request_and_freed_in_one);
  tcase_add_test(tc, pages_all_or_none);
  suite_add_tcase(s, tc);

  tc = tcase_create("stats");
  tcase_add_test(tc, stats_used_peak_quota);
  tcase_add_test(tc, stats_walk_no_tenant);
  suite_add_tcase(s, tc);

  tc = tcase_create("vmm");
  tcase_add_test(tc, vmm_charged_to_the_tenant);
  tcase_add_test(tc, vmm_takes_device_room);
  tcase_add_test(tc, vmm_held_served_by_other_release);
  tcase_add_test(tc, vmm_releases_lingering_segment);
  suite_add_tcase(s, tc);

  tc = tcase_create("heartbeat_bye");
  tcase_add_test(tc, heartbeat_and_segment_closed_have_no_reply);
  tcase_add_test(tc, bye_ends_session_and_frees);
  suite_add_tcase(s, tc);

  tc = tcase_create("wait");
  tcase_add_test(tc, wait_served_after_free);
  tcase_add_test(tc, wait_times_out);
  tcase_add_test(tc, wait_forever_never_expires);
  tcase_add_test(tc, wait_does_not_hold_back_no_wait_request);
  tcase_add_test(tc, wait_ends_with_bye_of_waiter);
  tcase_add_test(tc, wait_quota_held_by_cache_when_queue_busy);
  suite_add_tcase(s, tc);

  tc = tcase_create("issue12");
  tcase_add_test(tc, default_tenant_not_squatted);
  tcase_add_test(tc, wait_larger_than_device_refused);
  tcase_add_test(tc, reload_configured_name_ends_squatter);
  tcase_add_test(tc, sessions_capped_per_uid_and_total);
  tcase_add_test(tc, fd_limit_raised_or_sessions_lowered);
  tcase_add_test(tc, fd_split_shares_out_the_limit);
  tcase_add_test(tc, fd_limit_1024_admits_many_sessions);
  tcase_add_test(tc, default_tenants_reaped_and_capped);
  tcase_add_test(tc, default_tenant_reap_visits_only_listed);
  tcase_add_test(tc, registry_full_idle_make_room);
  tcase_add_test(tc, registry_full_refusals_walk_a_few_times_a_second);
  tcase_add_test(tc, waiters_capped_per_session_and_tenant);
  tcase_add_test(tc, reload_reservations_over_device_refused);
  tcase_add_test(tc, start_check_counts_state_file);
  tcase_add_test(tc, evict_sets_word_and_retires_segments);
  tcase_add_test(tc, retiring_counts_against_quota);
  tcase_add_test(tc, retired_by_the_pools_room_making_refused_not_aborted);
  tcase_add_test(tc, retired_sibling_passes_the_uid_budget_refused_not_aborted);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) { return check_run(dispatch_suite()); }
