/*
 * alloc.c - giving a session memory (alloc.h has the order and the rules).
 */
#include "alloc.h"

#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "gmb.h"
#include "locktab.h"
#include "log.h"
#include "reply.h"
#include "util.h"

uint64_t gmb__alloc_round(uint64_t size) {
  return (size + GMB_POOL_ALIGN - 1) & ~(uint64_t)(GMB_POOL_ALIGN - 1);
}

struct alloc_unmovable {
  const struct gmb_tenant *me;
  uint64_t others_free; /* free bytes in other tenants' segments */
  uint64_t bytes;
  struct {
    struct gmb_tenant *t;
    uint64_t bytes;
  } by[WIRE_HOLDERS_MAX];
  size_t n;
};

/* Counts the bytes compaction cannot move: pinned, or movable and locked
 * now; and which tenants hold the most of them.  And the free bytes in
 * other tenants' segments, which the requester can never use as they are
 * (a client may read all of a segment it maps). */
static int alloc_count_unmovable(void *ctx, const struct gmb_alloc_info *a,
                                 int is_free) {
  struct alloc_unmovable *u = ctx;
  if (is_free) {
    struct gmb_segment_view v;
    gmb__pool_segment_view(a->segment, &v);
    if (v.arena_tag != u->me) u->others_free += a->size;
    return 0;
  }
  if (a->id == 0) return 0;
  struct gmb_session *s = a->owner;
  if (s == NULL) return 0;
  if ((a->flags & GMB_MOVABLE) && !gmb__session_alloc_locked(a)) return 0;
  u->bytes += a->size;
  size_t i;
  for (i = 0; i < u->n; i++)
    if (u->by[i].t == s->tenant) break;
  if (i == u->n) {
    if (u->n == WIRE_HOLDERS_MAX) return 0; /* the total still counts */
    u->by[u->n].t = s->tenant;
    u->by[u->n].bytes = 0;
    u->n++;
  }
  u->by[i].bytes += a->size;
  return 0;
}

/* Walks the pool for what cannot be moved (b->explain keeps it) and the
 * free bytes in other tenants' segments than s's (returned). */
static uint64_t alloc_explain_walk(struct gmb_broker *b,
                                   const struct gmb_session *s, uint64_t now) {
  struct alloc_unmovable u;
  memset(&u, 0, sizeof u);
  u.me = s->tenant;
  gmb__pool_walk(b->pool, alloc_count_unmovable, &u);
  struct gmb_explain *e = &b->explain;
  e->at_ns = now;
  e->in_window++;
  e->walks++;
  e->unmovable = u.bytes;
  e->n = u.n;
  for (size_t i = 0; i < u.n; i++) {
    snprintf(e->holders[i], sizeof e->holders[i], "%s", u.by[i].t->name);
    e->bytes[i] = u.by[i].bytes;
  }
  return u.others_free;
}

void gmb__alloc_explain(struct gmb_broker *b, const struct gmb_session *s,
                        uint64_t rounded, struct wire_reply *rep) {
  uint64_t largest = 0, total = 0;
  gmb__pool_fragmentation(b->pool, &largest, &total);
  /* The walk is O(every range): a few a second (broker.h); the refusals
   * past them get the last walk's figures, and their age. */
  struct gmb_explain *e = &b->explain;
  const uint64_t now = gmb__now_ns();
  if (now - e->window_ns >= GMB_NS_PER_S) {
    e->window_ns = now;
    e->in_window = 0;
  }
  const int walk = e->at_ns == 0 || e->in_window < GMB_EXPLAIN_WALKS;
  const uint64_t others_free = walk ? alloc_explain_walk(b, s, now) : 0;
  char req_s[GMB_SIZE_BUFSZ], tot_s[GMB_SIZE_BUFSZ], big_s[GMB_SIZE_BUFSZ],
      stuck_s[GMB_SIZE_BUFSZ], one[GMB_SIZE_BUFSZ];
  char holders[256] = "";
  size_t off = 0;
  for (size_t i = 0; i < e->n && off < sizeof holders; i++) {
    int n = snprintf(holders + off, sizeof holders - off, "%s%s %s",
                     i ? ", " : "", e->holders[i],
                     gmb__size_format(e->bytes[i], one, sizeof one));
    if (n < 0) break;
    off += (size_t)n;
  }
  char age[112] = "";
  if (!walk)
    snprintf(age, sizeof age, " (counted %llu ms ago: the pool is walked "
             "for it at most %d times a second)",
             (unsigned long long)((now - e->at_ns) / GMB_NS_PER_MS),
             GMB_EXPLAIN_WALKS);
  /* cuda: retired segments still occupy the device until every client
   * that mapped them said it closed them; say so rather than leave a
   * "free" figure the device cannot honour. */
  /* Free bytes in other tenants' segments serve this tenant only once
   * compaction empties a whole segment of theirs back to the device. */
  char others[128] = "";
  if (others_free)
    snprintf(others, sizeof others, "; %s of the free bytes lie in other "
             "tenants' segments", gmb__size_format(others_free, one,
                                                   sizeof one));
  char retiring[96] = "";
  if (b->dev->retiring_bytes)
    snprintf(retiring, sizeof retiring,
             "; %s in %llu retired segment(s) waits for clients to close it",
             gmb__size_format(b->dev->retiring_bytes, one, sizeof one),
             (unsigned long long)b->dev->retiring);
  /* The room the offload job makes is its requests' (gmb__alloc_fence). */
  char fenced[128] = "";
  const uint64_t fence = gmb__alloc_fence(b, s);
  if (fence)
    snprintf(fenced, sizeof fenced, "; %s of the room is kept for the %zu "
             "request(s) the broker's offload job holds",
             gmb__size_format(fence, one, sizeof one), b->waitq.held_job);
  gmb__reply_fail(rep, GMB_E_NOMEM,
                  "no room for %s on %s (tenant %s): %s free in total, the "
                  "largest free range is %s; %s cannot be moved (pinned or "
                  "locked)%s%s%s%s%s%s%s",
                  gmb__size_format(rounded, req_s, sizeof req_s),
                  b->dev->desc, s->tenant->name,
                  gmb__size_format(total, tot_s, sizeof tot_s),
                  gmb__size_format(largest, big_s, sizeof big_s),
                  gmb__size_format(e->unmovable, stuck_s, sizeof stuck_s),
                  e->n ? ", held by " : "", holders, age, others,
                  b->cfg.compaction ? "" : "; compaction is off", retiring,
                  fenced);
  rep->kind = WIRE_NOMEM;
  rep->u.nomem.request = rounded;
  rep->u.nomem.free_total = total;
  rep->u.nomem.largest_free = largest;
  rep->u.nomem.unmovable = e->unmovable;
  rep->u.nomem.n_holders = e->n;
  for (size_t i = 0; i < e->n; i++)
    snprintf(rep->u.nomem.holders[i], sizeof rep->u.nomem.holders[i], "%s",
             e->holders[i]);
}

int gmb__alloc_quota(struct gmb_tenant *t, uint64_t rounded,
                     struct wire_reply *rep) {
  int rc = gmb__tenant_fits(t, rounded);
  if (rc) {
    char why[256];
    gmb__tenant_quota_why(t, rounded, why, sizeof why);
    gmb__reply_fail(rep, rc, "%s", why);
  }
  return rc;
}

void gmb__alloc_asked_back(const struct gmb_session *s,
                           struct wire_reply *rep) {
  /* Its own ask (for another's request) is not for this one: the caller is
   * blocked in this request and could not answer it anyway. */
  uint64_t coming = s->tenant->cache_asked - s->ask_bytes;
  if (coming == 0) return;
  rep->asked_back = coming;
  char sz[GMB_SIZE_BUFSZ];
  size_t n = strlen(rep->message);
  snprintf(rep->message + n, sizeof rep->message - n, "; %s of cached memory "
           "asked back from the tenant's other sessions is still on its way",
           gmb__size_format(coming, sz, sizeof sz));
}


uint64_t gmb__alloc_fence(const struct gmb_broker *b,
                          const struct gmb_session *s) {
  const struct gmb_waitq *q = &b->waitq;
  if (q->held_job == 0) return 0;
  /* A waiter: the job's own, or one ahead of its first in the queue,
   * passes; a new request comes after every waiter of its priority, so
   * only a higher one passes. */
  if (q->trying ? q->trying_passes : s->tenant->priority > q->job_priority)
    return 0;
  /* What the job's requests take, with what the reservations keep beside
   * them, less what the caches were asked for them: that much of the
   * room is theirs (reclaim.c reckons the job's lack the same way). */
  const uint64_t need = q->job_want + q->job_kept;
  const uint64_t coming = b->reclaim.ask_bytes < q->job_asked
                              ? b->reclaim.ask_bytes
                              : q->job_asked;
  return need > coming ? need - coming : 0;
}

/* A new segment was just made for session s's request: 1 when the room
 * left eats into what is fenced for the offload job (counted). */
static int alloc_fenced(struct gmb_broker *b, const struct gmb_session *s) {
  const uint64_t fence = gmb__alloc_fence(b, s);
  if (fence == 0) return 0;
  struct gmb_pool_stats ps;
  gmb__pool_stats(b->pool, &ps);
  if (ps.room >= fence) return 0;
  b->waitq.fenced++;
  return 1;
}

/* New segments were just made for session s's request of `size` bytes:
 * 0 when they may stay, else the refusal, and the caller undoes them:
 * the other tenants' reservations (GMB_NOMEM_RESERVED, the reason in
 * msg), or the room left being the offload job's (GMB_NOMEM_NO_ROOM,
 * alloc_fenced). */
static int alloc_segments_refused(struct gmb_broker *b,
                                  const struct gmb_session *s, uint64_t size,
                                  char *msg, size_t cap,
                                  enum gmb_nomem_why *why) {
  uint64_t room = b->dev->capacity > b->dev->in_use
                      ? b->dev->capacity - b->dev->in_use
                      : 0;
  int rc = gmb__tenant_reserve_allows(b->tenants, s->tenant, size, room, msg,
                                      cap);
  if (rc) {
    *why = GMB_NOMEM_RESERVED;
    return rc;
  }
  if (alloc_fenced(b, s)) {
    *why = GMB_NOMEM_NO_ROOM;
    return GMB_E_NOMEM;
  }
  return 0;
}

/* Gives back the `n` page allocations made so far for a refused pages
 * request. */
static void alloc_pages_undo(struct gmb_broker *b, struct gmb_tenant *t,
                             const uint64_t *ids, uint32_t n) {
  for (uint32_t i = 0; i < n; i++) gmb__pool_free(b->pool, ids[i], NULL);
  gmb__tenant_segments_sync(b->tenants, t);
}

/* A cache's pages (GMB__ALLOC_PAGES): `size` / GMB_SEGMENT_ALIGN pinned
 * allocations of one page each, every one in a segment of its own (the
 * pool's rule for requests past the small size), all or none.  The quota
 * was asked for the total. */
static int alloc_pages(struct gmb_broker *b, struct gmb_session *s,
                       uint64_t size, struct wire_reply *rep,
                       enum gmb_nomem_why *why) {
  struct gmb_tenant *t = s->tenant;
  const uint32_t n = (uint32_t)(size / GMB_SEGMENT_ALIGN);
  GMB_ASSERT(n >= 1 && n <= WIRE_PAGES_MAX &&
             size == (uint64_t)n * GMB_SEGMENT_ALIGN &&
             "dispatch checked the pages request");
  uint64_t seg_before = t->segment_bytes;
  memset(&rep->u.alloc, 0, sizeof rep->u.alloc);
  for (uint32_t i = 0; i < n; i++) {
    struct gmb_alloc_info info;
    int rc = gmb__pool_alloc(b->pool, t->arena, GMB_SEGMENT_ALIGN, 0, s,
                             &info);
    /* Counted at once: a page given back below (undo) retires a segment
     * the tenant must already be counted for. */
    gmb__tenant_segments_sync(b->tenants, t);
    if (rc == 0 && (info.offset != 0 || info.dseg->size != GMB_SEGMENT_ALIGN)) {
      /* Not a segment of its own: the pool's rules changed under us. */
      gmb__pool_free(b->pool, info.id, NULL);
      rc = GMB_E_DEVICE;
    }
    if (rc) {
      alloc_pages_undo(b, t, rep->u.alloc.page_id, i);
      if (rc != GMB_E_NOMEM)
        gmb__reply_fail(rep, rc, "%u pages for a cache failed: %s", n,
                        gmb_strerror(rc));
      else
        *why = GMB_NOMEM_NO_ROOM;
      return rc;
    }
    rep->u.alloc.page_id[i] = info.id;
    rep->u.alloc.page_seg[i] = info.dseg->id;
  }
  gmb__tenant_segments_sync(b->tenants, t);
  if (gmb__tenant_over(t, size)) { /* as in gmb__alloc_try */
    alloc_pages_undo(b, t, rep->u.alloc.page_id, n);
    return gmb__alloc_quota(t, size, rep);
  }
  if (t->segment_bytes > seg_before) {
    char msg[WIRE_MESSAGE_MAX];
    int rc = alloc_segments_refused(b, s, size, msg, sizeof msg, why);
    if (rc) {
      alloc_pages_undo(b, t, rep->u.alloc.page_id, n);
      if (*why == GMB_NOMEM_RESERVED)
        gmb__reply_fail(rep, rc, "%s", msg);
      else
        memset(&rep->u.alloc, 0, sizeof rep->u.alloc);
      return rc;
    }
  }
  int rc = gmb__tenant_charge(t, size);
  GMB_ASSERT(rc == 0 && "a size that fit the quota a moment ago");
  s->allocations += n;
  s->used += size;
  b->pool_ops += n;
  rep->status = 0;
  rep->kind = WIRE_ALLOC;
  rep->u.alloc.n_pages = n;
  rep->u.alloc.id = rep->u.alloc.page_id[0];
  rep->u.alloc.segment = rep->u.alloc.page_seg[0];
  rep->u.alloc.size = size;
  return 0;
}

int gmb__alloc_try(struct gmb_broker *b, struct gmb_session *s, uint64_t size,
                   uint32_t flags, struct wire_reply *rep,
                   enum gmb_nomem_why *why) {
  struct gmb_tenant *t = s->tenant;
  uint64_t rounded = gmb__alloc_round(size);
  *why = GMB_NOMEM_NONE;
  int rc = gmb__alloc_quota(t, rounded, rep);
  if (rc) return rc;
  if (flags & GMB__ALLOC_PAGES) return alloc_pages(b, s, size, rep, why);
  const int noslot = (flags & GMB__ALLOC_NOSLOT) != 0;
  flags &= ~(uint32_t)GMB__ALLOC_NOSLOT;
  struct gmb_alloc_info info;
  uint64_t seg_before = t->segment_bytes;
  rc = gmb__pool_alloc(b->pool, t->arena, size, flags, s, &info);
  /* The pool may have made a segment for t, or released lingering ones
   * (the retire callback counted those). */
  gmb__tenant_segments_sync(b->tenants, t);
  if (rc) {
    if (rc != GMB_E_NOMEM)
      gmb__reply_fail(rep, rc, "allocation of %" PRIu64 " bytes failed: %s",
                      size, gmb_strerror(rc));
    else
      *why = GMB_NOMEM_NO_ROOM;
    return rc;
  }
  /* To make room the pool may have released lingering segments that
   * processes still map: on a device that frees a segment only once its
   * mappers closed it (cuda) they are parked, and count against their
   * tenant's quota and uid budget from then on (tenant.h: retiring), t's
   * among them.  So the quota is asked again before the charge. */
  if (gmb__tenant_over(t, rounded)) {
    gmb__pool_free(b->pool, info.id, NULL);
    gmb__tenant_segments_sync(b->tenants, t);
    return gmb__alloc_quota(t, rounded, rep);
  }
  if (t->segment_bytes > seg_before) {
    char msg[WIRE_MESSAGE_MAX];
    rc = alloc_segments_refused(b, s, rounded, msg, sizeof msg, why);
    if (rc) {
      gmb__pool_free(b->pool, info.id, NULL);
      /* A small segment made for it would linger, counted as t's and
       * taking room from the reservations or the offload job's: give it
       * back now.  Fenced from the job's room, the request lacks room as
       * much as if there were none. */
      gmb__pool_trim(b->pool);
      gmb__tenant_segments_sync(b->tenants, t);
      if (*why == GMB_NOMEM_RESERVED) gmb__reply_fail(rep, rc, "%s", msg);
      return rc;
    }
  }
  GMB_ASSERT(info.size == rounded && "pool and broker round differently");
  uint32_t slot = 0;
  /* The pool keeps a large allocation pinned (pool.h rule 1): no slot. */
  if ((info.flags & GMB_MOVABLE) && !noslot) {
    rc = gmb__locktab_slot_new(s->lt, info.id, info.dseg->id, info.offset,
                               &slot);
    if (rc) {
      gmb__pool_free(b->pool, info.id, NULL);
      if (rc == GMB_E_LIMIT)
        gmb__reply_fail(rep, rc, "this session holds as many movable "
                        "allocations as its lock table has slots (%u)",
                        GMB_LT_DEFAULT_SLOTS);
      else
        gmb__reply_fail(rep, rc, "no lock-table slot: out of host memory");
      return rc;
    }
    gmb__pool_set_tag(b->pool, info.id, gmb__locktab_tag(slot));
  }
  rc = gmb__tenant_charge(t, rounded);
  GMB_ASSERT(rc == 0 && "a size that fit the quota a moment ago");
  s->allocations++;
  s->used += rounded;
  b->pool_ops++;
  rep->status = 0;
  rep->kind = WIRE_ALLOC;
  rep->u.alloc.id = info.id;
  rep->u.alloc.size = info.size;
  rep->u.alloc.segment = info.dseg->id;
  rep->u.alloc.offset = info.offset;
  rep->u.alloc.slot = slot;
  rep->u.alloc.pinned = (flags & GMB_MOVABLE) && !(info.flags & GMB_MOVABLE);
  rep->u.alloc.tail_segment = info.tail_dseg ? info.tail_dseg->id : 0;
  rep->u.alloc.tail_offset = info.tail_offset;
  rep->u.alloc.tail_size = info.tail_size;
  rep->u.alloc.n_pages = 0;
  /* The client fetches the segment's descriptor from the descriptor
   * channel when it has not mapped the segment yet (fdchan.c). */
  return 0;
}

/* --- VMM memory and the tenant's figures ---------------------------------- */

void gmb__alloc_stats(struct gmb_broker *b, const struct gmb_session *s,
                      struct wire_reply *rep) {
  struct gmb_arena_stats as;
  gmb__pool_arena_stats(s->tenant->arena, &as);
  rep->kind = WIRE_STATS;
  rep->u.stats.quota = s->tenant->quota;
  /* Its VMM bytes are memory it holds: in `used` too, so that quota -
   * used is what it can still get, whichever way it asks. */
  rep->u.stats.used = s->tenant->used + s->tenant->vmm;
  rep->u.stats.vmm = s->tenant->vmm;
  rep->u.stats.peak = s->tenant->peak;
  rep->u.stats.segments = as.segment_bytes;
  struct gmb_pool_stats ps;
  gmb__pool_stats(b->pool, &ps);
  rep->u.stats.device_capacity = ps.capacity;
  rep->u.stats.device_segments = ps.segment_bytes + b->dev->external;
  rep->u.stats.device_used = ps.used;
  rep->u.stats.free_in_segments = as.free_total;
  rep->u.stats.cached = gmb__tenant_cached(s->tenant);
}

int gmb__alloc_vmm(struct gmb_broker *b, struct gmb_session *s, uint64_t more,
                   struct wire_reply *rep, enum gmb_nomem_why *why) {
  struct gmb_tenant *t = s->tenant;
  char sz[GMB_SIZE_BUFSZ], text[WIRE_MESSAGE_MAX - 64];
  *why = GMB_NOMEM_NONE;
  if (gmb__tenant_fits(t, more) != 0) {
    gmb__tenant_quota_why(t, more, text, sizeof text);
    gmb__reply_fail(rep, GMB_E_QUOTA, "%s (cuMemCreate)", text);
    return GMB_E_QUOTA;
  }
  /* Lingering empty segments take room a new segment would have found
   * (gmb__alloc_try releases them before it gives up): released first.
   * Parked, they count against the quota (as in gmb__alloc_try): it is
   * asked again. */
  if (more > b->dev->capacity - b->dev->in_use) {
    gmb__pool_trim(b->pool);
    if (gmb__tenant_fits(t, more) != 0) {
      gmb__tenant_quota_why(t, more, text, sizeof text);
      gmb__reply_fail(rep, GMB_E_QUOTA, "%s (cuMemCreate)", text);
      return GMB_E_QUOTA;
    }
  }
  const uint64_t room = b->dev->capacity - b->dev->in_use;
  if (more > room) {
    char rm[GMB_SIZE_BUFSZ];
    *why = GMB_NOMEM_NO_ROOM;
    gmb__reply_fail(rep, GMB_E_NOMEM, "the device has room for %s more, not "
                    "%s (cuMemCreate)", gmb__size_format(room, rm, sizeof rm),
                    gmb__size_format(more, sz, sizeof sz));
    return GMB_E_NOMEM;
  }
  /* The room the offload job makes is its requests' (gmb__alloc_fence). */
  const uint64_t fence = gmb__alloc_fence(b, s);
  if (fence > room - more) {
    char rm[GMB_SIZE_BUFSZ], fc[GMB_SIZE_BUFSZ];
    b->waitq.fenced++;
    *why = GMB_NOMEM_NO_ROOM;
    gmb__reply_fail(rep, GMB_E_NOMEM, "the device has room for %s more, of "
                    "which %s is kept for the requests the broker's offload "
                    "job holds; not %s (cuMemCreate)",
                    gmb__size_format(room, rm, sizeof rm),
                    gmb__size_format(fence, fc, sizeof fc),
                    gmb__size_format(more, sz, sizeof sz));
    return GMB_E_NOMEM;
  }
  if (gmb__tenant_reserve_allows(b->tenants, t, more, room - more, text,
                                 sizeof text) != 0) {
    *why = GMB_NOMEM_RESERVED;
    gmb__reply_fail(rep, GMB_E_NOMEM, "%s (cuMemCreate)", text);
    return GMB_E_NOMEM;
  }
  int rc = gmb__device_external(b->dev, (int64_t)more);
  GMB_ASSERT(rc == 0 && "the room was checked a moment ago");
  gmb__tenant_vmm(t, (int64_t)more);
  s->vmm += more;
  gmb__alloc_stats(b, s, rep);
  return 0;
}
