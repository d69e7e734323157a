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
 * and ABI); the message starts with "gmb: out of memory" and names the
 * code (GMB_E_QUOTA, GMB_E_NOMEM, ...) and the broker's reason.
 *
 * Only C++ callers that catch may call it: a C caller must use
 * gmb_torch_alloc_nothrow.
 */
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

void *gmb_torch_alloc(ssize_t size, int device, void *stream) {
  void *p = gmb_torch_alloc_nothrow(size, device, stream);
  if (p == nullptr && size > 0)
    throw std::runtime_error(std::string("gmb: out of memory: ") +
                             gmb_torch_last_error());
  return p;
}
