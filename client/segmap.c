/*
 * segmap.c - the segments a client has mapped and its allocations in them.
 *
 * Two tables, both open-addressing hash maps from a 64-bit id to a record
 * (allocation ids and segment ids are never 0, so key 0 marks an empty
 * slot).  Lookups are O(1) because gmb_lock sits on the hot path of every
 * kernel launch.  Deletion shifts later entries back instead of leaving
 * tombstones, so a long-lived client that allocates and frees for hours
 * keeps short probe sequences.
 *
 * An allocation record keeps where the allocation was made and, for a
 * movable one, its lock-table slot; where a movable allocation is now is
 * in the lock table, not here (client.c).
 *
 * Invariants: a segment record exists exactly while its memory is mapped;
 * an allocation record's range lies inside the segment size it was checked
 * against; all of it is guarded by one rwlock.
 *
 * A host segment is a POSIX shm object named by the handle; the object's
 * size is checked before mmap, because touching a mapping past the end of
 * a short object raises SIGBUS in the application, and the library must
 * never crash on what the broker sends.
 */
#include "segmap.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "gmb.h"

/* --- a u64 -> pointer hash map -------------------------------------------- */

struct segmap_table {
  uint64_t *keys;
  void **vals;
  size_t cap; /* a power of two, or 0 */
  size_t n;
};

static size_t segmap_hash(uint64_t k, size_t cap) {
  /* splitmix64's finaliser: ids are sequential, so spread them. */
  k ^= k >> 30;
  k *= UINT64_C(0xbf58476d1ce4e5b9);
  k ^= k >> 27;
  k *= UINT64_C(0x94d049bb133111eb);
  k ^= k >> 31;
  return (size_t)k & (cap - 1);
}

static void *segmap_table_get(const struct segmap_table *t, uint64_t k) {
  if (t->cap == 0) return NULL;
  for (size_t i = segmap_hash(k, t->cap);; i = (i + 1) & (t->cap - 1)) {
    if (t->keys[i] == k) return t->vals[i];
    if (t->keys[i] == 0) return NULL;
  }
}

static int segmap_table_grow(struct segmap_table *t) {
  size_t cap = t->cap ? t->cap * 2 : 16;
  uint64_t *keys = calloc(cap, sizeof *keys);
  void **vals = calloc(cap, sizeof *vals);
  if (keys == NULL || vals == NULL) {
    free(keys);
    free(vals);
    return GMB_E_SYSTEM;
  }
  for (size_t j = 0; j < t->cap; j++) {
    if (t->keys[j] == 0) continue;
    size_t i = segmap_hash(t->keys[j], cap);
    while (keys[i]) i = (i + 1) & (cap - 1);
    keys[i] = t->keys[j];
    vals[i] = t->vals[j];
  }
  free(t->keys);
  free(t->vals);
  t->keys = keys;
  t->vals = vals;
  t->cap = cap;
  return 0;
}

/* The key must not be present. */
static int segmap_table_put(struct segmap_table *t, uint64_t k, void *v) {
  if ((t->n + 1) * 4 > t->cap * 3) { /* load factor at most 3/4 */
    int rc = segmap_table_grow(t);
    if (rc) return rc;
  }
  size_t i = segmap_hash(k, t->cap);
  while (t->keys[i]) i = (i + 1) & (t->cap - 1);
  t->keys[i] = k;
  t->vals[i] = v;
  t->n++;
  return 0;
}

/* Removes k and returns its value, or NULL when absent. */
static void *segmap_table_del(struct segmap_table *t, uint64_t k) {
  if (t->cap == 0) return NULL;
  size_t mask = t->cap - 1, i = segmap_hash(k, t->cap);
  while (t->keys[i] != k) {
    if (t->keys[i] == 0) return NULL;
    i = (i + 1) & mask;
  }
  void *v = t->vals[i];
  /* Backward shift: move up every later entry of the run whose home slot
   * is not between the hole and itself (cyclically). */
  size_t hole = i;
  for (size_t j = (i + 1) & mask; t->keys[j]; j = (j + 1) & mask) {
    size_t home = segmap_hash(t->keys[j], t->cap);
    int movable = hole <= j ? (home <= hole || home > j)
                            : (home <= hole && home > j);
    if (movable) {
      t->keys[hole] = t->keys[j];
      t->vals[hole] = t->vals[j];
      hole = j;
    }
  }
  t->keys[hole] = 0;
  t->vals[hole] = NULL;
  t->n--;
  return v;
}

static void segmap_table_free(struct segmap_table *t) {
  free(t->keys);
  free(t->vals);
  memset(t, 0, sizeof *t);
}

/* --- segments and allocations ------------------------------------------- */

struct segmap_segment {
  uint64_t id;
  uint8_t *base;
  uint64_t size;
};

struct segmap_alloc {
  uint64_t id, segment, offset, size;
  unsigned flags;
  uint32_t slot; /* lock-table slot, or GMB_SEGMAP_NO_SLOT */
};

struct gmb_segmap {
  pthread_rwlock_t lock;
  struct segmap_table segments; /* id -> struct segmap_segment */
  struct segmap_table allocs;   /* id -> struct segmap_alloc */
};

struct gmb_segmap *gmb__segmap_new(void) {
  struct gmb_segmap *m = calloc(1, sizeof *m);
  if (m == NULL) return NULL;
  if (pthread_rwlock_init(&m->lock, NULL) != 0) {
    free(m);
    return NULL;
  }
  return m;
}

static void segmap_segment_free(struct segmap_segment *s) {
  munmap(s->base, (size_t)s->size);
  free(s);
}

void gmb__segmap_destroy(struct gmb_segmap *m) {
  if (m == NULL) return;
  for (size_t i = 0; i < m->segments.cap; i++)
    if (m->segments.keys[i]) segmap_segment_free(m->segments.vals[i]);
  for (size_t i = 0; i < m->allocs.cap; i++)
    if (m->allocs.keys[i]) free(m->allocs.vals[i]);
  segmap_table_free(&m->segments);
  segmap_table_free(&m->allocs);
  pthread_rwlock_destroy(&m->lock);
  free(m);
}

int gmb__segmap_has_segment(struct gmb_segmap *m, uint64_t segment) {
  pthread_rwlock_rdlock(&m->lock);
  int has = segmap_table_get(&m->segments, segment) != NULL;
  pthread_rwlock_unlock(&m->lock);
  return has;
}

/* Opens and maps a host segment; the caller holds no lock (mmap is slow
 * and needs none). */
static int segmap_map_host(const struct wire_handle *h, uint8_t **base,
                           char *why, size_t cap) {
  char name[WIRE_HANDLE_MAX + 1];
  if (memchr(h->bytes, '\0', h->len) != NULL) {
    snprintf(why, cap, "segment %llu: handle is not a shm name",
             (unsigned long long)h->segment);
    return GMB_E_PROTO;
  }
  memcpy(name, h->bytes, h->len);
  name[h->len] = '\0';
  if (name[0] != '/' || strchr(name + 1, '/') != NULL) {
    snprintf(why, cap, "segment %llu: bad shm name \"%s\"",
             (unsigned long long)h->segment, name);
    return GMB_E_PROTO;
  }
  int fd = shm_open(name, O_RDWR | O_CLOEXEC, 0);
  if (fd < 0) {
    snprintf(why, cap, "segment %llu: shm_open %s: %s",
             (unsigned long long)h->segment, name, strerror(errno));
    return GMB_E_SYSTEM;
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || st.st_size < 0 ||
      (uint64_t)st.st_size < h->size) {
    snprintf(why, cap, "segment %llu: shm object %s is smaller than %llu bytes",
             (unsigned long long)h->segment, name,
             (unsigned long long)h->size);
    close(fd);
    return GMB_E_PROTO;
  }
  void *p = mmap(NULL, (size_t)h->size, PROT_READ | PROT_WRITE, MAP_SHARED,
                 fd, 0);
  int err = errno;
  close(fd);
  if (p == MAP_FAILED) {
    snprintf(why, cap, "segment %llu: mmap %s: %s",
             (unsigned long long)h->segment, name, strerror(err));
    return GMB_E_SYSTEM;
  }
  *base = p;
  return 0;
}

int gmb__segmap_map(struct gmb_segmap *m, const char *device,
                    const struct wire_handle *h, char *why, size_t cap) {
  if (h->segment == 0 || h->size == 0 || h->len == 0 ||
      h->len > WIRE_HANDLE_MAX || h->size > SIZE_MAX) {
    snprintf(why, cap, "segment %llu: empty or impossible handle",
             (unsigned long long)h->segment);
    return GMB_E_PROTO;
  }
  if (gmb__segmap_has_segment(m, h->segment)) return 0;
  if (strcmp(device, "cuda") == 0) {
    snprintf(why, cap, "CUDA client support not built yet");
    return GMB_E_DEVICE;
  }
  if (strcmp(device, "host") != 0) {
    snprintf(why, cap, "the broker's device \"%s\" is unknown to libgmb %s",
             device, GMB_VERSION_STRING);
    return GMB_E_DEVICE;
  }
  struct segmap_segment *s = calloc(1, sizeof *s);
  if (s == NULL) {
    snprintf(why, cap, "out of memory");
    return GMB_E_SYSTEM;
  }
  int rc = segmap_map_host(h, &s->base, why, cap);
  if (rc) {
    free(s);
    return rc;
  }
  s->id = h->segment;
  s->size = h->size;
  pthread_rwlock_wrlock(&m->lock);
  /* Another thread may have mapped it meanwhile: keep one mapping. */
  if (segmap_table_get(&m->segments, s->id) != NULL) {
    pthread_rwlock_unlock(&m->lock);
    segmap_segment_free(s);
    return 0;
  }
  rc = segmap_table_put(&m->segments, s->id, s);
  pthread_rwlock_unlock(&m->lock);
  if (rc) {
    segmap_segment_free(s);
    snprintf(why, cap, "out of memory");
  }
  return rc;
}

void gmb__segmap_retire(struct gmb_segmap *m, uint64_t segment) {
  pthread_rwlock_wrlock(&m->lock);
  struct segmap_segment *s = segmap_table_del(&m->segments, segment);
  pthread_rwlock_unlock(&m->lock);
  if (s) segmap_segment_free(s);
}

int gmb__segmap_add(struct gmb_segmap *m, uint64_t id, uint64_t segment,
                    uint64_t offset, uint64_t size, unsigned flags,
                    uint32_t slot, char *why, size_t cap) {
  struct segmap_alloc *a = malloc(sizeof *a);
  if (a == NULL) {
    snprintf(why, cap, "out of memory");
    return GMB_E_SYSTEM;
  }
  *a = (struct segmap_alloc){id, segment, offset, size, flags, slot};
  int rc = 0;
  pthread_rwlock_wrlock(&m->lock);
  struct segmap_segment *s = segmap_table_get(&m->segments, segment);
  if (id == 0) {
    snprintf(why, cap, "the broker gave allocation id 0");
    rc = GMB_E_PROTO;
  } else if (s == NULL) {
    snprintf(why, cap, "allocation %llu: segment %llu is not mapped",
             (unsigned long long)id, (unsigned long long)segment);
    rc = GMB_E_PROTO;
  } else if (size == 0 || offset > s->size || size > s->size - offset) {
    snprintf(why, cap,
             "allocation %llu: [%llu, +%llu) is outside segment %llu of "
             "%llu bytes",
             (unsigned long long)id, (unsigned long long)offset,
             (unsigned long long)size, (unsigned long long)segment,
             (unsigned long long)s->size);
    rc = GMB_E_PROTO;
  } else if (segmap_table_get(&m->allocs, id) != NULL) {
    snprintf(why, cap, "allocation %llu was given twice",
             (unsigned long long)id);
    rc = GMB_E_PROTO;
  } else {
    rc = segmap_table_put(&m->allocs, id, a);
    if (rc) snprintf(why, cap, "out of memory");
  }
  pthread_rwlock_unlock(&m->lock);
  if (rc) free(a);
  return rc;
}

int gmb__segmap_remove(struct gmb_segmap *m, uint64_t id) {
  pthread_rwlock_wrlock(&m->lock);
  struct segmap_alloc *a = id ? segmap_table_del(&m->allocs, id) : NULL;
  pthread_rwlock_unlock(&m->lock);
  free(a);
  return a ? 0 : GMB_E_NOENT;
}

int gmb__segmap_lookup(struct gmb_segmap *m, uint64_t id, void **ptr,
                       uint64_t *segment) {
  int rc;
  pthread_rwlock_rdlock(&m->lock);
  struct segmap_alloc *a = id ? segmap_table_get(&m->allocs, id) : NULL;
  if (a == NULL) {
    rc = GMB_E_NOENT;
  } else {
    struct segmap_segment *s = segmap_table_get(&m->segments, a->segment);
    if (s == NULL) {
      *segment = a->segment;
      rc = 1;
    } else if (a->offset > s->size || a->size > s->size - a->offset) {
      /* Re-mapped with a smaller size than the allocation was checked
       * against: refuse rather than hand out a pointer past the end. */
      rc = GMB_E_PROTO;
    } else {
      *ptr = s->base + a->offset;
      rc = 0;
    }
  }
  pthread_rwlock_unlock(&m->lock);
  return rc;
}

int gmb__segmap_get(struct gmb_segmap *m, uint64_t id,
                    struct gmb_segmap_entry *out) {
  pthread_rwlock_rdlock(&m->lock);
  struct segmap_alloc *a = id ? segmap_table_get(&m->allocs, id) : NULL;
  if (a)
    *out = (struct gmb_segmap_entry){a->id,   a->segment, a->offset,
                                     a->size, a->flags,   a->slot};
  pthread_rwlock_unlock(&m->lock);
  return a ? 0 : GMB_E_NOENT;
}

int gmb__segmap_ptr(struct gmb_segmap *m, uint64_t segment, uint64_t offset,
                    uint64_t size, void **ptr) {
  int rc;
  pthread_rwlock_rdlock(&m->lock);
  struct segmap_segment *s = segmap_table_get(&m->segments, segment);
  if (s == NULL) {
    rc = 1;
  } else if (offset > s->size || size > s->size - offset) {
    rc = GMB_E_PROTO;
  } else {
    *ptr = s->base + offset;
    rc = 0;
  }
  pthread_rwlock_unlock(&m->lock);
  return rc;
}

size_t gmb__segmap_count(struct gmb_segmap *m) {
  pthread_rwlock_rdlock(&m->lock);
  size_t n = m->allocs.n;
  pthread_rwlock_unlock(&m->lock);
  return n;
}
