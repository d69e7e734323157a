/*
 * fake_cudart.c - a stand-in for libcudart/libcuda in tests: the "real"
 * functions libgmb-preload.so passes through to when it is preloaded
 * first and this library second (LD_PRELOAD="gmb-preload fake").
 * Allocations are malloc'd host memory; cudaMemGetInfo reports the fixed
 * figures FAKE_FREE / FAKE_TOTAL so a test can tell whose answer it got.
 * The stream-ordered calls and the synchronisations say on stderr that
 * they arrived ("fake-cudart: cudaFreeAsync"), for the same reason.
 */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#define FAKE_FREE ((size_t)3 << 30)
#define FAKE_TOTAL ((size_t)5 << 30)
#define FAKE_API __attribute__((visibility("default")))

FAKE_API int cudaMalloc(void **p, size_t size);
FAKE_API int cudaFree(void *p);
FAKE_API int cudaMemGetInfo(size_t *fr, size_t *tot);
FAKE_API int cuMemAlloc_v2(unsigned long long *p, size_t size);
FAKE_API int cuMemFree_v2(unsigned long long p);
FAKE_API int cuMemGetInfo_v2(size_t *fr, size_t *tot);
FAKE_API int cudaMallocAsync(void **p, size_t size, void *stream);
FAKE_API int cudaFreeAsync(void *p, void *stream);
FAKE_API int cuMemAllocAsync(unsigned long long *p, size_t size, void *stream);
FAKE_API int cuMemFreeAsync(unsigned long long p, void *stream);
FAKE_API int cudaDeviceSynchronize(void);
FAKE_API int cuCtxSynchronize(void);

int cudaMalloc(void **p, size_t size) {
  *p = malloc(size ? size : 1);
  return *p ? 0 : 2;
}

int cudaFree(void *p) {
  /* cudaFree(NULL) creates the context in cudart: say it arrived. */
  if (p == NULL) fputs("fake-cudart: cudaFree(NULL)\n", stderr);
  free(p);
  return 0;
}

int cudaMemGetInfo(size_t *fr, size_t *tot) {
  *fr = FAKE_FREE;
  *tot = FAKE_TOTAL;
  return 0;
}

int cuMemAlloc_v2(unsigned long long *p, size_t size) {
  void *q = malloc(size ? size : 1);
  *p = (unsigned long long)(uintptr_t)q;
  return q ? 0 : 2;
}

int cuMemFree_v2(unsigned long long p) {
  free((void *)(uintptr_t)p);
  return 0;
}

/* Not through cudaMemGetInfo: that symbol is the preloaded library's,
 * which would then answer for the "real" one. */
int cuMemGetInfo_v2(size_t *fr, size_t *tot) {
  *fr = FAKE_FREE;
  *tot = FAKE_TOTAL;
  return 0;
}

int cudaMallocAsync(void **p, size_t size, void *stream) {
  (void)stream;
  fputs("fake-cudart: cudaMallocAsync\n", stderr);
  *p = malloc(size ? size : 1);
  return *p ? 0 : 2;
}

int cudaFreeAsync(void *p, void *stream) {
  (void)stream;
  fputs("fake-cudart: cudaFreeAsync\n", stderr);
  free(p);
  return 0;
}

int cuMemAllocAsync(unsigned long long *p, size_t size, void *stream) {
  (void)stream;
  fputs("fake-cudart: cuMemAllocAsync\n", stderr);
  void *q = malloc(size ? size : 1);
  *p = (unsigned long long)(uintptr_t)q;
  return q ? 0 : 2;
}

int cuMemFreeAsync(unsigned long long p, void *stream) {
  (void)stream;
  fputs("fake-cudart: cuMemFreeAsync\n", stderr);
  free((void *)(uintptr_t)p);
  return 0;
}

int cudaDeviceSynchronize(void) {
  fputs("fake-cudart: cudaDeviceSynchronize\n", stderr);
  return 0;
}

int cuCtxSynchronize(void) {
  fputs("fake-cudart: cuCtxSynchronize\n", stderr);
  return 0;
}

/* What dlsym(RTLD_NEXT, "cudaMalloc") answers this library, preloaded
 * after libgmb-preload.so (which defines dlsym): 0 NULL (nothing after it
 * defines cudaMalloc: right), 1 its own cudaMalloc (dlsym looked "next"
 * from libgmb-preload.so instead of from here), 2 another. */
FAKE_API int fake_next_probe(void);
int fake_next_probe(void) {
  void *next = dlsym(RTLD_NEXT, "cudaMalloc");
  if (next == NULL) return 0;
  /* By the library it lies in: a plain reference to cudaMalloc here would
   * bind to the preloaded shim's. */
  Dl_info me, it;
  if (dladdr((void *)(uintptr_t)fake_next_probe, &me) && dladdr(next, &it) &&
      me.dli_fbase == it.dli_fbase)
    return 1;
  return 2;
}
