/*
 * sleep_policy.h - a session's sleep policy and the pauses others ask of it
 * (the broker under pressure, an operator), carried out by the library
 * thread.
 *
 * The policy (GMB_SLEEP_POLICY, gmb_sleep_policy_set) opts the session in:
 * after it has been idle for the policy's time (no block allocated or
 * freed by its cache, no tagged gmb_alloc allocation made, freed or
 * locked), it offers the bytes of its policy's tags to the broker
 * (Request.sleep_pausable), which may then ask it (EVENT_SLEEP) to pause
 * some for another job's request.  A tag paused so resumes at the
 * process's next gmb_resume, or by itself at its next allocation or
 * gmb_lock of one of its allocations.
 *
 * A tag is a whole here: its cache part and its gmb_alloc allocations,
 * paused and resumed together through the session's callbacks
 * (gmb_sleep_ops, client.c), exactly as gmb_pause and gmb_resume do.  So
 * this module is plain C over those callbacks, and its unit test drives
 * it without a broker.
 *
 * Syntax: comma- or space-separated items: `idle=SECONDS` (a decimal
 * number, default 0), then tags: `NAME` or `NAME:offload` (copied to host
 * memory) or `NAME:discard` (a KV cache).  No tag named: every tag of the
 * process, offloaded.  "" or "off": no policy.  At most 64 tags.
 *
 * Thread safety: every function may be called from any thread; the
 * policy and the queue of asks are under the object's own mutex, which is
 * never held across a call into the cache or to the broker.
 */
#ifndef GMB_SLEEP_POLICY_H
#define GMB_SLEEP_POLICY_H

#include <stddef.h>
#include <stdint.h>

struct gmb_sleep_policy;

/* One tag of the session, both parts, as the callbacks see it now. */
struct gmb_sleep_tag {
  char name[64];
  int running;       /* some part runs: a pause has something to do */
  int paused;        /* some part is paused, pausing or resuming */
  int by;            /* paused: who paused it (GMB_CACHE_BY_*): the
                        application when it paused a part, else an
                        operator when one did, else the broker */
  uint64_t pausable; /* device bytes a pause would give back now: the
                        cache part's pages and the running allocations;
                        0 when one of its allocations is locked (a pause
                        would be refused, as gmb_pause refuses it) */
};

/* What the policy needs from the session (client.c).  Called from the
 * library thread (look, run) or a program thread (auto_resume), never
 * holding the policy's mutex. */
struct gmb_sleep_ops {
  void *ctx;
  /* The tags, in the order they were made, up to cap; how many there are. */
  unsigned (*tags)(void *ctx, struct gmb_sleep_tag *out, unsigned cap);
  /* Figures that move when the program allocates, frees or locks memory:
   * a change between two looks is activity. */
  void (*activity)(void *ctx, uint64_t v[4]);
  /* Gives back the cache's idle pages: the bytes given. */
  uint64_t (*trim)(void *ctx);
  /* Pauses (mode GMB_PAUSE_*, for `by`) or resumes a whole tag: 0 or the
   * failure, explained (gmb_last_error). */
  int (*pause)(void *ctx, const char *tag, int mode, int by);
  int (*resume)(void *ctx, const char *tag);
};

/* ops is copied. */
struct gmb_sleep_policy *gmb__sleep_policy_new(const struct gmb_sleep_ops *ops);
void gmb__sleep_policy_destroy(struct gmb_sleep_policy *p); /* NULL: no-op */

/* Sets the policy from `spec` (above; NULL: none).  0, or GMB_E_INVAL
 * with why filled and the policy unchanged. */
int gmb__sleep_policy_set(struct gmb_sleep_policy *p, const char *spec,
                          char *why, size_t whycap);

/* 1 when a policy is set. */
int gmb__sleep_policy_on(struct gmb_sleep_policy *p);

/* The library thread's look, each tick: notes activity (ops.activity
 * moved) and computes the offer: the pausable bytes of the policy's tags
 * once idle long enough. */
void gmb__sleep_policy_look(struct gmb_sleep_policy *p, uint64_t now);

/* 1 when the policy is on and the last look found the session idle past
 * its threshold, whatever its tags offer: the broker may then offload its
 * unlocked movable allocations (sent as Request.sleep_idle). */
int gmb__sleep_policy_idle(struct gmb_sleep_policy *p);

/* The offer to report now (0: no policy, or not idle long enough), and
 * how long the session has been idle (*idle_ms). */
uint64_t gmb__sleep_policy_offer(struct gmb_sleep_policy *p, uint64_t now,
                                 uint64_t *idle_ms);

/* An event from the broker: EVENT_SLEEP (wake 0) with `mode` (GMB_PAUSE_*,
 * or the broker's ask with `bytes`) and `tag`, or EVENT_WAKE (wake 1).
 * Queued for gmb__sleep_policy_run (at most 8 operators' asks wait; a
 * ninth replaces the last).  Cheap: called holding the socket. */
void gmb__sleep_policy_event(struct gmb_sleep_policy *p, int wake, int mode,
                             const char *tag, uint64_t bytes);

/* 1 when something waits for gmb__sleep_policy_run. */
int gmb__sleep_policy_pending(struct gmb_sleep_policy *p);

/* Carries out what was asked (the library thread, holding nothing):
 * operators' pauses and resumes, then the broker's ask: the cache's idle
 * pages, then the policy's tags in the policy's modes, largest pausable
 * first, until the bytes asked are given (none when the session was
 * active within its idle time since it offered).  A tag whose pause is
 * refused (a locked allocation) is passed over: the ask is answered with
 * what the others gave.  Returns 1 when the broker's ask must be answered
 * (a Heartbeat with trim_answered). */
int gmb__sleep_policy_run(struct gmb_sleep_policy *p, uint64_t now);

/* A paused tag was touched (an allocation with it current, a gmb_lock of
 * one of its allocations): resumes it when the broker or the policy
 * paused it (GMB_CACHE_BY_BROKER), trying again every 5 ms while the
 * broker has no room, up to wait_ms.  0 resumed (or found running);
 * GMB_E_INVAL when the application paused it (gmb_resume is its call) or
 * an operator did (gmbctl resume), with *by set; else the last refusal. */
int gmb__sleep_policy_auto_resume(struct gmb_sleep_policy *p, const char *tag,
                                  int wait_ms, int *by);

#endif /* GMB_SLEEP_POLICY_H */
