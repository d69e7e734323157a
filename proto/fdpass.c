/*
 * fdpass.c - one message and at most one descriptor over a SOCK_SEQPACKET
 * socket (fdpass.h).
 *
 * The receiver is the careful side: a peer may attach descriptors nobody
 * asked for, several of them, or a message longer than expected.  Every
 * descriptor that arrived is either handed to the caller or closed, so a
 * hostile peer cannot make its receiver leak descriptors.
 */
#include "fdpass.h"

#include <errno.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

/* Room for a few descriptors, so that extra ones are seen (and closed)
 * rather than silently dropped by the kernel with MSG_CTRUNC. */
#define FDPASS_MAX_FDS 4

int gmb__fd_send(int sock, const void *msg, size_t len, int fd, int flags) {
  struct iovec iov = {.iov_base = (void *)msg, .iov_len = len};
  union {
    char buf[CMSG_SPACE(sizeof(int))];
    struct cmsghdr align;
  } u;
  struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};
  if (fd >= 0) {
    memset(&u, 0, sizeof u);
    mh.msg_control = u.buf;
    mh.msg_controllen = sizeof u.buf;
    struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(c), &fd, sizeof fd);
  }
  ssize_t n;
  do {
    n = sendmsg(sock, &mh, flags | MSG_NOSIGNAL);
  } while (n < 0 && errno == EINTR);
  if (n < 0) return -errno;
  return (size_t)n == len ? 0 : -EMSGSIZE;
}

ssize_t gmb__fd_recv(int sock, void *msg, size_t cap, int *fd, int flags) {
  *fd = -1;
  struct iovec iov = {.iov_base = msg, .iov_len = cap};
  union {
    char buf[CMSG_SPACE(FDPASS_MAX_FDS * sizeof(int))];
    struct cmsghdr align;
  } u;
  struct msghdr mh = {.msg_iov = &iov,
                      .msg_iovlen = 1,
                      .msg_control = u.buf,
                      .msg_controllen = sizeof u.buf};
  ssize_t n;
  do {
    n = recvmsg(sock, &mh, flags | MSG_CMSG_CLOEXEC);
  } while (n < 0 && errno == EINTR);
  if (n < 0) return -errno;
  int got[FDPASS_MAX_FDS], n_got = 0;
  for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < k && n_got < FDPASS_MAX_FDS; i++)
      memcpy(&got[n_got++], CMSG_DATA(c) + i * sizeof(int), sizeof(int));
  }
  int bad = (mh.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) || n_got > 1;
  if (bad) {
    for (int i = 0; i < n_got; i++) close(got[i]);
    return -EPROTO;
  }
  if (n_got == 1) *fd = got[0];
  return n;
}
