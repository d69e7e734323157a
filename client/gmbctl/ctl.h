/*
 * ctl.h - what gmbctl's verbs share: the session with the admin socket,
 * errors, and output helpers.  gmbctl.c has main() and the verb table;
 * verbs live in gmbctl.c (status, tenants, sessions, compact), ctl_admin.c
 * (quota, reserve, evict, reload) and ctl_view.c (map, snapshot, metrics).
 *
 * Every verb returns gmbctl's exit status: 0, CTL_EXIT_FAIL after printing
 * one line "gmbctl: reason" on stderr (gmb__ctl_fail), or CTL_EXIT_USAGE.
 */
#ifndef GMB_CTL_H
#define GMB_CTL_H

#include <jansson.h>
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
/* The tenants of an admin status, as a JSON array. */
json_t *gmb__ctl_json_tenants(const struct wire_admin_status *st);
/* One session's row, as a JSON object. */
json_t *gmb__ctl_json_session(const struct wire_session_row *r);
json_t *gmb__ctl_json_compact(const struct wire_compact_stats *c);

/* ctl_admin.c: quota, reserve, evict, reload. */
int gmb__ctl_quota(struct ctl *ctl, const struct ctl_verb *v, int argc,
                   char **argv);
int gmb__ctl_reserve(struct ctl *ctl, const struct ctl_verb *v, int argc,
                     char **argv);
int gmb__ctl_evict(struct ctl *ctl, const struct ctl_verb *v, int argc,
                   char **argv);
int gmb__ctl_reload(struct ctl *ctl, const struct ctl_verb *v, int argc,
                    char **argv);

/* ctl_view.c: map [--svg FILE], snapshot [FILE], metrics. */
int gmb__ctl_map(struct ctl *ctl, const struct ctl_verb *v, int argc,
                 char **argv);
int gmb__ctl_snapshot(struct ctl *ctl, const struct ctl_verb *v, int argc,
                      char **argv);
int gmb__ctl_metrics(struct ctl *ctl, const struct ctl_verb *v, int argc,
                     char **argv);

#endif /* GMB_CTL_H */
