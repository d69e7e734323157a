/*
 * http_admin.c - operators' sleep and wake over HTTP (http_admin.h): a
 * libmicrohttpd server without a thread or a listening socket of its own,
 * run by the loop on admin-http.sock.
 *
 * Who may act: every request is an operator's or it is refused 403 before
 * its arguments are read, by the admin socket's own check
 * (gmb__admin_allowed, the peer's SO_PEERCRED uid read at connect); what
 * it does goes through the admin socket's handler (gmb__admin) as the
 * AdminPause, admin_resume or quota-get request gmbctl would send, so the
 * check is made again there, the actions and their log lines are
 * gmbctl's, and nothing of sleep.c is written twice.
 *
 * Bounds, since the socket is 0666 whenever admin_uids names a uid other
 * than the broker's: connections are accepted here (not by
 * libmicrohttpd), each counted against its uid from the moment it starts
 * until it closes: an operator's uid HA_PER_OPERATOR, any other uid
 * HA_PER_OTHER and all other uids together HA_OTHERS, HA_CONNECTIONS in
 * all; one past a cap is closed at once and counted for the log.  A
 * connection serves one request and is closed HA_TIMEOUT_S after it was
 * accepted, idle or not: libmicrohttpd's own timeout counts from the last
 * byte that moved, so a peer that sends a byte every few seconds would
 * hold its place for ever, and gmb__http_run (http.c, shared with the
 * metrics endpoint) shuts its socket down instead (libmicrohttpd then
 * reads the end and closes it as any other).  A
 * request's line and headers fit in HA_MEMORY bytes or libmicrohttpd
 * answers it 414/431 itself; a body is never read (the response is queued
 * on the first call, before it, and the connection closes after it); a
 * query with a key given twice that may be given once, more than
 * HA_TAGS_MAX tags, an unknown key or a bad value is answered 400 and
 * nothing is done, and so is a target with a NUL byte (%00) anywhere
 * (ha_unescape), which libmicrohttpd's C strings would cut short.
 *
 * Invariants: every connection open now has its ha_conn as its socket
 * context, in `conns`, counted in `uids` (and `others` when no operator's
 * uid connected it), from its start (ha_notify) to its end, or it was shut
 * down as it started (no peer, no memory, no row for its uid); everything
 * runs on the loop's thread.
 */
#include "http_admin.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "admin.h"
#include "core.h"
#include "gmb.h"
#include "http.h"
#include "log.h"
#include "session.h"
#include "sleep.h"
#include "tenant.h"
#include "util.h"

#define HA_CONNECTIONS 64  /* in all */
#define HA_PER_OPERATOR 16 /* connections of one operator uid */
#define HA_PER_OTHER 2     /* of one other uid (each request gets 403) */
#define HA_OTHERS 16       /* of all other uids together */
#define HA_TIMEOUT_S 5     /* a connection is closed this long after its
                              accept, idle or not */
#define HA_MEMORY 8192     /* a connection's buffer: request line, headers */
#define HA_ACCEPT_BATCH 16 /* connections accepted per turn of the loop */
#define HA_TAGS_MAX 8      /* tags one request names (a library queues 8) */
#define HA_NAMES_MAX 256   /* tag names /is_sleeping lists */
#define HA_JSON "application/json"

struct gmb_http_admin {
  struct gmb_broker *b;
  struct MHD_Daemon *d;
  int listen_fd;
  int spare_fd; /* given up to take a connection when out of descriptors */
  struct gmb_http_uids uids;
  unsigned others;  /* connections of uids that were no operator's */
  uint64_t refused; /* since the last gmb__http_admin_refused */
  struct gmb_http_conns conns; /* every connection open now (ha_conn) */
};

/* A connection's peer, as its socket said when it connected, and when it
 * must be gone. */
struct ha_conn {
  struct gmb_http_conn hc; /* its uid, socket and deadline */
  gid_t gid;
  pid_t pid;
  int other; /* counted in `others` */
  int nul;   /* a %00 in the request's path or query (ha_unescape) */
};

static struct gmb_log_rl ha_rl_denied, ha_rl_emfile;

/* --- connections ----------------------------------------------------------- */

static int ha_room(struct gmb_http_admin *h, uid_t uid) {
  unsigned *n = gmb__http_uid_count(&h->uids, uid, 0);
  unsigned have = n ? *n : 0;
  if (gmb__admin_allowed(h->b, uid)) return have < HA_PER_OPERATOR;
  return have < HA_PER_OTHER && h->others < HA_OTHERS;
}

/* Counts a connection in (its peer read from its socket) and out.  One
 * that cannot be counted is shut down at once: libmicrohttpd reads its
 * end and closes it, so nothing open escapes the caps or the deadline. */
static void ha_notify(void *cls, struct MHD_Connection *conn, void **ctx,
                      enum MHD_ConnectionNotificationCode code) {
  struct gmb_http_admin *h = cls;
  if (code == MHD_CONNECTION_NOTIFY_STARTED) {
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CONNECTION_FD);
    struct ucred cred;
    socklen_t cl = sizeof cred;
    struct ha_conn *c;
    unsigned *n = NULL;
    *ctx = NULL;
    if (ci == NULL) return; /* never: libmicrohttpd knows its socket */
    /* A row made here and left at 0 is a free row again. */
    if (getsockopt(ci->connect_fd, SOL_SOCKET, SO_PEERCRED, &cred, &cl) != 0 ||
        (n = gmb__http_uid_count(&h->uids, cred.uid, 1)) == NULL ||
        (c = malloc(sizeof *c)) == NULL) {
      shutdown(ci->connect_fd, SHUT_RDWR);
      return;
    }
    (*n)++;
    *c = (struct ha_conn){.gid = cred.gid, .pid = cred.pid,
                          .other = !gmb__admin_allowed(h->b, cred.uid)};
    gmb__http_conn_add(&h->conns, &c->hc, ci->connect_fd, cred.uid);
    h->others += (unsigned)c->other;
    *ctx = c;
  } else if (code == MHD_CONNECTION_NOTIFY_CLOSED && *ctx) {
    struct ha_conn *c = *ctx;
    unsigned *n = gmb__http_uid_count(&h->uids, c->hc.uid, 0);
    GMB_ASSERT(n && *n && "a connection counted in its uid's row");
    (*n)--;
    h->others -= (unsigned)c->other;
    gmb__http_conn_remove(&c->hc);
    free(c);
    *ctx = NULL;
  }
}

void gmb__http_admin_accept(struct gmb_http_admin *h) {
  for (int i = 0; i < HA_ACCEPT_BATCH; i++) {
    struct sockaddr_un sa;
    socklen_t sl = sizeof sa;
    int fd = accept4(h->listen_fd, (struct sockaddr *)&sa, &sl,
                     SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0 && (errno == EMFILE || errno == ENFILE) && h->spare_fd >= 0) {
      /* Left queued, it would keep the listener readable: a busy loop. */
      close(h->spare_fd);
      fd = accept4(h->listen_fd, NULL, NULL, SOCK_CLOEXEC);
      if (fd >= 0) close(fd);
      h->spare_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
      if (gmb__log_allow(&ha_rl_emfile))
        log_warn("%s: out of descriptors: a connection refused%s",
                 GMB_ADMIN_HTTP_SOCKET, gmb__log_suppressed(&ha_rl_emfile));
      continue;
    }
    if (fd < 0) {
      if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR &&
          errno != ECONNABORTED)
        log_warn("%s: accept: %s", GMB_ADMIN_HTTP_SOCKET, strerror(errno));
      return;
    }
    struct ucred cred;
    socklen_t cl = sizeof cred;
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &cl) != 0 ||
        !ha_room(h, cred.uid)) {
      h->refused++;
      close(fd);
      continue;
    }
    /* Closes fd itself when it fails (past HA_CONNECTIONS). */
    if (MHD_add_connection(h->d, fd, (struct sockaddr *)&sa, sl) != MHD_YES)
      h->refused++;
  }
}

/* --- answers ---------------------------------------------------------------- */

/* s as a JSON string; bytes that are not UTF-8 (a query's %ff, a tag a
 * client named so) would make jansson refuse it: each byte outside
 * printable ASCII is then '?'. */
static json_t *ha_text(const char *s) {
  json_t *j = json_string(s);
  if (j) return j;
  char safe[WIRE_MESSAGE_MAX];
  size_t i = 0;
  for (; s[i] && i + 1 < sizeof safe; i++)
    safe[i] = s[i] >= 0x20 && s[i] < 0x7f ? s[i] : '?';
  safe[i] = '\0';
  return json_string(safe);
}

static enum MHD_Result ha_json(struct MHD_Connection *conn, unsigned code,
                               json_t *j, const char *allow) {
  char *text = j ? json_dumps(j, JSON_COMPACT) : NULL;
  json_decref(j);
  if (text == NULL) { /* out of memory */
    static const char oom[] = "{\"error\":\"out of host memory\"}";
    return gmb__http_reply(conn, MHD_HTTP_INTERNAL_SERVER_ERROR, oom,
                           sizeof oom - 1, MHD_RESPMEM_PERSISTENT, HA_JSON,
                           NULL);
  }
  size_t len = strlen(text);
  text[len] = '\n'; /* replaces the NUL: the length says where it ends */
  return gmb__http_reply(conn, code, text, len + 1, MHD_RESPMEM_MUST_FREE,
                         HA_JSON, allow);
}

/* {"error": message, "code": GMB_E_*} with the HTTP code that fits rc. */
static enum MHD_Result ha_fail(struct MHD_Connection *conn, int rc,
                               const char *allow, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

static enum MHD_Result ha_fail(struct MHD_Connection *conn, int rc,
                               const char *allow, const char *fmt, ...) {
  char msg[WIRE_MESSAGE_MAX];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  unsigned code = rc == GMB_E_AUTH    ? MHD_HTTP_FORBIDDEN
                  : rc == GMB_E_NOENT ? MHD_HTTP_NOT_FOUND
                  : rc == GMB_E_INVAL ? MHD_HTTP_BAD_REQUEST
                  : rc == GMB_E_LIMIT ? MHD_HTTP_TOO_MANY_REQUESTS
                  : rc == GMB_E_PROTO ? MHD_HTTP_METHOD_NOT_ALLOWED
                                      : MHD_HTTP_INTERNAL_SERVER_ERROR;
  return ha_json(conn, code,
                 json_pack("{s:o, s:s}", "error", ha_text(msg), "code",
                           gmb_err_name(rc)),
                 allow);
}

/* --- the query -------------------------------------------------------------- */

/* libmicrohttpd's decoding of the path and of each key and value of the
 * query, as its own, but a %00 marks the connection: the handler gets C
 * strings, which a NUL would cut short ("/sleep%00x" would be /sleep,
 * "tenant=llm%00x" tenant llm), so such a request is refused instead. */
static size_t ha_unescape(void *cls, struct MHD_Connection *conn, char *s) {
  (void)cls;
  size_t n = MHD_http_unescape(s);
  if (memchr(s, '\0', n)) {
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(conn, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
    struct ha_conn *c = ci ? ci->socket_context : NULL;
    if (c) c->nul = 1;
  }
  return n;
}

struct ha_args {
  const char *path; /* for messages */
  const char *tenant, *level;
  const char *tags[HA_TAGS_MAX];
  unsigned n_tags;
  char err[256]; /* "": all well so far */
};

/* One key of the query (its value NULL when it has no '='), both
 * percent-decoded (no NUL in either: ha_unescape). */
static enum MHD_Result ha_arg(void *cls, enum MHD_ValueKind kind,
                              const char *key, const char *value) {
  struct ha_args *a = cls;
  (void)kind;
  const char **one = NULL;
  if (strcmp(key, "tenant") == 0)
    one = &a->tenant;
  else if (strcmp(key, "level") == 0)
    one = &a->level;
  else if (strcmp(key, "tag") != 0 && strcmp(key, "tags") != 0)
    snprintf(a->err, sizeof a->err, "unknown query argument '%.40s' (%s "
             "takes tenant, level, tag)", key, a->path);
  if (a->err[0]) return MHD_NO;
  if (value == NULL || value[0] == '\0') {
    snprintf(a->err, sizeof a->err, "%.40s has no value", key);
  } else if (one && *one) {
    snprintf(a->err, sizeof a->err, "%.40s given twice", key);
  } else if (one) {
    *one = value;
  } else if (strlen(value) > WIRE_TAG_MAX) {
    snprintf(a->err, sizeof a->err, "a tag has 1 to %d bytes", WIRE_TAG_MAX);
  } else if (a->n_tags == HA_TAGS_MAX) {
    snprintf(a->err, sizeof a->err, "more than %d tags", HA_TAGS_MAX);
  } else {
    for (unsigned i = 0; i < a->n_tags; i++)
      if (strcmp(a->tags[i], value) == 0)
        snprintf(a->err, sizeof a->err, "tag %.63s given twice", value);
    a->tags[a->n_tags++] = value;
  }
  return a->err[0] ? MHD_NO : MHD_YES;
}

/* --- the endpoints ---------------------------------------------------------- */

/* The broker's answer to one admin request made for this HTTP request:
 * 0 or its status (its reason in rep->message); the caller clears *rep. */
static int ha_admin(struct gmb_http_admin *h, const struct gmb_peer *peer,
                    const struct wire_request *req, struct wire_reply *rep) {
  struct gmb_broker *b = h->b;
  int sent = gmb__admin(b, peer, req, rep);
  GMB_ASSERT(sent && "pause, resume and quota get answer at once");
  if (b->checks && gmb__core_check(b) != 0)
    GMB_ASSERT(!"consistency check failed after an HTTP request");
  return rep->status;
}

/* POST /sleep and /wake_up: AdminPause or admin_resume per tag. */
static enum MHD_Result ha_sleep(struct gmb_http_admin *h,
                                struct MHD_Connection *conn,
                                const struct gmb_peer *peer,
                                const struct ha_args *a, int wake) {
  int level = 1;
  if (wake && a->level)
    return ha_fail(conn, GMB_E_INVAL, NULL, "/wake_up takes no level");
  if (a->level && strcmp(a->level, "1") == 0) level = 1;
  else if (a->level && strcmp(a->level, "2") == 0) level = 2;
  else if (a->level)
    return ha_fail(conn, GMB_E_INVAL, NULL, "level must be 1 or 2");
  /* vLLM's levels, as gmb_torch's presets: 1 keeps the weights in host
   * memory and drops the KV cache, 2 drops both.  Named tags: level 1
   * offloads them, 2 drops them.  A wake with no tag: every tag an
   * operator or the broker paused. */
  static const char *const preset[] = {"weights", "kv_cache"};
  const char *const *tags = a->n_tags ? a->tags : preset;
  unsigned n = a->n_tags ? a->n_tags : wake ? 1 : 2;
  json_t *did = wake ? json_array() : json_object();
  uint32_t sessions = 0;
  for (unsigned i = 0; i < n; i++) {
    struct wire_request req = {.kind = wake ? WIRE_ADMIN_RESUME
                                            : WIRE_ADMIN_PAUSE};
    const char *tag = wake && a->n_tags == 0 ? "" : tags[i];
    int discard = !wake && (level == 2 || (a->n_tags == 0 && i == 1));
    snprintf(req.u.admin_pause.tenant, sizeof req.u.admin_pause.tenant, "%s",
             a->tenant);
    snprintf(req.u.admin_pause.tag, sizeof req.u.admin_pause.tag, "%s", tag);
    req.u.admin_pause.discard = discard;
    struct wire_reply rep;
    int rc = ha_admin(h, peer, &req, &rep);
    if (rc) {
      json_decref(did);
      enum MHD_Result r = ha_fail(conn, rc, NULL, "%s", rep.message);
      gmb__wire_reply_clear(&rep);
      return r;
    }
    sessions = rep.u.pause.sessions;
    gmb__wire_reply_clear(&rep);
    if (wake && tag[0]) json_array_append_new(did, ha_text(tag));
    else if (!wake) {
      json_t *key = ha_text(tag);
      if (key)
        json_object_set_new(did, json_string_value(key),
                            json_string(discard ? "discard" : "offload"));
      json_decref(key);
    }
  }
  json_t *j = json_pack("{s:s, s:I, s:o, s:s}", "tenant", a->tenant,
                        "sessions", (json_int_t)sessions,
                        wake ? "tags" : "asked", did, "note",
                        "each session acts from its library's thread: "
                        "GET /is_sleeping shows what is paused");
  if (j && !wake) json_object_set_new(j, "level", json_integer(level));
  return ha_json(conn, MHD_HTTP_OK, j, NULL);
}

/* GET /is_sleeping: the tenant's row (quota get) and its paused tags. */
static enum MHD_Result ha_is_sleeping(struct gmb_http_admin *h,
                                      struct MHD_Connection *conn,
                                      const struct gmb_peer *peer,
                                      const struct ha_args *a) {
  if (a->level)
    return ha_fail(conn, GMB_E_INVAL, NULL, "/is_sleeping takes no level");
  if (a->n_tags > 1)
    return ha_fail(conn, GMB_E_INVAL, NULL, "/is_sleeping takes one tag");
  struct wire_request req = {.kind = WIRE_ADMIN_QUOTA};
  snprintf(req.u.admin_limit.tenant, sizeof req.u.admin_limit.tenant, "%s",
           a->tenant);
  struct wire_reply rep;
  int rc = ha_admin(h, peer, &req, &rep);
  if (rc) {
    enum MHD_Result r = ha_fail(conn, rc, NULL, "%s", rep.message);
    gmb__wire_reply_clear(&rep);
    return r;
  }
  struct wire_tenant_row row = rep.u.tenant_row;
  gmb__wire_reply_clear(&rep);
  const struct gmb_tenant *t = gmb__tenant_find(h->b->tenants, a->tenant);
  GMB_ASSERT(t && "quota get found it");
  const char *listed[HA_NAMES_MAX];
  int tag_paused = 0;
  int n = gmb__sleep_tenant_tags(t, listed, HA_NAMES_MAX,
                                 a->n_tags ? a->tags[0] : NULL, &tag_paused);
  if (n < 0) return ha_fail(conn, n, NULL, "out of host memory");
  json_t *names = json_array();
  for (int i = 0; i < n; i++) json_array_append_new(names, ha_text(listed[i]));
  int sleeping = a->n_tags ? tag_paused : row.paused_tags > 0;
  json_t *j = json_pack(
      "{s:b, s:s, s:o, s:I, s:I, s:I, s:I}", "is_sleeping", sleeping,
      "tenant", row.name, "paused_tags", names, "host_bytes",
      (json_int_t)row.host_bytes, "paused_bytes",
      (json_int_t)row.paused_bytes, "used", (json_int_t)row.used,
      "sessions", (json_int_t)row.sessions);
  if (j && a->n_tags) json_object_set_new(j, "tag", ha_text(a->tags[0]));
  return ha_json(conn, MHD_HTTP_OK, j, NULL);
}

static enum MHD_Result ha_handle(void *cls, struct MHD_Connection *conn,
                                 const char *url, const char *method,
                                 const char *version, const char *upload_data,
                                 size_t *upload_data_size, void **con_cls) {
  struct gmb_http_admin *h = cls;
  static int answered;
  (void)version;
  (void)upload_data;
  if (*con_cls == &answered) { /* a body after the answer: not read */
    *upload_data_size = 0;
    return MHD_YES;
  }
  *con_cls = &answered;
  const union MHD_ConnectionInfo *ci =
      MHD_get_connection_info(conn, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
  struct ha_conn *c = ci ? ci->socket_context : NULL;
  int nul = c && c->nul;
  if (c) c->nul = 0; /* for a next request, were there one */
  if (nul)
    return ha_fail(conn, GMB_E_INVAL, NULL, "a NUL byte (%%00) in the path or "
                   "the query");
  int get = strcmp(method, MHD_HTTP_METHOD_GET) == 0 ||
            strcmp(method, MHD_HTTP_METHOD_HEAD) == 0;
  int post = strcmp(method, MHD_HTTP_METHOD_POST) == 0;
  int what = strcmp(url, "/sleep") == 0         ? 1
             : strcmp(url, "/wake_up") == 0     ? 2
             : strcmp(url, "/is_sleeping") == 0 ? 3
                                                : 0;
  if (what == 0)
    return ha_fail(conn, GMB_E_NOENT, NULL, "no such endpoint: POST /sleep, "
                   "POST /wake_up, GET /is_sleeping");
  if (what == 3 ? !get : !post)
    return ha_fail(conn, GMB_E_PROTO, what == 3 ? "GET, HEAD" : "POST",
                   "%s takes %s", url, what == 3 ? "GET" : "POST");
  if (c == NULL || !gmb__admin_allowed(h->b, c->hc.uid)) {
    if (gmb__log_allow(&ha_rl_denied))
      log_warn("%s %s on %s from uid %ld refused: not an operator%s", method,
               url, GMB_ADMIN_HTTP_SOCKET, c ? (long)c->hc.uid : -1L,
               gmb__log_suppressed(&ha_rl_denied));
    return ha_fail(conn, GMB_E_AUTH, NULL, "uid %ld is not an operator of "
                   "this broker (see admin_uids)", c ? (long)c->hc.uid : -1L);
  }
  struct ha_args a = {.path = url};
  MHD_get_connection_values(conn, MHD_GET_ARGUMENT_KIND, ha_arg, &a);
  if (a.err[0]) return ha_fail(conn, GMB_E_INVAL, NULL, "%s", a.err);
  if (a.tenant == NULL)
    return ha_fail(conn, GMB_E_INVAL, NULL, "%s needs tenant=NAME", url);
  if (!gmb__name_valid(a.tenant))
    return ha_fail(conn, GMB_E_INVAL, NULL, "bad tenant name '%.63s'",
                   a.tenant);
  struct gmb_peer peer = {.uid = c->hc.uid, .gid = c->gid, .pid = c->pid};
  if (what == 3) return ha_is_sleeping(h, conn, &peer, &a);
  return ha_sleep(h, conn, &peer, &a, what == 2);
}

/* --- life cycle ------------------------------------------------------------- */

int gmb__http_admin_start(struct gmb_broker *b, int listen_fd,
                          struct gmb_http_admin **out, char *err,
                          size_t cap) {
  *out = NULL;
  struct gmb_http_admin *h = calloc(1, sizeof *h);
  if (h == NULL) {
    close(listen_fd);
    snprintf(err, cap, "out of host memory");
    return GMB_E_SYSTEM;
  }
  h->b = b;
  h->listen_fd = listen_fd;
  h->conns = (struct gmb_http_conns){.what = GMB_ADMIN_HTTP_SOCKET,
                                     .timeout_s = HA_TIMEOUT_S};
  h->spare_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  h->d = MHD_start_daemon(
      MHD_USE_EPOLL | MHD_USE_NO_LISTEN_SOCKET, 0, NULL, NULL, ha_handle, h,
      MHD_OPTION_CONNECTION_LIMIT, (unsigned int)HA_CONNECTIONS,
      MHD_OPTION_CONNECTION_TIMEOUT, (unsigned int)HA_TIMEOUT_S,
      MHD_OPTION_CONNECTION_MEMORY_LIMIT, (size_t)HA_MEMORY,
      MHD_OPTION_NOTIFY_CONNECTION, ha_notify, h,
      MHD_OPTION_UNESCAPE_CALLBACK, ha_unescape, NULL, MHD_OPTION_END);
  const union MHD_DaemonInfo *di =
      h->d ? MHD_get_daemon_info(h->d, MHD_DAEMON_INFO_EPOLL_FD) : NULL;
  if (di == NULL) {
    int saved = errno;
    snprintf(err, cap, "%s: the HTTP server did not start (%s); "
             "admin_http = no runs the broker without it",
             GMB_ADMIN_HTTP_SOCKET,
             h->d ? "no epoll descriptor" : strerror(saved));
    gmb__http_admin_stop(h);
    return GMB_E_SYSTEM;
  }
  *out = h;
  return 0;
}

int gmb__http_admin_listen_fd(const struct gmb_http_admin *h) {
  return h->listen_fd;
}

int gmb__http_admin_epoll_fd(const struct gmb_http_admin *h) {
  return MHD_get_daemon_info(h->d, MHD_DAEMON_INFO_EPOLL_FD)->epoll_fd;
}

void gmb__http_admin_run(struct gmb_http_admin *h) {
  gmb__http_run(h->d, &h->conns);
}

long gmb__http_admin_timeout_ms(struct gmb_http_admin *h) {
  return gmb__http_timeout_ms(h->d, &h->conns);
}

uint64_t gmb__http_admin_refused(struct gmb_http_admin *h) {
  uint64_t n = h->refused;
  h->refused = 0;
  return n;
}

void gmb__http_admin_stop(struct gmb_http_admin *h) {
  if (h == NULL) return;
  if (h->d) MHD_stop_daemon(h->d); /* closes the connections */
  if (h->listen_fd >= 0) close(h->listen_fd);
  if (h->spare_fd >= 0) close(h->spare_fd);
  free(h);
}
