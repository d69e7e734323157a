/*
 * tenant.h - the tenants: named parties with a quota, a reservation, a
 * priority, the uids (or token) that may act as them, and the arena of the
 * pool that holds their memory.
 *
 * The registry owns every tenant.  A tenant named in the config exists from
 * the start; any other is created on first use, owned by the uid that
 * connected first, with the config's default_quota.  A default name,
 * "uid-N", is uid N's alone unless the config names it: no other uid can
 * take it first.  `used` is the sum of
 * the rounded sizes of the tenant's live allocations, always equal to what
 * its arena holds (gmb__tenant_check() verifies it against the pool), and
 * never above `quota` when the quota is set, except after an operator
 * lowered the quota below it.
 *
 * One budget per uid for tenants made by first use.  Every tenant the
 * config does not name and whose quota no operator set (an *ad-hoc*
 * tenant: uid-N, or any name a client invents) is charged, besides its own
 * quota, to its owner uid's shared budget: all of a uid's ad-hoc tenants
 * together hold at most `default_quota` (0, the default: no limit, as
 * for each of them).  Inventing names therefore never multiplies what a
 * uid may hold.  A tenant named in the config, or whose quota an
 * operator set (gmbctl quota set, the state file), is outside any budget:
 * its own quota is the whole rule.  `budget_charged` is the part of `used`
 * charged to the budget; the budget's `used` is the sum of its tenants'
 * (gmb__tenant_check verifies it).
 *
 * Identity.  A tenant that lists uids or a token hash is proved by a
 * listed uid OR by a Hello token whose SHA-256 equals `token_sha256`
 * (compared in constant time).  Only the hash is ever kept; a refusal
 * never repeats the token.  A tenant with neither belongs to the first uid
 * that used it.
 *
 * Reservations.  A tenant's `reserve` is memory the others may not take.
 * What the device can still give tenant X is the room left for new
 * segments (capacity - bytes in segments, shared by everyone) plus the
 * free space inside X's own segments (no one else can use it).  X's
 * reservation is therefore safe while
 *     capacity - in_segments >= max(0, reserve_X - segments_X)
 * (the unused part of the reservation, reserve - used, less X's free space
 * in its segments, segments - used).  For all tenants at once the room is
 * shared, so the registry keeps, in O(1) per change, the running sum
 *     short = sum over X of max(0, reserve_X - segments_X)
 * of reservations not yet backed by the tenant's own segments.  An
 * allocation by T that made T's segments grow is refused (GMB_E_NOMEM)
 * when afterwards
 *     capacity - in_segments < short - max(0, reserve_T - segments_T)
 * unless T stays within its own reservation (used_T + size <= reserve_T):
 * a tenant is never refused for another's reservation while it uses its
 * own.  An allocation that fits in T's own segments takes nothing from the
 * device and is never refused for a reservation either.
 * `segments` mirrors the bytes of the tenant's arena: the broker calls
 * gmb__tenant_segments_sync() after an allocation and
 * gmb__tenant_segment_retired() from the pool's retire callback.
 */
#ifndef GMB_TENANT_H
#define GMB_TENANT_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "config.h"
#include "pool.h"

struct gmb_session;
struct gmb_uid_budget;
struct gmb_fdhold;

/* A list of fdchan.c's records of channels holding descriptors unread
 * (opaque here; all zero is empty). */
struct gmb_fdlist {
  struct gmb_fdhold *first, *last;
  size_t n;
};

struct gmb_tenant {
  char name[64];
  uint64_t quota;    /* 0: no limit */
  uint64_t reserve;
  int priority;
  uint64_t used;     /* bytes of live allocations (rounded) */
  uint64_t retiring; /* bytes of its retired segments that its sessions
                        still map (cuda): with `used`, against its quota
                        and its uid's budget, until they close them */
  uint64_t vmm;      /* bytes its sessions made themselves through the
                        VMM API (cuMemCreate under the preload shim) and
                        reported (dispatch.c, WIRE_VMM): with `used`,
                        against its quota and its uid's budget; the sum
                        of its sessions' `vmm` */
  uint64_t peak;     /* highest `used` (+ `vmm`) since start */
  /* Free bytes between blocks in its sessions' caches' pages, as each
   * last reported (Request.cached_holes), each at most what its session
   * holds: up to holes_frac of its quota, not charged to the quota
   * (gmb__tenant_charged), as the broker's own segments' free bytes are
   * not.  holes_frac: the config's cache_holes. */
  uint64_t cache_holes;
  double holes_frac;
  uint64_t refusals_quota; /* requests refused by the quota */
  uint64_t refusals_reserve; /* refused for another tenant's reservation */
  uint64_t segment_bytes; /* bytes of its arena's segments (a mirror) */
  uint64_t waiting;  /* its requests in the wait queue (dispatch.c) */
  /* The wait queue's memo (waitq.c): in serving pass wq_pass, one of its
   * allocations of wq_small bytes (at most GMB_POOL_SMALL_MAX; 0: none), or
   * of wq_pages bytes of pages and a tail of wq_tail (wq_pages 0: none),
   * found no room, and so would any as large in that pass. */
  uint64_t wq_pass, wq_small, wq_pages, wq_tail;
  /* Its requests held for the broker's offload job (waitq.c): how many,
   * their bytes (rounded, as the quota counts them), and its links in
   * b->waitq.job_tenants while there are any. */
  size_t job_n;
  uint64_t job_bytes;
  struct gmb_tenant *job_next, *job_prev;
  /* EVENT_TRIM asks its ended sessions were sent and left unanswered
   * (their gmb_session counters, folded in as each left the tenant's
   * list), so that per-tenant totals survive sessions
   * (gmb__tenant_trim_totals adds the live ones). */
  uint64_t trim_asks_ended, trim_ignored_ended;
  uint64_t cache_asked; /* bytes its sessions were asked to give back from
                           their caches and have not answered yet
                           (reclaim.c: the sum of their ask_bytes) */
  /* Asks of its sessions that fell short in a row, whichever session
   * (reclaim.c), and the moment before which none of its sessions is
   * asked: a tenant's sessions are one party, and a pause of the session
   * alone would let each of many sessions ignore an ask in turn. */
  uint32_t ask_short_run;
  uint64_t ask_skip_ns;
  /* Sleep and wake (sleep.h): the bound on host bytes of its paused tags
   * (0: none), their sums over its sessions now, and totals since start
   * (paused_ns: of tags resumed or ended; sleep_asks: EVENT_SLEEP asks). */
  uint64_t host_quota;
  int host_quota_default; /* host_quota is the config's default_host_quota
                             (a tenant the config does not name), and
                             follows it at reload */
  uint64_t host_bytes, paused_bytes, paused_tags;
  uint64_t pauses, resumes, paused_ns, sleep_asks;
  /* An operator's pause of its movable allocations still running, a
   * slice a loop turn (offload.h), and what it offloaded so far. */
  int offl_pausing;
  uint32_t offl_pause_n;
  uint64_t offl_pause_bytes;
  int configured;    /* named in the config */
  uid_t uids[GMB_CONFIG_UIDS_MAX];
  size_t n_uids;     /* 0 and !has_token: bound to owner_uid on first use */
  int has_token;
  uint8_t token_sha256[32]; /* only the hash: the token is never kept */
  int has_owner;
  uid_t owner_uid;   /* the first uid that connected, for unbound tenants */
  int made_counted;  /* counted as made by owner_uid's first use
                        (max_tenants_per_uid): gmb__tenant_owner_sync */
  uid_t made_uid;    /* the uid it is counted for */
  /* In the registry's list of tenants that may have gone idle since the
   * last reap (gmb__tenant_may_idle). */
  struct gmb_tenant *idle_next, *idle_prev;
  int idle_listed;
  int quota_set;     /* an operator set its quota (not the default) */
  int added;         /* made at run time by the admin socket (tenant add):
                        kept, idle or not, until removed */
  int removing;      /* a removal was asked: it admits no new session and
                        goes once its sessions ended (gmb__tenant_idle) */
  /* Revocation (defrag.c): segments a revoked process mapped are sealed
   * and their live bytes move out.  revoke_wait: the last pass left
   * locked allocations, tried again at the next timer; the totals are
   * this revocation's. */
  int revoking, revoke_wait;
  /* Ended sessions whose memory is freed in slices (core.c): how many,
   * the bytes they still hold (in `used`), and where the walk of the
   * arena goes on (a segment id; 0: from the start). */
  unsigned reaping;
  uint64_t reaping_bytes, reap_cursor;
  uint64_t reap_pass_freed; /* bytes the walk freed since it last began */
  uint64_t revoke_since_ns, revoke_moves, revoke_bytes;
  /* Its owner uid's shared budget while it is ad-hoc (tenant.h, above);
   * NULL otherwise.  budget_charged: the bytes of `used` charged to it. */
  struct gmb_uid_budget *budget;
  uint64_t budget_charged;
  struct gmb_arena *arena;
  unsigned n_sessions;
  struct gmb_session *sessions; /* list through gmb_session.tenant_next */
  /* The descriptor channel's account of it (fdchan.c): descriptors sent
   * on its sessions' channels and on the channels kept for its ended
   * sessions and not seen read, how many channels are kept (each names
   * the tenant: it is not idle while one is), the sends refused at its
   * bound since start, and the channels that hold some (fdchan.c's list;
   * all zero is an empty list). */
  uint64_t fd_unread, fd_refused;
  unsigned fd_kept;
  struct gmb_fdlist fd_holds;
};

struct gmb_tenants;

/* Builds the registry with a tenant per config section.  NULL on ENOMEM. */
struct gmb_tenants *gmb__tenants_new(struct gmb_pool *pool,
                                     const struct gmb_config *cfg);
/* Frees every tenant and its arena.  Accepts NULL. */
void gmb__tenants_destroy(struct gmb_tenants *ts);

struct gmb_tenant *gmb__tenant_find(struct gmb_tenants *ts, const char *name);

/* The tenant `name`, created when new with the default quota and no
 * owner (the first uid that connects as it owns it, unless the caller
 * gives it uids or a token): for the config at reload and the state file,
 * which name tenants no session asked for.  NULL when the registry is full
 * or out of memory. */
struct gmb_tenant *gmb__tenant_create(struct gmb_tenants *ts,
                                      const char *name);

/*
 * Finds or creates the tenant `name` for a session of uid `uid` that sent
 * `token` (may be empty), and checks that the uid or token may act as it:
 * a listed uid, or a token whose SHA-256 is the tenant's token_sha256.
 * Returns 0 with *out set, GMB_E_INVAL for a bad name, GMB_E_AUTH with a
 * reason in `why` (which never contains the token), GMB_E_LIMIT when too
 * many tenants exist or uid made max_tenants_per_uid by first use already
 * (its own default name uid-UID never counts).  The token is hashed and forgotten.
 */
int gmb__tenant_admit(struct gmb_tenants *ts, const char *name, uid_t uid,
                      const uint8_t *token, size_t token_len,
                      struct gmb_tenant **out, char *why, size_t whycap);

/* t's `configured` or owner changed outside this module (a reload):
 * counts it again among the tenants its owner made by first use, which a
 * Hello reads in O(log uids) instead of walking every tenant. */
void gmb__tenant_owner_sync(struct gmb_tenants *ts, struct gmb_tenant *t);

/* Gives tenant t, which proves no one and has no owner yet (one the state
 * file made), to `uid` as its first use would: from now on only that uid
 * may act as it. */
void gmb__tenant_set_owner(struct gmb_tenants *ts, struct gmb_tenant *t,
                           uid_t uid);

/* 1 when uid is one of t's configured uids. */
int gmb__tenant_uid_listed(const struct gmb_tenant *t, uid_t uid);
/* 1 with *uid set when `name` is a default tenant's name, "uid-N" (N in
 * canonical decimal): that name is uid N's alone unless the config names
 * it (gmb__tenant_admit). */
int gmb__tenant_default_uid(const char *name, uid_t *uid);

/* The bytes all of one uid's ad-hoc tenants may hold together:
 * default_quota (0: no limit). */
uint64_t gmb__tenants_uid_budget(const struct gmb_tenants *ts);
/* What t's uid budget holds now (0 with *limit 0 when t has none). */
uint64_t gmb__tenant_budget_used(const struct gmb_tenant *t, uint64_t *limit);

/* Why `size` more bytes pass t's quota or its uid's shared budget, for a
 * GMB_E_QUOTA reply ("tenant T: N more would pass ..."). */
void gmb__tenant_quota_why(const struct gmb_tenant *t, uint64_t size,
                           char *why, size_t whycap);

/* 1 when `size` more bytes would pass t's quota (0: no limit) or its
 * uid's shared budget (an ad-hoc tenant's), without
 * counting a refusal: for a request held while its tenant's other caches
 * are asked back (reclaim.h), which is tried again as memory comes back
 * and counted as refused only once, when it is answered so. */
int gmb__tenant_over(const struct gmb_tenant *t, uint64_t size);
/* 0 when `size` more bytes fit the tenant's quota, else GMB_E_QUOTA (and
 * the refusal is counted). */
int gmb__tenant_fits(struct gmb_tenant *t, uint64_t size);
/* Charges `size` bytes of a new allocation: 0, or GMB_E_QUOTA with nothing
 * charged.  The broker asks gmb__tenant_fits() before the pool, and charges
 * once the pool said yes, so `used` and `peak` only ever count memory that
 * was really handed out. */
int gmb__tenant_charge(struct gmb_tenant *t, uint64_t size);
/* Gives back `size` bytes charged before. */
void gmb__tenant_uncharge(struct gmb_tenant *t, uint64_t size);

/* Sets the quota (0: no limit).  Memory already held above a lowered
 * quota stays; new requests are refused until usage falls below it. */
void gmb__tenant_set_quota(struct gmb_tenants *ts, struct gmb_tenant *t,
                           uint64_t quota);
/* Sets the reservation and updates the registry's sum of unbacked
 * reservations.  It does not check it against the quota or the device:
 * the caller (config, admin) does. */
void gmb__tenant_set_reserve(struct gmb_tenants *ts, struct gmb_tenant *t,
                             uint64_t reserve);

/* Re-reads the bytes of segments of t's arena (after an allocation, which
 * may have made a segment). */
void gmb__tenant_segments_sync(struct gmb_tenants *ts, struct gmb_tenant *t);
/* A segment of `bytes` of t's arena is about to go back to the device
 * (the pool's retire callback, which runs before the pool's accounting). */
void gmb__tenant_segment_retired(struct gmb_tenants *ts, struct gmb_tenant *t,
                                 uint64_t bytes);

/* The VMM bytes of t's sessions (gmb_tenant.vmm): `delta` more (the
 * caller checked gmb__tenant_fits first) or fewer. */
void gmb__tenant_vmm(struct gmb_tenant *t, int64_t delta);

/* Bytes of t's retired segments that its sessions still map (the
 * device's retire_note): `delta` more (parked) or fewer (freed at last);
 * they count against its quota and its uid's budget. */
void gmb__tenant_retiring(struct gmb_tenant *t, int64_t delta);

/* 1 when `size` more bytes keep t within its own reservation. */
int gmb__tenant_within_reserve(const struct gmb_tenant *t, uint64_t size);

/*
 * The reservation rule, asked after t's allocation of `size` bytes made
 * its segments grow (t->segment_bytes already counts the new segment; `size`
 * is not charged yet).  `room` is capacity - bytes in segments, now.
 * 0 when the others' reservations are still safe (or t is within its own),
 * else GMB_E_NOMEM with why = "... would eat into tenant X's reservation
 * of N, of which M still unused" (and the refusal is counted).  O(1) when
 * allowed; a refusal looks for the tenant to name.
 */
int gmb__tenant_reserve_allows(struct gmb_tenants *ts, struct gmb_tenant *t,
                               uint64_t size, uint64_t room, char *why,
                               size_t whycap);

/* How many tenants have a reservation now.  O(1). */
size_t gmb__tenants_reserving(const struct gmb_tenants *ts);

/* Sum over tenants of max(0, reserve - segments): reserved bytes that
 * must still come from the device's room. */
uint64_t gmb__tenants_reserve_short(const struct gmb_tenants *ts);

/*
 * Start-up (and reload) check: GMB_E_INVAL, with a message, when the
 * reservations add up to more than `capacity` (they cannot all be kept:
 * the first tenants to use theirs win), else 0.  The broker warns and
 * runs on.
 */
int gmb__tenants_check_reservations(struct gmb_tenants *ts, uint64_t capacity,
                                    char *msg, size_t cap);

/* What of t's bytes counts against its quota: in use, retiring and VMM,
 * less its caches' holes up to holes_frac of the quota (above). */
uint64_t gmb__tenant_charged(const struct gmb_tenant *t);

/* Of t's caches' holes, the bytes not charged (at most holes_frac of the
 * quota; 0 without a quota). */
uint64_t gmb__tenant_holes_uncharged(const struct gmb_tenant *t);

/* Session report: the session's holes figure *mine becomes `reported`
 * (at most `held`, what the session holds), and t's sum with it. */
void gmb__tenant_holes_heard(struct gmb_tenant *t, uint64_t *mine,
                             uint64_t reported, uint64_t held);

/* The session now holds `held` bytes, fewer than before (a Free, the
 * broker's offload): its holes figure *mine stays at most that until its
 * next report, and t's sum with it.  Holes a session no longer holds
 * would be forgiven to its tenant's other sessions. */
void gmb__tenant_holes_held(struct gmb_tenant *t, uint64_t *mine,
                            uint64_t held);

/* Takes the limits a reload may change (max_tenants_per_uid,
 * cache_holes, default_host_quota: the tenants that have it take the new
 * one). */
void gmb__tenants_set_limits(struct gmb_tenants *ts,
                             const struct gmb_config *cfg);

/* 1 when t was made by first use (not configured, not added) and holds
 * nothing: no session, no allocation, no waiter, and no limit an operator
 * set (its quota is the default, no reservation, priority 0).  `named` 0:
 * only a default tenant (uid-N) counts, which loses nothing by going (its
 * name is its uid's anyway, and the next session makes it again, the
 * same); 1: any, which loses the first uid's ownership of its name.  A
 * tenant whose removal was asked (`removing`) is idle, whatever its
 * limits, once it has no session, allocation or waiter. */
int gmb__tenant_idle(const struct gmb_tenants *ts, const struct gmb_tenant *t,
                     int named);
/* Removes idle tenant t (gmb__tenant_idle): its reservation ends, its
 * arena's empty segments go back to the device, and t is freed. */
void gmb__tenant_remove(struct gmb_tenants *ts, struct gmb_tenant *t);

/* Removes every idle tenant (gmb__tenant_idle with `named`); returns how
 * many.  O(tenants). */
size_t gmb__tenants_reap(struct gmb_tenants *ts, int named);

/* t may have gone idle (a session ended, its memory freed, an operator's
 * limit set back): the next gmb__tenants_reap_listed looks at it.  The
 * registry lists t itself when its quota, reservation or `configured`
 * changes through it. */
void gmb__tenant_may_idle(struct gmb_tenants *ts, struct gmb_tenant *t);

/* Removes the listed tenants that are idle (gmb__tenant_idle, not named)
 * and empties the list; returns how many went.  O(listed), not
 * O(tenants): this runs after every session's end. */
size_t gmb__tenants_reap_listed(struct gmb_tenants *ts);

/* Tenants gmb__tenants_reap_listed looked at, since start. */
uint64_t gmb__tenants_reap_visits(const struct gmb_tenants *ts);

/* Visits the tenants in name order; stops when fn returns non-zero. */
int gmb__tenants_each(struct gmb_tenants *ts,
                      int (*fn)(void *ctx, struct gmb_tenant *t), void *ctx);
size_t gmb__tenants_count(const struct gmb_tenants *ts);

/* Lookups of a uid's count of tenants made by first use, since start
 * (a Hello that would make a tenant does one). */
uint64_t gmb__tenants_made_lookups(const struct gmb_tenants *ts);
/* 1 when the registry holds as many tenants as it may (4096). */
int gmb__tenants_full(const struct gmb_tenants *ts);

/* Number of broken invariants: `used` and `segments` of each tenant
 * against its arena, `peak` >= `used`, and the sum of unbacked
 * reservations against a recount. */
int gmb__tenant_check(struct gmb_tenants *ts);

#endif /* GMB_TENANT_H */
