/*
 * locktab.c - the broker's side of a session's lock table: the memfd, its
 * header, and the slots handed out to the session's movable allocations.
 *
 * Owns: the memfd and its mapping (the client maps the same pages, from
 * the descriptor the descriptor channel gave it), and a private free list.
 * The memfd has no name anywhere, and is sealed against shrinking and
 * growing, so no process that holds it can truncate it under the broker
 * (a mapping past the end of a file raises SIGBUS in whoever touches it).  Invariants: a slot is either in use
 * (handed out by slot_new, not yet freed) or free; every free slot below
 * `fresh` is on the free list exactly once; slots at or above `fresh` were
 * never used and are zero in the mapping (ftruncate zero-fills), so the
 * table costs pages only for the slots a session has ever had.  Slot
 * management is O(1) (amortized: the private next[] array doubles as
 * fresh slots are first used): reuse the head of the free list, else the
 * next fresh slot.
 *
 * The bookkeeping stays out of the shared mapping because the session's
 * process can write there: a client that scribbles on its own table can
 * hurt only its own data (a move it did not wait for), never the broker's
 * lists.  For the same reason nothing read from the mapping is asserted
 * on; a slot index the broker passes that it did not hand out is asserted.
 *
 * Memory order (the contract in proto/locktab_layout.h): claim is a CAS 0 ->
 * MOVING with acquire, so the broker's copy starts after every holder's
 * last access, which each holder published with the release of its
 * decrement; publish writes the position then exchanges 0 with release,
 * so a gmb_lock that acquires the new state reads the new position.
 * Whatever opens a slot (publish, release, free) wakes the gmb_lock calls
 * asleep on its word when the old state says there are some
 * (GMB_LT_WAITERS): a FUTEX_WAKE, which never blocks.
 */
#include "locktab.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "gmb.h"
#include "log.h"

#define LT_USED UINT32_MAX        /* next[] of a slot in use */
#define LT_END (UINT32_MAX - 1u)  /* next[] of the free list's last slot */
#define LT_SLOTS_MAX (1u << 24)   /* 512 MiB of table: far past any session */

struct gmb_locktab {
  struct gmb__lt_header *hdr; /* the shared mapping */
  struct gmb__lt_slot *slot;  /* gmb__lt_slots(hdr) */
  size_t bytes;
  uint32_t slots;
  uint32_t fresh;     /* slots [fresh, slots) were never handed out */
  uint32_t free_head; /* LT_END: the free list is empty */
  uint32_t used;
  uint32_t *next; /* per slot below fresh: LT_USED, or the next free slot */
  uint32_t cap_next; /* entries of next[]: grows with fresh, doubling */
  int fd;         /* the sealed memfd */
};

#define LT_NEXT_MIN 64u

struct gmb_locktab *gmb__locktab_new(uint64_t session_id, uint32_t slots,
                                     char *err, size_t errcap) {
  if (slots == 0 || slots > LT_SLOTS_MAX) {
    snprintf(err, errcap, "lock table: %u slots (1..%u)", slots, LT_SLOTS_MAX);
    return NULL;
  }
  struct gmb_locktab *lt = calloc(1, sizeof *lt);
  /* The per-slot array grows with the slots a session has used: an idle
   * session costs LT_NEXT_MIN entries, not `slots` (a calloc of 256 KiB
   * comes from the heap once glibc raised its mmap threshold, and is then
   * written whole: 157 KiB per idle session). */
  uint32_t cap = slots < LT_NEXT_MIN ? slots : LT_NEXT_MIN;
  uint32_t *next = malloc(cap * sizeof *next);
  if (lt == NULL || next == NULL) {
    free(lt);
    free(next);
    snprintf(err, errcap, "lock table: out of memory");
    return NULL;
  }
  lt->next = next;
  lt->cap_next = cap;
  lt->slots = slots;
  lt->free_head = LT_END;
  lt->bytes = (size_t)gmb__lt_bytes(slots);
  char name[48];
  snprintf(name, sizeof name, "gmb-lt-%llu", (unsigned long long)session_id);
  const char *what = NULL;
  lt->fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (lt->fd < 0)
    what = "memfd_create";
  else if (ftruncate(lt->fd, (off_t)lt->bytes) != 0)
    what = "ftruncate";
  else if (fcntl(lt->fd, F_ADD_SEALS,
                 F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0)
    what = "sealing";
  if (what == NULL) {
    void *p =
        mmap(NULL, lt->bytes, PROT_READ | PROT_WRITE, MAP_SHARED, lt->fd, 0);
    if (p == MAP_FAILED) what = "mmap";
    else lt->hdr = p;
  }
  if (what) {
    snprintf(err, errcap, "lock table: %s: %s", what, strerror(errno));
    if (lt->fd >= 0) close(lt->fd);
    free(lt->next);
    free(lt);
    return NULL;
  }
  lt->slot = gmb__lt_slots(lt->hdr);
  lt->hdr->version = GMB_LT_VERSION;
  lt->hdr->slots = slots;
  lt->hdr->session = session_id;
  /* The magic last: a reader that sees it sees a complete header (the
   * client maps the table only after it was sent, so this is belt and
   * braces). */
  __atomic_store_n(&lt->hdr->magic, GMB_LT_MAGIC, __ATOMIC_RELEASE);
  return lt;
}

int gmb__locktab_fd(const struct gmb_locktab *lt) { return lt->fd; }

uint64_t gmb__locktab_bytes(const struct gmb_locktab *lt) { return lt->bytes; }

uint32_t gmb__locktab_slots(const struct gmb_locktab *lt) { return lt->slots; }

uint32_t gmb__locktab_used(const struct gmb_locktab *lt) { return lt->used; }

/* A slot the broker handed out and has not freed; anything else is a bug
 * in the broker, never the client's doing. */
static struct gmb__lt_slot *locktab_slot(const struct gmb_locktab *lt,
                                        uint32_t slot) {
  GMB_ASSERT(slot < lt->fresh && lt->next[slot] == LT_USED &&
             "lock table slot in use");
  return &lt->slot[slot];
}

int gmb__locktab_slot_new(struct gmb_locktab *lt, uint64_t id,
                          uint64_t segment, uint64_t offset, uint32_t *slot) {
  GMB_ASSERT(id != 0 && "allocation ids are never 0");
  uint32_t i;
  if (lt->free_head != LT_END) {
    i = lt->free_head;
    lt->free_head = lt->next[i];
  } else if (lt->fresh < lt->slots) {
    if (lt->fresh == lt->cap_next) {
      uint32_t cap = lt->cap_next > lt->slots / 2 ? lt->slots
                                                  : lt->cap_next * 2;
      uint32_t *n = realloc(lt->next, (size_t)cap * sizeof *n);
      if (n == NULL) return GMB_E_SYSTEM;
      lt->next = n;
      lt->cap_next = cap;
    }
    i = lt->fresh++;
  } else {
    return GMB_E_LIMIT;
  }
  lt->next[i] = LT_USED;
  lt->used++;
  struct gmb__lt_slot *s = &lt->slot[i];
  __atomic_store_n(&s->id, id, __ATOMIC_RELAXED);
  __atomic_store_n(&s->segment, segment, __ATOMIC_RELAXED);
  __atomic_store_n(&s->offset, offset, __ATOMIC_RELAXED);
  /* Release: a client that reads the state reads the position too (the
   * reply that names the slot is sent later anyway). */
  atomic_store_explicit(&s->state, 0, memory_order_release);
  *slot = i;
  return 0;
}

/* Stores `to` (release) and wakes the sleepers the old state announces. */
static void locktab_store(struct gmb__lt_slot *s, uint32_t to) {
  uint32_t old = atomic_exchange_explicit(&s->state, to, memory_order_acq_rel);
  if (old & GMB_LT_WAITERS) gmb__lt_futex_wake(&s->state);
}

static void locktab_open(struct gmb__lt_slot *s) { locktab_store(s, 0); }

void gmb__locktab_slot_free(struct gmb_locktab *lt, uint32_t slot) {
  struct gmb__lt_slot *s = locktab_slot(lt, slot);
  /* Holders the client did not unlock lose their lock: the allocation is
   * gone.  A later gmb_lock of that id fails on the client's side. */
  __atomic_store_n(&s->id, 0, __ATOMIC_RELAXED);
  __atomic_store_n(&s->segment, 0, __ATOMIC_RELAXED);
  __atomic_store_n(&s->offset, 0, __ATOMIC_RELAXED);
  locktab_open(s);
  lt->next[slot] = lt->free_head;
  lt->free_head = slot;
  lt->used--;
}

int gmb__locktab_claim(struct gmb_locktab *lt, uint32_t slot) {
  struct gmb__lt_slot *s = locktab_slot(lt, slot);
  uint32_t expect = 0;
  return atomic_compare_exchange_strong_explicit(
      &s->state, &expect, GMB_LT_MOVING, memory_order_acq_rel,
      memory_order_acquire);
}

void gmb__locktab_publish(struct gmb_locktab *lt, uint32_t slot,
                          uint64_t segment, uint64_t offset) {
  struct gmb__lt_slot *s = locktab_slot(lt, slot);
  __atomic_store_n(&s->segment, segment, __ATOMIC_RELAXED);
  __atomic_store_n(&s->offset, offset, __ATOMIC_RELAXED);
  locktab_open(s);
}

void gmb__locktab_release(struct gmb_locktab *lt, uint32_t slot) {
  locktab_open(locktab_slot(lt, slot));
}

void gmb__locktab_offloaded(struct gmb_locktab *lt, uint32_t slot) {
  locktab_store(locktab_slot(lt, slot), GMB_LT_OFFLOADED);
}

void gmb__locktab_restoring(struct gmb_locktab *lt, uint32_t slot) {
  locktab_store(locktab_slot(lt, slot), GMB_LT_MOVING);
}

void gmb__locktab_restored(struct gmb_locktab *lt, uint32_t slot,
                           uint64_t segment, uint64_t offset, int held) {
  struct gmb__lt_slot *s = locktab_slot(lt, slot);
  __atomic_store_n(&s->segment, segment, __ATOMIC_RELAXED);
  __atomic_store_n(&s->offset, offset, __ATOMIC_RELAXED);
  locktab_store(s, held ? 1u : 0u);
}

void gmb__locktab_evict(struct gmb_locktab *lt) {
  atomic_store_explicit(&lt->hdr->evicted, GMB_LT_EVICTED,
                        memory_order_release);
}

uint32_t gmb__locktab_holders(const struct gmb_locktab *lt, uint32_t slot) {
  uint32_t st = atomic_load_explicit(&locktab_slot(lt, slot)->state,
                                     memory_order_relaxed);
  return (st & GMB_LT_MOVING) ? 0 : st;
}

uint64_t gmb__locktab_slot_id(const struct gmb_locktab *lt, uint32_t slot) {
  return __atomic_load_n(&locktab_slot(lt, slot)->id, __ATOMIC_RELAXED);
}

void gmb__locktab_destroy(struct gmb_locktab *lt) {
  if (lt == NULL) return;
  if (munmap(lt->hdr, lt->bytes) != 0)
    log_warn("lock table of session %llu: munmap: %s",
             (unsigned long long)lt->hdr->session, strerror(errno));
  close(lt->fd);
  free(lt->next);
  free(lt);
}
