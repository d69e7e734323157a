/*
 * fake_router.h - the socket side of the fake brokers in check_client.c and
 * check_client_cuda.c: a ROUTER bound by the test, one request at a time
 * taken off it and decoded, replies encoded and sent to the last peer; and
 * beside it the descriptor channel (proto/fdpass.h): a SOCK_SEQPACKET
 * listener at DIR/fd.sock whose connections the fake accepts, reads one
 * request at a time from, and answers with a reply and perhaps a
 * descriptor (sealed memfds made by fake_memfd).  fake_poll waits on both
 * at once, so one thread serves a client's ZeroMQ socket and its channel.
 * What each fake answers stays in its own test file.
 */
#ifndef GMB_FAKE_ROUTER_H
#define GMB_FAKE_ROUTER_H

#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>
#include <zmq.h>

#include "fdpass.h"
#include "wire.h"

/* A new context in *ctx and a ROUTER (linger 0) bound at `endpoint`. */
static inline void *fake_router_open(void **ctx, const char *endpoint) {
  *ctx = zmq_ctx_new();
  void *router = zmq_socket(*ctx, ZMQ_ROUTER);
  int zero = 0;
  zmq_setsockopt(router, ZMQ_LINGER, &zero, sizeof zero);
  ck_assert_int_eq(zmq_bind(router, endpoint), 0);
  return router;
}

/* Takes one message off the router if one is there (waiting up to
 * wait_ms).  Returns 1 with *req decoded and the sender's routing id in
 * peer (at most cap bytes, *peer_len), 0 when nothing came or it did not
 * decode. */
static inline int fake_router_take(void *router, int wait_ms, uint8_t *peer,
                                   size_t cap, size_t *peer_len,
                                   struct wire_request *req) {
  zmq_pollitem_t it = {router, 0, ZMQ_POLLIN, 0};
  if (zmq_poll(&it, 1, wait_ms) <= 0) return 0;
  zmq_msg_t id, body;
  zmq_msg_init(&id);
  zmq_msg_init(&body);
  zmq_msg_recv(&id, router, 0);
  zmq_msg_recv(&body, router, 0);
  *peer_len = zmq_msg_size(&id);
  if (*peer_len > cap) *peer_len = cap;
  memcpy(peer, zmq_msg_data(&id), *peer_len);
  int rc = gmb__wire_request_decode(zmq_msg_data(&body), zmq_msg_size(&body),
                                    req);
  zmq_msg_close(&id);
  zmq_msg_close(&body);
  return rc == 0;
}

/* Waits up to 10 ms for one request: fake_router_take. */
static inline int fake_router_recv(void *router, uint8_t *peer, size_t cap,
                                   size_t *peer_len, struct wire_request *req) {
  return fake_router_take(router, 10, peer, cap, peer_len, req);
}

/* Sends `len` raw bytes to the peer. */
static inline void fake_router_send(void *router, const uint8_t *peer,
                                    size_t peer_len, const void *buf,
                                    size_t len) {
  zmq_send(router, peer, peer_len, ZMQ_SNDMORE);
  zmq_send(router, buf, len, 0);
}

/* Encodes a reply (or an event) and sends it to the peer. */
static inline void fake_router_reply(void *router, const uint8_t *peer,
                                     size_t peer_len,
                                     const struct wire_reply *rep) {
  uint8_t *buf;
  size_t len;
  ck_assert_int_eq(gmb__wire_reply_encode(rep, &buf, &len), 0);
  fake_router_send(router, peer, peer_len, buf, len);
  free(buf);
}

/* --- the descriptor channel ------------------------------------------------ */

#define FAKE_FD_CONNS 8

struct fake_fdchan {
  int listen;                 /* -1: not listening */
  int conn[FAKE_FD_CONNS];    /* -1: a free place */
  struct ucred cred[FAKE_FD_CONNS]; /* SO_PEERCRED of each connection */
  int tag[FAKE_FD_CONNS];     /* the fake's own word per connection; 0
                                 when accepted */
  char path[sizeof(((struct sockaddr_un *)0)->sun_path)];
  /* Counted by the thread that polls; read by tests with atomics:
   * connections accepted, closed (by either side), and hung up by the
   * peer (closed includes those). */
  int accepted, closed, hangups;
};

/* Not listening, no connections (call before anything else). */
static inline void fake_fdchan_init(struct fake_fdchan *ch) {
  memset(ch, 0, sizeof *ch);
  ch->listen = -1;
  for (int i = 0; i < FAKE_FD_CONNS; i++) ch->conn[i] = -1;
}

/* Listens at DIR/fd.sock, where a client of ipc://DIR/broker.sock looks. */
static inline void fake_fdchan_listen(struct fake_fdchan *ch,
                                      const char *dir) {
  struct sockaddr_un sa;
  memset(&sa, 0, sizeof sa);
  sa.sun_family = AF_UNIX;
  ck_assert_int_lt(snprintf(sa.sun_path, sizeof sa.sun_path, "%s/%s", dir,
                            GMB_FD_SOCKET),
                   (int)sizeof sa.sun_path);
  snprintf(ch->path, sizeof ch->path, "%s", sa.sun_path);
  unlink(ch->path);
  ch->listen = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK,
                      0);
  ck_assert_int_ge(ch->listen, 0);
  ck_assert_int_eq(bind(ch->listen, (struct sockaddr *)&sa, sizeof sa), 0);
  ck_assert_int_eq(listen(ch->listen, 16), 0);
}

/* Closes one connection (the client sees the channel hang up). */
static inline void fake_fdchan_drop(struct fake_fdchan *ch, int conn) {
  for (int i = 0; i < FAKE_FD_CONNS; i++)
    if (ch->conn[i] == conn && conn >= 0) {
      close(conn);
      ch->conn[i] = -1;
      __atomic_fetch_add(&ch->closed, 1, __ATOMIC_SEQ_CST);
    }
}

/* Closes the listener and every connection, and removes fd.sock. */
static inline void fake_fdchan_close(struct fake_fdchan *ch) {
  for (int i = 0; i < FAKE_FD_CONNS; i++) fake_fdchan_drop(ch, ch->conn[i]);
  if (ch->listen >= 0) {
    close(ch->listen);
    unlink(ch->path);
  }
  ch->listen = -1;
}

/* Reads one of the counters above from another thread. */
#define FAKE_FDCHAN_COUNT(ch, field) __atomic_load_n(&(ch)->field, __ATOMIC_SEQ_CST)

/* The peer credentials of connection `conn`, NULL if it is not one. */
static inline const struct ucred *fake_fdchan_cred(const struct fake_fdchan *ch,
                                                   int conn) {
  for (int i = 0; i < FAKE_FD_CONNS; i++)
    if (ch->conn[i] == conn && conn >= 0) return &ch->cred[i];
  return NULL;
}

/* The fake's word for connection `conn` (0 when it was accepted), NULL
 * if it is not one. */
static inline int *fake_fdchan_tag(struct fake_fdchan *ch, int conn) {
  for (int i = 0; i < FAKE_FD_CONNS; i++)
    if (ch->conn[i] == conn && conn >= 0) return &ch->tag[i];
  return NULL;
}

/* Sends `len` raw bytes with `n` descriptors attached (n may exceed what
 * gmb__fd_send does: a hostile broker's reply).  0 or -errno. */
static inline int fake_fdchan_send_fds(int conn, const void *buf, size_t len,
                                       const int *fds, int n) {
  struct iovec iov = {.iov_base = (void *)buf, .iov_len = len};
  union {
    char buf[CMSG_SPACE(4 * sizeof(int))];
    struct cmsghdr align;
  } u;
  struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};
  if (n > 4) return -EINVAL;
  if (n > 0) {
    memset(&u, 0, sizeof u);
    mh.msg_control = u.buf;
    mh.msg_controllen = CMSG_SPACE((size_t)n * sizeof(int));
    struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN((size_t)n * sizeof(int));
    memcpy(CMSG_DATA(c), fds, (size_t)n * sizeof(int));
  }
  return sendmsg(conn, &mh, MSG_NOSIGNAL) < 0 ? -errno : 0;
}

/* A well-formed reply to operation `op`, with descriptor `fd` unless -1. */
static inline int fake_fdchan_reply(int conn, uint32_t op, int32_t status,
                                    uint64_t segment, uint64_t size, int fd,
                                    const char *msg) {
  struct gmb_fd_rep rep;
  memset(&rep, 0, sizeof rep);
  rep.magic = GMB_FD_MAGIC;
  rep.op = op;
  rep.status = status;
  rep.segment = segment;
  rep.size = size;
  snprintf(rep.message, sizeof rep.message, "%s", msg ? msg : "");
  return gmb__fd_send(conn, &rep, sizeof rep, fd, 0);
}

/* A memfd of `size` bytes with `seals` added (the broker's are
 * F_SEAL_SHRINK | F_SEAL_GROW; 0: none). */
static inline int fake_memfd(const char *name, uint64_t size, unsigned seals) {
  int fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
  ck_assert_int_ge(fd, 0);
  ck_assert_int_eq(ftruncate(fd, (off_t)size), 0);
  if (seals) ck_assert_int_eq(fcntl(fd, F_ADD_SEALS, seals), 0);
  return fd;
}

/* --- both at once -------------------------------------------------------------- */

enum fake_got { FAKE_GOT_NONE, FAKE_GOT_WIRE, FAKE_GOT_FD };

/* What fake_poll took. */
struct fake_msg {
  struct wire_request req; /* FAKE_GOT_WIRE */
  int conn;                /* FAKE_GOT_FD: the connection it came on */
  struct gmb_fd_req fdreq; /* FAKE_GOT_FD: the request (zeros past len) */
  size_t fdlen;            /* its length as received */
};

/*
 * Waits up to 10 ms for a request on the router (NULL: none) or the
 * channel, accepting new connections and closing those that hung up on
 * the way (ch->accepted, ch->hangups count them).  Returns FAKE_GOT_WIRE
 * with m->req decoded and the sender in peer; FAKE_GOT_FD with a request
 * of connection m->conn (a descriptor sent with it is closed); or
 * FAKE_GOT_NONE.
 */
static inline enum fake_got fake_poll(void *router, struct fake_fdchan *ch,
                                      uint8_t *peer, size_t cap,
                                      size_t *peer_len, struct fake_msg *m) {
  zmq_pollitem_t it[2 + FAKE_FD_CONNS];
  int n = 0, conn_at = 0;
  if (router) it[n++] = (zmq_pollitem_t){router, 0, ZMQ_POLLIN, 0};
  if (ch->listen >= 0) it[n++] = (zmq_pollitem_t){NULL, ch->listen,
                                                  ZMQ_POLLIN, 0};
  conn_at = n;
  for (int i = 0; i < FAKE_FD_CONNS; i++)
    if (ch->conn[i] >= 0)
      it[n++] = (zmq_pollitem_t){NULL, ch->conn[i], ZMQ_POLLIN, 0};
  if (n == 0) {
    usleep(10 * 1000);
    return FAKE_GOT_NONE;
  }
  if (zmq_poll(it, n, 10) <= 0) return FAKE_GOT_NONE;
  if (ch->listen >= 0 && (it[conn_at - 1].revents & ZMQ_POLLIN)) {
    int s = accept4(ch->listen, NULL, NULL, SOCK_CLOEXEC);
    int i = 0;
    while (s >= 0 && i < FAKE_FD_CONNS && ch->conn[i] >= 0) i++;
    if (s >= 0 && i == FAKE_FD_CONNS) {
      close(s);
    } else if (s >= 0) {
      socklen_t len = sizeof ch->cred[i];
      memset(&ch->cred[i], 0, sizeof ch->cred[i]);
      getsockopt(s, SOL_SOCKET, SO_PEERCRED, &ch->cred[i], &len);
      ch->conn[i] = s;
      ch->tag[i] = 0;
      __atomic_fetch_add(&ch->accepted, 1, __ATOMIC_SEQ_CST);
    }
  }
  for (int k = conn_at; k < n; k++) {
    if (!(it[k].revents & (ZMQ_POLLIN | ZMQ_POLLERR))) continue;
    int fd = -1;
    memset(&m->fdreq, 0, sizeof m->fdreq);
    ssize_t got = gmb__fd_recv(it[k].fd, &m->fdreq, sizeof m->fdreq, &fd,
                               MSG_DONTWAIT);
    if (fd >= 0) close(fd);
    if (got == -EAGAIN) continue;
    if (got <= 0) { /* hung up, or broken */
      fake_fdchan_drop(ch, it[k].fd);
      __atomic_fetch_add(&ch->hangups, 1, __ATOMIC_SEQ_CST);
      continue;
    }
    m->conn = it[k].fd;
    m->fdlen = (size_t)got;
    return FAKE_GOT_FD;
  }
  if (router && (it[0].revents & ZMQ_POLLIN))
    return fake_router_take(router, 0, peer, cap, peer_len, &m->req)
               ? FAKE_GOT_WIRE
               : FAKE_GOT_NONE;
  return FAKE_GOT_NONE;
}

#endif /* GMB_FAKE_ROUTER_H */
