/*
 * check_client_cuda.c - the client library on the cuda device, against a
 * fake broker and the fake driver (tests/fakecuda, through $GMB_LIBCUDA).
 *
 * The fake broker is a ROUTER thread driven with the wire codec, as in
 * check_client.c, answering for a broker whose device is "cuda".  Its
 * segments are real fake-driver allocations made by an "exporter" child
 * process (the fake driver, like the real one, will not import a process's
 * own allocation): the child cuMemAllocs them, writes a pattern, sends
 * their IPC handles over a pipe and waits; when told, it frees them, and
 * the fake driver logs to $FAKECUDA_LOG any segment freed while this
 * process still had it open.  The fake's device pointers are host
 * addresses, and its shm objects carry a header listing the pids that have
 * them open, which the test maps to count this process's imports.
 *
 * Tests that must run before the driver is first loaded (a load that
 * works is kept for the life of the process, and under SAN=1 the suite
 * runs in one process) come first.
 */
#include <check.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "cuimport.h"
#include "cudrv.h"
#include "fake_router.h"
#include "gmb.h"
#include "locktab_layout.h"
#include "wire.h"

#define SEG_SIZE (4u << 20)
#define NSEG 2
#define LT_SLOTS 64

/* The fake driver's header page (tests/fakecuda/fakecuda.c). */
#define FAKE_HDR 4096u
struct fake_hdr {
  uint64_t magic, size;
  int32_t owner;
  int32_t openers[64];
};

struct fk;
/* 1 when it answered (or chose silence), 0 for the default answer. */
typedef int (*fk_handler)(struct fk *f, const struct wire_request *req);

struct fk {
  char dir[64], endpoint[128], log[128];
  void *ctx, *router;
  pthread_t thread;
  atomic_int stop;
  fk_handler handler;
  uint8_t peer[256];
  size_t peer_len;

  /* the exporter child and its segments (ids 1..NSEG) */
  pid_t child;
  int to_child;
  gmb_cu_ipc_handle handle[NSEG];
  uint8_t *view[NSEG]; /* the test's own mapping of each, header first */
  int handle_sent;
  uint64_t next_offset, next_id;

  char lt_name[64];
  struct gmb__lt_header *lt;

  atomic_int n_alloc, n_segment, n_bye, n_closed;
  _Atomic uint64_t last_closed;
  atomic_int openers_at_bye; /* this process's imports of segment 1 */
  atomic_int retire_on_stats; /* segment to retire before a Stats reply */
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

static void exporter_main(int out, int in) {
  struct gmb_cudrv d;
  char err[256];
  if (gmb__cudrv_load(&d, err, sizeof err) != 0) _exit(2);
  gmb_cu_ctx ctx;
  gmb_cu_device dev;
  if (d.cuDeviceGet(&dev, 0) || d.cuDevicePrimaryCtxRetain(&ctx, dev) ||
      d.cuCtxSetCurrent(ctx))
    _exit(3);
  gmb_cu_ptr p[NSEG];
  for (size_t s = 0; s < NSEG; s++) {
    gmb_cu_ipc_handle h;
    if (d.cuMemAlloc(&p[s], SEG_SIZE) || d.cuIpcGetMemHandle(&h, p[s]))
      _exit(4);
    uint8_t *b = (uint8_t *)(uintptr_t)p[s];
    for (size_t i = 0; i < SEG_SIZE; i++) b[i] = pattern(s, i);
    if (write(out, &h, sizeof h) != (ssize_t)sizeof h) _exit(5);
  }
  char c;
  while (read(in, &c, 1) > 0) {
  }
  for (size_t s = 0; s < NSEG; s++) d.cuMemFree(p[s]);
  _exit(0);
}

static void exporter_start(void) {
  int a[2], b[2];
  ck_assert_int_eq(pipe(a), 0);
  ck_assert_int_eq(pipe(b), 0);
  fflush(NULL);
  F.child = fork();
  ck_assert_int_ge(F.child, 0);
  if (F.child == 0) {
    close(a[0]);
    close(b[1]);
    exporter_main(a[1], b[0]);
  }
  close(a[1]);
  close(b[0]);
  F.to_child = b[1];
  for (size_t s = 0; s < NSEG; s++) {
    ck_assert_int_eq(read(a[0], &F.handle[s], sizeof F.handle[s]),
                     (ssize_t)sizeof F.handle[s]);
    char name[49];
    memcpy(name, F.handle[s].reserved, 48);
    name[48] = '\0';
    int fd = shm_open(name, O_RDWR, 0);
    ck_assert_int_ge(fd, 0);
    F.view[s] = mmap(NULL, FAKE_HDR + SEG_SIZE, PROT_READ | PROT_WRITE,
                     MAP_SHARED, fd, 0);
    ck_assert_ptr_ne(F.view[s], MAP_FAILED);
    close(fd);
  }
  close(a[0]);
}

/* Lets the child free its segments and checks that none was still open
 * here (the fake driver logs it otherwise). */
static void exporter_finish(void) {
  if (F.child <= 0) return;
  close(F.to_child);
  int st;
  ck_assert_int_eq(waitpid(F.child, &st, 0), F.child);
  F.child = 0;
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "exporter: 0x%x", st);
  ck_assert_msg(access(F.log, F_OK) != 0, "the fake driver logged a free of "
                "a segment still open here (%s)", F.log);
}

/* How many times this process has segment `seg` (1-based) open. */
static int openers(int seg) {
  if (F.view[seg - 1] == NULL) return 0; /* no exporter in this test */
  const struct fake_hdr *h = (const struct fake_hdr *)F.view[seg - 1];
  int n = 0;
  for (int i = 0; i < 64; i++)
    if (__atomic_load_n(&h->openers[i], __ATOMIC_SEQ_CST) == (int32_t)getpid())
      n++;
  return n;
}

/* --- the fake broker -------------------------------------------------------- */

static void fk_reply(struct fk *f, const struct wire_reply *rep) {
  fake_router_reply(f->router, f->peer, f->peer_len, rep);
}

static void fk_handle(struct fk *f, uint64_t seg, struct wire_handle *h) {
  h->segment = seg;
  h->size = SEG_SIZE;
  h->len = sizeof(gmb_cu_ipc_handle);
  memcpy(h->bytes, &f->handle[seg - 1], h->len);
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
      snprintf(rep.u.hello.lock_table, sizeof rep.u.hello.lock_table, "%s",
               f->lt_name);
      rep.u.hello.lock_slots = f->lt_name[0] ? LT_SLOTS : 0;
      break;
    case WIRE_ALLOC: {
      uint64_t size = (req->u.alloc.size + 511) & ~(uint64_t)511;
      if (f->next_offset + size > SEG_SIZE || f->next_id >= LT_SLOTS) {
        rep.status = GMB_E_NOMEM;
        break;
      }
      rep.kind = WIRE_ALLOC;
      rep.u.alloc.id = ++f->next_id;
      rep.u.alloc.size = size;
      rep.u.alloc.segment = 1;
      rep.u.alloc.offset = f->next_offset;
      f->next_offset += size;
      if (!f->handle_sent) {
        fk_handle(f, 1, &rep.u.alloc.handle);
        f->handle_sent = 1;
      }
      if ((req->u.alloc.flags & GMB_MOVABLE) && f->lt) {
        struct gmb__lt_slot *sl = &gmb__lt_slots(f->lt)[rep.u.alloc.id - 1];
        sl->id = rep.u.alloc.id;
        sl->segment = 1;
        sl->offset = rep.u.alloc.offset;
        atomic_store_explicit(&sl->state, 0, memory_order_release);
        rep.u.alloc.slot = (uint32_t)(rep.u.alloc.id - 1);
      }
      break;
    }
    case WIRE_SEGMENT:
      if (req->u.segment.segment < 1 || req->u.segment.segment > NSEG) {
        rep.status = GMB_E_NOENT;
        break;
      }
      rep.kind = WIRE_SEGMENT;
      fk_handle(f, req->u.segment.segment, &rep.u.segment);
      break;
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

static void *fk_main(void *arg) {
  struct fk *f = arg;
  while (!atomic_load(&f->stop)) {
    struct wire_request req;
    if (!fake_router_recv(f->router, f->peer, sizeof f->peer, &f->peer_len,
                          &req))
      continue;
    switch (req.kind) {
      case WIRE_ALLOC: atomic_fetch_add(&f->n_alloc, 1); break;
      case WIRE_SEGMENT: atomic_fetch_add(&f->n_segment, 1); break;
      case WIRE_BYE: atomic_fetch_add(&f->n_bye, 1); break;
      case WIRE_SEGMENT_CLOSED:
        atomic_store(&f->last_closed, req.u.segment.segment);
        atomic_fetch_add(&f->n_closed, 1);
        break;
      default: break;
    }
    if (f->handler && f->handler(f, &req)) continue;
    fk_default(f, &req);
  }
  return NULL;
}

static void fk_start(void) {
  F.router = fake_router_open(&F.ctx, F.endpoint);
  ck_assert_int_eq(pthread_create(&F.thread, NULL, fk_main, &F), 0);
}

/* The session's lock table, named in the Hello reply. */
static void lt_setup(void) {
  snprintf(F.lt_name, sizeof F.lt_name, "/gmb-check-ccuda-lt-%d",
           (int)getpid());
  shm_unlink(F.lt_name);
  int fd = shm_open(F.lt_name, O_RDWR | O_CREAT | O_EXCL, 0600);
  ck_assert_int_ge(fd, 0);
  ck_assert_int_eq(ftruncate(fd, (off_t)gmb__lt_bytes(LT_SLOTS)), 0);
  F.lt = mmap(NULL, gmb__lt_bytes(LT_SLOTS), PROT_READ | PROT_WRITE,
              MAP_SHARED, fd, 0);
  ck_assert_ptr_ne(F.lt, MAP_FAILED);
  close(fd);
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
  FILE *m = fopen("/proc/self/maps", "r");
  ck_assert_ptr_nonnull(m);
  char line[512];
  int n = 0;
  while (fgets(line, sizeof line, m))
    if (strstr(line, F.lt_name + 1)) n++;
  fclose(m);
  return n;
}

static void setup(void) {
  memset(&F, 0, sizeof F);
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
}

static void teardown(void) {
  if (F.ctx) {
    atomic_store(&F.stop, 1);
    pthread_join(F.thread, NULL);
    zmq_close(F.router);
    zmq_ctx_term(F.ctx);
  }
  if (F.child > 0) { /* a failed test: let the child go */
    close(F.to_child);
    waitpid(F.child, NULL, 0);
  }
  for (size_t s = 0; s < NSEG; s++)
    if (F.view[s]) munmap(F.view[s], FAKE_HDR + SEG_SIZE);
  if (F.lt) munmap(F.lt, gmb__lt_bytes(LT_SLOTS));
  if (F.lt_name[0]) shm_unlink(F.lt_name);
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
  ck_assert_int_eq(atomic_load(&F.n_bye), 1); /* the session was ended */
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

/* --- imports ---------------------------------------------------------------- */

START_TEST(lock_returns_pointer_into_import) {
  exporter_start();
  fk_start();
  gmb_client *c = connect_ok();
  gmb_id a, b;
  ck_assert_int_eq(gmb_alloc(c, 4096, 0, &a), 0);
  ck_assert_int_eq(gmb_alloc(c, 1000, 0, &b), 0);
  uint8_t *pa, *pb;
  ck_assert_int_eq(gmb_lock(c, a, (void **)&pa), 0);
  ck_assert_int_eq(gmb_lock(c, b, (void **)&pb), 0);
  ck_assert_ptr_eq(pb, pa + 4096); /* base + offset of one import */
  /* What the exporter wrote is there, and what we write reaches it. */
  uint8_t want[4096];
  for (size_t i = 0; i < sizeof want; i++) want[i] = pattern(0, i);
  ck_assert_int_eq(memcmp(pa, want, sizeof want), 0);
  memset(pb, 0xab, 1000);
  ck_assert_uint_eq(F.view[0][FAKE_HDR + 4096], 0xab);
  ck_assert_uint_eq(F.view[0][FAKE_HDR + 4096 + 999], 0xab);
  ck_assert_uint_eq(F.view[0][FAKE_HDR + 4096 + 1024], pattern(0, 5120));
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
  gmb_id id[8];
  for (int i = 0; i < 8; i++) ck_assert_int_eq(gmb_alloc(c, 512, 0, &id[i]), 0);
  void *first = NULL;
  for (int n = 0; n < 1000; n++) {
    void *p;
    ck_assert_int_eq(gmb_lock(c, id[n % 8], &p), 0);
    if (n == 0) first = p;
    if (n % 8 == 0) ck_assert_ptr_eq(p, first);
    ck_assert_int_eq(gmb_unlock(c, id[n % 8]), 0);
  }
  ck_assert_int_eq(openers(1), 1);
  ck_assert_int_eq(atomic_load(&F.n_segment), 0);
  gmb_disconnect(c);
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
  /* The event comes before the Stats reply, so it was handled by the
   * time gmb_tenant_stats returns. */
  atomic_store(&F.retire_on_stats, 1);
  gmb_stats st;
  ck_assert_int_eq(gmb_tenant_stats(c, &st), 0);
  ck_assert_int_eq(openers(1), 0);
  wait_for(&F.n_closed, 1);
  ck_assert_uint_eq(atomic_load(&F.last_closed), 1);
  /* A segment given to the session but never imported here is reported
   * too: the broker counts sessions, not imports. */
  atomic_store(&F.retire_on_stats, 2);
  ck_assert_int_eq(gmb_tenant_stats(c, &st), 0);
  wait_for(&F.n_closed, 2);
  ck_assert_uint_eq(atomic_load(&F.last_closed), 2);
  /* The exporter may free segment 1 now: nothing here has it open. */
  gmb_disconnect(c);
  ck_assert_int_eq(atomic_load(&F.n_closed), 2);
  exporter_finish();
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
  ck_assert_int_eq(atomic_load(&F.n_bye), 1);
  int at_bye = atomic_load(&F.openers_at_bye);
  ck_assert_int_eq(at_bye, 0);
  ck_assert_int_eq(openers(1), 0);
  exporter_finish();
}
END_TEST

START_TEST(two_clients_share_one_import) {
  exporter_start();
  fk_start();
  gmb_client *c1 = connect_ok();
  gmb_client *c2 = connect_ok();
  gmb_id a, b;
  ck_assert_int_eq(gmb_alloc(c1, 512, 0, &a), 0);
  F.handle_sent = 0; /* the broker gives c2 the same segment's handle */
  ck_assert_int_eq(gmb_alloc(c2, 512, 0, &b), 0);
  void *pa, *pb;
  ck_assert_int_eq(gmb_lock(c1, a, &pa), 0);
  ck_assert_int_eq(gmb_lock(c2, b, &pb), 0);
  ck_assert_ptr_eq((uint8_t *)pb, (uint8_t *)pa + 512);
  ck_assert_int_eq(openers(1), 1);
  gmb_disconnect(c1);
  ck_assert_int_eq(openers(1), 1); /* c2 still uses it */
  ck_assert_int_eq(memcmp(pb, F.view[0] + FAKE_HDR + 512, 512), 0);
  gmb_disconnect(c2);
  ck_assert_int_eq(openers(1), 0);
  exporter_finish();
}
END_TEST

/* Stands for a context the application made current itself. */
static char app_ctx_obj;

START_TEST(primary_context_made_current_only_when_none) {
  exporter_start();
  fk_start();
  struct gmb_cudrv d;
  char err[256];
  ck_assert_msg(gmb__cudrv_load(&d, err, sizeof err) == 0, "%s", err);
  gmb_cu_ctx primary, cur = (gmb_cu_ctx)&app_ctx_obj;
  ck_assert_int_eq(d.cuDevicePrimaryCtxRetain(&primary, 0), 0);
  ck_assert_int_eq(d.cuCtxSetCurrent(NULL), 0);
  gmb_client *c = connect_ok();
  ck_assert_int_eq(d.cuCtxGetCurrent(&cur), 0);
  ck_assert_ptr_eq(cur, primary);
  /* A thread with its own context keeps it across an import. */
  ck_assert_int_eq(d.cuCtxSetCurrent((gmb_cu_ctx)&app_ctx_obj), 0);
  gmb_id id;
  void *p;
  ck_assert_int_eq(gmb_alloc(c, 512, 0, &id), 0);
  ck_assert_int_eq(gmb_lock(c, id, &p), 0);
  ck_assert_int_eq(d.cuCtxGetCurrent(&cur), 0);
  ck_assert_ptr_eq(cur, (gmb_cu_ctx)&app_ctx_obj);
  ck_assert_int_eq(openers(1), 1);
  gmb_disconnect(c);
  ck_assert_int_eq(d.cuCtxGetCurrent(&cur), 0);
  ck_assert_ptr_eq(cur, (gmb_cu_ctx)&app_ctx_obj);
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

static struct gmb_cudrv test_drv;

/* The test's own handle on the same (already loaded) fake driver. */
static void block_stream(void) {
  char err[256];
  ck_assert_msg(gmb__cudrv_load(&test_drv, err, sizeof err) == 0, "%s", err);
  atomic_store(&gate, 0);
  ck_assert_int_eq(test_drv.cuLaunchHostFunc(NULL, gate_fn, NULL), 0);
}

static void unblock_stream_and_sync(void) {
  atomic_store(&gate, 1);
  ck_assert_int_eq(test_drv.cuStreamSynchronize(NULL), 0);
  gmb__cudrv_unload(&test_drv);
}

START_TEST(unlock_on_stream_releases_when_stream_runs) {
  exporter_start();
  lt_setup();
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
  lt_setup();
  fk_start();
  gmb_client *c = connect_ok();
  gmb_id id;
  void *p;
  ck_assert_int_eq(gmb_alloc(c, 4096, GMB_MOVABLE, &id), 0);
  ck_assert_int_eq(gmb_lock(c, id, &p), 0);
  /* Closing an import waits for the fake's stream queue, so retire the
   * segment first: the disconnect below then has nothing to close and
   * returns while the release is still queued. */
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
  F.handle_sent = 0;
  c = connect_ok();
  ck_assert_int_eq(lt_mappings(), 2); /* the test's and the new client's */
  gmb_disconnect(c);
  ck_assert_int_eq(lt_mappings(), 1);
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

  tc = tcase_create("imports");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_add_test(tc, lock_returns_pointer_into_import);
  tcase_add_test(tc, import_cached_across_locks);
  tcase_add_test(tc, retired_segment_closed_then_reported);
  tcase_add_test(tc, disconnect_closes_imports_before_bye);
  tcase_add_test(tc, two_clients_share_one_import);
  tcase_add_test(tc, primary_context_made_current_only_when_none);
  suite_add_tcase(s, tc);

  tc = tcase_create("stream");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_add_test(tc, unlock_on_stream_releases_when_stream_runs);
  tcase_add_test(tc, unlock_on_stream_outlives_disconnect);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) {
  SRunner *sr = srunner_create(client_cuda_suite());
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? 1 : 0;
}
