/*
 * segmap.h - one client's view of its memory: the segments mapped into this
 * process and the allocations that live in them.
 *
 * Internal to the client library.  Thread-safe: lookups (gmb_lock) take a
 * read lock only; changes take the write lock.  The client's socket mutex,
 * when held, is always taken before this lock, never after.
 */
#ifndef GMB_SEGMAP_H
#define GMB_SEGMAP_H

#include <stddef.h>
#include <stdint.h>

#include "wire.h"

struct gmb_segmap;

struct gmb_segmap *gmb__segmap_new(void);
/* Unmaps every segment and frees the table.  Accepts NULL. */
void gmb__segmap_destroy(struct gmb_segmap *m);

/* 1 when `segment` is mapped here. */
int gmb__segmap_has_segment(struct gmb_segmap *m, uint64_t segment);

/*
 * Maps the segment that `h` describes, for a session on `device` ("host";
 * "cuda" is refused with GMB_E_DEVICE until the CUDA client exists).  A
 * segment already mapped is left alone (0).  Returns 0 or GMB_E_PROTO (a
 * handle that makes no sense), GMB_E_DEVICE, GMB_E_SYSTEM, with the reason
 * in `why`.
 */
int gmb__segmap_map(struct gmb_segmap *m, const char *device,
                    const struct wire_handle *h, char *why, size_t cap);

/* Unmaps and forgets a segment (the broker retired it).  Allocations still
 * recorded in it stay; gmb_lock on them maps the segment again. */
void gmb__segmap_retire(struct gmb_segmap *m, uint64_t segment);

/*
 * Records allocation `id` at [offset, offset+size) of a mapped segment.
 * GMB_E_PROTO when the segment is not mapped, the range does not fit in
 * it, or the id is 0 or already recorded.
 */
int gmb__segmap_add(struct gmb_segmap *m, uint64_t id, uint64_t segment,
                    uint64_t offset, uint64_t size, unsigned flags, char *why,
                    size_t cap);

/* Forgets allocation `id`: 0, or GMB_E_NOENT when unknown. */
int gmb__segmap_remove(struct gmb_segmap *m, uint64_t id);

/*
 * The address of allocation `id`: 0 with *ptr set; GMB_E_NOENT when the id
 * is unknown; 1 when it is known but its segment is not mapped here (after
 * a retirement): *segment says which one to map before asking again.
 */
int gmb__segmap_lookup(struct gmb_segmap *m, uint64_t id, void **ptr,
                       uint64_t *segment);

/* Number of allocations recorded (for tests and disconnect). */
size_t gmb__segmap_count(struct gmb_segmap *m);

#endif /* GMB_SEGMAP_H */
