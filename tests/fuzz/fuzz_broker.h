/*
 * fuzz_broker.h - what the targets that run a whole broker in their
 * process share (fuzz_dispatch.c, fuzz_http_admin.c): its config file,
 * written once into a scratch dir so that a reload can read it again,
 * and a fresh broker per input on a 16 MiB host device with its
 * consistency checks on and its replies tapped.
 */
#ifndef GMB_FUZZ_BROKER_H
#define GMB_FUZZ_BROKER_H

#include <stdio.h>
#include <stdlib.h>

#include "broker.h"
#include "config.h"
#include "core.h"
#include "fuzz.h"
#include "log.h"

/* Writes `text` to gmb.ini in a new scratch dir; its path in `path`.
 * The broker logs errors only, or everything with FZLOG set in the
 * environment (to follow one input: FZLOG=1 build/fuzz/fuzz_TARGET FILE). */
static inline void fz_broker_ini(const char *text, char *path, size_t cap) {
  gmb__log_set_level(getenv("FZLOG") ? GMB_LOG_DEBUG : GMB_LOG_ERROR);
  char dir[64] = "/tmp/gmb-fuzz-XXXXXX";
  FZ_ASSERT(mkdtemp(dir) != NULL);
  snprintf(path, cap, "%s/gmb.ini", dir);
  FILE *f = fopen(path, "w");
  FZ_ASSERT(f != NULL);
  fputs(text, f);
  FZ_ASSERT(fclose(f) == 0);
}

/* A broker with the config at `ini`, every reply given to `tap`. */
static inline struct gmb_broker *fz_broker_open(const char *ini,
                                                gmb_reply_tap tap) {
  struct gmb_broker *b = calloc(1, sizeof *b);
  FZ_ASSERT(b != NULL);
  char err[1024];
  gmb__config_defaults(&b->cfg);
  FZ_ASSERT(gmb__config_load(ini, &b->cfg, err, sizeof err) == 0);
  snprintf(b->config_path, sizeof b->config_path, "%s", ini);
  snprintf(b->cfg.device, sizeof b->cfg.device, "host:16MiB");
  b->flag_log_level = -1;
  b->checks = 1;
  b->reply_tap = tap;
  FZ_ASSERT(gmb__core_open(b, err, sizeof err) == 0);
  return b;
}

/* Closes b, which must free everything (ASan's leak check). */
static inline void fz_broker_close(struct gmb_broker *b) {
  gmb__core_close(b);
  gmb__config_free(&b->cfg);
  free(b);
}

#endif /* GMB_FUZZ_BROKER_H */
