/*
 * test_defrag.c - the broker's compaction as its users meet it: the seed's
 * failure (enough free in total, no range large enough) with compaction
 * off and with it on, the operator's AdminCompact, the explanation a
 * GMB_E_NOMEM carries, and compaction started by fragmentation alone.
 *
 * The scenario: a 64 MiB device filled by 1 MiB movable allocations (two
 * per 2 MiB small segment); every other one freed leaves 32 MiB free in 32
 * holes of 1 MiB, no segment empty, nothing outside segments.  An 8 MiB
 * request then fits the free total but no free range.
 */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gmb.h"
#include "harness.h"

#define MIB (UINT64_C(1) << 20)
#define N_BLOCKS 64

/* Fills the device with 1 MiB movable blocks carrying patterns, then frees
 * every other one.  Returns the number kept; ids[] holds them. */
static int fragment(gmb_client *c, gmb_id *ids, unsigned flags) {
  gmb_id all[N_BLOCKS];
  for (int i = 0; i < N_BLOCKS; i++) {
    int rc = gmb_alloc(c, MIB, flags, &all[i]);
    ck_assert_msg(rc == 0, "fill %d: %s", i, gmb_last_error(c));
    void *p = NULL;
    ck_assert_int_eq(gmb_lock(c, all[i], &p), 0);
    harness_pattern_fill(p, MIB, (uint64_t)i + 1);
    ck_assert_int_eq(gmb_unlock(c, all[i]), 0);
  }
  int kept = 0;
  for (int i = 0; i < N_BLOCKS; i++) {
    if (i % 2 == 0) {
      ck_assert_int_eq(gmb_free(c, all[i]), 0);
    } else {
      ids[kept++] = all[i];
    }
  }
  return kept;
}

/* Every kept block still holds its pattern (block i kept at index i/2). */
static void verify(gmb_client *c, const gmb_id *ids, int kept) {
  for (int k = 0; k < kept; k++) {
    void *p = NULL;
    ck_assert_int_eq(gmb_lock(c, ids[k], &p), 0);
    long bad = harness_pattern_check(p, MIB, (uint64_t)(2 * k + 1) + 1);
    ck_assert_msg(bad < 0, "block %d corrupted at byte %ld", k, bad);
    ck_assert_int_eq(gmb_unlock(c, ids[k]), 0);
  }
}

static const char *config_with(const char *compaction) {
  static char buf[512];
  snprintf(buf, sizeof buf,
           "[broker]\ncompaction = %s\ncompaction_threshold = 0.99\n"
           "[tenant:frag]\nquota = 1GiB\n", compaction);
  return buf;
}

START_TEST(seed_fails_with_compaction_off) {
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", config_with("off"));
  gmb_client *c = harness_connect_ok(&b, "frag");
  gmb_id ids[N_BLOCKS];
  int kept = fragment(c, ids, GMB_MOVABLE);
  gmb_id big = 0;
  int rc = gmb_alloc(c, 8 * MIB, 0, &big);
  ck_assert_int_eq(rc, GMB_E_NOMEM);
  const char *why = gmb_last_error(c);
  /* The explanation names the free total and the largest range. */
  ck_assert_msg(strstr(why, "32MiB free in total") != NULL, "%s", why);
  ck_assert_msg(strstr(why, "largest free range is 1MiB") != NULL, "%s", why);
  ck_assert_msg(strstr(why, "compaction is off") != NULL, "%s", why);
  verify(c, ids, kept);
  gmb_disconnect(c);
  harness_broker_stop(&b);
}
END_TEST

START_TEST(seed_succeeds_with_compaction_auto) {
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", config_with("auto"));
  gmb_client *c = harness_connect_ok(&b, "frag");
  gmb_id ids[N_BLOCKS];
  int kept = fragment(c, ids, GMB_MOVABLE);
  gmb_id big = 0;
  int rc = gmb_alloc(c, 8 * MIB, 0, &big);
  ck_assert_msg(rc == 0, "8 MiB after fragmentation: %s", gmb_last_error(c));
  verify(c, ids, kept);
  struct wire_reply rep;
  ck_assert_int_eq(harness_admin_status(&b, &rep), 0);
  ck_assert_uint_ge(rep.u.admin_status.compaction.moves, 1);
  ck_assert_uint_ge(rep.u.admin_status.compaction.segments_released, 4);
  printf("seed: %llu moves, %llu bytes moved, %llu segments released\n",
         (unsigned long long)rep.u.admin_status.compaction.moves,
         (unsigned long long)rep.u.admin_status.compaction.bytes_moved,
         (unsigned long long)rep.u.admin_status.compaction.segments_released);
  gmb__wire_reply_clear(&rep);
  ck_assert_int_eq(gmb_free(c, big), 0);
  gmb_disconnect(c);
  harness_broker_stop(&b);
}
END_TEST

START_TEST(pinned_memory_is_named_in_nomem) {
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", config_with("auto"));
  gmb_client *c = harness_connect_ok(&b, "frag");
  gmb_id ids[N_BLOCKS];
  int kept = fragment(c, ids, 0); /* pinned: compaction cannot help */
  gmb_id big = 0;
  int rc = gmb_alloc(c, 8 * MIB, 0, &big);
  ck_assert_int_eq(rc, GMB_E_NOMEM);
  const char *why = gmb_last_error(c);
  ck_assert_msg(strstr(why, "32MiB cannot be moved") != NULL, "%s", why);
  ck_assert_msg(strstr(why, "held by frag 32MiB") != NULL, "%s", why);
  verify(c, ids, kept);
  gmb_disconnect(c);
  harness_broker_stop(&b);
}
END_TEST

START_TEST(locked_memory_is_not_moved) {
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", config_with("off"));
  gmb_client *c = harness_connect_ok(&b, "frag");
  gmb_id ids[N_BLOCKS];
  int kept = fragment(c, ids, GMB_MOVABLE);
  void *before[N_BLOCKS];
  for (int k = 0; k < kept; k++)
    ck_assert_int_eq(gmb_lock(c, ids[k], &before[k]), 0);
  /* Everything is locked: an operator's compaction moves nothing. */
  void *s = harness_raw_open(b.admin_endpoint);
  struct wire_request req;
  memset(&req, 0, sizeof req);
  req.id = 7;
  req.kind = WIRE_ADMIN_COMPACT;
  struct wire_reply rep;
  ck_assert_int_eq(harness_raw_call(s, &req, &rep), 0);
  ck_assert_int_eq(rep.status, 0);
  ck_assert_int_eq(rep.kind, WIRE_ADMIN_COMPACT);
  ck_assert_uint_eq(rep.u.compact.moves, 0);
  ck_assert_uint_ge(rep.u.compact.skipped_locked, 1);
  for (int k = 0; k < kept; k++) {
    void *p = NULL;
    ck_assert_int_eq(gmb_lock(c, ids[k], &p), 0);
    ck_assert_ptr_eq(p, before[k]);
    ck_assert_int_eq(gmb_unlock(c, ids[k]), 0);
    ck_assert_int_eq(gmb_unlock(c, ids[k]), 0);
  }
  /* Unlocked, the same request moves them and frees segments. */
  req.id = 8;
  ck_assert_int_eq(harness_raw_call(s, &req, &rep), 0);
  ck_assert_int_eq(rep.status, 0);
  ck_assert_uint_ge(rep.u.compact.moves, 1);
  ck_assert_uint_ge(rep.u.compact.segments_released, 1);
  /* An unknown tenant is refused. */
  req.id = 9;
  strcpy(req.u.admin_compact.tenant, "nobody-here");
  ck_assert_int_eq(harness_raw_call(s, &req, &rep), 0);
  ck_assert_int_eq(rep.status, GMB_E_NOENT);
  harness_raw_close(s);
  verify(c, ids, kept);
  gmb_id big = 0;
  ck_assert_int_eq(gmb_alloc(c, 8 * MIB, 0, &big), 0);
  gmb_disconnect(c);
  harness_broker_stop(&b);
}
END_TEST

START_TEST(gmbctl_compact) {
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", config_with("off"));
  gmb_client *c = harness_connect_ok(&b, "frag");
  gmb_id ids[N_BLOCKS];
  int kept = fragment(c, ids, GMB_MOVABLE);
  char out[4096];
  int rc = harness_ctl(&b, out, sizeof out, "compact", "--tenant", "frag",
                       NULL);
  ck_assert_msg(rc == 0, "gmbctl compact: %d: %s", rc, out);
  ck_assert_msg(strstr(out, "compacted frag:") != NULL, "%s", out);
  rc = harness_ctl(&b, out, sizeof out, "--json", "compact", NULL);
  ck_assert_msg(rc == 0, "gmbctl --json compact: %d: %s", rc, out);
  ck_assert_msg(strstr(out, "\"bytes_moved\"") != NULL, "%s", out);
  rc = harness_ctl(&b, out, sizeof out, "compact", "--tenant", NULL);
  ck_assert_int_eq(rc, 2);
  rc = harness_ctl(&b, out, sizeof out, "compact", "--tenant", "ghost", NULL);
  ck_assert_int_eq(rc, 1);
  ck_assert_msg(strstr(out, "GMB_E_NOENT") != NULL, "%s", out);
  rc = harness_ctl(&b, out, sizeof out, "status", NULL);
  ck_assert_int_eq(rc, 0);
  ck_assert_msg(strstr(out, "fragmentation") != NULL, "%s", out);
  verify(c, ids, kept);
  gmb_disconnect(c);
  harness_broker_stop(&b);
}
END_TEST

static int compacted_by_itself(void *arg) {
  const struct harness_broker *b = arg;
  struct wire_reply rep;
  if (harness_admin_status(b, &rep) != 0) return 0;
  int done = rep.u.admin_status.compaction.runs > 0 &&
             rep.u.admin_status.compaction.moves > 0;
  gmb__wire_reply_clear(&rep);
  return done;
}

START_TEST(background_compaction_above_threshold) {
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB",
                       "[broker]\ncompaction = auto\n"
                       "compaction_threshold = 0.3\n");
  gmb_client *c = harness_connect_ok(&b, "bg");
  gmb_id ids[N_BLOCKS];
  int kept = fragment(c, ids, GMB_MOVABLE);
  /* 32 holes of 1 MiB, nothing outside segments: fragmentation 0.97.
   * No request fails; the broker compacts on its own after a while. */
  ck_assert(harness_poll_until(compacted_by_itself, &b, HARNESS_WAIT_MS));
  verify(c, ids, kept);
  gmb_disconnect(c);
  harness_broker_stop(&b);
}
END_TEST

int main(void) {
  return harness_main(HARNESS_SUITE(
      "defrag", "broker", 60,
      seed_fails_with_compaction_off,
      seed_succeeds_with_compaction_auto,
      pinned_memory_is_named_in_nomem,
      locked_memory_is_not_moved,
      gmbctl_compact,
      background_compaction_above_threshold));
}
