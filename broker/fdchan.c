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
 */
#include "fdchan.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
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

struct gmb_fdchan {
  int listen_fd;
  int spare_fd; /* /dev/null, closed to accept-and-close at EMFILE */
  uint64_t gen;
  size_t n_pending;
  struct fdchan_pending pending[GMB_FDCHAN_PENDING];
};

int gmb__fdchan_open(struct gmb_broker *b, int listen_fd) {
  struct gmb_fdchan *ch = calloc(1, sizeof *ch);
  if (ch == NULL) return GMB_E_SYSTEM;
  ch->listen_fd = listen_fd;
  if (!gmb__fd_refuse_rights(listen_fd, 1))
    log_info("descriptor channel: this kernel cannot refuse descriptors "
             "(SO_PASSRIGHTS); any a client sends are closed off the loop");
  ch->spare_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  for (size_t i = 0; i < GMB_FDCHAN_PENDING; i++) ch->pending[i].fd = -1;
  b->fdchan = ch;
  return 0;
}

void gmb__fdchan_close(struct gmb_broker *b) {
  struct gmb_fdchan *ch = b->fdchan;
  if (ch == NULL) return;
  for (size_t i = 0; i < GMB_FDCHAN_PENDING; i++)
    if (ch->pending[i].fd >= 0) gmb__fd_release(ch->pending[i].fd);
  gmb__fd_release(ch->listen_fd); /* its backlog may hold connections */
  if (ch->spare_fd >= 0) close(ch->spare_fd);
  free(ch);
  b->fdchan = NULL;
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
    fdchan_rl_inflight;

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
  /* The connection is the session's now (closed when it ends). */
  gmb__session_set_fdconn(b->sessions, s, p->fd);
  p->fd = -1;
  ch->n_pending--;
  ch->gen++;
  log_debug("session %" PRIu64 ": descriptor channel open", s->id);
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
  } else if ((seen = gmb__session_seg_seen(s, id)) < 0) {
    status = GMB_E_SYSTEM;
    snprintf(msg, sizeof msg, "out of host memory");
  }
  int rc = fdchan_reply(s->fdconn, GMB_FD_SEGMENT, status, id,
                        status ? 0 : d->size, status ? -1 : d->fd,
                        status ? msg : NULL);
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
