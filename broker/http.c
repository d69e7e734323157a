/*
 * http.c - the metrics endpoint: libmicrohttpd run by a thread of its own
 * (http_serve), serving the text the loop last published; and what both
 * HTTP servers share (http.h): the uid counts, the replies, and each
 * connection's absolute deadline.
 *
 * Invariants: the server thread reads nothing of the broker but `text`,
 * which it copies under `mu` into each response (libmicrohttpd's
 * MUST_COPY), so a publish may replace it at any time; the listening
 * socket is bound here, before the thread starts, so that a bad or busy
 * address is an error with its errno rather than a NULL daemon; and the
 * thread is created with every signal blocked, because the broker takes
 * SIGTERM/SIGINT through a signalfd and a signal delivered to this thread
 * would kill the process instead.
 *
 * Any local user may connect, so connections are bounded per local uid:
 * the uid that owns a loopback peer's socket is read from
 * /proc/net/tcp{,6} (the row whose local address is the peer's), and a
 * uid past HTTP_PER_UID connections is refused at accept; peers not
 * found there (other hosts, other network namespaces) share one count of
 * HTTP_PER_UID * 2.  The count lives in `uids`, touched only on the
 * server thread (the accept policy and the connection notices).  Each
 * connection is closed HTTP_TIMEOUT_S after its accept, idle or not
 * (gmb__http_run): libmicrohttpd's timeout counts idle time only, and a
 * peer trickling a byte every few seconds would otherwise keep its place
 * under the caps for ever, so a few of them could refuse every scrape.
 * The thread polls libmicrohttpd's epoll descriptor with the sooner of
 * its timeout and the next deadline, so it wakes for each; the loop never
 * waits on it (publishing takes `mu` for a pointer swap).
 */
#include "http.h"

#include <arpa/inet.h>
#include <errno.h>
#include <microhttpd.h>
#include <netdb.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include "gmb.h"
#include "log.h"
#include "util.h"

#define HTTP_CONTENT_TYPE "text/plain; version=0.0.4; charset=utf-8"
#define HTTP_CONNECTIONS 64 /* in all */
#define HTTP_PER_UID 4
#define HTTP_TIMEOUT_S 5   /* a connection is closed this long after its
                              accept, idle or not */
#define HTTP_UID_UNKNOWN ((uid_t)-1)

struct gmb_http {
  struct MHD_Daemon *d;
  uint16_t port;
  pthread_mutex_t mu;
  char *text; /* NULL until the first publish */
  size_t len;
  struct gmb_http_uids uids; /* uids with connections */
  struct gmb_http_conns conns; /* every connection open now */
  pthread_t thread;
  int stop_fd; /* an eventfd: written once, by gmb__http_stop */
  uint64_t refused;         /* past a uid's cap (read with the server
                               stopped, or racy for a log line) */
};

/* The uid owning the local TCP socket bound to `a` (the peer of one of
 * our connections), from /proc/net/tcp or tcp6; HTTP_UID_UNKNOWN when
 * none is found. */
static uid_t http_peer_uid(const struct sockaddr *a) {
  uint32_t want[4] = {0};
  unsigned port;
  int v6 = a->sa_family == AF_INET6;
  if (v6) {
    const struct sockaddr_in6 *s6 = (const void *)a;
    memcpy(want, &s6->sin6_addr, 16);
    port = ntohs(s6->sin6_port);
  } else if (a->sa_family == AF_INET) {
    const struct sockaddr_in *s4 = (const void *)a;
    memcpy(want, &s4->sin_addr, 4);
    port = ntohs(s4->sin_port);
  } else {
    return HTTP_UID_UNKNOWN;
  }
  FILE *f = fopen(v6 ? "/proc/net/tcp6" : "/proc/net/tcp", "re");
  if (f == NULL) return HTTP_UID_UNKNOWN;
  char line[512];
  uid_t uid = HTTP_UID_UNKNOWN;
  if (fgets(line, sizeof line, f) == NULL) line[0] = '\0'; /* the header */
  while (uid == HTTP_UID_UNKNOWN && fgets(line, sizeof line, f)) {
    /* "  sl  local_address rem_address st tx:rx tr:when retr uid ..."; an
     * address is the in-memory words of the address as native hex. */
    char *p = strchr(line, ':');
    if (p == NULL) continue;
    p++;
    while (*p == ' ') p++;
    uint32_t got[4] = {0};
    int ok = 1;
    for (int w = 0; w < (v6 ? 4 : 1) && ok; w++) {
      char hex[9];
      memcpy(hex, p + 8 * w, 8);
      hex[8] = '\0';
      char *end;
      got[w] = (uint32_t)strtoul(hex, &end, 16);
      ok = *end == '\0';
    }
    p += v6 ? 32 : 8;
    unsigned lport, st;
    unsigned long u;
    if (!ok || *p != ':' || memcmp(got, want, sizeof got) != 0 ||
        sscanf(p + 1, "%x %*x:%*x %x %*x:%*x %*x:%*x %*x %lu", &lport, &st,
               &u) != 3 || lport != port)
      continue;
    uid = (uid_t)u;
  }
  fclose(f);
  return uid;
}

unsigned *gmb__http_uid_count(struct gmb_http_uids *t, uid_t uid, int make) {
  for (size_t i = 0; i < GMB_HTTP_UIDS; i++)
    if (t->u[i].n && t->u[i].uid == uid) return &t->u[i].n;
  if (!make) return NULL;
  for (size_t i = 0; i < GMB_HTTP_UIDS; i++)
    if (t->u[i].n == 0) {
      t->u[i].uid = uid;
      return &t->u[i].n;
    }
  return NULL;
}

void gmb__http_conn_add(struct gmb_http_conns *l, struct gmb_http_conn *c,
                        int fd, uid_t uid) {
  *c = (struct gmb_http_conn){
      .fd = fd, .uid = uid,
      .end_ns = gmb__now_ns() + (uint64_t)l->timeout_s * GMB_NS_PER_S};
  c->next = l->head;
  if (c->next) c->next->prev = &c->next;
  c->prev = &l->head;
  l->head = c;
}

void gmb__http_conn_remove(struct gmb_http_conn *c) {
  *c->prev = c->next;
  if (c->next) c->next->prev = c->prev;
}

/* Nanoseconds until the next deadline of a connection not yet shut down
 * (0: one has passed; UINT64_MAX: none); with `cut`, shuts down each
 * connection past its deadline first. */
static uint64_t http_deadline(struct gmb_http_conns *l, uint64_t now,
                              int cut) {
  uint64_t next = UINT64_MAX;
  for (struct gmb_http_conn *c = l->head; c; c = c->next) {
    if (c->cut) continue;
    if (now < c->end_ns || !cut) {
      uint64_t left = now < c->end_ns ? c->end_ns - now : 0;
      if (left < next) next = left;
      continue;
    }
    log_debug("%s: a connection of uid %ld closed %u s after it was "
              "accepted", l->what,
              c->uid == HTTP_UID_UNKNOWN ? -1L : (long)c->uid, l->timeout_s);
    shutdown(c->fd, SHUT_RDWR);
    c->cut = 1;
  }
  return next;
}

void gmb__http_run(struct MHD_Daemon *d, struct gmb_http_conns *l) {
  http_deadline(l, gmb__now_ns(), 1);
  MHD_run(d);
}

long gmb__http_timeout_ms(struct MHD_Daemon *d, struct gmb_http_conns *l) {
  MHD_UNSIGNED_LONG_LONG ms;
  uint64_t cut = http_deadline(l, gmb__now_ns(), 0);
  if (MHD_get_timeout(d, &ms) != MHD_YES) ms = UINT64_MAX;
  if (cut != UINT64_MAX && (cut + GMB_NS_PER_MS - 1) / GMB_NS_PER_MS < ms)
    ms = (cut + GMB_NS_PER_MS - 1) / GMB_NS_PER_MS;
  if (ms == UINT64_MAX) return -1;
  return ms > 1000 ? 1000 : (long)ms;
}

static unsigned http_uid_cap(uid_t uid) {
  return uid == HTTP_UID_UNKNOWN ? 2 * HTTP_PER_UID : HTTP_PER_UID;
}

/* The accept policy: refuses a uid at its cap. */
static enum MHD_Result http_accept_ok(void *cls, const struct sockaddr *a,
                                      socklen_t len) {
  struct gmb_http *h = cls;
  (void)len;
  uid_t uid = http_peer_uid(a);
  unsigned *n = gmb__http_uid_count(&h->uids, uid, 0);
  if (n && *n >= http_uid_cap(uid)) {
    h->refused++;
    return MHD_NO;
  }
  return MHD_YES;
}

/* Counts a connection in (its uid's row, its deadline) and out; its
 * gmb_http_conn is its context.  One that cannot be counted is shut down
 * at once: libmicrohttpd reads its end and closes it, so nothing open
 * escapes the caps or the deadline. */
static void http_notify(void *cls, struct MHD_Connection *conn, void **ctx,
                        enum MHD_ConnectionNotificationCode code) {
  struct gmb_http *h = cls;
  if (code == MHD_CONNECTION_NOTIFY_STARTED) {
    const union MHD_ConnectionInfo *ca =
        MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CLIENT_ADDRESS);
    const union MHD_ConnectionInfo *cf =
        MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CONNECTION_FD);
    uid_t uid = ca ? http_peer_uid(ca->client_addr) : HTTP_UID_UNKNOWN;
    struct gmb_http_conn *c = NULL;
    unsigned *n = NULL;
    *ctx = NULL;
    if (cf == NULL) return; /* never: libmicrohttpd knows its socket */
    /* A row made here and left at 0 is a free row again. */
    if ((n = gmb__http_uid_count(&h->uids, uid, 1)) == NULL ||
        (c = malloc(sizeof *c)) == NULL) {
      shutdown(cf->connect_fd, SHUT_RDWR);
      return;
    }
    (*n)++;
    gmb__http_conn_add(&h->conns, c, cf->connect_fd, uid);
    *ctx = c;
  } else if (code == MHD_CONNECTION_NOTIFY_CLOSED && *ctx) {
    struct gmb_http_conn *c = *ctx;
    unsigned *n = gmb__http_uid_count(&h->uids, c->uid, 0);
    GMB_ASSERT(n && *n && "a connection counted in its uid's row");
    (*n)--;
    gmb__http_conn_remove(c);
    free(c);
    *ctx = NULL;
  }
}

/* The server thread: libmicrohttpd's epoll descriptor, its timeouts and
 * the connections' deadlines, until gmb__http_stop writes `stop_fd`. */
static void *http_serve(void *arg) {
  struct gmb_http *h = arg;
  struct pollfd p[2] = {
      {.fd = MHD_get_daemon_info(h->d, MHD_DAEMON_INFO_EPOLL_FD)->epoll_fd,
       .events = POLLIN},
      {.fd = h->stop_fd, .events = POLLIN}};
  for (;;) {
    p[1].revents = 0;
    (void)poll(p, 2, (int)gmb__http_timeout_ms(h->d, &h->conns));
    if (p[1].revents) return NULL;
    gmb__http_run(h->d, &h->conns);
  }
}

int gmb__http_listen_parse(const char *listen, char *host, size_t hostcap,
                           uint16_t *port, char *err, size_t errcap) {
  const char *colon, *h = listen;
  size_t hlen;
  if (listen[0] == '[') {
    const char *close = strchr(listen, ']');
    if (close == NULL || close[1] != ':') {
      snprintf(err, errcap, "metrics_listen '%s': expected [IPV6]:PORT",
               listen);
      return GMB_E_INVAL;
    }
    h = listen + 1;
    hlen = (size_t)(close - h);
    colon = close + 1;
  } else {
    colon = strrchr(listen, ':');
    if (colon == NULL || memchr(listen, ':', (size_t)(colon - listen))) {
      snprintf(err, errcap, "metrics_listen '%s': expected HOST:PORT "
               "(an IPv6 address goes in brackets)", listen);
      return GMB_E_INVAL;
    }
    hlen = (size_t)(colon - listen);
  }
  if (hlen == 0 || hlen >= hostcap) {
    snprintf(err, errcap, "metrics_listen '%s': %s host", listen,
             hlen ? "too long a" : "no");
    return GMB_E_INVAL;
  }
  char *end;
  errno = 0;
  unsigned long p = strtoul(colon + 1, &end, 10);
  if (colon[1] < '0' || colon[1] > '9' || *end || errno || p > 65535) {
    snprintf(err, errcap, "metrics_listen '%s': bad port", listen);
    return GMB_E_INVAL;
  }
  memcpy(host, h, hlen);
  host[hlen] = '\0';
  *port = (uint16_t)p;
  return 0;
}

/* The socket, bound and listening; -1 with the reason in err. */
static int http_bind(const char *addr, int *family, char *err,
                     size_t errcap) {
  char host[256], ports[8];
  uint16_t port;
  if (gmb__http_listen_parse(addr, host, sizeof host, &port, err, errcap))
    return -2;
  snprintf(ports, sizeof ports, "%u", (unsigned)port);
  struct addrinfo hints = {.ai_family = AF_UNSPEC,
                           .ai_socktype = SOCK_STREAM,
                           .ai_flags = AI_PASSIVE | AI_NUMERICSERV},
                  *res = NULL;
  int rc = getaddrinfo(host, ports, &hints, &res);
  if (rc != 0) {
    snprintf(err, errcap, "metrics_listen '%s': %s", addr,
             gai_strerror(rc));
    return -2;
  }
  int fd = -1, saved = 0;
  for (struct addrinfo *ai = res; ai && fd < 0; ai = ai->ai_next) {
    fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC,
                ai->ai_protocol);
    if (fd < 0) {
      saved = errno;
      continue;
    }
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (ai->ai_family == AF_INET6) /* [::] means IPv6 only: say what you mean */
      setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &one, sizeof one);
    if (bind(fd, ai->ai_addr, ai->ai_addrlen) != 0 || listen(fd, 64) != 0) {
      saved = errno;
      close(fd);
      fd = -1;
      continue;
    }
    *family = ai->ai_family;
  }
  freeaddrinfo(res);
  if (fd < 0)
    snprintf(err, errcap, "metrics_listen '%s': %s", addr,
             strerror(saved ? saved : EADDRNOTAVAIL));
  return fd;
}

enum MHD_Result gmb__http_reply(struct MHD_Connection *conn, unsigned int code,
                                const char *body, size_t len,
                                enum MHD_ResponseMemoryMode mode,
                                const char *type, const char *allow) {
  struct MHD_Response *r =
      MHD_create_response_from_buffer(len, (void *)body, mode);
  if (r == NULL) return MHD_NO;
  MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, type);
  if (allow) MHD_add_response_header(r, MHD_HTTP_HEADER_ALLOW, allow);
  enum MHD_Result ok = MHD_queue_response(conn, code, r);
  MHD_destroy_response(r);
  return ok;
}

static enum MHD_Result http_reply(struct MHD_Connection *conn,
                                  unsigned int code, const char *body,
                                  size_t len, enum MHD_ResponseMemoryMode mode,
                                  const char *allow) {
  return gmb__http_reply(conn, code, body, len, mode,
                         code == MHD_HTTP_OK ? HTTP_CONTENT_TYPE
                                             : "text/plain; charset=utf-8",
                         allow);
}

#define HTTP_STATIC(conn, code, text, allow)                            \
  http_reply(conn, code, text, sizeof text - 1, MHD_RESPMEM_PERSISTENT, \
             allow)

/* Runs on the server thread. */
static enum MHD_Result http_handle(void *cls, struct MHD_Connection *conn,
                                   const char *url, const char *method,
                                   const char *version,
                                   const char *upload_data,
                                   size_t *upload_data_size, void **con_cls) {
  struct gmb_http *h = cls;
  (void)version;
  (void)upload_data;
  (void)upload_data_size;
  (void)con_cls;
  if (strcmp(url, "/metrics") != 0)
    return HTTP_STATIC(conn, MHD_HTTP_NOT_FOUND,
                       "not found: the metrics are at /metrics\n", NULL);
  if (strcmp(method, MHD_HTTP_METHOD_GET) != 0 &&
      strcmp(method, MHD_HTTP_METHOD_HEAD) != 0)
    return HTTP_STATIC(conn, MHD_HTTP_METHOD_NOT_ALLOWED,
                       "method not allowed: use GET\n", "GET, HEAD");
  enum MHD_Result ok;
  pthread_mutex_lock(&h->mu);
  if (h->text == NULL)
    ok = HTTP_STATIC(conn, MHD_HTTP_SERVICE_UNAVAILABLE,
                     "no metrics yet: the broker is starting\n", NULL);
  else
    ok = http_reply(conn, MHD_HTTP_OK, h->text, h->len, MHD_RESPMEM_MUST_COPY,
                    NULL);
  pthread_mutex_unlock(&h->mu);
  return ok;
}

int gmb__http_start(const char *listen, struct gmb_http **out, char *err,
                    size_t cap) {
  *out = NULL;
  int family = AF_INET;
  int fd = http_bind(listen, &family, err, cap);
  if (fd < 0) return fd == -2 ? GMB_E_INVAL : GMB_E_SYSTEM;
  struct gmb_http *h = calloc(1, sizeof *h);
  if (h == NULL) {
    close(fd);
    snprintf(err, cap, "out of host memory");
    return GMB_E_SYSTEM;
  }
  pthread_mutex_init(&h->mu, NULL);
  h->conns = (struct gmb_http_conns){.what = "metrics_listen",
                                     .timeout_s = HTTP_TIMEOUT_S};
  h->stop_fd = -1;
  struct sockaddr_storage ss;
  socklen_t sl = sizeof ss;
  if (getsockname(fd, (struct sockaddr *)&ss, &sl) == 0)
    h->port = ntohs(ss.ss_family == AF_INET6
                        ? ((struct sockaddr_in6 *)&ss)->sin6_port
                        : ((struct sockaddr_in *)&ss)->sin_port);
  h->d = MHD_start_daemon(
      MHD_USE_EPOLL | (family == AF_INET6 ? MHD_USE_IPv6 : 0), 0,
      http_accept_ok, h, http_handle, h, MHD_OPTION_LISTEN_SOCKET, fd,
      MHD_OPTION_CONNECTION_LIMIT, (unsigned int)HTTP_CONNECTIONS,
      MHD_OPTION_CONNECTION_TIMEOUT, (unsigned int)HTTP_TIMEOUT_S,
      MHD_OPTION_NOTIFY_CONNECTION, http_notify, h, MHD_OPTION_END);
  const char *why = NULL;
  int saved = errno;
  if (h->d == NULL)
    close(fd);
  else if (MHD_get_daemon_info(h->d, MHD_DAEMON_INFO_EPOLL_FD) == NULL)
    why = "no epoll descriptor";
  else if ((h->stop_fd = eventfd(0, EFD_CLOEXEC)) < 0)
    saved = errno;
  if (h->d && !why && h->stop_fd >= 0) {
    /* The thread inherits this mask. */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    saved = pthread_create(&h->thread, NULL, http_serve, h);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (saved == 0) {
      *out = h;
      return 0;
    }
  }
  snprintf(err, cap, "metrics_listen '%s': the HTTP server did not start "
           "(%s)", listen, why ? why : strerror(saved));
  if (h->d) MHD_stop_daemon(h->d); /* closes the socket */
  if (h->stop_fd >= 0) close(h->stop_fd);
  pthread_mutex_destroy(&h->mu);
  free(h);
  return GMB_E_SYSTEM;
}

uint16_t gmb__http_port(const struct gmb_http *h) { return h->port; }

void gmb__http_publish(struct gmb_http *h, const char *text) {
  size_t len = strlen(text);
  char *copy = malloc(len + 1);
  if (copy == NULL) return; /* the last text stays: stale beats none */
  memcpy(copy, text, len + 1);
  pthread_mutex_lock(&h->mu);
  char *old = h->text;
  h->text = copy;
  h->len = len;
  pthread_mutex_unlock(&h->mu);
  free(old);
}

void gmb__http_stop(struct gmb_http *h) {
  if (h == NULL) return;
  uint64_t one = 1;
  if (write(h->stop_fd, &one, sizeof one) != sizeof one)
    GMB_ASSERT(!"an eventfd takes a write");
  pthread_join(h->thread, NULL);
  MHD_stop_daemon(h->d); /* closes the socket and the connections */
  close(h->stop_fd);
  pthread_mutex_destroy(&h->mu);
  free(h->text);
  free(h);
}
