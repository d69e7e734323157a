/*
 * cudrv.h - the CUDA driver API, loaded at run time.
 *
 * gmb never links against CUDA: the broker and the client library dlopen
 * libcuda.so.1 when they meet a cuda device, so one binary runs on hosts
 * with and without a GPU.  Every entry point is looked up with
 * cuGetProcAddress (the versioned one the header's macros would pick), so
 * a newer driver gives the ABI this code was written for.  The types are
 * declared here rather than taken from cuda.h, so that gmb builds where the
 * toolkit is not installed; tests/unit/check_cudrv.c checks them against
 * cuda.h where it is.
 *
 * $GMB_LIBCUDA names another library to load instead (tests load a fake
 * driver built on shared memory, tests/fakecuda/).
 */
#ifndef GMB_CUDRV_H
#define GMB_CUDRV_H

#include <stddef.h>
#include <stdint.h>

typedef int gmb_cu_result;              /* CUresult; 0 is CUDA_SUCCESS */
typedef unsigned long long gmb_cu_ptr;  /* CUdeviceptr */
typedef int gmb_cu_device;              /* CUdevice */
typedef struct gmb_cu_ctx_st *gmb_cu_ctx;       /* CUcontext */
typedef struct gmb_cu_stream_st *gmb_cu_stream; /* CUstream */
typedef struct {
  char reserved[64];
} gmb_cu_ipc_handle;                    /* CUipcMemHandle */
typedef void (*gmb_cu_host_fn)(void *user);     /* CUhostFn */

#define GMB_CU_SUCCESS 0
#define GMB_CU_IPC_LAZY_ENABLE_PEER_ACCESS 0x1u

struct gmb_cudrv {
  void *lib;
  char path[256]; /* what was loaded */
  int version;    /* cuDriverGetVersion */
  gmb_cu_result (*cuInit)(unsigned flags);
  gmb_cu_result (*cuDriverGetVersion)(int *v);
  gmb_cu_result (*cuDeviceGetCount)(int *n);
  gmb_cu_result (*cuDeviceGet)(gmb_cu_device *d, int ordinal);
  gmb_cu_result (*cuDeviceGetName)(char *name, int len, gmb_cu_device d);
  gmb_cu_result (*cuDevicePrimaryCtxRetain)(gmb_cu_ctx *c, gmb_cu_device d);
  gmb_cu_result (*cuDevicePrimaryCtxRelease)(gmb_cu_device d);
  gmb_cu_result (*cuCtxSetCurrent)(gmb_cu_ctx c);
  gmb_cu_result (*cuCtxGetCurrent)(gmb_cu_ctx *c);
  gmb_cu_result (*cuMemGetInfo)(size_t *free, size_t *total);
  gmb_cu_result (*cuMemAlloc)(gmb_cu_ptr *p, size_t bytes);
  gmb_cu_result (*cuMemFree)(gmb_cu_ptr p);
  gmb_cu_result (*cuMemcpyDtoD)(gmb_cu_ptr dst, gmb_cu_ptr src, size_t n);
  gmb_cu_result (*cuMemcpyDtoDAsync)(gmb_cu_ptr dst, gmb_cu_ptr src, size_t n,
                                     gmb_cu_stream s);
  gmb_cu_result (*cuMemcpyHtoD)(gmb_cu_ptr dst, const void *src, size_t n);
  gmb_cu_result (*cuMemcpyDtoH)(void *dst, gmb_cu_ptr src, size_t n);
  gmb_cu_result (*cuStreamCreate)(gmb_cu_stream *s, unsigned flags);
  gmb_cu_result (*cuStreamSynchronize)(gmb_cu_stream s);
  gmb_cu_result (*cuStreamDestroy)(gmb_cu_stream s);
  gmb_cu_result (*cuLaunchHostFunc)(gmb_cu_stream s, gmb_cu_host_fn fn,
                                    void *user);
  gmb_cu_result (*cuIpcGetMemHandle)(gmb_cu_ipc_handle *h, gmb_cu_ptr p);
  gmb_cu_result (*cuIpcOpenMemHandle)(gmb_cu_ptr *p, gmb_cu_ipc_handle h,
                                      unsigned flags);
  gmb_cu_result (*cuIpcCloseMemHandle)(gmb_cu_ptr p);
  gmb_cu_result (*cuGetErrorName)(gmb_cu_result r, const char **s);
  gmb_cu_result (*cuGetErrorString)(gmb_cu_result r, const char **s);
};

/*
 * Loads the driver ($GMB_LIBCUDA, else libcuda.so.1), resolves every entry
 * point and calls cuInit(0).  0, or GMB_E_DEVICE with one line in err
 * ("no CUDA driver: libcuda.so.1: cannot open shared object file", "the
 * driver lacks cuIpcGetMemHandle", "cuInit: CUDA_ERROR_NO_DEVICE: ...").
 */
int gmb__cudrv_load(struct gmb_cudrv *d, char *err, size_t errcap);
void gmb__cudrv_unload(struct gmb_cudrv *d); /* accepts a zeroed struct */

/* "CUDA_ERROR_OUT_OF_MEMORY: out of memory" into buf; returns buf. */
const char *gmb__cudrv_strerror(const struct gmb_cudrv *d, gmb_cu_result r,
                                char *buf, size_t cap);

#endif /* GMB_CUDRV_H */
