/*
 * pool.c - the broker's allocator (see pool.h for the contract).
 *
 * Layout.  A segment (struct gmb_segment) is one device segment owned by one
 * arena and one size class.  Its bytes are tiled by ranges (struct
 * pool_range) kept in a doubly linked list in address order: every byte of
 * the segment is in exactly one range, live or free, and no two free ranges
 * touch (they are merged when the second one is freed).  Free ranges also sit
 * in their arena's red-black tree for their class, keyed (size, segment id,
 * offset), so RB_NFIND(size) is the best fit.  Live ranges sit in the slot
 * table instead: slots[i].r points at the range, slots[i].gen is the
 * generation that the range's id carries in its high 32 bits.
 *
 * Memory.  A range is 80 bytes: the tree links and the owner pointer share a
 * union because only free ranges are in a tree and only live ones have an
 * owner.  Ranges come from chunks of POOL_CHUNK_RANGES (no malloc header per
 * range, and no malloc call per alloc/free); chunks that hold no range are
 * given back by gmb__pool_trim().  The slot table costs 16 bytes a slot and
 * doubles when full.  Nothing is ever stored in device memory.
 *
 * Ids.  A slot is reused after its allocation is freed (LIFO, so the table
 * stays as small as the peak), with the generation bumped; a slot whose
 * generation would wrap is retired for good.  So an id is never 0 (the
 * generation starts at 1) and never names two allocations.
 *
 * Empty segments.  A large segment that empties goes back to the device at
 * once.  A small one lingers as the arena's `linger` (one per arena, the
 * last emptied) so that a loop of alloc/free does not create and destroy a
 * shm object or cuMemAlloc region each time; gmb__pool_trim() or a device
 * allocation that fails for want of room releases it.  A lingering segment
 * stays in the free tree as one free range, so the arena reuses it first.
 *
 * Failure.  Every allocation reserves its slot and range structs before it
 * changes anything, so a failure (GMB_E_INVAL, GMB_E_NOMEM, or a device
 * error) leaves the pool as it was, apart from lingering segments released
 * under pressure.
 */
#include "pool.h"

#include <bsd/sys/queue.h>
#include <bsd/sys/tree.h>
#include <stdlib.h>
#include <string.h>

#include "gmb.h"
#include "log.h"

enum { POOL_SMALL = 0, POOL_LARGE = 1, POOL_CLASSES = 2 };

#define POOL_CHUNK_RANGES 2000u /* 160 KB chunks */
#define POOL_SLOTS_MIN 64u
#define POOL_SLOT_NONE UINT32_MAX

struct pool_range {
  struct pool_range *prev, *next; /* address order within the segment */
  struct gmb_segment *seg;
  uint64_t offset;
  uint64_t size;
  uint32_t flags; /* GMB_RANGE_FREE, or the allocation's flags */
  uint32_t slot;  /* live: its slot */
  union {
    RB_ENTRY(pool_range) node; /* free: in the arena's tree */
    void *owner;               /* live */
  } u;
};

_Static_assert(sizeof(struct pool_range) <= 80,
               "a range stays within 80 bytes (the per-allocation budget)");

RB_HEAD(pool_free_tree, pool_range);

/* One entry of the slot table.  The pointer and the generation share a
 * cache line so that looking an id up costs one miss, not two. */
struct pool_slot {
  struct pool_range *r; /* NULL: free or retired */
  uint32_t gen;         /* generation of the id the slot hands out next/now */
  uint32_t next_free;   /* free list, when r is NULL */
};

struct gmb_segment {
  struct gmb_dseg dseg;
  struct gmb_arena *arena;
  struct pool_range *first;
  RB_ENTRY(gmb_segment) by_id;  /* the pool's tree of segments */
  LIST_ENTRY(gmb_segment) link; /* the arena's segments */
  uint64_t used;                /* bytes of live ranges */
  uint32_t live;                /* count of live ranges */
  uint32_t cls;
};

RB_HEAD(pool_seg_tree, gmb_segment);

struct gmb_arena {
  void *tag;
  struct pool_free_tree free[POOL_CLASSES];
  LIST_HEAD(, gmb_segment) segs;
  LIST_ENTRY(gmb_arena) link;
  struct gmb_segment *linger; /* an empty small segment kept, or NULL */
  uint64_t used, allocations, segment_bytes, segments, free_total;
};

struct pool_chunk {
  struct pool_chunk *next;
  struct pool_range r[];
};

struct gmb_pool {
  struct gmb_device *dev;
  gmb_pool_retire_fn retire;
  void *ctx;
  LIST_HEAD(, gmb_arena) arenas;
  struct pool_seg_tree segs;
  uint64_t next_seg_id;
  uint64_t segment_bytes, segments, used, allocations;
  uint64_t lingering; /* arenas whose `linger` is set */

  struct pool_slot *slots;
  uint32_t nslots, slot_cap, slot_free;

  struct pool_chunk *chunks;
  struct pool_range *range_free; /* linked through `next` */
  uint64_t nchunks, nrange_free;
};

static int pool_free_cmp(const struct pool_range *a,
                         const struct pool_range *b) {
  if (a->size != b->size) return a->size < b->size ? -1 : 1;
  if (a->seg->dseg.id != b->seg->dseg.id)
    return a->seg->dseg.id < b->seg->dseg.id ? -1 : 1;
  if (a->offset != b->offset) return a->offset < b->offset ? -1 : 1;
  return 0;
}

static int pool_seg_cmp(const struct gmb_segment *a,
                        const struct gmb_segment *b) {
  return a->dseg.id < b->dseg.id ? -1 : a->dseg.id > b->dseg.id;
}

/* libbsd leaves __unused undefined, which RB_GENERATE_STATIC relies on, so
 * the functions are generated with the attribute spelled out (not every
 * tree uses PREV or NFIND). */
#define POOL_RB_STATIC __attribute__((unused)) static
RB_GENERATE_INTERNAL(pool_free_tree, pool_range, u.node, pool_free_cmp,
                     POOL_RB_STATIC)
RB_GENERATE_INTERNAL(pool_seg_tree, gmb_segment, by_id, pool_seg_cmp,
                     POOL_RB_STATIC)

#ifdef GMB_DEBUG
#define POOL_DEBUG_CHECK(p) \
  GMB_ASSERT(gmb__pool_check(p) == 0 && "pool invariants hold")
#else
#define POOL_DEBUG_CHECK(p) ((void)0)
#endif

/* ---- range structs ---------------------------------------------------- */

static void pool_range_put(struct gmb_pool *p, struct pool_range *r) {
  r->next = p->range_free;
  r->seg = NULL;
  p->range_free = r;
  p->nrange_free++;
}

static int pool_ranges_reserve(struct gmb_pool *p, uint64_t n) {
  while (p->nrange_free < n) {
    struct pool_chunk *c =
        malloc(sizeof *c + POOL_CHUNK_RANGES * sizeof(struct pool_range));
    if (!c) return GMB_E_NOMEM;
    c->next = p->chunks;
    p->chunks = c;
    p->nchunks++;
    for (uint32_t i = POOL_CHUNK_RANGES; i-- > 0;) pool_range_put(p, &c->r[i]);
  }
  return 0;
}

static struct pool_range *pool_range_get(struct gmb_pool *p) {
  GMB_ASSERT(p->range_free && "range structs reserved before use");
  struct pool_range *r = p->range_free;
  p->range_free = r->next;
  p->nrange_free--;
  memset(r, 0, sizeof *r);
  return r;
}

/* Gives back chunks none of whose range structs are in use, and rebuilds
 * the free list from the chunks that stay.  A struct on the free list is the
 * one with seg == NULL (every range of a segment has its segment), so this
 * is one pass over the chunks: O(structs), fine for something run by trim
 * and never on the allocation path. */
static void pool_chunks_trim(struct gmb_pool *p) {
  if (p->nrange_free < POOL_CHUNK_RANGES) return;
  struct pool_chunk *c = p->chunks;
  p->chunks = NULL;
  p->nchunks = 0;
  p->range_free = NULL;
  p->nrange_free = 0;
  while (c) {
    struct pool_chunk *nx = c->next;
    uint32_t nfree = 0;
    for (uint32_t j = 0; j < POOL_CHUNK_RANGES; j++) nfree += !c->r[j].seg;
    if (nfree == POOL_CHUNK_RANGES) {
      free(c);
    } else {
      c->next = p->chunks;
      p->chunks = c;
      p->nchunks++;
      for (uint32_t j = POOL_CHUNK_RANGES; j-- > 0;)
        if (!c->r[j].seg) pool_range_put(p, &c->r[j]);
    }
    c = nx;
  }
}

/* ---- slot table ------------------------------------------------------- */

static int pool_slot_reserve(struct gmb_pool *p) {
  if (p->slot_free != POOL_SLOT_NONE || p->nslots < p->slot_cap) return 0;
  if (p->slot_cap >= UINT32_MAX / 2) return GMB_E_NOMEM;
  uint32_t cap = p->slot_cap ? p->slot_cap * 2 : POOL_SLOTS_MIN;
  struct pool_slot *ns = realloc(p->slots, cap * sizeof *ns);
  if (!ns) return GMB_E_NOMEM;
  p->slots = ns;
  p->slot_cap = cap;
  return 0;
}

static int pool_slot_live(const struct gmb_pool *p, uint32_t i) {
  return i < p->nslots && p->slots[i].r != NULL;
}

/* Takes a slot for r (reserved beforehand); returns the id. */
static uint64_t pool_slot_take(struct gmb_pool *p, struct pool_range *r) {
  uint32_t i;
  if (p->slot_free != POOL_SLOT_NONE) {
    i = p->slot_free;
    p->slot_free = p->slots[i].next_free;
  } else {
    GMB_ASSERT(p->nslots < p->slot_cap && "slot reserved before use");
    i = p->nslots++;
    p->slots[i].gen = 1;
  }
  p->slots[i].r = r;
  r->slot = i;
  return (uint64_t)p->slots[i].gen << 32 | i;
}

static void pool_slot_release(struct gmb_pool *p, uint32_t i) {
  struct pool_slot *sl = &p->slots[i];
  sl->r = NULL;
  /* A slot whose generation is exhausted is retired: off the free list for
   * good, so no id ever comes back. */
  if (++sl->gen == 0) return;
  sl->next_free = p->slot_free;
  p->slot_free = i;
}

static struct pool_range *pool_lookup(const struct gmb_pool *p, uint64_t id) {
  uint32_t i = (uint32_t)id, gen = (uint32_t)(id >> 32);
  if (gen == 0 || i >= p->nslots) return NULL;
  const struct pool_slot *sl = &p->slots[i];
  return sl->gen == gen ? sl->r : NULL;
}

static uint64_t pool_range_id(const struct gmb_pool *p,
                              const struct pool_range *r) {
  return (uint64_t)p->slots[r->slot].gen << 32 | r->slot;
}

static void pool_info(const struct gmb_pool *p, const struct pool_range *r,
                      struct gmb_alloc_info *out) {
  int is_free = (r->flags & GMB_RANGE_FREE) != 0;
  out->id = is_free ? 0 : pool_range_id(p, r);
  out->size = r->size;
  out->offset = r->offset;
  out->flags = r->flags;
  out->owner = is_free ? NULL : r->u.owner;
  out->segment = r->seg;
  out->dseg = &r->seg->dseg;
}

/* ---- segments --------------------------------------------------------- */

static void pool_tree_insert(struct gmb_arena *a, struct pool_range *r) {
  struct pool_range *dup = RB_INSERT(pool_free_tree, &a->free[r->seg->cls], r);
  GMB_ASSERT(!dup && "free range keys are unique");
}

static void pool_tree_remove(struct gmb_arena *a, struct pool_range *r) {
  RB_REMOVE(pool_free_tree, &a->free[r->seg->cls], r);
}

static uint64_t pool_release_lingering(struct gmb_pool *p);

/* Creates a segment of `size` bytes for arena a, as one free range.  The
 * caller reserved one range struct.  Under device pressure the lingering
 * segments of every arena are released and the device asked again. */
static int pool_segment_new(struct gmb_pool *p, struct gmb_arena *a,
                            uint32_t cls, uint64_t size,
                            struct gmb_segment **out) {
  struct gmb_segment *s = calloc(1, sizeof *s);
  if (!s) return GMB_E_NOMEM;
  uint64_t id = p->next_seg_id;
  int rc = gmb__device_seg_new(p->dev, id, size, &s->dseg);
  if (rc == GMB_E_NOMEM && p->lingering) {
    pool_release_lingering(p);
    rc = gmb__device_seg_new(p->dev, id, size, &s->dseg);
  }
  if (rc != 0) {
    free(s);
    return rc;
  }
  p->next_seg_id++;
  s->arena = a;
  s->cls = cls;
  struct pool_range *r = pool_range_get(p);
  r->seg = s;
  r->offset = 0;
  r->size = size;
  r->flags = GMB_RANGE_FREE;
  s->first = r;
  RB_INSERT(pool_seg_tree, &p->segs, s);
  LIST_INSERT_HEAD(&a->segs, s, link);
  pool_tree_insert(a, r);
  a->segment_bytes += size;
  a->segments++;
  a->free_total += size;
  p->segment_bytes += size;
  p->segments++;
  *out = s;
  return 0;
}

/* Returns segment s to the device, with whatever ranges it still has (live
 * ones are dropped from the slot table and the accounting). */
static void pool_segment_release(struct gmb_pool *p, struct gmb_segment *s) {
  struct gmb_arena *a = s->arena;
  if (a->linger == s) {
    a->linger = NULL;
    p->lingering--;
  }
  for (struct pool_range *r = s->first, *nx; r; r = nx) {
    nx = r->next;
    if (r->flags & GMB_RANGE_FREE) {
      pool_tree_remove(a, r);
      a->free_total -= r->size;
    } else {
      pool_slot_release(p, r->slot);
      a->used -= r->size;
      a->allocations--;
      p->used -= r->size;
      p->allocations--;
    }
    pool_range_put(p, r);
  }
  if (p->retire) p->retire(p->ctx, &s->dseg, a->tag);
  RB_REMOVE(pool_seg_tree, &p->segs, s);
  LIST_REMOVE(s, link);
  a->segment_bytes -= s->dseg.size;
  a->segments--;
  p->segment_bytes -= s->dseg.size;
  p->segments--;
  gmb__device_seg_free(p->dev, &s->dseg);
  free(s);
}

/* Segment s just lost its last live range: release it, or let it linger
 * (small class), releasing the arena's previous lingering one. */
static void pool_segment_emptied(struct gmb_pool *p, struct gmb_segment *s) {
  struct gmb_arena *a = s->arena;
  if (s->cls != POOL_SMALL) {
    pool_segment_release(p, s);
    return;
  }
  if (a->linger) pool_segment_release(p, a->linger);
  a->linger = s;
  p->lingering++;
}

/* Releases every arena's lingering segment; returns the bytes. */
static uint64_t pool_release_lingering(struct gmb_pool *p) {
  uint64_t bytes = 0;
  struct gmb_arena *a;
  LIST_FOREACH(a, &p->arenas, link) {
    if (!p->lingering) break;
    if (a->linger) {
      bytes += a->linger->dseg.size;
      pool_segment_release(p, a->linger);
    }
  }
  return bytes;
}

/* ---- allocation ------------------------------------------------------- */

int gmb__pool_alloc(struct gmb_pool *p, struct gmb_arena *a, uint64_t size,
                    uint32_t flags, void *owner, struct gmb_alloc_info *out) {
  if (size == 0 || size > UINT64_MAX - (GMB_POOL_ALIGN - 1) ||
      (flags & GMB_RANGE_FREE))
    return GMB_E_INVAL;
  uint64_t need = (size + GMB_POOL_ALIGN - 1) & ~(uint64_t)(GMB_POOL_ALIGN - 1);
  uint32_t cls = need <= GMB_POOL_SMALL_MAX ? POOL_SMALL : POOL_LARGE;
  uint64_t segsize = GMB_POOL_SMALL_SEGMENT;
  if (cls == POOL_LARGE) {
    if (need > UINT64_MAX - (GMB_SEGMENT_ALIGN - 1)) return GMB_E_INVAL;
    segsize = (need + GMB_SEGMENT_ALIGN - 1) & ~(GMB_SEGMENT_ALIGN - 1);
  }
  /* Reserve everything that can fail before changing anything: one range
   * struct for a new segment, one for the remainder of a split. */
  int rc = pool_ranges_reserve(p, 2);
  if (rc == 0) rc = pool_slot_reserve(p);
  if (rc != 0) return rc;

  struct gmb_segment key_seg = {.dseg = {.id = 0}};
  struct pool_range key = {.seg = &key_seg, .size = need, .offset = 0};
  struct pool_range *r = RB_NFIND(pool_free_tree, &a->free[cls], &key);
  if (!r) {
    struct gmb_segment *s;
    rc = pool_segment_new(p, a, cls, segsize, &s);
    if (rc != 0) return rc;
    r = s->first;
  }
  struct gmb_segment *s = r->seg;
  pool_tree_remove(a, r);
  a->free_total -= r->size;
  if (r->size > need) {
    struct pool_range *rest = pool_range_get(p);
    rest->seg = s;
    rest->offset = r->offset + need;
    rest->size = r->size - need;
    rest->flags = GMB_RANGE_FREE;
    rest->prev = r;
    rest->next = r->next;
    if (r->next) r->next->prev = rest;
    r->next = rest;
    r->size = need;
    pool_tree_insert(a, rest);
    a->free_total += rest->size;
  }
  r->flags = flags;
  r->u.owner = owner;
  uint64_t id = pool_slot_take(p, r);
  if (s->live++ == 0 && a->linger == s) {
    a->linger = NULL;
    p->lingering--;
  }
  s->used += need;
  a->used += need;
  a->allocations++;
  p->used += need;
  p->allocations++;
  if (out) {
    pool_info(p, r, out);
    out->id = id;
  }
  POOL_DEBUG_CHECK(p);
  return 0;
}

/* Frees live range r: slot, accounting, coalescing.  Returns the free range
 * that now covers r's bytes.  The caller deals with an emptied segment. */
static struct pool_range *pool_range_free(struct gmb_pool *p,
                                          struct pool_range *r) {
  struct gmb_segment *s = r->seg;
  struct gmb_arena *a = s->arena;
  pool_slot_release(p, r->slot);
  s->live--;
  s->used -= r->size;
  a->used -= r->size;
  a->allocations--;
  a->free_total += r->size;
  p->used -= r->size;
  p->allocations--;
  r->flags = GMB_RANGE_FREE;
  struct pool_range *prev = r->prev, *next = r->next;
  if (prev && (prev->flags & GMB_RANGE_FREE)) {
    pool_tree_remove(a, prev);
    prev->size += r->size;
    prev->next = next;
    if (next) next->prev = prev;
    pool_range_put(p, r);
    r = prev;
  }
  if (next && (next->flags & GMB_RANGE_FREE)) {
    pool_tree_remove(a, next);
    r->size += next->size;
    r->next = next->next;
    if (next->next) next->next->prev = r;
    pool_range_put(p, next);
  }
  pool_tree_insert(a, r);
  return r;
}

int gmb__pool_free(struct gmb_pool *p, uint64_t id,
                   struct gmb_alloc_info *info) {
  struct pool_range *r = pool_lookup(p, id);
  if (!r) return GMB_E_NOENT;
  if (info) pool_info(p, r, info);
  struct gmb_segment *s = r->seg;
  struct gmb_arena *a = s->arena;
  pool_range_free(p, r);
  if (s->live == 0) {
    pool_segment_emptied(p, s);
    if (info && a->linger != s) { /* released: leave nothing dangling */
      info->segment = NULL;
      info->dseg = NULL;
    }
  }
  POOL_DEBUG_CHECK(p);
  return 0;
}

int gmb__pool_find(const struct gmb_pool *p, uint64_t id,
                   struct gmb_alloc_info *out) {
  const struct pool_range *r = pool_lookup(p, id);
  if (!r) return GMB_E_NOENT;
  if (out) pool_info(p, r, out);
  return 0;
}

uint64_t gmb__pool_free_owner(struct gmb_pool *p, struct gmb_arena *a,
                              void *owner) {
  uint64_t bytes = 0;
  for (struct gmb_segment *s = LIST_FIRST(&a->segs), *nx; s; s = nx) {
    nx = LIST_NEXT(s, link);
    uint32_t live_before = s->live;
    for (struct pool_range *r = s->first; r;) {
      if ((r->flags & GMB_RANGE_FREE) || r->u.owner != owner) {
        r = r->next;
        continue;
      }
      bytes += r->size;
      /* The merged free range is followed by a live range or nothing. */
      r = pool_range_free(p, r)->next;
    }
    if (live_before && s->live == 0) {
      /* Emptying s may release the arena's lingering segment; it has no
       * live range, so skipping it in this walk loses nothing. */
      if (nx && nx == a->linger) nx = LIST_NEXT(nx, link);
      pool_segment_emptied(p, s);
    }
  }
  POOL_DEBUG_CHECK(p);
  return bytes;
}

uint64_t gmb__pool_trim(struct gmb_pool *p) {
  uint64_t bytes = pool_release_lingering(p);
  pool_chunks_trim(p);
  POOL_DEBUG_CHECK(p);
  return bytes;
}

/* ---- pool and arenas -------------------------------------------------- */

struct gmb_pool *gmb__pool_new(struct gmb_device *dev,
                               gmb_pool_retire_fn retire, void *ctx) {
  struct gmb_pool *p = calloc(1, sizeof *p);
  if (!p) return NULL;
  p->dev = dev;
  p->retire = retire;
  p->ctx = ctx;
  LIST_INIT(&p->arenas);
  RB_INIT(&p->segs);
  p->next_seg_id = 1;
  p->slot_free = POOL_SLOT_NONE;
  return p;
}

void gmb__pool_destroy(struct gmb_pool *p) {
  if (!p) return;
  while (!LIST_EMPTY(&p->arenas))
    gmb__pool_arena_destroy(p, LIST_FIRST(&p->arenas));
  while (p->chunks) {
    struct pool_chunk *c = p->chunks;
    p->chunks = c->next;
    free(c);
  }
  free(p->slots);
  free(p);
}

struct gmb_arena *gmb__pool_arena_new(struct gmb_pool *p, void *tag) {
  struct gmb_arena *a = calloc(1, sizeof *a);
  if (!a) return NULL;
  a->tag = tag;
  for (int c = 0; c < POOL_CLASSES; c++) RB_INIT(&a->free[c]);
  LIST_INIT(&a->segs);
  LIST_INSERT_HEAD(&p->arenas, a, link);
  return a;
}

void gmb__pool_arena_destroy(struct gmb_pool *p, struct gmb_arena *a) {
  if (!a) return;
  while (!LIST_EMPTY(&a->segs)) pool_segment_release(p, LIST_FIRST(&a->segs));
  GMB_ASSERT(a->used == 0 && a->allocations == 0 && a->segments == 0 &&
             "an arena with no segments holds nothing");
  LIST_REMOVE(a, link);
  free(a);
  POOL_DEBUG_CHECK(p);
}

const struct gmb_dseg *gmb__pool_segment(const struct gmb_pool *p,
                                         uint64_t seg_id, void **arena_tag) {
  struct gmb_segment key = {.dseg = {.id = seg_id}};
  struct gmb_segment *s =
      RB_FIND(pool_seg_tree, (struct pool_seg_tree *)&p->segs, &key);
  if (!s) return NULL;
  if (arena_tag) *arena_tag = s->arena->tag;
  return &s->dseg;
}

/* ---- stats, walk, check ----------------------------------------------- */

void gmb__pool_arena_stats(const struct gmb_arena *a,
                           struct gmb_arena_stats *out) {
  out->used = a->used;
  out->allocations = a->allocations;
  out->segment_bytes = a->segment_bytes;
  out->segments = a->segments;
  out->free_total = a->free_total;
  out->largest_free = 0;
  for (int c = 0; c < POOL_CLASSES; c++) {
    struct pool_range *m =
        RB_MAX(pool_free_tree, (struct pool_free_tree *)&a->free[c]);
    if (m && m->size > out->largest_free) out->largest_free = m->size;
  }
}

void gmb__pool_stats(const struct gmb_pool *p, struct gmb_pool_stats *out) {
  out->capacity = p->dev->capacity;
  out->segment_bytes = p->segment_bytes;
  out->segments = p->segments;
  out->used = p->used;
  out->allocations = p->allocations;
}

int gmb__pool_walk(const struct gmb_pool *p, gmb_pool_walk_fn fn, void *ctx) {
  struct gmb_segment *s;
  RB_FOREACH(s, pool_seg_tree, (struct pool_seg_tree *)&p->segs) {
    for (struct pool_range *r = s->first; r; r = r->next) {
      struct gmb_alloc_info info;
      pool_info(p, r, &info);
      int rc = fn(ctx, &info, (r->flags & GMB_RANGE_FREE) != 0);
      if (rc) return rc;
    }
  }
  return 0;
}

#define POOL_BAD(...)       \
  do {                      \
    log_error(__VA_ARGS__); \
    bad++;                  \
  } while (0)

static int pool_check_segment(const struct gmb_pool *p,
                              const struct gmb_segment *s, uint64_t *nfree,
                              uint64_t *free_bytes) {
  int bad = 0;
  const struct gmb_arena *a = s->arena;
  unsigned long long sid = (unsigned long long)s->dseg.id;
  if (RB_FIND(pool_seg_tree, (struct pool_seg_tree *)&p->segs,
              (struct gmb_segment *)s) != s)
    POOL_BAD("pool check: segment %llu missing from the id tree", sid);
  if (s->cls == POOL_SMALL ? s->dseg.size != GMB_POOL_SMALL_SEGMENT
                           : s->dseg.size % GMB_SEGMENT_ALIGN != 0)
    POOL_BAD("pool check: segment %llu has size %llu for its class", sid,
             (unsigned long long)s->dseg.size);
  uint64_t off = 0, used = 0;
  uint32_t live = 0;
  const struct pool_range *prev = NULL;
  for (const struct pool_range *r = s->first; r; prev = r, r = r->next) {
    unsigned long long ro = (unsigned long long)r->offset;
    if (r->seg != s)
      POOL_BAD("pool check: seg %llu range %llu points at another segment", sid,
               ro);
    if (r->prev != prev)
      POOL_BAD("pool check: seg %llu range %llu has a wrong prev link", sid,
               ro);
    if (r->offset != off)
      POOL_BAD(
          "pool check: seg %llu range at %llu, expected %llu (gap or "
          "overlap)",
          sid, ro, (unsigned long long)off);
    if (r->size == 0 || r->size % GMB_POOL_ALIGN)
      POOL_BAD("pool check: seg %llu range %llu has size %llu", sid, ro,
               (unsigned long long)r->size);
    if (r->flags & GMB_RANGE_FREE) {
      if (prev && (prev->flags & GMB_RANGE_FREE))
        POOL_BAD(
            "pool check: seg %llu free ranges at %llu and %llu not "
            "coalesced",
            sid, (unsigned long long)prev->offset, ro);
      if (RB_FIND(pool_free_tree, (struct pool_free_tree *)&a->free[s->cls],
                  (struct pool_range *)r) != r)
        POOL_BAD("pool check: seg %llu free range %llu not in its tree", sid,
                 ro);
      (*nfree)++;
      *free_bytes += r->size;
    } else {
      if (!pool_slot_live(p, r->slot) || p->slots[r->slot].r != r)
        POOL_BAD(
            "pool check: seg %llu live range %llu not in the slot "
            "table",
            sid, ro);
      live++;
      used += r->size;
    }
    off += r->size;
  }
  if (off != s->dseg.size)
    POOL_BAD("pool check: seg %llu ranges cover %llu of %llu bytes", sid,
             (unsigned long long)off, (unsigned long long)s->dseg.size);
  if (live != s->live || used != s->used)
    POOL_BAD(
        "pool check: seg %llu counts %u live/%llu used, ranges say "
        "%u/%llu",
        sid, s->live, (unsigned long long)s->used, live,
        (unsigned long long)used);
  if (live == 0 && a->linger != s)
    POOL_BAD(
        "pool check: seg %llu is empty but neither released nor "
        "lingering",
        sid);
  return bad;
}

int gmb__pool_check(const struct gmb_pool *p) {
  int bad = 0;
  uint64_t segs = 0, seg_bytes = 0, used = 0, allocs = 0, lingering = 0;
  const struct gmb_arena *a;
  LIST_FOREACH(a, &p->arenas, link) {
    uint64_t nfree[POOL_CLASSES] = {0, 0}, free_bytes = 0;
    uint64_t a_segs = 0, a_bytes = 0, a_used = 0, a_allocs = 0;
    const struct gmb_segment *s;
    LIST_FOREACH(s, &a->segs, link) {
      if (s->arena != a)
        POOL_BAD("pool check: segment %llu in another arena's list",
                 (unsigned long long)s->dseg.id);
      uint64_t nf = 0;
      bad += pool_check_segment(p, s, &nf, &free_bytes);
      nfree[s->cls < POOL_CLASSES ? s->cls : 0] += nf;
      a_segs++;
      a_bytes += s->dseg.size;
      a_used += s->used;
      a_allocs += s->live;
    }
    if (a->linger) {
      lingering++;
      if (a->linger->arena != a || a->linger->live != 0 ||
          a->linger->cls != POOL_SMALL)
        POOL_BAD(
            "pool check: arena %p lingering segment is not an empty "
            "small segment of its own",
            a->tag);
    }
    for (int c = 0; c < POOL_CLASSES; c++) {
      uint64_t n = 0;
      struct pool_range *r;
      RB_FOREACH(r, pool_free_tree, (struct pool_free_tree *)&a->free[c]) {
        n++;
        if (!(r->flags & GMB_RANGE_FREE) || !r->seg || r->seg->arena != a ||
            r->seg->cls != (uint32_t)c)
          POOL_BAD(
              "pool check: arena %p tree %d holds a range that is not "
              "one of its free ranges",
              a->tag, c);
      }
      if (n != nfree[c])
        POOL_BAD(
            "pool check: arena %p tree %d holds %llu ranges, segments "
            "have %llu free",
            a->tag, c, (unsigned long long)n, (unsigned long long)nfree[c]);
    }
    if (a_segs != a->segments || a_bytes != a->segment_bytes ||
        a_used != a->used || a_allocs != a->allocations ||
        free_bytes != a->free_total)
      POOL_BAD(
          "pool check: arena %p totals (segs %llu bytes %llu used %llu "
          "allocs %llu free %llu) differ from its segments (%llu %llu "
          "%llu %llu %llu)",
          a->tag, (unsigned long long)a->segments,
          (unsigned long long)a->segment_bytes, (unsigned long long)a->used,
          (unsigned long long)a->allocations, (unsigned long long)a->free_total,
          (unsigned long long)a_segs, (unsigned long long)a_bytes,
          (unsigned long long)a_used, (unsigned long long)a_allocs,
          (unsigned long long)free_bytes);
    segs += a_segs;
    seg_bytes += a_bytes;
    used += a_used;
    allocs += a_allocs;
  }
  uint64_t in_tree = 0;
  struct gmb_segment *s;
  RB_FOREACH(s, pool_seg_tree, (struct pool_seg_tree *)&p->segs) in_tree++;
  if (segs != p->segments || in_tree != p->segments ||
      seg_bytes != p->segment_bytes || used != p->used ||
      allocs != p->allocations || lingering != p->lingering)
    POOL_BAD(
        "pool check: pool totals (segs %llu/%llu in tree, bytes %llu, "
        "used %llu, allocs %llu, lingering %llu) differ from its arenas "
        "(%llu %llu %llu %llu %llu)",
        (unsigned long long)p->segments, (unsigned long long)in_tree,
        (unsigned long long)p->segment_bytes, (unsigned long long)p->used,
        (unsigned long long)p->allocations, (unsigned long long)p->lingering,
        (unsigned long long)segs, (unsigned long long)seg_bytes,
        (unsigned long long)used, (unsigned long long)allocs,
        (unsigned long long)lingering);
  if (p->segment_bytes > p->dev->in_use)
    POOL_BAD("pool check: %llu segment bytes but the device counts %llu",
             (unsigned long long)p->segment_bytes,
             (unsigned long long)p->dev->in_use);
  uint64_t live_slots = 0;
  for (uint32_t i = 0; i < p->nslots; i++) {
    if (!pool_slot_live(p, i)) continue;
    live_slots++;
    const struct pool_range *r = p->slots[i].r;
    if ((r->flags & GMB_RANGE_FREE) || r->slot != i || !r->seg)
      POOL_BAD(
          "pool check: slot %u points at a range that is not its live "
          "allocation",
          i);
  }
  if (live_slots != p->allocations)
    POOL_BAD("pool check: %llu live slots for %llu allocations",
             (unsigned long long)live_slots,
             (unsigned long long)p->allocations);
  return bad;
}
