# The CUDA device's test double and the GPU bundle.
#
#   $(B)/fakecuda/libcuda.so.1   a fake CUDA driver (a test double) on
#                                memfd (tests/fakecuda/fakecuda.c), loaded
#                                by the tests through $GMB_LIBCUDA
#   make gpu-bundle              $(B)/gpu-bundle/: what travels to a GPU
#                                machine (the device tool's carry list is
#                                that one folder): the programs
#                                tests/gpu/run.sh runs and the shared
#                                libraries they need that such a machine
#                                lacks, found through RPATH
#                                (tests/gpu/bundle.sh); fails when more
#                                than 64 MiB would travel
#   make gpu-rehearse            tests/gpu/run.sh on the stand-in driver

FAKECUDA_SO := $(B)/fakecuda/libcuda.so.1

# Never sanitized (it is dlopen()ed into plain binaries too) and -z nodelete:
# its stream threads must outlive a dlclose().
$(FAKECUDA_SO): tests/fakecuda/fakecuda.c
	@mkdir -p $(dir $@)
	@echo "  CC      $<"
	$(Q)$(CC) -std=c11 -D_GNU_SOURCE -O2 -g -Wall -Wextra -Wshadow -Werror \
	  -fPIC -fvisibility=hidden -shared -Wl,-z,nodelete \
	  -Wl,-soname,libcuda.so.1 -o $@ $< -lpthread

all: $(FAKECUDA_SO)

# A fake NVML beside it (tests/fakecuda/fakenvml.c), for the preload's
# NVML figures.
FAKENVML_SO := $(B)/fakecuda/libnvidia-ml.so.1
$(FAKENVML_SO): tests/fakecuda/fakenvml.c
	@mkdir -p $(dir $@)
	@echo "  CC      $<"
	$(Q)$(CC) -std=c11 -D_GNU_SOURCE -O2 -g -Wall -Wextra -Wshadow -Werror \
	  -fPIC -fvisibility=hidden -shared -Wl,-soname,libnvidia-ml.so.1 \
	  -o $@ $<
all: $(FAKENVML_SO)
# The suites that load it find it by path: make sure it exists first.
$(B)/tests/check_cudrv $(B)/tests/check_device_cuda $(B)/tests/test_cuda \
  $(B)/tests/check_client_cuda $(B)/tests/check_fakecuda: | $(FAKECUDA_SO)

# Where the toolkit is installed, tests/fakecuda/cudrv_abi.c holds cudrv.h's
# types to cuda.h's with static asserts; check_cudrv is not linked until it
# compiled.  Elsewhere that check is skipped (check_cudrv says so).
CUDA_HOME ?= /usr/local/cuda
ifneq ($(wildcard $(CUDA_HOME)/include/cuda.h),)
CUDRV_ABI_OBJ := $(B)/obj/tests/fakecuda/cudrv_abi.o
$(CUDRV_ABI_OBJ): INC = $(COMMON_INC)
$(CUDRV_ABI_OBJ): CFLAGS += -DGMB_CUDA_H='"$(CUDA_HOME)/include/cuda.h"'
$(B)/obj/tests/unit/check_cudrv.o: CFLAGS += -DGMB_HAVE_CUDA_H
$(B)/tests/check_cudrv: | $(CUDRV_ABI_OBJ)

# check_fakecuda_linked: the stand-in as a program built with cuda.h and
# linked with -lcuda sees it (tests/fakecuda/check_linked.c).  It finds the
# stand-in through its run path, or the driver LD_LIBRARY_PATH names.
LINKED_CHECK := $(B)/tests/check_fakecuda_linked
$(B)/obj/tests/fakecuda/check_linked.o: INC = -I$(CUDA_HOME)/include
$(LINKED_CHECK): $(B)/obj/tests/fakecuda/check_linked.o | $(FAKECUDA_SO)
	@mkdir -p $(dir $@)
	@echo "  LD      $@"
	$(Q)$(CC) -o $@ $< $(LDFLAGS_ALL) -L$(B)/fakecuda -l:libcuda.so.1 \
	  -Wl,-rpath,$(abspath $(B)/fakecuda) $(CHECK_LIBS) -lpthread
all: $(LINKED_CHECK)
UNIT_BIN += $(LINKED_CHECK)
endif

# GPU tests (tests/gpu/*.c): plain C against libgmb and cudrv, so they
# build here; they only run where a GPU is (tests/gpu/run.sh).
GPU_SRC := $(wildcard tests/gpu/*.c)
GPU_BIN := $(patsubst tests/gpu/%.c,$(B)/gpu/%,$(GPU_SRC))
$(B)/obj/tests/gpu/%.o: INC = $(LIB_INC)
$(B)/gpu/%: $(B)/obj/tests/gpu/%.o $(LIB_A)
	@mkdir -p $(dir $@)
	@echo "  LD      $@"
	$(Q)$(CC) -o $@ $^ $(LDFLAGS_ALL) $(LIBS_ALL)
all: $(GPU_BIN)

.PHONY: gpu-bundle
gpu-bundle: all
	$(Q)sh tests/gpu/bundle.sh $(B)

# tests/gpu/run.sh rehearsed here, end to end, on the stand-in driver
# (GMB_GPU_REHEARSE=1; what the stand-in cannot run reads NOTRUN); its
# log and figures go to $(B)/gpu-rehearsal/.  tests/gpu_rehearse.sh runs
# it in `make check`.
.PHONY: gpu-rehearse
gpu-rehearse: gpu-bundle
	$(Q)GMB_GPU_REHEARSE=1 GMB_LIBCUDA=$(CURDIR)/$(FAKECUDA_SO) \
	  GMB_GPU_BUNDLE=$(B)/gpu-bundle bash tests/gpu/run.sh $(B)/gpu-rehearsal
