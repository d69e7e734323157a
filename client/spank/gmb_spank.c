/*
 * gmb_spank.c - the Slurm SPANK plugin gmb_spank.so: every job step that
 * asks for GPU memory (--gpu-mem=SIZE, or a count of the gmbmem generic
 * resource) is a gmb tenant of that quota on the broker of its GPU, for
 * the step's life (docs/slurm.md).
 *
 *   local/allocator (srun, sbatch, salloc): --gpu-mem is checked as it is
 *       read, so a malformed size fails before the job is queued.
 *   remote (slurmstepd, root, before the tasks): init_post_opt makes the
 *       tenant over the broker's admin socket, with a fresh token, and puts
 *       GMB_TENANT, GMB_TOKEN, GMB_RUN_DIR (and LD_PRELOAD) in the step's
 *       environment; slurm_spank_exit removes it, ending the sessions of
 *       processes that outlived the step's tasks.
 *
 * A failure fails the step with the reason (slurm_error: the slurmd log,
 * and the user's srun output), after undoing what was made: no tenant is
 * left behind by a step that did not start.  What this file keeps in
 * statics is one step's (a slurmstepd runs one step, an srun reads its
 * options once), never shared between steps.  The decisions are step.c's;
 * this file does Slurm's and the broker's I/O.
 */
#include <errno.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <slurm/slurm.h>
#include <slurm/spank.h>

#include "admin_rpc.h"
#include "gmb.h"
#include "step.h"
#include "util.h"
#include "wire.h"



extern const char plugin_name[];
extern const char plugin_type[];
extern const unsigned int plugin_version;
extern const unsigned int spank_plugin_version;
SPANK_PLUGIN(gmb, 1);

#define SPANK_ADMIN_TIMEOUT_MS 5000

/* What the options said: this process's only step. */
static uint64_t spank_mem;       /* --gpu-mem, bytes; 0: not given */
static int spank_preload;        /* --gpu-mem-preload */
/* The tenant this step made, to remove at its end. */
static char spank_tenant[WIRE_NAME_MAX + 1];
static char spank_endpoint[STEP_PATH_MAX + 32];
/* Why the step cannot start, said again from each task before it runs:
 * the step's output reaches srun only from there on (init_post_opt's goes
 * to slurmd's log), and a task that fails there exits non-zero, so srun
 * and sbatch fail too (a step that fails earlier is a "launch failure",
 * which srun 22.05 exits 0 after). */
static char spank_failed[STEP_WHY_MAX + 64];

/* Says why the step fails (the slurmd log now, the user at user_init);
 * returns -1. */
static int spank_fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

static int spank_fail(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(spank_failed, sizeof spank_failed, fmt, ap);
  va_end(ap);
  slurm_error("%s", spank_failed);
  return -1;
}

static int spank_opt_mem(int val, const char *optarg, int remote) {
  (void)val;
  (void)remote;
  char why[STEP_WHY_MAX];
  if (gmb__step_mem_parse(optarg, &spank_mem, why, sizeof why) != 0) {
    slurm_error("gmb: %s", why);
    return -1;
  }
  return 0;
}

static int spank_opt_preload(int val, const char *optarg, int remote) {
  (void)val;
  (void)optarg;
  (void)remote;
  spank_preload = 1;
  return 0;
}

static struct spank_option spank_opts[] = {
    {"gpu-mem", "SIZE",
     "GPU memory for each step, as a gmb tenant's quota (8GiB, 512MiB); "
     "must agree with --gres=gmbmem:N",
     1, 0, spank_opt_mem},
    {"gpu-mem-preload", NULL,
     "run the step's programs with gmb's LD_PRELOAD shim (cudaMalloc goes "
     "to the broker)",
     0, 0, spank_opt_preload},
    SPANK_OPTIONS_TABLE_END};

/* The options, registered here rather than exported as spank_options:
 * sbatch and salloc (the allocator context) show and accept only options
 * registered from slurm_spank_init. */
int slurm_spank_init(spank_t sp, int argc, char **argv) {
  (void)argc;
  (void)argv;
  for (struct spank_option *o = spank_opts; o->name; o++)
    if (spank_option_register(sp, o) != ESPANK_SUCCESS) {
      slurm_error("gmb: cannot register --%s", o->name);
      return -1;
    }
  return 0;
}

/* The step's (or for the batch step, the job's) tres_per_node from the
 * controller; "" when it has none.  0, or -1 after saying why. */
static int spank_tres(uint32_t job, uint32_t step, char *out, size_t cap) {
  out[0] = '\0';
  if (step == STEP_ID_BATCH || step == STEP_ID_INTERACTIVE) {
    job_info_msg_t *ji = NULL;
    if (slurm_load_job(&ji, job, SHOW_ALL) != 0 || ji == NULL ||
        ji->record_count < 1) {
      return spank_fail("gmb: cannot read job %u from the controller: %s",
                        job, slurm_strerror(slurm_get_errno()));
    }
    if (ji->job_array[0].tres_per_node)
      snprintf(out, cap, "%s", ji->job_array[0].tres_per_node);
    slurm_free_job_info_msg(ji);
    return 0;
  }
  job_step_info_response_msg_t *r = NULL;
  if (slurm_get_job_steps(0, job, step, &r, SHOW_ALL) != 0 || r == NULL) {
    return spank_fail("gmb: cannot read step %u.%u from the controller: %s",
                      job, step, slurm_strerror(slurm_get_errno()));
  }
  for (uint32_t i = 0; i < r->job_step_count; i++)
    if (r->job_steps[i].step_id.step_id == step &&
        r->job_steps[i].tres_per_node)
      snprintf(out, cap, "%s", r->job_steps[i].tres_per_node);
  slurm_free_job_step_info_response_msg(r);
  return 0;
}

/* A fresh token (64 hex digits) and its SHA-256, as the broker keeps it. */
static int spank_token(char *token, size_t cap, uint8_t sha[32]) {
  if (cap < 2 * ADMIN_TOKEN_BYTES + 1 || gmb__admin_token_new(token) ||
      gmb__admin_token_sha256(token, strlen(token), sha))
    return -1;
  return 0;
}

static void spank_getenv_or_empty(spank_t sp, const char *name, char *buf,
                                  int cap) {
  if (spank_getenv(sp, name, buf, cap) != ESPANK_SUCCESS) buf[0] = '\0';
}

/*
 * Removes this step's tenant, ending the sessions that still hold it:
 * `occasion` names the moment in the log.  By the step's end slurmstepd
 * has waited for its tasks and killed what its process tracking still
 * finds, so a session left is a process that got out of the step (with
 * proctrack/linuxproc, any child that setsid()s and outlives its parent);
 * left to end by itself, it would keep the tenant, its quota and the memory
 * it holds for as long as it likes, while Slurm gives the step's gmbmem to
 * the next job.  Its session ends, its memory goes back, and the removal is
 * logged with what it ended.
 */
static void spank_remove(const char *occasion) {
  if (spank_tenant[0] == '\0') return;
  char why[ADMIN_RPC_WHY_MAX];
  struct admin_rpc *rpc = NULL;
  struct admin_tenant_removal out = {0};
  int rc = gmb__admin_rpc_open(spank_endpoint, SPANK_ADMIN_TIMEOUT_MS, NULL,
                               &rpc, why, sizeof why);
  if (rc == 0)
    rc = gmb__admin_tenant_remove(rpc, spank_tenant, 1, &out, why, sizeof why);
  gmb__admin_rpc_close(rpc);
  if (rc) {
    slurm_error("gmb: %s: cannot remove tenant %s at %s: %s", occasion,
                spank_tenant, spank_endpoint, why);
  } else if (out.evicted) {
    char fs[GMB_SIZE_BUFSZ];
    slurm_info("gmb: %s: tenant %s removed, ending %u sessions that "
               "outlived the step's tasks (%s freed)", occasion,
               spank_tenant, out.evicted,
               gmb__size_format(out.bytes_freed, fs, sizeof fs));
  } else if (!out.removed) {
    slurm_info("gmb: tenant %s goes when its %u sessions end", spank_tenant,
               out.sessions);
  }
  spank_tenant[0] = '\0';
}

/* Makes the step's tenant and gives its tasks the environment.  0, or -1
 * after saying why, with nothing left behind. */
static int spank_step_begin(spank_t sp, const struct step_conf *conf) {
  uint32_t job = 0, step = 0;
  if (spank_get_item(sp, S_JOB_ID, &job) != ESPANK_SUCCESS ||
      spank_get_item(sp, S_JOB_STEPID, &step) != ESPANK_SUCCESS) {
    return spank_fail("gmb: cannot read the job and step ids");
  }
  if (step == STEP_ID_EXTERN) return 0; /* no tasks of the user's */
  char why[STEP_WHY_MAX], tres[1024];
  uint64_t count = 0, quota = 0;
  if (spank_tres(job, step, tres, sizeof tres) != 0) return -1;
  if (gmb__step_gres_count(tres, conf->gres, &count, why, sizeof why) != 0 ||
      gmb__step_quota(spank_mem, count, conf->unit, conf->require_gres,
                      conf->gres, &quota, why, sizeof why) != 0) {
    return spank_fail("gmb: step %u.%u: %s", job, step, why);
  }
  if (quota == 0) return 0; /* the step asked for no GPU memory */

  /* Only what slurmstepd set for this step names its GPU (step.h): the
   * rest of the environment is the user's. */
  char sgpus[1024], jgpus[1024], gpu[80], run_dir[STEP_PATH_MAX];
  spank_getenv_or_empty(sp, "SLURM_STEP_GPUS", sgpus, sizeof sgpus);
  spank_getenv_or_empty(sp, "SLURM_JOB_GPUS", jgpus, sizeof jgpus);
  if (gmb__step_gpu(step, sgpus, jgpus, gpu, sizeof gpu, why,
                    sizeof why) != 0 ||
      gmb__step_run_dir(conf, gpu, run_dir, sizeof run_dir, why,
                        sizeof why) != 0) {
    return spank_fail("gmb: step %u.%u: %s", job, step, why);
  }
  struct wire_tenant_add spec = {.quota = quota};
  char token[80];
  if (gmb__step_tenant_name(job, step, spec.tenant, sizeof spec.tenant) != 0 ||
      spank_token(token, sizeof token, spec.token_sha256) != 0) {
    return spank_fail("gmb: step %u.%u: cannot make a tenant name or token",
                      job, step);
  }
  spec.has_token = 1;
  snprintf(spank_endpoint, sizeof spank_endpoint, "ipc://%s/admin.sock",
           run_dir);
  char rwhy[ADMIN_RPC_WHY_MAX], hint[STEP_PATH_MAX + 80];
  snprintf(hint, sizeof hint, "no gmb broker serves this step's GPU on this "
           "node; run dir %s", run_dir);
  struct admin_rpc *rpc = NULL;
  int rc = gmb__admin_rpc_open(spank_endpoint, SPANK_ADMIN_TIMEOUT_MS, hint,
                               &rpc, rwhy, sizeof rwhy);
  if (rc == 0) rc = gmb__admin_tenant_add(rpc, &spec, NULL, rwhy, sizeof rwhy);
  gmb__admin_rpc_close(rpc);
  char qs[GMB_SIZE_BUFSZ];
  gmb__size_format(quota, qs, sizeof qs);
  if (rc) {
    return spank_fail("gmb: step %u.%u: the broker did not make tenant %s of "
                      "%s: %s", job, step, spec.tenant, qs, rwhy);
  }
  snprintf(spank_tenant, sizeof spank_tenant, "%s", spec.tenant);

  char ldp[1024];
  struct step_env env;
  spank_getenv_or_empty(sp, "LD_PRELOAD", ldp, sizeof ldp);
  rc = gmb__step_env(conf, spec.tenant, token, run_dir, spank_preload, ldp,
                     &env, why, sizeof why);
  for (size_t i = 0; rc == 0 && i < env.n; i++)
    if (spank_setenv(sp, env.v[i].name, env.v[i].value, 1) != ESPANK_SUCCESS) {
      snprintf(why, sizeof why, "cannot set %s in the step's environment",
               env.v[i].name);
      rc = -1;
    }
  explicit_bzero(token, sizeof token);
  if (rc) {
    spank_remove("the step did not start");
    return spank_fail("gmb: step %u.%u: %s", job, step, why);
  }
  slurm_info("gmb: step %u.%u is tenant %s of %s at %s", job, step,
             spec.tenant, qs, run_dir);
  return 0;
}

int slurm_spank_init_post_opt(spank_t sp, int argc,
                                            char **argv) {
  struct step_conf conf;
  char why[STEP_WHY_MAX];
  if (gmb__step_conf_parse(argc, argv, &conf, why, sizeof why) != 0) {
    slurm_error("gmb: plugstack.conf: %s", why);
    return -1;
  }
  if (spank_context() != S_CTX_REMOTE) return 0;
  /* A failure fails each task before it runs, where the user sees why. */
  spank_step_begin(sp, &conf);
  return 0;
}

int slurm_spank_task_init_privileged(spank_t sp, int argc, char **argv) {
  (void)sp;
  (void)argc;
  (void)argv;
  if (spank_failed[0] == '\0') return 0;
  slurm_error("%s", spank_failed);
  return -1;
}

int slurm_spank_exit(spank_t sp, int argc, char **argv) {
  (void)argc;
  (void)argv;
  if (spank_context() == S_CTX_REMOTE) spank_remove("the step ended");
  (void)sp;
  return 0;
}
