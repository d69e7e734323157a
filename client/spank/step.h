/*
 * step.h - what gmb_spank.so decides for one Slurm job step, apart from
 * Slurm: its plugstack.conf arguments, the size asked (--gpu-mem), the
 * generic-resource count the controller placed, their agreement, the
 * tenant's name, the broker of the step's GPU, and the environment its
 * tasks get.  Nothing here talks to Slurm or to a broker, so all of it is
 * unit-tested (tests/unit/check_spank_step.c); gmb_spank.c does the I/O.
 *
 * Every function returns 0, or GMB_E_INVAL with a one-line reason in `why`
 * (no prefix, no newline) that the plugin passes to the user unchanged.
 */
#ifndef GMB_SPANK_STEP_H
#define GMB_SPANK_STEP_H

#include <stddef.h>
#include <stdint.h>

#define STEP_PATH_MAX 256
#define STEP_WHY_MAX 512

/* plugstack.conf: `required PATH/gmb_spank.so [run_dir=DIR]
 * [run_dir_per_gpu] [preload=PATH] [gres=NAME] [unit=SIZE] [gpu_info=DIR]
 * [require_gres]`. */
struct step_conf {
  char run_dir[STEP_PATH_MAX];  /* "": the default (/run/gmb as root) */
  int per_gpu;                  /* brokers in RUN_DIR/UUID, one per GPU */
  char preload[STEP_PATH_MAX];  /* libgmb-preload.so for --gpu-mem-preload */
  char gres[32];                /* the generic resource counted: gmbmem */
  uint64_t unit;                /* bytes per count of it: 1GiB */
  char gpu_info[STEP_PATH_MAX]; /* /proc/driver/nvidia/gpus */
  int require_gres;             /* --gpu-mem alone is refused */
};

/* Fills *c with the defaults, then reads the arguments.  An unknown one
 * is an error: a typo in plugstack.conf must not pass unnoticed. */
int gmb__step_conf_parse(int argc, char **argv, struct step_conf *c,
                         char *why, size_t cap);

/* --gpu-mem=SIZE: a size as gmbctl reads it ("8GiB", "512MiB", bytes),
 * not zero. */
int gmb__step_mem_parse(const char *s, uint64_t *out, char *why, size_t cap);

/*
 * The count of generic resource `name` in a Slurm TRES string, as the
 * controller reports a step's or job's (tres_per_node):
 * "gres:gpu:1,gres:gmbmem:8", also "gres/gmbmem:8", with a type
 * ("gres:gmbmem:a100:8") and a K/M/G suffix (powers of 1024).  *count is
 * 0 when `name` is not there (tres NULL or empty included).
 */
int gmb__step_gres_count(const char *tres, const char *name, uint64_t *count,
                         char *why, size_t cap);

/*
 * The step's quota from what it asked: --gpu-mem `mem` (0: not given) and
 * `count` units of `unit` bytes of the generic resource (0: not asked).
 * Both given: they must agree, the count being the size rounded up to
 * whole units (--gres=gmbmem:8 --gpu-mem=7.5GiB agree with a 1GiB unit;
 * --gpu-mem=9GiB does not, nor does 6GiB).  Only the count: count * unit.
 * Only the size: that size, unless `require_gres`.  Neither: *quota 0
 * (the step does not use gmb).
 */
int gmb__step_quota(uint64_t mem, uint64_t count, uint64_t unit,
                    int require_gres, const char *gres, uint64_t *quota,
                    char *why, size_t cap);

/* The tenant of job `job` step `step`: "slurm-JOB.STEP", the batch and
 * interactive steps as "slurm-JOB.batch", "slurm-JOB.interactive"; what
 * `gmbctl tenants` shows.  Steps are Slurm's numbers (SLURM_BATCH_SCRIPT
 * and so on), passed in so that this file needs no Slurm header. */
#define STEP_ID_BATCH 0xfffffffbu
#define STEP_ID_EXTERN 0xfffffffcu
#define STEP_ID_INTERACTIVE 0xfffffffau
int gmb__step_tenant_name(uint32_t job, uint32_t step, char *buf, size_t cap);

/*
 * The GPU step `step` is bound to, from what slurmstepd set for it: a
 * job step's SLURM_STEP_GPUS, the batch or interactive step's
 * SLURM_JOB_GPUS (Slurm's gres/gpu sets each to the GPUs it allocated, or
 * unsets it, before the plugin runs).  One entry, a UUID ("GPU-...") or
 * an index; "" in *gpu when the variable is unset.  Never the other
 * variable, nor CUDA_VISIBLE_DEVICES: Slurm leaves those as the job's
 * user exported them (sbatch passes the user's environment to the batch
 * step), and CUDA_VISIBLE_DEVICES is renumbered from 0 when Slurm
 * constrains devices, so either would let a step name another job's GPU.
 * More than one GPU is refused: a step's tenant lives on one broker.
 */
int gmb__step_gpu(uint32_t step, const char *step_gpus, const char *job_gpus,
                  char *gpu, size_t gcap, char *why, size_t cap);

/*
 * The UUID of the GPU whose device minor (/dev/nvidiaN) is `minor`, from
 * the driver's DIR/<PCI id>/information files ("Device Minor: N", "GPU
 * UUID: GPU-..."); DIR is /proc/driver/nvidia/gpus on a GPU node, a
 * directory of such files in tests.
 */
int gmb__step_uuid_of_minor(const char *dir, unsigned minor, char *uuid,
                            size_t ucap, char *why, size_t cap);

/*
 * The run dir of the step's broker: c->run_dir (or the default) when one
 * broker serves the node; with per_gpu, RUN_DIR/UUID of `gpu` (a UUID, or
 * an index mapped by gmb__step_uuid_of_minor).  per_gpu and no GPU bound
 * is an error.
 */
int gmb__step_run_dir(const struct step_conf *c, const char *gpu, char *out,
                      size_t ocap, char *why, size_t cap);

/* The environment a step's tasks get: GMB_TENANT, GMB_TOKEN, GMB_RUN_DIR,
 * and with `preload` LD_PRELOAD = c->preload before `ld_preload` (the
 * step's own, may be NULL). */
#define STEP_ENV_MAX 4
struct step_env {
  size_t n;
  struct {
    const char *name;
    char value[1024];
  } v[STEP_ENV_MAX];
};
int gmb__step_env(const struct step_conf *c, const char *tenant,
                  const char *token, const char *run_dir, int preload,
                  const char *ld_preload, struct step_env *env, char *why,
                  size_t cap);

#endif /* GMB_SPANK_STEP_H */
