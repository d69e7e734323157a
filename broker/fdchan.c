/*
 * fdchan.c - the descriptor channel's handler (fdchan.h, proto/fdpass.h).
 *
 * Pending connections live in a fixed table of GMB_FDCHAN_PENDING slots:
 * a flood of connections costs the broker that table and nothing more (the
 * excess is closed at accept), and one uid at most
 * GMB_FDCHAN_PENDING_PER_UID of its places: a user who holds connections
 * open without a word keeps its own clients out, not others'.  Once a connection proves a session (its
 * secret, and SO_PEERCRED showing the session's uid) it moves to the
 * session (s->fdconn) and leaves the table.
 *
 * Answers never reveal more than the asker may know: a wrong session id, a
 * wrong secret and another uid's session get the same refusal, and a
 * segment of another tenant the same answer as one that does not exist.
 * Nothing read from a peer is trusted or asserted on.
 *
 * No client ever needs to send the broker a descriptor, and closing one a
 * peer sent may block for as long as the peer chose (a TCP socket with
 * SO_LINGER and unsent data; see proto/fdpass.c).  So the listener refuses
 * descriptors (SO_PASSRIGHTS off, inherited by each connection), and where
 * the kernel cannot refuse them (before Linux 6.16) every descriptor that
 * arrives, and every connection that might hold some, is closed on the
 * closer thread (gmb__fd_discard, gmb__fd_release), never on the loop.
 * A session that sends one has broken the protocol: it ends.
 *
 * Unread descriptors (fdchan.h).  SIOCOUTQ on the broker's end of a
 * channel is what the peer has not consumed yet; a channel that holds
 * descriptors sent since it was last read to the end has a record
 * (struct gmb_fdhold) weighing them, on three lists: every channel's,
 * its uid's account and its tenant's (t->fd_holds).  Invariants
 * (gmb__fdchan_check): a record weighs at least 1 (but between its
 * making and its first send); a live session's record is its fd_hold and
 * weighs its fd_sent; each account's sum (uid, tenant, b->fd_unread) is
 * the weight of its list, and its kept count the records of that list
 * with no session; a uid's account exists while its list is not empty.
 * A record goes when its channel is seen read to the end (at the
 * session's next request, a look before a refusal, the timer's sweep) or
 * its peer hung up, and only then is a kept channel closed.
 */
#include "fdchan.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <linux/sockios.h>
#include <sys/ioctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include "core.h"
#include "fdpass.h"
#include "gmb.h"
#include "locktab.h"
#include "log.h"
#include "rbtree.h"
#include "tenant.h"
#include "util.h"

#define FDCHAN_AUTH_NS ((uint64_t)GMB_FDCHAN_AUTH_MS * GMB_NS_PER_MS)
#define FDCHAN_ACCEPT_BATCH 16

struct fdchan_pending {
  int fd;               /* -1: a free slot */
  uid_t uid;            /* the peer's (SO_PEERCRED at accept) */
  uint64_t deadline_ns; /* closed when not authenticated by then */
};

/* The lists a channel's record is on: every channel's (the timer's
 * sweep), its uid's and its tenant's (the looks at a bound). */
enum { FDL_ALL, FDL_UID, FDL_TENANT, FDL_N };

/* A uid's account: the descriptors its channels may hold unread, how
 * many of them are kept for ended sessions, and those channels. */
struct fdchan_uid {
  uid_t uid;
  uint64_t unread;
  uint32_t kept;
  struct gmb_fdlist holds;
  RB_ENTRY(fdchan_uid) node;
};

/* A channel holding descriptors the broker sent and has not seen read:
 * a live session's (s; fd is its s->fdconn, the session's to close) or
 * one kept for an ended session (s NULL; fd is the broker's end, this
 * module's to close).  It exists while weight >= 1, but for the moment
 * between its making and the first send. */
struct gmb_fdhold {
  int fd;
  struct gmb_session *s;
  struct gmb_tenant *t; /* kept: not idle while the channel is (tenant.c) */
  struct fdchan_uid *u;
  uint32_t weight;      /* descriptors it may hold unread (= s->fd_sent) */
  struct {
    struct gmb_fdhold *prev, *next;
  } link[FDL_N];
};

static int fdchan_uid_cmp(const struct fdchan_uid *a,
                          const struct fdchan_uid *b) {
  return a->uid < b->uid ? -1 : a->uid > b->uid;
}

RB_HEAD(fdchan_uids, fdchan_uid);
RB_GENERATE_STATIC(fdchan_uids, fdchan_uid, node, fdchan_uid_cmp)

struct gmb_fdchan {
  int listen_fd;
  int spare_fd; /* /dev/null, closed to accept-and-close at EMFILE */
  uint64_t gen;
  size_t n_pending;
  struct fdchan_pending pending[GMB_FDCHAN_PENDING];
  /* Channels holding descriptors unread: all of them (swept from the
   * head, those still holding go to the tail), and the uids' accounts. */
  struct gmb_fdlist holds;
  struct fdchan_uids uids;
  uint64_t next_sweep_ns;
  uint32_t per_uid, per_tenant; /* the bounds in force (fdchan.h) */
};

static void fdchan_session_gone(struct gmb_broker *b, struct gmb_session *s);

static uint32_t fdchan_min(uint64_t a, uint64_t b) {
  return (uint32_t)(a < b ? a : b);
}

/* The bounds of unread descriptors under RLIMIT_NOFILE now (fdchan.h). */
static void fdchan_unread_limits(struct gmb_fdchan *ch) {
  struct rlimit rl;
  uint64_t have = UINT64_MAX;
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY)
    have = rl.rlim_cur;
  ch->per_uid = fdchan_min(GMB_FDCHAN_UNREAD_PER_UID,
                           have / GMB_FDCHAN_UNREAD_NOFILE_SHARE);
  if (ch->per_uid < GMB_FDCHAN_UNREAD_ANSWERS)
    ch->per_uid = GMB_FDCHAN_UNREAD_ANSWERS;
  ch->per_tenant = fdchan_min(GMB_FDCHAN_UNREAD_PER_TENANT, ch->per_uid / 2);
  if (ch->per_tenant < GMB_FDCHAN_UNREAD_ANSWERS)
    ch->per_tenant = GMB_FDCHAN_UNREAD_ANSWERS;
}

int gmb__fdchan_open(struct gmb_broker *b, int listen_fd) {
  struct gmb_fdchan *ch = calloc(1, sizeof *ch);
  if (ch == NULL) return GMB_E_SYSTEM;
  ch->listen_fd = listen_fd;
  if (!gmb__fd_refuse_rights(listen_fd, 1))
    log_info("descriptor channel: this kernel cannot refuse descriptors "
             "(SO_PASSRIGHTS); any a client sends are closed off the loop");
  fdchan_unread_limits(ch);
  RB_INIT(&ch->uids);
  ch->spare_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  for (size_t i = 0; i < GMB_FDCHAN_PENDING; i++) ch->pending[i].fd = -1;
  b->fdchan = ch;
  b->fdconn_gone = fdchan_session_gone;
  b->fd_bound_channel = GMB_FDCHAN_UNREAD_ANSWERS;
  b->fd_bound_uid = ch->per_uid;
  b->fd_bound_tenant = ch->per_tenant;
  return 0;
}

static void fdchan_hold_free(struct gmb_broker *b, struct gmb_fdhold *h,
                             int tidy);

void gmb__fdchan_close(struct gmb_broker *b) {
  struct gmb_fdchan *ch = b->fdchan;
  if (ch == NULL) return;
  for (size_t i = 0; i < GMB_FDCHAN_PENDING; i++)
    if (ch->pending[i].fd >= 0) gmb__fd_release(ch->pending[i].fd);
  /* The broker stops: kept channels close, live ones stay their
   * sessions' (nothing is sent any more). */
  b->closing++;
  while (ch->holds.first) fdchan_hold_free(b, ch->holds.first, 1);
  b->closing--;
  gmb__fd_release(ch->listen_fd); /* its backlog may hold connections */
  if (ch->spare_fd >= 0) close(ch->spare_fd);
  free(ch);
  b->fdchan = NULL;
  b->fdconn_gone = NULL;
  b->fd_bound_channel = b->fd_bound_uid = b->fd_bound_tenant = 0;
}
int gmb__fdchan_listener(const struct gmb_broker *b) {
  return b->fdchan ? b->fdchan->listen_fd : -1;
}

uint64_t gmb__fdchan_gen(const struct gmb_broker *b) {
  return b->fdchan ? b->fdchan->gen : 0;
}

void gmb__fdchan_each_pending(struct gmb_broker *b,
                             void (*fn)(void *ctx, int fd, void *conn),
                             void *ctx) {
  struct gmb_fdchan *ch = b->fdchan;
  if (ch == NULL) return;
  for (size_t i = 0; i < GMB_FDCHAN_PENDING; i++)
    if (ch->pending[i].fd >= 0) fn(ctx, ch->pending[i].fd, &ch->pending[i]);
}

static void fdchan_drop_pending(struct gmb_fdchan *ch,
                               struct fdchan_pending *p) {
  gmb__fd_release(p->fd);
  p->fd = -1;
  ch->n_pending--;
  ch->gen++;
}

static struct gmb_log_rl fdchan_rl_emfile, fdchan_rl_auth, fdchan_rl_full,
    fdchan_rl_inflight, fdchan_rl_unread, fdchan_rl_live, fdchan_rl_refuse;

/* --- descriptors unread --------------------------------------------------- */

/* Bytes the peer of `sock` has not consumed yet (SIOCOUTQ), or -1. */
static int fdchan_outq(int sock) {
  int n = 0;
  return ioctl(sock, SIOCOUTQ, &n) == 0 ? n : -1;
}

static void fdl_push(struct gmb_fdlist *l, struct gmb_fdhold *h, int k) {
  h->link[k].next = NULL;
  h->link[k].prev = l->last;
  if (l->last)
    l->last->link[k].next = h;
  else
    l->first = h;
  l->last = h;
  l->n++;
}

static void fdl_remove(struct gmb_fdlist *l, struct gmb_fdhold *h, int k) {
  if (h->link[k].prev)
    h->link[k].prev->link[k].next = h->link[k].next;
  else
    l->first = h->link[k].next;
  if (h->link[k].next)
    h->link[k].next->link[k].prev = h->link[k].prev;
  else
    l->last = h->link[k].prev;
  h->link[k].prev = h->link[k].next = NULL;
  l->n--;
}

static struct fdchan_uid *fdchan_uid_find(struct gmb_fdchan *ch, uid_t uid) {
  struct fdchan_uid key = {.uid = uid};
  return RB_FIND(fdchan_uids, &ch->uids, &key);
}

/* Frees uid account u once no channel of it holds anything; NULL then,
 * else u. */
static struct fdchan_uid *fdchan_uid_tidy(struct gmb_fdchan *ch,
                                          struct fdchan_uid *u) {
  if (u == NULL || u->holds.n > 0) return u;
  GMB_ASSERT(u->unread == 0 && u->kept == 0 &&
             "a uid's account adds up to its channels");
  RB_REMOVE(fdchan_uids, &ch->uids, u);
  free(u);
  return NULL;
}

/* Sets what h's channel may hold unread, and every sum it is part of. */
static void fdchan_weigh(struct gmb_broker *b, struct gmb_fdhold *h,
                         uint32_t w) {
  h->u->unread = h->u->unread - h->weight + w;
  h->t->fd_unread = h->t->fd_unread - h->weight + w;
  b->fd_unread = b->fd_unread - h->weight + w;
  h->weight = w;
  if (h->s) h->s->fd_sent = w;
}

/* Session s's record (made, weighing 0, when it has none), or NULL when
 * out of memory. */
static struct gmb_fdhold *fdchan_hold_of(struct gmb_broker *b,
                                         struct gmb_session *s, int fd) {
  struct gmb_fdchan *ch = b->fdchan;
  if (s->fd_hold) return s->fd_hold;
  struct fdchan_uid *u = fdchan_uid_find(ch, s->uid);
  if (u == NULL) {
    if ((u = calloc(1, sizeof *u)) == NULL) return NULL;
    u->uid = s->uid;
    RB_INSERT(fdchan_uids, &ch->uids, u);
  }
  struct gmb_fdhold *h = calloc(1, sizeof *h);
  if (h == NULL) {
    fdchan_uid_tidy(ch, u);
    return NULL;
  }
  h->fd = fd;
  h->s = s;
  h->t = s->tenant;
  h->u = u;
  fdl_push(&ch->holds, h, FDL_ALL);
  fdl_push(&u->holds, h, FDL_UID);
  fdl_push(&h->t->fd_holds, h, FDL_TENANT);
  s->fd_hold = h;
  return h;
}

/* Forgets h: its channel holds nothing unread any more (or the broker
 * stops).  A kept channel is closed, and its tenant may have gone idle;
 * a live one stays its session's.  With `tidy`, h's uid account goes
 * with its last channel (a look along that account's list passes 0 and
 * tidies after). */
static void fdchan_hold_free(struct gmb_broker *b, struct gmb_fdhold *h,
                             int tidy) {
  struct gmb_fdchan *ch = b->fdchan;
  struct fdchan_uid *u = h->u;
  struct gmb_tenant *t = h->t;
  fdchan_weigh(b, h, 0);
  fdl_remove(&ch->holds, h, FDL_ALL);
  fdl_remove(&u->holds, h, FDL_UID);
  fdl_remove(&t->fd_holds, h, FDL_TENANT);
  if (h->s) {
    h->s->fd_hold = NULL;
  } else {
    gmb__fd_release(h->fd);
    u->kept--;
    t->fd_kept--;
    b->fd_kept--;
    if (!b->closing) gmb__broker_tenant_idled(b, t);
  }
  free(h);
  if (tidy) fdchan_uid_tidy(ch, u);
}

/* 1 when h's channel holds nothing unread any more: nothing the broker
 * sent waits in its peer's queue (SIOCOUTQ 0), whether the peer read it
 * or closed its socket (the kernel frees the queue then).  A hang-up the
 * broker's end sees proves nothing: a peer that shuts its socket down
 * (shutdown(2)) keeps its queue, and the descriptors in it, for as long
 * as it keeps the socket open. */
static int fdchan_hold_read(const struct gmb_fdhold *h) {
  return fdchan_outq(h->fd) <= 0;
}

/* Looks at up to GMB_FDCHAN_UNREAD_LOOK channels of list l (k: which
 * list), from its head: those read to the end are forgotten, the others
 * go to the tail, so that the next look sees others.  Bounded, since a
 * client may ask at its bound as often as it likes.  Along a uid's own
 * list its account stays, for the caller to tidy. */
static void fdchan_look(struct gmb_broker *b, struct gmb_fdlist *l, int k,
                        size_t most) {
  int tidy = k != FDL_UID; /* not the account whose list this is */
  size_t n = l->n < most ? l->n : most;
  for (size_t i = 0; i < n && l->first; i++) {
    struct gmb_fdhold *h = l->first;
    if (fdchan_hold_read(h)) {
      fdchan_hold_free(b, h, tidy);
    } else {
      fdl_remove(l, h, k);
      fdl_push(l, h, k);
    }
  }
}

/* The timer's sweep: GMB_FDCHAN_UNREAD_SWEEP channels of all, from where
 * the last one stopped; uid accounts left empty go. */
static void fdchan_unread_sweep(struct gmb_broker *b) {
  struct gmb_fdchan *ch = b->fdchan;
  size_t n = ch->holds.n < GMB_FDCHAN_UNREAD_SWEEP ? ch->holds.n
                                                   : GMB_FDCHAN_UNREAD_SWEEP;
  for (size_t i = 0; i < n && ch->holds.first; i++) {
    struct gmb_fdhold *h = ch->holds.first;
    if (fdchan_hold_read(h)) {
      fdchan_hold_free(b, h, 1);
    } else {
      fdl_remove(&ch->holds, h, FDL_ALL);
      fdl_push(&ch->holds, h, FDL_ALL);
    }
  }
}

/* What uid `uid` and tenant t may hold unread now: after a look at their
 * channels when `more` more would pass a bound.  Sets *by_uid and
 * *by_tenant. */
static void fdchan_unread_now(struct gmb_broker *b, uid_t uid,
                              struct gmb_tenant *t, uint64_t more,
                              uint64_t *by_uid, uint64_t *by_tenant) {
  struct gmb_fdchan *ch = b->fdchan;
  struct fdchan_uid *u = fdchan_uid_find(ch, uid);
  if (u && u->unread + more > ch->per_uid) {
    fdchan_look(b, &u->holds, FDL_UID, GMB_FDCHAN_UNREAD_LOOK);
    u = fdchan_uid_tidy(ch, u);
  }
  if (t->fd_unread + more > ch->per_tenant) {
    fdchan_look(b, &t->fd_holds, FDL_TENANT, GMB_FDCHAN_UNREAD_LOOK);
    u = fdchan_uid_find(ch, uid); /* it may have gone with its last one */
  }
  *by_uid = u ? u->unread : 0;
  *by_tenant = t->fd_unread;
}

/* 1, with the reason in why, when uid `uid` or tenant t would hold more
 * than its bound with by_uid and by_tenant descriptors unread. */
static int fdchan_bound_why(const struct gmb_fdchan *ch, uid_t uid,
                            const struct gmb_tenant *t, uint64_t by_uid,
                            uint64_t by_tenant, char *why, size_t cap) {
  /* Cut short rather than not said: a tenant's name may be long. */
  int n = 0;
  if (by_tenant > ch->per_tenant)
    n = snprintf(why, cap, "tenant %s's channels hold %" PRIu64 " "
                 "descriptors unread, its limit (%u): read them, or close "
                 "ended sessions' sockets", t->name, by_tenant - 1,
                 ch->per_tenant);
  else if (by_uid > ch->per_uid)
    n = snprintf(why, cap, "uid %ld's channels hold %" PRIu64 " "
                 "descriptors unread, its limit (%u): read them, or close "
                 "ended sessions' sockets", (long)uid, by_uid - 1,
                 ch->per_uid);
  return n > 0;
}

/* Why one more descriptor for session s would pass a bound: 0, or
 * GMB_E_LIMIT with the reason in why (counted as a refusal). */
static int fdchan_may_send(struct gmb_broker *b, struct gmb_session *s,
                           char *why, size_t cap) {
  struct gmb_fdchan *ch = b->fdchan;
  uint64_t by_uid, by_tenant;
  fdchan_unread_now(b, s->uid, s->tenant, 1, &by_uid, &by_tenant);
  if (!fdchan_bound_why(ch, s->uid, s->tenant, by_uid + 1, by_tenant + 1,
                        why, cap))
    return 0;
  s->fd_refused++;
  s->tenant->fd_refused++;
  b->fd_refused++;
  if (gmb__log_allow(&fdchan_rl_refuse))
    log_warn("session %" PRIu64 ": a descriptor refused: %s%s", s->id, why,
             gmb__log_suppressed(&fdchan_rl_refuse));
  return GMB_E_LIMIT;
}

/* b->fdconn_gone: session s ends; its channel still holds descriptors the
 * broker sent: kept, counted as before against its uid and tenant, until
 * they are read or its peer closes its end (s->fdconn becomes -1).
 * Nothing kept while the broker stops. */
static void fdchan_session_gone(struct gmb_broker *b, struct gmb_session *s) {
  struct gmb_fdhold *h = s->fd_hold;
  if (h == NULL) return;
  /* Only refusals unread (no descriptor), or all read: closed as usual. */
  if (b->closing || fdchan_hold_read(h)) {
    fdchan_hold_free(b, h, 1);
    return;
  }
  s->fd_hold = NULL;
  s->fdconn = -1;
  h->s = NULL;
  h->u->kept++;
  h->t->fd_kept++;
  b->fd_kept++;
  if (gmb__log_allow(&fdchan_rl_unread))
    log_info("session %" PRIu64 " (tenant %s, uid %u) ended with up to %u "
             "descriptors unread: its channel stays open, counted, until "
             "they are read or its peer closes it (%u such channels, %"
             PRIu64 " descriptors unread on all channels)%s", s->id,
             h->t->name, (unsigned)s->uid, h->weight, b->fd_kept,
             b->fd_unread, gmb__log_suppressed(&fdchan_rl_unread));
}

int gmb__fdchan_unread_admit(struct gmb_broker *b, uid_t uid,
                             struct gmb_tenant *t, char *why, size_t cap) {
  struct gmb_fdchan *ch = b->fdchan;
  if (ch == NULL || ch->holds.n == 0) return 0;
  /* A kept channel holds a session's place: the broker's descriptors and
   * its uid's share stay bounded by max_sessions and max_sessions_per_uid
   * (and no kept channel ever has to be closed to make room). */
  struct fdchan_uid *u = fdchan_uid_find(ch, uid);
  uint32_t kept = u ? u->kept : 0;
  uint32_t mine = gmb__sessions_of_uid(b->sessions, uid);
  size_t all = gmb__sessions_count(b->sessions);
  uint32_t max = gmb__core_max_sessions(b);
  if (kept && mine + kept >= b->cfg.max_sessions_per_uid) {
    snprintf(why, cap, "uid %ld holds %u sessions and %u channels of ended "
             "sessions whose descriptors are unread, its limit "
             "(max_sessions_per_uid %u): close those sockets or end their "
             "processes", (long)uid, mine, kept, b->cfg.max_sessions_per_uid);
    return GMB_E_LIMIT;
  }
  if (b->fd_kept && all + b->fd_kept >= max) {
    snprintf(why, cap, "the broker holds %zu sessions and %u channels of "
             "ended sessions whose descriptors are unread, its limit "
             "(max_sessions)", all, b->fd_kept);
    return GMB_E_LIMIT;
  }
  uint64_t by_uid, by_tenant;
  fdchan_unread_now(b, uid, t, 1, &by_uid, &by_tenant);
  return fdchan_bound_why(ch, uid, t, by_uid + 1, by_tenant + 1, why, cap)
             ? GMB_E_LIMIT
             : 0;
}

void gmb__fdchan_unread_bounds(const struct gmb_broker *b, uint32_t *per_uid,
                               uint32_t *per_tenant) {
  const struct gmb_fdchan *ch = b->fdchan;
  *per_uid = ch ? ch->per_uid : 0;
  *per_tenant = ch ? ch->per_tenant : 0;
}

uint64_t gmb__fdchan_unread_of_uid(const struct gmb_broker *b, uid_t uid,
                                   uint32_t *kept) {
  struct fdchan_uid *u =
      b->fdchan ? fdchan_uid_find(b->fdchan, uid) : NULL;
  if (kept) *kept = u ? u->kept : 0;
  return u ? u->unread : 0;
}

/* One list's records against the sums they make. */
static int fdchan_check_list(const struct gmb_fdlist *l, int k,
                             uint64_t unread, uint64_t kept,
                             const char *what) {
  uint64_t w = 0, n = 0, nk = 0;
  const struct gmb_fdhold *prev = NULL;
  for (const struct gmb_fdhold *h = l->first; h; h = h->link[k].next) {
    if (h->link[k].prev != prev || n > l->n) break;
    w += h->weight;
    nk += h->s == NULL;
    n++;
    prev = h;
  }
  if (n != l->n || prev != l->last || w != unread || nk != kept) {
    log_error("fdchan check: %s lists %" PRIu64 " channels (%zu counted) "
              "weighing %" PRIu64 " (%" PRIu64 " counted), %" PRIu64
              " kept (%" PRIu64 " counted)", what, n, l->n, w, unread, nk,
              kept);
    return 1;
  }
  return 0;
}

int gmb__fdchan_check(struct gmb_broker *b) {
  struct gmb_fdchan *ch = b->fdchan;
  if (ch == NULL)
    return b->fd_unread != 0 || b->fd_kept != 0;
  int bad = fdchan_check_list(&ch->holds, FDL_ALL, b->fd_unread, b->fd_kept,
                              "the broker");
  for (const struct gmb_fdhold *h = ch->holds.first; h && !bad;
       h = h->link[FDL_ALL].next) {
    if (h->weight == 0 || (h->s && (h->s->fd_hold != h ||
                                    h->s->fd_sent != h->weight ||
                                    h->s->fdconn != h->fd))) {
      log_error("fdchan check: a channel weighs %u, its session's record "
                "disagrees", h->weight);
      bad++;
    }
    if (h->t->fd_holds.first == h) /* each tenant's list once */
      bad += fdchan_check_list(&h->t->fd_holds, FDL_TENANT, h->t->fd_unread,
                               h->t->fd_kept, h->t->name);
  }
  struct fdchan_uid *u;
  RB_FOREACH(u, fdchan_uids, &ch->uids) {
    bad += fdchan_check_list(&u->holds, FDL_UID, u->unread, u->kept, "a uid");
    if (u->holds.n == 0) bad++;
  }
  return bad;
}

/* --- connections ---------------------------------------------------------- */

/* Pending connections of uid: a scan of the table, which is small. */
static size_t fdchan_pending_of(const struct gmb_fdchan *ch, uid_t uid) {
  size_t n = 0;
  for (size_t i = 0; i < GMB_FDCHAN_PENDING; i++)
    if (ch->pending[i].fd >= 0 && ch->pending[i].uid == uid) n++;
  return n;
}

void gmb__fdchan_accept(struct gmb_broker *b, uint64_t now) {
  struct gmb_fdchan *ch = b->fdchan;
  if (ch == NULL) return;
  for (int i = 0; i < FDCHAN_ACCEPT_BATCH; i++) {
    int fd = accept4(ch->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0 && (errno == EMFILE || errno == ENFILE) && ch->spare_fd >= 0) {
      /* Out of descriptors: the connection would stay queued and the
       * listener readable for ever (a busy loop).  Accept it on the spare
       * descriptor and close it: the client sees a hang-up and retries. */
      close(ch->spare_fd);
      fd = accept4(ch->listen_fd, NULL, NULL, SOCK_CLOEXEC);
      if (fd >= 0) gmb__fd_release(fd);
      ch->spare_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
      if (gmb__log_allow(&fdchan_rl_emfile))
        log_warn("descriptor channel: out of descriptors: a connection "
                 "refused%s", gmb__log_suppressed(&fdchan_rl_emfile));
      continue;
    }
    if (fd < 0) {
      if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR &&
          errno != ECONNABORTED)
        log_warn("descriptor channel: accept: %s", strerror(errno));
      return;
    }
    struct ucred cred;
    socklen_t cl = sizeof cred;
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &cl) != 0) {
      gmb__fd_release(fd); /* it can never prove a session */
      continue;
    }
    const char *full = NULL;
    if (ch->n_pending == GMB_FDCHAN_PENDING)
      full = "in all"; /* whoever fills it waits for its own deadlines */
    else if (cred.uid != 0 &&
             fdchan_pending_of(ch, cred.uid) >= GMB_FDCHAN_PENDING_PER_UID)
      full = "of this uid";
    if (full) {
      if (gmb__log_allow(&fdchan_rl_full))
        log_warn("descriptor channel: a connection of uid %ld pid %ld "
                 "refused: too many wait to authenticate %s%s",
                 (long)cred.uid, (long)cred.pid, full,
                 gmb__log_suppressed(&fdchan_rl_full));
      gmb__fd_release(fd);
      continue;
    }
    for (size_t k = 0; k < GMB_FDCHAN_PENDING; k++) {
      if (ch->pending[k].fd >= 0) continue;
      ch->pending[k].fd = fd;
      ch->pending[k].uid = cred.uid;
      ch->pending[k].deadline_ns = now + FDCHAN_AUTH_NS;
      ch->n_pending++;
      ch->gen++;
      break;
    }
  }
}

uint64_t gmb__fdchan_expire(struct gmb_broker *b, uint64_t now) {
  struct gmb_fdchan *ch = b->fdchan;
  uint64_t next = UINT64_MAX;
  if (ch == NULL) return next;
  for (size_t i = 0; i < GMB_FDCHAN_PENDING; i++) {
    struct fdchan_pending *p = &ch->pending[i];
    if (p->fd < 0) continue;
    if (p->deadline_ns <= now) {
      log_debug("descriptor channel: a connection did not authenticate "
                "within %d ms; closed", GMB_FDCHAN_AUTH_MS);
      fdchan_drop_pending(ch, p);
    } else if (p->deadline_ns - now < next) {
      next = p->deadline_ns - now;
    }
  }
  if (ch->holds.n == 0) return next;
  if (now >= ch->next_sweep_ns) {
    fdchan_unread_sweep(b);
    ch->next_sweep_ns =
        now + (uint64_t)GMB_FDCHAN_UNREAD_TICK_MS * GMB_NS_PER_MS;
  }
  if (ch->holds.n > 0 && ch->next_sweep_ns - now < next)
    next = ch->next_sweep_ns - now;
  return next;
}

/* Sends a reply (and a descriptor when fd >= 0) without waiting: a peer
 * whose socket buffer is full is not reading.  0 or -errno. */
static int fdchan_reply(int sock, uint32_t op, int status, uint64_t segment,
                        uint64_t size, int fd, const char *msg) {
  struct gmb_fd_rep rep;
  memset(&rep, 0, sizeof rep);
  rep.magic = GMB_FD_MAGIC;
  rep.op = op;
  rep.status = status;
  rep.segment = segment;
  rep.size = size;
  if (msg) snprintf(rep.message, sizeof rep.message, "%s", msg);
  return gmb__fd_send(sock, &rep, sizeof rep, status == 0 ? fd : -1,
                      MSG_DONTWAIT);
}

/*
 * The kernel refused a descriptor: the broker's user has more in flight
 * (sent, not yet received by anyone) than its RLIMIT_NOFILE, and holds no
 * CAP_SYS_RESOURCE.  Clients that do not read what they asked for put
 * them there, and the broker cannot take them back; the asker is refused
 * with a reason (on `sock`; 0 or -errno, as fdchan_reply) and its session
 * lives, since the fault is not its own.
 */
static int fdchan_inflight_refusal(int sock, uint32_t op, uint64_t segment) {
  if (gmb__log_allow(&fdchan_rl_inflight))
    log_warn("descriptor channel: the kernel refuses to pass more "
             "descriptors: too many the broker sent are still unread "
             "(more than its RLIMIT_NOFILE; clients that ask and never "
             "read)%s", gmb__log_suppressed(&fdchan_rl_inflight));
  return fdchan_reply(sock, op, GMB_E_LIMIT, segment, 0, -1,
                      "the broker has too many descriptors in flight to "
                      "clients that do not read them; try again later");
}

/* Equal secrets, in time that does not depend on where they differ. */
static int fdchan_secret_eq(const uint8_t *a, const uint8_t *b) {
  volatile uint8_t d = 0;
  for (size_t i = 0; i < GMB_FD_SECRET_LEN; i++) d |= a[i] ^ b[i];
  return d == 0;
}

void gmb__fdchan_pending_ready(struct gmb_broker *b, void *conn) {
  struct gmb_fdchan *ch = b->fdchan;
  struct fdchan_pending *p = conn;
  /* Zeroed: a short message leaves the rest as it was, and the refusal
   * echoes `op` back to a peer that proved nothing yet. */
  struct gmb_fd_req req;
  memset(&req, 0, sizeof req);
  int extra = -1;
  ssize_t n = gmb__fd_recv(p->fd, &req, sizeof req, &extra, MSG_DONTWAIT);
  if (n == -EAGAIN || n == -EWOULDBLOCK) return;
  if (extra >= 0 || n == -EPROTO) {
    /* Nobody asked it for a descriptor: closed off the loop, and so is
     * the connection, without a word. */
    gmb__fd_discard(extra);
    fdchan_drop_pending(ch, p);
    return;
  }
  if (n <= 0) {
    fdchan_drop_pending(ch, p);
    return;
  }
  if ((size_t)n != sizeof req || req.magic != GMB_FD_MAGIC ||
      req.op != GMB_FD_AUTH) {
    fdchan_reply(p->fd, req.op, GMB_E_PROTO, 0, 0, -1,
                 "the first message on the descriptor channel is AUTH");
    fdchan_drop_pending(ch, p);
    return;
  }
  struct ucred cred;
  socklen_t len = sizeof cred;
  int have_cred = getsockopt(p->fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0;
  struct gmb_session *s = gmb__session_by_id(b->sessions, req.session);
  if (s == NULL || !have_cred || cred.uid != s->uid ||
      !fdchan_secret_eq(req.secret, s->secret)) {
    if (gmb__log_allow(&fdchan_rl_auth))
      log_warn("descriptor channel: uid %ld pid %ld failed to prove session "
               "%" PRIu64 "%s", have_cred ? (long)cred.uid : -1L,
               have_cred ? (long)cred.pid : -1L, req.session,
               gmb__log_suppressed(&fdchan_rl_auth));
    fdchan_reply(p->fd, GMB_FD_AUTH, GMB_E_AUTH, 0, 0, -1,
                 "no such session for this process (wrong id, secret or "
                 "uid)");
    fdchan_drop_pending(ch, p);
    return;
  }
  if (s->fdconn >= 0) {
    fdchan_reply(p->fd, GMB_FD_AUTH, GMB_E_LIMIT, 0, 0, -1,
                 "this session has its descriptor channel already");
    fdchan_drop_pending(ch, p);
    return;
  }
  /* Its lock table's descriptor would pass its tenant's or uid's bound
   * of descriptors unread (fdchan.h). */
  char why[GMB_FD_MESSAGE_MAX];
  struct gmb_fdhold *h = NULL;
  int st = fdchan_may_send(b, s, why, sizeof why);
  if (st == 0 && (h = fdchan_hold_of(b, s, p->fd)) == NULL) {
    st = GMB_E_SYSTEM;
    snprintf(why, sizeof why, "out of host memory");
  }
  if (st) {
    fdchan_reply(p->fd, GMB_FD_AUTH, st, 0, 0, -1, why);
    fdchan_drop_pending(ch, p);
    return;
  }
  int rc = fdchan_reply(p->fd, GMB_FD_AUTH, 0, 0,
                        gmb__locktab_bytes(s->lt), gmb__locktab_fd(s->lt),
                        NULL);
  if (rc) fdchan_hold_free(b, h, 1); /* nothing was sent */
  if (rc == -ETOOMANYREFS) {
    fdchan_inflight_refusal(p->fd, GMB_FD_AUTH, 0);
    fdchan_drop_pending(ch, p);
    return;
  }
  if (rc) {
    log_info("session %" PRIu64 ": its descriptor channel closed before it "
             "got its lock table: %s", s->id, strerror(-rc));
    fdchan_drop_pending(ch, p);
    return;
  }
  /* The connection is the session's now (closed when it ends, or kept
   * while what it was sent is unread: fdchan_session_gone). */
  gmb__session_set_fdconn(b->sessions, s, p->fd);
  fdchan_weigh(b, h, 1);
  p->fd = -1;
  ch->n_pending--;
  ch->gen++;
  log_debug("session %" PRIu64 ": descriptor channel open", s->id);
}

/* 1 when session s's channel holds GMB_FDCHAN_UNREAD_ANSWERS descriptors
 * it has not read: no more are sent until it reads.  A channel read to
 * the end starts the count again. */
static int fdchan_unread_full(struct gmb_broker *b, struct gmb_session *s) {
  int out = fdchan_outq(s->fdconn);
  if (out == 0 && s->fd_hold) fdchan_hold_free(b, s->fd_hold, 1);
  return out > 0 && s->fd_sent >= GMB_FDCHAN_UNREAD_ANSWERS;
}

/* One SEGMENT request of session s: the descriptor of a segment of its
 * tenant.  0, or the reason the session must end. */
static const char *fdchan_segment(struct gmb_broker *b, struct gmb_session *s,
                                  uint64_t id) {
  void *tag = NULL;
  const struct gmb_dseg *d = gmb__pool_segment(b->pool, id, &tag);
  char msg[GMB_FD_MESSAGE_MAX];
  int status = 0, seen = 1;
  struct gmb_fdhold *h = NULL;
  if (d == NULL || tag != s->tenant) {
    status = GMB_E_NOENT;
    snprintf(msg, sizeof msg, "no segment %" PRIu64 " for tenant %s", id,
             s->tenant->name);
  } else if (d->fd < 0) {
    status = GMB_E_DEVICE;
    snprintf(msg, sizeof msg, "segment %" PRIu64 " has no descriptor on "
             "device %s", id, b->dev->desc);
  } else if (fdchan_unread_full(b, s)) {
    if (gmb__log_allow(&fdchan_rl_live))
      log_info("session %" PRIu64 " (tenant %s, uid %u): a segment refused: "
               "the %u descriptors sent before are unread%s", s->id,
               s->tenant->name, (unsigned)s->uid, s->fd_sent,
               gmb__log_suppressed(&fdchan_rl_live));
    s->fd_refused++;
    s->tenant->fd_refused++;
    b->fd_refused++;
    status = GMB_E_LIMIT;
    snprintf(msg, sizeof msg, "descriptors sent earlier are still unread: "
             "read the answers before asking again (at most %d at once)",
             GMB_FDCHAN_UNREAD_ANSWERS);
  } else if ((status = fdchan_may_send(b, s, msg, sizeof msg)) != 0) {
    /* its tenant's or uid's channels hold their bound */
  } else if ((h = fdchan_hold_of(b, s, s->fdconn)) == NULL ||
             (seen = gmb__session_seg_seen(s, id)) < 0) {
    status = GMB_E_SYSTEM;
    snprintf(msg, sizeof msg, "out of host memory");
  }
  int rc = fdchan_reply(s->fdconn, GMB_FD_SEGMENT, status, id,
                        status ? 0 : d->size, status ? -1 : d->fd,
                        status ? msg : NULL);
  if (rc == 0 && status == 0) fdchan_weigh(b, h, h->weight + 1);
  if (h && h->weight == 0) fdchan_hold_free(b, h, 1); /* nothing sent */
  if (rc == -ETOOMANYREFS) {
    /* Not given after all: no retirement is announced to s for it, and
     * on the GPU none waits for s to close it. */
    if (seen == 0) gmb__session_seg_forget(s, id);
    rc = fdchan_inflight_refusal(s->fdconn, GMB_FD_SEGMENT, id);
  }
  if (rc == -EAGAIN || rc == -EWOULDBLOCK)
    return "it does not read its descriptor channel";
  if (rc) return "its descriptor channel closed";
  return NULL;
}

void gmb__fdchan_session_ready(struct gmb_broker *b, struct gmb_session *s) {
  const char *end = NULL;
  for (int i = 0; i < GMB_FDCHAN_BATCH && end == NULL; i++) {
    struct gmb_fd_req req;
    memset(&req, 0, sizeof req);
    int extra = -1;
    ssize_t n = gmb__fd_recv(s->fdconn, &req, sizeof req, &extra,
                             MSG_DONTWAIT);
    if (n == -EAGAIN || n == -EWOULDBLOCK) return;
    if (extra >= 0 || n == -EPROTO) {
      gmb__fd_discard(extra); /* off the loop: its close may block */
      end = "it sent descriptors on its descriptor channel";
    } else if (n == 0 || n == -ECONNRESET) {
      end = "its process exited (descriptor channel closed)";
    } else if (n < 0 || (size_t)n != sizeof req || req.magic != GMB_FD_MAGIC) {
      end = "it sent garbage on its descriptor channel";
    } else if (req.op == GMB_FD_SEGMENT) {
      end = fdchan_segment(b, s, req.segment);
    } else {
      char msg[64];
      snprintf(msg, sizeof msg, "unknown request %u", (unsigned)req.op);
      int rc = fdchan_reply(s->fdconn, req.op, GMB_E_PROTO, 0, 0, -1, msg);
      if (rc == -EAGAIN || rc == -EWOULDBLOCK)
        end = "it does not read its descriptor channel";
      else if (rc)
        end = "its descriptor channel closed";
    }
  }
  if (end) gmb__core_session_end_sliced(b, s, end);
}
