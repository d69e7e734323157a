/*
 * gpu_figures.c - the driver-level figures of GPU.md on a real GPU (run by
 * tests/gpu/run.sh; builds anywhere, since it loads the driver through
 * proto/cudrv like gmb does):
 *
 *   - cuMemAlloc+cuMemFree latency at 2 MiB (the baseline);
 *   - what the broker pays per segment: cuMemCreate (POSIX-fd handles) +
 *     cuMemExportToShareableHandle + reserve + map + set access, and back;
 *   - what a client pays to import a segment, at 2 MiB, 256 MiB and 8 GiB:
 *     the descriptor goes to another process over a socketpair
 *     (SCM_RIGHTS), which times cuMemImportFromShareableHandle +
 *     cuMemAddressReserve + cuMemMap + cuMemSetAccess (+ cuMemRelease) and
 *     the unmap, and checks the bytes both ways with copies;
 *   - plain cuMemcpyDtoD GB/s (the ceiling for the broker's migration);
 *   - what one more CUDA context costs (cuMemGetInfo around cuCtxCreate).
 *
 * The importing process is forked before this one touches CUDA (a child
 * forked after cuInit cannot use the driver) and waits for descriptors.
 * Exit 0 when every check passed; 2 when no GPU answered.  Knobs: ITER
 * (allocations timed, default 200), SIZE_MIB (copy size, 256), IMPORT_MIB
 * (a comma-separated list of import sizes, default 2,256,8192).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cudrv.h"

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

#define CU(call)                                                        \
  do {                                                                  \
    gmb_cu_result r_ = (call);                                          \
    if (r_ != GMB_CU_SUCCESS) {                                         \
      char b_[160];                                                     \
      fprintf(stderr, "gpu_figures: %s: %s\n", #call,                   \
              gmb__cudrv_strerror(&d, r_, b_, sizeof b_));              \
      return 1;                                                         \
    }                                                                   \
  } while (0)

#define MIB ((size_t)1 << 20)
#define CHECK_BYTES (4 * MIB) /* checked at each end of an import */

static struct gmb_cudrv d;
static size_t granularity;

static int ctx_on(void) {
  gmb_cu_device dev;
  gmb_cu_ctx ctx;
  CU(d.cuDeviceGet(&dev, 0));
  CU(d.cuDevicePrimaryCtxRetain(&ctx, dev));
  CU(d.cuCtxSetCurrent(ctx));
  struct gmb_cu_mem_prop p;
  memset(&p, 0, sizeof p);
  p.type = GMB_CU_MEM_ALLOCATION_TYPE_PINNED;
  p.requested_handle_types = GMB_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  p.location.type = GMB_CU_MEM_LOCATION_TYPE_DEVICE;
  CU(d.cuMemGetAllocationGranularity(&granularity, &p,
                                     GMB_CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  return 0;
}

static const struct gmb_cu_access_desc RW = {
    {GMB_CU_MEM_LOCATION_TYPE_DEVICE, 0},
    GMB_CU_MEM_ACCESS_FLAGS_PROT_READWRITE};

/* --- descriptors over a socketpair ------------------------------------------ */

struct msg {
  unsigned long long size; /* 0: no more */
  int ok;
};

static int send_fd(int sock, const struct msg *m, int fd) {
  struct iovec iov = {(void *)m, sizeof *m};
  union {
    struct cmsghdr h;
    char buf[CMSG_SPACE(sizeof(int))];
  } u;
  memset(&u, 0, sizeof u);
  struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};
  if (fd >= 0) {
    mh.msg_control = u.buf;
    mh.msg_controllen = sizeof u.buf;
    struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(c), &fd, sizeof fd);
  }
  return sendmsg(sock, &mh, 0) == (ssize_t)sizeof *m ? 0 : -1;
}

static int recv_fd(int sock, struct msg *m, int *fd) {
  struct iovec iov = {m, sizeof *m};
  union {
    struct cmsghdr h;
    char buf[CMSG_SPACE(sizeof(int))];
  } u;
  struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1,
                      .msg_control = u.buf, .msg_controllen = sizeof u.buf};
  *fd = -1;
  if (recvmsg(sock, &mh, MSG_CMSG_CLOEXEC) != (ssize_t)sizeof *m) return -1;
  struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
  if (c && c->cmsg_type == SCM_RIGHTS) memcpy(fd, CMSG_DATA(c), sizeof *fd);
  return 0;
}

static int pattern_ok(const unsigned char *b, size_t n, size_t at) {
  for (size_t i = 0; i < n; i++)
    if (b[i] != (unsigned char)((at + i) * 13 + 7)) return 0;
  return 1;
}

static void pattern(unsigned char *b, size_t n, size_t at) {
  for (size_t i = 0; i < n; i++) b[i] = (unsigned char)((at + i) * 13 + 7);
}

/* --- the importing process ------------------------------------------------------ */

/* One import: time it, check both ends, write 0xa5 over the head, unmap. */
static int import_one(int fd, size_t size, unsigned char *buf) {
  double t0 = now_s();
  gmb_cu_mem_handle h;
  gmb_cu_ptr va;
  CU(d.cuMemImportFromShareableHandle(
      &h, (void *)(uintptr_t)fd, GMB_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
  CU(d.cuMemAddressReserve(&va, size, granularity, 0, 0));
  CU(d.cuMemMap(va, size, 0, h, 0));
  CU(d.cuMemSetAccess(va, size, &RW, 1));
  CU(d.cuMemRelease(h));
  double t1 = now_s();
  printf("FIGURE import+map_%zuMiB_ms %.3f\n", size / MIB, (t1 - t0) * 1e3);
  size_t n = size < CHECK_BYTES ? size : CHECK_BYTES;
  CU(d.cuMemcpyDtoH(buf, va, n));
  if (!pattern_ok(buf, n, 0)) {
    fprintf(stderr, "gpu_figures: importer: head of %zu MiB differs\n",
            size / MIB);
    return 12;
  }
  CU(d.cuMemcpyDtoH(buf, va + size - n, n));
  if (!pattern_ok(buf, n, size - n)) {
    fprintf(stderr, "gpu_figures: importer: tail of %zu MiB differs\n",
            size / MIB);
    return 13;
  }
  memset(buf, 0xa5, n);
  CU(d.cuMemcpyHtoD(va, buf, n));
  /* From pageable memory the copy may still be in flight when it returns:
   * landed before the other process looks. */
  CU(d.cuStreamSynchronize(NULL));
  t0 = now_s();
  CU(d.cuMemUnmap(va, size));
  CU(d.cuMemAddressFree(va, size));
  printf("FIGURE unmap_%zuMiB_ms %.3f\n", size / MIB, (now_s() - t0) * 1e3);
  fflush(stdout);
  return 0;
}

static int importer(int sock) {
  char err[256];
  if (gmb__cudrv_load(&d, err, sizeof err) != 0) {
    fprintf(stderr, "gpu_figures: importer: %s\n", err);
    return 10;
  }
  if (ctx_on()) return 11;
  unsigned char *buf = malloc(CHECK_BYTES);
  if (!buf) return 14;
  for (;;) {
    struct msg m;
    int fd;
    if (recv_fd(sock, &m, &fd) != 0) return 15;
    if (m.size == 0) break;
    m.ok = fd >= 0 ? import_one(fd, (size_t)m.size, buf) : 16;
    if (fd >= 0) close(fd);
    if (send_fd(sock, &m, -1) != 0) return 17;
    if (m.ok) return m.ok;
  }
  free(buf);
  return 0;
}

/* --- the exporting process --------------------------------------------------------- */

/* A segment as the broker makes it: created, exported, mapped here. */
struct seg {
  gmb_cu_mem_handle h;
  gmb_cu_ptr va;
  size_t size;
  int fd;
};

static int seg_new(struct seg *s, size_t size) {
  struct gmb_cu_mem_prop p;
  memset(&p, 0, sizeof p);
  p.type = GMB_CU_MEM_ALLOCATION_TYPE_PINNED;
  p.requested_handle_types = GMB_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  p.location.type = GMB_CU_MEM_LOCATION_TYPE_DEVICE;
  s->size = size;
  s->fd = -1;
  CU(d.cuMemCreate(&s->h, size, &p, 0));
  CU(d.cuMemExportToShareableHandle(
      &s->fd, s->h, GMB_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
  CU(d.cuMemAddressReserve(&s->va, size, granularity, 0, 0));
  CU(d.cuMemMap(s->va, size, 0, s->h, 0));
  CU(d.cuMemSetAccess(s->va, size, &RW, 1));
  return 0;
}

static int seg_free(struct seg *s) {
  CU(d.cuMemUnmap(s->va, s->size));
  CU(d.cuMemAddressFree(s->va, s->size));
  CU(d.cuMemRelease(s->h));
  close(s->fd);
  return 0;
}

/* Sends one segment of `size` bytes to the importer and checks what it
 * wrote back. */
static int import_figure(int sock, size_t size, unsigned char *buf) {
  struct seg s;
  if (seg_new(&s, size)) return 1;
  size_t n = size < CHECK_BYTES ? size : CHECK_BYTES;
  pattern(buf, n, 0);
  CU(d.cuMemcpyHtoD(s.va, buf, n));
  pattern(buf, n, size - n);
  CU(d.cuMemcpyHtoD(s.va + size - n, buf, n));
  CU(d.cuStreamSynchronize(NULL)); /* landed before the importer reads */
  fflush(stdout);
  struct msg m = {size, 0};
  if (send_fd(sock, &m, s.fd) != 0) {
    fprintf(stderr, "gpu_figures: sendmsg failed\n");
    return 1;
  }
  int none;
  if (recv_fd(sock, &m, &none) != 0 || m.ok != 0) {
    fprintf(stderr, "gpu_figures: the importer failed at %zu MiB (%d)\n",
            size / MIB, m.ok);
    return 1;
  }
  CU(d.cuMemcpyDtoH(buf, s.va, n));
  for (size_t i = 0; i < n; i++)
    if (buf[i] != 0xa5) {
      fprintf(stderr, "gpu_figures: exporter saw byte %zu = %u\n", i, buf[i]);
      return 1;
    }
  printf("OK import of %zu MiB: bytes checked both ways\n", size / MIB);
  return seg_free(&s);
}

int main(void) {
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) != 0) {
    perror("gpu_figures: socketpair");
    return 1;
  }
  fflush(NULL);
  pid_t pid = fork(); /* before any CUDA call here */
  if (pid < 0) {
    perror("gpu_figures: fork");
    return 1;
  }
  if (pid == 0) {
    close(sv[0]);
    _exit(importer(sv[1]));
  }
  close(sv[1]);
  int sock = sv[0];
  char err[256];
  if (gmb__cudrv_load(&d, err, sizeof err) != 0) {
    fprintf(stderr, "gpu_figures: no GPU: %s\n", err);
    close(sock);
    waitpid(pid, NULL, 0);
    return 2;
  }
  int iter = getenv("ITER") ? atoi(getenv("ITER")) : 200;
  size_t mib = getenv("SIZE_MIB") ? (size_t)atoi(getenv("SIZE_MIB")) : 256;
  int rc = ctx_on();
  char name[96] = "";
  if (!rc) {
    d.cuDeviceGetName(name, sizeof name, 0);
    printf("FIGURE device \"%s\" driver %d granularity %zu\n", name,
           d.version, granularity);
  }

  /* What one CUDA context costs (what the broker's device_reserve auto
   * counts for each client): free memory before and after a second
   * context of this process. */
  if (!rc) {
    size_t f0 = 0, f1 = 0, tot = 0;
    gmb_cu_ctx extra;
    gmb_cu_device dev;
    CU(d.cuDeviceGet(&dev, 0));
    CU(d.cuMemGetInfo(&f0, &tot));
    CU(d.cuCtxCreate(&extra, 0, dev));
    CU(d.cuMemGetInfo(&f1, &tot));
    CU(d.cuCtxDestroy(extra));
    gmb_cu_ctx prim;
    CU(d.cuDevicePrimaryCtxRetain(&prim, dev));
    CU(d.cuCtxSetCurrent(prim));
    printf("FIGURE context_MiB %.1f\n",
           f0 > f1 ? (double)(f0 - f1) / (double)MIB : 0.0);
  }

  /* cuMemAlloc/cuMemFree of 2 MiB, the broker's segment unit. */
  double t0 = now_s();
  for (int i = 0; !rc && i < iter; i++) {
    gmb_cu_ptr p;
    CU(d.cuMemAlloc(&p, 2 * MIB));
    CU(d.cuMemFree(p));
  }
  if (!rc)
    printf("FIGURE cuMemAlloc+cuMemFree_2MiB_us %.2f\n",
           (now_s() - t0) / iter * 1e6);

  /* A broker segment of 2 MiB: create + export + map, then unmap + free. */
  t0 = now_s();
  for (int i = 0; !rc && i < iter; i++) {
    struct seg s;
    rc = seg_new(&s, 2 * MIB) || seg_free(&s);
  }
  if (!rc)
    printf("FIGURE segment_new+free_2MiB_us %.2f\n",
           (now_s() - t0) / iter * 1e6);

  /* Imports in the other process, at each size. */
  unsigned char *buf = malloc(CHECK_BYTES);
  const char *sizes = getenv("IMPORT_MIB") ? getenv("IMPORT_MIB")
                                           : "2,256,8192";
  for (const char *p = sizes; !rc && buf && *p;) {
    size_t sz = (size_t)strtoull(p, (char **)&p, 10) * MIB;
    if (*p == ',') p++;
    sz = (sz + granularity - 1) / granularity * granularity;
    if (sz) rc = import_figure(sock, sz, buf);
  }
  struct msg done = {0, 0};
  send_fd(sock, &done, -1);
  close(sock);
  int st = 0;
  waitpid(pid, &st, 0);
  if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
    fprintf(stderr, "gpu_figures: importer exited with status %#x\n", st);
    rc = 1;
  }
  free(buf);

  /* Plain D2D copy bandwidth. */
  if (!rc) {
    size_t n = mib * MIB;
    gmb_cu_ptr a, b;
    CU(d.cuMemAlloc(&a, n));
    CU(d.cuMemAlloc(&b, n));
    CU(d.cuMemcpyDtoD(b, a, n)); /* warm */
    gmb_cu_stream s;
    CU(d.cuStreamCreate(&s, GMB_CU_STREAM_NON_BLOCKING));
    t0 = now_s();
    for (int i = 0; i < 10; i++) CU(d.cuMemcpyDtoDAsync(b, a, n, s));
    CU(d.cuStreamSynchronize(s));
    double gbs = 10.0 * (double)n / (now_s() - t0) / 1e9;
    printf("FIGURE cuMemcpyDtoD_%zuMiB_GBps %.1f\n", mib, gbs);
    CU(d.cuStreamDestroy(s));
    CU(d.cuMemFree(a));
    CU(d.cuMemFree(b));
  }
  return rc;
}
