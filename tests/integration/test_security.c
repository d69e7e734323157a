/*
 * test_security.c - a hostile local user against the broker, round two:
 * each test reproduces one attack (the routing ids a peer chooses, a fake
 * broker in another user's run dir, a flood of the admin socket, ...) and
 * asserts that the broker lives and the victims are served.
 *
 * ZeroMQ is spoken raw where the attack needs it (ZMTP 3.0 over a Unix
 * socket, as tools/libraries other than libzmq can), so that a test does
 * not depend on what libzmq's own client lets one choose.
 *
 * Tests that need a second uid run a child as uid 65534 when the test
 * runs as root (CI does), and say on stdout what they skipped otherwise.
 */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <signal.h>
#include <unistd.h>

#include "gmb.h"
#include "harness.h"
#include "wire.h"

#define MIB (UINT64_C(1) << 20)
#define NOBODY 65534

/* --- raw ZMTP 3.0 ------------------------------------------------------- */

/* A Unix-socket connection to `path`, or -1. */
static int raw_connect(const char *path) {
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  snprintf(sa.sun_path, sizeof sa.sun_path, "%s", path);
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  if (connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

static int write_all(int fd, const void *buf, size_t len) {
  const char *p = buf;
  while (len > 0) {
    ssize_t n = write(fd, p, len);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return -1;
    p += n;
    len -= (size_t)n;
  }
  return 0;
}

/*
 * Sends a DEALER's ZMTP 3.0 greeting (NULL mechanism) and READY command
 * on fd, with the routing id `id` of `idlen` bytes (idlen 0: none, and
 * the ROUTER numbers the peer itself).  0 or -1.
 */
static int zmtp_hello(int fd, const unsigned char *id, size_t idlen) {
  unsigned char g[64] = {0xff, 0, 0, 0, 0, 0, 0, 0, 1, 0x7f, 3, 0};
  memcpy(g + 12, "NULL", 4);
  unsigned char cmd[300];
  size_t n = 2;
  cmd[n++] = 5;
  memcpy(cmd + n, "READY", 5);
  n += 5;
  cmd[n++] = 11;
  memcpy(cmd + n, "Socket-Type", 11);
  n += 11;
  cmd[n++] = 0, cmd[n++] = 0, cmd[n++] = 0, cmd[n++] = 6;
  memcpy(cmd + n, "DEALER", 6);
  n += 6;
  cmd[n++] = 8;
  memcpy(cmd + n, "Identity", 8);
  n += 8;
  cmd[n++] = 0, cmd[n++] = 0, cmd[n++] = 0, cmd[n++] = (unsigned char)idlen;
  if (idlen) memcpy(cmd + n, id, idlen);
  n += idlen;
  cmd[0] = 0x04; /* a short command */
  cmd[1] = (unsigned char)(n - 2);
  return write_all(fd, g, sizeof g) || write_all(fd, cmd, n) ? -1 : 0;
}

/* How many of fds[0..n) the peer closed within timeout_ms (all of them
 * ends the wait); each is read until then and what came dropped. */
static int count_closed(const int *fds, int n, int timeout_ms) {
  struct pollfd *p = calloc((size_t)n, sizeof *p);
  ck_assert_ptr_nonnull(p);
  for (int i = 0; i < n; i++) p[i] = (struct pollfd){fds[i], POLLIN, 0};
  int closed = 0;
  double end = harness_now_ms() + timeout_ms;
  char buf[512];
  while (closed < n) {
    int left = (int)(end - harness_now_ms());
    if (left <= 0) break;
    if (poll(p, (nfds_t)n, left) <= 0) continue;
    for (int i = 0; i < n; i++) {
      if (p[i].fd < 0 || !p[i].revents) continue;
      ssize_t r = read(p[i].fd, buf, sizeof buf);
      if (r == 0 || (r < 0 && errno != EINTR && errno != EAGAIN)) {
        p[i].fd = -1;
        closed++;
      }
    }
  }
  free(p);
  return closed;
}

/* The broker serves after an attack: a client allocates and frees, and
 * the operator's status is answered. */
static void serves_after(struct harness_broker *b) {
  gmb_client *c = harness_connect_ok(b, "after");
  gmb_id id = harness_alloc_ok(c, MIB);
  ck_assert_int_eq(gmb_free(c, id), 0);
  gmb_disconnect(c);
  struct wire_reply st;
  ck_assert_int_eq(harness_admin_status(b, &st), 0);
  gmb__wire_reply_clear(&st);
}

/* --- row: routing ids chosen by peers ------------------------------------ */

/* glibc's rand() as an unseeded process sees it, and libzmq 4.3's
 * generate_random() over it: where a ROUTER starts numbering the peers
 * that choose no id (router.cpp, _next_integral_routing_id). */
static void zmq_first_ids(uint32_t *out, int n) {
  static char state[128];
  struct random_data rd;
  memset(&rd, 0, sizeof rd);
  initstate_r(1, state, sizeof state, &rd);
  for (int i = 0; i < n; i++) {
    int32_t lo, hi;
    random_r(&rd, &lo);
    random_r(&rd, &hi);
    out[i] = (uint32_t)lo | ((uint32_t)hi << 31);
  }
}

/*
 * libzmq's ROUTER numbers anonymous peers 0x00 + a 32-bit counter that
 * starts at the unseeded rand()'s value, the same every start, and it
 * aborted the broker (socket_base.cpp: zmq_assert in add_out_pipe) when
 * that number was already a routing id a peer had chosen.  A local user
 * who chose the next few hundred numbers and then connected without one
 * stopped the broker of every tenant.  Now a peer that chooses a routing id
 * is refused in its handshake (both sockets), and the broker serves on.
 */
START_TEST(peer_chosen_routing_ids_refused) {
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", NULL);
  enum { STARTS = 4, SPAN = 80, ANON = 40 };
  uint32_t start[STARTS];
  zmq_first_ids(start, STARTS);
  struct rlimit rl;
  ck_assert_int_eq(getrlimit(RLIMIT_NOFILE, &rl), 0);
  rl.rlim_cur = rl.rlim_max;
  setrlimit(RLIMIT_NOFILE, &rl);
  static int fds[STARTS * SPAN * 2 + ANON];
  int nfd = 0, refused = 0;
  const char *paths[2] = {b.sock_path, b.admin_path};
  for (int s = 0; s < 2; s++)
    for (int i = 0; i < STARTS; i++)
      for (uint32_t k = 0; k < SPAN; k++) {
        uint32_t v = start[i] + k;
        unsigned char id[5] = {0, (unsigned char)(v >> 24),
                               (unsigned char)(v >> 16),
                               (unsigned char)(v >> 8), (unsigned char)v};
        int fd = raw_connect(paths[s]);
        if (fd < 0) continue;
        fds[nfd++] = fd;
        zmtp_hello(fd, id, sizeof id);
      }
  /* Each chosen id's connection is closed by the broker. */
  refused = count_closed(fds, nfd, HARNESS_WAIT_MS);
  ck_assert_int_eq(refused, nfd);
  /* Anonymous peers then take the numbers the others chose. */
  int anon[ANON];
  for (int i = 0; i < ANON; i++) {
    anon[i] = raw_connect(i % 2 ? b.admin_path : b.sock_path);
    ck_assert_int_ge(anon[i], 0);
    ck_assert_int_eq(zmtp_hello(anon[i], NULL, 0), 0);
  }
  ck_assert_msg(count_closed(anon, ANON, 500) == 0,
                "an anonymous peer was refused");
  ck_assert_int_eq(harness_broker_alive(&b), 1);
  serves_after(&b);
  for (int i = 0; i < ANON; i++) close(anon[i]);
  for (int i = 0; i < nfd; i++) close(fds[i]);
  harness_broker_stop(&b);
}
END_TEST

/* --- row: a message of endless parts ---------------------------------- */

/* Sends n empty frames, each saying that more parts follow, on fd (raw
 * ZMTP: flags MORE, size 0), until the peer stops taking them. */
static void send_more_frames(int fd, int n) {
  static unsigned char chunk[2 * 4096];
  for (size_t i = 0; i < sizeof chunk; i += 2) chunk[i] = 0x01, chunk[i + 1] = 0;
  for (int sent = 0; sent < n; sent += (int)sizeof chunk / 2) {
    const unsigned char *p = chunk;
    size_t left = sizeof chunk;
    while (left > 0) {
      ssize_t k = send(fd, p, left, MSG_NOSIGNAL);
      if (k < 0 && errno == EINTR) continue;
      if (k <= 0) return; /* the broker closed it: enough */
      p += k;
      left -= (size_t)k;
    }
  }
}

/*
 * ZMQ_MAXMSGSIZE bounds one frame, not a message: libzmq keeps every part
 * of a message until its last arrives, about 64 bytes of the broker's
 * memory for each 2-byte empty part, so one connection that sent parts and
 * never the last made the broker hold memory without bound (26 MB sent
 * took it from 10 MB to 770 MB).  Now a message of more parts than a
 * request could ever need closes its connection on both sockets, and the
 * broker serves on; a message of a few parts is still answered (bad_input
 * in test_tenancy).
 */
START_TEST(endless_multipart_closed) {
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", NULL);
  const char *paths[2] = {b.sock_path, b.admin_path};
  for (int s = 0; s < 2; s++) {
    int fd = raw_connect(paths[s]);
    ck_assert_int_ge(fd, 0);
    ck_assert_int_eq(zmtp_hello(fd, NULL, 0), 0);
    send_more_frames(fd, 100000);
    ck_assert_msg(count_closed(&fd, 1, HARNESS_WAIT_MS) == 1,
                  "the broker kept a connection sending endless parts (%s)",
                  paths[s]);
    close(fd);
  }
  ck_assert_int_eq(harness_broker_alive(&b), 1);
  /* 4 parts, the most a connection may send in one message: answered. */
  void *z = harness_raw_open(b.endpoint);
  for (int i = 0; i < 4; i++)
    ck_assert_int_eq(harness_raw_send(z, "x", 1, i < 3), 0);
  struct wire_reply rep;
  ck_assert_int_eq(harness_raw_recv(z, HARNESS_WAIT_MS, &rep), 0);
  ck_assert_int_eq(rep.status, GMB_E_PROTO);
  ck_assert_ptr_nonnull(strstr(rep.message, "multi-part"));
  gmb__wire_reply_clear(&rep);
  harness_raw_close(z);
  serves_after(&b);
  harness_broker_stop(&b);
}
END_TEST

/* --- row: a fake broker in another user's run dir ------------------------ */

struct fake_broker {
  char dir[96]; /* the run dir the child makes (as nobody) */
};

/* As nobody: makes f->dir (0755) and runs a real gmb-broker there, as an
 * attacker would run any program that answers the protocol. */
static int fake_broker_main(void *arg) {
  struct fake_broker *f = arg;
  CHILD_CHECK(setgroups(0, NULL) == 0, 10, "setgroups");
  CHILD_CHECK(setgid(NOBODY) == 0, 10, "setgid");
  CHILD_CHECK(setuid(NOBODY) == 0, 10, "setuid");
  CHILD_CHECK(mkdir(f->dir, 0755) == 0 || errno == EEXIST, 11, "mkdir %s: %s",
              f->dir, strerror(errno));
  char bin[PATH_MAX], log[160];
  snprintf(bin, sizeof bin, "%s/gmb-broker", harness_build_dir());
  snprintf(log, sizeof log, "%s/broker.log", f->dir);
  int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd >= 0) dup2(fd, 2);
  execl(bin, bin, "--device", "host:16MiB", "--run-dir", f->dir, (char *)0);
  return 127;
}

static int fake_broker_up(void *arg) {
  char sock[160];
  snprintf(sock, sizeof sock, "%s/broker.sock", ((struct fake_broker *)arg)->dir);
  struct stat st;
  return stat(sock, &st) == 0;
}

/* Starts nobody's fake broker in f->dir; returns its pid. */
static pid_t fake_broker_start(struct fake_broker *f) {
  pid_t kid = harness_fork(fake_broker_main, f);
  ck_assert_msg(harness_poll_until(fake_broker_up, f, HARNESS_WAIT_MS),
                "nobody's broker did not come up in %s", f->dir);
  return kid;
}

static void fake_broker_stop(struct fake_broker *f, pid_t kid) {
  kill(kid, SIGTERM);
  harness_wait(kid);
  char cmd[160];
  snprintf(cmd, sizeof cmd, "rm -rf %s", f->dir);
  ck_assert_int_eq(system(cmd), 0);
}

/*
 * A user made /tmp/gmb-UID of another user (the run dir a client falls
 * back to without XDG_RUNTIME_DIR) and ran a broker there: a client with
 * no token connected to it and wrote its "GPU memory" into the attacker's
 * memfds (the run dir was checked only before a token was sent).  Now a
 * client connects only to a run dir owned by root or itself, or one that
 * only root could have made for its owner (above it, its owner's
 * directories up to one of root's, none writable by others, as systemd
 * makes /run/gmb for a broker user and the broker makes /run/gmb/GPU-N).
 */
START_TEST(fake_broker_in_foreign_run_dir_refused) {
  if (geteuid() != 0) {
    printf("fake_broker_in_foreign_run_dir_refused: not root, so no second "
           "uid to plant a run dir; skipped\n");
    return;
  }
  unsetenv("GMB_TOKEN");
  unsetenv("GMB_TOKEN_FILE");
  struct fake_broker f;
  snprintf(f.dir, sizeof f.dir, "/tmp/gmbt-fake-%d", (int)getpid());
  pid_t kid = fake_broker_start(&f);
  char ep[160];
  snprintf(ep, sizeof ep, "ipc://%s/broker.sock", f.dir);
  gmb_client *c = NULL;
  int rc = gmb_connect(ep, "victim", &c);
  ck_assert_msg(rc == GMB_E_AUTH, "connect to nobody's run dir in /tmp = %s: %s",
                gmb_err_name(rc), gmb_last_error(NULL));
  ck_assert_ptr_null(c);
  ck_assert_ptr_nonnull(strstr(gmb_last_error(NULL), "uid 65534"));
  fake_broker_stop(&f, kid);

  /* A run dir root made for the broker's user, as systemd's
   * RuntimeDirectory= does: its parent is root's, 0755. */
  char parent[64] = "/tmp/gmbt-run-XXXXXX";
  ck_assert_ptr_nonnull(mkdtemp(parent));
  ck_assert_int_eq(chmod(parent, 0755), 0);
  snprintf(f.dir, sizeof f.dir, "%s/gmb", parent);
  ck_assert_int_eq(mkdir(f.dir, 0755), 0);
  ck_assert_int_eq(chown(f.dir, NOBODY, NOBODY), 0);
  kid = fake_broker_start(&f);
  snprintf(ep, sizeof ep, "ipc://%s/broker.sock", f.dir);
  rc = gmb_connect(ep, "ok", &c);
  ck_assert_msg(rc == 0, "connect to a run dir root made = %s: %s",
                gmb_err_name(rc), gmb_last_error(NULL));
  gmb_disconnect(c);
  fake_broker_stop(&f, kid);

  /* A broker per GPU in it, as the systemd units run them: the broker's
   * user made GPU-0 in the run dir root made for it. */
  char gmb_dir[80];
  snprintf(gmb_dir, sizeof gmb_dir, "%s/gmb", parent);
  ck_assert_int_eq(mkdir(gmb_dir, 0755), 0);
  ck_assert_int_eq(chown(gmb_dir, NOBODY, NOBODY), 0);
  snprintf(f.dir, sizeof f.dir, "%s/GPU-0", gmb_dir);
  ck_assert_int_eq(mkdir(f.dir, 0755), 0);
  ck_assert_int_eq(chown(f.dir, NOBODY, NOBODY), 0);
  kid = fake_broker_start(&f);
  snprintf(ep, sizeof ep, "ipc://%s/broker.sock", f.dir);
  rc = gmb_connect(ep, "ok", &c);
  ck_assert_msg(rc == 0, "connect to a GPU's dir in a run dir root made = "
                "%s: %s", gmb_err_name(rc), gmb_last_error(NULL));
  gmb_disconnect(c);
  fake_broker_stop(&f, kid);
  /* ...but not when a third uid owns the dir between them. */
  ck_assert_int_eq(chown(gmb_dir, NOBODY - 1, NOBODY - 1), 0);
  ck_assert_int_eq(mkdir(f.dir, 0755), 0);
  ck_assert_int_eq(chown(f.dir, NOBODY, NOBODY), 0);
  kid = fake_broker_start(&f);
  rc = gmb_connect(ep, "ok", &c);
  ck_assert_msg(rc == GMB_E_AUTH, "connect through another uid's dir = %s: "
                "%s", gmb_err_name(rc), gmb_last_error(NULL));
  ck_assert_ptr_null(c);
  fake_broker_stop(&f, kid);
  ck_assert_int_eq(rmdir(gmb_dir), 0);
  ck_assert_int_eq(rmdir(parent), 0);
}
END_TEST

/* --- row: a flood of the admin socket ------------------------------------ */

/* A child that holds n idle connections (to a Unix socket's path, or
 * to a TCP port of 127.0.0.1) until the test says go. */
struct flood {
  const char *path; /* NULL: TCP to port */
  int port, n, as_nobody;
  int ready[2], done[2]; /* child -> parent: opened; parent -> child: go */
  pid_t kid;
};

static int tcp_connect(int port);

static int flood_main(void *arg) {
  struct flood *f = arg;
  if (f->as_nobody) {
    CHILD_CHECK(setgroups(0, NULL) == 0, 10, "setgroups");
    CHILD_CHECK(setgid(NOBODY) == 0, 10, "setgid");
    CHILD_CHECK(setuid(NOBODY) == 0, 10, "setuid");
  }
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0) {
    rl.rlim_cur = rl.rlim_max;
    setrlimit(RLIMIT_NOFILE, &rl);
  }
  int opened = 0;
  for (int i = 0; i < f->n; i++)
    if ((f->path ? raw_connect(f->path) : tcp_connect(f->port)) >= 0) opened++;
  CHILD_CHECK(opened > 0, 11, "no connection opened");
  harness_pipe_send(f->ready[1], 'r');
  CHILD_CHECK(harness_pipe_wait(f->done[0], HARNESS_WAIT_MS) == 'g', 12,
              "no word from the test");
  return 0; /* exit closes them all */
}

/* Starts f's child and waits until its connections are open. */
static void flood_start(struct flood *f) {
  ck_assert_int_eq(pipe(f->ready), 0);
  ck_assert_int_eq(pipe(f->done), 0);
  f->kid = harness_fork(flood_main, f);
  ck_assert_int_eq(harness_pipe_wait(f->ready[0], HARNESS_WAIT_MS), 'r');
}

/* Lets f's child go, and fails unless it held its connections till then. */
static void flood_stop(struct flood *f) {
  harness_pipe_send(f->done[1], 'g');
  ck_assert_int_eq(harness_wait(f->kid), 0);
  close(f->ready[0]);
  close(f->ready[1]);
  close(f->done[0]);
  close(f->done[1]);
}

static int log_has_admin_refused(void *arg) {
  char *log = harness_broker_log(arg);
  int yes = log && strstr(log, "connections to the admin socket past");
  free(log);
  return yes;
}

/* Floods b's admin socket with 600 bare connections from this uid or
 * nobody; returns how many descriptors the broker gained meanwhile. */
static int admin_flood(struct harness_broker *b, int as_nobody) {
  struct flood f = {.path = b->admin_path, .n = 600, .as_nobody = as_nobody};
  int before = harness_fds_of(b->pid);
  flood_start(&f);
  ck_assert_msg(harness_poll_until(log_has_admin_refused, b, HARNESS_WAIT_MS),
                "the broker did not say it refused admin connections");
  int gained = harness_fds_of(b->pid) - before;
  ck_assert_int_eq(harness_broker_alive(b), 1);
  if (as_nobody) { /* the operator gets in during nobody's flood */
    struct wire_reply st;
    ck_assert_int_eq(harness_admin_status(b, &st), 0);
    gmb__wire_reply_clear(&st);
  }
  flood_stop(&f);
  return gained;
}

static int admin_status_ok(void *arg) {
  struct wire_reply st;
  int rc = harness_admin_status(arg, &st);
  if (rc == 0) gmb__wire_reply_clear(&st);
  return rc == 0;
}

/*
 * The admin socket's connections were not counted: a user flooding it
 * (0666 when admin_uids names another uid) held 20,000 of the broker's
 * descriptors, and clients and gmbctl timed out.  Now an operator's uid
 * holds 64 at most, any other uid 4, and other uids together 64; the
 * operator gets in during another uid's flood and clients are served.
 */
START_TEST(admin_flood_capped) {
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", "[broker]\nadmin_uids = 0,4242\n");
  int gained = admin_flood(&b, 0);
  ck_assert_msg(gained <= 64 + 8, "the broker holds %d more descriptors "
                "under this uid's admin flood", gained);
  ck_assert_msg(harness_poll_until(admin_status_ok, &b, HARNESS_WAIT_MS),
                "the operator did not get in after the flood");
  if (geteuid() == 0) {
    gained = admin_flood(&b, 1);
    ck_assert_msg(gained <= 64 + 8, "the broker holds %d more descriptors "
                  "under nobody's admin flood", gained);
  } else {
    printf("admin_flood_capped: not root, so no flood from another uid\n");
  }
  gmb_client *c = harness_connect_ok(&b, "after");
  gmb_disconnect(c);
  harness_broker_stop(&b);
}
END_TEST

/* --- row: the metrics port ------------------------------------------------ */

static int tcp_connect(int port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  struct sockaddr_in a = {.sin_family = AF_INET,
                          .sin_port = htons((uint16_t)port),
                          .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  if (fd >= 0 && connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
    close(fd);
    fd = -1;
  }
  return fd;
}

static char metrics_out[1 << 17];

/* A broker serving metrics on a free loopback port; the port. */
static int metrics_broker_start(struct harness_broker *b) {
  int port = harness_free_port();
  char cfg[128];
  snprintf(cfg, sizeof cfg, "[broker]\nmetrics_listen = 127.0.0.1:%d\n", port);
  harness_broker_start(b, "host:64MiB", cfg);
  return port;
}

/*
 * The metrics port served any local user every tenant's name, usage and
 * sessions, and 64 idle connections (kept 10 s each) made everyone's
 * scrapes fail.  Now the HTTP endpoint shows totals only unless
 * metrics_tenants is set (gmbctl metrics, for operators, shows all), and
 * each local uid holds 4 connections at most, so nobody's 100 idle
 * connections leave root's scrape served.
 */
START_TEST(metrics_port_bounded_and_private) {
  struct harness_broker b;
  int port = metrics_broker_start(&b);
  gmb_client *c = harness_connect_ok(&b, "secret-project");
  gmb_id id = harness_alloc_ok(c, MIB);
  int code = 0;
  for (int i = 0; i < 100; i++) {
    code = harness_http_get(port, "GET", "/metrics", metrics_out, sizeof metrics_out);
    if (code == 200 && strstr(metrics_out, "gmb_device_used_bytes 1048576"))
      break;
    harness_sleep_ms(50); /* the loop publishes about once a second */
  }
  ck_assert_int_eq(code, 200);
  ck_assert_msg(strstr(metrics_out, "gmb_device_used_bytes 1048576"), "%s",
                metrics_out);
  ck_assert_msg(!strstr(metrics_out, "secret-project") &&
                    !strstr(metrics_out, "tenant=\""),
                "the HTTP endpoint names tenants:\n%s", metrics_out);
  /* The operator's view has them. */
  int rc = harness_ctl(&b, metrics_out, sizeof metrics_out, "metrics", NULL);
  ck_assert_int_eq(rc, 0);
  ck_assert_ptr_nonnull(strstr(metrics_out, "tenant=\"secret-project\""));
  if (geteuid() == 0) {
    struct flood f = {.port = port, .n = 100, .as_nobody = 1};
    flood_start(&f);
    code = harness_http_get(port, "GET", "/metrics", metrics_out, sizeof metrics_out);
    ck_assert_msg(code == 200, "a scrape during nobody's flood got %d", code);
    flood_stop(&f);
  } else {
    printf("metrics_port_bounded_and_private: not root, so no flood from "
           "another uid\n");
  }
  ck_assert_int_eq(gmb_free(c, id), 0);
  gmb_disconnect(c);
  harness_broker_stop(&b);
}
END_TEST

/*
 * libmicrohttpd's timeout counts idle time only, so a uid's 4 connections
 * each sending a header byte every half second held its every place on
 * the metrics port for ever (and 16 uids' together every scrape's).  Now
 * each connection is closed 5 s after its accept, whatever it sends, and
 * the same uid's scrape is served afterwards.
 */
START_TEST(metrics_trickling_request_closed) {
  struct harness_broker b;
  int port = metrics_broker_start(&b);
  static const char head[] = "GET /metrics HTTP/1.1\r\nHost: localhost\r\n"
                             "X-Slow: ";
  int fd[4], open = 0, sent = 0;
  for (int i = 0; i < 4; i++) {
    fd[i] = tcp_connect(port);
    ck_assert_int_ge(fd[i], 0);
    ck_assert_int_eq(write(fd[i], head, sizeof head - 1),
                     (ssize_t)sizeof head - 1);
    open++;
  }
  for (; sent < 40 && open; sent++) { /* 40 half seconds */
    harness_sleep_ms(500);
    for (int i = 0; i < 4; i++) {
      if (fd[i] < 0) continue;
      struct pollfd p = {fd[i], POLLIN, 0};
      char c;
      int closed = poll(&p, 1, 0) == 1 && read(fd[i], &c, 1) <= 0;
      if (!closed && send(fd[i], "x", 1, MSG_NOSIGNAL) != 1)
        closed = 1; /* EPIPE */
      if (closed) {
        close(fd[i]);
        fd[i] = -1;
        open--;
      }
    }
  }
  for (int i = 0; i < 4; i++)
    if (fd[i] >= 0) close(fd[i]);
  ck_assert_msg(open == 0, "%d of 4 connections that trickled a byte every "
                "0.5 s were still open after %d bytes", open, sent);
  printf("metrics_trickling_request_closed: closed after %d bytes\n", sent);
  ck_assert_int_eq(harness_broker_alive(&b), 1);
  int code = 0;
  for (int i = 0; i < 100 && code != 200; i++) {
    code = harness_http_get(port, "GET", "/metrics", metrics_out,
                            sizeof metrics_out);
    if (code != 200) harness_sleep_ms(50);
  }
  ck_assert_int_eq(code, 200);
  harness_broker_stop(&b);
}
END_TEST

/* --- row: a safe default for tenants made by first use ------------------- */

/*
 * With the default config (default_quota = 0), one user's first-use
 * tenant may take the whole device.  The built-in default stays (the
 * documented contract, and what a single-user machine wants), but the
 * broker says so at start, and `default_quota = auto` (what the shipped
 * configs use) gives each uid's first-use tenants a quarter of the device
 * together: here 16 MiB of 64 MiB.
 */
START_TEST(default_quota_auto_bounds_first_use_tenants) {
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", NULL);
  char *log = harness_broker_log(&b);
  ck_assert_ptr_nonnull(log);
  ck_assert_msg(strstr(log, "default_quota is 0: a tenant the config does "
                            "not name may take the whole device"), "%s", log);
  free(log);
  harness_broker_stop(&b);

  harness_broker_start(&b, "host:64MiB", "[broker]\ndefault_quota = auto\n");
  log = harness_broker_log(&b);
  ck_assert_ptr_nonnull(strstr(log, "default_quota: 16MiB"));
  free(log);
  gmb_client *c = harness_connect_ok(&b, "first-use");
  gmb_id id = 0;
  int rc = gmb_alloc(c, 20 * MIB, 0, &id);
  ck_assert_msg(rc == GMB_E_QUOTA, "20 MiB of a first-use tenant = %s",
                gmb_err_name(rc));
  gmb_id a = harness_alloc_ok(c, 8 * MIB);
  /* Another name of the same uid shares the budget. */
  gmb_client *d = harness_connect_ok(&b, "first-use-2");
  rc = gmb_alloc(d, 10 * MIB, 0, &id);
  ck_assert_msg(rc == GMB_E_QUOTA, "past the uid's budget = %s",
                gmb_err_name(rc));
  gmb_id e = harness_alloc_ok(d, 8 * MIB);
  ck_assert_int_eq(gmb_free(c, a), 0);
  ck_assert_int_eq(gmb_free(d, e), 0);
  gmb_disconnect(d);
  gmb_disconnect(c);
  harness_broker_stop(&b);
}
END_TEST

int main(void) {
  return harness_main(HARNESS_SUITE("security", "security", 60,
                                    peer_chosen_routing_ids_refused,
                                    endless_multipart_closed,
                                    fake_broker_in_foreign_run_dir_refused,
                                    admin_flood_capped,
                                    metrics_port_bounded_and_private,
                                    metrics_trickling_request_closed,
                                    default_quota_auto_bounds_first_use_tenants));
}
