/*
 * alloc_tags.c - tags of gmb_alloc allocations and their sleep and wake.
 *
 * An allocation made while the thread has a tag (gmb_cache_tag) gets a
 * record here, keyed by the id the program holds: the broker's id at the
 * allocation.  A pause copies its bytes to host memory (offload) or drops
 * them (discard) and frees it at the broker; a resume allocates anew and
 * copies back, and the record maps the program's id to the new broker id
 * from then on.  The broker never gives an id twice (a slot's generation
 * grows with each use, and a slot whose generation runs out is retired),
 * so a program's id never names another allocation.
 *
 * States (under mu): RUNNING (cur is the broker's id); PAUSING and
 * RESUMING (the pauser owns the record: gets and frees of it fail);
 * PAUSED (cur 0, host the copy or NULL); FREEING (a gmb_free owns it
 * while the broker frees cur: a pause leaves it out, and it does not make
 * its tag paused).  `holds` counts gmb_lock minus
 * gmb_unlock (and the library's own copies): a pause refuses a tag with
 * a held allocation, so no pointer the program holds goes stale.  `by`
 * says who paused a record (the application, the broker's ask, an
 * operator), from the moment it is PAUSING until it runs again.
 *
 * Invariants: n counts the records; a record is PAUSED exactly when cur
 * is 0; host is non-NULL only when PAUSED or RESUMING.  Locks: mu guards
 * the tree and every record's state and holds; pause_mu makes pauses and
 * resumes one at a time and is taken before mu; no callback runs under
 * mu.
 */
#ifndef __unused
#define __unused __attribute__((__unused__))
#endif
#include "alloc_tags.h"

#include <bsd/sys/tree.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "cache.h"
#include "gmb.h"
#include "hostbuf.h"

enum { ATAG_RUNNING, ATAG_PAUSING, ATAG_PAUSED, ATAG_RESUMING, ATAG_FREEING };

struct atag {
  RB_ENTRY(atag) rb;
  uint64_t id;   /* the program's */
  uint64_t cur;  /* the broker's now; 0 while PAUSED */
  uint64_t size; /* as the broker gave it */
  unsigned flags;
  int tag;
  int holds;
  uint8_t state;
  uint8_t by; /* who paused it: GMB_CACHE_BY_* (cache.h) */
  void *host; /* the copy while paused (offload) */
  struct atag *work; /* the pause's or resume's list */
};

static int atag_cmp(const struct atag *a, const struct atag *b) {
  return (a->id > b->id) - (a->id < b->id);
}

RB_HEAD(atag_tree, atag);
RB_GENERATE_STATIC(atag_tree, atag, rb, atag_cmp)

struct gmb_atags {
  struct gmb_atag_ops ops;
  pthread_mutex_t mu, pause_mu;
  struct atag_tree tree;
  atomic_uint_fast64_t n;
  atomic_uint_fast64_t uses; /* gmb__atags_uses */
};

struct gmb_atags *gmb__atags_new(const struct gmb_atag_ops *ops) {
  struct gmb_atags *t = calloc(1, sizeof *t);
  if (t == NULL) return NULL;
  t->ops = *ops;
  pthread_mutex_init(&t->mu, NULL);
  pthread_mutex_init(&t->pause_mu, NULL);
  RB_INIT(&t->tree);
  return t;
}

uint64_t gmb__atags_destroy(struct gmb_atags *t) {
  if (t == NULL) return 0;
  uint64_t host = 0;
  struct atag *r, *next;
  RB_FOREACH_SAFE(r, atag_tree, &t->tree, next) {
    RB_REMOVE(atag_tree, &t->tree, r);
    if (r->host) host += r->size;
    gmb__hostbuf_free(r->host);
    free(r);
  }
  pthread_mutex_destroy(&t->mu);
  pthread_mutex_destroy(&t->pause_mu);
  free(t);
  return host;
}

static struct atag *atag_find(struct gmb_atags *t, uint64_t id) {
  struct atag key = {.id = id};
  return RB_FIND(atag_tree, &t->tree, &key);
}

/* A record of a paused tag: paused, or being paused or resumed. */
static int atag_away(const struct atag *r) {
  return r->state != ATAG_RUNNING && r->state != ATAG_FREEING;
}

/* 1 when the allocations of `tag` are paused, or being paused or resumed.
 * Holds mu. */
static int atag_paused_locked(struct gmb_atags *t, int tag) {
  struct atag *r;
  RB_FOREACH(r, atag_tree, &t->tree)
    if (r->tag == tag && atag_away(r)) return 1;
  return 0;
}

int gmb__atags_add(struct gmb_atags *t, uint64_t id, uint64_t size,
                   unsigned flags, int tag) {
  struct atag *r = calloc(1, sizeof *r);
  if (r == NULL) return GMB_E_SYSTEM;
  *r = (struct atag){.id = id, .cur = id, .size = size, .flags = flags,
                     .tag = tag};
  pthread_mutex_lock(&t->mu);
  /* Decided under mu, so that a pause either finds this record among the
   * tag's (atag_take) or was already under way and refuses it. */
  if (atag_paused_locked(t, tag)) {
    pthread_mutex_unlock(&t->mu);
    free(r);
    return 1;
  }
  struct atag *old = RB_INSERT(atag_tree, &t->tree, r);
  if (old == NULL) atomic_fetch_add(&t->n, 1);
  atomic_fetch_add_explicit(&t->uses, 1, memory_order_relaxed);
  pthread_mutex_unlock(&t->mu);
  if (old) free(r); /* the broker gave an id twice: the first record stays */
  return 0;
}


int gmb__atags_get(struct gmb_atags *t, uint64_t id, int hold, uint64_t *cur,
                   int *tag) {
  *cur = id;
  if (t == NULL || atomic_load_explicit(&t->n, memory_order_acquire) == 0)
    return 0;
  int rc = 0;
  pthread_mutex_lock(&t->mu);
  struct atag *r = atag_find(t, id);
  if (r && r->state != ATAG_RUNNING) {
    if (tag) *tag = r->tag;
    rc = GMB_E_INVAL;
  } else if (r) {
    *cur = r->cur;
    r->holds += hold != 0;
    if (hold) atomic_fetch_add_explicit(&t->uses, 1, memory_order_relaxed);
  }
  pthread_mutex_unlock(&t->mu);
  return rc;
}

void gmb__atags_unhold(struct gmb_atags *t, uint64_t id) {
  if (t == NULL || atomic_load_explicit(&t->n, memory_order_acquire) == 0)
    return;
  pthread_mutex_lock(&t->mu);
  struct atag *r = atag_find(t, id);
  if (r && r->holds > 0) r->holds--;
  pthread_mutex_unlock(&t->mu);
}

int gmb__atags_free(struct gmb_atags *t, uint64_t id, uint64_t *cur,
                    uint64_t *host) {
  *cur = id;
  *host = 0;
  if (t == NULL || atomic_load_explicit(&t->n, memory_order_acquire) == 0)
    return 0;
  pthread_mutex_lock(&t->mu);
  struct atag *r = atag_find(t, id);
  int rc = r == NULL ? 0 : r->state == ATAG_RUNNING ? 1
                       : r->state == ATAG_PAUSED    ? 2
                                                    : GMB_E_INVAL;
  if (rc == 1) {
    *cur = r->cur;
    r->state = ATAG_FREEING; /* a pause from now on leaves it out */
  }
  if (r) atomic_fetch_add_explicit(&t->uses, 1, memory_order_relaxed);
  struct atag gone = {0};
  if (rc == 2) {
    gone = *r;
    RB_REMOVE(atag_tree, &t->tree, r);
    atomic_fetch_sub(&t->n, 1);
    gmb__hostbuf_free(r->host);
    free(r);
  }
  pthread_mutex_unlock(&t->mu);
  if (rc == 2) {
    /* Its share of the tag's account goes: host copy and device bytes. */
    *host = gone.host ? gone.size : 0;
    (void)t->ops.admit(t->ops.ctx, gone.tag, 0, 0, gone.by, *host,
                       gone.size);
  }
  return rc;
}

void gmb__atags_remove(struct gmb_atags *t, uint64_t id, int freed) {
  if (t == NULL) return;
  pthread_mutex_lock(&t->mu);
  struct atag *r = atag_find(t, id);
  if (r && !freed && r->state == ATAG_FREEING) {
    r->state = ATAG_RUNNING; /* the broker kept it: it runs on */
  } else if (r) {
    RB_REMOVE(atag_tree, &t->tree, r);
    atomic_fetch_sub(&t->n, 1);
    gmb__hostbuf_free(r->host);
    free(r);
  }
  pthread_mutex_unlock(&t->mu);
}

/* Moves every record of `tag` in state `from` to `to` and lists them
 * (r->work), unless one of them is held (*held its id: nothing moved).
 * A pause names who asked (`by`); a resume passes -1, keeping it. */
static struct atag *atag_take(struct gmb_atags *t, int tag, int from, int to,
                              int by, uint64_t *held) {
  struct atag *list = NULL, *r;
  pthread_mutex_lock(&t->mu);
  RB_FOREACH(r, atag_tree, &t->tree)
    if (r->tag == tag && r->state == from && r->holds > 0) {
      *held = r->id;
      pthread_mutex_unlock(&t->mu);
      return NULL;
    }
  RB_FOREACH(r, atag_tree, &t->tree)
    if (r->tag == tag && r->state == from) {
      r->state = (uint8_t)to;
      if (by >= 0) r->by = (uint8_t)by;
      r->work = list;
      list = r;
    }
  pthread_mutex_unlock(&t->mu);
  return list;
}

static void atag_settle(struct gmb_atags *t, struct atag *list, int state) {
  pthread_mutex_lock(&t->mu);
  for (struct atag *r = list; r; r = r->work) r->state = (uint8_t)state;
  pthread_mutex_unlock(&t->mu);
}

/* Drops the host copies of list (a pause undone, a resume done). */
static void atag_drop_copies(struct atag *list) {
  for (struct atag *r = list; r; r = r->work) {
    gmb__hostbuf_free(r->host);
    r->host = NULL;
  }
}

/* Takes out of list the allocations the broker offloaded itself (an
 * operator's pause of every tag does so before the library pauses them):
 * their bytes are off the device already, so copying them would only
 * bring them back first.  They stay running as far as the tag goes, and
 * their next gmb_lock brings them back.  Returns what is left. */
static struct atag *atag_not_away(struct gmb_atags *t, struct atag *list) {
  if (t->ops.away == NULL) return list;
  struct atag *keep = NULL, *next;
  for (struct atag *r = list; r; r = next) {
    next = r->work;
    if (t->ops.away(t->ops.ctx, r->cur)) {
      pthread_mutex_lock(&t->mu);
      r->state = ATAG_RUNNING;
      pthread_mutex_unlock(&t->mu);
    } else {
      r->work = keep;
      keep = r;
    }
  }
  return keep;
}

int gmb__atags_pause(struct gmb_atags *t, int tag, int mode, int by,
                     uint64_t *locked) {
  *locked = 0;
  pthread_mutex_lock(&t->pause_mu);
  uint64_t held = 0;
  struct atag *list = atag_take(t, tag, ATAG_RUNNING, ATAG_PAUSING, by, &held);
  if (list) list = atag_not_away(t, list);
  if (list == NULL) {
    pthread_mutex_unlock(&t->pause_mu);
    *locked = held;
    return held ? GMB_E_INVAL : 0;
  }
  uint64_t host = 0, device = 0;
  for (struct atag *r = list; r; r = r->work) {
    device += r->size;
    host += mode == GMB_PAUSE_OFFLOAD ? r->size : 0;
  }
  /* The queued work on the memory done before its bytes are read. */
  int rc = t->ops.sync ? t->ops.sync(t->ops.ctx) : 0;
  if (rc == 0) rc = t->ops.admit(t->ops.ctx, tag, 1, mode, by, host, device);
  if (rc) {
    atag_settle(t, list, ATAG_RUNNING);
    pthread_mutex_unlock(&t->pause_mu);
    return rc;
  }
  for (struct atag *r = list; r && rc == 0 && mode == GMB_PAUSE_OFFLOAD;
       r = r->work) {
    r->host = gmb__hostbuf_alloc(r->size);
    rc = r->host ? t->ops.copy(t->ops.ctx, r->cur, r->host, r->size, 0)
                 : GMB_E_SYSTEM;
  }
  if (rc) {
    atag_drop_copies(list);
    (void)t->ops.admit(t->ops.ctx, tag, 0, mode, by, host, device);
    atag_settle(t, list, ATAG_RUNNING);
    pthread_mutex_unlock(&t->pause_mu);
    return rc;
  }
  /* The bytes are safe: the device memory goes back.  One the broker
   * would not free (the connection lost) runs on, its copy dropped. */
  int frc = 0;
  uint64_t kept_host = 0, kept_dev = 0;
  for (struct atag *r = list, *next; r; r = next) {
    /* Read first: once PAUSED or RUNNING again, a gmb_free of another
     * thread may drop the record (gmb__atags_free). */
    next = r->work;
    int e = t->ops.free(t->ops.ctx, r->cur);
    pthread_mutex_lock(&t->mu);
    if (e == 0) {
      r->cur = 0;
      r->state = ATAG_PAUSED;
    } else {
      frc = frc ? frc : e;
      kept_dev += r->size;
      kept_host += r->host ? r->size : 0;
      gmb__hostbuf_free(r->host);
      r->host = NULL;
      r->state = ATAG_RUNNING;
    }
    pthread_mutex_unlock(&t->mu);
  }
  if (kept_dev) (void)t->ops.admit(t->ops.ctx, tag, 0, mode, by, kept_host,
                                   kept_dev);
  pthread_mutex_unlock(&t->pause_mu);
  return frc;
}

int gmb__atags_claim(struct gmb_atags *t, int tag, int by) {
  int claimed = 0;
  struct atag *r;
  pthread_mutex_lock(&t->mu);
  RB_FOREACH(r, atag_tree, &t->tree)
    if (r->tag == tag && r->state == ATAG_PAUSED &&
        gmb__cache_by_rank(by) > gmb__cache_by_rank(r->by)) {
      r->by = (uint8_t)by;
      claimed = 1;
    }
  pthread_mutex_unlock(&t->mu);
  return claimed;
}

int gmb__atags_resume(struct gmb_atags *t, int tag) {
  pthread_mutex_lock(&t->pause_mu);
  uint64_t held = 0;
  struct atag *list =
      atag_take(t, tag, ATAG_PAUSED, ATAG_RESUMING, -1, &held);
  int rc = 0;
  struct atag *r;
  for (r = list; r && rc == 0; r = r->work) {
    rc = t->ops.alloc(t->ops.ctx, r->size, r->flags, &r->cur);
    if (rc == 0 && r->host)
      rc = t->ops.copy(t->ops.ctx, r->cur, r->host, r->size, 1);
    if (rc && r->cur) {
      (void)t->ops.free(t->ops.ctx, r->cur);
      r->cur = 0;
    }
  }
  if (rc) {
    /* Every new allocation goes back; the copies stay for a later try. */
    for (struct atag *q = list; q && q->cur; q = q->work) {
      (void)t->ops.free(t->ops.ctx, q->cur);
      q->cur = 0;
    }
    atag_settle(t, list, ATAG_PAUSED);
    pthread_mutex_unlock(&t->pause_mu);
    return rc;
  }
  uint64_t host = 0, device = 0;
  for (r = list; r; r = r->work) {
    device += r->size;
    host += r->host ? r->size : 0;
  }
  atag_drop_copies(list);
  /* Read before they run: a gmb_free may drop a running record. */
  const int by = list ? list->by : 0;
  atag_settle(t, list, ATAG_RUNNING);
  if (device) (void)t->ops.admit(t->ops.ctx, tag, 0, 0, by, host, device);
  pthread_mutex_unlock(&t->pause_mu);
  return 0;
}

int gmb__atags_paused(struct gmb_atags *t, int tag) {
  if (t == NULL || atomic_load_explicit(&t->n, memory_order_acquire) == 0)
    return 0;
  pthread_mutex_lock(&t->mu);
  int paused = atag_paused_locked(t, tag);
  pthread_mutex_unlock(&t->mu);
  return paused;
}

void gmb__atags_tags(struct gmb_atags *t, struct gmb_atags_tag *out) {
  memset(out, 0, GMB_ATAGS_TAGS * sizeof *out);
  if (t == NULL || atomic_load_explicit(&t->n, memory_order_acquire) == 0)
    return;
  struct atag *r;
  pthread_mutex_lock(&t->mu);
  RB_FOREACH(r, atag_tree, &t->tree) {
    if (r->tag < 0 || r->tag >= GMB_ATAGS_TAGS) continue;
    struct gmb_atags_tag *o = &out[r->tag];
    if (!atag_away(r)) {
      o->running += r->size;
      o->n_running++;
      if (r->holds > 0 && o->held == 0) o->held = r->id;
    } else {
      o->n_paused++;
      o->by_mask |= 1u << r->by;
    }
  }
  pthread_mutex_unlock(&t->mu);
}

uint64_t gmb__atags_uses(struct gmb_atags *t) {
  return t ? atomic_load_explicit(&t->uses, memory_order_relaxed) : 0;
}

void gmb__atags_counts(struct gmb_atags *t, struct gmb_atags_counts *out) {
  *out = (struct gmb_atags_counts){0};
  if (t == NULL) return;
  struct atag *r;
  pthread_mutex_lock(&t->mu);
  RB_FOREACH(r, atag_tree, &t->tree) {
    out->tagged++;
    if (!atag_away(r)) continue;
    out->paused++;
    out->device += r->size;
    out->host += r->host ? r->size : 0;
  }
  pthread_mutex_unlock(&t->mu);
}
