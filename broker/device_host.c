/*
 * device_host.c - the host device: each segment is a memfd of the
 * segment's size, mapped MAP_SHARED into the broker, and handed to clients
 * as that descriptor (the descriptor channel, fdpass.h).  Both see the same
 * pages, so every feature built on real bytes (migration, client death)
 * works on any Linux machine, exactly as on a GPU that shares by
 * descriptor.
 *
 * Nothing has a name: there is no object in /dev/shm for another process
 * to open, and the size of a container's /dev/shm does not matter (memfds
 * live on the kernel's internal tmpfs; as for any shared memory, a page is
 * charged to the memory cgroup of the process that first touches it).
 * Each memfd is sealed against shrinking and growing (F_SEAL_SHRINK |
 * F_SEAL_GROW, and F_SEAL_SEAL so the seals stay): a client holding the
 * descriptor cannot truncate it and make the broker fault (SIGBUS) when it
 * next copies.
 *
 * Memory: ftruncate() makes a sparse file, so a segment costs nothing until
 * its pages are written, and capacity is a promise checked by device.c
 * rather than memory taken at start-up.
 *
 * Descriptors: one per segment stays open for the segment's life (it is
 * what the descriptor channel sends); the soft RLIMIT_NOFILE is raised to
 * the hard limit when the device opens, since one descriptor per segment
 * is more than the usual 1024.  vm.max_map_count (65530 by default) also
 * bounds the number of segments, one mapping each.
 *
 * Release: seg_free unmaps and closes.  A client that still maps the
 * segment keeps its pages until it unmaps: the memory is reference counted
 * by the kernel, so a retired segment is never reused under anybody.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "device.h"
#include "gmb.h"
#include "log.h"
#include "util.h"


/* An exhausted resource is NOMEM; anything else is a device error. */
static int host_errno_code(int e) {
  return (e == ENOSPC || e == ENOMEM || e == EFBIG) ? GMB_E_NOMEM
                                                    : GMB_E_DEVICE;
}

static int host_seg_new(struct gmb_device *d, struct gmb_dseg *seg) {
  (void)d;
  char name[48];
  snprintf(name, sizeof name, "gmb-seg-%llu", (unsigned long long)seg->id);
  const char *what = NULL;
  int fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0)
    what = "memfd_create";
  else if (ftruncate(fd, (off_t)seg->size) != 0)
    what = "ftruncate";
  else if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL))
    what = "sealing";
  void *p = MAP_FAILED;
  if (what == NULL) {
    p = mmap(NULL, seg->size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) what = "mmap";
  }
  if (what) {
    int e = errno;
    log_error("host device: segment %llu (%llu bytes): %s: %s",
              (unsigned long long)seg->id, (unsigned long long)seg->size,
              what, strerror(e));
    if (fd >= 0) close(fd);
    return e == EMFILE || e == ENFILE ? GMB_E_DEVICE : host_errno_code(e);
  }
  seg->fd = fd;
  seg->host = p;
  return 0;
}

static void host_seg_free(struct gmb_device *d, struct gmb_dseg *seg) {
  (void)d;
  if (munmap(seg->host, seg->size) != 0)
    log_error("host device: munmap segment %llu: %s",
              (unsigned long long)seg->id, strerror(errno));
  close(seg->fd);
  seg->fd = -1;
  seg->host = NULL;
}

/*
 * The broker maps each segment once, but touches its pages only when it
 * moves something: the client wrote them through its own mapping.  So a
 * copy would take a page fault per 4 KiB on both sides, which costs more
 * than the copy itself; asking the kernel to map the whole range in one
 * call first (Linux 5.14+) is several times faster.  Where the kernel does
 * not know the advice, the copy simply faults as before.
 */
#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
static void host_populate(const void *addr, uint64_t len, int advice) {
  static int unsupported;
  if (unsupported || len == 0) return;
  uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
  uintptr_t a = (uintptr_t)addr & ~(page - 1);
  uintptr_t end = ((uintptr_t)addr + len + page - 1) & ~(page - 1);
  if (madvise((void *)a, end - a, advice) != 0 && errno == EINVAL)
    unsupported = 1;
}

static int host_copy(struct gmb_device *d, struct gmb_dseg *dst,
                     uint64_t dst_off, struct gmb_dseg *src, uint64_t src_off,
                     uint64_t len) {
  (void)d;
  /* device.c refuses overlapping ranges; one here would be a bug above. */
  GMB_ASSERT((dst->id != src->id || dst_off + len <= src_off ||
              src_off + len <= dst_off) &&
             "host copy ranges overlap");
  char *to = (char *)dst->host + dst_off;
  const char *from = (const char *)src->host + src_off;
  host_populate(from, len, MADV_POPULATE_READ);
  host_populate(to, len, MADV_POPULATE_WRITE);
  memcpy(to, from, (size_t)len);
  return 0;
}

/* Anonymous private pages: the broker's own, never shared with a client,
 * and given back to the kernel whole when freed (no heap to fragment).
 * Populated at once (one system call rather than a fault per page during
 * the copy, as host_populate does for segments). */
static void *host_host_alloc(struct gmb_device *d, uint64_t len) {
  (void)d;
  void *p = mmap(NULL, (size_t)len, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
  return p == MAP_FAILED ? NULL : p;
}

static void host_host_free(struct gmb_device *d, void *p, uint64_t len) {
  (void)d;
  if (munmap(p, (size_t)len) != 0)
    log_warn("host device: munmap of an offload copy: %s", strerror(errno));
}

static int host_copy_host(struct gmb_device *d, struct gmb_dseg *seg,
                          uint64_t off, void *p, uint64_t len, int to_host) {
  (void)d;
  char *at = (char *)seg->host + off;
  if (!to_host) host_populate(at, len, MADV_POPULATE_WRITE);
  if (to_host)
    memcpy(p, at, (size_t)len);
  else
    memcpy(at, p, (size_t)len);
  return 0;
}

static void host_destroy(struct gmb_device *d) { free(d); }

static const struct gmb_device_ops host_ops = {
    .kind = "host",
    .seg_new = host_seg_new,
    .seg_free = host_seg_free,
    .copy = host_copy,
    .host_alloc = host_host_alloc,
    .host_free = host_host_free,
    .copy_host = host_copy_host,
    .destroy = host_destroy,
};

/* One descriptor per segment: lift the soft limit as far as allowed. */
static void host_raise_nofile(void) {
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur >= rl.rlim_max) return;
  rl.rlim_cur = rl.rlim_max;
  if (setrlimit(RLIMIT_NOFILE, &rl) != 0)
    log_warn("host device: cannot raise the open file limit: %s",
             strerror(errno));
}

int gmb__device_host_open(uint64_t capacity, struct gmb_device **out, char *err,
                          size_t errcap) {
  *out = NULL;
  if (capacity < GMB_SEGMENT_ALIGN) {
    if (err && errcap)
      snprintf(err, errcap,
               "host device: capacity %llu is below one 2MiB "
               "segment",
               (unsigned long long)capacity);
    return GMB_E_INVAL;
  }
  struct gmb_device *d = calloc(1, sizeof *d);
  if (!d) {
    if (err && errcap) snprintf(err, errcap, "host device: out of memory");
    return GMB_E_NOMEM;
  }
  d->ops = &host_ops;
  d->capacity = capacity;
  char sz[GMB_SIZE_BUFSZ];
  snprintf(d->desc, sizeof d->desc, "host:%s",
           gmb__size_format(capacity, sz, sizeof sz));
  host_raise_nofile();
  *out = d;
  return 0;
}
