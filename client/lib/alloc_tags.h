/*
 * alloc_tags.h - the tags of gmb_alloc allocations: which allocation
 * belongs to which tag, the broker id that serves it now, and its pause
 * and resume (alloc_tags.c).  Plain C over callbacks, so that the unit
 * tests drive it without a broker.
 */
#ifndef GMB_ALLOC_TAGS_H
#define GMB_ALLOC_TAGS_H

#include <stdint.h>

struct gmb_atags;

/* What a pause and a resume need from the session (client.c). */
struct gmb_atag_ops {
  void *ctx;
  /* A new allocation at the broker: 0 and its id, or the refusal. */
  int (*alloc)(void *ctx, uint64_t size, unsigned flags, uint64_t *id);
  int (*free)(void *ctx, uint64_t id);
  /* Copies the n first bytes of broker allocation id from or to host. */
  int (*copy)(void *ctx, uint64_t id, void *host, uint64_t n, int to_device);
  /* The device's queued work done (NULL: nothing to wait for). */
  int (*sync)(void *ctx);
  /* Before a pause moves anything: takes `host` bytes of the host quota
   * and tells the broker (paused 1) who paused (`by`: GMB_CACHE_BY_* of
   * cache.h), which may refuse: then nothing is kept.  After a resume or
   * an undone pause (paused 0): gives `host` back and tells the broker.
   * 0 or the refusal. */
  int (*admit)(void *ctx, int tag, int paused, int mode, int by,
               uint64_t host, uint64_t device);
  /* 1 when broker allocation id is off the device already, offloaded by
   * the broker itself (NULL: never): a pause leaves it to the broker. */
  int (*away)(void *ctx, uint64_t id);
};

struct gmb_atags *gmb__atags_new(const struct gmb_atag_ops *ops);
/* Frees the records and host copies (the broker frees the allocations at
 * the session's end); returns the host bytes they held.  Accepts NULL. */
uint64_t gmb__atags_destroy(struct gmb_atags *t);

/* Records allocation id (broker id = the program's id) of tag `tag`
 * (0..63).  0, GMB_E_SYSTEM, or 1 when the tag's allocations are paused
 * (or being paused or resumed): nothing recorded, and the caller gives
 * the allocation back (it completed after the pause began). */
int gmb__atags_add(struct gmb_atags *t, uint64_t id, uint64_t size,
                   unsigned flags, int tag);

/* The broker id serving the program's allocation id now (*cur = id for an
 * untagged one): 0; GMB_E_INVAL while it is paused, pausing or resuming
 * (*tag its tag).  With `hold`, the allocation counts as locked until
 * gmb__atags_unhold: a pause refuses it meanwhile.  Lock-free and
 * message-free when no allocation is tagged. */
int gmb__atags_get(struct gmb_atags *t, uint64_t id, int hold, uint64_t *cur,
                   int *tag);
void gmb__atags_unhold(struct gmb_atags *t, uint64_t id);

/* Before a free: 1 and *cur when id is tagged and running, claimed for
 * the free (a pause leaves it out until gmb__atags_remove: the caller
 * frees *cur, then calls it); 2 when it was paused (record and host copy
 * dropped here, the host bytes given back through admit's accounting:
 * *host their bytes, the caller has nothing to free); 0 for an untagged
 * id; GMB_E_INVAL while it is pausing, resuming or being freed. */
int gmb__atags_free(struct gmb_atags *t, uint64_t id, uint64_t *cur,
                    uint64_t *host);
/* After gmb__atags_free's 1: the record goes when the broker `freed` the
 * allocation, else it runs again. */
void gmb__atags_remove(struct gmb_atags *t, uint64_t id, int freed);

/* Pauses every running allocation of tag `tag` for `by` (who asked,
 * passed to admit and kept while paused): with mode 0 (offload) each
 * one's bytes are copied to host memory; then each is freed at the
 * broker.  0 (also with nothing to pause); GMB_E_INVAL when one is locked
 * (*locked its id) and nothing changed; admit's refusal, GMB_E_SYSTEM or
 * a copy's failure with nothing changed. */
int gmb__atags_pause(struct gmb_atags *t, int tag, int mode, int by,
                     uint64_t *locked);

/* The paused allocations of tag `tag` that `by` outranks
 * (gmb__cache_by_rank) are `by`'s pause from now on; nothing else changes
 * (the caller tells the broker).  1 when there was one. */
int gmb__atags_claim(struct gmb_atags *t, int tag, int by);

/* Resumes the paused allocations of tag `tag`: each allocated anew (the
 * same size and flags) and its host copy written back; the program's id
 * now maps to the new broker id.  0 (also with nothing paused); the
 * broker's refusal with every one of them still paused, nothing lost. */
int gmb__atags_resume(struct gmb_atags *t, int tag);

/* Whether tag `tag` has paused allocations. */
int gmb__atags_paused(struct gmb_atags *t, int tag);

/* Each tag's allocations as a pause sees them (gmb__atags_tags):
 * `running` bytes and how many (`n_running`), one of them locked
 * (`held`, its program id; 0: none, so a pause would not be refused),
 * how many are paused or being paused or resumed (`n_paused`), and who
 * paused them (`by_mask`: bit 1 << GMB_CACHE_BY_* for each). */
struct gmb_atags_tag {
  uint64_t running, n_running, held, n_paused;
  unsigned by_mask;
};
#define GMB_ATAGS_TAGS 64
/* Fills out[0..GMB_ATAGS_TAGS), one walk of the records. */
void gmb__atags_tags(struct gmb_atags *t, struct gmb_atags_tag *out);

/* A figure that moves with each tagged allocation made, freed, locked or
 * copied (gmb__atags_add, gmb__atags_free, gmb__atags_get with hold):
 * the sleep policy's sign of activity.  One atomic load. */
uint64_t gmb__atags_uses(struct gmb_atags *t);

/* Figures: tagged allocations, and of them paused; their host bytes and
 * the device bytes they gave back. */
struct gmb_atags_counts {
  uint64_t tagged, paused, host, device;
};
void gmb__atags_counts(struct gmb_atags *t, struct gmb_atags_counts *out);

#endif /* GMB_ALLOC_TAGS_H */
