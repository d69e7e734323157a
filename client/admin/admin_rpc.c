/*
 * admin_rpc.c - owns the tools' side of the admin socket: the ZeroMQ
 * context, the DEALER connected to the broker's admin endpoint, the request
 * ids, and the wait for a reply under a deadline.  gmbctl and gmb-replay
 * both talk to the broker through it; neither touches ZeroMQ itself.
 *
 * Invariants: a handle has one request in flight at a time, so the reply
 * that matters is the one whose id is the last one sent; anything else on
 * the socket (an event, a reply that came after its caller gave up) is
 * dropped.  Linger is 0, so closing never waits for a broker that is gone.
 * Nothing here prints: every failure is a GMB_E_* code and a reason.
 */
#include "admin_rpc.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <openssl/evp.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zmq.h>

#include "endpoint.h"
#include "gmb.h"
#include "util.h"

struct admin_rpc {
  void *zctx, *sock;
  char endpoint[300];
  int timeout_ms;
  uint64_t next_id;
  const volatile sig_atomic_t *stop;
};

static int admin_rpc_fail(int code, char *why, size_t cap, const char *fmt,
                          ...) __attribute__((format(printf, 4, 5)));

static int admin_rpc_fail(int code, char *why, size_t cap, const char *fmt,
                          ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(why, cap, fmt, ap);
  va_end(ap);
  return code;
}

/* The admin socket is 0600: say so, rather than time out while ZeroMQ
 * retries a connect that can never succeed.  Then the probe turns a missing
 * or stale socket file into a reason too. */
static int admin_rpc_check(const char *endpoint, const char *hint, char *why,
                           size_t cap) {
  if (strncmp(endpoint, "ipc://", 6) != 0) return 0;
  const char *path = endpoint + 6;
  struct stat st;
  int denied = stat(path, &st) == 0
                   ? faccessat(AT_FDCWD, path, W_OK, AT_EACCESS) != 0
                   : errno == EACCES;
  if (denied)
    return admin_rpc_fail(GMB_E_CONN, why, cap,
                          "cannot open %s: %s (the admin socket is for the "
                          "broker's uid and admin_uids)",
                          endpoint, strerror(errno));
  return gmb__endpoint_probe(endpoint, hint, why, cap);
}

int gmb__admin_rpc_open(const char *endpoint, int timeout_ms, const char *hint,
                        struct admin_rpc **out, char *why, size_t cap) {
  *out = NULL;
  struct admin_rpc *rpc = calloc(1, sizeof *rpc);
  if (rpc == NULL)
    return admin_rpc_fail(GMB_E_SYSTEM, why, cap, "out of memory");
  if (strlen(endpoint) >= sizeof rpc->endpoint) {
    free(rpc);
    return admin_rpc_fail(GMB_E_CONN, why, cap, "endpoint too long: %.80s...",
                          endpoint);
  }
  snprintf(rpc->endpoint, sizeof rpc->endpoint, "%s", endpoint);
  rpc->timeout_ms = timeout_ms;
  int rc = admin_rpc_check(endpoint, hint, why, cap);
  if (rc) {
    free(rpc);
    return rc;
  }
  int zero = 0;
  rpc->zctx = zmq_ctx_new();
  rpc->sock = rpc->zctx ? zmq_socket(rpc->zctx, ZMQ_DEALER) : NULL;
  if (rpc->sock == NULL) {
    rc = admin_rpc_fail(GMB_E_SYSTEM, why, cap, "zmq: %s", zmq_strerror(errno));
  } else {
    zmq_setsockopt(rpc->sock, ZMQ_LINGER, &zero, sizeof zero);
    zmq_setsockopt(rpc->sock, ZMQ_SNDTIMEO, &timeout_ms, sizeof timeout_ms);
    if (zmq_connect(rpc->sock, endpoint) != 0)
      rc = admin_rpc_fail(GMB_E_CONN, why, cap, "cannot connect to %s: %s",
                          endpoint, zmq_strerror(errno));
  }
  if (rc) {
    gmb__admin_rpc_close(rpc);
    return rc;
  }
  *out = rpc;
  return 0;
}

void gmb__admin_rpc_set_stop(struct admin_rpc *rpc,
                             const volatile sig_atomic_t *flag) {
  rpc->stop = flag;
}

/* What came back for our id: 0 when it is the answer we wanted; else the
 * reply is cleared and the reason written. */
static int admin_rpc_judge(enum wire_kind expect, struct wire_reply *rep,
                           char *why, size_t cap) {
  int rc = 0;
  if (rep->status != 0)
    rc = admin_rpc_fail(rep->status < 0 ? rep->status : GMB_E_PROTO, why, cap,
                        "%s: %s", gmb_err_name(rep->status),
                        rep->message[0] ? rep->message
                                        : gmb_strerror(rep->status));
  else if (rep->kind != expect)
    rc = admin_rpc_fail(GMB_E_PROTO, why, cap,
                        "the broker answered with a %s reply",
                        gmb__wire_kind_name(rep->kind));
  if (rc) gmb__wire_reply_clear(rep);
  return rc;
}

int gmb__admin_rpc_call(struct admin_rpc *rpc, struct wire_request *req,
                        enum wire_kind expect, int timeout_ms,
                        struct wire_reply *rep, char *why, size_t cap) {
  uint8_t *buf;
  size_t len;
  req->id = ++rpc->next_id;
  if (gmb__wire_request_encode(req, &buf, &len) != 0)
    return admin_rpc_fail(GMB_E_INVAL, why, cap, "cannot encode the request");
  int rc = zmq_send(rpc->sock, buf, len, 0);
  free(buf);
  if (rc < 0)
    return admin_rpc_fail(GMB_E_CONN, why, cap,
                          "could not reach the broker at %s", rpc->endpoint);
  if (timeout_ms <= 0) timeout_ms = rpc->timeout_ms;
  uint64_t deadline = gmb__now_ns() + (uint64_t)timeout_ms * GMB_NS_PER_MS;
  for (;;) {
    if (rpc->stop && *rpc->stop)
      return admin_rpc_fail(GMB_E_TIMEOUT, why, cap,
                            "interrupted before the broker at %s answered",
                            rpc->endpoint);
    uint64_t now = gmb__now_ns();
    if (now >= deadline) break;
    zmq_pollitem_t it = {rpc->sock, 0, ZMQ_POLLIN, 0};
    /* EINTR and a poll that ends empty both come back here, to look at
     * the stop flag and the clock again. */
    if (zmq_poll(&it, 1, (long)((deadline - now) / GMB_NS_PER_MS) + 1) <= 0)
      continue;
    zmq_msg_t m;
    zmq_msg_init(&m);
    if (zmq_msg_recv(&m, rpc->sock, 0) < 0) {
      zmq_msg_close(&m);
      continue;
    }
    rc = gmb__wire_reply_decode(zmq_msg_data(&m), zmq_msg_size(&m), rep);
    zmq_msg_close(&m);
    if (rc)
      return admin_rpc_fail(GMB_E_PROTO, why, cap,
                            "the broker's reply could not be decoded");
    if (rep->id != req->id) { /* an event or a stale reply */
      gmb__wire_reply_clear(rep);
      continue;
    }
    return admin_rpc_judge(expect, rep, why, cap);
  }
  return admin_rpc_fail(GMB_E_TIMEOUT, why, cap,
                        "the broker at %s did not answer within %d ms",
                        rpc->endpoint, timeout_ms);
}

int gmb__admin_tenant_add(struct admin_rpc *rpc,
                          const struct wire_tenant_add *spec,
                          struct wire_tenant_row *row, char *why, size_t cap) {
  struct wire_request req = {.kind = WIRE_ADMIN_TENANT_ADD};
  req.u.admin_tenant_add = *spec;
  struct wire_reply rep;
  int rc = gmb__admin_rpc_call(rpc, &req, WIRE_TENANT_ROW, 0, &rep, why, cap);
  if (rc) return rc;
  if (row) *row = rep.u.tenant_row;
  gmb__wire_reply_clear(&rep);
  return 0;
}

int gmb__admin_tenant_remove(struct admin_rpc *rpc, const char *tenant,
                             int evict, struct admin_tenant_removal *out,
                             char *why, size_t cap) {
  struct wire_request req = {.kind = WIRE_ADMIN_TENANT_REMOVE};
  if (strlen(tenant) >= sizeof req.u.admin_tenant_remove.tenant)
    return admin_rpc_fail(GMB_E_INVAL, why, cap, "tenant name too long");
  snprintf(req.u.admin_tenant_remove.tenant,
           sizeof req.u.admin_tenant_remove.tenant, "%s", tenant);
  req.u.admin_tenant_remove.evict = evict != 0;
  struct wire_reply rep;
  int rc = gmb__admin_rpc_call(rpc, &req, WIRE_ADMIN_TENANT_REMOVE, 0, &rep,
                               why, cap);
  if (rc) return rc;
  if (out) {
    out->removed = rep.u.tenant_remove.removed;
    out->sessions = rep.u.tenant_remove.sessions;
    out->evicted = rep.u.tenant_remove.evicted;
    out->bytes_freed = rep.u.tenant_remove.bytes_freed;
  }
  gmb__wire_reply_clear(&rep);
  return 0;
}

int gmb__admin_token_new(char hex[2 * ADMIN_TOKEN_BYTES + 1]) {
  uint8_t raw[ADMIN_TOKEN_BYTES];
  size_t got = 0;
  while (got < sizeof raw) {
    ssize_t n = getrandom(raw + got, sizeof raw - got, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      return GMB_E_SYSTEM;
    }
    got += (size_t)n;
  }
  for (size_t i = 0; i < sizeof raw; i++)
    snprintf(hex + 2 * i, 3, "%02x", raw[i]);
  explicit_bzero(raw, sizeof raw);
  return 0;
}

int gmb__admin_token_sha256(const char *token, size_t len, uint8_t out[32]) {
  unsigned int n = 0;
  if (EVP_Digest(token, len, out, &n, EVP_sha256(), NULL) != 1 || n != 32)
    return GMB_E_SYSTEM;
  return 0;
}

void gmb__admin_rpc_close(struct admin_rpc *rpc) {
  if (rpc == NULL) return;
  if (rpc->sock) zmq_close(rpc->sock);
  if (rpc->zctx) zmq_ctx_term(rpc->zctx);
  free(rpc);
}
