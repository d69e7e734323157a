/*
 * step.c - one Slurm job step's plan: arguments, sizes, the generic
 * resource's count, the tenant's name, its broker and its environment
 * (step.h).  Pure functions over strings and files; the only state is
 * what the caller passes.
 *
 * Invariant kept for the plugin: what comes out is checked here (a quota
 * is never 0 for a step that uses gmb, a run dir fits its buffer, a GPU is
 * one entry), so gmb_spank.c never acts on half an answer.
 */
#include "step.h"

#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gmb.h"
#include "util.h"

#define STEP_DEFAULT_RUN_DIR "/run/gmb"
#define STEP_DEFAULT_GPU_INFO "/proc/driver/nvidia/gpus"

static int step_fail(char *why, size_t cap, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static int step_fail(char *why, size_t cap, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(why, cap, fmt, ap);
  va_end(ap);
  return GMB_E_INVAL;
}

/* Copies `val` into a path field; an empty or too long value is an error. */
static int step_path(char *dst, size_t dcap, const char *key, const char *val,
                     char *why, size_t cap) {
  if (val[0] == '\0' || strlen(val) >= dcap)
    return step_fail(why, cap, "%s: want a path of 1 to %zu characters", key,
                     dcap - 1);
  memcpy(dst, val, strlen(val) + 1);
  return 0;
}

int gmb__step_conf_parse(int argc, char **argv, struct step_conf *c,
                         char *why, size_t cap) {
  memset(c, 0, sizeof *c);
  snprintf(c->run_dir, sizeof c->run_dir, "%s", STEP_DEFAULT_RUN_DIR);
  snprintf(c->gres, sizeof c->gres, "gmbmem");
  snprintf(c->gpu_info, sizeof c->gpu_info, "%s", STEP_DEFAULT_GPU_INFO);
  c->unit = UINT64_C(1) << 30;
  for (int i = 0; i < argc; i++) {
    const char *a = argv[i];
    const char *eq = strchr(a, '=');
    const char *val = eq ? eq + 1 : NULL;
    size_t klen = eq ? (size_t)(eq - a) : strlen(a);
#define STEP_KEY(k) (klen == strlen(k) && strncmp(a, k, klen) == 0)
    int rc = 0;
    if (STEP_KEY("run_dir_per_gpu") && !val) {
      c->per_gpu = 1;
    } else if (STEP_KEY("require_gres") && !val) {
      c->require_gres = 1;
    } else if (STEP_KEY("run_dir") && val) {
      rc = step_path(c->run_dir, sizeof c->run_dir, "run_dir", val, why, cap);
    } else if (STEP_KEY("preload") && val) {
      rc = step_path(c->preload, sizeof c->preload, "preload", val, why, cap);
    } else if (STEP_KEY("gpu_info") && val) {
      rc = step_path(c->gpu_info, sizeof c->gpu_info, "gpu_info", val, why,
                     cap);
    } else if (STEP_KEY("gres") && val) {
      if (!gmb__name_valid(val) || strlen(val) >= sizeof c->gres)
        return step_fail(why, cap, "gres=%.60s: not a generic resource name",
                         val);
      snprintf(c->gres, sizeof c->gres, "%s", val);
    } else if (STEP_KEY("unit") && val) {
      if (gmb__size_parse(val, &c->unit) != 0 || c->unit == 0)
        return step_fail(why, cap, "unit=%.60s: want a size such as 1GiB",
                         val);
    } else {
      return step_fail(why, cap, "unknown plugstack.conf argument '%.80s' "
                       "(known: run_dir=DIR run_dir_per_gpu preload=PATH "
                       "gres=NAME unit=SIZE gpu_info=DIR require_gres)", a);
    }
#undef STEP_KEY
    if (rc) return rc;
  }
  return 0;
}

int gmb__step_mem_parse(const char *s, uint64_t *out, char *why, size_t cap) {
  if (s == NULL || gmb__size_parse(s, out) != 0 || *out == 0)
    return step_fail(why, cap, "--gpu-mem=%.60s: want a size such as 8GiB or "
                     "512MiB", s ? s : "");
  return 0;
}

/* A Slurm count: digits and an optional K, M or G (powers of 1024). */
static int step_count_parse(const char *s, size_t n, uint64_t *out) {
  uint64_t v = 0;
  size_t i = 0;
  if (n == 0 || !isdigit((unsigned char)s[0])) return -1;
  for (; i < n && isdigit((unsigned char)s[i]); i++) {
    if (v > (UINT64_MAX - 9) / 10) return -1;
    v = v * 10 + (uint64_t)(s[i] - '0');
  }
  if (i < n) {
    unsigned shift;
    switch (toupper((unsigned char)s[i])) {
      case 'K': shift = 10; break;
      case 'M': shift = 20; break;
      case 'G': shift = 30; break;
      default: return -1;
    }
    if (i + 1 != n || v > (UINT64_MAX >> shift)) return -1;
    v <<= shift;
  }
  *out = v;
  return 0;
}

int gmb__step_gres_count(const char *tres, const char *name, uint64_t *count,
                         char *why, size_t cap) {
  *count = 0;
  if (tres == NULL) return 0;
  size_t nlen = strlen(name);
  const char *p = tres;
  while (*p) {
    size_t len = strcspn(p, ",");
    /* "gres:NAME[:TYPE]:COUNT" or "gres/NAME..." */
    if (len > 5 && strncmp(p, "gres", 4) == 0 && (p[4] == ':' || p[4] == '/') &&
        len > 5 + nlen && strncmp(p + 5, name, nlen) == 0 &&
        p[5 + nlen] == ':') {
      const char *last = p + len;
      while (last > p && last[-1] != ':') last--;
      uint64_t v;
      /* Two entries of the resource are added, never wrapped: a sum that
       * wrapped would be a small quota, or none. */
      if (step_count_parse(last, (size_t)(p + len - last), &v) != 0 ||
          v > UINT64_MAX - *count)
        return step_fail(why, cap, "cannot read the count of %s in Slurm's "
                         "'%.*s'", name, (int)(len > 80 ? 80 : len), p);
      *count += v;
    }
    p += len;
    if (*p == ',') p++;
  }
  return 0;
}

int gmb__step_quota(uint64_t mem, uint64_t count, uint64_t unit,
                    int require_gres, const char *gres, uint64_t *quota,
                    char *why, size_t cap) {
  char ms[GMB_SIZE_BUFSZ], us[GMB_SIZE_BUFSZ];
  *quota = 0;
  gmb__size_format(unit, us, sizeof us);
  if (count && count > UINT64_MAX / unit)
    return step_fail(why, cap, "--gres=%s:%llu is past any GPU's memory",
                     gres, (unsigned long long)count);
  if (mem == 0) {
    *quota = count * unit;
    return 0;
  }
  gmb__size_format(mem, ms, sizeof ms);
  if (count == 0) {
    if (require_gres)
      return step_fail(why, cap, "--gpu-mem=%s needs --gres=%s:%llu (units "
                       "of %s) so that Slurm counts it", ms, gres,
                       (unsigned long long)(mem / unit + (mem % unit != 0)),
                       us);
    *quota = mem;
    return 0;
  }
  uint64_t need = mem / unit + (mem % unit != 0);
  if (need != count)
    return step_fail(why, cap, "--gpu-mem=%s and --gres=%s:%llu disagree: "
                     "with units of %s, %s is --gres=%s:%llu", ms, gres,
                     (unsigned long long)count, us, ms, gres,
                     (unsigned long long)need);
  *quota = mem;
  return 0;
}

int gmb__step_tenant_name(uint32_t job, uint32_t step, char *buf, size_t cap) {
  int n;
  if (step == STEP_ID_BATCH)
    n = snprintf(buf, cap, "slurm-%u.batch", job);
  else if (step == STEP_ID_INTERACTIVE)
    n = snprintf(buf, cap, "slurm-%u.interactive", job);
  else if (step == STEP_ID_EXTERN)
    n = snprintf(buf, cap, "slurm-%u.extern", job);
  else
    n = snprintf(buf, cap, "slurm-%u.%u", job, step);
  return n < 0 || (size_t)n >= cap ? GMB_E_INVAL : 0;
}

int gmb__step_gpu(uint32_t step, const char *step_gpus, const char *job_gpus,
                  char *gpu, size_t gcap, char *why, size_t cap) {
  int whole_job = step == STEP_ID_BATCH || step == STEP_ID_INTERACTIVE;
  const char *src = whole_job ? job_gpus : step_gpus;
  const char *what = whole_job ? "SLURM_JOB_GPUS" : "SLURM_STEP_GPUS";
  gpu[0] = '\0';
  if (src == NULL || *src == '\0') return 0;
  if (strchr(src, ',') != NULL)
    return step_fail(why, cap, "the step has several GPUs (%s=%.80s): a "
                     "gmb tenant lives on one GPU's broker; run one step per "
                     "GPU", what, src);
  if (strlen(src) >= gcap || !(gmb__gpu_uuid_valid(src) ||
                               strspn(src, "0123456789") == strlen(src)))
    return step_fail(why, cap, "%s=%.80s: want a GPU index or UUID", what,
                     src);
  memcpy(gpu, src, strlen(src) + 1);
  return 0;
}

/* One information file: 1 with *uuid set when its minor is `minor`. */
static int step_info_match(const char *path, unsigned minor, char *uuid,
                           size_t ucap) {
  FILE *f = fopen(path, "r");
  if (f == NULL) return 0;
  char line[256], id[80] = "";
  long m = -1;
  while (fgets(line, sizeof line, f)) {
    if (strncmp(line, "Device Minor:", 13) == 0)
      m = strtol(line + 13, NULL, 10);
    else if (strncmp(line, "GPU UUID:", 9) == 0)
      sscanf(line + 9, " %79s", id);
  }
  fclose(f);
  if (m < 0 || (unsigned long)m != minor || !gmb__gpu_uuid_valid(id) ||
      strlen(id) >= ucap)
    return 0;
  memcpy(uuid, id, strlen(id) + 1);
  return 1;
}

int gmb__step_uuid_of_minor(const char *dir, unsigned minor, char *uuid,
                            size_t ucap, char *why, size_t cap) {
  DIR *d = opendir(dir);
  if (d == NULL)
    return step_fail(why, cap, "cannot read %s (%s): no driver to tell GPU "
                     "%u's UUID", dir, strerror(errno), minor);
  struct dirent *e;
  int found = 0;
  while (!found && (e = readdir(d)) != NULL) {
    if (e->d_name[0] == '.') continue;
    char path[STEP_PATH_MAX + 300];
    snprintf(path, sizeof path, "%s/%s/information", dir, e->d_name);
    found = step_info_match(path, minor, uuid, ucap);
  }
  closedir(d);
  if (!found)
    return step_fail(why, cap, "no GPU with device minor %u in %s", minor,
                     dir);
  return 0;
}

int gmb__step_run_dir(const struct step_conf *c, const char *gpu, char *out,
                      size_t ocap, char *why, size_t cap) {
  if (!c->per_gpu) {
    if (strlen(c->run_dir) >= ocap)
      return step_fail(why, cap, "run dir too long");
    memcpy(out, c->run_dir, strlen(c->run_dir) + 1);
    return 0;
  }
  if (gpu == NULL || gpu[0] == '\0')
    return step_fail(why, cap, "one broker per GPU (run_dir_per_gpu) and the "
                     "step is bound to no GPU: ask for one (--gres=gpu:1)");
  char uuid[80];
  if (gmb__gpu_uuid_valid(gpu)) {
    snprintf(uuid, sizeof uuid, "%s", gpu);
  } else {
    int rc = gmb__step_uuid_of_minor(c->gpu_info, (unsigned)atoi(gpu), uuid,
                                     sizeof uuid, why, cap);
    if (rc) return rc;
  }
  if (gmb__run_dir_gpu(c->run_dir, uuid, out, ocap) == NULL)
    return step_fail(why, cap, "run dir too long");
  return 0;
}

static int step_env_add(struct step_env *env, const char *name,
                        const char *value, char *why, size_t cap) {
  if (env->n >= STEP_ENV_MAX)
    return step_fail(why, cap, "%s: more variables than a step holds", name);
  if (strlen(value) >= sizeof env->v[0].value)
    return step_fail(why, cap, "%s would be too long", name);
  env->v[env->n].name = name;
  memcpy(env->v[env->n].value, value, strlen(value) + 1);
  env->n++;
  return 0;
}

int gmb__step_env(const struct step_conf *c, const char *tenant,
                  const char *token, const char *run_dir, int preload,
                  const char *ld_preload, struct step_env *env, char *why,
                  size_t cap) {
  env->n = 0;
  int rc = step_env_add(env, "GMB_TENANT", tenant, why, cap);
  if (rc == 0) rc = step_env_add(env, "GMB_TOKEN", token, why, cap);
  if (rc == 0) rc = step_env_add(env, "GMB_RUN_DIR", run_dir, why, cap);
  if (rc || !preload) return rc;
  if (c->preload[0] == '\0')
    return step_fail(why, cap, "--gpu-mem-preload: this cluster's "
                     "plugstack.conf names no preload=PATH for gmb_spank.so");
  char v[sizeof env->v[0].value];
  /* The loader takes a list separated by spaces or colons; the shim goes
   * first so that its cudaMalloc is the one found. */
  int n = ld_preload && *ld_preload
              ? snprintf(v, sizeof v, "%s:%s", c->preload, ld_preload)
              : snprintf(v, sizeof v, "%s", c->preload);
  if (n < 0 || (size_t)n >= sizeof v)
    return step_fail(why, cap, "LD_PRELOAD would be too long");
  return step_env_add(env, "LD_PRELOAD", v, why, cap);
}
