/*
 * check_client.c - the client library against a fake broker.
 *
 * The fake is a ROUTER socket and a descriptor channel (fd.sock, a
 * SOCK_SEQPACKET listener: proto/fdpass.h) in one thread of the test,
 * bound in a fresh temporary directory and driven by hand with the wire
 * codec and fake_router.h: by default it answers like a well-behaved broker
 * on the host device (one segment, a sealed memfd the test creates, handed
 * out bump by bump; its descriptor given on the channel), and each test
 * replaces the answer to the requests it cares about, on either socket,
 * with garbage, silence, events or lies.  What needs a real broker is in
 * tests/integration.
 *
 * Every session has a lock table: the fake's Hello reply gives a secret
 * and the slot count, and its channel answers AUTH with a sealed memfd
 * that setup() creates for session 1.  It hands out slot id-1 for each
 * movable allocation; the test then claims, moves and publishes by hand
 * (the "mover"), as compaction does.
 *
 * The fake is in this process, so the descriptors the client receives are
 * in the same table as the fake's: check_count_fds() shows whether the library
 * closes what it was sent.  Nothing is created in /dev/shm.
 *
 * Knobs: ITER (allocations per thread in threads_share_client, default 200;
 * lock/unlock pairs per thread in movable_threads_lock_while_moving).
 */
#include <check.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "check_main.h"
#include "fake_router.h"
#include "fdpass.h"
#include "gmb.h"
#include "locktab_layout.h"
#include "wire.h"

#define FAKE_SEG_SIZE (4u << 20)
#define FAKE_MAX_IDS 8192
#define FAKE_LT_SLOTS 64
#define FAKE_SEALS (F_SEAL_SHRINK | F_SEAL_GROW)
/* A request for a cache's pages (Alloc.pages) gets a segment of its own
 * for each page, as the broker gives them: segment ids from FAKE_PAGE_SEG,
 * a sealed memfd each. */
#define FAKE_PAGE (2u << 20)
#define FAKE_PAGE_SEG 1000u
#define FAKE_PAGES 64

struct fake;
/* Returns 1 when it answered (or chose silence), 0 for the default. */
typedef int (*fake_handler)(struct fake *f, const struct wire_request *req);
/* The same for a request on the descriptor channel's connection `conn`. */
typedef int (*fake_fd_handler)(struct fake *f, int conn,
                               const struct gmb_fd_req *req);

struct fake {
  char dir[64];
  char endpoint[128];
  void *ctx;
  void *_Atomic router; /* NULL once the fake closed it */
  struct fake_fdchan ch;
  int no_channel; /* set before fake_start: no fd.sock at all */
  pthread_t thread;
  atomic_int stop;
  atomic_int close_now; /* the thread closes its sockets and exits */
  fake_handler handler;
  fake_fd_handler fd_handler;
  uint8_t peer[256];
  size_t peer_len;

  /* the default answers */
  char device[WIRE_DEVICE_MAX];
  int no_uuid; /* a cuda Hello reply without the GPU's UUID */
  uint32_t heartbeat_ms;
  uint64_t session;    /* in the Hello reply (1) */
  uint8_t secret[GMB_FD_SECRET_LEN];
  uint32_t secret_len; /* in the Hello reply: GMB_FD_SECRET_LEN */
  uint8_t hello_secret_xor; /* the Hello reply's secret[0] differs by it */
  int seg1_fd;         /* segment 1, a sealed memfd */
  uint8_t *seg1;       /* the test's own mapping of it */
  uint64_t next_offset, next_id;
  uint64_t offsets[FAKE_MAX_IDS];

  /* the lock table (setup): a sealed memfd of FAKE_LT_SLOTS slots, for
   * session 1; lt_slots is what the Hello reply says (and what the alloc
   * default believes), lt_size what the AUTH reply says (0: the size of
   * lt_slots slots) */
  int lt_fd;
  uint32_t lt_slots;
  uint64_t lt_size;
  struct gmb__lt_header *lt;
  /* segment 2 (seg2_setup): a second memfd, given only when asked for */
  int seg2_fd;
  uint8_t *seg2;
  /* the cache's pages: page_fd[i] is segment FAKE_PAGE_SEG + i */
  int page_fd[FAKE_PAGES];
  unsigned n_pages;

  /* what it saw */
  atomic_int n_total; /* every message on the ZeroMQ socket */
  atomic_int n_hello, n_alloc, n_free, n_stats, n_heartbeat, n_bye;
  atomic_int n_auth, n_segment; /* requests on the descriptor channel */
  struct wire_request last_hello, last_alloc, last_free;
  struct gmb_fd_req last_auth, last_segment;
  struct ucred auth_cred; /* SO_PEERCRED of the connection that sent AUTH */
  atomic_int step; /* for handlers with a script */
};

static struct fake F;

static void fake_send(struct fake *f, const void *buf, size_t len) {
  fake_router_send(f->router, f->peer, f->peer_len, buf, len);
}

static void fake_reply(struct fake *f, const struct wire_reply *rep) {
  fake_router_reply(f->router, f->peer, f->peer_len, rep);
}

static void fake_status(struct fake *f, uint64_t id, int status,
                        const char *msg) {
  struct wire_reply rep = {.id = id, .status = status};
  snprintf(rep.message, sizeof rep.message, "%s", msg ? msg : "");
  fake_reply(f, &rep);
}

static void fake_event(struct fake *f, enum wire_event kind, uint64_t segment,
                       const char *msg) {
  struct wire_reply rep = {.id = 0, .kind = WIRE_EVENT};
  rep.u.event.kind = kind;
  rep.u.event.segment = segment;
  snprintf(rep.message, sizeof rep.message, "%s", msg ? msg : "");
  fake_reply(f, &rep);
}

static struct gmb__lt_slot *lt_slot_of(struct fake *f, uint64_t id) {
  return &gmb__lt_slots(f->lt)[id - 1];
}

static void fake_default(struct fake *f, const struct wire_request *req) {
  struct wire_reply rep = {.id = req->id};
  switch (req->kind) {
    case WIRE_HELLO:
      rep.kind = WIRE_HELLO;
      rep.u.hello.version = WIRE_PROTOCOL_VERSION;
      rep.u.hello.session = f->session;
      snprintf(rep.u.hello.tenant, sizeof rep.u.hello.tenant, "%s",
               req->u.hello.tenant[0] ? req->u.hello.tenant : "uid-1000");
      snprintf(rep.u.hello.device, sizeof rep.u.hello.device, "%s",
               f->device);
      if (strcmp(f->device, "cuda") == 0 && !f->no_uuid)
        snprintf(rep.u.hello.device_uuid, sizeof rep.u.hello.device_uuid,
                 "GPU-46414b45-4355-4441-0000-000000000000");
      rep.u.hello.heartbeat_ms = f->heartbeat_ms;
      rep.u.hello.lock_slots = f->lt_slots;
      rep.u.hello.fd_secret_len = f->secret_len;
      memcpy(rep.u.hello.fd_secret, f->secret, f->secret_len);
      rep.u.hello.fd_secret[0] ^= f->hello_secret_xor;
      fake_reply(f, &rep);
      break;
    case WIRE_ALLOC: {
      uint64_t size = (req->u.alloc.size + 511) & ~(uint64_t)511;
      if (req->u.alloc.pages) {
        const uint32_t n = req->u.alloc.pages;
        if (f->n_pages + n > FAKE_PAGES || f->next_id + n >= FAKE_MAX_IDS) {
          fake_status(f, req->id, GMB_E_NOMEM, "fake is full");
          break;
        }
        rep.kind = WIRE_ALLOC;
        rep.u.alloc.size = size;
        rep.u.alloc.n_pages = n;
        for (uint32_t i = 0; i < n; i++) {
          f->page_fd[f->n_pages] =
              fake_memfd("gmb-check-client-page", FAKE_PAGE, FAKE_SEALS);
          rep.u.alloc.page_id[i] = ++f->next_id;
          rep.u.alloc.page_seg[i] = FAKE_PAGE_SEG + f->n_pages++;
        }
        rep.u.alloc.id = rep.u.alloc.page_id[0];
        rep.u.alloc.segment = rep.u.alloc.page_seg[0];
        fake_reply(f, &rep);
        break;
      }
      if (f->next_offset + size > FAKE_SEG_SIZE || f->next_id >= FAKE_MAX_IDS) {
        fake_status(f, req->id, GMB_E_NOMEM, "fake is full");
        break;
      }
      rep.kind = WIRE_ALLOC;
      rep.u.alloc.id = ++f->next_id;
      rep.u.alloc.size = size;
      rep.u.alloc.segment = 1;
      rep.u.alloc.offset = f->next_offset;
      f->offsets[rep.u.alloc.id] = f->next_offset;
      f->next_offset += size;
      if ((req->u.alloc.flags & GMB_MOVABLE) && rep.u.alloc.id <= f->lt_slots) {
        struct gmb__lt_slot *sl = lt_slot_of(f, rep.u.alloc.id);
        sl->id = rep.u.alloc.id;
        sl->segment = 1;
        sl->offset = rep.u.alloc.offset;
        atomic_store_explicit(&sl->state, 0, memory_order_release);
        rep.u.alloc.slot = (uint32_t)(rep.u.alloc.id - 1);
      }
      fake_reply(f, &rep);
      break;
    }
    case WIRE_STATS:
      rep.kind = WIRE_STATS;
      rep.u.stats.quota = 1u << 30;
      rep.u.stats.used = f->next_offset;
      rep.u.stats.peak = f->next_offset;
      rep.u.stats.segments = FAKE_SEG_SIZE;
      fake_reply(f, &rep);
      break;
    case WIRE_FREE:
    case WIRE_BYE:
      fake_reply(f, &rep);
      break;
    default:
      break; /* heartbeats get no reply */
  }
}

/* The channel as the broker keeps it: AUTH with this session's secret
 * gets the lock table; SEGMENT gets segment 1 (or 2 when set up) on an
 * authenticated connection, else a refusal and no descriptor. */
static void fake_fd_default(struct fake *f, int conn,
                            const struct gmb_fd_req *req) {
  int *authed = fake_fdchan_tag(&f->ch, conn);
  if (authed == NULL) return;
  if (req->magic != GMB_FD_MAGIC) {
    fake_fdchan_drop(&f->ch, conn);
    return;
  }
  switch (req->op) {
    case GMB_FD_AUTH:
      if (req->session != f->session ||
          memcmp(req->secret, f->secret, GMB_FD_SECRET_LEN) != 0) {
        fake_fdchan_reply(conn, GMB_FD_AUTH, GMB_E_AUTH, 0, 0, -1,
                          "no session with that secret");
        break;
      }
      *authed = 1;
      fake_fdchan_reply(conn, GMB_FD_AUTH, 0, 0,
                        f->lt_size ? f->lt_size : gmb__lt_bytes(f->lt_slots),
                        f->lt_fd, NULL);
      break;
    case GMB_FD_SEGMENT:
      if (!*authed) {
        fake_fdchan_reply(conn, GMB_FD_SEGMENT, GMB_E_AUTH, req->segment, 0,
                          -1, "not authenticated");
      } else if (req->segment == 1 || (req->segment == 2 && f->seg2)) {
        fake_fdchan_reply(conn, GMB_FD_SEGMENT, 0, req->segment,
                          FAKE_SEG_SIZE,
                          req->segment == 1 ? f->seg1_fd : f->seg2_fd, NULL);
      } else if (req->segment >= FAKE_PAGE_SEG &&
                 req->segment < FAKE_PAGE_SEG + f->n_pages) {
        fake_fdchan_reply(conn, GMB_FD_SEGMENT, 0, req->segment, FAKE_PAGE,
                          f->page_fd[req->segment - FAKE_PAGE_SEG], NULL);
      } else {
        char msg[64];
        snprintf(msg, sizeof msg, "segment %llu is not this tenant's",
                 (unsigned long long)req->segment);
        fake_fdchan_reply(conn, GMB_FD_SEGMENT, GMB_E_NOENT, req->segment, 0,
                          -1, msg);
      }
      break;
    default:
      fake_fdchan_reply(conn, req->op, GMB_E_PROTO, 0, 0, -1, "bad op");
      break;
  }
}

static void *fake_main(void *arg) {
  struct fake *f = arg;
  while (!atomic_load(&f->stop)) {
    if (atomic_load(&f->close_now)) {
      /* Linger, so that what was sent just before goes out first. */
      int linger = 2000;
      zmq_setsockopt(f->router, ZMQ_LINGER, &linger, sizeof linger);
      zmq_close(f->router);
      fake_fdchan_close(&f->ch);
      f->router = NULL;
      return NULL;
    }
    struct fake_msg m;
    enum fake_got got = fake_poll(f->router, &f->ch, f->peer, sizeof f->peer,
                                  &f->peer_len, &m);
    if (got == FAKE_GOT_FD) {
      if (m.fdreq.op == GMB_FD_AUTH) {
        f->last_auth = m.fdreq;
        const struct ucred *cr = fake_fdchan_cred(&f->ch, m.conn);
        if (cr) f->auth_cred = *cr;
        atomic_fetch_add(&f->n_auth, 1);
      } else if (m.fdreq.op == GMB_FD_SEGMENT) {
        f->last_segment = m.fdreq;
        atomic_fetch_add(&f->n_segment, 1);
      }
      if (f->fd_handler && f->fd_handler(f, m.conn, &m.fdreq)) continue;
      fake_fd_default(f, m.conn, &m.fdreq);
      continue;
    }
    if (got != FAKE_GOT_WIRE) continue;
    const struct wire_request *req = &m.req;
    atomic_fetch_add(&f->n_total, 1);
    switch (req->kind) {
      case WIRE_HELLO: f->last_hello = *req; atomic_fetch_add(&f->n_hello, 1); break;
      case WIRE_ALLOC: f->last_alloc = *req; atomic_fetch_add(&f->n_alloc, 1); break;
      case WIRE_FREE: f->last_free = *req; atomic_fetch_add(&f->n_free, 1); break;
      case WIRE_STATS: atomic_fetch_add(&f->n_stats, 1); break;
      case WIRE_HEARTBEAT: atomic_fetch_add(&f->n_heartbeat, 1); break;
      case WIRE_BYE: atomic_fetch_add(&f->n_bye, 1); break;
      default: break;
    }
    if (f->handler && f->handler(f, req)) continue;
    fake_default(f, req);
  }
  return NULL;
}

/* Waits (up to 2 s) for the process to hold `want` descriptors again: the
 * fake's side of a connection closes when its thread sees the hang-up,
 * and ZeroMQ's when its I/O thread does.  Returns the last count. */
static int fds_settle(int want) {
  int n = check_count_fds();
  for (int i = 0; i < 200 && n != want; i++) {
    usleep(10 * 1000);
    n = check_count_fds();
  }
  return n;
}

/* The lock table (FAKE_LT_SLOTS slots, for session 1), as the broker
 * makes it: a memfd sealed against shrinking and growing. */
static void lt_setup(void) {
  uint64_t bytes = gmb__lt_bytes(FAKE_LT_SLOTS);
  F.lt_fd = fake_memfd("gmb-check-client-lt", bytes, FAKE_SEALS);
  F.lt = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, F.lt_fd, 0);
  ck_assert_ptr_ne(F.lt, MAP_FAILED);
  F.lt_slots = FAKE_LT_SLOTS;
  F.lt->magic = GMB_LT_MAGIC;
  F.lt->version = GMB_LT_VERSION;
  F.lt->slots = FAKE_LT_SLOTS;
  F.lt->session = 1;
}

/* A second segment, given on the channel when asked for segment 2. */
static void seg2_setup(void) {
  F.seg2_fd = fake_memfd("gmb-check-client-seg2", FAKE_SEG_SIZE, FAKE_SEALS);
  F.seg2 = mmap(NULL, FAKE_SEG_SIZE, PROT_READ | PROT_WRITE, MAP_SHARED,
                F.seg2_fd, 0);
  ck_assert_ptr_ne(F.seg2, MAP_FAILED);
}

static void setup(void) {
  memset(&F, 0, sizeof F);
  fake_fdchan_init(&F.ch);
  F.lt_fd = F.seg1_fd = F.seg2_fd = -1;
  unsetenv("GMB_ENDPOINT");
  unsetenv("GMB_TENANT");
  unsetenv("GMB_TOKEN");
  unsetenv("GMB_TOKEN_FILE");
  unsetenv("GMB_REQUEST_TIMEOUT_MS");
  unsetenv("GMB_CONNECT_TIMEOUT_MS");
  unsetenv("GMB_LOCK_TIMEOUT_MS");
  snprintf(F.dir, sizeof F.dir, "/tmp/gmb-check-client-XXXXXX");
  ck_assert_ptr_nonnull(mkdtemp(F.dir));
  setenv("GMB_RUN_DIR", F.dir, 1);
  snprintf(F.endpoint, sizeof F.endpoint, "ipc://%s/broker.sock", F.dir);
  snprintf(F.device, sizeof F.device, "host");
  F.session = 1;
  F.secret_len = GMB_FD_SECRET_LEN;
  for (int i = 0; i < GMB_FD_SECRET_LEN; i++)
    F.secret[i] = (uint8_t)(0x5b ^ (i * 37) ^ getpid());
  F.seg1_fd = fake_memfd("gmb-check-client-seg1", FAKE_SEG_SIZE, FAKE_SEALS);
  F.seg1 = mmap(NULL, FAKE_SEG_SIZE, PROT_READ | PROT_WRITE, MAP_SHARED,
                F.seg1_fd, 0);
  ck_assert_ptr_ne(F.seg1, MAP_FAILED);
  lt_setup();
}

/* Starts the fake; a test sets F's fields and handlers first.  An
 * endpoint with a wildcard port (tcp://127.0.0.1:*) becomes the bound one. */
static void fake_start(void) {
  if (!F.no_channel) fake_fdchan_listen(&F.ch, F.dir);
  F.router = fake_router_open(&F.ctx, F.endpoint);
  size_t len = sizeof F.endpoint;
  ck_assert_int_eq(zmq_getsockopt(F.router, ZMQ_LAST_ENDPOINT, F.endpoint,
                                  &len), 0);
  ck_assert_int_eq(pthread_create(&F.thread, NULL, fake_main, &F), 0);
}

static void teardown(void) {
  if (F.ctx) {
    atomic_store(&F.stop, 1);
    pthread_join(F.thread, NULL);
    if (F.router) zmq_close(F.router);
    zmq_ctx_term(F.ctx);
  }
  fake_fdchan_close(&F.ch);
  munmap(F.seg1, FAKE_SEG_SIZE);
  close(F.seg1_fd);
  munmap(F.lt, gmb__lt_bytes(FAKE_LT_SLOTS));
  close(F.lt_fd);
  if (F.seg2) munmap(F.seg2, FAKE_SEG_SIZE);
  if (F.seg2_fd >= 0) close(F.seg2_fd);
  for (unsigned i = 0; i < F.n_pages; i++) close(F.page_fd[i]);
  char path[160];
  snprintf(path, sizeof path, "%s/broker.sock", F.dir);
  unlink(path);
  rmdir(F.dir);
}

static gmb_client *connect_ok(void) {
  gmb_client *c = NULL;
  int rc = gmb_connect(F.endpoint, "team-a", &c);
  ck_assert_msg(rc == 0, "connect: %s", gmb_last_error(NULL));
  ck_assert_ptr_nonnull(c);
  return c;
}

/* --- connecting ------------------------------------------------------------ */

START_TEST(connect_missing_socket) {
  gmb_client *c = (gmb_client *)&c;
  int rc = gmb_connect(NULL, NULL, &c); /* default endpoint in GMB_RUN_DIR */
  ck_assert_int_eq(rc, GMB_E_CONN);
  ck_assert_ptr_null(c);
  const char *e = gmb_last_error(NULL);
  ck_assert_ptr_nonnull(strstr(e, "GMB_E_CONN"));
  ck_assert_ptr_nonnull(strstr(e, F.endpoint));
  ck_assert_ptr_nonnull(strstr(e, "No such file or directory"));
  ck_assert_ptr_nonnull(strstr(e, "GMB_RUN_DIR="));
}
END_TEST

START_TEST(connect_stale_socket) {
  /* A socket file nobody listens on, as a killed broker leaves behind. */
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  snprintf(sa.sun_path, sizeof sa.sun_path, "%s/broker.sock", F.dir);
  int fd = socket(AF_UNIX, SOCK_STREAM, 0);
  ck_assert_int_ge(fd, 0);
  ck_assert_int_eq(bind(fd, (struct sockaddr *)&sa, sizeof sa), 0);
  close(fd); /* bound, never listening, now closed: the file stays */
  gmb_client *c = NULL;
  ck_assert_int_eq(gmb_connect(F.endpoint, NULL, &c), GMB_E_CONN);
  ck_assert_ptr_nonnull(strstr(gmb_last_error(NULL), "nothing listens"));
  ck_assert_ptr_nonnull(strstr(gmb_last_error(NULL), F.endpoint));
}
END_TEST

START_TEST(connect_null_out_invalid) {
  ck_assert_int_eq(gmb_connect(F.endpoint, NULL, NULL), GMB_E_INVAL);
}
END_TEST

START_TEST(connect_bad_tenant_invalid) {
  gmb_client *c = NULL;
  ck_assert_int_eq(gmb_connect(F.endpoint, "-bad name", &c), GMB_E_INVAL);
  ck_assert_ptr_null(c);
  ck_assert_ptr_nonnull(strstr(gmb_last_error(NULL), "tenant"));
}
END_TEST

static int refuse_hello(struct fake *f, const struct wire_request *req) {
  if (req->kind != WIRE_HELLO) return 0;
  fake_status(f, req->id, GMB_E_AUTH, "uid 1234 may not act as team-a");
  return 1;
}

START_TEST(hello_refused_auth) {
  F.handler = refuse_hello;
  fake_start();
  gmb_client *c = NULL;
  ck_assert_int_eq(gmb_connect(F.endpoint, "team-a", &c), GMB_E_AUTH);
  ck_assert_ptr_null(c);
  ck_assert_str_eq(gmb_last_error(NULL),
                   "GMB_E_AUTH: uid 1234 may not act as team-a");
}
END_TEST

static int hello_v2(struct fake *f, const struct wire_request *req) {
  if (req->kind != WIRE_HELLO) return 0;
  struct wire_reply rep = {.id = req->id, .kind = WIRE_HELLO};
  rep.u.hello.version = WIRE_PROTOCOL_VERSION + 1;
  snprintf(rep.u.hello.device, sizeof rep.u.hello.device, "host");
  fake_reply(f, &rep);
  return 1;
}

START_TEST(hello_other_version_proto) {
  F.handler = hello_v2;
  fake_start();
  gmb_client *c = NULL;
  ck_assert_int_eq(gmb_connect(F.endpoint, NULL, &c), GMB_E_PROTO);
  ck_assert_ptr_null(c);
}
END_TEST

START_TEST(hello_carries_env_tenant_token_file_pid) {
  char tok[128];
  snprintf(tok, sizeof tok, "%s/token", F.dir);
  FILE *fp = fopen(tok, "w");
  ck_assert_ptr_nonnull(fp);
  fputs("s3cret\n", fp);
  fclose(fp);
  setenv("GMB_TOKEN_FILE", tok, 1);
  setenv("GMB_TENANT", "from-env", 1);
  setenv("GMB_ENDPOINT", F.endpoint, 1);
  fake_start();
  gmb_client *c = NULL;
  ck_assert_int_eq(gmb_connect(NULL, NULL, &c), 0);
  struct wire_request *h = &F.last_hello;
  ck_assert_uint_eq(h->u.hello.version, WIRE_PROTOCOL_VERSION);
  ck_assert_str_eq(h->u.hello.tenant, "from-env");
  ck_assert_uint_eq(h->u.hello.token_len, 6);
  ck_assert_int_eq(memcmp(h->u.hello.token, "s3cret", 6), 0);
  ck_assert_int_eq(h->u.hello.pid, (int)getpid());
  ck_assert_str_eq(h->u.hello.client, "libgmb " GMB_VERSION_STRING);
  gmb_disconnect(c);
  ck_assert_int_eq(atomic_load(&F.n_bye), 1);
  unlink(tok);
}
END_TEST

START_TEST(hello_token_env_wins_over_file) {
  setenv("GMB_TOKEN", "tok-env", 1);
  setenv("GMB_TOKEN_FILE", "/nonexistent/file", 1);
  fake_start();
  gmb_client *c = connect_ok();
  ck_assert_uint_eq(F.last_hello.u.hello.token_len, 7);
  ck_assert_int_eq(memcmp(F.last_hello.u.hello.token, "tok-env", 7), 0);
  gmb_disconnect(c);
}
END_TEST

/* --- what the broker sends back ---------------------------------------------- */

static int garbage_stats(struct fake *f, const struct wire_request *req) {
  if (req->kind != WIRE_STATS || atomic_fetch_add(&f->step, 1) != 0) return 0;
  static const uint8_t junk[] = {0xff, 0xff, 0xff, 0xff, 0x0f, 0x12, 0x99};
  fake_send(f, junk, sizeof junk);
  return 1;
}

START_TEST(garbage_reply_proto_then_recovers) {
  F.handler = garbage_stats;
  fake_start();
  gmb_client *c = connect_ok();
  gmb_stats st;
  ck_assert_int_eq(gmb_tenant_stats(c, &st), GMB_E_PROTO);
  ck_assert_ptr_nonnull(strstr(gmb_last_error(c), "GMB_E_PROTO"));
  /* The client is not dead: the next exchange works. */
  ck_assert_int_eq(gmb_tenant_stats(c, &st), 0);
  ck_assert_uint_eq(st.quota, 1u << 30);
  gmb_disconnect(c);
}
END_TEST

static int stats_as_alloc(struct fake *f, const struct wire_request *req) {
  if (req->kind != WIRE_STATS) return 0;
  struct wire_reply rep = {.id = req->id, .kind = WIRE_ALLOC};
  rep.u.alloc.id = 5;
  fake_reply(f, &rep);
  return 1;
}

START_TEST(wrong_body_kind_proto) {
  F.handler = stats_as_alloc;
  fake_start();
  gmb_client *c = connect_ok();
  gmb_stats st;
  ck_assert_int_eq(gmb_tenant_stats(c, &st), GMB_E_PROTO);
  ck_assert_ptr_nonnull(strstr(gmb_last_error(c), "stats request"));
  gmb_disconnect(c);
}
END_TEST

static int stale_first(struct fake *f, const struct wire_request *req) {
  if (req->kind != WIRE_STATS) return 0;
  struct wire_reply rep = {.id = req->id + 7, .kind = WIRE_STATS};
  rep.u.stats.quota = 1;
  fake_reply(f, &rep); /* a future id */
  rep.id = req->id - 1;
  fake_reply(f, &rep); /* a late answer */
  fake_status(f, 0, GMB_E_PROTO, "could not decode"); /* an error notice */
  rep.id = req->id;
  rep.u.stats.quota = 42;
  fake_reply(f, &rep);
  return 1;
}

START_TEST(stale_reply_ids_ignored) {
  F.handler = stale_first;
  fake_start();
  gmb_client *c = connect_ok();
  gmb_stats st;
  ck_assert_int_eq(gmb_tenant_stats(c, &st), 0);
  ck_assert_uint_eq(st.quota, 42);
  gmb_disconnect(c);
}
END_TEST

static int silent_stats(struct fake *f, const struct wire_request *req) {
  (void)f;
  return req->kind == WIRE_STATS;
}

START_TEST(silent_broker_times_out) {
  setenv("GMB_REQUEST_TIMEOUT_MS", "150", 1);
  F.handler = silent_stats;
  fake_start();
  gmb_client *c = connect_ok();
  gmb_stats st;
  ck_assert_int_eq(gmb_tenant_stats(c, &st), GMB_E_CONN);
  ck_assert_ptr_nonnull(strstr(gmb_last_error(c), "did not answer within 150"));
  /* Dead for good: no new request reaches the broker. */
  int before = atomic_load(&F.n_alloc);
  gmb_id id;
  ck_assert_int_eq(gmb_alloc(c, 512, 0, &id), GMB_E_CONN);
  ck_assert_int_eq(atomic_load(&F.n_alloc), before);
  gmb_disconnect(c);
  ck_assert_int_eq(atomic_load(&F.n_bye), 0);
}
END_TEST

static int shutdown_on_stats(struct fake *f, const struct wire_request *req) {
  if (req->kind != WIRE_STATS) return 0;
  fake_event(f, WIRE_EVENT_SHUTDOWN, 0, "the broker is shutting down");
  return 1;
}

START_TEST(shutdown_event_kills_client) {
  F.handler = shutdown_on_stats;
  fake_start();
  gmb_client *c = connect_ok();
  gmb_id id;
  ck_assert_int_eq(gmb_alloc(c, 4096, 0, &id), 0);
  gmb_stats st;
  ck_assert_int_eq(gmb_tenant_stats(c, &st), GMB_E_CONN);
  ck_assert_int_eq(gmb_alloc(c, 512, 0, &id), GMB_E_CONN);
  ck_assert_str_eq(gmb_last_error(c), "GMB_E_CONN: the broker is shutting down");
  void *p;
  ck_assert_int_eq(gmb_lock(c, 1, &p), GMB_E_CONN);
  ck_assert_int_eq(gmb_free(c, 1), GMB_E_CONN);
  gmb_disconnect(c);
}
END_TEST

static int ended_on_stats(struct fake *f, const struct wire_request *req) {
  if (req->kind != WIRE_STATS) return 0;
  fake_event(f, WIRE_EVENT_SESSION_ENDED, 0, "evicted by an operator");
  return 1;
}

START_TEST(session_ended_event_kills_client) {
  F.handler = ended_on_stats;
  fake_start();
  gmb_client *c = connect_ok();
  gmb_stats st;
  ck_assert_int_eq(gmb_tenant_stats(c, &st), GMB_E_CONN);
  ck_assert_int_eq(gmb_tenant_stats(c, &st), GMB_E_CONN);
  ck_assert_ptr_nonnull(strstr(gmb_last_error(c), "evicted by an operator"));
  gmb_disconnect(c);
}
END_TEST

static int shutdown_after_stats(struct fake *f, const struct wire_request *req) {
  if (req->kind != WIRE_STATS) return 0;
  fake_default(f, req);
  fake_event(f, WIRE_EVENT_SHUTDOWN, 0, "the broker is shutting down");
  atomic_store(&f->close_now, 1);
  return 1;
}

START_TEST(shutdown_between_calls_reported_at_once) {
  /* Long enough that a client blocking in send would fail the message
   * check below with "could not reach" rather than the real reason. */
  setenv("GMB_REQUEST_TIMEOUT_MS", "3000", 1);
  F.handler = shutdown_after_stats;
  fake_start();
  gmb_client *c = connect_ok();
  gmb_stats st;
  int rc = gmb_tenant_stats(c, &st);
  ck_assert_msg(rc == 0, "%s", gmb_last_error(c));
  while (F.router != NULL) usleep(1000); /* the fake has closed */
  ck_assert_int_eq(gmb_free(c, 1), GMB_E_CONN);
  ck_assert_str_eq(gmb_last_error(c), "GMB_E_CONN: the broker is shutting down");
  gmb_disconnect(c);
}
END_TEST

static int close_on_alloc(struct fake *f, const struct wire_request *req) {
  if (req->kind != WIRE_ALLOC) return 0;
  atomic_store(&f->close_now, 1);
  return 1;
}

START_TEST(broker_gone_while_waiting_forever) {
  F.handler = close_on_alloc;
  fake_start();
  gmb_client *c = connect_ok();
  gmb_id id;
  ck_assert_int_eq(gmb_alloc_wait(c, 512, 0, -1, &id), GMB_E_CONN);
  ck_assert_ptr_nonnull(strstr(gmb_last_error(c), "closed the connection"));
  ck_assert_int_eq(F.last_alloc.u.alloc.timeout_ms, -1);
  gmb_disconnect(c);
}
END_TEST

static int slow_alloc(struct fake *f, const struct wire_request *req) {
  if (req->kind != WIRE_ALLOC) return 0;
  usleep(700 * 1000); /* longer than the request timeout, within the wait */
  fake_default(f, req);
  return 1;
}

START_TEST(alloc_wait_extends_reply_deadline) {
  setenv("GMB_REQUEST_TIMEOUT_MS", "300", 1);
  F.handler = slow_alloc;
  fake_start();
  gmb_client *c = connect_ok();
  gmb_id id;
  ck_assert_int_eq(gmb_alloc_wait(c, 512, 0, 1500, &id), 0);
  ck_assert_int_eq(F.last_alloc.u.alloc.timeout_ms, 1500);
  ck_assert_uint_ne(id, 0);
  gmb_disconnect(c);
}
END_TEST

/* --- allocations and mappings --------------------------------------------- */

static int alloc_too_far(struct fake *f, const struct wire_request *req) {
  if (req->kind != WIRE_ALLOC) return 0;
  struct wire_reply rep = {.id = req->id, .kind = WIRE_ALLOC};
  rep.u.alloc.id = 9;
  rep.u.alloc.size = 8192;
  rep.u.alloc.segment = 1;
  rep.u.alloc.offset = FAKE_SEG_SIZE - 4096;
  fake_reply(f, &rep);
  return 1;
}

START_TEST(alloc_outside_segment_proto) {
  F.handler = alloc_too_far;
  fake_start();
  gmb_client *c = connect_ok();
  gmb_id id = 77;
  ck_assert_int_eq(gmb_alloc(c, 8192, 0, &id), GMB_E_PROTO);
  ck_assert_uint_eq(id, 0);
  /* The segment's descriptor was fetched, and its size is what the range
   * is checked against. */
  ck_assert_int_eq(atomic_load(&F.n_segment), 1);
  ck_assert_ptr_nonnull(strstr(gmb_last_error(c), "outside segment 1"));
  /* The allocation it could not use was given back. */
  ck_assert_int_eq(atomic_load(&F.n_free), 1);
  ck_assert_uint_eq(F.last_free.u.free.id, 9);
  void *p;
  ck_assert_int_eq(gmb_lock(c, 9, &p), GMB_E_NOENT);
  gmb_disconnect(c);
}
END_TEST

static int alloc_bad_tail(struct fake *f, const struct wire_request *req) {
  if (req->kind != WIRE_ALLOC) return 0;
  struct wire_reply rep = {.id = req->id, .kind = WIRE_ALLOC};
  int step = atomic_fetch_add(&f->step, 1);
  rep.u.alloc.id = 20 + (uint64_t)step;
  rep.u.alloc.size = 5 * (UINT64_C(1) << 20);
  rep.u.alloc.segment = 1;
  rep.u.alloc.tail_segment = 2;
  rep.u.alloc.tail_size = UINT64_C(1) << 20;
  switch (step) {
    case 0: /* in the middle of its segment: no side-by-side mapping */
      rep.u.alloc.tail_offset = 4096;
      break;
    case 1: /* a whole page is no tail */
      rep.u.alloc.tail_size = 2 * (UINT64_C(1) << 20);
      break;
    case 2: /* the pages' own segment */
      rep.u.alloc.tail_segment = 1;
      break;
    default: /* as large as the whole allocation */
      rep.u.alloc.tail_size = rep.u.alloc.size;
  }
  fake_reply(f, &rep);
  return 1;
}

/* A large allocation's tail (docs/protocol.md) that cannot be mapped beside
 * its pages is a protocol error, found before any descriptor is asked
 * for, and the allocation is given back. */
START_TEST(alloc_impossible_tail_proto) {
  F.handler = alloc_bad_tail;
  fake_start();
  gmb_client *c = connect_ok();
  for (int i = 0; i < 4; i++) {
    gmb_id id = 77;
    ck_assert_int_eq(gmb_alloc(c, 5 << 20, 0, &id), GMB_E_PROTO);
    ck_assert_uint_eq(id, 0);
    ck_assert_ptr_nonnull(strstr(gmb_last_error(c), "is impossible"));
    ck_assert_int_eq(atomic_load(&F.n_free), i + 1);
    ck_assert_uint_eq(F.last_free.u.free.id, 20 + (uint64_t)i);
  }
  ck_assert_int_eq(atomic_load(&F.n_segment), 0);
  gmb_disconnect(c);
}
END_TEST

static int alloc_short(struct fake *f, const struct wire_request *req) {
  if (req->kind != WIRE_ALLOC) return 0;
  struct wire_reply rep = {.id = req->id, .kind = WIRE_ALLOC};
  rep.u.alloc.id = 3;
  rep.u.alloc.size = 512; /* less than asked */
  rep.u.alloc.segment = 1;
  fake_reply(f, &rep);
  return 1;
}

START_TEST(alloc_smaller_than_asked_proto) {
  F.handler = alloc_short;
  fake_start();
  gmb_client *c = connect_ok();
  gmb_id id;
  ck_assert_int_eq(gmb_alloc(c, 4096, 0, &id), GMB_E_PROTO);
  ck_assert_int_eq(atomic_load(&F.n_free), 1);
  gmb_disconnect(c);
}
END_TEST

static int alloc_in_segment_5(struct fake *f, const struct wire_request *req) {
  if (req->kind != WIRE_ALLOC) return 0;
  struct wire_reply rep = {.id = req->id, .kind = WIRE_ALLOC};
  rep.u.alloc.id = 4;
  rep.u.alloc.size = 512;
  rep.u.alloc.segment = 5; /* the channel will not give it */
  fake_reply(f, &rep);
  return 1;
}

START_TEST(alloc_in_segment_refused_on_channel) {
  F.handler = alloc_in_segment_5;
  fake_start();
  gmb_client *c = connect_ok();
  gmb_id id = 77;
  ck_assert_int_eq(gmb_alloc(c, 512, 0, &id), GMB_E_NOENT);
  ck_assert_uint_eq(id, 0);
  ck_assert_str_eq(gmb_last_error(c),
                   "GMB_E_NOENT: segment 5 is not this tenant's");
  ck_assert_uint_eq(F.last_segment.segment, 5);
  ck_assert_int_eq(atomic_load(&F.n_free), 1);
  ck_assert_uint_eq(F.last_free.u.free.id, 4);
  gmb_disconnect(c);
}
END_TEST

static int retire_on_stats(struct fake *f, const struct wire_request *req) {
  if (req->kind != WIRE_STATS) return 0;
  fake_event(f, WIRE_EVENT_SEGMENT_RETIRED, 1, "");
  fake_default(f, req);
  return 1;
}

START_TEST(alloc_maps_segment_and_lock_points_into_it) {
  F.handler = retire_on_stats;
  fake_start();
  gmb_client *c = connect_ok();
  ck_assert_int_eq(atomic_load(&F.n_segment), 0); /* nothing asked yet */
  gmb_id a, b;
  ck_assert_int_eq(gmb_alloc(c, 1000, 0, &a), 0); /* asks for segment 1 */
  ck_assert_int_eq(atomic_load(&F.n_segment), 1);
  ck_assert_uint_eq(F.last_segment.segment, 1);
  ck_assert_int_eq(gmb_alloc(c, 512, GMB_MOVABLE, &b), 0);
  ck_assert_int_eq(atomic_load(&F.n_segment), 1); /* the mapping was cached */
  void *pa, *pb;
  ck_assert_int_eq(gmb_lock(c, a, &pa), 0);
  ck_assert_int_eq(gmb_lock(c, b, &pb), 0);
  ck_assert_uint_eq((uintptr_t)pb - (uintptr_t)pa,
                    F.offsets[b] - F.offsets[a]);
  /* Bytes written by the client are in the test's own mapping. */
  memset(pa, 0xA5, 1000);
  memset(pb, 0x5A, 512);
  for (int i = 0; i < 1000; i++) ck_assert_uint_eq(F.seg1[F.offsets[a] + i], 0xA5);
  for (int i = 0; i < 512; i++) ck_assert_uint_eq(F.seg1[F.offsets[b] + i], 0x5A);
  /* ... and the other way round. */
  F.seg1[F.offsets[b] + 7] = 0x11;
  ck_assert_uint_eq(((uint8_t *)pb)[7], 0x11);
  ck_assert_int_eq(gmb_unlock(c, a), 0);
  ck_assert_int_eq(gmb_unlock(c, b), 0);

  /* The broker retires the segment: the next lock maps it again. */
  gmb_stats st;
  ck_assert_int_eq(gmb_tenant_stats(c, &st), 0);
  ck_assert_int_eq(gmb_lock(c, b, &pb), 0);
  ck_assert_int_eq(atomic_load(&F.n_segment), 2);
  ck_assert_uint_eq(((uint8_t *)pb)[7], 0x11);
  ck_assert_int_eq(gmb_unlock(c, b), 0);
  /* A pinned allocation too. */
  ck_assert_int_eq(gmb_tenant_stats(c, &st), 0);
  ck_assert_int_eq(gmb_lock(c, a, &pa), 0);
  ck_assert_int_eq(atomic_load(&F.n_segment), 3);
  ck_assert_uint_eq(((uint8_t *)pa)[999], 0xA5);

  /* Retired again: an alloc in it asks for the segment. */
  ck_assert_int_eq(gmb_tenant_stats(c, &st), 0);
  gmb_id d;
  ck_assert_int_eq(gmb_alloc(c, 512, 0, &d), 0);
  ck_assert_int_eq(atomic_load(&F.n_segment), 4);

  ck_assert_int_eq(gmb_free(c, a), 0);
  ck_assert_uint_eq(F.last_free.u.free.id, a);
  ck_assert_int_eq(gmb_lock(c, a, &pa), GMB_E_NOENT);
  ck_assert_int_eq(gmb_unlock(c, a), GMB_E_NOENT);
  gmb_disconnect(c);
}
END_TEST

START_TEST(fetched_descriptors_are_closed) {
  F.handler = retire_on_stats;
  fake_start();
  gmb_client *c = connect_ok();
  gmb_id id;
  ck_assert_int_eq(gmb_alloc(c, 512, 0, &id), 0);
  int before = check_count_fds();
  gmb_stats st;
  void *p;
  for (int i = 0; i < 50; i++) {
    ck_assert_int_eq(gmb_tenant_stats(c, &st), 0); /* retires segment 1 */
    ck_assert_int_eq(gmb_lock(c, id, &p), 0);      /* fetched again */
  }
  ck_assert_int_eq(atomic_load(&F.n_segment), 51);
  ck_assert_int_eq(check_count_fds(), before);
  gmb_disconnect(c);
}
END_TEST

static int free_noent(struct fake *f, const struct wire_request *req) {
  if (req->kind != WIRE_FREE) return 0;
  fake_status(f, req->id, GMB_E_NOENT, "no allocation 12345 in this session");
  return 1;
}

START_TEST(free_noent_passes_through) {
  F.handler = free_noent;
  fake_start();
  gmb_client *c = connect_ok();
  ck_assert_int_eq(gmb_free(c, 12345), GMB_E_NOENT);
  ck_assert_str_eq(gmb_last_error(c),
                   "GMB_E_NOENT: no allocation 12345 in this session");
  gmb_disconnect(c);
}
END_TEST

static int alloc_quota(struct fake *f, const struct wire_request *req) {
  if (req->kind != WIRE_ALLOC) return 0;
  fake_status(f, req->id, GMB_E_QUOTA, "team-a: 1GiB used of 1GiB");
  return 1;
}

START_TEST(alloc_refusal_passes_through) {
  F.handler = alloc_quota;
  fake_start();
  gmb_client *c = connect_ok();
  gmb_id id = 5;
  ck_assert_int_eq(gmb_alloc(c, 1 << 20, 0, &id), GMB_E_QUOTA);
  ck_assert_uint_eq(id, 0);
  ck_assert_str_eq(gmb_last_error(c), "GMB_E_QUOTA: team-a: 1GiB used of 1GiB");
  ck_assert_int_eq(atomic_load(&F.n_free), 0);
  gmb_disconnect(c);
}
END_TEST

START_TEST(alloc_bad_arguments_invalid) {
  fake_start();
  gmb_client *c = connect_ok();
  gmb_id id;
  ck_assert_int_eq(gmb_alloc(c, 0, 0, &id), GMB_E_INVAL);
  ck_assert_int_eq(gmb_alloc(c, 512, 0x4, &id), GMB_E_INVAL);
  ck_assert_int_eq(gmb_alloc(c, 512, 0, NULL), GMB_E_INVAL);
  ck_assert_int_eq(gmb_alloc(NULL, 512, 0, &id), GMB_E_INVAL);
  ck_assert_int_eq(gmb_alloc_wait(NULL, 512, 0, 10, &id), GMB_E_INVAL);
  ck_assert_int_eq(atomic_load(&F.n_alloc), 0); /* refused locally */
  void *p;
  gmb_stats st;
  ck_assert_int_eq(gmb_free(NULL, 1), GMB_E_INVAL);
  ck_assert_int_eq(gmb_lock(NULL, 1, &p), GMB_E_INVAL);
  ck_assert_int_eq(gmb_lock(c, 1, NULL), GMB_E_INVAL);
  ck_assert_int_eq(gmb_unlock(NULL, 1), GMB_E_INVAL);
  ck_assert_int_eq(gmb_tenant_stats(NULL, &st), GMB_E_INVAL);
  ck_assert_int_eq(gmb_tenant_stats(c, NULL), GMB_E_INVAL);
  ck_assert_int_eq(gmb_lock(c, 0, &p), GMB_E_NOENT);
  ck_assert_int_eq(gmb_unlock(c, 99), GMB_E_NOENT);
  gmb_disconnect(c);
  gmb_disconnect(NULL);
}
END_TEST

START_TEST(unlock_on_stream_host_device) {
  fake_start();
  gmb_client *c = connect_ok();
  gmb_id id;
  ck_assert_int_eq(gmb_alloc(c, 512, 0, &id), 0);
  ck_assert_int_eq(gmb_unlock_on_stream(c, id, NULL), GMB_E_DEVICE);
  ck_assert_str_eq(gmb_last_error(c),
                   "GMB_E_DEVICE: gmb_unlock_on_stream needs the CUDA device");
  gmb_disconnect(c);
}
END_TEST

/* The CUDA path itself is check_client_cuda's; here only that a cuda
 * broker without a driver to load is refused at connect, and told Bye. */
START_TEST(cuda_device_without_driver_refused) {
  snprintf(F.device, sizeof F.device, "cuda");
  setenv("GMB_LIBCUDA", "/nonexistent/libcuda.so.1", 1);
  fake_start();
  gmb_client *c = (gmb_client *)&c;
  ck_assert_int_eq(gmb_connect(F.endpoint, "team-a", &c), GMB_E_DEVICE);
  unsetenv("GMB_LIBCUDA");
  ck_assert_ptr_null(c);
  ck_assert_msg(strstr(gmb_last_error(NULL), "/nonexistent/libcuda.so.1"),
                "%s", gmb_last_error(NULL));
  ck_assert_int_eq(atomic_load(&F.n_bye), 1);
}
END_TEST

/* A cuda broker that does not say which GPU it serves: refused before any
 * driver is loaded, since an ordinal guessed here may name another GPU. */
START_TEST(cuda_device_without_uuid_refused) {
  snprintf(F.device, sizeof F.device, "cuda");
  F.no_uuid = 1;
  fake_start();
  gmb_client *c = (gmb_client *)&c;
  ck_assert_int_eq(gmb_connect(F.endpoint, "team-a", &c), GMB_E_DEVICE);
  ck_assert_ptr_null(c);
  ck_assert_msg(strstr(gmb_last_error(NULL), "did not say which GPU"),
                "%s", gmb_last_error(NULL));
  ck_assert_int_eq(atomic_load(&F.n_bye), 1);
}
END_TEST

START_TEST(heartbeats_sent_when_asked) {
  F.heartbeat_ms = 10;
  fake_start();
  gmb_client *c = connect_ok();
  /* No time is asserted: wait (under Check's timeout) for three. */
  while (atomic_load(&F.n_heartbeat) < 3) usleep(5000);
  gmb_disconnect(c);
  int n = atomic_load(&F.n_heartbeat);
  usleep(50 * 1000);
  ck_assert_int_eq(atomic_load(&F.n_heartbeat), n); /* the thread stopped */
}
END_TEST

/* Holds an alloc until three heartbeats came in after it: only a client
 * that keeps beating while it waits gets its answer. */
static struct wire_request held_alloc;
static int held_pending, held_hb;

static int hold_alloc(struct fake *f, const struct wire_request *req) {
  if (req->kind == WIRE_ALLOC) {
    held_alloc = *req;
    held_pending = 1;
    held_hb = atomic_load(&f->n_heartbeat);
    return 1;
  }
  if (req->kind == WIRE_HEARTBEAT && held_pending &&
      atomic_load(&f->n_heartbeat) - held_hb >= 3) {
    held_pending = 0;
    fake_default(f, &held_alloc);
    return 1;
  }
  return 0;
}

START_TEST(heartbeats_continue_during_long_wait) {
  setenv("GMB_REQUEST_TIMEOUT_MS", "200", 1);
  F.heartbeat_ms = 10;
  F.handler = hold_alloc;
  fake_start();
  gmb_client *c = connect_ok();
  gmb_id id;
  int rc = gmb_alloc_wait(c, 512, 0, 5000, &id);
  ck_assert_msg(rc == 0, "%s", gmb_last_error(c));
  gmb_disconnect(c);
}
END_TEST

/* Holds a waiting alloc until a Stats request comes, then answers the
 * alloc (twice: a hostile duplicate) and an id nobody sent, before the
 * Stats itself: the reply of the waiting request is read by the other
 * thread's call and must be handed over, the rest dropped. */
static int hold_alloc_until_stats(struct fake *f,
                                  const struct wire_request *req) {
  if (req->kind == WIRE_ALLOC && req->u.alloc.timeout_ms != 0) {
    held_alloc = *req;
    held_pending = 1;
    return 1;
  }
  if (req->kind == WIRE_STATS && held_pending) {
    held_pending = 0;
    fake_default(f, &held_alloc);
    fake_default(f, &held_alloc);
    struct wire_reply rep = {.id = held_alloc.id + 100, .kind = WIRE_ALLOC};
    fake_reply(f, &rep);
  }
  return 0;
}

struct alloc_waiter {
  gmb_client *c;
  gmb_id id;
  int rc;
};

static void *alloc_waiter_main(void *arg) {
  struct alloc_waiter *a = arg;
  a->rc = gmb_alloc_wait(a->c, 4096, 0, 5000, &a->id);
  return NULL;
}

/* A thread waits in gmb_alloc_wait; another thread's call goes through
 * meanwhile (the wait does not hold the socket) and hands the waiter the
 * reply it read for it. */
START_TEST(wait_reply_handed_over_by_another_call) {
  F.handler = hold_alloc_until_stats;
  fake_start();
  gmb_client *c = connect_ok();
  struct alloc_waiter a = {c, 0, -1};
  pthread_t th;
  ck_assert_int_eq(pthread_create(&th, NULL, alloc_waiter_main, &a), 0);
  while (atomic_load(&F.n_alloc) == 0) usleep(1000);
  gmb_stats st;
  int rc = gmb_tenant_stats(c, &st);
  ck_assert_msg(rc == 0, "%s", gmb_last_error(c));
  ck_assert_int_eq(pthread_join(th, NULL), 0);
  ck_assert_int_eq(a.rc, 0);
  ck_assert_uint_ne(a.id, 0);
  void *p;
  ck_assert_int_eq(gmb_lock(c, a.id, &p), 0);
  memset(p, 7, 4096);
  ck_assert_int_eq(gmb_unlock(c, a.id), 0);
  ck_assert_int_eq(gmb_free(c, a.id), 0);
  gmb_disconnect(c);
}
END_TEST

START_TEST(no_heartbeats_when_not_asked) {
  fake_start();
  gmb_client *c = connect_ok();
  gmb_stats st;
  for (int i = 0; i < 5; i++) ck_assert_int_eq(gmb_tenant_stats(c, &st), 0);
  gmb_disconnect(c);
  ck_assert_int_eq(atomic_load(&F.n_heartbeat), 0);
}
END_TEST

/* The cache's free bytes ride on heartbeats; a TRIM event is answered by
 * the library thread while the application makes no call at all. */
static _Atomic uint64_t trim_seen_cached, trim_last_cached;
static atomic_int trim_sent;

static int trim_on_heartbeat(struct fake *f, const struct wire_request *req) {
  if (req->kind != WIRE_HEARTBEAT) return 0;
  atomic_store(&trim_last_cached, req->cached_free);
  if (req->cached_free && !atomic_load(&trim_sent)) {
    atomic_store(&trim_seen_cached, req->cached_free);
    struct wire_reply ev = {.id = 0, .kind = WIRE_EVENT};
    ev.u.event.kind = WIRE_EVENT_TRIM;
    ev.u.event.bytes = 4u << 20;
    fake_reply(f, &ev);
    atomic_store(&trim_sent, 1);
  }
  return 1;
}

/* The channel refuses the third page's descriptor of the first batch. */
static int fd_refuse_third_page(struct fake *f, int conn,
                                const struct gmb_fd_req *req) {
  (void)f;
  if (req->op != GMB_FD_SEGMENT || req->segment != FAKE_PAGE_SEG + 2) return 0;
  fake_fdchan_reply(conn, GMB_FD_SEGMENT, GMB_E_NOENT, req->segment, 0, -1,
                    "no such segment of this tenant");
  return 1;
}

/* A cache's batch of pages asks for all its descriptors in one exchange
 * (every request before the first reply); one refused in the middle fails
 * the batch with no descriptor left open, gives the pages back, and leaves
 * the channel in step: the next batch is served. */
START_TEST(pages_descriptors_in_one_exchange) {
  F.fd_handler = fd_refuse_third_page;
  fake_start();
  gmb_client *c = connect_ok();
  int before = check_count_fds();
  void *p;
  ck_assert_int_eq(gmb_malloc_async(c, 10u << 20, NULL, &p), GMB_E_NOENT);
  ck_assert_ptr_nonnull(strstr(gmb_last_error(c), "no such segment"));
  ck_assert_int_eq(atomic_load(&F.n_segment), 5);
  /* The fake (in this process) keeps a memfd per page it made; the four
   * descriptors the client got were closed. */
  ck_assert_int_eq(check_count_fds(), before + 5);
  ck_assert_int_eq(atomic_load(&F.n_free), 1);
  ck_assert_uint_eq(F.last_free.u.free.id, 1);
  ck_assert_uint_eq(F.last_free.u.free.n_more, 4);
  ck_assert_int_eq(gmb_malloc_async(c, 10u << 20, NULL, &p), 0);
  ck_assert_int_eq(atomic_load(&F.n_segment), 10);
  memset(p, 0x5a, 10u << 20);
  ck_assert_int_eq(gmb_free_async(c, p, NULL), 0);
  gmb_disconnect(c);
}
END_TEST

START_TEST(trim_event_answered_by_idle_client) {
  F.heartbeat_ms = 10;
  F.handler = trim_on_heartbeat;
  fake_start();
  gmb_client *c = connect_ok();
  void *p;
  ck_assert_int_eq(gmb_malloc_async(c, 3u << 20, NULL, &p), 0);
  ck_assert_int_eq(gmb_free_async(c, p, NULL), 0);
  /* Idle from here: no call until both pages of the block went back, in
   * one Free (Check's timeout fails the test otherwise). */
  while (atomic_load(&F.n_free) < 1) usleep(5000);
  ck_assert_uint_eq(F.last_free.u.free.n_more, 1);
  ck_assert_uint_eq(atomic_load(&trim_seen_cached), 4u << 20);
  while (atomic_load(&trim_last_cached) != 0) usleep(5000);
  gmb_stats st;
  ck_assert_int_eq(gmb_tenant_stats(c, &st), 0);
  ck_assert_uint_eq(st.cached, 0);
  gmb_disconnect(c);
}
END_TEST

static void *last_error_thread(void *arg) {
  (void)arg;
  return (void *)gmb_last_error(NULL);
}

START_TEST(last_error_is_per_thread) {
  gmb_client *c = NULL;
  ck_assert_int_eq(gmb_connect(F.endpoint, NULL, &c), GMB_E_CONN);
  pthread_t t;
  void *res;
  pthread_create(&t, NULL, last_error_thread, NULL);
  pthread_join(t, &res);
  ck_assert_str_eq((const char *)res, "no error");
  ck_assert_ptr_nonnull(strstr(gmb_last_error(NULL), "GMB_E_CONN"));
}
END_TEST

/* --- many threads on one client -------------------------------------------- */

/* Odd workers allocate with gmb_alloc_wait (answered at once by the
 * fake): the waiting path, which releases the socket, reads for the
 * others and is handed replies, runs beside the ordinary one. */
struct worker {
  gmb_client *c;
  int n, tid;
  gmb_id *ids;
  int failures;
};

static void *worker_main(void *arg) {
  struct worker *w = arg;
  for (int i = 0; i < w->n; i++) {
    void *p;
    if (gmb_alloc_wait(w->c, 512, 0, w->tid % 2 ? 5000 : 0, &w->ids[i]) !=
            0 ||
        gmb_lock(w->c, w->ids[i], &p) != 0) {
      w->failures++;
      continue;
    }
    memset(p, (w->tid * 31 + i) & 0xff, 512);
    gmb_unlock(w->c, w->ids[i]);
    if (i % 3 == 2 && gmb_free(w->c, w->ids[i - 1]) != 0) w->failures++;
    if (i % 3 == 2) w->ids[i - 1] = 0;
  }
  return NULL;
}

START_TEST(threads_share_client) {
  int iter = getenv("ITER") ? atoi(getenv("ITER")) : 200;
  enum { NT = 4 };
  if (iter * NT * 512 > (int)FAKE_SEG_SIZE) iter = FAKE_SEG_SIZE / 512 / NT;
  F.heartbeat_ms = 1; /* the heartbeat thread competes for the socket too */
  fake_start();
  gmb_client *c = connect_ok();
  struct worker w[NT];
  pthread_t t[NT];
  for (int i = 0; i < NT; i++) {
    w[i] = (struct worker){c, iter, i, calloc((size_t)iter, sizeof(gmb_id)), 0};
    pthread_create(&t[i], NULL, worker_main, &w[i]);
  }
  for (int i = 0; i < NT; i++) pthread_join(t[i], NULL);
  for (int i = 0; i < NT; i++) {
    ck_assert_int_eq(w[i].failures, 0);
    for (int k = 0; k < iter; k++) {
      gmb_id id = w[i].ids[k];
      if (id == 0) continue;
      void *p;
      ck_assert_int_eq(gmb_lock(c, id, &p), 0);
      ck_assert_ptr_eq(p, (uint8_t *)p); /* silence */
      uint8_t want = (uint8_t)((i * 31 + k) & 0xff);
      ck_assert_uint_eq(F.seg1[F.offsets[id]], want);
      ck_assert_uint_eq(F.seg1[F.offsets[id] + 511], want);
      ck_assert_uint_eq(((uint8_t *)p)[100], want);
    }
    free(w[i].ids);
  }
  gmb_disconnect(c);
}
END_TEST

/* --- movable allocations and the lock table ---------------------------------- */

/* The mover, as the broker's compaction does it: claim, copy, publish. */
static int mv_claim(uint64_t id) {
  uint32_t zero = 0;
  return atomic_compare_exchange_strong_explicit(
      &lt_slot_of(&F, id)->state, &zero, GMB_LT_MOVING, memory_order_acq_rel,
      memory_order_acquire);
}

static void mv_publish(uint64_t id, uint64_t segment, uint64_t offset) {
  struct gmb__lt_slot *sl = lt_slot_of(&F, id);
  sl->segment = segment;
  sl->offset = offset;
  atomic_store_explicit(&sl->state, 0, memory_order_release);
}

static uint32_t lt_state(uint64_t id) {
  return atomic_load(&lt_slot_of(&F, id)->state);
}

START_TEST(movable_lock_sends_no_message) {
  fake_start();
  gmb_client *c = connect_ok();
  gmb_id id;
  ck_assert_int_eq(gmb_alloc(c, 4096, GMB_MOVABLE, &id), 0);
  ck_assert_uint_eq(F.last_alloc.u.alloc.flags, GMB_MOVABLE);
  void *p, *q;
  ck_assert_int_eq(gmb_lock(c, id, &p), 0);
  ck_assert_uint_eq(lt_state(id), 1);
  ck_assert_int_eq(gmb_lock(c, id, &q), 0); /* nested */
  ck_assert_ptr_eq(p, q);
  ck_assert_uint_eq(lt_state(id), 2);
  memset(p, 0x3C, 4096);
  ck_assert_uint_eq(F.seg1[F.offsets[id] + 4095], 0x3C);
  ck_assert_int_eq(gmb_unlock(c, id), 0);
  ck_assert_int_eq(gmb_unlock(c, id), 0);
  ck_assert_uint_eq(lt_state(id), 0);
  /* A round trip (Stats) makes sure everything the client sent so far has
   * reached the fake before counting. */
  gmb_stats st;
  ck_assert_int_eq(gmb_tenant_stats(c, &st), 0);
  int before = atomic_load(&F.n_total);
  for (int i = 0; i < 1000; i++) {
    ck_assert_int_eq(gmb_lock(c, id, &q), 0);
    ck_assert_ptr_eq(q, p);
    ck_assert_int_eq(gmb_unlock(c, id), 0);
  }
  ck_assert_int_eq(gmb_tenant_stats(c, &st), 0);
  ck_assert_int_eq(atomic_load(&F.n_total), before + 1); /* the Stats only */
  ck_assert_uint_eq(lt_state(id), 0);
  gmb_disconnect(c);
}
END_TEST

START_TEST(unlock_not_locked_invalid) {
  fake_start();
  gmb_client *c = connect_ok();
  gmb_id id;
  ck_assert_int_eq(gmb_alloc(c, 512, GMB_MOVABLE, &id), 0);
  ck_assert_int_eq(gmb_unlock(c, id), GMB_E_INVAL);
  ck_assert_uint_eq(lt_state(id), 0); /* never below 0 */
  void *p;
  ck_assert_int_eq(gmb_lock(c, id, &p), 0);
  ck_assert_int_eq(gmb_unlock(c, id), 0);
  ck_assert_int_eq(gmb_unlock(c, id), GMB_E_INVAL);
  ck_assert_uint_eq(lt_state(id), 0);
  /* A slot the broker is moving has no holder to release either. */
  ck_assert(mv_claim(id));
  ck_assert_int_eq(gmb_unlock(c, id), GMB_E_INVAL);
  ck_assert_uint_eq(lt_state(id), GMB_LT_MOVING);
  mv_publish(id, 1, F.offsets[id]);
  gmb_disconnect(c);
}
END_TEST

struct locker {
  gmb_client *c;
  gmb_id id;
  void *ptr;
  int rc;
  atomic_int done;
};

static void *locker_main(void *arg) {
  struct locker *l = arg;
  l->rc = gmb_lock(l->c, l->id, &l->ptr);
  atomic_store(&l->done, 1);
  return NULL;
}

START_TEST(lock_waits_while_moving_then_new_position) {
  fake_start();
  gmb_client *c = connect_ok();
  gmb_id id, other;
  ck_assert_int_eq(gmb_alloc(c, 1024, GMB_MOVABLE, &id), 0);
  ck_assert_int_eq(gmb_alloc(c, 1024, 0, &other), 0);
  void *p;
  ck_assert_int_eq(gmb_lock(c, id, &p), 0);
  memset(p, 0x77, 1024);
  ck_assert_int_eq(gmb_unlock(c, id), 0);

  ck_assert(mv_claim(id));
  struct locker l = {.c = c, .id = id};
  pthread_t t;
  ck_assert_int_eq(pthread_create(&t, NULL, locker_main, &l), 0);
  /* However long it waits, it must not return while the slot is MOVING;
   * meanwhile the client serves other calls (no mutex held while waiting). */
  usleep(30 * 1000);
  ck_assert_int_eq(atomic_load(&l.done), 0);
  gmb_stats st;
  ck_assert_int_eq(gmb_tenant_stats(c, &st), 0);
  void *po;
  ck_assert_int_eq(gmb_lock(c, other, &po), 0);
  ck_assert_int_eq(atomic_load(&l.done), 0);
  /* The move: copy, poison the old place, publish the new one. */
  uint64_t from = F.offsets[id], to = 2u << 20;
  memcpy(F.seg1 + to, F.seg1 + from, 1024);
  memset(F.seg1 + from, 0xEE, 1024);
  mv_publish(id, 1, to);
  pthread_join(t, NULL);
  ck_assert_int_eq(l.rc, 0);
  ck_assert_uint_eq((uintptr_t)l.ptr - (uintptr_t)p, to - from);
  for (int i = 0; i < 1024; i++)
    ck_assert_uint_eq(((uint8_t *)l.ptr)[i], 0x77);
  ck_assert_uint_eq(lt_state(id), 1);
  ck_assert_int_eq(gmb_unlock(c, id), 0);
  gmb_disconnect(c);
}
END_TEST

/* A lock that lands mid-move sleeps on the slot's word and the broker's
 * publish wakes it (proto/locktab_layout.h): the waiter announces itself
 * (WAITERS), sleeps in the futex call, and the wake finds exactly it. */
struct futex_locker {
  gmb_client *c;
  gmb_id id;
  void *ptr;
  int rc;
  _Atomic pid_t tid;
};

static void *futex_locker_main(void *arg) {
  struct futex_locker *l = arg;
  atomic_store(&l->tid, (pid_t)syscall(SYS_gettid));
  l->rc = gmb_lock(l->c, l->id, &l->ptr);
  return NULL;
}

/* A movable allocation of 1 KiB of 0x5A bytes (*id, its first address
 * *p) that the broker claimed (MOVING), and a thread of l asleep in
 * gmb_lock on its word. */
static void locker_asleep(gmb_client *c, gmb_id *id, void **p,
                          struct futex_locker *l, pthread_t *t) {
  ck_assert_int_eq(gmb_alloc(c, 1024, GMB_MOVABLE, id), 0);
  ck_assert_int_eq(gmb_lock(c, *id, p), 0);
  memset(*p, 0x5A, 1024);
  ck_assert_int_eq(gmb_unlock(c, *id), 0);
  ck_assert(mv_claim(*id));
  *l = (struct futex_locker){.c = c, .id = *id};
  ck_assert_int_eq(pthread_create(t, NULL, futex_locker_main, l), 0);
  while (atomic_load(&l->tid) == 0) sched_yield();
  ck_assert_msg(check_thread_in_futex(atomic_load(&l->tid)),
                "gmb_lock never slept on the lock word");
}

START_TEST(lock_mid_move_sleeps_until_woken) {
  fake_start();
  gmb_client *c = connect_ok();
  gmb_id id;
  void *p;
  struct futex_locker l;
  pthread_t t;
  locker_asleep(c, &id, &p, &l, &t);
  ck_assert_uint_eq(lt_state(id), GMB_LT_MOVING | GMB_LT_WAITERS);
  /* The broker's end of a move (locktab.c): position, exchange 0, wake. */
  uint64_t from = F.offsets[id], to = 2u << 20;
  memcpy(F.seg1 + to, F.seg1 + from, 1024);
  memset(F.seg1 + from, 0xEE, 1024);
  struct gmb__lt_slot *sl = lt_slot_of(&F, id);
  sl->segment = 1;
  sl->offset = to;
  uint32_t old = atomic_exchange(&sl->state, 0);
  ck_assert_uint_eq(old, GMB_LT_MOVING | GMB_LT_WAITERS);
  ck_assert_int_eq(gmb__lt_futex_wake(&sl->state), 1); /* it, asleep */
  pthread_join(t, NULL);
  ck_assert_int_eq(l.rc, 0);
  ck_assert_uint_eq((uintptr_t)l.ptr - (uintptr_t)p, to - from);
  for (int i = 0; i < 1024; i++)
    ck_assert_uint_eq(((uint8_t *)l.ptr)[i], 0x5A);
  ck_assert_uint_eq(lt_state(id), 1);
  ck_assert_int_eq(gmb_unlock(c, id), 0);
  gmb_disconnect(c);
}
END_TEST

/* The broker's side of an offload and a restore, for the lock tests
 * below: the bytes of the allocation offloaded (its copy here), and the
 * Lock handler that brings it back to OFFL_TO and takes the caller's
 * hold (offload.c), or refuses it (offl_refuse). */
#define OFFL_TO (3u << 20)
static uint8_t offl_copy[1024];
static int offl_refuse;
static atomic_int offl_locks;

static int offl_lock_handler(struct fake *f, const struct wire_request *req) {
  if (req->kind != WIRE_LOCK) return 0;
  atomic_fetch_add(&offl_locks, 1);
  if (offl_refuse) {
    fake_status(f, req->id, GMB_E_TIMEOUT, "no room for 1KiB was freed in "
                "time");
    return 1;
  }
  struct gmb__lt_slot *sl = lt_slot_of(f, req->u.lock.id);
  memcpy(f->seg1 + OFFL_TO, offl_copy, sizeof offl_copy);
  sl->segment = 1;
  sl->offset = OFFL_TO;
  atomic_store_explicit(&sl->state, 1, memory_order_release);
  struct wire_reply rep = {.id = req->id, .kind = WIRE_LOCK};
  rep.u.lock.held = 1;
  rep.u.lock.segment = 1;
  rep.u.lock.offset = OFFL_TO;
  fake_reply(f, &rep);
  return 1;
}

/* A gmb_lock asleep on the word while the broker copies the allocation
 * out is woken by the OFFLOADED store, asks the broker (Lock), and gets
 * its hold at the new place with the bytes; a lock refused by the broker
 * fails with its code and leaves the slot OFFLOADED. */
START_TEST(lock_mid_offload_asks_the_broker) {
  F.handler = offl_lock_handler;
  offl_refuse = 0;
  atomic_store(&offl_locks, 0);
  fake_start();
  gmb_client *c = connect_ok();
  gmb_id id;
  void *p;
  struct futex_locker l;
  pthread_t t;
  locker_asleep(c, &id, &p, &l, &t);
  /* The broker's offload: the copy, the range gone, OFFLOADED, wake. */
  memcpy(offl_copy, F.seg1 + F.offsets[id], sizeof offl_copy);
  memset(F.seg1 + F.offsets[id], 0xEE, 1024);
  struct gmb__lt_slot *sl = lt_slot_of(&F, id);
  uint32_t old = atomic_exchange(&sl->state, GMB_LT_OFFLOADED);
  ck_assert_uint_eq(old, GMB_LT_MOVING | GMB_LT_WAITERS);
  gmb__lt_futex_wake(&sl->state);
  pthread_join(t, NULL);
  ck_assert_int_eq(l.rc, 0);
  ck_assert_int_eq(atomic_load(&offl_locks), 1);
  ck_assert_uint_eq((uintptr_t)l.ptr - (uintptr_t)p, OFFL_TO - F.offsets[id]);
  for (int i = 0; i < 1024; i++)
    ck_assert_uint_eq(((uint8_t *)l.ptr)[i], 0x5A);
  ck_assert_uint_eq(lt_state(id), 1); /* the hold the broker took for us */
  ck_assert_int_eq(gmb_unlock(c, id), 0);
  ck_assert_uint_eq(lt_state(id), 0);
  /* Offloaded again, and the broker has no room: the code, nothing
   * changed; an unlock of it is refused. */
  ck_assert(mv_claim(id));
  atomic_store(&sl->state, GMB_LT_OFFLOADED);
  offl_refuse = 1;
  ck_assert_int_eq(gmb_lock(c, id, &p), GMB_E_TIMEOUT);
  ck_assert_ptr_nonnull(strstr(gmb_last_error(c), "in time"));
  ck_assert_uint_eq(lt_state(id), GMB_LT_OFFLOADED);
  ck_assert_int_eq(gmb_unlock(c, id), GMB_E_INVAL);
  gmb_disconnect(c);
  F.handler = NULL;
}
END_TEST

START_TEST(lock_moving_too_long_times_out) {
  setenv("GMB_LOCK_TIMEOUT_MS", "50", 1);
  fake_start();
  gmb_client *c = connect_ok();
  gmb_id id;
  ck_assert_int_eq(gmb_alloc(c, 512, GMB_MOVABLE, &id), 0);
  ck_assert(mv_claim(id));
  void *p;
  ck_assert_int_eq(gmb_lock(c, id, &p), GMB_E_TIMEOUT);
  ck_assert_ptr_nonnull(strstr(gmb_last_error(c), "being moved"));
  /* Still MOVING: the client only announced that it slept (WAITERS). */
  ck_assert_uint_eq(lt_state(id) & ~GMB_LT_WAITERS, GMB_LT_MOVING);
  mv_publish(id, 1, F.offsets[id]);
  ck_assert_int_eq(gmb_lock(c, id, &p), 0);
  ck_assert_int_eq(gmb_unlock(c, id), 0);
  gmb_disconnect(c);
  unsetenv("GMB_LOCK_TIMEOUT_MS");
}
END_TEST

START_TEST(moved_to_unmapped_segment_fetched_once) {
  seg2_setup();
  fake_start();
  gmb_client *c = connect_ok();
  gmb_id id;
  ck_assert_int_eq(gmb_alloc(c, 512, GMB_MOVABLE, &id), 0);
  ck_assert_int_eq(atomic_load(&F.n_segment), 1); /* segment 1 */
  ck_assert(mv_claim(id));
  memset(F.seg2 + 4096, 0x42, 512);
  mv_publish(id, 2, 4096);
  void *p, *q;
  ck_assert_int_eq(gmb_lock(c, id, &p), 0);
  ck_assert_int_eq(atomic_load(&F.n_segment), 2);
  ck_assert_uint_eq(F.last_segment.segment, 2);
  ck_assert_uint_eq(((uint8_t *)p)[511], 0x42);
  ((uint8_t *)p)[0] = 0x43;
  ck_assert_uint_eq(F.seg2[4096], 0x43);
  ck_assert_int_eq(gmb_unlock(c, id), 0);
  ck_assert_int_eq(gmb_lock(c, id, &q), 0);
  ck_assert_ptr_eq(p, q);
  ck_assert_int_eq(atomic_load(&F.n_segment), 2); /* mapped once */
  ck_assert_int_eq(gmb_unlock(c, id), 0);
  /* A segment the broker cannot give: the hold taken is given back. */
  ck_assert(mv_claim(id));
  mv_publish(id, 3, 0);
  ck_assert_int_eq(gmb_lock(c, id, &p), GMB_E_NOENT);
  ck_assert_str_eq(gmb_last_error(c),
                   "GMB_E_NOENT: segment 3 is not this tenant's");
  ck_assert_uint_eq(F.last_segment.segment, 3);
  ck_assert_uint_eq(lt_state(id), 0);
  /* A position outside the segment: refused, hold given back. */
  ck_assert(mv_claim(id));
  mv_publish(id, 1, FAKE_SEG_SIZE - 256);
  ck_assert_int_eq(gmb_lock(c, id, &p), GMB_E_PROTO);
  ck_assert_uint_eq(lt_state(id), 0);
  gmb_disconnect(c);
}
END_TEST

START_TEST(alloc_slot_of_another_allocation_proto) {
  fake_start();
  gmb_client *c = connect_ok();
  gmb_id a;
  ck_assert_int_eq(gmb_alloc(c, 512, GMB_MOVABLE, &a), 0);
  /* With lt_slots 1 the fake writes no slot for id 2 and answers slot 0,
   * which serves id 1: a reply that names another allocation's slot. */
  F.lt_slots = 1;
  gmb_id b = 5;
  ck_assert_int_eq(gmb_alloc(c, 512, GMB_MOVABLE, &b), GMB_E_PROTO);
  ck_assert_uint_eq(b, 0);
  ck_assert_ptr_nonnull(strstr(gmb_last_error(c), "slot"));
  ck_assert_int_eq(atomic_load(&F.n_free), 1); /* given back */
  F.lt_slots = 64;
  gmb_disconnect(c);
}
END_TEST

static int alloc_slot_out_of_range(struct fake *f,
                                   const struct wire_request *req) {
  if (req->kind != WIRE_ALLOC) return 0;
  struct wire_reply rep = {.id = req->id, .kind = WIRE_ALLOC};
  rep.u.alloc.id = 9;
  rep.u.alloc.size = 512;
  rep.u.alloc.segment = 1;
  rep.u.alloc.offset = 0;
  rep.u.alloc.slot = 64; /* == lock_slots */
  fake_reply(f, &rep);
  return 1;
}

START_TEST(alloc_slot_out_of_range_proto) {
  F.handler = alloc_slot_out_of_range;
  fake_start();
  gmb_client *c = connect_ok();
  gmb_id id;
  ck_assert_int_eq(gmb_alloc(c, 512, GMB_MOVABLE, &id), GMB_E_PROTO);
  ck_assert_ptr_nonnull(strstr(gmb_last_error(c), "out of range"));
  ck_assert_int_eq(atomic_load(&F.n_free), 1);
  gmb_disconnect(c);
}
END_TEST

START_TEST(lock_table_bad_magic_proto) {
  F.lt->magic ^= 1;
  fake_start();
  gmb_client *c = (gmb_client *)1;
  ck_assert_int_eq(gmb_connect(F.endpoint, "team-a", &c), GMB_E_PROTO);
  ck_assert_ptr_null(c);
  ck_assert_ptr_nonnull(strstr(gmb_last_error(NULL), "magic"));
  ck_assert_int_eq(atomic_load(&F.n_bye), 1); /* disconnected cleanly */
  F.lt->magic ^= 1;
  F.lt->version++;
  ck_assert_int_eq(gmb_connect(F.endpoint, "team-a", &c), GMB_E_PROTO);
  ck_assert_ptr_nonnull(strstr(gmb_last_error(NULL), "wrong version"));
  F.lt->version--;
  c = connect_ok();
  gmb_disconnect(c);
}
END_TEST

START_TEST(lock_table_other_session_proto) {
  F.lt->session = 2;
  fake_start();
  gmb_client *c = NULL;
  ck_assert_int_eq(gmb_connect(F.endpoint, "team-a", &c), GMB_E_PROTO);
  ck_assert_ptr_nonnull(strstr(gmb_last_error(NULL), "session"));
  F.lt->session = 1;
  F.lt->slots = 32; /* the header disagrees with the Hello reply */
  ck_assert_int_eq(gmb_connect(F.endpoint, "team-a", &c), GMB_E_PROTO);
  ck_assert_ptr_nonnull(strstr(gmb_last_error(NULL), "slot count"));
  F.lt->slots = FAKE_LT_SLOTS;
  /* More slots than the descriptor holds, its size announced as theirs:
   * mapping them all would SIGBUS at the last ones. */
  F.lt_slots = 1u << 20;
  ck_assert_int_eq(gmb_connect(F.endpoint, "team-a", &c), GMB_E_PROTO);
  ck_assert_ptr_nonnull(strstr(gmb_last_error(NULL),
                               "shorter than 1048576 slots"));
  F.lt_slots = FAKE_LT_SLOTS;
  ck_assert_int_eq(atomic_load(&F.n_bye), 3);
  ck_assert_int_eq(atomic_load(&F.n_auth), 3);
}
END_TEST

/* Threads lock the same and different movable allocations while a mover
 * thread keeps moving them: every holder sees its allocation's pattern and
 * a nested lock returns the same address. */
#define MV_N 8
#define MV_SIZE 4096
#define MV_MIN_MOVES 1000

struct mv_worker {
  gmb_client *c;
  gmb_id *ids;
  int iter, tid;
  long bad, nested_differs, locks;
};

static atomic_int mv_stop;
static atomic_long mv_moves;

static void *mv_worker_main(void *arg) {
  struct mv_worker *w = arg;
  unsigned r = (unsigned)w->tid * 2654435761u + 1;
  /* At least iter locks, and on until the mover made MV_MIN_MOVES: the
   * test proves nothing about moves if there were none. */
  for (long i = 0; i < w->iter || atomic_load(&mv_moves) < MV_MIN_MOVES;
       i++) {
    if (i % 256 == 255) sched_yield(); /* 2 cores: let the mover run */
    r = r * 1103515245u + 12345u;
    /* Half the time all threads want allocation 0: the same slot. */
    int k = (r >> 16) & 1 ? 0 : (int)((r >> 8) % MV_N);
    void *p, *q;
    if (gmb_lock(w->c, w->ids[k], &p) != 0) {
      w->bad++;
      continue;
    }
    uint8_t want = (uint8_t)(0x10 + k);
    const uint8_t *b = p;
    if (b[0] != want || b[MV_SIZE / 2] != want || b[MV_SIZE - 1] != want)
      w->bad++;
    if (gmb_lock(w->c, w->ids[k], &q) != 0 || q != p) w->nested_differs++;
    else gmb_unlock(w->c, w->ids[k]);
    if (gmb_unlock(w->c, w->ids[k]) != 0) w->bad++;
    w->locks++;
  }
  return NULL;
}

/* Moves allocation k between two places in segment 1: [1 MiB + k*8 KiB]
 * and [1 MiB + k*8 KiB + 4 KiB], poisoning the place it left. */
static void *mv_mover_main(void *arg) {
  gmb_id *ids = arg;
  unsigned r = 7;
  while (!atomic_load(&mv_stop)) {
    r = r * 1103515245u + 12345u;
    int k = (int)((r >> 8) % MV_N);
    struct gmb__lt_slot *sl = lt_slot_of(&F, ids[k]);
    if (!mv_claim(ids[k])) {
      sched_yield();
      continue;
    }
    uint64_t from = sl->offset;
    uint64_t base = (1u << 20) + (uint64_t)k * 2 * MV_SIZE;
    uint64_t to = from == base ? base + MV_SIZE : base;
    memcpy(F.seg1 + to, F.seg1 + from, MV_SIZE);
    memset(F.seg1 + from, 0xEE, MV_SIZE);
    mv_publish(ids[k], 1, to);
    atomic_fetch_add(&mv_moves, 1);
    sched_yield();
  }
  return NULL;
}

START_TEST(movable_threads_lock_while_moving) {
  int iter = getenv("ITER") ? atoi(getenv("ITER")) : 20000;
  enum { NT = 4 };
  fake_start();
  gmb_client *c = connect_ok();
  gmb_id ids[MV_N];
  for (int k = 0; k < MV_N; k++) {
    ck_assert_int_eq(gmb_alloc(c, MV_SIZE, GMB_MOVABLE, &ids[k]), 0);
    void *p;
    ck_assert_int_eq(gmb_lock(c, ids[k], &p), 0);
    memset(p, 0x10 + k, MV_SIZE);
    ck_assert_int_eq(gmb_unlock(c, ids[k]), 0);
  }
  atomic_store(&mv_stop, 0);
  atomic_store(&mv_moves, 0);
  pthread_t mover, t[NT];
  struct mv_worker w[NT];
  ck_assert_int_eq(pthread_create(&mover, NULL, mv_mover_main, ids), 0);
  for (int i = 0; i < NT; i++) {
    w[i] = (struct mv_worker){c, ids, iter, i, 0, 0, 0};
    ck_assert_int_eq(pthread_create(&t[i], NULL, mv_worker_main, &w[i]), 0);
  }
  for (int i = 0; i < NT; i++) pthread_join(t[i], NULL);
  /* Every slot is unlocked now: the mover can take each, so a few more
   * moves are certain before it stops. */
  long moves_at_end = atomic_load(&mv_moves);
  while (atomic_load(&mv_moves) < moves_at_end + MV_N) sched_yield();
  atomic_store(&mv_stop, 1);
  pthread_join(mover, NULL);
  for (int i = 0; i < NT; i++) {
    ck_assert_int_eq(w[i].bad, 0);
    ck_assert_int_eq(w[i].nested_differs, 0);
    ck_assert_int_ge(w[i].locks, iter);
  }
  for (int k = 0; k < MV_N; k++) {
    ck_assert_uint_eq(lt_state(ids[k]), 0);
    void *p;
    ck_assert_int_eq(gmb_lock(c, ids[k], &p), 0);
    for (int j = 0; j < MV_SIZE; j++)
      ck_assert_uint_eq(((uint8_t *)p)[j], 0x10 + k);
    ck_assert_int_eq(gmb_unlock(c, ids[k]), 0);
  }
  ck_assert_int_ge(atomic_load(&mv_moves), MV_MIN_MOVES);
  gmb_disconnect(c);
}
END_TEST

/* --- the descriptor channel -------------------------------------------------- */

START_TEST(connect_proves_session_on_channel) {
  /* A session id that needs all 64 bits, in the Hello reply and the
   * lock table's header alike. */
  F.session = UINT64_C(0x0123456789abcdef);
  F.lt->session = F.session;
  fake_start();
  gmb_client *c = connect_ok();
  ck_assert_int_eq(FAKE_FDCHAN_COUNT(&F.ch, accepted), 1);
  ck_assert_int_eq(atomic_load(&F.n_auth), 1);
  const struct gmb_fd_req *a = &F.last_auth;
  ck_assert_uint_eq(a->magic, GMB_FD_MAGIC);
  ck_assert_uint_eq(a->op, GMB_FD_AUTH);
  ck_assert_uint_eq(a->session, F.session);
  ck_assert_int_eq(memcmp(a->secret, F.secret, GMB_FD_SECRET_LEN), 0);
  /* The channel is this process's (what the broker checks the uid of). */
  ck_assert_int_eq(F.auth_cred.pid, (int)getpid());
  ck_assert_int_eq((int)F.auth_cred.uid, (int)getuid());
  /* Connecting sends nothing more on the ZeroMQ socket than the Hello: a
   * Stats round trip is the second message. */
  gmb_stats st;
  ck_assert_int_eq(gmb_tenant_stats(c, &st), 0);
  ck_assert_int_eq(atomic_load(&F.n_total), 2);
  ck_assert_int_eq(atomic_load(&F.n_heartbeat), 0);
  /* Segments are asked for by id on the same connection. */
  gmb_id id;
  ck_assert_int_eq(gmb_alloc(c, 512, GMB_MOVABLE, &id), 0);
  ck_assert_int_eq(atomic_load(&F.n_segment), 1);
  const struct gmb_fd_req *s = &F.last_segment;
  ck_assert_uint_eq(s->magic, GMB_FD_MAGIC);
  ck_assert_uint_eq(s->op, GMB_FD_SEGMENT);
  ck_assert_uint_eq(s->segment, 1);
  ck_assert_int_eq(FAKE_FDCHAN_COUNT(&F.ch, accepted), 1);
  /* The lock table the channel gave is shared with the fake. */
  void *p;
  ck_assert_int_eq(gmb_lock(c, id, &p), 0);
  ck_assert_uint_eq(atomic_load(&lt_slot_of(&F, id)->state), 1);
  ck_assert_int_eq(gmb_unlock(c, id), 0);
  ck_assert_uint_eq(atomic_load(&lt_slot_of(&F, id)->state), 0);
  gmb_disconnect(c);
}
END_TEST

START_TEST(disconnect_hangs_up_channel) {
  fake_start();
  int before = check_count_fds();
  gmb_client *c = connect_ok();
  gmb_id id;
  ck_assert_int_eq(gmb_alloc(c, 512, 0, &id), 0);
  ck_assert_int_eq(FAKE_FDCHAN_COUNT(&F.ch, hangups), 0);
  gmb_disconnect(c);
  /* The broker learns from the hang-up that the process let go. */
  while (FAKE_FDCHAN_COUNT(&F.ch, hangups) < 1) usleep(1000);
  ck_assert_int_eq(FAKE_FDCHAN_COUNT(&F.ch, accepted), 1);
  /* Nothing of the client is left open: the channel, the lock table's
   * and the segment's descriptors. */
  ck_assert_int_eq(fds_settle(before), before);
}
END_TEST

/* Connect fails after the Hello: Bye was said, no client is returned, the
 * channel (if any) was hung up, and nothing the client opened or was sent
 * is left open. */
static void connect_fails_cleanly(int want, const char *why, int before) {
  gmb_client *c = (gmb_client *)&c;
  int rc = gmb_connect(F.endpoint, "team-a", &c);
  ck_assert_msg(rc == want, "connect gave %d: %s", rc, gmb_last_error(NULL));
  ck_assert_ptr_null(c);
  ck_assert_msg(strstr(gmb_last_error(NULL), why), "\"%s\" lacks \"%s\"",
                gmb_last_error(NULL), why);
  ck_assert_int_eq(atomic_load(&F.n_bye), 1);
  int accepted = FAKE_FDCHAN_COUNT(&F.ch, accepted);
  while (FAKE_FDCHAN_COUNT(&F.ch, closed) < accepted) usleep(1000);
  ck_assert_int_eq(fds_settle(before), before);
}

START_TEST(hello_without_secret_proto) {
  F.secret_len = 0;
  fake_start();
  connect_fails_cleanly(GMB_E_PROTO, "no secret", check_count_fds());
  ck_assert_int_eq(FAKE_FDCHAN_COUNT(&F.ch, accepted), 0); /* never tried */
}
END_TEST

START_TEST(hello_short_secret_proto) {
  F.secret_len = GMB_FD_SECRET_LEN / 2;
  fake_start();
  connect_fails_cleanly(GMB_E_PROTO, "no secret", check_count_fds());
  ck_assert_int_eq(FAKE_FDCHAN_COUNT(&F.ch, accepted), 0);
}
END_TEST

START_TEST(hello_zero_lock_slots_proto) {
  /* Every session has a lock table now; a Hello without one is not from
   * a broker of this protocol. */
  F.lt_slots = 0;
  F.lt_size = gmb__lt_bytes(FAKE_LT_SLOTS);
  fake_start();
  connect_fails_cleanly(GMB_E_PROTO, "0 slots", check_count_fds());
}
END_TEST

START_TEST(channel_missing_fails_connect) {
  F.no_channel = 1; /* a broker.sock without an fd.sock beside it */
  fake_start();
  connect_fails_cleanly(GMB_E_CONN, "cannot reach the descriptor channel",
                        check_count_fds());
  ck_assert_ptr_nonnull(strstr(gmb_last_error(NULL), "/fd.sock"));
}
END_TEST

START_TEST(channel_needs_ipc_endpoint) {
  /* A broker reached over tcp:// cannot pass descriptors. */
  snprintf(F.endpoint, sizeof F.endpoint, "tcp://127.0.0.1:*");
  fake_start();
  ck_assert_ptr_null(strstr(F.endpoint, "*"));
  connect_fails_cleanly(GMB_E_CONN, "ipc://", check_count_fds());
  ck_assert_int_eq(FAKE_FDCHAN_COUNT(&F.ch, accepted), 0);
}
END_TEST

static int fd_silent_auth(struct fake *f, int conn,
                          const struct gmb_fd_req *req) {
  (void)f;
  (void)conn;
  return req->op == GMB_FD_AUTH;
}

START_TEST(channel_silent_auth_times_out) {
  setenv("GMB_CONNECT_TIMEOUT_MS", "200", 1);
  F.fd_handler = fd_silent_auth;
  fake_start();
  connect_fails_cleanly(GMB_E_TIMEOUT, "no answer in time", check_count_fds());
  ck_assert_int_eq(atomic_load(&F.n_auth), 1);
}
END_TEST

START_TEST(channel_wrong_secret_refused) {
  /* The Hello reply gives a secret the channel does not take: the
   * refusal, and its reason, reach the application. */
  F.hello_secret_xor = 0x80;
  fake_start();
  connect_fails_cleanly(GMB_E_AUTH, "GMB_E_AUTH: no session with that secret",
                        check_count_fds());
  ck_assert_int_eq(atomic_load(&F.n_auth), 1);
  ck_assert_uint_eq(F.last_auth.secret[0], F.secret[0] ^ 0x80);
  ck_assert_int_eq(memcmp(F.last_auth.secret + 1, F.secret + 1,
                          GMB_FD_SECRET_LEN - 1), 0);
}
END_TEST

/* Lies on the channel.  The fake's answer to the first request of
 * operation `lie_op` is replaced by `lie`; everything else is answered by
 * the default, so the test also sees the client go on afterwards. */
enum lie {
  LIE_SHORT_REPLY,     /* fewer bytes than a reply */
  LIE_LONG_REPLY,      /* more bytes than a reply */
  LIE_MAGIC,           /* another magic */
  LIE_OP,              /* the other operation's reply */
  LIE_STATUS,          /* a positive status, no GMB_E_* code */
  LIE_NO_FD,           /* status 0 and no descriptor */
  LIE_FD_WITH_REFUSAL, /* a refusal, with a descriptor */
  LIE_TWO_FDS,         /* two descriptors */
  LIE_OTHER_SEGMENT,   /* the reply names another segment */
  LIE_SIZE,            /* announces lie_size bytes */
  LIE_FD,              /* sends lie_fd (made by the test) */
  LIE_REFUSAL,         /* refuses with lie_status and a message */
  LIE_CLOSE,           /* closes the connection */
  LIE_UNKNOWN_STATUS,  /* a negative status that is no GMB_E_* code */
  LIE_EMPTY,           /* a message of 0 bytes, with a descriptor */
  LIE_REFUSAL_LONG,    /* a refusal whose message fills its field */
};

/* What LIE_FD sends. */
enum lie_fd { FD_NONE, FD_SHORT, FD_UNSEALED, FD_PIPE, FD_WRITE_SEALED };

#define LIE_SIZE_ZERO INT64_MIN

/* What the client must do after the lie. */
enum after {
  AFTER_WORKS, /* go on: the channel is in step, the next fetch works */
  AFTER_CONN,  /* every fetch fails with GMB_E_CONN (the channel is gone) */
  AFTER_ANY,   /* either (the client may or may not give up the channel) */
};

struct lie_case {
  const char *name;
  enum lie lie;
  enum lie_fd fd;
  int64_t size; /* LIE_SIZE: bytes more than the truth (negative: fewer;
                   LIE_SIZE_ZERO: 0 bytes) */
  int rc, rc2;  /* what the call gives: rc, or rc2 when not 0 */
  const char *why;
  enum after after;
};

static enum lie lie_now;
static uint32_t lie_op;
static uint64_t lie_size;
static int lie_fd = -1, lie_pipe[2] = {-1, -1};

static int fd_lie(struct fake *f, int conn, const struct gmb_fd_req *req) {
  if (req->op != lie_op || atomic_fetch_add(&f->step, 1) != 0) return 0;
  int auth = req->op == GMB_FD_AUTH;
  struct gmb_fd_rep rep;
  memset(&rep, 0, sizeof rep);
  rep.magic = GMB_FD_MAGIC;
  rep.op = req->op;
  rep.segment = req->segment;
  rep.size = auth ? gmb__lt_bytes(f->lt_slots) : FAKE_SEG_SIZE;
  int fds[2];
  fds[0] = fds[1] = auth ? f->lt_fd : f->seg1_fd;
  int nfd = 1;
  size_t len = sizeof rep;
  switch (lie_now) {
    case LIE_SHORT_REPLY: len = offsetof(struct gmb_fd_rep, message); break;
    case LIE_LONG_REPLY: len = sizeof rep + 64; break;
    case LIE_MAGIC: rep.magic = GMB_FD_MAGIC ^ 0x01000000; break;
    case LIE_OP: rep.op = auth ? GMB_FD_SEGMENT : GMB_FD_AUTH; break;
    case LIE_STATUS: rep.status = 5; nfd = 0; break;
    case LIE_NO_FD: nfd = 0; break;
    case LIE_FD_WITH_REFUSAL:
      rep.status = GMB_E_NOENT;
      snprintf(rep.message, sizeof rep.message, "no");
      break;
    case LIE_TWO_FDS: nfd = 2; break;
    case LIE_OTHER_SEGMENT: rep.segment = req->segment + 1; break;
    case LIE_SIZE: rep.size = lie_size; break;
    case LIE_FD: fds[0] = lie_fd; break;
    case LIE_REFUSAL:
      rep.status = auth ? GMB_E_AUTH : GMB_E_NOENT;
      snprintf(rep.message, sizeof rep.message, "%s",
               auth ? "no session with that secret"
                    : "not a segment of this tenant");
      nfd = 0;
      break;
    case LIE_CLOSE:
      fake_fdchan_drop(&f->ch, conn);
      return 1;
    case LIE_UNKNOWN_STATUS:
      rep.status = -1000;
      snprintf(rep.message, sizeof rep.message, "from a newer broker");
      nfd = 0;
      break;
    case LIE_EMPTY: len = 0; break;
    case LIE_REFUSAL_LONG:
      rep.status = auth ? GMB_E_AUTH : GMB_E_NOENT;
      memset(rep.message, 'x', sizeof rep.message); /* no NUL */
      nfd = 0;
      break;
  }
  uint8_t buf[sizeof rep + 64];
  memset(buf, 0xEE, sizeof buf);
  memcpy(buf, &rep, sizeof rep < len ? sizeof rep : len);
  fake_fdchan_send_fds(conn, buf, len, fds, nfd);
  return 1;
}

/* A memfd for LIE_FD of `bytes`, sealed with `seals`; for AUTH it begins
 * with the true lock table's header, so that only what the case changes
 * is wrong with it. */
static int lie_memfd(uint32_t op, uint64_t bytes, unsigned seals) {
  int fd = fake_memfd("gmb-lie", bytes, 0);
  if (op == GMB_FD_AUTH)
    ck_assert_int_eq(pwrite(fd, F.lt, sizeof *F.lt, 0), (ssize_t)sizeof *F.lt);
  if (seals) ck_assert_int_eq(fcntl(fd, F_ADD_SEALS, seals), 0);
  return fd;
}

/* Makes what case `lc` sends for operation `op` (whose true size is
 * `size`), and installs the lie; lie_teardown closes it. */
static void lie_setup(const struct lie_case *lc, uint32_t op, uint64_t size) {
  lie_now = lc->lie;
  lie_op = op;
  lie_size = lc->size == LIE_SIZE_ZERO ? 0 : size + (uint64_t)lc->size;
  lie_fd = -1;
  switch (lc->fd) {
    case FD_NONE: break;
    case FD_SHORT: lie_fd = lie_memfd(op, size / 2, FAKE_SEALS); break;
    case FD_UNSEALED: lie_fd = lie_memfd(op, size, 0); break;
    case FD_WRITE_SEALED:
      lie_fd = lie_memfd(op, size, FAKE_SEALS | F_SEAL_WRITE);
      break;
    case FD_PIPE:
      ck_assert_int_eq(pipe2(lie_pipe, O_CLOEXEC), 0);
      lie_fd = lie_pipe[0];
      break;
  }
  F.fd_handler = fd_lie;
}

static void lie_teardown(void) {
  if (lie_pipe[0] >= 0) {
    close(lie_pipe[0]);
    close(lie_pipe[1]);
  } else if (lie_fd >= 0) {
    close(lie_fd);
  }
  lie_fd = lie_pipe[0] = lie_pipe[1] = -1;
  teardown();
}

static const struct lie_case auth_lies[] = {
    {"short reply", LIE_SHORT_REPLY, FD_NONE, 0, GMB_E_PROTO, 0,
     "wrong size", AFTER_WORKS},
    {"long reply", LIE_LONG_REPLY, FD_NONE, 0, GMB_E_PROTO, 0,
     "descriptor channel: Protocol error", AFTER_WORKS},
    {"magic", LIE_MAGIC, FD_NONE, 0, GMB_E_PROTO, 0, "wrong magic",
     AFTER_WORKS},
    {"op", LIE_OP, FD_NONE, 0, GMB_E_PROTO, 0, "wrong operation",
     AFTER_WORKS},
    {"status", LIE_STATUS, FD_NONE, 0, GMB_E_PROTO, 0, "wrong status",
     AFTER_WORKS},
    {"no descriptor", LIE_NO_FD, FD_NONE, 0, GMB_E_PROTO, 0,
     "wrong missing descriptor", AFTER_WORKS},
    {"descriptor with refusal", LIE_FD_WITH_REFUSAL, FD_NONE, 0, GMB_E_PROTO,
     0, "wrong descriptor", AFTER_WORKS},
    {"two descriptors", LIE_TWO_FDS, FD_NONE, 0, GMB_E_PROTO, 0,
     "descriptor channel: Protocol error", AFTER_WORKS},
    {"size not of the slots", LIE_SIZE, FD_NONE, 64, GMB_E_PROTO, 0,
     "cannot hold 64 slots", AFTER_WORKS},
    {"size smaller than the slots", LIE_SIZE, FD_NONE, -64, GMB_E_PROTO, 0,
     "cannot hold 64 slots", AFTER_WORKS},
    {"size 0", LIE_SIZE, FD_NONE, LIE_SIZE_ZERO, GMB_E_PROTO, 0,
     "cannot hold 64 slots", AFTER_WORKS},
    /* More slots than the descriptor holds: SIGBUS at the last ones. */
    {"short descriptor", LIE_FD, FD_SHORT, 0, GMB_E_PROTO, 0,
     "shorter than 64 slots or not sealed", AFTER_WORKS},
    /* Could be truncated under the mapping by whoever holds it. */
    {"unsealed descriptor", LIE_FD, FD_UNSEALED, 0, GMB_E_PROTO, 0,
     "shorter than 64 slots or not sealed", AFTER_WORKS},
    {"a pipe", LIE_FD, FD_PIPE, 0, GMB_E_PROTO, 0,
     "shorter than 64 slots or not sealed", AFTER_WORKS},
    {"write-sealed descriptor", LIE_FD, FD_WRITE_SEALED, 0, GMB_E_SYSTEM, 0,
     "lock table: mmap", AFTER_WORKS},
    {"refusal", LIE_REFUSAL, FD_NONE, 0, GMB_E_AUTH, 0,
     "GMB_E_AUTH: no session with that secret", AFTER_WORKS},
    {"refusal with an unterminated message", LIE_REFUSAL_LONG, FD_NONE, 0,
     GMB_E_AUTH, 0, "GMB_E_AUTH: xxxxxxxx", AFTER_WORKS},
    {"hang-up", LIE_CLOSE, FD_NONE, 0, GMB_E_CONN, 0,
     "the broker closed the descriptor channel", AFTER_CONN},
    /* gmb.h: every function returns 0 or a GMB_E_* code; the ZeroMQ path
     * makes a status it does not know GMB_E_PROTO (wire.c). */
    {"unknown status", LIE_UNKNOWN_STATUS, FD_NONE, 0, GMB_E_PROTO, 0,
     "GMB_E_PROTO", AFTER_WORKS},
    /* recvmsg gives 0 for it, as for a hang-up; its descriptor must be
     * closed all the same. */
    {"empty message with a descriptor", LIE_EMPTY, FD_NONE, 0, GMB_E_CONN,
     GMB_E_PROTO, "descriptor channel", AFTER_ANY},
};

/* Open descriptors of this process whose file is memfd `name`: the fake
 * keeps one of each it made; more means the client kept one it was sent. */
static int count_memfds(const char *name) {
  char want[96];
  snprintf(want, sizeof want, "/memfd:%s ", name);
  DIR *d = opendir("/proc/self/fd");
  if (d == NULL) return -1;
  int n = 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    char path[300], target[256];
    snprintf(path, sizeof path, "/proc/self/fd/%s", e->d_name);
    ssize_t len = readlink(path, target, sizeof target - 1);
    if (len <= 0) continue;
    target[len] = '\0';
    if (strncmp(target, want, strlen(want)) == 0) n++;
  }
  closedir(d);
  return n;
}

/* count_memfds(name) once descriptors the client refused are closed: it
 * hands them to a closer thread (gmb__fd_discard), which may not have run
 * yet when the call returns.  Up to 2 s. */
static int count_memfds_settled(const char *name, int want) {
  int n = count_memfds(name);
  for (int i = 0; i < 200 && n != want; i++) {
    usleep(10 * 1000);
    n = count_memfds(name);
  }
  return n;
}

/* Whatever the channel answers to AUTH, a connect that cannot use it
 * fails with its reason, says Bye, and leaves nothing open. */
START_TEST(auth_reply_lie) {
  const struct lie_case *lc = &auth_lies[_i];
  lie_setup(lc, GMB_FD_AUTH, gmb__lt_bytes(FAKE_LT_SLOTS));
  fake_start();
  int before = check_count_fds();
  gmb_client *c = (gmb_client *)&c;
  int rc = gmb_connect(F.endpoint, "team-a", &c);
  ck_assert_msg(rc == lc->rc || (lc->rc2 && rc == lc->rc2),
                "%s: connect gave %d: %s", lc->name, rc,
                gmb_last_error(NULL));
  ck_assert_ptr_null(c);
  ck_assert_msg(strstr(gmb_last_error(NULL), lc->why), "%s: \"%s\" lacks "
                "\"%s\"", lc->name, gmb_last_error(NULL), lc->why);
  ck_assert_int_eq(atomic_load(&F.n_bye), 1);
  ck_assert_msg(count_memfds_settled("gmb-check-client-lt", 1) == 1,
                "%s: the client kept the lock table's descriptor", lc->name);
  while (FAKE_FDCHAN_COUNT(&F.ch, closed) < 1) usleep(1000);
  if (lc->lie != LIE_CLOSE) /* the client hung up */
    ck_assert_int_eq(FAKE_FDCHAN_COUNT(&F.ch, hangups), 1);
  ck_assert_msg(fds_settle(before) == before, "%s: %d descriptors open, "
                "%d before", lc->name, check_count_fds(), before);
  /* The next connect is answered truly, and works. */
  c = connect_ok();
  gmb_id id;
  void *p;
  ck_assert_int_eq(gmb_alloc(c, 512, GMB_MOVABLE, &id), 0);
  ck_assert_int_eq(gmb_lock(c, id, &p), 0);
  ck_assert_uint_eq(atomic_load(&lt_slot_of(&F, id)->state), 1);
  ck_assert_int_eq(gmb_unlock(c, id), 0);
  gmb_disconnect(c);
}
END_TEST

static const struct lie_case segment_lies[] = {
    {"short reply", LIE_SHORT_REPLY, FD_NONE, 0, GMB_E_PROTO, 0,
     "wrong size", AFTER_WORKS},
    {"long reply", LIE_LONG_REPLY, FD_NONE, 0, GMB_E_PROTO, 0,
     "descriptor channel: Protocol error", AFTER_WORKS},
    {"magic", LIE_MAGIC, FD_NONE, 0, GMB_E_PROTO, 0, "wrong magic",
     AFTER_WORKS},
    {"op", LIE_OP, FD_NONE, 0, GMB_E_PROTO, 0, "wrong operation",
     AFTER_WORKS},
    {"status", LIE_STATUS, FD_NONE, 0, GMB_E_PROTO, 0, "wrong status",
     AFTER_WORKS},
    {"no descriptor", LIE_NO_FD, FD_NONE, 0, GMB_E_PROTO, 0,
     "wrong missing descriptor", AFTER_WORKS},
    {"descriptor with refusal", LIE_FD_WITH_REFUSAL, FD_NONE, 0, GMB_E_PROTO,
     0, "wrong descriptor", AFTER_WORKS},
    {"two descriptors", LIE_TWO_FDS, FD_NONE, 0, GMB_E_PROTO, 0,
     "descriptor channel: Protocol error", AFTER_WORKS},
    {"another segment", LIE_OTHER_SEGMENT, FD_NONE, 0, GMB_E_PROTO, 0,
     "asked for segment 1's descriptor, got 2's", AFTER_WORKS},
    /* Claims more than the descriptor holds: mapping it would SIGBUS. */
    {"size larger than the descriptor", LIE_SIZE, FD_NONE, FAKE_SEG_SIZE,
     GMB_E_PROTO, 0, "holds fewer than 8388608 bytes", AFTER_WORKS},
    {"size 0", LIE_SIZE, FD_NONE, LIE_SIZE_ZERO, GMB_E_PROTO, 0,
     "empty or impossible", AFTER_WORKS},
    {"short descriptor", LIE_FD, FD_SHORT, 0, GMB_E_PROTO, 0,
     "holds fewer than 4194304 bytes", AFTER_WORKS},
    /* Could be truncated under the mapping by whoever holds it. */
    {"unsealed descriptor", LIE_FD, FD_UNSEALED, 0, GMB_E_PROTO, 0,
     "not sealed against shrinking", AFTER_WORKS},
    {"a pipe", LIE_FD, FD_PIPE, 0, GMB_E_PROTO, 0,
     "segment 1: its descriptor", AFTER_WORKS},
    {"write-sealed descriptor", LIE_FD, FD_WRITE_SEALED, 0, GMB_E_SYSTEM, 0,
     "segment 1: mmap", AFTER_WORKS},
    {"refusal", LIE_REFUSAL, FD_NONE, 0, GMB_E_NOENT, 0,
     "GMB_E_NOENT: not a segment of this tenant", AFTER_WORKS},
    {"refusal with an unterminated message", LIE_REFUSAL_LONG, FD_NONE, 0,
     GMB_E_NOENT, 0, "GMB_E_NOENT: xxxxxxxx", AFTER_WORKS},
    /* Every later fetch fails too, and no SIGPIPE kills the process. */
    {"hang-up", LIE_CLOSE, FD_NONE, 0, GMB_E_CONN, 0,
     "the broker closed the descriptor channel", AFTER_CONN},
    /* gmb.h: every function returns 0 or a GMB_E_* code; the ZeroMQ path
     * makes a status it does not know GMB_E_PROTO (wire.c). */
    {"unknown status", LIE_UNKNOWN_STATUS, FD_NONE, 0, GMB_E_PROTO, 0,
     "GMB_E_PROTO", AFTER_WORKS},
    /* recvmsg gives 0 for it, as for a hang-up; its descriptor must be
     * closed all the same. */
    {"empty message with a descriptor", LIE_EMPTY, FD_NONE, 0, GMB_E_CONN,
     GMB_E_PROTO, "descriptor channel", AFTER_ANY},
};

/* Whatever the channel answers to SEGMENT, the allocation fails with its
 * reason and is given back, whatever was sent is closed, and the client
 * goes on as lc->after says. */
START_TEST(segment_reply_lie) {
  const struct lie_case *lc = &segment_lies[_i];
  lie_setup(lc, GMB_FD_SEGMENT, FAKE_SEG_SIZE);
  fake_start();
  gmb_client *c = connect_ok();
  int before = check_count_fds();
  gmb_id id = 77;
  int rc = gmb_alloc(c, 512, 0, &id);
  ck_assert_msg(rc == lc->rc || (lc->rc2 && rc == lc->rc2),
                "%s: alloc gave %d: %s", lc->name, rc, gmb_last_error(c));
  ck_assert_uint_eq(id, 0);
  ck_assert_msg(strstr(gmb_last_error(c), lc->why), "%s: \"%s\" lacks \"%s\"",
                lc->name, gmb_last_error(c), lc->why);
  ck_assert_int_eq(atomic_load(&F.n_free), 1); /* given back */
  ck_assert_uint_eq(F.last_free.u.free.id, 1);
  /* Descriptors a message should not have carried are closed by the
   * library's closer thread (proto/fdpass.c): soon, not necessarily by
   * now. */
  int seg1 = count_memfds_settled("gmb-check-client-seg1", 1);
  ck_assert_msg(seg1 == 1, "%s: the client kept a descriptor it was sent",
                lc->name);
  if (lc->after == AFTER_WORKS)
    ck_assert_msg(fds_settle(before) == before,
                  "%s: %d descriptors open, %d before", lc->name,
                  check_count_fds(), before);
  if (lc->after == AFTER_CONN) /* both ends are closed */
    ck_assert_int_eq(fds_settle(before - 2), before - 2);
  for (int i = 0; i < 2; i++) {
    rc = gmb_alloc(c, 512, 0, &id);
    if (lc->after == AFTER_CONN || (lc->after == AFTER_ANY && rc != 0)) {
      ck_assert_msg(rc == GMB_E_CONN, "%s: then alloc gave %d: %s", lc->name,
                    rc, gmb_last_error(c));
      continue;
    }
    ck_assert_msg(rc == 0, "%s: then alloc gave %d: %s", lc->name, rc,
                  gmb_last_error(c));
    void *p;
    ck_assert_int_eq(gmb_lock(c, id, &p), 0);
    memset(p, 0x6B, 512);
    ck_assert_uint_eq(F.seg1[F.offsets[id] + 511], 0x6B);
    ck_assert_int_eq(gmb_unlock(c, id), 0);
  }
  if (lc->after == AFTER_WORKS) ck_assert_int_eq(check_count_fds(), before);
  if (lc->after == AFTER_CONN) ck_assert_int_eq(check_count_fds(), before - 2);
  ck_assert_int_eq(count_memfds("gmb-check-client-seg1"), 1);
  gmb_disconnect(c);
}
END_TEST

/* The first SEGMENT request is held, unanswered, without blocking the
 * fake (which goes on serving the ZeroMQ side); the test sends its answer
 * once the client gave up on it. */
static struct {
  struct fake *f;
  int conn;
  struct gmb_fd_req req;
  atomic_int held;
} late;

static int fd_late_segment(struct fake *f, int conn,
                           const struct gmb_fd_req *req) {
  if (req->op != GMB_FD_SEGMENT || atomic_fetch_add(&f->step, 1) != 0)
    return 0;
  late.f = f;
  late.conn = conn;
  late.req = *req;
  atomic_store(&late.held, 1);
  return 1;
}

/* A fetch that timed out must not leave its late answer to be taken for
 * the answer to the next one. */
START_TEST(late_segment_reply_not_taken_for_next) {
  /* The channel's requests wait as long as the socket's (long enough for
   * the fake's ZeroMQ answers on a loaded machine; the held one never
   * comes in time). */
  setenv("GMB_REQUEST_TIMEOUT_MS", "1000", 1);
  atomic_store(&late.held, 0);
  seg2_setup();
  F.fd_handler = fd_late_segment;
  fake_start();
  gmb_client *c = connect_ok();
  gmb_id a = 77, b;
  ck_assert_int_eq(gmb_alloc(c, 512, GMB_MOVABLE, &a), GMB_E_TIMEOUT);
  /* Now the late answer comes. */
  ck_assert_int_eq(atomic_load(&late.held), 1);
  fake_fd_default(late.f, late.conn, &late.req);
  ck_assert_ptr_nonnull(strstr(gmb_last_error(c), "no answer in time"));
  ck_assert_int_eq(atomic_load(&F.n_free), 1);
  /* Whatever the client makes of the late reply, a later fetch must get
   * what it asked for, or fail for good with GMB_E_CONN. */
  int rc = gmb_alloc(c, 512, GMB_MOVABLE, &b);
  ck_assert_msg(rc == 0 || rc == GMB_E_CONN, "alloc gave %d: %s", rc,
                gmb_last_error(c));
  if (rc == 0) {
    ck_assert(mv_claim(b));
    memset(F.seg2 + 8192, 0x2C, 512);
    mv_publish(b, 2, 8192);
    void *p;
    rc = gmb_lock(c, b, &p);
    ck_assert_msg(rc == 0 || rc == GMB_E_CONN, "lock gave %d: %s", rc,
                  gmb_last_error(c));
    if (rc == 0) {
      ck_assert_uint_eq(((uint8_t *)p)[511], 0x2C);
      ck_assert_int_eq(gmb_unlock(c, b), 0);
    }
  }
  gmb_disconnect(c);
}
END_TEST

#define LIES_OF(t) ((int)(sizeof(t) / sizeof((t)[0])))

static Suite *client_suite(void) {
  Suite *s = suite_create("client");
  TCase *tc = tcase_create("connect");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_add_test(tc, connect_missing_socket);
  tcase_add_test(tc, connect_stale_socket);
  tcase_add_test(tc, connect_null_out_invalid);
  tcase_add_test(tc, connect_bad_tenant_invalid);
  tcase_add_test(tc, hello_refused_auth);
  tcase_add_test(tc, hello_other_version_proto);
  tcase_add_test(tc, hello_carries_env_tenant_token_file_pid);
  tcase_add_test(tc, hello_token_env_wins_over_file);
  tcase_add_test(tc, last_error_is_per_thread);
  suite_add_tcase(s, tc);

  tc = tcase_create("replies");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_add_test(tc, garbage_reply_proto_then_recovers);
  tcase_add_test(tc, wrong_body_kind_proto);
  tcase_add_test(tc, stale_reply_ids_ignored);
  tcase_add_test(tc, silent_broker_times_out);
  tcase_add_test(tc, shutdown_event_kills_client);
  tcase_add_test(tc, session_ended_event_kills_client);
  tcase_add_test(tc, shutdown_between_calls_reported_at_once);
  tcase_add_test(tc, broker_gone_while_waiting_forever);
  tcase_add_test(tc, alloc_wait_extends_reply_deadline);
  tcase_add_test(tc, heartbeats_sent_when_asked);
  tcase_add_test(tc, heartbeats_continue_during_long_wait);
  tcase_add_test(tc, wait_reply_handed_over_by_another_call);
  tcase_add_test(tc, no_heartbeats_when_not_asked);
  tcase_add_test(tc, trim_event_answered_by_idle_client);
  suite_add_tcase(s, tc);

  tc = tcase_create("alloc");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_add_test(tc, alloc_outside_segment_proto);
  tcase_add_test(tc, alloc_smaller_than_asked_proto);
  tcase_add_test(tc, alloc_impossible_tail_proto);
  tcase_add_test(tc, pages_descriptors_in_one_exchange);
  tcase_add_test(tc, alloc_in_segment_refused_on_channel);
  tcase_add_test(tc, alloc_maps_segment_and_lock_points_into_it);
  tcase_add_test(tc, fetched_descriptors_are_closed);
  tcase_add_test(tc, free_noent_passes_through);
  tcase_add_test(tc, alloc_refusal_passes_through);
  tcase_add_test(tc, alloc_bad_arguments_invalid);
  tcase_add_test(tc, unlock_on_stream_host_device);
  tcase_add_test(tc, cuda_device_without_driver_refused);
  tcase_add_test(tc, cuda_device_without_uuid_refused);
  tcase_add_test(tc, threads_share_client);
  suite_add_tcase(s, tc);

  tc = tcase_create("movable");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_add_test(tc, movable_lock_sends_no_message);
  tcase_add_test(tc, unlock_not_locked_invalid);
  tcase_add_test(tc, lock_waits_while_moving_then_new_position);
  tcase_add_test(tc, lock_mid_move_sleeps_until_woken);
  tcase_add_test(tc, lock_moving_too_long_times_out);
  tcase_add_test(tc, lock_mid_offload_asks_the_broker);
  tcase_add_test(tc, moved_to_unmapped_segment_fetched_once);
  tcase_add_test(tc, alloc_slot_of_another_allocation_proto);
  tcase_add_test(tc, alloc_slot_out_of_range_proto);
  tcase_add_test(tc, lock_table_bad_magic_proto);
  tcase_add_test(tc, lock_table_other_session_proto);
  tcase_add_test(tc, movable_threads_lock_while_moving);
  suite_add_tcase(s, tc);

  tc = tcase_create("channel");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_add_test(tc, connect_proves_session_on_channel);
  tcase_add_test(tc, disconnect_hangs_up_channel);
  tcase_add_test(tc, hello_without_secret_proto);
  tcase_add_test(tc, hello_short_secret_proto);
  tcase_add_test(tc, hello_zero_lock_slots_proto);
  tcase_add_test(tc, channel_missing_fails_connect);
  tcase_add_test(tc, channel_needs_ipc_endpoint);
  tcase_add_test(tc, channel_silent_auth_times_out);
  tcase_add_test(tc, channel_wrong_secret_refused);
  tcase_add_test(tc, late_segment_reply_not_taken_for_next);
  suite_add_tcase(s, tc);

  tc = tcase_create("channel lies");
  tcase_add_checked_fixture(tc, setup, lie_teardown);
  tcase_add_loop_test(tc, auth_reply_lie, 0, LIES_OF(auth_lies));
  tcase_add_loop_test(tc, segment_reply_lie, 0, LIES_OF(segment_lies));
  suite_add_tcase(s, tc);
  return s;
}

int main(void) {
  SRunner *sr = srunner_create(client_suite());
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? 1 : 0;
}
