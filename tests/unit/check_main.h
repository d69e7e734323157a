/*
 * check_main.h - what every unit suite shares: check_run() runs the one
 * suite of a check_* binary and gives main its exit status, and two probes
 * of the process (its open descriptors, and gmb's names in /dev/shm) for
 * the suites that prove nothing leaks and nothing is named.
 *
 * Under AddressSanitizer the tests run in this process (CK_NOFORK) unless
 * CK_FORK says otherwise: LeakSanitizer reports when a process exits, and
 * Check does not look at how a forked test's process exits, so in fork
 * mode a leak would not fail the run.  tests/run.sh sets CK_FORK=no for
 * the sanitizer build anyway; this keeps a suite run by hand honest too.
 */
#ifndef GMB_CHECK_MAIN_H
#define GMB_CHECK_MAIN_H

#include <check.h>
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <unistd.h>

/* Runs s (the runner frees it); EXIT_SUCCESS when every test passed. */
static inline int check_run(Suite *s) {
  SRunner *sr = srunner_create(s);
#if defined(__SANITIZE_ADDRESS__)
  if (getenv("CK_FORK") == NULL) srunner_set_fork_status(sr, CK_NOFORK);
#endif
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}

/* The number of descriptors this process has open. */
static inline int check_count_fds(void) {
  DIR *d = opendir("/proc/self/fd");
  ck_assert_ptr_nonnull(d);
  int n = 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL)
    if (e->d_name[0] != '.') n++;
  closedir(d);
  return n - 1; /* the directory's own */
}

/* The number of names in /dev/shm that start with "gmb" (protocol version
 * 1 named segments and lock tables there; nothing is named now). */
static inline int check_shm_names(void) {
  DIR *d = opendir("/dev/shm");
  if (d == NULL) return 0;
  int n = 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL)
    if (strncmp(e->d_name, "gmb", 3) == 0) n++;
  closedir(d);
  return n;
}

/* Waits (polling, at most 60 s) until thread `tid` of this process sleeps
 * in the futex system call; 1 when it does, 0 when it never did.  A test
 * sees so that a waiter is parked on the word, with no timing. */
static inline int check_thread_in_futex(pid_t tid) {
  char path[64];
  snprintf(path, sizeof path, "/proc/self/task/%d/syscall", (int)tid);
  for (int i = 0; i < 60000; i++) {
    FILE *f = fopen(path, "r");
    long nr = -1;
    if (f) {
      if (fscanf(f, "%ld", &nr) != 1) nr = -1;
      fclose(f);
    }
    if (nr == SYS_futex) return 1;
    usleep(1000);
  }
  return 0;
}

#endif /* GMB_CHECK_MAIN_H */
