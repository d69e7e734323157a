/*
 * check_segmap.c - the client's segment map alone: its hash tables, its
 * checks on what the broker sends, and its lock-free readers against a
 * writer that changes the tables under them.
 *
 * Each test maps segment 1 from a sealed memfd the fixture creates (1 MiB),
 * as the broker sends a segment over the descriptor channel: the map
 * takes (segment, size, fd) and must neither keep nor close the caller's
 * descriptor (the teardown closes every one and checks that the process
 * has as many open as before the test).  Nothing is named in /dev/shm.  The thread tests run readers that take every
 * lookup the client's gmb_lock and gmb_unlock take, while a writer grows,
 * shrinks and shifts the tables and maps and retires a second segment;
 * every record's fields are a function of its id, so a reader can tell a
 * torn or mixed entry from a whole one.  Readers never call Check's
 * asserts (not safe off the main thread): they count what they saw wrong
 * and keep the first description for the main thread to report.
 *
 * Knobs: SCALE (multiplies table sizes), ITER (writer rounds in the thread
 * tests, default 3), SEED.
 */
#include <check.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "check_main.h"
#include "gmb.h"
#include "locktab_layout.h"
#include "segmap.h"

#define SEG_SIZE (1u << 20)
#define SEG1 UINT64_C(1)
#define SEG2 UINT64_C(2)

static unsigned env_uint(const char *name, unsigned dflt) {
  const char *v = getenv(name);
  return v && *v ? (unsigned)strtoul(v, NULL, 10) : dflt;
}

/* --- fixture ------------------------------------------------------------ */

static struct gmb_segmap *m;
static char why[512];
static int fds_before;

#define SEALS_BROKER (F_SEAL_SHRINK | F_SEAL_GROW)
#define MAX_FDS 16
static int fds[MAX_FDS], n_fds;

/* A memfd of `bytes` with `seals` added (0: none), as the broker makes a
 * segment (SEALS_BROKER); the teardown closes it. */
static int make_memfd(uint64_t bytes, unsigned seals) {
  ck_assert_int_lt(n_fds, MAX_FDS);
  int fd = memfd_create("gmb-test-segmap", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  ck_assert_int_ge(fd, 0);
  ck_assert_int_eq(ftruncate(fd, (off_t)bytes), 0);
  if (seals) ck_assert_int_eq(fcntl(fd, F_ADD_SEALS, seals), 0);
  fds[n_fds++] = fd;
  return fd;
}

static int seg1_fd;

static void setup(void) {
  n_fds = 0;
  fds_before = check_count_fds();
  m = gmb__segmap_new();
  ck_assert_ptr_nonnull(m);
  seg1_fd = make_memfd(SEG_SIZE, SEALS_BROKER);
  ck_assert_int_eq(gmb__segmap_map(m, "host", SEG1, SEG_SIZE, seg1_fd, why,
                                   sizeof why), 0);
}

static void teardown(void) {
  gmb__segmap_destroy(m);
  m = NULL;
  for (int i = 0; i < n_fds; i++)
    ck_assert_msg(close(fds[i]) == 0, "descriptor %d was closed by the map",
                  fds[i]);
  n_fds = 0;
  ck_assert_int_eq(check_count_fds(), fds_before);
}

static uint8_t *seg_base(uint64_t segment) {
  void *p = NULL;
  ck_assert_int_eq(gmb__segmap_ptr(m, segment, 0, 1, &p), 0);
  return p;
}

/* --- records whose fields follow from the id ---------------------------- */

static uint64_t want_offset(uint64_t id) { return (id * 64) % (SEG_SIZE - 64); }
static uint64_t want_size(uint64_t id) { return 1 + id % 64; }
static unsigned want_flags(uint64_t id) { return (unsigned)(id & 3); }
static uint32_t want_slot(uint64_t id) {
  return id & 1 ? (uint32_t)(id % 4096) : GMB_SEGMAP_NO_SLOT;
}

static int add_id(uint64_t id) {
  return gmb__segmap_add(m, id, SEG1, want_offset(id), want_size(id),
                         want_flags(id), want_slot(id), why, sizeof why);
}

/* NULL when `e` is exactly what add_id(id) recorded, else what differs. */
static const char *entry_wrong(uint64_t id, const struct gmb_segmap_entry *e,
                               const uint8_t *base) {
  if (e->id != id) return "id";
  if (e->segment != SEG1) return "segment";
  if (e->offset != want_offset(id)) return "offset";
  if (e->size != want_size(id)) return "size";
  if (e->flags != want_flags(id)) return "flags";
  if (e->slot != want_slot(id)) return "slot";
  if (e->slot == GMB_SEGMAP_NO_SLOT && e->ptr != base + want_offset(id))
    return "address";
  if (e->slot != GMB_SEGMAP_NO_SLOT && e->ptr != NULL)
    return "address of a slotted entry";
  return NULL;
}

/* --- single-threaded ---------------------------------------------------- */

START_TEST(add_get_remove) {
  uint8_t *base = seg_base(SEG1);
  ck_assert_int_eq(add_id(10), 0); /* pinned */
  ck_assert_int_eq(add_id(11), 0); /* with a slot */
  struct gmb_segmap_entry e;
  for (uint64_t id = 10; id <= 11; id++) {
    ck_assert_int_eq(gmb__segmap_get(m, id, NULL, 0, &e), 0);
    const char *bad = entry_wrong(id, &e, base);
    ck_assert_msg(bad == NULL, "id %llu: %s", (unsigned long long)id, bad);
    ck_assert_ptr_null(e.guess_base);
    uint32_t slot = 0;
    ck_assert_int_eq(gmb__segmap_slot(m, id, &slot), 0);
    ck_assert_uint_eq(slot, want_slot(id));
  }
  void *p = NULL;
  uint64_t seg = 0;
  ck_assert_int_eq(gmb__segmap_lookup(m, 10, &p, &seg), 0);
  ck_assert_ptr_eq(p, base + want_offset(10));
  ck_assert_uint_eq(gmb__segmap_count(m), 2);
  ck_assert_int_eq(gmb__segmap_remove(m, 10), 0);
  ck_assert_int_eq(gmb__segmap_remove(m, 10), GMB_E_NOENT);
  ck_assert_int_eq(gmb__segmap_get(m, 10, NULL, 0, &e), GMB_E_NOENT);
  ck_assert_int_eq(gmb__segmap_lookup(m, 10, &p, &seg), GMB_E_NOENT);
  ck_assert_uint_eq(gmb__segmap_count(m), 1);
}
END_TEST

START_TEST(id_zero_is_never_found) {
  /* 0 marks an empty slot inside the tables: it must not find one. */
  struct gmb_segmap_entry e;
  uint32_t slot;
  void *p;
  uint64_t seg;
  ck_assert_int_eq(gmb__segmap_add(m, 0, SEG1, 0, 1, 0, GMB_SEGMAP_NO_SLOT,
                                   why, sizeof why),
                   GMB_E_PROTO);
  ck_assert_int_eq(gmb__segmap_get(m, 0, NULL, 0, &e), GMB_E_NOENT);
  ck_assert_int_eq(gmb__segmap_slot(m, 0, &slot), GMB_E_NOENT);
  ck_assert_int_eq(gmb__segmap_lookup(m, 0, &p, &seg), GMB_E_NOENT);
  ck_assert_int_eq(gmb__segmap_remove(m, 0), GMB_E_NOENT);
  ck_assert_int_eq(gmb__segmap_has_segment(m, 0), 0);
  ck_assert_int_eq(gmb__segmap_ptr(m, 0, 0, 1, &p), 1);
  gmb__segmap_retire(m, 0); /* nothing to retire */
  ck_assert_int_eq(gmb__segmap_has_segment(m, SEG1), 1);
}
END_TEST

START_TEST(add_twice_refused) {
  ck_assert_int_eq(add_id(7), 0);
  ck_assert_int_eq(add_id(7), GMB_E_PROTO);
  ck_assert_uint_eq(gmb__segmap_count(m), 1);
}
END_TEST

START_TEST(add_outside_segment_refused) {
  const uint32_t no = GMB_SEGMAP_NO_SLOT;
  ck_assert_int_eq(gmb__segmap_add(m, 1, SEG1, SEG_SIZE, 1, 0, no, why,
                                   sizeof why), GMB_E_PROTO);
  ck_assert_int_eq(gmb__segmap_add(m, 2, SEG1, 1, UINT64_MAX, 0, no, why,
                                   sizeof why), GMB_E_PROTO);
  ck_assert_int_eq(gmb__segmap_add(m, 3, SEG1, 0, 0, 0, no, why, sizeof why),
                   GMB_E_PROTO);
  ck_assert_int_eq(gmb__segmap_add(m, 4, SEG2, 0, 1, 0, no, why, sizeof why),
                   GMB_E_PROTO); /* not mapped */
  ck_assert_int_eq(gmb__segmap_add(m, 5, SEG1, SEG_SIZE - 1, 1, 0, no, why,
                                   sizeof why), 0); /* the last byte */
  ck_assert_uint_eq(gmb__segmap_count(m), 1);
}
END_TEST

/* A host map from `fd`, of `size` bytes as segment 2. */
static int map2(uint64_t size, int fd) {
  return gmb__segmap_map(m, "host", SEG2, size, fd, why, sizeof why);
}

START_TEST(map_short_descriptor_refused) {
  /* Touching a mapping past the end of its file is SIGBUS. */
  int fd = make_memfd(4096, SEALS_BROKER);
  ck_assert_int_eq(map2(8192, fd), GMB_E_PROTO);
  ck_assert_ptr_nonnull(strstr(why, "fewer than 8192 bytes"));
  ck_assert_int_eq(gmb__segmap_has_segment(m, SEG2), 0);
  ck_assert_int_eq(map2(4097, fd), GMB_E_PROTO); /* one byte short */
  /* Empty, as a broker that forgot its ftruncate would send it. */
  ck_assert_int_eq(map2(4096, make_memfd(0, SEALS_BROKER)), GMB_E_PROTO);
  ck_assert_int_eq(gmb__segmap_has_segment(m, SEG2), 0);
  ck_assert_int_eq(map2(4096, fd), 0);
  ck_assert_int_eq(gmb__segmap_has_segment(m, SEG2), 1);
  void *p;
  ck_assert_int_eq(gmb__segmap_ptr(m, SEG2, 4095, 1, &p), 0);
  ck_assert_uint_eq(*(volatile uint8_t *)p, 0);
  ck_assert_int_eq(gmb__segmap_ptr(m, SEG2, 4096, 1, &p), GMB_E_PROTO);
}
END_TEST

START_TEST(map_larger_descriptor_maps_what_was_said) {
  /* A file larger than announced is mapped to the announced size: the
   * ranges are checked against what the broker said, not the file. */
  int fd = make_memfd(16384, SEALS_BROKER);
  ck_assert_int_eq(map2(8192, fd), 0);
  void *p;
  ck_assert_int_eq(gmb__segmap_ptr(m, SEG2, 8191, 1, &p), 0);
  ck_assert_int_eq(gmb__segmap_ptr(m, SEG2, 8192, 1, &p), GMB_E_PROTO);
}
END_TEST

START_TEST(map_unsealed_descriptor_refused) {
  /* Without F_SEAL_SHRINK anyone holding the descriptor (the other
   * processes of the tenant, too) could truncate it under the mapping. */
  ck_assert_int_eq(map2(8192, make_memfd(8192, 0)), GMB_E_PROTO);
  ck_assert_ptr_nonnull(strstr(why, "not sealed against shrinking"));
  ck_assert_int_eq(map2(8192, make_memfd(8192, F_SEAL_GROW)), GMB_E_PROTO);
  /* A memfd made without MFD_ALLOW_SEALING has only F_SEAL_SEAL. */
  ck_assert_int_lt(n_fds, MAX_FDS);
  int nosealing = memfd_create("gmb-test-segmap", MFD_CLOEXEC);
  ck_assert_int_ge(nosealing, 0);
  fds[n_fds++] = nosealing;
  ck_assert_int_eq(ftruncate(nosealing, 8192), 0);
  ck_assert_int_eq(map2(8192, nosealing), GMB_E_PROTO);
  /* Not a memfd at all: a pipe has no seals (F_GET_SEALS fails). */
  int pp[2];
  ck_assert_int_eq(pipe(pp), 0);
  ck_assert_int_eq(map2(8192, pp[0]), GMB_E_PROTO);
  close(pp[0]);
  close(pp[1]);
  ck_assert_int_eq(gmb__segmap_has_segment(m, SEG2), 0);
  /* Shrinking is the seal that matters to a mapping; growing does not. */
  ck_assert_int_eq(map2(8192, make_memfd(8192, F_SEAL_SHRINK)), 0);
  ck_assert_int_eq(gmb__segmap_has_segment(m, SEG2), 1);
}
END_TEST

START_TEST(map_write_sealed_descriptor_refused) {
  /* Sealed against writes: a shared writable mapping is impossible. */
  int fd = make_memfd(8192, SEALS_BROKER | F_SEAL_WRITE);
  ck_assert_int_eq(map2(8192, fd), GMB_E_SYSTEM);
  ck_assert_ptr_nonnull(strstr(why, "mmap"));
  ck_assert_int_eq(gmb__segmap_has_segment(m, SEG2), 0);
}
END_TEST

START_TEST(map_bad_arguments_refused) {
  int fd = make_memfd(8192, SEALS_BROKER);
  ck_assert_int_eq(gmb__segmap_map(m, "host", 0, 8192, fd, why, sizeof why),
                   GMB_E_PROTO);
  ck_assert_int_eq(map2(0, fd), GMB_E_PROTO);
  ck_assert_int_eq(map2(8192, -1), GMB_E_PROTO);
  /* A descriptor number that is not open. */
  int closed = make_memfd(8192, SEALS_BROKER);
  n_fds--;
  close(closed);
  ck_assert_int_eq(map2(8192, closed), GMB_E_PROTO);
  ck_assert_int_eq(gmb__segmap_map(m, "tpu", SEG2, 8192, fd, why, sizeof why),
                   GMB_E_DEVICE);
  ck_assert_int_eq(gmb__segmap_has_segment(m, SEG2), 0);
  /* Mapping a segment again keeps the first mapping, whatever comes. */
  uint8_t *base = seg_base(SEG1);
  ck_assert_int_eq(gmb__segmap_map(m, "host", SEG1, SEG_SIZE, seg1_fd, why,
                                   sizeof why), 0);
  ck_assert_int_eq(gmb__segmap_map(m, "host", SEG1, 8192, fd, why,
                                   sizeof why), 0);
  ck_assert_ptr_eq(seg_base(SEG1), base);
  void *p;
  ck_assert_int_eq(gmb__segmap_ptr(m, SEG1, SEG_SIZE - 1, 1, &p), 0);
}
END_TEST

START_TEST(map_outlives_the_descriptor) {
  /* The caller closes its descriptor after mapping (client.c does): the
   * mapping stays, and is the same memory as the broker's. */
  int fd = make_memfd(8192, SEALS_BROKER);
  uint8_t *mine = mmap(NULL, 8192, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ck_assert_ptr_ne(mine, MAP_FAILED);
  ck_assert_int_eq(map2(8192, fd), 0);
  ck_assert_int_ge(fcntl(fd, F_GETFD), 0); /* not closed by the map */
  n_fds--;
  ck_assert_int_eq(close(fd), 0);
  uint8_t *base = seg_base(SEG2);
  ck_assert_ptr_ne(base, mine);
  base[8191] = 0x5A;
  ck_assert_uint_eq(mine[8191], 0x5A);
  mine[0] = 0xA5;
  ck_assert_uint_eq(base[0], 0xA5);
  ck_assert_int_eq(munmap(mine, 8192), 0);
}
END_TEST

START_TEST(sealed_segment_cannot_shrink_under_the_map) {
  /* Why the seal is required: whoever holds the descriptor cannot truncate
   * it, so every mapped byte stays backed (no SIGBUS). */
  int fd = make_memfd(8192, SEALS_BROKER);
  ck_assert_int_eq(map2(8192, fd), 0);
  ck_assert_int_eq(ftruncate(fd, 0), -1);
  ck_assert_int_eq(errno, EPERM);
  ck_assert_int_eq(ftruncate(fd, 4096), -1);
  volatile uint8_t *base = seg_base(SEG2);
  base[8191] = 1;
  ck_assert_uint_eq(base[8191], 1);
}
END_TEST

START_TEST(ptr_checks_range) {
  uint8_t *base = seg_base(SEG1);
  void *p = NULL;
  ck_assert_int_eq(gmb__segmap_ptr(m, SEG1, SEG_SIZE - 8, 8, &p), 0);
  ck_assert_ptr_eq(p, base + SEG_SIZE - 8);
  ck_assert_int_eq(gmb__segmap_ptr(m, SEG1, SEG_SIZE - 8, 9, &p),
                   GMB_E_PROTO);
  ck_assert_int_eq(gmb__segmap_ptr(m, SEG1, 8, UINT64_MAX, &p), GMB_E_PROTO);
  ck_assert_int_eq(gmb__segmap_ptr(m, SEG1, UINT64_MAX, 1, &p), GMB_E_PROTO);
  ck_assert_int_eq(gmb__segmap_ptr(m, SEG2, 0, 1, &p), 1);
}
END_TEST

START_TEST(retire_keeps_allocations) {
  int fd = make_memfd(8192, SEALS_BROKER);
  ck_assert_int_eq(map2(8192, fd), 0);
  ck_assert_int_eq(gmb__segmap_add(m, 42, SEG2, 4096, 4096, 0,
                                   GMB_SEGMAP_NO_SLOT, why, sizeof why), 0);
  gmb__segmap_retire(m, SEG2);
  ck_assert_int_eq(gmb__segmap_has_segment(m, SEG2), 0);
  void *p = NULL;
  uint64_t seg = 0;
  ck_assert_int_eq(gmb__segmap_lookup(m, 42, &p, &seg), 1);
  ck_assert_uint_eq(seg, SEG2);
  struct gmb_segmap_entry e;
  ck_assert_int_eq(gmb__segmap_get(m, 42, NULL, 0, &e), 0);
  ck_assert_ptr_null(e.ptr);
  /* Mapped again, smaller than the allocation was checked against. */
  ck_assert_int_eq(map2(4096, fd), 0);
  ck_assert_int_eq(gmb__segmap_lookup(m, 42, &p, &seg), GMB_E_PROTO);
  ck_assert_int_eq(gmb__segmap_get(m, 42, NULL, 0, &e), 0);
  ck_assert_ptr_null(e.ptr);
  ck_assert_int_eq(gmb__segmap_remove(m, 42), 0);
}
END_TEST

START_TEST(guess_follows_the_slot) {
  ck_assert_int_eq(map2(8192, make_memfd(8192, SEALS_BROKER)), 0);
  struct gmb__lt_slot lt[8];
  memset(lt, 0, sizeof lt);
  ck_assert_int_eq(gmb__segmap_add(m, 9, SEG1, 0, 64, GMB_MOVABLE, 5, why,
                                   sizeof why), 0);
  struct gmb_segmap_entry e;
  lt[5].segment = SEG2;
  ck_assert_int_eq(gmb__segmap_get(m, 9, lt, 8, &e), 0);
  ck_assert_uint_eq(e.guess_segment, SEG2);
  ck_assert_ptr_eq(e.guess_base, seg_base(SEG2));
  ck_assert_uint_eq(e.guess_size, 8192);
  ck_assert_ptr_null(e.ptr);
  lt[5].segment = 77; /* not mapped here */
  ck_assert_int_eq(gmb__segmap_get(m, 9, lt, 8, &e), 0);
  ck_assert_ptr_null(e.guess_base);
  /* A slot past the table's end is never read. */
  lt[5].segment = SEG1;
  ck_assert_int_eq(gmb__segmap_get(m, 9, lt, 5, &e), 0);
  ck_assert_ptr_null(e.guess_base);
  ck_assert_int_eq(gmb__segmap_get(m, 9, NULL, 0, &e), 0);
  ck_assert_ptr_null(e.guess_base);
}
END_TEST

/* Random adds and removes against a model, with sequential ids (as a
 * broker gives them) and random ones (as a hostile one could), so that the
 * tables grow, wrap around their ends and shift runs back on removal. */
START_TEST(churn_matches_model) {
  unsigned scale = env_uint("SCALE", 1), seed = env_uint("SEED", 1);
  size_t n = 3000 * (size_t)scale;
  uint64_t *ids = malloc(n * sizeof *ids);
  char *in = calloc(n, 1);
  ck_assert_ptr_nonnull(ids);
  ck_assert_ptr_nonnull(in);
  srandom(seed);
  for (size_t i = 0; i < n; i++) {
    uint64_t r = ((uint64_t)random() << 33) ^ ((uint64_t)random() << 2);
    ids[i] = i % 2 ? i + 1 : (r | 1u << 20); /* distinct from 1..n */
  }
  uint8_t *base = seg_base(SEG1);
  size_t count = 0;
  for (size_t step = 0; step < 10 * n; step++) {
    size_t i = (size_t)random() % n;
    if (in[i]) {
      ck_assert_int_eq(gmb__segmap_remove(m, ids[i]), 0);
      in[i] = 0;
      count--;
    } else {
      ck_assert_int_eq(add_id(ids[i]), 0);
      in[i] = 1;
      count++;
    }
    if (step % (n / 4) == 0 || step == 10 * n - 1) {
      for (size_t j = 0; j < n; j++) {
        struct gmb_segmap_entry e;
        int rc = gmb__segmap_get(m, ids[j], NULL, 0, &e);
        ck_assert_int_eq(rc, in[j] ? 0 : GMB_E_NOENT);
        const char *bad = rc == 0 ? entry_wrong(ids[j], &e, base) : NULL;
        ck_assert_msg(bad == NULL, "id %llu: %s", (unsigned long long)ids[j],
                      bad);
      }
      ck_assert_uint_eq(gmb__segmap_count(m), count);
    }
  }
  free(ids);
  free(in);
}
END_TEST

/* --- threads ------------------------------------------------------------ */

/* One reader per spare core of a 2-core machine: a reader that shares a
 * core with the writer rarely runs in the middle of a write section. */
#define READERS 1
#define STABLE 64          /* ids 1..STABLE, never removed */
#define CHURN_FIRST 100000 /* ids the writer adds and removes */

struct readers {
  atomic_int stop, started;
  atomic_long reads, wrong;
  uint64_t churn; /* churn ids: CHURN_FIRST .. CHURN_FIRST + churn - 1 */
  _Atomic uint64_t cursor; /* the churn id the writer is changing */
  uint8_t *base1;
  pthread_mutex_t mu;
  char first[256]; /* the first thing a reader saw wrong */
};

static void reader_wrong(struct readers *r, const char *fmt, uint64_t id,
                         const char *what) {
  if (atomic_fetch_add(&r->wrong, 1) == 0) {
    pthread_mutex_lock(&r->mu);
    snprintf(r->first, sizeof r->first, fmt, (unsigned long long)id, what);
    pthread_mutex_unlock(&r->mu);
  }
}

/* Every lookup gmb_lock and gmb_unlock make, over and over. */
static void *reader_main(void *arg) {
  struct readers *r = arg;
  struct gmb__lt_slot lt[4096];
  memset(lt, 0, sizeof lt);
  for (size_t i = 0; i < 4096; i++) lt[i].segment = i % 2 ? SEG1 : SEG2;
  uint64_t x = 0;
  long reads = 0;
  while (!atomic_load_explicit(&r->stop, memory_order_relaxed)) {
    x = x * 6364136223846793005u + 1442695040888963407u;
    uint64_t id = x >> 40;
    /* Stable ids, random churn ids, and mostly the ids around the one
     * the writer is changing: where a torn read can happen at all. */
    switch (id % 4) {
    case 0:
      id = 1 + id % STABLE;
      break;
    case 1:
      id = CHURN_FIRST + id % r->churn;
      break;
    default:
      id = atomic_load_explicit(&r->cursor, memory_order_relaxed) + id % 3;
      break;
    }
    struct gmb_segmap_entry e;
    int rc = gmb__segmap_get(m, id, lt, 4096, &e);
    if (id <= STABLE && rc != 0) {
      reader_wrong(r, "stable id %llu: %s", id, "not found");
    } else if (rc == 0) {
      const char *bad = entry_wrong(id, &e, r->base1);
      if (bad) reader_wrong(r, "id %llu: torn %s", id, bad);
      if (e.slot != GMB_SEGMAP_NO_SLOT && e.guess_segment == SEG1 &&
          (e.guess_base != r->base1 || e.guess_size != SEG_SIZE))
        reader_wrong(r, "id %llu: %s", id, "wrong mapping of segment 1");
    } else if (rc != GMB_E_NOENT) {
      reader_wrong(r, "id %llu: %s", id, "impossible return");
    }
    uint32_t slot = 0;
    rc = gmb__segmap_slot(m, id, &slot);
    if (rc == 0 && slot != want_slot(id))
      reader_wrong(r, "id %llu: %s", id, "torn slot");
    if (id <= STABLE && rc != 0)
      reader_wrong(r, "stable id %llu: %s", id, "slot not found");
    void *p = NULL;
    rc = gmb__segmap_ptr(m, SEG1, id, 1, &p);
    if (rc != 0 || p != r->base1 + id)
      reader_wrong(r, "segment 1 at %llu: %s", id, "wrong address");
    /* Segment 2 comes and goes; what is asked of it must be answered as
     * mapped or not, never as a range that does not fit. */
    rc = gmb__segmap_ptr(m, SEG2, 4096, 4096, &p);
    if (rc != 0 && rc != 1)
      reader_wrong(r, "segment 2 at %llu: %s", 4096, "torn size");
    if (reads++ == 0) atomic_store(&r->started, 1);
  }
  atomic_fetch_add(&r->reads, reads);
  return NULL;
}

static uint64_t gcd(uint64_t a, uint64_t b) {
  while (b) {
    uint64_t t = a % b;
    a = b;
    b = t;
  }
  return a;
}

/*
 * One round of the writer: adds `churn` ids (growing the table from its
 * first size), removes them in a scattered order (shifting runs back),
 * and maps and retires segment 2 along the way.  NULL, or what failed: it
 * does not assert, since the readers must be stopped before the test may
 * end.
 */
static const char *writer_round(struct readers *r, int fd2,
                                unsigned *seed) {
  const uint64_t churn = r->churn;
  for (uint64_t i = 0; i < churn; i++) {
    atomic_store_explicit(&r->cursor, CHURN_FIRST + i, memory_order_relaxed);
    if (add_id(CHURN_FIRST + i) != 0) return "add";
    if (i % 256 == 0) {
      if (gmb__segmap_has_segment(m, SEG2))
        gmb__segmap_retire(m, SEG2);
      else if (map2(8192, fd2) != 0)
        return "map";
    }
  }
  uint64_t step = 1 + (uint64_t)rand_r(seed) % churn;
  while (gcd(step, churn) != 1) step++; /* a single cycle over all ids */
  for (uint64_t i = 0, j = 0; i < churn; i++, j = (j + step) % churn) {
    /* Removing j shifts the ids after it back: read those. */
    atomic_store_explicit(&r->cursor, CHURN_FIRST + j, memory_order_relaxed);
    if (gmb__segmap_remove(m, CHURN_FIRST + j) != 0) return "remove";
  }
  return NULL;
}

START_TEST(readers_never_see_torn_entries) {
  unsigned scale = env_uint("SCALE", 1), rounds = env_uint("ITER", 3);
  unsigned seed = env_uint("SEED", 1);
  int fd2 = make_memfd(8192, SEALS_BROKER);
  for (unsigned round = 0; round < rounds; round++) {
    /* A fresh map each round, so the tables grow under the readers. */
    gmb__segmap_destroy(m);
    m = gmb__segmap_new();
    ck_assert_ptr_nonnull(m);
    ck_assert_int_eq(gmb__segmap_map(m, "host", SEG1, SEG_SIZE, seg1_fd, why,
                                     sizeof why), 0);
    for (uint64_t id = 1; id <= STABLE; id++) ck_assert_int_eq(add_id(id), 0);
    struct readers r = {.churn = 4096 * (uint64_t)scale,
                        .cursor = CHURN_FIRST,
                        .base1 = seg_base(SEG1)};
    pthread_mutex_init(&r.mu, NULL);
    pthread_t t[READERS];
    for (int i = 0; i < READERS; i++)
      ck_assert_int_eq(pthread_create(&t[i], NULL, reader_main, &r), 0);
    /* On a busy machine a reader may not run for a while: writing before
     * it reads at all would test nothing. */
    while (!atomic_load(&r.started)) sched_yield();
    const char *failed = NULL;
    for (int pass = 0; pass < 6 && failed == NULL; pass++)
      failed = writer_round(&r, fd2, &seed);
    atomic_store(&r.stop, 1);
    for (int i = 0; i < READERS; i++) pthread_join(t[i], NULL);
    pthread_mutex_destroy(&r.mu);
    long wrong = atomic_load(&r.wrong), reads = atomic_load(&r.reads);
    ck_assert_msg(failed == NULL, "writer: %s failed (%s)", failed, why);
    ck_assert_msg(wrong == 0, "%ld wrong reads of %ld; first: %s", wrong,
                  reads, r.first);
    ck_assert_int_gt(reads, 0);
    ck_assert_uint_eq(gmb__segmap_count(m), STABLE);
  }
}
END_TEST

static Suite *segmap_suite(void) {
  Suite *s = suite_create("segmap");
  TCase *tc = tcase_create("table");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_add_test(tc, add_get_remove);
  tcase_add_test(tc, id_zero_is_never_found);
  tcase_add_test(tc, add_twice_refused);
  tcase_add_test(tc, add_outside_segment_refused);
  tcase_add_test(tc, map_short_descriptor_refused);
  tcase_add_test(tc, map_larger_descriptor_maps_what_was_said);
  tcase_add_test(tc, map_unsealed_descriptor_refused);
  tcase_add_test(tc, map_write_sealed_descriptor_refused);
  tcase_add_test(tc, map_bad_arguments_refused);
  tcase_add_test(tc, map_outlives_the_descriptor);
  tcase_add_test(tc, sealed_segment_cannot_shrink_under_the_map);
  tcase_add_test(tc, ptr_checks_range);
  tcase_add_test(tc, retire_keeps_allocations);
  tcase_add_test(tc, guess_follows_the_slot);
  tcase_add_test(tc, churn_matches_model);
  suite_add_tcase(s, tc);

  tc = tcase_create("threads");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_add_test(tc, readers_never_see_torn_entries);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) { return check_run(segmap_suite()); }
