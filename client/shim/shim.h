/*
 * shim.h - what libgmb-preload.so and libgmb-torch.so share: one
 * process-wide session, made at first use, and the map from the pointers
 * they handed out to the broker's allocation ids.
 *
 * Each of the two libraries links its own copy (the symbols stay hidden),
 * so a process that loads both holds two sessions of the same tenant; they
 * never see each other's pointers.
 */
#ifndef GMB_SHIM_H
#define GMB_SHIM_H

#include <stddef.h>
#include <stdint.h>

#include "gmb.h"

/* Exported entry points of the shims (the archives' symbols stay hidden). */
#define GMB_SHIM_API __attribute__((visibility("default")))

/*
 * The process-wide session, connected once (pthread_once) with
 * $GMB_ENDPOINT / $GMB_TENANT as gmb_connect reads them.  Returns it, or
 * NULL when no broker answered; *why (may be NULL) then holds the reason
 * ("GMB_E_CONN: no broker at ..."), valid for the life of the process.
 * In a child made by fork() after the session was made it returns NULL
 * with a reason that says so: the parent's ZeroMQ context must not be
 * used there (as CUDA itself forbids using a context across fork).
 * A broker whose device is not a GPU (`host`) is no broker for a shim:
 * cudaMalloc and PyTorch expect device pointers, and host addresses given
 * to kernels would fault.  The session is closed and NULL returned with
 * that reason, unless $GMB_SHIM_ALLOW_HOST=1 (for tests of the shims on
 * machines without a GPU; the pointers are then host memory).
 */
gmb_client *gmb__shim_client(const char **why);

/* 1 when the calling process is a fork() child of the one that connected. */
int gmb__shim_forked(void);

/* The session's GPU as this process numbers it (gmb_device_get's
 * ordinal), or -1 (no session, or a host device allowed for tests). */
int gmb__shim_device(void);

/*
 * A pinned allocation of `size` bytes (> 0) through the session: *ptr is
 * its address in this process (gmb_lock's; pinned, so it never moves) and
 * the pointer is remembered for gmb__shim_free.  0 or the GMB_E_* code;
 * the failure is explained by gmb_last_error() on this thread.
 */
int gmb__shim_alloc(gmb_client *c, size_t size, void **ptr);

/* Frees what gmb__shim_alloc gave.  GMB_E_NOENT, touching nothing, for a
 * pointer that is not one of ours; else gmb_free's result.  gmb_free
 * waits for the GPU first (cuCtxSynchronize in the primary context, as
 * cudaFree); when that wait or the free fails (other than a session that
 * is gone) the pointer stays ours and the memory allocated: it is never
 * handed back while the GPU may still use it. */
int gmb__shim_free(gmb_client *c, void *ptr);

/* Forgets ptr without freeing it (memory a CUDA graph may still use):
 * it stays allocated until the session ends.  0 or GMB_E_NOENT. */
int gmb__shim_keep(void *ptr);

/* 1 when ptr is one of ours (for tests and diagnostics). */
int gmb__shim_owns(const void *ptr);

/* $NAME as 0/1 ("1", "yes", "true", "on" are 1). */
int gmb__shim_env_flag(const char *name);

#endif /* GMB_SHIM_H */
