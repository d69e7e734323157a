/*
 * bench_lockwait.c - how long a gmb_lock that lands mid-move waits after
 * the move ends: sleeping on the lock word (a futex, woken by the broker's
 * publish; client.c's client_hold now) against the wait it replaced, in
 * the same run: 64 spins, 16 yields, then sleeps from 1 us doubling to
 * 1 ms, looking again after each.
 *
 * The broker's side is the real one (broker/locktab.c: claim, publish),
 * on a real lock table mapped twice as the client maps it; the waiter is
 * a thread that runs a copy of each wait loop (client_hold is static in
 * the library, and the old loop is gone from it).  Each trial: the mover
 * claims the slot, the waiter starts and finds it MOVING, the mover
 * "copies" for BENCH_MOVE_US (default 300) busy microseconds, publishes,
 * and the waiter's lag is the time from the publish to its hold.  Printed
 * over BENCH_TRIALS trials (default 200): median, 90th percentile and
 * largest lag of each way, and their ratios (futex / sleeps).
 */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "gmb.h"
#include "locktab.h"
#include "log.h"
#include "util.h"

static uint64_t env_u64(const char *name, uint64_t dflt) {
  const char *s = getenv(name);
  return s && *s ? strtoull(s, NULL, 0) : dflt;
}

static void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

/* The wait before the futex: spins, yields, sleeps doubling to 1 ms. */
static void hold_sleeps(_Atomic uint32_t *w) {
  uint32_t st = atomic_load_explicit(w, memory_order_acquire);
  unsigned waits = 0;
  long sleep_ns = 1000;
  for (;;) {
    if (!(st & GMB_LT_MOVING) &&
        atomic_compare_exchange_weak_explicit(w, &st, st + 1,
                                              memory_order_acq_rel,
                                              memory_order_acquire))
      return;
    if (!(st & GMB_LT_MOVING)) continue;
    if (waits < 64) {
      relax();
    } else if (waits < 80) {
      sched_yield();
    } else {
      struct timespec ts = {0, sleep_ns};
      nanosleep(&ts, NULL);
      if (sleep_ns < 1000000) sleep_ns = sleep_ns * 2 > 1000000 ? 1000000
                                                                : sleep_ns * 2;
    }
    waits++;
    st = atomic_load_explicit(w, memory_order_acquire);
  }
}

/* The wait now (client.c): spins, then sleeps on the word. */
static void hold_futex(_Atomic uint32_t *w) {
  uint32_t st = atomic_load_explicit(w, memory_order_acquire);
  unsigned waits = 0;
  for (;;) {
    if (!(st & GMB_LT_MOVING)) {
      if (atomic_compare_exchange_weak_explicit(w, &st, st + 1,
                                                memory_order_acq_rel,
                                                memory_order_acquire))
        return;
      continue;
    }
    if (waits < 64) {
      relax();
    } else {
      uint32_t want = GMB_LT_MOVING | GMB_LT_WAITERS;
      if (st == want ||
          atomic_compare_exchange_strong_explicit(w, &st, want,
                                                  memory_order_acq_rel,
                                                  memory_order_acquire))
        gmb__lt_futex_wait(w, want, GMB_LT_WAIT_SLICE_NS);
    }
    waits++;
    st = atomic_load_explicit(w, memory_order_acquire);
  }
}

struct trial {
  _Atomic uint32_t *w;
  int futex;
  _Atomic int started;
  uint64_t held_ns;
};

static void *waiter(void *arg) {
  struct trial *t = arg;
  atomic_store(&t->started, 1);
  if (t->futex)
    hold_futex(t->w);
  else
    hold_sleeps(t->w);
  t->held_ns = gmb__now_ns();
  return NULL;
}

static int cmp_u64(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return (x > y) - (x < y);
}

static void run(struct gmb_locktab *lt, uint32_t slot, _Atomic uint32_t *w,
                int futex, uint64_t trials, uint64_t move_ns, uint64_t *lag) {
  for (uint64_t i = 0; i < trials; i++) {
    if (!gmb__locktab_claim(lt, slot)) abort();
    struct trial t = {.w = w, .futex = futex};
    pthread_t th;
    if (pthread_create(&th, NULL, waiter, &t) != 0) abort();
    while (!atomic_load(&t.started)) sched_yield();
    uint64_t end = gmb__now_ns() + move_ns; /* the copy */
    while (gmb__now_ns() < end) relax();
    uint64_t pub = gmb__now_ns();
    gmb__locktab_publish(lt, slot, 1, 0);
    pthread_join(th, NULL);
    lag[i] = t.held_ns > pub ? t.held_ns - pub : 0;
    /* The waiter holds one: give it back as gmb_unlock would. */
    atomic_fetch_sub_explicit(w, 1, memory_order_release);
  }
  qsort(lag, trials, sizeof *lag, cmp_u64);
}

int main(void) {
  gmb__log_set_level(GMB_LOG_ERROR);
  uint64_t trials = env_u64("BENCH_TRIALS", 200);
  uint64_t move_ns = env_u64("BENCH_MOVE_US", 300) * 1000;
  if (trials == 0) trials = 1;
  char err[256];
  struct gmb_locktab *lt = gmb__locktab_new(1, 4, err, sizeof err);
  if (lt == NULL) {
    fprintf(stderr, "bench_lockwait: %s\n", err);
    return 1;
  }
  /* The client's own mapping of the table. */
  struct gmb__lt_header *h =
      mmap(NULL, gmb__lt_bytes(4), PROT_READ | PROT_WRITE, MAP_SHARED,
           gmb__locktab_fd(lt), 0);
  if (h == MAP_FAILED) return 1;
  uint32_t slot;
  if (gmb__locktab_slot_new(lt, 7, 1, 0, &slot) != 0) return 1;
  _Atomic uint32_t *w = &gmb__lt_slots(h)[slot].state;
  uint64_t *a = calloc(trials, sizeof *a), *b = calloc(trials, sizeof *b);
  if (!a || !b) return 1;
  run(lt, slot, w, 0, trials, move_ns, a);
  run(lt, slot, w, 1, trials, move_ns, b);
  uint64_t p50 = trials / 2, p90 = trials * 9 / 10, mx = trials - 1;
  printf("lockwait.move_us %llu, trials %llu\n",
         (unsigned long long)(move_ns / 1000), (unsigned long long)trials);
  printf("lockwait.sleeps_lag_us p50 %.1f p90 %.1f max %.1f\n", a[p50] / 1e3,
         a[p90] / 1e3, a[mx] / 1e3);
  printf("lockwait.futex_lag_us p50 %.1f p90 %.1f max %.1f\n", b[p50] / 1e3,
         b[p90] / 1e3, b[mx] / 1e3);
  printf("lockwait.ratio_p50 %.3f ratio_p90 %.3f (futex / sleeps)\n",
         a[p50] ? (double)b[p50] / (double)a[p50] : 0.0,
         a[p90] ? (double)b[p90] / (double)a[p90] : 0.0);
  free(a);
  free(b);
  munmap(h, gmb__lt_bytes(4));
  gmb__locktab_destroy(lt);
  return 0;
}
