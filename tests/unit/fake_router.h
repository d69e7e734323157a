/*
 * fake_router.h - the socket side of the fake brokers in check_client.c and
 * check_client_cuda.c: a ROUTER bound by the test, one request at a time
 * taken off it and decoded, replies encoded and sent to the last peer.
 * What each fake answers stays in its own test file.
 */
#ifndef GMB_FAKE_ROUTER_H
#define GMB_FAKE_ROUTER_H

#include <check.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include "wire.h"

/* A new context in *ctx and a ROUTER (linger 0) bound at `endpoint`. */
static inline void *fake_router_open(void **ctx, const char *endpoint) {
  *ctx = zmq_ctx_new();
  void *router = zmq_socket(*ctx, ZMQ_ROUTER);
  int zero = 0;
  zmq_setsockopt(router, ZMQ_LINGER, &zero, sizeof zero);
  ck_assert_int_eq(zmq_bind(router, endpoint), 0);
  return router;
}

/* Waits up to 10 ms for one request.  Returns 1 with *req decoded and the
 * sender's routing id in peer (at most cap bytes, *peer_len), 0 when
 * nothing came or it did not decode. */
static inline int fake_router_recv(void *router, uint8_t *peer, size_t cap,
                                   size_t *peer_len, struct wire_request *req) {
  zmq_pollitem_t it = {router, 0, ZMQ_POLLIN, 0};
  if (zmq_poll(&it, 1, 10) <= 0) return 0;
  zmq_msg_t id, body;
  zmq_msg_init(&id);
  zmq_msg_init(&body);
  zmq_msg_recv(&id, router, 0);
  zmq_msg_recv(&body, router, 0);
  *peer_len = zmq_msg_size(&id);
  if (*peer_len > cap) *peer_len = cap;
  memcpy(peer, zmq_msg_data(&id), *peer_len);
  int rc = gmb__wire_request_decode(zmq_msg_data(&body), zmq_msg_size(&body),
                                    req);
  zmq_msg_close(&id);
  zmq_msg_close(&body);
  return rc == 0;
}

/* Sends `len` raw bytes to the peer. */
static inline void fake_router_send(void *router, const uint8_t *peer,
                                    size_t peer_len, const void *buf,
                                    size_t len) {
  zmq_send(router, peer, peer_len, ZMQ_SNDMORE);
  zmq_send(router, buf, len, 0);
}

/* Encodes a reply (or an event) and sends it to the peer. */
static inline void fake_router_reply(void *router, const uint8_t *peer,
                                     size_t peer_len,
                                     const struct wire_reply *rep) {
  uint8_t *buf;
  size_t len;
  ck_assert_int_eq(gmb__wire_reply_encode(rep, &buf, &len), 0);
  fake_router_send(router, peer, peer_len, buf, len);
  free(buf);
}

#endif /* GMB_FAKE_ROUTER_H */
