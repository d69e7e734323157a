/*
 * fdpass.c - one message and at most one descriptor over a SOCK_SEQPACKET
 * socket (fdpass.h).
 *
 * The receiver is the careful side: a peer may attach descriptors nobody
 * asked for, several of them, or a message longer than expected.  Every
 * descriptor that arrived is either handed to the caller or discarded, so a
 * hostile peer cannot make its receiver leak descriptors.
 *
 * Discarding is not a plain close(): the last close of a descriptor runs
 * whatever its file does on release, and a peer chooses the file.  A TCP
 * socket with SO_LINGER and unsent data blocks its closer for as long as
 * the linger says (hours if the peer likes), a FUSE file waits for its
 * daemon's answer to FLUSH, a tty drains its output, and a Unix socket
 * releases the descriptors queued in it, recursively.  SO_LINGER cannot be
 * turned off from here for every such file, so a descriptor a peer may
 * control is closed on a closer thread of its own (started at first use):
 * one that blocks there blocks nothing else.  The queue to that thread is
 * bounded; when it is full (more than FDPASS_CLOSER_QUEUE closes stuck at
 * once) a descriptor is kept open, counted, rather than closed where it
 * could block.  The kernel itself closes in the receiving thread the
 * descriptors that do not fit the control buffer, so the buffer has room
 * for as many as one message can carry (SCM_MAX_FD).
 */
#include "fdpass.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

/* As many descriptors as one message may carry (the kernel's SCM_MAX_FD):
 * those that do not fit are released by the kernel in the receiving
 * thread, with whatever blocking their release brings. */
#define FDPASS_MAX_FDS 253
#define FDPASS_CLOSER_QUEUE 1024

static pthread_mutex_t closer_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t closer_cv = PTHREAD_COND_INITIALIZER;
static int closer_q[FDPASS_CLOSER_QUEUE];
static size_t closer_head, closer_n;
static int closer_state; /* 0: not started, 1: running, -1: cannot start */
static atomic_ulong closer_kept, closer_closed;

static void *closer_main(void *arg) {
  (void)arg;
  for (;;) {
    pthread_mutex_lock(&closer_mu);
    while (closer_n == 0) pthread_cond_wait(&closer_cv, &closer_mu);
    int fd = closer_q[closer_head];
    closer_head = (closer_head + 1) % FDPASS_CLOSER_QUEUE;
    closer_n--;
    pthread_mutex_unlock(&closer_mu);
    close(fd); /* may block: that is why it is here */
    atomic_fetch_add(&closer_closed, 1);
  }
  return NULL;
}

/* Under closer_mu. */
static void closer_start(void) {
  pthread_t t;
  sigset_t all, old;
  sigfillset(&all);
  /* Signals stay with the threads that wait for them (the broker reads
   * its own through a signalfd). */
  pthread_sigmask(SIG_SETMASK, &all, &old);
  closer_state = pthread_create(&t, NULL, closer_main, NULL) == 0 ? 1 : -1;
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  if (closer_state == 1) pthread_detach(t);
}

int gmb__fd_discard(int fd) {
  if (fd < 0) return 0;
  pthread_mutex_lock(&closer_mu);
  if (closer_state == 0) closer_start();
  int rc = 0;
  if (closer_state < 0 || closer_n == FDPASS_CLOSER_QUEUE) {
    rc = -EAGAIN; /* kept open: better a descriptor than a stopped caller */
    atomic_fetch_add(&closer_kept, 1);
  } else {
    closer_q[(closer_head + closer_n) % FDPASS_CLOSER_QUEUE] = fd;
    closer_n++;
    pthread_cond_signal(&closer_cv);
  }
  pthread_mutex_unlock(&closer_mu);
  return rc;
}

/* SO_PASSRIGHTS (Linux 6.16): whether a socket accepts SCM_RIGHTS.  Off on
 * a listener, it is off on every connection accepted from it, and a peer's
 * sendmsg with a descriptor fails with EPERM: nothing can be queued. */
#ifndef SO_PASSRIGHTS
#define SO_PASSRIGHTS 83
#endif

static atomic_int rights_refused; /* 1: every listener made refuses them */

int gmb__fd_refuse_rights(int listen_fd, int refuse) {
  int pass = !refuse;
  int ok = setsockopt(listen_fd, SOL_SOCKET, SO_PASSRIGHTS, &pass,
                      sizeof pass) == 0;
  atomic_store(&rights_refused, ok && refuse);
  return ok && refuse;
}

void gmb__fd_release(int conn) {
  if (conn < 0) return;
  if (atomic_load(&rights_refused)) {
    close(conn); /* nothing a peer chose can be queued in it */
    return;
  }
  /* The peer sees the hang-up now; the close, which releases whatever
   * descriptors wait in the connection, happens on the closer. */
  shutdown(conn, SHUT_RDWR);
  gmb__fd_discard(conn);
}

void gmb__fd_discard_stats(uint64_t *queued, uint64_t *closed,
                           uint64_t *kept) {
  pthread_mutex_lock(&closer_mu);
  *queued = closer_n;
  pthread_mutex_unlock(&closer_mu);
  *closed = atomic_load(&closer_closed);
  *kept = atomic_load(&closer_kept);
}

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
    for (int i = 0; i < n_got; i++) gmb__fd_discard(got[i]);
    return -EPROTO;
  }
  if (n_got == 1) *fd = got[0];
  return n;
}
