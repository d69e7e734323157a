/*
 * device.c - picks a device implementation from its spec and enforces the
 * capacity on top of whatever the implementation can do.
 *
 * Every segment goes through gmb__device_seg_new()/seg_free(), so `in_use`
 * and `segments` always equal the sum and count of live segments (in_use
 * plus the clients' own VMM bytes, `external`), and in_use never passes
 * `capacity`.  Sizes must be non-zero multiples of
 * GMB_SEGMENT_ALIGN: a CUDA allocation is made of 2 MiB pages anyway, and
 * keeping the host device to the same rule means what passes on a laptop
 * behaves the same on a GPU.  Copies are bounds-checked here so that an
 * implementation only ever sees ranges inside its segments.
 *
 * Retirement (device.h): on a device whose free waits for holders, a freed
 * segment with holders is parked on d->retire_head with a copy of its dseg
 * (the pool's record is gone) and the list of sessions still to answer.  A
 * parked segment stays counted in in_use and segments; the implementation's
 * seg_free runs only when its list empties, or when the device closes (the
 * broker is stopping: its own exit frees the memory anyway).
 */
#include "device.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gmb.h"
#include "log.h"
#include "util.h"

struct gmb_device_retiring {
  uint64_t id;
  int parked;           /* 1: the pool freed it; seg holds its dseg */
  void *owner;          /* for retire_note */
  struct gmb_dseg seg;
  uint64_t *holders;    /* session ids still to answer */
  size_t n, cap;
  struct gmb_device_retiring *next;
};

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
  *out = NULL;
  if (err && errcap) err[0] = '\0';
  if (!spec || !*spec)
    return device_fail(err, errcap, GMB_E_INVAL,
                       "empty device spec (expected auto, cuda:N or "
                       "host:SIZE)");

  if (strcmp(spec, "auto") == 0) {
    /* A GPU when one answers; else the host device, and the log says why
     * and how big it is, so nobody mistakes one for the other. */
    char why[256] = "";
    if (gmb__device_cuda_open(0, capacity, reserve, out, why, sizeof why) == 0) {
      log_info("device auto: using %s", (*out)->desc);
      return 0;
    }
    uint64_t cap = capacity ? capacity : DEVICE_AUTO_HOST_CAPACITY;
    int rc = gmb__device_host_open(cap, out, err, errcap);
    if (rc == 0)
      log_info("no usable CUDA device (cuda:0: %s): using the host device %s",
               why,
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
    return gmb__device_cuda_open(atoi(n), capacity, reserve, out, err,
                                 errcap);
  }

  return device_fail(err, errcap, GMB_E_INVAL,
                     "%s: unknown device (expected auto, cuda:N or host:SIZE)",
                     spec);
}

static void device_retiring_drop(struct gmb_device *d,
                                 struct gmb_device_retiring *r, int force);

void gmb__device_close(struct gmb_device *d) {
  if (!d) return;
  if (d->retiring)
    log_warn("device %s closed with %llu retired segments that clients "
             "never said they closed: freeing them now",
             d->desc, (unsigned long long)d->retiring);
  while (d->retire_head) device_retiring_drop(d, d->retire_head, 1);
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
  if (d->seg_max && d->segments >= d->seg_max) {
    /* Once, then every 1024th: a full device is asked often. */
    if (d->seg_max_refused++ % 1024 == 0)
      log_warn("%s: %llu segments, the most the descriptor limit leaves "
               "room for: a new one is refused as out of memory (%llu so "
               "far); raise RLIMIT_NOFILE", d->desc,
               (unsigned long long)d->segments,
               (unsigned long long)d->seg_max_refused);
    return GMB_E_NOMEM;
  }
  memset(out, 0, sizeof *out);
  out->id = id;
  out->size = size;
  out->fd = -1;
  int rc = d->ops->seg_new(d, out);
  if (rc != 0) return rc;
  d->in_use += size;
  d->segments++;
  return 0;
}

int gmb__device_external(struct gmb_device *d, int64_t delta) {
  if (delta >= 0) {
    if ((uint64_t)delta > d->capacity - d->in_use) return GMB_E_NOMEM;
    d->in_use += (uint64_t)delta;
    d->external += (uint64_t)delta;
    return 0;
  }
  uint64_t n = (uint64_t)0 - (uint64_t)delta;
  GMB_ASSERT(n <= d->external && n <= d->in_use &&
             "uncounting external bytes the device does not count");
  d->in_use -= n;
  d->external -= n;
  return 0;
}

/* The real free, and the accounting with it. */
static void device_free_now(struct gmb_device *d, struct gmb_dseg *seg) {
  GMB_ASSERT(d->segments > 0 && d->in_use >= seg->size &&
             "freeing a segment the device does not count");
  d->ops->seg_free(d, seg);
  d->in_use -= seg->size;
  d->segments--;
}

static struct gmb_device_retiring *device_retiring_find(
    const struct gmb_device *d, uint64_t id) {
  for (struct gmb_device_retiring *r = d->retire_head; r; r = r->next)
    if (r->id == id) return r;
  return NULL;
}

/* Unlinks r; frees its segment when parked (force: whoever still holds). */
static void device_retiring_drop(struct gmb_device *d,
                                 struct gmb_device_retiring *r, int force) {
  GMB_ASSERT((force || r->n == 0) && "dropping a segment still held");
  struct gmb_device_retiring **pp = &d->retire_head;
  while (*pp != r) pp = &(*pp)->next;
  *pp = r->next;
  if (r->parked) {
    GMB_ASSERT(d->retiring > 0 && d->retiring_bytes >= r->seg.size &&
               "parked segment not counted");
    d->retiring--;
    d->retiring_bytes -= r->seg.size;
    if (!force && d->retire_note)
      d->retire_note(d->retire_ctx, r->owner, -(int64_t)r->seg.size);
    device_free_now(d, &r->seg);
  }
  free(r->holders);
  free(r);
}

int gmb__device_seg_hold(struct gmb_device *d, uint64_t seg_id,
                         uint64_t holder, void *owner) {
  if (!d->ops->free_waits_for_holders) return 0;
  struct gmb_device_retiring *r = device_retiring_find(d, seg_id);
  if (r == NULL) {
    r = calloc(1, sizeof *r);
    if (r == NULL) return GMB_E_NOMEM;
    r->id = seg_id;
    r->owner = owner;
    r->next = d->retire_head;
    d->retire_head = r;
  }
  GMB_ASSERT(!r->parked && "a hold on a segment already freed by the pool");
  for (size_t i = 0; i < r->n; i++)
    if (r->holders[i] == holder) return 0;
  if (r->n == r->cap) {
    size_t cap = r->cap ? 2 * r->cap : 4;
    uint64_t *h = realloc(r->holders, cap * sizeof *h);
    if (h == NULL) return GMB_E_NOMEM;
    r->holders = h;
    r->cap = cap;
  }
  r->holders[r->n++] = holder;
  return 0;
}

void gmb__device_seg_free(struct gmb_device *d, struct gmb_dseg *seg) {
  struct gmb_device_retiring *r = device_retiring_find(d, seg->id);
  if (r && r->n > 0) {
    GMB_ASSERT(!r->parked && "segment freed twice");
    r->parked = 1;
    r->seg = *seg;
    d->retiring++;
    d->retiring_bytes += seg->size;
    if (d->retire_note)
      d->retire_note(d->retire_ctx, r->owner, (int64_t)seg->size);
    log_debug("device %s: segment %llu retired, freed once %zu session(s) "
              "closed it", d->desc, (unsigned long long)seg->id, r->n);
    return;
  }
  if (r) device_retiring_drop(d, r, 0); /* no holder left: not parked */
  device_free_now(d, seg);
}

/* Crosses holder off r; 1 when that freed r's segment. */
static int device_retiring_cross(struct gmb_device *d,
                                 struct gmb_device_retiring *r,
                                 uint64_t holder) {
  for (size_t i = 0; i < r->n; i++) {
    if (r->holders[i] != holder) continue;
    r->holders[i] = r->holders[--r->n];
    if (r->n == 0 && r->parked) {
      log_debug("device %s: segment %llu closed by its last holder: freed",
                d->desc, (unsigned long long)r->id);
      device_retiring_drop(d, r, 0);
      return 1;
    }
    return 0;
  }
  return 0;
}

int gmb__device_seg_closed(struct gmb_device *d, uint64_t seg_id,
                           uint64_t holder) {
  struct gmb_device_retiring *r = device_retiring_find(d, seg_id);
  return r ? device_retiring_cross(d, r, holder) : 0;
}

int gmb__device_holder_gone(struct gmb_device *d, uint64_t holder) {
  int freed = 0;
  for (struct gmb_device_retiring *r = d->retire_head, *next; r; r = next) {
    next = r->next;
    freed += device_retiring_cross(d, r, holder);
  }
  return freed;
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

void *gmb__device_host_alloc(struct gmb_device *d, uint64_t len) {
  if (len == 0 || len > SIZE_MAX) return NULL;
  return d->ops->host_alloc(d, len);
}

void gmb__device_host_free(struct gmb_device *d, void *p, uint64_t len) {
  if (p) d->ops->host_free(d, p, len);
}

int gmb__device_copy_host(struct gmb_device *d, struct gmb_dseg *seg,
                          uint64_t off, void *p, uint64_t len, int to_host) {
  if (!device_in_bounds(off, len, seg->size) || (p == NULL && len))
    return GMB_E_INVAL;
  if (len == 0) return 0;
  return d->ops->copy_host(d, seg, off, p, len, to_host);
}
