// preload_app.cu - an unmodified CUDA program for libgmb-preload.so on a
// GPU (tests/gpu/run.sh builds it with nvcc -cudart shared, so that
// cudaMalloc is a dynamic symbol LD_PRELOAD can replace).  cudaFree(0)
// creates the context; a kernel writes every element of a cudaMalloc'd
// buffer, which is checked by a copy back; cudaMemGetInfo is printed.
// Exit 0 when the bytes are right and the calls succeeded.
#include <cstdio>
#include <cuda_runtime.h>

__global__ void fill(unsigned *p, size_t n) {
  size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
  if (i < n) p[i] = (unsigned)(i * 2654435761u);
}

int main() {
  if (cudaFree(0) != cudaSuccess) return 1;
  const size_t n = 64u << 20;
  unsigned *d = nullptr;
  cudaError_t e = cudaMalloc(&d, n * sizeof *d);
  if (e != cudaSuccess) { printf("cudaMalloc: %s\n", cudaGetErrorString(e)); return 1; }
  fill<<<(unsigned)((n + 255) / 256), 256>>>(d, n);
  static unsigned h[64u << 20];
  if (cudaMemcpy(h, d, n * sizeof *d, cudaMemcpyDeviceToHost) != cudaSuccess) return 1;
  for (size_t i = 0; i < n; i++)
    if (h[i] != (unsigned)(i * 2654435761u)) { printf("bad at %zu\n", i); return 1; }
  size_t fr = 0, tot = 0;
  e = cudaMemGetInfo(&fr, &tot);
  printf("cudaMemGetInfo: %d free %zu total %zu\n", (int)e, fr, tot);
  if (cudaFree(d) != cudaSuccess) return 1;
  printf("preload_app: 256MiB written by a kernel, read back\n");
  return 0;
}
