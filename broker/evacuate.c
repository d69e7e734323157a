/*
 * evacuate.c - moves live bytes out of sealed segments (evacuate.h).
 *
 * A step scans the arena's segments from the head of its list and works
 * the sealed ones range by range.  After every committed move it starts
 * over from the head: a commit may release the sealed segment it came
 * from, and a new target segment (gmb__pool_segment_add) may release the
 * arena's lingering one, so no pointer into the lists is kept across a
 * change.  Each restart follows a move that left one movable allocation
 * fewer in the sealed segments, so a step ends; its cost is the ranges of
 * the sealed segments per move (a 2 MiB segment has at most 4096).
 */
#include "evacuate.h"

#include <stdio.h>

#include "gmb.h"
#include "log.h"
#include "pool_impl.h"
#include "util.h"

static int evac_accept(void *ctx, const struct gmb_segment *s) {
  (void)ctx;
  return !s->sealed; /* sealed ranges are in no tree anyway */
}

/* Where `size` bytes of arena a may go: the holes of pinned segments
 * first, then movable segments' free ranges, else a new segment.  NULL
 * when the device has no room. */
static struct pool_range *evac_target(struct gmb_pool *p, struct gmb_arena *a,
                                      uint64_t size) {
  struct pool_range *t =
      gmb__pool_fit(p, a, POOL_SMALL_PINNED, size, evac_accept, NULL);
  if (!t) t = gmb__pool_fit(p, a, POOL_SMALL_MOVABLE, size, evac_accept, NULL);
  if (t) return t;
  uint64_t id;
  if (gmb__pool_segment_add(p, a, &id) != 0) return NULL;
  struct gmb_segment *s = gmb__pool_seg_by_id(p, id);
  return s ? s->first : NULL;
}

/* Moves live range r out of its sealed segment: 1 when the move was
 * committed, 0 when it stays (not claimed, or no room). */
static int evac_move(struct gmb_pool *p, struct gmb_arena *a,
                     struct pool_range *r, const struct gmb_compact_hooks *h,
                     struct gmb_evac_stats *st) {
  uint64_t id = gmb__pool_range_id(p, r);
  struct gmb_alloc_info info;
  if (gmb__pool_find(p, id, &info) != 0) return 0;
  if (h->claim && !h->claim(h->ctx, &info)) return 0;
  gmb__pool_note_lock(p, r, 0);
  struct pool_range *t = evac_target(p, a, r->size);
  struct gmb_pool_move mv;
  if (t == NULL || gmb__pool_move_begin_at(p, id, t, t->offset, &mv) != 0) {
    if (h->release) h->release(h->ctx, &info);
    return 0;
  }
  int rc = gmb__device_copy(gmb__pool_device(p), mv.dst, mv.dst_offset,
                            mv.src, mv.src_offset, mv.size);
  if (rc != 0) {
    log_error("revocation: copying %#llx failed (%s); it stays where it is",
              (unsigned long long)id, gmb_err_name(rc));
    gmb__pool_move_abort(p, &mv);
    if (h->release) h->release(h->ctx, &info);
    return 0;
  }
  struct gmb_alloc_info moved;
  if (gmb__pool_move_commit(p, &mv, &moved, NULL) != 0) return 0;
  st->moves++;
  st->bytes_moved += mv.size;
  if (h->publish) h->publish(h->ctx, &moved);
  return 1;
}

int gmb__evac_step(struct gmb_pool *p, struct gmb_arena *a,
                   const struct gmb_compact_hooks *h, uint64_t deadline_ns,
                   struct gmb_evac_stats *st) {
  for (;;) {
    struct gmb_evac_stats left = {0};
    int moved = 0;
    struct gmb_segment *s;
    LIST_FOREACH(s, &a->segs, link) {
      if (!s->sealed) continue;
      left.sealed++;
      for (struct pool_range *r = s->first; r && !moved; r = r->next) {
        if (!pool_is_live(r)) continue;
        if (!(r->flags & GMB_MOVABLE)) {
          left.pinned++;
          left.pinned_bytes += r->size;
          continue;
        }
        if (!(r->flags & POOL_MOVING_SRC) && evac_move(p, a, r, h, st)) {
          moved = 1;
          break;
        }
        left.locked++;
        left.locked_bytes += r->size;
      }
      if (moved) break;
    }
    if (moved) { /* the lists may have changed: from the head */
      if (gmb__now_ns() >= deadline_ns) return 1;
      continue;
    }
    st->pinned = left.pinned;
    st->pinned_bytes = left.pinned_bytes;
    st->locked = left.locked;
    st->locked_bytes = left.locked_bytes;
    st->sealed = left.sealed;
    return 0;
  }
}
