/*
 * fuzz_http_admin.c - libFuzzer target: the bytes of one connection to
 * the operators' HTTP socket (admin-http.sock), read by libmicrohttpd and
 * answered by broker/http_admin.c in front of a whole broker in this
 * process, over a real Unix socket (abstract, named per input) that the
 * target accepts and runs the server on as the loop does (loop.c:
 * gmb__http_admin_accept, then gmb__http_admin_run each round).  The
 * peer is this process, the broker's own uid: an operator, so every
 * request reaches the query's parser and the admin socket's handler
 * (a uid that is no operator is refused before either: test_admin_http).
 *
 * An input: byte 0 is the size of the pieces the rest is written in, one
 * piece a round with the server run between two (0: as much as the
 * socket takes), so requests arrive split anywhere; the rest is the
 * connection's bytes, after which the writer shuts its side down.
 *
 * The broker (a fresh one per input) has tenants llm and batch, and one
 * session of llm that reported tag "weights" paused, so /is_sleeping has
 * a row to list and /sleep and /wake_up a session to tell.
 *
 * Invariants: the server closes the connection within FZ_ROUNDS rounds
 * more than the input has bytes (nothing holds it: a hang is a crash
 * here); whatever
 * comes back is at most FZ_RESPONSE_MAX bytes and, if anything, one HTTP
 * response whose JSON body (ours) parses, with "error" and "code" exactly
 * when the status is not 200; a session is told something (a sleep or
 * wake event) only by a 200; the broker's consistency check holds; and
 * the server's stop frees every connection (ASan's leak check).
 */
#include <errno.h>
#include <jansson.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "broker.h"
#include "dispatch.h"
#include "fuzz.h"
#include "fuzz_broker.h"
#include "gmb.h"
#include "http_admin.h"
#include "wire.h"

#define FZ_ROUNDS 1000 /* rounds of the server beyond one per byte */
#define FZ_RESPONSE_MAX (64 * 1024)

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t len);

static char fz_ini[128];
static uint64_t fz_events; /* sleep and wake events sent to sessions */

static const char fz_config[] =
    "[broker]\n"
    "max_sessions = 4\n"
    "[tenant:llm]\n"
    "quota = 8MiB\n"
    "[tenant:batch]\n"
    "quota = 4MiB\n";

static void fz_tap(void *ctx, enum gmb_socket sock, const uint8_t *rid,
                   size_t rid_len, const struct wire_reply *rep) {
  (void)ctx;
  (void)rid;
  (void)rid_len;
  if (sock == GMB_SOCK_CLIENT && rep->kind == WIRE_EVENT) fz_events++;
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc;
  (void)argv;
  fz_broker_ini(fz_config, fz_ini, sizeof fz_ini);
  return 0;
}

/* One request of client "a" (this process's uid), answered at once. */
static void fz_client(struct gmb_broker *b, struct wire_request *req) {
  static uint64_t id;
  struct gmb_peer peer = {.rid = (const uint8_t *)"a", .rid_len = 1,
                          .uid = geteuid(), .gid = getegid(), .pid = 0};
  struct wire_reply rep;
  memset(&rep, 0, sizeof rep);
  req->id = ++id;
  FZ_ASSERT(gmb__dispatch(b, &peer, req, &rep) == 1);
  FZ_ASSERT(rep.status == 0);
  gmb__wire_reply_clear(&rep);
}

/* A listening socket at a fresh abstract address. */
static int fz_listen(struct sockaddr_un *sa, socklen_t *sl) {
  static unsigned seq;
  memset(sa, 0, sizeof *sa);
  sa->sun_family = AF_UNIX;
  int n = snprintf(sa->sun_path + 1, sizeof sa->sun_path - 1,
                   "gmb-fuzz-http-%ld-%u", (long)getpid(), seq++);
  *sl = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + (size_t)n);
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  FZ_ASSERT(fd >= 0);
  FZ_ASSERT(bind(fd, (struct sockaddr *)sa, *sl) == 0);
  FZ_ASSERT(listen(fd, 4) == 0);
  return fd;
}

/* What came back: nothing, or one response of ours or libmicrohttpd's. */
static void fz_response(const char *r, size_t got, uint64_t events) {
  if (got == 0) {
    FZ_ASSERT(events == 0);
    return;
  }
  FZ_ASSERT(got >= 12 && memcmp(r, "HTTP/1.1 ", 9) == 0);
  int code = atoi(r + 9);
  FZ_ASSERT(code >= 100 && code <= 599);
  FZ_ASSERT(events == 0 || code == 200);
  const char *end = memmem(r, got, "\r\n\r\n", 4);
  FZ_ASSERT(end != NULL);
  size_t head = (size_t)(end - r) + 4;
  char h[4096];
  snprintf(h, sizeof h, "%.*s", (int)(head < sizeof h ? head : sizeof h - 1),
           r);
  if (strstr(h, "\r\nContent-Type: application/json\r\n") == NULL) {
    FZ_ASSERT(events == 0); /* libmicrohttpd's own answer: nothing done */
    return;
  }
  const char *cl = strstr(h, "\r\nContent-Length: ");
  FZ_ASSERT(cl != NULL);
  size_t len = (size_t)strtoul(cl + 18, NULL, 10), body = got - head;
  FZ_ASSERT(body == len || body == 0); /* 0: an answer to HEAD */
  if (body == 0) return;
  json_error_t e;
  json_t *j = json_loadb(r + head, body, 0, &e);
  FZ_ASSERT(j != NULL && json_is_object(j));
  int failed = json_is_string(json_object_get(j, "error")) &&
               json_is_string(json_object_get(j, "code"));
  FZ_ASSERT(failed == (code != 200));
  json_decref(j);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t len) {
  struct gmb_broker *b = fz_broker_open(fz_ini, fz_tap);
  char err[1024];

  struct wire_request req;
  memset(&req, 0, sizeof req);
  req.kind = WIRE_HELLO;
  req.u.hello.version = WIRE_PROTOCOL_VERSION;
  snprintf(req.u.hello.tenant, sizeof req.u.hello.tenant, "llm");
  snprintf(req.u.hello.client, sizeof req.u.hello.client, "fuzz");
  fz_client(b, &req);
  memset(&req, 0, sizeof req);
  req.kind = WIRE_SLEEP_NOTE;
  snprintf(req.u.sleep_note.tag, sizeof req.u.sleep_note.tag, "weights");
  req.u.sleep_note.paused = 1;
  req.u.sleep_note.host_bytes = 1 << 20;
  req.u.sleep_note.by = WIRE_BY_OPERATOR;
  fz_client(b, &req);

  struct sockaddr_un sa;
  socklen_t sl;
  struct gmb_http_admin *h;
  FZ_ASSERT(gmb__http_admin_start(b, fz_listen(&sa, &sl), &h, err,
                                  sizeof err) == 0);
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  FZ_ASSERT(fd >= 0 && connect(fd, (struct sockaddr *)&sa, sl) == 0);
  gmb__http_admin_accept(h);

  size_t piece = len ? data[0] : 0, at = len ? 1 : 0, got = 0;
  static char r[FZ_RESPONSE_MAX];
  uint64_t events = fz_events;
  int ended = 0, shut = 0;
  /* A round writes a piece or finds the socket full: len + FZ_ROUNDS
   * rounds are enough unless the server neither reads nor closes. */
  for (size_t round = 0; !ended && round < len + FZ_ROUNDS; round++) {
    if (at < len) {
      size_t n = piece && piece < len - at ? piece : len - at;
      ssize_t w = send(fd, data + at, n, MSG_DONTWAIT | MSG_NOSIGNAL);
      if (w > 0)
        at += (size_t)w;
      else if (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK)
        at = len; /* the server closed: the rest is not for it */
    } else if (!shut) {
      FZ_ASSERT(shutdown(fd, SHUT_WR) == 0 || errno == ENOTCONN);
      shut = 1;
    }
    gmb__http_admin_run(h);
    for (;;) {
      char buf[4096];
      ssize_t n = recv(fd, buf, sizeof buf, MSG_DONTWAIT);
      if (n > 0) {
        FZ_ASSERT(got + (size_t)n < sizeof r);
        memcpy(r + got, buf, (size_t)n);
        got += (size_t)n;
        continue;
      }
      ended = n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK);
      break;
    }
  }
  if (!ended) {
    /* libmicrohttpd stops reading a request whose line it cannot grow its
     * buffer for (a header line of a few KiB, cut short), so it never
     * sees the end: the connection waits for its deadline (HA_TIMEOUT_S,
     * too long to wait for here).  It must wait, not spin: the server
     * asks the loop to come back later, not at once. */
    long ms = gmb__http_admin_timeout_ms(h);
    FZ_ASSERT(ms > 0);
  }
  close(fd);
  fz_response(r, got, fz_events - events);
  FZ_ASSERT(gmb__core_check(b) == 0);

  gmb__http_admin_stop(h);
  fz_broker_close(b);
  return 0;
}
