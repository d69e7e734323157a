/*
 * bench_import.c - what importing a host segment costs a client: receiving
 * its descriptor over the descriptor channel and mapping it (how gmb shares
 * memory now), beside opening a named POSIX shm object and mapping it (how
 * version 1 did), measured in the same run.
 *
 * For each size (2 MiB, the small segments; 256 MiB, a large one):
 *   - shm_open: shm_open(name) + fstat + mmap + munmap + close of an object
 *     this process created, as a version-1 client did for every segment;
 *   - fd_recv: a SEQPACKET round trip (request, reply + SCM_RIGHTS of a
 *     sealed memfd, both ends in this process, as the channel's messages
 *     are) + fstat + F_GET_SEALS + mmap + munmap + close, as
 *     client_fetch_segment and segmap_map_host do now.
 * The two alternate in BENCH_ROUNDS rounds (default 5) of BENCH_ITER
 * imports each (default 2000), so load from elsewhere falls on both; the
 * figure is the ratio of the medians of the rounds' means.  Neither maps a
 * page in (mapping is lazy): the pages cost the same either way.
 *
 * Output: "key=value" lines (docs/benchmarks.md).  Exit status 0, or 1
 * when a system call failed.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fdpass.h"
#include "util.h"

#define BENCH_MAX_ROUNDS 32

static long bench_env(const char *name, long def) {
  const char *v = getenv(name);
  char *end;
  long n = v ? strtol(v, &end, 10) : 0;
  return v && *v && *end == '\0' && n > 0 ? n : def;
}

static void bench_die(const char *what) {
  fprintf(stderr, "bench_import: %s: %s\n", what, strerror(errno));
  exit(1);
}

static int bench_cmp(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static double bench_median(double *v, int n) {
  qsort(v, (size_t)n, sizeof *v, bench_cmp);
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/* One version-1 import: the object by name. */
static void bench_shm_once(const char *name, size_t size) {
  int fd = shm_open(name, O_RDWR | O_CLOEXEC, 0);
  if (fd < 0) bench_die("shm_open");
  struct stat st;
  if (fstat(fd, &st) != 0 || (size_t)st.st_size < size) bench_die("fstat");
  void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) bench_die("mmap");
  munmap(p, size);
  close(fd);
}

/* One import now: ask, receive the descriptor, check, map. */
static void bench_fd_once(int cli, int srv, int memfd, size_t size) {
  struct gmb_fd_req req = {.magic = GMB_FD_MAGIC, .op = GMB_FD_SEGMENT,
                           .segment = 1};
  struct gmb_fd_rep rep = {.magic = GMB_FD_MAGIC, .op = GMB_FD_SEGMENT,
                           .segment = 1, .size = size};
  int got = -1;
  if (gmb__fd_send(cli, &req, sizeof req, -1, 0) != 0) bench_die("send");
  if (gmb__fd_recv(srv, &req, sizeof req, &got, 0) != sizeof req)
    bench_die("recv request");
  if (gmb__fd_send(srv, &rep, sizeof rep, memfd, 0) != 0) bench_die("reply");
  if (gmb__fd_recv(cli, &rep, sizeof rep, &got, 0) != sizeof rep || got < 0)
    bench_die("recv reply");
  struct stat st;
  int seals = fcntl(got, F_GET_SEALS);
  if (fstat(got, &st) != 0 || (size_t)st.st_size < size ||
      !(seals & F_SEAL_SHRINK))
    bench_die("fstat");
  void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, got, 0);
  if (p == MAP_FAILED) bench_die("mmap");
  munmap(p, size);
  close(got);
}

int main(void) {
  long iter = bench_env("BENCH_ITER", 2000);
  int rounds = (int)bench_env("BENCH_ROUNDS", 5);
  if (rounds > BENCH_MAX_ROUNDS) rounds = BENCH_MAX_ROUNDS;
  static const size_t sizes[] = {2u << 20, 256u << 20};
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) != 0)
    bench_die("socketpair");
  printf("bench_import: %d rounds of %ld imports of each kind\n", rounds,
         iter);
  for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
    size_t size = sizes[k];
    char name[64];
    snprintf(name, sizeof name, "/gmb-bench-import-%ld", (long)getpid());
    int shm = shm_open(name, O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
    if (shm < 0 || ftruncate(shm, (off_t)size) != 0) bench_die("shm");
    int memfd = memfd_create("gmb-bench", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (memfd < 0 || ftruncate(memfd, (off_t)size) != 0 ||
        fcntl(memfd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) != 0)
      bench_die("memfd");
    double shm_us[BENCH_MAX_ROUNDS], fd_us[BENCH_MAX_ROUNDS];
    for (int r = 0; r < rounds; r++) {
      uint64_t t0 = gmb__now_ns();
      for (long i = 0; i < iter; i++) bench_shm_once(name, size);
      uint64_t t1 = gmb__now_ns();
      for (long i = 0; i < iter; i++) bench_fd_once(sv[0], sv[1], memfd, size);
      uint64_t t2 = gmb__now_ns();
      shm_us[r] = (double)(t1 - t0) / 1e3 / (double)iter;
      fd_us[r] = (double)(t2 - t1) / 1e3 / (double)iter;
    }
    double s = bench_median(shm_us, rounds), f = bench_median(fd_us, rounds);
    printf("import.size_mib=%zu shm_open_us=%.2f fd_recv_us=%.2f "
           "ratio=%.2f\n", size >> 20, s, f, f / s);
    shm_unlink(name);
    close(shm);
    close(memfd);
  }
  close(sv[0]);
  close(sv[1]);
  return 0;
}
