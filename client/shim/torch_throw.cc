/*
 * torch_throw.cc - the allocation entry point PyTorch calls,
 * gmb_torch_alloc, as C++: it throws where the C core
 * (gmb_torch_alloc_nothrow, torch.c) returns NULL for a refusal.
 *
 * Why C++: CUDAPluggableAllocator::malloc stores what the allocation
 * function returns without checking it for NULL, so a NULL would become a
 * tensor at address 0.  The function is called through a std::function
 * from C++ code, before any lock is taken; an exception thrown here
 * unwinds into PyTorch, whose Python bindings turn a std::exception into a
 * RuntimeError carrying what().  std::runtime_error is used because the
 * library does not link against libtorch (c10::OutOfMemoryError, which
 * would give torch.OutOfMemoryError, is not reachable without its headers
 * and ABI); the message begins as PyTorch's own ("CUDA out of memory.
 * Tried to allocate 2.00 MiB on GPU 0.", which is what users match on),
 * then "gmb: " with the code (GMB_E_QUOTA, GMB_E_NOMEM, ...) and the
 * broker's reason.
 *
 * Only C++ callers that catch may call it: a C caller must use
 * gmb_torch_alloc_nothrow.
 */
#include <cstdio>
#include <stdexcept>
#include <string>
#include <sys/types.h>

extern "C" {
void *gmb_torch_alloc_nothrow(ssize_t size, int device, void *stream);
const char *gmb_torch_last_error(void);
__attribute__((visibility("default"))) void *gmb_torch_alloc(ssize_t size,
                                                             int device,
                                                             void *stream);
}

/* A size as PyTorch's messages print it (c10's format_size). */
static std::string torch_size(ssize_t size) {
  char b[64];
  double v = (double)size;
  if (v <= 1048576.0)
    snprintf(b, sizeof b, "%.2f KiB", v / 1024.0);
  else if (v <= 1073741824.0)
    snprintf(b, sizeof b, "%.2f MiB", v / 1048576.0);
  else
    snprintf(b, sizeof b, "%.2f GiB", v / 1073741824.0);
  return b;
}

void *gmb_torch_alloc(ssize_t size, int device, void *stream) {
  void *p = gmb_torch_alloc_nothrow(size, device, stream);
  if (p == nullptr && size > 0)
    throw std::runtime_error("CUDA out of memory. Tried to allocate " +
                             torch_size(size) + " on GPU " +
                             std::to_string(device) + ". gmb: " +
                             gmb_torch_last_error());
  return p;
}
