/*
 * cudrv_abi.c - compile-time check of proto/cudrv.h against the toolkit's
 * cuda.h (mk/cuda.mk compiles it only where cuda.h is installed; the object
 * is not linked anywhere).  A separate translation unit because cuda.h's
 * macros (#define cuMemAlloc cuMemAlloc_v2) would rename the members of
 * struct gmb_cudrv.
 *
 * What is held to cuda.h: every type's size, every field's offset in the
 * structures passed by pointer (CUmemAllocationProp, CUmemAccessDesc), the
 * value of every constant gmb passes or tests for, and each entry point's
 * prototype (the ABI() lines).
 */
#include GMB_CUDA_H

#include <stddef.h>

#include "cudrv.h"

#define SAME_SIZE(ours, theirs) \
  _Static_assert(sizeof(ours) == sizeof(theirs), #theirs " size")
#define SAME_OFFSET(ours, of, theirs, tf)                       \
  _Static_assert(offsetof(ours, of) == offsetof(theirs, tf),    \
                 #theirs "." #tf " offset")
#define SAME_VALUE(ours, theirs) \
  _Static_assert((long long)(ours) == (long long)(theirs), #theirs)

_Static_assert(CUDA_VERSION >= 12000, "cuda.h older than 12.0");
SAME_SIZE(gmb_cu_result, CUresult);
SAME_SIZE(gmb_cu_ptr, CUdeviceptr);
SAME_SIZE(gmb_cu_device, CUdevice);
SAME_SIZE(gmb_cu_ctx, CUcontext);
SAME_SIZE(gmb_cu_stream, CUstream);
SAME_SIZE(gmb_cu_mem_handle, CUmemGenericAllocationHandle);

/* The enums gmb passes as int. */
SAME_SIZE(int, CUdevice_attribute);
SAME_SIZE(int, CUmemAllocationType);
SAME_SIZE(int, CUmemAllocationHandleType);
SAME_SIZE(int, CUmemLocationType);
SAME_SIZE(int, CUmemAccess_flags);
SAME_SIZE(int, CUmemAllocationGranularity_flags);

SAME_SIZE(struct gmb_cu_mem_location, CUmemLocation);
SAME_OFFSET(struct gmb_cu_mem_location, type, CUmemLocation, type);
SAME_OFFSET(struct gmb_cu_mem_location, id, CUmemLocation, id);

SAME_SIZE(struct gmb_cu_mem_prop, CUmemAllocationProp);
SAME_OFFSET(struct gmb_cu_mem_prop, type, CUmemAllocationProp, type);
SAME_OFFSET(struct gmb_cu_mem_prop, requested_handle_types,
            CUmemAllocationProp, requestedHandleTypes);
SAME_OFFSET(struct gmb_cu_mem_prop, location, CUmemAllocationProp, location);
SAME_OFFSET(struct gmb_cu_mem_prop, win32_handle_meta_data,
            CUmemAllocationProp, win32HandleMetaData);
SAME_OFFSET(struct gmb_cu_mem_prop, alloc_flags, CUmemAllocationProp,
            allocFlags);
SAME_OFFSET(struct gmb_cu_mem_prop, alloc_flags.compression_type,
            CUmemAllocationProp, allocFlags.compressionType);
SAME_OFFSET(struct gmb_cu_mem_prop, alloc_flags.gpu_direct_rdma_capable,
            CUmemAllocationProp, allocFlags.gpuDirectRDMACapable);
SAME_OFFSET(struct gmb_cu_mem_prop, alloc_flags.usage, CUmemAllocationProp,
            allocFlags.usage);
SAME_OFFSET(struct gmb_cu_mem_prop, alloc_flags.reserved, CUmemAllocationProp,
            allocFlags.reserved);

SAME_SIZE(struct gmb_cu_access_desc, CUmemAccessDesc);
SAME_OFFSET(struct gmb_cu_access_desc, location, CUmemAccessDesc, location);
SAME_OFFSET(struct gmb_cu_access_desc, flags, CUmemAccessDesc, flags);

SAME_VALUE(GMB_CU_SUCCESS, CUDA_SUCCESS);
SAME_SIZE(int, CUstreamCaptureMode);
SAME_VALUE(GMB_CU_STREAM_CAPTURE_MODE_RELAXED, CU_STREAM_CAPTURE_MODE_RELAXED);
SAME_VALUE(GMB_CU_ERROR_STREAM_CAPTURE_UNSUPPORTED,
           CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
SAME_VALUE(GMB_CU_ERROR_STREAM_CAPTURE_IMPLICIT,
           CUDA_ERROR_STREAM_CAPTURE_IMPLICIT);
SAME_VALUE(GMB_CU_ERROR_INVALID_VALUE, CUDA_ERROR_INVALID_VALUE);
SAME_VALUE(GMB_CU_ERROR_OUT_OF_MEMORY, CUDA_ERROR_OUT_OF_MEMORY);
SAME_VALUE(GMB_CU_ERROR_NOT_INITIALIZED, CUDA_ERROR_NOT_INITIALIZED);
SAME_VALUE(GMB_CU_ERROR_INVALID_CONTEXT, CUDA_ERROR_INVALID_CONTEXT);
SAME_VALUE(GMB_CU_ERROR_NOT_SUPPORTED, CUDA_ERROR_NOT_SUPPORTED);
SAME_VALUE(GMB_CU_STREAM_NON_BLOCKING, CU_STREAM_NON_BLOCKING);
SAME_VALUE(GMB_CU_MEM_ALLOCATION_TYPE_PINNED, CU_MEM_ALLOCATION_TYPE_PINNED);
SAME_VALUE(GMB_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
           CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
SAME_VALUE(GMB_CU_MEM_LOCATION_TYPE_DEVICE, CU_MEM_LOCATION_TYPE_DEVICE);
SAME_VALUE(GMB_CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
           CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
SAME_VALUE(GMB_CU_MEM_ALLOC_GRANULARITY_MINIMUM,
           CU_MEM_ALLOC_GRANULARITY_MINIMUM);
SAME_VALUE(GMB_CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
           CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED);
SAME_VALUE(GMB_CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
           CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED);
SAME_VALUE(GMB_CU_DEVICE_ATTRIBUTE_COMPUTE_MODE,
           CU_DEVICE_ATTRIBUTE_COMPUTE_MODE);
SAME_VALUE(GMB_CU_COMPUTEMODE_DEFAULT, CU_COMPUTEMODE_DEFAULT);
SAME_VALUE(GMB_CU_COMPUTEMODE_PROHIBITED, CU_COMPUTEMODE_PROHIBITED);
SAME_VALUE(GMB_CU_COMPUTEMODE_EXCLUSIVE_PROCESS,
           CU_COMPUTEMODE_EXCLUSIVE_PROCESS);
SAME_VALUE(GMB_CU_STREAM_CAPTURE_STATUS_NONE, CU_STREAM_CAPTURE_STATUS_NONE);
SAME_VALUE(GMB_CU_STREAM_CAPTURE_STATUS_ACTIVE,
           CU_STREAM_CAPTURE_STATUS_ACTIVE);
SAME_VALUE(GMB_CU_STREAM_CAPTURE_STATUS_INVALIDATED,
           CU_STREAM_CAPTURE_STATUS_INVALIDATED);
SAME_SIZE(int, CUstreamCaptureStatus);
SAME_SIZE(struct gmb_cu_uuid, CUuuid);
SAME_OFFSET(struct gmb_cu_uuid, bytes, CUuuid, bytes);
SAME_VALUE(0, CU_GET_PROC_ADDRESS_DEFAULT);
/* The other error codes the fake driver (tests/fakecuda) returns. */
SAME_VALUE(100, CUDA_ERROR_NO_DEVICE);
SAME_VALUE(101, CUDA_ERROR_INVALID_DEVICE);
SAME_VALUE(400, CUDA_ERROR_INVALID_HANDLE);
SAME_VALUE(500, CUDA_ERROR_NOT_FOUND);
SAME_VALUE(GMB_CU_ERROR_NOT_READY, CUDA_ERROR_NOT_READY);
SAME_VALUE(GMB_CU_ERROR_INVALID_HANDLE, CUDA_ERROR_INVALID_HANDLE);
SAME_VALUE(GMB_CU_ERROR_INVALID_CONTEXT, CUDA_ERROR_INVALID_CONTEXT);
SAME_VALUE(GMB_CU_ERROR_CONTEXT_IS_DESTROYED, CUDA_ERROR_CONTEXT_IS_DESTROYED);
SAME_VALUE(GMB_CU_EVENT_DISABLE_TIMING, CU_EVENT_DISABLE_TIMING);
SAME_VALUE(GMB_CU_MEMHOSTALLOC_PORTABLE, CU_MEMHOSTALLOC_PORTABLE);

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
ABI(cuMemsetD8, cuMemsetD8, CUdeviceptr, unsigned char, size_t);
ABI(cuMemHostAlloc, cuMemHostAlloc, void **, size_t, unsigned int);
ABI(cuMemFreeHost, cuMemFreeHost, void *);
ABI(cuDevicePrimaryCtxRelease, cuDevicePrimaryCtxRelease, CUdevice);
ABI(cuDevicePrimaryCtxRetain, cuDevicePrimaryCtxRetain, CUcontext *, CUdevice);
ABI(cuStreamDestroy, cuStreamDestroy, CUstream);
ABI(cuStreamCreate, cuStreamCreate, CUstream *, unsigned int);
ABI(cuLaunchHostFunc, cuLaunchHostFunc, CUstream, CUhostFn, void *);
ABI(cuEventCreate, cuEventCreate, CUevent *, unsigned int);
ABI(cuEventRecord, cuEventRecord, CUevent, CUstream);
ABI(cuEventQuery, cuEventQuery, CUevent);
ABI(cuEventDestroy, cuEventDestroy, CUevent);
ABI(cuDeviceGetName, cuDeviceGetName, char *, int, CUdevice);
ABI(cuDeviceGetUuid, cuDeviceGetUuid, CUuuid *, CUdevice);
ABI(cuDeviceGetPCIBusId, cuDeviceGetPCIBusId, char *, int, CUdevice);
ABI(cuCtxSynchronize, cuCtxSynchronize, void);
ABI(cuCtxDestroy, cuCtxDestroy_v2, CUcontext);
/* cuda.h 13 declares only cuCtxCreate_v4 (with a parameters structure);
 * the 12.0 ABI asked for by version is cuCtxCreate_v2, declared here as
 * the 12.x headers did. */
CUresult CUDAAPI cuCtxCreate_v2(CUcontext *pctx, unsigned int flags,
                                CUdevice dev);
ABI(cuCtxCreate, cuCtxCreate_v2, CUcontext *, unsigned int, CUdevice);
ABI(cuCtxGetDevice, cuCtxGetDevice, CUdevice *);
ABI(cuStreamIsCapturing, cuStreamIsCapturing, CUstream,
    CUstreamCaptureStatus *);
ABI(cuDeviceGetAttribute, cuDeviceGetAttribute, int *, CUdevice_attribute,
    CUdevice);
ABI(cuMemGetAllocationGranularity, cuMemGetAllocationGranularity, size_t *,
    const CUmemAllocationProp *, CUmemAllocationGranularity_flags);
ABI(cuMemCreate, cuMemCreate, CUmemGenericAllocationHandle *, size_t,
    const CUmemAllocationProp *, unsigned long long);
ABI(cuMemRelease, cuMemRelease, CUmemGenericAllocationHandle);
ABI(cuMemExportToShareableHandle, cuMemExportToShareableHandle, void *,
    CUmemGenericAllocationHandle, CUmemAllocationHandleType,
    unsigned long long);
ABI(cuMemImportFromShareableHandle, cuMemImportFromShareableHandle,
    CUmemGenericAllocationHandle *, void *, CUmemAllocationHandleType);
ABI(cuMemAddressReserve, cuMemAddressReserve, CUdeviceptr *, size_t, size_t,
    CUdeviceptr, unsigned long long);
ABI(cuMemAddressFree, cuMemAddressFree, CUdeviceptr, size_t);
ABI(cuMemMap, cuMemMap, CUdeviceptr, size_t, size_t,
    CUmemGenericAllocationHandle, unsigned long long);
ABI(cuMemUnmap, cuMemUnmap, CUdeviceptr, size_t);
ABI(cuThreadExchangeStreamCaptureMode, cuThreadExchangeStreamCaptureMode,
    CUstreamCaptureMode *);
ABI(cuDeviceCanAccessPeer, cuDeviceCanAccessPeer, int *, CUdevice, CUdevice);
ABI(cuMemSetAccess, cuMemSetAccess, CUdeviceptr, size_t,
    const CUmemAccessDesc *, size_t);
