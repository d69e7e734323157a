/*
 * replay.c - gmb-replay: replays an allocation trace through a real broker
 * and counts what failed, and why.
 *
 *   gmb-replay --trace FILE [--compaction off|auto] [--cache] [--json]
 *              [--series FILE] [--broker PATH] [--verbose]
 *
 * The trace format is DESIGN.md's ("Trace format"): `capacity SIZE`,
 * `quota TENANT SIZE`, `alloc TENANT KEY SIZE [movable]`, `free TENANT KEY`,
 * `lock TENANT KEY`, `unlock TENANT KEY`, `#` comments.  The whole trace is
 * parsed and checked first (a KEY allocated twice, freed while locked, or
 * used before it was allocated is an error at FILE:LINE, exit 2), so that a
 * replay never stops half-way for a mistake in its input.
 *
 * Processes.  The replayer starts a gmb-broker on host:CAPACITY in a private
 * run dir with a config it writes (one [tenant:T] per quota line, and
 * `compaction = off|auto`), then forks one client process per tenant, each
 * with its own session (gmb_connect as that tenant), so tenants are as
 * separate as real jobs.  The parent walks the trace in order and hands each
 * operation to its tenant's child over a pipe, then waits for the result:
 * the broker sees exactly the trace's order, one request at a time.  Only
 * after the children exist does the parent open its own ZeroMQ context (for
 * AdminStatus on the admin socket): a ZeroMQ context must not cross fork().
 *
 * What is counted.  A failure is any operation the library refused.  A
 * fragmentation failure is a GMB_E_NOMEM while the free total - capacity
 * minus the rounded bytes of the live allocations, which the replayer tracks
 * itself - was at least the rounded request: memory was there, just not in
 * one piece the broker could use.  An operation on a KEY whose alloc failed
 * is skipped (counted apart, never sent).  Of the fragmentation failures,
 * the page-bound ones are those that no allocator keeping each tenant in
 * 2 MiB pages of its own could have served (rp_page_bound).  Bytes moved
 * and compaction time come from the broker's own totals (AdminStatus) at
 * the end.  Three baselines are computed from the trace alone, with a
 * perfect allocator: static slices of the device per tenant, one shared
 * pool with quotas and no fragmentation (the floor), and that pool with
 * each tenant in 2 MiB pages of its own (the paged floor) (rp_baselines).
 *
 * The cache (--cache).  Each child then allocates with gmb_malloc_async
 * and frees with gmb_free_async on one stream (the legacy one; the host
 * device ignores streams), as the torch allocator and cudaMallocAsync do:
 * its session's cache serves the trace, mapping 2 MiB pages from the
 * broker on a miss.  Blocks are pinned, so `movable` means nothing and
 * lock/unlock are no-ops (counted, never failing); compaction cannot move
 * the caches' pages.  Each answer carries the cache's figures
 * (gmb_cache_stats_get, no message), so the replay knows each tenant's
 * bytes held in pages along the trace; the peak of the bytes all caches
 * hold at one moment (rp_cache_peak: the other tenants' figures are read
 * again whenever their last answers would set a new peak) beside the peak
 * in use says what the cache costs in memory, and its hits and misses
 * what it saves in broker requests (one per alloc and per free without
 * it; with it, a page mapped on a miss and a page given back).  The
 * accounting check compares the broker's bytes for each tenant with the
 * pages its cache holds.  A GMB_E_NOMEM while other tenants' caches hold
 * the free memory counts as a fragmentation failure: the free total
 * includes cached memory, which the broker can ask back.  The replay is
 * reproducible: a child answers only after gmb_cache_report (the broker
 * has its cache's figures, and any ask for pages sent to it is answered),
 * and after an alloc that reached the broker every other child reports
 * too (rp_child_cached), so no operation races a library thread's report
 * or answer; the broker's trim_wait_ms is at its maximum, so that no hold
 * runs out on a starved machine.  The broker's release of emptied
 * segments kept for reuse is off (segment_linger_ms = 0: they go back when
 * a request needs their room), so where that timer fell between two
 * operations no longer depends on the machine's speed: compaction off is
 * reproducible too.  (auto still runs its background compaction on a
 * timer.)
 *
 * Integrity.  Each allocation of 24 bytes or more gets three 8-byte stamps
 * (start, middle, end) written through gmb_lock when it is made; they are
 * checked when it is freed and, for what is still live, at the end.  A
 * compaction that moved an allocation without its bytes shows up as a
 * corrupted allocation, and the replay exits 1: that is a bug, not a figure.
 *
 * Exit status: 0 the replay ran (failures are figures, not errors); 1 the
 * broker or a client could not run, or bytes were corrupted; 2 usage or a
 * bad trace.
 */
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <limits.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "admin_rpc.h"
#include "gmb.h"
#include "util.h"
#include "wire.h"

#define RP_EXIT_FAIL 1
#define RP_EXIT_USAGE 2
#define RP_ALIGN 512u          /* the broker's rounding (GMB_POOL_ALIGN) */
#define RP_TENANTS_MAX 64
#define RP_SERIES_POINTS 500
#define RP_WAIT_MS 10000       /* broker start, admin replies, stop */
#define RP_SKIPPED 1           /* a result: the op was not sent */
#define RP_SMALL_MAX (UINT64_C(1) << 20) /* the broker's small requests */
#define RP_PAGE (UINT64_C(2) << 20)      /* its segments' granularity */

enum rp_kind {
  RP_ALLOC = 1,
  RP_FREE,
  RP_LOCK,
  RP_UNLOCK,
  RP_VERIFY,
  RP_QUIT,
  RP_STATS /* nothing but the answer's cache figures (--cache: after
              gmb_cache_report) */
};

static const char *const rp_kind_names[] = {"", "alloc", "free", "lock",
                                            "unlock", "verify", "quit",
                                            "stats"};

/* One trace operation; also the command a child reads from its pipe. */
struct rp_op {
  uint32_t kind;
  uint32_t tenant;
  uint32_t key;   /* index into the key table */
  uint32_t flags; /* GMB_MOVABLE */
  uint64_t size;  /* as written in the trace */
  uint32_t line;
};

/* A child's answer. */
struct rp_result {
  int32_t rc; /* 0, RP_SKIPPED, or a GMB_E_* code */
  uint32_t corrupt;
  gmb_cache_stats cache; /* --cache: its figures after the operation */
  uint32_t asked; /* --cache: an alloc that reached the broker (a miss or a
                     refusal), which may have asked the other caches */
  char msg[WIRE_MESSAGE_MAX];
};

struct rp_key {
  char *name; /* "TENANT\0KEY" */
  uint32_t tenant;
  uint32_t hash;
  /* While parsing: 1 when allocated at this point of the trace, and its
   * lock count; at run time (parent): 1 while live. */
  uint8_t live;
  uint32_t locks;
  uint64_t rounded;
};

struct rp_tenant {
  char name[WIRE_NAME_MAX + 1];
  uint64_t quota;
  int has_quota;
  pid_t pid;
  int cmd_w, res_r; /* parent's ends */
};

struct rp_trace {
  uint64_t capacity;
  struct rp_op *ops;
  size_t n_ops, cap_ops;
  struct rp_key *keys;
  size_t n_keys, cap_keys;
  uint32_t *slots; /* open addressing: key index + 1, 0 empty */
  size_t n_slots;
  struct rp_tenant tenants[RP_TENANTS_MAX];
  size_t n_tenants;
};

/* --cache -v: why a refusal happened, from every cache's figures read at
 * the refusal (rp_cache_why). */
enum {
  RP_WHY_QUOTA_CACHED, /* quota: its own cache's free bytes would cover it */
  RP_WHY_QUOTA,        /* quota: bytes in use */
  RP_WHY_IDLE,         /* no memory: idle pages (any cache's) and the
                          device's free room would cover its pages */
  RP_WHY_PARTIAL,      /* no memory: the free bytes lie in pages that hold
                          blocks in use */
  RP_WHY_FULL,         /* no memory: the bytes in use leave no room */
  RP_WHY_N
};
static const char *const rp_why_keys[RP_WHY_N] = {
    "quota_cached", "quota", "idle", "partial", "full"};
static const char *const rp_why_names[RP_WHY_N] = {
    "quota, its own cache's free bytes would cover it",
    "quota, bytes in use",
    "no memory, idle pages and free room would cover it",
    "no memory, free bytes only in pages with blocks in use",
    "no memory, the bytes in use leave no room"};

struct rp_figures {
  uint64_t operations, skipped, failures, quota_failures, nomem_failures,
      fragmentation_failures, other_failures, corrupted;
  uint64_t page_bound_failures; /* of the fragmentation failures */
  uint64_t in_use, peak;
  uint64_t tenant_in_use[RP_TENANTS_MAX];
  /* --cache: each tenant's cache as its last answer had it, the bytes
   * their pages hold in all (each as of its last answer), the peak of the
   * bytes held at one moment (rp_cache_peak), and the requests that would
   * have gone to the broker without the cache (allocs and frees). */
  gmb_cache_stats tenant_cache[RP_TENANTS_MAX];
  uint64_t held, peak_held, uncached_requests;
  /* Per tenant: rounded bytes of live small allocations, and the 2 MiB
   * pages its live large ones take (for the page bound). */
  uint64_t tenant_small[RP_TENANTS_MAX], tenant_large[RP_TENANTS_MAX];
  struct rp_baseline {
    uint64_t failures, quota_failures, nomem_failures;
  } base_static, base_shared, base_paged;
  uint64_t accounting_mismatches; /* tenants whose broker `used` differs */
  struct wire_compact_stats compaction;
  uint64_t final_largest_free, final_in_segments;
  double wall_s;
  char first_frag[WIRE_MESSAGE_MAX + 128];
  /* --cache -v: the refusals by cause (rp_cache_why), each tenant's cache
   * read again at the refusal. */
  uint64_t cache_why[RP_WHY_N];
};

static const char *rp_prog = "gmb-replay";
static volatile sig_atomic_t rp_stop;

static int rp_fail(int code, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

static int rp_fail(int code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "%s: ", rp_prog);
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
  return code;
}

static uint64_t rp_round(uint64_t size) {
  return (size + RP_ALIGN - 1) & ~(uint64_t)(RP_ALIGN - 1);
}

static uint64_t rp_pages(uint64_t bytes) {
  return (bytes + RP_PAGE - 1) & ~(RP_PAGE - 1);
}

/* A request's whole pages of its own and the rest, which shares pages
 * with its tenant's other bytes: as the broker places it (pool.h, rule 1:
 * a large request's tail lies in a small segment), so as a tenant's bytes
 * packed across its own pages are. */
static uint64_t rp_own(uint64_t r) {
  return r > RP_SMALL_MAX ? r & ~(RP_PAGE - 1) : 0;
}

static uint64_t rp_shared(uint64_t r) { return r - rp_own(r); }

/* --- the trace ------------------------------------------------------------ */

static uint32_t rp_hash(const char *t, const char *k) {
  uint32_t h = 2166136261u; /* FNV-1a over "TENANT\0KEY" */
  for (; *t; t++) h = (h ^ (uint8_t)*t) * 16777619u;
  h = (h ^ 0u) * 16777619u;
  for (; *k; k++) h = (h ^ (uint8_t)*k) * 16777619u;
  return h;
}

static int rp_key_grow(struct rp_trace *tr) {
  size_t n = tr->n_slots ? tr->n_slots * 2 : 1024;
  uint32_t *s = calloc(n, sizeof *s);
  if (s == NULL) return -1;
  for (size_t i = 0; i < tr->n_keys; i++) {
    size_t j = tr->keys[i].hash & (n - 1);
    while (s[j]) j = (j + 1) & (n - 1);
    s[j] = (uint32_t)i + 1;
  }
  free(tr->slots);
  tr->slots = s;
  tr->n_slots = n;
  return 0;
}

/* The index of KEY of tenant t, created when `create`; -1 when absent (or
 * out of memory, which the caller cannot tell apart: it then fails later
 * with "never allocated", acceptable for a tool). */
static long rp_key_find(struct rp_trace *tr, uint32_t t, const char *key,
                        int create) {
  const char *tname = tr->tenants[t].name;
  uint32_t h = rp_hash(tname, key);
  size_t tl = strlen(tname);
  if (tr->n_slots) {
    for (size_t j = h & (tr->n_slots - 1); tr->slots[j];
         j = (j + 1) & (tr->n_slots - 1)) {
      struct rp_key *k = &tr->keys[tr->slots[j] - 1];
      if (k->hash == h && k->tenant == t && strcmp(k->name + tl + 1, key) == 0)
        return (long)tr->slots[j] - 1;
    }
  }
  if (!create) return -1;
  if ((tr->n_keys + 1) * 2 > tr->n_slots && rp_key_grow(tr) != 0) return -1;
  if (tr->n_keys == tr->cap_keys) {
    size_t n = tr->cap_keys ? tr->cap_keys * 2 : 1024;
    struct rp_key *k = realloc(tr->keys, n * sizeof *k);
    if (k == NULL) return -1;
    tr->keys = k;
    tr->cap_keys = n;
  }
  struct rp_key *k = &tr->keys[tr->n_keys];
  memset(k, 0, sizeof *k);
  k->name = malloc(tl + strlen(key) + 2);
  if (k->name == NULL) return -1;
  memcpy(k->name, tname, tl + 1);
  strcpy(k->name + tl + 1, key);
  k->tenant = t;
  k->hash = h;
  size_t j = h & (tr->n_slots - 1);
  while (tr->slots[j]) j = (j + 1) & (tr->n_slots - 1);
  tr->slots[j] = (uint32_t)tr->n_keys + 1;
  return (long)tr->n_keys++;
}

static const char *rp_key_str(const struct rp_trace *tr, uint32_t k) {
  const char *n = tr->keys[k].name;
  return n + strlen(n) + 1;
}

static long rp_tenant_find(struct rp_trace *tr, const char *name, int create) {
  for (size_t i = 0; i < tr->n_tenants; i++)
    if (strcmp(tr->tenants[i].name, name) == 0) return (long)i;
  if (!create || tr->n_tenants == RP_TENANTS_MAX) return -1;
  struct rp_tenant *t = &tr->tenants[tr->n_tenants];
  memset(t, 0, sizeof *t);
  snprintf(t->name, sizeof t->name, "%s", name);
  t->cmd_w = t->res_r = -1;
  return (long)tr->n_tenants++;
}

static int rp_push(struct rp_trace *tr, const struct rp_op *op) {
  if (tr->n_ops == tr->cap_ops) {
    size_t n = tr->cap_ops ? tr->cap_ops * 2 : 4096;
    struct rp_op *o = realloc(tr->ops, n * sizeof *o);
    if (o == NULL) return -1;
    tr->ops = o;
    tr->cap_ops = n;
  }
  tr->ops[tr->n_ops++] = *op;
  return 0;
}

#define RP_TRACE_FAIL(...) \
  do {                     \
    rc = rp_fail(RP_EXIT_USAGE, __VA_ARGS__); \
    goto out;              \
  } while (0)

/* Parses and checks the whole trace.  0, or an exit status after saying
 * why at FILE:LINE. */
static int rp_trace_load(const char *path, struct rp_trace *tr) {
  FILE *f = fopen(path, "r");
  if (f == NULL)
    return rp_fail(RP_EXIT_USAGE, "cannot open %s: %s", path, strerror(errno));
  char *line = NULL;
  size_t cap = 0;
  unsigned ln = 0;
  int rc = 0;
  uint8_t started[RP_TENANTS_MAX] = {0}; /* a tenant's first op was seen */
  while (getline(&line, &cap, f) >= 0) {
    ln++;
    char *hash = strchr(line, '#');
    if (hash) *hash = '\0';
    char *w[6];
    int n = 0;
    for (char *tok = strtok(line, " \t\r\n"); tok;
         tok = strtok(NULL, " \t\r\n")) {
      if (n == 6) RP_TRACE_FAIL("%s:%u: too many words", path, ln);
      w[n++] = tok;
    }
    if (n == 0) continue;
    if (strcmp(w[0], "capacity") == 0) {
      if (n != 2) RP_TRACE_FAIL("%s:%u: usage: capacity SIZE", path, ln);
      if (tr->capacity)
        RP_TRACE_FAIL("%s:%u: capacity given twice", path, ln);
      if (tr->n_ops)
        RP_TRACE_FAIL("%s:%u: capacity must come before the operations",
                      path, ln);
      if (gmb__size_parse(w[1], &tr->capacity) != 0 || tr->capacity == 0)
        RP_TRACE_FAIL("%s:%u: bad SIZE '%s' (e.g. 512MiB)", path, ln, w[1]);
      continue;
    }
    if (strcmp(w[0], "quota") == 0) {
      if (n != 3) RP_TRACE_FAIL("%s:%u: usage: quota TENANT SIZE", path, ln);
      if (!gmb__name_valid(w[1]))
        RP_TRACE_FAIL("%s:%u: bad tenant name '%s'", path, ln, w[1]);
      long t = rp_tenant_find(tr, w[1], 1);
      if (t < 0) RP_TRACE_FAIL("%s:%u: more than %d tenants", path, ln,
                               RP_TENANTS_MAX);
      if (started[t] || tr->tenants[t].has_quota)
        RP_TRACE_FAIL("%s:%u: the quota of %s must be given once, before "
                      "its first operation", path, ln, w[1]);
      if (gmb__size_parse(w[2], &tr->tenants[t].quota) != 0)
        RP_TRACE_FAIL("%s:%u: bad SIZE '%s'", path, ln, w[2]);
      tr->tenants[t].has_quota = 1;
      continue;
    }
    struct rp_op op = {.line = ln};
    for (uint32_t k = RP_ALLOC; k <= RP_UNLOCK; k++)
      if (strcmp(w[0], rp_kind_names[k]) == 0) op.kind = k;
    if (op.kind == 0)
      RP_TRACE_FAIL("%s:%u: unknown operation '%s' (want capacity, quota, "
                    "alloc, free, lock or unlock)", path, ln, w[0]);
    if (op.kind == RP_ALLOC ? (n != 4 && n != 5) : n != 3)
      RP_TRACE_FAIL("%s:%u: usage: %s", path, ln,
                    op.kind == RP_ALLOC ? "alloc TENANT KEY SIZE [movable]"
                                        : op.kind == RP_FREE ? "free TENANT KEY"
                                        : op.kind == RP_LOCK ? "lock TENANT KEY"
                                                             : "unlock TENANT KEY");
    if (!tr->capacity)
      RP_TRACE_FAIL("%s:%u: 'capacity SIZE' must come first", path, ln);
    if (!gmb__name_valid(w[1]))
      RP_TRACE_FAIL("%s:%u: bad tenant name '%s'", path, ln, w[1]);
    long t = rp_tenant_find(tr, w[1], 1);
    if (t < 0)
      RP_TRACE_FAIL("%s:%u: more than %d tenants", path, ln, RP_TENANTS_MAX);
    started[t] = 1;
    op.tenant = (uint32_t)t;
    long k = rp_key_find(tr, (uint32_t)t, w[2], op.kind == RP_ALLOC);
    if (k < 0 && op.kind == RP_ALLOC)
      RP_TRACE_FAIL("%s:%u: out of memory", path, ln);
    if (k < 0 || (op.kind != RP_ALLOC && !tr->keys[k].live))
      RP_TRACE_FAIL("%s:%u: %s %s: not allocated at this point", path, ln,
                    w[1], w[2]);
    struct rp_key *key = &tr->keys[k];
    op.key = (uint32_t)k;
    switch (op.kind) {
      case RP_ALLOC:
        if (key->live)
          RP_TRACE_FAIL("%s:%u: %s %s is already allocated", path, ln, w[1],
                        w[2]);
        if (gmb__size_parse(w[3], &op.size) != 0 || op.size == 0)
          RP_TRACE_FAIL("%s:%u: bad SIZE '%s'", path, ln, w[3]);
        if (n == 5) {
          if (strcmp(w[4], "movable") != 0)
            RP_TRACE_FAIL("%s:%u: unknown flag '%s' (want movable)", path, ln,
                          w[4]);
          op.flags = GMB_MOVABLE;
        }
        key->live = 1;
        break;
      case RP_FREE:
        if (key->locks)
          RP_TRACE_FAIL("%s:%u: %s %s is freed while locked", path, ln, w[1],
                        w[2]);
        key->live = 0;
        break;
      case RP_LOCK:
        key->locks++;
        break;
      case RP_UNLOCK:
        if (key->locks == 0)
          RP_TRACE_FAIL("%s:%u: %s %s is not locked", path, ln, w[1], w[2]);
        key->locks--;
        break;
    }
    if (rp_push(tr, &op) != 0) RP_TRACE_FAIL("%s:%u: out of memory", path, ln);
  }
  if (ferror(f)) RP_TRACE_FAIL("%s: read error: %s", path, strerror(errno));
  if (!tr->capacity) RP_TRACE_FAIL("%s: no 'capacity SIZE' line", path);
  if (tr->n_tenants == 0) RP_TRACE_FAIL("%s: no operations", path);
out:
  free(line);
  fclose(f);
  for (size_t i = 0; i < tr->n_keys; i++) {
    tr->keys[i].live = 0;
    tr->keys[i].locks = 0;
  }
  return rc;
}

static void rp_trace_free(struct rp_trace *tr) {
  for (size_t i = 0; i < tr->n_keys; i++) free(tr->keys[i].name);
  free(tr->keys);
  free(tr->slots);
  free(tr->ops);
}

/* --- pipes ------------------------------------------------------------------- */

static int rp_write_all(int fd, const void *buf, size_t len) {
  const char *p = buf;
  while (len) {
    ssize_t n = write(fd, p, len);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return -1;
    p += n;
    len -= (size_t)n;
  }
  return 0;
}

static int rp_read_all(int fd, void *buf, size_t len) {
  char *p = buf;
  while (len) {
    ssize_t n = read(fd, p, len);
    if (n < 0 && errno == EINTR) {
      if (rp_stop) return -1;
      continue;
    }
    if (n <= 0) return -1;
    p += n;
    len -= (size_t)n;
  }
  return 0;
}

/* --- a tenant's client process ----------------------------------------------- */

/* The stamp at `pos` of key k: differs per key, per place and per run. */
static uint64_t rp_stamp(uint32_t k, int pos, uint64_t salt) {
  uint64_t x = salt ^ ((uint64_t)k << 2 | (uint64_t)pos);
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

static void rp_stamp_offsets(uint64_t size, uint64_t off[3]) {
  off[0] = 0;
  off[1] = (size / 2) & ~(uint64_t)7;
  off[2] = (size - 8) & ~(uint64_t)7;
}

/* Writes (check = 0) or checks (check = 1) the stamps of key k at p (host
 * memory: the replay's broker serves the host device).  0, or 1 when a
 * stamp differs. */
static int rp_stamps_at(void *p, uint32_t k, uint64_t size, uint64_t salt,
                        int check) {
  if (size < 24) return 0;
  uint64_t off[3];
  rp_stamp_offsets(size, off);
  int bad = 0;
  for (int i = 0; i < 3; i++) {
    uint64_t v = rp_stamp(k, i, salt);
    uint64_t *w = (uint64_t *)((char *)p + off[i]);
    if (!check)
      *w = v;
    else if (*w != v)
      bad = 1;
  }
  return bad;
}

/* The same for allocation id, held locked meanwhile.  Returns 0, 1 when a
 * stamp differs, or a GMB_E_* code from gmb_lock. */
static int rp_stamps(gmb_client *c, gmb_id id, uint32_t k, uint64_t size,
                     uint64_t salt, int check) {
  if (size < 24) return 0;
  void *p;
  int rc = gmb_lock(c, id, &p);
  if (rc != 0) return rc;
  int bad = rp_stamps_at(p, k, size, salt, check);
  gmb_unlock(c, id);
  return bad;
}

static void rp_result_msg(struct rp_result *r, gmb_client *c) {
  snprintf(r->msg, sizeof r->msg, "%s", gmb_last_error(c));
}

struct rp_child {
  const struct rp_trace *tr;
  uint32_t tenant;
  const char *endpoint;
  int cmd_r, res_w;
  uint64_t salt;
  int cache; /* --cache */
};

/* One operation through the session's cache (--cache): blocks by key in
 * ptrs[].  Fills *res. */
static void rp_child_cached(const struct rp_child *a, gmb_client *c,
                            void **ptrs, uint64_t *sizes,
                            const struct rp_op *op, struct rp_result *res) {
  uint32_t k = op->key;
  gmb_cache_stats before;
  gmb_cache_stats_get(c, &before);
  switch (op->kind) {
    case RP_ALLOC:
      res->rc = gmb_malloc_async(c, (size_t)op->size, NULL, &ptrs[k]);
      if (res->rc) {
        ptrs[k] = NULL;
        rp_result_msg(res, c);
        break;
      }
      sizes[k] = op->size;
      rp_stamps_at(ptrs[k], k, op->size, a->salt, 0);
      break;
    case RP_FREE:
      if (ptrs[k] == NULL) {
        res->rc = RP_SKIPPED;
        break;
      }
      if (rp_stamps_at(ptrs[k], k, sizes[k], a->salt, 1)) res->corrupt = 1;
      res->rc = gmb_free_async(c, ptrs[k], NULL);
      if (res->rc)
        rp_result_msg(res, c);
      else
        ptrs[k] = NULL;
      break;
    case RP_LOCK:
    case RP_UNLOCK: /* blocks are pinned: nothing to do */
      res->rc = ptrs[k] ? 0 : RP_SKIPPED;
      break;
    case RP_VERIFY:
      for (size_t i = 0; i < a->tr->n_keys; i++)
        if (ptrs[i] &&
            rp_stamps_at(ptrs[i], (uint32_t)i, sizes[i], a->salt, 1) != 0)
          res->corrupt++;
      break;
    case RP_STATS:
      break;
    default:
      res->rc = GMB_E_INVAL;
      snprintf(res->msg, sizeof res->msg, "unknown command %u", op->kind);
  }
  /* The broker learns the cache's idle bytes and holes from the requests
   * the session sends, and from the library thread shortly after a change
   * that no request carried (a free that left a page idle, a hit); the
   * thread also answers the broker's asks for idle pages, shortly after
   * they came.  Shortly is a race with the parent's next operation: whether
   * the broker knew of idle pages then, or had them back, would depend on
   * the moment, and each run would count other refusals.  So the answer
   * waits for gmb_cache_report (one round trip, counted nowhere, and the
   * asks' Frees), and an alloc that reached the broker says so: the
   * parent then has the other children report too (RP_STATS), since the
   * broker may have asked their caches.  Every operation meets the caches
   * as they stand after the one before, as if each report and answer
   * arrived at once.  A failed report is not the operation's failure: a
   * lost broker fails the next. */
  if (op->kind == RP_ALLOC || op->kind == RP_STATS ||
      (op->kind == RP_FREE && res->rc != RP_SKIPPED))
    (void)gmb_cache_report(c);
  gmb_cache_stats_get(c, &res->cache);
  res->asked = op->kind == RP_ALLOC &&
               (res->rc != 0 || res->cache.misses != before.misses);
}


/* The child's life: connect, then serve commands until RP_QUIT or EOF.
 * Returns the exit status. */
static int rp_child_main(const struct rp_child *a) {
  const struct rp_trace *tr = a->tr;
  gmb_id *ids = calloc(tr->n_keys ? tr->n_keys : 1, sizeof *ids);
  uint64_t *sizes = calloc(tr->n_keys ? tr->n_keys : 1, sizeof *sizes);
  void **ptrs = calloc(tr->n_keys ? tr->n_keys : 1, sizeof *ptrs);
  struct rp_result res;
  memset(&res, 0, sizeof res);
  gmb_client *c = NULL;
  if (ids == NULL || sizes == NULL || ptrs == NULL) {
    res.rc = GMB_E_SYSTEM;
    snprintf(res.msg, sizeof res.msg, "out of memory");
  } else {
    res.rc = gmb_connect(a->endpoint, tr->tenants[a->tenant].name, &c);
    if (res.rc) rp_result_msg(&res, NULL);
  }
  if (rp_write_all(a->res_w, &res, sizeof res) != 0 || res.rc != 0) return 1;
  struct rp_op op;
  while (rp_read_all(a->cmd_r, &op, sizeof op) == 0) {
    memset(&res, 0, sizeof res);
    uint32_t k = op.key;
    if (a->cache && op.kind != RP_QUIT) {
      rp_child_cached(a, c, ptrs, sizes, &op, &res);
      if (rp_write_all(a->res_w, &res, sizeof res) != 0) break;
      continue;
    }
    switch (op.kind) {
      case RP_ALLOC: {
        gmb_id id = 0;
        res.rc = gmb_alloc(c, (size_t)op.size, op.flags, &id);
        if (res.rc) {
          rp_result_msg(&res, c);
          break;
        }
        ids[k] = id;
        sizes[k] = op.size;
        int s = rp_stamps(c, id, k, op.size, a->salt, 0);
        if (s < 0) {
          res.rc = s;
          rp_result_msg(&res, c);
        }
        break;
      }
      case RP_FREE:
        if (ids[k] == 0) {
          res.rc = RP_SKIPPED;
          break;
        }
        if (rp_stamps(c, ids[k], k, sizes[k], a->salt, 1) != 0) res.corrupt = 1;
        res.rc = gmb_free(c, ids[k]);
        if (res.rc)
          rp_result_msg(&res, c);
        else
          ids[k] = 0;
        break;
      case RP_LOCK: {
        void *p;
        if (ids[k] == 0) {
          res.rc = RP_SKIPPED;
          break;
        }
        res.rc = gmb_lock(c, ids[k], &p);
        if (res.rc) rp_result_msg(&res, c);
        break;
      }
      case RP_UNLOCK:
        if (ids[k] == 0) {
          res.rc = RP_SKIPPED;
          break;
        }
        res.rc = gmb_unlock(c, ids[k]);
        if (res.rc) rp_result_msg(&res, c);
        break;
      case RP_VERIFY:
        for (size_t i = 0; i < tr->n_keys; i++)
          if (ids[i] && rp_stamps(c, ids[i], (uint32_t)i, sizes[i], a->salt,
                                  1) != 0)
            res.corrupt++;
        break;
      case RP_STATS:
        break;
      case RP_QUIT:
        gmb_disconnect(c);
        free(ids);
        free(sizes);
        free(ptrs);
        rp_write_all(a->res_w, &res, sizeof res);
        return 0;
      default:
        res.rc = GMB_E_INVAL;
        snprintf(res.msg, sizeof res.msg, "unknown command %u", op.kind);
    }
    if (rp_write_all(a->res_w, &res, sizeof res) != 0) break;
  }
  gmb_disconnect(c);
  return 1;
}

/* --- the broker ------------------------------------------------------------- */

struct rp_broker {
  char dir[64];
  char config[96];
  char log[96];
  char sock[96];
  char admin[96];
  char endpoint[128];
  char admin_endpoint[128];
  pid_t pid;
};

/* The gmb-broker to run: --broker, else the one next to this program, else
 * whatever PATH finds. */
static void rp_broker_path(const char *opt, char *buf, size_t cap) {
  if (opt) {
    snprintf(buf, cap, "%s", opt);
    return;
  }
  char self[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  if (n > 0) {
    self[n] = '\0';
    char *slash = strrchr(self, '/');
    if (slash) {
      *slash = '\0';
      int len = snprintf(buf, cap, "%s/gmb-broker", self);
      if (len > 0 && (size_t)len < cap && access(buf, X_OK) == 0) return;
    }
  }
  snprintf(buf, cap, "gmb-broker");
}

static int rp_write_config(const struct rp_broker *b,
                           const struct rp_trace *tr, const char *compaction) {
  FILE *f = fopen(b->config, "w");
  if (f == NULL)
    return rp_fail(RP_EXIT_FAIL, "cannot write %s: %s", b->config,
                   strerror(errno));
  /* trim_wait_ms at its maximum: an ask to a cache is answered by its
   * library thread within a tick when the machine has a core for it, but
   * the replay's figures must not depend on that (a held request that ran
   * out would be refused).  Every child asked is idle, so the answer
   * comes; the bound is only ever reached on a starved machine.  No
   * release of emptied segments on a timer: which operation it fell
   * before would depend on the machine's speed. */
  fprintf(f, "; written by gmb-replay\n[broker]\ncompaction = %s\n"
          "log_level = warn\ntrim_wait_ms = 5000\nsegment_linger_ms = 0\n",
          compaction);
  for (size_t i = 0; i < tr->n_tenants; i++)
    if (tr->tenants[i].has_quota)
      fprintf(f, "\n[tenant:%s]\nquota = %llu\n", tr->tenants[i].name,
              (unsigned long long)tr->tenants[i].quota);
  if (fclose(f) != 0)
    return rp_fail(RP_EXIT_FAIL, "cannot write %s: %s", b->config,
                   strerror(errno));
  return 0;
}

static int rp_is_socket(const char *path) {
  struct stat st;
  return stat(path, &st) == 0 && S_ISSOCK(st.st_mode);
}

static void rp_sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

static void rp_log_tail(const struct rp_broker *b) {
  FILE *f = fopen(b->log, "r");
  if (f == NULL) return;
  char lines[15][512];
  int n = 0;
  while (fgets(lines[n % 15], sizeof lines[0], f)) n++;
  fclose(f);
  if (n == 0) return;
  fprintf(stderr, "%s: the broker's last log lines:\n", rp_prog);
  for (int i = n > 15 ? n - 15 : 0; i < n; i++)
    fprintf(stderr, "  | %s", lines[i % 15]);
}

static int rp_broker_start(struct rp_broker *b, const char *bin,
                           uint64_t capacity) {
  char device[64];
  snprintf(device, sizeof device, "host:%llu", (unsigned long long)capacity);
  b->pid = fork();
  if (b->pid < 0)
    return rp_fail(RP_EXIT_FAIL, "fork: %s", strerror(errno));
  if (b->pid == 0) {
    /* The broker stops cleanly (SIGTERM) if the replayer dies. */
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    int fd = open(b->log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    int null = open("/dev/null", O_RDONLY);
    if (fd >= 0 && null >= 0) {
      dup2(null, 0);
      dup2(fd, 1);
      dup2(fd, 2);
    }
    char *argv[] = {(char *)bin, "--config", b->config, "--run-dir", b->dir,
                    "--device", device, NULL};
    execvp(bin, argv);
    fprintf(stderr, "gmb-replay: cannot run %s: %s\n", bin, strerror(errno));
    _exit(127);
  }
  for (int waited = 0;; waited += 20) {
    if (rp_is_socket(b->sock) && rp_is_socket(b->admin)) return 0;
    int st;
    if (waitpid(b->pid, &st, WNOHANG) == b->pid) {
      b->pid = 0;
      rp_log_tail(b);
      return rp_fail(RP_EXIT_FAIL, "%s exited at start-up (status %d)", bin,
                     WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st));
    }
    if (waited >= RP_WAIT_MS || rp_stop) {
      rp_log_tail(b);
      return rp_fail(RP_EXIT_FAIL, "%s did not create its sockets in %d ms",
                     bin, RP_WAIT_MS);
    }
    rp_sleep_ms(20);
  }
}

/* SIGTERM, then wait; SIGKILL if it does not stop.  Returns 0 when it
 * exited with status 0. */
static int rp_broker_stop(struct rp_broker *b) {
  if (b->pid <= 0) return -1;
  kill(b->pid, SIGTERM);
  int st = 0;
  pid_t w = 0;
  for (int waited = 0; waited < RP_WAIT_MS; waited += 10) {
    w = waitpid(b->pid, &st, WNOHANG);
    if (w == b->pid || (w < 0 && errno != EINTR)) break;
    rp_sleep_ms(10);
  }
  if (w != b->pid) {
    kill(b->pid, SIGKILL);
    waitpid(b->pid, &st, 0);
    rp_fail(0, "the broker did not stop within %d ms of SIGTERM; killed",
            RP_WAIT_MS);
    st = 1 << 8;
  }
  b->pid = 0;
  if (WIFEXITED(st) && WEXITSTATUS(st) == 0) return 0;
  rp_log_tail(b);
  if (WIFSIGNALED(st))
    rp_fail(0, "the broker was killed by signal %d", WTERMSIG(st));
  else
    rp_fail(0, "the broker exited with status %d", WEXITSTATUS(st));
  return -1;
}

static void rp_dir_remove(struct rp_broker *b) {
  if (!b->dir[0]) return;
  unlink(b->config);
  unlink(b->log);
  unlink(b->sock);
  unlink(b->admin);
  if (rmdir(b->dir) != 0)
    rp_fail(0, "warning: could not remove %s: %s", b->dir, strerror(errno));
}

/* --- admin status ---------------------------------------------------------- */

/* AdminStatus through admin_rpc.c: 0 with *rep filled (the caller clears
 * it), else -1 after saying why. */
static int rp_admin_status(struct admin_rpc *ad, struct wire_reply *rep) {
  struct wire_request req = {.kind = WIRE_ADMIN_STATUS};
  char why[ADMIN_RPC_WHY_MAX];
  if (gmb__admin_rpc_call(ad, &req, WIRE_ADMIN_STATUS, 0, rep, why,
                          sizeof why) != 0)
    return rp_fail(-1, "AdminStatus: %s", why);
  return 0;
}

/* --- the replay ------------------------------------------------------------- */

struct rp_opts {
  const char *trace;
  const char *compaction;
  const char *series;
  const char *broker;
  int json, verbose;
  int cache; /* --cache: through gmb_malloc_async / gmb_free_async */
};

static void rp_on_signal(int sig) {
  (void)sig;
  rp_stop = 1;
}

/* Sends op to its tenant's child and reads the result: 0 or -1 when the
 * child is gone. */
static int rp_call(struct rp_tenant *t, const struct rp_op *op,
                   struct rp_result *res) {
  if (rp_write_all(t->cmd_w, op, sizeof *op) != 0) return -1;
  return rp_read_all(t->res_r, res, sizeof *res);
}

/* The bytes of 2 MiB pages that a request of r bytes from tenant t would
 * bring the device to, for an allocator that keeps each tenant in pages of
 * its own (the broker's segments; a GPU's granularity) and is perfect
 * otherwise: each tenant's bytes packed densely across its pages, the
 * whole pages of large allocations apart (large: their bytes, all
 * tenants) and the rest (small[u], n tenants: small allocations and the
 * tails of large ones) sharing pages. */
static uint64_t rp_paged(const uint64_t *small, size_t n, uint64_t large,
                         uint32_t t, uint64_t r) {
  uint64_t pages = large + rp_own(r);
  for (size_t u = 0; u < n; u++)
    pages += rp_pages(small[u] + (u == t ? rp_shared(r) : 0));
  return pages;
}

/* 1 when no allocator that keeps each tenant in 2 MiB pages of its own
 * could have served a request of `need` bytes from tenant t now (rp_paged
 * passes the capacity).  Such a failure counts as fragmentation (the free
 * total was enough) but no compaction can avoid it. */
static int rp_page_bound(const struct rp_trace *tr, const struct rp_figures *fg,
                         uint32_t t, uint64_t need) {
  uint64_t large = 0;
  for (size_t i = 0; i < tr->n_tenants; i++) large += fg->tenant_large[i];
  return rp_paged(fg->tenant_small, tr->n_tenants, large, t, need) >
         tr->capacity;
}

/* The three baselines, computed from the trace alone with a perfect
 * allocator (every request that fits its budget is served; no
 * fragmentation):
 *   static  each tenant owns a fixed slice of the device (what hosts do
 *           without a broker: MIG, per-process memory fractions): its
 *           quota when the quotas fit the device, else a share of the
 *           capacity in proportion to its quota (tenants without a quota
 *           weigh as much as the largest quota);
 *   shared  one pool for all with the quotas: refused only past a quota
 *           (GMB_E_QUOTA) or past the capacity.  The floor: nothing a
 *           broker does can refuse less;
 *   paged   the same pool, but each tenant in 2 MiB pages of its own,
 *           packed perfectly (rp_paged): refused past a quota or when
 *           the pages pass the capacity.  The floor of any broker that
 *           isolates tenants on a GPU (a client can read all of a page
 *           it maps), so of this one.
 * Each keeps its own set of live keys (what it refused is never freed). */
static void rp_baselines(struct rp_trace *tr, struct rp_figures *fg) {
  uint64_t qmax = 0, qsum = 0;
  for (size_t i = 0; i < tr->n_tenants; i++)
    if (tr->tenants[i].has_quota && tr->tenants[i].quota > qmax)
      qmax = tr->tenants[i].quota;
  if (qmax == 0) qmax = tr->capacity;
  uint64_t slice[RP_TENANTS_MAX], quota[RP_TENANTS_MAX];
  for (size_t i = 0; i < tr->n_tenants; i++) {
    quota[i] = tr->tenants[i].has_quota && tr->tenants[i].quota
                   ? tr->tenants[i].quota
                   : UINT64_MAX;
    qsum += quota[i] == UINT64_MAX ? qmax : quota[i];
  }
  for (size_t i = 0; i < tr->n_tenants; i++) {
    uint64_t w = quota[i] == UINT64_MAX ? qmax : quota[i];
    slice[i] = qsum <= tr->capacity
                   ? w
                   : (uint64_t)((double)tr->capacity * (double)w /
                                (double)qsum);
  }
  struct rp_baseline *const bls[3] = {&fg->base_static, &fg->base_shared,
                                       &fg->base_paged};
  for (int which = 0; which < 3; which++) {
    struct rp_baseline *bl = bls[which];
    /* The rounded size of each live key, 0 when not live. */
    uint64_t *live = calloc(tr->n_keys ? tr->n_keys : 1, sizeof *live);
    uint64_t used[RP_TENANTS_MAX] = {0}, total = 0;
    /* paged: each tenant's shared bytes, and the whole pages of the large
     * ones (all tenants). */
    uint64_t small[RP_TENANTS_MAX] = {0}, large = 0;
    if (live == NULL) return;
    for (size_t i = 0; i < tr->n_ops; i++) {
      const struct rp_op *op = &tr->ops[i];
      uint32_t t = op->tenant;
      uint64_t r = rp_round(op->size);
      if (op->kind == RP_ALLOC) {
        int over;
        if (which == 0) {
          over = used[t] + r > slice[t];
        } else if (which == 1) {
          over = total + r > tr->capacity;
        } else {
          over = rp_paged(small, tr->n_tenants, large, t, r) > tr->capacity;
        }
        if (quota[t] != UINT64_MAX && used[t] + r > quota[t]) {
          bl->failures++;
          bl->quota_failures++;
        } else if (over) {
          bl->failures++;
          bl->nomem_failures++;
        } else {
          live[op->key] = r;
          used[t] += r;
          total += r;
          large += rp_own(r);
          small[t] += rp_shared(r);
        }
      } else if (op->kind == RP_FREE && live[op->key]) {
        r = live[op->key];
        live[op->key] = 0;
        used[t] -= r;
        total -= r;
        large -= rp_own(r);
        small[t] -= rp_shared(r);
      }
    }
    free(live);
  }
}

/* A tenant's cache as a child's answer has it, and the sum over the
 * tenants of the bytes of the pages their caches hold, each as of its
 * tenant's last answer. */
static void rp_cache_seen(struct rp_figures *fg, uint32_t t,
                          const gmb_cache_stats *cs) {
  fg->held = fg->held - fg->tenant_cache[t].held + cs->held;
  fg->tenant_cache[t] = *cs;
}

static int rp_cache_refresh_but(struct rp_trace *tr, struct rp_figures *fg,
                                size_t except);

/* Why tenant t's cached request of `size` bytes was refused with `rc`,
 * from the caches' figures (RP_WHY_*).  A cache maps whole pages, so a
 * request needs its pages' worth of idle pages or free room. */
static unsigned rp_cache_why(const struct rp_trace *tr,
                             const struct rp_figures *fg, uint32_t t, int rc,
                             uint64_t size) {
  const gmb_cache_stats *own = &fg->tenant_cache[t];
  uint64_t need = rp_round(size);
  if (rc == GMB_E_QUOTA)
    return own->held - own->in_use >= need ? RP_WHY_QUOTA_CACHED
                                           : RP_WHY_QUOTA;
  uint64_t held = 0, idle = 0, in_use = 0;
  for (size_t i = 0; i < tr->n_tenants; i++) {
    held += fg->tenant_cache[i].held;
    idle += fg->tenant_cache[i].idle;
    in_use += fg->tenant_cache[i].in_use;
  }
  uint64_t room = tr->capacity > held ? tr->capacity - held : 0;
  if (room + idle >= rp_pages(need) * RP_PAGE) return RP_WHY_IDLE;
  return tr->capacity >= in_use + need ? RP_WHY_PARTIAL : RP_WHY_FULL;
}

static void rp_count(const struct rp_opts *o, struct rp_trace *tr,
                     const struct rp_op *op, const struct rp_result *res,
                     struct rp_figures *fg) {
  struct rp_key *k = &tr->keys[op->key];
  fg->operations++;
  fg->corrupted += res->corrupt;
  if (o->cache) rp_cache_seen(fg, op->tenant, &res->cache);
  if (res->rc != RP_SKIPPED && (op->kind == RP_ALLOC || op->kind == RP_FREE))
    fg->uncached_requests++;
  if (res->rc == RP_SKIPPED) {
    fg->skipped++;
    return;
  }
  if (res->rc == 0) {
    if (op->kind == RP_ALLOC) {
      k->live = 1;
      k->rounded = rp_round(op->size);
      fg->in_use += k->rounded;
      fg->tenant_in_use[op->tenant] += k->rounded;
      fg->tenant_small[op->tenant] += rp_shared(k->rounded);
      fg->tenant_large[op->tenant] += rp_own(k->rounded);
      if (fg->in_use > fg->peak) fg->peak = fg->in_use;
    } else if (op->kind == RP_FREE) {
      k->live = 0;
      fg->in_use -= k->rounded;
      fg->tenant_in_use[op->tenant] -= k->rounded;
      fg->tenant_small[op->tenant] -= rp_shared(k->rounded);
      fg->tenant_large[op->tenant] -= rp_own(k->rounded);
    }
    return;
  }
  fg->failures++;
  uint64_t need = rp_round(op->size);
  uint64_t free_total =
      tr->capacity > fg->in_use ? tr->capacity - fg->in_use : 0;
  const char *why = "";
  if (res->rc == GMB_E_QUOTA) {
    fg->quota_failures++;
  } else if (res->rc == GMB_E_NOMEM) {
    fg->nomem_failures++;
    if (free_total >= need) {
      fg->fragmentation_failures++;
      why = " [fragmentation]";
      if (rp_page_bound(tr, fg, op->tenant, need)) {
        fg->page_bound_failures++;
        why = " [fragmentation, page bound]";
      }
      if (!fg->first_frag[0])
        snprintf(fg->first_frag, sizeof fg->first_frag,
                 "line %u: alloc %s %s -> %s", op->line,
                 tr->tenants[op->tenant].name, rp_key_str(tr, op->key),
                 res->msg);
    }
  } else {
    fg->other_failures++;
  }
  if (o->verbose) {
    char a[GMB_SIZE_BUFSZ], b[GMB_SIZE_BUFSZ], c[GMB_SIZE_BUFSZ];
    fprintf(stderr, "line %u: %s %s %s", op->line, rp_kind_names[op->kind],
            tr->tenants[op->tenant].name, rp_key_str(tr, op->key));
    if (op->kind == RP_ALLOC)
      fprintf(stderr, " %s (free total %s)",
              gmb__size_format(op->size, a, sizeof a),
              gmb__size_format(free_total, b, sizeof b));
    fprintf(stderr, " -> %s%s\n", res->msg[0] ? res->msg
                                                : gmb_err_name(res->rc), why);
    /* With the cache: every cache's figures as they are now, not as of
     * their last answers (a trim ask may have changed them since), and
     * the refusal's cause. */
    if (o->cache && op->kind == RP_ALLOC &&
        (res->rc == GMB_E_QUOTA || res->rc == GMB_E_NOMEM) &&
        rp_cache_refresh_but(tr, fg, op->tenant) == 0) {
      for (size_t i = 0; i < tr->n_tenants; i++) {
        const gmb_cache_stats *cs = &fg->tenant_cache[i];
        fprintf(stderr, "  %s: cache held %s, in use %s, idle %s\n",
                tr->tenants[i].name, gmb__size_format(cs->held, a, sizeof a),
                gmb__size_format(cs->in_use, b, sizeof b),
                gmb__size_format(cs->idle, c, sizeof c));
      }
      unsigned w = rp_cache_why(tr, fg, op->tenant, res->rc, op->size);
      fg->cache_why[w]++;
      fprintf(stderr, "  cause: %s\n", rp_why_names[w]);
    }
  }
}

/* The broker's view of each tenant against the replay's: the bytes of what
 * the library said was allocated and not yet freed, or with the cache the
 * bytes its pages hold, which must hold at least those.  Returns the
 * number of tenants that differ; `say` names them on stderr. */
static uint64_t rp_accounting(struct rp_trace *tr, const struct rp_figures *fg,
                              const struct wire_admin_status *st, int cached,
                              int say) {
  uint64_t bad = 0;
  for (size_t i = 0; i < st->n_tenants; i++) {
    const struct wire_tenant_row *row = &st->tenants[i];
    long t = rp_tenant_find(tr, row->name, 0);
    if (t < 0) continue;
    uint64_t want = cached ? fg->tenant_cache[t].held : fg->tenant_in_use[t];
    if (row->used == want &&
        (!cached || fg->tenant_cache[t].held >= fg->tenant_in_use[t]))
      continue;
    bad++;
    if (say)
      rp_fail(0, "tenant %s: the broker counts %llu bytes in use, the "
              "replay %llu%s (%llu live)", row->name,
              (unsigned long long)row->used, (unsigned long long)want,
              cached ? " in its cache's pages" : "",
              (unsigned long long)fg->tenant_in_use[t]);
  }
  return bad;
}

/* --cache: every child's figures as they are now (RP_STATS), but tenant
 * `except`'s (pass n_tenants for none).  0, or -1 when a child is gone. */
static int rp_cache_refresh_but(struct rp_trace *tr, struct rp_figures *fg,
                                size_t except) {
  for (size_t i = 0; i < tr->n_tenants; i++) {
    if (i == except) continue;
    struct rp_op op = {.kind = RP_STATS, .tenant = (uint32_t)i};
    struct rp_result r;
    if (rp_call(&tr->tenants[i], &op, &r) != 0) return -1;
    rp_cache_seen(fg, (uint32_t)i, &r.cache);
  }
  return 0;
}

static int rp_cache_refresh(struct rp_trace *tr, struct rp_figures *fg) {
  return rp_cache_refresh_but(tr, fg, tr->n_tenants);
}

/* --cache, after tenant t's operation (its figures are those of its
 * answer): the peak of the bytes all the caches hold at one moment.  The
 * sum of each tenant's last answer is not that: a cache grows only in its
 * own process's calls (a miss), but shrinks at any moment (its library
 * thread gives pages back when the broker asks), so another tenant's last
 * answer may count pages it has given back since - to the tenant whose
 * operation just took them - and the sum may pass the capacity.  Stale
 * figures are only ever too high, so when their sum stays within the peak
 * so far the true sum does too; when it would set a new peak, the other
 * tenants' figures are read again (RP_STATS) and their sum counts.  Each
 * figure is read after the operation ended and none of them grows
 * meanwhile, so the sum lies between the true sums at two moments after
 * the operation; none passes what the broker's pages back (a cache counts
 * a page off before it sends it back).  0, or -1 when a child is gone. */
static int rp_cache_peak(struct rp_trace *tr, struct rp_figures *fg,
                         uint32_t t) {
  if (fg->held <= fg->peak_held) return 0;
  if (rp_cache_refresh_but(tr, fg, t) != 0) return -1;
  if (fg->held > fg->peak_held) fg->peak_held = fg->held;
  return 0;
}

static int rp_fork_children(struct rp_trace *tr, const struct rp_broker *b,
                            int cache) {
  uint64_t salt = gmb__now_ns() ^ ((uint64_t)getpid() << 32);
  for (size_t i = 0; i < tr->n_tenants; i++) {
    int cmd[2], res[2];
    if (pipe2(cmd, O_CLOEXEC) != 0 || pipe2(res, O_CLOEXEC) != 0)
      return rp_fail(RP_EXIT_FAIL, "pipe: %s", strerror(errno));
    fflush(NULL);
    pid_t pid = fork();
    if (pid < 0) return rp_fail(RP_EXIT_FAIL, "fork: %s", strerror(errno));
    if (pid == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      signal(SIGINT, SIG_IGN); /* the parent stops us with QUIT or EOF */
      signal(SIGTERM, SIG_DFL);
      for (size_t j = 0; j < i; j++) { /* older siblings' pipes */
        close(tr->tenants[j].cmd_w);
        close(tr->tenants[j].res_r);
      }
      close(cmd[1]);
      close(res[0]);
      struct rp_child a = {tr,     (uint32_t)i, b->endpoint, cmd[0],
                           res[1], salt,        cache};
      _exit(rp_child_main(&a));
    }
    close(cmd[0]);
    close(res[1]);
    tr->tenants[i].pid = pid;
    tr->tenants[i].cmd_w = cmd[1];
    tr->tenants[i].res_r = res[0];
    struct rp_result r;
    if (rp_read_all(res[0], &r, sizeof r) != 0)
      return rp_fail(RP_EXIT_FAIL, "the client of tenant %s died at start",
                     tr->tenants[i].name);
    if (r.rc != 0)
      return rp_fail(RP_EXIT_FAIL, "tenant %s cannot connect: %s",
                     tr->tenants[i].name, r.msg);
  }
  return 0;
}

/* Tells every child to verify and quit, and waits for them.  Returns the
 * number of children that did not end well. */
static int rp_end_children(struct rp_trace *tr, struct rp_figures *fg,
                           int verify) {
  int bad = 0;
  for (size_t i = 0; i < tr->n_tenants; i++) {
    struct rp_tenant *t = &tr->tenants[i];
    if (t->pid <= 0) continue;
    struct rp_result r;
    struct rp_op op = {.kind = RP_VERIFY, .tenant = (uint32_t)i};
    if (verify) {
      if (rp_call(t, &op, &r) == 0)
        fg->corrupted += r.corrupt;
      else
        bad++;
    }
    op.kind = RP_QUIT;
    rp_call(t, &op, &r);
    close(t->cmd_w);
    close(t->res_r);
    t->cmd_w = t->res_r = -1;
    int st;
    int waited = 0;
    while (waitpid(t->pid, &st, WNOHANG) == 0 && waited < RP_WAIT_MS) {
      rp_sleep_ms(5);
      waited += 5;
    }
    if (waited >= RP_WAIT_MS) {
      kill(t->pid, SIGKILL);
      waitpid(t->pid, &st, 0);
    }
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) bad++;
    t->pid = 0;
  }
  return bad;
}

/* The cache's figures summed over the tenants; without --cache, what the
 * same figures are when every allocation is its own broker request. */
struct rp_cache_sum {
  uint64_t hits, misses, slab_allocs, slab_frees, requests, peak_held;
};

static struct rp_cache_sum rp_cache_sum(const struct rp_opts *o,
                                        const struct rp_trace *tr,
                                        const struct rp_figures *fg) {
  struct rp_cache_sum cs = {0};
  if (!o->cache) {
    cs.requests = fg->uncached_requests;
    cs.peak_held = fg->peak;
    return cs;
  }
  for (size_t i = 0; i < tr->n_tenants; i++) {
    cs.hits += fg->tenant_cache[i].hits;
    cs.misses += fg->tenant_cache[i].misses;
    cs.slab_allocs += fg->tenant_cache[i].slab_allocs;
    cs.slab_frees += fg->tenant_cache[i].slab_frees;
  }
  cs.requests = cs.misses + cs.slab_frees; /* a miss: at least one */
  cs.peak_held = fg->peak_held;
  return cs;
}

static void rp_print(const struct rp_opts *o, const struct rp_trace *tr,
                     const struct rp_figures *fg) {
  char a[GMB_SIZE_BUFSZ], b[GMB_SIZE_BUFSZ];
  struct rp_cache_sum cs = rp_cache_sum(o, tr, fg);
  double hit_rate = cs.hits + cs.misses
                        ? (double)cs.hits / (double)(cs.hits + cs.misses)
                        : 0.0;
  if (o->json) {
    json_t *j = json_pack(
        "{s:s, s:s, s:I, s:i, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, "
        "s:I, s:I, s:I, s:I, s:I, s:f, s:f, s:I, s:I, s:I, s:I, s:I}",
        "trace", o->trace, "compaction", o->compaction, "capacity",
        (json_int_t)tr->capacity, "tenants", (int)tr->n_tenants, "operations",
        (json_int_t)fg->operations, "skipped", (json_int_t)fg->skipped,
        "failures", (json_int_t)fg->failures, "quota_failures",
        (json_int_t)fg->quota_failures, "nomem_failures",
        (json_int_t)fg->nomem_failures, "fragmentation_failures",
        (json_int_t)fg->fragmentation_failures, "other_failures",
        (json_int_t)fg->other_failures, "peak_bytes_in_use",
        (json_int_t)fg->peak, "bytes_moved",
        (json_int_t)fg->compaction.bytes_moved, "compaction_moves",
        (json_int_t)fg->compaction.moves, "compaction_runs",
        (json_int_t)fg->compaction.runs, "corrupted",
        (json_int_t)fg->corrupted, "accounting_mismatches",
        (json_int_t)fg->accounting_mismatches, "final_largest_free",
        (json_int_t)fg->final_largest_free, "compaction_seconds",
        fg->compaction.seconds, "wall_seconds", fg->wall_s,
        "page_bound_failures", (json_int_t)fg->page_bound_failures,
        "baseline_static_failures", (json_int_t)fg->base_static.failures,
        "baseline_static_quota_failures",
        (json_int_t)fg->base_static.quota_failures,
        "baseline_shared_failures", (json_int_t)fg->base_shared.failures,
        "baseline_shared_quota_failures",
        (json_int_t)fg->base_shared.quota_failures);
    json_object_set_new(j, "baseline_paged_failures",
                        json_integer((json_int_t)fg->base_paged.failures));
    json_object_set_new(j, "baseline_paged_quota_failures",
                        json_integer((json_int_t)fg->base_paged.quota_failures));
    json_object_set_new(j, "cache", json_boolean(o->cache));
    json_object_set_new(j, "peak_bytes_held", json_integer((json_int_t)cs.peak_held));
    json_object_set_new(j, "cache_hits", json_integer((json_int_t)cs.hits));
    json_object_set_new(j, "cache_misses", json_integer((json_int_t)cs.misses));
    json_object_set_new(j, "cache_hit_rate", json_real(hit_rate));
    json_object_set_new(j, "cache_slab_allocs",
                        json_integer((json_int_t)cs.slab_allocs));
    json_object_set_new(j, "cache_slab_frees",
                        json_integer((json_int_t)cs.slab_frees));
    json_object_set_new(j, "broker_requests", json_integer((json_int_t)cs.requests));
    json_object_set_new(j, "uncached_requests",
                        json_integer((json_int_t)fg->uncached_requests));
    if (o->cache && o->verbose) {
      json_t *w = json_object();
      for (unsigned i = 0; i < RP_WHY_N; i++)
        json_object_set_new(w, rp_why_keys[i],
                            json_integer((json_int_t)fg->cache_why[i]));
      json_object_set_new(j, "cache_refusal_causes", w);
    }
    json_dumpf(j, stdout, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
    fputc('\n', stdout);
    json_decref(j);
    return;
  }
  printf("trace                   %s (capacity %s, %zu tenant%s)\n", o->trace,
         gmb__size_format(tr->capacity, a, sizeof a), tr->n_tenants,
         tr->n_tenants == 1 ? "" : "s");
  printf("compaction              %s\n", o->compaction);
  printf("allocator               %s\n",
         o->cache ? "the client cache (gmb_malloc_async)" : "gmb_alloc");
  printf("operations              %llu (%llu skipped: their alloc had "
         "failed)\n", (unsigned long long)fg->operations,
         (unsigned long long)fg->skipped);
  printf("failures                %llu\n", (unsigned long long)fg->failures);
  printf("  quota                 %llu\n",
         (unsigned long long)fg->quota_failures);
  printf("  no memory             %llu\n",
         (unsigned long long)fg->nomem_failures);
  printf("    fragmentation       %llu (the free total was enough)\n",
         (unsigned long long)fg->fragmentation_failures);
  printf("      page bound        %llu (no allocator with per-tenant 2 MiB "
         "pages could serve them)\n",
         (unsigned long long)fg->page_bound_failures);
  printf("  other                 %llu\n",
         (unsigned long long)fg->other_failures);
  printf("baseline: static slices %llu failures (%llu quota)\n",
         (unsigned long long)fg->base_static.failures,
         (unsigned long long)fg->base_static.quota_failures);
  printf("baseline: shared, ideal %llu failures (%llu quota)\n",
         (unsigned long long)fg->base_shared.failures,
         (unsigned long long)fg->base_shared.quota_failures);
  printf("baseline: shared, paged %llu failures (%llu quota; each tenant "
         "in 2 MiB pages of its own)\n",
         (unsigned long long)fg->base_paged.failures,
         (unsigned long long)fg->base_paged.quota_failures);
  printf("peak bytes in use       %s\n",
         gmb__size_format(fg->peak, a, sizeof a));
  if (o->cache) {
    printf("peak bytes held         %s (the caches' pages at one moment; "
           "%.2fx the peak in use)\n", gmb__size_format(cs.peak_held, a, sizeof a),
           fg->peak ? (double)cs.peak_held / (double)fg->peak : 0.0);
    printf("cache                   %llu hits, %llu misses (%.1f%% hits)\n",
           (unsigned long long)cs.hits, (unsigned long long)cs.misses,
           100.0 * hit_rate);
    printf("broker requests         %llu (%llu pages, %llu given back) "
           "instead of %llu\n", (unsigned long long)cs.requests,
           (unsigned long long)cs.slab_allocs,
           (unsigned long long)cs.slab_frees,
           (unsigned long long)fg->uncached_requests);
  }
  printf("bytes moved             %s (%llu moves, %llu runs)\n",
         gmb__size_format(fg->compaction.bytes_moved, b, sizeof b),
         (unsigned long long)fg->compaction.moves,
         (unsigned long long)fg->compaction.runs);
  printf("compaction seconds      %.3f\n", fg->compaction.seconds);
  printf("corrupted allocations   %llu\n", (unsigned long long)fg->corrupted);
  printf("wall seconds            %.2f\n", fg->wall_s);
  if (fg->first_frag[0])
    printf("first fragmentation failure:\n  %s\n", fg->first_frag);
  if (o->cache && o->verbose) {
    printf("refusals by cause (-v: every cache read at the refusal):\n");
    for (unsigned w = 0; w < RP_WHY_N; w++)
      printf("  %-56s %llu\n", rp_why_names[w],
             (unsigned long long)fg->cache_why[w]);
  }
}

static int rp_series_row(struct admin_rpc *ad, FILE *f, uint64_t op,
                         const struct rp_trace *tr,
                         const struct rp_figures *fg) {
  struct wire_reply rep;
  if (rp_admin_status(ad, &rep) != 0) return -1;
  fprintf(f, "%llu %llu %llu %llu %llu\n", (unsigned long long)op,
          (unsigned long long)rep.u.admin_status.in_use,
          (unsigned long long)rep.u.admin_status.largest_free,
          (unsigned long long)rep.u.admin_status.in_segments,
          (unsigned long long)(tr->capacity - fg->in_use));
  gmb__wire_reply_clear(&rep);
  return 0;
}

static int rp_run(const struct rp_opts *o, struct rp_trace *tr) {
  struct rp_broker b;
  memset(&b, 0, sizeof b);
  struct admin_rpc *ad = NULL;
  struct rp_figures fg;
  memset(&fg, 0, sizeof fg);
  FILE *series = NULL;
  int rc = 0;
  char bin[PATH_MAX];
  rp_broker_path(o->broker, bin, sizeof bin);

  snprintf(b.dir, sizeof b.dir, "/tmp/gmb-replay-XXXXXX");
  if (mkdtemp(b.dir) == NULL) {
    b.dir[0] = '\0';
    return rp_fail(RP_EXIT_FAIL, "mkdtemp: %s", strerror(errno));
  }
  snprintf(b.config, sizeof b.config, "%s/gmb.ini", b.dir);
  snprintf(b.log, sizeof b.log, "%s/broker.log", b.dir);
  snprintf(b.sock, sizeof b.sock, "%s/broker.sock", b.dir);
  snprintf(b.admin, sizeof b.admin, "%s/admin.sock", b.dir);
  snprintf(b.endpoint, sizeof b.endpoint, "ipc://%s", b.sock);
  snprintf(b.admin_endpoint, sizeof b.admin_endpoint, "ipc://%s", b.admin);

  if (o->series && (series = fopen(o->series, "w")) == NULL) {
    rc = rp_fail(RP_EXIT_USAGE, "cannot write %s: %s", o->series,
                 strerror(errno));
    goto out;
  }
  rc = rp_write_config(&b, tr, o->compaction);
  if (rc == 0) rc = rp_broker_start(&b, bin, tr->capacity);
  if (rc == 0) rc = rp_fork_children(tr, &b, o->cache);
  if (rc) goto out;
  char why[ADMIN_RPC_WHY_MAX];
  if (gmb__admin_rpc_open(b.admin_endpoint, RP_WAIT_MS, NULL, &ad, why,
                          sizeof why) != 0) {
    rc = rp_fail(RP_EXIT_FAIL, "%s", why);
    goto out;
  }
  gmb__admin_rpc_set_stop(ad, &rp_stop);

  size_t every = tr->n_ops / RP_SERIES_POINTS;
  if (every == 0) every = 1;
  if (series)
    fprintf(series, "# %s, compaction %s\n# op bytes_in_use largest_free "
            "in_segments free_total\n", o->trace, o->compaction);
  uint64_t t0 = gmb__now_ns();
  for (size_t i = 0; i < tr->n_ops && !rp_stop; i++) {
    if (series && i % every == 0 && rp_series_row(ad, series, i, tr, &fg)) {
      rc = RP_EXIT_FAIL;
      goto out;
    }
    const struct rp_op *op = &tr->ops[i];
    struct rp_result res;
    if (rp_call(&tr->tenants[op->tenant], op, &res) != 0) {
      if (rp_stop) break;
      rc = rp_fail(RP_EXIT_FAIL, "line %u: the client of tenant %s is gone",
                   op->line, tr->tenants[op->tenant].name);
      goto out;
    }
    /* Whatever the broker asked of the other caches for it is given back
     * and answered before the next operation (rp_child_cached). */
    if (res.asked && rp_cache_refresh_but(tr, &fg, op->tenant) != 0) {
      if (rp_stop) break;
      rc = rp_fail(RP_EXIT_FAIL, "line %u: a client process is gone",
                   op->line);
      goto out;
    }
    rp_count(o, tr, op, &res, &fg);
    if (o->cache && rp_cache_peak(tr, &fg, op->tenant) != 0) {
      if (rp_stop) break;
      rc = rp_fail(RP_EXIT_FAIL, "line %u: a client process is gone",
                   op->line);
      goto out;
    }
  }
  if (rp_stop) {
    rc = rp_fail(RP_EXIT_FAIL, "interrupted");
    goto out;
  }
  fg.wall_s = (double)(gmb__now_ns() - t0) / 1e9;
  if (series && rp_series_row(ad, series, tr->n_ops, tr, &fg)) {
    rc = RP_EXIT_FAIL;
    goto out;
  }
  struct wire_reply rep;
  /* With the cache the broker's view may lag by an answer to its own ask
   * for cached memory (a library thread gives it back a moment later):
   * the children's figures and the broker's are read again, a bounded
   * number of times, until they agree. */
  for (int tries = 0;; tries++) {
    if (o->cache && rp_cache_refresh(tr, &fg) != 0) {
      rc = rp_fail(RP_EXIT_FAIL, "a client process is gone");
      goto out;
    }
    if (rp_admin_status(ad, &rep) != 0) {
      rc = RP_EXIT_FAIL;
      goto out;
    }
    if (!o->cache || tries >= RP_WAIT_MS / 20 ||
        rp_accounting(tr, &fg, &rep.u.admin_status, 1, 0) == 0)
      break;
    gmb__wire_reply_clear(&rep);
    rp_sleep_ms(20);
  }
  fg.compaction = rep.u.admin_status.compaction;
  fg.accounting_mismatches =
      rp_accounting(tr, &fg, &rep.u.admin_status, o->cache, 1);
  fg.final_largest_free = rep.u.admin_status.largest_free;
  fg.final_in_segments = rep.u.admin_status.in_segments;
  gmb__wire_reply_clear(&rep);
  if (rp_end_children(tr, &fg, 1) != 0) {
    rc = rp_fail(RP_EXIT_FAIL, "a client process did not end well");
    goto out;
  }
  rp_baselines(tr, &fg);
  rp_print(o, tr, &fg);
  if (fg.corrupted)
    rc = rp_fail(RP_EXIT_FAIL, "%llu allocations did not keep their bytes",
                 (unsigned long long)fg.corrupted);
  if (fg.accounting_mismatches)
    rc = rp_fail(RP_EXIT_FAIL, "the broker's accounting differs from the "
                 "replay for %llu tenants",
                 (unsigned long long)fg.accounting_mismatches);
out:
  gmb__admin_rpc_close(ad);
  rp_end_children(tr, &fg, 0);
  if (series && fclose(series) != 0 && rc == 0)
    rc = rp_fail(RP_EXIT_FAIL, "cannot write %s", o->series);
  if (b.pid > 0 && rp_broker_stop(&b) != 0 && rc == 0) rc = RP_EXIT_FAIL;
  rp_dir_remove(&b);
  return rc;
}

/* --- main -------------------------------------------------------------------- */

static void rp_usage(FILE *f) {
  fprintf(f,
          "usage: gmb-replay --trace FILE [--compaction off|auto] [--cache]\n"
          "                  [--json] [--series FILE] [--broker PATH] "
          "[--verbose]\n\n"
          "Replays an allocation trace through a real gmb-broker on the host\n"
          "device (capacity from the trace), one client process per tenant,\n"
          "and prints what failed and why.\n\n"
          "trace lines ('#' starts a comment):\n"
          "  capacity SIZE                     first; the device's size\n"
          "  quota TENANT SIZE                 before the tenant's first op\n"
          "  alloc TENANT KEY SIZE [movable]\n"
          "  free TENANT KEY\n"
          "  lock TENANT KEY | unlock TENANT KEY\n\n"
          "options:\n"
          "  --trace FILE        the trace to replay\n"
          "  --compaction MODE   the broker's compaction: auto (default) or "
          "off\n"
          "  --cache             allocate through each client's cache\n"
          "                      (gmb_malloc_async/gmb_free_async on one "
          "stream;\n"
          "                      blocks are pinned, lock/unlock do nothing)\n"
          "  --json              the figures as JSON\n"
          "  --series FILE       write 'op bytes_in_use largest_free "
          "in_segments\n"
          "                      free_total' about %d times along the trace\n"
          "  --broker PATH       the gmb-broker to run (default: the one next "
          "to\n"
          "                      gmb-replay, else PATH)\n"
          "  -v, --verbose       one line on stderr per failed operation\n"
          "  -h, --help          this text\n\n"
          "A fragmentation failure is GMB_E_NOMEM while capacity minus the\n"
          "rounded bytes of live allocations was at least the request.\n"
          "exit: 0 the replay ran (failures are figures), 1 the broker or a\n"
          "client failed or bytes were corrupted, 2 usage or a bad trace.\n",
          RP_SERIES_POINTS);
}

/* tests/fuzz/fuzz_replay.c includes this file without its main, to fuzz
 * the trace parser. */
#ifndef GMB_REPLAY_NO_MAIN
int main(int argc, char **argv) {
  struct rp_opts o = {.compaction = "auto"};
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    const char **val = NULL;
    if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
      rp_usage(stdout);
      return 0;
    } else if (strcmp(a, "--json") == 0) {
      o.json = 1;
    } else if (strcmp(a, "--cache") == 0) {
      o.cache = 1;
    } else if (strcmp(a, "-v") == 0 || strcmp(a, "--verbose") == 0) {
      o.verbose = 1;
    } else if (strcmp(a, "--trace") == 0) {
      val = &o.trace;
    } else if (strcmp(a, "--compaction") == 0) {
      val = &o.compaction;
    } else if (strcmp(a, "--series") == 0) {
      val = &o.series;
    } else if (strcmp(a, "--broker") == 0) {
      val = &o.broker;
    } else {
      return rp_fail(RP_EXIT_USAGE, "unknown argument '%s' (see --help)", a);
    }
    if (val) {
      if (++i >= argc)
        return rp_fail(RP_EXIT_USAGE, "%s needs a value", a);
      *val = argv[i];
    }
  }
  if (o.trace == NULL)
    return rp_fail(RP_EXIT_USAGE, "--trace FILE is required (see --help)");
  if (strcmp(o.compaction, "auto") != 0 && strcmp(o.compaction, "off") != 0)
    return rp_fail(RP_EXIT_USAGE, "--compaction: want off or auto, not '%s'",
                   o.compaction);
  struct rp_trace tr;
  memset(&tr, 0, sizeof tr);
  int rc = rp_trace_load(o.trace, &tr);
  if (rc == 0) {
    signal(SIGPIPE, SIG_IGN);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = rp_on_signal;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    rc = rp_run(&o, &tr);
  }
  rp_trace_free(&tr);
  return rc;
}
#endif /* GMB_REPLAY_NO_MAIN */
