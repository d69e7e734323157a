/*
 * test_snapshot.c - snapshots of thousands of allocations read in pages
 * (docs/snapshot.md), by the real gmbctl from a real broker.
 *
 * Two tenants hold a few thousand small allocations (512 B to 4 KiB, both
 * kinds, some freed again) and a few large ones.  `gmbctl snapshot --page
 * N FILE` with pages far smaller than the snapshot must give exactly the
 * set of live allocations, each once, segments whole (a segment split
 * between pages is one segment in the document), ranges tiling each
 * segment, and a document that parses (jansson, and python3 -m json.tool
 * when the machine has it).  The text map read in pages has one line per
 * segment.  Then a client allocates and frees without pause while gmbctl
 * reads one range a page: the document stays valid, no allocation comes
 * twice, and "consistent" is a boolean that says whether the pool moved.
 */
#include <check.h>
#include <ctype.h>
#include <jansson.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "gmb.h"
#include "harness.h"
#include "wire.h"

#define KIB (UINT64_C(1) << 10)
#define MIB (UINT64_C(1) << 20)
#define N_ALLOCS 3000

static char out[8 << 20];

struct scene {
  struct harness_broker b;
  gmb_client *c[2];
  gmb_id ids[N_ALLOCS + 16];
  int n; /* ids[] entries; 0: freed */
  int live;
};

static void scene_start(struct scene *s) {
  memset(s, 0, sizeof *s);
  harness_broker_start(&s->b, "host:256MiB",
                       "[broker]\ncompaction = off\n");
  s->c[0] = harness_connect_ok(&s->b, "llm-a");
  s->c[1] = harness_connect_ok(&s->b, "train-b");
  uint64_t rnd = 0x9e3779b97f4a7c15u;
  for (int i = 0; i < N_ALLOCS; i++) {
    uint64_t size = 512 + harness_rnd(&rnd) % (4 * KIB - 511);
    if (i % 500 == 250) size = 3 * MIB; /* a large one now and then */
    gmb_id id = 0;
    int rc = gmb_alloc(s->c[i & 1], size, i % 3 ? GMB_MOVABLE : 0, &id);
    ck_assert_msg(rc == 0, "alloc %d: %s", i, gmb_last_error(s->c[i & 1]));
    s->ids[s->n++] = id;
    s->live++;
    if (i % 7 == 3) { /* holes */
      ck_assert_int_eq(gmb_free(s->c[i & 1], id), 0);
      s->ids[s->n - 1] = 0;
      s->live--;
    }
  }
}

static void scene_stop(struct scene *s) {
  for (int t = 0; t < 2; t++) gmb_disconnect(s->c[t]);
  harness_broker_stop(&s->b);
}

static int cmp_u64(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? -1 : x > y;
}

static json_int_t jint(json_t *o, const char *key) {
  json_t *v = json_object_get(o, key);
  ck_assert_msg(json_is_integer(v), "\"%s\" is not an integer", key);
  return json_integer_value(v);
}

/* The allocation ids of document j, sorted, in *ids (the caller frees);
 * checks on the way that segments come once each and in id order, and
 * (when `whole`) that ranges tile each segment and `used` adds up; with
 * `whole` 0 (the pool changed while it was read) only that offsets grow. */
static size_t doc_ids(json_t *j, int whole, uint64_t **ids) {
  json_t *segs = json_object_get(j, "segments");
  ck_assert(json_is_array(segs));
  size_t cap = 1024, n = 0, i;
  *ids = malloc(cap * sizeof **ids);
  ck_assert_ptr_nonnull(*ids);
  json_int_t prev = 0;
  json_t *seg;
  json_array_foreach(segs, i, seg) {
    json_int_t id = jint(seg, "id"), size = jint(seg, "size");
    ck_assert_int_gt(id, prev); /* once each, in order */
    prev = id;
    json_t *ranges = json_object_get(seg, "ranges");
    ck_assert(json_is_array(ranges));
    uint64_t at = 0, used = 0;
    size_t k;
    json_t *r;
    json_array_foreach(ranges, k, r) {
      uint64_t off = (uint64_t)jint(r, "offset"), rs = (uint64_t)jint(r, "size");
      if (whole)
        ck_assert_uint_eq(off, at);
      else
        ck_assert_uint_ge(off, at);
      at = off + rs;
      const char *state = json_string_value(json_object_get(r, "state"));
      ck_assert_ptr_nonnull(state);
      if (strcmp(state, "allocated") != 0) continue;
      used += rs;
      /* A large allocation's tail: the same id as its pages. */
      if (json_is_true(json_object_get(r, "tail"))) continue;
      if (n == cap) {
        cap *= 2;
        *ids = realloc(*ids, cap * sizeof **ids);
        ck_assert_ptr_nonnull(*ids);
      }
      (*ids)[n++] = (uint64_t)jint(r, "id");
    }
    ck_assert_uint_le(at, (uint64_t)size);
    if (whole) {
      ck_assert_uint_eq(at, (uint64_t)size);
      ck_assert_uint_eq((uint64_t)jint(seg, "used"), used);
    }
  }
  qsort(*ids, n, sizeof **ids, cmp_u64);
  for (size_t k = 1; k < n; k++)
    ck_assert_msg((*ids)[k] != (*ids)[k - 1], "allocation %llu given twice",
                  (unsigned long long)(*ids)[k]);
  return n;
}

/* Pages of 100 ranges, and of 1: the document is the set of live
 * allocations, each once, whatever the page; it parses, and says it was
 * read in pages from a pool that did not change. */
START_TEST(snapshot_in_pages_is_the_set_of_allocations) {
  struct scene s;
  scene_start(&s);
  uint64_t *want = malloc((size_t)s.live * sizeof *want);
  ck_assert_ptr_nonnull(want);
  int k = 0;
  for (int i = 0; i < s.n; i++)
    if (s.ids[i]) want[k++] = s.ids[i];
  qsort(want, (size_t)s.live, sizeof *want, cmp_u64);
  struct wire_reply st;
  ck_assert_int_eq(harness_admin_status(&s.b, &st), 0);

  static const char *pages[] = {"100", "1", "3000"};
  size_t nseg_first = 0;
  for (size_t p = 0; p < sizeof pages / sizeof pages[0]; p++) {
    char path[160];
    snprintf(path, sizeof path, "%s/snap-%s.json", s.b.dir, pages[p]);
    int rc = harness_ctl(&s.b, out, sizeof out, "snapshot", "--page",
                         pages[p], path, NULL);
    ck_assert_msg(rc == 0, "gmbctl snapshot --page %s: %d: %s", pages[p], rc,
                  out);
    ck_assert_msg(strstr(out, "written to"), "%s", out);
    ck_assert_int_ne(access(path, F_OK), -1);
    char tmp[200];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    ck_assert_int_eq(access(tmp, F_OK), -1); /* renamed, not left */
    json_error_t jerr;
    json_t *j = json_load_file(path, 0, &jerr);
    ck_assert_msg(j != NULL, "--page %s: not JSON: %s line %d", pages[p],
                  jerr.text, jerr.line);
    ck_assert_str_eq(json_string_value(json_object_get(j, "format")),
                     "gmb-snapshot/1");
    ck_assert(json_is_true(json_object_get(j, "consistent")));
    json_int_t npages = jint(j, "pages");
    if (strcmp(pages[p], "3000") != 0) ck_assert_int_gt(npages, 10);
    json_t *status = json_object_get(j, "status");
    ck_assert_uint_eq((uint64_t)jint(status, "in_use"),
                      st.u.admin_status.in_use);
    uint64_t *got;
    size_t n = doc_ids(j, 1, &got);
    ck_assert_uint_eq(n, (size_t)s.live);
    for (size_t i = 0; i < n; i++) ck_assert_uint_eq(got[i], want[i]);
    free(got);
    size_t nseg = json_array_size(json_object_get(j, "segments"));
    if (p == 0) nseg_first = nseg;
    ck_assert_uint_eq(nseg, nseg_first); /* split segments came out whole */
    json_decref(j);
    /* Another parser agrees, where there is one. */
    if (access("/usr/bin/python3", X_OK) == 0) {
      char *argv[] = {"/usr/bin/python3", "-m", "json.tool", path, NULL};
      static char pyout[1 << 16];
      rc = harness_run(argv, pyout, sizeof pyout);
      ck_assert_msg(rc == 0, "python3 -m json.tool %s: %d: %.400s", path, rc,
                    pyout);
    }
  }

  /* The text map read in pages of 10: one line per segment. */
  int rc = harness_ctl(&s.b, out, sizeof out, "map", "--page", "10", NULL);
  ck_assert_msg(rc == 0, "gmbctl map --page 10: %d: %s", rc, out);
  size_t bars = 0;
  for (char *line = strtok(out, "\n"); line; line = strtok(NULL, "\n")) {
    char *open = strchr(line, '['), *close = strrchr(line, ']');
    if (open && close && isdigit((unsigned char)line[strspn(line, " ")]))
      bars++;
  }
  ck_assert_uint_eq(bars, nseg_first);

  /* A page size that is no number is a usage error, said as such. */
  rc = harness_ctl(&s.b, out, sizeof out, "snapshot", "--page", "0", NULL);
  ck_assert_int_eq(rc, 2);
  ck_assert_msg(strstr(out, "--page"), "%s", out);
  rc = harness_ctl(&s.b, out, sizeof out, "map", "--page=12x", NULL);
  ck_assert_int_eq(rc, 2);
  gmb__wire_reply_clear(&st);
  free(want);
  scene_stop(&s);
}
END_TEST

struct churn {
  const char *endpoint;
  atomic_int *stop;
  atomic_long *ops;
};

/* Allocates and frees without pause until told to stop. */
static int churn_main(void *arg) {
  struct churn *c = arg;
  gmb_client *cl;
  if (gmb_connect(c->endpoint, "churn", &cl) != 0) return 3;
  while (!atomic_load(c->stop)) {
    gmb_id id;
    if (gmb_alloc(cl, 4096, 0, &id) != 0) return 4;
    if (gmb_free(cl, id) != 0) return 5;
    atomic_fetch_add(c->ops, 1);
  }
  gmb_disconnect(cl);
  return 0;
}

/* The pool changes while gmbctl reads it a range a page: the document is
 * still valid JSON, no allocation comes twice, every allocation that lived
 * throughout is there, and "consistent" says false when the churner was
 * served between the first page and the last. */
START_TEST(snapshot_valid_while_pool_changes) {
  struct scene s;
  scene_start(&s);
  atomic_int *stop = mmap(NULL, 4096, PROT_READ | PROT_WRITE,
                          MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  ck_assert(stop != MAP_FAILED);
  atomic_long *ops = (atomic_long *)(stop + 16);
  struct churn c = {s.b.endpoint, stop, ops};
  pid_t pid = harness_fork(churn_main, &c);
  /* Wait until it runs, so that it churns during the whole snapshot. */
  for (int i = 0; i < 500 && atomic_load(ops) < 10; i++) harness_sleep_ms(10);
  ck_assert_int_ge(atomic_load(ops), 10);
  char path[160];
  snprintf(path, sizeof path, "%s/churn.json", s.b.dir);
  long before = atomic_load(ops);
  int rc = harness_ctl(&s.b, out, sizeof out, "snapshot", "--page", "1",
                       path, NULL);
  long during = atomic_load(ops) - before;
  fprintf(stderr, "snapshot_valid_while_pool_changes: %ld alloc+free pairs "
          "served during the snapshot\n", during);
  atomic_store(stop, 1);
  ck_assert_int_eq(harness_wait(pid), 0);
  ck_assert_msg(rc == 0, "gmbctl snapshot: %d: %s", rc, out);
  json_error_t jerr;
  json_t *j = json_load_file(path, 0, &jerr);
  ck_assert_msg(j != NULL, "not JSON: %s line %d", jerr.text, jerr.line);
  json_t *cons = json_object_get(j, "consistent");
  ck_assert(json_is_boolean(cons));
  /* Thousands of pages against a client that allocates without pause:
   * served in between unless it was never scheduled. */
  if (during > 1000) ck_assert(json_is_false(cons));
  uint64_t *got;
  size_t n = doc_ids(j, json_is_true(cons), &got);
  for (int i = 0; i < s.n; i++)
    if (s.ids[i])
      ck_assert_msg(bsearch(&s.ids[i], got, n, sizeof *got, cmp_u64),
                    "allocation %llu missing", (unsigned long long)s.ids[i]);
  ck_assert_uint_le(n, (size_t)s.live + 1); /* the churner holds one */
  free(got);
  json_decref(j);
  munmap(stop, 4096);
  scene_stop(&s);
}
END_TEST

int main(void) {
  return harness_main(HARNESS_SUITE("snapshot", "snapshot", 120,
                                    snapshot_in_pages_is_the_set_of_allocations,
                                    snapshot_valid_while_pool_changes));
}
