/*
 * preload.h - what the parts of libgmb-preload.so share: preload.c (the
 * runtime and driver allocation calls), getproc.c (cuGetProcAddress,
 * cudaGetDriverEntryPoint* and dlsym, which hand out preload.c's functions
 * to programs that look the driver up instead of linking it), vmm.c (the
 * VMM calls, charged to the tenant at the broker) and nvml.c (NVML's memory figures).
 * docs/preload.md is the user's page.
 *
 * The CUDA types are declared here (the enums are int-sized, CUdeviceptr
 * is unsigned long long) so the library builds without the toolkit;
 * tests/fakecuda/cudrv_abi.c holds gmb's mirror of them to cuda.h.
 */
#ifndef GMB_PRELOAD_H
#define GMB_PRELOAD_H

#include <stddef.h>
#include <stdint.h>

#include "gmb.h"
#include "shim.h"

typedef int cudaError_t;
typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef void *cudaStream_t; /* struct CUstream_st *, as CUstream */

/* The codes the library returns (cuda_runtime_api.h / cuda.h values). */
#define PRE_CUDA_SUCCESS 0
#define PRE_CUDA_INVALID_VALUE 1    /* cudaErrorInvalidValue, CUDA_ERROR_INVALID_VALUE */
#define PRE_CUDA_OUT_OF_MEMORY 2    /* cudaErrorMemoryAllocation, CUDA_ERROR_OUT_OF_MEMORY */
#define PRE_CUDA_NOT_INITIALIZED 3  /* cudaErrorInitializationError, CUDA_ERROR_NOT_INITIALIZED */
#define PRE_CUDA_NOT_FOUND 500      /* cudaErrorSymbolNotFound, CUDA_ERROR_NOT_FOUND */
#define PRE_CUDA_NOT_SUPPORTED 801  /* cudaErrorNotSupported, CUDA_ERROR_NOT_SUPPORTED */

/* The driver entry points gmb routes, as getproc.c knows them: each has
 * the driver's function that a caller would otherwise get (the "real"
 * one, for pass-through and for pointers that are not gmb's). */
enum pre_drv {
  PRE_DRV_MEM_ALLOC,          /* cuMemAlloc_v2 */
  PRE_DRV_MEM_FREE,           /* cuMemFree_v2 */
  PRE_DRV_MEM_GET_INFO,       /* cuMemGetInfo_v2 */
  PRE_DRV_DEVICE_TOTAL_MEM,   /* cuDeviceTotalMem_v2 */
  PRE_DRV_MEM_ALLOC_ASYNC,    /* cuMemAllocAsync */
  PRE_DRV_MEM_ALLOC_ASYNC_PTSZ,
  PRE_DRV_MEM_FREE_ASYNC,     /* cuMemFreeAsync */
  PRE_DRV_MEM_FREE_ASYNC_PTSZ,
  PRE_DRV_MEM_CREATE,         /* cuMemCreate */
  PRE_DRV_MEM_RELEASE,        /* cuMemRelease */
  PRE_DRV_IPC_GET_MEM_HANDLE, /* cuIpcGetMemHandle */
  PRE_DRV_COUNT
};

/*
 * The driver's own function for `which`, or NULL when the process has
 * none: the definition after this library (dlsym(RTLD_NEXT)), else the
 * one the driver's cuGetProcAddress gives (the driver this process loaded,
 * seen through dlsym or $GMB_LIBCUDA / libcuda.so.1 when already loaded).
 * Never one of this library's functions.
 */
void *gmb__pre_drv_real(enum pre_drv which);

/* The driver's own `name` at the ABI of CUDA `version` (what the driver's
 * cuGetProcAddress gives, never this library's function), for a call
 * gmb makes on the program's behalf that the program may have no link to
 * (the static runtime opens the driver RTLD_LOCAL).  NULL when the
 * process has no driver or it lacks the name. */
void *gmb__pre_drv_lookup(const char *name, int version);

/* The definition of `name` after this library (dlsym(RTLD_NEXT)), else
 * the one a library's handle gave when dlsym on it was answered with this
 * library's function instead (getproc.c): for the runtime's and NVML's
 * functions this library defines.  NULL when the process has none. */
void *gmb__pre_named_real(const char *name);

/* `name` (which this library does not define) from the library that
 * defines `known`, one of those gmb__pre_named_real serves: after this
 * library, else on the handle `known` was looked up on.  NULL if none. */
void *gmb__pre_sibling_real(const char *known, const char *name);

/* The one-line-once message for "no broker" and the fallback decision
 * (preload.c): the session of `device` (-1: the calling thread's current
 * one), or NULL with *pass set when the caller should call its real
 * function (have_real says it has one) and *code the CUDA code to return
 * otherwise. */
gmb_client *gmb__pre_session(const char *what, int device, int have_real,
                             int *pass, int *code);

/* With GMB_PRELOAD_VERBOSE=1, one line for a refusal. */
void gmb__pre_say_refused(const char *what, size_t size, int rc,
                          gmb_client *c);

/*
 * The memory figures every interface reports (cudaMemGetInfo,
 * cuMemGetInfo, NVML): total = the tenant's quota, free = quota - used
 * (the tenant's VMM bytes, vmm.c, are in `used`), or, for a
 * tenant without a quota, what the broker could still give it (see
 * preload.c), for which `real` (may be NULL) gives the device's own
 * figures (called with `arg`; 0 or its own error code).  0, a negative
 * GMB_E_* code, or the real function's positive code.
 */
typedef gmb__shim_real_figures_fn gmb__pre_real_figures_fn;
int gmb__pre_figures(gmb_client *c, gmb__pre_real_figures_fn real,
                     void *arg, uint64_t *freep, uint64_t *totalp);

/* Bytes of this process's live cuMemCreate allocations on devices, as
 * the brokers were told (vmm.c). */
uint64_t gmb__pre_vmm_bytes(void);

/* Exported (interposed) functions that other parts hand out. */
GMB_SHIM_API CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize);
GMB_SHIM_API CUresult cuMemFree_v2(CUdeviceptr dptr);
GMB_SHIM_API CUresult cuMemGetInfo_v2(size_t *free, size_t *total);
GMB_SHIM_API CUresult cuDeviceTotalMem_v2(size_t *bytes, int dev);
GMB_SHIM_API CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize,
                                      cudaStream_t stream);
GMB_SHIM_API CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize,
                                           cudaStream_t stream);
GMB_SHIM_API CUresult cuMemFreeAsync(CUdeviceptr dptr, cudaStream_t stream);
GMB_SHIM_API CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr,
                                          cudaStream_t stream);
GMB_SHIM_API CUresult cuMemCreate(CUmemGenericAllocationHandle *handle,
                                  size_t size, const void *prop,
                                  unsigned long long flags);
GMB_SHIM_API CUresult cuMemRelease(CUmemGenericAllocationHandle handle);
GMB_SHIM_API CUresult cuIpcGetMemHandle(void *handle, CUdeviceptr dptr);
GMB_SHIM_API cudaError_t cudaIpcGetMemHandle(void *handle, void *devPtr);

#endif /* GMB_PRELOAD_H */
