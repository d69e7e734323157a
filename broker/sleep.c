/*
 * sleep.c - sleep and wake across processes: the paused tags' account,
 * host_quota, operators' pause and resume, and who may be asked to pause
 * (sleep.h has the rules and the bounds).
 *
 * A session's records are a short list (at most GMB_SLEEP_TAGS_MAX), in the
 * order they came; every change goes through sleep_add and sleep_drop,
 * which keep the tenant's sums in step.
 */
#include "sleep.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "device.h"
#include "gmb.h"
#include "log.h"
#include "reply.h"
#include "tenant.h"
#include "util.h"

static struct gmb_log_rl sleep_rl_note, sleep_rl_offer;

void gmb__sleep_heard(struct gmb_broker *b, struct gmb_session *s,
                      uint64_t pausable, int idle, uint64_t idle_ms,
                      uint64_t now) {
  /* An offer is a pause's bytes, at most the device's capacity, as a
   * SleepNote's are (gmb__sleep_note): a figure past it is a lie, refused
   * as no offer at all rather than kept for status and the asks. */
  uint64_t cap = b->dev->capacity;
  if (pausable > cap) {
    if (gmb__log_allow(&sleep_rl_offer))
      log_warn("session %" PRIu64 " (tenant %s) offers to pause %" PRIu64
               " bytes, past the device's %" PRIu64 ": offer refused%s",
               s->id, s->tenant->name, pausable, cap,
               gmb__log_suppressed(&sleep_rl_offer));
    pausable = 0;
  }
  s->sleep_pausable = pausable;
  s->sleep_idle = idle != 0;
  /* A day at most: a figure past it says nothing more about the order
   * (and the product cannot wrap).  And idle no longer than the session
   * has existed: a longer figure would move it ahead of sessions idle
   * longer than it has been alive, and show in status as such.  So the
   * moment it was last active is never before its Hello. */
  if (idle_ms > UINT64_C(86400000)) idle_ms = UINT64_C(86400000);
  uint64_t idle_ns = idle_ms * GMB_NS_PER_MS;
  uint64_t active = now > idle_ns ? now - idle_ns : 0;
  s->sleep_active_ns = active > s->born_ns ? active : s->born_ns;
}

static struct gmb_sleep_tag **sleep_find(struct gmb_session *s,
                                         const char *tag) {
  struct gmb_sleep_tag **p = &s->paused;
  while (*p && strcmp((*p)->tag, tag) != 0) p = &(*p)->next;
  return p;
}

static void sleep_drop(struct gmb_session *s, struct gmb_sleep_tag **p,
                       uint64_t now) {
  struct gmb_sleep_tag *z = *p;
  struct gmb_tenant *t = s->tenant;
  GMB_ASSERT(t->host_bytes >= z->host_bytes &&
             t->paused_bytes >= z->device_bytes && t->paused_tags > 0 &&
             s->n_paused > 0 && "sleep sums drifted");
  t->host_bytes -= z->host_bytes;
  t->paused_bytes -= z->device_bytes;
  t->paused_tags--;
  t->paused_ns += now > z->since_ns ? now - z->since_ns : 0;
  s->host_bytes -= z->host_bytes;
  s->paused_bytes -= z->device_bytes;
  s->n_paused--;
  *p = z->next;
  free(z);
}

int gmb__sleep_note(struct gmb_broker *b, struct gmb_session *s,
                    const struct wire_request *req, struct wire_reply *rep) {
  const char *tag = req->u.sleep_note.tag;
  struct gmb_tenant *t = s->tenant;
  uint64_t now = gmb__now_ns();
  if (tag[0] == '\0')
    return gmb__reply_fail(rep, GMB_E_INVAL, "a sleep note names a tag");
  if (strcmp(tag, GMB_SLEEP_MOVABLE_TAG) == 0)
    return gmb__reply_fail(rep, GMB_E_INVAL, "the tag name %s is the "
                           "broker's (its offloads of movable allocations)",
                           tag);
  struct gmb_sleep_tag **p = sleep_find(s, tag);
  if (!req->u.sleep_note.paused) {
    if (*p) {
      sleep_drop(s, p, now);
      t->resumes++;
    }
    rep->status = 0;
    return 1;
  }
  uint64_t host = req->u.sleep_note.host_bytes;
  uint64_t device = req->u.sleep_note.device_bytes;
  /* A tag's pages were on the device at once, and its copy is at most
   * their bytes: a figure past the capacity is a lie, and refused, so that
   * no record (of at most GMB_SLEEP_TAGS_MAX + 1 per session) can wrap
   * the sums that sleep_drop takes it from. */
  uint64_t cap = b->dev->capacity;
  if (host > cap || device > cap) {
    char c[GMB_SIZE_BUFSZ];
    return gmb__reply_fail(rep, GMB_E_INVAL, "a sleep note of tag %s claims "
                           "%" PRIu64 " host and %" PRIu64 " device bytes; "
                           "a pause gives back at most the device's %s",
                           tag, host, device,
                           gmb__size_format(cap, c, sizeof c));
  }
  uint64_t old_host = *p ? (*p)->host_bytes : 0;
  /* Host bytes: the tenant's other paused tags plus this one's new copy. */
  uint64_t others = t->host_bytes - old_host;
  if (t->host_quota && (host > t->host_quota || others > t->host_quota - host)) {
    char q[GMB_SIZE_BUFSZ], h[GMB_SIZE_BUFSZ], w[GMB_SIZE_BUFSZ];
    if (gmb__log_allow(&sleep_rl_note))
      log_info("session %" PRIu64 " (tenant %s): pausing tag %s refused: "
               "%s more host memory would pass the host_quota %s (%s held)%s",
               s->id, t->name, tag, gmb__size_format(host, w, sizeof w),
               gmb__size_format(t->host_quota, q, sizeof q),
               gmb__size_format(others, h, sizeof h),
               gmb__log_suppressed(&sleep_rl_note));
    return gmb__reply_fail(rep, GMB_E_LIMIT, "offloading tag %s (%s) would "
                           "pass tenant %s's host_quota %s (%s held by its "
                           "paused tags)", tag,
                           gmb__size_format(host, w, sizeof w), t->name,
                           gmb__size_format(t->host_quota, q, sizeof q),
                           gmb__size_format(others, h, sizeof h));
  }
  struct gmb_sleep_tag *z = *p;
  if (z == NULL) {
    if (s->n_paused - (*sleep_find(s, GMB_SLEEP_MOVABLE_TAG) != NULL) >=
        GMB_SLEEP_TAGS_MAX)
      return gmb__reply_fail(rep, GMB_E_LIMIT, "a session reports at most %d "
                             "paused tags", GMB_SLEEP_TAGS_MAX);
    z = calloc(1, sizeof *z);
    if (z == NULL)
      return gmb__reply_fail(rep, GMB_E_SYSTEM, "out of host memory");
    snprintf(z->tag, sizeof z->tag, "%s", tag);
    z->since_ns = now;
    *p = z;
    s->n_paused++;
    t->paused_tags++;
    t->pauses++;
  } else {
    t->host_bytes -= z->host_bytes;
    t->paused_bytes -= z->device_bytes;
    s->host_bytes -= z->host_bytes;
    s->paused_bytes -= z->device_bytes;
  }
  z->host_bytes = host;
  z->device_bytes = device;
  z->mode = (uint8_t)(req->u.sleep_note.mode == GMB_PAUSE_DISCARD);
  z->by = (uint8_t)(req->u.sleep_note.by <= WIRE_BY_OPERATOR
                        ? req->u.sleep_note.by
                        : WIRE_BY_APP);
  t->host_bytes += host;
  t->paused_bytes += device;
  s->host_bytes += host;
  s->paused_bytes += device;
  rep->status = 0;
  return 1;
}

int gmb__sleep_admin(struct gmb_broker *b, struct gmb_tenant *t,
                     const struct wire_request *req, struct wire_reply *rep) {
  int pause = req->kind == WIRE_ADMIN_PAUSE;
  struct wire_reply ev;
  memset(&ev, 0, sizeof ev);
  ev.kind = WIRE_EVENT;
  ev.u.event.kind = pause ? WIRE_EVENT_SLEEP : WIRE_EVENT_WAKE;
  snprintf(ev.u.event.tag, sizeof ev.u.event.tag, "%s",
           req->u.admin_pause.tag);
  ev.u.event.mode = pause && req->u.admin_pause.discard ? GMB_PAUSE_DISCARD
                                                        : GMB_PAUSE_OFFLOAD;
  uint32_t n = 0;
  for (struct gmb_session *s = t->sessions; s; s = s->tenant_next) {
    gmb__reply_to_session(b, s, &ev);
    n++;
  }
  rep->kind = WIRE_ADMIN_PAUSE; /* one reply body for both */
  rep->u.pause.sessions = n;
  snprintf(rep->message, sizeof rep->message, "%u session%s of tenant %s "
           "asked to %s %s%s%s", n, n == 1 ? "" : "s", t->name,
           pause ? "pause" : "resume",
           req->u.admin_pause.tag[0] ? "tag " : "every tag",
           req->u.admin_pause.tag, pause && req->u.admin_pause.discard
                                       ? " (discarding its bytes)"
                                       : "");
  return 1;
}

int gmb__sleep_movable(struct gmb_session *s, int64_t delta) {
  struct gmb_tenant *t = s->tenant;
  uint64_t now = gmb__now_ns();
  struct gmb_sleep_tag **p = sleep_find(s, GMB_SLEEP_MOVABLE_TAG);
  struct gmb_sleep_tag *z = *p;
  if (z == NULL) {
    GMB_ASSERT(delta > 0 && "fewer offloaded bytes than none");
    /* Out of host memory is the caller's refusal, not a bug: nothing has
     * changed yet. */
    if ((z = calloc(1, sizeof *z)) == NULL) return GMB_E_SYSTEM;
    snprintf(z->tag, sizeof z->tag, "%s", GMB_SLEEP_MOVABLE_TAG);
    z->since_ns = now;
    z->by = WIRE_BY_BROKER;
    *p = z;
    s->n_paused++;
    t->paused_tags++;
    /* Not in `pauses`/`resumes`, which count the tags the libraries
     * paused: the broker's own are counted in b->offload. */
  }
  GMB_ASSERT((delta >= 0 || z->host_bytes >= (uint64_t)-delta) &&
             "offloaded bytes drifted");
  z->host_bytes += (uint64_t)delta; /* two's complement: adds or takes */
  z->device_bytes += (uint64_t)delta;
  t->host_bytes += (uint64_t)delta;
  t->paused_bytes += (uint64_t)delta;
  s->host_bytes += (uint64_t)delta;
  s->paused_bytes += (uint64_t)delta;
  if (z->host_bytes == 0) sleep_drop(s, p, now);
  return 0;
}

void gmb__sleep_forget_session(struct gmb_session *s) {
  uint64_t now = gmb__now_ns();
  while (s->paused) sleep_drop(s, &s->paused, now);
  s->sleep_pausable = 0;
  s->sleep_idle = 0;
}

int gmb__sleep_askable(const struct gmb_session *o,
                       const struct gmb_session *s, uint64_t now) {
  return o != s && o->tenant != s->tenant &&
         (o->sleep_pausable > 0 || o->sleep_idle) &&
         o->tenant->priority <= s->tenant->priority && o->ask_bytes == 0 &&
         now >= o->ask_skip_ns && o->waiting == 0;
}

int gmb__sleep_cmp(const void *x, const void *y) {
  const struct gmb_session *a = *(struct gmb_session *const *)x;
  const struct gmb_session *c = *(struct gmb_session *const *)y;
  if (a->tenant->priority != c->tenant->priority)
    return a->tenant->priority < c->tenant->priority ? -1 : 1;
  if (a->sleep_active_ns != c->sleep_active_ns)
    return a->sleep_active_ns < c->sleep_active_ns ? -1 : 1;
  if (a->sleep_pausable != c->sleep_pausable)
    return a->sleep_pausable > c->sleep_pausable ? -1 : 1;
  return (a->id > c->id) - (a->id < c->id);
}

struct sleep_pick {
  struct gmb_session **v;
  size_t n, cap;
  const struct gmb_session *s;
  uint64_t now;
};

static void sleep_collect(void *ctx, struct gmb_session *o) {
  struct sleep_pick *p = ctx;
  if (p->n < p->cap && gmb__sleep_askable(o, p->s, p->now)) p->v[p->n++] = o;
}

struct gmb_session **gmb__sleep_candidates(struct gmb_broker *b,
                                           const struct gmb_session *s,
                                           size_t *n) {
  struct sleep_pick p = {.s = s, .now = gmb__now_ns()};
  *n = 0;
  p.cap = gmb__sessions_count(b->sessions);
  if (p.cap == 0 || (p.v = malloc(p.cap * sizeof *p.v)) == NULL) return NULL;
  gmb__sessions_each(b->sessions, sleep_collect, &p);
  if (p.n == 0) {
    free(p.v);
    return NULL;
  }
  qsort(p.v, p.n, sizeof *p.v, gmb__sleep_cmp);
  *n = p.n;
  return p.v;
}

double gmb__sleep_tenant_seconds(const struct gmb_tenant *t, uint64_t now) {
  uint64_t ns = t->paused_ns;
  for (const struct gmb_session *s = t->sessions; s; s = s->tenant_next)
    for (const struct gmb_sleep_tag *z = s->paused; z; z = z->next)
      ns += now > z->since_ns ? now - z->since_ns : 0;
  return (double)ns / 1e9;
}

void gmb__sleep_session_paused(const struct gmb_session *s, char *buf,
                               size_t cap) {
  size_t n = 0;
  buf[0] = '\0';
  for (const struct gmb_sleep_tag *z = s->paused; z; z = z->next) {
    size_t len = strlen(z->tag) + (n ? 1 : 0);
    if (n + len + 4 > cap) { /* room for "..." and the NUL */
      snprintf(buf + n, cap - n, "...");
      return;
    }
    n += (size_t)snprintf(buf + n, cap - n, "%s%s", n ? "," : "", z->tag);
  }
}

static int sleep_name_cmp(const void *x, const void *y) {
  return strcmp(*(const char *const *)x, *(const char *const *)y);
}

int gmb__sleep_tenant_tags(const struct gmb_tenant *t, const char **names,
                           size_t max, const char *tag, int *found) {
  size_t n = 0, k = 0;
  if (found) *found = 0;
  for (const struct gmb_session *s = t->sessions; s; s = s->tenant_next)
    n += s->n_paused;
  if (n == 0) return 0;
  const char **v = malloc(n * sizeof *v);
  if (v == NULL) return GMB_E_SYSTEM;
  size_t i = 0;
  for (const struct gmb_session *s = t->sessions; s; s = s->tenant_next)
    for (const struct gmb_sleep_tag *z = s->paused; z && i < n; z = z->next)
      v[i++] = z->tag;
  qsort(v, i, sizeof *v, sleep_name_cmp);
  for (size_t j = 0; j < i; j++) {
    if (j > 0 && strcmp(v[j], v[j - 1]) == 0) continue;
    if (tag && found && strcmp(v[j], tag) == 0) *found = 1;
    if (k < max) names[k++] = v[j];
  }
  free(v);
  return (int)k;
}

struct sleep_sums {
  int bad;
};

static int sleep_tenant_check(void *ctx, struct gmb_tenant *t) {
  struct sleep_sums *c = ctx;
  uint64_t host = 0, dev = 0, tags = 0;
  for (const struct gmb_session *s = t->sessions; s; s = s->tenant_next) {
    uint64_t sh = 0, sd = 0, sn = 0;
    for (const struct gmb_sleep_tag *z = s->paused; z; z = z->next) {
      sh += z->host_bytes;
      sd += z->device_bytes;
      sn++;
    }
    c->bad += sh != s->host_bytes || sd != s->paused_bytes ||
              sn != s->n_paused || sn > GMB_SLEEP_TAGS_MAX + 1;
    host += sh;
    dev += sd;
    tags += sn;
  }
  c->bad += host != t->host_bytes || dev != t->paused_bytes ||
            tags != t->paused_tags;
  return 0;
}

int gmb__sleep_check(struct gmb_broker *b) {
  struct sleep_sums c = {0};
  if (b->tenants == NULL) return 0;
  gmb__tenants_each(b->tenants, sleep_tenant_check, &c);
  if (c.bad) log_error("sleep: %d violations of the paused sums", c.bad);
  return c.bad;
}
