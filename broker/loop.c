/*
 * loop.c - the broker's one event loop: two ROUTER sockets, a signalfd, a
 * pidfd per watched client, and timers (waiter deadlines, heartbeats, trim).
 *
 * zmq_poll waits on all of them.  The poll set is rebuilt only when the
 * session table changed; while a batch of messages is handled, sessions
 * may end, so pidfd results of a stale poll set are ignored (poll is level
 * triggered: a dead process is still readable on the next round).  A batch
 * of at most LOOP_BATCH messages per socket is taken per round so that one
 * busy client cannot starve the others or the timers.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>
#include <zmq.h>

#include "broker.h"
#include "gmb.h"
#include "log.h"
#include "observe.h"
#include "session.h"
#include "util.h"

#define LOOP_BATCH 256
#define LOOP_TRIM_NS (2000ull * 1000000ull)
#define LOOP_FRAG_NS (1000ull * 1000000ull)  /* background check period */
#define LOOP_COMPACT_NS (1000000ull)  /* compaction slice per round: 1 ms */

/* The poll set, rebuilt from the session table when it is dirty. */
static zmq_pollitem_t *loop_items;
static struct gmb_session **loop_item_sessions;
static size_t loop_n_items, loop_cap_items;
static int loop_dirty = 1;

void gmb__loop_sessions_changed(struct gmb_broker *b) {
  (void)b;
  loop_dirty = 1;
}

/* Refuses to start over a live broker; removes a stale socket file. */
static int loop_claim_path(const char *path, char *err, size_t errcap) {
  struct sockaddr_un sa;
  if (strlen(path) >= sizeof sa.sun_path) {
    snprintf(err, errcap, "socket path too long (%zu bytes, max %zu): %s",
             strlen(path), sizeof sa.sun_path - 1, path);
    return GMB_E_INVAL;
  }
  struct stat st;
  if (lstat(path, &st) != 0) return 0;
  if (!S_ISSOCK(st.st_mode)) {
    snprintf(err, errcap, "%s exists and is not a socket; not touching it",
             path);
    return GMB_E_INVAL;
  }
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    snprintf(err, errcap, "socket: %s", strerror(errno));
    return GMB_E_SYSTEM;
  }
  memset(&sa, 0, sizeof sa);
  sa.sun_family = AF_UNIX;
  memcpy(sa.sun_path, path, strlen(path) + 1);
  int live = connect(fd, (struct sockaddr *)&sa, sizeof sa) == 0;
  close(fd);
  if (live) {
    snprintf(err, errcap, "another broker is already serving %s", path);
    return GMB_E_INVAL;
  }
  unlink(path);
  return 0;
}

static int loop_mkdir_p(const char *dir, char *err, size_t errcap) {
  char tmp[PATH_MAX];
  snprintf(tmp, sizeof tmp, "%s", dir);
  for (char *p = tmp + 1; *p; p++) {
    if (*p != '/') continue;
    *p = '\0';
    if (mkdir(tmp, 0755) != 0 && errno != EEXIST) goto fail;
    *p = '/';
  }
  if (mkdir(tmp, 0755) != 0 && errno != EEXIST) goto fail;
  return 0;
fail:
  snprintf(err, errcap, "cannot create run dir %s: %s", tmp, strerror(errno));
  return GMB_E_SYSTEM;
}

static void *loop_router(struct gmb_broker *b, const char *path, mode_t mode,
                         char *err, size_t errcap) {
  void *s = zmq_socket(b->zctx, ZMQ_ROUTER);
  if (s == NULL) {
    snprintf(err, errcap, "zmq_socket: %s", zmq_strerror(zmq_errno()));
    return NULL;
  }
  /* Options must be set before bind to apply to accepted connections. */
  int64_t maxmsg = GMB_MAX_MSG_SIZE;
  int one = 1, linger = 200;
  zmq_setsockopt(s, ZMQ_MAXMSGSIZE, &maxmsg, sizeof maxmsg);
  zmq_setsockopt(s, ZMQ_ROUTER_MANDATORY, &one, sizeof one);
  zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof linger);
  char ep[PATH_MAX + 8];
  snprintf(ep, sizeof ep, "ipc://%s", path);
  /* Bind under a tight umask, then open up as wanted: no window in which
   * the admin socket is reachable by others. */
  mode_t old = umask(0077);
  int rc = zmq_bind(s, ep);
  umask(old);
  if (rc != 0) {
    snprintf(err, errcap, "cannot bind %s: %s", ep, zmq_strerror(zmq_errno()));
    zmq_close(s);
    return NULL;
  }
  if (chmod(path, mode) != 0) {
    snprintf(err, errcap, "chmod %s: %s", path, strerror(errno));
    zmq_close(s);
    return NULL;
  }
  return s;
}

int gmb__loop_open(struct gmb_broker *b, char *err, size_t errcap) {
  int rc = loop_mkdir_p(b->run_dir, err, errcap);
  if (rc) return rc;
  int n1 = snprintf(b->client_path, sizeof b->client_path, "%s/broker.sock",
                    b->run_dir);
  int n2 = snprintf(b->admin_path, sizeof b->admin_path, "%s/admin.sock",
                    b->run_dir);
  if (n1 < 0 || n2 < 0 || (size_t)n1 >= sizeof b->client_path ||
      (size_t)n2 >= sizeof b->admin_path) {
    snprintf(err, errcap, "run dir path too long: %s", b->run_dir);
    return GMB_E_INVAL;
  }
  if ((rc = loop_claim_path(b->client_path, err, errcap)) ||
      (rc = loop_claim_path(b->admin_path, err, errcap)))
    return rc;

  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGHUP);
  sigprocmask(SIG_BLOCK, &set, NULL);
  signal(SIGPIPE, SIG_IGN);
  b->sigfd = signalfd(-1, &set, SFD_CLOEXEC | SFD_NONBLOCK);
  if (b->sigfd < 0) {
    snprintf(err, errcap, "signalfd: %s", strerror(errno));
    return GMB_E_SYSTEM;
  }

  b->zctx = zmq_ctx_new();
  if (b->zctx == NULL) {
    snprintf(err, errcap, "zmq_ctx_new: %s", zmq_strerror(zmq_errno()));
    return GMB_E_SYSTEM;
  }
  /* The admin socket is 0600 unless admin_uids names another uid, in which
   * case the per-message uid check is what keeps others out. */
  mode_t admin_mode = 0600;
  for (size_t i = 0; i < b->cfg.n_admin_uids; i++)
    if (b->cfg.admin_uids[i] != geteuid()) admin_mode = 0666;
  b->client_sock = loop_router(b, b->client_path, 0666, err, errcap);
  if (b->client_sock == NULL) return GMB_E_SYSTEM;
  b->admin_sock = loop_router(b, b->admin_path, admin_mode, err, errcap);
  if (b->admin_sock == NULL) return GMB_E_SYSTEM;
  return 0;
}

void gmb__loop_close(struct gmb_broker *b) {
  if (b->client_sock) zmq_close(b->client_sock);
  if (b->admin_sock) zmq_close(b->admin_sock);
  b->client_sock = b->admin_sock = NULL;
  if (b->zctx) zmq_ctx_term(b->zctx);
  b->zctx = NULL;
  if (b->client_path[0]) unlink(b->client_path);
  if (b->admin_path[0]) unlink(b->admin_path);
  if (b->sigfd >= 0) close(b->sigfd);
  b->sigfd = -1;
  free(loop_items);
  free(loop_item_sessions);
  loop_items = NULL;
  loop_item_sessions = NULL;
  loop_n_items = loop_cap_items = 0;
  loop_dirty = 1;
}

void gmb__loop_send(struct gmb_broker *b, void *sock, const uint8_t *rid,
                    size_t rid_len, const struct wire_reply *rep) {
  (void)b;
  uint8_t *buf = NULL;
  size_t len = 0;
  int rc = gmb__wire_reply_encode(rep, &buf, &len);
  if (rc) {
    log_error("cannot encode a reply: %s", gmb_strerror(rc));
    return;
  }
  if (zmq_send(sock, rid, rid_len, ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0 ||
      zmq_send(sock, buf, len, ZMQ_DONTWAIT) < 0)
    log_debug("reply %" PRIu64 " dropped: %s", rep->id,
              zmq_strerror(zmq_errno()));
  free(buf);
}

/* "localhost:UID:GID:PID" (libzmq, from SO_PEERCRED): the last three. */
static int loop_peer_creds(zmq_msg_t *m, struct gmb_peer *p) {
  const char *a = zmq_msg_gets(m, "Peer-Address");
  if (a == NULL) return -1;
  const char *c3 = strrchr(a, ':');
  if (c3 == NULL || c3 == a) return -1;
  const char *c2 = c3 - 1;
  while (c2 > a && *c2 != ':') c2--;
  if (*c2 != ':' || c2 == a) return -1;
  const char *c1 = c2 - 1;
  while (c1 > a && *c1 != ':') c1--;
  if (*c1 != ':') return -1;
  char *end;
  unsigned long uid = strtoul(c1 + 1, &end, 10);
  if (end != c2) return -1;
  unsigned long gid = strtoul(c2 + 1, &end, 10);
  if (end != c3) return -1;
  long pid = strtol(c3 + 1, &end, 10);
  if (*end != '\0' || pid < 0) return -1;
  p->uid = (uid_t)uid;
  p->gid = (gid_t)gid;
  p->pid = (pid_t)pid;
  return 0;
}

static void loop_reply_error(struct gmb_broker *b, void *sock,
                             const uint8_t *rid, size_t rid_len, int status,
                             const char *msg) {
  struct wire_reply rep;
  memset(&rep, 0, sizeof rep);
  rep.status = status;
  snprintf(rep.message, sizeof rep.message, "%s", msg);
  gmb__loop_send(b, sock, rid, rid_len, &rep);
}

/* Takes one message off `sock`; 0 when one was handled, -1 when none. */
static int loop_take(struct gmb_broker *b, void *sock, int admin) {
  zmq_msg_t rid, body;
  zmq_msg_init(&rid);
  if (zmq_msg_recv(&rid, sock, ZMQ_DONTWAIT) < 0) {
    zmq_msg_close(&rid);
    return -1;
  }
  if (!zmq_msg_more(&rid)) { /* a ROUTER always gives the routing id first */
    zmq_msg_close(&rid);
    return 0;
  }
  zmq_msg_init(&body);
  zmq_msg_recv(&body, sock, 0);
  int extra = 0;
  while (zmq_msg_more(&body)) { /* a multi-part message is not ours */
    extra = 1;
    zmq_msg_close(&body);
    zmq_msg_init(&body);
    zmq_msg_recv(&body, sock, 0);
  }
  const uint8_t *r = zmq_msg_data(&rid);
  size_t rlen = zmq_msg_size(&rid);
  struct gmb_peer peer = {.rid = r, .rid_len = rlen};
  struct wire_request req;
  if (extra) {
    loop_reply_error(b, sock, r, rlen, GMB_E_PROTO,
                     "a request is one frame; multi-part message dropped");
  } else if (loop_peer_creds(&body, &peer) != 0) {
    log_warn("message without peer credentials dropped");
    loop_reply_error(b, sock, r, rlen, GMB_E_AUTH,
                     "the broker cannot tell who sent this message");
  } else if (gmb__wire_request_decode(zmq_msg_data(&body),
                                      zmq_msg_size(&body), &req) != 0) {
    log_warn("undecodable message (%zu bytes) from uid %u pid %d",
             zmq_msg_size(&body), (unsigned)peer.uid, (int)peer.pid);
    loop_reply_error(b, sock, r, rlen, GMB_E_PROTO,
                     "the message does not decode as a gmb Request");
  } else {
    struct wire_reply rep;
    uint64_t t0 = gmb__now_ns();
    if (admin) {
      if (gmb__admin(b, &peer, &req, &rep))
        gmb__loop_send(b, sock, r, rlen, &rep);
    } else if (gmb__dispatch(b, &peer, &req, &rep)) {
      gmb__loop_send(b, sock, r, rlen, &rep);
      gmb__observe_request(b, req.kind, rep.status, gmb__now_ns() - t0);
    }
    gmb__wire_reply_clear(&rep);
    if (b->checks && gmb__broker_check(b) != 0)
      GMB_ASSERT(!"consistency check failed after a request");
  }
  zmq_msg_close(&body);
  zmq_msg_close(&rid);
  return 0;
}

struct loop_collect {
  size_t n;
};

static void loop_add_session(void *ctx, struct gmb_session *s) {
  struct loop_collect *c = ctx;
  if (s->pidfd < 0) return;
  loop_items[c->n].socket = NULL;
  loop_items[c->n].fd = s->pidfd;
  loop_items[c->n].events = ZMQ_POLLIN;
  loop_items[c->n].revents = 0;
  loop_item_sessions[c->n] = s;
  c->n++;
}

static int loop_rebuild(struct gmb_broker *b) {
  size_t want = 3 + gmb__sessions_count(b->sessions);
  if (want > loop_cap_items) {
    size_t cap = want * 2;
    zmq_pollitem_t *it = realloc(loop_items, cap * sizeof *it);
    if (it == NULL) return -1;
    loop_items = it;
    struct gmb_session **ss = realloc(loop_item_sessions, cap * sizeof *ss);
    if (ss == NULL) return -1;
    loop_item_sessions = ss;
    loop_cap_items = cap;
  }
  memset(loop_items, 0, 3 * sizeof *loop_items);
  loop_items[0].socket = b->client_sock;
  loop_items[0].events = ZMQ_POLLIN;
  loop_items[1].socket = b->admin_sock;
  loop_items[1].events = ZMQ_POLLIN;
  loop_items[2].fd = b->sigfd;
  loop_items[2].events = ZMQ_POLLIN;
  struct loop_collect c = {3};
  gmb__sessions_each(b->sessions, loop_add_session, &c);
  loop_n_items = c.n;
  loop_dirty = 0;
  return 0;
}

struct loop_hb {
  struct gmb_broker *b;
  uint64_t now;
};

static void loop_check_heartbeat(void *ctx, struct gmb_session *s) {
  struct loop_hb *h = ctx;
  if (s->pidfd >= 0) return;
  uint64_t limit = 3ull * h->b->cfg.heartbeat_ms * 1000000ull;
  if (h->now - s->last_seen_ns > limit)
    gmb__session_end(h->b, s, "heartbeats stopped");
}

static void loop_signal(struct gmb_broker *b) {
  struct signalfd_siginfo si;
  while (read(b->sigfd, &si, sizeof si) == (ssize_t)sizeof si) {
    if (si.ssi_signo == SIGTERM || si.ssi_signo == SIGINT) {
      log_info("signal %d: stopping", (int)si.ssi_signo);
      b->stopping = 1;
    } else if (si.ssi_signo == SIGHUP) {
      char err[512];
      if (gmb__admin_reload(b, err, sizeof err) == 0)
        log_info("SIGHUP: configuration reloaded");
      else
        log_error("SIGHUP: reload failed, the running configuration is "
                  "kept: %s", err);
    }
  }
}

static void loop_tell_shutdown(void *ctx, struct gmb_session *s) {
  struct gmb_broker *b = ctx;
  struct wire_reply ev;
  memset(&ev, 0, sizeof ev);
  ev.kind = WIRE_EVENT;
  ev.u.event.kind = WIRE_EVENT_SHUTDOWN;
  snprintf(ev.message, sizeof ev.message, "the broker is shutting down");
  gmb__loop_send(b, b->client_sock, s->rid, s->rid_len, &ev);
}

int gmb__loop_run(struct gmb_broker *b) {
  uint64_t next_trim = gmb__now_ns() + LOOP_TRIM_NS;
  uint64_t next_hb = gmb__now_ns() + b->cfg.heartbeat_ms * 1000000ull;
  uint64_t next_frag = gmb__now_ns() + LOOP_FRAG_NS;
  while (!b->stopping) {
    if (loop_dirty && loop_rebuild(b) != 0) {
      log_error("out of host memory building the poll set");
      return 1;
    }
    uint64_t now = gmb__now_ns();
    uint64_t wait_ns = gmb__dispatch_expire_waiters(b, now);
    if (next_trim - now < wait_ns) wait_ns = next_trim > now ? next_trim - now : 0;
    if (next_hb > now && next_hb - now < wait_ns) wait_ns = next_hb - now;
    long timeout_ms = (long)(wait_ns / 1000000u) + 1;
    if (timeout_ms > 1000) timeout_ms = 1000;
    if (loop_dirty) timeout_ms = 0; /* expiring waiters changed nothing of
                                       the poll set, but be safe */
    /* While compaction has work, poll without sleeping: the loop
     * alternates between a slice of compaction and the messages that
     * arrived meanwhile. */
    if (b->compacting || b->compact_reqs) timeout_ms = 0;
    int rc = zmq_poll(loop_items, (int)loop_n_items, timeout_ms);
    if (rc < 0) {
      if (zmq_errno() == EINTR) continue;
      log_error("zmq_poll: %s", zmq_strerror(zmq_errno()));
      return 1;
    }
    if (loop_items[2].revents & ZMQ_POLLIN) loop_signal(b);
    /* Sessions that end in this round make the pidfd results stale. */
    int stale = 0;
    for (int i = 0; i < LOOP_BATCH; i++)
      if (loop_take(b, b->client_sock, 0) != 0) break;
    for (int i = 0; i < LOOP_BATCH; i++)
      if (loop_take(b, b->admin_sock, 1) != 0) break;
    stale = loop_dirty;
    if (!stale) {
      for (size_t i = 3; i < loop_n_items; i++) {
        if (!(loop_items[i].revents & ZMQ_POLLIN)) continue;
        gmb__session_end(b, loop_item_sessions[i], "its process exited");
        break; /* the set is stale now; the next round sees the rest */
      }
    }
    now = gmb__now_ns();
    if (b->compacting || b->compact_reqs) {
      gmb__defrag_tick(b, now + LOOP_COMPACT_NS);
      now = gmb__now_ns();
    }
    if (now >= next_frag) {
      gmb__defrag_timer(b, now);
      next_frag = now + LOOP_FRAG_NS;
    }
    gmb__observe_tick(b, now); /* publishes metrics to HTTP once a second */
    if (now >= next_hb) {
      struct loop_hb h = {b, now};
      gmb__sessions_each(b->sessions, loop_check_heartbeat, &h);
      next_hb = now + b->cfg.heartbeat_ms * 1000000ull;
    }
    if (now >= next_trim) {
      uint64_t freed = gmb__pool_trim(b->pool);
      if (freed)
        log_debug("trim: %" PRIu64 " bytes of idle segments released", freed);
      next_trim = now + LOOP_TRIM_NS;
    }
  }
  gmb__defrag_shutdown(b);
  gmb__sessions_each(b->sessions, loop_tell_shutdown, b);
  return 0;
}
