/*
 * gmbctl.c - the operator's command line: a client of the broker's admin
 * socket (ipc://RUN_DIR/admin.sock).
 *
 * Each verb is one entry in ctl_verbs[] and one function; main() only
 * parses the options every verb shares, finds the verb and runs it.  A verb
 * sends requests through gmb__ctl_call(), which opens the admin socket
 * (client/admin/admin_rpc.c) on first use, with a 5-second timeout, and
 * prints the one-line explanation of every failure.  Output is for
 * people by default and JSON (jansson) with --json; sizes read and print as
 * "512MiB".
 *
 * Exit status: 0 success; 1 the broker could not be reached or refused;
 * 2 a usage error or a verb this broker does not implement yet.  Every
 * failure is one line on stderr, "gmbctl: reason".
 */
#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "admin_rpc.h"
#include "ctl.h"
#include "cudrv.h"
#include "endpoint.h"
#include "gmb.h"
#include "util.h"
#include "wire.h"

int gmb__ctl_fail(int code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fputs("gmbctl: ", stderr);
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
  return code;
}

/* --- talking to the broker ------------------------------------------------- */

/* Opens the admin socket on the first call; every failure is one line
 * "gmbctl: VERB: reason" (the reasons are admin_rpc.c's). */
int gmb__ctl_call(struct ctl *ctl, const char *verb, struct wire_request *req,
                  enum wire_kind expect, struct wire_reply *rep) {
  char why[ADMIN_RPC_WHY_MAX];
  if (ctl->rpc == NULL) {
    char endpoint[300], hint[400];
    if (gmb__endpoint_default(ctl->run_dir, "admin.sock", endpoint,
                              sizeof endpoint) == NULL)
      return gmb__ctl_fail(CTL_EXIT_FAIL, "run directory name too long");
    snprintf(hint, sizeof hint, "is gmb-broker running? run dir %s",
             ctl->run_dir);
    if (gmb__admin_rpc_open(endpoint, CTL_TIMEOUT_MS, hint, &ctl->rpc, why,
                            sizeof why) != 0)
      return gmb__ctl_fail(CTL_EXIT_FAIL, "%s", why);
  }
  if (gmb__admin_rpc_call(ctl->rpc, req, expect, ctl->timeout_ms, rep, why,
                          sizeof why) != 0)
    return gmb__ctl_fail(CTL_EXIT_FAIL, "%s: %s", verb, why);
  return 0;
}

/* --- output ------------------------------------------------------------------ */

int gmb__ctl_json_print(json_t *j) {
  int rc = json_dumpf(j, stdout, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
  json_decref(j);
  fputc('\n', stdout);
  return rc == 0 ? 0 : gmb__ctl_fail(CTL_EXIT_FAIL, "cannot write the output");
}

/* A tenant's sleep and wake figures (docs/sleep.md). */
static json_t *ctl_json_sleep(const struct wire_tenant_row *t) {
  json_t *j = json_pack("{s:I, s:I, s:i, s:I, s:I, s:I, s:f, s:I}",
                        "host_bytes", (json_int_t)t->host_bytes,
                        "paused_bytes", (json_int_t)t->paused_bytes,
                        "paused_tags", (int)t->paused_tags, "host_quota",
                        (json_int_t)t->host_quota, "pauses",
                        (json_int_t)t->pauses, "resumes",
                        (json_int_t)t->resumes, "paused_seconds",
                        t->paused_seconds, "sleep_asks",
                        (json_int_t)t->sleep_asks);
  return j;
}

json_t *gmb__ctl_json_tenants(const struct wire_admin_status *st) {
  json_t *arr = json_array();
  for (size_t i = 0; i < st->n_tenants; i++) {
    const struct wire_tenant_row *t = &st->tenants[i];
    json_array_append_new(
        arr, json_pack("{s:s, s:I, s:I, s:I, s:I, s:i, s:I}", "name", t->name,
                       "quota", (json_int_t)t->quota, "used",
                       (json_int_t)t->used, "peak", (json_int_t)t->peak,
                       "segments", (json_int_t)t->segments, "sessions",
                       (int)t->sessions, "allocations",
                       (json_int_t)t->allocations));
    json_t *row = json_array_get(arr, json_array_size(arr) - 1);
    json_object_set_new(row, "free_in_segments",
                        json_integer((json_int_t)t->free_in_segments));
    json_object_set_new(row, "largest_free",
                        json_integer((json_int_t)t->largest_free));
    json_object_set_new(row, "fragmentation", json_real(t->fragmentation));
    json_object_set_new(row, "cached", json_integer((json_int_t)t->cached));
    json_object_set_new(row, "trim_asks",
                        json_integer((json_int_t)t->trim_asks));
    json_object_set_new(row, "trim_ignored",
                        json_integer((json_int_t)t->trim_ignored));
    json_object_set_new(row, "sleep", ctl_json_sleep(t));
    json_object_set_new(row, "vmm", json_integer((json_int_t)t->vmm));
    json_object_set_new(row, "fd_unread",
                        json_integer((json_int_t)t->fd_unread));
    json_object_set_new(row, "fd_kept", json_integer((json_int_t)t->fd_kept));
    json_object_set_new(row, "fd_refused",
                        json_integer((json_int_t)t->fd_refused));
  }
  return arr;
}

json_t *gmb__ctl_json_session(const struct wire_session_row *r) {
  json_t *j = json_pack("{s:I, s:s, s:I, s:i, s:s, s:I, s:I, s:I}", "id",
                        (json_int_t)r->id, "tenant", r->tenant, "uid",
                        (json_int_t)r->uid, "pid", (int)r->pid, "client",
                        r->client, "allocations", (json_int_t)r->allocations,
                        "used", (json_int_t)r->used, "cached",
                        (json_int_t)r->cached);
  json_object_set_new(j, "trim_asks", json_integer((json_int_t)r->trim_asks));
  json_object_set_new(j, "trim_ignored",
                      json_integer((json_int_t)r->trim_ignored));
  json_object_set_new(j, "waiting", json_integer((json_int_t)r->waiting));
  json_object_set_new(j, "paused", json_string(r->paused));
  json_object_set_new(j, "host_bytes", json_integer((json_int_t)r->host_bytes));
  json_object_set_new(j, "paused_bytes",
                      json_integer((json_int_t)r->paused_bytes));
  json_object_set_new(j, "sleep_pausable",
                      json_integer((json_int_t)r->sleep_pausable));
  json_object_set_new(j, "sleep_idle_ms",
                      json_integer((json_int_t)r->sleep_idle_ms));
  json_object_set_new(j, "fd_unread", json_integer((json_int_t)r->fd_unread));
  json_object_set_new(j, "fd_refused",
                      json_integer((json_int_t)r->fd_refused));
  return j;
}

json_t *gmb__ctl_json_status(const struct wire_admin_status *st) {
  json_t *j = json_pack(
      "{s:s, s:I, s:I, s:I, s:I, s:i, s:o}", "device", st->device, "capacity",
      (json_int_t)st->capacity, "in_segments", (json_int_t)st->in_segments,
      "in_use", (json_int_t)st->in_use, "cached", (json_int_t)st->cached,
      "sessions", (int)st->sessions, "tenants", gmb__ctl_json_tenants(st));
  json_object_set_new(j, "largest_free",
                      json_integer((json_int_t)st->largest_free));
  json_object_set_new(j, "fragmentation", json_real(st->fragmentation));
  json_object_set_new(j, "retiring", json_integer((json_int_t)st->retiring));
  json_object_set_new(j, "host_bytes",
                      json_integer((json_int_t)st->host_bytes));
  json_object_set_new(j, "paused_bytes",
                      json_integer((json_int_t)st->paused_bytes));
  json_object_set_new(j, "offload_job_requests",
                      json_integer((json_int_t)st->offload_job_requests));
  json_object_set_new(j, "offload_slices",
                      json_integer((json_int_t)st->offload_slices));
  json_object_set_new(j, "offload_jobs",
                      json_integer((json_int_t)st->offload_jobs));
  json_object_set_new(j, "offload_pauses",
                      json_integer((json_int_t)st->offload_pauses));
  json_object_set_new(j, "compaction", gmb__ctl_json_compact(&st->compaction));
  json_object_set_new(j, "fd_unread", json_integer((json_int_t)st->fd_unread));
  json_object_set_new(j, "fd_kept", json_integer((json_int_t)st->fd_kept));
  json_object_set_new(j, "fd_refused",
                      json_integer((json_int_t)st->fd_refused));
  json_t *rows = json_array();
  for (size_t i = 0; i < st->n_sessions; i++)
    json_array_append_new(rows, gmb__ctl_json_session(&st->session_rows[i]));
  json_object_set_new(j, "session_rows", rows);
  return j;
}

/* Prints a table of `ncols` columns (at most CTL_MAXCOLS): head[] their
 * titles, cells[r * ncols + k] the text of row r, column k.  align[k] is
 * 'l' for names, left-aligned, or 'r' for figures, right-aligned, as `df`
 * does; a left-aligned last column is not padded (free text). */
#define CTL_MAXCOLS 16
#define CTL_CELL 80
static void ctl_table(int ncols, const char *const *head, const char *align,
                      char (*cells)[CTL_CELL], size_t nrows) {
  size_t w[CTL_MAXCOLS];
  if (ncols > CTL_MAXCOLS) ncols = CTL_MAXCOLS;
  for (int k = 0; k < ncols; k++) {
    w[k] = strlen(head[k]);
    for (size_t r = 0; r < nrows; r++)
      if (strlen(cells[r * ncols + k]) > w[k])
        w[k] = strlen(cells[r * ncols + k]);
  }
  for (size_t r = 0; r <= nrows; r++) {
    for (int k = 0; k < ncols; k++) {
      const char *c = r == 0 ? head[k] : cells[(r - 1) * ncols + k];
      const char *sep = k ? "  " : "";
      if (align[k] == 'l' && k == ncols - 1)
        printf("%s%s", sep, c);
      else if (align[k] == 'l')
        printf("%s%-*s", sep, (int)w[k], c);
      else
        printf("%s%*s", sep, (int)w[k], c);
    }
    putchar('\n');
  }
}

#define CTL_COLS 9
#define CTL_ZCOLS 9

/* Tenants that paused tags, hold host bytes, paused or were asked to
 * (a host_quota alone does not count: every tenant the config does not
 * name has default_host_quota's), and sessions that hold paused tags: a
 * second table, printed only when there are some. */
static void ctl_print_sleep(const struct wire_admin_status *st) {
  static const char *const head[CTL_ZCOLS] = {
      "NAME",   "PAUSED-TAGS", "HOST", "GIVEN-BACK", "HOST-QUOTA",
      "PAUSES", "RESUMES",     "PAUSED-S", "SLEEP-ASKS"};
  size_t n = 0;
  char(*cell)[CTL_CELL] =
      calloc((st->n_tenants ? st->n_tenants : 1) * CTL_ZCOLS, sizeof *cell);
  if (cell == NULL) return;
  for (size_t i = 0; i < st->n_tenants; i++) {
    const struct wire_tenant_row *t = &st->tenants[i];
    if (!t->paused_tags && !t->host_bytes && !t->pauses && !t->sleep_asks)
      continue;
    char(*c)[CTL_CELL] = &cell[n++ * CTL_ZCOLS];
    snprintf(c[0], sizeof c[0], "%s", t->name);
    snprintf(c[1], sizeof c[1], "%u", t->paused_tags);
    gmb__size_format(t->host_bytes, c[2], sizeof c[2]);
    gmb__size_format(t->paused_bytes, c[3], sizeof c[3]);
    if (t->host_quota)
      gmb__size_format(t->host_quota, c[4], sizeof c[4]);
    else
      snprintf(c[4], sizeof c[4], "unlimited");
    snprintf(c[5], sizeof c[5], "%llu", (unsigned long long)t->pauses);
    snprintf(c[6], sizeof c[6], "%llu", (unsigned long long)t->resumes);
    snprintf(c[7], sizeof c[7], "%.1f", t->paused_seconds);
    snprintf(c[8], sizeof c[8], "%llu", (unsigned long long)t->sleep_asks);
  }
  if (n) {
    printf("\nsleep and wake (host bytes of paused tags, device bytes they "
           "gave back):\n");
    ctl_table(CTL_ZCOLS, head, "lrrrrrrrr", cell, n);
  }
  free(cell);
  for (size_t i = 0; i < st->n_sessions; i++)
    if (st->session_rows[i].paused[0])
      printf("  session %llu (tenant %s) paused: %s\n",
             (unsigned long long)st->session_rows[i].id,
             st->session_rows[i].tenant, st->session_rows[i].paused);
}

#define CTL_FCOLS 4

/* Tenants whose descriptor channels hold descriptors unread, keep
 * channels of ended sessions or were refused some, and sessions that
 * hold some: a table and lines printed only when there are some. */
static void ctl_print_fds(const struct wire_admin_status *st) {
  static const char *const head[CTL_FCOLS] = {"NAME", "UNREAD", "KEPT",
                                              "REFUSED"};
  size_t n = 0;
  char(*cell)[CTL_CELL] =
      calloc((st->n_tenants ? st->n_tenants : 1) * CTL_FCOLS, sizeof *cell);
  if (cell == NULL) return;
  for (size_t i = 0; i < st->n_tenants; i++) {
    const struct wire_tenant_row *t = &st->tenants[i];
    if (!t->fd_unread && !t->fd_kept && !t->fd_refused) continue;
    char(*c)[CTL_CELL] = &cell[n++ * CTL_FCOLS];
    snprintf(c[0], sizeof c[0], "%s", t->name);
    snprintf(c[1], sizeof c[1], "%llu", (unsigned long long)t->fd_unread);
    snprintf(c[2], sizeof c[2], "%u", t->fd_kept);
    snprintf(c[3], sizeof c[3], "%llu", (unsigned long long)t->fd_refused);
  }
  if (n) {
    printf("\ndescriptor channels (descriptors sent and not seen read, "
           "channels kept for ended sessions, requests refused at a "
           "bound):\n");
    ctl_table(CTL_FCOLS, head, "lrrr", cell, n);
  }
  free(cell);
  for (size_t i = 0; i < st->n_sessions; i++) {
    const struct wire_session_row *r = &st->session_rows[i];
    if (r->fd_unread || r->fd_refused)
      printf("  session %llu (tenant %s): %u descriptors unread, %llu "
             "refused\n", (unsigned long long)r->id, r->tenant, r->fd_unread,
             (unsigned long long)r->fd_refused);
  }
}

/* The tenants of an admin status, as a table. */
static void ctl_print_tenants(const struct wire_admin_status *st) {
  static const char *const head[CTL_COLS] = {
      "NAME",     "QUOTA",    "USED",   "CACHED", "PEAK",
      "SEGMENTS", "SESSIONS", "ALLOCS", "FRAG"};
  size_t n = st->n_tenants;
  char(*cell)[CTL_CELL] = calloc((n ? n : 1) * CTL_COLS, sizeof *cell);
  if (cell == NULL) return;
  for (size_t i = 0; i < n; i++) {
    const struct wire_tenant_row *t = &st->tenants[i];
    char(*c)[CTL_CELL] = &cell[i * CTL_COLS];
    snprintf(c[0], sizeof c[0], "%s", t->name);
    if (t->quota)
      gmb__size_format(t->quota, c[1], sizeof c[1]);
    else
      snprintf(c[1], sizeof c[1], "unlimited");
    gmb__size_format(t->used, c[2], sizeof c[2]);
    /* Of USED: free in its sessions' caches, which they could give back. */
    gmb__size_format(t->cached, c[3], sizeof c[3]);
    gmb__size_format(t->peak, c[4], sizeof c[4]);
    gmb__size_format(t->segments, c[5], sizeof c[5]);
    snprintf(c[6], sizeof c[6], "%u", t->sessions);
    snprintf(c[7], sizeof c[7], "%llu", (unsigned long long)t->allocations);
    /* 1 - largest free range / free bytes inside its segments. */
    snprintf(c[8], sizeof c[8], "%.2f", t->fragmentation);
  }
  ctl_table(CTL_COLS, head, "lrrrrrrrr", cell, n);
  free(cell);
  ctl_print_sleep(st);
  ctl_print_fds(st);
}

#define CTL_SCOLS 10

/* Sessions of an admin status (those of `tenant` only, unless NULL), as a
 * table; the client's free text last.  Returns how many it printed. */
static size_t ctl_print_sessions(const struct wire_admin_status *st,
                                 const char *tenant) {
  static const char *const head[CTL_SCOLS] = {
      "ID",     "TENANT", "UID",       "PID",     "ALLOCS",
      "USED",   "CACHED", "TRIM-ASKS", "IGNORED", "CLIENT"};
  size_t n = 0;
  char(*cell)[CTL_CELL] = calloc((st->n_sessions ? st->n_sessions : 1) * CTL_SCOLS,
                           sizeof *cell);
  if (cell == NULL) return 0;
  for (size_t i = 0; i < st->n_sessions; i++) {
    const struct wire_session_row *r = &st->session_rows[i];
    if (tenant && strcmp(r->tenant, tenant) != 0) continue;
    char(*c)[CTL_CELL] = &cell[n++ * CTL_SCOLS];
    snprintf(c[0], sizeof c[0], "%llu", (unsigned long long)r->id);
    snprintf(c[1], sizeof c[1], "%s", r->tenant);
    snprintf(c[2], sizeof c[2], "%u", r->uid);
    /* 0: the broker cannot see the pid (another PID namespace). */
    if (r->pid > 0)
      snprintf(c[3], sizeof c[3], "%d", (int)r->pid);
    else
      snprintf(c[3], sizeof c[3], "-");
    snprintf(c[4], sizeof c[4], "%llu", (unsigned long long)r->allocations);
    gmb__size_format(r->used, c[5], sizeof c[5]);
    gmb__size_format(r->cached, c[6], sizeof c[6]);
    snprintf(c[7], sizeof c[7], "%llu", (unsigned long long)r->trim_asks);
    snprintf(c[8], sizeof c[8], "%llu", (unsigned long long)r->trim_ignored);
    snprintf(c[9], sizeof c[9], "%s", r->client[0] ? r->client : "-");
  }
  if (n) ctl_table(CTL_SCOLS, head, "rlrrrrrrrl", cell, n);
  free(cell);
  return n;
}

/* --- verbs ------------------------------------------------------------------- */

int gmb__ctl_no_args(const struct ctl_verb *v, int argc, char **argv) {
  if (argc > 0)
    return gmb__ctl_fail(CTL_EXIT_USAGE, "%s: unexpected argument '%s' (usage: "
                    "gmbctl %s)", v->name, argv[0], v->usage);
  return 0;
}

json_t *gmb__ctl_json_compact(const struct wire_compact_stats *c) {
  return json_pack("{s:I, s:I, s:I, s:I, s:I, s:I, s:f, s:I}", "moves",
                   (json_int_t)c->moves, "bytes_moved",
                   (json_int_t)c->bytes_moved, "segments_released",
                   (json_int_t)c->segments_released, "bytes_released",
                   (json_int_t)c->bytes_released, "skipped_locked",
                   (json_int_t)c->skipped_locked, "skipped_pinned",
                   (json_int_t)c->skipped_pinned, "seconds", c->seconds,
                   "runs", (json_int_t)c->runs);
}

/* status and tenants: no arguments, one AdminStatus. */
static int ctl_admin_status(struct ctl *ctl, const struct ctl_verb *v,
                            int argc, char **argv, struct wire_reply *rep) {
  int rc = gmb__ctl_no_args(v, argc, argv);
  if (rc) return rc;
  struct wire_request req = {.kind = WIRE_ADMIN_STATUS};
  return gmb__ctl_call(ctl, v->name, &req, WIRE_ADMIN_STATUS, rep);
}

static int ctl_status(struct ctl *ctl, const struct ctl_verb *v, int argc,
                      char **argv) {
  struct wire_reply rep;
  int rc = ctl_admin_status(ctl, v, argc, argv, &rep);
  if (rc) return rc;
  const struct wire_admin_status *st = &rep.u.admin_status;
  if (ctl->json) {
    json_t *j = gmb__ctl_json_status(st);
    gmb__wire_reply_clear(&rep);
    return gmb__ctl_json_print(j);
  }
  char a[GMB_SIZE_BUFSZ], b[GMB_SIZE_BUFSZ], c[GMB_SIZE_BUFSZ];
  printf("device       %s\n", st->device);
  printf("capacity     %s\n", gmb__size_format(st->capacity, a, sizeof a));
  printf("in segments  %s\n", gmb__size_format(st->in_segments, b, sizeof b));
  printf("in use       %s\n", gmb__size_format(st->in_use, c, sizeof c));
  printf("cached       %s (of in use: free in the clients' caches, "
         "which they give back when asked)\n",
         gmb__size_format(st->cached, a, sizeof a));
  printf("sessions     %u\n", st->sessions);
  if (st->retiring)
    printf("retiring     %s (retired segments that clients still have open)\n",
           gmb__size_format(st->retiring, c, sizeof c));
  printf("largest free %s (fragmentation %.2f)\n",
         gmb__size_format(st->largest_free, a, sizeof a), st->fragmentation);
  printf("descriptors  unread %llu, kept channels %u, refused %llu (sent "
         "and not seen read; channels of ended sessions kept open; requests "
         "refused at a bound)\n",
         (unsigned long long)st->fd_unread, st->fd_kept,
         (unsigned long long)st->fd_refused);
  const struct wire_compact_stats *cs = &st->compaction;
  printf("compaction   %llu runs, %llu moves, %s moved, %.3f s\n",
         (unsigned long long)cs->runs, (unsigned long long)cs->moves,
         gmb__size_format(cs->bytes_moved, b, sizeof b), cs->seconds);
  if (st->offload_job_requests)
    printf("offload job  %u requests held while idle sessions' movable "
           "memory is offloaded, a slice a turn (%llu slices, %llu jobs "
           "since start)\n", st->offload_job_requests,
           (unsigned long long)st->offload_slices,
           (unsigned long long)st->offload_jobs);
  if (st->offload_pauses)
    printf("offload pause %u tenant%s' movable memory still offloaded for "
           "an operator's pause, a slice a turn\n", st->offload_pauses,
           st->offload_pauses == 1 ? "" : "s");
  printf("\n");
  ctl_print_tenants(st);
  gmb__wire_reply_clear(&rep);
  return 0;
}

static int ctl_tenants(struct ctl *ctl, const struct ctl_verb *v, int argc,
                       char **argv) {
  struct wire_reply rep;
  int rc = ctl_admin_status(ctl, v, argc, argv, &rep);
  if (rc) return rc;
  if (ctl->json) {
    json_t *j =
        json_pack("{s:o}", "tenants", gmb__ctl_json_tenants(&rep.u.admin_status));
    gmb__wire_reply_clear(&rep);
    return gmb__ctl_json_print(j);
  }
  ctl_print_tenants(&rep.u.admin_status);
  gmb__wire_reply_clear(&rep);
  return 0;
}

/* sessions [--tenant T]: every session (or one tenant's), from the admin
 * status. */
static int ctl_sessions(struct ctl *ctl, const struct ctl_verb *v, int argc,
                        char **argv) {
  const char *tenant = NULL;
  for (int i = 0; i < argc; i++) {
    if (strcmp(argv[i], "--tenant") == 0) {
      if (++i >= argc)
        return gmb__ctl_fail(CTL_EXIT_USAGE, "%s: --tenant needs a name",
                             v->name);
      tenant = argv[i];
    } else if (strncmp(argv[i], "--tenant=", 9) == 0) {
      tenant = argv[i] + 9;
    } else {
      return gmb__ctl_fail(CTL_EXIT_USAGE, "%s: unexpected argument '%s' "
                           "(usage: gmbctl %s)", v->name, argv[i], v->usage);
    }
    if (!gmb__name_valid(tenant))
      return gmb__ctl_fail(CTL_EXIT_USAGE, "%s: bad tenant name '%.80s'",
                           v->name, tenant);
  }
  struct wire_request req = {.kind = WIRE_ADMIN_STATUS};
  struct wire_reply rep;
  int rc = gmb__ctl_call(ctl, v->name, &req, WIRE_ADMIN_STATUS, &rep);
  if (rc) return rc;
  const struct wire_admin_status *st = &rep.u.admin_status;
  if (tenant) {
    size_t i = 0;
    while (i < st->n_tenants && strcmp(st->tenants[i].name, tenant) != 0) i++;
    if (i == st->n_tenants) {
      gmb__wire_reply_clear(&rep);
      return gmb__ctl_fail(CTL_EXIT_FAIL, "%s: GMB_E_NOENT: no tenant %s",
                           v->name, tenant);
    }
  }
  if (ctl->json) {
    json_t *rows = json_array();
    for (size_t i = 0; i < st->n_sessions; i++)
      if (tenant == NULL || strcmp(st->session_rows[i].tenant, tenant) == 0)
        json_array_append_new(rows,
                              gmb__ctl_json_session(&st->session_rows[i]));
    json_t *j = json_pack("{s:o}", "sessions", rows);
    gmb__wire_reply_clear(&rep);
    return gmb__ctl_json_print(j);
  }
  if (ctl_print_sessions(st, tenant) == 0) {
    if (tenant)
      printf("no sessions of tenant %s\n", tenant);
    else
      printf("no sessions\n");
  }
  gmb__wire_reply_clear(&rep);
  return 0;
}

static int ctl_compact(struct ctl *ctl, const struct ctl_verb *v, int argc,
                       char **argv) {
  struct wire_request req = {.kind = WIRE_ADMIN_COMPACT};
  for (int i = 0; i < argc; i++) {
    const char *t = NULL;
    if (strcmp(argv[i], "--tenant") == 0) {
      if (++i >= argc)
        return gmb__ctl_fail(CTL_EXIT_USAGE, "%s: --tenant needs a name", v->name);
      t = argv[i];
    } else if (strncmp(argv[i], "--tenant=", 9) == 0) {
      t = argv[i] + 9;
    } else {
      return gmb__ctl_fail(CTL_EXIT_USAGE, "%s: unexpected argument '%s' (usage: "
                      "gmbctl %s)", v->name, argv[i], v->usage);
    }
    if (!gmb__name_valid(t))
      return gmb__ctl_fail(CTL_EXIT_USAGE, "%s: bad tenant name '%s'", v->name, t);
    snprintf(req.u.admin_compact.tenant, sizeof req.u.admin_compact.tenant,
             "%s", t);
  }
  /* A compaction of a large device may take a while; the broker answers
   * when it is over. */
  ctl->timeout_ms = 600000;
  struct wire_reply rep;
  int rc = gmb__ctl_call(ctl, v->name, &req, WIRE_ADMIN_COMPACT, &rep);
  if (rc) return rc;
  const struct wire_compact_stats *c = &rep.u.compact;
  if (ctl->json) return gmb__ctl_json_print(gmb__ctl_json_compact(c));
  char a[GMB_SIZE_BUFSZ], b[GMB_SIZE_BUFSZ];
  printf("compacted %s: %llu moves, %s moved, %llu segments (%s) released, "
         "%.3f s\n",
         req.u.admin_compact.tenant[0] ? req.u.admin_compact.tenant
                                       : "every tenant",
         (unsigned long long)c->moves,
         gmb__size_format(c->bytes_moved, a, sizeof a),
         (unsigned long long)c->segments_released,
         gmb__size_format(c->bytes_released, b, sizeof b), c->seconds);
  if (c->skipped_locked || c->skipped_pinned)
    printf("left in place: %llu locked, %llu pinned allocations\n",
           (unsigned long long)c->skipped_locked,
           (unsigned long long)c->skipped_pinned);
  return 0;
}

static const struct ctl_verb ctl_verbs[] = {
    {"status", "status [--json]",
     "the device, what is in use, and a row per tenant", ctl_status},
    {"tenants", "tenants [--json]",
     "a row per tenant: quota, used, cached, peak, segments, sessions, "
     "allocations", ctl_tenants},
    {"sessions", "sessions [--tenant T] [--json]",
     "a row per client session: tenant, uid, pid, used, cached, trim asks",
     ctl_sessions},
    {"quota", "quota set TENANT SIZE | quota get TENANT",
     "set or show a tenant's quota", gmb__ctl_quota},
    {"reserve", "reserve set TENANT SIZE | reserve get TENANT",
     "set or show the memory kept for a tenant", gmb__ctl_reserve},
    {"compact", "compact [--tenant T]", "gather free space by moving "
     "movable allocations", ctl_compact},
    {"map", "map [--svg FILE] [--page N]",
     "draw the device's segments and allocations", gmb__ctl_map},
    {"snapshot", "snapshot [--page N] [FILE]",
     "write the broker's state as JSON (read N ranges a page)",
     gmb__ctl_snapshot},
    {"evict", "evict TENANT", "end every session of a tenant",
     gmb__ctl_evict},
    {"pause", "pause TENANT [--tag T] [--discard]",
     "ask every session of a tenant to pause a tag (every tag): its bytes "
     "to host memory (or dropped), its device memory to others; with no "
     "tag (or --tag '(movable)') the broker also copies the tenant's "
     "unlocked movable allocations to host memory itself",
     gmb__ctl_pause},
    {"resume", "resume TENANT [--tag T]",
     "ask every session of a tenant to resume its paused tags; the "
     "movable allocations the broker offloaded come back while they fit "
     "(the rest at their next gmb_lock)",
     gmb__ctl_pause},
    {"metrics", "metrics", "the broker's metrics (Prometheus text)",
     gmb__ctl_metrics},
    {"reload", "reload", "read the config file again", gmb__ctl_reload},
    {"tenant",
     "tenant add NAME [--quota SIZE] [--reserve SIZE] [--host-quota SIZE] "
     "[--token-file FILE | --token-sha256 HEX] [--uid N]... | tenant remove "
     "NAME [--evict]",
     "make a tenant at run time (not saved), or remove one once its "
     "sessions end; --host-quota bounds the host memory of its paused and "
     "offloaded bytes (0: no limit; without it, default_host_quota)",
     gmb__ctl_tenant},
};
#define CTL_NVERBS (sizeof ctl_verbs / sizeof ctl_verbs[0])

/* --gpu: the UUID `gpu` names (itself, or ordinal N's through the driver)
 * into uuid.  0, or the exit status after a one-line reason. */
static int ctl_gpu_uuid(const char *gpu, char *uuid, size_t cap) {
  if (gmb__gpu_uuid_valid(gpu)) {
    snprintf(uuid, cap, "%s", gpu);
    return 0;
  }
  char *end;
  long n = strtol(gpu, &end, 10);
  if (*gpu == '\0' || *end != '\0' || n < 0)
    return gmb__ctl_fail(CTL_EXIT_USAGE, "--gpu %s: want a GPU's UUID "
                         "(GPU-...) or a CUDA ordinal", gpu);
  struct gmb_cudrv d;
  char err[512];
  if (gmb__cudrv_load(&d, err, sizeof err) != 0)
    return gmb__ctl_fail(CTL_EXIT_FAIL, "--gpu %s: %s", gpu, err);
  int count = 0;
  gmb_cu_device dev;
  struct gmb_cu_uuid u;
  int ok = d.cuDeviceGetCount(&count) == GMB_CU_SUCCESS && n < count &&
           d.cuDeviceGet(&dev, (int)n) == GMB_CU_SUCCESS &&
           d.cuDeviceGetUuid(&u, dev) == GMB_CU_SUCCESS;
  if (ok) gmb__cudrv_uuid_str(&u, uuid, cap);
  gmb__cudrv_unload(&d);
  if (!ok)
    return gmb__ctl_fail(CTL_EXIT_FAIL, "--gpu %s: no such GPU (the driver "
                         "sees %d)", gpu, count);
  return 0;
}

static void ctl_usage(FILE *f) {
  fprintf(f,
          "usage: gmbctl [--run-dir DIR] [--gpu UUID|N] [--json] VERB [ARGS]\n"
          "       gmbctl VERB --help | --help | --version\n\n"
          "Talks to the gmb broker's admin socket, ipc://RUN_DIR/admin.sock\n"
          "(RUN_DIR: --run-dir, else $GMB_RUN_DIR, else /run/gmb for root,\n"
          "$XDG_RUNTIME_DIR/gmb, /tmp/gmb-UID).  Sizes read and print as\n"
          "512MiB, 20GiB; bytes are accepted.\n\nverbs:\n");
  for (size_t i = 0; i < CTL_NVERBS; i++)
    fprintf(f, "  %s\n      %s\n", ctl_verbs[i].usage, ctl_verbs[i].summary);
  fprintf(f,
          "\noptions:\n"
          "  --run-dir DIR  the broker's run directory\n"
          "  --gpu UUID|N   the broker of that GPU, on a host with one broker\n"
          "                 per GPU: RUN_DIR/UUID (N: this process's CUDA\n"
          "                 ordinal N, whose UUID the driver gives)\n"
          "  --json         machine-readable output\n"
          "  -h, --help     this text, or a verb's\n"
          "  --version      the version\n\n"
          "exit status: 0 success, 1 the broker failed or could not be "
          "reached,\n2 usage error or a verb this broker does not have yet.\n");
}

int main(int argc, char **argv) {
  struct ctl ctl = {.json = 0};
  int help = 0;
  const struct ctl_verb *verb = NULL;
  char **rest = calloc((size_t)argc + 1, sizeof *rest);
  int nrest = 0;
  const char *run_dir = NULL, *gpu = NULL;
  if (rest == NULL) return gmb__ctl_fail(CTL_EXIT_FAIL, "out of memory");

  /* Options every verb shares may come before or after the verb; what is
   * left after the verb is the verb's. */
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (strcmp(a, "--json") == 0) {
      ctl.json = 1;
    } else if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
      help = 1;
    } else if (strcmp(a, "--version") == 0) {
      printf("gmbctl %s (libgmb %s)\n", GMB_VERSION_STRING, gmb_version());
      free(rest);
      return 0;
    } else if (strcmp(a, "--run-dir") == 0) {
      if (++i >= argc) {
        free(rest);
        return gmb__ctl_fail(CTL_EXIT_USAGE, "--run-dir needs a directory");
      }
      run_dir = argv[i];
    } else if (strncmp(a, "--run-dir=", 10) == 0) {
      run_dir = a + 10;
    } else if (strcmp(a, "--gpu") == 0) {
      if (++i >= argc) {
        free(rest);
        return gmb__ctl_fail(CTL_EXIT_USAGE, "--gpu needs a UUID or ordinal");
      }
      gpu = argv[i];
    } else if (strncmp(a, "--gpu=", 6) == 0) {
      gpu = a + 6;
    } else if (verb == NULL && a[0] == '-') {
      free(rest);
      return gmb__ctl_fail(CTL_EXIT_USAGE, "unknown option '%s' (see gmbctl --help)",
                      a);
    } else if (verb == NULL) {
      for (size_t k = 0; k < CTL_NVERBS; k++)
        if (strcmp(a, ctl_verbs[k].name) == 0) verb = &ctl_verbs[k];
      if (verb == NULL) {
        free(rest);
        return gmb__ctl_fail(CTL_EXIT_USAGE, "unknown verb '%s' (see gmbctl --help)",
                        a);
      }
    } else {
      rest[nrest++] = argv[i];
    }
  }
  if (verb == NULL) {
    free(rest);
    if (help) {
      ctl_usage(stdout);
      return 0;
    }
    return gmb__ctl_fail(CTL_EXIT_USAGE, "no verb given (see gmbctl --help)");
  }
  if (help) {
    printf("usage: gmbctl [--run-dir DIR] %s\n  %s\n", verb->usage,
           verb->summary);
    free(rest);
    return 0;
  }
  if (run_dir) {
    if (strlen(run_dir) >= sizeof ctl.run_dir) {
      free(rest);
      return gmb__ctl_fail(CTL_EXIT_USAGE, "--run-dir: name too long");
    }
    snprintf(ctl.run_dir, sizeof ctl.run_dir, "%s", run_dir);
  } else if (gmb__run_dir(ctl.run_dir, sizeof ctl.run_dir) == NULL) {
    free(rest);
    return gmb__ctl_fail(CTL_EXIT_FAIL, "the run directory's name is too long");
  }
  if (gpu) {
    char uuid[64], dir[sizeof ctl.run_dir];
    int rc = ctl_gpu_uuid(gpu, uuid, sizeof uuid);
    if (rc == 0 && gmb__run_dir_gpu(ctl.run_dir, uuid, dir, sizeof dir) == NULL)
      rc = gmb__ctl_fail(CTL_EXIT_USAGE, "--gpu: the run directory's name is "
                         "too long");
    if (rc) {
      free(rest);
      return rc;
    }
    memcpy(ctl.run_dir, dir, sizeof dir);
  }
  int rc = verb->run(&ctl, verb, nrest, rest);
  gmb__admin_rpc_close(ctl.rpc);
  free(rest);
  return rc;
}
