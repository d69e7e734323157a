/*
 * dp_state.c - owns gmb-device-plugin's state file, STATE_DIR/state: the
 * GPUs it advertised (with the capacity each broker last said, so that a
 * broker that is down at the plugin's start is still listed, unhealthy)
 * and every allocation whose tenant it made and has not removed yet.  The
 * token itself is never in it, only its SHA-256: the token lives in
 * STATE_DIR/tokens/NAME, the file the pod's container mounts.
 *
 * A token file is readable by every uid (the container's uid may be any),
 * so what keeps it is that tokens/ cannot be listed (0711) and that NAME is
 * a secret: the SHA-256 of the token's SHA-256, which only the state file
 * and the broker's memory hold.  It used to be the tenant's name, which
 * `gmbctl tenants`, the broker's metrics (a label) and log, and the pod's
 * environment all show: anyone on the node could read any pod's token.
 * The state directory and tokens/ must be this uid's or root's and
 * writable by no one else, or the plugin does not start: whoever could
 * write there could plant tokens/ and read every token put in it.
 *
 * The file is text, one record a line:
 *   gpu KEY CAPACITY
 *   alloc TENANT GPUKEY QUOTA RESERVE SHA256 MADE GONE UNIT,UNIT,...
 * It is written whole, to a temporary file that is synced and renamed over
 * the old one, so a crash leaves the old state or the new, never half.  A
 * line that does not read stops the load with its number: the plugin
 * refuses to start rather than forget tenants it made.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "dp.h"
#include "util.h"

char *dp_token_path(const struct dp *dp, const uint8_t sha256[32], char *buf,
                    size_t cap) {
  static const char tag[] = "gmb-device-plugin token file\n";
  char in[sizeof tag - 1 + 32];
  uint8_t name[32];
  memcpy(in, tag, sizeof tag - 1);
  memcpy(in + sizeof tag - 1, sha256, 32);
  char hex[65];
  if (gmb__admin_token_sha256(in, sizeof in, name) != 0) {
    /* No digest: a name no file has, so nothing is written or mounted. */
    snprintf(buf, cap, "%s/tokens/.no-digest", dp->conf.state_dir);
    return buf;
  }
  for (int i = 0; i < 32; i++) snprintf(hex + 2 * i, 3, "%02x", name[i]);
  snprintf(buf, cap, "%s/tokens/%s", dp->conf.state_dir, hex);
  return buf;
}

void dp_token_unlink(const struct dp *dp, const struct dp_alloc *a) {
  char path[DP_PATH_MAX + 96];
  unlink(dp_token_path(dp, a->sha256, path, sizeof path));
  /* An earlier version's file, named after the tenant. */
  snprintf(path, sizeof path, "%s/tokens/%s", dp->conf.state_dir, a->tenant);
  unlink(path);
}

/* `path` is a directory (not a link) of this uid or root that no one else
 * may write; with `private`, one no one else may list either, made so when
 * only its read bits are wrong.  0, or -1 with why. */
static int dp_dir_own(const char *path, int private, char *why, size_t cap) {
  struct stat st;
  if (lstat(path, &st) != 0) {
    snprintf(why, cap, "cannot read %s: %s", path, strerror(errno));
    return -1;
  }
  if (!S_ISDIR(st.st_mode) || (st.st_uid != geteuid() && st.st_uid != 0) ||
      (st.st_mode & 022)) {
    snprintf(why, cap, "%s: not a directory of this uid or root, writable "
             "by no one else (%s, owner uid %u, mode %04o)", path,
             S_ISLNK(st.st_mode) ? "a symbolic link" :
             S_ISDIR(st.st_mode) ? "a directory" : "not a directory",
             (unsigned)st.st_uid, (unsigned)(st.st_mode & 07777));
    return -1;
  }
  if (private && (st.st_mode & 044)) {
    if (chmod(path, 0711) != 0) {
      snprintf(why, cap, "chmod 0711 %s: %s", path, strerror(errno));
      return -1;
    }
    dp_log("%s could be listed by other uids (mode %04o): now 0711", path,
           (unsigned)(st.st_mode & 07777));
  }
  return 0;
}

int dp_state_dir_check(const struct dp *dp, char *why, size_t cap) {
  char tokens[DP_PATH_MAX + 16];
  snprintf(tokens, sizeof tokens, "%s/tokens", dp->conf.state_dir);
  if (dp_dir_own(dp->conf.state_dir, 0, why, cap) != 0) return -1;
  if (mkdir(tokens, 0711) != 0 && errno != EEXIST) {
    snprintf(why, cap, "mkdir %s: %s", tokens, strerror(errno));
    return -1;
  }
  return dp_dir_own(tokens, 1, why, cap);
}

int dp_state_save(const struct dp *dp, char *why, size_t cap) {
  char path[DP_PATH_MAX + 16], tmp[DP_PATH_MAX + 32];
  snprintf(path, sizeof path, "%s/state", dp->conf.state_dir);
  snprintf(tmp, sizeof tmp, "%s/.state.tmp", dp->conf.state_dir);
  int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW,
                0600);
  if (fd < 0) {
    snprintf(why, cap, "cannot write %s: %s", tmp, strerror(errno));
    return -1;
  }
  FILE *f = fdopen(fd, "w");
  if (f == NULL) {
    close(fd);
    snprintf(why, cap, "cannot write %s: %s", tmp, strerror(errno));
    return -1;
  }
  fprintf(f, "# gmb-device-plugin state, version 1: written by the plugin, "
          "do not edit\n");
  for (size_t g = 0; g < dp->n_gpu; g++)
    if (dp->gpu[g].capacity)
      fprintf(f, "gpu %s %llu\n", dp->gpu[g].key,
              (unsigned long long)dp->gpu[g].capacity);
  for (size_t i = 0; i < dp->n_allocs; i++) {
    const struct dp_alloc *a = &dp->allocs[i];
    fprintf(f, "alloc %s %s %llu %llu ", a->tenant, dp->gpu[a->gpu].key,
            (unsigned long long)a->quota, (unsigned long long)a->reserve);
    for (int k = 0; k < 32; k++) fprintf(f, "%02x", a->sha256[k]);
    fprintf(f, " %lld %d ", (long long)a->made, a->gone);
    for (uint32_t k = 0; k < a->n_units; k++)
      fprintf(f, "%s%u", k ? "," : "", a->units[k]);
    fputc('\n', f);
  }
  int bad = fflush(f) != 0 || fsync(fd) != 0;
  bad |= fclose(f) != 0;
  if (bad || rename(tmp, path) != 0) {
    snprintf(why, cap, "cannot write %s: %s", path, strerror(errno));
    unlink(tmp);
    return -1;
  }
  return 0;
}

static int dp_hex32(const char *s, uint8_t out[32]) {
  if (strlen(s) != 64) return -1;
  for (int i = 0; i < 32; i++) {
    unsigned v;
    if (sscanf(s + 2 * i, "%2x", &v) != 1) return -1;
    out[i] = (uint8_t)v;
  }
  return 0;
}

static int dp_units_parse(char *s, struct dp_alloc *a) {
  size_t n = 1;
  for (char *p = s; *p; p++) n += *p == ',';
  if (n > DP_UNITS_MAX) return -1;
  a->units = calloc(n, sizeof *a->units);
  if (a->units == NULL) return -1;
  char *save = NULL;
  for (char *t = strtok_r(s, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
    char *end;
    unsigned long v = strtoul(t, &end, 10);
    if (*end || v >= DP_UNITS_MAX || a->n_units >= n) return -1;
    a->units[a->n_units++] = (uint32_t)v;
  }
  return a->n_units ? 0 : -1;
}

static int dp_state_line(struct dp *dp, char *line) {
  char kind[8], key[DP_KEY_MAX], tenant[64], hash[72];
  unsigned long long cap, quota, reserve;
  long long made;
  int gone;
  if (sscanf(line, "%7s", kind) != 1) return 0; /* blank */
  if (strcmp(kind, "gpu") == 0) {
    if (sscanf(line, "gpu %63s %llu", key, &cap) != 2) return -1;
    int g = dp_gpu_get(dp, key);
    if (g < 0) return -1;
    dp->gpu[g].capacity = cap;
    dp->gpu[g].units = (uint32_t)(cap / dp->conf.unit > DP_UNITS_MAX
                                      ? DP_UNITS_MAX
                                      : cap / dp->conf.unit);
    return 0;
  }
  if (strcmp(kind, "alloc") != 0) return -1;
  static char ubuf[8 * DP_UNITS_MAX];
  if (sscanf(line, "alloc %63s %63s %llu %llu %71s %lld %d %16383s", tenant,
             key, &quota, &reserve, hash, &made, &gone, ubuf) != 8)
    return -1;
  if (!gmb__name_valid(tenant) || dp->n_allocs >= DP_ALLOCS_MAX) return -1;
  struct dp_alloc a = {0};
  snprintf(a.tenant, sizeof a.tenant, "%s", tenant);
  a.gpu = dp_gpu_get(dp, key);
  a.quota = quota;
  a.reserve = reserve;
  a.made = (time_t)made;
  a.gone = gone != 0;
  if (a.gpu < 0 || dp_hex32(hash, a.sha256) || dp_units_parse(ubuf, &a)) {
    free(a.units);
    return -1;
  }
  if (dp->n_allocs == dp->cap_allocs) {
    size_t nc = dp->cap_allocs ? 2 * dp->cap_allocs : 16;
    struct dp_alloc *na = realloc(dp->allocs, nc * sizeof *na);
    if (na == NULL) {
      free(a.units);
      return -1;
    }
    dp->allocs = na;
    dp->cap_allocs = nc;
  }
  dp->allocs[dp->n_allocs++] = a;
  return 0;
}

int dp_state_load(struct dp *dp, char *why, size_t cap) {
  char path[DP_PATH_MAX + 16];
  snprintf(path, sizeof path, "%s/state", dp->conf.state_dir);
  int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) {
    if (errno == ENOENT) return 0;
    snprintf(why, cap, "cannot read %s: %s", path, strerror(errno));
    return -1;
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) ||
      (st.st_uid != geteuid() && st.st_uid != 0) || (st.st_mode & 022)) {
    close(fd);
    snprintf(why, cap, "%s: not a regular file of this uid or root, "
             "writable by no one else", path);
    return -1;
  }
  FILE *f = fdopen(fd, "r");
  if (f == NULL) {
    close(fd);
    snprintf(why, cap, "cannot read %s: %s", path, strerror(errno));
    return -1;
  }
  char *line = NULL;
  size_t lcap = 0;
  unsigned no = 0;
  int rc = 0;
  while (getline(&line, &lcap, f) >= 0) {
    no++;
    if (line[0] == '#') continue;
    if (dp_state_line(dp, line) != 0) {
      snprintf(why, cap, "%s:%u: not a state line this plugin wrote", path,
               no);
      rc = -1;
      break;
    }
  }
  free(line);
  fclose(f);
  return rc;
}
