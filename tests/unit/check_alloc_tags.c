/*
 * check_alloc_tags.c - the tags of gmb_alloc allocations (alloc_tags.c)
 * over a fake broker: allocations are malloc'd buffers under increasing
 * ids, a device of fixed room, a host quota, and failures on demand.
 */
#include <check.h>
#include <stdlib.h>
#include <string.h>

#include "alloc_tags.h"
#include "cache.h"
#include "check_main.h"
#include "gmb.h"

#define FAKE_MAX 64

struct fake {
  uint64_t next_id;
  uint64_t ids[FAKE_MAX];
  char *mem[FAKE_MAX];
  uint64_t size[FAKE_MAX];
  uint64_t room;      /* device bytes left */
  uint64_t host, host_quota, device_paused;
  int admits, refuse_admit, fail_alloc_after, allocs, frees, syncs;
  int last_by; /* admit's `by` of the last pause */
};

static struct fake F;
static struct gmb_atags *T;

static int fake_slot(uint64_t id) {
  for (int i = 0; i < FAKE_MAX; i++)
    if (F.ids[i] == id && id) return i;
  return -1;
}

static int fake_alloc(void *ctx, uint64_t size, unsigned flags, uint64_t *id) {
  (void)ctx;
  (void)flags;
  if (F.fail_alloc_after >= 0 && F.allocs >= F.fail_alloc_after)
    return GMB_E_NOMEM;
  if (size > F.room) return GMB_E_NOMEM;
  int i;
  for (i = 0; i < FAKE_MAX && F.ids[i]; i++) {}
  ck_assert_int_lt(i, FAKE_MAX);
  F.ids[i] = ++F.next_id;
  F.mem[i] = calloc(1, size);
  F.size[i] = size;
  F.room -= size;
  F.allocs++;
  *id = F.ids[i];
  return 0;
}

static int fake_free(void *ctx, uint64_t id) {
  (void)ctx;
  int i = fake_slot(id);
  if (i < 0) return GMB_E_NOENT;
  F.room += F.size[i];
  free(F.mem[i]);
  F.mem[i] = NULL;
  F.ids[i] = 0;
  F.frees++;
  return 0;
}

static int fake_copy(void *ctx, uint64_t id, void *host, uint64_t n,
                     int to_device) {
  (void)ctx;
  int i = fake_slot(id);
  ck_assert_int_ge(i, 0);
  ck_assert_uint_le(n, F.size[i]);
  if (to_device)
    memcpy(F.mem[i], host, n);
  else
    memcpy(host, F.mem[i], n);
  return 0;
}

static int fake_sync(void *ctx) {
  (void)ctx;
  F.syncs++;
  return 0;
}

static int fake_admit(void *ctx, int tag, int paused, int mode, int by,
                      uint64_t host, uint64_t device) {
  (void)ctx;
  (void)tag;
  (void)mode;
  F.admits++;
  if (paused) F.last_by = by;
  if (paused) {
    if (F.refuse_admit) return GMB_E_LIMIT;
    if (F.host_quota && F.host + host > F.host_quota) return GMB_E_LIMIT;
    F.host += host;
    F.device_paused += device;
  } else {
    ck_assert_uint_ge(F.host, host);
    ck_assert_uint_ge(F.device_paused, device);
    F.host -= host;
    F.device_paused -= device;
  }
  return 0;
}

static void setup(void) {
  memset(&F, 0, sizeof F);
  F.room = 1 << 20;
  F.fail_alloc_after = -1;
  struct gmb_atag_ops ops = {.alloc = fake_alloc, .free = fake_free,
                             .copy = fake_copy, .sync = fake_sync,
                             .admit = fake_admit};
  T = gmb__atags_new(&ops);
  ck_assert_ptr_nonnull(T);
}

static void teardown(void) {
  gmb__atags_destroy(T);
  for (int i = 0; i < FAKE_MAX; i++) free(F.mem[i]);
}

/* A program's allocation of `size` bytes under tag `tag`, filled with
 * `fill`; its id. */
static uint64_t prog_alloc(uint64_t size, int tag, int fill) {
  uint64_t id;
  ck_assert_int_eq(fake_alloc(NULL, size, 0, &id), 0);
  memset(F.mem[fake_slot(id)], fill, size);
  ck_assert_int_eq(gmb__atags_add(T, id, size, 0, tag), 0);
  return id;
}

/* The bytes behind the program's id now. */
static const char *prog_bytes(uint64_t id) {
  uint64_t cur;
  ck_assert_int_eq(gmb__atags_get(T, id, 0, &cur, NULL), 0);
  int i = fake_slot(cur);
  ck_assert_int_ge(i, 0);
  return F.mem[i];
}

START_TEST(offload_keeps_bytes_under_the_same_id) {
  uint64_t a = prog_alloc(4096, 0, 0x5a), b = prog_alloc(512, 0, 0x11);
  uint64_t other = prog_alloc(1024, 1, 0x22);
  uint64_t room = F.room, locked;
  ck_assert_int_eq(gmb__atags_pause(T, 0, GMB_PAUSE_OFFLOAD, GMB_CACHE_BY_APP, &locked), 0);
  ck_assert_uint_eq(F.room, room + 4096 + 512); /* the device bytes went */
  ck_assert_uint_eq(F.host, 4096 + 512);
  ck_assert_uint_eq(F.device_paused, 4096 + 512);
  ck_assert_int_ge(F.syncs, 1);
  ck_assert(gmb__atags_paused(T, 0));
  ck_assert(!gmb__atags_paused(T, 1));
  uint64_t cur;
  int tag = -1;
  ck_assert_int_eq(gmb__atags_get(T, a, 1, &cur, &tag), GMB_E_INVAL);
  ck_assert_int_eq(tag, 0);
  ck_assert_int_eq(prog_bytes(other)[0], 0x22); /* another tag runs */
  struct gmb_atags_counts n;
  gmb__atags_counts(T, &n);
  ck_assert_uint_eq(n.tagged, 3);
  ck_assert_uint_eq(n.paused, 2);
  ck_assert_uint_eq(n.host, 4096 + 512);

  ck_assert_int_eq(gmb__atags_resume(T, 0), 0);
  ck_assert_uint_eq(F.host, 0);
  ck_assert_uint_eq(F.device_paused, 0);
  ck_assert_int_eq(gmb__atags_get(T, a, 0, &cur, NULL), 0);
  ck_assert_uint_ne(cur, a); /* a new broker id behind the same id */
  for (int i = 0; i < 4096; i++) ck_assert_int_eq(prog_bytes(a)[i], 0x5a);
  for (int i = 0; i < 512; i++) ck_assert_int_eq(prog_bytes(b)[i], 0x11);
  ck_assert(!gmb__atags_paused(T, 0));
}
END_TEST

START_TEST(discard_copies_nothing) {
  uint64_t a = prog_alloc(8192, 3, 0x77), locked;
  ck_assert_int_eq(gmb__atags_pause(T, 3, GMB_PAUSE_DISCARD, GMB_CACHE_BY_APP, &locked), 0);
  ck_assert_uint_eq(F.host, 0);
  ck_assert_uint_eq(F.device_paused, 8192);
  ck_assert_int_eq(gmb__atags_resume(T, 3), 0);
  ck_assert_int_eq(prog_bytes(a)[0], 0); /* new memory, bytes dropped */
  ck_assert_uint_eq(F.device_paused, 0);
}
END_TEST

START_TEST(locked_allocation_refuses_the_pause) {
  uint64_t a = prog_alloc(4096, 0, 1), cur, locked;
  prog_alloc(4096, 0, 2);
  ck_assert_int_eq(gmb__atags_get(T, a, 1, &cur, NULL), 0); /* gmb_lock */
  uint64_t room = F.room;
  ck_assert_int_eq(gmb__atags_pause(T, 0, GMB_PAUSE_OFFLOAD, GMB_CACHE_BY_APP, &locked),
                   GMB_E_INVAL);
  ck_assert_uint_eq(locked, a);
  ck_assert_uint_eq(F.room, room); /* nothing moved */
  ck_assert_int_eq(F.admits, 0);
  ck_assert(!gmb__atags_paused(T, 0));
  gmb__atags_unhold(T, a); /* gmb_unlock */
  ck_assert_int_eq(gmb__atags_pause(T, 0, GMB_PAUSE_OFFLOAD, GMB_CACHE_BY_APP, &locked), 0);
  ck_assert(gmb__atags_paused(T, 0));
}
END_TEST

START_TEST(refused_admit_changes_nothing) {
  uint64_t a = prog_alloc(4096, 0, 9), locked;
  F.host_quota = 1024;
  uint64_t room = F.room;
  ck_assert_int_eq(gmb__atags_pause(T, 0, GMB_PAUSE_OFFLOAD, GMB_CACHE_BY_APP, &locked),
                   GMB_E_LIMIT);
  ck_assert_uint_eq(F.room, room);
  ck_assert_int_eq(prog_bytes(a)[0], 9);
  /* A discard needs no host memory and passes. */
  ck_assert_int_eq(gmb__atags_pause(T, 0, GMB_PAUSE_DISCARD, GMB_CACHE_BY_APP, &locked), 0);
}
END_TEST

START_TEST(resume_without_room_keeps_everything_paused) {
  uint64_t a = prog_alloc(4096, 0, 3), b = prog_alloc(4096, 0, 4), locked;
  ck_assert_int_eq(gmb__atags_pause(T, 0, GMB_PAUSE_OFFLOAD, GMB_CACHE_BY_APP, &locked), 0);
  F.fail_alloc_after = F.allocs + 1; /* the second allocation fails */
  uint64_t room = F.room;
  ck_assert_int_eq(gmb__atags_resume(T, 0), GMB_E_NOMEM);
  ck_assert_uint_eq(F.room, room); /* the first one went back */
  ck_assert(gmb__atags_paused(T, 0));
  ck_assert_uint_eq(F.host, 8192); /* copies kept */
  F.fail_alloc_after = -1;
  ck_assert_int_eq(gmb__atags_resume(T, 0), 0);
  ck_assert_int_eq(prog_bytes(a)[100], 3);
  ck_assert_int_eq(prog_bytes(b)[100], 4);
}
END_TEST

START_TEST(free_while_paused_drops_the_copy) {
  uint64_t a = prog_alloc(4096, 0, 3), cur, host, locked;
  ck_assert_int_eq(gmb__atags_pause(T, 0, GMB_PAUSE_OFFLOAD, GMB_CACHE_BY_APP, &locked), 0);
  ck_assert_int_eq(gmb__atags_free(T, a, &cur, &host), 2);
  ck_assert_uint_eq(host, 4096);
  ck_assert_uint_eq(F.host, 0);
  ck_assert_uint_eq(F.device_paused, 0);
  ck_assert(!gmb__atags_paused(T, 0));
  /* Gone: an untagged id for the table now. */
  ck_assert_int_eq(gmb__atags_free(T, a, &cur, &host), 0);
  ck_assert_int_eq(gmb__atags_resume(T, 0), 0);
  ck_assert_int_eq(F.allocs, 1); /* nothing allocated again */
}
END_TEST

START_TEST(untagged_ids_pass_through) {
  uint64_t cur, host;
  ck_assert_int_eq(gmb__atags_get(T, 42, 1, &cur, NULL), 0);
  ck_assert_uint_eq(cur, 42);
  prog_alloc(512, 0, 1);
  ck_assert_int_eq(gmb__atags_get(T, 42, 1, &cur, NULL), 0);
  ck_assert_uint_eq(cur, 42);
  ck_assert_int_eq(gmb__atags_free(T, 42, &cur, &host), 0);
  ck_assert_uint_eq(cur, 42);
}
END_TEST

START_TEST(free_running_maps_to_the_current_id) {
  uint64_t a = prog_alloc(512, 0, 1), cur, host, locked;
  ck_assert_int_eq(gmb__atags_pause(T, 0, GMB_PAUSE_OFFLOAD, GMB_CACHE_BY_APP, &locked), 0);
  ck_assert_int_eq(gmb__atags_resume(T, 0), 0);
  ck_assert_int_eq(gmb__atags_free(T, a, &cur, &host), 1);
  ck_assert_uint_ne(cur, a);
  ck_assert_int_eq(fake_free(NULL, cur), 0);
  gmb__atags_remove(T, a, 1);
  struct gmb_atags_counts n;
  gmb__atags_counts(T, &n);
  ck_assert_uint_eq(n.tagged, 0);
}
END_TEST

/* A gmb_free claims its record before the broker frees it: a pause of
 * the tag from another thread meanwhile leaves it out (it once took it,
 * copied and freed it at the broker, and the program's free then failed
 * GMB_E_NOENT with the record left paused), and the tag does not look
 * paused.  A free the broker refused gives the record back to the tag. */
START_TEST(free_in_flight_is_left_out_of_a_pause) {
  uint64_t a = prog_alloc(512, 0, 1), b = prog_alloc(1024, 0, 2);
  uint64_t cur, host, locked;
  ck_assert_int_eq(gmb__atags_free(T, a, &cur, &host), 1);
  ck_assert_uint_eq(cur, a);
  ck_assert_int_eq(gmb__atags_paused(T, 0), 0);
  ck_assert_int_eq(gmb__atags_pause(T, 0, GMB_PAUSE_OFFLOAD,
                                    GMB_CACHE_BY_APP, &locked), 0);
  ck_assert_uint_eq(F.device_paused, 1024); /* b only */
  ck_assert_int_ge(fake_slot(a), 0);        /* a not freed by the pause */
  ck_assert_int_eq(gmb__atags_free(T, a, &cur, &host), GMB_E_INVAL);
  ck_assert_int_eq(fake_free(NULL, cur), 0);
  gmb__atags_remove(T, a, 1);
  ck_assert_int_eq(gmb__atags_resume(T, 0), 0);
  /* Refused at the broker: it runs again, and the next pause takes it. */
  ck_assert_int_eq(gmb__atags_free(T, b, &cur, &host), 1);
  gmb__atags_remove(T, b, 0);
  ck_assert_int_eq(gmb__atags_pause(T, 0, GMB_PAUSE_OFFLOAD,
                                    GMB_CACHE_BY_APP, &locked), 0);
  ck_assert_uint_eq(F.device_paused, 1024);
  struct gmb_atags_counts n;
  gmb__atags_counts(T, &n);
  ck_assert_uint_eq(n.tagged, 1);
  ck_assert_uint_eq(n.paused, 1);
}
END_TEST

/* What the sleep policy sees of each tag: running bytes, a locked one
 * (which would refuse the pause), and who paused the rest. */
START_TEST(tags_report_running_held_and_who_paused) {
  uint64_t a = prog_alloc(4096, 0, 1), cur, locked;
  prog_alloc(512, 0, 2);
  uint64_t c = prog_alloc(1024, 5, 3);
  struct gmb_atags_tag t[GMB_ATAGS_TAGS];
  gmb__atags_tags(T, t);
  ck_assert_uint_eq(t[0].running, 4096 + 512);
  ck_assert_uint_eq(t[0].n_running, 2);
  ck_assert_uint_eq(t[0].held, 0);
  ck_assert_uint_eq(t[5].running, 1024);
  ck_assert_uint_eq(t[1].n_running + t[1].n_paused, 0);
  ck_assert_int_eq(gmb__atags_get(T, c, 1, &cur, NULL), 0); /* gmb_lock */
  gmb__atags_tags(T, t);
  ck_assert_uint_eq(t[5].held, c);
  ck_assert_uint_eq(t[5].running, 1024); /* running, though not pausable */
  ck_assert_int_eq(gmb__atags_pause(T, 0, GMB_PAUSE_OFFLOAD,
                                    GMB_CACHE_BY_BROKER, &locked), 0);
  ck_assert_int_eq(F.last_by, GMB_CACHE_BY_BROKER);
  gmb__atags_tags(T, t);
  ck_assert_uint_eq(t[0].running, 0);
  ck_assert_uint_eq(t[0].n_paused, 2);
  ck_assert_uint_eq(t[0].by_mask, 1u << GMB_CACHE_BY_BROKER);
  ck_assert_int_eq(gmb__atags_resume(T, 0), 0);
  gmb__atags_tags(T, t);
  ck_assert_uint_eq(t[0].by_mask, 0);
  ck_assert_uint_eq(t[0].n_running, 2);
  /* An operator's pause is told so, and kept while paused. */
  ck_assert_int_eq(gmb__atags_pause(T, 0, GMB_PAUSE_DISCARD,
                                    GMB_CACHE_BY_OPERATOR, &locked), 0);
  ck_assert_int_eq(F.last_by, GMB_CACHE_BY_OPERATOR);
  gmb__atags_tags(T, t);
  ck_assert_uint_eq(t[0].by_mask, 1u << GMB_CACHE_BY_OPERATOR);
  ck_assert_int_eq(gmb__atags_get(T, a, 1, &cur, NULL), GMB_E_INVAL);
}
END_TEST

/* The sign of activity moves with each tagged allocation made, locked or
 * freed, and not with a look that holds nothing. */
START_TEST(uses_move_with_activity) {
  ck_assert_uint_eq(gmb__atags_uses(T), 0);
  uint64_t a = prog_alloc(512, 0, 1), cur, host;
  uint64_t u = gmb__atags_uses(T);
  ck_assert_uint_gt(u, 0);
  ck_assert_int_eq(gmb__atags_get(T, a, 0, &cur, NULL), 0); /* unlock's */
  ck_assert_uint_eq(gmb__atags_uses(T), u);
  ck_assert_int_eq(gmb__atags_get(T, a, 1, &cur, NULL), 0); /* a lock */
  ck_assert_uint_gt(gmb__atags_uses(T), u);
  u = gmb__atags_uses(T);
  gmb__atags_unhold(T, a);
  ck_assert_int_eq(gmb__atags_free(T, a, &cur, &host), 1);
  ck_assert_uint_gt(gmb__atags_uses(T), u);
}
END_TEST

static Suite *alloc_tags_suite(void) {
  Suite *s = suite_create("alloc_tags");
  TCase *tc = tcase_create("pause");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_add_test(tc, offload_keeps_bytes_under_the_same_id);
  tcase_add_test(tc, discard_copies_nothing);
  tcase_add_test(tc, locked_allocation_refuses_the_pause);
  tcase_add_test(tc, refused_admit_changes_nothing);
  tcase_add_test(tc, resume_without_room_keeps_everything_paused);
  tcase_add_test(tc, free_while_paused_drops_the_copy);
  tcase_add_test(tc, untagged_ids_pass_through);
  tcase_add_test(tc, free_running_maps_to_the_current_id);
  tcase_add_test(tc, free_in_flight_is_left_out_of_a_pause);
  tcase_add_test(tc, tags_report_running_held_and_who_paused);
  tcase_add_test(tc, uses_move_with_activity);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) { return check_run(alloc_tags_suite()); }
