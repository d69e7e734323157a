/*
 * device_cuda.c - the cuda device: GPU N through the CUDA driver API,
 * loaded at run time (proto/cudrv.h), so one broker binary runs with and
 * without a GPU.
 *
 * Segments come from the virtual memory management (VMM) API and are
 * shared as POSIX file descriptors:
 *
 *   seg_new   cuMemCreate (pinned memory on this GPU, a multiple of the
 *             allocation granularity, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
 *             requested), cuMemExportToShareableHandle into seg->fd, and a
 *             mapping of the broker's own (cuMemAddressReserve, cuMemMap,
 *             cuMemSetAccess) for the compaction copies.  A client maps
 *             a segment from a copy of seg->fd sent over the descriptor
 *             channel: cuMemImportFromShareableHandle + reserve + map on
 *             its side (client/lib/cuimport.c).
 *   seg_free  cuMemUnmap, cuMemAddressFree, cuMemRelease, close(seg->fd).
 *
 * Lifetimes.  The driver counts references to physical memory: it is
 * freed when every handle to it is released, every mapping of it unmapped
 * and every descriptor of it closed, in every process.  So seg_free gives
 * back only the broker's references, and a client that still maps the
 * segment (evicted, stopped, slow to read its events) keeps its memory
 * valid until it unmaps or dies; nothing is ever undefined behaviour.  The
 * ops still set free_waits_for_holders: device.c keeps counting a retired
 * segment ("retiring") until every session that mapped it said it unmapped
 * it or is gone, because until then the GPU really holds those bytes and
 * the broker must not promise them to anyone else.  seg->fd is owned here
 * from seg_new to seg_free; the descriptor channel sends copies of it.
 *
 * The broker never touches device memory except through `copy`, a
 * cuMemcpyDtoDAsync between its own mappings on its own stream followed by
 * a synchronize: the loop thread waits for it, which is what lets the
 * compactor commit a move once copy returns.  Ranges never overlap
 * (device.c refuses them; the compactor copies an overlapping slide in
 * chunks no larger than the shift), because the driver does not promise
 * memmove semantics.
 *
 * At open the device must support VMM and POSIX-fd handles (device
 * attributes), and its minimum allocation granularity must divide the
 * 2 MiB segment unit (GMB_SEGMENT_ALIGN; it is 2 MiB on every NVIDIA GPU
 * so far): otherwise the open fails with one line naming what is missing,
 * rather than rounding segments up and wasting memory the pool would not
 * see.
 *
 * Context: the device's primary context is retained at open and made
 * current on the loop thread, the only thread that calls these ops.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cudrv.h"
#include "device.h"
#include "gmb.h"
#include "log.h"
#include "util.h"

struct cuda_device {
  struct gmb_cudrv drv;
  int index;
  gmb_cu_device dev;
  gmb_cu_ctx ctx;
  gmb_cu_stream stream; /* the broker's copies */
  uint64_t granularity; /* divides GMB_SEGMENT_ALIGN */
};

struct cuda_seg {
  gmb_cu_mem_handle handle; /* released by seg_free */
  gmb_cu_ptr va;            /* the broker's mapping, for copies */
};

static const char *cuda_err(const struct cuda_device *cd, gmb_cu_result r,
                            char *buf, size_t cap) {
  return gmb__cudrv_strerror(&cd->drv, r, buf, cap);
}

static struct gmb_cu_mem_prop cuda_prop(const struct cuda_device *cd) {
  struct gmb_cu_mem_prop p;
  memset(&p, 0, sizeof p);
  p.type = GMB_CU_MEM_ALLOCATION_TYPE_PINNED;
  p.requested_handle_types = GMB_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  p.location.type = GMB_CU_MEM_LOCATION_TYPE_DEVICE;
  p.location.id = cd->index;
  return p;
}

static int cuda_seg_new(struct gmb_device *d, struct gmb_dseg *seg) {
  struct cuda_device *cd = d->priv;
  char why[160];
  size_t size = (size_t)seg->size;
  GMB_ASSERT(seg->size % cd->granularity == 0 &&
             "segment size not a multiple of the granularity");
  struct cuda_seg *cs = calloc(1, sizeof *cs);
  if (!cs) return GMB_E_NOMEM;
  struct gmb_cu_mem_prop prop = cuda_prop(cd);
  gmb_cu_result r = cd->drv.cuMemCreate(&cs->handle, size, &prop, 0);
  if (r != GMB_CU_SUCCESS) {
    /* Out of memory is an answer, not a fault: another process on the GPU
     * may hold what cuMemGetInfo showed free at start-up. */
    if (r == GMB_CU_ERROR_OUT_OF_MEMORY)
      log_warn("%s: cuMemCreate of %llu bytes: %s", d->desc,
               (unsigned long long)seg->size, cuda_err(cd, r, why, sizeof why));
    else
      log_error("%s: cuMemCreate of %llu bytes: %s", d->desc,
                (unsigned long long)seg->size,
                cuda_err(cd, r, why, sizeof why));
    free(cs);
    return r == GMB_CU_ERROR_OUT_OF_MEMORY ? GMB_E_NOMEM : GMB_E_DEVICE;
  }
  int fd = -1;
  int reserved = 0, mapped = 0;
  const char *step = "cuMemExportToShareableHandle";
  r = cd->drv.cuMemExportToShareableHandle(
      &fd, cs->handle, GMB_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
  if (r == GMB_CU_SUCCESS) {
    step = "cuMemAddressReserve";
    r = cd->drv.cuMemAddressReserve(&cs->va, size, (size_t)cd->granularity,
                                    0, 0);
  }
  if (r == GMB_CU_SUCCESS) {
    reserved = 1;
    step = "cuMemMap";
    r = cd->drv.cuMemMap(cs->va, size, 0, cs->handle, 0);
  }
  if (r == GMB_CU_SUCCESS) {
    mapped = 1;
    struct gmb_cu_access_desc rw = {
        {GMB_CU_MEM_LOCATION_TYPE_DEVICE, cd->index},
        GMB_CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    step = "cuMemSetAccess";
    r = cd->drv.cuMemSetAccess(cs->va, size, &rw, 1);
  }
  /* The physical memory may hold what another process or tenant left on
   * the GPU (the driver does not promise zeros): cleared before any
   * client maps it.  Segments are never shared between tenants and are
   * released when emptied, so clearing at creation covers every change
   * of tenant; it costs a device memset of the segment (about a
   * millisecond per GiB) and a wait for it. */
  if (r == GMB_CU_SUCCESS) {
    step = "cuMemsetD8";
    r = cd->drv.cuMemsetD8(cs->va, 0, size);
  }
  /* A memset of device memory may return before it ran: done before the
   * descriptor can reach a client, whose work runs in its own context. */
  if (r == GMB_CU_SUCCESS) {
    step = "cuCtxSynchronize";
    r = cd->drv.cuCtxSynchronize();
  }
  if (r != GMB_CU_SUCCESS) {
    log_error("%s: segment %llu of %llu bytes: %s: %s", d->desc,
              (unsigned long long)seg->id, (unsigned long long)seg->size,
              step, cuda_err(cd, r, why, sizeof why));
    if (mapped) cd->drv.cuMemUnmap(cs->va, size);
    if (reserved) cd->drv.cuMemAddressFree(cs->va, size);
    cd->drv.cuMemRelease(cs->handle);
    if (fd >= 0) close(fd);
    free(cs);
    return r == GMB_CU_ERROR_OUT_OF_MEMORY ? GMB_E_NOMEM : GMB_E_DEVICE;
  }
  seg->priv = cs;
  seg->host = NULL;
  seg->fd = fd;
  return 0;
}

static void cuda_seg_free(struct gmb_device *d, struct gmb_dseg *seg) {
  struct cuda_device *cd = d->priv;
  struct cuda_seg *cs = seg->priv;
  size_t size = (size_t)seg->size;
  char why[160];
  const char *step = "cuMemUnmap";
  gmb_cu_result r = cd->drv.cuMemUnmap(cs->va, size);
  if (r == GMB_CU_SUCCESS) {
    step = "cuMemAddressFree";
    r = cd->drv.cuMemAddressFree(cs->va, size);
  }
  if (r != GMB_CU_SUCCESS)
    log_error("%s: segment %llu: %s: %s", d->desc,
              (unsigned long long)seg->id, step,
              cuda_err(cd, r, why, sizeof why));
  /* The handle goes whatever the mapping did: leaking it would keep the
   * memory for the life of the broker. */
  r = cd->drv.cuMemRelease(cs->handle);
  if (r != GMB_CU_SUCCESS)
    log_error("%s: segment %llu: cuMemRelease: %s", d->desc,
              (unsigned long long)seg->id, cuda_err(cd, r, why, sizeof why));
  if (seg->fd >= 0) close(seg->fd);
  seg->fd = -1;
  free(cs);
  seg->priv = NULL;
}

static int cuda_copy(struct gmb_device *d, struct gmb_dseg *dst,
                     uint64_t dst_off, struct gmb_dseg *src, uint64_t src_off,
                     uint64_t len) {
  struct cuda_device *cd = d->priv;
  GMB_ASSERT((dst->id != src->id || dst_off + len <= src_off ||
              src_off + len <= dst_off) &&
             "cuda copy ranges overlap");
  gmb_cu_ptr to = ((struct cuda_seg *)dst->priv)->va + dst_off;
  gmb_cu_ptr from = ((struct cuda_seg *)src->priv)->va + src_off;
  char why[160];
  gmb_cu_result r =
      cd->drv.cuMemcpyDtoDAsync(to, from, (size_t)len, cd->stream);
  if (r == GMB_CU_SUCCESS) r = cd->drv.cuStreamSynchronize(cd->stream);
  if (r != GMB_CU_SUCCESS) {
    log_error("%s: copy of %llu bytes from segment %llu to %llu: %s",
              d->desc, (unsigned long long)len, (unsigned long long)src->id,
              (unsigned long long)dst->id, cuda_err(cd, r, why, sizeof why));
    return GMB_E_DEVICE;
  }
  return 0;
}

/* Page-locked host memory, so that an offload or a restore is one DMA at
 * the bus's speed rather than a copy through the driver's staging buffer.
 * The loop thread's context is current (open made it so). */
static void *cuda_host_alloc(struct gmb_device *d, uint64_t len) {
  struct cuda_device *cd = d->priv;
  void *p = NULL;
  char why[160];
  gmb_cu_result r = cd->drv.cuMemHostAlloc(&p, (size_t)len, 0);
  if (r != GMB_CU_SUCCESS) {
    log_warn("%s: %llu bytes of page-locked host memory: %s", d->desc,
             (unsigned long long)len, cuda_err(cd, r, why, sizeof why));
    return NULL;
  }
  return p;
}

static void cuda_host_free(struct gmb_device *d, void *p, uint64_t len) {
  struct cuda_device *cd = d->priv;
  (void)len;
  char why[160];
  gmb_cu_result r = cd->drv.cuMemFreeHost(p);
  if (r != GMB_CU_SUCCESS)
    log_warn("%s: cuMemFreeHost: %s", d->desc,
             cuda_err(cd, r, why, sizeof why));
}

static int cuda_copy_host(struct gmb_device *d, struct gmb_dseg *seg,
                          uint64_t off, void *p, uint64_t len, int to_host) {
  struct cuda_device *cd = d->priv;
  gmb_cu_ptr at = ((struct cuda_seg *)seg->priv)->va + off;
  char why[160];
  gmb_cu_result r = to_host ? cd->drv.cuMemcpyDtoH(p, at, (size_t)len)
                            : cd->drv.cuMemcpyHtoD(at, p, (size_t)len);
  if (r != GMB_CU_SUCCESS) {
    log_error("%s: copy of %llu bytes %s segment %llu: %s", d->desc,
              (unsigned long long)len, to_host ? "from" : "to",
              (unsigned long long)seg->id, cuda_err(cd, r, why, sizeof why));
    return GMB_E_DEVICE;
  }
  return 0;
}

static void cuda_destroy(struct gmb_device *d) {
  struct cuda_device *cd = d->priv;
  if (cd->stream) cd->drv.cuStreamDestroy(cd->stream);
  if (cd->ctx) cd->drv.cuDevicePrimaryCtxRelease(cd->dev);
  gmb__cudrv_unload(&cd->drv);
  free(cd);
  free(d);
}

static const struct gmb_device_ops cuda_ops = {
    .kind = "cuda",
    .seg_new = cuda_seg_new,
    .seg_free = cuda_seg_free,
    .copy = cuda_copy,
    .host_alloc = cuda_host_alloc,
    .host_free = cuda_host_free,
    .copy_host = cuda_copy_host,
    .destroy = cuda_destroy,
    .free_waits_for_holders = 1,
};

/* What the device must support for segments to be shared as descriptors:
 * 0, or GMB_E_DEVICE with the missing attribute named in err. */
static int cuda_check_support(struct cuda_device *cd, const char *name,
                              char *err, size_t errcap) {
  static const struct {
    int attr;
    const char *attr_name, *what;
  } need[] = {
      {GMB_CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
       "CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED",
       "the virtual memory management API"},
      {GMB_CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
       "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED",
       "memory shared as POSIX file descriptors"},
  };
  char why[160];
  for (size_t i = 0; i < sizeof need / sizeof need[0]; i++) {
    int v = 0;
    gmb_cu_result r = cd->drv.cuDeviceGetAttribute(&v, need[i].attr, cd->dev);
    if (r != GMB_CU_SUCCESS) {
      snprintf(err, errcap, "cuda:%d (%s): cuDeviceGetAttribute(%s): %s",
               cd->index, name, need[i].attr_name,
               cuda_err(cd, r, why, sizeof why));
      return GMB_E_DEVICE;
    }
    if (v == 0) {
      snprintf(err, errcap,
               "cuda:%d (%s) does not support %s (%s is 0): gmb needs it to "
               "share memory between processes",
               cd->index, name, need[i].what, need[i].attr_name);
      return GMB_E_DEVICE;
    }
  }
  struct gmb_cu_mem_prop prop = cuda_prop(cd);
  size_t g = 0;
  gmb_cu_result r = cd->drv.cuMemGetAllocationGranularity(
      &g, &prop, GMB_CU_MEM_ALLOC_GRANULARITY_MINIMUM);
  if (r != GMB_CU_SUCCESS) {
    snprintf(err, errcap, "cuda:%d (%s): cuMemGetAllocationGranularity: %s",
             cd->index, name, cuda_err(cd, r, why, sizeof why));
    return GMB_E_DEVICE;
  }
  if (g == 0 || GMB_SEGMENT_ALIGN % g != 0) {
    char gs[GMB_SIZE_BUFSZ];
    snprintf(err, errcap,
             "cuda:%d (%s): allocation granularity %s does not divide the "
             "2MiB segment unit",
             cd->index, name, gmb__size_format(g, gs, sizeof gs));
    return GMB_E_DEVICE;
  }
  cd->granularity = g;
  return 0;
}

/* What one CUDA context costs on the GPU: cuMemGetInfo's free bytes before
 * and after a throwaway context (made current by cuCtxCreate, then
 * destroyed; the broker's own context is current again after).  Another
 * process allocating meanwhile makes it read high or low: a start-up
 * estimate, logged; *cost 0 when the driver refuses a step of it.
 * Returns what making the broker's context current again returned. */
static gmb_cu_result cuda_context_cost(struct cuda_device *cd,
                                       uint64_t *cost) {
  size_t f0 = 0, f1 = 0, total = 0;
  gmb_cu_ctx tmp = NULL;
  *cost = 0;
  if (cd->drv.cuMemGetInfo(&f0, &total) == GMB_CU_SUCCESS &&
      cd->drv.cuCtxCreate(&tmp, 0, cd->dev) == GMB_CU_SUCCESS) {
    if (cd->drv.cuMemGetInfo(&f1, &total) == GMB_CU_SUCCESS && f0 > f1)
      *cost = (uint64_t)(f0 - f1);
    cd->drv.cuCtxDestroy(tmp);
  }
  /* Without its own context current again, the broker's every later call
   * would run in none (or in one just destroyed): the open fails. */
  return cd->drv.cuCtxSetCurrent(cd->ctx);
}

int gmb__device_cuda_open(int index, uint64_t capacity, uint64_t reserve,
                          struct gmb_device **out, char *err, size_t errcap) {
  *out = NULL;
  char why[200];
  struct gmb_device *d = calloc(1, sizeof *d);
  struct cuda_device *cd = calloc(1, sizeof *cd);
  if (!d || !cd) {
    free(d);
    free(cd);
    snprintf(err, errcap, "out of host memory");
    return GMB_E_NOMEM;
  }
  d->ops = &cuda_ops;
  d->priv = cd;
  cd->index = index;

  int rc = gmb__cudrv_load(&cd->drv, why, sizeof why);
  if (rc != 0) {
    snprintf(err, errcap, "%s", why);
    free(cd);
    free(d);
    return rc;
  }
  gmb_cu_result r;
  int count = 0;
  const char *step = "cuDeviceGetCount";
  if ((r = cd->drv.cuDeviceGetCount(&count)) != GMB_CU_SUCCESS) goto cu_fail;
  if (index < 0 || index >= count) {
    snprintf(err, errcap, "no GPU %d: the driver %s sees %d", index,
             cd->drv.path, count);
    cuda_destroy(d);
    return GMB_E_DEVICE;
  }
  step = "cuDeviceGet";
  if ((r = cd->drv.cuDeviceGet(&cd->dev, index)) != GMB_CU_SUCCESS)
    goto cu_fail;
  char name[48] = "";
  step = "cuDeviceGetName";
  if ((r = cd->drv.cuDeviceGetName(name, (int)sizeof name, cd->dev)) !=
      GMB_CU_SUCCESS)
    goto cu_fail;
  /* Who the GPU is, for clients that number it otherwise (containers,
   * CUDA_VISIBLE_DEVICES): its UUID travels in every Hello reply. */
  struct gmb_cu_uuid uuid;
  step = "cuDeviceGetUuid";
  if ((r = cd->drv.cuDeviceGetUuid(&uuid, cd->dev)) != GMB_CU_SUCCESS)
    goto cu_fail;
  gmb__cudrv_uuid_str(&uuid, d->uuid, sizeof d->uuid);
  step = "cuDeviceGetPCIBusId";
  if ((r = cd->drv.cuDeviceGetPCIBusId(d->pci_bus_id,
                                       (int)sizeof d->pci_bus_id, cd->dev)) !=
      GMB_CU_SUCCESS)
    goto cu_fail;
  /* In EXCLUSIVE_PROCESS mode the broker's own context would be the only
   * one the GPU allows: every client's import would fail.  PROHIBITED
   * allows none at all. */
  int mode = 0;
  step = "cuDeviceGetAttribute(CU_DEVICE_ATTRIBUTE_COMPUTE_MODE)";
  if ((r = cd->drv.cuDeviceGetAttribute(&mode,
                                        GMB_CU_DEVICE_ATTRIBUTE_COMPUTE_MODE,
                                        cd->dev)) != GMB_CU_SUCCESS)
    goto cu_fail;
  if (mode == GMB_CU_COMPUTEMODE_EXCLUSIVE_PROCESS ||
      mode == GMB_CU_COMPUTEMODE_PROHIBITED) {
    snprintf(err, errcap,
             "cuda:%d (%s, %s) is in compute mode %s: %s; set it to DEFAULT "
             "(nvidia-smi -i %s -c DEFAULT)",
             index, name, d->uuid,
             mode == GMB_CU_COMPUTEMODE_EXCLUSIVE_PROCESS
                 ? "EXCLUSIVE_PROCESS"
                 : "PROHIBITED",
             mode == GMB_CU_COMPUTEMODE_EXCLUSIVE_PROCESS
                 ? "only one process may use it, so the broker would lock "
                   "every client out"
                 : "no process may use it",
             d->uuid);
    cuda_destroy(d);
    return GMB_E_DEVICE;
  }
  step = "cuDevicePrimaryCtxRetain";
  if ((r = cd->drv.cuDevicePrimaryCtxRetain(&cd->ctx, cd->dev)) !=
      GMB_CU_SUCCESS)
    goto cu_fail;
  step = "cuCtxSetCurrent";
  if ((r = cd->drv.cuCtxSetCurrent(cd->ctx)) != GMB_CU_SUCCESS) goto cu_fail;
  /* With the context current: the queries need none, but nothing is lost
   * by asking from where the segments will be made. */
  if ((rc = cuda_check_support(cd, name, err, errcap)) != 0) {
    cuda_destroy(d);
    return rc;
  }
  step = "cuStreamCreate";
  if ((r = cd->drv.cuStreamCreate(&cd->stream, GMB_CU_STREAM_NON_BLOCKING)) !=
      GMB_CU_SUCCESS)
    goto cu_fail;
  if (reserve & GMB_DEVICE_RESERVE_CONTEXTS) {
    uint64_t n = reserve & ~GMB_DEVICE_RESERVE_CONTEXTS;
    uint64_t one;
    step = "cuCtxSetCurrent (the broker's context again, after measuring "
           "what a context costs for device_reserve auto)";
    if ((r = cuda_context_cost(cd, &one)) != GMB_CU_SUCCESS) goto cu_fail;
    reserve = n * one;
    char o[GMB_SIZE_BUFSZ], rs[GMB_SIZE_BUFSZ];
    log_info("cuda:%d: a CUDA context costs %s here (measured): "
             "device_reserve auto keeps %s for %llu client contexts",
             index, gmb__size_format(one, o, sizeof o),
             gmb__size_format(reserve, rs, sizeof rs),
             (unsigned long long)n);
  }
  size_t free_b = 0, total = 0;
  step = "cuMemGetInfo";
  if ((r = cd->drv.cuMemGetInfo(&free_b, &total)) != GMB_CU_SUCCESS)
    goto cu_fail;

  /* What the broker may hand out: free memory less what the operator keeps
   * for the driver and other users, capped by the configured capacity. */
  uint64_t avail = (uint64_t)free_b > reserve ? (uint64_t)free_b - reserve : 0;
  uint64_t cap = capacity && capacity < avail ? capacity : avail;
  cap &= ~(GMB_SEGMENT_ALIGN - 1);
  if (cap < GMB_SEGMENT_ALIGN) {
    char f[GMB_SIZE_BUFSZ], rs[GMB_SIZE_BUFSZ];
    snprintf(err, errcap,
             "%s free, less the device reserve %s, leaves less than one "
             "2MiB segment",
             gmb__size_format(free_b, f, sizeof f),
             gmb__size_format(reserve, rs, sizeof rs));
    cuda_destroy(d);
    return GMB_E_NOMEM;
  }
  d->capacity = cap;
  snprintf(d->desc, sizeof d->desc, "cuda:%d (%s)", index, name);
  char c[GMB_SIZE_BUFSZ], t[GMB_SIZE_BUFSZ], f2[GMB_SIZE_BUFSZ],
      g[GMB_SIZE_BUFSZ];
  log_info("cuda:%d: %s (%s, PCI %s), driver %d (%s): %s total, %s free, "
           "offering %s; VMM segments shared as descriptors, granularity %s",
           index, name, d->uuid, d->pci_bus_id, cd->drv.version, cd->drv.path,
           gmb__size_format(total, t, sizeof t),
           gmb__size_format(free_b, f2, sizeof f2),
           gmb__size_format(cap, c, sizeof c),
           gmb__size_format(cd->granularity, g, sizeof g));
  *out = d;
  return 0;

cu_fail:
  snprintf(err, errcap, "%s: %s", step,
           cuda_err(cd, r, why, sizeof why));
  cuda_destroy(d);
  return GMB_E_DEVICE;
}
