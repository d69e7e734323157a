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
 * Devices.  A broker names its GPU by UUID (the Hello reply); ordinals
 * differ between processes (CUDA_VISIBLE_DEVICES, containers), so
 * gmb__cuda_attach looks for the ordinal of this process whose
 * cuDeviceGetUuid is that UUID, and refuses when none is: importing on
 * another GPU would fail or, worse, map remote memory over the bus.  Each
 * device a session uses gets its record here (primary context,
 * granularity), kept for the life of the process.
 *
 * Contexts.  Imports are made and closed in that device's primary
 * context, the one the CUDA runtime (PyTorch, CuPy) uses, so a pointer
 * gmb_lock returns is valid in the application's kernels.  A thread gets
 * back the context it had after each call, none included: gmb never
 * leaves a context current behind the program's back (the runtime's
 * device, and so the shims' routing, would change).
 *
 * Graph capture.  Every driver call gmb makes for itself runs in the
 * relaxed capture mode (cuThreadExchangeStreamCaptureMode, given back
 * after the call), so that an application's capture, on this thread or
 * another, neither refuses nor is invalidated by gmb's imports, maps,
 * unmaps and event queries (the library's background thread included).
 * No event is recorded on a capturing stream (its query would be
 * illegal), and a stream the driver answers
 * CUDA_ERROR_STREAM_CAPTURE_IMPLICIT for counts as capturing.
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
 * Other contexts.  A program may run kernels on gmb's memory in contexts
 * of its own (cuCtxCreate), not only in the primary one: the mapping is
 * the process's, valid in every context of the device.  A free must wait
 * for them too, as cudaFree waits for the device, so the library notes
 * each context of a device it sees current on a thread that calls it
 * (connect, imports and maps, stream releases, frees) and gmb__cuda_sync
 * synchronises the primary context and every noted one; a noted context
 * since destroyed is forgotten there.  At most CUDA_MAX_SEEN per device:
 * past that the oldest note gives way.  A context that never was current
 * on a thread calling gmb is not known, so not waited for (docs/cache.md).
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

/* One device this process imports on, by its ordinal here. */
struct cuda_dev {
  int ready; /* retained; set once, never cleared */
  gmb_cu_device dev;
  gmb_cu_ctx ctx;
  uint64_t granularity;
};

static pthread_mutex_t cuda_mu = PTHREAD_MUTEX_INITIALIZER;
static struct gmb_cudrv cuda_drv;
static int cuda_loaded; /* under cuda_mu; set once, never cleared */
static pid_t cuda_pid;  /* the process that loaded the driver */
static struct cuda_dev cuda_devs[GMB_CUDA_MAX_DEVICES];
static struct cuda_unmap *cuda_unmaps;
static _Atomic uint64_t cuda_pending;

/* The contexts other than the primary ones noted on each device, for
 * gmb__cuda_sync.  Its own leaf lock: taken under cuda_mu or alone, and
 * never across a driver call that waits. */
#define CUDA_MAX_SEEN 16
static pthread_mutex_t cuda_seen_mu = PTHREAD_MUTEX_INITIALIZER;
static struct cuda_seen {
  gmb_cu_ctx ctx[CUDA_MAX_SEEN]; /* NULL: free */
  unsigned next;                 /* the slot to give way when all are used */
} cuda_seen[GMB_CUDA_MAX_DEVICES];

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

/* The record of an attached ordinal, or NULL (a caller's bug: every
 * ordinal the library passes came from gmb__cuda_attach). */
static struct cuda_dev *cuda_dev_of(int ordinal) {
  if (ordinal < 0 || ordinal >= GMB_CUDA_MAX_DEVICES) return NULL;
  struct cuda_dev *d = &cuda_devs[ordinal];
  return __atomic_load_n(&d->ready, __ATOMIC_ACQUIRE) ? d : NULL;
}

/* As cuda_dev_of, with the reason in why when the ordinal is not
 * attached. */
static const struct cuda_dev *cuda_dev_attached(int ordinal, char *why,
                                                size_t cap) {
  const struct cuda_dev *d = cuda_dev_of(ordinal);
  if (d == NULL)
    snprintf(why, cap, "CUDA device %d is not attached", ordinal);
  return d;
}

/* Notes `ctx`, current on the calling thread, as a context that may use
 * device d's memory: it is one of d's and not its primary context. */
static void cuda_seen_note(const struct cuda_dev *d, gmb_cu_ctx ctx) {
  if (ctx == NULL || ctx == d->ctx) return;
  struct cuda_seen *s = &cuda_seen[d - cuda_devs];
  pthread_mutex_lock(&cuda_seen_mu);
  int known = 0;
  for (int i = 0; i < CUDA_MAX_SEEN && !known; i++) known = s->ctx[i] == ctx;
  pthread_mutex_unlock(&cuda_seen_mu);
  gmb_cu_device dev;
  if (known || cuda_drv.cuCtxGetDevice(&dev) != GMB_CU_SUCCESS ||
      dev != d->dev)
    return;
  pthread_mutex_lock(&cuda_seen_mu);
  int slot = -1;
  for (int i = 0; i < CUDA_MAX_SEEN; i++) {
    if (s->ctx[i] == ctx) {
      slot = -2; /* another thread noted it meanwhile */
      break;
    }
    if (slot == -1 && s->ctx[i] == NULL) slot = i;
  }
  if (slot == -1) slot = (int)(s->next++ % CUDA_MAX_SEEN);
  if (slot >= 0) s->ctx[slot] = ctx;
  pthread_mutex_unlock(&cuda_seen_mu);
}

static void cuda_seen_forget(const struct cuda_dev *d, gmb_cu_ctx ctx) {
  struct cuda_seen *s = &cuda_seen[d - cuda_devs];
  pthread_mutex_lock(&cuda_seen_mu);
  for (int i = 0; i < CUDA_MAX_SEEN; i++)
    if (s->ctx[i] == ctx) s->ctx[i] = NULL;
  pthread_mutex_unlock(&cuda_seen_mu);
}

/* What cuda_leave gives back: the thread's context and capture mode. */
struct cuda_scope {
  gmb_cu_ctx ctx;
  int mode;
  int mode_set;
};

/* Relaxed capture mode for gmb's own calls on this thread; *mode_set says
 * to give the previous mode back.  An application thread may be
 * capturing a graph (or another thread may, in the global mode): gmb's
 * imports, maps and event queries are then "potentially unsafe" calls the
 * driver refuses, invalidating the capture, unless the calling thread is
 * in the relaxed mode (PyTorch's allocator does the same around its
 * cudaMalloc). */
static void cuda_relax(int *mode, int *mode_set) {
  *mode = GMB_CU_STREAM_CAPTURE_MODE_RELAXED;
  *mode_set = cuda_drv.cuThreadExchangeStreamCaptureMode(mode) ==
              GMB_CU_SUCCESS;
}

static void cuda_unrelax(int mode, int mode_set) {
  if (mode_set) cuda_drv.cuThreadExchangeStreamCaptureMode(&mode);
}

/* Makes the device's primary context current for a call, in the relaxed
 * capture mode; *prev is what to give back to cuda_leave after a
 * success.  On failure the thread is as it was (a cuda_leave then is
 * harmless).  Once the device is ready. */
static gmb_cu_result cuda_enter(const struct cuda_dev *d,
                                struct cuda_scope *prev) {
  cuda_relax(&prev->mode, &prev->mode_set);
  if (cuda_drv.cuCtxGetCurrent(&prev->ctx) != GMB_CU_SUCCESS) prev->ctx = NULL;
  if (prev->ctx == d->ctx) return GMB_CU_SUCCESS;
  cuda_seen_note(d, prev->ctx);
  gmb_cu_result r = cuda_drv.cuCtxSetCurrent(d->ctx);
  if (r != GMB_CU_SUCCESS) {
    cuda_unrelax(prev->mode, prev->mode_set);
    prev->mode_set = 0;
    prev->ctx = d->ctx; /* nothing for cuda_leave to give back */
  }
  return r;
}

/* Gives the thread back its context (none, when it had none: no context
 * is left current behind the program's back) and its capture mode. */
static void cuda_leave(const struct cuda_dev *d, struct cuda_scope prev) {
  if (prev.ctx != d->ctx) cuda_drv.cuCtxSetCurrent(prev.ctx);
  cuda_unrelax(prev.mode, prev.mode_set);
}

/* Finds the ordinal whose UUID is `uuid`; under cuda_mu, driver loaded.
 * 0 with *ordinal, or GMB_E_DEVICE explained (the GPUs seen listed). */
static int cuda_find(const char *uuid, int *ordinal, char *why, size_t cap) {
  int n = 0;
  gmb_cu_result r = cuda_drv.cuDeviceGetCount(&n);
  if (r != GMB_CU_SUCCESS) {
    cuda_err(r, "cuDeviceGetCount", why, cap);
    return GMB_E_DEVICE;
  }
  char seen[512] = "";
  size_t used = 0;
  for (int i = 0; i < n; i++) {
    gmb_cu_device dev;
    struct gmb_cu_uuid u;
    char s[GMB_CU_UUID_STR];
    if (cuda_drv.cuDeviceGet(&dev, i) != GMB_CU_SUCCESS ||
        cuda_drv.cuDeviceGetUuid(&u, dev) != GMB_CU_SUCCESS)
      continue;
    gmb__cudrv_uuid_str(&u, s, sizeof s);
    if (strcmp(s, uuid) == 0) {
      if (i >= GMB_CUDA_MAX_DEVICES) break;
      *ordinal = i;
      return 0;
    }
    if (used < sizeof seen) {
      int k = snprintf(seen + used, sizeof seen - used, "%s%d=%s",
                       used ? ", " : "", i, s);
      if (k > 0) used += (size_t)k;
    }
  }
  snprintf(why, cap, "the broker's GPU %s is not visible to this process "
           "(it sees %d GPU%s%s%s%s); check CUDA_VISIBLE_DEVICES / "
           "NVIDIA_VISIBLE_DEVICES, or connect to the broker of a GPU it "
           "sees", uuid, n, n == 1 ? "" : "s", n ? ": " : "", seen,
           used >= sizeof seen ? "..." : "");
  return GMB_E_DEVICE;
}

/* Retains ordinal `o`'s primary context and reads its granularity; under
 * cuda_mu. */
static int cuda_dev_open(int o, char *why, size_t cap) {
  struct cuda_dev *d = &cuda_devs[o];
  if (d->ready) return 0;
  gmb_cu_result r = cuda_drv.cuDeviceGet(&d->dev, o);
  if (r != GMB_CU_SUCCESS) {
    cuda_err(r, "cuDeviceGet", why, cap);
    return GMB_E_DEVICE;
  }
  r = cuda_drv.cuDevicePrimaryCtxRetain(&d->ctx, d->dev);
  if (r != GMB_CU_SUCCESS) {
    cuda_err(r, "cuDevicePrimaryCtxRetain", why, cap);
    return GMB_E_DEVICE;
  }
  /* Imports reserve address ranges aligned to it. */
  struct gmb_cu_mem_prop prop;
  memset(&prop, 0, sizeof prop);
  prop.type = GMB_CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.requested_handle_types = GMB_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  prop.location.type = GMB_CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = o;
  size_t g = 0;
  struct cuda_scope prev;
  r = cuda_enter(d, &prev);
  if (r == GMB_CU_SUCCESS)
    r = cuda_drv.cuMemGetAllocationGranularity(
        &g, &prop, GMB_CU_MEM_ALLOC_GRANULARITY_MINIMUM);
  cuda_leave(d, prev);
  if (r != GMB_CU_SUCCESS) {
    cuda_err(r, "cuMemGetAllocationGranularity", why, cap);
  } else if (g == 0) {
    snprintf(why, cap, "cuMemGetAllocationGranularity: 0");
    r = GMB_CU_ERROR_NOT_SUPPORTED;
  }
  if (r != GMB_CU_SUCCESS) {
    cuda_drv.cuDevicePrimaryCtxRelease(d->dev);
    return GMB_E_DEVICE;
  }
  d->granularity = g;
  __atomic_store_n(&d->ready, 1, __ATOMIC_RELEASE);
  return 0;
}

int gmb__cuda_attach(const char *uuid, int *ordinal, char *why, size_t cap) {
  pthread_mutex_lock(&cuda_mu);
  cuda_sweep();
  int rc = 0;
  /* A child forked after its parent attached inherits cuda_loaded, but
   * CUDA does not work in it (the driver refuses every call): say why at
   * connect rather than at the first import. */
  if (cuda_loaded && cuda_pid != getpid()) {
    snprintf(why, cap, "this process was forked after CUDA started in its "
             "parent, and CUDA does not work in such a child: fork before "
             "any CUDA call, or exec");
    pthread_mutex_unlock(&cuda_mu);
    return GMB_E_DEVICE;
  }
  if (uuid == NULL || strncmp(uuid, "GPU-", 4) != 0) {
    snprintf(why, cap, "the broker did not say which GPU it serves (no GPU "
             "UUID in its Hello reply): an older broker? Imports on a GPU "
             "guessed by ordinal could land on another one");
    pthread_mutex_unlock(&cuda_mu);
    return GMB_E_DEVICE;
  }
  if (!cuda_loaded) {
    char err[256];
    rc = gmb__cudrv_load(&cuda_drv, err, sizeof err);
    if (rc) {
      snprintf(why, cap, "%s", err);
      rc = GMB_E_DEVICE;
      goto out;
    }
    cuda_loaded = 1;
    cuda_pid = getpid();
  }
  int o = -1;
  rc = cuda_find(uuid, &o, why, cap);
  if (rc == 0) rc = cuda_dev_open(o, why, cap);
  /* The calling thread keeps the context it had, none included: making
   * one current behind the program's back would change the device its
   * next CUDA runtime call (and the shims' routing) sees. */
  if (rc == 0) {
    *ordinal = o;
    gmb_cu_ctx cur = NULL;
    if (cuda_drv.cuCtxGetCurrent(&cur) == GMB_CU_SUCCESS)
      cuda_seen_note(&cuda_devs[o], cur);
  }
out:
  pthread_mutex_unlock(&cuda_mu);
  return rc;
}

/* Checks a size to map: a non-zero multiple of the device's granularity.
 * 0 or GMB_E_PROTO explained. */
static int cuda_size_ok(const struct cuda_dev *d, uint64_t size, char *why,
                        size_t cap) {
  if (size != 0 && size <= SIZE_MAX && size % d->granularity == 0) return 0;
  snprintf(why, cap, "a segment of %llu bytes is not a multiple of the "
           "allocation granularity %llu", (unsigned long long)size,
           (unsigned long long)d->granularity);
  return GMB_E_PROTO;
}

int gmb__cuda_reserve(int ordinal, uint64_t size, uint64_t *base, char *why,
                      size_t cap) {
  pthread_mutex_lock(&cuda_mu);
  const struct cuda_dev *d = cuda_dev_attached(ordinal, why, cap);
  int rc = d ? cuda_size_ok(d, size, why, cap) : GMB_E_DEVICE;
  if (rc == 0) {
    struct cuda_scope prev;
    gmb_cu_ptr va = 0;
    const char *step = "cuCtxSetCurrent";
    gmb_cu_result r = cuda_enter(d, &prev);
    if (r == GMB_CU_SUCCESS) {
      step = "cuMemAddressReserve";
      r = cuda_drv.cuMemAddressReserve(&va, (size_t)size,
                                       (size_t)d->granularity, 0, 0);
      cuda_leave(d, prev);
    }
    if (r != GMB_CU_SUCCESS) {
      cuda_err(r, step, why, cap);
      rc = r == GMB_CU_ERROR_OUT_OF_MEMORY ? GMB_E_NOMEM : GMB_E_DEVICE;
    } else {
      *base = va;
    }
  }
  pthread_mutex_unlock(&cuda_mu);
  return rc;
}

void gmb__cuda_unreserve(int ordinal, uint64_t base, uint64_t size) {
  pthread_mutex_lock(&cuda_mu);
  struct cuda_scope prev;
  const struct cuda_dev *d = cuda_dev_of(ordinal);
  if (d && cuda_enter(d, &prev) == GMB_CU_SUCCESS) {
    cuda_drv.cuMemAddressFree(base, (size_t)size);
    cuda_leave(d, prev);
  }
  pthread_mutex_unlock(&cuda_mu);
}

/* Who may use a mapping of device `ordinal`'s memory: that device, and
 * with $GMB_PEER_ACCESS=1 every other device of this process that can
 * reach it (cuDeviceCanAccessPeer).  Memory of the virtual memory API is
 * reachable only from the devices cuMemSetAccess names: a program's
 * cuCtxEnablePeerAccess does not extend to it, so a program whose kernels
 * on one GPU read another's gmb memory sets the variable.  Returns the
 * count of descriptors in out.  Under cuda_mu. */
static size_t cuda_access_list(const struct cuda_dev *d, int ordinal,
                               struct gmb_cu_access_desc *out) {
  size_t n = 0;
  out[n].location.type = GMB_CU_MEM_LOCATION_TYPE_DEVICE;
  out[n].location.id = ordinal;
  out[n++].flags = GMB_CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  const char *v = getenv("GMB_PEER_ACCESS");
  int count = 0;
  if (!v || strcmp(v, "1") != 0 ||
      cuda_drv.cuDeviceGetCount(&count) != GMB_CU_SUCCESS)
    return n;
  for (int i = 0; i < count && i < GMB_CUDA_MAX_DEVICES; i++) {
    gmb_cu_device peer;
    int can = 0;
    if (i == ordinal || cuda_drv.cuDeviceGet(&peer, i) != GMB_CU_SUCCESS ||
        cuda_drv.cuDeviceCanAccessPeer(&can, peer, d->dev) != GMB_CU_SUCCESS ||
        !can)
      continue;
    out[n].location.type = GMB_CU_MEM_LOCATION_TYPE_DEVICE;
    out[n].location.id = i;
    out[n++].flags = GMB_CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  }
  return n;
}

/* Maps handle h at [addr, addr+size) with read/write access for device d.
 * Under cuda_mu, in d's context.  On failure nothing stays mapped and
 * `step` names the call. */
static gmb_cu_result cuda_map_locked(const struct cuda_dev *d, int ordinal,
                                     gmb_cu_ptr addr, uint64_t size,
                                     gmb_cu_mem_handle h, const char **step) {
  *step = "cuMemMap";
  gmb_cu_result r = cuda_drv.cuMemMap(addr, (size_t)size, 0, h, 0);
  if (r != GMB_CU_SUCCESS) return r;
  struct gmb_cu_access_desc rw[GMB_CUDA_MAX_DEVICES];
  size_t n = cuda_access_list(d, ordinal, rw);
  *step = "cuMemSetAccess";
  r = cuda_drv.cuMemSetAccess(addr, (size_t)size, rw, n);
  if (r != GMB_CU_SUCCESS) cuda_drv.cuMemUnmap(addr, (size_t)size);
  return r;
}

int gmb__cuda_map_at(int ordinal, int fd, uint64_t addr, uint64_t size,
                     int keep, uint64_t *handle, char *why, size_t cap) {
  pthread_mutex_lock(&cuda_mu);
  int rc = 0;
  const struct cuda_dev *d = cuda_dev_attached(ordinal, why, cap);
  if (d == NULL) {
    rc = GMB_E_DEVICE;
    goto out;
  }
  if (fd < 0) {
    snprintf(why, cap, "no descriptor for the segment");
    rc = GMB_E_PROTO;
    goto out;
  }
  if ((rc = cuda_size_ok(d, size, why, cap)) != 0) goto out;
  struct cuda_scope prev;
  gmb_cu_mem_handle h = 0;
  const char *step = "cuCtxSetCurrent";
  gmb_cu_result r = cuda_enter(d, &prev);
  if (r == GMB_CU_SUCCESS) {
    step = "cuMemImportFromShareableHandle";
    r = cuda_drv.cuMemImportFromShareableHandle(
        &h, (void *)(uintptr_t)fd, GMB_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    if (r == GMB_CU_SUCCESS) {
      r = cuda_map_locked(d, ordinal, addr, size, h, &step);
      /* Kept for a later move, or released now: the mapping keeps the
       * memory either way. */
      if (r != GMB_CU_SUCCESS || !keep) {
        gmb_cu_result rr = cuda_drv.cuMemRelease(h);
        if (r == GMB_CU_SUCCESS && rr != GMB_CU_SUCCESS) {
          cuda_drv.cuMemUnmap(addr, (size_t)size);
          r = rr;
          step = "cuMemRelease";
        }
        h = 0;
      }
    }
    cuda_leave(d, prev);
  }
  if (r != GMB_CU_SUCCESS) {
    cuda_err(r, step, why, cap);
    rc = GMB_E_DEVICE;
  } else if (handle) {
    *handle = (uint64_t)h;
  }
out:
  pthread_mutex_unlock(&cuda_mu);
  return rc;
}

void gmb__cuda_unmap_at(int ordinal, uint64_t addr, uint64_t size,
                        uint64_t handle) {
  pthread_mutex_lock(&cuda_mu);
  struct cuda_scope prev;
  const struct cuda_dev *d = cuda_dev_of(ordinal);
  if (d && cuda_enter(d, &prev) == GMB_CU_SUCCESS) {
    cuda_drv.cuMemUnmap(addr, (size_t)size);
    if (handle) cuda_drv.cuMemRelease((gmb_cu_mem_handle)handle);
    cuda_leave(d, prev);
  }
  pthread_mutex_unlock(&cuda_mu);
}

int gmb__cuda_move(int ordinal, uint64_t from, uint64_t to, uint64_t size,
                   uint64_t handle, char *why, size_t cap) {
  pthread_mutex_lock(&cuda_mu);
  int rc = 0;
  const struct cuda_dev *d = cuda_dev_attached(ordinal, why, cap);
  if (d == NULL || handle == 0) {
    if (d) snprintf(why, cap, "no handle kept for the mapping at %#llx",
                    (unsigned long long)from);
    pthread_mutex_unlock(&cuda_mu);
    return GMB_E_DEVICE;
  }
  struct cuda_scope prev;
  const char *step = "cuCtxSetCurrent";
  gmb_cu_result r = cuda_enter(d, &prev);
  if (r == GMB_CU_SUCCESS) {
    /* Mapped at the new address first, so that a failure leaves the old
     * mapping as it was. */
    r = cuda_map_locked(d, ordinal, to, size, (gmb_cu_mem_handle)handle,
                        &step);
    if (r == GMB_CU_SUCCESS) {
      step = "cuMemUnmap";
      r = cuda_drv.cuMemUnmap(from, (size_t)size);
      if (r != GMB_CU_SUCCESS) cuda_drv.cuMemUnmap(to, (size_t)size);
    }
    cuda_leave(d, prev);
  }
  if (r != GMB_CU_SUCCESS) {
    cuda_err(r, step, why, cap);
    rc = GMB_E_DEVICE;
  }
  pthread_mutex_unlock(&cuda_mu);
  return rc;
}

int gmb__cuda_import(int ordinal, int fd, uint64_t size, uint64_t *base,
                     char *why, size_t cap) {
  uint64_t va = 0;
  int rc = gmb__cuda_reserve(ordinal, size, &va, why, cap);
  if (rc) return rc == GMB_E_NOMEM ? GMB_E_DEVICE : rc;
  rc = gmb__cuda_map_at(ordinal, fd, va, size, 0, NULL, why, cap);
  if (rc) {
    gmb__cuda_unreserve(ordinal, va, size);
    return rc;
  }
  *base = va;
  return 0;
}

void gmb__cuda_close(int ordinal, uint64_t base, uint64_t size) {
  gmb__cuda_unmap_at(ordinal, base, size, 0);
  gmb__cuda_unreserve(ordinal, base, size);
}

/* --- graph captures under way: the streams gmb was handed ----------------- */

/* The program's streams gmb was handed (gmb__cuda_stream_note): a ring of
 * distinct handles, the oldest overwritten when full.  cuda_streams_gen
 * changes whenever one is forgotten, so that a thread's note of the last
 * stream it named (cuda_stream_last) is not trusted past it. */
static pthread_mutex_t cuda_streams_mu = PTHREAD_MUTEX_INITIALIZER;
static void *cuda_streams[GMB_CUDA_MAX_STREAMS];
static unsigned cuda_streams_next;
static atomic_uint cuda_streams_gen;
static __thread void *cuda_stream_last;
static __thread unsigned cuda_stream_last_gen;

/* The handles every thread has without creating a stream: the legacy
 * stream (NULL, CU_STREAM_LEGACY) and CU_STREAM_PER_THREAD, which names
 * the calling thread's own stream, not one another thread could ask of. */
static int cuda_stream_builtin(void *stream) {
  return (uintptr_t)stream <= 2;
}

void gmb__cuda_stream_note(void *stream) {
  unsigned gen = atomic_load_explicit(&cuda_streams_gen, memory_order_acquire);
  if (cuda_stream_builtin(stream) ||
      (stream == cuda_stream_last && gen == cuda_stream_last_gen))
    return;
  pthread_mutex_lock(&cuda_streams_mu);
  int known = 0;
  for (int i = 0; i < GMB_CUDA_MAX_STREAMS && !known; i++)
    known = cuda_streams[i] == stream;
  if (!known) {
    int slot = -1;
    for (int i = 0; i < GMB_CUDA_MAX_STREAMS && slot < 0; i++)
      if (cuda_streams[i] == NULL) slot = i;
    if (slot < 0) slot = (int)(cuda_streams_next++ % GMB_CUDA_MAX_STREAMS);
    cuda_streams[slot] = stream;
  }
  pthread_mutex_unlock(&cuda_streams_mu);
  cuda_stream_last = stream;
  cuda_stream_last_gen = gen;
}

static void cuda_stream_forget(void *stream) {
  pthread_mutex_lock(&cuda_streams_mu);
  for (int i = 0; i < GMB_CUDA_MAX_STREAMS; i++)
    if (cuda_streams[i] == stream) cuda_streams[i] = NULL;
  atomic_fetch_add_explicit(&cuda_streams_gen, 1, memory_order_release);
  pthread_mutex_unlock(&cuda_streams_mu);
}

/* 1 when `stream` captures, or its answer cannot rule a capture out; 0
 * when it does not, or the driver no longer knows it (forgotten then).
 * In d's primary context, entered. */
static int cuda_stream_busy(void *stream, char *why, size_t cap) {
  int st = GMB_CU_STREAM_CAPTURE_STATUS_NONE;
  gmb_cu_result r = cuda_drv.cuStreamIsCapturing((gmb_cu_stream)stream, &st);
  if (r == GMB_CU_SUCCESS && st == GMB_CU_STREAM_CAPTURE_STATUS_NONE)
    return 0;
  if (stream != NULL && (r == GMB_CU_ERROR_INVALID_HANDLE ||
                         r == GMB_CU_ERROR_CONTEXT_IS_DESTROYED)) {
    cuda_stream_forget(stream);
    return 0;
  }
  if (r == GMB_CU_SUCCESS)
    snprintf(why, cap, "a CUDA graph capture is underway in this process "
             "(stream %p)", stream);
  else if (r == GMB_CU_ERROR_STREAM_CAPTURE_IMPLICIT)
    snprintf(why, cap, "a CUDA graph capture is underway in this process "
             "(a blocking stream captures: the legacy stream answers "
             "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT)");
  else
    cuda_err(r, "cuStreamIsCapturing (a capture may be underway)", why, cap);
  return 1;
}

int gmb__cuda_capture_underway(int ordinal, char *why, size_t cap) {
  const struct cuda_dev *d = cuda_dev_attached(ordinal, why, cap);
  if (d == NULL) return GMB_E_DEVICE;
  void *streams[GMB_CUDA_MAX_STREAMS];
  pthread_mutex_lock(&cuda_streams_mu);
  memcpy(streams, cuda_streams, sizeof streams);
  pthread_mutex_unlock(&cuda_streams_mu);
  struct cuda_scope prev;
  gmb_cu_result r = cuda_enter(d, &prev);
  if (r != GMB_CU_SUCCESS) {
    cuda_err(r, "cuCtxSetCurrent (a capture may be underway)", why, cap);
    return 1;
  }
  int busy = cuda_stream_busy(NULL, why, cap);
  for (int i = 0; i < GMB_CUDA_MAX_STREAMS && !busy; i++)
    if (streams[i] != NULL) busy = cuda_stream_busy(streams[i], why, cap);
  cuda_leave(d, prev);
  return busy;
}

/* Synchronises each context noted on device d (cuda_seen_note), made
 * current in turn; the primary one is current again after.  A context
 * since destroyed is forgotten (the driver refuses it as such; a handle
 * reused by a context of another device is skipped).  *step names the
 * call that failed. */
static gmb_cu_result cuda_sync_seen(const struct cuda_dev *d,
                                    const char **step) {
  gmb_cu_ctx ctx[CUDA_MAX_SEEN];
  pthread_mutex_lock(&cuda_seen_mu);
  memcpy(ctx, cuda_seen[d - cuda_devs].ctx, sizeof ctx);
  pthread_mutex_unlock(&cuda_seen_mu);
  gmb_cu_result r = GMB_CU_SUCCESS;
  for (int i = 0; i < CUDA_MAX_SEEN && r == GMB_CU_SUCCESS; i++) {
    if (ctx[i] == NULL) continue;
    gmb_cu_device dev;
    *step = "cuCtxSetCurrent (a context of the program's)";
    r = cuda_drv.cuCtxSetCurrent(ctx[i]);
    if (r == GMB_CU_SUCCESS) {
      *step = "cuCtxGetDevice";
      r = cuda_drv.cuCtxGetDevice(&dev);
    }
    if (r == GMB_CU_SUCCESS && dev == d->dev) {
      *step = "cuCtxSynchronize (a context of the program's)";
      r = cuda_drv.cuCtxSynchronize();
    }
    if (r == GMB_CU_ERROR_INVALID_CONTEXT ||
        r == GMB_CU_ERROR_CONTEXT_IS_DESTROYED ||
        (r == GMB_CU_SUCCESS && dev != d->dev)) {
      cuda_seen_forget(d, ctx[i]);
      r = GMB_CU_SUCCESS;
    }
  }
  gmb_cu_result back = cuda_drv.cuCtxSetCurrent(d->ctx);
  if (r == GMB_CU_SUCCESS && back != GMB_CU_SUCCESS) {
    *step = "cuCtxSetCurrent";
    r = back;
  }
  return r;
}

int gmb__cuda_sync(int ordinal, char *why, size_t cap) {
  const struct cuda_dev *d = cuda_dev_attached(ordinal, why, cap);
  if (d == NULL) return GMB_E_DEVICE;
  /* The driver refuses a wait while a stream captures, and breaks that
   * capture, whichever thread makes it: none is made then. */
  int busy = gmb__cuda_capture_underway(ordinal, why, cap);
  if (busy) return GMB_E_DEVICE;
  /* Not under cuda_mu: a wait may be long, and the driver table and the
   * device record are immutable once ready.  The caller's own context,
   * when it is another of the device's, is noted by cuda_enter and so
   * waited for with the others. */
  struct cuda_scope prev;
  gmb_cu_result r = cuda_enter(d, &prev);
  const char *step = "cuCtxSetCurrent";
  if (r == GMB_CU_SUCCESS) {
    step = "cuCtxSynchronize";
    r = cuda_drv.cuCtxSynchronize();
    if (r == GMB_CU_SUCCESS) r = cuda_sync_seen(d, &step);
    cuda_leave(d, prev);
  }
  if (r != GMB_CU_SUCCESS) {
    cuda_err(r, step, why, cap);
    return GMB_E_DEVICE;
  }
  return 0;
}

int gmb__cuda_copy(int ordinal, uint64_t dev, void *host, size_t n,
                   int to_device, char *why, size_t cap) {
  const struct cuda_dev *d = cuda_dev_attached(ordinal, why, cap);
  if (d == NULL) return GMB_E_DEVICE;
  struct cuda_scope prev;
  gmb_cu_result r = cuda_enter(d, &prev);
  const char *step = "cuCtxSetCurrent";
  if (r == GMB_CU_SUCCESS) {
    step = to_device ? "cuMemcpyHtoD" : "cuMemcpyDtoH";
    r = to_device ? cuda_drv.cuMemcpyHtoD(dev, host, n)
                  : cuda_drv.cuMemcpyDtoH(host, dev, n);
    /* From pageable memory the driver returns once it has staged the
     * bytes, before they land: only this context's legacy stream is
     * ordered after them, not the program's other streams and contexts,
     * nor the broker, which may move or offload the allocation as soon
     * as it is unlocked.  So the copy is waited for (at once when it
     * came from pinned memory). */
    if (r == GMB_CU_SUCCESS && to_device) {
      step = "cuStreamSynchronize (after cuMemcpyHtoD)";
      r = cuda_drv.cuStreamSynchronize(NULL);
    }
    cuda_leave(d, prev);
  }
  if (r != GMB_CU_SUCCESS) {
    cuda_err(r, step, why, cap);
    return GMB_E_DEVICE;
  }
  return 0;
}

int gmb__cuda_host_alloc(size_t n, void **p, int *ordinal, char *why,
                         size_t cap) {
  *p = NULL;
  if (cap) why[0] = '\0';
  int o = 0;
  while (o < GMB_CUDA_MAX_DEVICES && cuda_dev_of(o) == NULL) o++;
  if (o == GMB_CUDA_MAX_DEVICES) return GMB_E_NOENT;
  const struct cuda_dev *d = cuda_dev_of(o);
  struct cuda_scope prev;
  gmb_cu_result r = cuda_enter(d, &prev);
  const char *step = "cuCtxSetCurrent";
  if (r == GMB_CU_SUCCESS) {
    step = "cuMemHostAlloc";
    r = cuda_drv.cuMemHostAlloc(p, n, GMB_CU_MEMHOSTALLOC_PORTABLE);
    cuda_leave(d, prev);
  }
  if (r != GMB_CU_SUCCESS) {
    *p = NULL;
    cuda_err(r, step, why, cap);
    return GMB_E_DEVICE;
  }
  *ordinal = o;
  return 0;
}

void gmb__cuda_host_free(int ordinal, void *p) {
  const struct cuda_dev *d = cuda_dev_of(ordinal);
  struct cuda_scope prev;
  if (d == NULL || p == NULL || cuda_enter(d, &prev) != GMB_CU_SUCCESS) return;
  (void)cuda_drv.cuMemFreeHost(p);
  cuda_leave(d, prev);
}

/* The capture status of `stream` (an application's stream: asked in the
 * thread's own context, or in d's primary one, for the call only, on a
 * thread with none).  CUDA_ERROR_STREAM_CAPTURE_IMPLICIT (the legacy
 * stream while a blocking stream captures: work there would join that
 * capture) reads as capturing, *implicit set.  0 with *st, or
 * GMB_E_DEVICE explained. */
static int cuda_stream_status(const struct cuda_dev *d, void *stream,
                              int *st, int *implicit, char *why,
                              size_t cap) {
  struct cuda_scope prev;
  gmb_cu_ctx cur = NULL;
  *st = GMB_CU_STREAM_CAPTURE_STATUS_NONE;
  *implicit = 0;
  gmb_cu_result r = cuda_drv.cuCtxGetCurrent(&cur);
  int entered = r == GMB_CU_SUCCESS && cur == NULL;
  if (entered) r = cuda_enter(d, &prev);
  if (r == GMB_CU_SUCCESS)
    r = cuda_drv.cuStreamIsCapturing((gmb_cu_stream)stream, st);
  if (entered) cuda_leave(d, prev);
  if (r == GMB_CU_ERROR_STREAM_CAPTURE_IMPLICIT) {
    *st = GMB_CU_STREAM_CAPTURE_STATUS_ACTIVE;
    *implicit = 1;
    return 0;
  }
  if (r != GMB_CU_SUCCESS) {
    cuda_err(r, "cuStreamIsCapturing", why, cap);
    return GMB_E_DEVICE;
  }
  return 0;
}

int gmb__cuda_capturing(int ordinal, void *stream, char *why, size_t cap) {
  const struct cuda_dev *d = cuda_dev_attached(ordinal, why, cap);
  if (d == NULL) return GMB_E_DEVICE;
  int st, implicit;
  int rc = cuda_stream_status(d, stream, &st, &implicit, why, cap);
  if (rc) return rc;
  if (st != GMB_CU_STREAM_CAPTURE_STATUS_NONE) {
    snprintf(why, cap, "the stream is being captured into a CUDA graph%s",
             implicit ? " (the legacy stream, while a blocking stream "
                        "captures: work on it would join that capture)"
             : st == GMB_CU_STREAM_CAPTURE_STATUS_INVALIDATED
                 ? " (the capture was invalidated)"
                 : "");
    return 1;
  }
  return 0;
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

int gmb__cuda_release_on_stream(int ordinal, _Atomic uint32_t *state,
                                void *stream, char *why, size_t cap) {
  /* Not under cuda_mu: the launch is the caller's hot-ish path, and the
   * driver table is immutable once the device was seen ready (the client
   * attached at connect, under the mutex, before it could get here). */
  const struct cuda_dev *d = cuda_dev_attached(ordinal, why, cap);
  if (d == NULL) return GMB_E_DEVICE;
  /* Inside a graph capture the host function would be recorded into the
   * graph, run on every replay and never at capture: the hold would be
   * given back at the wrong times, or not at all. */
  int st, implicit;
  int rc = cuda_stream_status(d, stream, &st, &implicit, why, cap);
  if (rc) return rc;
  if (st != GMB_CU_STREAM_CAPTURE_STATUS_NONE) {
    snprintf(why, cap, "the stream is being captured into a CUDA graph%s: a "
             "release recorded there would run at every replay, never now; "
             "unlock after the capture",
             implicit ? " (the legacy stream, joined to a capture)" : "");
    return GMB_E_INVAL;
  }
  /* A thread without a context launches in the primary one, for the call
   * only; one with a context keeps it, since the stream is probably its
   * own. */
  gmb_cu_ctx cur = NULL;
  struct cuda_scope prev;
  gmb_cu_result r = cuda_drv.cuCtxGetCurrent(&cur);
  int entered = r == GMB_CU_SUCCESS && cur == NULL;
  if (entered) r = cuda_enter(d, &prev);
  else if (r == GMB_CU_SUCCESS) cuda_seen_note(d, cur);
  if (r != GMB_CU_SUCCESS) {
    cuda_err(r, "cuCtxSetCurrent", why, cap);
    return GMB_E_DEVICE;
  }
  /* Counted before the launch: the function may run before it returns. */
  atomic_fetch_add_explicit(&cuda_pending, 1, memory_order_relaxed);
  r = cuda_drv.cuLaunchHostFunc((gmb_cu_stream)stream, cuda_release_fn,
                                (void *)state);
  if (entered) cuda_leave(d, prev);
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

/* --- events (the stream-ordered cache) ------------------------------------ */

int gmb__cuda_event_new(int ordinal, void **ev, char *why, size_t cap) {
  const struct cuda_dev *d = cuda_dev_attached(ordinal, why, cap);
  if (d == NULL) return GMB_E_DEVICE;
  struct cuda_scope prev;
  gmb_cu_event e = NULL;
  gmb_cu_result r = cuda_enter(d, &prev);
  if (r == GMB_CU_SUCCESS) {
    r = cuda_drv.cuEventCreate(&e, GMB_CU_EVENT_DISABLE_TIMING);
    cuda_leave(d, prev);
  }
  if (r != GMB_CU_SUCCESS) {
    cuda_err(r, "cuEventCreate", why, cap);
    return GMB_E_DEVICE;
  }
  *ev = e;
  return 0;
}

int gmb__cuda_event_record(int ordinal, void *ev, void *stream, char *why,
                           size_t cap) {
  const struct cuda_dev *d = cuda_dev_attached(ordinal, why, cap);
  if (d == NULL) return GMB_E_DEVICE;
  /* A record on a capturing stream would be a node of the graph, and a
   * query of it illegal (it would invalidate the capture): the cache
   * treats such a stream as one that takes no event. */
  int st, implicit;
  int rc = cuda_stream_status(d, stream, &st, &implicit, why, cap);
  if (rc) return GMB_E_INVAL;
  if (st != GMB_CU_STREAM_CAPTURE_STATUS_NONE) {
    snprintf(why, cap, "the stream is being captured into a CUDA graph: no "
             "event is recorded on it");
    return 1;
  }
  struct cuda_scope prev;
  gmb_cu_result r = cuda_enter(d, &prev);
  if (r == GMB_CU_SUCCESS) {
    r = cuda_drv.cuEventRecord((gmb_cu_event)ev, (gmb_cu_stream)stream);
    cuda_leave(d, prev);
  }
  if (r != GMB_CU_SUCCESS) {
    cuda_err(r, "cuEventRecord on the stream", why, cap);
    return GMB_E_INVAL;
  }
  return 0;
}

int gmb__cuda_event_query(int ordinal, void *ev) {
  const struct cuda_dev *d = cuda_dev_of(ordinal);
  if (d == NULL) return GMB_E_DEVICE;
  struct cuda_scope prev;
  gmb_cu_result r = cuda_enter(d, &prev);
  if (r == GMB_CU_SUCCESS) {
    r = cuda_drv.cuEventQuery((gmb_cu_event)ev);
    cuda_leave(d, prev);
  }
  if (r == GMB_CU_SUCCESS) return 1;
  return r == GMB_CU_ERROR_NOT_READY ? 0 : GMB_E_DEVICE;
}

void gmb__cuda_event_destroy(int ordinal, void *ev) {
  const struct cuda_dev *d = cuda_dev_of(ordinal);
  struct cuda_scope prev;
  if (d && cuda_enter(d, &prev) == GMB_CU_SUCCESS) {
    cuda_drv.cuEventDestroy((gmb_cu_event)ev);
    cuda_leave(d, prev);
  }
}

/* --- which GPU: ordinals, UUIDs, the current device ----------------------- */

/* Loads the driver once per process (under cuda_mu); 0 or GMB_E_DEVICE
 * explained, as gmb__cuda_attach does. */
static int cuda_load_locked(char *why, size_t cap) {
  if (cuda_loaded && cuda_pid != getpid()) {
    snprintf(why, cap, "this process was forked after CUDA started in its "
             "parent, and CUDA does not work in such a child: fork before "
             "any CUDA call, or exec");
    return GMB_E_DEVICE;
  }
  if (cuda_loaded) return 0;
  char err[256];
  if (gmb__cudrv_load(&cuda_drv, err, sizeof err) != 0) {
    snprintf(why, cap, "%s", err);
    return GMB_E_DEVICE;
  }
  cuda_loaded = 1;
  cuda_pid = getpid();
  return 0;
}

int gmb__cuda_uuid_of(int ordinal, char *uuid, size_t ucap, char *why,
                      size_t cap) {
  pthread_mutex_lock(&cuda_mu);
  int rc = cuda_load_locked(why, cap);
  int n = 0;
  gmb_cu_device dev;
  struct gmb_cu_uuid u;
  gmb_cu_result r = GMB_CU_SUCCESS;
  if (rc == 0 && (r = cuda_drv.cuDeviceGetCount(&n)) != GMB_CU_SUCCESS) {
    cuda_err(r, "cuDeviceGetCount", why, cap);
    rc = GMB_E_DEVICE;
  }
  if (rc == 0 && (ordinal < 0 || ordinal >= n)) {
    snprintf(why, cap, "no GPU cuda:%d in this process (it sees %d)", ordinal,
             n);
    rc = GMB_E_DEVICE;
  }
  if (rc == 0 && ((r = cuda_drv.cuDeviceGet(&dev, ordinal)) != GMB_CU_SUCCESS ||
                  (r = cuda_drv.cuDeviceGetUuid(&u, dev)) != GMB_CU_SUCCESS)) {
    cuda_err(r, "cuDeviceGetUuid", why, cap);
    rc = GMB_E_DEVICE;
  }
  if (rc == 0) {
    char s[GMB_CU_UUID_STR];
    snprintf(uuid, ucap, "%s", gmb__cudrv_uuid_str(&u, s, sizeof s));
  }
  pthread_mutex_unlock(&cuda_mu);
  return rc;
}

int gmb__cuda_current(int *ordinal, char *why, size_t cap) {
  pthread_mutex_lock(&cuda_mu);
  int rc = cuda_load_locked(why, cap);
  gmb_cu_ctx cur = NULL;
  gmb_cu_device dev = 0;
  gmb_cu_result r = GMB_CU_SUCCESS;
  if (rc == 0 && (r = cuda_drv.cuCtxGetCurrent(&cur)) != GMB_CU_SUCCESS) {
    cuda_err(r, "cuCtxGetCurrent", why, cap);
    rc = GMB_E_DEVICE;
  }
  if (rc == 0 && cur == NULL) {
    *ordinal = 0; /* what the CUDA runtime uses on such a thread */
    goto out;
  }
  if (rc == 0 && (r = cuda_drv.cuCtxGetDevice(&dev)) != GMB_CU_SUCCESS) {
    cuda_err(r, "cuCtxGetDevice", why, cap);
    rc = GMB_E_DEVICE;
  }
  /* A CUdevice is a handle, not necessarily the ordinal: look it up. */
  int n = 0;
  if (rc == 0 && cuda_drv.cuDeviceGetCount(&n) == GMB_CU_SUCCESS) {
    for (int i = 0; i < n; i++) {
      gmb_cu_device d;
      if (cuda_drv.cuDeviceGet(&d, i) == GMB_CU_SUCCESS && d == dev) {
        *ordinal = i;
        goto out;
      }
    }
  }
  if (rc == 0) {
    snprintf(why, cap, "the current context's device is none of the %d this "
             "process sees", n);
    rc = GMB_E_DEVICE;
  }
out:
  pthread_mutex_unlock(&cuda_mu);
  return rc;
}
