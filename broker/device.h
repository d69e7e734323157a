/*
 * device.h - the one interface between the broker and the memory it hands
 * out: a table of functions with two implementations, `host` (sealed
 * memfds, device_host.c) and `cuda` (the CUDA driver API, device_cuda.c).
 *
 * A device hands out segments.  Each segment has a shareable descriptor
 * (`fd`): what a client needs to map it, sent over the descriptor channel
 * (fdpass.h) to the sessions of the segment's tenant only.  Memory shared
 * by descriptor is reference counted by the kernel (memfd) or the driver
 * (CUDA virtual memory handles): when the broker releases a segment, a
 * process that still maps it keeps its pages until it unmaps, so nothing is
 * ever reused under a client, whether it is alive, evicted or dying.  The
 * generic layer here enforces the capacity: the sum of live segment sizes
 * never passes `capacity`.
 *
 * Two-step retirement (cuda): a retired segment's memory stays in use on
 * the GPU while clients map it, so the broker keeps counting it.  When the
 * pool retires a segment, the broker first records the sessions it told
 * (gmb__device_seg_hold, from the pool's retire callback), then the pool
 * calls gmb__device_seg_free, which for such a device only parks the
 * segment; the real free comes when the last holder answered SegmentClosed
 * (gmb__device_seg_closed) or ended (gmb__device_holder_gone).  A parked
 * segment still occupies the device: it stays in `in_use` and `segments`
 * until then, and `retiring`/`retiring_bytes` say how much of them waits.
 * The host device frees at once (holds are not even recorded for it): its
 * pages are the host's, and a client's mapping keeps only what it touched.
 * Device memory is never read by the broker except through `copy` (GPU
 * memory cannot be touched from the CPU).
 */
#ifndef GMB_DEVICE_H
#define GMB_DEVICE_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#define GMB_SEGMENT_ALIGN (UINT64_C(2) << 20) /* segments are 2 MiB multiples */

struct gmb_device;

struct gmb_dseg {
  uint64_t id;   /* the broker's segment id, unique for its lifetime */
  uint64_t size; /* bytes, a multiple of GMB_SEGMENT_ALIGN */
  void *priv;    /* the implementation's own state */
  void *host;    /* host device: the broker's mapping; NULL elsewhere */
  /* The segment's shareable descriptor (host: its memfd; cuda: the POSIX
   * fd of its cuMemCreate handle), owned by the device and closed by
   * seg_free; the descriptor channel sends copies of it (SCM_RIGHTS). */
  int fd;
};

struct gmb_device_ops {
  const char *kind; /* "host" or "cuda": how clients import handles */
  /* Creates a segment of seg->size bytes for seg->id; fills the rest of
   * *seg.  0, GMB_E_NOMEM or GMB_E_DEVICE. */
  int (*seg_new)(struct gmb_device *d, struct gmb_dseg *seg);
  /* Releases a segment.  Clients that still map it keep their mapping
   * (host) or were told to close it first (cuda). */
  void (*seg_free)(struct gmb_device *d, struct gmb_dseg *seg);
  /* Copies len bytes between two segments; the ranges never overlap.
   * 0 or GMB_E_DEVICE. */
  int (*copy)(struct gmb_device *d, struct gmb_dseg *dst, uint64_t dst_off,
              struct gmb_dseg *src, uint64_t src_off, uint64_t len);
  /* Host memory for the broker's own copies of movable allocations it
   * offloads (offload.c): `len` bytes the broker owns, or NULL when none
   * can be had.  host: anonymous pages; cuda: page-locked memory
   * (cuMemHostAlloc), so that copies run at the bus's speed. */
  void *(*host_alloc)(struct gmb_device *d, uint64_t len);
  void (*host_free)(struct gmb_device *d, void *p, uint64_t len);
  /* Copies len bytes between [off, off + len) of seg and host memory p
   * (to_host: from the segment).  0 or GMB_E_DEVICE. */
  int (*copy_host)(struct gmb_device *d, struct gmb_dseg *seg, uint64_t off,
                   void *p, uint64_t len, int to_host);
  void (*destroy)(struct gmb_device *d);
  /* 1: seg_free must wait until every holder closed its import (cuda). */
  int free_waits_for_holders;
};

struct gmb_device_retiring; /* device.c */

struct gmb_device {
  const struct gmb_device_ops *ops;
  uint64_t capacity;  /* bytes that segments may total */
  uint64_t in_use;    /* bytes of live segments, and `external` */
  /* Of in_use: device memory the clients made themselves through the VMM
   * API (cuMemCreate under the preload shim) and reported, which takes
   * the device's room as a segment does (gmb__device_external). */
  uint64_t external;
  uint64_t segments;  /* count of live segments */
  uint64_t retiring;       /* of those, parked until clients close them */
  uint64_t retiring_bytes;
  /* Live segments allowed at once, retiring ones included (0: no cap):
   * each holds a descriptor, and RLIMIT_NOFILE may be low (core.c). */
  uint64_t seg_max;
  uint64_t seg_max_refused; /* segments refused for it, for the log */
  char desc[64];      /* "host:1GiB", for logs and status */
  /* cuda: the GPU's identity, told to clients in the Hello reply so that
   * each finds the GPU under its own ordinal (containers renumber them):
   * "GPU-xxxxxxxx-..." and "0000:17:00.0".  Empty on the host device. */
  char uuid[48];
  char pci_bus_id[32];
  void *priv;
  struct gmb_device_retiring *retire_head; /* device.c's list */
  /* Told when a segment is parked (+size) and when a parked one is freed
   * (-size), with the owner given to gmb__device_seg_hold: the broker
   * counts retiring bytes against their tenant.  NULL: nobody is told.
   * Not called when the device closes. */
  void (*retire_note)(void *ctx, void *owner, int64_t delta);
  void *retire_ctx;
};

/*
 * Opens the device named by `spec` ("host:SIZE", "cuda:N" or "auto").
 * `capacity` (0: none) caps what the device offers.  On failure returns a
 * GMB_E_* code and writes a one-line reason into err.
 */
int gmb__device_open(const char *spec, uint64_t capacity, uint64_t reserve,
                     struct gmb_device **out, char *err, size_t errcap);
void gmb__device_close(struct gmb_device *d); /* accepts NULL */

/* Capacity-checked wrappers over the table. */
int gmb__device_seg_new(struct gmb_device *d, uint64_t id, uint64_t size,
                        struct gmb_dseg *out);
void gmb__device_seg_free(struct gmb_device *d, struct gmb_dseg *seg);
int gmb__device_copy(struct gmb_device *d, struct gmb_dseg *dst,
                     uint64_t dst_off, struct gmb_dseg *src, uint64_t src_off,
                     uint64_t len);
/* The host-memory ops above, checked: NULL for len 0; GMB_E_INVAL for a
 * range outside the segment. */
void *gmb__device_host_alloc(struct gmb_device *d, uint64_t len);
void gmb__device_host_free(struct gmb_device *d, void *p, uint64_t len);
int gmb__device_copy_host(struct gmb_device *d, struct gmb_dseg *seg,
                          uint64_t off, void *p, uint64_t len, int to_host);

/*
 * Two-step retirement (see the top of this file).  `holder` is a session
 * id.  gmb__device_seg_hold records that `holder` was told to close
 * segment `seg_id` (call it before the pool frees the segment), and
 * `owner` (opaque: the tenant) for retire_note: 0, or
 * GMB_E_NOMEM when it cannot be recorded (the segment is then freed at once).
 * A no-op on a device that frees at once.
 * gmb__device_seg_closed crosses `holder` off; gmb__device_holder_gone
 * crosses it off every segment (the session ended: its process's mappings
 * died with it, or it closed them before Bye).  Both return how many
 * segments they really freed (room appeared: serve waiting allocations).
 * An unknown segment or holder is ignored (a late or repeated message).
 */
int gmb__device_seg_hold(struct gmb_device *d, uint64_t seg_id,
                         uint64_t holder, void *owner);
int gmb__device_seg_closed(struct gmb_device *d, uint64_t seg_id,
                           uint64_t holder);
int gmb__device_holder_gone(struct gmb_device *d, uint64_t holder);

/* `reserve` for a CUDA device: bytes, or GMB_DEVICE_RESERVE_CONTEXTS | n,
 * n times what one CUDA context costs on that GPU, measured when it is
 * opened (a throwaway context, cuMemGetInfo before and after): room for
 * the contexts of n client processes, which the driver takes from the
 * same memory. */
#define GMB_DEVICE_RESERVE_CONTEXTS (UINT64_C(1) << 63)
/* Counts `delta` more (or, negative, fewer) bytes of device memory that a
 * client made outside the broker's segments and reported (its VMM
 * allocations): they take the room new segments would, so in_use and
 * `external` move together.  0, or GMB_E_NOMEM with nothing counted when
 * the capacity has no room for delta more. */
int gmb__device_external(struct gmb_device *d, int64_t delta);

/* The CUDA device (device_cuda.c): GPU `index` through the driver API
 * loaded at run time (proto/cudrv.h).  Capacity: what cuMemGetInfo says
 * is free less `reserve`, capped at `capacity` when non-zero, in 2 MiB
 * steps.  On failure a GMB_E_* code (GMB_E_DEVICE: no driver, no such GPU)
 * and one line in err. */
int gmb__device_cuda_open(int index, uint64_t capacity, uint64_t reserve,
                          struct gmb_device **out, char *err, size_t errcap);

/* The host device (device_host.c): segments are sealed memfds. */
int gmb__device_host_open(uint64_t capacity, struct gmb_device **out,
                          char *err, size_t errcap);

#endif /* GMB_DEVICE_H */
