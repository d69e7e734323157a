/*
 * check_fdchan.c - the descriptor channel's handler (fdchan.h), driven
 * directly, the way the loop drives it, with a whole broker in the test's
 * process (broker_fixture.h) and real AF_UNIX SOCK_SEQPACKET sockets.
 *
 * The test makes the listening socket itself (fd.sock in the fixture's
 * scratch dir, non-blocking, as loop.c makes it) and hands it to
 * gmb__fdchan_open().  Clients are plain sockets of this process: they
 * connect, then the test calls gmb__fdchan_accept(), and for a connection
 * that has something to read gmb__fdchan_pending_ready() (before it proved
 * a session) or gmb__fdchan_session_ready() (after), as the loop does when
 * poll says so; each reply is read back with MSG_DONTWAIT, so a broker
 * that did not answer fails the test instead of hanging it.  Sessions are
 * opened through the real Hello (fx_hello) for this process's uid, since
 * SO_PEERCRED of every connection the test makes is its own.
 *
 * Covers AUTH (the lock table's descriptor, sealed and of the right size,
 * and the connection bound to the session), the refusals that must look
 * alike (wrong secret, unknown session, another uid; a process of another
 * uid when the test runs as root), a second channel for a session, first
 * messages that are not AUTH, garbage, the pending table's bound and its
 * deadline, SEGMENT for the tenant's own segments (a descriptor of the
 * broker's pages, recorded as given) and for others' or made-up ids (the
 * same refusal, no descriptor), unknown requests, garbage and hang-up from
 * an authenticated session (it ends, its memory freed), a client that
 * never reads (ended, the broker never blocks), descriptors sent to the
 * broker (closed), the number of messages read per round, and the broker's
 * descriptor count back at idle once sessions end, and a short first
 * message that must echo nothing of the broker's memory.
 */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <linux/capability.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <grp.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <unistd.h>

#include "broker_fixture.h"
#include "check_main.h"
#include "fdchan.h"
#include "fdpass.h"
#include "locktab.h"
#include "observe.h"
#include "pool.h"
#include "util.h"

#define MIB GMB_MIB
#define SEC (UINT64_C(1000) * GMB_NS_PER_MS)

/* --- the broker's side --------------------------------------------------- */

struct chan {
  struct fx f;
  char path[sizeof(((struct sockaddr_un *)0)->sun_path)];
  int idle_fds; /* the process's descriptors with the channel open, idle */
  uint64_t clock; /* sweep_unread's time (0: not started) */
};

/* RLIMIT_NOFILE while the channel opens (0: as it is). */
static rlim_t chan_nofile;

/* A broker with its descriptor channel listening at DIR/fd.sock. */
static void chan_open_ini(struct chan *c, const char *device,
                          const char *ini) {
  fx_open_ini(&c->f, device, ini);
  int n = snprintf(c->path, sizeof c->path, "%s/%s", c->f.dir, GMB_FD_SOCKET);
  ck_assert_int_lt(n, (int)sizeof c->path);
  int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  ck_assert_int_ge(fd, 0);
  struct sockaddr_un sa;
  memset(&sa, 0, sizeof sa);
  sa.sun_family = AF_UNIX;
  memcpy(sa.sun_path, c->path, strlen(c->path) + 1);
  ck_assert_int_eq(bind(fd, (struct sockaddr *)&sa, sizeof sa), 0);
  ck_assert_int_eq(chmod(c->path, 0666), 0);
  ck_assert_int_eq(listen(fd, GMB_FDCHAN_PENDING), 0);
  /* The channel's bounds follow RLIMIT_NOFILE at its start. */
  struct rlimit old, low;
  ck_assert_int_eq(getrlimit(RLIMIT_NOFILE, &old), 0);
  low = old;
  if (chan_nofile) low.rlim_cur = chan_nofile;
  ck_assert_int_eq(setrlimit(RLIMIT_NOFILE, &low), 0);
  ck_assert_int_eq(gmb__fdchan_open(&c->f.b, fd), 0);
  ck_assert_int_eq(setrlimit(RLIMIT_NOFILE, &old), 0);
  ck_assert_int_eq(gmb__fdchan_listener(&c->f.b), fd);
  c->idle_fds = fx_count_fds();
  c->clock = 0;
}

static void chan_open(struct chan *c) {
  chan_open_ini(c, "host:64MiB", NULL);
}

/* As the loop closes: the channel first (listener and pending
 * connections), then the broker (sessions close their own). */
static void chan_close(struct chan *c) {
  gmb__fdchan_close(&c->f.b);
  ck_assert_int_eq(gmb__fdchan_listener(&c->f.b), -1);
  fx_close(&c->f);
}

struct pend {
  size_t n;
  int fd[GMB_FDCHAN_PENDING + 1];
  void *conn[GMB_FDCHAN_PENDING + 1];
};

static void pend_collect(void *ctx, int fd, void *conn) {
  struct pend *p = ctx;
  ck_assert_uint_lt(p->n, GMB_FDCHAN_PENDING + 1);
  p->fd[p->n] = fd;
  p->conn[p->n] = conn;
  p->n++;
}

static size_t pending_count(struct chan *c) {
  struct pend p = {.n = 0};
  gmb__fdchan_each_pending(&c->f.b, pend_collect, &p);
  return p.n;
}

/* The listener is readable: accept what waits, as often as the loop
 * would (each call takes a bounded batch). */
static void accept_at(struct chan *c, uint64_t now) {
  for (int i = 0; i < 16; i++) gmb__fdchan_accept(&c->f.b, now);
}

static void accept_all(struct chan *c) { accept_at(c, gmb__now_ns()); }

/* Every pending connection is handed to pending_ready, as the loop does
 * for each one poll finds readable (one with nothing to read returns). */
static void serve_pending(struct chan *c) {
  struct pend p = {.n = 0};
  gmb__fdchan_each_pending(&c->f.b, pend_collect, &p);
  for (size_t i = 0; i < p.n; i++)
    gmb__fdchan_pending_ready(&c->f.b, p.conn[i]);
}

/* The session with id `id` reads its channel; 1 when it still lives
 * afterwards. */
static int serve_session(struct chan *c, uint64_t id) {
  struct gmb_session *s = gmb__session_by_id(c->f.b.sessions, id);
  ck_assert_ptr_nonnull(s);
  ck_assert_int_ge(s->fdconn, 0);
  gmb__fdchan_session_ready(&c->f.b, s);
  ck_assert_int_eq(gmb__core_check(&c->f.b), 0);
  ck_assert_int_eq(gmb__fdchan_check(&c->f.b), 0);
  return gmb__session_by_id(c->f.b.sessions, id) != NULL;
}

/* --- the client's side --------------------------------------------------- */

static int cli_connect(const struct chan *c) {
  int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  ck_assert_int_ge(fd, 0);
  struct sockaddr_un sa;
  memset(&sa, 0, sizeof sa);
  sa.sun_family = AF_UNIX;
  memcpy(sa.sun_path, c->path, strlen(c->path) + 1);
  ck_assert_msg(connect(fd, (struct sockaddr *)&sa, sizeof sa) == 0,
                "connect %s: %s", c->path, strerror(errno));
  return fd;
}

static struct gmb_fd_req req_of(uint32_t op, uint64_t session,
                                uint64_t segment, const uint8_t *secret) {
  struct gmb_fd_req r;
  memset(&r, 0, sizeof r);
  r.magic = GMB_FD_MAGIC;
  r.op = op;
  r.session = session;
  r.segment = segment;
  if (secret) memcpy(r.secret, secret, GMB_FD_SECRET_LEN);
  return r;
}

/* Sends a request, with descriptor `attach` unless it is -1. */
static void cli_send(int sock, const struct gmb_fd_req *r, int attach) {
  ck_assert_int_eq(gmb__fd_send(sock, r, sizeof *r, attach, 0), 0);
}

static void cli_auth(int sock, const struct gmb_session *s) {
  struct gmb_fd_req r = req_of(GMB_FD_AUTH, s->id, 0, s->secret);
  cli_send(sock, &r, -1);
}

static void cli_segment(int sock, uint64_t session, uint64_t seg) {
  struct gmb_fd_req r = req_of(GMB_FD_SEGMENT, session, seg, NULL);
  cli_send(sock, &r, -1);
}

/* Reads the one reply that must be there now; *fd gets its descriptor
 * (-1: none). */
static struct gmb_fd_rep cli_reply(int sock, int *fd) {
  struct gmb_fd_rep rep;
  memset(&rep, 0, sizeof rep);
  ssize_t n = gmb__fd_recv(sock, &rep, sizeof rep, fd, MSG_DONTWAIT);
  ck_assert_msg(n == (ssize_t)sizeof rep, "reply: got %zd (%s)", n,
                n < 0 ? strerror((int)-n) : "short");
  ck_assert_uint_eq(rep.magic, GMB_FD_MAGIC);
  ck_assert_uint_lt(strnlen(rep.message, sizeof rep.message),
                    sizeof rep.message);
  return rep;
}

/* A refusal: status `want`, a reason, and no descriptor. */
static struct gmb_fd_rep cli_refused(int sock, int want) {
  int fd = -1;
  struct gmb_fd_rep rep = cli_reply(sock, &fd);
  ck_assert_int_eq(rep.status, want);
  ck_assert_int_eq(fd, -1);
  ck_assert_uint_gt(strlen(rep.message), 0);
  ck_assert_uint_eq(rep.size, 0);
  return rep;
}

/* 1 when the broker closed its end (after whatever it sent before). */
static int cli_hung_up(int sock) {
  char buf[sizeof(struct gmb_fd_rep) + 8];
  int fd = -1;
  ssize_t n = gmb__fd_recv(sock, buf, sizeof buf, &fd, MSG_DONTWAIT);
  if (fd >= 0) close(fd);
  return n == 0 || n == -ECONNRESET;
}

/* 1 when the connection is open and nothing waits to be read. */
static int cli_quiet(int sock) {
  char buf[sizeof(struct gmb_fd_rep) + 8];
  int fd = -1;
  ssize_t n = gmb__fd_recv(sock, buf, sizeof buf, &fd, MSG_DONTWAIT);
  if (fd >= 0) close(fd);
  return n == -EAGAIN || n == -EWOULDBLOCK;
}

/* Opens session `rid` of this process's uid in `tenant` and its channel:
 * connect, AUTH, the lock table's descriptor (in *lt_fd when not NULL,
 * else closed).  Returns the client's socket. */
static int chan_session(struct chan *c, const char *rid, const char *tenant,
                        struct gmb_session **out, int *lt_fd) {
  struct gmb_session *s = fx_hello(&c->f, rid, geteuid(), tenant);
  int sock = cli_connect(c);
  accept_all(c);
  cli_auth(sock, s);
  serve_pending(c);
  int fd = -1;
  struct gmb_fd_rep rep = cli_reply(sock, &fd);
  ck_assert_msg(rep.status == 0, "auth: %s", rep.message);
  ck_assert_int_ge(fd, 0);
  ck_assert_int_ge(s->fdconn, 0);
  if (lt_fd)
    *lt_fd = fd;
  else
    close(fd);
  if (out) *out = s;
  return sock;
}

/* Asks for segment `seg` and requires its descriptor; returns it. */
static int must_segment(struct chan *c, int sock, const struct gmb_session *s,
                        uint64_t seg, uint64_t size) {
  uint64_t id = s->id;
  cli_segment(sock, id, seg);
  ck_assert_int_eq(serve_session(c, id), 1);
  int fd = -1;
  struct gmb_fd_rep rep = cli_reply(sock, &fd);
  ck_assert_msg(rep.status == 0, "segment %" PRIu64 ": %s", seg, rep.message);
  ck_assert_uint_eq(rep.op, GMB_FD_SEGMENT);
  ck_assert_uint_eq(rep.segment, seg);
  ck_assert_uint_eq(rep.size, size);
  ck_assert_int_ge(fd, 0);
  return fd;
}

/* What the broker logs while fn runs (its log is its stderr); the text is
 * written to the real stderr afterwards as well. */
struct logcap {
  int saved, fd;
};

static void log_begin(struct logcap *l) {
  fflush(stderr);
  l->fd = memfd_create("log", MFD_CLOEXEC);
  ck_assert_int_ge(l->fd, 0);
  l->saved = dup(STDERR_FILENO);
  ck_assert_int_ge(l->saved, 0);
  ck_assert_int_ge(dup2(l->fd, STDERR_FILENO), 0);
}

static void log_end(struct logcap *l, char *buf, size_t cap) {
  fflush(stderr);
  ck_assert_int_ge(dup2(l->saved, STDERR_FILENO), 0);
  close(l->saved);
  ssize_t n = pread(l->fd, buf, cap - 1, 0);
  close(l->fd);
  buf[n > 0 ? n : 0] = '\0';
  if (n > 0) {
    ssize_t w = write(STDERR_FILENO, buf, (size_t)n);
    (void)w;
  }
}

/* The segment a session's allocation lives in, from the broker's books. */
static const struct gmb_dseg *segment_of(struct chan *c, uint64_t seg) {
  const struct gmb_dseg *d = gmb__pool_segment(c->f.b.pool, seg, NULL);
  ck_assert_ptr_nonnull(d);
  return d;
}

static int recorded(const struct gmb_session *s, uint64_t seg) {
  for (size_t i = 0; i < s->n_segs; i++)
    if (s->segs[i] == seg) return 1;
  return 0;
}

/* The loop's ticks, as many as it takes to look at every channel holding
 * descriptors (each tick looks at a bounded number), on the test's own
 * clock, ahead of the real one: pending connections expire meanwhile.
 * Returns the channels kept for ended sessions that are left. */
static size_t sweep_unread(struct chan *c) {
  if (c->clock == 0) c->clock = gmb__now_ns();
  size_t n = gmb__sessions_count(c->f.b.sessions) + c->f.b.fd_kept;
  for (size_t i = 0; i <= n / GMB_FDCHAN_UNREAD_SWEEP + 1; i++) {
    c->clock += (uint64_t)GMB_FDCHAN_UNREAD_TICK_MS * GMB_NS_PER_MS;
    gmb__fdchan_expire(&c->f.b, c->clock);
  }
  ck_assert_int_eq(gmb__fdchan_check(&c->f.b), 0);
  return c->f.b.fd_kept;
}

/* --- AUTH ----------------------------------------------------------------- */

START_TEST(auth_ok_sends_lock_table) {
  struct chan c;
  chan_open(&c);
  struct gmb_session *s = fx_hello(&c.f, "a", geteuid(), "");
  int sock = cli_connect(&c);
  uint64_t gen = gmb__fdchan_gen(&c.f.b);
  ck_assert_uint_eq(pending_count(&c), 0);
  accept_all(&c);
  ck_assert_uint_eq(pending_count(&c), 1);
  ck_assert_uint_ne(gmb__fdchan_gen(&c.f.b), gen);
  /* Nothing to read yet: it waits. */
  serve_pending(&c);
  ck_assert_uint_eq(pending_count(&c), 1);
  ck_assert_int_eq(cli_quiet(sock), 1);
  gen = gmb__fdchan_gen(&c.f.b);
  uint64_t sgen = gmb__sessions_gen(c.f.b.sessions);
  cli_auth(sock, s);
  serve_pending(&c);
  int fd = -1;
  struct gmb_fd_rep rep = cli_reply(sock, &fd);
  ck_assert_int_eq(rep.status, 0);
  ck_assert_uint_eq(rep.op, GMB_FD_AUTH);
  ck_assert_uint_eq(rep.size, gmb__locktab_bytes(s->lt));
  ck_assert_uint_eq(rep.size, gmb__lt_bytes(GMB_LT_DEFAULT_SLOTS));
  ck_assert_int_ge(fd, 0);
  /* The connection is the session's now: out of the pending table, and
   * the loop must poll it (both generations changed). */
  ck_assert_uint_eq(pending_count(&c), 0);
  ck_assert_int_ge(s->fdconn, 0);
  ck_assert_uint_ne(gmb__fdchan_gen(&c.f.b), gen);
  ck_assert_uint_ne(gmb__sessions_gen(c.f.b.sessions), sgen);
  /* The lock table: sealed, of its size, closed on exec. */
  struct stat st;
  ck_assert_int_eq(fstat(fd, &st), 0);
  ck_assert_uint_eq((uint64_t)st.st_size, rep.size);
  ck_assert_int_eq(fcntl(fd, F_GET_SEALS),
                   F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
  ck_assert_int_eq(fcntl(fd, F_GETFD) & FD_CLOEXEC, FD_CLOEXEC);
  errno = 0;
  ck_assert_int_eq(ftruncate(fd, 0), -1);
  ck_assert_int_eq(errno, EPERM);
  struct gmb__lt_header *h = fx_map_fd(fd, rep.size);
  close(fd);
  ck_assert_uint_eq(h->magic, GMB_LT_MAGIC);
  ck_assert_uint_eq(h->session, s->id);
  ck_assert_uint_eq(h->slots, GMB_LT_DEFAULT_SLOTS);
  /* The very table the broker writes: a movable allocation's slot. */
  struct wire_reply r = fx_must_alloc(&c.f, "a", geteuid(), MIB, GMB_MOVABLE);
  ck_assert_uint_eq(gmb__lt_slots(h)[r.u.alloc.slot].id, r.u.alloc.id);
  fx_unmap_locktab(h);
  ck_assert_int_eq(cli_quiet(sock), 1);
  close(sock);
  chan_close(&c);
}
END_TEST

/* Wrong secret, unknown session, a session of another uid: the same
 * refusal (nothing tells which part was wrong), then the connection is
 * closed and no session has a channel. */
START_TEST(auth_refusals_look_alike) {
  struct chan c;
  chan_open(&c);
  uid_t me = geteuid(), other = me == 1001 ? 1002 : 1001;
  struct gmb_session *s = fx_hello(&c.f, "a", me, "");
  struct gmb_session *o = fx_hello(&c.f, "o", other, "");
  enum { N = 5 };
  struct gmb_fd_req r[N];
  uint8_t wrong[GMB_FD_SECRET_LEN];
  memcpy(wrong, s->secret, sizeof wrong);
  wrong[GMB_FD_SECRET_LEN - 1] ^= 1; /* the last byte only */
  r[0] = req_of(GMB_FD_AUTH, s->id, 0, wrong);
  r[1] = req_of(GMB_FD_AUTH, s->id, 0, NULL); /* all zero */
  r[2] = req_of(GMB_FD_AUTH, s->id + 1000, 0, s->secret);
  r[3] = req_of(GMB_FD_AUTH, 0, 0, s->secret);
  r[4] = req_of(GMB_FD_AUTH, o->id, 0, o->secret); /* uid differs */
  char first[GMB_FD_MESSAGE_MAX] = "";
  for (int i = 0; i < N; i++) {
    int sock = cli_connect(&c);
    accept_all(&c);
    cli_send(sock, &r[i], -1);
    serve_pending(&c);
    struct gmb_fd_rep rep = cli_refused(sock, GMB_E_AUTH);
    ck_assert_uint_eq(rep.op, GMB_FD_AUTH);
    if (i == 0)
      snprintf(first, sizeof first, "%s", rep.message);
    else
      ck_assert_str_eq(rep.message, first);
    ck_assert_int_eq(cli_hung_up(sock), 1);
    ck_assert_uint_eq(pending_count(&c), 0);
    close(sock);
  }
  ck_assert_int_eq(s->fdconn, -1);
  ck_assert_int_eq(o->fdconn, -1);
  ck_assert_uint_eq(gmb__sessions_count(c.f.b.sessions), 2);
  /* The right secret still works afterwards (no lockout). */
  int sock = cli_connect(&c);
  accept_all(&c);
  cli_auth(sock, s);
  serve_pending(&c);
  int fd = -1;
  ck_assert_int_eq(cli_reply(sock, &fd).status, 0);
  close(fd);
  close(sock);
  chan_close(&c);
}
END_TEST

/* A process of another uid that knows a session's id and secret (as root
 * the test can run one): refused like any wrong guess. */
START_TEST(auth_other_uid_process_refused) {
  if (geteuid() != 0) {
    fprintf(stderr, "auth_other_uid_process_refused: skipped: needs root "
            "to run a process of another uid (the uid check itself is "
            "covered by auth_refusals_look_alike)\n");
    return;
  }
  struct chan c;
  chan_open(&c);
  ck_assert_int_eq(chmod(c.f.dir, 0755), 0); /* let uid 65534 reach it */
  struct gmb_session *s = fx_hello(&c.f, "root", 0, "");
  int res[2];
  ck_assert_int_eq(pipe(res), 0);
  fflush(stderr);
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0) {
    /* uid 65534 with the session's id and secret (a copy of this
     * process's memory): result codes through the pipe. */
    close(res[0]);
    int code = 0;
    if (setgroups(0, NULL) != 0 || setgid(65534) != 0 || setuid(65534) != 0)
      code = 100;
    int sock = code ? -1 : socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    struct sockaddr_un sa;
    memset(&sa, 0, sizeof sa);
    sa.sun_family = AF_UNIX;
    memcpy(sa.sun_path, c.path, strlen(c.path) + 1);
    if (!code && (sock < 0 ||
                  connect(sock, (struct sockaddr *)&sa, sizeof sa) != 0))
      code = 101;
    struct gmb_fd_req r = req_of(GMB_FD_AUTH, s->id, 0, s->secret);
    if (!code && gmb__fd_send(sock, &r, sizeof r, -1, 0) != 0) code = 102;
    struct gmb_fd_rep rep;
    int fd = -1;
    if (!code) {
      struct timeval tv = {.tv_sec = 5};
      setsockopt(sock, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
      if (gmb__fd_recv(sock, &rep, sizeof rep, &fd, 0) != sizeof rep)
        code = 103;
      else if (rep.status != GMB_E_AUTH)
        code = 104;
      else if (fd >= 0)
        code = 105;
      else if (gmb__fd_recv(sock, &rep, sizeof rep, &fd, 0) != 0)
        code = 106; /* not hung up */
    }
    ssize_t w = write(res[1], &code, sizeof code);
    (void)w;
    _exit(0);
  }
  close(res[1]);
  /* The broker's side, as the loop: the listener turns readable, then the
   * connection. */
  struct pollfd p = {.fd = gmb__fdchan_listener(&c.f.b), .events = POLLIN};
  ck_assert_int_eq(poll(&p, 1, 5000), 1);
  accept_all(&c);
  ck_assert_uint_eq(pending_count(&c), 1);
  struct pend pd = {.n = 0};
  gmb__fdchan_each_pending(&c.f.b, pend_collect, &pd);
  struct pollfd q = {.fd = pd.fd[0], .events = POLLIN};
  ck_assert_int_eq(poll(&q, 1, 5000), 1);
  gmb__fdchan_pending_ready(&c.f.b, pd.conn[0]);
  int code = -1;
  ck_assert_int_eq(read(res[0], &code, sizeof code), (ssize_t)sizeof code);
  close(res[0]);
  int st;
  ck_assert_int_eq(waitpid(pid, &st, 0), pid);
  ck_assert_int_eq(code, 0);
  ck_assert_int_eq(s->fdconn, -1);
  ck_assert_uint_eq(pending_count(&c), 0);
  chan_close(&c);
}
END_TEST

START_TEST(auth_second_channel_limit) {
  struct chan c;
  chan_open(&c);
  struct gmb_session *s;
  int sock = chan_session(&c, "a", "", &s, NULL);
  int fdconn = s->fdconn;
  int sock2 = cli_connect(&c);
  accept_all(&c);
  cli_auth(sock2, s);
  serve_pending(&c);
  struct gmb_fd_rep rep = cli_refused(sock2, GMB_E_LIMIT);
  ck_assert_uint_eq(rep.op, GMB_FD_AUTH);
  ck_assert_int_eq(cli_hung_up(sock2), 1);
  close(sock2);
  /* The first channel is untouched and serves. */
  ck_assert_int_eq(s->fdconn, fdconn);
  uint64_t seg = fx_must_alloc(&c.f, "a", geteuid(), MIB, 0).u.alloc.segment;
  close(must_segment(&c, sock, s, seg, 2 * MIB));
  close(sock);
  chan_close(&c);
}
END_TEST

/* The first message must be a whole AUTH: anything else closes the
 * connection (with a GMB_E_PROTO reply when it was a whole message). */
START_TEST(first_message_not_auth_closed) {
  struct chan c;
  chan_open(&c);
  struct gmb_session *s = fx_hello(&c.f, "a", geteuid(), "");
  int fds = fx_count_fds();
  struct gmb_fd_req seg = req_of(GMB_FD_SEGMENT, s->id, 1, s->secret);
  struct gmb_fd_req magic = req_of(GMB_FD_AUTH, s->id, 0, s->secret);
  magic.magic ^= 0xff;
  struct gmb_fd_req op0 = req_of(0, s->id, 0, s->secret);
  uint8_t big[sizeof(struct gmb_fd_req) + 100];
  memcpy(big, &magic, sizeof magic);
  memcpy(big, &(uint32_t){GMB_FD_MAGIC}, 4);
  static const struct {
    int kind; /* 0: a request, 1: raw bytes, 2: hang up */
    size_t len;
    int proto_reply; /* a GMB_E_PROTO reply before the close */
  } cases[] = {
      {0, sizeof seg, 1},  /* SEGMENT before AUTH */
      {1, sizeof magic, 1}, /* wrong magic */
      {2, sizeof op0, 1},  /* op 0 */
      {3, 4, 1},           /* 4 bytes */
      {3, sizeof(struct gmb_fd_req) - 1, 1}, /* one byte short */
      {3, sizeof big, 0},  /* longer than any request (truncated) */
      {3, 0, 0},           /* an empty message */
      {4, 0, 0},           /* hang up without a word */
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    int sock = cli_connect(&c);
    accept_all(&c);
    ck_assert_uint_eq(pending_count(&c), 1);
    switch (cases[i].kind) {
      case 0: cli_send(sock, &seg, -1); break;
      case 1: cli_send(sock, &magic, -1); break;
      case 2: cli_send(sock, &op0, -1); break;
      case 3:
        ck_assert_int_eq(gmb__fd_send(sock, big, cases[i].len, -1, 0), 0);
        break;
      case 4: shutdown(sock, SHUT_WR); break;
    }
    serve_pending(&c);
    ck_assert_msg(pending_count(&c) == 0, "case %zu still pending", i);
    if (cases[i].proto_reply) {
      struct gmb_fd_rep rep = cli_refused(sock, GMB_E_PROTO);
      ck_assert_ptr_nonnull(strstr(rep.message, "AUTH"));
    }
    ck_assert_msg(cli_hung_up(sock), "case %zu not closed", i);
    close(sock);
  }
  ck_assert_int_eq(s->fdconn, -1);
  ck_assert_int_eq(fx_count_fds(), fds);
  chan_close(&c);
}
END_TEST

/* At most room connections wait to authenticate, and
 * room_PER_UID of one uid other than root; more are closed at
 * accept, and a freed place takes the next one. */
START_TEST(pending_table_bounded) {
  struct chan c;
  chan_open(&c);
  const int room = geteuid() == 0 ? GMB_FDCHAN_PENDING
                                   : GMB_FDCHAN_PENDING_PER_UID;
  enum { MAX = GMB_FDCHAN_PENDING + 6 };
  const int N = room + 6;
  int sock[MAX];
  for (int i = 0; i < N; i++) {
    sock[i] = cli_connect(&c);
    if (i % 8 == 7) accept_all(&c); /* before the backlog fills */
  }
  accept_all(&c);
  ck_assert_uint_eq(pending_count(&c), room);
  for (int i = 0; i < N; i++)
    ck_assert_msg(i < room ? cli_quiet(sock[i])
                                         : cli_hung_up(sock[i]),
                  "connection %d", i);
  /* The broker holds the listener's and the table's descriptors only. */
  ck_assert_int_eq(fx_count_fds(), c.idle_fds + N + room);
  /* One leaves: the next connection gets its place. */
  close(sock[3]);
  serve_pending(&c);
  ck_assert_uint_eq(pending_count(&c), room - 1);
  int late = cli_connect(&c);
  accept_all(&c);
  ck_assert_uint_eq(pending_count(&c), room);
  ck_assert_int_eq(cli_quiet(late), 1);
  /* And it may authenticate like any other. */
  struct gmb_session *s = fx_hello(&c.f, "a", geteuid(), "");
  cli_auth(late, s);
  serve_pending(&c);
  int fd = -1;
  ck_assert_int_eq(cli_reply(late, &fd).status, 0);
  close(fd);
  ck_assert_uint_eq(pending_count(&c), room - 1);
  close(late);
  for (int i = 0; i < N; i++)
    if (i != 3) close(sock[i]);
  chan_close(&c);
}
END_TEST

/* One uid that holds connections open without a word gets at most
 * GMB_FDCHAN_PENDING_PER_UID places; the rest are closed at accept, and
 * another uid's client still gets in and proves its session. */
START_TEST(pending_capped_per_uid) {
  if (geteuid() != 0) {
    fprintf(stderr, "pending_capped_per_uid: skipped: needs root to run a "
            "process of another uid (pending_table_bounded checks the cap "
            "on this uid)\n");
    return;
  }
  struct chan c;
  chan_open(&c);
  ck_assert_int_eq(chmod(c.f.dir, 0755), 0); /* let uid 65534 reach it */
  enum { FLOOD = GMB_FDCHAN_PENDING_PER_UID + 8 };
  int ready[2], done[2];
  ck_assert_int_eq(pipe(ready), 0);
  ck_assert_int_eq(pipe(done), 0);
  fflush(stderr);
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0) {
    char opened = 0;
    if (setgroups(0, NULL) == 0 && setgid(65534) == 0 && setuid(65534) == 0)
      for (int i = 0; i < FLOOD; i++)
        if (cli_connect(&c) >= 0) opened++;
    ssize_t w = write(ready[1], &opened, 1);
    char b;
    w = read(done[0], &b, 1); /* hold them until the test is done */
    (void)w;
    _exit(0);
  }
  char opened = 0;
  ck_assert_int_eq(read(ready[0], &opened, 1), 1);
  ck_assert_int_eq(opened, FLOOD);
  for (int i = 0; i < 4; i++) accept_all(&c);
  ck_assert_uint_eq(pending_count(&c), GMB_FDCHAN_PENDING_PER_UID);
  /* Root's client gets a place and proves its session. */
  struct gmb_session *s;
  int sock = chan_session(&c, "victim", "", &s, NULL);
  ck_assert_int_ge(s->fdconn, 0);
  close(sock);
  ck_assert_int_eq(write(done[1], "g", 1), 1);
  int st;
  ck_assert_int_eq(waitpid(pid, &st, 0), pid);
  close(ready[0]);
  close(ready[1]);
  close(done[0]);
  close(done[1]);
  chan_close(&c);
}
END_TEST

/* A connection that does not authenticate within GMB_FDCHAN_AUTH_MS is
 * closed by the expiry; the expiry says how long until the next
 * deadline. */
START_TEST(pending_expires) {
  struct chan c;
  chan_open(&c);
  uint64_t t0 = gmb__now_ns();
  uint64_t auth = GMB_FDCHAN_AUTH_MS * GMB_NS_PER_MS;
  ck_assert_uint_eq(auth, 2 * SEC);
  ck_assert_uint_eq(gmb__fdchan_expire(&c.f.b, t0), UINT64_MAX); /* none */
  int a = cli_connect(&c);
  accept_at(&c, t0);
  int b = cli_connect(&c);
  accept_at(&c, t0 + SEC);
  ck_assert_uint_eq(pending_count(&c), 2);
  ck_assert_uint_eq(gmb__fdchan_expire(&c.f.b, t0 + SEC / 2),
                    auth - SEC / 2);
  ck_assert_uint_eq(pending_count(&c), 2);
  /* 2.5 s on: a's deadline passed, b's is half a second away. */
  uint64_t gen = gmb__fdchan_gen(&c.f.b);
  ck_assert_uint_eq(gmb__fdchan_expire(&c.f.b, t0 + 5 * SEC / 2), SEC / 2);
  ck_assert_uint_eq(pending_count(&c), 1);
  ck_assert_uint_ne(gmb__fdchan_gen(&c.f.b), gen);
  ck_assert_int_eq(cli_hung_up(a), 1);
  ck_assert_int_eq(cli_quiet(b), 1);
  /* Exactly at its deadline b goes too. */
  ck_assert_uint_eq(gmb__fdchan_expire(&c.f.b, t0 + SEC + auth),
                    UINT64_MAX);
  ck_assert_uint_eq(pending_count(&c), 0);
  ck_assert_int_eq(cli_hung_up(b), 1);
  /* An authenticated connection has no deadline. */
  struct gmb_session *s;
  int sock = chan_session(&c, "a", "", &s, NULL);
  ck_assert_uint_eq(gmb__fdchan_expire(&c.f.b, UINT64_MAX - 1), UINT64_MAX);
  ck_assert_int_ge(s->fdconn, 0);
  ck_assert_int_eq(cli_quiet(sock), 1);
  close(a);
  close(b);
  close(sock);
  /* The session's channel and lock table. */
  ck_assert_int_eq(fx_count_fds(), c.idle_fds + 2);
  chan_close(&c);
}
END_TEST

/* --- SEGMENT -------------------------------------------------------------- */

START_TEST(segment_own_maps_broker_pages) {
  struct chan c;
  chan_open(&c);
  struct gmb_session *s, *s2;
  int sock = chan_session(&c, "a", "", &s, NULL);
  struct wire_reply r = fx_must_alloc(&c.f, "a", geteuid(), MIB, 0);
  uint64_t seg = r.u.alloc.segment;
  ck_assert_uint_eq(s->n_segs, 0);
  int fd = must_segment(&c, sock, s, seg, 2 * MIB);
  /* Recorded as given, so that its retirement is announced to s. */
  ck_assert_uint_eq(s->n_segs, 1);
  ck_assert_int_eq(recorded(s, seg), 1);
  ck_assert_int_eq(gmb__session_seg_seen(s, seg), 1);
  /* A sealed file of the segment's size... */
  struct stat st;
  ck_assert_int_eq(fstat(fd, &st), 0);
  ck_assert_uint_eq((uint64_t)st.st_size, 2 * MIB);
  ck_assert_int_eq(fcntl(fd, F_GET_SEALS),
                   F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
  errno = 0;
  ck_assert_int_eq(ftruncate(fd, MIB), -1);
  ck_assert_int_eq(errno, EPERM);
  /* ...whose pages are the broker's segment. */
  unsigned char *m = fx_map_fd(fd, 2 * MIB);
  close(fd);
  unsigned char *h = segment_of(&c, seg)->host;
  h[r.u.alloc.offset] = 0x3c;
  h[2 * MIB - 1] = 0xc3;
  ck_assert_uint_eq(m[r.u.alloc.offset], 0x3c);
  ck_assert_uint_eq(m[2 * MIB - 1], 0xc3);
  m[r.u.alloc.offset + 1] = 0x77;
  ck_assert_uint_eq(h[r.u.alloc.offset + 1], 0x77);
  munmap(m, 2 * MIB);
  /* Asked again (a client that lost it): given again, recorded once. */
  close(must_segment(&c, sock, s, seg, 2 * MIB));
  ck_assert_uint_eq(s->n_segs, 1);
  /* Another session of the tenant may have it too, and is recorded. */
  int sock2 = chan_session(&c, "a2", "", &s2, NULL);
  close(must_segment(&c, sock2, s2, seg, 2 * MIB));
  ck_assert_int_eq(recorded(s2, seg), 1);
  /* A large segment, then released: gone for its tenant too. */
  uint64_t big = fx_must_alloc(&c.f, "a", geteuid(), 4 * MIB, 0).u.alloc.id;
  struct gmb_alloc_info info;
  ck_assert_int_eq(gmb__pool_find(c.f.b.pool, big, &info), 0);
  uint64_t bigseg = info.dseg->id;
  close(must_segment(&c, sock, s, bigseg, 4 * MIB));
  ck_assert_int_eq(fx_free(&c.f, "a", geteuid(), big), 0);
  ck_assert_ptr_null(gmb__pool_segment(c.f.b.pool, bigseg, NULL));
  cli_segment(sock, s->id, bigseg);
  ck_assert_int_eq(serve_session(&c, s->id), 1);
  cli_refused(sock, GMB_E_NOENT);
  close(sock);
  close(sock2);
  chan_close(&c);
}
END_TEST

/* Another tenant's segment gets the answer of one that does not exist,
 * with no descriptor, and the session goes on. */
START_TEST(segment_other_tenant_noent) {
  struct chan c;
  chan_open(&c);
  struct gmb_session *a, *b;
  int sa = chan_session(&c, "a", "ta", &a, NULL);
  int sb = chan_session(&c, "b", "tb", &b, NULL);
  uid_t me = geteuid();
  uint64_t segb = fx_must_alloc(&c.f, "b", me, MIB, 0).u.alloc.segment;
  uint64_t sega = fx_must_alloc(&c.f, "a", me, MIB, 0).u.alloc.segment;
  ck_assert_uint_ne(sega, segb);
  int fds = fx_count_fds();
  static const uint64_t delta[] = {0, 1000};
  for (int i = 0; i < 2; i++) {
    uint64_t ask = segb + delta[i];
    if (i == 1)
      ck_assert_ptr_null(gmb__pool_segment(c.f.b.pool, ask, NULL));
    cli_segment(sa, a->id, ask);
    ck_assert_int_eq(serve_session(&c, a->id), 1);
    struct gmb_fd_rep rep = cli_refused(sa, GMB_E_NOENT);
    ck_assert_uint_eq(rep.op, GMB_FD_SEGMENT);
    ck_assert_uint_eq(rep.segment, ask);
    char want[GMB_FD_MESSAGE_MAX];
    snprintf(want, sizeof want, "no segment %" PRIu64 " for tenant ta", ask);
    ck_assert_str_eq(rep.message, want);
  }
  /* Ids that are nobody's: 0 and the largest. */
  static const uint64_t none[] = {0, UINT64_MAX};
  for (int i = 0; i < 2; i++) {
    cli_segment(sa, a->id, none[i]);
    ck_assert_int_eq(serve_session(&c, a->id), 1);
    cli_refused(sa, GMB_E_NOENT);
  }
  /* Nothing recorded, no descriptor made, and the session lives. */
  ck_assert_uint_eq(a->n_segs, 0);
  ck_assert_int_eq(fx_count_fds(), fds);
  ck_assert_int_eq(cli_quiet(sa), 1);
  close(must_segment(&c, sa, a, sega, 2 * MIB));
  /* The session id in a request is not what decides: b's connection
   * asking with a's id is still b asking. */
  cli_segment(sb, a->id, sega);
  ck_assert_int_eq(serve_session(&c, b->id), 1);
  cli_refused(sb, GMB_E_NOENT);
  close(must_segment(&c, sb, b, segb, 2 * MIB));
  close(sa);
  close(sb);
  chan_close(&c);
}
END_TEST

/* Two tenants proved by tokens under one uid (root
 * containers, the documented setup) cannot reach each other's memory.
 * The uid is the same, so nothing but the session decides: a session is
 * given its own lock table and its own tenant's segments only, and a
 * token proves its own tenant only. */
#define TOKEN_A "secret-a"
#define TOKEN_B "secret-b"
#define INI_TOKENS                                                          \
  "[tenant:job-a]\ntoken_sha256 = "                                        \
  "8766b9cb08e6040b704f1e3ee1e186efccf2635b1d2634d6525333007e6aeae1\n"     \
  "[tenant:job-b]\ntoken_sha256 = "                                        \
  "ff492ef788c89b555e6f738b33d2422f57dbb6656af2402155672c5f123a90af\n"

static int hello_token(struct chan *c, const char *rid, const char *tenant,
                       const char *token, struct wire_reply *rep) {
  struct wire_request req;
  memset(&req, 0, sizeof req);
  req.kind = WIRE_HELLO;
  req.u.hello.version = WIRE_PROTOCOL_VERSION;
  snprintf(req.u.hello.tenant, sizeof req.u.hello.tenant, "%s", tenant);
  req.u.hello.token_len = (uint32_t)strlen(token);
  memcpy(req.u.hello.token, token, strlen(token));
  fx_request(&c->f, rid, geteuid(), &req, rep);
  return rep->status;
}

START_TEST(same_uid_token_tenants_apart) {
  struct chan c;
  chan_open_ini(&c, "host:64MiB", INI_TOKENS);
  uid_t me = geteuid();
  struct wire_reply rep;
  /* A token proves its own tenant only, whatever the uid. */
  ck_assert_int_eq(hello_token(&c, "x", "job-b", TOKEN_A, &rep), GMB_E_AUTH);
  ck_assert_int_eq(hello_token(&c, "a", "job-a", TOKEN_A, &rep), 0);
  ck_assert_int_eq(hello_token(&c, "b", "job-b", TOKEN_B, &rep), 0);
  struct gmb_session *a = gmb__session_find(c.f.b.sessions,
                                            (const uint8_t *)"a", 1);
  struct gmb_session *b = gmb__session_find(c.f.b.sessions,
                                            (const uint8_t *)"b", 1);
  ck_assert_ptr_nonnull(a);
  ck_assert_ptr_nonnull(b);
  ck_assert_uint_eq(a->uid, b->uid);
  ck_assert_ptr_ne(a->tenant, b->tenant);
  uint64_t segb = fx_must_alloc(&c.f, "b", me, MIB, GMB_MOVABLE).u.alloc.segment;
  uint64_t sega = fx_must_alloc(&c.f, "a", me, MIB, 0).u.alloc.segment;
  /* a's process proves a, then asks for b's segment: nothing. */
  int sa = cli_connect(&c);
  accept_all(&c);
  cli_auth(sa, a);
  serve_pending(&c);
  int lt = -1;
  struct gmb_fd_rep r = cli_reply(sa, &lt);
  ck_assert_int_eq(r.status, 0);
  ck_assert_int_ge(lt, 0);
  close(lt);
  cli_segment(sa, b->id, segb);
  ck_assert_int_eq(serve_session(&c, a->id), 1);
  cli_refused(sa, GMB_E_NOENT);
  ck_assert_uint_eq(a->n_segs, 0);
  close(must_segment(&c, sa, a, sega, 2 * MIB));
  /* Nor b's lock table: b's id with a's secret (the same uid) is refused,
   * and so is a second channel for a. */
  int sx = cli_connect(&c);
  accept_all(&c);
  struct gmb_fd_req req = req_of(GMB_FD_AUTH, b->id, 0, a->secret);
  cli_send(sx, &req, -1);
  serve_pending(&c);
  cli_refused(sx, GMB_E_AUTH);
  close(sx);
  ck_assert_int_eq(b->fdconn, -1);
  close(sa);
  chan_close(&c);
}
END_TEST

START_TEST(unknown_op_proto_session_lives) {
  struct chan c;
  chan_open(&c);
  struct gmb_session *s;
  int sock = chan_session(&c, "a", "", &s, NULL);
  uint64_t id = s->id;
  static const uint32_t ops[] = {0, GMB_FD_AUTH, 3, 99, UINT32_MAX};
  for (size_t i = 0; i < sizeof ops / sizeof ops[0]; i++) {
    struct gmb_fd_req r = req_of(ops[i], id, 0, s->secret);
    cli_send(sock, &r, -1);
    ck_assert_int_eq(serve_session(&c, id), 1);
    struct gmb_fd_rep rep = cli_refused(sock, GMB_E_PROTO);
    ck_assert_uint_eq(rep.op, ops[i]);
    char want[64];
    snprintf(want, sizeof want, "unknown request %u", (unsigned)ops[i]);
    ck_assert_str_eq(rep.message, want);
  }
  uint64_t seg = fx_must_alloc(&c.f, "a", geteuid(), 512, 0).u.alloc.segment;
  close(must_segment(&c, sock, s, seg, 2 * MIB));
  close(sock);
  chan_close(&c);
}
END_TEST

/* The listener lets descriptors through, as a kernel before Linux 6.16
 * does (SO_PASSRIGHTS), or refuses them again. */
static void chan_rights(struct chan *c, int refuse) {
  int got = gmb__fd_refuse_rights(gmb__fdchan_listener(&c->f.b), refuse);
  if (!refuse) ck_assert_int_eq(got, 0);
}

/* Two descriptors in one message (fdpass.c refuses more than one). */
static void send_two_fds(int sock, const void *msg, size_t len, int fd1,
                         int fd2) {
  struct iovec iov = {.iov_base = (void *)msg, .iov_len = len};
  union {
    char buf[CMSG_SPACE(2 * sizeof(int))];
    struct cmsghdr align;
  } u;
  memset(&u, 0, sizeof u);
  struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1,
                      .msg_control = u.buf, .msg_controllen = sizeof u.buf};
  struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
  cm->cmsg_level = SOL_SOCKET;
  cm->cmsg_type = SCM_RIGHTS;
  cm->cmsg_len = CMSG_LEN(2 * sizeof(int));
  int fds[2] = {fd1, fd2};
  memcpy(CMSG_DATA(cm), fds, sizeof fds);
  ck_assert_int_eq(sendmsg(sock, &mh, MSG_NOSIGNAL), (ssize_t)len);
}

/* Garbage from an authenticated session ends it, and its memory is
 * freed; other sessions go on. */
START_TEST(session_garbage_ends_it) {
  struct chan c;
  chan_open(&c);
  chan_rights(&c, 0); /* two descriptors must get through to be garbage */
  struct gmb_session *keep;
  int ksock = chan_session(&c, "keep", "", &keep, NULL);
  uid_t me = geteuid();
  fx_must_alloc(&c.f, "keep", me, MIB, 0);
  for (int kind = 0; kind < 5; kind++) {
    char rid[16];
    snprintf(rid, sizeof rid, "g%d", kind);
    struct gmb_session *s;
    int sock = chan_session(&c, rid, "", &s, NULL);
    uint64_t id = s->id;
    struct gmb_tenant *t = s->tenant;
    uint64_t used = t->used;
    fx_must_alloc(&c.f, rid, me, 3 * MIB, GMB_MOVABLE);
    struct gmb_fd_req r = req_of(GMB_FD_SEGMENT, id, 1, NULL);
    uint8_t big[sizeof r + 64];
    memset(big, 0xee, sizeof big);
    memcpy(big, &r, sizeof r);
    switch (kind) {
      case 0: /* short */
        ck_assert_int_eq(gmb__fd_send(sock, &r, 10, -1, 0), 0);
        break;
      case 1: /* wrong magic */
        r.magic = 0;
        cli_send(sock, &r, -1);
        break;
      case 2: /* longer than a request */
        ck_assert_int_eq(gmb__fd_send(sock, big, sizeof big, -1, 0), 0);
        break;
      case 3: /* two descriptors */
        send_two_fds(sock, &r, sizeof r, 0, 1);
        break;
      case 4: /* empty */
        ck_assert_int_eq(gmb__fd_send(sock, &r, 0, -1, 0), 0);
        break;
    }
    ck_assert_msg(serve_session(&c, id) == 0, "kind %d: session lives", kind);
    ck_assert_uint_eq(t->used, used);
    ck_assert_msg(cli_hung_up(sock), "kind %d: not closed", kind);
    close(sock);
  }
  ck_assert_ptr_eq(gmb__session_by_id(c.f.b.sessions, keep->id), keep);
  ck_assert_uint_eq(keep->tenant->used, MIB);
  ck_assert_int_eq(cli_quiet(ksock), 1);
  close(ksock);
  chan_rights(&c, 1);
  chan_close(&c);
}
END_TEST

/* The client's end closing is its process exiting, in whatever PID
 * namespace: the session ends and its memory is freed. */
START_TEST(client_close_ends_session) {
  struct chan c;
  chan_open(&c);
  struct gmb_session *s;
  int sock = chan_session(&c, "a", "", &s, NULL);
  uid_t me = geteuid();
  uint64_t id = s->id;
  struct gmb_tenant *t = s->tenant;
  uint64_t ids[3];
  ids[0] = fx_must_alloc(&c.f, "a", me, MIB, GMB_MOVABLE).u.alloc.id;
  ids[1] = fx_must_alloc(&c.f, "a", me, 3 * MIB, 0).u.alloc.id;
  ids[2] = fx_must_alloc(&c.f, "a", me, 4096, 0).u.alloc.id;
  ck_assert_uint_gt(t->used, 0);
  close(sock);
  struct logcap l;
  char log[8192];
  log_begin(&l);
  int alive = serve_session(&c, id);
  log_end(&l, log, sizeof log);
  ck_assert_int_eq(alive, 0);
  ck_assert_ptr_null(gmb__session_by_id(c.f.b.sessions, id));
  ck_assert_ptr_null(
      gmb__session_find(c.f.b.sessions, (const uint8_t *)"a", 1));
  ck_assert_ptr_nonnull(strstr(log, "descriptor channel closed"));
  ck_assert_uint_eq(t->used, 0);
  ck_assert_uint_eq(t->n_sessions, 0);
  for (int i = 0; i < 3; i++)
    ck_assert_int_eq(gmb__pool_find(c.f.b.pool, ids[i], NULL), GMB_E_NOENT);
  chan_close(&c);
}
END_TEST

/* A client that asks and never reads: once the broker's reply cannot be
 * sent at once, the session ends; the broker never waits. */
START_TEST(client_never_reads_ended) {
  struct chan c;
  chan_open(&c);
  struct gmb_session *s;
  int sock = chan_session(&c, "a", "", &s, NULL);
  uint64_t id = s->id;
  struct gmb_tenant *t = s->tenant;
  uint64_t seg = fx_must_alloc(&c.f, "a", geteuid(), MIB, 0).u.alloc.segment;
  struct gmb_fd_req r = req_of(GMB_FD_SEGMENT, id, seg, NULL);
  struct logcap l;
  char log[8192];
  log_begin(&l);
  uint64_t t0 = gmb__now_ns();
  int sent = 0, alive = 1;
  for (int i = 0; i < 100000 && alive; i++) {
    int rc = gmb__fd_send(sock, &r, sizeof r, -1, MSG_DONTWAIT);
    if (rc == 0) sent++;
    else if (rc != -EAGAIN) break; /* the broker hung up */
    alive = serve_session(&c, id);
  }
  uint64_t took = gmb__now_ns() - t0;
  log_end(&l, log, sizeof log);
  ck_assert_msg(!alive, "the session lives after %d requests", sent);
  ck_assert_ptr_null(gmb__session_by_id(c.f.b.sessions, id));
  ck_assert_int_gt(sent, GMB_FDCHAN_BATCH);
  ck_assert_ptr_nonnull(strstr(log, "does not read its descriptor channel"));
  ck_assert_uint_eq(t->used, 0);
  ck_assert_uint_lt(took, 2 * SEC);
  /* What did reach the client are whole replies: a descriptor each for
   * as many as a channel may leave unread, then refusals without one.
   * No hang-up yet: the broker keeps its end while they are unread. */
  int got = 0, with_fd = 0;
  for (;;) {
    int fd = -1;
    struct gmb_fd_rep rep;
    ssize_t n = gmb__fd_recv(sock, &rep, sizeof rep, &fd, MSG_DONTWAIT);
    if (n != (ssize_t)sizeof rep) {
      ck_assert(n == -EAGAIN || n == -EWOULDBLOCK);
      break;
    }
    if (got < GMB_FDCHAN_UNREAD_ANSWERS) {
      ck_assert_int_eq(rep.status, 0);
      ck_assert_int_ge(fd, 0);
      close(fd);
      with_fd++;
    } else {
      ck_assert_int_eq(rep.status, GMB_E_LIMIT);
      ck_assert_int_eq(fd, -1);
      ck_assert_ptr_nonnull(strstr(rep.message, "still unread"));
    }
    got++;
  }
  ck_assert_int_eq(with_fd, GMB_FDCHAN_UNREAD_ANSWERS);
  ck_assert_int_gt(got, with_fd);
  ck_assert_int_le(got, sent);
  /* It ended with them unread: the broker kept its end, weighed by what
   * it sent since the channel was last read to the end. */
  ck_assert_uint_eq(c.f.b.fd_kept, 1);
  ck_assert_uint_eq(c.f.b.fd_unread, GMB_FDCHAN_UNREAD_ANSWERS);
  ck_assert_uint_eq(t->fd_kept, 1);
  ck_assert_uint_eq(t->fd_unread, GMB_FDCHAN_UNREAD_ANSWERS);
  ck_assert_int_eq(gmb__fdchan_check(&c.f.b), 0);
  /* All read now: the broker closes its end at its next ticks. */
  ck_assert_uint_eq(sweep_unread(&c), 0);
  ck_assert_int_eq(cli_hung_up(sock), 1);
  close(sock);
  ck_assert_int_eq(gmb__pool_trim(c.f.b.pool) > 0, 1);
  ck_assert_int_eq(fx_count_fds(), c.idle_fds);
  chan_close(&c);
}
END_TEST

/* At most GMB_FDCHAN_BATCH messages of one connection per round: a
 * flooding client cannot hold the loop. */
START_TEST(batch_per_round) {
  struct chan c;
  chan_open(&c);
  struct gmb_session *s;
  int sock = chan_session(&c, "a", "", &s, NULL);
  uint64_t id = s->id;
  enum { N = GMB_FDCHAN_BATCH + 4 };
  for (int i = 0; i < N; i++) {
    struct gmb_fd_req r = req_of(77, id, 0, NULL); /* answered PROTO */
    cli_send(sock, &r, -1);
  }
  ck_assert_int_eq(serve_session(&c, id), 1);
  for (int i = 0; i < GMB_FDCHAN_BATCH; i++) cli_refused(sock, GMB_E_PROTO);
  ck_assert_int_eq(cli_quiet(sock), 1);
  ck_assert_int_eq(serve_session(&c, id), 1);
  for (int i = GMB_FDCHAN_BATCH; i < N; i++) cli_refused(sock, GMB_E_PROTO);
  ck_assert_int_eq(cli_quiet(sock), 1);
  close(sock);
  chan_close(&c);
}
END_TEST

/* --- descriptors --------------------------------------------------------- */

/* A descriptor that comes with a request is closed by the broker, off its
 * loop (the closer thread): the write end of a pipe sent along is the only
 * one left, so the read end sees end-of-file once the broker's copy is
 * closed.  Waits for it (the test's time limit bounds the wait). */
static int fd_sent_is_closed(int rd) {
  struct pollfd p = {.fd = rd, .events = POLLIN};
  char byte;
  for (;;) {
    if (poll(&p, 1, -1) < 0 && errno != EINTR) return 0;
    ssize_t n = read(rd, &byte, 1);
    if (n == 0) return 1;
    if (n > 0 || (errno != EAGAIN && errno != EINTR)) return 0;
  }
}

static int pipe_nb(int p[2]) {
  ck_assert_int_eq(pipe2(p, O_CLOEXEC | O_NONBLOCK), 0);
  return p[1];
}


/* No client ever sends the broker a descriptor: where the kernel can
 * (SO_PASSRIGHTS), the channel refuses them, and a client's sendmsg with
 * one fails with EPERM, before AUTH and after; the connection goes on. */
START_TEST(fds_refused_by_kernel) {
  struct chan c;
  chan_open(&c);
  int probe = cli_connect(&c);
  int p[2];
  struct gmb_fd_req auth = req_of(GMB_FD_AUTH, 1, 0, NULL);
  int rc = gmb__fd_send(probe, &auth, sizeof auth, pipe_nb(p), 0);
  close(probe);
  close(p[0]);
  close(p[1]);
  if (rc == 0) {
    printf("fds_refused_by_kernel: this kernel has no SO_PASSRIGHTS "
           "(before Linux 6.16); fds_sent_to_broker_closed covers it\n");
    chan_close(&c);
    return;
  }
  ck_assert_int_eq(rc, -EPERM);
  accept_all(&c);
  serve_pending(&c);
  struct gmb_session *s;
  int sock = chan_session(&c, "a", "", &s, NULL);
  uint64_t seg = fx_must_alloc(&c.f, "a", geteuid(), MIB, 0).u.alloc.segment;
  struct gmb_fd_req r = req_of(GMB_FD_SEGMENT, s->id, seg, NULL);
  ck_assert_int_eq(gmb__fd_send(sock, &r, sizeof r, pipe_nb(p), 0), -EPERM);
  close(p[0]);
  close(p[1]);
  ck_assert_int_eq(cli_quiet(sock), 1);
  close(must_segment(&c, sock, s, seg, 2 * MIB));
  close(sock);
  chan_close(&c);
}
END_TEST

/* Where descriptors get through, each one that comes with a request is
 * closed off the loop and the connection is dropped: before AUTH without a
 * word, after it the session ends.  Nothing is left open. */
START_TEST(fds_sent_to_broker_closed) {
  struct chan c;
  chan_open(&c);
  chan_rights(&c, 0);
  struct gmb_session *s = fx_hello(&c.f, "a", geteuid(), "");
  uint64_t seg = fx_must_alloc(&c.f, "a", geteuid(), MIB, 0).u.alloc.segment;
  int p[2];

  /* With a refused AUTH, a first message that is not AUTH, a good AUTH:
   * the connection is dropped all the same, the session not proved. */
  struct gmb_fd_req first[3] = {
      req_of(GMB_FD_AUTH, s->id + 1, 0, s->secret),
      req_of(GMB_FD_SEGMENT, s->id, seg, NULL),
      req_of(GMB_FD_AUTH, s->id, 0, s->secret),
  };
  for (int i = 0; i < 3; i++) {
    int sock = cli_connect(&c);
    accept_all(&c);
    cli_send(sock, &first[i], pipe_nb(p));
    close(p[1]);
    serve_pending(&c);
    ck_assert_uint_eq(pending_count(&c), 0);
    ck_assert_msg(cli_hung_up(sock), "case %d not closed", i);
    ck_assert_int_eq(fd_sent_is_closed(p[0]), 1);
    close(p[0]);
    close(sock);
  }
  ck_assert_int_eq(s->fdconn, -1);

  /* From a session: it ends, and its connection is closed. */
  for (int two = 0; two < 2; two++) {
    char rid[8];
    snprintf(rid, sizeof rid, "s%d", two);
    struct gmb_session *t;
    int sock = chan_session(&c, rid, "", &t, NULL);
    uint64_t id = t->id;
    struct gmb_fd_req r = req_of(GMB_FD_SEGMENT, id, seg, NULL);
    int q[2] = {-1, -1};
    if (two) {
      pipe_nb(p);
      pipe_nb(q);
      send_two_fds(sock, &r, sizeof r, p[1], q[1]);
      close(q[1]);
    } else {
      cli_send(sock, &r, pipe_nb(p));
    }
    close(p[1]);
    ck_assert_int_eq(serve_session(&c, id), 0);
    ck_assert_ptr_null(gmb__session_by_id(c.f.b.sessions, id));
    ck_assert_int_eq(cli_hung_up(sock), 1);
    ck_assert_int_eq(fd_sent_is_closed(p[0]), 1);
    close(p[0]);
    if (two) {
      ck_assert_int_eq(fd_sent_is_closed(q[0]), 1);
      close(q[0]);
    }
    close(sock);
  }
  chan_rights(&c, 1);
  chan_close(&c);
}
END_TEST

/* A TCP socket with SO_LINGER set and unsent data toward a peer that never
 * reads: its last close() waits until the data is sent or the linger time
 * is up (an hour here).  Returns it; *hold is the listener that keeps its
 * peer alive (close it to end the wait). */
static int lingering_socket(int *hold) {
  int l = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ck_assert_int_ge(l, 0);
  struct sockaddr_in a = {.sin_family = AF_INET,
                          .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t al = sizeof a;
  ck_assert_int_eq(bind(l, (struct sockaddr *)&a, sizeof a), 0);
  ck_assert_int_eq(listen(l, 1), 0);
  ck_assert_int_eq(getsockname(l, (struct sockaddr *)&a, &al), 0);
  int t = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ck_assert_int_ge(t, 0);
  int small = 4096;
  setsockopt(t, SOL_SOCKET, SO_SNDBUF, &small, sizeof small);
  ck_assert_int_eq(connect(t, (struct sockaddr *)&a, sizeof a), 0);
  /* The peer is never accepted: its receive window fills, then ours. */
  ck_assert_int_eq(fcntl(t, F_SETFL, O_NONBLOCK), 0);
  static char junk[65536];
  size_t sent = 0;
  for (;;) {
    ssize_t n = send(t, junk, sizeof junk, MSG_NOSIGNAL);
    if (n > 0) {
      sent += (size_t)n;
      continue;
    }
    if (errno == EINTR) continue;
    ck_assert_int_eq(errno, EAGAIN);
    struct pollfd pw = {.fd = t, .events = POLLOUT};
    if (poll(&pw, 1, 200) == 0) break; /* stays full: the peer reads no more */
  }
  ck_assert_uint_gt(sent, 0);
  struct linger lg = {.l_onoff = 1, .l_linger = 3600};
  ck_assert_int_eq(setsockopt(t, SOL_SOCKET, SO_LINGER, &lg, sizeof lg), 0);
  *hold = l;
  return t;
}

/* The attack: a message carrying a socket whose close blocks.  Closed on
 * the loop, it stopped the broker for as long as the sender chose; now it
 * is closed on the closer thread and the loop goes on at once, before
 * AUTH and from a session.  (Where the kernel refuses descriptors,
 * fds_refused_by_kernel: the message cannot even be sent.) */
START_TEST(fd_with_linger_closed_off_loop) {
  struct chan c;
  chan_open(&c);
  chan_rights(&c, 0);
  uint64_t queued0, closed0, kept0;
  gmb__fd_discard_stats(&queued0, &closed0, &kept0);
  int hold[2];
  int t = lingering_socket(&hold[0]);
  int sock = cli_connect(&c);
  accept_all(&c);
  struct gmb_fd_req auth = req_of(GMB_FD_AUTH, 1, 0, NULL);
  cli_send(sock, &auth, t);
  close(t); /* the broker's copy is the last */
  serve_pending(&c); /* before: blocked here for an hour */
  ck_assert_uint_eq(pending_count(&c), 0);
  ck_assert_int_eq(cli_hung_up(sock), 1);
  close(sock);

  struct gmb_session *s;
  sock = chan_session(&c, "a", "", &s, NULL);
  uint64_t id = s->id;
  t = lingering_socket(&hold[1]);
  struct gmb_fd_req r = req_of(GMB_FD_SEGMENT, id, 1, NULL);
  cli_send(sock, &r, t);
  close(t);
  ck_assert_int_eq(serve_session(&c, id), 0); /* ended, not stuck */
  ck_assert_int_eq(cli_hung_up(sock), 1);
  close(sock);
  /* Both went to the closer, none kept open. */
  uint64_t queued, closed, kept;
  gmb__fd_discard_stats(&queued, &closed, &kept);
  ck_assert_uint_eq(kept, kept0);
  ck_assert_uint_ge(queued + closed, queued0 + closed0 + 1);
  /* And the broker serves the next client. */
  struct gmb_session *n;
  int next = chan_session(&c, "b", "", &n, NULL);
  ck_assert_int_ge(n->fdconn, 0);
  close(next);
  close(hold[0]); /* their peers go: the closer's waits end */
  close(hold[1]);
  chan_rights(&c, 1);
  chan_close(&c);
}
END_TEST

/* Sessions come, take descriptors and go, in every way a session ends;
 * afterwards the broker holds exactly the descriptors it held idle. */
START_TEST(fd_count_back_to_idle) {
  struct chan c;
  chan_open(&c);
  int shm_before = fx_shm_names();
  uid_t me = geteuid();
  struct gmb_session *s[4];
  int sock[4];
  static const char *const rids[4] = {"close", "bye", "end", "garbage"};
  for (int i = 0; i < 4; i++) {
    int lt_fd;
    sock[i] = chan_session(&c, rids[i], i % 2 ? "t2" : "t1", &s[i], &lt_fd);
    /* A client maps its table and keeps the mapping, not the fd. */
    struct gmb__lt_header *h = fx_map_fd(lt_fd, gmb__locktab_bytes(s[i]->lt));
    close(lt_fd);
    fx_unmap_locktab(h);
    uint64_t small =
        fx_must_alloc(&c.f, rids[i], me, MIB, GMB_MOVABLE).u.alloc.segment;
    uint64_t large = fx_must_alloc(&c.f, rids[i], me, 6 * MIB, 0).u.alloc.segment;
    close(must_segment(&c, sock[i], s[i], small, 2 * MIB));
    int fd = must_segment(&c, sock[i], s[i], large, 6 * MIB);
    void *m = fx_map_fd(fd, 6 * MIB);
    close(fd);
    munmap(m, 6 * MIB);
  }
  /* A connection that never authenticates, expired. */
  int idle_conn = cli_connect(&c);
  accept_at(&c, 1);
  ck_assert_uint_gt(fx_count_fds(), c.idle_fds);
  ck_assert_int_eq(fx_shm_names(), shm_before);
  /* The client closes; Bye; the broker ends it; garbage. */
  uint64_t ids[4];
  for (int i = 0; i < 4; i++) ids[i] = s[i]->id;
  close(sock[0]);
  ck_assert_int_eq(serve_session(&c, ids[0]), 0);
  struct wire_reply rep;
  ck_assert_int_eq(fx_plain(&c.f, "bye", me, WIRE_BYE, &rep), 1);
  ck_assert_int_eq(rep.status, 0);
  fx_end(&c.f, s[2]);
  ck_assert_int_eq(gmb__fd_send(sock[3], "x", 1, -1, 0), 0);
  ck_assert_int_eq(serve_session(&c, ids[3]), 0);
  for (int i = 1; i < 4; i++) {
    ck_assert_int_eq(cli_hung_up(sock[i]), 1);
    close(sock[i]);
  }
  ck_assert_uint_eq(gmb__fdchan_expire(&c.f.b, gmb__now_ns()), UINT64_MAX);
  ck_assert_int_eq(cli_hung_up(idle_conn), 1);
  close(idle_conn);
  ck_assert_uint_eq(gmb__sessions_count(c.f.b.sessions), 0);
  /* Each tenant's last small segment lingers until trimmed (pool.h). */
  gmb__pool_trim(c.f.b.pool);
  ck_assert_uint_eq(c.f.b.dev->segments, 0);
  ck_assert_int_eq(fx_count_fds(), c.idle_fds);
  chan_close(&c);
}
END_TEST

/* A first message shorter than 8 bytes (magic and op) is refused with an
 * op that is only what the peer sent (0 when it sent none), never bytes of
 * the broker's stack: primed here with a value another connection sent
 * just before, which a reused stack slot would echo. */
START_TEST(short_first_message_echoes_nothing) {
  struct chan c;
  chan_open(&c);
  for (size_t len = 1; len < 8; len++) {
    int a = cli_connect(&c);
    int b = cli_connect(&c);
    accept_all(&c);
    struct pend p = {.n = 0};
    gmb__fdchan_each_pending(&c.f.b, pend_collect, &p);
    ck_assert_uint_eq(p.n, 2);
    /* a leaves 0xdeadbeef where the broker keeps a request's op... */
    struct gmb_fd_req r = req_of(0xdeadbeef, 1, 2, NULL);
    r.magic = 0;
    cli_send(a, &r, -1);
    gmb__fdchan_pending_ready(&c.f.b, p.conn[0]);
    cli_refused(a, GMB_E_PROTO);
    /* ...and b sends fewer bytes than reach the op. */
    uint8_t bytes[8];
    uint32_t magic = GMB_FD_MAGIC;
    memset(bytes, 0, sizeof bytes);
    memcpy(bytes, &magic, sizeof magic);
    ck_assert_int_eq(gmb__fd_send(b, bytes, len, -1, 0), 0);
    gmb__fdchan_pending_ready(&c.f.b, p.conn[1]);
    struct gmb_fd_rep rep = cli_refused(b, GMB_E_PROTO);
    uint32_t sent_op = 0;
    if (len > 4) memcpy(&sent_op, bytes + 4, len - 4);
    ck_assert_msg(rep.op == sent_op, "%zu bytes sent: reply op 0x%x",
                  len, (unsigned)rep.op);
    close(a);
    close(b);
  }
  chan_close(&c);
}
END_TEST

/* --- descriptors in flight -------------------------------------------- */

/* The kernel counts the descriptors a user has sent and no one has
 * received yet, and past its RLIMIT_NOFILE refuses that user's next
 * SCM_RIGHTS with ETOOMANYREFS, unless it holds CAP_SYS_RESOURCE or
 * CAP_SYS_ADMIN (the shipped units run the broker as gmb with none).
 * Sets this process's effective capabilities to none (restore: 1, the
 * permitted set back); 0, or -1 when it cannot. */
struct caps {
  struct __user_cap_header_struct h;
  struct __user_cap_data_struct d[2];
};

static int caps_effective(struct caps *saved, int restore) {
  if (!restore) {
    saved->h.version = _LINUX_CAPABILITY_VERSION_3;
    saved->h.pid = 0;
    if (syscall(SYS_capget, &saved->h, saved->d) != 0) return -1;
  }
  struct caps c = *saved;
  for (int i = 0; i < 2; i++) c.d[i].effective = restore ? saved->d[i].effective : 0;
  return syscall(SYS_capset, &c.h, c.d) == 0 ? 0 : -1;
}

/* Sends descriptors on a pair nobody reads until the kernel refuses the
 * next one; the pair's reading end (its queue holds them), or -1. */
static int park_until_refused(void) {
  int sv[2];
  ck_assert_int_eq(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv),
                   0);
  char byte = 0;
  int rc = 0;
  for (int i = 0; i < 10000 && rc == 0; i++)
    rc = gmb__fd_send(sv[0], &byte, 1, sv[0], MSG_DONTWAIT);
  close(sv[0]);
  if (rc == -ETOOMANYREFS) return sv[1];
  close(sv[1]);
  return -1;
}

/*
 * A local user who leaves the descriptors it asked for unread (its lock
 * table's, a segment's), and ends its sessions, parks them in flight on
 * the broker's account; past the broker's RLIMIT_NOFILE every descriptor
 * the broker sends fails with ETOOMANYREFS.  That ended every other
 * tenant's session that asked for a segment then, freeing its memory, and
 * told a new client only that the channel closed.  Now the asker is
 * refused with GMB_E_LIMIT and a reason, its session lives, and once the
 * descriptors are read or closed it is served again.
 */
START_TEST(inflight_exhausted_spares_sessions) {
  struct chan c;
  chan_open(&c);
  struct gmb_session *s;
  int sock = chan_session(&c, "a", "", &s, NULL);
  uint64_t id = s->id;
  uint64_t seg = fx_must_alloc(&c.f, "a", geteuid(), MIB, 0).u.alloc.segment;
  struct gmb_session *s2 = fx_hello(&c.f, "b", geteuid(), "");
  int sock2 = cli_connect(&c);
  accept_all(&c);
  /* The limit the kernel compares with: a little above what is open. */
  struct rlimit old, low;
  ck_assert_int_eq(getrlimit(RLIMIT_NOFILE, &old), 0);
  low = old;
  low.rlim_cur = (rlim_t)fx_count_fds() + 32;
  ck_assert_int_eq(setrlimit(RLIMIT_NOFILE, &low), 0);
  struct caps caps;
  int dropped = caps_effective(&caps, 0) == 0;
  int parked = park_until_refused();
  if (parked < 0) {
    printf("inflight_exhausted_spares_sessions: the kernel did not refuse "
           "descriptors in flight past RLIMIT_NOFILE; skipped\n");
  } else {
    cli_segment(sock, id, seg);
    ck_assert_int_eq(serve_session(&c, id), 1);
    struct gmb_fd_rep rep = cli_refused(sock, GMB_E_LIMIT);
    ck_assert_ptr_nonnull(strstr(rep.message, "in flight"));
    ck_assert_int_eq(recorded(s, seg), 0); /* never given */
    cli_auth(sock2, s2);
    serve_pending(&c);
    cli_refused(sock2, GMB_E_LIMIT);
    ck_assert_int_eq(cli_hung_up(sock2), 1);
    ck_assert_int_eq(s2->fdconn, -1);
    close(parked); /* what was in flight is released */
    close(must_segment(&c, sock, s, seg, 2 * MIB));
    ck_assert_int_eq(recorded(s, seg), 1);
  }
  if (dropped) ck_assert_int_eq(caps_effective(&caps, 1), 0);
  ck_assert_int_eq(setrlimit(RLIMIT_NOFILE, &old), 0);
  close(sock2);
  close(sock);
  chan_close(&c);
}
END_TEST

/* --- descriptors left unread ---------------------------------------------- */

/* Hello of client `rid` as this process's uid in `tenant`: its status,
 * the reason in *why. */
static int try_hello(struct chan *c, const char *rid, const char *tenant,
                     char *why, size_t cap) {
  struct wire_reply rep;
  ck_assert_int_eq(fx_hello_as(&c->f, rid, geteuid(), tenant,
                               WIRE_PROTOCOL_VERSION, &rep), 1);
  snprintf(why, cap, "%s", rep.message);
  return rep.status;
}

/* Hello, AUTH, and the lock table left unread: a session of this
 * process's uid in `tenant` whose channel holds one descriptor; its
 * socket is returned. */
static int open_unread(struct chan *c, const char *rid, const char *tenant,
                       struct gmb_session **out) {
  struct gmb_session *s = fx_hello(&c->f, rid, geteuid(), tenant);
  int sock = cli_connect(c);
  accept_all(c);
  cli_auth(sock, s);
  serve_pending(c);
  ck_assert_int_ge(s->fdconn, 0); /* served: the table waits unread */
  ck_assert_uint_eq(s->fd_sent, 1);
  if (out) *out = s;
  return sock;
}

/* A hostile client's round: Hello in `tenant`, AUTH, never read the lock
 * table, Bye; its socket stays open and is returned. */
static int leave_unread(struct chan *c, const char *rid, const char *tenant) {
  int sock = open_unread(c, rid, tenant, NULL);
  struct wire_reply rep;
  ck_assert_int_eq(fx_plain(&c->f, rid, geteuid(), WIRE_BYE, &rep), 1);
  ck_assert_int_eq(rep.status, 0);
  ck_assert_ptr_null(gmb__session_find(c->f.b.sessions, (const uint8_t *)rid,
                                       strlen(rid)));
  return sock;
}

/* The channels kept for ended sessions; *descs: what every channel holds
 * unread (kept and live). */
static size_t unread_channels(struct chan *c, uint64_t *descs) {
  ck_assert_int_eq(gmb__fdchan_check(&c->f.b), 0);
  if (descs) *descs = c->f.b.fd_unread;
  return c->f.b.fd_kept;
}

/* Session s asks for segment `seg` n times and the broker reads them all;
 * the answers wait unread.  The session lives. */
static void ask_segments(struct chan *c, int sock, struct gmb_session *s,
                         uint64_t seg, int n) {
  for (int i = 0; i < n; i++) cli_segment(sock, s->id, seg);
  for (int i = 0; i <= n / GMB_FDCHAN_BATCH; i++)
    ck_assert_int_eq(serve_session(c, s->id), 1);
}

/* Reads every answer waiting on sock: *given those with a descriptor
 * (closed), *refused the GMB_E_LIMIT ones (the last reason in why). */
static void read_answers(int sock, int *given, int *refused, char *why,
                         size_t cap) {
  *given = *refused = 0;
  for (;;) {
    int fd = -1;
    struct gmb_fd_rep rep;
    ssize_t n = gmb__fd_recv(sock, &rep, sizeof rep, &fd, MSG_DONTWAIT);
    if (n != (ssize_t)sizeof rep) {
      ck_assert(n == -EAGAIN || n == -EWOULDBLOCK);
      return;
    }
    if (rep.status == 0) {
      ck_assert_int_ge(fd, 0);
      close(fd);
      ++*given;
    } else {
      ck_assert_int_eq(rep.status, GMB_E_LIMIT);
      ck_assert_int_eq(fd, -1);
      snprintf(why, cap, "%s", rep.message);
      ++*refused;
    }
  }
}

/* RLIMIT_NOFILE 2,048 at the channel's start: a uid 128, a tenant 64. */
#define LOW_NOFILE 2048

/*
 * Live sessions of one tenant together hold at most its bound: each may
 * hold GMB_FDCHAN_UNREAD_ANSWERS, but while one holds 40 another gets
 * only what is left of the tenant's 64, the rest refused with the reason,
 * and both live.  Before it refuses, the broker looks again at the
 * tenant's channels: once the first read its answers, the second is
 * served again.  The refusals are counted for the session, the tenant
 * and the broker, as status shows them.
 */
START_TEST(live_unread_bound_per_tenant) {
  struct chan c;
  chan_nofile = LOW_NOFILE;
  chan_open(&c);
  chan_nofile = 0;
  uint32_t per_uid, per_tenant;
  gmb__fdchan_unread_bounds(&c.f.b, &per_uid, &per_tenant);
  ck_assert_uint_eq(per_uid, LOW_NOFILE / GMB_FDCHAN_UNREAD_NOFILE_SHARE);
  ck_assert_uint_eq(per_tenant, GMB_FDCHAN_UNREAD_ANSWERS);
  struct gmb_session *a, *b;
  int sa = chan_session(&c, "a", "t", &a, NULL);
  int sb = chan_session(&c, "b", "t", &b, NULL);
  struct gmb_tenant *t = a->tenant;
  uint64_t seg = fx_must_alloc(&c.f, "a", geteuid(), MIB, 0).u.alloc.segment;
  ask_segments(&c, sa, a, seg, 40);
  ck_assert_uint_eq(a->fd_sent, 40);
  ask_segments(&c, sb, b, seg, 40);
  ck_assert_uint_eq(b->fd_sent, 24);
  ck_assert_uint_eq(t->fd_unread, 64);
  ck_assert_uint_eq(c.f.b.fd_unread, 64);
  ck_assert_uint_eq(b->fd_refused, 16);
  ck_assert_uint_eq(a->fd_refused, 0);
  ck_assert_uint_eq(t->fd_refused, 16);
  ck_assert_uint_eq(c.f.b.fd_refused, 16);
  int given, refused;
  char why[GMB_FD_MESSAGE_MAX];
  read_answers(sb, &given, &refused, why, sizeof why);
  ck_assert_int_eq(given, 24);
  ck_assert_int_eq(refused, 16);
  ck_assert_ptr_nonnull(strstr(why, "tenant t's channels hold 64 "
                                    "descriptors unread"));
  /* The status shows it, per session and tenant and in all. */
  struct wire_reply st;
  memset(&st, 0, sizeof st);
  gmb__observe_status(&c.f.b, &st);
  ck_assert_uint_eq(st.u.admin_status.fd_unread, 64);
  ck_assert_uint_eq(st.u.admin_status.fd_kept, 0);
  ck_assert_uint_eq(st.u.admin_status.fd_refused, 16);
  int rows = 0;
  for (size_t i = 0; i < st.u.admin_status.n_tenants; i++)
    if (strcmp(st.u.admin_status.tenants[i].name, "t") == 0) {
      ck_assert_uint_eq(st.u.admin_status.tenants[i].fd_unread, 64);
      ck_assert_uint_eq(st.u.admin_status.tenants[i].fd_refused, 16);
      rows++;
    }
  for (size_t i = 0; i < st.u.admin_status.n_sessions; i++) {
    const struct wire_session_row *r = &st.u.admin_status.session_rows[i];
    ck_assert_uint_eq(r->fd_unread, r->id == a->id ? 40 : 24);
    ck_assert_uint_eq(r->fd_refused, r->id == a->id ? 0 : 16);
    rows++;
  }
  ck_assert_int_eq(rows, 3);
  gmb__wire_reply_clear(&st);
  /* b read its answers, a did not: b gets what a leaves of the bound
   * again, no more. */
  ask_segments(&c, sb, b, seg, 25);
  ck_assert_uint_eq(b->fd_sent, 24);
  ck_assert_uint_eq(b->fd_refused, 17);
  /* a reads its 40; b, its 24 unread, asks again: the broker finds a's
   * read before it would refuse, and serves b. */
  read_answers(sa, &given, &refused, why, sizeof why);
  ck_assert_int_eq(given, 40);
  ck_assert_uint_eq(t->fd_unread, 64); /* not seen yet */
  ask_segments(&c, sb, b, seg, 1);
  ck_assert_uint_eq(b->fd_sent, 25);
  ck_assert_uint_eq(b->fd_refused, 17);
  ck_assert_uint_eq(t->fd_unread, 25);
  read_answers(sb, &given, &refused, why, sizeof why);
  ck_assert_int_eq(given, 25);
  ck_assert_int_eq(refused, 1);
  /* Another tenant of the same uid was never held by t's bound. */
  struct gmb_session *o;
  int so = chan_session(&c, "o", "other", &o, NULL);
  ask_segments(&c, so, o, fx_must_alloc(&c.f, "o", geteuid(), MIB, 0)
                              .u.alloc.segment,
               GMB_FDCHAN_UNREAD_ANSWERS);
  ck_assert_uint_eq(o->fd_sent, GMB_FDCHAN_UNREAD_ANSWERS);
  ck_assert_uint_eq(o->fd_refused, 0);
  read_answers(so, &given, &refused, why, sizeof why);
  ck_assert_int_eq(given, GMB_FDCHAN_UNREAD_ANSWERS);
  /* Read to the end: the sweep forgets them, and nothing is kept. */
  sweep_unread(&c);
  ck_assert_uint_eq(c.f.b.fd_unread, 0);
  fx_end(&c.f, o);
  fx_end(&c.f, b);
  fx_end(&c.f, a);
  ck_assert_uint_eq(unread_channels(&c, NULL), 0);
  close(so);
  close(sb);
  close(sa);
  chan_close(&c);
}
END_TEST

/*
 * Descriptors are counted as they are sent, so a burst of sessions that
 * all prove their channel before any of them ends cannot pass a bound
 * together: the lock table of the session past its tenant's bound is
 * refused, and so is one past its uid's (another tenant of the uid), and
 * Hellos too.  When they all end, their channels are kept and counted as
 * before (never closed to make room); once their clients close the
 * sockets, the uid is served again.
 */
START_TEST(auth_burst_counted_at_send) {
  struct chan c;
  chan_nofile = LOW_NOFILE;
  chan_open(&c);
  chan_nofile = 0;
  uint32_t per_uid, per_tenant;
  gmb__fdchan_unread_bounds(&c.f.b, &per_uid, &per_tenant);
  ck_assert_uint_eq(per_uid, 2 * per_tenant);
  enum { N = 2 * GMB_FDCHAN_UNREAD_ANSWERS };
  ck_assert_uint_eq(per_uid, N);
  /* Sessions that said Hello before the bounds were met. */
  struct gmb_session *late = fx_hello(&c.f, "late", geteuid(), "t1");
  struct gmb_session *late3 = fx_hello(&c.f, "late3", geteuid(), "t3");
  struct gmb_session *s[N];
  int sock[N];
  char rid[32], why[WIRE_MESSAGE_MAX];
  for (int i = 0; i < N; i++) {
    snprintf(rid, sizeof rid, "s%d", i);
    sock[i] = open_unread(&c, rid, i < N / 2 ? "t1" : "t2", &s[i]);
    if (i == N / 2 - 1) {
      /* t1 at its bound: its Hello and its late AUTH are refused. */
      ck_assert_int_eq(try_hello(&c, "next", "t1", why, sizeof why),
                       GMB_E_LIMIT);
      ck_assert_ptr_nonnull(strstr(why, "tenant t1's channels hold"));
      int l = cli_connect(&c);
      accept_all(&c);
      cli_auth(l, late);
      serve_pending(&c);
      struct gmb_fd_rep rep = cli_refused(l, GMB_E_LIMIT);
      ck_assert_ptr_nonnull(strstr(rep.message, "unread"));
      ck_assert_int_eq(cli_hung_up(l), 1);
      ck_assert_int_eq(late->fdconn, -1);
      close(l);
    }
  }
  struct gmb_tenant *t1 = s[0]->tenant, *t2 = s[N - 1]->tenant;
  ck_assert_uint_eq(t1->fd_unread, per_tenant);
  ck_assert_uint_eq(t2->fd_unread, per_tenant);
  ck_assert_uint_eq(gmb__fdchan_unread_of_uid(&c.f.b, geteuid(), NULL), N);
  /* The uid at its bound: a third tenant's late AUTH and Hello. */
  int l = cli_connect(&c);
  accept_all(&c);
  cli_auth(l, late3);
  serve_pending(&c);
  struct gmb_fd_rep rep = cli_refused(l, GMB_E_LIMIT);
  ck_assert_ptr_nonnull(strstr(rep.message, "'s channels hold 128"));
  ck_assert_ptr_nonnull(strstr(rep.message, "uid "));
  close(l);
  ck_assert_int_eq(try_hello(&c, "next3", "t3", why, sizeof why),
                   GMB_E_LIMIT);
  ck_assert_ptr_nonnull(strstr(why, "uid "));
  /* They all end: every channel kept and counted, none closed. */
  for (int i = 0; i < N; i++) fx_end(&c.f, s[i]);
  uint64_t descs;
  ck_assert_uint_eq(unread_channels(&c, &descs), N);
  ck_assert_uint_eq(descs, N);
  ck_assert_uint_eq(t1->fd_kept, N / 2);
  uint32_t kept;
  ck_assert_uint_eq(gmb__fdchan_unread_of_uid(&c.f.b, geteuid(), &kept), N);
  ck_assert_uint_eq(kept, N);
  ck_assert_uint_eq(sweep_unread(&c), N);
  ck_assert_int_eq(try_hello(&c, "next3", "t3", why, sizeof why),
                   GMB_E_LIMIT);
  /* t1's clients close their sockets: the uid has room again. */
  for (int i = 0; i < N / 2; i++) close(sock[i]);
  ck_assert_uint_eq(sweep_unread(&c), N / 2);
  ck_assert_uint_eq(t1->fd_kept, 0);
  ck_assert_uint_eq(c.f.b.fd_unread, N / 2);
  struct gmb_session *n3;
  int s3 = chan_session(&c, "n3", "t3", &n3, NULL);
  for (int i = N / 2; i < N; i++) close(sock[i]);
  ck_assert_uint_eq(sweep_unread(&c), 0);
  fx_end(&c.f, n3);
  fx_end(&c.f, late3);
  fx_end(&c.f, late);
  ck_assert_uint_eq(unread_channels(&c, NULL), 0);
  close(s3);
  ck_assert_int_eq(fx_count_fds(), c.idle_fds);
  chan_close(&c);
}
END_TEST

/*
 * A client that leaves its lock table unread and ends, keeping its end of
 * the channel open, leaves that descriptor in flight on the broker's
 * account.  Its tenant may do so a bounded number of times: then its next
 * Hello is refused with the reason, and so is the AUTH of a session that
 * said Hello before; another tenant is served, sessions and segments.
 * Once the hostile sockets close, the broker closes its ends at its next
 * ticks and the tenant is served again.  A session that read everything
 * leaves nothing behind.
 */
START_TEST(unread_channels_bound_tenant) {
  struct chan c;
  chan_nofile = LOW_NOFILE;
  chan_open(&c);
  chan_nofile = 0;
  uint32_t per_uid, per_tenant;
  gmb__fdchan_unread_bounds(&c.f.b, &per_uid, &per_tenant);
  ck_assert_uint_gt(per_tenant, 0);
  ck_assert_uint_le(per_tenant, GMB_FDCHAN_UNREAD_PER_TENANT);
  ck_assert_uint_lt(per_tenant, per_uid); /* the other tenant is not held */
  /* A session of the tenant that said Hello before its bound was met. */
  struct gmb_session *late = fx_hello(&c.f, "late", geteuid(), "bad");
  int hostile[GMB_FDCHAN_UNREAD_PER_TENANT];
  char rid[32], why[WIRE_MESSAGE_MAX];
  for (uint32_t i = 0; i < per_tenant; i++) {
    snprintf(rid, sizeof rid, "bad%u", i);
    ck_assert_int_eq(try_hello(&c, "probe", "bad", why, sizeof why), 0);
    struct wire_reply rep;
    ck_assert_int_eq(fx_plain(&c.f, "probe", geteuid(), WIRE_BYE, &rep), 1);
    hostile[i] = leave_unread(&c, rid, "bad");
  }
  uint64_t descs;
  ck_assert_uint_eq(unread_channels(&c, &descs), per_tenant);
  ck_assert_uint_eq(descs, per_tenant); /* a lock table each */
  ck_assert_int_eq(try_hello(&c, "next", "bad", why, sizeof why),
                   GMB_E_LIMIT);
  ck_assert_ptr_nonnull(strstr(why, "unread"));
  ck_assert_ptr_nonnull(strstr(why, "close ended sessions' sockets"));
  ck_assert_ptr_null(gmb__session_find(c.f.b.sessions,
                                       (const uint8_t *)"next", 4));
  int lsock = cli_connect(&c);
  accept_all(&c);
  cli_auth(lsock, late);
  serve_pending(&c);
  struct gmb_fd_rep rep = cli_refused(lsock, GMB_E_LIMIT);
  ck_assert_ptr_nonnull(strstr(rep.message, "unread"));
  ck_assert_int_eq(cli_hung_up(lsock), 1);
  ck_assert_int_eq(late->fdconn, -1);
  close(lsock);
  /* Another tenant of the same uid: a session, a segment. */
  struct gmb_session *g;
  int gsock = chan_session(&c, "good", "good", &g, NULL);
  uint64_t seg = fx_must_alloc(&c.f, "good", geteuid(), MIB, 0)
                     .u.alloc.segment;
  close(must_segment(&c, gsock, g, seg, 2 * MIB));
  /* The ticks keep what is still unread. */
  ck_assert_uint_eq(sweep_unread(&c), per_tenant);
  /* The hostile sockets close: the broker's ends follow, a tick later. */
  for (uint32_t i = 0; i < per_tenant; i++) close(hostile[i]);
  ck_assert_uint_eq(sweep_unread(&c), 0);
  ck_assert_int_eq(try_hello(&c, "next", "bad", why, sizeof why), 0);
  struct gmb_session *again;
  int asock = chan_session(&c, "again", "bad", &again, NULL);
  /* Sessions that read everything leave nothing behind. */
  fx_end(&c.f, again);
  fx_end(&c.f, g);
  ck_assert_uint_eq(unread_channels(&c, NULL), 0);
  close(asock);
  close(gsock);
  chan_close(&c);
}
END_TEST

/*
 * Channels kept for ended sessions are never closed to make room: what
 * they hold stays counted until their clients read it or close their
 * ends.  Each holds a session's place instead, so that the broker's
 * descriptors they take stay within max_sessions_per_uid (and
 * max_sessions): past it a Hello is refused with the reason.  Under a low
 * RLIMIT_NOFILE the bounds are lower, never below one live channel's.
 */
START_TEST(kept_channels_hold_places) {
  struct chan c;
  chan_nofile = 512;
  chan_open_ini(&c, "host:64MiB", "[broker]\nmax_sessions_per_uid = 24\n");
  chan_nofile = 0;
  uint32_t per_uid, per_tenant;
  gmb__fdchan_unread_bounds(&c.f.b, &per_uid, &per_tenant);
  ck_assert_uint_eq(per_uid, GMB_FDCHAN_UNREAD_ANSWERS);
  ck_assert_uint_eq(per_tenant, GMB_FDCHAN_UNREAD_ANSWERS);
  enum { N = 20, PLACES = 24 };
  struct gmb_session *s[N];
  int sock[N];
  char rid[16], why[WIRE_MESSAGE_MAX];
  for (int i = 0; i < N; i++) {
    snprintf(rid, sizeof rid, "s%d", i);
    sock[i] = open_unread(&c, rid, i % 2 ? "t1" : "t2", &s[i]);
  }
  for (int i = 0; i < N; i++) fx_end(&c.f, s[i]);
  uint64_t descs;
  ck_assert_uint_eq(unread_channels(&c, &descs), N);
  ck_assert_uint_eq(descs, N);
  ck_assert_uint_eq(sweep_unread(&c), N);
  /* Their places: the uid opens the rest, and no more. */
  for (int i = 0; i < PLACES - N; i++) {
    snprintf(rid, sizeof rid, "p%d", i);
    ck_assert_int_eq(try_hello(&c, rid, "t1", why, sizeof why), 0);
  }
  ck_assert_int_eq(try_hello(&c, "over", "t1", why, sizeof why),
                   GMB_E_LIMIT);
  ck_assert_ptr_nonnull(strstr(why, "20 channels of ended sessions"));
  ck_assert_ptr_nonnull(strstr(why, "max_sessions_per_uid"));
  /* None was closed: every client reads its table, and no hang-up. */
  for (int i = 0; i < N; i++) {
    int fd = -1;
    struct gmb_fd_rep rep = cli_reply(sock[i], &fd);
    ck_assert_int_eq(rep.status, 0);
    ck_assert_int_ge(fd, 0);
    close(fd);
    ck_assert_int_eq(cli_quiet(sock[i]), 1);
  }
  /* Read to the end: the broker's ends go at its next ticks, and with
   * them the places. */
  ck_assert_uint_eq(sweep_unread(&c), 0);
  ck_assert_uint_eq(c.f.b.fd_unread, 0);
  for (int i = 0; i < N; i++) ck_assert_int_eq(cli_hung_up(sock[i]), 1);
  ck_assert_int_eq(try_hello(&c, "over", "t1", why, sizeof why), 0);
  for (int i = 0; i < N; i++) close(sock[i]);
  chan_close(&c);
}
END_TEST

/*
 * A live session may leave at most GMB_FDCHAN_UNREAD_ANSWERS descriptors
 * unread (libgmb asks for that many before it reads): its next request is
 * refused with GMB_E_LIMIT and the reason, the segment is not recorded as
 * given, and the session lives; once it read them it is served again.
 */
START_TEST(live_unread_refused_session_lives) {
  struct chan c;
  chan_open(&c);
  struct gmb_session *s;
  int lt_fd = -1;
  /* Its lock table is read here; a second session leaves its own unread
   * and may then take one descriptor less. */
  int sock = chan_session(&c, "a", "", &s, &lt_fd);
  close(lt_fd);
  uint64_t id = s->id;
  uint64_t seg = fx_must_alloc(&c.f, "a", geteuid(), MIB, 0).u.alloc.segment;
  ck_assert_int_eq(gmb__session_seg_forget(s, seg), 0);
  for (int i = 0; i <= GMB_FDCHAN_UNREAD_ANSWERS; i++) cli_segment(sock, id, seg);
  for (int i = 0; i <= GMB_FDCHAN_UNREAD_ANSWERS / GMB_FDCHAN_BATCH; i++)
    ck_assert_int_eq(serve_session(&c, id), 1);
  for (int i = 0; i < GMB_FDCHAN_UNREAD_ANSWERS; i++) {
    int fd = -1;
    struct gmb_fd_rep rep = cli_reply(sock, &fd);
    ck_assert_int_eq(rep.status, 0);
    ck_assert_int_ge(fd, 0);
    close(fd);
  }
  struct gmb_fd_rep rep = cli_refused(sock, GMB_E_LIMIT);
  ck_assert_ptr_nonnull(strstr(rep.message, "still unread"));
  ck_assert_int_eq(cli_quiet(sock), 1);
  ck_assert_int_eq(recorded(s, seg), 1); /* the ones given */
  /* Read now: served again. */
  close(must_segment(&c, sock, s, seg, 2 * MIB));
  /* Its lock table unread: one descriptor less before the refusal. */
  struct gmb_session *s2 = fx_hello(&c.f, "b", geteuid(), "");
  int sock2 = cli_connect(&c);
  accept_all(&c);
  cli_auth(sock2, s2);
  serve_pending(&c);
  for (int i = 0; i < GMB_FDCHAN_UNREAD_ANSWERS; i++)
    cli_segment(sock2, s2->id, seg);
  for (int i = 0; i <= GMB_FDCHAN_UNREAD_ANSWERS / GMB_FDCHAN_BATCH; i++)
    ck_assert_int_eq(serve_session(&c, s2->id), 1);
  for (int i = 0; i < GMB_FDCHAN_UNREAD_ANSWERS; i++) {
    int fd = -1;
    rep = cli_reply(sock2, &fd);
    ck_assert_int_eq(rep.status, 0);
    ck_assert_int_ge(fd, 0);
    close(fd);
  }
  cli_refused(sock2, GMB_E_LIMIT);
  ck_assert_int_eq(cli_quiet(sock2), 1);
  /* Both read to the end: neither leaves a channel behind. */
  fx_end(&c.f, s2);
  fx_end(&c.f, s);
  ck_assert_uint_eq(unread_channels(&c, NULL), 0);
  ck_assert_int_eq(cli_hung_up(sock), 1);
  close(sock2);
  close(sock);
  chan_close(&c);
}
END_TEST

/*
 * What the tenant's bound is for: as many sessions of one tenant as it
 * holds full batches (eight at the shipped bound) may each have asked for
 * a whole batch of pages and read none of it, at the same moment, and all
 * are served; only then is the tenant at its bound.  Once they read their
 * answers the next session of the tenant is served.
 */
START_TEST(tenant_sessions_full_batches_served) {
  struct chan c;
  chan_open(&c);
  uint32_t per_uid, per_tenant;
  gmb__fdchan_unread_bounds(&c.f.b, &per_uid, &per_tenant);
  ck_assert_uint_ge(per_tenant, GMB_FDCHAN_UNREAD_ANSWERS);
  enum { MAXN = GMB_FDCHAN_UNREAD_PER_TENANT / GMB_FDCHAN_UNREAD_ANSWERS };
  unsigned n = per_tenant / GMB_FDCHAN_UNREAD_ANSWERS;
  ck_assert_uint_le(n, MAXN);
  struct gmb_session *s[MAXN];
  int sock[MAXN];
  char rid[16], why[WIRE_MESSAGE_MAX];
  for (unsigned i = 0; i < n; i++) {
    snprintf(rid, sizeof rid, "s%u", i);
    sock[i] = chan_session(&c, rid, "t", &s[i], NULL);
  }
  uint64_t seg =
      fx_must_alloc(&c.f, "s0", geteuid(), MIB, 0).u.alloc.segment;
  for (unsigned i = 0; i < n; i++)
    ask_segments(&c, sock[i], s[i], seg, GMB_FDCHAN_UNREAD_ANSWERS);
  for (unsigned i = 0; i < n; i++) {
    ck_assert_uint_eq(s[i]->fd_sent, GMB_FDCHAN_UNREAD_ANSWERS);
    ck_assert_uint_eq(s[i]->fd_refused, 0);
  }
  ck_assert_uint_eq(s[0]->tenant->fd_unread, n * GMB_FDCHAN_UNREAD_ANSWERS);
  ck_assert_int_eq(try_hello(&c, "more", "t", why, sizeof why), GMB_E_LIMIT);
  int given, refused;
  for (unsigned i = 0; i < n; i++) {
    read_answers(sock[i], &given, &refused, why, sizeof why);
    ck_assert_int_eq(given, GMB_FDCHAN_UNREAD_ANSWERS);
    ck_assert_int_eq(refused, 0);
  }
  struct gmb_session *m;
  int ms = chan_session(&c, "more", "t", &m, NULL);
  fx_end(&c.f, m);
  for (unsigned i = 0; i < n; i++) fx_end(&c.f, s[i]);
  ck_assert_uint_eq(unread_channels(&c, NULL), 0);
  close(ms);
  for (unsigned i = 0; i < n; i++) close(sock[i]);
  chan_close(&c);
}
END_TEST

/*
 * A client that shuts its socket down (shutdown(2)) instead of closing it
 * keeps its queue, and the descriptors in it, while the broker's end sees
 * a hang-up: its session ends, but its channel is kept and counted, at
 * the end and at every tick, until the client reads them or closes the
 * socket.  Taken for gone at the hang-up, it would leave them in flight
 * uncounted, and could start again.
 */
START_TEST(shutdown_keeps_count) {
  struct chan c;
  chan_open(&c);
  struct gmb_session *s;
  int sock = chan_session(&c, "a", "", &s, NULL);
  uint64_t id = s->id;
  struct gmb_tenant *t = s->tenant;
  uint64_t seg = fx_must_alloc(&c.f, "a", geteuid(), MIB, 0).u.alloc.segment;
  ask_segments(&c, sock, s, seg, 8);
  ck_assert_uint_eq(s->fd_sent, 8);
  ck_assert_int_eq(shutdown(sock, SHUT_WR), 0);
  ck_assert_int_eq(serve_session(&c, id), 0); /* the end of its stream */
  ck_assert_uint_eq(unread_channels(&c, NULL), 1);
  ck_assert_uint_eq(t->fd_unread, 8);
  ck_assert_uint_eq(sweep_unread(&c), 1);
  ck_assert_uint_eq(t->fd_unread, 8);
  ck_assert_uint_eq(gmb__fdchan_unread_of_uid(&c.f.b, geteuid(), NULL), 8);
  /* They were still there, all of them. */
  int given, refused;
  char why[GMB_FD_MESSAGE_MAX];
  read_answers(sock, &given, &refused, why, sizeof why);
  ck_assert_int_eq(given, 8);
  ck_assert_uint_eq(sweep_unread(&c), 0);
  ck_assert_uint_eq(c.f.b.fd_unread, 0);
  close(sock);
  ck_assert_int_eq(gmb__pool_trim(c.f.b.pool) > 0, 1);
  ck_assert_int_eq(fx_count_fds(), c.idle_fds);
  chan_close(&c);
}
END_TEST

static Suite *fdchan_suite(void) {
  Suite *s = suite_create("fdchan");
  TCase *tc = tcase_create("auth");
  tcase_add_test(tc, auth_ok_sends_lock_table);
  tcase_add_test(tc, auth_refusals_look_alike);
  tcase_add_test(tc, auth_other_uid_process_refused);
  tcase_add_test(tc, auth_second_channel_limit);
  tcase_add_test(tc, first_message_not_auth_closed);
  tcase_add_test(tc, pending_table_bounded);
  tcase_add_test(tc, pending_capped_per_uid);
  tcase_add_test(tc, pending_expires);
  tcase_add_test(tc, short_first_message_echoes_nothing);
  suite_add_tcase(s, tc);

  tc = tcase_create("segment");
  tcase_add_test(tc, segment_own_maps_broker_pages);
  tcase_add_test(tc, segment_other_tenant_noent);
  tcase_add_test(tc, same_uid_token_tenants_apart);
  tcase_add_test(tc, unknown_op_proto_session_lives);
  suite_add_tcase(s, tc);

  tc = tcase_create("session");
  tcase_add_test(tc, session_garbage_ends_it);
  tcase_add_test(tc, client_close_ends_session);
  tcase_add_test(tc, client_never_reads_ended);
  tcase_add_test(tc, batch_per_round);
  tcase_add_test(tc, inflight_exhausted_spares_sessions);
  suite_add_tcase(s, tc);

  tc = tcase_create("unread");
  tcase_add_test(tc, unread_channels_bound_tenant);
  tcase_add_test(tc, live_unread_refused_session_lives);
  tcase_add_test(tc, live_unread_bound_per_tenant);
  tcase_add_test(tc, auth_burst_counted_at_send);
  tcase_add_test(tc, kept_channels_hold_places);
  tcase_add_test(tc, shutdown_keeps_count);
  tcase_add_test(tc, tenant_sessions_full_batches_served);
  suite_add_tcase(s, tc);

  tc = tcase_create("descriptors");
  tcase_add_test(tc, fds_refused_by_kernel);
  tcase_add_test(tc, fds_sent_to_broker_closed);
  tcase_add_test(tc, fd_with_linger_closed_off_loop);
  tcase_add_test(tc, fd_count_back_to_idle);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) { return check_run(fdchan_suite()); }
