/*
 * segmap.h - one client's view of its memory: the segments mapped into this
 * process and the allocations that live in them.
 *
 * Internal to the client library.  Thread-safe: lookups (gmb_lock,
 * gmb_unlock) take no lock at all (a sequence lock, segmap.c); changes
 * serialise on the map's mutex.  The client's socket mutex, when held, is
 * always taken before that mutex, never after.
 */
#ifndef GMB_SEGMAP_H
#define GMB_SEGMAP_H

#include <stddef.h>
#include <stdint.h>

#include "locktab_layout.h"

struct gmb_segmap;

struct gmb_segmap *gmb__segmap_new(void);

/* The CUDA device (this process's ordinal, gmb__cuda_attach's) that
 * segments of a "cuda" broker are imported on; set before the first
 * gmb__segmap_map.  0 until set. */
void gmb__segmap_set_cuda(struct gmb_segmap *m, int ordinal);
/* Unmaps (host) or closes (cuda) every segment and frees the table.
 * Accepts NULL. */
void gmb__segmap_destroy(struct gmb_segmap *m);

/* 1 when `segment` is mapped here. */
int gmb__segmap_has_segment(struct gmb_segmap *m, uint64_t segment);

/*
 * Maps segment `segment` of `size` bytes from its descriptor `fd` (which
 * the caller keeps and closes), for a session on `device`: "host" (mmap of
 * the memfd) or "cuda" (a virtual-memory import, cuimport.c; the session
 * must have attached to the driver).  Either way the segment's record holds
 * its base address, host or device, and the lookups below return addresses
 * in it.  A segment already mapped is left alone (0).  Returns 0 or
 * GMB_E_PROTO (a descriptor that is not what the broker said),
 * GMB_E_DEVICE, GMB_E_SYSTEM, with the reason in `why`.
 */
int gmb__segmap_map(struct gmb_segmap *m, const char *device,
                    uint64_t segment, uint64_t size, int fd, char *why,
                    size_t cap);

/*
 * A large allocation whose bytes past its whole pages (its tail) lie at an
 * end of a small segment (the broker's pool.h, rule 1): maps `pages` bytes
 * of descriptor fd_pages and, right after them (or, with `tail_first`,
 * right before them), the GMB_SEGMAP_PAGE bytes of descriptor fd_tail, in
 * an address range of its own (the caller keeps and closes both
 * descriptors).  Recorded as a segment of its own, a view, whose id
 * (*view: its top bit set, so never a broker's segment id) the
 * allocation is then added in with gmb__segmap_add.  The tail's segment
 * may be mapped here a second time on its own: the same tenant's bytes.
 * A view is unmapped when its allocation is removed, or by
 * gmb__segmap_unmap_all; never by gmb__segmap_retire.  Errors as
 * gmb__segmap_map.
 */
#define GMB_SEGMAP_PAGE (UINT64_C(2) << 20)
#define GMB_SEGMAP_VIEW (UINT64_C(1) << 63)
int gmb__segmap_view(struct gmb_segmap *m, const char *device, uint64_t pages,
                     int fd_pages, int fd_tail, int tail_first,
                     uint64_t *view, char *why, size_t cap);
/* Unmaps a view that no allocation was added in. */
void gmb__segmap_view_drop(struct gmb_segmap *m, uint64_t view);

/* Unmaps (or closes the import of) and forgets a segment (the broker
 * retired it).  Allocations still recorded in it stay; gmb_lock on them
 * maps the segment again.  1 when it was mapped here, else 0. */
int gmb__segmap_retire(struct gmb_segmap *m, uint64_t segment);

/* Retires every segment mapped here (gmb_disconnect, before Bye);
 * returns how many there were.  The allocations stay recorded. */
size_t gmb__segmap_unmap_all(struct gmb_segmap *m);

/* The slot of an allocation that has no lock-table slot: pinned, or
 * movable under a broker that gave the session no lock table (it cannot
 * move what the client cannot lock). */
#define GMB_SEGMAP_NO_SLOT UINT32_MAX

/*
 * Records allocation `id` at [offset, offset+size) of a mapped segment,
 * with its lock-table `slot` (GMB_SEGMAP_NO_SLOT: none).  GMB_E_PROTO when
 * the segment is not mapped, the range does not fit in it, or the id is 0
 * or already recorded.  An allocation with a slot may name a segment not
 * mapped (it left it before it was mapped): its slot says where it is.
 */
int gmb__segmap_add(struct gmb_segmap *m, uint64_t id, uint64_t segment,
                    uint64_t offset, uint64_t size, unsigned flags,
                    uint32_t slot, char *why, size_t cap);

/* What the map knows of one allocation.  For one with a slot, segment and
 * offset are where it was at alloc time; the lock table says where it is
 * now. */
struct gmb_segmap_entry {
  uint64_t id, segment, offset, size;
  unsigned flags;
  uint32_t slot;
  /* Without a slot: its address, when its segment is mapped here and
   * holds the range; else NULL (gmb__segmap_lookup tells why).  Always
   * NULL for an allocation with a slot. */
  void *ptr;
  /* With a slot, and a lock table given to gmb__segmap_get: the segment
   * the slot named during the lookup, and where that segment was mapped
   * then (guess_base NULL: not mapped here, or no guess).  A guess only,
   * read before any hold: see gmb__segmap_get. */
  uint64_t guess_segment, guess_size;
  uint8_t *guess_base;
};

/*
 * 0 with *out filled, or GMB_E_NOENT when the id is unknown (*out is then
 * unspecified).  One consistent snapshot, taken without a lock.
 *
 * `lt` (NULL: none) are the session's `nslots` lock-table slots.  With
 * one, gmb_lock gets everything in a single lookup: for an allocation
 * with a slot, the segment its slot names at that moment and that
 * segment's mapping (guess_*).  The slot is read without a hold, so the
 * guess may be stale or torn; the caller uses it only when the position
 * it reads under its hold names the same segment.  That is sound because
 * a segment that holds a held allocation cannot have been unmapped since
 * the lookup saw it mapped (client.c, client_lock_movable, says why).
 */
int gmb__segmap_get(struct gmb_segmap *m, uint64_t id,
                    const struct gmb__lt_slot *lt, uint32_t nslots,
                    struct gmb_segmap_entry *out);

/* gmb_unlock's lookup: 0 with *slot set (GMB_SEGMAP_NO_SLOT for one
 * without), or GMB_E_NOENT when the id is unknown. */
int gmb__segmap_slot(struct gmb_segmap *m, uint64_t id, uint32_t *slot);

/*
 * The address of [offset, offset+size) of `segment` in this process: 0
 * with *ptr set; 1 when the segment is not mapped here; GMB_E_PROTO when
 * the range does not fit in the segment as mapped.
 */
int gmb__segmap_ptr(struct gmb_segmap *m, uint64_t segment, uint64_t offset,
                    uint64_t size, void **ptr);

/* Forgets allocation `id`: 0, or GMB_E_NOENT when unknown. */
int gmb__segmap_remove(struct gmb_segmap *m, uint64_t id);

/*
 * The address of allocation `id` where it was made: 0 with *ptr set;
 * GMB_E_NOENT when the id is unknown; 1 when it is known but its segment
 * is not mapped here (after a retirement): *segment says which one to map
 * before asking again.  Only for allocations without a lock-table slot:
 * one with a slot may have moved (gmb__segmap_ptr on the slot's position).
 */
int gmb__segmap_lookup(struct gmb_segmap *m, uint64_t id, void **ptr,
                       uint64_t *segment);

/* Number of allocations recorded (for tests and disconnect). */
size_t gmb__segmap_count(struct gmb_segmap *m);

#endif /* GMB_SEGMAP_H */
