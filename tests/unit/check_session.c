/*
 * check_session.c - the session table (session.h) and the end of a session
 * (gmb__core_session_end, core.h), with a whole broker on a host device
 * (broker_fixture.h).
 *
 * Covers finding sessions by routing id (ids of different lengths, one a
 * prefix of another, bytes that are not text), the table's count and
 * generation, visiting every session while ending them, watching the
 * client's process (pidfd) or asking for heartbeats, the sorted set of
 * segments a session was given, its descriptor channel and secret (a
 * fresh secret per session; the channel closed with the session), and
 * each step of ending a session: its allocations freed and uncharged, its
 * lock table destroyed (its memfd closed, a client's mapping still its
 * own), its waiters
 * dropped without a reply, others' waiters served with the memory that
 * came back, its tenant's list of sessions kept whole whichever session
 * goes, and the segments retired meanwhile announced only to those that
 * stay.  Last, the lock-table slot of an allocation and whether its client
 * holds it locked.  Every test ends with fx_close(), which requires the
 * pool and the tenants to be consistent.
 */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <inttypes.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "alloc.h"
#include "broker_fixture.h"
#include "core.h"
#include "check_main.h"
#include "locktab.h"
#include "pool.h"
#include "tenant.h"
#include "util.h"
#include "waitq.h"

#define MIB GMB_MIB

/* A session made by the table alone, without Hello (so without a lock
 * table), for routing id `rid` of `len` bytes in uid's default tenant. */
static struct gmb_session *raw_session(struct fx *f, const void *rid,
                                       size_t len, uid_t uid, pid_t pid) {
  struct gmb_tenant *t = NULL;
  char why[256];
  ck_assert_msg(gmb__tenant_admit(f->b.tenants, "", uid, NULL, 0, &t, why,
                                  sizeof why) == 0, "admit: %s", why);
  struct gmb_peer p = {.rid = rid, .rid_len = len, .uid = uid, .gid = uid,
                       .pid = pid};
  return gmb__session_new(&f->b, &p, t, "raw");
}

static struct gmb_session *find(struct fx *f, const void *rid, size_t len) {
  return gmb__session_find(f->b.sessions, rid, len);
}


/* The tenant's list of sessions, walked both ways, must hold exactly n
 * sessions with consistent links; returns the head. */
static struct gmb_session *check_tenant_list(const struct gmb_tenant *t,
                                             unsigned n) {
  ck_assert_uint_eq(t->n_sessions, n);
  unsigned count = 0;
  const struct gmb_session *prev = NULL;
  for (struct gmb_session *s = t->sessions; s; s = s->tenant_next) {
    ck_assert_ptr_eq(s->tenant, t);
    ck_assert_ptr_eq(s->tenant_prev, prev);
    prev = s;
    ck_assert_uint_le(++count, n);
  }
  ck_assert_uint_eq(count, n);
  return t->sessions;
}

static int tenant_has(const struct gmb_tenant *t, const struct gmb_session *x) {
  for (struct gmb_session *s = t->sessions; s; s = s->tenant_next)
    if (s == x) return 1;
  return 0;
}

/* 1 when descriptor fd is open and is the memfd called `name` (a
 * descriptor number alone may be reused by the next open). */
static int fd_is_memfd(int fd, const char *name) {
  char path[64], link[256], want[128];
  snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
  ssize_t n = readlink(path, link, sizeof link - 1);
  if (n < 0) return 0;
  link[n] = '\0';
  snprintf(want, sizeof want, "/memfd:%s ", name);
  return strncmp(link, want, strlen(want)) == 0;
}

static int pidfd_works(void) {
#ifdef SYS_pidfd_open
  int fd = (int)syscall(SYS_pidfd_open, getpid(), 0);
  if (fd < 0) return 0;
  close(fd);
  return 1;
#else
  return 0;
#endif
}

/* --- the table -------------------------------------------------------- */

START_TEST(find_by_routing_id) {
  struct fx f;
  fx_open(&f);
  /* Prefixes of each other, equal bytes of different lengths, NULs. */
  static const struct {
    const char *rid;
    size_t len;
  } ids[] = {{"a", 1},    {"ab", 2},     {"abc", 3},   {"b", 1},
             {"\0", 1},   {"\0\0", 2},   {"a\0", 2},   {"\xff", 1},
             {"\xff\xff\xff\xff\xff", 5}};
  enum { N = sizeof ids / sizeof ids[0] };
  struct gmb_session *s[N];
  for (size_t i = 0; i < N; i++) {
    s[i] = raw_session(&f, ids[i].rid, ids[i].len, 1001, 0);
    ck_assert_ptr_nonnull(s[i]);
    ck_assert_uint_eq(s[i]->rid_len, ids[i].len);
    ck_assert_mem_eq(s[i]->rid, ids[i].rid, ids[i].len);
  }
  ck_assert_uint_eq(gmb__sessions_count(f.b.sessions), N);
  for (size_t i = 0; i < N; i++)
    ck_assert_ptr_eq(find(&f, ids[i].rid, ids[i].len), s[i]);
  /* Neighbours of each id are none of them. */
  ck_assert_ptr_null(find(&f, "", 0));
  ck_assert_ptr_null(find(&f, "abcd", 4));
  ck_assert_ptr_null(find(&f, "ac", 2));
  ck_assert_ptr_null(find(&f, "A", 1));
  ck_assert_ptr_null(find(&f, "\0\0\0", 3));
  ck_assert_ptr_null(find(&f, "b\0", 2));
  ck_assert_ptr_null(find(&f, "\xff\xff", 2));
  /* Ending one leaves the others findable. */
  fx_end(&f, s[1]); /* "ab", between "a" and "abc" */
  ck_assert_ptr_null(find(&f, "ab", 2));
  ck_assert_ptr_eq(find(&f, "a", 1), s[0]);
  ck_assert_ptr_eq(find(&f, "abc", 3), s[2]);
  ck_assert_uint_eq(gmb__sessions_count(f.b.sessions), N - 1);
  fx_close(&f);
}
END_TEST

START_TEST(new_copies_what_it_is_given) {
  struct fx f;
  fx_open(&f);
  char rid[8] = "client";
  struct gmb_session *s = raw_session(&f, rid, 6, 1001, 0);
  ck_assert_ptr_nonnull(s);
  memcpy(rid, "CLIENT", 6); /* the caller's buffer is the message's */
  ck_assert_ptr_eq(find(&f, "client", 6), s);
  ck_assert_ptr_null(find(&f, "CLIENT", 6));
  ck_assert_uint_eq(s->uid, 1001);
  ck_assert_uint_eq(s->gid, 1001);
  ck_assert_int_eq(s->pid, 0);
  ck_assert_int_eq(s->pidfd, -1); /* pid unknown: heartbeats */
  ck_assert_str_eq(s->client, "raw");
  ck_assert_str_eq(s->tenant->name, "uid-1001");
  ck_assert_uint_eq(s->n_segs, 0);
  ck_assert_uint_eq(s->allocations, 0);
  ck_assert_ptr_null(s->lt);
  ck_assert_uint_gt(s->last_seen_ns, 0);
  /* Ids grow; a NULL client name is an empty one; a long one is cut. */
  struct gmb_tenant *t = s->tenant;
  struct gmb_peer p = {.rid = (const uint8_t *)"x", .rid_len = 1,
                       .uid = 1001, .gid = 7, .pid = 0};
  struct gmb_session *s2 = gmb__session_new(&f.b, &p, t, NULL);
  ck_assert_ptr_nonnull(s2);
  ck_assert_uint_gt(s2->id, s->id);
  ck_assert_str_eq(s2->client, "");
  ck_assert_uint_eq(s2->gid, 7);
  char longname[200];
  memset(longname, 'n', sizeof longname - 1);
  longname[sizeof longname - 1] = '\0';
  p.rid = (const uint8_t *)"y";
  struct gmb_session *s3 = gmb__session_new(&f.b, &p, t, longname);
  ck_assert_ptr_nonnull(s3);
  ck_assert_uint_eq(strlen(s3->client), sizeof s3->client - 1);
  check_tenant_list(t, 3);
  fx_close(&f);
}
END_TEST

START_TEST(new_watches_a_live_pid) {
  if (!pidfd_works()) return; /* kernel without pidfd_open: heartbeats */
  struct fx f;
  fx_open(&f);
  struct gmb_session *s = raw_session(&f, "me", 2, 1001, getpid());
  ck_assert_ptr_nonnull(s);
  ck_assert_int_eq(s->pid, getpid());
  int fd = s->pidfd;
  ck_assert_int_ge(fd, 0);
  ck_assert_int_ne(fcntl(fd, F_GETFD), -1);
  /* The pidfd closes with the session. */
  fx_end(&f, s);
  errno = 0;
  ck_assert_int_eq(fcntl(fd, F_GETFD), -1);
  ck_assert_int_eq(errno, EBADF);
  fx_close(&f);
}
END_TEST

START_TEST(new_for_a_dead_pid_is_esrch) {
  if (!pidfd_works()) return;
  struct fx f;
  fx_open(&f);
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0) _exit(0);
  int st;
  ck_assert_int_eq(waitpid(pid, &st, 0), pid);
  uint64_t gen = gmb__sessions_gen(f.b.sessions);
  errno = 0;
  ck_assert_ptr_null(raw_session(&f, "gone", 4, 1001, pid));
  ck_assert_int_eq(errno, ESRCH);
  ck_assert_uint_eq(gmb__sessions_count(f.b.sessions), 0);
  ck_assert_uint_eq(gmb__sessions_gen(f.b.sessions), gen);
  ck_assert_uint_eq(fx_tenant(&f, "uid-1001")->n_sessions, 0);
  ck_assert_ptr_null(fx_tenant(&f, "uid-1001")->sessions);
  /* Through Hello: no session and no reply (nobody to answer). */
  struct wire_request req;
  memset(&req, 0, sizeof req);
  req.kind = WIRE_HELLO;
  req.u.hello.version = WIRE_PROTOCOL_VERSION;
  struct gmb_peer p = {.rid = (const uint8_t *)"gone", .rid_len = 4,
                       .uid = 1001, .gid = 1001, .pid = pid};
  struct wire_reply rep;
  ck_assert_int_eq(gmb__dispatch(&f.b, &p, &req, &rep), 0);
  ck_assert_uint_eq(gmb__sessions_count(f.b.sessions), 0);
  ck_assert_uint_eq(f.n_sent, 0);
  fx_close(&f);
}
END_TEST

START_TEST(gen_changes_on_add_and_remove) {
  struct fx f;
  fx_open(&f);
  uint64_t g0 = gmb__sessions_gen(f.b.sessions);
  ck_assert_uint_eq(gmb__sessions_count(f.b.sessions), 0);
  struct gmb_session *a = fx_hello(&f, "a", 1001, "");
  uint64_t g1 = gmb__sessions_gen(f.b.sessions);
  ck_assert_uint_ne(g1, g0);
  struct gmb_session *b = raw_session(&f, "b", 1, 1002, 0);
  uint64_t g2 = gmb__sessions_gen(f.b.sessions);
  ck_assert_uint_ne(g2, g1);
  ck_assert_uint_ne(g2, g0);
  ck_assert_uint_eq(gmb__sessions_count(f.b.sessions), 2);
  /* Requests, allocations and refused Hellos are not comings or goings. */
  fx_must_alloc(&f, "a", 1001, MIB, 0);
  struct wire_reply rep;
  ck_assert_int_eq(fx_hello_as(&f, "a", 1001, "", WIRE_PROTOCOL_VERSION,
                               &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_PROTO);
  ck_assert_uint_eq(gmb__sessions_gen(f.b.sessions), g2);
  fx_end(&f, a);
  uint64_t g3 = gmb__sessions_gen(f.b.sessions);
  ck_assert_uint_ne(g3, g2);
  ck_assert_uint_eq(gmb__sessions_count(f.b.sessions), 1);
  fx_end(&f, b);
  uint64_t g4 = gmb__sessions_gen(f.b.sessions);
  ck_assert_uint_ne(g4, g3);
  /* Back to no sessions is not back to the first generation. */
  ck_assert_uint_ne(g4, g0);
  ck_assert_uint_eq(gmb__sessions_count(f.b.sessions), 0);
  fx_close(&f);
}
END_TEST

/* Each session gets its own random secret for the descriptor channel,
 * and no channel until it proves itself there. */
START_TEST(new_has_secret_and_no_channel) {
  struct fx f;
  fx_open(&f);
  enum { N = 8 };
  struct gmb_session *s[N];
  static const uint8_t zero[GMB_FD_SECRET_LEN];
  for (int i = 0; i < N; i++) {
    char rid[8];
    snprintf(rid, sizeof rid, "r%d", i);
    s[i] = raw_session(&f, rid, strlen(rid), 1001, 0);
    ck_assert_ptr_nonnull(s[i]);
    ck_assert_int_eq(s[i]->fdconn, -1);
    ck_assert_int_ne(memcmp(s[i]->secret, zero, GMB_FD_SECRET_LEN), 0);
    for (int j = 0; j < i; j++)
      ck_assert_int_ne(memcmp(s[i]->secret, s[j]->secret, GMB_FD_SECRET_LEN),
                       0);
  }
  fx_close(&f);
}
END_TEST

START_TEST(by_id) {
  struct fx f;
  fx_open(&f);
  struct gmb_session *a = fx_hello(&f, "a", 1001, "");
  struct gmb_session *b = raw_session(&f, "b", 1, 1002, 0);
  struct gmb_session *c = fx_hello(&f, "c", 1001, "");
  ck_assert_ptr_eq(gmb__session_by_id(f.b.sessions, a->id), a);
  ck_assert_ptr_eq(gmb__session_by_id(f.b.sessions, b->id), b);
  ck_assert_ptr_eq(gmb__session_by_id(f.b.sessions, c->id), c);
  /* Ids that no session has: 0, past the last, and one that ended. */
  ck_assert_ptr_null(gmb__session_by_id(f.b.sessions, 0));
  ck_assert_ptr_null(gmb__session_by_id(f.b.sessions, c->id + 1));
  ck_assert_ptr_null(gmb__session_by_id(f.b.sessions, UINT64_MAX));
  uint64_t bid = b->id;
  fx_end(&f, b);
  ck_assert_ptr_null(gmb__session_by_id(f.b.sessions, bid));
  ck_assert_ptr_eq(gmb__session_by_id(f.b.sessions, a->id), a);
  ck_assert_ptr_eq(gmb__session_by_id(f.b.sessions, c->id), c);
  fx_close(&f);
}
END_TEST

/* The session owns its channel's descriptor from set_fdconn on (the loop
 * polls it: the generation changes) and closes it when it ends: the peer
 * sees the hang-up. */
START_TEST(fdconn_owned_and_closed_at_end) {
  struct fx f;
  fx_open(&f);
  struct gmb_session *a = fx_hello(&f, "a", 1001, "");
  int sv[2];
  ck_assert_int_eq(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv),
                   0);
  uint64_t gen = gmb__sessions_gen(f.b.sessions);
  gmb__session_set_fdconn(f.b.sessions, a, sv[0]);
  ck_assert_int_eq(a->fdconn, sv[0]);
  ck_assert_uint_ne(gmb__sessions_gen(f.b.sessions), gen);
  ck_assert_uint_eq(gmb__sessions_count(f.b.sessions), 1);
  fx_end(&f, a);
  char byte;
  ck_assert_int_eq(recv(sv[1], &byte, 1, MSG_DONTWAIT), 0); /* EOF */
  close(sv[1]);
  fx_close(&f);
}
END_TEST

struct visit {
  struct fx *f;
  size_t n;
  char seen[16][8];
  int end_every; /* 0: none; k: end every k-th visited */
};

static void visit_fn(void *ctx, struct gmb_session *s) {
  struct visit *v = ctx;
  ck_assert_uint_lt(v->n, 16);
  snprintf(v->seen[v->n], sizeof v->seen[v->n], "%.*s", (int)s->rid_len,
           (const char *)s->rid);
  v->n++;
  if (v->end_every && v->n % (size_t)v->end_every == 0)
    gmb__core_session_end(&v->f->b, s, "visited");
}

START_TEST(each_visits_every_session_once) {
  struct fx f;
  fx_open(&f);
  static const char *const rids[] = {"c", "a", "bb", "b", "ab"};
  for (size_t i = 0; i < 5; i++) fx_hello(&f, rids[i], 1001, "");
  struct visit v = {.f = &f};
  gmb__sessions_each(f.b.sessions, visit_fn, &v);
  ck_assert_uint_eq(v.n, 5);
  /* In routing id order. */
  static const char *const sorted[] = {"a", "ab", "b", "bb", "c"};
  for (size_t i = 0; i < 5; i++) ck_assert_str_eq(v.seen[i], sorted[i]);
  ck_assert_uint_eq(gmb__sessions_count(f.b.sessions), 5);
  fx_close(&f);
}
END_TEST

START_TEST(each_may_end_every_session) {
  struct fx f;
  fx_open(&f);
  static const char *const rids[] = {"c", "a", "bb", "b", "ab", "d"};
  for (size_t i = 0; i < 6; i++) {
    fx_hello(&f, rids[i], 1001 + (uid_t)(i % 2), "");
    fx_must_alloc(&f, rids[i], 1001 + (uid_t)(i % 2), MIB, i % 3 ? GMB_MOVABLE
                                                             : 0);
  }
  struct visit v = {.f = &f, .end_every = 1};
  gmb__sessions_each(f.b.sessions, visit_fn, &v);
  ck_assert_uint_eq(v.n, 6);
  ck_assert_uint_eq(gmb__sessions_count(f.b.sessions), 0);
  ck_assert_int_eq(gmb__core_check(&f.b), 0);
  struct gmb_tenant *t1 = fx_tenant(&f, "uid-1001");
  struct gmb_tenant *t2 = fx_tenant(&f, "uid-1002");
  ck_assert_uint_eq(t1->used, 0);
  ck_assert_uint_eq(t2->used, 0);
  check_tenant_list(t1, 0);
  check_tenant_list(t2, 0);
  /* Visiting an empty table visits nothing. */
  struct visit none = {.f = &f};
  gmb__sessions_each(f.b.sessions, visit_fn, &none);
  ck_assert_uint_eq(none.n, 0);
  fx_close(&f);
}
END_TEST

START_TEST(each_may_end_some_sessions) {
  struct fx f;
  fx_open(&f);
  static const char *const rids[] = {"a", "b", "c", "d", "e", "f", "g"};
  for (size_t i = 0; i < 7; i++) fx_hello(&f, rids[i], 1001, "");
  struct visit v = {.f = &f, .end_every = 2}; /* b, d, f */
  gmb__sessions_each(f.b.sessions, visit_fn, &v);
  ck_assert_uint_eq(v.n, 7);
  ck_assert_uint_eq(gmb__sessions_count(f.b.sessions), 4);
  for (size_t i = 0; i < 7; i++) {
    struct gmb_session *s = find(&f, rids[i], 1);
    if (i % 2)
      ck_assert_ptr_null(s);
    else
      ck_assert_ptr_nonnull(s);
  }
  check_tenant_list(fx_tenant(&f, "uid-1001"), 4);
  fx_close(&f);
}
END_TEST

/* --- segments a session was given ------------------------------------- */

static void check_segs_sorted(const struct gmb_session *s) {
  for (size_t i = 1; i < s->n_segs; i++)
    ck_assert_uint_lt(s->segs[i - 1], s->segs[i]);
  ck_assert_uint_le(s->n_segs, s->cap_segs);
}

START_TEST(seg_seen_sorted_and_once) {
  struct fx f;
  fx_open(&f);
  struct gmb_session *s = raw_session(&f, "a", 1, 1001, 0);
  ck_assert_int_eq(gmb__session_seg_seen(s, 5), 0);
  ck_assert_int_eq(gmb__session_seg_seen(s, 5), 1);
  ck_assert_uint_eq(s->n_segs, 1);
  /* Enough values, in no order, with duplicates, to grow the array a few
   * times; the ends of the range too. */
  uint64_t x = 12345;
  size_t fresh = 1;
  for (int i = 0; i < 100; i++) {
    x = x * 6364136223846793005u + 1442695040888963407u;
    uint64_t seg = (x >> 33) % 40; /* many repeats */
    int had = 0;
    for (size_t j = 0; j < s->n_segs; j++) had |= s->segs[j] == seg;
    ck_assert_int_eq(gmb__session_seg_seen(s, seg), had);
    fresh += !had;
    ck_assert_uint_eq(s->n_segs, fresh);
    check_segs_sorted(s);
  }
  ck_assert_int_eq(gmb__session_seg_seen(s, UINT64_MAX), 0);
  ck_assert_int_eq(gmb__session_seg_seen(s, 0), s->segs[0] == 0);
  ck_assert_int_eq(gmb__session_seg_seen(s, UINT64_MAX), 1);
  check_segs_sorted(s);
  ck_assert_uint_eq(s->segs[s->n_segs - 1], UINT64_MAX);
  ck_assert_uint_eq(s->segs[0], 0);
  ck_assert_uint_gt(s->cap_segs, 8);
  fx_close(&f);
}
END_TEST

START_TEST(seg_forget) {
  struct fx f;
  fx_open(&f);
  struct gmb_session *s = raw_session(&f, "a", 1, 1001, 0);
  /* Nothing recorded yet. */
  ck_assert_int_eq(gmb__session_seg_forget(s, 0), 0);
  ck_assert_int_eq(gmb__session_seg_forget(s, 7), 0);
  for (uint64_t seg = 10; seg <= 100; seg += 10)
    ck_assert_int_eq(gmb__session_seg_seen(s, seg), 0);
  ck_assert_uint_eq(s->n_segs, 10);
  /* Unknown: below, between, above. */
  ck_assert_int_eq(gmb__session_seg_forget(s, 5), 0);
  ck_assert_int_eq(gmb__session_seg_forget(s, 55), 0);
  ck_assert_int_eq(gmb__session_seg_forget(s, 101), 0);
  ck_assert_uint_eq(s->n_segs, 10);
  /* First, last, middle; each once. */
  ck_assert_int_eq(gmb__session_seg_forget(s, 10), 1);
  ck_assert_int_eq(gmb__session_seg_forget(s, 10), 0);
  ck_assert_int_eq(gmb__session_seg_forget(s, 100), 1);
  ck_assert_int_eq(gmb__session_seg_forget(s, 50), 1);
  ck_assert_uint_eq(s->n_segs, 7);
  check_segs_sorted(s);
  static const uint64_t left[] = {20, 30, 40, 60, 70, 80, 90};
  for (size_t i = 0; i < 7; i++) ck_assert_uint_eq(s->segs[i], left[i]);
  /* A forgotten segment may be given again, and is new then. */
  ck_assert_int_eq(gmb__session_seg_seen(s, 50), 0);
  ck_assert_int_eq(gmb__session_seg_seen(s, 50), 1);
  for (size_t i = 0; i < 7; i++)
    ck_assert_int_eq(gmb__session_seg_forget(s, left[i]), 1);
  ck_assert_int_eq(gmb__session_seg_forget(s, 50), 1);
  ck_assert_uint_eq(s->n_segs, 0);
  ck_assert_int_eq(gmb__session_seg_forget(s, 50), 0);
  fx_close(&f);
}
END_TEST

/* --- ending a session ------------------------------------------------- */

START_TEST(end_frees_and_uncharges) {
  struct fx f;
  fx_open(&f);
  struct gmb_session *a = fx_hello(&f, "a", 1001, "");
  fx_hello(&f, "a2", 1001, "");
  fx_hello(&f, "b", 1002, "");
  struct gmb_tenant *t = a->tenant;
  uint64_t ids[4];
  ids[0] = fx_must_alloc(&f, "a", 1001, MIB, 0).u.alloc.id;
  ids[1] = fx_must_alloc(&f, "a", 1001, 1000, GMB_MOVABLE).u.alloc.id;
  ids[2] = fx_must_alloc(&f, "a", 1001, 5 * MIB, GMB_MOVABLE).u.alloc.id;
  ids[3] = fx_must_alloc(&f, "a", 1001, 3 * MIB, 0).u.alloc.id;
  uint64_t keep = fx_must_alloc(&f, "a2", 1001, 4096, 0).u.alloc.id;
  uint64_t other = fx_must_alloc(&f, "b", 1002, MIB, 0).u.alloc.id;
  ck_assert_uint_eq(a->allocations, 4);
  ck_assert_uint_eq(t->used, 9 * MIB + 1024 + 4096);
  uint64_t peak = t->peak, ops = f.b.pool_ops;
  struct gmb_pool_stats ps;
  gmb__pool_stats(f.b.pool, &ps);
  ck_assert_uint_eq(ps.allocations, 6);
  fx_end(&f, a);
  ck_assert_ptr_null(find(&f, "a", 1));
  ck_assert_uint_eq(t->used, 4096);
  ck_assert_uint_eq(t->peak, peak);
  ck_assert_uint_eq(f.b.pool_ops, ops + 1);
  for (int i = 0; i < 4; i++)
    ck_assert_int_eq(gmb__pool_find(f.b.pool, ids[i], NULL), GMB_E_NOENT);
  ck_assert_int_eq(gmb__pool_find(f.b.pool, keep, NULL), 0);
  ck_assert_int_eq(gmb__pool_find(f.b.pool, other, NULL), 0);
  gmb__pool_stats(f.b.pool, &ps);
  ck_assert_uint_eq(ps.allocations, 2);
  ck_assert_uint_eq(ps.used, 4096 + MIB);
  ck_assert_uint_eq(fx_tenant(&f, "uid-1002")->used, MIB);
  fx_end(&f, find(&f, "b", 1));
  fx_end(&f, find(&f, "a2", 2));
  ck_assert_uint_eq(t->used, 0);
  fx_close(&f);
}
END_TEST

START_TEST(end_destroys_lock_table) {
  struct fx f;
  fx_open(&f);
  /* The table is a memfd of the broker's until the session ends; then
   * the broker's descriptor is closed (and nothing was ever named). */
  int shm_before = fx_shm_names();
  struct gmb_session *a = fx_hello(&f, "a", 1001, "");
  int fd = gmb__locktab_fd(a->lt);
  char name[64];
  snprintf(name, sizeof name, "gmb-lt-%" PRIu64, a->id);
  ck_assert_int_eq(fd_is_memfd(fd, name), 1);
  /* A client's mapping (made from the descriptor) outlives the session. */
  struct gmb__lt_header *ha = fx_map_locktab(a);
  uint64_t id = a->id;
  int fds = fx_count_fds();
  fx_end(&f, a);
  ck_assert_int_eq(fd_is_memfd(fd, name), 0);
  ck_assert_int_eq(fx_count_fds(), fds - 1);
  ck_assert_uint_eq(ha->magic, GMB_LT_MAGIC);
  ck_assert_uint_eq(ha->session, id);
  fx_unmap_locktab(ha);
  ck_assert_int_eq(fx_shm_names(), shm_before);
  /* Ended while its client holds a movable allocation locked: the lock
   * dies with the session, and the memory is freed all the same. */
  struct gmb_session *b = fx_hello(&f, "b", 1001, "");
  struct gmb__lt_header *h = fx_map_locktab(b);
  struct wire_reply r = fx_must_alloc(&f, "b", 1001, MIB, GMB_MOVABLE);
  struct gmb__lt_slot *slot = &gmb__lt_slots(h)[r.u.alloc.slot];
  ck_assert_uint_eq(slot->id, r.u.alloc.id);
  atomic_fetch_add(&slot->state, 1);
  struct gmb_alloc_info info;
  ck_assert_int_eq(gmb__pool_find(f.b.pool, r.u.alloc.id, &info), 0);
  ck_assert_int_eq(gmb__session_alloc_locked(&info), 1);
  struct gmb_tenant *t = b->tenant;
  fx_end(&f, b);
  ck_assert_uint_eq(t->used, 0);
  ck_assert_int_eq(gmb__pool_find(f.b.pool, r.u.alloc.id, NULL), GMB_E_NOENT);
  fx_unmap_locktab(h);
  fx_close(&f);
}
END_TEST

START_TEST(end_drops_own_waiters) {
  struct fx f;
  fx_open_small(&f);
  fx_hello(&f, "a", 1001, "");
  struct gmb_session *b = fx_hello(&f, "b", 1002, "");
  struct gmb_tenant *tb = b->tenant;
  uint64_t big = fx_must_alloc(&f, "a", 1001, 8 * MIB, 0).u.alloc.id;
  struct wire_reply rep;
  ck_assert_int_eq(fx_alloc(&f, "b", 1002, MIB, 0, 60000, &rep), 0);
  ck_assert_int_eq(fx_alloc(&f, "b", 1002, 2 * MIB, GMB_MOVABLE, -1, &rep), 0);
  ck_assert_uint_eq(f.b.waitq.n, 2);
  ck_assert_uint_eq(tb->waiting, 2);
  size_t sent = f.n_sent;
  fx_end(&f, b);
  ck_assert_uint_eq(f.b.waitq.n, 0);
  ck_assert_ptr_null(f.b.waitq.head);
  ck_assert_ptr_null(f.b.waitq.tail);
  ck_assert_uint_eq(tb->waiting, 0);
  ck_assert_uint_eq(f.n_sent, sent); /* no reply: it is gone */
  /* The memory that comes back goes to nobody; expiry finds nothing. */
  ck_assert_int_eq(fx_free(&f, "a", 1001, big), 0);
  ck_assert_uint_eq(gmb__waitq_expire(&f.b, UINT64_MAX - 1), UINT64_MAX);
  ck_assert_ptr_null(fx_last_to(&f, "b"));
  ck_assert_uint_eq(tb->used, 0);
  fx_close(&f);
}
END_TEST

START_TEST(end_serves_others_waiters) {
  struct fx f;
  fx_open_small(&f);
  struct gmb_session *a = fx_hello(&f, "a", 1001, "");
  struct gmb_session *b = fx_hello(&f, "b", 1002, "");
  fx_must_alloc(&f, "a", 1001, 4 * MIB, 0);
  fx_must_alloc(&f, "a", 1001, 4 * MIB, GMB_MOVABLE);
  struct wire_reply rep;
  ck_assert_int_eq(fx_alloc(&f, "b", 1002, 6 * MIB, 0, 60000, &rep), 0);
  uint64_t req_id = f.next_req - 1;
  ck_assert_ptr_null(fx_last_to(&f, "b"));
  fx_end(&f, a);
  const struct fx_sent *got = fx_last_to(&f, "b");
  ck_assert_ptr_nonnull(got);
  ck_assert_uint_eq(got->rep.id, req_id);
  ck_assert_int_eq(got->rep.status, 0);
  ck_assert_int_eq(got->rep.kind, WIRE_ALLOC);
  ck_assert_uint_eq(got->rep.u.alloc.size, 6 * MIB);
  ck_assert_uint_eq(f.b.waitq.n, 0);
  ck_assert_uint_eq(b->tenant->waiting, 0);
  ck_assert_uint_eq(b->tenant->used, 6 * MIB);
  ck_assert_uint_eq(b->allocations, 1);
  /* Nothing went to the session that ended. */
  ck_assert_ptr_null(fx_last_to(&f, "a"));
  fx_close(&f);
}
END_TEST

START_TEST(end_of_blocking_waiter_serves_those_behind) {
  /* b's large request blocks c's small one behind it; when b goes, c is
   * served from the room that was there all along. */
  struct fx f;
  fx_open_small(&f);
  fx_hello(&f, "a", 1001, "");
  struct gmb_session *b = fx_hello(&f, "b", 1002, "");
  struct gmb_session *c = fx_hello(&f, "c", 1003, "");
  fx_must_alloc(&f, "a", 1001, 6 * MIB, 0);
  struct wire_reply rep;
  ck_assert_int_eq(fx_alloc(&f, "b", 1002, 4 * MIB, 0, 60000, &rep), 0);
  ck_assert_int_eq(fx_alloc(&f, "c", 1003, MIB, 0, 60000, &rep), 0);
  uint64_t c_req = f.next_req - 1;
  ck_assert_uint_eq(f.b.waitq.n, 2);
  ck_assert_ptr_null(fx_last_to(&f, "c"));
  fx_end(&f, b);
  const struct fx_sent *got = fx_last_to(&f, "c");
  ck_assert_ptr_nonnull(got);
  ck_assert_uint_eq(got->rep.id, c_req);
  ck_assert_int_eq(got->rep.status, 0);
  ck_assert_uint_eq(f.b.waitq.n, 0);
  ck_assert_uint_eq(c->tenant->waiting, 0);
  ck_assert_uint_eq(c->tenant->used, MIB);
  fx_close(&f);
}
END_TEST

/* Three sessions of one tenant; the k-th made is ended.  The tenant's
 * list is newest first, so k = 0 is its last entry, k = 2 its head. */
static void end_one_of_three(int k) {
  struct fx f;
  fx_open(&f);
  static const char *const rids[] = {"s0", "s1", "s2"};
  struct gmb_session *s[3];
  for (int i = 0; i < 3; i++) {
    s[i] = fx_hello(&f, rids[i], 1001, "");
    fx_must_alloc(&f, rids[i], 1001, (uint64_t)(i + 1) * 4096, 0);
  }
  struct gmb_tenant *t = s[0]->tenant;
  check_tenant_list(t, 3);
  fx_end(&f, s[k]);
  check_tenant_list(t, 2);
  for (int i = 0; i < 3; i++)
    if (i != k) ck_assert_int_eq(tenant_has(t, s[i]), 1);
  ck_assert_uint_eq(t->used, 6 * 4096 - (uint64_t)(k + 1) * 4096);
  /* The rest go too, in turn, and the list stays whole each time. */
  unsigned left = 2;
  for (int i = 0; i < 3; i++) {
    if (i == k) continue;
    fx_end(&f, s[i]);
    check_tenant_list(t, --left);
  }
  ck_assert_ptr_null(t->sessions);
  ck_assert_uint_eq(t->used, 0);
  fx_close(&f);
}

START_TEST(end_first_of_three) { end_one_of_three(0); }
END_TEST

START_TEST(end_middle_of_three) { end_one_of_three(1); }
END_TEST

START_TEST(end_last_of_three) { end_one_of_three(2); }
END_TEST

START_TEST(detach_twice_is_harmless) {
  struct fx f;
  fx_open(&f);
  struct gmb_session *s[3];
  static const char *const rids[] = {"s0", "s1", "s2"};
  for (int i = 0; i < 3; i++) s[i] = fx_hello(&f, rids[i], 1001, "");
  struct gmb_tenant *t = s[0]->tenant;
  /* Each position: s2 is the head, s1 the middle, s0 the tail. */
  for (int i = 2; i >= 0; i--) {
    gmb__session_detach(s[i]);
    ck_assert_int_eq(tenant_has(t, s[i]), 0);
    gmb__session_detach(s[i]);
    check_tenant_list(t, (unsigned)i);
  }
  /* Ending detaches again; still nothing counted twice. */
  for (int i = 0; i < 3; i++) {
    fx_end(&f, s[i]);
    check_tenant_list(t, 0);
  }
  fx_close(&f);
}
END_TEST

START_TEST(end_retired_segment_told_to_those_who_stay) {
  struct fx f;
  fx_open(&f);
  struct gmb_session *a = fx_hello(&f, "a", 1001, "");
  struct gmb_session *a2 = fx_hello(&f, "a2", 1001, "");
  fx_hello(&f, "a3", 1001, "");
  /* a's large allocation has a segment of its own; a2 mapped it too, a3
   * never did. */
  struct wire_reply r = fx_must_alloc(&f, "a", 1001, 4 * MIB, 0);
  uint64_t seg = r.u.alloc.segment;
  /* What the descriptor channel records when it sends a2 the segment's
   * descriptor (check_fdchan.c). */
  ck_assert_int_eq(gmb__session_seg_seen(a2, seg), 0);
  ck_assert_uint_eq(a2->n_segs, 1);
  size_t sent = f.n_sent;
  fx_end(&f, a);
  /* Its end released the segment: a2 is told, once; a (gone) and a3
   * (never mapped it) are not. */
  ck_assert_uint_eq(f.n_sent, sent + 1);
  const struct fx_sent *ev = fx_last_to(&f, "a2");
  ck_assert_ptr_nonnull(ev);
  ck_assert_int_eq(ev->rep.kind, WIRE_EVENT);
  ck_assert_int_eq(ev->rep.u.event.kind, WIRE_EVENT_SEGMENT_RETIRED);
  ck_assert_uint_eq(ev->rep.u.event.segment, seg);
  ck_assert_uint_eq(a2->n_segs, 0);
  ck_assert_ptr_null(fx_last_to(&f, "a"));
  ck_assert_ptr_null(fx_last_to(&f, "a3"));
  ck_assert_ptr_null(gmb__pool_segment(f.b.pool, seg, NULL));
  fx_close(&f);
}
END_TEST

/* --- lock-table slots ------------------------------------------------- */

START_TEST(slot_pinned_has_none) {
  struct fx f;
  fx_open(&f);
  fx_hello(&f, "a", 1001, "");
  uint64_t id = fx_must_alloc(&f, "a", 1001, 4096, 0).u.alloc.id;
  struct gmb_alloc_info info;
  ck_assert_int_eq(gmb__pool_find(f.b.pool, id, &info), 0);
  uint32_t slot = 77;
  ck_assert_ptr_null(gmb__session_slot(&info, &slot));
  ck_assert_int_eq(gmb__session_alloc_locked(&info), 0);
  fx_close(&f);
}
END_TEST

START_TEST(slot_movable_and_locked) {
  struct fx f;
  fx_open(&f);
  struct gmb_session *s = fx_hello(&f, "a", 1001, "");
  struct gmb__lt_header *h = fx_map_locktab(s);
  ck_assert_uint_eq(h->session, s->id);
  struct wire_reply r1 = fx_must_alloc(&f, "a", 1001, 4096, GMB_MOVABLE);
  struct wire_reply r2 = fx_must_alloc(&f, "a", 1001, 4096, GMB_MOVABLE);
  struct gmb_alloc_info i1, i2;
  ck_assert_int_eq(gmb__pool_find(f.b.pool, r1.u.alloc.id, &i1), 0);
  ck_assert_int_eq(gmb__pool_find(f.b.pool, r2.u.alloc.id, &i2), 0);
  uint32_t slot = UINT32_MAX;
  ck_assert_ptr_eq(gmb__session_slot(&i1, &slot), s->lt);
  ck_assert_uint_eq(slot, r1.u.alloc.slot);
  ck_assert_ptr_eq(gmb__session_slot(&i2, &slot), s->lt);
  ck_assert_uint_eq(slot, r2.u.alloc.slot);
  struct gmb__lt_slot *w = &gmb__lt_slots(h)[r1.u.alloc.slot];
  ck_assert_uint_eq(w->id, r1.u.alloc.id);
  ck_assert_uint_eq(w->segment, r1.u.alloc.segment);
  ck_assert_uint_eq(w->offset, r1.u.alloc.offset);
  ck_assert_int_eq(gmb__session_alloc_locked(&i1), 0);
  /* The client's gmb_lock: one holder, then two; only r1 is locked. */
  atomic_fetch_add(&w->state, 1);
  ck_assert_int_eq(gmb__session_alloc_locked(&i1), 1);
  ck_assert_uint_eq(gmb__locktab_holders(s->lt, r1.u.alloc.slot), 1);
  ck_assert_int_eq(gmb__session_alloc_locked(&i2), 0);
  atomic_fetch_add(&w->state, 1);
  ck_assert_uint_eq(gmb__locktab_holders(s->lt, r1.u.alloc.slot), 2);
  ck_assert_int_eq(gmb__session_alloc_locked(&i1), 1);
  /* gmb_unlock twice: free to move again. */
  atomic_fetch_sub(&w->state, 1);
  ck_assert_int_eq(gmb__session_alloc_locked(&i1), 1);
  atomic_fetch_sub(&w->state, 1);
  ck_assert_int_eq(gmb__session_alloc_locked(&i1), 0);
  /* MOVING is the broker's claim, not a holder. */
  ck_assert_int_eq(gmb__locktab_claim(s->lt, r1.u.alloc.slot), 1);
  ck_assert_uint_eq(atomic_load(&w->state), GMB_LT_MOVING);
  ck_assert_uint_eq(gmb__locktab_holders(s->lt, r1.u.alloc.slot), 0);
  ck_assert_int_eq(gmb__session_alloc_locked(&i1), 0);
  gmb__locktab_release(s->lt, r1.u.alloc.slot);
  ck_assert_uint_eq(atomic_load(&w->state), 0);
  /* Freeing the allocation clears the slot the client sees. */
  atomic_fetch_add(&w->state, 1);
  ck_assert_int_eq(fx_free(&f, "a", 1001, r1.u.alloc.id), 0);
  ck_assert_uint_eq(atomic_load(&w->state), 0);
  ck_assert_uint_eq(w->id, 0);
  fx_unmap_locktab(h);
  fx_close(&f);
}
END_TEST

START_TEST(slot_without_owner_or_table) {
  struct fx f;
  fx_open(&f);
  /* A movable allocation's info whose owner is gone or has no table (a
   * session made without Hello) names no slot. */
  struct gmb_alloc_info info;
  memset(&info, 0, sizeof info);
  info.id = 1;
  info.flags = GMB_MOVABLE;
  info.tag = gmb__locktab_tag(3);
  uint32_t slot = UINT32_MAX;
  ck_assert_ptr_null(gmb__session_slot(&info, &slot));
  ck_assert_int_eq(gmb__session_alloc_locked(&info), 0);
  struct gmb_session *s = raw_session(&f, "raw", 3, 1001, 0);
  ck_assert_ptr_null(s->lt);
  info.owner = s;
  ck_assert_ptr_null(gmb__session_slot(&info, &slot));
  ck_assert_int_eq(gmb__session_alloc_locked(&info), 0);
  fx_close(&f);
}
END_TEST

START_TEST(locked_movable_cannot_be_moved) {
  /* The NoMemory explanation counts a movable allocation as stuck while
   * its client holds it locked, and names its tenant. */
  struct fx f;
  fx_open_small(&f);
  struct gmb_session *a = fx_hello(&f, "a", 1001, "");
  struct gmb__lt_header *h = fx_map_locktab(a);
  fx_hello(&f, "b", 1002, "");
  /* The small device filled with small movable allocations (a large one
   * would be pinned). */
  struct wire_reply r1 = fx_must_alloc(&f, "a", 1001, MIB, GMB_MOVABLE);
  for (int i = 1; i < 8; i++) fx_must_alloc(&f, "a", 1001, MIB, GMB_MOVABLE);
  struct wire_reply rep;
  ck_assert_int_eq(fx_alloc(&f, "b", 1002, MIB, 0, 0, &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_NOMEM);
  ck_assert_int_eq(rep.kind, WIRE_NOMEM);
  ck_assert_uint_eq(rep.u.nomem.unmovable, 0);
  ck_assert_uint_eq(rep.u.nomem.n_holders, 0);
  struct gmb__lt_slot *w = &gmb__lt_slots(h)[r1.u.alloc.slot];
  atomic_fetch_add(&w->state, 1);
  ck_assert_int_eq(fx_alloc(&f, "b", 1002, MIB, 0, 0, &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_NOMEM);
  ck_assert_uint_eq(rep.u.nomem.unmovable, MIB);
  ck_assert_uint_eq(rep.u.nomem.n_holders, 1);
  ck_assert_str_eq(rep.u.nomem.holders[0], "uid-1001");
  atomic_fetch_sub(&w->state, 1);
  fx_unmap_locktab(h);
  fx_close(&f);
}
END_TEST


/* gmb__core_close sends nothing (core.h): ending the sessions one by one
 * frees memory, which must not serve the waiters of sessions not ended yet
 * (they were told the broker stops) nor announce retired segments to
 * sessions that mapped them. */
START_TEST(close_sends_nothing) {
  struct fx f;
  fx_open_small(&f);
  fx_hello(&f, "a", 1001, "");
  struct gmb_session *a2 = fx_hello(&f, "a2", 1001, "");
  fx_hello(&f, "b", 1002, "");
  struct wire_reply r = fx_must_alloc(&f, "a", 1001, 8 * MIB, 0);
  /* a2 was given the segment's descriptor (the channel records it). */
  ck_assert_int_eq(gmb__session_seg_seen(a2, r.u.alloc.segment), 0);
  struct wire_reply rep;
  ck_assert_int_eq(fx_alloc(&f, "b", 1002, MIB, 0, -1, &rep), 0);
  size_t sent = f.n_sent;
  /* fx_close, with a look at the tap between close and the rest. */
  ck_assert_int_eq(gmb__core_check(&f.b), 0);
  gmb__core_close(&f.b);
  size_t during = f.n_sent - sent;
  gmb__config_free(&f.b.cfg);
  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf %s", f.dir);
  ck_assert_int_eq(system(cmd), 0);
  ck_assert_uint_eq(during, 0);
}
END_TEST


/* --- ending in slices ----------------------------------------------------- */

#define SL_N 6000u

/* Session "a" of tenant "shared" (uid 1001) holds SL_N small allocations
 * (movable and pinned) and a large one; "b" of the same tenant and "c" of
 * another hold a few.  Returns a. */
static struct gmb_session *sl_setup(struct fx *f) {
  fx_open_ini(f, "host:256MiB", FX_INI_OFF);
  struct gmb_session *a = fx_hello(f, "a", 1001, "shared");
  fx_hello(f, "b", 1001, "shared");
  fx_hello(f, "c", 1002, "");
  for (unsigned i = 0; i < SL_N; i++) {
    struct wire_request req;
    memset(&req, 0, sizeof req);
    req.kind = WIRE_ALLOC;
    req.u.alloc.size = 512u * (1 + i % 8);
    req.u.alloc.flags = (i % 3) ? GMB_MOVABLE : 0;
    struct wire_reply rep;
    struct gmb_peer p = fx_peer("a", 1001);
    req.id = f->next_req++;
    ck_assert_int_eq(gmb__dispatch(&f->b, &p, &req, &rep), 1);
    ck_assert_msg(rep.status == 0, "alloc %u: %s", i, rep.message);
  }
  fx_must_alloc(f, "a", 1001, 3u << 20, 0); /* pages and a tail */
  for (int i = 0; i < 10; i++) {
    fx_must_alloc(f, "b", 1001, 4096, GMB_MOVABLE);
    fx_must_alloc(f, "c", 1002, 4096, 0);
  }
  ck_assert_int_eq(gmb__core_check(&f->b), 0);
  return a;
}

/* What ends in slices is freed exactly: the pool and the tenant lose the
 * session's bytes and allocations, no more, no fewer, over more than one
 * slice; meanwhile the other sessions are served and every check holds;
 * at the end nothing of the session is left. */
START_TEST(sliced_end_reclaims_exactly) {
  struct fx f;
  struct gmb_session *a = sl_setup(&f);
  struct gmb_tenant *t = fx_tenant(&f, "shared");
  struct gmb_pool_stats before, after;
  gmb__pool_stats(f.b.pool, &before);
  uint64_t a_bytes = a->used, a_allocs = a->allocations;
  uint64_t t_used = t->used, n_sessions = gmb__sessions_count(f.b.sessions);
  ck_assert_uint_eq(a_allocs, SL_N + 1);
  gmb__core_session_end_sliced(&f.b, a, "test");
  /* Gone at once from the table and its tenant; its bytes still counted. */
  ck_assert_ptr_null(gmb__session_find(f.b.sessions, (const uint8_t *)"a", 1));
  ck_assert_uint_eq(gmb__sessions_count(f.b.sessions), n_sessions - 1);
  ck_assert_uint_eq(t->n_sessions, 1);
  ck_assert_uint_eq(t->reaping, 1);
  ck_assert_uint_eq(t->reaping_bytes, a_bytes);
  ck_assert_uint_eq(t->used, t_used);
  ck_assert_int_eq(gmb__core_check(&f.b), 0);
  unsigned slices = 0;
  while (gmb__core_reap_step(&f.b, 0)) { /* one slice each */
    slices++;
    ck_assert_uint_le(slices, 100);
    ck_assert_int_eq(gmb__core_check(&f.b), 0);
    /* The others are served between slices. */
    struct wire_reply rb = fx_must_alloc(&f, "b", 1001, 8192, GMB_MOVABLE);
    ck_assert_int_eq(fx_free(&f, "b", 1001, rb.u.alloc.id), 0);
    struct wire_reply rc = fx_must_alloc(&f, "c", 1002, 8192, 0);
    ck_assert_int_eq(fx_free(&f, "c", 1002, rc.u.alloc.id), 0);
  }
  ck_assert_uint_ge(slices, 1); /* more than one slice */
  ck_assert_int_eq(gmb__core_check(&f.b), 0);
  ck_assert_ptr_null(f.b.reap_head);
  ck_assert_uint_eq(t->reaping, 0);
  ck_assert_uint_eq(t->reaping_bytes, 0);
  ck_assert_uint_eq(t->used, t_used - a_bytes);
  gmb__pool_stats(f.b.pool, &after);
  ck_assert_uint_eq(after.used, before.used - a_bytes);
  ck_assert_uint_eq(after.allocations, before.allocations - a_allocs);
  fx_close(&f);
}
END_TEST

/* A Bye of a session that holds many allocations ends it in slices too;
 * an eviction of its tenant meanwhile frees the rest at once. */
START_TEST(sliced_end_then_evict_frees_at_once) {
  struct fx f;
  sl_setup(&f);
  struct gmb_tenant *t = fx_tenant(&f, "shared");
  struct wire_reply rep;
  ck_assert_int_eq(fx_plain(&f, "a", 1001, WIRE_BYE, &rep), 1);
  ck_assert_uint_eq(t->reaping, 1);
  ck_assert_int_eq(gmb__core_reap_step(&f.b, 0), 1); /* one slice, more */
  gmb__core_reap_tenant(&f.b, t);
  ck_assert_uint_eq(t->reaping, 0);
  ck_assert_uint_eq(t->reaping_bytes, 0);
  ck_assert_ptr_null(f.b.reap_head);
  ck_assert_int_eq(gmb__core_check(&f.b), 0);
  fx_close(&f);
}
END_TEST

static Suite *session_suite(void) {
  Suite *s = suite_create("session");
  TCase *tc = tcase_create("table");
  tcase_add_test(tc, find_by_routing_id);
  tcase_add_test(tc, new_copies_what_it_is_given);
  tcase_add_test(tc, new_watches_a_live_pid);
  tcase_add_test(tc, new_for_a_dead_pid_is_esrch);
  tcase_add_test(tc, gen_changes_on_add_and_remove);
  tcase_add_test(tc, new_has_secret_and_no_channel);
  tcase_add_test(tc, by_id);
  tcase_add_test(tc, fdconn_owned_and_closed_at_end);
  tcase_add_test(tc, each_visits_every_session_once);
  tcase_add_test(tc, each_may_end_every_session);
  tcase_add_test(tc, each_may_end_some_sessions);
  suite_add_tcase(s, tc);

  tc = tcase_create("segments");
  tcase_add_test(tc, seg_seen_sorted_and_once);
  tcase_add_test(tc, seg_forget);
  suite_add_tcase(s, tc);

  tc = tcase_create("end");
  tcase_add_test(tc, end_frees_and_uncharges);
  tcase_add_test(tc, end_destroys_lock_table);
  tcase_add_test(tc, end_drops_own_waiters);
  tcase_add_test(tc, end_serves_others_waiters);
  tcase_add_test(tc, end_of_blocking_waiter_serves_those_behind);
  tcase_add_test(tc, end_first_of_three);
  tcase_add_test(tc, end_middle_of_three);
  tcase_add_test(tc, end_last_of_three);
  tcase_add_test(tc, detach_twice_is_harmless);
  tcase_add_test(tc, end_retired_segment_told_to_those_who_stay);
  tcase_add_test(tc, close_sends_nothing);
  tcase_add_test(tc, sliced_end_reclaims_exactly);
  tcase_add_test(tc, sliced_end_then_evict_frees_at_once);
  suite_add_tcase(s, tc);

  tc = tcase_create("slots");
  tcase_add_test(tc, slot_pinned_has_none);
  tcase_add_test(tc, slot_movable_and_locked);
  tcase_add_test(tc, slot_without_owner_or_table);
  tcase_add_test(tc, locked_movable_cannot_be_moved);
  suite_add_tcase(s, tc);

  return s;
}

int main(void) { return check_run(session_suite()); }
