/*
 * check_sleep_policy.c - the sleep policy of a session (sleep_policy.c)
 * over fake tags: what it offers, which tags a broker's ask pauses and in
 * which order, an operator's pause and resume, an ask put off while the
 * session waits for memory, and the resume of a tag that a program thread
 * touches.  The fake's tags stand for whole tags (cache part and gmb_alloc
 * allocations), as client.c's callbacks report them.
 */
#include <check.h>
#include <stdio.h>
#include <string.h>

#include "cache.h"
#include "check_main.h"
#include "gmb.h"
#include "sleep_policy.h"
#include "wire.h"

#define FAKE_TAGS 8
#define SEC (UINT64_C(1000000000))

struct ftag {
  char name[64];
  int running, paused, by, pause_rc;
  uint64_t pausable;
};

static struct fake {
  struct ftag t[FAKE_TAGS];
  unsigned n;
  uint64_t act[4];
  uint64_t trim_gives;
  int resume_fails; /* the next resumes refused GMB_E_NOMEM */
  int pauses, resumes;
  char log[512]; /* "P name mode by;" and "R name;" in call order */
} F;

static struct gmb_sleep_policy *P;

static struct ftag *fake_find(const char *name) {
  for (unsigned i = 0; i < F.n; i++)
    if (strcmp(F.t[i].name, name) == 0) return &F.t[i];
  return NULL;
}

static void fake_log(const char *fmt, const char *name, int a, int b) {
  size_t n = strlen(F.log);
  snprintf(F.log + n, sizeof F.log - n, fmt, name, a, b);
}

static unsigned fake_tags(void *ctx, struct gmb_sleep_tag *out,
                          unsigned cap) {
  (void)ctx;
  for (unsigned i = 0; i < F.n && i < cap; i++) {
    snprintf(out[i].name, sizeof out[i].name, "%s", F.t[i].name);
    out[i].running = F.t[i].running;
    out[i].paused = F.t[i].paused;
    out[i].by = F.t[i].by;
    out[i].pausable = F.t[i].pausable;
  }
  return F.n;
}

static void fake_activity(void *ctx, uint64_t v[4]) {
  (void)ctx;
  memcpy(v, F.act, sizeof F.act);
}

static uint64_t fake_trim(void *ctx) {
  (void)ctx;
  return F.trim_gives;
}

static int fake_pause(void *ctx, const char *tag, int mode, int by) {
  (void)ctx;
  struct ftag *t = fake_find(tag);
  ck_assert_ptr_nonnull(t);
  F.pauses++;
  fake_log("P %s %d %d;", tag, mode, by);
  if (t->pause_rc) return t->pause_rc;
  t->running = 0;
  t->paused = 1;
  t->by = by;
  t->pausable = 0;
  return 0;
}

static int fake_resume(void *ctx, const char *tag) {
  (void)ctx;
  struct ftag *t = fake_find(tag);
  ck_assert_ptr_nonnull(t);
  F.resumes++;
  if (F.resume_fails > 0) {
    F.resume_fails--;
    return GMB_E_NOMEM;
  }
  fake_log("R %s;", tag, 0, 0);
  t->running = 1;
  t->paused = 0;
  return 0;
}

static void fake_tag(const char *name, uint64_t pausable) {
  ck_assert_uint_lt(F.n, FAKE_TAGS);
  struct ftag *t = &F.t[F.n++];
  snprintf(t->name, sizeof t->name, "%s", name);
  t->running = 1;
  t->pausable = pausable;
}

static void setup(void) {
  memset(&F, 0, sizeof F);
  struct gmb_sleep_ops ops = {.tags = fake_tags,
                              .activity = fake_activity,
                              .trim = fake_trim,
                              .pause = fake_pause,
                              .resume = fake_resume};
  P = gmb__sleep_policy_new(&ops);
  ck_assert_ptr_nonnull(P);
}

static void teardown(void) { gmb__sleep_policy_destroy(P); }

/* Sets the policy and marks the session active at time 0: the tests'
 * clock starts there. */
static void policy(const char *spec) {
  char why[256];
  ck_assert_int_eq(gmb__sleep_policy_set(P, spec, why, sizeof why), 0);
  F.act[0]++;
  gmb__sleep_policy_look(P, 0);
}

/* The offer: the pausable bytes of the policy's tags (a tag with a locked
 * allocation reports none), once idle for the policy's time. */
START_TEST(offer_counts_policy_tags_once_idle) {
  policy("idle=1,a,b:discard");
  fake_tag("a", 10);
  fake_tag("b", 20);
  fake_tag("c", 40);   /* not the policy's */
  fake_tag("held", 0); /* a locked allocation: nothing pausable */
  uint64_t idle_ms, now = 100 * SEC;
  F.act[3] = 7; /* an allocation made: active now */
  gmb__sleep_policy_look(P, now);
  ck_assert_uint_eq(gmb__sleep_policy_offer(P, now, &idle_ms), 0);
  gmb__sleep_policy_look(P, now + SEC / 2);
  ck_assert_uint_eq(gmb__sleep_policy_offer(P, now + SEC / 2, &idle_ms), 0);
  gmb__sleep_policy_look(P, now + SEC);
  ck_assert_uint_eq(gmb__sleep_policy_offer(P, now + SEC, &idle_ms), 30);
  ck_assert_uint_eq(idle_ms, 1000);
  /* A lock of a tagged allocation is activity too: the offer goes. */
  F.act[3]++;
  gmb__sleep_policy_look(P, now + 2 * SEC);
  ck_assert_uint_eq(gmb__sleep_policy_offer(P, now + 2 * SEC, &idle_ms), 0);
}
END_TEST

/* The idle flag: set once idle for the policy's time whether or not a tag
 * offers bytes (the broker may then offload movable allocations), cleared
 * by activity and by turning the policy off. */
START_TEST(idle_flag_without_tagged_bytes) {
  policy("idle=1");
  uint64_t idle_ms, now = 10 * SEC;
  gmb__sleep_policy_look(P, SEC / 2);
  ck_assert_int_eq(gmb__sleep_policy_idle(P), 0);
  gmb__sleep_policy_look(P, now);
  ck_assert_int_eq(gmb__sleep_policy_idle(P), 1);
  ck_assert_uint_eq(gmb__sleep_policy_offer(P, now, &idle_ms), 0);
  F.act[3]++; /* a gmb_lock */
  gmb__sleep_policy_look(P, now + SEC / 2);
  ck_assert_int_eq(gmb__sleep_policy_idle(P), 0);
  gmb__sleep_policy_look(P, now + 2 * SEC);
  ck_assert_int_eq(gmb__sleep_policy_idle(P), 1);
  char why[256];
  ck_assert_int_eq(gmb__sleep_policy_set(P, "off", why, sizeof why), 0);
  ck_assert_int_eq(gmb__sleep_policy_idle(P), 0);
}
END_TEST

/* A broker's ask: idle pages first, then the policy's tags in its modes,
 * largest pausable first, by the broker, until the bytes are given. */
START_TEST(ask_pauses_largest_first_until_given) {
  policy("idle=0,a,b:discard,c");
  fake_tag("a", 10);
  fake_tag("b", 20);
  fake_tag("c", 5);
  fake_tag("x", 100); /* not the policy's */
  F.trim_gives = 2;
  gmb__sleep_policy_look(P, SEC);
  gmb__sleep_policy_event(P, 0, WIRE_SLEEP_ASK, "", 25);
  ck_assert(gmb__sleep_policy_pending(P));
  ck_assert_int_eq(gmb__sleep_policy_run(P, SEC), 1);
  ck_assert_str_eq(F.log, "P b 1 1;P a 0 1;");
  ck_assert(!gmb__sleep_policy_pending(P));
  uint64_t idle_ms;
  ck_assert_uint_eq(gmb__sleep_policy_offer(P, SEC, &idle_ms), 0);
}
END_TEST

/* A tag whose pause is refused (an allocation locked since the offer) is
 * passed over; one with nothing pausable is not even tried. */
START_TEST(ask_passes_over_a_refused_tag) {
  policy("idle=0");
  fake_tag("locked", 0);
  fake_tag("big", 30);
  fake_tag("small", 8);
  F.t[1].pause_rc = GMB_E_INVAL;
  gmb__sleep_policy_look(P, SEC);
  gmb__sleep_policy_event(P, 0, WIRE_SLEEP_ASK, "", 10);
  ck_assert_int_eq(gmb__sleep_policy_run(P, SEC), 1);
  ck_assert_str_eq(F.log, "P big 0 1;P small 0 1;");
  ck_assert(F.t[1].running);
  ck_assert(F.t[0].running);
}
END_TEST

/* Active since the offer: the ask is declined (answered, nothing paused). */
START_TEST(active_session_declines) {
  policy("idle=5");
  fake_tag("a", 10);
  F.act[1]++; /* a cache hit at 100 s */
  gmb__sleep_policy_look(P, 100 * SEC);
  gmb__sleep_policy_event(P, 0, WIRE_SLEEP_ASK, "", 10);
  ck_assert_int_eq(gmb__sleep_policy_run(P, 100 * SEC), 1);
  ck_assert_int_eq(F.pauses, 0);
}
END_TEST

/* An operator's pause and the broker's ask queued together: one call
 * carries out both (nothing is put off any more: a thread waiting for
 * memory does not hold the socket), the operator's first. */
START_TEST(operator_pause_and_ask_in_one_run) {
  policy("idle=0");
  fake_tag("a", 10);
  gmb__sleep_policy_look(P, SEC);
  gmb__sleep_policy_event(P, 0, WIRE_SLEEP_ASK, "", 10);
  gmb__sleep_policy_event(P, 0, GMB_PAUSE_DISCARD, "a", 0);
  ck_assert_int_eq(gmb__sleep_policy_run(P, SEC), 1);
  ck_assert_str_eq(F.log, "P a 1 2;");
  ck_assert(!gmb__sleep_policy_pending(P));
  ck_assert_int_eq(gmb__sleep_policy_run(P, SEC), 0); /* nothing left */
}
END_TEST

/* An operator's pause of every tag pauses those with something running,
 * and asks for those the broker paused too, so that they become the
 * operator's (the cache then keeps them paused past their next use); a
 * resume of every tag leaves those the application paused, one naming
 * the tag resumes it whoever paused it. */
START_TEST(operator_pause_and_resume) {
  fake_tag("run", 10);
  fake_tag("app", 0);
  fake_tag("brk", 0);
  F.t[1] = (struct ftag){"app", 0, 1, GMB_CACHE_BY_APP, 0, 0};
  F.t[2] = (struct ftag){"brk", 0, 1, GMB_CACHE_BY_BROKER, 0, 0};
  gmb__sleep_policy_event(P, 0, GMB_PAUSE_OFFLOAD, "", 0);
  ck_assert_int_eq(gmb__sleep_policy_run(P, SEC), 0);
  ck_assert_str_eq(F.log, "P run 0 2;P brk 0 2;");
  ck_assert_int_eq(F.t[2].by, GMB_CACHE_BY_OPERATOR);
  F.log[0] = '\0';
  gmb__sleep_policy_event(P, 1, 0, "", 0);
  ck_assert_int_eq(gmb__sleep_policy_run(P, SEC), 0);
  ck_assert_str_eq(F.log, "R run;R brk;");
  F.log[0] = '\0';
  gmb__sleep_policy_event(P, 1, 0, "app", 0);
  ck_assert_int_eq(gmb__sleep_policy_run(P, SEC), 0);
  ck_assert_str_eq(F.log, "R app;");
}
END_TEST

/* A touched tag resumes by itself only when the broker paused it, trying
 * again while there is no room, within the wait. */
START_TEST(auto_resume_only_for_the_broker) {
  fake_tag("t", 0);
  int by;
  ck_assert_int_eq(gmb__sleep_policy_auto_resume(P, "t", 100, &by), 0);
  ck_assert_int_eq(F.resumes, 0); /* running: nothing to do */
  ck_assert_int_eq(gmb__sleep_policy_auto_resume(P, "none", 100, &by),
                   GMB_E_INVAL);
  F.t[0] = (struct ftag){"t", 0, 1, GMB_CACHE_BY_OPERATOR, 0, 0};
  ck_assert_int_eq(gmb__sleep_policy_auto_resume(P, "t", 100, &by),
                   GMB_E_INVAL);
  ck_assert_int_eq(by, GMB_CACHE_BY_OPERATOR);
  F.t[0].by = GMB_CACHE_BY_APP;
  ck_assert_int_eq(gmb__sleep_policy_auto_resume(P, "t", 100, &by),
                   GMB_E_INVAL);
  ck_assert_int_eq(by, GMB_CACHE_BY_APP);
  ck_assert_int_eq(F.resumes, 0);
  F.t[0].by = GMB_CACHE_BY_BROKER;
  F.resume_fails = 2;
  ck_assert_int_eq(gmb__sleep_policy_auto_resume(P, "t", 10000, &by), 0);
  ck_assert_int_eq(F.resumes, 3);
  F.t[0] = (struct ftag){"t", 0, 1, GMB_CACHE_BY_BROKER, 0, 0};
  F.resume_fails = 1000;
  ck_assert_int_eq(gmb__sleep_policy_auto_resume(P, "t", 0, &by),
                   GMB_E_NOMEM);
  ck_assert(F.t[0].paused);
}
END_TEST

static Suite *sleep_policy_suite(void) {
  Suite *s = suite_create("sleep_policy");
  TCase *tc = tcase_create("policy");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_add_test(tc, offer_counts_policy_tags_once_idle);
  tcase_add_test(tc, idle_flag_without_tagged_bytes);
  tcase_add_test(tc, ask_pauses_largest_first_until_given);
  tcase_add_test(tc, ask_passes_over_a_refused_tag);
  tcase_add_test(tc, active_session_declines);
  tcase_add_test(tc, operator_pause_and_ask_in_one_run);
  tcase_add_test(tc, operator_pause_and_resume);
  tcase_add_test(tc, auto_resume_only_for_the_broker);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) { return check_run(sleep_policy_suite()); }
