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

/*
 * Loads the driver, retains device 0's primary context and reads its
 * allocation granularity, once per process, and makes that context
 * current on a calling thread that has none (one with a context of its
 * own keeps it).  A failure is not remembered (the
 * next call tries again).  0, or GMB_E_DEVICE with one line in `why`
 * naming the library or the call that failed.
 */
int gmb__cuda_attach(char *why, size_t cap);

/*
 * Imports the allocation descriptor `fd` names (a POSIX fd exported by the
 * broker; the caller keeps it and closes it) and maps all `size` bytes of
 * it in the primary context: cuMemImportFromShareableHandle, a reservation
 * of `size` bytes aligned to the allocation granularity
 * (cuMemAddressReserve), cuMemMap, read/write access for the device
 * (cuMemSetAccess), then cuMemRelease of the handle (the mapping keeps the
 * memory).  0 with *base set to the device address; GMB_E_PROTO for a
 * descriptor or size that cannot be a segment (fd < 0, size 0 or not a
 * multiple of the granularity); GMB_E_DEVICE when the driver refuses (the
 * call is named in `why`).  No de-duplication: two imports of one
 * allocation in one process are two mappings, each closed on its own.
 */
int gmb__cuda_import(int fd, uint64_t size, uint64_t *base, char *why,
                     size_t cap);

/* Unmaps an import made by gmb__cuda_import (cuMemUnmap, then
 * cuMemAddressFree of its `size` bytes at `base`).  A failure is dropped:
 * there is nothing the caller could do about it. */
void gmb__cuda_close(uint64_t base, uint64_t size);

/*
 * Enqueues on `stream` (NULL: the legacy default stream) a host function
 * that gives back one hold of the lock-table word `state` when the stream
 * reaches it.  The word must stay mapped until the function ran: see
 * gmb__cuda_unmap_later.  0, or GMB_E_DEVICE (explained) when the driver
 * refused; the hold is then still taken.
 */
int gmb__cuda_release_on_stream(_Atomic uint32_t *state, void *stream,
                                char *why, size_t cap);

/*
 * Unmaps [p, p+len) (a lock table) now when no host function of
 * gmb__cuda_release_on_stream is pending in this process, else as soon as
 * none is (checked at the next attach or unmap_later).
 */
void gmb__cuda_unmap_later(void *p, size_t len);

/* Host functions enqueued and not yet run (for tests). */
uint64_t gmb__cuda_pending(void);

#endif /* GMB_CUIMPORT_H */
