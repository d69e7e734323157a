/*
 * shim.c - the session and pointer map shared by libgmb-preload.so and
 * libgmb-torch.so (see shim.h).
 *
 * Sessions are made at the first allocation, not in a constructor: a
 * program that never allocates device memory never talks to the broker,
 * and a library constructor must not start threads (ZeroMQ's) while the
 * loader holds its lock.  The calling thread's current device is read
 * before anything connects (connecting changes no thread's context).
 * The default broker is tried once, first; then
 * each device gets its session at its first request, from the broker of
 * its GPU (one broker serves one GPU).  Whether a device has a broker is
 * decided that one time; a broker started later is not seen by this
 * process.
 *
 * A fork() child may not use its parent's sessions.  It is told by a
 * pthread_atfork child handler, registered when the first session is
 * made, that sets a flag: reading it costs a load, where asking getpid()
 * on every call cost a system call (about 1 us on a VM), more than the
 * cache's whole alloc+free pair.  A child made without the handlers
 * (a raw clone or fork system call) is not seen; such a child normally
 * runs nothing but exec.
 *
 * The map holds pointer -> (allocation id, session, tag) for every live
 * allocation the shim gave out (id 0 for a block of a session's cache),
 * so a free goes to the broker that gave the memory whatever device is
 * current then.  It is SHIM_SHARDS open-addressing tables, the shard
 * chosen by the pointer's hash, each under a lock of its own: an
 * allocation or a free through the cache takes no global lock (threads
 * meet only when their pointers hash to one shard), and a free makes one
 * lookup (gmb__shim_async_take), which hands back everything the caller
 * needs.  Invariants, per shard (under its lock): a key is a pointer gmb_lock or
 * gmb_malloc_async returned (512-byte aligned, so never 0 or 1, which
 * mark empty and deleted slots); `used + deleted` stays under 3/4 of
 * `cap`.
 */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
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
  /* Written once, under shim_conn_mu; read without it by a free
   * (gmb__shim_session_of), hence atomic. */
  _Atomic(gmb_client *) c;
  char why[512];
};

static pthread_once_t shim_once = PTHREAD_ONCE_INIT;
static pthread_mutex_t shim_conn_mu = PTHREAD_MUTEX_INITIALIZER;
static struct shim_dev shim_devs[GMB_SHIM_MAX_DEVICES];
static gmb_client *shim_host; /* a host-device broker allowed for tests */
/* shim_start has run (release): shim_host and the default broker's
 * session are set; read by gmb__shim_session_of, which never connects. */
static atomic_int shim_started;
static int shim_default_ordinal = -1; /* the default broker's GPU, or -1 */
static char shim_default_why[512];    /* why the default broker is none */
/* Set in a fork() child of the process that made the first session
 * (shim.h: gmb__shim_forked reads it inline). */
atomic_int gmb__shim_in_child;
static char shim_fork_why[] =
    "GMB_E_CONN: this process is a fork() child of the one that connected to "
    "the broker; it may not use the parent's session (nor, in CUDA, its "
    "context)";

/* A power of two; 64 shards of 64 bytes each keep threads that free
 * different pointers off each other's cache lines. */
#define SHIM_SHARDS 64

/* Each shard's lock is a spin lock, not a mutex: it is held for one
 * probe of an open-addressing table (a growth, rarer, rehashes one
 * shard), so a waiter spins briefly and then yields; taking and leaving
 * it costs one atomic exchange and one store, where a mutex costs two
 * atomic read-modify-writes, and an uncontended pair of those costs as
 * much as a quarter of the cache's own alloc+free pair. */
struct shim_shard {
  atomic_int lock;
  struct shim_slot *tab;
  size_t cap, used, deleted;
} __attribute__((aligned(64)));

static struct shim_shard shim_shards[SHIM_SHARDS];

static void shim_lock(struct shim_shard *h) {
  while (atomic_exchange_explicit(&h->lock, 1, memory_order_acquire)) {
    for (int spins = 0;
         atomic_load_explicit(&h->lock, memory_order_relaxed); spins++) {
      if (spins >= 100)
        sched_yield(); /* its holder may be descheduled */
#if defined(__x86_64__) || defined(__i386__)
      else
        __builtin_ia32_pause();
#endif
    }
  }
}

static void shim_unlock(struct shim_shard *h) {
  atomic_store_explicit(&h->lock, 0, memory_order_release);
}

/* The child has one thread: a shard lock another thread of the parent
 * held at the fork would never be released, so the locks start free (the
 * child only reads the map, to refuse what it is asked). */
static void shim_atfork_child(void) {
  atomic_store_explicit(&gmb__shim_in_child, 1, memory_order_relaxed);
  for (int i = 0; i < SHIM_SHARDS; i++)
    atomic_store_explicit(&shim_shards[i].lock, 0, memory_order_relaxed);
}

/* The default broker ($GMB_ENDPOINT, else the run dir's), once: a GPU
 * broker becomes the session of its GPU; a host broker serves every
 * device when tests allow it, and is refused otherwise. */
static void shim_start(void) {
  /* Before the first connect: a child forked from here on is refused. */
  pthread_atfork(NULL, NULL, shim_atfork_child);
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
    atomic_store(&shim_devs[di.ordinal].c, c);
  } else {
    gmb_disconnect(c);
  }
}

/* shim_start, and then a flag that says it ran, for gmb__shim_session_of. */
static void shim_start_once(void) {
  shim_start();
  atomic_store_explicit(&shim_started, 1, memory_order_release);
}

/* Device d's session (d valid), connected at the first call: the broker
 * of its GPU (gmb_connect_gpu).  When there is none, the reason names the
 * default broker's refusal when that is what the user set up. */
static gmb_client *shim_dev_session(int d, const char **why) {
  struct shim_dev *sd = &shim_devs[d];
  /* Every allocation comes here: once connected, a load and no lock (the
   * session is written once and never changes). */
  gmb_client *c = atomic_load_explicit(&sd->c, memory_order_acquire);
  if (__builtin_expect(c != NULL, 1)) return c;
  pthread_mutex_lock(&shim_conn_mu);
  if (!sd->tried) {
    sd->tried = 1;
    char gpu[24];
    snprintf(gpu, sizeof gpu, "cuda:%d", d);
    gmb_client *nc = NULL;
    int rc = gmb_connect_gpu(gpu, NULL, &nc);
    if (rc == 0) {
      atomic_store(&sd->c, nc);
    } else if (shim_default_why[0] && shim_default_ordinal < 0 &&
               (rc == GMB_E_DEVICE || strstr(shim_default_why, "not a GPU"))) {
      /* No GPU to look for (no driver), or a default broker that was
       * refused: what happened to the default broker says more. */
      snprintf(sd->why, sizeof sd->why, "%s", shim_default_why);
    } else {
      snprintf(sd->why, sizeof sd->why, "%s", gmb_last_error(NULL));
    }
  }
  c = atomic_load(&sd->c);
  pthread_mutex_unlock(&shim_conn_mu);
  if (c == NULL && why) *why = sd->why;
  return c;
}

gmb_client *gmb__shim_session(int device, int *resolved, const char **why) {
  /* The current device is read before the first connection: the request
   * goes to the broker of the device the program chose, whatever broker
   * the default endpoint names (1 known, -1 not to be known). */
  int known = 0;
  if (!atomic_load_explicit(&shim_started, memory_order_acquire)) {
    if (device < 0) known = gmb_gpu_current(&device) == 0 ? 1 : -1;
    pthread_once(&shim_once, shim_start_once);
  }
  if (resolved) *resolved = device;
  if (gmb__shim_forked()) {
    if (why) *why = shim_fork_why;
    return NULL;
  }
  if (shim_host) return shim_host;
  if (device < 0 && (known < 0 || gmb_gpu_current(&device) != 0)) {
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

gmb_client *gmb__shim_session_of(int device) {
  if (!atomic_load_explicit(&shim_started, memory_order_acquire))
    return NULL;
  if (shim_host) return shim_host;
  if (device < 0 || device >= GMB_SHIM_MAX_DEVICES) return NULL;
  return atomic_load_explicit(&shim_devs[device].c, memory_order_acquire);
}

int gmb__shim_sessions(gmb_client **out, int cap) {
  if (!atomic_load_explicit(&shim_started, memory_order_acquire)) return 0;
  if (shim_host) {
    if (cap > 0) out[0] = shim_host;
    return 1;
  }
  int n = 0;
  for (int d = 0; d < GMB_SHIM_MAX_DEVICES; d++) {
    gmb_client *c = atomic_load(&shim_devs[d].c);
    if (c == NULL) continue;
    if (n < cap) out[n] = c;
    n++;
  }
  return n;
}

gmb_client *gmb__shim_client(const char **why) {
  return gmb__shim_session(-1, NULL, why);
}

int gmb__shim_host(void) {
  /* Once started, a load: this is on every allocation's path. */
  if (!atomic_load_explicit(&shim_started, memory_order_acquire))
    pthread_once(&shim_once, shim_start_once);
  return shim_host != NULL;
}

/* --- the pointer map ------------------------------------------------------- */

static uint64_t shim_hash(uintptr_t k) {
  return (uint64_t)k * UINT64_C(0x9E3779B97F4A7C15);
}

/* The shard of key k (its hash's top bits; the table index uses others). */
static struct shim_shard *shim_shard_of(uintptr_t k) {
  return &shim_shards[shim_hash(k) >> (64 - 6)];
}
_Static_assert(SHIM_SHARDS == 64, "shim_shard_of takes 6 bits");

/* The slot of key k in shard h, or of the first free place where it would
 * go (with `insert`).  Callers hold h->mu. */
static struct shim_slot *shim_find(struct shim_shard *h, uintptr_t k,
                                   int insert) {
  if (h->cap == 0) return NULL;
  struct shim_slot *tomb = NULL;
  for (size_t i = (size_t)(shim_hash(k) >> 17) & (h->cap - 1), n = 0;
       n < h->cap; i = (i + 1) & (h->cap - 1), n++) {
    struct shim_slot *s = &h->tab[i];
    if (s->key == k) return s;
    if (s->key == SHIM_DELETED) {
      if (tomb == NULL) tomb = s;
    } else if (s->key == SHIM_EMPTY) {
      return insert ? (tomb ? tomb : s) : NULL;
    }
  }
  return insert ? tomb : NULL;
}

static int shim_grow(struct shim_shard *h) {
  size_t ncap = h->cap ? h->cap * 2 : 64;
  if (h->used * 2 < h->cap) ncap = h->cap; /* tombstones only */
  struct shim_slot *old = h->tab, *nt = calloc(ncap, sizeof *nt);
  if (nt == NULL) return GMB_E_SYSTEM;
  size_t ocap = h->cap;
  h->tab = nt;
  h->cap = ncap;
  h->deleted = 0;
  for (size_t i = 0; i < ocap; i++)
    if (old[i].key > SHIM_DELETED) *shim_find(h, old[i].key, 1) = old[i];
  free(old);
  return 0;
}

static int shim_put(void *ptr, gmb_id id, gmb_client *c, unsigned tag) {
  struct shim_shard *h = shim_shard_of((uintptr_t)ptr);
  shim_lock(h);
  int rc = 0;
  if ((h->used + h->deleted + 1) * 4 > h->cap * 3) rc = shim_grow(h);
  if (rc == 0) {
    struct shim_slot *s = shim_find(h, (uintptr_t)ptr, 1);
    if (s->key == SHIM_DELETED) h->deleted--;
    if (s->key != (uintptr_t)ptr) h->used++;
    s->key = (uintptr_t)ptr;
    s->id = id;
    s->c = c;
    s->tag = tag;
  }
  shim_unlock(h);
  return rc;
}

/* Removes ptr; its id in *id, its session in *c, its tag in *tag.  0, or
 * GMB_E_NOENT when it is not there. */
static int shim_take(const void *ptr, gmb_id *id, gmb_client **c,
                     unsigned *tag) {
  if ((uintptr_t)ptr <= SHIM_DELETED) return GMB_E_NOENT;
  struct shim_shard *h = shim_shard_of((uintptr_t)ptr);
  shim_lock(h);
  struct shim_slot *s = shim_find(h, (uintptr_t)ptr, 0);
  int rc = GMB_E_NOENT;
  if (s) {
    *id = s->id;
    *c = s->c;
    *tag = s->tag;
    s->key = SHIM_DELETED;
    h->used--;
    h->deleted++;
    rc = 0;
  }
  shim_unlock(h);
  return rc;
}

/* Looks ptr up without removing it: 0 with what the map holds, or
 * GMB_E_NOENT. */
static int shim_get(const void *ptr, gmb_id *id, gmb_client **c,
                    unsigned *tag) {
  if ((uintptr_t)ptr <= SHIM_DELETED) return GMB_E_NOENT;
  struct shim_shard *h = shim_shard_of((uintptr_t)ptr);
  shim_lock(h);
  struct shim_slot *s = shim_find(h, (uintptr_t)ptr, 0);
  if (s) {
    *id = s->id;
    *c = s->c;
    *tag = s->tag;
  }
  shim_unlock(h);
  return s ? 0 : GMB_E_NOENT;
}

int gmb__shim_owns(const void *ptr) {
  gmb_id id;
  gmb_client *c;
  unsigned tag;
  return shim_get(ptr, &id, &c, &tag) == 0;
}

int gmb__shim_is_async(const void *ptr, unsigned *tag) {
  gmb_id id;
  gmb_client *c;
  unsigned t;
  if (shim_get(ptr, &id, &c, &t) != 0) return -1;
  if (tag) *tag = t;
  return id == 0;
}

gmb_client *gmb__shim_owner(const void *ptr) {
  gmb_id id;
  gmb_client *c;
  unsigned tag;
  return shim_get(ptr, &id, &c, &tag) == 0 ? c : NULL;
}

int gmb__shim_alloc(gmb_client *c, size_t size, void **ptr) {
  gmb_id id = 0;
  /* Untagged: the pointer is kept for good, so a pause of the thread's
   * tag must not wait for its unlock. */
  int rc = gmb_alloc(c, size, GMB_UNTAGGED, &id);
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
  if (shim_take(ptr, &id, &c, &tag)) return GMB_E_NOENT;
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

int gmb__shim_async_take(void *ptr, gmb_client **c, unsigned *tag) {
  gmb_id id;
  if (shim_take(ptr, &id, c, tag)) return GMB_E_NOENT;
  if (id != 0) { /* gmb__shim_alloc's: put back, not this path's */
    if (shim_put(ptr, id, *c, *tag) != 0) return GMB_E_SYSTEM;
    return GMB_E_INVAL;
  }
  return 0;
}

int gmb__shim_async_release(gmb_client *c, void *ptr, void *stream,
                            unsigned tag) {
  int rc = gmb_free_async(c, ptr, stream);
  /* Not freed (the stream took no event): still ours, still in use.  A
   * dead session took the memory with it. */
  if (rc && rc != GMB_E_CONN && rc != GMB_E_EVICTED && rc != GMB_E_NOENT &&
      shim_put(ptr, 0, c, tag) != 0)
    rc = GMB_E_SYSTEM;
  return rc;
}

int gmb__shim_free_async(void *ptr, void *stream) {
  gmb_client *c;
  unsigned tag;
  int rc = gmb__shim_async_take(ptr, &c, &tag);
  return rc ? rc : gmb__shim_async_release(c, ptr, stream, tag);
}

int gmb__shim_trim_all(size_t keep_bytes) {
  pthread_once(&shim_once, shim_start_once);
  if (gmb__shim_forked()) return GMB_E_CONN;
  if (shim_host) return gmb_trim(shim_host, keep_bytes);
  int first = 0;
  for (int d = 0; d < GMB_SHIM_MAX_DEVICES; d++) {
    pthread_mutex_lock(&shim_conn_mu);
    gmb_client *c = atomic_load(&shim_devs[d].c);
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
  if (shim_take(ptr, &id, &c, &tag)) return GMB_E_NOENT;
  return 0;
}

int gmb__shim_figures(gmb_client *c, uint64_t local_held,
                      gmb__shim_real_figures_fn real, void *arg,
                      uint64_t *freep, uint64_t *totalp) {
  gmb_stats st;
  int rc = gmb_tenant_stats(c, &st);
  if (rc) return rc;
  if (st.quota != 0) {
    uint64_t held = st.used + local_held;
    if (held < st.used) held = UINT64_MAX;
    *totalp = st.quota;
    *freep = held < st.quota ? st.quota - held : 0;
    return 0;
  }
  gmb_device_stats ds;
  rc = gmb_device_stats_get(c, &ds);
  if (rc) return rc;
  /* Figures from the broker are not trusted to add up: no wrap-around. */
  uint64_t room = ds.capacity > ds.segments ? ds.capacity - ds.segments : 0;
  uint64_t total = ds.capacity;
  if (real) {
    uint64_t real_free = 0, real_total = 0;
    rc = real(arg, &real_free, &real_total);
    if (rc != 0) return rc;
    /* The device's free figure does not count what the broker's segments
     * hold free, which is the tenant's to use, and already lacks what
     * this process holds outside the broker. */
    if (real_free < room) room = real_free;
    total = real_total;
  }
  uint64_t fr = room + ds.free_in_segments;
  if (fr < room || fr > total) fr = total;
  if (!real) fr = fr > local_held ? fr - local_held : 0;
  *freep = fr;
  *totalp = total;
  return 0;
}

int gmb__shim_env_flag(const char *name) {
  const char *s = getenv(name);
  if (s == NULL) return 0;
  return !strcmp(s, "1") || !strcasecmp(s, "yes") || !strcasecmp(s, "true") ||
         !strcasecmp(s, "on");
}
