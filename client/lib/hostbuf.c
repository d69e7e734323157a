/*
 * hostbuf.c - host memory for the bytes gmb_pause offloads: the copies of
 * a cache tag's pages (cache_sleep.c) and of tagged gmb_alloc
 * allocations (alloc_tags.c).
 *
 * On a GPU those copies are cuMemcpyDtoH/HtoD, which run at the bus's
 * speed only between device memory and pinned (page-locked) host memory:
 * a pageable buffer goes through the driver's staging buffers, and its
 * fresh pages fault in one by one during the copy.  So once a CUDA device
 * is attached in the process, a buffer is pinned memory
 * (cuMemHostAlloc, portable).  Pinning is limited (RLIMIT_MEMLOCK in
 * containers, the host's RAM): when the driver refuses, the buffer is
 * pageable and one line on stderr says why, once per process.  On the
 * host device a buffer is pageable; one of 2 MiB or more is its own
 * mapping, aligned to 2 MiB, advised huge pages and populated in one call
 * (MADV_POPULATE_WRITE) rather than faulted in 4 KiB at a time by the
 * copy.
 *
 * Pinning a buffer costs more than the copy it speeds up (the driver locks
 * and maps every page), and a fresh pageable buffer costs its page faults,
 * so a freed buffer is kept for the next pause (a job that sleeps once
 * usually sleeps again, the same tags at the same sizes), up to
 * GMB_HOST_KEEP bytes (a size, read at the first use; default 1 GiB; 0
 * keeps none), the oldest freed first when more must go.  Kept bytes are
 * not paused bytes: host_quota and gmb_cache_stats.host do not count them.
 * A pinning the driver refuses frees the kept buffers and tries once more.
 *
 * Every buffer handed out or kept is in `hb_tree` by address, with its
 * size and kind; the kept ones are also on `hb_kept`, oldest first.
 * Invariants (under hb_mu): hb_kept_bytes is the sum of the kept buffers'
 * sizes and stays within the limit; a buffer is on hb_kept exactly when
 * `kept` is set.  No driver call is made under hb_mu.
 */
#ifndef __unused
#define __unused __attribute__((__unused__))
#endif
#include "hostbuf.h"

#include <bsd/sys/tree.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>

#include "cuimport.h"
#include "gmb.h"
#include "util.h"

#define HB_HUGE (UINT64_C(2) << 20)
#define HB_KEEP_DEFAULT (UINT64_C(1) << 30)

enum { HB_MALLOC, HB_MMAP, HB_PINNED };

struct hb {
  RB_ENTRY(hb) rb;
  char *p;
  size_t size;  /* what the buffer holds (a request may have been less) */
  int kind;     /* HB_* */
  int ordinal;  /* HB_PINNED: the device that pinned it */
  int kept;
  struct hb *next; /* on hb_kept */
};

static int hb_cmp(const struct hb *a, const struct hb *b) {
  return (a->p > b->p) - (a->p < b->p);
}

RB_HEAD(hb_tree, hb);
RB_GENERATE_STATIC(hb_tree, hb, rb, hb_cmp)

static pthread_mutex_t hb_mu = PTHREAD_MUTEX_INITIALIZER;
static struct hb_tree hb_all = RB_INITIALIZER(&hb_all);
static struct hb *hb_kept; /* oldest first */
static uint64_t hb_kept_bytes, hb_limit, hb_pinned, hb_pageable, hb_reused,
    hb_refused;
static int hb_limit_read, hb_warned;

/* Under hb_mu. */
static uint64_t hb_keep_limit(void) {
  if (!hb_limit_read) {
    hb_limit_read = 1;
    hb_limit = HB_KEEP_DEFAULT;
    const char *s = getenv("GMB_HOST_KEEP");
    uint64_t v;
    if (s && s[0]) {
      if (gmb__size_parse(s, &v) == 0)
        hb_limit = v;
      else
        fprintf(stderr, "gmb: GMB_HOST_KEEP=%s is not a size (such as "
                "512MiB): %llu bytes kept\n", s,
                (unsigned long long)hb_limit);
    }
  }
  return hb_limit;
}

/* Frees the memory of e (not in the tree any more); no lock held. */
static void hb_drop(struct hb *e) {
  if (e->kind == HB_PINNED)
    gmb__cuda_host_free(e->ordinal, e->p);
  else if (e->kind == HB_MMAP)
    munmap(e->p, e->size);
  else
    free(e->p);
  free(e);
}

/* Takes e out of the tree and its figure, onto the list *gone (for
 * hb_drop_list).  Under hb_mu. */
static void hb_unlink(struct hb *e, struct hb **gone) {
  RB_REMOVE(hb_tree, &hb_all, e);
  if (e->kind == HB_PINNED)
    hb_pinned -= e->size;
  else
    hb_pageable -= e->size;
  e->next = *gone;
  *gone = e;
}

/* Takes kept buffers off hb_kept (oldest first) until `room` more bytes
 * fit within `limit`; returns them as a list for hb_drop_list.  Under
 * hb_mu. */
static struct hb *hb_evict(uint64_t room, uint64_t limit) {
  struct hb *gone = NULL;
  while (hb_kept && (room > limit || hb_kept_bytes > limit - room)) {
    struct hb *e = hb_kept;
    hb_kept = e->next;
    hb_kept_bytes -= e->size;
    hb_unlink(e, &gone);
  }
  return gone;
}

static void hb_drop_list(struct hb *l) {
  while (l) {
    struct hb *next = l->next;
    hb_drop(l);
    l = next;
  }
}

/* A kept buffer that fits n (the smallest of at least n and at most 2n),
 * off the kept list; or NULL.  Under hb_mu. */
static struct hb *hb_reuse(size_t n) {
  struct hb **best = NULL;
  for (struct hb **pp = &hb_kept; *pp; pp = &(*pp)->next)
    if ((*pp)->size >= n && (*pp)->size / 2 <= n &&
        (best == NULL || (*pp)->size < (*best)->size))
      best = pp;
  if (best == NULL) return NULL;
  struct hb *e = *best;
  *best = e->next;
  e->next = NULL;
  e->kept = 0;
  hb_kept_bytes -= e->size;
  hb_reused++;
  return e;
}

/* Pageable memory of n bytes into e; 0 or -1. */
static int hb_pageable_new(struct hb *e, size_t n) {
  if (n < HB_HUGE) {
    e->kind = HB_MALLOC;
    e->p = malloc(n ? n : 1);
    e->size = n;
    return e->p ? 0 : -1;
  }
  /* Its own mapping, 2 MiB aligned: the slack before and after goes. */
  size_t size = (n + HB_HUGE - 1) & ~(size_t)(HB_HUGE - 1);
  char *m = mmap(NULL, size + HB_HUGE, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) return -1;
  char *p = (char *)(((uintptr_t)m + HB_HUGE - 1) & ~(uintptr_t)(HB_HUGE - 1));
  if (p > m) munmap(m, (size_t)(p - m));
  if (m + size + HB_HUGE > p + size)
    munmap(p + size, (size_t)(m + size + HB_HUGE - (p + size)));
  /* Huge pages, faulted in by one call: on a VM a fault can cost as much
   * as copying its page, and one per 4 KiB page made a fresh buffer's
   * first offload 40 times slower than the copy into it. */
#ifdef MADV_HUGEPAGE
  (void)madvise(p, size, MADV_HUGEPAGE);
#endif
#ifdef MADV_POPULATE_WRITE
  (void)madvise(p, size, MADV_POPULATE_WRITE);
#endif
  e->kind = HB_MMAP;
  e->p = p;
  e->size = size;
  return 0;
}

void *gmb__hostbuf_alloc(size_t n) {
  pthread_mutex_lock(&hb_mu);
  struct hb *e = hb_reuse(n);
  pthread_mutex_unlock(&hb_mu);
  if (e) return e->p;
  e = calloc(1, sizeof *e);
  if (e == NULL) return NULL;
  char why[256];
  void *p = NULL;
  int rc = gmb__cuda_host_alloc(n ? n : 1, &p, &e->ordinal, why, sizeof why);
  if (rc == GMB_E_DEVICE) {
    /* Kept buffers hold memory the driver may want: they go first. */
    pthread_mutex_lock(&hb_mu);
    struct hb *gone = hb_evict(UINT64_MAX, 0);
    pthread_mutex_unlock(&hb_mu);
    if (gone) {
      hb_drop_list(gone);
      rc = gmb__cuda_host_alloc(n ? n : 1, &p, &e->ordinal, why, sizeof why);
    }
  }
  int warn = 0;
  if (rc == 0) {
    e->kind = HB_PINNED;
    e->p = p;
    e->size = n;
  } else {
    if (rc == GMB_E_DEVICE) {
      pthread_mutex_lock(&hb_mu);
      hb_refused++;
      warn = !hb_warned;
      hb_warned = 1;
      pthread_mutex_unlock(&hb_mu);
    }
    if (hb_pageable_new(e, n)) {
      free(e);
      return NULL;
    }
  }
  if (warn)
    fprintf(stderr, "gmb: pinned host memory for an offload of %zu bytes "
            "refused (%s): pageable memory instead, copied more slowly "
            "(said once)\n", n, why);
  pthread_mutex_lock(&hb_mu);
  RB_INSERT(hb_tree, &hb_all, e);
  if (e->kind == HB_PINNED)
    hb_pinned += e->size;
  else
    hb_pageable += e->size;
  pthread_mutex_unlock(&hb_mu);
  return e->p;
}

void gmb__hostbuf_free(void *p) {
  if (p == NULL) return;
  struct hb key = {.p = p}, *gone = NULL;
  pthread_mutex_lock(&hb_mu);
  struct hb *e = RB_FIND(hb_tree, &hb_all, &key);
  if (e == NULL || e->kept) {
    pthread_mutex_unlock(&hb_mu);
    /* Not one of ours, or freed twice: the caller's bug, and freeing
     * memory of unknown kind could only make it worse. */
    fprintf(stderr, "gmb: host buffer %p freed but not held\n", p);
    return;
  }
  uint64_t limit = hb_keep_limit();
  if (e->size <= limit) {
    gone = hb_evict(e->size, limit);
    e->kept = 1;
    e->next = NULL;
    struct hb **tail = &hb_kept;
    while (*tail) tail = &(*tail)->next;
    *tail = e;
    hb_kept_bytes += e->size;
  } else {
    hb_unlink(e, &gone);
  }
  pthread_mutex_unlock(&hb_mu);
  hb_drop_list(gone);
}

void gmb__hostbuf_release(void) {
  pthread_mutex_lock(&hb_mu);
  struct hb *gone = hb_evict(UINT64_MAX, 0);
  pthread_mutex_unlock(&hb_mu);
  hb_drop_list(gone);
}

void gmb__hostbuf_stats(struct gmb_hostbuf_stats *out) {
  pthread_mutex_lock(&hb_mu);
  *out = (struct gmb_hostbuf_stats){.pinned = hb_pinned,
                                    .pageable = hb_pageable,
                                    .kept = hb_kept_bytes,
                                    .reused = hb_reused,
                                    .refused = hb_refused};
  pthread_mutex_unlock(&hb_mu);
}
