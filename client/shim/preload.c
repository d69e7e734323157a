/*
 * preload.c - libgmb-preload.so: LD_PRELOAD it into an unmodified CUDA
 * program and its cudaMalloc / cudaFree / cudaMemGetInfo /
 * cudaMallocAsync / cudaFreeAsync (runtime API) and cuMemAlloc_v2 /
 * cuMemFree_v2 / cuMemGetInfo_v2 / cuMemAllocAsync / cuMemFreeAsync
 * (driver API; the stream-ordered ones also as the _ptsz variants a
 * program built for per-thread default streams calls) go to the broker.
 * docs/preload.md is the user's page; its limits section says what is not
 * intercepted.
 *
 * cudaMalloc is a broker allocation of its own (gmb_alloc); cudaMallocAsync
 * is gmb_malloc_async, the session's stream-ordered cache, and its
 * cudaFreeAsync gmb_free_async on the stream named: no message, no wait.
 * Streams as CUDA names them: 0 is the legacy default stream, or the
 * thread's per-thread default stream in the _ptsz variants (passed on as
 * CU_STREAM_PER_THREAD).  The two kinds of pointer may be freed either
 * way, as CUDA allows: cudaFreeAsync of cudaMalloc's memory is gmb_free
 * (it waits for the device), and cudaFree of cudaMallocAsync's first
 * waits for the device as cudaFree does (the real cudaDeviceSynchronize /
 * cuCtxSynchronize, when the process has one) and then gives the block
 * back on the legacy stream.  Memory a stream-ordered allocation got while
 * its stream was being captured into a CUDA graph, or freed during a
 * capture, is kept until the process ends: the graph uses it at every
 * replay (docs/preload.md).  cudaMallocFromPoolAsync is not interposed:
 * memory of a pool the program made has that pool's properties, which
 * only CUDA gives; its pointers reach cudaFreeAsync, which passes them on.
 *
 * Every allocation is pinned (a raw device pointer must never move) and
 * comes from the session of the calling thread's current device (shim.c:
 * one per device, each with the broker of that GPU, found by its UUID);
 * a free goes to the session the pointer came from.  The pointer returned is
 * gmb_lock's: a device address on a cuda broker, a host address on the
 * host device.  A pointer this library did not give out (allocated by the
 * real function before or beside us) is passed to the real free function:
 * the runtime's found with dlsym(RTLD_NEXT), the driver's through
 * gmb__pre_drv_real (getproc.c).
 *
 * A broker whose device is the host (not a GPU) counts as no broker: its
 * memory is host memory, which kernels cannot use (shim.c; tests set
 * GMB_SHIM_ALLOW_HOST=1 to run on it).
 *
 * When no broker answers, $GMB_PRELOAD_FALLBACK decides: `refuse`
 * (default) fails every allocation with the out-of-memory code, as a GPU
 * that is full would; `passthrough` calls the real function, and refuses
 * when there is none.  Either way one line on stderr says why, once per
 * process ($GMB_PRELOAD_STRICT=0 is passthrough when the other is unset).
 * This library never aborts its host program.
 *
 * The other parts of the library (preload.h, which also declares the
 * CUDA types): getproc.c hands these functions to programs that look the
 * driver up (cuGetProcAddress, dlsym: the static runtime) and finds the
 * driver's own for them; vmm.c reports cuMemCreate to the broker, which
 * charges it to the tenant's quota; nvml.c
 * gives NVML the figures of gmb__pre_figures below.  Legacy CUDA IPC of
 * a pointer of ours is refused here (the end of this file).
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "preload.h"

/* cuda.h's CU_STREAM_PER_THREAD: what stream 0 means in a _ptsz call. */
#define PRE_STREAM_PER_THREAD ((void *)(uintptr_t)0x2)

GMB_SHIM_API cudaError_t cudaMalloc(void **devPtr, size_t size);
GMB_SHIM_API cudaError_t cudaFree(void *devPtr);
GMB_SHIM_API cudaError_t cudaMemGetInfo(size_t *free, size_t *total);
GMB_SHIM_API cudaError_t cudaMallocAsync(void **devPtr, size_t size,
                                         cudaStream_t stream);
GMB_SHIM_API cudaError_t cudaMallocAsync_ptsz(void **devPtr, size_t size,
                                              cudaStream_t stream);
GMB_SHIM_API cudaError_t cudaFreeAsync(void *devPtr, cudaStream_t stream);
GMB_SHIM_API cudaError_t cudaFreeAsync_ptsz(void *devPtr,
                                            cudaStream_t stream);

typedef int (*pre_alloc_fn)(void **p, size_t size);
typedef int (*pre_free_fn)(void *p);
typedef int (*pre_info_fn)(size_t *free, size_t *total);
typedef int (*pre_cualloc_fn)(CUdeviceptr *p, size_t size);
typedef int (*pre_cufree_fn)(CUdeviceptr p);
typedef int (*pre_alloc_async_fn)(void **p, size_t size, cudaStream_t s);
typedef int (*pre_free_async_fn)(void *p, cudaStream_t s);
typedef int (*pre_cualloc_async_fn)(CUdeviceptr *p, size_t size,
                                    cudaStream_t s);
typedef int (*pre_cufree_async_fn)(CUdeviceptr p, cudaStream_t s);
typedef int (*pre_sync_fn)(void);

/* The runtime's functions, when a library after us defines them.  The
 * stream-ordered ones by [ptsz]: 0 the plain name, 1 the _ptsz one.  The
 * driver's come from gmb__pre_drv_real (getproc.c), which also finds them
 * in a driver the program reached through cuGetProcAddress. */
static struct {
  pthread_once_t once;
  pre_alloc_fn cudaMalloc;
  pre_free_fn cudaFree;
  pre_info_fn cudaMemGetInfo;
  pre_alloc_async_fn cudaMallocAsync[2];
  pre_free_async_fn cudaFreeAsync[2];
  pre_sync_fn cudaDeviceSynchronize, cuCtxSynchronize;
} pre_real = {.once = PTHREAD_ONCE_INIT};

static void pre_real_load(void) {
  /* A cast through void* is how POSIX says dlsym results are used. */
  *(void **)&pre_real.cudaMalloc = dlsym(RTLD_NEXT, "cudaMalloc");
  *(void **)&pre_real.cudaFree = dlsym(RTLD_NEXT, "cudaFree");
  *(void **)&pre_real.cudaMemGetInfo = dlsym(RTLD_NEXT, "cudaMemGetInfo");
  *(void **)&pre_real.cudaMallocAsync[0] = dlsym(RTLD_NEXT, "cudaMallocAsync");
  *(void **)&pre_real.cudaMallocAsync[1] =
      dlsym(RTLD_NEXT, "cudaMallocAsync_ptsz");
  *(void **)&pre_real.cudaFreeAsync[0] = dlsym(RTLD_NEXT, "cudaFreeAsync");
  *(void **)&pre_real.cudaFreeAsync[1] = dlsym(RTLD_NEXT, "cudaFreeAsync_ptsz");
  *(void **)&pre_real.cudaDeviceSynchronize =
      dlsym(RTLD_NEXT, "cudaDeviceSynchronize");
  *(void **)&pre_real.cuCtxSynchronize = dlsym(RTLD_NEXT, "cuCtxSynchronize");
}

/* The driver's functions (getproc.c). */
#define PRE_DRV(type, which) ((type)(uintptr_t)gmb__pre_drv_real(which))

static void pre_real_get(void) { pthread_once(&pre_real.once, pre_real_load); }

/* --- policy and messages ---------------------------------------------------- */

enum pre_fallback { PRE_REFUSE, PRE_PASSTHROUGH };

static enum pre_fallback pre_fallback(void) {
  const char *s = getenv("GMB_PRELOAD_FALLBACK");
  if (s == NULL || *s == '\0') {
    /* GMB_PRELOAD_STRICT=0 says the same as passthrough; 1, the
     * default, as refuse.  GMB_PRELOAD_FALLBACK wins when both are set. */
    const char *strict = getenv("GMB_PRELOAD_STRICT");
    return strict && !strcmp(strict, "0") ? PRE_PASSTHROUGH : PRE_REFUSE;
  }
  if (!strcmp(s, "passthrough")) return PRE_PASSTHROUGH;
  static atomic_int warned;
  if (s && *s && strcmp(s, "refuse") && !atomic_exchange(&warned, 1))
    fprintf(stderr, "gmb-preload: GMB_PRELOAD_FALLBACK=%s is neither refuse "
            "nor passthrough; refusing\n", s);
  return PRE_REFUSE;
}

/* One line, once per process, for the no-broker case; `what` is the
 * function that met it. */
static void pre_say_unbrokered(const char *what, const char *why,
                               int passing) {
  static atomic_int said;
  if (atomic_exchange(&said, 1)) return;
  if (passing)
    fprintf(stderr, "gmb-preload: no broker (%s); %s and the others pass "
            "through to the real CUDA functions (GMB_PRELOAD_FALLBACK="
            "passthrough)\n", why, what);
  else
    fprintf(stderr, "gmb-preload: no broker (%s); %s refused with "
            "out-of-memory%s\n", why, what,
            pre_fallback() == PRE_PASSTHROUGH
                ? " (GMB_PRELOAD_FALLBACK=passthrough, but this process "
                  "has no real function to pass to)"
                : " (GMB_PRELOAD_FALLBACK=refuse)");
}

void gmb__pre_say_refused(const char *what, size_t size, int rc,
                          gmb_client *c) {
  if (!gmb__shim_env_flag("GMB_PRELOAD_VERBOSE")) return;
  fprintf(stderr, "gmb-preload: %s(%zu) refused: %s\n", what, size,
          rc ? gmb_last_error(c) : "?");
}

/* The broker's answer as a CUDA code: every refusal of an allocation is
 * "out of memory" to the program, which is what it knows how to handle. */
static int pre_code(int rc) {
  if (rc == 0) return PRE_CUDA_SUCCESS;
  if (rc == GMB_E_INVAL) return PRE_CUDA_INVALID_VALUE;
  return PRE_CUDA_OUT_OF_MEMORY;
}

/* --- allocation, both APIs ------------------------------------------------- */

/* The session, or NULL with the fallback decided: *pass is 1 when the
 * caller should call its real function (which it has checked exists). */
gmb_client *gmb__pre_session(const char *what, int device, int have_real,
                             int *pass, int *code) {
  const char *why = NULL;
  gmb_client *c = gmb__shim_session(device, NULL, &why);
  *pass = 0;
  if (c) return c;
  if (gmb__shim_forked()) {
    static atomic_int said;
    if (!atomic_exchange(&said, 1))
      fprintf(stderr, "gmb-preload: %s: %s\n", what, why);
    *code = PRE_CUDA_NOT_INITIALIZED;
    return NULL;
  }
  int passing = pre_fallback() == PRE_PASSTHROUGH && have_real;
  pre_say_unbrokered(what, why, passing);
  *pass = passing;
  *code = PRE_CUDA_OUT_OF_MEMORY;
  return NULL;
}

static int pre_alloc(int drv, void **out, size_t size) {
  const char *what = drv ? "cuMemAlloc_v2" : "cudaMalloc";
  int pass, code;
  pre_real_get();
  pre_cualloc_fn real_drv = PRE_DRV(pre_cualloc_fn, PRE_DRV_MEM_ALLOC);
  int have = drv ? real_drv != NULL : pre_real.cudaMalloc != NULL;
  gmb_client *c = gmb__pre_session(what, -1, have, &pass, &code);
  if (pass) {
    if (!drv) return pre_real.cudaMalloc(out, size);
    CUdeviceptr d = 0;
    int r = real_drv(&d, size);
    if (r == 0) *out = (void *)(uintptr_t)d;
    return r;
  }
  if (c == NULL) return code;
  int rc = gmb__shim_alloc(c, size, out);
  if (rc) gmb__pre_say_refused(what, size, rc, c);
  return pre_code(rc);
}

/* A block of the cache that a graph may use (allocated or freed during a
 * capture of its stream) is kept until the process ends: 1 when p was
 * kept so. */
static int pre_keep_for_graph(gmb_client *c, void *p, unsigned tag,
                              void *stream) {
  if (!(tag & GMB_SHIM_TAG_GRAPH) &&
      (gmb__shim_host() || gmb_stream_capturing(c, stream) != 1))
    return 0;
  return gmb__shim_keep(p) == 0;
}

/* A free's outcome as CUDA's code: the session gone (broker stopped) took
 * the memory with it, a success. */
static int pre_free_code(const char *what, void *p, int rc, gmb_client *c) {
  if (rc == GMB_E_CONN || rc == GMB_E_EVICTED || rc == 0) return 0;
  if (gmb__shim_env_flag("GMB_PRELOAD_VERBOSE"))
    fprintf(stderr, "gmb-preload: %s(%p): %s\n", what, p, gmb_last_error(c));
  return PRE_CUDA_INVALID_VALUE;
}

/* A pointer we gave goes back to the broker, after the device finished
 * with it (cudaFree synchronises too); any other goes to the real free. */
static int pre_free(int drv, void *p) {
  const char *what = drv ? "cuMemFree_v2" : "cudaFree";
  pre_real_get();
  unsigned tag = 0;
  int kind = gmb__shim_is_async(p, &tag);
  if (kind >= 0) {
    if (gmb__shim_forked()) return PRE_CUDA_NOT_INITIALIZED;
    gmb_client *c = gmb__shim_owner(p);
    if (kind == 1) {
      /* cudaMallocAsync's memory: wait for the device as cudaFree does
       * (the real synchronisation, when the process has one), then give
       * the block back on the legacy stream. */
      if (pre_keep_for_graph(c, p, tag, NULL)) return 0;
      /* A capture on another stream (one not joined to the legacy
       * stream) would be broken by the wait: the driver refuses
       * cuCtxSynchronize while any stream of the context captures, and
       * invalidates the capture.  Freed during a capture, the block is
       * kept, as a stream-ordered free during a capture is. */
      if (gmb__client_capture_underway(c) && gmb__shim_keep(p) == 0) return 0;
      pre_sync_fn sync = drv ? pre_real.cuCtxSynchronize
                             : pre_real.cudaDeviceSynchronize;
      /* A program of the static runtime reaches the driver through its
       * own handle (RTLD_LOCAL): no cuCtxSynchronize after this library,
       * so the driver is asked for it, at the 12.0 ABI (no argument). */
      if (drv && sync == NULL)
        sync = (pre_sync_fn)(uintptr_t)gmb__pre_drv_lookup("cuCtxSynchronize",
                                                           12000);
      int r = sync ? sync() : 0;
      if (r != 0) return r;
      return pre_free_code(what, p, gmb__shim_free_async(p, NULL), c);
    }
    /* To the session it came from, whatever device is current now.
     * gmb_free waits for the GPU (cuCtxSynchronize in the primary
     * context, as cudaFree); when the wait fails nothing is freed. */
    return pre_free_code(what, p, gmb__shim_free(p), c);
  }
  if (!drv && pre_real.cudaFree) return pre_real.cudaFree(p);
  pre_cufree_fn real_drv = PRE_DRV(pre_cufree_fn, PRE_DRV_MEM_FREE);
  if (drv && real_drv) return real_drv((CUdeviceptr)(uintptr_t)p);
  return PRE_CUDA_INVALID_VALUE;
}

/* --- the stream-ordered calls, both APIs ---------------------------------- */

/* The stream a call means: 0 in a _ptsz call is the thread's per-thread
 * default stream. */
static void *pre_stream(int ptsz, cudaStream_t s) {
  return ptsz && s == NULL ? PRE_STREAM_PER_THREAD : s;
}

static int pre_alloc_async(int drv, int ptsz, void **out, size_t size,
                           cudaStream_t stream) {
  static const char *const names[2][2] = {
      {"cudaMallocAsync", "cudaMallocAsync_ptsz"},
      {"cuMemAllocAsync", "cuMemAllocAsync_ptsz"}};
  const char *what = names[drv][ptsz];
  int pass, code;
  pre_real_get();
  pre_cualloc_async_fn real_drv = PRE_DRV(
      pre_cualloc_async_fn,
      ptsz ? PRE_DRV_MEM_ALLOC_ASYNC_PTSZ : PRE_DRV_MEM_ALLOC_ASYNC);
  int have = drv ? real_drv != NULL : pre_real.cudaMallocAsync[ptsz] != NULL;
  gmb_client *c = gmb__pre_session(what, -1, have, &pass, &code);
  if (pass) {
    if (!drv) return pre_real.cudaMallocAsync[ptsz](out, size, stream);
    CUdeviceptr d = 0;
    int r = real_drv(&d, size, stream);
    if (r == 0) *out = (void *)(uintptr_t)d;
    return r;
  }
  if (c == NULL) return code;
  void *s = pre_stream(ptsz, stream);
  /* Allocated while the stream is captured: the graph uses it at every
   * replay, so it is never reused (pre_keep_for_graph at the free). */
  unsigned tag = !gmb__shim_host() && gmb_stream_capturing(c, s) == 1
                     ? GMB_SHIM_TAG_GRAPH
                     : 0;
  int rc = gmb__shim_malloc_async(c, size, s, tag, out);
  if (rc) gmb__pre_say_refused(what, size, rc, c);
  return pre_code(rc);
}

static int pre_free_async(int drv, int ptsz, void *p, cudaStream_t stream) {
  static const char *const names[2][2] = {
      {"cudaFreeAsync", "cudaFreeAsync_ptsz"},
      {"cuMemFreeAsync", "cuMemFreeAsync_ptsz"}};
  const char *what = names[drv][ptsz];
  pre_real_get();
  unsigned tag = 0;
  int kind = gmb__shim_is_async(p, &tag);
  if (kind < 0) {
    /* Not ours (the real allocator's, a pool's, NULL): CUDA's answer. */
    if (!drv && pre_real.cudaFreeAsync[ptsz])
      return pre_real.cudaFreeAsync[ptsz](p, stream);
    pre_cufree_async_fn real_drv = PRE_DRV(
        pre_cufree_async_fn,
        ptsz ? PRE_DRV_MEM_FREE_ASYNC_PTSZ : PRE_DRV_MEM_FREE_ASYNC);
    if (drv && real_drv) return real_drv((CUdeviceptr)(uintptr_t)p, stream);
    return p == NULL ? PRE_CUDA_SUCCESS : PRE_CUDA_INVALID_VALUE;
  }
  if (gmb__shim_forked()) return PRE_CUDA_NOT_INITIALIZED;
  gmb_client *c = gmb__shim_owner(p);
  /* cudaMalloc's memory freed stream-ordered (CUDA allows it): gmb_free,
   * which waits for the device first. */
  if (kind == 0) return pre_free_code(what, p, gmb__shim_free(p), c);
  void *s = pre_stream(ptsz, stream);
  if (pre_keep_for_graph(c, p, tag, s)) return 0;
  /* Reusable at once on that stream, on others once its work ran. */
  return pre_free_code(what, p, gmb__shim_free_async(p, s), c);
}

/* Free and total as the program should see them, every interface alike
 * (the runtime's, the driver's, NVML's): gmb__shim_figures.  This
 * process's cuMemCreate bytes (vmm.c) are the broker's to count: they are
 * in the tenant's `used` and the device's segments already. */
int gmb__pre_figures(gmb_client *c, gmb__pre_real_figures_fn real,
                     void *arg, uint64_t *freep, uint64_t *totalp) {
  return gmb__shim_figures(c, 0, real, arg, freep, totalp);
}

/* A cudaMemGetInfo-like function as gmb__pre_figures asks for it. */
static int pre_info_real(void *arg, uint64_t *freep, uint64_t *totalp) {
  size_t f = 0, t = 0;
  int r = (*(pre_info_fn *)arg)(&f, &t);
  *freep = f;
  *totalp = t;
  return r;
}

static int pre_info(const char *what, pre_info_fn real, size_t *freep,
                    size_t *totalp) {
  if (freep == NULL || totalp == NULL) return PRE_CUDA_INVALID_VALUE;
  int pass, code;
  gmb_client *c = gmb__pre_session(what, -1, real != NULL, &pass, &code);
  if (pass) return real(freep, totalp);
  if (c == NULL) return code;
  uint64_t fr = 0, tot = 0;
  int rc = gmb__pre_figures(c, real ? pre_info_real : NULL, &real, &fr, &tot);
  if (rc > 0) return rc; /* the real function's failure, as it was */
  if (rc) {
    gmb__pre_say_refused(what, 0, rc, c);
    return PRE_CUDA_NOT_INITIALIZED;
  }
  *freep = (size_t)fr;
  *totalp = (size_t)tot;
  return 0;
}

/* --- the interposed functions ----------------------------------------------- */

cudaError_t cudaMalloc(void **devPtr, size_t size) {
  if (devPtr == NULL) return PRE_CUDA_INVALID_VALUE;
  if (size == 0) { /* as cudart: success, and no memory */
    *devPtr = NULL;
    return PRE_CUDA_SUCCESS;
  }
  return pre_alloc(0, devPtr, size);
}

cudaError_t cudaFree(void *devPtr) {
  if (devPtr == NULL) {
    /* Programs call cudaFree(0) to create the runtime's context: the real
     * one must see it.  Without one, it is a success, as in cudart. */
    pre_real_get();
    return pre_real.cudaFree ? pre_real.cudaFree(NULL) : PRE_CUDA_SUCCESS;
  }
  return pre_free(0, devPtr);
}

cudaError_t cudaMemGetInfo(size_t *free, size_t *total) {
  pre_real_get();
  return pre_info("cudaMemGetInfo", pre_real.cudaMemGetInfo, free, total);
}

CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize) {
  if (dptr == NULL || bytesize == 0) return PRE_CUDA_INVALID_VALUE; /* as cuda.h */
  void *p = NULL;
  int r = pre_alloc(1, &p, bytesize);
  if (r == 0) *dptr = (CUdeviceptr)(uintptr_t)p;
  return r;
}

CUresult cuMemFree_v2(CUdeviceptr dptr) {
  if (dptr == 0) return PRE_CUDA_SUCCESS;
  return pre_free(1, (void *)(uintptr_t)dptr);
}

CUresult cuMemGetInfo_v2(size_t *free, size_t *total) {
  return pre_info("cuMemGetInfo_v2",
                  PRE_DRV(pre_info_fn, PRE_DRV_MEM_GET_INFO), free, total);
}

/*
 * The device's size, as frameworks and cudaGetDeviceProperties
 * (totalGlobalMem) read it: the tenant's quota when the broker of that
 * GPU gives it one, so that a program sizing itself from the device sees
 * what cudaMemGetInfo calls total; else the driver's figure.  `dev` is
 * taken as the process's ordinal, which is what the real driver's
 * CUdevice is.  A GPU without a broker gets the driver's figure whatever
 * the fallback says: refusing a device property would stop programs at
 * their start, before they allocate anything gmb could refuse.
 */
typedef int (*pre_total_fn)(size_t *bytes, int dev);

CUresult cuDeviceTotalMem_v2(size_t *bytes, int dev) {
  pre_total_fn real = PRE_DRV(pre_total_fn, PRE_DRV_DEVICE_TOTAL_MEM);
  if (bytes == NULL || dev < 0) return real ? real(bytes, dev)
                                            : PRE_CUDA_INVALID_VALUE;
  gmb_client *c = gmb__shim_session(dev, NULL, NULL);
  if (c == NULL)
    return real ? real(bytes, dev)
                : gmb__shim_forked() ? PRE_CUDA_NOT_INITIALIZED
                                     : PRE_CUDA_INVALID_VALUE;
  gmb_stats st;
  int rc = gmb_tenant_stats(c, &st);
  if (rc) {
    gmb__pre_say_refused("cuDeviceTotalMem_v2", 0, rc, c);
    return PRE_CUDA_NOT_INITIALIZED;
  }
  if (st.quota != 0) {
    *bytes = (size_t)st.quota;
    return 0;
  }
  if (real) return real(bytes, dev);
  gmb_device_stats ds;
  if (gmb_device_stats_get(c, &ds) != 0) return PRE_CUDA_NOT_INITIALIZED;
  *bytes = (size_t)ds.capacity;
  return 0;
}

/* Size 0 as the synchronous calls: the runtime's succeeds with no memory,
 * the driver's is an invalid value. */
cudaError_t cudaMallocAsync(void **devPtr, size_t size, cudaStream_t stream) {
  if (devPtr == NULL) return PRE_CUDA_INVALID_VALUE;
  if (size == 0) {
    *devPtr = NULL;
    return PRE_CUDA_SUCCESS;
  }
  return pre_alloc_async(0, 0, devPtr, size, stream);
}

cudaError_t cudaMallocAsync_ptsz(void **devPtr, size_t size,
                                 cudaStream_t stream) {
  if (devPtr == NULL) return PRE_CUDA_INVALID_VALUE;
  if (size == 0) {
    *devPtr = NULL;
    return PRE_CUDA_SUCCESS;
  }
  return pre_alloc_async(0, 1, devPtr, size, stream);
}

cudaError_t cudaFreeAsync(void *devPtr, cudaStream_t stream) {
  return pre_free_async(0, 0, devPtr, stream);
}

cudaError_t cudaFreeAsync_ptsz(void *devPtr, cudaStream_t stream) {
  return pre_free_async(0, 1, devPtr, stream);
}

static CUresult pre_cu_alloc_async(int ptsz, CUdeviceptr *dptr, size_t n,
                                   cudaStream_t stream) {
  if (dptr == NULL || n == 0) return PRE_CUDA_INVALID_VALUE;
  void *p = NULL;
  int r = pre_alloc_async(1, ptsz, &p, n, stream);
  if (r == 0) *dptr = (CUdeviceptr)(uintptr_t)p;
  return r;
}

CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize,
                         cudaStream_t stream) {
  return pre_cu_alloc_async(0, dptr, bytesize, stream);
}

CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize,
                              cudaStream_t stream) {
  return pre_cu_alloc_async(1, dptr, bytesize, stream);
}

CUresult cuMemFreeAsync(CUdeviceptr dptr, cudaStream_t stream) {
  return pre_free_async(1, 0, (void *)(uintptr_t)dptr, stream);
}

CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, cudaStream_t stream) {
  return pre_free_async(1, 1, (void *)(uintptr_t)dptr, stream);
}

/* --- CUDA IPC of gmb memory ------------------------------------------------- */

/*
 * Legacy CUDA IPC (cudaIpcGetMemHandle / cuIpcGetMemHandle) exports memory
 * that cudaMalloc made; gmb's pointers are mappings of memory imported
 * from the broker, which the driver refuses to export so (and which the
 * broker shares with other processes of the tenant only through its own
 * descriptor channel).  A pointer of gmb's is refused with
 * not-supported and one line on stderr, once, that says what to do
 * instead (docs/preload.md); any other goes to the real function.
 */
typedef int (*pre_ipc_get_fn)(void *handle, void *ptr);
typedef int (*pre_cu_ipc_get_fn)(void *handle, CUdeviceptr ptr);

static int pre_ipc_refuse(const char *what, const void *p) {
  static atomic_int said;
  if (!atomic_exchange(&said, 1))
    fprintf(stderr, "gmb-preload: %s(%p): memory from the gmb broker cannot "
            "be shared with legacy CUDA IPC (it is mapped from the broker, "
            "not made by cudaMalloc); refused with not-supported (801). "
            "Share it through host memory, or allocate what other "
            "processes must open outside the preload (docs/preload.md, "
            "\"CUDA IPC\")\n", what, p);
  return PRE_CUDA_NOT_SUPPORTED;
}

cudaError_t cudaIpcGetMemHandle(void *handle, void *devPtr) {
  if (devPtr && gmb__shim_owns(devPtr))
    return pre_ipc_refuse("cudaIpcGetMemHandle", devPtr);
  pre_ipc_get_fn real =
      (pre_ipc_get_fn)(uintptr_t)gmb__pre_named_real("cudaIpcGetMemHandle");
  return real ? real(handle, devPtr) : PRE_CUDA_INVALID_VALUE;
}

CUresult cuIpcGetMemHandle(void *handle, CUdeviceptr dptr) {
  void *p = (void *)(uintptr_t)dptr;
  if (p && gmb__shim_owns(p)) return pre_ipc_refuse("cuIpcGetMemHandle", p);
  pre_cu_ipc_get_fn real =
      PRE_DRV(pre_cu_ipc_get_fn, PRE_DRV_IPC_GET_MEM_HANDLE);
  return real ? real(handle, dptr) : PRE_CUDA_INVALID_VALUE;
}
