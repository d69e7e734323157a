/*
 * check_device_host.c - the device layer and its host (memfd)
 * implementation: each segment is a memfd with a descriptor of its own
 * (seg->fd), sealed against shrinking and growing, mapped by the broker
 * (seg->host) and by a client from a copy of the descriptor (SCM_RIGHTS,
 * as the descriptor channel sends it), closed at seg_free, and never
 * named in /dev/shm; copies move bytes, the capacity holds, and device
 * specs that mean nothing are refused with a clear reason.
 */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check_main.h"
#include "device.h"
#include "fdpass.h"
#include "gmb.h"
#include "util.h"

#define SEG GMB_SEGMENT_ALIGN

static struct gmb_device *open_ok(const char *spec, uint64_t capacity) {
  struct gmb_device *d = NULL;
  char err[256] = "";
  int rc = gmb__device_open(spec, capacity, 0, &d, err, sizeof err);
  ck_assert_msg(rc == 0, "%s: %s (%s)", spec, gmb_err_name(rc), err);
  ck_assert_ptr_nonnull(d);
  return d;
}

/* A copy of seg's descriptor as a client receives it: sent with
 * SCM_RIGHTS over a socket pair. */
static int fd_passed(const struct gmb_dseg *seg) {
  int sv[2];
  ck_assert_int_eq(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv),
                   0);
  char msg = 'S';
  ck_assert_int_eq(gmb__fd_send(sv[0], &msg, 1, seg->fd, 0), 0);
  int fd = -1;
  char got = 0;
  ck_assert_int_eq(gmb__fd_recv(sv[1], &got, 1, &fd, 0), 1);
  ck_assert_int_ge(fd, 0);
  ck_assert_int_ne(fd, seg->fd);
  close(sv[0]);
  close(sv[1]);
  return fd;
}

/* Maps a segment the way a client does: from a copy of its descriptor,
 * which is a sealed file of the segment's size. */
static void *client_map(const struct gmb_dseg *seg) {
  int fd = fd_passed(seg);
  struct stat st;
  ck_assert_int_eq(fstat(fd, &st), 0);
  ck_assert(S_ISREG(st.st_mode));
  ck_assert_uint_eq((uint64_t)st.st_size, seg->size);
  ck_assert_int_eq(fcntl(fd, F_GET_SEALS),
                   F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
  void *p = mmap(NULL, seg->size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ck_assert_ptr_ne(p, MAP_FAILED);
  close(fd);
  return p;
}

/* 1 when descriptor fd is the memfd called `name`. */
static int fd_is_memfd(int fd, const char *name) {
  char path[64], link[256], want[128];
  snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
  ssize_t n = readlink(path, link, sizeof link - 1);
  if (n < 0) return 0;
  link[n] = '\0';
  snprintf(want, sizeof want, "/memfd:%s ", name);
  return strncmp(link, want, strlen(want)) == 0;
}

START_TEST(segment_visible_to_second_mapping) {
  int shm_before = check_shm_names();
  struct gmb_device *d = open_ok("host:8MiB", 0);
  ck_assert_str_eq(d->ops->kind, "host");
  int fds_before = check_count_fds();
  struct gmb_dseg seg;
  ck_assert_int_eq(gmb__device_seg_new(d, 7, SEG, &seg), 0);
  ck_assert_uint_eq(seg.id, 7);
  ck_assert_ptr_nonnull(seg.host);
  ck_assert_int_ge(seg.fd, 0);
  ck_assert_int_eq(fd_is_memfd(seg.fd, "gmb-seg-7"), 1);
  ck_assert_int_eq(fcntl(seg.fd, F_GETFD) & FD_CLOEXEC, FD_CLOEXEC);
  ck_assert_int_eq(check_count_fds(), fds_before + 1);
  ck_assert_int_eq(check_shm_names(), shm_before);

  unsigned char *b = seg.host;
  for (uint64_t i = 0; i < SEG; i += 4096) b[i] = (unsigned char)(i >> 12);
  b[SEG - 1] = 0xAB;
  unsigned char *c = client_map(&seg);
  for (uint64_t i = 0; i < SEG; i += 4096)
    ck_assert_uint_eq(c[i], (unsigned char)(i >> 12));
  ck_assert_uint_eq(c[SEG - 1], 0xAB);
  c[100] = 0x5A; /* and the other way round */
  ck_assert_uint_eq(b[100], 0x5A);

  /* After seg_free the descriptor is closed but the client's mapping still
   * works (the kernel counts its references). */
  int fd = seg.fd;
  gmb__device_seg_free(d, &seg);
  ck_assert_int_eq(seg.fd, -1);
  ck_assert_ptr_null(seg.host);
  ck_assert_int_eq(fd_is_memfd(fd, "gmb-seg-7"), 0);
  ck_assert_int_eq(check_count_fds(), fds_before);
  ck_assert_uint_eq(c[SEG - 1], 0xAB);
  munmap(c, SEG);
  ck_assert_uint_eq(d->in_use, 0);
  gmb__device_close(d);
  ck_assert_int_eq(check_shm_names(), shm_before);
}
END_TEST

/* seg->fd is the segment: a mapping of it (the broker's own descriptor)
 * reads and writes the same bytes as seg->host, at every offset. */
START_TEST(fd_maps_same_bytes_as_host) {
  struct gmb_device *d = open_ok("host:16MiB", 0);
  struct gmb_dseg seg;
  ck_assert_int_eq(gmb__device_seg_new(d, 3, 2 * SEG, &seg), 0);
  unsigned char *h = seg.host;
  unsigned char *m = mmap(NULL, seg.size, PROT_READ | PROT_WRITE, MAP_SHARED,
                          seg.fd, 0);
  ck_assert_ptr_ne(m, MAP_FAILED);
  ck_assert_ptr_ne(m, h); /* two mappings... */
  for (uint64_t i = 0; i < seg.size; i += 4093) h[i] = (unsigned char)(i * 13);
  for (uint64_t i = 0; i < seg.size; i += 4093)
    ck_assert_uint_eq(m[i], (unsigned char)(i * 13)); /* ...one memory */
  m[seg.size - 1] = 0xC3;
  ck_assert_uint_eq(h[seg.size - 1], 0xC3);
  /* A copy through the device lands in both views. */
  memset(h, 0x11, 4096);
  ck_assert_int_eq(gmb__device_copy(d, &seg, SEG, &seg, 0, 4096), 0);
  ck_assert_uint_eq(m[SEG], 0x11);
  ck_assert_uint_eq(m[SEG + 4095], 0x11);
  /* And what pread sees through the descriptor is the same too. */
  unsigned char byte = 0;
  ck_assert_int_eq(pread(seg.fd, &byte, 1, (off_t)seg.size - 1), 1);
  ck_assert_uint_eq(byte, 0xC3);
  munmap(m, seg.size);
  gmb__device_seg_free(d, &seg);
  gmb__device_close(d);
}
END_TEST

/* Whoever holds a segment's descriptor (any client of its tenant) cannot
 * resize it: shrinking would make the broker's next copy fault (SIGBUS). */
START_TEST(segment_sealed_against_resize) {
  struct gmb_device *d = open_ok("host:8MiB", 0);
  struct gmb_dseg seg;
  ck_assert_int_eq(gmb__device_seg_new(d, 9, SEG, &seg), 0);
  int fds[2] = {seg.fd, fd_passed(&seg)};
  for (int i = 0; i < 2; i++) {
    int fd = fds[i];
    ck_assert_int_eq(fcntl(fd, F_GET_SEALS),
                     F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
    static const off_t sizes[] = {0, 4096, SEG - 1, SEG + 1, 2 * SEG};
    for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
      errno = 0;
      ck_assert_int_eq(ftruncate(fd, sizes[k]), -1);
      ck_assert_int_eq(errno, EPERM);
    }
    errno = 0;
    ck_assert_int_eq(fallocate(fd, 0, SEG, 4096), -1);
    ck_assert_int_eq(errno, EPERM);
    errno = 0;
    ck_assert_int_eq(fcntl(fd, F_ADD_SEALS, F_SEAL_WRITE), -1);
    ck_assert_int_eq(errno, EPERM);
    struct stat st;
    ck_assert_int_eq(fstat(fd, &st), 0);
    ck_assert_uint_eq((uint64_t)st.st_size, SEG);
  }
  close(fds[1]);
  /* The broker still reads and writes all of it. */
  ((unsigned char *)seg.host)[SEG - 1] = 1;
  ck_assert_int_eq(gmb__device_copy(d, &seg, 0, &seg, SEG - 4096, 4096), 0);
  gmb__device_seg_free(d, &seg);
  gmb__device_close(d);
}
END_TEST

/* One descriptor per live segment, each closed at seg_free, and none of
 * them named in /dev/shm. */
START_TEST(one_fd_per_segment_closed_at_free) {
  int shm_before = check_shm_names();
  struct gmb_device *d = open_ok("host:64MiB", 0);
  int fds_before = check_count_fds();
  enum { N = 20 };
  struct gmb_dseg s[N];
  for (int i = 0; i < N; i++) {
    ck_assert_int_eq(gmb__device_seg_new(d, (uint64_t)i + 100, SEG, &s[i]), 0);
    for (int j = 0; j < i; j++) ck_assert_int_ne(s[i].fd, s[j].fd);
  }
  ck_assert_int_eq(check_count_fds(), fds_before + N);
  ck_assert_int_eq(check_shm_names(), shm_before);
  /* Every other one, then the rest. */
  for (int i = 0; i < N; i += 2) gmb__device_seg_free(d, &s[i]);
  ck_assert_int_eq(check_count_fds(), fds_before + N / 2);
  for (int i = 1; i < N; i += 2) gmb__device_seg_free(d, &s[i]);
  ck_assert_int_eq(check_count_fds(), fds_before);
  /* A refused segment opens nothing either. */
  struct gmb_dseg big;
  ck_assert_int_eq(gmb__device_seg_new(d, 1, 128 * GMB_MIB, &big),
                   GMB_E_NOMEM);
  ck_assert_int_eq(check_count_fds(), fds_before);
  gmb__device_close(d);
  ck_assert_int_eq(check_shm_names(), shm_before);
}
END_TEST

/* A segment's descriptor does not leak into programs the broker would
 * start (close-on-exec), and a copy a client gets is its own (closing it
 * leaves the broker's). */
START_TEST(fd_closed_on_exec) {
  struct gmb_device *d = open_ok("host:8MiB", 0);
  struct gmb_dseg seg;
  ck_assert_int_eq(gmb__device_seg_new(d, 1, SEG, &seg), 0);
  fflush(stderr);
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0) {
    char cmd[64];
    /* exit 0 when the descriptor is not open in the new program */
    snprintf(cmd, sizeof cmd, "test ! -e /proc/self/fd/%d", seg.fd);
    execl("/bin/sh", "sh", "-c", cmd, (char *)NULL);
    _exit(127);
  }
  int status;
  ck_assert_int_eq(waitpid(pid, &status, 0), pid);
  ck_assert(WIFEXITED(status));
  ck_assert_int_eq(WEXITSTATUS(status), 0);
  int copy = fd_passed(&seg);
  close(copy);
  ck_assert_int_ne(fcntl(seg.fd, F_GETFD), -1);
  gmb__device_seg_free(d, &seg);
  gmb__device_close(d);
}
END_TEST

START_TEST(copy_moves_bytes) {
  struct gmb_device *d = open_ok("host:16MiB", 0);
  struct gmb_dseg a, b;
  ck_assert_int_eq(gmb__device_seg_new(d, 1, SEG, &a), 0);
  ck_assert_int_eq(gmb__device_seg_new(d, 2, 2 * SEG, &b), 0);
  unsigned char *pa = a.host, *pb = b.host;
  for (int i = 0; i < 10000; i++) pa[4096 + i] = (unsigned char)(i * 7 + 3);
  ck_assert_int_eq(gmb__device_copy(d, &b, 3 * GMB_MIB, &a, 4096, 10000), 0);
  for (int i = 0; i < 10000; i++)
    ck_assert_uint_eq(pb[3 * GMB_MIB + (uint64_t)i],
                      (unsigned char)(i * 7 + 3));
  ck_assert_uint_eq(pb[3 * GMB_MIB + 10000], 0); /* nothing past len */

  /* Within one segment, non-overlapping ranges are fine. */
  ck_assert_int_eq(gmb__device_copy(d, &a, 0, &a, 4096, 4096), 0);
  for (int i = 0; i < 4096; i++)
    ck_assert_uint_eq(pa[i], (unsigned char)(i * 7 + 3));
  /* Overlapping ones are refused (the CUDA driver would not promise them). */
  ck_assert_int_eq(gmb__device_copy(d, &a, 4096, &a, 6000, 4096), GMB_E_INVAL);
  /* Out of bounds, including wrap-around. */
  ck_assert_int_eq(gmb__device_copy(d, &a, SEG - 10, &b, 0, 11), GMB_E_INVAL);
  ck_assert_int_eq(gmb__device_copy(d, &a, 0, &b, 2 * SEG, 1), GMB_E_INVAL);
  ck_assert_int_eq(gmb__device_copy(d, &a, 16, &b, 0, UINT64_MAX - 8),
                   GMB_E_INVAL);
  ck_assert_int_eq(gmb__device_copy(d, &a, 0, &b, 0, 0), 0);
  gmb__device_seg_free(d, &a);
  gmb__device_seg_free(d, &b);
  gmb__device_close(d);
}
END_TEST

START_TEST(capacity_enforced) {
  struct gmb_device *d = open_ok("host:5MiB", 0); /* room for two segments */
  ck_assert_uint_eq(d->capacity, 5 * GMB_MIB);
  struct gmb_dseg s1, s2, s3;
  ck_assert_int_eq(gmb__device_seg_new(d, 1, 0, &s1), GMB_E_INVAL);
  ck_assert_int_eq(gmb__device_seg_new(d, 1, SEG + 512, &s1), GMB_E_INVAL);
  ck_assert_int_eq(gmb__device_seg_new(d, 1, 3 * SEG, &s1), GMB_E_NOMEM);
  ck_assert_int_eq(gmb__device_seg_new(d, 1, SEG, &s1), 0);
  ck_assert_int_eq(gmb__device_seg_new(d, 2, SEG, &s2), 0);
  ck_assert_uint_eq(d->in_use, 2 * SEG);
  ck_assert_uint_eq(d->segments, 2);
  ck_assert_int_eq(gmb__device_seg_new(d, 3, SEG, &s3), GMB_E_NOMEM);
  ck_assert_int_eq(gmb__device_seg_new(d, 3, UINT64_MAX - SEG + 1, &s3),
                   GMB_E_NOMEM);
  gmb__device_seg_free(d, &s1);
  ck_assert_int_eq(gmb__device_seg_new(d, 3, SEG, &s3), 0);
  gmb__device_seg_free(d, &s2);
  gmb__device_seg_free(d, &s3);
  ck_assert_uint_eq(d->in_use, 0);
  ck_assert_uint_eq(d->segments, 0);
  gmb__device_close(d);

  /* The capacity argument caps what host:SIZE offers. */
  d = open_ok("host:8MiB", 4 * GMB_MIB);
  ck_assert_uint_eq(d->capacity, 4 * GMB_MIB);
  ck_assert_str_eq(d->desc, "host:4MiB");
  gmb__device_close(d);
  d = open_ok("host:8MiB", 64 * GMB_MIB); /* a cap above is no increase */
  ck_assert_uint_eq(d->capacity, 8 * GMB_MIB);
  gmb__device_close(d);
}
END_TEST

START_TEST(auto_falls_back_to_host) {
  struct gmb_device *d = open_ok("auto", 0);
  ck_assert_str_eq(d->ops->kind, "host");
  ck_assert_uint_eq(d->capacity, GMB_GIB);
  gmb__device_close(d);
  d = open_ok("auto", 256 * GMB_MIB);
  ck_assert_uint_eq(d->capacity, 256 * GMB_MIB);
  ck_assert_str_eq(d->desc, "host:256MiB");
  gmb__device_close(d);
}
END_TEST

static void refused(const char *spec, int want, const char *msg_part) {
  struct gmb_device *d = (struct gmb_device *)0x1;
  char err[256] = "";
  int rc = gmb__device_open(spec, 0, 0, &d, err, sizeof err);
  ck_assert_msg(rc == want, "%s: got %s, want %s", spec ? spec : "(null)",
                gmb_err_name(rc), gmb_err_name(want));
  ck_assert_ptr_null(d);
  ck_assert_msg(err[0] != '\0', "%s: no reason given", spec ? spec : "(null)");
  if (msg_part)
    ck_assert_msg(strstr(err, msg_part), "%s: message '%s' lacks '%s'", spec,
                  err, msg_part);
}

START_TEST(bad_specs_refused) {
  refused("host:", GMB_E_INVAL, "host:");
  refused("host:abc", GMB_E_INVAL, "host:abc");
  refused("host:0", GMB_E_INVAL, "host:0");
  refused("host:1MiB", GMB_E_INVAL, "2MiB"); /* less than one segment */
  refused("host:-1GiB", GMB_E_INVAL, NULL);
  refused("gpu:1", GMB_E_INVAL, "gpu:1");
  refused("", GMB_E_INVAL, NULL);
  refused(NULL, GMB_E_INVAL, NULL);
  refused("cuda:", GMB_E_INVAL, NULL);
  refused("cuda:x", GMB_E_INVAL, NULL);
  /* With no driver to load, a cuda device is refused with the reason
   * (the cuda device itself is tested in check_device_cuda). */
  setenv("GMB_LIBCUDA", "/nonexistent/libcuda.so.1", 1);
  refused("cuda:0", GMB_E_DEVICE, "no CUDA driver");
  refused("cuda:3", GMB_E_DEVICE, "no CUDA driver");
  unsetenv("GMB_LIBCUDA");
}
END_TEST

START_TEST(segments_are_sparse) {
  /* A big device costs nothing until written: 1 GiB of segments, touched
   * on one page each, must not need 1 GiB of memory. */
  struct gmb_device *d = open_ok("host:1GiB", 0);
  enum { N = 512 };
  static struct gmb_dseg s[N];
  for (int i = 0; i < N; i++) {
    ck_assert_int_eq(gmb__device_seg_new(d, (uint64_t)i + 1, SEG, &s[i]), 0);
    ((char *)s[i].host)[0] = 1;
  }
  ck_assert_uint_eq(d->in_use, GMB_GIB);
  struct stat st;
  ck_assert_int_eq(fstat(s[0].fd, &st), 0);
  ck_assert_uint_eq((uint64_t)st.st_size, SEG);
  ck_assert_uint_lt((uint64_t)st.st_blocks * 512, SEG); /* one page used */
  for (int i = 0; i < N; i++) gmb__device_seg_free(d, &s[i]);
  gmb__device_close(d);
}
END_TEST

static Suite *device_host_suite(void) {
  Suite *s = suite_create("device_host");
  TCase *tc = tcase_create("device_host");
  tcase_add_test(tc, segment_visible_to_second_mapping);
  tcase_add_test(tc, copy_moves_bytes);
  tcase_add_test(tc, capacity_enforced);
  tcase_add_test(tc, auto_falls_back_to_host);
  tcase_add_test(tc, bad_specs_refused);
  tcase_add_test(tc, fd_maps_same_bytes_as_host);
  tcase_add_test(tc, segment_sealed_against_resize);
  tcase_add_test(tc, one_fd_per_segment_closed_at_free);
  tcase_add_test(tc, fd_closed_on_exec);
  tcase_add_test(tc, segments_are_sparse);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) { return check_run(device_host_suite()); }
