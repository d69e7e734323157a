/*
 * test_tenancy.c - what keeps tenants apart: ids that mean nothing to
 * another tenant, admission by uid, descriptors of memory given only to
 * the sessions of the tenant that owns it, and a broker that answers
 * malformed or hostile input with the documented error and goes on
 * serving the others.
 *
 * The descriptor channel (fd.sock in the run dir, proto/fdpass.h) is
 * spoken raw here, as an attacker would: a legitimate session (a raw
 * ZeroMQ Hello gives its id and secret) asks for another tenant's
 * segments, and processes that are no session's guess ids and secrets,
 * or hold a real session's secret under another uid.
 *
 * The uid tests need root (CI runs as root): a child drops to uid 65534
 * and connects.  Without root only the positive path is tested, and the
 * test says so on stdout.
 */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "fdpass.h"
#include "gmb.h"
#include "harness.h"
#include "locktab_layout.h"
#include "wire.h"

#define MIB (UINT64_C(1) << 20)
#define NOBODY 65534

/* An allocation filled with a pattern derived from its id. */
static gmb_id alloc_pattern(gmb_client *c, size_t size) {
  gmb_id id = 0;
  int rc = gmb_alloc(c, size, 0, &id);
  ck_assert_msg(rc == 0, "gmb_alloc = %s: %s", gmb_err_name(rc),
                gmb_last_error(c));
  void *p = NULL;
  ck_assert_int_eq(gmb_lock(c, id, &p), 0);
  harness_pattern_fill(p, size, id);
  ck_assert_int_eq(gmb_unlock(c, id), 0);
  return id;
}

static void verify_pattern(gmb_client *c, gmb_id id, size_t size) {
  void *p = NULL;
  int rc = gmb_lock(c, id, &p);
  ck_assert_msg(rc == 0, "gmb_lock = %s: %s", gmb_err_name(rc),
                gmb_last_error(c));
  long bad = harness_pattern_check(p, size, id);
  ck_assert_msg(bad < 0, "allocation %llu differs at byte %ld",
                (unsigned long long)id, bad);
  ck_assert_int_eq(gmb_unlock(c, id), 0);
}

/* --- isolation ------------------------------------------------------------------- */

struct iso_child {
  const char *endpoint;
  int go_r;
  volatile gmb_id *their_id; /* in a MAP_SHARED page */
};

static int iso_child_main(void *arg) {
  struct iso_child *a = arg;
  CHILD_CHECK(harness_pipe_wait(a->go_r, HARNESS_WAIT_MS) == 'g', 10,
              "no go from the parent");
  gmb_id theirs = *a->their_id;
  gmb_client *c = NULL;
  int rc = gmb_connect(a->endpoint, "beta", &c);
  CHILD_CHECK(rc == 0, 11, "connect: %s", gmb_last_error(NULL));
  rc = gmb_free(c, theirs);
  CHILD_CHECK(rc == GMB_E_NOENT, 12, "free of alpha's id = %s: %s",
              gmb_err_name(rc), gmb_last_error(c));
  void *p = NULL;
  rc = gmb_lock(c, theirs, &p);
  CHILD_CHECK(rc == GMB_E_NOENT, 13, "lock of alpha's id = %s",
              gmb_err_name(rc));
  CHILD_CHECK(gmb_unlock(c, theirs) == GMB_E_NOENT, 14, "unlock of alpha's id");
  /* beta's figures are its own. */
  gmb_stats st;
  rc = gmb_tenant_stats(c, &st);
  CHILD_CHECK(rc == 0 && st.used == 0 && st.segments == 0, 15,
              "beta's stats: used %llu segments %llu",
              (unsigned long long)st.used, (unsigned long long)st.segments);
  gmb_id mine = 0;
  rc = gmb_alloc(c, MIB, 0, &mine);
  CHILD_CHECK(rc == 0, 16, "alloc: %s", gmb_last_error(c));
  CHILD_CHECK(mine != theirs, 17, "beta was given alpha's id");
  rc = gmb_lock(c, mine, &p);
  CHILD_CHECK(rc == 0, 18, "lock: %s", gmb_last_error(c));
  memset(p, 0xee, MIB); /* scribble over all of ours */
  rc = gmb_free(c, mine);
  CHILD_CHECK(rc == 0, 19, "free: %s", gmb_last_error(c));
  rc = gmb_free(c, mine);
  CHILD_CHECK(rc == GMB_E_NOENT, 20, "second free = %s", gmb_err_name(rc));
  gmb_disconnect(c);
  return 0;
}

START_TEST(isolation) {
  struct harness_broker b;
  harness_broker_start(&b, "host:128MiB", NULL);
  int go[2];
  ck_assert_int_eq(pipe(go), 0);
  volatile gmb_id *shared = mmap(NULL, sizeof *shared, PROT_READ | PROT_WRITE,
                                 MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  ck_assert_ptr_ne((void *)shared, MAP_FAILED);
  struct iso_child a = {b.endpoint, go[0], shared};
  pid_t kid = harness_fork(iso_child_main, &a);

  gmb_client *alpha = harness_connect_ok(&b, "alpha");
  /* Small, so it sits in a shared small segment like beta's will. */
  gmb_id id = alloc_pattern(alpha, MIB);
  gmb_stats before = harness_stats_ok(alpha);
  *shared = id;
  ck_assert_int_eq(harness_pipe_send(go[1], 'g'), 0);
  int st = harness_wait(kid);
  ck_assert_msg(st == 0, "beta ended with %d (its stderr says why)", st);

  verify_pattern(alpha, id, MIB);
  gmb_stats after = harness_stats_ok(alpha);
  ck_assert_uint_eq(after.used, before.used);
  ck_assert_uint_eq(after.used, MIB);
  ck_assert_int_eq(gmb_free(alpha, id), 0);
  gmb_disconnect(alpha);
  close(go[0]);
  close(go[1]);
  munmap((void *)shared, sizeof *shared);
  harness_broker_stop(&b);
}
END_TEST

/* --- auth_uid_refused ---------------------------------------------------------- */

struct auth_child {
  const char *endpoint;
  const char *tenant; /* NULL: the default uid-UID */
  int want;           /* expected gmb_connect result */
  int use;            /* on success: allocate, write and read back */
};

static int auth_child_main(void *arg) {
  struct auth_child *a = arg;
  unsetenv("GMB_TENANT");
  unsetenv("GMB_TOKEN");
  unsetenv("GMB_TOKEN_FILE");
  CHILD_CHECK(setgroups(0, NULL) == 0, 10, "setgroups");
  CHILD_CHECK(setgid(NOBODY) == 0, 10, "setgid");
  CHILD_CHECK(setuid(NOBODY) == 0, 10, "setuid");
  gmb_client *c = NULL;
  int rc = gmb_connect(a->endpoint, a->tenant, &c);
  CHILD_CHECK(rc == a->want, 11, "connect(%s) = %s, want %s: %s",
              a->tenant ? a->tenant : "(default)", gmb_err_name(rc),
              gmb_err_name(a->want), gmb_last_error(NULL));
  if (rc != 0) {
    char uid[32];
    snprintf(uid, sizeof uid, "uid %d", NOBODY);
    CHILD_CHECK(strstr(gmb_last_error(NULL), uid) != NULL, 12,
                "the refusal does not name %s: %s", uid, gmb_last_error(NULL));
    return 0;
  }
  if (a->use) {
    /* The segment the broker (root) creates must be usable by this uid. */
    gmb_id id = 0;
    rc = gmb_alloc(c, MIB, 0, &id);
    CHILD_CHECK(rc == 0, 13, "alloc as uid %d: %s", NOBODY,
                gmb_last_error(c));
    void *p = NULL;
    rc = gmb_lock(c, id, &p);
    CHILD_CHECK(rc == 0, 14, "lock: %s", gmb_last_error(c));
    harness_pattern_fill(p, MIB, id);
    CHILD_CHECK(harness_pattern_check(p, MIB, id) < 0, 15, "read back");
    rc = gmb_free(c, id);
    CHILD_CHECK(rc == 0, 16, "free: %s", gmb_last_error(c));
  }
  gmb_disconnect(c);
  return 0;
}

static void auth_run_child(const struct harness_broker *b, const char *tenant,
                           int want, int use) {
  struct auth_child a = {b->endpoint, tenant, want, use};
  pid_t kid = harness_fork(auth_child_main, &a);
  int st = harness_wait(kid);
  ck_assert_msg(st == 0, "uid %d connecting as %s: child ended with %d (its "
                "stderr says why)", NOBODY, tenant ? tenant : "(default)", st);
}

static void auth_refused_here(const struct harness_broker *b,
                              const char *tenant, const char *must_name) {
  gmb_client *c = NULL;
  int rc = gmb_connect(b->endpoint, tenant, &c);
  ck_assert_msg(rc == GMB_E_AUTH, "connect(%s) = %s, want GMB_E_AUTH: %s",
                tenant, gmb_err_name(rc), gmb_last_error(NULL));
  ck_assert_ptr_null(c);
  ck_assert_msg(strstr(gmb_last_error(NULL), must_name) != NULL,
                "the refusal does not name %s: %s", must_name,
                gmb_last_error(NULL));
}

START_TEST(auth_uid_refused) {
  struct harness_broker b;
  uid_t me = getuid();
  if (me != 0) {
    /* Not root: no other uid to act as.  Only what this uid may do. */
    char cfg[256];
    snprintf(cfg, sizeof cfg,
             "[tenant:locked]\nuids = %u\n[tenant:mine]\nuids = %u\n",
             me == 12345 ? 12346u : 12345u, (unsigned)me);
    harness_broker_start(&b, "host:64MiB", cfg);
    char uidstr[32];
    snprintf(uidstr, sizeof uidstr, "uid %u", (unsigned)me);
    auth_refused_here(&b, "locked", uidstr);
    gmb_client *c = harness_connect_ok(&b, "mine");
    gmb_id id = alloc_pattern(c, MIB);
    verify_pattern(c, id, MIB);
    gmb_disconnect(c);
    c = harness_connect_ok(&b, "fresh-tenant");
    gmb_disconnect(c);
    printf("auth_uid_refused: not root, so only this uid's own paths were "
           "tested (no second uid to act as)\n");
    harness_broker_stop(&b);
    return;
  }
  harness_broker_start(&b, "host:64MiB",
                       "[tenant:locked]\nquota = 16MiB\nuids = 12345\n");
  /* uid 0 is not special: root is not in locked's uids either. */
  auth_refused_here(&b, "locked", "uid 0");
  auth_run_child(&b, "locked", GMB_E_AUTH, 0);

  /* A tenant made on first use belongs to the uid that made it. */
  gmb_client *root = harness_connect_ok(&b, "rootowned");
  auth_run_child(&b, "rootowned", GMB_E_AUTH, 0);
  /* ... and, the other way round, one that uid 65534 made is its own. */
  auth_run_child(&b, "nobodys", 0, 1);
  auth_refused_here(&b, "nobodys", "uid 0");
  /* No tenant named: uid-65534, which is that uid's. */
  auth_run_child(&b, NULL, 0, 0);
  auth_refused_here(&b, "uid-65534", "uid 0");

  ck_assert_uint_eq(harness_stats_ok(root).used, 0);
  gmb_disconnect(root);
  harness_broker_stop(&b);
}
END_TEST

/* --- bad_input ------------------------------------------------------------------- */

static void send_frame(void *s, const void *buf, size_t len, int more) {
  ck_assert_int_eq(harness_raw_send(s, buf, len, more), 0);
}

/* Receives the broker's answer and checks its id and status. */
static void expect_reply(void *s, uint64_t id, int status, const char *what) {
  struct wire_reply rep;
  int rc = harness_raw_recv(s, HARNESS_WAIT_MS, &rep);
  ck_assert_msg(rc == 0, "%s: no decodable reply (%s)", what,
                gmb_err_name(rc));
  ck_assert_msg(rep.id == id, "%s: reply id %llu, want %llu", what,
                (unsigned long long)rep.id, (unsigned long long)id);
  ck_assert_msg(rep.status == status, "%s: status %s, want %s (%s)", what,
                gmb_err_name(rep.status), gmb_err_name(status), rep.message);
  gmb__wire_reply_clear(&rep);
}

static void call_expect(void *s, struct wire_request *req, int status,
                        const char *what) {
  uint8_t *buf = NULL;
  size_t len = 0;
  ck_assert_int_eq(gmb__wire_request_encode(req, &buf, &len), 0);
  send_frame(s, buf, len, 0);
  free(buf);
  expect_reply(s, req->id, status, what);
}

static struct wire_request hello_req(uint64_t id, const char *tenant,
                                     uint32_t version) {
  struct wire_request r;
  memset(&r, 0, sizeof r);
  r.id = id;
  r.kind = WIRE_HELLO;
  r.u.hello.version = version;
  snprintf(r.u.hello.tenant, sizeof r.u.hello.tenant, "%s", tenant);
  r.u.hello.pid = (int32_t)getpid();
  snprintf(r.u.hello.client, sizeof r.u.hello.client, "raw test socket");
  return r;
}

static struct wire_request alloc_req(uint64_t id, uint64_t size,
                                     uint32_t flags) {
  struct wire_request r;
  memset(&r, 0, sizeof r);
  r.id = id;
  r.kind = WIRE_ALLOC;
  r.u.alloc.size = size;
  r.u.alloc.flags = flags;
  return r;
}

static struct wire_request simple_req(uint64_t id, enum wire_kind kind) {
  struct wire_request r;
  memset(&r, 0, sizeof r);
  r.id = id;
  r.kind = kind;
  return r;
}

/* --- the descriptor channel, raw ---------------------------------------- */

/* A raw Hello on ZeroMQ socket s: the session's id and its secret for the
 * descriptor channel (what libgmb keeps to itself). */
struct raw_session {
  uint64_t id;
  uint8_t secret[GMB_FD_SECRET_LEN];
  uint32_t lock_slots;
};

static struct raw_session raw_hello(void *s, uint64_t req_id,
                                    const char *tenant) {
  struct wire_request r = hello_req(req_id, tenant, WIRE_PROTOCOL_VERSION);
  struct wire_reply rep;
  int rc = harness_raw_call(s, &r, &rep);
  ck_assert_msg(rc == 0, "hello: %s", gmb_err_name(rc));
  ck_assert_msg(rep.status == 0, "hello: %s", rep.message);
  ck_assert_int_eq(rep.kind, WIRE_HELLO);
  ck_assert_uint_eq(rep.u.hello.fd_secret_len, GMB_FD_SECRET_LEN);
  struct raw_session out;
  out.id = rep.u.hello.session;
  memcpy(out.secret, rep.u.hello.fd_secret, GMB_FD_SECRET_LEN);
  out.lock_slots = rep.u.hello.lock_slots;
  gmb__wire_reply_clear(&rep);
  return out;
}

/* A connection to broker dir's fd.sock; -errno when connect fails.  Does
 * not use Check: children call it too. */
static int fd_connect(const char *dir) {
  struct sockaddr_un sa;
  memset(&sa, 0, sizeof sa);
  sa.sun_family = AF_UNIX;
  int n = snprintf(sa.sun_path, sizeof sa.sun_path, "%s/%s", dir,
                   GMB_FD_SOCKET);
  if (n < 0 || (size_t)n >= sizeof sa.sun_path) return -ENAMETOOLONG;
  int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (fd < 0) return -errno;
  if (connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0) {
    int e = errno;
    close(fd);
    return -e;
  }
  return fd;
}

/* Sends one request and waits (HARNESS_WAIT_MS) for its reply: 0 with
 * *rep and its descriptor in *fd (-1: none), or -errno (-ETIMEDOUT, or
 * -EPIPE when the broker hung up instead).  No Check either. */
static int fd_call(int sock, uint32_t op, uint64_t session, uint64_t segment,
                   const uint8_t *secret, struct gmb_fd_rep *rep, int *fd) {
  struct gmb_fd_req req;
  memset(&req, 0, sizeof req);
  req.magic = GMB_FD_MAGIC;
  req.op = op;
  req.session = session;
  req.segment = segment;
  if (secret) memcpy(req.secret, secret, GMB_FD_SECRET_LEN);
  *fd = -1;
  int rc = gmb__fd_send(sock, &req, sizeof req, -1, 0);
  if (rc) return rc;
  struct pollfd p = {.fd = sock, .events = POLLIN};
  if (poll(&p, 1, HARNESS_WAIT_MS) != 1) return -ETIMEDOUT;
  ssize_t n = gmb__fd_recv(sock, rep, sizeof *rep, fd, 0);
  if (n == 0) return -EPIPE;
  if (n < 0) return (int)n;
  if ((size_t)n != sizeof *rep || rep->magic != GMB_FD_MAGIC) return -EPROTO;
  rep->message[sizeof rep->message - 1] = '\0';
  return 0;
}

/* 1 when the broker closed the connection (within HARNESS_WAIT_MS). */
static int fd_hung_up(int sock) {
  struct pollfd p = {.fd = sock, .events = POLLIN};
  if (poll(&p, 1, HARNESS_WAIT_MS) != 1) return 0;
  char buf[sizeof(struct gmb_fd_rep)];
  int fd = -1;
  ssize_t n = gmb__fd_recv(sock, buf, sizeof buf, &fd, 0);
  if (fd >= 0) close(fd);
  return n == 0 || n == -ECONNRESET;
}

/* AUTH on a new connection that must be refused GMB_E_AUTH, with no
 * descriptor, and closed; the refusal's text in msg.  0, or a code saying
 * what went wrong (children report it). */
static int fd_auth_refused(const char *dir, uint64_t session,
                           const uint8_t *secret, char *msg, size_t cap) {
  int sock = fd_connect(dir);
  if (sock < 0) return 1;
  struct gmb_fd_rep rep;
  int fd = -1;
  int rc = fd_call(sock, GMB_FD_AUTH, session, 0, secret, &rep, &fd);
  int code = rc != 0                   ? 2
             : rep.status != GMB_E_AUTH ? 3
             : fd >= 0                  ? 4
             : !fd_hung_up(sock)        ? 5
                                        : 0;
  if (fd >= 0) close(fd);
  if (rc == 0 && msg) snprintf(msg, cap, "%s", rep.message);
  close(sock);
  return code;
}

/* The id of a segment of `tenant`, from the admin snapshot; 0 if none. */
static uint64_t segment_of_tenant(const struct harness_broker *b,
                                  const char *tenant) {
  void *admin = harness_raw_open(b->admin_endpoint);
  struct wire_request r = simple_req(1, WIRE_ADMIN_SNAPSHOT);
  struct wire_reply rep;
  ck_assert_int_eq(harness_raw_call(admin, &r, &rep), 0);
  ck_assert_msg(rep.status == 0, "snapshot: %s", rep.message);
  uint64_t seg = 0;
  for (size_t i = 0; i < rep.u.snapshot.n_segments && seg == 0; i++)
    if (strcmp(rep.u.snapshot.segments[i].tenant, tenant) == 0)
      seg = rep.u.snapshot.segments[i].id;
  gmb__wire_reply_clear(&rep);
  harness_raw_close(admin);
  return seg;
}

START_TEST(bad_input) {
  struct harness_broker b;
  harness_broker_start(&b, "host:128MiB", NULL);
  /* Another tenant whose allocation must come through untouched. */
  gmb_client *keeper = harness_connect_ok(&b, "keeper");
  gmb_id kid = alloc_pattern(keeper, MIB);

  void *s = harness_raw_open(b.endpoint);
  /* Garbage (field 0, wire type 7: no protobuf parses it). */
  static const char garbage[] = "\x07 this is not a protobuf \xff\xfe";
  send_frame(s, garbage, sizeof garbage - 1, 0);
  expect_reply(s, 0, GMB_E_PROTO, "garbage");
  /* An empty frame: a Request without a body. */
  send_frame(s, "", 0, 0);
  expect_reply(s, 0, GMB_E_PROTO, "empty frame");
  /* A multi-part message, even of valid requests, is not a request. */
  {
    struct wire_request st = simple_req(3, WIRE_STATS);
    uint8_t *buf = NULL;
    size_t len = 0;
    ck_assert_int_eq(gmb__wire_request_encode(&st, &buf, &len), 0);
    send_frame(s, buf, len, 1);
    send_frame(s, buf, len, 0);
    free(buf);
    expect_reply(s, 0, GMB_E_PROTO, "multi-part message");
  }
  /* Anything but Hello first: no session. */
  struct wire_request r = simple_req(4, WIRE_STATS);
  call_expect(s, &r, GMB_E_CONN, "stats before hello");
  r = alloc_req(5, MIB, 0);
  call_expect(s, &r, GMB_E_CONN, "alloc before hello");
  r = hello_req(6, "raw", 99);
  call_expect(s, &r, GMB_E_PROTO, "hello with protocol version 99");
  r = hello_req(7, "-bad", WIRE_PROTOCOL_VERSION);
  call_expect(s, &r, GMB_E_INVAL, "hello with a bad tenant name");
  struct raw_session raw = raw_hello(s, 8, "raw");
  r = hello_req(9, "raw", WIRE_PROTOCOL_VERSION);
  call_expect(s, &r, GMB_E_PROTO, "second hello");

  r = alloc_req(10, 0, 0);
  call_expect(s, &r, GMB_E_INVAL, "alloc of size 0");
  r = alloc_req(11, UINT64_MAX, 0);
  call_expect(s, &r, GMB_E_INVAL, "alloc of UINT64_MAX");
  r = alloc_req(12, MIB, 0xff);
  call_expect(s, &r, GMB_E_INVAL, "alloc with flags 0xff");
  r = alloc_req(13, UINT64_C(1) << 40, 0);
  call_expect(s, &r, GMB_E_NOMEM, "alloc of 1TiB on a 128MiB device");

  r = simple_req(14, WIRE_FREE);
  r.u.free.id = 0;
  call_expect(s, &r, GMB_E_NOENT, "free of id 0");
  r.id = 15;
  r.u.free.id = 0x0123456789abcdefull;
  call_expect(s, &r, GMB_E_NOENT, "free of a random id");
  r.id = 16;
  r.u.free.id = kid;
  call_expect(s, &r, GMB_E_NOENT, "free of another tenant's id");
  /* The descriptor channel: the session proves itself, and gets its own
   * segment's descriptor and nothing of another tenant's, whatever the id
   * asked (keeper's real segment, or guesses). */
  int ch = fd_connect(b.dir);
  ck_assert_msg(ch >= 0, "connect fd.sock: %s", strerror(-ch));
  struct gmb_fd_rep frep;
  int fd = -1;
  ck_assert_int_eq(
      fd_call(ch, GMB_FD_AUTH, raw.id, 0, raw.secret, &frep, &fd), 0);
  ck_assert_msg(frep.status == 0, "auth: %s", frep.message);
  ck_assert_int_ge(fd, 0);
  ck_assert_uint_eq(frep.size, gmb__lt_bytes(raw.lock_slots));
  close(fd);
  struct wire_reply arep;
  r = alloc_req(17, MIB, 0);
  ck_assert_int_eq(harness_raw_call(s, &r, &arep), 0);
  ck_assert_msg(arep.status == 0, "alloc: %s", arep.message);
  uint64_t own = arep.u.alloc.segment;
  gmb__wire_reply_clear(&arep);
  ck_assert_int_eq(fd_call(ch, GMB_FD_SEGMENT, raw.id, own, NULL, &frep, &fd),
                   0);
  ck_assert_msg(frep.status == 0, "own segment: %s", frep.message);
  ck_assert_int_ge(fd, 0);
  struct stat sb;
  ck_assert_int_eq(fstat(fd, &sb), 0);
  ck_assert_uint_eq((uint64_t)sb.st_size, frep.size);
  errno = 0;
  ck_assert_int_eq(ftruncate(fd, 0), -1); /* sealed */
  ck_assert_int_eq(errno, EPERM);
  close(fd);
  uint64_t keepers = segment_of_tenant(&b, "keeper");
  ck_assert_uint_ne(keepers, 0);
  ck_assert_uint_ne(keepers, own);
  for (uint64_t seg = 0; seg < 18; seg++) {
    uint64_t ask = seg == 17 ? keepers : seg == 16 ? UINT64_MAX : seg;
    if (ask == own) continue;
    ck_assert_int_eq(
        fd_call(ch, GMB_FD_SEGMENT, raw.id, ask, NULL, &frep, &fd), 0);
    ck_assert_msg(frep.status == GMB_E_NOENT,
                  "segment %llu: status %s (%s)", (unsigned long long)ask,
                  gmb_err_name(frep.status), frep.message);
    ck_assert_int_eq(fd, -1);
    /* The same words for keeper's segment as for one that is nobody's. */
    char want[GMB_FD_MESSAGE_MAX];
    snprintf(want, sizeof want, "no segment %llu for tenant raw",
             (unsigned long long)ask);
    ck_assert_str_eq(frep.message, want);
  }
  r = simple_req(40, WIRE_ADMIN_STATUS);
  call_expect(s, &r, GMB_E_PROTO, "admin request on the client socket");
  /* Unknown fields are ignored (field 99, varint 1, appended). */
  {
    struct wire_request st = simple_req(41, WIRE_STATS);
    uint8_t *buf = NULL;
    size_t len = 0;
    ck_assert_int_eq(gmb__wire_request_encode(&st, &buf, &len), 0);
    uint8_t *more = malloc(len + 3);
    memcpy(more, buf, len);
    memcpy(more + len, "\x98\x06\x01", 3);
    send_frame(s, more, len + 3, 0);
    free(more);
    free(buf);
    expect_reply(s, 41, 0, "stats with an unknown field");
  }
  r = simple_req(42, WIRE_BYE);
  call_expect(s, &r, 0, "bye");
  r = simple_req(43, WIRE_STATS);
  call_expect(s, &r, GMB_E_CONN, "stats after bye");
  harness_raw_close(s);
  /* Its session ended with Bye: so did its descriptor channel. */
  ck_assert_int_eq(fd_hung_up(ch), 1);
  close(ch);

  /* Over ZMQ_MAXMSGSIZE: ZeroMQ drops that connection, nothing answers. */
  void *big = harness_raw_open(b.endpoint);
  size_t n = 70 * 1024;
  char *blob = calloc(1, n);
  send_frame(big, blob, n, 0);
  free(blob);
  struct wire_reply rep;
  int rc = harness_raw_recv(big, 300, &rep);
  if (rc == 0) gmb__wire_reply_clear(&rep);
  harness_raw_close(big);

  /* The broker lives and serves: a fresh client, and the keeper. */
  ck_assert(harness_broker_alive(&b));
  gmb_client *fresh = harness_connect_ok(&b, "fresh");
  gmb_id fid = alloc_pattern(fresh, 4 * MIB);
  verify_pattern(fresh, fid, 4 * MIB);
  gmb_disconnect(fresh);
  verify_pattern(keeper, kid, MIB);
  ck_assert_uint_eq(harness_stats_ok(keeper).used, MIB);
  gmb_disconnect(keeper);
  harness_broker_stop(&b);
}
END_TEST

/* --- fd_channel_attacks -------------------------------------------------------- */

struct attacker {
  const char *dir;
  uint64_t stolen_id; /* a real session's id and secret, other uid */
  const uint8_t *stolen_secret;
  uint64_t max_id;
};

/* Guesses: every session id up to max_id with a zero and a made-up secret;
 * then, if given, a real session's id and secret. */
static int attack(const struct attacker *a) {
  uint8_t made_up[GMB_FD_SECRET_LEN];
  for (size_t i = 0; i < sizeof made_up; i++) made_up[i] = (uint8_t)(i * 7);
  char first[GMB_FD_MESSAGE_MAX] = "", msg[GMB_FD_MESSAGE_MAX];
  for (uint64_t id = 0; id <= a->max_id; id++) {
    for (int k = 0; k < 2; k++) {
      static const uint8_t zero[GMB_FD_SECRET_LEN];
      int code = fd_auth_refused(a->dir, id, k ? made_up : zero, msg,
                                 sizeof msg);
      CHILD_CHECK(code == 0, 20 + code, "session %llu guessed: refusal "
                  "step %d failed", (unsigned long long)id, code);
      if (!first[0]) snprintf(first, sizeof first, "%s", msg);
      CHILD_CHECK(strcmp(first, msg) == 0, 30, "refusals differ: '%s' / '%s'",
                  first, msg);
    }
  }
  if (a->stolen_secret) {
    int code = fd_auth_refused(a->dir, a->stolen_id, a->stolen_secret, msg,
                               sizeof msg);
    CHILD_CHECK(code == 0, 40 + code, "a real secret from uid %d: refusal "
                "step %d failed", (int)geteuid(), code);
    CHILD_CHECK(strcmp(first, msg) == 0, 50, "refusals differ: '%s' / '%s'",
                first, msg);
  }
  return 0;
}

static int attacker_main(void *arg) {
  CHILD_CHECK(setgroups(0, NULL) == 0, 10, "setgroups");
  CHILD_CHECK(setgid(NOBODY) == 0, 10, "setgid");
  CHILD_CHECK(setuid(NOBODY) == 0, 10, "setuid");
  return attack(arg);
}

/* A process that is no session's gets nothing from the descriptor
 * channel: guessed session ids and secrets, and (as another uid) even a
 * real session's id and secret, are refused alike, and the connection is
 * closed; the sessions it aimed at go on. */
START_TEST(fd_channel_attacks) {
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", NULL);
  gmb_client *victim = harness_connect_ok(&b, "victim");
  gmb_id vid = alloc_pattern(victim, MIB);
  void *s = harness_raw_open(b.endpoint);
  struct raw_session raw = raw_hello(s, 1, "raw");
  /* While sessions hold memory, /dev/shm has nothing of this broker's. */
  ck_assert_int_eq(harness_shm_leftovers(b.pid), 0);

  /* From this uid: guesses. */
  struct attacker a = {b.dir, 0, NULL, raw.id + 4};
  ck_assert_int_eq(attack(&a), 0);
  if (geteuid() == 0) {
    /* From another uid: guesses, and the raw session's real secret. */
    a.stolen_id = raw.id;
    a.stolen_secret = raw.secret;
    pid_t kid = harness_fork(attacker_main, &a);
    int st = harness_wait(kid);
    ck_assert_msg(st == 0, "uid %d attacking: child ended with %d (its "
                  "stderr says why)", NOBODY, st);
  } else {
    printf("fd_channel_attacks: not root, so no process of another uid "
           "tried a stolen secret\n");
  }
  /* No lockout: the real session proves itself after all that. */
  int ch = fd_connect(b.dir);
  ck_assert_int_ge(ch, 0);
  struct gmb_fd_rep rep;
  int fd = -1;
  ck_assert_int_eq(fd_call(ch, GMB_FD_AUTH, raw.id, 0, raw.secret, &rep, &fd),
                   0);
  ck_assert_msg(rep.status == 0, "auth: %s", rep.message);
  ck_assert_int_ge(fd, 0);
  close(fd);
  /* ...and only once: a second channel for it is refused. */
  int ch2 = fd_connect(b.dir);
  ck_assert_int_ge(ch2, 0);
  ck_assert_int_eq(
      fd_call(ch2, GMB_FD_AUTH, raw.id, 0, raw.secret, &rep, &fd), 0);
  ck_assert_int_eq(rep.status, GMB_E_LIMIT);
  ck_assert_int_eq(fd, -1);
  ck_assert_int_eq(fd_hung_up(ch2), 1);
  close(ch2);
  /* The victim's memory was never anybody else's. */
  verify_pattern(victim, vid, MIB);
  ck_assert_int_eq(gmb_free(victim, vid), 0);
  gmb_disconnect(victim);
  /* The raw session's channel closing ends it (its process is gone, as
   * far as the broker can tell). */
  close(ch);
  struct wire_request r = simple_req(2, WIRE_STATS);
  struct wire_reply zrep;
  int alive = 1;
  for (int i = 0; i < 200 && alive; i++) {
    r.id = 2 + (uint64_t)i;
    ck_assert_int_eq(harness_raw_call(s, &r, &zrep), 0);
    alive = zrep.status == 0;
    gmb__wire_reply_clear(&zrep);
    if (alive) harness_sleep_ms(10);
  }
  ck_assert_msg(!alive, "the raw session outlived its descriptor channel");
  harness_raw_close(s);
  ck_assert(harness_broker_alive(&b));
  harness_broker_stop(&b);
}
END_TEST

/* --- run_dir_squatted ------------------------------------------------------- */

/* Another user made the fallback run dir first and a
 * socket in it, and the client sent its token there.  A client sends a
 * token only to a run dir owned by root or itself that no one else may
 * write to, holding a socket owned by root or itself; and the broker
 * refuses to start in a dir that fails the same check. */
static int squat_listen(const char *dir) {
  int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ck_assert_int_ge(s, 0);
  struct sockaddr_un sa;
  memset(&sa, 0, sizeof sa);
  sa.sun_family = AF_UNIX;
  snprintf(sa.sun_path, sizeof sa.sun_path, "%s/broker.sock", dir);
  ck_assert_int_eq(bind(s, (struct sockaddr *)&sa, sizeof sa), 0);
  ck_assert_int_eq(listen(s, 8), 0);
  return s;
}

/* Whatever the impostor received on its socket, within a short while. */
static size_t squat_heard(int s, char *buf, size_t cap) {
  struct pollfd p = {s, POLLIN, 0};
  if (poll(&p, 1, 500) <= 0) return 0;
  int c = accept(s, NULL, NULL);
  if (c < 0) return 0;
  size_t got = 0;
  for (;;) {
    struct pollfd q = {c, POLLIN, 0};
    if (poll(&q, 1, 500) <= 0) break;
    ssize_t n = read(c, buf + got, cap - got);
    if (n <= 0) break;
    got += (size_t)n;
    if (got == cap) break;
  }
  close(c);
  return got;
}

START_TEST(run_dir_squatted) {
  char dir[] = "/tmp/gmbsq-XXXXXX";
  ck_assert_ptr_nonnull(mkdtemp(dir));
  char endpoint[128];
  snprintf(endpoint, sizeof endpoint, "ipc://%s/broker.sock", dir);
  setenv("GMB_TOKEN", "the-secret-token", 1);
  char buf[4096];
  /* Writable by others: anyone could have put that socket there. */
  ck_assert_int_eq(chmod(dir, 0777), 0);
  int s = squat_listen(dir);
  gmb_client *c = NULL;
  int rc = gmb_connect(endpoint, "t", &c);
  ck_assert_msg(rc == GMB_E_AUTH, "connect = %s: %s", gmb_err_name(rc),
                gmb_last_error(NULL));
  ck_assert_ptr_nonnull(strstr(gmb_last_error(NULL), "token not sent"));
  size_t n = squat_heard(s, buf, sizeof buf);
  ck_assert_ptr_null(memmem(buf, n, "the-secret-token", 16));
  ck_assert_uint_eq(n, 0);
  /* Owned by another user, even with a sane mode. */
  if (geteuid() == 0) {
    ck_assert_int_eq(chmod(dir, 0755), 0);
    ck_assert_int_eq(chown(dir, 65534, 65534), 0);
    rc = gmb_connect(endpoint, "t", &c);
    ck_assert_int_eq(rc, GMB_E_AUTH);
    ck_assert_ptr_nonnull(strstr(gmb_last_error(NULL), "uid 65534"));
    ck_assert_uint_eq(squat_heard(s, buf, sizeof buf), 0);
    ck_assert_int_eq(chown(dir, 0, 0), 0);
  }
  close(s);
  unsetenv("GMB_TOKEN");
  /* The broker will not start there either. */
  ck_assert_int_eq(chmod(dir, 0777), 0);
  char bin[PATH_MAX], out[4096];
  snprintf(bin, sizeof bin, "%s/gmb-broker", harness_build_dir());
  char *argv[] = {bin, "--device", "host:8MiB", "--run-dir", dir, NULL};
  int st = harness_run(argv, out, sizeof out);
  ck_assert_msg(st == 1, "broker in a world-writable run dir: exit %d: %s",
                st, out);
  ck_assert_ptr_nonnull(strstr(out, "writable by others"));
  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
  ck_assert_int_eq(system(cmd), 0);
}
END_TEST

/* --- a flood of bare connections ------------------------------------- */

struct flood {
  const char *path; /* the client socket */
  int n;            /* connections to open */
  int as_nobody;
  int ready[2], done[2]; /* child -> parent: opened; parent -> child: go */
};

static int flood_main(void *arg) {
  struct flood *f = arg;
  if (f->as_nobody) {
    CHILD_CHECK(setgroups(0, NULL) == 0, 10, "setgroups");
    CHILD_CHECK(setgid(NOBODY) == 0, 10, "setgid");
    CHILD_CHECK(setuid(NOBODY) == 0, 10, "setuid");
  }
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  snprintf(sa.sun_path, sizeof sa.sun_path, "%s", f->path);
  int opened = 0;
  for (int i = 0; i < f->n; i++) {
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) break; /* our own descriptor limit: enough */
    if (connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0) {
      close(fd);
      continue; /* the listen backlog is full for a moment */
    }
    opened++;
  }
  CHILD_CHECK(opened > 0, 11, "no connection opened");
  harness_pipe_send(f->ready[1], 'r');
  CHILD_CHECK(harness_pipe_wait(f->done[0], HARNESS_WAIT_MS) == 'g', 12,
              "no word from the test");
  return 0; /* exit closes them all */
}

static int log_has_refused(void *arg) {
  char *log = harness_broker_log(arg);
  int yes = log && strstr(log, "refused") && strstr(log, "client connections");
  free(log);
  return yes;
}

/* libzmq accepts every connection to broker.sock in its own thread and
 * aborted the broker when accept() met EMFILE: a local
 * user opening ~1,000 bare connections stopped every tenant's broker.  Now
 * connections are counted and capped, in all and per uid: the broker
 * lives, the flood's uid cannot take every place, the operator's admin
 * socket answers during the flood, and once it ends clients connect. */
static void flood_run(struct harness_broker *b, int as_nobody) {
  struct flood f = {b->sock_path, 600, as_nobody, {-1, -1}, {-1, -1}};
  ck_assert_int_eq(pipe(f.ready), 0);
  ck_assert_int_eq(pipe(f.done), 0);
  pid_t kid = harness_fork(flood_main, &f);
  ck_assert_int_eq(harness_pipe_wait(f.ready[0], HARNESS_WAIT_MS), 'r');
  ck_assert_int_eq(harness_broker_alive(b), 1);
  /* The operator gets in during the flood. */
  struct wire_reply st;
  ck_assert_int_eq(harness_admin_status(b, &st), 0);
  gmb__wire_reply_clear(&st);
  if (as_nobody) {
    /* Another uid's client is served while nobody floods. */
    gmb_client *c = harness_connect_ok(b, "victim");
    gmb_id id = harness_alloc_ok(c, MIB);
    ck_assert_int_eq(gmb_free(c, id), 0);
    gmb_disconnect(c);
  }
  ck_assert_msg(harness_poll_until(log_has_refused, b, HARNESS_WAIT_MS),
                "the broker did not say it refused connections");
  harness_pipe_send(f.done[1], 'g');
  ck_assert_int_eq(harness_wait(kid), 0);
  /* After the flood, every uid connects again. */
  gmb_client *c = harness_connect_ok(b, "after");
  gmb_disconnect(c);
  ck_assert_int_eq(harness_broker_alive(b), 1);
  close(f.ready[0]);
  close(f.ready[1]);
  close(f.done[0]);
  close(f.done[1]);
}

START_TEST(connection_flood) {
  struct harness_broker b;
  /* 20 sessions: room for 84 connections, 20 of one uid. */
  harness_broker_start(&b, "host:64MiB",
                       "[broker]\nmax_sessions = 20\n"
                       "max_sessions_per_uid = 4\n");
  flood_run(&b, 0); /* this uid (root: only the total caps it) */
  if (geteuid() == 0)
    flood_run(&b, 1); /* nobody: its uid's cap */
  else
    printf("connection_flood: not root, so no flood from another uid\n");
  harness_broker_stop(&b);
}
END_TEST

struct flood_note {
  struct harness_broker *b;
  void *sock;
  const char *msg;
  size_t len;
};

/* One more undecodable message; 1 once the log counts those left out. */
static int log_has_note(void *arg) {
  struct flood_note *f = arg;
  send_frame(f->sock, f->msg, f->len, 0);
  expect_reply(f->sock, 0, GMB_E_PROTO, "garbage");
  char *log = harness_broker_log(f->b);
  int yes = log && strstr(log, "more like it, not logged") != NULL;
  free(log);
  return yes;
}

/* A local user sending undecodable messages as fast as it can made the
 * broker write a log line for each (100,000 a second).  The line is
 * rate-limited now: 2,000 messages, each still answered, give a handful of
 * lines and a count of those left out. */
START_TEST(undecodable_flood_log_bounded) {
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", NULL);
  void *s = harness_raw_open(b.endpoint);
  static const char garbage[] = "\x07 this is not a protobuf \xff\xfe";
  enum { N = 2000 };
  for (int i = 0; i < N; i++) {
    send_frame(s, garbage, sizeof garbage - 1, 0);
    expect_reply(s, 0, GMB_E_PROTO, "garbage");
  }
  char *log = harness_broker_log(&b);
  ck_assert_ptr_nonnull(log);
  size_t lines = harness_count(log, "undecodable message");
  ck_assert_msg(lines < N / 10, "%zu lines for %d messages", lines, N);
  free(log);
  /* The next line let through says how many were left out. */
  struct flood_note fn = {&b, s, garbage, sizeof garbage - 1};
  ck_assert_msg(harness_poll_until(log_has_note, &fn, HARNESS_WAIT_MS),
                "no line counted the messages left out");
  harness_raw_close(s);
  gmb_client *c = harness_connect_ok(&b, "after"); /* and it serves on */
  gmb_disconnect(c);
  harness_broker_stop(&b);
}
END_TEST

int main(void) {
  return harness_main(HARNESS_SUITE(
      "tenancy", "tenancy", 60,
      isolation,
      auth_uid_refused,
      bad_input,
      fd_channel_attacks,
      run_dir_squatted,
      connection_flood,
      undecodable_flood_log_bounded));
}
