/*
 * config.c - reads the broker's INI file with inih into struct gmb_config.
 *
 * Everything is parsed into a private struct that starts from the defaults;
 * *out is written only when the whole file was valid, so a failed load (or
 * a failed reload) never leaves a half-applied configuration behind.  The
 * first error stops the parse and is the one reported, as
 * "FILE:LINE: [section] key: reason".
 *
 * inih is fed through our own line reader rather than ini_parse_file, for
 * three reasons that all come from how Debian builds libinih 55 (the
 * defaults in <ini.h>: INI_HANDLER_LINENO 0, INI_CALL_HANDLER_ON_NEW_SECTION
 * 0, INI_MAX_LINE 200, MAX_SECTION 50):
 *  - the handler is not told the line number, so the reader counts lines;
 *  - the handler is never called for a section header, and it receives the
 *    section name cut to 49 bytes ("[tenant:" plus a 63-byte name does not
 *    fit), so the reader recognises section headers itself, exactly as inih
 *    does, and the handler ignores inih's copy of the name;
 *  - inih splits a line longer than 199 bytes into two "lines" without a
 *    word; the reader refuses such a line instead.
 * Inline comments are "value ; comment" (a ';' after whitespace); '#' only
 * starts a comment at the beginning of a line.  A line that starts with
 * whitespace right after a key continues that key's value (Python
 * configparser style), which here reads as the key given twice.
 */
#include "config.h"

#include <ctype.h>
#include <errno.h>
#include <ini.h>
#include <math.h>
#include <pwd.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gmb.h"
#include "log.h"
#include "util.h"

enum cfg_section { CFG_NONE, CFG_BROKER, CFG_TENANT };

struct cfg_parse {
  const char *path;
  FILE *f;
  int line;                /* the line the reader returned last */
  struct gmb_config c;     /* the result, copied out only on success */
  enum cfg_section sec;
  char sec_label[80];      /* "[broker]", "[tenant:llm-a]" for messages */
  int broker_line;         /* where [broker] was seen; 0: not yet */
  int key_in_section;      /* inih's prev_name is set: see cfg_reader */
  int seen_line[32];       /* per key of the current section: line or 0 */
  int err_line;            /* 0 while there is no error */
  char *err;
  size_t errcap;
};

/* Records the first error; later ones are consequences and are dropped. */
__attribute__((format(printf, 3, 4))) static int cfg_fail(
    struct cfg_parse *p, int line, const char *fmt, ...) {
  if (p->err_line) return 0;
  p->err_line = line;
  if (p->err && p->errcap) {
    int n = snprintf(p->err, p->errcap, "%s:%d: ", p->path, line);
    if (n >= 0 && (size_t)n < p->errcap) {
      va_list ap;
      va_start(ap, fmt);
      vsnprintf(p->err + n, p->errcap - (size_t)n, fmt, ap);
      va_end(ap);
    }
  }
  return 0;
}

/* ---- values ------------------------------------------------------------ */

static int cfg_size(struct cfg_parse *p, const char *key, const char *v,
                    uint64_t *out) {
  if (gmb__size_parse(v, out) == 0) return 1;
  return cfg_fail(p, p->line,
                  "%s %s: bad size '%s' (want e.g. 512MiB, 20GiB or bytes)",
                  p->sec_label, key, v);
}

/* A whole decimal integer in [lo, hi]: no spaces, no trailing text. */
static int cfg_int_in(const char *v, long lo, long hi, long *out) {
  char *end;
  if (*v == '\0' || isspace((unsigned char)*v)) return 0;
  errno = 0;
  long x = strtol(v, &end, 10);
  if (errno || *end != '\0' || x < lo || x > hi) return 0;
  *out = x;
  return 1;
}

static int cfg_int(struct cfg_parse *p, const char *key, const char *v,
                   long lo, long hi, long *out) {
  if (cfg_int_in(v, lo, hi, out)) return 1;
  return cfg_fail(p, p->line, "%s %s: bad value '%s' (want an integer %ld..%ld)",
                  p->sec_label, key, v, lo, hi);
}

/* Copies a string value into a fixed field. */
static int cfg_str(struct cfg_parse *p, const char *key, const char *v,
                   char *dst, size_t cap) {
  size_t n = strlen(v);
  if (n < cap) {
    memcpy(dst, v, n + 1);
    return 1;
  }
  return cfg_fail(p, p->line, "%s %s: too long (%zu bytes; the limit is %zu)",
                  p->sec_label, key, n, cap - 1);
}

/* One uid: a number, or else a user name looked up in the password
 * database (names may start with a digit). */
static int cfg_uid_one(const char *s, uid_t *out) {
  if (s[0] != '\0' && s[strspn(s, "0123456789")] == '\0') {
    char *end;
    errno = 0;
    unsigned long long x = strtoull(s, &end, 10);
    /* (uid_t)-1 means "no uid" to setreuid() and friends: never a user. */
    if (errno || x >= (unsigned long long)(uid_t)-1) return 0;
    *out = (uid_t)x;
    return 1;
  }
  struct passwd pw, *res = NULL;
  char buf[4096];
  if (getpwnam_r(s, &pw, buf, sizeof buf, &res) != 0 || res == NULL) return 0;
  *out = res->pw_uid;
  return 1;
}

uid_t gmb__config_overflow_uid(void) {
  static _Atomic long long cached = -1; /* the admin socket's threads */
  long long v = atomic_load_explicit(&cached, memory_order_relaxed);
  if (v >= 0) return (uid_t)v;
  unsigned long long x;
  FILE *f = fopen("/proc/sys/kernel/overflowuid", "re");
  v = 65534;
  if (f && fscanf(f, "%llu", &x) == 1 && x < (unsigned long long)(uid_t)-1)
    v = (long long)x;
  if (f) fclose(f);
  atomic_store_explicit(&cached, v, memory_order_relaxed);
  return (uid_t)v;
}

int gmb__config_operator(const uid_t *admins, size_t n, uid_t overflow,
                         uid_t uid) {
  if (uid == overflow) return 0;
  if (uid == geteuid()) return 1;
  for (size_t i = 0; i < n; i++)
    if (admins[i] == uid) return 1;
  return 0;
}

/* A uid list may not name the overflow uid: every peer the broker cannot
 * map would be that operator or that tenant's. */
static int cfg_uid_overflow(struct cfg_parse *p, const char *key,
                            const char *item, uid_t uid) {
  if (uid != gmb__config_overflow_uid()) return 1;
  return cfg_fail(p, p->line, "%s %s: uid %u ('%s') is the overflow uid "
                  "(/proc/sys/kernel/overflowuid): every peer without a uid "
                  "in the broker's user namespace shows as it, so it names "
                  "no one", p->sec_label, key, (unsigned)uid, item);
}

/* "0, 1001,alice": an empty value is an empty list. */
static int cfg_uids(struct cfg_parse *p, const char *key, const char *v,
                    uid_t *uids, size_t *n_out) {
  size_t n = 0;
  const char *s = v;
  if (*s == '\0') {
    *n_out = 0;
    return 1;
  }
  for (;;) {
    while (isspace((unsigned char)*s)) s++;
    const char *e = strchr(s, ',');
    size_t len = e ? (size_t)(e - s) : strlen(s);
    while (len && isspace((unsigned char)s[len - 1])) len--;
    char item[256];
    if (len == 0 || len >= sizeof item)
      return cfg_fail(p, p->line,
                      "%s %s: bad uid list '%s' (want e.g. 0,1001,alice)",
                      p->sec_label, key, v);
    memcpy(item, s, len);
    item[len] = '\0';
    if (n == GMB_CONFIG_UIDS_MAX)
      return cfg_fail(p, p->line, "%s %s: more than %d uids", p->sec_label,
                      key, GMB_CONFIG_UIDS_MAX);
    if (!cfg_uid_one(item, &uids[n]))
      return cfg_fail(p, p->line,
                      "%s %s: bad uid '%s' (not a uid number or a user name)",
                      p->sec_label, key, item);
    if (!cfg_uid_overflow(p, key, item, uids[n])) return 0;
    n++;
    if (e == NULL) break;
    s = e + 1;
  }
  *n_out = n;
  return 1;
}

static int cfg_hexval(int ch) {
  if (ch >= '0' && ch <= '9') return ch - '0';
  if (ch >= 'a' && ch <= 'f') return ch - 'a' + 10;
  if (ch >= 'A' && ch <= 'F') return ch - 'A' + 10;
  return -1;
}

static int cfg_token(struct cfg_parse *p, const char *key, const char *v,
                     uint8_t out[32]) {
  uint8_t tmp[32];
  int ok = strlen(v) == 64;
  for (size_t i = 0; ok && i < 32; i++) {
    int hi = cfg_hexval((unsigned char)v[2 * i]);
    int lo = cfg_hexval((unsigned char)v[2 * i + 1]);
    if (hi < 0 || lo < 0) ok = 0;
    else tmp[i] = (uint8_t)(hi << 4 | lo);
  }
  if (!ok)
    return cfg_fail(p, p->line,
                    "%s %s: bad value '%s' (want 64 hex digits: the SHA-256 "
                    "of the token, e.g. from sha256sum)",
                    p->sec_label, key, v);
  memcpy(out, tmp, 32);
  return 1;
}

/* auto, cuda:N or host:SIZE with SIZE > 0. */
static int cfg_device(struct cfg_parse *p, const char *key, const char *v) {
  uint64_t size;
  long n;
  int ok = strcmp(v, "auto") == 0 ||
           (strncmp(v, "cuda:", 5) == 0 && isdigit((unsigned char)v[5]) &&
            cfg_int_in(v + 5, 0, 1023, &n)) ||
           (strncmp(v, "host:", 5) == 0 && gmb__size_parse(v + 5, &size) == 0 &&
            size > 0);
  if (!ok)
    return cfg_fail(p, p->line,
                    "%s %s: bad device '%s' (want auto, cuda:N or host:SIZE)",
                    p->sec_label, key, v);
  return cfg_str(p, key, v, p->c.device, sizeof p->c.device);
}

/* HOST:PORT, HOST may be [v6]; empty: no metrics endpoint. */
static int cfg_listen(struct cfg_parse *p, const char *key, const char *v) {
  const char *colon = strrchr(v, ':');
  long port;
  int ok = *v == '\0' ||
           (colon && colon > v && cfg_int_in(colon + 1, 1, 65535, &port) &&
            (v[0] != '[' || colon[-1] == ']'));
  if (!ok)
    return cfg_fail(p, p->line,
                    "%s %s: bad address '%s' (want HOST:PORT, e.g. "
                    "127.0.0.1:9464)",
                    p->sec_label, key, v);
  return cfg_str(p, key, v, p->c.metrics_listen, sizeof p->c.metrics_listen);
}

static int cfg_bool(struct cfg_parse *p, const char *key, const char *v,
                    int *out) {
  if (!strcmp(v, "yes") || !strcmp(v, "on") || !strcmp(v, "true") ||
      !strcmp(v, "1"))
    *out = 1;
  else if (!strcmp(v, "no") || !strcmp(v, "off") || !strcmp(v, "false") ||
           !strcmp(v, "0"))
    *out = 0;
  else
    return cfg_fail(p, p->line, "%s %s: bad value '%s' (want yes or no)",
                    p->sec_label, key, v);
  return 1;
}

/* ---- keys -------------------------------------------------------------- */

enum {
  K_DEVICE, K_CAPACITY, K_DEVICE_RESERVE, K_RUN_DIR, K_STATE, K_ADMIN_UIDS,
  K_DEFAULT_QUOTA, K_COMPACTION, K_COMPACTION_THRESHOLD, K_METRICS_LISTEN,
  K_LOG_LEVEL, K_HEARTBEAT_MS, K_SHUTDOWN_GRACE_MS, K_MAX_SESSIONS,
  K_MAX_SESSIONS_PER_UID, K_MAX_TENANTS_PER_UID, K_MAX_WAITERS_PER_SESSION,
  K_MAX_WAITERS_PER_TENANT, K_RUN_DIR_PER_GPU, K_TRIM_WAIT_MS,
  K_METRICS_TENANTS, K_SLEEP_WAIT_MS, K_CLIENT_CONTEXTS, K_ADMIN_HTTP,
  K_OFFLOAD_HOST_MAX, K_RESTORE_WAIT_MS, K_CACHE_HOLES,
  K_DEFAULT_HOST_QUOTA, K_SEGMENT_LINGER_MS,
};
static const char *const cfg_broker_keys[] = {
    "device",        "capacity",   "device_reserve",       "run_dir",
    "state",         "admin_uids", "default_quota",        "compaction",
    "compaction_threshold", "metrics_listen", "log_level", "heartbeat_ms",
    "shutdown_grace_ms", "max_sessions", "max_sessions_per_uid",
    "max_tenants_per_uid", "max_waiters_per_session",
    "max_waiters_per_tenant", "run_dir_per_gpu", "trim_wait_ms",
    "metrics_tenants", "sleep_wait_ms", "client_contexts", "admin_http",
    "offload_host_max", "restore_wait_ms", "cache_holes",
    "default_host_quota", "segment_linger_ms",
};

enum { K_QUOTA, K_RESERVE, K_UIDS, K_TOKEN, K_PRIORITY, K_HOST_QUOTA };
static const char *const cfg_tenant_keys[] = {
    "quota", "reserve", "uids", "token_sha256", "priority", "host_quota",
};

/* A number 0..1 into *out; 1, or 0 with the error. */
static int cfg_fraction(struct cfg_parse *p, const char *key, const char *v,
                        double *out) {
  char *end;
  errno = 0;
  double d = strtod(v, &end);
  /* isfinite() also refuses "nan", which passes both comparisons. */
  if (*v == '\0' || isspace((unsigned char)*v) || errno || *end != '\0' ||
      !isfinite(d) || d < 0.0 || d > 1.0)
    return cfg_fail(p, p->line,
                    "%s %s: bad value '%s' (want a number 0..1, e.g. 0.3)",
                    p->sec_label, key, v);
  *out = d;
  return 1;
}

static int cfg_broker_key(struct cfg_parse *p, int k, const char *key,
                          const char *v) {
  struct gmb_config *c = &p->c;
  long x;
  switch (k) {
    case K_DEVICE: return cfg_device(p, key, v);
    case K_CAPACITY: return cfg_size(p, key, v, &c->capacity);
    case K_DEVICE_RESERVE:
      if (strcmp(v, "auto") == 0) {
        c->device_reserve = GMB_DEVICE_RESERVE_AUTO;
        return 1;
      }
      return cfg_size(p, key, v, &c->device_reserve);
    case K_CLIENT_CONTEXTS:
      if (!cfg_int(p, key, v, 0, 4096, &x)) return 0;
      c->client_contexts = (uint32_t)x;
      return 1;
    case K_RUN_DIR: return cfg_str(p, key, v, c->run_dir, sizeof c->run_dir);
    case K_STATE: return cfg_str(p, key, v, c->state, sizeof c->state);
    case K_ADMIN_UIDS:
      return cfg_uids(p, key, v, c->admin_uids, &c->n_admin_uids);
    case K_DEFAULT_QUOTA:
      if (strcmp(v, "auto") == 0) {
        c->default_quota = GMB_DEFAULT_QUOTA_AUTO;
        return 1;
      }
      return cfg_size(p, key, v, &c->default_quota);
    case K_COMPACTION:
      if (strcmp(v, "auto") == 0) c->compaction = 1;
      else if (strcmp(v, "off") == 0) c->compaction = 0;
      else
        return cfg_fail(p, p->line, "%s %s: bad value '%s' (want auto or off)",
                        p->sec_label, key, v);
      return 1;
    case K_COMPACTION_THRESHOLD:
      return cfg_fraction(p, key, v, &c->compaction_threshold);
    case K_CACHE_HOLES:
      return cfg_fraction(p, key, v, &c->cache_holes);
    case K_DEFAULT_HOST_QUOTA:
      if (strcmp(v, "auto") == 0) {
        c->default_host_quota = GMB_DEFAULT_HOST_QUOTA_AUTO;
        return 1;
      }
      return cfg_size(p, key, v, &c->default_host_quota);
    case K_METRICS_LISTEN: return cfg_listen(p, key, v);
    case K_LOG_LEVEL:
      if (gmb__log_level_parse(v, &c->log_level) != 0)
        return cfg_fail(p, p->line,
                        "%s %s: bad value '%s' (want error, warn, info or "
                        "debug)",
                        p->sec_label, key, v);
      return 1;
    case K_HEARTBEAT_MS:
      if (!cfg_int(p, key, v, 100, 60000, &x)) return 0;
      c->heartbeat_ms = (uint32_t)x;
      return 1;
    case K_SHUTDOWN_GRACE_MS:
      if (!cfg_int(p, key, v, 0, 60000, &x)) return 0;
      c->shutdown_grace_ms = (uint32_t)x;
      return 1;
    case K_MAX_SESSIONS:
      if (!cfg_int(p, key, v, 1, 1000000, &x)) return 0;
      c->max_sessions = (uint32_t)x;
      return 1;
    case K_MAX_SESSIONS_PER_UID:
      if (!cfg_int(p, key, v, 1, 1000000, &x)) return 0;
      c->max_sessions_per_uid = (uint32_t)x;
      return 1;
    case K_MAX_TENANTS_PER_UID:
      if (!cfg_int(p, key, v, 1, 4096, &x)) return 0;
      c->max_tenants_per_uid = (uint32_t)x;
      return 1;
    case K_MAX_WAITERS_PER_SESSION:
      if (!cfg_int(p, key, v, 1, 1000000, &x)) return 0;
      c->max_waiters_per_session = (uint32_t)x;
      return 1;
    case K_MAX_WAITERS_PER_TENANT:
      if (!cfg_int(p, key, v, 1, 1000000, &x)) return 0;
      c->max_waiters_per_tenant = (uint32_t)x;
      return 1;
    case K_TRIM_WAIT_MS:
      /* A held request's reply must come well before the client's own
       * request timeout (GMB_REQUEST_TIMEOUT_MS, 10 s by default). */
      if (!cfg_int(p, key, v, 0, 5000, &x)) return 0;
      c->trim_wait_ms = (uint32_t)x;
      return 1;
    case K_SEGMENT_LINGER_MS:
      /* An hour at most: a segment kept longer is memory the device's
       * other users never see come back. */
      if (!cfg_int(p, key, v, 0, 3600000, &x)) return 0;
      c->segment_linger_ms = (uint32_t)x;
      return 1;
    case K_SLEEP_WAIT_MS:
      /* An offload takes longer than a trim, but the held request's reply
       * must still come before the client's own request timeout
       * (GMB_REQUEST_TIMEOUT_MS, 10 s by default). */
      if (!cfg_int(p, key, v, 0, 8000, &x)) return 0;
      c->sleep_wait_ms = (uint32_t)x;
      return 1;
    case K_OFFLOAD_HOST_MAX: return cfg_size(p, key, v, &c->offload_host_max);
    case K_RESTORE_WAIT_MS:
      /* Below the client's own request timeout, as sleep_wait_ms: the
       * client waits this long plus its request timeout for the answer. */
      if (!cfg_int(p, key, v, 0, 60000, &x)) return 0;
      c->restore_wait_ms = (uint32_t)x;
      return 1;
    case K_RUN_DIR_PER_GPU: return cfg_bool(p, key, v, &c->run_dir_per_gpu);
    case K_METRICS_TENANTS: return cfg_bool(p, key, v, &c->metrics_tenants);
    case K_ADMIN_HTTP: return cfg_bool(p, key, v, &c->admin_http);
  }
  GMB_ASSERT(0 && "a broker key without a case");
}

static int cfg_tenant_key(struct cfg_parse *p, int k, const char *key,
                          const char *v) {
  GMB_ASSERT(p->c.n_tenants > 0 && "a tenant key outside a tenant section");
  struct gmb_tenant_conf *t = &p->c.tenants[p->c.n_tenants - 1];
  long x;
  switch (k) {
    case K_QUOTA: return cfg_size(p, key, v, &t->quota);
    case K_RESERVE: return cfg_size(p, key, v, &t->reserve);
    case K_UIDS: return cfg_uids(p, key, v, t->uids, &t->n_uids);
    case K_TOKEN:
      if (!cfg_token(p, key, v, t->token_sha256)) return 0;
      t->has_token = 1;
      return 1;
    case K_PRIORITY:
      if (!cfg_int(p, key, v, -100, 100, &x)) return 0;
      t->priority = (int)x;
      return 1;
    case K_HOST_QUOTA: return cfg_size(p, key, v, &t->host_quota);
  }
  GMB_ASSERT(0 && "a tenant key without a case");
}

/* inih's callback for each name=value (and each continuation line). */
static int cfg_handler(void *user, const char *section, const char *name,
                       const char *value) {
  struct cfg_parse *p = user;
  (void)section; /* cut to 49 bytes by inih: p->sec is the truth */
  if (p->err_line) return 0;
  p->key_in_section = name[0] != '\0';

  const char *const *keys;
  size_t n_keys;
  switch (p->sec) {
    case CFG_NONE:
      return cfg_fail(p, p->line,
                      "'%s' outside a section (put it under [broker] or "
                      "[tenant:NAME])",
                      name);
    case CFG_BROKER:
      keys = cfg_broker_keys;
      n_keys = sizeof cfg_broker_keys / sizeof cfg_broker_keys[0];
      break;
    case CFG_TENANT:
    default:
      keys = cfg_tenant_keys;
      n_keys = sizeof cfg_tenant_keys / sizeof cfg_tenant_keys[0];
      break;
  }
  size_t k = 0;
  while (k < n_keys && strcmp(keys[k], name) != 0) k++;
  if (k == n_keys)
    return cfg_fail(p, p->line, "%s unknown key '%s'", p->sec_label, name);
  GMB_ASSERT(k < sizeof p->seen_line / sizeof p->seen_line[0]);
  /* A key given twice is most likely a slip (or an indented line read as a
   * continuation); the second would silently win, so refuse it. */
  if (p->seen_line[k])
    return cfg_fail(p, p->line, "%s %s: given twice (first at line %d)",
                    p->sec_label, name, p->seen_line[k]);
  p->seen_line[k] = p->line;
  return p->sec == CFG_BROKER ? cfg_broker_key(p, (int)k, name, value)
                              : cfg_tenant_key(p, (int)k, name, value);
}

/* ---- sections ---------------------------------------------------------- */

/* Checks that need the whole section: run when it ends. */
static int cfg_section_end(struct cfg_parse *p) {
  if (p->sec != CFG_TENANT) return 1;
  const struct gmb_tenant_conf *t = &p->c.tenants[p->c.n_tenants - 1];
  char q[GMB_SIZE_BUFSZ], r[GMB_SIZE_BUFSZ];
  if (t->quota && t->reserve > t->quota)
    return cfg_fail(p, t->line,
                    "[tenant:%s] reserve %s is more than quota %s", t->name,
                    gmb__size_format(t->reserve, r, sizeof r),
                    gmb__size_format(t->quota, q, sizeof q));
  return 1;
}

static int cfg_section_begin(struct cfg_parse *p, const char *name,
                             size_t len) {
  if (!cfg_section_end(p)) return 0;
  memset(p->seen_line, 0, sizeof p->seen_line);
  p->key_in_section = 0;
  if (len == 6 && memcmp(name, "broker", 6) == 0) {
    if (p->broker_line)
      return cfg_fail(p, p->line, "duplicate section [broker] (first at line %d)",
                      p->broker_line);
    p->broker_line = p->line;
    p->sec = CFG_BROKER;
    snprintf(p->sec_label, sizeof p->sec_label, "[broker]");
    return 1;
  }
  if (len < 7 || memcmp(name, "tenant:", 7) != 0)
    return cfg_fail(p, p->line,
                    "unknown section [%.*s] (want [broker] or [tenant:NAME])",
                    (int)(len > 100 ? 100 : len), name);
  const char *tn = name + 7;
  size_t tlen = len - 7;
  char tname[64];
  if (tlen >= sizeof tname || memchr(tn, '\0', tlen) != NULL)
    return cfg_fail(p, p->line,
                    "[tenant:%.*s...] bad tenant name (1 to 63 of A-Z a-z 0-9 "
                    "._- not starting with . or -)",
                    40, tn);
  memcpy(tname, tn, tlen);
  tname[tlen] = '\0';
  if (!gmb__name_valid(tname))
    return cfg_fail(p, p->line,
                    "[tenant:%s] bad tenant name (1 to 63 of A-Z a-z 0-9 ._- "
                    "not starting with . or -)",
                    tname);
  const struct gmb_tenant_conf *dup = gmb__config_tenant(&p->c, tname);
  if (dup)
    return cfg_fail(p, p->line,
                    "duplicate section [tenant:%s] (first at line %d)", tname,
                    dup->line);
  struct gmb_tenant_conf *ts =
      realloc(p->c.tenants, (p->c.n_tenants + 1) * sizeof *ts);
  if (ts == NULL) return cfg_fail(p, p->line, "out of memory");
  p->c.tenants = ts;
  struct gmb_tenant_conf *t = &ts[p->c.n_tenants++];
  memset(t, 0, sizeof *t);
  memcpy(t->name, tname, tlen + 1);
  t->line = p->line;
  p->sec = CFG_TENANT;
  snprintf(p->sec_label, sizeof p->sec_label, "[tenant:%s]", tname);
  return 1;
}

/*
 * inih's line source.  Besides counting lines it spots section headers the
 * way inih 55 does: after leading whitespace a '[' starts a header unless
 * the line is indented and follows a key (then inih reads it as the
 * continuation of that key's value); the name runs to the first ']', and a
 * ';' after whitespace before it is a comment, which inih calls a syntax
 * error.  Returning NULL ends the parse, which is how the first error stops
 * it.
 */
static char *cfg_reader(char *str, int num, void *stream) {
  struct cfg_parse *p = stream;
  if (p->err_line) return NULL;
  if (fgets(str, num, p->f) == NULL) return NULL;
  size_t n = strlen(str);
  if (n == 0 || str[n - 1] != '\n') {
    /* Without a newline fgets stopped at EOF or after num - 1 bytes;
     * anything shorter means a NUL byte hid the rest from strlen(). */
    if (ferror(p->f)) return NULL;
    if (!feof(p->f)) {
      if (n != (size_t)num - 1) {
        cfg_fail(p, p->line + 1, "NUL byte in line");
        return NULL;
      }
      int ch = getc(p->f); /* a line of exactly num - 1 bytes still fits */
      if (ch != '\n' && ch != EOF) {
        cfg_fail(p, p->line + 1, "line too long (the limit is %d bytes)",
                 num - 1);
        return NULL;
      }
    }
  }
  p->line++;

  const char *s = str;
  if (p->line == 1 && (unsigned char)s[0] == 0xEF &&
      (unsigned char)s[1] == 0xBB && (unsigned char)s[2] == 0xBF)
    s += 3;
  const char *t = s;
  while (*t && isspace((unsigned char)*t)) t++;
  if (*t != '[' || (t > s && p->key_in_section)) return str;
  int was_space = 0;
  const char *e = t + 1;
  while (*e && *e != ']' && !(was_space && *e == ';')) {
    was_space = isspace((unsigned char)*e);
    e++;
  }
  if (*e == ']' && !cfg_section_begin(p, t + 1, (size_t)(e - (t + 1))))
    return NULL;
  return str;
}

/* ---- the interface ------------------------------------------------------ */

void gmb__config_defaults(struct gmb_config *c) {
  memset(c, 0, sizeof *c);
  snprintf(c->device, sizeof c->device, "auto");
  c->compaction = 1;
  c->compaction_threshold = 0.3;
  c->cache_holes = GMB_CACHE_HOLES_DEFAULT;
  c->default_host_quota = GMB_DEFAULT_HOST_QUOTA_AUTO;
  c->log_level = GMB_LOG_INFO;
  c->heartbeat_ms = 1000;
  c->shutdown_grace_ms = 2000;
  c->max_sessions = 4096;
  c->max_sessions_per_uid = 1024;
  c->max_tenants_per_uid = 16;
  c->max_waiters_per_session = 64;
  c->max_waiters_per_tenant = 1024;
  c->trim_wait_ms = 100;
  c->segment_linger_ms = 2000;
  c->sleep_wait_ms = 3000;
  c->offload_host_max = gmb__config_offload_default();
  c->restore_wait_ms = 3000;
  c->device_reserve = GMB_DEVICE_RESERVE_AUTO;
  c->client_contexts = 8;
  c->admin_http = 1;
}

/*
 * *out's previous contents are overwritten, not freed: it may be an
 * uninitialised struct (a reload loads into a fresh one, then swaps).
 */
int gmb__config_load(const char *path, struct gmb_config *out, char *err,
                     size_t errcap) {
  if (err && errcap) err[0] = '\0';
  if (path == NULL || out == NULL) {
    if (err && errcap) snprintf(err, errcap, "no config file named");
    return GMB_E_INVAL;
  }
  struct cfg_parse *p = calloc(1, sizeof *p); /* two PATH_MAX buffers */
  if (p == NULL) {
    if (err && errcap) snprintf(err, errcap, "%s: out of memory", path);
    return GMB_E_SYSTEM;
  }
  p->path = path;
  p->err = err;
  p->errcap = errcap;
  gmb__config_defaults(&p->c);
  p->f = fopen(path, "r");
  if (p->f == NULL) {
    if (err && errcap)
      snprintf(err, errcap, "%s: cannot open: %s", path, strerror(errno));
    free(p);
    return GMB_E_SYSTEM;
  }

  int rc = ini_parse_stream(cfg_reader, p, cfg_handler, p);
  int result = 0;
  if (ferror(p->f)) {
    /* A directory opens but does not read (EISDIR), for one. */
    int e = errno;
    if (err && errcap)
      snprintf(err, errcap, "%s: cannot read: %s", path, strerror(e));
    result = GMB_E_SYSTEM;
  } else if (rc > 0 && (p->err_line == 0 || rc < p->err_line)) {
    /* inih found a line it cannot read at all, before any error of ours. */
    p->err_line = 0;
    cfg_fail(p, rc,
             "syntax error (want [section], key = value or a ; or # "
             "comment)");
    result = GMB_E_INVAL;
  } else if (rc < 0 && p->err_line == 0) {
    if (err && errcap) snprintf(err, errcap, "%s: out of memory", path);
    result = GMB_E_SYSTEM;
  } else if (p->err_line || !cfg_section_end(p)) {
    result = GMB_E_INVAL;
  }
  fclose(p->f);

  if (result == 0)
    *out = p->c;
  else
    gmb__config_free(&p->c);
  free(p);
  return result;
}

const struct gmb_tenant_conf *gmb__config_tenant(const struct gmb_config *c,
                                                 const char *name) {
  if (c == NULL || name == NULL) return NULL;
  for (size_t i = 0; i < c->n_tenants; i++)
    if (strcmp(c->tenants[i].name, name) == 0) return &c->tenants[i];
  return NULL;
}

void gmb__config_free(struct gmb_config *c) {
  if (c == NULL) return;
  free(c->tenants);
  c->tenants = NULL;
  c->n_tenants = 0;
}

uint64_t gmb__config_default_quota(const struct gmb_config *c,
                                   uint64_t capacity) {
  if (c->default_quota != GMB_DEFAULT_QUOTA_AUTO) return c->default_quota;
  const uint64_t seg = UINT64_C(2) << 20; /* device.h's GMB_SEGMENT_ALIGN */
  uint64_t q = capacity / 4 & ~(seg - 1);
  return q ? q : seg;
}

uint64_t gmb__config_default_host_quota(const struct gmb_config *c) {
  if (c->default_host_quota != GMB_DEFAULT_HOST_QUOTA_AUTO)
    return c->default_host_quota;
  uint64_t max = c->offload_host_max ? c->offload_host_max
                                     : gmb__config_offload_default();
  return max / 4 + (max % 4 != 0); /* never 0, which means no limit */
}

uint64_t gmb__config_offload_default(void) {
  long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  uint64_t ram = pages > 0 && page > 0 ? (uint64_t)pages * (uint64_t)page
                                       : UINT64_C(4) << 30;
  return ram / 4;
}

mode_t gmb__config_admin_mode(const struct gmb_config *c) {
  for (size_t i = 0; i < c->n_admin_uids; i++)
    if (c->admin_uids[i] != geteuid()) return 0666;
  return 0600;
}
