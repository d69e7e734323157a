/*
 * cache_check.c - the cache's figures (gmb__cache_counters, the walk of
 * its pages) and its invariant checker (gmb__cache_check), apart from the
 * allocator in cache.c, whose opening paragraph lists the invariants
 * checked here.  Each function takes the arenas' locks itself: one at a
 * time for the figures, all of them in index order for the checker.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cache.h"
#include "cache_impl.h"
#include "gmb.h"

void gmb__cache_counters(struct gmb_cache *k, struct gmb_cache_counters *out) {
  memset(out, 0, sizeof *out);
  if (k == NULL) return;
  for (unsigned i = 0; i < cache_arenas(k); i++) {
    struct cache_arena *a = &k->arena[i];
    pthread_mutex_lock(&a->mu);
    if (a->sleep) out->paused += a->sleep->n * k->page;
    out->hits += a->hits;
    out->misses += a->misses;
    out->slab_allocs += a->page_maps;
    out->slab_frees += a->page_frees;
    out->page_moves += a->page_moves;
    out->slabs += a->mapped;
    out->slab_bytes += a->mapped * k->page;
    out->in_use += a->in_use_req;
    /* A paused tag's blocks are still handed out (in_use) but lie on no
     * mapped page: nothing of it is cached. */
    if (a->sleep == NULL)
      out->cached += a->mapped * k->page - a->in_use_blocks;
    out->idle += a->idle * k->page;
    pthread_mutex_unlock(&a->mu);
  }
  out->peak_in_use = atomic_load(&k->peak_in_use);
  out->peak_slab_bytes = atomic_load(&k->peak_held);
  out->host = atomic_load(&k->host_held);
}

int gmb__cache_pages(struct gmb_cache *k, gmb_cache_page_fn fn, void *arg) {
  if (k == NULL) return 0;
  for (unsigned i = 0; i < cache_arenas(k); i++) {
    struct cache_arena *a = &k->arena[i];
    pthread_mutex_lock(&a->mu);
    int rc = 0;
    for (struct cache_span *s = a->spans; s && !rc; s = s->next)
      for (uint64_t p = 0; p < s->npages && !rc; p++)
        if (s->page[p].pg.id)
          rc = fn(arg, s->base + (p << k->shift), &s->page[p].pg);
    pthread_mutex_unlock(&a->mu);
    if (rc) return rc;
  }
  return 0;
}

/* The runs of mapped pages of span s: run[i] is the index of the first
 * page of page i's run (i when unmapped), end[i] one past its last. */
static void cache_span_runs(const struct cache_span *s, uint64_t *run,
                            uint64_t *end) {
  for (uint64_t i = 0; i < s->npages; i++)
    run[i] = i > 0 && s->page[i].pg.id && s->page[i - 1].pg.id ? run[i - 1]
                                                                : i;
  for (uint64_t i = s->npages; i-- > 0;)
    end[i] = i + 1 < s->npages && s->page[i].pg.id && s->page[i + 1].pg.id
                 ? end[i + 1]
                 : i + 1;
}

/* Each piece of block b on mapped pages of s, to fn. */
static int cache_block_pieces(const struct gmb_cache *k, unsigned ai,
                              const struct cache_span *s,
                              const struct cache_block *b,
                              const uint64_t *run, const uint64_t *end,
                              gmb_cache_block_fn fn, void *arg) {
  struct gmb_cache_block_info info = {0};
  info.state = cache_live(b) ? (b->pending ? GMB_CACHE_BLOCK_PENDING
                                           : GMB_CACHE_BLOCK_LIVE)
                             : GMB_CACHE_BLOCK_FREE;
  info.req = cache_live(b) ? b->req : 0;
  info.stream = b->stream;
  info.arena = ai;
  uintptr_t at = b->ptr, stop = b->ptr + b->size;
  while (at < stop) {
    uint64_t i = (at - s->base) >> k->shift;
    uintptr_t next;
    if (s->page[i].pg.id == 0) {
      next = s->base + ((i + 1) << k->shift);
    } else {
      next = s->base + (end[i] << k->shift);
      info.seg_base = s->base + (run[i] << k->shift);
      info.seg_size = (end[i] - run[i]) << k->shift;
      info.ptr = at;
      info.size = (next < stop ? next : stop) - at;
      int rc = fn(arg, &info);
      if (rc) return rc;
    }
    at = next;
  }
  return 0;
}

int gmb__cache_blocks(struct gmb_cache *k, gmb_cache_block_fn fn, void *arg) {
  if (k == NULL) return 0;
  for (unsigned i = 0; i < cache_arenas(k); i++) {
    struct cache_arena *a = &k->arena[i];
    pthread_mutex_lock(&a->mu);
    int rc = 0;
    for (struct cache_span *s = a->spans; s && !rc; s = s->next) {
      uint64_t *run = malloc(2 * s->npages * sizeof *run);
      if (run == NULL) {
        rc = GMB_E_SYSTEM;
        break;
      }
      cache_span_runs(s, run, run + s->npages);
      for (const struct cache_block *b = s->first; b && !rc; b = b->next)
        if (b->state != CACHE_VIRT && b->state != CACHE_LOST)
          rc = cache_block_pieces(k, i, s, b, run, run + s->npages, fn, arg);
      free(run);
    }
    pthread_mutex_unlock(&a->mu);
    if (rc) return rc;
  }
  return 0;
}

/* --- the checker ------------------------------------------------------------ */

#define CACHE_BAD(...)                                 \
  do {                                                 \
    fprintf(stderr, "cache_check: " __VA_ARGS__);     \
    fputc('\n', stderr);                               \
    bad++;                                             \
  } while (0)

/* The blocks and pages of one span.  Adds to the arena's sums. */
static int cache_check_span(const struct gmb_cache *k,
                            const struct cache_arena *a, unsigned ai,
                            const struct cache_span *s, uint64_t *mapped,
                            uint64_t *idle, uint64_t *in_blocks,
                            uint64_t *in_req, uint64_t *nfree, uint64_t *nout,
                            uint64_t *npend, uint64_t *nvirt,
                            uint64_t *saved) {
  int bad = 0;
  uint32_t *users = calloc(s->npages, sizeof *users);
  uint8_t *unmapped = calloc(s->npages, 1); /* 1: VIRT/LOST, 2: MAPPING */
  if (users == NULL || unmapped == NULL) {
    free(users);
    free(unmapped);
    CACHE_BAD("arena %u: out of memory checking a span", ai);
    return bad;
  }
  uintptr_t at = s->base;
  const struct cache_block *prev = NULL;
  for (const struct cache_block *b = s->first; b; prev = b, b = b->next) {
    const unsigned long ptr = (unsigned long)b->ptr;
    if (b->prev != prev) CACHE_BAD("arena %u: block %#lx: prev link", ai, ptr);
    if (b->span != s) CACHE_BAD("arena %u: block %#lx: wrong span", ai, ptr);
    if (b->ptr != at)
      CACHE_BAD("arena %u: block %#lx: gap or overlap at %#lx", ai, ptr,
                (unsigned long)at);
    if (b->size == 0 || b->size % GMB_CACHE_ALIGN ||
        b->ptr + b->size > s->base + s->size) {
      CACHE_BAD("arena %u: block %#lx: size %llu", ai, ptr,
                (unsigned long long)b->size);
      break;
    }
    at = b->ptr + b->size;
    if (prev && cache_mergeable(prev, b))
      CACHE_BAD("arena %u: blocks %#lx and %#lx not merged", ai,
                (unsigned long)prev->ptr, ptr);
    uint64_t p0 = (b->ptr - s->base) >> k->shift;
    uint64_t p1 = (b->ptr + b->size - 1 - s->base) >> k->shift;
    switch (b->state) {
      case CACHE_VIRT:
      case CACHE_LOST: {
        if (b->ptr % k->page || b->size % k->page)
          CACHE_BAD("arena %u: unmapped block %#lx not page aligned", ai, ptr);
        if (b->state == CACHE_LOST && b->size != k->page)
          CACHE_BAD("arena %u: lost block %#lx is not one page", ai, ptr);
        for (uint64_t p = p0; p <= p1; p++) unmapped[p] = 1;
        if (b->state == CACHE_VIRT) {
          (*nvirt)++;
          const struct cache_block *x = s->virt;
          while (x && x != b) x = x->fnext;
          if (x == NULL) CACHE_BAD("arena %u: VIRT block %#lx in no list", ai,
                                   ptr);
        }
        break;
      }
      case CACHE_FREE: {
        (*nfree)++;
        if (b->req) CACHE_BAD("arena %u: free block with a request", ai);
        const struct cache_block *x = a->bins[cache_bin(b->size)];
        while (x && x != b) x = x->fnext;
        if (x == NULL) CACHE_BAD("arena %u: free block %#lx in no bin", ai, ptr);
        if (b->ready && (b->ev || b->stream))
          CACHE_BAD("arena %u: ready block %#lx with a stream", ai, ptr);
        if (b->pending || b->n_waits || b->n_uses)
          CACHE_BAD("arena %u: free block %#lx with waits or uses", ai, ptr);
        break;
      }
      case CACHE_MAPPING:
        for (uint64_t p = p0; p <= p1; p++) {
          users[p]++;
          unmapped[p] = 2;
        }
        break;
      case CACHE_LIVE: {
        for (uint64_t p = p0; p <= p1; p++) users[p]++;
        (*nout)++;
        *in_blocks += b->size;
        *in_req += b->req;
        if (b->req == 0 || b->req > b->size)
          CACHE_BAD("arena %u: block %#lx: request %llu of %llu", ai, ptr,
                    (unsigned long long)b->req, (unsigned long long)b->size);
        if (b->pending) {
          (*npend)++;
          const struct cache_block *x = a->pending;
          while (x && x != b) x = x->fnext;
          if (x == NULL) CACHE_BAD("arena %u: pending block %#lx not in the "
                                   "pending list", ai, ptr);
          if (b->n_waits == 0 || b->n_uses)
            CACHE_BAD("arena %u: pending block %#lx waits for %u, uses %u",
                      ai, ptr, b->n_waits, b->n_uses);
          break;
        }
        if (b->ev) CACHE_BAD("arena %u: handed-out block with an event", ai);
        if (b->n_waits) CACHE_BAD("arena %u: handed-out block with waits", ai);
        size_t h = a->hash_cap ? cache_hash_of(b->ptr, a->hash_cap) : 0;
        const struct cache_block *x = a->hash_cap ? a->hash[h] : NULL;
        while (x && x != b) x = x->hnext;
        if (x == NULL) CACHE_BAD("arena %u: handed-out block %#lx not in the "
                                 "hash", ai, ptr);
        break;
      }
      default:
        CACHE_BAD("arena %u: block %#lx: state %u", ai, ptr, b->state);
    }
  }
  if (at != s->base + s->size)
    CACHE_BAD("arena %u: span %#lx: blocks end at %#lx, not %#lx", ai,
              (unsigned long)s->base, (unsigned long)at,
              (unsigned long)(s->base + s->size));
  /* A paused tag's pages are all unmapped; those that the pause gave back
   * from under blocks are marked saved, and stand for the mapped ones. */
  const int asleep = a->state == CACHE_PAUSED || a->state == CACHE_RESUMING;
  for (uint64_t p = 0; p < s->npages; p++) {
    const struct cache_page *pg = &s->page[p];
    int is_mapped = asleep ? pg->saved != 0 : pg->pg.id != 0;
    if (asleep && pg->pg.id)
      CACHE_BAD("arena %u: page %#lx mapped while its tag is paused", ai,
                (unsigned long)(s->base + (p << k->shift)));
    if (!asleep && pg->saved)
      CACHE_BAD("arena %u: page %#lx saved while its tag runs", ai,
                (unsigned long)(s->base + (p << k->shift)));
    if (unmapped[p] == 1 && is_mapped)
      CACHE_BAD("arena %u: page %#lx mapped under unmapped memory", ai,
                (unsigned long)(s->base + (p << k->shift)));
    if (unmapped[p] == 0 && !is_mapped)
      CACHE_BAD("arena %u: page %#lx not mapped under a block", ai,
                (unsigned long)(s->base + (p << k->shift)));
    if (pg->users != users[p])
      CACHE_BAD("arena %u: page %#lx counts %u users, %u blocks lie on it",
                ai, (unsigned long)(s->base + (p << k->shift)), pg->users,
                users[p]);
    if (asleep) {
      *saved += is_mapped;
      continue;
    }
    *mapped += is_mapped;
    *idle += is_mapped && pg->users == 0;
  }
  free(users);
  free(unmapped);
  return bad;
}

static int cache_check_arena(const struct gmb_cache *k,
                             const struct cache_arena *a, unsigned ai,
                             uint64_t *held_sum, uint64_t *idle_sum,
                             uint64_t *req_sum) {
  int bad = 0;
  uint64_t mapped = 0, idle = 0, in_blocks = 0, in_req = 0, nfree = 0,
           nout = 0, npend = 0, nvirt = 0, saved = 0;
  for (const struct cache_span *s = a->spans; s; s = s->next) {
    bad += cache_check_span(k, a, ai, s, &mapped, &idle, &in_blocks, &in_req,
                            &nfree, &nout, &npend, &nvirt, &saved);
    uint64_t inlist = 0;
    for (const struct cache_block *v = s->virt; v && inlist <= s->npages;
         v = v->fnext) {
      inlist++;
      if (v->state != CACHE_VIRT || v->span != s)
        CACHE_BAD("arena %u: the VIRT list holds block %#lx of state %u", ai,
                  (unsigned long)v->ptr, v->state);
    }
    nvirt -= nvirt >= inlist ? inlist : nvirt;
  }
  if (nvirt) CACHE_BAD("arena %u: VIRT lists miss %llu blocks", ai,
                       (unsigned long long)nvirt);
  uint64_t inbins = 0;
  for (unsigned i = 0; i < CACHE_BINS; i++) {
    int bit = !!(a->bitmap[i / 64] & (UINT64_C(1) << (i % 64)));
    if (bit != (a->bins[i] != NULL))
      CACHE_BAD("arena %u: bin %u: bitmap bit %d", ai, i, bit);
    const struct cache_block *prev = NULL;
    for (const struct cache_block *b = a->bins[i]; b; prev = b, b = b->fnext) {
      inbins++;
      if (b->fprev != prev) CACHE_BAD("arena %u: bin %u: links", ai, i);
      if (b->state != CACHE_FREE || cache_bin(b->size) != i)
        CACHE_BAD("arena %u: bin %u holds block %#lx (state %u, size %llu)",
                  ai, i, (unsigned long)b->ptr, b->state,
                  (unsigned long long)b->size);
      if (inbins > nfree + 1) break; /* a cycle: counted below */
    }
  }
  if (inbins != nfree)
    CACHE_BAD("arena %u: %llu blocks in bins, %llu free", ai,
              (unsigned long long)inbins, (unsigned long long)nfree);
  if (a->hash_n != nout - npend)
    CACHE_BAD("arena %u: hash holds %zu, %llu handed out, %llu of them "
              "pending", ai, a->hash_n, (unsigned long long)nout,
              (unsigned long long)npend);
  uint64_t inlist = 0;
  for (const struct cache_block *b = a->pending; b && inlist <= npend;
       b = b->fnext)
    inlist++;
  if (inlist != npend || a->pending_n != npend)
    CACHE_BAD("arena %u: pending list holds %llu (counted %zu), %llu pending",
              ai, (unsigned long long)inlist, a->pending_n,
              (unsigned long long)npend);
  /* Event references: count the blocks naming each event. */
  for (const struct cache_span *s = a->spans; s; s = s->next)
    for (const struct cache_block *b = s->first; b; b = b->next) {
      if (b->ev == NULL) continue;
      uint32_t n = 0;
      for (const struct cache_span *t = a->spans; t; t = t->next)
        for (const struct cache_block *c = t->first; c; c = c->next) {
          n += c->ev == b->ev;
          for (uint32_t w = 0; w < c->n_waits; w++) n += c->waits[w] == b->ev;
        }
      if (n != b->ev->refs)
        CACHE_BAD("arena %u: event named %u times has %u references", ai, n,
                  b->ev->refs);
    }
  for (const struct cache_event *e = a->spare_events; e; e = e->next)
    if (e->refs) CACHE_BAD("arena %u: spare event with references", ai);
  const int asleep = a->state == CACHE_PAUSED || a->state == CACHE_RESUMING;
  if (asleep != (a->sleep != NULL))
    CACHE_BAD("arena %u: state %u with%s a sleep record", ai, a->state,
              a->sleep ? "" : "out");
  if (a->sleep && a->sleep->n != saved)
    CACHE_BAD("arena %u: %llu pages saved, the pause kept %llu", ai,
              (unsigned long long)saved, (unsigned long long)a->sleep->n);
  if (a->sleep && a->sleep->buf == NULL && a->sleep->host)
    CACHE_BAD("arena %u: host bytes with no host copy", ai);
  if (a->state != CACHE_RUNNING && ai < k->n)
    CACHE_BAD("arena %u: untagged, yet paused (state %u)", ai, a->state);
  if (mapped != a->mapped || idle != a->idle)
    CACHE_BAD("arena %u: %llu pages mapped, %llu idle; counted %llu, %llu", ai,
              (unsigned long long)mapped, (unsigned long long)idle,
              (unsigned long long)a->mapped, (unsigned long long)a->idle);
  if (a->peak_req < a->in_use_req)
    CACHE_BAD("arena %u: peak in use %llu below in use %llu", ai,
              (unsigned long long)a->peak_req,
              (unsigned long long)a->in_use_req);
  if (in_blocks != a->in_use_blocks || in_req != a->in_use_req)
    CACHE_BAD("arena %u: handed out %llu (%llu asked), counted %llu (%llu)",
              ai, (unsigned long long)in_blocks, (unsigned long long)in_req,
              (unsigned long long)a->in_use_blocks,
              (unsigned long long)a->in_use_req);
  uint64_t spare = 0;
  for (const struct cache_block *b = a->spare_blocks;
       b && spare <= CACHE_SPARE_BLOCKS; b = b->fnext)
    spare++;
  if (spare != a->n_spare_blocks || spare > CACHE_SPARE_BLOCKS)
    CACHE_BAD("arena %u: %llu spare records, counted %u (at most %u)", ai,
              (unsigned long long)spare, a->n_spare_blocks,
              CACHE_SPARE_BLOCKS);
  *held_sum += mapped * k->page;
  *idle_sum += idle * k->page;
  *req_sum += in_req;
  return bad;
}

int gmb__cache_check(struct gmb_cache *k) {
  if (k == NULL) return 0;
  int bad = 0;
  uint64_t held = 0, idle = 0, req = 0, host = 0;
  /* The host copies add up only while no pause or resume is under way. */
  const int quiet = pthread_mutex_trylock(&k->sleep_mu) == 0;
  const unsigned all = cache_arenas(k);
  for (unsigned i = 0; i < all; i++) pthread_mutex_lock(&k->arena[i].mu);
  for (unsigned i = 0; i < all; i++) {
    bad += cache_check_arena(k, &k->arena[i], i, &held, &idle, &req);
    if (k->arena[i].sleep) host += k->arena[i].sleep->host;
  }
  if (quiet &&
      host + atomic_load(&k->host_others) != atomic_load(&k->host_held))
    CACHE_BAD("host copies hold %llu bytes, counted %llu",
              (unsigned long long)host,
              (unsigned long long)atomic_load(&k->host_held));
  if (k->host_quota && atomic_load(&k->host_held) > k->host_quota)
    CACHE_BAD("host copies of %llu bytes pass the host quota %llu",
              (unsigned long long)atomic_load(&k->host_held),
              (unsigned long long)k->host_quota);
  if (held != atomic_load(&k->held) || idle != atomic_load(&k->idle) ||
      req != atomic_load(&k->in_use))
    CACHE_BAD("totals: held %llu, idle %llu, in use %llu; arenas sum to "
              "%llu, %llu, %llu",
              (unsigned long long)atomic_load(&k->held),
              (unsigned long long)atomic_load(&k->idle),
              (unsigned long long)atomic_load(&k->in_use),
              (unsigned long long)held, (unsigned long long)idle,
              (unsigned long long)req);
  if (atomic_load(&k->peak_in_use) < req || atomic_load(&k->peak_held) < held)
    CACHE_BAD("a peak is below the current figure");
  for (unsigned i = all; i-- > 0;) pthread_mutex_unlock(&k->arena[i].mu);
  if (quiet) pthread_mutex_unlock(&k->sleep_mu);
  return bad;
}
