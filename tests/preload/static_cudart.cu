// static_cudart.cu - a CUDA program as nvcc builds it by default, on the
// static runtime (libcudart_static.a: no dynamic cudaMalloc for LD_PRELOAD
// to replace), for tests/integration/test_preload.c.  mk/shim.mk builds it
// where the toolkit's nvcc is installed.  Without a GPU the runtime cannot
// start (the stand-in driver has no cuGetExportTable, which only NVIDIA's
// driver provides), but before it gives up it has found the driver and
// asked cuGetProcAddress for every entry point, which is what the test
// looks at; on a GPU (tests/gpu/run.sh uses preload_app.cu) it runs.
// Prints each call's code.
#include <cstdio>
#include <cuda_runtime.h>

int main() {
  void *p = nullptr;
  cudaError_t e = cudaMalloc(&p, 1 << 20);
  printf("cudaMalloc: %d\n", (int)e);
  size_t fr = 0, tot = 0;
  e = cudaMemGetInfo(&fr, &tot);
  printf("cudaMemGetInfo: %d %zu %zu\n", (int)e, fr, tot);
  if (p) printf("cudaFree: %d\n", (int)cudaFree(p));
  return 0;
}
