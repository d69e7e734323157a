/*
 * dp_grpc.h - gmb-device-plugin's gRPC layer: the only part of the plugin
 * that speaks gRPC (gRPC's C core, as Debian 12 ships it: libgrpc 1.51).
 * It moves bytes: the messages themselves are protobuf-c's, encoded and
 * decoded by the caller.
 *
 * A server serves the kubelet's DevicePlugin service on a Unix socket; its
 * calls are handed out one at a time by dpg_next(), from one thread (the
 * plugin's loop), and each unary call is answered at once by dpg_reply()
 * or dpg_fail().  ListAndWatch calls become streams (dpg_stream_keep):
 * dpg_broadcast() sends the newest device list to every open stream, and a
 * stream whose peer hung up goes away by itself.  dpg_unary() is a
 * blocking client call, for Register and pod-resources List.
 *
 * Every function returns 0 or -1 with a one-line reason in `why`.
 */
#ifndef GMB_DP_GRPC_H
#define GMB_DP_GRPC_H

#include <stddef.h>
#include <stdint.h>

enum dpg_method {
  DPG_OPTIONS = 0,   /* GetDevicePluginOptions */
  DPG_LIST_AND_WATCH,
  DPG_PREFERRED,     /* GetPreferredAllocation */
  DPG_ALLOCATE,
  DPG_PRESTART,      /* PreStartContainer */
  DPG_NMETHODS,
  DPG_UNKNOWN = DPG_NMETHODS /* any other method: answered UNIMPLEMENTED */
};

/* gRPC status codes the plugin answers with (grpc/status.h). */
#define DPG_INVALID_ARGUMENT 3
#define DPG_RESOURCE_EXHAUSTED 8
#define DPG_FAILED_PRECONDITION 9
#define DPG_UNIMPLEMENTED 12
#define DPG_INTERNAL 13
#define DPG_UNAVAILABLE 14

struct dpg;
struct dpg_call;

int dpg_new(struct dpg **out, char *why, size_t cap);
/* Stops the server and the streams, and gRPC.  Accepts NULL. */
void dpg_destroy(struct dpg *g);

/* Serves the DevicePlugin service on the Unix socket `path`, first
 * stopping a server already running (its streams end).  A stale file at
 * `path` is removed. */
int dpg_serve(struct dpg *g, const char *path, char *why, size_t cap);
/* Stops the server, if any: its calls and streams end. */
void dpg_stop(struct dpg *g);

/* Waits up to timeout_ms for a call.  1 with the call, its method and its
 * request's bytes (valid until the call is answered); 0 when none came. */
int dpg_next(struct dpg *g, int timeout_ms, struct dpg_call **call,
             enum dpg_method *method, const uint8_t **req, size_t *len);

/* Answers a unary call with a message, or with a status and a reason;
 * the call is gone afterwards. */
void dpg_reply(struct dpg_call *c, const uint8_t *buf, size_t len);
void dpg_fail(struct dpg_call *c, int code, const char *msg);

/* Makes a ListAndWatch call a stream that dpg_broadcast() feeds, starting
 * with `buf`. */
void dpg_stream_keep(struct dpg_call *c, const uint8_t *buf, size_t len);
/* Sends `buf` to every open stream (a stream still busy with its last
 * message gets this one as soon as that one is out; older ones that did not
 * go out yet are dropped: only the newest list matters). */
void dpg_broadcast(struct dpg *g, const uint8_t *buf, size_t len);
/* The number of open streams. */
size_t dpg_streams(const struct dpg *g);

/* A unary call of `method` ("/v1beta1.Registration/Register") on the gRPC
 * server at the Unix socket `path`.  0 with the reply's bytes in *resp
 * (malloc'd; the caller frees), -1 with why (the status and its message). */
int dpg_unary(struct dpg *g, const char *path, const char *method,
              const uint8_t *req, size_t len, int timeout_ms, uint8_t **resp,
              size_t *rlen, char *why, size_t cap);

#endif /* GMB_DP_GRPC_H */
