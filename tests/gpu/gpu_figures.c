/*
 * gpu_figures.c - the driver-level figures of GPU.md on a real GPU (run by
 * tests/gpu/run.sh; builds anywhere, since it loads the driver through
 * proto/cudrv like gmb does): cuMemAlloc latency, cuIpcOpenMemHandle cost
 * in another process, plain cuMemcpyDtoD GB/s (the ceiling for the broker's
 * migration), and an IPC round trip whose bytes are checked with
 * cuMemcpyDtoH.  Exit 0 when every check passed; 2 when no GPU answered.
 * Knobs: ITER (allocations timed, default 200), SIZE_MIB (copy size, 256).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cudrv.h"

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

#define CU(call)                                                        \
  do {                                                                  \
    gmb_cu_result r_ = (call);                                          \
    if (r_ != GMB_CU_SUCCESS) {                                         \
      char b_[160];                                                     \
      fprintf(stderr, "gpu_figures: %s: %s\n", #call,                   \
              gmb__cudrv_strerror(&d, r_, b_, sizeof b_));              \
      return 1;                                                         \
    }                                                                   \
  } while (0)

static struct gmb_cudrv d;

static int ctx_on(gmb_cu_ctx *ctx) {
  gmb_cu_device dev;
  CU(d.cuDeviceGet(&dev, 0));
  CU(d.cuDevicePrimaryCtxRetain(ctx, dev));
  CU(d.cuCtxSetCurrent(*ctx));
  return 0;
}

/* Child: open the handle, time it, check the pattern, write its own. */
static int child(gmb_cu_ipc_handle h, size_t n) {
  char err[256];
  if (gmb__cudrv_load(&d, err, sizeof err) != 0) return 10;
  gmb_cu_ctx ctx;
  if (ctx_on(&ctx)) return 11;
  gmb_cu_ptr p;
  double t0 = now_s();
  CU(d.cuIpcOpenMemHandle(&p, h, GMB_CU_IPC_LAZY_ENABLE_PEER_ACCESS));
  printf("FIGURE cuIpcOpenMemHandle_ms %.3f\n", (now_s() - t0) * 1e3);
  unsigned char *buf = malloc(n);
  CU(d.cuMemcpyDtoH(buf, p, n));
  for (size_t i = 0; i < n; i++)
    if (buf[i] != (unsigned char)(i * 13 + 7)) {
      fprintf(stderr, "gpu_figures: child saw byte %zu = %u\n", i, buf[i]);
      return 12;
    }
  memset(buf, 0xa5, n);
  CU(d.cuMemcpyHtoD(p, buf, n));
  t0 = now_s();
  CU(d.cuIpcCloseMemHandle(p));
  printf("FIGURE cuIpcCloseMemHandle_ms %.3f\n", (now_s() - t0) * 1e3);
  fflush(stdout);
  return 0;
}

int main(void) {
  char err[256];
  if (gmb__cudrv_load(&d, err, sizeof err) != 0) {
    fprintf(stderr, "gpu_figures: no GPU: %s\n", err);
    return 2;
  }
  int iter = getenv("ITER") ? atoi(getenv("ITER")) : 200;
  size_t mib = getenv("SIZE_MIB") ? (size_t)atoi(getenv("SIZE_MIB")) : 256;
  gmb_cu_ctx ctx;
  if (ctx_on(&ctx)) return 1;
  char name[96] = "";
  d.cuDeviceGetName(name, sizeof name, 0);
  printf("FIGURE device \"%s\" driver %d\n", name, d.version);

  /* cuMemAlloc/cuMemFree of 2 MiB, the broker's segment unit. */
  double t0 = now_s();
  for (int i = 0; i < iter; i++) {
    gmb_cu_ptr p;
    CU(d.cuMemAlloc(&p, 2u << 20));
    CU(d.cuMemFree(p));
  }
  printf("FIGURE cuMemAlloc+cuMemFree_2MiB_us %.2f\n",
         (now_s() - t0) / iter * 1e6);

  /* Plain D2D copy bandwidth. */
  size_t n = mib << 20;
  gmb_cu_ptr a, b;
  CU(d.cuMemAlloc(&a, n));
  CU(d.cuMemAlloc(&b, n));
  CU(d.cuMemcpyDtoD(b, a, n)); /* warm */
  gmb_cu_stream s;
  CU(d.cuStreamCreate(&s, 1));
  t0 = now_s();
  for (int i = 0; i < 10; i++) CU(d.cuMemcpyDtoDAsync(b, a, n, s));
  CU(d.cuStreamSynchronize(s));
  double gbs = 10.0 * (double)n / (now_s() - t0) / 1e9;
  printf("FIGURE cuMemcpyDtoD_%zuMiB_GBps %.1f\n", mib, gbs);

  /* IPC round trip with checked bytes. */
  size_t m = 4u << 20;
  unsigned char *buf = malloc(m);
  for (size_t i = 0; i < m; i++) buf[i] = (unsigned char)(i * 13 + 7);
  CU(d.cuMemcpyHtoD(a, buf, m));
  gmb_cu_ipc_handle h;
  CU(d.cuIpcGetMemHandle(&h, a));
  fflush(stdout);
  pid_t pid = fork();
  if (pid == 0) _exit(child(h, m));
  int st;
  waitpid(pid, &st, 0);
  if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
    fprintf(stderr, "gpu_figures: IPC child failed (status %d)\n", st);
    return 1;
  }
  CU(d.cuMemcpyDtoH(buf, a, m));
  for (size_t i = 0; i < m; i++)
    if (buf[i] != 0xa5) {
      fprintf(stderr, "gpu_figures: parent saw byte %zu = %u\n", i, buf[i]);
      return 1;
    }
  printf("OK ipc round trip %zu bytes checked\n", m);
  CU(d.cuMemFree(a));
  CU(d.cuMemFree(b));
  return 0;
}
