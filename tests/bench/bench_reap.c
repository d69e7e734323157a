/*
 * bench_reap.c - how long the broker's loop stalls when sessions that hold
 * many allocations end, ending at once (the baseline, measured in the
 * same run) against ending in slices (core.h: gmb__core_session_end_sliced
 * and gmb__core_reap_step, 1 ms a turn as the loop drives it).
 *
 * Two cases, each on a whole broker in this process (host device, no
 * sockets: replies go to a tap):
 *   - kill9: one session holds BENCH_REAP_N allocations (default 250000,
 *     512 B to 4 KiB, one in eight movable) and its process dies;
 *   - many: BENCH_REAP_SESSIONS sessions (default 1000) of one tenant hold
 *     BENCH_REAP_EACH allocations each (default 250) and all end, one per
 *     turn of the loop, as when ten processes with a hundred sessions each
 *     are killed.
 * A stall is the time of one turn's work: ending a session (at once: its
 * whole free; in slices: what ending it does at once, plus one reap step
 * with a 1 ms deadline).  Printed: the largest stall (wall time, and the
 * turn's CPU time, which a loaded machine's preemption does not inflate)
 * and the total of each way, and the ratios sliced/at-once of the largest
 * stalls.  No
 * figure is asserted (tests/unit/check_session.c checks that the slices
 * free exactly what they should).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "broker.h"
#include "config.h"
#include "core.h"
#include "dispatch.h"
#include "gmb.h"
#include "log.h"
#include "session.h"
#include "util.h"
#include "wire.h"

#define REAP_SLICE_NS GMB_NS_PER_MS /* the loop's LOOP_REAP_NS */

static uint64_t env_u64(const char *name, uint64_t dflt) {
  const char *s = getenv(name);
  return s && *s ? strtoull(s, NULL, 0) : dflt;
}

static void tap(void *ctx, enum gmb_socket sock, const uint8_t *rid,
                size_t rid_len, const struct wire_reply *rep) {
  (void)ctx;
  (void)sock;
  (void)rid;
  (void)rid_len;
  (void)rep;
}

static void open_broker(struct gmb_broker *b) {
  memset(b, 0, sizeof *b);
  gmb__config_defaults(&b->cfg);
  snprintf(b->cfg.device, sizeof b->cfg.device, "host:2GiB");
  b->cfg.compaction = 0;
  b->cfg.max_sessions = 4096;
  b->cfg.max_sessions_per_uid = 4096;
  b->flag_log_level = -1;
  b->reply_tap = tap;
  char err[512];
  if (gmb__core_open(b, err, sizeof err) != 0) {
    fprintf(stderr, "bench_reap: %s\n", err);
    exit(1);
  }
}

static uint64_t next_req = 1;

static struct gmb_session *hello(struct gmb_broker *b, const char *rid) {
  struct gmb_peer p = {.rid = (const uint8_t *)rid, .rid_len = strlen(rid),
                       .uid = 4242, .gid = 4242, .pid = 0};
  struct wire_request req;
  struct wire_reply rep;
  memset(&req, 0, sizeof req);
  req.kind = WIRE_HELLO;
  req.id = next_req++;
  req.u.hello.version = WIRE_PROTOCOL_VERSION;
  snprintf(req.u.hello.tenant, sizeof req.u.hello.tenant, "bench");
  if (gmb__dispatch(b, &p, &req, &rep) != 1 || rep.status != 0) {
    fprintf(stderr, "bench_reap: hello: %s\n", rep.message);
    exit(1);
  }
  return gmb__session_find(b->sessions, (const uint8_t *)rid, strlen(rid));
}

static void allocs(struct gmb_broker *b, const char *rid, uint64_t n) {
  struct gmb_peer p = {.rid = (const uint8_t *)rid, .rid_len = strlen(rid),
                       .uid = 4242, .gid = 4242, .pid = 0};
  for (uint64_t i = 0; i < n; i++) {
    struct wire_request req;
    struct wire_reply rep;
    memset(&req, 0, sizeof req);
    req.kind = WIRE_ALLOC;
    req.id = next_req++;
    req.u.alloc.size = 512u * (1 + i % 8);
    req.u.alloc.flags = (i % 8) ? 0 : GMB_MOVABLE; /* 65536 slots a session */
    if (gmb__dispatch(b, &p, &req, &rep) != 1 || rep.status != 0) {
      fprintf(stderr, "bench_reap: alloc %llu: %s\n", (unsigned long long)i,
              rep.message);
      exit(1);
    }
  }
}

struct stall {
  uint64_t max_ns, total_ns, turns;
  uint64_t cpu_max_ns; /* the same turn's work in this thread's CPU time:
                          what a machine that does not preempt the loop
                          would see */
};

static uint64_t cpu_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static uint64_t turn_cpu0;

static uint64_t turn_begin(void) {
  turn_cpu0 = cpu_ns();
  return gmb__now_ns();
}

static void turn(struct stall *st, uint64_t t0) {
  uint64_t d = gmb__now_ns() - t0, c = cpu_ns() - turn_cpu0;
  if (d > st->max_ns) st->max_ns = d;
  if (c > st->cpu_max_ns) st->cpu_max_ns = c;
  st->total_ns += d;
  st->turns++;
}

/* Ends sessions s[0..n) one per turn, at once or in slices, then lets the
 * slices finish, a turn each. */
static struct stall end_all(struct gmb_broker *b, struct gmb_session **s,
                            size_t n, int sliced) {
  struct stall st = {0, 0, 0, 0};
  for (size_t i = 0; i < n; i++) {
    uint64_t t0 = turn_begin();
    if (sliced) {
      gmb__core_session_end_sliced(b, s[i], "bench");
      if (b->reap_head) gmb__core_reap_step(b, gmb__now_ns() + REAP_SLICE_NS);
    } else {
      gmb__core_session_end(b, s[i], "bench");
    }
    turn(&st, t0);
  }
  while (b->reap_head) {
    uint64_t t0 = turn_begin();
    gmb__core_reap_step(b, t0 + REAP_SLICE_NS);
    turn(&st, t0);
  }
  if (gmb__core_check(b) != 0) {
    fprintf(stderr, "bench_reap: the broker's checks failed\n");
    exit(1);
  }
  return st;
}

static void report(const char *name, const struct stall *once,
                   const struct stall *sliced) {
  printf("reap.%s.at_once_max_ms %.2f\n", name, once->max_ns / 1e6);
  printf("reap.%s.at_once_max_cpu_ms %.2f\n", name, once->cpu_max_ns / 1e6);
  printf("reap.%s.at_once_total_ms %.2f\n", name, once->total_ns / 1e6);
  printf("reap.%s.sliced_max_ms %.2f\n", name, sliced->max_ns / 1e6);
  printf("reap.%s.sliced_max_cpu_ms %.2f\n", name, sliced->cpu_max_ns / 1e6);
  printf("reap.%s.sliced_total_ms %.2f (%llu turns)\n", name,
         sliced->total_ns / 1e6, (unsigned long long)sliced->turns);
  printf("reap.%s.max_stall_ratio %.3f (sliced / at once; CPU time %.3f)\n",
         name,
         once->max_ns ? (double)sliced->max_ns / (double)once->max_ns : 0.0,
         once->cpu_max_ns
             ? (double)sliced->cpu_max_ns / (double)once->cpu_max_ns
             : 0.0);
}

static struct stall run_kill9(uint64_t n, int sliced) {
  struct gmb_broker b;
  open_broker(&b);
  struct gmb_session *s = hello(&b, "victim");
  hello(&b, "other");
  allocs(&b, "victim", n);
  allocs(&b, "other", 100);
  struct stall st = end_all(&b, &s, 1, sliced);
  gmb__core_close(&b);
  gmb__config_free(&b.cfg);
  return st;
}

static struct stall run_many(uint64_t sessions, uint64_t each, int sliced) {
  struct gmb_broker b;
  open_broker(&b);
  struct gmb_session **s = calloc(sessions, sizeof *s);
  if (s == NULL) exit(1);
  for (uint64_t i = 0; i < sessions; i++) {
    char rid[32];
    snprintf(rid, sizeof rid, "s%llu", (unsigned long long)i);
    s[i] = hello(&b, rid);
    allocs(&b, rid, each);
  }
  struct stall st = end_all(&b, s, sessions, sliced);
  free(s);
  gmb__core_close(&b);
  gmb__config_free(&b.cfg);
  return st;
}

int main(void) {
  gmb__log_set_level(GMB_LOG_ERROR);
  uint64_t n = env_u64("BENCH_REAP_N", 250000);
  uint64_t sessions = env_u64("BENCH_REAP_SESSIONS", 1000);
  uint64_t each = env_u64("BENCH_REAP_EACH", 250);
  struct stall a = run_kill9(n, 0), c = run_kill9(n, 1);
  report("kill9", &a, &c);
  a = run_many(sessions, each, 0);
  c = run_many(sessions, each, 1);
  report("many", &a, &c);
  return 0;
}
