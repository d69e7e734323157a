/*
 * util.c - sizes, the run directory, tenant names, the clock.
 */
#include "util.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

#include "gmb.h"

static const struct {
  const char *name;
  uint64_t mult;
} util_units[] = {
    {"", 1},          {"b", 1},          {"k", GMB_KIB},    {"kb", GMB_KIB},
    {"kib", GMB_KIB}, {"m", GMB_MIB},    {"mb", GMB_MIB},   {"mib", GMB_MIB},
    {"g", GMB_GIB},   {"gb", GMB_GIB},   {"gib", GMB_GIB},  {"t", GMB_TIB},
    {"tb", GMB_TIB},  {"tib", GMB_TIB},
};

int gmb__size_parse(const char *s, uint64_t *out) {
  if (s == NULL) return GMB_E_INVAL;
  while (isspace((unsigned char)*s)) s++;
  if (!isdigit((unsigned char)*s)) return GMB_E_INVAL; /* no sign, no empty */
  const char *p = s;
  uint64_t whole = 0;
  while (isdigit((unsigned char)*p)) {
    unsigned d = (unsigned)(*p - '0');
    if (whole > (UINT64_MAX - d) / 10) return GMB_E_INVAL;
    whole = whole * 10 + d;
    p++;
  }
  /* A fraction: kept as digits so that "0.5GiB" is exact. */
  uint64_t frac_num = 0, frac_den = 1;
  int has_frac = 0;
  if (*p == '.') {
    has_frac = 1;
    p++;
    if (!isdigit((unsigned char)*p)) return GMB_E_INVAL;
    while (isdigit((unsigned char)*p)) {
      if (frac_den < UINT64_C(1000000000)) {
        frac_num = frac_num * 10 + (uint64_t)(*p - '0');
        frac_den *= 10;
      }
      p++;
    }
  }
  while (isspace((unsigned char)*p)) p++;
  const char *unit = p;
  size_t ulen = strlen(unit);
  while (ulen && isspace((unsigned char)unit[ulen - 1])) ulen--;
  for (size_t i = 0; i < sizeof util_units / sizeof util_units[0]; i++) {
    if (strlen(util_units[i].name) != ulen ||
        strncasecmp(unit, util_units[i].name, ulen) != 0)
      continue;
    uint64_t m = util_units[i].mult;
    if (has_frac && m == 1) return GMB_E_INVAL; /* half a byte */
    if (whole > UINT64_MAX / m) return GMB_E_INVAL;
    uint64_t v = whole * m;
    if (has_frac) {
      /* m is a power of two up to 2^40 and frac_den <= 10^9, so m / den
       * first would lose bits; m * num fits since num < den <= 10^9. */
      unsigned __int128 f = (unsigned __int128)m * frac_num / frac_den;
      if (v > UINT64_MAX - (uint64_t)f) return GMB_E_INVAL;
      v += (uint64_t)f;
    }
    *out = v;
    return 0;
  }
  return GMB_E_INVAL;
}

char *gmb__size_format(uint64_t v, char *buf, size_t cap) {
  static const char *names[] = {"B", "KiB", "MiB", "GiB", "TiB"};
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
  double d = (double)v;
  i = 0;
  /* 1023.995 and up would print as "1024.00": go up a unit instead, so
   * that 1 GiB - 1 reads "1.00GiB", not "1024.00MiB". */
  while (i < 4 && d >= 1023.995) {
    d /= 1024.0;
    i++;
  }
  snprintf(buf, cap, "%.2f%s", d, names[i]);
  return buf;
}

char *gmb__run_dir(char *buf, size_t cap) {
  const char *env = getenv("GMB_RUN_DIR");
  int n;
  if (env && *env)
    n = snprintf(buf, cap, "%s", env);
  else if (geteuid() == 0)
    n = snprintf(buf, cap, "/run/gmb");
  else if ((env = getenv("XDG_RUNTIME_DIR")) && *env)
    n = snprintf(buf, cap, "%s/gmb", env);
  else
    n = snprintf(buf, cap, "/tmp/gmb-%u", (unsigned)geteuid());
  if (n < 0 || (size_t)n >= cap) return NULL;
  return buf;
}

int gmb__gpu_uuid_valid(const char *s) {
  if (s == NULL || (strncmp(s, "GPU-", 4) != 0 && strncmp(s, "MIG-", 4) != 0))
    return 0;
  size_t n = 4;
  for (const char *p = s + 4; *p; p++, n++)
    if (n >= 63 || !(isxdigit((unsigned char)*p) || *p == '-')) return 0;
  return n > 4;
}

char *gmb__run_dir_gpu(const char *base, const char *uuid, char *buf,
                       size_t cap) {
  char dir[256];
  if (!gmb__gpu_uuid_valid(uuid)) return NULL;
  if (base == NULL && (base = gmb__run_dir(dir, sizeof dir)) == NULL)
    return NULL;
  int n = snprintf(buf, cap, "%s/%s", base, uuid);
  if (n < 0 || (size_t)n >= cap) return NULL;
  return buf;
}

int gmb__name_valid(const char *name) {
  size_t n = 0;
  if (name == NULL || name[0] == '\0' || name[0] == '.' || name[0] == '-')
    return 0;
  for (const char *p = name; *p; p++, n++) {
    if (n >= 63) return 0;
    if (!isalnum((unsigned char)*p) && *p != '.' && *p != '_' && *p != '-')
      return 0;
  }
  return 1;
}

uint64_t gmb__now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * GMB_NS_PER_S + (uint64_t)ts.tv_nsec;
}
