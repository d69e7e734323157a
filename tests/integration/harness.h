/*
 * harness.h - what the integration tests use to drive a real gmb-broker and
 * real client processes, the way Redis's suite drives a real server.
 *
 * A broker runs in a run dir of its own under /tmp (mode 0755 so processes
 * of other uids reach its socket), started from $GMB_BUILD_DIR/gmb-broker
 * (default "build") with GMB_BROKER_CHECKS=1: it then checks its pool and
 * tenants after every request and aborts on a violation, so each test ends
 * with harness_broker_stop(), which fails unless the broker was still alive
 * and exits 0 on SIGTERM.
 *
 * When a test fails before stopping its broker, the broker gets SIGTERM
 * as its test process dies and stops cleanly; after the suite,
 * harness_main() waits for it, dumps its log to stderr and removes its run
 * dir.  Client children made with harness_fork() die with their test.
 *
 * No test asserts a duration: harness_poll_until() waits for a condition
 * with a generous bound (HARNESS_WAIT_MS) and the test asserts the
 * condition, never how fast it came.
 */
#ifndef GMB_TEST_HARNESS_H
#define GMB_TEST_HARNESS_H

#include <check.h>
#include <limits.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/types.h>

#include "gmb.h"
#include "wire.h"

/* Upper bound of every wait for a condition, in milliseconds. */
#define HARNESS_WAIT_MS 10000

struct harness_broker {
  pid_t pid;               /* 0 once stopped */
  char dir[64];            /* the run dir: /tmp/gmbt-XXXXXX */
  char endpoint[128];      /* "ipc://DIR/broker.sock" */
  char admin_endpoint[128];
  char sock_path[96];
  char admin_path[96];
  char log_path[96];
  char config_path[96];    /* "" without a config */
  char device[64];
  char base_dir[64];       /* per-GPU brokers: --run-dir BASE
                              --run-dir-per-gpu, dir = BASE/UUID */
};

/*
 * Starts a broker on `device` ("host:256MiB"), with `config` (INI text, or
 * NULL for none) written to DIR/gmb.ini, and waits until a client can
 * connect.  Fails the test (with the broker's log) when it does not come
 * up.
 */
void harness_broker_start(struct harness_broker *b, const char *device,
                          const char *config);

/*
 * As harness_broker_start, with options.  HARNESS_PIDNS: the broker runs
 * in a new PID namespace (root only), so it cannot see its clients' pids
 * and must watch them by heartbeats; b->pid is then a process outside
 * that passes SIGTERM on and exits with the broker's status.
 */
#define HARNESS_PIDNS 0x1u
void harness_broker_start_opts(struct harness_broker *b, const char *device,
                               const char *config, unsigned opts);

/*
 * A broker of one GPU on a host with several (--run-dir-per-gpu): started
 * with --run-dir `base` (a directory the test made) on `device`
 * ("cuda:N"), it makes its sockets in BASE/UUID, `uuid` being the GPU's
 * (the test knows it: the fake driver's are fixed).  Its log and config
 * go to BASE/UUID.log and BASE/UUID.ini; harness_broker_stop removes
 * BASE/UUID only.
 */
void harness_broker_start_gpu(struct harness_broker *b, const char *base,
                              const char *device, const char *uuid,
                              const char *config);

/* The fake driver's UUID of physical GPU p (0..7; tests/fakecuda). */
#define HARNESS_FAKE_UUID(p) "GPU-46414b45-4355-4441-0000-00000000000" #p

/*
 * A host with `n` GPUs of the fake driver, for per-GPU brokers: sets
 * GMB_LIBCUDA (build/fakecuda/libcuda.so.1), FAKECUDA_DEVICES=n,
 * FAKECUDA_TOTAL=128m, FAKECUDA_DIR (a directory of its own, dev_dir) and
 * GMB_RUN_DIR (an empty run dir, base, mode 0755); unsets
 * FAKECUDA_VISIBLE and GMB_ENDPOINT.  harness_fake_gpus_done removes
 * both directories (after the brokers stopped).
 */
struct harness_gpus {
  int n;
  char base[64];
  char dev_dir[64];
};
void harness_fake_gpus(struct harness_gpus *g, int n);
void harness_fake_gpus_done(struct harness_gpus *g);

/* 1 when this process may make a PID namespace (for HARNESS_PIDNS). */
int harness_pidns_possible(void);

/* 1 while the broker process has not exited. */
int harness_broker_alive(struct harness_broker *b);

/*
 * SIGTERMs the broker, waits for it, and fails the test unless it was
 * alive until then and exited with status 0 (its log is dumped otherwise).
 * Removes the run dir.  Returns the broker's pid (for shm checks).
 */
pid_t harness_broker_stop(struct harness_broker *b);
/* As harness_broker_stop, keeping the run dir (and the log in it) for the
 * test to read; harness_broker_rm_dir removes it then. */
pid_t harness_broker_stop_keep_dir(struct harness_broker *b);
void harness_broker_rm_dir(struct harness_broker *b);
/* SIGKILLs the broker (no last word to its clients: a crash), waits for
 * it and removes its run dir; fails the test unless it was alive. */
void harness_broker_kill(struct harness_broker *b);

/* The broker's log so far, NUL-terminated; the caller frees it. */
char *harness_broker_log(const struct harness_broker *b);

/* Writes the broker's log to stderr, framed, for a failing test. */
void harness_broker_dump_log(const struct harness_broker *b);

/* How many /dev/shm objects of broker `pid` ("gmb-PID-*") are still
 * there; each is named on stderr. */
int harness_shm_leftovers(pid_t pid);

/* The build dir: $GMB_BUILD_DIR, else "build". */
const char *harness_build_dir(void);

/*
 * Forks a child that runs fn(arg) and _exit()s with its return value.  The
 * child dies with the test process (PR_SET_PDEATHSIG), so a failing test
 * leaves no client behind.  Children must not use ck_assert: they report
 * through their exit code and stderr (see CHILD_CHECK).
 */
pid_t harness_fork(int (*fn)(void *arg), void *arg);

/*
 * Waits up to HARNESS_WAIT_MS for child `pid`; returns its exit code, 128 +
 * the signal that killed it, or -1 when it did not end in time (it is then
 * killed).
 */
int harness_wait(pid_t pid);

/* One byte through a pipe, to order events between processes: send
 * returns 0 or -1; wait returns the byte, or -1 on EOF or when nothing came
 * within timeout_ms. */
int harness_pipe_send(int fd, char c);
int harness_pipe_wait(int fd, int timeout_ms);

/* Calls cond(arg) until it returns non-zero or timeout_ms pass; returns the
 * last value. */
int harness_poll_until(int (*cond)(void *arg), void *arg, int timeout_ms);

/* Sleeps ms milliseconds; only to pace a loop, never as a proof. */
void harness_sleep_ms(int ms);

/* Milliseconds on the monotonic clock, for printed observations. */
double harness_now_ms(void);

/*
 * Runs argv (argv[0] a path) with stdout and stderr captured into out
 * (NUL-terminated, truncated to cap), for at most HARNESS_WAIT_MS.  Returns
 * the exit status, 128 + signal, or -1 when it had to be killed.
 */
int harness_run(char *const argv[], char *out, size_t cap);

/* Writes `text` to `path` (0644); fails the test on error. */
void harness_write_file(const char *path, const char *text);

/* Fills buf with `len` bytes that depend on seed, for pattern checks;
 * harness_pattern_check returns the index of the first mismatch or -1. */
void harness_pattern_fill(void *buf, size_t len, uint64_t seed);
long harness_pattern_check(const void *buf, size_t len, uint64_t seed);

/* A knob from the environment (SCALE, ITER), def when unset or bad. */
long harness_env_long(const char *name, long def);

/* --- raw ZeroMQ access, for malformed input and the admin socket -------- */

/* A DEALER connected to `endpoint`; fails the test on error. */
void *harness_raw_open(const char *endpoint);
void harness_raw_close(void *sock);

/* Sends `len` bytes as one frame (more: ZMQ_SNDMORE); 0 or -1. */
int harness_raw_send(void *sock, const void *buf, size_t len, int more);

/* Receives one message within timeout_ms and decodes it as a Reply: 0,
 * GMB_E_TIMEOUT when nothing came, or the decoder's GMB_E_PROTO.  The
 * caller clears *rep with gmb__wire_reply_clear. */
int harness_raw_recv(void *sock, int timeout_ms, struct wire_reply *rep);

/* Encodes and sends req, then receives its reply (as harness_raw_recv). */
int harness_raw_call(void *sock, const struct wire_request *req,
                     struct wire_reply *rep);

/* The admin status of broker b (its device and per-tenant rows): 0 or a
 * GMB_E_* code; the caller clears *rep. */
int harness_admin_status(const struct harness_broker *b,
                         struct wire_reply *rep);

/*
 * One AdminCompact request on an admin socket opened with
 * harness_raw_open(b->admin_endpoint): compacts `tenant` ("" or NULL: every
 * tenant) and fills *out with the run's figures.  0, the broker's status,
 * GMB_E_TIMEOUT when no reply came within HARNESS_WAIT_MS, or GMB_E_PROTO
 * for a reply of another kind.
 */
int harness_admin_compact(void *admin_sock, const char *tenant,
                          struct wire_compact_stats *out);

/* The admin status row of `tenant`: 0 with *out filled, GMB_E_NOENT when
 * the broker lists no such tenant, or the failure of the request. */
int harness_tenant_row(const struct harness_broker *b, const char *tenant,
                       struct wire_tenant_row *out);

/* The largest sleep offer (SessionRow.sleep_pausable) of a session of
 * `tenant` now; 0 when none offers (or no status). */
uint64_t harness_sleep_offer(const struct harness_broker *b,
                             const char *tenant);

/*
 * A child process driven by one-byte commands: harness_job_open makes the
 * pipes (the child reads commands on in_fd(), answers on out_fd()), then
 * harness_job_start forks fn(arg) and waits for its 'r'.  harness_job_ask
 * sends a command and returns the answer (-1 on none within
 * HARNESS_WAIT_MS); harness_job_end sends 'q', requires exit status 0 and
 * closes the pipes; harness_job_close only closes them (a killed child).
 */
/* A job's own check: on failure it says where on stderr and returns from
 * the job's function with an exit status made of the line number. */
#define HARNESS_JOB_CHECK(cond)                                            \
  do {                                                                     \
    if (!(cond)) {                                                         \
      fprintf(stderr, "%s:%d: child check failed: %s (%s)\n", __FILE__,    \
              __LINE__, #cond, gmb_last_error(NULL));                      \
      return __LINE__ % 200 + 10;                                          \
    }                                                                      \
  } while (0)

struct harness_job {
  int to[2], from[2];
  pid_t pid;
};
void harness_job_open(struct harness_job *j);
static inline int harness_job_in(const struct harness_job *j) {
  return j->to[0];
}
static inline int harness_job_out(const struct harness_job *j) {
  return j->from[1];
}
void harness_job_start(struct harness_job *j, int (*fn)(void *arg), void *arg);
int harness_job_ask(struct harness_job *j, char cmd);
void harness_job_end(struct harness_job *j);
void harness_job_close(struct harness_job *j);

/* --- HTTP, for the metrics endpoint ---------------------------------------- */

/* A TCP port of 127.0.0.1 that was free a moment ago. */
int harness_free_port(void);

/* One HTTP/1.0 exchange on 127.0.0.1:port: the status code (0 when
 * nothing answered) and the response's body in `body` (cut to cap). */
int harness_http_get(int port, const char *method, const char *path,
                     char *body, size_t cap);

/* The same over the Unix socket `sock` (admin-http.sock): the status
 * code, 0 when nothing that reads as HTTP came back, or -errno when the
 * connection was refused (-EACCES: the socket's mode keeps this uid
 * out).  Safe in a child: it never fails the test itself. */
int harness_http_unix(const char *sock, const char *method, const char *path,
                      char *body, size_t cap);

/* The descriptors process pid has open now (fails the test when
 * /proc/PID/fd cannot be read). */
int harness_fds_of(pid_t pid);

/* --- what most tests repeat ----------------------------------------------- */

/* gmb_connect to broker b as `tenant`; fails the test (with the client's
 * error) unless it succeeds with a client. */
gmb_client *harness_connect_ok(const struct harness_broker *b,
                               const char *tenant);

/* gmb_tenant_stats of c; fails the test unless it succeeds.  The struct
 * is filled with 0xff first, so a field the call leaves alone shows. */
gmb_stats harness_stats_ok(gmb_client *c);

/* A pinned allocation of `size` bytes (flags 0); fails the test unless
 * gmb_alloc succeeds. */
gmb_id harness_alloc_ok(gmb_client *c, uint64_t size);

/* The next value of a xorshift64* generator with state *s (not 0): cheap,
 * reproducible randomness for sizes and choices, seeded by the test. */
uint64_t harness_rnd(uint64_t *s);

/* How many times `needle` occurs in `hay` (overlapping ones counted). */
size_t harness_count(const char *hay, const char *needle);

/*
 * Runs the build's program `tool` ("gmb-broker", "gmbctl") with the
 * arguments that follow, up to a NULL (at most 12), as harness_run:
 * output in out, the exit status returned.
 */
int harness_tool(const char *tool, char *out, size_t cap, ...);

/* As harness_tool, for gmbctl against broker b: "gmbctl --run-dir DIR"
 * and then the arguments up to a NULL (at most 12). */
int harness_ctl(const struct harness_broker *b, char *out, size_t cap, ...);

/*
 * A suite `name` of one test case `tcase` with the tests listed (a
 * NULL-ended array; see HARNESS_SUITE), each given timeout_s seconds
 * (0: Check's default, CK_DEFAULT_TIMEOUT).
 */
Suite *harness_suite(const char *name, const char *tcase, double timeout_s,
                     const TTest *const tests[]);
#define HARNESS_SUITE(name, tcase, timeout_s, ...) \
  harness_suite((name), (tcase), (timeout_s),     \
                (const TTest *const[]){__VA_ARGS__, NULL})

/* Runs a Check suite (the one suite of a test binary) and returns the exit
 * status for main: 0 when every test passed. */
int harness_main(Suite *s);

/*
 * In a child: when cond is false, say where and why on stderr and return
 * `code` from the child's function.
 */
#define CHILD_CHECK(cond, code, ...)                                        \
  do {                                                                      \
    if (!(cond)) {                                                          \
      fprintf(stderr, "child %d: %s:%d: check failed: %s: ", (int)getpid(), \
              __FILE__, __LINE__, #cond);                                   \
      fprintf(stderr, __VA_ARGS__);                                         \
      fprintf(stderr, "\n");                                                \
      return (code);                                                        \
    }                                                                       \
  } while (0)

#endif /* GMB_TEST_HARNESS_H */
