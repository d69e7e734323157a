/*
 * cuda_prog.c - an "unmodified CUDA program" for tests/integration/
 * test_preload.c.  It declares the CUDA functions itself (weak, so it links
 * against nothing that defines them) and runs them as libgmb-preload.so,
 * LD_PRELOADed, provides them.
 *
 * It reads one command a line on stdin and answers one line on stdout:
 *   rt_malloc SLOT SIZE | drv_malloc SLOT SIZE     -> "RC"
 *   rt_free SLOT | drv_free SLOT | rt_free_null     -> "RC"
 *   rt_info | drv_info                              -> "RC FREE TOTAL"
 *   fill SLOT SIZE SEED | check SLOT SIZE SEED      -> "0" or "bad OFFSET"
 *   real_malloc SLOT SIZE   cudaMalloc of the library named by
 *                           $CUDA_PROG_REAL (not the interposed one) -> "RC"
 *   next_probe              the stand-in library's fake_next_probe: what
 *                           dlsym(RTLD_NEXT) answers a library preloaded
 *                           after the shim -> "0" right, "1" wrong
 *   set_device N            makes ordinal N's primary context current, as
 *                           cudaSetDevice does, through the driver named by
 *                           $GMB_LIBCUDA (the fake in tests)     -> "RC"
 *   rt_malloc_async SLOT SIZE STREAM | rt_malloc_async_ptsz ... |
 *   drv_malloc_async SLOT SIZE STREAM                            -> "RC"
 *   rt_free_async SLOT STREAM | rt_free_async_ptsz SLOT STREAM |
 *   drv_free_async SLOT STREAM | rt_free_async_null              -> "RC"
 *                           (STREAM a number: 0 the default stream, 1
 *                           cudaStreamLegacy, 2 cudaStreamPerThread)
 *   dup FROM TO             slot TO holds slot FROM's pointer too -> "0"
 *   same A B                "1" when slots A and B hold one pointer, else "0"
 *   capture on|off          sets or unsets FAKECUDA_CAPTURING=all: the fake
 *                           driver's streams are being captured   -> "0"
 *   graph begin|end         a real capture (global mode) on a non-blocking
 *                           stream of the driver's, made at the first
 *                           begin, which STREAM 3 names above; end is
 *                           cuStreamEndCapture (and the graph destroyed)
 *                                                                  -> "RC"
 *   exit                    ends without freeing anything
 * "nofunc NAME" when a function is not there (nothing was preloaded).
 */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef int cudaError_t;
typedef int CUresult;
typedef unsigned long long CUdeviceptr;

extern cudaError_t cudaMalloc(void **devPtr, size_t size) __attribute__((weak));
extern cudaError_t cudaFree(void *devPtr) __attribute__((weak));
extern cudaError_t cudaMemGetInfo(size_t *free, size_t *total) __attribute__((weak));
extern CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize) __attribute__((weak));
extern CUresult cuMemFree_v2(CUdeviceptr dptr) __attribute__((weak));
extern CUresult cuMemGetInfo_v2(size_t *free, size_t *total) __attribute__((weak));
extern cudaError_t cudaMallocAsync(void **p, size_t n, void *s) __attribute__((weak));
extern cudaError_t cudaMallocAsync_ptsz(void **p, size_t n, void *s) __attribute__((weak));
extern cudaError_t cudaFreeAsync(void *p, void *s) __attribute__((weak));
extern cudaError_t cudaFreeAsync_ptsz(void *p, void *s) __attribute__((weak));
extern CUresult cuMemAllocAsync(CUdeviceptr *d, size_t n, void *s) __attribute__((weak));
extern CUresult cuMemFreeAsync(CUdeviceptr d, void *s) __attribute__((weak));

#define PROG_SLOTS 64

typedef int (*prog_gpa_fn)(const char *sym, void **pfn, int ver,
                           unsigned long long flags, int *status);

/* cudaSetDevice(n) through the driver: -1 when there is none. */
static prog_gpa_fn prog_gpa(void);

static int prog_set_device(int n) {
  prog_gpa_fn gpa = prog_gpa();
  if (gpa == NULL) return -1;
  int (*init)(unsigned) = NULL, (*get)(int *, int) = NULL;
  int (*retain)(void **, int) = NULL, (*set)(void *) = NULL;
  if (gpa("cuInit", (void **)&init, 12000, 0, NULL) ||
      gpa("cuDeviceGet", (void **)&get, 12000, 0, NULL) ||
      gpa("cuDevicePrimaryCtxRetain", (void **)&retain, 12000, 0, NULL) ||
      gpa("cuCtxSetCurrent", (void **)&set, 12000, 0, NULL))
    return -1;
  int dev, rc;
  void *ctx;
  if ((rc = init(0)) || (rc = get(&dev, n)) || (rc = retain(&ctx, dev)))
    return rc;
  return set(ctx);
}

/* The device of the calling thread's current context, or -2 when it has
 * none (-1: no driver). */
static int prog_current(void) {
  prog_gpa_fn gpa = prog_gpa();
  if (gpa == NULL) return -1;
  int (*init)(unsigned) = NULL, (*cur)(void **) = NULL, (*dev)(int *) = NULL;
  if (gpa("cuInit", (void **)&init, 12000, 0, NULL) ||
      gpa("cuCtxGetCurrent", (void **)&cur, 12000, 0, NULL) ||
      gpa("cuCtxGetDevice", (void **)&dev, 12000, 0, NULL))
    return -1;
  void *ctx = NULL;
  int d = -1;
  if (init(0) || cur(&ctx)) return -1;
  if (ctx == NULL) return -2;
  return dev(&d) ? -1 : d;
}

/* The stream of "graph begin" (STREAM 3 in the commands). */
static void *prog_stream;

/* cuGetProcAddress_v2 of the driver $GMB_LIBCUDA names, or NULL. */
static prog_gpa_fn prog_gpa(void) {
  const char *lib = getenv("GMB_LIBCUDA");
  void *h = lib ? dlopen(lib, RTLD_NOW | RTLD_LOCAL) : NULL;
  prog_gpa_fn gpa = NULL;
  if (h) *(void **)&gpa = dlsym(h, "cuGetProcAddress_v2");
  return gpa;
}

/* "graph begin" / "graph end": a capture of the driver's own. */
static int prog_graph(int begin) {
  prog_gpa_fn gpa = prog_gpa();
  int (*create)(void **, unsigned) = NULL, (*start)(void *, int) = NULL;
  int (*end)(void *, void **) = NULL, (*destroy)(void *) = NULL;
  if (gpa == NULL || gpa("cuStreamCreate", (void **)&create, 12000, 0, NULL) ||
      gpa("cuStreamBeginCapture", (void **)&start, 12000, 0, NULL) ||
      gpa("cuStreamEndCapture", (void **)&end, 12000, 0, NULL) ||
      gpa("cuGraphDestroy", (void **)&destroy, 12000, 0, NULL))
    return -1;
  if (begin) {
    int rc = prog_stream ? 0 : create(&prog_stream, 1 /* non-blocking */);
    return rc ? rc : start(prog_stream, 0 /* global mode */);
  }
  void *graph = NULL;
  int rc = end(prog_stream, &graph);
  if (rc == 0 && graph) destroy(graph);
  return rc;
}

/* A command's STREAM: 3 is prog_stream, the others are CUDA's handles. */
static void *prog_stream_of(unsigned long n) {
  return n == 3 ? prog_stream : (void *)(uintptr_t)n;
}

static void *prog_slot[PROG_SLOTS];

static unsigned char prog_byte(size_t i, unsigned long seed) {
  uint64_t x = (i + 1) * UINT64_C(0x9E3779B97F4A7C15) ^ seed;
  return (unsigned char)(x >> 29);
}

#define NEED(f)                          \
  if (!(f)) {                            \
    printf("nofunc %s\n", #f);           \
    continue;                            \
  }

int main(void) {
  char line[256], cmd[32];
  setvbuf(stdout, NULL, _IOLBF, 0);
  while (fgets(line, sizeof line, stdin)) {
    unsigned slot = 0;
    unsigned long long size = 0;
    unsigned long seed = 0;
    if (sscanf(line, "%31s %u %llu %lu", cmd, &slot, &size, &seed) < 1)
      continue;
    if (slot >= PROG_SLOTS) slot = 0;
    if (!strcmp(cmd, "rt_malloc")) {
      NEED(cudaMalloc);
      printf("%d\n", cudaMalloc(&prog_slot[slot], (size_t)size));
    } else if (!strcmp(cmd, "drv_malloc")) {
      NEED(cuMemAlloc_v2);
      CUdeviceptr d = 0;
      int rc = cuMemAlloc_v2(&d, (size_t)size);
      prog_slot[slot] = (void *)(uintptr_t)d;
      printf("%d\n", rc);
    } else if (!strcmp(cmd, "rt_free")) {
      NEED(cudaFree);
      printf("%d\n", cudaFree(prog_slot[slot]));
      prog_slot[slot] = NULL;
    } else if (!strcmp(cmd, "drv_free")) {
      NEED(cuMemFree_v2);
      printf("%d\n", cuMemFree_v2((CUdeviceptr)(uintptr_t)prog_slot[slot]));
      prog_slot[slot] = NULL;
    } else if (!strcmp(cmd, "rt_free_null")) {
      NEED(cudaFree);
      printf("%d\n", cudaFree(NULL));
    } else if (!strcmp(cmd, "rt_info") || !strcmp(cmd, "drv_info")) {
      size_t fr = 1, tot = 1;
      int rc;
      if (cmd[0] == 'r') {
        NEED(cudaMemGetInfo);
        rc = cudaMemGetInfo(&fr, &tot);
      } else {
        NEED(cuMemGetInfo_v2);
        rc = cuMemGetInfo_v2(&fr, &tot);
      }
      printf("%d %zu %zu\n", rc, fr, tot);
    } else if (!strcmp(cmd, "fill") || !strcmp(cmd, "check")) {
      /* On the host device the pointer is host memory. */
      unsigned char *p = prog_slot[slot];
      long bad = -1;
      for (size_t i = 0; i < size && p; i++) {
        if (cmd[0] == 'f')
          p[i] = prog_byte(i, seed);
        else if (p[i] != prog_byte(i, seed)) {
          bad = (long)i;
          break;
        }
      }
      if (p == NULL) bad = -2;
      if (bad == -1)
        printf("0\n");
      else
        printf("bad %ld\n", bad);
    } else if (!strcmp(cmd, "real_malloc")) {
      const char *lib = getenv("CUDA_PROG_REAL");
      void *h = lib ? dlopen(lib, RTLD_NOW | RTLD_NOLOAD) : NULL;
      cudaError_t (*f)(void **, size_t) = NULL;
      if (h) *(void **)&f = dlsym(h, "cudaMalloc");
      NEED(f);
      printf("%d\n", f(&prog_slot[slot], (size_t)size));
    } else if (!strcmp(cmd, "next_probe")) {
      const char *lib = getenv("CUDA_PROG_REAL");
      void *h = lib ? dlopen(lib, RTLD_NOW | RTLD_NOLOAD) : NULL;
      int (*f)(void) = NULL;
      if (h) *(void **)&f = dlsym(h, "fake_next_probe");
      NEED(f);
      printf("%d\n", f());
    } else if (!strcmp(cmd, "rt_malloc_async")) {
      NEED(cudaMallocAsync);
      printf("%d\n", cudaMallocAsync(&prog_slot[slot], (size_t)size,
                                     prog_stream_of(seed)));
    } else if (!strcmp(cmd, "rt_malloc_async_ptsz")) {
      NEED(cudaMallocAsync_ptsz);
      printf("%d\n", cudaMallocAsync_ptsz(&prog_slot[slot], (size_t)size,
                                          (void *)(uintptr_t)seed));
    } else if (!strcmp(cmd, "drv_malloc_async")) {
      NEED(cuMemAllocAsync);
      CUdeviceptr d = 0;
      int rc = cuMemAllocAsync(&d, (size_t)size, (void *)(uintptr_t)seed);
      prog_slot[slot] = (void *)(uintptr_t)d;
      printf("%d\n", rc);
    } else if (!strcmp(cmd, "rt_free_async")) {
      NEED(cudaFreeAsync);
      printf("%d\n", cudaFreeAsync(prog_slot[slot], (void *)(uintptr_t)size));
      prog_slot[slot] = NULL;
    } else if (!strcmp(cmd, "rt_free_async_ptsz")) {
      NEED(cudaFreeAsync_ptsz);
      printf("%d\n", cudaFreeAsync_ptsz(prog_slot[slot],
                                        (void *)(uintptr_t)size));
      prog_slot[slot] = NULL;
    } else if (!strcmp(cmd, "drv_free_async")) {
      NEED(cuMemFreeAsync);
      printf("%d\n", cuMemFreeAsync((CUdeviceptr)(uintptr_t)prog_slot[slot],
                                    (void *)(uintptr_t)size));
      prog_slot[slot] = NULL;
    } else if (!strcmp(cmd, "rt_free_async_null")) {
      NEED(cudaFreeAsync);
      printf("%d\n", cudaFreeAsync(NULL, NULL));
    } else if (!strcmp(cmd, "dup")) {
      prog_slot[size < PROG_SLOTS ? size : 0] = prog_slot[slot];
      printf("0\n");
    } else if (!strcmp(cmd, "same")) {
      printf("%d\n", prog_slot[slot] == prog_slot[size < PROG_SLOTS ? size : 0]);
    } else if (!strcmp(cmd, "capture")) {
      char onoff[8] = "";
      sscanf(line, "%*s %7s", onoff);
      if (!strcmp(onoff, "on"))
        setenv("FAKECUDA_CAPTURING", "all", 1);
      else
        unsetenv("FAKECUDA_CAPTURING");
      printf("0\n");
    } else if (!strcmp(cmd, "graph")) {
      char what[8] = "";
      sscanf(line, "%*s %7s", what);
      printf("%d\n", prog_graph(!strcmp(what, "begin")));
    } else if (!strcmp(cmd, "current")) {
      int d = prog_current();
      if (d == -2)
        printf("none\n");
      else
        printf("%d\n", d);
    } else if (!strcmp(cmd, "set_device")) {
      printf("%d\n", prog_set_device((int)slot));
    } else if (!strcmp(cmd, "exit")) {
      fflush(stdout);
      _exit(0);
    } else {
      printf("unknown %s\n", cmd);
    }
  }
  return 0;
}
