/*
 * torch.c - libgmb-torch.so, the allocator functions PyTorch's
 * torch.cuda.memory.CUDAPluggableAllocator calls (client/python/gmb_torch.py
 * installs them; docs/pytorch.md is the user's page).
 *
 * PyTorch hands every device allocation of the process to gmb_torch_alloc
 * and gives it back with gmb_torch_free, passing the same size, device and
 * stream.  Allocations are pinned (a tensor holds a raw pointer) and come
 * from one process-wide session (shim.c).
 *
 * The contract, read from PyTorch's CUDAPluggableAllocator.cpp: malloc
 * stores whatever alloc returns in its metadata map and builds the tensor's
 * DataPtr from it; it does not check for NULL.  So an allocation that the
 * broker refuses returns NULL, with the reason kept for
 * gmb_torch_last_error() (and printed when GMB_TORCH_VERBOSE=1); size 0
 * returns NULL too, as PyTorch's own caching allocator does, and a NULL
 * DataPtr is never passed to free.  free may come on any thread.
 */
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/types.h>

#include "gmb.h"
#include "shim.h"

GMB_SHIM_API void *gmb_torch_alloc(ssize_t size, int device, void *stream);
GMB_SHIM_API void gmb_torch_free(void *ptr, ssize_t size, int device,
                                 void *stream);
GMB_SHIM_API const char *gmb_torch_last_error(void);

/* The last failure of the process (not the thread: PyTorch reports an OOM
 * on whichever thread asks, often not the allocating one). */
static pthread_mutex_t torch_err_mu = PTHREAD_MUTEX_INITIALIZER;
static char torch_err[1024] = "no error";
static char torch_err_copy[1024]; /* what gmb_torch_last_error returned */

static void torch_fail(const char *fmt1, long long a, const char *why) {
  pthread_mutex_lock(&torch_err_mu);
  snprintf(torch_err, sizeof torch_err, fmt1, a, why);
  if (gmb__shim_env_flag("GMB_TORCH_VERBOSE"))
    fprintf(stderr, "gmb-torch: %s\n", torch_err);
  pthread_mutex_unlock(&torch_err_mu);
}

void *gmb_torch_alloc(ssize_t size, int device, void *stream) {
  (void)device; /* the broker serves one device: the session's */
  (void)stream; /* pinned memory is usable on every stream */
  if (size <= 0) return NULL;
  const char *why = NULL;
  gmb_client *c = gmb__shim_client(&why);
  if (c == NULL) {
    torch_fail("gmb_torch_alloc(%lld): no broker: %s", (long long)size, why);
    return NULL;
  }
  void *p = NULL;
  int rc = gmb__shim_alloc(c, (size_t)size, &p);
  if (rc) {
    torch_fail("gmb_torch_alloc(%lld): %s", (long long)size,
               gmb_last_error(c));
    return NULL;
  }
  return p;
}

void gmb_torch_free(void *ptr, ssize_t size, int device, void *stream) {
  (void)device;
  if (ptr == NULL) return;
  const char *why = NULL;
  gmb_client *c = gmb__shim_client(&why);
  if (c == NULL) {
    torch_fail("gmb_torch_free(%lld): %s", (long long)size, why);
    return;
  }
  /* Kernels queued on the allocation's stream may still use it: wait for
   * them before another tensor can be given the same bytes. */
  gmb__shim_sync(stream);
  int rc = gmb__shim_free(c, ptr);
  if (rc == GMB_E_NOENT)
    torch_fail("gmb_torch_free(%lld): not a pointer gmb_torch_alloc gave "
               "(%s)", (long long)size, "ignored");
  else if (rc && rc != GMB_E_CONN && rc != GMB_E_EVICTED)
    torch_fail("gmb_torch_free(%lld): %s", (long long)size, gmb_last_error(c));
}

const char *gmb_torch_last_error(void) {
  /* A copy, so a caller reading it never sees a half-written message; it
   * stays valid until the next call. */
  pthread_mutex_lock(&torch_err_mu);
  memcpy(torch_err_copy, torch_err, sizeof torch_err_copy);
  pthread_mutex_unlock(&torch_err_mu);
  return torch_err_copy;
}
