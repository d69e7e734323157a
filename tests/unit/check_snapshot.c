/*
 * check_snapshot.c - what the broker shows of itself, as the admin socket
 * asks for it: here the snapshot, a page at a time (docs/snapshot.md).
 *
 * A whole broker runs in the process (broker_fixture.h) on a host device;
 * pages are asked for through the admin handler (gmb__admin), as gmbctl's
 * requests arrive, and compared with the pool's own walk (gmb__pool_walk)
 * taken at the same moment: every range exactly once, in (segment id,
 * offset) order, no page over its limit, the status on the first page
 * only.  Then the pool changes between pages (an allocation freed ahead of
 * the cursor, one behind it, the cursor's own segment released), and
 * cursors and limits no page could have named are sent.
 */
#include <check.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "admin.h"
#include "broker_fixture.h"
#include "check_main.h"
#include "observe.h"
#include "pool.h"
#include "util.h"

#define MIB GMB_MIB
#define KIB GMB_KIB

/* ---- helpers ---------------------------------------------------------- */

/* One range as the pool's walk or a page shows it. */
struct rng {
  uint64_t seg, offset, size, id;
  int tail;
};

struct rngs {
  struct rng *r;
  size_t n, cap;
};

static void rngs_add(struct rngs *v, uint64_t seg, uint64_t offset,
                     uint64_t size, uint64_t id, int tail) {
  if (v->n == v->cap) {
    v->cap = v->cap ? v->cap * 2 : 256;
    v->r = realloc(v->r, v->cap * sizeof *v->r);
    ck_assert_ptr_nonnull(v->r);
  }
  v->r[v->n++] = (struct rng){seg, offset, size, id, tail};
}

static int walk_fn(void *ctx, const struct gmb_alloc_info *info,
                   int is_free) {
  (void)is_free;
  rngs_add(ctx, info->dseg->id, info->offset, info->size, info->id,
           (info->flags & GMB_RANGE_TAIL) != 0);
  return 0;
}

/* Every range of the pool now, by its own walk. */
static struct rngs pool_ranges(struct fx *f) {
  struct rngs v = {0};
  ck_assert_int_eq(gmb__pool_walk(f->b.pool, walk_fn, &v), 0);
  return v;
}

/* Asks for one page as an admin (this process's uid); the reply is the
 * caller's to clear. */
static void page(struct fx *f, uint64_t seg, uint64_t off, uint32_t limit,
                 struct wire_reply *rep) {
  struct wire_request req;
  memset(&req, 0, sizeof req);
  req.id = f->next_req++;
  req.kind = WIRE_ADMIN_SNAPSHOT;
  req.u.admin_snapshot.segment = seg;
  req.u.admin_snapshot.offset = off;
  req.u.admin_snapshot.limit = limit;
  struct gmb_peer peer = fx_peer("ctl", geteuid());
  ck_assert_int_eq(gmb__admin(&f->b, &peer, &req, rep), 1);
  ck_assert_uint_eq(rep->id, req.id);
  ck_assert_int_eq(gmb__core_check(&f->b), 0);
}

/* A page that must be served; checks what every page promises. */
static void page_ok(struct fx *f, uint64_t seg, uint64_t off, uint32_t limit,
                    struct wire_reply *rep) {
  page(f, seg, off, limit, rep);
  ck_assert_msg(rep->status == 0, "page at (%llu, %llu): %s",
                (unsigned long long)seg, (unsigned long long)off,
                rep->message);
  ck_assert_int_eq(rep->kind, WIRE_ADMIN_SNAPSHOT);
  ck_assert_int_eq(rep->u.snapshot.has_status, seg == 0);
  uint32_t want = limit == 0                        ? GMB_SNAPSHOT_PAGE_DEFAULT
                  : limit > GMB_SNAPSHOT_PAGE_MAX ? GMB_SNAPSHOT_PAGE_MAX
                                                    : limit;
  ck_assert_uint_eq(rep->u.snapshot.limit, want);
  size_t n = 0;
  for (size_t i = 0; i < rep->u.snapshot.n_segments; i++) {
    const struct wire_segment_info *s = &rep->u.snapshot.segments[i];
    ck_assert_uint_gt(s->n_ranges, 0); /* no empty segment entries */
    if (i) ck_assert_uint_gt(s->id, rep->u.snapshot.segments[i - 1].id);
    n += s->n_ranges;
  }
  ck_assert_uint_le(n, want);
  /* A page stops early only at the end. */
  if (rep->u.snapshot.next_segment) ck_assert_uint_eq(n, want);
  ck_assert_uint_eq(rep->u.snapshot.changes,
                    gmb__pool_changes(f->b.pool, NULL));
}

/* Appends a page's ranges to v; checks each segment's entry against the
 * pool (size, tenant, used, class) while it still exists. */
static void page_ranges(struct fx *f, const struct wire_reply *rep,
                        struct rngs *v) {
  for (size_t i = 0; i < rep->u.snapshot.n_segments; i++) {
    const struct wire_segment_info *s = &rep->u.snapshot.segments[i];
    void *tag = NULL;
    const struct gmb_dseg *d = gmb__pool_segment(f->b.pool, s->id, &tag);
    ck_assert_ptr_nonnull(d);
    ck_assert_uint_eq(s->size, d->size);
    ck_assert_str_eq(s->tenant, ((struct gmb_tenant *)tag)->name);
    uint64_t used = 0;
    struct rngs all = pool_ranges(f);
    int large = 0;
    for (size_t k = 0; k < all.n; k++)
      if (all.r[k].seg == s->id && all.r[k].id) {
        used += all.r[k].size;
        /* a large one's pages: whole 2 MiB pages (its tail is apart) */
        large |= !all.r[k].tail && all.r[k].size >= GMB_SEGMENT_ALIGN;
      }
    free(all.r);
    ck_assert_uint_eq(s->used, used);
    /* A large request has a segment of its own; the rest share small
     * ones (an empty segment is a small one, lingering). */
    ck_assert_int_eq(s->small, !large);
    for (size_t k = 0; k < s->n_ranges; k++)
      rngs_add(v, s->id, s->ranges[k].offset, s->ranges[k].size,
               s->ranges[k].id, s->ranges[k].tail);
  }
}

/* Two sessions of two tenants: small allocations of 512 B to 8 KiB, both
 * kinds, with every fifth freed, and a few large ones between them, so
 * that segments of all sizes and many ranges exist.  Returns the number
 * of live allocations. */
static int scene(struct fx *f, int n) {
  fx_hello(f, "a", 1001, "llm-a");
  fx_hello(f, "b", 1002, "train-b");
  uint64_t seed = 12345;
  int live = 0;
  for (int i = 0; i < n; i++) {
    seed = seed * 6364136223846793005u + 1442695040888963407u;
    const char *rid = i % 3 ? "a" : "b";
    uid_t uid = i % 3 ? 1001 : 1002;
    uint64_t size = 512 + (seed >> 33) % (8 * KIB);
    if (i % 97 == 50) size = 3 * MIB;
    struct wire_reply r =
        fx_must_alloc(f, rid, uid, size, i % 2 ? GMB_MOVABLE : 0);
    live++;
    if (i % 5 == 4) {
      ck_assert_int_eq(fx_free(f, rid, uid, r.u.alloc.id), 0);
      live--;
    }
  }
  return live;
}

/* Pages through the whole snapshot at `limit`; returns the ranges in the
 * order the pages gave them and the number of pages. */
static struct rngs page_all(struct fx *f, uint32_t limit, int *pages) {
  struct rngs v = {0};
  uint64_t seg = 0, off = 0, changes = 0;
  *pages = 0;
  do {
    struct wire_reply rep;
    page_ok(f, seg, off, limit, &rep);
    if (*pages == 0) {
      changes = rep.u.snapshot.changes;
      struct gmb_pool_stats ps;
      gmb__pool_stats(f->b.pool, &ps);
      ck_assert_uint_eq(rep.u.snapshot.status.in_use, ps.used);
      ck_assert_uint_eq(rep.u.snapshot.status.in_segments, ps.segment_bytes);
    }
    ck_assert_uint_eq(rep.u.snapshot.changes, changes); /* nothing moved */
    page_ranges(f, &rep, &v);
    seg = rep.u.snapshot.next_segment;
    off = rep.u.snapshot.next_offset;
    gmb__wire_reply_clear(&rep);
    ck_assert_int_lt(++*pages, 100000);
  } while (seg);
  return v;
}

static void rngs_eq(const struct rngs *a, const struct rngs *b) {
  ck_assert_uint_eq(a->n, b->n);
  for (size_t i = 0; i < a->n; i++) {
    ck_assert_uint_eq(a->r[i].seg, b->r[i].seg);
    ck_assert_uint_eq(a->r[i].offset, b->r[i].offset);
    ck_assert_uint_eq(a->r[i].size, b->r[i].size);
    ck_assert_uint_eq(a->r[i].id, b->r[i].id);
    ck_assert_int_eq(a->r[i].tail, b->r[i].tail);
  }
}

/* ---- tests -------------------------------------------------------------- */

/* At every limit, from one range a page to all in one, the pages give the
 * pool's ranges exactly once and in order; segments split between pages
 * continue where they stopped. */
START_TEST(snapshot_pages_every_range_once_in_order) {
  struct fx f;
  fx_open_ini(&f, "host:64MiB", FX_INI_OFF);
  int live = scene(&f, 700);
  struct rngs want = pool_ranges(&f);
  ck_assert_uint_gt(want.n, (size_t)live); /* free ranges between them */
  static const uint32_t limits[] = {1, 2, 7, 100, 333, 0, UINT32_MAX};
  for (size_t k = 0; k < sizeof limits / sizeof limits[0]; k++) {
    int pages = 0;
    struct rngs got = page_all(&f, limits[k], &pages);
    rngs_eq(&got, &want);
    uint32_t eff = limits[k] == 0 ? GMB_SNAPSHOT_PAGE_DEFAULT : limits[k];
    ck_assert_uint_eq((uint64_t)pages,
                      eff >= want.n ? 1 : (want.n + eff - 1) / eff);
    size_t allocs = 0;
    for (size_t i = 0; i < got.n; i++)
      allocs += got.r[i].id != 0 && !got.r[i].tail;
    ck_assert_uint_eq(allocs, (size_t)live);
    free(got.r);
  }
  free(want.r);
  fx_close(&f);
}
END_TEST

/* A page holds no more than the broker's default when no limit is named
 * (an old gmbctl), and no more than its maximum whatever is asked; the
 * default bites on a pool with more ranges than that. */
START_TEST(snapshot_page_bounded) {
  struct fx f;
  fx_open_ini(&f, "host:64MiB", FX_INI_OFF);
  fx_hello(&f, "a", 1001, "many");
  /* 1536 bytes: 1365 to a segment and 512 bytes free at its end, so that
   * a segment has 1366 ranges and the default page ends inside one. */
  int n = (int)GMB_SNAPSHOT_PAGE_DEFAULT + 800;
  for (int i = 0; i < n; i++) fx_must_alloc(&f, "a", 1001, 1536, 0);
  struct rngs want = pool_ranges(&f);
  ck_assert_uint_gt(want.n, GMB_SNAPSHOT_PAGE_DEFAULT);
  struct wire_reply rep;
  page_ok(&f, 0, 0, 0, &rep);
  size_t got = 0;
  for (size_t i = 0; i < rep.u.snapshot.n_segments; i++)
    got += rep.u.snapshot.segments[i].n_ranges;
  ck_assert_uint_eq(got, GMB_SNAPSHOT_PAGE_DEFAULT);
  ck_assert_uint_ne(rep.u.snapshot.next_segment, 0);
  /* The next page goes on inside the segment where this one stopped. */
  ck_assert_uint_eq(rep.u.snapshot.next_segment, want.r[got].seg);
  ck_assert_uint_eq(rep.u.snapshot.next_offset, want.r[got].offset);
  ck_assert_uint_gt(rep.u.snapshot.next_offset, 0);
  gmb__wire_reply_clear(&rep);
  page_ok(&f, 0, 0, UINT32_MAX, &rep); /* clamped, and all of it fits */
  ck_assert_uint_eq(rep.u.snapshot.limit, GMB_SNAPSHOT_PAGE_MAX);
  ck_assert_uint_eq(rep.u.snapshot.next_segment, 0);
  gmb__wire_reply_clear(&rep);
  free(want.r);
  fx_close(&f);
}
END_TEST

static int has_id(const struct rngs *v, uint64_t id) {
  for (size_t i = 0; i < v->n; i++)
    if (v->r[i].id == id) return 1;
  return 0;
}

/* The pool changes between pages: the change counter says so, nothing is
 * given twice, an allocation freed ahead of the cursor is not given, and
 * a cursor whose segment was released goes on at the next segment. */
START_TEST(snapshot_free_between_pages) {
  struct fx f;
  fx_open_ini(&f, "host:64MiB", FX_INI_OFF);
  fx_hello(&f, "a", 1001, "llm-a");
  /* Three small segments full of 64 KiB allocations (32 each), then a
   * large one, so that pages end inside segments. */
  uint64_t ids[96], seg_of[96];
  for (int i = 0; i < 96; i++) {
    ids[i] = fx_must_alloc(&f, "a", 1001, 64 * KIB, 0).u.alloc.id;
    struct gmb_alloc_info info;
    ck_assert_int_eq(gmb__pool_find(f.b.pool, ids[i], &info), 0);
    seg_of[i] = info.dseg->id;
  }
  ck_assert_uint_ne(seg_of[0], seg_of[95]);
  uint64_t big = fx_must_alloc(&f, "a", 1001, 4 * MIB, 0).u.alloc.id;

  struct wire_reply rep;
  struct rngs got = {0};
  page_ok(&f, 0, 0, 10, &rep); /* ids[0..9] */
  page_ranges(&f, &rep, &got);
  uint64_t c0 = rep.u.snapshot.changes;
  uint64_t seg = rep.u.snapshot.next_segment, off = rep.u.snapshot.next_offset;
  ck_assert_uint_eq(seg, seg_of[10]);
  gmb__wire_reply_clear(&rep);

  /* One behind the cursor, one ahead of it in the same segment, one in
   * the next segment. */
  ck_assert_int_eq(fx_free(&f, "a", 1001, ids[3]), 0);
  ck_assert_int_eq(fx_free(&f, "a", 1001, ids[20]), 0);
  ck_assert_int_eq(fx_free(&f, "a", 1001, ids[40]), 0);
  page_ok(&f, seg, off, 10, &rep);
  ck_assert_uint_ne(rep.u.snapshot.changes, c0); /* the reader can tell */
  page_ranges(&f, &rep, &got);
  seg = rep.u.snapshot.next_segment;
  off = rep.u.snapshot.next_offset;
  gmb__wire_reply_clear(&rep);

  /* Release the segment the cursor points into: every allocation of the
   * second segment goes (the first free takes it past the cursor). */
  uint64_t cursor_seg = seg_of[32];
  ck_assert_uint_eq(seg, seg_of[20]); /* still in the first segment */
  page_ok(&f, seg, off, 20, &rep);    /* to the middle of the second */
  page_ranges(&f, &rep, &got);
  seg = rep.u.snapshot.next_segment;
  off = rep.u.snapshot.next_offset;
  gmb__wire_reply_clear(&rep);
  ck_assert_uint_eq(seg, cursor_seg);
  ck_assert_uint_gt(off, 0);
  for (int i = 32; i < 64; i++)
    if (i != 40) ck_assert_int_eq(fx_free(&f, "a", 1001, ids[i]), 0);
  gmb__pool_trim(f.b.pool); /* the emptied segment lingers: release it */
  ck_assert_ptr_null(gmb__pool_segment(f.b.pool, cursor_seg, NULL));
  do {
    page_ok(&f, seg, off, 10, &rep);
    page_ranges(&f, &rep, &got);
    seg = rep.u.snapshot.next_segment;
    off = rep.u.snapshot.next_offset;
    gmb__wire_reply_clear(&rep);
  } while (seg);

  /* Nothing twice: (segment, offset) pairs strictly increase. */
  for (size_t i = 1; i < got.n; i++)
    ck_assert(got.r[i].seg > got.r[i - 1].seg ||
              (got.r[i].seg == got.r[i - 1].seg &&
               got.r[i].offset > got.r[i - 1].offset));
  ck_assert(has_id(&got, ids[3]));   /* given before it was freed */
  ck_assert(!has_id(&got, ids[20])); /* freed before its page */
  ck_assert(!has_id(&got, ids[40]));
  for (int i = 64; i < 96; i++) ck_assert(has_id(&got, ids[i]));
  ck_assert(has_id(&got, big));
  free(got.r);
  fx_close(&f);
}
END_TEST

/* Cursors that no page could have named are refused, and say why. */
START_TEST(snapshot_bad_cursor_refused) {
  struct fx f;
  fx_open_ini(&f, "host:64MiB", FX_INI_OFF);
  fx_hello(&f, "a", 1001, "llm-a");
  struct wire_reply r = fx_must_alloc(&f, "a", 1001, 4096, 0);
  uint64_t seg = r.u.alloc.segment;
  static const struct {
    uint64_t seg, off;
    const char *why;
  } bad[] = {
      {0, 512, "an offset needs a segment"},
      {1, 100, "not a multiple of 512"},
      {UINT64_MAX, 0, "never made"},
      {2, 0, "never made"}, /* one segment exists: id 1 */
      {1, 2 * MIB, "past its segment's end"},
      {1, UINT64_MAX - 511, "past its segment's end"},
  };
  ck_assert_uint_eq(seg, 1);
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    struct wire_reply rep;
    page(&f, bad[i].seg, bad[i].off, 10, &rep);
    ck_assert_int_eq(rep.status, GMB_E_INVAL);
    ck_assert_int_eq(rep.kind, WIRE_NONE);
    ck_assert_msg(strstr(rep.message, "bad snapshot cursor") &&
                      strstr(rep.message, bad[i].why),
                  "(%llu, %llu): %s", (unsigned long long)bad[i].seg,
                  (unsigned long long)bad[i].off, rep.message);
    gmb__wire_reply_clear(&rep);
  }
  /* The last offset of the segment is a cursor, if an odd one. */
  struct wire_reply rep;
  page_ok(&f, 1, 2 * MIB - 512, 10, &rep);
  ck_assert_uint_eq(rep.u.snapshot.n_segments, 0); /* no range starts there */
  ck_assert_uint_eq(rep.u.snapshot.next_segment, 0);
  gmb__wire_reply_clear(&rep);
  /* An admin request from a uid that is no admin is refused first. */
  struct wire_request req;
  memset(&req, 0, sizeof req);
  req.id = 99;
  req.kind = WIRE_ADMIN_SNAPSHOT;
  struct gmb_peer peer = fx_peer("job", geteuid() + 4242);
  ck_assert_int_eq(gmb__admin(&f.b, &peer, &req, &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_AUTH);
  fx_close(&f);
}
END_TEST

static Suite *snapshot_suite(void) {
  Suite *s = suite_create("snapshot");
  TCase *tc = tcase_create("snapshot");
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, snapshot_pages_every_range_once_in_order);
  tcase_add_test(tc, snapshot_page_bounded);
  tcase_add_test(tc, snapshot_free_between_pages);
  tcase_add_test(tc, snapshot_bad_cursor_refused);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) { return check_run(snapshot_suite()); }
