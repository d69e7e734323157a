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
 *
 * The untrusted owner.  An input whose first byte is 1 to 5 is a file the
 * broker must not trust, the rest of the input its bytes: 1 owned by
 * another uid (65534; as root only, else it is 2), 2 group-writable
 * (0620), 3 writable by others (0602), 4 a symbolic link to the file,
 * 5 a hard link to it owned by another uid (as root only, else 3).  Then
 * the load must be refused with a reason, no tenant may change (the
 * configured values stay, no tenant is made) and the reason must be the
 * one an empty file of that kind gets (nothing of the bytes in it, nor
 * anything that depends on them): a planted file
 * (a link to /etc/shadow) must neither command the broker nor reach its
 * log.  Any other first byte: the whole input is a trusted file, as
 * before.
 */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
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

/* The fuzzer's scratch directory, made once. */
static const char *fz_dir(void) {
  static char dir[] = "/tmp/gmb-fuzz-state-XXXXXX";
  static int made;
  if (!made) {
    FZ_ASSERT(mkdtemp(dir) != NULL);
    made = 1;
  }
  return dir;
}

/* Writes the input as a state file, trusted (kind 0) or of an untrusted
 * kind (1-5, above); returns the path the broker is given. */
static const char *fz_state_file(const uint8_t *data, size_t len, int kind) {
  static char path[96], real[96];
  snprintf(path, sizeof path, "%s/state", fz_dir());
  snprintf(real, sizeof real, "%s/real", fz_dir());
  unlink(path);
  unlink(real);
  int fd = open(kind == 4 || kind == 5 ? real : path,
                O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  FZ_ASSERT(fd >= 0);
  size_t done = 0;
  while (done < len) {
    ssize_t w = write(fd, data + done, len - done);
    FZ_ASSERT(w > 0);
    done += (size_t)w;
  }
  if (kind == 1 || kind == 5) FZ_ASSERT(fchown(fd, 65534, 65534) == 0);
  if (kind == 2) FZ_ASSERT(fchmod(fd, 0620) == 0);
  if (kind == 3) FZ_ASSERT(fchmod(fd, 0602) == 0);
  FZ_ASSERT(close(fd) == 0);
  if (kind == 4) FZ_ASSERT(symlink(real, path) == 0);
  if (kind == 5) FZ_ASSERT(link(real, path) == 0);
  return path;
}

/* The trust kind an input asks for (0: trusted) and where its file's
 * bytes start.  Another owner needs root; without it the nearest kind
 * that needs none stands in. */
static int fz_kind(const uint8_t *data, size_t len, size_t *skip) {
  *skip = 0;
  if (len == 0 || data[0] < 1 || data[0] > 5) return 0;
  *skip = 1;
  int kind = data[0];
  if (geteuid() != 0 && kind == 1) kind = 2;
  if (geteuid() != 0 && kind == 5) kind = 3;
  return kind;
}

/* Tenants as configured: llm-a with its quota, batch with its
 * reservation, and no other. */
static void fz_as_configured(struct gmb_broker *b) {
  FZ_ASSERT(gmb__tenants_count(b->tenants) == 2);
  struct gmb_tenant *a = gmb__tenant_find(b->tenants, "llm-a");
  struct gmb_tenant *t = gmb__tenant_find(b->tenants, "batch");
  FZ_ASSERT(a != NULL && t != NULL);
  FZ_ASSERT(a->quota == (32u << 20) && a->reserve == 0);
  FZ_ASSERT(t->quota == 0 && t->reserve == (8u << 20));
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t len) {
  struct gmb_broker *b = &fz_b;
  struct gmb_tenants *keep = b->tenants;
  b->tenants = gmb__tenants_new(b->pool, &b->cfg);
  FZ_ASSERT(b->tenants != NULL);
  size_t skip;
  int kind = fz_kind(data, len, &skip);
  snprintf(b->cfg.state, sizeof b->cfg.state, "%s",
           fz_state_file(data + skip, len - skip, kind));
  char err[1024];
  err[0] = '\0';
  int rc = gmb__statefile_load(b, err, sizeof err);
  if (kind != 0) {
    FZ_ASSERT(rc == GMB_E_AUTH && err[0] != '\0');
    fz_as_configured(b);
    /* The reason is the one an empty file of that kind gets: it says
     * nothing of the bytes. */
    gmb__statefile_free(b->statefile);
    b->statefile = NULL;
    char empty[sizeof err];
    empty[0] = '\0';
    fz_state_file(data, 0, kind);
    FZ_ASSERT(gmb__statefile_load(b, empty, sizeof empty) == GMB_E_AUTH);
    FZ_ASSERT(strcmp(err, empty) == 0);
    fz_as_configured(b);
  } else if (rc == 0) {
    gmb__statefile_each(b, fz_named, b);
  } else {
    FZ_ASSERT(err[0] != '\0');
  }
  FZ_ASSERT(gmb__core_check(b) == 0);
  gmb__tenants_destroy(b->tenants);
  gmb__statefile_free(b->statefile);
  b->statefile = NULL;
  b->tenants = keep;
  return 0;
}
