/*
 * offload.c - the broker offloads movable allocations itself, and brings
 * them back at the client's gmb_lock (offload.h has the rules and the
 * bounds).
 *
 * A session's records live in a red-black tree by the id its client knows
 * (a Free or a Lock names it) and in an array by lock-table slot (a pool
 * allocation names its slot through its tag), both private to the broker:
 * nothing read from the shared lock table decides which record an
 * allocation is.  Every record change goes through offl_add and offl_drop,
 * which keep the session's, the broker's and the sleep record's sums in
 * step.
 *
 * An offload claims the slot as a move does (CAS 0 -> MOVING: a locked
 * allocation is skipped, and no gmb_lock can start during the copy; for
 * a request, every slot of a segment before its first copy, so that the
 * segment goes whole or stays), copies the bytes to host memory, frees
 * the device range and only then stores GMB_LT_OFFLOADED, waking the lock
 * calls that slept on the word.
 * A restore stores MOVING, allocates and copies, writes the position and
 * stores 1: the hold of the client whose Lock brought it back.
 */
#include "offload.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "compact.h"
#include "gmb.h"
#include "locktab.h"
#include "log.h"
#include "pool.h"
#include "rbtree.h"
#include "reply.h"
#include "sleep.h"
#include "tenant.h"
#include "util.h"

struct offl_rec {
  RB_ENTRY(offl_rec) link;
  uint64_t id;      /* what the client calls it: its first pool id */
  uint64_t pool_id; /* the pool's id now; 0 while offloaded */
  uint64_t size;    /* rounded */
  uint32_t slot;    /* its lock-table slot, kept while offloaded */
  void *host;       /* its bytes while offloaded, in `chunk` */
  struct gmb_offl_chunk *chunk;
};

static int offl_cmp(const struct offl_rec *a, const struct offl_rec *b) {
  return (a->id > b->id) - (a->id < b->id);
}

RB_HEAD(offl_tree, offl_rec);
RB_GENERATE_STATIC(offl_tree, offl_rec, link, offl_cmp)

struct gmb_offload_set {
  struct offl_tree by_id;
  struct offl_rec **by_slot; /* cap entries */
  uint32_t cap;
  uint32_t n, away;          /* records; offloaded ones */
  uint64_t bytes;            /* host bytes of the offloaded ones */
};

static struct gmb_log_rl offl_rl_refused, offl_rl_copy, offl_rl_made;

/* --- records -------------------------------------------------------------- */

static struct gmb_offload_set *offl_set(struct gmb_session *s) {
  if (s->offl == NULL) {
    s->offl = calloc(1, sizeof *s->offl);
    if (s->offl) RB_INIT(&s->offl->by_id);
  }
  return s->offl;
}

static struct offl_rec *offl_find(const struct gmb_session *s, uint64_t id) {
  if (s->offl == NULL) return NULL;
  struct offl_rec key = {.id = id};
  return RB_FIND(offl_tree, &s->offl->by_id, &key);
}

static struct offl_rec *offl_at_slot(const struct gmb_session *s,
                                     uint32_t slot) {
  const struct gmb_offload_set *st = s->offl;
  return st && slot < st->cap ? st->by_slot[slot] : NULL;
}

/* A new record, in both indexes; NULL out of host memory. */
static struct offl_rec *offl_new(struct gmb_session *s, uint64_t id,
                                 uint32_t slot) {
  struct gmb_offload_set *st = offl_set(s);
  if (st == NULL) return NULL;
  if (slot >= st->cap) {
    uint32_t cap = st->cap ? st->cap : 64;
    while (cap <= slot) cap *= 2;
    struct offl_rec **v = realloc(st->by_slot, cap * sizeof *v);
    if (v == NULL) return NULL;
    memset(v + st->cap, 0, (cap - st->cap) * sizeof *v);
    st->by_slot = v;
    st->cap = cap;
  }
  struct offl_rec *r = calloc(1, sizeof *r);
  if (r == NULL) return NULL;
  r->id = id;
  r->slot = slot;
  GMB_ASSERT(st->by_slot[slot] == NULL &&
             RB_INSERT(offl_tree, &st->by_id, r) == NULL &&
             "one record per slot and id");
  st->by_slot[slot] = r;
  st->n++;
  return r;
}

/* --- host memory ------------------------------------------------------------
 *
 * The copies are cut in order from chunks of up to OFFL_CHUNK bytes of the
 * device's host memory, and a chunk goes back when its last copy does.  On
 * a GPU every chunk is a cuMemHostAlloc, whose pinning costs more than
 * copying the 1 MiB at most that a movable allocation holds: one call per
 * chunk rather than one per allocation.  What the chunks hold, copies and
 * the gaps freed copies left, stays within offload_host_max: a chunk that
 * would pass it is made smaller, down to the one copy it is for, and past
 * that the offload is refused as the host bounds refuse it.
 */
#define OFFL_CHUNK (UINT64_C(32) << 20)
#define OFFL_PIECE_ALIGN UINT64_C(256)

struct gmb_offl_chunk {
  char *base;
  uint64_t size, used; /* used: cut so far, from base */
  uint32_t live;       /* copies in it now */
  uint32_t seen;       /* gmb__offload_check's count of them */
};

static void offl_chunk_put(struct gmb_broker *b, struct gmb_offl_chunk *c) {
  GMB_ASSERT(c->live > 0 && "a chunk's copies drifted");
  if (--c->live) return;
  if (b->offload.chunk == c) b->offload.chunk = NULL;
  gmb__device_host_free(b->dev, c->base, c->size);
  b->offload.chunk_bytes -= c->size;
  free(c);
}

/* Host memory for a copy of `size` bytes (*c its chunk), or NULL: the
 * chunks would pass offload_host_max (*limit set), or no host memory. */
static void *offl_host_get(struct gmb_broker *b, uint64_t size,
                           struct gmb_offl_chunk **c, int *limit) {
  const uint64_t need = (size + OFFL_PIECE_ALIGN - 1) & ~(OFFL_PIECE_ALIGN - 1);
  struct gmb_offl_chunk *k = b->offload.chunk;
  *limit = 0;
  if (k == NULL || k->size - k->used < need) {
    const uint64_t max = b->cfg.offload_host_max;
    uint64_t left = max > b->offload.chunk_bytes
                        ? max - b->offload.chunk_bytes : 0;
    uint64_t want = need > OFFL_CHUNK ? need : OFFL_CHUNK;
    if (want > left) want = left;
    if (want < need) {
      *limit = 1;
      return NULL;
    }
    if ((k = calloc(1, sizeof *k)) == NULL) return NULL;
    k->base = gmb__device_host_alloc(b->dev, want);
    if (k->base == NULL && want > need) /* a smaller one may still come */
      k->base = gmb__device_host_alloc(b->dev, want = need);
    if (k->base == NULL) {
      free(k);
      return NULL;
    }
    k->size = want;
    b->offload.chunk_bytes += want;
    /* The chunk before stays while copies live in it; none is cut from it
     * again.  Holding none, it went already (offl_chunk_put). */
    b->offload.chunk = k;
  }
  void *p = k->base + k->used;
  k->used += need;
  k->live++;
  *c = k;
  return p;
}

/* r's bytes are in host memory now: the sums grow.  0, or GMB_E_SYSTEM
 * with nothing changed when there is no host memory for the session's
 * (movable) sleep record. */
static int offl_add(struct gmb_broker *b, struct gmb_session *s,
                    struct offl_rec *r, void *host,
                    struct gmb_offl_chunk *chunk) {
  if (gmb__sleep_movable(s, (int64_t)r->size) != 0) return GMB_E_SYSTEM;
  r->host = host;
  r->chunk = chunk;
  r->pool_id = 0;
  s->offl->away++;
  s->offl->bytes += r->size;
  b->offload.host_bytes += r->size;
  b->offload.held++;
  return 0;
}

/* r's host copy goes (brought back, or freed): the sums shrink. */
static void offl_sub(struct gmb_broker *b, struct gmb_session *s,
                     struct offl_rec *r) {
  GMB_ASSERT(r->host && s->offl->away > 0 && s->offl->bytes >= r->size &&
             b->offload.host_bytes >= r->size && "offload sums drifted");
  offl_chunk_put(b, r->chunk);
  r->host = NULL;
  r->chunk = NULL;
  s->offl->away--;
  s->offl->bytes -= r->size;
  b->offload.host_bytes -= r->size;
  b->offload.held--;
  int rc = gmb__sleep_movable(s, -(int64_t)r->size);
  GMB_ASSERT(rc == 0 && "fewer offloaded bytes needs no host memory");
}

static void offl_drop(struct gmb_broker *b, struct gmb_session *s,
                      struct offl_rec *r) {
  if (r->host) offl_sub(b, s, r);
  RB_REMOVE(offl_tree, &s->offl->by_id, r);
  s->offl->by_slot[r->slot] = NULL;
  s->offl->n--;
  free(r);
}

int gmb__offload_resolve(const struct gmb_session *s, uint64_t id,
                         uint64_t *pool_id, uint64_t *size) {
  const struct offl_rec *r = offl_find(s, id);
  *pool_id = r ? r->pool_id : id;
  if (size) *size = r ? r->size : 0;
  if (r == NULL) return GMB_OFFL_NONE;
  return r->host ? GMB_OFFL_AWAY : GMB_OFFL_ALIAS;
}

void gmb__offload_free(struct gmb_broker *b, struct gmb_session *s,
                       uint64_t id) {
  struct offl_rec *r = offl_find(s, id);
  GMB_ASSERT(r && r->host && "freeing an allocation that is not offloaded");
  if (s->lt) gmb__locktab_slot_free(s->lt, r->slot);
  offl_drop(b, s, r);
}

void gmb__offload_freed(struct gmb_session *s, uint32_t slot,
                        uint64_t pool_id) {
  struct offl_rec *r = offl_at_slot(s, slot);
  if (r && r->host == NULL && r->pool_id == pool_id) {
    RB_REMOVE(offl_tree, &s->offl->by_id, r);
    s->offl->by_slot[slot] = NULL;
    s->offl->n--;
    free(r);
  }
}

void gmb__offload_forget_session(struct gmb_broker *b, struct gmb_session *s) {
  struct gmb_offload_set *st = s->offl;
  if (st == NULL) return;
  struct offl_rec *r, *next;
  RB_FOREACH_SAFE(r, offl_tree, &st->by_id, next) offl_drop(b, s, r);
  free(st->by_slot);
  free(st);
  s->offl = NULL;
}

/* --- one allocation out --------------------------------------------------- */

/* May tenant t's offloads hold `size` more host bytes?  The broker's bound
 * for every tenant, then t's host_quota (with its paused tags). */
static int offl_host_allows(const struct gmb_broker *b,
                            const struct gmb_tenant *t, uint64_t size) {
  uint64_t max = b->cfg.offload_host_max;
  if (size > max || b->offload.host_bytes > max - size) return 0;
  return t->host_quota == 0 ||
         (size <= t->host_quota && t->host_bytes <= t->host_quota - size);
}

static void offl_refused(struct gmb_broker *b, const struct gmb_session *o,
                         uint64_t size) {
  b->offload.refused++;
  if (!gmb__log_allow(&offl_rl_refused)) return;
  char a[GMB_SIZE_BUFSZ], h[GMB_SIZE_BUFSZ], k[GMB_SIZE_BUFSZ],
      m[GMB_SIZE_BUFSZ], t[GMB_SIZE_BUFSZ], q[GMB_SIZE_BUFSZ];
  log_info("session %" PRIu64 " (tenant %s): offloading %s more would pass "
           "the host bounds (the broker holds %s of copies in %s of chunks, "
           "of offload_host_max %s; the tenant %s of host_quota %s)%s",
           o->id, o->tenant->name, gmb__size_format(size, a, sizeof a),
           gmb__size_format(b->offload.host_bytes, h, sizeof h),
           gmb__size_format(b->offload.chunk_bytes, k, sizeof k),
           gmb__size_format(b->cfg.offload_host_max, m, sizeof m),
           gmb__size_format(o->tenant->host_bytes, t, sizeof t),
           o->tenant->host_quota
               ? gmb__size_format(o->tenant->host_quota, q, sizeof q)
               : "unlimited",
           gmb__log_suppressed(&offl_rl_refused));
}

/* Claims pool allocation `id` for an offload as a move claims it (CAS 0 ->
 * MOVING): 1 with its owner, table and slot, 0 when it is not a session's
 * movable allocation with a slot, or is locked or being moved.  Nothing
 * read from the table decides more than whether the claim succeeds. */
static int offl_claim(struct gmb_broker *b, uint64_t id,
                      struct gmb_session **owner, struct gmb_locktab **lt,
                      uint32_t *slot) {
  struct gmb_alloc_info info;
  if (gmb__pool_find(b->pool, id, &info) != 0 ||
      !(info.flags & GMB_MOVABLE) || info.tail_dseg != NULL)
    return 0;
  if ((*lt = gmb__session_slot(&info, slot)) == NULL) return 0;
  *owner = info.owner;
  /* An allocation brought back before keeps its record (and the client's
   * id); a record of another allocation at its slot would be a bug. */
  const struct offl_rec *r = offl_at_slot(*owner, *slot);
  if (r && r->pool_id != id) return 0;
  return gmb__locktab_claim(*lt, *slot);
}

/* Gives back the claims offl_claim took on ids[0..n). */
static void offl_unclaim(struct gmb_broker *b, const uint64_t *ids,
                         size_t n) {
  for (size_t i = 0; i < n; i++) {
    struct gmb_alloc_info info;
    uint32_t slot;
    struct gmb_locktab *lt;
    if (gmb__pool_find(b->pool, ids[i], &info) == 0 &&
        (lt = gmb__session_slot(&info, &slot)) != NULL)
      gmb__locktab_release(lt, slot);
  }
}

/*
 * Offloads pool allocation `id` of session o, whose slot (lt, slot) the
 * caller claimed (offl_claim): 0 when it went to host memory, the slot
 * saying OFFLOADED; else the slot is given back and the allocation stays
 * where it is: GMB_E_LIMIT when the host bounds refuse it (nothing of o
 * fits then), GMB_E_SYSTEM or GMB_E_DEVICE when host memory or the copy
 * failed.
 */
static int offl_out(struct gmb_broker *b, struct gmb_session *o, uint64_t id,
                    struct gmb_locktab *lt, uint32_t slot) {
  struct gmb_alloc_info info;
  int rc = gmb__pool_find(b->pool, id, &info);
  GMB_ASSERT(rc == 0 && info.owner == o && "a claimed allocation is live");
  if (!offl_host_allows(b, o->tenant, info.size)) {
    gmb__locktab_release(lt, slot);
    offl_refused(b, o, info.size);
    return GMB_E_LIMIT;
  }
  /* Its record (an allocation brought back before keeps the client's id),
   * or a new one, made before anything changes. */
  struct offl_rec *r = offl_at_slot(o, slot);
  int fresh = r == NULL;
  if (fresh && (r = offl_new(o, id, slot)) == NULL) {
    gmb__locktab_release(lt, slot);
    return GMB_E_SYSTEM;
  }
  r->size = info.size;
  struct gmb_offl_chunk *chunk = NULL;
  int limit;
  void *host = offl_host_get(b, info.size, &chunk, &limit);
  rc = host ? 0 : limit ? GMB_E_LIMIT : GMB_E_SYSTEM;
  if (rc == 0) {
    /* The device only reads the segment here; its ops take it non-const
     * because copies in general write one. */
    rc = gmb__device_copy_host(b->dev, (struct gmb_dseg *)info.dseg,
                               info.offset, host, info.size, 1);
    if (rc && gmb__log_allow(&offl_rl_copy))
      log_error("offloading allocation %" PRIu64 " of session %" PRIu64
                " failed (%s); it stays on the device%s", id, o->id,
                gmb_err_name(rc), gmb__log_suppressed(&offl_rl_copy));
  }
  if (rc == GMB_E_SYSTEM && gmb__log_allow(&offl_rl_copy))
    log_error("offloading allocation %" PRIu64 " of session %" PRIu64
              ": no host memory for its copy; it stays on the device%s", id,
              o->id, gmb__log_suppressed(&offl_rl_copy));
  /* The sums and the session's (movable) record, before anything is
   * committed: a record there is no host memory for refuses the offload. */
  if (rc == 0 && (rc = offl_add(b, o, r, host, chunk)) != 0 &&
      gmb__log_allow(&offl_rl_copy))
    log_error("offloading allocation %" PRIu64 " of session %" PRIu64
              ": no host memory for its sleep record; it stays on the "
              "device%s", id, o->id, gmb__log_suppressed(&offl_rl_copy));
  if (rc) {
    gmb__locktab_release(lt, slot);
    if (chunk) offl_chunk_put(b, chunk);
    if (fresh) offl_drop(b, o, r);
    if (rc == GMB_E_LIMIT) offl_refused(b, o, info.size);
    return rc;
  }
  /* Committed (the sums count the copy already): the device range goes
   * back as a Free's does, then the slot says where the bytes are. */
  if (b->compacting) gmb__compact_forget(b->compacting, id);
  rc = gmb__pool_free(b->pool, id, &info);
  GMB_ASSERT(rc == 0 && "an allocation found a moment ago cannot be freed");
  b->pool_ops++;
  gmb__tenant_uncharge(o->tenant, info.size);
  o->allocations--;
  o->used -= info.size;
  gmb__tenant_holes_held(o->tenant, &o->cached_holes, o->used);
  b->offload.offloads++;
  b->offload.bytes_out += info.size;
  gmb__locktab_offloaded(lt, slot);
  return 0;
}

/* --- choosing what goes --------------------------------------------------- */

/*
 * One pool walk chooses what may go, whoever it is for, so that a request
 * costs one walk however many sessions are idle (a tenant that opens many
 * idle sessions must not make every full-device request walk the pool once
 * for each).  For a request (`for_s`), the candidates are the segments of
 * the tenants in `tenants` (sorted by address) that hold nothing but
 * unlocked movable allocations of that tenant's sessions that may be
 * offloaded for it (gmb__sleep_askable): offloading them empties the
 * segment, room another tenant can use.  For an operator's pause (`t`),
 * they are the unlocked movable allocations of t's sessions wherever they
 * are, one by one.  ids[] holds them; groups[] the segments (for_s) or
 * nothing.
 */
struct offl_group {
  const struct gmb_tenant *t;
  size_t rank;       /* its tenant's place in the candidates' order */
  size_t start, end; /* its ids, [start, end) */
};

struct offl_scan {
  const struct gmb_session *for_s;
  const struct gmb_tenant *t;
  const struct gmb_tenant **tenants; /* for_s: sorted by address */
  size_t n_tenants;
  uint64_t now;
  const struct gmb_segment *seg;
  const struct gmb_tenant *seg_t; /* the segment's tenant, a candidate */
  int seg_ok;
  size_t seg_start;
  uint64_t *ids;
  size_t n, cap;
  struct offl_group *groups;
  size_t n_groups, cap_groups;
  int oom;
};

static int offl_ptr_cmp(const void *x, const void *y) {
  uintptr_t a = (uintptr_t) * (const void *const *)x;
  uintptr_t c = (uintptr_t) * (const void *const *)y;
  return (a > c) - (a < c);
}

/* The place of tenant t among c->tenants, or SIZE_MAX. */
static size_t offl_tenant_at(const struct offl_scan *c,
                             const struct gmb_tenant *t) {
  const struct gmb_tenant **k =
      bsearch(&t, c->tenants, c->n_tenants, sizeof *c->tenants, offl_ptr_cmp);
  return k ? (size_t)(k - c->tenants) : SIZE_MAX;
}

static int offl_grow(void **v, size_t *cap, size_t n, size_t each) {
  if (n < *cap) return 0;
  size_t c = *cap ? *cap * 2 : 64;
  void *w = realloc(*v, c * each);
  if (w == NULL) return 1;
  *v = w;
  *cap = c;
  return 0;
}

static int offl_scan_push(struct offl_scan *c, uint64_t id) {
  if (offl_grow((void **)&c->ids, &c->cap, c->n, sizeof *c->ids)) {
    c->oom = 1;
    return 1;
  }
  c->ids[c->n++] = id;
  return 0;
}

/* The segment walked so far is done: for a request, its ids stay (a
 * group) only if it holds nothing but candidates. */
static int offl_scan_close(struct offl_scan *c) {
  if (c->seg == NULL || c->for_s == NULL) return 0;
  if (!c->seg_ok || c->n == c->seg_start) {
    c->n = c->seg_start;
    return 0;
  }
  if (offl_grow((void **)&c->groups, &c->cap_groups, c->n_groups,
                sizeof *c->groups)) {
    c->oom = 1;
    return 1;
  }
  c->groups[c->n_groups++] =
      (struct offl_group){.t = c->seg_t, .start = c->seg_start, .end = c->n};
  return 0;
}

static int offl_scan_one(void *ctx, const struct gmb_alloc_info *a,
                         int is_free) {
  struct offl_scan *c = ctx;
  if (a->segment != c->seg) {
    if (offl_scan_close(c)) return 1;
    struct gmb_segment_view v;
    gmb__pool_segment_view(a->segment, &v);
    c->seg = a->segment;
    c->seg_t = v.arena_tag;
    c->seg_ok = v.small && (c->for_s ? offl_tenant_at(c, c->seg_t) != SIZE_MAX
                                     : c->seg_t == c->t);
    c->seg_start = c->n;
  }
  if (!c->seg_ok || is_free) return 0;
  const struct gmb_session *own = a->owner;
  int mine = own && own->tenant == c->seg_t &&
             (c->for_s == NULL || gmb__sleep_askable(own, c->for_s, c->now));
  if (a->id == 0 || !mine || !(a->flags & GMB_MOVABLE) ||
      (a->flags & GMB_RANGE_TAIL) || gmb__session_alloc_locked(a)) {
    c->seg_ok = c->for_s == NULL; /* a request's segment is now no use */
    return 0;
  }
  return offl_scan_push(c, a->id);
}

/* Walks the pool once for scan c (set up by the caller).  Out of host
 * memory, c holds what was found before (for a request, whole segments
 * only). */
static void offl_scan(struct gmb_broker *b, struct offl_scan *c) {
  b->offload.walks++;
  gmb__pool_walk(b->pool, offl_scan_one, c);
  if (!c->oom) offl_scan_close(c);
  /* Out of memory part-way: a segment not walked to its end is not known
   * to hold only candidates. */
  if (c->oom && c->for_s) c->n = c->seg_start;
}

/* Whether the host bounds and the chunks leave room for `bytes` more of
 * tenant t's copies (`need`: their pieces' bytes, aligned), cut as
 * offl_host_get cuts them: in what is left of
 * the current chunk, or else (what does not fit there, less than a
 * chunk) in a new one within offload_host_max. */
static int offl_host_room(const struct gmb_broker *b,
                          const struct gmb_tenant *t, uint64_t bytes,
                          uint64_t need) {
  if (!offl_host_allows(b, t, bytes)) return 0;
  const struct gmb_offl_chunk *k = b->offload.chunk;
  if (k && k->size - k->used >= need) return 1;
  const uint64_t max = b->cfg.offload_host_max;
  return max > b->offload.chunk_bytes && max - b->offload.chunk_bytes >= need &&
         need <= OFFL_CHUNK;
}

/*
 * Offloads the candidates ids[0..k) of one segment of o's tenant (`whole`
 * scan) all or none: its tenant above `floor` and the host bounds are
 * checked for their sum, and every slot is claimed before any byte moves,
 * so that one allocation locked (or being moved) meanwhile leaves the
 * whole segment where it is rather than some of it offloaded for no room.
 * Returns 0 (*n and *bytes grown by what went), or GMB_E_LIMIT when the
 * host bounds refuse it, or the error of a host allocation or copy that
 * failed part-way (what went before stays offloaded, nothing is lost).
 */
static int offl_segment(struct gmb_broker *b, struct gmb_session *o,
                        const uint64_t *ids, size_t k, uint64_t floor,
                        uint32_t *n, uint64_t *bytes) {
  uint64_t sum = 0, pieces = 0;
  for (size_t i = 0; i < k; i++) {
    struct gmb_alloc_info info;
    if (gmb__pool_find(b->pool, ids[i], &info) != 0) return 0;
    sum += info.size;
    pieces += (info.size + OFFL_PIECE_ALIGN - 1) & ~(OFFL_PIECE_ALIGN - 1);
  }
  const struct gmb_tenant *t = o->tenant;
  if (t->used < floor || t->used - floor < sum) return 0;
  if (!offl_host_room(b, t, sum, pieces)) {
    offl_refused(b, o, sum);
    return GMB_E_LIMIT;
  }
  for (size_t i = 0; i < k; i++) {
    struct gmb_session *owner;
    struct gmb_locktab *lt;
    uint32_t slot;
    if (!offl_claim(b, ids[i], &owner, &lt, &slot)) {
      offl_unclaim(b, ids, i);
      return 0;
    }
  }
  for (size_t i = 0; i < k; i++) {
    struct gmb_alloc_info info;
    uint32_t slot;
    int rc = gmb__pool_find(b->pool, ids[i], &info);
    struct gmb_locktab *lt = rc == 0 ? gmb__session_slot(&info, &slot) : NULL;
    GMB_ASSERT(lt && "a claimed allocation has its slot");
    rc = offl_out(b, (struct gmb_session *)info.owner, ids[i], lt, slot);
    if (rc) {
      offl_unclaim(b, ids + i + 1, k - i - 1);
      return rc;
    }
    (*n)++;
    *bytes += info.size;
  }
  return 0;
}

/* Groups in the candidates' order: their tenant's first candidate, then
 * address order (the walk's). */
static int offl_group_cmp(const void *x, const void *y) {
  const struct offl_group *a = x, *c = y;
  if (a->rank != c->rank) return a->rank < c->rank ? -1 : 1;
  return (a->start > c->start) - (a->start < c->start);
}

uint64_t gmb__offload_for(struct gmb_broker *b, struct gmb_session *s,
                          uint64_t want, uint64_t max, int *more) {
  *more = 0;
  if (want == 0 || max == 0 || b->cfg.offload_host_max == 0 || b->closing)
    return 0;
  /* Whom the asks to sleep would pick, in their order (sleep.h). */
  size_t n_cand;
  struct gmb_session **cand = gmb__sleep_candidates(b, s, &n_cand);
  if (cand == NULL) return 0;
  b->offload.slices++;
  struct offl_scan c = {.for_s = s, .now = gmb__now_ns()};
  /* Their tenants, each once, for the walk's look-ups; then each tenant's
   * rank is the place of its first candidate. */
  size_t *first = malloc(n_cand * sizeof *first);
  c.tenants = malloc(n_cand * sizeof *c.tenants);
  uint64_t made = 0, copied = 0;
  if (first == NULL || c.tenants == NULL) goto out;
  for (size_t i = 0; i < n_cand; i++) c.tenants[i] = cand[i]->tenant;
  qsort(c.tenants, n_cand, sizeof *c.tenants, offl_ptr_cmp);
  for (size_t i = 0; i < n_cand; i++)
    if (c.n_tenants == 0 || c.tenants[c.n_tenants - 1] != c.tenants[i])
      c.tenants[c.n_tenants++] = c.tenants[i];
  for (size_t i = 0; i < c.n_tenants; i++) first[i] = SIZE_MAX;
  for (size_t i = 0; i < n_cand; i++) {
    size_t k = offl_tenant_at(&c, cand[i]->tenant);
    if (first[k] == SIZE_MAX) first[k] = i;
  }
  offl_scan(b, &c);
  for (size_t g = 0; g < c.n_groups; g++)
    c.groups[g].rank = first[offl_tenant_at(&c, c.groups[g].t)];
  if (c.n_groups) /* groups is NULL when the walk found none */
    qsort(c.groups, c.n_groups, sizeof *c.groups, offl_group_cmp);
  struct gmb_pool_stats ps;
  gmb__pool_stats(b->pool, &ps);
  const uint64_t room0 = ps.room;
  /* Tenant by tenant: each never below its reservation; one the host
   * bounds refuse (or whose copies fail) gives no more.  A segment goes
   * whole, so a slice copies at most `max` and the last segment begun. */
  for (size_t g = 0; g < c.n_groups && made < want && copied < max;) {
    struct gmb_session *o = cand[c.groups[g].rank];
    const struct gmb_tenant *t = c.groups[g].t;
    uint32_t n = 0;
    uint64_t bytes = 0;
    int rc = 0;
    for (; g < c.n_groups && c.groups[g].t == t; g++) {
      if (rc || made >= want) continue;
      if (copied + bytes >= max) {
        *more = 1; /* candidates left for the next slice */
        continue;
      }
      rc = offl_segment(b, o, c.ids + c.groups[g].start,
                        c.groups[g].end - c.groups[g].start, t->reserve, &n,
                        &bytes);
      gmb__pool_stats(b->pool, &ps);
      made = ps.room > room0 ? ps.room - room0 : 0;
    }
    copied += bytes;
    if (made < want && copied >= max && g < c.n_groups) *more = 1;
    if (n && gmb__log_allow(&offl_rl_made)) {
      char sz[GMB_SIZE_BUFSZ], rm[GMB_SIZE_BUFSZ];
      log_info("session %" PRIu64 " (tenant %s, priority %d; with its "
               "tenant's other idle sessions): %u movable allocations (%s) "
               "offloaded to the broker's host memory for session %" PRIu64
               " (tenant %s); %s of device room made%s",
               o->id, t->name, t->priority, n,
               gmb__size_format(bytes, sz, sizeof sz), s->id, s->tenant->name,
               gmb__size_format(made, rm, sizeof rm),
               gmb__log_suppressed(&offl_rl_made));
    }
  }
out:
  free(c.ids);
  free(c.groups);
  free(c.tenants);
  free(first);
  free(cand);
  return made;
}

/* --- one allocation back -------------------------------------------------- */

/* Brings r of session s back: 0 with *rep a LockReply (held: the slot's
 * state is 1, the caller's hold), or the refusal of gmb__alloc_try
 * (nothing changed), or GMB_E_DEVICE when the copy failed (the
 * allocation stays offloaded). */
static int offl_in(struct gmb_broker *b, struct gmb_session *s,
                   struct offl_rec *r, int held, struct wire_reply *rep,
                   enum gmb_nomem_why *why) {
  int rc = gmb__alloc_try(b, s, r->size, GMB_MOVABLE | GMB__ALLOC_NOSLOT,
                          rep, why);
  if (rc) return rc;
  uint64_t id = rep->u.alloc.id;
  struct gmb_alloc_info info;
  rc = gmb__pool_find(b->pool, id, &info);
  GMB_ASSERT(rc == 0 && (info.flags & GMB_MOVABLE) && info.size == r->size &&
             "a restored allocation is movable and of its size");
  gmb__locktab_restoring(s->lt, r->slot);
  rc = gmb__device_copy_host(b->dev, (struct gmb_dseg *)info.dseg,
                             info.offset, r->host, r->size, 0);
  if (rc) {
    gmb__pool_free(b->pool, id, NULL);
    b->pool_ops++;
    gmb__tenant_uncharge(s->tenant, r->size);
    s->allocations--;
    s->used -= r->size;
    gmb__tenant_holes_held(s->tenant, &s->cached_holes, s->used);
    gmb__locktab_unrestored(s->lt, r->slot);
    uint64_t rid = rep->id;
    memset(rep, 0, sizeof *rep);
    rep->id = rid;
    gmb__reply_fail(rep, rc, "allocation %" PRIu64 " could not be copied "
                    "back to the device; it stays offloaded", r->id);
    return rc;
  }
  gmb__pool_set_tag(b->pool, id, gmb__locktab_tag(r->slot));
  offl_sub(b, s, r);
  r->pool_id = id;
  b->offload.restores++;
  b->offload.bytes_in += r->size;
  gmb__locktab_restored(s->lt, r->slot, info.dseg->id, info.offset, held);
  uint64_t rid = rep->id;
  memset(rep, 0, sizeof *rep);
  rep->id = rid;
  rep->kind = WIRE_LOCK;
  rep->u.lock.held = held;
  rep->u.lock.segment = info.dseg->id;
  rep->u.lock.offset = info.offset;
  return 0;
}

/* After a Lock brought one back, the session is active: its other
 * offloaded allocations come back too while there is room now and nobody
 * waits for memory, up to OFFLOAD_BATCH bytes a request (one round trip
 * rather than one per allocation; the loop stays short), unlocked. */
#define OFFLOAD_BATCH (UINT64_C(64) << 20)

static void offl_in_more(struct gmb_broker *b, struct gmb_session *s,
                         int queued) {
  uint64_t done = 0;
  struct offl_rec *r, *next;
  RB_FOREACH_SAFE(r, offl_tree, &s->offl->by_id, next) {
    /* The Lock itself, when the queue serves it, is no one else. */
    if (done >= OFFLOAD_BATCH || s->offl->away == 0 ||
        b->waitq.n > (size_t)queued)
      break;
    if (r->host == NULL) continue;
    struct wire_reply rep;
    memset(&rep, 0, sizeof rep);
    enum gmb_nomem_why why;
    uint64_t size = r->size;
    if (offl_in(b, s, r, 0, &rep, &why) != 0) break;
    done += size;
  }
}

int gmb__offload_try(struct gmb_broker *b, struct gmb_session *s,
                     uint64_t size, uint32_t flags, struct wire_reply *rep,
                     enum gmb_nomem_why *why) {
  if (!(flags & GMB__ALLOC_RESTORE))
    return gmb__alloc_try(b, s, size, flags, rep, why);
  *why = GMB_NOMEM_NONE;
  struct offl_rec *r = offl_find(s, s->restore_id);
  if (r == NULL) {
    /* Freed while its Lock waited: the answer a Lock of a freed id gets. */
    gmb__reply_fail(rep, GMB_E_NOENT, "allocation %" PRIu64 " was freed "
                    "while its Lock waited", s->restore_id);
    return GMB_E_NOENT;
  }
  if (r->host == NULL || s->lt == NULL) {
    /* Brought back by an operator's resume meanwhile. */
    rep->status = 0;
    rep->kind = WIRE_LOCK;
    rep->u.lock.held = 0;
    return 0;
  }
  int rc = offl_in(b, s, r, 1, rep, why);
  if (rc == 0) offl_in_more(b, s, (flags & GMB__ALLOC_QUEUED) != 0);
  return rc;
}

/* --- operators ------------------------------------------------------------- */

/* One slice of an operator's pause of t: its unlocked movable
 * allocations offloaded one by one, GMB_OFFLOAD_SLICE of copies at most
 * (the last allocation begun goes whole); *n and *bytes grow by what
 * went.  Returns 1 when it stopped at the slice with allocations left. */
static int offl_pause_slice(struct gmb_broker *b, struct gmb_tenant *t,
                            uint32_t *n, uint64_t *bytes) {
  if (b->cfg.offload_host_max == 0 || t->sessions == NULL || b->closing)
    return 0;
  b->offload.slices++;
  struct offl_scan c = {.t = t, .now = gmb__now_ns()};
  offl_scan(b, &c);
  uint64_t copied = 0;
  int more = 0;
  for (size_t i = 0; i < c.n; i++) {
    if (copied >= GMB_OFFLOAD_SLICE) {
      more = 1; /* the rest at the next turn, chosen anew */
      break;
    }
    struct gmb_session *owner;
    struct gmb_locktab *lt;
    uint32_t slot;
    struct gmb_alloc_info info;
    if (gmb__pool_find(b->pool, c.ids[i], &info) != 0 ||
        !offl_claim(b, c.ids[i], &owner, &lt, &slot))
      continue; /* locked */
    if (offl_out(b, owner, c.ids[i], lt, slot) != 0)
      break; /* the host bounds, or host memory: nothing more fits */
    (*n)++;
    *bytes += info.size;
    copied += info.size;
  }
  free(c.ids);
  return more;
}

/* The tenants whose operator's pause still runs, counted anew (a tenant
 * removed meanwhile is no longer among them). */
static int offl_count_pausing(void *ctx, struct gmb_tenant *t) {
  *(uint32_t *)ctx += t->offl_pausing != 0;
  return 0;
}

static void offl_pausing_sync(struct gmb_broker *b) {
  uint32_t n = 0;
  if (b->tenants) gmb__tenants_each(b->tenants, offl_count_pausing, &n);
  b->offload.pausing = n;
}

static int offl_first_pausing(void *ctx, struct gmb_tenant *t) {
  if (!t->offl_pausing) return 0;
  *(struct gmb_tenant **)ctx = t;
  return 1;
}

int gmb__offload_pause_step(struct gmb_broker *b, uint32_t *made) {
  *made = 0;
  if (b->offload.pausing == 0) return 0;
  struct gmb_tenant *t = NULL;
  if (b->tenants) gmb__tenants_each(b->tenants, offl_first_pausing, &t);
  if (t != NULL) {
    uint32_t n = 0;
    uint64_t bytes = 0;
    t->offl_pausing = offl_pause_slice(b, t, &n, &bytes);
    t->offl_pause_n += n;
    t->offl_pause_bytes += bytes;
    if (!t->offl_pausing) {
      char sz[GMB_SIZE_BUFSZ];
      log_info("operator's pause of tenant %s: %u movable allocations (%s) "
               "offloaded to the broker's host memory in all, a slice a "
               "turn", t->name, t->offl_pause_n,
               gmb__size_format(t->offl_pause_bytes, sz, sizeof sz));
    }
    *made = n;
  }
  offl_pausing_sync(b);
  return b->offload.pausing > 0;
}

int gmb__offload_tenant(struct gmb_broker *b, struct gmb_tenant *t,
                        int pause, uint32_t *n, uint64_t *bytes) {
  *n = 0;
  *bytes = 0;
  /* A pause running, or done: this command starts over (a resume ends
   * it). */
  t->offl_pausing = 0;
  t->offl_pause_n = 0;
  t->offl_pause_bytes = 0;
  if (pause) {
    t->offl_pausing = offl_pause_slice(b, t, n, bytes);
    t->offl_pause_n = *n;
    t->offl_pause_bytes = *bytes;
    offl_pausing_sync(b);
    return t->offl_pausing;
  }
  offl_pausing_sync(b);
  for (struct gmb_session *s = t->sessions; s; s = s->tenant_next) {
    if (s->offl == NULL || s->offl->away == 0) continue;
    struct offl_rec *r, *next;
    RB_FOREACH_SAFE(r, offl_tree, &s->offl->by_id, next) {
      if (r->host == NULL || s->restore_id == r->id) continue;
      struct wire_reply rep;
      memset(&rep, 0, sizeof rep);
      enum gmb_nomem_why why;
      uint64_t size = r->size;
      if (offl_in(b, s, r, 0, &rep, &why) != 0) break; /* no room: lazily */
      (*n)++;
      *bytes += size;
    }
  }
  return 0;
}

/* --- the consistency check ------------------------------------------------ */

/* Pass 0 zeroes the chunks' counts, pass 1 counts each chunk's copies and
 * the chunks' bytes (each once), pass 2 compares the counts. */
struct offl_count {
  struct gmb_broker *b;
  int pass;
  uint64_t bytes, chunk_bytes;
  uint32_t held;
  int cur_seen; /* the current chunk holds one of the copies */
  int bad;
};

static void offl_check_chunk(struct offl_count *c, const struct offl_rec *r) {
  struct gmb_offl_chunk *k = r->chunk;
  if (k == NULL) {
    c->bad += c->pass == 1;
    return;
  }
  if (c->pass == 0) {
    k->seen = 0;
  } else if (c->pass == 1) {
    if (k->seen++ == 0) c->chunk_bytes += k->size;
    c->cur_seen |= k == c->b->offload.chunk;
    /* The copy lies in what was cut of its chunk. */
    c->bad += (const char *)r->host < k->base || k->used > k->size ||
              r->size > k->used ||
              (uint64_t)((const char *)r->host - k->base) > k->used - r->size;
  } else {
    c->bad += k->seen != k->live;
  }
}

static void offl_check_session(void *ctx, struct gmb_session *s) {
  struct offl_count *c = ctx;
  const struct gmb_offload_set *st = s->offl;
  struct offl_rec *r;
  if (c->pass != 1) {
    if (st)
      RB_FOREACH(r, offl_tree, &s->offl->by_id)
        if (r->host) offl_check_chunk(c, r);
    return;
  }
  uint64_t movable = 0;
  for (const struct gmb_sleep_tag *z = s->paused; z; z = z->next)
    if (strcmp(z->tag, GMB_SLEEP_MOVABLE_TAG) == 0) movable = z->host_bytes;
  if (st == NULL) {
    c->bad += movable != 0;
    return;
  }
  uint64_t bytes = 0;
  uint32_t n = 0, away = 0;
  RB_FOREACH(r, offl_tree, &s->offl->by_id) {
    n++;
    c->bad += r->slot >= st->cap || st->by_slot[r->slot] != r;
    if (r->host) {
      away++;
      bytes += r->size;
      c->bad += r->pool_id != 0 || s->lt == NULL;
      offl_check_chunk(c, r);
    } else {
      struct gmb_alloc_info info;
      uint32_t slot;
      c->bad += r->chunk != NULL ||
                gmb__pool_find(c->b->pool, r->pool_id, &info) != 0 ||
                info.owner != s || gmb__session_slot(&info, &slot) == NULL ||
                slot != r->slot;
    }
  }
  c->bad += n != st->n || away != st->away || bytes != st->bytes ||
            bytes != movable;
  c->bytes += bytes;
  c->held += away;
}

int gmb__offload_check(struct gmb_broker *b) {
  if (b->sessions == NULL) return 0;
  struct offl_count c = {.b = b};
  for (c.pass = 0; c.pass < 3; c.pass++)
    gmb__sessions_each(b->sessions, offl_check_session, &c);
  /* Sessions being reaped (core.c) forgot theirs when they ended.  A
   * chunk goes with its last copy, so the chunks are those the copies
   * are in, the current one among them. */
  c.bad += c.bytes != b->offload.host_bytes || c.held != b->offload.held;
  c.bad += c.chunk_bytes != b->offload.chunk_bytes ||
           (b->offload.chunk != NULL && !c.cur_seen);
  if (c.bad) log_error("offload: %d violations of the offload sums", c.bad);
  return c.bad;
}
