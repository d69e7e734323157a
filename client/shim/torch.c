/*
 * torch.c - libgmb-torch.so, the allocator functions PyTorch's
 * torch.cuda.memory.CUDAPluggableAllocator calls (client/python/gmb_torch.py
 * installs them; docs/pytorch.md is the user's page).
 *
 * PyTorch hands every device allocation of the process to gmb_torch_alloc
 * and gives it back with gmb_torch_free, passing the same size, device and
 * stream.  Allocations come from the session of the device PyTorch names
 * (shim.c: one per device, each with the broker of that GPU) and go
 * through that session's stream-ordered cache (gmb_malloc_async /
 * gmb_free_async on PyTorch's stream), as PyTorch's own caching allocator
 * would serve them: a tensor made and dropped in a steady loop sends no
 * message and the free never waits for the GPU (the block is reusable at
 * once on its stream, on others once an event recorded at the free
 * completed).  Blocks are pinned (a tensor holds a raw pointer).
 * gmb_torch_empty_cache (gmb_torch.empty_cache()) gives every session's
 * free cached slabs back to its broker, as torch.cuda.empty_cache() does.
 *
 * The contract, read from PyTorch's torch/csrc/cuda/CUDAPluggableAllocator.cpp
 * (the 2.x sources): malloc calls alloc_fn_ and stores whatever it returns
 * in its metadata map, building the tensor's DataPtr from it, without a
 * check for NULL; the call is made through a std::function from C++,
 * before any lock is taken.  So a refusal must not return NULL (the tensor
 * would get address 0 and the first kernel kill the context): the entry
 * point PyTorch calls, gmb_torch_alloc, is C++ (torch_throw.cc) and throws
 * std::runtime_error, which PyTorch's Python bindings turn into a
 * RuntimeError naming the reason.  This file is its C core,
 * gmb_torch_alloc_nothrow, which returns NULL with the reason kept for
 * gmb_torch_last_error() (C callers and tests use it).  Size 0 returns
 * NULL without an error, as PyTorch's own caching allocator does, and a
 * NULL DataPtr is never passed to free.  free may come on any thread.
 *
 * Devices: `device` is PyTorch's index, the process's CUDA ordinal; its
 * allocation goes to the broker of that GPU, found by the GPU's UUID
 * (gmb_connect_gpu), and a device without a broker is refused with the
 * reason.  A free goes to the session of the device PyTorch names with
 * it (the tensor's), whose cache knows its blocks: a pointer it did not
 * give, or one freed already, is refused there and changes nothing (a
 * pointer of another device's session, which PyTorch never passes, is
 * tried on the other sessions).  So the hot path keeps no map of its own,
 * and no count of bytes in use (the memory fraction and the allocated
 * figures read the session cache's): a pair costs the cache's pair plus a
 * few loads and plain stores (bench_shim measures it; goal <= 1.2x).
 * The shim's map holds only blocks allocated during a graph capture.
 *
 * Free: never waits.  Memory a CUDA graph may use at every replay, for as
 * long as it lives, which the allocator cannot see, is kept, never handed
 * back to the cache, until the process ends (gmb_torch_kept() counts it):
 * a block allocated while its stream was being captured (tagged at the
 * allocation), and any block freed while its stream is being captured.
 *
 * PyTorch's other hooks (CUDAPluggableAllocator's set_*_fn, given function
 * pointers by client/python/gmb_torch.py; docs/pytorch.md lists them all
 * and why some are left unset):
 *  - init (gmb_torch_init): the device count, at CUDA's lazy init; a
 *    device index past it is refused.
 *  - reset (gmb_torch_reset): what torch.cuda.empty_cache() calls; every
 *    session's wholly free cached slabs go back (gmb_trim(c, 0)).
 *  - memory fraction (gmb_torch_set_memory_fraction):
 *    torch.cuda.set_per_process_memory_fraction(f, d); an allocation that
 *    would take this process's bytes in use on device d past f times the
 *    broker's capacity of that GPU is refused, as PyTorch's own allocator
 *    refuses past f times the device's memory.  Exact across threads in
 *    the safe direction: allocations racing each other never pass it
 *    together, though one within another in-flight allocation's size of
 *    the limit may be refused (torch_take).
 *  - record stream (gmb_torch_record_stream): Tensor.record_stream(s);
 *    gmb_record_stream, so the block is reused by no stream until the
 *    work queued on s before its free has finished.
 *
 * PyTorch's statistics (gmb_torch_memory_stats, read by gmb_torch.py under
 * PyTorch's key names): per device, running totals in per-thread blocks
 * (plain stores: no atomic read-modify-write on the hot path beyond
 * the cache's own), the current figures their differences (allocated
 * bytes: the session cache's count of bytes in use), the peak of allocated
 * bytes raised by CAS only when passed; reserved bytes are the session
 * cache's.  An allocation's text
 * for PyTorch begins "CUDA out of memory." (torch_throw.cc).
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>

#ifndef __unused /* libbsd's RB_GENERATE_STATIC uses it; Linux lacks it */
#define __unused __attribute__((__unused__))
#endif
#include <bsd/sys/tree.h>

#include "gmb.h"
#include "shim.h"

GMB_SHIM_API void *gmb_torch_alloc_nothrow(ssize_t size, int device,
                                           void *stream);
GMB_SHIM_API unsigned long long gmb_torch_kept(void);
GMB_SHIM_API void gmb_torch_free(void *ptr, ssize_t size, int device,
                                 void *stream);
GMB_SHIM_API const char *gmb_torch_last_error(void);
GMB_SHIM_API int gmb_torch_empty_cache(void);
GMB_SHIM_API void gmb_torch_init(int device_count);
GMB_SHIM_API void gmb_torch_reset(void);
GMB_SHIM_API void gmb_torch_set_memory_fraction(double fraction, int device);
GMB_SHIM_API void gmb_torch_record_stream(void *ptr, void *stream);
GMB_SHIM_API int gmb_torch_tag(int device, const char *tag);
GMB_SHIM_API int gmb_torch_pause(int device, const char *tag, int mode);
GMB_SHIM_API int gmb_torch_resume(int device, const char *tag);

/* One device's figures for gmb_torch.memory_stats() (docs/pytorch.md
 * names the PyTorch key each becomes).  Bytes "allocated" are each
 * request rounded to 512, as the cache counts them; "requested" as
 * PyTorch asked.  Keep in step with client/python/gmb_torch.py. */
struct gmb_torch_stats {
  uint64_t allocated_current, allocated_peak, allocated_total, freed_total;
  uint64_t requested_current, requested_total, requested_freed;
  uint64_t allocs_current, allocs_total, frees_total;
  uint64_t reserved_current, reserved_peak; /* the cache's mapped pages */
  uint64_t segments_current, segments_total, segments_freed; /* pages */
  uint64_t num_ooms;
  uint64_t inactive_current; /* of reserved: free */
  uint64_t kept;             /* kept for CUDA graphs (all devices) */
};
GMB_SHIM_API int gmb_torch_memory_stats(int device, struct gmb_torch_stats *out,
                                        size_t size);
GMB_SHIM_API int gmb_torch_reset_peak(int device);
GMB_SHIM_API int gmb_torch_mem_get_info(int device, unsigned long long *free,
                                        unsigned long long *total);

/* A live block, as gmb_torch_snapshot gives it. */
struct gmb_torch_block {
  uint64_t address, size, requested_size, stream;
  int32_t device;
  uint32_t reserved;
};
GMB_SHIM_API void gmb_torch_record_history(int enabled);
GMB_SHIM_API long gmb_torch_snapshot(struct gmb_torch_block *out, size_t cap);

/* The last failure of the process (not the thread: PyTorch reports an OOM
 * on whichever thread asks, often not the allocating one). */
static pthread_mutex_t torch_err_mu = PTHREAD_MUTEX_INITIALIZER;
static char torch_err[1024] = "no error";
static char torch_err_copy[1024]; /* what gmb_torch_last_error returned */

static void torch_fail(const char *fmt1, long long a, const char *why) {
  pthread_mutex_lock(&torch_err_mu);
  snprintf(torch_err, sizeof torch_err, fmt1, a, why);
  if (gmb__shim_env_flag("GMB_TORCH_VERBOSE"))
    fprintf(stderr, "gmb-torch: %s\n", torch_err);
  pthread_mutex_unlock(&torch_err_mu);
}

static _Atomic unsigned long long torch_kept;

/* Blocks allocated during a graph capture and not freed yet: the only
 * pointers this library keeps in the shim's map (gmb__shim_malloc_async
 * with GMB_SHIM_TAG_GRAPH), so that their free keeps them.  While there
 * are none, a free does not look at the map at all. */
static atomic_int torch_graph_live;

unsigned long long gmb_torch_kept(void) { return torch_kept; }

/* What PyTorch told the init hook (0: not called). */
static _Atomic int torch_devices;

/*
 * Per device: the memory fraction's limit, and the figures the session's
 * cache does not keep.  The bytes in use are the cache's own count
 * (gmb__client_cache_in_use: each request rounded to 512, one atomic
 * load), so the hot path adds no atomic read-modify-write of its own.
 * `fraction` < 0: none; `limit` is computed from it at the next
 * allocation (it needs the device's session), 0 meanwhile.  `pending`:
 * bytes of allocations past the fraction's check and not yet counted
 * by the cache (only while a fraction is set).
 */
static struct {
  _Atomic double fraction;
  _Atomic uint64_t limit, pending;
  /* The highest bytes in use seen after an allocation since the last
   * reset (raised by whoever passes it: a load, and a CAS only when
   * higher) and the refusals. */
  _Atomic uint64_t peak_allocated, ooms;
} torch_dev[GMB_SHIM_MAX_DEVICES] = {
    [0 ... GMB_SHIM_MAX_DEVICES - 1] = {.fraction = -1.0}};

/* Each device's session once torch_session found it (written once; the
 * session never changes while this process is not a fork() child), so
 * that an allocation and a free find it with one load and no call; and
 * whether it is the host session that serves every device
 * (GMB_SHIM_ALLOW_HOST), set before the first is published. */
static _Atomic(gmb_client *) torch_sess[GMB_SHIM_MAX_DEVICES];
static atomic_int torch_on_host;

/* Device d's session when known and usable here, else NULL (the caller
 * takes the slow path, which explains a refusal). */
static inline gmb_client *torch_fast(int d) {
  if ((unsigned)d >= GMB_SHIM_MAX_DEVICES || gmb__shim_forked()) return NULL;
  return atomic_load_explicit(&torch_sess[d], memory_order_acquire);
}

/*
 * The running totals of the statistics, per thread: each thread adds to
 * its own block with plain stores (an atomic read-modify-write per figure
 * on every allocation and free cost more than the cache's whole pair,
 * bench_shim), and gmb_torch_memory_stats sums the blocks.  A block is
 * never freed: a thread that ends gives it up (its key's destructor) and
 * the next new thread takes it over, counts and all, so the sums stay
 * right and the list stays as long as the most threads alive at once.
 */
struct torch_tls_dev {
  _Atomic uint64_t allocated, requested, requested_freed, allocs, frees;
};
struct torch_tls {
  struct torch_tls *next; /* the list, pushed at the head, never unlinked */
  atomic_int taken;       /* a live thread owns it */
  struct torch_tls_dev dev[GMB_SHIM_MAX_DEVICES];
};
static _Atomic(struct torch_tls *) torch_tls_all;
static pthread_key_t torch_tls_key;
static pthread_once_t torch_tls_once = PTHREAD_ONCE_INIT;
static __thread struct torch_tls *torch_me
    __attribute__((tls_model("initial-exec")));

static void torch_tls_gone(void *arg) {
  struct torch_tls *t = arg;
  atomic_store(&t->taken, 0);
}

static void torch_tls_init(void) {
  pthread_key_create(&torch_tls_key, torch_tls_gone);
}

/* The calling thread's block, or NULL (out of memory: not counted). */
static struct torch_tls *torch_tls(void) {
  struct torch_tls *t = torch_me;
  if (__builtin_expect(t != NULL, 1)) return t;
  pthread_once(&torch_tls_once, torch_tls_init);
  for (t = atomic_load(&torch_tls_all); t; t = t->next) {
    int free_block = 0;
    if (atomic_compare_exchange_strong(&t->taken, &free_block, 1)) break;
  }
  if (t == NULL) {
    t = calloc(1, sizeof *t);
    if (t == NULL) return NULL;
    atomic_store(&t->taken, 1);
    t->next = atomic_load(&torch_tls_all);
    while (!atomic_compare_exchange_weak(&torch_tls_all, &t->next, t)) {
    }
  }
  pthread_setspecific(torch_tls_key, t);
  torch_me = t;
  return t;
}

/* Adds v to a word only this thread writes. */
static inline void torch_bump(_Atomic uint64_t *w, uint64_t v) {
  atomic_store_explicit(w, atomic_load_explicit(w, memory_order_relaxed) + v,
                        memory_order_relaxed);
}

static void torch_raise(_Atomic uint64_t *peak, uint64_t now) {
  uint64_t was = atomic_load_explicit(peak, memory_order_relaxed);
  while (now > was && !atomic_compare_exchange_weak_explicit(
                          peak, &was, now, memory_order_relaxed,
                          memory_order_relaxed)) {
  }
}

/* An allocation of `size` (need: rounded) on device d, for the figures;
 * the session's bytes in use after it are `now`. */
static void torch_count_alloc(int d, uint64_t now, uint64_t need,
                              ssize_t size) {
  if (d < 0 || d >= GMB_SHIM_MAX_DEVICES) return;
  torch_raise(&torch_dev[d].peak_allocated, now);
  struct torch_tls *t = torch_tls();
  if (t == NULL) return;
  torch_bump(&t->dev[d].allocated, need);
  torch_bump(&t->dev[d].requested, (uint64_t)size);
  torch_bump(&t->dev[d].allocs, 1);
}

static void torch_count_free(int d, ssize_t size) {
  struct torch_tls *t = torch_tls();
  if (t == NULL) return;
  torch_bump(&t->dev[d].requested_freed, (uint64_t)size);
  torch_bump(&t->dev[d].frees, 1);
}

static void torch_count_oom(int d) {
  if (d >= 0 && d < GMB_SHIM_MAX_DEVICES)
    atomic_fetch_add_explicit(&torch_dev[d].ooms, 1, memory_order_relaxed);
}

static uint64_t torch_round(ssize_t size) {
  return ((uint64_t)size + 511) & ~UINT64_C(511);
}

void gmb_torch_init(int device_count) {
  atomic_store(&torch_devices, device_count > 0 ? device_count : 0);
}

void gmb_torch_set_memory_fraction(double fraction, int device) {
  if (device < 0 || device >= GMB_SHIM_MAX_DEVICES || !(fraction >= 0.0) ||
      fraction > 1.0) {
    torch_fail("gmb_torch_set_memory_fraction: device %lld, %s",
               (long long)device, "a fraction outside [0, 1] or a device "
               "past the shims' limit: ignored");
    return;
  }
  atomic_store(&torch_dev[device].limit, 0);
  atomic_store(&torch_dev[device].fraction, fraction);
}

/*
 * The memory fraction's check of `need` bytes on device d: 0 when there
 * is no fraction (the usual case: one load), 1 when the bytes fit under
 * it, -1 (with the reason recorded) when they would pass it.  On 1 they
 * were added to `pending` first (the caller takes them off with
 * torch_done once the cache counted the allocation, or it failed), and
 * the check is of the cache's bytes in use plus every pending
 * allocation's: threads allocating at once together never pass the
 * limit.  It errs the safe way: an allocation the cache counted before
 * its thread took it off `pending` is counted twice for that moment, so
 * a request within that allocation's size of the limit may be refused
 * although it would fit.
 * In host mode (GMB_SHIM_ALLOW_HOST, one session for every device) the
 * bytes in use are all devices'.
 */
static int torch_take(gmb_client *c, int d, uint64_t need, ssize_t size) {
  if (d < 0 || d >= GMB_SHIM_MAX_DEVICES) return 0;
  double f = atomic_load_explicit(&torch_dev[d].fraction,
                                  memory_order_relaxed);
  if (__builtin_expect(f < 0, 1)) return 0;
  uint64_t pend = atomic_fetch_add(&torch_dev[d].pending, need) + need;
  uint64_t was = gmb__client_cache_in_use(c);
  uint64_t limit = atomic_load(&torch_dev[d].limit);
  if (limit == 0 && f > 0) {
    gmb_device_stats ds;
    if (gmb_device_stats_get(c, &ds) == 0) {
      limit = (uint64_t)((double)ds.capacity * f);
      if (limit == 0) limit = 1; /* computed: 0 means "not yet" */
      atomic_store(&torch_dev[d].limit, limit);
    }
  }
  if (limit != 0 && was + pend <= limit) return 1;
  atomic_fetch_sub(&torch_dev[d].pending, need);
  char why[256];
  snprintf(why, sizeof why, "GMB_E_QUOTA: past this process's memory "
           "fraction of cuda:%d (%g of the broker's capacity: %llu bytes; "
           "%llu in use)", d, f, (unsigned long long)limit,
           (unsigned long long)was);
  torch_fail("gmb_torch_alloc(%lld): %s", (long long)size, why);
  return -1;
}

/* After torch_take returned `took`: the allocation is counted by the
 * cache now, or failed; on 1 its bytes leave `pending`. */
static inline void torch_done(int d, uint64_t need, int took) {
  if (took > 0) atomic_fetch_sub(&torch_dev[d].pending, need);
}

/* A free, counted.  The size a free names is the caller's word: it only
 * feeds the requested-bytes totals; the bytes in use are the cache's,
 * which knows each block's size. */
static void torch_give(int d, ssize_t size) {
  if (d < 0 || d >= GMB_SHIM_MAX_DEVICES || size <= 0) return;
  torch_count_free(d, size);
}

/* --- the live blocks, while recording (gmb_torch_record_history) --------- */

/*
 * A debugging aid, off by default: while on, every allocation is kept in
 * a red-black tree by address (under torch_blk_mu) until its free, for
 * gmb_torch_snapshot.  Off, an allocation pays one relaxed load and a
 * free one more (torch_blk_live); blocks allocated before it was turned
 * on are not in the tree.  Turning it off empties the tree.
 */
struct torch_blk {
  RB_ENTRY(torch_blk) link;
  struct gmb_torch_block b;
};

static int torch_blk_cmp(const struct torch_blk *a, const struct torch_blk *b) {
  return a->b.address < b->b.address ? -1 : a->b.address > b->b.address;
}

RB_HEAD(torch_blk_tree, torch_blk);
RB_GENERATE_STATIC(torch_blk_tree, torch_blk, link, torch_blk_cmp)

static pthread_mutex_t torch_blk_mu = PTHREAD_MUTEX_INITIALIZER;
static struct torch_blk_tree torch_blks = RB_INITIALIZER(&torch_blks);
static atomic_int torch_recording;
static atomic_long torch_blk_live; /* blocks in the tree */

static void torch_blk_add(const void *p, uint64_t need, ssize_t size,
                          int device, void *stream) {
  if (!atomic_load_explicit(&torch_recording, memory_order_relaxed)) return;
  struct torch_blk *n = calloc(1, sizeof *n);
  if (n == NULL) return; /* not recorded: the snapshot lacks it */
  n->b = (struct gmb_torch_block){(uintptr_t)p, need, (uint64_t)size,
                                  (uintptr_t)stream, device, 0};
  pthread_mutex_lock(&torch_blk_mu);
  if (atomic_load(&torch_recording)) {
    struct torch_blk *old = RB_INSERT(torch_blk_tree, &torch_blks, n);
    if (old == NULL) {
      atomic_fetch_add(&torch_blk_live, 1);
      n = NULL;
    } else {
      old->b = n->b; /* a free this library did not see: the new one wins */
    }
  }
  pthread_mutex_unlock(&torch_blk_mu);
  free(n); /* recording stopped meanwhile, or the address was there */
}

static void torch_blk_remove(const void *p) {
  if (atomic_load_explicit(&torch_blk_live, memory_order_relaxed) == 0)
    return;
  struct torch_blk key;
  key.b.address = (uintptr_t)p;
  pthread_mutex_lock(&torch_blk_mu);
  struct torch_blk *n = RB_FIND(torch_blk_tree, &torch_blks, &key);
  if (n) {
    RB_REMOVE(torch_blk_tree, &torch_blks, n);
    atomic_fetch_sub(&torch_blk_live, 1);
  }
  pthread_mutex_unlock(&torch_blk_mu);
  free(n);
}

/* gmb_torch.record_history(enabled): on, allocations from now on are
 * kept for gmb_torch_snapshot; off, none are and the tree is emptied. */
void gmb_torch_record_history(int enabled) {
  pthread_mutex_lock(&torch_blk_mu);
  atomic_store(&torch_recording, enabled != 0);
  if (!enabled) {
    struct torch_blk *n, *next;
    for (n = RB_MIN(torch_blk_tree, &torch_blks); n; n = next) {
      next = RB_NEXT(torch_blk_tree, &torch_blks, n);
      RB_REMOVE(torch_blk_tree, &torch_blks, n);
      free(n);
    }
    atomic_store(&torch_blk_live, 0);
  }
  pthread_mutex_unlock(&torch_blk_mu);
}

/* The recorded live blocks by address: up to cap of them into out; the
 * number there are (call with cap 0 to size the buffer). */
long gmb_torch_snapshot(struct gmb_torch_block *out, size_t cap) {
  long n = 0;
  pthread_mutex_lock(&torch_blk_mu);
  struct torch_blk *b;
  RB_FOREACH(b, torch_blk_tree, &torch_blks) {
    if (out && (size_t)n < cap) out[n] = b->b;
    n++;
  }
  pthread_mutex_unlock(&torch_blk_mu);
  return n;
}

/*
 * The blocks of every session's cache, for gmb_torch.snapshot() (PyTorch's
 * snapshot format: client/python/gmb_torch.py groups them into segments).
 * A "segment" is a run of consecutive mapped pages of the cache; a block
 * is given with its state, and its requested size as PyTorch asked when
 * record_history() was on at its allocation, else rounded to 512.
 */
struct gmb_torch_seg_block {
  uint64_t seg_address, seg_size, address, size, requested_size, stream;
  int32_t device;
  uint32_t state; /* GMB_BLOCK_FREE, _LIVE, _PENDING */
};
GMB_SHIM_API long gmb_torch_blocks(int device, struct gmb_torch_seg_block *out,
                                   size_t cap);

struct torch_visit {
  struct gmb_torch_seg_block *out;
  size_t cap;
  long n;
  int device;
};

static int torch_visit_block(void *arg, const gmb_cache_block *b) {
  struct torch_visit *v = arg;
  if (v->out && (size_t)v->n < v->cap) {
    struct gmb_torch_seg_block *o = &v->out[v->n];
    *o = (struct gmb_torch_seg_block){b->seg_address, b->seg_size,
                                      b->address, b->size, b->requested,
                                      (uintptr_t)b->stream, v->device,
                                      (uint32_t)b->state};
    if (b->state != GMB_BLOCK_FREE &&
        atomic_load_explicit(&torch_blk_live, memory_order_relaxed)) {
      struct torch_blk key;
      key.b.address = b->address;
      pthread_mutex_lock(&torch_blk_mu);
      struct torch_blk *r = RB_FIND(torch_blk_tree, &torch_blks, &key);
      if (r) {
        o->requested_size = r->b.requested_size;
        o->stream = r->b.stream;
      }
      pthread_mutex_unlock(&torch_blk_mu);
    }
  }
  v->n++;
  return 0;
}

/* Up to cap blocks of device `device`'s session (-1: every device's) into
 * out, by device, then arena and address; the number there are (call with
 * cap 0 to size the buffer), or a negative GMB_E_* code. */
long gmb_torch_blocks(int device, struct gmb_torch_seg_block *out,
                      size_t cap) {
  struct torch_visit v = {out, cap, 0, 0};
  gmb_client *seen[GMB_SHIM_MAX_DEVICES];
  int n_seen = 0;
  for (int d = device < 0 ? 0 : device;
       d < (device < 0 ? GMB_SHIM_MAX_DEVICES : device + 1); d++) {
    gmb_client *c = gmb__shim_session_of(d);
    int dup = 0;
    for (int i = 0; i < n_seen; i++) dup |= seen[i] == c;
    if (c == NULL || dup) continue; /* the host session serves them all */
    seen[n_seen++] = c;
    v.device = d;
    int rc = gmb_cache_visit(c, torch_visit_block, &v);
    if (rc) return rc;
  }
  return v.n;
}

/* The session of PyTorch's device (-1: the current one; *dev receives the
 * ordinal), or NULL with the reason recorded as `what`(arg)'s. */
static gmb_client *torch_session(int device, int *dev, const char *what,
                                 long long arg) {
  const char *why = NULL;
  *dev = device;
  gmb_client *c = gmb__shim_session(device < 0 ? -1 : device, dev, &why);
  if (c && *dev >= 0 && *dev < GMB_SHIM_MAX_DEVICES &&
      atomic_load_explicit(&torch_sess[*dev], memory_order_relaxed) == NULL) {
    atomic_store_explicit(&torch_on_host, gmb__shim_host(),
                          memory_order_relaxed); /* one value */
    atomic_store_explicit(&torch_sess[*dev], c, memory_order_release);
  }
  if (c == NULL) {
    char b[48];
    snprintf(b, sizeof b, "cuda:%d", *dev);
    pthread_mutex_lock(&torch_err_mu);
    snprintf(torch_err, sizeof torch_err, "%s(%lld): no broker for %s: %s",
             what, arg, b, why);
    if (gmb__shim_env_flag("GMB_TORCH_VERBOSE"))
      fprintf(stderr, "gmb-torch: %s\n", torch_err);
    pthread_mutex_unlock(&torch_err_mu);
  }
  return c;
}

void *gmb_torch_alloc_nothrow(ssize_t size, int device, void *stream) {
  if (size <= 0) return NULL;
  int dev = device;
  int n = atomic_load(&torch_devices);
  if (n > 0 && device >= n) {
    torch_fail("gmb_torch_alloc(%lld): %s", (long long)size,
               "GMB_E_DEVICE: a device index past the count PyTorch gave "
               "the init hook");
    torch_count_oom(device);
    return NULL;
  }
  /* A device's session is found with one load once known (torch_fast);
   * the slow path connects, or explains why not. */
  gmb_client *c = torch_fast(device);
  if (__builtin_expect(c == NULL, 0)) {
    c = torch_session(device, &dev, "gmb_torch_alloc", size);
    if (c == NULL) {
      torch_count_oom(dev);
      return NULL;
    }
  }
  uint64_t need = torch_round(size);
  int took = torch_take(c, dev, need, size);
  if (took < 0) {
    torch_count_oom(dev);
    return NULL;
  }
  /* Memory allocated while its stream is captured into a graph is used by
   * the graph at every replay: remembered, it is never reused (see the
   * top). */
  int graph = !atomic_load_explicit(&torch_on_host, memory_order_relaxed) &&
              gmb_stream_capturing(c, stream) == 1;
  void *p = NULL;
  int rc = graph ? gmb__shim_malloc_async(c, (size_t)size, stream,
                                          GMB_SHIM_TAG_GRAPH, &p)
                 : gmb_malloc_async(c, (size_t)size, stream, &p);
  torch_done(dev, need, took);
  if (rc) {
    torch_count_oom(dev);
    torch_fail("gmb_torch_alloc(%lld): %s", (long long)size,
               gmb_last_error(c));
    return NULL;
  }
  torch_count_alloc(dev, gmb__client_cache_in_use(c), need, size);
  torch_blk_add(p, need, size, dev, stream);
  if (graph) atomic_fetch_add(&torch_graph_live, 1);
  return p;
}

/* gmb_free_async of ptr through c, the session of PyTorch's device (may
 * be NULL), else (a pointer of another device's session, which PyTorch
 * never passes) through each other session in turn.  The result from the session that knew the
 * pointer, named in *owner; GMB_E_NOENT when none did. */
static int torch_release(gmb_client *c, void *ptr, void *stream,
                         gmb_client **owner) {
  *owner = c;
  int rc = c ? gmb_free_async(c, ptr, stream) : GMB_E_NOENT;
  if (rc != GMB_E_NOENT) return rc;
  gmb_client *all[GMB_SHIM_MAX_DEVICES];
  int n = gmb__shim_sessions(all, GMB_SHIM_MAX_DEVICES);
  for (int i = 0; i < n && i < GMB_SHIM_MAX_DEVICES; i++) {
    if (all[i] == c) continue;
    rc = gmb_free_async(all[i], ptr, stream);
    if (rc != GMB_E_NOENT) {
      *owner = all[i];
      return rc;
    }
  }
  return GMB_E_NOENT;
}

void gmb_torch_free(void *ptr, ssize_t size, int device, void *stream) {
  if (ptr == NULL) return;
  if (gmb__shim_forked()) {
    torch_fail("gmb_torch_free(%lld): %s", (long long)size,
               "GMB_E_CONN: a fork() child may not use its parent's session");
    return;
  }
  /* Allocated during a graph capture: kept (see the top), and out of the
   * map from now on.  The map is looked at only while it holds such
   * blocks. */
  int graph = 0;
  if (atomic_load_explicit(&torch_graph_live, memory_order_relaxed) > 0) {
    gmb_client *gc;
    unsigned tag;
    if (gmb__shim_async_take(ptr, &gc, &tag) == 0) {
      atomic_fetch_sub(&torch_graph_live, 1);
      graph = 1;
    }
  }
  /* The device's session: one load once known, else the shim's look
   * (which never connects). */
  gmb_client *dc = torch_fast(device);
  int host;
  if (__builtin_expect(dc != NULL, 1)) {
    host = atomic_load_explicit(&torch_on_host, memory_order_relaxed);
  } else {
    host = gmb__shim_host();
    dc = gmb__shim_session_of(device);
  }
  /* Freed during a capture: kept as well. */
  if (!graph && !host && dc && gmb_stream_capturing(dc, stream) == 1)
    graph = 2;
  if (graph) {
    torch_blk_remove(ptr);
    torch_kept += (unsigned long long)(size > 0 ? size : 0);
    torch_fail("gmb_torch_free(%lld): %s", (long long)size,
               graph == 1 ? "allocated during a CUDA graph capture: kept "
                            "until the process ends, since the graph may use "
                            "it at every replay"
                          : "freed during a CUDA graph capture: kept until "
                            "the process ends, since the graph may use it at "
                            "every replay");
    return;
  }
  /* Reusable at once on `stream`; on others after its work ran (and, for
   * a block record_stream named other streams for, after theirs).  The
   * cache knows its blocks: a pointer it did not give, or one freed
   * already, is refused and changes nothing. */
  gmb_client *c = NULL;
  /* Out of the recorded blocks before the cache may hand the address to
   * another thread's allocation. */
  torch_blk_remove(ptr);
  int rc = torch_release(dc, ptr, stream, &c);
  if (rc == 0 || rc == GMB_E_CONN || rc == GMB_E_EVICTED)
    torch_give(device, size);
  if (rc == GMB_E_NOENT)
    torch_fail("gmb_torch_free(%lld): not a pointer gmb_torch_alloc gave, "
               "or one freed already (%s)", (long long)size, "ignored");
  else if (rc == GMB_E_INVAL)
    torch_fail("gmb_torch_free(%lld): freed already, or on a stream that "
               "takes no event (ignored: %s)", (long long)size,
               gmb_last_error(c));
  else if (rc && rc != GMB_E_CONN && rc != GMB_E_EVICTED)
    torch_fail("gmb_torch_free(%lld): %s", (long long)size, gmb_last_error(c));
}

const char *gmb_torch_last_error(void) {
  /* A copy, so a caller reading it never sees a half-written message; it
   * stays valid until the next call. */
  pthread_mutex_lock(&torch_err_mu);
  memcpy(torch_err_copy, torch_err, sizeof torch_err_copy);
  pthread_mutex_unlock(&torch_err_mu);
  return torch_err_copy;
}

/* Sleep and wake for gmb_torch.tag/pause/resume (docs/sleep.md), on the
 * session of `device` (made when there is none yet): the tag of the
 * calling thread's allocations there (NULL or "": none; PyTorch's
 * allocator runs on the thread that allocates), and the pause (mode
 * GMB_PAUSE_OFFLOAD or GMB_PAUSE_DISCARD) or resume of a tag.  0, or a
 * negative GMB_E_* code with the reason for gmb_torch_last_error. */
int gmb_torch_tag(int device, const char *tag) {
  int dev;
  gmb_client *c = torch_session(device, &dev, "gmb_torch_tag", device);
  if (c == NULL) return GMB_E_CONN;
  int rc = gmb_cache_tag(c, tag);
  if (rc) torch_fail("gmb_torch_tag(device %lld): %s", device,
                     gmb_last_error(c));
  return rc;
}

int gmb_torch_pause(int device, const char *tag, int mode) {
  int dev;
  gmb_client *c = torch_session(device, &dev, "gmb_torch_pause", device);
  if (c == NULL) return GMB_E_CONN;
  int rc = gmb_pause(c, tag, mode);
  if (rc) torch_fail("gmb_torch_pause(device %lld): %s", device,
                     gmb_last_error(c));
  return rc;
}

int gmb_torch_resume(int device, const char *tag) {
  int dev;
  gmb_client *c = torch_session(device, &dev, "gmb_torch_resume", device);
  if (c == NULL) return GMB_E_CONN;
  int rc = gmb_resume(c, tag);
  if (rc) torch_fail("gmb_torch_resume(device %lld): %s", device,
                     gmb_last_error(c));
  return rc;
}

/* gmb_torch.empty_cache(): every session's wholly free cached slabs go
 * back to its broker (each device's).  0, or the first GMB_E_* code. */
int gmb_torch_empty_cache(void) { return gmb__shim_trim_all(0); }

/* torch.cuda.empty_cache() (the reset hook): the same, with nothing to
 * return (a failure is kept for gmb_torch_last_error). */
void gmb_torch_reset(void) {
  int rc = gmb__shim_trim_all(0);
  if (rc)
    torch_fail("gmb_torch_reset(%lld): %s", 0, gmb_err_name(rc));
}

void gmb_torch_record_stream(void *ptr, void *stream) {
  if (ptr == NULL) return;
  if (gmb__shim_forked()) {
    torch_fail("gmb_torch_record_stream(%lld): %s", 0,
               "GMB_E_CONN: a fork() child may not use its parent's session");
    return;
  }
  /* No device is given: the current device's session first (PyTorch
   * records a tensor on its own device), then the others. */
  int dev = 0;
  if (gmb_gpu_current(&dev) != 0) dev = 0;
  gmb_client *first = gmb__shim_session_of(dev), *c = first;
  int rc = first ? gmb_record_stream(first, ptr, stream) : GMB_E_NOENT;
  gmb_client *all[GMB_SHIM_MAX_DEVICES];
  int n = rc == GMB_E_NOENT ? gmb__shim_sessions(all, GMB_SHIM_MAX_DEVICES)
                            : 0;
  for (int i = 0; rc == GMB_E_NOENT && i < n && i < GMB_SHIM_MAX_DEVICES;
       i++) {
    if (all[i] == first) continue;
    c = all[i];
    rc = gmb_record_stream(c, ptr, stream);
  }
  if (rc == GMB_E_NOENT)
    torch_fail("gmb_torch_record_stream(%lld): %s", 0,
               "not a pointer gmb_torch_alloc gave, or one freed already "
               "(ignored)");
  else if (rc)
    torch_fail("gmb_torch_record_stream(%lld): %s", 0, gmb_last_error(c));
}

/* --- PyTorch's view of memory: statistics and mem_get_info ---------------- */

int gmb_torch_memory_stats(int device, struct gmb_torch_stats *out,
                           size_t size) {
  if (out == NULL || size < sizeof *out || device < 0 ||
      device >= GMB_SHIM_MAX_DEVICES)
    return GMB_E_INVAL;
  memset(out, 0, size);
  /* Read while other threads may count: each sum is of words each right,
   * taken a moment apart. */
  uint64_t freed = 0;
  for (struct torch_tls *t = atomic_load(&torch_tls_all); t; t = t->next) {
    const struct torch_tls_dev *td = &t->dev[device];
    out->allocated_total += atomic_load_explicit(&td->allocated,
                                                 memory_order_relaxed);
    out->requested_total += atomic_load_explicit(&td->requested,
                                                 memory_order_relaxed);
    freed += atomic_load_explicit(&td->requested_freed, memory_order_relaxed);
    out->allocs_total += atomic_load_explicit(&td->allocs,
                                              memory_order_relaxed);
    out->frees_total += atomic_load_explicit(&td->frees,
                                             memory_order_relaxed);
  }
  /* The cache of the device's session: what it hands out and holds. */
  gmb_client *c = gmb__shim_session_of(device);
  out->allocated_current = gmb__client_cache_in_use(c);
  out->freed_total = out->allocated_total > out->allocated_current
                         ? out->allocated_total - out->allocated_current
                         : 0;
  out->allocated_peak = atomic_load(&torch_dev[device].peak_allocated);
  if (out->allocated_peak < out->allocated_current)
    out->allocated_peak = out->allocated_current;
  out->requested_freed = freed;
  out->requested_current =
      out->requested_total > freed ? out->requested_total - freed : 0;
  out->allocs_current = out->allocs_total > out->frees_total
                            ? out->allocs_total - out->frees_total
                            : 0;
  out->num_ooms = atomic_load(&torch_dev[device].ooms);
  out->kept = torch_kept;
  gmb_cache_stats cs;
  if (c && gmb_cache_stats_get(c, &cs) == 0) {
    out->reserved_current = cs.held;
    out->reserved_peak = cs.peak_held;
    out->segments_total = cs.slab_allocs;
    out->segments_freed = cs.slab_frees;
    out->segments_current =
        cs.slab_allocs > cs.slab_frees ? cs.slab_allocs - cs.slab_frees : 0;
    out->inactive_current = cs.cached;
  }
  return 0;
}

/* torch.cuda.reset_peak_memory_stats(device): the peak of allocated bytes
 * starts again from the current figure.  The cache's peak of mapped pages
 * (reserved_peak) is the session's and is not reset. */
int gmb_torch_reset_peak(int device) {
  if (device < 0 || device >= GMB_SHIM_MAX_DEVICES) return GMB_E_INVAL;
  atomic_store(&torch_dev[device].peak_allocated,
               gmb__client_cache_in_use(gmb__shim_session_of(device)));
  return 0;
}

/* torch.cuda.mem_get_info(device): what cudaMemGetInfo gives under the
 * preload (gmb__shim_figures without the device's own figure): the
 * tenant's quota as total and what it can still get as free, or without
 * a quota the broker's capacity and room.  0, or a GMB_E_* code (no
 * broker for the device: its reason is kept for gmb_torch_last_error). */
int gmb_torch_mem_get_info(int device, unsigned long long *free_b,
                           unsigned long long *total) {
  if (free_b == NULL || total == NULL) return GMB_E_INVAL;
  int dev;
  gmb_client *c = torch_session(device, &dev, "gmb_torch_mem_get_info",
                                device);
  if (c == NULL) return GMB_E_CONN;
  uint64_t fr = 0, tot = 0;
  int rc = gmb__shim_figures(c, 0, NULL, NULL, &fr, &tot);
  if (rc) {
    torch_fail("gmb_torch_mem_get_info(%lld): %s", (long long)device,
               gmb_last_error(c));
    return rc < 0 ? rc : GMB_E_DEVICE;
  }
  *free_b = fr;
  *total = tot;
  return 0;
}
