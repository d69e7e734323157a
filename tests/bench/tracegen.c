/*
 * tracegen.c - writes the allocation traces of the fragmentation suite
 * (tests/bench/frag.sh) in gmb-replay's format.
 *
 *   tracegen [--seed N] [--scale X] llm|train|mixed|adversarial|kv|serving
 *            > FILE
 *
 * Every trace is a function of (kind, seed, scale) only: the random numbers
 * come from a splitmix64 of our own, never from rand() or awk, so the same
 * command writes the same bytes on every machine and libc.
 *
 * What each trace models, and why it fragments:
 *   llm          one inference server: pinned weights, then requests that
 *                take KV-cache blocks (256 KiB, movable) as their sequences
 *                grow and give them all back when they finish, with a load
 *                that swings between busy and quiet; every few scheduler
 *                iterations an activation buffer (8-32 MiB, movable) is
 *                needed while the batch's blocks are locked.  Requests end
 *                out of order, so in a quiet phase the surviving blocks are
 *                scattered over the small segments of the busy phase.
 *   train        a training job: pinned parameters, gradients and optimizer
 *                state; steps of varying batch size whose per-layer
 *                activations (movable) are freed at the end of the step; a
 *                few small buffers per step (statistics, caches) live on for
 *                tens of steps; every 8 steps a large workspace (movable).
 *                The long-lived buffers pin the step's segments.
 *   mixed        two inference servers and a trainer under quotas, their
 *                operations interleaved.  The quotas sum to more than the
 *                device and the servers sometimes burst past their quota.
 *   adversarial  rounds of interleaved small and larger allocations that
 *                fill the device, then every other one freed, then requests
 *                larger than any hole.
 *   kv           three servers with paged KV caches under quotas that sum
 *                to more than the device: each request's blocks are of one
 *                size, 64 KiB to 1 MiB, and 15 % of the blocks are pinned;
 *                activation buffers (4-16 MiB) come between.
 *   serving      the same three servers on a tighter device, with tensors
 *                of the sizes a framework asks for rather than whole
 *                pages: weights as a dozen pinned tensors of 0.6-3.4 MiB,
 *                KV blocks of 96 KiB to 1.5 MiB, activations of 3-13 MiB
 *                in 64 KiB steps.  A large tensor's last page is partly
 *                used, so this is the trace where sharing it counts.
 * Most allocations are movable; weights, optimizer state and a few small
 * buffers are pinned.  Each generator keeps what it holds under a budget,
 * so a failure in the replay is the broker's, not the trace asking for more
 * than the device has (mixed excepted, on purpose).
 *
 * --scale multiplies the number of operations (default 1: ~10-20k each).
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "util.h"

#define KIB (UINT64_C(1) << 10)
#define MIB (UINT64_C(1) << 20)

/* --- random numbers ------------------------------------------------------ */

static uint64_t tg_state;

static uint64_t tg_next(void) { return gmb__splitmix64(&tg_state); }

/* Uniform in [0, 1). */
static double tg_unit(void) { return (double)(tg_next() >> 11) * 0x1.0p-53; }

/* Uniform in [lo, hi]. */
static uint64_t tg_range(uint64_t lo, uint64_t hi) {
  return lo + tg_next() % (hi - lo + 1);
}

/* --- output ---------------------------------------------------------------- */

static uint64_t tg_ops;

static const char *tg_size(uint64_t v, char *buf, size_t cap) {
  if (v % MIB == 0)
    snprintf(buf, cap, "%lluMiB", (unsigned long long)(v / MIB));
  else if (v % KIB == 0)
    snprintf(buf, cap, "%lluKiB", (unsigned long long)(v / KIB));
  else
    snprintf(buf, cap, "%llu", (unsigned long long)v);
  return buf;
}

static void tg_alloc(const char *t, const char *key, uint64_t size,
                     int movable) {
  char b[32];
  printf("alloc %s %s %s%s\n", t, key, tg_size(size, b, sizeof b),
         movable ? " movable" : "");
  tg_ops++;
}

static void tg_op(const char *op, const char *t, const char *key) {
  printf("%s %s %s\n", op, t, key);
  tg_ops++;
}

/* --- one inference server ---------------------------------------------------- */

#define LLM_MAX_REQS 256
#define LLM_MAX_BLOCKS 48

struct llm_req {
  uint32_t id;
  int blocks, target;
  int pinned;     /* holds a small pinned buffer too */
  uint64_t block; /* its KV block size */
};

struct llm {
  const char *t;
  uint64_t budget, live, block;
  int lo, hi, period, max_blocks;
  uint64_t act_min, act_max; /* MiB multiples of 2 */
  struct llm_req reqs[LLM_MAX_REQS];
  int n;
  uint32_t next_id, acts;
  uint64_t iter;
  double burst; /* chance that a request asks past the budget (quota) */
  int paged;    /* each request picks its block size: 64 KiB - 1 MiB */
  int odd;      /* tensors of any size: blocks 96 KiB - 1.5 MiB, and
                   activations in 64 KiB steps */
  double pinned_p; /* chance that a KV block is pinned */
};

static void llm_key(char *k, size_t cap, uint32_t id, int j) {
  if (j < 0)
    snprintf(k, cap, "r%u.meta", id);
  else
    snprintf(k, cap, "r%u.%d", id, j);
}

static void llm_init(struct llm *g, int with_weights, uint64_t weights) {
  if (with_weights) {
    tg_alloc(g->t, "weights", weights, 0);
    g->live += weights;
  }
}

/* A request ends (finished, or preempted): all its memory goes back. */
static void llm_finish(struct llm *g, int i) {
  struct llm_req *r = &g->reqs[i];
  char k[32];
  /* Blocks go back newest first, as a block table is torn down. */
  for (int j = r->blocks - 1; j >= 0; j--) {
    llm_key(k, sizeof k, r->id, j);
    tg_op("free", g->t, k);
    g->live -= r->block;
  }
  if (r->pinned) {
    llm_key(k, sizeof k, r->id, -1);
    tg_op("free", g->t, k);
    g->live -= 64 * KIB;
  }
  g->reqs[i] = g->reqs[--g->n];
}

static int llm_grow(struct llm *g, struct llm_req *r, int force) {
  if (!force && g->live + r->block > g->budget) return 0;
  char k[32];
  llm_key(k, sizeof k, r->id, r->blocks++);
  /* Only the paged trace draws here, so the other traces keep their
   * bytes. */
  int pinned = g->pinned_p > 0 && tg_unit() < g->pinned_p;
  tg_alloc(g->t, k, r->block, !pinned);
  g->live += r->block;
  return 1;
}

/* One scheduler iteration. */
static void llm_step(struct llm *g) {
  g->iter++;
  double phase = sin(2.0 * M_PI * (double)g->iter / g->period);
  int target = g->lo + (int)((g->hi - g->lo) * (0.5 + 0.5 * phase));
  /* Admit a request: its prompt's blocks at once (prefill). */
  if (g->n < target && g->n < LLM_MAX_REQS && tg_unit() < 0.8) {
    struct llm_req *r = &g->reqs[g->n];
    double u = tg_unit();
    r->id = g->next_id++;
    r->block = g->block;
    if (g->paged) /* 64 KiB .. 1 MiB, powers of two */
      r->block = (64 * KIB) << tg_range(0, 4);
    if (g->odd) /* 96 KiB .. 1.5 MiB */
      r->block = (96 * KIB) << tg_range(0, 4);
    r->target = 1 + (int)((g->max_blocks - 1) * u * u);
    r->blocks = 0;
    r->pinned = tg_unit() < 0.05;
    int prompt = 1 + (int)(r->target * (0.2 + 0.4 * tg_unit()));
    int burst = tg_unit() < g->burst;
    if (burst) /* a long prompt that does not look at the budget */
      r->target = prompt = g->max_blocks;
    uint64_t need = (uint64_t)prompt * r->block + (r->pinned ? 64 * KIB : 0);
    if (burst || g->live + need <= g->budget) {
      g->n++;
      if (r->pinned) {
        char k[32];
        llm_key(k, sizeof k, r->id, -1);
        tg_alloc(g->t, k, 64 * KIB, 0);
        g->live += 64 * KIB;
      }
      for (int j = 0; j < prompt; j++) llm_grow(g, r, 1);
    }
  }
  /* Decode: a few running requests take a block, or finish. */
  for (int s = 0; s < 4 && g->n; s++) {
    int i = (int)tg_range(0, (uint64_t)g->n - 1);
    struct llm_req *r = &g->reqs[i];
    if (r->blocks >= r->target)
      llm_finish(g, i);
    else if (!llm_grow(g, r, 0))
      llm_finish(g, i); /* preempted: no room to grow */
  }
  /* Load going down: requests end early. */
  while (g->n > target + 2) llm_finish(g, (int)tg_range(0, (uint64_t)g->n - 1));
  /* An activation buffer, with two blocks of the batch locked meanwhile. */
  if (g->iter % 6 == 0) {
    uint64_t act = g->odd ? g->act_min + 64 * KIB *
                                             tg_range(0, (g->act_max -
                                                          g->act_min) /
                                                             (64 * KIB))
                          : 2 * MIB * tg_range(g->act_min / (2 * MIB),
                                               g->act_max / (2 * MIB));
    if (g->live + act <= g->budget) {
      char k[32], l1[32] = "", l2[32] = "";
      if (g->n) {
        struct llm_req *r = &g->reqs[tg_range(0, (uint64_t)g->n - 1)];
        if (r->blocks >= 2) {
          llm_key(l1, sizeof l1, r->id, 0);
          llm_key(l2, sizeof l2, r->id, r->blocks - 1);
          tg_op("lock", g->t, l1);
          tg_op("lock", g->t, l2);
        }
      }
      snprintf(k, sizeof k, "act%u", g->acts++);
      tg_alloc(g->t, k, act, 1);
      tg_op("free", g->t, k);
      if (l1[0]) {
        tg_op("unlock", g->t, l2);
        tg_op("unlock", g->t, l1);
      }
    }
  }
}

static void llm_end(struct llm *g) {
  while (g->n) llm_finish(g, g->n - 1);
}

/* --- one training job -------------------------------------------------------- */

#define TR_MAX_KEEP 512

struct train {
  const char *t;
  uint64_t budget, live;
  int layers, bmin, bmax;
  uint64_t act_per_sample;
  uint64_t ws_min, ws_max;
  double keep_p; /* chance per layer of a long-lived buffer */
  uint64_t step;
  struct {
    uint32_t id;
    uint64_t size, until;
    int pinned;
  } keep[TR_MAX_KEEP];
  int n_keep;
  uint32_t next_keep;
  /* Within a step: where we are (layer), the batch's activation size. */
  int phase, layer;
  uint64_t act;
};

static void train_init(struct train *g, uint64_t params) {
  tg_alloc(g->t, "params", params, 0);
  tg_alloc(g->t, "grads", params, 0);
  tg_alloc(g->t, "adam", 2 * params, 0);
  g->live += 4 * params;
}

/* Long-lived buffers whose time has come go back. */
static void train_expire(struct train *g) {
  for (int i = 0; i < g->n_keep;) {
    if (g->keep[i].until <= g->step) {
      char k[32];
      snprintf(k, sizeof k, "keep%u", g->keep[i].id);
      tg_op("free", g->t, k);
      g->live -= g->keep[i].size;
      g->keep[i] = g->keep[--g->n_keep];
    } else {
      i++;
    }
  }
}

static void train_keep(struct train *g) {
  if (g->n_keep == TR_MAX_KEEP) return;
  uint64_t size = 64 * KIB * tg_range(1, 4);
  if (g->live + size > g->budget) return;
  char k[32];
  int i = g->n_keep++;
  g->keep[i].id = g->next_keep++;
  g->keep[i].size = size;
  g->keep[i].until = g->step + tg_range(4, 60);
  g->keep[i].pinned = tg_unit() < 0.03;
  snprintf(k, sizeof k, "keep%u", g->keep[i].id);
  tg_alloc(g->t, k, size, !g->keep[i].pinned);
  g->live += size;
}

/* A slice of a step: a forward layer, a backward layer, or the end of the
 * step; so that a mixed trace can interleave steps with other tenants. */
static void train_slice(struct train *g) {
  char k[32];
  if (g->phase == 0) { /* a new step: pick the batch */
    g->step++;
    uint64_t b = tg_range((uint64_t)g->bmin, (uint64_t)g->bmax);
    g->act = g->act_per_sample * b;
    g->phase = 1;
    g->layer = 0;
    return;
  }
  if (g->phase == 1) { /* forward: keep each layer's activation */
    snprintf(k, sizeof k, "s%llu.a%d", (unsigned long long)g->step, g->layer);
    tg_alloc(g->t, k, g->act, 1);
    g->live += g->act;
    if (tg_unit() < g->keep_p) train_keep(g);
    if (++g->layer == g->layers) g->phase = 2;
    return;
  }
  if (g->phase == 2) { /* backward: a gradient temporary, then free */
    g->layer--;
    snprintf(k, sizeof k, "s%llu.g%d", (unsigned long long)g->step, g->layer);
    tg_alloc(g->t, k, g->act / 2, 1);
    tg_op("free", g->t, k);
    snprintf(k, sizeof k, "s%llu.a%d", (unsigned long long)g->step, g->layer);
    tg_op("free", g->t, k);
    g->live -= g->act;
    if (g->layer == 0) g->phase = 3;
    return;
  }
  /* Step end: the optimizer's workspace now and then, old buffers go. */
  if (g->step % 4 == 0) {
    uint64_t ws = 2 * MIB * tg_range(g->ws_min / (2 * MIB),
                                     g->ws_max / (2 * MIB));
    if (g->live + ws <= g->budget) {
      snprintf(k, sizeof k, "ws%llu", (unsigned long long)g->step);
      tg_alloc(g->t, k, ws, 1);
      tg_op("free", g->t, k);
    }
  }
  train_expire(g);
  g->phase = 0;
}

static void train_end(struct train *g) {
  while (g->phase != 0) train_slice(g);
  g->step = UINT64_MAX;
  train_expire(g);
}

/* --- the traces -------------------------------------------------------------- */

static void trace_llm(double scale) {
  printf("capacity 192MiB\n");
  struct llm g = {.t = "llm", .budget = 176 * MIB, .block = 256 * KIB,
                  .lo = 4, .hi = 40, .period = 700, .max_blocks = 40,
                  .act_min = 8 * MIB, .act_max = 32 * MIB};
  llm_init(&g, 1, 24 * MIB);
  while (tg_ops < (uint64_t)(16000 * scale)) llm_step(&g);
  llm_end(&g);
}

static void trace_train(double scale) {
  printf("capacity 128MiB\n");
  struct train g = {.t = "train", .budget = 124 * MIB, .layers = 24,
                    .bmin = 8, .bmax = 64, .act_per_sample = 16 * KIB,
                    .ws_min = 32 * MIB, .ws_max = 64 * MIB, .keep_p = 0.25};
  train_init(&g, 8 * MIB);
  while (tg_ops < (uint64_t)(14000 * scale)) train_slice(&g);
  train_end(&g);
}

static void trace_mixed(double scale) {
  printf("capacity 208MiB\nquota llm-a 112MiB\nquota llm-b 80MiB\n"
         "quota train 96MiB\n");
  /* Budgets a little above the quotas: a server that bursts meets its
   * quota (GMB_E_QUOTA), which is not the device's fault. */
  struct llm a = {.t = "llm-a", .budget = 112 * MIB, .block = 256 * KIB,
                  .lo = 2, .hi = 24, .period = 500, .max_blocks = 32,
                  .act_min = 4 * MIB, .act_max = 16 * MIB, .burst = 0.06};
  struct llm b = {.t = "llm-b", .budget = 80 * MIB, .block = 128 * KIB,
                  .lo = 2, .hi = 30, .period = 900, .max_blocks = 48,
                  .act_min = 4 * MIB, .act_max = 12 * MIB, .burst = 0.06};
  struct train c = {.t = "train", .budget = 92 * MIB, .layers = 16,
                    .bmin = 8, .bmax = 48, .act_per_sample = 16 * KIB,
                    .ws_min = 12 * MIB, .ws_max = 32 * MIB, .keep_p = 0.2};
  llm_init(&a, 1, 16 * MIB);
  llm_init(&b, 1, 8 * MIB);
  train_init(&c, 6 * MIB);
  while (tg_ops < (uint64_t)(18000 * scale)) {
    double u = tg_unit();
    if (u < 0.35)
      llm_step(&a);
    else if (u < 0.7)
      llm_step(&b);
    else
      train_slice(&c);
  }
  llm_end(&a);
  llm_end(&b);
  train_end(&c);
}

/* Three servers' scheduler steps interleaved (40 %, 35 %, 25 %) until the
 * trace has 18000 * scale operations, then every request ended. */
static void three_servers(struct llm *a, struct llm *b, struct llm *c,
                          double scale) {
  while (tg_ops < (uint64_t)(18000 * scale)) {
    double u = tg_unit();
    if (u < 0.4)
      llm_step(a);
    else if (u < 0.75)
      llm_step(b);
    else
      llm_step(c);
  }
  llm_end(a);
  llm_end(b);
  llm_end(c);
}

/* Three servers with paged KV caches: each request's blocks are one size
 * from 64 KiB to 1 MiB, 15 % of them pinned (blocks registered with a
 * NIC or another process), on a device smaller than the quotas' sum. */
static void trace_kv(double scale) {
  printf("capacity 144MiB\nquota kv-a 96MiB\nquota kv-b 80MiB\n"
         "quota kv-c 64MiB\n");
  struct llm a = {.t = "kv-a", .budget = 92 * MIB, .block = 64 * KIB,
                  .lo = 2, .hi = 20, .period = 600, .max_blocks = 24,
                  .act_min = 4 * MIB, .act_max = 16 * MIB, .burst = 0.03,
                  .paged = 1, .pinned_p = 0.15};
  struct llm b = {.t = "kv-b", .budget = 76 * MIB, .block = 64 * KIB,
                  .lo = 2, .hi = 24, .period = 800, .max_blocks = 24,
                  .act_min = 4 * MIB, .act_max = 12 * MIB, .burst = 0.03,
                  .paged = 1, .pinned_p = 0.15};
  struct llm c = {.t = "kv-c", .budget = 60 * MIB, .block = 64 * KIB,
                  .lo = 2, .hi = 16, .period = 1000, .max_blocks = 24,
                  .act_min = 4 * MIB, .act_max = 8 * MIB, .burst = 0.03,
                  .paged = 1, .pinned_p = 0.15};
  llm_init(&a, 1, 12 * MIB);
  llm_init(&b, 1, 8 * MIB);
  llm_init(&c, 1, 6 * MIB);
  three_servers(&a, &b, &c, scale);
}

/* Weights as a model loads them: `n` pinned tensors of 0.6-3.4 MiB
 * (4 KiB steps). */
static void serving_weights(struct llm *g, int n) {
  for (int i = 0; i < n; i++) {
    char k[32];
    uint64_t size = 600 * KIB + 4 * KIB * tg_range(0, 700);
    snprintf(k, sizeof k, "w%d", i);
    tg_alloc(g->t, k, size, 0);
    g->live += size;
  }
}

/* The kv trace's three servers with tensors of any size, on a device
 * that holds about two thirds of their quotas. */
static void trace_serving(double scale) {
  printf("capacity 160MiB\nquota sv-a 96MiB\nquota sv-b 80MiB\n"
         "quota sv-c 64MiB\n");
  struct llm a = {.t = "sv-a", .budget = 92 * MIB, .lo = 2, .hi = 20,
                  .period = 600, .max_blocks = 24, .act_min = 3 * MIB,
                  .act_max = 13 * MIB, .burst = 0.03, .odd = 1,
                  .pinned_p = 0.15};
  struct llm b = {.t = "sv-b", .budget = 76 * MIB, .lo = 2, .hi = 24,
                  .period = 800, .max_blocks = 24, .act_min = 3 * MIB,
                  .act_max = 11 * MIB, .burst = 0.03, .odd = 1,
                  .pinned_p = 0.15};
  struct llm c = {.t = "sv-c", .budget = 60 * MIB, .lo = 2, .hi = 16,
                  .period = 1000, .max_blocks = 24, .act_min = 3 * MIB,
                  .act_max = 7 * MIB, .burst = 0.03, .odd = 1,
                  .pinned_p = 0.15};
  serving_weights(&a, 12);
  serving_weights(&b, 8);
  serving_weights(&c, 6);
  three_servers(&a, &b, &c, scale);
}

static void trace_adversarial(double scale) {
  const uint64_t cap = 128 * MIB;
  printf("capacity 128MiB\n");
  static const uint64_t pairs[][2] = {
      {256 * KIB, 768 * KIB}, {128 * KIB, 384 * KIB}, {512 * KIB, 512 * KIB},
      {64 * KIB, 192 * KIB},  {384 * KIB, 128 * KIB}, {1024 * KIB, 1024 * KIB},
  };
  int rounds = (int)(18 * scale);
  if (rounds < 1) rounds = 1;
  for (int round = 0; round < rounds; round++) {
    const uint64_t *p = pairs[round % 6];
    /* Fill to ~85 %: small, larger, small, larger, ... */
    uint64_t live = 0;
    int n = 0;
    char k[32];
    while (live + p[0] + p[1] <= cap * 85 / 100) {
      snprintf(k, sizeof k, "x%d.%d", round, n);
      /* One kept allocation in 32 is pinned: it never moves. */
      tg_alloc("adv", k, p[0], !(n % 64 == 32));
      snprintf(k, sizeof k, "x%d.%d", round, n + 1);
      tg_alloc("adv", k, p[1], 1);
      live += p[0] + p[1];
      n += 2;
    }
    /* Free every other one: the larger of each pair. */
    for (int i = 1; i < n; i += 2) {
      snprintf(k, sizeof k, "x%d.%d", round, i);
      tg_op("free", "adv", k);
      live -= p[1];
    }
    /* Requests larger than any hole, while two survivors are locked. */
    char l1[32], l2[32];
    snprintf(l1, sizeof l1, "x%d.%d", round, 0);
    snprintf(l2, sizeof l2, "x%d.%d", round, n - 2);
    tg_op("lock", "adv", l1);
    tg_op("lock", "adv", l2);
    uint64_t room = cap - live;
    int nb = 0;
    for (; nb < 3; nb++) {
      uint64_t big = 2 * MIB * tg_range(4, 12); /* 8..24 MiB */
      if (big > room / 2) big = (room / 2) & ~(2 * MIB - 1);
      if (big < 4 * MIB) break;
      snprintf(k, sizeof k, "big%d.%d", round, nb);
      tg_alloc("adv", k, big, 1);
      room -= big;
    }
    tg_op("unlock", "adv", l2);
    tg_op("unlock", "adv", l1);
    /* Everything goes back before the next round. */
    for (int j = 0; j < nb; j++) {
      snprintf(k, sizeof k, "big%d.%d", round, j);
      tg_op("free", "adv", k);
    }
    for (int i = 0; i < n; i += 2) {
      snprintf(k, sizeof k, "x%d.%d", round, i);
      tg_op("free", "adv", k);
    }
  }
}

static void tg_usage(FILE *f) {
  fprintf(f, "usage: tracegen [--seed N] [--scale X] "
             "llm|train|mixed|adversarial|kv|serving > FILE\n");
}

int main(int argc, char **argv) {
  uint64_t seed = 1;
  double scale = 1.0;
  const char *kind = NULL;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--seed") == 0 && i + 1 < argc) {
      seed = strtoull(argv[++i], NULL, 10);
    } else if (strcmp(argv[i], "--scale") == 0 && i + 1 < argc) {
      scale = strtod(argv[++i], NULL);
      if (!(scale > 0 && scale <= 100)) {
        fprintf(stderr, "tracegen: --scale wants 0 < X <= 100\n");
        return 2;
      }
    } else if (strcmp(argv[i], "-h") == 0 || strcmp(argv[i], "--help") == 0) {
      tg_usage(stdout);
      return 0;
    } else if (argv[i][0] != '-' && kind == NULL) {
      kind = argv[i];
    } else {
      tg_usage(stderr);
      return 2;
    }
  }
  if (kind == NULL) {
    tg_usage(stderr);
    return 2;
  }
  tg_state = seed * 0x2545f4914f6cdd1dull + 0x632be59bd9b4e019ull;
  printf("# gmb-replay trace: %s, seed %llu, scale %g (tests/bench/tracegen)\n",
         kind, (unsigned long long)seed, scale);
  if (strcmp(kind, "llm") == 0)
    trace_llm(scale);
  else if (strcmp(kind, "train") == 0)
    trace_train(scale);
  else if (strcmp(kind, "mixed") == 0)
    trace_mixed(scale);
  else if (strcmp(kind, "adversarial") == 0)
    trace_adversarial(scale);
  else if (strcmp(kind, "kv") == 0)
    trace_kv(scale);
  else if (strcmp(kind, "serving") == 0)
    trace_serving(scale);
  else {
    fprintf(stderr, "tracegen: unknown trace '%s'\n", kind);
    return 2;
  }
  return fflush(stdout) == 0 ? 0 : 1;
}
