/*
 * http.h - the metrics endpoint: GET /metrics over HTTP (libmicrohttpd).
 *
 * The broker's state belongs to the loop thread, so the server never
 * computes anything: the loop publishes the finished text (about once a
 * second) and the server's own thread answers every scrape with a copy of
 * the latest one.  The text is the only thing both threads touch, under a
 * mutex.  /metrics answers 200 (503 until a first text is published), any
 * other path 404, any method but GET and HEAD 405.
 */
#ifndef GMB_HTTP_H
#define GMB_HTTP_H

#include <microhttpd.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

struct gmb_http;

/* Connections counted per uid, for an HTTP server's caps (each server's
 * table is touched by one thread only: the one that runs it). */
#define GMB_HTTP_UIDS 64
struct gmb_http_uids {
  struct {
    uid_t uid;
    unsigned n; /* 0: a free row */
  } u[GMB_HTTP_UIDS];
};

/* uid's count in t, made (at 0) when `make`; NULL when uid has none and
 * `make` is 0, or the table is full. */
unsigned *gmb__http_uid_count(struct gmb_http_uids *t, uid_t uid, int make);

/*
 * A connection's absolute deadline.  libmicrohttpd's own timeout counts
 * from the last byte that moved, so a peer that sends a byte every few
 * seconds would hold its connection (and its place under the server's
 * caps) for ever; each server therefore keeps its open connections in a
 * gmb_http_conns and, before each MHD_run, shuts down the socket of every
 * one accepted more than `timeout_s` ago, idle or not (libmicrohttpd then
 * reads the end and closes it as any other).  A list is touched by one
 * thread only: the one that runs its server.
 */
struct gmb_http_conn {
  int fd;    /* its socket (libmicrohttpd's, closed by it) */
  int cut;   /* shut down past end_ns: its end is on its way */
  uid_t uid; /* for the log line */
  uint64_t end_ns;
  struct gmb_http_conn *next, **prev;
};

struct gmb_http_conns {
  struct gmb_http_conn *head; /* every connection open now */
  const char *what;           /* the endpoint, for the log line */
  unsigned timeout_s;
};

/* Links c (fd, uid) into l with its deadline timeout_s from now. */
void gmb__http_conn_add(struct gmb_http_conns *l, struct gmb_http_conn *c,
                        int fd, uid_t uid);

/* Unlinks c from its list (it is the caller's to free). */
void gmb__http_conn_remove(struct gmb_http_conn *c);

/* Shuts down every connection of l past its deadline, then runs d
 * (MHD_run: never blocks). */
void gmb__http_run(struct MHD_Daemon *d, struct gmb_http_conns *l);

/* Milliseconds until d wants gmb__http_run again although nothing is
 * readable: the sooner of libmicrohttpd's own timeout and the next
 * deadline in l, at most 1000; -1 when there is neither. */
long gmb__http_timeout_ms(struct MHD_Daemon *d, struct gmb_http_conns *l);

/* Queues a response of `len` bytes of `body` (libmicrohttpd's memory
 * `mode`) with status `code`, Content-Type `type` and, unless NULL, an
 * Allow header.  libmicrohttpd's result (MHD_NO: close the connection). */
enum MHD_Result gmb__http_reply(struct MHD_Connection *conn, unsigned int code,
                                const char *body, size_t len,
                                enum MHD_ResponseMemoryMode mode,
                                const char *type, const char *allow);

/*
 * Splits "HOST:PORT" ("127.0.0.1:9464", "[::1]:9464", "localhost:9464") into
 * host (without brackets) and port.  0, or GMB_E_INVAL with the reason in
 * err.
 */
int gmb__http_listen_parse(const char *listen, char *host, size_t hostcap,
                           uint16_t *port, char *err, size_t errcap);

/*
 * Binds `listen` (PORT 0: any free port) and starts the server thread.
 * 0 with *out set, or GMB_E_INVAL (a bad address) / GMB_E_SYSTEM (bind,
 * listen or the thread failed) with the reason in err.  The server thread
 * blocks every signal, so it never takes the broker's SIGTERM.
 */
int gmb__http_start(const char *listen, struct gmb_http **out, char *err,
                    size_t cap);

/* The port the endpoint listens on (useful after PORT 0). */
uint16_t gmb__http_port(const struct gmb_http *h);

/* Replaces the text served at /metrics with a copy of `text`. */
void gmb__http_publish(struct gmb_http *h, const char *text);

/* Stops the thread, closes the socket, frees.  Accepts NULL. */
void gmb__http_stop(struct gmb_http *h);

#endif /* GMB_HTTP_H */
