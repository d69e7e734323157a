/*
 * check_statefile.c - the state file: operators' run-time quotas and
 * reservations, read at start and at reload, written atomically at each
 * change, every malformed line refused with its FILE:LINE.
 *
 * A whole broker runs on a host device (broker_fixture.h) with the state
 * path "@STATE@", a file in the fixture's scratch dir that does not exist
 * when the broker opens (an empty state).  A test then writes the file by
 * hand and loads it again with gmb__statefile_load(), which is what the
 * broker does at start on tenants the config alone made; or drives
 * gmb__statefile_set(), _reread() and _apply() as gmbctl and a reload do.
 * Writes are made to fail with a state path whose parent is a regular
 * file, so the tests hold when run as root.
 */
#include <check.h>
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "broker_fixture.h"
#include "check_main.h"
#include "statefile.h"
#include "tenant.h"
#include "util.h"

#define MIB GMB_MIB
#define GIB (UINT64_C(1) << 30)

/* "cfg": quota 8 MiB, reserve 2 MiB; others get 16 MiB. */
#define INI                                                               \
  "[broker]\nstate = @STATE@\ndefault_quota = 16MiB\n"                    \
  "[tenant:cfg]\nuids = 1001\nquota = 8MiB\nreserve = 2MiB\n"
#define INI_NO_STATE                                                      \
  "[broker]\ndefault_quota = 16MiB\n"                                     \
  "[tenant:cfg]\nuids = 1001\nquota = 8MiB\nreserve = 2MiB\n"

/* ---- helpers ---------------------------------------------------------- */

static void open_state(struct fx *f) { fx_open_ini(f, "host:64MiB", INI); }

/* The state file's path. */
static const char *state_path(const struct fx *f) {
  ck_assert_str_ne(f->b.cfg.state, "");
  return f->b.cfg.state;
}

/* Writes `len` bytes (text with NULs) as the state file. */
static void put_bytes(struct fx *f, const char *data, size_t len) {
  FILE *fp = fopen(state_path(f), "w");
  ck_assert_ptr_nonnull(fp);
  ck_assert_uint_eq(fwrite(data, 1, len, fp), len);
  ck_assert_int_eq(fclose(fp), 0);
  ck_assert_int_eq(chmod(state_path(f), 0644), 0); /* whatever the umask */
}

static void put(struct fx *f, const char *text) {
  put_bytes(f, text, strlen(text));
}

/* The state file's text (malloc'd), or NULL when there is none. */
static char *slurp(const char *path) {
  FILE *fp = fopen(path, "r");
  if (fp == NULL) return NULL;
  char *buf = calloc(1, 65536);
  ck_assert_ptr_nonnull(buf);
  size_t n = fread(buf, 1, 65535, fp);
  ck_assert_int_eq(ferror(fp), 0);
  buf[n] = '\0';
  fclose(fp);
  return buf;
}

/* 1 when the scratch dir holds exactly the config and, if `state`, the
 * state file: no temporary file was left behind. */
static int dir_clean(const struct fx *f, int state) {
  DIR *d = opendir(f->dir);
  ck_assert_ptr_nonnull(d);
  int ini = 0, st = 0, other = 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
      continue;
    if (strcmp(e->d_name, "gmb.ini") == 0)
      ini++;
    else if (strcmp(e->d_name, "state") == 0)
      st++;
    else
      other++;
  }
  closedir(d);
  return ini == 1 && st == (state ? 1 : 0) && other == 0;
}

static struct gmb_tenant *tenant(struct fx *f, const char *name) {
  return gmb__tenant_find(f->b.tenants, name);
}

static int load(struct fx *f, char *err, size_t cap) {
  err[0] = '\0';
  return gmb__statefile_load(&f->b, err, cap);
}

static int reread(struct fx *f, char *err, size_t cap) {
  err[0] = '\0';
  return gmb__statefile_reread(&f->b, err, cap);
}

static int set(struct fx *f, const char *name, enum gmb_state_field field,
               uint64_t value, int *persisted) {
  char err[512] = "";
  *persisted = -1;
  int rc = gmb__statefile_set(&f->b, name, field, value, persisted, err,
                              sizeof err);
  ck_assert_msg(rc == 0, "set %s: %s", name, err);
  return rc;
}

/* ---- loading ------------------------------------------------------------ */

START_TEST(load_no_path_is_empty) {
  struct fx f;
  fx_open_ini(&f, "host:64MiB", INI_NO_STATE);
  ck_assert_str_eq(f.b.cfg.state, "");
  char err[512];
  ck_assert_int_eq(load(&f, err, sizeof err), 0);
  ck_assert_int_eq(gmb__statefile_apply(&f.b), 0);
  ck_assert_uint_eq(tenant(&f, "cfg")->quota, 8 * MIB);
  ck_assert_uint_eq(tenant(&f, "cfg")->reserve, 2 * MIB);
  ck_assert_uint_eq(gmb__tenants_count(f.b.tenants), 1);
  fx_close(&f);
}
END_TEST

START_TEST(load_missing_file_is_empty) {
  struct fx f;
  open_state(&f);
  ck_assert_int_eq(access(state_path(&f), F_OK), -1);
  char err[512];
  ck_assert_int_eq(load(&f, err, sizeof err), 0);
  ck_assert_int_eq(gmb__statefile_apply(&f.b), 0);
  ck_assert_uint_eq(tenant(&f, "cfg")->quota, 8 * MIB);
  ck_assert_uint_eq(gmb__tenants_count(f.b.tenants), 1);
  ck_assert_int_eq(access(state_path(&f), F_OK), -1); /* not made */
  fx_close(&f);
}
END_TEST

START_TEST(load_empty_file_is_empty) {
  struct fx f;
  open_state(&f);
  char err[512];
  put(&f, "");
  ck_assert_int_eq(load(&f, err, sizeof err), 0);
  put(&f, "# only a comment\n\n; and another\n   \n");
  ck_assert_int_eq(load(&f, err, sizeof err), 0);
  put(&f, "version = 1\n");
  ck_assert_int_eq(load(&f, err, sizeof err), 0);
  ck_assert_int_eq(gmb__statefile_apply(&f.b), 0);
  ck_assert_uint_eq(gmb__tenants_count(f.b.tenants), 1);
  fx_close(&f);
}
END_TEST

START_TEST(load_applies_overrides) {
  struct fx f;
  open_state(&f);
  put(&f,
      "# written by hand\n"
      "version = 1\n"
      "\n"
      "[tenant:cfg]   ; the configured one\n"
      "quota = 20GiB  # a size\n"
      "reserve = 1048576\n"
      "\n"
      "[tenant:new]\n"
      "  quota=3MiB\n");
  char err[512];
  ck_assert_msg(load(&f, err, sizeof err) == 0, "%s", err);
  struct gmb_tenant *c = tenant(&f, "cfg");
  ck_assert_uint_eq(c->quota, 20 * GIB);
  ck_assert_uint_eq(c->reserve, MIB);
  ck_assert_int_eq(c->configured, 1);
  struct gmb_tenant *n = tenant(&f, "new");
  ck_assert_ptr_nonnull(n);
  ck_assert_uint_eq(n->quota, 3 * MIB);
  ck_assert_uint_eq(n->reserve, 0);
  ck_assert_int_eq(n->configured, 0);
  ck_assert_int_eq(n->has_owner, 0);
  ck_assert_uint_eq(gmb__tenants_count(f.b.tenants), 2);
  /* Applying again touches the same two and creates nothing. */
  ck_assert_int_eq(gmb__statefile_apply(&f.b), 2);
  ck_assert_uint_eq(gmb__tenants_count(f.b.tenants), 2);
  fx_close(&f);
}
END_TEST

START_TEST(load_one_key_leaves_the_other) {
  /* A section with one key overrides that one; the other is the config's
   * (or, for a tenant the config does not name, the default). */
  struct fx f;
  open_state(&f);
  put(&f, "version = 1\n[tenant:cfg]\nreserve = 4MiB\n"
          "[tenant:new]\nreserve = 1MiB\n[tenant:empty]\n");
  char err[512];
  ck_assert_msg(load(&f, err, sizeof err) == 0, "%s", err);
  ck_assert_uint_eq(tenant(&f, "cfg")->quota, 8 * MIB);
  ck_assert_uint_eq(tenant(&f, "cfg")->reserve, 4 * MIB);
  ck_assert_uint_eq(tenant(&f, "new")->quota, 16 * MIB);
  ck_assert_uint_eq(tenant(&f, "new")->reserve, MIB);
  /* A section with no key overrides nothing and creates no one. */
  ck_assert_ptr_null(tenant(&f, "empty"));
  fx_close(&f);
}
END_TEST

START_TEST(load_quota_zero_is_unlimited) {
  /* quota 0 means no limit: a reserve above it is fine. */
  struct fx f;
  open_state(&f);
  put(&f, "version = 1\n[tenant:cfg]\nquota = 0   # unlimited\n"
          "reserve = 4MiB\n");
  char err[512];
  ck_assert_msg(load(&f, err, sizeof err) == 0, "%s", err);
  ck_assert_uint_eq(tenant(&f, "cfg")->quota, 0);
  ck_assert_uint_eq(tenant(&f, "cfg")->reserve, 4 * MIB);
  fx_close(&f);
}
END_TEST

START_TEST(load_created_tenant_owned_by_first_uid) {
  struct fx f;
  open_state(&f);
  put(&f, "version = 1\n[tenant:new]\nquota = 3MiB\n");
  char err[512];
  ck_assert_msg(load(&f, err, sizeof err) == 0, "%s", err);
  struct gmb_session *s = fx_hello(&f, "n", 1005, "new");
  ck_assert_ptr_eq(s->tenant, tenant(&f, "new"));
  ck_assert_int_eq(s->tenant->has_owner, 1);
  ck_assert_uint_eq(s->tenant->owner_uid, 1005);
  ck_assert_uint_eq(s->tenant->quota, 3 * MIB);
  char why[256];
  struct gmb_tenant *t;
  ck_assert_int_eq(gmb__tenant_admit(f.b.tenants, "new", 1006, NULL, 0, &t,
                                     why, sizeof why),
                   GMB_E_AUTH);
  fx_close(&f);
}
END_TEST

/* A tenant made by first use belongs to its first uid; an operator's
 * quota for it is kept in the state file, and so is that uid (`owner`).
 * Before, the file kept the quota alone: after a restart the tenant came
 * back owned by nobody, with the operator's quota, so whichever local uid
 * named it first took it (and its larger quota) and its own uid was
 * refused.  Now the owner comes back with it. */
START_TEST(set_keeps_first_uid_across_restart) {
  struct fx f;
  open_state(&f);
  fx_hello(&f, "a", 1005, "job");
  int persisted;
  set(&f, "job", GMB_STATE_QUOTA, 32 * MIB, &persisted);
  ck_assert_int_eq(persisted, 1);
  /* A configured tenant has no owner to keep. */
  set(&f, "cfg", GMB_STATE_QUOTA, 4 * MIB, &persisted);
  char *text = slurp(state_path(&f));
  ck_assert_ptr_nonnull(text);
  const char *own = strstr(text, "owner = 1005");
  ck_assert_msg(own != NULL, "%s", text);
  ck_assert_msg(strstr(text, "owner") == own &&
                    strstr(own + 1, "owner") == NULL, "%s", text);
  free(text);
  fx_close(&f);
  /* The restart: the file as the broker wrote it. */
  open_state(&f);
  put(&f, "version = 1\n[tenant:job]\nowner = 1005\nquota = 33554432\n");
  char err[512];
  ck_assert_msg(load(&f, err, sizeof err) == 0, "%s", err);
  struct gmb_tenant *t = tenant(&f, "job");
  ck_assert_ptr_nonnull(t);
  ck_assert_int_eq(t->has_owner, 1);
  ck_assert_uint_eq(t->owner_uid, 1005);
  char why[256];
  struct gmb_tenant *got;
  ck_assert_int_eq(gmb__tenant_admit(f.b.tenants, "job", 1006, NULL, 0, &got,
                                     why, sizeof why),
                   GMB_E_AUTH);
  struct gmb_session *s = fx_hello(&f, "a", 1005, "job");
  ck_assert_ptr_eq(s->tenant, t);
  ck_assert_uint_eq(t->quota, 32 * MIB);
  fx_close(&f);
}
END_TEST

/* `owner` is a uid: one given twice, outside a section, or not a number
 * below 2^32 - 1 is refused with its line. */
START_TEST(load_bad_owner_refused) {
  static const char *const bad[] = {
      "version = 1\n[tenant:j]\nquota = 1MiB\nowner = 1\nowner = 2\n",
      "version = 1\n[tenant:j]\nquota = 1MiB\nowner = x\n",
      "version = 1\n[tenant:j]\nquota = 1MiB\nowner = -1\n",
      "version = 1\n[tenant:j]\nquota = 1MiB\nowner = 4294967295\n",
      "version = 1\n[tenant:j]\nquota = 1MiB\nowner = 1MiB\n",
      "version = 1\nowner = 5\n",
  };
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
    struct fx f;
    open_state(&f);
    put(&f, bad[i]);
    char err[512];
    ck_assert_msg(load(&f, err, sizeof err) == GMB_E_INVAL, "case %zu", i);
    ck_assert_msg(strstr(err, ":4:") || strstr(err, ":5:") ||
                      strstr(err, ":2:"),
                  "case %zu: %s", i, err);
    fx_close(&f);
  }
}
END_TEST

START_TEST(load_longest_name) {
  struct fx f;
  open_state(&f);
  const char *name =
      "a12345678901234567890123456789012345678901234567890123456789012";
  ck_assert_uint_eq(strlen(name), 63);
  char text[256];
  snprintf(text, sizeof text, "version = 1\n[tenant:%s]\nquota = 1MiB\n",
           name);
  put(&f, text);
  char err[512];
  ck_assert_msg(load(&f, err, sizeof err) == 0, "%s", err);
  ck_assert_ptr_nonnull(tenant(&f, name));
  ck_assert_uint_eq(tenant(&f, name)->quota, MIB);
  int persisted;
  set(&f, name, GMB_STATE_RESERVE, MIB, &persisted);
  ck_assert_msg(reread(&f, err, sizeof err) == 0, "%s", err);
  ck_assert_int_eq(gmb__statefile_apply(&f.b), 1);
  ck_assert_uint_eq(tenant(&f, name)->reserve, MIB);
  fx_close(&f);
}
END_TEST

START_TEST(load_too_many_tenants_is_limit) {
  /* More tenants than the registry holds (4096, one is the config's):
   * the load fails, naming the file. */
  struct fx f;
  open_state(&f);
  size_t cap = 4200 * 40, off = 0;
  char *text = malloc(cap);
  ck_assert_ptr_nonnull(text);
  off += (size_t)snprintf(text, cap, "version = 1\n");
  for (int i = 0; i < 4096; i++)
    off += (size_t)snprintf(text + off, cap - off,
                            "[tenant:t%04d]\nquota = 1MiB\n", i);
  ck_assert_uint_lt(off, cap);
  put(&f, text);
  free(text);
  char err[512];
  ck_assert_int_eq(load(&f, err, sizeof err), GMB_E_LIMIT);
  ck_assert_ptr_nonnull(strstr(err, state_path(&f)));
  ck_assert_ptr_nonnull(strstr(err, "could not be created"));
  ck_assert_ptr_null(tenant(&f, "t4095"));
  fx_close(&f);
}
END_TEST

/* One malformed file: what it holds, the line named, part of the reason. */
struct bad_case {
  const char *what;
  const char *text;
  size_t len; /* 0: strlen(text) */
  int line;
  const char *reason;
};

#define NUL_TEXT "version = 1\n[tenant:a]\nquo\0ta = 1\n"

static const struct bad_case bad_cases[] = {
    {"key_outside_section", "version = 1\nquota = 1MiB\n", 0, 2,
     "unknown key outside a tenant section"},
    {"version_wrong", "# v2\nversion = 2\n", 0, 2,
     "version is not one this broker reads"},
    {"version_in_section", "version = 1\n[tenant:a]\nversion = 1\n", 0, 3,
     "[tenant:a] unknown key (want quota, reserve or owner)"},
    {"unknown_key", "version = 1\n[tenant:a]\nquota = 1\nlimit = 3\n", 0, 4,
     "[tenant:a] unknown key (want quota, reserve or owner)"},
    {"bad_size", "version = 1\n[tenant:a]\nquota = lots\n", 0, 3,
     "[tenant:a] quota: bad size"},
    {"negative_size", "version = 1\n[tenant:a]\nreserve = -1\n", 0, 3,
     "[tenant:a] reserve: bad size"},
    {"size_overflow", "version = 1\n[tenant:a]\nquota = 99999999999999999999\n",
     0, 3, "bad size"},
    {"size_bad_unit", "version = 1\n[tenant:a]\nquota = 3 parsecs\n", 0, 3,
     "bad size"},
    {"comment_glued_to_value", "version = 1\n[tenant:a]\nquota = 3MiB#x\n", 0,
     3, "[tenant:a] quota: bad size"},
    {"empty_value", "version = 1\n[tenant:a]\nquota =\n", 0, 3, "bad size"},
    {"key_twice",
     "version = 1\n[tenant:a]\nquota = 1\nreserve = 0\nquota = 2\n", 0, 5,
     "[tenant:a] quota given twice"},
    {"section_twice", "version = 1\n[tenant:a]\nquota = 1\n\n[tenant:a]\n", 0,
     5, "[tenant:a] given twice (first at line 2)"},
    {"section_not_tenant", "version = 1\n[broker]\n", 0, 2,
     "bad section header (want [tenant:NAME])"},
    {"section_unclosed", "version = 1\n[tenant:a\n", 0, 2, "bad section"},
    {"section_spaced", "version = 1\n[ tenant:a ]\n", 0, 2, "bad section"},
    {"tenant_name_bad", "version = 1\n[tenant:a b]\n", 0, 2,
     "bad tenant name (want 1 to 63"},
    {"tenant_name_empty", "version = 1\n[tenant:]\n", 0, 2,
     "bad tenant name"},
    {"tenant_name_dot", "version = 1\n[tenant:.hidden]\n", 0, 2,
     "bad tenant name"},
    {"tenant_name_long",
     "version = 1\n[tenant:"
     "a123456789012345678901234567890123456789012345678901234567890123]\n",
     0, 2, "bad tenant name"},
    {"no_equals", "version = 1\n[tenant:a]\nquota 1MiB\n", 0, 3,
     "syntax error (want key = value"},
    {"no_version", "# old file\n[tenant:a]\nquota = 1\n", 0, 1,
     "no version = 1 line"},
    {"reserve_above_quota",
     "version = 1\n\n[tenant:a]\nquota = 1MiB\nreserve = 2MiB\n", 0, 3,
     "[tenant:a] reserve is more than quota"},
    {"nul_byte", NUL_TEXT, sizeof NUL_TEXT - 1, 3,
     "NUL byte in line"},
};

START_TEST(load_malformed_names_file_line) {
  const struct bad_case *c = &bad_cases[_i];
  struct fx f;
  open_state(&f);
  put_bytes(&f, c->text, c->len ? c->len : strlen(c->text));
  char err[512], want[512];
  snprintf(want, sizeof want, "%s:%d: ", state_path(&f), c->line);
  ck_assert_msg(load(&f, err, sizeof err) == GMB_E_INVAL, "%s: accepted",
                c->what);
  ck_assert_msg(strncmp(err, want, strlen(want)) == 0,
                "%s: '%s' does not start with '%s'", c->what, err, want);
  ck_assert_msg(strstr(err, c->reason) != NULL, "%s: '%s' lacks '%s'",
                c->what, err, c->reason);
  /* Only the path, the line and the reason: nothing the file holds is
   * quoted back (a valid tenant name is the one exception). */
  ck_assert_msg(strchr(err + strlen(want), '\'') == NULL,
                "%s: '%s' quotes the file", c->what, err);
  /* Nothing applied: no tenant made, the config's values stand. */
  ck_assert_uint_eq(gmb__tenants_count(f.b.tenants), 1);
  ck_assert_uint_eq(tenant(&f, "cfg")->quota, 8 * MIB);
  ck_assert_int_eq(gmb__statefile_apply(&f.b), 0);
  /* A reload reads it the same way. */
  ck_assert_int_eq(reread(&f, err, sizeof err), GMB_E_INVAL);
  ck_assert_msg(strncmp(err, want, strlen(want)) == 0, "%s: reread '%s'",
                c->what, err);
  fx_close(&f);
}
END_TEST

START_TEST(load_error_keeps_earlier_overrides) {
  struct fx f;
  open_state(&f);
  put(&f, "version = 1\n[tenant:cfg]\nquota = 12MiB\n");
  char err[512];
  ck_assert_msg(load(&f, err, sizeof err) == 0, "%s", err);
  put(&f, "version = 1\n[tenant:cfg]\nquota = 4MiB\nbogus = 1\n");
  ck_assert_int_eq(load(&f, err, sizeof err), GMB_E_INVAL);
  ck_assert_uint_eq(tenant(&f, "cfg")->quota, 12 * MIB);
  ck_assert_int_eq(reread(&f, err, sizeof err), GMB_E_INVAL);
  gmb__tenant_set_quota(f.b.tenants, tenant(&f, "cfg"), 8 * MIB);
  ck_assert_int_eq(gmb__statefile_apply(&f.b), 1);
  ck_assert_uint_eq(tenant(&f, "cfg")->quota, 12 * MIB);
  fx_close(&f);
}
END_TEST

START_TEST(load_unreadable_is_system_error) {
  struct fx f;
  open_state(&f);
  char err[512], want[512];
  /* A directory opens but cannot be read. */
  ck_assert_int_eq(mkdir(state_path(&f), 0755), 0);
  ck_assert_int_eq(load(&f, err, sizeof err), GMB_E_SYSTEM);
  snprintf(want, sizeof want, "%s: ", state_path(&f));
  ck_assert_msg(strncmp(err, want, strlen(want)) == 0, "'%s'", err);
  ck_assert_int_eq(reread(&f, err, sizeof err), GMB_E_SYSTEM);
  ck_assert_int_eq(rmdir(state_path(&f)), 0);
  ck_assert_uint_eq(tenant(&f, "cfg")->quota, 8 * MIB);
  fx_close(&f);
}
END_TEST

START_TEST(load_parent_not_a_dir_is_system_error) {
  struct fx f;
  fx_open_ini(&f, "host:64MiB", INI_NO_STATE);
  char path[256], err[512];
  fx_write(&f, "plain", "not a directory\n", path, sizeof path);
  snprintf(f.b.cfg.state, sizeof f.b.cfg.state, "%s/state", path);
  ck_assert_int_eq(load(&f, err, sizeof err), GMB_E_SYSTEM);
  ck_assert_ptr_nonnull(strstr(err, "cannot open"));
  fx_close(&f);
}
END_TEST

/* ---- who may write it ---------------------------------------------------- */

/*
 * A state file sets quotas, so one that someone other than the broker's
 * uid (or root) could have written is refused, and so is a symbolic link:
 * pointed at /etc/shadow, the broker used to quote its first line in the
 * start-up error.  The refusal names the file, the owner and the mode it
 * wants.
 */
static void assert_refused(struct fx *f, const char *what) {
  char err[512];
  ck_assert_int_eq(load(f, err, sizeof err), GMB_E_AUTH);
  ck_assert_msg(strstr(err, state_path(f)) == err, "%s: '%s'", what, err);
  ck_assert_msg(strstr(err, "refused") != NULL, "%s: '%s'", what, err);
  ck_assert_msg(strstr(err, "owned by uid") != NULL, "%s: '%s'", what, err);
  ck_assert_msg(strstr(err, "0644") != NULL, "%s: '%s'", what, err);
  ck_assert_msg(strstr(err, "SECRET") == NULL, "%s echoes: '%s'", what, err);
  /* Nothing applied: the config's quota stands, no tenant was made. */
  ck_assert_uint_eq(tenant(f, "cfg")->quota, 8 * MIB);
  ck_assert_uint_eq(gmb__tenants_count(f->b.tenants), 1);
  ck_assert_int_eq(reread(f, err, sizeof err), GMB_E_AUTH);
}

START_TEST(load_symlink_refused) {
  struct fx f;
  open_state(&f);
  char target[256];
  fx_write(&f, "shadow", "root:SECRET$6$salt$hash:19000:0:99999:7:::\n",
           target, sizeof target);
  ck_assert_int_eq(symlink(target, state_path(&f)), 0);
  assert_refused(&f, "symlink to a non-state file");
  /* Nor is a link to a valid state file followed. */
  ck_assert_int_eq(unlink(state_path(&f)), 0);
  fx_write(&f, "good", "version = 1\n[tenant:cfg]\nquota = 1MiB\n", target,
           sizeof target);
  ck_assert_int_eq(symlink(target, state_path(&f)), 0);
  assert_refused(&f, "symlink to a state file");
  ck_assert_int_eq(unlink(state_path(&f)), 0);
  fx_close(&f);
}
END_TEST

START_TEST(load_group_or_other_writable_refused) {
  static const mode_t modes[] = {0666, 0646, 0664, 0620};
  for (size_t i = 0; i < sizeof modes / sizeof modes[0]; i++) {
    struct fx f;
    open_state(&f);
    put(&f, "version = 1\n[tenant:cfg]\nquota = 1MiB\n");
    ck_assert_int_eq(chmod(state_path(&f), modes[i]), 0);
    assert_refused(&f, "writable by others");
    fx_close(&f);
  }
}
END_TEST

START_TEST(load_foreign_owner_refused) {
  if (geteuid() != 0) {
    /* Giving a file away takes root; the mode test covers the check. */
    fprintf(stderr, "load_foreign_owner_refused: skipped (needs root to "
                    "chown a file to another uid)\n");
    return;
  }
  struct fx f;
  open_state(&f);
  put(&f, "version = 1\n[tenant:cfg]\nquota = 1MiB\n");
  ck_assert_int_eq(chown(state_path(&f), 4242, 4242), 0);
  ck_assert_int_eq(chmod(state_path(&f), 0600), 0);
  assert_refused(&f, "owned by another uid");
  /* Root's own file is trusted (the broker may run as another uid). */
  ck_assert_int_eq(chown(state_path(&f), 0, 0), 0);
  char err[512];
  ck_assert_msg(load(&f, err, sizeof err) == 0, "%s", err);
  ck_assert_uint_eq(tenant(&f, "cfg")->quota, 1 * MIB);
  fx_close(&f);
}
END_TEST

START_TEST(load_fifo_refused_without_blocking) {
  struct fx f;
  open_state(&f);
  ck_assert_int_eq(mkfifo(state_path(&f), 0600), 0);
  char err[512];
  ck_assert_int_eq(load(&f, err, sizeof err), GMB_E_SYSTEM);
  ck_assert_ptr_nonnull(strstr(err, "not a regular file"));
  ck_assert_int_eq(unlink(state_path(&f)), 0);
  fx_close(&f);
}
END_TEST

START_TEST(load_unparsed_line_not_echoed) {
  struct fx f;
  open_state(&f);
  put(&f, "version = 1\nroot:SECRET$6$salt$hash:19000:0:99999:7:::\n");
  char err[512], want[512];
  ck_assert_int_eq(load(&f, err, sizeof err), GMB_E_INVAL);
  snprintf(want, sizeof want, "%s:2: ", state_path(&f));
  ck_assert_msg(strncmp(err, want, strlen(want)) == 0, "'%s'", err);
  ck_assert_msg(strstr(err, "SECRET") == NULL, "echoes: '%s'", err);
  ck_assert_msg(strstr(err, "root:") == NULL, "echoes: '%s'", err);
  fx_close(&f);
}
END_TEST

/* ---- setting ------------------------------------------------------------ */

START_TEST(set_writes_file) {
  struct fx f;
  open_state(&f);
  int persisted;
  set(&f, "cfg", GMB_STATE_QUOTA, 20 * GIB, &persisted);
  ck_assert_int_eq(persisted, 1);
  set(&f, "new", GMB_STATE_RESERVE, 3 * MIB, &persisted);
  ck_assert_int_eq(persisted, 1);
  char *text = slurp(state_path(&f));
  ck_assert_ptr_nonnull(text);
  ck_assert_ptr_nonnull(strstr(text, "\nversion = 1\n"));
  ck_assert_ptr_nonnull(
      strstr(text, "\n[tenant:cfg]\nquota = 21474836480   # 20GiB\n"));
  ck_assert_ptr_nonnull(
      strstr(text, "\n[tenant:new]\nreserve = 3145728   # 3MiB\n"));
  ck_assert_ptr_null(strstr(text, "[tenant:cfg]\nquota = 21474836480   "
                                  "# 20GiB\nreserve"));
  free(text);
  struct stat st;
  ck_assert_int_eq(stat(state_path(&f), &st), 0);
  ck_assert_uint_eq(st.st_mode & 0777, 0644);
  ck_assert(dir_clean(&f, 1));
  /* set records; the caller applies.  The file reads back the same. */
  ck_assert_uint_eq(tenant(&f, "cfg")->quota, 8 * MIB);
  ck_assert_ptr_null(tenant(&f, "new"));
  char err[512];
  ck_assert_msg(reread(&f, err, sizeof err) == 0, "%s", err);
  ck_assert_int_eq(gmb__statefile_apply(&f.b), 2);
  ck_assert_uint_eq(tenant(&f, "cfg")->quota, 20 * GIB);
  ck_assert_uint_eq(tenant(&f, "cfg")->reserve, 2 * MIB);
  ck_assert_uint_eq(tenant(&f, "new")->reserve, 3 * MIB);
  ck_assert_uint_eq(tenant(&f, "new")->quota, 16 * MIB);
  fx_close(&f);
}
END_TEST

START_TEST(set_both_fields_one_section) {
  struct fx f;
  open_state(&f);
  int persisted;
  set(&f, "cfg", GMB_STATE_QUOTA, 6 * MIB, &persisted);
  set(&f, "cfg", GMB_STATE_RESERVE, 3 * MIB, &persisted);
  set(&f, "cfg", GMB_STATE_QUOTA, 7 * MIB, &persisted); /* replaced */
  char *text = slurp(state_path(&f));
  ck_assert_ptr_nonnull(text);
  ck_assert_ptr_nonnull(strstr(text, "\n[tenant:cfg]\nquota = 7340032   "
                                     "# 7MiB\nreserve = 3145728   # 3MiB\n"));
  ck_assert_ptr_eq(strstr(text, "[tenant:"), strrchr(text, '['));
  free(text);
  ck_assert(dir_clean(&f, 1));
  fx_close(&f);
}
END_TEST

START_TEST(set_back_to_config_removes_override) {
  struct fx f;
  open_state(&f);
  int persisted;
  set(&f, "cfg", GMB_STATE_QUOTA, 12 * MIB, &persisted);
  set(&f, "cfg", GMB_STATE_RESERVE, 4 * MIB, &persisted);
  set(&f, "cfg", GMB_STATE_QUOTA, 8 * MIB, &persisted); /* the config's */
  ck_assert_int_eq(persisted, 1);
  char *text = slurp(state_path(&f));
  ck_assert_ptr_nonnull(strstr(text, "\n[tenant:cfg]\nreserve = 4194304"));
  ck_assert_ptr_null(strstr(text, "quota ="));
  free(text);
  set(&f, "cfg", GMB_STATE_RESERVE, 2 * MIB, &persisted);
  ck_assert_int_eq(persisted, 1);
  text = slurp(state_path(&f));
  ck_assert_ptr_null(strstr(text, "[tenant:"));
  ck_assert_ptr_nonnull(strstr(text, "\nversion = 1\n"));
  free(text);
  ck_assert(dir_clean(&f, 1));
  /* No override left: the config rules again. */
  gmb__tenant_set_quota(f.b.tenants, tenant(&f, "cfg"), 12 * MIB);
  char err[512];
  ck_assert_int_eq(reread(&f, err, sizeof err), 0);
  ck_assert_int_eq(gmb__statefile_apply(&f.b), 0);
  ck_assert_uint_eq(tenant(&f, "cfg")->quota, 12 * MIB);
  fx_close(&f);
}
END_TEST

START_TEST(set_config_value_without_override) {
  /* The config's value, set when no override exists: the file says
   * nothing of the tenant. */
  struct fx f;
  open_state(&f);
  int persisted;
  set(&f, "cfg", GMB_STATE_QUOTA, 8 * MIB, &persisted);
  ck_assert_int_eq(persisted, 1);
  char *text = slurp(state_path(&f));
  ck_assert_ptr_nonnull(text);
  ck_assert_ptr_null(strstr(text, "[tenant:"));
  free(text);
  ck_assert_int_eq(gmb__statefile_apply(&f.b), 0);
  fx_close(&f);
}
END_TEST

START_TEST(set_unconfigured_zero_is_an_override) {
  /* A tenant the config does not name has no config value to go back
   * to: quota 0 (no limit) is an override like any other. */
  struct fx f;
  open_state(&f);
  int persisted;
  set(&f, "new", GMB_STATE_QUOTA, 0, &persisted);
  set(&f, "new", GMB_STATE_RESERVE, 0, &persisted);
  char *text = slurp(state_path(&f));
  ck_assert_ptr_nonnull(strstr(text, "\n[tenant:new]\nquota = 0   "
                                     "# unlimited\nreserve = 0   # 0B\n"));
  free(text);
  char err[512];
  ck_assert_msg(reread(&f, err, sizeof err) == 0, "%s", err);
  ck_assert_int_eq(gmb__statefile_apply(&f.b), 1);
  ck_assert_uint_eq(tenant(&f, "new")->quota, 0);
  fx_close(&f);
}
END_TEST

START_TEST(set_without_path_not_persisted) {
  struct fx f;
  fx_open_ini(&f, "host:64MiB", INI_NO_STATE);
  int persisted;
  set(&f, "cfg", GMB_STATE_QUOTA, 12 * MIB, &persisted);
  ck_assert_int_eq(persisted, 0);
  ck_assert(dir_clean(&f, 0));
  /* Kept in memory: a reload (reread) keeps it and applies it. */
  char err[512];
  ck_assert_int_eq(reread(&f, err, sizeof err), 0);
  ck_assert_int_eq(gmb__statefile_apply(&f.b), 1);
  ck_assert_uint_eq(tenant(&f, "cfg")->quota, 12 * MIB);
  set(&f, "cfg", GMB_STATE_QUOTA, 8 * MIB, &persisted);
  ck_assert_int_eq(persisted, 0);
  ck_assert_int_eq(gmb__statefile_apply(&f.b), 0);
  fx_close(&f);
}
END_TEST

START_TEST(set_write_fails_changes_nothing) {
  /* The state path's parent is a regular file: no file can be made
   * beside it (root or not). */
  struct fx f;
  fx_open_ini(&f, "host:64MiB",
              "[broker]\nstate = @STATE@/s\n"
              "[tenant:cfg]\nuids = 1001\nquota = 8MiB\n");
  char dir[256];
  snprintf(dir, sizeof dir, "%s/state", f.dir);
  ck_assert_int_eq(mkdir(dir, 0755), 0);
  int persisted;
  set(&f, "cfg", GMB_STATE_QUOTA, 12 * MIB, &persisted); /* works */
  ck_assert_int_eq(persisted, 1);
  char cmd[300];
  snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
  ck_assert_int_eq(system(cmd), 0);
  char path[256];
  fx_write(&f, "state", "a regular file\n", path, sizeof path);
  char err[512] = "";
  persisted = -1;
  ck_assert_int_eq(gmb__statefile_set(&f.b, "cfg", GMB_STATE_QUOTA, 4 * MIB,
                                      &persisted, err, sizeof err),
                   GMB_E_SYSTEM);
  ck_assert_int_eq(persisted, 0);
  ck_assert_ptr_nonnull(strstr(err, f.b.cfg.state));
  ck_assert_ptr_nonnull(strstr(err, "Not a directory"));
  err[0] = '\0';
  ck_assert_int_eq(gmb__statefile_set(&f.b, "other", GMB_STATE_RESERVE, MIB,
                                      &persisted, err, sizeof err),
                   GMB_E_SYSTEM);
  ck_assert(dir_clean(&f, 1));
  /* Neither failed value is recorded: apply shows the last good one, and
   * a reload cannot read the file at all. */
  ck_assert_int_eq(gmb__statefile_apply(&f.b), 1);
  ck_assert_uint_eq(tenant(&f, "cfg")->quota, 12 * MIB);
  ck_assert_ptr_null(tenant(&f, "other"));
  ck_assert_int_eq(reread(&f, err, sizeof err), GMB_E_SYSTEM);
  ck_assert_int_eq(gmb__statefile_apply(&f.b), 1);
  ck_assert_uint_eq(tenant(&f, "cfg")->quota, 12 * MIB);
  fx_close(&f);
}
END_TEST

START_TEST(set_rename_fails_leaves_no_temp) {
  /* The temporary file is written beside the state path, then cannot
   * replace it (a directory is there): it is removed, nothing recorded. */
  struct fx f;
  open_state(&f);
  ck_assert_int_eq(mkdir(state_path(&f), 0755), 0);
  char err[512] = "";
  int persisted = -1;
  ck_assert_int_eq(gmb__statefile_set(&f.b, "cfg", GMB_STATE_QUOTA, 4 * MIB,
                                      &persisted, err, sizeof err),
                   GMB_E_SYSTEM);
  ck_assert_int_eq(persisted, 0);
  ck_assert_ptr_nonnull(strstr(err, "cannot rename"));
  ck_assert(dir_clean(&f, 1));
  ck_assert_int_eq(rmdir(state_path(&f)), 0);
  ck_assert_int_eq(gmb__statefile_apply(&f.b), 0);
  ck_assert_uint_eq(tenant(&f, "cfg")->quota, 8 * MIB);
  fx_close(&f);
}
END_TEST

/* ---- reload ------------------------------------------------------------- */

START_TEST(reread_after_hand_edit) {
  struct fx f;
  open_state(&f);
  int persisted;
  set(&f, "cfg", GMB_STATE_QUOTA, 12 * MIB, &persisted);
  ck_assert_int_eq(gmb__statefile_apply(&f.b), 1);
  /* An operator edits the file: cfg's override goes, two come. */
  put(&f, "version = 1\n[tenant:cfg]\nreserve = 1MiB\n"
          "[tenant:edited]\nquota = 5MiB\nreserve = 1MiB\n");
  /* Reading changes no tenant; applying does. */
  char err[512];
  ck_assert_msg(reread(&f, err, sizeof err) == 0, "%s", err);
  ck_assert_ptr_null(tenant(&f, "edited"));
  ck_assert_uint_eq(tenant(&f, "cfg")->reserve, 2 * MIB);
  ck_assert_int_eq(gmb__statefile_apply(&f.b), 2);
  ck_assert_uint_eq(tenant(&f, "cfg")->reserve, MIB);
  ck_assert_uint_eq(tenant(&f, "edited")->quota, 5 * MIB);
  ck_assert_uint_eq(tenant(&f, "edited")->reserve, MIB);
  /* The next set starts from what was read, not from before the edit. */
  set(&f, "other", GMB_STATE_QUOTA, 6 * MIB, &persisted);
  char *text = slurp(state_path(&f));
  ck_assert_ptr_nonnull(strstr(text, "[tenant:edited]"));
  ck_assert_ptr_nonnull(strstr(text, "[tenant:other]"));
  ck_assert_ptr_nonnull(strstr(text, "[tenant:cfg]\nreserve = 1048576"));
  ck_assert_ptr_null(strstr(text, "12MiB"));
  free(text);
  fx_close(&f);
}
END_TEST

START_TEST(reread_file_removed_is_empty) {
  struct fx f;
  open_state(&f);
  int persisted;
  set(&f, "cfg", GMB_STATE_QUOTA, 12 * MIB, &persisted);
  ck_assert_int_eq(unlink(state_path(&f)), 0);
  char err[512];
  ck_assert_int_eq(reread(&f, err, sizeof err), 0);
  ck_assert_int_eq(gmb__statefile_apply(&f.b), 0);
  fx_close(&f);
}
END_TEST

START_TEST(free_null) {
  struct fx f;
  fx_open(&f);
  gmb__statefile_free(NULL);
  fx_close(&f);
}
END_TEST

static Suite *statefile_suite(void) {
  Suite *s = suite_create("statefile");
  TCase *tc = tcase_create("load");
  tcase_add_test(tc, load_no_path_is_empty);
  tcase_add_test(tc, load_missing_file_is_empty);
  tcase_add_test(tc, load_empty_file_is_empty);
  tcase_add_test(tc, load_applies_overrides);
  tcase_add_test(tc, load_one_key_leaves_the_other);
  tcase_add_test(tc, load_quota_zero_is_unlimited);
  tcase_add_test(tc, load_created_tenant_owned_by_first_uid);
  tcase_add_test(tc, load_bad_owner_refused);
  tcase_add_test(tc, load_longest_name);
  tcase_add_test(tc, load_too_many_tenants_is_limit);
  suite_add_tcase(s, tc);

  tc = tcase_create("malformed");
  tcase_add_loop_test(tc, load_malformed_names_file_line, 0,
                      (int)(sizeof bad_cases / sizeof bad_cases[0]));
  tcase_add_test(tc, load_error_keeps_earlier_overrides);
  tcase_add_test(tc, load_unreadable_is_system_error);
  tcase_add_test(tc, load_parent_not_a_dir_is_system_error);
  suite_add_tcase(s, tc);

  tc = tcase_create("trust");
  tcase_add_test(tc, load_symlink_refused);
  tcase_add_test(tc, load_group_or_other_writable_refused);
  tcase_add_test(tc, load_foreign_owner_refused);
  tcase_add_test(tc, load_fifo_refused_without_blocking);
  tcase_add_test(tc, load_unparsed_line_not_echoed);
  suite_add_tcase(s, tc);

  tc = tcase_create("set");
  tcase_add_test(tc, set_writes_file);
  tcase_add_test(tc, set_keeps_first_uid_across_restart);
  tcase_add_test(tc, set_both_fields_one_section);
  tcase_add_test(tc, set_back_to_config_removes_override);
  tcase_add_test(tc, set_config_value_without_override);
  tcase_add_test(tc, set_unconfigured_zero_is_an_override);
  tcase_add_test(tc, set_without_path_not_persisted);
  tcase_add_test(tc, set_write_fails_changes_nothing);
  tcase_add_test(tc, set_rename_fails_leaves_no_temp);
  suite_add_tcase(s, tc);

  tc = tcase_create("reload");
  tcase_add_test(tc, reread_after_hand_edit);
  tcase_add_test(tc, reread_file_removed_is_empty);
  tcase_add_test(tc, free_null);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) { return check_run(statefile_suite()); }
