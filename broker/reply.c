/*
 * reply.c - the sender (reply.h): encodes replies and events and hands
 * them to the right ROUTER socket without ever waiting for a peer.
 */
#include "reply.h"

#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include "gmb.h"
#include "log.h"

/* Sends handed to each socket (the loop's; one loop thread per
 * process). */
static uint64_t reply_sends[2];

uint64_t gmb__reply_sends(enum gmb_socket sock) {
  return reply_sends[sock == GMB_SOCK_ADMIN];
}

void gmb__reply_send(struct gmb_broker *b, enum gmb_socket sock,
                     const uint8_t *rid, size_t rid_len,
                     const struct wire_reply *rep) {
  /* The sessions were told the broker stops; what their teardown frees
   * or retires is nobody's business any more. */
  if (b->closing) return;
  if (b->reply_tap) {
    b->reply_tap(b->reply_tap_ctx, sock, rid, rid_len, rep);
    return;
  }
  void *s = sock == GMB_SOCK_ADMIN ? b->admin_sock : b->client_sock;
  if (s == NULL) return; /* not serving (yet, or any more) */
  uint8_t *buf = NULL;
  size_t len = 0;
  int rc = gmb__wire_reply_encode(rep, &buf, &len);
  if (rc) {
    log_error("cannot encode a reply: %s", gmb_strerror(rc));
    return;
  }
  reply_sends[sock == GMB_SOCK_ADMIN]++;
  if (zmq_send(s, rid, rid_len, ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0 ||
      zmq_send(s, buf, len, ZMQ_DONTWAIT) < 0)
    log_debug("reply %" PRIu64 " dropped: %s", rep->id,
              zmq_strerror(zmq_errno()));
  free(buf);
}

void gmb__reply_to_session(struct gmb_broker *b, const struct gmb_session *s,
                           const struct wire_reply *rep) {
  gmb__reply_send(b, GMB_SOCK_CLIENT, s->rid, s->rid_len, rep);
}

void gmb__reply_event(struct gmb_broker *b, const struct gmb_session *s,
                      enum wire_event kind, uint64_t segment,
                      const char *msg) {
  struct wire_reply ev;
  memset(&ev, 0, sizeof ev);
  ev.kind = WIRE_EVENT;
  ev.u.event.kind = kind;
  ev.u.event.segment = segment;
  if (msg) snprintf(ev.message, sizeof ev.message, "%s", msg);
  gmb__reply_to_session(b, s, &ev);
}

int gmb__reply_fail(struct wire_reply *rep, int status, const char *fmt,
                    ...) {
  va_list ap;
  rep->status = status;
  rep->kind = WIRE_NONE;
  va_start(ap, fmt);
  vsnprintf(rep->message, sizeof rep->message, fmt, ap);
  va_end(ap);
  return 1;
}
