/*
 * fuzz_fdchan.c - libFuzzer target: the descriptor channel's handler
 * (broker/fdchan.c) reading what a client sends on fd.sock, with a whole
 * broker in this process (as tests/unit/check_fdchan.c drives it) and a
 * real AF_UNIX SOCK_SEQPACKET connection.
 *
 * The broker and its listening socket (in a scratch dir) live for the
 * whole run.  Each input opens a session through the real Hello (this
 * process's uid), allocates twice so its tenant has segments, connects to
 * fd.sock and sends the input as datagrams.  A record is
 *
 *   byte 0   what: 0 raw bytes; 1 a valid AUTH of the session (the bytes
 *            that follow overwrite its tail); 2 a SEGMENT request of the
 *            session, for its first or second segment or the id in the
 *            bytes; bit 7: a descriptor rides along, of /dev/null, or
 *            with bit 6 too, a socket with SO_LINGER set (a descriptor
 *            whose close could block: the broker must close it off its
 *            loop, and keep none)
 *   byte 1   the length of the bytes that follow (cut to what is left)
 *
 * After each datagram the broker reads the connection as the loop would
 * (pending_ready before AUTH, session_ready after) and every reply is
 * read back, its descriptor closed.  At the end of the input the client
 * hangs up, the broker must see it (the session ends), and then: the
 * consistency check is 0, no pending connection remains after their
 * deadline, and this process has exactly as many descriptors as before
 * the input (nothing the peer sent or was sent is kept).
 */
#include <dirent.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "broker.h"
#include "config.h"
#include "core.h"
#include "dispatch.h"
#include "fdchan.h"
#include "fdpass.h"
#include "fuzz.h"
#include "gmb.h"
#include "log.h"
#include "session.h"
#include "statefile.h"
#include "util.h"
#include "wire.h"

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t len);

static struct gmb_broker fz_b;
static char fz_path[108];
static int fz_null = -1, fz_linger = -1;

static void fz_tap(void *ctx, enum gmb_socket sock, const uint8_t *rid,
                   size_t rid_len, const struct wire_reply *rep) {
  (void)ctx;
  (void)sock;
  (void)rid;
  (void)rid_len;
  (void)rep;
}

static int fz_count_fds(void) {
  DIR *d = opendir("/proc/self/fd");
  FZ_ASSERT(d != NULL);
  int n = 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL)
    if (e->d_name[0] != '.') n++;
  closedir(d);
  return n;
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc;
  (void)argv;
  gmb__log_set_level(GMB_LOG_ERROR);
  struct gmb_broker *b = &fz_b;
  char dir[64] = "/tmp/gmb-fuzz-XXXXXX", err[512];
  FZ_ASSERT(mkdtemp(dir) != NULL);
  gmb__config_defaults(&b->cfg);
  snprintf(b->cfg.device, sizeof b->cfg.device, "host:16MiB");
  b->flag_log_level = -1;
  b->checks = 1;
  b->reply_tap = fz_tap;
  FZ_ASSERT(gmb__core_open(b, err, sizeof err) == 0);
  FZ_ASSERT(gmb__statefile_load(b, err, sizeof err) == 0);
  snprintf(fz_path, sizeof fz_path, "%s/%s", dir, GMB_FD_SOCKET);
  int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  FZ_ASSERT(fd >= 0);
  struct sockaddr_un sa;
  memset(&sa, 0, sizeof sa);
  sa.sun_family = AF_UNIX;
  memcpy(sa.sun_path, fz_path, strlen(fz_path) + 1);
  FZ_ASSERT(bind(fd, (struct sockaddr *)&sa, sizeof sa) == 0);
  FZ_ASSERT(listen(fd, GMB_FDCHAN_PENDING) == 0);
  FZ_ASSERT(gmb__fdchan_open(b, fd) == 0);
  fz_null = open("/dev/null", O_RDONLY | O_CLOEXEC);
  FZ_ASSERT(fz_null >= 0);
  int pair[2];
  FZ_ASSERT(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) == 0);
  struct linger lg = {.l_onoff = 1, .l_linger = 30};
  FZ_ASSERT(setsockopt(pair[0], SOL_SOCKET, SO_LINGER, &lg, sizeof lg) == 0);
  fz_linger = pair[0]; /* pair[1] stays open: the peer never reads */
  return 0;
}

static void fz_pending_ready(void *ctx, int fd, void *conn) {
  (void)fd;
  void **first = ctx;
  if (*first == NULL) *first = conn;
}

/* Lets the broker read: the session's connection once it has one, else
 * the pending connection (there is at most one: ours). */
static void fz_serve(struct gmb_broker *b, uint64_t sid) {
  struct gmb_session *s = gmb__session_by_id(b->sessions, sid);
  if (s && s->fdconn >= 0) {
    gmb__fdchan_session_ready(b, s);
  } else {
    void *conn = NULL;
    gmb__fdchan_each_pending(b, fz_pending_ready, &conn);
    if (conn) gmb__fdchan_pending_ready(b, conn);
  }
  FZ_ASSERT(gmb__core_check(b) == 0);
}

/* Reads every reply there is; each must be whole and say why it failed. */
static void fz_drain(int sock) {
  for (;;) {
    struct gmb_fd_rep rep;
    int fd = -1;
    ssize_t n = gmb__fd_recv(sock, &rep, sizeof rep, &fd, MSG_DONTWAIT);
    if (fd >= 0) close(fd);
    if (n <= 0) return;
    FZ_ASSERT(n == (ssize_t)sizeof rep);
    FZ_ASSERT(rep.magic == GMB_FD_MAGIC);
    FZ_ASSERT(fz_terminated(rep.message, sizeof rep.message));
    FZ_ASSERT(rep.status == 0 || fd < 0);
  }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t len) {
  struct gmb_broker *b = &fz_b;
  int fds_before = fz_count_fds();
  struct gmb_peer peer = {.rid = (const uint8_t *)"f", .rid_len = 1,
                          .uid = getuid(), .gid = getgid(), .pid = 0};
  struct wire_request req;
  struct wire_reply rep;
  memset(&req, 0, sizeof req);
  req.kind = WIRE_HELLO;
  req.u.hello.version = WIRE_PROTOCOL_VERSION;
  snprintf(req.u.hello.client, sizeof req.u.hello.client, "fuzz");
  FZ_ASSERT(gmb__dispatch(b, &peer, &req, &rep) == 1 && rep.status == 0);
  uint64_t sid = rep.u.hello.session;
  uint64_t seg[2] = {0, 0};
  for (int i = 0; i < 2; i++) {
    memset(&req, 0, sizeof req);
    req.kind = WIRE_ALLOC;
    req.u.alloc.size = i ? (3u << 20) : 4096;
    req.u.alloc.flags = i ? 0 : GMB_MOVABLE;
    FZ_ASSERT(gmb__dispatch(b, &peer, &req, &rep) == 1 && rep.status == 0);
    seg[i] = rep.u.alloc.segment;
  }
  struct gmb_session *s = gmb__session_by_id(b->sessions, sid);
  FZ_ASSERT(s != NULL);
  uint8_t secret[GMB_FD_SECRET_LEN];
  memcpy(secret, s->secret, sizeof secret);

  int sock = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  FZ_ASSERT(sock >= 0);
  struct sockaddr_un sa;
  memset(&sa, 0, sizeof sa);
  sa.sun_family = AF_UNIX;
  memcpy(sa.sun_path, fz_path, strlen(fz_path) + 1);
  FZ_ASSERT(connect(sock, (struct sockaddr *)&sa, sizeof sa) == 0);
  gmb__fdchan_accept(b, gmb__now_ns());

  size_t at = 0;
  while (at + 2 <= len) {
    uint8_t what = data[at], n = data[at + 1];
    at += 2;
    size_t k = n < len - at ? n : len - at;
    uint8_t msg[256];
    size_t mlen = k;
    memcpy(msg, data + at, k);
    at += k;
    struct gmb_fd_req r;
    memset(&r, 0, sizeof r);
    r.magic = GMB_FD_MAGIC;
    r.session = sid;
    switch (what & 0x3f) {
      case 1:
        r.op = GMB_FD_AUTH;
        memcpy(r.secret, secret, sizeof secret);
        break;
      case 2:
        r.op = GMB_FD_SEGMENT;
        r.segment = k > 0 && msg[0] < 2 ? seg[msg[0]] : 0;
        if (k >= 9 && msg[0] >= 2) memcpy(&r.segment, msg + 1, 8);
        break;
      default:
        break;
    }
    if ((what & 0x3f) == 1 || (what & 0x3f) == 2) {
      /* A valid request whose tail the input may overwrite. */
      uint8_t whole[sizeof r];
      memcpy(whole, &r, sizeof r);
      if ((what & 0x3f) == 1 && k > 0 && k <= sizeof whole)
        memcpy(whole + sizeof whole - k, msg, k);
      memcpy(msg, whole, sizeof whole);
      mlen = sizeof whole;
    }
    int att = !(what & 0x80) ? -1 : (what & 0x40) ? fz_linger : fz_null;
    int rc = gmb__fd_send(sock, msg, mlen, att, MSG_DONTWAIT);
    if (rc != 0) break; /* the broker closed it */
    fz_serve(b, sid);
    fz_drain(sock);
  }
  close(sock);
  /* The hang-up: the broker must see it and end the session (or the
   * pending connection). */
  fz_serve(b, sid);
  gmb__fdchan_expire(b, gmb__now_ns() + UINT64_C(3600) * 1000000000u);
  s = gmb__session_by_id(b->sessions, sid);
  if (s) {
    /* It never proved itself on the channel: it ends as a session whose
     * heartbeats stop would. */
    FZ_ASSERT(s->fdconn < 0);
    gmb__core_session_end(b, s, "fuzz input over");
  }
  void *conn = NULL;
  gmb__fdchan_each_pending(b, fz_pending_ready, &conn);
  FZ_ASSERT(conn == NULL);
  /* An ended session that held much is freed in slices, by the loop's
   * turns (a fuzz build's slices are small: mk/fuzz.mk). */
  for (int i = 0; i < 100000 && b->reap_head; i++)
    gmb__core_reap_step(b, gmb__now_ns() + 1000000);
  FZ_ASSERT(b->reap_head == NULL);
  gmb__core_reap(b, 0);
  FZ_ASSERT(gmb__core_check(b) == 0);
  FZ_ASSERT(fz_count_fds() == fds_before);
  return 0;
}
