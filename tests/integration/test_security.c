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
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
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
  memcpy(cmd + n, id, idlen);
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
  gmb_client *c = harness_connect_ok(&b, "after");
  gmb_id id = harness_alloc_ok(c, MIB);
  ck_assert_int_eq(gmb_free(c, id), 0);
  gmb_disconnect(c);
  struct wire_reply st;
  ck_assert_int_eq(harness_admin_status(&b, &st), 0);
  gmb__wire_reply_clear(&st);
  for (int i = 0; i < ANON; i++) close(anon[i]);
  for (int i = 0; i < nfd; i++) close(fds[i]);
  harness_broker_stop(&b);
}
END_TEST

int main(void) {
  return harness_main(HARNESS_SUITE("security", "security", 60,
                                    peer_chosen_routing_ids_refused));
}
