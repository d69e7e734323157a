/*
 * pool_check.c - what the pool reports of itself: its figures
 * (gmb__pool_stats, gmb__pool_arena_stats), walks over its ranges
 * (gmb__pool_walk, gmb__pool_walk_from, for the snapshot and the map), and
 * gmb__pool_check(), which verifies every invariant pool.c keeps (pool.h,
 * pool_impl.h): the tests run it after each step, and a GMB_DEBUG build
 * after each change.  It only reads the pool's structures.
 */
#include <stdlib.h>
#include <string.h>

#include "gmb.h"
#include "log.h"
#include "pool.h"
#include "pool_impl.h"

uint64_t gmb__pool_arena_largest(const struct gmb_arena *a) {
  uint64_t largest = 0;
  /* The slack above a large allocation serves nobody: only small free
   * ranges count. */
  for (int c = 0; c < POOL_CLASSES; c++) {
    if (!pool_cls_small((uint32_t)c)) continue;
    struct pool_range *m =
        RB_MAX(pool_free_tree, (struct pool_free_tree *)&a->free[c]);
    if (m && m->size > largest) largest = m->size;
  }
  return largest;
}

void gmb__pool_arena_stats(const struct gmb_arena *a,
                           struct gmb_arena_stats *out) {
  out->used = a->used;
  out->allocations = a->allocations;
  out->segment_bytes = a->segment_bytes;
  out->segments = a->segments;
  out->free_total = a->free_total;
  out->moving = a->moving;
  out->held_segments = a->held;
  out->largest_free = a->unsettled ? gmb__pool_arena_largest(a) : a->largest;
}

/* The figures every gmb_pool_stats has: the pool's own totals, and the
 * room for new segments. */
static void pool_stats_common(const struct gmb_pool *p,
                              struct gmb_pool_stats *out) {
  out->capacity = p->dev->capacity;
  out->segment_bytes = p->segment_bytes;
  out->segments = p->segments;
  out->used = p->used;
  out->allocations = p->allocations;
  /* Room for a new segment; lingering ones are released before an
   * allocation gives up, so their bytes count as room too.  The device's
   * count includes segments it still waits to free (cuda's retiring
   * ones): they are no room yet. */
  uint64_t room = p->lingering * GMB_POOL_SMALL_SEGMENT;
  uint64_t taken =
      p->dev->in_use > p->segment_bytes ? p->dev->in_use : p->segment_bytes;
  if (p->dev->capacity > taken) room += p->dev->capacity - taken;
  room &= ~(GMB_SEGMENT_ALIGN - 1);
  out->room = room;
}

void gmb__pool_stats(const struct gmb_pool *p, struct gmb_pool_stats *out) {
  /* The arenas changed since the last figures take their places: what a
   * reader sees is the same, so the figures keep taking a const pool. */
  gmb__pool_settle((struct gmb_pool *)p);
  pool_stats_common(p, out);
  out->free_in_segments = p->free_total;
  const struct gmb_arena *top =
      RB_MAX(pool_arena_tree, (struct pool_arena_tree *)&p->by_largest);
  out->largest_free = top ? top->largest : 0;
  if (out->room > out->largest_free) out->largest_free = out->room;
}

void gmb__pool_stats_walk(const struct gmb_pool *p,
                          struct gmb_pool_stats *out) {
  ((struct gmb_pool *)p)->stats_walks++; /* a count, not the pool's state */
  pool_stats_common(p, out);
  out->free_in_segments = 0;
  out->largest_free = 0;
  const struct gmb_arena *a;
  LIST_FOREACH(a, &p->arenas, link) {
    out->free_in_segments += a->free_total;
    uint64_t largest = gmb__pool_arena_largest(a);
    if (largest > out->largest_free) out->largest_free = largest;
  }
  if (out->room > out->largest_free) out->largest_free = out->room;
}

uint64_t gmb__pool_stats_walks(const struct gmb_pool *p) {
  return p->stats_walks;
}

double gmb__fragmentation(uint64_t largest_free, uint64_t total_free) {
  if (total_free == 0 || largest_free >= total_free) return 0.0;
  return 1.0 - (double)largest_free / (double)total_free;
}

double gmb__pool_fragmentation(const struct gmb_pool *p, uint64_t *largest_free,
                               uint64_t *free_total) {
  struct gmb_pool_stats ps;
  gmb__pool_stats(p, &ps);
  uint64_t total = ps.capacity > ps.used ? ps.capacity - ps.used : 0;
  if (largest_free) *largest_free = ps.largest_free;
  if (free_total) *free_total = total;
  return gmb__fragmentation(ps.largest_free, total);
}

int gmb__pool_walk(const struct gmb_pool *p, gmb_pool_walk_fn fn, void *ctx) {
  return gmb__pool_walk_from(p, 0, 0, fn, ctx, NULL, NULL);
}

int gmb__pool_walk_from(const struct gmb_pool *p, uint64_t seg_id,
                        uint64_t offset, gmb_pool_walk_fn fn, void *ctx,
                        uint64_t *next_seg, uint64_t *next_offset) {
  if (next_seg) *next_seg = 0;
  if (next_offset) *next_offset = 0;
  struct pool_seg_tree *segs = (struct pool_seg_tree *)&p->segs;
  struct gmb_segment key = {.dseg = {.id = seg_id}};
  for (struct gmb_segment *s = RB_NFIND(pool_seg_tree, segs, &key); s;
       s = RB_NEXT(pool_seg_tree, segs, s)) {
    struct pool_range *r = s->first;
    /* Within the cursor's own segment, the ranges below it were seen. */
    if (s->dseg.id == seg_id)
      while (r && r->offset < offset) r = r->next;
    for (; r; r = r->next) {
      struct gmb_alloc_info info;
      gmb__pool_info(p, r, &info);
      /* A target: is_free 0 and id 0 (pool_info). */
      int rc = fn(ctx, &info, (r->flags & GMB_RANGE_FREE) != 0);
      if (rc) {
        if (next_seg) *next_seg = s->dseg.id;
        if (next_offset) *next_offset = r->offset;
        return rc;
      }
    }
  }
  return 0;
}

void gmb__pool_segment_view(const struct gmb_segment *s,
                            struct gmb_segment_view *out) {
  out->dseg = &s->dseg;
  out->arena_tag = s->arena->tag;
  out->used = s->used;
  out->small = pool_cls_small(s->cls);
}

uint64_t gmb__pool_changes(const struct gmb_pool *p, uint64_t *last_seg_id) {
  if (last_seg_id) *last_seg_id = p->next_seg_id - 1;
  return p->changes;
}

#define POOL_BAD(...)       \
  do {                      \
    log_error(__VA_ARGS__); \
    bad++;                  \
  } while (0)

static int pool_check_segment(const struct gmb_pool *p,
                              const struct gmb_segment *s, uint64_t *nfree,
                              uint64_t *free_bytes, uint64_t *moving) {
  int bad = 0;
  const struct gmb_arena *a = s->arena;
  unsigned long long sid = (unsigned long long)s->dseg.id;
  if (RB_FIND(pool_seg_tree, (struct pool_seg_tree *)&p->segs,
              (struct gmb_segment *)s) != s)
    POOL_BAD("pool check: segment %llu missing from the id tree", sid);
  if (pool_cls_small(s->cls) ? s->dseg.size != GMB_POOL_SMALL_SEGMENT
                             : s->dseg.size % GMB_SEGMENT_ALIGN != 0)
    POOL_BAD("pool check: segment %llu has size %llu for its class", sid,
             (unsigned long long)s->dseg.size);
  if (s->cls >= POOL_CLASSES)
    POOL_BAD("pool check: segment %llu has class %u", sid, s->cls);
  uint64_t off = 0, used = 0, reserved = 0;
  uint32_t live = 0, pinned = 0, targets = 0, held = 0, tails = 0;
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
      int in_tree =
          RB_FIND(pool_free_tree, (struct pool_free_tree *)&a->free[s->cls],
                  (struct pool_range *)r) == r;
      if (!s->sealed && !in_tree)
        POOL_BAD("pool check: seg %llu free range %llu not in its tree", sid,
                 ro);
      if (s->sealed && in_tree)
        POOL_BAD("pool check: sealed seg %llu free range %llu in a tree",
                 sid, ro);
      if (!s->sealed) (*nfree)++;
      *free_bytes += r->size;
    } else if (r->flags & GMB_RANGE_TARGET) {
      /* Its allocation is live, marked moving, of the same arena and
       * class, and either as large (elsewhere) or just above it and larger
       * (a slide that overlaps). */
      const struct pool_range *src =
          pool_slot_live(p, r->slot) ? p->slots[r->slot].r : NULL;
      if (!src || !(src->flags & POOL_MOVING_SRC) || !src->seg ||
          src->seg->arena != a || !pool_cls_small(src->seg->cls) ||
          !pool_cls_small(s->cls) || !(src->flags & GMB_MOVABLE) ||
          !(src->size == r->size || (src->size > r->size && r->next == src)))
        POOL_BAD(
            "pool check: seg %llu move target %llu has no moving "
            "allocation that fits it",
            sid, ro);
      int listed = 0;
      for (const struct pool_range *t = p->moves; t; t = t->u.target.next)
        listed += t == r;
      if (listed != 1)
        POOL_BAD("pool check: seg %llu move target %llu is listed %d times",
                 sid, ro, listed);
      targets++;
      reserved += r->size;
      *moving += r->size;
    } else if (r->flags & GMB_RANGE_TAIL) {
      /* A large allocation's tail: its slot names that allocation, in a
       * segment of its own, whose tail it is; pinned, in a small one. */
      const struct pool_range *head =
          pool_slot_live(p, r->slot) ? p->slots[r->slot].r : NULL;
      if (!head || head->u.live.tail != r || !head->seg ||
          head->seg->cls != POOL_LARGE || head->seg->arena != a ||
          head->u.live.owner != r->u.live.owner)
        POOL_BAD("pool check: seg %llu tail %llu is not the tail of a large "
                 "allocation of its arena", sid, ro);
      if (!pool_cls_small(s->cls) || (r->flags & GMB_MOVABLE) ||
          r->u.live.tail)
        POOL_BAD("pool check: seg %llu tail %llu is movable, has a tail or "
                 "lies in a large segment", sid, ro);
      if (r->size >= GMB_SEGMENT_ALIGN ||
          (r->offset != 0 && r->offset + r->size != s->dseg.size))
        POOL_BAD("pool check: seg %llu tail %llu of %llu bytes is not at "
                 "an end of its segment or not under a page", sid, ro,
                 (unsigned long long)r->size);
      live++;
      tails++;
      pinned++;
      used += r->size;
    } else {
      if (!pool_slot_live(p, r->slot) || p->slots[r->slot].r != r)
        POOL_BAD(
            "pool check: seg %llu live range %llu not in the slot "
            "table",
            sid, ro);
      if (r->u.live.tail && (!(r->u.live.tail->flags & GMB_RANGE_TAIL) ||
                             r->u.live.tail->slot != r->slot ||
                             s->cls != POOL_LARGE || (r->flags & GMB_MOVABLE)))
        POOL_BAD("pool check: seg %llu range %llu has a tail that is not "
                 "its own, or is not a pinned large allocation", sid, ro);
      if (r->flags & POOL_MOVING_SRC) {
        int n = 0;
        for (const struct pool_range *t = p->moves; t; t = t->u.target.next)
          n += t->slot == r->slot;
        if (n != 1)
          POOL_BAD("pool check: seg %llu moving range %llu has %d targets", sid,
                   ro, n);
      }
      live++;
      pinned += !(r->flags & GMB_MOVABLE);
      held += (r->flags & POOL_LOCK_HELD) != 0;
      if ((r->flags & POOL_LOCK_HELD) && !(r->flags & POOL_LOCK_SEEN))
        POOL_BAD("pool check: seg %llu range %llu held but never seen locked",
                 sid, ro);
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
  if (tails != s->tails)
    POOL_BAD("pool check: seg %llu counts %u tails, ranges say %u", sid,
             s->tails, tails);
  if (held != s->held)
    POOL_BAD("pool check: seg %llu counts %u held ranges, ranges say %u", sid,
             s->held, held);
  if (targets != s->targets || reserved != s->reserved || pinned != s->pinned)
    POOL_BAD(
        "pool check: seg %llu counts %u targets/%llu reserved/%u pinned, "
        "ranges say %u/%llu/%u",
        sid, s->targets, (unsigned long long)s->reserved, s->pinned, targets,
        (unsigned long long)reserved, pinned);
  /* Mobility grouping: a small segment's class says whether it holds a
   * pinned allocation; a large one holds exactly one allocation. */
  if (pool_cls_small(s->cls) &&
      s->cls != (pinned ? POOL_SMALL_PINNED : POOL_SMALL_MOVABLE))
    POOL_BAD("pool check: seg %llu has class %u with %u pinned allocations",
             sid, s->cls, pinned);
  if (!pool_cls_small(s->cls) && (live != 1 || targets != 0))
    POOL_BAD(
        "pool check: large seg %llu holds %u allocations and %u move "
        "targets (one allocation each)",
        sid, live, targets);
  if (live == 0 && targets == 0 && a->linger != s)
    POOL_BAD(
        "pool check: seg %llu is empty but neither released nor "
        "lingering",
        sid);
  return bad;
}

int gmb__pool_check(const struct gmb_pool *p) {
  int bad = 0;
  uint64_t segs = 0, seg_bytes = 0, used = 0, allocs = 0, lingering = 0;
  uint64_t all_free = 0, with_largest = 0, unsettled = 0;
  const struct gmb_arena *a;
  LIST_FOREACH(a, &p->arenas, link) {
    uint64_t nfree[POOL_CLASSES] = {0}, free_bytes = 0, moving = 0;
    uint64_t a_segs = 0, a_bytes = 0, a_used = 0, a_allocs = 0, a_held = 0;
    const struct gmb_segment *s;
    LIST_FOREACH(s, &a->segs, link) {
      if (s->arena != a)
        POOL_BAD("pool check: segment %llu in another arena's list",
                 (unsigned long long)s->dseg.id);
      uint64_t nf = 0;
      bad += pool_check_segment(p, s, &nf, &free_bytes, &moving);
      nfree[s->cls < POOL_CLASSES ? s->cls : 0] += nf;
      a_segs++;
      a_held += s->held > 0;
      a_bytes += s->dseg.size;
      a_used += s->used;
      a_allocs += s->live - s->tails;
    }
    if (a->linger) {
      lingering++;
      if (a->linger->arena != a || !pool_seg_idle(a->linger) ||
          a->linger->cls != POOL_SMALL_MOVABLE || a->linger->sealed)
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
    uint64_t largest = gmb__pool_arena_largest(a);
    if ((!a->unsettled && largest != a->largest) ||
        (a->largest != 0) !=
            (RB_FIND(pool_arena_tree, (struct pool_arena_tree *)&p->by_largest,
                     (struct gmb_arena *)a) == a))
      POOL_BAD("pool check: arena %p keeps %llu as its largest free range, "
               "its trees %llu (or the pool's tree of arenas disagrees)",
               a->tag, (unsigned long long)a->largest,
               (unsigned long long)largest);
    all_free += a->free_total;
    with_largest += a->largest != 0;
    unsettled += a->unsettled != 0;
    if (a_held != a->held)
      POOL_BAD(
          "pool check: arena %p counts %llu segments with held locks, "
          "its segments %llu",
          a->tag, (unsigned long long)a->held, (unsigned long long)a_held);
    if (a_segs != a->segments || a_bytes != a->segment_bytes ||
        a_used != a->used || a_allocs != a->allocations ||
        free_bytes != a->free_total || moving != a->moving ||
        a->used + a->free_total + a->moving != a->segment_bytes)
      POOL_BAD(
          "pool check: arena %p totals (segs %llu bytes %llu used %llu "
          "allocs %llu free %llu moving %llu) differ from its segments "
          "(%llu %llu %llu %llu %llu %llu)",
          a->tag, (unsigned long long)a->segments,
          (unsigned long long)a->segment_bytes, (unsigned long long)a->used,
          (unsigned long long)a->allocations, (unsigned long long)a->free_total,
          (unsigned long long)a->moving, (unsigned long long)a_segs,
          (unsigned long long)a_bytes, (unsigned long long)a_used,
          (unsigned long long)a_allocs, (unsigned long long)free_bytes,
          (unsigned long long)moving);
    segs += a_segs;
    seg_bytes += a_bytes;
    used += a_used;
    allocs += a_allocs;
  }
  uint64_t in_arena_tree = 0, listed = 0;
  struct gmb_arena *ta;
  RB_FOREACH(ta, pool_arena_tree, (struct pool_arena_tree *)&p->by_largest)
    in_arena_tree++;
  LIST_FOREACH(a, &p->unsettled, unsettled_link) listed++;
  if (listed != unsettled)
    POOL_BAD("pool check: %llu arenas on the unsettled list, %llu marked",
             (unsigned long long)listed, (unsigned long long)unsettled);
  if (all_free != p->free_total || in_arena_tree != with_largest)
    POOL_BAD("pool check: the pool counts %llu free bytes in segments and "
             "%llu arenas by largest free range; its arenas %llu and %llu",
             (unsigned long long)p->free_total,
             (unsigned long long)in_arena_tree, (unsigned long long)all_free,
             (unsigned long long)with_largest);
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
    if (!pool_is_live(r) || r->slot != i || !r->seg)
      POOL_BAD(
          "pool check: slot %u points at a range that is not its live "
          "allocation",
          i);
  }
  uint64_t nmoves = 0;
  for (const struct pool_range *t = p->moves; t; t = t->u.target.next) {
    nmoves++;
    if (!(t->flags & GMB_RANGE_TARGET) || !t->seg) {
      POOL_BAD(
          "pool check: the list of moves holds a range that is not a "
          "target");
      break;
    }
  }
  if (nmoves != p->nmoves)
    POOL_BAD("pool check: %llu moves listed, %llu counted",
             (unsigned long long)nmoves, (unsigned long long)p->nmoves);
  if (live_slots != p->allocations)
    POOL_BAD("pool check: %llu live slots for %llu allocations",
             (unsigned long long)live_slots,
             (unsigned long long)p->allocations);
  return bad;
}
