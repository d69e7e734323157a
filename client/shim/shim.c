/*
 * shim.c - the session and pointer map shared by libgmb-preload.so and
 * libgmb-torch.so (see shim.h).
 *
 * The session is made once per process, at the first allocation, not in a
 * constructor: a program that never allocates device memory never talks to
 * the broker, and a library constructor must not start threads (ZeroMQ's)
 * while the loader holds its lock.  Whether a broker answered is decided
 * that one time; a broker started later is not seen by this process.
 *
 * The map holds pointer -> allocation id for every live allocation the shim
 * gave out, in an open-addressing table under one mutex.  The broker's
 * round trip on each alloc and free costs far more than the mutex, so a
 * lock-free table would buy nothing measurable.  Invariants: a key is a
 * pointer gmb_lock returned (512-byte aligned, so never 0 or 1, which mark
 * empty and deleted slots); `used + deleted` stays under 3/4 of `cap`.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "shim.h"

#define SHIM_EMPTY ((uintptr_t)0)
#define SHIM_DELETED ((uintptr_t)1)

struct shim_slot {
  uintptr_t key;
  gmb_id id;
};

static pthread_once_t shim_once = PTHREAD_ONCE_INIT;
static gmb_client *shim_client;
static pid_t shim_pid;
static char shim_why[512];
static char shim_fork_why[] =
    "GMB_E_CONN: this process is a fork() child of the one that connected to "
    "the broker; it may not use the parent's session (nor, in CUDA, its "
    "context)";

static pthread_mutex_t shim_mu = PTHREAD_MUTEX_INITIALIZER;
static struct shim_slot *shim_tab;
static size_t shim_cap, shim_used, shim_deleted;

static int shim_ordinal = -1;

static void shim_connect(void) {
  shim_pid = getpid();
  gmb_client *c = NULL;
  int rc = gmb_connect(NULL, NULL, &c);
  if (rc != 0) {
    snprintf(shim_why, sizeof shim_why, "%s", gmb_last_error(NULL));
    return;
  }
  gmb_device_info di;
  rc = gmb_device_get(c, &di);
  if (rc == 0 && strcmp(di.kind, "cuda") != 0 &&
      !gmb__shim_env_flag("GMB_SHIM_ALLOW_HOST")) {
    snprintf(shim_why, sizeof shim_why,
             "GMB_E_DEVICE: the broker serves the %s device, not a GPU: its "
             "memory is host memory, which CUDA kernels cannot use",
             di.kind);
    gmb_disconnect(c);
    return;
  }
  if (rc != 0) {
    snprintf(shim_why, sizeof shim_why, "%s", gmb_last_error(c));
    gmb_disconnect(c);
    return;
  }
  shim_ordinal = di.ordinal;
  shim_client = c;
}

int gmb__shim_device(void) {
  return shim_client ? shim_ordinal : -1;
}

int gmb__shim_forked(void) {
  return shim_pid != 0 && getpid() != shim_pid;
}

gmb_client *gmb__shim_client(const char **why) {
  pthread_once(&shim_once, shim_connect);
  if (gmb__shim_forked()) {
    if (why) *why = shim_fork_why;
    return NULL;
  }
  if (shim_client == NULL && why) *why = shim_why;
  return shim_client;
}

/* --- the pointer map ------------------------------------------------------- */

static size_t shim_hash(uintptr_t k, size_t cap) {
  uint64_t h = (uint64_t)k * UINT64_C(0x9E3779B97F4A7C15);
  return (size_t)(h >> 17) & (cap - 1);
}

/* The slot of key k, or of the first free place where it would go (with
 * `insert`).  Callers hold shim_mu. */
static struct shim_slot *shim_find(uintptr_t k, int insert) {
  if (shim_cap == 0) return NULL;
  struct shim_slot *tomb = NULL;
  for (size_t i = shim_hash(k, shim_cap), n = 0; n < shim_cap;
       i = (i + 1) & (shim_cap - 1), n++) {
    struct shim_slot *s = &shim_tab[i];
    if (s->key == k) return s;
    if (s->key == SHIM_DELETED) {
      if (tomb == NULL) tomb = s;
    } else if (s->key == SHIM_EMPTY) {
      return insert ? (tomb ? tomb : s) : NULL;
    }
  }
  return insert ? tomb : NULL;
}

static int shim_grow(void) {
  size_t ncap = shim_cap ? shim_cap * 2 : 256;
  if (shim_used * 2 < shim_cap) ncap = shim_cap; /* tombstones only */
  struct shim_slot *old = shim_tab, *nt = calloc(ncap, sizeof *nt);
  if (nt == NULL) return GMB_E_SYSTEM;
  size_t ocap = shim_cap;
  shim_tab = nt;
  shim_cap = ncap;
  shim_deleted = 0;
  for (size_t i = 0; i < ocap; i++)
    if (old[i].key > SHIM_DELETED) *shim_find(old[i].key, 1) = old[i];
  free(old);
  return 0;
}

static int shim_put(void *ptr, gmb_id id) {
  pthread_mutex_lock(&shim_mu);
  int rc = 0;
  if ((shim_used + shim_deleted + 1) * 4 > shim_cap * 3) rc = shim_grow();
  if (rc == 0) {
    struct shim_slot *s = shim_find((uintptr_t)ptr, 1);
    if (s->key == SHIM_DELETED) shim_deleted--;
    if (s->key != (uintptr_t)ptr) shim_used++;
    s->key = (uintptr_t)ptr;
    s->id = id;
  }
  pthread_mutex_unlock(&shim_mu);
  return rc;
}

/* Removes ptr; its id in *id.  0, or GMB_E_NOENT when it is not there. */
static int shim_take(const void *ptr, gmb_id *id) {
  pthread_mutex_lock(&shim_mu);
  struct shim_slot *s = shim_find((uintptr_t)ptr, 0);
  int rc = GMB_E_NOENT;
  if (s) {
    *id = s->id;
    s->key = SHIM_DELETED;
    shim_used--;
    shim_deleted++;
    rc = 0;
  }
  pthread_mutex_unlock(&shim_mu);
  return rc;
}

int gmb__shim_owns(const void *ptr) {
  if ((uintptr_t)ptr <= SHIM_DELETED) return 0;
  pthread_mutex_lock(&shim_mu);
  int r = shim_find((uintptr_t)ptr, 0) != NULL;
  pthread_mutex_unlock(&shim_mu);
  return r;
}

int gmb__shim_alloc(gmb_client *c, size_t size, void **ptr) {
  gmb_id id = 0;
  int rc = gmb_alloc(c, size, 0, &id);
  if (rc) return rc;
  void *p = NULL;
  rc = gmb_lock(c, id, &p); /* pinned: never moves, nothing to unlock */
  if (rc == 0 && (uintptr_t)p <= SHIM_DELETED) rc = GMB_E_PROTO;
  if (rc == 0) rc = shim_put(p, id);
  if (rc) {
    gmb_free(c, id);
    return rc;
  }
  *ptr = p;
  return 0;
}

int gmb__shim_free(gmb_client *c, void *ptr) {
  gmb_id id;
  if ((uintptr_t)ptr <= SHIM_DELETED || shim_take(ptr, &id)) return GMB_E_NOENT;
  int rc = gmb_free(c, id);
  /* Not freed (the wait for the GPU failed, the broker refused): still
   * ours, still allocated.  A dead session took the memory with it. */
  if (rc && rc != GMB_E_CONN && rc != GMB_E_EVICTED && rc != GMB_E_NOENT &&
      shim_put(ptr, id) != 0)
    rc = GMB_E_SYSTEM;
  return rc;
}

int gmb__shim_keep(void *ptr) {
  gmb_id id;
  if ((uintptr_t)ptr <= SHIM_DELETED || shim_take(ptr, &id)) return GMB_E_NOENT;
  return 0;
}

int gmb__shim_env_flag(const char *name) {
  const char *s = getenv(name);
  if (s == NULL) return 0;
  return !strcmp(s, "1") || !strcasecmp(s, "yes") || !strcasecmp(s, "true") ||
         !strcasecmp(s, "on");
}
