/*
 * vmm.c - the CUDA virtual memory calls under libgmb-preload.so:
 * cuMemCreate charged to the tenant at the broker, cuMemRelease given
 * back (docs/preload.md, "The VMM API").
 *
 * Programs that manage their own address space (PyTorch's expandable
 * segments, vLLM's sleep mode) make physical memory with cuMemCreate and
 * map it themselves.  The memory stays the driver's: gmb cannot hand them
 * a broker segment instead, because the program chooses the handle's
 * properties (its sharing types, compression, granularity) and may export,
 * retain or query it, which an imported handle does not answer as the
 * program expects.  What the broker does instead is count it: before the
 * driver makes the memory, this process reports its new total of VMM
 * bytes on that GPU (gmb_vmm_report, the protocol's Vmm request), and the
 * broker charges the difference to the tenant's quota (every process of
 * the tenant together, with its gmb allocations) and to the device's
 * room, or refuses it (after holding the report while other processes'
 * caches were asked to give back what they idle, when they could cover
 * it); a refusal is CUDA_ERROR_OUT_OF_MEMORY, after the session's own
 * cache gave its idle pages back and the report was tried again.  cuMemRelease reports the smaller total.  When the process dies
 * its session ends and the broker gives all of it back (the driver frees
 * a dead process's memory too).  gmbctl, other processes of the tenant
 * and every memory figure the shim reports see these bytes in the
 * tenant's `used`.
 *
 * Only memory on a device is counted (the property's location type
 * CU_MEM_LOCATION_TYPE_DEVICE): pinned host memory made through the VMM
 * API passes through.  The tenant is that of the broker of the GPU the
 * allocation is made on (the property's location id).
 *
 * Invariant (under vmm_mu): each session's `bytes` in vmm_sess is the sum
 * of the sizes of its records, and what the broker was last told for it;
 * a record is a handle cuMemCreate gave and cuMemRelease has not taken.
 * Records live in a tree by handle (a release is O(log n) among the tens
 * of thousands of 2 MiB handles a large expandable-segments process
 * holds); their number is the driver's own bound on live handles.  Every
 * other VMM call (cuMemMap, cuMemUnmap, cuMemAddressReserve,
 * cuMemSetAccess, ...) is the driver's, untouched.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>

#ifndef __unused /* libbsd's RB_GENERATE_STATIC uses it; Linux lacks it */
#define __unused __attribute__((__unused__))
#endif
#include <bsd/sys/tree.h>

#include "preload.h"

typedef CUresult (*vmm_create_fn)(CUmemGenericAllocationHandle *h,
                                  size_t size, const void *prop,
                                  unsigned long long flags);
typedef CUresult (*vmm_release_fn)(CUmemGenericAllocationHandle h);

#define VMM_LOCATION_DEVICE 1 /* CU_MEM_LOCATION_TYPE_DEVICE */
#define VMM_WHY_MAX 512       /* a refusal's reason, for the verbose line */

/* What the broker of one session was told this process holds. */
struct vmm_sess {
  gmb_client *c;
  uint64_t bytes;
};

struct vmm_rec {
  RB_ENTRY(vmm_rec) link;
  CUmemGenericAllocationHandle h;
  uint64_t size;
  struct vmm_sess *sess;
};

static int vmm_cmp(const struct vmm_rec *a, const struct vmm_rec *b) {
  return a->h < b->h ? -1 : a->h > b->h;
}

RB_HEAD(vmm_tree, vmm_rec);
RB_GENERATE_STATIC(vmm_tree, vmm_rec, link, vmm_cmp)

static pthread_mutex_t vmm_mu = PTHREAD_MUTEX_INITIALIZER;
static struct vmm_tree vmm_recs = RB_INITIALIZER(&vmm_recs);
static struct vmm_sess vmm_sess[GMB_SHIM_MAX_DEVICES];
static _Atomic uint64_t vmm_bytes; /* all sessions' */

uint64_t gmb__pre_vmm_bytes(void) { return atomic_load(&vmm_bytes); }

/* The entry of session c (under vmm_mu), made at its first use; NULL when
 * the table is full, which one entry per session of the shim (at most
 * GMB_SHIM_MAX_DEVICES) never is. */
static struct vmm_sess *vmm_sess_of(gmb_client *c) {
  for (size_t i = 0; i < GMB_SHIM_MAX_DEVICES; i++) {
    if (vmm_sess[i].c == c) return &vmm_sess[i];
    if (vmm_sess[i].c == NULL) {
      vmm_sess[i].c = c;
      return &vmm_sess[i];
    }
  }
  return NULL;
}

/* Tells the broker that s holds `bytes` (under vmm_mu): 0 with s->bytes
 * set, or the refusal with its reason in why.  A refusal for the quota or
 * the device is tried once more after the session's cache gave its free
 * pages back (which may be what the tenant's quota is short of). */
static int vmm_report(struct vmm_sess *s, uint64_t bytes, char *why,
                      size_t cap) {
  for (int attempt = 0;; attempt++) {
    int rc = gmb_vmm_report(s->c, bytes, NULL);
    if (rc == 0) {
      if (bytes > s->bytes)
        atomic_fetch_add(&vmm_bytes, bytes - s->bytes);
      else
        atomic_fetch_sub(&vmm_bytes, s->bytes - bytes);
      s->bytes = bytes;
      return 0;
    }
    if (attempt == 0 && (rc == GMB_E_QUOTA || rc == GMB_E_NOMEM) &&
        gmb__shim_trim_all(0) == 0)
      continue;
    snprintf(why, cap, "%s", gmb_last_error(s->c));
    return rc;
  }
}

/* Forgets a record (under vmm_mu) and tells the broker its session holds
 * that much less.  A failed report (the broker gone, the session ended)
 * changes nothing there that the session's end does not: the local figure
 * goes down anyway. */
static void vmm_forget(struct vmm_rec *r) {
  RB_REMOVE(vmm_tree, &vmm_recs, r);
  struct vmm_sess *s = r->sess;
  uint64_t left = s->bytes - r->size;
  char why[VMM_WHY_MAX];
  if (vmm_report(s, left, why, sizeof why) != 0) {
    atomic_fetch_sub(&vmm_bytes, r->size);
    s->bytes = left;
  }
  free(r);
}

CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                     const void *prop, unsigned long long flags) {
  vmm_create_fn real =
      (vmm_create_fn)(uintptr_t)gmb__pre_drv_real(PRE_DRV_MEM_CREATE);
  if (handle == NULL || prop == NULL || size == 0)
    return real ? real(handle, size, prop, flags) : PRE_CUDA_INVALID_VALUE;
  /* CUmemAllocationProp: {type, requestedHandleTypes, location {type,
   * id}, ...}; a device location names the GPU whose tenant counts it.
   * Memory elsewhere (pinned host memory) is not the GPU's: the driver's. */
  const int *p = prop;
  if (p[2] != VMM_LOCATION_DEVICE || p[3] < 0)
    return real ? real(handle, size, prop, flags) : PRE_CUDA_INVALID_VALUE;
  int pass, code;
  gmb_client *c =
      gmb__pre_session("cuMemCreate", p[3], real != NULL, &pass, &code);
  if (pass) return real(handle, size, prop, flags);
  if (c == NULL) return code;
  if (real == NULL) return PRE_CUDA_NOT_SUPPORTED; /* no driver to make it */
  char why[VMM_WHY_MAX] = "";
  CUresult r = PRE_CUDA_OUT_OF_MEMORY;
  struct vmm_rec *rec = calloc(1, sizeof *rec);
  pthread_mutex_lock(&vmm_mu);
  struct vmm_sess *s = vmm_sess_of(c);
  int rc = GMB_E_SYSTEM;
  if (rec == NULL || s == NULL)
    snprintf(why, sizeof why, "out of host memory for its record");
  else if (size > UINT64_MAX - s->bytes)
    snprintf(why, sizeof why, "size too large");
  else
    rc = vmm_report(s, s->bytes + size, why, sizeof why);
  if (rc == 0) {
    r = real(handle, size, prop, flags);
    if (r != 0) {
      /* The driver refused: the charge goes back. */
      if (vmm_report(s, s->bytes - size, why, sizeof why) != 0) {
        atomic_fetch_sub(&vmm_bytes, size);
        s->bytes -= size;
      }
    } else {
      rec->h = *handle;
      rec->size = size;
      rec->sess = s;
      /* A handle the driver gave again: its old record was released
       * behind the shim's back (a pointer to the driver's own function). */
      struct vmm_rec *old = RB_INSERT(vmm_tree, &vmm_recs, rec);
      if (old) {
        vmm_forget(old);
        RB_INSERT(vmm_tree, &vmm_recs, rec);
      }
      rec = NULL;
    }
  }
  pthread_mutex_unlock(&vmm_mu);
  free(rec);
  if (rc && gmb__shim_env_flag("GMB_PRELOAD_VERBOSE"))
    fprintf(stderr, "gmb-preload: cuMemCreate(%zu) refused: %s\n", size, why);
  return r;
}

CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
  vmm_release_fn real =
      (vmm_release_fn)(uintptr_t)gmb__pre_drv_real(PRE_DRV_MEM_RELEASE);
  if (real == NULL) return PRE_CUDA_INVALID_VALUE;
  CUresult r = real(handle);
  /* In a fork() child the records are the parent's, and so is the session
   * (its ZeroMQ context must not be used here): nothing to report. */
  if (r != 0 || gmb__shim_forked()) return r;
  pthread_mutex_lock(&vmm_mu);
  struct vmm_rec key = {.h = handle};
  struct vmm_rec *rec = RB_FIND(vmm_tree, &vmm_recs, &key);
  if (rec) vmm_forget(rec);
  pthread_mutex_unlock(&vmm_mu);
  return r;
}
