/*
 * admin_rpc.h - a client of the broker's admin socket, for the tools that
 * speak the admin protocol (gmbctl, gmb-replay).
 *
 * One handle is one ZeroMQ context and one DEALER connected to an admin
 * endpoint, with one request in flight at a time.  Every function returns
 * 0 or a negative GMB_E_* code with a one-line reason in `why` (no prefix,
 * no newline); it prints nothing and exits nothing, so each tool says the
 * reason in its own voice.  ADMIN_RPC_WHY_MAX bytes hold any reason.
 *
 * A ZeroMQ context must not cross fork(): open the handle in the process
 * that uses it, after any fork.
 */
#ifndef GMB_ADMIN_RPC_H
#define GMB_ADMIN_RPC_H

#include <signal.h>
#include <stddef.h>
#include <stdint.h>

#include "wire.h"

#define ADMIN_RPC_WHY_MAX 1024

struct admin_rpc;

/*
 * Connects to `endpoint` ("ipc://RUN_DIR/admin.sock").  An ipc:// socket
 * file this uid may not write, or one nobody listens on, fails at once
 * (GMB_E_CONN) instead of leaving ZeroMQ to retry for ever; `hint`, when not
 * NULL, goes into the latter reason ("is gmb-broker running? ...").
 * `timeout_ms` bounds each send and is the default wait for a reply.
 * Returns 0 with *out set (the caller closes it with gmb__admin_rpc_close),
 * GMB_E_CONN, or GMB_E_SYSTEM when ZeroMQ or memory fails.
 */
int gmb__admin_rpc_open(const char *endpoint, int timeout_ms, const char *hint,
                        struct admin_rpc **out, char *why, size_t cap);

/* A wait for a reply gives up as soon as *flag is nonzero (a flag that a
 * signal handler sets); NULL, the default: only the timeout ends it. */
void gmb__admin_rpc_set_stop(struct admin_rpc *rpc,
                             const volatile sig_atomic_t *flag);

/*
 * Sends `req` (its id is set here) and waits up to `timeout_ms` (0: the
 * handle's default) for the reply with the same id; replies to other ids
 * are dropped.  Returns 0 with *rep filled and of kind `expect` (the caller
 * clears it with gmb__wire_reply_clear).  Else *rep needs no clearing and
 * the code is the broker's own when it refused ("GMB_E_NOENT: no tenant
 * x"), GMB_E_PROTO for a reply that does not decode or is of another kind,
 * GMB_E_CONN when the send fails, GMB_E_INVAL when the request does not
 * encode, GMB_E_TIMEOUT when no reply came in time or the stop flag was
 * set.
 */
int gmb__admin_rpc_call(struct admin_rpc *rpc, struct wire_request *req,
                        enum wire_kind expect, int timeout_ms,
                        struct wire_reply *rep, char *why, size_t cap);

/*
 * Tenants made and removed at run time, for the node components of
 * schedulers (the Slurm SPANK plugin, the Kubernetes device plugin) and
 * gmbctl.  gmb__admin_tenant_add creates `spec->tenant` with its quota,
 * reservation, token hash, uids and, when `spec->has_host_quota`, its
 * host_quota (else the broker's default_host_quota, followed at reloads);
 * 0 with *row (may be NULL) filled, or
 * the broker's refusal (GMB_E_INVAL: it exists, bad name, proves no one,
 * above the device; GMB_E_NOMEM: the reservations would pass the device;
 * GMB_E_LIMIT: too many tenants; GMB_E_AUTH: not an admin uid).
 * gmb__admin_tenant_remove removes `tenant`: at once when no session holds
 * it, else when its last session ended (it admits no new one), or after
 * ending them when `evict`.  0 with *out (may be NULL) filled.
 */
int gmb__admin_tenant_add(struct admin_rpc *rpc,
                          const struct wire_tenant_add *spec,
                          struct wire_tenant_row *row, char *why, size_t cap);
struct admin_tenant_removal {
  int removed;           /* gone now; else when `sessions` end */
  uint32_t sessions;     /* still open */
  uint32_t evicted;      /* sessions ended by `evict` */
  uint64_t bytes_freed;  /* by `evict` */
};
int gmb__admin_tenant_remove(struct admin_rpc *rpc, const char *tenant,
                             int evict, struct admin_tenant_removal *out,
                             char *why, size_t cap);

/* A fresh token: ADMIN_TOKEN_BYTES random bytes from the kernel written as
 * lowercase hex (2 * ADMIN_TOKEN_BYTES characters and a NUL in `hex`).
 * 0, or GMB_E_SYSTEM when the kernel gives no randomness. */
#define ADMIN_TOKEN_BYTES 32
int gmb__admin_token_new(char hex[2 * ADMIN_TOKEN_BYTES + 1]);
/* The SHA-256 of a token's bytes, as the broker compares it.  0, or
 * GMB_E_SYSTEM. */
int gmb__admin_token_sha256(const char *token, size_t len, uint8_t out[32]);

/* Closes the socket and the context; accepts NULL. */
void gmb__admin_rpc_close(struct admin_rpc *rpc);

#endif /* GMB_ADMIN_RPC_H */
