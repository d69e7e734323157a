/*
 * shim.c - the session and pointer map shared by libgmb-preload.so and
 * libgmb-torch.so (see shim.h).
 *
 * Sessions are made at the first allocation, not in a constructor: a
 * program that never allocates device memory never talks to the broker,
 * and a library constructor must not start threads (ZeroMQ's) while the
 * loader holds its lock.  The default broker is tried once, first; then
 * each device gets its session at its first request, from the broker of
 * its GPU (one broker serves one GPU).  Whether a device has a broker is
 * decided that one time; a broker started later is not seen by this
 * process.
 *
 * The map holds pointer -> (allocation id, session, tag) for every live
 * allocation the shim gave out (id 0 for a block of a session's cache), so a free goes to the broker that gave
 * the memory whatever device is current then, in an open-addressing table under one mutex.  The broker's
 * round trip on each alloc and free costs far more than the mutex, so a
 * lock-free table would buy nothing measurable.  Invariants: a key is a
 * pointer gmb_lock or gmb_malloc_async returned (512-byte aligned, so never 0 or 1, which mark
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
  gmb_id id;     /* 0: a block of the session's cache (gmb_malloc_async) */
  gmb_client *c; /* the session it came from */
  unsigned tag;  /* GMB_SHIM_TAG_* */
};

/* One session per device of this process, connected at the first
 * request for that device; `tried` says the attempt was made (whatever
 * its outcome), under shim_conn_mu. */
struct shim_dev {
  int tried;
  gmb_client *c;
  char why[512];
};

static pthread_once_t shim_once = PTHREAD_ONCE_INIT;
static pthread_mutex_t shim_conn_mu = PTHREAD_MUTEX_INITIALIZER;
static struct shim_dev shim_devs[GMB_SHIM_MAX_DEVICES];
static gmb_client *shim_host; /* a host-device broker allowed for tests */
static int shim_default_ordinal = -1; /* the default broker's GPU, or -1 */
static char shim_default_why[512];    /* why the default broker is none */
static pid_t shim_pid;
static char shim_fork_why[] =
    "GMB_E_CONN: this process is a fork() child of the one that connected to "
    "the broker; it may not use the parent's session (nor, in CUDA, its "
    "context)";

static pthread_mutex_t shim_mu = PTHREAD_MUTEX_INITIALIZER;
static struct shim_slot *shim_tab;
static size_t shim_cap, shim_used, shim_deleted;

/* The default broker ($GMB_ENDPOINT, else the run dir's), once: a GPU
 * broker becomes the session of its GPU; a host broker serves every
 * device when tests allow it, and is refused otherwise. */
static void shim_start(void) {
  shim_pid = getpid();
  gmb_client *c = NULL;
  int rc = gmb_connect(NULL, NULL, &c);
  if (rc != 0) {
    snprintf(shim_default_why, sizeof shim_default_why, "%s",
             gmb_last_error(NULL));
    return;
  }
  gmb_device_info di;
  rc = gmb_device_get(c, &di);
  if (rc != 0) {
    snprintf(shim_default_why, sizeof shim_default_why, "%s",
             gmb_last_error(c));
    gmb_disconnect(c);
    return;
  }
  if (strcmp(di.kind, "cuda") != 0) {
    if (gmb__shim_env_flag("GMB_SHIM_ALLOW_HOST")) {
      shim_host = c;
      return;
    }
    snprintf(shim_default_why, sizeof shim_default_why,
             "GMB_E_DEVICE: the broker serves the %s device, not a GPU: its "
             "memory is host memory, which CUDA kernels cannot use",
             di.kind);
    gmb_disconnect(c);
    return;
  }
  if (di.ordinal >= 0 && di.ordinal < GMB_SHIM_MAX_DEVICES) {
    shim_default_ordinal = di.ordinal;
    shim_devs[di.ordinal].tried = 1;
    shim_devs[di.ordinal].c = c;
  } else {
    gmb_disconnect(c);
  }
}

/* Device d's session (d valid), connected at the first call: the broker
 * of its GPU (gmb_connect_gpu).  When there is none, the reason names the
 * default broker's refusal when that is what the user set up. */
static gmb_client *shim_dev_session(int d, const char **why) {
  struct shim_dev *sd = &shim_devs[d];
  pthread_mutex_lock(&shim_conn_mu);
  if (!sd->tried) {
    sd->tried = 1;
    char gpu[24];
    snprintf(gpu, sizeof gpu, "cuda:%d", d);
    gmb_client *c = NULL;
    int rc = gmb_connect_gpu(gpu, NULL, &c);
    if (rc == 0) {
      sd->c = c;
    } else if (shim_default_why[0] && shim_default_ordinal < 0 &&
               (rc == GMB_E_DEVICE || strstr(shim_default_why, "not a GPU"))) {
      /* No GPU to look for (no driver), or a default broker that was
       * refused: what happened to the default broker says more. */
      snprintf(sd->why, sizeof sd->why, "%s", shim_default_why);
    } else {
      snprintf(sd->why, sizeof sd->why, "%s", gmb_last_error(NULL));
    }
  }
  pthread_mutex_unlock(&shim_conn_mu);
  if (sd->c == NULL && why) *why = sd->why;
  return sd->c;
}

gmb_client *gmb__shim_session(int device, int *resolved, const char **why) {
  pthread_once(&shim_once, shim_start);
  if (resolved) *resolved = device;
  if (gmb__shim_forked()) {
    if (why) *why = shim_fork_why;
    return NULL;
  }
  if (shim_host) return shim_host;
  if (device < 0 && gmb_gpu_current(&device) != 0) {
    static char cur_why[512];
    static pthread_mutex_t cur_mu = PTHREAD_MUTEX_INITIALIZER;
    pthread_mutex_lock(&cur_mu);
    if (shim_default_why[0])
      snprintf(cur_why, sizeof cur_why, "%s", shim_default_why);
    else
      snprintf(cur_why, sizeof cur_why, "%s", gmb_last_error(NULL));
    pthread_mutex_unlock(&cur_mu);
    if (why) *why = cur_why;
    return NULL;
  }
  if (resolved) *resolved = device;
  if (device >= GMB_SHIM_MAX_DEVICES) {
    static char big_why[] = "GMB_E_DEVICE: a device ordinal past the shims' "
                            "limit of 64";
    if (why) *why = big_why;
    return NULL;
  }
  return shim_dev_session(device, why);
}

gmb_client *gmb__shim_client(const char **why) {
  return gmb__shim_session(-1, NULL, why);
}

int gmb__shim_forked(void) {
  return shim_pid != 0 && getpid() != shim_pid;
}

int gmb__shim_host(void) {
  pthread_once(&shim_once, shim_start);
  return shim_host != NULL;
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

static int shim_put(void *ptr, gmb_id id, gmb_client *c, unsigned tag) {
  pthread_mutex_lock(&shim_mu);
  int rc = 0;
  if ((shim_used + shim_deleted + 1) * 4 > shim_cap * 3) rc = shim_grow();
  if (rc == 0) {
    struct shim_slot *s = shim_find((uintptr_t)ptr, 1);
    if (s->key == SHIM_DELETED) shim_deleted--;
    if (s->key != (uintptr_t)ptr) shim_used++;
    s->key = (uintptr_t)ptr;
    s->id = id;
    s->c = c;
    s->tag = tag;
  }
  pthread_mutex_unlock(&shim_mu);
  return rc;
}

/* Removes ptr; its id in *id, its session in *c, its tag in *tag.  0, or
 * GMB_E_NOENT when it is not there. */
static int shim_take(const void *ptr, gmb_id *id, gmb_client **c,
                     unsigned *tag) {
  pthread_mutex_lock(&shim_mu);
  struct shim_slot *s = shim_find((uintptr_t)ptr, 0);
  int rc = GMB_E_NOENT;
  if (s) {
    *id = s->id;
    *c = s->c;
    *tag = s->tag;
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

int gmb__shim_is_async(const void *ptr, unsigned *tag) {
  if ((uintptr_t)ptr <= SHIM_DELETED) return -1;
  pthread_mutex_lock(&shim_mu);
  struct shim_slot *s = shim_find((uintptr_t)ptr, 0);
  int r = s ? s->id == 0 : -1;
  if (s && tag) *tag = s->tag;
  pthread_mutex_unlock(&shim_mu);
  return r;
}

gmb_client *gmb__shim_owner(const void *ptr) {
  if ((uintptr_t)ptr <= SHIM_DELETED) return NULL;
  pthread_mutex_lock(&shim_mu);
  struct shim_slot *s = shim_find((uintptr_t)ptr, 0);
  gmb_client *c = s ? s->c : NULL;
  pthread_mutex_unlock(&shim_mu);
  return c;
}

int gmb__shim_alloc(gmb_client *c, size_t size, void **ptr) {
  gmb_id id = 0;
  int rc = gmb_alloc(c, size, 0, &id);
  if (rc) return rc;
  void *p = NULL;
  rc = gmb_lock(c, id, &p); /* pinned: never moves, nothing to unlock */
  if (rc == 0 && (uintptr_t)p <= SHIM_DELETED) rc = GMB_E_PROTO;
  if (rc == 0) rc = shim_put(p, id, c, 0);
  if (rc) {
    gmb_free(c, id);
    return rc;
  }
  *ptr = p;
  return 0;
}

int gmb__shim_free(void *ptr) {
  gmb_id id;
  gmb_client *c;
  unsigned tag;
  if ((uintptr_t)ptr <= SHIM_DELETED || shim_take(ptr, &id, &c, &tag))
    return GMB_E_NOENT;
  if (id == 0) { /* a block of the cache: put back, not this path's */
    if (shim_put(ptr, id, c, tag) != 0) return GMB_E_SYSTEM;
    return GMB_E_INVAL;
  }
  int rc = gmb_free(c, id);
  /* Not freed (the wait for the GPU failed, the broker refused): still
   * ours, still allocated.  A dead session took the memory with it. */
  if (rc && rc != GMB_E_CONN && rc != GMB_E_EVICTED && rc != GMB_E_NOENT &&
      shim_put(ptr, id, c, tag) != 0)
    rc = GMB_E_SYSTEM;
  return rc;
}

int gmb__shim_malloc_async(gmb_client *c, size_t size, void *stream,
                           unsigned tag, void **ptr) {
  void *p = NULL;
  int rc = gmb_malloc_async(c, size, stream, &p);
  if (rc) return rc;
  /* id 0: a block of the session's cache, not an allocation of its own. */
  if ((uintptr_t)p <= SHIM_DELETED) rc = GMB_E_PROTO;
  else rc = shim_put(p, 0, c, tag);
  if (rc) {
    gmb_free_async(c, p, stream);
    return rc;
  }
  *ptr = p;
  return 0;
}

int gmb__shim_free_async(void *ptr, void *stream) {
  gmb_id id;
  gmb_client *c;
  unsigned tag;
  if ((uintptr_t)ptr <= SHIM_DELETED || shim_take(ptr, &id, &c, &tag))
    return GMB_E_NOENT;
  if (id != 0) { /* gmb__shim_alloc's: put back, not this path's */
    if (shim_put(ptr, id, c, tag) != 0) return GMB_E_SYSTEM;
    return GMB_E_INVAL;
  }
  int rc = gmb_free_async(c, ptr, stream);
  /* Not freed (the stream took no event): still ours, still in use.  A
   * dead session took the memory with it. */
  if (rc && rc != GMB_E_CONN && rc != GMB_E_EVICTED && rc != GMB_E_NOENT &&
      shim_put(ptr, id, c, tag) != 0)
    rc = GMB_E_SYSTEM;
  return rc;
}

int gmb__shim_trim_all(size_t keep_bytes) {
  pthread_once(&shim_once, shim_start);
  if (gmb__shim_forked()) return GMB_E_CONN;
  if (shim_host) return gmb_trim(shim_host, keep_bytes);
  int first = 0;
  for (int d = 0; d < GMB_SHIM_MAX_DEVICES; d++) {
    pthread_mutex_lock(&shim_conn_mu);
    gmb_client *c = shim_devs[d].c;
    pthread_mutex_unlock(&shim_conn_mu);
    if (c == NULL) continue;
    int rc = gmb_trim(c, keep_bytes);
    if (rc && first == 0) first = rc;
  }
  return first;
}

int gmb__shim_keep(void *ptr) {
  gmb_id id;
  gmb_client *c;
  unsigned tag;
  if ((uintptr_t)ptr <= SHIM_DELETED || shim_take(ptr, &id, &c, &tag))
    return GMB_E_NOENT;
  return 0;
}

int gmb__shim_env_flag(const char *name) {
  const char *s = getenv(name);
  if (s == NULL) return 0;
  return !strcmp(s, "1") || !strcasecmp(s, "yes") || !strcasecmp(s, "true") ||
         !strcasecmp(s, "on");
}
