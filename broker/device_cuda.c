/*
 * device_cuda.c - the cuda device: GPU N through the CUDA driver API,
 * loaded at run time (proto/cudrv.h), so one broker binary runs with and
 * without a GPU.
 *
 * A segment is one cuMemAlloc region (a 2 MiB multiple, device.c checks),
 * exported with cuIpcGetMemHandle: the 64 bytes are the import handle that
 * clients pass to cuIpcOpenMemHandle.  The broker never touches device
 * memory except through `copy`, a cuMemcpyDtoDAsync on the broker's own
 * stream followed by a synchronize: the loop thread waits for it, which is
 * what lets the compactor commit a move once copy returns.  Ranges never
 * overlap (device.c refuses them; the compactor copies an overlapping slide
 * in chunks no larger than the shift), because the driver does not promise
 * memmove semantics.
 *
 * Freeing: a segment a client still has open must not be cuMemFree'd (UB in
 * CUDA), so these ops set free_waits_for_holders and device.c parks retired
 * segments until every session that was given the handle closed it (see
 * device.h); seg_free here is the real cuMemFree.
 *
 * Context: the device's primary context is retained at open and made
 * current on the loop thread, the only thread that calls these ops.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cudrv.h"
#include "device.h"
#include "gmb.h"
#include "log.h"
#include "util.h"

#define CUDA_OOM 2                  /* CUDA_ERROR_OUT_OF_MEMORY */
#define CUDA_STREAM_NON_BLOCKING 1u /* no implicit sync with stream 0 */

struct cuda_device {
  struct gmb_cudrv drv;
  int index;
  gmb_cu_device dev;
  gmb_cu_ctx ctx;
  gmb_cu_stream stream; /* the broker's copies */
};

struct cuda_seg {
  gmb_cu_ptr ptr;
};

static const char *cuda_err(const struct cuda_device *cd, gmb_cu_result r,
                            char *buf, size_t cap) {
  return gmb__cudrv_strerror(&cd->drv, r, buf, cap);
}

static int cuda_seg_new(struct gmb_device *d, struct gmb_dseg *seg) {
  struct cuda_device *cd = d->priv;
  char why[160];
  struct cuda_seg *cs = malloc(sizeof *cs);
  if (!cs) return GMB_E_NOMEM;
  gmb_cu_result r = cd->drv.cuMemAlloc(&cs->ptr, (size_t)seg->size);
  if (r != GMB_CU_SUCCESS) {
    /* Out of memory is an answer, not a fault: another process on the GPU
     * may hold what cuMemGetInfo showed free at start-up. */
    if (r == CUDA_OOM)
      log_warn("%s: cuMemAlloc of %llu bytes: %s", d->desc,
               (unsigned long long)seg->size, cuda_err(cd, r, why, sizeof why));
    else
      log_error("%s: cuMemAlloc of %llu bytes: %s", d->desc,
                (unsigned long long)seg->size,
                cuda_err(cd, r, why, sizeof why));
    free(cs);
    return r == CUDA_OOM ? GMB_E_NOMEM : GMB_E_DEVICE;
  }
  gmb_cu_ipc_handle h;
  r = cd->drv.cuIpcGetMemHandle(&h, cs->ptr);
  if (r != GMB_CU_SUCCESS) {
    log_error("%s: cuIpcGetMemHandle: %s", d->desc,
              cuda_err(cd, r, why, sizeof why));
    cd->drv.cuMemFree(cs->ptr);
    free(cs);
    return GMB_E_DEVICE;
  }
  _Static_assert(sizeof h <= GMB_DEVICE_HANDLE_MAX, "IPC handle fits");
  seg->priv = cs;
  seg->host = NULL;
  seg->handle_len = (uint32_t)sizeof h;
  memcpy(seg->handle, &h, sizeof h);
  return 0;
}

static void cuda_seg_free(struct gmb_device *d, struct gmb_dseg *seg) {
  struct cuda_device *cd = d->priv;
  struct cuda_seg *cs = seg->priv;
  char why[160];
  gmb_cu_result r = cd->drv.cuMemFree(cs->ptr);
  if (r != GMB_CU_SUCCESS)
    log_error("%s: cuMemFree of segment %llu: %s", d->desc,
              (unsigned long long)seg->id, cuda_err(cd, r, why, sizeof why));
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
  gmb_cu_ptr to = ((struct cuda_seg *)dst->priv)->ptr + dst_off;
  gmb_cu_ptr from = ((struct cuda_seg *)src->priv)->ptr + src_off;
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
    .destroy = cuda_destroy,
    .free_waits_for_holders = 1,
};

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
  step = "cuDevicePrimaryCtxRetain";
  if ((r = cd->drv.cuDevicePrimaryCtxRetain(&cd->ctx, cd->dev)) !=
      GMB_CU_SUCCESS)
    goto cu_fail;
  step = "cuCtxSetCurrent";
  if ((r = cd->drv.cuCtxSetCurrent(cd->ctx)) != GMB_CU_SUCCESS) goto cu_fail;
  step = "cuStreamCreate";
  if ((r = cd->drv.cuStreamCreate(&cd->stream, CUDA_STREAM_NON_BLOCKING)) !=
      GMB_CU_SUCCESS)
    goto cu_fail;
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
  char c[GMB_SIZE_BUFSZ], t[GMB_SIZE_BUFSZ], f2[GMB_SIZE_BUFSZ];
  log_info("cuda:%d: %s, driver %d (%s): %s total, %s free, offering %s",
           index, name, cd->drv.version, cd->drv.path,
           gmb__size_format(total, t, sizeof t),
           gmb__size_format(free_b, f2, sizeof f2),
           gmb__size_format(cap, c, sizeof c));
  *out = d;
  return 0;

cu_fail:
  snprintf(err, errcap, "%s: %s", step,
           cuda_err(cd, r, why, sizeof why));
  cuda_destroy(d);
  return GMB_E_DEVICE;
}
