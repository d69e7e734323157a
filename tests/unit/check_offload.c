/*
 * check_offload.c - broker/offload.c driven through the dispatcher with the
 * broker fixture (no sockets): a request of a higher priority that finds
 * the device full takes an idle, opted-in session's unlocked movable
 * allocations to the broker's host memory (whole segments, bytes kept),
 * and a Lock brings one back with the caller's hold and every byte (and
 * the session's others with it while there is room); the
 * host bounds (host_quota, offload_host_max); a locked allocation stays;
 * nobody is offloaded for a lower priority or without an offer; Free and
 * the session's end while offloaded give everything back; a Lock without
 * room waits in the queue and is served when room comes, or is refused at
 * once without a wait; operators' pause and resume.  A hostile client:
 * state bits written into its lock table (on the device, offloaded, in
 * slots it was never given), Locks of ids not its own, freed or flooded,
 * Free and the session's end while its Lock waits, sleep_idle from a busy
 * session; host memory, copies and sleep records that fail, and chunks
 * freed out of order: a segment goes all or nothing, nothing is lost, and
 * every sum comes back to zero.  The offload job (a request lacking more
 * than a slice, GMB_OFFLOAD_SLICE, is held while the loop's turns make
 * the rest; the tests drive the turns): other tenants' requests answered
 * between slices, two requesters both served, a lock mid-job honoured,
 * the requester's end, a job that cannot finish, and one that lets its
 * request go on to asks to pause tags, at a slice that can make nothing
 * more or at its bound; the room the job makes fenced from a stream of
 * other requests, passed by a higher priority and lifted when the job
 * lets go; a turn that reads the job's sums rather than walk its
 * requests; an operator's pause in slices, others answered between them,
 * taking turns with a job.  The fixture runs the
 * consistency checks (gmb__offload_check and the pool's among them) after
 * every request.
 */
#include <inttypes.h>
#include <check.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "admin.h"
#include "broker_fixture.h"
#include "check_main.h"
#include "defrag.h"
#include "observe.h"
#include "offload.h"
#include "sleep.h"
#include "tenant.h"
#include "reclaim.h"
#include "util.h"
#include "waitq.h"

#define MIB GMB_MIB
#define NA 8 /* movable allocations of 1 MiB of session "a": 4 segments */

#define INI_LOW_HIGH(extra_broker, extra_low)             \
  "[broker]\ncompaction = off\n" extra_broker               \
  "[tenant:low]\nuids = 1001\npriority = 0\n" extra_low    \
  "[tenant:high]\nuids = 1002\npriority = 10\n"

/* The bytes of pool allocation `id` in the host device's mapping. */
static uint8_t *bytes_of(struct fx *f, uint64_t id) {
  struct gmb_alloc_info info;
  ck_assert_int_eq(gmb__pool_find(f->b.pool, id, &info), 0);
  return (uint8_t *)info.dseg->host + info.offset;
}

/* A Heartbeat from `rid` offering `pausable` bytes, idle for `idle_ms`
 * (its session made at least that long ago). */
static void offer(struct fx *f, const char *rid, uid_t uid, uint64_t pausable,
                  uint64_t idle_ms) {
  fx_age(gmb__session_find(f->b.sessions, (const uint8_t *)rid, strlen(rid)),
         idle_ms);
  struct wire_request req;
  memset(&req, 0, sizeof req);
  req.kind = WIRE_HEARTBEAT;
  req.sleep_pausable = pausable;
  req.sleep_idle_ms = idle_ms;
  struct wire_reply rep;
  ck_assert_int_eq(fx_request(f, rid, uid, &req, &rep), 0);
}

/* A Lock request of `rid` for `id`; returns the answer-now flag. */
static int lock(struct fx *f, const char *rid, uid_t uid, uint64_t id,
                int timeout_ms, struct wire_reply *rep) {
  struct wire_request req;
  memset(&req, 0, sizeof req);
  req.kind = WIRE_LOCK;
  req.u.lock.id = id;
  req.u.lock.timeout_ms = timeout_ms;
  return fx_request(f, rid, uid, &req, rep);
}

struct scene {
  struct fx f;
  struct gmb_session *a, *b;
  struct gmb__lt_header *lt; /* a's lock table, as its client maps it */
  uint64_t id[NA];
  uint32_t slot[NA];
};

/* The lock-table word of a's allocation i. */
static _Atomic uint32_t *state_of(struct scene *sc, int i) {
  return &gmb__lt_slots(sc->lt)[sc->slot[i]].state;
}

/* A 16 MiB device: "a" (tenant low) holds NA movable MiB with a pattern
 * and offers to sleep (idle 5 s); "b" (tenant high) holds 8 MiB pinned. */
static void scene_open(struct scene *sc, const char *ini, int offering) {
  memset(sc, 0, sizeof *sc);
  fx_open_ini(&sc->f, "host:16MiB", ini);
  sc->a = fx_hello(&sc->f, "a", 1001, "low");
  sc->b = fx_hello(&sc->f, "b", 1002, "high");
  for (int i = 0; i < NA; i++) {
    struct wire_reply rep = fx_must_alloc(&sc->f, "a", 1001, MIB, GMB_MOVABLE);
    sc->id[i] = rep.u.alloc.id;
    sc->slot[i] = rep.u.alloc.slot;
    memset(bytes_of(&sc->f, sc->id[i]), 0x40 + i, MIB);
  }
  fx_must_alloc(&sc->f, "b", 1002, 8 * MIB, 0);
  sc->lt = fx_map_locktab(sc->a);
  if (offering) offer(&sc->f, "a", 1001, 1, 5000);
}

static void scene_close(struct scene *sc) {
  fx_unmap_locktab(sc->lt);
  fx_close(&sc->f);
}

static int offloaded(struct scene *sc) {
  int n = 0;
  for (int i = 0; i < NA; i++)
    n += atomic_load(state_of(sc, i)) == GMB_LT_OFFLOADED;
  return n;
}

/* The indexes of a's offloaded allocations in away[NA]; returns how
 * many. */
static int offloaded_list(struct scene *sc, int *away) {
  int n = 0;
  for (int i = 0; i < NA; i++)
    if (atomic_load(state_of(sc, i)) == GMB_LT_OFFLOADED) away[n++] = i;
  return n;
}

/* a's allocation i, brought back or not, still holds its pattern. */
static void assert_pattern(struct scene *sc, int i) {
  uint64_t now;
  ck_assert_int_ne(gmb__offload_resolve(sc->a, sc->id[i], &now, NULL),
                   GMB_OFFL_AWAY);
  const uint8_t *p = bytes_of(&sc->f, now);
  for (size_t k = 0; k < MIB; k++)
    if (p[k] != (uint8_t)(0x40 + i))
      ck_abort_msg("allocation %d byte %zu is %#x", i, k, p[k]);
}

/* An allocation of `size` pinned bytes by `rid` that does not wait:
 * answered at once; returns its status, *id (may be NULL) its id. */
static int ask(struct scene *sc, const char *rid, uid_t uid, uint64_t size,
               uint64_t *id) {
  struct wire_reply rep;
  ck_assert_int_eq(fx_alloc(&sc->f, rid, uid, size, 0, 0, &rep), 1);
  if (id) *id = rep.u.alloc.id;
  return rep.status;
}

/* The scene with b's 4 MiB taken from a's offloaded segments: *big b's
 * allocation, away[] the indexes of a's four offloaded ones. */
static void scene_offloaded(struct scene *sc, uint64_t *big, int *away) {
  scene_open(sc, INI_LOW_HIGH("", ""), 1);
  ck_assert_int_eq(ask(sc, "b", 1002, 4 * MIB, big), 0);
  ck_assert_int_eq(offloaded_list(sc, away), 4);
}

START_TEST(offload_then_lock_brings_back) {
  struct scene sc;
  scene_open(&sc, INI_LOW_HIGH("", ""), 1);
  struct fx *f = &sc.f;
  struct gmb_tenant *low = fx_tenant(f, "low");
  /* The device is full: 4 MiB for "b" takes two of a's segments. */
  struct wire_reply rep;
  uint64_t big;
  ck_assert_int_eq(ask(&sc, "b", 1002, 4 * MIB, &big), 0);
  ck_assert_int_eq(offloaded(&sc), 4);
  ck_assert_uint_eq(low->used, 4 * MIB);
  ck_assert_uint_eq(low->host_bytes, 4 * MIB);
  ck_assert_uint_eq(low->paused_bytes, 4 * MIB);
  ck_assert_uint_eq(f->b.offload.host_bytes, 4 * MIB);
  /* The four copies share one chunk of host memory. */
  ck_assert_ptr_nonnull(f->b.offload.chunk);
  ck_assert_uint_ge(f->b.offload.chunk_bytes, 4 * MIB);
  ck_assert_uint_le(f->b.offload.chunk_bytes, 32 * MIB);
  ck_assert_uint_eq(f->b.offload.offloads, 4);
  ck_assert_str_eq(sc.a->paused->tag, GMB_SLEEP_MOVABLE_TAG);
  /* b gives 4 MiB back; every offloaded one is locked back, byte for
   * byte, held for the caller (state 1). */
  ck_assert_int_eq(fx_free(f, "b", 1002, big), 0);
  for (int i = 0; i < NA; i++) {
    if (atomic_load(state_of(&sc, i)) != GMB_LT_OFFLOADED) continue;
    ck_assert_int_eq(lock(f, "a", 1001, sc.id[i], 0, &rep), 1);
    ck_assert_msg(rep.status == 0, "lock: %s", rep.message);
    ck_assert_int_eq(rep.kind, WIRE_LOCK);
    ck_assert_int_eq(rep.u.lock.held, 1);
    ck_assert_uint_eq(atomic_load(state_of(&sc, i)), 1);
    struct gmb__lt_slot *sl = &gmb__lt_slots(sc.lt)[sc.slot[i]];
    ck_assert_uint_eq(sl->segment, rep.u.lock.segment);
    ck_assert_uint_eq(sl->offset, rep.u.lock.offset);
    ck_assert_uint_eq(sl->id, sc.id[i]); /* the client's id stays */
    /* The session is active again: the others came back with it,
     * unlocked, while there was room. */
    ck_assert_int_eq(offloaded(&sc), 0);
    atomic_store(state_of(&sc, i), 0); /* its gmb_unlock */
    /* Not offloaded any more: a second Lock says so. */
    ck_assert_int_eq(lock(f, "a", 1001, sc.id[i], 0, &rep), 1);
    ck_assert_int_eq(rep.status, 0);
    ck_assert_int_eq(rep.u.lock.held, 0);
  }
  for (int i = 0; i < NA; i++) {
    uint64_t now;
    gmb__offload_resolve(sc.a, sc.id[i], &now, NULL);
    const uint8_t *p = bytes_of(f, now);
    for (size_t k = 0; k < MIB; k++)
      if (p[k] != (uint8_t)(0x40 + i))
        ck_abort_msg("allocation %d byte %zu is %#x", i, k, p[k]);
    ck_assert_uint_eq(atomic_load(state_of(&sc, i)), 0);
  }
  ck_assert_uint_eq(low->used, NA * MIB);
  ck_assert_uint_eq(low->host_bytes, 0);
  ck_assert_uint_eq(f->b.offload.chunk_bytes, 0); /* its last copy went */
  ck_assert_ptr_null(f->b.offload.chunk);
  ck_assert_ptr_null(sc.a->paused);
  ck_assert_uint_eq(f->b.offload.restores, 4);
  /* Brought back under new pool ids, freed by the client's ids. */
  for (int i = 0; i < NA; i++)
    ck_assert_int_eq(fx_free(f, "a", 1001, sc.id[i]), 0);
  ck_assert_uint_eq(low->used, 0);
  ck_assert_int_eq(fx_free(f, "a", 1001, sc.id[0]), GMB_E_NOENT);
  scene_close(&sc);
}
END_TEST

/* Two idle sessions of one tenant whose allocations share segments: a
 * segment empties only when both are taken, and both may be. */
START_TEST(sessions_of_a_tenant_share_segments) {
  struct fx f;
  fx_open_ini(&f, "host:16MiB", INI_LOW_HIGH("", ""));
  fx_hello(&f, "a", 1001, "low");
  fx_hello(&f, "c", 1001, "low");
  fx_hello(&f, "b", 1002, "high");
  for (int i = 0; i < NA; i++)
    fx_must_alloc(&f, i % 2 ? "c" : "a", 1001, MIB, GMB_MOVABLE);
  fx_must_alloc(&f, "b", 1002, 8 * MIB, 0);
  offer(&f, "a", 1001, 1, 5000);
  struct wire_reply rep;
  /* Only one of them offers: no segment can be emptied. */
  ck_assert_int_eq(fx_alloc(&f, "b", 1002, 2 * MIB, 0, 0, &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_NOMEM);
  ck_assert_uint_eq(f.b.offload.host_bytes, 0);
  offer(&f, "c", 1001, 1, 5000);
  ck_assert_int_eq(fx_alloc(&f, "b", 1002, 2 * MIB, 0, 0, &rep), 1);
  ck_assert_msg(rep.status == 0, "b refused: %s", rep.message);
  ck_assert_uint_eq(f.b.offload.host_bytes, 2 * MIB);
  ck_assert_uint_eq(fx_tenant(&f, "low")->host_bytes, 2 * MIB);
  fx_close(&f);
}
END_TEST

START_TEST(free_and_end_while_offloaded) {
  struct scene sc;
  scene_open(&sc, INI_LOW_HIGH("", ""), 1);
  struct fx *f = &sc.f;
  ck_assert_int_eq(ask(&sc, "b", 1002, 4 * MIB, NULL), 0);
  ck_assert_int_eq(offloaded(&sc), 4);
  int freed = 0;
  for (int i = 0; i < NA && !freed; i++)
    if (atomic_load(state_of(&sc, i)) == GMB_LT_OFFLOADED) {
      ck_assert_int_eq(fx_free(f, "a", 1001, sc.id[i]), 0);
      ck_assert_uint_eq(gmb__lt_slots(sc.lt)[sc.slot[i]].id, 0);
      freed = 1;
    }
  ck_assert_uint_eq(f->b.offload.host_bytes, 3 * MIB);
  ck_assert_uint_eq(fx_tenant(f, "low")->host_bytes, 3 * MIB);
  ck_assert_uint_ge(f->b.offload.chunk_bytes, 4 * MIB); /* a gap in it */
  /* The session ends with three still offloaded: all reclaimed. */
  fx_end(f, sc.a);
  ck_assert_uint_eq(f->b.offload.host_bytes, 0);
  ck_assert_uint_eq(f->b.offload.chunk_bytes, 0);
  ck_assert_uint_eq(f->b.offload.held, 0);
  ck_assert_uint_eq(fx_tenant(f, "low")->host_bytes, 0);
  ck_assert_uint_eq(fx_tenant(f, "low")->used, 0);
  scene_close(&sc);
}
END_TEST

/* host_quota 1 MiB: the first of a segment's two goes, the second would
 * pass it, so no segment empties and the request is refused; the broker
 * never holds more than the quota. */
START_TEST(host_quota_bounds) {
  struct scene sc;
  scene_open(&sc, INI_LOW_HIGH("", "host_quota = 1MiB\n"), 1);
  ck_assert_int_eq(ask(&sc, "b", 1002, 4 * MIB, NULL), GMB_E_NOMEM);
  ck_assert_uint_le(fx_tenant(&sc.f, "low")->host_bytes, MIB);
  ck_assert_uint_le(sc.f.b.offload.host_bytes, MIB);
  ck_assert_uint_ge(sc.f.b.offload.refused, 1);
  scene_close(&sc);
}
END_TEST

/* A session that reported every byte it holds as holes, then had half of
 * it offloaded by the broker before its next report: its holes follow
 * what it holds down (the check after each request counts a session whose
 * holes pass what it holds). */
START_TEST(offload_brings_holes_down) {
  struct scene sc;
  scene_open(&sc, INI_LOW_HIGH("cache_holes = 1\n", "quota = 16MiB\n"), 0);
  struct wire_request req;
  memset(&req, 0, sizeof req);
  req.kind = WIRE_HEARTBEAT;
  req.sleep_pausable = 1;
  req.sleep_idle_ms = 5000;
  req.cached_holes = UINT64_MAX;
  struct wire_reply rep;
  ck_assert_int_eq(fx_request(&sc.f, "a", 1001, &req, &rep), 0);
  ck_assert_uint_eq(sc.a->cached_holes, NA * MIB);
  ck_assert_int_eq(ask(&sc, "b", 1002, 4 * MIB, NULL), 0);
  ck_assert_int_eq(offloaded(&sc), 4);
  ck_assert_uint_eq(sc.a->used, (NA - 4) * MIB);
  ck_assert_uint_eq(sc.a->cached_holes, (NA - 4) * MIB);
  ck_assert_uint_eq(fx_tenant(&sc.f, "low")->cache_holes, (NA - 4) * MIB);
  scene_close(&sc);
}
END_TEST

START_TEST(broker_bound) {
  struct scene sc;
  scene_open(&sc, INI_LOW_HIGH("offload_host_max = 2MiB\n", ""), 1);
  /* One segment's worth: 2 MiB for b fits the bound. */
  ck_assert_int_eq(ask(&sc, "b", 1002, 2 * MIB, NULL), 0);
  ck_assert_uint_eq(sc.f.b.offload.host_bytes, 2 * MIB);
  /* Two more would pass it. */
  ck_assert_int_eq(ask(&sc, "b", 1002, 2 * MIB, NULL), GMB_E_NOMEM);
  ck_assert_uint_eq(sc.f.b.offload.host_bytes, 2 * MIB);
  /* The chunk was cut to the bound: the host memory held stays in it. */
  ck_assert_uint_le(sc.f.b.offload.chunk_bytes, 2 * MIB);
  scene_close(&sc);
}
END_TEST

START_TEST(offload_off) {
  struct scene sc;
  scene_open(&sc, INI_LOW_HIGH("offload_host_max = 0\n", ""), 1);
  ck_assert_int_eq(ask(&sc, "b", 1002, 2 * MIB, NULL), GMB_E_NOMEM);
  ck_assert_int_eq(offloaded(&sc), 0);
  scene_close(&sc);
}
END_TEST

/* One lock in each of a's segments: none can be emptied. */
START_TEST(locked_stays) {
  struct scene sc;
  scene_open(&sc, INI_LOW_HIGH("", ""), 1);
  for (int i = 0; i < NA; i += 2) atomic_store(state_of(&sc, i), 1);
  ck_assert_int_eq(ask(&sc, "b", 1002, 2 * MIB, NULL), GMB_E_NOMEM);
  ck_assert_int_eq(offloaded(&sc), 0);
  for (int i = 0; i < NA; i += 2) atomic_store(state_of(&sc, i), 0);
  scene_close(&sc);
}
END_TEST

/* Without an offer, or for a requester of lower priority: nothing. */
START_TEST(only_opted_in_for_higher) {
  struct scene sc;
  scene_open(&sc, INI_LOW_HIGH("", ""), 0);
  ck_assert_int_eq(ask(&sc, "b", 1002, 2 * MIB, NULL), GMB_E_NOMEM);
  ck_assert_int_eq(offloaded(&sc), 0);
  scene_close(&sc);
  /* b offers, a (lower priority) asks: b holds pinned memory only, and
   * a's own tenant is never taken for it either. */
  scene_open(&sc, INI_LOW_HIGH("", ""), 1);
  offer(&sc.f, "b", 1002, 1, 5000);
  fx_hello(&sc.f, "a2", 1001, "low");
  ck_assert_int_eq(ask(&sc, "a2", 1001, 2 * MIB, NULL), GMB_E_NOMEM);
  ck_assert_int_eq(offloaded(&sc), 0);
  scene_close(&sc);
}
END_TEST

/* A Lock with no room waits in the queue and is served when b frees; one
 * that does not wait is refused, the allocation kept offloaded. */
START_TEST(lock_waits_for_room) {
  struct scene sc;
  scene_open(&sc, INI_LOW_HIGH("", ""), 1);
  struct fx *f = &sc.f;
  struct wire_reply rep;
  uint64_t big;
  ck_assert_int_eq(ask(&sc, "b", 1002, 4 * MIB, &big), 0);
  int i = 0;
  while (atomic_load(state_of(&sc, i)) != GMB_LT_OFFLOADED) i++;
  /* b is active (no offer), of higher priority: nothing to take. */
  ck_assert_int_eq(lock(f, "a", 1001, sc.id[i], 0, &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_NOMEM);
  ck_assert_uint_eq(atomic_load(state_of(&sc, i)), GMB_LT_OFFLOADED);
  ck_assert_uint_eq(f->b.offload.host_bytes, 4 * MIB);
  ck_assert_int_eq(lock(f, "a", 1001, sc.id[i], 2000, &rep), 0);
  ck_assert_uint_eq(sc.a->restore_id, sc.id[i]);
  /* A second Lock meanwhile is refused. */
  ck_assert_int_eq(lock(f, "a", 1001, sc.id[i], 2000, &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_INVAL);
  size_t before = f->n_sent;
  ck_assert_int_eq(fx_free(f, "b", 1002, big), 0);
  int served = 0;
  for (size_t k = before; k < f->n_sent; k++)
    if (strcmp(f->sent[k].rid, "a") == 0 && f->sent[k].rep.kind == WIRE_LOCK) {
      ck_assert_int_eq(f->sent[k].rep.status, 0);
      ck_assert_int_eq(f->sent[k].rep.u.lock.held, 1);
      served = 1;
    }
  ck_assert_msg(served, "the held Lock was not answered");
  ck_assert_uint_eq(sc.a->restore_id, 0);
  ck_assert_uint_eq(atomic_load(state_of(&sc, i)), 1);
  /* The queue served it and nobody else waits: the others came back with
   * it, as after a Lock that did not wait. */
  ck_assert_int_eq(offloaded(&sc), 0);
  ck_assert_uint_eq(f->b.offload.host_bytes, 0);
  atomic_store(state_of(&sc, i), 0);
  for (int k = 0; k < NA; k++) assert_pattern(&sc, k);
  scene_close(&sc);
}
END_TEST

START_TEST(operator_pause_resume) {
  struct scene sc;
  scene_open(&sc, INI_LOW_HIGH("", ""), 0);
  struct fx *f = &sc.f;
  atomic_store(state_of(&sc, 3), 1); /* locked: stays */
  struct wire_request req;
  memset(&req, 0, sizeof req);
  req.kind = WIRE_ADMIN_PAUSE;
  snprintf(req.u.admin_pause.tenant, sizeof req.u.admin_pause.tenant, "low");
  struct gmb_peer p = fx_peer("ctl", geteuid());
  struct wire_reply rep;
  ck_assert_int_eq(gmb__admin(&f->b, &p, &req, &rep), 1);
  ck_assert_int_eq(rep.status, 0);
  ck_assert_uint_eq(rep.u.pause.movable, NA - 1);
  ck_assert_uint_eq(rep.u.pause.movable_bytes, (NA - 1) * MIB);
  ck_assert_int_eq(offloaded(&sc), NA - 1);
  ck_assert_int_eq(gmb__core_check(&f->b), 0);
  req.kind = WIRE_ADMIN_RESUME;
  ck_assert_int_eq(gmb__admin(&f->b, &p, &req, &rep), 1);
  ck_assert_uint_eq(rep.u.pause.movable, NA - 1);
  ck_assert_int_eq(offloaded(&sc), 0);
  for (int i = 0; i < NA; i++) {
    uint64_t now;
    gmb__offload_resolve(sc.a, sc.id[i], &now, NULL);
    ck_assert_uint_eq(bytes_of(f, now)[MIB - 1], (uint8_t)(0x40 + i));
    if (i != 3) ck_assert_uint_eq(atomic_load(state_of(&sc, i)), 0);
  }
  atomic_store(state_of(&sc, 3), 0);
  ck_assert_int_eq(gmb__core_check(&f->b), 0);
  scene_close(&sc);
}
END_TEST

/* --- a hostile client ------------------------------------------------------
 *
 * The lock table is the client's to write: whatever it writes there, into
 * slots of its allocations or slots it was never given, decides nothing
 * for the broker but whether its own allocations may be claimed.  Every
 * request below is followed by the fixture's consistency checks. */

/* A Heartbeat from `rid` that says it is idle (Request.sleep_idle) without
 * offering any bytes to pause. */
static void idle(struct fx *f, const char *rid, uid_t uid, int flag) {
  struct wire_request req;
  memset(&req, 0, sizeof req);
  req.kind = WIRE_HEARTBEAT;
  req.sleep_idle = flag;
  req.sleep_idle_ms = flag ? 5000 : 0;
  struct wire_reply rep;
  ck_assert_int_eq(fx_request(f, rid, uid, &req, &rep), 0);
}

/* The bits written by the client into slots on the device and into slots
 * it does not own: the broker neither claims what looks taken nor
 * believes OFFLOADED where it offloaded nothing. */
START_TEST(client_writes_state_bits) {
  struct scene sc;
  scene_open(&sc, INI_LOW_HIGH("", ""), 1);
  struct fx *f = &sc.f;
  struct gmb__lt_slot *slots = gmb__lt_slots(sc.lt);
  atomic_store(state_of(&sc, 0), GMB_LT_OFFLOADED);
  atomic_store(state_of(&sc, 2), GMB_LT_MOVING | GMB_LT_WAITERS);
  atomic_store(state_of(&sc, 4), GMB_LT_OFFLOADED | GMB_LT_WAITERS);
  atomic_store(&slots[NA + 7].state, GMB_LT_OFFLOADED);
  __atomic_store_n(&slots[NA + 7].id, sc.id[6], __ATOMIC_RELAXED);
  /* What it wrote is not an offload: Lock says so, and nothing changes. */
  struct wire_reply rep;
  ck_assert_int_eq(lock(f, "a", 1001, sc.id[0], 0, &rep), 1);
  ck_assert_int_eq(rep.status, 0);
  ck_assert_int_eq(rep.u.lock.held, 0);
  ck_assert_uint_eq(atomic_load(state_of(&sc, 0)), GMB_LT_OFFLOADED);
  ck_assert_uint_eq(f->b.offload.host_bytes, 0);
  offer(f, "a", 1001, 1, 5000); /* idle again after its Lock */
  /* b's request: the segments of 0, 2 and 4 look claimed; only the one
   * of 6 and 7 can be emptied (2 MiB), so 4 MiB cannot be made. */
  ck_assert_int_eq(ask(&sc, "b", 1002, 4 * MIB, NULL), GMB_E_NOMEM);
  ck_assert_uint_eq(f->b.offload.host_bytes, 2 * MIB);
  ck_assert_uint_eq(atomic_load(state_of(&sc, 6)), GMB_LT_OFFLOADED);
  ck_assert_uint_eq(atomic_load(state_of(&sc, 0)), GMB_LT_OFFLOADED);
  ck_assert_uint_eq(atomic_load(state_of(&sc, 2)),
                    GMB_LT_MOVING | GMB_LT_WAITERS);
  /* The slot it does not own stays its own scribble. */
  ck_assert_uint_eq(atomic_load(&slots[NA + 7].state), GMB_LT_OFFLOADED);
  /* Free of the one it marked: freed, the word reset. */
  ck_assert_int_eq(fx_free(f, "a", 1001, sc.id[0]), 0);
  ck_assert_uint_eq(atomic_load(state_of(&sc, 0)), 0);
  ck_assert_uint_eq(slots[sc.slot[0]].id, 0);
  ck_assert_int_eq(lock(f, "a", 1001, sc.id[0], 0, &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_NOENT);
  atomic_store(state_of(&sc, 2), 0);
  atomic_store(state_of(&sc, 4), 0);
  for (int i = 1; i < NA; i++)
    if (atomic_load(state_of(&sc, i)) != GMB_LT_OFFLOADED)
      assert_pattern(&sc, i);
  scene_close(&sc);
}
END_TEST

/* An offloaded slot the client rewrote (0, a hold of its own, MOVING,
 * WAITERS): the broker's record decides, and a Lock brings the bytes back
 * whole with the caller's hold; a Free frees the host copy. */
START_TEST(client_rewrites_offloaded_slot) {
  struct scene sc;
  uint64_t big;
  int away[NA];
  scene_offloaded(&sc, &big, away);
  struct fx *f = &sc.f;
  atomic_store(state_of(&sc, away[0]), 0);
  atomic_store(state_of(&sc, away[1]), 3); /* holds it never had */
  atomic_store(state_of(&sc, away[2]), GMB_LT_MOVING | GMB_LT_WAITERS);
  atomic_store(state_of(&sc, away[3]), GMB_LT_MOVING);
  /* A second request: the four on the device are locked, and none of
   * those the broker holds is offloaded twice. */
  for (int i = 0; i < NA; i++)
    if (i != away[0] && i != away[1] && i != away[2] && i != away[3])
      atomic_store(state_of(&sc, i), 1);
  ck_assert_int_eq(ask(&sc, "b", 1002, 4 * MIB, NULL), GMB_E_NOMEM);
  ck_assert_uint_eq(f->b.offload.host_bytes, 4 * MIB);
  ck_assert_uint_eq(f->b.offload.offloads, 4);
  for (int i = 0; i < NA; i++)
    if (i != away[0] && i != away[1] && i != away[2] && i != away[3])
      atomic_store(state_of(&sc, i), 0);
  ck_assert_int_eq(fx_free(f, "b", 1002, big), 0);
  struct wire_reply rep;
  for (int k = 0; k < 3; k++) {
    int i = away[k];
    if (gmb__offload_resolve(sc.a, sc.id[i], &(uint64_t){0}, NULL) !=
        GMB_OFFL_AWAY)
      continue; /* came back with an earlier one */
    ck_assert_int_eq(lock(f, "a", 1001, sc.id[i], 0, &rep), 1);
    ck_assert_msg(rep.status == 0, "lock: %s", rep.message);
    ck_assert_int_eq(rep.u.lock.held, 1);
    ck_assert_uint_eq(atomic_load(state_of(&sc, i)), 1);
    atomic_store(state_of(&sc, i), 0);
  }
  /* The last one: freed while offloaded (if it still is). */
  uint64_t dummy;
  if (gmb__offload_resolve(sc.a, sc.id[away[3]], &dummy, NULL) ==
      GMB_OFFL_AWAY) {
    ck_assert_int_eq(fx_free(f, "a", 1001, sc.id[away[3]]), 0);
    ck_assert_uint_eq(atomic_load(state_of(&sc, away[3])), 0);
  }
  for (int i = 0; i < NA; i++)
    if (i != away[3]) assert_pattern(&sc, i);
  ck_assert_uint_eq(f->b.offload.host_bytes, 0);
  ck_assert_uint_eq(f->b.offload.chunk_bytes, 0);
  ck_assert_ptr_null(sc.a->paused);
  scene_close(&sc);
}
END_TEST

/* Lock of ids that are not this session's offloaded ones: another
 * session's, a freed one, 0, one never given; and a flood of Locks while
 * one waits: one waiter, whatever comes. */
START_TEST(lock_of_foreign_freed_and_flooded_ids) {
  struct scene sc;
  uint64_t big;
  int away[NA];
  scene_offloaded(&sc, &big, away);
  struct fx *f = &sc.f;
  struct wire_reply rep;
  /* b names a's offloaded allocation: not b's. */
  ck_assert_int_eq(lock(f, "b", 1002, sc.id[away[0]], 0, &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_NOENT);
  ck_assert_int_eq(lock(f, "b", 1002, sc.id[away[0]], 1000, &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_NOENT);
  ck_assert_uint_eq(sc.b->restore_id, 0);
  ck_assert_uint_eq(atomic_load(state_of(&sc, away[0])), GMB_LT_OFFLOADED);
  ck_assert_int_eq(fx_free(f, "b", 1002, sc.id[away[0]]), GMB_E_NOENT);
  ck_assert_uint_eq(f->b.offload.host_bytes, 4 * MIB);
  /* a names b's allocation, 0, and an id never given. */
  ck_assert_int_eq(lock(f, "a", 1001, big, 0, &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_NOENT);
  ck_assert_int_eq(lock(f, "a", 1001, 0, 0, &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_NOENT);
  ck_assert_int_eq(lock(f, "a", 1001, UINT64_MAX, 0, &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_NOENT);
  /* A freed one. */
  ck_assert_int_eq(fx_free(f, "a", 1001, sc.id[away[0]]), 0);
  ck_assert_int_eq(lock(f, "a", 1001, sc.id[away[0]], 0, &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_NOENT);
  ck_assert_int_eq(fx_free(f, "a", 1001, sc.id[away[0]]), GMB_E_NOENT);
  /* One waits (no room: b is active and of higher priority); a hundred
   * more, of the same and the other ids, are refused at once. */
  ck_assert_int_eq(lock(f, "a", 1001, sc.id[away[1]], 5000, &rep), 0);
  ck_assert_uint_eq(f->b.waitq.n, 1);
  for (int k = 0; k < 100; k++) {
    ck_assert_int_eq(lock(f, "a", 1001, sc.id[away[1 + k % 3]], 5000, &rep),
                     1);
    ck_assert_int_eq(rep.status, GMB_E_INVAL);
  }
  ck_assert_uint_eq(f->b.waitq.n, 1);
  ck_assert_uint_eq(sc.a->waiting, 1);
  /* Free of the waiting one: the wait ends with no such allocation, and
   * its host copy is gone. */
  size_t before = f->n_sent;
  ck_assert_int_eq(fx_free(f, "a", 1001, sc.id[away[1]]), 0);
  ck_assert_uint_eq(f->b.offload.host_bytes, 2 * MIB);
  ck_assert_int_eq(fx_free(f, "b", 1002, big), 0);
  int answered = 0;
  for (size_t k = before; k < f->n_sent; k++)
    if (strcmp(f->sent[k].rid, "a") == 0 &&
        f->sent[k].rep.id != 0 && !answered) {
      ck_assert_int_eq(f->sent[k].rep.status, GMB_E_NOENT);
      answered = 1;
    }
  ck_assert_msg(answered, "the waiting Lock was not answered");
  ck_assert_uint_eq(f->b.waitq.n, 0);
  ck_assert_uint_eq(sc.a->restore_id, 0);
  ck_assert_uint_eq(f->b.offload.host_bytes, 2 * MIB);
  scene_close(&sc);
}
END_TEST

/* The session ends while its Lock waits: the waiter, the host copies,
 * the records and the (movable) record all go. */
START_TEST(end_while_lock_waits) {
  struct scene sc;
  uint64_t big;
  int away[NA];
  scene_offloaded(&sc, &big, away);
  struct fx *f = &sc.f;
  const int i = away[0];
  struct wire_reply rep;
  ck_assert_int_eq(lock(f, "a", 1001, sc.id[i], 5000, &rep), 0);
  ck_assert_uint_eq(f->b.waitq.n, 1);
  struct gmb_tenant *low = fx_tenant(f, "low");
  fx_end(f, sc.a);
  ck_assert_uint_eq(f->b.waitq.n, 0);
  ck_assert_uint_eq(low->waiting, 0);
  ck_assert_uint_eq(f->b.offload.host_bytes, 0);
  ck_assert_uint_eq(f->b.offload.held, 0);
  ck_assert_uint_eq(f->b.offload.chunk_bytes, 0);
  ck_assert_uint_eq(low->host_bytes, 0);
  ck_assert_uint_eq(low->paused_bytes, 0);
  ck_assert_uint_eq(low->paused_tags, 0);
  ck_assert_uint_eq(low->used, 0);
  scene_close(&sc);
}
END_TEST

/* sleep_idle from a busy client makes only its own session a candidate:
 * its tenant's other session, which says nothing, is never taken, a
 * requester of lower priority takes nothing, and its tenant's
 * reservation holds. */
START_TEST(idle_flag_makes_only_itself_a_victim) {
  struct fx f;
  fx_open_ini(&f, "host:16MiB",
              "[broker]\ncompaction = off\n"
              "[tenant:low]\nuids = 1001\npriority = 0\nreserve = 4MiB\n"
              "[tenant:mid]\nuids = 1003\npriority = 5\n"
              "[tenant:high]\nuids = 1002\npriority = 10\n");
  fx_hello(&f, "a", 1001, "low");
  fx_hello(&f, "c", 1001, "low");
  fx_hello(&f, "m", 1003, "mid");
  fx_hello(&f, "b", 1002, "high");
  /* a: 4 MiB in two segments of its own; c: 2 MiB in one; m: 2 MiB
   * movable; b: 8 MiB pinned.  Full. */
  for (int i = 0; i < 4; i++) fx_must_alloc(&f, "a", 1001, MIB, GMB_MOVABLE);
  for (int i = 0; i < 2; i++) fx_must_alloc(&f, "c", 1001, MIB, GMB_MOVABLE);
  for (int i = 0; i < 2; i++) fx_must_alloc(&f, "m", 1003, MIB, GMB_MOVABLE);
  fx_must_alloc(&f, "b", 1002, 8 * MIB, 0);
  idle(&f, "a", 1001, 1);
  idle(&f, "m", 1003, 1);
  struct wire_reply rep;
  /* c (low, priority 0) asks: m is of higher priority, a is its own
   * tenant: nothing. */
  ck_assert_int_eq(fx_alloc(&f, "c", 1001, 2 * MIB, 0, 0, &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_NOMEM);
  ck_assert_uint_eq(f.b.offload.host_bytes, 0);
  /* b asks for 6 MiB: a's two segments and m's one could make it, but low
   * keeps its reservation (4 MiB: only a's 2 MiB above it), and c says
   * nothing: m's 2 MiB and a's 2 MiB, not enough. */
  ck_assert_int_eq(fx_alloc(&f, "b", 1002, 6 * MIB, 0, 0, &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_NOMEM);
  struct gmb_tenant *low = fx_tenant(&f, "low");
  ck_assert_uint_ge(low->used, 4 * MIB);
  ck_assert_uint_le(low->host_bytes, 2 * MIB);
  ck_assert_ptr_null(gmb__session_find(f.b.sessions, (const uint8_t *)"c", 1)
                         ->offl);
  fx_close(&f);
}
END_TEST

/* Many idle sessions cost one pool walk: a tenant that opens sixteen idle
 * sessions, each with a small movable allocation in a segment none of
 * them can empty (a busy sibling holds one there too), comes first in the
 * order (idle longest) and gives nothing; the request still walks the
 * pool once, and is served from a's segments.  An operator's pause of a
 * tenant walks it once too. */
START_TEST(one_walk_however_many_idle_sessions) {
  struct fx f;
  fx_open_ini(&f, "host:16MiB",
              "[broker]\ncompaction = off\n"
              "[tenant:low]\nuids = 1001\npriority = 0\n"
              "[tenant:mid]\nuids = 1003\npriority = 0\n"
              "[tenant:high]\nuids = 1002\npriority = 10\n");
  fx_hello(&f, "a", 1001, "low");
  for (int i = 0; i < NA; i++) fx_must_alloc(&f, "a", 1001, MIB, GMB_MOVABLE);
  fx_hello(&f, "m", 1003, "mid");
  fx_must_alloc(&f, "m", 1003, 512, GMB_MOVABLE);
  char rid[16];
  for (int i = 0; i < 16; i++) {
    snprintf(rid, sizeof rid, "m%d", i);
    fx_hello(&f, rid, 1003, "mid");
    fx_must_alloc(&f, rid, 1003, 512, GMB_MOVABLE);
    struct wire_request req;
    memset(&req, 0, sizeof req);
    req.kind = WIRE_HEARTBEAT;
    req.sleep_idle = 1;
    req.sleep_idle_ms = 60000;
    struct wire_reply rep;
    ck_assert_int_eq(fx_request(&f, rid, 1003, &req, &rep), 0);
  }
  fx_hello(&f, "b", 1002, "high");
  fx_must_alloc(&f, "b", 1002, 6 * MIB, 0);
  offer(&f, "a", 1001, 1, 5000);
  uint64_t walks = f.b.offload.walks;
  struct wire_reply rep;
  ck_assert_int_eq(fx_alloc(&f, "b", 1002, 4 * MIB, 0, 0, &rep), 1);
  ck_assert_msg(rep.status == 0, "b refused: %s", rep.message);
  ck_assert_uint_eq(f.b.offload.walks - walks, 1);
  ck_assert_uint_eq(f.b.offload.host_bytes, 4 * MIB);
  ck_assert_uint_eq(fx_tenant(&f, "mid")->host_bytes, 0);
  /* gmbctl pause mid: every movable allocation of its seventeen sessions,
   * one walk. */
  struct wire_request req;
  memset(&req, 0, sizeof req);
  req.kind = WIRE_ADMIN_PAUSE;
  snprintf(req.u.admin_pause.tenant, sizeof req.u.admin_pause.tenant, "mid");
  struct gmb_peer p = fx_peer("ctl", geteuid());
  walks = f.b.offload.walks;
  ck_assert_int_eq(gmb__admin(&f.b, &p, &req, &rep), 1);
  ck_assert_int_eq(rep.status, 0);
  ck_assert_uint_eq(rep.u.pause.movable, 17);
  ck_assert_uint_eq(f.b.offload.walks - walks, 1);
  ck_assert_int_eq(gmb__core_check(&f.b), 0);
  fx_close(&f);
}
END_TEST

/* A tenant the config does not name (made by first use) has
 * default_host_quota: offloaded, it stops there, and the broker's
 * offload_host_max still has room for another tenant's segment, where
 * without the default the first would have taken all of it.  Its pause of
 * a tag is bound the same way. */
START_TEST(default_host_quota_bounds_adhoc) {
  struct fx f;
  fx_open_ini(&f, "host:16MiB",
              "[broker]\ncompaction = off\noffload_host_max = 4MiB\n"
              "default_host_quota = 2MiB\n"
              "[tenant:low]\nuids = 1001\npriority = 0\n"
              "[tenant:high]\nuids = 1002\npriority = 10\n");
  fx_hello(&f, "x", 1003, "adhoc");
  for (int i = 0; i < 4; i++) fx_must_alloc(&f, "x", 1003, MIB, GMB_MOVABLE);
  fx_hello(&f, "a", 1001, "low");
  for (int i = 0; i < 4; i++) fx_must_alloc(&f, "a", 1001, MIB, GMB_MOVABLE);
  fx_hello(&f, "b", 1002, "high");
  fx_must_alloc(&f, "b", 1002, 8 * MIB, 0);
  struct gmb_tenant *x = fx_tenant(&f, "adhoc"), *low = fx_tenant(&f, "low");
  ck_assert_uint_eq(x->host_quota, 2 * MIB);
  ck_assert_uint_eq(low->host_quota, 0); /* configured: its own, none */
  /* The ad-hoc tenant idle longest: asked first. */
  offer(&f, "x", 1003, 1, 60000);
  offer(&f, "a", 1001, 1, 5000);
  struct wire_reply rep;
  ck_assert_int_eq(fx_alloc(&f, "b", 1002, 2 * MIB, 0, 0, &rep), 1);
  ck_assert_msg(rep.status == 0, "b refused: %s", rep.message);
  ck_assert_uint_eq(x->host_bytes, 2 * MIB);
  ck_assert_uint_eq(low->host_bytes, 0);
  /* Its default reached: the next segment is low's. */
  ck_assert_int_eq(fx_alloc(&f, "b", 1002, 2 * MIB, 0, 0, &rep), 1);
  ck_assert_msg(rep.status == 0, "b refused: %s", rep.message);
  ck_assert_uint_eq(x->host_bytes, 2 * MIB);
  ck_assert_uint_eq(low->host_bytes, 2 * MIB);
  ck_assert_uint_eq(f.b.offload.host_bytes, 4 * MIB);
  ck_assert_uint_ge(f.b.offload.refused, 1);
  /* A tag of its own is refused past the default too. */
  ck_assert_int_eq(fx_sleep_note(&f, "x", 1003, "w", 1, MIB, MIB),
                   GMB_E_LIMIT);
  ck_assert_uint_eq(x->host_bytes, 2 * MIB);
  ck_assert_int_eq(gmb__core_check(&f.b), 0);
  fx_close(&f);
}
END_TEST

/* A library's pause of tag "w" (its SleepNote, host bytes it copies) and
 * the broker's offloads share the tenant's host_quota, whichever comes
 * first; the (movable) record's name is the broker's. */
static int note(struct fx *f, const char *rid, uid_t uid, const char *tag,
                int paused, uint64_t host) {
  return fx_sleep_note(f, rid, uid, tag, paused, host, host);
}

START_TEST(host_quota_shared_with_paused_tags) {
  struct scene sc;
  scene_open(&sc, INI_LOW_HIGH("", "host_quota = 3MiB\n"), 1);
  struct fx *f = &sc.f;
  struct gmb_tenant *low = fx_tenant(f, "low");
  fx_hello(f, "a2", 1001, "low");
  /* The library's pause first: 2 MiB of the 3; a segment (2 MiB) of a's
   * would pass the rest, so none is offloaded. */
  ck_assert_int_eq(note(f, "a2", 1001, "w", 1, 2 * MIB), 0);
  ck_assert_int_eq(ask(&sc, "b", 1002, 2 * MIB, NULL), GMB_E_NOMEM);
  ck_assert_int_eq(offloaded(&sc), 0);
  ck_assert_uint_eq(low->host_bytes, 2 * MIB);
  /* The (movable) record is the broker's: no library may name it. */
  ck_assert_int_eq(note(f, "a2", 1001, GMB_SLEEP_MOVABLE_TAG, 1, 0),
                   GMB_E_INVAL);
  ck_assert_int_eq(note(f, "a2", 1001, GMB_SLEEP_MOVABLE_TAG, 0, 0),
                   GMB_E_INVAL);
  /* The tag resumes: now the broker's offload takes 2 MiB, and the
   * library's next pause of 2 MiB would pass the quota. */
  ck_assert_int_eq(note(f, "a2", 1001, "w", 0, 0), 0);
  ck_assert_int_eq(ask(&sc, "b", 1002, 2 * MIB, NULL), 0);
  ck_assert_int_eq(offloaded(&sc), 2);
  ck_assert_uint_eq(low->host_bytes, 2 * MIB);
  ck_assert_int_eq(note(f, "a2", 1001, "w", 1, 2 * MIB), GMB_E_LIMIT);
  ck_assert_int_eq(note(f, "a2", 1001, "w", 1, MIB), 0);
  ck_assert_uint_eq(low->host_bytes, 3 * MIB);
  /* Nothing more fits: another segment is refused whole. */
  ck_assert_int_eq(ask(&sc, "b", 1002, 2 * MIB, NULL), GMB_E_NOMEM);
  ck_assert_int_eq(offloaded(&sc), 2);
  ck_assert_uint_le(low->host_bytes, 3 * MIB);
  scene_close(&sc);
}
END_TEST

/* --- host memory and copies that fail ----------------------------------- */

/* The host device's ops, with host allocations and copies that fail on
 * demand: the n-th call from now (1: the next one), 0: never. */
static const struct gmb_device_ops *real_ops;
static struct gmb_device_ops faulty_ops;
static int no_host_memory, fail_copy_out, fail_copy_in;
/* record_fails: the first calloc after each copy out fails (the broker's
 * (movable) sleep record, made once the bytes are on the host); the
 * suite links with --wrap=calloc, so every calloc of the broker's comes
 * here. */
static int record_fails, calloc_fail_next, callocs_failed;

void *__real_calloc(size_t n, size_t size);
void *__wrap_calloc(size_t n, size_t size);
void *__wrap_calloc(size_t n, size_t size) {
  if (calloc_fail_next) {
    calloc_fail_next = 0;
    callocs_failed++;
    return NULL;
  }
  return __real_calloc(n, size);
}

static void *faulty_host_alloc(struct gmb_device *d, uint64_t len) {
  if (no_host_memory) return NULL;
  return real_ops->host_alloc(d, len);
}

static int faulty_copy_host(struct gmb_device *d, struct gmb_dseg *seg,
                            uint64_t off, void *p, uint64_t len,
                            int to_host) {
  int *n = to_host ? &fail_copy_out : &fail_copy_in;
  if (*n && --*n == 0) return GMB_E_DEVICE;
  int rc = real_ops->copy_host(d, seg, off, p, len, to_host);
  if (rc == 0 && to_host && record_fails) calloc_fail_next = 1;
  return rc;
}

static void faulty_on(struct fx *f) {
  real_ops = f->b.dev->ops;
  faulty_ops = *real_ops;
  faulty_ops.host_alloc = faulty_host_alloc;
  faulty_ops.copy_host = faulty_copy_host;
  f->b.dev->ops = &faulty_ops;
  no_host_memory = fail_copy_out = fail_copy_in = 0;
  record_fails = calloc_fail_next = callocs_failed = 0;
}

static void faulty_off(struct fx *f) {
  f->b.dev->ops = real_ops;
  record_fails = calloc_fail_next = 0;
}

/* No host memory, then a copy out that fails half-way through a segment,
 * then a copy back that fails: each time nothing is lost, the slots say
 * where the bytes are, and a later try succeeds. */
START_TEST(host_memory_and_copies_fail) {
  struct scene sc;
  scene_open(&sc, INI_LOW_HIGH("", ""), 1);
  struct fx *f = &sc.f;
  faulty_on(f);
  /* No host memory at all: nothing offloaded, the request refused. */
  no_host_memory = 1;
  ck_assert_int_eq(ask(&sc, "b", 1002, 2 * MIB, NULL), GMB_E_NOMEM);
  ck_assert_int_eq(offloaded(&sc), 0);
  ck_assert_uint_eq(f->b.offload.host_bytes, 0);
  ck_assert_uint_eq(f->b.offload.chunk_bytes, 0);
  for (int i = 0; i < NA; i++) {
    ck_assert_uint_eq(atomic_load(state_of(&sc, i)), 0);
    assert_pattern(&sc, i);
  }
  no_host_memory = 0;
  /* The second copy of a segment fails: the first stays offloaded, the
   * second on the device, unclaimed. */
  fail_copy_out = 2;
  ck_assert_int_eq(ask(&sc, "b", 1002, 2 * MIB, NULL), GMB_E_NOMEM);
  ck_assert_int_eq(offloaded(&sc), 1);
  ck_assert_uint_eq(f->b.offload.host_bytes, MIB);
  int away = -1;
  for (int i = 0; i < NA; i++) {
    if (atomic_load(state_of(&sc, i)) == GMB_LT_OFFLOADED) {
      away = i;
      continue;
    }
    ck_assert_uint_eq(atomic_load(state_of(&sc, i)), 0);
    assert_pattern(&sc, i);
  }
  /* Its copy back fails: GMB_E_DEVICE, still offloaded, bytes kept. */
  struct wire_reply rep;
  fail_copy_in = 1;
  ck_assert_int_eq(lock(f, "a", 1001, sc.id[away], 0, &rep), 1);
  ck_assert_int_eq(rep.status, GMB_E_DEVICE);
  ck_assert_uint_eq(atomic_load(state_of(&sc, away)), GMB_LT_OFFLOADED);
  ck_assert_uint_eq(f->b.offload.host_bytes, MIB);
  ck_assert_uint_eq(fx_tenant(f, "low")->used, (NA - 1) * MIB);
  /* Then it comes back whole. */
  ck_assert_int_eq(lock(f, "a", 1001, sc.id[away], 0, &rep), 1);
  ck_assert_msg(rep.status == 0, "lock: %s", rep.message);
  ck_assert_int_eq(rep.u.lock.held, 1);
  atomic_store(state_of(&sc, away), 0);
  assert_pattern(&sc, away);
  ck_assert_uint_eq(f->b.offload.host_bytes, 0);
  ck_assert_uint_eq(f->b.offload.chunk_bytes, 0);
  faulty_off(f);
  scene_close(&sc);
}
END_TEST

/* No host memory for the session's (movable) sleep record, made with its
 * first offloaded allocation: the offload is refused as when its copy
 * fails (the segment stays whole on the device, nothing is held on the
 * host, no record half made), and the broker serves on; with memory
 * again, the same request offloads. */
START_TEST(sleep_record_out_of_memory) {
  struct scene sc;
  scene_open(&sc, INI_LOW_HIGH("", ""), 1);
  struct fx *f = &sc.f;
  struct gmb_tenant *low = fx_tenant(f, "low");
  faulty_on(f);
  record_fails = 1;
  uint64_t refused = f->b.offload.refused;
  ck_assert_int_eq(ask(&sc, "b", 1002, 2 * MIB, NULL), GMB_E_NOMEM);
  ck_assert_int_ge(callocs_failed, 1);
  ck_assert_int_eq(offloaded(&sc), 0);
  ck_assert_uint_eq(f->b.offload.host_bytes, 0);
  ck_assert_uint_eq(f->b.offload.chunk_bytes, 0);
  ck_assert_uint_eq(f->b.offload.held, 0);
  ck_assert_uint_eq(f->b.offload.refused, refused); /* not the host bounds */
  ck_assert_uint_eq(sc.a->n_paused, 0);
  ck_assert_ptr_null(sc.a->paused);
  ck_assert_uint_eq(low->paused_tags, 0);
  ck_assert_uint_eq(low->host_bytes, 0);
  ck_assert_uint_eq(low->paused_bytes, 0);
  ck_assert_uint_eq(low->used, NA * MIB);
  for (int i = 0; i < NA; i++) {
    ck_assert_uint_eq(atomic_load(state_of(&sc, i)), 0);
    assert_pattern(&sc, i);
  }
  ck_assert_int_eq(gmb__core_check(&f->b), 0);
  record_fails = 0;
  ck_assert_int_eq(ask(&sc, "b", 1002, 2 * MIB, NULL), 0);
  ck_assert_int_eq(offloaded(&sc), 2);
  ck_assert_uint_eq(low->paused_tags, 1);
  ck_assert_uint_eq(low->host_bytes, 2 * MIB);
  faulty_off(f);
  scene_close(&sc);
}
END_TEST

/* offload_host_max 3 MiB: the chunk is cut to it; a segment that does not
 * fit what is left of it is refused whole; copies freed out of order keep
 * their chunk until its last one goes, and the bound holds throughout. */
START_TEST(chunks_freed_out_of_order) {
  struct scene sc;
  scene_open(&sc, INI_LOW_HIGH("offload_host_max = 3MiB\n", ""), 1);
  struct fx *f = &sc.f;
  ck_assert_int_eq(ask(&sc, "b", 1002, 2 * MIB, NULL), 0);
  ck_assert_uint_eq(f->b.offload.host_bytes, 2 * MIB);
  ck_assert_uint_eq(f->b.offload.chunk_bytes, 3 * MIB);
  int away[NA];
  ck_assert_int_eq(offloaded_list(&sc, away), 2);
  /* The consistency check sums the chunks the copies are in. */
  ck_assert_int_eq(gmb__offload_check(&f->b), 0);
  f->b.offload.chunk_bytes += 4096;
  ck_assert_int_gt(gmb__offload_check(&f->b), 0);
  f->b.offload.chunk_bytes -= 4096;
  struct gmb_offl_chunk *cur = f->b.offload.chunk;
  f->b.offload.chunk = (struct gmb_offl_chunk *)&sc; /* not one of theirs */
  ck_assert_int_gt(gmb__offload_check(&f->b), 0);
  f->b.offload.chunk = cur;
  ck_assert_int_eq(gmb__offload_check(&f->b), 0);
  /* Another segment: 1 MiB left in the chunk and none within the bound:
   * refused whole, nothing of it offloaded. */
  offer(f, "a", 1001, 1, 5000);
  ck_assert_int_eq(ask(&sc, "b", 1002, 2 * MIB, NULL), GMB_E_NOMEM);
  ck_assert_int_eq(offloaded(&sc), 2);
  ck_assert_uint_le(f->b.offload.chunk_bytes, 3 * MIB);
  /* The first copy freed: its chunk stays for the second, and its gap is
   * not cut again. */
  ck_assert_int_eq(fx_free(f, "a", 1001, sc.id[away[0]]), 0);
  ck_assert_uint_eq(f->b.offload.host_bytes, MIB);
  ck_assert_uint_eq(f->b.offload.chunk_bytes, 3 * MIB);
  offer(f, "a", 1001, 1, 5000); /* idle again after its Free */
  ck_assert_int_eq(ask(&sc, "b", 1002, 2 * MIB, NULL), GMB_E_NOMEM);
  ck_assert_int_eq(offloaded(&sc), 1);
  ck_assert_uint_eq(f->b.offload.chunk_bytes, 3 * MIB);
  /* The second: the chunk goes, and a new one takes a segment again. */
  ck_assert_int_eq(fx_free(f, "a", 1001, sc.id[away[1]]), 0);
  ck_assert_uint_eq(f->b.offload.host_bytes, 0);
  ck_assert_uint_eq(f->b.offload.chunk_bytes, 0);
  ck_assert_ptr_null(f->b.offload.chunk);
  ck_assert_ptr_null(sc.a->paused);
  offer(f, "a", 1001, 1, 5000);
  ck_assert_int_eq(ask(&sc, "b", 1002, 2 * MIB, NULL), 0);
  ck_assert_int_eq(offloaded(&sc), 2);
  ck_assert_uint_eq(f->b.offload.chunk_bytes, 3 * MIB);
  scene_close(&sc);
}
END_TEST

/* --- a seeded random hostile mix -----------------------------------------
 *
 * Four sessions of three tenants send what a hostile client may, in a
 * seeded random order (SEED, ITER: 1500 steps by default), with the
 * consistency checks after every step; then they end and nothing stays
 * counted. */

#define ST_SESS 4 /* a, a2 (low), m (mid), b (high) */
#define ST_IDS 64

struct stress {
  struct fx f;
  const char *rid[ST_SESS];
  uid_t uid[ST_SESS];
  const char *tenant[ST_SESS];
  uint64_t id[ST_SESS][ST_IDS]; /* what each was given (0: none) */
  struct gmb__lt_header *lt[ST_SESS];
};

static uint64_t st_rand(uint64_t *x) {
  *x ^= *x << 13;
  *x ^= *x >> 7;
  *x ^= *x << 17;
  return *x;
}

static void st_hello(struct stress *st, int k) {
  struct gmb_session *s =
      fx_hello(&st->f, st->rid[k], st->uid[k], st->tenant[k]);
  st->lt[k] = fx_map_locktab(s);
  memset(st->id[k], 0, sizeof st->id[k]);
}

/* One random step of session k: the requests a hostile client may send
 * (ids of its own, of others, freed or made up), words written into its
 * lock table, idle claims, operators' pauses, time passing, its end. */
static void st_step(struct stress *st, uint64_t *x) {
  struct fx *f = &st->f;
  const int k = (int)(st_rand(x) % ST_SESS);
  const char *rid = st->rid[k];
  const uid_t uid = st->uid[k];
  uint64_t any = st->id[st_rand(x) % ST_SESS][st_rand(x) % ST_IDS];
  if (st_rand(x) % 8 == 0) any = st_rand(x) % 4 ? any + 1 : st_rand(x);
  struct wire_request req;
  struct wire_reply rep;
  memset(&req, 0, sizeof req);
  switch (st_rand(x) % 11) {
    case 0:
    case 1: { /* alloc */
      uint64_t size = 512 + st_rand(x) % (k == 3 ? 3 * MIB : MIB);
      unsigned flags = k == 3 && st_rand(x) % 2 ? 0 : GMB_MOVABLE;
      int wait = st_rand(x) % 4 == 0 ? 50 : 0;
      if (fx_alloc(f, rid, uid, size, flags, wait, &rep) == 1 &&
          rep.status == 0)
        st->id[k][st_rand(x) % ST_IDS] = rep.u.alloc.id;
      break;
    }
    case 2: /* free, any id */
      req.kind = WIRE_FREE;
      req.u.free.id = any;
      fx_request(f, rid, uid, &req, &rep);
      break;
    case 3:
    case 4: /* Lock, any id; a hold it got is given back at once */
      if (lock(f, rid, uid, any, st_rand(x) % 3 ? 0 : 100, &rep) == 1 &&
          rep.status == 0 && rep.u.lock.held) {
        for (uint32_t i = 0; i < 256; i++) {
          _Atomic uint32_t *w = &gmb__lt_slots(st->lt[k])[i].state;
          if (gmb__lt_slots(st->lt[k])[i].id == any && atomic_load(w) == 1)
            atomic_store(w, 0);
        }
      }
      break;
    case 5: { /* a word of its lock table */
      static const uint32_t words[] = {
          0, 1, 2, GMB_LT_MOVING, GMB_LT_MOVING | GMB_LT_WAITERS,
          GMB_LT_OFFLOADED, GMB_LT_OFFLOADED | GMB_LT_WAITERS,
          GMB_LT_MAX_HOLDERS, UINT32_MAX};
      uint32_t slot = (uint32_t)(st_rand(x) % 96);
      atomic_store(&gmb__lt_slots(st->lt[k])[slot].state,
                   words[st_rand(x) % (sizeof words / sizeof *words)]);
      break;
    }
    case 6: /* idle or not, offering bytes or not */
      req.kind = WIRE_HEARTBEAT;
      req.sleep_idle = (int)(st_rand(x) % 2);
      req.sleep_pausable = st_rand(x) % 3 == 0 ? st_rand(x) % (4 * MIB) : 0;
      req.sleep_idle_ms = st_rand(x) % 100000;
      fx_request(f, rid, uid, &req, &rep);
      break;
    case 7: { /* an operator's pause or resume of low or mid */
      memset(&req, 0, sizeof req);
      req.kind = st_rand(x) % 2 ? WIRE_ADMIN_PAUSE : WIRE_ADMIN_RESUME;
      snprintf(req.u.admin_pause.tenant, sizeof req.u.admin_pause.tenant,
               "%s", st_rand(x) % 2 ? "low" : "mid");
      struct gmb_peer p = fx_peer("ctl", geteuid());
      gmb__admin(&f->b, &p, &req, &rep);
      ck_assert_int_eq(gmb__core_check(&f->b), 0);
      break;
    }
    case 8: { /* time passes: compaction runs, waits and asks run out */
      for (int n = 0; n < 8 && gmb__defrag_tick(&f->b, UINT64_MAX); n++)
        ck_assert_int_eq(gmb__core_check(&f->b), 0);
      uint64_t later = gmb__now_ns() + 20 * GMB_NS_PER_S;
      gmb__waitq_expire(&f->b, later);
      gmb__reclaim_expire(&f->b, later);
      ck_assert_int_eq(gmb__core_check(&f->b), 0);
      break;
    }
    case 9: /* a SleepNote of some tag */
      note(f, rid, uid, st_rand(x) % 2 ? "w" : GMB_SLEEP_MOVABLE_TAG,
           (int)(st_rand(x) % 2), st_rand(x) % (2 * MIB));
      break;
    default: /* the end of a session, and a new one in its place */
      if (st_rand(x) % 4) break;
      fx_unmap_locktab(st->lt[k]);
      fx_end(f, gmb__session_find(f->b.sessions, (const uint8_t *)rid,
                                  strlen(rid)));
      st_hello(st, k);
      break;
  }
  f->n_sent = 0;
}

static void stress_run(const char *compaction) {
  struct stress st;
  memset(&st, 0, sizeof st);
  char ini[512];
  snprintf(ini, sizeof ini,
           "[broker]\ncompaction = %s\noffload_host_max = 12MiB\n"
           "max_waiters_per_session = 4\n"
           "[tenant:low]\nuids = 1001\npriority = 0\nreserve = 2MiB\n"
           "host_quota = 6MiB\n"
           "[tenant:mid]\nuids = 1003\npriority = 5\n"
           "[tenant:high]\nuids = 1002\npriority = 10\n", compaction);
  fx_open_ini(&st.f, "host:24MiB", ini);
  const char *rids[ST_SESS] = {"a", "a2", "m", "b"};
  const uid_t uids[ST_SESS] = {1001, 1001, 1003, 1002};
  const char *tenants[ST_SESS] = {"low", "low", "mid", "high"};
  for (int k = 0; k < ST_SESS; k++) {
    st.rid[k] = rids[k];
    st.uid[k] = uids[k];
    st.tenant[k] = tenants[k];
    st_hello(&st, k);
  }
  const char *e = getenv("ITER");
  int iter = e ? atoi(e) : 1000;
  e = getenv("SEED");
  uint64_t x = e ? strtoull(e, NULL, 0) : UINT64_C(0x9e3779b97f4a7c15);
  for (int i = 0; i < iter; i++) st_step(&st, &x);
  /* The mix did what it is for (with any seed of some length). */
  ck_assert_uint_gt(st.f.b.offload.offloads, 0);
  ck_assert_uint_gt(st.f.b.offload.restores, 0);
  /* Everyone ends: nothing stays counted. */
  for (int k = 0; k < ST_SESS; k++) {
    fx_unmap_locktab(st.lt[k]);
    fx_end(&st.f, gmb__session_find(st.f.b.sessions,
                                    (const uint8_t *)st.rid[k],
                                    strlen(st.rid[k])));
  }
  ck_assert_uint_eq(st.f.b.offload.host_bytes, 0);
  ck_assert_uint_eq(st.f.b.offload.chunk_bytes, 0);
  ck_assert_uint_eq(st.f.b.offload.held, 0);
  ck_assert_uint_eq(st.f.b.waitq.n, 0);
  ck_assert_uint_eq(fx_tenant(&st.f, "low")->host_bytes, 0);
  ck_assert_uint_eq(fx_tenant(&st.f, "mid")->host_bytes, 0);
  fx_close(&st.f);
}

/* With compaction off, and on (its runs moving what the offloads leave,
 * a step at a time). */
START_TEST(hostile_mix_keeps_the_sums) {
  stress_run("off");
  stress_run("auto");
}
END_TEST

/* --- the offload job: slices over the loop's turns --------------------- */

/* A device where one request lacks more than a slice: "a" (tenant low)
 * holds n movable MiB with a pattern and offers to sleep; "b" (high,
 * priority 10) and "d" (mid, priority 10) ask for room; "c" (other) is a
 * bystander whose requests must be answered between slices. */
#define NB_MAX 288
#define INI_JOB                                                     \
  "[broker]\ncompaction = off\n"                                    \
  "[tenant:low]\nuids = 1001\npriority = 0\n"                       \
  "[tenant:high]\nuids = 1002\npriority = 10\n"                     \
  "[tenant:mid]\nuids = 1003\npriority = 10\n"                      \
  "[tenant:other]\nuids = 1004\npriority = 0\n"

struct big {
  struct fx f;
  struct gmb_session *a, *b;
  struct gmb__lt_header *lt;
  int n;
  uint64_t id[NB_MAX];
  uint32_t slot[NB_MAX];
};

static uint8_t big_byte(int i) { return (uint8_t)(i * 7 + 1); }

static void big_open_ini(struct big *g, const char *device, const char *ini,
                         int n) {
  memset(g, 0, sizeof *g);
  ck_assert_int_le(n, NB_MAX);
  fx_open_ini(&g->f, device, ini);
  g->a = fx_hello(&g->f, "a", 1001, "low");
  g->b = fx_hello(&g->f, "b", 1002, "high");
  fx_hello(&g->f, "c", 1004, "other");
  fx_hello(&g->f, "d", 1003, "mid");
  g->n = n;
  for (int i = 0; i < n; i++) {
    struct wire_reply rep = fx_must_alloc(&g->f, "a", 1001, MIB, GMB_MOVABLE);
    g->id[i] = rep.u.alloc.id;
    g->slot[i] = rep.u.alloc.slot;
    memset(bytes_of(&g->f, g->id[i]), big_byte(i), MIB);
  }
  g->lt = fx_map_locktab(g->a);
  offer(&g->f, "a", 1001, 1, 5000);
}

static void big_open(struct big *g, const char *device, int n) {
  big_open_ini(g, device, INI_JOB, n);
}

static _Atomic uint32_t *big_state(struct big *g, int i) {
  return &gmb__lt_slots(g->lt)[g->slot[i]].state;
}

static int big_offloaded(struct big *g) {
  int k = 0;
  for (int i = 0; i < g->n; i++)
    k += atomic_load(big_state(g, i)) == GMB_LT_OFFLOADED;
  return k;
}

/* a's allocation i is on the device with its pattern. */
static void big_assert_pattern(struct big *g, int i) {
  uint64_t now;
  ck_assert_int_ne(gmb__offload_resolve(g->a, g->id[i], &now, NULL),
                   GMB_OFFL_AWAY);
  const uint8_t *p = bytes_of(&g->f, now);
  for (size_t k = 0; k < MIB; k++)
    if (p[k] != big_byte(i))
      ck_abort_msg("allocation %d byte %zu is %#x", i, k, p[k]);
}

/* One turn's slice, then the consistency checks; returns the step's
 * answer (1: the job goes on). */
static int big_step(struct big *g) {
  int more = gmb__reclaim_offload_step(&g->f.b);
  ck_assert_int_eq(gmb__core_check(&g->f.b), 0);
  ck_assert_int_eq(gmb__offload_check(&g->f.b), 0);
  return more;
}

/* The last answer the tap recorded for `rid` (a held request's: nothing
 * else is sent to the requesters here), or NULL. */
static const struct wire_reply *big_answer(struct big *g, const char *rid) {
  const struct fx_sent *x = fx_last_to(&g->f, rid);
  return x ? &x->rep : NULL;
}

/* Everything comes back, byte for byte, after b (and d) gave back: each
 * offloaded allocation is locked back (the others with it), then all is
 * freed, and no host byte stays counted. */
static void big_restore_all(struct big *g) {
  for (int i = 0; i < g->n; i++) {
    if (atomic_load(big_state(g, i)) != GMB_LT_OFFLOADED) continue;
    struct wire_reply rep;
    ck_assert_int_eq(lock(&g->f, "a", 1001, g->id[i], 0, &rep), 1);
    ck_assert_msg(rep.status == 0, "lock %d: %s", i, rep.message);
    atomic_store(big_state(g, i), 0); /* its gmb_unlock */
  }
  for (int i = 0; i < g->n; i++) big_assert_pattern(g, i);
  for (int i = 0; i < g->n; i++)
    ck_assert_int_eq(fx_free(&g->f, "a", 1001, g->id[i]), 0);
  ck_assert_uint_eq(g->f.b.offload.host_bytes, 0);
  ck_assert_uint_eq(g->f.b.offload.chunk_bytes, 0);
  ck_assert_uint_eq(g->f.b.offload.held, 0);
  ck_assert_uint_eq(fx_tenant(&g->f, "low")->host_bytes, 0);
}

static void big_close(struct big *g) {
  ck_assert_uint_eq(g->f.b.waitq.held_job, 0);
  fx_unmap_locktab(g->lt);
  fx_close(&g->f);
}

/* Session a, asked to pause its tags, answers as its library would: it
 * frees `segments` of its allocations still on the device (1 MiB each),
 * then says so in a Heartbeat offering `pausable` more.  b's held request
 * is then served (and freed), nothing waits, a has no ask left; a's
 * offloaded allocations come back by Lock with every byte, all of a's
 * are freed, and no host byte stays counted.  Closes g. */
static void big_ask_answered(struct big *g, int segments, uint64_t pausable) {
  struct fx *f = &g->f;
  int freed[NB_MAX] = {0}, gone = 0;
  for (int i = 0; i < g->n && gone < segments; i++)
    if (atomic_load(big_state(g, i)) == 0) {
      ck_assert_int_eq(fx_free(f, "a", 1001, g->id[i]), 0);
      freed[i] = 1;
      gone++;
    }
  ck_assert_int_eq(gone, segments);
  struct wire_request req;
  memset(&req, 0, sizeof req);
  req.kind = WIRE_HEARTBEAT;
  req.sleep_pausable = pausable;
  req.sleep_idle_ms = 5000;
  req.trim_answered = 1;
  struct wire_reply rep;
  ck_assert_int_eq(fx_request(f, "a", 1001, &req, &rep), 0);
  const struct wire_reply *rb = big_answer(g, "b");
  ck_assert_ptr_nonnull(rb);
  ck_assert_msg(rb->status == 0, "b refused: %s", rb->message);
  ck_assert_uint_eq(f->b.waitq.n, 0);
  ck_assert_uint_eq(g->a->ask_bytes, 0);
  ck_assert_int_eq(fx_free(f, "b", 1002, rb->u.alloc.id), 0);
  for (int i = 0; i < g->n; i++) {
    if (atomic_load(big_state(g, i)) != GMB_LT_OFFLOADED) continue;
    ck_assert_int_eq(lock(f, "a", 1001, g->id[i], 0, &rep), 1);
    ck_assert_msg(rep.status == 0, "lock %d: %s", i, rep.message);
    atomic_store(big_state(g, i), 0);
  }
  for (int i = 0; i < g->n; i++)
    if (!freed[i]) {
      big_assert_pattern(g, i);
      ck_assert_int_eq(fx_free(f, "a", 1001, g->id[i]), 0);
    }
  ck_assert_uint_eq(f->b.offload.host_bytes, 0);
  big_close(g);
}

/* 320 MiB: a holds 256 (room 64); b asks 192, which lacks 128: the first
 * slice (64 MiB) runs in b's request, which is held; c's Stats and
 * Heartbeat are answered while the job runs, between its slices, and its
 * Alloc (of a lower priority than b's) finds the room made so far fenced
 * for b: it joins the job, held.  The job makes the rest over the next
 * turns, b is served, then c, and a's bytes all come back intact. */
START_TEST(job_slices_and_others_served_between) {
  struct big g;
  big_open(&g, "host:320MiB", 256);
  struct fx *f = &g.f;
  struct wire_reply rep;
  ck_assert_int_eq(fx_alloc(f, "b", 1002, 192 * MIB, 0, 0, &rep), 0);
  ck_assert_uint_eq(f->b.waitq.held_job, 1);
  ck_assert_uint_eq(f->b.offload.slices, 1);
  ck_assert_uint_eq(f->b.offload.jobs, 1);
  /* Status shows it. */
  struct wire_reply st;
  memset(&st, 0, sizeof st);
  gmb__observe_status(&f->b, &st);
  ck_assert_uint_eq(st.u.admin_status.offload_job_requests, 1);
  ck_assert_uint_eq(st.u.admin_status.offload_slices, 1);
  ck_assert_uint_eq(st.u.admin_status.offload_jobs, 1);
  gmb__wire_reply_clear(&st);
  /* A slice copies 64 MiB, whole segments. */
  ck_assert_int_eq(big_offloaded(&g), (int)(GMB_OFFLOAD_SLICE / MIB));
  ck_assert_ptr_null(big_answer(&g, "b"));
  /* Between slices: another tenant's Stats, Alloc and Heartbeat. */
  ck_assert_int_eq(fx_plain(f, "c", 1004, WIRE_STATS, &rep), 1);
  ck_assert_int_eq(rep.status, 0);
  const uint64_t fenced = f->b.waitq.fenced;
  ck_assert_int_eq(fx_alloc(f, "c", 1004, MIB, 0, 0, &rep), 0);
  ck_assert_uint_eq(f->b.waitq.fenced, fenced + 1);
  ck_assert_uint_eq(f->b.waitq.held_job, 2);
  char *m = gmb__observe_metrics(&f->b, 0), line[64];
  ck_assert_ptr_nonnull(m);
  snprintf(line, sizeof line, "\ngmb_offload_job_fenced_total %" PRIu64 "\n",
           fenced + 1);
  ck_assert_msg(strstr(m, line) != NULL, "no %s", line + 1);
  free(m);
  uint64_t seen = g.a->last_seen_ns;
  ck_assert_int_eq(fx_plain(f, "c", 1004, WIRE_HEARTBEAT, &rep), 0);
  ck_assert_uint_eq(g.a->last_seen_ns, seen); /* c's, not a's */
  /* Still the first slice only, and b still held. */
  ck_assert_uint_eq(f->b.offload.slices, 1);
  ck_assert_uint_eq(f->b.waitq.held_job, 2);
  ck_assert_ptr_null(big_answer(&g, "b"));
  /* The turns: one slice each, until b is served. */
  int turns = 0;
  while (big_step(&g)) {
    ck_assert_int_lt(++turns, 16);
    /* Between two of them, c again. */
    ck_assert_int_eq(fx_plain(f, "c", 1004, WIRE_STATS, &rep), 1);
    ck_assert_int_eq(rep.status, 0);
  }
  /* 128 MiB lacking after the first slice and 2 MiB for c's segment: a
   * second slice makes b's room, a third c's 2 MiB past it. */
  ck_assert_uint_eq(f->b.offload.slices, 3);
  const struct wire_reply *a = big_answer(&g, "b");
  ck_assert_ptr_nonnull(a);
  ck_assert_msg(a->status == 0, "b refused: %s", a->message);
  const struct wire_reply *ac = big_answer(&g, "c");
  ck_assert_ptr_nonnull(ac);
  ck_assert_msg(ac->status == 0, "c refused: %s", ac->message);
  const uint64_t c_id = ac->u.alloc.id;
  /* It took no more than it lacked: (192 - 64 + 2) MiB, a segment's
   * slack. */
  ck_assert_uint_ge(f->b.offload.host_bytes, 130 * MIB);
  ck_assert_uint_le(f->b.offload.host_bytes, 132 * MIB);
  ck_assert_int_eq(fx_free(f, "b", 1002, a->u.alloc.id), 0);
  ck_assert_int_eq(fx_free(f, "c", 1004, c_id), 0);
  big_restore_all(&g);
  big_close(&g);
}
END_TEST

/* Two requesters while a job runs: b (128 MiB) starts it and is held
 * after its first slice; d (128 MiB) comes while the room made so far
 * (96 MiB) is b's and does not fit it: d joins the job rather than count
 * on b's room.  Both are served, in turn, from a's 288 idle MiB. */
START_TEST(job_two_requesters_both_served) {
  struct big g;
  big_open(&g, "host:320MiB", 288);
  struct fx *f = &g.f;
  struct wire_reply rep;
  ck_assert_int_eq(fx_alloc(f, "b", 1002, 128 * MIB, 0, 0, &rep), 0);
  ck_assert_uint_eq(f->b.waitq.held_job, 1);
  ck_assert_uint_eq(f->b.offload.slices, 1);
  ck_assert_int_eq(fx_alloc(f, "d", 1003, 128 * MIB, 0, 0, &rep), 0);
  ck_assert_uint_eq(f->b.waitq.held_job, 2);
  ck_assert_uint_eq(f->b.offload.slices, 1); /* it ran no slice of its own */
  ck_assert_uint_eq(f->b.offload.jobs, 1);   /* it joined the one running */
  int turns = 0;
  while (big_step(&g)) ck_assert_int_lt(++turns, 16);
  const struct wire_reply *rb = big_answer(&g, "b");
  const struct wire_reply *rd = big_answer(&g, "d");
  ck_assert_ptr_nonnull(rb);
  ck_assert_ptr_nonnull(rd);
  ck_assert_msg(rb->status == 0, "b refused: %s", rb->message);
  ck_assert_msg(rd->status == 0, "d refused: %s", rd->message);
  /* 224 MiB made for 256 MiB asked, 32 MiB free to start with. */
  ck_assert_uint_le(f->b.offload.host_bytes, 226 * MIB);
  ck_assert_int_eq(fx_free(f, "b", 1002, rb->u.alloc.id), 0);
  ck_assert_int_eq(fx_free(f, "d", 1003, rd->u.alloc.id), 0);
  big_restore_all(&g);
  big_close(&g);
}
END_TEST

/* Requests that join a running job cost the loop no walk of the requests
 * held for it: what the caches were asked for the job's requests is kept
 * as a sum.  32 requests of d join b's job; the holds are looked at a
 * few times for each (its own hold's insertion), not once per held
 * request, which made a flood of joins cost the square of its length. */
START_TEST(job_joins_walk_no_held_requests) {
  struct big g;
  big_open(&g, "host:320MiB", 288);
  struct fx *f = &g.f;
  struct wire_reply rep;
  ck_assert_int_eq(fx_alloc(f, "b", 1002, 128 * MIB, 0, 0, &rep), 0);
  ck_assert_uint_eq(f->b.waitq.held_job, 1);
  const uint64_t visits = f->b.waitq.hold_visits;
  enum { JOINS = 32 };
  for (uint64_t i = 0; i < JOINS; i++)
    ck_assert_int_eq(fx_alloc(f, "d", 1003, 128 * MIB, 0, 0, &rep), 0);
  ck_assert_uint_eq(f->b.waitq.held_job, 1 + JOINS);
  ck_assert_msg(f->b.waitq.hold_visits - visits <= 2 * JOINS,
                "%" PRIu64 " held requests looked at for %d joins",
                f->b.waitq.hold_visits - visits, JOINS);
  int turns = 0;
  while (big_step(&g)) ck_assert_int_lt(++turns, 256);
  const struct wire_reply *rb = big_answer(&g, "b");
  ck_assert_ptr_nonnull(rb);
  ck_assert_msg(rb->status == 0, "b refused: %s", rb->message);
  /* The job let every one of d's go (served or refused: the device holds
   * one of them), its sums back to nothing. */
  ck_assert_uint_eq(f->b.waitq.held_job, 0);
  ck_assert_uint_eq(f->b.waitq.job_asked, 0);
  big_close(&g);
}
END_TEST

/* The owner of a's allocations locks mid-job: one not yet offloaded
 * through its lock table (gmb_lock's fast path), which every later slice
 * leaves where it is, bytes intact; one offloaded already through a Lock
 * request (still offering to sleep, as its library reports), which gets
 * its bytes back at once, held.  The job goes on with the rest and b is
 * served. */
START_TEST(job_honours_a_lock_mid_job) {
  struct big g;
  big_open(&g, "host:320MiB", 256);
  struct fx *f = &g.f;
  struct wire_reply rep;
  ck_assert_int_eq(fx_alloc(f, "b", 1002, 192 * MIB, 0, 0, &rep), 0);
  ck_assert_uint_eq(f->b.waitq.held_job, 1);
  int away = -1, kept = -1;
  for (int i = 0; i < g.n; i++) {
    uint32_t st = atomic_load(big_state(&g, i));
    if (st == GMB_LT_OFFLOADED && away < 0) away = i;
    if (st == 0 && kept < 0) kept = i; /* the next slice's first */
  }
  ck_assert_int_ge(away, 0);
  ck_assert_int_ge(kept, 0);
  uint32_t zero = 0;
  ck_assert(atomic_compare_exchange_strong(big_state(&g, kept), &zero, 1));
  struct wire_request req;
  memset(&req, 0, sizeof req);
  req.kind = WIRE_LOCK;
  req.u.lock.id = g.id[away];
  req.sleep_pausable = 1;
  req.sleep_idle_ms = 5000;
  ck_assert_int_eq(fx_request(f, "a", 1001, &req, &rep), 1);
  ck_assert_msg(rep.status == 0, "lock: %s", rep.message);
  ck_assert_int_eq(rep.u.lock.held, 1);
  ck_assert_uint_eq(atomic_load(big_state(&g, away)), 1);
  big_assert_pattern(&g, away);
  int turns = 0;
  while (big_step(&g)) ck_assert_int_lt(++turns, 16);
  const struct wire_reply *rb = big_answer(&g, "b");
  ck_assert_ptr_nonnull(rb);
  ck_assert_msg(rb->status == 0, "b refused: %s", rb->message);
  /* Both locked ones stayed on the device, held, their bytes intact. */
  ck_assert_uint_eq(atomic_load(big_state(&g, kept)), 1);
  ck_assert_uint_eq(atomic_load(big_state(&g, away)), 1);
  big_assert_pattern(&g, kept);
  big_assert_pattern(&g, away);
  atomic_store(big_state(&g, kept), 0);
  atomic_store(big_state(&g, away), 0);
  ck_assert_int_eq(fx_free(f, "b", 1002, rb->u.alloc.id), 0);
  big_restore_all(&g);
  big_close(&g);
}
END_TEST

/* The requester ends mid-job: its held request goes with it, the job
 * ends at the next turn without a slice, and what was offloaded for it
 * comes back whole, no host byte left counted. */
START_TEST(job_requester_ends_mid_job) {
  struct big g;
  big_open(&g, "host:320MiB", 256);
  struct fx *f = &g.f;
  struct wire_reply rep;
  ck_assert_int_eq(fx_alloc(f, "b", 1002, 192 * MIB, 0, 0, &rep), 0);
  ck_assert_uint_eq(f->b.waitq.held_job, 1);
  const uint64_t slices = f->b.offload.slices;
  fx_end(f, g.b);
  ck_assert_uint_eq(f->b.waitq.held_job, 0);
  ck_assert_uint_eq(f->b.waitq.n, 0);
  ck_assert_int_eq(big_step(&g), 0);
  ck_assert_uint_eq(f->b.offload.slices, slices);
  ck_assert_uint_eq(f->b.offload.host_bytes, GMB_OFFLOAD_SLICE);
  big_restore_all(&g);
  big_close(&g);
}
END_TEST

/* A job that cannot finish lets its request go with a refusal: here
 * every candidate left is locked after the first slice (a gmb_lock of
 * each, as a busy owner would), so the next slice makes nothing, and b
 * is answered GMB_E_NOMEM (explained) at once rather than at its bound;
 * a job that outlives its bound (10 s) does too. */
START_TEST(job_that_cannot_finish_refuses) {
  struct big g;
  big_open(&g, "host:320MiB", 256);
  struct fx *f = &g.f;
  struct wire_reply rep;
  ck_assert_int_eq(fx_alloc(f, "b", 1002, 192 * MIB, 0, 0, &rep), 0);
  for (int i = 0; i < g.n; i++)
    if (atomic_load(big_state(&g, i)) == 0) atomic_store(big_state(&g, i), 1);
  ck_assert_int_eq(big_step(&g), 0);
  const struct wire_reply *rb = big_answer(&g, "b");
  ck_assert_ptr_nonnull(rb);
  ck_assert_int_eq(rb->status, GMB_E_NOMEM);
  ck_assert_uint_eq(f->b.waitq.n, 0);
  for (int i = 0; i < g.n; i++)
    if (atomic_load(big_state(&g, i)) == 1) atomic_store(big_state(&g, i), 0);
  /* Its bound: the hold ends when the timer finds it past 10 s. */
  ck_assert_int_eq(fx_alloc(f, "d", 1003, 240 * MIB, 0, 0, &rep), 0);
  ck_assert_uint_eq(f->b.waitq.held_job, 1);
  gmb__reclaim_expire(&f->b, gmb__now_ns() + 11 * GMB_NS_PER_S);
  ck_assert_uint_eq(f->b.waitq.held_job, 0);
  const struct wire_reply *rd = big_answer(&g, "d");
  ck_assert_ptr_nonnull(rd);
  ck_assert_int_eq(rd->status, GMB_E_NOMEM);
  ck_assert_int_eq(big_step(&g), 0);
  ck_assert_int_eq(gmb__core_check(&f->b), 0);
  big_restore_all(&g);
  big_close(&g);
}
END_TEST

/* A request the job lets go goes on to the remedy that follows the
 * broker's offload, as one that never went through a job would: the
 * sessions that opted in are asked to pause tags.  Here the broker's
 * bound (offload_host_max 96 MiB) stops the job short of b's lack (128
 * MiB after the 64 free): the next slice can make nothing more, and a,
 * which offers 64 MiB of tags, is asked to pause them for the 32 MiB b
 * still lacks; b is held meanwhile, and served once a gave them back and
 * answered. */
START_TEST(job_let_go_asks_to_pause) {
  struct big g;
  big_open_ini(&g, "host:320MiB",
               "[broker]\ncompaction = off\noffload_host_max = 96MiB\n"
               "sleep_wait_ms = 500\n"
               "[tenant:low]\nuids = 1001\npriority = 0\n"
               "[tenant:high]\nuids = 1002\npriority = 10\n"
               "[tenant:mid]\nuids = 1003\npriority = 10\n"
               "[tenant:other]\nuids = 1004\npriority = 0\n",
               256);
  struct fx *f = &g.f;
  offer(f, "a", 1001, 64 * MIB, 5000);
  struct wire_reply rep;
  ck_assert_int_eq(fx_alloc(f, "b", 1002, 192 * MIB, 0, 0, &rep), 0);
  ck_assert_uint_eq(f->b.waitq.held_job, 1);
  int turns = 0;
  while (big_step(&g)) ck_assert_int_lt(++turns, 16);
  ck_assert_uint_eq(f->b.offload.host_bytes, 96 * MIB);
  /* Let go by the job, still held: a was asked to pause 32 MiB. */
  ck_assert_uint_eq(f->b.waitq.held_job, 0);
  ck_assert_uint_eq(f->b.waitq.n, 1);
  ck_assert_ptr_null(big_answer(&g, "b"));
  const struct fx_sent *ev = fx_last_to(f, "a");
  ck_assert_ptr_nonnull(ev);
  ck_assert_int_eq(ev->rep.kind, WIRE_EVENT);
  ck_assert_int_eq(ev->rep.u.event.kind, WIRE_EVENT_SLEEP);
  ck_assert_int_eq(ev->rep.u.event.mode, WIRE_SLEEP_ASK);
  ck_assert_uint_eq(ev->rep.u.event.bytes, 32 * MIB);
  ck_assert_uint_eq(g.a->ask_bytes, 32 * MIB);
  /* a pauses its tags: its library frees 32 MiB on the device (whole
   * segments), then answers; b is served; the rest comes back. */
  big_ask_answered(&g, 32, 32 * MIB);
}
END_TEST

/* c's answered allocations: their ids in ids[] (up to cap); returns how
 * many the tap recorded. */
static int big_served(struct big *g, const char *rid, uint64_t *ids, int cap) {
  int n = 0;
  for (size_t i = 0; i < g->f.n_sent; i++) {
    const struct fx_sent *x = &g->f.sent[i];
    if (strcmp(x->rid, rid) != 0 || x->rep.kind != WIRE_ALLOC ||
        x->rep.status != 0)
      continue;
    if (n < cap) ids[n] = x->rep.u.alloc.id;
    n++;
  }
  return n;
}

/* The room the job makes is its requests': a stream of c's requests (of
 * a lower priority than b's, 4 MiB each, four a turn) between slices
 * does not take it.  b is served at the slice that makes its room (the
 * second: 64 MiB free, two slices of 64), not later; c's requests meet
 * the fence, lack room, and join the job, which makes theirs after b's. */
START_TEST(job_room_fenced_from_a_stream) {
  struct big g;
  big_open(&g, "host:320MiB", 256);
  struct fx *f = &g.f;
  struct wire_reply rep;
  ck_assert_int_eq(fx_alloc(f, "b", 1002, 192 * MIB, 0, 0, &rep), 0);
  ck_assert_uint_eq(f->b.offload.slices, 1);
  enum { PER_TURN = 4 };
  int turns = 0, more = 1, sent = 0;
  while (big_answer(&g, "b") == NULL) {
    ck_assert_int_lt(++turns, 8);
    for (int i = 0; i < PER_TURN; i++, sent++)
      (void)fx_alloc(f, "c", 1004, 4 * MIB, 0, 0, &rep);
    more = big_step(&g);
  }
  const struct wire_reply *rb = big_answer(&g, "b");
  ck_assert_msg(rb->status == 0, "b refused: %s", rb->message);
  ck_assert_msg(f->b.offload.slices == 2,
                "b served at slice %" PRIu64 " (a stream took its room)",
                f->b.offload.slices);
  ck_assert_uint_ge(f->b.waitq.fenced, PER_TURN);
  const uint64_t b_id = rb->u.alloc.id;
  /* c's requests, held for the job, are served after b's. */
  while (more) {
    ck_assert_int_lt(++turns, 32);
    more = big_step(&g);
  }
  uint64_t c_ids[PER_TURN * 8];
  const int served = big_served(&g, "c", c_ids, PER_TURN * 8);
  ck_assert_int_eq(served, sent);
  ck_assert_uint_eq(f->b.waitq.n, 0);
  ck_assert_int_eq(fx_free(f, "b", 1002, b_id), 0);
  for (int i = 0; i < served; i++)
    ck_assert_int_eq(fx_free(f, "c", 1004, c_ids[i]), 0);
  big_restore_all(&g);
  big_close(&g);
}
END_TEST

#define INI_FENCE                                                   \
  INI_JOB "[tenant:top]\nuids = 1005\npriority = 20\n"              \
          "[tenant:under]\nuids = 1006\npriority = -5\n"

/* The fence lets through a request of a higher priority than the job's
 * first: e (priority 20, above b's 10) is served at once from the room
 * made for b.  It holds back one of a lower priority that has no idle
 * session of its own to take from: u's gmb_alloc_wait waits in the
 * queue, and is served as soon as the job lets b go (its candidates all
 * locked), the fence lifted with it: no request waits on a job that is
 * over. */
START_TEST(job_fence_passes_higher_and_lifts) {
  struct big g;
  big_open_ini(&g, "host:320MiB", INI_FENCE, 256);
  struct fx *f = &g.f;
  fx_hello(f, "e", 1005, "top");
  fx_hello(f, "u", 1006, "under");
  struct wire_reply rep;
  ck_assert_int_eq(fx_alloc(f, "b", 1002, 192 * MIB, 0, 0, &rep), 0);
  ck_assert_uint_eq(f->b.waitq.held_job, 1);
  const uint64_t fenced = f->b.waitq.fenced;
  ck_assert_int_eq(fx_alloc(f, "e", 1005, 4 * MIB, 0, 0, &rep), 1);
  ck_assert_msg(rep.status == 0, "e refused: %s", rep.message);
  const uint64_t e_id = rep.u.alloc.id;
  ck_assert_uint_eq(f->b.waitq.fenced, fenced);
  ck_assert_int_eq(fx_alloc(f, "u", 1006, 4 * MIB, 0, 60000, &rep), 0);
  ck_assert_uint_eq(f->b.waitq.fenced, fenced + 1);
  ck_assert_uint_eq(f->b.waitq.held_job, 1); /* u did not join */
  ck_assert_uint_eq(f->b.waitq.n, 2);
  ck_assert_ptr_null(big_answer(&g, "u"));
  for (int i = 0; i < g.n; i++)
    if (atomic_load(big_state(&g, i)) == 0) atomic_store(big_state(&g, i), 1);
  ck_assert_int_eq(big_step(&g), 0);
  const struct wire_reply *rb = big_answer(&g, "b");
  ck_assert_ptr_nonnull(rb);
  ck_assert_int_eq(rb->status, GMB_E_NOMEM);
  const struct wire_reply *ru = big_answer(&g, "u");
  ck_assert_ptr_nonnull(ru);
  ck_assert_msg(ru->status == 0, "u refused: %s", ru->message);
  ck_assert_uint_eq(f->b.waitq.n, 0);
  for (int i = 0; i < g.n; i++)
    if (atomic_load(big_state(&g, i)) == 1) atomic_store(big_state(&g, i), 0);
  ck_assert_int_eq(fx_free(f, "u", 1006, ru->u.alloc.id), 0);
  ck_assert_int_eq(fx_free(f, "e", 1005, e_id), 0);
  big_restore_all(&g);
  big_close(&g);
}
END_TEST

/* A waiter ahead of the job's first request in the queue's order passes
 * the fence: the queue serves it first anyway.  d (priority 10, as b's)
 * waits for 8 MiB while every candidate is locked (no job can start for
 * it); then b starts a job behind it, and d is served at the job's next
 * slice from the room made, b after it. */
START_TEST(job_fence_passes_waiters_ahead) {
  struct big g;
  big_open(&g, "host:320MiB", 256);
  struct fx *f = &g.f;
  struct wire_reply rep;
  ck_assert_int_eq(fx_alloc(f, "b", 1002, 64 * MIB, 0, 0, &rep), 1);
  ck_assert_msg(rep.status == 0, "b's first: %s", rep.message);
  const uint64_t b_first = rep.u.alloc.id;
  for (int i = 0; i < g.n; i++) atomic_store(big_state(&g, i), 1);
  ck_assert_int_eq(fx_alloc(f, "d", 1003, 8 * MIB, 0, 60000, &rep), 0);
  ck_assert_uint_eq(f->b.waitq.n, 1);
  ck_assert_uint_eq(f->b.waitq.held_job, 0);
  for (int i = 0; i < g.n; i++) atomic_store(big_state(&g, i), 0);
  ck_assert_int_eq(fx_alloc(f, "b", 1002, 128 * MIB, 0, 0, &rep), 0);
  ck_assert_uint_eq(f->b.waitq.held_job, 1);
  ck_assert_ptr_null(big_answer(&g, "d"));
  const uint64_t fenced = f->b.waitq.fenced;
  big_step(&g);
  const struct wire_reply *rd = big_answer(&g, "d");
  ck_assert_ptr_nonnull(rd);
  ck_assert_msg(rd->status == 0, "d refused: %s", rd->message);
  ck_assert_uint_eq(f->b.waitq.fenced, fenced);
  int turns = 0;
  while (big_step(&g)) ck_assert_int_lt(++turns, 16);
  const struct wire_reply *rb = big_answer(&g, "b");
  ck_assert_ptr_nonnull(rb);
  ck_assert_msg(rb->status == 0, "b refused: %s", rb->message);
  ck_assert_int_eq(fx_free(f, "b", 1002, rb->u.alloc.id), 0);
  ck_assert_int_eq(fx_free(f, "b", 1002, b_first), 0);
  ck_assert_int_eq(fx_free(f, "d", 1003, rd->u.alloc.id), 0);
  big_restore_all(&g);
  big_close(&g);
}
END_TEST

/* A request whose job bound (10 s) comes goes the way of one a slice can
 * make nothing more for: the sessions that opted in are asked to pause
 * tags for what it still lacks, and it is held within the asks' bound
 * rather than refused at once.  b lacks 64 MiB after its first slice; at
 * its bound a, which offers 64 MiB of tags, is asked to pause them; b is
 * served once a gave them back and answered. */
START_TEST(job_bound_lets_go_to_asks) {
  struct big g;
  big_open_ini(&g, "host:320MiB",
               "[broker]\ncompaction = off\nsleep_wait_ms = 500\n"
               "[tenant:low]\nuids = 1001\npriority = 0\n"
               "[tenant:high]\nuids = 1002\npriority = 10\n"
               "[tenant:mid]\nuids = 1003\npriority = 10\n"
               "[tenant:other]\nuids = 1004\npriority = 0\n",
               256);
  struct fx *f = &g.f;
  offer(f, "a", 1001, 64 * MIB, 5000);
  struct wire_reply rep;
  ck_assert_int_eq(fx_alloc(f, "b", 1002, 192 * MIB, 0, 0, &rep), 0);
  ck_assert_uint_eq(f->b.waitq.held_job, 1);
  ck_assert_uint_eq(f->b.offload.host_bytes, GMB_OFFLOAD_SLICE);
  /* No turn runs; the loop's timer finds b past its bound. */
  gmb__reclaim_expire(&f->b, gmb__now_ns() + 11 * GMB_NS_PER_S);
  ck_assert_int_eq(gmb__core_check(&f->b), 0);
  ck_assert_uint_eq(f->b.waitq.held_job, 0);
  ck_assert_uint_eq(f->b.waitq.n, 1);
  ck_assert_ptr_null(big_answer(&g, "b"));
  const struct fx_sent *ev = fx_last_to(f, "a");
  ck_assert_ptr_nonnull(ev);
  ck_assert_int_eq(ev->rep.kind, WIRE_EVENT);
  ck_assert_int_eq(ev->rep.u.event.kind, WIRE_EVENT_SLEEP);
  ck_assert_uint_eq(ev->rep.u.event.bytes, 64 * MIB);
  ck_assert_uint_eq(g.a->ask_bytes, 64 * MIB);
  /* a pauses its tags: its library frees 64 MiB, then answers; b is
   * served; the rest comes back. */
  big_ask_answered(&g, 64, 1);
}
END_TEST

/* The job's step reads the sums the queue keeps (what its requests take
 * and were asked, the first of them) and looks at each tenant with
 * requests held, not at every held request: with b's and 32 of d's
 * requests held, a turn looks at 3 (the first, and tenants high and
 * mid), however many are held. */
START_TEST(job_step_walks_no_held_requests) {
  struct big g;
  big_open(&g, "host:320MiB", 288);
  struct fx *f = &g.f;
  struct wire_reply rep;
  ck_assert_int_eq(fx_alloc(f, "b", 1002, 128 * MIB, 0, 0, &rep), 0);
  enum { JOINS = 32 };
  for (uint64_t i = 0; i < JOINS; i++)
    ck_assert_int_eq(fx_alloc(f, "d", 1003, 128 * MIB, 0, 0, &rep), 0);
  ck_assert_uint_eq(f->b.waitq.held_job, 1 + JOINS);
  const uint64_t visits = f->b.waitq.hold_visits;
  ck_assert_int_eq(big_step(&g), 1);
  ck_assert_msg(f->b.waitq.hold_visits - visits <= 3,
                "%" PRIu64 " looked at in one turn with %d requests held",
                f->b.waitq.hold_visits - visits, 1 + JOINS);
  int turns = 0;
  while (big_step(&g)) ck_assert_int_lt(++turns, 256);
  const struct wire_reply *rb = big_answer(&g, "b");
  ck_assert_ptr_nonnull(rb);
  ck_assert_msg(rb->status == 0, "b refused: %s", rb->message);
  ck_assert_uint_eq(f->b.waitq.held_job, 0);
  ck_assert_uint_eq(f->b.waitq.job_want, 0);
  ck_assert_ptr_null(f->b.waitq.job_tenants);
  big_close(&g);
}
END_TEST

/* A request's offload job and an operator's pause that both have work
 * take the loop's turns in turn (gmb__reclaim_slice, the job's first),
 * rather than the pause waiting for the job to end.  a (128 MiB, idle)
 * is what the job takes for b; c (128 MiB movable, tenant other) is what
 * the operator pauses.  After the first slice of each, the next turn is
 * the job's and the one after the pause's. */
START_TEST(job_and_pause_take_turns) {
  struct big g;
  big_open(&g, "host:320MiB", 128);
  struct fx *f = &g.f;
  for (int i = 0; i < 128; i++)
    fx_must_alloc(f, "c", 1004, MIB, GMB_MOVABLE);
  struct gmb_tenant *low = fx_tenant(f, "low"), *other = fx_tenant(f, "other");
  struct wire_reply rep;
  ck_assert_int_eq(fx_alloc(f, "b", 1002, 300 * MIB, 0, 0, &rep), 0);
  ck_assert_uint_eq(f->b.waitq.held_job, 1);
  ck_assert_uint_eq(low->host_bytes, GMB_OFFLOAD_SLICE);
  struct wire_request req;
  memset(&req, 0, sizeof req);
  req.kind = WIRE_ADMIN_PAUSE;
  snprintf(req.u.admin_pause.tenant, sizeof req.u.admin_pause.tenant,
           "other");
  struct gmb_peer p = fx_peer("ctl", geteuid());
  ck_assert_int_eq(gmb__admin(&f->b, &p, &req, &rep), 1);
  ck_assert_msg(rep.status == 0, "pause: %s", rep.message);
  ck_assert_uint_eq(f->b.offload.pausing, 1);
  ck_assert_uint_eq(other->host_bytes, GMB_OFFLOAD_SLICE);
  /* The job's turn. */
  ck_assert_int_eq(gmb__reclaim_slice(&f->b), 1);
  ck_assert_int_eq(gmb__core_check(&f->b), 0);
  ck_assert_uint_eq(low->host_bytes, 2 * GMB_OFFLOAD_SLICE);
  ck_assert_uint_eq(other->host_bytes, GMB_OFFLOAD_SLICE);
  /* The pause's, though the job still holds b. */
  ck_assert_uint_eq(f->b.waitq.held_job, 1);
  gmb__reclaim_slice(&f->b);
  ck_assert_int_eq(gmb__core_check(&f->b), 0);
  ck_assert_uint_eq(other->host_bytes, 2 * GMB_OFFLOAD_SLICE);
  ck_assert_uint_eq(low->host_bytes, 2 * GMB_OFFLOAD_SLICE);
  /* Both made room: b (300 MiB of 320) is served. */
  const struct wire_reply *rb = big_answer(&g, "b");
  ck_assert_ptr_nonnull(rb);
  ck_assert_msg(rb->status == 0, "b refused: %s", rb->message);
  ck_assert_int_eq(gmb__reclaim_slice(&f->b), 0);
  ck_assert_int_eq(fx_free(f, "b", 1002, rb->u.alloc.id), 0);
  req.kind = WIRE_ADMIN_RESUME;
  ck_assert_int_eq(gmb__admin(&f->b, &p, &req, &rep), 1);
  ck_assert_uint_eq(other->host_bytes, 0);
  big_restore_all(&g);
  big_close(&g);
}
END_TEST

/* An operator's pause of a tenant holding four slices' worth of movable
 * memory (a's 256 MiB) copies a slice in its command and the rest a
 * slice a loop turn (the tests drive the turns): the reply counts the
 * first slice and says the rest is under way, status shows the pause
 * running, and another tenant's Alloc and Stats are answered between two
 * slices; a resume mid-way ends it and brings everything back. */
START_TEST(operator_pause_in_slices) {
  struct big g;
  big_open(&g, "host:320MiB", 256);
  struct fx *f = &g.f;
  const int per = (int)(GMB_OFFLOAD_SLICE / MIB);
  struct wire_request req;
  memset(&req, 0, sizeof req);
  req.kind = WIRE_ADMIN_PAUSE;
  snprintf(req.u.admin_pause.tenant, sizeof req.u.admin_pause.tenant, "low");
  struct gmb_peer p = fx_peer("ctl", geteuid());
  struct wire_reply rep;
  const uint64_t slices0 = f->b.offload.slices;
  ck_assert_int_eq(gmb__admin(&f->b, &p, &req, &rep), 1);
  ck_assert_msg(rep.status == 0, "pause: %s", rep.message);
  ck_assert_uint_eq(rep.u.pause.movable, (uint32_t)per);
  ck_assert_uint_eq(rep.u.pause.movable_bytes, GMB_OFFLOAD_SLICE);
  ck_assert_ptr_nonnull(strstr(rep.message, "the rest a slice a loop turn"));
  ck_assert_uint_eq(f->b.offload.slices, slices0 + 1);
  ck_assert_int_eq(big_offloaded(&g), per);
  struct wire_reply st;
  memset(&st, 0, sizeof st);
  gmb__observe_status(&f->b, &st);
  ck_assert_uint_eq(st.u.admin_status.offload_pauses, 1);
  gmb__wire_reply_clear(&st);
  /* The turns: between two slices, c's Alloc and Stats are answered, and
   * each slice adds one slice's worth. */
  uint64_t c_ids[8];
  int steps = 0, more;
  do {
    ck_assert_int_lt(steps, 8);
    ck_assert_int_eq(fx_alloc(f, "c", 1004, MIB, 0, 0, &rep), 1);
    ck_assert_msg(rep.status == 0, "c refused: %s", rep.message);
    c_ids[steps] = rep.u.alloc.id;
    ck_assert_int_eq(fx_plain(f, "c", 1004, WIRE_STATS, &rep), 1);
    ck_assert_int_eq(rep.status, 0);
    ck_assert_int_eq(big_offloaded(&g), per * (steps + 1));
    more = gmb__reclaim_pause_step(&f->b);
    steps++;
    ck_assert_int_eq(gmb__core_check(&f->b), 0);
    ck_assert_int_eq(gmb__offload_check(&f->b), 0);
  } while (more);
  /* Four slices in all: the command's and three turns'. */
  ck_assert_int_eq(steps, 3);
  ck_assert_uint_eq(f->b.offload.slices, slices0 + 4);
  ck_assert_int_eq(big_offloaded(&g), 256);
  ck_assert_uint_eq(f->b.offload.pausing, 0);
  memset(&st, 0, sizeof st);
  gmb__observe_status(&f->b, &st);
  ck_assert_uint_eq(st.u.admin_status.offload_pauses, 0);
  gmb__wire_reply_clear(&st);
  ck_assert_int_eq(gmb__reclaim_pause_step(&f->b), 0);
  ck_assert_uint_eq(f->b.offload.slices, slices0 + 4);
  for (int i = 0; i < steps; i++)
    ck_assert_int_eq(fx_free(f, "c", 1004, c_ids[i]), 0);
  /* A resume mid-way ends the pause: everything back, no slice more. */
  req.kind = WIRE_ADMIN_RESUME;
  ck_assert_int_eq(gmb__admin(&f->b, &p, &req, &rep), 1);
  ck_assert_int_eq(big_offloaded(&g), 0);
  req.kind = WIRE_ADMIN_PAUSE;
  ck_assert_int_eq(gmb__admin(&f->b, &p, &req, &rep), 1);
  ck_assert_int_eq(big_offloaded(&g), per);
  ck_assert_uint_eq(f->b.offload.pausing, 1);
  req.kind = WIRE_ADMIN_RESUME;
  ck_assert_int_eq(gmb__admin(&f->b, &p, &req, &rep), 1);
  ck_assert_uint_eq(f->b.offload.pausing, 0);
  ck_assert_int_eq(big_offloaded(&g), 0);
  const uint64_t slices1 = f->b.offload.slices;
  ck_assert_int_eq(gmb__reclaim_pause_step(&f->b), 0);
  ck_assert_uint_eq(f->b.offload.slices, slices1);
  big_restore_all(&g);
  big_close(&g);
}
END_TEST

static Suite *offload_suite(void) {
  Suite *s = suite_create("offload");
  TCase *tc = tcase_create("offload");
  tcase_add_test(tc, offload_then_lock_brings_back);
  tcase_add_test(tc, sessions_of_a_tenant_share_segments);
  tcase_add_test(tc, free_and_end_while_offloaded);
  tcase_add_test(tc, host_quota_bounds);
  tcase_add_test(tc, offload_brings_holes_down);
  tcase_add_test(tc, broker_bound);
  tcase_add_test(tc, offload_off);
  tcase_add_test(tc, locked_stays);
  tcase_add_test(tc, only_opted_in_for_higher);
  tcase_add_test(tc, lock_waits_for_room);
  tcase_add_test(tc, operator_pause_resume);
  tcase_add_test(tc, client_writes_state_bits);
  tcase_add_test(tc, client_rewrites_offloaded_slot);
  tcase_add_test(tc, lock_of_foreign_freed_and_flooded_ids);
  tcase_add_test(tc, end_while_lock_waits);
  tcase_add_test(tc, idle_flag_makes_only_itself_a_victim);
  tcase_add_test(tc, one_walk_however_many_idle_sessions);
  tcase_add_test(tc, host_quota_shared_with_paused_tags);
  tcase_add_test(tc, default_host_quota_bounds_adhoc);
  tcase_add_test(tc, host_memory_and_copies_fail);
  tcase_add_test(tc, sleep_record_out_of_memory);
  tcase_add_test(tc, chunks_freed_out_of_order);
  tcase_add_test(tc, hostile_mix_keeps_the_sums);
  suite_add_tcase(s, tc);
  TCase *job = tcase_create("job");
  tcase_add_test(job, job_slices_and_others_served_between);
  tcase_add_test(job, job_two_requesters_both_served);
  tcase_add_test(job, job_joins_walk_no_held_requests);
  tcase_add_test(job, job_honours_a_lock_mid_job);
  tcase_add_test(job, job_requester_ends_mid_job);
  tcase_add_test(job, job_that_cannot_finish_refuses);
  tcase_add_test(job, job_let_go_asks_to_pause);
  tcase_add_test(job, operator_pause_in_slices);
  tcase_add_test(job, job_room_fenced_from_a_stream);
  tcase_add_test(job, job_fence_passes_higher_and_lifts);
  tcase_add_test(job, job_fence_passes_waiters_ahead);
  tcase_add_test(job, job_bound_lets_go_to_asks);
  tcase_add_test(job, job_step_walks_no_held_requests);
  tcase_add_test(job, job_and_pause_take_turns);
  suite_add_tcase(s, job);
  return s;
}

int main(void) { return check_run(offload_suite()); }
