/*
 * core.h - the broker's life cycle: what it is made of at start-up, how a
 * session ends, the consistency checks, and the clean stop.
 *
 * Ending a session is the one place where a client's memory is taken back
 * without its asking: it runs when the process dies, says Bye, stops
 * heartbeating, is evicted, or the broker stops.  It touches every layer
 * below (wait queue, compaction, pool, tenant, lock table, device), which
 * is why it lives here, above the services, rather than in session.c.
 */
#ifndef GMB_CORE_H
#define GMB_CORE_H

#include <stddef.h>

#include "broker.h"
#include "session.h"

/*
 * Opens b->cfg's device and makes the pool, the tenants, the session table
 * and the metrics counters.  0, or a GMB_E_* code with a one-line reason in
 * err (GMB_E_INVAL: the device spec is wrong).  On failure what was made is
 * left for gmb__core_close.
 */
int gmb__core_open(struct gmb_broker *b, char *err, size_t errcap);

/* Ends every session, then frees the tenants, the pool, the device, the
 * counters and the state file's table.  From here on nothing is sent
 * (b->closing): not the answers of waiters that the freed memory would
 * serve, nor retirement events.  Safe on a partly opened broker. */
void gmb__core_close(struct gmb_broker *b);

/* Ends session s: drops its waiters, stops moving its memory, frees its
 * allocations (counted back to its tenant), destroys its lock table,
 * releases its holds on retired segments, and serves the wait queue when
 * memory came back.  `why` is logged.  s is freed. */
void gmb__core_session_end(struct gmb_broker *b, struct gmb_session *s,
                           const char *why);

/*
 * Ends session s as gmb__core_session_end does, but frees its memory in
 * slices (gmb__core_reap_step): for a process that died, said Bye or
 * stopped heartbeating, so that one holding hundreds of thousands of
 * allocations (or many sessions ending at once) never stalls the loop.
 * At once: its waiters, asks and moves are dropped, its lock table goes
 * (nothing can claim or move its allocations), it leaves the table and
 * its tenant's list (no message or event reaches it).  Its bytes stay
 * counted against its tenant (t->reaping_bytes, within t->used) until
 * freed.  A session that holds nothing, one whose tenant holds few
 * allocations (half a slice: the walk is short), and any while the broker
 * stops, ends at once.  Not for evictions and revocations: those free at once,
 * so that no segment a removed process mapped lingers for the tenant.
 */
void gmb__core_session_end_sliced(struct gmb_broker *b, struct gmb_session *s,
                                  const char *why);
/* Frees ended sessions' memory until `deadline_ns` (at least one slice of
 * GMB_CORE_REAP_RANGES ranges), oldest first, and frees the sessions that
 * hold nothing any more; serves the wait queue when memory came back.
 * Returns 1 while ended sessions still hold memory. */
#ifndef GMB_CORE_REAP_RANGES
/* A fuzz build makes it 8 (mk/fuzz.mk), so that its inputs' sessions
 * reach the slices. */
#define GMB_CORE_REAP_RANGES 4096u
#endif
int gmb__core_reap_step(struct gmb_broker *b, uint64_t deadline_ns);
/* Frees at once everything tenant t's ended sessions still hold (an
 * eviction, a revocation, the broker's stop). */
void gmb__core_reap_tenant(struct gmb_broker *b, struct gmb_tenant *t);

/* Consistency checks of the pool, the tenants, each tenant's sessions
 * against it (bytes held, count) and the cache asks; returns the number of
 * violations (0: all is well). */
int gmb__core_check(struct gmb_broker *b);

/* GMB_E_INVAL with a message when the tenants' reservations add up to more
 * than the device (they cannot all be kept), else 0.  main.c asks it once
 * the state file is applied (and warns); a reload refuses a configuration
 * that fails it before anything is applied (admin.c). */
int gmb__core_reservations(struct gmb_broker *b, char *msg, size_t cap);

/* The sessions the broker admits in all: max_sessions, or fewer when
 * RLIMIT_NOFILE could not be raised far enough for them (core_open). */
uint32_t gmb__core_max_sessions(const struct gmb_broker *b);

/* Sets the connection guard's caps (connguard.h) from the sessions the
 * broker admits: max sessions plus GMB_CONN_UNNAMED connections that have
 * not said Hello yet, and per uid max_sessions_per_uid plus
 * GMB_CONN_UNNAMED_PER_UID, but never more than half of the total.  At
 * start and after a reload. */
void gmb__core_conn_limits(struct gmb_broker *b);
#define GMB_CONN_UNNAMED 64
#define GMB_CONN_UNNAMED_PER_UID 16

/*
 * How `have` descriptors (RLIMIT_NOFILE) are shared out.  Each segment
 * holds one (its memfd or exported CUDA handle), each session
 * GMB_FDS_PER_SESSION, and the rest of the broker up to GMB_FDS_RESERVED
 * (a quarter of `have` when that is less).  When everything fits, every
 * configured session is admitted and segments are not capped (*seg_max
 * 0).  Otherwise sessions get what the worst case of `segs` segments
 * leaves, but never less than half of what is left after the reserve, and
 * segments are capped at the remainder: a broker under a low limit
 * (docker's 1024) serves fewer, smaller jobs instead of one.  Pure, for
 * the tests; the sum never exceeds `have` when `have` is at least 16.
 */
void gmb__core_fd_split(uint64_t have, uint64_t segs, uint32_t max_sessions,
                        uint32_t *sessions, uint64_t *seg_max);

/* Removes the tenants made by first use that are idle now
 * (gmb__tenant_idle): with `named` 0 the default ones (uid-N), when a
 * session's end made some so; with `named` 1 every idle one (the registry
 * is full).  The loop calls it between messages, never while a compaction
 * run or an admin request may name a tenant.  Returns how many went. */
size_t gmb__core_reap(struct gmb_broker *b, int named);

/* The registry is full (a Hello would be refused): gmb__core_reap(b, 1)
 * when a tenant may have gone idle since the last such walk, or while this
 * second has had fewer than GMB_REAP_FULL_WALKS (broker.h); else nothing.
 * Returns how many tenants went. */
size_t gmb__core_reap_full(struct gmb_broker *b);

#endif /* GMB_CORE_H */
