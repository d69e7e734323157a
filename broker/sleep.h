/*
 * sleep.h - sleep and wake across processes, the broker's side.
 *
 * The bytes of a paused tag live in its client's process (host memory it
 * allocated) or nowhere (discarded): the broker holds no copy.  What it
 * keeps is the account: each session's paused tags as its library reports
 * them (SleepNote, before the copy), each tenant's sums (host bytes held,
 * device bytes given back, tags paused) and totals since start (pauses,
 * resumes, seconds paused, asks to sleep), for status, snapshots and
 * metrics; and the tenant's host_quota, checked when a pause is reported
 * (the library asks before it copies, and an offload past the quota is
 * refused GMB_E_LIMIT).  A process could still allocate host memory of its
 * own outside libgmb: the quota bounds what gmb's sleep holds, not the
 * host.
 *
 * Who may be asked to pause (gmb__sleep_askable) for another session's
 * request that found the device full (reclaim.c plans and sends the ask,
 * EVENT_SLEEP, with its ordinary bounds): a session whose sleep policy
 * offers bytes now (Request.sleep_pausable: it has opted in and has been
 * idle as long as its policy says), or whose policy says it is idle
 * although its tags offer nothing (Request.sleep_idle: only the broker's
 * own offload of its movable allocations, offload.c, takes anything from
 * it; the asks pass it over), of another tenant whose priority is not
 * above the requester's, not asked already, not waiting itself, and not
 * in its pause after asks that fell short.  Order: lowest priority,
 * longest idle, largest offer (gmb__sleep_cmp).  The asks (reclaim.c)
 * also pass over a session whose tenant is in such a pause (any of its
 * sessions fell short), and ask a session for at most what it holds.
 *
 * Operators pause and resume a tenant's tags (gmbctl pause|resume): every
 * session of the tenant is sent EVENT_SLEEP with the tag and mode, or
 * EVENT_WAKE; its library acts from its own thread and reports with
 * SleepNotes.  Nothing waits for them: status shows what paused.
 *
 * Bounds: at most GMB_SLEEP_TAGS_MAX paused tags recorded per session (a
 * library has at most 64 tags); a note past that is refused GMB_E_LIMIT.
 * A session that ends forgets its records (its host bytes died with its
 * process, or will when it exits).
 *
 * Invariants (gmb__sleep_check): each tenant's host_bytes, paused_bytes
 * and paused_tags are the sums over its sessions' records.
 */
#ifndef GMB_SLEEP_H
#define GMB_SLEEP_H

#include <stddef.h>
#include <stdint.h>

#include "broker.h"
#include "session.h"
#include "wire.h"

#define GMB_SLEEP_TAGS_MAX 64
/* The record of the movable allocations the broker offloaded itself
 * (offload.c): a name no client may report (gmb__sleep_note refuses it),
 * beyond GMB_SLEEP_TAGS_MAX. */
#define GMB_SLEEP_MOVABLE_TAG "(movable)"

/* One paused tag of a session. */
struct gmb_sleep_tag {
  struct gmb_sleep_tag *next;
  char tag[WIRE_TAG_MAX + 1];
  uint64_t host_bytes, device_bytes;
  uint64_t since_ns;
  uint8_t mode, by;
};

/* Every request carries the session's sleep offer: recorded (the idle time,
 * at most the session's age, becomes the moment it was last active, on the
 * broker's clock; an offer past the device's capacity is refused: no
 * offer). */
void gmb__sleep_heard(struct gmb_broker *b, struct gmb_session *s,
                      uint64_t pausable, int idle, uint64_t idle_ms,
                      uint64_t now);

/* A SleepNote of session s: records or forgets the paused tag, checking
 * the tenant's host_quota for a pause.  Fills *rep; returns 1. */
int gmb__sleep_note(struct gmb_broker *b, struct gmb_session *s,
                    const struct wire_request *req, struct wire_reply *rep);

/* AdminPause / admin_resume: tells every session of the tenant (already
 * found and checked by admin.c).  Fills *rep; returns 1. */
int gmb__sleep_admin(struct gmb_broker *b, struct gmb_tenant *t,
                     const struct wire_request *req, struct wire_reply *rep);

/* The broker offloaded `delta` more bytes of s's movable allocations to
 * its own host memory (delta < 0: fewer, brought back or freed): kept in
 * s's GMB_SLEEP_MOVABLE_TAG record (made at the first, dropped when it
 * holds nothing), whose host and device bytes are those bytes, so that
 * the tenant's sums, host_quota and status count them as paused tags.
 * 0, or GMB_E_SYSTEM with nothing changed when the record is to be made
 * and there is no host memory for it (only when delta > 0). */
int gmb__sleep_movable(struct gmb_session *s, int64_t delta);

/* Session s is ending: its records go, their time is added to the
 * tenant's totals. */
void gmb__sleep_forget_session(struct gmb_session *s);

/* May session o be asked to pause for session s's request now? */
int gmb__sleep_askable(const struct gmb_session *o,
                       const struct gmb_session *s, uint64_t now);

/* qsort order of askable sessions: lowest priority, longest idle, largest
 * offer, then id. */
int gmb__sleep_cmp(const void *x, const void *y);

/* The sessions that may be asked to pause for session s's request now
 * (gmb__sleep_askable), in gmb__sleep_cmp's order: the one choice both
 * the asks (reclaim.c) and the broker's own offloads (offload.c) follow.
 * A malloc'd array the caller frees, *n its length; NULL (and *n 0) when
 * there is none or no host memory. */
struct gmb_session **gmb__sleep_candidates(struct gmb_broker *b,
                                           const struct gmb_session *s,
                                           size_t *n);

/* The seconds tenant t's tags spent paused since the broker started (its
 * ended sessions' and the paused now, up to now). */
double gmb__sleep_tenant_seconds(const struct gmb_tenant *t, uint64_t now);

/* s's paused tags, "a,b,c", cut to fit cap (ending "..." when cut). */
void gmb__sleep_session_paused(const struct gmb_session *s, char *buf,
                               size_t cap);

/* The names of tenant t's paused tags (its sessions' records, the
 * broker's own included), each once and in byte order, the first `max` of
 * them in names[] (pointers into the records, valid until the next
 * request); *found (when tag is not NULL): whether some record is named
 * tag.  Sorting rather than searching the list for each record keeps the
 * cost O(r log r) in the tenant's records: a tenant of 1,024 sessions with
 * 64 paused tags each cannot make a status read search 256 names 65,536
 * times.  The count listed, or GMB_E_SYSTEM (out of host memory). */
int gmb__sleep_tenant_tags(const struct gmb_tenant *t, const char **names,
                           size_t max, const char *tag, int *found);

/* The number of broken invariants of the sums (above). */
int gmb__sleep_check(struct gmb_broker *b);

#endif /* GMB_SLEEP_H */
