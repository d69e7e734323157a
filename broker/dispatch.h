/*
 * dispatch.h - the client requests' handler (the client socket's messages,
 * decoded by the loop).
 */
#ifndef GMB_DISPATCH_H
#define GMB_DISPATCH_H

#include "broker.h"
#include "wire.h"

/* Handles one decoded client request from `peer`.  Returns 1 when *rep is
 * to be sent now, 0 when the reply was deferred (a waiting allocation) or
 * is not due (a heartbeat, a process already gone). */
int gmb__dispatch(struct gmb_broker *b, const struct gmb_peer *peer,
                  const struct wire_request *req, struct wire_reply *rep);

#endif /* GMB_DISPATCH_H */
