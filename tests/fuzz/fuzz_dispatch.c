/*
 * fuzz_dispatch.c - libFuzzer target: a client's or an operator's bytes,
 * decoded by the wire codec (proto/wire.c) and handled by a whole broker
 * in this process (broker/dispatch.c, broker/admin.c and everything below
 * them), the way the loop does it (loop.c, loop_take) but without sockets:
 * the sender is tapped, as in tests/unit/broker_fixture.h.  Between two
 * messages the loop's work in slices runs one step each, as in the loop's
 * turn: the freeing of ended sessions, a compaction in progress, and a
 * slice of the broker's offload job for held requests or of an operator's
 * pause (taking turns; only in a turn whose messages ran no slice).
 *
 * An input is a sequence of records, each one message:
 *
 *   byte 0    who: bits 0-1 the client (routing ids "a".."d", uids 1000,
 *             1000, 1001 and 4242, an admin uid), bit 2 the admin socket
 *             instead of the client socket; 0xff is not a message but
 *             "time passes": waiting requests expire, asks of caches run
 *             out (and held requests fall through), the compaction
 *             timer fires, and the loop's reaping of idle default tenants
 *   bytes 1-2 the frame's length, little-endian (cut to what is left)
 *   then      the frame, decoded with gmb__wire_request_decode
 *
 * Each input gets a fresh broker (config from a file in a scratch dir, so
 * that reload reads it again; a 16 MiB host device; small limits, so the
 * refusals are reached).  After every message, and after the compaction
 * that an admin compact starts has run to its end, the broker's
 * consistency check (gmb__core_check, pool and tenants) must be 0; at the
 * end of the input the broker is closed, which must free everything
 * (ASan's leak check).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "admin.h"
#include "broker.h"
#include "config.h"
#include "core.h"
#include "defrag.h"
#include "dispatch.h"
#include "fuzz.h"
#include "fuzz_broker.h"
#include "gmb.h"
#include "log.h"
#include "reclaim.h"
#include "statefile.h"
#include "util.h"
#include "waitq.h"
#include "wire.h"

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t len);

static char fz_ini[128];
static uint64_t fz_sent;

static const char *const fz_rids[4] = {"a", "b", "c", "d"};
static const uid_t fz_uids[4] = {1000, 1000, 1001, 4242};

static const char fz_config[] =
    "[broker]\n"
    "admin_uids = 4242\n"
    "max_sessions = 6\n"
    "max_sessions_per_uid = 3\n"
    "max_tenants_per_uid = 3\n"
    "max_waiters_per_session = 3\n"
    "max_waiters_per_tenant = 5\n"
    "compaction_threshold = 0.2\n"
    "[tenant:llm-a]\n"
    "quota = 8MiB\n"
    "uids = 1000\n"
    "[tenant:batch]\n"
    "quota = 6MiB\n"
    "reserve = 2MiB\n"
    "priority = 5\n"
    "[tenant:tok]\n"
    "token_sha256 = "
    "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08\n";

static void fz_tap(void *ctx, enum gmb_socket sock, const uint8_t *rid,
                   size_t rid_len, const struct wire_reply *rep) {
  (void)ctx;
  (void)sock;
  FZ_ASSERT(rid_len > 0 && rid != NULL);
  FZ_ASSERT(rep->status <= 0);
  FZ_ASSERT(fz_terminated(rep->message, sizeof rep->message));
  fz_sent++;
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc;
  (void)argv;
  fz_broker_ini(fz_config, fz_ini, sizeof fz_ini);
  return 0;
}

/* 1 while the loop would have work in slices. */
static int fz_busy(const struct gmb_broker *b) {
  return b->reap_head || gmb__defrag_busy(b) || b->waitq.held_job ||
         b->offload.pausing;
}

/* One turn's steps, as loop.c's gmb__loop_run takes them after its reads
 * (`slices`: the offload slices counted before the turn's messages). */
static void fz_steps(struct gmb_broker *b, uint64_t slices) {
  if (b->reap_head) gmb__core_reap_step(b, gmb__now_ns() + 1000000);
  if (gmb__defrag_busy(b)) gmb__defrag_tick(b, gmb__now_ns() + 1000000);
  if ((b->waitq.held_job || b->offload.pausing) &&
      b->offload.slices == slices)
    gmb__reclaim_slice(b);
  FZ_ASSERT(gmb__core_check(b) == 0);
}

/* Runs the work in slices to its end, as the loop's turns would (a held
 * request's bound may have to come first: time passes once). */
static void fz_settle(struct gmb_broker *b) {
  for (int i = 0; i < 100000 && fz_busy(b); i++) {
    if (i == 50000) {
      uint64_t later = gmb__now_ns() + UINT64_C(3600) * 1000000000u;
      gmb__waitq_expire(b, later);
      gmb__reclaim_expire(b, later);
    }
    fz_steps(b, b->offload.slices);
  }
  FZ_ASSERT(!fz_busy(b));
  FZ_ASSERT(gmb__core_check(b) == 0);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t len) {
  struct gmb_broker *b = fz_broker_open(fz_ini, fz_tap);
  char err[1024];
  FZ_ASSERT(gmb__statefile_load(b, err, sizeof err) == 0);

  size_t at = 0;
  while (at < len) {
    uint8_t who = data[at++];
    if (who == 0xff) {
      uint64_t later = gmb__now_ns() + UINT64_C(3600) * 1000000000u;
      gmb__waitq_expire(b, later);
      gmb__reclaim_expire(b, later);
      gmb__defrag_timer(b, later);
      fz_settle(b);
      gmb__core_reap(b, 0);
      FZ_ASSERT(gmb__core_check(b) == 0);
      continue;
    }
    size_t n = 0;
    if (at < len) n = data[at++];
    if (at < len) n |= (size_t)data[at++] << 8;
    if (n > len - at) n = len - at;
    const uint8_t *frame = data + at;
    at += n;
    unsigned c = who & 3u;
    struct gmb_peer peer = {.rid = (const uint8_t *)fz_rids[c],
                            .rid_len = 1, .uid = fz_uids[c],
                            .gid = fz_uids[c], .pid = 0};
    struct wire_request req;
    if (gmb__wire_request_decode(frame, n, &req) != 0) continue;
    struct wire_reply rep;
    memset(&rep, 0, sizeof rep);
    const uint64_t slices = b->offload.slices;
    int now;
    if (who & 4u) {
      now = gmb__admin(b, &peer, &req, &rep);
    } else {
      now = gmb__dispatch(b, &peer, &req, &rep);
    }
    if (now) fz_tap(NULL, (who & 4u) ? GMB_SOCK_ADMIN : GMB_SOCK_CLIENT,
                    peer.rid, peer.rid_len, &rep);
    gmb__wire_reply_clear(&rep);
    FZ_ASSERT(gmb__core_check(b) == 0);
    /* The loop's turn goes on with its slices, so requests arrive while
     * allocations are moving, sessions being freed and the offload job
     * copying. */
    fz_steps(b, slices);
  }
  fz_settle(b);
  gmb__defrag_shutdown(b);
  fz_broker_close(b);
  return 0;
}
