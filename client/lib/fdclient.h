/*
 * fdclient.h - the client's end of the descriptor channel (the messages
 * are in proto/fdpass.h): a blocking SOCK_SEQPACKET connection to fd.sock
 * beside the broker's client socket, proved once with the session's secret
 * and then asked for segments' descriptors.
 *
 * The caller serialises requests on one connection (client.c holds its io
 * mutex); every call waits at most `timeout_ms` (SO_RCVTIMEO/SO_SNDTIMEO).
 */
#ifndef GMB_FDCLIENT_H
#define GMB_FDCLIENT_H

#include <stddef.h>
#include <stdint.h>

/*
 * Connects to the descriptor channel of the broker at `endpoint`
 * ("ipc://DIR/broker.sock": the channel is DIR/fd.sock) and proves session
 * `session` with `secret` (GMB_FD_SECRET_LEN bytes).  Returns 0 with the
 * connected socket in *sock and the session's lock table as a descriptor
 * in *lt_fd (close-on-exec; the caller maps and closes it) of *lt_size
 * bytes; or GMB_E_CONN / GMB_E_AUTH / GMB_E_PROTO / GMB_E_TIMEOUT with the
 * reason in why.
 */
int gmb__fdclient_connect(const char *endpoint, uint64_t session,
                          const uint8_t *secret, int timeout_ms, int *sock,
                          int *lt_fd, uint64_t *lt_size, char *why,
                          size_t cap);

/* Sets how long each later request on `sock` may wait (ms). */
void gmb__fdclient_timeout(int sock, int timeout_ms);

/* Asks for segment `segment`'s descriptor on channel *sock: 0 with it in
 * *fd (the caller closes it) and its size in *size, or the broker's refusal
 * (GMB_E_NOENT for a segment this session's tenant does not own), or a
 * failure of the channel itself (GMB_E_CONN, GMB_E_TIMEOUT, GMB_E_PROTO),
 * after which the channel is closed and *sock is -1: later calls fail with
 * GMB_E_CONN at once.  Explained in why. */
int gmb__fdclient_segment(int *sock, uint64_t segment, int *fd, uint64_t *size,
                          char *why, size_t cap);

/* The same for `n` segments (1 to GMB_FDCLIENT_BATCH) in one exchange:
 * every request is sent before the first reply is read, so a batch waits
 * for the broker once, not once per descriptor.  0 with fds[0..n) and
 * sizes[0..n); on any failure no descriptor is left open (all fds[] are
 * -1), the first failure is the one explained, and the channel is closed
 * as above when the exchange itself failed. */
#define GMB_FDCLIENT_BATCH 64
int gmb__fdclient_segments(int *sock, const uint64_t *segs, unsigned n,
                           int *fds, uint64_t *sizes, char *why, size_t cap);

#endif /* GMB_FDCLIENT_H */
