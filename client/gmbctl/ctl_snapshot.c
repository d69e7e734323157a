/*
 * ctl_snapshot.c - a snapshot of the broker's memory read page by page
 * (docs/snapshot.md), and `gmbctl snapshot`, which writes it as JSON while
 * the pages arrive.
 *
 * The reader (gmb__ctl_pages) asks for the first page, then for the page
 * at each reply's next cursor until a reply names none, and hands every
 * page to its sinks before it asks for the next: it holds one page, never
 * the snapshot.  A segment whose ranges the broker split between pages is
 * given to the sinks as one segment (begun, continued, ended).  The pool's
 * change counter, the same on every page or not, says whether the pages
 * show one instant ("consistent").
 *
 * The JSON writer prints the document as it goes: the header and the
 * status (first page), then each segment and its ranges, one range a
 * line, then "pages" and "consistent" at the end, where they are known.
 * It relies on nothing the broker says to stay valid JSON: strings are
 * escaped byte by byte.
 *
 * Invariants: the cursor moves forward at every page, or the reader stops
 * with an error (a broker that answered otherwise would loop it for
 * ever); a sink sees begin, then more zero or more times, then end, for
 * each segment, in segment id order.
 */
#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ctl.h"
#include "gmb.h"
#include "util.h"
#include "wire.h"

#define CTL_SNAPSHOT_FORMAT "gmb-snapshot/1"

/* --- reading pages -------------------------------------------------------- */

/* Each of these hands one event to every sink that takes it, until one
 * fails; 0 or that sink's code. */
static int pages_status(const struct ctl_pages_sink *k, size_t n,
                        const struct wire_admin_status *st) {
  int rc = 0;
  for (size_t i = 0; i < n && rc == 0; i++)
    if (k[i].status) rc = k[i].status(k[i].ctx, st);
  return rc;
}

static int pages_begin(const struct ctl_pages_sink *k, size_t n,
                       const struct wire_segment_info *s, int split) {
  int rc = 0;
  for (size_t i = 0; i < n && rc == 0; i++)
    if (k[i].begin) rc = k[i].begin(k[i].ctx, s, split);
  return rc;
}

static int pages_more(const struct ctl_pages_sink *k, size_t n,
                      const struct wire_segment_info *s) {
  int rc = 0;
  for (size_t i = 0; i < n && rc == 0; i++)
    if (k[i].more) rc = k[i].more(k[i].ctx, s);
  return rc;
}

static int pages_end(const struct ctl_pages_sink *k, size_t n) {
  int rc = 0;
  for (size_t i = 0; i < n && rc == 0; i++)
    if (k[i].end) rc = k[i].end(k[i].ctx);
  return rc;
}

static int pages_finish(const struct ctl_pages_sink *k, size_t n,
                        const struct ctl_pages_total *t) {
  int rc = 0;
  for (size_t i = 0; i < n && rc == 0; i++)
    if (k[i].finish) rc = k[i].finish(k[i].ctx, t);
  return rc;
}

int gmb__ctl_pages(struct ctl *ctl, const char *verb, uint32_t limit,
                   const struct ctl_pages_sink *sinks, size_t n_sinks,
                   struct ctl_pages_total *total) {
  memset(total, 0, sizeof *total);
  total->consistent = 1;
  uint64_t seg = 0, off = 0, changes = 0, open_id = 0;
  int open = 0, rc = 0;
  do {
    struct wire_request req = {.kind = WIRE_ADMIN_SNAPSHOT};
    req.u.admin_snapshot.segment = seg;
    req.u.admin_snapshot.offset = off;
    req.u.admin_snapshot.limit = limit;
    struct wire_reply rep;
    rc = gmb__ctl_call(ctl, verb, &req, WIRE_ADMIN_SNAPSHOT, &rep);
    if (rc) return rc;
    if (total->pages == 0) {
      if (!rep.u.snapshot.has_status) {
        gmb__wire_reply_clear(&rep);
        return gmb__ctl_fail(CTL_EXIT_FAIL, "%s: the broker's first page "
                             "has no status", verb);
      }
      changes = rep.u.snapshot.changes;
      rc = pages_status(sinks, n_sinks, &rep.u.snapshot.status);
    } else if (rep.u.snapshot.changes != changes) {
      total->consistent = 0;
    }
    total->pages++;
    size_t n = rep.u.snapshot.n_segments;
    for (size_t i = 0; i < n && rc == 0; i++) {
      const struct wire_segment_info *s = &rep.u.snapshot.segments[i];
      /* The segment the last page stopped in goes on; any other segment
       * ends it (it may have been released between the pages). */
      int cont = open && i == 0 && s->id == open_id;
      if (open && !cont) {
        rc = pages_end(sinks, n_sinks);
        open = 0;
      }
      if (!cont) {
        int split = i + 1 == n && rep.u.snapshot.next_segment == s->id;
        total->segments++;
        if (rc == 0) rc = pages_begin(sinks, n_sinks, s, split);
        open = 1;
        open_id = s->id;
      } else {
        rc = pages_more(sinks, n_sinks, s);
      }
      for (size_t k = 0; k < s->n_ranges; k++)
        total->allocations += s->ranges[k].id != 0;
    }
    uint64_t nseg = rep.u.snapshot.next_segment;
    uint64_t noff = rep.u.snapshot.next_offset;
    gmb__wire_reply_clear(&rep);
    if (rc) return rc;
    if (nseg && (nseg < seg || (nseg == seg && noff <= off)))
      return gmb__ctl_fail(CTL_EXIT_FAIL, "%s: the broker's next page "
                           "(segment %llu, offset %llu) does not come after "
                           "this one", verb, (unsigned long long)nseg,
                           (unsigned long long)noff);
    seg = nseg;
    off = noff;
  } while (seg);
  if (open) rc = pages_end(sinks, n_sinks);
  if (rc == 0) rc = pages_finish(sinks, n_sinks, total);
  return rc;
}

int gmb__ctl_page_opt(const struct ctl_verb *v, int argc, char **argv,
                      int *i, uint32_t *limit) {
  const char *val = NULL;
  if (strcmp(argv[*i], "--page") == 0) {
    if (*i + 1 >= argc)
      return -gmb__ctl_fail(CTL_EXIT_USAGE, "%s: --page needs a number of "
                            "ranges", v->name);
    val = argv[++*i];
  } else if (strncmp(argv[*i], "--page=", 7) == 0) {
    val = argv[*i] + 7;
  } else {
    return 0;
  }
  char *end;
  errno = 0;
  unsigned long long n = strtoull(val, &end, 10);
  if (*val < '0' || *val > '9' || *end || errno || n == 0 || n > UINT32_MAX)
    return -gmb__ctl_fail(CTL_EXIT_USAGE, "%s: --page %s: want a number of "
                          "ranges from 1 to %u (the broker caps it)", v->name,
                          val, UINT32_MAX);
  *limit = (uint32_t)n;
  return 1;
}

/* --- the JSON writer -------------------------------------------------------- */

/* A JSON string, escaped byte by byte: a tenant name is plain ASCII when
 * the broker made it, and stays valid JSON when it is not. */
static void json_str(FILE *f, const char *s) {
  fputc('"', f);
  for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
    if (*p == '"' || *p == '\\')
      fprintf(f, "\\%c", *p);
    else if (*p < 0x20 || *p >= 0x7f)
      fprintf(f, "\\u%04x", *p);
    else
      fputc(*p, f);
  }
  fputc('"', f);
}

static int json_w_status(void *ctx, const struct wire_admin_status *st) {
  struct ctl_json_writer *w = ctx;
  char when[40];
  time_t now = time(NULL);
  struct tm tm;
  gmtime_r(&now, &tm);
  strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%SZ", &tm);
  /* The status as `gmbctl status --json` shows it, field for field. */
  json_t *j = gmb__ctl_json_status(st);
  char *text = j ? json_dumps(j, JSON_INDENT(2) | JSON_PRESERVE_ORDER) : NULL;
  json_decref(j);
  if (text == NULL) return gmb__ctl_fail(CTL_EXIT_FAIL, "out of memory");
  fprintf(w->f, "{\n  \"format\": \"%s\",\n  \"taken\": \"%s\",\n  \"status\": ",
          CTL_SNAPSHOT_FORMAT, when);
  /* Nested one level down: two more spaces on each of its lines. */
  for (const char *p = text; *p; p++) {
    fputc(*p, w->f);
    if (*p == '\n') fputs("  ", w->f);
  }
  free(text);
  fputs(",\n  \"segments\": [", w->f);
  return 0;
}

static void json_w_ranges(struct ctl_json_writer *w,
                          const struct wire_segment_info *s) {
  for (size_t k = 0; k < s->n_ranges; k++) {
    const struct wire_range_info *r = &s->ranges[k];
    const char *state = r->id ? "allocated" : r->locked ? "moving" : "free";
    fprintf(w->f, "%s\n       {\"offset\": %llu, \"size\": %llu, "
            "\"state\": \"%s\"", w->ranges++ ? "," : "",
            (unsigned long long)r->offset, (unsigned long long)r->size,
            state);
    if (r->id)
      fprintf(w->f, ", \"id\": %llu, \"movable\": %s, \"locked\": %s, "
              "\"session\": %llu", (unsigned long long)r->id,
              r->movable ? "true" : "false", r->locked ? "true" : "false",
              (unsigned long long)r->session);
    if (r->tail) fprintf(w->f, ", \"tail\": true");
    fputc('}', w->f);
  }
}

static int json_w_begin(void *ctx, const struct wire_segment_info *s,
                        int split) {
  struct ctl_json_writer *w = ctx;
  /* A segment whole in its page: its used bytes are its ranges' (a broker
   * before paging does not send them); a split one's, the broker's. */
  uint64_t used = s->used;
  if (!split) {
    used = 0;
    for (size_t k = 0; k < s->n_ranges; k++)
      if (s->ranges[k].id) used += s->ranges[k].size;
  }
  fprintf(w->f, "%s\n    {\"id\": %llu, \"size\": %llu, \"tenant\": ",
          w->segments++ ? "," : "", (unsigned long long)s->id,
          (unsigned long long)s->size);
  json_str(w->f, s->tenant);
  fprintf(w->f, ", \"small\": %s, \"used\": %llu,\n     \"ranges\": [",
          s->small ? "true" : "false", (unsigned long long)used);
  w->ranges = 0;
  json_w_ranges(w, s);
  return ferror(w->f) ? -1 : 0;
}

static int json_w_more(void *ctx, const struct wire_segment_info *s) {
  struct ctl_json_writer *w = ctx;
  json_w_ranges(w, s);
  return ferror(w->f) ? -1 : 0;
}

static int json_w_end(void *ctx) {
  struct ctl_json_writer *w = ctx;
  fputs("\n     ]}", w->f);
  return ferror(w->f) ? -1 : 0;
}

static int json_w_finish(void *ctx, const struct ctl_pages_total *t) {
  struct ctl_json_writer *w = ctx;
  fprintf(w->f, "%s],\n  \"pages\": %u,\n  \"consistent\": %s\n}\n",
          w->segments ? "\n  " : "", t->pages,
          t->consistent ? "true" : "false");
  return ferror(w->f) ? -1 : 0;
}

void gmb__ctl_json_writer(struct ctl_json_writer *w, FILE *f,
                          struct ctl_pages_sink *sink) {
  memset(w, 0, sizeof *w);
  w->f = f;
  *sink = (struct ctl_pages_sink){.status = json_w_status,
                                  .begin = json_w_begin,
                                  .more = json_w_more,
                                  .end = json_w_end,
                                  .finish = json_w_finish,
                                  .ctx = w};
}

/* --- gmbctl snapshot [--page N] [FILE] ------------------------------------- */

/* The pages into `f`; 0, or the exit status after saying why (a write that
 * failed is CTL_EXIT_FAIL with `what` named). */
static int snapshot_to(struct ctl *ctl, const char *verb, uint32_t limit,
                       FILE *f, const char *what,
                       struct ctl_pages_total *total) {
  struct ctl_json_writer w;
  struct ctl_pages_sink sink;
  gmb__ctl_json_writer(&w, f, &sink);
  int rc = gmb__ctl_pages(ctl, verb, limit, &sink, 1, total);
  if (rc < 0 || (rc == 0 && fflush(f) != 0) || ferror(f))
    return gmb__ctl_fail(CTL_EXIT_FAIL, "cannot write %s: %s", what,
                         strerror(errno ? errno : EIO));
  return rc;
}

/* gmb__ctl_write_atomic's writer for `gmbctl snapshot FILE`. */
struct snapshot_file {
  struct ctl *ctl;
  const char *verb;
  uint32_t limit;
  const char *path;
  struct ctl_pages_total *total;
};

static int snapshot_file_fn(FILE *f, void *ctx) {
  struct snapshot_file *sf = ctx;
  return snapshot_to(sf->ctl, sf->verb, sf->limit, f, sf->path, sf->total);
}

int gmb__ctl_snapshot(struct ctl *ctl, const struct ctl_verb *v, int argc,
                      char **argv) {
  const char *path = NULL;
  uint32_t limit = 0;
  for (int i = 0; i < argc; i++) {
    int rc = gmb__ctl_page_opt(v, argc, argv, &i, &limit);
    if (rc < 0) return -rc;
    if (rc > 0) continue;
    if (path || (argv[i][0] == '-' && argv[i][1]))
      return gmb__ctl_fail(CTL_EXIT_USAGE, "%s: unexpected argument '%s' "
                           "(usage: gmbctl %s)", v->name, argv[i], v->usage);
    path = argv[i];
  }
  if (path && strcmp(path, "-") == 0) path = NULL;
  struct ctl_pages_total total;
  if (path == NULL) return snapshot_to(ctl, v->name, limit, stdout, "the output",
                                       &total);
  /* Through a temporary file and a rename, so a reader never sees half a
   * snapshot, nor a snapshot that failed halfway. */
  struct snapshot_file sf = {ctl, v->name, limit, path, &total};
  int rc = gmb__ctl_write_atomic(path, snapshot_file_fn, &sf);
  if (rc) return rc;
  if (ctl->json)
    return gmb__ctl_json_print(json_pack(
        "{s:s, s:I, s:I, s:i, s:b}", "file", path, "segments",
        (json_int_t)total.segments, "allocations",
        (json_int_t)total.allocations, "pages", (int)total.pages,
        "consistent", total.consistent));
  printf("snapshot of %llu segments, %llu allocations written to %s",
         (unsigned long long)total.segments,
         (unsigned long long)total.allocations, path);
  if (!total.consistent)
    printf(" (%u pages; the broker's memory changed while they were read)",
           total.pages);
  putchar('\n');
  return 0;
}
