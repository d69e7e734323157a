/*
 * check_locktab.c - the broker's side of a session's lock table, alone and
 * against a second process that locks the way the client library does.
 *
 * A table is a memfd: no name anywhere, sealed against shrinking and
 * growing (and against more seals), mapped by the broker and by its client
 * from a copy of its descriptor.  Each test makes a table for a made-up
 * session id and destroys it; the teardown checks that the process has as
 * many descriptors open as before the test (the memfd was closed) and that
 * no gmb name appeared in /dev/shm.  Clients map the table from the
 * descriptor; the tests do the same, from the broker's descriptor or from
 * a copy sent over a socket with SCM_RIGHTS (proto/fdpass.h), as the
 * descriptor channel does.  The two-process test hands a forked child the
 * table that way; the child hammers one slot with the client's CAS loops
 * while the parent claims, "copies" and publishes like a compaction; both
 * report what they saw through a shared anonymous mapping.
 *
 * Knobs: ITER (locks the child takes in hammer tests, default 20000).
 */
#include <check.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check_main.h"
#include "fdpass.h"
#include "locktab.h"
#include "gmb.h"

static uint64_t next_session = 1000;
static struct gmb_locktab *lt;
static int fds_before, shm_before;

static struct gmb_locktab *lt_new(uint32_t slots) {
  char err[256] = "";
  struct gmb_locktab *t = gmb__locktab_new(++next_session, slots, err,
                                           sizeof err);
  ck_assert_msg(t != NULL, "%s", err);
  return t;
}

static void setup(void) {
  lt = NULL;
  fds_before = check_count_fds();
  shm_before = check_shm_names();
}

static void teardown(void) {
  gmb__locktab_destroy(lt);
  lt = NULL;
  ck_assert_int_eq(check_count_fds(), fds_before);
  ck_assert_int_eq(check_shm_names(), shm_before);
}

/* Maps a table from a descriptor the way the client does; NULL on failure
 * with errno set. */
static struct gmb__lt_header *lt_map_fd(int fd, uint32_t slots) {
  void *p = mmap(NULL, gmb__lt_bytes(slots), PROT_READ | PROT_WRITE,
                 MAP_SHARED, fd, 0);
  return p == MAP_FAILED ? NULL : p;
}

/* Maps table t from the broker's own descriptor. */
static struct gmb__lt_header *lt_map(const struct gmb_locktab *t) {
  return lt_map_fd(gmb__locktab_fd(t), gmb__locktab_slots(t));
}

/* A copy of t's descriptor as a client receives it: sent with SCM_RIGHTS
 * over a socket pair (a new descriptor for the same open file). */
static int lt_fd_passed(const struct gmb_locktab *t) {
  int sv[2];
  ck_assert_int_eq(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv),
                   0);
  char msg = 'L';
  ck_assert_int_eq(gmb__fd_send(sv[0], &msg, 1, gmb__locktab_fd(t), 0), 0);
  int fd = -1;
  char got = 0;
  ck_assert_int_eq(gmb__fd_recv(sv[1], &got, 1, &fd, 0), 1);
  ck_assert_int_eq(got, 'L');
  ck_assert_int_ge(fd, 0);
  ck_assert_int_ne(fd, gmb__locktab_fd(t));
  close(sv[0]);
  close(sv[1]);
  return fd;
}

/* 1 when descriptor fd is the memfd called `name`. */
static int fd_is_memfd(int fd, const char *name) {
  char path[64], link[256], want[128];
  snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
  ssize_t n = readlink(path, link, sizeof link - 1);
  if (n < 0) return 0;
  link[n] = '\0';
  snprintf(want, sizeof want, "/memfd:%s ", name);
  return strncmp(link, want, strlen(want)) == 0;
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

START_TEST(new_fills_header_and_fd) {
  lt = lt_new(16);
  ck_assert_uint_eq(gmb__locktab_slots(lt), 16);
  ck_assert_uint_eq(gmb__locktab_used(lt), 0);
  ck_assert_uint_eq(gmb__locktab_bytes(lt), gmb__lt_bytes(16));
  int fd = gmb__locktab_fd(lt);
  ck_assert_int_ge(fd, 0);
  ck_assert_int_eq(check_count_fds(), fds_before + 1);
  /* A memfd (its name is a label for /proc, not a path anyone opens),
   * closed on exec, of the table's size. */
  char label[64];
  snprintf(label, sizeof label, "gmb-lt-%llu",
           (unsigned long long)next_session);
  ck_assert_int_eq(fd_is_memfd(fd, label), 1);
  ck_assert_int_eq(fcntl(fd, F_GETFD) & FD_CLOEXEC, FD_CLOEXEC);
  struct stat st;
  ck_assert_int_eq(fstat(fd, &st), 0);
  ck_assert(S_ISREG(st.st_mode));
  ck_assert_uint_eq((uint64_t)st.st_size, gmb__lt_bytes(16));
  struct gmb__lt_header *h = lt_map(lt);
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
  ck_assert_ptr_null(gmb__locktab_new(++next_session, 0, err, sizeof err));
  ck_assert_ptr_nonnull(strstr(err, "slots"));
  err[0] = '\0';
  ck_assert_ptr_null(gmb__locktab_new(++next_session, UINT32_MAX, err,
                                      sizeof err));
  ck_assert_ptr_nonnull(strstr(err, "slots"));
  /* Nothing was opened for a refused table (the teardown counts). */
}
END_TEST

/* Nothing is named, so nothing collides: two tables for one session id
 * (two brokers of the same pid in PID namespaces, say) are two tables. */
START_TEST(new_same_session_twice_independent) {
  lt = lt_new(4);
  char err[256] = "";
  struct gmb_locktab *t2 = gmb__locktab_new(next_session, 4, err, sizeof err);
  ck_assert_msg(t2 != NULL, "%s", err);
  ck_assert_int_ne(gmb__locktab_fd(t2), gmb__locktab_fd(lt));
  uint32_t s1, s2;
  ck_assert_int_eq(gmb__locktab_slot_new(lt, 11, 1, 0, &s1), 0);
  ck_assert_int_eq(gmb__locktab_slot_new(t2, 22, 1, 0, &s2), 0);
  struct gmb__lt_header *h1 = lt_map(lt), *h2 = lt_map(t2);
  ck_assert_ptr_nonnull(h1);
  ck_assert_ptr_nonnull(h2);
  ck_assert_uint_eq(gmb__lt_slots(h1)[s1].id, 11);
  ck_assert_uint_eq(gmb__lt_slots(h2)[s2].id, 22);
  munmap(h1, gmb__lt_bytes(4));
  munmap(h2, gmb__lt_bytes(4));
  gmb__locktab_destroy(t2);
}
END_TEST

/* A client holds a descriptor of the table: if it could truncate it, the
 * broker's next write to a slot past the new end would fault (SIGBUS).
 * Seals forbid shrinking and growing, on every descriptor of the file
 * (a copy passed with SCM_RIGHTS, or a new open of /proc/self/fd/N), and
 * forbid removing or adding seals. */
START_TEST(sealed_against_resize) {
  lt = lt_new(64);
  uint64_t bytes = gmb__locktab_bytes(lt);
  int fds[3];
  fds[0] = gmb__locktab_fd(lt);
  fds[1] = lt_fd_passed(lt);
  char path[64];
  snprintf(path, sizeof path, "/proc/self/fd/%d", fds[0]);
  fds[2] = open(path, O_RDWR | O_CLOEXEC);
  ck_assert_int_ge(fds[2], 0);
  for (int i = 0; i < 3; i++) {
    int fd = fds[i];
    ck_assert_int_eq(fcntl(fd, F_GET_SEALS),
                     F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
    errno = 0;
    ck_assert_int_eq(ftruncate(fd, 0), -1);
    ck_assert_int_eq(errno, EPERM);
    errno = 0;
    ck_assert_int_eq(ftruncate(fd, (off_t)bytes - 1), -1);
    ck_assert_int_eq(errno, EPERM);
    errno = 0;
    ck_assert_int_eq(ftruncate(fd, (off_t)bytes + 4096), -1);
    ck_assert_int_eq(errno, EPERM);
    errno = 0;
    ck_assert_int_eq(ftruncate(fd, (off_t)bytes * 2), -1);
    ck_assert_int_eq(errno, EPERM);
    /* Growing by writing past the end, or by fallocate, is refused too. */
    errno = 0;
    ck_assert_int_eq(pwrite(fd, "x", 1, (off_t)bytes), -1);
    ck_assert_int_eq(errno, EPERM);
    errno = 0;
    ck_assert_int_eq(fallocate(fd, 0, (off_t)bytes, 4096), -1);
    ck_assert_int_eq(errno, EPERM);
    /* No more seals (F_SEAL_WRITE would stop the broker's own writes). */
    errno = 0;
    ck_assert_int_eq(fcntl(fd, F_ADD_SEALS, F_SEAL_WRITE), -1);
    ck_assert_int_eq(errno, EPERM);
    /* Resizing to the same size is no change, and allowed. */
    ck_assert_int_eq(ftruncate(fd, (off_t)bytes), 0);
    struct stat st;
    ck_assert_int_eq(fstat(fd, &st), 0);
    ck_assert_uint_eq((uint64_t)st.st_size, bytes);
  }
  /* The broker's table is whole and still works. */
  uint32_t slot;
  ck_assert_int_eq(gmb__locktab_slot_new(lt, 9, 1, 0, &slot), 0);
  close(fds[1]);
  close(fds[2]);
}
END_TEST

/* The descriptor a client receives maps the broker's pages: what one side
 * writes the other reads, both ways. */
START_TEST(passed_fd_maps_same_pages) {
  lt = lt_new(8);
  int fd = lt_fd_passed(lt);
  struct gmb__lt_header *h = lt_map_fd(fd, 8);
  ck_assert_ptr_nonnull(h);
  close(fd); /* the mapping stays */
  ck_assert_uint_eq(h->magic, GMB_LT_MAGIC);
  ck_assert_uint_eq(h->session, next_session);
  uint32_t slot;
  ck_assert_int_eq(gmb__locktab_slot_new(lt, 31, 4, 1024, &slot), 0);
  struct gmb__lt_slot *s = &gmb__lt_slots(h)[slot];
  ck_assert_uint_eq(s->id, 31);
  ck_assert_uint_eq(s->segment, 4);
  ck_assert_uint_eq(s->offset, 1024);
  cli_lock(s);
  ck_assert_uint_eq(gmb__locktab_holders(lt, slot), 1);
  ck_assert_int_eq(gmb__locktab_claim(lt, slot), 0);
  cli_unlock(s);
  ck_assert_int_eq(gmb__locktab_claim(lt, slot), 1);
  ck_assert_uint_eq(atomic_load(&s->state), GMB_LT_MOVING);
  gmb__locktab_publish(lt, slot, 5, 2048);
  ck_assert_uint_eq(s->segment, 5);
  ck_assert_uint_eq(s->offset, 2048);
  ck_assert_uint_eq(atomic_load(&s->state), 0);
  munmap(h, gmb__lt_bytes(8));
}
END_TEST

START_TEST(slot_new_writes_position) {
  lt = lt_new(8);
  struct gmb__lt_header *h = lt_map(lt);
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
  struct gmb__lt_header *h = lt_map(lt);
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
  struct gmb__lt_header *h = lt_map(lt);
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
  struct gmb__lt_header *h = lt_map(lt);
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

/* A gmb_lock asleep on a slot's word (as client.c sleeps mid-move: it sets
 * WAITERS, then FUTEX_WAIT) is woken by whatever opens the slot: publish,
 * release, and free.  The sleeper's wait would last 60 s: it must end
 * woken (0), never timed out. */
struct sleeper {
  struct gmb__lt_slot *s;
  _Atomic pid_t tid;
  int rc, err;
};

static void *sleeper_main(void *arg) {
  struct sleeper *z = arg;
  uint32_t st = GMB_LT_MOVING;
  ck_assert(atomic_compare_exchange_strong(&z->s->state, &st,
                                           GMB_LT_MOVING | GMB_LT_WAITERS));
  atomic_store(&z->tid, (pid_t)syscall(SYS_gettid));
  errno = 0;
  z->rc = gmb__lt_futex_wait(&z->s->state, GMB_LT_MOVING | GMB_LT_WAITERS,
                             UINT64_C(60) * 1000000000u);
  z->err = errno;
  return NULL;
}

/* Claims `slot`, parks a sleeper on it, runs `how` (0 publish, 1 release,
 * 2 free) and checks the sleeper woke. */
static void wake_by(struct gmb__lt_header *h, uint32_t slot, int how) {
  struct gmb__lt_slot *s = &gmb__lt_slots(h)[slot];
  ck_assert_int_eq(gmb__locktab_claim(lt, slot), 1);
  struct sleeper z = {.s = s};
  pthread_t t;
  ck_assert_int_eq(pthread_create(&t, NULL, sleeper_main, &z), 0);
  while (atomic_load(&z.tid) == 0) sched_yield();
  ck_assert_msg(check_thread_in_futex(atomic_load(&z.tid)),
                "the sleeper never slept on the word");
  /* The broker sees no holder in a MOVING|WAITERS slot. */
  ck_assert_uint_eq(gmb__locktab_holders(lt, slot), 0);
  if (how == 0) gmb__locktab_publish(lt, slot, 9, 4096);
  if (how == 1) gmb__locktab_release(lt, slot);
  if (how == 2) gmb__locktab_slot_free(lt, slot);
  pthread_join(t, NULL);
  ck_assert_msg(z.rc == 0, "how %d: the sleeper was not woken (%s)", how,
                strerror(z.err));
  ck_assert_uint_eq(atomic_load(&s->state), 0);
}

START_TEST(open_slot_wakes_futex_sleepers) {
  lt = lt_new(4);
  struct gmb__lt_header *h = lt_map(lt);
  ck_assert_ptr_nonnull(h);
  uint32_t slot;
  ck_assert_int_eq(gmb__locktab_slot_new(lt, 7, 1, 512, &slot), 0);
  wake_by(h, slot, 0);
  ck_assert_uint_eq(gmb__lt_slots(h)[slot].segment, 9);
  ck_assert_uint_eq(gmb__lt_slots(h)[slot].offset, 4096);
  wake_by(h, slot, 1);
  wake_by(h, slot, 2);
  ck_assert_uint_eq(gmb__lt_slots(h)[slot].id, 0);
  munmap(h, gmb__lt_bytes(4));
}
END_TEST

/* A client that writes WAITERS into a slot that is not moving makes its
 * own allocation look locked (no move starts), and nothing the broker
 * does on the slot waits on it. */
START_TEST(waiters_on_idle_slot_only_locks_it) {
  lt = lt_new(4);
  struct gmb__lt_header *h = lt_map(lt);
  ck_assert_ptr_nonnull(h);
  uint32_t slot;
  ck_assert_int_eq(gmb__locktab_slot_new(lt, 7, 1, 512, &slot), 0);
  struct gmb__lt_slot *s = &gmb__lt_slots(h)[slot];
  atomic_store(&s->state, GMB_LT_WAITERS | 3u);
  ck_assert_uint_ne(gmb__locktab_holders(lt, slot), 0);
  ck_assert_int_eq(gmb__locktab_claim(lt, slot), 0);
  atomic_store(&s->state, GMB_LT_WAITERS);
  ck_assert_int_eq(gmb__locktab_claim(lt, slot), 0);
  gmb__locktab_slot_free(lt, slot); /* wakes nobody, returns */
  ck_assert_uint_eq(atomic_load(&s->state), 0);
  munmap(h, gmb__lt_bytes(4));
}
END_TEST

/* Many tables, and not one name in /dev/shm (the teardown checks again
 * after they are gone). */
START_TEST(nothing_in_dev_shm) {
  enum { N = 16 };
  struct gmb_locktab *t[N];
  for (int i = 0; i < N; i++) t[i] = lt_new(64);
  ck_assert_int_eq(check_shm_names(), shm_before);
  ck_assert_int_eq(check_count_fds(), fds_before + N);
  for (int i = 0; i < N; i++) gmb__locktab_destroy(t[i]);
  ck_assert_int_eq(check_count_fds(), fds_before);
}
END_TEST

/* destroy closes the broker's descriptor; a client's mapping (and a
 * client's copy of the descriptor) stays its own. */
START_TEST(destroy_closes_fd_mappings_stay) {
  gmb__locktab_destroy(NULL);
  struct gmb_locktab *t = lt_new(4);
  uint64_t session = next_session;
  uint32_t slot;
  ck_assert_int_eq(gmb__locktab_slot_new(t, 5, 2, 1024, &slot), 0);
  int copy = lt_fd_passed(t);
  struct gmb__lt_header *h = lt_map(t);
  ck_assert_ptr_nonnull(h);
  int fd = gmb__locktab_fd(t);
  char label[64];
  snprintf(label, sizeof label, "gmb-lt-%llu", (unsigned long long)session);
  ck_assert_int_eq(check_count_fds(), fds_before + 2);
  gmb__locktab_destroy(t);
  ck_assert_int_eq(check_count_fds(), fds_before + 1);
  ck_assert_int_eq(fd_is_memfd(fd, label), 0);
  ck_assert_int_eq(fd_is_memfd(copy, label), 1);
  /* Both the old mapping and a new one from the copy read the table. */
  ck_assert_uint_eq(h->session, session);
  ck_assert_uint_eq(gmb__lt_slots(h)[slot].id, 5);
  struct gmb__lt_header *h2 = lt_map_fd(copy, 4);
  ck_assert_ptr_nonnull(h2);
  ck_assert_uint_eq(gmb__lt_slots(h2)[slot].offset, 1024);
  atomic_fetch_add(&gmb__lt_slots(h2)[slot].state, 1);
  ck_assert_uint_eq(atomic_load(&gmb__lt_slots(h)[slot].state), 1);
  munmap(h, gmb__lt_bytes(4));
  munmap(h2, gmb__lt_bytes(4));
  close(copy);
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
  int sock; /* the table's descriptor comes on it, as from the channel */
  uint32_t slots, slot;
  long iter;
  struct hammer *hm;
};

static int hammer_child_main(struct hammer_child *a) {
  char msg;
  int fd = -1;
  if (gmb__fd_recv(a->sock, &msg, 1, &fd, 0) != 1 || fd < 0) return 5;
  struct gmb__lt_header *h = lt_map_fd(fd, a->slots);
  close(fd);
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

  int sv[2];
  ck_assert_int_eq(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv),
                   0);
  struct hammer_child arg = {sv[1], 8, slot, iter, hm};
  fflush(stderr);
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0) {
    close(sv[0]);
    _exit(hammer_child_main(&arg));
  }
  close(sv[1]);
  /* The child gets the table as a client does: a copy of the descriptor
   * over a socket, after the fork. */
  char msg = 'T';
  ck_assert_int_eq(gmb__fd_send(sv[0], &msg, 1, gmb__locktab_fd(lt), 0), 0);
  close(sv[0]);
  while (!atomic_load(&hm->child_ready)) {
    int status;
    if (waitpid(pid, &status, WNOHANG) == pid)
      ck_abort_msg("child exited early with %d", WEXITSTATUS(status));
    sched_yield();
  }

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

/* --- other users (root only) ---------------------------------------------- */

/* In a child: become uid:gid and try to open the broker's (this process's)
 * descriptor `fd` through /proc, the only path to a memfd.  Exits 0 when
 * it opened and mapped the table, else with the errno. */
static int open_as(pid_t broker, int fd, uid_t uid, gid_t gid) {
  fflush(stderr);
  pid_t pid = fork();
  if (pid == 0) {
    if (setgroups(0, NULL) != 0 || setgid(gid) != 0 || setuid(uid) != 0)
      _exit(200);
    char path[64];
    snprintf(path, sizeof path, "/proc/%ld/fd/%d", (long)broker, fd);
    int f = open(path, O_RDWR);
    if (f < 0) _exit(errno ? errno : 201);
    struct gmb__lt_header *h = mmap(NULL, sizeof *h, PROT_READ | PROT_WRITE,
                                   MAP_SHARED, f, 0);
    _exit(h == MAP_FAILED ? 202 : h->magic == GMB_LT_MAGIC ? 0 : 203);
  }
  int status;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 255;
}

/* A table has no name: a process of another uid has no path to it but the
 * broker's /proc/PID/fd, which the kernel closes to other uids. */
START_TEST(other_uid_cannot_open_table) {
  if (geteuid() != 0) {
    fprintf(stderr, "other_uid_cannot_open_table: skipped: needs root to "
            "run a process of another uid\n");
    return;
  }
  lt = lt_new(16);
  int fd = gmb__locktab_fd(lt);
  /* The broker's own uid can, which proves the path is right... */
  ck_assert_int_eq(open_as(getpid(), fd, 0, 0), 0);
  /* ...and no other uid can, whatever its group. */
  ck_assert_int_eq(open_as(getpid(), fd, 65534, 65534), EACCES);
  ck_assert_int_eq(open_as(getpid(), fd, 65534, 0), EACCES);
}
END_TEST

static Suite *locktab_suite(void) {
  Suite *s = suite_create("locktab");
  TCase *tc = tcase_create("table");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_add_test(tc, new_fills_header_and_fd);
  tcase_add_test(tc, new_zero_slots_refused);
  tcase_add_test(tc, new_same_session_twice_independent);
  tcase_add_test(tc, sealed_against_resize);
  tcase_add_test(tc, passed_fd_maps_same_pages);
  tcase_add_test(tc, nothing_in_dev_shm);
  tcase_add_test(tc, destroy_closes_fd_mappings_stay);
  tcase_add_test(tc, other_uid_cannot_open_table);
  suite_add_tcase(s, tc);

  tc = tcase_create("slots");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_add_test(tc, slot_new_writes_position);
  tcase_add_test(tc, slots_exhausted_limit);
  tcase_add_test(tc, free_list_reuse_resets_slot);
  tcase_add_test(tc, claim_refused_while_locked);
  tcase_add_test(tc, publish_moves_release_keeps);
  tcase_add_test(tc, open_slot_wakes_futex_sleepers);
  tcase_add_test(tc, waiters_on_idle_slot_only_locks_it);
  tcase_add_test(tc, slot_out_of_range_is_a_bug);
  suite_add_tcase(s, tc);

  tc = tcase_create("processes");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_add_test(tc, two_processes_claim_never_overlaps_a_hold);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) { return check_run(locktab_suite()); }
