/*
 * ctl_admin.c - gmbctl's verbs that change the broker: quota, reserve,
 * evict, reload, and tenant add|remove.
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

/* A request of `kind` for the one TENANT argument (evict, tenant
 * remove); 0, or the exit status after a usage line. */
static int ctl_one_tenant(const struct ctl_verb *v, int argc, char **argv,
                          enum wire_kind kind, struct wire_request *req) {
  if (argc < 1) return ctl_usage_fail(v, "missing TENANT");
  if (argc > 1) {
    char what[160];
    snprintf(what, sizeof what, "unexpected argument '%.60s'", argv[1]);
    return ctl_usage_fail(v, what);
  }
  if (!gmb__name_valid(argv[0]))
    return gmb__ctl_fail(CTL_EXIT_USAGE, "%s: bad tenant name '%.80s'",
                         v->name, argv[0]);
  memset(req, 0, sizeof *req);
  req->kind = kind;
  snprintf(req->u.admin_evict.tenant, sizeof req->u.admin_evict.tenant, "%s",
           argv[0]);
  return 0;
}

int gmb__ctl_evict(struct ctl *ctl, const struct ctl_verb *v, int argc,
                   char **argv) {
  struct wire_request req;
  int urc = ctl_one_tenant(v, argc, argv, WIRE_ADMIN_EVICT, &req);
  if (urc) return urc;
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

/* tenant add NAME --quota SIZE [--reserve SIZE] (--token-file FILE |
 * --token-sha256 HEX): the token itself is hashed here and never sent. */
static int ctl_tenant_add(struct ctl *ctl, const struct ctl_verb *v, int argc,
                          char **argv) {
  const char *name = NULL, *quota_s = NULL, *reserve_s = NULL;
  const char *token_file = NULL, *hash_hex = NULL;
  for (int i = 0; i < argc; i++) {
    const char **dst = NULL;
    if (strcmp(argv[i], "--quota") == 0) dst = &quota_s;
    else if (strcmp(argv[i], "--reserve") == 0) dst = &reserve_s;
    else if (strcmp(argv[i], "--token-file") == 0) dst = &token_file;
    else if (strcmp(argv[i], "--token-sha256") == 0) dst = &hash_hex;
    if (dst) {
      if (i + 1 >= argc) return ctl_usage_fail(v, "an option lacks its value");
      *dst = argv[++i];
    } else if (name == NULL && argv[i][0] != '-') {
      name = argv[i];
    } else {
      char what[160];
      snprintf(what, sizeof what, "unexpected argument '%.60s'", argv[i]);
      return ctl_usage_fail(v, what);
    }
  }
  if (name == NULL) return ctl_usage_fail(v, "missing TENANT");
  if (!gmb__name_valid(name))
    return gmb__ctl_fail(CTL_EXIT_USAGE, "%s: bad tenant name '%.80s'",
                         v->name, name);
  if (quota_s == NULL) return ctl_usage_fail(v, "missing --quota SIZE");
  if ((token_file == NULL) == (hash_hex == NULL))
    return ctl_usage_fail(v, "give one of --token-file and --token-sha256");
  uint64_t quota = 0, reserve = 0;
  if (strcmp(quota_s, "unlimited") != 0 && gmb__size_parse(quota_s, &quota))
    return gmb__ctl_fail(CTL_EXIT_USAGE, "%s: bad size '%.60s'", v->name,
                         quota_s);
  if (reserve_s && gmb__size_parse(reserve_s, &reserve))
    return gmb__ctl_fail(CTL_EXIT_USAGE, "%s: bad size '%.60s'", v->name,
                         reserve_s);
  uint8_t hash[32];
  if (hash_hex) {
    if (strlen(hash_hex) != 64)
      return gmb__ctl_fail(CTL_EXIT_USAGE, "%s: --token-sha256 wants 64 hex "
                           "digits", v->name);
    for (int i = 0; i < 32; i++) {
      char b[3] = {hash_hex[2 * i], hash_hex[2 * i + 1], 0}, *end;
      unsigned long x = strtoul(b, &end, 16);
      if (*end != '\0' || b[0] == '+' || b[0] == '-' || b[0] == ' ')
        return gmb__ctl_fail(CTL_EXIT_USAGE, "%s: --token-sha256 wants 64 "
                             "hex digits", v->name);
      hash[i] = (uint8_t)x;
    }
  } else {
    FILE *f = fopen(token_file, "r");
    if (f == NULL)
      return gmb__ctl_fail(CTL_EXIT_FAIL, "%s: cannot read %s", v->name,
                           token_file);
    char buf[WIRE_TOKEN_MAX + 2];
    size_t n = fread(buf, 1, sizeof buf, f);
    fclose(f);
    if (n && buf[n - 1] == '\n') n--;
    if (n == 0 || n > WIRE_TOKEN_MAX)
      return gmb__ctl_fail(CTL_EXIT_FAIL, "%s: %s: a token is 1 to %d bytes",
                           v->name, token_file, WIRE_TOKEN_MAX);
    int rc = gmb__admin_token_sha256(buf, n, hash);
    memset(buf, 0, sizeof buf);
    if (rc) return gmb__ctl_fail(CTL_EXIT_FAIL, "%s: SHA-256 failed", v->name);
  }
  struct wire_request req = {.kind = WIRE_ADMIN_TENANT_ADD};
  snprintf(req.u.admin_tenant_add.tenant, sizeof req.u.admin_tenant_add.tenant,
           "%s", name);
  req.u.admin_tenant_add.quota = quota;
  req.u.admin_tenant_add.reserve = reserve;
  req.u.admin_tenant_add.has_token = 1;
  memcpy(req.u.admin_tenant_add.token_sha256, hash, sizeof hash);
  struct wire_reply rep;
  int rc = gmb__ctl_call(ctl, v->name, &req, WIRE_TENANT_ROW, &rep);
  if (rc) return rc;
  if (ctl->json) {
    json_t *j = ctl_row_json(&rep.u.tenant_row);
    gmb__wire_reply_clear(&rep);
    return gmb__ctl_json_print(j);
  }
  printf("%s\n", rep.message);
  gmb__wire_reply_clear(&rep);
  return 0;
}

static int ctl_tenant_remove(struct ctl *ctl, const struct ctl_verb *v,
                             int argc, char **argv) {
  struct wire_request req;
  int rc = ctl_one_tenant(v, argc, argv, WIRE_ADMIN_TENANT_REMOVE, &req);
  if (rc) return rc;
  struct wire_reply rep;
  rc = gmb__ctl_call(ctl, v->name, &req, WIRE_NONE, &rep);
  if (rc) return rc;
  if (ctl->json) {
    json_t *j = json_pack("{s:s, s:b}", "tenant", argv[0], "removed", 1);
    gmb__wire_reply_clear(&rep);
    return gmb__ctl_json_print(j);
  }
  printf("%s\n", rep.message);
  gmb__wire_reply_clear(&rep);
  return 0;
}

int gmb__ctl_tenant(struct ctl *ctl, const struct ctl_verb *v, int argc,
                    char **argv) {
  if (argc >= 1 && strcmp(argv[0], "add") == 0)
    return ctl_tenant_add(ctl, v, argc - 1, argv + 1);
  if (argc >= 1 && strcmp(argv[0], "remove") == 0)
    return ctl_tenant_remove(ctl, v, argc - 1, argv + 1);
  return ctl_usage_fail(v, "want add or remove");
}
