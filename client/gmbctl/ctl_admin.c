/*
 * ctl_admin.c - gmbctl's verbs that change the broker: quota, reserve,
 * evict, reload, and tenant add/remove (run-time tenants, as a scheduler's
 * node component makes them).
 *
 * Arguments are checked here before anything is sent, so a typo never
 * reaches the broker: a missing or extra argument, an unknown subcommand,
 * a bad tenant name or size is exit 2 with one line.  What the broker
 * refuses (an unknown tenant, a quota below the reservation, a config file
 * that does not read) is exit 1 with the broker's own message, printed by
 * gmb__ctl_call.  A quota of 0 means no limit and prints as "unlimited";
 * "unlimited" is accepted as a quota too.
 */
#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
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

/* pause TENANT [--tag T] [--discard] and resume TENANT [--tag T]: every
 * session of the tenant is told; its library pauses (or resumes) from its
 * own thread, and status shows what paused. */
int gmb__ctl_pause(struct ctl *ctl, const struct ctl_verb *v, int argc,
                   char **argv) {
  int pause = strcmp(v->name, "pause") == 0;
  enum wire_kind kind = pause ? WIRE_ADMIN_PAUSE : WIRE_ADMIN_RESUME;
  struct wire_request req = {.kind = kind};
  const char *tenant = NULL;
  for (int i = 0; i < argc; i++) {
    const char *tag = NULL;
    if (strcmp(argv[i], "--tag") == 0) {
      if (++i >= argc) return ctl_usage_fail(v, "--tag needs a name");
      tag = argv[i];
    } else if (strncmp(argv[i], "--tag=", 6) == 0) {
      tag = argv[i] + 6;
    } else if (pause && strcmp(argv[i], "--discard") == 0) {
      req.u.admin_pause.discard = 1;
      continue;
    } else if (argv[i][0] != '-' && tenant == NULL) {
      tenant = argv[i];
      continue;
    } else {
      char what[160];
      snprintf(what, sizeof what, "unexpected argument '%.60s'", argv[i]);
      return ctl_usage_fail(v, what);
    }
    if (tag[0] == '\0' || strlen(tag) > WIRE_TAG_MAX)
      return gmb__ctl_fail(CTL_EXIT_USAGE, "%s: a tag has 1 to %d bytes",
                           v->name, WIRE_TAG_MAX);
    snprintf(req.u.admin_pause.tag, sizeof req.u.admin_pause.tag, "%s", tag);
  }
  if (tenant == NULL) return ctl_usage_fail(v, "missing TENANT");
  if (!gmb__name_valid(tenant))
    return gmb__ctl_fail(CTL_EXIT_USAGE, "%s: bad tenant name '%.80s'",
                         v->name, tenant);
  snprintf(req.u.admin_pause.tenant, sizeof req.u.admin_pause.tenant, "%s",
           tenant);
  struct wire_reply rep;
  int rc = gmb__ctl_call(ctl, v->name, &req, WIRE_ADMIN_PAUSE, &rep);
  if (rc) return rc;
  if (ctl->json) {
    json_t *j = json_pack("{s:s, s:s, s:i, s:b, s:i, s:I}", "tenant", tenant,
                          "tag", req.u.admin_pause.tag, "sessions",
                          (int)rep.u.pause.sessions, "discard",
                          req.u.admin_pause.discard, "movable",
                          (int)rep.u.pause.movable, "movable_bytes",
                          (json_int_t)rep.u.pause.movable_bytes);
    gmb__wire_reply_clear(&rep);
    return gmb__ctl_json_print(j);
  }
  printf("%s\n", rep.message);
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

/* --- tenant add / remove ------------------------------------------------ */

/* The SHA-256 of the token in `path` (trailing newlines dropped, as the
 * library reads GMB_TOKEN_FILE), or of a hex hash given as is. */
static int ctl_token_file(const struct ctl_verb *v, const char *path,
                          uint8_t sha[32]) {
  FILE *f = fopen(path, "r");
  if (f == NULL)
    return gmb__ctl_fail(CTL_EXIT_USAGE, "%s: --token-file %s: %s", v->name,
                         path, strerror(errno));
  char buf[WIRE_TOKEN_MAX + 2];
  size_t n = fread(buf, 1, sizeof buf, f);
  fclose(f);
  while (n && (buf[n - 1] == '\n' || buf[n - 1] == '\r')) n--;
  if (n == 0 || n > WIRE_TOKEN_MAX)
    return gmb__ctl_fail(CTL_EXIT_USAGE, "%s: --token-file %s: want 1 to %d "
                         "bytes of token", v->name, path, WIRE_TOKEN_MAX);
  if (gmb__admin_token_sha256(buf, n, sha))
    return gmb__ctl_fail(CTL_EXIT_FAIL, "%s: cannot hash the token", v->name);
  return 0;
}

static int ctl_hex32(const char *s, uint8_t out[32]) {
  if (strlen(s) != 64) return -1;
  for (int i = 0; i < 32; i++) {
    unsigned x;
    if (sscanf(s + 2 * i, "%2x", &x) != 1) return -1;
    out[i] = (uint8_t)x;
  }
  return 0;
}

static int ctl_tenant_add(struct ctl *ctl, const struct ctl_verb *v, int argc,
                          char **argv) {
  struct wire_request req = {.kind = WIRE_ADMIN_TENANT_ADD};
  struct wire_tenant_add *a = &req.u.admin_tenant_add;
  snprintf(a->tenant, sizeof a->tenant, "%s", argv[0]);
  for (int i = 1; i < argc; i++) {
    const char *o = argv[i], *val = i + 1 < argc ? argv[i + 1] : NULL;
    if (val == NULL) return ctl_usage_fail(v, "an option lacks its value");
    int rc = 0;
    if (strcmp(o, "--quota") == 0) {
      rc = gmb__size_parse(val, &a->quota);
    } else if (strcmp(o, "--reserve") == 0) {
      rc = gmb__size_parse(val, &a->reserve);
    } else if (strcmp(o, "--host-quota") == 0) {
      rc = gmb__size_parse(val, &a->host_quota);
      a->has_host_quota = 1;
    } else if (strcmp(o, "--token-file") == 0) {
      int r = ctl_token_file(v, val, a->token_sha256);
      if (r) return r;
      a->has_token = 1;
    } else if (strcmp(o, "--token-sha256") == 0) {
      rc = ctl_hex32(val, a->token_sha256);
      a->has_token = 1;
    } else if (strcmp(o, "--uid") == 0) {
      char *end;
      unsigned long u = strtoul(val, &end, 10);
      if (*val == '\0' || *end != '\0' || u > UINT32_MAX ||
          a->n_uids >= WIRE_UIDS_MAX)
        rc = -1;
      else
        a->uids[a->n_uids++] = (uint32_t)u;
    } else {
      char what[160];
      snprintf(what, sizeof what, "unknown option '%.60s'", o);
      return ctl_usage_fail(v, what);
    }
    if (rc) {
      char what[160];
      snprintf(what, sizeof what, "bad value '%.60s' for %s", val, o);
      return ctl_usage_fail(v, what);
    }
    i++;
  }
  struct wire_reply rep;
  int rc = gmb__ctl_call(ctl, v->name, &req, WIRE_TENANT_ROW, &rep);
  if (rc) return rc;
  if (ctl->json) {
    json_t *j = ctl_row_json(&rep.u.tenant_row);
    json_object_set_new(j, "message", json_string(rep.message));
    gmb__wire_reply_clear(&rep);
    return gmb__ctl_json_print(j);
  }
  printf("%s\n", rep.message);
  gmb__wire_reply_clear(&rep);
  return 0;
}

static int ctl_tenant_remove(struct ctl *ctl, const struct ctl_verb *v,
                             int argc, char **argv) {
  struct wire_request req = {.kind = WIRE_ADMIN_TENANT_REMOVE};
  snprintf(req.u.admin_tenant_remove.tenant,
           sizeof req.u.admin_tenant_remove.tenant, "%s", argv[0]);
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--evict") != 0) {
      char what[160];
      snprintf(what, sizeof what, "unexpected argument '%.60s'", argv[i]);
      return ctl_usage_fail(v, what);
    }
    req.u.admin_tenant_remove.evict = 1;
  }
  struct wire_reply rep;
  int rc = gmb__ctl_call(ctl, v->name, &req, WIRE_ADMIN_TENANT_REMOVE, &rep);
  if (rc) return rc;
  if (ctl->json) {
    json_t *j = json_pack("{s:s, s:b, s:i, s:i, s:I, s:s}", "tenant", argv[0],
                          "removed", rep.u.tenant_remove.removed, "sessions",
                          (int)rep.u.tenant_remove.sessions, "evicted",
                          (int)rep.u.tenant_remove.evicted, "bytes_freed",
                          (json_int_t)rep.u.tenant_remove.bytes_freed,
                          "message", rep.message);
    gmb__wire_reply_clear(&rep);
    return gmb__ctl_json_print(j);
  }
  printf("%s\n", rep.message);
  gmb__wire_reply_clear(&rep);
  return 0;
}

int gmb__ctl_tenant(struct ctl *ctl, const struct ctl_verb *v, int argc,
                    char **argv) {
  if (argc < 1) return ctl_usage_fail(v, "missing subcommand add or remove");
  int add = strcmp(argv[0], "add") == 0;
  if (!add && strcmp(argv[0], "remove") != 0) {
    char what[160];
    snprintf(what, sizeof what, "unknown subcommand '%.60s' (want add or "
             "remove)", argv[0]);
    return ctl_usage_fail(v, what);
  }
  if (argc < 2) return ctl_usage_fail(v, "missing TENANT");
  if (!gmb__name_valid(argv[1]))
    return gmb__ctl_fail(CTL_EXIT_USAGE, "%s: bad tenant name '%.80s'",
                         v->name, argv[1]);
  return add ? ctl_tenant_add(ctl, v, argc - 1, argv + 1)
             : ctl_tenant_remove(ctl, v, argc - 1, argv + 1);
}
