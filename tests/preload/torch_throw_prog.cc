/*
 * torch_throw_prog.cc - calls libgmb-torch.so's gmb_torch_alloc the way
 * PyTorch's CUDAPluggableAllocator does (dlopen by path, a C++ caller),
 * and catches what it throws as PyTorch's Python bindings do
 * (torch/csrc/Exceptions.h, CATCH_TH_ERRORS): a torch::PyTorchError
 * becomes an exception of the Python type its python_type() names, any
 * other std::exception a RuntimeError.  torch::PyTorchError is declared
 * here as PyTorch declares it, in this program (another DSO than the
 * library's, as libtorch_python is), so the catch matches by name as it
 * would in PyTorch.
 *
 *   torch_throw_prog LIB SIZE WANT [oom-type]
 *
 * With oom-type, a stand-in for the class object torch.OutOfMemoryError
 * is registered first (gmb_torch_set_oom_type, as gmb_torch.enable()
 * does).  Prints "returned P", "python_error TYPE: WHAT" (TYPE "oom" when
 * python_type() is the registered object) or "threw: WHAT" (RuntimeError).
 * Exit 0 when it threw and what() contains WANT; 1 when it returned a
 * pointer or threw otherwise; 2 usage or no library.
 */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>

#include <exception>
#include <string>

typedef struct _object PyObject;

namespace torch {
struct PyTorchError : public std::exception {
  PyTorchError() = default;
  explicit PyTorchError(std::string m) : msg(std::move(m)) {}
  virtual PyObject *python_type() = 0;
  const char *what() const noexcept override { return msg.c_str(); }
  std::string msg;
};
} // namespace torch

typedef void *(*alloc_fn)(ssize_t, int, void *);
typedef void (*set_type_fn)(void *);

static char oom_class; /* stands for torch.OutOfMemoryError */

int main(int argc, char **argv) {
  if (argc != 4 && argc != 5) return 2;
  void *h = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    fprintf(stderr, "dlopen: %s\n", dlerror());
    return 2;
  }
  alloc_fn f = reinterpret_cast<alloc_fn>(dlsym(h, "gmb_torch_alloc"));
  set_type_fn set =
      reinterpret_cast<set_type_fn>(dlsym(h, "gmb_torch_set_oom_type"));
  if (!f || !set) return 2;
  if (argc == 5) set(&oom_class);
  try {
    void *p = f(strtoll(argv[2], nullptr, 10), 0, nullptr);
    printf("returned %p\n", p);
    return 1;
  } catch (torch::PyTorchError &e) {
    PyObject *t = e.python_type();
    printf("python_error %s: %s\n",
           (void *)t == (void *)&oom_class ? "oom" : "other", e.what());
    return strstr(e.what(), argv[3]) ? 0 : 1;
  } catch (const std::exception &e) {
    printf("threw: %s\n", e.what());
    return strstr(e.what(), argv[3]) ? 0 : 1;
  }
}
