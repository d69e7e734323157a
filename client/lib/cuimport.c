/*
 * cuimport.c - the client library's side of the CUDA device: the driver, the
 * primary context, imports of segments from their descriptors and
 * stream-ordered releases (cuimport.h).
 *
 * All state is per process and lives for the life of the process once the
 * driver is loaded: the driver is never unloaded and the primary context
 * never released, because host functions may still be queued on streams
 * (their code and data must stay), because re-creating a primary context
 * costs hundreds of milliseconds, and because the application's own CUDA
 * code shares that context.  `cuda_mu` guards everything but the pending
 * counter; it is a leaf lock (nothing else is taken under it), and the
 * hot paths (gmb_lock, gmb_unlock) never reach this file.
 *
 * Contexts.  Imports are made and closed in device 0's primary context,
 * the one the CUDA runtime (PyTorch, CuPy) uses, so a pointer gmb_lock
 * returns is valid in the application's kernels.  A thread with no
 * current context is left with the primary one current (what the runtime
 * would do on its first call); a thread that has another context current
 * gets it back after the call.
 *
 * Imports.  A segment comes as a POSIX file descriptor of the broker's
 * cuMemCreate allocation.  Importing it gives a handle; the library
 * reserves a range of device addresses, maps the handle there, grants the
 * device read/write access and releases the handle at once, so that the
 * mapping is the only reference this process keeps: unmapping it (close)
 * is all it takes to give the memory back, and a process that dies with
 * it mapped gives it back too.  The driver counts references to physical
 * memory across processes, so the broker may release its own at any time
 * without this mapping becoming undefined.  Imports are not shared: the
 * driver allows one allocation to be mapped twice in a process, and the
 * caller (segmap.c) keeps one mapping per segment per client.
 *
 * Stream releases.  The host function given to cuLaunchHostFunc runs on a
 * driver thread, later, perhaps after the client is gone.  It may not call
 * CUDA, take the library's locks or allocate, so it does two atomic
 * operations: it gives back the hold on the lock-table word it was given
 * and decrements `cuda_pending`, a process-wide count of functions queued
 * and not run.  A lock table must stay mapped while any function that
 * points into it may run: gmb_disconnect hands its table to
 * gmb__cuda_unmap_later, which unmaps it once the count has been seen at
 * 0 (every function queued before the disconnect has then run).
 */
#include "cuimport.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/mman.h>

#include "cudrv.h"
#include "gmb.h"
#include "locktab_layout.h"

struct cuda_unmap {
  struct cuda_unmap *next;
  void *p;
  size_t len;
};

static pthread_mutex_t cuda_mu = PTHREAD_MUTEX_INITIALIZER;
static struct gmb_cudrv cuda_drv;
static int cuda_ready; /* under cuda_mu; set once, never cleared */
static pid_t cuda_pid;  /* the process that attached */
static gmb_cu_device cuda_dev;
static gmb_cu_ctx cuda_ctx;
static uint64_t cuda_granularity; /* for device 0's segments; set with ready */
static struct cuda_unmap *cuda_unmaps;
static _Atomic uint64_t cuda_pending;

static void cuda_err(gmb_cu_result r, const char *call, char *why,
                     size_t cap) {
  char buf[160];
  snprintf(why, cap, "%s: %s", call,
           gmb__cudrv_strerror(&cuda_drv, r, buf, sizeof buf));
}

/* Unmaps the deferred lock tables when no host function is pending.  The
 * acquire load pairs with the functions' release decrements, so their
 * last accesses to a table happen before its munmap.  Under cuda_mu. */
static void cuda_sweep(void) {
  if (cuda_unmaps == NULL ||
      atomic_load_explicit(&cuda_pending, memory_order_acquire) != 0)
    return;
  while (cuda_unmaps) {
    struct cuda_unmap *u = cuda_unmaps;
    cuda_unmaps = u->next;
    munmap(u->p, u->len);
    free(u);
  }
}

/* Makes the primary context current for an import or a close; *prev is
 * what to give back to cuda_leave.  Under cuda_mu, once cuda_ctx is
 * retained. */
static gmb_cu_result cuda_enter(gmb_cu_ctx *prev) {
  if (cuda_drv.cuCtxGetCurrent(prev) != GMB_CU_SUCCESS) *prev = NULL;
  if (*prev == cuda_ctx) return GMB_CU_SUCCESS;
  return cuda_drv.cuCtxSetCurrent(cuda_ctx);
}

static void cuda_leave(gmb_cu_ctx prev) {
  if (prev != NULL && prev != cuda_ctx) cuda_drv.cuCtxSetCurrent(prev);
}

int gmb__cuda_attach(char *why, size_t cap) {
  pthread_mutex_lock(&cuda_mu);
  cuda_sweep();
  int rc = 0;
  /* A child forked after its parent attached inherits cuda_ready, but
   * CUDA does not work in it (the driver refuses every call): say why at
   * connect rather than at the first import. */
  if (cuda_ready && cuda_pid != getpid()) {
    snprintf(why, cap, "this process was forked after CUDA started in its "
             "parent, and CUDA does not work in such a child: fork before "
             "any CUDA call, or exec");
    pthread_mutex_unlock(&cuda_mu);
    return GMB_E_DEVICE;
  }
  if (cuda_ready) goto out;
  char err[256];
  rc = gmb__cudrv_load(&cuda_drv, err, sizeof err);
  if (rc) {
    snprintf(why, cap, "%s", err);
    rc = GMB_E_DEVICE;
    goto out;
  }
  /* Ordinal 0 for now: the broker's device index (its --device cuda:N,
   * as this process numbers devices, which CUDA_VISIBLE_DEVICES may
   * change) should travel in the Hello reply so that the client imports
   * into the right device's context. */
  gmb_cu_result r = cuda_drv.cuDeviceGet(&cuda_dev, 0);
  if (r == GMB_CU_SUCCESS) {
    r = cuda_drv.cuDevicePrimaryCtxRetain(&cuda_ctx, cuda_dev);
    if (r != GMB_CU_SUCCESS) cuda_err(r, "cuDevicePrimaryCtxRetain", why, cap);
  } else {
    cuda_err(r, "cuDeviceGet(0)", why, cap);
  }
  if (r == GMB_CU_SUCCESS) {
    /* Imports reserve address ranges aligned to it. */
    struct gmb_cu_mem_prop prop;
    memset(&prop, 0, sizeof prop);
    prop.type = GMB_CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requested_handle_types = GMB_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    prop.location.type = GMB_CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    size_t g = 0;
    gmb_cu_ctx prev;
    r = cuda_enter(&prev);
    if (r == GMB_CU_SUCCESS)
      r = cuda_drv.cuMemGetAllocationGranularity(
          &g, &prop, GMB_CU_MEM_ALLOC_GRANULARITY_MINIMUM);
    cuda_leave(prev);
    if (r != GMB_CU_SUCCESS) {
      cuda_err(r, "cuMemGetAllocationGranularity", why, cap);
    } else if (g == 0) {
      snprintf(why, cap, "cuMemGetAllocationGranularity: 0");
      r = GMB_CU_ERROR_NOT_SUPPORTED;
    }
    cuda_granularity = g;
    if (r != GMB_CU_SUCCESS) cuda_drv.cuDevicePrimaryCtxRelease(cuda_dev);
  }
  if (r != GMB_CU_SUCCESS) {
    gmb__cudrv_unload(&cuda_drv);
    rc = GMB_E_DEVICE;
    goto out;
  }
  cuda_ready = 1;
  cuda_pid = getpid();
out:
  if (rc == 0) {
    /* The connecting thread may go on with driver calls of its own on
     * the pointers gmb_lock gives: without a context they would fail. */
    gmb_cu_ctx cur = NULL;
    if (cuda_drv.cuCtxGetCurrent(&cur) == GMB_CU_SUCCESS && cur == NULL)
      cuda_drv.cuCtxSetCurrent(cuda_ctx);
  }
  pthread_mutex_unlock(&cuda_mu);
  return rc;
}

int gmb__cuda_import(int fd, uint64_t size, uint64_t *base, char *why,
                     size_t cap) {
  pthread_mutex_lock(&cuda_mu);
  int rc = 0;
  if (!cuda_ready) { /* the client attaches at connect; a bug otherwise */
    snprintf(why, cap, "the CUDA driver is not loaded");
    rc = GMB_E_DEVICE;
    goto out;
  }
  if (fd < 0) {
    snprintf(why, cap, "no descriptor for the segment");
    rc = GMB_E_PROTO;
    goto out;
  }
  if (size == 0 || size > SIZE_MAX || size % cuda_granularity != 0) {
    snprintf(why, cap, "a segment of %llu bytes is not a multiple of the "
             "allocation granularity %llu", (unsigned long long)size,
             (unsigned long long)cuda_granularity);
    rc = GMB_E_PROTO;
    goto out;
  }
  gmb_cu_ctx prev;
  gmb_cu_mem_handle h = 0;
  gmb_cu_ptr va = 0;
  int imported = 0, reserved = 0, mapped = 0;
  const char *step = "cuCtxSetCurrent";
  gmb_cu_result r = cuda_enter(&prev);
  if (r == GMB_CU_SUCCESS) {
    step = "cuMemImportFromShareableHandle";
    r = cuda_drv.cuMemImportFromShareableHandle(
        &h, (void *)(uintptr_t)fd, GMB_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  }
  if (r == GMB_CU_SUCCESS) {
    imported = 1;
    step = "cuMemAddressReserve";
    r = cuda_drv.cuMemAddressReserve(&va, (size_t)size,
                                     (size_t)cuda_granularity, 0, 0);
  }
  if (r == GMB_CU_SUCCESS) {
    reserved = 1;
    step = "cuMemMap";
    r = cuda_drv.cuMemMap(va, (size_t)size, 0, h, 0);
  }
  if (r == GMB_CU_SUCCESS) {
    mapped = 1;
    struct gmb_cu_access_desc rw = {{GMB_CU_MEM_LOCATION_TYPE_DEVICE, 0},
                                    GMB_CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    step = "cuMemSetAccess";
    r = cuda_drv.cuMemSetAccess(va, (size_t)size, &rw, 1);
  }
  if (r == GMB_CU_SUCCESS) {
    imported = 0; /* the mapping keeps the memory */
    step = "cuMemRelease";
    r = cuda_drv.cuMemRelease(h);
  }
  if (r != GMB_CU_SUCCESS) {
    cuda_err(r, step, why, cap);
    if (mapped) cuda_drv.cuMemUnmap(va, (size_t)size);
    if (reserved) cuda_drv.cuMemAddressFree(va, (size_t)size);
    if (imported) cuda_drv.cuMemRelease(h);
    rc = GMB_E_DEVICE;
  } else {
    *base = va;
  }
  cuda_leave(prev);
out:
  pthread_mutex_unlock(&cuda_mu);
  return rc;
}

void gmb__cuda_close(uint64_t base, uint64_t size) {
  pthread_mutex_lock(&cuda_mu);
  gmb_cu_ctx prev;
  if (cuda_ready && cuda_enter(&prev) == GMB_CU_SUCCESS) {
    if (cuda_drv.cuMemUnmap(base, (size_t)size) == GMB_CU_SUCCESS)
      cuda_drv.cuMemAddressFree(base, (size_t)size);
    cuda_leave(prev);
  }
  pthread_mutex_unlock(&cuda_mu);
}

/* Runs on a driver thread when the stream reaches it: no CUDA, no locks,
 * no allocation.  Gives back one hold the way gmb_unlock does (release,
 * never below 0), then says it ran. */
static void cuda_release_fn(void *arg) {
  _Atomic uint32_t *state = arg;
  uint32_t st = atomic_load_explicit(state, memory_order_relaxed);
  while (st != 0 && st <= GMB_LT_MAX_HOLDERS &&
         !atomic_compare_exchange_weak_explicit(state, &st, st - 1,
                                                memory_order_release,
                                                memory_order_relaxed)) {
  }
  atomic_fetch_sub_explicit(&cuda_pending, 1, memory_order_release);
}

int gmb__cuda_release_on_stream(_Atomic uint32_t *state, void *stream,
                                char *why, size_t cap) {
  /* Not under cuda_mu: the launch is the caller's hot-ish path, and the
   * driver table is immutable once cuda_ready was seen (the client
   * attached at connect, under the mutex, before it could get here). */
  gmb_cu_ctx cur = NULL;
  gmb_cu_result r = cuda_drv.cuCtxGetCurrent(&cur);
  /* A thread without a context gets the primary one, as the runtime
   * would give it; one with a context keeps it, since the stream is
   * probably its own. */
  if (r == GMB_CU_SUCCESS && cur == NULL) r = cuda_drv.cuCtxSetCurrent(cuda_ctx);
  if (r != GMB_CU_SUCCESS) {
    cuda_err(r, "cuCtxSetCurrent", why, cap);
    return GMB_E_DEVICE;
  }
  /* Counted before the launch: the function may run before it returns. */
  atomic_fetch_add_explicit(&cuda_pending, 1, memory_order_relaxed);
  r = cuda_drv.cuLaunchHostFunc((gmb_cu_stream)stream, cuda_release_fn,
                                (void *)state);
  if (r != GMB_CU_SUCCESS) {
    atomic_fetch_sub_explicit(&cuda_pending, 1, memory_order_relaxed);
    cuda_err(r, "cuLaunchHostFunc", why, cap);
    return GMB_E_DEVICE;
  }
  return 0;
}

void gmb__cuda_unmap_later(void *p, size_t len) {
  pthread_mutex_lock(&cuda_mu);
  struct cuda_unmap *u = malloc(sizeof *u);
  if (u) {
    u->p = p;
    u->len = len;
    u->next = cuda_unmaps;
    cuda_unmaps = u;
  }
  /* Without memory to remember it, the table is left mapped for good:
   * a leak of address space is better than a host function writing into
   * an unmapped page of the application. */
  cuda_sweep();
  pthread_mutex_unlock(&cuda_mu);
}

uint64_t gmb__cuda_pending(void) {
  return atomic_load_explicit(&cuda_pending, memory_order_acquire);
}
