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

#include <stddef.h>
#include <stdint.h>

struct gmb_http;

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
