/*
 * segmap.c - the segments a client has mapped and its allocations in them.
 *
 * Two tables, both open-addressing hash maps from a 64-bit id to a record
 * (allocation ids and segment ids are never 0, so key 0 marks an empty
 * slot).  Lookups are O(1) and take no lock, because gmb_lock and
 * gmb_unlock sit on the hot path of every kernel launch.  Deletion shifts
 * later entries back instead of leaving tombstones, so a long-lived client
 * that allocates and frees for hours keeps short probe sequences.
 *
 * An allocation record keeps where the allocation was made and, for a
 * movable one, its lock-table slot; where a movable allocation is now is
 * in the lock table, not here (client.c).
 *
 * Concurrency: a sequence lock.  Writers (map, retire, add, remove: rare,
 * and each already costs a round trip to the broker) serialise on `mu`
 * and wrap every change readers can see in a write section that makes
 * `seq` odd before and even after.  Readers take no lock: they read `seq`,
 * read what they need, and start again when `seq` was odd or changed
 * meanwhile, so what they return is a snapshot of one moment between
 * write sections.  A reader may read a half-changed table before it
 * notices; two rules make that harmless:
 *
 *  - A reader never dereferences memory a writer could free or unmap
 *    while it reads.  Records live inline in the hash arrays (no pointer
 *    to chase), and an array replaced by a bigger one is kept on a retired
 *    list until gmb__segmap_destroy (the arrays grow by doubling, so the
 *    retired ones take less room than the live one).  A segment record is
 *    its base address and size; readers only compute addresses from them.
 *  - A reader's probe loop is bounded by the capacity, since a torn view
 *    may show no empty slot.  Each array carries its capacity, so one load
 *    of the array pointer gives a consistent (slots, capacity) pair.
 *
 * In C11 terms this is the seqlock of Boehm's "Can seqlocks get along with
 * programming language memory models?" (2012): every shared word that
 * readers read racily is accessed with __atomic loads and stores, relaxed,
 * so a torn read is a stale value and never undefined behaviour.  The
 * writer stores the odd `seq` (relaxed), then a release fence, then its
 * relaxed data stores, then the even `seq` with release.  The reader
 * loads `seq` with acquire, its data relaxed, then an acquire fence, then
 * `seq` again.  If a reader saw any data store of a write section, its
 * acquire fence synchronises with that section's release fence, so it
 * sees the odd `seq` (or later) on its re-check and retries; if it saw
 * none, its first acquire load ordered it after every earlier section.
 * A new array is filled privately and published with a release store of
 * the table's pointer that readers load with acquire, so its contents and
 * capacity are visible to whoever sees the pointer.  On x86-64 all of this
 * compiles to plain moves; on arm64 to ldar/stlr and dmb ishld.
 *
 * Invariants: a segment record exists exactly while its memory is mapped
 * (host: mmap; cuda: a virtual-memory import, cuimport.c, whose device
 * address is the base: the record and the lookups do not care which);
 * an allocation record's range lies inside the segment size it was checked
 * against; a segment record's base and size never change while it exists.
 *
 * A host segment is a memfd the broker sent over the descriptor channel.
 * Its size is checked before mmap, and so is its seal against shrinking:
 * touching a mapping past the end of a file raises SIGBUS in the
 * application, other processes of the tenant hold the same descriptor, and
 * the library must never crash on what it is sent.  A cuda segment's size
 * cannot be checked that way (the driver API the library loads has no
 * query for an import's extent); it is the broker's word.
 */
#include "segmap.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cuimport.h"
#include "gmb.h"

/* --- records as words --------------------------------------------------- */

/* A record is `width` 64-bit words, word 0 its key, so that one table
 * implementation serves both kinds and every word can be read and written
 * atomically.  An allocation's slot and size come first: they are what
 * gmb_lock and gmb_unlock read of a movable one, and the fewer cache lines
 * a lookup touches the better. */
enum { SEG_ID, SEG_BASE, SEG_SIZE, SEG_KIND, SEG_WIDTH };
/* SEG_KIND: how the base was obtained: SEG_HOST (mmap), or SEG_CUDA plus
 * the ordinal of the CUDA device it was imported on. */
enum { SEG_HOST, SEG_CUDA };
/* With SEG_VIEW in the kind word, a view (gmb__segmap_view): its size is
 * its pages and one page of tail, that page first with SEG_TAIL_FIRST. */
#define SEG_VIEW (UINT64_C(1) << 32)
#define SEG_TAIL_FIRST (UINT64_C(1) << 33)
enum { AL_ID, AL_FLAGS_SLOT, AL_SIZE, AL_SEGMENT, AL_OFFSET, AL_WIDTH };

#define SEGMAP_MIN_CAP 16

/* --- the sequence lock -------------------------------------------------- */

struct segmap_array {
  struct segmap_array *older; /* retired arrays; writers only */
  size_t mask;                /* capacity - 1; fixed before publication */
  unsigned shift;             /* 64 - log2(capacity), for segmap_hash */
  uint64_t w[];               /* (mask + 1) * width words */
};

struct segmap_table {
  struct segmap_array *a; /* release-published, acquire-loaded */
  size_t n;               /* records; writers only */
};

struct gmb_segmap {
  /* Odd during a write section.  It wraps after 2^32 sections; a reader
   * would have to sleep through exactly that many to be fooled, and each
   * one costs a round trip to the broker. */
  unsigned seq;
  struct segmap_table segments, allocs;
  pthread_mutex_t mu; /* serialises writers; readers never take it */
  int cuda_ordinal;   /* the CUDA device cuda segments are imported on */
  uint64_t views;     /* views made so far; under mu */
};

static inline void segmap_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

/* Waits out a write section in progress.  A write section is a few
 * stores, but its thread can be preempted inside it; after a short spin,
 * yield the CPU to it.  Out of line, so that the lookups it serves need
 * no stack frame of their own. */
__attribute__((noinline, cold)) static unsigned
segmap_read_wait(const struct gmb_segmap *m) {
  unsigned s;
  for (unsigned spins = 0;; spins++) {
    if (spins < 64)
      segmap_relax();
    else
      sched_yield();
    s = __atomic_load_n(&m->seq, __ATOMIC_ACQUIRE);
    if (!(s & 1)) return s;
  }
}

static inline unsigned segmap_read_begin(const struct gmb_segmap *m) {
  unsigned s = __atomic_load_n(&m->seq, __ATOMIC_ACQUIRE);
  if (__builtin_expect(s & 1, 0)) s = segmap_read_wait(m);
  return s;
}

/* 1 when what was read since segmap_read_begin returned `s` may be torn. */
static inline int segmap_read_retry(const struct gmb_segmap *m, unsigned s) {
  __atomic_thread_fence(__ATOMIC_ACQUIRE);
  return __builtin_expect(__atomic_load_n(&m->seq, __ATOMIC_RELAXED) != s, 0);
}

/* Both under mu. */
static void segmap_write_begin(struct gmb_segmap *m) {
  __atomic_store_n(&m->seq, m->seq + 1, __ATOMIC_RELAXED);
  __atomic_thread_fence(__ATOMIC_RELEASE);
}

static void segmap_write_end(struct gmb_segmap *m) {
  __atomic_store_n(&m->seq, m->seq + 1, __ATOMIC_RELEASE);
}

/* --- a u64 -> inline record hash map ------------------------------------ */

/* Fibonacci hashing: the top bits of k * 2^64/phi.  Ids are sequential,
 * and for an arithmetic sequence this spreads keys as evenly as a hash
 * can; it is one multiply, which matters since a gmb_lock + gmb_unlock
 * pair hashes three times.  A broker that picks colliding ids on purpose
 * only makes probes longer (they stay bounded). */
static inline size_t segmap_hash(uint64_t k, unsigned shift) {
  return (size_t)((k * UINT64_C(0x9e3779b97f4a7c15)) >> shift);
}

static inline uint64_t segmap_load(const uint64_t *w) {
  return __atomic_load_n(w, __ATOMIC_RELAXED);
}

static inline void segmap_store(uint64_t *w, uint64_t v) {
  __atomic_store_n(w, v, __ATOMIC_RELAXED);
}

static struct segmap_array *segmap_array_new(size_t cap, size_t width) {
  struct segmap_array *a =
      calloc(1, sizeof *a + cap * width * sizeof(uint64_t));
  if (a == NULL) return NULL;
  a->mask = cap - 1;
  a->shift = 64;
  while (cap > 1) {
    cap >>= 1;
    a->shift--;
  }
  return a;
}

/*
 * The record with key k in `t`, or NULL (always for k = 0, the key of an
 * empty slot).  Safe in a read section: the array is never freed while the
 * map exists, and the probe stops after one lap even when a torn view
 * shows no empty slot.  The caller copies the words out with segmap_load
 * before checking the sequence.
 */
static inline const uint64_t *segmap_find(const struct segmap_table *t,
                                          size_t width, uint64_t k) {
  if (k == 0) return NULL;
  const struct segmap_array *a = __atomic_load_n(&t->a, __ATOMIC_ACQUIRE);
  size_t mask = a->mask;
  size_t i = segmap_hash(k, a->shift);
  for (size_t probes = 0; probes <= mask; probes++, i = (i + 1) & mask) {
    uint64_t key = segmap_load(&a->w[i * width]);
    if (key == k) return &a->w[i * width];
    if (key == 0) return NULL;
  }
  return NULL;
}

/* Places a record in an array no reader can see yet. */
static void segmap_array_place(struct segmap_array *a, size_t width,
                               const uint64_t *rec) {
  size_t i = segmap_hash(rec[0], a->shift);
  while (a->w[i * width]) i = (i + 1) & a->mask;
  memcpy(&a->w[i * width], rec, width * sizeof *rec);
}

/* Adds a record whose key is not present; under mu.  GMB_E_SYSTEM when a
 * bigger array is needed and cannot be had. */
static int segmap_put(struct gmb_segmap *m, struct segmap_table *t,
                      size_t width, const uint64_t *rec) {
  struct segmap_array *a = t->a;
  size_t cap = a->mask + 1;
  if ((t->n + 1) * 4 > cap * 3) { /* load factor at most 3/4 */
    struct segmap_array *b = segmap_array_new(cap * 2, width);
    if (b == NULL) return GMB_E_SYSTEM;
    for (size_t j = 0; j < cap; j++)
      if (a->w[j * width]) segmap_array_place(b, width, &a->w[j * width]);
    segmap_array_place(b, width, rec);
    b->older = a; /* readers may still be in it */
    segmap_write_begin(m);
    __atomic_store_n(&t->a, b, __ATOMIC_RELEASE);
    segmap_write_end(m);
    t->n++;
    return 0;
  }
  size_t i = segmap_hash(rec[0], a->shift);
  while (a->w[i * width]) i = (i + 1) & a->mask;
  segmap_write_begin(m);
  for (size_t k = 0; k < width; k++) segmap_store(&a->w[i * width + k], rec[k]);
  segmap_write_end(m);
  t->n++;
  return 0;
}

/* Removes key k, copying its record to `out`; under mu.  0, or
 * GMB_E_NOENT when absent. */
static int segmap_del(struct gmb_segmap *m, struct segmap_table *t,
                      size_t width, uint64_t k, uint64_t *out) {
  struct segmap_array *a = t->a;
  size_t mask = a->mask, i = segmap_hash(k, a->shift);
  while (a->w[i * width] != k) {
    if (a->w[i * width] == 0) return GMB_E_NOENT;
    i = (i + 1) & mask;
  }
  memcpy(out, &a->w[i * width], width * sizeof *out);
  segmap_write_begin(m);
  /* Backward shift: move up every later entry of the run whose home slot
   * is not between the hole and itself (cyclically). */
  size_t hole = i;
  for (size_t j = (i + 1) & mask; a->w[j * width]; j = (j + 1) & mask) {
    size_t home = segmap_hash(a->w[j * width], a->shift);
    int movable = hole <= j ? (home <= hole || home > j)
                            : (home <= hole && home > j);
    if (movable) {
      for (size_t w = 0; w < width; w++)
        segmap_store(&a->w[hole * width + w], a->w[j * width + w]);
      hole = j;
    }
  }
  for (size_t w = 0; w < width; w++) segmap_store(&a->w[hole * width + w], 0);
  segmap_write_end(m);
  t->n--;
  return 0;
}

static void segmap_table_free(struct segmap_table *t) {
  for (struct segmap_array *a = t->a, *older; a; a = older) {
    older = a->older;
    free(a);
  }
  t->a = NULL;
}

/* --- segments and allocations ------------------------------------------- */

void gmb__segmap_set_cuda(struct gmb_segmap *m, int ordinal) {
  m->cuda_ordinal = ordinal;
}

struct gmb_segmap *gmb__segmap_new(void) {
  struct gmb_segmap *m = calloc(1, sizeof *m);
  if (m == NULL) return NULL;
  m->segments.a = segmap_array_new(SEGMAP_MIN_CAP, SEG_WIDTH);
  m->allocs.a = segmap_array_new(SEGMAP_MIN_CAP, AL_WIDTH);
  if (m->segments.a == NULL || m->allocs.a == NULL ||
      pthread_mutex_init(&m->mu, NULL) != 0) {
    segmap_table_free(&m->segments);
    segmap_table_free(&m->allocs);
    free(m);
    return NULL;
  }
  return m;
}

/* Unmaps or closes a segment whose record is gone. */
static void segmap_release(const uint64_t *rec) {
  if (rec[SEG_KIND] & SEG_VIEW) {
    uint64_t kind = rec[SEG_KIND] & ~(SEG_VIEW | SEG_TAIL_FIRST);
    uint64_t base = rec[SEG_BASE], size = rec[SEG_SIZE];
    uint64_t pages = size - GMB_SEGMAP_PAGE;
    uint64_t at = rec[SEG_KIND] & SEG_TAIL_FIRST ? GMB_SEGMAP_PAGE : 0;
    if (kind >= SEG_CUDA) {
      int ord = (int)(kind - SEG_CUDA);
      gmb__cuda_unmap_at(ord, base + at, pages, 0);
      gmb__cuda_unmap_at(ord, at ? base : base + pages, GMB_SEGMAP_PAGE, 0);
      gmb__cuda_unreserve(ord, base, size);
    } else {
      munmap((void *)(uintptr_t)base, (size_t)size);
    }
    return;
  }
  if (rec[SEG_KIND] >= SEG_CUDA)
    gmb__cuda_close((int)(rec[SEG_KIND] - SEG_CUDA), rec[SEG_BASE],
                    rec[SEG_SIZE]);
  else
    munmap((void *)(uintptr_t)rec[SEG_BASE], (size_t)rec[SEG_SIZE]);
}

void gmb__segmap_destroy(struct gmb_segmap *m) {
  if (m == NULL) return;
  const struct segmap_array *a = m->segments.a;
  for (size_t i = 0; i <= a->mask; i++) {
    const uint64_t *r = &a->w[i * SEG_WIDTH];
    if (r[SEG_ID]) segmap_release(r);
  }
  segmap_table_free(&m->segments);
  segmap_table_free(&m->allocs);
  pthread_mutex_destroy(&m->mu);
  free(m);
}

int gmb__segmap_has_segment(struct gmb_segmap *m, uint64_t segment) {
  int has;
  unsigned s;
  do {
    s = segmap_read_begin(m);
    has = segmap_find(&m->segments, SEG_WIDTH, segment) != NULL;
  } while (segmap_read_retry(m, s));
  return has;
}

/* Checks that a host segment's memfd holds `size` bytes and cannot
 * shrink under a mapping. */
static int segmap_host_fd(uint64_t segment, uint64_t size, int fd, char *why,
                          size_t cap) {
  struct stat st;
  int seals = fcntl(fd, F_GET_SEALS);
  if (fstat(fd, &st) != 0 || st.st_size < 0 || (uint64_t)st.st_size < size) {
    snprintf(why, cap, "segment %llu: its descriptor holds fewer than %llu "
             "bytes", (unsigned long long)segment, (unsigned long long)size);
    return GMB_E_PROTO;
  }
  if (seals < 0 || !(seals & F_SEAL_SHRINK)) {
    snprintf(why, cap, "segment %llu: its descriptor is not sealed against "
             "shrinking", (unsigned long long)segment);
    return GMB_E_PROTO;
  }
  return 0;
}

/* Maps a host segment's memfd; the caller holds no lock (mmap is slow
 * and needs none). */
static int segmap_map_host(uint64_t segment, uint64_t size, int fd,
                           uint8_t **base, char *why, size_t cap) {
  int rc = segmap_host_fd(segment, size, fd, why, cap);
  if (rc) return rc;
  void *p = mmap(NULL, (size_t)size, PROT_READ | PROT_WRITE, MAP_SHARED, fd,
                 0);
  if (p == MAP_FAILED) {
    snprintf(why, cap, "segment %llu: mmap: %s", (unsigned long long)segment,
             strerror(errno));
    return GMB_E_SYSTEM;
  }
  *base = p;
  return 0;
}

int gmb__segmap_map(struct gmb_segmap *m, const char *device,
                    uint64_t segment, uint64_t size, int fd, char *why,
                    size_t cap) {
  if (segment == 0 || size == 0 || size > SIZE_MAX || fd < 0) {
    snprintf(why, cap, "segment %llu: empty or impossible",
             (unsigned long long)segment);
    return GMB_E_PROTO;
  }
  if (gmb__segmap_has_segment(m, segment)) return 0;
  uint64_t rec[SEG_WIDTH] = {[SEG_ID] = segment, [SEG_SIZE] = size};
  int rc;
  if (strcmp(device, "cuda") == 0) {
    rec[SEG_KIND] = SEG_CUDA + (uint64_t)m->cuda_ordinal;
    char cwhy[256];
    rc = gmb__cuda_import(m->cuda_ordinal, fd, size, &rec[SEG_BASE], cwhy,
                          sizeof cwhy);
    if (rc)
      snprintf(why, cap, "segment %llu: %s", (unsigned long long)segment,
               cwhy);
  } else if (strcmp(device, "host") == 0) {
    uint8_t *base = NULL;
    rec[SEG_KIND] = SEG_HOST;
    rc = segmap_map_host(segment, size, fd, &base, why, cap);
    rec[SEG_BASE] = (uintptr_t)base;
  } else {
    snprintf(why, cap, "the broker's device \"%s\" is unknown to libgmb %s",
             device, GMB_VERSION_STRING);
    return GMB_E_DEVICE;
  }
  if (rc) return rc;
  pthread_mutex_lock(&m->mu);
  /* Another thread may have mapped it meanwhile: keep one mapping. */
  int dup = segmap_find(&m->segments, SEG_WIDTH, segment) != NULL;
  if (!dup) rc = segmap_put(m, &m->segments, SEG_WIDTH, rec);
  pthread_mutex_unlock(&m->mu);
  if (dup || rc) segmap_release(rec);
  if (rc) snprintf(why, cap, "out of memory");
  return rc;
}

/* A view's two mappings in a range of its own, host or cuda.  0 with
 * *base, or the failure explained with nothing mapped. */
static int segmap_view_map(struct gmb_segmap *m, int cuda, uint64_t pages,
                           int fd_pages, int fd_tail, int tail_first,
                           uint64_t *base, char *why, size_t cap) {
  const uint64_t size = pages + GMB_SEGMAP_PAGE;
  /* Where the pages and the tail's page start in the view. */
  const uint64_t at_pages = tail_first ? GMB_SEGMAP_PAGE : 0;
  const uint64_t at_tail = tail_first ? 0 : pages;
  char cwhy[256];
  if (cuda) {
    int ord = m->cuda_ordinal, rc;
    rc = gmb__cuda_reserve(ord, size, base, cwhy, sizeof cwhy);
    if (rc == 0) {
      rc = gmb__cuda_map_at(ord, fd_pages, *base + at_pages, pages, 0, NULL,
                            cwhy, sizeof cwhy);
      if (rc == 0) {
        rc = gmb__cuda_map_at(ord, fd_tail, *base + at_tail, GMB_SEGMAP_PAGE,
                              0, NULL, cwhy, sizeof cwhy);
        if (rc) gmb__cuda_unmap_at(ord, *base + at_pages, pages, 0);
      }
      if (rc) gmb__cuda_unreserve(ord, *base, size);
    }
    if (rc) snprintf(why, cap, "a large allocation's view: %s", cwhy);
    return rc;
  }
  int rc = segmap_host_fd(0, pages, fd_pages, why, cap);
  if (rc == 0) rc = segmap_host_fd(0, GMB_SEGMAP_PAGE, fd_tail, why, cap);
  if (rc) return rc;
  uint8_t *p = mmap(NULL, (size_t)size, PROT_NONE,
                    MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED ||
      mmap(p + at_pages, (size_t)pages, PROT_READ | PROT_WRITE,
           MAP_SHARED | MAP_FIXED, fd_pages, 0) == MAP_FAILED ||
      mmap(p + at_tail, GMB_SEGMAP_PAGE, PROT_READ | PROT_WRITE,
           MAP_SHARED | MAP_FIXED, fd_tail, 0) == MAP_FAILED) {
    snprintf(why, cap, "a large allocation's view: mmap: %s", strerror(errno));
    if (p != MAP_FAILED) munmap(p, (size_t)size);
    return GMB_E_SYSTEM;
  }
  *base = (uintptr_t)p;
  return 0;
}

int gmb__segmap_view(struct gmb_segmap *m, const char *device, uint64_t pages,
                     int fd_pages, int fd_tail, int tail_first,
                     uint64_t *view, char *why, size_t cap) {
  int cuda = strcmp(device, "cuda") == 0;
  if (!cuda && strcmp(device, "host") != 0) {
    snprintf(why, cap, "the broker's device \"%s\" is unknown to libgmb %s",
             device, GMB_VERSION_STRING);
    return GMB_E_DEVICE;
  }
  if (pages == 0 || pages % GMB_SEGMAP_PAGE ||
      pages > SIZE_MAX - GMB_SEGMAP_PAGE || fd_pages < 0 || fd_tail < 0) {
    snprintf(why, cap, "a large allocation of %llu bytes of pages: "
             "impossible", (unsigned long long)pages);
    return GMB_E_PROTO;
  }
  uint64_t rec[SEG_WIDTH] = {[SEG_SIZE] = pages + GMB_SEGMAP_PAGE};
  rec[SEG_KIND] = SEG_VIEW | (tail_first ? SEG_TAIL_FIRST : 0) |
                  (cuda ? SEG_CUDA + (uint64_t)m->cuda_ordinal : SEG_HOST);
  int rc = segmap_view_map(m, cuda, pages, fd_pages, fd_tail, tail_first,
                           &rec[SEG_BASE], why, cap);
  if (rc) return rc;
  pthread_mutex_lock(&m->mu);
  rec[SEG_ID] = GMB_SEGMAP_VIEW | ++m->views;
  rc = segmap_put(m, &m->segments, SEG_WIDTH, rec);
  pthread_mutex_unlock(&m->mu);
  if (rc) {
    segmap_release(rec);
    snprintf(why, cap, "out of memory");
    return rc;
  }
  *view = rec[SEG_ID];
  return 0;
}

void gmb__segmap_view_drop(struct gmb_segmap *m, uint64_t view) {
  uint64_t rec[SEG_WIDTH];
  pthread_mutex_lock(&m->mu);
  int rc = (view & GMB_SEGMAP_VIEW)
               ? segmap_del(m, &m->segments, SEG_WIDTH, view, rec)
               : GMB_E_NOENT;
  pthread_mutex_unlock(&m->mu);
  if (rc == 0) segmap_release(rec);
}

int gmb__segmap_retire(struct gmb_segmap *m, uint64_t segment) {
  uint64_t rec[SEG_WIDTH];
  /* A view is its allocation's, not the broker's to retire. */
  if (segment & GMB_SEGMAP_VIEW) return 0;
  pthread_mutex_lock(&m->mu);
  int rc = segment ? segmap_del(m, &m->segments, SEG_WIDTH, segment, rec)
                   : GMB_E_NOENT;
  pthread_mutex_unlock(&m->mu);
  /* After the write section: a reader that still computes an address in
   * it is one the caller's protocol already excludes (client.c). */
  if (rc == 0) segmap_release(rec);
  return rc == 0;
}

size_t gmb__segmap_unmap_all(struct gmb_segmap *m) {
  size_t n = 0;
  for (;;) {
    uint64_t rec[SEG_WIDTH] = {0};
    pthread_mutex_lock(&m->mu);
    const struct segmap_array *a = m->segments.a;
    uint64_t k = 0;
    for (size_t i = 0; i <= a->mask && k == 0; i++) k = a->w[i * SEG_WIDTH];
    int rc = k ? segmap_del(m, &m->segments, SEG_WIDTH, k, rec) : GMB_E_NOENT;
    pthread_mutex_unlock(&m->mu);
    if (rc) return n;
    segmap_release(rec);
    n++;
  }
}

int gmb__segmap_add(struct gmb_segmap *m, uint64_t id, uint64_t segment,
                    uint64_t offset, uint64_t size, unsigned flags,
                    uint32_t slot, char *why, size_t cap) {
  const uint64_t rec[AL_WIDTH] = {
      [AL_ID] = id, [AL_SEGMENT] = segment, [AL_OFFSET] = offset,
      [AL_SIZE] = size, [AL_FLAGS_SLOT] = (uint64_t)flags << 32 | slot};
  int rc = 0;
  pthread_mutex_lock(&m->mu);
  const uint64_t *s = segmap_find(&m->segments, SEG_WIDTH, segment);
  uint64_t ssize = s ? s[SEG_SIZE] : 0;
  if (id == 0) {
    snprintf(why, cap, "the broker gave allocation id 0");
    rc = GMB_E_PROTO;
  } else if (s == NULL && slot == GMB_SEGMAP_NO_SLOT) {
    snprintf(why, cap, "allocation %llu: segment %llu is not mapped",
             (unsigned long long)id, (unsigned long long)segment);
    rc = GMB_E_PROTO;
  } else if (size == 0 ||
             (s && (offset > ssize || size > ssize - offset))) {
    snprintf(why, cap,
             "allocation %llu: [%llu, +%llu) is outside segment %llu of "
             "%llu bytes",
             (unsigned long long)id, (unsigned long long)offset,
             (unsigned long long)size, (unsigned long long)segment,
             (unsigned long long)ssize);
    rc = GMB_E_PROTO;
  } else if (segmap_find(&m->allocs, AL_WIDTH, id) != NULL) {
    snprintf(why, cap, "allocation %llu was given twice",
             (unsigned long long)id);
    rc = GMB_E_PROTO;
  } else {
    rc = segmap_put(m, &m->allocs, AL_WIDTH, rec);
    if (rc) snprintf(why, cap, "out of memory");
  }
  pthread_mutex_unlock(&m->mu);
  return rc;
}

int gmb__segmap_remove(struct gmb_segmap *m, uint64_t id) {
  uint64_t rec[AL_WIDTH], view[SEG_WIDTH];
  pthread_mutex_lock(&m->mu);
  int rc = id ? segmap_del(m, &m->allocs, AL_WIDTH, id, rec) : GMB_E_NOENT;
  /* A view goes with its allocation. */
  int unmap = rc == 0 && (rec[AL_SEGMENT] & GMB_SEGMAP_VIEW) &&
              segmap_del(m, &m->segments, SEG_WIDTH, rec[AL_SEGMENT],
                         view) == 0;
  pthread_mutex_unlock(&m->mu);
  if (unmap) segmap_release(view);
  return rc;
}

/* Where [offset, +size) of the segment record `s` is: 0 with *ptr set, 1
 * when there is no record, GMB_E_PROTO when the range does not fit (a
 * segment mapped again smaller than it was checked against).  In a read
 * section: the words are read once each, so the check and the address use
 * the same values. */
static inline int segmap_address(const uint64_t *s, uint64_t offset,
                                 uint64_t size, void **ptr) {
  if (s == NULL) return 1;
  uint64_t base = segmap_load(&s[SEG_BASE]), ssize = segmap_load(&s[SEG_SIZE]);
  if (offset > ssize || size > ssize - offset) return GMB_E_PROTO;
  *ptr = (void *)(uintptr_t)(base + offset);
  return 0;
}

int gmb__segmap_lookup(struct gmb_segmap *m, uint64_t id, void **ptr,
                       uint64_t *segment) {
  int rc;
  unsigned s;
  void *p = NULL;
  uint64_t seg = 0;
  do {
    s = segmap_read_begin(m);
    const uint64_t *a = segmap_find(&m->allocs, AL_WIDTH, id);
    if (a == NULL) {
      rc = GMB_E_NOENT;
      continue;
    }
    seg = segmap_load(&a[AL_SEGMENT]);
    rc = segmap_address(segmap_find(&m->segments, SEG_WIDTH, seg),
                        segmap_load(&a[AL_OFFSET]), segmap_load(&a[AL_SIZE]),
                        &p);
  } while (segmap_read_retry(m, s));
  if (rc == 0) *ptr = p;
  if (rc == 1) *segment = seg;
  return rc;
}

/*
 * gmb_lock's and gmb_unlock's lookups try once in line and leave waiting
 * and retrying to a loop out of line: a call inside the fast path would
 * make it save and restore registers on every call, a tenth of its work.
 * Each *_once reads one snapshot and may write its outputs from a torn
 * one; its caller writes them again on retry.
 */
static inline int segmap_get_once(const struct gmb_segmap *m, uint64_t id,
                                  const struct gmb__lt_slot *lt,
                                  uint32_t nslots,
                                  struct gmb_segmap_entry *out) {
  const uint64_t *a = segmap_find(&m->allocs, AL_WIDTH, id);
  if (a == NULL) return GMB_E_NOENT;
  uint64_t fs = segmap_load(&a[AL_FLAGS_SLOT]);
  out->id = id;
  out->segment = segmap_load(&a[AL_SEGMENT]);
  out->offset = segmap_load(&a[AL_OFFSET]);
  out->size = segmap_load(&a[AL_SIZE]);
  out->flags = (unsigned)(fs >> 32);
  out->slot = (uint32_t)fs;
  out->ptr = NULL;
  out->guess_segment = 0;
  out->guess_size = 0;
  out->guess_base = NULL;
  if (out->slot == GMB_SEGMAP_NO_SLOT) {
    /* It never moves: resolve its address in the same read section,
     * which is all gmb_lock needs. */
    segmap_address(segmap_find(&m->segments, SEG_WIDTH, out->segment),
                   out->offset, out->size, &out->ptr);
  } else if (lt != NULL && out->slot < nslots) {
    /* The slot index is checked here, not only at add time: a torn read
     * may give any value, and the table must not be overrun. */
    uint64_t g = __atomic_load_n(&lt[out->slot].segment, __ATOMIC_RELAXED);
    const uint64_t *r = segmap_find(&m->segments, SEG_WIDTH, g);
    if (r) {
      out->guess_segment = g;
      out->guess_base = (uint8_t *)(uintptr_t)segmap_load(&r[SEG_BASE]);
      out->guess_size = segmap_load(&r[SEG_SIZE]);
    }
  }
  return 0;
}

__attribute__((noinline)) static int
segmap_get_slow(const struct gmb_segmap *m, uint64_t id,
                const struct gmb__lt_slot *lt, uint32_t nslots,
                struct gmb_segmap_entry *out) {
  int rc;
  unsigned s;
  do {
    s = segmap_read_begin(m);
    rc = segmap_get_once(m, id, lt, nslots, out);
  } while (segmap_read_retry(m, s));
  return rc;
}

int gmb__segmap_get(struct gmb_segmap *m, uint64_t id,
                    const struct gmb__lt_slot *lt, uint32_t nslots,
                    struct gmb_segmap_entry *out) {
  unsigned s = __atomic_load_n(&m->seq, __ATOMIC_ACQUIRE);
  if (__builtin_expect(!(s & 1), 1)) {
    int rc = segmap_get_once(m, id, lt, nslots, out);
    if (!segmap_read_retry(m, s)) return rc;
  }
  return segmap_get_slow(m, id, lt, nslots, out);
}

static inline int segmap_slot_once(const struct gmb_segmap *m, uint64_t id,
                                   uint32_t *slot) {
  const uint64_t *a = segmap_find(&m->allocs, AL_WIDTH, id);
  if (a == NULL) return GMB_E_NOENT;
  *slot = (uint32_t)segmap_load(&a[AL_FLAGS_SLOT]);
  return 0;
}

__attribute__((noinline)) static int
segmap_slot_slow(const struct gmb_segmap *m, uint64_t id, uint32_t *slot) {
  int rc;
  unsigned s;
  do {
    s = segmap_read_begin(m);
    rc = segmap_slot_once(m, id, slot);
  } while (segmap_read_retry(m, s));
  return rc;
}

int gmb__segmap_slot(struct gmb_segmap *m, uint64_t id, uint32_t *slot) {
  unsigned s = __atomic_load_n(&m->seq, __ATOMIC_ACQUIRE);
  if (__builtin_expect(!(s & 1), 1)) {
    int rc = segmap_slot_once(m, id, slot);
    if (!segmap_read_retry(m, s)) return rc;
  }
  return segmap_slot_slow(m, id, slot);
}

int gmb__segmap_ptr(struct gmb_segmap *m, uint64_t segment, uint64_t offset,
                    uint64_t size, void **ptr) {
  int rc;
  unsigned s;
  void *p = NULL;
  do {
    s = segmap_read_begin(m);
    rc = segmap_address(segmap_find(&m->segments, SEG_WIDTH, segment), offset,
                        size, &p);
  } while (segmap_read_retry(m, s));
  if (rc == 0) *ptr = p;
  return rc;
}

size_t gmb__segmap_count(struct gmb_segmap *m) {
  pthread_mutex_lock(&m->mu);
  size_t n = m->allocs.n;
  pthread_mutex_unlock(&m->mu);
  return n;
}
