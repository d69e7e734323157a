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
 * once without a wait; operators' pause and resume.  The fixture runs the
 * consistency checks (gmb__offload_check and the pool's among them) after
 * every request.
 */
#include <check.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "admin.h"
#include "broker_fixture.h"
#include "check_main.h"
#include "offload.h"
#include "sleep.h"
#include "tenant.h"
#include "util.h"

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

/* A Heartbeat from `rid` offering `pausable` bytes, idle for `idle_ms`. */
static void offer(struct fx *f, const char *rid, uid_t uid, uint64_t pausable,
                  uint64_t idle_ms) {
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

/* An allocation of `size` pinned bytes by `rid` that does not wait:
 * answered at once; returns its status, *id (may be NULL) its id. */
static int ask(struct scene *sc, const char *rid, uid_t uid, uint64_t size,
               uint64_t *id) {
  struct wire_reply rep;
  ck_assert_int_eq(fx_alloc(&sc->f, rid, uid, size, 0, 0, &rep), 1);
  if (id) *id = rep.u.alloc.id;
  return rep.status;
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
  atomic_store(state_of(&sc, i), 0);
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

static Suite *offload_suite(void) {
  Suite *s = suite_create("offload");
  TCase *tc = tcase_create("offload");
  tcase_add_test(tc, offload_then_lock_brings_back);
  tcase_add_test(tc, sessions_of_a_tenant_share_segments);
  tcase_add_test(tc, free_and_end_while_offloaded);
  tcase_add_test(tc, host_quota_bounds);
  tcase_add_test(tc, broker_bound);
  tcase_add_test(tc, offload_off);
  tcase_add_test(tc, locked_stays);
  tcase_add_test(tc, only_opted_in_for_higher);
  tcase_add_test(tc, lock_waits_for_room);
  tcase_add_test(tc, operator_pause_resume);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) { return check_run(offload_suite()); }
