# mk/soak.mk - `make soak SOAK_SECONDS=N` (default 60): the soak with
# faults (tests/soak/soak.c), a real broker and client processes on the
# host device with kill -9, SIGSTOP, evictions, reloads, operators'
# pauses and resumes and broker restarts, while the clients pause and
# resume a tag and the broker offloads idle ones; it prints operations,
# faults and pauses per kind and fails on any violation.  Not part of
# `all` or `check`; CI runs a short round.

SOAK_SECONDS ?= 60
SOAK_BIN := $(B)/soak/soak
$(B)/obj/tests/soak/%.o: INC = $(LIB_INC) -Itests/integration

$(SOAK_BIN): $(B)/obj/tests/soak/soak.o $(HARNESS_OBJ) $(LIB_A)
	@mkdir -p $(dir $@)
	@echo "  LD      $@"
	$(Q)$(CC) -o $@ $^ $(LDFLAGS_ALL) $(CHECK_LIBS) $(LIBS_ALL)

.PHONY: soak
soak: $(SOAK_BIN) $(BROKER_BIN) $(CTL_BIN)
	$(Q)GMB_BUILD_DIR=$(B) SOAK_SECONDS=$(SOAK_SECONDS) CK_FORK=no \
	  CK_DEFAULT_TIMEOUT=$$(($(SOAK_SECONDS) + 300)) $(SOAK_BIN)
