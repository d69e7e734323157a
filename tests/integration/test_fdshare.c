/*
 * test_fdshare.c - memory shared as descriptors, end to end: a real broker
 * on the host device, real client processes, and raw clients that do what
 * a hostile local user would with what they are given.
 *
 * What it shows: nothing of gmb's appears in /dev/shm while clients hold
 * memory; the broker's descriptors come back to their idle count when the
 * sessions end; what a client receives is sealed (ftruncate, shrinking or
 * growing, fails), so the broker keeps serving and compacting; a process
 * of another uid that knows a session's id and secret still gets nothing;
 * a client in another PID namespace than the broker's allocates, writes,
 * reads, and is reclaimed when killed (its descriptor channel hangs up);
 * a broker killed with SIGKILL as PID 1 of a namespace takes its memory
 * with it and the next PID 1 allocates the whole device; an evicted
 * process that still runs keeps its own bytes, never another tenant's;
 * and a process whose uid a reload revoked keeps its mappings but finds
 * none of the tenant's later data there.
 */
#include <check.h>
#include <jansson.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "fdpass.h"
#include "gmb.h"
#include "harness.h"

#define MIB (UINT64_C(1) << 20)

/* Entries of /dev/shm whose name contains "gmb". */
static int shm_gmb_entries(void) {
  DIR *d = opendir("/dev/shm");
  if (d == NULL) return 0;
  int n = 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL)
    if (strstr(e->d_name, "gmb")) n++;
  closedir(d);
  return n;
}

/* Open descriptors of process pid. */
static int fd_count(pid_t pid) {
  char path[64];
  snprintf(path, sizeof path, "/proc/%ld/fd", (long)pid);
  DIR *d = opendir(path);
  if (d == NULL) return -1;
  int n = 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL)
    if (e->d_name[0] != '.') n++;
  closedir(d);
  return n - 1; /* the directory stream's own */
}

/* --- a raw session: ZeroMQ Hello, then the descriptor channel ------------ */

struct raw {
  void *sock;
  uint64_t session;
  uint8_t secret[GMB_FD_SECRET_LEN];
  uint64_t next_id;
};

static void raw_hello(struct raw *r, const struct harness_broker *b,
                      const char *tenant) {
  memset(r, 0, sizeof *r);
  r->sock = harness_raw_open(b->endpoint);
  struct wire_request req;
  memset(&req, 0, sizeof req);
  req.id = ++r->next_id;
  req.kind = WIRE_HELLO;
  req.u.hello.version = WIRE_PROTOCOL_VERSION;
  snprintf(req.u.hello.tenant, sizeof req.u.hello.tenant, "%s", tenant);
  struct wire_reply rep;
  ck_assert_int_eq(harness_raw_call(r->sock, &req, &rep), 0);
  ck_assert_msg(rep.status == 0, "hello: %s", rep.message);
  ck_assert_uint_eq(rep.u.hello.fd_secret_len, GMB_FD_SECRET_LEN);
  r->session = rep.u.hello.session;
  memcpy(r->secret, rep.u.hello.fd_secret, GMB_FD_SECRET_LEN);
  gmb__wire_reply_clear(&rep);
}

/* A pinned allocation; returns its segment. */
static uint64_t raw_alloc(struct raw *r, uint64_t size) {
  struct wire_request req;
  memset(&req, 0, sizeof req);
  req.id = ++r->next_id;
  req.kind = WIRE_ALLOC;
  req.u.alloc.size = size;
  struct wire_reply rep;
  ck_assert_int_eq(harness_raw_call(r->sock, &req, &rep), 0);
  ck_assert_msg(rep.status == 0, "alloc: %s", rep.message);
  uint64_t seg = rep.u.alloc.segment;
  gmb__wire_reply_clear(&rep);
  return seg;
}

/* A connection to the run dir's fd.sock (blocking). */
static int fd_connect(const struct harness_broker *b) {
  int s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  ck_assert_int_ge(s, 0);
  struct sockaddr_un sa;
  memset(&sa, 0, sizeof sa);
  sa.sun_family = AF_UNIX;
  snprintf(sa.sun_path, sizeof sa.sun_path, "%s/%s", b->dir, GMB_FD_SOCKET);
  ck_assert_msg(connect(s, (struct sockaddr *)&sa, sizeof sa) == 0,
                "connect %s: %s", sa.sun_path, strerror(errno));
  return s;
}

/* One request on the channel; the reply's status, and its descriptor in
 * *fd (-1: none). */
static int fd_call(int s, uint32_t op, uint64_t session, const uint8_t *secret,
                   uint64_t segment, int *fd, struct gmb_fd_rep *rep) {
  struct gmb_fd_req req;
  memset(&req, 0, sizeof req);
  req.magic = GMB_FD_MAGIC;
  req.op = op;
  req.session = session;
  req.segment = segment;
  if (secret) memcpy(req.secret, secret, GMB_FD_SECRET_LEN);
  if (gmb__fd_send(s, &req, sizeof req, -1, 0) != 0) return INT32_MIN;
  ssize_t n = gmb__fd_recv(s, rep, sizeof *rep, fd, 0);
  if (n != (ssize_t)sizeof *rep) return INT32_MIN;
  return rep->status;
}

/* --- nothing_in_dev_shm ---------------------------------------------------- */

START_TEST(nothing_in_dev_shm) {
  int before = shm_gmb_entries();
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", NULL);
  gmb_client *c1 = harness_connect_ok(&b, "a");
  gmb_client *c2 = harness_connect_ok(&b, "b");
  gmb_id small = harness_alloc_ok(c1, 256 * 1024);
  gmb_id big = harness_alloc_ok(c2, 8 * MIB);
  gmb_id mov = 0;
  ck_assert_int_eq(gmb_alloc(c1, MIB, GMB_MOVABLE, &mov), 0);
  void *p1 = NULL, *p2 = NULL, *p3 = NULL;
  ck_assert_int_eq(gmb_lock(c1, small, &p1), 0);
  ck_assert_int_eq(gmb_lock(c2, big, &p2), 0);
  ck_assert_int_eq(gmb_lock(c1, mov, &p3), 0);
  memset(p1, 1, 256 * 1024);
  memset(p2, 2, 8 * MIB);
  memset(p3, 3, MIB);
  /* Segments, lock tables, all mapped and written: none has a name. */
  ck_assert_int_eq(shm_gmb_entries(), before);
  gmb_unlock(c1, mov);
  gmb_disconnect(c1);
  gmb_disconnect(c2);
  pid_t pid = harness_broker_stop(&b);
  ck_assert_int_eq(harness_shm_leftovers(pid), 0);
  ck_assert_int_eq(shm_gmb_entries(), before);
}
END_TEST

/* --- descriptors_back_to_idle ---------------------------------------------- */

struct fd_idle {
  pid_t pid;
  int idle;
};

static int fd_back_to_idle(void *arg) {
  struct fd_idle *f = arg;
  return fd_count(f->pid) == f->idle;
}

START_TEST(descriptors_back_to_idle) {
  struct harness_broker b;
  harness_broker_start(&b, "host:128MiB", NULL);
  /* The broker's count with no session (the start-up probe has gone). */
  gmb_client *probe = harness_connect_ok(&b, "t");
  gmb_disconnect(probe);
  harness_sleep_ms(200);
  struct fd_idle f = {b.pid, fd_count(b.pid)};
  ck_assert_int_gt(f.idle, 0);
  enum { N = 4 };
  gmb_client *c[N];
  for (int i = 0; i < N; i++) {
    c[i] = harness_connect_ok(&b, "t");
    harness_alloc_ok(c[i], 4 * MIB);     /* a segment of its own */
    harness_alloc_ok(c[i], 64 * 1024);   /* in a shared small segment */
  }
  int busy = fd_count(b.pid);
  /* A channel per session and a descriptor per segment, at least. */
  ck_assert_int_ge(busy, f.idle + 2 * N);
  for (int i = 0; i < N; i++) gmb_disconnect(c[i]);
  ck_assert_msg(harness_poll_until(fd_back_to_idle, &f, HARNESS_WAIT_MS),
                "the broker holds %d descriptors, %d when idle",
                fd_count(b.pid), f.idle);
  printf("descriptors_back_to_idle: broker %d idle, %d with %d sessions, "
         "back to %d\n", f.idle, busy, N, fd_count(b.pid));
  harness_broker_stop(&b);
}
END_TEST

/* --- sealed_against_truncation --------------------------------------------- */

START_TEST(sealed_against_truncation) {
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", NULL);
  struct raw r;
  raw_hello(&r, &b, "mallory");
  uint64_t seg = raw_alloc(&r, 4 * MIB);
  int s = fd_connect(&b);
  struct gmb_fd_rep rep;
  int lt = -1, sfd = -1;
  ck_assert_int_eq(fd_call(s, GMB_FD_AUTH, r.session, r.secret, 0, &lt, &rep),
                   0);
  ck_assert_int_ge(lt, 0);
  ck_assert_int_eq(fd_call(s, GMB_FD_SEGMENT, 0, NULL, seg, &sfd, &rep), 0);
  ck_assert_int_ge(sfd, 0);
  ck_assert_uint_eq(rep.size, 4 * MIB);
  /* What a hostile client would do to crash the broker with SIGBUS at its
   * next copy: the seals say no, shrinking or growing. */
  int fds[2] = {lt, sfd};
  for (int i = 0; i < 2; i++) {
    struct stat st;
    ck_assert_int_eq(fstat(fds[i], &st), 0);
    errno = 0;
    ck_assert_int_eq(ftruncate(fds[i], 0), -1);
    ck_assert_int_eq(errno, EPERM);
    errno = 0;
    ck_assert_int_eq(ftruncate(fds[i], st.st_size * 2), -1);
    ck_assert_int_eq(errno, EPERM);
    ck_assert_int_eq(fcntl(fds[i], F_ADD_SEALS, 0), -1); /* F_SEAL_SEAL */
  }
  /* The broker is fine: it compacts (touching segments) and serves. */
  void *adm = harness_raw_open(b.admin_endpoint);
  struct wire_compact_stats cs;
  ck_assert_int_eq(harness_admin_compact(adm, NULL, &cs), 0);
  harness_raw_close(adm);
  gmb_client *c = harness_connect_ok(&b, "other");
  gmb_id id = harness_alloc_ok(c, 8 * MIB);
  void *p = NULL;
  ck_assert_int_eq(gmb_lock(c, id, &p), 0);
  memset(p, 7, 8 * MIB);
  gmb_disconnect(c);
  close(lt);
  close(sfd);
  close(s);
  harness_raw_close(r.sock);
  harness_broker_stop(&b);
}
END_TEST

/* --- other_uid_gets_nothing ------------------------------------------------ */

struct thief {
  const struct harness_broker *b;
  uint64_t session, segment;
  uint8_t secret[GMB_FD_SECRET_LEN];
};

/* As uid 65534, with the session's id and secret (the worst case: they
 * leaked): the channel refuses it, and a SEGMENT without a proved session
 * gets nothing either. */
static int thief_main(void *arg) {
  struct thief *t = arg;
  CHILD_CHECK(setgid(65534) == 0 && setuid(65534) == 0, 10, "setuid: %s",
              strerror(errno));
  int s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  struct sockaddr_un sa;
  memset(&sa, 0, sizeof sa);
  sa.sun_family = AF_UNIX;
  snprintf(sa.sun_path, sizeof sa.sun_path, "%s/%s", t->b->dir,
           GMB_FD_SOCKET);
  CHILD_CHECK(connect(s, (struct sockaddr *)&sa, sizeof sa) == 0, 11,
              "connect: %s", strerror(errno));
  struct gmb_fd_rep rep;
  int fd = -1;
  int st = fd_call(s, GMB_FD_AUTH, t->session, t->secret, 0, &fd, &rep);
  CHILD_CHECK(st == GMB_E_AUTH && fd < 0, 12, "auth as another uid: %d", st);
  close(s);
  s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  CHILD_CHECK(connect(s, (struct sockaddr *)&sa, sizeof sa) == 0, 13,
              "connect: %s", strerror(errno));
  st = fd_call(s, GMB_FD_SEGMENT, 0, NULL, t->segment, &fd, &rep);
  CHILD_CHECK(st == GMB_E_PROTO && fd < 0, 14, "segment unproved: %d", st);
  close(s);
  return 0;
}

START_TEST(other_uid_gets_nothing) {
  if (geteuid() != 0) {
    printf("other_uid_gets_nothing: skipped: needs root to act as another "
           "uid\n");
    return;
  }
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", NULL);
  struct raw r;
  raw_hello(&r, &b, "victim");
  struct thief t = {.b = &b, .session = r.session};
  memcpy(t.secret, r.secret, sizeof t.secret);
  t.segment = raw_alloc(&r, 4 * MIB);
  pid_t kid = harness_fork(thief_main, &t);
  ck_assert_int_eq(harness_wait(kid), 0);
  /* The victim's own channel still opens (the thief's attempt did not
   * take it). */
  int s = fd_connect(&b);
  struct gmb_fd_rep rep;
  int lt = -1;
  ck_assert_int_eq(fd_call(s, GMB_FD_AUTH, r.session, r.secret, 0, &lt, &rep),
                   0);
  close(lt);
  close(s);
  harness_raw_close(r.sock);
  harness_broker_stop(&b);
}
END_TEST

/* --- client_in_another_pid_namespace --------------------------------------- */

struct nsclient {
  const char *endpoint;
  int ready_w; /* sends 'r' once it wrote and read back */
};

static int nsclient_work(struct nsclient *a) {
  gmb_client *c = NULL;
  CHILD_CHECK(gmb_connect(a->endpoint, "ns", &c) == 0, 20, "connect: %s",
              gmb_last_error(NULL));
  gmb_id id = 0;
  CHILD_CHECK(gmb_alloc(c, 8 * MIB, 0, &id) == 0, 21, "alloc: %s",
              gmb_last_error(c));
  void *p = NULL;
  CHILD_CHECK(gmb_lock(c, id, &p) == 0, 22, "lock: %s", gmb_last_error(c));
  harness_pattern_fill(p, 8 * MIB, 42);
  CHILD_CHECK(harness_pattern_check(p, 8 * MIB, 42) < 0, 23, "read back");
  CHILD_CHECK(harness_pipe_send(a->ready_w, 'r') == 0, 24, "pipe");
  for (;;) pause(); /* until killed */
}

/* Outside: makes a PID namespace and runs the client as its first
 * process; reports the client's pid (as seen from here) on the pipe. */
static int nsclient_main(void *arg) {
  struct nsclient *a = arg;
  CHILD_CHECK(unshare(CLONE_NEWPID) == 0, 30, "unshare: %s", strerror(errno));
  pid_t kid = fork();
  if (kid == 0) {
    /* The namespace's first process dies with this one. */
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    _exit(nsclient_work(a));
  }
  CHILD_CHECK(kid > 0, 31, "fork: %s", strerror(errno));
  int st;
  waitpid(kid, &st, 0);
  return 0;
}

struct used_zero {
  const struct harness_broker *b;
};

static int ns_used_zero(void *arg) {
  struct used_zero *u = arg;
  struct wire_tenant_row row;
  return harness_tenant_row(u->b, "ns", &row) == 0 && row.used == 0;
}

START_TEST(client_in_another_pid_namespace) {
  if (geteuid() != 0 || !harness_pidns_possible()) {
    printf("client_in_another_pid_namespace: skipped: PID namespaces need "
           "root\n");
    return;
  }
  /* The broker in a PID namespace of its own and the client in another:
   * neither sees the other's pid.  Heartbeats are slow (a minute), so a
   * quick reclaim can only come from the descriptor channel's hang-up. */
  struct harness_broker b;
  harness_broker_start_opts(&b, "host:64MiB",
                            "[broker]\nheartbeat_ms = 60000\n", HARNESS_PIDNS);
  int ready[2];
  ck_assert_int_eq(pipe(ready), 0);
  struct nsclient a = {b.endpoint, ready[1]};
  pid_t outer = harness_fork(nsclient_main, &a);
  ck_assert_msg(harness_pipe_wait(ready[0], HARNESS_WAIT_MS) == 'r',
                "the client in its namespace did not allocate, write and "
                "read (exit %d)", harness_wait(outer));
  struct wire_tenant_row row;
  ck_assert_int_eq(harness_tenant_row(&b, "ns", &row), 0);
  ck_assert_uint_eq(row.used, 8 * MIB);
  /* Killing the outer process kills the namespace's first process (its
   * parent-death signal), which is the client. */
  double t0 = harness_now_ms();
  ck_assert_int_eq(kill(outer, SIGKILL), 0);
  harness_wait(outer);
  struct used_zero u = {&b};
  ck_assert_msg(harness_poll_until(ns_used_zero, &u, HARNESS_WAIT_MS),
                "the killed client's memory was not reclaimed");
  printf("client_in_another_pid_namespace: reclaimed %.0f ms after kill -9 "
         "(heartbeats every 60 s; observed)\n", harness_now_ms() - t0);
  char *log = harness_broker_log(&b);
  ck_assert_msg(strstr(log, "descriptor channel closed") != NULL,
                "reclaimed for another reason; log:\n%s", log);
  free(log);
  close(ready[0]);
  close(ready[1]);
  harness_broker_stop(&b);
}
END_TEST

/* --- broker_kill9_restart_same_pid ----------------------------------------- */

/* The broker's own process inside its namespace (the handle's child). */
static pid_t inner_broker(const struct harness_broker *b) {
  char path[96];
  snprintf(path, sizeof path, "/proc/%ld/task/%ld/children", (long)b->pid,
           (long)b->pid);
  FILE *f = fopen(path, "r");
  if (f == NULL) return -1;
  long pid = -1;
  if (fscanf(f, "%ld", &pid) != 1) pid = -1;
  fclose(f);
  return (pid_t)pid;
}

/* The pid of process `pid` in its innermost namespace (NSpid's last). */
static long ns_pid(pid_t pid) {
  char path[64], line[256];
  snprintf(path, sizeof path, "/proc/%ld/status", (long)pid);
  FILE *f = fopen(path, "r");
  if (f == NULL) return -1;
  long last = -1;
  while (fgets(line, sizeof line, f)) {
    if (strncmp(line, "NSpid:", 6) != 0) continue;
    char *save = NULL;
    for (char *tok = strtok_r(line + 6, " \t\n", &save); tok;
         tok = strtok_r(NULL, " \t\n", &save))
      last = strtol(tok, NULL, 10);
  }
  fclose(f);
  return last;
}

static long shmem_kib(void) {
  FILE *f = fopen("/proc/meminfo", "r");
  if (f == NULL) return -1;
  char line[128];
  long v = -1;
  while (fgets(line, sizeof line, f))
    if (sscanf(line, "Shmem: %ld kB", &v) == 1) break;
  fclose(f);
  return v;
}

static int broker_gone(void *arg) {
  return !harness_broker_alive(arg);
}

/* A broker killed with SIGKILL used to leave its shm
 * objects behind, named after its pid, so a new broker with the same pid
 * (PID 1 of a new namespace, every container restart) could not make a
 * segment: every alloc GMB_E_DEVICE.  Memory lives in memfds now: it dies
 * with the broker, nothing is named, and the next PID 1 allocates the
 * whole device. */
START_TEST(broker_kill9_restart_same_pid) {
  if (geteuid() != 0 || !harness_pidns_possible()) {
    printf("broker_kill9_restart_same_pid: skipped: PID namespaces need "
           "root\n");
    return;
  }
  int shm_before = shm_gmb_entries();
  long kib0 = shmem_kib();
  for (int round = 0; round < 2; round++) {
    struct harness_broker b;
    harness_broker_start_opts(&b, "host:64MiB", NULL, HARNESS_PIDNS);
    pid_t inner = inner_broker(&b);
    ck_assert_int_gt(inner, 0);
    ck_assert_int_eq(ns_pid(inner), 1);
    gmb_client *c = harness_connect_ok(&b, "kept");
    gmb_id id = harness_alloc_ok(c, 64 * MIB); /* the whole device */
    void *p = NULL;
    ck_assert_int_eq(gmb_lock(c, id, &p), 0);
    harness_pattern_fill(p, 64 * MIB, (uint64_t)round + 1);
    ck_assert_int_eq(harness_pattern_check(p, 64 * MIB, (uint64_t)round + 1),
                     -1);
    ck_assert_int_eq(gmb_unlock(c, id), 0);
    ck_assert_int_eq(shm_gmb_entries(), shm_before);
    ck_assert_int_eq(kill(inner, SIGKILL), 0);
    ck_assert_msg(harness_poll_until(broker_gone, &b, HARNESS_WAIT_MS),
                  "the broker's namespace outlived its PID 1");
    gmb_disconnect(c); /* its mapping was the last holder of the memory */
    ck_assert_int_eq(shm_gmb_entries(), shm_before);
    harness_broker_rm_dir(&b);
  }
  printf("broker_kill9_restart_same_pid: two brokers as PID 1, each killed "
         "with 64 MiB held; Shmem %ld kB before, %ld kB after (observed, "
         "machine-wide)\n", kib0, shmem_kib());
}
END_TEST

/* --- evicted_process_keeps_its_bytes --------------------------------------- */

struct evictee {
  const char *endpoint;
  int ready_w, go_r;
};

static int evictee_main(void *arg) {
  struct evictee *a = arg;
  gmb_client *c = NULL;
  CHILD_CHECK(gmb_connect(a->endpoint, "victim", &c) == 0, 40, "connect: %s",
              gmb_last_error(NULL));
  gmb_id id = 0;
  CHILD_CHECK(gmb_alloc(c, 32 * MIB, 0, &id) == 0, 41, "alloc: %s",
              gmb_last_error(c));
  void *p = NULL;
  CHILD_CHECK(gmb_lock(c, id, &p) == 0, 42, "lock: %s", gmb_last_error(c));
  harness_pattern_fill(p, 32 * MIB, 7);
  CHILD_CHECK(harness_pipe_send(a->ready_w, 'r') == 0, 43, "pipe");
  /* Evicted meanwhile, and its memory given to another tenant, which
   * wrote all of it. */
  CHILD_CHECK(harness_pipe_wait(a->go_r, HARNESS_WAIT_MS) == 'g', 44,
              "no go");
  long bad = harness_pattern_check(p, 32 * MIB, 7);
  CHILD_CHECK(bad < 0, 45, "byte %ld of its memory changed under it", bad);
  gmb_stats st;
  CHILD_CHECK(gmb_tenant_stats(c, &st) == GMB_E_EVICTED, 46,
              "not told it was evicted: %s", gmb_last_error(c));
  gmb_disconnect(c);
  return 0;
}

START_TEST(evicted_process_keeps_its_bytes) {
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", NULL);
  int ready[2], go[2];
  ck_assert_int_eq(pipe(ready), 0);
  ck_assert_int_eq(pipe(go), 0);
  struct evictee a = {b.endpoint, ready[1], go[0]};
  pid_t kid = harness_fork(evictee_main, &a);
  ck_assert_msg(harness_pipe_wait(ready[0], HARNESS_WAIT_MS) == 'r',
                "the victim did not allocate (exit %d)", harness_wait(kid));
  char out[4096];
  ck_assert_int_eq(harness_ctl(&b, out, sizeof out, "evict", "victim", NULL),
                   0);
  /* The whole device for another tenant, every byte written. */
  gmb_client *c = harness_connect_ok(&b, "next");
  gmb_id id = harness_alloc_ok(c, 64 * MIB);
  void *p = NULL;
  ck_assert_int_eq(gmb_lock(c, id, &p), 0);
  memset(p, 0xee, 64 * MIB);
  ck_assert_int_eq(harness_pipe_send(go[1], 'g'), 0);
  int st = harness_wait(kid);
  ck_assert_msg(st == 0, "the evicted child ended with %d (its stderr says "
                "why)", st);
  gmb_disconnect(c);
  close(ready[0]);
  close(ready[1]);
  close(go[0]);
  close(go[1]);
  harness_broker_stop(&b);
}
END_TEST

/* --- evicted_writer_spares_next_session ----------------------------------- */

struct scribbler {
  const char *endpoint;
  int ready_w, go_r;
};

/* Holds 1 MiB of tenant "scrib" (a small segment, the kind the pool keeps
 * lingering), is evicted, sees it in gmb_lock, and writes all over the
 * memory it still maps, as a process that did not notice would. */
static int scribbler_main(void *arg) {
  struct scribbler *a = arg;
  gmb_client *c = NULL;
  CHILD_CHECK(gmb_connect(a->endpoint, "scrib", &c) == 0, 50, "connect: %s",
              gmb_last_error(NULL));
  gmb_id id = 0;
  CHILD_CHECK(gmb_alloc(c, MIB, GMB_MOVABLE, &id) == 0, 51, "alloc: %s",
              gmb_last_error(c));
  void *p = NULL;
  CHILD_CHECK(gmb_lock(c, id, &p) == 0, 52, "lock: %s", gmb_last_error(c));
  CHILD_CHECK(harness_pipe_send(a->ready_w, 'r') == 0, 53, "pipe");
  CHILD_CHECK(harness_pipe_wait(a->go_r, HARNESS_WAIT_MS) == 'g', 54,
              "no go");
  void *q = NULL;
  int rc = gmb_lock(c, id, &q);
  CHILD_CHECK(rc == GMB_E_EVICTED, 55, "gmb_lock after the eviction = %s",
              gmb_err_name(rc));
  memset(p, 0xff, MIB);
  CHILD_CHECK(harness_pipe_send(a->ready_w, 'w') == 0, 56, "pipe");
  gmb_disconnect(c);
  return 0;
}

START_TEST(evicted_writer_spares_next_session) {
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", NULL);
  int ready[2], go[2];
  ck_assert_int_eq(pipe(ready), 0);
  ck_assert_int_eq(pipe(go), 0);
  struct scribbler a = {b.endpoint, ready[1], go[0]};
  pid_t kid = harness_fork(scribbler_main, &a);
  ck_assert_msg(harness_pipe_wait(ready[0], HARNESS_WAIT_MS) == 'r',
                "the scribbler did not allocate (exit %d)", harness_wait(kid));
  char out[4096];
  ck_assert_int_eq(harness_ctl(&b, out, sizeof out, "evict", "scrib", NULL),
                   0);
  /* The tenant's next session: the same size, the same kind of segment. */
  gmb_client *c = harness_connect_ok(&b, "scrib");
  gmb_id id = 0;
  ck_assert_int_eq(gmb_alloc(c, MIB, GMB_MOVABLE, &id), 0);
  void *p = NULL;
  ck_assert_int_eq(gmb_lock(c, id, &p), 0);
  harness_pattern_fill(p, MIB, 9);
  ck_assert_int_eq(harness_pipe_send(go[1], 'g'), 0);
  ck_assert_msg(harness_pipe_wait(ready[0], HARNESS_WAIT_MS) == 'w',
                "the scribbler did not write (exit %d)", harness_wait(kid));
  long bad = harness_pattern_check(p, MIB, 9);
  ck_assert_msg(bad < 0, "byte %ld of the next session's memory was "
                "written by the evicted process", bad);
  int st = harness_wait(kid);
  ck_assert_msg(st == 0, "the scribbler ended with %d", st);
  gmb_disconnect(c);
  close(ready[0]);
  close(ready[1]);
  close(go[0]);
  close(go[1]);
  harness_broker_stop(&b);
}
END_TEST

/* --- revoked_uid_cannot_reach_later_data ----------------------------------- */

#define RV_SIZE (256u << 10)

struct revokee {
  const char *endpoint;
  int ready_w, go_r;
};

/* 1 when the first 512 bytes of pattern `seed` start at a 512-aligned
 * offset of [p, p + len). */
static int rv_find(const uint8_t *p, size_t len, uint64_t seed) {
  uint8_t want[512];
  harness_pattern_fill(want, sizeof want, seed);
  for (size_t off = 0; off + sizeof want <= len; off += 512)
    if (memcmp(p + off, want, sizeof want) == 0) return 1;
  return 0;
}

/* The whole mapping of this process that holds `p` (the client maps a
 * segment whole): its start and length, from /proc/self/maps. */
static int rv_mapping_of(const void *p, uint8_t **start, size_t *len) {
  FILE *f = fopen("/proc/self/maps", "r");
  if (f == NULL) return -1;
  char line[512];
  int rc = -1;
  while (fgets(line, sizeof line, f)) {
    unsigned long lo, hi;
    if (sscanf(line, "%lx-%lx", &lo, &hi) != 2) continue;
    if ((uintptr_t)p >= lo && (uintptr_t)p < hi) {
      *start = (uint8_t *)lo;
      *len = hi - lo;
      rc = 0;
      break;
    }
  }
  fclose(f);
  return rc;
}

/* As uid 4242, one of tenant "shared"'s uids until a reload removes it:
 * allocates in the segment that holds the victim's bytes, keeps a mapping
 * of its own of the whole segment (mremap of size 0: the same pages, which
 * no unmapping by the library takes away), and after the revocation looks
 * there for the tenant's later data and writes all over it, as a process
 * that lost its membership but not its mappings would. */
static int revokee_main(void *arg) {
  struct revokee *a = arg;
  CHILD_CHECK(setgid(4242) == 0 && setuid(4242) == 0, 60, "setuid: %s",
              strerror(errno));
  gmb_client *c = NULL;
  CHILD_CHECK(gmb_connect(a->endpoint, "shared", &c) == 0, 61, "connect: %s",
              gmb_last_error(NULL));
  gmb_id id = 0;
  CHILD_CHECK(gmb_alloc(c, 64u << 10, GMB_MOVABLE, &id) == 0, 62,
              "alloc: %s", gmb_last_error(c));
  void *p = NULL;
  CHILD_CHECK(gmb_lock(c, id, &p) == 0, 63, "lock: %s", gmb_last_error(c));
  uint8_t *seg = NULL;
  size_t len = 0;
  CHILD_CHECK(rv_mapping_of(p, &seg, &len) == 0, 64, "no mapping");
  uint8_t *mine = mremap(seg, 0, len, MREMAP_MAYMOVE);
  CHILD_CHECK(mine != MAP_FAILED, 65, "mremap: %s", strerror(errno));
  /* The attack's premise: the victim's bytes are in this segment. */
  CHILD_CHECK(rv_find(mine, len, 1), 66, "the victim's bytes are not in "
              "the segment this process mapped");
  CHILD_CHECK(harness_pipe_send(a->ready_w, 'r') == 0, 67, "pipe");
  /* The test waits for the revocation's end (HARNESS_WAIT_MS at most)
   * before it writes: wait longer. */
  CHILD_CHECK(harness_pipe_wait(a->go_r, 3 * HARNESS_WAIT_MS) == 'g', 68,
              "no go");
  CHILD_CHECK(!rv_find(mine, len, 2), 80, "the revoked process reads the "
              "tenant's later data (an allocation written after the "
              "revocation) through its old mapping");
  CHILD_CHECK(!rv_find(mine, len, 3), 81, "the revoked process reads a "
              "later allocation of the tenant through its old mapping");
  memset(mine, 0xff, len);
  CHILD_CHECK(harness_pipe_send(a->ready_w, 'w') == 0, 69, "pipe");
  gmb_disconnect(c);
  return 0;
}

struct rv_log {
  const struct harness_broker *b;
};

static int rv_revocation_done(void *arg) {
  struct rv_log *l = arg;
  char *log = harness_broker_log(l->b);
  int done = log && strstr(log, "revocation of tenant shared done") != NULL;
  free(log);
  return done;
}

/* A uid removed from a tenant's uids by a reload keeps its process's
 * mappings of the tenant's segments: the revocation moves the tenant's
 * live bytes out of them, and nothing new lands there, so the process
 * neither reads nor writes what the tenant keeps afterwards. */
START_TEST(revoked_uid_cannot_reach_later_data) {
  if (geteuid() != 0) {
    printf("revoked_uid_cannot_reach_later_data: skipped: needs root to "
           "run the revoked process as another uid\n");
    return;
  }
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", "[tenant:shared]\nuids = 0,4242\n");
  gmb_client *c = harness_connect_ok(&b, "shared");
  gmb_id x = 0;
  ck_assert_int_eq(gmb_alloc(c, RV_SIZE, GMB_MOVABLE, &x), 0);
  void *p = NULL;
  ck_assert_int_eq(gmb_lock(c, x, &p), 0);
  harness_pattern_fill(p, RV_SIZE, 1);
  ck_assert_int_eq(gmb_unlock(c, x), 0);
  int ready[2], go[2];
  ck_assert_int_eq(pipe(ready), 0);
  ck_assert_int_eq(pipe(go), 0);
  struct revokee a = {b.endpoint, ready[1], go[0]};
  pid_t kid = harness_fork(revokee_main, &a);
  close(ready[1]); /* its exit ends the waits below at once */
  close(go[0]);
  ck_assert_msg(harness_pipe_wait(ready[0], HARNESS_WAIT_MS) == 'r',
                "the revoked process did not map the segment (exit %d)",
                harness_wait(kid));
  harness_write_file(b.config_path, "[tenant:shared]\nuids = 0\n");
  char out[4096];
  ck_assert_msg(harness_ctl(&b, out, sizeof out, "reload", NULL) == 0, "%s",
                out);
  struct rv_log l = {&b};
  int done = harness_poll_until(rv_revocation_done, &l, HARNESS_WAIT_MS);
  /* The tenant's later data: its allocation written again, and a new one. */
  ck_assert_int_eq(gmb_lock(c, x, &p), 0);
  ck_assert_msg(harness_pattern_check(p, RV_SIZE, 1) < 0,
                "the allocation lost its bytes when it moved");
  harness_pattern_fill(p, RV_SIZE, 2);
  gmb_id y = 0;
  void *q = NULL;
  ck_assert_int_eq(gmb_alloc(c, RV_SIZE, GMB_MOVABLE, &y), 0);
  ck_assert_int_eq(gmb_lock(c, y, &q), 0);
  harness_pattern_fill(q, RV_SIZE, 3);
  ck_assert_int_eq(harness_pipe_send(go[1], 'g'), 0);
  int w = harness_pipe_wait(ready[0], HARNESS_WAIT_MS);
  int st = harness_wait(kid);
  ck_assert_msg(w == 'w' && st == 0, "the revoked process reached the "
                "tenant's data (exit %d: 80 read the later write, 81 the "
                "later allocation)", st);
  long bad = harness_pattern_check(p, RV_SIZE, 2);
  ck_assert_msg(bad < 0, "byte %ld of the tenant's allocation was written "
                "by the revoked process", bad);
  bad = harness_pattern_check(q, RV_SIZE, 3);
  ck_assert_msg(bad < 0, "byte %ld of the tenant's later allocation was "
                "written by the revoked process", bad);
  ck_assert_msg(done, "the broker never logged the revocation's end");
  char *log = harness_broker_log(&b);
  ck_assert_ptr_nonnull(log);
  ck_assert_msg(strstr(log, "nothing stays in a segment a revoked process "
                            "mapped") != NULL,
                "the revocation left bytes behind");
  free(log);
  ck_assert_int_eq(gmb_unlock(c, x), 0);
  ck_assert_int_eq(gmb_unlock(c, y), 0);
  gmb_disconnect(c);
  close(ready[0]);
  close(go[1]);
  harness_broker_stop(&b);
}
END_TEST

/* --- unread_descriptors_shown ----------------------------------------------- */

/* The admin status's figures of the descriptor channel, for polling. */
struct fd_figures {
  const struct harness_broker *b;
  uint64_t unread, refused;
  uint32_t kept;
  uint64_t want_unread;
  uint32_t want_kept;
};

static int fd_figures_are(void *arg) {
  struct fd_figures *f = arg;
  struct wire_reply rep;
  if (harness_admin_status(f->b, &rep) != 0) return 0;
  f->unread = rep.u.admin_status.fd_unread;
  f->kept = rep.u.admin_status.fd_kept;
  f->refused = rep.u.admin_status.fd_refused;
  gmb__wire_reply_clear(&rep);
  return f->unread == f->want_unread && f->kept == f->want_kept;
}

static json_int_t fd_jint(json_t *o, const char *key) {
  json_t *v = json_object_get(o, key);
  ck_assert_msg(json_is_integer(v), "\"%s\" is not an integer", key);
  return json_integer_value(v);
}

/*
 * A hostile client asks for its lock table and three segments, reads
 * none, and says Bye with its channel open: gmbctl status (text and
 * JSON) and the metrics show the four descriptors unread, per session
 * while it lives, then per tenant and in all with the channel kept for
 * its ended session; once it closes the socket, the broker closes its end
 * and the figures go back to nothing.
 */
START_TEST(unread_descriptors_shown) {
  static char out[1 << 16];
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", NULL);
  struct raw r;
  raw_hello(&r, &b, "hoarder");
  uint64_t seg = raw_alloc(&r, 4 * MIB);
  int s = fd_connect(&b);
  struct gmb_fd_req req;
  memset(&req, 0, sizeof req);
  req.magic = GMB_FD_MAGIC;
  req.op = GMB_FD_AUTH;
  req.session = r.session;
  memcpy(req.secret, r.secret, GMB_FD_SECRET_LEN);
  ck_assert_int_eq(gmb__fd_send(s, &req, sizeof req, -1, 0), 0);
  req.op = GMB_FD_SEGMENT;
  req.segment = seg;
  for (int i = 0; i < 3; i++)
    ck_assert_int_eq(gmb__fd_send(s, &req, sizeof req, -1, 0), 0);
  struct fd_figures f = {.b = &b, .want_unread = 4, .want_kept = 0};
  ck_assert_msg(harness_poll_until(fd_figures_are, &f, HARNESS_WAIT_MS),
                "status: %llu unread, %u kept", (unsigned long long)f.unread,
                f.kept);
  /* Per session, while it lives. */
  ck_assert_int_eq(harness_ctl(&b, out, sizeof out, "--json", "status", NULL),
                   0);
  json_error_t err;
  json_t *j = json_loads(out, 0, &err);
  ck_assert_msg(j != NULL, "not JSON (%s): %s", err.text, out);
  json_t *rows = json_object_get(j, "session_rows");
  int seen = 0;
  for (size_t i = 0; i < json_array_size(rows); i++) {
    json_t *row = json_array_get(rows, i);
    if (strcmp(json_string_value(json_object_get(row, "tenant")),
               "hoarder") != 0)
      continue;
    ck_assert_int_eq(fd_jint(row, "fd_unread"), 4);
    ck_assert_int_eq(fd_jint(row, "fd_refused"), 0);
    seen++;
  }
  ck_assert_int_eq(seen, 1);
  json_decref(j);
  /* It ends with them unread: the channel is kept, and counted. */
  struct wire_request bye;
  memset(&bye, 0, sizeof bye);
  bye.id = ++r.next_id;
  bye.kind = WIRE_BYE;
  struct wire_reply rep;
  ck_assert_int_eq(harness_raw_call(r.sock, &bye, &rep), 0);
  gmb__wire_reply_clear(&rep);
  f.want_kept = 1;
  ck_assert_msg(harness_poll_until(fd_figures_are, &f, HARNESS_WAIT_MS),
                "status: %llu unread, %u kept", (unsigned long long)f.unread,
                f.kept);
  ck_assert_int_eq(harness_ctl(&b, out, sizeof out, "--json", "status", NULL),
                   0);
  j = json_loads(out, 0, &err);
  ck_assert_msg(j != NULL, "not JSON (%s): %s", err.text, out);
  ck_assert_int_eq(fd_jint(j, "fd_unread"), 4);
  ck_assert_int_eq(fd_jint(j, "fd_kept"), 1);
  ck_assert_int_eq(fd_jint(j, "fd_refused"), 0);
  json_t *tenants = json_object_get(j, "tenants");
  seen = 0;
  for (size_t i = 0; i < json_array_size(tenants); i++) {
    json_t *row = json_array_get(tenants, i);
    if (strcmp(json_string_value(json_object_get(row, "name")), "hoarder"))
      continue;
    ck_assert_int_eq(fd_jint(row, "fd_unread"), 4);
    ck_assert_int_eq(fd_jint(row, "fd_kept"), 1);
    seen++;
  }
  ck_assert_int_eq(seen, 1);
  json_decref(j);
  ck_assert_int_eq(harness_ctl(&b, out, sizeof out, "status", NULL), 0);
  ck_assert_msg(strstr(out, "unread 4, kept channels 1, refused 0"),
                "%s", out);
  ck_assert_msg(strstr(out, "descriptor channels"), "%s", out);
  ck_assert_int_eq(harness_ctl(&b, out, sizeof out, "metrics", NULL), 0);
  ck_assert_msg(strstr(out, "\ngmb_fd_kept_channels 1\n"), "%s", out);
  ck_assert_msg(strstr(out, "\ngmb_fd_unread 4\n"), "%s", out);
  ck_assert_msg(strstr(out, "gmb_tenant_fd_unread{tenant=\"hoarder\"} 4\n"),
                "%s", out);
  ck_assert_msg(strstr(out, "gmb_tenant_fd_kept_channels{tenant=\"hoarder\"} "
                            "1\n"), "%s", out);
  ck_assert_msg(strstr(out, "gmb_fd_unread_limit{scope=\"tenant\"} "), "%s",
                out);
  /* Its socket closes: the broker's end follows, the figures go. */
  close(s);
  f.want_unread = 0;
  f.want_kept = 0;
  ck_assert_msg(harness_poll_until(fd_figures_are, &f, HARNESS_WAIT_MS),
                "status: %llu unread, %u kept", (unsigned long long)f.unread,
                f.kept);
  harness_raw_close(r.sock);
  harness_broker_stop(&b);
}
END_TEST

int main(void) {
  return harness_main(HARNESS_SUITE(
      "fdshare", "descriptors", 60, nothing_in_dev_shm,
      descriptors_back_to_idle, sealed_against_truncation,
      other_uid_gets_nothing, client_in_another_pid_namespace,
      broker_kill9_restart_same_pid, evicted_process_keeps_its_bytes,
      evicted_writer_spares_next_session,
      revoked_uid_cannot_reach_later_data, unread_descriptors_shown));
}
