/*
 * util.h - small pieces shared by the broker, the client library and the
 * tools: sizes as people write them ("512MiB"), the run directory, tenant
 * names, the clock.
 */
#ifndef GMB_UTIL_H
#define GMB_UTIL_H

#include <stddef.h>
#include <stdint.h>

#define GMB_KIB (UINT64_C(1) << 10)
#define GMB_MIB (UINT64_C(1) << 20)
#define GMB_GIB (UINT64_C(1) << 30)
#define GMB_TIB (UINT64_C(1) << 40)

#define GMB_NS_PER_MS UINT64_C(1000000)
#define GMB_NS_PER_S UINT64_C(1000000000)

/*
 * Parses a size: a decimal number of bytes, or a number followed by a unit
 * (B, KiB, MiB, GiB, TiB; K/M/G/T and KB/MB/GB/TB mean the same powers of
 * two, as operators expect of GPU memory).  Spaces between number and unit
 * are allowed; a fraction is allowed with a unit ("1.5GiB").  Returns 0, or
 * GMB_E_INVAL for anything else, a negative number or an overflow.
 */
int gmb__size_parse(const char *s, uint64_t *out);

/* Writes `v` as the shortest exact form ("512MiB", "3GiB", "1000B") when one
 * exists, else with two decimals ("1.50GiB").  Returns buf. */
char *gmb__size_format(uint64_t v, char *buf, size_t cap);
#define GMB_SIZE_BUFSZ 32

/* The run directory: $GMB_RUN_DIR, else /run/gmb for root, else
 * $XDG_RUNTIME_DIR/gmb, else /tmp/gmb-UID.  Returns buf, or NULL if the
 * result does not fit. */
char *gmb__run_dir(char *buf, size_t cap);

/* 1 when `s` reads as a GPU's UUID as the driver and nvidia-smi write it
 * ("GPU-" or "MIG-", then hex digits and dashes, under 64 characters), so
 * it can name a directory without reaching outside its parent. */
int gmb__gpu_uuid_valid(const char *s);

/* The run dir of the broker of GPU `uuid` on a host with one broker per
 * GPU: BASE/UUID, BASE the run directory (gmb__run_dir() when base is
 * NULL).  Returns buf, or NULL when uuid is not a UUID or the result does
 * not fit. */
char *gmb__run_dir_gpu(const char *base, const char *uuid, char *buf,
                       size_t cap);

/* 1 when `name` is a valid tenant name: 1..63 of [A-Za-z0-9._-], not
 * starting with '.' or '-'. */
int gmb__name_valid(const char *name);

/* Monotonic clock in nanoseconds. */
uint64_t gmb__now_ns(void);

/* splitmix64: the next value of the stream whose state is *s.  The seeded
 * tests, benchmarks and trace generator share it, so a seed means the same
 * sequence everywhere. */
static inline uint64_t gmb__splitmix64(uint64_t *s) {
  uint64_t z = (*s += UINT64_C(0x9e3779b97f4a7c15));
  z = (z ^ (z >> 30)) * UINT64_C(0xbf58476d1ce4e5b9);
  z = (z ^ (z >> 27)) * UINT64_C(0x94d049bb133111eb);
  return z ^ (z >> 31);
}

#endif /* GMB_UTIL_H */
