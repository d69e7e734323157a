/*
 * observe.c - placeholder while the operator issue builds snapshots and
 * metrics: every entry point answers that it is not there yet.
 */
#include "observe.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gmb.h"

struct gmb_observe {
  int unused;
};

struct gmb_observe *gmb__observe_new(void) {
  return calloc(1, sizeof(struct gmb_observe));
}

void gmb__observe_destroy(struct gmb_observe *o) { free(o); }

void gmb__observe_request(struct gmb_broker *b, enum wire_kind kind,
                          int status, uint64_t ns) {
  (void)b;
  (void)kind;
  (void)status;
  (void)ns;
}

void gmb__observe_snapshot(struct gmb_broker *b, struct wire_reply *rep) {
  (void)b;
  rep->status = GMB_E_PROTO;
  snprintf(rep->message, sizeof rep->message,
           "snapshots are not implemented by this broker yet");
}

char *gmb__observe_metrics(struct gmb_broker *b) {
  (void)b;
  return NULL;
}
