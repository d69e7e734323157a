/*
 * endpoint.c - default endpoints and the probe of an ipc:// socket file.
 *
 * The probe opens a plain non-blocking AF_UNIX connection and closes it at
 * once.  The broker's ROUTER accepts it and sees it go before any ZMTP
 * greeting, which it treats as a peer that left; no session is created.
 * EAGAIN (the listen backlog is full) means a broker is there but busy,
 * which is not an error here.
 */
#include "endpoint.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "gmb.h"
#include "util.h"

char *gmb__endpoint_default(const char *run_dir, const char *name, char *buf,
                            size_t cap) {
  char dir[256];
  if (run_dir == NULL) {
    run_dir = gmb__run_dir(dir, sizeof dir);
    if (run_dir == NULL) return NULL;
  }
  int n = snprintf(buf, cap, "ipc://%s/%s", run_dir, name);
  if (n < 0 || (size_t)n >= cap) return NULL;
  return buf;
}

static int endpoint_fail(char *why, size_t cap, const char *endpoint,
                         const char *reason, const char *hint) {
  if (hint && *hint)
    snprintf(why, cap, "no broker at %s: %s (%s)", endpoint, reason, hint);
  else
    snprintf(why, cap, "no broker at %s: %s", endpoint, reason);
  return GMB_E_CONN;
}

int gmb__endpoint_probe(const char *endpoint, const char *hint, char *why,
                        size_t cap) {
  if (strncmp(endpoint, "ipc://", 6) != 0) return 0;
  const char *path = endpoint + 6;
  struct sockaddr_un sa;
  memset(&sa, 0, sizeof sa);
  sa.sun_family = AF_UNIX;
  if (strlen(path) >= sizeof sa.sun_path)
    return endpoint_fail(why, cap, endpoint, "path too long for a Unix socket",
                         NULL);
  memcpy(sa.sun_path, path, strlen(path) + 1);

  struct stat st;
  if (stat(path, &st) != 0) {
    if (errno == EACCES) {
      snprintf(why, cap, "cannot connect to %s: %s", endpoint, strerror(errno));
      return GMB_E_CONN;
    }
    return endpoint_fail(why, cap, endpoint, strerror(errno), hint);
  }
  if (!S_ISSOCK(st.st_mode))
    return endpoint_fail(why, cap, endpoint, "not a socket", hint);

  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return 0; /* cannot probe; let ZeroMQ try */
  int rc = connect(fd, (struct sockaddr *)&sa, sizeof sa);
  int err = errno;
  close(fd);
  if (rc == 0 || err == EAGAIN || err == EINPROGRESS) return 0;
  if (err == ECONNREFUSED)
    return endpoint_fail(why, cap, endpoint,
                         "connection refused: a stale socket file, nothing listens on it", hint);
  if (err == EACCES || err == EPERM) {
    snprintf(why, cap, "cannot connect to %s: %s", endpoint, strerror(err));
    return GMB_E_CONN;
  }
  return endpoint_fail(why, cap, endpoint, strerror(err), hint);
}

/* 0 when `path` (lstat: not followed) is owned by root or `uid`, else
 * GMB_E_AUTH with the reason; `dir`: it must also be a directory nobody
 * else may write to. */
static int endpoint_owned(const char *path, uid_t uid, int dir, char *why,
                          size_t cap) {
  struct stat st;
  if (lstat(path, &st) != 0) {
    snprintf(why, cap, "%s: %s", path, strerror(errno));
    return GMB_E_CONN;
  }
  if (st.st_uid != 0 && st.st_uid != uid) {
    snprintf(why, cap, "%s belongs to uid %u, neither root nor uid %u: it "
             "may not be the broker's", path, (unsigned)st.st_uid,
             (unsigned)uid);
    return GMB_E_AUTH;
  }
  if (dir && !S_ISDIR(st.st_mode)) {
    snprintf(why, cap, "%s is not a directory", path);
    return GMB_E_AUTH;
  }
  if (dir && (st.st_mode & (S_IWGRP | S_IWOTH))) {
    snprintf(why, cap, "%s is writable by others (mode %03o): anyone could "
             "put a socket there", path, (unsigned)(st.st_mode & 0777));
    return GMB_E_AUTH;
  }
  if (!dir && !S_ISSOCK(st.st_mode)) {
    snprintf(why, cap, "%s is not a socket", path);
    return GMB_E_AUTH;
  }
  return 0;
}

int gmb__run_dir_trusted(const char *dir, uid_t uid, char *why, size_t cap) {
  return endpoint_owned(dir, uid, 1, why, cap);
}

/* 1 when only root could have given `dir` (a path to a directory) to
 * `owner`: above it, directories of `owner` that no one else may write,
 * up to one of root's that no one else may write, so root chose the
 * owner and the owner made the rest (systemd's RuntimeDirectory= makes
 * /run/gmb for the broker's user, which makes /run/gmb/GPU-... itself). */
static int endpoint_made_by_root(const char *dir, uid_t owner) {
  char p[PATH_MAX];
  if (realpath(dir, p) == NULL) return 0;
  for (;;) {
    char *slash = strrchr(p, '/');
    if (slash == NULL || slash == p) return 0; /* reached "/": no */
    *slash = '\0';
    struct stat st;
    if (stat(p, &st) != 0 || !S_ISDIR(st.st_mode) ||
        (st.st_mode & (S_IWGRP | S_IWOTH)))
      return 0;
    if (st.st_uid == 0) return 1;
    if (st.st_uid != owner) return 0;
  }
}

int gmb__endpoint_trusted(const char *endpoint, uid_t uid, char *why,
                          size_t cap) {
  if (strncmp(endpoint, "ipc://", 6) != 0) return 0;
  const char *path = endpoint + 6;
  char dir[sizeof(((struct sockaddr_un *)0)->sun_path) + 1];
  size_t n = strlen(path);
  if (n >= sizeof dir) {
    snprintf(why, cap, "endpoint path too long");
    return GMB_E_INVAL;
  }
  memcpy(dir, path, n + 1);
  char *slash = strrchr(dir, '/');
  if (slash == NULL) {
    dir[0] = '.';
    dir[1] = '\0';
  } else if (slash == dir) {
    dir[1] = '\0';
  } else {
    *slash = '\0';
  }
  struct stat st;
  uid_t owner = uid;
  if (lstat(dir, &st) == 0 && S_ISDIR(st.st_mode) && st.st_uid != 0 &&
      st.st_uid != uid && endpoint_made_by_root(dir, st.st_uid))
    owner = st.st_uid; /* the broker's user, given the dir by root */
  int rc = endpoint_owned(dir, owner, 1, why, cap);
  if (rc == 0) rc = endpoint_owned(path, owner, 0, why, cap);
  return rc;
}
