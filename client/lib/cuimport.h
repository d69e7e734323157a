/*
 * cuimport.h - the client library's CUDA import layer: the driver and the
 * device's primary context (one per process), imports of the broker's
 * segments from their file descriptors (the VMM API), and stream-ordered
 * releases of lock-table holds.
 *
 * Internal to the client library.  Everything here is per process, not
 * per client: CUDA contexts and mappings are process-wide resources, and a
 * PyTorch or CuPy program in the same process must see the same memory
 * through the same (primary) context.  Thread-safe.
 */
#ifndef GMB_CUIMPORT_H
#define GMB_CUIMPORT_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

/* Devices a process can import on (ordinals 0 .. this - 1). */
#define GMB_CUDA_MAX_DEVICES 64

/*
 * Loads the driver once per process, finds the ordinal of this process
 * whose GPU has `uuid` ("GPU-xxxxxxxx-...", from the broker's Hello
 * reply), retains its primary context and reads its allocation
 * granularity (once per device).  The calling thread's current context
 * is left as it was (none stays none).
 * 0 with *ordinal set, or GMB_E_DEVICE with one line in `why`: no driver,
 * no UUID given, no GPU of that UUID visible here (the GPUs seen are
 * listed), a driver call that failed, or a fork child of a process that
 * attached.  A failure is not remembered (the next call tries again).
 */
int gmb__cuda_attach(const char *uuid, int *ordinal, char *why, size_t cap);

/*
 * Imports the allocation descriptor `fd` names (a POSIX fd exported by the
 * broker; the caller keeps it and closes it) and maps all `size` bytes of
 * it in the primary context of device `ordinal` (attached):
 * cuMemImportFromShareableHandle, a reservation of `size` bytes aligned to
 * the allocation granularity (cuMemAddressReserve), cuMemMap, read/write
 * access for the device (cuMemSetAccess), then cuMemRelease of the handle
 * (the mapping keeps the memory).  0 with *base set to the device address;
 * GMB_E_PROTO for a descriptor or size that cannot be a segment (fd < 0,
 * size 0 or not a multiple of the granularity); GMB_E_DEVICE when the
 * driver refuses (the call is named in `why`).  No de-duplication: two
 * imports of one allocation in one process are two mappings, each closed
 * on its own.
 */
int gmb__cuda_import(int ordinal, int fd, uint64_t size, uint64_t *base,
                     char *why, size_t cap);

/* Unmaps an import made by gmb__cuda_import (cuMemUnmap, then
 * cuMemAddressFree of its `size` bytes at `base`).  A failure is dropped:
 * there is nothing the caller could do about it. */
void gmb__cuda_close(int ordinal, uint64_t base, uint64_t size);

/*
 * The pieces of an import, for the cache's arenas of pages (cache.c):
 * gmb__cuda_reserve reserves `size` bytes (a multiple of the granularity)
 * of device address space aligned to the granularity: 0 with *base,
 * GMB_E_NOMEM when the driver has no room, GMB_E_PROTO or GMB_E_DEVICE
 * explained.  gmb__cuda_unreserve gives back a whole reservation.
 * gmb__cuda_map_at imports the descriptor `fd` (kept by the caller) and
 * maps `size` bytes of it at `addr` (granularity aligned, reserved,
 * mapped to nothing) with read/write access; with `keep` the imported
 * handle is kept and returned in *handle (for gmb__cuda_move; released by
 * gmb__cuda_unmap_at), else released at once (the mapping keeps the
 * memory) and *handle, when not NULL, is 0.  0, GMB_E_PROTO, GMB_E_DEVICE
 * (the call named in why), with nothing mapped on failure.
 * gmb__cuda_unmap_at unmaps [addr, addr+size) and releases `handle`
 * (0: none).  gmb__cuda_move maps `handle` at `to` and then unmaps `from`:
 * 0, or GMB_E_DEVICE explained with the old mapping as it was.
 */
int gmb__cuda_reserve(int ordinal, uint64_t size, uint64_t *base, char *why,
                      size_t cap);
void gmb__cuda_unreserve(int ordinal, uint64_t base, uint64_t size);
int gmb__cuda_map_at(int ordinal, int fd, uint64_t addr, uint64_t size,
                     int keep, uint64_t *handle, char *why, size_t cap);
void gmb__cuda_unmap_at(int ordinal, uint64_t addr, uint64_t size,
                        uint64_t handle);
int gmb__cuda_move(int ordinal, uint64_t from, uint64_t to, uint64_t size,
                   uint64_t handle, char *why, size_t cap);

/*
 * Waits for all work of device `ordinal`'s primary context and of every
 * other context of that device this process was seen using gmb in
 * (cuCtxSynchronize with each current; the caller's context is given
 * back), as cudaFree does before it frees.  0, or GMB_E_DEVICE explained: the
 * work did not finish (a fault), or a graph capture is (or may be)
 * underway, when nothing is waited for (gmb__cuda_capture_underway), so
 * the memory it used must not be handed back.
 */
int gmb__cuda_sync(int ordinal, char *why, size_t cap);

/*
 * Graph captures, which a wait of gmb's own would break: the driver
 * refuses cuCtxSynchronize while any stream of the context captures, in
 * every capture mode, and invalidates that capture (the program learns
 * of it at cuStreamEndCapture).  The driver has no process-wide "is a
 * capture underway" call, so the library asks what it can:
 * gmb__cuda_stream_note remembers each stream the program hands gmb
 * (gmb_malloc_async, gmb_free_async, gmb_record_stream,
 * gmb_stream_capturing, gmb_unlock_on_stream; the last
 * GMB_CUDA_MAX_STREAMS distinct ones; cheap when a thread names the
 * stream it named last).  gmb__cuda_capture_underway asks
 * cuStreamIsCapturing (a call the driver allows during captures) of the
 * legacy stream, which answers CUDA_ERROR_STREAM_CAPTURE_IMPLICIT while
 * any blocking stream captures, and of each noted stream (one the driver
 * no longer knows is forgotten): 1 when one captures or the driver could
 * not tell (why says which), 0 when none does, GMB_E_DEVICE explained
 * when the device is not attached.  Not seen: a capture on a
 * non-blocking stream gmb was never handed.  gmb__cuda_sync asks it
 * first and does not wait while it says 1.
 */
#define GMB_CUDA_MAX_STREAMS 64
void gmb__cuda_stream_note(void *stream);
int gmb__cuda_capture_underway(int ordinal, char *why, size_t cap);

/* Copies n bytes between host memory and device address `dev` (to_device:
 * cuMemcpyHtoD, else cuMemcpyDtoH) in device `ordinal`'s primary context,
 * done when it returns (the bytes are in device memory for every context
 * and process, whatever kind of host memory they came from).  0 or
 * GMB_E_DEVICE explained. */
int gmb__cuda_copy(int ordinal, uint64_t dev, void *host, size_t n,
                   int to_device, char *why, size_t cap);

/*
 * Pinned host memory (cuMemHostAlloc, portable: every context may copy to
 * and from it) of n bytes, in the primary context of the first attached
 * device (hostbuf.c's buffers).  0 with *p and *ordinal (give both to
 * gmb__cuda_host_free); GMB_E_NOENT when no device is attached (the host
 * device: why is empty); GMB_E_DEVICE explained when the driver refused
 * (pinned memory is limited).
 */
int gmb__cuda_host_alloc(size_t n, void **p, int *ordinal, char *why,
                         size_t cap);
/* Frees what gmb__cuda_host_alloc gave (cuMemFreeHost).  A failure is
 * dropped, as for gmb__cuda_close. */
void gmb__cuda_host_free(int ordinal, void *p);
/* 1 when `stream` is being captured into a graph (cuStreamIsCapturing;
 * why says so), 0 when not, GMB_E_DEVICE when the driver cannot tell. */
int gmb__cuda_capturing(int ordinal, void *stream, char *why, size_t cap);

/*
 * Enqueues on `stream` (NULL: the legacy default stream) a host function
 * that gives back one hold of the lock-table word `state` when the stream
 * reaches it.  The word must stay mapped until the function ran: see
 * gmb__cuda_unmap_later.  0; GMB_E_INVAL (explained) while the stream is
 * being captured into a graph (the function would be recorded into the
 * graph and run at every replay instead of now); GMB_E_DEVICE when the
 * driver refused.  On failure the hold is still taken.  A host function
 * is not run when the context has faulted (the driver drops queued work):
 * the hold then stays until the session ends, and the allocation never
 * moves meanwhile.
 */
int gmb__cuda_release_on_stream(int ordinal, _Atomic uint32_t *state,
                                void *stream, char *why, size_t cap);

/*
 * Unmaps [p, p+len) (a lock table) now when no host function of
 * gmb__cuda_release_on_stream is pending in this process, else as soon as
 * none is (checked at the next attach or unmap_later).
 */
void gmb__cuda_unmap_later(void *p, size_t len);

/* Events for the stream-ordered cache (cache.c), in device `ordinal`'s
 * primary context.  event_new: 0 with *ev (cuEventCreate, no timing) or
 * GMB_E_DEVICE.  event_record: 0, GMB_E_INVAL when the stream does
 * not take it (destroyed, invalid), or 1 when it is being captured into
 * a CUDA graph now (a record would be a node of the graph), explained.  event_query: 1 when the
 * work before the last record finished, 0 when not yet, GMB_E_DEVICE when
 * the driver cannot tell (a fault).  event_destroy may be called with
 * records pending. */
int gmb__cuda_event_new(int ordinal, void **ev, char *why, size_t cap);
int gmb__cuda_event_record(int ordinal, void *ev, void *stream, char *why,
                           size_t cap);
int gmb__cuda_event_query(int ordinal, void *ev);
void gmb__cuda_event_destroy(int ordinal, void *ev);

/* The UUID ("GPU-...") of this process's GPU `ordinal`, through the
 * driver (loaded here if need be).  0, or GMB_E_DEVICE explained (no
 * driver, no such ordinal, a fork child). */
int gmb__cuda_uuid_of(int ordinal, char *uuid, size_t ucap, char *why,
                      size_t cap);

/* The calling thread's current device as this process numbers it: the
 * device of its current context (cuCtxGetDevice), or 0 when it has none
 * (the device the CUDA runtime uses then).  0 or GMB_E_DEVICE explained. */
int gmb__cuda_current(int *ordinal, char *why, size_t cap);

/* Host functions enqueued and not yet run (for tests). */
uint64_t gmb__cuda_pending(void);

#endif /* GMB_CUIMPORT_H */
