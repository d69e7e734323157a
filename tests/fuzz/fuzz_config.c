/*
 * fuzz_config.c - libFuzzer target: the broker's config parser
 * (broker/config.c), on any bytes as the file.
 *
 * Invariants: loading either succeeds with every string terminated and
 * every count within its array, or fails with GMB_E_INVAL and a reason;
 * nothing leaks either way (ASan).
 */
#include <string.h>

#include "config.h"
#include "fuzz.h"
#include "gmb.h"
#include "log.h"
#include "util.h"

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t len);

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc;
  (void)argv;
  gmb__log_set_level(GMB_LOG_ERROR);
  return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t len) {
  const char *path = fz_file(data, len);
  struct gmb_config c;
  gmb__config_defaults(&c);
  char err[1024];
  err[0] = '\0';
  int rc = gmb__config_load(path, &c, err, sizeof err);
  if (rc == 0) {
    FZ_ASSERT(fz_terminated(c.device, sizeof c.device));
    FZ_ASSERT(fz_terminated(c.run_dir, sizeof c.run_dir));
    FZ_ASSERT(fz_terminated(c.state, sizeof c.state));
    FZ_ASSERT(fz_terminated(c.metrics_listen, sizeof c.metrics_listen));
    FZ_ASSERT(c.n_admin_uids <= GMB_CONFIG_UIDS_MAX);
    FZ_ASSERT(c.n_tenants == 0 || c.tenants != NULL);
    for (size_t i = 0; i < c.n_tenants; i++) {
      const struct gmb_tenant_conf *t = &c.tenants[i];
      FZ_ASSERT(fz_terminated(t->name, sizeof t->name));
      FZ_ASSERT(gmb__name_valid(t->name));
      FZ_ASSERT(t->n_uids <= GMB_CONFIG_UIDS_MAX);
      FZ_ASSERT(gmb__config_tenant(&c, t->name) == t);
    }
  } else {
    FZ_ASSERT(rc == GMB_E_INVAL || rc == GMB_E_SYSTEM);
    FZ_ASSERT(err[0] != '\0');
  }
  gmb__config_free(&c);
  return 0;
}
