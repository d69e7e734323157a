/*
 * size.h - sizes as the examples read and print them ("512MiB", "4096"),
 * with nothing but the C library.  An example includes gmb.h alone and
 * links only the installed libgmb, as a user's program would, so it
 * brings its own few lines for this rather than the broker's internals.
 *
 * A size is a decimal number of bytes, or a whole number and a binary unit:
 * K, M, G or T, alone or followed by B or iB, in any case ("256MiB",
 * "2g", "64 KB").  Fractions ("1.5GiB") are not accepted here.  A size is
 * printed in the largest unit that holds it exactly ("3GiB", "1000B"),
 * else with two decimals ("1.50GiB").
 */
#ifndef GMB_EXAMPLE_SIZE_H
#define GMB_EXAMPLE_SIZE_H

#include <ctype.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define SIZE_BUFSZ 32

/* 0 with *out set, or -1: no digits, a sign, an unknown unit, overflow. */
static inline int size_parse(const char *s, uint64_t *out) {
  while (isspace((unsigned char)*s)) s++;
  if (!isdigit((unsigned char)*s)) return -1;
  char *p;
  errno = 0;
  uint64_t n = strtoull(s, &p, 10);
  if (errno == ERANGE) return -1;
  while (isspace((unsigned char)*p)) p++;
  static const char units[] = "kmgt";
  const char *u = *p ? strchr(units, tolower((unsigned char)*p)) : NULL;
  int shift = 0;
  if (u) {
    shift = 10 * (int)(u - units + 1);
    p++;
    if (tolower((unsigned char)p[0]) == 'i' &&
        tolower((unsigned char)p[1]) == 'b')
      p++;
  }
  if (tolower((unsigned char)*p) == 'b') p++;
  while (isspace((unsigned char)*p)) p++;
  if (*p || n > UINT64_MAX >> shift) return -1;
  *out = n << shift;
  return 0;
}

/* Writes v into buf (SIZE_BUFSZ bytes will do); returns buf. */
static inline char *size_format(uint64_t v, char *buf, size_t cap) {
  static const char *const names[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int i = 0;
  uint64_t x = v;
  while (i < 4 && x >= 1024 && x % 1024 == 0) {
    x /= 1024;
    i++;
  }
  if (i > 0 || v < 1024) {
    snprintf(buf, cap, "%llu%s", (unsigned long long)x, names[i]);
    return buf;
  }
  /* From 1023.995 up, "%.2f" would print 1024.00: take the next unit. */
  double d = (double)v;
  for (i = 0; i < 4 && d >= 1023.995; i++) d /= 1024.0;
  snprintf(buf, cap, "%.2f%s", d, names[i]);
  return buf;
}

#endif /* GMB_EXAMPLE_SIZE_H */
