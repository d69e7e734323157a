/*
 * statefile.c - the state file: operators' run-time quota and reservation
 * changes, kept across restarts (the format and the precedence rules are
 * in statefile.h).
 *
 * The overrides live in one table, b->statefile, owned by this module.
 * Invariant: when a state path is set, the table is exactly what the file
 * says.  A change is made on a copy of the table, the copy is written to
 * a temporary file in the same directory, fsync'd, renamed over the file
 * and the directory fsync'd; only then does the copy replace the table.
 * So a crash at any point leaves the old file or the new one, never a
 * mixture, and a change the file does not hold is never in force.
 *
 * The file sets limits, so whoever can write it commands the broker.  It
 * is read only when it is a regular file (not followed through a symbolic
 * link) owned by the broker's effective uid or by root and writable by no
 * one else; otherwise the broker refuses it and names the owner and mode
 * it wants.  A line that does not parse is reported by its number and a
 * reason, never quoted: a file the broker was pointed at may hold what
 * its author should not see in the log (a hard link to /etc/shadow).
 */
#include "statefile.h"

#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "broker.h"
#include "gmb.h"
#include "log.h"
#include "tenant.h"
#include "util.h"

struct state_entry {
  char name[WIRE_NAME_MAX + 1];
  int has[2];        /* by enum gmb_state_field */
  uint64_t value[2];
  /* The uid a tenant made by first use belongs to: kept with its limits,
   * so that a restart gives it back to that uid, not to whichever names
   * it first (only beside a quota or reserve). */
  int has_owner;
  uid_t owner;
  int line;          /* where its section starts, for messages */
};

struct state_table {
  struct state_entry *e;
  size_t n;
};

struct gmb_statefile {
  struct state_table cur;
};

/* The broker's table, made on first use; NULL out of host memory. */
static struct state_table *state_cur(struct gmb_broker *b) {
  if (b->statefile == NULL) b->statefile = calloc(1, sizeof *b->statefile);
  return b->statefile ? &b->statefile->cur : NULL;
}

static void state_table_free(struct state_table *t) {
  free(t->e);
  t->e = NULL;
  t->n = 0;
}

static struct state_entry *state_find(struct state_table *t,
                                      const char *name) {
  for (size_t i = 0; i < t->n; i++)
    if (strcmp(t->e[i].name, name) == 0) return &t->e[i];
  return NULL;
}

static struct state_entry *state_add(struct state_table *t, const char *name) {
  struct state_entry *e = realloc(t->e, (t->n + 1) * sizeof *e);
  if (e == NULL) return NULL;
  t->e = e;
  e = &t->e[t->n++];
  memset(e, 0, sizeof *e);
  snprintf(e->name, sizeof e->name, "%s", name);
  return e;
}

static int state_copy(struct state_table *dst, const struct state_table *src) {
  dst->n = 0;
  dst->e = NULL;
  if (src->n == 0) return 0;
  dst->e = malloc(src->n * sizeof *dst->e);
  if (dst->e == NULL) return -1;
  memcpy(dst->e, src->e, src->n * sizeof *dst->e);
  dst->n = src->n;
  return 0;
}

/* ---- reading ------------------------------------------------------------- */

__attribute__((format(printf, 5, 6))) static int state_fail(
    char *err, size_t errcap, const char *path, int line, const char *fmt,
    ...) {
  int n = line > 0 ? snprintf(err, errcap, "%s:%d: ", path, line)
                   : snprintf(err, errcap, "%s: ", path);
  if (n >= 0 && (size_t)n < errcap) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err + n, errcap - (size_t)n, fmt, ap);
    va_end(ap);
  }
  return GMB_E_INVAL;
}

/* Cuts a comment (# or ; at the start or after whitespace) and trims. */
static char *state_strip(char *s) {
  for (char *p = s; *p; p++)
    if ((*p == '#' || *p == ';') &&
        (p == s || isspace((unsigned char)p[-1]))) {
      *p = '\0';
      break;
    }
  while (isspace((unsigned char)*s)) s++;
  size_t n = strlen(s);
  while (n && isspace((unsigned char)s[n - 1])) s[--n] = '\0';
  return s;
}

static int state_parse(const char *path, FILE *f, struct state_table *out,
                       char *err, size_t errcap) {
  char *buf = NULL;
  size_t cap = 0;
  ssize_t len;
  int line = 0, rc = 0;
  struct state_entry *cur = NULL;
  int seen_version = 0;
  while ((len = getline(&buf, &cap, f)) >= 0) {
    line++;
    if ((size_t)len != strlen(buf)) {
      rc = state_fail(err, errcap, path, line, "NUL byte in line");
      break;
    }
    char *s = state_strip(buf);
    if (*s == '\0') continue;
    if (*s == '[') {
      size_t n = strlen(s);
      if (s[n - 1] != ']' || strncmp(s, "[tenant:", 8) != 0) {
        rc = state_fail(err, errcap, path, line,
                        "bad section header (want [tenant:NAME])");
        break;
      }
      s[n - 1] = '\0';
      const char *name = s + 8;
      if (!gmb__name_valid(name)) {
        rc = state_fail(err, errcap, path, line,
                        "bad tenant name (want 1 to 63 of A-Z a-z 0-9 . _ -, "
                        "not starting with . or -)");
        break;
      }
      struct state_entry *dup = state_find(out, name);
      if (dup) {
        rc = state_fail(err, errcap, path, line,
                        "[tenant:%s] given twice (first at line %d)", name,
                        dup->line);
        break;
      }
      cur = state_add(out, name);
      if (cur == NULL) {
        rc = state_fail(err, errcap, path, line, "out of memory");
        break;
      }
      cur->line = line;
      continue;
    }
    char *eq = strchr(s, '=');
    if (eq == NULL) {
      rc = state_fail(err, errcap, path, line,
                      "syntax error (want key = value or [tenant:NAME])");
      break;
    }
    *eq = '\0';
    char *key = state_strip(s), *val = state_strip(eq + 1);
    if (cur == NULL) {
      if (strcmp(key, "version") != 0) {
        rc = state_fail(err, errcap, path, line,
                        "unknown key outside a tenant section (only "
                        "version = 1 may come before [tenant:NAME])");
        break;
      }
      if (strcmp(val, "1") != 0) {
        rc = state_fail(err, errcap, path, line,
                        "version is not one this broker reads (want "
                        "version = 1)");
        break;
      }
      seen_version = 1;
      continue;
    }
    if (strcmp(key, "owner") == 0) {
      char *end;
      errno = 0;
      unsigned long long u = strtoull(val, &end, 10);
      if (cur->has_owner || !isdigit((unsigned char)val[0]) || *end ||
          errno || u >= (uid_t)-1) {
        rc = state_fail(err, errcap, path, line, "[tenant:%s] owner: %s",
                        cur->name, cur->has_owner
                                       ? "given twice"
                                       : "not a uid (want 0 to 4294967294)");
        break;
      }
      cur->has_owner = 1;
      cur->owner = (uid_t)u;
      continue;
    }
    int field = strcmp(key, "quota") == 0     ? GMB_STATE_QUOTA
                : strcmp(key, "reserve") == 0 ? GMB_STATE_RESERVE
                                              : -1;
    if (field < 0) {
      rc = state_fail(err, errcap, path, line,
                      "[tenant:%s] unknown key (want quota, reserve or "
                      "owner)", cur->name);
      break;
    }
    if (cur->has[field]) {
      rc = state_fail(err, errcap, path, line, "[tenant:%s] %s given twice",
                      cur->name, key);
      break;
    }
    uint64_t v;
    if (gmb__size_parse(val, &v) != 0) {
      rc = state_fail(err, errcap, path, line,
                      "[tenant:%s] %s: bad size (want bytes, or a number "
                      "with KiB, MiB, GiB, ...)", cur->name, key);
      break;
    }
    cur->has[field] = 1;
    cur->value[field] = v;
  }
  if (rc == 0 && ferror(f))
    rc = GMB_E_SYSTEM, snprintf(err, errcap, "%s: read error: %s", path,
                                strerror(errno));
  free(buf);
  if (rc == 0 && line > 0 && !seen_version && out->n > 0)
    rc = state_fail(err, errcap, path, 1, "no version = 1 line: not a gmb "
                    "state file?");
  for (size_t i = 0; rc == 0 && i < out->n; i++) {
    const struct state_entry *e = &out->e[i];
    if (e->has[GMB_STATE_QUOTA] && e->has[GMB_STATE_RESERVE] &&
        e->value[GMB_STATE_QUOTA] &&
        e->value[GMB_STATE_RESERVE] > e->value[GMB_STATE_QUOTA])
      rc = state_fail(err, errcap, path, e->line,
                      "[tenant:%s] reserve is more than quota", e->name);
  }
  if (rc) state_table_free(out);
  return rc;
}

/*
 * Opens `path` for reading when it may be trusted: a regular file, not a
 * symbolic link, owned by the broker's effective uid or root, with no
 * group or other write bit.  Returns 0 with *fdp the descriptor, or -1
 * when there is no file; or a negative GMB_E* code with `err` set.  O_NONBLOCK
 * keeps a planted FIFO from blocking the broker in open().
 */
static int state_open(const char *path, int *fdp, char *err, size_t errcap) {
  *fdp = -1;
  int fd = open(path, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return 0;
    if (errno == ELOOP) {
      snprintf(err, errcap, "%s: refused: it is a symbolic link (the state "
               "file must be a regular file owned by uid %u or root, mode "
               "0644 or stricter)", path, (unsigned)geteuid());
      return GMB_E_AUTH;
    }
    snprintf(err, errcap, "%s: cannot open: %s", path, strerror(errno));
    return GMB_E_SYSTEM;
  }
  struct stat st;
  if (fstat(fd, &st) != 0) {
    snprintf(err, errcap, "%s: cannot stat: %s", path, strerror(errno));
    close(fd);
    return GMB_E_SYSTEM;
  }
  if (!S_ISREG(st.st_mode)) {
    snprintf(err, errcap, "%s: cannot read: not a regular file", path);
    close(fd);
    return GMB_E_SYSTEM;
  }
  if ((st.st_uid != geteuid() && st.st_uid != 0) ||
      (st.st_mode & (S_IWGRP | S_IWOTH))) {
    snprintf(err, errcap, "%s: refused: owned by uid %u with mode %04o; the "
             "state file must be owned by uid %u (the broker) or root and "
             "writable by no one else (mode 0644 or stricter), since whoever "
             "writes it sets quotas", path, (unsigned)st.st_uid,
             (unsigned)(st.st_mode & 07777), (unsigned)geteuid());
    close(fd);
    return GMB_E_AUTH;
  }
  *fdp = fd;
  return 0;
}

/* Reads `path` into *out: 0 (a missing file is an empty table) or an
 * error. */
static int state_read(const char *path, struct state_table *out, char *err,
                      size_t errcap) {
  out->e = NULL;
  out->n = 0;
  int fd;
  int rc = state_open(path, &fd, err, errcap);
  if (rc != 0 || fd < 0) return rc;
  FILE *f = fdopen(fd, "r");
  if (f == NULL) {
    snprintf(err, errcap, "%s: cannot open: %s", path, strerror(errno));
    close(fd);
    return GMB_E_SYSTEM;
  }
  rc = state_parse(path, f, out, err, errcap);
  fclose(f);
  return rc;
}

/* ---- writing ------------------------------------------------------------- */

static int state_write(const char *path, const struct state_table *t,
                       char *err, size_t errcap) {
  char tmp[PATH_MAX + 16];
  if (snprintf(tmp, sizeof tmp, "%s.XXXXXX", path) >= (int)sizeof tmp) {
    snprintf(err, errcap, "%s: path too long", path);
    return GMB_E_SYSTEM;
  }
  int fd = mkstemp(tmp);
  if (fd < 0) {
    snprintf(err, errcap, "cannot create a file beside %s: %s", path,
             strerror(errno));
    return GMB_E_SYSTEM;
  }
  fchmod(fd, 0644); /* limits, not secrets: operators may read them */
  FILE *f = fdopen(fd, "w");
  if (f == NULL) {
    snprintf(err, errcap, "%s: fdopen: %s", tmp, strerror(errno));
    close(fd);
    unlink(tmp);
    return GMB_E_SYSTEM;
  }
  fprintf(f,
          "# gmb-broker state: quotas and reservations set at run time with\n"
          "# gmbctl.  Written by the broker; it overrides the config file's\n"
          "# values for these tenants (setting a tenant back to its config\n"
          "# value removes the override).\n"
          "version = 1\n");
  for (size_t i = 0; i < t->n; i++) {
    const struct state_entry *e = &t->e[i];
    if (!e->has[0] && !e->has[1]) continue;
    fprintf(f, "\n[tenant:%s]\n", e->name);
    /* Before its values: a file cut short (it never is by the broker, which
     * renames a whole one into place) inside this line leaves a section
     * with no value, which makes nothing, rather than another uid's. */
    if (e->has_owner)
      fprintf(f, "owner = %u   # the uid that made it by first use\n",
              (unsigned)e->owner);
    static const char *const keys[2] = {"quota", "reserve"};
    for (int k = 0; k < 2; k++) {
      char h[GMB_SIZE_BUFSZ];
      if (e->has[k])
        fprintf(f, "%s = %llu   # %s\n", keys[k],
                (unsigned long long)e->value[k],
                e->value[k] == 0 && k == GMB_STATE_QUOTA
                    ? "unlimited"
                    : gmb__size_format(e->value[k], h, sizeof h));
    }
  }
  int bad = fflush(f) != 0 || ferror(f) || fsync(fd) != 0;
  int e1 = errno;
  if (fclose(f) != 0 && !bad) {
    bad = 1;
    e1 = errno;
  }
  if (bad) {
    snprintf(err, errcap, "cannot write %s: %s", tmp, strerror(e1));
    unlink(tmp);
    return GMB_E_SYSTEM;
  }
  if (rename(tmp, path) != 0) {
    snprintf(err, errcap, "cannot rename %s to %s: %s", tmp, path,
             strerror(errno));
    unlink(tmp);
    return GMB_E_SYSTEM;
  }
  /* The rename is durable only once the directory is. */
  char dir[PATH_MAX];
  snprintf(dir, sizeof dir, "%s", path);
  char *slash = strrchr(dir, '/');
  if (slash == NULL)
    snprintf(dir, sizeof dir, ".");
  else if (slash == dir)
    dir[1] = '\0';
  else
    *slash = '\0';
  int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd < 0 || fsync(dfd) != 0) {
    /* The new file is in place; only its durability is in doubt. */
    log_warn("state: cannot fsync directory %s: %s", dir, strerror(errno));
  }
  if (dfd >= 0) close(dfd);
  return 0;
}

/* ---- applying ------------------------------------------------------------ */

/* The tenant `name`, created (owned by nobody) when it does not exist. */
static struct gmb_tenant *state_tenant(struct gmb_broker *b,
                                       const char *name) {
  struct gmb_tenant *t = gmb__tenant_find(b->tenants, name);
  if (t) return t;
  t = gmb__tenant_create(b->tenants, name);
  if (t == NULL) {
    log_error("state: cannot create tenant %s: the registry is full", name);
    return NULL;
  }
  log_info("tenant %s created from the state file (owned by the first uid "
           "to use it)", name);
  return t;
}

int gmb__statefile_lookup(struct gmb_broker *b, const char *name,
                          enum gmb_state_field field, uint64_t *value) {
  struct state_table *cur = b->statefile ? &b->statefile->cur : NULL;
  const struct state_entry *e = cur ? state_find(cur, name) : NULL;
  if (e == NULL || !e->has[field]) return 0;
  *value = e->value[field];
  return 1;
}

void gmb__statefile_each(struct gmb_broker *b,
                         void (*fn)(void *ctx, const char *name), void *ctx) {
  struct state_table *cur = b->statefile ? &b->statefile->cur : NULL;
  for (size_t i = 0; cur && i < cur->n; i++) fn(ctx, cur->e[i].name);
}

int gmb__statefile_apply(struct gmb_broker *b) {
  int touched = 0, rc = 0;
  const struct state_table *cur = state_cur(b);
  for (size_t i = 0; cur && i < cur->n; i++) {
    const struct state_entry *e = &cur->e[i];
    if (!e->has[0] && !e->has[1]) continue;
    struct gmb_tenant *t = state_tenant(b, e->name);
    if (t == NULL) {
      rc = GMB_E_LIMIT;
      continue;
    }
    if (e->has[GMB_STATE_QUOTA])
      gmb__tenant_set_quota(b->tenants, t, e->value[GMB_STATE_QUOTA]);
    if (e->has[GMB_STATE_RESERVE])
      gmb__tenant_set_reserve(b->tenants, t, e->value[GMB_STATE_RESERVE]);
    /* Its first uid's again (a live tenant keeps whom it has; a default
     * name, uid-N, is uid N's whatever a hand-edited file says). */
    uid_t named;
    if (e->has_owner && !t->configured && !t->has_owner && t->n_uids == 0 &&
        !t->has_token &&
        (!gmb__tenant_default_uid(t->name, &named) || named == e->owner))
      gmb__tenant_set_owner(b->tenants, t, e->owner);
    char q[GMB_SIZE_BUFSZ], r[GMB_SIZE_BUFSZ];
    if (t->quota && t->reserve > t->quota)
      log_warn("tenant %s: reservation %s is above its quota %s (one comes "
               "from the config, the other from the state file); fix it "
               "with gmbctl reserve set or gmbctl quota set", t->name,
               gmb__size_format(t->reserve, r, sizeof r),
               gmb__size_format(t->quota, q, sizeof q));
    touched++;
  }
  return rc ? rc : touched;
}

int gmb__statefile_load(struct gmb_broker *b, char *err, size_t errcap) {
  struct state_table t = {0};
  struct state_table *cur = state_cur(b);
  if (cur == NULL) {
    snprintf(err, errcap, "out of host memory");
    return GMB_E_SYSTEM;
  }
  if (b->cfg.state[0]) {
    int rc = state_read(b->cfg.state, &t, err, errcap);
    if (rc) return rc;
  }
  state_table_free(cur);
  *cur = t;
  int n = gmb__statefile_apply(b);
  if (n < 0) {
    snprintf(err, errcap, "%s: a tenant it names could not be created",
             b->cfg.state);
    return n;
  }
  if (b->cfg.state[0])
    log_info("state: %s applied (%d tenants with run-time limits)",
             b->cfg.state, n);
  return 0;
}

int gmb__statefile_reread(struct gmb_broker *b, char *err, size_t errcap) {
  if (b->cfg.state[0] == '\0') return 0; /* memory is all there is */
  struct state_table *cur = state_cur(b);
  if (cur == NULL) {
    snprintf(err, errcap, "out of host memory");
    return GMB_E_SYSTEM;
  }
  struct state_table t;
  int rc = state_read(b->cfg.state, &t, err, errcap);
  if (rc) return rc;
  state_table_free(cur);
  *cur = t;
  return 0;
}

int gmb__statefile_set(struct gmb_broker *b, const char *name,
                       enum gmb_state_field field, uint64_t value,
                       int *persisted, char *err, size_t errcap) {
  GMB_ASSERT((field == GMB_STATE_QUOTA || field == GMB_STATE_RESERVE) &&
             "a state field without a key");
  struct state_table *cur = state_cur(b);
  struct state_table next;
  if (cur == NULL || state_copy(&next, cur) != 0) {
    snprintf(err, errcap, "out of host memory");
    return GMB_E_SYSTEM;
  }
  struct state_entry *e = state_find(&next, name);
  if (e == NULL && (e = state_add(&next, name)) == NULL) {
    state_table_free(&next);
    snprintf(err, errcap, "out of host memory");
    return GMB_E_SYSTEM;
  }
  const struct gmb_tenant_conf *tc = gmb__config_tenant(&b->cfg, name);
  uint64_t conf = tc == NULL                   ? 0
                  : field == GMB_STATE_QUOTA   ? tc->quota
                                               : tc->reserve;
  /* Back to the config's value: no override, so the config rules again. */
  if (tc && value == conf) {
    e->has[field] = 0;
  } else {
    e->has[field] = 1;
    e->value[field] = value;
  }
  /* A tenant proved by nothing but its first uid: that uid goes with its
   * limits (gmb__statefile_apply gives it back after a restart). */
  const struct gmb_tenant *t = gmb__tenant_find(b->tenants, name);
  e->has_owner = t && !t->configured && t->has_owner && t->n_uids == 0 &&
                 !t->has_token;
  e->owner = e->has_owner ? t->owner_uid : 0;
  *persisted = 0;
  if (b->cfg.state[0]) {
    int rc = state_write(b->cfg.state, &next, err, errcap);
    if (rc) {
      state_table_free(&next);
      return rc;
    }
    *persisted = 1;
  }
  state_table_free(cur);
  *cur = next;
  return 0;
}

void gmb__statefile_free(struct gmb_statefile *sf) {
  if (sf == NULL) return;
  state_table_free(&sf->cur);
  free(sf);
}

