# mk/k8s.mk - gmb-device-plugin (client/k8s/), the Kubernetes node
# component: the kubelet's device-plugin API v1beta1 and pod-resources v1
# over gRPC (gRPC's C core, libgrpc-dev as Debian 12 ships it: 1.51), the
# brokers over their admin sockets through client/admin/, as gmbctl.
#
# The .proto files are ours (client/k8s/*.proto, written from the published
# API); protoc-c compiles them into $(B)/gen/k8s/, and the test kubelet
# (tests/k8s/) reads the same files as a descriptor set.

DP_SRC := client/k8s/dp_main.c client/k8s/dp_plugin.c client/k8s/dp_state.c \
  client/k8s/dp_grpc.c
DP_PROTOS := client/k8s/deviceplugin.proto client/k8s/podresources.proto
DP_SERVICE_PROTO := client/k8s/deviceplugin_service.proto
DP_GEN_C := $(patsubst client/k8s/%.proto,$(B)/gen/k8s/%.pb-c.c,$(DP_PROTOS))
DP_GEN_H := $(DP_GEN_C:.c=.h)
DP_GEN_OBJ := $(patsubst $(B)/gen/k8s/%.c,$(B)/obj/gen/k8s/%.o,$(DP_GEN_C))
DP_BIN := $(B)/gmb-device-plugin
DP_DESC := $(B)/gen/k8s/kubelet.desc
GRPC_CFLAGS = $(shell pkg-config --cflags grpc 2>/dev/null)
GRPC_LIBS = $(shell pkg-config --libs grpc 2>/dev/null)

$(B)/obj/client/k8s/%.o: INC = -Iinclude -Iproto -Iclient/admin -Iclient/k8s \
  -I$(B)/gen/k8s $(GRPC_CFLAGS)
$(call obj,$(DP_SRC)): | $(DP_GEN_H)

# protoc-c compiles the messages to C, and writes the descriptor set of
# every file (services too) that the test kubelet loads (a grouped target).
$(DP_GEN_C) $(DP_GEN_H) $(DP_DESC) &: $(DP_PROTOS) $(DP_SERVICE_PROTO) | deps
	@mkdir -p $(B)/gen/k8s
	@echo "  PROTOC  $(DP_PROTOS) $(DP_SERVICE_PROTO)"
	$(Q)protoc-c --proto_path=client/k8s --c_out=$(B)/gen/k8s \
	  $(notdir $(DP_PROTOS))
	$(Q)protoc-c --proto_path=client/k8s --descriptor_set_out=$(DP_DESC) \
	  --include_imports $(notdir $(DP_PROTOS) $(DP_SERVICE_PROTO))

$(B)/obj/gen/k8s/%.o: $(B)/gen/k8s/%.c
	@mkdir -p $(dir $@)
	@echo "  CC      $<"
	$(Q)$(CC) $(filter-out -Wshadow -Wstrict-prototypes,$(CFLAGS_ALL)) \
	  -I$(B)/gen/k8s -c $< -o $@

$(DP_BIN): $(call obj,$(DP_SRC) client/admin/admin_rpc.c) $(DP_GEN_OBJ) $(COMMON_A)
	@echo "  LD      $@"
	$(Q)$(CC) -o $@ $^ $(LDFLAGS_ALL) $(GRPC_LIBS) $(LIBS_ALL)

all: $(DP_BIN)

# The test kubelet: Python with Debian's python3-grpcio, on the same .proto
# files, against real brokers on the fake CUDA driver (tests/k8s/).
K8S_CHECKS := tests/k8s/device_plugin.sh
check: $(DP_BIN)
