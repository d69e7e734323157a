/*
 * sleep_policy.c - the sleep policy of a session and the pauses others ask
 * of it (sleep_policy.h has the rules).
 *
 * State: the policy (on, idle time, tags and their modes) and the queue of
 * operators' asks under `mu`; the broker's ask (bytes), the offer and the
 * moment of the last activity in atomics, read by any thread that sends a
 * request.  Only the library thread writes `seen` (the figures at its
 * last look) and carries out asks; program threads call auto_resume.
 * Every tag is reached through the session's callbacks (ops), never
 * under mu.
 */
#include "sleep_policy.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cache.h"
#include "gmb.h"
#include "util.h"
#include "wire.h"

#define POLICY_TAGS 64
#define POLICY_OPS 8
#define POLICY_RETRY_NS (5 * 1000 * 1000L)

_Static_assert(sizeof(((struct gmb_sleep_tag *)0)->name) ==
                   GMB_CACHE_TAG_MAX + 1,
               "a tag's name as the cache bounds it");

struct policy_op {
  int wake, mode;
  char tag[GMB_CACHE_TAG_MAX + 1]; /* "": every tag */
};

struct gmb_sleep_policy {
  struct gmb_sleep_ops ops;
  pthread_mutex_t mu;
  atomic_int on;
  uint64_t idle_ms;
  unsigned n; /* 0: every tag, offloaded */
  char tag[POLICY_TAGS][GMB_CACHE_TAG_MAX + 1];
  uint8_t mode[POLICY_TAGS];
  struct policy_op op[POLICY_OPS];
  unsigned n_op;
  atomic_int pending;          /* op or ask queued */
  _Atomic uint64_t ask;        /* bytes the broker asked (0: none) */
  _Atomic uint64_t offer;      /* bytes offered now */
  _Atomic int idle;            /* idle past idle_ms (sent as sleep_idle) */
  _Atomic uint64_t active_ns;  /* last activity seen */
  uint64_t seen[4];            /* ops.activity at the last look */
};

struct gmb_sleep_policy *gmb__sleep_policy_new(const struct gmb_sleep_ops *ops) {
  struct gmb_sleep_policy *p = calloc(1, sizeof *p);
  if (p == NULL) return NULL;
  p->ops = *ops;
  pthread_mutex_init(&p->mu, NULL);
  p->active_ns = gmb__now_ns();
  return p;
}

void gmb__sleep_policy_destroy(struct gmb_sleep_policy *p) {
  if (p == NULL) return;
  pthread_mutex_destroy(&p->mu);
  free(p);
}

int gmb__sleep_policy_set(struct gmb_sleep_policy *p, const char *spec,
                          char *why, size_t whycap) {
  uint64_t idle_ms = 0;
  unsigned n = 0;
  char tag[POLICY_TAGS][GMB_CACHE_TAG_MAX + 1];
  uint8_t mode[POLICY_TAGS];
  int on = spec != NULL && spec[0] != '\0' && strcmp(spec, "off") != 0;
  if (on && strlen(spec) > 8192) {
    snprintf(why, whycap, "a sleep policy has at most 8192 bytes");
    return GMB_E_INVAL;
  }
  char *copy = on ? strdup(spec) : NULL;
  int rc = on && copy == NULL ? GMB_E_SYSTEM : 0;
  char *save = NULL;
  for (char *it = copy ? strtok_r(copy, ", \t", &save) : NULL;
       it && rc == 0; it = strtok_r(NULL, ", \t", &save)) {
    if (strncmp(it, "idle=", 5) == 0) {
      char *end;
      errno = 0;
      double s = strtod(it + 5, &end);
      if (it[5] == '\0' || *end != '\0' || errno || !(s >= 0) ||
          s > 86400.0) {
        snprintf(why, whycap, "sleep policy: \"%s\" is not idle=SECONDS "
                 "(0 to 86400)", it);
        rc = GMB_E_INVAL;
      }
      idle_ms = (uint64_t)(s * 1000.0 + 0.5);
      continue;
    }
    char *colon = strchr(it, ':');
    int m = GMB_PAUSE_OFFLOAD;
    if (colon) {
      *colon = '\0';
      if (strcmp(colon + 1, "discard") == 0) {
        m = GMB_PAUSE_DISCARD;
      } else if (strcmp(colon + 1, "offload") != 0) {
        snprintf(why, whycap, "sleep policy: tag %s: mode \"%s\" is neither "
                 "offload nor discard", it, colon + 1);
        rc = GMB_E_INVAL;
        break;
      }
    }
    if (it[0] == '\0' || strlen(it) > GMB_CACHE_TAG_MAX) {
      snprintf(why, whycap, "sleep policy: a tag has 1 to %d bytes",
               GMB_CACHE_TAG_MAX);
      rc = GMB_E_INVAL;
    } else if (n == POLICY_TAGS) {
      snprintf(why, whycap, "sleep policy: at most %d tags", POLICY_TAGS);
      rc = GMB_E_INVAL;
    } else {
      snprintf(tag[n], sizeof tag[n], "%s", it);
      mode[n++] = (uint8_t)m;
    }
  }
  free(copy);
  if (rc == GMB_E_SYSTEM) snprintf(why, whycap, "out of memory");
  if (rc == 0) {
    pthread_mutex_lock(&p->mu);
    p->idle_ms = idle_ms;
    p->n = n;
    memcpy(p->tag, tag, sizeof tag[0] * n);
    memcpy(p->mode, mode, n);
    atomic_store(&p->on, on);
    if (!on) {
      atomic_store(&p->offer, 0);
      atomic_store(&p->idle, 0);
    }
    pthread_mutex_unlock(&p->mu);
  }
  return rc;
}

int gmb__sleep_policy_on(struct gmb_sleep_policy *p) {
  return p && atomic_load_explicit(&p->on, memory_order_relaxed);
}

/* The policy's mode for `tag`: GMB_PAUSE_*, or -1 when it is not one of
 * the policy's tags.  Holds mu. */
static int policy_mode(const struct gmb_sleep_policy *p, const char *tag) {
  if (p->n == 0) return GMB_PAUSE_OFFLOAD;
  for (unsigned i = 0; i < p->n; i++)
    if (strcmp(p->tag[i], tag) == 0) return p->mode[i];
  return -1;
}

/* The session's tags (at most POLICY_TAGS) into info: how many. */
static unsigned policy_tags(struct gmb_sleep_policy *p,
                            struct gmb_sleep_tag *info) {
  unsigned n = p->ops.tags(p->ops.ctx, info, POLICY_TAGS);
  return n > POLICY_TAGS ? POLICY_TAGS : n;
}

void gmb__sleep_policy_look(struct gmb_sleep_policy *p, uint64_t now) {
  if (!gmb__sleep_policy_on(p)) return;
  uint64_t seen[4] = {0};
  p->ops.activity(p->ops.ctx, seen);
  if (memcmp(seen, p->seen, sizeof seen) != 0) {
    memcpy(p->seen, seen, sizeof seen);
    atomic_store(&p->active_ns, now);
  }
  struct gmb_sleep_tag info[POLICY_TAGS];
  unsigned n = policy_tags(p, info);
  uint64_t offer = 0;
  pthread_mutex_lock(&p->mu);
  uint64_t idle_ns = p->idle_ms * GMB_NS_PER_MS;
  const int idle = now - atomic_load(&p->active_ns) >= idle_ns;
  atomic_store(&p->idle, idle);
  if (idle)
    for (unsigned i = 0; i < n; i++)
      if (policy_mode(p, info[i].name) >= 0) offer += info[i].pausable;
  pthread_mutex_unlock(&p->mu);
  atomic_store(&p->offer, offer);
}

int gmb__sleep_policy_idle(struct gmb_sleep_policy *p) {
  return gmb__sleep_policy_on(p) && atomic_load(&p->idle);
}

uint64_t gmb__sleep_policy_offer(struct gmb_sleep_policy *p, uint64_t now,
                                 uint64_t *idle_ms) {
  *idle_ms = 0;
  if (!gmb__sleep_policy_on(p)) return 0;
  uint64_t act = atomic_load(&p->active_ns);
  *idle_ms = now > act ? (now - act) / GMB_NS_PER_MS : 0;
  return atomic_load(&p->offer);
}

void gmb__sleep_policy_event(struct gmb_sleep_policy *p, int wake, int mode,
                             const char *tag, uint64_t bytes) {
  if (p == NULL) return;
  if (!wake && mode == WIRE_SLEEP_ASK) {
    atomic_store(&p->ask, bytes ? bytes : 1);
  } else {
    pthread_mutex_lock(&p->mu);
    unsigned i = p->n_op < POLICY_OPS ? p->n_op++ : POLICY_OPS - 1;
    p->op[i].wake = wake;
    p->op[i].mode = mode == GMB_PAUSE_DISCARD ? GMB_PAUSE_DISCARD
                                              : GMB_PAUSE_OFFLOAD;
    snprintf(p->op[i].tag, sizeof p->op[i].tag, "%s", tag ? tag : "");
    pthread_mutex_unlock(&p->mu);
  }
  atomic_store(&p->pending, 1);
}

int gmb__sleep_policy_pending(struct gmb_sleep_policy *p) {
  return p && atomic_load_explicit(&p->pending, memory_order_relaxed);
}

/* An operator's ask: pause (in its mode) or resume the tag it names, or
 * every tag (a resume of every tag leaves those the application paused).
 * A tag whose pause is refused (a locked allocation) runs on. */
static void policy_op_run(struct gmb_sleep_policy *p,
                          const struct policy_op *op) {
  struct gmb_sleep_tag info[POLICY_TAGS];
  unsigned n = policy_tags(p, info);
  for (unsigned i = 0; i < n; i++) {
    if (op->tag[0] && strcmp(op->tag, info[i].name) != 0) continue;
    if (op->wake && info[i].paused &&
        (op->tag[0] || info[i].by != GMB_CACHE_BY_APP))
      (void)p->ops.resume(p->ops.ctx, info[i].name); /* no room: paused */
    else if (!op->wake &&
             (info[i].running || info[i].by == GMB_CACHE_BY_BROKER))
      /* Paused by the broker's ask, it becomes the operator's pause: it
       * no longer resumes by itself at its next use. */
      (void)p->ops.pause(p->ops.ctx, info[i].name, op->mode,
                         GMB_CACHE_BY_OPERATOR);
  }
}

static int policy_info_cmp(const void *x, const void *y) {
  const struct gmb_sleep_tag *a = x, *b = y;
  return a->pausable > b->pausable ? -1 : a->pausable < b->pausable;
}

int gmb__sleep_policy_run(struct gmb_sleep_policy *p, uint64_t now) {
  if (p == NULL || !atomic_exchange(&p->pending, 0)) return 0;
  uint64_t want = atomic_exchange(&p->ask, 0);
  struct policy_op op[POLICY_OPS];
  pthread_mutex_lock(&p->mu);
  unsigned nop = p->n_op;
  memcpy(op, p->op, nop * sizeof op[0]);
  p->n_op = 0;
  pthread_mutex_unlock(&p->mu);
  for (unsigned i = 0; i < nop; i++) policy_op_run(p, &op[i]);
  if (want == 0) return 0;
  /* Active since it offered (the broker saw an old offer; a thread that
   * started to wait for memory is activity too): it declines, and the
   * broker counts an ask that gave nothing. */
  uint64_t idle_ms;
  if (gmb__sleep_policy_offer(p, now, &idle_ms) == 0) return 1;
  pthread_mutex_lock(&p->mu);
  int idle = idle_ms >= p->idle_ms;
  pthread_mutex_unlock(&p->mu);
  if (!idle) return 1;
  uint64_t given = p->ops.trim(p->ops.ctx); /* idle pages hold nothing */
  struct gmb_sleep_tag info[POLICY_TAGS];
  unsigned n = policy_tags(p, info);
  qsort(info, n, sizeof info[0], policy_info_cmp);
  for (unsigned i = 0; i < n && given < want; i++) {
    if (info[i].pausable == 0) continue; /* nothing, or a locked allocation */
    pthread_mutex_lock(&p->mu);
    int mode = policy_mode(p, info[i].name);
    pthread_mutex_unlock(&p->mu);
    if (mode < 0) continue;
    if (p->ops.pause(p->ops.ctx, info[i].name, mode, GMB_CACHE_BY_BROKER) == 0)
      given += info[i].pausable;
  }
  atomic_store(&p->offer, 0); /* until the next look */
  return 1;
}

int gmb__sleep_policy_auto_resume(struct gmb_sleep_policy *p, const char *tag,
                                  int wait_ms, int *by) {
  struct gmb_sleep_tag info[POLICY_TAGS];
  unsigned n = policy_tags(p, info);
  *by = GMB_CACHE_BY_APP;
  int found = 0;
  for (unsigned i = 0; i < n; i++) {
    if (strcmp(info[i].name, tag) != 0) continue;
    if (!info[i].paused) return 0; /* resumed meanwhile by another thread */
    *by = info[i].by;
    found = 1;
  }
  if (!found || *by != GMB_CACHE_BY_BROKER) return GMB_E_INVAL;
  uint64_t until = gmb__now_ns() + (uint64_t)wait_ms * GMB_NS_PER_MS;
  for (;;) {
    int rc = p->ops.resume(p->ops.ctx, tag);
    if (rc != GMB_E_NOMEM && rc != GMB_E_QUOTA) return rc;
    if (gmb__now_ns() >= until) return rc;
    struct timespec ts = {0, POLICY_RETRY_NS};
    nanosleep(&ts, NULL);
  }
}
