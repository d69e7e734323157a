/*
 * fuzz_replay.c - libFuzzer target: gmb-replay's trace parser
 * (client/replay/replay.c, rp_trace_load) and the three baselines it
 * computes from a trace alone (rp_baselines), on any bytes as the trace.
 *
 * replay.c is included here without its main (GMB_REPLAY_NO_MAIN), so the
 * parser is tested as the tool runs it.  Invariants: a trace that loads
 * has a capacity and a tenant, and every operation names a tenant and a
 * key that exist, of its tenant; one that does not load was refused with
 * the usage status (2); the baselines never count more failures than
 * operations.
 */
#define GMB_REPLAY_NO_MAIN 1
#include "replay.c"

#include "fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t len);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t len) {
  struct rp_trace tr;
  memset(&tr, 0, sizeof tr);
  int rc = rp_trace_load(fz_file(data, len), &tr);
  if (rc == 0) {
    FZ_ASSERT(tr.capacity > 0);
    FZ_ASSERT(tr.n_tenants > 0 && tr.n_tenants <= RP_TENANTS_MAX);
    for (size_t i = 0; i < tr.n_ops; i++) {
      const struct rp_op *op = &tr.ops[i];
      FZ_ASSERT(op->kind >= RP_ALLOC && op->kind <= RP_UNLOCK);
      FZ_ASSERT(op->tenant < tr.n_tenants);
      FZ_ASSERT(op->key < tr.n_keys);
      FZ_ASSERT(tr.keys[op->key].tenant == op->tenant);
      FZ_ASSERT(op->kind != RP_ALLOC || op->size > 0);
    }
    struct rp_figures fg;
    memset(&fg, 0, sizeof fg);
    rp_baselines(&tr, &fg);
    FZ_ASSERT(fg.base_static.failures <= tr.n_ops);
    FZ_ASSERT(fg.base_shared.failures <= tr.n_ops);
    FZ_ASSERT(fg.base_paged.failures <= tr.n_ops);
  } else {
    FZ_ASSERT(rc == RP_EXIT_USAGE);
  }
  rp_trace_free(&tr);
  return 0;
}
