# mk/spank.mk - the Slurm SPANK plugin gmb_spank.so (client/spank/,
# docs/slurm.md), built when Slurm's spank.h is installed (Debian:
# libslurm-dev), and its unit test, built always (step.c needs no Slurm).
#
# The plugin speaks only the admin protocol, as gmbctl does: it links the
# admin client and the shared code, no libgmb.  It is loaded by slurmstepd
# and srun, which provide the Slurm symbols it calls (slurm_load_job,
# slurm_get_job_steps): it does not link libslurm, as Slurm asks of
# plugins.  Only its SPANK entry points are exported (gmb_spank.c is built
# with default visibility; everything it links keeps it hidden).

SPANK_H ?= /usr/include/slurm/spank.h
SPANK_STEP_SRC := client/spank/step.c
SPANK_SRC := client/spank/gmb_spank.c
SPANK_SO := $(B)/gmb_spank.so

$(B)/obj/client/spank/%.o: INC = -Iinclude -Iproto -Iclient/admin \
  -Iclient/spank
$(call obj,$(SPANK_SRC)): VIS = -fvisibility=default
$(B)/obj/tests/unit/check_spank_step.o: INC = -Iinclude -Iproto -Iclient/spank
$(eval $(call link,$(B)/tests/check_spank_step,$(B)/obj/tests/unit/check_spank_step.o,$(call obj,$(SPANK_STEP_SRC)) $(COMMON_A)))

ifneq ($(wildcard $(SPANK_H)),)
all: $(SPANK_SO)
$(SPANK_SO): $(call obj,$(SPANK_SRC) $(SPANK_STEP_SRC) client/admin/admin_rpc.c) \
  $(COMMON_A)
	@echo "  LD      $@"
	$(Q)$(CC) -shared -o $@ $^ $(LDFLAGS_ALL) -Wl,--as-needed $(LIBS_ALL)
endif
