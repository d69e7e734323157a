/*
 * http_admin.h - operators' sleep and wake over HTTP, as vLLM's /sleep and
 * /wake_up: a libmicrohttpd server on the Unix socket admin-http.sock
 * beside admin.sock, run by the loop's thread.
 *
 *   POST /sleep?tenant=T[&level=1|2][&tag=NAME]...
 *   POST /wake_up?tenant=T[&tags=NAME]...
 *   GET  /is_sleeping?tenant=T[&tag=NAME]
 *
 * Every request goes through the admin socket's handler (gmb__admin):
 * the same operator check (the peer's SO_PEERCRED uid against the
 * broker's and admin_uids), the same AdminPause and admin_resume, the same
 * log lines.  Answers are JSON (docs/sleep.md has every code).
 *
 * The loop owns the descriptors: it binds the listening socket, watches
 * it and the server's epoll descriptor, and calls in when either is ready
 * or the server's timeout comes; nothing here runs on another thread, so
 * the handlers read and change the broker's state as admin.c's do.
 */
#ifndef GMB_HTTP_ADMIN_H
#define GMB_HTTP_ADMIN_H

#include <stddef.h>
#include <stdint.h>

#include "broker.h"

/* The socket's file name in the run dir. */
#define GMB_ADMIN_HTTP_SOCKET "admin-http.sock"

struct gmb_http_admin;

/*
 * Serves on `listen_fd` (a listening AF_UNIX stream socket, non-blocking;
 * taken in every case).  0 with *out set, or GMB_E_SYSTEM with the
 * reason in err.
 */
int gmb__http_admin_start(struct gmb_broker *b, int listen_fd,
                          struct gmb_http_admin **out, char *err, size_t cap);

/* The descriptors the loop watches for reading: the listening socket, and
 * the server's epoll descriptor (ready when a connection is). */
int gmb__http_admin_listen_fd(const struct gmb_http_admin *h);
int gmb__http_admin_epoll_fd(const struct gmb_http_admin *h);

/* The listening socket is readable: accepts what waits (a batch), each
 * connection within its uid's cap, or closes it. */
void gmb__http_admin_accept(struct gmb_http_admin *h);

/* Lets the server read, answer and time out its connections; first shuts
 * down each connection accepted 5 s ago or more, idle or not (the server
 * then reads its end and closes it). */
void gmb__http_admin_run(struct gmb_http_admin *h);

/* Milliseconds until the server wants gmb__http_admin_run again although
 * nothing is readable (an idle connection's timeout, a connection's 5 s
 * since its accept, work left over), at most 1000; -1: none. */
long gmb__http_admin_timeout_ms(struct gmb_http_admin *h);

/* Connections refused at their cap since the last call (for the log). */
uint64_t gmb__http_admin_refused(struct gmb_http_admin *h);

/* Closes every connection and the listening socket, frees.  Accepts NULL. */
void gmb__http_admin_stop(struct gmb_http_admin *h);

#endif /* GMB_HTTP_ADMIN_H */
