/*
 * harness.c - a real broker and real client processes for the integration
 * tests (see harness.h for the contract).
 *
 * The harness owns the brokers a test process started: each is recorded
 * in a registry (pid, run dir, log) in memory shared with the runner until
 * harness_broker_stop() takes it out.  Check ends a failed test's process
 * with _exit() and SIGKILLs its process group, so nothing in the test
 * process can clean up after a failure.  Brokers therefore run in a
 * process group of their own with PR_SET_PDEATHSIG = SIGTERM: when the
 * test process dies they stop cleanly (sockets and shm objects removed),
 * and the runner, a child subreaper, waits for them after the suite,
 * dumps their logs to stderr and removes their run dirs.
 *
 * Raw ZeroMQ sockets share one context per process, made on first use.
 */
#include "harness.h"
#include "util.h"

#include <dirent.h>
#include <stdarg.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/un.h>

#define HARNESS_MAX_BROKERS 8

struct harness_reg {
  pid_t pid;
  char dir[64];
  char log_path[96];
};

/* Shared with the forked test processes (MAP_SHARED, made by
 * harness_main before the suite runs), so the runner sees what they left. */
static struct harness_reg *harness_regs;
static void *harness_zctx;

/* --- small things --------------------------------------------------------- */

void harness_sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
  }
}

double harness_now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

const char *harness_build_dir(void) {
  const char *b = getenv("GMB_BUILD_DIR");
  return b && *b ? b : "build";
}

long harness_env_long(const char *name, long def) {
  const char *s = getenv(name);
  if (s == NULL || *s == '\0') return def;
  char *end;
  errno = 0;
  long v = strtol(s, &end, 10);
  if (errno || *end != '\0' || v <= 0) return def;
  return v;
}

int harness_poll_until(int (*cond)(void *arg), void *arg, int timeout_ms) {
  double deadline = harness_now_ms() + timeout_ms;
  int pause_ms = 1;
  for (;;) {
    int v = cond(arg);
    if (v || harness_now_ms() >= deadline) return v;
    harness_sleep_ms(pause_ms);
    if (pause_ms < 20) pause_ms *= 2;
  }
}

void harness_write_file(const char *path, const char *text) {
  FILE *f = fopen(path, "w");
  ck_assert_msg(f != NULL, "cannot write %s: %s", path, strerror(errno));
  size_t n = strlen(text);
  ck_assert_uint_eq(fwrite(text, 1, n, f), n);
  ck_assert_int_eq(fclose(f), 0);
}

static char *harness_read_file(const char *path) {
  FILE *f = fopen(path, "r");
  if (f == NULL) return strdup("");
  size_t cap = 4096, n = 0;
  char *buf = malloc(cap);
  for (;;) {
    if (n + 1024 > cap) {
      cap *= 2;
      buf = realloc(buf, cap);
    }
    size_t got = fread(buf + n, 1, cap - n - 1, f);
    n += got;
    if (got == 0) break;
  }
  fclose(f);
  buf[n] = '\0';
  return buf;
}

/* splitmix64: patterns that differ for every seed and every word. */
static uint64_t harness_mix(uint64_t x) { return gmb__splitmix64(&x); }

void harness_pattern_fill(void *buf, size_t len, uint64_t seed) {
  uint8_t *p = buf;
  size_t words = len / 8;
  uint64_t base = harness_mix(seed);
  for (size_t i = 0; i < words; i++) {
    uint64_t v = base ^ (i * 0x100000001b3ull);
    memcpy(p + i * 8, &v, 8);
  }
  for (size_t i = words * 8; i < len; i++) p[i] = (uint8_t)(base >> (i % 8));
}

long harness_pattern_check(const void *buf, size_t len, uint64_t seed) {
  const uint8_t *p = buf;
  size_t words = len / 8;
  uint64_t base = harness_mix(seed);
  for (size_t i = 0; i < words; i++) {
    uint64_t v = base ^ (i * 0x100000001b3ull), got;
    memcpy(&got, p + i * 8, 8);
    if (got != v) return (long)(i * 8);
  }
  for (size_t i = words * 8; i < len; i++)
    if (p[i] != (uint8_t)(base >> (i % 8))) return (long)i;
  return -1;
}

/* --- the registry and the failure path --------------------------------- */

static int harness_rm_one(const char *path, const struct stat *st, int flag,
                          struct FTW *ftw) {
  (void)st;
  (void)flag;
  (void)ftw;
  remove(path);
  return 0;
}

static void harness_rm_rf(const char *dir) {
  if (dir[0]) nftw(dir, harness_rm_one, 16, FTW_DEPTH | FTW_PHYS);
}

static void harness_dump(const char *log_path, const char *why) {
  char *log = harness_read_file(log_path);
  fprintf(stderr, "---- %s: %s ----\n%s---- end of %s ----\n", why, log_path,
          log, log_path);
  free(log);
}

static void harness_register(const struct harness_broker *b) {
  if (harness_regs == NULL) { /* harness_main was not used: local only */
    static struct harness_reg local[HARNESS_MAX_BROKERS];
    harness_regs = local;
  }
  for (int i = 0; i < HARNESS_MAX_BROKERS; i++) {
    if (harness_regs[i].pid != 0) continue;
    harness_regs[i].pid = b->pid;
    snprintf(harness_regs[i].dir, sizeof harness_regs[i].dir, "%s", b->dir);
    snprintf(harness_regs[i].log_path, sizeof harness_regs[i].log_path, "%s",
             b->log_path);
    return;
  }
  ck_abort_msg("more than %d brokers at once", HARNESS_MAX_BROKERS);
}

static void harness_unregister(pid_t pid) {
  for (int i = 0; harness_regs && i < HARNESS_MAX_BROKERS; i++)
    if (harness_regs[i].pid == pid) harness_regs[i].pid = 0;
}

/*
 * After the suite: what is still registered was started by a test that
 * failed before stopping it.  Its test process is gone, the broker got
 * SIGTERM from PR_SET_PDEATHSIG (or gets it now, without fork mode) and
 * was handed to this process, the subreaper, to be waited for.
 */
static int harness_sweep(void) {
  int n = 0;
  for (int i = 0; harness_regs && i < HARNESS_MAX_BROKERS; i++) {
    struct harness_reg *r = &harness_regs[i];
    if (r->pid == 0) continue;
    n++;
    kill(r->pid, SIGTERM);
    int st = 0;
    double deadline = harness_now_ms() + 5000;
    pid_t w;
    while ((w = waitpid(r->pid, &st, WNOHANG)) == 0 &&
           harness_now_ms() < deadline)
      harness_sleep_ms(5);
    if (w == 0) {
      kill(r->pid, SIGKILL);
      waitpid(r->pid, &st, 0);
    }
    char why[160];
    snprintf(why, sizeof why, "log of broker %d, left running by a failed "
             "test (%s)", (int)r->pid,
             w == 0 ? "it ignored SIGTERM and was killed"
             : w < 0 ? "not a child of this process"
             : WIFSIGNALED(st) ? "it died of a signal"
             : WEXITSTATUS(st) == 0 ? "it then stopped cleanly"
                                    : "it then exited with an error");
    harness_dump(r->log_path, why);
    harness_rm_rf(r->dir);
    r->pid = 0;
  }
  while (waitpid(-1, NULL, WNOHANG) > 0) { /* orphaned clients */
  }
  return n;
}

/* --- brokers ---------------------------------------------------------------- */

char *harness_broker_log(const struct harness_broker *b) {
  return harness_read_file(b->log_path);
}

void harness_broker_dump_log(const struct harness_broker *b) {
  harness_dump(b->log_path, "broker log");
}

/* Reaps the broker if it exited; 1 while it runs. */
static int harness_reap(struct harness_broker *b, int *status) {
  if (b->pid == 0) return 0;
  int st;
  pid_t r = waitpid(b->pid, &st, WNOHANG);
  if (r == 0) return 1;
  if (status) *status = r == b->pid ? st : -1;
  return 0;
}

int harness_broker_alive(struct harness_broker *b) {
  int st = 0;
  if (harness_reap(b, &st)) return 1;
  if (b->pid != 0) {
    /* It died by itself: that is what the caller will fail on, so say how. */
    if (WIFSIGNALED(st))
      fprintf(stderr, "broker %d was killed by signal %d\n", (int)b->pid,
              WTERMSIG(st));
    else if (WIFEXITED(st))
      fprintf(stderr, "broker %d exited with status %d\n", (int)b->pid,
              WEXITSTATUS(st));
    harness_unregister(b->pid);
    harness_broker_dump_log(b);
    b->pid = 0;
  }
  return 0;
}

/* In the broker's process, after fork: never returns. */
static void harness_exec_broker(const struct harness_broker *b) {
  char bin[PATH_MAX];
  snprintf(bin, sizeof bin, "%s/gmb-broker", harness_build_dir());
  char *argv[12];
  int n = 0;
  argv[n++] = bin;
  argv[n++] = "--run-dir";
  argv[n++] = (char *)(b->base_dir[0] ? b->base_dir : b->dir);
  if (b->base_dir[0]) argv[n++] = "--run-dir-per-gpu";
  argv[n++] = "--device";
  argv[n++] = (char *)b->device;
  if (b->config_path[0]) {
    argv[n++] = "--config";
    argv[n++] = (char *)b->config_path;
  }
  argv[n++] = "--log-level";
  argv[n++] = "info";
  argv[n] = NULL;
  setenv("GMB_BROKER_CHECKS", "1", 1);
  execv(bin, argv);
  fprintf(stderr, "harness: cannot run %s: %s\n", bin, strerror(errno));
  _exit(127);
}

/*
 * The broker as pid 1 of a new PID namespace, where the pids of clients
 * outside are invisible (SO_PEERCRED gives 0), so it must rely on their
 * heartbeats.  This process stays outside as the test's handle: it passes
 * SIGTERM on and exits with the broker's status.  The signals stay
 * blocked across exec: a namespace's init drops signals it has no handler
 * for, but blocked ones are queued, and the broker reads them from its
 * signalfd.
 */
static void harness_exec_broker_pidns(const struct harness_broker *b) {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGCHLD);
  sigprocmask(SIG_BLOCK, &set, NULL);
  if (unshare(CLONE_NEWPID) != 0) {
    fprintf(stderr, "harness: unshare(CLONE_NEWPID): %s\n", strerror(errno));
    _exit(120);
  }
  pid_t broker = fork();
  if (broker < 0) _exit(121);
  if (broker == 0) {
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    harness_exec_broker(b);
  }
  for (;;) {
    int sig = 0;
    if (sigwait(&set, &sig) != 0) continue;
    if (sig == SIGTERM || sig == SIGINT) {
      kill(broker, SIGTERM);
      continue;
    }
    int st;
    pid_t w = waitpid(broker, &st, WNOHANG);
    if (w == broker)
      _exit(WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st));
  }
}

static void harness_broker_child(const struct harness_broker *b, int pidns) {
  int fd = open(b->log_path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  int null = open("/dev/null", O_RDONLY);
  if (fd < 0 || null < 0) _exit(126);
  dup2(null, 0);
  dup2(fd, 1);
  dup2(fd, 2);
  /* Its own process group: Check SIGKILLs the test's group when a test
   * ends, and a broker killed so leaves its sockets and shm objects behind.
   * Instead a broker whose test process died gets SIGTERM and stops
   * cleanly (harness_sweep waits for it). */
  setpgid(0, 0);
  prctl(PR_SET_PDEATHSIG, SIGTERM);
  if (pidns) harness_exec_broker_pidns(b);
  harness_exec_broker(b);
}

int harness_pidns_possible(void) {
  fflush(NULL);
  pid_t pid = fork();
  if (pid < 0) return 0;
  if (pid == 0) _exit(unshare(CLONE_NEWPID) == 0 ? 0 : 1);
  int st;
  if (waitpid(pid, &st, 0) != pid) return 0;
  return WIFEXITED(st) && WEXITSTATUS(st) == 0;
}

static int harness_broker_ready(void *arg) {
  struct harness_broker *b = arg;
  if (!harness_broker_alive(b)) return -1;
  struct stat st;
  if (stat(b->sock_path, &st) != 0) return 0;
  /* In a child: connecting to a cuda broker loads the CUDA driver, and a
   * test process that did could fork no client any more (the driver
   * refuses a child forked after cuInit). */
  fflush(NULL);
  pid_t pid = fork();
  if (pid < 0) return 0;
  if (pid == 0) {
    gmb_client *c = NULL;
    if (gmb_connect(b->endpoint, "harness-probe", &c) != 0) _exit(1);
    gmb_disconnect(c);
    _exit(0);
  }
  int wst;
  if (waitpid(pid, &wst, 0) != pid) return 0;
  return WIFEXITED(wst) && WEXITSTATUS(wst) == 0;
}

void harness_broker_start(struct harness_broker *b, const char *device,
                          const char *config) {
  harness_broker_start_opts(b, device, config, 0);
}

void harness_broker_start_opts(struct harness_broker *b, const char *device,
                               const char *config, unsigned opts) {
  memset(b, 0, sizeof *b);
  char tmpl[] = "/tmp/gmbt-XXXXXX";
  ck_assert_msg(mkdtemp(tmpl) != NULL, "mkdtemp: %s", strerror(errno));
  /* Other uids (the auth tests) must reach the socket inside. */
  ck_assert_int_eq(chmod(tmpl, 0755), 0);
  snprintf(b->dir, sizeof b->dir, "%s", tmpl);
  snprintf(b->sock_path, sizeof b->sock_path, "%s/broker.sock", b->dir);
  snprintf(b->admin_path, sizeof b->admin_path, "%s/admin.sock", b->dir);
  snprintf(b->endpoint, sizeof b->endpoint, "ipc://%s", b->sock_path);
  snprintf(b->admin_endpoint, sizeof b->admin_endpoint, "ipc://%s",
           b->admin_path);
  snprintf(b->log_path, sizeof b->log_path, "%s/broker.log", b->dir);
  snprintf(b->device, sizeof b->device, "%s", device);
  if (config) {
    snprintf(b->config_path, sizeof b->config_path, "%s/gmb.ini", b->dir);
    harness_write_file(b->config_path, config);
  }
  fflush(NULL);
  pid_t pid = fork();
  ck_assert_msg(pid >= 0, "fork: %s", strerror(errno));
  if (pid == 0) harness_broker_child(b, (opts & HARNESS_PIDNS) != 0);
  b->pid = pid;
  harness_register(b);
  int ready = harness_poll_until(harness_broker_ready, b, HARNESS_WAIT_MS);
  ck_assert_msg(ready == 1, "broker on %s did not come up (%s); see its log "
                "above", b->device, ready < 0 ? "it exited" : "no answer");
}

void harness_broker_start_gpu(struct harness_broker *b, const char *base,
                              const char *device, const char *uuid,
                              const char *config) {
  memset(b, 0, sizeof *b);
  snprintf(b->base_dir, sizeof b->base_dir, "%s", base);
  ck_assert_int_lt(strlen(base) + strlen(uuid) + 1, sizeof b->dir);
  snprintf(b->dir, sizeof b->dir, "%s/%s", base, uuid);
  snprintf(b->sock_path, sizeof b->sock_path, "%s/broker.sock", b->dir);
  snprintf(b->admin_path, sizeof b->admin_path, "%s/admin.sock", b->dir);
  snprintf(b->endpoint, sizeof b->endpoint, "ipc://%s", b->sock_path);
  snprintf(b->admin_endpoint, sizeof b->admin_endpoint, "ipc://%s",
           b->admin_path);
  snprintf(b->log_path, sizeof b->log_path, "%s/%s.log", base, uuid);
  snprintf(b->device, sizeof b->device, "%s", device);
  if (config) {
    snprintf(b->config_path, sizeof b->config_path, "%s/%s.ini", base, uuid);
    harness_write_file(b->config_path, config);
  }
  fflush(NULL);
  pid_t pid = fork();
  ck_assert_msg(pid >= 0, "fork: %s", strerror(errno));
  if (pid == 0) harness_broker_child(b, 0);
  b->pid = pid;
  harness_register(b);
  int ready = harness_poll_until(harness_broker_ready, b, HARNESS_WAIT_MS);
  ck_assert_msg(ready == 1, "broker on %s did not come up (%s); see its log "
                "above", b->device, ready < 0 ? "it exited" : "no answer");
}

void harness_fake_gpus(struct harness_gpus *g, int n) {
  static char path[PATH_MAX];
  char cwd[PATH_MAX / 2];
  const char *bd = harness_build_dir();
  if (bd[0] == '/')
    snprintf(path, sizeof path, "%s/fakecuda/libcuda.so.1", bd);
  else {
    ck_assert_ptr_ne(getcwd(cwd, sizeof cwd), NULL);
    snprintf(path, sizeof path, "%s/%s/fakecuda/libcuda.so.1", cwd, bd);
  }
  ck_assert_msg(access(path, R_OK) == 0, "no fake driver at %s", path);
  memset(g, 0, sizeof *g);
  g->n = n;
  char num[16];
  snprintf(num, sizeof num, "%d", n);
  setenv("GMB_LIBCUDA", path, 1);
  setenv("FAKECUDA_TOTAL", "128m", 1);
  setenv("FAKECUDA_DEVICES", num, 1);
  unsetenv("FAKECUDA_VISIBLE");
  unsetenv("GMB_ENDPOINT");
  snprintf(g->dev_dir, sizeof g->dev_dir, "/tmp/gmbt-fakedev-XXXXXX");
  ck_assert_ptr_nonnull(mkdtemp(g->dev_dir));
  setenv("FAKECUDA_DIR", g->dev_dir, 1);
  snprintf(g->base, sizeof g->base, "/tmp/gmbt-XXXXXX");
  ck_assert_ptr_nonnull(mkdtemp(g->base));
  ck_assert_int_eq(chmod(g->base, 0755), 0);
  setenv("GMB_RUN_DIR", g->base, 1);
}

void harness_fake_gpus_done(struct harness_gpus *g) {
  harness_rm_rf(g->base);
  harness_rm_rf(g->dev_dir);
  unsetenv("GMB_RUN_DIR");
  unsetenv("FAKECUDA_DEVICES");
}

pid_t harness_broker_stop(struct harness_broker *b) {
  pid_t pid = harness_broker_stop_keep_dir(b);
  harness_rm_rf(b->dir);
  return pid;
}

void harness_broker_rm_dir(struct harness_broker *b) { harness_rm_rf(b->dir); }

void harness_broker_kill(struct harness_broker *b) {
  ck_assert_msg(harness_broker_alive(b), "the broker died during the test");
  pid_t pid = b->pid;
  ck_assert_int_eq(kill(pid, SIGKILL), 0);
  int st = 0;
  ck_assert_int_eq(waitpid(pid, &st, 0), pid);
  harness_unregister(pid);
  b->pid = 0;
  harness_rm_rf(b->dir);
}

pid_t harness_broker_stop_keep_dir(struct harness_broker *b) {
  ck_assert_msg(harness_broker_alive(b), "the broker died during the test "
                "(a failed consistency check aborts it; see its log above)");
  pid_t pid = b->pid;
  ck_assert_int_eq(kill(pid, SIGTERM), 0);
  int st = 0;
  double deadline = harness_now_ms() + HARNESS_WAIT_MS;
  pid_t r;
  while ((r = waitpid(pid, &st, WNOHANG)) == 0 && harness_now_ms() < deadline)
    harness_sleep_ms(5);
  if (r == 0) {
    harness_broker_dump_log(b);
    kill(pid, SIGKILL);
    waitpid(pid, &st, 0);
    harness_unregister(pid);
    b->pid = 0;
    ck_abort_msg("the broker did not stop within %d ms of SIGTERM",
                 HARNESS_WAIT_MS);
  }
  harness_unregister(pid);
  b->pid = 0;
  int clean = WIFEXITED(st) && WEXITSTATUS(st) == 0;
  if (!clean) {
    harness_broker_dump_log(b);
    if (WIFSIGNALED(st))
      ck_abort_msg("the broker was killed by signal %d while stopping",
                   WTERMSIG(st));
    ck_abort_msg("the broker exited with status %d after SIGTERM, want 0",
                 WEXITSTATUS(st));
  }
  return pid;
}

int harness_shm_leftovers(pid_t pid) {
  char prefix[32];
  int n = snprintf(prefix, sizeof prefix, "gmb-%ld-", (long)pid);
  DIR *d = opendir("/dev/shm");
  if (d == NULL) return 0;
  int count = 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL)
    if (strncmp(e->d_name, prefix, (size_t)n) == 0) {
      fprintf(stderr, "left behind: /dev/shm/%s\n", e->d_name);
      count++;
    }
  closedir(d);
  return count;
}

/* --- child processes -------------------------------------------------------- */

pid_t harness_fork(int (*fn)(void *arg), void *arg) {
  fflush(NULL);
  pid_t parent = getpid();
  pid_t pid = fork();
  ck_assert_msg(pid >= 0, "fork: %s", strerror(errno));
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(125);
    int rc = fn(arg);
    fflush(NULL);
    _exit(rc & 0xff);
  }
  return pid;
}

int harness_wait(pid_t pid) {
  int st;
  double deadline = harness_now_ms() + HARNESS_WAIT_MS;
  pid_t r;
  while ((r = waitpid(pid, &st, WNOHANG)) == 0) {
    if (harness_now_ms() > deadline) {
      fprintf(stderr, "child %d did not end within %d ms; killing it\n",
              (int)pid, HARNESS_WAIT_MS);
      kill(pid, SIGKILL);
      waitpid(pid, &st, 0);
      return -1;
    }
    harness_sleep_ms(2);
  }
  if (r < 0) return -1;
  if (WIFEXITED(st)) return WEXITSTATUS(st);
  if (WIFSIGNALED(st)) return 128 + WTERMSIG(st);
  return -1;
}

int harness_pipe_send(int fd, char c) {
  ssize_t n;
  while ((n = write(fd, &c, 1)) < 0 && errno == EINTR) {
  }
  return n == 1 ? 0 : -1;
}

int harness_pipe_wait(int fd, int timeout_ms) {
  double deadline = harness_now_ms() + timeout_ms;
  for (;;) {
    struct pollfd p = {fd, POLLIN, 0};
    int left = (int)(deadline - harness_now_ms());
    if (left < 0) left = 0;
    int r = poll(&p, 1, left);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return -1;
    char c;
    ssize_t n = read(fd, &c, 1);
    if (n < 0 && errno == EINTR) continue;
    return n == 1 ? (unsigned char)c : -1;
  }
}

int harness_run(char *const argv[], char *out, size_t cap) {
  int fds[2];
  ck_assert_int_eq(pipe(fds), 0);
  fflush(NULL);
  pid_t pid = fork();
  ck_assert_msg(pid >= 0, "fork: %s", strerror(errno));
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    close(fds[0]);
    dup2(fds[1], 1);
    dup2(fds[1], 2);
    close(fds[1]);
    execv(argv[0], argv);
    fprintf(stderr, "cannot run %s: %s\n", argv[0], strerror(errno));
    _exit(127);
  }
  close(fds[1]);
  size_t n = 0;
  double deadline = harness_now_ms() + HARNESS_WAIT_MS;
  for (;;) {
    struct pollfd p = {fds[0], POLLIN, 0};
    int left = (int)(deadline - harness_now_ms());
    if (left <= 0 || poll(&p, 1, left) <= 0) break;
    char tmp[1024];
    ssize_t got = read(fds[0], tmp, sizeof tmp);
    if (got <= 0) break;
    size_t take = (size_t)got;
    if (cap && n + take > cap - 1) take = cap - 1 - n;
    memcpy(out + n, tmp, take);
    n += take;
  }
  close(fds[0]);
  if (cap) out[n] = '\0';
  return harness_wait(pid);
}

/* --- raw ZeroMQ ------------------------------------------------------------- */

void *harness_raw_open(const char *endpoint) {
  if (harness_zctx == NULL) harness_zctx = zmq_ctx_new();
  ck_assert_ptr_nonnull(harness_zctx);
  void *s = zmq_socket(harness_zctx, ZMQ_DEALER);
  ck_assert_ptr_nonnull(s);
  int zero = 0;
  zmq_setsockopt(s, ZMQ_LINGER, &zero, sizeof zero);
  ck_assert_msg(zmq_connect(s, endpoint) == 0, "zmq_connect %s: %s", endpoint,
                zmq_strerror(zmq_errno()));
  return s;
}

void harness_raw_close(void *sock) {
  if (sock) zmq_close(sock);
}

int harness_raw_send(void *sock, const void *buf, size_t len, int more) {
  return zmq_send(sock, buf, len, more ? ZMQ_SNDMORE : 0) < 0 ? -1 : 0;
}

int harness_raw_recv(void *sock, int timeout_ms, struct wire_reply *rep) {
  memset(rep, 0, sizeof *rep);
  zmq_pollitem_t it = {sock, 0, ZMQ_POLLIN, 0};
  if (zmq_poll(&it, 1, timeout_ms) <= 0) return GMB_E_TIMEOUT;
  zmq_msg_t m;
  zmq_msg_init(&m);
  if (zmq_msg_recv(&m, sock, 0) < 0) {
    zmq_msg_close(&m);
    return GMB_E_CONN;
  }
  int multi = zmq_msg_more(&m);
  int rc = multi ? GMB_E_PROTO
                 : gmb__wire_reply_decode(zmq_msg_data(&m), zmq_msg_size(&m),
                                          rep);
  zmq_msg_close(&m);
  while (multi) {
    zmq_msg_init(&m);
    if (zmq_msg_recv(&m, sock, 0) < 0) multi = 0;
    else multi = zmq_msg_more(&m);
    zmq_msg_close(&m);
  }
  return rc;
}

int harness_raw_call(void *sock, const struct wire_request *req,
                     struct wire_reply *rep) {
  uint8_t *buf = NULL;
  size_t len = 0;
  int rc = gmb__wire_request_encode(req, &buf, &len);
  if (rc) return rc;
  rc = harness_raw_send(sock, buf, len, 0);
  free(buf);
  if (rc) return GMB_E_CONN;
  return harness_raw_recv(sock, HARNESS_WAIT_MS, rep);
}

int harness_admin_status(const struct harness_broker *b,
                         struct wire_reply *rep) {
  void *s = harness_raw_open(b->admin_endpoint);
  struct wire_request req;
  memset(&req, 0, sizeof req);
  req.id = 1;
  req.kind = WIRE_ADMIN_STATUS;
  int rc = harness_raw_call(s, &req, rep);
  harness_raw_close(s);
  if (rc == 0 && rep->status != 0) rc = rep->status;
  if (rc == 0 && rep->kind != WIRE_ADMIN_STATUS) rc = GMB_E_PROTO;
  return rc;
}

int harness_admin_compact(void *admin_sock, const char *tenant,
                          struct wire_compact_stats *out) {
  static uint64_t next_id = 1000;
  struct wire_request req;
  struct wire_reply rep;
  memset(&req, 0, sizeof req);
  req.id = ++next_id;
  req.kind = WIRE_ADMIN_COMPACT;
  snprintf(req.u.admin_compact.tenant, sizeof req.u.admin_compact.tenant,
           "%s", tenant ? tenant : "");
  int rc = harness_raw_call(admin_sock, &req, &rep);
  if (rc) return rc;
  if (rep.status != 0) rc = rep.status;
  else if (rep.kind != WIRE_ADMIN_COMPACT || rep.id != req.id) rc = GMB_E_PROTO;
  else *out = rep.u.compact;
  gmb__wire_reply_clear(&rep);
  return rc;
}

int harness_tenant_row(const struct harness_broker *b, const char *tenant,
                       struct wire_tenant_row *out) {
  struct wire_reply rep;
  int rc = harness_admin_status(b, &rep);
  if (rc) return rc;
  rc = GMB_E_NOENT;
  for (size_t i = 0; i < rep.u.admin_status.n_tenants; i++)
    if (strcmp(rep.u.admin_status.tenants[i].name, tenant) == 0) {
      *out = rep.u.admin_status.tenants[i];
      rc = 0;
    }
  gmb__wire_reply_clear(&rep);
  return rc;
}

uint64_t harness_sleep_offer(const struct harness_broker *b,
                             const char *tenant) {
  struct wire_reply rep;
  if (harness_admin_status(b, &rep)) return 0;
  uint64_t most = 0;
  for (size_t i = 0; i < rep.u.admin_status.n_sessions; i++) {
    const struct wire_session_row *s = &rep.u.admin_status.session_rows[i];
    if (strcmp(s->tenant, tenant) == 0 && s->sleep_pausable > most)
      most = s->sleep_pausable;
  }
  gmb__wire_reply_clear(&rep);
  return most;
}

/* --- jobs driven over pipes ----------------------------------------------- */

void harness_job_open(struct harness_job *j) {
  ck_assert_int_eq(pipe(j->to), 0);
  ck_assert_int_eq(pipe(j->from), 0);
  j->pid = -1;
}

void harness_job_start(struct harness_job *j, int (*fn)(void *arg),
                       void *arg) {
  j->pid = harness_fork(fn, arg);
  int got = harness_pipe_wait(j->from[0], HARNESS_WAIT_MS);
  ck_assert_msg(got == 'r', "the job did not start (it said %d; exit %d)",
                got, got == 'r' ? 0 : harness_wait(j->pid));
}

int harness_job_ask(struct harness_job *j, char cmd) {
  harness_pipe_send(j->to[1], cmd);
  return harness_pipe_wait(j->from[0], HARNESS_WAIT_MS);
}

void harness_job_close(struct harness_job *j) {
  for (int i = 0; i < 2; i++) {
    close(j->to[i]);
    close(j->from[i]);
  }
}

void harness_job_end(struct harness_job *j) {
  harness_pipe_send(j->to[1], 'q');
  ck_assert_int_eq(harness_wait(j->pid), 0);
  harness_job_close(j);
}

/* --- main ------------------------------------------------------------------- */

int harness_main(Suite *s) {
  /* A client blocked on a dead broker must not take SIGPIPE. */
  signal(SIGPIPE, SIG_IGN);
  /* Brokers orphaned by a failed test come here to be waited for. */
  prctl(PR_SET_CHILD_SUBREAPER, 1);
  void *m = mmap(NULL, HARNESS_MAX_BROKERS * sizeof *harness_regs,
                 PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (m != MAP_FAILED) {
    memset(m, 0, HARNESS_MAX_BROKERS * sizeof *harness_regs);
    harness_regs = m;
  }
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  int left = harness_sweep();
  if (left && failed == 0) {
    fprintf(stderr, "%d broker(s) were left running by passing tests\n",
            left);
    failed = 1;
  }
  return failed == 0 ? 0 : 1;
}

/* --- what most tests repeat ----------------------------------------------- */

gmb_client *harness_connect_ok(const struct harness_broker *b,
                               const char *tenant) {
  gmb_client *c = NULL;
  int rc = gmb_connect(b->endpoint, tenant, &c);
  ck_assert_msg(rc == 0, "gmb_connect(%s) = %s: %s", tenant, gmb_err_name(rc),
                gmb_last_error(NULL));
  ck_assert_ptr_nonnull(c);
  return c;
}

gmb_stats harness_stats_ok(gmb_client *c) {
  gmb_stats st;
  memset(&st, 0xff, sizeof st);
  int rc = gmb_tenant_stats(c, &st);
  ck_assert_msg(rc == 0, "gmb_tenant_stats = %s: %s", gmb_err_name(rc),
                gmb_last_error(c));
  return st;
}

gmb_id harness_alloc_ok(gmb_client *c, uint64_t size) {
  gmb_id id = 0;
  int rc = gmb_alloc(c, size, 0, &id);
  ck_assert_msg(rc == 0, "gmb_alloc(%llu) = %s: %s", (unsigned long long)size,
                gmb_err_name(rc), gmb_last_error(c));
  return id;
}

uint64_t harness_rnd(uint64_t *s) {
  *s ^= *s >> 12;
  *s ^= *s << 25;
  *s ^= *s >> 27;
  return *s * 0x2545f4914f6cdd1dull;
}

size_t harness_count(const char *hay, const char *needle) {
  size_t n = 0;
  for (const char *p = hay; (p = strstr(p, needle)) != NULL; p++) n++;
  return n;
}

#define HARNESS_TOOL_ARGS 12

/* argv = bin, the `pre` prefix, then ap's arguments up to a NULL. */
static int harness_tool_va(const char *tool, const char *const *pre, int npre,
                           char *out, size_t cap, va_list ap) {
  char bin[PATH_MAX];
  snprintf(bin, sizeof bin, "%s/%s", harness_build_dir(), tool);
  char *argv[1 + 2 + HARNESS_TOOL_ARGS + 1];
  int n = 0;
  argv[n++] = bin;
  for (int i = 0; i < npre; i++) argv[n++] = (char *)pre[i];
  char *a;
  int extra = 0;
  while ((a = va_arg(ap, char *)) != NULL) {
    ck_assert_msg(extra++ < HARNESS_TOOL_ARGS, "%s: too many arguments", tool);
    argv[n++] = a;
  }
  argv[n] = NULL;
  return harness_run(argv, out, cap);
}

int harness_tool(const char *tool, char *out, size_t cap, ...) {
  va_list ap;
  va_start(ap, cap);
  int rc = harness_tool_va(tool, NULL, 0, out, cap, ap);
  va_end(ap);
  return rc;
}

int harness_ctl(const struct harness_broker *b, char *out, size_t cap, ...) {
  const char *pre[] = {"--run-dir", b->dir};
  va_list ap;
  va_start(ap, cap);
  int rc = harness_tool_va("gmbctl", pre, 2, out, cap, ap);
  va_end(ap);
  return rc;
}

Suite *harness_suite(const char *name, const char *tcase, double timeout_s,
                     const TTest *const tests[]) {
  Suite *s = suite_create(name);
  TCase *tc = tcase_create(tcase);
  if (timeout_s > 0) tcase_set_timeout(tc, timeout_s);
  for (size_t i = 0; tests[i] != NULL; i++) tcase_add_test(tc, tests[i]);
  suite_add_tcase(s, tc);
  return s;
}

int harness_fds_of(pid_t pid) {
  char dir[64];
  snprintf(dir, sizeof dir, "/proc/%d/fd", (int)pid);
  DIR *d = opendir(dir);
  ck_assert_msg(d != NULL, "%s: %s", dir, strerror(errno));
  int n = 0;
  for (struct dirent *e; (e = readdir(d)) != NULL;)
    if (e->d_name[0] != '.') n++;
  closedir(d);
  return n;
}

/* --- HTTP ------------------------------------------------------------------ */

int harness_free_port(void) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {.sin_family = AF_INET,
                          .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t len = sizeof a;
  ck_assert_int_eq(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
  ck_assert_int_eq(getsockname(fd, (struct sockaddr *)&a, &len), 0);
  close(fd);
  return ntohs(a.sin_port);
}

/* One HTTP/1.0 request on connected socket fd (closed here): the status
 * code, 0 when nothing that reads as HTTP came back; the body in `body`.
 * No ck_assert: children use it. */
static int harness_http_exchange(int fd, const char *method, const char *path,
                                 char *body, size_t cap) {
  char req[32768];
  int n = snprintf(req, sizeof req, "%s %s HTTP/1.0\r\nHost: localhost\r\n\r\n",
                   method, path);
  if (n < 0 || (size_t)n >= sizeof req || write(fd, req, (size_t)n) != n) {
    close(fd);
    return 0;
  }
  static char resp[1 << 20];
  size_t got = 0;
  for (;;) {
    struct pollfd p = {fd, POLLIN, 0};
    if (poll(&p, 1, HARNESS_WAIT_MS) <= 0) break;
    ssize_t r = read(fd, resp + got, sizeof resp - 1 - got);
    if (r <= 0) break;
    got += (size_t)r;
  }
  close(fd);
  resp[got] = '\0';
  int code = 0;
  if (sscanf(resp, "HTTP/1.%*d %d", &code) != 1) return 0;
  char *b = strstr(resp, "\r\n\r\n");
  snprintf(body, cap, "%s", b ? b + 4 : "");
  return code;
}

int harness_http_get(int port, const char *method, const char *path,
                    char *body, size_t cap) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {.sin_family = AF_INET,
                          .sin_port = htons((uint16_t)port),
                          .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
    close(fd);
    return 0;
  }
  return harness_http_exchange(fd, method, path, body, cap);
}

int harness_http_unix(const char *sock, const char *method, const char *path,
                      char *body, size_t cap) {
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  struct sockaddr_un a = {.sun_family = AF_UNIX};
  snprintf(a.sun_path, sizeof a.sun_path, "%s", sock);
  if (fd < 0 || connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
    if (fd >= 0) close(fd);
    return -errno;
  }
  return harness_http_exchange(fd, method, path, body, cap);
}
