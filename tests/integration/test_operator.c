/*
 * test_operator.c - the operator plane through the real gmbctl and a real
 * broker: quota and reserve get/set, evict, reload (gmbctl and SIGHUP),
 * the state file across restarts, and who may use the admin socket.
 *
 * Each gmbctl run is checked for its exit status (0 ok, 1 refused by the
 * broker, 2 usage) and for what it printed; a failure must be exactly one
 * line.  The uid tests need root (a child drops to another uid); without
 * root they say so on stdout and pass.
 */
#include <check.h>
#include <fcntl.h>
#include <grp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "gmb.h"
#include "harness.h"
#include "wire.h"

#define MIB (UINT64_C(1) << 20)
#define GIB (UINT64_C(1) << 30)
#define NOBODY 65534

/* The output of the last gmbctl run (CTL_OK, CTL_FAILS, ctl_as). */
static char ctl_out[8192];

static int lines(const char *s) {
  int n = 0;
  for (; *s; s++) n += *s == '\n';
  return n;
}

#define CTL_OK(b, ...)                                                  \
  do {                                                                  \
    int rc_ = harness_ctl(b, ctl_out, sizeof ctl_out, __VA_ARGS__, NULL); \
    ck_assert_msg(rc_ == 0, "gmbctl exited %d: %s", rc_, ctl_out);      \
  } while (0)

/* A failure: exit `code`, one line, containing `needle`. */
#define CTL_FAILS(code, needle, b, ...)                                       \
  do {                                                                        \
    int rc_ = harness_ctl(b, ctl_out, sizeof ctl_out, __VA_ARGS__, NULL);      \
    ck_assert_msg(rc_ == (code), "gmbctl exited %d, want %d: %s", rc_,        \
                  (code), ctl_out);                                           \
    ck_assert_msg(lines(ctl_out) == 1, "want one line, got: %s", ctl_out);    \
    ck_assert_msg(strstr(ctl_out, needle) != NULL, "no '%s' in: %s", needle, \
                  ctl_out);                                                   \
  } while (0)

#define OUT_HAS(needle) \
  ck_assert_msg(strstr(ctl_out, needle) != NULL, "no '%s' in: %s", needle, \
                ctl_out)

static struct wire_tenant_row row_of(const struct harness_broker *b,
                                     const char *tenant) {
  struct wire_tenant_row r;
  int rc = harness_tenant_row(b, tenant, &r);
  ck_assert_msg(rc == 0, "tenant row %s: %s", tenant, gmb_err_name(rc));
  return r;
}

/* A directory for state files that outlives a broker's run dir. */
static void state_dir(char *dir, size_t cap) {
  char tmpl[] = "/tmp/gmbs-XXXXXX";
  ck_assert_ptr_nonnull(mkdtemp(tmpl));
  snprintf(dir, cap, "%s", tmpl);
}

/* A state dir, and a config that keeps its state there and gives tenant
 * "a" a quota of 8MiB. */
static void state_conf(char *dir, size_t dcap, char *conf, size_t ccap) {
  state_dir(dir, dcap);
  snprintf(conf, ccap,
           "[broker]\nstate = %s/state\n[tenant:a]\nquota = 8MiB\n", dir);
}

static void rm_state_dir(const char *dir) {
  char p[128];
  snprintf(p, sizeof p, "%s/state", dir);
  unlink(p);
  rmdir(dir);
}

static char *read_file(const char *path) {
  FILE *f = fopen(path, "r");
  if (f == NULL) return NULL;
  char *buf = calloc(1, 65536);
  ck_assert_ptr_nonnull(buf);
  size_t n = fread(buf, 1, 65535, f);
  buf[n] = '\0';
  fclose(f);
  return buf;
}

/* --- quota and reserve ------------------------------------------------------ */

static const char *limits_conf =
    "[tenant:llm-a]\nquota = 10GiB\nreserve = 1MiB\n"
    "[tenant:llm-b]\nquota = 8MiB\n";

START_TEST(quota_get_set_human_and_json) {
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", limits_conf);
  CTL_OK(&b, "quota", "get", "llm-a");
  OUT_HAS("llm-a quota 10GiB");
  CTL_OK(&b, "quota", "set", "llm-a", "20GiB");
  OUT_HAS("quota of llm-a set to 20GiB (was 10GiB)");
  ck_assert_uint_eq(row_of(&b, "llm-a").quota, 20 * GIB);
  CTL_OK(&b, "--json", "quota", "get", "llm-a");
  OUT_HAS("\"quota\": 21474836480");
  OUT_HAS("\"reserve\": 1048576");
  CTL_OK(&b, "quota", "set", "llm-a", "unlimited", "--json");
  OUT_HAS("\"quota\": 0");
  OUT_HAS("\"message\"");
  CTL_OK(&b, "quota", "get", "llm-a");
  OUT_HAS("quota unlimited");
  CTL_OK(&b, "quota", "set", "llm-a", "1073741824"); /* bytes are sizes too */
  ck_assert_uint_eq(row_of(&b, "llm-a").quota, GIB);
  /* The broker logs who changed what. */
  char *log = harness_broker_log(&b);
  ck_assert_msg(strstr(log, "set quota of llm-a to 20GiB (was 10GiB)") != NULL,
                "%s", log);
  free(log);
  harness_broker_stop(&b);
}
END_TEST

START_TEST(quota_usage_errors_exit_2) {
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", limits_conf);
  CTL_FAILS(2, "bad size 'lots'", &b, "quota", "set", "llm-a", "lots");
  CTL_FAILS(2, "bad size", &b, "--json", "quota", "set", "llm-a", "-5");
  CTL_FAILS(2, "missing SIZE", &b, "quota", "set", "llm-a");
  CTL_FAILS(2, "missing TENANT", &b, "quota", "get");
  CTL_FAILS(2, "missing subcommand", &b, "quota");
  CTL_FAILS(2, "unknown subcommand 'frob'", &b, "quota", "frob", "llm-a");
  CTL_FAILS(2, "unexpected argument 'x'", &b, "quota", "get", "llm-a", "x");
  CTL_FAILS(2, "bad tenant name", &b, "quota", "get", "-x");
  CTL_FAILS(2, "missing SIZE", &b, "reserve", "set", "llm-a");
  CTL_FAILS(2, "unknown subcommand", &b, "reserve", "put", "llm-a", "1MiB");
  CTL_FAILS(2, "bad size 'unlimited'", &b, "reserve", "set", "llm-a",
            "unlimited");
  CTL_OK(&b, "quota", "--help");
  OUT_HAS("quota set TENANT SIZE");
  CTL_OK(&b, "reserve", "--help");
  OUT_HAS("reserve set TENANT SIZE");
  /* Nothing changed. */
  ck_assert_uint_eq(row_of(&b, "llm-a").quota, 10 * GIB);
  harness_broker_stop(&b);
}
END_TEST

START_TEST(limit_refusals_exit_1_with_broker_message) {
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", limits_conf);
  CTL_FAILS(1, "GMB_E_NOENT", &b, "quota", "get", "ghost");
  CTL_FAILS(1, "no tenant ghost", &b, "--json", "quota", "set", "ghost",
            "1MiB");
  CTL_FAILS(1, "GMB_E_NOENT", &b, "reserve", "get", "ghost");
  /* quota below the reservation, reservation above the quota */
  CTL_FAILS(1, "below its reservation", &b, "quota", "set", "llm-a",
            "512KiB");
  CTL_FAILS(1, "GMB_E_INVAL", &b, "--json", "quota", "set", "llm-a", "512KiB");
  CTL_FAILS(1, "above its quota", &b, "reserve", "set", "llm-b", "16MiB");
  /* more reserved than the device has */
  CTL_FAILS(1, "more than the device", &b, "reserve", "set", "llm-a", "1GiB");
  struct wire_tenant_row a = row_of(&b, "llm-a"), bb = row_of(&b, "llm-b");
  ck_assert_uint_eq(a.quota, 10 * GIB);
  ck_assert_uint_eq(a.reserve, MIB);
  ck_assert_uint_eq(bb.reserve, 0);
  /* Quota 0 (no limit) takes any reservation the device can hold. */
  CTL_OK(&b, "quota", "set", "llm-b", "0");
  CTL_OK(&b, "reserve", "set", "llm-b", "16MiB");
  OUT_HAS("reservation of llm-b set to 16MiB (was 0B)");
  harness_broker_stop(&b);
}
END_TEST

START_TEST(reserve_get_set_human_and_json) {
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", limits_conf);
  CTL_OK(&b, "reserve", "get", "llm-a");
  OUT_HAS("llm-a reserve 1MiB (quota 10GiB");
  CTL_OK(&b, "reserve", "set", "llm-a", "4MiB");
  OUT_HAS("reservation of llm-a set to 4MiB (was 1MiB)");
  CTL_OK(&b, "--json", "reserve", "get", "llm-a");
  OUT_HAS("\"reserve\": 4194304");
  OUT_HAS("\"tenant\": \"llm-a\"");
  CTL_OK(&b, "--json", "reserve", "set", "llm-a", "0");
  OUT_HAS("\"reserve\": 0");
  ck_assert_uint_eq(row_of(&b, "llm-a").reserve, 0);
  harness_broker_stop(&b);
}
END_TEST

START_TEST(quota_below_usage_refuses_new_requests) {
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", NULL);
  gmb_client *c = harness_connect_ok(&b, "heavy");
  harness_alloc_ok(c, 4 * MIB);
  CTL_OK(&b, "quota", "set", "heavy", "1MiB");
  OUT_HAS("more than the new quota");
  gmb_id id = 0;
  int rc = gmb_alloc(c, 4096, 0, &id);
  ck_assert_msg(rc == GMB_E_QUOTA, "alloc over a lowered quota = %s",
                gmb_err_name(rc));
  gmb_stats st;
  ck_assert_int_eq(gmb_tenant_stats(c, &st), 0);
  ck_assert_uint_eq(st.used, 4 * MIB); /* nothing taken back */
  ck_assert_uint_eq(st.quota, MIB);
  gmb_disconnect(c);
  harness_broker_stop(&b);
}
END_TEST

/* --- evict -------------------------------------------------------------------- */

struct waiter_arg {
  const char *endpoint;
  int ready_w;
};

/* A session of tenant "ev" that waits for memory (the device is full)
 * when it is evicted: the wait ends with GMB_E_EVICTED. */
static int waiter_main(void *arg) {
  struct waiter_arg *a = arg;
  gmb_client *c = NULL;
  CHILD_CHECK(gmb_connect(a->endpoint, "ev", &c) == 0, 10, "connect: %s",
              gmb_last_error(NULL));
  harness_pipe_send(a->ready_w, 'r');
  gmb_id id = 0;
  int rc = gmb_alloc_wait(c, 32 * MIB, 0, -1, &id);
  CHILD_CHECK(rc == GMB_E_EVICTED, 11, "alloc_wait = %s: %s", gmb_err_name(rc),
              gmb_last_error(c));
  gmb_disconnect(c);
  return 0;
}

START_TEST(evict_ends_sessions_frees_memory_at_once) {
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", NULL);
  gmb_client *c1 = harness_connect_ok(&b, "ev");
  gmb_client *c2 = harness_connect_ok(&b, "ev");
  gmb_client *o = harness_connect_ok(&b, "other");
  harness_alloc_ok(c1, 4 * MIB);
  harness_alloc_ok(c2, 2 * MIB);
  /* The device is nearly full: the waiter waits. */
  harness_alloc_ok(o, 40 * MIB);
  int p[2];
  ck_assert_int_eq(pipe(p), 0);
  struct waiter_arg wa = {b.endpoint, p[1]};
  pid_t kid = harness_fork(waiter_main, &wa);
  ck_assert_int_eq(harness_pipe_wait(p[0], HARNESS_WAIT_MS), 'r');
  harness_sleep_ms(100); /* pacing: either way the child sees EVICTED */

  CTL_OK(&b, "evict", "ev");
  OUT_HAS("evicted ev: 3 sessions ended, 6MiB freed");
  /* Freed by the time the reply came. */
  struct wire_tenant_row r = row_of(&b, "ev");
  ck_assert_uint_eq(r.used, 0);
  ck_assert_uint_eq(r.sessions, 0);
  ck_assert_int_eq(harness_wait(kid), 0);

  gmb_stats st;
  int rc = gmb_tenant_stats(c1, &st);
  ck_assert_msg(rc == GMB_E_EVICTED, "stats after evict = %s",
                gmb_err_name(rc));
  ck_assert_msg(strstr(gmb_last_error(c1), "evicted") != NULL, "%s",
                gmb_last_error(c1));
  ck_assert_msg(strstr(gmb_last_error(c1), "uid") != NULL,
                "the reason does not name who: %s", gmb_last_error(c1));
  gmb_id id;
  ck_assert_int_eq(gmb_alloc(c1, 4096, 0, &id), GMB_E_EVICTED); /* for good */
  ck_assert_int_eq(gmb_alloc(c2, 4096, 0, &id), GMB_E_EVICTED);

  /* Another tenant is not touched. */
  ck_assert_int_eq(gmb_tenant_stats(o, &st), 0);
  ck_assert_uint_eq(st.used, 40 * MIB);
  harness_alloc_ok(o, MIB);

  CTL_OK(&b, "--json", "evict", "ev");
  OUT_HAS("\"sessions\": 0");
  OUT_HAS("\"bytes_freed\": 0");
  CTL_FAILS(1, "GMB_E_NOENT", &b, "evict", "ghost");
  CTL_FAILS(2, "missing TENANT", &b, "evict");
  CTL_FAILS(2, "unexpected argument", &b, "evict", "ev", "other");
  char *log = harness_broker_log(&b);
  ck_assert_msg(strstr(log, "evicted tenant ev: 3 sessions ended") != NULL,
                "%s", log);
  free(log);
  gmb_disconnect(c1);
  gmb_disconnect(c2);
  gmb_disconnect(o);
  close(p[0]);
  close(p[1]);
  harness_broker_stop(&b);
}
END_TEST

/* --- reload ------------------------------------------------------------------- */

START_TEST(reload_broken_config_keeps_running_one) {
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", "[tenant:a]\nquota = 8MiB\n");
  harness_write_file(b.config_path,
                     "[tenant:a]\nquota = 12MiB\nbogus = 1\n");
  CTL_FAILS(1, "gmb.ini:3:", &b, "reload");
  OUT_HAS("unknown key 'bogus'");
  ck_assert_uint_eq(row_of(&b, "a").quota, 8 * MIB);
  CTL_FAILS(1, "gmb.ini:3:", &b, "--json", "reload");

  harness_write_file(b.config_path,
                     "[tenant:a]\nquota = 12MiB\nreserve = 1MiB\n"
                     "priority = 5\n[tenant:b]\nquota = 2MiB\n");
  CTL_OK(&b, "reload");
  OUT_HAS("1 tenants updated, 1 created");
  struct wire_tenant_row r = row_of(&b, "a");
  ck_assert_uint_eq(r.quota, 12 * MIB);
  ck_assert_uint_eq(r.reserve, MIB);
  ck_assert_int_eq(r.priority, 5);
  ck_assert_uint_eq(row_of(&b, "b").quota, 2 * MIB);
  CTL_OK(&b, "--json", "reload");
  OUT_HAS("\"reloaded\": true");
  CTL_FAILS(2, "unexpected argument", &b, "reload", "now");

  /* A tenant dropped from the config keeps its limits. */
  harness_write_file(b.config_path, "[tenant:a]\nquota = 12MiB\n");
  CTL_OK(&b, "reload");
  OUT_HAS("keep their limits");
  ck_assert_uint_eq(row_of(&b, "b").quota, 2 * MIB);
  harness_broker_stop(&b);
}
END_TEST

START_TEST(reload_without_config_is_refused) {
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", NULL);
  CTL_FAILS(1, "started without --config", &b, "reload");
  harness_broker_stop(&b);
}
END_TEST

struct quota_is {
  const struct harness_broker *b;
  uint64_t want;
};

static int quota_is(void *arg) {
  struct quota_is *q = arg;
  struct wire_tenant_row r;
  return harness_tenant_row(q->b, "a", &r) == 0 && r.quota == q->want;
}

START_TEST(sighup_reloads) {
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", "[tenant:a]\nquota = 8MiB\n");
  harness_write_file(b.config_path, "[tenant:a]\nquota = 3MiB\n");
  ck_assert_int_eq(kill(b.pid, SIGHUP), 0);
  struct quota_is q = {&b, 3 * MIB};
  ck_assert_msg(harness_poll_until(quota_is, &q, HARNESS_WAIT_MS),
                "quota not 3MiB after SIGHUP");
  /* A broken file on SIGHUP: logged, the running config kept. */
  harness_write_file(b.config_path, "[tenant:a]\nquota = x\n");
  ck_assert_int_eq(kill(b.pid, SIGHUP), 0);
  harness_sleep_ms(200); /* pacing; the check is on the log and the row */
  ck_assert_uint_eq(row_of(&b, "a").quota, 3 * MIB);
  harness_broker_stop(&b);
}
END_TEST

/* --- the state file ------------------------------------------------------------ */

START_TEST(state_overrides_config_at_reload) {
  char dir[64], conf[512];
  state_conf(dir, sizeof dir, conf, sizeof conf);
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", conf);
  CTL_OK(&b, "quota", "set", "a", "20MiB");
  char path[128];
  snprintf(path, sizeof path, "%s/state", dir);
  char *st = read_file(path);
  ck_assert_ptr_nonnull(st);
  ck_assert_msg(strstr(st, "[tenant:a]\nquota = 20971520") != NULL, "%s", st);
  free(st);
  /* The config changes a's quota; the operator's value still wins. */
  char conf2[512];
  snprintf(conf2, sizeof conf2,
           "[broker]\nstate = %s/state\n[tenant:a]\nquota = 9MiB\n", dir);
  harness_write_file(b.config_path, conf2);
  CTL_OK(&b, "reload");
  ck_assert_uint_eq(row_of(&b, "a").quota, 20 * MIB);
  /* Back to the config's value: the override is gone, and the config
   * rules again at the next reload. */
  CTL_OK(&b, "quota", "set", "a", "9MiB");
  st = read_file(path);
  ck_assert_msg(strstr(st, "quota =") == NULL, "%s", st);
  free(st);
  snprintf(conf2, sizeof conf2,
           "[broker]\nstate = %s/state\n[tenant:a]\nquota = 10MiB\n", dir);
  harness_write_file(b.config_path, conf2);
  CTL_OK(&b, "reload");
  ck_assert_uint_eq(row_of(&b, "a").quota, 10 * MIB);
  /* No temporary files are left beside it. */
  char cmd[128];
  snprintf(cmd, sizeof cmd, "ls %s | grep -qv '^state$'", dir);
  ck_assert_int_ne(system(cmd), 0);
  harness_broker_stop(&b);
  rm_state_dir(dir);
}
END_TEST

START_TEST(state_survives_restart) {
  char dir[64], conf[512];
  state_conf(dir, sizeof dir, conf, sizeof conf);
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", conf);
  /* A tenant only seen in use. */
  gmb_client *c = harness_connect_ok(&b, "seen");
  gmb_disconnect(c);
  CTL_OK(&b, "quota", "set", "a", "16MiB");
  CTL_OK(&b, "reserve", "set", "a", "1MiB");
  CTL_OK(&b, "quota", "set", "seen", "2MiB");
  harness_broker_stop(&b);

  harness_broker_start(&b, "host:64MiB", conf);
  struct wire_tenant_row r = row_of(&b, "a");
  ck_assert_uint_eq(r.quota, 16 * MIB);
  ck_assert_uint_eq(r.reserve, MIB);
  ck_assert_uint_eq(row_of(&b, "seen").quota, 2 * MIB);
  /* Created from the state, owned by the first uid that uses it. */
  c = harness_connect_ok(&b, "seen");
  gmb_stats st;
  ck_assert_int_eq(gmb_tenant_stats(c, &st), 0);
  ck_assert_uint_eq(st.quota, 2 * MIB);
  gmb_disconnect(c);
  harness_broker_stop(&b);
  rm_state_dir(dir);
}
END_TEST

START_TEST(corrupt_state_refuses_start) {
  char dir[64], conf[512], path[128];
  state_conf(dir, sizeof dir, conf, sizeof conf);
  snprintf(path, sizeof path, "%s/state", dir);
  harness_write_file(path, "version = 1\n[tenant:a]\nquota = lots\n");
  char cpath[128], run[128];
  snprintf(cpath, sizeof cpath, "%s/gmb.ini", dir);
  snprintf(run, sizeof run, "%s/run", dir);
  harness_write_file(cpath, conf);
  char out[4096];
  int rc = harness_tool("gmb-broker", out, sizeof out, "--config", cpath,
                        "--run-dir", run, "--device", "host:64MiB", NULL);
  ck_assert_msg(rc == 2, "broker with a corrupt state exited %d: %s", rc, out);
  char where[160];
  snprintf(where, sizeof where, "%s:3:", path);
  ck_assert_msg(strstr(out, where) != NULL, "no '%s' in: %s", where, out);
  unlink(cpath);
  rmdir(run);
  rm_state_dir(dir);
}
END_TEST

/* --- who may use the admin socket ------------------------------------------------ */

struct as_uid {
  uid_t uid;
  int out_fd;
  char *const *argv;
};

static int as_uid_main(void *arg) {
  struct as_uid *a = arg;
  CHILD_CHECK(setgroups(0, NULL) == 0, 120, "setgroups");
  CHILD_CHECK(setgid(a->uid) == 0, 120, "setgid");
  CHILD_CHECK(setuid(a->uid) == 0, 120, "setuid");
  dup2(a->out_fd, 1);
  dup2(a->out_fd, 2);
  execv(a->argv[0], a->argv);
  return 127;
}

/* --- run-time tenants (tenant add / remove) ------------------------------- */

static int tenant_gone(void *arg) {
  const struct harness_broker *b = arg;
  struct wire_tenant_row r;
  return harness_tenant_row(b, "slurm-9.0", &r) == GMB_E_NOENT;
}

START_TEST(tenant_add_remove_at_run_time) {
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", NULL);
  char dir[64], tok[96];
  state_dir(dir, sizeof dir);
  snprintf(tok, sizeof tok, "%s/token", dir);
  harness_write_file(tok, "s3cret\n");
  CTL_OK(&b, "tenant", "add", "slurm-9.0", "--quota", "8MiB", "--token-file",
         tok);
  OUT_HAS("tenant slurm-9.0 added: quota 8MiB");
  CTL_FAILS(1, "exists already", &b, "tenant", "add", "slurm-9.0",
            "--token-file", tok);
  CTL_FAILS(1, "would prove no one", &b, "tenant", "add", "x", "--quota",
            "1MiB");
  CTL_FAILS(2, "unknown subcommand 'del'", &b, "tenant", "del", "x");
  CTL_FAILS(2, "bad value 'lots' for --quota", &b, "tenant", "add", "x",
            "--quota", "lots");
  /* --host-quota: the same sizes as --quota, and the tenant's own. */
  CTL_FAILS(2, "bad value '-1' for --host-quota", &b, "tenant", "add", "x",
            "--host-quota", "-1", "--uid", "4242");
  CTL_FAILS(2, "bad value '99999999999999999999' for --host-quota", &b,
            "tenant", "add", "x", "--host-quota", "99999999999999999999",
            "--uid", "4242");
  CTL_FAILS(2, "an option lacks its value", &b, "tenant", "add", "x",
            "--uid", "4242", "--host-quota");
  CTL_OK(&b, "tenant", "add", "hq", "--host-quota", "0.5GiB", "--uid",
         "4242");
  OUT_HAS("tenant hq added: quota unlimited, host_quota 512MiB");
  ck_assert_uint_eq(row_of(&b, "hq").host_quota, 512 * MIB);
  CTL_OK(&b, "--json", "tenants");
  OUT_HAS("\"host_quota\": 536870912");
  CTL_OK(&b, "tenant", "remove", "hq");
  CTL_OK(&b, "tenant", "--help");
  OUT_HAS("[--host-quota SIZE]");
  /* The token proves it; its quota holds. */
  setenv("GMB_TOKEN", "s3cret", 1);
  gmb_client *c = harness_connect_ok(&b, "slurm-9.0");
  unsetenv("GMB_TOKEN");
  harness_alloc_ok(c, 6 * MIB);
  gmb_id id;
  ck_assert_int_eq(gmb_alloc(c, 4 * MIB, 0, &id), GMB_E_QUOTA);
  /* Removal waits for the session, then the tenant and its memory go. */
  CTL_OK(&b, "tenant", "remove", "slurm-9.0");
  OUT_HAS("tenant slurm-9.0 goes when its 1 sessions end");
  ck_assert_uint_eq(row_of(&b, "slurm-9.0").used, 6 * MIB);
  gmb_disconnect(c);
  ck_assert_int_ne(harness_poll_until(tenant_gone, &b, HARNESS_WAIT_MS), 0);
  CTL_FAILS(1, "no tenant slurm-9.0", &b, "tenant", "remove", "slurm-9.0");
  unlink(tok);
  rmdir(dir);
  harness_broker_stop(&b);
}
END_TEST

/* Runs gmbctl as `uid`; its exit status, its output in ctl_out. */
static int ctl_as(const struct harness_broker *b, uid_t uid, const char *a1,
                  const char *a2, const char *a3, const char *a4) {
  char bin[256], out[128];
  snprintf(bin, sizeof bin, "%s/gmbctl", harness_build_dir());
  snprintf(out, sizeof out, "%s/ctl-as.out", b->dir);
  int fd = open(out, O_WRONLY | O_CREAT | O_TRUNC, 0666);
  ck_assert_int_ge(fd, 0);
  char *argv[] = {bin, "--run-dir", (char *)b->dir, (char *)a1, (char *)a2,
                  (char *)a3, (char *)a4, NULL};
  struct as_uid a = {uid, fd, argv};
  pid_t kid = harness_fork(as_uid_main, &a);
  int rc = harness_wait(kid);
  close(fd);
  char *s = read_file(out);
  snprintf(ctl_out, sizeof ctl_out, "%s", s ? s : "");
  free(s);
  return rc;
}

START_TEST(admin_socket_refused_to_other_uids) {
  if (geteuid() != 0) {
    printf("NOTE: not root: admin socket uid tests skipped\n");
    return;
  }
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", "[tenant:a]\nquota = 8MiB\n");
  struct stat st;
  ck_assert_int_eq(stat(b.admin_path, &st), 0);
  ck_assert_uint_eq(st.st_mode & 0777, 0600);
  int rc = ctl_as(&b, NOBODY, "quota", "set", "a", "1MiB");
  ck_assert_msg(rc == 1, "gmbctl as nobody exited %d: %s", rc, ctl_out);
  ck_assert_msg(strstr(ctl_out, "Permission denied") != NULL, "%s", ctl_out);
  ck_assert_uint_eq(row_of(&b, "a").quota, 8 * MIB);
  harness_broker_stop(&b);

  /* admin_uids names uid 4242: the socket opens to all, and each message
   * is checked against its uid.  Nobody, the overflow uid (what the kernel
   * says of a peer it cannot map), is refused as any other uid. */
  harness_broker_start(&b, "host:64MiB",
                       "[broker]\nadmin_uids = 4242\n[tenant:a]\nquota = 8MiB\n");
  ck_assert_int_eq(stat(b.admin_path, &st), 0);
  ck_assert_uint_eq(st.st_mode & 0777, 0666);
  rc = ctl_as(&b, 4242, "quota", "set", "a", "1MiB");
  ck_assert_msg(rc == 0, "gmbctl as admin uid 4242 exited %d: %s", rc,
                ctl_out);
  ck_assert_uint_eq(row_of(&b, "a").quota, MIB);
  char *log = harness_broker_log(&b);
  ck_assert_msg(strstr(log, "uid 4242 set quota of a to 1MiB (was 8MiB)"),
                "%s", log);
  free(log);
  uid_t others[] = {4241, NOBODY};
  for (int i = 0; i < 2; i++) {
    rc = ctl_as(&b, others[i], "quota", "set", "a", "2MiB");
    ck_assert_msg(rc == 1, "gmbctl as uid %u exited %d: %s",
                  (unsigned)others[i], rc, ctl_out);
    ck_assert_msg(strstr(ctl_out, "GMB_E_AUTH") != NULL, "%s", ctl_out);
  }
  ck_assert_uint_eq(row_of(&b, "a").quota, MIB);
  harness_broker_stop(&b);
}
END_TEST

int main(void) {
  return harness_main(HARNESS_SUITE(
      "operator", "gmbctl", 60,
      quota_get_set_human_and_json,
      quota_usage_errors_exit_2,
      limit_refusals_exit_1_with_broker_message,
      reserve_get_set_human_and_json,
      quota_below_usage_refuses_new_requests,
      evict_ends_sessions_frees_memory_at_once,
      tenant_add_remove_at_run_time,
      reload_broken_config_keeps_running_one,
      reload_without_config_is_refused,
      sighup_reloads,
      state_overrides_config_at_reload,
      state_survives_restart,
      corrupt_state_refuses_start,
      admin_socket_refused_to_other_uids));
}
