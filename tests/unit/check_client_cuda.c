/*
 * check_client_cuda.c - the client library on the cuda device, against a
 * fake broker and the fake driver (tests/fakecuda, through $GMB_LIBCUDA).
 *
 * The fake broker is a ROUTER and a descriptor channel (fd.sock beside
 * broker.sock, proto/fdpass.h) served by one thread of the test through
 * fake_router.h, as in check_client.c, answering for a broker whose device
 * is "cuda" and that speaks protocol 2: the Hello reply carries a secret
 * and the lock table's slot count; the channel answers AUTH (with that
 * secret) with the session's lock table, a sealed memfd, and SEGMENT n
 * with the CUDA export descriptor F.fd[n - 1].  Its segments are real
 * fake-driver allocations made by an "exporter" process (this program
 * started again with --exporter, since a child forked after this process
 * called cuInit could not use the driver): it cuMemCreates them, writes a
 * pattern with cuMemcpyHtoD, sends their descriptors
 * (cuMemExportToShareableHandle) back over a socketpair with SCM_RIGHTS and
 * waits; when told, it releases them and exits.
 *
 * Device memory cannot be read from the CPU (the fake faults like a GPU):
 * the test reads and writes it with cuMemcpy through its own handle on the
 * driver.  It counts this process's mappings of a segment in
 * /proc/self/maps, where the fake maps each mapping's bytes as
 * "memfd:fakecuda-<id>" (the id is in the name of the descriptor's link in
 * /proc/self/fd), and the descriptors that name it in /proc/self/fd.
 * Misuse the fake reports goes to $FAKECUDA_LOG, which must stay empty.
 * Nothing is made in /dev/shm (main checks).
 *
 * Fork rules: a process that called cuInit cannot use the driver in a
 * child it forks, so other processes here are this program exec'd again
 * (--exporter, --client); one test forks on purpose to see the library
 * fail clearly in such a child.
 *
 * Tests that must run before the driver is first loaded (a load that
 * works is kept for the life of the process, and under SAN=1 the suite
 * runs in one process) come first.
 */
#include <check.h>
#include <dirent.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "cudrv.h"
#include "cuimport.h"
#include "fake_router.h"
#include "fdpass.h"
#include "gmb.h"
#include "locktab_layout.h"
#include "wire.h"

#define SEG_SIZE (4u << 20)
#define NSEG 2
/* After the segments, pages for the client's cache: a request for pages
 * (Alloc.pages) gets as many of them, each a segment of its own (id
 * PAGE_SEG + i), as the broker gives them. */
#define PAGE_SIZE (2u << 20)
#define NPAGE 2
#define PAGE_SEG 100u
#define NALL (NSEG + NPAGE)
#define LT_SLOTS 64
#define LT_SEALS (F_SEAL_SHRINK | F_SEAL_GROW)

struct fk;
/* 1 when it answered (or chose silence), 0 for the default answer. */
typedef int (*fk_handler)(struct fk *f, const struct wire_request *req);
/* The same for a request on the descriptor channel's connection `conn`. */
typedef int (*fk_fd_handler)(struct fk *f, int conn,
                             const struct gmb_fd_req *req);

/* The fake driver's UUID of physical device 0 (and 1): "FAKECUDA", then
 * zeros with the device in the last byte. */
#define FAKE_UUID0 "GPU-46414b45-4355-4441-0000-000000000000"
#define FAKE_UUID1 "GPU-46414b45-4355-4441-0000-000000000001"

static atomic_int gate; /* block_stream's: 1 once the stream may go on */

struct fk {
  char dir[64], endpoint[128], log[128];
  void *ctx, *router;
  struct fake_fdchan ch;
  pthread_t thread;
  atomic_int stop;
  fk_handler handler;
  fk_fd_handler fd_handler;
  uint8_t peer[256];
  size_t peer_len;
  uint8_t secret[GMB_FD_SECRET_LEN]; /* in the Hello reply, asked at AUTH */

  /* the exporter process and its segments (ids 1..NSEG) */
  pid_t child;
  int to_child;
  int fd[NALL];         /* each segment's descriptor, for the client:
                           NSEG segments, then NPAGE pages */
  char maps_name[NALL][48]; /* "memfd:fakecuda-<id> " in /proc/self/maps */
  _Atomic uint64_t next_offset;
  uint64_t next_id;
  unsigned next_page;

  /* the session's lock table: a sealed memfd (setup), session 1 */
  char lt_name[64];
  int lt_fd;
  struct gmb__lt_header *lt;

  /* what a handler gives for SEGMENT instead (fd_other) */
  int other_fd;        /* -1: the segment's own */
  uint64_t other_size; /* 0: SEG_SIZE */

  char uuid[48]; /* the GPU the Hello reply names; "": FAKE_UUID0 */
  atomic_int n_alloc, n_free, n_bye, n_closed;
  atomic_int watch_gate, free_early; /* a Free that came before the gate */
  atomic_int n_auth, n_segment; /* requests on the descriptor channel */
  _Atomic uint64_t last_segment, last_closed;
  atomic_int openers_at_bye; /* this process's imports of segment 1 */
  atomic_int openers_at_closed; /* ... of the segment SegmentClosed names */
  atomic_int retire_on_stats; /* segment to retire before a Stats reply */
  atomic_int retire_now; /* segment to retire unasked, between requests */
  _Atomic uint64_t trim_now; /* bytes a TRIM event asks for, sent unasked */
  atomic_int n_trim_answered; /* Heartbeats that answer a TRIM */
};

static struct fk F;

/* --- the exporter child ------------------------------------------------------ */

static const char *fake_path(void) {
  static char buf[256];
  const char *p = getenv("FAKECUDA_SO");
  if (p && *p) return p;
  const char *b = getenv("GMB_BUILD_DIR");
  snprintf(buf, sizeof buf, "%s/fakecuda/libcuda.so.1", b && *b ? b : "build");
  return buf;
}

static uint8_t pattern(size_t seg, size_t i) {
  return (uint8_t)(i * 7 + 3 + seg * 101);
}

static char self_exe[PATH_MAX];
static char fake_dir[64];
extern char **environ;

/* The exporter process (--exporter SOCK): makes the segments, writes their
 * patterns, sends their descriptors over SOCK, then waits for it to close
 * and releases them. */
static int exporter_main(int sock) {
  struct gmb_cudrv d;
  char err[256];
  if (gmb__cudrv_load(&d, err, sizeof err) != 0) return 2;
  gmb_cu_ctx ctx;
  gmb_cu_device dev;
  if (d.cuDeviceGet(&dev, 0) || d.cuDevicePrimaryCtxRetain(&ctx, dev) ||
      d.cuCtxSetCurrent(ctx))
    return 3;
  struct gmb_cu_mem_prop prop;
  memset(&prop, 0, sizeof prop);
  prop.type = GMB_CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.requested_handle_types = GMB_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  prop.location.type = GMB_CU_MEM_LOCATION_TYPE_DEVICE;
  struct gmb_cu_access_desc rw = {{GMB_CU_MEM_LOCATION_TYPE_DEVICE, 0},
                                  GMB_CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
  gmb_cu_mem_handle h[NALL];
  gmb_cu_ptr va[NALL];
  uint8_t *b = malloc(SEG_SIZE);
  if (!b) return 4;
  for (size_t s = 0; s < NALL; s++) {
    int fd = -1;
    const size_t size = s < NSEG ? SEG_SIZE : PAGE_SIZE;
    if (d.cuMemCreate(&h[s], size, &prop, 0) ||
        d.cuMemAddressReserve(&va[s], size, 0, 0, 0) ||
        d.cuMemMap(va[s], size, 0, h[s], 0) ||
        d.cuMemSetAccess(va[s], size, &rw, 1) ||
        d.cuMemExportToShareableHandle(
            &fd, h[s], GMB_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0))
      return 5;
    for (size_t i = 0; i < size; i++) b[i] = pattern(s, i);
    /* Landed before the descriptor leaves (from pageable memory the
     * copy returns before it does). */
    if (d.cuMemcpyHtoD(va[s], b, size) || d.cuStreamSynchronize(NULL))
      return 6;
    char c = 's';
    struct iovec iov = {&c, 1};
    union {
      struct cmsghdr h;
      char buf[CMSG_SPACE(sizeof(int))];
    } u;
    memset(&u, 0, sizeof u);
    struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1,
                       .msg_control = u.buf, .msg_controllen = sizeof u.buf};
    struct cmsghdr *cm = CMSG_FIRSTHDR(&m);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(cm), &fd, sizeof fd);
    if (sendmsg(sock, &m, 0) != 1) return 7;
    close(fd);
  }
  free(b);
  char c;
  while (read(sock, &c, 1) > 0) {
  }
  for (size_t s = 0; s < NALL; s++) {
    const size_t size = s < NSEG ? SEG_SIZE : PAGE_SIZE;
    if (d.cuMemUnmap(va[s], size) || d.cuMemAddressFree(va[s], size) ||
        d.cuMemRelease(h[s]))
      return 8;
  }
  return 0;
}

static int recv_fd(int sock) {
  char c;
  struct iovec iov = {&c, 1};
  union {
    struct cmsghdr h;
    char buf[CMSG_SPACE(sizeof(int))];
  } u;
  struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1,
                     .msg_control = u.buf, .msg_controllen = sizeof u.buf};
  ck_assert_int_eq(recvmsg(sock, &m, MSG_CMSG_CLOEXEC), 1);
  struct cmsghdr *cm = CMSG_FIRSTHDR(&m);
  ck_assert_ptr_nonnull(cm);
  ck_assert_int_eq(cm->cmsg_type, SCM_RIGHTS);
  int fd;
  memcpy(&fd, CMSG_DATA(cm), sizeof fd);
  return fd;
}

static void exporter_start(void) {
  int sv[2];
  ck_assert_int_eq(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  ck_assert_int_eq(fcntl(sv[1], F_SETFD, 0), 0); /* the exporter's end */
  char arg[16];
  snprintf(arg, sizeof arg, "%d", sv[1]);
  char *argv[] = {self_exe, "--exporter", arg, NULL};
  fflush(NULL);
  F.child = fork();
  ck_assert_int_ge(F.child, 0);
  if (F.child == 0) {
    execve(self_exe, argv, environ);
    _exit(127);
  }
  close(sv[1]);
  F.to_child = sv[0];
  for (size_t s = 0; s < NALL; s++) {
    F.fd[s] = recv_fd(sv[0]);
    char link[64], target[128];
    snprintf(link, sizeof link, "/proc/self/fd/%d", F.fd[s]);
    ssize_t n = readlink(link, target, sizeof target - 1);
    ck_assert_int_gt(n, 0);
    target[n] = '\0';
    /* "/memfd:fakecuda-7 (deleted)": the mappings' name is up to the
     * space, with a space after it in /proc/self/maps. */
    char *sp = strchr(target, ' ');
    if (sp) *sp = '\0';
    ck_assert_msg(strstr(target, "memfd:fakecuda-") != NULL, "%s", target);
    snprintf(F.maps_name[s], sizeof F.maps_name[s], "%s ",
             strstr(target, "memfd:"));
  }
}

/* Lets the exporter release its segments and checks that nobody misused
 * the driver (the fake logs it otherwise). */
static void exporter_finish(void) {
  if (F.child <= 0) return;
  close(F.to_child);
  int st;
  ck_assert_int_eq(waitpid(F.child, &st, 0), F.child);
  F.child = 0;
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "exporter: 0x%x", st);
  ck_assert_msg(access(F.log, F_OK) != 0, "the fake driver logged misuse "
                "(%s)", F.log);
}

/* How many mappings of segment `seg` (1-based) this process has. */
static int openers(int seg) {
  if (F.maps_name[seg - 1][0] == '\0') return 0; /* no exporter here */
  FILE *m = fopen("/proc/self/maps", "r");
  ck_assert_ptr_nonnull(m);
  char line[512];
  int n = 0;
  while (fgets(line, sizeof line, m))
    if (strstr(line, F.maps_name[seg - 1])) n++;
  fclose(m);
  return n;
}

/* The test's own handle on the driver the client loaded (one per
 * process), to read and write device memory by copies. */
static struct gmb_cudrv test_drv;

static void test_drv_load(void) {
  char err[256];
  ck_assert_msg(gmb__cudrv_load(&test_drv, err, sizeof err) == 0, "%s", err);
  /* As a program's CUDA runtime would: the library makes no context
   * current on the program's threads. */
  gmb_cu_ctx cur = NULL, ctx;
  ck_assert_int_eq(test_drv.cuCtxGetCurrent(&cur), 0);
  if (cur == NULL) {
    ck_assert_int_eq(test_drv.cuDevicePrimaryCtxRetain(&ctx, 0), 0);
    ck_assert_int_eq(test_drv.cuCtxSetCurrent(ctx), 0);
  }
}

static void dev_read(void *dst, const void *src, size_t n) {
  ck_assert_int_eq(test_drv.cuMemcpyDtoH(dst, (gmb_cu_ptr)(uintptr_t)src, n),
                   0);
}

static void dev_fill(void *dst, uint8_t v, size_t n) {
  uint8_t *b = malloc(n);
  ck_assert_ptr_nonnull(b);
  memset(b, v, n);
  ck_assert_int_eq(test_drv.cuMemcpyHtoD((gmb_cu_ptr)(uintptr_t)dst, b, n), 0);
  free(b);
}

/* How many descriptors of this process name `name` ("memfd:X", as the
 * links in /proc/self/fd read after their "/"). */
static int fd_links(const char *name) {
  DIR *d = opendir("/proc/self/fd");
  ck_assert_ptr_nonnull(d);
  size_t len = strlen(name);
  int n = 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    if (e->d_name[0] == '.') continue;
    char link[300], target[256];
    snprintf(link, sizeof link, "/proc/self/fd/%s", e->d_name);
    ssize_t k = readlink(link, target, sizeof target - 1);
    if (k <= 0) continue;
    target[k] = '\0';
    /* "/memfd:fakecuda-7 (deleted)": the name, then a space or the end */
    if (strncmp(target + 1, name, len) == 0 &&
        (target[1 + len] == ' ' || target[1 + len] == '\0'))
      n++;
  }
  closedir(d);
  return n;
}

/* Descriptors of segment `seg` (1-based) in this process. */
static int seg_fds(int seg) {
  char name[sizeof F.maps_name[0]];
  memcpy(name, F.maps_name[seg - 1], sizeof name);
  name[strcspn(name, " ")] = '\0';
  return fd_links(name);
}

/* The protection of the CPU mapping that holds address p, in perms
 * ("---p"); 0 when nothing is mapped there. */
static int cpu_perms(const void *p, char perms[5]) {
  FILE *m = fopen("/proc/self/maps", "r");
  ck_assert_ptr_nonnull(m);
  char line[512];
  int found = 0;
  while (!found && fgets(line, sizeof line, m)) {
    unsigned long lo, hi;
    char pr[5];
    if (sscanf(line, "%lx-%lx %4s", &lo, &hi, pr) == 3 &&
        (uintptr_t)p >= lo && (uintptr_t)p < hi) {
      memcpy(perms, pr, 5);
      found = 1;
    }
  }
  fclose(m);
  return found;
}

/* A device address as the fake makes them: reserved in this process's
 * address space, but no CPU load or store may touch it. */
static void assert_not_cpu_memory(const void *p) {
  char perms[5] = "";
  ck_assert_msg(cpu_perms(p, perms), "%p: not reserved", p);
  ck_assert_msg(strcmp(perms, "---p") == 0, "%p: %s", p, perms);
}

/* The reservation of SEG_SIZE bytes at device address p was given back
 * (cuMemAddressFree), as the fake driver sees it: freeing it again is
 * refused.  The fake logs that refusal as misuse, so the log must be empty
 * before and is removed after.  Needs a context on this thread. */
static void assert_reservation_freed(const void *p) {
  ck_assert_msg(access(F.log, F_OK) != 0, "the fake logged misuse before");
  test_drv_load();
  gmb_cu_result r = test_drv.cuMemAddressFree((gmb_cu_ptr)(uintptr_t)p,
                                              SEG_SIZE);
  gmb__cudrv_unload(&test_drv);
  ck_assert_msg(r != GMB_CU_SUCCESS, "%p was still reserved", p);
  ck_assert_msg(access(F.log, F_OK) == 0, "no refusal logged");
  unlink(F.log);
}

/* --- the fake broker -------------------------------------------------------- */

static void fk_reply(struct fk *f, const struct wire_reply *rep) {
  fake_router_reply(f->router, f->peer, f->peer_len, rep);
}

static void fk_retire(struct fk *f, uint64_t seg) {
  struct wire_reply ev = {.id = 0, .kind = WIRE_EVENT};
  ev.u.event.kind = WIRE_EVENT_SEGMENT_RETIRED;
  ev.u.event.segment = seg;
  fk_reply(f, &ev);
}

static void fk_default(struct fk *f, const struct wire_request *req) {
  struct wire_reply rep = {.id = req->id};
  switch (req->kind) {
    case WIRE_HELLO:
      rep.kind = WIRE_HELLO;
      rep.u.hello.version = WIRE_PROTOCOL_VERSION;
      rep.u.hello.session = 1;
      snprintf(rep.u.hello.tenant, sizeof rep.u.hello.tenant, "team-a");
      snprintf(rep.u.hello.device, sizeof rep.u.hello.device, "cuda");
      snprintf(rep.u.hello.device_uuid, sizeof rep.u.hello.device_uuid, "%s",
               f->uuid[0] ? f->uuid : FAKE_UUID0);
      rep.u.hello.lock_slots = LT_SLOTS;
      rep.u.hello.fd_secret_len = GMB_FD_SECRET_LEN;
      memcpy(rep.u.hello.fd_secret, f->secret, GMB_FD_SECRET_LEN);
      break;
    case WIRE_ALLOC: {
      uint64_t size = (req->u.alloc.size + 511) & ~(uint64_t)511;
      if (req->u.alloc.pages) {
        const uint32_t n = req->u.alloc.pages;
        if (f->next_page + n > NPAGE) {
          rep.status = GMB_E_NOMEM;
          break;
        }
        rep.kind = WIRE_ALLOC;
        rep.u.alloc.size = size;
        rep.u.alloc.n_pages = n;
        for (uint32_t i = 0; i < n; i++) {
          rep.u.alloc.page_id[i] = 1000 + ++f->next_page;
          rep.u.alloc.page_seg[i] = PAGE_SEG + f->next_page - 1;
        }
        rep.u.alloc.id = rep.u.alloc.page_id[0];
        rep.u.alloc.segment = rep.u.alloc.page_seg[0];
        break;
      }
      uint64_t off = atomic_load(&f->next_offset);
      if (off + size > SEG_SIZE || f->next_id >= LT_SLOTS) {
        rep.status = GMB_E_NOMEM;
        break;
      }
      rep.kind = WIRE_ALLOC;
      rep.u.alloc.id = ++f->next_id;
      rep.u.alloc.size = size;
      rep.u.alloc.segment = 1;
      rep.u.alloc.offset = off;
      atomic_store(&f->next_offset, off + size);
      if (req->u.alloc.flags & GMB_MOVABLE) {
        struct gmb__lt_slot *sl = &gmb__lt_slots(f->lt)[rep.u.alloc.id - 1];
        sl->id = rep.u.alloc.id;
        sl->segment = 1;
        sl->offset = rep.u.alloc.offset;
        atomic_store_explicit(&sl->state, 0, memory_order_release);
        rep.u.alloc.slot = (uint32_t)(rep.u.alloc.id - 1);
      }
      break;
    }
    case WIRE_STATS: {
      uint64_t seg = (uint64_t)atomic_exchange(&f->retire_on_stats, 0);
      if (seg) fk_retire(f, seg);
      rep.kind = WIRE_STATS;
      break;
    }
    case WIRE_BYE:
      atomic_store(&f->openers_at_bye, openers(1));
      break;
    case WIRE_FREE:
      break;
    default:
      return; /* heartbeats and SegmentClosed get no reply */
  }
  fk_reply(f, &rep);
}

/* The channel as a cuda broker keeps it: AUTH with session 1's secret gets
 * the lock table; SEGMENT n, on an authenticated connection, the export
 * descriptor of segment n; anything else a refusal and no descriptor.
 * Nothing here asserts (it runs on the fake's thread): the client's
 * answers show what went wrong. */
static void fk_fd_default(struct fk *f, int conn, const struct gmb_fd_req *req) {
  int *authed = fake_fdchan_tag(&f->ch, conn);
  if (authed == NULL) return;
  if (req->magic != GMB_FD_MAGIC) {
    fake_fdchan_drop(&f->ch, conn);
    return;
  }
  switch (req->op) {
    case GMB_FD_AUTH:
      if (req->session != 1 ||
          memcmp(req->secret, f->secret, GMB_FD_SECRET_LEN) != 0) {
        fake_fdchan_reply(conn, GMB_FD_AUTH, GMB_E_AUTH, 0, 0, -1,
                          "no session with that secret");
        break;
      }
      *authed = 1;
      fake_fdchan_reply(conn, GMB_FD_AUTH, 0, 0, gmb__lt_bytes(LT_SLOTS),
                        f->lt_fd, NULL);
      break;
    case GMB_FD_SEGMENT:
      if (!*authed) {
        fake_fdchan_reply(conn, GMB_FD_SEGMENT, GMB_E_AUTH, req->segment, 0,
                          -1, "not authenticated");
      } else if (req->segment >= 1 && req->segment <= NSEG &&
                 f->fd[req->segment - 1] >= 0) {
        fake_fdchan_reply(conn, GMB_FD_SEGMENT, 0, req->segment, SEG_SIZE,
                          f->fd[req->segment - 1], NULL);
      } else if (req->segment >= PAGE_SEG && req->segment < PAGE_SEG + NPAGE &&
                 f->fd[NSEG + req->segment - PAGE_SEG] >= 0) {
        fake_fdchan_reply(conn, GMB_FD_SEGMENT, 0, req->segment, PAGE_SIZE,
                          f->fd[NSEG + req->segment - PAGE_SEG], NULL);
      } else {
        fake_fdchan_reply(conn, GMB_FD_SEGMENT, GMB_E_NOENT, req->segment, 0,
                          -1, "not this tenant's segment");
      }
      break;
    default:
      fake_fdchan_reply(conn, req->op, GMB_E_PROTO, 0, 0, -1, "bad op");
      break;
  }
}

/* SEGMENT answered with f->other_fd (or the segment's own descriptor) and
 * f->other_size (or SEG_SIZE): a broker that lies about its memory. */
static int fd_other(struct fk *f, int conn, const struct gmb_fd_req *req) {
  int *authed = fake_fdchan_tag(&f->ch, conn);
  if (req->op != GMB_FD_SEGMENT || authed == NULL || !*authed ||
      req->segment < 1 || req->segment > NSEG)
    return 0;
  fake_fdchan_reply(conn, GMB_FD_SEGMENT, 0, req->segment,
                    f->other_size ? f->other_size : SEG_SIZE,
                    f->other_fd >= 0 ? f->other_fd : f->fd[req->segment - 1],
                    NULL);
  return 1;
}

static void *fk_main(void *arg) {
  struct fk *f = arg;
  while (!atomic_load(&f->stop)) {
    uint64_t now = (uint64_t)atomic_load(&f->retire_now);
    if (now && f->peer_len) { /* an event nobody asked for */
      atomic_store(&f->retire_now, 0);
      fk_retire(f, now);
    }
    uint64_t trim = atomic_load(&f->trim_now);
    if (trim && f->peer_len) { /* another tenant needs memory */
      atomic_store(&f->trim_now, 0);
      struct wire_reply ev = {.id = 0, .kind = WIRE_EVENT};
      ev.u.event.kind = WIRE_EVENT_TRIM;
      ev.u.event.bytes = trim;
      fk_reply(f, &ev);
    }
    struct fake_msg m;
    enum fake_got got = fake_poll(f->router, &f->ch, f->peer, sizeof f->peer,
                                  &f->peer_len, &m);
    if (got == FAKE_GOT_FD) {
      if (m.fdreq.op == GMB_FD_AUTH) {
        atomic_fetch_add(&f->n_auth, 1);
      } else if (m.fdreq.op == GMB_FD_SEGMENT) {
        atomic_store(&f->last_segment, m.fdreq.segment);
        atomic_fetch_add(&f->n_segment, 1);
      }
      if (f->fd_handler && f->fd_handler(f, m.conn, &m.fdreq)) continue;
      fk_fd_default(f, m.conn, &m.fdreq);
      continue;
    }
    if (got != FAKE_GOT_WIRE) continue;
    const struct wire_request *req = &m.req;
    switch (req->kind) {
      case WIRE_ALLOC: atomic_fetch_add(&f->n_alloc, 1); break;
      case WIRE_FREE:
        atomic_fetch_add(&f->n_free, 1);
        if (atomic_load(&f->watch_gate) && !atomic_load(&gate))
          atomic_fetch_add(&f->free_early, 1);
        break;
      case WIRE_BYE: atomic_fetch_add(&f->n_bye, 1); break;
      case WIRE_HEARTBEAT:
        if (req->trim_answered) atomic_fetch_add(&f->n_trim_answered, 1);
        break;
      case WIRE_SEGMENT_CLOSED: {
        uint64_t seg = req->u.segment.segment;
        /* What this process still maps of it when the report comes: the
         * client unmaps first. */
        atomic_store(&f->openers_at_closed,
                     seg >= 1 && seg <= NSEG ? openers((int)seg) : -1);
        atomic_store(&f->last_closed, seg);
        atomic_fetch_add(&f->n_closed, 1);
        break;
      }
      default: break;
    }
    if (f->handler && f->handler(f, req)) continue;
    fk_default(f, req);
  }
  return NULL;
}

static void fk_start(void) {
  fake_fdchan_listen(&F.ch, F.dir);
  F.router = fake_router_open(&F.ctx, F.endpoint);
  ck_assert_int_eq(pthread_create(&F.thread, NULL, fk_main, &F), 0);
}

/* The session's lock table, as the broker makes it: a memfd sealed against
 * shrinking and growing, given at AUTH; the test keeps a mapping. */
static void lt_setup(void) {
  snprintf(F.lt_name, sizeof F.lt_name, "gmb-check-ccuda-lt-%d",
           (int)getpid());
  F.lt_fd = fake_memfd(F.lt_name, gmb__lt_bytes(LT_SLOTS), LT_SEALS);
  F.lt = mmap(NULL, gmb__lt_bytes(LT_SLOTS), PROT_READ | PROT_WRITE,
              MAP_SHARED, F.lt_fd, 0);
  ck_assert_ptr_ne(F.lt, MAP_FAILED);
  F.lt->magic = GMB_LT_MAGIC;
  F.lt->version = GMB_LT_VERSION;
  F.lt->slots = LT_SLOTS;
  F.lt->session = 1;
}

static uint32_t lt_state(gmb_id id) {
  return atomic_load(&gmb__lt_slots(F.lt)[id - 1].state);
}

/* Mappings of the lock table in this process (/proc/self/maps). */
static int lt_mappings(void) {
  char name[80];
  snprintf(name, sizeof name, "/memfd:%s ", F.lt_name);
  FILE *m = fopen("/proc/self/maps", "r");
  ck_assert_ptr_nonnull(m);
  char line[512];
  int n = 0;
  while (fgets(line, sizeof line, m))
    if (strstr(line, name)) n++;
  fclose(m);
  return n;
}

static void setup(void) {
  memset(&F, 0, sizeof F);
  fake_fdchan_init(&F.ch);
  F.lt_fd = F.other_fd = -1;
  for (size_t s = 0; s < NALL; s++) F.fd[s] = -1;
  unsetenv("GMB_ENDPOINT");
  unsetenv("GMB_TENANT");
  unsetenv("GMB_TOKEN");
  unsetenv("GMB_TOKEN_FILE");
  unsetenv("FAKECUDA_DEVICES");
  unsetenv("FAKECUDA_MISSING");
  snprintf(F.dir, sizeof F.dir, "/tmp/gmb-check-ccuda-XXXXXX");
  ck_assert_ptr_nonnull(mkdtemp(F.dir));
  snprintf(F.endpoint, sizeof F.endpoint, "ipc://%s/broker.sock", F.dir);
  snprintf(F.log, sizeof F.log, "%s/fakecuda.log", F.dir);
  setenv("FAKECUDA_LOG", F.log, 1);
  setenv("GMB_LIBCUDA", fake_path(), 1);
  for (int i = 0; i < GMB_FD_SECRET_LEN; i++)
    F.secret[i] = (uint8_t)(0xc3 ^ (i * 29) ^ getpid());
  lt_setup();
}

static void teardown(void) {
  if (F.ctx) {
    atomic_store(&F.stop, 1);
    pthread_join(F.thread, NULL);
    zmq_close(F.router);
    zmq_ctx_term(F.ctx);
  }
  fake_fdchan_close(&F.ch);
  if (F.child > 0) { /* a failed test: let the child go */
    close(F.to_child);
    waitpid(F.child, NULL, 0);
  }
  for (size_t s = 0; s < NALL; s++)
    if (F.fd[s] >= 0) close(F.fd[s]);
  if (F.other_fd >= 0) close(F.other_fd);
  if (F.lt) munmap(F.lt, gmb__lt_bytes(LT_SLOTS));
  if (F.lt_fd >= 0) close(F.lt_fd);
  char path[192];
  snprintf(path, sizeof path, "%s/broker.sock", F.dir);
  unlink(path);
  unlink(F.log);
  rmdir(F.dir);
  unsetenv("FAKECUDA_LOG");
}

static gmb_client *connect_ok(void) {
  gmb_client *c = NULL;
  int rc = gmb_connect(F.endpoint, "team-a", &c);
  ck_assert_msg(rc == 0, "connect: %s", gmb_last_error(NULL));
  return c;
}

/* Counters of the fake, read from the test's thread (named so that a
 * failed assertion reads well). */
static int ld(atomic_int *v) { return atomic_load(v); }
static uint64_t ld64(_Atomic uint64_t *v) { return atomic_load(v); }

/* Waits (under Check's timeout) until *v reaches want. */
static void wait_for(atomic_int *v, int want) {
  while (atomic_load(v) < want) {
    struct timespec ts = {0, 1000000};
    nanosleep(&ts, NULL);
  }
}

/* --- before the driver is loaded ---------------------------------------------- */

START_TEST(no_driver_connect_fails_naming_library) {
  setenv("GMB_LIBCUDA", "/nonexistent/libcuda.so.1", 1);
  fk_start();
  gmb_client *c = (gmb_client *)&c;
  ck_assert_int_eq(gmb_connect(F.endpoint, "team-a", &c), GMB_E_DEVICE);
  ck_assert_ptr_null(c);
  const char *e = gmb_last_error(NULL);
  ck_assert_msg(strstr(e, "GMB_E_DEVICE") && strstr(e, "cuda") &&
                    strstr(e, "/nonexistent/libcuda.so.1"),
                "%s", e);
  ck_assert_int_eq(ld(&F.n_bye), 1); /* the session was ended */
}
END_TEST

START_TEST(no_device_connect_fails_with_driver_reason) {
  setenv("FAKECUDA_DEVICES", "0", 1);
  fk_start();
  gmb_client *c = (gmb_client *)&c;
  ck_assert_int_eq(gmb_connect(F.endpoint, "team-a", &c), GMB_E_DEVICE);
  ck_assert_ptr_null(c);
  ck_assert_msg(strstr(gmb_last_error(NULL), "CUDA_ERROR_NO_DEVICE"), "%s",
                gmb_last_error(NULL));
  unsetenv("FAKECUDA_DEVICES");
}
END_TEST

/* --- cuimport on its own: a descriptor in, a device address out ----------- */

START_TEST(cuda_import_maps_descriptor) {
  exporter_start();
  char why[256] = "";
  int ord = -1;
  ck_assert_msg(gmb__cuda_attach(FAKE_UUID0, &ord, why, sizeof why) == 0,
                "%s", why);
  ck_assert_int_eq(ord, 0);
  uint64_t a = 0, b = 0;
  ck_assert_msg(gmb__cuda_import(0, F.fd[0], SEG_SIZE, &a, why, sizeof why) == 0,
                "%s", why);
  ck_assert_uint_ne(a, 0);
  ck_assert_int_eq(openers(1), 1);
  /* The exporter's bytes, by copies; what is written here reaches them. */
  test_drv_load();
  uint8_t got[4096];
  dev_read(got, (void *)(uintptr_t)(a + SEG_SIZE - sizeof got), sizeof got);
  for (size_t i = 0; i < sizeof got; i++)
    ck_assert_uint_eq(got[i], pattern(0, SEG_SIZE - sizeof got + i));
  dev_fill((void *)(uintptr_t)a, 0x5c, 100);
  /* No de-duplication: a second import is a second mapping, with the same
   * bytes at another address. */
  ck_assert_msg(gmb__cuda_import(0, F.fd[0], SEG_SIZE, &b, why, sizeof why) == 0,
                "%s", why);
  ck_assert_uint_ne(a, b);
  ck_assert_int_eq(openers(1), 2);
  dev_read(got, (void *)(uintptr_t)b, 101);
  ck_assert_uint_eq(got[99], 0x5c);
  ck_assert_uint_eq(got[100], pattern(0, 100));
  gmb__cuda_close(0, a, SEG_SIZE);
  ck_assert_int_eq(openers(1), 1);
  gmb__cuda_close(0, b, SEG_SIZE);
  ck_assert_int_eq(openers(1), 0);
  gmb__cudrv_unload(&test_drv);
  /* The caller keeps its descriptor: it still imports. */
  ck_assert_int_ne(fcntl(F.fd[0], F_GETFD), -1);
  exporter_finish();
}
END_TEST

START_TEST(cuda_import_refuses_what_is_no_segment) {
  exporter_start();
  char why[256] = "";
  int ord = -1;
  ck_assert_msg(gmb__cuda_attach(FAKE_UUID0, &ord, why, sizeof why) == 0,
                "%s", why);
  ck_assert_int_eq(ord, 0);
  uint64_t a = 0;
  ck_assert_int_eq(gmb__cuda_import(0, -1, SEG_SIZE, &a, why, sizeof why),
                   GMB_E_PROTO);
  ck_assert_msg(strstr(why, "descriptor") != NULL, "%s", why);
  ck_assert_int_eq(gmb__cuda_import(0, F.fd[0], 0, &a, why, sizeof why),
                   GMB_E_PROTO);
  ck_assert_int_eq(gmb__cuda_import(0, F.fd[0], SEG_SIZE - 4096, &a, why,
                                    sizeof why),
                   GMB_E_PROTO);
  ck_assert_msg(strstr(why, "granularity") != NULL, "%s", why);
  /* Bigger than the allocation: the driver refuses the mapping. */
  ck_assert_int_eq(gmb__cuda_import(0, F.fd[0], 2 * SEG_SIZE, &a, why,
                                    sizeof why),
                   GMB_E_DEVICE);
  ck_assert_msg(strstr(why, "cuMemMap") != NULL, "%s", why);
  /* A descriptor that is not device memory. */
  int fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  ck_assert_int_ge(fd, 0);
  ck_assert_int_eq(gmb__cuda_import(0, fd, SEG_SIZE, &a, why, sizeof why),
                   GMB_E_DEVICE);
  ck_assert_msg(strstr(why, "cuMemImportFromShareableHandle") != NULL, "%s",
                why);
  close(fd);
  ck_assert_int_eq(openers(1), 0); /* nothing half-made stays mapped */
  /* A refused mapping is misuse the fake reports: not this test's point. */
  unlink(F.log);
  exporter_finish();
}
END_TEST

/* --- imports ---------------------------------------------------------------- */

START_TEST(lock_returns_pointer_into_import) {
  exporter_start();
  fk_start();
  gmb_client *c = connect_ok();
  ck_assert_int_eq(ld(&F.n_auth), 1);
  gmb_id a, b;
  ck_assert_int_eq(gmb_alloc(c, 4096, 0, &a), 0);
  ck_assert_int_eq(gmb_alloc(c, 1000, 0, &b), 0);
  /* The first alloc in segment 1 asked the channel for its descriptor. */
  ck_assert_int_eq(ld(&F.n_segment), 1);
  ck_assert_uint_eq(ld64(&F.last_segment), 1);
  uint8_t *pa, *pb;
  ck_assert_int_eq(gmb_lock(c, a, (void **)&pa), 0);
  ck_assert_int_eq(gmb_lock(c, b, (void **)&pb), 0);
  ck_assert_ptr_eq(pb, pa + 4096); /* base + offset of one import */
  /* A device address: no CPU access at all. */
  assert_not_cpu_memory(pa);
  assert_not_cpu_memory(pb);
  /* What the exporter wrote is there, and what we write reaches it (by
   * copies: device addresses are not CPU addresses). */
  test_drv_load();
  uint8_t want[4096], got[4096];
  for (size_t i = 0; i < sizeof want; i++) want[i] = pattern(0, i);
  dev_read(got, pa, sizeof got);
  ck_assert_int_eq(memcmp(got, want, sizeof want), 0);
  dev_fill(pb, 0xab, 1000);
  dev_read(got, pa + 4096, 1025);
  ck_assert_uint_eq(got[0], 0xab);
  ck_assert_uint_eq(got[999], 0xab);
  ck_assert_uint_eq(got[1024], pattern(0, 5120));
  gmb__cudrv_unload(&test_drv);
  ck_assert_int_eq(gmb_unlock(c, a), 0);
  ck_assert_int_eq(gmb_unlock(c, b), 0);
  gmb_disconnect(c);
  exporter_finish();
}
END_TEST

START_TEST(import_cached_across_locks) {
  exporter_start();
  fk_start();
  gmb_client *c = connect_ok();
  ck_assert_int_eq(openers(1), 0);
  ck_assert_int_eq(seg_fds(1), 1); /* the test's own */
  gmb_id id[8];
  for (int i = 0; i < 8; i++)
    ck_assert_int_eq(gmb_alloc(c, 512, i % 2 ? GMB_MOVABLE : 0, &id[i]), 0);
  void *first = NULL;
  for (int n = 0; n < 1000; n++) {
    void *p;
    ck_assert_int_eq(gmb_lock(c, id[n % 8], &p), 0);
    if (n == 0) first = p;
    ck_assert_ptr_eq(p, (uint8_t *)first + 512 * (n % 8));
    ck_assert_int_eq(gmb_unlock(c, id[n % 8]), 0);
  }
  /* One import, one request for its descriptor, for 8 allocations and
   * 1000 locks; the client closed the descriptor it was sent (the other
   * one is the driver's, held by the mapping). */
  ck_assert_int_eq(openers(1), 1);
  ck_assert_int_eq(ld(&F.n_segment), 1);
  ck_assert_int_eq(seg_fds(1), 2);
  gmb_disconnect(c);
  ck_assert_int_eq(openers(1), 0);
  ck_assert_int_eq(seg_fds(1), 1);
  ck_assert_int_eq(ld(&F.n_segment), 1);
  exporter_finish();
}
END_TEST

START_TEST(retired_segment_closed_then_reported) {
  exporter_start();
  fk_start();
  gmb_client *c = connect_ok();
  gmb_id id;
  void *p;
  ck_assert_int_eq(gmb_alloc(c, 512, 0, &id), 0);
  ck_assert_int_eq(gmb_lock(c, id, &p), 0);
  ck_assert_int_eq(gmb_free(c, id), 0);
  ck_assert_int_eq(openers(1), 1);
  assert_not_cpu_memory(p);
  /* The event comes before the Stats reply, so it was handled by the
   * time gmb_tenant_stats returns. */
  atomic_store(&F.retire_on_stats, 1);
  gmb_stats st;
  ck_assert_int_eq(gmb_tenant_stats(c, &st), 0);
  /* cuMemUnmap: the fake's view is gone; cuMemAddressFree: so is the
   * reservation; and the driver let go of the memory. */
  ck_assert_int_eq(openers(1), 0);
  assert_reservation_freed(p);
  ck_assert_int_eq(seg_fds(1), 1);
  wait_for(&F.n_closed, 1);
  ck_assert_uint_eq(ld64(&F.last_closed), 1);
  /* Unmapped before it was reported. */
  ck_assert_int_eq(ld(&F.openers_at_closed), 0);
  /* A segment given to the session but never imported here is reported
   * too: the broker counts sessions, not imports. */
  atomic_store(&F.retire_on_stats, 2);
  ck_assert_int_eq(gmb_tenant_stats(c, &st), 0);
  wait_for(&F.n_closed, 2);
  ck_assert_uint_eq(ld64(&F.last_closed), 2);
  /* The exporter may free segment 1 now: nothing here has it open. */
  gmb_disconnect(c);
  ck_assert_int_eq(ld(&F.n_closed), 2);
  ck_assert_int_eq(ld(&F.n_segment), 1);
  exporter_finish();
}
END_TEST

/* A retirement that comes while the application makes no call is read by
 * the client's own thread, which has no context of its own: the unmap
 * still happens (in the primary context), and is reported. */
START_TEST(retired_between_calls_closed_by_client_thread) {
  exporter_start();
  fk_start();
  gmb_client *c = connect_ok();
  gmb_id id;
  void *p;
  ck_assert_int_eq(gmb_alloc(c, 512, 0, &id), 0);
  ck_assert_int_eq(gmb_lock(c, id, &p), 0);
  ck_assert_int_eq(gmb_free(c, id), 0);
  ck_assert_int_eq(openers(1), 1);
  atomic_store(&F.retire_now, 1);
  wait_for(&F.n_closed, 1);
  ck_assert_uint_eq(ld64(&F.last_closed), 1);
  ck_assert_int_eq(ld(&F.openers_at_closed), 0);
  ck_assert_int_eq(openers(1), 0);
  assert_reservation_freed(p);
  gmb_disconnect(c);
  exporter_finish(); /* and the fake logged no misuse */
}
END_TEST

START_TEST(disconnect_closes_imports_before_bye) {
  exporter_start();
  fk_start();
  gmb_client *c = connect_ok();
  gmb_id id;
  void *p;
  ck_assert_int_eq(gmb_alloc(c, 512, 0, &id), 0);
  ck_assert_int_eq(gmb_lock(c, id, &p), 0);
  ck_assert_int_eq(openers(1), 1);
  atomic_store(&F.openers_at_bye, -1);
  gmb_disconnect(c);
  ck_assert_int_eq(ld(&F.n_bye), 1);
  int at_bye = atomic_load(&F.openers_at_bye);
  ck_assert_int_eq(at_bye, 0);
  ck_assert_int_eq(openers(1), 0);
  exporter_finish();
}
END_TEST

START_TEST(two_clients_map_separately) {
  exporter_start();
  fk_start();
  gmb_client *c1 = connect_ok();
  gmb_client *c2 = connect_ok();
  ck_assert_int_eq(ld(&F.n_auth), 2);
  gmb_id a, b;
  ck_assert_int_eq(gmb_alloc(c1, 512, 0, &a), 0);
  ck_assert_int_eq(gmb_alloc(c2, 512, 0, &b), 0);
  /* Each client asked for the segment on its own channel. */
  ck_assert_int_eq(ld(&F.n_segment), 2);
  void *pa, *pb;
  ck_assert_int_eq(gmb_lock(c1, a, &pa), 0);
  ck_assert_int_eq(gmb_lock(c2, b, &pb), 0);
  /* Each client maps the segment on its own (the VMM API allows two
   * mappings of one allocation in a process): two device addresses. */
  ck_assert_ptr_ne(pb, (uint8_t *)pa + 512);
  ck_assert_int_eq(openers(1), 2);
  gmb_disconnect(c1);
  ck_assert_int_eq(openers(1), 1); /* c2's mapping stays */
  test_drv_load();
  uint8_t got[512];
  dev_read(got, pb, sizeof got);
  for (size_t i = 0; i < sizeof got; i++)
    ck_assert_uint_eq(got[i], pattern(0, 512 + i));
  gmb__cudrv_unload(&test_drv);
  gmb_disconnect(c2);
  ck_assert_int_eq(openers(1), 0);
  ck_assert_int_eq(ld(&F.n_segment), 2);
  exporter_finish();
}
END_TEST

/* A movable allocation the broker moved to a segment this process has
 * not mapped: the next gmb_lock asks the channel for that segment's
 * descriptor, imports it once, and points into it. */
START_TEST(movable_lock_follows_move_to_unmapped_segment) {
  exporter_start();
  fk_start();
  gmb_client *c = connect_ok();
  gmb_id id;
  uint8_t *p1, *p2, *p3;
  ck_assert_int_eq(gmb_alloc(c, 4096, GMB_MOVABLE, &id), 0);
  ck_assert_int_eq(gmb_lock(c, id, (void **)&p1), 0);
  ck_assert_uint_eq(lt_state(id), 1);
  ck_assert_int_eq(gmb_unlock(c, id), 0);
  ck_assert_int_eq(ld(&F.n_segment), 1);
  /* The mover: claim, publish the new place (segment 2, offset 8192),
   * release.  The exporter's pattern there stands for the moved bytes. */
  struct gmb__lt_slot *sl = &gmb__lt_slots(F.lt)[id - 1];
  uint32_t zero = 0;
  ck_assert(atomic_compare_exchange_strong(&sl->state, &zero, GMB_LT_MOVING));
  sl->segment = 2;
  sl->offset = 8192;
  atomic_store_explicit(&sl->state, 0, memory_order_release);
  ck_assert_int_eq(gmb_lock(c, id, (void **)&p2), 0);
  ck_assert_int_eq(ld(&F.n_segment), 2);
  ck_assert_uint_eq(ld64(&F.last_segment), 2);
  ck_assert_int_eq(openers(2), 1);
  ck_assert_int_eq(seg_fds(2), 2); /* the test's and the mapping's */
  assert_not_cpu_memory(p2);
  test_drv_load();
  uint8_t got[4096];
  dev_read(got, p2, sizeof got);
  for (size_t i = 0; i < sizeof got; i++)
    ck_assert_uint_eq(got[i], pattern(1, 8192 + i));
  gmb__cudrv_unload(&test_drv);
  ck_assert_int_eq(gmb_unlock(c, id), 0);
  /* Cached: the same address, no new request. */
  ck_assert_int_eq(gmb_lock(c, id, (void **)&p3), 0);
  ck_assert_ptr_eq(p3, p2);
  ck_assert_int_eq(gmb_unlock(c, id), 0);
  ck_assert_int_eq(ld(&F.n_segment), 2);
  ck_assert_uint_eq(lt_state(id), 0);
  /* Segment 1 emptied and retired: segment 2 stays mapped. */
  atomic_store(&F.retire_on_stats, 1);
  gmb_stats st;
  ck_assert_int_eq(gmb_tenant_stats(c, &st), 0);
  ck_assert_int_eq(openers(1), 0);
  ck_assert_int_eq(openers(2), 1);
  gmb_disconnect(c);
  ck_assert_int_eq(openers(2), 0);
  ck_assert_int_eq(seg_fds(2), 1);
  exporter_finish();
}
END_TEST

/* cuCtxCreate_v2 (asked for at 11.0: from 11.4 on the driver hands out
 * cuCtxCreate_v3, with execution-affinity arguments), which gmb does not
 * need: asked of the driver directly, for a context the application
 * made. */
typedef gmb_cu_result (*ctx_create_fn)(gmb_cu_ctx *c, unsigned flags,
                                       gmb_cu_device d);
typedef gmb_cu_result (*ctx_destroy_fn)(gmb_cu_ctx c);
typedef gmb_cu_result (*gpa_fn)(const char *sym, void **pfn, int ver,
                                unsigned long long flags, int *status);

static void *driver_fn(struct gmb_cudrv *d, const char *name) {
  gpa_fn gpa = (gpa_fn)(uintptr_t)dlsym(d->lib, "cuGetProcAddress_v2");
  ck_assert_ptr_nonnull((void *)(uintptr_t)gpa);
  void *fn = NULL;
  int status = 0;
  ck_assert_int_eq(gpa(name, &fn, 11000, 0, &status), 0);
  return fn;
}

/* A context of the program's own through the test's handle on the driver
 * (loaded here), current on the calling thread from now on; and its end,
 * after which the thread has none. */
static gmb_cu_ctx app_ctx_new(void) {
  test_drv_load();
  ctx_create_fn create =
      (ctx_create_fn)(uintptr_t)driver_fn(&test_drv, "cuCtxCreate");
  gmb_cu_ctx app = NULL;
  ck_assert_int_eq(create(&app, 0, 0), 0);
  return app;
}

static void app_ctx_end(gmb_cu_ctx app) {
  ctx_destroy_fn destroy =
      (ctx_destroy_fn)(uintptr_t)driver_fn(&test_drv, "cuCtxDestroy");
  ck_assert_int_eq(destroy(app), 0);
  ck_assert_int_eq(test_drv.cuCtxSetCurrent(NULL), 0);
}

START_TEST(no_context_made_current_behind_the_program) {
  exporter_start();
  fk_start();
  struct gmb_cudrv d;
  char err[256];
  ck_assert_msg(gmb__cudrv_load(&d, err, sizeof err) == 0, "%s", err);
  ctx_create_fn ctx_create = (ctx_create_fn)(uintptr_t)driver_fn(&d, "cuCtxCreate");
  ctx_destroy_fn ctx_destroy =
      (ctx_destroy_fn)(uintptr_t)driver_fn(&d, "cuCtxDestroy");
  /* Stands for a context the application made current itself. */
  gmb_cu_ctx app_ctx = NULL;
  ck_assert_int_eq(ctx_create(&app_ctx, 0, 0), 0);
  gmb_cu_ctx primary, cur = app_ctx;
  ck_assert_int_eq(d.cuDevicePrimaryCtxRetain(&primary, 0), 0);
  ck_assert_int_eq(d.cuCtxSetCurrent(NULL), 0);
  gmb_client *c = connect_ok();
  /* A thread with none stays with none, across the connect and an
   * import: a context made current would change the device its CUDA
   * runtime uses next. */
  ck_assert_int_eq(d.cuCtxGetCurrent(&cur), 0);
  ck_assert_ptr_null(cur);
  gmb_id id0;
  void *p0;
  ck_assert_int_eq(gmb_alloc(c, 512, 0, &id0), 0);
  ck_assert_int_eq(gmb_lock(c, id0, &p0), 0);
  ck_assert_int_eq(d.cuCtxGetCurrent(&cur), 0);
  ck_assert_ptr_null(cur);
  ck_assert_int_eq(gmb_unlock(c, id0), 0);
  (void)primary;
  /* A thread with its own context keeps it across an import. */
  ck_assert_int_eq(d.cuCtxSetCurrent(app_ctx), 0);
  gmb_id id;
  void *p;
  ck_assert_int_eq(gmb_alloc(c, 512, 0, &id), 0);
  ck_assert_int_eq(gmb_lock(c, id, &p), 0);
  ck_assert_int_eq(d.cuCtxGetCurrent(&cur), 0);
  ck_assert_ptr_eq(cur, app_ctx);
  ck_assert_int_eq(openers(1), 1);
  gmb_disconnect(c);
  ck_assert_int_eq(d.cuCtxGetCurrent(&cur), 0);
  ck_assert_ptr_eq(cur, app_ctx);
  ck_assert_int_eq(ctx_destroy(app_ctx), 0);
  ck_assert_int_eq(d.cuCtxSetCurrent(NULL), 0);
  gmb__cudrv_unload(&d);
  exporter_finish();
}
END_TEST

/* --- gmb_unlock_on_stream ------------------------------------------------------ */

/* A host function of the test that holds the fake's stream queue until
 * the gate opens, so the test decides when the stream "reaches" what was
 * queued after it. */
static atomic_int gate;

static void gate_fn(void *arg) {
  (void)arg;
  while (!atomic_load(&gate)) {
    struct timespec ts = {0, 1000000};
    nanosleep(&ts, NULL);
  }
}

/* Through the test's own handle on the same (already loaded) driver. */
static void block_stream(void) {
  test_drv_load();
  atomic_store(&gate, 0);
  ck_assert_int_eq(test_drv.cuLaunchHostFunc(NULL, gate_fn, NULL), 0);
}

static void unblock_stream_and_sync(void) {
  atomic_store(&gate, 1);
  ck_assert_int_eq(test_drv.cuStreamSynchronize(NULL), 0);
  gmb__cudrv_unload(&test_drv);
}

struct free_arg {
  gmb_client *c;
  gmb_id id;
  int rc;
};

static void *free_thread(void *arg) {
  struct free_arg *a = arg;
  a->rc = gmb_free(a->c, a->id);
  return NULL;
}

/* gmb_free waits for the device as cudaFree does: with work queued on the
 * stream, the Free reaches the broker only after the stream got past it. */
START_TEST(free_waits_for_queued_work) {
  exporter_start();
  fk_start();
  gmb_client *c = connect_ok();
  struct free_arg a = {c, 0, -100};
  ck_assert_int_eq(gmb_alloc(c, 4096, 0, &a.id), 0);
  atomic_store(&F.watch_gate, 1);
  block_stream();
  pthread_t t;
  ck_assert_int_eq(pthread_create(&t, NULL, free_thread, &a), 0);
  struct timespec ts = {0, 20 * 1000000}; /* a chance to free too early */
  nanosleep(&ts, NULL);
  unblock_stream_and_sync();
  pthread_join(t, NULL);
  ck_assert_int_eq(a.rc, 0);
  ck_assert_int_eq(ld(&F.n_free), 1);
  ck_assert_int_eq(ld(&F.free_early), 0);
  gmb_disconnect(c);
  exporter_finish();
}
END_TEST

/* The capture entry points, asked of the driver by the names a real
 * libcuda.so.1 exports. */
typedef gmb_cu_result (*begin_capture_fn)(gmb_cu_stream s, int mode);
typedef gmb_cu_result (*end_capture_fn)(gmb_cu_stream s, void **graph);
typedef gmb_cu_result (*graph_destroy_fn)(void *graph);

struct other_alloc {
  gmb_client *c;
  gmb_cu_stream s;
  int rc;
};

/* Another thread of the program (in the default, global capture mode)
 * allocates through gmb on a stream of its own while the main thread
 * captures: a miss there, as the library's own thread would do. */
static void *alloc_other_thread(void *arg) {
  struct other_alloc *o = arg;
  void *p = NULL;
  o->rc = gmb_malloc_async(o->c, 1 << 20, o->s, &p);
  if (o->rc == 0) o->rc = gmb_free_async(o->c, p, o->s);
  return NULL;
}

/* A cache miss while the calling stream is captured into a CUDA graph in
 * the global mode (torch.cuda.graph's default): the broker round trip,
 * the import and the map happen in the relaxed capture mode, so the
 * driver refuses none of them and the capture is not invalidated; nor by
 * a miss in another thread meanwhile.  No event is recorded on the
 * capturing stream.  The stand-in refuses, and logs as misuse, every
 * potentially unsafe call of a capture's global mode. */
START_TEST(cache_miss_during_capture_keeps_the_capture) {
  exporter_start();
  fk_start();
  gmb_client *c = connect_ok();
  test_drv_load();
  begin_capture_fn begin = (begin_capture_fn)(uintptr_t)dlsym(
      test_drv.lib, "cuStreamBeginCapture_v2");
  end_capture_fn end =
      (end_capture_fn)(uintptr_t)dlsym(test_drv.lib, "cuStreamEndCapture");
  graph_destroy_fn gdestroy =
      (graph_destroy_fn)(uintptr_t)dlsym(test_drv.lib, "cuGraphDestroy");
  ck_assert_ptr_nonnull((void *)(uintptr_t)begin);
  ck_assert_ptr_nonnull((void *)(uintptr_t)end);
  ck_assert_ptr_nonnull((void *)(uintptr_t)gdestroy);
  gmb_cu_stream s, s2;
  ck_assert_int_eq(test_drv.cuStreamCreate(&s, GMB_CU_STREAM_NON_BLOCKING), 0);
  ck_assert_int_eq(test_drv.cuStreamCreate(&s2, GMB_CU_STREAM_NON_BLOCKING), 0);
  ck_assert_int_eq(begin(s, 0 /* CU_STREAM_CAPTURE_MODE_GLOBAL */), 0);
  ck_assert_int_eq(gmb_stream_capturing(c, s), 1);
  void *p = NULL;
  int rc = gmb_malloc_async(c, 1 << 20, s, &p);
  ck_assert_msg(rc == 0, "miss during capture: %s", gmb_last_error(c));
  struct other_alloc o = {c, s2, -1};
  pthread_t t;
  ck_assert_int_eq(pthread_create(&t, NULL, alloc_other_thread, &o), 0);
  ck_assert_int_eq(pthread_join(t, NULL), 0);
  ck_assert_msg(o.rc == 0, "the other thread: %s", gmb_last_error(c));
  ck_assert_int_eq(gmb_free_async(c, p, s), 0);
  void *g = NULL;
  ck_assert_int_eq(end(s, &g), 0); /* not CUDA_ERROR_..._INVALIDATED */
  ck_assert_ptr_nonnull(g);
  ck_assert_int_eq(gdestroy(g), 0);
  ck_assert_msg(access(F.log, F_OK) != 0, "the stand-in logged misuse");
  /* The legacy stream while a blocking stream captures counts as
   * capturing (CUDA_ERROR_STREAM_CAPTURE_IMPLICIT). */
  gmb_cu_stream b;
  ck_assert_int_eq(test_drv.cuStreamCreate(&b, 0), 0);
  ck_assert_int_eq(gmb_stream_capturing(c, NULL), 0);
  ck_assert_int_eq(begin(b, 2 /* CU_STREAM_CAPTURE_MODE_RELAXED */), 0);
  ck_assert_int_eq(gmb_stream_capturing(c, NULL), 1);
  ck_assert_int_eq(end(b, &g), 0);
  ck_assert_int_eq(gdestroy(g), 0);
  ck_assert_int_eq(test_drv.cuStreamDestroy(b), 0);
  ck_assert_int_eq(test_drv.cuStreamDestroy(s2), 0);
  ck_assert_int_eq(test_drv.cuStreamDestroy(s), 0);
  gmb_disconnect(c);
  gmb__cudrv_unload(&test_drv);
  exporter_finish();
}
END_TEST

/* A page of the cache left idle by a block freed on stream s, then a
 * capture of s in the global mode (torch.cuda.graph's default) begun on
 * this thread: the page cannot go back now (its block's stream work
 * cannot be waited for: no event can be recorded on s, and a
 * cuCtxSynchronize would break the capture). */
struct capture_rig {
  gmb_client *c;
  gmb_cu_stream s;
  begin_capture_fn begin;
  end_capture_fn end;
  graph_destroy_fn gdestroy;
};

static void capture_rig_start(struct capture_rig *r) {
  r->c = connect_ok();
  test_drv_load();
  r->begin = (begin_capture_fn)(uintptr_t)dlsym(test_drv.lib,
                                                "cuStreamBeginCapture_v2");
  r->end = (end_capture_fn)(uintptr_t)dlsym(test_drv.lib,
                                            "cuStreamEndCapture");
  r->gdestroy =
      (graph_destroy_fn)(uintptr_t)dlsym(test_drv.lib, "cuGraphDestroy");
  ck_assert_ptr_nonnull((void *)(uintptr_t)r->begin);
  ck_assert_ptr_nonnull((void *)(uintptr_t)r->end);
  ck_assert_ptr_nonnull((void *)(uintptr_t)r->gdestroy);
  ck_assert_int_eq(test_drv.cuStreamCreate(&r->s, GMB_CU_STREAM_NON_BLOCKING),
                   0);
  void *p = NULL;
  ck_assert_int_eq(gmb_malloc_async(r->c, 1 << 20, r->s, &p), 0);
  ck_assert_int_eq(gmb_free_async(r->c, p, r->s), 0);
  gmb_cache_stats st;
  ck_assert_int_eq(gmb_cache_stats_get(r->c, &st), 0);
  ck_assert_uint_eq(st.idle, PAGE_SIZE);
  ck_assert_int_eq(r->begin(r->s, 0 /* CU_STREAM_CAPTURE_MODE_GLOBAL */), 0);
}

/* Ends the capture (it must have stayed valid: a graph, nothing in the
 * stand-in's misuse log), then waits (under Check's timeout) for the
 * library's thread to give the deferred page back. */
static void capture_rig_finish(struct capture_rig *r) {
  void *g = NULL;
  ck_assert_int_eq(r->end(r->s, &g), 0); /* not ..._INVALIDATED */
  ck_assert_ptr_nonnull(g);
  ck_assert_int_eq(r->gdestroy(g), 0);
  ck_assert_msg(access(F.log, F_OK) != 0, "the stand-in logged misuse");
  wait_for(&F.n_free, 1);
  gmb_cache_stats st;
  ck_assert_int_eq(gmb_cache_stats_get(r->c, &st), 0);
  ck_assert_uint_eq(st.idle, 0);
}

static void capture_rig_close(struct capture_rig *r) {
  ck_assert_int_eq(test_drv.cuStreamDestroy(r->s), 0);
  gmb_disconnect(r->c);
  gmb__cudrv_unload(&test_drv);
  ck_assert_msg(access(F.log, F_OK) != 0, "the stand-in logged misuse");
}

/* The broker asks the process to trim (another tenant needs memory)
 * while the program captures: the library's thread answers without
 * breaking the capture, keeps the page meanwhile, and gives it back
 * once the capture ended. */
START_TEST(trim_asked_during_capture_deferred) {
  exporter_start();
  fk_start();
  struct capture_rig r;
  capture_rig_start(&r);
  atomic_store(&F.trim_now, (uint64_t)PAGE_SIZE);
  wait_for(&F.n_trim_answered, 1);
  ck_assert_int_eq(ld(&F.n_free), 0);
  capture_rig_finish(&r);
  capture_rig_close(&r);
  exporter_finish();
}
END_TEST

struct other_trim {
  gmb_client *c;
  gmb_id id;
  int trim_rc, free_rc;
  char free_err[256];
};

/* Another thread of the program, in the default global capture mode:
 * gmb_trim, and gmb_free of an allocation. */
static void *trim_other_thread(void *arg) {
  struct other_trim *o = arg;
  o->trim_rc = gmb_trim(o->c, 0);
  o->free_rc = gmb_free(o->c, o->id);
  snprintf(o->free_err, sizeof o->free_err, "%s", gmb_last_error(o->c));
  return NULL;
}

/* gmb_trim from another thread while the program captures: no wait for
 * the device (the driver would refuse it and break the capture); the
 * page goes back once the capture ended, by the library's thread.  A
 * gmb_free meanwhile, which would have to wait, fails clearly and frees
 * nothing; after the capture it frees. */
START_TEST(trim_during_capture_deferred) {
  exporter_start();
  fk_start();
  struct capture_rig r;
  capture_rig_start(&r);
  gmb_id id;
  ck_assert_int_eq(gmb_alloc(r.c, 4096, 0, &id), 0);
  struct other_trim o = {r.c, id, -1, -1, ""};
  pthread_t t;
  ck_assert_int_eq(pthread_create(&t, NULL, trim_other_thread, &o), 0);
  ck_assert_int_eq(pthread_join(t, NULL), 0);
  ck_assert_int_eq(ld(&F.n_free), 0);
  capture_rig_finish(&r);
  ck_assert_int_eq(o.trim_rc, 0);
  ck_assert_int_eq(o.free_rc, GMB_E_DEVICE);
  ck_assert_msg(strstr(o.free_err, "not freed") &&
                    strstr(o.free_err, "capture is underway"),
                "%s", o.free_err);
  ck_assert_int_eq(gmb_free(r.c, id), 0);
  ck_assert_int_eq(ld(&F.n_free), 2);
  capture_rig_close(&r);
  exporter_finish();
}
END_TEST

/* A program's own context (cuCtxCreate) runs work on gmb's memory: a
 * gmb_free from a thread with no context (or the primary one) waits for
 * that context too, as cudaFree waits for the device, since the driver's
 * cuCtxSynchronize waits only for the current context.  The context is
 * known to the library from the connect made while it was current; one
 * seen only at an import counts too (the second round).  A context since
 * destroyed is forgotten, not an error. */
START_TEST(free_waits_for_work_in_program_context) {
  exporter_start();
  fk_start();
  test_drv_load();
  ctx_create_fn ctx_create =
      (ctx_create_fn)(uintptr_t)driver_fn(&test_drv, "cuCtxCreate");
  ctx_destroy_fn ctx_destroy =
      (ctx_destroy_fn)(uintptr_t)driver_fn(&test_drv, "cuCtxDestroy");
  for (int round = 0; round < 2; round++) {
    gmb_cu_ctx app = NULL;
    ck_assert_int_eq(ctx_create(&app, 0, 0), 0); /* current now */
    if (round == 1) ck_assert_int_eq(test_drv.cuCtxSetCurrent(NULL), 0);
    gmb_client *c = connect_ok();
    struct free_arg a = {c, 0, -100};
    void *p;
    ck_assert_int_eq(test_drv.cuCtxSetCurrent(app), 0);
    ck_assert_int_eq(gmb_alloc(c, 4096, 0, &a.id), 0);
    ck_assert_int_eq(gmb_lock(c, a.id, &p), 0); /* the import notes it */
    gmb_cu_stream s;
    ck_assert_int_eq(test_drv.cuStreamCreate(&s, GMB_CU_STREAM_NON_BLOCKING),
                     0);
    atomic_store(&F.free_early, 0);
    atomic_store(&F.n_free, 0);
    atomic_store(&F.watch_gate, 1);
    atomic_store(&gate, 0);
    ck_assert_int_eq(test_drv.cuLaunchHostFunc(s, gate_fn, NULL), 0);
    ck_assert_int_eq(gmb_unlock(c, a.id), 0);
    pthread_t t; /* a thread with no context current */
    ck_assert_int_eq(pthread_create(&t, NULL, free_thread, &a), 0);
    struct timespec ts = {0, 20 * 1000000}; /* a chance to free too early */
    nanosleep(&ts, NULL);
    atomic_store(&gate, 1);
    pthread_join(t, NULL);
    ck_assert_int_eq(a.rc, 0);
    ck_assert_int_eq(ld(&F.n_free), 1);
    ck_assert_int_eq(ld(&F.free_early), 0);
    ck_assert_int_eq(test_drv.cuStreamDestroy(s), 0);
    /* Destroyed: the next free does not trip over it. */
    ck_assert_int_eq(ctx_destroy(app), 0);
    ck_assert_int_eq(gmb_alloc(c, 4096, 0, &a.id), 0);
    ck_assert_int_eq(gmb_free(c, a.id), 0);
    gmb_disconnect(c);
  }
  ck_assert_int_eq(test_drv.cuCtxSetCurrent(NULL), 0);
  gmb__cudrv_unload(&test_drv);
  exporter_finish();
}
END_TEST

/* gmb_write's bytes are in device memory when it returns, for every
 * reader: a copy from pageable memory returns once the driver staged the
 * bytes, and only the legacy stream of the context that copied is
 * ordered after them; here another context reads at once, while the
 * stand-in holds the copy back. */
START_TEST(write_landed_when_it_returns) {
  exporter_start();
  fk_start();
  gmb_client *c = connect_ok();
  gmb_id id;
  uint8_t pat[4096], got[4096];
  void *p;
  for (size_t i = 0; i < sizeof pat; i++) pat[i] = (uint8_t)(i * 13 + 0x5a);
  ck_assert_int_eq(gmb_alloc(c, sizeof pat, 0, &id), 0);
  setenv("FAKECUDA_HTOD_DELAY_MS", "300", 1);
  ck_assert_int_eq(gmb_write(c, id, 0, pat, sizeof pat), 0);
  unsetenv("FAKECUDA_HTOD_DELAY_MS");
  ck_assert_int_eq(gmb_lock(c, id, &p), 0);
  gmb_cu_ctx app = app_ctx_new();
  dev_read(got, p, sizeof got);
  app_ctx_end(app);
  ck_assert_int_eq(memcmp(got, pat, sizeof pat), 0);
  ck_assert_int_eq(gmb_unlock(c, id), 0);
  ck_assert_int_eq(gmb_free(c, id), 0);
  gmb_disconnect(c);
  gmb__cudrv_unload(&test_drv);
  exporter_finish();
}
END_TEST

/* A copy of 64 bytes from p in device d's primary context, then device
 * 0's made current again: the driver's answer. */
static gmb_cu_result copy_on_device(int d, void *p) {
  gmb_cu_ctx ctx, ctx0;
  uint8_t b[64];
  ck_assert_int_eq(test_drv.cuDevicePrimaryCtxRetain(&ctx, d), 0);
  ck_assert_int_eq(test_drv.cuDevicePrimaryCtxRetain(&ctx0, 0), 0);
  ck_assert_int_eq(test_drv.cuCtxSetCurrent(ctx), 0);
  gmb_cu_result r = test_drv.cuMemcpyDtoH(b, (gmb_cu_ptr)(uintptr_t)p,
                                          sizeof b);
  ck_assert_int_eq(test_drv.cuCtxSetCurrent(ctx0), 0);
  return r;
}

/* Memory of GPU 0's broker is mapped for GPU 0 only (access is per
 * device, and a program's peer access does not reach virtual-memory
 * memory); with GMB_PEER_ACCESS=1 every GPU that can reach it may use it
 * too.  The refused copy is the stand-in's misuse, logged. */
START_TEST(peer_access_only_when_asked) {
  setenv("FAKECUDA_DEVICES", "2", 1);
  exporter_start();
  fk_start();
  gmb_client *c = connect_ok();
  test_drv_load();
  gmb_id id;
  void *p;
  ck_assert_int_eq(gmb_alloc(c, 4096, 0, &id), 0);
  ck_assert_int_eq(gmb_lock(c, id, &p), 0);
  ck_assert_int_eq(copy_on_device(0, p), 0);
  ck_assert_int_eq(copy_on_device(1, p), GMB_CU_ERROR_INVALID_VALUE);
  ck_assert_msg(access(F.log, F_OK) == 0, "no refusal logged");
  unlink(F.log);
  ck_assert_int_eq(gmb_unlock(c, id), 0);
  gmb_disconnect(c);
  setenv("GMB_PEER_ACCESS", "1", 1);
  c = connect_ok();
  ck_assert_int_eq(gmb_alloc(c, 4096, 0, &id), 0);
  ck_assert_int_eq(gmb_lock(c, id, &p), 0);
  ck_assert_int_eq(copy_on_device(1, p), 0);
  ck_assert_int_eq(copy_on_device(0, p), 0);
  ck_assert_int_eq(gmb_unlock(c, id), 0);
  gmb_disconnect(c);
  unsetenv("GMB_PEER_ACCESS");
  gmb__cudrv_unload(&test_drv);
  exporter_finish();
  unsetenv("FAKECUDA_DEVICES");
}
END_TEST

/* When the wait fails (here: a graph capture, during which the driver
 * refuses to synchronise) nothing is handed back; later it is. */
/* The stream-ordered cache on a GPU: gmb_free_async returns at once with
 * the stream's work still queued (the test would hang otherwise) and
 * records nothing; the block is not given to another stream until that
 * work ran (an event recorded when the other stream wants it), and is
 * given then.  A block freed on a destroyed stream is never given to
 * another stream (no event can be recorded on it).  No Free reaches the
 * broker. */
START_TEST(free_async_ordered_by_event) {
  exporter_start();
  fk_start();
  gmb_client *c = connect_ok();
  void *p, *q, *r;
  ck_assert_int_eq(gmb_malloc_async(c, 65536, NULL, &p), 0);
  block_stream(); /* the legacy stream waits at the gate */
  gmb_cu_stream s2, s3;
  ck_assert_int_eq(test_drv.cuStreamCreate(&s2, GMB_CU_STREAM_NON_BLOCKING), 0);
  ck_assert_int_eq(test_drv.cuStreamCreate(&s3, GMB_CU_STREAM_NON_BLOCKING), 0);
  ck_assert_int_eq(gmb_free_async(c, p, NULL), 0);
  /* Same stream: at once.  Then freed again on it. */
  ck_assert_int_eq(gmb_malloc_async(c, 65536, NULL, &q), 0);
  ck_assert_ptr_eq(q, p);
  ck_assert_int_eq(gmb_free_async(c, q, NULL), 0);
  /* Another stream: not while the legacy stream's work is queued.  The
   * fake broker has two pages: the second is s2's, filled by q, x and y;
   * then nothing is left for s2 but the first, which it must not have. */
  void *x, *y, *z;
  ck_assert_int_eq(gmb_malloc_async(c, 65536, s2, &q), 0);
  ck_assert_ptr_ne(q, p);
  ck_assert_int_eq(gmb_malloc_async(c, 1 << 20, s2, &x), 0);
  ck_assert_int_eq(gmb_malloc_async(c, 960 << 10, s2, &y), 0);
  ck_assert_int_eq(gmb_malloc_async(c, 65536, s2, &z), GMB_E_NOMEM);
  /* A free on a destroyed stream makes no driver call: it succeeds, and
   * the block is s3's for good. */
  ck_assert_int_eq(test_drv.cuStreamDestroy(s3), 0);
  ck_assert_int_eq(gmb_free_async(c, q, s3), 0);
  atomic_store(&gate, 1);
  ck_assert_int_eq(test_drv.cuStreamSynchronize(NULL), 0);
  ck_assert_int_eq(gmb_malloc_async(c, 65536, s2, &r), 0);
  ck_assert_ptr_eq(r, p);
  ck_assert_int_eq(gmb_malloc_async(c, 65536, s2, &z), 0);
  ck_assert_ptr_ne(z, q);
  ck_assert_int_eq(gmb_free_async(c, r, s2), 0);
  ck_assert_int_eq(gmb_free_async(c, z, s2), 0);
  ck_assert_int_eq(gmb_free_async(c, x, s2), 0);
  ck_assert_int_eq(gmb_free_async(c, y, s2), 0);
  ck_assert_int_eq(test_drv.cuStreamDestroy(s2), 0);
  gmb__cudrv_unload(&test_drv);
  ck_assert_int_eq(ld(&F.n_free), 0);
  gmb_disconnect(c);
  exporter_finish();
}
END_TEST

/* A block freed on a stream of the program's own context: gmb's events
 * are its primary context's, which the driver will not record on that
 * stream, so the block is not handed to another stream while the work
 * queued there may still use it. */
START_TEST(free_async_on_stream_of_program_context) {
  exporter_start();
  fk_start();
  gmb_cu_ctx app = app_ctx_new();
  gmb_client *c = connect_ok();
  gmb_cu_stream s;
  ck_assert_int_eq(test_drv.cuStreamCreate(&s, GMB_CU_STREAM_NON_BLOCKING), 0);
  void *p, *q;
  ck_assert_int_eq(gmb_malloc_async(c, 65536, s, &p), 0);
  atomic_store(&gate, 0);
  ck_assert_int_eq(test_drv.cuLaunchHostFunc(s, gate_fn, NULL), 0);
  ck_assert_int_eq(gmb_free_async(c, p, s), 0);
  ck_assert_int_eq(gmb_malloc_async(c, 65536, NULL, &q), 0);
  ck_assert_ptr_ne(q, p);
  atomic_store(&gate, 1);
  ck_assert_int_eq(test_drv.cuStreamSynchronize(s), 0);
  ck_assert_int_eq(gmb_free_async(c, q, NULL), 0);
  ck_assert_int_eq(test_drv.cuStreamDestroy(s), 0);
  gmb_disconnect(c);
  app_ctx_end(app);
  gmb__cudrv_unload(&test_drv);
  exporter_finish();
}
END_TEST

START_TEST(free_not_sent_when_wait_fails) {
  exporter_start();
  fk_start();
  gmb_client *c = connect_ok();
  gmb_id id;
  ck_assert_int_eq(gmb_alloc(c, 4096, 0, &id), 0);
  setenv("FAKECUDA_CAPTURING", "all", 1);
  ck_assert_int_eq(gmb_free(c, id), GMB_E_DEVICE);
  ck_assert_msg(strstr(gmb_last_error(c), "not freed") &&
                    strstr(gmb_last_error(c), "capture is underway"),
                "%s", gmb_last_error(c));
  ck_assert_int_eq(ld(&F.n_free), 0);
  ck_assert_int_eq(gmb_stream_capturing(c, NULL), 1);
  unsetenv("FAKECUDA_CAPTURING");
  ck_assert_int_eq(gmb_stream_capturing(c, NULL), 0);
  ck_assert_int_eq(gmb_free(c, id), 0);
  ck_assert_int_eq(ld(&F.n_free), 1);
  gmb_disconnect(c);
  exporter_finish();
}
END_TEST

/* A release recorded into a graph would run at every replay and never
 * now: refused while the stream captures, nothing queued, hold kept. */
START_TEST(unlock_on_stream_refused_during_capture) {
  exporter_start();
  fk_start();
  gmb_client *c = connect_ok();
  gmb_id id;
  void *p;
  ck_assert_int_eq(gmb_alloc(c, 4096, GMB_MOVABLE, &id), 0);
  ck_assert_int_eq(gmb_lock(c, id, &p), 0);
  uint64_t pending0 = gmb__cuda_pending();
  setenv("FAKECUDA_CAPTURING", "all", 1);
  ck_assert_int_eq(gmb_unlock_on_stream(c, id, NULL), GMB_E_INVAL);
  unsetenv("FAKECUDA_CAPTURING");
  ck_assert_msg(strstr(gmb_last_error(c), "captured into a CUDA graph"), "%s",
                gmb_last_error(c));
  ck_assert_uint_eq(gmb__cuda_pending(), pending0);
  ck_assert_uint_eq(lt_state(id), 1);
  ck_assert_int_eq(gmb_unlock(c, id), 0);
  gmb_disconnect(c);
  exporter_finish();
}
END_TEST

/* The contract of gmb_unlock_on_stream with queued work: a copy queued on
 * the stream into a locked movable allocation, then the release.  Until
 * the stream has run both, the broker's claim of the slot (CAS 0 ->
 * MOVING, done here as the broker does it) fails, so a move can never
 * copy the allocation while the queued copy still writes it; after, the
 * claim succeeds and the bytes are the copy's. */
START_TEST(move_claim_waits_for_queued_work) {
  exporter_start();
  fk_start();
  gmb_client *c = connect_ok();
  gmb_id id, src;
  void *p, *s;
  ck_assert_int_eq(gmb_alloc(c, 4096, GMB_MOVABLE, &id), 0);
  ck_assert_int_eq(gmb_alloc(c, 4096, 0, &src), 0);
  char pat[4096], back[4096];
  for (size_t i = 0; i < sizeof pat; i++) pat[i] = (char)(i * 13 + 5);
  ck_assert_int_eq(gmb_write(c, src, 0, pat, sizeof pat), 0);
  ck_assert_int_eq(gmb_lock(c, id, &p), 0);
  ck_assert_int_eq(gmb_lock(c, src, &s), 0);
  block_stream();
  ck_assert_int_eq(test_drv.cuMemcpyDtoDAsync((gmb_cu_ptr)(uintptr_t)p,
                                              (gmb_cu_ptr)(uintptr_t)s,
                                              sizeof pat, NULL),
                   0);
  ck_assert_int_eq(gmb_unlock_on_stream(c, id, NULL), 0);
  _Atomic uint32_t *state = &gmb__lt_slots(F.lt)[id - 1].state;
  uint32_t zero = 0;
  ck_assert(!atomic_compare_exchange_strong(state, &zero, GMB_LT_MOVING));
  unblock_stream_and_sync();
  zero = 0;
  ck_assert(atomic_compare_exchange_strong(state, &zero, GMB_LT_MOVING));
  atomic_store(state, 0); /* the "move" ends where it began */
  ck_assert_int_eq(gmb_read(c, id, 0, back, sizeof back), 0);
  ck_assert_mem_eq(back, pat, sizeof pat);
  gmb_disconnect(c);
  exporter_finish();
}
END_TEST

/* --- a broker that lies about its memory ---------------------------------------- */

/* The descriptor is not device memory: the alloc fails with the driver's
 * reason, is given back, and leaves nothing mapped or open; the channel
 * stays usable. */
START_TEST(segment_descriptor_not_device_memory) {
  exporter_start();
  F.other_fd = fake_memfd("gmb-check-ccuda-bogus", SEG_SIZE, LT_SEALS);
  F.fd_handler = fd_other;
  fk_start();
  gmb_client *c = connect_ok();
  gmb_id id = 77;
  ck_assert_int_eq(gmb_alloc(c, 512, 0, &id), GMB_E_DEVICE);
  ck_assert_uint_eq(id, 0);
  const char *e = gmb_last_error(NULL);
  ck_assert_msg(strstr(e, "cuMemImportFromShareableHandle") &&
                    strstr(e, "segment 1"),
                "%s", e);
  ck_assert_int_eq(ld(&F.n_free), 1); /* the alloc given back */
  ck_assert_int_eq(fd_links("memfd:gmb-check-ccuda-bogus"), 1); /* ours */
  ck_assert_int_eq(openers(1), 0);
  F.fd_handler = NULL; /* honest again */
  void *p;
  ck_assert_int_eq(gmb_alloc(c, 512, 0, &id), 0);
  ck_assert_int_eq(gmb_lock(c, id, &p), 0);
  ck_assert_int_eq(openers(1), 1);
  ck_assert_int_eq(ld(&F.n_segment), 2);
  gmb_disconnect(c);
  ck_assert_int_eq(openers(1), 0);
  exporter_finish();
}
END_TEST

/* The right descriptor with a wrong size: not a multiple of the
 * granularity (refused before the driver is asked), or more than the
 * allocation holds (the driver refuses the mapping). */
START_TEST(segment_descriptor_with_wrong_size) {
  exporter_start();
  F.fd_handler = fd_other;
  F.other_size = SEG_SIZE - 4096;
  fk_start();
  gmb_client *c = connect_ok();
  gmb_id id;
  ck_assert_int_eq(gmb_alloc(c, 512, 0, &id), GMB_E_PROTO);
  ck_assert_msg(strstr(gmb_last_error(NULL), "granularity"), "%s",
                gmb_last_error(NULL));
  F.other_size = 2 * (uint64_t)SEG_SIZE;
  ck_assert_int_eq(gmb_alloc(c, 512, 0, &id), GMB_E_DEVICE);
  ck_assert_msg(strstr(gmb_last_error(NULL), "cuMemMap"), "%s",
                gmb_last_error(NULL));
  ck_assert_int_eq(ld(&F.n_free), 2);
  ck_assert_int_eq(openers(1), 0);
  ck_assert_int_eq(seg_fds(1), 1); /* neither the client nor the driver
                                      kept one */
  /* The oversized mapping is misuse the fake reports: expected here. */
  unlink(F.log);
  F.fd_handler = NULL;
  void *p;
  ck_assert_int_eq(gmb_alloc(c, 512, 0, &id), 0);
  ck_assert_int_eq(gmb_lock(c, id, &p), 0);
  ck_assert_int_eq(openers(1), 1);
  gmb_disconnect(c);
  exporter_finish();
}
END_TEST

/* A movable allocation moved to a segment whose descriptor the driver
 * cannot import: gmb_lock fails with the driver's reason and gives its
 * hold back; once the broker is honest the same lock maps the segment. */
START_TEST(movable_lock_into_unimportable_segment) {
  exporter_start();
  fk_start();
  gmb_client *c = connect_ok();
  gmb_id id;
  uint8_t *p;
  ck_assert_int_eq(gmb_alloc(c, 4096, GMB_MOVABLE, &id), 0);
  struct gmb__lt_slot *sl = &gmb__lt_slots(F.lt)[id - 1];
  uint32_t zero = 0;
  ck_assert(atomic_compare_exchange_strong(&sl->state, &zero, GMB_LT_MOVING));
  sl->segment = 2;
  sl->offset = 0;
  atomic_store_explicit(&sl->state, 0, memory_order_release);
  F.other_fd = fake_memfd("gmb-check-ccuda-bogus", SEG_SIZE, LT_SEALS);
  F.fd_handler = fd_other;
  ck_assert_int_eq(gmb_lock(c, id, (void **)&p), GMB_E_DEVICE);
  ck_assert_msg(strstr(gmb_last_error(NULL), "cuMemImportFromShareableHandle"),
                "%s", gmb_last_error(NULL));
  ck_assert_uint_eq(lt_state(id), 0); /* no hold left behind */
  ck_assert_int_eq(openers(2), 0);
  ck_assert_int_eq(fd_links("memfd:gmb-check-ccuda-bogus"), 1);
  F.fd_handler = NULL;
  ck_assert_int_eq(gmb_lock(c, id, (void **)&p), 0);
  ck_assert_uint_eq(lt_state(id), 1);
  ck_assert_int_eq(openers(2), 1);
  ck_assert_int_eq(ld(&F.n_segment), 3); /* 1, 2 refused, 2 */
  test_drv_load();
  uint8_t got[64];
  dev_read(got, p, sizeof got);
  for (size_t i = 0; i < sizeof got; i++)
    ck_assert_uint_eq(got[i], pattern(1, i));
  gmb__cudrv_unload(&test_drv);
  ck_assert_int_eq(gmb_unlock(c, id), 0);
  gmb_disconnect(c);
  ck_assert_int_eq(openers(2), 0);
  exporter_finish();
}
END_TEST

START_TEST(unlock_on_stream_releases_when_stream_runs) {
  exporter_start();
  fk_start();
  gmb_client *c = connect_ok();
  gmb_id id, pinned;
  void *p;
  ck_assert_int_eq(gmb_alloc(c, 4096, GMB_MOVABLE, &id), 0);
  ck_assert_int_eq(gmb_alloc(c, 512, 0, &pinned), 0);
  ck_assert_int_eq(gmb_lock(c, id, &p), 0);
  ck_assert_int_eq(gmb_lock(c, id, &p), 0);
  ck_assert_uint_eq(lt_state(id), 2);
  uint64_t pending0 = gmb__cuda_pending();
  block_stream();
  ck_assert_int_eq(gmb_unlock_on_stream(c, id, NULL), 0);
  ck_assert_uint_eq(lt_state(id), 2); /* not before the stream gets there */
  ck_assert_uint_eq(gmb__cuda_pending(), pending0 + 1);
  unblock_stream_and_sync();
  ck_assert_uint_eq(lt_state(id), 1);
  ck_assert_uint_eq(gmb__cuda_pending(), pending0);
  ck_assert_int_eq(gmb_unlock(c, id), 0);
  /* Not locked: refused at once, nothing queued. */
  ck_assert_int_eq(gmb_unlock_on_stream(c, id, NULL), GMB_E_INVAL);
  ck_assert_uint_eq(gmb__cuda_pending(), pending0);
  /* Pinned: nothing to release. */
  ck_assert_int_eq(gmb_unlock_on_stream(c, pinned, NULL), 0);
  ck_assert_int_eq(gmb_unlock_on_stream(c, 999, NULL), GMB_E_NOENT);
  ck_assert_uint_eq(gmb__cuda_pending(), pending0);
  gmb_disconnect(c);
  exporter_finish();
}
END_TEST

START_TEST(unlock_on_stream_outlives_disconnect) {
  exporter_start();
  fk_start();
  gmb_client *c = connect_ok();
  gmb_id id;
  void *p;
  ck_assert_int_eq(gmb_alloc(c, 4096, GMB_MOVABLE, &id), 0);
  ck_assert_int_eq(gmb_lock(c, id, &p), 0);
  /* Retire the segment first, so that the disconnect below has nothing
   * to unmap and returns while the release is still queued. */
  atomic_store(&F.retire_on_stats, 1);
  gmb_stats st;
  ck_assert_int_eq(gmb_tenant_stats(c, &st), 0);
  ck_assert_int_eq(openers(1), 0);
  int maps_before = lt_mappings(); /* the test's and the client's */
  ck_assert_int_eq(maps_before, 2);
  block_stream();
  ck_assert_int_eq(gmb_unlock_on_stream(c, id, NULL), 0);
  gmb_disconnect(c);
  ck_assert_uint_eq(lt_state(id), 1);
  ck_assert_int_eq(lt_mappings(), 2); /* still mapped for the release */
  unblock_stream_and_sync();
  ck_assert_uint_eq(lt_state(id), 0); /* written through the kept mapping */
  /* The next attach (a connect) unmaps what is no longer needed. */
  c = connect_ok();
  ck_assert_int_eq(lt_mappings(), 2); /* the test's and the new client's */
  gmb_disconnect(c);
  ck_assert_int_eq(lt_mappings(), 1);
  ck_assert_int_eq(ld(&F.n_auth), 2);
  exporter_finish();
}
END_TEST

/* --- other processes ---------------------------------------------------------- */

/* The --client process: a session of its own that allocates 4096 bytes
 * (at `off` in segment 1, the fake's next place), checks the exporter's
 * pattern there by copies and overwrites it with 0xcd.  Exit 0, or the
 * step that failed. */
static int client_child_main(const char *endpoint, uint64_t off) {
  gmb_client *c = NULL;
  int step = 10;
  if (gmb_connect(endpoint, "team-a", &c) != 0) goto fail;
  gmb_id id;
  void *p;
  step++;
  if (gmb_alloc(c, 4096, 0, &id) != 0 || gmb_lock(c, id, &p) != 0) goto fail;
  struct gmb_cudrv d;
  char err[256];
  step++;
  if (gmb__cudrv_load(&d, err, sizeof err) != 0) goto fail;
  /* Its own context, as a program's CUDA runtime makes one. */
  gmb_cu_ctx ctx;
  if (d.cuDevicePrimaryCtxRetain(&ctx, 0) != 0 || d.cuCtxSetCurrent(ctx) != 0)
    goto fail;
  uint8_t b[4096];
  step++;
  if (d.cuMemcpyDtoH(b, (gmb_cu_ptr)(uintptr_t)p, sizeof b) != 0) goto fail;
  step++;
  for (size_t i = 0; i < sizeof b; i++)
    if (b[i] != pattern(0, off + i)) goto fail;
  memset(b, 0xcd, sizeof b);
  step++;
  /* Landed before the process goes (from pageable memory the copy
   * returns before it does). */
  if (d.cuMemcpyHtoD((gmb_cu_ptr)(uintptr_t)p, b, sizeof b) != 0 ||
      d.cuStreamSynchronize(NULL) != 0)
    goto fail;
  gmb__cudrv_unload(&d);
  gmb_unlock(c, id);
  gmb_disconnect(c);
  return 0;
fail:
  fprintf(stderr, "client child: step %d: %s\n", step, gmb_last_error(NULL));
  return step;
}

/* Another process (this program exec'd: a fork of this one could not use
 * the driver) imports the same segment through its own session, and its
 * writes are what this process reads. */
START_TEST(client_in_exec_child_shares_segment) {
  exporter_start();
  fk_start();
  gmb_client *c = connect_ok();
  gmb_id a;
  uint8_t *pa;
  ck_assert_int_eq(gmb_alloc(c, 4096, 0, &a), 0);
  ck_assert_int_eq(gmb_lock(c, a, (void **)&pa), 0);
  uint64_t off = atomic_load(&F.next_offset); /* where the child's goes */
  char arg[32];
  snprintf(arg, sizeof arg, "%llu", (unsigned long long)off);
  char *argv[] = {self_exe, "--client", F.endpoint, arg, NULL};
  fflush(NULL);
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0) {
    execve(self_exe, argv, environ);
    _exit(127);
  }
  int st;
  ck_assert_int_eq(waitpid(pid, &st, 0), pid);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "child: 0x%x", st);
  ck_assert_int_eq(ld(&F.n_auth), 2);
  ck_assert_int_eq(ld(&F.n_segment), 2);
  ck_assert_int_eq(ld(&F.n_bye), 1);
  test_drv_load();
  uint8_t got[4096];
  dev_read(got, pa + off, sizeof got);
  for (size_t i = 0; i < sizeof got; i++) ck_assert_uint_eq(got[i], 0xcd);
  gmb__cudrv_unload(&test_drv);
  gmb_disconnect(c);
  exporter_finish();
}
END_TEST

/* A child forked after this process attached cannot use the driver (the
 * real one refuses it everything): its session fails with GMB_E_DEVICE and
 * the driver's reason, at connect or at its first import, and nothing
 * crashes.  Exit 10: refused at connect; 11: at the alloc; else wrong. */
START_TEST(client_forked_after_attach_fails_clearly) {
  exporter_start();
  char why[256] = "";
  int ord = -1;
  ck_assert_msg(gmb__cuda_attach(FAKE_UUID0, &ord, why, sizeof why) == 0,
                "%s", why);
  ck_assert_int_eq(ord, 0);
  /* Forked before the fake's threads start: a child forked while other
   * threads run may inherit their locks held (the sanitizers' allocator
   * deadlocks so).  It waits for the fake, then connects. */
  int go[2];
  ck_assert_int_eq(pipe2(go, O_CLOEXEC), 0);
  fflush(NULL);
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0) {
    char b;
    close(go[1]);
    if (read(go[0], &b, 1) != 1) _exit(30); /* the test failed first */
    gmb_client *c = NULL;
    int rc = gmb_connect(F.endpoint, "team-a", &c);
    if (rc) {
      int ok = rc == GMB_E_DEVICE;
      if (!ok) fprintf(stderr, "child: connect: %s\n", gmb_last_error(NULL));
      _exit(ok ? 10 : 20);
    }
    gmb_id id;
    rc = gmb_alloc(c, 512, 0, &id);
    int ok = rc == GMB_E_DEVICE &&
             strstr(gmb_last_error(NULL), "CUDA_ERROR_NOT_INITIALIZED");
    if (!ok) fprintf(stderr, "child: alloc: %d %s\n", rc, gmb_last_error(NULL));
    gmb_disconnect(c);
    _exit(ok ? 11 : 21);
  }
  close(go[0]);
  fk_start();
  ck_assert_int_eq(write(go[1], "g", 1), 1);
  close(go[1]);
  int st;
  ck_assert_int_eq(waitpid(pid, &st, 0), pid);
  ck_assert_msg(WIFEXITED(st) &&
                    (WEXITSTATUS(st) == 10 || WEXITSTATUS(st) == 11),
                "child: 0x%x", st);
  if (WEXITSTATUS(st) == 11)
    ck_assert_int_eq(ld(&F.n_free), 1); /* the alloc given back */
  ck_assert_int_eq(ld(&F.n_bye), 1);
  /* This process still imports. */
  uint64_t a = 0;
  ck_assert_msg(gmb__cuda_import(0, F.fd[0], SEG_SIZE, &a, why, sizeof why) == 0,
                "%s", why);
  gmb__cuda_close(0, a, SEG_SIZE);
  exporter_finish();
}
END_TEST

static Suite *client_cuda_suite(void) {
  Suite *s = suite_create("client_cuda");
  TCase *tc = tcase_create("no_driver");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_add_test(tc, no_driver_connect_fails_naming_library);
  tcase_add_test(tc, no_device_connect_fails_with_driver_reason);
  suite_add_tcase(s, tc);

  tc = tcase_create("cuimport");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_add_test(tc, cuda_import_maps_descriptor);
  tcase_add_test(tc, cuda_import_refuses_what_is_no_segment);
  suite_add_tcase(s, tc);

  tc = tcase_create("imports");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_add_test(tc, lock_returns_pointer_into_import);
  tcase_add_test(tc, import_cached_across_locks);
  tcase_add_test(tc, retired_segment_closed_then_reported);
  tcase_add_test(tc, retired_between_calls_closed_by_client_thread);
  tcase_add_test(tc, disconnect_closes_imports_before_bye);
  tcase_add_test(tc, two_clients_map_separately);
  tcase_add_test(tc, movable_lock_follows_move_to_unmapped_segment);
  tcase_add_test(tc, no_context_made_current_behind_the_program);
  suite_add_tcase(s, tc);

  tc = tcase_create("lies");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_add_test(tc, segment_descriptor_not_device_memory);
  tcase_add_test(tc, segment_descriptor_with_wrong_size);
  tcase_add_test(tc, movable_lock_into_unimportable_segment);
  suite_add_tcase(s, tc);

  tc = tcase_create("stream");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_add_test(tc, unlock_on_stream_releases_when_stream_runs);
  tcase_add_test(tc, free_waits_for_queued_work);
  tcase_add_test(tc, free_waits_for_work_in_program_context);
  tcase_add_test(tc, free_async_ordered_by_event);
  tcase_add_test(tc, cache_miss_during_capture_keeps_the_capture);
  tcase_add_test(tc, trim_asked_during_capture_deferred);
  tcase_add_test(tc, trim_during_capture_deferred);
  tcase_add_test(tc, peer_access_only_when_asked);
  tcase_add_test(tc, free_not_sent_when_wait_fails);
  tcase_add_test(tc, unlock_on_stream_refused_during_capture);
  tcase_add_test(tc, move_claim_waits_for_queued_work);
  tcase_add_test(tc, unlock_on_stream_outlives_disconnect);
  tcase_add_test(tc, write_landed_when_it_returns);
  tcase_add_test(tc, free_async_on_stream_of_program_context);
  suite_add_tcase(s, tc);

  tc = tcase_create("processes");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_add_test(tc, client_in_exec_child_shares_segment);
  tcase_add_test(tc, client_forked_after_attach_fails_clearly);
  suite_add_tcase(s, tc);
  return s;
}

/* Names in /dev/shm that look like gmb's or the fake driver's. */
#define SHM_MAX 256
static int shm_names(char names[][NAME_MAX + 1], int cap) {
  DIR *d = opendir("/dev/shm");
  if (d == NULL) return 0;
  int n = 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL && n < cap)
    if (strstr(e->d_name, "gmb") || strstr(e->d_name, "cuda"))
      snprintf(names[n++], NAME_MAX + 1, "%s", e->d_name);
  closedir(d);
  return n;
}

int main(int argc, char **argv) {
  ssize_t n = readlink("/proc/self/exe", self_exe, sizeof self_exe - 1);
  if (n <= 0) return 2;
  self_exe[n] = '\0';
  if (argc == 3 && strcmp(argv[1], "--exporter") == 0)
    return exporter_main(atoi(argv[2]));
  if (argc == 4 && strcmp(argv[1], "--client") == 0)
    return client_child_main(argv[2], strtoull(argv[3], NULL, 10));
  static char shm_before[SHM_MAX][NAME_MAX + 1], shm_after[SHM_MAX][NAME_MAX + 1];
  int n_before = shm_names(shm_before, SHM_MAX);
  snprintf(fake_dir, sizeof fake_dir, "/tmp/gmb-check-ccuda-dev-XXXXXX");
  if (!mkdtemp(fake_dir)) return 2;
  setenv("FAKECUDA_DIR", fake_dir, 1); /* a fake device of the suite's own */
  SRunner *sr = srunner_create(client_cuda_suite());
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  char acct[96];
  snprintf(acct, sizeof acct, "%s/device0", fake_dir);
  unlink(acct);
  rmdir(fake_dir);
  /* Nothing of ours may be left in /dev/shm (memfds only). */
  int n_after = shm_names(shm_after, SHM_MAX);
  for (int i = 0; i < n_after; i++) {
    int old = 0;
    for (int j = 0; j < n_before && !old; j++)
      old = strcmp(shm_after[i], shm_before[j]) == 0;
    if (!old) {
      fprintf(stderr, "check_client_cuda: left in /dev/shm: %s\n",
              shm_after[i]);
      failed++;
    }
  }
  return failed ? 1 : 0;
}
