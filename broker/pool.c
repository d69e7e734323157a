/*
 * pool.c - the broker's allocator (see pool.h for the contract).
 *
 * Layout.  A segment (struct gmb_segment) is one device segment owned by one
 * arena and of one class: small movable, small pinned or large (pool.h has
 * the placement rules; pool_seg_reclass() moves a small segment's free
 * ranges to the other tree when its first pinned allocation arrives or its
 * last one goes).  Its bytes are tiled by ranges (struct
 * pool_range) kept in a doubly linked list in address order: every byte of
 * the segment is in exactly one range, live or free, and no two free ranges
 * touch (they are merged when the second one is freed).  Free ranges also sit
 * in their arena's red-black tree for their class, keyed (size, segment id,
 * offset), so RB_NFIND(size) is the best fit.  Live ranges sit in the slot
 * table instead: slots[i].r points at the range, slots[i].gen is the
 * generation that the range's id carries in its high 32 bits.
 *
 * The structures are in pool_impl.h, which compact.c reads (see there for
 * the rule: only this file writes them).
 *
 * Memory.  A range is 80 bytes: the tree links, the owner pointer and tag,
 * and a move target's list link share a union because only free ranges are
 * in a tree, only live ones have an owner and only targets are in the list
 * of moves.  Ranges come from chunks of POOL_CHUNK_RANGES (no malloc header per
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
 * stays in the movable tree as one free range, so the arena reuses it first
 * (a pinned request that finds no pinned range takes it over).
 * "Empty" means idle: no live range and no move target.  A segment emptied
 * by a committed move is released at once, whatever its class.
 *
 * Moves.  A move target is carved out of a free range (up to two free
 * pieces stay around it), leaves the free tree, and is listed in p->moves
 * with a serial that names it to the mover; its source is marked
 * POOL_MOVING_SRC.  There are few moves in flight (one per compaction
 * run), so the list is searched linearly.  Commit swaps the target in for
 * the source in the slot table (or, for a slide that overlaps, moves the
 * range down and frees the tail); a free of the source, or the end of its
 * arena, drops the target, so the mover is the only one that can be
 * surprised, and it finds out from commit/abort returning GMB_E_NOENT.
 *
 * Failure.  Every allocation reserves its slot and range structs before it
 * changes anything, so a failure (GMB_E_INVAL, GMB_E_NOMEM, or a device
 * error) leaves the pool as it was, apart from lingering segments released
 * under pressure.
 */
#include "pool.h"

#include <stdlib.h>
#include <string.h>

#include "gmb.h"
#include "log.h"
#include "pool_impl.h"

#define POOL_CHUNK_RANGES 2000u /* 160 KB chunks */
#define POOL_SLOTS_MIN 64u

_Static_assert(sizeof(struct pool_range) <= 80,
               "a range stays within 80 bytes (the per-allocation budget)");

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

/* Arenas by their largest free range in a small segment, then address. */
static int pool_arena_cmp(const struct gmb_arena *a,
                          const struct gmb_arena *b) {
  if (a->largest != b->largest) return a->largest < b->largest ? -1 : 1;
  return (uintptr_t)a < (uintptr_t)b ? -1 : (uintptr_t)a > (uintptr_t)b;
}

RB_GENERATE(pool_free_tree, pool_range, u.node, pool_free_cmp)
RB_GENERATE(pool_seg_tree, gmb_segment, by_id, pool_seg_cmp)
RB_GENERATE(pool_arena_tree, gmb_arena, by_largest, pool_arena_cmp)

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

void gmb__pool_info(const struct gmb_pool *p, const struct pool_range *r,
                    struct gmb_alloc_info *out) {
  int live = pool_is_live(r);
  out->id = live ? pool_range_id(p, r) : 0;
  out->size = r->size;
  out->offset = r->offset;
  out->flags = r->flags & ~(POOL_MOVING_SRC | POOL_LOCK_SEEN | POOL_LOCK_HELD);
  out->tag = live ? r->u.live.tag : 0;
  out->owner = live ? r->u.live.owner : NULL;
  out->segment = r->seg;
  out->dseg = &r->seg->dseg;
  out->tail_dseg = NULL;
  out->tail_offset = out->tail_size = 0;
}

/* What alloc, free and find report of live allocation r: the whole of it,
 * its tail included (gmb__pool_info reports one range). */
static void pool_info_whole(const struct gmb_pool *p,
                            const struct pool_range *r,
                            struct gmb_alloc_info *out) {
  gmb__pool_info(p, r, out);
  const struct pool_range *t = r->u.live.tail;
  if (t) {
    out->size += t->size;
    out->tail_dseg = &t->seg->dseg;
    out->tail_offset = t->offset;
    out->tail_size = t->size;
  }
}

struct pool_range *gmb__pool_range_by_id(const struct gmb_pool *p,
                                         uint64_t id) {
  return pool_lookup(p, id);
}

uint64_t gmb__pool_range_id(const struct gmb_pool *p,
                            const struct pool_range *r) {
  return pool_range_id(p, r);
}

/* ---- segments --------------------------------------------------------- */

/* Arena a's largest free range in a small class may have changed: it is
 * searched for when the pool's figures are next asked for. */
static void pool_unsettle(struct gmb_arena *a) {
  if (a->unsettled) return;
  a->unsettled = 1;
  LIST_INSERT_HEAD(&a->pool->unsettled, a, unsettled_link);
}

/* Arena a takes its place in the pool's tree by its largest free range. */
static void pool_settle(struct gmb_pool *p, struct gmb_arena *a) {
  uint64_t largest = gmb__pool_arena_largest(a);
  if (largest != a->largest) {
    if (a->largest) RB_REMOVE(pool_arena_tree, &p->by_largest, a);
    a->largest = largest;
    if (largest) RB_INSERT(pool_arena_tree, &p->by_largest, a);
  }
  a->unsettled = 0;
  LIST_REMOVE(a, unsettled_link);
}

void gmb__pool_settle(struct gmb_pool *p) {
  while (!LIST_EMPTY(&p->unsettled)) pool_settle(p, LIST_FIRST(&p->unsettled));
}

/* The free bytes in arena a's segments grow (shrink) by `bytes`, and the
 * pool's sum with them. */
static void pool_free_add(struct gmb_arena *a, uint64_t bytes) {
  a->free_total += bytes;
  a->pool->free_total += bytes;
}

static void pool_free_sub(struct gmb_arena *a, uint64_t bytes) {
  GMB_ASSERT(a->free_total >= bytes && a->pool->free_total >= bytes &&
             "free bytes counted");
  a->free_total -= bytes;
  a->pool->free_total -= bytes;
}

/* A sealed segment's free ranges stay out of the trees: no allocation,
 * tail or move target is ever placed there (gmb__pool_seal).  A change
 * of a small class's tree that may alter its arena's `largest` (a range
 * larger comes, or one as large goes) unsettles the arena. */
static void pool_tree_insert(struct gmb_arena *a, struct pool_range *r) {
  if (r->seg->sealed) return;
  struct pool_range *dup = RB_INSERT(pool_free_tree, &a->free[r->seg->cls], r);
  GMB_ASSERT(!dup && "free range keys are unique");
  if (pool_cls_small(r->seg->cls) && r->size > a->largest) pool_unsettle(a);
}

static void pool_tree_remove(struct gmb_arena *a, struct pool_range *r) {
  if (r->seg->sealed) return;
  RB_REMOVE(pool_free_tree, &a->free[r->seg->cls], r);
  if (pool_cls_small(r->seg->cls) && r->size >= a->largest) pool_unsettle(a);
}

/* Moves small segment s to class `cls` (its free ranges change trees):
 * O(ranges of s), and only when its first pinned allocation comes or its
 * last one goes. */
static void pool_seg_reclass(struct gmb_segment *s, uint32_t cls) {
  struct gmb_arena *a = s->arena;
  if (s->cls == cls) return;
  GMB_ASSERT(pool_cls_small(s->cls) && pool_cls_small(cls) &&
             "only small segments change class");
  for (struct pool_range *r = s->first; r; r = r->next)
    if (r->flags & GMB_RANGE_FREE) pool_tree_remove(a, r);
  s->cls = cls;
  for (struct pool_range *r = s->first; r; r = r->next)
    if (r->flags & GMB_RANGE_FREE) pool_tree_insert(a, r);
}

/* Clears live range r's lock notes (POOL_LOCK_*), with its segment's and
 * arena's counts. */
static void pool_held_drop(struct pool_range *r) {
  struct gmb_segment *s = r->seg;
  if ((r->flags & POOL_LOCK_HELD) && --s->held == 0) s->arena->held--;
  r->flags &= ~(POOL_LOCK_SEEN | POOL_LOCK_HELD);
}

void gmb__pool_note_lock(struct gmb_pool *p, const struct pool_range *cr,
                         int locked) {
  struct pool_range *r = (struct pool_range *)cr; /* ours to write */
  (void)p;
  if (!pool_is_live(r)) return;
  if (!locked) {
    pool_held_drop(r);
  } else if ((r->flags & POOL_LOCK_SEEN) && !(r->flags & POOL_LOCK_HELD)) {
    r->flags |= POOL_LOCK_HELD;
    if (r->seg->held++ == 0) r->seg->arena->held++;
  } else {
    r->flags |= POOL_LOCK_SEEN;
  }
}

static uint64_t pool_release_lingering(struct gmb_pool *p);
static void pool_move_drop(struct gmb_pool *p, struct pool_range *t,
                           int handle_empty);

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
  pool_free_add(a, size);
  p->segment_bytes += size;
  p->segments++;
  *out = s;
  return 0;
}

/* Returns segment s to the device, with whatever ranges it still has (live
 * ones are dropped from the slot table and the accounting).  `retire`: the
 * broker hears of it (0 only for one made a moment ago that nobody saw). */
static void pool_segment_drop(struct gmb_pool *p, struct gmb_segment *s,
                              int retire) {
  struct gmb_arena *a = s->arena;
  p->changes++;
  if (a->linger == s) {
    a->linger = NULL;
    p->lingering--;
  }
  /* Only a whole arena's end releases a segment that a move touches (an
   * idle segment has no target and no live source): drop those moves
   * first, so no range below is a target or a moving source.  A target
   * dropped in another segment of the arena leaves it to be released in
   * turn. */
  for (struct pool_range *t = p->moves, *tn; t; t = tn) {
    tn = t->u.target.next;
    if (t->seg == s || p->slots[t->slot].r->seg == s) pool_move_drop(p, t, 0);
  }
  for (struct pool_range *r = s->first, *nx; r; r = nx) {
    nx = r->next;
    if (r->flags & GMB_RANGE_FREE) {
      pool_tree_remove(a, r);
      pool_free_sub(a, r->size);
    } else {
      /* A tail's slot is its allocation's, released with that range
       * (only a whole arena's end releases a segment with live ranges,
       * and it releases all of them). */
      if (!(r->flags & GMB_RANGE_TAIL)) {
        pool_slot_release(p, r->slot);
        a->allocations--;
        p->allocations--;
      }
      a->used -= r->size;
      p->used -= r->size;
    }
    pool_range_put(p, r);
  }
  if (retire && p->retire) p->retire(p->ctx, &s->dseg, a->tag);
  RB_REMOVE(pool_seg_tree, &p->segs, s);
  LIST_REMOVE(s, link);
  a->segment_bytes -= s->dseg.size;
  a->segments--;
  p->segment_bytes -= s->dseg.size;
  p->segments--;
  gmb__device_seg_free(p->dev, &s->dseg);
  free(s);
}

static void pool_segment_release(struct gmb_pool *p, struct gmb_segment *s) {
  pool_segment_drop(p, s, 1);
}

/* Segment s just lost its last live range: release it, or let it linger
 * (small class), releasing the arena's previous lingering one. */
static void pool_segment_emptied(struct gmb_pool *p, struct gmb_segment *s) {
  struct gmb_arena *a = s->arena;
  if (!pool_cls_small(s->cls) || s->sealed) {
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

static int pool_accept_held(void *ctx, const struct gmb_segment *s) {
  (void)ctx;
  return s->held > 0;
}

/* A pinned request with no pinned range: the best fit among the free
 * ranges of movable segments that hold a lock held across compaction
 * runs (they count as pinned: pool.h rule 2), which then becomes pinned;
 * or NULL. */
static struct pool_range *pool_fit_held(struct gmb_pool *p,
                                        struct gmb_arena *a, uint64_t need) {
  struct pool_range *best =
      gmb__pool_fit(p, a, POOL_SMALL_MOVABLE, need, pool_accept_held, NULL);
  if (best) pool_seg_reclass(best->seg, POOL_SMALL_PINNED);
  return best;
}

/* Takes `need` bytes at the start of free range r (at its end with
 * `at_end`) for a live range of `flags` and `owner` (the rest, if any,
 * stays free), with the counts of its segment, arena and pool; the slot
 * and the allocation counts are the caller's.  Returns the live range.
 * One range struct reserved. */
static struct pool_range *pool_take(struct gmb_pool *p, struct pool_range *r,
                                    uint64_t need, uint32_t flags, void *owner,
                                    int at_end) {
  struct gmb_segment *s = r->seg;
  struct gmb_arena *a = s->arena;
  pool_tree_remove(a, r);
  pool_free_sub(a, r->size);
  if (at_end && r->size > need) {
    /* The free rest stays below, in r; the new range above it. */
    struct pool_range *top = pool_range_get(p);
    top->seg = s;
    top->offset = r->offset + r->size - need;
    top->size = need;
    top->prev = r;
    top->next = r->next;
    if (r->next) r->next->prev = top;
    r->next = top;
    r->size -= need;
    pool_tree_insert(a, r);
    pool_free_add(a, r->size);
    r = top;
  } else if (r->size > need) {
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
    pool_free_add(a, rest->size);
  }
  r->flags = flags;
  r->u.live.owner = owner;
  r->u.live.tag = 0;
  r->u.live.tail = NULL;
  if (s->live++ == 0 && a->linger == s) {
    a->linger = NULL;
    p->lingering--;
  }
  if (!(flags & GMB_MOVABLE)) s->pinned++;
  if (flags & GMB_RANGE_TAIL) s->tails++;
  s->used += need;
  a->used += need;
  p->used += need;
  return r;
}

/* Free ranges a tail's placement looks at before it gives up on the
 * segments the arena has: a bound on the work of one large request. */
#define POOL_TAIL_SCAN 64u

/* The smallest free range of at least `size` bytes at either end of one
 * of arena a's small segments of class `cls` (a tail must touch its
 * segment's first or last byte: the client maps the large allocation's
 * pages right after or right before that segment), the lingering one
 * aside, among the POOL_TAIL_SCAN smallest that fit; or NULL. */
static struct pool_range *pool_tail_fit(const struct gmb_arena *a,
                                        uint32_t cls, uint64_t size) {
  struct gmb_segment key_seg = {.dseg = {.id = 0}};
  struct pool_range key = {.seg = &key_seg, .size = size, .offset = 0};
  struct pool_free_tree *tree = (struct pool_free_tree *)&a->free[cls];
  unsigned n = 0;
  for (struct pool_range *r = RB_NFIND(pool_free_tree, tree, &key);
       r && n < POOL_TAIL_SCAN; r = RB_NEXT(pool_free_tree, tree, r), n++)
    if (r->seg != a->linger &&
        (r->offset == 0 || r->offset + r->size == r->seg->dseg.size))
      return r;
  return NULL;
}

/* Where the tail of a large allocation goes (pool.h rule 1): a free range
 * at an end of a pinned small segment, else the lingering segment, else a
 * new small segment, else (the device full) a movable segment's.  Without
 * grouping, the best fit among both classes first.  The segment is made
 * pinned by the caller.  0 with *out, or GMB_E_NOMEM or a device error.
 * Reserved: one range struct (a new segment's). */
static int pool_tail_place(struct gmb_pool *p, struct gmb_arena *a,
                           uint64_t size, struct pool_range **out) {
  struct pool_range *r = pool_tail_fit(a, POOL_SMALL_PINNED, size);
  if (!p->grouping) {
    struct pool_range *o = pool_tail_fit(a, POOL_SMALL_MOVABLE, size);
    if (o && (!r || o->size < r->size)) r = o;
  }
  if (!r && a->linger) r = a->linger->first;
  if (!r) {
    struct gmb_segment *s;
    int rc = pool_segment_new(p, a, POOL_SMALL_PINNED, GMB_POOL_SMALL_SEGMENT,
                              &s);
    if (rc == 0) r = s->first;
    if (rc == GMB_E_NOMEM) r = pool_tail_fit(a, POOL_SMALL_MOVABLE, size);
    if (!r) return rc ? rc : GMB_E_NOMEM;
  }
  *out = r;
  return 0;
}

/* A request of whole pages plus a tail (pool.h rule 1): the pages first
 * (a new segment under pressure releases the lingering ones, which the
 * tail's placement must not have picked yet), then the tail; a tail with
 * no room gives the pages back.  The allocation is pinned. */
static int pool_alloc_large(struct gmb_pool *p, struct gmb_arena *a,
                            uint64_t pages, uint64_t tail, void *owner,
                            struct pool_range **out) {
  struct gmb_segment *s;
  int rc = pool_segment_new(p, a, POOL_LARGE, pages, &s);
  if (rc) return rc;
  struct pool_range *t = NULL;
  if (tail) {
    rc = pool_tail_place(p, a, tail, &t);
    if (rc) {
      pool_segment_drop(p, s, 0);
      return rc;
    }
  }
  struct pool_range *r = pool_take(p, s->first, pages, 0, owner, 0);
  if (t) {
    /* At the segment's start when it can be, else at its end. */
    t = pool_take(p, t, tail, GMB_RANGE_TAIL, owner, t->offset != 0);
    pool_seg_reclass(t->seg, POOL_SMALL_PINNED);
    r->u.live.tail = t;
  }
  *out = r;
  return 0;
}

int gmb__pool_alloc(struct gmb_pool *p, struct gmb_arena *a, uint64_t size,
                    uint32_t flags, void *owner, struct gmb_alloc_info *out) {
  if (size == 0 || size > UINT64_MAX - (GMB_SEGMENT_ALIGN - 1) ||
      (flags & (GMB_RANGE_FREE | GMB_RANGE_TAIL)))
    return GMB_E_INVAL;
  uint64_t need = (size + GMB_POOL_ALIGN - 1) & ~(uint64_t)(GMB_POOL_ALIGN - 1);
  /* Large: pinned, its whole pages in a segment of its own and its tail in
   * a small segment (rule 1); under a page, all of it is tail, placed as a
   * small pinned request. */
  uint64_t pages = 0, tail = 0;
  if (need > GMB_POOL_SMALL_MAX) {
    flags &= ~(uint32_t)GMB_MOVABLE;
    pages = need & ~(GMB_SEGMENT_ALIGN - 1);
    tail = need - pages;
  }
  uint32_t cls = (flags & GMB_MOVABLE) ? POOL_SMALL_MOVABLE : POOL_SMALL_PINNED;
  /* Reserve everything that can fail before changing anything: range
   * structs for two new segments and the rest of a split, and a slot. */
  int rc = pool_ranges_reserve(p, 3);
  if (rc == 0) rc = pool_slot_reserve(p);
  if (rc != 0) return rc;

  struct pool_range *r = NULL;
  if (pages) {
    rc = pool_alloc_large(p, a, pages, tail, owner, &r);
    if (rc) return rc;
    goto taken;
  }
  /* Placement (pool.h): a small request takes the best fit among the free
   * ranges of its class (pinned with pinned, movable with movable), else
   * the arena's lingering segment, else a new segment. */
  struct gmb_segment key_seg = {.dseg = {.id = 0}};
  struct pool_range key = {.seg = &key_seg, .size = need, .offset = 0};
  r = RB_NFIND(pool_free_tree, &a->free[cls], &key);
  uint32_t other =
      cls == POOL_SMALL_PINNED ? POOL_SMALL_MOVABLE : POOL_SMALL_PINNED;
  if (!p->grouping) {
    /* Without compaction nothing is ever moved, so grouping by mobility
     * buys nothing and costs a second partly used segment: the best fit
     * in either class (a pinned allocation makes its segment pinned). */
    struct pool_range *o = RB_NFIND(pool_free_tree, &a->free[other], &key);
    if (o && (!r || o->size < r->size)) r = o;
  }
  if (!r && cls == POOL_SMALL_PINNED && a->held) r = pool_fit_held(p, a, need);
  if (!r && a->linger) r = a->linger->first;
  if (!r) {
    struct gmb_segment *s;
    rc = pool_segment_new(p, a, cls, GMB_POOL_SMALL_SEGMENT, &s);
    if (rc == 0) r = s->first;
    /* The device is full: fall back to the other class's free ranges
     * rather than refuse (placement rule 2's last resort). */
    if (rc == GMB_E_NOMEM)
      r = RB_NFIND(pool_free_tree, &a->free[other], &key);
    if (!r) return rc ? rc : GMB_E_NOMEM;
  }
  r = pool_take(p, r, need, flags, owner, 0);
  /* A pinned allocation makes its segment pinned; a movable one taking
   * the lingering segment makes it movable (it lingered as movable). */
  if (cls == POOL_SMALL_PINNED) pool_seg_reclass(r->seg, POOL_SMALL_PINNED);
taken:;
  uint64_t id = pool_slot_take(p, r);
  if (r->u.live.tail) r->u.live.tail->slot = r->slot;
  a->allocations++;
  p->allocations++;
  p->changes++;
  if (out) {
    pool_info_whole(p, r, out);
    out->id = id;
  }
  POOL_DEBUG_CHECK(p);
  return 0;
}

/* Makes r (no longer live or target; its counts already adjusted) a free
 * range: merged with free neighbours and put in the tree.  The arena's
 * free_total is the caller's.  Returns the free range that covers r. */
static struct pool_range *pool_coalesce(struct gmb_pool *p,
                                        struct pool_range *r) {
  struct gmb_arena *a = r->seg->arena;
  p->changes++; /* every free, drop and commit ends here */
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

/* Finds the target of the move of live range r (which has POOL_MOVING_SRC). */
static struct pool_range *pool_move_target_of(const struct gmb_pool *p,
                                              const struct pool_range *r) {
  for (struct pool_range *t = p->moves; t; t = t->u.target.next)
    if (t->slot == r->slot) return t;
  GMB_ASSERT(0 && "a moving allocation has a target");
  return NULL;
}

/* Frees live range r: its move if one is in flight (the target's segment
 * is dealt with only when handle_empty), slot, accounting, coalescing, and
 * its tail if it has one.  Returns the free range that now covers r's
 * bytes.  The caller deals with r's segment, and the tail's, if they
 * emptied. */
static struct pool_range *pool_range_free(struct gmb_pool *p,
                                          struct pool_range *r,
                                          int handle_empty) {
  if (r->flags & POOL_MOVING_SRC)
    pool_move_drop(p, pool_move_target_of(p, r), handle_empty);
  struct gmb_segment *s = r->seg;
  struct gmb_arena *a = s->arena;
  struct pool_range *tail = r->u.live.tail; /* the union is reused below */
  if (r->flags & GMB_RANGE_TAIL) {
    s->tails--; /* the slot is its allocation's */
  } else {
    pool_slot_release(p, r->slot);
    a->allocations--;
    p->allocations--;
  }
  pool_held_drop(r);
  s->live--;
  if (!(r->flags & GMB_MOVABLE)) s->pinned--;
  s->used -= r->size;
  a->used -= r->size;
  pool_free_add(a, r->size);
  p->used -= r->size;
  struct pool_range *f = pool_coalesce(p, r);
  /* Its last pinned allocation gone, the segment is movable again (and
   * compaction may empty it). */
  if (s->cls == POOL_SMALL_PINNED && s->pinned == 0)
    pool_seg_reclass(s, POOL_SMALL_MOVABLE);
  if (tail) pool_range_free(p, tail, handle_empty);
  return f;
}

int gmb__pool_free(struct gmb_pool *p, uint64_t id,
                   struct gmb_alloc_info *info) {
  struct pool_range *r = pool_lookup(p, id);
  if (!r) return GMB_E_NOENT;
  if (info) pool_info_whole(p, r, info);
  struct gmb_segment *s = r->seg;
  struct gmb_segment *ts = r->u.live.tail ? r->u.live.tail->seg : NULL;
  struct gmb_arena *a = s->arena;
  pool_range_free(p, r, 1);
  /* The tail's small segment first: it may linger, and a large segment
   * that empties is released whatever lingers. */
  if (ts && pool_seg_idle(ts)) {
    pool_segment_emptied(p, ts);
    if (info && a->linger != ts) info->tail_dseg = NULL;
  }
  if (pool_seg_idle(s)) {
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
  if (out) pool_info_whole(p, r, out);
  return 0;
}

/* ---- moves ------------------------------------------------------------ */

/* Unlinks target t from the pool's list of moves and clears its source's
 * mark.  The target's counts are the caller's. */
static void pool_move_unlink(struct gmb_pool *p, struct pool_range *t) {
  struct pool_range **pp = &p->moves;
  while (*pp != t) {
    GMB_ASSERT(*pp && "a target is in the list of moves");
    pp = &(*pp)->u.target.next;
  }
  *pp = t->u.target.next;
  p->nmoves--;
  struct pool_range *src = p->slots[t->slot].r;
  GMB_ASSERT(src && (src->flags & POOL_MOVING_SRC) &&
             "a target's allocation is marked moving");
  src->flags &= ~POOL_MOVING_SRC;
}

/* Drops move target t: it becomes free.  With handle_empty, a segment
 * left with nothing in it is released or lingers, as after a free. */
static void pool_move_drop(struct gmb_pool *p, struct pool_range *t,
                           int handle_empty) {
  struct gmb_segment *s = t->seg;
  struct gmb_arena *a = s->arena;
  pool_move_unlink(p, t);
  s->targets--;
  s->reserved -= t->size;
  a->moving -= t->size;
  pool_free_add(a, t->size);
  pool_coalesce(p, t);
  if (handle_empty && pool_seg_idle(s) && a->linger != s)
    pool_segment_emptied(p, s);
}

static struct pool_range *pool_move_find(const struct gmb_pool *p,
                                         uint64_t serial) {
  for (struct pool_range *t = p->moves; t; t = t->u.target.next)
    if (t->u.target.serial == serial) return t;
  return NULL;
}

struct pool_range *gmb__pool_range_at(const struct gmb_segment *s,
                                      uint64_t off) {
  struct pool_range *r = s->first;
  while (r && r->offset + r->size <= off) r = r->next;
  return r;
}

int gmb__pool_move_begin(struct gmb_pool *p, uint64_t id, uint64_t seg_id,
                         uint64_t dst_offset, struct gmb_pool_move *out) {
  struct pool_range *r = pool_lookup(p, id);
  struct gmb_segment *t = gmb__pool_seg_by_id(p, seg_id);
  if (!r || !t) return GMB_E_NOENT;
  struct pool_range *fr = gmb__pool_range_at(t, dst_offset);
  if (!fr) return GMB_E_INVAL;
  return gmb__pool_move_begin_at(p, id, fr, dst_offset, out);
}

int gmb__pool_move_begin_at(struct gmb_pool *p, uint64_t id,
                            struct pool_range *fr, uint64_t dst_offset,
                            struct gmb_pool_move *out) {
  struct pool_range *r = pool_lookup(p, id);
  if (!r) return GMB_E_NOENT;
  struct gmb_segment *s = r->seg, *t = fr->seg;
  /* Only movable small allocations move, into small segments of their
   * arena (of either class: compaction may fill a pinned segment's holes,
   * pool.h).  A large allocation is its own segment: moving it would
   * gather nothing. */
  if ((r->flags & POOL_MOVING_SRC) || !(r->flags & GMB_MOVABLE) ||
      t->arena != s->arena || !pool_cls_small(s->cls) ||
      !pool_cls_small(t->cls) || t->sealed || dst_offset % GMB_POOL_ALIGN ||
      (t == s && dst_offset >= r->offset))
    return GMB_E_INVAL;
  if (!(fr->flags & GMB_RANGE_FREE) || fr->offset > dst_offset ||
      fr->offset + fr->size <= dst_offset)
    return GMB_E_INVAL;
  uint64_t lo = dst_offset, hi, fr_end = fr->offset + fr->size;
  if (r->size <= fr_end - lo)
    hi = lo + r->size;
  else if (fr->next == r) /* a slide that overlaps its old place */
    hi = fr_end;
  else
    return GMB_E_INVAL;
  int rc = pool_ranges_reserve(p, 2);
  if (rc != 0) return rc;

  struct gmb_arena *a = t->arena;
  pool_tree_remove(a, fr);
  pool_free_sub(a, fr->size);
  if (lo > fr->offset) { /* the free piece below stays free */
    struct pool_range *below = pool_range_get(p);
    below->seg = t;
    below->offset = fr->offset;
    below->size = lo - fr->offset;
    below->flags = GMB_RANGE_FREE;
    below->prev = fr->prev;
    below->next = fr;
    if (fr->prev)
      fr->prev->next = below;
    else
      t->first = below;
    fr->prev = below;
    pool_tree_insert(a, below);
    pool_free_add(a, below->size);
  }
  if (hi < fr_end) { /* and so does the piece above */
    struct pool_range *above = pool_range_get(p);
    above->seg = t;
    above->offset = hi;
    above->size = fr_end - hi;
    above->flags = GMB_RANGE_FREE;
    above->prev = fr;
    above->next = fr->next;
    if (fr->next) fr->next->prev = above;
    fr->next = above;
    pool_tree_insert(a, above);
    pool_free_add(a, above->size);
  }
  fr->offset = lo;
  fr->size = hi - lo;
  fr->flags = GMB_RANGE_TARGET;
  fr->slot = r->slot;
  fr->u.target.serial = ++p->next_serial;
  fr->u.target.next = p->moves;
  p->moves = fr;
  p->nmoves++;
  r->flags |= POOL_MOVING_SRC;
  p->changes++;
  if (a->linger == t) { /* no longer empty */
    a->linger = NULL;
    p->lingering--;
  }
  t->targets++;
  t->reserved += fr->size;
  a->moving += fr->size;
  if (out) {
    out->serial = fr->u.target.serial;
    out->id = id;
    out->size = r->size;
    out->src = &s->dseg;
    out->dst = &t->dseg;
    out->src_offset = r->offset;
    out->dst_offset = lo;
  }
  POOL_DEBUG_CHECK(p);
  return 0;
}

int gmb__pool_move_commit(struct gmb_pool *p, const struct gmb_pool_move *m,
                          struct gmb_alloc_info *moved, uint64_t *released) {
  if (released) *released = 0;
  struct pool_range *t = pool_move_find(p, m->serial);
  if (!t) return GMB_E_NOENT;
  pool_move_unlink(p, t);
  struct pool_range *r = p->slots[t->slot].r;
  struct gmb_segment *ts = t->seg, *s = r->seg;
  struct gmb_arena *a = s->arena;
  ts->targets--;
  ts->reserved -= t->size;
  a->moving -= t->size;
  struct pool_range *now;
  if (t->size < r->size) {
    /* A slide that overlaps: [t][r] becomes [r][t], t the freed tail. */
    GMB_ASSERT(t->next == r && ts == s && "an overlapping target is below");
    uint64_t shift = t->size;
    r->prev = t->prev;
    if (t->prev)
      t->prev->next = r;
    else
      s->first = r;
    t->next = r->next;
    if (r->next) r->next->prev = t;
    r->next = t;
    t->prev = r;
    r->offset -= shift;
    t->offset = r->offset + r->size;
    pool_free_add(a, shift);
    pool_coalesce(p, t);
    now = r;
  } else {
    /* The target becomes the allocation; the old range is freed.  (A
     * move was claimed, so its lock was free: nothing of it is held.) */
    pool_held_drop(r);
    t->flags = r->flags;
    t->u.live = r->u.live;
    t->slot = r->slot;
    p->slots[t->slot].r = t;
    ts->live++;
    ts->used += t->size;
    if (!(t->flags & GMB_MOVABLE)) ts->pinned++;
    s->live--;
    s->used -= r->size;
    if (!(r->flags & GMB_MOVABLE)) s->pinned--;
    pool_free_add(a, r->size);
    pool_coalesce(p, r);
    now = t;
    if (pool_seg_idle(s)) {
      /* Emptied by compaction: released, not lingering. */
      if (released) *released = s->dseg.size;
      pool_segment_release(p, s);
    }
  }
  if (moved) {
    gmb__pool_info(p, now, moved);
  }
  POOL_DEBUG_CHECK(p);
  return 0;
}

int gmb__pool_move_abort(struct gmb_pool *p, const struct gmb_pool_move *m) {
  struct pool_range *t = pool_move_find(p, m->serial);
  if (!t) return GMB_E_NOENT;
  pool_move_drop(p, t, 1);
  POOL_DEBUG_CHECK(p);
  return 0;
}

int gmb__pool_set_tag(struct gmb_pool *p, uint64_t id, uint32_t tag) {
  struct pool_range *r = pool_lookup(p, id);
  if (!r) return GMB_E_NOENT;
  r->u.live.tag = tag;
  return 0;
}

uint64_t gmb__pool_free_owner(struct gmb_pool *p, struct gmb_arena *a,
                              void *owner) {
  uint64_t bytes = 0;
  /* Two passes: freeing a moving allocation drops its target, which may
   * empty another segment of the arena; releasing segments only in the
   * second pass keeps the first pass's walk valid.  A move within one
   * segment targets lower offsets, behind the walk. */
  struct gmb_segment *s, *nx;
  LIST_FOREACH(s, &a->segs, link) {
    for (struct pool_range *r = s->first; r;) {
      /* A tail goes with its allocation. */
      if (!pool_is_live(r) || r->u.live.owner != owner ||
          (r->flags & GMB_RANGE_TAIL)) {
        r = r->next;
        continue;
      }
      bytes += r->size + (r->u.live.tail ? r->u.live.tail->size : 0);
      /* The merged free range is followed by a live range, a target or
       * nothing. */
      r = pool_range_free(p, r, 0)->next;
    }
  }
  for (s = LIST_FIRST(&a->segs); s; s = nx) {
    nx = LIST_NEXT(s, link);
    if (pool_seg_idle(s) && a->linger != s) {
      /* Emptying s may release the arena's lingering segment; it has no
       * live range, so skipping it in this walk loses nothing. */
      if (nx && nx == a->linger) nx = LIST_NEXT(nx, link);
      pool_segment_emptied(p, s);
    }
  }
  POOL_DEBUG_CHECK(p);
  return bytes;
}

int gmb__pool_free_owners_step(struct gmb_pool *p, struct gmb_arena *a,
                               gmb_pool_doomed_fn doomed,
                               gmb_pool_freed_fn freed, void *ctx,
                               uint64_t *cursor, uint64_t budget) {
  struct gmb_segment *s = NULL;
  if (*cursor) {
    s = gmb__pool_seg_by_id(p, *cursor);
    if (s && s->arena != a) s = NULL;
  }
  /* No cursor, or its segment went back to the device meanwhile: from the
   * head (what was freed before is free ranges now, quickly skipped). */
  if (s == NULL) s = LIST_FIRST(&a->segs);
  uint64_t visited = 0;
  int dropped = 0; /* another segment may have gone idle */
  while (s && visited < budget) {
    for (struct pool_range *r = s->first; r; visited++) {
      if (!pool_is_live(r) || (r->flags & GMB_RANGE_TAIL) ||
          !doomed(ctx, r->u.live.owner)) {
        r = r->next;
        continue;
      }
      void *owner = r->u.live.owner;
      uint64_t bytes = r->size + (r->u.live.tail ? r->u.live.tail->size : 0);
      /* A dropped move's target, or a tail, may leave another segment
       * idle (one this walk may have passed). */
      dropped |= (r->flags & POOL_MOVING_SRC) || r->u.live.tail;
      /* Segments are released below, never in the middle of this walk
       * (as in gmb__pool_free_owner). */
      r = pool_range_free(p, r, 0)->next;
      freed(ctx, owner, bytes);
    }
    struct gmb_segment *nx = LIST_NEXT(s, link);
    if (pool_seg_idle(s) && a->linger != s) {
      if (nx && nx == a->linger) nx = LIST_NEXT(nx, link);
      pool_segment_emptied(p, s);
    }
    s = nx;
  }
  if (dropped) {
    /* Release what a dropped target or a freed tail left idle, as
     * gmb__pool_free_owner does: O(the arena's segments), only after a
     * large allocation or a move (the broker stops the moves of what it
     * frees first). */
    uint64_t at = s ? s->dseg.id : 0;
    struct gmb_segment *x, *xn;
    for (x = LIST_FIRST(&a->segs); x; x = xn) {
      xn = LIST_NEXT(x, link);
      if (pool_seg_idle(x) && a->linger != x) {
        if (xn && xn == a->linger) xn = LIST_NEXT(xn, link);
        pool_segment_emptied(p, x);
      }
    }
    s = at ? gmb__pool_seg_by_id(p, at) : NULL;
    if (at && s == NULL) s = LIST_FIRST(&a->segs);
  }
  *cursor = s ? s->dseg.id : 0;
  POOL_DEBUG_CHECK(p);
  return s == NULL;
}

uint64_t gmb__pool_trim(struct gmb_pool *p) {
  uint64_t bytes = pool_release_lingering(p);
  pool_chunks_trim(p);
  POOL_DEBUG_CHECK(p);
  return bytes;
}

int gmb__pool_seal(struct gmb_pool *p, uint64_t seg_id) {
  struct gmb_segment *s = gmb__pool_seg_by_id(p, seg_id);
  if (s == NULL) return GMB_E_NOENT;
  if (s->sealed) return 0;
  struct gmb_arena *a = s->arena;
  p->changes++;
  if (pool_seg_idle(s)) { /* lingering: nothing in it to keep */
    pool_segment_release(p, s);
    return 0;
  }
  for (struct pool_range *r = s->first; r; r = r->next)
    if (r->flags & GMB_RANGE_FREE) pool_tree_remove(a, r);
  s->sealed = 1;
  POOL_DEBUG_CHECK(p);
  return 0;
}

size_t gmb__pool_seal_arena(struct gmb_pool *p, struct gmb_arena *a) {
  size_t n = 0;
  struct gmb_segment *s, *nx;
  for (s = LIST_FIRST(&a->segs); s; s = nx) {
    nx = LIST_NEXT(s, link); /* sealing an empty one releases it */
    if (!s->sealed && !pool_seg_idle(s)) n++;
    gmb__pool_seal(p, s->dseg.id);
  }
  return n;
}

int gmb__pool_segment_add(struct gmb_pool *p, struct gmb_arena *a,
                          uint64_t *seg_id) {
  int rc = pool_ranges_reserve(p, 1);
  if (rc != 0) return rc;
  struct gmb_segment *s;
  rc = pool_segment_new(p, a, POOL_SMALL_MOVABLE, GMB_POOL_SMALL_SEGMENT, &s);
  if (rc != 0) return rc;
  p->changes++;
  /* Empty until the caller's move begins: it lingers meanwhile, which
   * keeps the checks' rule (an empty segment lingers or is gone). */
  if (a->linger) pool_segment_release(p, a->linger);
  a->linger = s;
  p->lingering++;
  *seg_id = s->dseg.id;
  return 0;
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
  RB_INIT(&p->by_largest);
  LIST_INIT(&p->unsettled);
  p->next_seg_id = 1;
  p->slot_free = POOL_SLOT_NONE;
  p->grouping = 1;
  return p;
}

void gmb__pool_set_grouping(struct gmb_pool *p, int on) { p->grouping = on; }

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
  a->pool = p;
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
  GMB_ASSERT(a->free_total == 0 &&
             "an arena with no segments has no free range");
  if (a->unsettled) pool_settle(p, a);
  GMB_ASSERT(a->largest == 0 && "an arena with no free range is in no tree");
  LIST_REMOVE(a, link);
  free(a);
  POOL_DEBUG_CHECK(p);
}

struct gmb_device *gmb__pool_device(const struct gmb_pool *p) {
  return p->dev;
}

struct gmb_segment *gmb__pool_seg_by_id(const struct gmb_pool *p,
                                        uint64_t id) {
  struct gmb_segment key = {.dseg = {.id = id}};
  return RB_FIND(pool_seg_tree, (struct pool_seg_tree *)&p->segs, &key);
}

struct gmb_segment *gmb__pool_seg_next(const struct gmb_pool *p,
                                       const struct gmb_segment *s) {
  if (!s) return RB_MIN(pool_seg_tree, (struct pool_seg_tree *)&p->segs);
  return RB_NEXT(pool_seg_tree, (struct pool_seg_tree *)&p->segs,
                 (struct gmb_segment *)s);
}

struct gmb_arena *gmb__pool_arena_next(const struct gmb_pool *p,
                                       const struct gmb_arena *a) {
  return a ? LIST_NEXT(a, link) : LIST_FIRST(&p->arenas);
}

struct pool_range *gmb__pool_fit(const struct gmb_pool *p,
                                 const struct gmb_arena *a, uint32_t cls,
                                 uint64_t size, gmb_pool_seg_accept_fn accept,
                                 void *ctx) {
  (void)p;
  struct gmb_segment key_seg = {.dseg = {.id = 0}};
  struct pool_range key = {.seg = &key_seg, .size = size, .offset = 0};
  struct pool_free_tree *tree = (struct pool_free_tree *)&a->free[cls];
  for (struct pool_range *r = RB_NFIND(pool_free_tree, tree, &key); r;
       r = RB_NEXT(pool_free_tree, tree, r))
    if (accept(ctx, r->seg)) return r;
  return NULL;
}

const struct gmb_dseg *gmb__pool_segment(const struct gmb_pool *p,
                                         uint64_t seg_id, void **arena_tag) {
  struct gmb_segment *s = gmb__pool_seg_by_id(p, seg_id);
  if (!s) return NULL;
  if (arena_tag) *arena_tag = s->arena->tag;
  return &s->dseg;
}
