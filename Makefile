# gmb - GPU memory broker.  One Makefile; everything it makes goes to build/.
#
#   make            build the broker, the client library, gmbctl and tests
#   make check      build and run every test this machine can run
#   make check SAN=1  the same under AddressSanitizer + UBSan (build/san/)
#   make demo       a broker on the host device with a short demo
#   make bench      benchmarks (figures in docs/benchmarks.md)
#   make check-deploy  image, containers, compose, Kubernetes, systemd (root)
#   make check-fresh   the README's first lines in a minbase Debian 12 (root)
#   make check-slurm   gmb_spank.so under a Slurm started on this machine (root)
#   make install PREFIX=/usr/local   binaries, libraries, header, gmb.pc, docs
#   make clean
#   V=1             show full commands

PREFIX ?= /usr/local
SAN ?= 0
ifeq ($(SAN),1)
B := build/san
SANFLAGS := -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined
else
B := build
SANFLAGS :=
endif

ifeq ($(V),1)
Q :=
else
Q := @
endif

CC ?= cc
PKGS := libzmq libprotobuf-c inih libbsd jansson libcrypto libmicrohttpd
PKG_CFLAGS = $(shell pkg-config --cflags $(PKGS) 2>/dev/null)
PKG_LIBS = $(shell pkg-config --libs $(PKGS) 2>/dev/null)
CHECK_CFLAGS = $(shell pkg-config --cflags check 2>/dev/null)
CHECK_LIBS = $(shell pkg-config --libs check 2>/dev/null)

OPT ?= -O2 -g
WARN := -Wall -Wextra -Wstrict-prototypes -Wshadow -Werror
# INC is each part's own include path (below): a file includes its own
# part's headers, the shared ones (proto/) and the public one (include/),
# and nothing else compiles (docs/architecture.md, tests/layout.sh).
# VIS: only the public API is exported (a plugin's entry points set it).
VIS = -fvisibility=hidden
CFLAGS_ALL = -std=c11 -D_GNU_SOURCE -DGMB_BUILDING $(OPT) $(WARN) -fPIC \
  $(VIS) $(SANFLAGS) -MMD -MP $(INC) $(PKG_CFLAGS) $(CFLAGS)
LDFLAGS_ALL = $(SANFLAGS) $(LDFLAGS)
LIBS_ALL = $(PKG_LIBS) -lpthread -lrt -lm -ldl

# --- the parts, each an explicit list of sources --------------------------
#
#   proto/        shared by every side: wire codec, errors, util, driver
#                 loader, endpoints, lock-table layout  -> libgmb-common.a
#   broker/       gmb-broker (main.c) over libgmb-broker.a
#   client/lib/   the client library                    -> libgmb.a/.so
#   client/admin/ the admin socket's client, for gmbctl and gmb-replay
#   client/gmbctl/, client/replay/, client/shim/, client/examples/
COMMON_SRC := proto/wire.c proto/error.c proto/util.c proto/cudrv.c \
  proto/fdpass.c \
  proto/endpoint.c
# The broker by layer, top down (docs/architecture.md).
BROKER_SRC := broker/loop.c \
  broker/dispatch.c broker/admin.c broker/http.c broker/http_admin.c \
  broker/fdchan.c \
  broker/core.c \
  broker/reclaim.c broker/sleep.c broker/offload.c broker/defrag.c broker/observe.c broker/waitq.c \
  broker/alloc.c \
  broker/session.c broker/tenant.c broker/compact.c broker/repack.c \
  broker/evacuate.c \
  broker/locktab.c \
  broker/statefile.c broker/reply.c \
  broker/pool.c \
  broker/pool_check.c \
  broker/device.c broker/device_host.c broker/device_cuda.c \
  broker/config.c broker/log.c broker/connguard.c
BROKER_MAIN := broker/main.c
LIB_SRC := client/lib/client.c client/lib/cuimport.c client/lib/segmap.c \
  client/lib/fdclient.c client/lib/gpu.c client/lib/cache.c \
  client/lib/cache_check.c client/lib/cache_sleep.c \
  client/lib/sleep_policy.c client/lib/alloc_tags.c client/lib/hostbuf.c

COMMON_INC := -Iinclude -Iproto -I$(B)/gen
BROKER_INC := -Iinclude -Iproto -Ibroker
LIB_INC := -Iinclude -Iproto -Iclient/lib
$(B)/obj/proto/%.o: INC = $(COMMON_INC)
$(B)/obj/broker/%.o: INC = $(BROKER_INC)
$(B)/obj/client/lib/%.o: INC = $(LIB_INC)

# Tests include the part they test: broker modules, the library, or only
# the shared code.
UNIT_SRC := $(wildcard tests/unit/check_*.c)
LIB_UNITS := check_client check_client_cuda check_segmap check_cache \
  check_alloc_tags check_sleep_policy check_hostbuf
COMMON_UNITS := check_wire check_util check_cudrv check_fakecuda
INTEG_SRC := $(wildcard tests/integration/test_*.c)
HARNESS_SRC := tests/integration/harness.c
BENCH_SRC := $(wildcard tests/bench/bench_*.c)
LIB_BENCHES := bench_alloc bench_import bench_cache bench_snapshot bench_shim \
  bench_sleep
$(B)/obj/tests/unit/%.o: INC = $(BROKER_INC)
$(foreach u,$(LIB_UNITS),$(eval $(B)/obj/tests/unit/$(u).o: INC = $(LIB_INC)))
$(foreach u,$(COMMON_UNITS),$(eval $(B)/obj/tests/unit/$(u).o: INC = $(COMMON_INC)))
$(B)/obj/tests/integration/%.o: INC = $(LIB_INC)
$(B)/obj/tests/bench/%.o: INC = $(BROKER_INC)
$(foreach u,$(LIB_BENCHES),$(eval $(B)/obj/tests/bench/$(u).o: INC = $(LIB_INC)))
$(B)/obj/tests/bench/tracegen.o: INC = $(COMMON_INC)

obj = $(patsubst %.c,$(B)/obj/%.o,$(1))
GEN_OBJ := $(B)/obj/gen/gmb.pb-c.o
COMMON_OBJ := $(call obj,$(COMMON_SRC)) $(GEN_OBJ)
BROKER_OBJ := $(call obj,$(BROKER_SRC))
LIB_OBJ := $(call obj,$(LIB_SRC))
HARNESS_OBJ := $(call obj,$(HARNESS_SRC))

BROKER_BIN := $(B)/gmb-broker
# Named here, not in mk/tools.mk which builds it: mk/*.mk are read in
# name order, and a rule in an earlier one (mk/soak.mk) names it as a
# prerequisite, which make expands as it reads the rule.
CTL_BIN := $(B)/gmbctl
TRACEGEN_BIN := $(B)/bench/tracegen
COMMON_A := $(B)/libgmb-common.a
BROKER_A := $(B)/libgmb-broker.a
LIB_A := $(B)/libgmb.a
LIB_SO := $(B)/libgmb.so.0
LIB_SO_LINK := $(B)/libgmb.so
UNIT_BIN := $(patsubst tests/unit/%.c,$(B)/tests/%,$(UNIT_SRC))
INTEG_BIN := $(patsubst tests/integration/%.c,$(B)/tests/%,$(INTEG_SRC))
BENCH_BIN := $(patsubst tests/bench/%.c,$(B)/bench/%,$(BENCH_SRC))

.PHONY: all deps check unit integration demo bench install clean gen layout \
  check-deploy check-fresh check-slurm
# Keep the objects that only pattern rules name (tests, benchmarks) between
# runs.  Not a bare .SECONDARY: that would also let make skip a missing
# object of an archive whenever the archive is newer than its source.
.PRECIOUS: $(B)/obj/%.o
all: $(BROKER_BIN) $(TRACEGEN_BIN) $(LIB_SO) $(LIB_SO_LINK) $(LIB_A) \
     $(UNIT_BIN) $(INTEG_BIN) $(BENCH_BIN) $(B)/gmb.pc

# Missing Debian packages are installed (as root) or named (otherwise).
deps:
	$(Q)sh deploy/install-deps.sh

# One run of protoc-c makes both files (a grouped target).
$(B)/gen/gmb.pb-c.c $(B)/gen/gmb.pb-c.h &: proto/gmb.proto | deps
	@mkdir -p $(B)/gen
	@echo "  PROTOC  $<"
	$(Q)protoc-c --proto_path=proto --c_out=$(B)/gen $<
gen: $(B)/gen/gmb.pb-c.c

$(B)/obj/%.o: %.c
	@mkdir -p $(dir $@)
	@echo "  CC      $<"
	$(Q)$(CC) $(CFLAGS_ALL) -c $< -o $@

# Only the wire codec includes the generated header.
$(call obj,$(COMMON_SRC)): | $(B)/gen/gmb.pb-c.h

$(GEN_OBJ): INC = $(COMMON_INC)
$(GEN_OBJ): $(B)/gen/gmb.pb-c.c
	@mkdir -p $(dir $@)
	@echo "  CC      $<"
	$(Q)$(CC) $(filter-out -Wshadow -Wstrict-prototypes,$(CFLAGS_ALL)) -c $< -o $@

$(COMMON_A): $(COMMON_OBJ)
	@echo "  AR      $@"
	$(Q)rm -f $@ && ar rcs $@ $^

$(BROKER_A): $(BROKER_OBJ)
	@echo "  AR      $@"
	$(Q)rm -f $@ && ar rcs $@ $^

# The library carries the shared code it uses: libgmb.a and libgmb.so
# stand alone, as installed.
$(LIB_A): $(LIB_OBJ) $(COMMON_OBJ)
	@echo "  AR      $@"
	$(Q)rm -f $@ && ar rcs $@ $^

$(LIB_SO): $(LIB_OBJ) $(COMMON_OBJ)
	@echo "  LD      $@"
	$(Q)$(CC) -shared -Wl,-soname,libgmb.so.0 -o $@ $^ $(LDFLAGS_ALL) $(LIBS_ALL)

# The name a linker looks for (-lgmb); the run-time loader wants the soname.
$(LIB_SO_LINK): $(LIB_SO)
	$(Q)ln -sf libgmb.so.0 $@

$(BROKER_BIN): $(call obj,$(BROKER_MAIN)) $(BROKER_A) $(COMMON_A)
	@echo "  LD      $@"
	$(Q)$(CC) -o $@ $^ $(LDFLAGS_ALL) $(LIBS_ALL)

# Writes the fragmentation suite's traces (tests/bench/frag.sh).
$(TRACEGEN_BIN): $(B)/obj/tests/bench/tracegen.o
	@mkdir -p $(dir $@)
	@echo "  LD      $@"
	$(Q)$(CC) -o $@ $^ $(LDFLAGS_ALL) -lm

# Each suite links the part it tests and nothing of the other side.
$(B)/tests/check_%: $(B)/obj/tests/unit/check_%.o $(BROKER_A) $(COMMON_A)
	@mkdir -p $(dir $@)
	@echo "  LD      $@"
	$(Q)$(CC) -o $@ $^ $(LDFLAGS_ALL) $(CHECK_LIBS) $(LIBS_ALL)
# check_offload fails the broker's small callocs on demand (__wrap_calloc).
$(B)/tests/check_offload: private LDFLAGS_ALL += -Wl,--wrap=calloc
# link PROGRAM, OBJECT, ARCHIVES: a program of another part than its
# directory's pattern rule assumes.
define link
$(1): $(2) $(3)
	@mkdir -p $$(dir $$@)
	@echo "  LD      $$@"
	$$(Q)$$(CC) -o $$@ $$^ $$(LDFLAGS_ALL) $$(CHECK_LIBS) $$(LIBS_ALL)
endef
$(foreach u,$(LIB_UNITS),$(eval $(call link,$(B)/tests/$(u),$(B)/obj/tests/unit/$(u).o,$(LIB_A))))
$(foreach u,$(COMMON_UNITS),$(eval $(call link,$(B)/tests/$(u),$(B)/obj/tests/unit/$(u).o,$(COMMON_A))))

$(B)/tests/test_%: $(B)/obj/tests/integration/test_%.o $(HARNESS_OBJ) $(LIB_A)
	@mkdir -p $(dir $@)
	@echo "  LD      $@"
	$(Q)$(CC) -o $@ $^ $(LDFLAGS_ALL) $(CHECK_LIBS) $(LIBS_ALL)

$(B)/bench/%: $(B)/obj/tests/bench/%.o $(BROKER_A) $(COMMON_A)
	@mkdir -p $(dir $@)
	@echo "  LD      $@"
	$(Q)$(CC) -o $@ $^ $(LDFLAGS_ALL) $(LIBS_ALL)
$(foreach u,$(LIB_BENCHES),$(eval $(call link,$(B)/bench/$(u),$(B)/obj/tests/bench/$(u).o,$(LIB_A))))

# Fragments for parts with their own rules (mk/*.mk): the tools beside the
# library, the CUDA bundle, the LD_PRELOAD shim and the PyTorch allocator.
# Before the targets below, whose prerequisites name their programs.
include $(sort $(wildcard mk/*.mk))

# The pkg-config file names PREFIX, so it is written again at install time
# (a plain `make` writes one for the default PREFIX).
define write_pc
	$(Q)printf '%s\n' 'prefix=$(PREFIX)' 'libdir=$${prefix}/lib' \
	  'includedir=$${prefix}/include' '' 'Name: gmb' \
	  'Description: client library of the gmb GPU memory broker' \
	  'Version: 0.1.0' 'Requires.private: libzmq libprotobuf-c' \
	  'Libs: -L$${libdir} -lgmb' 'Libs.private: -lpthread -lrt' \
	  'Cflags: -I$${includedir}' > $(1)
endef

$(B)/gmb.pc: Makefile
	@mkdir -p $(B)
	$(call write_pc,$@)

# Tests: the tree's own checks (the layering rules and their self-test, a
# second make that has nothing to do, the examples built against an
# installed library), unit tests, then integration tests that start real
# brokers.  Each is a suite; tests/run.sh prints a summary line.
TREE_CHECKS := tests/layout.sh tests/layout_selftest.sh tests/rebuild.sh \
  tests/entrypoint.sh tests/torch_py.sh \
  tests/install.sh tests/gpu_rehearse.sh
check: all
	$(Q)sh tests/run.sh $(B) $(TREE_CHECKS) $(UNIT_BIN) $(INTEG_BIN) \
	  $(K8S_CHECKS) $(FUZZ_SEED_CHECKS)

unit: $(UNIT_BIN)
	$(Q)sh tests/run.sh $(B) $(UNIT_BIN)

integration: $(INTEG_BIN) $(BROKER_BIN) $(CTL_BIN) $(REPLAY_BIN)
	$(Q)sh tests/run.sh $(B) $(INTEG_BIN)

demo: $(BROKER_BIN) $(CTL_BIN) $(REPLAY_BIN) $(EXAMPLE_BIN)
	$(Q)sh deploy/demo/demo.sh $(B)

bench: $(BENCH_BIN) $(BROKER_BIN) $(CTL_BIN) $(REPLAY_BIN) $(TRACEGEN_BIN)
	$(Q)sh tests/bench/run.sh $(B)

install: $(BROKER_BIN) $(CTL_BIN) $(REPLAY_BIN) $(DP_BIN) $(LIB_SO) $(LIB_A) \
  $(B)/gmb.pc
	install -d $(DESTDIR)$(PREFIX)/bin $(DESTDIR)$(PREFIX)/lib \
	  $(DESTDIR)$(PREFIX)/include $(DESTDIR)$(PREFIX)/lib/pkgconfig
	install -m 0755 $(BROKER_BIN) $(CTL_BIN) $(REPLAY_BIN) $(DP_BIN) \
	  $(DESTDIR)$(PREFIX)/bin/
	install -m 0755 $(LIB_SO) $(DESTDIR)$(PREFIX)/lib/libgmb.so.0
	ln -sf libgmb.so.0 $(DESTDIR)$(PREFIX)/lib/libgmb.so
	install -m 0644 $(LIB_A) $(DESTDIR)$(PREFIX)/lib/
	install -m 0644 include/gmb.h $(DESTDIR)$(PREFIX)/include/
	$(call write_pc,$(DESTDIR)$(PREFIX)/lib/pkgconfig/gmb.pc)
	install -d $(DESTDIR)$(PREFIX)/share/doc/gmb
	install -m 0644 README.md docs/*.md deploy/gmb.ini.example \
	  deploy/grafana/gmb-dashboard.json \
	  $(DESTDIR)$(PREFIX)/share/doc/gmb/

# The deployment files, built and run as an operator would: podman builds
# the image on a debootstrap base and runs a broker and jobs in
# containers; a private dockerd builds it and runs compose.yaml; both
# systemd units run under a booted systemd (systemd-nspawn); compose and
# Kubernetes files are validated; check-fresh runs too
# (deploy/check/check-deploy.sh, docs/deploy.md).  Needs root; says what
# it skipped and why, and leaves the machine's network as it found it.
check-deploy: all
	$(Q)bash deploy/check/check-deploy.sh $(B)

# The README's first two lines, verbatim, in a minbase Debian 12 root made
# with debootstrap from this machine's apt mirror (deploy/check/
# check-fresh.sh).  Needs root.
check-fresh:
	$(Q)bash deploy/check/check-fresh.sh $(B)

# gmb_spank.so under a real Slurm: Debian's packages installed when missing
# (deploy/install-deps.sh --slurm), munged, slurmctld and slurmd for one
# node and gmb brokers started from a private directory, jobs submitted
# with srun and sbatch (deploy/check/check-slurm.sh, docs/slurm.md).
# Needs root; says what it skipped and why.
check-slurm: all
	$(Q)bash deploy/check/check-slurm.sh $(B)

clean:
	rm -rf build

-include $(shell find $(B)/obj -name '*.d' 2>/dev/null)
