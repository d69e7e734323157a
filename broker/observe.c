/*
 * observe.c - what the broker shows of itself: the admin status, the
 * snapshot behind gmbctl map/snapshot, the counters behind the metrics, and
 * the metrics text for gmbctl metrics and the HTTP endpoint
 * (docs/metrics.md, docs/snapshot.md).
 *
 * Owns: request counters per kind and per refusal and the allocation
 * latency histogram.  All of it runs on the loop thread; the loop publishes
 * the text to the HTTP endpoint (http.c).
 *
 * Invariants: a snapshot's ranges tile each segment in address order (the
 * pool walk guarantees it; the snapshot only copies); a page holds at most
 * its limit of ranges, so what one request makes the broker allocate and
 * how long it holds the loop are bounded whatever the pool's size; its
 * status is built by the same function as the admin status, so that map,
 * snapshot and status never disagree; every counter only grows.
 */
#include "observe.h"

#include <inttypes.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gmb.h"
#include "log.h"
#include "session.h"
#include "sleep.h"
#include "tenant.h"
#include "util.h"

#define OBSERVE_KINDS 32  /* > every enum wire_kind */
#define OBSERVE_CODES 32  /* > every -GMB_E_* */

/* Upper bounds of the allocation latency buckets, in seconds.  An answer
 * from the pool takes microseconds; one that created a segment or waited
 * for compaction, milliseconds to seconds: the buckets span both. */
static const double observe_le[] = {
    0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025,
    0.005,   0.01,     0.025,   0.05,   0.1,     0.25,   0.5,   1,
    2.5,     5,        10};
#define OBSERVE_NLE (sizeof observe_le / sizeof observe_le[0])

/* A histogram over observe_le. */
struct observe_hist {
  uint64_t bucket[OBSERVE_NLE + 1]; /* not cumulative; last: +Inf */
  uint64_t count;
  double seconds;
};

struct gmb_observe {
  uint64_t requests[OBSERVE_KINDS];
  uint64_t refusals[OBSERVE_CODES]; /* by -status */
  struct observe_hist alloc; /* allocation requests, waits included */
  struct observe_hist turn;  /* the loop's turns, their work (no wait) */
  double turn_max;           /* the longest turn's work, in seconds */
};

static void observe_hist_add(struct observe_hist *h, double s) {
  size_t i = 0;
  while (i < OBSERVE_NLE && s > observe_le[i]) i++;
  h->bucket[i]++;
  h->count++;
  h->seconds += s;
}

struct gmb_observe *gmb__observe_new(void) {
  return calloc(1, sizeof(struct gmb_observe));
}

void gmb__observe_destroy(struct gmb_observe *o) { free(o); }

void gmb__observe_request(struct gmb_observe *o, enum wire_kind kind,
                          int status, uint64_t ns) {
  if (o == NULL) return;
  if ((unsigned)kind < OBSERVE_KINDS) o->requests[kind]++;
  if (status < 0 && -status < OBSERVE_CODES) o->refusals[-status]++;
  if (kind != WIRE_ALLOC) return;
  observe_hist_add(&o->alloc, (double)ns / 1e9);
}

double gmb__observe_turn(struct gmb_observe *o, uint64_t ns) {
  if (o == NULL) return 0;
  double s = (double)ns / 1e9;
  observe_hist_add(&o->turn, s);
  double before = o->turn_max;
  if (s > o->turn_max) o->turn_max = s;
  return before;
}

/* --- status ------------------------------------------------------------- */

void gmb__observe_tenant_row(struct gmb_tenant *t,
                             struct wire_tenant_row *row) {
  struct gmb_arena_stats as;
  gmb__pool_arena_stats(t->arena, &as);
  memset(row, 0, sizeof *row);
  snprintf(row->name, sizeof row->name, "%s", t->name);
  row->quota = t->quota;
  row->used = t->used + t->vmm; /* as the tenant's own StatsReply says */
  row->vmm = t->vmm;
  row->peak = t->peak;
  row->segments = as.segment_bytes;
  row->sessions = t->n_sessions;
  row->allocations = as.allocations;
  row->free_in_segments = as.free_total;
  row->largest_free = as.largest_free;
  row->fragmentation = gmb__fragmentation(as.largest_free, as.free_total);
  row->reserve = t->reserve;
  row->priority = t->priority;
  row->waiting = t->waiting;
  row->cached = gmb__tenant_cached(t);
  gmb__tenant_trim_totals(t, &row->trim_asks, &row->trim_ignored);
  row->host_bytes = t->host_bytes;
  row->paused_bytes = t->paused_bytes;
  row->paused_tags = (uint32_t)t->paused_tags;
  row->host_quota = t->host_quota;
  row->pauses = t->pauses;
  row->resumes = t->resumes;
  row->paused_seconds = gmb__sleep_tenant_seconds(t, gmb__now_ns());
  row->sleep_asks = t->sleep_asks;
  row->fd_unread = t->fd_unread;
  row->fd_kept = t->fd_kept;
  row->fd_refused = t->fd_refused;
}

struct observe_rows {
  struct wire_tenant_row *rows;
  size_t n, cap;
  struct wire_session_row *srows;
  size_t ns, scap;
};

static void observe_session_row(const struct gmb_session *s,
                                struct wire_session_row *row) {
  memset(row, 0, sizeof *row);
  row->id = s->id;
  snprintf(row->tenant, sizeof row->tenant, "%s", s->tenant->name);
  row->uid = (uint32_t)s->uid;
  row->pid = (int32_t)s->pid;
  /* The client's own words, shown to operators: escaped (gmb__log_escape),
   * so neither a terminal nor a JSON encoder meets its raw bytes. */
  gmb__log_escape(row->client, sizeof row->client, s->client);
  row->allocations = s->allocations;
  row->used = s->used;
  row->cached = gmb__session_cached(s);
  row->trim_asks = s->trim_asks;
  row->trim_ignored = s->trim_ignored;
  row->waiting = s->waiting;
  row->fd_unread = s->fd_sent;
  row->fd_refused = s->fd_refused;
  row->host_bytes = s->host_bytes;
  row->paused_bytes = s->paused_bytes;
  char paused[sizeof row->paused];
  gmb__sleep_session_paused(s, paused, sizeof paused);
  gmb__log_escape(row->paused, sizeof row->paused, paused);
  row->sleep_pausable = s->sleep_pausable;
  uint64_t now = gmb__now_ns();
  row->sleep_idle_ms = (s->sleep_pausable || s->sleep_idle) &&
                                   now > s->sleep_active_ns
                           ? (now - s->sleep_active_ns) / GMB_NS_PER_MS
                           : 0;
}

static int observe_session_cmp(const void *a, const void *b) {
  const struct wire_session_row *x = a, *y = b;
  return x->id < y->id ? -1 : x->id > y->id;
}

/* A tenant's row, then its sessions' rows (by id; its list is newest
 * first).  The tables were sized from the registries' counts, which
 * nothing changes meanwhile (one thread). */
static int observe_row(void *ctx, struct gmb_tenant *t) {
  struct observe_rows *r = ctx;
  if (r->n == r->cap) return 1;
  struct wire_tenant_row *row = &r->rows[r->n++];
  gmb__observe_tenant_row(t, row);
  size_t first = r->ns;
  for (const struct gmb_session *s = t->sessions; s; s = s->tenant_next) {
    GMB_ASSERT(r->ns < r->scap && "every session is in the table");
    observe_session_row(s, &r->srows[r->ns++]);
  }
  if (r->ns > first) /* srows is NULL while there is no session */
    qsort(r->srows + first, r->ns - first, sizeof *r->srows,
          observe_session_cmp);
  return 0;
}

void gmb__observe_status(struct gmb_broker *b, struct wire_reply *rep) {
  struct gmb_pool_stats ps;
  gmb__pool_stats(b->pool, &ps);
  rep->kind = WIRE_ADMIN_STATUS;
  snprintf(rep->u.admin_status.device, sizeof rep->u.admin_status.device,
           "%s", b->dev->desc);
  rep->u.admin_status.capacity = ps.capacity;
  rep->u.admin_status.in_segments = ps.segment_bytes;
  rep->u.admin_status.retiring = b->dev->retiring_bytes;
  rep->u.admin_status.in_use = ps.used;
  rep->u.admin_status.sessions = (uint32_t)gmb__sessions_count(b->sessions);
  rep->u.admin_status.fragmentation = gmb__pool_fragmentation(
      b->pool, &rep->u.admin_status.largest_free, NULL);
  rep->u.admin_status.compaction = b->compact_totals;
  /* Every session is listed: their number is bounded by max_sessions
   * (admission refuses the next), a few dozen bytes each. */
  struct observe_rows r = {0};
  r.cap = gmb__tenants_count(b->tenants);
  r.scap = gmb__sessions_count(b->sessions);
  if ((r.cap && (r.rows = calloc(r.cap, sizeof *r.rows)) == NULL) ||
      (r.scap && (r.srows = calloc(r.scap, sizeof *r.srows)) == NULL)) {
    free(r.rows);
    rep->kind = WIRE_NONE;
    rep->status = GMB_E_SYSTEM;
    snprintf(rep->message, sizeof rep->message, "out of host memory");
    return;
  }
  if (r.cap) gmb__tenants_each(b->tenants, observe_row, &r);
  GMB_ASSERT(r.ns == r.scap && "each session belongs to a listed tenant");
  uint64_t cached = 0;
  for (size_t i = 0; i < r.n; i++) {
    cached += r.rows[i].cached;
    rep->u.admin_status.host_bytes += r.rows[i].host_bytes;
    rep->u.admin_status.paused_bytes += r.rows[i].paused_bytes;
  }
  rep->u.admin_status.cached = cached;
  rep->u.admin_status.offload_job_requests = (uint32_t)b->waitq.held_job;
  rep->u.admin_status.offload_slices = b->offload.slices;
  rep->u.admin_status.offload_jobs = b->offload.jobs;
  rep->u.admin_status.offload_pauses = b->offload.pausing;
  rep->u.admin_status.fd_unread = b->fd_unread;
  rep->u.admin_status.fd_kept = b->fd_kept;
  rep->u.admin_status.fd_refused = b->fd_refused;
  /* Freed by gmb__wire_reply_clear. */
  rep->u.admin_status.tenants = r.rows;
  rep->u.admin_status.n_tenants = r.n;
  rep->u.admin_status.session_rows = r.srows;
  rep->u.admin_status.n_sessions = r.ns;
}

/* --- snapshot ------------------------------------------------------------ */

/* One page being filled by the pool's walk. */
struct observe_page {
  struct wire_segment_info *segs;
  size_t n, cap;
  size_t rcap;       /* capacity of segs[n - 1].ranges */
  uint32_t ranges;   /* in the page so far */
  uint32_t limit;
  int oom;
};

static int observe_range(void *ctx, const struct gmb_alloc_info *info,
                         int is_free) {
  struct observe_page *w = ctx;
  if (w->ranges == w->limit) return 1; /* full: this range opens the next */
  struct wire_segment_info *si = w->n ? &w->segs[w->n - 1] : NULL;
  if (si == NULL || si->id != info->dseg->id) {
    if (w->n == w->cap) {
      size_t cap = w->cap ? w->cap * 2 : 16;
      struct wire_segment_info *s = realloc(w->segs, cap * sizeof *s);
      if (s == NULL) return w->oom = 1;
      w->segs = s;
      w->cap = cap;
    }
    si = &w->segs[w->n++];
    memset(si, 0, sizeof *si);
    w->rcap = 0;
    struct gmb_segment_view v;
    gmb__pool_segment_view(info->segment, &v);
    const struct gmb_tenant *t = v.arena_tag;
    si->id = v.dseg->id;
    si->size = v.dseg->size;
    si->used = v.used;
    si->small = v.small;
    snprintf(si->tenant, sizeof si->tenant, "%s", t ? t->name : "");
  }
  if (si->n_ranges == w->rcap) {
    size_t cap = w->rcap ? w->rcap * 2 : 8;
    if (cap > w->limit) cap = w->limit;
    struct wire_range_info *r = realloc(si->ranges, cap * sizeof *r);
    if (r == NULL) return w->oom = 1;
    si->ranges = r;
    w->rcap = cap;
  }
  struct wire_range_info *ri = &si->ranges[si->n_ranges++];
  w->ranges++;
  memset(ri, 0, sizeof *ri);
  ri->offset = info->offset;
  ri->size = info->size;
  if (is_free) return 0;
  if (info->id == 0) {
    /* A move target in flight: neither free nor an allocation yet.  It
     * is shown as an id-0 range that is locked (docs/snapshot.md). */
    ri->locked = 1;
    return 0;
  }
  ri->id = info->id;
  ri->movable = (info->flags & GMB_MOVABLE) != 0;
  ri->tail = (info->flags & GMB_RANGE_TAIL) != 0;
  const struct gmb_session *s = info->owner;
  if (s) ri->session = s->id;
  if (ri->movable) ri->locked = gmb__session_alloc_locked(info);
  return 0;
}

static void observe_segments_free(struct wire_segment_info *segs, size_t n) {
  for (size_t i = 0; i < n; i++) free(segs[i].ranges);
  free(segs);
}

/* 0 when (segment, offset) is a cursor a page could have named; else the
 * refusal is in *rep.  A segment released since is fine: the walk goes on
 * at the next one. */
static int observe_cursor(struct gmb_broker *b, uint64_t segment,
                          uint64_t offset, struct wire_reply *rep) {
  uint64_t last = 0;
  gmb__pool_changes(b->pool, &last);
  const char *why = NULL;
  if (segment == 0 && offset != 0)
    why = "an offset needs a segment";
  else if (offset % GMB_POOL_ALIGN)
    why = "its offset is not a multiple of 512";
  else if (segment > last)
    why = "it names a segment that was never made";
  if (why == NULL && segment) {
    const struct gmb_dseg *d = gmb__pool_segment(b->pool, segment, NULL);
    if (d && offset >= d->size) why = "its offset is past its segment's end";
  }
  if (why == NULL) return 0;
  rep->status = GMB_E_INVAL;
  snprintf(rep->message, sizeof rep->message,
           "bad snapshot cursor (segment %" PRIu64 ", offset %" PRIu64
           "): %s; start at (0, 0) and follow each page's next cursor",
           segment, offset, why);
  return GMB_E_INVAL;
}

void gmb__observe_snapshot(struct gmb_broker *b, uint64_t segment,
                           uint64_t offset, uint32_t limit,
                           struct wire_reply *rep) {
  if (observe_cursor(b, segment, offset, rep)) return;
  if (limit == 0) limit = GMB_SNAPSHOT_PAGE_DEFAULT;
  if (limit > GMB_SNAPSHOT_PAGE_MAX) limit = GMB_SNAPSHOT_PAGE_MAX;
  /* The first page's status is exactly what AdminStatus answers. */
  struct wire_reply st;
  memset(&st, 0, sizeof st);
  if (segment == 0) {
    gmb__observe_status(b, &st);
    if (st.status != 0 || st.kind != WIRE_ADMIN_STATUS) {
      rep->status = st.status ? st.status : GMB_E_SYSTEM;
      snprintf(rep->message, sizeof rep->message, "%s", st.message);
      gmb__wire_reply_clear(&st);
      return;
    }
  }
  struct observe_page w = {.limit = limit};
  uint64_t next_seg = 0, next_off = 0;
  gmb__pool_walk_from(b->pool, segment, offset, observe_range, &w, &next_seg,
                      &next_off);
  if (w.oom) {
    observe_segments_free(w.segs, w.n);
    gmb__wire_reply_clear(&st);
    rep->status = GMB_E_SYSTEM;
    snprintf(rep->message, sizeof rep->message, "out of host memory");
    return;
  }
  rep->kind = WIRE_ADMIN_SNAPSHOT;
  if (segment == 0) {
    rep->u.snapshot.has_status = 1;
    rep->u.snapshot.status = st.u.admin_status; /* takes its tenants */
  }
  rep->u.snapshot.segments = w.segs;
  rep->u.snapshot.n_segments = w.n;
  rep->u.snapshot.next_segment = next_seg;
  rep->u.snapshot.next_offset = next_off;
  rep->u.snapshot.changes = gmb__pool_changes(b->pool, NULL);
  rep->u.snapshot.limit = limit;
}

/* --- metrics ------------------------------------------------------------- */

/* Writes a label value escaped as the exposition format wants: backslash,
 * double quote and newline. */
static void observe_label(FILE *f, const char *v) {
  for (; *v; v++) {
    if (*v == '\\')
      fputs("\\\\", f);
    else if (*v == '"')
      fputs("\\\"", f);
    else if (*v == '\n')
      fputs("\\n", f);
    else
      fputc(*v, f);
  }
}

static void observe_head(FILE *f, const char *name, const char *type,
                         const char *help) {
  fprintf(f, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

/* A histogram's lines, its buckets cumulative as Prometheus reads them. */
static void observe_hist(FILE *f, const char *name, const char *help,
                         const struct observe_hist *h) {
  observe_head(f, name, "histogram", help);
  uint64_t cum = 0;
  for (size_t i = 0; i < OBSERVE_NLE; i++) {
    cum += h->bucket[i];
    fprintf(f, "%s_bucket{le=\"%g\"} %" PRIu64 "\n", name, observe_le[i],
            cum);
  }
  cum += h->bucket[OBSERVE_NLE];
  fprintf(f, "%s_bucket{le=\"+Inf\"} %" PRIu64 "\n", name, cum);
  fprintf(f, "%s_sum %.9g\n", name, h->seconds);
  fprintf(f, "%s_count %" PRIu64 "\n", name, h->count);
}

static void observe_u64(FILE *f, const char *name, const char *type,
                        const char *help, uint64_t v) {
  observe_head(f, name, type, help);
  fprintf(f, "%s %" PRIu64 "\n", name, v);
}

static void observe_dbl(FILE *f, const char *name, const char *type,
                        const char *help, double v) {
  observe_head(f, name, type, help);
  fprintf(f, "%s %.9g\n", name, v);
}

/* One tenant's figures, gathered once so each metric family can list
 * every tenant (the format wants a family's samples together). */
struct observe_tenant {
  const char *name;
  uint64_t used, vmm, quota, reserve, peak, segment_bytes, held_segments,
      allocations,
      refusals_quota, cached, trim_asks, trim_ignored, fd_unread, fd_kept,
      fd_refused;
  uint64_t host_bytes, paused_bytes, host_quota, pauses, resumes, sleep_asks;
  uint64_t holes_free; /* of its caches' holes, those not charged */
  double paused_seconds;
  unsigned sessions;
  double frag;
};

struct observe_tenants {
  struct observe_tenant *t;
  size_t n, cap;
};

/* A per-tenant counter family: the uint64_t at `field` of each row. */
static void observe_tenant_counter(FILE *f, const struct observe_tenants *r,
                                   const char *name, const char *help,
                                   size_t field) {
  observe_head(f, name, "counter", help);
  for (size_t i = 0; i < r->n; i++) {
    uint64_t v;
    memcpy(&v, (const char *)&r->t[i] + field, sizeof v);
    fprintf(f, "%s{tenant=\"", name);
    observe_label(f, r->t[i].name);
    fprintf(f, "\"} %" PRIu64 "\n", v);
  }
}

static int observe_tenant_row(void *ctx, struct gmb_tenant *t) {
  struct observe_tenants *r = ctx;
  if (r->n == r->cap) return 1;
  struct gmb_arena_stats as;
  gmb__pool_arena_stats(t->arena, &as);
  r->t[r->n++] = (struct observe_tenant){
      .name = t->name,
      .used = t->used + t->vmm, /* as its StatsReply and row say */
      .vmm = t->vmm,
      .quota = t->quota,
      .reserve = t->reserve,
      .peak = t->peak,
      .segment_bytes = as.segment_bytes,
      .held_segments = as.held_segments,
      .allocations = as.allocations,
      .refusals_quota = t->refusals_quota,
      .cached = gmb__tenant_cached(t),
      .sessions = t->n_sessions,
      .frag = gmb__fragmentation(as.largest_free, as.free_total),
      .host_bytes = t->host_bytes,
      .paused_bytes = t->paused_bytes,
      .host_quota = t->host_quota,
      .pauses = t->pauses,
      .resumes = t->resumes,
      .sleep_asks = t->sleep_asks,
      .holes_free = gmb__tenant_holes_uncharged(t),
      .fd_unread = t->fd_unread,
      .fd_kept = t->fd_kept,
      .fd_refused = t->fd_refused,
      .paused_seconds = gmb__sleep_tenant_seconds(t, gmb__now_ns())};
  struct observe_tenant *o = &r->t[r->n - 1];
  gmb__tenant_trim_totals(t, &o->trim_asks, &o->trim_ignored);
  return 0;
}

enum { OT_USED, OT_VMM, OT_CACHED, OT_QUOTA, OT_RESERVE, OT_PEAK, OT_SEGMENTS,
       OT_HELD, OT_ALLOCS, OT_SESSIONS, OT_FRAG, OT_HOST, OT_PAUSED,
       OT_HOST_QUOTA, OT_HOLES, OT_FD_UNREAD, OT_FD_KEPT };

static const struct {
  const char *name, *help;
} observe_tenant_family[] = {
    [OT_USED] = {"gmb_tenant_used_bytes",
                 "Bytes of the tenant's live allocations (rounded), and of "
                 "the device memory its processes made through the VMM "
                 "API (gmb_tenant_vmm_bytes)."},
    [OT_VMM] = {"gmb_tenant_vmm_bytes",
                "Of the tenant's used bytes, the device memory its processes "
                "made themselves through the CUDA VMM API (cuMemCreate "
                "under the preload shim) and reported."},
    [OT_CACHED] = {"gmb_tenant_cached_bytes",
                   "Of the tenant's used bytes, those free in its sessions' "
                   "caches (as each last reported), which it could give "
                   "back."},
    [OT_QUOTA] = {"gmb_tenant_quota_bytes",
                  "Bytes the tenant may hold; 0 means no limit."},
    [OT_RESERVE] = {"gmb_tenant_reserve_bytes",
                    "Bytes kept for the tenant that others may not take."},
    [OT_PEAK] = {"gmb_tenant_peak_bytes",
                 "Highest used bytes of the tenant since the broker started."},
    [OT_SEGMENTS] = {"gmb_tenant_segment_bytes",
                     "Bytes of device segments held for the tenant."},
    [OT_HELD] = {"gmb_tenant_held_segments",
                 "The tenant's movable segments that count as pinned: two "
                 "compaction runs in a row found one of its allocations "
                 "locked."},
    [OT_ALLOCS] = {"gmb_tenant_allocations",
                   "Live allocations of the tenant."},
    [OT_SESSIONS] = {"gmb_tenant_sessions",
                     "Connected sessions of the tenant."},
    [OT_FRAG] = {"gmb_tenant_fragmentation_ratio",
                 "1 - largest free range / free bytes in the tenant's "
                 "segments; 0 when nothing is free."},
    [OT_HOST] = {"gmb_tenant_host_bytes",
                 "Bytes of host memory holding the tenant's paused tags, as "
                 "its sessions reported them."},
    [OT_PAUSED] = {"gmb_tenant_paused_bytes",
                   "Device bytes the tenant's paused tags gave back."},
    [OT_HOST_QUOTA] = {"gmb_tenant_host_quota_bytes",
                       "Host bytes the tenant's paused tags may hold; 0 "
                       "means no limit."},
    [OT_HOLES] = {"gmb_tenant_cache_holes_bytes",
                  "Of the tenant's used bytes, the free bytes between "
                  "blocks in its caches' pages that its quota does not "
                  "charge (at most cache_holes of the quota)."},
    [OT_FD_UNREAD] = {"gmb_tenant_fd_unread",
                      "Descriptors the broker sent on the tenant's descriptor "
                      "channels (its sessions' and those kept for its ended "
                      "sessions) that it has not seen read yet (at most "
                      "gmb_fd_unread_limit{scope=\"tenant\"})."},
    [OT_FD_KEPT] = {"gmb_tenant_fd_kept_channels",
                    "Channels of the tenant's ended sessions the broker keeps "
                    "open while they hold descriptors unread."},
};

static void observe_tenant_metrics(FILE *f, const struct observe_tenants *r) {
  for (int k = OT_USED; k <= OT_FD_KEPT; k++) {
    observe_head(f, observe_tenant_family[k].name, "gauge",
                 observe_tenant_family[k].help);
    for (size_t i = 0; i < r->n; i++) {
      const struct observe_tenant *t = &r->t[i];
      fprintf(f, "%s{tenant=\"", observe_tenant_family[k].name);
      observe_label(f, t->name);
      fputs("\"} ", f);
      switch (k) {
        case OT_USED: fprintf(f, "%" PRIu64 "\n", t->used); break;
        case OT_VMM: fprintf(f, "%" PRIu64 "\n", t->vmm); break;
        case OT_CACHED: fprintf(f, "%" PRIu64 "\n", t->cached); break;
        case OT_QUOTA: fprintf(f, "%" PRIu64 "\n", t->quota); break;
        case OT_RESERVE: fprintf(f, "%" PRIu64 "\n", t->reserve); break;
        case OT_PEAK: fprintf(f, "%" PRIu64 "\n", t->peak); break;
        case OT_SEGMENTS: fprintf(f, "%" PRIu64 "\n", t->segment_bytes); break;
        case OT_HELD: fprintf(f, "%" PRIu64 "\n", t->held_segments); break;
        case OT_ALLOCS: fprintf(f, "%" PRIu64 "\n", t->allocations); break;
        case OT_SESSIONS: fprintf(f, "%u\n", t->sessions); break;
        case OT_HOST: fprintf(f, "%" PRIu64 "\n", t->host_bytes); break;
        case OT_PAUSED: fprintf(f, "%" PRIu64 "\n", t->paused_bytes); break;
        case OT_HOST_QUOTA: fprintf(f, "%" PRIu64 "\n", t->host_quota); break;
        case OT_HOLES: fprintf(f, "%" PRIu64 "\n", t->holes_free); break;
        case OT_FD_UNREAD: fprintf(f, "%" PRIu64 "\n", t->fd_unread); break;
        case OT_FD_KEPT: fprintf(f, "%" PRIu64 "\n", t->fd_kept); break;
        default: fprintf(f, "%.9g\n", t->frag); break;
      }
    }
  }
  observe_tenant_counter(f, r, "gmb_tenant_fd_refused_total",
                         "Descriptor requests of the tenant's sessions "
                         "refused at a bound of unread descriptors (the "
                         "channel's, its uid's or its own).",
                         offsetof(struct observe_tenant, fd_refused));
  observe_tenant_counter(f, r, "gmb_tenant_quota_refusals_total",
                         "Allocation requests of the tenant refused by its "
                         "quota.",
                         offsetof(struct observe_tenant, refusals_quota));
  /* Per tenant, not per session: sessions come and go, and a label per
   * session would make a series per process.  Ended sessions' asks stay
   * in their tenant's totals. */
  observe_tenant_counter(f, r, "gmb_trim_asks_total",
                         "Asks to give cached memory back (EVENT_TRIM) sent "
                         "to the tenant's sessions.",
                         offsetof(struct observe_tenant, trim_asks));
  observe_tenant_counter(f, r, "gmb_trim_ignored_total",
                         "Asks to give cached memory back that the tenant's "
                         "sessions left unanswered past the broker's bound.",
                         offsetof(struct observe_tenant, trim_ignored));
  observe_tenant_counter(f, r, "gmb_pauses_total",
                         "Tags of the tenant's sessions paused (by the "
                         "application, the broker's ask or an operator).",
                         offsetof(struct observe_tenant, pauses));
  observe_tenant_counter(f, r, "gmb_resumes_total",
                         "Paused tags of the tenant's sessions resumed.",
                         offsetof(struct observe_tenant, resumes));
  observe_tenant_counter(f, r, "gmb_sleep_asks_total",
                         "Asks to pause (EVENT_SLEEP) the broker sent to the "
                         "tenant's sessions for other tenants' requests.",
                         offsetof(struct observe_tenant, sleep_asks));
  observe_head(f, "gmb_paused_seconds_total", "counter",
               "Seconds the tenant's tags spent paused (summed over tags).");
  for (size_t i = 0; i < r->n; i++) {
    fputs("gmb_paused_seconds_total{tenant=\"", f);
    observe_label(f, r->t[i].name);
    fprintf(f, "\"} %.9g\n", r->t[i].paused_seconds);
  }
}

/* Client requests the loop answers (a heartbeat has no answer). */
static const enum wire_kind observe_client_kinds[] = {
    WIRE_HELLO, WIRE_ALLOC, WIRE_FREE, WIRE_STATS, WIRE_BYE};

static void observe_request_metrics(FILE *f, const struct gmb_observe *o) {
  observe_head(f, "gmb_requests_total", "counter",
               "Client requests answered, by kind.");
  for (size_t i = 0; i < sizeof observe_client_kinds /
                             sizeof observe_client_kinds[0]; i++) {
    enum wire_kind k = observe_client_kinds[i];
    fprintf(f, "gmb_requests_total{kind=\"%s\"} %" PRIu64 "\n",
            gmb__wire_kind_name(k), o->requests[k]);
  }
  observe_head(f, "gmb_refusals_total", "counter",
               "Client requests answered with an error, by its code "
               "(GMB_E_QUOTA is reason=\"quota\").");
  static const struct {
    int code;
    const char *reason;
  } codes[] = {
#define OBSERVE_CODE_(name, code, text) {code, #name},
      GMB_ERRORS(OBSERVE_CODE_)
#undef OBSERVE_CODE_
  };
  for (size_t i = 0; i < sizeof codes / sizeof codes[0]; i++) {
    if (codes[i].code >= OBSERVE_CODES) continue;
    fputs("gmb_refusals_total{reason=\"", f);
    for (const char *c = codes[i].reason; *c; c++)
      fputc(*c >= 'A' && *c <= 'Z' ? *c - 'A' + 'a' : *c, f);
    fprintf(f, "\"} %" PRIu64 "\n", o->refusals[codes[i].code]);
  }
  observe_hist(f, "gmb_alloc_duration_seconds",
               "Time from receiving an allocation request to answering it, "
               "waits included.", &o->alloc);
  observe_hist(f, "gmb_loop_turn_seconds",
               "Work of one turn of the broker's loop (its messages, timers "
               "and slices; not its wait for events): nothing else is served "
               "meanwhile.", &o->turn);
  observe_head(f, "gmb_loop_turn_max_seconds", "gauge",
               "The longest turn of the loop since start, its work.");
  fprintf(f, "gmb_loop_turn_max_seconds %.9g\n", o->turn_max);
}

char *gmb__observe_metrics(struct gmb_broker *b, int tenants) {
  static const struct gmb_observe none;
  const struct gmb_observe *o = b->observe ? b->observe : &none;
  struct observe_tenants r = {0};
  r.cap = gmb__tenants_count(b->tenants);
  if (r.cap && (r.t = calloc(r.cap, sizeof *r.t)) == NULL) return NULL;
  gmb__tenants_each(b->tenants, observe_tenant_row, &r);

  char *text = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&text, &len);
  if (f == NULL) {
    free(r.t);
    return NULL;
  }
  struct gmb_pool_stats ps;
  gmb__pool_stats(b->pool, &ps);
  uint64_t largest = 0;
  double frag = gmb__pool_fragmentation(b->pool, &largest, NULL);
  const struct wire_compact_stats *c = &b->compact_totals;

  observe_head(f, "gmb_build_info", "gauge",
               "Always 1; the broker's version and device in labels.");
  fprintf(f, "gmb_build_info{version=\"");
  observe_label(f, gmb_version());
  fputs("\",device=\"", f);
  observe_label(f, b->dev->desc);
  fputs("\"} 1\n", f);
  observe_u64(f, "gmb_device_capacity_bytes", "gauge",
              "Bytes the broker may take from the device.", ps.capacity);
  observe_u64(f, "gmb_device_segment_bytes", "gauge",
              "Bytes of device segments held, all tenants.", ps.segment_bytes);
  observe_u64(f, "gmb_device_segments", "gauge",
              "Device segments held, all tenants.", ps.segments);
  observe_u64(f, "gmb_device_retiring_bytes", "gauge",
              "Bytes of retired segments that clients have not closed yet.",
              b->dev->retiring_bytes);
  observe_u64(f, "gmb_device_used_bytes", "gauge",
              "Bytes of live allocations, all tenants.", ps.used);
  observe_u64(f, "gmb_device_allocations", "gauge",
              "Live allocations, all tenants.", ps.allocations);
  observe_u64(f, "gmb_device_largest_free_bytes", "gauge",
              "The largest request that could succeed now for some tenant.",
              largest);
  observe_dbl(f, "gmb_device_fragmentation_ratio", "gauge",
              "1 - largest free / (capacity - used bytes).", frag);
  observe_u64(f, "gmb_sessions", "gauge", "Connected client sessions.",
              (uint64_t)gmb__sessions_count(b->sessions));
  observe_u64(f, "gmb_tenants", "gauge", "Tenants the broker knows.",
              (uint64_t)r.n);
  if (tenants) observe_tenant_metrics(f, &r);
  observe_u64(f, "gmb_fd_unread", "gauge",
              "Descriptors the broker sent on descriptor channels (live "
              "sessions' and those kept for ended sessions) that it has not "
              "seen read yet; the kernel refuses the broker more past its "
              "RLIMIT_NOFILE.", b->fd_unread);
  observe_u64(f, "gmb_fd_kept_channels", "gauge",
              "Channels of ended sessions kept open while they hold "
              "descriptors unread (each holds a session's place).",
              b->fd_kept);
  observe_u64(f, "gmb_fd_refused_total", "counter",
              "Descriptor requests refused at a bound of unread "
              "descriptors.", b->fd_refused);
  observe_head(f, "gmb_fd_unread_limit", "gauge",
               "The bounds of unread descriptors: one channel's, all the "
               "channels of one uid's, of one tenant's (0: no channel).");
  fprintf(f, "gmb_fd_unread_limit{scope=\"channel\"} %u\n",
          b->fd_bound_channel);
  fprintf(f, "gmb_fd_unread_limit{scope=\"uid\"} %u\n", b->fd_bound_uid);
  fprintf(f, "gmb_fd_unread_limit{scope=\"tenant\"} %u\n",
          b->fd_bound_tenant);
  observe_u64(f, "gmb_wait_queue_length", "gauge",
              "Allocation requests waiting for memory.",
              (uint64_t)b->waitq.n);
  observe_request_metrics(f, o);
  observe_u64(f, "gmb_compaction_runs_total", "counter",
              "Compaction runs finished.", c->runs);
  observe_u64(f, "gmb_compaction_moves_total", "counter",
              "Allocations moved by compaction.", c->moves);
  observe_u64(f, "gmb_compaction_moved_bytes_total", "counter",
              "Bytes moved by compaction.", c->bytes_moved);
  observe_u64(f, "gmb_compaction_released_bytes_total", "counter",
              "Bytes of segments that compaction gave back to the device.",
              c->bytes_released);
  observe_u64(f, "gmb_compaction_skipped_locked_total", "counter",
              "Allocations compaction left in place because they were "
              "locked.", c->skipped_locked);
  observe_dbl(f, "gmb_compaction_seconds_total", "counter",
              "Seconds spent in compaction runs.", c->seconds);
  const struct gmb_offload *ol = &b->offload;
  observe_u64(f, "gmb_offload_host_bytes", "gauge",
              "Host bytes of the copies of the movable allocations the "
              "broker offloaded, all tenants (at most offload_host_max).",
              ol->host_bytes);
  observe_u64(f, "gmb_offload_host_chunk_bytes", "gauge",
              "Host memory the broker holds for those copies: the chunks "
              "they are cut from (at most offload_host_max).",
              ol->chunk_bytes);
  observe_u64(f, "gmb_offload_allocations", "gauge",
              "Movable allocations offloaded by the broker now.", ol->held);
  observe_u64(f, "gmb_offloads_total", "counter",
              "Movable allocations the broker offloaded to its host memory.",
              ol->offloads);
  observe_u64(f, "gmb_offload_restores_total", "counter",
              "Offloaded allocations brought back to the device.",
              ol->restores);
  observe_u64(f, "gmb_offload_bytes_total", "counter",
              "Bytes copied to the broker's host memory by offloads.",
              ol->bytes_out);
  observe_u64(f, "gmb_offload_restored_bytes_total", "counter",
              "Bytes copied back to the device by restores.", ol->bytes_in);
  observe_u64(f, "gmb_offload_refused_total", "counter",
              "Offloads refused by host_quota or offload_host_max.",
              ol->refused);
  observe_u64(f, "gmb_offload_slices_total", "counter",
              "Slices of the broker's offloads (at most 64 MiB copied "
              "each, one a loop turn).", ol->slices);
  observe_u64(f, "gmb_offload_jobs_total", "counter",
              "Offload jobs begun: requests whose room took more than "
              "one slice.", ol->jobs);
  observe_u64(f, "gmb_offload_job_requests", "gauge",
              "Requests held now while the offload job makes their room.",
              (uint64_t)b->waitq.held_job);
  observe_u64(f, "gmb_offload_job_fenced_total", "counter",
              "New segments refused because the room left was the offload "
              "job's, kept for the requests it holds.", b->waitq.fenced);
  observe_dbl(f, "gmb_uptime_seconds", "gauge",
              "Seconds since the broker started.",
              b->start_ns ? (double)(gmb__now_ns() - b->start_ns) / 1e9 : 0);
  int bad = ferror(f);
  fclose(f);
  free(r.t);
  if (bad) {
    free(text);
    return NULL;
  }
  return text;
}
