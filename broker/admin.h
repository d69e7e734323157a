/*
 * admin.h - the admin socket's handler: what operators (gmbctl) ask.
 */
#ifndef GMB_ADMIN_H
#define GMB_ADMIN_H

#include <stddef.h>
#include <sys/types.h>

#include "broker.h"
#include "wire.h"

/* 1 when uid is an operator: the broker's own uid or one of admin_uids,
 * never the overflow uid (gmb__config_operator); checked on every admin
 * request, whichever socket it came by. */
int gmb__admin_allowed(const struct gmb_broker *b, uid_t uid);

/* Handles one admin request.  Returns 1 when *rep is to be sent now, 0
 * when the answer comes later (a compaction). */
int gmb__admin(struct gmb_broker *b, const struct gmb_peer *peer,
               const struct wire_request *req, struct wire_reply *rep);

/* Reads the config file again (SIGHUP, gmbctl reload): 0 with a summary in
 * msg, or an error with the reason in msg, in which case the running
 * config is kept. */
int gmb__admin_reload(struct gmb_broker *b, char *msg, size_t cap);

#endif /* GMB_ADMIN_H */
