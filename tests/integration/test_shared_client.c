/*
 * test_shared_client.c - one client shared by many threads, under a seeded
 * random mix of every call that takes the client's mutexes, against a real
 * broker (run with its consistency checks after every request,
 * GMB_BROKER_CHECKS), on the host device and on the stand-in CUDA driver.
 *
 * Worker threads of tenant "s" allocate (gmb_alloc, gmb_alloc_wait that
 * must often wait: the tenant's quota and the device are kept nearly
 * full), free, lock and unlock movable allocations, check bytes, use the
 * cache (gmb_malloc_async/gmb_free_async), trim, report, and make tagged
 * allocations that another worker pauses and resumes (gmb_pause/
 * gmb_resume).  Meanwhile the main thread plays another tenant's pressure
 * (its requests make the broker ask "s" for its cached pages) and an
 * operator pausing and resuming tenant "s".
 *
 * Checked: every call returns 0 or an error its documentation names for
 * the situation (a table per call, below); every byte written to a live
 * allocation or block reads back, at the end of each round once every
 * tag is resumed; no call hangs (each round is bounded, the suite has a
 * time limit); the broker stays alive (a failed check aborts it); and
 * after gmb_disconnect the broker holds nothing of the session.
 *
 * Knobs: SEED (printed; the same seed gives the same mix of calls per
 * thread, though not the same interleaving), ROUNDS, ITER (calls per
 * thread per round), THREADS.
 */
#include <check.h>
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "gmb.h"
#include "harness.h"

#define KIB (UINT64_C(1) << 10)
#define MIB (UINT64_C(1) << 20)
#define THREADS_MAX 12
#define LIVE_MAX 24  /* allocations a worker holds at once */
#define BLOCKS_MAX 8 /* cache blocks a worker holds at once */
#define TAGS 2
static const char *const tag_name[TAGS] = {"ta", "tb"};

struct live {
  gmb_id id;
  size_t size;
  uint64_t seed;
  int movable, tagged;
};

struct block {
  void *p;
  size_t size;
  uint64_t seed;
};

struct worker {
  gmb_client *c;
  int idx, cuda, iters;
  uint64_t rng;
  struct live live[LIVE_MAX];
  int n_live;
  struct block blk[BLOCKS_MAX];
  int n_blk;
  pthread_t th;
  uint64_t calls, waits_served, waits_timed_out;
};

/* The first unexpected outcome of any thread, reported by the main one. */
static atomic_int bad;
static char bad_why[1024];
static pthread_mutex_t bad_mu = PTHREAD_MUTEX_INITIALIZER;

static void unexpected(struct worker *w, const char *call, int rc) {
  pthread_mutex_lock(&bad_mu);
  if (atomic_fetch_add(&bad, 1) == 0)
    snprintf(bad_why, sizeof bad_why, "thread %d: %s returned %s: %s",
             w->idx, call, gmb_err_name(rc), gmb_last_error(w->c));
  pthread_mutex_unlock(&bad_mu);
}

/* rc must be 0 or one of the codes listed (terminated by 0). */
static int allowed(struct worker *w, const char *call, int rc, ...) {
  if (rc == 0) return 1;
  va_list ap;
  va_start(ap, rc);
  int ok = 0;
  for (int e; (e = va_arg(ap, int)) != 0;)
    if (e == rc) ok = 1;
  va_end(ap);
  if (!ok) unexpected(w, call, rc);
  return 0;
}

/* A pattern of n bytes from seed: written and read with gmb_write/gmb_read
 * (the CPU cannot touch device memory on a GPU). */
static int fill_alloc(struct worker *w, const struct live *l) {
  char *buf = malloc(l->size);
  if (buf == NULL) return GMB_E_SYSTEM;
  harness_pattern_fill(buf, l->size, l->seed);
  int rc = gmb_write(w->c, l->id, 0, buf, l->size);
  free(buf);
  return rc;
}

/* 0 when the bytes read back, 1 when they differ, else the call's code. */
static int check_alloc(struct worker *w, const struct live *l) {
  char *buf = malloc(l->size);
  if (buf == NULL) return GMB_E_SYSTEM;
  int rc = gmb_read(w->c, l->id, 0, buf, l->size);
  if (rc == 0 && harness_pattern_check(buf, l->size, l->seed) >= 0) rc = 1;
  free(buf);
  return rc;
}

static void corrupt(struct worker *w, const char *what, gmb_id id) {
  pthread_mutex_lock(&bad_mu);
  if (atomic_fetch_add(&bad, 1) == 0)
    snprintf(bad_why, sizeof bad_why, "thread %d: %s %llu: bytes differ",
             w->idx, what, (unsigned long long)id);
  pthread_mutex_unlock(&bad_mu);
}

static size_t rnd_size(struct worker *w) {
  uint64_t r = harness_rnd(&w->rng);
  switch (r % 4) {
    case 0: return (size_t)(512 + r % (8 * KIB));
    case 1: return (size_t)(64 * KIB + r % (256 * KIB));
    case 2: return (size_t)(1 * MIB + r % (1 * MIB));
    default: return (size_t)(2 * MIB + r % (2 * MIB)); /* large: a tail */
  }
}

static void do_alloc(struct worker *w, int wait, int tagged) {
  if (w->n_live == LIVE_MAX) return;
  struct live l = {.size = rnd_size(w), .seed = harness_rnd(&w->rng)};
  l.movable = !tagged && harness_rnd(&w->rng) % 2;
  l.tagged = tagged;
  int t = (int)(harness_rnd(&w->rng) % TAGS);
  if (tagged && gmb_cache_tag(w->c, tag_name[t]) != 0) {
    unexpected(w, "gmb_cache_tag", -1);
    return;
  }
  int rc = wait ? gmb_alloc_wait(w->c, l.size, l.movable ? GMB_MOVABLE : 0,
                                 50 + (int)(harness_rnd(&w->rng) % 250), &l.id)
                : gmb_alloc(w->c, l.size, l.movable ? GMB_MOVABLE : 0, &l.id);
  if (tagged) gmb_cache_tag(w->c, NULL);
  /* GMB_E_INVAL: the tag's allocations are paused (by the application or
   * an operator), or were while the wait was pending. */
  if (!(wait ? allowed(w, "gmb_alloc_wait", rc, GMB_E_QUOTA, GMB_E_NOMEM,
                       GMB_E_TIMEOUT, GMB_E_INVAL, 0)
             : allowed(w, "gmb_alloc", rc, GMB_E_QUOTA, GMB_E_NOMEM,
                       GMB_E_INVAL, 0))) {
    if (wait && rc == GMB_E_TIMEOUT) w->waits_timed_out++;
    if (rc == GMB_E_INVAL && !tagged) unexpected(w, "untagged alloc", rc);
    return;
  }
  if (wait) w->waits_served++;
  /* A tagged allocation's tag may pause before its bytes are written:
   * GMB_E_INVAL, and it is freed (a paused one drops with its copy). */
  rc = fill_alloc(w, &l);
  /* Or an operator's pause offloaded it at once and there is no room to
   * bring it back (TIMEOUT, NOMEM, QUOTA), or its tag, paused for another
   * job, cannot resume now (NOMEM, QUOTA). */
  if (rc) {
    if (!tagged && rc == GMB_E_INVAL) unexpected(w, "gmb_write", rc);
    else allowed(w, "gmb_write", rc, GMB_E_INVAL, GMB_E_TIMEOUT, GMB_E_NOMEM,
                 GMB_E_QUOTA, 0);
    int frc;
    while ((frc = gmb_free(w->c, l.id)) == GMB_E_INVAL) sched_yield();
    allowed(w, "gmb_free", frc, 0);
    return;
  }
  w->live[w->n_live++] = l;
}

static void do_free(struct worker *w) {
  if (w->n_live == 0) return;
  int i = (int)(harness_rnd(&w->rng) % (uint64_t)w->n_live);
  int rc = gmb_free(w->c, w->live[i].id);
  /* GMB_E_INVAL: being paused or resumed right now; kept, freed later. */
  if (!allowed(w, "gmb_free", rc, w->live[i].tagged ? GMB_E_INVAL : 0, 0))
    return;
  w->live[i] = w->live[--w->n_live];
}

static void do_check(struct worker *w) {
  if (w->n_live == 0) return;
  struct live *l = &w->live[harness_rnd(&w->rng) % (uint64_t)w->n_live];
  int rc = check_alloc(w, l);
  if (rc == 1) corrupt(w, "allocation", l->id);
  /* Paused (GMB_E_INVAL), or offloaded by the operator's pause with no
   * room to come back (GMB_E_TIMEOUT, GMB_E_NOMEM, GMB_E_QUOTA). */
  else if (rc)
    allowed(w, "gmb_read", rc, GMB_E_INVAL, GMB_E_TIMEOUT, GMB_E_NOMEM,
            GMB_E_QUOTA, 0);
}

/* Lock a movable one, check its first bytes through the pointer (host
 * device only), unlock. */
static void do_lock(struct worker *w) {
  for (int k = 0; k < w->n_live; k++) {
    struct live *l = &w->live[k];
    if (!l->movable) continue;
    void *p;
    int rc = gmb_lock(w->c, l->id, &p);
    if (!allowed(w, "gmb_lock", rc, GMB_E_TIMEOUT, GMB_E_NOMEM, GMB_E_QUOTA,
                 0))
      return;
    if (!w->cuda && harness_pattern_check(p, l->size, l->seed) >= 0)
      corrupt(w, "locked allocation", l->id);
    rc = gmb_unlock(w->c, l->id);
    allowed(w, "gmb_unlock", rc, 0);
    return;
  }
}

static void do_cache(struct worker *w) {
  if (w->n_blk > 0 && (w->n_blk == BLOCKS_MAX || harness_rnd(&w->rng) % 2)) {
    int i = (int)(harness_rnd(&w->rng) % (uint64_t)w->n_blk);
    struct block *b = &w->blk[i];
    if (!w->cuda && harness_pattern_check(b->p, b->size, b->seed) >= 0)
      corrupt(w, "cache block", (gmb_id)(uintptr_t)b->p);
    allowed(w, "gmb_free_async", gmb_free_async(w->c, b->p, NULL), 0);
    *b = w->blk[--w->n_blk];
    return;
  }
  struct block b = {.size = (size_t)(256 + harness_rnd(&w->rng) % (1 * MIB)),
                    .seed = harness_rnd(&w->rng)};
  int rc = gmb_malloc_async(w->c, b.size, NULL, &b.p);
  if (!allowed(w, "gmb_malloc_async", rc, GMB_E_QUOTA, GMB_E_NOMEM, 0))
    return;
  if (!w->cuda) harness_pattern_fill(b.p, b.size, b.seed);
  w->blk[w->n_blk++] = b;
}

/* The pauser's part: pause or resume one tag (offload: no byte lost). */
static void do_pause(struct worker *w) {
  const char *t = tag_name[harness_rnd(&w->rng) % TAGS];
  if (harness_rnd(&w->rng) % 2) {
    int rc = gmb_pause(w->c, t, GMB_PAUSE_OFFLOAD);
    /* GMB_E_INVAL: an allocation of it is locked (a check's copy holds
     * it), or it is being paused or resumed by someone else; NOENT: no
     * such tag yet in this process. */
    allowed(w, "gmb_pause", rc, GMB_E_INVAL, GMB_E_NOENT, 0);
  } else {
    int rc = gmb_resume(w->c, t);
    allowed(w, "gmb_resume", rc, GMB_E_NOMEM, GMB_E_QUOTA, GMB_E_NOENT,
            GMB_E_INVAL, 0);
  }
}

static void *worker_main(void *arg) {
  struct worker *w = arg;
  int pauser = w->idx == 0;
  for (int i = 0; i < w->iters && !atomic_load(&bad); i++) {
    w->calls++;
    uint64_t r = harness_rnd(&w->rng) % 100;
    if (pauser && r < 30) do_pause(w);
    else if (r < 20) do_alloc(w, 0, 0);
    else if (r < 32) do_alloc(w, 1, 0);
    else if (r < 42) do_alloc(w, (int)(r % 2), 1);
    else if (r < 60) do_free(w);
    else if (r < 68) do_check(w);
    else if (r < 76) do_lock(w);
    else if (r < 92) do_cache(w);
    else if (r < 96)
      allowed(w, "gmb_trim",
              gmb_trim(w->c, (size_t)(harness_rnd(&w->rng) % (4 * MIB))), 0);
    else
      allowed(w, "gmb_cache_report", gmb_cache_report(w->c), 0);
  }
  return NULL;
}

/* Frees one untagged allocation of a worker, its bytes checked first, and
 * the cache's idle pages; never one of worker k0's from index `from` on
 * (those round_check has not checked yet; k0 -1: any).  1 when it was one
 * of k0's before `from`: the ones after it moved down by one, the
 * caller's index with them. */
static int make_room(gmb_client *c, struct worker *w, int n, int k0,
                     int from) {
  ck_assert_int_eq(gmb_trim(c, 0), 0);
  for (int k = 0; k < n; k++)
    for (int i = 0; i < w[k].n_live && !(k == k0 && i >= from); i++) {
      struct live *l = &w[k].live[i];
      if (l->tagged) continue;
      int rc = check_alloc(&w[k], l);
      /* Offloaded, and no room to read it back: another one. */
      if (rc == GMB_E_QUOTA || rc == GMB_E_NOMEM) continue;
      ck_assert_msg(rc == 0, "thread %d allocation %llu: %s", k,
                    (unsigned long long)l->id,
                    rc == 1 ? "bytes differ" : gmb_last_error(c));
      ck_assert_int_eq(gmb_free(c, l->id), 0);
      if (k != k0) {
        *l = w[k].live[--w[k].n_live];
        return 0;
      }
      memmove(l, l + 1, (size_t)(w[k].n_live - i - 1) * sizeof *l);
      w[k].n_live--;
      return 1;
    }
  return 0;
}

/* After a round: every tag resumed (the operator's and the
 * application's), then every byte of every live allocation and block. */
static void round_check(const struct harness_broker *b, gmb_client *c,
                        struct worker *w, int n) {
  char out[4096];
  int rc = harness_ctl(b, out, sizeof out, "resume", "s", NULL);
  ck_assert_msg(rc == 0, "gmbctl resume: %s", out);
  for (int t = 0; t < TAGS; t++) {
    rc = -1;
    for (int i = 0; i < HARNESS_WAIT_MS / 5 && rc != 0 && rc != GMB_E_NOENT;
         i++) {
      rc = gmb_resume(c, tag_name[t]);
      /* Paused, the tag gave its quota to what the workers allocated
       * since: room is made by freeing untagged allocations (their bytes
       * checked first) and the cache's idle pages. */
      if (rc == GMB_E_QUOTA || rc == GMB_E_NOMEM) make_room(c, w, n, -1, 0);
      else if (rc != 0 && rc != GMB_E_NOENT) harness_sleep_ms(5);
    }
    ck_assert_msg(rc == 0 || rc == GMB_E_NOENT, "resume %s: %s", tag_name[t],
                  gmb_last_error(c));
  }
  for (int k = 0; k < n; k++) {
    for (int i = 0; i < w[k].n_live; i++) {
      rc = -1;
      /* An operator's resume is carried out by the library thread.  An
       * allocation the broker offloaded comes back to be read, which the
       * quota may not have room for after the resumes: room is made as
       * for them, from allocations checked already or not this worker's. */
      for (int j = 0; j < HARNESS_WAIT_MS / 5 && rc != 0 && rc != 1; j++) {
        rc = check_alloc(&w[k], &w[k].live[i]);
        if (rc == GMB_E_QUOTA || rc == GMB_E_NOMEM)
          i -= make_room(c, w, n, k, i);
        else if (rc != 0 && rc != 1)
          harness_sleep_ms(5);
      }
      ck_assert_msg(rc == 0, "thread %d allocation %llu (%zu bytes): %s", k,
                    (unsigned long long)w[k].live[i].id, w[k].live[i].size,
                    rc == 1 ? "bytes differ" : gmb_last_error(c));
    }
    for (int i = 0; i < w[k].n_blk && !w[k].cuda; i++)
      ck_assert_msg(harness_pattern_check(w[k].blk[i].p, w[k].blk[i].size,
                                          w[k].blk[i].seed) < 0,
                    "thread %d cache block %p: bytes differ", k,
                    w[k].blk[i].p);
  }
}

/* The main thread's part during a round: another tenant's pressure and an
 * operator's pauses, until the workers are done. */
struct pressure {
  gmb_client *o;
  gmb_id id[64];
  int n;
};

static void pressure_step(const struct harness_broker *b, struct pressure *p,
                          uint64_t *rng) {
  uint64_t r = harness_rnd(rng) % 10;
  if (r < 5 && p->n < 64) {
    gmb_id id;
    /* A short wait when the device is full, the pressure's point: the
     * broker asks "s" for its cache's idle pages meanwhile. */
    int rc = gmb_alloc_wait(p->o,
                            (size_t)(1 * MIB + harness_rnd(rng) % (15 * MIB)),
                            0, 50, &id);
    ck_assert_msg(rc == 0 || rc == GMB_E_NOMEM || rc == GMB_E_TIMEOUT,
                  "pressure alloc: %s", gmb_last_error(p->o));
    if (rc == 0) p->id[p->n++] = id;
  } else if (r < 8 && p->n > 0) {
    int i = (int)(harness_rnd(rng) % (uint64_t)p->n);
    ck_assert_int_eq(gmb_free(p->o, p->id[i]), 0);
    p->id[i] = p->id[--p->n];
  } else if (r == 8) {
    char out[4096];
    int rc = harness_ctl(b, out, sizeof out, "pause", "s", NULL);
    ck_assert_msg(rc == 0, "gmbctl pause: %s", out);
  } else {
    char out[4096];
    int rc = harness_ctl(b, out, sizeof out, "resume", "s", NULL);
    ck_assert_msg(rc == 0, "gmbctl resume: %s", out);
  }
}

static void shared_client_mix(const char *device, int cuda) {
  uint64_t seed = (uint64_t)harness_env_long("SEED", 0);
  if (seed == 0) seed = (uint64_t)time(NULL) ^ (uint64_t)getpid() << 16;
  long rounds = harness_env_long("ROUNDS", 4);
  long iters = harness_env_long("ITER", 300);
  long threads = harness_env_long("THREADS", 6);
  if (threads < 2) threads = 2;
  if (threads > THREADS_MAX) threads = THREADS_MAX;
  printf("shared_client_mix %s: SEED=%llu ROUNDS=%ld ITER=%ld THREADS=%ld\n",
         device, (unsigned long long)seed, rounds, iters, threads);
  fflush(stdout);
  struct harness_broker b;
  /* The tenant's quota and the device both nearly full: waits happen, and
   * the other tenant's requests make the broker ask for cached pages. */
  harness_broker_start(&b, device,
                       "[broker]\nsleep_wait_ms = 200\ntrim_wait_ms = 200\n"
                       "restore_wait_ms = 300\n"
                       "[tenant:s]\nquota = 40MiB\n");
  gmb_client *c = harness_connect_ok(&b, "s");
  struct pressure p = {.o = harness_connect_ok(&b, "p")};
  static struct worker w[THREADS_MAX];
  memset(w, 0, sizeof w);
  atomic_store(&bad, 0);
  uint64_t mrng = seed * 2654435761u + 1;
  for (int k = 0; k < threads; k++) {
    w[k].c = c;
    w[k].idx = k;
    w[k].cuda = cuda;
    w[k].iters = (int)iters;
    w[k].rng = seed + (uint64_t)k * 0x9e3779b97f4a7c15u + 1;
  }
  for (long round = 0; round < rounds; round++) {
    for (int k = 0; k < threads; k++)
      ck_assert_int_eq(pthread_create(&w[k].th, NULL, worker_main, &w[k]),
                       0);
    /* Pressure while they run; the workers' own calls bound the round. */
    for (int i = 0; i < (int)iters / 10; i++) {
      pressure_step(&b, &p, &mrng);
      harness_sleep_ms(2); /* pace only */
    }
    for (int k = 0; k < threads; k++)
      ck_assert_int_eq(pthread_join(w[k].th, NULL), 0);
    ck_assert_msg(atomic_load(&bad) == 0, "SEED=%llu round %ld: %s",
                  (unsigned long long)seed, round, bad_why);
    while (p.n > 0) ck_assert_int_eq(gmb_free(p.o, p.id[--p.n]), 0);
    round_check(&b, c, w, (int)threads);
    ck_assert_msg(harness_broker_alive(&b), "the broker died (its checks)");
  }
  uint64_t calls = 0, served = 0, timed = 0;
  for (int k = 0; k < threads; k++) {
    calls += w[k].calls;
    served += w[k].waits_served;
    timed += w[k].waits_timed_out;
  }
  printf("shared_client_mix %s: %llu calls, %llu waits served, %llu timed "
         "out\n", device, (unsigned long long)calls,
         (unsigned long long)served, (unsigned long long)timed);
  /* What the mix claims to exercise happened: requests waited at the
   * broker, the broker asked for cached pages or pauses, an operator and
   * the application paused tags. */
  struct wire_tenant_row r;
  ck_assert_int_eq(harness_tenant_row(&b, "s", &r), 0);
  char *log = harness_broker_log(&b);
  size_t waited = harness_count(log, "wait for memory");
  free(log);
  printf("shared_client_mix %s: broker: %zu wait lines, %llu trim asks, "
         "%llu pauses, %llu resumes\n", device, waited,
         (unsigned long long)r.trim_asks, (unsigned long long)r.pauses,
         (unsigned long long)r.resumes);
  ck_assert_uint_gt(waited, 0);
  ck_assert_uint_gt(served, 0);
  ck_assert_uint_gt(r.pauses, 0);
  /* Everything given back by hand, then by disconnect: nothing left. */
  for (int k = 0; k < threads; k++) {
    while (w[k].n_live > 0)
      ck_assert_int_eq(gmb_free(c, w[k].live[--w[k].n_live].id), 0);
    while (w[k].n_blk > 0)
      ck_assert_int_eq(gmb_free_async(c, w[k].blk[--w[k].n_blk].p, NULL), 0);
  }
  ck_assert_int_eq(gmb_trim(c, 0), 0);
  gmb_disconnect(c);
  ck_assert_int_eq(harness_tenant_row(&b, "s", &r), 0);
  ck_assert_uint_eq(r.sessions, 0);
  ck_assert_uint_eq(r.used, 0);
  ck_assert_uint_eq(r.allocations, 0);
  ck_assert_uint_eq(r.host_bytes, 0);
  ck_assert_uint_eq(r.paused_tags, 0);
  ck_assert_uint_eq(r.waiting, 0);
  gmb_disconnect(p.o);
  harness_broker_stop(&b);
}

START_TEST(shared_client_mix_host) {
  shared_client_mix("host:64MiB", 0);
}
END_TEST

/* The stand-in CUDA driver (tests/fakecuda), as test_cuda uses it: a
 * device of its own for this broker. */
START_TEST(shared_client_mix_fake_cuda) {
  static char path[PATH_MAX], dev[64];
  const char *bd = harness_build_dir();
  char cwd[PATH_MAX / 2] = "";
  if (bd[0] != '/') ck_assert_ptr_ne(getcwd(cwd, sizeof cwd), NULL);
  snprintf(path, sizeof path, "%s%s%s/fakecuda/libcuda.so.1", cwd,
           cwd[0] ? "/" : "", bd);
  ck_assert_msg(access(path, R_OK) == 0, "no fake driver at %s", path);
  setenv("GMB_LIBCUDA", path, 1);
  setenv("FAKECUDA_TOTAL", "64m", 1);
  unsetenv("FAKECUDA_DEVICES");
  snprintf(dev, sizeof dev, "/tmp/gmbt-fakedev-XXXXXX");
  ck_assert_ptr_nonnull(mkdtemp(dev));
  setenv("FAKECUDA_DIR", dev, 1);
  shared_client_mix("cuda:0", 1);
  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf %s", dev);
  ck_assert_int_eq(system(cmd), 0);
}
END_TEST

int main(void) {
  return harness_main(HARNESS_SUITE("shared_client", "shared_client", 240,
                                    shared_client_mix_host,
                                    shared_client_mix_fake_cuda));
}
