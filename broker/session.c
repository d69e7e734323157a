/*
 * session.c - the session table: sessions by routing id, their pidfds and
 * the segments they mapped.
 *
 * Sessions are few compared to allocations (one per client process), so a
 * red-black tree by routing id is plenty; the loop rebuilds its poll set
 * from it when the generation changed.
 */
#include "session.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "fdpass.h"
#include "gmb.h"
#include "locktab.h"
#include "log.h"
#include "util.h"

static int session_cmp(const struct gmb_session *a,
                       const struct gmb_session *b) {
  size_t n = a->rid_len < b->rid_len ? a->rid_len : b->rid_len;
  int c = memcmp(a->rid, b->rid, n);
  if (c) return c;
  return (a->rid_len > b->rid_len) - (a->rid_len < b->rid_len);
}

RB_HEAD(session_tree, gmb_session);
RB_GENERATE_STATIC(session_tree, gmb_session, link, session_cmp)

/* Sessions per uid, sorted by uid, for max_sessions_per_uid: one entry
 * per uid with a session (uids are few; a binary search finds one). */
struct session_uid {
  uid_t uid;
  uint32_t n;
};

struct gmb_sessions {
  struct session_tree tree;
  size_t count;
  uint64_t gen; /* bumped at every insert and removal */
  struct session_uid *uids;
  size_t n_uids, cap_uids;
};

static size_t session_uid_index(const struct gmb_sessions *ss, uid_t uid) {
  size_t lo = 0, hi = ss->n_uids;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    if (ss->uids[mid].uid < uid)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

uint64_t gmb__session_cached(const struct gmb_session *s) {
  return s->cached_free < s->used ? s->cached_free : s->used;
}

uint64_t gmb__tenant_cached(const struct gmb_tenant *t) {
  uint64_t cached = 0;
  /* Each capped at what its session holds, so the sum (at most the
   * tenant's bytes) cannot wrap however large the clients' figures. */
  for (const struct gmb_session *o = t->sessions; o; o = o->tenant_next)
    cached += gmb__session_cached(o);
  return cached < t->used ? cached : t->used;
}

void gmb__tenant_trim_totals(const struct gmb_tenant *t, uint64_t *asks,
                             uint64_t *ignored) {
  uint64_t a = t->trim_asks_ended, i = t->trim_ignored_ended;
  for (const struct gmb_session *o = t->sessions; o; o = o->tenant_next) {
    a += o->trim_asks;
    i += o->trim_ignored;
  }
  *asks = a;
  *ignored = i;
}

int gmb__tenant_sessions_check(const struct gmb_tenant *t) {
  uint64_t used = 0, vmm = 0;
  unsigned n = 0;
  for (const struct gmb_session *o = t->sessions; o; o = o->tenant_next) {
    used += o->used;
    vmm += o->vmm;
    n++;
  }
  int bad = 0;
  used += t->reaping_bytes; /* ended sessions not yet freed (core.c) */
  if (vmm != t->vmm) {
    log_error("session check: tenant %s counts %llu VMM bytes, its sessions "
              "%llu", t->name, (unsigned long long)t->vmm,
              (unsigned long long)vmm);
    bad++;
  }
  if (used != t->used) {
    log_error("session check: tenant %s uses %llu bytes, its sessions hold "
              "%llu (%llu of them ended ones')", t->name,
              (unsigned long long)t->used, (unsigned long long)used,
              (unsigned long long)t->reaping_bytes);
    bad++;
  }
  if (n != t->n_sessions) {
    log_error("session check: tenant %s counts %u sessions, its list has %u",
              t->name, t->n_sessions, n);
    bad++;
  }
  return bad;
}

uint32_t gmb__sessions_of_uid(const struct gmb_sessions *ss, uid_t uid) {
  size_t i = session_uid_index(ss, uid);
  return i < ss->n_uids && ss->uids[i].uid == uid ? ss->uids[i].n : 0;
}

/* Makes room for uid's entry (before the session is linked anywhere, so
 * that running out of memory leaves nothing half done).  0 or -1. */
static int session_uid_reserve(struct gmb_sessions *ss, uid_t uid) {
  size_t i = session_uid_index(ss, uid);
  if (i < ss->n_uids && ss->uids[i].uid == uid) return 0;
  if (ss->n_uids == ss->cap_uids) {
    size_t cap = ss->cap_uids ? ss->cap_uids * 2 : 16;
    struct session_uid *n = realloc(ss->uids, cap * sizeof *n);
    if (n == NULL) return -1;
    ss->uids = n;
    ss->cap_uids = cap;
  }
  memmove(&ss->uids[i + 1], &ss->uids[i], (ss->n_uids - i) * sizeof *ss->uids);
  ss->uids[i].uid = uid;
  ss->uids[i].n = 0;
  ss->n_uids++;
  return 0;
}

/* Forgets uid's entry when it counts nobody (a session that failed to
 * start). */
static void session_uid_trim(struct gmb_sessions *ss, uid_t uid) {
  size_t i = session_uid_index(ss, uid);
  if (i >= ss->n_uids || ss->uids[i].uid != uid || ss->uids[i].n > 0) return;
  memmove(&ss->uids[i], &ss->uids[i + 1],
          (ss->n_uids - i - 1) * sizeof *ss->uids);
  ss->n_uids--;
}

static void session_uid_drop(struct gmb_sessions *ss, uid_t uid) {
  size_t i = session_uid_index(ss, uid);
  GMB_ASSERT(i < ss->n_uids && ss->uids[i].uid == uid && ss->uids[i].n > 0 &&
             "a session's uid is counted");
  if (--ss->uids[i].n > 0) return;
  memmove(&ss->uids[i], &ss->uids[i + 1],
          (ss->n_uids - i - 1) * sizeof *ss->uids);
  ss->n_uids--;
}

struct gmb_sessions *gmb__sessions_new(void) {
  struct gmb_sessions *ss = calloc(1, sizeof *ss);
  if (ss) RB_INIT(&ss->tree);
  return ss;
}

struct gmb_session *gmb__session_find(struct gmb_sessions *ss,
                                      const uint8_t *rid, size_t rid_len) {
  struct gmb_session key;
  key.rid = (uint8_t *)rid;
  key.rid_len = rid_len;
  return RB_FIND(session_tree, &ss->tree, &key);
}

struct gmb_session *gmb__session_by_id(struct gmb_sessions *ss, uint64_t id) {
  struct gmb_session *s;
  RB_FOREACH(s, session_tree, &ss->tree)
    if (s->id == id) return s;
  return NULL;
}

static int session_pidfd_open(pid_t pid) {
#ifdef SYS_pidfd_open
  return (int)syscall(SYS_pidfd_open, pid, 0);
#else
  (void)pid;
  errno = ENOSYS;
  return -1;
#endif
}

static struct gmb_session *session_new(struct gmb_broker *b,
                                       const struct gmb_peer *peer,
                                       struct gmb_tenant *tenant,
                                       const char *client) {
  struct gmb_session *s = calloc(1, sizeof *s);
  if (s == NULL) return NULL;
  s->rid = malloc(peer->rid_len ? peer->rid_len : 1);
  if (s->rid == NULL) {
    free(s);
    errno = ENOMEM;
    return NULL;
  }
  memcpy(s->rid, peer->rid, peer->rid_len);
  s->rid_len = peer->rid_len;
  s->uid = peer->uid;
  s->gid = peer->gid;
  s->pid = peer->pid;
  s->pidfd = -1;
  s->fdconn = -1;
  ssize_t got = getrandom(s->secret, sizeof s->secret, 0);
  if (got != (ssize_t)sizeof s->secret) {
    int e = errno;
    free(s->rid);
    free(s);
    errno = e ? e : EIO;
    return NULL;
  }
  if (peer->pid > 0) {
    s->pidfd = session_pidfd_open(peer->pid);
    if (s->pidfd < 0 && errno == ESRCH) {
      /* It said Hello and died before we looked: nothing to serve. */
      free(s->rid);
      free(s);
      errno = ESRCH;
      return NULL;
    }
    if (s->pidfd < 0)
      log_warn("cannot watch pid %d (%s): session falls back to heartbeats",
               (int)peer->pid, strerror(errno));
  }
  s->id = ++b->next_session_id;
  s->tenant = tenant;
  snprintf(s->client, sizeof s->client, "%s", client ? client : "");
  s->last_seen_ns = gmb__now_ns();
  s->born_ns = s->last_seen_ns;
  /* Link into the tenant's list. */
  s->tenant_next = tenant->sessions;
  if (tenant->sessions) tenant->sessions->tenant_prev = s;
  tenant->sessions = s;
  tenant->n_sessions++;
  RB_INSERT(session_tree, &b->sessions->tree, s);
  b->sessions->uids[session_uid_index(b->sessions, s->uid)].n++;
  b->sessions->count++;
  b->sessions->gen++;
  return s;
}

struct gmb_session *gmb__session_new(struct gmb_broker *b,
                                     const struct gmb_peer *peer,
                                     struct gmb_tenant *tenant,
                                     const char *client) {
  if (session_uid_reserve(b->sessions, peer->uid) != 0) {
    errno = ENOMEM;
    return NULL;
  }
  struct gmb_session *s = session_new(b, peer, tenant, client);
  if (s == NULL) {
    int e = errno;
    session_uid_trim(b->sessions, peer->uid);
    errno = e;
  }
  return s;
}

void gmb__session_detach(struct gmb_session *s) {
  struct gmb_tenant *t = s->tenant;
  if (s->tenant_prev)
    s->tenant_prev->tenant_next = s->tenant_next;
  else if (t->sessions == s)
    t->sessions = s->tenant_next;
  else
    return; /* detached already */
  if (s->tenant_next) s->tenant_next->tenant_prev = s->tenant_prev;
  s->tenant_next = s->tenant_prev = NULL;
  t->n_sessions--;
  t->trim_asks_ended += s->trim_asks;
  t->trim_ignored_ended += s->trim_ignored;
}

void gmb__session_set_fdconn(struct gmb_sessions *ss, struct gmb_session *s,
                             int fd) {
  s->fdconn = fd;
  ss->gen++; /* the loop polls the channel */
}

void gmb__session_unlink(struct gmb_sessions *ss, struct gmb_session *s) {
  if (s->unlinked) return;
  GMB_ASSERT(s->fd_hold == NULL &&
             "the descriptor channel's record goes first (fdchan.c)");
  gmb__session_detach(s);
  RB_REMOVE(session_tree, &ss->tree, s);
  session_uid_drop(ss, s->uid);
  ss->count--;
  ss->gen++;
  if (s->pidfd >= 0) close(s->pidfd);
  s->pidfd = -1;
  gmb__fd_release(s->fdconn); /* off the loop if a peer queued descriptors */
  s->fdconn = -1;
  s->unlinked = 1;
}

void gmb__session_free(struct gmb_sessions *ss, struct gmb_session *s) {
  gmb__session_unlink(ss, s);
  free(s->segs);
  free(s->rid);
  free(s);
}

void gmb__sessions_destroy(struct gmb_sessions *ss) {
  if (ss == NULL) return;
  GMB_ASSERT(ss->count == 0 && "sessions are ended before the table goes");
  free(ss->uids);
  free(ss);
}

size_t gmb__sessions_count(const struct gmb_sessions *ss) { return ss->count; }

uint64_t gmb__sessions_gen(const struct gmb_sessions *ss) { return ss->gen; }

struct gmb_locktab *gmb__session_slot(const struct gmb_alloc_info *a,
                                      uint32_t *slot) {
  const struct gmb_session *s = a->owner;
  if (s == NULL || s->lt == NULL || !gmb__locktab_tag_slot(a->tag, slot))
    return NULL;
  return s->lt;
}

int gmb__session_alloc_locked(const struct gmb_alloc_info *a) {
  uint32_t slot;
  struct gmb_locktab *lt = gmb__session_slot(a, &slot);
  return lt != NULL && gmb__locktab_holders(lt, slot) != 0;
}

void gmb__sessions_each(struct gmb_sessions *ss,
                        void (*fn)(void *ctx, struct gmb_session *s),
                        void *ctx) {
  struct gmb_session *s, *next;
  RB_FOREACH_SAFE(s, session_tree, &ss->tree, next) fn(ctx, s);
}

/* Index of the first recorded segment >= seg. */
static size_t session_seg_index(const struct gmb_session *s, uint64_t seg) {
  size_t lo = 0, hi = s->n_segs;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    if (s->segs[mid] < seg)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

int gmb__session_seg_seen(struct gmb_session *s, uint64_t seg) {
  size_t i = session_seg_index(s, seg);
  if (i < s->n_segs && s->segs[i] == seg) return 1;
  if (s->n_segs == s->cap_segs) {
    size_t cap = s->cap_segs ? s->cap_segs * 2 : 8;
    uint64_t *n = realloc(s->segs, cap * sizeof *n);
    if (n == NULL) return -1;
    s->segs = n;
    s->cap_segs = cap;
  }
  memmove(&s->segs[i + 1], &s->segs[i], (s->n_segs - i) * sizeof *s->segs);
  s->segs[i] = seg;
  s->n_segs++;
  return 0;
}

int gmb__session_seg_forget(struct gmb_session *s, uint64_t seg) {
  size_t i = session_seg_index(s, seg);
  if (i >= s->n_segs || s->segs[i] != seg) return 0;
  memmove(&s->segs[i], &s->segs[i + 1], (s->n_segs - i - 1) * sizeof *s->segs);
  s->n_segs--;
  return 1;
}
