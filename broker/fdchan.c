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
 * channel is what the peer has not consumed yet; a session counts the
 * descriptors sent since it last read to the end (fd_sent), an upper
 * bound of those it holds unread.  The unread channels of ended sessions
 * live in a table of at most unread_max entries (each weighs at least
 * one descriptor): n_unread entries, unread_weight their sum, never more
 * than unread_max; an entry goes when its channel's queue is empty or its
 * peer hung up, or is evicted (closed) to make room.
 */
#include "fdchan.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <linux/sockios.h>
#include <poll.h>
#include <sys/ioctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include "core.h"
#include "fdpass.h"
#include "gmb.h"
#include "locktab.h"
#include "log.h"
#include "util.h"

#define FDCHAN_AUTH_NS ((uint64_t)GMB_FDCHAN_AUTH_MS * GMB_NS_PER_MS)
#define FDCHAN_ACCEPT_BATCH 16

struct fdchan_pending {
  int fd;               /* -1: a free slot */
  uid_t uid;            /* the peer's (SO_PEERCRED at accept) */
  uint64_t deadline_ns; /* closed when not authenticated by then */
};

/* An ended session's channel whose peer has not read what it was sent. */
struct fdchan_unread {
  int fd;
  uid_t uid;
  uint32_t weight; /* descriptors it may still hold (>= 1) */
  uint64_t seq;    /* order of arrival: the oldest has the least */
  char tenant[sizeof(((struct gmb_tenant *)0)->name)];
};

/* A uid's weight, to find the heaviest when the table is full. */
struct fdchan_uid_weight {
  uid_t uid;
  uint64_t weight;
};

struct gmb_fdchan {
  int listen_fd;
  int spare_fd; /* /dev/null, closed to accept-and-close at EMFILE */
  uint64_t gen;
  size_t n_pending;
  struct fdchan_pending pending[GMB_FDCHAN_PENDING];
  /* Unread channels: unread_max entries each, in no order. */
  struct fdchan_unread *unread;
  struct fdchan_uid_weight *scratch;
  size_t n_unread, cursor; /* cursor: where the next tick starts */
  uint64_t unread_weight, seq, evicted, next_sweep_ns;
  uint32_t unread_max, unread_per_uid, unread_per_tenant;
};

static void fdchan_session_gone(struct gmb_broker *b, struct gmb_session *s);

static uint32_t fdchan_min(uint64_t a, uint64_t b) {
  return (uint32_t)(a < b ? a : b);
}

/* The bounds of unread channels under RLIMIT_NOFILE now (fdchan.h). */
static void fdchan_unread_limits(struct gmb_fdchan *ch) {
  struct rlimit rl;
  uint64_t have = UINT64_MAX;
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY)
    have = rl.rlim_cur;
  ch->unread_max = fdchan_min(GMB_FDCHAN_UNREAD, have / 32);
  if (ch->unread_max < 8) ch->unread_max = 8;
  ch->unread_per_uid = fdchan_min(GMB_FDCHAN_UNREAD_PER_UID,
                                  ch->unread_max / 4);
  ch->unread_per_tenant = fdchan_min(GMB_FDCHAN_UNREAD_PER_TENANT,
                                     ch->unread_max / 8);
}

int gmb__fdchan_open(struct gmb_broker *b, int listen_fd) {
  struct gmb_fdchan *ch = calloc(1, sizeof *ch);
  if (ch == NULL) return GMB_E_SYSTEM;
  ch->listen_fd = listen_fd;
  if (!gmb__fd_refuse_rights(listen_fd, 1))
    log_info("descriptor channel: this kernel cannot refuse descriptors "
             "(SO_PASSRIGHTS); any a client sends are closed off the loop");
  fdchan_unread_limits(ch);
  ch->unread = calloc(ch->unread_max, sizeof *ch->unread);
  ch->scratch = calloc(ch->unread_max, sizeof *ch->scratch);
  if (ch->unread == NULL || ch->scratch == NULL) {
    free(ch->unread);
    free(ch->scratch);
    free(ch);
    return GMB_E_SYSTEM;
  }
  ch->spare_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  for (size_t i = 0; i < GMB_FDCHAN_PENDING; i++) ch->pending[i].fd = -1;
  b->fdchan = ch;
  b->fdconn_gone = fdchan_session_gone;
  return 0;
}

void gmb__fdchan_close(struct gmb_broker *b) {
  struct gmb_fdchan *ch = b->fdchan;
  if (ch == NULL) return;
  for (size_t i = 0; i < GMB_FDCHAN_PENDING; i++)
    if (ch->pending[i].fd >= 0) gmb__fd_release(ch->pending[i].fd);
  for (size_t i = 0; i < ch->n_unread; i++)
    gmb__fd_release(ch->unread[i].fd);
  gmb__fd_release(ch->listen_fd); /* its backlog may hold connections */
  if (ch->spare_fd >= 0) close(ch->spare_fd);
  free(ch->unread);
  free(ch->scratch);
  free(ch);
  b->fdchan = NULL;
  b->fdconn_gone = NULL;
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
    fdchan_rl_inflight, fdchan_rl_unread, fdchan_rl_evict, fdchan_rl_live,
    fdchan_rl_refuse;

/* --- unread channels ------------------------------------------------------ */

/* Bytes the peer of `sock` has not consumed yet (SIOCOUTQ), or -1. */
static int fdchan_outq(int sock) {
  int n = 0;
  return ioctl(sock, SIOCOUTQ, &n) == 0 ? n : -1;
}

/* Closes unread channel i (the last entry takes its place). */
static void fdchan_unread_drop(struct gmb_fdchan *ch, size_t i) {
  gmb__fd_release(ch->unread[i].fd);
  ch->unread_weight -= ch->unread[i].weight;
  ch->unread[i] = ch->unread[--ch->n_unread];
}

/* 1 when unread channel `fd` has nothing unread any more, or its peer
 * closed its end (a peer that is gone had its queue freed too). */
static int fdchan_unread_done(int fd) {
  if (fdchan_outq(fd) <= 0) return 1;
  struct pollfd p = {.fd = fd, .events = POLLIN | POLLRDHUP};
  return poll(&p, 1, 0) > 0 &&
         (p.revents & (POLLHUP | POLLRDHUP | POLLERR | POLLNVAL)) != 0;
}

/* Checks up to GMB_FDCHAN_UNREAD_SWEEP unread channels, from where the
 * last tick stopped, and closes those that are done. */
static void fdchan_unread_sweep(struct gmb_fdchan *ch) {
  for (int k = 0; k < GMB_FDCHAN_UNREAD_SWEEP && ch->n_unread > 0; k++) {
    if (ch->cursor >= ch->n_unread) ch->cursor = 0;
    if (fdchan_unread_done(ch->unread[ch->cursor].fd))
      fdchan_unread_drop(ch, ch->cursor); /* the moved one is next */
    else
      ch->cursor++;
  }
}

static int fdchan_uid_cmp(const void *a, const void *b) {
  uid_t x = ((const struct fdchan_uid_weight *)a)->uid;
  uid_t y = ((const struct fdchan_uid_weight *)b)->uid;
  return x < y ? -1 : x > y;
}

/* The uid whose unread channels weigh the most (n_unread > 0). */
static uid_t fdchan_unread_heaviest(struct gmb_fdchan *ch) {
  for (size_t i = 0; i < ch->n_unread; i++) {
    ch->scratch[i].uid = ch->unread[i].uid;
    ch->scratch[i].weight = ch->unread[i].weight;
  }
  qsort(ch->scratch, ch->n_unread, sizeof *ch->scratch, fdchan_uid_cmp);
  uid_t top = ch->scratch[0].uid;
  uint64_t best = 0;
  for (size_t i = 0; i < ch->n_unread;) {
    uint64_t w = 0;
    size_t j = i;
    for (; j < ch->n_unread && ch->scratch[j].uid == ch->scratch[i].uid; j++)
      w += ch->scratch[j].weight;
    if (w > best) {
      best = w;
      top = ch->scratch[i].uid;
    }
    i = j;
  }
  return top;
}

/* Makes room for `weight` in the table: while it would weigh more than
 * unread_max, the oldest channel of the heaviest uid is closed.  What its
 * peer holds stays in flight, but the table stays bounded. */
static void fdchan_unread_room(struct gmb_fdchan *ch, uint32_t weight) {
  while (ch->n_unread > 0 &&
         ch->unread_weight + weight > ch->unread_max) {
    uid_t top = fdchan_unread_heaviest(ch);
    size_t old = ch->n_unread;
    for (size_t i = 0; i < ch->n_unread; i++)
      if (ch->unread[i].uid == top &&
          (old == ch->n_unread || ch->unread[i].seq < ch->unread[old].seq))
        old = i;
    if (gmb__log_allow(&fdchan_rl_evict))
      log_warn("descriptor channel: %" PRIu64 " descriptors sent to ended "
               "sessions are unread, the most kept (%u): the oldest channel "
               "of uid %ld (tenant %s) closed; what it holds stays counted "
               "against the broker's RLIMIT_NOFILE%s", ch->unread_weight,
               ch->unread_max, (long)top, ch->unread[old].tenant,
               gmb__log_suppressed(&fdchan_rl_evict));
    fdchan_unread_drop(ch, old);
    ch->evicted++;
  }
}

/* b->fdconn_gone: session s ends; its channel still holds descriptors the
 * broker sent: kept as an unread channel of its uid and tenant
 * (s->fdconn becomes -1).  Nothing while the broker stops. */
static void fdchan_session_gone(struct gmb_broker *b, struct gmb_session *s) {
  struct gmb_fdchan *ch = b->fdchan;
  if (ch == NULL || b->closing || s->fdconn < 0 || s->fd_sent == 0) return;
  /* Only refusals unread (no descriptor), or all read: closed as usual. */
  if (fdchan_outq(s->fdconn) <= 0) return;
  uint32_t w = fdchan_min(s->fd_sent, ch->unread_max);
  fdchan_unread_room(ch, w);
  GMB_ASSERT(ch->n_unread < ch->unread_max &&
             "each unread channel weighs at least one descriptor");
  struct fdchan_unread *e = &ch->unread[ch->n_unread++];
  e->fd = s->fdconn;
  e->uid = s->uid;
  e->weight = w;
  e->seq = ++ch->seq;
  snprintf(e->tenant, sizeof e->tenant, "%s", s->tenant->name);
  ch->unread_weight += w;
  s->fdconn = -1;
  if (gmb__log_allow(&fdchan_rl_unread))
    log_info("session %" PRIu64 " (tenant %s, uid %u) ended with up to %u "
             "descriptors unread: its channel stays open until they are "
             "read or its peer closes it (%zu such channels, %" PRIu64
             " descriptors)%s", s->id, e->tenant, (unsigned)s->uid, w,
             ch->n_unread, ch->unread_weight,
             gmb__log_suppressed(&fdchan_rl_unread));
}

int gmb__fdchan_unread_admit(const struct gmb_broker *b, uid_t uid,
                             const char *tenant, char *why, size_t cap) {
  const struct gmb_fdchan *ch = b->fdchan;
  if (ch == NULL || ch->n_unread == 0) return 0;
  uint64_t by_uid = 0, by_tenant = 0;
  for (size_t i = 0; i < ch->n_unread; i++) {
    if (ch->unread[i].uid == uid) by_uid += ch->unread[i].weight;
    if (strcmp(ch->unread[i].tenant, tenant) == 0)
      by_tenant += ch->unread[i].weight;
  }
  if (by_tenant >= ch->unread_per_tenant)
    snprintf(why, cap, "tenant %s left %" PRIu64 " descriptors unread in "
             "ended sessions (limit %u): close those sockets or end their "
             "processes", tenant, by_tenant, ch->unread_per_tenant);
  else if (by_uid >= ch->unread_per_uid)
    snprintf(why, cap, "uid %ld left %" PRIu64 " descriptors unread in "
             "ended sessions (limit %u): close those sockets or end their "
             "processes", (long)uid, by_uid, ch->unread_per_uid);
  else
    return 0;
  return GMB_E_LIMIT;
}

void gmb__fdchan_unread_stats(const struct gmb_broker *b, size_t *channels,
                              uint64_t *descriptors, uint64_t *evicted) {
  const struct gmb_fdchan *ch = b->fdchan;
  *channels = ch ? ch->n_unread : 0;
  *descriptors = ch ? ch->unread_weight : 0;
  *evicted = ch ? ch->evicted : 0;
}

void gmb__fdchan_unread_bounds(const struct gmb_broker *b, uint32_t *all,
                               uint32_t *per_uid, uint32_t *per_tenant) {
  const struct gmb_fdchan *ch = b->fdchan;
  *all = ch ? ch->unread_max : 0;
  *per_uid = ch ? ch->unread_per_uid : 0;
  *per_tenant = ch ? ch->unread_per_tenant : 0;
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
  if (ch->n_unread == 0) return next;
  if (now >= ch->next_sweep_ns) {
    fdchan_unread_sweep(ch);
    ch->next_sweep_ns =
        now + (uint64_t)GMB_FDCHAN_UNREAD_TICK_MS * GMB_NS_PER_MS;
  }
  if (ch->n_unread > 0 && ch->next_sweep_ns - now < next)
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
  /* Its tenant or uid left too much unread since its Hello. */
  char why[GMB_FD_MESSAGE_MAX];
  if (gmb__fdchan_unread_admit(b, s->uid, s->tenant->name, why,
                               sizeof why) != 0) {
    if (gmb__log_allow(&fdchan_rl_refuse))
      log_warn("session %" PRIu64 ": its descriptor channel refused: %s%s",
               s->id, why, gmb__log_suppressed(&fdchan_rl_refuse));
    fdchan_reply(p->fd, GMB_FD_AUTH, GMB_E_LIMIT, 0, 0, -1, why);
    fdchan_drop_pending(ch, p);
    return;
  }
  int rc = fdchan_reply(p->fd, GMB_FD_AUTH, 0, 0,
                        gmb__locktab_bytes(s->lt), gmb__locktab_fd(s->lt),
                        NULL);
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
  s->fd_sent = 1;
  p->fd = -1;
  ch->n_pending--;
  ch->gen++;
  log_debug("session %" PRIu64 ": descriptor channel open", s->id);
}

/* 1 when session s's channel holds GMB_FDCHAN_UNREAD_ANSWERS descriptors
 * it has not read: no more are sent until it reads.  A channel read to
 * the end starts the count again. */
static int fdchan_unread_full(struct gmb_session *s) {
  int out = fdchan_outq(s->fdconn);
  if (out == 0) s->fd_sent = 0;
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
  if (d == NULL || tag != s->tenant) {
    status = GMB_E_NOENT;
    snprintf(msg, sizeof msg, "no segment %" PRIu64 " for tenant %s", id,
             s->tenant->name);
  } else if (d->fd < 0) {
    status = GMB_E_DEVICE;
    snprintf(msg, sizeof msg, "segment %" PRIu64 " has no descriptor on "
             "device %s", id, b->dev->desc);
  } else if (fdchan_unread_full(s)) {
    if (gmb__log_allow(&fdchan_rl_live))
      log_info("session %" PRIu64 " (tenant %s, uid %u): a segment refused: "
               "the %u descriptors sent before are unread%s", s->id,
               s->tenant->name, (unsigned)s->uid, s->fd_sent,
               gmb__log_suppressed(&fdchan_rl_live));
    status = GMB_E_LIMIT;
    snprintf(msg, sizeof msg, "descriptors sent earlier are still unread: "
             "read the answers before asking again (at most %d at once)",
             GMB_FDCHAN_UNREAD_ANSWERS);
  } else if ((seen = gmb__session_seg_seen(s, id)) < 0) {
    status = GMB_E_SYSTEM;
    snprintf(msg, sizeof msg, "out of host memory");
  }
  int rc = fdchan_reply(s->fdconn, GMB_FD_SEGMENT, status, id,
                        status ? 0 : d->size, status ? -1 : d->fd,
                        status ? msg : NULL);
  if (rc == 0 && status == 0) s->fd_sent++;
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
