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

#include <stdint.h>

#include "gmb.h"

/* The session cache's bytes in use (each request rounded to 512), one
 * atomic load: libgmb-torch.so's memory fraction and allocated figures
 * (client/shim/shim.h declares it again, the shims having no path to
 * this header).  0 for NULL. */
uint64_t gmb__client_cache_in_use(gmb_client *c);

/* 1 when a graph capture is, or may be, underway in the process on the
 * session's GPU (gmb__cuda_capture_underway: a wait for the device now
 * would break it), 0 when none is or on the host device (the shims, as
 * above: client/shim/shim.h declares it again). */
int gmb__client_capture_underway(gmb_client *c);

#endif /* GMB_CLIENT_H */
