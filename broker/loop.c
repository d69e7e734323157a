/*
 * loop.c - the broker's one event loop: two ROUTER sockets, a signalfd, a
 * pidfd per watched client, the metrics endpoint, the operators' HTTP
 * socket (its listener and its server's epoll descriptor: the server runs
 * here, http_admin.h), and timers (waiter deadlines, heartbeats,
 * compaction, trim, metrics, the HTTP server's).
 *
 * One epoll set waits on all of them: the descriptors, and for each
 * ZeroMQ socket the descriptor libzmq signals when the socket has
 * commands to process (ZMQ_FD).  The set (struct gmb_loop) is rebuilt only
 * when the session table's generation changed; while a batch of messages
 * is handled, sessions may end, so pidfd results of a stale set are
 * ignored (the set is level triggered: a dead process is still readable
 * on the next round).  A batch of at most LOOP_BATCH messages per socket
 * is taken per round so that one busy client cannot starve the others or
 * the timers; on the admin socket LOOP_ADMIN_BATCH, because an admin
 * request (a snapshot page) may cost a millisecond or more.  Messages are
 * decoded here and handed to their handler (dispatch.c, admin.c); replies
 * leave through the sender (reply.c).
 *
 * Why epoll and not zmq_poll: zmq_poll asks each socket for ZMQ_EVENTS
 * before and after it sleeps, and each ask costs a poll() and a getpid()
 * in libzmq; with the receive that finds the socket empty, a request cost
 * the broker about 12 more system calls than a bare ROUTER's blocking
 * receive (a system call is about 1 us on a VM).  ZMQ_FD is edge-like: it
 * is readable when commands arrived and is reset when libzmq processes
 * them, which any call on the socket may do, a send included.  So a
 * socket is read until it is empty (or its batch is spent) before the
 * wait, and a send on it after that (a timer's reply, an admin request's
 * event to a client; gmb__reply_sends counts them per socket) makes the
 * wait a poll that does not sleep and the socket read again: no message
 * is left waiting for a descriptor that was already reset.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <malloc.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>
#include <zmq.h>

#include "loop.h"

#include "admin.h"
#include "connguard.h"
#include "core.h"
#include "defrag.h"
#include "dispatch.h"
#include "endpoint.h"
#include "fdchan.h"
#include "fdpass.h"
#include "gmb.h"
#include "http.h"
#include "http_admin.h"
#include "log.h"
#include "observe.h"
#include "reclaim.h"
#include "reply.h"
#include "session.h"
#include "util.h"
#include "waitq.h"

#define LOOP_BATCH 256
/* Admin tools send one request at a time; a page of a snapshot costs up to
 * a few milliseconds, so a client that pipelines pages gets a few per
 * round, and the clients' requests are served in between. */
#define LOOP_ADMIN_BATCH 4
/* Replies queued for one admin connection that does not read them: beyond
 * this the sender drops them (reply.c), so a client that asks for pages
 * and never reads holds at most this many in the broker. */
#define LOOP_ADMIN_SNDHWM 8
#define LOOP_TRIM_NS (2000 * GMB_NS_PER_MS)
#define LOOP_FRAG_NS (1000 * GMB_NS_PER_MS)    /* background check period */
#define LOOP_COMPACT_NS GMB_NS_PER_MS          /* compaction slice: 1 ms */
#define LOOP_REAP_NS GMB_NS_PER_MS /* freeing ended sessions: 1 ms a turn */
#define LOOP_PUBLISH_NS (1000 * GMB_NS_PER_MS) /* metrics to HTTP */
/* A turn that works this long is logged: every client waits for it. */
#define LOOP_SLOW_TURN_NS (500 * GMB_NS_PER_MS)

/* The poll set's fixed slots; then per session its pidfd and its
 * descriptor channel, then the connections that have not authenticated. */
enum {
  LOOP_SLOT_CLIENT,   /* the client socket */
  LOOP_SLOT_ADMIN,    /* the admin socket */
  LOOP_SLOT_SIGNAL,   /* the signalfd */
  LOOP_SLOT_FDLISTEN, /* the descriptor channel's listener */
  LOOP_SLOT_HTTP_LISTEN, /* admin-http.sock's listener (-1: not served) */
  LOOP_SLOT_HTTP,        /* its server's epoll descriptor */
  LOOP_SLOTS_FIXED
};

/* What a slot past the fixed ones watches. */
enum loop_watch { LOOP_PIDFD, LOOP_FDCONN, LOOP_PENDING };

struct loop_item {
  enum loop_watch what;
  void *ptr; /* the session, or fdchan.c's pending connection */
};

struct gmb_loop {
  zmq_pollitem_t *items; /* revents: what the last wait saw */
  struct loop_item *watch; /* by slot; unused for the fixed slots */
  size_t n_items, cap_items;
  int epfd;                  /* the items, by slot (event data) */
  struct epoll_event *evs;   /* cap_items of them */
  int built;     /* the set matches these generations: */
  uint64_t gen, fd_gen; /* the session table's, the pending connections' */
  int sigfd;
  struct gmb_http *http; /* the metrics endpoint, or NULL */
  struct gmb_http_admin *http_admin; /* admin-http.sock, or NULL */
  uint64_t next_http_admin_ns; /* its server wants to run by then */
  uint64_t next_publish_ns;
  uint64_t taken; /* messages read off both sockets, since start */
};

/* The poll set is stale when sessions came or went since it was built. */
static int loop_stale(const struct gmb_broker *b) {
  return !b->loop->built || b->loop->gen != gmb__sessions_gen(b->sessions) ||
         b->loop->fd_gen != gmb__fdchan_gen(b);
}

/* Refuses to start over a live broker; removes a stale socket file.
 * `type` is the socket type a live owner would accept. */
static int loop_claim_path(const char *path, int type, char *err,
                           size_t errcap) {
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
  int fd = socket(AF_UNIX, type | SOCK_CLOEXEC, 0);
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
                         int sndhwm, char *err, size_t errcap) {
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
  if (sndhwm > 0) zmq_setsockopt(s, ZMQ_SNDHWM, &sndhwm, sizeof sndhwm);
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

/* A listening Unix socket of `type` at `path` with file mode `mode`
 * (bound under a tight umask: never reachable by others before the
 * chmod), non-blocking; -1 with the reason in err. */
static int loop_unix_listen(const char *path, int type, mode_t mode,
                            int backlog, char *err, size_t errcap) {
  int fd = socket(AF_UNIX, type | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    snprintf(err, errcap, "socket: %s", strerror(errno));
    return -1;
  }
  struct sockaddr_un sa;
  memset(&sa, 0, sizeof sa);
  sa.sun_family = AF_UNIX;
  memcpy(sa.sun_path, path, strlen(path) + 1);
  mode_t old = umask(0077);
  int rc = bind(fd, (struct sockaddr *)&sa, sizeof sa);
  umask(old);
  const char *what = rc != 0                      ? "bind"
                     : chmod(path, mode) != 0     ? "chmod"
                     : listen(fd, backlog) != 0   ? "listen"
                                                  : NULL;
  if (what) {
    snprintf(err, errcap, "%s %s: %s", what, path, strerror(errno));
    close(fd);
    return -1;
  }
  return fd;
}

/* The descriptor channel's socket: anyone may connect (0666), as to the
 * client socket; a connection proves its session before it gets anything
 * (fdchan.c). */
static int loop_fd_listen(struct gmb_broker *b, char *err, size_t errcap) {
  int fd = loop_unix_listen(b->fd_path, SOCK_SEQPACKET, 0666,
                            GMB_FDCHAN_PENDING, err, errcap);
  if (fd < 0) return GMB_E_SYSTEM;
  if (gmb__fdchan_open(b, fd) != 0) {
    snprintf(err, errcap, "out of host memory");
    close(fd);
    return GMB_E_SYSTEM;
  }
  return 0;
}

/* Operators' HTTP (admin-http.sock, http_admin.h): the admin socket's
 * mode, since the same uids may use it. */
static int loop_http_admin(struct gmb_broker *b, char *err, size_t errcap) {
  int fd = loop_unix_listen(b->admin_http_path, SOCK_STREAM,
                            gmb__config_admin_mode(&b->cfg), 64, err, errcap);
  if (fd < 0) return GMB_E_SYSTEM;
  return gmb__http_admin_start(b, fd, &b->loop->http_admin, err, errcap);
}

int gmb__loop_open(struct gmb_broker *b, char *err, size_t errcap) {
  b->loop = calloc(1, sizeof *b->loop);
  if (b->loop == NULL) {
    snprintf(err, errcap, "out of host memory");
    return GMB_E_SYSTEM;
  }
  b->loop->sigfd = -1;
  b->loop->epfd = -1;
  int rc = loop_mkdir_p(b->run_dir, err, errcap);
  if (rc == 0) {
    /* Clients send tokens to the sockets made here: a dir another user
     * owns or may write to could hold an impostor's socket next. */
    char why[512];
    rc = gmb__run_dir_trusted(b->run_dir, geteuid(), why, sizeof why);
    if (rc) {
      snprintf(err, errcap, "run dir refused: %s", why);
      return GMB_E_SYSTEM;
    }
  }
  if (rc) return rc;
  int n1 = snprintf(b->client_path, sizeof b->client_path, "%s/broker.sock",
                    b->run_dir);
  int n2 = snprintf(b->admin_path, sizeof b->admin_path, "%s/admin.sock",
                    b->run_dir);
  int n3 = snprintf(b->fd_path, sizeof b->fd_path, "%s/%s", b->run_dir,
                    GMB_FD_SOCKET);
  if (n1 < 0 || n2 < 0 || n3 < 0 || (size_t)n1 >= sizeof b->client_path ||
      (size_t)n2 >= sizeof b->admin_path || (size_t)n3 >= sizeof b->fd_path) {
    snprintf(err, errcap, "run dir path too long: %s", b->run_dir);
    return GMB_E_INVAL;
  }
  /* The longest name of the run dir's sockets: a run dir that held the
   * others before this socket existed still starts, without it. */
  if (b->cfg.admin_http) {
    struct sockaddr_un sa;
    size_t n = (size_t)snprintf(b->admin_http_path, sizeof b->admin_http_path,
                                "%s/%s", b->run_dir, GMB_ADMIN_HTTP_SOCKET);
    if (n >= sizeof sa.sun_path) {
      log_warn("%s/%s: too long a path for a Unix socket (%zu bytes, at "
               "most %zu): operators' HTTP is not served", b->run_dir,
               GMB_ADMIN_HTTP_SOCKET, n, sizeof sa.sun_path - 1);
      b->admin_http_path[0] = '\0';
    }
  }
  if ((rc = loop_claim_path(b->client_path, SOCK_STREAM, err, errcap)) ||
      (rc = loop_claim_path(b->admin_path, SOCK_STREAM, err, errcap)) ||
      (rc = loop_claim_path(b->fd_path, SOCK_SEQPACKET, err, errcap)) ||
      (b->admin_http_path[0] &&
       (rc = loop_claim_path(b->admin_http_path, SOCK_STREAM, err, errcap))))
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

  /* Before the sockets: libzmq accepts connections from then on. */
  if (gmb__connguard_init(b->client_path, b->admin_path) != 0)
    log_warn("connections are not counted (%s): a flood of connections to "
             "%s could exhaust the broker's descriptors", strerror(errno),
             b->client_path);
  gmb__core_conn_limits(b);
  b->zctx = zmq_ctx_new();
  if (b->zctx == NULL) {
    snprintf(err, errcap, "zmq_ctx_new: %s", zmq_strerror(zmq_errno()));
    return GMB_E_SYSTEM;
  }
  b->client_sock = loop_router(b, b->client_path, 0666, 0, err, errcap);
  if (b->client_sock == NULL) return GMB_E_SYSTEM;
  b->admin_sock =
      loop_router(b, b->admin_path, gmb__config_admin_mode(&b->cfg),
                  LOOP_ADMIN_SNDHWM, err, errcap);
  if (b->admin_sock == NULL) return GMB_E_SYSTEM;
  if ((rc = loop_fd_listen(b, err, errcap)) != 0) return rc;
  if (b->admin_http_path[0] && (rc = loop_http_admin(b, err, errcap)) != 0)
    return rc;
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
  if (l) gmb__http_admin_stop(l->http_admin);
  if (b->client_sock) zmq_close(b->client_sock);
  if (b->admin_sock) zmq_close(b->admin_sock);
  b->client_sock = b->admin_sock = NULL;
  if (b->zctx) zmq_ctx_term(b->zctx);
  b->zctx = NULL;
  gmb__fdchan_close(b);
  if (b->client_path[0]) unlink(b->client_path);
  if (b->admin_path[0]) unlink(b->admin_path);
  if (b->fd_path[0]) unlink(b->fd_path);
  if (b->admin_http_path[0]) unlink(b->admin_http_path);
  if (l == NULL) return;
  if (l->sigfd >= 0) close(l->sigfd);
  if (l->epfd >= 0) close(l->epfd);
  free(l->evs);
  free(l->items);
  free(l->watch);
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

/* Lines any local user can cause at will, one per message it sends:
 * rate-limited, with a count of those left out. */
static struct gmb_log_rl loop_rl_nocred, loop_rl_undecodable;

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
  b->loop->taken++;
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
    if (gmb__log_allow(&loop_rl_nocred))
      log_warn("message without peer credentials dropped%s",
               gmb__log_suppressed(&loop_rl_nocred));
    loop_reply_error(b, which, r, rlen, GMB_E_AUTH,
                     "the broker cannot tell who sent this message");
  } else if (gmb__wire_request_decode(zmq_msg_data(&body),
                                      zmq_msg_size(&body), &req) != 0) {
    if (gmb__log_allow(&loop_rl_undecodable))
      log_warn("undecodable message (%zu bytes) from uid %u pid %d%s",
               zmq_msg_size(&body), (unsigned)peer.uid, (int)peer.pid,
               gmb__log_suppressed(&loop_rl_undecodable));
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
    if (b->checks && (gmb__core_check(b) != 0 || gmb__fdchan_check(b) != 0))
      GMB_ASSERT(!"consistency check failed after a request");
  }
  zmq_msg_close(&body);
  zmq_msg_close(&rid);
  return 0;
}

/*
 * Takes up to `batch` messages off socket `which`: 0 when it was read
 * until empty, 1 when the batch was spent first (more may wait).
 *
 * A receive that finds the socket empty makes libzmq process the
 * socket's commands; one that finds a message does not (but every 100th).
 * Among the commands are the credits for replies the peers have read
 * (activate_write): a socket read in whole batches, as a client that
 * sends its next request as soon as it has the reply keeps it, would not
 * see them, and its replies would be dropped at the high-water mark
 * (8 on the admin socket).  So a spent batch ends as an empty read does,
 * with its commands processed (ZMQ_EVENTS).
 */
static int loop_read(struct gmb_broker *b, enum gmb_socket which, int batch) {
  int i = 0;
  while (i < batch && loop_take(b, which) == 0) i++;
  if (i < batch) return 0;
  void *sock = which == GMB_SOCK_ADMIN ? b->admin_sock : b->client_sock;
  int ev = 0;
  size_t len = sizeof ev;
  zmq_getsockopt(sock, ZMQ_EVENTS, &ev, &len);
  return 1;
}

static void loop_add(struct gmb_loop *l, int fd, enum loop_watch what,
                     void *ptr) {
  zmq_pollitem_t *it = &l->items[l->n_items];
  memset(it, 0, sizeof *it);
  it->fd = fd;
  it->events = ZMQ_POLLIN;
  l->watch[l->n_items].what = what;
  l->watch[l->n_items].ptr = ptr;
  l->n_items++;
}

static void loop_add_session(void *ctx, struct gmb_session *s) {
  struct gmb_loop *l = ctx;
  if (s->pidfd >= 0) loop_add(l, s->pidfd, LOOP_PIDFD, s);
  if (s->fdconn >= 0) loop_add(l, s->fdconn, LOOP_FDCONN, s);
}

static void loop_add_pending(void *ctx, int fd, void *conn) {
  loop_add(ctx, fd, LOOP_PENDING, conn);
}

/* A new epoll set of the items, each by its slot.  Sessions come and go
 * far less often than messages, so the set is made again rather than
 * edited; an fd that was closed since left it by itself. */
static int loop_epoll_build(struct gmb_loop *l) {
  if (l->epfd >= 0) close(l->epfd);
  l->epfd = epoll_create1(EPOLL_CLOEXEC);
  if (l->epfd < 0) {
    log_error("epoll_create1: %s", strerror(errno));
    return -1;
  }
  for (size_t i = 0; i < l->n_items; i++) {
    int fd = l->items[i].fd;
    if (l->items[i].socket) {
      size_t len = sizeof fd;
      if (zmq_getsockopt(l->items[i].socket, ZMQ_FD, &fd, &len) != 0) {
        log_error("ZMQ_FD: %s", zmq_strerror(zmq_errno()));
        return -1;
      }
    }
    if (fd < 0) continue;
    struct epoll_event ev = {.events = EPOLLIN, .data.u64 = i};
    if (epoll_ctl(l->epfd, EPOLL_CTL_ADD, fd, &ev) != 0) {
      log_error("epoll_ctl: %s", strerror(errno));
      return -1;
    }
  }
  return 0;
}

/* Waits up to timeout_ms for the set; the items' revents say what is
 * ready, as zmq_poll's would (ZMQ_POLLIN; ZMQ_POLLERR for an error or a
 * hang-up).  The number of ready items, or -1 with errno. */
static int loop_wait(struct gmb_loop *l, long timeout_ms) {
  int n = epoll_wait(l->epfd, l->evs, (int)l->n_items, (int)timeout_ms);
  for (size_t i = 0; i < l->n_items; i++) l->items[i].revents = 0;
  for (int k = 0; k < n; k++) {
    uint64_t i = l->evs[k].data.u64;
    if (i >= l->n_items) continue;
    if (l->evs[k].events & EPOLLIN) l->items[i].revents |= ZMQ_POLLIN;
    if (l->evs[k].events & (EPOLLERR | EPOLLHUP))
      l->items[i].revents |= ZMQ_POLLERR;
  }
  return n;
}

static int loop_rebuild(struct gmb_broker *b) {
  struct gmb_loop *l = b->loop;
  size_t want = LOOP_SLOTS_FIXED + 2 * gmb__sessions_count(b->sessions) +
                GMB_FDCHAN_PENDING;
  if (want > l->cap_items) {
    size_t cap = want * 2;
    zmq_pollitem_t *it = realloc(l->items, cap * sizeof *it);
    if (it == NULL) return -1;
    l->items = it;
    struct loop_item *w = realloc(l->watch, cap * sizeof *w);
    if (w == NULL) return -1;
    l->watch = w;
    struct epoll_event *ev = realloc(l->evs, cap * sizeof *ev);
    if (ev == NULL) return -1;
    l->evs = ev;
    l->cap_items = cap;
  }
  memset(l->items, 0, LOOP_SLOTS_FIXED * sizeof *l->items);
  l->items[LOOP_SLOT_CLIENT].socket = b->client_sock;
  l->items[LOOP_SLOT_CLIENT].events = ZMQ_POLLIN;
  l->items[LOOP_SLOT_ADMIN].socket = b->admin_sock;
  l->items[LOOP_SLOT_ADMIN].events = ZMQ_POLLIN;
  l->items[LOOP_SLOT_SIGNAL].fd = l->sigfd;
  l->items[LOOP_SLOT_SIGNAL].events = ZMQ_POLLIN;
  l->items[LOOP_SLOT_FDLISTEN].fd = gmb__fdchan_listener(b);
  l->items[LOOP_SLOT_FDLISTEN].events = ZMQ_POLLIN;
  l->items[LOOP_SLOT_HTTP_LISTEN].fd =
      l->http_admin ? gmb__http_admin_listen_fd(l->http_admin) : -1;
  l->items[LOOP_SLOT_HTTP_LISTEN].events = ZMQ_POLLIN;
  l->items[LOOP_SLOT_HTTP].fd =
      l->http_admin ? gmb__http_admin_epoll_fd(l->http_admin) : -1;
  l->items[LOOP_SLOT_HTTP].events = ZMQ_POLLIN;
  l->n_items = LOOP_SLOTS_FIXED;
  gmb__sessions_each(b->sessions, loop_add_session, l);
  gmb__fdchan_each_pending(b, loop_add_pending, l);
  if (loop_epoll_build(l) != 0) return -1;
  l->gen = gmb__sessions_gen(b->sessions);
  l->fd_gen = gmb__fdchan_gen(b);
  l->built = 1;
  return 0;
}

/* The first watched descriptor that is ready: a process gone, a
 * connection to read.  One per round: handling it may end sessions, which
 * makes the rest of the poll set stale. */
static void loop_watched(struct gmb_broker *b, uint64_t now) {
  struct gmb_loop *l = b->loop;
  if (l->items[LOOP_SLOT_FDLISTEN].revents & (ZMQ_POLLIN | ZMQ_POLLERR))
    gmb__fdchan_accept(b, now);
  for (size_t i = LOOP_SLOTS_FIXED; i < l->n_items && !loop_stale(b); i++) {
    if (!(l->items[i].revents & (ZMQ_POLLIN | ZMQ_POLLERR))) continue;
    switch (l->watch[i].what) {
      case LOOP_PIDFD:
        gmb__core_session_end_sliced(b, l->watch[i].ptr,
                                     "its process exited");
        break;
      case LOOP_FDCONN:
        gmb__fdchan_session_ready(b, l->watch[i].ptr);
        break;
      case LOOP_PENDING:
        gmb__fdchan_pending_ready(b, l->watch[i].ptr);
        break;
    }
    if (b->checks && l->watch[i].what != LOOP_PIDFD &&
        gmb__fdchan_check(b) != 0)
      GMB_ASSERT(!"descriptor channel check failed after its messages");
  }
}

struct loop_hb {
  struct gmb_broker *b;
  uint64_t now;
};

static void loop_check_heartbeat(void *ctx, struct gmb_session *s) {
  struct loop_hb *h = ctx;
  /* A process the broker cannot see (another PID namespace) heartbeats
   * even with its descriptor channel open: the channel tells that it
   * exited, the heartbeats that it still runs. */
  if (s->pidfd >= 0) return;
  uint64_t limit = 3 * h->b->cfg.heartbeat_ms * GMB_NS_PER_MS;
  if (h->now - s->last_seen_ns > limit)
    gmb__core_session_end_sliced(h->b, s, "heartbeats stopped");
}

static void loop_signal(struct gmb_broker *b) {
  struct signalfd_siginfo si;
  while (read(b->loop->sigfd, &si, sizeof si) == (ssize_t)sizeof si) {
    if (si.ssi_signo == SIGTERM || si.ssi_signo == SIGINT) {
      /* A second one cuts short the wait for clients at the stop. */
      log_info("signal %d: stopping%s", (int)si.ssi_signo,
               b->stopping ? " now" : "");
      b->stopping++;
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
  char *text = gmb__observe_metrics(b, b->cfg.metrics_tenants);
  if (text == NULL) return; /* out of memory: the last text stays */
  gmb__http_publish(l->http, text);
  free(text);
}

/*
 * After the sessions were told the broker stops.  On a device that counts
 * a retired segment until every holder unmapped it (cuda), the clients get
 * shutdown_grace_ms to say goodbye or exit while the loop serves their
 * Bye, SegmentClosed and hang-ups (new sessions and allocations are
 * refused).  They keep what they map either way (the driver counts
 * references); the wait lets the GPU's memory go back in order.  A second
 * SIGTERM or SIGINT ends it.
 */
static void loop_drain(struct gmb_broker *b) {
  struct gmb_loop *l = b->loop;
  size_t left = gmb__sessions_count(b->sessions);
  if (!b->dev->ops->free_waits_for_holders || b->cfg.shutdown_grace_ms == 0 ||
      left == 0)
    return;
  log_info("waiting up to %u ms for %zu sessions to unmap their segments",
           b->cfg.shutdown_grace_ms, left);
  uint64_t deadline =
      gmb__now_ns() + (uint64_t)b->cfg.shutdown_grace_ms * GMB_NS_PER_MS;
  for (;;) {
    uint64_t now = gmb__now_ns();
    left = gmb__sessions_count(b->sessions);
    if (left == 0 || now >= deadline || b->stopping > 1) break;
    if (loop_stale(b) && loop_rebuild(b) != 0) break;
    long timeout_ms = (long)((deadline - now) / GMB_NS_PER_MS) + 1;
    if (timeout_ms > 100) timeout_ms = 100;
    if (zmq_poll(l->items, (int)l->n_items, timeout_ms) < 0) {
      if (zmq_errno() == EINTR) continue;
      break;
    }
    if (l->items[LOOP_SLOT_SIGNAL].revents & ZMQ_POLLIN) loop_signal(b);
    for (int i = 0; i < LOOP_BATCH; i++)
      if (loop_take(b, GMB_SOCK_CLIENT) != 0) break;
    if (!loop_stale(b)) loop_watched(b, gmb__now_ns());
  }
  if (left)
    log_info("%zu sessions still hold segments; stopping without them",
             left);
  else
    log_info("every session is gone");
}

/* admin-http.sock: new connections, then the server's turn when one of
 * its connections is ready or its timeout came.  An operator's request
 * may end nothing (pause and resume only send events), so the poll set
 * stays valid. */
static void loop_http_admin_serve(struct gmb_broker *b) {
  struct gmb_loop *l = b->loop;
  int accept = l->items[LOOP_SLOT_HTTP_LISTEN].revents != 0;
  if (accept) gmb__http_admin_accept(l->http_admin);
  if (accept || l->items[LOOP_SLOT_HTTP].revents ||
      gmb__now_ns() >= l->next_http_admin_ns)
    gmb__http_admin_run(l->http_admin);
}

/* Says, at most every LOOP_TRIM_NS, how many connections the guard
 * refused since it last said (connguard.h: it counts in libzmq's thread,
 * which must not log). */
static void loop_report_refused(struct gmb_connguard_stats *last) {
  struct gmb_connguard_stats st;
  gmb__connguard_stats(&st);
  uint64_t total = st.refused_total - last->refused_total;
  uint64_t uid = st.refused_uid - last->refused_uid;
  uint64_t fds = st.refused_fds - last->refused_fds;
  if (total || uid || fds)
    log_warn("refused %" PRIu64 " client connections: %" PRIu64 " past the "
             "limit in all, %" PRIu64 " past a uid's limit, %" PRIu64
             " with no descriptor left (%u counted now; see max_sessions, "
             "max_sessions_per_uid)",
             total + uid + fds, total, uid, fds, st.connections);
  uint64_t adm = st.refused_admin - last->refused_admin;
  if (adm)
    log_warn("refused %" PRIu64 " connections to the admin socket past its "
             "caps (64 per operator uid; 4 per other uid, 64 of those in all; "
             "%u of other uids now)", adm, st.admin_others);
  uint64_t hs = st.refused_handshake - last->refused_handshake;
  if (hs)
    log_warn("dropped %" PRIu64 " ZeroMQ connections in their handshake: a "
             "routing id of the peer's choosing, or not ZMTP 3 with the NULL "
             "mechanism (the broker numbers its peers itself)", hs);
  uint64_t parts = st.refused_parts - last->refused_parts;
  if (parts)
    log_warn("dropped %" PRIu64 " ZeroMQ connections that sent a message "
             "of more than 4 parts (a request is one)", parts);
  *last = st;
}

/* What one turn did, for gmb_loop_turn_seconds and, when it was long,
 * the log: while it worked nobody was answered.  `work` leaves out the
 * wait for events; the clock is the wall's, so time the broker was not
 * run (a loaded machine) counts, as it does for its clients. */
struct loop_turn {
  uint64_t work, taken, slices;
  int reaping, compacting;
};

static void loop_turn_done(struct gmb_broker *b, const struct loop_turn *t) {
  static struct gmb_log_rl rl;
  double longest = gmb__observe_turn(b->observe, t->work);
  if (t->work < LOOP_SLOW_TURN_NS || !gmb__log_allow(&rl)) return;
  log_warn("a turn of the loop took %" PRIu64 " ms, in which no other "
           "request was answered: %" PRIu64 " messages, %" PRIu64
           " offload slices%s%s (the longest before: %.0f ms; "
           "gmb_loop_turn_seconds)%s",
           t->work / GMB_NS_PER_MS, t->taken, t->slices,
           t->reaping ? ", ended sessions being freed" : "",
           t->compacting ? ", compaction running" : "", longest * 1e3,
           gmb__log_suppressed(&rl));
}

int gmb__loop_run(struct gmb_broker *b) {
  struct gmb_loop *l = b->loop;
  uint64_t hb_ns = b->cfg.heartbeat_ms * GMB_NS_PER_MS;
  uint64_t next_trim = gmb__now_ns() + LOOP_TRIM_NS;
  uint64_t next_linger =
      gmb__now_ns() + (uint64_t)b->cfg.segment_linger_ms * GMB_NS_PER_MS;
  uint64_t next_hb = gmb__now_ns() + hb_ns;
  uint64_t next_frag = gmb__now_ns() + LOOP_FRAG_NS;
  uint64_t trimmed_gen = 0;
  struct gmb_connguard_stats refused = {0};
  /* Read the sockets this round: at the first, when their descriptor
   * said so, when a batch was cut short, or when a send on the socket
   * since it was last read to the end may have processed its commands
   * (mark: the socket's sends then; see the top). */
  int read_client = 1, read_admin = 1;
  uint64_t mark_client = 0, mark_admin = 0;
  while (!b->stopping) {
    /* A request that ran an offload slice in this turn (reclaim.h) is the
     * turn's slice: the job's next one waits for the next turn. */
    const uint64_t slices = b->offload.slices;
    const uint64_t turn_at = gmb__now_ns();
    struct loop_turn turn = {.taken = l->taken,
                             .reaping = b->reap_head != NULL,
                             .compacting = gmb__defrag_busy(b)};
    if (loop_stale(b) && loop_rebuild(b) != 0) {
      log_error("out of host memory building the poll set");
      return 1;
    }
    gmb__core_reap(b, 0); /* default tenants idle since a session ended */
    read_client |= gmb__reply_sends(GMB_SOCK_CLIENT) != mark_client;
    read_admin |= gmb__reply_sends(GMB_SOCK_ADMIN) != mark_admin;
    int more = 0;
    if (read_client) {
      more |= read_client = loop_read(b, GMB_SOCK_CLIENT, LOOP_BATCH);
      mark_client = gmb__reply_sends(GMB_SOCK_CLIENT);
    }
    if (read_admin) {
      more |= read_admin = loop_read(b, GMB_SOCK_ADMIN, LOOP_ADMIN_BATCH);
      mark_admin = gmb__reply_sends(GMB_SOCK_ADMIN);
    }
    uint64_t now = gmb__now_ns();
    uint64_t wait_ns = gmb__waitq_expire(b, now);
    uint64_t fd_ns = gmb__fdchan_expire(b, now);
    if (fd_ns < wait_ns) wait_ns = fd_ns;
    /* Asks of caches that ran out, and requests held for them. */
    uint64_t ask_ns = gmb__reclaim_expire(b, now);
    if (ask_ns < wait_ns) wait_ns = ask_ns;
    if (next_trim - now < wait_ns) wait_ns = next_trim > now ? next_trim - now : 0;
    if (next_hb > now && next_hb - now < wait_ns) wait_ns = next_hb - now;
    if (b->cfg.segment_linger_ms && next_linger > now &&
        next_linger - now < wait_ns)
      wait_ns = next_linger - now;
    long timeout_ms = (long)(wait_ns / GMB_NS_PER_MS) + 1;
    if (timeout_ms > 1000) timeout_ms = 1000;
    /* Expiring waiters may have ended nothing, but be safe: a stale set is
     * rebuilt first. */
    if (loop_stale(b)) timeout_ms = 0;
    /* While compaction has work, poll without sleeping: the loop
     * alternates between a slice of compaction and the messages that
     * arrived meanwhile. */
    if (gmb__defrag_busy(b)) timeout_ms = 0;
    /* The same while ended sessions' memory is freed in slices, and
     * while the broker's offload job or an operator's pause copies (a
     * slice a turn). */
    if (b->reap_head || b->waitq.held_job || b->offload.pausing)
      timeout_ms = 0;
    /* A batch cut short, or a send on a socket since it was read to the
     * end (the admin handlers send on the client socket too, and the
     * timers above on both): read them again before sleeping. */
    int sent_client = gmb__reply_sends(GMB_SOCK_CLIENT) != mark_client;
    int sent_admin = gmb__reply_sends(GMB_SOCK_ADMIN) != mark_admin;
    if (more || sent_client || sent_admin) timeout_ms = 0;
    if (l->http_admin) { /* its idle connections' timeouts, work left */
      long t = gmb__http_admin_timeout_ms(l->http_admin);
      if (t >= 0 && t < timeout_ms) timeout_ms = t;
      l->next_http_admin_ns =
          t >= 0 ? now + (uint64_t)t * GMB_NS_PER_MS : UINT64_MAX;
    }
    turn.work = gmb__now_ns() - turn_at;
    int rc = loop_wait(l, timeout_ms);
    const uint64_t woke_at = gmb__now_ns();
    if (rc < 0) {
      if (errno == EINTR) continue;
      log_error("epoll_wait: %s", strerror(errno));
      return 1;
    }
    read_client |= l->items[LOOP_SLOT_CLIENT].revents & ZMQ_POLLIN;
    read_admin |= l->items[LOOP_SLOT_ADMIN].revents & ZMQ_POLLIN;
    if (l->items[LOOP_SLOT_SIGNAL].revents & ZMQ_POLLIN) loop_signal(b);
    if (l->http_admin) loop_http_admin_serve(b);
    /* Sessions that ended in this round make the results stale: the set
     * is level triggered, the next round sees what is still ready. */
    if (!loop_stale(b)) loop_watched(b, gmb__now_ns());
    now = gmb__now_ns();
    if (b->reap_head) {
      gmb__core_reap_step(b, now + LOOP_REAP_NS);
      now = gmb__now_ns();
    }
    if (gmb__defrag_busy(b)) {
      gmb__defrag_tick(b, now + LOOP_COMPACT_NS);
      now = gmb__now_ns();
    }
    /* One slice a turn, when a request's own did not run: the offload
     * job's or an operator's pause's, taking turns when both have work. */
    if ((b->waitq.held_job || b->offload.pausing) &&
        b->offload.slices == slices) {
      gmb__reclaim_slice(b);
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
    /* Empty segments kept for reuse go back every segment_linger_ms (a
     * reload applies at the next turn); 0 keeps them until a request
     * needs their room, which makes runs that replay a trace independent
     * of the machine's speed (gmb-replay sets it). */
    uint64_t linger_ns = (uint64_t)b->cfg.segment_linger_ms * GMB_NS_PER_MS;
    if (linger_ns && now >= next_linger) {
      uint64_t freed = gmb__pool_trim(b->pool);
      if (freed)
        log_debug("trim: %" PRIu64 " bytes of idle segments released", freed);
      next_linger = now + linger_ns;
    } else if (linger_ns == 0 || next_linger > now + linger_ns) {
      next_linger = now + linger_ns; /* off, or shortened by a reload */
    }
    if (now >= next_trim) {
      /* Sessions came and went: give the heap's free pages back, so the
       * broker's RSS returns near its base after a burst of clients. */
      uint64_t gen = gmb__sessions_gen(b->sessions);
      if (gen != trimmed_gen) {
        malloc_trim(0);
        trimmed_gen = gen;
      }
      loop_report_refused(&refused);
      uint64_t hr = l->http_admin ? gmb__http_admin_refused(l->http_admin) : 0;
      if (hr)
        log_warn("refused %" PRIu64 " connections to %s past its caps (16 "
                 "per operator uid; 2 per other uid, 16 of those in all; 64 "
                 "in all)", hr, GMB_ADMIN_HTTP_SOCKET);
      next_trim = now + LOOP_TRIM_NS;
    }
    turn.work += gmb__now_ns() - woke_at;
    turn.taken = l->taken - turn.taken;
    turn.slices = b->offload.slices - slices;
    turn.reaping |= b->reap_head != NULL;
    turn.compacting |= gmb__defrag_busy(b);
    loop_turn_done(b, &turn);
  }
  gmb__defrag_shutdown(b);
  /* Operators' HTTP ends here: the drain below does not serve it, and a
   * descriptor left in its poll set would keep waking it. */
  gmb__http_admin_stop(l->http_admin);
  l->http_admin = NULL;
  l->items[LOOP_SLOT_HTTP_LISTEN].fd = l->items[LOOP_SLOT_HTTP].fd = -1;
  gmb__sessions_each(b->sessions, loop_tell_shutdown, b);
  loop_drain(b);
  return 0;
}
