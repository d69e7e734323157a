/*
 * endpoint.h - where the broker's sockets are, and a quick look at whether
 * anyone is listening there, for the client library and gmbctl.
 *
 * ZeroMQ connects in the background and retries for ever: a missing socket
 * file, a stale one left by a dead broker or one this uid may not open all
 * look the same to it (a send that never completes).  Probing the Unix
 * socket ourselves first turns each of those into a one-line reason at once.
 */
#ifndef GMB_ENDPOINT_H
#define GMB_ENDPOINT_H

#include <stddef.h>
#include <sys/types.h>

/* "ipc://RUN_DIR/NAME" for NAME "broker.sock" or "admin.sock", with RUN_DIR
 * from gmb__run_dir() when run_dir is NULL.  Returns buf, or NULL when it
 * does not fit. */
char *gmb__endpoint_default(const char *run_dir, const char *name, char *buf,
                            size_t cap);

/*
 * For an ipc:// endpoint: 0 when something listens on the socket file,
 * else GMB_E_CONN with the reason in `why` ("no broker at ipc://...: No such
 * file or directory (is gmb-broker running? GMB_RUN_DIR=...)").  `hint` is
 * appended inside that parenthesis when not NULL.  Other transports (tcp://)
 * are not probed: 0.
 */
int gmb__endpoint_probe(const char *endpoint, const char *hint, char *why,
                        size_t cap);

/*
 * Before a client connects (with a token or without: a fake broker would
 * get its memory either way): 0 when the run dir of an ipc:// endpoint is
 * a directory no one else may write to, owned by root or `uid`, or by a
 * uid that only root could have given it (its parent is root's and
 * writable by no one else, as /run/gmb made by systemd for the broker's
 * user), and the socket file in it is a socket of root, `uid` or that
 * owner; else GMB_E_AUTH (or GMB_E_CONN when missing) with the reason.
 * Another user could otherwise make the fallback run dir (/tmp/gmb-UID)
 * first and listen there.  Other transports: 0.
 */
int gmb__endpoint_trusted(const char *endpoint, uid_t uid, char *why,
                          size_t cap);
/* The same check of a run dir alone, for the broker at start. */
int gmb__run_dir_trusted(const char *dir, uid_t uid, char *why, size_t cap);

#endif /* GMB_ENDPOINT_H */
