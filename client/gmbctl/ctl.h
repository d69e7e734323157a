/*
 * ctl.h - what gmbctl's verbs share: the session with the admin socket,
 * errors, and output helpers.  gmbctl.c has main() and the verb table;
 * verbs live in gmbctl.c (status, tenants, sessions, compact), ctl_admin.c
 * (quota, reserve, evict, reload), ctl_snapshot.c (snapshot, and the
 * reading of a snapshot page by page) and ctl_view.c (map, metrics).
 *
 * Every verb returns gmbctl's exit status: 0, CTL_EXIT_FAIL after printing
 * one line "gmbctl: reason" on stderr (gmb__ctl_fail), or CTL_EXIT_USAGE.
 */
#ifndef GMB_CTL_H
#define GMB_CTL_H

#include <jansson.h>
#include <stdint.h>
#include <stdio.h>

#include "admin_rpc.h"
#include "wire.h"

#define CTL_TIMEOUT_MS 5000
#define CTL_EXIT_FAIL 1
#define CTL_EXIT_USAGE 2

struct ctl {
  char run_dir[256];
  int json;
  int timeout_ms;        /* for one reply; 0: CTL_TIMEOUT_MS */
  struct admin_rpc *rpc; /* NULL until the first gmb__ctl_call */
};

struct ctl_verb {
  const char *name;
  const char *usage;   /* after "gmbctl " */
  const char *summary; /* one line for the tool's --help */
  int (*run)(struct ctl *ctl, const struct ctl_verb *v, int argc, char **argv);
};

/* Prints "gmbctl: ..." on stderr; returns `code`. */
int gmb__ctl_fail(int code, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* Sends `req` on the admin socket and waits for its reply, whose body must
 * be `expect`.  0 with *rep filled (the caller clears it with
 * gmb__wire_reply_clear), or an exit status after printing why (a refusal
 * prints the broker's code and message). */
int gmb__ctl_call(struct ctl *ctl, const char *verb, struct wire_request *req,
                  enum wire_kind expect, struct wire_reply *rep);

/* Prints JSON (and frees it); 0 or CTL_EXIT_FAIL. */
int gmb__ctl_json_print(json_t *j);

/* CTL_EXIT_USAGE with a message when the verb got arguments. */
int gmb__ctl_no_args(const struct ctl_verb *v, int argc, char **argv);

/* An admin status as JSON: the object of `gmbctl status --json`, also a
 * snapshot's "status" (docs/snapshot.md). */
json_t *gmb__ctl_json_status(const struct wire_admin_status *st);

/* Writes `path` through a temporary file and a rename, so that a reader
 * never sees half a file, nor one whose writing failed: fn writes into the
 * open file and returns 0, -1 on a write error (reported here, with
 * errno), or an exit status after reporting the failure itself.  Returns
 * gmbctl's exit status. */
int gmb__ctl_write_atomic(const char *path, int (*fn)(FILE *f, void *ctx),
                          void *ctx);
/* The tenants of an admin status, as a JSON array. */
json_t *gmb__ctl_json_tenants(const struct wire_admin_status *st);
/* One session's row, as a JSON object. */
json_t *gmb__ctl_json_session(const struct wire_session_row *r);
json_t *gmb__ctl_json_compact(const struct wire_compact_stats *c);

/* ctl_admin.c: quota, reserve, evict, reload, tenant. */
int gmb__ctl_quota(struct ctl *ctl, const struct ctl_verb *v, int argc,
                   char **argv);
int gmb__ctl_reserve(struct ctl *ctl, const struct ctl_verb *v, int argc,
                     char **argv);
int gmb__ctl_evict(struct ctl *ctl, const struct ctl_verb *v, int argc,
                   char **argv);
int gmb__ctl_pause(struct ctl *ctl, const struct ctl_verb *v, int argc,
                   char **argv);
int gmb__ctl_reload(struct ctl *ctl, const struct ctl_verb *v, int argc,
                    char **argv);
/* tenant add NAME [--quota S] [--reserve S] [--host-quota S] [--token-file F
 * | --token-sha256 HEX] [--uid N]... | tenant remove NAME [--evict] */
int gmb__ctl_tenant(struct ctl *ctl, const struct ctl_verb *v, int argc,
                    char **argv);

/* ctl_snapshot.c: a snapshot read page by page (docs/snapshot.md). */

/* What the reader has read, once it is done. */
struct ctl_pages_total {
  unsigned pages;
  int consistent; /* every page had the same change counter */
  uint64_t segments, allocations;
};

/*
 * What a view does with the pages as they arrive; any callback may be
 * NULL.  Each returns 0, or non-zero to stop the reading (a negative value
 * for a write that failed, else an exit status after saying why).  The
 * pointers are valid during the call only.
 *   status  the admin status, from the first page, before any segment
 *   begin   a segment: its header and its ranges in this page; `split`:
 *           more of them follow in the next page (`used` is then the
 *           broker's figure, not the sum of these ranges)
 *   more    more ranges of the segment that began last
 *   end     that segment is over
 *   finish  every page was read
 */
struct ctl_pages_sink {
  int (*status)(void *ctx, const struct wire_admin_status *st);
  int (*begin)(void *ctx, const struct wire_segment_info *s, int split);
  int (*more)(void *ctx, const struct wire_segment_info *s);
  int (*end)(void *ctx);
  int (*finish)(void *ctx, const struct ctl_pages_total *total);
  void *ctx;
};

/* Reads the snapshot a page of `limit` ranges at a time (0: the broker's
 * default), handing each page to the sinks before asking for the next.
 * 0 with *total filled, else what a sink or gmb__ctl_call returned. */
int gmb__ctl_pages(struct ctl *ctl, const char *verb, uint32_t limit,
                   const struct ctl_pages_sink *sinks, size_t n_sinks,
                   struct ctl_pages_total *total);

/* --page N or --page=N at argv[*i]: 1 with *limit set and *i on its last
 * word, 0 when argv[*i] is something else, or minus the exit status after
 * a usage message. */
int gmb__ctl_page_opt(const struct ctl_verb *v, int argc, char **argv,
                      int *i, uint32_t *limit);

/* A sink that writes the gmb-snapshot/1 document to f as pages arrive. */
struct ctl_json_writer {
  FILE *f;
  uint64_t segments, ranges; /* written so far; ranges: of this segment */
};
void gmb__ctl_json_writer(struct ctl_json_writer *w, FILE *f,
                          struct ctl_pages_sink *sink);

int gmb__ctl_snapshot(struct ctl *ctl, const struct ctl_verb *v, int argc,
                      char **argv);

/* ctl_view.c: map [--svg FILE] [--page N], metrics. */
int gmb__ctl_map(struct ctl *ctl, const struct ctl_verb *v, int argc,
                 char **argv);
int gmb__ctl_metrics(struct ctl *ctl, const struct ctl_verb *v, int argc,
                     char **argv);

#endif /* GMB_CTL_H */
