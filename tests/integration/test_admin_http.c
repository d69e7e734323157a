/*
 * test_admin_http.c - operators' sleep and wake over HTTP, as vLLM's
 * /sleep, /wake_up and /is_sleeping, on admin-http.sock, against a real
 * broker on the host device and a real client process with tagged memory:
 * a sleep pauses the client's tags in vLLM's level's modes (level 1: the
 * weights offloaded, the KV cache dropped; level 2: both dropped), a wake
 * brings every byte of the weights back at its address, /is_sleeping says
 * so; bad requests are answered 400/404/405/414 and change nothing, and a
 * connection that trickles its request is closed all the same; a uid
 * that is no operator gets 403 and nothing happens, and its flood of
 * connections is capped, as are many such uids' together, while an
 * operator is served; admin_http = no serves nothing.
 *
 * Tests that need a second uid run a child as uid 65534 when the test
 * runs as root (CI does), and say on stdout what they skipped otherwise.
 */
#include <check.h>
#include <errno.h>
#include <grp.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "gmb.h"
#include "harness.h"
#include "wire.h"

#define MIB (UINT64_C(1) << 20)
#define NOBODY 65534
#define W_SIZE (6 * MIB)
#define KV_SIZE (4 * MIB)

static char body[1 << 16];

/* The broker's admin-http.sock. */
static const char *sock_of(const struct harness_broker *b) {
  static char path[160];
  snprintf(path, sizeof path, "%s/admin-http.sock", b->dir);
  return path;
}

/* One request to b as this process's uid: the status code. */
static int http(const struct harness_broker *b, const char *method,
                const char *target) {
  return harness_http_unix(sock_of(b), method, target, body, sizeof body);
}

/* A job of tenant "llm" (the child): "weights" and "kv_cache" tags, each
 * filled with a pattern; says 'r'.  On 'c' it checks the weights' bytes
 * at their old address and says 'k' (or 'x'); on 'q' it exits. */
struct job {
  const char *endpoint;
  int in, out;
};

static int job_main(void *arg) {
  struct job *j = arg;
  gmb_client *c;
  CHILD_CHECK(gmb_connect(j->endpoint, "llm", &c) == 0, 10, "%s",
              gmb_last_error(NULL));
  void *w, *kv;
  CHILD_CHECK(gmb_cache_tag(c, "weights") == 0, 11, "tag");
  CHILD_CHECK(gmb_malloc_async(c, W_SIZE, NULL, &w) == 0, 12, "%s",
              gmb_last_error(c));
  harness_pattern_fill(w, W_SIZE, 5);
  CHILD_CHECK(gmb_cache_tag(c, "kv_cache") == 0, 13, "tag");
  CHILD_CHECK(gmb_malloc_async(c, KV_SIZE, NULL, &kv) == 0, 14, "%s",
              gmb_last_error(c));
  harness_pattern_fill(kv, KV_SIZE, 6);
  gmb_cache_tag(c, NULL);
  harness_pipe_send(j->out, 'r');
  for (;;) {
    int cmd = harness_pipe_wait(j->in, 60000);
    if (cmd != 'c') break;
    harness_pipe_send(j->out,
                      harness_pattern_check(w, W_SIZE, 5) < 0 ? 'k' : 'x');
  }
  gmb_disconnect(c);
  return 0;
}

struct jobrun {
  struct job j;
  int to[2], from[2];
  pid_t pid;
};

static void job_start(struct jobrun *r, const struct harness_broker *b) {
  ck_assert_int_eq(pipe(r->to), 0);
  ck_assert_int_eq(pipe(r->from), 0);
  r->j = (struct job){b->endpoint, r->to[0], r->from[1]};
  r->pid = harness_fork(job_main, &r->j);
  ck_assert_int_eq(harness_pipe_wait(r->from[0], HARNESS_WAIT_MS), 'r');
}

static int job_bytes_ok(struct jobrun *r) {
  harness_pipe_send(r->to[1], 'c');
  return harness_pipe_wait(r->from[0], HARNESS_WAIT_MS) == 'k';
}

static void job_end(struct jobrun *r) {
  harness_pipe_send(r->to[1], 'q');
  ck_assert_int_eq(harness_wait(r->pid), 0);
  for (int i = 0; i < 2; i++) {
    close(r->to[i]);
    close(r->from[i]);
  }
}

/* Polls until tenant llm has `tags` paused tags and `used` bytes on the
 * device (a pause is reported before its pages go back). */
struct tags_wait {
  const struct harness_broker *b;
  uint32_t tags;
  uint64_t used;
};

static int tags_seen(void *arg) {
  struct tags_wait *t = arg;
  struct wire_tenant_row r;
  return harness_tenant_row(t->b, "llm", &r) == 0 && r.paused_tags == t->tags &&
         r.used == t->used;
}

static struct wire_tenant_row wait_tags(const struct harness_broker *b,
                                        uint32_t tags, uint64_t used) {
  struct tags_wait t = {b, tags, used};
  ck_assert_msg(harness_poll_until(tags_seen, &t, HARNESS_WAIT_MS),
                "tenant llm never had %u paused tags and %llu bytes used",
                tags, (unsigned long long)used);
  struct wire_tenant_row r;
  ck_assert_int_eq(harness_tenant_row(b, "llm", &r), 0);
  return r;
}

static const char *const llm_config = "[tenant:llm]\nquota = 32MiB\n";

/* What a vLLM-style controller does: sleep (level 1, then 2), ask, wake. */
START_TEST(sleep_and_wake_up_over_http) {
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", llm_config);
  struct jobrun j;
  job_start(&j, &b);

  ck_assert_int_eq(http(&b, "GET", "/is_sleeping?tenant=llm"), 200);
  ck_assert_msg(strstr(body, "\"is_sleeping\":false"), "%s", body);

  /* Level 1: weights to host memory, the KV cache dropped. */
  ck_assert_int_eq(http(&b, "POST", "/sleep?tenant=llm&level=1"), 200);
  ck_assert_msg(strstr(body, "\"sessions\":1") &&
                    strstr(body, "\"weights\":\"offload\"") &&
                    strstr(body, "\"kv_cache\":\"discard\""),
                "%s", body);
  struct wire_tenant_row r = wait_tags(&b, 2, 0);
  ck_assert_uint_ge(r.host_bytes, W_SIZE);
  ck_assert_uint_lt(r.host_bytes, W_SIZE + KV_SIZE); /* kv_cache: none */
  ck_assert_int_eq(http(&b, "GET", "/is_sleeping?tenant=llm"), 200);
  ck_assert_msg(strstr(body, "\"is_sleeping\":true") &&
                    strstr(body, "\"weights\"") && strstr(body, "\"kv_cache\""),
                "%s", body);
  char want[64];
  snprintf(want, sizeof want, "\"host_bytes\":%llu",
           (unsigned long long)r.host_bytes);
  ck_assert_msg(strstr(body, want), "%s lacks %s", body, want);
  ck_assert_int_eq(http(&b, "GET", "/is_sleeping?tenant=llm&tag=weights"),
                   200);
  ck_assert_msg(strstr(body, "\"is_sleeping\":true"), "%s", body);
  ck_assert_int_eq(http(&b, "GET", "/is_sleeping?tenant=llm&tag=other"), 200);
  ck_assert_msg(strstr(body, "\"is_sleeping\":false"), "%s", body);

  /* Wake every tag: the weights' bytes are back at their address. */
  ck_assert_int_eq(http(&b, "POST", "/wake_up?tenant=llm"), 200);
  wait_tags(&b, 0, W_SIZE + KV_SIZE);
  ck_assert_int_eq(job_bytes_ok(&j), 1);
  ck_assert_int_eq(http(&b, "GET", "/is_sleeping?tenant=llm"), 200);
  ck_assert_msg(strstr(body, "\"is_sleeping\":false"), "%s", body);

  /* A tag by name, with the tool a controller script would use. */
  if (access("/usr/bin/curl", X_OK) == 0) {
    char out[4096];
    char *argv[] = {"/usr/bin/curl", "-s", "-X", "POST", "--unix-socket",
                    (char *)sock_of(&b),
                    "http://localhost/sleep?tenant=llm&tag=weights", NULL};
    ck_assert_int_eq(harness_run(argv, out, sizeof out), 0);
    ck_assert_msg(strstr(out, "\"asked\":{\"weights\":\"offload\"}"), "%s",
                  out);
    r = wait_tags(&b, 1, KV_SIZE);
    ck_assert_uint_ge(r.host_bytes, W_SIZE);
    ck_assert_int_eq(http(&b, "POST", "/wake_up?tenant=llm&tags=weights"),
                     200);
    wait_tags(&b, 0, W_SIZE + KV_SIZE);
    ck_assert_int_eq(job_bytes_ok(&j), 1);
  } else {
    printf("sleep_and_wake_up_over_http: no /usr/bin/curl, its part "
           "skipped\n");
  }
  /* Level 2: both dropped, nothing in host memory (the weights' bytes
   * with them: a server reloads them); woken by name. */
  ck_assert_int_eq(http(&b, "POST", "/sleep?tenant=llm&level=2"), 200);
  r = wait_tags(&b, 2, 0);
  ck_assert_uint_eq(r.host_bytes, 0);
  ck_assert_int_eq(
      http(&b, "POST", "/wake_up?tenant=llm&tags=weights&tags=kv_cache"), 200);
  wait_tags(&b, 0, W_SIZE + KV_SIZE);

  job_end(&j);
  harness_broker_stop(&b);
}
END_TEST

/* Bad requests: each answered with its code and a JSON reason; nothing is
 * asked of the tenant, and the broker serves on. */
START_TEST(bad_requests_refused) {
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", llm_config);
  static const struct {
    const char *method, *target;
    int code;
    const char *says;
  } bad[] = {
      {"POST", "/sleep", 400, "needs tenant"},
      {"POST", "/sleep?tenant", 400, "no value"},
      {"POST", "/sleep?tenant=llm&level=3", 400, "level must be 1 or 2"},
      {"POST", "/sleep?tenant=llm&level=1&level=2", 400, "given twice"},
      {"POST", "/sleep?tenant=llm&tenant=other", 400, "given twice"},
      {"POST", "/sleep?tenant=llm&foo=1", 400, "unknown query argument"},
      {"POST", "/sleep?tenant=llm&f%ff=1", 400, "unknown query argument 'f?'"},
      /* A %00 would end the C string: each would act on tenant llm. */
      {"POST", "/sleep%00x?tenant=llm", 400, "NUL byte"},
      {"POST", "/sleep?tenant=llm%00x", 400, "NUL byte"},
      {"POST", "/sleep?tenant%00x=llm", 400, "NUL byte"},
      {"POST", "/sleep?tenant=llm&tag=weights%00", 400, "NUL byte"},
      {"POST", "/wake_up?tenant=llm&tags=%00", 400, "NUL byte"},
      {"POST", "/sleep?tenant=llm&tag=a&tag=a", 400, "given twice"},
      {"POST", "/sleep?tenant=llm&tag=1&tag=2&tag=3&tag=4&tag=5&tag=6&tag=7"
               "&tag=8&tag=9", 400, "more than 8 tags"},
      {"POST", "/sleep?tenant=..", 400, "bad tenant name"},
      {"POST", "/wake_up?tenant=llm&level=1", 400, "no level"},
      {"GET", "/is_sleeping?tenant=llm&tag=a&tag=b", 400, "one tag"},
      {"POST", "/sleep?tenant=nobody-here", 404, "no tenant"},
      {"GET", "/is_sleeping?tenant=nobody-here", 404, "no tenant"},
      {"GET", "/metrics", 404, "no such endpoint"},
      {"GET", "/sleep?tenant=llm", 405, "takes POST"},
      {"POST", "/is_sleeping?tenant=llm", 405, "takes GET"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    int code = http(&b, bad[i].method, bad[i].target);
    ck_assert_msg(code == bad[i].code && strstr(body, bad[i].says) &&
                      strstr(body, "\"error\""),
                  "%s %s: %d %s", bad[i].method, bad[i].target, code, body);
  }
  /* A query past the connection's memory: libmicrohttpd answers it
   * itself. */
  char target[12000];
  int n;
  n = snprintf(target, sizeof target, "/sleep?tenant=");
  memset(target + n, 'a', sizeof target - (size_t)n - 1);
  target[sizeof target - 1] = '\0';
  int code = http(&b, "POST", target);
  ck_assert_msg(code == 414 || code == 431, "a 12 KB query: %d", code);

  ck_assert_int_eq(harness_broker_alive(&b), 1);
  char *log = harness_broker_log(&b);
  ck_assert_ptr_nonnull(log);
  ck_assert_msg(!strstr(log, "asked tenant"), "a bad request acted:\n%s", log);
  free(log);
  ck_assert_int_eq(http(&b, "GET", "/is_sleeping?tenant=llm"), 200);
  harness_broker_stop(&b);
}
END_TEST

/*
 * A peer that sends its request a byte at a time, each well within the
 * idle timeout (a slowloris), is closed all the same: a connection lives
 * 5 s from its accept.  Before that bound it held its place for as long
 * as it trickled; here it trickles for up to 4 times the bound.
 */
START_TEST(trickling_request_closed) {
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", llm_config);
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  struct sockaddr_un a = {.sun_family = AF_UNIX};
  const char *path = sock_of(&b);
  ck_assert_uint_lt(strlen(path), sizeof a.sun_path);
  memcpy(a.sun_path, path, strlen(path) + 1);
  ck_assert_int_eq(connect(fd, (struct sockaddr *)&a, sizeof a), 0);
  static const char head[] = "GET /is_sleeping?tenant=llm HTTP/1.1\r\n"
                             "Host: localhost\r\nX-Slow: ";
  ck_assert_int_eq(write(fd, head, sizeof head - 1), (ssize_t)sizeof head - 1);
  int closed = 0, sent = 0;
  for (; sent < 40 && !closed; sent++) { /* 40 half seconds */
    harness_sleep_ms(500);
    struct pollfd p = {fd, POLLIN, 0};
    if (poll(&p, 1, 0) == 1) {
      char c;
      closed = read(fd, &c, 1) <= 0; /* its end, or a reset */
    }
    if (!closed && send(fd, "x", 1, MSG_NOSIGNAL) != 1)
      closed = 1; /* EPIPE */
  }
  close(fd);
  ck_assert_msg(closed, "a connection that trickled a byte every 0.5 s "
                "was still open after %d bytes", sent);
  printf("trickling_request_closed: closed after %d bytes\n", sent);
  ck_assert_int_eq(harness_broker_alive(&b), 1);
  ck_assert_int_eq(http(&b, "GET", "/is_sleeping?tenant=llm"), 200);
  harness_broker_stop(&b);
}
END_TEST

/* --- a uid that is no operator --------------------------------------------- */

static int become_nobody(void) {
  return setgroups(0, NULL) == 0 && setgid(NOBODY) == 0 &&
                 setuid(NOBODY) == 0
             ? 0
             : -1;
}

struct nobody {
  const char *sock;
  int code;    /* of its request */
  int ready[2], done[2];
};

/* As nobody: one request (its code in the exit status: 0 for 403, 1 for
 * EACCES, else 20 + code / 100), then 40 bare connections held until the
 * test says. */
static int nobody_main(void *arg) {
  struct nobody *n = arg;
  CHILD_CHECK(become_nobody() == 0, 10, "cannot become uid %d", NOBODY);
  static char out[4096];
  int code = harness_http_unix(n->sock, "POST", "/sleep?tenant=llm", out,
                               sizeof out);
  int status = code == 403 && strstr(out, "not an operator") ? 0
               : code == -EACCES                              ? 1
                                                 : 20 + (code > 0 ? code / 100 : 0);
  if (status == 1) return status;
  for (int i = 0; i < 40; i++) {
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    snprintf(a.sun_path, sizeof a.sun_path, "%s", n->sock);
    if (fd >= 0) connect(fd, (struct sockaddr *)&a, sizeof a);
  }
  harness_pipe_send(n->ready[1], 'r');
  harness_pipe_wait(n->done[0], HARNESS_WAIT_MS);
  return status;
}

static int log_says_capped(void *arg) {
  char *log = harness_broker_log(arg);
  int yes = log && strstr(log, "connections to admin-http.sock past its caps");
  free(log);
  return yes;
}

/*
 * With admin_uids naming another uid the socket is 0666, as admin.sock:
 * nobody connects, gets 403, and nothing is asked of the tenant; its 40
 * connections are capped at 2 while the operator is served.  With the
 * default admin_uids the socket is 0600: nobody cannot connect at all.
 */
START_TEST(non_operator_refused) {
  if (geteuid() != 0) {
    printf("non_operator_refused: not root, so no second uid; skipped\n");
    return;
  }
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB",
                       "[broker]\nadmin_uids = 0,4242\n[tenant:llm]\n");
  struct stat st;
  ck_assert_int_eq(stat(sock_of(&b), &st), 0);
  ck_assert_uint_eq(st.st_mode & 0777, 0666);
  struct nobody n = {.sock = sock_of(&b)};
  ck_assert_int_eq(pipe(n.ready), 0);
  ck_assert_int_eq(pipe(n.done), 0);
  int before = harness_fds_of(b.pid);
  pid_t kid = harness_fork(nobody_main, &n);
  ck_assert_int_eq(harness_pipe_wait(n.ready[0], HARNESS_WAIT_MS), 'r');
  ck_assert_msg(harness_poll_until(log_says_capped, &b, HARNESS_WAIT_MS),
                "the broker did not say it refused connections");
  int gained = harness_fds_of(b.pid) - before;
  printf("non_operator_refused: nobody's 40 connections left the broker "
         "%d descriptors more\n", gained);
  /* 2 are nobody's; 2 more of slack for connections in flight. */
  ck_assert_msg(gained <= 4, "nobody holds %d of the broker's descriptors",
                gained);
  ck_assert_int_eq(http(&b, "GET", "/is_sleeping?tenant=llm"), 200);
  harness_pipe_send(n.done[1], 'g');
  ck_assert_int_eq(harness_wait(kid), 0); /* its request got 403 */
  char *log = harness_broker_log(&b);
  ck_assert_ptr_nonnull(strstr(log, "from uid 65534 refused: not an operator"));
  ck_assert_msg(!strstr(log, "asked tenant"), "nobody's request acted");
  free(log);
  harness_broker_stop(&b);

  harness_broker_start(&b, "host:64MiB", "[tenant:llm]\n");
  ck_assert_int_eq(stat(sock_of(&b), &st), 0);
  ck_assert_uint_eq(st.st_mode & 0777, 0600);
  kid = harness_fork(nobody_main, &n);
  ck_assert_int_eq(harness_wait(kid), 1); /* EACCES */
  for (int i = 0; i < 2; i++) {
    close(n.ready[i]);
    close(n.done[i]);
  }
  harness_broker_stop(&b);
}
END_TEST

/* Many uids that are no operator's, each with a few connections that
 * send a request's first line and nothing more (a slowloris from many
 * uids at once). */
#define MANY_UIDS 20
#define MANY_EACH 4

struct many {
  const char *sock;
  uid_t uid;
  int ready[2], done[2];
};

static int many_main(void *arg) {
  struct many *m = arg;
  close(m->ready[0]);
  close(m->done[1]); /* the test's close of its end is the signal */
  CHILD_CHECK(setgroups(0, NULL) == 0 && setgid(m->uid) == 0 &&
                  setuid(m->uid) == 0,
              10, "cannot become uid %u", (unsigned)m->uid);
  static const char line[] = "GET /is_sleeping?tenant=llm HTTP/1.1\r\n";
  for (int i = 0; i < MANY_EACH; i++) {
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    snprintf(a.sun_path, sizeof a.sun_path, "%s", m->sock);
    if (fd >= 0 && connect(fd, (struct sockaddr *)&a, sizeof a) == 0)
      (void)!send(fd, line, sizeof line - 1, MSG_NOSIGNAL);
  }
  harness_pipe_send(m->ready[1], 'r');
  harness_pipe_wait(m->done[0], HARNESS_WAIT_MS);
  return 0;
}

/*
 * 20 uids that are no operator's, 4 connections each: each uid keeps 2,
 * and all of them together 16, so their 80 connections leave the broker
 * at most 16 descriptors more (the test allows 4 of slack) while an
 * operator is served.
 */
START_TEST(other_uids_capped_together) {
  if (geteuid() != 0) {
    printf("other_uids_capped_together: not root, so no other uids; "
           "skipped\n");
    return;
  }
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB",
                       "[broker]\nadmin_uids = 0,4242\n[tenant:llm]\n");
  struct many m = {.sock = sock_of(&b)};
  ck_assert_int_eq(pipe(m.ready), 0);
  ck_assert_int_eq(pipe(m.done), 0);
  int before = harness_fds_of(b.pid);
  pid_t kids[MANY_UIDS];
  for (int i = 0; i < MANY_UIDS; i++) {
    m.uid = (uid_t)(61000 + i);
    kids[i] = harness_fork(many_main, &m);
  }
  for (int i = 0; i < MANY_UIDS; i++)
    ck_assert_int_eq(harness_pipe_wait(m.ready[0], HARNESS_WAIT_MS), 'r');
  ck_assert_msg(harness_poll_until(log_says_capped, &b, HARNESS_WAIT_MS),
                "the broker did not say it refused connections");
  int gained = harness_fds_of(b.pid) - before;
  printf("other_uids_capped_together: %d uids' %d connections left the "
         "broker %d descriptors more\n", MANY_UIDS, MANY_UIDS * MANY_EACH,
         gained);
  ck_assert_msg(gained <= 16 + 4, "other uids hold %d of the broker's "
                "descriptors", gained);
  ck_assert_int_eq(http(&b, "GET", "/is_sleeping?tenant=llm"), 200);
  close(m.done[1]);
  for (int i = 0; i < MANY_UIDS; i++) ck_assert_int_eq(harness_wait(kids[i]), 0);
  close(m.ready[0]);
  close(m.ready[1]);
  close(m.done[0]);
  ck_assert_int_eq(harness_broker_alive(&b), 1);
  harness_broker_stop(&b);
}
END_TEST

/* admin_http = no: no socket, and the broker runs as before. */
START_TEST(admin_http_off) {
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", "[broker]\nadmin_http = no\n");
  ck_assert_int_eq(access(sock_of(&b), F_OK), -1);
  ck_assert_int_eq(http(&b, "GET", "/is_sleeping?tenant=x"), -ENOENT);
  gmb_client *c = harness_connect_ok(&b, "x");
  gmb_disconnect(c);
  harness_broker_stop(&b);
}
END_TEST

int main(void) {
  return harness_main(HARNESS_SUITE("admin_http", "admin_http", 60,
                                    sleep_and_wake_up_over_http,
                                    bad_requests_refused,
                                    trickling_request_closed,
                                    non_operator_refused,
                                    other_uids_capped_together,
                                    admin_http_off));
}
