/*
 * connguard.c - a bound on the connections libzmq accepts (connguard.h).
 *
 * State: per descriptor number, whether it is a counted connection and
 * whose; per uid with connections, how many.  accept() runs in libzmq's
 * I/O thread and close() in any thread, so both take one mutex, but
 * close() only for a descriptor marked counted (an atomic flag read
 * first): closing files and memfds costs one load.  The system calls are
 * made directly (syscall()), never through the symbols defined here.
 *
 * A descriptor closed behind close() (close_range, a library's internal
 * close) leaves a stale mark; the next accept() that returns that number
 * finds it and drops the old count first, so counts heal.
 *
 * Every connection to the client or the admin socket also has its
 * ZeroMQ handshake read as it passes through recv() (libzmq's only read
 * of a stream socket), until its READY command: a peer that speaks
 * anything but ZMTP 3 with the NULL mechanism, or that names a routing id
 * of its own (READY's Identity property), gets ECONNRESET from recv(), and
 * libzmq drops it before its ROUTER sees the id.  So every routing id is
 * the ROUTER's own number (0x00 + a 32-bit counter): libzmq 4.3 asserts
 * (socket_base.cpp, add_out_pipe) when that number is one a peer chose
 * first, and the counter starts at the unseeded rand()'s value, the same
 * every start.  The handshake's state lives in a buffer of its own per
 * connection (cg_hs), made at accept() and freed at close().
 *
 * After READY the same reader follows the connection's frames, headers
 * only (a frame's body is skipped by its size): ZMQ_MAXMSGSIZE bounds one
 * frame, but libzmq keeps every part of a message until its last arrives,
 * about 64 bytes of memory for each empty part of 2 bytes, so a peer that
 * sends parts without end would hold the broker's memory without bound.
 * A message of more than CG_PARTS_MAX parts gets ECONNRESET as a bad
 * handshake does: libzmq drops the connection and the parts it kept.  A
 * request is one frame; a message of a few parts still reaches the loop,
 * which answers that it is not one.  The reader's buffer shrinks to its
 * frame state at READY (cg_hs_frames).
 */
#include "connguard.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/un.h>
#include <unistd.h>

#include "config.h"

struct cg_uid {
  uid_t uid;
  uint32_t n;       /* connections to the client socket */
  uint32_t n_admin; /* to the admin socket */
};

/* The greeting (ZMTP 3: 64 bytes), a command's header (flags and a size
 * of 1 or 8 bytes) and READY's body, refused past CG_READY_MAX (a DEALER's
 * is about 30 bytes; a peer's metadata could make it longer). */
#define CG_GREETING 64
#define CG_READY_MAX 1024
/* Parts of one message past which its connection is dropped. */
#define CG_PARTS_MAX 4
struct cg_hs {
  uint32_t got;    /* bytes of the handshake seen */
  int framing;     /* READY passed: frames are followed, buf is gone */
  uint32_t parts;  /* parts of the message being read that said MORE */
  uint8_t head[9]; /* the frame header being read: flags, size */
  uint8_t head_got;
  uint64_t left;   /* bytes of the current frame's body still to come */
  unsigned char buf[CG_GREETING + 9 + CG_READY_MAX]; /* until READY */
};

/* What a descriptor number's mark says (cg_counted). */
#define CG_COUNTED 0x1u /* counted against its uid's and the total cap */
#define CG_HS 0x2u      /* its stream is being read (cg_hs) */
#define CG_ADMIN 0x4u   /* counted as a connection to the admin socket */
#define CG_OTHER 0x8u   /* ... of a uid that was no operator's then */

static pthread_mutex_t cg_mu = PTHREAD_MUTEX_INITIALIZER;
static atomic_uchar *cg_counted; /* per descriptor number: CG_* */
static struct cg_hs *_Atomic *cg_hs; /* per descriptor number */
static uid_t *cg_owner;
static size_t cg_nfd;
static struct cg_uid *cg_uids; /* uids with connections, unordered */
static size_t cg_nuids, cg_capuids;
static uint32_t cg_total, cg_total_max, cg_uid_max;
/* The admin socket: operators (admin_uids and the broker's uid) each up to
 * CG_ADMIN_OPERATOR; every other uid up to CG_ADMIN_OTHER, and those
 * together up to CG_ADMIN_OTHERS, so that their flood never keeps an
 * operator out. */
#define CG_ADMIN_OPERATOR 64
#define CG_ADMIN_OTHER 4
#define CG_ADMIN_OTHERS 64
#define CG_ADMINS_MAX 64
static uid_t cg_admins[CG_ADMINS_MAX];
static size_t cg_nadmins;
static uint32_t cg_admin_others;
static int cg_spare = -1;
static char cg_path[sizeof(((struct sockaddr_un *)0)->sun_path)];
static char cg_admin_path[sizeof cg_path];
static atomic_int cg_on;
static uint64_t cg_refused_total, cg_refused_uid, cg_refused_fds;
static uint64_t cg_refused_admin;
static atomic_uint_fast64_t cg_refused_hs, cg_refused_parts;

static int cg_sys_accept4(int fd, struct sockaddr *addr, socklen_t *len,
                          int flags) {
  return (int)syscall(SYS_accept4, fd, addr, len, flags);
}

static int cg_sys_close(int fd) { return (int)syscall(SYS_close, fd); }

static ssize_t cg_sys_recv(int fd, void *buf, size_t len, int flags) {
  return syscall(SYS_recvfrom, fd, buf, len, flags, NULL, NULL);
}

int gmb__connguard_init(const char *path, const char *admin_path) {
  if (strlen(path) >= sizeof cg_path || strlen(admin_path) >= sizeof cg_path) {
    errno = ENAMETOOLONG;
    return -1;
  }
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) != 0) return -1;
  size_t n = rl.rlim_cur == RLIM_INFINITY || rl.rlim_cur > (1u << 24)
                 ? (size_t)1 << 24
                 : (size_t)rl.rlim_cur;
  pthread_mutex_lock(&cg_mu);
  int rc = 0;
  if (!cg_counted) {
    cg_counted = calloc(n, sizeof *cg_counted);
    cg_owner = calloc(n, sizeof *cg_owner);
    cg_hs = calloc(n, sizeof *cg_hs);
    if (!cg_counted || !cg_owner || !cg_hs) {
      free(cg_counted);
      free(cg_owner);
      free((void *)cg_hs);
      cg_counted = NULL;
      cg_owner = NULL;
      cg_hs = NULL;
      errno = ENOMEM;
      rc = -1;
    } else {
      cg_nfd = n;
    }
  }
  if (rc == 0 && cg_spare < 0) cg_spare = open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (rc == 0) {
    memcpy(cg_path, path, strlen(path) + 1);
    memcpy(cg_admin_path, admin_path, strlen(admin_path) + 1);
  }
  pthread_mutex_unlock(&cg_mu);
  if (rc == 0) atomic_store(&cg_on, 1);
  return rc;
}

void gmb__connguard_limits(uint32_t total_max, uint32_t per_uid_max) {
  pthread_mutex_lock(&cg_mu);
  cg_total_max = total_max;
  cg_uid_max = per_uid_max;
  pthread_mutex_unlock(&cg_mu);
}

void gmb__connguard_admins(const uid_t *uids, size_t n) {
  pthread_mutex_lock(&cg_mu);
  cg_nadmins = n < CG_ADMINS_MAX ? n : CG_ADMINS_MAX;
  memcpy(cg_admins, uids, cg_nadmins * sizeof *uids);
  pthread_mutex_unlock(&cg_mu);
}

void gmb__connguard_stats(struct gmb_connguard_stats *out) {
  pthread_mutex_lock(&cg_mu);
  out->connections = cg_total;
  out->refused_total = cg_refused_total;
  out->refused_uid = cg_refused_uid;
  out->refused_fds = cg_refused_fds;
  out->refused_admin = cg_refused_admin;
  out->admin_others = cg_admin_others;
  pthread_mutex_unlock(&cg_mu);
  out->refused_handshake = atomic_load(&cg_refused_hs);
  out->refused_parts = atomic_load(&cg_refused_parts);
}

/* Under cg_mu: 1 when uid is an operator (gmb__connguard_admins). */
static int cg_is_admin(uid_t uid) {
  return gmb__config_operator(cg_admins, cg_nadmins,
                              gmb__config_overflow_uid(), uid);
}

/* Under cg_mu. */
static struct cg_uid *cg_uid_find(uid_t uid) {
  for (size_t i = 0; i < cg_nuids; i++)
    if (cg_uids[i].uid == uid) return &cg_uids[i];
  return NULL;
}

/* Under cg_mu: forgets descriptor fd's connection and its handshake. */
static void cg_forget(int fd) {
  unsigned mark = atomic_exchange_explicit(&cg_counted[fd], 0,
                                           memory_order_relaxed);
  if (mark & CG_HS) free(atomic_exchange(&cg_hs[fd], NULL));
  if (!(mark & (CG_COUNTED | CG_ADMIN))) return;
  struct cg_uid *u = cg_uid_find(cg_owner[fd]);
  if (mark & CG_COUNTED) {
    cg_total--;
    if (u) u->n--;
  } else {
    if (mark & CG_OTHER) cg_admin_others--;
    if (u) u->n_admin--;
  }
  if (u && u->n == 0 && u->n_admin == 0) *u = cg_uids[--cg_nuids];
}

/* Under cg_mu: counts connection fd of uid to the client socket, or to
 * the admin socket (`admin`), or says why not (0: counted, 1: past the
 * total, 2: past the uid's cap, 3: past the admin socket's caps, -1: out
 * of memory). */
static int cg_count(int fd, uid_t uid, int admin) {
  cg_forget(fd); /* a stale mark: closed behind close() */
  struct cg_uid *u = cg_uid_find(uid);
  int op = admin && cg_is_admin(uid);
  if (admin) {
    uint32_t had = u ? u->n_admin : 0;
    if (op ? had >= CG_ADMIN_OPERATOR
           : had >= CG_ADMIN_OTHER || cg_admin_others >= CG_ADMIN_OTHERS)
      return 3;
  } else {
    if (cg_total_max && cg_total >= cg_total_max) return 1;
    if (uid != 0 && cg_uid_max && u && u->n >= cg_uid_max) return 2;
  }
  if (!u) {
    if (cg_nuids == cg_capuids) {
      size_t cap = cg_capuids ? 2 * cg_capuids : 16;
      struct cg_uid *nu = realloc(cg_uids, cap * sizeof *nu);
      if (!nu) return -1;
      cg_uids = nu;
      cg_capuids = cap;
    }
    u = &cg_uids[cg_nuids++];
    u->uid = uid;
    u->n = u->n_admin = 0;
  }
  cg_owner[fd] = uid;
  if (admin) {
    u->n_admin++;
    if (!op) cg_admin_others++;
  } else {
    u->n++;
    cg_total++;
  }
  unsigned mark = !admin ? CG_COUNTED : op ? CG_ADMIN : CG_ADMIN | CG_OTHER;
  atomic_fetch_or_explicit(&cg_counted[fd], (unsigned char)mark,
                           memory_order_relaxed);
  return 0;
}

/* Under cg_mu: starts reading fd's handshake; -1 when out of memory. */
static int cg_watch(int fd) {
  struct cg_hs *h = calloc(1, sizeof *h);
  if (!h) return -1;
  atomic_store(&cg_hs[fd], h);
  atomic_fetch_or_explicit(&cg_counted[fd], CG_HS, memory_order_relaxed);
  return 0;
}

static uint64_t cg_be(const unsigned char *p, int n) {
  uint64_t v = 0;
  for (int i = 0; i < n; i++) v = v << 8 | p[i];
  return v;
}

/* READY's body (name, then properties: name, 4-byte length, value): 1
 * when it is READY and names no routing id, else -1. */
static int cg_ready_ok(const unsigned char *p, size_t len) {
  if (len < 6 || p[0] != 5 || memcmp(p + 1, "READY", 5) != 0) return -1;
  for (size_t i = 6; i < len;) {
    size_t nl = p[i];
    if (len - i < 1 + nl + 4) return -1;
    const unsigned char *name = p + i + 1;
    uint64_t vl = cg_be(p + i + 1 + nl, 4);
    i += 1 + nl + 4;
    if (vl > len - i) return -1;
    if (nl == 8 && memcmp(name, "Identity", 8) == 0 && vl > 0) return -1;
    i += (size_t)vl;
  }
  return 1;
}

/*
 * Feeds n more bytes of a connection's stream to its handshake's reader:
 * 0 while the READY command is not complete, 1 once it is and may pass,
 * -1 when the connection must go (not ZMTP 3 with the NULL mechanism, or
 * a routing id of its own).  *used: how many of the n were the
 * handshake's (the rest are frames).
 */
static int cg_hs_feed(struct cg_hs *h, const unsigned char *in, size_t n,
                      size_t *used) {
  size_t room = sizeof h->buf - h->got;
  if (n > room) n = room;
  memcpy(h->buf + h->got, in, n);
  uint32_t before = h->got;
  h->got += (uint32_t)n;
  *used = n;
  const unsigned char *b = h->buf;
  /* Signature 0xff ... 0x7f (bit 0 of byte 9 set: else ZMTP 1.0, whose
   * first message is a routing id), major version 3 or later (2.0 sends
   * one too), mechanism NULL. */
  if (h->got >= 1 && b[0] != 0xff) return -1;
  if (h->got >= 10 && !(b[9] & 1)) return -1;
  if (h->got >= 11 && b[10] < 3) return -1;
  static const unsigned char null_mech[20] = "NULL";
  if (h->got >= 32 && memcmp(b + 12, null_mech, sizeof null_mech) != 0)
    return -1;
  if (h->got <= CG_GREETING) return 0;
  unsigned flags = b[CG_GREETING];
  if (flags != 0x04 && flags != 0x06) return -1; /* READY is a command */
  size_t head = flags == 0x04 ? 2 : 9;
  if (h->got < CG_GREETING + head) return 0;
  uint64_t size = cg_be(b + CG_GREETING + 1, (int)head - 1);
  if (size > CG_READY_MAX) return -1;
  if (h->got < CG_GREETING + head + size) return 0;
  *used = CG_GREETING + head + (size_t)size - before;
  return cg_ready_ok(b + CG_GREETING + head, (size_t)size);
}

/*
 * Feeds n more bytes of the frames after READY (ZMTP 3: flags, with MORE
 * 0x1, LONG 0x2 and COMMAND 0x4, then a size of 1 or 8 bytes, then the
 * body): 0 while they may pass, -1 when a message has more than
 * CG_PARTS_MAX parts.  Commands (PING, PONG) are no parts.
 */
static int cg_frames_feed(struct cg_hs *h, const unsigned char *in,
                          size_t n) {
  while (n > 0) {
    if (h->left > 0) {
      size_t k = n < h->left ? n : (size_t)h->left;
      in += k;
      n -= k;
      h->left -= k;
      continue;
    }
    h->head[h->head_got++] = *in++;
    n--;
    unsigned flags = h->head[0];
    size_t need = flags & 0x2 ? 9 : 2;
    if (h->head_got < need) continue;
    h->left = cg_be(h->head + 1, (int)need - 1);
    h->head_got = 0;
    if (flags & 0x4) continue;
    if (!(flags & 0x1))
      h->parts = 0;
    else if (++h->parts >= CG_PARTS_MAX)
      return -1;
  }
  return 0;
}

/* At READY: the handshake's buffer goes, the frame state stays.  The
 * connection's reader, which may have moved. */
static struct cg_hs *cg_hs_frames(int fd, struct cg_hs *h) {
  h->framing = 1;
  struct cg_hs *small = realloc(h, offsetof(struct cg_hs, buf));
  if (small == NULL) return h; /* keeps its buffer, works as well */
  atomic_store(&cg_hs[fd], small);
  return small;
}

static int cg_accept(int lfd, struct sockaddr *addr, socklen_t *len,
                     int flags) {
  int fd = cg_sys_accept4(lfd, addr, len, flags);
  if (!atomic_load(&cg_on)) return fd;
  if (fd < 0) {
    if (errno != EMFILE && errno != ENFILE) return fd;
    /* Take the connection on the spare descriptor and drop it: libzmq
     * aborts on EMFILE, and a connection left queued keeps the listener
     * readable for ever. */
    pthread_mutex_lock(&cg_mu);
    if (cg_spare >= 0) {
      cg_sys_close(cg_spare);
      int c = cg_sys_accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
      if (c >= 0) cg_sys_close(c);
      cg_spare = open("/dev/null", O_RDONLY | O_CLOEXEC);
    }
    cg_refused_fds++;
    pthread_mutex_unlock(&cg_mu);
    errno = ECONNABORTED;
    return -1;
  }
  /* The client socket's and the admin socket's connections count, each
   * against caps of their own; the other listeners cap their own (the
   * descriptor channel, metrics) or are not ours.  Both ZeroMQ sockets'
   * handshakes are read. */
  struct sockaddr_un un;
  socklen_t ul = sizeof un;
  struct ucred cred;
  socklen_t cl = sizeof cred;
  memset(&un, 0, sizeof un);
  if ((size_t)fd >= cg_nfd ||
      getsockname(fd, (struct sockaddr *)&un, &ul) != 0 ||
      un.sun_family != AF_UNIX || ul <= offsetof(struct sockaddr_un, sun_path))
    return fd;
  int client = strncmp(un.sun_path, cg_path, sizeof un.sun_path) == 0;
  int admin = strncmp(un.sun_path, cg_admin_path, sizeof un.sun_path) == 0;
  if ((!client && !admin) ||
      getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &cl) != 0)
    return fd; /* not a connection to a ZeroMQ socket of ours */
  pthread_mutex_lock(&cg_mu);
  int why = cg_count(fd, cred.uid, !client);
  if (why == 1) cg_refused_total++;
  if (why == 2) cg_refused_uid++;
  if (why == 3) cg_refused_admin++;
  if (why == 0 && cg_watch(fd) != 0) {
    cg_forget(fd);
    why = -1;
  }
  pthread_mutex_unlock(&cg_mu);
  if (why == 0) return fd;
  cg_sys_close(fd);
  errno = ECONNABORTED;
  return -1;
}

/* The definitions libzmq's calls resolve to (see connguard.h): of
 * default visibility, so that the executable exports them. */
#define CG_EXPORT __attribute__((visibility("default")))

CG_EXPORT int accept4(int fd, struct sockaddr *addr, socklen_t *len, int flags) {
  return cg_accept(fd, addr, len, flags);
}

CG_EXPORT int accept(int fd, struct sockaddr *addr, socklen_t *len) {
  return cg_accept(fd, addr, len, 0);
}

/* libzmq's read of a connection (tcp_read); a connection whose stream
 * is being read gets ECONNRESET when it must go (see the top). */
CG_EXPORT ssize_t recv(int fd, void *buf, size_t len, int flags) {
  ssize_t n = cg_sys_recv(fd, buf, len, flags);
  if (n <= 0 || fd < 0 || (size_t)fd >= cg_nfd || (flags & MSG_PEEK) ||
      !(atomic_load_explicit(&cg_counted[fd], memory_order_relaxed) & CG_HS))
    return n;
  struct cg_hs *h = atomic_load(&cg_hs[fd]);
  if (!h) return n;
  const unsigned char *in = buf;
  size_t used = 0;
  int ok = 0;
  if (!h->framing) {
    ok = cg_hs_feed(h, in, (size_t)n, &used);
    if (ok > 0) h = cg_hs_frames(fd, h);
  }
  if (ok < 0) {
    atomic_fetch_add(&cg_refused_hs, 1);
  } else if (h->framing && cg_frames_feed(h, in + used, (size_t)n - used)) {
    atomic_fetch_add(&cg_refused_parts, 1);
    ok = -1;
  }
  if (ok >= 0) return n;
  atomic_fetch_and_explicit(&cg_counted[fd], (unsigned char)~CG_HS,
                            memory_order_relaxed);
  free(atomic_exchange(&cg_hs[fd], NULL));
  errno = ECONNRESET;
  return -1;
}

CG_EXPORT int close(int fd) {
  if (fd >= 0 && (size_t)fd < cg_nfd &&
      atomic_load_explicit(&cg_counted[fd], memory_order_relaxed)) {
    pthread_mutex_lock(&cg_mu);
    cg_forget(fd);
    pthread_mutex_unlock(&cg_mu);
  }
  return cg_sys_close(fd);
}
