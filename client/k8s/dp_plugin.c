/*
 * dp_plugin.c - owns what gmb-device-plugin promises the kubelet: the
 * device list (each GPU's broker capacity in units, healthy while its
 * broker answers), the allocations (a tenant on one GPU's broker per
 * container, with a fresh token), and their end (the tenant of a pod the
 * kubelet's pod-resources API no longer lists is removed once its sessions
 * ended).
 *
 * Invariants: a unit belongs to at most one allocation that is not gone;
 * every allocation in the table has its tenant on its broker (or will get
 * it again as soon as the broker is back up) and its token file; the state
 * file holds the table as it was after the last change, written before the
 * kubelet is told of an allocation.  An Allocate either makes every
 * container's tenant or none: what was made for the others is removed
 * before the error goes back.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <deviceplugin.pb-c.h> /* generated: BUILD/gen/k8s */
#include "dp.h"
#include "dp_grpc.h"
#include "gmb.h"
#include <podresources.pb-c.h> /* generated: BUILD/gen/k8s */
#include "util.h"
#include "wire.h"

#define DP_ADMIN_TIMEOUT_MS 3000
#define DP_POD_RESOURCES_TIMEOUT_MS 5000

/* --- GPUs and their brokers ------------------------------------------- */

int dp_gpu_get(struct dp *dp, const char *key) {
  for (size_t g = 0; g < dp->n_gpu; g++)
    if (strcmp(dp->gpu[g].key, key) == 0) return (int)g;
  if (dp->n_gpu >= DP_GPUS_MAX || strlen(key) >= DP_KEY_MAX) return -1;
  struct dp_gpu *gp = &dp->gpu[dp->n_gpu];
  memset(gp, 0, sizeof *gp);
  snprintf(gp->key, sizeof gp->key, "%s", key);
  if (dp->conf.per_gpu)
    snprintf(gp->dir, sizeof gp->dir, "%s/%s", dp->conf.run_dir, key);
  else
    snprintf(gp->dir, sizeof gp->dir, "%s", dp->conf.run_dir);
  dp->list_changed = 1;
  return (int)dp->n_gpu++;
}

void dp_alloc_drop(struct dp *dp, size_t i) {
  free(dp->allocs[i].units);
  dp->allocs[i] = dp->allocs[--dp->n_allocs];
}

void dp_free(struct dp *dp) {
  for (size_t g = 0; g < dp->n_gpu; g++) gmb__admin_rpc_close(dp->gpu[g].rpc);
  for (size_t i = 0; i < dp->n_allocs; i++) free(dp->allocs[i].units);
  free(dp->allocs);
  dp->allocs = NULL;
  dp->n_allocs = dp->cap_allocs = 0;
}

static void dp_gpu_down(struct dp_gpu *gp, const char *why) {
  if (gp->up) dp_log("GPU %s: its broker is down (%s): its units are "
                     "unhealthy", gp->key, why);
  gmb__admin_rpc_close(gp->rpc);
  gp->rpc = NULL;
  gp->up = 0;
}

static int dp_row_cmp(const void *key, const void *row) {
  return strcmp(key, ((const struct wire_tenant_row *)row)->name);
}

/* A broker that restarted (however quickly: its admin socket reconnects
 * by itself) lacks the tenants added at run time: the allocations still
 * live get theirs again.  `st` is its status, whose tenant rows are in
 * name order. */
/* The broker's run-time tenants (admin_rpc.h): a pod's tenant, proved by
 * its token's hash, with its quota and reservation. */
static int dp_tenant_add(struct admin_rpc *rpc, const struct dp_alloc *a,
                         char *why, size_t cap) {
  struct wire_tenant_add spec;
  memset(&spec, 0, sizeof spec);
  snprintf(spec.tenant, sizeof spec.tenant, "%s", a->tenant);
  spec.quota = a->quota;
  spec.reserve = a->reserve;
  spec.has_token = 1;
  memcpy(spec.token_sha256, a->sha256, sizeof spec.token_sha256);
  return gmb__admin_tenant_add(rpc, &spec, NULL, why, cap);
}

/* Removes a pod's tenant: at once when it is unused, else the broker
 * admits no new session of it and removes it when its last one ends.
 * 0 either way, GMB_E_NOENT when it is gone already. */
static int dp_tenant_remove(struct admin_rpc *rpc, const char *tenant,
                            char *why, size_t cap) {
  return gmb__admin_tenant_remove(rpc, tenant, 0, NULL, why, cap);
}

static void dp_gpu_restore(struct dp *dp, int g,
                           const struct wire_admin_status *st) {
  struct dp_gpu *gp = &dp->gpu[g];
  for (size_t i = 0; i < dp->n_allocs && gp->rpc; i++) {
    const struct dp_alloc *a = &dp->allocs[i];
    if (a->gpu != g || a->gone) continue;
    if (st->n_tenants &&
        bsearch(a->tenant, st->tenants, st->n_tenants, sizeof *st->tenants,
                dp_row_cmp))
      continue;
    dp_log("GPU %s: tenant %s is not on its broker (it restarted?): "
           "adding it again", gp->key, a->tenant);
    char why[ADMIN_RPC_WHY_MAX];
    int rc = dp_tenant_add(gp->rpc, a, why, sizeof why);
    if (rc == GMB_E_CONN || rc == GMB_E_TIMEOUT) dp_gpu_down(gp, why);
    else if (rc) dp_log("GPU %s: tenant %s not made again: %s", gp->key,
                        a->tenant, why);
  }
}

static void dp_gpu_poll(struct dp *dp, int g) {
  struct dp_gpu *gp = &dp->gpu[g];
  char why[ADMIN_RPC_WHY_MAX];
  if (gp->rpc == NULL) {
    char ep[sizeof gp->dir + 32];
    snprintf(ep, sizeof ep, "ipc://%s/admin.sock", gp->dir);
    if (gmb__admin_rpc_open(ep, DP_ADMIN_TIMEOUT_MS, NULL, &gp->rpc, why,
                            sizeof why) != 0) {
      gp->rpc = NULL;
      dp_gpu_down(gp, why);
      return;
    }
  }
  struct wire_request req = {.kind = WIRE_ADMIN_STATUS};
  struct wire_reply rep;
  if (gmb__admin_rpc_call(gp->rpc, &req, WIRE_ADMIN_STATUS, 0, &rep, why,
                          sizeof why) != 0) {
    dp_gpu_down(gp, why);
    dp->list_changed = 1;
    return;
  }
  uint64_t capacity = rep.u.admin_status.capacity;
  dp_gpu_restore(dp, g, &rep.u.admin_status);
  gmb__wire_reply_clear(&rep);
  if (gp->rpc == NULL) return; /* it went down meanwhile */
  uint64_t u = capacity / dp->conf.unit;
  uint32_t units = (uint32_t)(u > DP_UNITS_MAX ? DP_UNITS_MAX : u);
  if (capacity != gp->capacity) {
    char a[GMB_SIZE_BUFSZ], b[GMB_SIZE_BUFSZ];
    dp_log("GPU %s: broker capacity %s, %u units of %s", gp->key,
           gmb__size_format(capacity, a, sizeof a), units,
           gmb__size_format(dp->conf.unit, b, sizeof b));
    gp->capacity = capacity;
    if (dp_state_save(dp, why, sizeof why)) dp_log("%s", why);
  }
  if (units != gp->units) dp->list_changed = 1;
  gp->units = units;
  if (!gp->up) {
    gp->up = 1;
    dp_log("GPU %s: its broker is up: %u units healthy", gp->key, units);
    dp->list_changed = 1;
  }
}

static int dp_gpu_wanted(const struct dp *dp, const char *key) {
  if (dp->conf.n_gpus == 0) return 1;
  for (size_t i = 0; i < dp->conf.n_gpus; i++)
    if (strcmp(dp->conf.gpus[i], key) == 0) return 1;
  return 0;
}

void dp_brokers_poll(struct dp *dp) {
  if (dp->conf.per_gpu) {
    DIR *d = opendir(dp->conf.run_dir);
    struct dirent *e;
    while (d && (e = readdir(d)) != NULL) {
      if (!gmb__gpu_uuid_valid(e->d_name) || !dp_gpu_wanted(dp, e->d_name))
        continue;
      char sock[DP_PATH_MAX + 300];
      struct stat st;
      snprintf(sock, sizeof sock, "%s/%s/admin.sock", dp->conf.run_dir,
               e->d_name);
      if (stat(sock, &st) == 0 && S_ISSOCK(st.st_mode) &&
          dp_gpu_get(dp, e->d_name) < 0)
        dp_log("more than %d GPUs: %s is not advertised", DP_GPUS_MAX,
               e->d_name);
    }
    if (d) closedir(d);
  } else if (dp->n_gpu == 0) {
    dp_gpu_get(dp, "gmb");
  }
  for (size_t g = 0; g < dp->n_gpu; g++) {
    int was = dp->gpu[g].up;
    dp_gpu_poll(dp, (int)g);
    if (was != dp->gpu[g].up) dp->list_changed = 1;
  }
}

/* --- device ids ---------------------------------------------------------- */

/* "KEY_N" -> GPU index and unit; -1 when no such unit is advertised. */
static int dp_id_parse(const struct dp *dp, const char *id, int *g,
                       uint32_t *unit) {
  const char *us = id ? strrchr(id, '_') : NULL;
  if (us == NULL || us == id || (size_t)(us - id) >= DP_KEY_MAX) return -1;
  char key[DP_KEY_MAX];
  memcpy(key, id, (size_t)(us - id));
  key[us - id] = '\0';
  char *end;
  if (us[1] < '0' || us[1] > '9') return -1;
  errno = 0;
  unsigned long v = strtoul(us + 1, &end, 10);
  if (*end || errno || (us[1] == '0' && us[2] != '\0')) return -1;
  for (size_t i = 0; i < dp->n_gpu; i++)
    if (strcmp(dp->gpu[i].key, key) == 0) {
      if (v >= dp->gpu[i].units) return -1;
      *g = (int)i;
      *unit = (uint32_t)v;
      return 0;
    }
  return -1;
}

static int dp_u32_cmp(const void *a, const void *b) {
  uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
  return (x > y) - (x < y);
}

/* The allocation that is not gone and holds unit u of GPU g, or -1. */
static long dp_unit_owner(const struct dp *dp, int g, uint32_t u) {
  for (size_t i = 0; i < dp->n_allocs; i++) {
    const struct dp_alloc *a = &dp->allocs[i];
    if (a->gone || a->gpu != g) continue;
    if (a->n_units && bsearch(&u, a->units, a->n_units, sizeof u, dp_u32_cmp))
      return (long)i;
  }
  return -1;
}

/* --- the device list ---------------------------------------------------- */

int dp_list_encode(const struct dp *dp, uint8_t **buf, size_t *len) {
  size_t n = 0;
  for (size_t g = 0; g < dp->n_gpu; g++) n += dp->gpu[g].units;
  V1beta1__Device *devs = calloc(n ? n : 1, sizeof *devs);
  V1beta1__Device **ptrs = calloc(n ? n : 1, sizeof *ptrs);
  char (*ids)[DP_KEY_MAX + 12] = calloc(n ? n : 1, sizeof *ids);
  int rc = -1;
  if (devs && ptrs && ids) {
    size_t k = 0;
    for (size_t g = 0; g < dp->n_gpu; g++)
      for (uint32_t u = 0; u < dp->gpu[g].units; u++, k++) {
        v1beta1__device__init(&devs[k]);
        snprintf(ids[k], sizeof ids[k], "%s_%u", dp->gpu[g].key, u);
        devs[k].id = ids[k];
        devs[k].health = dp->gpu[g].up ? "Healthy" : "Unhealthy";
        ptrs[k] = &devs[k];
      }
    V1beta1__ListAndWatchResponse r = V1BETA1__LIST_AND_WATCH_RESPONSE__INIT;
    r.n_devices = n;
    r.devices = ptrs;
    *len = v1beta1__list_and_watch_response__get_packed_size(&r);
    *buf = malloc(*len ? *len : 1);
    if (*buf) {
      v1beta1__list_and_watch_response__pack(&r, *buf);
      rc = 0;
    }
  }
  free(devs);
  free(ptrs);
  free(ids);
  return rc;
}

/* --- what pod-resources says ------------------------------------------- */

/* The units pod-resources' List says pods hold, GPU by GPU: held[g] is a
 * bitmap of DP_UNITS_MAX bits, NULL when GPU g has none held.  0, or -1
 * with why when it did not answer, its reply did not decode, or memory
 * ran out: then nothing may be concluded from it.  The caller frees. */
static int dp_held(struct dp *dp, struct dpg *g, uint8_t *held[DP_GPUS_MAX],
                   char *why, size_t cap) {
  uint8_t *resp = NULL;
  size_t rlen = 0;
  memset(held, 0, DP_GPUS_MAX * sizeof *held);
  if (dpg_unary(g, dp->conf.pod_resources, "/v1.PodResourcesLister/List",
                (const uint8_t *)"", 0, DP_POD_RESOURCES_TIMEOUT_MS, &resp,
                &rlen, why, cap) != 0)
    return -1;
  V1__ListPodResourcesResponse *r =
      v1__list_pod_resources_response__unpack(NULL, rlen, resp);
  free(resp);
  if (r == NULL) {
    snprintf(why, cap, "the List reply does not decode");
    return -1;
  }
  int oom = 0;
  for (size_t p = 0; p < r->n_pod_resources; p++) {
    const V1__PodResources *pr = r->pod_resources[p];
    for (size_t c = 0; c < pr->n_containers; c++) {
      const V1__ContainerResources *cr = pr->containers[c];
      for (size_t d = 0; d < cr->n_devices; d++) {
        const V1__ContainerDevices *cd = cr->devices[d];
        if (cd->resource_name == NULL ||
            strcmp(cd->resource_name, dp->conf.resource) != 0)
          continue;
        for (size_t k = 0; k < cd->n_device_ids; k++) {
          int gi;
          uint32_t u;
          if (dp_id_parse(dp, cd->device_ids[k], &gi, &u) != 0) continue;
          if (held[gi] == NULL) held[gi] = calloc(DP_UNITS_MAX / 8, 1);
          if (held[gi] == NULL) {
            oom = 1;
            continue;
          }
          held[gi][u / 8] |= (uint8_t)(1u << (u % 8));
        }
      }
    }
  }
  v1__list_pod_resources_response__free_unpacked(r, NULL);
  if (oom) {
    for (size_t gi = 0; gi < DP_GPUS_MAX; gi++) free(held[gi]);
    memset(held, 0, DP_GPUS_MAX * sizeof *held);
    snprintf(why, cap, "out of memory");
    return -1;
  }
  return 0;
}

/* Whether a pod holds any of allocation a's units, by dp_held's map. */
static int dp_alloc_held(const struct dp_alloc *a,
                         uint8_t *const held[DP_GPUS_MAX]) {
  for (uint32_t k = 0; k < a->n_units && held[a->gpu]; k++)
    if ((held[a->gpu][a->units[k] / 8] >> (a->units[k] % 8)) & 1) return 1;
  return 0;
}

/* --- Allocate ------------------------------------------------------------ */

/* What one container's answer needs to outlive its building. */
struct dp_made {
  size_t alloc;                  /* index in dp->allocs */
  char token[2 * ADMIN_TOKEN_BYTES + 1];
  char endpoint[DP_PATH_MAX + 32], token_file[DP_PATH_MAX + 96];
  char host_sock[2][DP_PATH_MAX + DP_KEY_MAX + 16];
  char cont_sock[2][DP_PATH_MAX + 16];
  V1beta1__ContainerAllocateResponse__EnvsEntry env[6];
  V1beta1__ContainerAllocateResponse__EnvsEntry *envp[6];
  V1beta1__Mount mount[4];
  V1beta1__Mount *mountp[4];
  V1beta1__ContainerAllocateResponse resp;
};

/* Removes the tenant and token of allocation i (made by this Allocate),
 * and the record. */
static void dp_unmake(struct dp *dp, size_t i) {
  struct dp_alloc *a = &dp->allocs[i];
  struct dp_gpu *gp = &dp->gpu[a->gpu];
  char why[ADMIN_RPC_WHY_MAX];
  if (gp->rpc) {
    int rc = dp_tenant_remove(gp->rpc, a->tenant, why, sizeof why);
    if (rc && rc != GMB_E_NOENT)
      dp_log("tenant %s of a failed Allocate not removed: %s", a->tenant, why);
  }
  dp_token_unlink(dp, a);
  dp_alloc_drop(dp, i);
}

static int dp_failf(char *why, size_t cap, int code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static int dp_failf(char *why, size_t cap, int code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(why, cap, fmt, ap);
  va_end(ap);
  return code;
}

/* Writes the token file, mode 0644 under a secret name in a directory only
 * root may list (dp_state.c): the pod's container reads it whatever uid it
 * runs as. */
static int dp_token_write(const struct dp *dp, const uint8_t sha256[32],
                          const char *token, char *why, size_t cap) {
  char dir[DP_PATH_MAX + 16], path[DP_PATH_MAX + 96];
  snprintf(dir, sizeof dir, "%s/tokens", dp->conf.state_dir);
  if (mkdir(dir, 0711) != 0 && errno != EEXIST)
    return dp_failf(why, cap, DPG_INTERNAL, "mkdir %s: %s", dir,
                    strerror(errno));
  dp_token_path(dp, sha256, path, sizeof path);
  int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW,
                0644);
  if (fd < 0)
    return dp_failf(why, cap, DPG_INTERNAL, "cannot write %s: %s", path,
                    strerror(errno));
  size_t n = strlen(token);
  int bad = write(fd, token, n) != (ssize_t)n || fchmod(fd, 0644) != 0;
  bad |= close(fd) != 0;
  if (bad) {
    unlink(path);
    return dp_failf(why, cap, DPG_INTERNAL, "cannot write %s", path);
  }
  return 0;
}

/* Makes one container's allocation: checks its units, adds the tenant,
 * writes the token, appends the record.  0, or a gRPC code with why. */
static int dp_make(struct dp *dp, const V1beta1__ContainerAllocateRequest *cr,
                   struct dp_made *m, char *why, size_t cap) {
  size_t n = cr->n_devices_ids;
  if (n == 0)
    return dp_failf(why, cap, DPG_INVALID_ARGUMENT, "a container asks for "
                    "no %s units", dp->conf.resource);
  if (n > DP_UNITS_MAX)
    return dp_failf(why, cap, DPG_INVALID_ARGUMENT, "%zu units asked: more "
                    "than any GPU has", n);
  if (dp->n_allocs >= DP_ALLOCS_MAX)
    return dp_failf(why, cap, DPG_RESOURCE_EXHAUSTED, "%d allocations are "
                    "live on this node, the plugin's limit", DP_ALLOCS_MAX);
  uint32_t *units = calloc(n, sizeof *units);
  if (units == NULL) return dp_failf(why, cap, DPG_INTERNAL, "out of memory");
  int g = -1;
  for (size_t i = 0; i < n; i++) {
    int gi;
    if (dp_id_parse(dp, cr->devices_ids[i], &gi, &units[i]) != 0) {
      free(units);
      return dp_failf(why, cap, DPG_INVALID_ARGUMENT, "unknown device id "
                      "'%.70s': not a unit this plugin advertises",
                      cr->devices_ids[i] ? cr->devices_ids[i] : "");
    }
    if (g >= 0 && gi != g) {
      free(units);
      return dp_failf(why, cap, DPG_INVALID_ARGUMENT, "the units asked are "
                      "of two GPUs (%s and %s): one container's %s comes "
                      "from one GPU (the kubelet's preferred allocation "
                      "keeps to one; ask for fewer units, or free some on "
                      "one GPU)", dp->gpu[g].key, dp->gpu[gi].key,
                      dp->conf.resource);
    }
    g = gi;
  }
  qsort(units, n, sizeof *units, dp_u32_cmp);
  for (size_t i = 1; i < n; i++)
    if (units[i] == units[i - 1]) {
      dp_failf(why, cap, DPG_INVALID_ARGUMENT, "unit %s_%u asked twice",
               dp->gpu[g].key, units[i]);
      free(units);
      return DPG_INVALID_ARGUMENT;
    }
  for (size_t i = 0; i < n; i++) {
    long o = dp_unit_owner(dp, g, units[i]);
    if (o >= 0) {
      dp_failf(why, cap, DPG_FAILED_PRECONDITION, "unit %s_%u is allocated "
               "already (tenant %s)", dp->gpu[g].key, units[i],
               dp->allocs[o].tenant);
      free(units);
      return DPG_FAILED_PRECONDITION;
    }
  }
  struct dp_gpu *gp = &dp->gpu[g];
  if (!gp->up || gp->rpc == NULL) {
    free(units);
    return dp_failf(why, cap, DPG_UNAVAILABLE, "the broker of GPU %s is "
                    "down (no answer at %s/admin.sock)", gp->key, gp->dir);
  }
  /* Room for the record before anything is made, so that running out of
   * memory leaves no tenant or token file behind. */
  if (dp->n_allocs == dp->cap_allocs) {
    size_t nc = dp->cap_allocs ? 2 * dp->cap_allocs : 16;
    struct dp_alloc *na = realloc(dp->allocs, nc * sizeof *na);
    if (na == NULL) {
      free(units);
      return dp_failf(why, cap, DPG_INTERNAL, "out of memory");
    }
    dp->allocs = na;
    dp->cap_allocs = nc;
  }
  struct dp_alloc a = {0};
  char name_rand[2 * ADMIN_TOKEN_BYTES + 1];
  if (gmb__admin_token_new(name_rand) || gmb__admin_token_new(m->token) ||
      gmb__admin_token_sha256(m->token, strlen(m->token), a.sha256)) {
    free(units);
    return dp_failf(why, cap, DPG_INTERNAL, "no randomness from the kernel");
  }
  snprintf(a.tenant, sizeof a.tenant, "k8s-%.16s", name_rand);
  a.gpu = g;
  a.quota = (uint64_t)n * dp->conf.unit;
  a.reserve = a.quota / 100 * dp->conf.reserve_pct +
              a.quota % 100 * dp->conf.reserve_pct / 100;
  a.made = time(NULL);
  a.units = units;
  a.n_units = (uint32_t)n;
  int rc = dp_token_write(dp, a.sha256, m->token, why, cap);
  if (rc) {
    free(units);
    return rc;
  }
  char bwhy[ADMIN_RPC_WHY_MAX];
  int brc = dp_tenant_add(gp->rpc, &a, bwhy, sizeof bwhy);
  if (brc) {
    dp_token_unlink(dp, &a);
    free(units);
    if (brc == GMB_E_CONN || brc == GMB_E_TIMEOUT) {
      /* It may have been made before the answer was lost. */
      char w2[ADMIN_RPC_WHY_MAX];
      if (gp->rpc)
        dp_tenant_remove(gp->rpc, a.tenant, w2, sizeof w2);
      dp_gpu_down(gp, bwhy);
      dp->list_changed = 1;
      return dp_failf(why, cap, DPG_UNAVAILABLE, "the broker of GPU %s: %s",
                      gp->key, bwhy);
    }
    return dp_failf(why, cap,
                    brc == GMB_E_LIMIT ? DPG_RESOURCE_EXHAUSTED
                                       : DPG_FAILED_PRECONDITION,
                    "the broker of GPU %s refused tenant %s: %s", gp->key,
                    a.tenant, bwhy);
  }
  m->alloc = dp->n_allocs;
  dp->allocs[dp->n_allocs++] = a;
  return 0;
}

static void dp_env(struct dp_made *m, size_t *k, const char *key,
                   const char *value) {
  V1beta1__ContainerAllocateResponse__EnvsEntry *e = &m->env[*k];
  v1beta1__container_allocate_response__envs_entry__init(e);
  e->key = (char *)key;
  e->value = (char *)value;
  m->envp[(*k)++] = e;
}

static void dp_mount(struct dp_made *m, size_t *k, const char *host,
                     const char *cont) {
  V1beta1__Mount *mt = &m->mount[*k];
  v1beta1__mount__init(mt);
  mt->host_path = (char *)host;
  mt->container_path = (char *)cont;
  mt->read_only = 1;
  m->mountp[(*k)++] = mt;
}

#define DP_TOKEN_IN_CONTAINER "/run/secrets/gmb/token"
#define DP_PRELOAD_IN_CONTAINER "/usr/lib/gmb/libgmb-preload.so"

/* The container's environment and mounts for allocation m->alloc. */
static void dp_made_answer(const struct dp *dp, struct dp_made *m) {
  const struct dp_alloc *a = &dp->allocs[m->alloc];
  const struct dp_conf *c = &dp->conf;
  v1beta1__container_allocate_response__init(&m->resp);
  size_t ne = 0, nm = 0;
  snprintf(m->endpoint, sizeof m->endpoint, "ipc://%s/broker.sock",
           c->container_run_dir);
  dp_env(m, &ne, "GMB_TENANT", a->tenant);
  dp_env(m, &ne, "GMB_RUN_DIR", c->container_run_dir);
  dp_env(m, &ne, "GMB_ENDPOINT", m->endpoint);
  /* The broker's two client sockets, each mounted read-only (connecting
   * to a socket needs no write access to its file system): never its
   * admin socket, which the plugin itself uses.  A mount names the file
   * the runtime finds when the container starts; a broker that restarts
   * makes new sockets, which a container started after it gets. */
  static const char *const socks[2] = {"broker.sock", "fd.sock"};
  for (int k = 0; k < 2; k++) {
    snprintf(m->host_sock[k], sizeof m->host_sock[k], "%s/%s",
             dp->gpu[a->gpu].dir, socks[k]);
    snprintf(m->cont_sock[k], sizeof m->cont_sock[k], "%s/%s",
             c->container_run_dir, socks[k]);
    dp_mount(m, &nm, m->host_sock[k], m->cont_sock[k]);
  }
  if (c->token_env) {
    dp_env(m, &ne, "GMB_TOKEN", m->token);
  } else {
    dp_token_path(dp, a->sha256, m->token_file, sizeof m->token_file);
    dp_env(m, &ne, "GMB_TOKEN_FILE", DP_TOKEN_IN_CONTAINER);
    dp_mount(m, &nm, m->token_file, DP_TOKEN_IN_CONTAINER);
  }
  if (c->preload[0]) {
    dp_env(m, &ne, "LD_PRELOAD", DP_PRELOAD_IN_CONTAINER);
    dp_mount(m, &nm, c->preload, DP_PRELOAD_IN_CONTAINER);
  }
  m->resp.n_envs = ne;
  m->resp.envs = m->envp;
  m->resp.n_mounts = nm;
  m->resp.mounts = m->mountp;
}

/*
 * Units the kubelet asks for that an allocation of ours still holds.  The
 * kubelet offers only units no active pod holds, so normally that
 * allocation's pod is over: it ended within grace_s of its Allocate (the
 * collection keeps allocations that young), or before the last
 * collection saw it go; the kubelet frees its units at once and its
 * preferred allocation picks the same ones first.  Refusing would fail the
 * next pod's admission for as long as grace_s, and a user who starts and
 * ends short pods could keep others' pods off the node that way.  So the
 * holders are asked about once, here: an allocation none of whose units
 * pod-resources lists is marked gone (its tenant is removed at the next
 * collection, once its sessions end); one a listed pod still holds keeps
 * its units, and dp_make refuses them.  1 when an allocation was marked.
 */
static int dp_settle_conflicts(struct dp *dp, struct dpg *g,
                               const V1beta1__AllocateRequest *r) {
  int conflict = 0;
  for (size_t c = 0; c < r->n_container_requests && !conflict; c++) {
    const V1beta1__ContainerAllocateRequest *cr = r->container_requests[c];
    for (size_t i = 0; i < cr->n_devices_ids && !conflict; i++) {
      int gi;
      uint32_t u;
      conflict = dp_id_parse(dp, cr->devices_ids[i], &gi, &u) == 0 &&
                 dp_unit_owner(dp, gi, u) >= 0;
    }
  }
  if (!conflict) return 0;
  char why[1024];
  uint8_t *held[DP_GPUS_MAX];
  if (dp_held(dp, g, held, why, sizeof why) != 0) {
    dp_log("pod-resources: %s: units asked again are kept by their "
           "allocations", why);
    return 0;
  }
  int marked = 0;
  for (size_t c = 0; c < r->n_container_requests; c++) {
    const V1beta1__ContainerAllocateRequest *cr = r->container_requests[c];
    for (size_t i = 0; i < cr->n_devices_ids; i++) {
      int gi;
      uint32_t u;
      if (dp_id_parse(dp, cr->devices_ids[i], &gi, &u) != 0) continue;
      long o = dp_unit_owner(dp, gi, u);
      if (o < 0 || dp_alloc_held(&dp->allocs[o], held)) continue;
      dp->allocs[o].gone = 1;
      marked = 1;
      dp_log("tenant %s: the kubelet gives its units to another pod and "
             "no pod holds them: removed once its sessions end",
             dp->allocs[o].tenant);
    }
  }
  for (size_t gi = 0; gi < DP_GPUS_MAX; gi++) free(held[gi]);
  return marked;
}

static void dp_allocate(struct dp *dp, struct dpg *g, struct dpg_call *call,
                        const uint8_t *req, size_t len) {
  V1beta1__AllocateRequest *r = v1beta1__allocate_request__unpack(NULL, len,
                                                                 req);
  if (r == NULL) {
    dpg_fail(call, DPG_INVALID_ARGUMENT, "the AllocateRequest does not "
             "decode");
    return;
  }
  size_t n = r->n_container_requests;
  char why[1024] = "";
  int code = 0;
  struct dp_made *made = n ? calloc(n, sizeof *made) : NULL;
  V1beta1__ContainerAllocateResponse **resps =
      n ? calloc(n, sizeof *resps) : NULL;
  size_t done = 0; /* containers made */
  int settled = n ? dp_settle_conflicts(dp, g, r) : 0;
  if (n == 0) code = dp_failf(why, sizeof why, DPG_INVALID_ARGUMENT,
                              "the AllocateRequest names no container");
  else if (made == NULL || resps == NULL)
    code = dp_failf(why, sizeof why, DPG_INTERNAL, "out of memory");
  while (code == 0 && done < n) {
    code = dp_make(dp, r->container_requests[done], &made[done], why,
                   sizeof why);
    if (code == 0) done++;
  }
  if (code == 0 && dp_state_save(dp, why, sizeof why) != 0)
    code = DPG_INTERNAL;
  if (code != 0) {
    /* Nothing half-made: undo the containers made before the failure
     * (their records are the last ones, in order). */
    for (size_t k = done; k-- > 0;) dp_unmake(dp, made[k].alloc);
    if (done || settled) {
      char w2[512];
      if (dp_state_save(dp, w2, sizeof w2)) dp_log("%s", w2);
    }
    dp_log("Allocate refused: %s", why);
    dpg_fail(call, code, why);
  } else {
    V1beta1__AllocateResponse out = V1BETA1__ALLOCATE_RESPONSE__INIT;
    for (size_t k = 0; k < n; k++) {
      dp_made_answer(dp, &made[k]);
      resps[k] = &made[k].resp;
      const struct dp_alloc *a = &dp->allocs[made[k].alloc];
      char q[GMB_SIZE_BUFSZ];
      dp_log("Allocate: tenant %s on GPU %s, %u units, quota %s", a->tenant,
             dp->gpu[a->gpu].key, a->n_units,
             gmb__size_format(a->quota, q, sizeof q));
    }
    out.n_container_responses = n;
    out.container_responses = resps;
    size_t plen = v1beta1__allocate_response__get_packed_size(&out);
    uint8_t *buf = malloc(plen ? plen : 1);
    if (buf == NULL) {
      dpg_fail(call, DPG_INTERNAL, "out of memory");
    } else {
      v1beta1__allocate_response__pack(&out, buf);
      dpg_reply(call, buf, plen);
      free(buf);
    }
  }
  if (made)
    for (size_t k = 0; k < n; k++)
      memset(made[k].token, 0, sizeof made[k].token);
  free(made);
  free(resps);
  v1beta1__allocate_request__free_unpacked(r, NULL);
}

/* --- GetPreferredAllocation ---------------------------------------------- */

/* For each container: units of one GPU, those it must include first, then
 * the others of that GPU from the available ones; the GPU is the one that
 * the must-include units name, else the one with the fewest available
 * units that still has enough (so that big holes stay for big pods). */
static void dp_preferred(struct dp *dp, struct dpg_call *call,
                         const uint8_t *req, size_t len) {
  V1beta1__PreferredAllocationRequest *r =
      v1beta1__preferred_allocation_request__unpack(NULL, len, req);
  if (r == NULL) {
    dpg_fail(call, DPG_INVALID_ARGUMENT, "the PreferredAllocationRequest "
             "does not decode");
    return;
  }
  size_t n = r->n_container_requests;
  V1beta1__ContainerPreferredAllocationResponse *cs =
      calloc(n ? n : 1, sizeof *cs);
  V1beta1__ContainerPreferredAllocationResponse **cp =
      calloc(n ? n : 1, sizeof *cp);
  char ***lists = calloc(n ? n : 1, sizeof *lists);
  int ok = cs && cp && lists;
  for (size_t i = 0; ok && i < n; i++) {
    const V1beta1__ContainerPreferredAllocationRequest *c =
        r->container_requests[i];
    v1beta1__container_preferred_allocation_response__init(&cs[i]);
    cp[i] = &cs[i];
    size_t want = c->allocation_size > 0 ? (size_t)c->allocation_size : 0;
    size_t avail_per[DP_GPUS_MAX] = {0};
    int gu;
    uint32_t u;
    for (size_t k = 0; k < c->n_available_deviceids; k++)
      if (dp_id_parse(dp, c->available_deviceids[k], &gu, &u) == 0)
        avail_per[gu]++;
    int g = -1;
    for (size_t k = 0; k < c->n_must_include_deviceids && g < 0; k++)
      if (dp_id_parse(dp, c->must_include_deviceids[k], &gu, &u) == 0) g = gu;
    int fixed = g >= 0;
    for (size_t k = 0; !fixed && k < dp->n_gpu; k++)
      if (dp->gpu[k].up && avail_per[k] >= want &&
          (g < 0 || avail_per[k] < avail_per[g]))
        g = (int)k;
    if (g < 0) /* none has enough: the one with the most */
      for (size_t k = 0; k < dp->n_gpu; k++)
        if (g < 0 || avail_per[k] > avail_per[g]) g = (int)k;
    lists[i] = calloc(want ? want : 1, sizeof *lists[i]);
    if (lists[i] == NULL) {
      ok = 0;
      break;
    }
    size_t got = 0;
    for (size_t k = 0; k < c->n_must_include_deviceids && got < want; k++)
      lists[i][got++] = c->must_include_deviceids[k];
    for (size_t k = 0; k < c->n_available_deviceids && got < want; k++) {
      if (dp_id_parse(dp, c->available_deviceids[k], &gu, &u) != 0 || gu != g)
        continue;
      int dup = 0;
      for (size_t j = 0; j < got && !dup; j++)
        dup = strcmp(lists[i][j], c->available_deviceids[k]) == 0;
      if (!dup) lists[i][got++] = c->available_deviceids[k];
    }
    cs[i].n_deviceids = got;
    cs[i].deviceids = lists[i];
  }
  if (!ok) {
    dpg_fail(call, DPG_INTERNAL, "out of memory");
  } else {
    V1beta1__PreferredAllocationResponse out =
        V1BETA1__PREFERRED_ALLOCATION_RESPONSE__INIT;
    out.n_container_responses = n;
    out.container_responses = cp;
    size_t plen = v1beta1__preferred_allocation_response__get_packed_size(&out);
    uint8_t *buf = malloc(plen ? plen : 1);
    if (buf) {
      v1beta1__preferred_allocation_response__pack(&out, buf);
      dpg_reply(call, buf, plen);
      free(buf);
    } else {
      dpg_fail(call, DPG_INTERNAL, "out of memory");
    }
  }
  for (size_t i = 0; lists && i < n; i++) free(lists[i]);
  free(lists);
  free(cs);
  free(cp);
  v1beta1__preferred_allocation_request__free_unpacked(r, NULL);
}

/* --- the other calls ------------------------------------------------------ */

void dp_handle(struct dp *dp, struct dpg *g, struct dpg_call *call,
               int method, const uint8_t *req, size_t len) {
  switch (method) {
    case DPG_OPTIONS: {
      V1beta1__DevicePluginOptions o = V1BETA1__DEVICE_PLUGIN_OPTIONS__INIT;
      o.get_preferred_allocation_available = 1;
      uint8_t buf[16];
      size_t n = v1beta1__device_plugin_options__pack(&o, buf);
      dpg_reply(call, buf, n);
      return;
    }
    case DPG_LIST_AND_WATCH: {
      uint8_t *buf;
      size_t n;
      if (dp_list_encode(dp, &buf, &n) != 0) {
        dpg_fail(call, DPG_INTERNAL, "out of memory");
        return;
      }
      dpg_stream_keep(call, buf, n);
      free(buf);
      return;
    }
    case DPG_PREFERRED:
      dp_preferred(dp, call, req, len);
      return;
    case DPG_ALLOCATE:
      dp_allocate(dp, g, call, req, len);
      return;
    case DPG_PRESTART: {
      /* Not asked for (pre_start_required is false); an empty answer. */
      V1beta1__PreStartContainerRequest *r =
          v1beta1__pre_start_container_request__unpack(NULL, len, req);
      if (r == NULL) {
        dpg_fail(call, DPG_INVALID_ARGUMENT, "the PreStartContainerRequest "
                 "does not decode");
        return;
      }
      v1beta1__pre_start_container_request__free_unpacked(r, NULL);
      dpg_reply(call, (const uint8_t *)"", 0);
      return;
    }
    default:
      dpg_fail(call, DPG_UNIMPLEMENTED, "not a DevicePlugin method");
  }
}

/* --- the end of a pod ---------------------------------------------------- */

void dp_collect(struct dp *dp, struct dpg *g) {
  static int warned;
  char why[1024];
  uint8_t *held[DP_GPUS_MAX];
  if (dp_held(dp, g, held, why, sizeof why) != 0) {
    /* No answer is no news: nothing is removed while the kubelet is away. */
    if (!warned++) dp_log("pod-resources: %s (tenants of gone pods are "
                          "removed once it answers)", why);
    return;
  }
  warned = 0;
  int changed = 0;
  time_t now = time(NULL);
  for (size_t i = 0; i < dp->n_allocs; i++) {
    struct dp_alloc *a = &dp->allocs[i];
    /* time() counts whole seconds: more than grace_s of them have passed
     * when the difference is above it. */
    if (a->gone || now - a->made <= dp->conf.grace_s) continue;
    if (dp_alloc_held(a, held)) continue;
    a->gone = 1;
    changed = 1;
    dp_log("tenant %s: its pod holds its units no more: removed once its "
           "sessions end", a->tenant);
  }
  for (size_t gi = 0; gi < DP_GPUS_MAX; gi++) free(held[gi]);
  for (size_t i = dp->n_allocs; i-- > 0;) {
    struct dp_alloc *a = &dp->allocs[i];
    struct dp_gpu *gp = &dp->gpu[a->gpu];
    if (!a->gone || gp->rpc == NULL) continue;
    int rc = dp_tenant_remove(gp->rpc, a->tenant, why, sizeof why);
    if (rc == GMB_E_LIMIT) continue; /* its sessions still run: later */
    if (rc && rc != GMB_E_NOENT) {
      dp_log("tenant %s: not removed yet: %s", a->tenant, why);
      continue;
    }
    dp_token_unlink(dp, a);
    dp_log("tenant %s removed from GPU %s", a->tenant, gp->key);
    dp_alloc_drop(dp, i);
    changed = 1;
  }
  if (changed && dp_state_save(dp, why, sizeof why)) dp_log("%s", why);
}
