/*
 * fdpass.h - the descriptor channel's messages, shared by the broker and
 * the client library, and the SCM_RIGHTS plumbing both sides use.
 *
 * ZeroMQ cannot carry file descriptors, so beside the client socket the
 * broker listens on $GMB_RUN_DIR/fd.sock, an AF_UNIX SOCK_SEQPACKET socket:
 * one message is one datagram, never split or merged, and a descriptor
 * rides along as ancillary data.  A session opens one connection right
 * after its Hello and keeps it for its life:
 *
 *   client -> AUTH {session, secret}      broker -> {status, lock table fd}
 *   client -> SEGMENT {segment}           broker -> {status, size, seg. fd}
 *
 * The secret (32 random bytes) came in the session's Hello reply, and the
 * connection's SO_PEERCRED uid must be the session's.  A SEGMENT request is
 * answered with a descriptor only for a segment of the session's tenant;
 * everything else gets a status and a message, never a descriptor.  The
 * connection's hang-up tells the broker that the process is gone, in any
 * PID namespace.  Messages are fixed-size and little more than ids: the
 * broker reads each with one recvmsg and never waits for a peer.
 */
#ifndef GMB_FDPASS_H
#define GMB_FDPASS_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#define GMB_FD_MAGIC UINT32_C(0x31646667) /* "gfd1" */
#define GMB_FD_SECRET_LEN 32
#define GMB_FD_MESSAGE_MAX 160
#define GMB_FD_SOCKET "fd.sock"

enum gmb_fd_op {
  GMB_FD_AUTH = 1,    /* prove the session; answered with its lock table */
  GMB_FD_SEGMENT = 2, /* a segment's descriptor */
};

struct gmb_fd_req {
  uint32_t magic; /* GMB_FD_MAGIC */
  uint32_t op;    /* enum gmb_fd_op */
  uint64_t session;
  uint64_t segment; /* GMB_FD_SEGMENT */
  uint8_t secret[GMB_FD_SECRET_LEN]; /* GMB_FD_AUTH */
};

struct gmb_fd_rep {
  uint32_t magic; /* GMB_FD_MAGIC */
  uint32_t op;    /* the request's */
  int32_t status; /* 0 or a GMB_E_* code; a descriptor comes only with 0 */
  uint32_t reserved;
  uint64_t segment; /* GMB_FD_SEGMENT: the one asked for */
  uint64_t size;    /* bytes behind the descriptor */
  char message[GMB_FD_MESSAGE_MAX]; /* why, when status is not 0 */
};

_Static_assert(sizeof(struct gmb_fd_req) == 56, "fd request layout");
_Static_assert(sizeof(struct gmb_fd_rep) == 192, "fd reply layout");

/*
 * Sends one message of `len` bytes on the SOCK_SEQPACKET socket `sock`,
 * with descriptor `fd` attached unless it is -1.  `flags` go to sendmsg
 * (MSG_NOSIGNAL is always added).  0, or -errno (-EAGAIN: the peer does not
 * read and the socket is non-blocking or MSG_DONTWAIT was given).
 */
int gmb__fd_send(int sock, const void *msg, size_t len, int fd, int flags);

/*
 * Receives one message into msg (at most cap bytes) and the descriptor
 * that came with it, if any, into *fd (-1 when none; close-on-exec).
 * More than one descriptor, or a message longer than cap, is refused:
 * everything that came is discarded (gmb__fd_discard) and -EPROTO
 * returned.  Returns the message's length (0: the peer hung up), or
 * -errno.  A descriptor the caller did not want goes to gmb__fd_discard,
 * never to close(): closing it may block for as long as its sender likes.
 */
ssize_t gmb__fd_recv(int sock, void *msg, size_t cap, int *fd, int flags);

/*
 * Closes `fd`, a descriptor whose file a peer may have chosen (received
 * with SCM_RIGHTS, or a connection on which a peer may have queued such
 * descriptors), on a closer thread, so that a close that blocks (SO_LINGER,
 * FUSE, ttys) blocks only that thread.  Never blocks the caller.  0, or
 * -EAGAIN when the closer's bounded queue is full (or it could not start):
 * the descriptor is then kept open, and counted, rather than closed here.
 * Takes the descriptor in both cases; -1 is accepted and ignored.
 */
int gmb__fd_discard(int fd);
/*
 * Makes the listening socket `listen_fd` and every connection accepted from
 * it refuse descriptors (SO_PASSRIGHTS off: a peer's sendmsg with
 * SCM_RIGHTS fails with EPERM).  1 when the kernel does so (Linux 6.16 and
 * later), 0 when it cannot: then descriptors may arrive and must go to
 * gmb__fd_discard.  Remembered for gmb__fd_release.  With `refuse` 0 it
 * lets them through, as an older kernel does (tests use it), and
 * returns 0.
 */
int gmb__fd_refuse_rights(int listen_fd, int refuse);
/*
 * Closes a connection accepted from such a listener.  Where descriptors
 * are refused, a plain close(); otherwise a peer may have queued
 * descriptors in it, whose release happens at its close: it is shut down
 * (the peer sees the hang-up at once) and closed by gmb__fd_discard.
 */
void gmb__fd_release(int conn);
/* Descriptors waiting for the closer now, closed by it, and kept open
 * because its queue was full. */
void gmb__fd_discard_stats(uint64_t *queued, uint64_t *closed,
                           uint64_t *kept);

#endif /* GMB_FDPASS_H */
