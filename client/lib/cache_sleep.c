/*
 * cache_sleep.c - tags of the cache and their sleep and wake: a tag is an
 * arena of its own (after the cache's untagged arenas in k->arena, made
 * at the first use of its name, never removed), and gmb__cache_pause
 * gives back every page of that arena, its bytes first copied to host
 * memory or discarded, while the address ranges and the blocks cut from
 * them stay as they are; gmb__cache_resume maps new pages at the same
 * addresses and copies the bytes back.
 *
 * States of a tag arena (a->state, under a->mu): RUNNING; PAUSING (a
 * pause is copying with no lock held: allocations fail, frees are taken,
 * trims leave the arena alone, so no page is mapped, unmapped or moved
 * under the copy); PAUSED (no page mapped; the pages the pause gave back
 * are marked `saved` and listed in a->sleep with their host copies);
 * RESUMING (a resume maps and copies with no lock held; as PAUSED
 * otherwise).  A free while paused is bookkeeping only (blocks and page
 * users change, no page does): the page stays saved and is mapped again
 * at the resume, idle then if nothing lies on it any more.
 *
 * Invariants (gmb__cache_check): a paused arena maps no page, and marks
 * saved exactly the pages that a running one would have mapped (under
 * blocks that are not VIRT or LOST); a->sleep exists exactly in PAUSED
 * and RESUMING and lists those pages; the host copies' bytes add up to
 * k->host_held, which stays within k->host_quota.
 *
 * Locks: k->sleep_mu makes pauses and resumes one at a time; it is taken
 * before any arena lock.  Messages to the broker (page_map, page_free)
 * and copies are made with no arena lock held.
 */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cache.h"
#include "cache_impl.h"
#include "gmb.h"
#include "hostbuf.h"

/* The tag arena named `tag`, or NULL.  With `make`, made when missing
 * (*rc: GMB_E_LIMIT past CACHE_MAX_TAGS). */
static struct cache_arena *sleep_tag(struct gmb_cache *k, const char *tag,
                                     int make, unsigned *idx, int *rc) {
  *rc = 0;
  pthread_mutex_lock(&k->tag_mu);
  unsigned all = cache_arenas(k);
  for (unsigned i = k->n; i < all; i++)
    if (strcmp(k->arena[i].tag, tag) == 0) {
      pthread_mutex_unlock(&k->tag_mu);
      *idx = i;
      return &k->arena[i];
    }
  struct cache_arena *a = NULL;
  if (!make) {
    *rc = GMB_E_NOENT;
  } else if (all - k->n >= CACHE_MAX_TAGS) {
    *rc = GMB_E_LIMIT;
  } else {
    a = &k->arena[all];
    pthread_mutex_init(&a->mu, NULL);
    strcpy(a->tag, tag);
    *idx = all;
    /* Published after it is made: cache_arenas readers see it whole. */
    atomic_store_explicit(&k->ntags, all - k->n + 1, memory_order_release);
  }
  pthread_mutex_unlock(&k->tag_mu);
  return a;
}

int gmb__cache_tag_set(struct gmb_cache *k, const char *tag) {
  if (k == NULL) return GMB_E_INVAL;
  if (tag == NULL || tag[0] == '\0') {
    gmb__cache_tls_set(k, 0);
    return 0;
  }
  if (strlen(tag) > GMB_CACHE_TAG_MAX) return GMB_E_INVAL;
  unsigned idx;
  int rc;
  if (sleep_tag(k, tag, 1, &idx, &rc) == NULL) return rc;
  gmb__cache_tls_set(k, idx);
  return 0;
}

const char *gmb__cache_tag_paused(struct gmb_cache *k) {
  unsigned idx = k ? gmb__cache_tls_idx(k) : 0;
  if (idx == 0) return NULL;
  struct cache_arena *a = &k->arena[idx];
  pthread_mutex_lock(&a->mu);
  int asleep = a->state != CACHE_RUNNING;
  pthread_mutex_unlock(&a->mu);
  return asleep ? a->tag : NULL;
}

void gmb__cache_host_quota_set(struct gmb_cache *k, uint64_t bytes) {
  if (k) k->host_quota = bytes;
}

int gmb__cache_tag_now(struct gmb_cache *k) {
  unsigned idx = k ? gmb__cache_tls_idx(k) : 0;
  return idx == 0 ? -1 : (int)(idx - k->n);
}

int gmb__cache_tag_find(struct gmb_cache *k, const char *tag) {
  unsigned idx;
  int rc;
  if (k == NULL || tag == NULL) return GMB_E_NOENT;
  return sleep_tag(k, tag, 0, &idx, &rc) ? (int)(idx - k->n) : rc;
}

const char *gmb__cache_tag_name(struct gmb_cache *k, int ord) {
  if (k == NULL || ord < 0 || (unsigned)ord >= cache_arenas(k) - k->n)
    return NULL;
  return k->arena[k->n + (unsigned)ord].tag;
}

void gmb__cache_sleep_free(struct gmb_cache *k, struct cache_arena *a) {
  struct cache_sleep *z = a->sleep;
  if (z == NULL) return;
  atomic_fetch_sub(&k->host_held, z->host);
  gmb__hostbuf_free(z->buf);
  free(z->pages);
  free(z);
  a->sleep = NULL;
}

/* Takes `bytes` of the host quota: 0, or GMB_E_LIMIT with nothing taken. */
static int sleep_host_take(struct gmb_cache *k, uint64_t bytes) {
  uint64_t held = atomic_load(&k->host_held);
  do {
    if (k->host_quota && (held > k->host_quota ||
                          bytes > k->host_quota - held))
      return GMB_E_LIMIT;
  } while (!atomic_compare_exchange_weak(&k->host_held, &held, held + bytes));
  return 0;
}

/* Under sleep_mu, so that gmb__cache_check sees the two figures agree. */
int gmb__cache_host_take(struct gmb_cache *k, uint64_t bytes) {
  pthread_mutex_lock(&k->sleep_mu);
  int rc = sleep_host_take(k, bytes);
  if (rc == 0) atomic_fetch_add(&k->host_others, bytes);
  pthread_mutex_unlock(&k->sleep_mu);
  return rc;
}

void gmb__cache_host_give(struct gmb_cache *k, uint64_t bytes) {
  pthread_mutex_lock(&k->sleep_mu);
  atomic_fetch_sub(&k->host_others, bytes);
  atomic_fetch_sub(&k->host_held, bytes);
  pthread_mutex_unlock(&k->sleep_mu);
}

/* Copies the saved pages that have a host copy, in runs of neighbours
 * (one call per run: the driver's copy is faster in large pieces).  0 or
 * the backend's code. */
static int sleep_copy(struct gmb_cache *k, const struct cache_sleep *z,
                      int to_device) {
  for (uint64_t i = 0; i < z->n;) {
    if (z->pages[i].host == NULL) {
      i++;
      continue;
    }
    uint64_t j = i + 1;
    while (j < z->n && z->pages[j].host &&
           z->pages[j].addr == z->pages[j - 1].addr + k->page &&
           z->pages[j].host == z->pages[j - 1].host + k->page)
      j++;
    uint64_t n = (j - i) * k->page;
    int rc = 0;
    if (k->ops.copy)
      rc = k->ops.copy(k->ops.ctx, z->pages[i].addr, z->pages[i].host, n,
                       to_device);
    else if (to_device)
      memcpy((void *)z->pages[i].addr, z->pages[i].host, n);
    else
      memcpy(z->pages[i].host, (const void *)z->pages[i].addr, n);
    if (rc) return rc;
    i = j;
  }
  return 0;
}

/* Gives back pg[0..n) in messages of up to GMB_CACHE_BATCH pages. */
static void sleep_page_free(struct gmb_cache *k, const struct gmb_cache_page *pg,
                            uint64_t n) {
  for (uint64_t i = 0; i < n; i += GMB_CACHE_BATCH)
    k->ops.page_free(k->ops.ctx, pg + i,
                     n - i < GMB_CACHE_BATCH ? (unsigned)(n - i)
                                             : GMB_CACHE_BATCH);
}

static int sleep_abort(struct gmb_cache *k, struct cache_arena *a,
                       struct cache_sleep *z, int rc);

/* Tells the backend (the broker) of a tag's state, when it listens. */
static int sleep_note(struct gmb_cache *k, struct cache_arena *a, int paused,
                      int mode, uint64_t host, uint64_t device, int by) {
  return k->ops.note ? k->ops.note(k->ops.ctx, a->tag, paused, mode, host,
                                   device, by)
                     : 0;
}

/* Back to RUNNING after a pause that failed before it unmapped anything
 * (`noted`: the broker was told it paused, and is told it did not). */
static int sleep_abort_noted(struct gmb_cache *k, struct cache_arena *a,
                             struct cache_sleep *z, int rc, int noted) {
  if (noted) sleep_note(k, a, 0, 0, 0, 0, 0);
  return sleep_abort(k, a, z, rc);
}

static int sleep_abort(struct gmb_cache *k, struct cache_arena *a,
                       struct cache_sleep *z, int rc) {
  if (z) {
    atomic_fetch_sub(&k->host_held, z->host);
    gmb__hostbuf_free(z->buf);
    free(z->pages);
    free(z);
  }
  pthread_mutex_lock(&a->mu);
  a->state = CACHE_RUNNING;
  pthread_mutex_unlock(&a->mu);
  return rc;
}

/* The pause proper, with sleep_mu held and a PAUSING. */
static int sleep_pause(struct gmb_cache *k, struct cache_arena *a, int mode,
                       int by) {
  /* A miss in flight maps pages with no lock held: wait for it (it is as
   * long as one request to the broker). */
  pthread_mutex_lock(&a->mu);
  while (a->inflight) {
    pthread_mutex_unlock(&a->mu);
    nanosleep(&(struct timespec){0, 100 * 1000}, NULL);
    pthread_mutex_lock(&a->mu);
  }
  pthread_mutex_unlock(&a->mu);
  /* The device's work on the tag's blocks must be done before their bytes
   * are copied and their pages go; it also makes every free block's
   * stream done, so that the idle pages can go back below. */
  if (k->ops.sync) {
    int rc = k->ops.sync(k->ops.ctx);
    if (rc) return sleep_abort(k, a, NULL, rc);
  }
  /* Idle pages hold nothing worth keeping: they go back as a trim's do
   * (the range becomes VIRT) rather than being saved. */
  for (;;) {
    struct gmb_cache_page pg[GMB_CACHE_BATCH];
    pthread_mutex_lock(&a->mu);
    unsigned n = gmb__cache_trim_arena(k, a, GMB_CACHE_BATCH, pg);
    pthread_mutex_unlock(&a->mu);
    if (n == 0) break;
    k->ops.page_free(k->ops.ctx, pg, n);
  }
  /* The pages left, in address order per span; those with blocks in use
   * are copied.  No page is mapped or unmapped meanwhile (PAUSING). */
  struct cache_sleep *z = calloc(1, sizeof *z);
  if (z == NULL) return sleep_abort(k, a, NULL, GMB_E_SYSTEM);
  pthread_mutex_lock(&a->mu);
  uint64_t n = a->mapped, copied = 0;
  z->pages = n ? calloc(n, sizeof *z->pages) : NULL;
  for (struct cache_span *s = a->spans; s && (z->pages || !n); s = s->next)
    for (uint64_t p = 0; p < s->npages; p++)
      if (s->page[p].pg.id && z->n < n) {
        z->pages[z->n].addr = s->base + (p << k->shift);
        /* A stand-in for the host address, made real below. */
        z->pages[z->n].host = s->page[p].users && mode == GMB_CACHE_OFFLOAD
                                  ? (char *)(uintptr_t)(++copied)
                                  : NULL;
        z->n++;
      }
  pthread_mutex_unlock(&a->mu);
  if (n && z->pages == NULL) return sleep_abort(k, a, z, GMB_E_SYSTEM);
  if (copied) {
    int rc = sleep_host_take(k, copied * k->page);
    if (rc) return sleep_abort(k, a, z, rc);
    z->host = copied * k->page;
  }
  /* The broker hears of it before the copy: the tenant's host_quota may
   * refuse it (nothing done yet). */
  int rc = sleep_note(k, a, 1, mode, z->host, z->n * k->page, by);
  if (rc) return sleep_abort(k, a, z, rc);
  if (copied) {
    z->buf = gmb__hostbuf_alloc(z->host);
    if (z->buf == NULL) return sleep_abort_noted(k, a, z, GMB_E_SYSTEM, 1);
    for (uint64_t i = 0; i < z->n; i++)
      if (z->pages[i].host)
        z->pages[i].host = z->buf + ((uintptr_t)z->pages[i].host - 1) * k->page;
    rc = sleep_copy(k, z, 0);
    if (rc) return sleep_abort_noted(k, a, z, rc, 1);
  }
  /* Every page unmapped and given back; the addresses stay reserved. */
  struct gmb_cache_page *gone = n ? calloc(n, sizeof *gone) : NULL;
  if (n && gone == NULL) return sleep_abort_noted(k, a, z, GMB_E_SYSTEM, 1);
  pthread_mutex_lock(&a->mu);
  for (uint64_t i = 0; i < z->n; i++) {
    struct cache_span *s = a->spans;
    while (z->pages[i].addr - s->base >= s->size) s = s->next;
    struct cache_page *pg = cache_pg(k, s, z->pages[i].addr);
    k->ops.page_unmap(k->ops.ctx, z->pages[i].addr, &pg->pg);
    gone[i] = pg->pg;
    memset(&pg->pg, 0, sizeof pg->pg);
    pg->saved = 1;
  }
  cache_totals(k, -(int64_t)(a->mapped * k->page),
               -(int64_t)(a->idle * k->page), 0);
  a->page_frees += a->mapped;
  a->mapped = a->idle = 0;
  a->sleep = z;
  a->state = CACHE_PAUSED;
  a->paused_by = (uint8_t)by;
  pthread_mutex_unlock(&a->mu);
  sleep_page_free(k, gone, n);
  free(gone);
  return 0;
}

/* Finds the arena of `tag` (*ap) and takes sleep_mu; moves the arena from
 * state `from` to `to`: 1 when it was in `from`, 0 when not (nothing to
 * do; sleep_mu is held either way), or GMB_E_NOENT for no such tag (no
 * lock held). */
static int sleep_enter(struct gmb_cache *k, const char *tag, int from, int to,
                       struct cache_arena **ap) {
  unsigned idx;
  int rc;
  struct cache_arena *a = sleep_tag(k, tag, 0, &idx, &rc);
  if (a == NULL) return rc;
  pthread_mutex_lock(&k->sleep_mu);
  pthread_mutex_lock(&a->mu);
  int moved = a->state == from;
  if (moved) a->state = (uint8_t)to;
  pthread_mutex_unlock(&a->mu);
  *ap = a;
  return moved;
}

int gmb__cache_by_rank(int by) {
  return by == GMB_CACHE_BY_APP ? 2 : by == GMB_CACHE_BY_OPERATOR ? 1 : 0;
}

int gmb__cache_claim(struct gmb_cache *k, const char *tag, int by) {
  unsigned idx;
  int rc;
  struct cache_arena *a = sleep_tag(k, tag, 0, &idx, &rc);
  if (a == NULL) return rc;
  /* state and paused_by are a->mu's: a resume under way has made the
   * arena RESUMING, and is left alone. */
  pthread_mutex_lock(&a->mu);
  int claim = a->state == CACHE_PAUSED &&
              gmb__cache_by_rank(by) > gmb__cache_by_rank(a->paused_by);
  if (claim) a->paused_by = (uint8_t)by;
  pthread_mutex_unlock(&a->mu);
  return claim;
}

int gmb__cache_pause(struct gmb_cache *k, const char *tag, int mode) {
  return gmb__cache_pause_by(k, tag, mode, GMB_CACHE_BY_APP, NULL);
}

int gmb__cache_pause_by(struct gmb_cache *k, const char *tag, int mode,
                        int by, int *paused_now) {
  if (paused_now) *paused_now = 0;
  if (k == NULL || tag == NULL || tag[0] == '\0' ||
      (mode != GMB_CACHE_OFFLOAD && mode != GMB_CACHE_DISCARD) ||
      by < GMB_CACHE_BY_APP || by > GMB_CACHE_BY_OPERATOR)
    return GMB_E_INVAL;
  struct cache_arena *a;
  int rc = sleep_enter(k, tag, CACHE_RUNNING, CACHE_PAUSING, &a);
  if (rc < 0) return rc;
  if (rc == 0) { /* paused already (by whoever): nothing changes */
    pthread_mutex_unlock(&k->sleep_mu);
    return 0;
  }
  /* Who pauses it is known from now on (gmb__cache_tag_info), so that a
   * thread that finds it pausing knows whether it may resume it. */
  pthread_mutex_lock(&a->mu);
  a->paused_by = (uint8_t)by;
  pthread_mutex_unlock(&a->mu);
  rc = sleep_pause(k, a, mode, by);
  pthread_mutex_unlock(&k->sleep_mu);
  if (rc == 0 && paused_now) *paused_now = 1;
  return rc;
}

/* Maps pages at the saved addresses, in runs of neighbours of up to
 * GMB_CACHE_BATCH (one request each), into pg[].  0, or the backend's
 * code with nothing mapped (what was, unmapped and given back). */
static int sleep_map(struct gmb_cache *k, const struct cache_sleep *z,
                     struct gmb_cache_page *pg) {
  uint64_t i = 0;
  int rc = 0, trimmed = 0;
  while (i < z->n) {
    unsigned r = 1;
    while (r < GMB_CACHE_BATCH && i + r < z->n &&
           z->pages[i + r].addr == z->pages[i].addr + (uint64_t)r * k->page)
      r++;
    rc = k->ops.page_map(k->ops.ctx, z->pages[i].addr, r,
                         (z->n - i - r) * k->page, &pg[i]);
    if ((rc == GMB_E_QUOTA || rc == GMB_E_NOMEM) && !trimmed) {
      /* The other arenas' idle pages go back first, as for a miss. */
      uint64_t released = 0;
      trimmed = 1;
      gmb__cache_trim(k, 0, 0, &released);
      if (released) continue;
    }
    if (rc) break;
    i += r;
  }
  if (rc == 0) return 0;
  for (uint64_t j = 0; j < i; j++)
    k->ops.page_unmap(k->ops.ctx, z->pages[j].addr, &pg[j]);
  sleep_page_free(k, pg, i);
  return rc;
}

int gmb__cache_resume(struct gmb_cache *k, const char *tag) {
  if (k == NULL || tag == NULL || tag[0] == '\0') return GMB_E_INVAL;
  struct cache_arena *a;
  int rc = sleep_enter(k, tag, CACHE_PAUSED, CACHE_RESUMING, &a);
  if (rc <= 0) {
    if (rc == 0) pthread_mutex_unlock(&k->sleep_mu); /* not paused */
    return rc;
  }
  struct cache_sleep *z = a->sleep; /* stays while RESUMING */
  struct gmb_cache_page *pg = z->n ? calloc(z->n, sizeof *pg) : NULL;
  rc = z->n && pg == NULL ? GMB_E_SYSTEM : 0;
  if (rc == 0) rc = sleep_map(k, z, pg);
  if (rc == 0) {
    rc = sleep_copy(k, z, 1);
    if (rc) {
      for (uint64_t j = 0; j < z->n; j++)
        k->ops.page_unmap(k->ops.ctx, z->pages[j].addr, &pg[j]);
      sleep_page_free(k, pg, z->n);
    }
  }
  pthread_mutex_lock(&a->mu);
  if (rc) {
    a->state = CACHE_PAUSED; /* the host copy is kept: try again later */
  } else {
    uint64_t idle = 0;
    for (uint64_t i = 0; i < z->n; i++) {
      struct cache_span *s = a->spans;
      while (z->pages[i].addr - s->base >= s->size) s = s->next;
      struct cache_page *p = cache_pg(k, s, z->pages[i].addr);
      p->pg = pg[i];
      p->saved = 0;
      idle += p->users == 0; /* its blocks were freed while paused */
    }
    a->mapped += z->n;
    a->idle += idle;
    a->page_maps += z->n;
    cache_totals(k, (int64_t)(z->n * k->page), (int64_t)(idle * k->page), 0);
    gmb__cache_sleep_free(k, a);
    a->state = CACHE_RUNNING;
  }
  pthread_mutex_unlock(&a->mu);
  /* Running again: the broker's account of it goes (a refusal of this
   * note changes nothing here: the tag runs). */
  if (rc == 0) sleep_note(k, a, 0, 0, 0, 0, 0);
  pthread_mutex_unlock(&k->sleep_mu);
  free(pg);
  return rc;
}

unsigned gmb__cache_tag_info(struct gmb_cache *k,
                             struct gmb_cache_tag_info *out, unsigned cap) {
  if (k == NULL) return 0;
  unsigned all = cache_arenas(k), n = 0;
  for (unsigned i = k->n; i < all; i++, n++) {
    if (n >= cap) continue;
    struct cache_arena *a = &k->arena[i];
    pthread_mutex_lock(&a->mu);
    snprintf(out[n].tag, sizeof out[n].tag, "%s", a->tag);
    out[n].running = a->state == CACHE_RUNNING;
    out[n].by = a->state != CACHE_RUNNING ? a->paused_by : GMB_CACHE_BY_APP;
    out[n].mapped = a->mapped * k->page;
    pthread_mutex_unlock(&a->mu);
  }
  return n;
}
