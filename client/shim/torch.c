/*
 * torch.c - libgmb-torch.so, the allocator functions PyTorch's
 * torch.cuda.memory.CUDAPluggableAllocator calls (client/python/gmb_torch.py
 * installs them; docs/pytorch.md is the user's page).
 *
 * PyTorch hands every device allocation of the process to gmb_torch_alloc
 * and gives it back with gmb_torch_free, passing the same size, device and
 * stream.  Allocations come from the session of the device PyTorch names
 * (shim.c: one per device, each with the broker of that GPU) and go
 * through that session's stream-ordered cache (gmb_malloc_async /
 * gmb_free_async on PyTorch's stream), as PyTorch's own caching allocator
 * would serve them: a tensor made and dropped in a steady loop sends no
 * message and the free never waits for the GPU (the block is reusable at
 * once on its stream, on others once an event recorded at the free
 * completed).  Blocks are pinned (a tensor holds a raw pointer).
 * gmb_torch_empty_cache (gmb_torch.empty_cache()) gives every session's
 * free cached slabs back to its broker, as torch.cuda.empty_cache() does.
 *
 * The contract, read from PyTorch's torch/csrc/cuda/CUDAPluggableAllocator.cpp
 * (the 2.x sources): malloc calls alloc_fn_ and stores whatever it returns
 * in its metadata map, building the tensor's DataPtr from it, without a
 * check for NULL; the call is made through a std::function from C++,
 * before any lock is taken.  So a refusal must not return NULL (the tensor
 * would get address 0 and the first kernel kill the context): the entry
 * point PyTorch calls, gmb_torch_alloc, is C++ (torch_throw.cc) and throws
 * std::runtime_error, which PyTorch's Python bindings turn into a
 * RuntimeError naming the reason.  This file is its C core,
 * gmb_torch_alloc_nothrow, which returns NULL with the reason kept for
 * gmb_torch_last_error() (C callers and tests use it).  Size 0 returns
 * NULL without an error, as PyTorch's own caching allocator does, and a
 * NULL DataPtr is never passed to free.  free may come on any thread.
 *
 * Devices: `device` is PyTorch's index, the process's CUDA ordinal; its
 * allocation goes to the broker of that GPU, found by the GPU's UUID
 * (gmb_connect_gpu), and a device without a broker is refused with the
 * reason.  A free goes to the session the pointer came from.
 *
 * Free: never waits.  During a CUDA graph capture on the allocation's
 * stream the graph may use the memory at every replay, for as long as it
 * lives, which the allocator cannot see: such memory is kept, never handed
 * back to the cache, until the process ends (gmb_torch_kept() counts it).
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/types.h>

#include "gmb.h"
#include "shim.h"

GMB_SHIM_API void *gmb_torch_alloc_nothrow(ssize_t size, int device,
                                           void *stream);
GMB_SHIM_API unsigned long long gmb_torch_kept(void);
GMB_SHIM_API void gmb_torch_free(void *ptr, ssize_t size, int device,
                                 void *stream);
GMB_SHIM_API const char *gmb_torch_last_error(void);
GMB_SHIM_API int gmb_torch_empty_cache(void);

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

static void torch_fail2(const char *fmt, long long a, const char *b,
                        const char *why) {
  pthread_mutex_lock(&torch_err_mu);
  snprintf(torch_err, sizeof torch_err, fmt, a, b, why);
  if (gmb__shim_env_flag("GMB_TORCH_VERBOSE"))
    fprintf(stderr, "gmb-torch: %s\n", torch_err);
  pthread_mutex_unlock(&torch_err_mu);
}

static _Atomic unsigned long long torch_kept;

unsigned long long gmb_torch_kept(void) { return torch_kept; }

void *gmb_torch_alloc_nothrow(ssize_t size, int device, void *stream) {
  if (size <= 0) return NULL;
  const char *why = NULL;
  int dev = device;
  gmb_client *c = gmb__shim_session(device < 0 ? -1 : device, &dev, &why);
  if (c == NULL) {
    char b[48];
    snprintf(b, sizeof b, "cuda:%d", dev);
    torch_fail2("gmb_torch_alloc(%lld): no broker for %s: %s",
                (long long)size, b, why);
    return NULL;
  }
  void *p = NULL;
  int rc = gmb__shim_malloc_async(c, (size_t)size, stream, &p);
  if (rc) {
    torch_fail("gmb_torch_alloc(%lld): %s", (long long)size,
               gmb_last_error(c));
    return NULL;
  }
  return p;
}

void gmb_torch_free(void *ptr, ssize_t size, int device, void *stream) {
  (void)device; /* the pointer knows its session */
  if (ptr == NULL) return;
  if (gmb__shim_forked()) {
    torch_fail("gmb_torch_free(%lld): %s", (long long)size,
               "GMB_E_CONN: a fork() child may not use its parent's session");
    return;
  }
  gmb_client *c = gmb__shim_owner(ptr);
  if (c == NULL) {
    torch_fail("gmb_torch_free(%lld): not a pointer gmb_torch_alloc gave, "
               "or one freed already (%s)", (long long)size, "ignored");
    return;
  }
  /* During a graph capture: keep the memory (see the top). */
  if (!gmb__shim_host() && gmb_stream_capturing(c, stream) == 1 &&
      gmb__shim_keep(ptr) == 0) {
    torch_kept += (unsigned long long)(size > 0 ? size : 0);
    torch_fail("gmb_torch_free(%lld): %s", (long long)size,
               "freed during a CUDA graph capture: kept until the process "
               "ends, since the graph may use it at every replay");
    return;
  }
  /* Reusable at once on `stream`; on others after its work ran.  A
   * failure frees nothing. */
  int rc = gmb__shim_free_async(ptr, stream);
  if (rc == GMB_E_NOENT)
    torch_fail("gmb_torch_free(%lld): not a pointer gmb_torch_alloc gave, "
               "or one freed already (%s)", (long long)size, "ignored");
  else if (rc == GMB_E_INVAL)
    torch_fail("gmb_torch_free(%lld): %s", (long long)size,
               gmb_last_error(c));
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

/* torch.cuda.empty_cache(): every session's wholly free cached slabs go
 * back to its broker (each device's).  0, or the first GMB_E_* code. */
int gmb_torch_empty_cache(void) { return gmb__shim_trim_all(0); }
