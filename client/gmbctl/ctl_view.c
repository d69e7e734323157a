/*
 * ctl_view.c - gmbctl's views of the broker's memory: `map` (a text map,
 * or an SVG with --svg; with --json the snapshot document) and `metrics`
 * (the Prometheus text, docs/metrics.md).
 *
 * The map reads a snapshot page by page (ctl_snapshot.c) and keeps what
 * its drawing needs: the text map one line per segment (its bar is
 * summed up as the ranges arrive, so no range is kept), the SVG every
 * range, because it draws each allocation and lays rows out by tenant
 * only once all are known (docs/snapshot.md says so).  Nothing here
 * interprets the broker's state beyond drawing it: the ranges of a segment
 * come in address order and tile it (the broker's pool guarantees it), and
 * the drawings rely on that only to lay out; a reply that breaks it draws
 * wrongly but never reads out of bounds.
 *
 * The text map gives each segment one line and a bar of CTL_MAP_WIDTH
 * slices, each the same fraction of its own segment; the SVG scales bar
 * lengths by the logarithm of segment sizes, so 2 MiB and 2 GiB segments
 * both stay legible on one page.
 */
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ctl.h"
#include "gmb.h"
#include "util.h"
#include "wire.h"

#define CTL_MAP_WIDTH 64

/* --- shared -------------------------------------------------------------- */

/* A size for reading at a glance: exact when that is short ("2MiB"), else
 * three significant digits ("2.25GiB"): gmb__size_format's exact forms
 * such as "2362304KiB" or "1642MiB" are right but slow to read. */
static char *view_size(uint64_t v, char *buf, size_t cap) {
  gmb__size_format(v, buf, cap);
  if (strspn(buf, "0123456789") <= 3 && strlen(buf) <= 7) return buf;
  static const char *unit[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double d = (double)v;
  int i = 0;
  while (i < 4 && d >= 1000.0) {
    d /= 1024.0;
    i++;
  }
  snprintf(buf, cap, d < 10 ? "%.2f%s" : d < 100 ? "%.1f%s" : "%.0f%s", d,
           unit[i]);
  return buf;
}

/* "2024-05-01T12:00:00Z" (json) or "2024-05-01 12:00:00 UTC". */
static void view_time(char *buf, size_t cap, int iso) {
  time_t now = time(NULL);
  struct tm tm;
  gmtime_r(&now, &tm);
  strftime(buf, cap, iso ? "%Y-%m-%dT%H:%M:%SZ" : "%Y-%m-%d %H:%M:%S UTC",
           &tm);
}

static uint64_t view_seg_used(const struct wire_segment_info *s) {
  uint64_t u = 0;
  for (size_t k = 0; k < s->n_ranges; k++)
    if (s->ranges[k].id) u += s->ranges[k].size;
  return u;
}

static uint64_t view_allocations(const struct wire_reply *rep) {
  uint64_t n = 0;
  for (size_t i = 0; i < rep->u.snapshot.n_segments; i++)
    for (size_t k = 0; k < rep->u.snapshot.segments[i].n_ranges; k++)
      if (rep->u.snapshot.segments[i].ranges[k].id) n++;
  return n;
}

/* Segment order for drawings: by tenant, then id, so that a tenant's
 * segments sit together. */
static const struct wire_segment_info *view_sort_base;
static int view_cmp(const void *a, const void *b) {
  const struct wire_segment_info *x = &view_sort_base[*(const size_t *)a];
  const struct wire_segment_info *y = &view_sort_base[*(const size_t *)b];
  int c = strcmp(x->tenant, y->tenant);
  if (c) return c;
  return x->id < y->id ? -1 : x->id > y->id;
}

static size_t *view_order(const struct wire_reply *rep) {
  size_t n = rep->u.snapshot.n_segments;
  size_t *ord = malloc((n ? n : 1) * sizeof *ord);
  if (ord == NULL) return NULL;
  for (size_t i = 0; i < n; i++) ord[i] = i;
  view_sort_base = rep->u.snapshot.segments;
  qsort(ord, n, sizeof *ord, view_cmp);
  return ord;
}

/* --- text map ----------------------------------------------------------- */

/* The bar of one segment, summed up range by range: each slice shows what
 * covers most of it. */
struct view_bar {
  uint64_t size;
  uint64_t freeb[CTL_MAP_WIDTH], best[CTL_MAP_WIDTH];
  char what[CTL_MAP_WIDTH];
  unsigned nth; /* allocations so far: neighbours get the next letter */
};

static void view_bar_start(struct view_bar *b, uint64_t size) {
  memset(b, 0, sizeof *b);
  memset(b->what, '.', sizeof b->what);
  b->size = size ? size : 1;
}

static void view_bar_add(struct view_bar *b, const struct wire_range_info *r) {
  uint64_t size = b->size;
  if (r->size == 0 || r->offset >= size) return;
  uint64_t end = r->offset + r->size > size || r->offset + r->size < r->offset
                     ? size
                     : r->offset + r->size;
  char c;
  if (r->id) {
    c = r->locked ? '#' : (char)((r->movable ? 'a' : 'A') + (char)(b->nth % 26));
    b->nth++;
  } else {
    c = r->locked ? '+' : '.';
  }
  uint64_t j0 = r->offset * CTL_MAP_WIDTH / size;
  uint64_t j1 = (end - 1) * CTL_MAP_WIDTH / size;
  for (uint64_t j = j0; j <= j1 && j < CTL_MAP_WIDTH; j++) {
    uint64_t lo = j * size / CTL_MAP_WIDTH, hi = (j + 1) * size / CTL_MAP_WIDTH;
    uint64_t a = r->offset > lo ? r->offset : lo, e = end < hi ? end : hi;
    uint64_t ov = e > a ? e - a : 0;
    if (c == '.') {
      b->freeb[j] += ov;
    } else if (ov > b->best[j]) {
      b->best[j] = ov;
      b->what[j] = c;
    }
  }
}

static void view_bar_done(const struct view_bar *b, char *bar) {
  uint64_t size = b->size;
  for (int j = 0; j < CTL_MAP_WIDTH; j++) {
    uint64_t len = (uint64_t)(j + 1) * size / CTL_MAP_WIDTH -
                   (uint64_t)j * size / CTL_MAP_WIDTH;
    if (b->best[j] == 0)
      bar[j] = '.';
    else if (b->freeb[j] * 2 > len)
      bar[j] = ':'; /* mostly free, with something small in it */
    else
      bar[j] = b->what[j];
  }
  bar[CTL_MAP_WIDTH] = '\0';
}

/* Paused tags hold no segment, so the map cannot draw them: a line per
 * tenant that has some says what went where (docs/sleep.md). */
static void view_text_paused(const struct wire_admin_status *st) {
  for (size_t i = 0; i < st->n_tenants; i++) {
    const struct wire_tenant_row *t = &st->tenants[i];
    if (t->paused_tags == 0) continue;
    char a[GMB_SIZE_BUFSZ], b[GMB_SIZE_BUFSZ];
    printf("paused: tenant %s, %u tags: %s given back, %s in host memory\n",
           t->name, t->paused_tags, view_size(t->paused_bytes, a, sizeof a),
           view_size(t->host_bytes, b, sizeof b));
  }
}

/* Each tenant's totals under the map: what its segments hold, and how
 * much of that its sessions' caches keep free (allocated in the map, yet
 * theirs to give back). */
static void view_text_tenants(const struct wire_admin_status *st) {
  int wt = (int)strlen("TENANT");
  for (size_t i = 0; i < st->n_tenants; i++)
    if ((int)strlen(st->tenants[i].name) > wt)
      wt = (int)strlen(st->tenants[i].name);
  printf("\n%-*s  %9s  %9s  %9s  %4s\n", wt, "TENANT", "SEGMENTS", "USED",
         "CACHED", "FRAG");
  for (size_t i = 0; i < st->n_tenants; i++) {
    const struct wire_tenant_row *t = &st->tenants[i];
    char a[GMB_SIZE_BUFSZ], b[GMB_SIZE_BUFSZ], c[GMB_SIZE_BUFSZ];
    printf("%-*s  %9s  %9s  %9s  %4.2f\n", wt, t->name,
           view_size(t->segments, a, sizeof a), view_size(t->used, b, sizeof b),
           view_size(t->cached, c, sizeof c), t->fragmentation);
  }
  printf("CACHED: of USED, free in the tenant's sessions' caches "
         "(gmbctl sessions shows whose)\n");
  view_text_paused(st);
}

/* One line of the text map: all the map keeps of a segment. */
struct view_line {
  uint64_t id, size, used;
  int small;
  char tenant[WIRE_NAME_MAX + 1];
  char bar[CTL_MAP_WIDTH + 1];
};

/* What `map` keeps while the pages arrive: the status, and a line per
 * segment (text) or every segment with its ranges (SVG). */
struct view_map {
  int svg;
  struct wire_admin_status st; /* a copy: its tenants are ours */
  struct view_line *lines;
  struct wire_segment_info *segs; /* SVG: ranges are ours */
  size_t n, cap;
  struct view_bar bar; /* text: of the open segment */
};

static int view_grow(void **arr, size_t *cap, size_t n, size_t elem) {
  if (n < *cap) return 0;
  size_t c = *cap ? *cap * 2 : 64;
  void *p = realloc(*arr, c * elem);
  if (p == NULL) return gmb__ctl_fail(CTL_EXIT_FAIL, "out of memory");
  *arr = p;
  *cap = c;
  return 0;
}

static int view_map_status(void *ctx, const struct wire_admin_status *st) {
  struct view_map *m = ctx;
  m->st = *st;
  m->st.tenants = NULL;
  m->st.n_tenants = 0;
  m->st.session_rows = NULL; /* the page's, freed with it; not drawn */
  m->st.n_sessions = 0;
  if (st->n_tenants) {
    m->st.tenants = malloc(st->n_tenants * sizeof *st->tenants);
    if (m->st.tenants == NULL)
      return gmb__ctl_fail(CTL_EXIT_FAIL, "out of memory");
    memcpy(m->st.tenants, st->tenants, st->n_tenants * sizeof *st->tenants);
    m->st.n_tenants = st->n_tenants;
  }
  return 0;
}

/* SVG: appends s's ranges to the segment kept last. */
static int view_map_keep_ranges(struct view_map *m,
                                const struct wire_segment_info *s) {
  struct wire_segment_info *k = &m->segs[m->n - 1];
  if (s->n_ranges == 0) return 0;
  struct wire_range_info *r =
      realloc(k->ranges, (k->n_ranges + s->n_ranges) * sizeof *r);
  if (r == NULL) return gmb__ctl_fail(CTL_EXIT_FAIL, "out of memory");
  memcpy(r + k->n_ranges, s->ranges, s->n_ranges * sizeof *r);
  k->ranges = r;
  k->n_ranges += s->n_ranges;
  return 0;
}

static int view_map_more(void *ctx, const struct wire_segment_info *s) {
  struct view_map *m = ctx;
  if (m->svg) return view_map_keep_ranges(m, s);
  struct view_line *l = &m->lines[m->n - 1];
  for (size_t k = 0; k < s->n_ranges; k++) {
    view_bar_add(&m->bar, &s->ranges[k]);
    if (s->ranges[k].id) l->used += s->ranges[k].size;
  }
  return 0;
}

static int view_map_begin(void *ctx, const struct wire_segment_info *s,
                          int split) {
  (void)split;
  struct view_map *m = ctx;
  if (m->svg) {
    int rc = view_grow((void **)&m->segs, &m->cap, m->n, sizeof *m->segs);
    if (rc) return rc;
    m->segs[m->n] = *s;
    m->segs[m->n].ranges = NULL;
    m->segs[m->n].n_ranges = 0;
    m->n++;
    return view_map_keep_ranges(m, s);
  }
  int rc = view_grow((void **)&m->lines, &m->cap, m->n, sizeof *m->lines);
  if (rc) return rc;
  struct view_line *l = &m->lines[m->n++];
  memset(l, 0, sizeof *l);
  l->id = s->id;
  l->size = s->size;
  l->small = s->small;
  snprintf(l->tenant, sizeof l->tenant, "%s", s->tenant);
  view_bar_start(&m->bar, s->size);
  return view_map_more(m, s);
}

static int view_map_end(void *ctx) {
  struct view_map *m = ctx;
  if (!m->svg) view_bar_done(&m->bar, m->lines[m->n - 1].bar);
  return 0;
}

static void view_map_free(struct view_map *m) {
  free(m->st.tenants);
  free(m->lines);
  for (size_t i = 0; m->svg && i < m->n; i++) free(m->segs[i].ranges);
  free(m->segs);
}

/* Segment order for drawings: by tenant, then id, so that a tenant's
 * segments sit together. */
static int view_line_cmp(const void *a, const void *b) {
  const struct view_line *x = a, *y = b;
  int c = strcmp(x->tenant, y->tenant);
  if (c) return c;
  return x->id < y->id ? -1 : x->id > y->id;
}

static void view_text(struct view_map *m, const struct ctl_pages_total *t) {
  const struct wire_admin_status *st = &m->st;
  char a[GMB_SIZE_BUFSZ], b[GMB_SIZE_BUFSZ], c[GMB_SIZE_BUFSZ], when[40];
  view_time(when, sizeof when, 0);
  char d[GMB_SIZE_BUFSZ];
  printf("device %s  capacity %s  in segments %s  in use %s  cached %s  "
         "fragmentation %.2f  (%s)\n",
         st->device, view_size(st->capacity, a, sizeof a),
         view_size(st->in_segments, b, sizeof b),
         view_size(st->in_use, c, sizeof c), view_size(st->cached, d, sizeof d),
         st->fragmentation, when);
  size_t n = m->n, wt = strlen("TENANT"), ws = 4;
  if (n) qsort(m->lines, n, sizeof *m->lines, view_line_cmp); /* NULL when 0 */
  for (size_t i = 0; i < n; i++) {
    const struct view_line *l = &m->lines[i];
    if (strlen(l->tenant) > wt) wt = strlen(l->tenant);
    if (strlen(gmb__size_format(l->size, a, sizeof a)) > ws) ws = strlen(a);
  }
  if (n == 0) {
    printf("no segments: nothing is allocated\n");
    view_text_paused(st);
    return;
  }
  printf("%6s  %-*s  %-*s  %4s  %s\n", "SEG", (int)ws, "SIZE", (int)wt,
         "TENANT", "USED", "MAP (each character 1/64 of its segment)");
  for (size_t i = 0; i < n; i++) {
    const struct view_line *l = &m->lines[i];
    printf("%6llu  %-*s  %-*s  %3d%%  [%s]%s\n", (unsigned long long)l->id,
           (int)ws, gmb__size_format(l->size, a, sizeof a), (int)wt,
           l->tenant, l->size ? (int)(l->used * 100 / l->size) : 0, l->bar,
           l->small ? "" : "  large");
  }
  printf("legend: A-Z pinned, a-z movable (one letter per allocation, the "
         "next letter for its neighbour),\n        # locked, + move in "
         "flight, . free, : mostly free; \"large\": a segment of one or "
         "more large requests\n");
  if (!t->consistent)
    printf("note: read in %u pages while the broker's memory changed: the "
           "lines are not one instant\n", t->pages);
  view_text_tenants(st);
}

/* --- SVG map ------------------------------------------------------------ */

static const char *view_palette[] = {"#4e79a7", "#e15759", "#59a14f",
                                     "#f28e2b", "#b07aa1", "#76b7b2",
                                     "#edc948", "#9c755f"};
#define VIEW_NPAL (sizeof view_palette / sizeof view_palette[0])

static void view_xml(FILE *f, const char *s) {
  for (; *s; s++) {
    switch (*s) {
      case '&': fputs("&amp;", f); break;
      case '<': fputs("&lt;", f); break;
      case '>': fputs("&gt;", f); break;
      case '"': fputs("&quot;", f); break;
      default: fputc(*s, f);
    }
  }
}

/* `hex` mixed with white: t 0 the colour, 1 white. */
static void view_light(const char *hex, double t, char *out, size_t cap) {
  unsigned r, g, b;
  if (sscanf(hex, "#%02x%02x%02x", &r, &g, &b) != 3) r = g = b = 128;
  snprintf(out, cap, "#%02x%02x%02x", (unsigned)(r + (255 - r) * t + 0.5),
           (unsigned)(g + (255 - g) * t + 0.5),
           (unsigned)(b + (255 - b) * t + 0.5));
}

/* Index of each segment's tenant among the distinct tenants (in order). */
struct view_tenants {
  const char *name[64];
  size_t n;
};

static size_t view_tenant_index(struct view_tenants *vt, const char *name) {
  for (size_t i = 0; i < vt->n; i++)
    if (strcmp(vt->name[i], name) == 0) return i;
  if (vt->n < 64) vt->name[vt->n++] = name;
  return vt->n - 1;
}

#define SVG_W 1160
#define SVG_X0 170      /* bars start */
#define SVG_BARMAX 760  /* the largest segment's bar */
#define SVG_ROW 26
#define SVG_BARH 18
#define SVG_TOP 84

static int view_svg(const struct wire_reply *rep, const size_t *ord,
                    FILE *f) {
  const struct wire_admin_status *st = &rep->u.snapshot.status;
  size_t n = rep->u.snapshot.n_segments;
  uint64_t smin = UINT64_MAX, smax = 0;
  struct view_tenants vt = {.n = 0};
  for (size_t i = 0; i < n; i++) {
    const struct wire_segment_info *s = &rep->u.snapshot.segments[ord[i]];
    if (s->size < smin) smin = s->size;
    if (s->size > smax) smax = s->size;
    view_tenant_index(&vt, s->tenant);
  }
  /* The tenants without segments still get a legend entry. */
  for (size_t i = 0; i < st->n_tenants; i++)
    view_tenant_index(&vt, st->tenants[i].name);
  size_t legend_rows = (vt.n + 2) / 3;
  int h = SVG_TOP + (int)(n ? n : 1) * SVG_ROW + 24 + 28 +
          (int)legend_rows * 22 + 4;
  char a[GMB_SIZE_BUFSZ], b[GMB_SIZE_BUFSZ], c[GMB_SIZE_BUFSZ], d[GMB_SIZE_BUFSZ],
      when[40];
  view_time(when, sizeof when, 0);
  fprintf(f,
          "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
          "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" "
          "height=\"%d\" viewBox=\"0 0 %d %d\" "
          "font-family=\"DejaVu Sans, Helvetica, Arial, sans-serif\" "
          "font-size=\"12\">\n<title>gmb map of ",
          SVG_W, h, SVG_W, h);
  view_xml(f, st->device);
  fprintf(f, " at %s</title>\n", when);
  fputs("<defs>\n"
        "<pattern id=\"hatch\" width=\"6\" height=\"6\" "
        "patternUnits=\"userSpaceOnUse\" patternTransform=\"rotate(45)\">"
        "<rect width=\"6\" height=\"6\" fill=\"none\"/>"
        "<line x1=\"0\" y1=\"0\" x2=\"0\" y2=\"6\" stroke=\"#1a1a1a\" "
        "stroke-width=\"2.2\"/></pattern>\n</defs>\n"
        "<rect width=\"100%\" height=\"100%\" fill=\"#ffffff\"/>\n", f);
  fputs("<text x=\"20\" y=\"32\" font-size=\"20\" font-weight=\"bold\">"
        "gmb memory map \xe2\x80\x94 ", f);
  view_xml(f, st->device);
  fprintf(f, " \xe2\x80\x94 %s</text>\n", when);
  fprintf(f,
          "<text x=\"20\" y=\"56\" fill=\"#444\">capacity %s \xc2\xb7 in "
          "segments %s \xc2\xb7 in use %s \xc2\xb7 largest free %s \xc2\xb7 "
          "fragmentation %.2f \xc2\xb7 %zu segments, %llu allocations, %u "
          "sessions</text>\n",
          view_size(st->capacity, a, sizeof a),
          view_size(st->in_segments, b, sizeof b),
          view_size(st->in_use, c, sizeof c),
          view_size(st->largest_free, d, sizeof d), st->fragmentation,
          n, (unsigned long long)view_allocations(rep), st->sessions);
  fprintf(f, "<text x=\"%d\" y=\"76\" fill=\"#777\" font-size=\"11\">bar "
          "length grows with the logarithm of the segment's size; offsets "
          "within a bar are linear</text>\n", SVG_X0);
  if (n == 0)
    fprintf(f, "<text x=\"%d\" y=\"%d\" fill=\"#777\">no segments: nothing "
            "is allocated</text>\n", SVG_X0, SVG_TOP + 16);
  const char *prev = NULL;
  for (size_t i = 0; i < n; i++) {
    const struct wire_segment_info *s = &rep->u.snapshot.segments[ord[i]];
    size_t ti = view_tenant_index(&vt, s->tenant);
    const char *col = view_palette[ti % VIEW_NPAL];
    char light[8];
    view_light(col, 0.55, light, sizeof light);
    double frac = smax > smin ? 0.22 + 0.78 * log((double)s->size / smin) /
                                            log((double)smax / smin)
                              : 1.0;
    double bw = SVG_BARMAX * frac;
    int y = SVG_TOP + (int)i * SVG_ROW;
    if (prev == NULL || strcmp(prev, s->tenant) != 0) {
      if (prev)
        fprintf(f, "<line x1=\"20\" x2=\"%d\" y1=\"%d\" y2=\"%d\" "
                "stroke=\"#ddd\"/>\n", SVG_W - 20, y - 4, y - 4);
      fprintf(f, "<rect x=\"20\" y=\"%d\" width=\"10\" height=\"%d\" "
              "fill=\"%s\"/><text x=\"36\" y=\"%d\" font-weight=\"bold\">",
              y, SVG_BARH, col, y + 13);
      view_xml(f, s->tenant[0] ? s->tenant : "(none)");
      fputs("</text>\n", f);
      prev = s->tenant;
    }
    fprintf(f, "<g><title>segment %llu, %s, ", (unsigned long long)s->id,
            gmb__size_format(s->size, a, sizeof a));
    view_xml(f, s->tenant);
    fputs("</title>\n", f);
    fprintf(f, "<rect x=\"%d\" y=\"%d\" width=\"%.2f\" height=\"%d\" "
            "fill=\"#f2f2f2\"/>\n", SVG_X0, y, bw, SVG_BARH);
    for (size_t k = 0; k < s->n_ranges; k++) {
      const struct wire_range_info *r = &s->ranges[k];
      if (r->id == 0 && !r->locked) continue; /* free: the background */
      double x = SVG_X0 + bw * (double)r->offset / (double)s->size;
      double w = bw * (double)r->size / (double)s->size;
      if (w < 0.8) w = 0.8; /* a tiny allocation still shows */
      const char *fill = r->id == 0 ? "#ffffff" : r->movable ? light : col;
      const char *sep = w >= 3 ? " stroke=\"#ffffff\" stroke-width=\"0.7\"" : "";
      fprintf(f, "<rect x=\"%.2f\" y=\"%d\" width=\"%.2f\" height=\"%d\" "
              "fill=\"%s\"%s><title>", x, y, w, SVG_BARH, fill, sep);
      if (r->id)
        fprintf(f, "allocation %llu: %s at +%s, %s%s, session %llu",
                (unsigned long long)r->id,
                gmb__size_format(r->size, a, sizeof a),
                gmb__size_format(r->offset, b, sizeof b),
                r->movable ? "movable" : "pinned", r->locked ? ", locked" : "",
                (unsigned long long)r->session);
      else
        fprintf(f, "move in flight: %s", gmb__size_format(r->size, a, sizeof a));
      fputs("</title></rect>\n", f);
      if (r->id && r->locked)
        fprintf(f, "<rect x=\"%.2f\" y=\"%.1f\" width=\"%.2f\" height=\"%d\" "
                "fill=\"url(#hatch)\" stroke=\"#1a1a1a\" stroke-width=\"1.2\"/>"
                "\n", x + 0.6, y + 0.6, w > 1.2 ? w - 1.2 : w, SVG_BARH - 1);
      else if (r->id == 0)
        fprintf(f, "<rect x=\"%.2f\" y=\"%d\" width=\"%.2f\" height=\"%d\" "
                "fill=\"none\" stroke=\"#555\" stroke-dasharray=\"3 2\"/>\n",
                x + 0.5, y + 1, w > 1 ? w - 1 : w, SVG_BARH - 2);
    }
    fprintf(f, "<rect x=\"%d\" y=\"%d\" width=\"%.2f\" height=\"%d\" "
            "fill=\"none\" stroke=\"#888\" stroke-width=\"0.8\"/>\n", SVG_X0,
            y, bw, SVG_BARH);
    uint64_t used = view_seg_used(s);
    fprintf(f, "<text x=\"%.1f\" y=\"%d\" fill=\"#333\">seg %llu \xc2\xb7 "
            "%s \xc2\xb7 %d%% used%s</text>\n</g>\n", SVG_X0 + bw + 8, y + 13,
            (unsigned long long)s->id, gmb__size_format(s->size, a, sizeof a),
            s->size ? (int)(used * 100 / s->size) : 0,
            s->small ? "" : " \xc2\xb7 large");
  }
  /* Legend: the kinds of range, then a swatch per tenant. */
  int y = SVG_TOP + (int)(n ? n : 1) * SVG_ROW + 24;
  fprintf(f, "<line x1=\"20\" x2=\"%d\" y1=\"%d\" y2=\"%d\" stroke=\"#bbb\"/>"
          "\n", SVG_W - 20, y - 14, y - 14);
  const char *c0 = view_palette[0];
  char l0[8];
  view_light(c0, 0.55, l0, sizeof l0);
  fprintf(f,
          "<text x=\"20\" y=\"%d\" font-weight=\"bold\">legend</text>\n"
          "<rect x=\"90\" y=\"%d\" width=\"28\" height=\"14\" fill=\"%s\"/>"
          "<text x=\"124\" y=\"%d\">pinned (never moves)</text>\n"
          "<rect x=\"270\" y=\"%d\" width=\"28\" height=\"14\" fill=\"%s\"/>"
          "<text x=\"304\" y=\"%d\">movable</text>\n"
          "<rect x=\"380\" y=\"%d\" width=\"28\" height=\"14\" fill=\"%s\"/>"
          "<rect x=\"380.6\" y=\"%d.6\" width=\"26.8\" height=\"13\" "
          "fill=\"url(#hatch)\" stroke=\"#1a1a1a\" stroke-width=\"1.2\"/>"
          "<text x=\"414\" y=\"%d\">movable, locked now</text>\n"
          "<rect x=\"560\" y=\"%d\" width=\"28\" height=\"14\" "
          "fill=\"#f2f2f2\" stroke=\"#888\" stroke-width=\"0.8\"/>"
          "<text x=\"594\" y=\"%d\">free</text>\n"
          "<rect x=\"650\" y=\"%d\" width=\"28\" height=\"14\" fill=\"#fff\" "
          "stroke=\"#555\" stroke-dasharray=\"3 2\"/>"
          "<text x=\"684\" y=\"%d\">move in flight</text>\n"
          "<text x=\"800\" y=\"%d\" fill=\"#777\">colour: tenant</text>\n",
          y, y - 11, c0, y, y - 11, l0, y, y - 11, l0, y - 11, y, y - 11, y,
          y - 11, y, y);
  y += 28;
  for (size_t i = 0; i < vt.n; i++) {
    const struct wire_tenant_row *row = NULL;
    for (size_t k = 0; k < st->n_tenants; k++)
      if (strcmp(st->tenants[k].name, vt.name[i]) == 0) row = &st->tenants[k];
    int x = 20 + (int)(i % 3) * 375, yy = y + (int)(i / 3) * 22;
    fprintf(f, "<rect x=\"%d\" y=\"%d\" width=\"14\" height=\"14\" "
            "fill=\"%s\"/><text x=\"%d\" y=\"%d\"><tspan "
            "font-weight=\"bold\">", x, yy - 11, view_palette[i % VIEW_NPAL],
            x + 20, yy);
    view_xml(f, vt.name[i][0] ? vt.name[i] : "(none)");
    fputs("</tspan>", f);
    if (row)
      fprintf(f, "  %s used of %s in segments \xc2\xb7 frag %.2f",
              view_size(row->used, a, sizeof a),
              view_size(row->segments, b, sizeof b), row->fragmentation);
    if (row && row->cached)
      fprintf(f, " \xc2\xb7 %s cached", view_size(row->cached, a, sizeof a));
    fputs("</text>\n", f);
  }
  fputs("</svg>\n", f);
  return ferror(f) ? -1 : 0;
}

int gmb__ctl_write_atomic(const char *path, int (*fn)(FILE *f, void *ctx),
                          void *ctx) {
  char tmp[4096];
  if ((size_t)snprintf(tmp, sizeof tmp, "%s.tmp", path) >= sizeof tmp)
    return gmb__ctl_fail(CTL_EXIT_FAIL, "%s: name too long", path);
  FILE *f = fopen(tmp, "w");
  if (f == NULL)
    return gmb__ctl_fail(CTL_EXIT_FAIL, "cannot write %s: %s", path,
                         strerror(errno));
  int rc = fn(f, ctx);
  if (fclose(f) != 0 && rc == 0) rc = -1;
  if (rc == 0 && rename(tmp, path) != 0) rc = -1;
  if (rc == 0) return 0;
  int e = errno;
  remove(tmp);
  if (rc > 0) return rc; /* fn said why */
  return gmb__ctl_fail(CTL_EXIT_FAIL, "cannot write %s: %s", path,
                       strerror(e ? e : EIO));
}

struct view_svg_ctx {
  const struct wire_reply *rep;
  const size_t *ord;
};

static int view_svg_fn(FILE *f, void *ctx) {
  const struct view_svg_ctx *c = ctx;
  return view_svg(c->rep, c->ord, f);
}

static int view_svg_write(const struct wire_reply *rep, const size_t *ord,
                          const char *path) {
  if (strcmp(path, "-") == 0)
    return view_svg(rep, ord, stdout) == 0
               ? 0
               : gmb__ctl_fail(CTL_EXIT_FAIL, "cannot write the SVG");
  struct view_svg_ctx c = {rep, ord};
  return gmb__ctl_write_atomic(path, view_svg_fn, &c);
}

int gmb__ctl_map(struct ctl *ctl, const struct ctl_verb *v, int argc,
                 char **argv) {
  const char *svg = NULL;
  uint32_t limit = 0;
  for (int i = 0; i < argc; i++) {
    int rc = gmb__ctl_page_opt(v, argc, argv, &i, &limit);
    if (rc < 0) return -rc;
    if (rc > 0) continue;
    if (strcmp(argv[i], "--svg") == 0) {
      if (++i >= argc)
        return gmb__ctl_fail(CTL_EXIT_USAGE, "%s: --svg needs a file name",
                             v->name);
      svg = argv[i];
    } else if (strncmp(argv[i], "--svg=", 6) == 0 && argv[i][6]) {
      svg = argv[i] + 6;
    } else {
      return gmb__ctl_fail(CTL_EXIT_USAGE, "%s: unexpected argument '%s' "
                           "(usage: gmbctl %s)", v->name, argv[i], v->usage);
    }
  }
  /* What the pages go to: the SVG's collection and, with --json, the
   * document on stdout; else the text map's lines. */
  struct view_map m = {.svg = svg != NULL};
  struct ctl_pages_sink sinks[2];
  size_t n = 0;
  struct ctl_json_writer w;
  if (svg || !ctl->json)
    sinks[n++] = (struct ctl_pages_sink){.status = view_map_status,
                                         .begin = view_map_begin,
                                         .more = view_map_more,
                                         .end = view_map_end,
                                         .ctx = &m};
  if (ctl->json) gmb__ctl_json_writer(&w, stdout, &sinks[n++]);
  struct ctl_pages_total t;
  int rc = gmb__ctl_pages(ctl, v->name, limit, sinks, n, &t);
  if (rc < 0) rc = gmb__ctl_fail(CTL_EXIT_FAIL, "cannot write the output");
  if (rc == 0 && svg) {
    /* The drawing reads a whole snapshot: lend it the collection. */
    struct wire_reply rep = {.kind = WIRE_ADMIN_SNAPSHOT};
    rep.u.snapshot.has_status = 1;
    rep.u.snapshot.status = m.st;
    rep.u.snapshot.segments = m.segs;
    rep.u.snapshot.n_segments = m.n;
    size_t *ord = view_order(&rep);
    rc = ord ? view_svg_write(&rep, ord, svg)
             : gmb__ctl_fail(CTL_EXIT_FAIL, "out of memory");
    free(ord);
    if (rc == 0 && !ctl->json && strcmp(svg, "-") != 0)
      printf("map of %zu segments written to %s\n", m.n, svg);
  } else if (rc == 0 && !ctl->json) {
    view_text(&m, &t);
  }
  view_map_free(&m);
  if (rc == 0 && fflush(stdout) != 0)
    rc = gmb__ctl_fail(CTL_EXIT_FAIL, "cannot write the output");
  return rc;
}

/* --- metrics -------------------------------------------------------------- */

int gmb__ctl_metrics(struct ctl *ctl, const struct ctl_verb *v, int argc,
                     char **argv) {
  int rc = gmb__ctl_no_args(v, argc, argv);
  if (rc) return rc;
  struct wire_request req = {.kind = WIRE_ADMIN_METRICS};
  struct wire_reply rep;
  rc = gmb__ctl_call(ctl, v->name, &req, WIRE_ADMIN_METRICS, &rep);
  if (rc) return rc;
  if (ctl->json) {
    json_t *j = json_pack("{s:s, s:s}", "format", "prometheus-text/0.0.4",
                          "text", rep.u.metrics.text);
    gmb__wire_reply_clear(&rep);
    return j ? gmb__ctl_json_print(j)
             : gmb__ctl_fail(CTL_EXIT_FAIL, "out of memory");
  }
  fputs(rep.u.metrics.text, stdout);
  gmb__wire_reply_clear(&rep);
  return fflush(stdout) == 0 ? 0
                             : gmb__ctl_fail(CTL_EXIT_FAIL,
                                             "cannot write the output");
}
