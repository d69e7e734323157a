/*
 * soak.c - the soak with faults: a real broker on the host
 * device, several tenants' client processes doing real work against it,
 * and an operator that keeps breaking things, for SOAK_SECONDS (default
 * 60).  `make soak SOAK_SECONDS=N` runs it; CI runs a short round.
 *
 * The clients (SOAK_TENANTS tenants x SOAK_CLIENTS processes each) loop:
 * allocate (pinned or movable, 512 B .. 1 MiB, now and then 2 MiB), write
 * a pattern that depends on the allocation, verify it when they lock it
 * again (movable ones may have been moved by compaction in between),
 * verify it again before they free it.  What they believe they hold
 * (rounded to 512 B) and every mismatching byte are kept in a shared page.
 * A client whose session is lost (evicted, broker gone, killed broker)
 * counts it, forgets its allocations and connects again, to the broker's
 * current endpoint.
 *
 * Sleep and wake (docs/sleep.md) run under the same faults.  A third of
 * the allocations are made with the thread's tag "w" current (sized to a
 * multiple of 512, so that a pause gives back what the broker charged).
 * Now and then a client pauses the tag itself (gmb_pause, offloaded, or
 * one time in four discarded) and later resumes it: then every allocation
 * of the tag is locked and checked (gmb_alloc allocations keep their
 * gmb_id, not their address, so only bytes are compared), and after a
 * discard written anew, as gmb.h says discarded bytes are whatever the
 * new pages hold.  While its own pause holds, a lock of the tag's
 * allocations must be refused GMB_E_INVAL or, where the pause did not take
 * the allocation (one the broker had offloaded; a tag an operator had
 * paused already), give intact bytes.  Every client opts in with a sleep
 * policy (50 ms idle, the tag offloaded) and naps now and then; the
 * device (56 MiB) is smaller than the quotas together, so requests find
 * it full and the broker offloads idle clients' movable allocations and
 * asks them to pause their tag: the next lock brings an allocation back,
 * or resumes its tag, with its bytes intact, or is refused for room
 * (GMB_E_NOMEM, GMB_E_QUOTA, GMB_E_TIMEOUT) with nothing lost.  A tagged
 * lock or allocation refused as "paused by an operator" (an operator's
 * pause does not end by itself) is followed by the client's gmb_resume,
 * which must end it; any other GMB_E_INVAL of a tag is a violation
 * (except one caught while the library's thread pauses or resumes it).
 *
 * The faults, at random every few hundred milliseconds: kill -9 of a
 * client (a new one takes its place), SIGSTOP of a client (SIGCONT some
 * time later), `gmbctl evict` of a tenant, `gmbctl reload` of a config
 * whose quota changed, `gmbctl compact`, `gmbctl pause` of a tenant
 * (every tag of its sessions, and the broker's offload of its movable
 * allocations) and `gmbctl resume`, and now and then a broker restart
 * (SIGTERM, which must exit 0, or kill -9), except in the last third, so
 * that the last broker carries load before the final checks.  An
 * operator's pause and resume that the draw did not give by a quarter and
 * half of the run are made then.
 *
 * Checkpoints (every SOAK_SECONDS/6, at least 5 s, and at the end): every
 * stopped client continued, `gmbctl resume` of every tenant (an
 * operator's pause still offloading ends), every client paused between
 * two operations after resuming its own pause, verifying all it holds and
 * asking the broker whether its session still stands; then the admin
 * status's `used` plus `paused_bytes` of each tenant (a paused tag's and
 * the broker's offloads are off the device, and no resume can be required
 * to succeed under a quota the faults lowered) must equal the sum its
 * clients believe they hold (polled: killed clients' sessions end as the
 * broker notices); no session of a tenant whose clients all say their tag
 * runs with nothing on the host (the library's figures) may have the tag
 * paused at the broker, and at the end, every client gone, no tenant may
 * hold host or paused bytes; and no byte may be corrupted.  At the end
 * the clients disconnect and exit, and the broker's descriptors
 * (/proc/PID/fd) must come back to at most its idle count plus 2, and its
 * RSS to at most its idle RSS plus 16 MiB (the trim timer gives heap
 * back), within HARNESS_WAIT_MS.  It prints operations, faults and
 * sleep and wake per kind (the broker's offloads, restores and asks read
 * from each broker before it goes), and fails on any violation; over
 * 20 s or more, a kind of pause or resume that never happened is one.
 * No check is on a duration.
 *
 * An attacker runs beside them when the soak runs as root (as uid 65534,
 * nobody; else it says it was skipped): connections that choose a
 * ZeroMQ routing id (each must be dropped in its handshake; the broker
 * aborted on such ids once), Hellos that try the soak tenants, which
 * belong to another uid (each must be refused), undecodable messages
 * (each must be answered GMB_E_PROTO), and bursts of bare connections to
 * both sockets.  A broker that is restarting meanwhile excuses a
 * missing answer, never a wrong one.  It stops before the last
 * checkpoint, so the final descriptor count is the broker's own.
 */
#include <check.h>
#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <grp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <zmq.h>

#include "gmb.h"
#include "harness.h"
#include "wire.h"

#define SOAK_MAX_TENANTS 8
#define SOAK_MAX_CLIENTS 32
#define SOAK_MAX_HELD 48 /* allocations per client */
#define SOAK_ALIGN 512u
/* The broker's RSS after load is checked, except under AddressSanitizer
 * (its quarantine keeps freed memory; see the end of the soak). */
#ifdef __SANITIZE_ADDRESS__
#define SOAK_RSS_CHECKED 0
#else
#define SOAK_RSS_CHECKED 1
#endif
#define SOAK_DEVICE "host:56MiB" /* below the quotas' sum (72 MiB) */

/* A client's counts of sleep and wake: its own pauses (offload, discard)
 * and resumes, tagged calls refused as "paused by an operator" (then
 * resumed by its gmb_resume), locks and resumes refused for room (nothing
 * lost), naps long enough to be offered to the broker, and answers the
 * API does not give (each a violation). */
enum soak_scount {
  S_PAUSES, S_DISCARDS, S_RESUMES, S_OP_SEEN, S_ROOM_REFUSED, S_NAPS,
  S_WRONG, S_COUNT
};
static const char *const soak_scount_names[S_COUNT] = {
    "pauses (offload)", "pauses (discard)", "resumes",
    "calls refused as paused by an operator",
    "locks/resumes refused for room", "naps", "wrong answers"};

struct soak_slot {
  atomic_int pause, paused, quit;
  atomic_int tags_back; /* while paused: its tag runs, nothing of it on the
                           host (the library's own figures) */
  atomic_uint_fast64_t held; /* rounded bytes the client believes it holds,
                                on the device, paused or offloaded */
  atomic_uint_fast64_t ops, allocs, frees, locks, refusals, lost, corrupt;
  atomic_uint_fast64_t sc[S_COUNT]; /* sleep and wake: enum soak_scount */
  pid_t pid;
  int tenant;
  int stopped; /* parent: SIGSTOPped, not yet continued */
  double cont_at;
};

enum soak_attack {
  A_CHOSEN_ID, A_FOREIGN_HELLO, A_GARBAGE, A_BARE_BURST, A_COUNT
};
static const char *const soak_attack_names[A_COUNT] = {
    "chosen routing id", "Hello as another uid's tenant",
    "undecodable message", "burst of bare connections"};

struct soak_shared {
  atomic_uint_fast64_t gen; /* odd while the endpoint is being rewritten */
  atomic_int attack_quit;
  atomic_uint_fast64_t attacks[A_COUNT], attack_unanswered;
  atomic_uint_fast64_t attack_wrong; /* an attack the broker let through */
  char endpoint[128];
  int n_slots;
  struct soak_slot slot[SOAK_MAX_CLIENTS];
};

static struct soak_shared *sh;

static const char *soak_tenant_name(int t, char *buf, size_t cap) {
  snprintf(buf, cap, "soak%d", t);
  return buf;
}

/* --- the client --------------------------------------------------------- */

struct soak_alloc {
  gmb_id id;
  uint64_t size, rounded, seed;
  unsigned flags;
  int tagged;    /* made with SOAK_TAG current */
  int undefined; /* its bytes are not its pattern (a discard, or no fill
                    yet): written, not checked, at its next lock */
};

struct soak_client {
  int idx;
  struct soak_slot *me;
  gmb_client *c;
  struct soak_alloc a[SOAK_MAX_HELD];
  int n;
  int own_pause; /* 0, or 1 + the mode of the client's own gmb_pause */
  int tagged;    /* a tagged allocation was made in this session */
  /* In a checkpoint, set at the first lock or resume refused for room:
   * the others that may need room are not tried (each would wait
   * restore_wait_ms or GMB_RESUME_WAIT_MS for room nobody frees then). */
  int in_checkpoint, no_room;
  uint64_t rng;
};

/* The tag of the clients' tagged allocations, and their sleep policy:
 * offered to the broker (offloaded, never discarded: the client would not
 * know its bytes went) after 50 ms without a call. */
#define SOAK_TAG "w"
#define SOAK_POLICY "idle=0.05," SOAK_TAG ":offload"

static void soak_wrong(struct soak_client *k, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
static void soak_wrong(struct soak_client *k, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "soak: client %d: ", k->idx);
  vfprintf(stderr, fmt, ap);
  fprintf(stderr, " (%s)\n", gmb_last_error(k->c));
  va_end(ap);
  atomic_fetch_add(&k->me->sc[S_WRONG], 1);
}

static void soak_endpoint(char *buf, size_t cap) {
  for (;;) {
    uint64_t g = atomic_load(&sh->gen);
    if (g & 1) {
      harness_sleep_ms(1);
      continue;
    }
    snprintf(buf, cap, "%s", sh->endpoint);
    if (atomic_load(&sh->gen) == g) return;
  }
}

/* The session is gone (or must be treated as gone): what it held is the
 * broker's to free, not ours. */
static void soak_lose(struct soak_client *k) {
  atomic_fetch_add(&k->me->lost, 1);
  atomic_store(&k->me->held, 0);
  k->n = 0;
  k->own_pause = 0;
  k->tagged = 0;
  gmb_disconnect(k->c);
  k->c = NULL;
}

/* The tag's allocations were refused as paused (GMB_E_INVAL): by an
 * operator, whose pause does not end by itself and which the
 * application's gmb_resume ends (sleep.md), or caught while the library's
 * thread pauses or resumes the tag.  Anything else is a wrong answer.
 * Returns 1 when the tag was resumed here (try again), 0 when not (the
 * refusal stands), -1 when the session is lost (then forgotten). */
static int soak_paused_refusal(struct soak_client *k, const char *what) {
  const char *why = gmb_last_error(k->c);
  if (strstr(why, "paused by an operator") == NULL) {
    if (strstr(why, "being paused") == NULL)
      soak_wrong(k, "%s: GMB_E_INVAL, not as a paused tag", what);
    return 0;
  }
  atomic_fetch_add(&k->me->sc[S_OP_SEEN], 1);
  int rc = gmb_resume(k->c, SOAK_TAG);
  if (rc == 0) {
    atomic_fetch_add(&k->me->sc[S_RESUMES], 1);
    return 1;
  }
  if (rc == GMB_E_NOMEM || rc == GMB_E_QUOTA) {
    atomic_fetch_add(&k->me->sc[S_ROOM_REFUSED], 1);
    k->no_room = k->in_checkpoint;
    return 0;
  }
  soak_lose(k);
  return -1;
}

/* Locks allocation i, checks its pattern (writes it, when a discard left
 * its bytes undefined), unlocks.  0, also when the lock was refused with
 * nothing lost: its tag paused, or no room to bring it back; -1 when the
 * session is lost (then forgotten).
 *
 * While the client's own pause holds, a lock of the tag's allocations is
 * refused GMB_E_INVAL, except where the pause did not take it: a movable
 * one the broker had offloaded stays the broker's and comes back at its
 * lock (sleep.md), and a pause of a tag already paused (by an operator,
 * whose gmbctl resume then resumes it) changes nothing.  Either way the
 * bytes must be intact, and are checked. */
static int soak_verify(struct soak_client *k, int i) {
  struct soak_alloc *a = &k->a[i];
  if (k->no_room && ((a->flags & GMB_MOVABLE) || a->tagged)) return 0;
  void *p;
  int rc = gmb_lock(k->c, a->id, &p);
  if (rc == GMB_E_INVAL && a->tagged && k->own_pause) return 0;
  if (rc == GMB_E_INVAL && a->tagged) {
    int again = soak_paused_refusal(k, "a lock");
    if (again <= 0) return again;
    rc = gmb_lock(k->c, a->id, &p);
    if (rc == GMB_E_INVAL && strstr(gmb_last_error(k->c), "being paused"))
      return 0; /* the library's thread paused it again meanwhile */
  }
  /* An allocation the broker offloaded, or a tag it paused, comes back at
   * the lock when there is room; else nothing is lost. */
  if ((rc == GMB_E_NOMEM || rc == GMB_E_QUOTA || rc == GMB_E_TIMEOUT) &&
      ((a->flags & GMB_MOVABLE) || a->tagged)) {
    atomic_fetch_add(&k->me->sc[S_ROOM_REFUSED], 1);
    k->no_room = k->in_checkpoint;
    return 0;
  }
  if (rc != 0) {
    soak_lose(k);
    return -1;
  }
  atomic_fetch_add(&k->me->locks, 1);
  if (a->undefined) {
    harness_pattern_fill(p, a->size, a->seed);
    a->undefined = 0;
    gmb_unlock(k->c, a->id);
    return 0;
  }
  long bad = harness_pattern_check(p, a->size, a->seed);
  if (bad >= 0) {
    const uint8_t *b = p;
    uint64_t n = 0;
    uint8_t *exp = malloc(a->size);
    if (exp) {
      harness_pattern_fill(exp, a->size, a->seed);
      for (uint64_t j = 0; j < a->size; j++) n += b[j] != exp[j];
      free(exp);
    } else {
      n = 1;
    }
    fprintf(stderr, "soak: client %d: allocation %" PRIu64 " (%" PRIu64
            " bytes%s%s): %" PRIu64 " corrupted bytes, first at %ld\n",
            k->idx, (uint64_t)a->id, a->size,
            a->flags & GMB_MOVABLE ? ", movable" : "",
            a->tagged ? ", tagged" : "", n, bad);
    atomic_fetch_add(&k->me->corrupt, n);
  }
  gmb_unlock(k->c, a->id);
  return 0;
}

/* The client's own pause of its tag: offloaded, or now and then
 * discarded, after which the tag's bytes are undefined (gmb.h: "discarded
 * ones read as whatever the new pages hold") and are written anew at
 * their next lock. */
static void soak_pause(struct soak_client *k) {
  int mode = harness_rnd(&k->rng) % 4 == 0 ? GMB_PAUSE_DISCARD
                                           : GMB_PAUSE_OFFLOAD;
  int rc = gmb_pause(k->c, SOAK_TAG, mode);
  if (rc == GMB_E_LIMIT || rc == GMB_E_SYSTEM || rc == GMB_E_INVAL) {
    atomic_fetch_add(&k->me->refusals, 1);
    return;
  }
  if (rc != 0) {
    soak_lose(k);
    return;
  }
  k->own_pause = 1 + mode;
  atomic_fetch_add(&k->me->sc[mode == GMB_PAUSE_DISCARD ? S_DISCARDS
                                                       : S_PAUSES], 1);
}

/* Its resume: then every allocation of the tag is locked and checked (a
 * discarded one written anew). */
static void soak_resume(struct soak_client *k) {
  int rc = gmb_resume(k->c, SOAK_TAG);
  if (rc == GMB_E_NOMEM || rc == GMB_E_QUOTA) {
    atomic_fetch_add(&k->me->sc[S_ROOM_REFUSED], 1);
    k->no_room = k->in_checkpoint;
    return;
  }
  if (rc != 0) {
    soak_lose(k);
    return;
  }
  int discarded = k->own_pause == 1 + GMB_PAUSE_DISCARD;
  k->own_pause = 0;
  atomic_fetch_add(&k->me->sc[S_RESUMES], 1);
  for (int i = k->n - 1; k->c && i >= 0; i--)
    if (k->a[i].tagged) {
      if (discarded) k->a[i].undefined = 1;
      if (soak_verify(k, i) != 0) return;
    }
}

static void soak_op(struct soak_client *k) {
  uint64_t r = harness_rnd(&k->rng);
  int what = (int)(r % 100);
  if (what < 45 && k->n < SOAK_MAX_HELD) {
    uint64_t size = (harness_rnd(&k->rng) % 16 == 0)
                        ? (UINT64_C(2) << 20)
                        : 512 + harness_rnd(&k->rng) % (UINT64_C(1) << 20);
    unsigned flags = (r >> 8) & 1 ? GMB_MOVABLE : 0;
    /* A third of them in the tag, sized to a multiple of 512 so that what
     * a pause gives back (their sizes, as the broker counts a SleepNote)
     * is what the broker had charged for them. */
    int tagged = (r >> 9) % 3 == 0 && !k->own_pause;
    if (tagged) {
      size = (size + SOAK_ALIGN - 1) & ~(uint64_t)(SOAK_ALIGN - 1);
      gmb_cache_tag(k->c, SOAK_TAG);
    }
    gmb_id id;
    int rc = gmb_alloc(k->c, size, flags, &id);
    if (tagged) {
      gmb_cache_tag(k->c, NULL);
      k->tagged = 1;
    }
    if (rc == GMB_E_INVAL && tagged) {
      soak_paused_refusal(k, "a tagged allocation");
      return;
    }
    if (rc == GMB_E_QUOTA || rc == GMB_E_NOMEM || rc == GMB_E_LIMIT) {
      atomic_fetch_add(&k->me->refusals, 1);
      return;
    }
    if (rc != 0) {
      soak_lose(k);
      return;
    }
    struct soak_alloc *a = &k->a[k->n++];
    a->id = id;
    a->size = size;
    a->rounded = (size + SOAK_ALIGN - 1) & ~(uint64_t)(SOAK_ALIGN - 1);
    a->seed = harness_rnd(&k->rng);
    a->flags = flags;
    a->tagged = tagged;
    a->undefined = 1; /* until the lock below writes it */
    atomic_fetch_add(&k->me->held, a->rounded);
    atomic_fetch_add(&k->me->allocs, 1);
    soak_verify(k, k->n - 1);
  } else if (what < 75 && k->n > 0) {
    int i = (int)(harness_rnd(&k->rng) % (uint64_t)k->n);
    if (soak_verify(k, i) != 0) return;
    int rc = gmb_free(k->c, k->a[i].id);
    if (rc == GMB_E_INVAL && k->a[i].tagged &&
        strstr(gmb_last_error(k->c), "being paused")) {
      atomic_fetch_add(&k->me->refusals, 1); /* a later free drops it */
      return;
    }
    if (rc != 0) {
      soak_lose(k);
      return;
    }
    atomic_fetch_sub(&k->me->held, k->a[i].rounded);
    atomic_fetch_add(&k->me->frees, 1);
    k->a[i] = k->a[--k->n];
  } else if (what < 77 && k->tagged && !k->own_pause) {
    soak_pause(k);
  } else if (what < 87 && k->own_pause) {
    soak_resume(k); /* soon: the tag runs most of the time */
  } else if (what < 79) {
    /* A nap: the library's thread offers the process to the broker,
     * which may offload its movable allocations or ask it to pause its
     * tag for another tenant's request. */
    atomic_fetch_add(&k->me->sc[S_NAPS], 1);
    harness_sleep_ms(100 + (int)(harness_rnd(&k->rng) % 300));
  } else if (k->n > 0) {
    soak_verify(k, (int)(harness_rnd(&k->rng) % (uint64_t)k->n));
  }
}

static int soak_client_main(void *arg) {
  struct soak_client k;
  memset(&k, 0, sizeof k);
  k.idx = (int)(intptr_t)arg;
  k.me = &sh->slot[k.idx];
  k.rng = (uint64_t)getpid() * 0x9e3779b97f4a7c15u | 1;
  char tenant[32], ep[128];
  soak_tenant_name(k.me->tenant, tenant, sizeof tenant);
  for (;;) {
    if (atomic_load(&k.me->pause)) {
      /* A checkpoint: resume its own pause, verify everything (which
       * brings back what the broker offloaded, where there is room, and
       * resumes what an operator paused; after one refusal for room, what
       * may need room waits for a later operation), and make sure the
       * session still stands (an eviction is seen here at the latest). */
      k.in_checkpoint = 1;
      if (k.c && k.own_pause) soak_resume(&k);
      for (int i = k.n - 1; k.c && i >= 0; i--)
        if (soak_verify(&k, i) != 0) break;
      k.in_checkpoint = k.no_room = 0;
      gmb_stats st;
      if (k.c && gmb_tenant_stats(k.c, &st) != 0) soak_lose(&k);
      if (atomic_load(&k.me->quit)) {
        if (k.c) gmb_disconnect(k.c);
        atomic_store(&k.me->held, 0);
        atomic_store(&k.me->tags_back, 1);
        atomic_store(&k.me->paused, 1);
        return 0;
      }
      atomic_store(&k.me->paused, 1);
      while (atomic_load(&k.me->pause)) {
        /* The library's thread may still pause or resume the tag (an
         * operator's event sent before the checkpoint): say what it has
         * now, for the check that the broker's record follows it. */
        gmb_cache_stats cs = {0};
        int back = k.c == NULL ||
                   (gmb_cache_stats_get(k.c, &cs) == 0 && cs.host == 0 &&
                    cs.paused == 0 && !k.own_pause);
        atomic_store(&k.me->tags_back, back);
        harness_sleep_ms(1);
      }
      atomic_store(&k.me->paused, 0);
      continue;
    }
    if (k.c == NULL) {
      soak_endpoint(ep, sizeof ep);
      if (gmb_connect(ep, tenant, &k.c) != 0) {
        k.c = NULL;
        harness_sleep_ms(20);
        continue;
      }
      if (gmb_sleep_policy_set(k.c, SOAK_POLICY) != 0)
        soak_wrong(&k, "sleep policy \"%s\" refused", SOAK_POLICY);
    }
    soak_op(&k);
    atomic_fetch_add(&k.me->ops, 1);
    if (atomic_load(&k.me->ops) % 8 == 0) harness_sleep_ms(1);
  }
}

/* --- the attacker ---------------------------------------------------------- */

static int soak_unix_connect(const char *path) {
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  snprintf(sa.sun_path, sizeof sa.sun_path, "%s", path);
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd >= 0 && connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0) {
    close(fd);
    fd = -1;
  }
  return fd;
}

/* A DEALER's ZMTP 3.0 greeting and READY naming routing id `id` (5
 * bytes) on fd; 0 or -1. */
static int soak_zmtp_chosen(int fd, const unsigned char id[5]) {
  unsigned char g[64] = {0xff, 0, 0, 0, 0, 0, 0, 0, 1, 0x7f, 3, 0};
  memcpy(g + 12, "NULL", 4);
  static const unsigned char ready[] =
      "\x04\x00\x05READY\x0bSocket-Type\0\0\0\x06" "DEALER"
      "\x08Identity\0\0\0\x05";
  unsigned char cmd[sizeof ready - 1 + 5];
  memcpy(cmd, ready, sizeof ready - 1);
  memcpy(cmd + sizeof ready - 1, id, 5);
  cmd[1] = (unsigned char)(sizeof cmd - 2); /* the command's size */
  return write(fd, g, sizeof g) == (ssize_t)sizeof g &&
                 write(fd, cmd, sizeof cmd) == (ssize_t)sizeof cmd
             ? 0
             : -1;
}

/* 1 when the peer closed fd within timeout_ms. */
static int soak_closed(int fd, int timeout_ms) {
  double end = harness_now_ms() + timeout_ms;
  char buf[256];
  for (;;) {
    int left = (int)(end - harness_now_ms());
    if (left <= 0) return 0;
    struct pollfd p = {fd, POLLIN, 0};
    if (poll(&p, 1, left) <= 0) continue;
    ssize_t n = read(fd, buf, sizeof buf);
    if (n == 0 || (n < 0 && errno != EINTR && errno != EAGAIN)) return 1;
  }
}

/* One request on a fresh DEALER to `endpoint`; the reply's status, or 1
 * when none came in 2 s (a broker restarting). */
static int soak_raw_call(void *z, const char *endpoint, const void *msg,
                         size_t len) {
  void *s = zmq_socket(z, ZMQ_DEALER);
  if (s == NULL) return 1;
  int zero = 0, wait = 2000;
  zmq_setsockopt(s, ZMQ_LINGER, &zero, sizeof zero);
  zmq_setsockopt(s, ZMQ_RCVTIMEO, &wait, sizeof wait);
  int status = 1;
  if (zmq_connect(s, endpoint) == 0 && zmq_send(s, msg, len, 0) >= 0) {
    zmq_msg_t m;
    zmq_msg_init(&m);
    struct wire_reply rep;
    if (zmq_msg_recv(&m, s, 0) >= 0 &&
        gmb__wire_reply_decode(zmq_msg_data(&m), zmq_msg_size(&m), &rep) ==
            0) {
      status = rep.status;
      gmb__wire_reply_clear(&rep);
    }
    zmq_msg_close(&m);
  }
  zmq_close(s);
  return status;
}

static int soak_attacker_main(void *arg) {
  (void)arg;
  if (setgroups(0, NULL) != 0 || setgid(65534) != 0 || setuid(65534) != 0)
    return 10;
  void *z = zmq_ctx_new();
  if (z == NULL) return 11;
  uint64_t rng = (uint64_t)getpid() * 2654435761u | 1;
  while (!atomic_load(&sh->attack_quit)) {
    char ep[128], dir[128], path[160];
    soak_endpoint(ep, sizeof ep);
    snprintf(dir, sizeof dir, "%s", ep + 6);
    char *slash = strrchr(dir, '/');
    if (slash) *slash = '\0';
    uint64_t gen = atomic_load(&sh->gen);
    int kind = (int)(harness_rnd(&rng) % A_COUNT);
    int answered = 1, wrong = 0;
    if (kind == A_CHOSEN_ID) {
      uint32_t v = (uint32_t)harness_rnd(&rng);
      unsigned char id[5] = {0, (unsigned char)(v >> 24),
                             (unsigned char)(v >> 16), (unsigned char)(v >> 8),
                             (unsigned char)v};
      int fd = soak_unix_connect(ep + 6);
      if (fd >= 0) {
        if (soak_zmtp_chosen(fd, id) == 0 && !soak_closed(fd, 2000))
          wrong = 1; /* a chosen id kept */
        close(fd);
      } else {
        answered = 0;
      }
    } else if (kind == A_FOREIGN_HELLO) {
      struct wire_request req;
      memset(&req, 0, sizeof req);
      req.id = 1;
      req.kind = WIRE_HELLO;
      req.u.hello.version = WIRE_PROTOCOL_VERSION;
      soak_tenant_name((int)(harness_rnd(&rng) % 2), req.u.hello.tenant,
                       sizeof req.u.hello.tenant);
      memcpy(req.u.hello.token, "guess", 5);
      req.u.hello.token_len = 5;
      uint8_t *buf = NULL;
      size_t len = 0;
      if (gmb__wire_request_encode(&req, &buf, &len) != 0) return 12;
      int st = soak_raw_call(z, ep, buf, len);
      free(buf);
      answered = st != 1;
      wrong = st == 0; /* nobody admitted to a soak tenant */
    } else if (kind == A_GARBAGE) {
      static const char junk[] = "\x07 not a protobuf \xff\xfe";
      int st = soak_raw_call(z, ep, junk, sizeof junk - 1);
      answered = st != 1;
      wrong = answered && st != GMB_E_PROTO;
    } else {
      int fds[24];
      for (int i = 0; i < 24; i++) {
        if (i % 2)
          snprintf(path, sizeof path, "%s/admin.sock", dir);
        else
          snprintf(path, sizeof path, "%s", ep + 6);
        fds[i] = soak_unix_connect(path);
      }
      harness_sleep_ms(100);
      for (int i = 0; i < 24; i++)
        if (fds[i] >= 0) close(fds[i]);
    }
    /* A broker restarted meanwhile excuses silence, not a wrong answer. */
    if (atomic_load(&sh->gen) != gen) answered = 1;
    atomic_fetch_add(&sh->attacks[kind], 1);
    if (!answered) atomic_fetch_add(&sh->attack_unanswered, 1);
    if (wrong) {
      atomic_fetch_add(&sh->attack_wrong, 1);
      fprintf(stderr, "soak: attack \"%s\" was let through\n",
              soak_attack_names[kind]);
    }
    harness_sleep_ms(20 + (int)(harness_rnd(&rng) % 80));
  }
  zmq_ctx_term(z);
  return 0;
}

/* --- the operator -------------------------------------------------------- */

enum soak_fault {
  F_KILL, F_STOP, F_EVICT, F_RELOAD, F_COMPACT, F_PAUSE, F_RESUME,
  F_RESTART_TERM, F_RESTART_KILL, F_COUNT
};
static const char *const soak_fault_names[F_COUNT] = {
    "kill -9 client", "SIGSTOP client", "gmbctl evict", "gmbctl reload",
    "gmbctl compact", "gmbctl pause", "gmbctl resume",
    "broker restart (SIGTERM)", "broker restart (kill -9)"};

/* The broker's own counts of its offloads, what came back, and its asks
 * to pause, summed over the brokers of the run (each read before it
 * goes). */
enum soak_bcount { B_OFFLOADS, B_RESTORES, B_ASKS, B_COUNT };
static const char *const soak_bcount_names[B_COUNT] = {
    "broker offloads", "restores of broker offloads", "broker asks to pause"};

struct soak {
  struct harness_broker b;
  char config[1024];
  int tenants, clients_per;
  uint64_t faults[F_COUNT];
  uint64_t violations, checkpoints;
  uint64_t rng;
  int quota_toggle;
  int base_fds;
  long base_rss_kib;
  /* Figures of clients that were killed (their slots are reused). */
  uint64_t dead_ops, dead_allocs, dead_frees, dead_locks, dead_refusals,
      dead_lost, dead_corrupt;
  uint64_t dead_sc[S_COUNT];
  uint64_t bcount[B_COUNT], bcount_past[B_COUNT];
  /* The brokers' loops: the longest turn's work (s), and the turns of
   * 500 ms or more (gmb_loop_turn_seconds), for the report only. */
  double turn_max;
  uint64_t slow_turns, slow_turns_past;
};

static int soak_count_fds(pid_t pid) {
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/fd", (int)pid);
  DIR *d = opendir(path);
  if (d == NULL) return -1;
  int n = 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL)
    if (e->d_name[0] != '.') n++;
  closedir(d);
  return n;
}

static long soak_rss_kib(pid_t pid) {
  char path[64], line[256];
  snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
  FILE *f = fopen(path, "r");
  if (f == NULL) return -1;
  long kib = -1;
  while (fgets(line, sizeof line, f))
    if (sscanf(line, "VmRSS: %ld kB", &kib) == 1) break;
  fclose(f);
  return kib;
}

/* A sample of the broker's metrics (`name` with its labels), or 0 when
 * it cannot be read. */
static double soak_metric_f(struct soak *s, const char *name) {
  static char out[1 << 16];
  if (harness_ctl(&s->b, out, sizeof out, "metrics", NULL) != 0) return 0;
  char key[128];
  snprintf(key, sizeof key, "\n%s ", name);
  const char *at = strstr(out, key);
  return at ? strtod(at + strlen(key), NULL) : 0;
}

/* A counter of the broker's metrics, or 0 when it cannot be read. */
static uint64_t soak_metric(struct soak *s, const char *name) {
  return (uint64_t)soak_metric_f(s, name);
}

/* Reads the running broker's counts (soak_bcount); `gone`: it is about to
 * go, so they join the past brokers'. */
static void soak_bcount_read(struct soak *s, int gone) {
  s->bcount[B_OFFLOADS] = soak_metric(s, "gmb_offloads_total");
  s->bcount[B_RESTORES] = soak_metric(s, "gmb_offload_restores_total");
  double longest = soak_metric_f(s, "gmb_loop_turn_max_seconds");
  if (longest > s->turn_max) s->turn_max = longest;
  uint64_t turns = soak_metric(s, "gmb_loop_turn_seconds_count");
  uint64_t quick = soak_metric(s, "gmb_loop_turn_seconds_bucket{le=\"0.25\"}");
  if (turns >= quick) s->slow_turns = turns - quick;
  struct wire_reply rep;
  if (harness_admin_status(&s->b, &rep) == 0) {
    uint64_t asks = 0;
    for (size_t i = 0; i < rep.u.admin_status.n_tenants; i++)
      asks += rep.u.admin_status.tenants[i].sleep_asks;
    s->bcount[B_ASKS] = asks;
    gmb__wire_reply_clear(&rep);
  }
  if (gone)
    for (int b = 0; b < B_COUNT; b++) {
      s->bcount_past[b] += s->bcount[b];
      s->bcount[b] = 0;
    }
  if (gone) {
    s->slow_turns_past += s->slow_turns;
    s->slow_turns = 0;
  }
}

/* The device is smaller than the tenants' quotas together, so that
 * requests find it full: then the broker offloads the movable allocations
 * of idle clients (their sleep policy) and asks them to pause their tag. */
static void soak_write_config(struct soak *s) {
  char *p = s->config;
  size_t cap = sizeof s->config;
  int n = snprintf(p, cap, "[broker]\ncompaction = auto\n"
                   "compaction_threshold = 0.2\nsleep_wait_ms = 500\n"
                   "restore_wait_ms = 500\n");
  for (int t = 0; t < s->tenants; t++) {
    int last = t == s->tenants - 1;
    n += snprintf(p + n, cap - (size_t)n, "[tenant:soak%d]\nquota = %s\n",
                  t, last && s->quota_toggle ? "12MiB" : "24MiB");
    /* With the attacker (root only), root is named: a tenant claimed by
     * its first uid would be the attacker's whenever its Hello came first
     * after a restart (while the tenant's clients nap, or are stopped). */
    if (geteuid() == 0)
      n += snprintf(p + n, cap - (size_t)n, "uids = 0\n");
  }
}

static void soak_publish(const char *endpoint) {
  atomic_fetch_add(&sh->gen, 1);
  snprintf(sh->endpoint, sizeof sh->endpoint, "%s", endpoint);
  atomic_fetch_add(&sh->gen, 1);
}

static void soak_broker_start(struct soak *s) {
  soak_write_config(s);
  harness_broker_start(&s->b, SOAK_DEVICE, s->config);
  soak_publish(s->b.endpoint);
  s->base_fds = soak_count_fds(s->b.pid);
  s->base_rss_kib = soak_rss_kib(s->b.pid);
}

static void soak_spawn(struct soak *s, int i) {
  struct soak_slot *m = &sh->slot[i];
  atomic_store(&m->pause, 0);
  atomic_store(&m->paused, 0);
  atomic_store(&m->quit, 0);
  atomic_store(&m->held, 0);
  atomic_store(&m->tags_back, 1);
  m->stopped = 0;
  m->tenant = i % s->tenants;
  m->pid = harness_fork(soak_client_main, (void *)(intptr_t)i);
}

static void soak_continue_all(void) {
  for (int i = 0; i < sh->n_slots; i++)
    if (sh->slot[i].stopped) {
      kill(sh->slot[i].pid, SIGCONT);
      sh->slot[i].stopped = 0;
    }
}

static void soak_violation(struct soak *s, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
static void soak_violation(struct soak *s, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "soak: VIOLATION: ");
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
  s->violations++;
}

static int soak_all_paused(void *arg) {
  (void)arg;
  for (int i = 0; i < sh->n_slots; i++)
    if (!atomic_load(&sh->slot[i].paused)) return 0;
  return 1;
}

struct soak_acct {
  struct soak *s;
  uint64_t used[SOAK_MAX_TENANTS], want[SOAK_MAX_TENANTS];
  uint64_t paused; /* of used: the tenants' paused_bytes */
};

static int soak_accounting_exact(void *arg) {
  struct soak_acct *a = arg;
  a->paused = 0;
  for (int t = 0; t < a->s->tenants; t++) {
    char name[32];
    struct wire_tenant_row row;
    a->want[t] = 0;
    for (int i = 0; i < sh->n_slots; i++)
      if (sh->slot[i].tenant == t) a->want[t] += atomic_load(&sh->slot[i].held);
    int rc = harness_tenant_row(&a->s->b, soak_tenant_name(t, name,
                                                           sizeof name), &row);
    /* A tenant nobody used since the last restart may not be listed.
     * What its clients hold is on the device (used) or given back by a
     * paused tag or the broker's offload (paused_bytes: their sizes, which
     * the clients made multiples of 512 for tagged allocations). */
    a->used[t] = rc == 0 ? row.used + row.paused_bytes
                 : rc == GMB_E_NOENT ? 0 : UINT64_MAX;
    a->paused += rc == 0 ? row.paused_bytes : 0;
  }
  for (int t = 0; t < a->s->tenants; t++)
    if (a->used[t] != a->want[t]) return 0;
  return 1;
}

struct soak_tags {
  struct soak *s;
  int quit;
  int n_back; /* tenants whose clients all said their tag runs */
  char why[512];
};

/* A tenant whose clients all have their tag running, nothing of it on the
 * host (or all exited), has no session with the tag paused at the broker;
 * after the last checkpoint (every client gone) no tenant holds host or
 * paused bytes at all. */
static int soak_tags_back(void *arg) {
  struct soak_tags *g = arg;
  int back[SOAK_MAX_TENANTS];
  for (int t = 0; t < g->s->tenants; t++) back[t] = 1;
  for (int i = 0; i < sh->n_slots; i++)
    if (!atomic_load(&sh->slot[i].tags_back)) back[sh->slot[i].tenant] = 0;
  g->n_back = 0;
  for (int t = 0; t < g->s->tenants; t++) g->n_back += back[t];
  struct wire_reply rep;
  if (harness_admin_status(&g->s->b, &rep) != 0) {
    snprintf(g->why, sizeof g->why, "no status");
    return 0;
  }
  int ok = 1;
  const struct wire_admin_status *st = &rep.u.admin_status;
  for (size_t i = 0; ok && i < st->n_sessions; i++) {
    const struct wire_session_row *r = &st->session_rows[i];
    int t = -1;
    if (sscanf(r->tenant, "soak%d", &t) != 1 || t < 0 || t >= g->s->tenants ||
        !back[t])
      continue;
    char list[sizeof r->paused + 2];
    snprintf(list, sizeof list, ",%s,", r->paused);
    if (strstr(list, "," SOAK_TAG ",")) {
      snprintf(g->why, sizeof g->why, "session %" PRIu64 " of tenant %s "
               "has tag " SOAK_TAG " paused (%s)", r->id, r->tenant,
               r->paused);
      ok = 0;
    }
  }
  for (size_t i = 0; ok && g->quit && i < st->n_tenants; i++) {
    const struct wire_tenant_row *r = &st->tenants[i];
    if (strncmp(r->name, "soak", 4) == 0 && (r->host_bytes || r->paused_bytes)) {
      snprintf(g->why, sizeof g->why, "tenant %s holds %" PRIu64 " host and %"
               PRIu64 " paused bytes with no client left", r->name,
               r->host_bytes, r->paused_bytes);
      ok = 0;
    }
  }
  gmb__wire_reply_clear(&rep);
  return ok;
}

static uint64_t soak_corrupt(struct soak *s) {
  uint64_t n = s->dead_corrupt;
  for (int i = 0; i < sh->n_slots; i++) n += atomic_load(&sh->slot[i].corrupt);
  return n;
}

/* Resumes every tenant (`gmbctl resume`): an operator's pause still
 * offloading a slice a loop turn ends, and its tags come back. */
static void soak_resume_all(struct soak *s) {
  char out[4096], name[32];
  for (int t = 0; t < s->tenants; t++) {
    int rc = harness_ctl(&s->b, out, sizeof out, "resume",
                         soak_tenant_name(t, name, sizeof name), NULL);
    if (rc != 0 && strstr(out, "no tenant") == NULL &&
        strstr(out, "GMB_E_NOENT") == NULL)
      soak_violation(s, "gmbctl resume exited %d: %s", rc, out);
  }
}

/* Pauses every client (continued first), checks, resumes unless `quit`. */
static void soak_checkpoint(struct soak *s, int quit) {
  soak_continue_all();
  soak_resume_all(s);
  for (int i = 0; i < sh->n_slots; i++) {
    atomic_store(&sh->slot[i].quit, quit);
    atomic_store(&sh->slot[i].pause, 1);
  }
  if (!harness_poll_until(soak_all_paused, NULL, HARNESS_WAIT_MS))
    soak_violation(s, "checkpoint %" PRIu64 ": clients did not pause",
                   s->checkpoints);
  struct soak_acct a = {.s = s};
  if (!harness_poll_until(soak_accounting_exact, &a, HARNESS_WAIT_MS))
    for (int t = 0; t < s->tenants; t++)
      if (a.used[t] != a.want[t])
        soak_violation(s, "checkpoint %" PRIu64 ": tenant soak%d: the broker "
                       "counts %" PRIu64 " bytes used or paused, its "
                       "clients hold %" PRIu64, s->checkpoints, t, a.used[t],
                       a.want[t]);
  struct soak_tags g = {.s = s, .quit = quit};
  if (!harness_poll_until(soak_tags_back, &g, HARNESS_WAIT_MS))
    soak_violation(s, "checkpoint %" PRIu64 ": %s", s->checkpoints, g.why);
  soak_bcount_read(s, 0);
  uint64_t bad = soak_corrupt(s);
  if (bad)
    soak_violation(s, "checkpoint %" PRIu64 ": %" PRIu64 " corrupted bytes "
                   "so far", s->checkpoints, bad);
  s->checkpoints++;
  int exact = soak_accounting_exact(&a);
  printf("soak: checkpoint %" PRIu64 ": accounting %s (%" PRIu64 " bytes "
         "of it paused or offloaded), tag back at the broker for %d of %d "
         "tenants, %" PRIu64 " corrupted bytes\n", s->checkpoints,
         exact ? "exact" : "WRONG", a.paused, g.n_back, s->tenants, bad);
  fflush(stdout);
  if (!quit)
    for (int i = 0; i < sh->n_slots; i++) atomic_store(&sh->slot[i].pause, 0);
}

static void soak_reap_dead(struct soak *s, int i) {
  struct soak_slot *m = &sh->slot[i];
  s->dead_ops += atomic_load(&m->ops);
  s->dead_allocs += atomic_load(&m->allocs);
  s->dead_frees += atomic_load(&m->frees);
  s->dead_locks += atomic_load(&m->locks);
  s->dead_refusals += atomic_load(&m->refusals);
  s->dead_lost += atomic_load(&m->lost);
  s->dead_corrupt += atomic_load(&m->corrupt);
  atomic_store(&m->ops, 0);
  atomic_store(&m->allocs, 0);
  atomic_store(&m->frees, 0);
  atomic_store(&m->locks, 0);
  atomic_store(&m->refusals, 0);
  atomic_store(&m->lost, 0);
  atomic_store(&m->corrupt, 0);
  for (int c = 0; c < S_COUNT; c++) {
    s->dead_sc[c] += atomic_load(&m->sc[c]);
    atomic_store(&m->sc[c], 0);
  }
}

static void soak_fault(struct soak *s, double now, double end, double start,
                       double *last_restart) {
  int i = (int)(harness_rnd(&s->rng) % (uint64_t)sh->n_slots);
  struct soak_slot *m = &sh->slot[i];
  char out[4096], name[32];
  int what = (int)(harness_rnd(&s->rng) % 100);
  double span = end - start;
  /* An operator's pause and resume happen in every run, whatever the
   * draw: the soak requires them over 20 s. */
  if (s->faults[F_PAUSE] == 0 && now > start + span / 4)
    what = 64;
  else if (s->faults[F_RESUME] == 0 && now > start + span / 2)
    what = 79;
  if (what < 15) {
    if (m->stopped) kill(m->pid, SIGCONT);
    kill(m->pid, SIGKILL);
    harness_wait(m->pid);
    soak_reap_dead(s, i);
    soak_spawn(s, i);
    s->faults[F_KILL]++;
  } else if (what < 30) {
    if (!m->stopped) {
      kill(m->pid, SIGSTOP);
      m->stopped = 1;
      m->cont_at = now + 50 + (double)(harness_rnd(&s->rng) % 1000);
      s->faults[F_STOP]++;
    }
  } else if (what < 42) {
    int t = (int)(harness_rnd(&s->rng) % (uint64_t)s->tenants);
    int rc = harness_ctl(&s->b, out, sizeof out, "evict",
                         soak_tenant_name(t, name, sizeof name), NULL);
    /* A tenant with no session since the last restart is unknown. */
    if (rc != 0 && strstr(out, "no tenant") == NULL &&
        strstr(out, "GMB_E_NOENT") == NULL)
      soak_violation(s, "gmbctl evict exited %d: %s", rc, out);
    s->faults[F_EVICT]++;
  } else if (what < 54) {
    s->quota_toggle = !s->quota_toggle;
    soak_write_config(s);
    harness_write_file(s->b.config_path, s->config);
    int rc = harness_ctl(&s->b, out, sizeof out, "reload", NULL);
    if (rc != 0) soak_violation(s, "gmbctl reload exited %d: %s", rc, out);
    s->faults[F_RELOAD]++;
  } else if (what < 64) {
    int rc = harness_ctl(&s->b, out, sizeof out, "compact", NULL);
    if (rc != 0) soak_violation(s, "gmbctl compact exited %d: %s", rc, out);
    s->faults[F_COMPACT]++;
  } else if (what < 80) {
    /* An operator's pause of every tag of the tenant's sessions (and the
     * broker's offload of its movable allocations), or its resume; never
     * a discard, which the clients would not know of. */
    int t = (int)(harness_rnd(&s->rng) % (uint64_t)s->tenants);
    int pause = what < 75; /* resumed less often: paused for a while */
    int rc = harness_ctl(&s->b, out, sizeof out, pause ? "pause" : "resume",
                         soak_tenant_name(t, name, sizeof name), NULL);
    if (rc != 0 && strstr(out, "no tenant") == NULL &&
        strstr(out, "GMB_E_NOENT") == NULL)
      soak_violation(s, "gmbctl %s exited %d: %s", pause ? "pause" : "resume",
                     rc, out);
    s->faults[pause ? F_PAUSE : F_RESUME]++;
  } else if (what < 84 && now - *last_restart > span / 5 &&
             now < start + span * 2 / 3) {
    *last_restart = now;
    soak_bcount_read(s, 1);
    if (harness_rnd(&s->rng) & 1) {
      harness_broker_stop(&s->b); /* fails the test unless it exits 0 */
      s->faults[F_RESTART_TERM]++;
    } else {
      /* Keep the log short: reaping a killed broker dumps it. */
      if (truncate(s->b.log_path, 0) != 0) perror("truncate");
      kill(s->b.pid, SIGKILL);
      while (harness_broker_alive(&s->b)) harness_sleep_ms(5);
      harness_broker_rm_dir(&s->b);
      s->faults[F_RESTART_KILL]++;
    }
    soak_broker_start(s);
  }
}

START_TEST(soak_with_faults) {
  struct soak s;
  memset(&s, 0, sizeof s);
  long secs = harness_env_long("SOAK_SECONDS", 60);
  s.tenants = (int)harness_env_long("SOAK_TENANTS", 3);
  s.clients_per = (int)harness_env_long("SOAK_CLIENTS", 2);
  ck_assert_int_ge(s.tenants, 1);
  ck_assert_int_le(s.tenants, SOAK_MAX_TENANTS);
  ck_assert_int_le(s.tenants * s.clients_per, SOAK_MAX_CLIENTS);
  s.rng = (uint64_t)harness_env_long("SOAK_SEED", 12) | 1;
  /* A client waits for a broker that is gone for at most this long. */
  setenv("GMB_CONNECT_TIMEOUT_MS", "2000", 1);
  setenv("GMB_REQUEST_TIMEOUT_MS", "3000", 1);
  /* A tag the broker paused resumes at the next touch within this. */
  setenv("GMB_RESUME_WAIT_MS", "1000", 1);
  sh = mmap(NULL, sizeof *sh, PROT_READ | PROT_WRITE,
            MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  ck_assert_ptr_ne(sh, MAP_FAILED);
  memset(sh, 0, sizeof *sh);
  sh->n_slots = s.tenants * s.clients_per;
  soak_broker_start(&s);
  printf("soak: %ld s, %d tenants x %d clients, broker idle: %d "
         "descriptors, RSS %ld KiB\n", secs, s.tenants, s.clients_per,
         s.base_fds, s.base_rss_kib);
  for (int i = 0; i < sh->n_slots; i++) soak_spawn(&s, i);
  pid_t attacker = 0;
  if (geteuid() == 0)
    attacker = harness_fork(soak_attacker_main, NULL);
  else
    printf("soak: not root, so no attacker (it runs as another uid)\n");

  double start = harness_now_ms(), end = start + (double)secs * 1000;
  double every = (double)(secs * 1000 / 6 > 5000 ? secs * 1000 / 6 : 5000);
  double next_cp = start + every, last_restart = start;
  while (harness_now_ms() < end) {
    double now = harness_now_ms();
    for (int i = 0; i < sh->n_slots; i++)
      if (sh->slot[i].stopped && now >= sh->slot[i].cont_at) {
        kill(sh->slot[i].pid, SIGCONT);
        sh->slot[i].stopped = 0;
      }
    if (now >= next_cp) {
      soak_checkpoint(&s, 0);
      next_cp = harness_now_ms() + every;
      continue;
    }
    soak_fault(&s, now, end, start, &last_restart);
    harness_sleep_ms(100 + (int)(harness_rnd(&s.rng) % 300));
  }
  if (attacker) {
    atomic_store(&sh->attack_quit, 1);
    int rc = harness_wait(attacker);
    if (rc != 0) soak_violation(&s, "the attacker exited %d", rc);
  }
  soak_checkpoint(&s, 1); /* the last one: clients disconnect and exit */
  for (int i = 0; i < sh->n_slots; i++) {
    int rc = harness_wait(sh->slot[i].pid);
    if (rc != 0) soak_violation(&s, "client %d exited %d", i, rc);
  }

  /* The broker after load: descriptors and RSS back near idle. */
  pid_t bp = s.b.pid;
  double deadline = harness_now_ms() + HARNESS_WAIT_MS;
  int fds;
  long rss;
  for (;;) {
    fds = soak_count_fds(bp);
    rss = soak_rss_kib(bp);
    if ((fds <= s.base_fds + 2 &&
         (!SOAK_RSS_CHECKED || rss <= s.base_rss_kib + 16 * 1024)) ||
        harness_now_ms() > deadline)
      break;
    harness_sleep_ms(50);
  }
  if (fds > s.base_fds + 2)
    soak_violation(&s, "broker descriptors: %d after the clients ended, %d "
                   "when idle", fds, s.base_fds);
#ifdef __SANITIZE_ADDRESS__
  /* Built with SAN=1 (the broker too): AddressSanitizer keeps freed memory
   * in its quarantine (256 MiB by default), so RSS says nothing here; a
   * leak is LeakSanitizer's to find when the broker exits, which then
   * fails its stop (harness_broker_stop wants status 0). */
  printf("soak: broker RSS %ld KiB after load (idle %ld KiB): not checked "
         "under AddressSanitizer\n", rss, s.base_rss_kib);
#else
  if (rss > s.base_rss_kib + 16 * 1024)
    soak_violation(&s, "broker RSS: %ld KiB after load, %ld KiB when idle",
                   rss, s.base_rss_kib);
#endif

  uint64_t ops = s.dead_ops, allocs = s.dead_allocs, frees = s.dead_frees,
           locks = s.dead_locks, refusals = s.dead_refusals,
           lost = s.dead_lost;
  for (int i = 0; i < sh->n_slots; i++) {
    ops += atomic_load(&sh->slot[i].ops);
    allocs += atomic_load(&sh->slot[i].allocs);
    frees += atomic_load(&sh->slot[i].frees);
    locks += atomic_load(&sh->slot[i].locks);
    refusals += atomic_load(&sh->slot[i].refusals);
    lost += atomic_load(&sh->slot[i].lost);
  }
  uint64_t nfaults = 0;
  printf("soak: operations %" PRIu64 " (allocs %" PRIu64 ", frees %" PRIu64
         ", locks with a pattern check %" PRIu64 ", refused %" PRIu64
         "), sessions lost and reopened %" PRIu64 "\n", ops, allocs, frees,
         locks, refusals, lost);
  for (int f = 0; f < F_COUNT; f++) {
    printf("soak: fault %-26s %" PRIu64 "\n", soak_fault_names[f],
           s.faults[f]);
    nfaults += s.faults[f];
  }
  uint64_t sc[S_COUNT];
  for (int c = 0; c < S_COUNT; c++) {
    sc[c] = s.dead_sc[c];
    for (int i = 0; i < sh->n_slots; i++) sc[c] += atomic_load(&sh->slot[i].sc[c]);
    printf("soak: sleep %-40s %" PRIu64 "\n", soak_scount_names[c], sc[c]);
  }
  for (int b = 0; b < B_COUNT; b++)
    printf("soak: sleep %-40s %" PRIu64 "\n", soak_bcount_names[b],
           s.bcount_past[b] + s.bcount[b]);
  printf("soak: broker loop: longest turn %.0f ms, %" PRIu64 " turns over "
         "250 ms (not checked: a loaded machine makes them too)\n",
         s.turn_max * 1e3, s.slow_turns_past + s.slow_turns);
  if (sc[S_WRONG])
    soak_violation(&s, "%" PRIu64 " answers of sleep and wake the API does "
                   "not give", sc[S_WRONG]);
  /* Over 20 s each path of sleep and wake runs, so that none of them can
   * silently stop being exercised. */
  if (secs >= 20) {
    static const int need[] = {S_PAUSES, S_DISCARDS, S_RESUMES, S_OP_SEEN};
    for (size_t n = 0; n < sizeof need / sizeof need[0]; n++)
      if (sc[need[n]] == 0)
        soak_violation(&s, "no %s in %ld s", soak_scount_names[need[n]],
                       secs);
    if (s.faults[F_PAUSE] == 0 || s.faults[F_RESUME] == 0)
      soak_violation(&s, "no gmbctl pause or resume in %ld s", secs);
    if (s.bcount_past[B_RESTORES] + s.bcount[B_RESTORES] == 0)
      soak_violation(&s, "no restore of a broker offload in %ld s", secs);
  }
  printf("soak: %" PRIu64 " faults, %" PRIu64 " checkpoints, %" PRIu64
         " corrupted bytes, broker at the end: %d descriptors (idle %d), "
         "RSS %ld KiB (idle %ld KiB)\n", nfaults, s.checkpoints,
         soak_corrupt(&s), fds, s.base_fds, rss, s.base_rss_kib);
  for (int a = 0; a < A_COUNT; a++)
    printf("soak: attack %-30s %" PRIu64 "\n", soak_attack_names[a],
           (uint64_t)atomic_load(&sh->attacks[a]));
  printf("soak: attacks let through %" PRIu64 ", unanswered while the "
         "broker ran %" PRIu64 "\n", (uint64_t)atomic_load(&sh->attack_wrong),
         (uint64_t)atomic_load(&sh->attack_unanswered));
  if (atomic_load(&sh->attack_wrong))
    soak_violation(&s, "%" PRIu64 " attacks let through",
                   (uint64_t)atomic_load(&sh->attack_wrong));
  printf("soak: %" PRIu64 " violations\n", s.violations);
  fflush(stdout);
  harness_broker_stop(&s.b);
  ck_assert_uint_gt(allocs, 0);
  ck_assert_uint_eq(s.violations, 0);
  munmap(sh, sizeof *sh);
}
END_TEST

int main(void) {
  long secs = harness_env_long("SOAK_SECONDS", 60);
  return harness_main(HARNESS_SUITE("soak", "faults", (double)secs + 300,
                                    soak_with_faults));
}
