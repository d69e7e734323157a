/*
 * cudrv_abi.c - compile-time check of proto/cudrv.h against the toolkit's
 * cuda.h (mk/cuda.mk compiles it only where cuda.h is installed; the object
 * is not linked anywhere).  A separate translation unit because cuda.h's
 * macros (#define cuMemAlloc cuMemAlloc_v2) would rename the members of
 * struct gmb_cudrv.
 */
#include GMB_CUDA_H

#include "cudrv.h"

_Static_assert(CUDA_VERSION >= 12000, "cuda.h older than 12.0");
_Static_assert(sizeof(gmb_cu_result) == sizeof(CUresult), "CUresult");
_Static_assert(sizeof(gmb_cu_ptr) == sizeof(CUdeviceptr), "CUdeviceptr");
_Static_assert(sizeof(gmb_cu_device) == sizeof(CUdevice), "CUdevice");
_Static_assert(sizeof(gmb_cu_ctx) == sizeof(CUcontext), "CUcontext");
_Static_assert(sizeof(gmb_cu_stream) == sizeof(CUstream), "CUstream");
_Static_assert(sizeof(gmb_cu_ipc_handle) == sizeof(CUipcMemHandle),
               "CUipcMemHandle");
_Static_assert(sizeof(gmb_cu_ipc_handle) == CU_IPC_HANDLE_SIZE,
               "CU_IPC_HANDLE_SIZE");
_Static_assert(GMB_CU_SUCCESS == CUDA_SUCCESS, "CUDA_SUCCESS");
_Static_assert(GMB_CU_IPC_LAZY_ENABLE_PEER_ACCESS ==
                   (unsigned)CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS,
               "CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS");
_Static_assert(CU_GET_PROC_ADDRESS_DEFAULT == 0, "CU_GET_PROC_ADDRESS_DEFAULT");
_Static_assert(CUDA_ERROR_NO_DEVICE == 100 && CUDA_ERROR_ALREADY_MAPPED == 208 &&
                   CUDA_ERROR_INVALID_HANDLE == 400 &&
                   CUDA_ERROR_NOT_FOUND == 500,
               "error codes the fake driver uses");

/* The macros map the names cudrv.c asks for to the ABI cudrv.h describes:
 * each real function must convert to the member's pointer type with the
 * result type alone differing (CUresult is an enum, gmb_cu_result an int). */
#define ABI(member, real, ...)                                              \
  static CUresult (*abi_##member)(__VA_ARGS__) __attribute__((unused)) = real
ABI(cuMemAlloc, cuMemAlloc, CUdeviceptr *, size_t);
ABI(cuMemFree, cuMemFree, CUdeviceptr);
ABI(cuMemGetInfo, cuMemGetInfo, size_t *, size_t *);
ABI(cuMemcpyDtoD, cuMemcpyDtoD, CUdeviceptr, CUdeviceptr, size_t);
ABI(cuMemcpyDtoDAsync, cuMemcpyDtoDAsync, CUdeviceptr, CUdeviceptr, size_t,
    CUstream);
ABI(cuMemcpyHtoD, cuMemcpyHtoD, CUdeviceptr, const void *, size_t);
ABI(cuMemcpyDtoH, cuMemcpyDtoH, void *, CUdeviceptr, size_t);
ABI(cuIpcOpenMemHandle, cuIpcOpenMemHandle, CUdeviceptr *, CUipcMemHandle,
    unsigned int);
ABI(cuIpcGetMemHandle, cuIpcGetMemHandle, CUipcMemHandle *, CUdeviceptr);
ABI(cuIpcCloseMemHandle, cuIpcCloseMemHandle, CUdeviceptr);
ABI(cuDevicePrimaryCtxRelease, cuDevicePrimaryCtxRelease, CUdevice);
ABI(cuDevicePrimaryCtxRetain, cuDevicePrimaryCtxRetain, CUcontext *, CUdevice);
ABI(cuStreamDestroy, cuStreamDestroy, CUstream);
ABI(cuStreamCreate, cuStreamCreate, CUstream *, unsigned int);
ABI(cuLaunchHostFunc, cuLaunchHostFunc, CUstream, CUhostFn, void *);
ABI(cuDeviceGetName, cuDeviceGetName, char *, int, CUdevice);
