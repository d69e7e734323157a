/*
 * torch_throw.cc - the allocation entry point PyTorch calls,
 * gmb_torch_alloc, as C++: it throws where the C core
 * (gmb_torch_alloc_nothrow, torch.c) returns NULL for a refusal.
 *
 * Why C++: CUDAPluggableAllocator::malloc stores what the allocation
 * function returns without checking it for NULL, so a NULL would become a
 * tensor at address 0.  The function is called through a std::function
 * from C++ code, before any lock is taken; an exception thrown here
 * unwinds into PyTorch, whose Python bindings (torch/csrc/Exceptions.h,
 * CATCH_TH_ERRORS and the pybind11 translator built on it) turn it into a
 * Python exception.
 *
 * Which one: PyTorch's own OOM, c10::OutOfMemoryError, becomes
 * torch.OutOfMemoryError, but it is a c10::Error whose layout (backtrace,
 * context, caller) changes between releases and whose constructor lives in
 * libc10: a library that does not link libtorch cannot make one safely.
 * The bindings also catch torch::PyTorchError, an abstract std::exception
 * with one virtual function more, python_type(), and raise
 * PyErr_SetString(e.python_type(), e.what()): the base PyTorch keeps for
 * exceptions that name their Python type.  Its vtable (what, then
 * python_type) and its name have been the same since PyTorch 1.0, and a
 * catch matches a class of another library by its mangled name (libstdc++
 * compares type_info names), so gmb throws a subclass of its own
 * declaration of it (gmb::TorchOutOfMemory) whose python_type() is the
 * class gmb_torch.enable() registered with gmb_torch_set_oom_type:
 * torch.OutOfMemoryError.  Python code then catches it as
 * torch.OutOfMemoryError (a RuntimeError, as before).  Before a type is
 * registered (C callers, tests, a PyTorch older than torch.OutOfMemoryError)
 * it is a std::runtime_error, a RuntimeError in Python.  Either way the
 * message begins as PyTorch's own ("CUDA out of memory. Tried to allocate
 * 2.00 MiB on GPU 0.", which is what users and libraries match on), then
 * "gmb: " with the code (GMB_E_QUOTA, GMB_E_NOMEM, ...) and the broker's
 * reason.
 *
 * Only C++ callers that catch may call it: a C caller must use
 * gmb_torch_alloc_nothrow.
 */
#include <atomic>
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
__attribute__((visibility("default"))) void gmb_torch_set_oom_type(void *type);
}

typedef struct _object PyObject; /* Python's, by name only: never touched */

/* PyTorch's declaration (torch/csrc/Exceptions.h), member for member in
 * the order that fixes its vtable; gmb never makes one of its own but
 * through the subclass below. */
namespace torch {
struct PyTorchError : public std::exception {
  PyTorchError() = default;
  explicit PyTorchError(std::string m) : msg(std::move(m)) {}
  virtual PyObject *python_type() = 0;
  const char *what() const noexcept override { return msg.c_str(); }
  std::string msg;
};
} // namespace torch

/* The Python class to raise, as gmb_torch.enable() registered it (a
 * borrowed reference: gmb_torch keeps the class alive, as torch does). */
static std::atomic<PyObject *> torch_oom_type{nullptr};

namespace gmb {
struct TorchOutOfMemory : public torch::PyTorchError {
  TorchOutOfMemory(std::string m, PyObject *t)
      : torch::PyTorchError(std::move(m)), type(t) {}
  PyObject *python_type() override { return type; }
  PyObject *type;
};
} // namespace gmb

void gmb_torch_set_oom_type(void *type) {
  torch_oom_type.store(static_cast<PyObject *>(type));
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
  if (p != nullptr || size <= 0) return p;
  std::string msg = "CUDA out of memory. Tried to allocate " +
                    torch_size(size) + " on GPU " + std::to_string(device) +
                    ". gmb: " + gmb_torch_last_error();
  PyObject *type = torch_oom_type.load();
  if (type != nullptr) throw gmb::TorchOutOfMemory(std::move(msg), type);
  throw std::runtime_error(msg);
}
