/*
 * nvml.c - NVML's memory figures under libgmb-preload.so:
 * nvmlDeviceGetMemoryInfo and nvmlDeviceGetMemoryInfo_v2 report what
 * cudaMemGetInfo reports (preload.c, gmb__pre_figures): the tenant's
 * quota as total, what it can still get as free, and total - free as
 * used, so that a framework that sizes itself from NVML (vLLM's
 * gpu_memory_utilization, nvidia-smi-like monitors in the job) sees the
 * same figure as gmbctl shows for the tenant (docs/preload.md).
 *
 * Preloaded, the library defines both functions; a program that loads
 * NVML with dlopen and looks them up on its handle (pynvml, through
 * ctypes) gets them from the dlsym hook (getproc.c), which also
 * remembers NVML's own functions.  The device is told by its UUID
 * (NVML's nvmlDeviceGetUUID): its figures come from a session of this
 * process with the broker of that GPU (the shim's, or one made for it);
 * a GPU without a broker, or NVML without nvmlDeviceGetUUID, gets NVML's
 * own figures, untouched: NVML is a monitoring interface, and refusing
 * it would only hide the device.
 */
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "preload.h"

typedef int nvmlReturn_t;
typedef void *nvmlDevice_t;
typedef struct {
  unsigned long long total, free, used;
} nvmlMemory_t;
typedef struct {
  unsigned int version;
  unsigned long long total, reserved, free, used;
} nvmlMemory_v2_t;

/* nvml.h's nvmlMemory_v2: the struct's size and version 2. */
#define NV_MEMORY_V2 ((unsigned)sizeof(nvmlMemory_v2_t) | (2u << 24))

#define NVML_SUCCESS 0
#define NVML_ERROR_FUNCTION_NOT_FOUND 13

typedef nvmlReturn_t (*nv_info_fn)(nvmlDevice_t d, void *mem);
typedef nvmlReturn_t (*nv_uuid_fn)(nvmlDevice_t d, char *uuid,
                                   unsigned int len);

GMB_SHIM_API nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t d,
                                                  nvmlMemory_t *mem);
GMB_SHIM_API nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t d,
                                                     nvmlMemory_v2_t *mem);

/* Sessions made for NVML alone (a GPU whose broker the shim has not
 * connected to yet), by UUID; connected once each. */
#define NV_MAX 64
static pthread_mutex_t nv_mu = PTHREAD_MUTEX_INITIALIZER;
static struct {
  char uuid[96];
  gmb_client *c; /* NULL: no broker serves it */
} nv_sessions[NV_MAX];
static int nv_n;

/* The session for the GPU of this UUID, or NULL. */
static gmb_client *nv_session(const char *uuid) {
  if (gmb__shim_forked()) return NULL;
  if (gmb__shim_host()) return gmb__shim_session(0, NULL, NULL);
  gmb_client *all[GMB_SHIM_MAX_DEVICES];
  int n = gmb__shim_sessions(all, GMB_SHIM_MAX_DEVICES);
  for (int i = 0; i < n && i < GMB_SHIM_MAX_DEVICES; i++) {
    gmb_device_info di;
    if (gmb_device_get(all[i], &di) == 0 && strcmp(di.uuid, uuid) == 0)
      return all[i];
  }
  gmb_client *c = NULL;
  pthread_mutex_lock(&nv_mu);
  int i;
  for (i = 0; i < nv_n; i++)
    if (strcmp(nv_sessions[i].uuid, uuid) == 0) break;
  if (i < nv_n) {
    c = nv_sessions[i].c;
  } else if (nv_n < NV_MAX) {
    if (gmb_connect_gpu(uuid, NULL, &c) != 0) c = NULL;
    snprintf(nv_sessions[nv_n].uuid, sizeof nv_sessions[nv_n].uuid, "%s",
             uuid);
    nv_sessions[nv_n++].c = c;
  }
  pthread_mutex_unlock(&nv_mu);
  return c;
}

/* NVML's own figures, for gmb__pre_figures. */
struct nv_real {
  nvmlDevice_t d;
  nv_info_fn fn;
  int v2;
  nvmlMemory_v2_t got;
};

static int nv_real_figures(void *arg, uint64_t *freep, uint64_t *totalp) {
  struct nv_real *r = arg;
  if (r->v2) {
    r->got.version = NV_MEMORY_V2;
    int rc = r->fn(r->d, &r->got);
    if (rc) return rc;
  } else {
    nvmlMemory_t m;
    int rc = r->fn(r->d, &m);
    if (rc) return rc;
    r->got.total = m.total;
    r->got.free = m.free;
    r->got.used = m.used;
  }
  *freep = r->got.free;
  *totalp = r->got.total;
  return 0;
}

static nvmlReturn_t nv_info(const char *name, nvmlDevice_t d, int v2,
                            void *mem) {
  nv_info_fn real = (nv_info_fn)(uintptr_t)gmb__pre_named_real(name);
  if (real == NULL) return NVML_ERROR_FUNCTION_NOT_FOUND;
  /* What NVML itself refuses (no struct, a _v2 struct of another
   * version) it refuses with its own code. */
  if (mem == NULL ||
      (v2 && ((nvmlMemory_v2_t *)mem)->version != NV_MEMORY_V2))
    return real(d, mem);
  nv_uuid_fn uuid_of =
      (nv_uuid_fn)(uintptr_t)gmb__pre_sibling_real(name, "nvmlDeviceGetUUID");
  char uuid[96];
  gmb_client *c = NULL;
  if (uuid_of && uuid_of(d, uuid, sizeof uuid) == NVML_SUCCESS)
    c = nv_session(uuid);
  if (c == NULL) return real(d, mem);
  struct nv_real r = {d, real, v2, {0}};
  uint64_t fr = 0, tot = 0;
  int rc = gmb__pre_figures(c, nv_real_figures, &r, &fr, &tot);
  if (rc > 0) return rc; /* NVML's own failure */
  if (rc < 0) return real(d, mem); /* the broker did not answer */
  if (v2) {
    nvmlMemory_v2_t *m = mem;
    m->total = tot;
    m->free = fr;
    m->reserved = 0;
    m->used = tot - fr;
  } else {
    nvmlMemory_t *m = mem;
    m->total = tot;
    m->free = fr;
    m->used = tot - fr;
  }
  return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t d, nvmlMemory_t *mem) {
  return nv_info("nvmlDeviceGetMemoryInfo", d, 0, mem);
}

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t d,
                                        nvmlMemory_v2_t *mem) {
  return nv_info("nvmlDeviceGetMemoryInfo_v2", d, 1, mem);
}
