/*
 * check_client.c - the client library against a fake broker.
 *
 * The fake is a ROUTER socket in a thread of the test, bound in a fresh
 * temporary directory and driven by hand with the wire codec: by default it
 * answers like a well-behaved broker on the host device (one shm segment
 * the test creates, handed out bump by bump), and each test replaces the
 * answer to the requests it cares about with garbage, silence, events or
 * lies.  What needs a real broker is in tests/integration.
 *
 * For movable allocations the test plays the broker's side of the lock
 * table too: lt_setup() creates a table and the fake names it in its Hello
 * reply and hands out slot id-1 for each movable allocation; the test then
 * claims, moves and publishes by hand (the "mover"), as compaction does.
 *
 * Knobs: ITER (allocations per thread in threads_share_client, default 200;
 * lock/unlock pairs per thread in movable_threads_lock_while_moving).
 */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>
#include <zmq.h>

#include "fake_router.h"
#include "gmb.h"
#include "locktab_layout.h"
#include "wire.h"

#define FAKE_SEG_SIZE (4u << 20)
#define FAKE_MAX_IDS 8192

struct fake;
/* Returns 1 when it answered (or chose silence), 0 for the default. */
typedef int (*fake_handler)(struct fake *f, const struct wire_request *req);

struct fake {
  char dir[64];
  char endpoint[128];
  void *ctx;
  void *_Atomic router; /* NULL once the fake closed it */
  pthread_t thread;
  atomic_int stop;
  atomic_int close_now; /* the thread closes its socket and exits */
  fake_handler handler;
  uint8_t peer[256];
  size_t peer_len;

  /* the default answers */
  char device[WIRE_DEVICE_MAX];
  uint32_t heartbeat_ms;
  char shm_name[64]; /* segment 1 */
  uint8_t *shm;      /* the test's own mapping of it */
  uint64_t next_offset, next_id;
  int handle_sent;
  uint64_t offsets[FAKE_MAX_IDS];

  /* the lock table (lt_setup); lt_name "" for none */
  char lt_name[64];
  uint32_t lt_slots;
  struct gmb__lt_header *lt;
  /* segment 2 (seg2_setup): a second shm, given only on a Segment request */
  char shm2_name[64];
  uint8_t *shm2;

  /* what it saw */
  atomic_int n_total; /* every message */
  atomic_int n_hello, n_alloc, n_free, n_stats, n_segment, n_heartbeat, n_bye;
  struct wire_request last_hello, last_alloc, last_free;
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

static void fake_handle_of(struct fake *f, struct wire_handle *h) {
  h->segment = 1;
  h->size = FAKE_SEG_SIZE;
  h->len = (uint32_t)strlen(f->shm_name);
  memcpy(h->bytes, f->shm_name, h->len);
}

static void fake_handle2_of(struct fake *f, struct wire_handle *h) {
  h->segment = 2;
  h->size = FAKE_SEG_SIZE;
  h->len = (uint32_t)strlen(f->shm2_name);
  memcpy(h->bytes, f->shm2_name, h->len);
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
      rep.u.hello.session = 1;
      snprintf(rep.u.hello.tenant, sizeof rep.u.hello.tenant, "%s",
               req->u.hello.tenant[0] ? req->u.hello.tenant : "uid-1000");
      snprintf(rep.u.hello.device, sizeof rep.u.hello.device, "%s",
               f->device);
      rep.u.hello.heartbeat_ms = f->heartbeat_ms;
      snprintf(rep.u.hello.lock_table, sizeof rep.u.hello.lock_table, "%s",
               f->lt_name);
      rep.u.hello.lock_slots = f->lt_name[0] ? f->lt_slots : 0;
      fake_reply(f, &rep);
      break;
    case WIRE_ALLOC: {
      uint64_t size = (req->u.alloc.size + 511) & ~(uint64_t)511;
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
      if (!f->handle_sent) {
        fake_handle_of(f, &rep.u.alloc.handle);
        f->handle_sent = 1;
      }
      if ((req->u.alloc.flags & GMB_MOVABLE) && f->lt &&
          rep.u.alloc.id <= f->lt_slots) {
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
    case WIRE_SEGMENT:
      if (req->u.segment.segment == 2 && f->shm2) {
        rep.kind = WIRE_SEGMENT;
        fake_handle2_of(f, &rep.u.segment);
        fake_reply(f, &rep);
        break;
      }
      if (req->u.segment.segment != 1) {
        fake_status(f, req->id, GMB_E_NOENT, "no such segment");
        break;
      }
      rep.kind = WIRE_SEGMENT;
      fake_handle_of(f, &rep.u.segment);
      fake_reply(f, &rep);
      break;
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

static void *fake_main(void *arg) {
  struct fake *f = arg;
  while (!atomic_load(&f->stop)) {
    if (atomic_load(&f->close_now)) {
      /* Linger, so that what was sent just before goes out first. */
      int linger = 2000;
      zmq_setsockopt(f->router, ZMQ_LINGER, &linger, sizeof linger);
      zmq_close(f->router);
      f->router = NULL;
      return NULL;
    }
    struct wire_request req;
    if (!fake_router_recv(f->router, f->peer, sizeof f->peer, &f->peer_len,
                          &req))
      continue;
    atomic_fetch_add(&f->n_total, 1);
    switch (req.kind) {
      case WIRE_HELLO: f->last_hello = req; atomic_fetch_add(&f->n_hello, 1); break;
      case WIRE_ALLOC: f->last_alloc = req; atomic_fetch_add(&f->n_alloc, 1); break;
      case WIRE_FREE: f->last_free = req; atomic_fetch_add(&f->n_free, 1); break;
      case WIRE_STATS: atomic_fetch_add(&f->n_stats, 1); break;
      case WIRE_SEGMENT: atomic_fetch_add(&f->n_segment, 1); break;
      case WIRE_HEARTBEAT: atomic_fetch_add(&f->n_heartbeat, 1); break;
      case WIRE_BYE: atomic_fetch_add(&f->n_bye, 1); break;
      default: break;
    }
    if (f->handler && f->handler(f, &req)) continue;
    fake_default(f, &req);
  }
  return NULL;
}

static void setup(void) {
  memset(&F, 0, sizeof F);
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
  snprintf(F.shm_name, sizeof F.shm_name, "/gmb-check-client-%d",
           (int)getpid());
  shm_unlink(F.shm_name);
  int fd = shm_open(F.shm_name, O_RDWR | O_CREAT | O_EXCL, 0600);
  ck_assert_int_ge(fd, 0);
  ck_assert_int_eq(ftruncate(fd, FAKE_SEG_SIZE), 0);
  F.shm = mmap(NULL, FAKE_SEG_SIZE, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ck_assert_ptr_ne(F.shm, MAP_FAILED);
  close(fd);
}

/* Starts the fake; a test sets F's fields and handler first. */
static void fake_start(void) {
  F.router = fake_router_open(&F.ctx, F.endpoint);
  ck_assert_int_eq(pthread_create(&F.thread, NULL, fake_main, &F), 0);
}

static void teardown(void) {
  if (F.ctx) {
    atomic_store(&F.stop, 1);
    pthread_join(F.thread, NULL);
    if (F.router) zmq_close(F.router);
    zmq_ctx_term(F.ctx);
  }
  munmap(F.shm, FAKE_SEG_SIZE);
  shm_unlink(F.shm_name);
  if (F.lt) munmap(F.lt, gmb__lt_bytes(F.lt_slots));
  if (F.lt_name[0]) shm_unlink(F.lt_name);
  if (F.shm2) munmap(F.shm2, FAKE_SEG_SIZE);
  if (F.shm2_name[0]) shm_unlink(F.shm2_name);
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
  fake_handle_of(f, &rep.u.alloc.handle);
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
  ck_assert_ptr_nonnull(strstr(gmb_last_error(c), "does not fit"));
  /* The allocation it could not use was given back. */
  ck_assert_int_eq(atomic_load(&F.n_free), 1);
  ck_assert_uint_eq(F.last_free.u.free.id, 9);
  void *p;
  ck_assert_int_eq(gmb_lock(c, 9, &p), GMB_E_NOENT);
  gmb_disconnect(c);
}
END_TEST

static int alloc_short(struct fake *f, const struct wire_request *req) {
  if (req->kind != WIRE_ALLOC) return 0;
  struct wire_reply rep = {.id = req->id, .kind = WIRE_ALLOC};
  rep.u.alloc.id = 3;
  rep.u.alloc.size = 512; /* less than asked */
  rep.u.alloc.segment = 1;
  fake_handle_of(f, &rep.u.alloc.handle);
  fake_reply(f, &rep);
  return 1;
}

START_TEST(alloc_smaller_than_asked_proto) {
  F.handler = alloc_short;
  fake_start();
  gmb_client *c = connect_ok();
  gmb_id id;
  ck_assert_int_eq(gmb_alloc(c, 4096, 0, &id), GMB_E_PROTO);
  gmb_disconnect(c);
}
END_TEST

static int alloc_bad_handle(struct fake *f, const struct wire_request *req) {
  if (req->kind != WIRE_ALLOC) return 0;
  struct wire_reply rep = {.id = req->id, .kind = WIRE_ALLOC};
  rep.u.alloc.id = 4;
  rep.u.alloc.size = 512;
  rep.u.alloc.segment = 1;
  fake_handle_of(f, &rep.u.alloc.handle);
  /* Claims more than the shm object holds: mapping it would SIGBUS. */
  rep.u.alloc.handle.size = 2 * FAKE_SEG_SIZE;
  fake_reply(f, &rep);
  return 1;
}

START_TEST(alloc_handle_larger_than_shm_proto) {
  F.handler = alloc_bad_handle;
  fake_start();
  gmb_client *c = connect_ok();
  gmb_id id;
  ck_assert_int_eq(gmb_alloc(c, 512, 0, &id), GMB_E_PROTO);
  ck_assert_ptr_nonnull(strstr(gmb_last_error(c), "smaller than"));
  gmb_disconnect(c);
}
END_TEST

static int retire_on_stats(struct fake *f, const struct wire_request *req) {
  if (req->kind != WIRE_STATS) return 0;
  fake_event(f, WIRE_EVENT_SEGMENT_RETIRED, 1, "");
  fake_default(f, req);
  return 1;
}

START_TEST(alloc_maps_shm_and_lock_points_into_it) {
  F.handler = retire_on_stats;
  fake_start();
  gmb_client *c = connect_ok();
  gmb_id a, b;
  ck_assert_int_eq(gmb_alloc(c, 1000, 0, &a), 0); /* carries the handle */
  ck_assert_int_eq(gmb_alloc(c, 512, GMB_MOVABLE, &b), 0); /* no handle */
  ck_assert_int_eq(atomic_load(&F.n_segment), 0); /* the mapping was cached */
  void *pa, *pb;
  ck_assert_int_eq(gmb_lock(c, a, &pa), 0);
  ck_assert_int_eq(gmb_lock(c, b, &pb), 0);
  ck_assert_uint_eq((uintptr_t)pb - (uintptr_t)pa,
                    F.offsets[b] - F.offsets[a]);
  /* Bytes written by the client are in the test's own mapping. */
  memset(pa, 0xA5, 1000);
  memset(pb, 0x5A, 512);
  for (int i = 0; i < 1000; i++) ck_assert_uint_eq(F.shm[F.offsets[a] + i], 0xA5);
  for (int i = 0; i < 512; i++) ck_assert_uint_eq(F.shm[F.offsets[b] + i], 0x5A);
  /* ... and the other way round. */
  F.shm[F.offsets[b] + 7] = 0x11;
  ck_assert_uint_eq(((uint8_t *)pb)[7], 0x11);
  ck_assert_int_eq(gmb_unlock(c, a), 0);
  ck_assert_int_eq(gmb_unlock(c, b), 0);

  /* The broker retires the segment: the next lock maps it again. */
  gmb_stats st;
  ck_assert_int_eq(gmb_tenant_stats(c, &st), 0);
  ck_assert_int_eq(gmb_lock(c, b, &pb), 0);
  ck_assert_int_eq(atomic_load(&F.n_segment), 1);
  ck_assert_uint_eq(((uint8_t *)pb)[7], 0x11);

  /* Retired again: an alloc in it without a handle asks for the segment. */
  ck_assert_int_eq(gmb_tenant_stats(c, &st), 0);
  gmb_id d;
  ck_assert_int_eq(gmb_alloc(c, 512, 0, &d), 0);
  ck_assert_int_eq(atomic_load(&F.n_segment), 2);

  ck_assert_int_eq(gmb_free(c, a), 0);
  ck_assert_uint_eq(F.last_free.u.free.id, a);
  ck_assert_int_eq(gmb_lock(c, a, &pa), GMB_E_NOENT);
  ck_assert_int_eq(gmb_unlock(c, a), GMB_E_NOENT);
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
  ck_assert_int_eq(gmb_alloc(c, 512, 0x2, &id), GMB_E_INVAL);
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

START_TEST(no_heartbeats_when_not_asked) {
  fake_start();
  gmb_client *c = connect_ok();
  gmb_stats st;
  for (int i = 0; i < 5; i++) ck_assert_int_eq(gmb_tenant_stats(c, &st), 0);
  gmb_disconnect(c);
  ck_assert_int_eq(atomic_load(&F.n_heartbeat), 0);
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
    if (gmb_alloc(w->c, 512, 0, &w->ids[i]) != 0 ||
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
      ck_assert_uint_eq(F.shm[F.offsets[id]], want);
      ck_assert_uint_eq(F.shm[F.offsets[id] + 511], want);
      ck_assert_uint_eq(((uint8_t *)p)[100], want);
    }
    free(w[i].ids);
  }
  gmb_disconnect(c);
}
END_TEST

/* --- movable allocations and the lock table ---------------------------------- */

/* Creates the lock table the fake's Hello names, for session 1. */
static void lt_setup(uint32_t slots) {
  snprintf(F.lt_name, sizeof F.lt_name, "/gmb-check-client-lt-%d",
           (int)getpid());
  shm_unlink(F.lt_name);
  int fd = shm_open(F.lt_name, O_RDWR | O_CREAT | O_EXCL, 0600);
  ck_assert_int_ge(fd, 0);
  ck_assert_int_eq(ftruncate(fd, (off_t)gmb__lt_bytes(slots)), 0);
  F.lt = mmap(NULL, gmb__lt_bytes(slots), PROT_READ | PROT_WRITE, MAP_SHARED,
              fd, 0);
  ck_assert_ptr_ne(F.lt, MAP_FAILED);
  close(fd);
  F.lt_slots = slots;
  F.lt->magic = GMB_LT_MAGIC;
  F.lt->version = GMB_LT_VERSION;
  F.lt->slots = slots;
  F.lt->session = 1;
}

/* A second segment, handed out on a Segment request for segment 2. */
static void seg2_setup(void) {
  snprintf(F.shm2_name, sizeof F.shm2_name, "/gmb-check-client-2-%d",
           (int)getpid());
  shm_unlink(F.shm2_name);
  int fd = shm_open(F.shm2_name, O_RDWR | O_CREAT | O_EXCL, 0600);
  ck_assert_int_ge(fd, 0);
  ck_assert_int_eq(ftruncate(fd, FAKE_SEG_SIZE), 0);
  F.shm2 = mmap(NULL, FAKE_SEG_SIZE, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ck_assert_ptr_ne(F.shm2, MAP_FAILED);
  close(fd);
}

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
  lt_setup(64);
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
  ck_assert_uint_eq(F.shm[F.offsets[id] + 4095], 0x3C);
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

START_TEST(heartbeat_after_hello_with_lock_table) {
  lt_setup(64);
  fake_start();
  gmb_client *c = connect_ok();
  gmb_stats st;
  /* No heartbeat period was asked for; the one heartbeat is what lets the
   * broker unlink the table's name at once. */
  ck_assert_int_eq(gmb_tenant_stats(c, &st), 0);
  ck_assert_int_eq(atomic_load(&F.n_heartbeat), 1);
  gmb_disconnect(c);
}
END_TEST

START_TEST(unlock_not_locked_invalid) {
  lt_setup(64);
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
  lt_setup(64);
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
  memcpy(F.shm + to, F.shm + from, 1024);
  memset(F.shm + from, 0xEE, 1024);
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

START_TEST(lock_moving_too_long_times_out) {
  setenv("GMB_LOCK_TIMEOUT_MS", "50", 1);
  lt_setup(64);
  fake_start();
  gmb_client *c = connect_ok();
  gmb_id id;
  ck_assert_int_eq(gmb_alloc(c, 512, GMB_MOVABLE, &id), 0);
  ck_assert(mv_claim(id));
  void *p;
  ck_assert_int_eq(gmb_lock(c, id, &p), GMB_E_TIMEOUT);
  ck_assert_ptr_nonnull(strstr(gmb_last_error(c), "being moved"));
  ck_assert_uint_eq(lt_state(id), GMB_LT_MOVING); /* untouched */
  mv_publish(id, 1, F.offsets[id]);
  ck_assert_int_eq(gmb_lock(c, id, &p), 0);
  ck_assert_int_eq(gmb_unlock(c, id), 0);
  gmb_disconnect(c);
  unsetenv("GMB_LOCK_TIMEOUT_MS");
}
END_TEST

START_TEST(moved_to_unmapped_segment_fetched_once) {
  lt_setup(64);
  seg2_setup();
  fake_start();
  gmb_client *c = connect_ok();
  gmb_id id;
  ck_assert_int_eq(gmb_alloc(c, 512, GMB_MOVABLE, &id), 0);
  ck_assert(mv_claim(id));
  memset(F.shm2 + 4096, 0x42, 512);
  mv_publish(id, 2, 4096);
  void *p, *q;
  ck_assert_int_eq(gmb_lock(c, id, &p), 0);
  ck_assert_int_eq(atomic_load(&F.n_segment), 1);
  ck_assert_uint_eq(((uint8_t *)p)[511], 0x42);
  ((uint8_t *)p)[0] = 0x43;
  ck_assert_uint_eq(F.shm2[4096], 0x43);
  ck_assert_int_eq(gmb_unlock(c, id), 0);
  ck_assert_int_eq(gmb_lock(c, id, &q), 0);
  ck_assert_ptr_eq(p, q);
  ck_assert_int_eq(atomic_load(&F.n_segment), 1); /* mapped once */
  ck_assert_int_eq(gmb_unlock(c, id), 0);
  /* A segment the broker cannot give: the hold taken is given back. */
  ck_assert(mv_claim(id));
  mv_publish(id, 3, 0);
  ck_assert_int_eq(gmb_lock(c, id, &p), GMB_E_NOENT);
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
  lt_setup(64);
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
  fake_handle_of(f, &rep.u.alloc.handle);
  fake_reply(f, &rep);
  return 1;
}

START_TEST(alloc_slot_out_of_range_proto) {
  lt_setup(64);
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
  lt_setup(64);
  F.lt->magic ^= 1;
  fake_start();
  gmb_client *c = (gmb_client *)1;
  ck_assert_int_eq(gmb_connect(F.endpoint, "team-a", &c), GMB_E_PROTO);
  ck_assert_ptr_null(c);
  ck_assert_ptr_nonnull(strstr(gmb_last_error(NULL), "magic"));
  ck_assert_int_eq(atomic_load(&F.n_bye), 1); /* disconnected cleanly */
}
END_TEST

START_TEST(lock_table_other_session_proto) {
  lt_setup(64);
  F.lt->session = 2;
  fake_start();
  gmb_client *c = NULL;
  ck_assert_int_eq(gmb_connect(F.endpoint, "team-a", &c), GMB_E_PROTO);
  ck_assert_ptr_nonnull(strstr(gmb_last_error(NULL), "session"));
  F.lt->session = 1;
  F.lt->slots = 32; /* the header disagrees with the Hello reply */
  ck_assert_int_eq(gmb_connect(F.endpoint, "team-a", &c), GMB_E_PROTO);
  ck_assert_ptr_nonnull(strstr(gmb_last_error(NULL), "slot count"));
  F.lt->slots = 64;
  F.lt_slots = 1u << 20; /* more slots than the object holds */
  ck_assert_int_eq(gmb_connect(F.endpoint, "team-a", &c), GMB_E_PROTO);
  ck_assert_ptr_nonnull(strstr(gmb_last_error(NULL), "smaller"));
  F.lt_slots = 64;
}
END_TEST

START_TEST(lock_table_missing_fails_connect) {
  lt_setup(64);
  shm_unlink(F.lt_name);
  fake_start();
  gmb_client *c = NULL;
  ck_assert_int_eq(gmb_connect(F.endpoint, "team-a", &c), GMB_E_SYSTEM);
  ck_assert_ptr_nonnull(strstr(gmb_last_error(NULL), "shm_open"));
  snprintf(F.lt_name, sizeof F.lt_name, "no-slash");
  ck_assert_int_eq(gmb_connect(F.endpoint, "team-a", &c), GMB_E_PROTO);
  F.lt_name[0] = '\0';
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
    memcpy(F.shm + to, F.shm + from, MV_SIZE);
    memset(F.shm + from, 0xEE, MV_SIZE);
    mv_publish(ids[k], 1, to);
    atomic_fetch_add(&mv_moves, 1);
    sched_yield();
  }
  return NULL;
}

START_TEST(movable_threads_lock_while_moving) {
  int iter = getenv("ITER") ? atoi(getenv("ITER")) : 20000;
  enum { NT = 4 };
  lt_setup(64);
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

START_TEST(movable_without_lock_table_is_pinned) {
  fake_start(); /* a Hello without a lock table */
  gmb_client *c = connect_ok();
  gmb_id id;
  ck_assert_int_eq(gmb_alloc(c, 512, GMB_MOVABLE, &id), 0);
  void *p;
  ck_assert_int_eq(gmb_lock(c, id, &p), 0);
  ck_assert_uint_eq((uintptr_t)p % 512, 0);
  ck_assert_int_eq(gmb_unlock(c, id), 0);
  ck_assert_int_eq(gmb_unlock(c, id), 0); /* nothing counted */
  gmb_disconnect(c);
}
END_TEST

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
  tcase_add_test(tc, no_heartbeats_when_not_asked);
  suite_add_tcase(s, tc);

  tc = tcase_create("alloc");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_add_test(tc, alloc_outside_segment_proto);
  tcase_add_test(tc, alloc_smaller_than_asked_proto);
  tcase_add_test(tc, alloc_handle_larger_than_shm_proto);
  tcase_add_test(tc, alloc_maps_shm_and_lock_points_into_it);
  tcase_add_test(tc, free_noent_passes_through);
  tcase_add_test(tc, alloc_refusal_passes_through);
  tcase_add_test(tc, alloc_bad_arguments_invalid);
  tcase_add_test(tc, unlock_on_stream_host_device);
  tcase_add_test(tc, cuda_device_without_driver_refused);
  tcase_add_test(tc, threads_share_client);
  suite_add_tcase(s, tc);

  tc = tcase_create("movable");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_add_test(tc, movable_lock_sends_no_message);
  tcase_add_test(tc, heartbeat_after_hello_with_lock_table);
  tcase_add_test(tc, unlock_not_locked_invalid);
  tcase_add_test(tc, lock_waits_while_moving_then_new_position);
  tcase_add_test(tc, lock_moving_too_long_times_out);
  tcase_add_test(tc, moved_to_unmapped_segment_fetched_once);
  tcase_add_test(tc, alloc_slot_of_another_allocation_proto);
  tcase_add_test(tc, alloc_slot_out_of_range_proto);
  tcase_add_test(tc, lock_table_bad_magic_proto);
  tcase_add_test(tc, lock_table_other_session_proto);
  tcase_add_test(tc, lock_table_missing_fails_connect);
  tcase_add_test(tc, movable_threads_lock_while_moving);
  tcase_add_test(tc, movable_without_lock_table_is_pinned);
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
