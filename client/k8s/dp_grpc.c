/*
 * dp_grpc.c - owns the plugin's gRPC objects: one completion queue, the
 * server of the moment with a pending request per method (and one for
 * methods it does not know), the calls being answered and the open
 * ListAndWatch streams.
 *
 * Every tag on the queue is a `struct dpg_tag` whose kind says what
 * finished.  Invariants: each method has exactly one request outstanding
 * while its server runs (re-armed as soon as a call arrives); a call is
 * freed only when no batch of it is in flight; a stream has at most one
 * send in flight and keeps only the newest list waiting behind it.  One
 * thread (the plugin's loop) calls everything here.
 */
#include "dp_grpc.h"

#include <errno.h>
#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/support/alloc.h>
#include <grpc/support/time.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static const char *const dpg_paths[DPG_NMETHODS] = {
    "/v1beta1.DevicePlugin/GetDevicePluginOptions",
    "/v1beta1.DevicePlugin/ListAndWatch",
    "/v1beta1.DevicePlugin/GetPreferredAllocation",
    "/v1beta1.DevicePlugin/Allocate",
    "/v1beta1.DevicePlugin/PreStartContainer",
};

enum dpg_tag_kind {
  TAG_SLOT,     /* a requested call arrived (or the request was cancelled) */
  TAG_DONE,     /* a unary call's answer went out */
  TAG_SEND,     /* a stream's message went out */
  TAG_CLOSE,    /* a stream's call is over */
  TAG_SHUTDOWN, /* the server stopped */
};

struct dpg_tag {
  enum dpg_tag_kind kind;
  void *owner;
};

struct dpg_server;

/* The request outstanding for one method (or, DPG_UNKNOWN, for any other). */
struct dpg_slot {
  struct dpg_tag tag;
  struct dpg_server *srv;
  enum dpg_method method;
  grpc_call *call;
  gpr_timespec deadline;
  grpc_call_details details; /* DPG_UNKNOWN only */
  grpc_metadata_array md;
  grpc_byte_buffer *payload;
};

struct dpg_server {
  grpc_server *server;
  void *methods[DPG_NMETHODS];
  struct dpg_slot slots[DPG_NMETHODS + 1];
  int live_slots; /* slots whose request is outstanding */
  int stopping;
  struct dpg_tag shutdown;
};

struct dpg_call {
  struct dpg *g;
  grpc_call *call;
  enum dpg_method method;
  grpc_slice req; /* the request's bytes */
  int has_req;
  /* Streams: */
  struct dpg_tag t_done, t_send, t_close;
  int in_flight;    /* batches not completed */
  int sent_initial; /* initial metadata went with the first message */
  int closed;       /* the call is over (peer gone, or cancelled) */
  int cancelled;    /* RECV_CLOSE_ON_SERVER's answer */
  grpc_byte_buffer *waiting; /* the newest list, behind a send in flight */
  struct dpg_call *next;     /* in g->streams */
};

struct dpg {
  grpc_completion_queue *cq;
  struct dpg_server *srv;
  struct dpg_call *streams;
  size_t n_streams;
};

static int dpg_failf(char *why, size_t cap, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int dpg_failf(char *why, size_t cap, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(why, cap, fmt, ap);
  va_end(ap);
  return -1;
}

static gpr_timespec dpg_in_ms(int ms) {
  return gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC),
                      gpr_time_from_millis(ms, GPR_TIMESPAN));
}

static grpc_byte_buffer *dpg_buffer(const uint8_t *buf, size_t len) {
  grpc_slice s = grpc_slice_from_copied_buffer((const char *)buf, len);
  grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&s, 1);
  grpc_slice_unref(s);
  return bb;
}

static grpc_slice dpg_read(grpc_byte_buffer *bb) {
  grpc_byte_buffer_reader r;
  if (!grpc_byte_buffer_reader_init(&r, bb)) return grpc_empty_slice();
  grpc_slice s = grpc_byte_buffer_reader_readall(&r);
  grpc_byte_buffer_reader_destroy(&r);
  return s;
}

int dpg_new(struct dpg **out, char *why, size_t cap) {
  struct dpg *g = calloc(1, sizeof *g);
  if (g == NULL) return dpg_failf(why, cap, "out of memory");
  grpc_init();
  g->cq = grpc_completion_queue_create_for_next(NULL);
  *out = g;
  return 0;
}

/* Asks for the next call of slot s's method. */
static void dpg_arm(struct dpg *g, struct dpg_slot *s) {
  struct dpg_server *srv = s->srv;
  grpc_metadata_array_init(&s->md);
  s->payload = NULL;
  s->call = NULL;
  grpc_call_error e;
  if (s->method == DPG_UNKNOWN) {
    grpc_call_details_init(&s->details);
    e = grpc_server_request_call(srv->server, &s->call, &s->details, &s->md,
                                 g->cq, g->cq, &s->tag);
  } else {
    e = grpc_server_request_registered_call(
        srv->server, srv->methods[s->method], &s->call, &s->deadline, &s->md,
        &s->payload, g->cq, g->cq, &s->tag);
  }
  if (e == GRPC_CALL_OK) srv->live_slots++;
  else grpc_metadata_array_destroy(&s->md);
}

/* What an arrived slot leaves behind once its call was taken. */
static void dpg_slot_clear(struct dpg_slot *s) {
  grpc_metadata_array_destroy(&s->md);
  if (s->method == DPG_UNKNOWN) grpc_call_details_destroy(&s->details);
  if (s->payload) grpc_byte_buffer_destroy(s->payload);
  s->payload = NULL;
}

static void dpg_call_free(struct dpg_call *c) {
  if (c->has_req) grpc_slice_unref(c->req);
  if (c->waiting) grpc_byte_buffer_destroy(c->waiting);
  if (c->call) grpc_call_unref(c->call);
  free(c);
}

static void dpg_stream_unlink(struct dpg *g, struct dpg_call *c) {
  for (struct dpg_call **pp = &g->streams; *pp; pp = &(*pp)->next)
    if (*pp == c) {
      *pp = c->next;
      g->n_streams--;
      return;
    }
}

static void dpg_send(struct dpg_call *c, grpc_byte_buffer *bb) {
  grpc_op ops[2];
  memset(ops, 0, sizeof ops);
  size_t n = 0;
  if (!c->sent_initial) {
    ops[n].op = GRPC_OP_SEND_INITIAL_METADATA;
    n++;
    c->sent_initial = 1;
  }
  ops[n].op = GRPC_OP_SEND_MESSAGE;
  ops[n].data.send_message.send_message = bb;
  n++;
  c->in_flight++;
  if (grpc_call_start_batch(c->call, ops, n, &c->t_send, NULL) != GRPC_CALL_OK)
    c->in_flight--;
  grpc_byte_buffer_destroy(bb); /* the batch holds its own reference */
}

/* One finished tag.  Returns the call that arrived, if it was one. */
static struct dpg_call *dpg_event(struct dpg *g, struct dpg_tag *t, int ok) {
  switch (t->kind) {
    case TAG_SLOT: {
      struct dpg_slot *s = t->owner;
      struct dpg_server *srv = s->srv;
      srv->live_slots--;
      if (!ok || srv->stopping) {
        if (ok && s->call) {
          grpc_call_cancel(s->call, NULL);
          grpc_call_unref(s->call);
        }
        dpg_slot_clear(s);
        return NULL;
      }
      struct dpg_call *c = calloc(1, sizeof *c);
      if (c == NULL) {
        grpc_call_cancel(s->call, NULL);
        grpc_call_unref(s->call);
        dpg_slot_clear(s);
        dpg_arm(g, s);
        return NULL;
      }
      c->g = g;
      c->call = s->call;
      c->method = s->method;
      c->t_done = (struct dpg_tag){TAG_DONE, c};
      c->t_send = (struct dpg_tag){TAG_SEND, c};
      c->t_close = (struct dpg_tag){TAG_CLOSE, c};
      if (s->payload) {
        c->req = dpg_read(s->payload);
        c->has_req = 1;
      }
      dpg_slot_clear(s);
      dpg_arm(g, s);
      return c;
    }
    case TAG_DONE:
      dpg_call_free(t->owner);
      return NULL;
    case TAG_SEND: {
      struct dpg_call *c = t->owner;
      c->in_flight--;
      if (!ok) c->closed = 1;
      if (c->closed) {
        if (c->in_flight == 0) dpg_call_free(c);
        return NULL;
      }
      if (c->waiting) {
        grpc_byte_buffer *bb = c->waiting;
        c->waiting = NULL;
        dpg_send(c, bb);
      }
      return NULL;
    }
    case TAG_CLOSE: {
      struct dpg_call *c = t->owner;
      c->in_flight--;
      c->closed = 1;
      dpg_stream_unlink(g, c);
      if (c->in_flight == 0) dpg_call_free(c);
      return NULL;
    }
    case TAG_SHUTDOWN:
      return NULL;
  }
  return NULL;
}

void dpg_stop(struct dpg *g) {
  struct dpg_server *srv = g->srv;
  if (srv == NULL) return;
  srv->stopping = 1;
  srv->shutdown = (struct dpg_tag){TAG_SHUTDOWN, srv};
  grpc_server_shutdown_and_notify(srv->server, g->cq, &srv->shutdown);
  grpc_server_cancel_all_calls(srv->server);
  /* Drain until the server says it stopped and every request it held came
   * back; the streams' closes come back too (their calls were cancelled). */
  int down = 0;
  while (!down || srv->live_slots > 0) {
    grpc_event ev =
        grpc_completion_queue_next(g->cq, dpg_in_ms(5000), NULL);
    if (ev.type == GRPC_QUEUE_TIMEOUT) break; /* gRPC hung: leak, go on */
    if (ev.type != GRPC_OP_COMPLETE) break;
    struct dpg_tag *t = ev.tag;
    if (t == &srv->shutdown) {
      down = 1;
      continue;
    }
    dpg_event(g, t, ev.success);
  }
  grpc_server_destroy(srv->server);
  free(srv);
  g->srv = NULL;
}

int dpg_serve(struct dpg *g, const char *path, char *why, size_t cap) {
  dpg_stop(g);
  if (unlink(path) != 0 && errno != ENOENT)
    return dpg_failf(why, cap, "cannot remove the old %s: %s", path,
                     strerror(errno));
  struct dpg_server *srv = calloc(1, sizeof *srv);
  if (srv == NULL) return dpg_failf(why, cap, "out of memory");
  srv->server = grpc_server_create(NULL, NULL);
  grpc_server_register_completion_queue(srv->server, g->cq, NULL);
  for (int m = 0; m < DPG_NMETHODS; m++)
    srv->methods[m] = grpc_server_register_method(
        srv->server, dpg_paths[m], NULL,
        GRPC_SRM_PAYLOAD_READ_INITIAL_BYTE_BUFFER, 0);
  char addr[4200];
  snprintf(addr, sizeof addr, "unix:%s", path);
  grpc_server_credentials *cr = grpc_insecure_server_credentials_create();
  int port = grpc_server_add_http2_port(srv->server, addr, cr);
  grpc_server_credentials_release(cr);
  if (port == 0) {
    grpc_server_destroy(srv->server);
    free(srv);
    return dpg_failf(why, cap, "cannot listen on %s", path);
  }
  grpc_server_start(srv->server);
  /* The kubelet connects as root; nobody else needs to. */
  if (chmod(path, 0600) != 0) {
    g->srv = srv;
    dpg_stop(g);
    return dpg_failf(why, cap, "chmod %s: %s", path, strerror(errno));
  }
  g->srv = srv;
  for (int m = 0; m <= DPG_NMETHODS; m++) {
    struct dpg_slot *s = &srv->slots[m];
    s->tag = (struct dpg_tag){TAG_SLOT, s};
    s->srv = srv;
    s->method = (enum dpg_method)m;
    dpg_arm(g, s);
  }
  return 0;
}

int dpg_next(struct dpg *g, int timeout_ms, struct dpg_call **call,
             enum dpg_method *method, const uint8_t **req, size_t *len) {
  gpr_timespec deadline = dpg_in_ms(timeout_ms);
  for (;;) {
    grpc_event ev = grpc_completion_queue_next(g->cq, deadline, NULL);
    if (ev.type != GRPC_OP_COMPLETE) return 0;
    struct dpg_call *c = dpg_event(g, ev.tag, ev.success);
    if (c == NULL) continue;
    if (c->method == DPG_UNKNOWN) {
      dpg_fail(c, DPG_UNIMPLEMENTED, "gmb-device-plugin serves the "
               "v1beta1.DevicePlugin service only");
      continue;
    }
    *call = c;
    *method = c->method;
    *req = c->has_req ? GRPC_SLICE_START_PTR(c->req) : NULL;
    *len = c->has_req ? GRPC_SLICE_LENGTH(c->req) : 0;
    return 1;
  }
}

static void dpg_finish(struct dpg_call *c, grpc_byte_buffer *bb, int code,
                       const char *msg) {
  grpc_op ops[4];
  memset(ops, 0, sizeof ops);
  size_t n = 0;
  grpc_slice details = grpc_slice_from_copied_string(msg ? msg : "");
  ops[n++].op = GRPC_OP_SEND_INITIAL_METADATA;
  if (bb) {
    ops[n].op = GRPC_OP_SEND_MESSAGE;
    ops[n++].data.send_message.send_message = bb;
  }
  ops[n].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
  ops[n].data.send_status_from_server.status = (grpc_status_code)code;
  ops[n++].data.send_status_from_server.status_details = &details;
  ops[n].op = GRPC_OP_RECV_CLOSE_ON_SERVER;
  ops[n++].data.recv_close_on_server.cancelled = &c->cancelled;
  if (grpc_call_start_batch(c->call, ops, n, &c->t_done, NULL) !=
      GRPC_CALL_OK)
    dpg_call_free(c);
  grpc_slice_unref(details);
  if (bb) grpc_byte_buffer_destroy(bb);
}

void dpg_reply(struct dpg_call *c, const uint8_t *buf, size_t len) {
  dpg_finish(c, dpg_buffer(buf, len), 0, NULL);
}

void dpg_fail(struct dpg_call *c, int code, const char *msg) {
  dpg_finish(c, NULL, code, msg);
}

void dpg_stream_keep(struct dpg_call *c, const uint8_t *buf, size_t len) {
  struct dpg *g = c->g;
  grpc_op op;
  memset(&op, 0, sizeof op);
  op.op = GRPC_OP_RECV_CLOSE_ON_SERVER;
  op.data.recv_close_on_server.cancelled = &c->cancelled;
  c->in_flight++;
  if (grpc_call_start_batch(c->call, &op, 1, &c->t_close, NULL) !=
      GRPC_CALL_OK) {
    dpg_call_free(c);
    return;
  }
  c->next = g->streams;
  g->streams = c;
  g->n_streams++;
  dpg_send(c, dpg_buffer(buf, len));
}

void dpg_broadcast(struct dpg *g, const uint8_t *buf, size_t len) {
  for (struct dpg_call *c = g->streams; c; c = c->next) {
    if (c->closed) continue;
    grpc_byte_buffer *bb = dpg_buffer(buf, len);
    if (c->in_flight > 1) { /* the close's batch, and a send */
      if (c->waiting) grpc_byte_buffer_destroy(c->waiting);
      c->waiting = bb;
    } else {
      dpg_send(c, bb);
    }
  }
}

size_t dpg_streams(const struct dpg *g) { return g->n_streams; }

int dpg_unary(struct dpg *g, const char *path, const char *method,
              const uint8_t *req, size_t len, int timeout_ms, uint8_t **resp,
              size_t *rlen, char *why, size_t cap) {
  (void)g;
  char addr[4200];
  snprintf(addr, sizeof addr, "unix:%s", path);
  grpc_channel_credentials *cc = grpc_insecure_credentials_create();
  grpc_channel *ch = grpc_channel_create(addr, cc, NULL);
  grpc_channel_credentials_release(cc);
  grpc_completion_queue *cq = grpc_completion_queue_create_for_next(NULL);
  gpr_timespec deadline = dpg_in_ms(timeout_ms);
  grpc_slice msl = grpc_slice_from_copied_string(method);
  grpc_call *call = grpc_channel_create_call(ch, NULL, GRPC_PROPAGATE_DEFAULTS,
                                             cq, msl, NULL, deadline, NULL);
  grpc_slice_unref(msl);
  grpc_metadata_array init_md, trail_md;
  grpc_metadata_array_init(&init_md);
  grpc_metadata_array_init(&trail_md);
  grpc_byte_buffer *out = dpg_buffer(req, len), *in = NULL;
  grpc_status_code status = GRPC_STATUS_UNKNOWN;
  grpc_slice details = grpc_empty_slice();
  grpc_op ops[6];
  memset(ops, 0, sizeof ops);
  ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
  ops[1].op = GRPC_OP_SEND_MESSAGE;
  ops[1].data.send_message.send_message = out;
  ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
  ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
  ops[3].data.recv_initial_metadata.recv_initial_metadata = &init_md;
  ops[4].op = GRPC_OP_RECV_MESSAGE;
  ops[4].data.recv_message.recv_message = &in;
  ops[5].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
  ops[5].data.recv_status_on_client.trailing_metadata = &trail_md;
  ops[5].data.recv_status_on_client.status = &status;
  ops[5].data.recv_status_on_client.status_details = &details;
  int rc = -1;
  int tag;
  if (grpc_call_start_batch(call, ops, 6, &tag, NULL) != GRPC_CALL_OK) {
    dpg_failf(why, cap, "cannot start a call to %s", path);
  } else {
    /* The call's own deadline ends it; a little more here so that the
     * status it ends with is what we read. */
    grpc_event ev =
        grpc_completion_queue_next(cq, dpg_in_ms(timeout_ms + 1000), NULL);
    if (ev.type != GRPC_OP_COMPLETE) {
      grpc_call_cancel(call, NULL);
      ev = grpc_completion_queue_next(cq, dpg_in_ms(5000), NULL);
    }
    if (ev.type != GRPC_OP_COMPLETE) {
      dpg_failf(why, cap, "%s at %s: no answer", method, path);
    } else if (status != GRPC_STATUS_OK) {
      char *d = grpc_slice_to_c_string(details);
      dpg_failf(why, cap, "%s at %s: status %d: %s", method, path, (int)status,
                d);
      gpr_free(d);
    } else if (in == NULL) {
      dpg_failf(why, cap, "%s at %s: no reply message", method, path);
    } else {
      grpc_slice s = dpg_read(in);
      *rlen = GRPC_SLICE_LENGTH(s);
      *resp = malloc(*rlen ? *rlen : 1);
      if (*resp) {
        memcpy(*resp, GRPC_SLICE_START_PTR(s), *rlen);
        rc = 0;
      } else {
        dpg_failf(why, cap, "out of memory");
      }
      grpc_slice_unref(s);
    }
  }
  if (in) grpc_byte_buffer_destroy(in);
  grpc_byte_buffer_destroy(out);
  grpc_slice_unref(details);
  grpc_metadata_array_destroy(&init_md);
  grpc_metadata_array_destroy(&trail_md);
  grpc_call_unref(call);
  grpc_channel_destroy(ch);
  grpc_completion_queue_shutdown(cq);
  while (grpc_completion_queue_next(cq, gpr_inf_future(GPR_CLOCK_REALTIME),
                                    NULL).type != GRPC_QUEUE_SHUTDOWN) {
  }
  grpc_completion_queue_destroy(cq);
  return rc;
}

void dpg_destroy(struct dpg *g) {
  if (g == NULL) return;
  dpg_stop(g);
  grpc_completion_queue_shutdown(g->cq);
  for (;;) {
    grpc_event ev = grpc_completion_queue_next(
        g->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
    if (ev.type == GRPC_QUEUE_SHUTDOWN) break;
    if (ev.type == GRPC_OP_COMPLETE) dpg_event(g, ev.tag, ev.success);
  }
  grpc_completion_queue_destroy(g->cq);
  free(g);
  grpc_shutdown_blocking();
}
