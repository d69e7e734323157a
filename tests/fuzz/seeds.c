/*
 * seeds.c - writes the dispatch target's seed corpus
 * (tests/fuzz/corpus/dispatch/), in the record format fuzz_dispatch.c
 * reads: valid requests, encoded by the wire codec, from the clients and
 * the operator that target knows.  Not built by make: the seeds are
 * committed; after a change of the protocol, rebuild and run it by hand:
 *
 *   cc -std=c11 -D_GNU_SOURCE -Iinclude -Iproto tests/fuzz/seeds.c \
 *     build/libgmb-common.a $(pkg-config --libs libprotobuf-c) \
 *     -o build/fuzz-seeds && build/fuzz-seeds tests/fuzz/corpus/dispatch
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gmb.h"
#include "wire.h"

enum { A = 0, B = 1, C = 2, D = 3, ADMIN = 4, TICK = 0xff };

static FILE *out;

static void rec(int who, struct wire_request *req) {
  static uint64_t id = 1;
  req->id = id++;
  uint8_t *buf;
  size_t len;
  if (gmb__wire_request_encode(req, &buf, &len) != 0) {
    fprintf(stderr, "seeds: cannot encode\n");
    exit(1);
  }
  fputc(who, out);
  fputc((int)(len & 0xff), out);
  fputc((int)(len >> 8), out);
  fwrite(buf, 1, len, out);
  free(buf);
}

static void tick(void) { fputc(TICK, out); }

static void hello(int who, const char *tenant, const char *token) {
  struct wire_request r;
  memset(&r, 0, sizeof r);
  r.kind = WIRE_HELLO;
  r.u.hello.version = WIRE_PROTOCOL_VERSION;
  snprintf(r.u.hello.tenant, sizeof r.u.hello.tenant, "%s", tenant);
  snprintf(r.u.hello.client, sizeof r.u.hello.client, "seed");
  if (token) {
    r.u.hello.token_len = (uint32_t)strlen(token);
    memcpy(r.u.hello.token, token, strlen(token));
  }
  rec(who, &r);
}

static void alloc(int who, uint64_t size, uint32_t flags, int timeout) {
  struct wire_request r;
  memset(&r, 0, sizeof r);
  r.kind = WIRE_ALLOC;
  r.u.alloc.size = size;
  r.u.alloc.flags = flags;
  r.u.alloc.timeout_ms = timeout;
  rec(who, &r);
}

static void freeid(int who, uint64_t id) {
  struct wire_request r;
  memset(&r, 0, sizeof r);
  r.kind = WIRE_FREE;
  r.u.free.id = id;
  rec(who, &r);
}

static void plain(int who, enum wire_kind kind) {
  struct wire_request r;
  memset(&r, 0, sizeof r);
  r.kind = kind;
  rec(who, &r);
}

/* A Heartbeat carrying the cache's free bytes and, when `answered`, the
 * answer to the last EVENT_TRIM. */
static void cached(int who, uint64_t bytes, int answered) {
  struct wire_request r;
  memset(&r, 0, sizeof r);
  r.kind = WIRE_HEARTBEAT;
  r.cached_free = bytes;
  r.trim_answered = answered;
  rec(who, &r);
}

static void admin_limit(enum wire_kind kind, const char *tenant, int set,
                        uint64_t value) {
  struct wire_request r;
  memset(&r, 0, sizeof r);
  r.kind = kind;
  snprintf(r.u.admin_limit.tenant, sizeof r.u.admin_limit.tenant, "%s",
           tenant);
  r.u.admin_limit.set = set;
  r.u.admin_limit.value = value;
  rec(D | ADMIN, &r);
}

static void admin_named(enum wire_kind kind, const char *tenant) {
  struct wire_request r;
  memset(&r, 0, sizeof r);
  r.kind = kind;
  /* admin_compact and admin_evict both start with the tenant's name */
  snprintf(r.u.admin_evict.tenant, sizeof r.u.admin_evict.tenant, "%s",
           tenant);
  rec(D | ADMIN, &r);
}

static void open_seed(const char *dir, const char *name) {
  char path[512];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  out = fopen(path, "wb");
  if (out == NULL) {
    perror(path);
    exit(1);
  }
}

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: fuzz-seeds DIR\n");
    return 2;
  }
  const char *dir = argv[1];

  open_seed(dir, "alloc_free");
  hello(A, "llm-a", NULL);
  alloc(A, 1 << 20, GMB_MOVABLE, 0);
  alloc(A, 65536, 0, 0);
  alloc(A, 3000, GMB_MOVABLE, 0);
  plain(A, WIRE_STATS);
  freeid(A, 1);
  freeid(A, 2);
  plain(A, WIRE_HEARTBEAT);
  plain(A, WIRE_BYE);
  fclose(out);

  open_seed(dir, "wait_and_admin");
  hello(B, "batch", NULL);
  alloc(B, 4 << 20, 0, 0);
  alloc(B, 4 << 20, 0, 500);
  hello(C, "", NULL);
  alloc(C, 8 << 20, GMB_MOVABLE, 0);
  alloc(C, 12 << 20, 0, 1000);
  plain(D | ADMIN, WIRE_ADMIN_STATUS);
  admin_limit(WIRE_ADMIN_QUOTA, "batch", 1, 2 << 20);
  admin_limit(WIRE_ADMIN_RESERVE, "batch", 1, 1 << 20);
  admin_limit(WIRE_ADMIN_QUOTA, "uid-1001", 0, 0);
  tick();
  admin_named(WIRE_ADMIN_COMPACT, "");
  plain(D | ADMIN, WIRE_ADMIN_SNAPSHOT);
  plain(D | ADMIN, WIRE_ADMIN_METRICS);
  admin_named(WIRE_ADMIN_EVICT, "batch");
  plain(D | ADMIN, WIRE_ADMIN_RELOAD);
  tick();
  fclose(out);

  open_seed(dir, "fragment_compact");
  hello(C, "tok", "test");
  for (int i = 0; i < 8; i++) alloc(C, 700 << 10, GMB_MOVABLE, 0);
  for (uint64_t id = 1; id <= 8; id += 2) freeid(C, id);
  alloc(C, 3 << 20, GMB_MOVABLE, 0);
  struct wire_request r;
  memset(&r, 0, sizeof r);
  r.kind = WIRE_SEGMENT_CLOSED;
  r.u.segment.segment = 1;
  rec(C, &r);
  admin_named(WIRE_ADMIN_COMPACT, "tok");
  plain(C, WIRE_STATS);
  tick();
  fclose(out);

  open_seed(dir, "admin_only");
  hello(D, "", NULL);
  plain(D | ADMIN, WIRE_ADMIN_STATUS);
  plain(A | ADMIN, WIRE_ADMIN_STATUS); /* not an admin uid */
  admin_limit(WIRE_ADMIN_QUOTA, "llm-a", 1, 1 << 20);
  admin_named(WIRE_ADMIN_EVICT, "uid-4242");
  fclose(out);

  /* A scheduler's run-time tenant: made with a token hash, used, removed
   * while its session lives (deferred), then made again. */
  open_seed(dir, "tenant_add_remove");
  memset(&r, 0, sizeof r);
  r.kind = WIRE_ADMIN_TENANT_ADD;
  snprintf(r.u.admin_tenant_add.tenant, sizeof r.u.admin_tenant_add.tenant,
           "slurm-7.0");
  r.u.admin_tenant_add.quota = 4 << 20;
  r.u.admin_tenant_add.has_token = 1;
  memset(r.u.admin_tenant_add.token_sha256, 0x5a, 32);
  r.u.admin_tenant_add.n_uids = 1;
  r.u.admin_tenant_add.uids[0] = 1000;
  rec(D | ADMIN, &r);
  hello(A, "slurm-7.0", NULL);
  alloc(A, 1 << 20, 0, 0);
  memset(&r, 0, sizeof r);
  r.kind = WIRE_ADMIN_TENANT_REMOVE;
  snprintf(r.u.admin_tenant_remove.tenant,
           sizeof r.u.admin_tenant_remove.tenant, "slurm-7.0");
  rec(D | ADMIN, &r);
  plain(A, WIRE_BYE);
  tick();
  r.u.admin_tenant_remove.evict = 1;
  rec(D | ADMIN, &r);
  fclose(out);

  /* Caches asked back: a full device (c's requests held while a is
   * asked), a quota (b refused, a's ask on its way), a's free and answer,
   * then an ask left unanswered (b) as time passes. */
  open_seed(dir, "cache_asked");
  hello(A, "llm-a", NULL);
  hello(B, "llm-a", NULL);
  hello(C, "", NULL);
  alloc(A, 6 << 20, 0, 0);
  cached(A, 6 << 20, 0);
  alloc(C, 8 << 20, 0, 0);
  alloc(C, 4 << 20, 0, 0);
  alloc(C, 4 << 20, 0, 2000);
  alloc(B, 4 << 20, 0, 0);
  freeid(A, 1);
  cached(A, 0, 1);
  tick();
  alloc(B, 2 << 20, 0, 0);
  cached(B, 2 << 20, 0);
  alloc(C, 4 << 20, 0, 0);
  tick();
  fclose(out);

  /* Sleep and wake: a offers its tag (idle), c's request finds the device
   * full and a is asked to sleep; a notes its pause (past its tenant's
   * host_quota once, then within), frees, answers; an operator pauses and
   * resumes b's tenant; a resumes and notes it. */
  open_seed(dir, "sleep_asked");
  hello(A, "llm-b", NULL);
  hello(B, "llm-a", NULL);
  hello(C, "", NULL);
  alloc(A, 8 << 20, 0, 0);
  memset(&r, 0, sizeof r);
  r.kind = WIRE_HEARTBEAT;
  r.sleep_pausable = 8 << 20;
  r.sleep_idle_ms = 60000;
  rec(A, &r);
  alloc(C, 12 << 20, 0, 0);
  memset(&r, 0, sizeof r);
  r.kind = WIRE_SLEEP_NOTE;
  snprintf(r.u.sleep_note.tag, sizeof r.u.sleep_note.tag, "weights");
  r.u.sleep_note.paused = 1;
  r.u.sleep_note.host_bytes = UINT64_C(1) << 40;
  r.u.sleep_note.device_bytes = 8 << 20;
  r.u.sleep_note.by = 1;
  rec(A, &r);
  r.u.sleep_note.host_bytes = 8 << 20;
  rec(A, &r);
  freeid(A, 1);
  cached(A, 0, 1);
  memset(&r, 0, sizeof r);
  r.kind = WIRE_ADMIN_PAUSE;
  snprintf(r.u.admin_pause.tenant, sizeof r.u.admin_pause.tenant, "llm-a");
  snprintf(r.u.admin_pause.tag, sizeof r.u.admin_pause.tag, "kv");
  r.u.admin_pause.discard = 1;
  rec(D | ADMIN, &r);
  r.kind = WIRE_ADMIN_RESUME;
  r.u.admin_pause.tag[0] = '\0';
  rec(D | ADMIN, &r);
  tick();
  memset(&r, 0, sizeof r);
  r.kind = WIRE_SLEEP_NOTE;
  snprintf(r.u.sleep_note.tag, sizeof r.u.sleep_note.tag, "weights");
  rec(A, &r);
  fclose(out);

  /* The broker's own offload: A's movable allocations, A idle by its
   * policy, C asks for more than the free room and one slice (a fuzz
   * build's slice is 2 MiB), B joins the job, the operator pauses and
   * resumes A in slices, A locks an offloaded allocation (brought back),
   * then says Bye with allocations left (freed in slices). */
  open_seed(dir, "offload_job");
  hello(A, "llm-b", NULL);
  hello(B, "llm-a", NULL);
  hello(C, "", NULL);
  for (int i = 0; i < 24; i++) alloc(A, 512 << 10, GMB_MOVABLE, 0);
  memset(&r, 0, sizeof r);
  r.kind = WIRE_HEARTBEAT;
  r.sleep_pausable = 12 << 20;
  r.sleep_idle_ms = 60000;
  r.sleep_idle = 1;
  rec(A, &r);
  alloc(C, 10 << 20, 0, 2000);
  alloc(B, 2 << 20, 0, 2000);
  plain(C, WIRE_HEARTBEAT);
  plain(B, WIRE_STATS);
  memset(&r, 0, sizeof r);
  r.kind = WIRE_ADMIN_PAUSE;
  snprintf(r.u.admin_pause.tenant, sizeof r.u.admin_pause.tenant, "llm-b");
  rec(D | ADMIN, &r);
  plain(A, WIRE_STATS);
  memset(&r, 0, sizeof r);
  r.kind = WIRE_LOCK;
  r.u.lock.id = 2;
  r.u.lock.timeout_ms = 1000;
  rec(A, &r);
  memset(&r, 0, sizeof r);
  r.kind = WIRE_ADMIN_RESUME;
  snprintf(r.u.admin_pause.tenant, sizeof r.u.admin_pause.tenant, "llm-b");
  rec(D | ADMIN, &r);
  tick();
  plain(A, WIRE_BYE);
  plain(C, WIRE_STATS);
  fclose(out);
  return 0;
}
