/*
 * test_observe.c - the operator's views of a real broker: `gmbctl snapshot`
 * against its documented shape (docs/snapshot.md), `gmbctl map` as text and
 * SVG, `gmbctl metrics` parsed line by line against the names of
 * docs/metrics.md and against the admin status, and the HTTP endpoint
 * scraped over TCP.
 *
 * The scene: three tenants on a 256 MiB host device with compaction off,
 * so that what was made stays as it was made: large pinned and movable
 * allocations, small ones of both kinds with every third freed (holes),
 * two movable allocations held locked by this process, and one request
 * refused by its tenant's quota.
 */
#include <arpa/inet.h>
#include <check.h>
#include <ctype.h>
#include <jansson.h>
#include <math.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "gmb.h"
#include "harness.h"
#include "wire.h"

#define KIB (UINT64_C(1) << 10)
#define MIB (UINT64_C(1) << 20)
#define OUT_CAP (512 * 1024)
#define MAX_IDS 256

static const char *tenant_names[3] = {"llm-a", "train-b", "batch-c"};

struct scene {
  struct harness_broker b;
  gmb_client *c[3];
  gmb_id ids[MAX_IDS]; /* live allocations made here */
  int movable[MAX_IDS];
  int locked[MAX_IDS];
  int n;
  int alloc_calls; /* every gmb_alloc, refused ones included */
  int quota_refusals;
};

static char out[OUT_CAP];

static void scene_alloc(struct scene *s, int t, uint64_t size, unsigned flags) {
  gmb_id id = 0;
  s->alloc_calls++;
  int rc = gmb_alloc(s->c[t], size, flags, &id);
  ck_assert_msg(rc == 0, "alloc %llu for %s: %s", (unsigned long long)size,
                tenant_names[t], gmb_last_error(s->c[t]));
  ck_assert_int_lt(s->n, MAX_IDS);
  s->ids[s->n] = id;
  /* A large request is pinned whatever it asks (pool.h rule 1). */
  s->movable[s->n] = (flags & GMB_MOVABLE) != 0 && size <= MIB;
  s->locked[s->n] = 0;
  s->n++;
}

/* Frees every third allocation of tenant t made since index `from`. */
static void scene_holes(struct scene *s, int t, int from) {
  int k = 0;
  for (int i = from; i < s->n; i++) {
    if (k++ % 3 != 1) continue;
    ck_assert_int_eq(gmb_free(s->c[t], s->ids[i]), 0);
    s->ids[i] = 0;
  }
}

static void scene_lock(struct scene *s, int t, int i) {
  void *p = NULL;
  ck_assert(s->movable[i] && s->ids[i]);
  ck_assert_int_eq(gmb_lock(s->c[t], s->ids[i], &p), 0);
  ck_assert_ptr_nonnull(p);
  s->locked[i] = 1;
}

static void scene_start(struct scene *s, const char *extra_broker_conf) {
  memset(s, 0, sizeof *s);
  char conf[1024];
  snprintf(conf, sizeof conf,
           "[broker]\ncompaction = off\n%s"
           "[tenant:llm-a]\nquota = 160MiB\n"
           "[tenant:train-b]\nquota = 64MiB\nreserve = 8MiB\n"
           "[tenant:batch-c]\nquota = 16MiB\n",
           extra_broker_conf ? extra_broker_conf : "");
  harness_broker_start(&s->b, "host:256MiB", conf);
  for (int t = 0; t < 3; t++) {
    int rc = gmb_connect(s->b.endpoint, tenant_names[t], &s->c[t]);
    ck_assert_msg(rc == 0, "connect %s: %s", tenant_names[t],
                  gmb_last_error(NULL));
  }
  /* llm-a: large pinned weights, large movable buffers, small of both. */
  scene_alloc(s, 0, 24 * MIB, 0);
  scene_alloc(s, 0, 6 * MIB, GMB_MOVABLE);
  scene_alloc(s, 0, 6 * MIB, GMB_MOVABLE);
  scene_alloc(s, 0, 3 * MIB + 512 * KIB, 0);
  int from = s->n;
  for (int i = 0; i < 18; i++)
    scene_alloc(s, 0, (i % 4 + 1) * 128 * KIB, i % 3 ? GMB_MOVABLE : 0);
  scene_holes(s, 0, from);
  scene_lock(s, 0, from + 2); /* movable, and never a hole */
  /* train-b: movable activations with holes. */
  scene_alloc(s, 1, 16 * MIB, GMB_MOVABLE);
  scene_alloc(s, 1, 4 * MIB, 0);
  from = s->n;
  for (int i = 0; i < 12; i++)
    scene_alloc(s, 1, 512 * KIB, GMB_MOVABLE);
  scene_holes(s, 1, from);
  scene_lock(s, 1, from); /* index 0 of the run is never a hole */
  /* batch-c: many small pinned pieces, then a request over its quota. */
  from = s->n;
  for (int i = 0; i < 20; i++) scene_alloc(s, 2, 96 * KIB, 0);
  scene_holes(s, 2, from);
  gmb_id id;
  s->alloc_calls++;
  int rc = gmb_alloc(s->c[2], 32 * MIB, 0, &id);
  ck_assert_int_eq(rc, GMB_E_QUOTA);
  s->quota_refusals++;
}

static void scene_stop(struct scene *s) {
  for (int i = 0; i < s->n; i++)
    if (s->locked[i]) {
      int t = -1;
      for (int k = 0; k < 3 && t < 0; k++)
        if (gmb_unlock(s->c[k], s->ids[i]) == 0) t = k;
      ck_assert_int_ge(t, 0);
    }
  for (int t = 0; t < 3; t++) gmb_disconnect(s->c[t]);
  harness_broker_stop(&s->b);
}

static int gmbctl(const struct scene *s, const char *a1, const char *a2,
                  const char *a3, const char *a4) {
  return harness_ctl(&s->b, out, sizeof out, a1, a2, a3, a4, NULL);
}

static void status_of(const struct scene *s, struct wire_reply *rep) {
  int rc = harness_admin_status(&s->b, rep);
  ck_assert_msg(rc == 0, "admin status: %s", gmb_err_name(rc));
}

static const struct wire_tenant_row *row_of(const struct wire_reply *st,
                                            const char *name) {
  for (size_t i = 0; i < st->u.admin_status.n_tenants; i++)
    if (strcmp(st->u.admin_status.tenants[i].name, name) == 0)
      return &st->u.admin_status.tenants[i];
  ck_abort_msg("tenant %s missing from the status", name);
  return NULL;
}

static json_int_t jint(json_t *o, const char *key) {
  json_t *v = json_object_get(o, key);
  ck_assert_msg(json_is_integer(v), "\"%s\" is not an integer", key);
  return json_integer_value(v);
}

/* --- snapshot -------------------------------------------------------------- */

START_TEST(snapshot_json_matches_documented_shape) {
  struct scene s;
  scene_start(&s, NULL);
  char path[160];
  snprintf(path, sizeof path, "%s/snap.json", s.b.dir);
  int rc = gmbctl(&s, "snapshot", path, NULL, NULL);
  ck_assert_msg(rc == 0, "gmbctl snapshot: %d: %s", rc, out);
  struct wire_reply st;
  status_of(&s, &st);

  json_error_t jerr;
  json_t *j = json_load_file(path, 0, &jerr);
  ck_assert_msg(j != NULL, "snapshot is not JSON: %s line %d", jerr.text,
                jerr.line);
  ck_assert_str_eq(json_string_value(json_object_get(j, "format")),
                   "gmb-snapshot/1");
  ck_assert(json_is_string(json_object_get(j, "taken")));
  json_t *status = json_object_get(j, "status");
  ck_assert(json_is_object(status));
  ck_assert_str_eq(json_string_value(json_object_get(status, "device")),
                   st.u.admin_status.device);
  ck_assert_uint_eq(jint(status, "capacity"), st.u.admin_status.capacity);
  ck_assert_uint_eq(jint(status, "in_use"), st.u.admin_status.in_use);
  ck_assert_uint_eq(jint(status, "in_segments"),
                    st.u.admin_status.in_segments);
  ck_assert_int_eq(jint(status, "sessions"), 3);
  ck_assert(json_is_real(json_object_get(status, "fragmentation")));
  ck_assert(json_is_object(json_object_get(status, "compaction")));
  json_t *tenants = json_object_get(status, "tenants");
  /* Ours, and the harness's probe tenant. */
  ck_assert_uint_ge(json_array_size(tenants), 3);
  ck_assert_uint_eq(json_array_size(tenants), st.u.admin_status.n_tenants);

  json_t *segs = json_object_get(j, "segments");
  ck_assert(json_is_array(segs));
  ck_assert_uint_gt(json_array_size(segs), 3);
  uint64_t seg_total = 0, used_total = 0, t_used[3] = {0}, t_segs[3] = {0};
  int seen[MAX_IDS] = {0}, locked_seen = 0, small = 0, large = 0;
  uint64_t prev_id = 0;
  size_t i;
  json_t *seg;
  json_array_foreach(segs, i, seg) {
    json_int_t id = jint(seg, "id"), size = jint(seg, "size");
    ck_assert_uint_gt((uint64_t)id, prev_id); /* in id order */
    prev_id = (uint64_t)id;
    ck_assert_uint_eq((uint64_t)size % (2 * MIB), 0);
    const char *tn = json_string_value(json_object_get(seg, "tenant"));
    ck_assert_ptr_nonnull(tn);
    int t = -1;
    for (int k = 0; k < 3; k++)
      if (strcmp(tn, tenant_names[k]) == 0) t = k;
    ck_assert_msg(t >= 0, "segment %lld of unknown tenant %s", (long long)id,
                  tn);
    json_t *jsmall = json_object_get(seg, "small");
    ck_assert(json_is_boolean(jsmall));
    if (json_is_true(jsmall)) {
      small++;
      ck_assert_uint_eq((uint64_t)size, 2 * MIB);
    } else {
      large++;
    }
    json_t *ranges = json_object_get(seg, "ranges");
    ck_assert_uint_gt(json_array_size(ranges), 0);
    uint64_t at = 0, used = 0;
    size_t k;
    json_t *r;
    json_array_foreach(ranges, k, r) {
      /* Ranges tile the segment: each starts where the last ended. */
      ck_assert_uint_eq((uint64_t)jint(r, "offset"), at);
      uint64_t rs = (uint64_t)jint(r, "size");
      ck_assert_uint_gt(rs, 0);
      ck_assert_uint_eq(rs % 512, 0);
      at += rs;
      const char *state = json_string_value(json_object_get(r, "state"));
      ck_assert_ptr_nonnull(state);
      if (strcmp(state, "free") == 0 || strcmp(state, "moving") == 0) {
        ck_assert_ptr_null(json_object_get(r, "id"));
        continue;
      }
      ck_assert_str_eq(state, "allocated");
      used += rs;
      json_int_t aid = jint(r, "id");
      ck_assert_int_gt(jint(r, "session"), 0);
      json_t *mv = json_object_get(r, "movable"), *lk = json_object_get(r, "locked");
      ck_assert(json_is_boolean(mv) && json_is_boolean(lk));
      int found = -1;
      for (int n = 0; n < s.n; n++)
        if (s.ids[n] == (gmb_id)aid) found = n;
      ck_assert_msg(found >= 0, "allocation %lld was not made, or was freed",
                    (long long)aid);
      /* A large allocation's tail: counted with its pages. */
      json_t *tl = json_object_get(r, "tail");
      if (tl) {
        ck_assert(json_is_true(tl) && !s.movable[found]);
        continue;
      }
      ck_assert_int_eq(seen[found]++, 0);
      ck_assert_int_eq(json_is_true(mv), s.movable[found]);
      ck_assert_int_eq(json_is_true(lk), s.locked[found]);
      locked_seen += json_is_true(lk);
    }
    ck_assert_uint_eq(at, (uint64_t)size);
    ck_assert_uint_eq((uint64_t)jint(seg, "used"), used);
    seg_total += (uint64_t)size;
    used_total += used;
    t_used[t] += used;
    t_segs[t] += (uint64_t)size;
  }
  ck_assert_int_gt(small, 0);
  ck_assert_int_gt(large, 0);
  for (int n = 0; n < s.n; n++)
    if (s.ids[n]) ck_assert_msg(seen[n] == 1, "allocation %d not in the map", n);
  ck_assert_int_eq(locked_seen, 2);
  ck_assert_uint_eq(seg_total, st.u.admin_status.in_segments);
  ck_assert_uint_eq(used_total, st.u.admin_status.in_use);
  for (int t = 0; t < 3; t++) {
    const struct wire_tenant_row *row = row_of(&st, tenant_names[t]);
    ck_assert_uint_eq(t_used[t], row->used);
    ck_assert_uint_eq(t_segs[t], row->segments);
  }
  size_t nseg = json_array_size(segs);
  json_decref(j);

  /* Without a file: the same JSON on stdout. */
  rc = gmbctl(&s, "snapshot", NULL, NULL, NULL);
  ck_assert_msg(rc == 0, "gmbctl snapshot: %d: %s", rc, out);
  j = json_loads(out, 0, &jerr);
  ck_assert_msg(j != NULL, "stdout is not JSON: %s", jerr.text);
  ck_assert_uint_eq(json_array_size(json_object_get(j, "segments")), nseg);
  json_decref(j);
  gmb__wire_reply_clear(&st);
  scene_stop(&s);
}
END_TEST

/* The same snapshot over the raw admin socket: the wire body decodes. */
START_TEST(snapshot_reply_over_the_wire) {
  struct scene s;
  scene_start(&s, NULL);
  void *sock = harness_raw_open(s.b.admin_endpoint);
  struct wire_request req = {.id = 7, .kind = WIRE_ADMIN_SNAPSHOT};
  struct wire_reply rep;
  ck_assert_int_eq(harness_raw_call(sock, &req, &rep), 0);
  ck_assert_int_eq(rep.status, 0);
  ck_assert_int_eq(rep.kind, WIRE_ADMIN_SNAPSHOT);
  ck_assert_uint_ge(rep.u.snapshot.status.n_tenants, 3);
  uint64_t total = 0;
  for (size_t i = 0; i < rep.u.snapshot.n_segments; i++)
    total += rep.u.snapshot.segments[i].size;
  ck_assert_uint_eq(total, rep.u.snapshot.status.in_segments);
  gmb__wire_reply_clear(&rep);
  harness_raw_close(sock);
  scene_stop(&s);
}
END_TEST

/* --- map -------------------------------------------------------------------- */

START_TEST(map_text_has_a_line_per_segment) {
  struct scene s;
  scene_start(&s, NULL);
  void *sock = harness_raw_open(s.b.admin_endpoint);
  struct wire_request req = {.id = 8, .kind = WIRE_ADMIN_SNAPSHOT};
  struct wire_reply rep;
  ck_assert_int_eq(harness_raw_call(sock, &req, &rep), 0);
  size_t nseg = rep.u.snapshot.n_segments;
  gmb__wire_reply_clear(&rep);
  harness_raw_close(sock);

  int rc = gmbctl(&s, "map", NULL, NULL, NULL);
  ck_assert_msg(rc == 0, "gmbctl map: %d: %s", rc, out);
  size_t bars = 0;
  int upper = 0, lower = 0, locked = 0, dots = 0;
  for (char *line = strtok(out, "\n"); line; line = strtok(NULL, "\n")) {
    char *open = strchr(line, '['), *close = strrchr(line, ']');
    if (!open || !close || !isdigit((unsigned char)line[strspn(line, " ")]))
      continue;
    ck_assert_int_eq(close - open - 1, 64);
    bars++;
    for (char *c = open + 1; c < close; c++) {
      upper |= isupper((unsigned char)*c) != 0;
      lower |= islower((unsigned char)*c) != 0;
      locked |= *c == '#';
      dots |= *c == '.';
    }
    int t = 0;
    for (int k = 0; k < 3; k++) t |= strstr(line, tenant_names[k]) != NULL;
    ck_assert_msg(t, "segment line without its tenant: %s", line);
  }
  ck_assert_uint_eq(bars, nseg);
  ck_assert(upper && lower && locked && dots);
  scene_stop(&s);
}
END_TEST

START_TEST(map_svg_is_an_svg_of_every_tenant) {
  struct scene s;
  scene_start(&s, NULL);
  char path[160];
  snprintf(path, sizeof path, "%s/map.svg", s.b.dir);
  int rc = gmbctl(&s, "map", "--svg", path, NULL);
  ck_assert_msg(rc == 0, "gmbctl map --svg: %d: %s", rc, out);
  FILE *f = fopen(path, "r");
  ck_assert_msg(f != NULL, "%s was not written", path);
  static char svg[2 * OUT_CAP];
  size_t n = fread(svg, 1, sizeof svg - 1, f);
  fclose(f);
  svg[n] = '\0';
  ck_assert_uint_gt(n, 0);
  ck_assert_uint_lt(n, sizeof svg - 1);
  /* The root element is <svg>, after the XML declaration only. */
  const char *p = svg;
  if (strncmp(p, "<?xml", 5) == 0) p = strstr(p, "?>") + 2;
  while (isspace((unsigned char)*p)) p++;
  ck_assert_msg(strncmp(p, "<svg", 4) == 0, "root is not <svg>: %.40s", p);
  ck_assert(strstr(p, "xmlns=\"http://www.w3.org/2000/svg\"") != NULL);
  ck_assert_uint_eq(harness_count(svg, "<svg"), 1);
  ck_assert_uint_eq(harness_count(svg, "</svg>"), 1);
  ck_assert_uint_eq(harness_count(svg, "<g>"), harness_count(svg, "</g>"));
  ck_assert_uint_eq(harness_count(svg, "<text"), harness_count(svg, "</text>"));
  ck_assert_uint_eq(harness_count(svg, "<title>"),
                    harness_count(svg, "</title>"));
  for (int t = 0; t < 3; t++)
    ck_assert_msg(strstr(svg, tenant_names[t]), "no %s", tenant_names[t]);
  ck_assert(strstr(svg, "url(#hatch)") != NULL); /* the locked ones */
  int live = 0;
  for (int i = 0; i < s.n; i++) live += s.ids[i] != 0;
  ck_assert_uint_ge(harness_count(svg, "allocation "), (size_t)live);
  scene_stop(&s);
}
END_TEST

/* --- metrics ---------------------------------------------------------------- */

struct sample {
  char name[96];
  char labels[160]; /* as written, without braces */
  double value;
};

struct samples {
  struct sample s[512];
  int n;
  char typed[128][96];
  int ntyped;
};

/* Parses the exposition text; fails the test on any line that is neither a
 * comment nor `name{labels} value`. */
static void parse_metrics(char *text, struct samples *m) {
  m->n = m->ntyped = 0;
  for (char *line = strtok(text, "\n"); line; line = strtok(NULL, "\n")) {
    if (line[0] == '#') {
      char name[96], type[32];
      if (sscanf(line, "# TYPE %95s %31s", name, type) == 2) {
        ck_assert(strcmp(type, "gauge") == 0 || strcmp(type, "counter") == 0 ||
                  strcmp(type, "histogram") == 0);
        ck_assert_int_lt(m->ntyped, 128);
        snprintf(m->typed[m->ntyped++], 96, "%s", name);
      } else {
        ck_assert_msg(strncmp(line, "# HELP ", 7) == 0, "comment: %s", line);
      }
      continue;
    }
    ck_assert_int_lt(m->n, 512);
    struct sample *s = &m->s[m->n++];
    const char *p = line;
    size_t k = 0;
    ck_assert_msg(isalpha((unsigned char)*p) || *p == '_', "line: %s", line);
    while (isalnum((unsigned char)*p) || *p == '_' || *p == ':') {
      ck_assert_uint_lt(k, sizeof s->name - 1);
      s->name[k++] = *p++;
    }
    s->name[k] = '\0';
    s->labels[0] = '\0';
    if (*p == '{') {
      const char *start = ++p;
      int in_str = 0;
      while (*p && (in_str || *p != '}')) {
        if (in_str && *p == '\\') {
          ck_assert_msg(p[1] == '\\' || p[1] == '"' || p[1] == 'n',
                        "bad escape: %s", line);
          p += 2;
          continue;
        }
        if (*p == '"') in_str = !in_str;
        p++;
      }
      ck_assert_msg(*p == '}', "unclosed labels: %s", line);
      ck_assert_uint_lt((size_t)(p - start), sizeof s->labels);
      memcpy(s->labels, start, (size_t)(p - start));
      s->labels[p - start] = '\0';
      p++;
    }
    ck_assert_msg(*p == ' ', "no value: %s", line);
    char *end;
    s->value = strtod(p + 1, &end);
    ck_assert_msg(*end == '\0' && end != p + 1, "bad value: %s", line);
  }
}

static int find(const struct samples *m, const char *name, const char *labels,
                double *v) {
  for (int i = 0; i < m->n; i++)
    if (strcmp(m->s[i].name, name) == 0 &&
        strcmp(m->s[i].labels, labels ? labels : "") == 0) {
      *v = m->s[i].value;
      return 1;
    }
  return 0;
}

static double must(const struct samples *m, const char *name,
                   const char *labels) {
  double v = 0;
  ck_assert_msg(find(m, name, labels, &v), "no sample %s{%s}", name,
                labels ? labels : "");
  return v;
}

static const char *metric_names[] = {
    "gmb_device_capacity_bytes",     "gmb_device_segment_bytes",
    "gmb_device_used_bytes",         "gmb_device_fragmentation_ratio",
    "gmb_tenant_used_bytes",         "gmb_tenant_quota_bytes",
    "gmb_tenant_reserve_bytes",      "gmb_tenant_peak_bytes",
    "gmb_tenant_segment_bytes",      "gmb_tenant_fragmentation_ratio",
    "gmb_sessions",                  "gmb_tenant_sessions",
    "gmb_alloc_duration_seconds",    "gmb_requests_total",
    "gmb_refusals_total",            "gmb_compaction_moved_bytes_total",
    "gmb_compaction_seconds_total",  "gmb_compaction_runs_total",
    "gmb_wait_queue_length",         "gmb_fd_unread",
    "gmb_fd_kept_channels",          "gmb_fd_refused_total",
    "gmb_fd_unread_limit",           "gmb_tenant_fd_unread",
    "gmb_tenant_fd_kept_channels",   "gmb_tenant_fd_refused_total",
    "gmb_loop_turn_seconds",         "gmb_loop_turn_max_seconds"};

/* Every documented family is typed and has samples; the values agree
 * with the admin status `st` and what scene `sc` did. */
static void check_metrics(char *text, const struct scene *sc,
                          const struct wire_reply *st) {
  static struct samples m;
  parse_metrics(text, &m);
  for (size_t i = 0; i < sizeof metric_names / sizeof metric_names[0]; i++) {
    int typed = 0, sampled = 0;
    for (int k = 0; k < m.ntyped; k++) typed |= !strcmp(m.typed[k], metric_names[i]);
    size_t len = strlen(metric_names[i]);
    for (int k = 0; k < m.n; k++)
      sampled |= strncmp(m.s[k].name, metric_names[i], len) == 0;
    ck_assert_msg(typed && sampled, "metric %s missing", metric_names[i]);
  }
  /* Every sample belongs to a family with a TYPE line. */
  for (int k = 0; k < m.n; k++) {
    int ok = 0;
    for (int t = 0; t < m.ntyped && !ok; t++) {
      size_t len = strlen(m.typed[t]);
      ok = strncmp(m.s[k].name, m.typed[t], len) == 0 &&
           (m.s[k].name[len] == '\0' || !strcmp(m.s[k].name + len, "_bucket") ||
            !strcmp(m.s[k].name + len, "_sum") ||
            !strcmp(m.s[k].name + len, "_count"));
    }
    ck_assert_msg(ok, "sample %s has no TYPE", m.s[k].name);
  }
  const struct wire_admin_status *as = &st->u.admin_status;
  ck_assert_uint_eq((uint64_t)must(&m, "gmb_device_capacity_bytes", NULL),
                    as->capacity);
  ck_assert_uint_eq((uint64_t)must(&m, "gmb_device_segment_bytes", NULL),
                    as->in_segments);
  ck_assert_uint_eq((uint64_t)must(&m, "gmb_device_used_bytes", NULL),
                    as->in_use);
  ck_assert(fabs(must(&m, "gmb_device_fragmentation_ratio", NULL) -
                 as->fragmentation) < 1e-6);
  ck_assert_uint_eq((uint64_t)must(&m, "gmb_sessions", NULL), as->sessions);
  ck_assert_uint_eq((uint64_t)must(&m, "gmb_wait_queue_length", NULL), 0);
  /* Clients that read their answers: no channel kept, nothing refused
   * (what is unread is seen read at the next look, a count that moves). */
  ck_assert_uint_eq((uint64_t)must(&m, "gmb_fd_kept_channels", NULL),
                    as->fd_kept);
  ck_assert_uint_eq(as->fd_kept, 0);
  ck_assert_uint_eq((uint64_t)must(&m, "gmb_fd_refused_total", NULL),
                    as->fd_refused);
  ck_assert_uint_eq(as->fd_refused, 0);
  ck_assert_uint_eq(
      (uint64_t)must(&m, "gmb_fd_unread_limit", "scope=\"channel\""), 64);
  ck_assert_uint_ge(
      (uint64_t)must(&m, "gmb_fd_unread_limit", "scope=\"uid\""), 64);
  for (int t = 0; t < 3; t++) {
    const struct wire_tenant_row *row = row_of(st, tenant_names[t]);
    char l[96];
    snprintf(l, sizeof l, "tenant=\"%s\"", tenant_names[t]);
    ck_assert_uint_eq((uint64_t)must(&m, "gmb_tenant_used_bytes", l), row->used);
    ck_assert_uint_eq((uint64_t)must(&m, "gmb_tenant_quota_bytes", l), row->quota);
    ck_assert_uint_eq((uint64_t)must(&m, "gmb_tenant_peak_bytes", l), row->peak);
    ck_assert_uint_eq((uint64_t)must(&m, "gmb_tenant_segment_bytes", l),
                      row->segments);
    ck_assert_uint_eq((uint64_t)must(&m, "gmb_tenant_sessions", l), 1);
    ck_assert(fabs(must(&m, "gmb_tenant_fragmentation_ratio", l) -
                   row->fragmentation) < 1e-6);
  }
  ck_assert_uint_eq(
      (uint64_t)must(&m, "gmb_tenant_reserve_bytes", "tenant=\"train-b\""),
      8 * MIB);
  /* Every allocation request was answered at once: counted and timed. */
  double allocs = must(&m, "gmb_requests_total", "kind=\"alloc\"");
  ck_assert_int_eq((int)allocs, sc->alloc_calls);
  /* Ours and the harness's probe connection. */
  ck_assert_int_ge((int)must(&m, "gmb_requests_total", "kind=\"hello\""), 3);
  ck_assert_int_eq((int)must(&m, "gmb_refusals_total", "reason=\"quota\""),
                   sc->quota_refusals);
  ck_assert_int_eq((int)must(&m, "gmb_refusals_total", "reason=\"nomem\""), 0);
  ck_assert_int_eq((int)must(&m, "gmb_alloc_duration_seconds_count", NULL),
                   (int)allocs);
  ck_assert(must(&m, "gmb_alloc_duration_seconds_sum", NULL) > 0);
  double prev = 0;
  int buckets = 0;
  for (int k = 0; k < m.n; k++) {
    if (strcmp(m.s[k].name, "gmb_alloc_duration_seconds_bucket")) continue;
    ck_assert(m.s[k].value >= prev); /* cumulative */
    prev = m.s[k].value;
    buckets++;
  }
  ck_assert_int_gt(buckets, 5);
  ck_assert(must(&m, "gmb_alloc_duration_seconds_bucket", "le=\"+Inf\"") ==
            allocs);
  ck_assert_int_eq((int)must(&m, "gmb_compaction_runs_total", NULL), 0);
  /* The loop's turns: some were counted (the scene's requests were read
   * and answered in turns), and the figures agree with each other, the
   * longest no shorter than the mean and no longer than the sum; what
   * the turns took is not checked (no test asserts a time). */
  double turns = must(&m, "gmb_loop_turn_seconds_count", NULL);
  double turn_sum = must(&m, "gmb_loop_turn_seconds_sum", NULL);
  double turn_max = must(&m, "gmb_loop_turn_max_seconds", NULL);
  ck_assert_msg(turns >= 1, "%g turns", turns);
  /* (The text gives 9 significant digits: equal figures may differ in the
   * last.) */
  ck_assert_msg(turn_max <= turn_sum * (1 + 1e-8) &&
                    turn_max * turns >= turn_sum * (1 - 1e-8),
                "longest turn %g s of %g turns, %g s", turn_max, turns,
                turn_sum);
  ck_assert(must(&m, "gmb_loop_turn_seconds_bucket", "le=\"+Inf\"") ==
            turns);
}

START_TEST(metrics_text_parses_and_agrees_with_status) {
  struct scene s;
  scene_start(&s, NULL);
  struct wire_reply st;
  status_of(&s, &st);
  int rc = gmbctl(&s, "metrics", NULL, NULL, NULL);
  ck_assert_msg(rc == 0, "gmbctl metrics: %d: %s", rc, out);
  check_metrics(out, &s, &st);
  gmb__wire_reply_clear(&st);
  scene_stop(&s);
}
END_TEST

/* --- HTTP -------------------------------------------------------------------- */

struct http_wait {
  int port;
  char *body;
};

static int http_ready(void *arg) {
  struct http_wait *w = arg;
  return harness_http_get(w->port, "GET", "/metrics", w->body, OUT_CAP) == 200;
}

START_TEST(http_endpoint_serves_metrics) {
  int port = harness_free_port();
  char extra[96];
  snprintf(extra, sizeof extra,
           "metrics_listen = 127.0.0.1:%d\nmetrics_tenants = yes\n", port);
  struct scene s;
  scene_start(&s, extra);
  char *log = harness_broker_log(&s.b);
  ck_assert_msg(strstr(log, "serving metrics on http://") != NULL,
                "the broker did not say it serves metrics");
  free(log);
  struct http_wait w = {port, out};
  ck_assert_msg(harness_poll_until(http_ready, &w, HARNESS_WAIT_MS),
                "GET /metrics never answered 200");
  /* The loop publishes about once a second: wait for a text that has seen
   * every request of the scene, then compare it with the status. */
  struct wire_reply st;
  status_of(&s, &st);
  char want[64];
  snprintf(want, sizeof want, "gmb_requests_total{kind=\"alloc\"} %d\n",
           s.alloc_calls);
  for (int i = 0; i < 50 && !strstr(out, want); i++) {
    harness_sleep_ms(100);
    ck_assert_int_eq(harness_http_get(port, "GET", "/metrics", out, OUT_CAP), 200);
  }
  check_metrics(out, &s, &st);
  gmb__wire_reply_clear(&st);
  static char body[4096];
  ck_assert_int_eq(harness_http_get(port, "GET", "/other", body, sizeof body), 404);
  ck_assert_int_eq(harness_http_get(port, "POST", "/metrics", body, sizeof body), 405);
  scene_stop(&s);
}
END_TEST

/* A request that waited is counted when it is answered: here one that
 * timed out, so it shows as an alloc request and a timeout refusal. */
START_TEST(metrics_count_waited_requests) {
  struct harness_broker b;
  harness_broker_start(&b, "host:16MiB", NULL);
  gmb_client *c = harness_connect_ok(&b, "waiter");
  gmb_id big = 0, more = 0;
  ck_assert_int_eq(gmb_alloc(c, 12 * MIB, 0, &big), 0);
  ck_assert_int_eq(gmb_alloc_wait(c, 8 * MIB, 0, 100, &more), GMB_E_TIMEOUT);
  static char text[65536];
  int rc = harness_ctl(&b, text, sizeof text, "metrics", NULL);
  ck_assert_msg(rc == 0, "gmbctl metrics: %d: %s", rc, text);
  ck_assert_msg(strstr(text, "gmb_requests_total{kind=\"alloc\"} 2\n"),
                "%s", text);
  ck_assert_msg(strstr(text, "gmb_refusals_total{reason=\"timeout\"} 1\n"),
                "%s", text);
  ck_assert_msg(strstr(text, "gmb_alloc_duration_seconds_count 2\n"), "%s",
                text);
  ck_assert_int_eq(gmb_free(c, big), 0);
  gmb_disconnect(c);
  harness_broker_stop(&b);
}
END_TEST

int main(void) {
  return harness_main(HARNESS_SUITE(
      "observe", "observe", 0,
      snapshot_json_matches_documented_shape,
      snapshot_reply_over_the_wire,
      map_text_has_a_line_per_segment,
      map_svg_is_an_svg_of_every_tenant,
      metrics_text_parses_and_agrees_with_status,
      http_endpoint_serves_metrics,
      metrics_count_waited_requests));
}
