/*
 * check_device_host.c - the device layer and its host (POSIX shm)
 * implementation: segments are real shared memory that a second process
 * can map by name, copies move bytes, the capacity holds, and device specs
 * that mean nothing are refused with a clear reason.
 */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "check_main.h"
#include "device.h"
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

/* Maps a segment the way a client does: by the name in its handle. */
static void *client_map(const struct gmb_dseg *seg) {
  char name[GMB_DEVICE_HANDLE_MAX + 1];
  ck_assert_uint_lt(seg->handle_len, sizeof name);
  memcpy(name, seg->handle, seg->handle_len);
  name[seg->handle_len] = '\0';
  int fd = shm_open(name, O_RDWR, 0);
  ck_assert_msg(fd >= 0, "shm_open %s: %s", name, strerror(errno));
  struct stat st;
  ck_assert_int_eq(fstat(fd, &st), 0);
  ck_assert_uint_eq((uint64_t)st.st_size, seg->size);
  ck_assert_uint_eq(st.st_mode & 0777, 0600);
  void *p = mmap(NULL, seg->size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ck_assert_ptr_ne(p, MAP_FAILED);
  close(fd);
  return p;
}

START_TEST(segment_visible_to_second_mapping) {
  struct gmb_device *d = open_ok("host:8MiB", 0);
  ck_assert_str_eq(d->ops->kind, "host");
  struct gmb_dseg seg;
  ck_assert_int_eq(gmb__device_seg_new(d, 7, SEG, &seg), 0);
  ck_assert_uint_eq(seg.id, 7);
  ck_assert_ptr_nonnull(seg.host);
  char want[64];
  snprintf(want, sizeof want, "/gmb-%ld-7", (long)getpid());
  ck_assert_uint_eq(seg.handle_len, strlen(want));
  ck_assert_int_eq(memcmp(seg.handle, want, seg.handle_len), 0);

  unsigned char *b = seg.host;
  for (uint64_t i = 0; i < SEG; i += 4096) b[i] = (unsigned char)(i >> 12);
  b[SEG - 1] = 0xAB;
  unsigned char *c = client_map(&seg);
  for (uint64_t i = 0; i < SEG; i += 4096)
    ck_assert_uint_eq(c[i], (unsigned char)(i >> 12));
  ck_assert_uint_eq(c[SEG - 1], 0xAB);
  c[100] = 0x5A; /* and the other way round */
  ck_assert_uint_eq(b[100], 0x5A);

  /* After seg_free the name is gone but the client's mapping still works. */
  gmb__device_seg_free(d, &seg);
  char name[64];
  memcpy(name, want, strlen(want) + 1);
  errno = 0;
  ck_assert_int_eq(shm_open(name, O_RDWR, 0), -1);
  ck_assert_int_eq(errno, ENOENT);
  ck_assert_uint_eq(c[SEG - 1], 0xAB);
  munmap(c, SEG);
  ck_assert_uint_eq(d->in_use, 0);
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

/* A root broker hands a segment to the client's uid; any other broker
 * serves its own uid only and leaves the owner alone. */
START_TEST(grant_owner) {
  struct gmb_device *d = open_ok("host:4MiB", 0);
  struct gmb_dseg s;
  ck_assert_int_eq(gmb__device_seg_new(d, 1, SEG, &s), 0);
  char path[64 + GMB_DEVICE_HANDLE_MAX];
  snprintf(path, sizeof path, "/dev/shm/%.*s", (int)s.handle_len,
           (const char *)s.handle);
  uid_t to = geteuid() == 0 ? 65534 : geteuid();
  ck_assert_int_eq(gmb__device_grant(d, &s, to, 65534), 0);
  struct stat st;
  ck_assert_int_eq(stat(path, &st), 0);
  ck_assert_uint_eq(st.st_uid, to);
  gmb__device_seg_free(d, &s);
  gmb__device_close(d);
}
END_TEST

START_TEST(segments_are_sparse) {
  /* A big device costs nothing until written: 1 GiB of segments, touched
   * on one page each, must not need 1 GiB of /dev/shm. */
  struct gmb_device *d = open_ok("host:1GiB", 0);
  enum { N = 512 };
  static struct gmb_dseg s[N];
  for (int i = 0; i < N; i++) {
    ck_assert_int_eq(gmb__device_seg_new(d, (uint64_t)i + 1, SEG, &s[i]), 0);
    ((char *)s[i].host)[0] = 1;
  }
  ck_assert_uint_eq(d->in_use, GMB_GIB);
  char name[GMB_DEVICE_HANDLE_MAX + 1];
  memcpy(name, s[0].handle, s[0].handle_len);
  name[s[0].handle_len] = '\0';
  int fd = shm_open(name, O_RDONLY, 0);
  ck_assert_int_ge(fd, 0);
  struct stat st;
  ck_assert_int_eq(fstat(fd, &st), 0);
  close(fd);
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
  tcase_add_test(tc, grant_owner);
  tcase_add_test(tc, segments_are_sparse);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) { return check_run(device_host_suite()); }
