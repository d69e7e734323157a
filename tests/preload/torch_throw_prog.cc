/*
 * torch_throw_prog.cc - calls libgmb-torch.so's gmb_torch_alloc the way
 * PyTorch's CUDAPluggableAllocator does (dlopen by path, a C++ caller),
 * and catches what it throws, as PyTorch's Python bindings would turn it
 * into a RuntimeError.
 *
 *   torch_throw_prog LIB SIZE WANT
 *
 * Exit 0 when the allocation of SIZE bytes threw a std::exception whose
 * what() contains WANT; 1 when it returned a pointer or threw otherwise;
 * 2 usage or no library.
 */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>

#include <exception>

typedef void *(*alloc_fn)(ssize_t, int, void *);

int main(int argc, char **argv) {
  if (argc != 4) return 2;
  void *h = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    fprintf(stderr, "dlopen: %s\n", dlerror());
    return 2;
  }
  alloc_fn f = reinterpret_cast<alloc_fn>(dlsym(h, "gmb_torch_alloc"));
  if (!f) return 2;
  try {
    void *p = f(strtoll(argv[2], nullptr, 10), 0, nullptr);
    printf("returned %p\n", p);
    return 1;
  } catch (const std::exception &e) {
    printf("threw: %s\n", e.what());
    return strstr(e.what(), argv[3]) ? 0 : 1;
  }
}
