/*
 * device.c - picks a device implementation from its spec and enforces the
 * capacity on top of whatever the implementation can do.
 *
 * Every segment goes through gmb__device_seg_new()/seg_free(), so `in_use`
 * and `segments` always equal the sum and count of live segments, and
 * in_use never passes `capacity`.  Sizes must be non-zero multiples of
 * GMB_SEGMENT_ALIGN: a CUDA allocation is made of 2 MiB pages anyway, and
 * keeping the host device to the same rule means what passes on a laptop
 * behaves the same on a GPU.  Copies are bounds-checked here so that an
 * implementation only ever sees ranges inside its segments.
 */
#include "device.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gmb.h"
#include "log.h"
#include "util.h"

/* Capacity used by `auto` when no GPU answers and the config gave none. */
#define DEVICE_AUTO_HOST_CAPACITY GMB_GIB

static int device_fail(char *err, size_t errcap, int code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static int device_fail(char *err, size_t errcap, int code, const char *fmt,
                       ...) {
  if (err && errcap) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errcap, fmt, ap);
    va_end(ap);
  }
  return code;
}

int gmb__device_open(const char *spec, uint64_t capacity, uint64_t reserve,
                     struct gmb_device **out, char *err, size_t errcap) {
  (void)reserve; /* what the driver keeps: only meaningful for cuda */
  *out = NULL;
  if (err && errcap) err[0] = '\0';
  if (!spec || !*spec)
    return device_fail(err, errcap, GMB_E_INVAL,
                       "empty device spec (expected auto, cuda:N or "
                       "host:SIZE)");

  if (strcmp(spec, "auto") == 0) {
    /* A CUDA device comes with a later module; until then auto always
     * means the host device, and the log says so and how big it is. */
    uint64_t cap = capacity ? capacity : DEVICE_AUTO_HOST_CAPACITY;
    int rc = gmb__device_host_open(cap, out, err, errcap);
    if (rc == 0)
      log_info(
          "device auto: no CUDA support built in, using the host device "
          "(%s)",
          (*out)->desc);
    return rc;
  }

  if (strncmp(spec, "host:", 5) == 0) {
    uint64_t size;
    if (gmb__size_parse(spec + 5, &size) != 0)
      return device_fail(err, errcap, GMB_E_INVAL,
                         "%s: the host device needs a size, as in host:8GiB",
                         spec);
    if (size < GMB_SEGMENT_ALIGN)
      return device_fail(err, errcap, GMB_E_INVAL,
                         "%s: the host device needs at least 2MiB (one "
                         "segment)",
                         spec);
    if (capacity && capacity < size) size = capacity;
    return gmb__device_host_open(size, out, err, errcap);
  }

  if (strncmp(spec, "cuda:", 5) == 0) {
    const char *n = spec + 5;
    size_t digits = strspn(n, "0123456789");
    if (digits == 0 || n[digits] != '\0' || digits > 4)
      return device_fail(err, errcap, GMB_E_INVAL,
                         "%s: a CUDA device is named cuda:N, N a GPU index",
                         spec);
    return device_fail(err, errcap, GMB_E_DEVICE,
                       "%s: CUDA device support is not built into this "
                       "broker yet",
                       spec);
  }

  return device_fail(err, errcap, GMB_E_INVAL,
                     "%s: unknown device (expected auto, cuda:N or host:SIZE)",
                     spec);
}

void gmb__device_close(struct gmb_device *d) {
  if (!d) return;
  if (d->segments)
    log_warn("device %s closed with %llu segments (%llu bytes) still live",
             d->desc, (unsigned long long)d->segments,
             (unsigned long long)d->in_use);
  d->ops->destroy(d);
}

int gmb__device_seg_new(struct gmb_device *d, uint64_t id, uint64_t size,
                        struct gmb_dseg *out) {
  if (size == 0 || size % GMB_SEGMENT_ALIGN != 0) return GMB_E_INVAL;
  /* Written so that it cannot overflow: in_use <= capacity always. */
  if (size > d->capacity - d->in_use) return GMB_E_NOMEM;
  memset(out, 0, sizeof *out);
  out->id = id;
  out->size = size;
  int rc = d->ops->seg_new(d, out);
  if (rc != 0) return rc;
  d->in_use += size;
  d->segments++;
  return 0;
}

void gmb__device_seg_free(struct gmb_device *d, struct gmb_dseg *seg) {
  GMB_ASSERT(d->segments > 0 && d->in_use >= seg->size &&
             "freeing a segment the device does not count");
  d->ops->seg_free(d, seg);
  d->in_use -= seg->size;
  d->segments--;
}

/* 1 when [off, off+len) lies inside a segment of `size` bytes. */
static int device_in_bounds(uint64_t off, uint64_t len, uint64_t size) {
  return off <= size && len <= size - off;
}

int gmb__device_copy(struct gmb_device *d, struct gmb_dseg *dst,
                     uint64_t dst_off, struct gmb_dseg *src, uint64_t src_off,
                     uint64_t len) {
  if (!device_in_bounds(dst_off, len, dst->size) ||
      !device_in_bounds(src_off, len, src->size))
    return GMB_E_INVAL;
  if (len == 0) return 0;
  /* Overlapping ranges are refused: the CUDA driver does not promise
   * memmove semantics, so no caller may rely on them here either. */
  if (dst->id == src->id && dst_off < src_off + len && src_off < dst_off + len)
    return GMB_E_INVAL;
  return d->ops->copy(d, dst, dst_off, src, src_off, len);
}
