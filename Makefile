# gmb - GPU memory broker.  One Makefile; everything it makes goes to build/.
#
#   make            build the broker, the client library, gmbctl and tests
#   make check      build and run every test this machine can run
#   make check SAN=1  the same under AddressSanitizer + UBSan (build/san/)
#   make demo       a broker on the host device with a short demo
#   make bench      benchmarks (figures in docs/benchmarks.md)
#   make install PREFIX=/usr/local   binaries, libraries, header, gmb.pc
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
CFLAGS_ALL = -std=c11 -D_GNU_SOURCE -DGMB_BUILDING $(OPT) $(WARN) -fPIC \
  -fvisibility=hidden $(SANFLAGS) -MMD -MP \
  -Iinclude -Iclient -Iproto -Ibroker -I$(B)/gen $(PKG_CFLAGS) $(CFLAGS)
LDFLAGS_ALL = $(SANFLAGS) $(LDFLAGS)
LIBS_ALL = $(PKG_LIBS) -lpthread -lrt -lm -ldl

GEN := $(B)/gen/gmb.pb-c.c

LIB_SRC := $(filter-out client/gmbctl.c client/ctl_%.c client/replay.c,$(wildcard client/*.c)) proto/wire.c
CTL_SRC := client/gmbctl.c $(wildcard client/ctl_*.c)
BROKER_SRC := $(filter-out broker/main.c,$(wildcard broker/*.c))
UNIT_SRC := $(wildcard tests/unit/check_*.c)
INTEG_SRC := $(wildcard tests/integration/test_*.c)
HARNESS_SRC := $(wildcard tests/integration/harness.c)
EXAMPLE_SRC := $(wildcard client/examples/*.c)
BENCH_SRC := $(wildcard tests/bench/bench_*.c)

obj = $(patsubst %.c,$(B)/obj/%.o,$(1))
GEN_OBJ := $(B)/obj/gen/gmb.pb-c.o
LIB_OBJ := $(call obj,$(LIB_SRC)) $(GEN_OBJ)
BROKER_OBJ := $(call obj,$(BROKER_SRC))
HARNESS_OBJ := $(call obj,$(HARNESS_SRC))

BROKER_BIN := $(B)/gmb-broker
CTL_BIN := $(B)/gmbctl
REPLAY_BIN := $(B)/gmb-replay
TRACEGEN_BIN := $(B)/bench/tracegen
LIB_SO := $(B)/libgmb.so
LIB_A := $(B)/libgmb.a
CORE_A := $(B)/libgmb-broker.a
UNIT_BIN := $(patsubst tests/unit/%.c,$(B)/tests/%,$(UNIT_SRC))
INTEG_BIN := $(patsubst tests/integration/%.c,$(B)/tests/%,$(INTEG_SRC))
EXAMPLE_BIN := $(patsubst client/examples/%.c,$(B)/examples/%,$(EXAMPLE_SRC))
BENCH_BIN := $(patsubst tests/bench/%.c,$(B)/bench/%,$(BENCH_SRC))

.PHONY: all deps check unit integration demo bench install clean gen
# Keep test and bench objects between runs (they are intermediate files).
.SECONDARY:
all: $(BROKER_BIN) $(CTL_BIN) $(REPLAY_BIN) $(TRACEGEN_BIN) $(LIB_SO) $(LIB_A) $(UNIT_BIN) $(INTEG_BIN) \
     $(EXAMPLE_BIN) $(BENCH_BIN) $(B)/gmb.pc

# Missing Debian packages are installed (as root) or named (otherwise).
deps:
	$(Q)sh deploy/install-deps.sh

$(B)/gen/gmb.pb-c.c $(B)/gen/gmb.pb-c.h: proto/gmb.proto | deps
	@mkdir -p $(B)/gen
	@echo "  PROTOC  $<"
	$(Q)protoc-c --proto_path=proto --c_out=$(B)/gen $<
gen: $(GEN)

# Every object waits for the generated header (order-only).
$(B)/obj/%.o: %.c | $(B)/gen/gmb.pb-c.h
	@mkdir -p $(dir $@)
	@echo "  CC      $<"
	$(Q)$(CC) $(CFLAGS_ALL) -c $< -o $@

$(GEN_OBJ): $(B)/gen/gmb.pb-c.c
	@mkdir -p $(dir $@)
	@echo "  CC      $<"
	$(Q)$(CC) $(filter-out -Wshadow -Wstrict-prototypes,$(CFLAGS_ALL)) -c $< -o $@

$(LIB_A): $(LIB_OBJ)
	@echo "  AR      $@"
	$(Q)rm -f $@ && ar rcs $@ $^

$(LIB_SO): $(LIB_OBJ)
	@echo "  LD      $@"
	$(Q)$(CC) -shared -Wl,-soname,libgmb.so.0 -o $@ $^ $(LDFLAGS_ALL) $(LIBS_ALL)

$(CORE_A): $(BROKER_OBJ)
	@echo "  AR      $@"
	$(Q)rm -f $@ && ar rcs $@ $^

$(BROKER_BIN): $(B)/obj/broker/main.o $(CORE_A) $(LIB_A)
	@echo "  LD      $@"
	$(Q)$(CC) -o $@ $^ $(LDFLAGS_ALL) $(LIBS_ALL)

$(CTL_BIN): $(call obj,$(CTL_SRC)) $(LIB_A)
	@echo "  LD      $@"
	$(Q)$(CC) -o $@ $^ $(LDFLAGS_ALL) $(LIBS_ALL)

# The trace replayer (DESIGN.md "Trace format"), a client like gmbctl.
$(REPLAY_BIN): $(B)/obj/client/replay.o $(LIB_A)
	@echo "  LD      $@"
	$(Q)$(CC) -o $@ $^ $(LDFLAGS_ALL) $(LIBS_ALL)

# Writes the fragmentation suite's traces (tests/bench/frag.sh).
$(TRACEGEN_BIN): $(B)/obj/tests/bench/tracegen.o
	@mkdir -p $(dir $@)
	@echo "  LD      $@"
	$(Q)$(CC) -o $@ $^ $(LDFLAGS_ALL) -lm

$(B)/tests/check_%: $(B)/obj/tests/unit/check_%.o $(CORE_A) $(LIB_A)
	@mkdir -p $(dir $@)
	@echo "  LD      $@"
	$(Q)$(CC) -o $@ $^ $(LDFLAGS_ALL) $(CHECK_LIBS) $(LIBS_ALL)

$(B)/tests/test_%: $(B)/obj/tests/integration/test_%.o $(HARNESS_OBJ) $(LIB_A)
	@mkdir -p $(dir $@)
	@echo "  LD      $@"
	$(Q)$(CC) -o $@ $^ $(LDFLAGS_ALL) $(CHECK_LIBS) $(LIBS_ALL)

$(B)/examples/%: $(B)/obj/client/examples/%.o $(LIB_A)
	@mkdir -p $(dir $@)
	@echo "  LD      $@"
	$(Q)$(CC) -o $@ $^ $(LDFLAGS_ALL) $(LIBS_ALL)

$(B)/bench/%: $(B)/obj/tests/bench/%.o $(CORE_A) $(LIB_A)
	@mkdir -p $(dir $@)
	@echo "  LD      $@"
	$(Q)$(CC) -o $@ $^ $(LDFLAGS_ALL) $(LIBS_ALL)

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

# Tests: unit tests, then integration tests that start real brokers.  Each
# binary is a Check suite; tests/run.sh prints a summary line per suite.
check: all
	$(Q)sh tests/run.sh $(B) $(UNIT_BIN) $(INTEG_BIN)

unit: $(UNIT_BIN)
	$(Q)sh tests/run.sh $(B) $(UNIT_BIN)

integration: $(INTEG_BIN) $(BROKER_BIN) $(CTL_BIN) $(REPLAY_BIN)
	$(Q)sh tests/run.sh $(B) $(INTEG_BIN)

demo: $(BROKER_BIN) $(CTL_BIN) $(REPLAY_BIN) $(EXAMPLE_BIN)
	$(Q)sh deploy/demo/demo.sh $(B)

bench: $(BENCH_BIN) $(BROKER_BIN) $(REPLAY_BIN) $(TRACEGEN_BIN)
	$(Q)sh tests/bench/run.sh $(B)

install: $(BROKER_BIN) $(CTL_BIN) $(REPLAY_BIN) $(LIB_SO) $(LIB_A) $(B)/gmb.pc
	install -d $(DESTDIR)$(PREFIX)/bin $(DESTDIR)$(PREFIX)/lib \
	  $(DESTDIR)$(PREFIX)/include $(DESTDIR)$(PREFIX)/lib/pkgconfig
	install -m 0755 $(BROKER_BIN) $(CTL_BIN) $(REPLAY_BIN) $(DESTDIR)$(PREFIX)/bin/
	install -m 0755 $(LIB_SO) $(DESTDIR)$(PREFIX)/lib/libgmb.so.0
	ln -sf libgmb.so.0 $(DESTDIR)$(PREFIX)/lib/libgmb.so
	install -m 0644 $(LIB_A) $(DESTDIR)$(PREFIX)/lib/
	install -m 0644 include/gmb.h $(DESTDIR)$(PREFIX)/include/
	$(call write_pc,$(DESTDIR)$(PREFIX)/lib/pkgconfig/gmb.pc)

clean:
	rm -rf build

# Fragments for parts with their own rules (mk/*.mk): the CUDA bundle,
# the LD_PRELOAD shim and the PyTorch allocator.
-include $(wildcard mk/*.mk)

-include $(shell find $(B)/obj -name '*.d' 2>/dev/null)
