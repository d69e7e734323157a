/*
 * fdclient.c - the client's end of the descriptor channel (fdclient.h).
 *
 * Nothing the broker sends can make the library misbehave: a reply of the
 * wrong size, magic or operation is GMB_E_PROTO, and a descriptor that
 * comes with a refusal (it should not) is closed.
 */
#include "fdclient.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include "fdpass.h"
#include "gmb.h"

/* DIR/fd.sock for endpoint ipc://DIR/NAME. */
static int fdclient_path(const char *endpoint, char *path, size_t cap,
                         char *why, size_t whycap) {
  static const char ipc[] = "ipc://";
  if (strncmp(endpoint, ipc, sizeof ipc - 1) != 0) {
    snprintf(why, whycap, "the descriptor channel needs an ipc:// endpoint "
             "(%s cannot carry file descriptors)", endpoint);
    return GMB_E_CONN;
  }
  const char *p = endpoint + sizeof ipc - 1;
  const char *slash = strrchr(p, '/');
  int n = slash ? snprintf(path, cap, "%.*s/%s", (int)(slash - p), p,
                           GMB_FD_SOCKET)
                : snprintf(path, cap, "%s", GMB_FD_SOCKET);
  if (n < 0 || (size_t)n >= cap) {
    snprintf(why, whycap, "the descriptor channel's path is too long");
    return GMB_E_CONN;
  }
  return 0;
}

/* Sends one request.  0, or the failure (the channel then broken). */
static int fdclient_send(int sock, const struct gmb_fd_req *req, char *why,
                         size_t cap) {
  int rc = gmb__fd_send(sock, req, sizeof *req, -1, 0);
  if (rc == 0) return 0;
  snprintf(why, cap, "descriptor channel: send: %s", strerror(-rc));
  return rc == -EAGAIN ? GMB_E_TIMEOUT : GMB_E_CONN;
}

/*
 * The reply to request `req` (and perhaps a descriptor), checked.  *broken
 * is set when the exchange itself failed (a receive error, a hang-up, no
 * reply in time): a reply that comes late would be read as the answer to
 * the next request, so such a channel must not be used again.  A reply
 * that arrived but makes no sense is GMB_E_PROTO and leaves the channel in
 * step (SOCK_SEQPACKET keeps messages whole).
 */
static int fdclient_reply(int sock, const struct gmb_fd_req *req,
                          struct gmb_fd_rep *rep, int *fd, int *broken,
                          char *why, size_t cap) {
  *fd = -1;
  *broken = 1;
  ssize_t n = gmb__fd_recv(sock, rep, sizeof *rep, fd, 0);
  if (n == 0) {
    if (*fd >= 0) close(*fd);
    *fd = -1;
    snprintf(why, cap, "the broker closed the descriptor channel");
    return GMB_E_CONN;
  }
  if (n == -EPROTO) *broken = 0; /* one whole message, refused */
  if (n < 0) {
    snprintf(why, cap, "descriptor channel: %s",
             n == -EAGAIN ? "no answer in time" : strerror((int)-n));
    return n == -EAGAIN ? GMB_E_TIMEOUT
           : n == -EPROTO ? GMB_E_PROTO
                          : GMB_E_CONN;
  }
  *broken = 0; /* one message came for one request */
  const char *bad = (size_t)n != sizeof *rep     ? "size"
                    : rep->magic != GMB_FD_MAGIC ? "magic"
                    : rep->op != req->op         ? "operation"
                    : rep->status > 0 || rep->status < GMB_E_SYSTEM
                        ? "status"
                        : NULL;
  if (bad == NULL && rep->status == 0 && *fd < 0) bad = "missing descriptor";
  if (bad == NULL && rep->status != 0 && *fd >= 0) bad = "descriptor";
  if (bad) {
    if (*fd >= 0) close(*fd);
    *fd = -1;
    snprintf(why, cap, "descriptor channel: a reply with a wrong %s", bad);
    return GMB_E_PROTO;
  }
  if (rep->status) {
    rep->message[sizeof rep->message - 1] = '\0';
    snprintf(why, cap, "%s", rep->message[0] ? rep->message
                                             : gmb_strerror(rep->status));
    return rep->status;
  }
  return 0;
}

/* One request, one reply: fdclient_send, then fdclient_reply. */
static int fdclient_call(int sock, const struct gmb_fd_req *req,
                         struct gmb_fd_rep *rep, int *fd, int *broken,
                         char *why, size_t cap) {
  *fd = -1;
  *broken = 1;
  int rc = fdclient_send(sock, req, why, cap);
  return rc ? rc : fdclient_reply(sock, req, rep, fd, broken, why, cap);
}

void gmb__fdclient_timeout(int sock, int timeout_ms) {
  struct timeval tv = {.tv_sec = timeout_ms / 1000,
                       .tv_usec = (timeout_ms % 1000) * 1000};
  setsockopt(sock, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  setsockopt(sock, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
}

int gmb__fdclient_connect(const char *endpoint, uint64_t session,
                          const uint8_t *secret, int timeout_ms, int *sock,
                          int *lt_fd, uint64_t *lt_size, char *why,
                          size_t cap) {
  *sock = *lt_fd = -1;
  struct sockaddr_un sa;
  memset(&sa, 0, sizeof sa);
  sa.sun_family = AF_UNIX;
  int rc = fdclient_path(endpoint, sa.sun_path, sizeof sa.sun_path, why, cap);
  if (rc) return rc;
  int s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (s < 0) {
    snprintf(why, cap, "descriptor channel: socket: %s", strerror(errno));
    return GMB_E_SYSTEM;
  }
  gmb__fdclient_timeout(s, timeout_ms);
  if (connect(s, (struct sockaddr *)&sa, sizeof sa) != 0) {
    snprintf(why, cap, "cannot reach the descriptor channel %s: %s "
             "(a broker older than this library?)", sa.sun_path,
             strerror(errno));
    close(s);
    return GMB_E_CONN;
  }
  struct gmb_fd_req req;
  memset(&req, 0, sizeof req);
  req.magic = GMB_FD_MAGIC;
  req.op = GMB_FD_AUTH;
  req.session = session;
  memcpy(req.secret, secret, GMB_FD_SECRET_LEN);
  struct gmb_fd_rep rep;
  int broken;
  rc = fdclient_call(s, &req, &rep, lt_fd, &broken, why, cap);
  if (rc) {
    close(s);
    return rc;
  }
  *sock = s;
  *lt_size = rep.size;
  return 0;
}

int gmb__fdclient_segment(int *sock, uint64_t segment, int *fd, uint64_t *size,
                          char *why, size_t cap) {
  return gmb__fdclient_segments(sock, &segment, 1, fd, size, why, cap);
}

int gmb__fdclient_segments(int *sock, const uint64_t *segs, unsigned n,
                           int *fds, uint64_t *sizes, char *why, size_t cap) {
  for (unsigned i = 0; i < n; i++) fds[i] = -1;
  if (*sock < 0) {
    snprintf(why, cap, "the descriptor channel is closed (an earlier "
             "request on it failed)");
    return GMB_E_CONN;
  }
  if (n == 0 || n > GMB_FDCLIENT_BATCH) {
    snprintf(why, cap, "%u descriptors asked at once", n);
    return GMB_E_INVAL;
  }
  struct gmb_fd_req req;
  memset(&req, 0, sizeof req);
  req.magic = GMB_FD_MAGIC;
  req.op = GMB_FD_SEGMENT;
  /* All the requests first, then the replies in the same order: one wait
   * for the batch, not one per descriptor. */
  int rc = 0, broken = 0;
  unsigned sent = 0;
  for (; sent < n && rc == 0; sent++) {
    req.segment = segs[sent];
    rc = fdclient_send(*sock, &req, why, cap);
  }
  if (rc) {
    broken = 1;
    sent--; /* the one that failed was not sent */
  }
  /* Every reply to what was sent is read, so that the channel stays in
   * step; the first failure is the one reported. */
  for (unsigned i = 0; i < sent && !broken; i++) {
    struct gmb_fd_rep rep;
    char w[GMB_FD_MESSAGE_MAX + 64];
    req.segment = segs[i];
    int r = fdclient_reply(*sock, &req, &rep, &fds[i], &broken, w, sizeof w);
    if (r == 0 && rep.segment != segs[i]) {
      close(fds[i]);
      fds[i] = -1;
      snprintf(w, sizeof w, "asked for segment %llu's descriptor, got %llu's",
               (unsigned long long)segs[i], (unsigned long long)rep.segment);
      r = GMB_E_PROTO;
    }
    if (r == 0) sizes[i] = rep.size;
    if (r && rc == 0) {
      rc = r;
      snprintf(why, cap, "%s", w);
    }
  }
  if (broken) {
    close(*sock);
    *sock = -1;
  }
  if (rc)
    for (unsigned i = 0; i < n; i++)
      if (fds[i] >= 0) {
        close(fds[i]);
        fds[i] = -1;
      }
  return rc;
}
