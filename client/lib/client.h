/*
 * client.h - what client.c offers the rest of the library (not the
 * public API, which is gmb.h).
 */
#ifndef GMB_CLIENT_H
#define GMB_CLIENT_H

/* Records the calling thread's last failure (gmb_last_error) as
 * "GMB_E_NAME: text" and returns `code`. */
int gmb__client_fail(int code, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

#endif /* GMB_CLIENT_H */
