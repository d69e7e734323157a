/*
 * config.h - the broker's configuration: defaults, the INI file (read with
 * inih) and the command line's overrides.
 *
 * Loading never half-succeeds: either the whole file is valid and *out is
 * filled, or an error names the file and line ("gmb.ini:12: quota: bad
 * size 'x'") and *out is left as it was.  Unknown sections and keys are
 * errors, so a typo never silently drops a limit.
 */
#ifndef GMB_CONFIG_H
#define GMB_CONFIG_H

#include <limits.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#define GMB_CONFIG_UIDS_MAX 64
/* cache_holes when the config does not say: an eighth of the quota. */
#define GMB_CACHE_HOLES_DEFAULT 0.125

struct gmb_tenant_conf {
  char name[64];
  uint64_t quota;     /* 0: no limit */
  uint64_t reserve;   /* 0: none */
  int priority;       /* default 0 */
  uint64_t host_quota; /* host bytes its paused tags may hold; 0: no limit */
  uid_t uids[GMB_CONFIG_UIDS_MAX];
  size_t n_uids;      /* 0: any uid may act as it (unless a token is set) */
  int has_token;
  uint8_t token_sha256[32];
  int line;           /* where its section starts, for messages */
};

struct gmb_config {
  char device[64];          /* "auto", "host:SIZE", "cuda:N" */
  uint64_t capacity;        /* 0: what the device has */
  uint64_t device_reserve;  /* cuda: bytes left to others;
                               GMB_DEVICE_RESERVE_AUTO: client_contexts
                               times a context's measured cost */
  uint32_t client_contexts; /* how many clients' contexts auto leaves
                               room for */
  char run_dir[PATH_MAX];   /* "" : gmb__run_dir() */
  int run_dir_per_gpu;      /* 1: sockets in RUN_DIR/UUID, state file
                               STATE.UUID, metrics port + N (cuda:N) */
  char state[PATH_MAX];     /* "" : no state file */
  uid_t admin_uids[GMB_CONFIG_UIDS_MAX];
  size_t n_admin_uids;      /* the broker's own uid is always admin */
  uint64_t default_quota;   /* for tenants the config does not name;
                               GMB_DEFAULT_QUOTA_AUTO until resolved */
  int compaction;           /* 1 auto, 0 off */
  double compaction_threshold;
  double cache_holes;       /* the part of a tenant's quota that the holes
                               between blocks in its caches' pages may take
                               uncharged (0..1; 0: pages charged whole) */
  char metrics_listen[64];  /* "" : no HTTP endpoint */
  int metrics_tenants;      /* 1: the HTTP endpoint shows per-tenant series
                               (names, usage, sessions); 0: only totals */
  int admin_http;           /* 1: serve admin-http.sock (http_admin.h) */
  int log_level;            /* GMB_LOG_* */
  uint32_t heartbeat_ms;    /* period asked of clients whose pid the broker
                               cannot watch; a session is ended after 3
                               missed periods */
  uint32_t shutdown_grace_ms; /* at a stop, how long sessions that still
                               map retiring segments get to unmap them */
  /* Limits on what clients can make the broker hold: each is
   * refused with GMB_E_LIMIT past its value, and the broker serves on. */
  uint32_t max_sessions;          /* sessions in all (lowered at start to
                                     what RLIMIT_NOFILE allows) */
  uint32_t max_sessions_per_uid;
  uint32_t max_tenants_per_uid;   /* tenants a uid made by first use */
  uint32_t max_waiters_per_session; /* gmb_alloc_wait requests queued */
  uint32_t max_waiters_per_tenant;
  uint32_t segment_linger_ms; /* how often the empty segments the pool
                               keeps for reuse (one per size class) are
                               released; 0: only when a request needs
                               their room */
  uint32_t trim_wait_ms;    /* how long a request that found the device
                               full, or its tenant's quota held by its
                               other sessions' caches, is held while they
                               are asked back (0: they are not asked) */
  uint32_t sleep_wait_ms;   /* how long such a request is held while idle
                               sessions of no higher priority are asked to
                               pause (EVENT_SLEEP); 0: none is asked */
  uint64_t offload_host_max; /* host memory the broker may hold for the
                               movable allocations it offloads itself, all
                               tenants together (offload.c); 0: it never
                               offloads.  Default: a quarter of the host's
                               memory */
  uint64_t default_host_quota; /* host_quota of the tenants the config
                               does not name (made by first use or by
                               tenant add); 0: no limit;
                               GMB_DEFAULT_HOST_QUOTA_AUTO (the default):
                               gmb__config_default_host_quota */
  uint32_t restore_wait_ms; /* how long a gmb_lock of an offloaded
                               allocation is held while the device has no
                               room to bring it back */
  struct gmb_tenant_conf *tenants; /* owned */
  size_t n_tenants;
};

/* Fills *c with the defaults (device auto, no limits, log info, heartbeat
 * 1000 ms, compaction auto at 0.3). */
void gmb__config_defaults(struct gmb_config *c);

/* Reads `path` on top of the defaults.  0 on success; GMB_E_INVAL (bad
 * content) or GMB_E_SYSTEM (cannot open) with "FILE:LINE: reason" (or
 * "FILE: reason") in err. */
int gmb__config_load(const char *path, struct gmb_config *out, char *err,
                     size_t errcap);

/* The tenant section named `name`, or NULL. */
const struct gmb_tenant_conf *gmb__config_tenant(const struct gmb_config *c,
                                                 const char *name);

/* Releases what *c owns; accepts a zeroed struct. */
void gmb__config_free(struct gmb_config *c);

/* The admin socket's file mode: 0600 unless admin_uids names a uid other
 * than the broker's, in which case the per-message uid check is what keeps
 * others out (0666). */
mode_t gmb__config_admin_mode(const struct gmb_config *c);

/*
 * The kernel's overflow uid (/proc/sys/kernel/overflowuid; 65534, its
 * default, when that cannot be read), read once.  SO_PEERCRED reports it
 * for every peer whose uid has no mapping in the broker's user namespace,
 * so it names no one in particular: admin_uids and a tenant's uids may not
 * name it (the config is refused), and it is never an operator.
 */
uid_t gmb__config_overflow_uid(void);

/* 1 when a peer whose SO_PEERCRED uid is `uid` is an operator: the
 * broker's own uid or one of admins[0..n), and never `overflow` (the
 * overflow uid: an unmapped peer's), even when the broker runs as it.
 * The one operator rule: the admin socket's check and its connection
 * caps both use it. */
int gmb__config_operator(const uid_t *admins, size_t n, uid_t overflow,
                         uid_t uid);

/* offload_host_max's default: a quarter of the host's physical memory. */
uint64_t gmb__config_offload_default(void);

/* `default_quota = auto`: a quarter of the device (in whole segments),
 * resolved by gmb__config_default_quota once the capacity is known. */
#define GMB_DEFAULT_QUOTA_AUTO UINT64_MAX
#define GMB_DEVICE_RESERVE_AUTO UINT64_MAX
uint64_t gmb__config_default_quota(const struct gmb_config *c,
                                   uint64_t capacity);

/* `default_host_quota = auto` (the default): a quarter of
 * offload_host_max, rounded up (of its default when offload_host_max is 0,
 * since paused tags' copies still count), so that no one tenant the config
 * does not name can take all of the broker's host memory for offloads. */
#define GMB_DEFAULT_HOST_QUOTA_AUTO UINT64_MAX
uint64_t gmb__config_default_host_quota(const struct gmb_config *c);

#endif /* GMB_CONFIG_H */
