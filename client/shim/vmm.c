/*
 * vmm.c - the CUDA virtual memory calls under libgmb-preload.so:
 * cuMemCreate counted and limited, cuMemRelease counted back
 * (docs/preload.md, "The VMM API").
 *
 * Programs that manage their own address space (PyTorch's expandable
 * segments, vLLM's sleep mode) make physical memory with cuMemCreate and
 * map it themselves.  gmb cannot hand them the broker's memory for that
 * (a broker allocation is a range of a segment, and the driver maps a
 * handle only whole), so the memory stays the driver's, and this file
 * holds it to the tenant's quota: a cuMemCreate that would take the
 * tenant's bytes at the broker plus this process's live cuMemCreate bytes
 * past the quota is refused with CUDA_ERROR_OUT_OF_MEMORY (after the
 * session's cache gave its idle pages back, as an allocation would), and
 * the bytes are subtracted from the free figure every interface reports
 * (preload.c, gmb__pre_figures).  The broker does not see them: another
 * process of the tenant, or gmbctl, does not count them (the limit is per
 * process on top of the tenant's broker memory).
 *
 * The tenant is that of the broker of the GPU the allocation is made on
 * (the property's location), else of the calling thread's current device.
 *
 * Invariant (under vmm_mu): vmm_bytes is the sum of the records' sizes;
 * a record is a handle cuMemCreate gave and cuMemRelease has not taken.
 * Every other VMM call (cuMemMap, cuMemUnmap, cuMemAddressReserve,
 * cuMemSetAccess, ...) is the driver's, untouched.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>

#include "preload.h"

typedef CUresult (*vmm_create_fn)(CUmemGenericAllocationHandle *h,
                                  size_t size, const void *prop,
                                  unsigned long long flags);
typedef CUresult (*vmm_release_fn)(CUmemGenericAllocationHandle h);

#define VMM_LOCATION_DEVICE 1 /* CU_MEM_LOCATION_TYPE_DEVICE */

struct vmm_rec {
  CUmemGenericAllocationHandle h;
  uint64_t size;
};

static pthread_mutex_t vmm_mu = PTHREAD_MUTEX_INITIALIZER;
static struct vmm_rec *vmm_recs;
static size_t vmm_n, vmm_cap;
static _Atomic uint64_t vmm_bytes;

uint64_t gmb__pre_vmm_bytes(void) { return atomic_load(&vmm_bytes); }

/* Remembers h (under vmm_mu): 0, or -1 when out of host memory. */
static int vmm_add(CUmemGenericAllocationHandle h, uint64_t size) {
  if (vmm_n == vmm_cap) {
    size_t ncap = vmm_cap ? vmm_cap * 2 : 64;
    struct vmm_rec *n = realloc(vmm_recs, ncap * sizeof *n);
    if (n == NULL) return -1;
    vmm_recs = n;
    vmm_cap = ncap;
  }
  vmm_recs[vmm_n++] = (struct vmm_rec){h, size};
  atomic_fetch_add(&vmm_bytes, size);
  return 0;
}

/* Whether cuMemCreate of size bytes fits the tenant's quota (under
 * vmm_mu): 0, or the reason in why. */
static int vmm_fits(gmb_client *c, uint64_t size, char *why, size_t cap) {
  for (int attempt = 0;; attempt++) {
    gmb_stats st;
    int rc = gmb_tenant_stats(c, &st);
    if (rc) {
      snprintf(why, cap, "%s", gmb_last_error(c));
      return rc;
    }
    uint64_t mine = atomic_load(&vmm_bytes);
    if (st.quota == 0 || (st.used <= st.quota && mine <= st.quota - st.used &&
                          size <= st.quota - st.used - mine))
      return 0;
    /* The session's cache may hold idle pages of the quota: they go back
     * first, as before an allocation's refusal. */
    if (attempt == 0 && gmb__shim_trim_all(0) == 0) continue;
    snprintf(why, cap, "GMB_E_QUOTA: the tenant's quota of %llu bytes "
             "would be passed: %llu held at the broker, %llu through "
             "cuMemCreate in this process", (unsigned long long)st.quota,
             (unsigned long long)st.used, (unsigned long long)mine);
    return GMB_E_QUOTA;
  }
}

CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                     const void *prop, unsigned long long flags) {
  vmm_create_fn real =
      (vmm_create_fn)(uintptr_t)gmb__pre_drv_real(PRE_DRV_MEM_CREATE);
  if (handle == NULL || prop == NULL || size == 0)
    return real ? real(handle, size, prop, flags) : PRE_CUDA_INVALID_VALUE;
  /* CUmemAllocationProp: {type, requestedHandleTypes, location {type,
   * id}, ...}; a device location names the GPU whose tenant counts it. */
  const int *p = prop;
  int device = p[2] == VMM_LOCATION_DEVICE && p[3] >= 0 ? p[3] : -1;
  int pass, code;
  gmb_client *c =
      gmb__pre_session("cuMemCreate", device, real != NULL, &pass, &code);
  if (pass) return real(handle, size, prop, flags);
  if (c == NULL) return code;
  if (real == NULL) return PRE_CUDA_NOT_SUPPORTED; /* no driver to make it */
  char why[256];
  pthread_mutex_lock(&vmm_mu);
  int rc = vmm_fits(c, size, why, sizeof why);
  CUresult r = PRE_CUDA_OUT_OF_MEMORY;
  if (rc == 0) {
    r = real(handle, size, prop, flags);
    if (r == 0 && vmm_add(*handle, size) != 0) {
      vmm_release_fn rel =
          (vmm_release_fn)(uintptr_t)gmb__pre_drv_real(PRE_DRV_MEM_RELEASE);
      if (rel) rel(*handle);
      snprintf(why, sizeof why, "out of host memory for its record");
      r = PRE_CUDA_OUT_OF_MEMORY;
      rc = GMB_E_SYSTEM;
    }
  }
  pthread_mutex_unlock(&vmm_mu);
  if (rc && gmb__shim_env_flag("GMB_PRELOAD_VERBOSE"))
    fprintf(stderr, "gmb-preload: cuMemCreate(%zu) refused: %s\n", size, why);
  return r;
}

CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
  vmm_release_fn real =
      (vmm_release_fn)(uintptr_t)gmb__pre_drv_real(PRE_DRV_MEM_RELEASE);
  if (real == NULL) return PRE_CUDA_INVALID_VALUE;
  CUresult r = real(handle);
  if (r != 0) return r;
  pthread_mutex_lock(&vmm_mu);
  for (size_t i = 0; i < vmm_n; i++)
    if (vmm_recs[i].h == handle) {
      atomic_fetch_sub(&vmm_bytes, vmm_recs[i].size);
      vmm_recs[i] = vmm_recs[--vmm_n];
      break;
    }
  pthread_mutex_unlock(&vmm_mu);
  return r;
}
