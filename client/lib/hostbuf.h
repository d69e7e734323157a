/*
 * hostbuf.h - host memory for the bytes gmb_pause offloads (the cache's
 * tags, cache_sleep.c, and tagged gmb_alloc allocations, alloc_tags.c):
 * pinned on a GPU, reused from one pause to the next.  Process-wide and
 * thread-safe.  Internal to the client library.
 */
#ifndef GMB_HOSTBUF_H
#define GMB_HOSTBUF_H
#include <stddef.h>
#include <stdint.h>

/* A buffer of at least n bytes (contents undefined), or NULL out of host
 * memory.  Pinned (cuMemHostAlloc) once a CUDA device is attached in the
 * process, else, or when pinning is refused (one line on stderr, once),
 * pageable.  A buffer kept from an earlier gmb__hostbuf_free is reused
 * when one fits.  Freed with gmb__hostbuf_free only. */
void *gmb__hostbuf_alloc(size_t n);

/* Gives back what gmb__hostbuf_alloc gave (NULL: nothing): kept for reuse
 * within GMB_HOST_KEEP bytes, else freed. */
void gmb__hostbuf_free(void *p);

/* Frees every kept buffer (none is in use by the caller). */
void gmb__hostbuf_release(void);

/* The figures, for tests and benchmarks. */
struct gmb_hostbuf_stats {
  uint64_t pinned;    /* bytes of pinned buffers now (in use and kept) */
  uint64_t pageable;  /* bytes of pageable buffers now */
  uint64_t kept;      /* of those: bytes kept for reuse */
  uint64_t reused;    /* allocations served from a kept buffer */
  uint64_t refused;   /* pinnings the driver refused */
};
void gmb__hostbuf_stats(struct gmb_hostbuf_stats *out);

#endif
