# mk/shim.mk - the LD_PRELOAD shim (libgmb-preload.so), the PyTorch
# allocator (libgmb-torch.so) and the small programs their tests run.
#
# The shims use the public API only (gmb.h).  Each .so carries a private
# copy of the client library (libgmb.a); --exclude-libs keeps its gmb_*
# symbols hidden, so a program that links libgmb.so itself is not
# interposed on.

$(B)/obj/client/shim/%.o: INC = -Iinclude -Iclient/shim

SHIM_COMMON := $(call obj,client/shim/shim.c)
PRELOAD_SO := $(B)/libgmb-preload.so
TORCH_SO := $(B)/libgmb-torch.so
PRELOAD_PROG := $(B)/preload/cuda_prog
PRELOAD_FAKE := $(B)/preload/libfakecudart.so
PRELOAD_STATIC_PROG := $(B)/preload/static_prog
TORCH_THROW_PROG := $(B)/preload/torch_throw_prog

all: $(PRELOAD_SO) $(TORCH_SO) $(PRELOAD_PROG) $(PRELOAD_FAKE) $(TORCH_THROW_PROG) \
  $(PRELOAD_STATIC_PROG)

# gmb_torch_alloc is C++ (it throws; see torch_throw.cc): compiled with
# the C++ compiler, and the library links libstdc++.
CXX ?= g++
TORCH_THROW_OBJ := $(B)/obj/client/shim/torch_throw.o
$(TORCH_THROW_OBJ): client/shim/torch_throw.cc
	@mkdir -p $(dir $@)
	@echo "  CXX     $<"
	$(Q)$(CXX) -std=c++17 -O2 -g -Wall -Wextra -Werror -fPIC \
	  -fvisibility=hidden $(SANFLAGS) -c -o $@ $<

$(TORCH_THROW_PROG): tests/preload/torch_throw_prog.cc
	@mkdir -p $(dir $@)
	@echo "  CXX     $<"
	$(Q)$(CXX) -std=c++17 -O2 -g -Wall -Wextra -Werror $(SANFLAGS) -o $@ $< -ldl

PRELOAD_SRC := client/shim/preload.c client/shim/getproc.c client/shim/vmm.c \
  client/shim/nvml.c
$(PRELOAD_SO): $(call obj,$(PRELOAD_SRC)) $(SHIM_COMMON) $(LIB_A)
	@echo "  LD      $@"
	$(Q)$(CC) -shared -Wl,-soname,libgmb-preload.so -o $@ \
	  $(filter %.o,$^) $(LIB_A) -Wl,--exclude-libs,ALL -Wl,-z,defs $(LDFLAGS_ALL) $(LIBS_ALL)

$(TORCH_SO): $(call obj,client/shim/torch.c) $(TORCH_THROW_OBJ) $(SHIM_COMMON) $(LIB_A)
	@echo "  LD      $@"
	$(Q)$(CC) -shared -Wl,-soname,libgmb-torch.so -o $@ \
	  $(filter %.o,$^) $(LIB_A) -Wl,--exclude-libs,ALL $(LDFLAGS_ALL) $(LIBS_ALL) -lstdc++

# Linked against nothing that defines the CUDA functions (they are weak in
# it): only the preloaded library provides them.
$(PRELOAD_PROG): $(call obj,tests/preload/cuda_prog.c)
	@mkdir -p $(dir $@)
	@echo "  LD      $@"
	$(Q)$(CC) -o $@ $^ $(LDFLAGS_ALL) -ldl

# As a program on the static CUDA runtime: it names no CUDA function and
# finds the driver with dlopen/dlsym/cuGetProcAddress.
$(PRELOAD_STATIC_PROG): $(call obj,tests/preload/static_prog.c)
	@mkdir -p $(dir $@)
	@echo "  LD      $@"
	$(Q)$(CC) -o $@ $^ $(LDFLAGS_ALL) -ldl

# A real nvcc build on the default static runtime, where the toolkit is
# installed (test_preload says it skipped it elsewhere).
NVCC ?= $(CUDA_HOME)/bin/nvcc
ifneq ($(wildcard $(NVCC)),)
PRELOAD_STATIC_CUDART := $(B)/preload/static_cudart $(B)/preload/shared_cudart
$(B)/preload/static_cudart: tests/preload/static_cudart.cu
	@mkdir -p $(dir $@)
	@echo "  NVCC    $<"
	$(Q)$(NVCC) -o $@ $<
# The same with the runtime as a shared library (nvcc -cudart shared).
$(B)/preload/shared_cudart: tests/preload/static_cudart.cu
	@mkdir -p $(dir $@)
	@echo "  NVCC    $< (-cudart shared)"
	$(Q)$(NVCC) -cudart shared -Xlinker -rpath=$(CUDA_HOME)/lib64 -o $@ $<
all: $(PRELOAD_STATIC_CUDART)
endif

$(PRELOAD_FAKE): $(call obj,tests/preload/fake_cudart.c)
	@mkdir -p $(dir $@)
	@echo "  LD      $@"
	$(Q)$(CC) -shared -o $@ $^ $(LDFLAGS_ALL) -ldl

# The integration tests run these at run time (order-only: not linked in).
$(B)/tests/test_preload: | $(PRELOAD_SO) $(PRELOAD_PROG) $(PRELOAD_FAKE) $(BROKER_BIN) \
  $(PRELOAD_STATIC_PROG) $(FAKECUDA_SO) $(FAKENVML_SO) $(PRELOAD_STATIC_CUDART)
$(B)/tests/test_torch: | $(TORCH_SO) $(TORCH_THROW_PROG) $(BROKER_BIN)
# bench_shim loads the PyTorch allocator at run time, as the test does.
$(B)/bench/bench_shim: | $(TORCH_SO) $(BROKER_BIN)

install: install-shim
.PHONY: install-shim
install-shim: $(PRELOAD_SO) $(TORCH_SO)
	install -d $(DESTDIR)$(PREFIX)/lib $(DESTDIR)$(PREFIX)/share/gmb/python
	install -m 0755 $(PRELOAD_SO) $(TORCH_SO) $(DESTDIR)$(PREFIX)/lib/
	install -m 0644 client/python/gmb_torch.py $(DESTDIR)$(PREFIX)/share/gmb/python/
