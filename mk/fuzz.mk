# mk/fuzz.mk - `make fuzz`: libFuzzer targets (tests/fuzz/), built with
# clang under ASan + UBSan into build/fuzz/, each run FUZZ_SECONDS seconds
# (default 60) from its seed corpus (tests/fuzz/corpus/TARGET/) by
# tests/fuzz/run.sh, which prints executions per target and fails on a
# crash.  Not part of `all` or `check` (they build with $(CC)).
#
#   make fuzz                     every target, 60 s each
#   make fuzz FUZZ_SECONDS=20     the CI round
#   make fuzz FUZZ_TARGETS=config one target
#
# The code under test is compiled again here with -fsanitize=fuzzer-no-link
# (coverage for libFuzzer, no main); each part keeps its own include path.

FUZZ_SECONDS ?= 60
FUZZ_CC ?= clang
FZ := build/fuzz
FUZZ_TARGETS ?= dispatch config statefile replay fdchan http_admin
FUZZ_SAN := -fsanitize=address,undefined -fno-sanitize-recover=undefined \
  -fno-omit-frame-pointer
FUZZ_CFLAGS = -std=c11 -D_GNU_SOURCE -DGMB_BUILDING -O1 -g -Wall -Wextra \
  -Wno-unused-parameter $(FUZZ_SAN) -fsanitize=fuzzer-no-link \
  -fsanitize-coverage-ignorelist=tests/fuzz/coverage-ignore.txt $(FZ_INC) \
  $(PKG_CFLAGS) $(FUZZ_SLICE)
# The broker's slices made small enough for the dispatch target's inputs
# (a 16 MiB device, a few dozen allocations) to reach them: the offload
# job's (broker/offload.h) and ended sessions' (broker/core.h).  Changing
# these needs build/fuzz/obj removed (objects do not depend on flags).
FUZZ_SLICE := '-DGMB_OFFLOAD_SLICE=(UINT64_C(2) << 20)' \
  -DGMB_CORE_REAP_RANGES=8u

FZ_COMMON_OBJ := $(patsubst %.c,$(FZ)/obj/%.o,$(COMMON_SRC)) \
  $(FZ)/obj/gen/gmb.pb-c.o
FZ_BROKER_OBJ := $(patsubst %.c,$(FZ)/obj/%.o,$(BROKER_SRC))
FZ_LIB_OBJ := $(patsubst %.c,$(FZ)/obj/%.o,$(LIB_SRC) $(ADMIN_SRC))
FZ_BIN := $(patsubst %,$(FZ)/fuzz_%,$(FUZZ_TARGETS))

$(FZ)/obj/proto/%.o: FZ_INC = -Iinclude -Iproto -I$(FZ)/gen
$(FZ)/obj/gen/%.o: FZ_INC = -Iinclude -Iproto -I$(FZ)/gen
$(FZ)/obj/broker/%.o: FZ_INC = $(BROKER_INC)
$(FZ)/obj/client/lib/%.o: FZ_INC = $(LIB_INC)
$(FZ)/obj/client/admin/%.o: FZ_INC = -Iinclude -Iproto -Iclient/admin
$(FZ)/obj/tests/fuzz/%.o: FZ_INC = $(BROKER_INC)
$(FZ)/obj/tests/fuzz/fuzz_replay.o: FZ_INC = -Iinclude -Iproto \
  -Iclient/admin -Iclient/replay

# replay.c without its main leaves the tool's other functions unused.
$(FZ)/obj/tests/fuzz/fuzz_replay.o: FUZZ_CFLAGS += -Wno-unused-function
.PRECIOUS: $(FZ)/obj/%.o

$(FZ)/gen/gmb.pb-c.c $(FZ)/gen/gmb.pb-c.h &: proto/gmb.proto | deps
	@mkdir -p $(FZ)/gen
	@echo "  PROTOC  $< (fuzz)"
	$(Q)protoc-c --proto_path=proto --c_out=$(FZ)/gen $<

$(FZ)/obj/gen/gmb.pb-c.o: $(FZ)/gen/gmb.pb-c.c
	@mkdir -p $(dir $@)
	@echo "  CLANG   $<"
	$(Q)$(FUZZ_CC) $(FUZZ_CFLAGS) -c $< -o $@

$(FZ)/obj/%.o: %.c tests/fuzz/coverage-ignore.txt | $(FZ)/gen/gmb.pb-c.h
	@mkdir -p $(dir $@)
	@echo "  CLANG   $<"
	$(Q)$(FUZZ_CC) $(FUZZ_CFLAGS) -MMD -MP -c $< -o $@

# gmb-replay's parser is the library's side: it links no broker object.
$(FZ)/fuzz_replay: $(FZ)/obj/tests/fuzz/fuzz_replay.o $(FZ_LIB_OBJ) \
    $(FZ_COMMON_OBJ)
	@echo "  LD      $@"
	$(Q)$(FUZZ_CC) $(FUZZ_SAN) -fsanitize=fuzzer -o $@ $^ $(LIBS_ALL)
$(FZ)/fuzz_%: $(FZ)/obj/tests/fuzz/fuzz_%.o $(FZ_BROKER_OBJ) $(FZ_COMMON_OBJ)
	@echo "  LD      $@"
	$(Q)$(FUZZ_CC) $(FUZZ_SAN) -fsanitize=fuzzer -o $@ $^ $(LIBS_ALL)

.PHONY: fuzz fuzz-build
fuzz-build: $(FZ_BIN)
fuzz: fuzz-build
	$(Q)sh tests/fuzz/run.sh $(FZ) $(FUZZ_SECONDS) $(FUZZ_TARGETS)

-include $(shell find $(FZ)/obj -name '*.d' 2>/dev/null)

# The seed corpora on every `make check` (tests/fuzz/seeds.sh): the
# broker's targets linked with tests/fuzz/standalone.c's main instead of
# libFuzzer, built with $(CC) (and under SAN=1 with the sanitizers), each
# given its corpus once.  No clang needed; `make fuzz` still mutates.
FUZZ_SEED_TARGETS := statefile fdchan config dispatch http_admin
FUZZ_SEED_BIN := $(patsubst %,$(B)/tests/fuzzseed_%,$(FUZZ_SEED_TARGETS))
FUZZ_SEED_CHECKS := tests/fuzz/seeds.sh
$(B)/obj/tests/fuzz/%.o: INC = $(BROKER_INC)
$(B)/tests/fuzzseed_%: $(B)/obj/tests/fuzz/fuzz_%.o \
    $(B)/obj/tests/fuzz/standalone.o $(BROKER_A) $(COMMON_A)
	@mkdir -p $(dir $@)
	@echo "  LD      $@"
	$(Q)$(CC) -o $@ $^ $(LDFLAGS_ALL) $(LIBS_ALL)
all: $(FUZZ_SEED_BIN)
