/*
 * fuzz.h - what the libFuzzer targets in tests/fuzz/ share.
 *
 * The parsers under test read files by path, so an input is written to one
 * anonymous memfd that lives as long as the fuzzer, and the parser opens
 * it as /proc/self/fd/N: nothing is written to disk, nothing is named, and
 * every open starts at offset 0.  FZ_ASSERT is an invariant the input must
 * never break: it says which and aborts, which libFuzzer reports as a
 * crash with the input that caused it.
 */
#ifndef GMB_FUZZ_H
#define GMB_FUZZ_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#define FZ_ASSERT(cond)                                                   \
  do {                                                                    \
    if (!(cond)) {                                                        \
      fprintf(stderr, "fuzz: %s:%d: invariant broken: %s\n", __FILE__,    \
              __LINE__, #cond);                                           \
      abort();                                                            \
    }                                                                     \
  } while (0)

/* Writes the input to the fuzzer's memfd; returns a path that opens it. */
static inline const char *fz_file(const uint8_t *data, size_t len) {
  static int fd = -1;
  static char path[64];
  if (fd < 0) {
    fd = memfd_create("gmb-fuzz", MFD_CLOEXEC);
    FZ_ASSERT(fd >= 0);
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
  }
  FZ_ASSERT(ftruncate(fd, 0) == 0);
  size_t done = 0;
  while (done < len) {
    ssize_t w = pwrite(fd, data + done, len - done, (off_t)done);
    FZ_ASSERT(w > 0);
    done += (size_t)w;
  }
  return path;
}

/* 1 when s is NUL-terminated within cap bytes. */
static inline int fz_terminated(const char *s, size_t cap) {
  for (size_t i = 0; i < cap; i++)
    if (s[i] == '\0') return 1;
  return 0;
}

#endif /* GMB_FUZZ_H */
