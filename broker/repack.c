/*
 * repack.c - plans a chain of moves that empties one small segment of an
 * arena (see repack.h for the contract).
 *
 * The model.  The planner copies the arena's small segments into plain
 * arrays (struct rk_seg: ranges in address order that tile the segment,
 * each free, fixed or movable) and plays the moves on that copy: a block
 * placed takes a piece of a free range, a block moved away leaves a free
 * range that merges with free neighbours, as in the pool.  Fixed ranges
 * are pinned or locked allocations and move targets in flight; they are
 * never moved and no window covers them.  So the model agrees with the
 * pool as long as the pool does not change, and every step it records
 * lands in a range that is free when the steps before it are done.
 *
 * Placing a block is the engine's best fit (compact_fit): the smallest
 * free range that holds it, pinned segments' holes first (those segments
 * cannot go back to the device anyway), then the smaller range, lower
 * segment id and offset.  A block that has no such place gets a window:
 * of the windows of its size that start where a range starts (or end at
 * a segment's end) and hold nothing fixed, the GMB_REPACK_WINDOWS cheapest
 * (bytes to move) are tried in turn on a copy of the model.  A window's
 * blocks need places of their own first, outside its segment and every
 * segment the chain already uses: a free range, or (one level deeper, at
 * most REPACK_DEPTH levels) a window again.  The first window that works
 * is kept.  A window never holds all the blocks of a segment without
 * fixed ones: that segment would empty and go back to the device before
 * the block could land in it.
 *
 * Emptying a segment places its blocks largest first; of the
 * GMB_REPACK_VICTIMS least used candidates, the plan that moves the
 * fewest bytes is kept.  A hole for a waiting request is a window for a
 * block that does not exist: its blocks move, and nothing moves in.  Or a
 * segment is packed (rk_pack_hole): its blocks, largest first, move to
 * best fits elsewhere while they have one, until sliding the rest down
 * (as the engine's slide pass would, lowest free range first) leaves the
 * hole; the segments with the most free bytes are tried, and the
 * cheapest of all those plans is kept.
 *
 * Work: each window tried copies the model (its ranges), and each fit
 * visits the ranges outside the chain's segments, so a plan costs at most
 * about (GMB_REPACK_WINDOWS * blocks per window)^REPACK_DEPTH copies per
 * block; the budget cuts it off long before that on a large arena.
 */
#include "repack.h"

#include <stdlib.h>
#include <string.h>

#include "gmb.h"

/* How deep a chain goes: a block's window, the windows of that window's
 * blocks, and no further.  GMB_REPACK_WINDOWS windows are tried for a
 * block, cheapest first. */
#define REPACK_DEPTH 2u

enum { RK_FREE, RK_FIXED, RK_MOVABLE };

struct rk_range {
  uint64_t off, size;
  uint64_t id; /* RK_MOVABLE: the allocation; else 0 */
  int kind;
};

struct rk_seg {
  uint64_t id, size;
  int pinned;         /* of class PINNED: its holes are taken first */
  struct rk_range *r; /* address order, tiling the segment */
  size_t n, cap;
  size_t movable, fixed; /* counts of those kinds */
  uint64_t moving;       /* bytes of its movable ranges */
};

struct rk_model {
  struct rk_seg *s;
  size_t n;
};

/* The segments a chain may not use: the victim, and the segments whose
 * windows the chain is making (at most REPACK_DEPTH + 1). */
struct rk_excl {
  uint64_t id[REPACK_DEPTH + 2];
  size_t n;
};

static int rk_excluded(const struct rk_excl *x, uint64_t id) {
  for (size_t i = 0; i < x->n; i++)
    if (x->id[i] == id) return 1;
  return 0;
}

struct rk_planner {
  uint64_t *budget;
  int stop;  /* the budget ran out, or host memory did */
  int nomem; /* host memory did */
};

/* Counts n units of work; 0 (and stop) once the budget is spent. */
static int rk_spend(struct rk_planner *pl, uint64_t n) {
  if (pl->stop) return 0;
  if (*pl->budget < n) {
    *pl->budget = 0;
    pl->stop = 1;
    return 0;
  }
  *pl->budget -= n;
  return 1;
}

static void rk_nomem(struct rk_planner *pl) {
  pl->stop = 1;
  pl->nomem = 1;
}

/* ---- the model --------------------------------------------------------- */

static void rk_model_free(struct rk_model *m) {
  for (size_t i = 0; i < m->n; i++) free(m->s[i].r);
  free(m->s);
  m->s = NULL;
  m->n = 0;
}

static int rk_seg_reserve(struct rk_planner *pl, struct rk_seg *s,
                          size_t want) {
  if (want <= s->cap) return 1;
  size_t cap = s->cap ? s->cap : 8;
  while (cap < want) cap *= 2;
  struct rk_range *r = realloc(s->r, cap * sizeof *r);
  if (!r) {
    rk_nomem(pl);
    return 0;
  }
  s->r = r;
  s->cap = cap;
  return 1;
}

static int rk_build(struct rk_planner *pl, const struct gmb_pool *p,
                    const struct gmb_arena *a, gmb_repack_movable_fn movable,
                    void *ctx, struct rk_model *m) {
  const struct gmb_segment *s;
  size_t n = 0;
  LIST_FOREACH(s, &a->segs, link) n += pool_cls_small(s->cls);
  m->s = calloc(n ? n : 1, sizeof *m->s);
  if (!m->s) {
    rk_nomem(pl);
    return 0;
  }
  LIST_FOREACH(s, &a->segs, link) {
    if (!pool_cls_small(s->cls)) continue;
    struct rk_seg *ms = &m->s[m->n++];
    ms->id = s->dseg.id;
    ms->size = s->dseg.size;
    ms->pinned = s->cls == POOL_SMALL_PINNED;
    for (const struct pool_range *r = s->first; r; r = r->next) {
      if (!rk_spend(pl, 1) || !rk_seg_reserve(pl, ms, ms->n + 1)) return 0;
      struct rk_range *x = &ms->r[ms->n++];
      x->off = r->offset;
      x->size = r->size;
      x->id = 0;
      /* A sealed segment's free bytes take nothing (gmb__pool_seal). */
      if ((r->flags & GMB_RANGE_FREE) && !s->sealed) {
        x->kind = RK_FREE;
      } else if (!(r->flags & (GMB_RANGE_TARGET | GMB_RANGE_FREE)) &&
                 movable(ctx, r)) {
        x->kind = RK_MOVABLE;
        x->id = gmb__pool_range_id(p, r);
        ms->movable++;
        ms->moving += r->size;
      } else {
        x->kind = RK_FIXED;
        ms->fixed++;
      }
    }
  }
  return 1;
}

/* *dst becomes a copy of *src with ranges of its own. */
static int rk_seg_dup(struct rk_planner *pl, struct rk_seg *dst,
                      const struct rk_seg *src) {
  *dst = *src;
  dst->r = NULL;
  dst->cap = 0;
  if (!rk_spend(pl, src->n) || !rk_seg_reserve(pl, dst, src->n + 2)) {
    dst->n = 0;
    return 0;
  }
  memcpy(dst->r, src->r, src->n * sizeof *src->r);
  return 1;
}

static int rk_copy(struct rk_planner *pl, struct rk_model *dst,
                   const struct rk_model *src) {
  dst->s = calloc(src->n ? src->n : 1, sizeof *dst->s);
  dst->n = 0;
  if (!dst->s) {
    rk_nomem(pl);
    return 0;
  }
  for (size_t i = 0; i < src->n; i++)
    if (!rk_seg_dup(pl, &dst->s[dst->n++], &src->s[i])) return 0;
  return 1;
}

static struct rk_seg *rk_seg(struct rk_model *m, uint64_t id) {
  for (size_t i = 0; i < m->n; i++)
    if (m->s[i].id == id) return &m->s[i];
  return NULL;
}

/* The index of s's range holding allocation id, or s->n. */
static size_t rk_find(const struct rk_seg *s, uint64_t id) {
  size_t j = 0;
  while (j < s->n && !(s->r[j].kind == RK_MOVABLE && s->r[j].id == id)) j++;
  return j;
}

/* Range j of s becomes free and merges with free neighbours. */
static void rk_release(struct rk_seg *s, size_t j) {
  struct rk_range *r = s->r;
  s->movable--;
  s->moving -= r[j].size;
  r[j].kind = RK_FREE;
  r[j].id = 0;
  if (j + 1 < s->n && r[j + 1].kind == RK_FREE) {
    r[j].size += r[j + 1].size;
    memmove(&r[j + 1], &r[j + 2], (s->n - j - 2) * sizeof *r);
    s->n--;
  }
  if (j > 0 && r[j - 1].kind == RK_FREE) {
    r[j - 1].size += r[j].size;
    memmove(&r[j], &r[j + 1], (s->n - j - 1) * sizeof *r);
    s->n--;
  }
}

/* Allocation id of `size` bytes takes [off, off + size) of s, which lies
 * in one free range.  0 when it does not (a bug in the caller) or out of
 * memory. */
static int rk_carve(struct rk_planner *pl, struct rk_seg *s, uint64_t off,
                    uint64_t size, uint64_t id) {
  size_t j = 0;
  while (j < s->n && !(s->r[j].kind == RK_FREE && s->r[j].off <= off &&
                       off + size <= s->r[j].off + s->r[j].size))
    j++;
  if (j == s->n || !rk_seg_reserve(pl, s, s->n + 2)) return 0;
  struct rk_range fr = s->r[j];
  struct rk_range piece[3];
  size_t k = 0;
  if (fr.off < off)
    piece[k++] = (struct rk_range){fr.off, off - fr.off, 0, RK_FREE};
  piece[k++] = (struct rk_range){off, size, id, RK_MOVABLE};
  if (off + size < fr.off + fr.size)
    piece[k++] = (struct rk_range){off + size, fr.off + fr.size - off - size, 0,
                                   RK_FREE};
  memmove(&s->r[j + k], &s->r[j + 1], (s->n - j - 1) * sizeof *s->r);
  memcpy(&s->r[j], piece, k * sizeof *piece);
  s->n += k - 1;
  s->movable++;
  s->moving += size;
  return 1;
}

/* 1 when free range r of s is a better fit than b of bs (NULL: none yet):
 * pinned segments first, then the smaller range, the lower segment id and
 * offset. */
static int rk_better(const struct rk_seg *s, const struct rk_range *r,
                     const struct rk_seg *bs, const struct rk_range *b) {
  if (!b) return 1;
  if (s->pinned != bs->pinned) return s->pinned;
  if (r->size != b->size) return r->size < b->size;
  if (s->id != bs->id) return s->id < bs->id;
  return r->off < b->off;
}

/* Best fit for `size` bytes outside the segments of x: sets *seg, *off;
 * 0 when nothing holds it. */
static int rk_fit(struct rk_planner *pl, struct rk_model *m, uint64_t size,
                  const struct rk_excl *x, struct rk_seg **seg, uint64_t *off) {
  const struct rk_range *best = NULL;
  struct rk_seg *bs = NULL;
  for (size_t i = 0; i < m->n; i++) {
    struct rk_seg *s = &m->s[i];
    if (rk_excluded(x, s->id) || !rk_spend(pl, s->n)) continue;
    for (size_t j = 0; j < s->n; j++) {
      const struct rk_range *r = &s->r[j];
      if (r->kind == RK_FREE && r->size >= size && rk_better(s, r, bs, best)) {
        best = r;
        bs = s;
      }
    }
  }
  if (!best) return 0;
  *seg = bs;
  *off = best->off;
  return 1;
}

static int rk_push(struct rk_planner *pl, struct gmb_repack_plan *plan,
                   const struct gmb_repack_step *st) {
  if (plan->n == plan->cap) {
    size_t cap = plan->cap ? 2 * plan->cap : 16;
    struct gmb_repack_step *ns = realloc(plan->steps, cap * sizeof *ns);
    if (!ns) {
      rk_nomem(pl);
      return 0;
    }
    plan->steps = ns;
    plan->cap = cap;
  }
  plan->steps[plan->n++] = *st;
  plan->bytes += st->size;
  return 1;
}

/* Adds every step of `from` to plan, in order. */
static int rk_append(struct rk_planner *pl, struct gmb_repack_plan *plan,
                     const struct gmb_repack_plan *from) {
  for (size_t i = 0; i < from->n; i++)
    if (!rk_push(pl, plan, &from->steps[i])) return 0;
  return 1;
}

/* Moves the block at index j of `from` to [off, off + size) of `to` in
 * the model and records the step. */
static int rk_move(struct rk_planner *pl, struct gmb_repack_plan *plan,
                   struct rk_seg *from, size_t j, struct rk_seg *to,
                   uint64_t off) {
  if (j >= from->n) return 0;
  struct gmb_repack_step st = {from->r[j].id, from->r[j].size, from->id, to->id,
                               off};
  if (!rk_carve(pl, to, off, st.size, st.id) || !rk_push(pl, plan, &st))
    return 0;
  rk_release(from, rk_find(from, st.id));
  return 1;
}

/* ---- places ------------------------------------------------------------- */

/* A block to place: allocation id (0: none, the hole goal's window) of
 * `size` bytes, in segment src. */
struct rk_block {
  uint64_t id, size, src;
};

/* The cost of the window [lo, lo + size) of s, whose first range is j:
 * the bytes of its movable blocks; UINT64_MAX when it holds a fixed one,
 * no block, or every block of a segment without fixed ones (s would empty
 * and go back to the device before the block could land there). */
static uint64_t rk_window_cost(struct rk_planner *pl, const struct rk_seg *s,
                               size_t j, uint64_t lo, uint64_t size) {
  uint64_t cost = 0;
  size_t blocks = 0;
  for (size_t k = j; k < s->n && s->r[k].off < lo + size; k++) {
    if (!rk_spend(pl, 1) || s->r[k].kind == RK_FIXED) return UINT64_MAX;
    if (s->r[k].kind == RK_MOVABLE) {
      cost += s->r[k].size;
      blocks++;
    }
  }
  return blocks == 0 || (blocks == s->movable && s->fixed == 0) ? UINT64_MAX
                                                                : cost;
}

void gmb__repack_window_keep(struct gmb_repack_window *best, size_t *n,
                             const struct gmb_repack_window *w) {
  size_t k = *n;
  if (k == GMB_REPACK_WINDOWS) {
    if (best[k - 1].cost <= w->cost) return;
    k--;
  } else {
    (*n)++;
  }
  while (k > 0 && best[k - 1].cost > w->cost) {
    best[k] = best[k - 1];
    k--;
  }
  best[k] = *w;
}

/* The cheapest windows of `size` bytes outside x: those that start where
 * a range starts, and the top one of each segment.  Returns how many. */
static size_t rk_windows(struct rk_planner *pl, const struct rk_model *m,
                         uint64_t size, const struct rk_excl *x,
                         struct gmb_repack_window *best) {
  size_t n = 0;
  for (size_t i = 0; i < m->n; i++) {
    const struct rk_seg *s = &m->s[i];
    if (rk_excluded(x, s->id) || s->size < size) continue;
    uint64_t top = s->size - size;
    for (size_t j = 0; j < s->n && s->r[j].off <= top; j++) {
      uint64_t lo[2] = {s->r[j].off, top};
      int tops = top > s->r[j].off && top < s->r[j].off + s->r[j].size;
      for (int k = 0; k <= tops; k++) {
        struct gmb_repack_window w = {rk_window_cost(pl, s, j, lo[k], size),
                                      s->id, lo[k]};
        if (w.cost != UINT64_MAX) gmb__repack_window_keep(best, &n, &w);
      }
    }
  }
  return n;
}

static int rk_desc(const void *a, const void *b) {
  const struct rk_range *x = a, *y = b;
  if (x->size != y->size) return x->size < y->size ? 1 : -1;
  return x->off < y->off ? -1 : x->off > y->off;
}

static int rk_place(struct rk_planner *pl, struct rk_model *m,
                    const struct rk_block *b, const struct rk_excl *x,
                    unsigned depth, struct gmb_repack_plan *plan);

/* Tries window w for block b on a copy of *m: the window's blocks get
 * places of their own (largest first; outside x and w's segment, one
 * level less deep), then b moves into it.  On success *m becomes the copy
 * and the steps are added to plan. */
static int rk_window_try(struct rk_planner *pl, struct rk_model *m,
                         const struct rk_block *b, const struct rk_excl *x,
                         unsigned depth, const struct gmb_repack_window *w,
                         struct gmb_repack_plan *plan) {
  struct rk_model t = {0};
  struct gmb_repack_plan steps = {0};
  struct rk_range *mv = NULL;
  struct rk_excl xs = *x;
  xs.id[xs.n++] = w->seg;
  int ok = rk_copy(pl, &t, m);
  struct rk_seg *s = ok ? rk_seg(&t, w->seg) : NULL;
  size_t nmv = 0;
  ok = s != NULL;
  if (ok) {
    mv = malloc(s->n * sizeof *mv);
    if (!mv) rk_nomem(pl);
    ok = mv != NULL;
    for (size_t j = 0; ok && j < s->n; j++)
      if (s->r[j].kind == RK_MOVABLE && s->r[j].off < w->lo + b->size &&
          s->r[j].off + s->r[j].size > w->lo)
        mv[nmv++] = s->r[j];
    if (ok) qsort(mv, nmv, sizeof *mv, rk_desc);
  }
  for (size_t i = 0; ok && i < nmv; i++) {
    struct rk_block wb = {mv[i].id, mv[i].size, w->seg};
    ok = rk_place(pl, &t, &wb, &xs, depth - 1, &steps);
  }
  if (ok && b->id) {
    struct rk_seg *from = rk_seg(&t, b->src), *to = rk_seg(&t, w->seg);
    ok = from && to &&
         rk_move(pl, &steps, from, rk_find(from, b->id), to, w->lo);
  }
  ok = ok && rk_append(pl, plan, &steps);
  free(mv);
  gmb__repack_plan_clear(&steps);
  if (ok) {
    rk_model_free(m);
    *m = t;
  } else {
    rk_model_free(&t);
  }
  return ok;
}

/* Finds block b a place outside x and records the steps that take it
 * there: the best fit among free ranges, else (depth > 0) a window made
 * for it.  The hole goal's block (id 0) always takes a window. */
static int rk_place(struct rk_planner *pl, struct rk_model *m,
                    const struct rk_block *b, const struct rk_excl *x,
                    unsigned depth, struct gmb_repack_plan *plan) {
  struct rk_seg *to;
  uint64_t off;
  if (b->id && rk_fit(pl, m, b->size, x, &to, &off)) {
    struct rk_seg *from = rk_seg(m, b->src);
    return from && rk_move(pl, plan, from, rk_find(from, b->id), to, off);
  }
  if (depth == 0 || pl->stop) return 0;
  struct gmb_repack_window best[GMB_REPACK_WINDOWS];
  size_t n = rk_windows(pl, m, b->size, x, best);
  for (size_t k = 0; k < n && !pl->stop; k++)
    if (rk_window_try(pl, m, b, x, depth, &best[k], plan)) return 1;
  return 0;
}

/* ---- packing a segment ------------------------------------------------- */

/* Where block j of s slides to, as the engine's slide pass picks: the
 * lowest free range below it that holds it, else the free range just below
 * it when the shift is worth copying (GMB_REPACK_SLIDE_CHUNKS).  0 when it
 * stays. */
static int rk_slide_target(const struct rk_seg *s, size_t j, uint64_t *off) {
  const struct rk_range *b = &s->r[j];
  for (size_t k = 0; k < j; k++)
    if (s->r[k].kind == RK_FREE && s->r[k].size >= b->size) {
      *off = s->r[k].off;
      return 1;
    }
  if (j > 0 && s->r[j - 1].kind == RK_FREE &&
      s->r[j - 1].size * GMB_REPACK_SLIDE_CHUNKS >= b->size) {
    *off = s->r[j - 1].off;
    return 1;
  }
  return 0;
}

static uint64_t rk_largest_free(const struct rk_seg *s) {
  uint64_t best = 0;
  for (size_t j = 0; j < s->n; j++)
    if (s->r[j].kind == RK_FREE && s->r[j].size > best) best = s->r[j].size;
  return best;
}

/* Packs s down: its movable blocks, in address order, slide to their
 * targets (the steps go to plan).  Returns the largest free range of s
 * afterwards; 0 when the budget or host memory ran out. */
static uint64_t rk_pack(struct rk_planner *pl, struct rk_seg *s,
                        struct gmb_repack_plan *plan) {
  uint64_t *ids = malloc((s->movable ? s->movable : 1) * sizeof *ids);
  size_t n = 0;
  if (!ids) {
    rk_nomem(pl);
    return 0;
  }
  for (size_t j = 0; j < s->n; j++)
    if (s->r[j].kind == RK_MOVABLE) ids[n++] = s->r[j].id;
  int ok = 1;
  for (size_t i = 0; ok && i < n; i++) {
    size_t j = rk_find(s, ids[i]);
    uint64_t off;
    ok = rk_spend(pl, s->n) && j < s->n; /* the find, target and carve */
    if (!ok || !rk_slide_target(s, j, &off)) continue;
    struct gmb_repack_step st = {ids[i], s->r[j].size, s->id, s->id, off};
    rk_release(s, j); /* first: the target may overlap its old place */
    ok = rk_carve(pl, s, off, st.size, st.id) && rk_push(pl, plan, &st);
  }
  free(ids);
  return ok ? rk_largest_free(s) : 0;
}

/* Plans a free range of `hole` bytes in segment sid of m by packing it:
 * its blocks, largest first, move to best fits outside it (those that have
 * one) until sliding the rest down leaves the range; then the slides.  For
 * the segment whose blocks are larger than the holes between them, where
 * no window's blocks all have places. */
static int rk_pack_hole(struct rk_planner *pl, struct rk_model *m, uint64_t sid,
                        uint64_t hole, struct gmb_repack_plan *plan) {
  struct rk_seg *s = rk_seg(m, sid);
  struct rk_range *blocks = s ? malloc(s->n * sizeof *blocks) : NULL;
  if (!blocks) {
    if (s) rk_nomem(pl);
    return 0;
  }
  size_t nb = 0;
  for (size_t j = 0; j < s->n; j++)
    if (s->r[j].kind == RK_MOVABLE) blocks[nb++] = s->r[j];
  qsort(blocks, nb, sizeof *blocks, rk_desc);
  struct rk_excl x = {{sid}, 1};
  int ok = 0;
  for (size_t i = 0; !pl->stop;) {
    /* Packed on a copy: kept, with its slides, once it leaves the hole. */
    struct rk_seg t;
    struct gmb_repack_plan slides = {0};
    if (!rk_seg_dup(pl, &t, s)) break;
    int done = rk_pack(pl, &t, &slides) >= hole;
    if (done) {
      ok = rk_append(pl, plan, &slides);
      free(s->r);
      *s = t;
    } else {
      free(t.r);
    }
    gmb__repack_plan_clear(&slides);
    if (done) break;
    struct rk_seg *to = NULL;
    uint64_t off = 0;
    while (i < nb && !rk_fit(pl, m, blocks[i].size, &x, &to, &off)) i++;
    if (i == nb || !rk_move(pl, plan, s, rk_find(s, blocks[i].id), to, off))
      break;
    i++;
  }
  free(blocks);
  return ok && !pl->stop;
}

/* ---- the plan ----------------------------------------------------------- */

/* Plans the emptying of victim v in model m (which the plan changes). */
static int rk_empty(struct rk_planner *pl, struct rk_model *m, uint64_t v,
                    struct gmb_repack_plan *plan) {
  struct rk_seg *vs = rk_seg(m, v);
  size_t nb = 0;
  struct rk_range *blocks = malloc(vs->n * sizeof *blocks);
  if (!blocks) {
    rk_nomem(pl);
    return 0;
  }
  for (size_t j = 0; j < vs->n; j++)
    if (vs->r[j].kind == RK_MOVABLE) blocks[nb++] = vs->r[j];
  qsort(blocks, nb, sizeof *blocks, rk_desc);
  struct rk_excl x = {{v}, 1};
  int ok = 1;
  for (size_t i = 0; ok && i < nb; i++) {
    struct rk_block b = {blocks[i].id, blocks[i].size, v};
    ok = rk_place(pl, m, &b, &x, REPACK_DEPTH, plan);
  }
  free(blocks);
  return ok && !pl->stop;
}

/* A segment to work on: a victim to empty, or one to pack for a hole;
 * candidates are tried in order of key (then id). */
struct rk_cand {
  uint64_t key, id;
};

static int rk_cand_cmp(const void *a, const void *b) {
  const struct rk_cand *x = a, *y = b;
  if (x->key != y->key) return x->key < y->key ? -1 : 1;
  return x->id < y->id ? -1 : x->id > y->id;
}

static uint64_t rk_free_bytes(const struct rk_seg *s) {
  uint64_t n = 0;
  for (size_t j = 0; j < s->n; j++)
    if (s->r[j].kind == RK_FREE) n += s->r[j].size;
  return n;
}

/* The candidates of model m, best first: with hole 0, the movable
 * segments without fixed ranges of id at most max_seg, least moving bytes
 * first; else the segments with movable blocks that can hold the hole,
 * most free bytes first.  Returns how many (at most GMB_REPACK_VICTIMS),
 * or SIZE_MAX when out of host memory. */
static size_t rk_candidates(const struct rk_model *m, uint64_t max_seg,
                            uint64_t hole, struct rk_cand *out) {
  struct rk_cand *c = malloc((m->n ? m->n : 1) * sizeof *c);
  size_t n = 0;
  if (!c) return SIZE_MAX;
  for (size_t i = 0; i < m->n; i++) {
    const struct rk_seg *s = &m->s[i];
    if (hole == 0 && !s->pinned && s->fixed == 0 && s->movable > 0 &&
        s->id <= max_seg)
      c[n++] = (struct rk_cand){s->moving, s->id};
    else if (hole > 0 && s->movable > 0 && s->size >= hole)
      c[n++] = (struct rk_cand){s->size - rk_free_bytes(s), s->id};
  }
  qsort(c, n, sizeof *c, rk_cand_cmp);
  if (n > GMB_REPACK_VICTIMS) n = GMB_REPACK_VICTIMS;
  memcpy(out, c, n * sizeof *c);
  free(c);
  return n;
}

int gmb__repack_plan(const struct gmb_pool *p, const struct gmb_arena *a,
                     uint64_t max_seg, uint64_t hole,
                     gmb_repack_movable_fn movable, void *ctx, uint64_t *budget,
                     struct gmb_repack_plan *out) {
  struct rk_planner pl = {budget, 0, 0};
  struct rk_model base = {0};
  struct rk_cand cand[GMB_REPACK_VICTIMS];
  size_t nc = 0;
  int found = 0;
  if (rk_build(&pl, p, a, movable, ctx, &base)) {
    nc = rk_candidates(&base, max_seg, hole, cand);
    if (nc == SIZE_MAX) {
      rk_nomem(&pl);
      nc = 0;
    }
  }
  if (hole && !pl.stop) {
    struct rk_model w = {0};
    struct rk_block b = {0, hole, 0};
    struct rk_excl none = {{0}, 0};
    found = rk_copy(&pl, &w, &base) &&
            rk_place(&pl, &w, &b, &none, REPACK_DEPTH, out) && !pl.stop;
    if (!found) gmb__repack_plan_clear(out);
    rk_model_free(&w);
  }
  for (size_t i = 0; !pl.stop && i < nc; i++) {
    struct rk_model w = {0};
    struct gmb_repack_plan pc = {0};
    int ok = rk_copy(&pl, &w, &base) &&
             (hole ? rk_pack_hole(&pl, &w, cand[i].id, hole, &pc)
                   : rk_empty(&pl, &w, cand[i].id, &pc));
    if (ok && (!found || pc.bytes < out->bytes)) {
      gmb__repack_plan_clear(out);
      *out = pc;
      out->victim = hole ? 0 : cand[i].id;
      found = 1;
    } else {
      gmb__repack_plan_clear(&pc);
    }
    rk_model_free(&w);
  }
  if (!found || pl.nomem) gmb__repack_plan_clear(out);
  rk_model_free(&base);
  return pl.nomem ? GMB_E_NOMEM : found;
}

void gmb__repack_plan_clear(struct gmb_repack_plan *plan) {
  free(plan->steps);
  memset(plan, 0, sizeof *plan);
}
