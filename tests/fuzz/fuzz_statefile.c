/*
 * fuzz_statefile.c - libFuzzer target: the state file's parser and its
 * application to the tenants (broker/statefile.c), on any bytes as the
 * file.
 *
 * One broker core lives for the whole run (a 64 MiB host device and two
 * configured tenants); each input gets a fresh tenant registry on it, the
 * state file is loaded into it as at start-up, and then the registry must
 * pass its consistency check (gmb__core_check) and every tenant the file
 * named with a value must exist with the file's values.  A load that fails must say
 * why.  The bytes go to a regular file of the fuzzer's own, mode 0600: the
 * broker refuses a state file reached through a symbolic link (as
 * /proc/self/fd/N is), so fz_file's memfd would test only the refusal.
 */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "broker.h"
#include "config.h"
#include "core.h"
#include "fuzz.h"
#include "gmb.h"
#include "log.h"
#include "statefile.h"
#include "tenant.h"

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t len);

static struct gmb_broker fz_b;

static void fz_named(void *ctx, const char *name) {
  struct gmb_broker *b = ctx;
  uint64_t q, r;
  int has_q = gmb__statefile_lookup(b, name, GMB_STATE_QUOTA, &q) == 1;
  int has_r = gmb__statefile_lookup(b, name, GMB_STATE_RESERVE, &r) == 1;
  if (!has_q && !has_r) return; /* an empty section sets nothing */
  struct gmb_tenant *t = gmb__tenant_find(b->tenants, name);
  FZ_ASSERT(t != NULL);
  if (has_q) FZ_ASSERT(t->quota == q);
  if (has_r) FZ_ASSERT(t->reserve == r);
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc;
  (void)argv;
  gmb__log_set_level(GMB_LOG_ERROR);
  struct gmb_broker *b = &fz_b;
  gmb__config_defaults(&b->cfg);
  snprintf(b->cfg.device, sizeof b->cfg.device, "host:64MiB");
  b->cfg.tenants = calloc(2, sizeof *b->cfg.tenants);
  FZ_ASSERT(b->cfg.tenants != NULL);
  b->cfg.n_tenants = 2;
  snprintf(b->cfg.tenants[0].name, 64, "llm-a");
  b->cfg.tenants[0].quota = 32u << 20;
  snprintf(b->cfg.tenants[1].name, 64, "batch");
  b->cfg.tenants[1].reserve = 8u << 20;
  b->flag_log_level = -1;
  char err[512];
  FZ_ASSERT(gmb__core_open(b, err, sizeof err) == 0);
  return 0;
}

/* Writes the input as a state file the broker trusts; returns its path. */
static const char *fz_state_file(const uint8_t *data, size_t len) {
  static char path[64];
  if (path[0] == '\0') {
    char dir[] = "/tmp/gmb-fuzz-state-XXXXXX";
    FZ_ASSERT(mkdtemp(dir) != NULL);
    snprintf(path, sizeof path, "%s/state", dir);
  }
  int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  FZ_ASSERT(fd >= 0);
  size_t done = 0;
  while (done < len) {
    ssize_t w = write(fd, data + done, len - done);
    FZ_ASSERT(w > 0);
    done += (size_t)w;
  }
  FZ_ASSERT(close(fd) == 0);
  return path;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t len) {
  struct gmb_broker *b = &fz_b;
  struct gmb_tenants *keep = b->tenants;
  b->tenants = gmb__tenants_new(b->pool, &b->cfg);
  FZ_ASSERT(b->tenants != NULL);
  snprintf(b->cfg.state, sizeof b->cfg.state, "%s", fz_state_file(data, len));
  char err[1024];
  err[0] = '\0';
  int rc = gmb__statefile_load(b, err, sizeof err);
  if (rc == 0)
    gmb__statefile_each(b, fz_named, b);
  else
    FZ_ASSERT(err[0] != '\0');
  FZ_ASSERT(gmb__core_check(b) == 0);
  gmb__tenants_destroy(b->tenants);
  gmb__statefile_free(b->statefile);
  b->statefile = NULL;
  b->tenants = keep;
  return 0;
}
