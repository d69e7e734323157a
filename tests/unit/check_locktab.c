/*
 * check_locktab.c - the broker's side of a session's lock table, alone and
 * against a second process that locks the way the client library does.
 *
 * Each test makes a table for a made-up session id (unique per test, so a
 * table a failed test left behind never collides) and destroys it; the
 * teardown checks that no "/gmb-lt-<pid>-*" name is left in /dev/shm.  The
 * two-process test forks a child that maps the table by name before it is
 * unlinked and hammers one slot with the client's CAS loops, while the
 * parent claims, "copies" and publishes like a compaction; both report what
 * they saw through a shared anonymous mapping.
 *
 * Knobs: ITER (locks the child takes in hammer tests, default 20000).
 */
#include <check.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check_main.h"
#include "locktab.h"
#include "gmb.h"

static uint64_t next_session = 1000;
static struct gmb_locktab *lt;

static struct gmb_locktab *lt_new(uint32_t slots) {
  char err[256] = "";
  struct gmb_locktab *t =
      gmb__locktab_new(++next_session, getuid(), getgid(), slots, err,
                       sizeof err);
  ck_assert_msg(t != NULL, "%s", err);
  return t;
}

/* Names of this process's lock tables still in /dev/shm. */
static int lt_leftovers(void) {
  char prefix[64];
  snprintf(prefix, sizeof prefix, "gmb-lt-%ld-", (long)getpid());
  DIR *d = opendir("/dev/shm");
  if (d == NULL) return 0;
  int n = 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL)
    if (strncmp(e->d_name, prefix, strlen(prefix)) == 0) {
      fprintf(stderr, "left over: /dev/shm/%s\n", e->d_name);
      n++;
    }
  closedir(d);
  return n;
}

static void setup(void) { lt = NULL; }

static void teardown(void) {
  gmb__locktab_destroy(lt);
  lt = NULL;
  ck_assert_int_eq(lt_leftovers(), 0);
}

/* Maps a table by name the way the client does; NULL on failure with
 * errno set. */
static struct gmb__lt_header *lt_map(const char *name, uint32_t slots) {
  int fd = shm_open(name, O_RDWR, 0);
  if (fd < 0) return NULL;
  void *p = mmap(NULL, gmb__lt_bytes(slots), PROT_READ | PROT_WRITE,
                 MAP_SHARED, fd, 0);
  int err = errno;
  close(fd);
  errno = err;
  return p == MAP_FAILED ? NULL : p;
}

/* --- the client's side of the protocol, as client.c does it -------------- */

static void cli_lock(struct gmb__lt_slot *s) {
  uint32_t st = atomic_load_explicit(&s->state, memory_order_acquire);
  for (;;) {
    if (st == GMB_LT_MOVING) {
      sched_yield();
      st = atomic_load_explicit(&s->state, memory_order_acquire);
      continue;
    }
    if (atomic_compare_exchange_weak_explicit(&s->state, &st, st + 1,
                                              memory_order_acq_rel,
                                              memory_order_acquire))
      return;
  }
}

static void cli_unlock(struct gmb__lt_slot *s) {
  atomic_fetch_sub_explicit(&s->state, 1, memory_order_release);
}

/* --- one process -------------------------------------------------------- */

START_TEST(new_fills_header_and_name) {
  lt = lt_new(16);
  char want[64];
  snprintf(want, sizeof want, "/gmb-lt-%ld-%llu", (long)getpid(),
           (unsigned long long)next_session);
  ck_assert_str_eq(gmb__locktab_name(lt), want);
  ck_assert_uint_eq(gmb__locktab_slots(lt), 16);
  ck_assert_uint_eq(gmb__locktab_used(lt), 0);
  int fd = shm_open(want, O_RDONLY, 0);
  ck_assert_int_ge(fd, 0);
  struct stat st;
  ck_assert_int_eq(fstat(fd, &st), 0);
  close(fd);
  ck_assert_uint_eq(st.st_mode & 0777, 0600);
  ck_assert_uint_eq((uint64_t)st.st_size, gmb__lt_bytes(16));
  struct gmb__lt_header *h = lt_map(want, 16);
  ck_assert_ptr_nonnull(h);
  ck_assert_uint_eq(h->magic, GMB_LT_MAGIC);
  ck_assert_uint_eq(h->version, GMB_LT_VERSION);
  ck_assert_uint_eq(h->slots, 16);
  ck_assert_uint_eq(h->session, next_session);
  for (uint32_t i = 0; i < 16; i++) {
    ck_assert_uint_eq(atomic_load(&gmb__lt_slots(h)[i].state), 0);
    ck_assert_uint_eq(gmb__lt_slots(h)[i].id, 0);
  }
  munmap(h, gmb__lt_bytes(16));
}
END_TEST

START_TEST(new_zero_slots_refused) {
  char err[256] = "";
  ck_assert_ptr_null(gmb__locktab_new(++next_session, getuid(), getgid(), 0,
                                      err, sizeof err));
  ck_assert_ptr_nonnull(strstr(err, "slots"));
  ck_assert_ptr_null(gmb__locktab_new(++next_session, getuid(), getgid(),
                                      UINT32_MAX, err, sizeof err));
}
END_TEST

START_TEST(new_same_session_twice_exists) {
  lt = lt_new(4);
  char err[256] = "";
  ck_assert_ptr_null(gmb__locktab_new(next_session, getuid(), getgid(), 4,
                                      err, sizeof err));
  ck_assert_ptr_nonnull(strstr(err, "exists"));
  /* The failed attempt did not remove the first table's name. */
  int fd = shm_open(gmb__locktab_name(lt), O_RDONLY, 0);
  ck_assert_int_ge(fd, 0);
  close(fd);
}
END_TEST

START_TEST(slot_new_writes_position) {
  lt = lt_new(8);
  struct gmb__lt_header *h = lt_map(gmb__locktab_name(lt), 8);
  ck_assert_ptr_nonnull(h);
  uint32_t slot = 99;
  ck_assert_int_eq(gmb__locktab_slot_new(lt, 42, 3, 4096, &slot), 0);
  ck_assert_uint_lt(slot, 8);
  struct gmb__lt_slot *s = &gmb__lt_slots(h)[slot];
  ck_assert_uint_eq(s->id, 42);
  ck_assert_uint_eq(s->segment, 3);
  ck_assert_uint_eq(s->offset, 4096);
  ck_assert_uint_eq(atomic_load(&s->state), 0);
  ck_assert_uint_eq(gmb__locktab_slot_id(lt, slot), 42);
  ck_assert_uint_eq(gmb__locktab_used(lt), 1);
  munmap(h, gmb__lt_bytes(8));
}
END_TEST

START_TEST(slots_exhausted_limit) {
  lt = lt_new(4);
  uint32_t got[4];
  int seen[4] = {0};
  for (int i = 0; i < 4; i++) {
    ck_assert_int_eq(gmb__locktab_slot_new(lt, 100 + i, 1, 0, &got[i]), 0);
    ck_assert_uint_lt(got[i], 4);
    ck_assert_int_eq(seen[got[i]]++, 0); /* every slot once */
  }
  uint32_t slot = 77;
  ck_assert_int_eq(gmb__locktab_slot_new(lt, 200, 1, 0, &slot), GMB_E_LIMIT);
  ck_assert_uint_eq(slot, 77); /* untouched */
  ck_assert_uint_eq(gmb__locktab_used(lt), 4);
  /* One freed: exactly that one comes back, then full again. */
  gmb__locktab_slot_free(lt, got[2]);
  ck_assert_uint_eq(gmb__locktab_used(lt), 3);
  ck_assert_int_eq(gmb__locktab_slot_new(lt, 201, 1, 0, &slot), 0);
  ck_assert_uint_eq(slot, got[2]);
  ck_assert_int_eq(gmb__locktab_slot_new(lt, 202, 1, 0, &slot), GMB_E_LIMIT);
}
END_TEST

START_TEST(free_list_reuse_resets_slot) {
  lt = lt_new(64);
  struct gmb__lt_header *h = lt_map(gmb__locktab_name(lt), 64);
  ck_assert_ptr_nonnull(h);
  uint32_t a, b, c;
  ck_assert_int_eq(gmb__locktab_slot_new(lt, 1, 1, 0, &a), 0);
  ck_assert_int_eq(gmb__locktab_slot_new(lt, 2, 1, 512, &b), 0);
  ck_assert_int_eq(gmb__locktab_slot_new(lt, 3, 1, 1024, &c), 0);
  /* A client that freed without unlocking: the slot is reset anyway. */
  atomic_store(&gmb__lt_slots(h)[b].state, 3);
  gmb__locktab_slot_free(lt, b);
  ck_assert_uint_eq(atomic_load(&gmb__lt_slots(h)[b].state), 0);
  ck_assert_uint_eq(gmb__lt_slots(h)[b].id, 0);
  gmb__locktab_slot_free(lt, a);
  /* Freed slots are reused before fresh ones: no table growth in a
   * session that allocates and frees for hours. */
  uint32_t x, y, z;
  ck_assert_int_eq(gmb__locktab_slot_new(lt, 4, 2, 0, &x), 0);
  ck_assert_int_eq(gmb__locktab_slot_new(lt, 5, 2, 0, &y), 0);
  ck_assert_int_eq(gmb__locktab_slot_new(lt, 6, 2, 0, &z), 0);
  ck_assert((x == a && y == b) || (x == b && y == a));
  ck_assert_uint_ne(z, a);
  ck_assert_uint_ne(z, b);
  ck_assert_uint_ne(z, c);
  ck_assert_uint_eq(gmb__lt_slots(h)[x].id, 4);
  ck_assert_uint_eq(gmb__lt_slots(h)[y].id, 5);
  ck_assert_uint_eq(gmb__locktab_used(lt), 4);
  /* Many rounds of new/free stay within the slots touched so far. */
  for (int i = 0; i < 1000; i++) {
    uint32_t s;
    ck_assert_int_eq(gmb__locktab_slot_new(lt, 1000 + i, 1, 0, &s), 0);
    ck_assert_uint_le(s, 4);
    gmb__locktab_slot_free(lt, s);
  }
  munmap(h, gmb__lt_bytes(64));
}
END_TEST

START_TEST(claim_refused_while_locked) {
  lt = lt_new(4);
  struct gmb__lt_header *h = lt_map(gmb__locktab_name(lt), 4);
  ck_assert_ptr_nonnull(h);
  uint32_t slot;
  ck_assert_int_eq(gmb__locktab_slot_new(lt, 7, 1, 512, &slot), 0);
  struct gmb__lt_slot *s = &gmb__lt_slots(h)[slot];
  cli_lock(s);
  cli_lock(s);
  ck_assert_uint_eq(gmb__locktab_holders(lt, slot), 2);
  ck_assert_int_eq(gmb__locktab_claim(lt, slot), 0);
  ck_assert_uint_eq(atomic_load(&s->state), 2); /* a refused claim writes nothing */
  cli_unlock(s);
  ck_assert_uint_eq(gmb__locktab_holders(lt, slot), 1);
  ck_assert_int_eq(gmb__locktab_claim(lt, slot), 0);
  cli_unlock(s);
  ck_assert_uint_eq(gmb__locktab_holders(lt, slot), 0);
  ck_assert_int_eq(gmb__locktab_claim(lt, slot), 1);
  ck_assert_uint_eq(atomic_load(&s->state), GMB_LT_MOVING);
  ck_assert_uint_eq(gmb__locktab_holders(lt, slot), 0);
  ck_assert_int_eq(gmb__locktab_claim(lt, slot), 0); /* not twice */
  munmap(h, gmb__lt_bytes(4));
}
END_TEST

START_TEST(publish_moves_release_keeps) {
  lt = lt_new(4);
  struct gmb__lt_header *h = lt_map(gmb__locktab_name(lt), 4);
  ck_assert_ptr_nonnull(h);
  uint32_t slot;
  ck_assert_int_eq(gmb__locktab_slot_new(lt, 7, 1, 512, &slot), 0);
  struct gmb__lt_slot *s = &gmb__lt_slots(h)[slot];
  ck_assert_int_eq(gmb__locktab_claim(lt, slot), 1);
  gmb__locktab_publish(lt, slot, 9, 8192);
  ck_assert_uint_eq(atomic_load(&s->state), 0);
  ck_assert_uint_eq(s->segment, 9);
  ck_assert_uint_eq(s->offset, 8192);
  ck_assert_uint_eq(s->id, 7);
  ck_assert_int_eq(gmb__locktab_claim(lt, slot), 1);
  gmb__locktab_release(lt, slot);
  ck_assert_uint_eq(atomic_load(&s->state), 0);
  ck_assert_uint_eq(s->segment, 9);
  ck_assert_uint_eq(s->offset, 8192);
  cli_lock(s); /* lockable again */
  ck_assert_uint_eq(gmb__locktab_holders(lt, slot), 1);
  munmap(h, gmb__lt_bytes(4));
}
END_TEST

START_TEST(unlink_name_gone_mappings_work) {
  lt = lt_new(4);
  char name[64];
  snprintf(name, sizeof name, "%s", gmb__locktab_name(lt));
  struct gmb__lt_header *h = lt_map(name, 4);
  ck_assert_ptr_nonnull(h);
  gmb__locktab_unlink(lt);
  errno = 0;
  ck_assert_int_lt(shm_open(name, O_RDWR, 0), 0);
  ck_assert_int_eq(errno, ENOENT);
  gmb__locktab_unlink(lt); /* idempotent */
  ck_assert_str_eq(gmb__locktab_name(lt), name); /* still names it */
  /* Both mappings still share the pages. */
  uint32_t slot;
  ck_assert_int_eq(gmb__locktab_slot_new(lt, 5, 2, 1024, &slot), 0);
  struct gmb__lt_slot *s = &gmb__lt_slots(h)[slot];
  ck_assert_uint_eq(s->id, 5);
  cli_lock(s);
  ck_assert_uint_eq(gmb__locktab_holders(lt, slot), 1);
  ck_assert_int_eq(gmb__locktab_claim(lt, slot), 0);
  cli_unlock(s);
  ck_assert_int_eq(gmb__locktab_claim(lt, slot), 1);
  gmb__locktab_publish(lt, slot, 3, 0);
  ck_assert_uint_eq(s->segment, 3);
  munmap(h, gmb__lt_bytes(4));
}
END_TEST

START_TEST(destroy_unlinks_and_accepts_null) {
  gmb__locktab_destroy(NULL);
  struct gmb_locktab *t = lt_new(4);
  char name[64];
  snprintf(name, sizeof name, "%s", gmb__locktab_name(t));
  gmb__locktab_destroy(t);
  errno = 0;
  ck_assert_int_lt(shm_open(name, O_RDONLY, 0), 0);
  ck_assert_int_eq(errno, ENOENT);
  t = lt_new(4);
  gmb__locktab_unlink(t);
  gmb__locktab_destroy(t); /* after an unlink: nothing left to remove */
}
END_TEST

/* A broker bug (a slot it never handed out) aborts; checked in a child so
 * that the suite runs the same forked or not. */
static int aborts(void (*fn)(void)) {
  fflush(stderr);
  pid_t pid = fork();
  if (pid == 0) {
    int devnull = open("/dev/null", O_WRONLY);
    if (devnull >= 0) dup2(devnull, 2); /* the expected assertion message */
    fn();
    _exit(0);
  }
  int status;
  waitpid(pid, &status, 0);
  return WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT;
}

static void bad_claim(void) {
  uint32_t slot;
  gmb__locktab_slot_new(lt, 1, 1, 0, &slot);
  gmb__locktab_claim(lt, 4);
}
static void bad_free_twice(void) {
  uint32_t slot;
  gmb__locktab_slot_new(lt, 1, 1, 0, &slot);
  gmb__locktab_slot_free(lt, slot);
  gmb__locktab_slot_free(lt, slot);
}
static void bad_publish_unused(void) { gmb__locktab_publish(lt, 2, 1, 0); }

START_TEST(slot_out_of_range_is_a_bug) {
  lt = lt_new(4);
  ck_assert(aborts(bad_claim));
  ck_assert(aborts(bad_free_twice));
  ck_assert(aborts(bad_publish_unused));
}
END_TEST

/* --- two processes ------------------------------------------------------- */

/* What the child and the parent share, besides the table.  `data` plays
 * the device memory: the allocation is the word at data[offset]; the
 * parent's "copy" writes the value at the new offset and poisons the old
 * one, so a child that reads through a stale position sees the poison. */
#define HAMMER_WORDS 8
#define HAMMER_VALUE UINT64_C(0x600dcafe600dcafe)
#define HAMMER_POISON UINT64_C(0xdeaddeaddeaddead)

struct hammer {
  _Atomic uint64_t data[HAMMER_WORDS];
  atomic_int holding;      /* the child is between its CAS and unlock */
  atomic_int child_ready;  /* the child mapped the table */
  atomic_long locks, stale, moved_seen, claims, claims_while_held;
};

struct hammer_child {
  const char *name;
  uint32_t slots, slot;
  long iter;
  struct hammer *hm;
};

static int hammer_child_main(struct hammer_child *a) {
  struct gmb__lt_header *h = lt_map(a->name, a->slots);
  if (h == NULL) return 2;
  if (h->magic != GMB_LT_MAGIC) return 3;
  struct hammer *hm = a->hm;
  atomic_store(&hm->child_ready, 1);
  struct gmb__lt_slot *s = &gmb__lt_slots(h)[a->slot];
  uint64_t last_off = UINT64_MAX;
  /* At least `iter` locks, and at least 50 moves seen between them, so
   * that the test proves something about moves (the parent keeps
   * moving until the child is done). */
  for (long i = 0; i < a->iter || atomic_load(&hm->moved_seen) < 50; i++) {
    cli_lock(s);
    atomic_store(&hm->holding, 1);
    uint64_t seg = s->segment, off = s->offset;
    if (off >= HAMMER_WORDS) return 4;
    if (last_off != UINT64_MAX && off != last_off)
      atomic_fetch_add(&hm->moved_seen, 1);
    last_off = off;
    for (int k = 0; k < 20; k++) {
      if (atomic_load(&hm->data[off]) != HAMMER_VALUE)
        atomic_fetch_add(&hm->stale, 1);
      if (s->segment != seg || s->offset != off)
        atomic_fetch_add(&hm->stale, 1);
    }
    atomic_store(&hm->holding, 0);
    cli_unlock(s);
    atomic_fetch_add(&hm->locks, 1);
  }
  return 0;
}

START_TEST(two_processes_claim_never_overlaps_a_hold) {
  long iter = getenv("ITER") ? atol(getenv("ITER")) : 20000;
  lt = lt_new(8);
  struct hammer *hm = mmap(NULL, sizeof *hm, PROT_READ | PROT_WRITE,
                           MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  ck_assert_ptr_ne(hm, MAP_FAILED);
  memset(hm, 0, sizeof *hm);
  uint32_t slot;
  ck_assert_int_eq(gmb__locktab_slot_new(lt, 77, 1, 0, &slot), 0);
  atomic_store(&hm->data[0], HAMMER_VALUE);
  for (int i = 1; i < HAMMER_WORDS; i++)
    atomic_store(&hm->data[i], HAMMER_POISON);

  struct hammer_child arg = {gmb__locktab_name(lt), 8, slot, iter, hm};
  fflush(stderr);
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0) _exit(hammer_child_main(&arg));
  /* The child maps the table by name; unlinking after that, as the broker
   * does at the session's next request, must not disturb it. */
  while (!atomic_load(&hm->child_ready)) {
    int status;
    if (waitpid(pid, &status, WNOHANG) == pid)
      ck_abort_msg("child exited early with %d", WEXITSTATUS(status));
    sched_yield();
  }
  gmb__locktab_unlink(lt);

  uint64_t off = 0;
  int status = 0;
  for (;;) {
    if (waitpid(pid, &status, WNOHANG) == pid) break;
    if (!gmb__locktab_claim(lt, slot)) {
      sched_yield();
      continue;
    }
    atomic_fetch_add(&hm->claims, 1);
    if (atomic_load(&hm->holding)) atomic_fetch_add(&hm->claims_while_held, 1);
    /* The move: copy to the next word, poison the old one, publish. */
    uint64_t to = (off + 1) % HAMMER_WORDS;
    atomic_store(&hm->data[to], atomic_load(&hm->data[off]));
    atomic_store(&hm->data[off], HAMMER_POISON);
    off = to;
    gmb__locktab_publish(lt, slot, 1 + (to & 1), to);
    sched_yield(); /* let the child in between moves */
  }
  ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0,
                "child status 0x%x", status);
  long locks = atomic_load(&hm->locks), moved = atomic_load(&hm->moved_seen);
  long claims = atomic_load(&hm->claims);
  long while_held = atomic_load(&hm->claims_while_held);
  long stale = atomic_load(&hm->stale);
  ck_assert_int_ge(locks, iter);
  ck_assert_int_ge(moved, 50);
  ck_assert_int_gt(claims, 0);
  ck_assert_int_eq(while_held, 0);
  ck_assert_int_eq(stale, 0);
  ck_assert_uint_eq(gmb__locktab_holders(lt, slot), 0);
  munmap(hm, sizeof *hm);
}
END_TEST

/* --- ownership (root only) ------------------------------------------------ */

/* In a child: become uid:gid and try to open `name` read-write.  Exits 0
 * when it opened, else with the errno. */
static int open_as(const char *name, uid_t uid, gid_t gid) {
  fflush(stderr);
  pid_t pid = fork();
  if (pid == 0) {
    if (setgroups(0, NULL) != 0 || setgid(gid) != 0 || setuid(uid) != 0)
      _exit(200);
    int fd = shm_open(name, O_RDWR, 0);
    if (fd < 0) _exit(errno ? errno : 201);
    struct gmb__lt_header *h = mmap(NULL, sizeof *h, PROT_READ | PROT_WRITE,
                                   MAP_SHARED, fd, 0);
    _exit(h == MAP_FAILED ? 202 : h->magic == GMB_LT_MAGIC ? 0 : 203);
  }
  int status;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 255;
}

START_TEST(other_uid_cannot_map_table) {
  if (geteuid() != 0) {
    fprintf(stderr, "other_uid_cannot_map_table: skipped: needs root to "
            "create tables for other uids\n");
    return;
  }
  char err[256] = "";
  lt = gmb__locktab_new(++next_session, 65534, 65534, 16, err, sizeof err);
  ck_assert_msg(lt != NULL, "%s", err);
  const char *name = gmb__locktab_name(lt);
  int fd = shm_open(name, O_RDONLY, 0);
  ck_assert_int_ge(fd, 0);
  struct stat st;
  ck_assert_int_eq(fstat(fd, &st), 0);
  close(fd);
  ck_assert_uint_eq(st.st_uid, 65534);
  ck_assert_uint_eq(st.st_gid, 65534);
  ck_assert_uint_eq(st.st_mode & 0777, 0600);
  /* The session's own uid maps it; another session's uid may not. */
  ck_assert_int_eq(open_as(name, 65534, 65534), 0);
  ck_assert_int_eq(open_as(name, 65533, 65533), EACCES);
  ck_assert_int_eq(open_as(name, 65533, 65534), EACCES); /* not by group */
}
END_TEST

START_TEST(root_session_table_stays_root) {
  lt = lt_new(4); /* for this process's own uid */
  int fd = shm_open(gmb__locktab_name(lt), O_RDONLY, 0);
  ck_assert_int_ge(fd, 0);
  struct stat st;
  ck_assert_int_eq(fstat(fd, &st), 0);
  close(fd);
  ck_assert_uint_eq(st.st_uid, geteuid());
}
END_TEST

static Suite *locktab_suite(void) {
  Suite *s = suite_create("locktab");
  TCase *tc = tcase_create("table");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_add_test(tc, new_fills_header_and_name);
  tcase_add_test(tc, new_zero_slots_refused);
  tcase_add_test(tc, new_same_session_twice_exists);
  tcase_add_test(tc, unlink_name_gone_mappings_work);
  tcase_add_test(tc, destroy_unlinks_and_accepts_null);
  tcase_add_test(tc, root_session_table_stays_root);
  tcase_add_test(tc, other_uid_cannot_map_table);
  suite_add_tcase(s, tc);

  tc = tcase_create("slots");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_add_test(tc, slot_new_writes_position);
  tcase_add_test(tc, slots_exhausted_limit);
  tcase_add_test(tc, free_list_reuse_resets_slot);
  tcase_add_test(tc, claim_refused_while_locked);
  tcase_add_test(tc, publish_moves_release_keeps);
  tcase_add_test(tc, slot_out_of_range_is_a_bug);
  suite_add_tcase(s, tc);

  tc = tcase_create("processes");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_add_test(tc, two_processes_claim_never_overlaps_a_hold);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) { return check_run(locktab_suite()); }
