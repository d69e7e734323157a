/*
 * cudrv.h - the CUDA driver API, loaded at run time.
 *
 * gmb never links against CUDA: the broker and the client library dlopen
 * libcuda.so.1 when they meet a cuda device, so one binary runs on hosts
 * with and without a GPU.  Every entry point is looked up with
 * cuGetProcAddress (the versioned one the header's macros would pick), so
 * a newer driver gives the ABI this code was written for.  The types are
 * declared here rather than taken from cuda.h, so that gmb builds where the
 * toolkit is not installed; tests/fakecuda/cudrv_abi.c checks them against
 * cuda.h with static asserts where it is (sizes, offsets, values).
 *
 * Device memory is shared between processes only through the virtual
 * memory management API with POSIX file descriptors (cuMemCreate,
 * cuMemExportToShareableHandle, cuMemImportFromShareableHandle): the
 * legacy cuIpc* handles are not used (their lifetime rules and their need
 * of a shared PID namespace make them unfit for containers).  cuMemAlloc
 * stays for scratch memory that is never shared (tests, GPU figures).
 *
 * $GMB_LIBCUDA names another library to load instead (tests load a fake
 * driver built on memfd, tests/fakecuda/).
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
typedef void (*gmb_cu_host_fn)(void *user);     /* CUhostFn */
typedef struct gmb_cu_event_st *gmb_cu_event;   /* CUevent */

/* The virtual memory management (VMM) API.  A generic allocation handle
 * names physical memory (cuMemCreate, or an import); it is mapped into a
 * range of virtual addresses reserved apart (cuMemAddressReserve, cuMemMap)
 * and made accessible (cuMemSetAccess).  The physical memory is freed when
 * every handle to it is released, every mapping of it unmapped and every
 * shareable descriptor of it closed, in every process. */
typedef unsigned long long gmb_cu_mem_handle; /* CUmemGenericAllocationHandle */

struct gmb_cu_mem_location { /* CUmemLocation */
  int type;                  /* CUmemLocationType */
  int id;                    /* the device ordinal for a device location */
};

struct gmb_cu_mem_prop {        /* CUmemAllocationProp */
  int type;                     /* CUmemAllocationType */
  int requested_handle_types;   /* CUmemAllocationHandleType, a bit set */
  struct gmb_cu_mem_location location;
  void *win32_handle_meta_data; /* Windows only; NULL */
  struct {
    unsigned char compression_type;
    unsigned char gpu_direct_rdma_capable;
    unsigned short usage;
    unsigned char reserved[4];
  } alloc_flags;
};

struct gmb_cu_access_desc { /* CUmemAccessDesc */
  struct gmb_cu_mem_location location;
  int flags; /* CUmemAccess_flags */
};

#define GMB_CU_SUCCESS 0
#define GMB_CU_ERROR_INVALID_VALUE 1
#define GMB_CU_ERROR_OUT_OF_MEMORY 2
#define GMB_CU_ERROR_NOT_INITIALIZED 3
#define GMB_CU_ERROR_INVALID_CONTEXT 201
#define GMB_CU_ERROR_CONTEXT_IS_DESTROYED 709
#define GMB_CU_ERROR_INVALID_HANDLE 400
#define GMB_CU_ERROR_NOT_READY 600
#define GMB_CU_EVENT_DISABLE_TIMING 0x2u
#define GMB_CU_ERROR_NOT_SUPPORTED 801
#define GMB_CU_STREAM_NON_BLOCKING 0x1u
#define GMB_CU_MEMHOSTALLOC_PORTABLE 0x1u
#define GMB_CU_MEM_ALLOCATION_TYPE_PINNED 0x1
#define GMB_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR 0x1
#define GMB_CU_MEM_LOCATION_TYPE_DEVICE 0x1
#define GMB_CU_MEM_ACCESS_FLAGS_PROT_READWRITE 0x3
#define GMB_CU_MEM_ALLOC_GRANULARITY_MINIMUM 0x0
#define GMB_CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED 102
#define GMB_CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED 103
#define GMB_CU_DEVICE_ATTRIBUTE_COMPUTE_MODE 20
#define GMB_CU_COMPUTEMODE_DEFAULT 0
#define GMB_CU_COMPUTEMODE_PROHIBITED 2
#define GMB_CU_COMPUTEMODE_EXCLUSIVE_PROCESS 3
#define GMB_CU_STREAM_CAPTURE_STATUS_NONE 0
#define GMB_CU_STREAM_CAPTURE_STATUS_ACTIVE 1
#define GMB_CU_STREAM_CAPTURE_STATUS_INVALIDATED 2
#define GMB_CU_STREAM_CAPTURE_MODE_RELAXED 2
#define GMB_CU_ERROR_STREAM_CAPTURE_UNSUPPORTED 900
#define GMB_CU_ERROR_STREAM_CAPTURE_IMPLICIT 906

/* CUuuid: a GPU's identity, the same in every process and container
 * whatever ordinal it has there. */
struct gmb_cu_uuid {
  char bytes[16];
};
/* "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" (as nvidia-smi -L prints it)
 * and its NUL. */
#define GMB_CU_UUID_STR 41

struct gmb_cudrv {
  void *lib;
  char path[256]; /* what was loaded */
  int version;    /* cuDriverGetVersion */
  gmb_cu_result (*cuInit)(unsigned flags);
  gmb_cu_result (*cuDriverGetVersion)(int *v);
  gmb_cu_result (*cuDeviceGetCount)(int *n);
  gmb_cu_result (*cuDeviceGet)(gmb_cu_device *d, int ordinal);
  gmb_cu_result (*cuDeviceGetName)(char *name, int len, gmb_cu_device d);
  gmb_cu_result (*cuDeviceGetUuid)(struct gmb_cu_uuid *uuid, gmb_cu_device d);
  gmb_cu_result (*cuDeviceGetPCIBusId)(char *bus, int len, gmb_cu_device d);
  gmb_cu_result (*cuDevicePrimaryCtxRetain)(gmb_cu_ctx *c, gmb_cu_device d);
  gmb_cu_result (*cuDevicePrimaryCtxRelease)(gmb_cu_device d);
  gmb_cu_result (*cuCtxSetCurrent)(gmb_cu_ctx c);
  gmb_cu_result (*cuCtxGetCurrent)(gmb_cu_ctx *c);
  gmb_cu_result (*cuCtxGetDevice)(gmb_cu_device *d);
  gmb_cu_result (*cuCtxSynchronize)(void);
  /* cuCtxCreate_v2 (asked for at version 3020: at 12000 the driver hands
   * back _v3, which takes execution-affinity arguments) and
   * cuCtxDestroy_v2: the broker measures
   * what a context costs on its GPU with a throwaway one. */
  gmb_cu_result (*cuCtxCreate)(gmb_cu_ctx *c, unsigned flags, gmb_cu_device d);
  gmb_cu_result (*cuCtxDestroy)(gmb_cu_ctx c);
  gmb_cu_result (*cuMemGetInfo)(size_t *free, size_t *total);
  gmb_cu_result (*cuMemAlloc)(gmb_cu_ptr *p, size_t bytes);
  gmb_cu_result (*cuMemFree)(gmb_cu_ptr p);
  gmb_cu_result (*cuMemcpyDtoD)(gmb_cu_ptr dst, gmb_cu_ptr src, size_t n);
  gmb_cu_result (*cuMemcpyDtoDAsync)(gmb_cu_ptr dst, gmb_cu_ptr src, size_t n,
                                     gmb_cu_stream s);
  gmb_cu_result (*cuMemcpyHtoD)(gmb_cu_ptr dst, const void *src, size_t n);
  gmb_cu_result (*cuMemcpyDtoH)(void *dst, gmb_cu_ptr src, size_t n);
  /* The broker clears every segment it makes before a tenant gets it. */
  gmb_cu_result (*cuMemsetD8)(gmb_cu_ptr dst, unsigned char v, size_t n);
  /* Pinned (page-locked) host memory, which the copies above move at the
   * bus's full speed: the library's host copies of paused memory, and the
   * broker's copies of the movable allocations it offloads.  Flags:
   * GMB_CU_MEMHOSTALLOC_PORTABLE (every context may use it). */
  gmb_cu_result (*cuMemHostAlloc)(void **p, size_t bytes, unsigned flags);
  gmb_cu_result (*cuMemFreeHost)(void *p);
  gmb_cu_result (*cuStreamCreate)(gmb_cu_stream *s, unsigned flags);
  gmb_cu_result (*cuStreamSynchronize)(gmb_cu_stream s);
  gmb_cu_result (*cuStreamDestroy)(gmb_cu_stream s);
  /* *status: GMB_CU_STREAM_CAPTURE_STATUS_* (CUstreamCaptureStatus). */
  gmb_cu_result (*cuStreamIsCapturing)(gmb_cu_stream s, int *status);
  gmb_cu_result (*cuLaunchHostFunc)(gmb_cu_stream s, gmb_cu_host_fn fn,
                                    void *user);
  /* Events (the stream-ordered cache): cuEventQuery answers
   * GMB_CU_ERROR_NOT_READY while the work before the last record runs. */
  gmb_cu_result (*cuEventCreate)(gmb_cu_event *e, unsigned flags);
  gmb_cu_result (*cuEventRecord)(gmb_cu_event e, gmb_cu_stream s);
  gmb_cu_result (*cuEventQuery)(gmb_cu_event e);
  gmb_cu_result (*cuEventDestroy)(gmb_cu_event e);
  gmb_cu_result (*cuDeviceGetAttribute)(int *v, int attrib, gmb_cu_device d);
  gmb_cu_result (*cuMemGetAllocationGranularity)(
      size_t *granularity, const struct gmb_cu_mem_prop *prop, int option);
  gmb_cu_result (*cuMemCreate)(gmb_cu_mem_handle *h, size_t size,
                               const struct gmb_cu_mem_prop *prop,
                               unsigned long long flags);
  gmb_cu_result (*cuMemRelease)(gmb_cu_mem_handle h);
  /* For a POSIX-fd handle type, `shareable` points to an int that receives
   * a new descriptor, which the caller owns. */
  gmb_cu_result (*cuMemExportToShareableHandle)(void *shareable,
                                                gmb_cu_mem_handle h, int type,
                                                unsigned long long flags);
  /* For a POSIX-fd handle type, `os_handle` is the descriptor itself,
   * (void *)(uintptr_t)fd; the caller keeps it (and closes it). */
  gmb_cu_result (*cuMemImportFromShareableHandle)(gmb_cu_mem_handle *h,
                                                  void *os_handle, int type);
  gmb_cu_result (*cuMemAddressReserve)(gmb_cu_ptr *p, size_t size,
                                       size_t alignment, gmb_cu_ptr addr,
                                       unsigned long long flags);
  gmb_cu_result (*cuMemAddressFree)(gmb_cu_ptr p, size_t size);
  gmb_cu_result (*cuMemMap)(gmb_cu_ptr p, size_t size, size_t offset,
                            gmb_cu_mem_handle h, unsigned long long flags);
  gmb_cu_result (*cuMemUnmap)(gmb_cu_ptr p, size_t size);
  gmb_cu_result (*cuMemSetAccess)(gmb_cu_ptr p, size_t size,
                                  const struct gmb_cu_access_desc *desc,
                                  size_t count);
  gmb_cu_result (*cuGetErrorName)(gmb_cu_result r, const char **s);
  gmb_cu_result (*cuGetErrorString)(gmb_cu_result r, const char **s);
  /* *mode: GMB_CU_STREAM_CAPTURE_MODE_* in, this thread's previous mode
   * out (CUstreamCaptureMode). */
  gmb_cu_result (*cuThreadExchangeStreamCaptureMode)(int *mode);
  gmb_cu_result (*cuDeviceCanAccessPeer)(int *can, gmb_cu_device d,
                                         gmb_cu_device peer);
};

/*
 * Loads the driver ($GMB_LIBCUDA, else libcuda.so.1), resolves every entry
 * point and calls cuInit(0).  0, or GMB_E_DEVICE with one line in err
 * ("no CUDA driver: libcuda.so.1: cannot open shared object file", "the
 * driver ... lacks cuMemCreate", "cuInit: CUDA_ERROR_NO_DEVICE: ...").
 */
int gmb__cudrv_load(struct gmb_cudrv *d, char *err, size_t errcap);
void gmb__cudrv_unload(struct gmb_cudrv *d); /* accepts a zeroed struct */

/* A UUID as "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" into buf (at least
 * GMB_CU_UUID_STR bytes); returns buf. */
const char *gmb__cudrv_uuid_str(const struct gmb_cu_uuid *u, char *buf,
                                size_t cap);

/* "CUDA_ERROR_OUT_OF_MEMORY: out of memory" into buf; returns buf. */
const char *gmb__cudrv_strerror(const struct gmb_cudrv *d, gmb_cu_result r,
                                char *buf, size_t cap);

#endif /* GMB_CUDRV_H */
