/*
 * shim.h - what libgmb-preload.so and libgmb-torch.so share: one
 * session per device of the process (one broker serves one GPU), each made
 * at first use, and the map from the pointers they handed out to the
 * broker's allocation ids and the sessions they came from.
 *
 * Each of the two libraries links its own copy (the symbols stay hidden),
 * so a process that loads both holds two sessions per device; they
 * never see each other's pointers.
 */
#ifndef GMB_SHIM_H
#define GMB_SHIM_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "gmb.h"

/* Exported entry points of the shims (the archives' symbols stay hidden). */
#define GMB_SHIM_API __attribute__((visibility("default")))

/* Devices a process's shims keep sessions for (ordinals 0 .. this - 1). */
#define GMB_SHIM_MAX_DEVICES 64

/*
 * The session for device `device` of this process (its CUDA ordinal; -1:
 * the calling thread's current device, gmb_gpu_current), connected at the
 * first request for that device: the broker of that GPU, found by its
 * UUID (gmb_connect_gpu: $GMB_RUN_DIR/UUID/broker.sock, else the default
 * broker when it serves that GPU).  The default broker ($GMB_ENDPOINT /
 * $GMB_TENANT as gmb_connect reads them) is connected once, first, and
 * serves its own GPU.  Returns the session, or NULL when that device has
 * no broker; *why (may be NULL) then holds the reason ("GMB_E_CONN: no
 * broker for GPU ..."), valid for the life of the process.  *resolved
 * (may be NULL) receives the device used.  In a child made by fork()
 * after the first session it returns NULL with a reason that says so:
 * the parent's ZeroMQ context must not be used there (as CUDA itself
 * forbids using a context across fork).
 *
 * A broker whose device is not a GPU (`host`) is no broker for a shim:
 * cudaMalloc and PyTorch expect device pointers, and host addresses given
 * to kernels would fault.  It is refused with that reason, unless
 * $GMB_SHIM_ALLOW_HOST=1 (for tests of the shims on machines without a
 * GPU): then that one session serves every device.
 */
gmb_client *gmb__shim_session(int device, int *resolved, const char **why);

/* The session device's allocations came from, if one was made: never
 * connects, takes no lock (a free's path).  The host session when one
 * serves every device; NULL for a device without a session, past the
 * limit, or before any session was made. */
gmb_client *gmb__shim_session_of(int device);

/* The sessions made so far (at most cap of them in out): their number. */
int gmb__shim_sessions(gmb_client **out, int cap);

/* gmb__shim_session for the calling thread's current device. */
gmb_client *gmb__shim_client(const char **why);

/* 1 when the calling process is a fork() child of the one that connected
 * (a flag a pthread_atfork handler sets: no system call, and inline, as
 * it is on every allocation's and free's path).  Set once, never
 * cleared: a session found before it was set must not be used once it is. */
extern atomic_int gmb__shim_in_child;
static inline int gmb__shim_forked(void) {
  return atomic_load_explicit(&gmb__shim_in_child, memory_order_relaxed);
}

/* 1 when a host-device broker serves every device (GMB_SHIM_ALLOW_HOST). */
int gmb__shim_host(void);

/* The session a pointer of ours came from, or NULL. */
gmb_client *gmb__shim_owner(const void *ptr);

/*
 * A pinned allocation of `size` bytes (> 0) through the session: *ptr is
 * its address in this process (gmb_lock's; pinned, so it never moves) and
 * the pointer is remembered for gmb__shim_free.  0 or the GMB_E_* code;
 * the failure is explained by gmb_last_error() on this thread.
 */
int gmb__shim_alloc(gmb_client *c, size_t size, void **ptr);

/* Frees what gmb__shim_alloc gave, through the session it came from.
 * GMB_E_NOENT, touching nothing, for a pointer that is not one of ours;
 * GMB_E_INVAL, touching nothing, for one of gmb__shim_malloc_async's;
 * else gmb_free's result.  gmb_free
 * waits for the GPU first (cuCtxSynchronize in the primary context, as
 * cudaFree); when that wait or the free fails (other than a session that
 * is gone) the pointer stays ours and the memory allocated: it is never
 * handed back while the GPU may still use it. */
int gmb__shim_free(void *ptr);

/* Tags a pointer of the map may carry (gmb__shim_is_async). */
#define GMB_SHIM_TAG_GRAPH 0x1u /* allocated during a CUDA graph capture */

/*
 * The stream-ordered cache's path (libgmb-torch.so, and cudaMallocAsync in
 * libgmb-preload.so): gmb_malloc_async on session c and `stream`, the
 * pointer remembered (with its session and `tag`, GMB_SHIM_TAG_*) as
 * gmb__shim_alloc's are, so that a free finds its session whatever
 * device is current.  0 or the GMB_E_* code, explained by
 * gmb_last_error(c).
 */
int gmb__shim_malloc_async(gmb_client *c, size_t size, void *stream,
                           unsigned tag, void **ptr);

/* 1 when ptr is one of gmb__shim_malloc_async's (a block of a session's
 * cache), 0 when it is gmb__shim_alloc's, -1 when it is not ours; *tag
 * (may be NULL) receives its tag. */
int gmb__shim_is_async(const void *ptr, unsigned *tag);

/*
 * The two halves of gmb__shim_free_async, for a caller that decides
 * between them whether to free at all (libgmb-torch.so keeps memory a
 * CUDA graph may use): one map lookup per free.  gmb__shim_async_take
 * takes ptr, one of gmb__shim_malloc_async's, out of the map: 0 with its
 * session in *c and its tag in *tag (the pointer is then no longer ours:
 * kept, as gmb__shim_keep leaves it, unless released); GMB_E_NOENT,
 * touching nothing, for a pointer that is not one of ours; GMB_E_INVAL,
 * touching nothing, for one of gmb__shim_alloc's.
 * gmb__shim_async_release frees a taken pointer: gmb_free_async's result;
 * when that fails (other than a session that is gone) the pointer is put
 * back, still ours.
 */
int gmb__shim_async_take(void *ptr, gmb_client **c, unsigned *tag);
int gmb__shim_async_release(gmb_client *c, void *ptr, void *stream,
                            unsigned tag);

/* Frees what gmb__shim_malloc_async gave: gmb_free_async on the session it
 * came from (never waits; the block is reusable on `stream` at once, on
 * others once its work ran).  GMB_E_NOENT, touching nothing, for a
 * pointer that is not one of ours; GMB_E_INVAL, touching nothing, for one
 * of gmb__shim_alloc's; else gmb_free_async's result (the
 * pointer stays ours when that fails, other than a session that is gone). */
int gmb__shim_free_async(void *ptr, void *stream);

/* gmb_trim(keep_bytes) on every session this shim holds (each device's,
 * or the one host session).  0 (also when there is none yet), or the
 * first failure's GMB_E_* code. */
int gmb__shim_trim_all(size_t keep_bytes);

/* Forgets ptr without freeing it (memory a CUDA graph may still use):
 * it stays allocated until the session ends.  0 or GMB_E_NOENT. */
int gmb__shim_keep(void *ptr);

/* 1 when ptr is one of ours (for tests and diagnostics). */
int gmb__shim_owns(const void *ptr);

/*
 * The memory figures the shims report (cudaMemGetInfo, cuMemGetInfo,
 * NVML, torch.cuda.mem_get_info), from session c.  With a quota: total =
 * the quota, free = quota - used - local_held (bytes this process holds
 * outside the broker, which it does not see).  Without: what the broker
 * could still give the tenant: the device's free memory capped by the
 * broker's room for new segments (capacity - segments), plus the free
 * bytes in the tenant's own segments; total is the device's.  The
 * device's own figures come from `real` (called with `arg`; 0 or its own
 * positive error code) when it is not NULL, else the broker's capacity is
 * the total and local_held is taken off free.  0, a negative GMB_E_* code,
 * or real's positive code.  One or two broker round trips.
 */
typedef int (*gmb__shim_real_figures_fn)(void *arg, uint64_t *free,
                                         uint64_t *total);
int gmb__shim_figures(gmb_client *c, uint64_t local_held,
                      gmb__shim_real_figures_fn real, void *arg,
                      uint64_t *freep, uint64_t *totalp);

/* libgmb.a's (client/lib/client.h): the session cache's bytes in use,
 * each request rounded to 512, one atomic load.  One of the two calls of
 * the shims past gmb.h, for libgmb-torch.so's memory fraction and figures,
 * which a gmb_cache_stats_get (a lock per arena) would cost too much on
 * every allocation.  0 for NULL. */
uint64_t gmb__client_cache_in_use(gmb_client *c);

/* libgmb.a's too: 1 when a graph capture is, or may be, underway in the
 * process (a wait for the device would break it), else 0; the preload's
 * own synchronisation before a free asks it first. */
int gmb__client_capture_underway(gmb_client *c);

/* $NAME as 0/1 ("1", "yes", "true", "on" are 1). */
int gmb__shim_env_flag(const char *name);

#endif /* GMB_SHIM_H */
