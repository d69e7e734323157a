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

struct cg_uid {
  uid_t uid;
  uint32_t n;
};

static pthread_mutex_t cg_mu = PTHREAD_MUTEX_INITIALIZER;
static atomic_uchar *cg_counted; /* per descriptor number */
static uid_t *cg_owner;
static size_t cg_nfd;
static struct cg_uid *cg_uids; /* uids with connections, unordered */
static size_t cg_nuids, cg_capuids;
static uint32_t cg_total, cg_total_max, cg_uid_max;
static int cg_spare = -1;
static char cg_path[sizeof(((struct sockaddr_un *)0)->sun_path)];
static atomic_int cg_on;
static uint64_t cg_refused_total, cg_refused_uid, cg_refused_fds;

static int cg_sys_accept4(int fd, struct sockaddr *addr, socklen_t *len,
                          int flags) {
  return (int)syscall(SYS_accept4, fd, addr, len, flags);
}

static int cg_sys_close(int fd) { return (int)syscall(SYS_close, fd); }

int gmb__connguard_init(const char *path) {
  if (strlen(path) >= sizeof cg_path) {
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
    if (!cg_counted || !cg_owner) {
      free(cg_counted);
      free(cg_owner);
      cg_counted = NULL;
      cg_owner = NULL;
      errno = ENOMEM;
      rc = -1;
    } else {
      cg_nfd = n;
    }
  }
  if (rc == 0 && cg_spare < 0) cg_spare = open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (rc == 0) memcpy(cg_path, path, strlen(path) + 1);
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

void gmb__connguard_stats(struct gmb_connguard_stats *out) {
  pthread_mutex_lock(&cg_mu);
  out->connections = cg_total;
  out->refused_total = cg_refused_total;
  out->refused_uid = cg_refused_uid;
  out->refused_fds = cg_refused_fds;
  pthread_mutex_unlock(&cg_mu);
}

/* Under cg_mu. */
static struct cg_uid *cg_uid_find(uid_t uid) {
  for (size_t i = 0; i < cg_nuids; i++)
    if (cg_uids[i].uid == uid) return &cg_uids[i];
  return NULL;
}

/* Under cg_mu: forgets descriptor fd's connection, if counted. */
static void cg_forget(int fd) {
  if (!atomic_load_explicit(&cg_counted[fd], memory_order_relaxed)) return;
  atomic_store_explicit(&cg_counted[fd], 0, memory_order_relaxed);
  cg_total--;
  struct cg_uid *u = cg_uid_find(cg_owner[fd]);
  if (u && --u->n == 0) *u = cg_uids[--cg_nuids];
}

/* Under cg_mu: counts connection fd of uid, or says why not (0: counted,
 * 1: past the total, 2: past the uid's cap, -1: out of memory). */
static int cg_count(int fd, uid_t uid) {
  cg_forget(fd); /* a stale mark: closed behind close() */
  if (cg_total_max && cg_total >= cg_total_max) return 1;
  struct cg_uid *u = cg_uid_find(uid);
  if (uid != 0 && cg_uid_max && u && u->n >= cg_uid_max) return 2;
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
    u->n = 0;
  }
  u->n++;
  cg_total++;
  cg_owner[fd] = uid;
  atomic_store_explicit(&cg_counted[fd], 1, memory_order_relaxed);
  return 0;
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
  /* Only the client socket's connections count: the admin socket is the
   * operator's way in during a flood, and the other listeners cap their
   * own (the descriptor channel) or are not Unix sockets (metrics). */
  struct sockaddr_un un;
  socklen_t ul = sizeof un;
  struct ucred cred;
  socklen_t cl = sizeof cred;
  memset(&un, 0, sizeof un);
  if ((size_t)fd >= cg_nfd ||
      getsockname(fd, (struct sockaddr *)&un, &ul) != 0 ||
      un.sun_family != AF_UNIX || ul <= offsetof(struct sockaddr_un, sun_path) ||
      strncmp(un.sun_path, cg_path, sizeof un.sun_path) != 0 ||
      getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &cl) != 0)
    return fd; /* not a connection to the client socket: not counted */
  pthread_mutex_lock(&cg_mu);
  int why = cg_count(fd, cred.uid);
  if (why == 1) cg_refused_total++;
  if (why == 2) cg_refused_uid++;
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

CG_EXPORT int close(int fd) {
  if (fd >= 0 && (size_t)fd < cg_nfd &&
      atomic_load_explicit(&cg_counted[fd], memory_order_relaxed)) {
    pthread_mutex_lock(&cg_mu);
    cg_forget(fd);
    pthread_mutex_unlock(&cg_mu);
  }
  return cg_sys_close(fd);
}
