/*
 * check_main.h - the main() of every unit suite: check_run() runs the one
 * suite of a check_* binary and gives main its exit status.
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
#include <stdlib.h>

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

#endif /* GMB_CHECK_MAIN_H */
