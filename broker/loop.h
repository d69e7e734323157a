/*
 * loop.h - the broker's event loop: the sockets under the run dir, the
 * signals, the watched client processes and the timers.
 */
#ifndef GMB_LOOP_H
#define GMB_LOOP_H

#include <stddef.h>

#include "broker.h"

/* Creates the run dir and binds the sockets under b->run_dir (with
 * admin-http.sock unless admin_http = no), blocks the signals it handles,
 * and starts the metrics endpoint when the config asks for one.  0 or a GMB_E_* code, with a reason in err.  What was opened is
 * closed by gmb__loop_close either way. */
int gmb__loop_open(struct gmb_broker *b, char *err, size_t errcap);

/* Runs until SIGTERM/SIGINT, then tells every session the broker stops.
 * 0 on a clean stop, 1 when the loop itself failed. */
int gmb__loop_run(struct gmb_broker *b);

/* Stops the metrics endpoint, closes the sockets and removes their files.
 * Safe after a failed or no gmb__loop_open. */
void gmb__loop_close(struct gmb_broker *b);

#endif /* GMB_LOOP_H */
