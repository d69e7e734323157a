/*
 * device_host.c - the host device: each segment is a POSIX shared memory
 * object, /gmb-<broker pid>-<segment id>, mode 0600, mapped MAP_SHARED into
 * the broker.  A client imports a segment by shm_open()ing the name (the
 * handle is the name's bytes, without a NUL) and mapping it; both see the
 * same pages, so every feature built on real bytes (migration, client
 * death) works on any Linux machine.
 *
 * Memory: ftruncate() on tmpfs makes a sparse object, so a segment costs
 * nothing until its pages are written, and capacity is a promise checked by
 * device.c rather than memory taken at start-up.  Only written pages count
 * against /dev/shm's size; a write past that fails with SIGBUS in whichever
 * process touches the page, so the operator should keep the capacity within
 * `df /dev/shm`.
 *
 * Ownership: the object belongs to the broker's euid with mode 0600.  When
 * the broker runs as root and clients do not, a client cannot open it until
 * the broker hands it over, which the broker does when it knows the tenant's
 * uid (host_grant(), through gmb__device_grant()).  For that the shm
 * descriptor stays open for the segment's life (in seg->priv); the soft
 * RLIMIT_NOFILE is raised to the hard limit when the device opens, since
 * one descriptor per segment is more than the usual 1024.
 * vm.max_map_count (65530 by default) also bounds the number of segments,
 * one mapping each.
 *
 * Release: seg_free unmaps, unlinks and closes.  A client that still maps
 * the segment keeps its pages until it unmaps; the name is gone at once, so
 * no new client can open a retired segment.
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

struct host_device {
  pid_t pid; /* part of every segment name */
};

struct host_seg {
  int fd; /* kept open so the broker can fchown the object later */
};

static void host_seg_name(const struct gmb_dseg *seg, char *buf, size_t cap) {
  GMB_ASSERT(seg->handle_len < cap && "shm name longer than the buffer");
  memcpy(buf, seg->handle, seg->handle_len);
  buf[seg->handle_len] = '\0';
}

/* An exhausted resource is NOMEM; anything else is a device error. */
static int host_errno_code(int e) {
  return (e == ENOSPC || e == ENOMEM || e == EFBIG) ? GMB_E_NOMEM
                                                    : GMB_E_DEVICE;
}

static int host_seg_new(struct gmb_device *d, struct gmb_dseg *seg) {
  struct host_device *hd = d->priv;
  char name[64];
  int n = snprintf(name, sizeof name, "/gmb-%ld-%llu", (long)hd->pid,
                   (unsigned long long)seg->id);
  GMB_ASSERT(n > 0 && (size_t)n < sizeof name && "shm name fits");

  struct host_seg *hs = malloc(sizeof *hs);
  if (!hs) return GMB_E_NOMEM;
  int fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0) {
    int e = errno;
    /* EEXIST: a broker with the same pid (another PID namespace sharing
     * /dev/shm) or a stale object of a crashed one.  Neither is ours to
     * remove. */
    log_error("host device: shm_open %s: %s", name, strerror(e));
    free(hs);
    return e == EMFILE || e == ENFILE ? GMB_E_DEVICE : host_errno_code(e);
  }
  if (ftruncate(fd, (off_t)seg->size) != 0) {
    int e = errno;
    log_error("host device: ftruncate %s to %llu: %s", name,
              (unsigned long long)seg->size, strerror(e));
    shm_unlink(name);
    close(fd);
    free(hs);
    return host_errno_code(e);
  }
  void *p = mmap(NULL, seg->size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    int e = errno;
    log_error("host device: mmap %s (%llu bytes): %s", name,
              (unsigned long long)seg->size, strerror(e));
    shm_unlink(name);
    close(fd);
    free(hs);
    return host_errno_code(e);
  }
  hs->fd = fd;
  seg->priv = hs;
  seg->host = p;
  seg->handle_len = (uint32_t)n;
  memcpy(seg->handle, name, (size_t)n);
  return 0;
}

static void host_seg_free(struct gmb_device *d, struct gmb_dseg *seg) {
  (void)d;
  struct host_seg *hs = seg->priv;
  char name[GMB_DEVICE_HANDLE_MAX + 1];
  host_seg_name(seg, name, sizeof name);
  if (munmap(seg->host, seg->size) != 0)
    log_error("host device: munmap %s: %s", name, strerror(errno));
  if (shm_unlink(name) != 0)
    log_error("host device: shm_unlink %s: %s", name, strerror(errno));
  close(hs->fd);
  free(hs);
  seg->priv = NULL;
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

/*
 * A broker running as root gives the object to the uid of each session
 * about to open it, so that a job that is not root can map it; the client
 * opens it right after the reply, and opening is the only moment the owner
 * matters.  (Two sessions of one tenant under different uids, handed the
 * same new segment in the same instant, could still race.)  A broker that
 * is not root serves its own uid only, and root clients need nothing.
 */
static int host_grant(struct gmb_device *d, const struct gmb_dseg *seg,
                      uid_t uid, gid_t gid) {
  (void)d;
  const struct host_seg *hs = seg->priv;
  if (geteuid() != 0 || uid == 0 || hs == NULL) return 0;
  if (fchown(hs->fd, uid, gid) != 0) {
    log_error("host device: fchown segment %llu to %ld:%ld: %s",
              (unsigned long long)seg->id, (long)uid, (long)gid,
              strerror(errno));
    return GMB_E_SYSTEM;
  }
  return 0;
}

static void host_destroy(struct gmb_device *d) {
  free(d->priv);
  free(d);
}

static const struct gmb_device_ops host_ops = {
    .kind = "host",
    .seg_new = host_seg_new,
    .seg_free = host_seg_free,
    .copy = host_copy,
    .destroy = host_destroy,
    .grant = host_grant,
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
  struct host_device *hd = calloc(1, sizeof *hd);
  if (!d || !hd) {
    free(d);
    free(hd);
    if (err && errcap) snprintf(err, errcap, "host device: out of memory");
    return GMB_E_NOMEM;
  }
  hd->pid = getpid();
  d->ops = &host_ops;
  d->capacity = capacity;
  d->priv = hd;
  char sz[GMB_SIZE_BUFSZ];
  snprintf(d->desc, sizeof d->desc, "host:%s",
           gmb__size_format(capacity, sz, sizeof sz));
  host_raise_nofile();
  *out = d;
  return 0;
}
