/*
 * test_multigpu.c - a host with two GPUs (the fake driver with
 * FAKECUDA_DEVICES=2) and one broker per GPU: `gmb-broker --device cuda:N
 * --run-dir BASE --run-dir-per-gpu` puts its sockets in BASE/UUID, and a
 * client finds the broker of a GPU by the GPU's UUID (gmb_connect_gpu),
 * whatever ordinal the GPU has in the client (FAKECUDA_VISIBLE renumbers
 * them as CUDA_VISIBLE_DEVICES does).  gmbctl --gpu addresses each broker;
 * a GPU without a broker is refused with a reason that says where the
 * client looked.
 *
 * Clients run in forked children, forked before the test process touches
 * CUDA (the driver refuses a child forked after cuInit); they check what
 * they can see themselves and report through their exit code, and the test
 * checks each broker's own figures (admin status) from outside.
 */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cudrv.h"
#include "gmb.h"
#include "harness.h"

/* The fake driver's UUIDs of physical GPUs 0 and 1 (tests/fakecuda). */
#define UUID0 HARNESS_FAKE_UUID(0)
#define UUID1 HARNESS_FAKE_UUID(1)

static char out[8192];
static char base[64]; /* the run dir both brokers share */

static const char *mg_config = "[tenant:mg]\nquota = 1GiB\n";

static struct harness_gpus gpus;

static void mg_setup(void) {
  harness_fake_gpus(&gpus, 2);
  snprintf(base, sizeof base, "%s", gpus.base);
}

static void mg_teardown(void) { harness_fake_gpus_done(&gpus); }

/* The tenant's bytes in use as broker b counts them. */
static uint64_t mg_used(const struct harness_broker *b) {
  struct wire_tenant_row row;
  int rc = harness_tenant_row(b, "mg", &row);
  if (rc == GMB_E_NOENT) return 0;
  ck_assert_msg(rc == 0, "tenant row: %s", gmb_err_name(rc));
  return row.used;
}

/* Makes this thread's current context the primary one of ordinal `o`,
 * as cudaSetDevice(o) does. */
static int mg_set_device(int o) {
  static struct gmb_cudrv d;
  char err[256];
  if (d.lib == NULL && gmb__cudrv_load(&d, err, sizeof err) != 0) {
    fprintf(stderr, "%s\n", err);
    return -1;
  }
  gmb_cu_device dev;
  gmb_cu_ctx ctx;
  if (d.cuDeviceGet(&dev, o) != 0 || d.cuDevicePrimaryCtxRetain(&ctx, dev) != 0 ||
      d.cuCtxSetCurrent(ctx) != 0)
    return -1;
  return 0;
}

/* Connects to the broker of `gpu`, allocates `size` bytes there, writes
 * and reads them back, and checks the session's GPU: its ordinal here
 * and its UUID.  Keeps the allocation (the test reads the broker's
 * figures while the child waits on its pipe). */
static int mg_use(const char *gpu, int want_ordinal, const char *want_uuid,
                  size_t size, gmb_client **cp) {
  gmb_client *c = NULL;
  int rc = gmb_connect_gpu(gpu, "mg", &c);
  CHILD_CHECK(rc == 0, 2, "gmb_connect_gpu(%s): %s", gpu ? gpu : "NULL",
              gmb_last_error(NULL));
  gmb_device_info di;
  CHILD_CHECK(gmb_device_get(c, &di) == 0, 3, "device_get");
  CHILD_CHECK(di.ordinal == want_ordinal && strcmp(di.uuid, want_uuid) == 0,
              4, "%s: got ordinal %d, %s; want %d, %s", gpu ? gpu : "NULL",
              di.ordinal, di.uuid, want_ordinal, want_uuid);
  gmb_id id;
  char in[512], back[512] = "";
  snprintf(in, sizeof in, "bytes on %s", want_uuid);
  CHILD_CHECK(gmb_alloc(c, size, 0, &id) == 0, 5, "alloc: %s",
              gmb_last_error(c));
  CHILD_CHECK(gmb_write(c, id, 0, in, sizeof in) == 0 &&
                  gmb_read(c, id, 0, back, sizeof back) == 0 &&
                  strcmp(in, back) == 0,
              6, "write/read: %s", gmb_last_error(c));
  *cp = c;
  return 0;
}

struct mg_args {
  int to_test[2]; /* child -> test: "ready" */
  int to_child[2]; /* test -> child: "go on" */
};

/* Sees the GPUs as "1,0": its cuda:0 is physical GPU 1.  Uses both
 * brokers: by ordinal, by UUID and by the current device. */
static int both_child(void *arg) {
  struct mg_args *a = arg;
  setenv("FAKECUDA_VISIBLE", "1,0", 1);
  gmb_client *c0 = NULL, *c1 = NULL, *cu = NULL, *cc = NULL;
  int rc = mg_use("cuda:0", 0, UUID1, 1 << 20, &c0); /* physical 1 */
  if (rc) return rc;
  rc = mg_use("1", 1, UUID0, 3 << 20, &c1); /* physical 0 */
  if (rc) return rc + 10;
  rc = mg_use(UUID0, 1, UUID0, 512, &cu); /* by UUID */
  if (rc) return rc + 20;
  CHILD_CHECK(mg_set_device(1) == 0, 31, "set device 1");
  int cur = -1;
  CHILD_CHECK(gmb_gpu_current(&cur) == 0 && cur == 1, 32, "current %d: %s",
              cur, gmb_last_error(NULL));
  rc = mg_use(NULL, 1, UUID0, 512, &cc); /* the current device */
  if (rc) return rc + 40;
  harness_pipe_send(a->to_test[1], 'r');
  if (harness_pipe_wait(a->to_child[0], HARNESS_WAIT_MS) < 0) return 50;
  gmb_disconnect(c0);
  gmb_disconnect(c1);
  gmb_disconnect(cu);
  gmb_disconnect(cc);
  return 0;
}

START_TEST(two_brokers_found_by_uuid) {
  mg_setup();
  struct harness_broker b0, b1;
  harness_broker_start_gpu(&b0, base, "cuda:0", UUID0, mg_config);
  harness_broker_start_gpu(&b1, base, "cuda:1", UUID1, mg_config);
  struct stat st;
  ck_assert_int_eq(stat(b0.sock_path, &st), 0);
  ck_assert_int_eq(stat(b1.sock_path, &st), 0);
  struct mg_args a;
  ck_assert_int_eq(pipe(a.to_test), 0);
  ck_assert_int_eq(pipe(a.to_child), 0);
  pid_t pid = harness_fork(both_child, &a);
  int got = harness_pipe_wait(a.to_test[0], HARNESS_WAIT_MS);
  if (got != 'r') {
    harness_pipe_send(a.to_child[1], 'g');
    ck_abort_msg("the client failed: exit %d", harness_wait(pid));
  }
  /* Physical 0 holds 3 MiB + 512 + 512, physical 1 holds 1 MiB: each
   * request went to the broker of the GPU it named. */
  ck_assert_uint_eq(mg_used(&b0), (3 << 20) + 1024);
  ck_assert_uint_eq(mg_used(&b1), 1 << 20);
  harness_pipe_send(a.to_child[1], 'g');
  ck_assert_int_eq(harness_wait(pid), 0);
  ck_assert_uint_eq(mg_used(&b0), 0);
  ck_assert_uint_eq(mg_used(&b1), 0);
  harness_broker_stop(&b0);
  harness_broker_stop(&b1);
  mg_teardown();
}
END_TEST

/* Only physical GPU 0 has a broker.  Asking for GPU 1 is refused at once,
 * with where the client looked; GPU 0 works. */
static int nobroker_child(void *arg) {
  (void)arg;
  gmb_client *c = NULL;
  int rc = gmb_connect_gpu("cuda:1", "mg", &c);
  const char *why = gmb_last_error(NULL);
  CHILD_CHECK(rc == GMB_E_CONN && c == NULL, 2, "rc %d: %s", rc, why);
  CHILD_CHECK(strstr(why, "no broker for GPU " UUID1) != NULL, 3, "%s", why);
  CHILD_CHECK(strstr(why, UUID1 "/broker.sock") != NULL, 4, "%s", why);
  rc = gmb_connect_gpu("cuda:7", "mg", &c);
  CHILD_CHECK(rc == GMB_E_DEVICE, 5, "cuda:7: rc %d: %s", rc,
              gmb_last_error(NULL));
  rc = gmb_connect_gpu("GPU-../../etc", "mg", &c);
  CHILD_CHECK(rc == GMB_E_INVAL, 6, "a path for a UUID: rc %d", rc);
  rc = mg_use("cuda:0", 0, UUID0, 4096, &c);
  if (rc) return rc + 10;
  gmb_disconnect(c);
  return 0;
}

/* A single-GPU host keeps its broker in the run dir itself: the default
 * broker is taken for its own GPU, and named when another is asked for. */
static int default_child(void *arg) {
  (void)arg;
  gmb_client *c = NULL;
  int rc = mg_use("cuda:0", 0, UUID0, 4096, &c);
  if (rc) return rc;
  gmb_disconnect(c);
  rc = gmb_connect_gpu("cuda:1", "mg", &c);
  const char *why = gmb_last_error(NULL);
  CHILD_CHECK(rc == GMB_E_CONN, 20, "rc %d: %s", rc, why);
  CHILD_CHECK(strstr(why, "serves " UUID0) != NULL, 21, "%s", why);
  return 0;
}

START_TEST(gpu_without_broker_refused) {
  mg_setup();
  struct harness_broker b0;
  harness_broker_start_gpu(&b0, base, "cuda:0", UUID0, mg_config);
  ck_assert_int_eq(harness_wait(harness_fork(nobroker_child, NULL)), 0);
  ck_assert_uint_eq(mg_used(&b0), 0);
  harness_broker_stop(&b0);
  /* The default broker, on GPU 0, in the run dir itself. */
  struct harness_broker d;
  harness_broker_start(&d, "cuda:0", mg_config);
  setenv("GMB_RUN_DIR", d.dir, 1);
  ck_assert_int_eq(harness_wait(harness_fork(default_child, NULL)), 0);
  harness_broker_stop(&d);
  mg_teardown();
}
END_TEST

/* gmbctl --gpu addresses each broker, by UUID or by ordinal (its own,
 * renumbered like any process's). */
START_TEST(gmbctl_gpu_addresses_each_broker) {
  mg_setup();
  struct harness_broker b0, b1;
  harness_broker_start_gpu(&b0, base, "cuda:0", UUID0, mg_config);
  harness_broker_start_gpu(&b1, base, "cuda:1", UUID1, mg_config);
  int rc = harness_tool("gmbctl", out, sizeof out, "--run-dir", base, "--gpu",
                        UUID1, "status", NULL);
  ck_assert_msg(rc == 0 && strstr(out, "cuda:1 (fakecuda 1)"), "%s", out);
  rc = harness_tool("gmbctl", out, sizeof out, "--run-dir", base, "--gpu", "0",
                    "status", NULL);
  ck_assert_msg(rc == 0 && strstr(out, "cuda:0 (fakecuda 0)"), "%s", out);
  setenv("FAKECUDA_VISIBLE", "1,0", 1);
  rc = harness_tool("gmbctl", out, sizeof out, "--run-dir", base, "--gpu", "0",
                    "status", NULL);
  unsetenv("FAKECUDA_VISIBLE");
  ck_assert_msg(rc == 0 && strstr(out, "cuda:1 (fakecuda 1)"), "%s", out);
  rc = harness_tool("gmbctl", out, sizeof out, "--run-dir", base, "--gpu", "5",
                    "status", NULL);
  ck_assert_msg(rc != 0 && strstr(out, "no such GPU"), "%s", out);
  /* Without --gpu: nothing in the run dir itself. */
  rc = harness_tool("gmbctl", out, sizeof out, "--run-dir", base, "status",
                    NULL);
  ck_assert_msg(rc != 0 && strstr(out, "no broker"), "%s", out);
  harness_broker_stop(&b0);
  harness_broker_stop(&b1);
  mg_teardown();
}
END_TEST

/* --run-dir-per-gpu needs a GPU; --list-gpus lists what the driver sees. */
START_TEST(per_gpu_needs_a_gpu_and_list_gpus) {
  mg_setup();
  int rc = harness_tool("gmb-broker", out, sizeof out, "--run-dir", base,
                        "--run-dir-per-gpu", "--device", "host:64MiB", NULL);
  ck_assert_msg(rc == 2 && strstr(out, "needs a GPU"), "rc %d: %s", rc, out);
  rc = harness_tool("gmb-broker", out, sizeof out, "--list-gpus", NULL);
  ck_assert_msg(rc == 0, "%s", out);
  ck_assert_msg(strstr(out, "0 " UUID0 " 0000:10:00.0 fakecuda 0\n") &&
                    strstr(out, "1 " UUID1 " 0000:11:00.0 fakecuda 1\n"),
                "%s", out);
  setenv("FAKECUDA_VISIBLE", "1", 1);
  rc = harness_tool("gmb-broker", out, sizeof out, "--list-gpus", NULL);
  unsetenv("FAKECUDA_VISIBLE");
  ck_assert_msg(rc == 0 && strcmp(out, "0 " UUID1 " 0000:11:00.0 fakecuda 1\n") == 0,
                "%s", out);
  mg_teardown();
}
END_TEST

int main(void) {
  return harness_main(HARNESS_SUITE(
      "multigpu", "broker", 60, two_brokers_found_by_uuid,
      gpu_without_broker_refused, gmbctl_gpu_addresses_each_broker,
      per_gpu_needs_a_gpu_and_list_gpus));
}
