/*
 * loop.c - the broker's one event loop: two ROUTER sockets, a signalfd, a
 * pidfd per watched client, the metrics endpoint, and timers (waiter
 * deadlines, heartbeats, compaction, trim, metrics).
 *
 * zmq_poll waits on all of them.  The poll set (struct gmb_loop) is rebuilt
 * only when the session table's generation changed; while a batch of
 * messages is handled, sessions may end, so pidfd results of a stale poll
 * set are ignored (poll is level triggered: a dead process is still
 * readable on the next round).  A batch of at most LOOP_BATCH messages per
 * socket is taken per round so that one busy client cannot starve the
 * others or the timers.  Messages are decoded here and handed to their
 * handler (dispatch.c, admin.c); replies leave through the sender
 * (reply.c).
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

#include "loop.h"

#include "admin.h"
#include "core.h"
#include "defrag.h"
#include "dispatch.h"
#include "gmb.h"
#include "http.h"
#include "log.h"
#include "observe.h"
#include "reply.h"
#include "session.h"
#include "util.h"
#include "waitq.h"

#define LOOP_BATCH 256
#define LOOP_TRIM_NS (2000 * GMB_NS_PER_MS)
#define LOOP_FRAG_NS (1000 * GMB_NS_PER_MS)    /* background check period */
#define LOOP_COMPACT_NS GMB_NS_PER_MS          /* compaction slice: 1 ms */
#define LOOP_PUBLISH_NS (1000 * GMB_NS_PER_MS) /* metrics to HTTP */

/* The poll set's fixed slots; the sessions' pidfds follow. */
enum {
  LOOP_SLOT_CLIENT, /* the client socket */
  LOOP_SLOT_ADMIN,  /* the admin socket */
  LOOP_SLOT_SIGNAL, /* the signalfd */
  LOOP_SLOTS_FIXED
};

struct gmb_loop {
  zmq_pollitem_t *items;
  struct gmb_session **item_sessions; /* by slot; NULL for fixed slots */
  size_t n_items, cap_items;
  int built;           /* the set matches the table of generation `gen` */
  uint64_t gen;
  int sigfd;
  struct gmb_http *http; /* the metrics endpoint, or NULL */
  uint64_t next_publish_ns;
};

/* The poll set is stale when sessions came or went since it was built. */
static int loop_stale(const struct gmb_broker *b) {
  return !b->loop->built || b->loop->gen != gmb__sessions_gen(b->sessions);
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
  b->loop = calloc(1, sizeof *b->loop);
  if (b->loop == NULL) {
    snprintf(err, errcap, "out of host memory");
    return GMB_E_SYSTEM;
  }
  b->loop->sigfd = -1;
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
  b->loop->sigfd = signalfd(-1, &set, SFD_CLOEXEC | SFD_NONBLOCK);
  if (b->loop->sigfd < 0) {
    snprintf(err, errcap, "signalfd: %s", strerror(errno));
    return GMB_E_SYSTEM;
  }

  b->zctx = zmq_ctx_new();
  if (b->zctx == NULL) {
    snprintf(err, errcap, "zmq_ctx_new: %s", zmq_strerror(zmq_errno()));
    return GMB_E_SYSTEM;
  }
  b->client_sock = loop_router(b, b->client_path, 0666, err, errcap);
  if (b->client_sock == NULL) return GMB_E_SYSTEM;
  b->admin_sock = loop_router(b, b->admin_path,
                              gmb__config_admin_mode(&b->cfg), err, errcap);
  if (b->admin_sock == NULL) return GMB_E_SYSTEM;
  /* metrics_listen was asked for and cannot be served: say so now rather
   * than run without the endpoint an operator relies on.  The server's
   * thread starts after the signal mask is set, so it never sees one. */
  if (b->cfg.metrics_listen[0]) {
    rc = gmb__http_start(b->cfg.metrics_listen, &b->loop->http, err, errcap);
    if (rc) return rc;
    log_info("serving metrics on http://%s/metrics", b->cfg.metrics_listen);
  }
  return 0;
}

void gmb__loop_close(struct gmb_broker *b) {
  struct gmb_loop *l = b->loop;
  if (l) gmb__http_stop(l->http);
  if (b->client_sock) zmq_close(b->client_sock);
  if (b->admin_sock) zmq_close(b->admin_sock);
  b->client_sock = b->admin_sock = NULL;
  if (b->zctx) zmq_ctx_term(b->zctx);
  b->zctx = NULL;
  if (b->client_path[0]) unlink(b->client_path);
  if (b->admin_path[0]) unlink(b->admin_path);
  if (l == NULL) return;
  if (l->sigfd >= 0) close(l->sigfd);
  free(l->items);
  free(l->item_sessions);
  free(l);
  b->loop = NULL;
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

static void loop_reply_error(struct gmb_broker *b, enum gmb_socket which,
                             const uint8_t *rid, size_t rid_len, int status,
                             const char *msg) {
  struct wire_reply rep;
  memset(&rep, 0, sizeof rep);
  gmb__reply_fail(&rep, status, "%s", msg);
  gmb__reply_send(b, which, rid, rid_len, &rep);
}

/* Takes one message off socket `which`; 0 when one was handled, -1 when
 * none. */
static int loop_take(struct gmb_broker *b, enum gmb_socket which) {
  void *sock = which == GMB_SOCK_ADMIN ? b->admin_sock : b->client_sock;
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
    loop_reply_error(b, which, r, rlen, GMB_E_PROTO,
                     "a request is one frame; multi-part message dropped");
  } else if (loop_peer_creds(&body, &peer) != 0) {
    log_warn("message without peer credentials dropped");
    loop_reply_error(b, which, r, rlen, GMB_E_AUTH,
                     "the broker cannot tell who sent this message");
  } else if (gmb__wire_request_decode(zmq_msg_data(&body),
                                      zmq_msg_size(&body), &req) != 0) {
    log_warn("undecodable message (%zu bytes) from uid %u pid %d",
             zmq_msg_size(&body), (unsigned)peer.uid, (int)peer.pid);
    loop_reply_error(b, which, r, rlen, GMB_E_PROTO,
                     "the message does not decode as a gmb Request");
  } else {
    struct wire_reply rep;
    uint64_t t0 = gmb__now_ns();
    if (which == GMB_SOCK_ADMIN) {
      if (gmb__admin(b, &peer, &req, &rep))
        gmb__reply_send(b, which, r, rlen, &rep);
    } else if (gmb__dispatch(b, &peer, &req, &rep)) {
      gmb__reply_send(b, which, r, rlen, &rep);
      gmb__observe_request(b->observe, req.kind, rep.status,
                           gmb__now_ns() - t0);
    }
    gmb__wire_reply_clear(&rep);
    if (b->checks && gmb__core_check(b) != 0)
      GMB_ASSERT(!"consistency check failed after a request");
  }
  zmq_msg_close(&body);
  zmq_msg_close(&rid);
  return 0;
}

static void loop_add_session(void *ctx, struct gmb_session *s) {
  struct gmb_loop *l = ctx;
  if (s->pidfd < 0) return;
  zmq_pollitem_t *it = &l->items[l->n_items];
  memset(it, 0, sizeof *it);
  it->fd = s->pidfd;
  it->events = ZMQ_POLLIN;
  l->item_sessions[l->n_items++] = s;
}

static int loop_rebuild(struct gmb_broker *b) {
  struct gmb_loop *l = b->loop;
  size_t want = LOOP_SLOTS_FIXED + gmb__sessions_count(b->sessions);
  if (want > l->cap_items) {
    size_t cap = want * 2;
    zmq_pollitem_t *it = realloc(l->items, cap * sizeof *it);
    if (it == NULL) return -1;
    l->items = it;
    struct gmb_session **ss = realloc(l->item_sessions, cap * sizeof *ss);
    if (ss == NULL) return -1;
    l->item_sessions = ss;
    l->cap_items = cap;
  }
  memset(l->items, 0, LOOP_SLOTS_FIXED * sizeof *l->items);
  memset(l->item_sessions, 0, LOOP_SLOTS_FIXED * sizeof *l->item_sessions);
  l->items[LOOP_SLOT_CLIENT].socket = b->client_sock;
  l->items[LOOP_SLOT_CLIENT].events = ZMQ_POLLIN;
  l->items[LOOP_SLOT_ADMIN].socket = b->admin_sock;
  l->items[LOOP_SLOT_ADMIN].events = ZMQ_POLLIN;
  l->items[LOOP_SLOT_SIGNAL].fd = l->sigfd;
  l->items[LOOP_SLOT_SIGNAL].events = ZMQ_POLLIN;
  l->n_items = LOOP_SLOTS_FIXED;
  gmb__sessions_each(b->sessions, loop_add_session, l);
  l->gen = gmb__sessions_gen(b->sessions);
  l->built = 1;
  return 0;
}

struct loop_hb {
  struct gmb_broker *b;
  uint64_t now;
};

static void loop_check_heartbeat(void *ctx, struct gmb_session *s) {
  struct loop_hb *h = ctx;
  if (s->pidfd >= 0) return;
  uint64_t limit = 3 * h->b->cfg.heartbeat_ms * GMB_NS_PER_MS;
  if (h->now - s->last_seen_ns > limit)
    gmb__core_session_end(h->b, s, "heartbeats stopped");
}

static void loop_signal(struct gmb_broker *b) {
  struct signalfd_siginfo si;
  while (read(b->loop->sigfd, &si, sizeof si) == (ssize_t)sizeof si) {
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
  gmb__reply_event(ctx, s, WIRE_EVENT_SHUTDOWN, 0,
                   "the broker is shutting down");
}

/* About once a second (and at the first round) the metrics text goes to
 * the HTTP endpoint, whose thread serves only that copy. */
static void loop_publish(struct gmb_broker *b, uint64_t now) {
  struct gmb_loop *l = b->loop;
  if (l->http == NULL || now < l->next_publish_ns) return;
  l->next_publish_ns = now + LOOP_PUBLISH_NS;
  char *text = gmb__observe_metrics(b);
  if (text == NULL) return; /* out of memory: the last text stays */
  gmb__http_publish(l->http, text);
  free(text);
}

int gmb__loop_run(struct gmb_broker *b) {
  struct gmb_loop *l = b->loop;
  uint64_t hb_ns = b->cfg.heartbeat_ms * GMB_NS_PER_MS;
  uint64_t next_trim = gmb__now_ns() + LOOP_TRIM_NS;
  uint64_t next_hb = gmb__now_ns() + hb_ns;
  uint64_t next_frag = gmb__now_ns() + LOOP_FRAG_NS;
  while (!b->stopping) {
    if (loop_stale(b) && loop_rebuild(b) != 0) {
      log_error("out of host memory building the poll set");
      return 1;
    }
    uint64_t now = gmb__now_ns();
    uint64_t wait_ns = gmb__waitq_expire(b, now);
    if (next_trim - now < wait_ns) wait_ns = next_trim > now ? next_trim - now : 0;
    if (next_hb > now && next_hb - now < wait_ns) wait_ns = next_hb - now;
    long timeout_ms = (long)(wait_ns / GMB_NS_PER_MS) + 1;
    if (timeout_ms > 1000) timeout_ms = 1000;
    /* Expiring waiters may have ended nothing, but be safe: a stale set is
     * rebuilt first. */
    if (loop_stale(b)) timeout_ms = 0;
    /* While compaction has work, poll without sleeping: the loop
     * alternates between a slice of compaction and the messages that
     * arrived meanwhile. */
    if (gmb__defrag_busy(b)) timeout_ms = 0;
    int rc = zmq_poll(l->items, (int)l->n_items, timeout_ms);
    if (rc < 0) {
      if (zmq_errno() == EINTR) continue;
      log_error("zmq_poll: %s", zmq_strerror(zmq_errno()));
      return 1;
    }
    if (l->items[LOOP_SLOT_SIGNAL].revents & ZMQ_POLLIN) loop_signal(b);
    for (int i = 0; i < LOOP_BATCH; i++)
      if (loop_take(b, GMB_SOCK_CLIENT) != 0) break;
    for (int i = 0; i < LOOP_BATCH; i++)
      if (loop_take(b, GMB_SOCK_ADMIN) != 0) break;
    /* Sessions that ended in this round make the pidfd results stale. */
    if (!loop_stale(b)) {
      for (size_t i = LOOP_SLOTS_FIXED; i < l->n_items; i++) {
        if (!(l->items[i].revents & ZMQ_POLLIN)) continue;
        gmb__core_session_end(b, l->item_sessions[i], "its process exited");
        break; /* the set is stale now; the next round sees the rest */
      }
    }
    now = gmb__now_ns();
    if (gmb__defrag_busy(b)) {
      gmb__defrag_tick(b, now + LOOP_COMPACT_NS);
      now = gmb__now_ns();
    }
    if (now >= next_frag) {
      gmb__defrag_timer(b, now);
      next_frag = now + LOOP_FRAG_NS;
    }
    loop_publish(b, now);
    if (now >= next_hb) {
      struct loop_hb h = {b, now};
      gmb__sessions_each(b->sessions, loop_check_heartbeat, &h);
      next_hb = now + hb_ns;
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
