/*
 * gpu.c - hosts with several GPUs: finding the broker of one GPU
 * (gmb_connect_gpu) and the calling thread's current device
 * (gmb_gpu_current).
 *
 * One broker serves one GPU, and a host with N GPUs runs N brokers.  A
 * broker started with --run-dir-per-gpu makes its sockets in RUN_DIR/UUID
 * (RUN_DIR/GPU-xxxxxxxx-.../broker.sock), so a client finds the broker of
 * a GPU by the GPU's UUID, whatever ordinal either process gives it
 * (CUDA_VISIBLE_DEVICES and containers renumber GPUs; UUIDs never change).
 * A host with one GPU may keep its broker in the run dir itself: the
 * default endpoint is taken when the broker there names the GPU asked for
 * in its Hello reply, and refused when it names another.
 *
 * Only public calls of the library are used here (gmb_connect,
 * gmb_device_get), plus the driver look-ups of cuimport.c.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client.h"
#include "cuimport.h"
#include "endpoint.h"
#include "gmb.h"
#include "util.h"

#define GPU_EP_MAX 512

/* The UUID `gpu` names: itself, or that of ordinal N ("cuda:N", "N"), or
 * of the current device (NULL).  *ordinal: the ordinal when one was
 * given or found, else -1.  0 or the failure, explained. */
static int gpu_resolve(const char *gpu, char *uuid, size_t ucap,
                       int *ordinal) {
  char why[256];
  *ordinal = -1;
  if (gpu && gmb__gpu_uuid_valid(gpu)) {
    snprintf(uuid, ucap, "%s", gpu);
    return 0;
  }
  int o = -1;
  if (gpu == NULL) {
    int rc = gmb__cuda_current(&o, why, sizeof why);
    if (rc) return gmb__client_fail(rc, "the current CUDA device: %s", why);
  } else {
    const char *num = strncmp(gpu, "cuda:", 5) == 0 ? gpu + 5 : gpu;
    char *end;
    long v = strtol(num, &end, 10);
    if (*num == '\0' || *end != '\0' || v < 0 || v >= GMB_CUDA_MAX_DEVICES)
      return gmb__client_fail(GMB_E_INVAL, "\"%.80s\" names no GPU: want its "
                              "UUID (GPU-...), cuda:N or N", gpu);
    o = (int)v;
  }
  int rc = gmb__cuda_uuid_of(o, uuid, ucap, why, sizeof why);
  if (rc) return gmb__client_fail(rc, "cuda:%d: %s", o, why);
  *ordinal = o;
  return 0;
}

/* gmb_connect to `endpoint`, kept only when its broker serves `uuid`.
 * *served: the GPU it serves ("host" for the host device), when it
 * answered. */
static int gpu_try(const char *endpoint, const char *tenant, const char *uuid,
                   char *served, size_t scap, gmb_client **out) {
  gmb_client *c = NULL;
  served[0] = '\0';
  int rc = gmb_connect(endpoint, tenant, &c);
  if (rc) return rc;
  gmb_device_info di;
  rc = gmb_device_get(c, &di);
  if (rc == 0)
    snprintf(served, scap, "%s", strcmp(di.kind, "cuda") == 0 ? di.uuid
                                                             : di.kind);
  if (rc == 0 && strcmp(di.kind, "cuda") == 0 && strcmp(di.uuid, uuid) == 0) {
    *out = c;
    return 0;
  }
  gmb_disconnect(c);
  return 1;
}

GMB_EXPORT int gmb_connect_gpu(const char *gpu, const char *tenant,
                               gmb_client **out) {
  if (out == NULL) return gmb__client_fail(GMB_E_INVAL, "out is NULL");
  *out = NULL;
  char uuid[64], name[96];
  int ordinal;
  int rc = gpu_resolve(gpu, uuid, sizeof uuid, &ordinal);
  if (rc) return rc;
  if (ordinal >= 0)
    snprintf(name, sizeof name, "%s (cuda:%d here)", uuid, ordinal);
  else
    snprintf(name, sizeof name, "%s", uuid);

  /* Its own run dir first: RUN_DIR/UUID. */
  char dir[GPU_EP_MAX - 32], ep[GPU_EP_MAX], why[GPU_EP_MAX + 128];
  char served[64];
  if (gmb__run_dir_gpu(NULL, uuid, dir, sizeof dir) == NULL ||
      gmb__endpoint_default(dir, "broker.sock", ep, sizeof ep) == NULL)
    return gmb__client_fail(GMB_E_INVAL, "the run directory's name is too "
                            "long");
  if (gmb__endpoint_probe(ep, NULL, why, sizeof why) == 0) {
    rc = gpu_try(ep, tenant, uuid, served, sizeof served, out);
    if (rc != 1) return rc;
    return gmb__client_fail(GMB_E_DEVICE, "the broker at %s serves %s, not "
                            "GPU %s", ep, served, name);
  }

  /* Else the default broker, if it serves that GPU. */
  char def[GPU_EP_MAX];
  const char *env = getenv("GMB_ENDPOINT");
  if (env && *env) {
    snprintf(def, sizeof def, "%s", env);
  } else if (gmb__endpoint_default(NULL, "broker.sock", def, sizeof def) ==
             NULL) {
    return gmb__client_fail(GMB_E_INVAL, "the run directory's name is too "
                            "long");
  }
  char why2[GPU_EP_MAX + 128];
  if (gmb__endpoint_probe(def, NULL, why2, sizeof why2) != 0)
    return gmb__client_fail(GMB_E_CONN, "no broker for GPU %s: none at %s "
                            "nor at %s (is a gmb-broker --device cuda:N "
                            "--run-dir-per-gpu running for it?)", name, ep,
                            def);
  rc = gpu_try(def, tenant, uuid, served, sizeof served, out);
  if (rc == 0) return 0;
  if (rc == 1)
    return gmb__client_fail(GMB_E_CONN, "no broker for GPU %s: none at %s, "
                            "and the broker at %s serves %s", name, ep, def,
                            served);
  if (rc == GMB_E_DEVICE) {
    /* The default broker's GPU is not one this process can use: so it is
     * not the GPU asked for either. */
    char prev[384];
    snprintf(prev, sizeof prev, "%s", gmb_last_error(NULL));
    return gmb__client_fail(GMB_E_CONN, "no broker for GPU %s: none at %s, "
                            "and the broker at %s is not it (%s)", name, ep,
                            def, prev);
  }
  return rc;
}

GMB_EXPORT int gmb_gpu_current(int *ordinal) {
  if (ordinal == NULL) return gmb__client_fail(GMB_E_INVAL, "ordinal is NULL");
  char why[256];
  int rc = gmb__cuda_current(ordinal, why, sizeof why);
  return rc ? gmb__client_fail(rc, "%s", why) : 0;
}
