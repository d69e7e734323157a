/*
 * ctl_admin.c - gmbctl's verbs that change the broker: quota, reserve,
 * evict and reload.
 *
 * Arguments are checked here before anything is sent, so a typo never
 * reaches the broker: a missing or extra argument, an unknown subcommand,
 * a bad tenant name or size is exit 2 with one line.  What the broker
 * refuses (an unknown tenant, a quota below the reservation, a config file
 * that does not read) is exit 1 with the broker's own message, printed by
 * gmb__ctl_call.  A quota of 0 means no limit and prints as "unlimited";
 * "unlimited" is accepted as a quota too.
 */
#include <jansson.h>
#include <stdio.h>
#include <string.h>

#include "ctl.h"
#include "gmb.h"
#include "util.h"
#include "wire.h"

static int ctl_usage_fail(const struct ctl_verb *v, const char *what) {
  return gmb__ctl_fail(CTL_EXIT_USAGE, "%s: %s (usage: gmbctl %s)", v->name,
                       what, v->usage);
}

static const char *ctl_quota_str(uint64_t q, char *buf, size_t cap) {
  if (q == 0) {
    snprintf(buf, cap, "unlimited");
    return buf;
  }
  return gmb__size_format(q, buf, cap);
}

static json_t *ctl_row_json(const struct wire_tenant_row *r) {
  json_t *j = json_pack("{s:s, s:I, s:I, s:I, s:I, s:i, s:i}", "tenant",
                        r->name, "quota", (json_int_t)r->quota, "reserve",
                        (json_int_t)r->reserve, "used", (json_int_t)r->used,
                        "peak", (json_int_t)r->peak, "sessions",
                        (int)r->sessions, "priority", (int)r->priority);
  return j;
}

/* quota and reserve: `set TENANT SIZE` or `get TENANT`. */
static int ctl_limit(struct ctl *ctl, const struct ctl_verb *v, int argc,
                     char **argv, enum wire_kind kind) {
  int is_quota = kind == WIRE_ADMIN_QUOTA;
  if (argc < 1) return ctl_usage_fail(v, "missing subcommand set or get");
  int set;
  if (strcmp(argv[0], "set") == 0) {
    set = 1;
  } else if (strcmp(argv[0], "get") == 0) {
    set = 0;
  } else {
    char what[160];
    snprintf(what, sizeof what, "unknown subcommand '%.60s' (want set or get)",
             argv[0]);
    return ctl_usage_fail(v, what);
  }
  int want = set ? 3 : 2;
  if (argc < 2) return ctl_usage_fail(v, "missing TENANT");
  if (set && argc < 3) return ctl_usage_fail(v, "missing SIZE");
  if (argc > want) {
    char what[160];
    snprintf(what, sizeof what, "unexpected argument '%.60s'", argv[want]);
    return ctl_usage_fail(v, what);
  }
  const char *tenant = argv[1];
  if (!gmb__name_valid(tenant))
    return gmb__ctl_fail(CTL_EXIT_USAGE,
                         "%s: bad tenant name '%.80s' (1 to 63 of A-Z a-z 0-9 "
                         "._- not starting with . or -)",
                         v->name, tenant);
  struct wire_request req = {.kind = kind};
  snprintf(req.u.admin_limit.tenant, sizeof req.u.admin_limit.tenant, "%s",
           tenant);
  req.u.admin_limit.set = set;
  if (set) {
    uint64_t size;
    if (is_quota && strcmp(argv[2], "unlimited") == 0)
      size = 0;
    else if (gmb__size_parse(argv[2], &size) != 0)
      return gmb__ctl_fail(CTL_EXIT_USAGE,
                           "%s: bad size '%.80s' (want e.g. 512MiB, 20GiB or "
                           "bytes%s)",
                           v->name, argv[2], is_quota ? ", or unlimited" : "");
    req.u.admin_limit.value = size;
  }
  struct wire_reply rep;
  int rc = gmb__ctl_call(ctl, v->name, &req, WIRE_TENANT_ROW, &rep);
  if (rc) return rc;
  const struct wire_tenant_row *r = &rep.u.tenant_row;
  if (ctl->json) {
    json_t *j = ctl_row_json(r);
    if (set) json_object_set_new(j, "message", json_string(rep.message));
    gmb__wire_reply_clear(&rep);
    return gmb__ctl_json_print(j);
  }
  char a[GMB_SIZE_BUFSZ], b[GMB_SIZE_BUFSZ], c[GMB_SIZE_BUFSZ];
  if (set) {
    printf("%s\n", rep.message);
  } else if (is_quota) {
    printf("%s quota %s (used %s, reserve %s)\n", r->name,
           ctl_quota_str(r->quota, a, sizeof a),
           gmb__size_format(r->used, b, sizeof b),
           gmb__size_format(r->reserve, c, sizeof c));
  } else {
    printf("%s reserve %s (quota %s, used %s)\n", r->name,
           gmb__size_format(r->reserve, a, sizeof a),
           ctl_quota_str(r->quota, b, sizeof b),
           gmb__size_format(r->used, c, sizeof c));
  }
  gmb__wire_reply_clear(&rep);
  return 0;
}

int gmb__ctl_quota(struct ctl *ctl, const struct ctl_verb *v, int argc,
                   char **argv) {
  return ctl_limit(ctl, v, argc, argv, WIRE_ADMIN_QUOTA);
}

int gmb__ctl_reserve(struct ctl *ctl, const struct ctl_verb *v, int argc,
                     char **argv) {
  return ctl_limit(ctl, v, argc, argv, WIRE_ADMIN_RESERVE);
}

int gmb__ctl_evict(struct ctl *ctl, const struct ctl_verb *v, int argc,
                   char **argv) {
  if (argc < 1) return ctl_usage_fail(v, "missing TENANT");
  if (argc > 1) {
    char what[160];
    snprintf(what, sizeof what, "unexpected argument '%.60s'", argv[1]);
    return ctl_usage_fail(v, what);
  }
  if (!gmb__name_valid(argv[0]))
    return gmb__ctl_fail(CTL_EXIT_USAGE, "%s: bad tenant name '%.80s'",
                         v->name, argv[0]);
  struct wire_request req = {.kind = WIRE_ADMIN_EVICT};
  snprintf(req.u.admin_evict.tenant, sizeof req.u.admin_evict.tenant, "%s",
           argv[0]);
  struct wire_reply rep;
  int rc = gmb__ctl_call(ctl, v->name, &req, WIRE_ADMIN_EVICT, &rep);
  if (rc) return rc;
  if (ctl->json) {
    json_t *j = json_pack("{s:s, s:i, s:I}", "tenant", argv[0], "sessions",
                          (int)rep.u.evict.sessions, "bytes_freed",
                          (json_int_t)rep.u.evict.bytes_freed);
    gmb__wire_reply_clear(&rep);
    return gmb__ctl_json_print(j);
  }
  char f[GMB_SIZE_BUFSZ];
  printf("evicted %s: %u sessions ended, %s freed\n", argv[0],
         rep.u.evict.sessions,
         gmb__size_format(rep.u.evict.bytes_freed, f, sizeof f));
  gmb__wire_reply_clear(&rep);
  return 0;
}

int gmb__ctl_reload(struct ctl *ctl, const struct ctl_verb *v, int argc,
                    char **argv) {
  int rc = gmb__ctl_no_args(v, argc, argv);
  if (rc) return rc;
  struct wire_request req = {.kind = WIRE_ADMIN_RELOAD};
  struct wire_reply rep;
  rc = gmb__ctl_call(ctl, v->name, &req, WIRE_NONE, &rep);
  if (rc) return rc;
  if (ctl->json) {
    json_t *j = json_pack("{s:b, s:s}", "reloaded", 1, "message", rep.message);
    gmb__wire_reply_clear(&rep);
    return gmb__ctl_json_print(j);
  }
  printf("%s\n", rep.message);
  gmb__wire_reply_clear(&rep);
  return 0;
}
