/*
 * dp.h - what gmb-device-plugin's modules share: its settings, the GPUs it
 * advertises (one broker each), and the allocations it made (one tenant
 * each).  dp_main.c reads the command line and the config and runs the
 * loop; dp_plugin.c answers the kubelet and keeps the tenants; dp_state.c
 * writes and reads the state file; dp_grpc.c is the gRPC layer.
 *
 * Units.  GPU g's broker capacity C is advertised as floor(C / unit)
 * devices named "KEY_N" (KEY: the GPU's UUID, or "gmb" for a single broker
 * in the run dir itself; N: 0..units-1).  An allocation of k units of one
 * GPU is a tenant on its broker with quota k x unit.
 */
#ifndef GMB_DP_H
#define GMB_DP_H

#include <limits.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

#include "admin_rpc.h"

#define DP_GPUS_MAX 16
#define DP_ALLOCS_MAX 4096    /* the broker's tenant registry holds 4096 */
#define DP_UNITS_MAX 2048     /* per GPU: the list stays under 2 MiB */
#define DP_KEY_MAX 64
#define DP_PATH_MAX 512

struct dp_conf {
  char kubelet_dir[DP_PATH_MAX];   /* its kubelet.sock, and our socket */
  char pod_resources[DP_PATH_MAX]; /* the pod-resources socket */
  char run_dir[DP_PATH_MAX];       /* the brokers' run dir (base) */
  int per_gpu;                     /* brokers in RUN_DIR/UUID */
  uint64_t unit;                   /* bytes per advertised unit */
  char resource[128];              /* "gmb.io/memory" */
  char endpoint[64];               /* our socket's name in kubelet_dir */
  unsigned reserve_pct;            /* reservation: this % of the quota */
  char gpus[DP_GPUS_MAX][DP_KEY_MAX]; /* only these UUIDs; none: all */
  size_t n_gpus;
  int token_env;                   /* token as GMB_TOKEN, not a file */
  char state_dir[DP_PATH_MAX];     /* state file and tokens/ */
  char preload[DP_PATH_MAX];       /* host path of libgmb-preload.so; "" */
  char container_run_dir[DP_PATH_MAX]; /* where the pod sees the run dir */
  int poll_ms;                     /* brokers' health, the kubelet socket */
  int gc_ms;                       /* pod-resources List period */
  int grace_s;                     /* an allocation this young is kept */
};

struct dp_gpu {
  char key[DP_KEY_MAX];
  char dir[DP_PATH_MAX + DP_KEY_MAX + 2]; /* its broker's run dir */
  uint64_t capacity;      /* as the broker said last; 0: never heard */
  uint32_t units;
  int up;
  struct admin_rpc *rpc;  /* NULL while down */
};

struct dp_alloc {
  char tenant[64];
  int gpu;                /* index in dp->gpu */
  uint64_t quota, reserve;
  uint8_t sha256[32];
  time_t made;
  int gone;               /* its pod left; the tenant is being removed */
  uint32_t n_units;
  uint32_t *units;        /* sorted */
};

struct dp {
  struct dp_conf conf;
  struct dp_gpu gpu[DP_GPUS_MAX];
  size_t n_gpu;
  struct dp_alloc *allocs;
  size_t n_allocs, cap_allocs;
  int list_changed;       /* the device list must go out again */
};

/* dp_state.c: the state file, STATE_DIR/state.  Save writes it whole
 * through a temporary file and a rename; 0 or -1 with why.  Load reads it
 * when it exists (0 also when it does not), adding its GPUs and
 * allocations. */
int dp_state_save(const struct dp *dp, char *why, size_t cap);
int dp_state_load(struct dp *dp, char *why, size_t cap);
/* STATE_DIR/tokens/NAME into buf: the file of the token whose SHA-256 is
 * `sha256`, NAME a secret derived from it (dp_state.c). */
char *dp_token_path(const struct dp *dp, const uint8_t sha256[32], char *buf,
                    size_t cap);
/* Removes allocation a's token file (and one an earlier version named after
 * its tenant). */
void dp_token_unlink(const struct dp *dp, const struct dp_alloc *a);
/* The state directory and STATE_DIR/tokens (made when missing) are
 * directories of this uid or root that no one else may write, and tokens/
 * one no one else may list (chmod 0711 when it could be).  0, or -1 with
 * why: the plugin does not start. */
int dp_state_dir_check(const struct dp *dp, char *why, size_t cap);

/* dp_plugin.c */
/* The GPU with this key, added when new (its run dir from the layout);
 * -1 when the table is full. */
int dp_gpu_get(struct dp *dp, const char *key);
/* Frees an allocation's parts and takes it out of the table. */
void dp_alloc_drop(struct dp *dp, size_t i);

struct dpg;
struct dpg_call;
/* The device list as a ListAndWatchResponse (malloc'd bytes). */
int dp_list_encode(const struct dp *dp, uint8_t **buf, size_t *len);
/* Asks every broker how it is (and finds new ones): a broker back up gets
 * its tenants again; list_changed is set when a health or a count
 * changed. */
void dp_brokers_poll(struct dp *dp);
/* Answers one call of the kubelet's (method: enum dpg_method); `g` asks
 * pod-resources when an Allocate names units an allocation still holds. */
void dp_handle(struct dp *dp, struct dpg *g, struct dpg_call *call,
               int method, const uint8_t *req, size_t len);
/* Asks the kubelet's pod-resources List which units are still held, marks
 * the allocations of pods that are gone, and removes their tenants once
 * their sessions ended. */
void dp_collect(struct dp *dp, struct dpg *g);
/* Closes the admin sockets and frees the tables. */
void dp_free(struct dp *dp);

/* Logs one line on stderr, with the time. */
void dp_log(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

#endif /* GMB_DP_H */
