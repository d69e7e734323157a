/*
 * check_config.c - broker/config.c: the INI file, its errors and defaults.
 *
 * Each case writes a small file with mkstemp and loads it.  An error must be
 * GMB_E_INVAL with a message that starts with "FILE:LINE: " for the line at
 * fault, and must leave *out exactly as it was (the struct is filled with a
 * byte pattern first and compared afterwards): a broker that fails to reload
 * keeps its old configuration.
 */
#include <check.h>
#include <errno.h>
#include <pwd.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check_main.h"
#include "config.h"
#include "gmb.h"
#include "log.h"
#include "util.h"

#define TOKEN_HEX "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"

static char cfg_path[64];

static const char *write_cfg_n(const char *text, size_t n) {
  const char *dir = getenv("TMPDIR");
  snprintf(cfg_path, sizeof cfg_path, "%s/gmb-cfg-XXXXXX",
           dir && *dir && strlen(dir) < 40 ? dir : "/tmp");
  int fd = mkstemp(cfg_path);
  ck_assert_msg(fd >= 0, "mkstemp: %s", strerror(errno));
  ck_assert_int_eq(write(fd, text, n), (ssize_t)n);
  close(fd);
  return cfg_path;
}

static const char *write_cfg(const char *text) {
  return write_cfg_n(text, strlen(text));
}

static void teardown(void) {
  if (cfg_path[0]) unlink(cfg_path);
  cfg_path[0] = '\0';
}

/* Loads `text`; must succeed.  The caller frees *c. */
static void load_ok(const char *text, struct gmb_config *c) {
  char err[512] = "";
  const char *path = write_cfg(text);
  int rc = gmb__config_load(path, c, err, sizeof err);
  ck_assert_msg(rc == 0, "load failed (%d): %s", rc, err);
  ck_assert_str_eq(err, "");
}

/*
 * Loads `text`; must fail with GMB_E_INVAL at `line` with `what` in the
 * message, and leave *out untouched.  Returns the message.
 */
static const char *load_bad(const char *text, int line, const char *what) {
  static char err[512];
  struct gmb_config c, before;
  memset(&c, 0xa5, sizeof c);
  memcpy(&before, &c, sizeof c);
  const char *path = write_cfg(text);
  err[0] = '\0';
  int rc = gmb__config_load(path, &c, err, sizeof err);
  ck_assert_msg(rc == GMB_E_INVAL, "rc %d, want GMB_E_INVAL (err: %s)", rc,
                err);
  char prefix[96];
  snprintf(prefix, sizeof prefix, "%s:%d: ", path, line);
  ck_assert_msg(strncmp(err, prefix, strlen(prefix)) == 0,
                "message '%s' does not start with '%s'", err, prefix);
  ck_assert_msg(strstr(err, what) != NULL, "message '%s' lacks '%s'", err,
                what);
  ck_assert_msg(memcmp(&c, &before, sizeof c) == 0,
                "a failed load changed *out");
  return err + strlen(prefix);
}

static const char *design_config =
    "[broker]\n"
    "device = auto            ; cuda:0, host:8GiB\n"
    "capacity = 70GiB         ; optional cap below what the device has\n"
    "device_reserve = 1GiB    ; cuda: left to the driver and other users\n"
    "run_dir = /run/gmb\n"
    "state = /var/lib/gmb/state   ; run-time quota changes survive a restart\n"
    "admin_uids = 0\n"
    "default_quota = 0        ; for tenants the config does not name\n"
    "compaction = auto        ; or off\n"
    "compaction_threshold = 0.3\n"
    "metrics_listen = 127.0.0.1:9464\n"
    "[tenant:llm-a]\n"
    "quota = 20GiB\n"
    "reserve = 4GiB\n"
    "uids = 1001,1002\n"
    "token_sha256 = " TOKEN_HEX "   ; sha256 of the tenant's token\n"
    "priority = 10\n";

START_TEST(design_example_parses) {
  struct gmb_config c;
  load_ok(design_config, &c);
  ck_assert_str_eq(c.device, "auto");
  ck_assert_uint_eq(c.capacity, 70 * GMB_GIB);
  ck_assert_uint_eq(c.device_reserve, GMB_GIB);
  ck_assert_str_eq(c.run_dir, "/run/gmb");
  ck_assert_str_eq(c.state, "/var/lib/gmb/state");
  ck_assert_uint_eq(c.n_admin_uids, 1);
  ck_assert_uint_eq(c.admin_uids[0], 0);
  ck_assert_uint_eq(c.default_quota, 0);
  ck_assert_int_eq(c.compaction, 1);
  ck_assert_double_eq_tol(c.compaction_threshold, 0.3, 1e-12);
  ck_assert_str_eq(c.metrics_listen, "127.0.0.1:9464");
  ck_assert_int_eq(c.log_level, GMB_LOG_INFO);
  ck_assert_uint_eq(c.heartbeat_ms, 1000);
  ck_assert_uint_eq(c.trim_wait_ms, 100); /* not in the file: the default */
  ck_assert_uint_eq(c.segment_linger_ms, 2000);
  ck_assert_int_eq(c.admin_http, 1);      /* the default: served */
  ck_assert_uint_eq(c.n_tenants, 1);
  const struct gmb_tenant_conf *t = gmb__config_tenant(&c, "llm-a");
  ck_assert_ptr_nonnull(t);
  ck_assert_ptr_eq(t, &c.tenants[0]);
  ck_assert_str_eq(t->name, "llm-a");
  ck_assert_uint_eq(t->quota, 20 * GMB_GIB);
  ck_assert_uint_eq(t->reserve, 4 * GMB_GIB);
  ck_assert_uint_eq(t->n_uids, 2);
  ck_assert_uint_eq(t->uids[0], 1001);
  ck_assert_uint_eq(t->uids[1], 1002);
  ck_assert_int_eq(t->has_token, 1);
  static const uint8_t want[32] = {
      0x9f, 0x86, 0xd0, 0x81, 0x88, 0x4c, 0x7d, 0x65, 0x9a, 0x2f, 0xea,
      0xa0, 0xc5, 0x5a, 0xd0, 0x15, 0xa3, 0xbf, 0x4f, 0x1b, 0x2b, 0x0b,
      0x82, 0x2c, 0xd1, 0x5d, 0x6c, 0x15, 0xb0, 0xf0, 0x0a, 0x08};
  ck_assert_mem_eq(t->token_sha256, want, 32);
  ck_assert_int_eq(t->priority, 10);
  ck_assert_int_eq(t->line, 12);
  ck_assert_ptr_null(gmb__config_tenant(&c, "llm-b"));
  ck_assert_ptr_null(gmb__config_tenant(&c, "llm-a "));
  ck_assert_ptr_null(gmb__config_tenant(&c, NULL));
  gmb__config_free(&c);
  ck_assert_ptr_null(c.tenants);
  ck_assert_uint_eq(c.n_tenants, 0);
  gmb__config_free(&c); /* twice is harmless */
}
END_TEST

/* The commented example in deploy/ must stay loadable.  make check runs
 * tests from the top of the tree; a build folder's tests/ is tried too. */
START_TEST(deploy_example_parses) {
  static const char *where[] = {"deploy/gmb.ini.example",
                                "../../deploy/gmb.ini.example",
                                "../../../deploy/gmb.ini.example"};
  const char *path = NULL;
  for (size_t i = 0; i < sizeof where / sizeof where[0] && !path; i++)
    if (access(where[i], R_OK) == 0) path = where[i];
  ck_assert_msg(path != NULL,
                "deploy/gmb.ini.example not found: run from the top of the "
                "tree");
  struct gmb_config c;
  char err[512] = "";
  int rc = gmb__config_load(path, &c, err, sizeof err);
  ck_assert_msg(rc == 0, "%s", err);
  ck_assert_str_eq(c.device, "auto");
  /* No capacity: installed as it is, the example must not promise more
   * than the machine's device has (the device's own size is used). */
  ck_assert_uint_eq(c.capacity, 0);
  ck_assert_uint_eq(c.n_tenants, 2);
  const struct gmb_tenant_conf *t = gmb__config_tenant(&c, "llm-a");
  ck_assert_ptr_nonnull(t);
  ck_assert_uint_eq(t->quota, 20 * GMB_GIB);
  ck_assert_uint_eq(t->reserve, 256 * GMB_MIB);
  ck_assert_int_eq(t->has_token, 1);
  t = gmb__config_tenant(&c, "batch");
  ck_assert_ptr_nonnull(t);
  ck_assert_int_eq(t->priority, -10);
  gmb__config_free(&c);
}
END_TEST

START_TEST(every_other_value_parses) {
  struct gmb_config c;
  load_ok("# a comment line\n"
          "; another\n"
          "[broker] ; the broker's own keys\n"
          "device = host:8GiB\n"
          "admin_uids = 0, root ,4294967294\n"
          "default_quota = 512MiB\n"
          "compaction = off\n"
          "compaction_threshold = 1\n"
          "metrics_listen = [::1]:65535\n"
          "log_level = debug\n"
          "heartbeat_ms = 100\n"
          "trim_wait_ms = 0\n"
          "segment_linger_ms = 0\n"
          "admin_http = no\n"
          "offload_host_max = 0\n"
          "restore_wait_ms = 0\n"
          "cache_holes = 0.5\n"
          "\n"
          "[tenant:b]\n"
          "quota = 1GiB\n"
          "reserve = 1GiB\n"
          "priority = -100\n"
          "token_sha256 = " "9F86D081884C7D659A2FEAA0C55AD015A3BF4F1B2B0B822CD15D6C15B0F00A08" "\n"
          "uids = root\n"
          "[tenant:c]\n"
          "reserve = 3GiB\n"
          "uids =\n",
          &c);
  ck_assert_str_eq(c.device, "host:8GiB");
  ck_assert_uint_eq(c.n_admin_uids, 3);
  ck_assert_uint_eq(c.admin_uids[0], 0);
  ck_assert_uint_eq(c.admin_uids[1], 0);
  ck_assert_uint_eq(c.admin_uids[2], 4294967294u);
  ck_assert_uint_eq(c.default_quota, 512 * GMB_MIB);
  ck_assert_int_eq(c.compaction, 0);
  ck_assert_double_eq(c.compaction_threshold, 1.0);
  ck_assert_str_eq(c.metrics_listen, "[::1]:65535");
  ck_assert_int_eq(c.log_level, GMB_LOG_DEBUG);
  ck_assert_uint_eq(c.heartbeat_ms, 100);
  ck_assert_uint_eq(c.trim_wait_ms, 0); /* 0: caches are not asked */
  ck_assert_uint_eq(c.segment_linger_ms, 0); /* 0: released under need only */
  ck_assert_int_eq(c.admin_http, 0);
  ck_assert_uint_eq(c.offload_host_max, 0); /* 0: the broker never offloads */
  ck_assert_uint_eq(c.restore_wait_ms, 0);
  ck_assert_double_eq(c.cache_holes, 0.5);
  ck_assert_uint_eq(c.n_tenants, 2);
  const struct gmb_tenant_conf *b = gmb__config_tenant(&c, "b");
  ck_assert_ptr_nonnull(b);
  ck_assert_uint_eq(b->quota, GMB_GIB);
  ck_assert_uint_eq(b->reserve, GMB_GIB); /* reserve == quota is fine */
  ck_assert_int_eq(b->priority, -100);
  ck_assert_int_eq(b->has_token, 1);
  ck_assert_uint_eq(b->token_sha256[0], 0x9f);
  ck_assert_uint_eq(b->token_sha256[31], 0x08);
  ck_assert_uint_eq(b->n_uids, 1);
  ck_assert_uint_eq(b->uids[0], 0);
  ck_assert_int_eq(b->line, 19);
  const struct gmb_tenant_conf *t = gmb__config_tenant(&c, "c");
  ck_assert_ptr_nonnull(t);
  ck_assert_uint_eq(t->quota, 0);
  ck_assert_uint_eq(t->reserve, 3 * GMB_GIB); /* no quota: any reserve */
  ck_assert_uint_eq(t->n_uids, 0);
  ck_assert_int_eq(t->has_token, 0);
  gmb__config_free(&c);
}
END_TEST

/* default_host_quota: auto (the default) is a quarter of
 * offload_host_max, rounded up so that it never reads as 0 (no limit),
 * and of offload_host_max's default when the broker never offloads
 * (paused tags still count); a size is taken as it is, 0 meaning none. */
START_TEST(default_host_quota_auto_and_sizes) {
  struct gmb_config c;
  load_ok("[broker]\noffload_host_max = 8GiB\n", &c);
  ck_assert_uint_eq(c.default_host_quota, GMB_DEFAULT_HOST_QUOTA_AUTO);
  ck_assert_uint_eq(gmb__config_default_host_quota(&c), 2 * GMB_GIB);
  gmb__config_free(&c);
  teardown();
  load_ok("[broker]\noffload_host_max = 3\ndefault_host_quota = auto\n", &c);
  ck_assert_uint_eq(gmb__config_default_host_quota(&c), 1);
  gmb__config_free(&c);
  teardown();
  load_ok("[broker]\noffload_host_max = 0\n", &c);
  uint64_t off = gmb__config_offload_default();
  ck_assert_uint_eq(gmb__config_default_host_quota(&c),
                    off / 4 + (off % 4 != 0));
  ck_assert_uint_gt(gmb__config_default_host_quota(&c), 0);
  gmb__config_free(&c);
  teardown();
  load_ok("[broker]\ndefault_host_quota = 512MiB\ncache_holes = 0\n", &c);
  ck_assert_uint_eq(gmb__config_default_host_quota(&c), 512 * GMB_MIB);
  gmb__config_free(&c);
  teardown();
  load_ok("[broker]\ndefault_host_quota = 0\n", &c);
  ck_assert_uint_eq(gmb__config_default_host_quota(&c), 0);
  gmb__config_free(&c);
}
END_TEST

/* device_reserve = auto keeps room for client_contexts contexts (the
 * broker measures one at start); an explicit size is taken as it is. */
START_TEST(device_reserve_auto_and_client_contexts) {
  struct gmb_config c;
  load_ok("[broker]\ndevice_reserve = auto\nclient_contexts = 3\n", &c);
  ck_assert_uint_eq(c.device_reserve, GMB_DEVICE_RESERVE_AUTO);
  ck_assert_uint_eq(c.client_contexts, 3);
  gmb__config_free(&c);
  load_ok("[broker]\ndevice_reserve = 0\nclient_contexts = 0\n", &c);
  ck_assert_uint_eq(c.device_reserve, 0);
  ck_assert_uint_eq(c.client_contexts, 0);
  gmb__config_free(&c);
}
END_TEST

START_TEST(defaults_right) {
  struct gmb_config d, c;
  gmb__config_defaults(&d);
  ck_assert_str_eq(d.device, "auto");
  ck_assert_uint_eq(d.capacity, 0);
  ck_assert_uint_eq(d.device_reserve, GMB_DEVICE_RESERVE_AUTO);
  ck_assert_uint_eq(d.client_contexts, 8);
  ck_assert_str_eq(d.run_dir, "");
  ck_assert_str_eq(d.state, "");
  ck_assert_uint_eq(d.n_admin_uids, 0);
  ck_assert_uint_eq(d.default_quota, 0);
  ck_assert_int_eq(d.compaction, 1);
  ck_assert_double_eq(d.compaction_threshold, 0.3);
  ck_assert_str_eq(d.metrics_listen, "");
  ck_assert_int_eq(d.log_level, GMB_LOG_INFO);
  ck_assert_uint_eq(d.heartbeat_ms, 1000);
  ck_assert_uint_eq(d.restore_wait_ms, 3000);
  ck_assert_double_eq(d.cache_holes, 0.125); /* an eighth of the quota */
  ck_assert_uint_eq(d.default_host_quota, GMB_DEFAULT_HOST_QUOTA_AUTO);
  /* A quarter of the host's memory: more than nothing, less than it. */
  ck_assert_uint_gt(d.offload_host_max, 0);
  ck_assert_uint_eq(d.offload_host_max, gmb__config_offload_default());
  ck_assert_ptr_null(d.tenants);
  ck_assert_uint_eq(d.n_tenants, 0);
  /* An empty file, and one with an empty [broker], give the defaults;
   * what was in *out before does not leak through. */
  memset(&c, 0x5a, sizeof c);
  load_ok("", &c);
  ck_assert_mem_eq(&c, &d, sizeof c);
  teardown();
  memset(&c, 0x5a, sizeof c);
  load_ok("[broker]\n; nothing set\n", &c);
  ck_assert_mem_eq(&c, &d, sizeof c);
}
END_TEST

START_TEST(inline_comment_quota) {
  struct gmb_config c;
  load_ok("[tenant:a]\nquota = 20GiB ; comment\nreserve = 1GiB\t; tab\n", &c);
  ck_assert_uint_eq(c.tenants[0].quota, 20 * GMB_GIB);
  ck_assert_uint_eq(c.tenants[0].reserve, GMB_GIB);
  gmb__config_free(&c);
  teardown();
  load_bad("[tenant:a]\nquota = 20GiB ; comment\npriority = 5;x\n", 3,
           "priority: bad value '5;x'");
  teardown();
  /* '#' starts a comment only at the start of a line. */
  load_bad("[tenant:a]\nquota = 20GiB # comment\n", 2,
           "quota: bad size '20GiB # comment'");
}
END_TEST

START_TEST(tenant_name_63_not_cut) {
  /* inih hands the handler section names cut to 49 bytes; the full name
   * must survive. */
  char text[256], name[64];
  struct gmb_config c;
  memset(name, 'n', 63);
  name[63] = '\0';
  name[50] = '7';
  snprintf(text, sizeof text, "[tenant:%s]\nquota = 1GiB\n[tenant:%.45s]\n",
           name, name);
  load_ok(text, &c);
  ck_assert_uint_eq(c.n_tenants, 2);
  ck_assert_str_eq(c.tenants[0].name, name);
  ck_assert_uint_eq(c.tenants[0].quota, GMB_GIB);
  ck_assert_uint_eq(strlen(c.tenants[1].name), 45);
  ck_assert_uint_eq(c.tenants[1].quota, 0);
  gmb__config_free(&c);
}
END_TEST

START_TEST(empty_tenant_section_declares_tenant) {
  struct gmb_config c;
  load_ok("[tenant:idle]\n[broker]\n", &c);
  ck_assert_uint_eq(c.n_tenants, 1);
  ck_assert_str_eq(c.tenants[0].name, "idle");
  ck_assert_int_eq(c.tenants[0].line, 1);
  gmb__config_free(&c);
}
END_TEST

START_TEST(crlf_and_bom) {
  struct gmb_config c;
  load_ok("\xEF\xBB\xBF[broker]\r\ncapacity = 1GiB\r\n[tenant:w]\r\nquota = "
          "2GiB\r\n",
          &c);
  ck_assert_uint_eq(c.capacity, GMB_GIB);
  ck_assert_uint_eq(c.n_tenants, 1);
  ck_assert_str_eq(c.tenants[0].name, "w");
  ck_assert_uint_eq(c.tenants[0].quota, 2 * GMB_GIB);
  gmb__config_free(&c);
}
END_TEST

START_TEST(line_of_199_bytes_fits) {
  char text[512];
  struct gmb_config c;
  /* "state = " is 8 bytes: a 191-byte path makes a 199-byte line. */
  int n = snprintf(text, sizeof text, "[broker]\nstate = /%0190d\n", 0);
  ck_assert_int_lt(n, (int)sizeof text);
  load_ok(text, &c);
  ck_assert_uint_eq(strlen(c.state), 191);
  gmb__config_free(&c);
  teardown();
  /* ...also as the last line, with no newline. */
  snprintf(text, sizeof text, "[broker]\nstate = /%0190d", 0);
  load_ok(text, &c);
  ck_assert_uint_eq(strlen(c.state), 191);
  gmb__config_free(&c);
}
END_TEST

/* ---- errors --------------------------------------------------------------- */

START_TEST(err_unknown_key) {
  load_bad("[broker]\ndevice = auto\nquotaa = 1GiB\n", 3,
           "[broker] unknown key 'quotaa'");
  teardown();
  load_bad("[tenant:a]\n\n\ncapacity = 1GiB\n", 4,
           "[tenant:a] unknown key 'capacity'");
}
END_TEST

START_TEST(err_unknown_section) {
  load_bad("[broker]\ndevice = auto\n\n[brokr]\n", 4,
           "unknown section [brokr]");
  teardown();
  /* Even an empty one: it is a typo all the same. */
  load_bad("[tenants:a]\n", 1, "unknown section [tenants:a]");
  teardown();
  load_bad("[Broker]\ndevice = auto\n", 1, "unknown section [Broker]");
}
END_TEST

START_TEST(err_key_outside_section) {
  load_bad("device = auto\n[broker]\n", 1, "'device' outside a section");
}
END_TEST

START_TEST(err_bad_size) {
  const char *m =
      load_bad("[broker]\n[tenant:llm-a]\nquota = x\n", 3, "quota");
  ck_assert_str_eq(m,
                   "[tenant:llm-a] quota: bad size 'x' (want e.g. 512MiB, "
                   "20GiB or bytes)");
  teardown();
  load_bad("[broker]\ncapacity = -1GiB\n", 2,
           "[broker] capacity: bad size '-1GiB'");
  teardown();
  load_bad("[broker]\ndevice_reserve = 1.5\n", 2, "device_reserve: bad size");
  load_bad("[broker]\nclient_contexts = -1\n", 2, "client_contexts");
  load_bad("[broker]\nclient_contexts = 5000\n", 2, "client_contexts");
  teardown();
  load_bad("[broker]\ndefault_quota =\n", 2, "default_quota: bad size ''");
  teardown();
  load_bad("[broker]\ndefault_host_quota = lots\n", 2,
           "[broker] default_host_quota: bad size 'lots'");
  teardown();
  load_bad("[broker]\ndefault_host_quota = Auto\n", 2,
           "default_host_quota: bad size 'Auto'");
  teardown();
  load_bad("[tenant:a]\ndefault_host_quota = 1GiB\n", 2,
           "default_host_quota");
  teardown();
  load_bad("[tenant:a]\nreserve = 17179869184GiB\n", 2, "reserve: bad size");
}
END_TEST

START_TEST(err_bad_uid) {
  load_bad("[tenant:a]\nuids = 1001,no-such-user-gmb-test\n", 2,
           "uids: bad uid 'no-such-user-gmb-test'");
  teardown();
  load_bad("[tenant:a]\nuids = 1001,,1002\n", 2, "uids: bad uid list");
  teardown();
  load_bad("[tenant:a]\nuids = 1001,\n", 2, "uids: bad uid list");
  teardown();
  load_bad("[broker]\nadmin_uids = 4294967295\n", 2,
           "admin_uids: bad uid '4294967295'");
  teardown();
  load_bad("[broker]\nadmin_uids = 99999999999999999999\n", 2,
           "admin_uids: bad uid");
  teardown();
  load_bad("[broker]\nadmin_uids = 12abc\n", 2, "admin_uids: bad uid '12abc'");
}
END_TEST

/* The overflow uid, which every peer the broker cannot map shows as, may
 * name neither an operator nor a tenant's uid: the config is refused, by
 * number or by a user name that is it. */
START_TEST(err_overflow_uid) {
  uid_t ov = gmb__config_overflow_uid();
  FILE *f = fopen("/proc/sys/kernel/overflowuid", "r");
  unsigned long want = 65534;
  if (f) {
    ck_assert_int_eq(fscanf(f, "%lu", &want), 1);
    fclose(f);
  }
  ck_assert_uint_eq(ov, want);
  char text[256], what[64];
  snprintf(text, sizeof text, "[broker]\nadmin_uids = 0, %u\n", (unsigned)ov);
  snprintf(what, sizeof what, "admin_uids: uid %u ('%u') is the overflow uid",
           (unsigned)ov, (unsigned)ov);
  load_bad(text, 2, what);
  teardown();
  snprintf(text, sizeof text, "[tenant:a]\nquota = 1MiB\nuids = %u,1001\n",
           (unsigned)ov);
  load_bad(text, 3, "uids: uid");
  teardown();
  struct passwd *pw = getpwuid(ov);
  if (pw) {
    snprintf(text, sizeof text, "[broker]\nadmin_uids = %s\n", pw->pw_name);
    load_bad(text, 2, "is the overflow uid");
    teardown();
  }
  /* Its neighbours are uids as any. */
  struct gmb_config c;
  snprintf(text, sizeof text, "[broker]\nadmin_uids = %u\n",
           (unsigned)ov - 1);
  load_ok(text, &c);
  ck_assert_uint_eq(c.n_admin_uids, 1);
  gmb__config_free(&c);
}
END_TEST

START_TEST(err_too_many_uids) {
  char text[1024];
  size_t n = (size_t)snprintf(text, sizeof text, "[tenant:a]\nuids = 1");
  for (int i = 2; i <= GMB_CONFIG_UIDS_MAX; i++)
    n += (size_t)snprintf(text + n, sizeof text - n, ",%d", i % 10);
  snprintf(text + n, sizeof text - n, "\n");
  struct gmb_config c;
  load_ok(text, &c); /* exactly the limit */
  ck_assert_uint_eq(c.tenants[0].n_uids, GMB_CONFIG_UIDS_MAX);
  gmb__config_free(&c);
  teardown();
  text[strlen(text) - 1] = '\0';
  strcat(text, ",7\n");
  load_bad(text, 2, "uids: more than 64 uids");
}
END_TEST

START_TEST(err_bad_token) {
  char text[256];
  snprintf(text, sizeof text, "[tenant:a]\ntoken_sha256 = %.63s\n", TOKEN_HEX);
  load_bad(text, 2, "token_sha256: bad value");
  teardown();
  snprintf(text, sizeof text, "[tenant:a]\ntoken_sha256 = %s0\n", TOKEN_HEX);
  load_bad(text, 2, "want 64 hex digits");
  teardown();
  snprintf(text, sizeof text, "[tenant:a]\ntoken_sha256 = g%.63s\n",
           TOKEN_HEX);
  load_bad(text, 2, "token_sha256: bad value 'g9f86");
  teardown();
  load_bad("[tenant:a]\ntoken_sha256 =\n", 2, "token_sha256: bad value ''");
}
END_TEST

START_TEST(err_duplicate_tenant) {
  load_bad("[tenant:a]\nquota = 1GiB\n[tenant:b]\n[tenant:a]\n", 4,
           "duplicate section [tenant:a] (first at line 1)");
}
END_TEST

START_TEST(err_duplicate_broker_and_key) {
  load_bad("[broker]\ncapacity = 1GiB\n[broker]\n", 3,
           "duplicate section [broker] (first at line 1)");
  teardown();
  load_bad("[tenant:a]\nquota = 1GiB\nquota = 2GiB\n", 3,
           "quota: given twice (first at line 2)");
  teardown();
  /* An indented line after a key continues its value (inih's multi-line
   * rule): it reads as the key given twice, not silently as a new key. */
  load_bad("[tenant:a]\nquota = 1GiB\n  reserve = 2GiB\n", 3,
           "quota: given twice");
}
END_TEST

START_TEST(err_invalid_tenant_name) {
  load_bad("[broker]\n[tenant:.hidden]\n", 2, "[tenant:.hidden] bad tenant name");
  teardown();
  load_bad("[tenant:a b]\n", 1, "bad tenant name");
  teardown();
  load_bad("[tenant:-x]\n", 1, "bad tenant name");
  teardown();
  load_bad("[tenant:a/b]\n", 1, "bad tenant name");
  teardown();
  load_bad("[tenant:]\n", 1, "bad tenant name");
  teardown();
  char text[128];
  snprintf(text, sizeof text, "[tenant:%064d]\n", 0);
  load_bad(text, 1, "bad tenant name");
}
END_TEST

START_TEST(err_reserve_over_quota) {
  /* Reported at the tenant's section line, whatever the key order. */
  load_bad("[broker]\n[tenant:a]\n; about a\nreserve = 2GiB\nquota = 1GiB\n"
           "[tenant:b]\n",
           2, "[tenant:a] reserve 2GiB is more than quota 1GiB");
  teardown();
  /* ...also when it is the last section of the file. */
  load_bad("[tenant:z]\nquota = 1GiB\nreserve = 1025MiB\n", 1,
           "[tenant:z] reserve 1025MiB is more than quota 1GiB");
}
END_TEST

START_TEST(err_bad_compaction) {
  load_bad("[broker]\ncompaction = on\n", 2,
           "compaction: bad value 'on' (want auto or off)");
  teardown();
  load_bad("[broker]\ncompaction = Auto\n", 2, "compaction: bad value");
}
END_TEST

/* Both keys that take a part of something (0..1). */
START_TEST(err_threshold_range) {
  static const char *bad[] = {"1.5", "-0.1", "nan", "inf", "0.3x", "", "1e9"};
  static const char *keys[] = {"compaction_threshold", "cache_holes"};
  for (size_t k = 0; k < 2; k++)
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
      char text[128], what[64];
      snprintf(text, sizeof text, "[broker]\n%s = %s\n", keys[k], bad[i]);
      snprintf(what, sizeof what, "%s: bad value '%s' (want a number 0..1",
               keys[k], bad[i]);
      load_bad(text, 2, what);
      teardown();
    }
  struct gmb_config c;
  load_ok("[broker]\ncompaction_threshold = 0\ncache_holes = 0\n", &c);
  ck_assert_double_eq(c.compaction_threshold, 0.0);
  ck_assert_double_eq(c.cache_holes, 0.0); /* pages charged whole */
  gmb__config_free(&c);
}
END_TEST

START_TEST(err_bad_log_level) {
  load_bad("[broker]\nlog_level = verbose\n", 2,
           "log_level: bad value 'verbose' (want error, warn, info or debug)");
  teardown();
  load_bad("[broker]\nlog_level = INFO\n", 2, "log_level: bad value");
}
END_TEST

START_TEST(err_bad_integers) {
  load_bad("[broker]\nheartbeat_ms = 99\n", 2, "heartbeat_ms: bad value '99'");
  teardown();
  load_bad("[broker]\nheartbeat_ms = 60001\n", 2, "want an integer 100..60000");
  teardown();
  load_bad("[broker]\nadmin_http = maybe\n", 2, "admin_http: bad value "
           "'maybe' (want yes or no)");
  teardown();
  load_bad("[broker]\ntrim_wait_ms = 5001\n", 2, "trim_wait_ms: bad value "
           "'5001' (want an integer 0..5000)");
  teardown();
  load_bad("[broker]\ntrim_wait_ms = -1\n", 2, "trim_wait_ms: bad value");
  load_bad("[broker]\nsegment_linger_ms = 3600001\n", 2,
           "segment_linger_ms: bad value");
  load_bad("[broker]\nsegment_linger_ms = soon\n", 2,
           "segment_linger_ms: bad value");
  teardown();
  load_bad("[broker]\nrestore_wait_ms = 60001\n", 2, "restore_wait_ms: bad "
           "value '60001' (want an integer 0..60000)");
  teardown();
  load_bad("[broker]\noffload_host_max = lots\n", 2, "offload_host_max");
  teardown();
  load_bad("[tenant:a]\npriority = 101\n", 2, "priority: bad value '101'");
  teardown();
  load_bad("[tenant:a]\npriority = -101\n", 2, "priority: bad value");
  teardown();
  load_bad("[tenant:a]\npriority = 1.5\n", 2, "priority: bad value");
  teardown();
  load_bad("[tenant:a]\npriority = high\n", 2, "priority: bad value");
}
END_TEST

START_TEST(err_bad_device_and_listen) {
  load_bad("[broker]\ndevice = gpu0\n", 2, "device: bad device 'gpu0'");
  teardown();
  load_bad("[broker]\ndevice = host:0\n", 2, "device: bad device");
  teardown();
  load_bad("[broker]\ndevice = cuda:\n", 2, "device: bad device");
  teardown();
  load_bad("[broker]\ndevice = cuda:x\n", 2, "device: bad device");
  teardown();
  load_bad("[broker]\nmetrics_listen = 9464\n", 2,
           "metrics_listen: bad address '9464'");
  teardown();
  load_bad("[broker]\nmetrics_listen = :9464\n", 2, "bad address");
  teardown();
  load_bad("[broker]\nmetrics_listen = localhost:70000\n", 2, "bad address");
  teardown();
  load_bad("[broker]\nmetrics_listen = localhost:0\n", 2, "bad address");
  teardown();
  char text[256];
  snprintf(text, sizeof text, "[broker]\nmetrics_listen = %070d:80\n", 0);
  load_bad(text, 2, "metrics_listen: too long");
}
END_TEST

START_TEST(err_syntax_line) {
  load_bad("[broker]\ncapacity = 1GiB\nthis line has no equals\n", 3,
           "syntax error");
  teardown();
  load_bad("[broker\n", 1, "syntax error");
  teardown();
  /* The first error wins, whoever found it. */
  load_bad("[broker]\nnope = 1\ngarbage\n", 2, "unknown key 'nope'");
  teardown();
  load_bad("[broker]\ngarbage\nnope = 1\n", 2, "syntax error");
}
END_TEST

START_TEST(err_line_too_long) {
  char text[512];
  snprintf(text, sizeof text, "[broker]\n\nstate = /%0191d\n", 0);
  load_bad(text, 3, "line too long");
}
END_TEST

START_TEST(err_nul_byte) {
  static const char text[] = "[broker]\ncapacity = 1GiB\0 junk\n[tenant:a]\n";
  struct gmb_config c;
  char err[256];
  const char *path = write_cfg_n(text, sizeof text - 1);
  ck_assert_int_eq(gmb__config_load(path, &c, err, sizeof err), GMB_E_INVAL);
  char want[128];
  snprintf(want, sizeof want, "%s:2: NUL byte in line", path);
  ck_assert_str_eq(err, want);
}
END_TEST

START_TEST(err_missing_file) {
  struct gmb_config c, before;
  char err[256];
  memset(&c, 0xa5, sizeof c);
  memcpy(&before, &c, sizeof c);
  int rc = gmb__config_load("/nonexistent-gmb-dir/gmb.ini", &c, err,
                            sizeof err);
  ck_assert_int_eq(rc, GMB_E_SYSTEM);
  ck_assert_str_eq(err,
                   "/nonexistent-gmb-dir/gmb.ini: cannot open: No such file "
                   "or directory");
  ck_assert_mem_eq(&c, &before, sizeof c);
  /* A directory opens but does not read. */
  rc = gmb__config_load("/", &c, err, sizeof err);
  ck_assert_int_eq(rc, GMB_E_SYSTEM);
  ck_assert_msg(strncmp(err, "/: ", 3) == 0, "err: %s", err);
  ck_assert_mem_eq(&c, &before, sizeof c);
  /* No room for a message is not a crash. */
  ck_assert_int_eq(gmb__config_load("/nonexistent-gmb-dir/x", &c, NULL, 0),
                   GMB_E_SYSTEM);
}
END_TEST

START_TEST(failed_load_leaves_out_untouched) {
  /* A good config loaded, then a bad one: the first must survive whole. */
  struct gmb_config c, keep;
  load_ok(design_config, &c);
  memcpy(&keep, &c, sizeof c);
  teardown();
  char err[256];
  const char *path = write_cfg("[broker]\ncapacity = 1GiB\n[tenant:x]\n"
                               "[tenant:y]\nquota = 1GiB\nreserve = 2GiB\n");
  ck_assert_int_eq(gmb__config_load(path, &c, err, sizeof err), GMB_E_INVAL);
  ck_assert_mem_eq(&c, &keep, sizeof c);
  ck_assert_uint_eq(c.capacity, 70 * GMB_GIB);
  ck_assert_str_eq(c.tenants[0].name, "llm-a");
  gmb__config_free(&c);
}
END_TEST

START_TEST(err_message_cut_to_errcap) {
  char err[16];
  struct gmb_config c;
  const char *path = write_cfg("[broker]\nnope = 1\n");
  memset(err, 'x', sizeof err);
  ck_assert_int_eq(gmb__config_load(path, &c, err, sizeof err), GMB_E_INVAL);
  ck_assert_uint_lt(strnlen(err, sizeof err), sizeof err);
  ck_assert_int_eq(gmb__config_load(path, &c, NULL, 0), GMB_E_INVAL);
}
END_TEST

static Suite *config_suite(void) {
  Suite *s = suite_create("config");
  TCase *tc = tcase_create("valid");
  tcase_add_checked_fixture(tc, NULL, teardown);
  tcase_add_test(tc, design_example_parses);
  tcase_add_test(tc, deploy_example_parses);
  tcase_add_test(tc, every_other_value_parses);
  tcase_add_test(tc, defaults_right);
  tcase_add_test(tc, device_reserve_auto_and_client_contexts);
  tcase_add_test(tc, default_host_quota_auto_and_sizes);
  tcase_add_test(tc, inline_comment_quota);
  tcase_add_test(tc, tenant_name_63_not_cut);
  tcase_add_test(tc, empty_tenant_section_declares_tenant);
  tcase_add_test(tc, crlf_and_bom);
  tcase_add_test(tc, line_of_199_bytes_fits);
  suite_add_tcase(s, tc);

  tc = tcase_create("errors");
  tcase_add_checked_fixture(tc, NULL, teardown);
  tcase_add_test(tc, err_unknown_key);
  tcase_add_test(tc, err_unknown_section);
  tcase_add_test(tc, err_key_outside_section);
  tcase_add_test(tc, err_bad_size);
  tcase_add_test(tc, err_bad_uid);
  tcase_add_test(tc, err_overflow_uid);
  tcase_add_test(tc, err_too_many_uids);
  tcase_add_test(tc, err_bad_token);
  tcase_add_test(tc, err_duplicate_tenant);
  tcase_add_test(tc, err_duplicate_broker_and_key);
  tcase_add_test(tc, err_invalid_tenant_name);
  tcase_add_test(tc, err_reserve_over_quota);
  tcase_add_test(tc, err_bad_compaction);
  tcase_add_test(tc, err_threshold_range);
  tcase_add_test(tc, err_bad_log_level);
  tcase_add_test(tc, err_bad_integers);
  tcase_add_test(tc, err_bad_device_and_listen);
  tcase_add_test(tc, err_syntax_line);
  tcase_add_test(tc, err_line_too_long);
  tcase_add_test(tc, err_nul_byte);
  tcase_add_test(tc, err_missing_file);
  tcase_add_test(tc, failed_load_leaves_out_untouched);
  tcase_add_test(tc, err_message_cut_to_errcap);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) { return check_run(config_suite()); }
