# mk/tools.mk - the programs beside the library: gmbctl (client/gmbctl/),
# gmb-replay (client/replay/) and the examples (client/examples/).
#
# gmbctl speaks only the admin protocol, so it links the shared code and
# no client library; gmb-replay's children are clients, so it links
# libgmb.  Both reach the admin socket through one module, client/admin/.
# The examples include gmb.h alone, as a user's program would
# (tests/install.sh builds them against the installed library).

CTL_SRC := client/gmbctl/gmbctl.c client/gmbctl/ctl_admin.c \
  client/gmbctl/ctl_snapshot.c client/gmbctl/ctl_view.c
REPLAY_SRC := client/replay/replay.c
ADMIN_SRC := client/admin/admin_rpc.c
EXAMPLE_SRC := client/examples/job.c client/examples/frag.c

$(B)/obj/client/admin/%.o: INC = -Iinclude -Iproto -Iclient/admin
$(B)/obj/client/gmbctl/%.o: INC = -Iinclude -Iproto -Iclient/admin \
  -Iclient/gmbctl
$(B)/obj/client/replay/%.o: INC = -Iinclude -Iproto -Iclient/admin \
  -Iclient/replay
$(B)/obj/client/examples/%.o: INC = -Iinclude

REPLAY_BIN := $(B)/gmb-replay
EXAMPLE_BIN := $(patsubst client/examples/%.c,$(B)/examples/%,$(EXAMPLE_SRC))

all: $(CTL_BIN) $(REPLAY_BIN) $(EXAMPLE_BIN)

$(CTL_BIN): $(call obj,$(CTL_SRC) $(ADMIN_SRC)) $(COMMON_A)
	@echo "  LD      $@"
	$(Q)$(CC) -o $@ $^ $(LDFLAGS_ALL) $(LIBS_ALL)

# The trace replayer (DESIGN.md "Trace format"), a client like gmbctl.
$(REPLAY_BIN): $(call obj,$(REPLAY_SRC) $(ADMIN_SRC)) $(LIB_A)
	@echo "  LD      $@"
	$(Q)$(CC) -o $@ $^ $(LDFLAGS_ALL) $(LIBS_ALL)

$(B)/examples/%: $(B)/obj/client/examples/%.o $(LIB_A)
	@mkdir -p $(dir $@)
	@echo "  LD      $@"
	$(Q)$(CC) -o $@ $^ $(LDFLAGS_ALL) $(LIBS_ALL)
