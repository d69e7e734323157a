/*
 * check_spank_step.c - client/spank/step.c: what gmb_spank.so decides for a
 * Slurm job step before it talks to anyone: its plugstack.conf arguments,
 * --gpu-mem, the generic resource's count in Slurm's TRES strings, their
 * agreement, the tenant's name, the GPU and its broker's run dir, and the
 * environment the tasks get.
 */
#include <check.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "check_main.h"
#include "gmb.h"
#include "step.h"

#define GiB (UINT64_C(1) << 30)
#define MiB (UINT64_C(1) << 20)

static char why[STEP_WHY_MAX];

static struct step_conf conf_of(int argc, char **argv) {
  struct step_conf c;
  int rc = gmb__step_conf_parse(argc, argv, &c, why, sizeof why);
  ck_assert_msg(rc == 0, "conf refused: %s", why);
  return c;
}

START_TEST(conf_defaults) {
  struct step_conf c = conf_of(0, NULL);
  ck_assert_str_eq(c.run_dir, "/run/gmb");
  ck_assert_int_eq(c.per_gpu, 0);
  ck_assert_str_eq(c.preload, "");
  ck_assert_str_eq(c.gres, "gmbmem");
  ck_assert_uint_eq(c.unit, GiB);
  ck_assert_str_eq(c.gpu_info, "/proc/driver/nvidia/gpus");
  ck_assert_int_eq(c.require_gres, 0);
}
END_TEST

START_TEST(conf_every_argument) {
  char *argv[] = {"run_dir=/srv/gmb", "run_dir_per_gpu",
                  "preload=/usr/lib/libgmb-preload.so", "gres=gpumem",
                  "unit=512MiB", "gpu_info=/tmp/gpus", "require_gres"};
  struct step_conf c = conf_of(7, argv);
  ck_assert_str_eq(c.run_dir, "/srv/gmb");
  ck_assert_int_eq(c.per_gpu, 1);
  ck_assert_str_eq(c.preload, "/usr/lib/libgmb-preload.so");
  ck_assert_str_eq(c.gres, "gpumem");
  ck_assert_uint_eq(c.unit, 512 * MiB);
  ck_assert_str_eq(c.gpu_info, "/tmp/gpus");
  ck_assert_int_eq(c.require_gres, 1);
}
END_TEST

static void conf_refused(char *arg, const char *says) {
  struct step_conf c;
  char *argv[] = {arg};
  why[0] = '\0';
  ck_assert_int_eq(gmb__step_conf_parse(1, argv, &c, why, sizeof why),
                   GMB_E_INVAL);
  ck_assert_msg(strstr(why, says) != NULL, "'%s': why '%s' lacks '%s'", arg,
                why, says);
}

START_TEST(conf_refusals) {
  conf_refused("run_dirr=/x", "unknown plugstack.conf argument 'run_dirr=/x'");
  conf_refused("run_dir", "unknown");          /* a key that wants a value */
  conf_refused("run_dir_per_gpu=yes", "unknown"); /* a flag with one */
  conf_refused("run_dir=", "run_dir: want a path");
  conf_refused("unit=0", "unit=0");
  conf_refused("unit=lots", "unit=lots");
  conf_refused("gres=a b", "not a generic resource name");
  char longp[400];
  memset(longp, 'x', sizeof longp);
  memcpy(longp, "preload=", 8);
  longp[sizeof longp - 1] = '\0';
  conf_refused(longp, "preload: want a path");
}
END_TEST

START_TEST(mem_sizes) {
  uint64_t v = 0;
  ck_assert_int_eq(gmb__step_mem_parse("64MiB", &v, why, sizeof why), 0);
  ck_assert_uint_eq(v, 64 * MiB);
  ck_assert_int_eq(gmb__step_mem_parse("8G", &v, why, sizeof why), 0);
  ck_assert_uint_eq(v, 8 * GiB);
  ck_assert_int_eq(gmb__step_mem_parse("1.5GiB", &v, why, sizeof why), 0);
  ck_assert_uint_eq(v, 3 * GiB / 2);
  const char *bad[] = {"", "0", "-1GiB", "GiB", "8 apples", "1e9",
                       "99999999999999999999GiB", "18446744073709551615G",
                       "17179869184GiB", "16777216TiB", "0.00000000001GiB",
                       NULL};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    why[0] = '\0';
    ck_assert_int_eq(gmb__step_mem_parse(bad[i], &v, why, sizeof why),
                     GMB_E_INVAL);
    ck_assert_msg(strstr(why, "--gpu-mem=") != NULL, "why '%s'", why);
  }
}
END_TEST

static uint64_t count_of(const char *tres) {
  uint64_t n = 12345;
  int rc = gmb__step_gres_count(tres, "gmbmem", &n, why, sizeof why);
  ck_assert_msg(rc == 0, "'%s' refused: %s", tres ? tres : "(null)", why);
  return n;
}

START_TEST(gres_counts) {
  ck_assert_uint_eq(count_of(NULL), 0);
  ck_assert_uint_eq(count_of(""), 0);
  ck_assert_uint_eq(count_of("gres:gpu:1"), 0);
  ck_assert_uint_eq(count_of("gres:gmbmem:8"), 8);
  ck_assert_uint_eq(count_of("gres:gpu:1,gres:gmbmem:3"), 3);
  ck_assert_uint_eq(count_of("gres:gmbmem:2,gres:gmbmem:3"), 5);
  ck_assert_uint_eq(count_of("gres/gmbmem:4,gres/gpu:2"), 4);
  ck_assert_uint_eq(count_of("gres:gmbmem:a100:6"), 6);
  ck_assert_uint_eq(count_of("gres:gmbmem:2K"), 2048);
  /* Another resource whose name starts the same is not it. */
  ck_assert_uint_eq(count_of("gres:gmbmemx:5,gres:gmb:7"), 0);
}
END_TEST

START_TEST(gres_count_malformed) {
  uint64_t n;
  const char *bad[] = {"gres:gmbmem:", "gres:gmbmem:x", "gres:gmbmem:4Q",
                       "gres:gmbmem:99999999999999999999",
                       /* each fits, their sum does not */
                       "gres:gmbmem:18446744073709551615,gres:gmbmem:1",
                       "gres:gmbmem:8589934592G,gres:gmbmem:8589934592G"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
    ck_assert_int_eq(gmb__step_gres_count(bad[i], "gmbmem", &n, why,
                                          sizeof why),
                     GMB_E_INVAL);
  ck_assert_msg(strstr(why, "cannot read the count of gmbmem") != NULL, "%s",
                why);
}
END_TEST

static int quota(uint64_t mem, uint64_t count, int require, uint64_t *q) {
  why[0] = '\0';
  return gmb__step_quota(mem, count, GiB, require, "gmbmem", q, why,
                         sizeof why);
}

START_TEST(quota_agreement) {
  uint64_t q = 1;
  ck_assert_int_eq(quota(0, 0, 0, &q), 0); /* no gmb for this step */
  ck_assert_uint_eq(q, 0);
  ck_assert_int_eq(quota(0, 8, 0, &q), 0); /* the count alone */
  ck_assert_uint_eq(q, 8 * GiB);
  ck_assert_int_eq(quota(8 * GiB, 8, 0, &q), 0); /* both, exact */
  ck_assert_uint_eq(q, 8 * GiB);
  ck_assert_int_eq(quota(15 * GiB / 2, 8, 0, &q), 0); /* 7.5GiB: 8 units */
  ck_assert_uint_eq(q, 15 * GiB / 2);
  ck_assert_int_eq(quota(64 * MiB, 0, 0, &q), 0); /* the size alone */
  ck_assert_uint_eq(q, 64 * MiB);
}
END_TEST

START_TEST(quota_disagreement) {
  uint64_t q = 1;
  ck_assert_int_eq(quota(9 * GiB, 8, 0, &q), GMB_E_INVAL);
  ck_assert_msg(strstr(why, "--gpu-mem=9GiB and --gres=gmbmem:8 disagree") &&
                    strstr(why, "is --gres=gmbmem:9"),
                "%s", why);
  ck_assert_int_eq(quota(6 * GiB, 8, 0, &q), GMB_E_INVAL);
  ck_assert_msg(strstr(why, "is --gres=gmbmem:6") != NULL, "%s", why);
  ck_assert_int_eq(quota(64 * MiB, 0, 1, &q), GMB_E_INVAL);
  ck_assert_msg(strstr(why, "needs --gres=gmbmem:1") != NULL, "%s", why);
  ck_assert_int_eq(quota(0, UINT64_MAX / 2, 0, &q), GMB_E_INVAL);
  ck_assert_uint_eq(q, 0);
}
END_TEST

START_TEST(tenant_names) {
  char b[64];
  ck_assert_int_eq(gmb__step_tenant_name(1234, 0, b, sizeof b), 0);
  ck_assert_str_eq(b, "slurm-1234.0");
  ck_assert_int_eq(gmb__step_tenant_name(7, STEP_ID_BATCH, b, sizeof b), 0);
  ck_assert_str_eq(b, "slurm-7.batch");
  ck_assert_int_eq(gmb__step_tenant_name(7, STEP_ID_INTERACTIVE, b, sizeof b),
                   0);
  ck_assert_str_eq(b, "slurm-7.interactive");
  ck_assert_int_eq(gmb__step_tenant_name(4294967294u, 4294967000u, b,
                                         sizeof b), 0);
  ck_assert_str_eq(b, "slurm-4294967294.4294967000");
  ck_assert_int_eq(gmb__step_tenant_name(1234, 0, b, 8), GMB_E_INVAL);
}
END_TEST

START_TEST(gpu_from_env) {
  char g[80];
  ck_assert_int_eq(gmb__step_gpu(3, NULL, NULL, g, sizeof g, why, sizeof why),
                   0);
  ck_assert_str_eq(g, "");
  ck_assert_int_eq(gmb__step_gpu(3, "1", NULL, g, sizeof g, why, sizeof why),
                   0);
  ck_assert_str_eq(g, "1");
  ck_assert_int_eq(gmb__step_gpu(3, "GPU-0a1b2c3d-0000-1111-2222-333344445555",
                                 NULL, g, sizeof g, why, sizeof why), 0);
  ck_assert_str_eq(g, "GPU-0a1b2c3d-0000-1111-2222-333344445555");
  /* The batch and interactive steps are bound to the job's GPUs. */
  ck_assert_int_eq(gmb__step_gpu(STEP_ID_BATCH, NULL, "1", g, sizeof g, why,
                                 sizeof why), 0);
  ck_assert_str_eq(g, "1");
  ck_assert_int_eq(gmb__step_gpu(STEP_ID_INTERACTIVE, NULL, "0", g, sizeof g,
                                 why, sizeof why), 0);
  ck_assert_str_eq(g, "0");
  ck_assert_int_eq(gmb__step_gpu(3, "0,1", NULL, g, sizeof g, why, sizeof why),
                   GMB_E_INVAL);
  ck_assert_msg(strstr(why, "several GPUs (SLURM_STEP_GPUS=0,1)"), "%s", why);
  ck_assert_int_eq(gmb__step_gpu(STEP_ID_BATCH, NULL, "../x", g, sizeof g, why,
                                 sizeof why), GMB_E_INVAL);
  ck_assert_msg(strstr(why, "SLURM_JOB_GPUS=../x"), "%s", why);
}
END_TEST

/* slurmstepd sets (or unsets) SLURM_STEP_GPUS for a job step and
 * SLURM_JOB_GPUS for the batch step; the other one, like
 * CUDA_VISIBLE_DEVICES, is whatever the job's user exported: sbatch
 * passes SLURM_STEP_GPUS=1 from the submitting shell to the batch step as
 * it is.  It must not choose the broker. */
START_TEST(gpu_not_from_user_env) {
  char g[80];
  ck_assert_int_eq(gmb__step_gpu(STEP_ID_BATCH, "1", "0", g, sizeof g, why,
                                 sizeof why), 0);
  ck_assert_str_eq(g, "0");
  ck_assert_int_eq(gmb__step_gpu(STEP_ID_BATCH, "1", NULL, g, sizeof g, why,
                                 sizeof why), 0);
  ck_assert_str_eq(g, ""); /* bound to no GPU, whatever the user says */
  ck_assert_int_eq(gmb__step_gpu(0, NULL, "1", g, sizeof g, why, sizeof why),
                   0);
  ck_assert_str_eq(g, "");
}
END_TEST

/* A fake /proc/driver/nvidia/gpus with two GPUs, minors 0 and 1. */
static char gpus_dir[64];

static void info_write(const char *pci, int minor, const char *uuid) {
  char path[160];
  snprintf(path, sizeof path, "%s/%s", gpus_dir, pci);
  ck_assert_int_eq(mkdir(path, 0755), 0);
  snprintf(path, sizeof path, "%s/%s/information", gpus_dir, pci);
  FILE *f = fopen(path, "w");
  ck_assert_ptr_nonnull(f);
  fprintf(f, "Model: \t\t NVIDIA H100\nIRQ:   \t\t 42\nGPU UUID: \t\t %s\n"
          "Video BIOS: \t\t ??.??.??.??.??\nBus Type: \t\t PCIe\n"
          "Device Minor: \t\t %d\n", uuid, minor);
  fclose(f);
}

static void gpus_setup(void) {
  snprintf(gpus_dir, sizeof gpus_dir, "/tmp/check_spank_step.XXXXXX");
  ck_assert_ptr_nonnull(mkdtemp(gpus_dir));
  info_write("0000:17:00.0", 1, "GPU-11111111-2222-3333-4444-555555555555");
  info_write("0000:03:00.0", 0, "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee");
}

static void gpus_teardown(void) {
  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", gpus_dir);
  ck_assert_int_eq(system(cmd), 0);
}

START_TEST(uuid_of_minor) {
  char u[80];
  ck_assert_int_eq(gmb__step_uuid_of_minor(gpus_dir, 1, u, sizeof u, why,
                                           sizeof why), 0);
  ck_assert_str_eq(u, "GPU-11111111-2222-3333-4444-555555555555");
  ck_assert_int_eq(gmb__step_uuid_of_minor(gpus_dir, 0, u, sizeof u, why,
                                           sizeof why), 0);
  ck_assert_str_eq(u, "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee");
  ck_assert_int_eq(gmb__step_uuid_of_minor(gpus_dir, 2, u, sizeof u, why,
                                           sizeof why), GMB_E_INVAL);
  ck_assert_msg(strstr(why, "no GPU with device minor 2") != NULL, "%s", why);
  ck_assert_int_eq(gmb__step_uuid_of_minor("/nonexistent/gpus", 0, u,
                                           sizeof u, why, sizeof why),
                   GMB_E_INVAL);
  ck_assert_msg(strstr(why, "cannot read /nonexistent/gpus") != NULL, "%s",
                why);
}
END_TEST

START_TEST(run_dirs) {
  char d[STEP_PATH_MAX];
  char *one[] = {"run_dir=/srv/gmb"};
  struct step_conf c = conf_of(1, one);
  ck_assert_int_eq(gmb__step_run_dir(&c, "", d, sizeof d, why, sizeof why), 0);
  ck_assert_str_eq(d, "/srv/gmb");
  ck_assert_int_eq(gmb__step_run_dir(&c, "1", d, sizeof d, why, sizeof why),
                   0);
  ck_assert_str_eq(d, "/srv/gmb"); /* one broker: every GPU's */
  char info[96];
  snprintf(info, sizeof info, "gpu_info=%s", gpus_dir);
  char *per[] = {"run_dir=/srv/gmb", "run_dir_per_gpu", info};
  c = conf_of(3, per);
  ck_assert_int_eq(gmb__step_run_dir(&c, "1", d, sizeof d, why, sizeof why),
                   0);
  ck_assert_str_eq(d, "/srv/gmb/GPU-11111111-2222-3333-4444-555555555555");
  ck_assert_int_eq(gmb__step_run_dir(&c, "GPU-77", d, sizeof d, why,
                                     sizeof why), 0);
  ck_assert_str_eq(d, "/srv/gmb/GPU-77");
  ck_assert_int_eq(gmb__step_run_dir(&c, "", d, sizeof d, why, sizeof why),
                   GMB_E_INVAL);
  ck_assert_msg(strstr(why, "bound to no GPU") != NULL, "%s", why);
  ck_assert_int_eq(gmb__step_run_dir(&c, "5", d, sizeof d, why, sizeof why),
                   GMB_E_INVAL);
}
END_TEST

START_TEST(env_plain_and_preload) {
  char *argv[] = {"preload=/usr/lib/gmb/libgmb-preload.so"};
  struct step_conf c = conf_of(1, argv);
  struct step_env e;
  ck_assert_int_eq(gmb__step_env(&c, "slurm-3.0", "tok", "/run/gmb", 0, NULL,
                                 &e, why, sizeof why), 0);
  ck_assert_uint_eq(e.n, 3);
  ck_assert_str_eq(e.v[0].name, "GMB_TENANT");
  ck_assert_str_eq(e.v[0].value, "slurm-3.0");
  ck_assert_str_eq(e.v[1].name, "GMB_TOKEN");
  ck_assert_str_eq(e.v[1].value, "tok");
  ck_assert_str_eq(e.v[2].name, "GMB_RUN_DIR");
  ck_assert_str_eq(e.v[2].value, "/run/gmb");
  ck_assert_int_eq(gmb__step_env(&c, "slurm-3.0", "tok", "/run/gmb", 1, "",
                                 &e, why, sizeof why), 0);
  ck_assert_uint_eq(e.n, 4);
  ck_assert_str_eq(e.v[3].name, "LD_PRELOAD");
  ck_assert_str_eq(e.v[3].value, "/usr/lib/gmb/libgmb-preload.so");
  ck_assert_int_eq(gmb__step_env(&c, "slurm-3.0", "tok", "/run/gmb", 1,
                                 "/opt/x.so", &e, why, sizeof why), 0);
  ck_assert_str_eq(e.v[3].value, "/usr/lib/gmb/libgmb-preload.so:/opt/x.so");
}
END_TEST

START_TEST(env_preload_unconfigured) {
  struct step_conf c = conf_of(0, NULL);
  struct step_env e;
  ck_assert_int_eq(gmb__step_env(&c, "slurm-3.0", "tok", "/run/gmb", 1, NULL,
                                 &e, why, sizeof why), GMB_E_INVAL);
  ck_assert_msg(strstr(why, "names no preload=PATH") != NULL, "%s", why);
  char big[1100];
  memset(big, 'a', sizeof big);
  big[sizeof big - 1] = '\0';
  ck_assert_int_eq(gmb__step_env(&c, "slurm-3.0", big, "/run/gmb", 0, NULL,
                                 &e, why, sizeof why), GMB_E_INVAL);
  ck_assert_msg(strstr(why, "GMB_TOKEN would be too long") != NULL, "%s", why);
}
END_TEST

static Suite *step_suite(void) {
  Suite *s = suite_create("spank_step");
  TCase *tc = tcase_create("conf");
  tcase_add_test(tc, conf_defaults);
  tcase_add_test(tc, conf_every_argument);
  tcase_add_test(tc, conf_refusals);
  suite_add_tcase(s, tc);
  tc = tcase_create("sizes");
  tcase_add_test(tc, mem_sizes);
  tcase_add_test(tc, gres_counts);
  tcase_add_test(tc, gres_count_malformed);
  tcase_add_test(tc, quota_agreement);
  tcase_add_test(tc, quota_disagreement);
  suite_add_tcase(s, tc);
  tc = tcase_create("step");
  tcase_add_checked_fixture(tc, gpus_setup, gpus_teardown);
  tcase_add_test(tc, tenant_names);
  tcase_add_test(tc, gpu_from_env);
  tcase_add_test(tc, gpu_not_from_user_env);
  tcase_add_test(tc, uuid_of_minor);
  tcase_add_test(tc, run_dirs);
  tcase_add_test(tc, env_plain_and_preload);
  tcase_add_test(tc, env_preload_unconfigured);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) { return check_run(step_suite()); }
