/*
 * broker_fixture.h - a whole broker in the test's process, without sockets,
 * for the suites of the modules above the pool (dispatch, waitq, session,
 * statefile, core).
 *
 * fx_open() builds the broker the way main.c does (core.c on a host
 * device, then the state file), with the consistency checks on, and points
 * the sender at a tap that records every reply and event instead of
 * sending it.  Clients are plain routing ids: fx_hello() opens a session
 * for one through the real Hello handler.  Peers have pid 0 (not visible),
 * so sessions heartbeat rather than hold a pidfd.  fx_close() requires
 * gmb__core_check() == 0 before it tears everything down through
 * gmb__core_close(), so every test ends with a consistency check.
 *
 * Replies the tap records are shallow copies: scalar fields and messages
 * are valid, pointers inside (admin tables) are not.
 *
 * Below fx_last_to are the helpers the suites share: a small device with
 * compaction off, plain requests, Hello with any version, an allocation
 * that must succeed, a SleepNote, a tenant by name, ending a session,
 * mapping a session's lock table from its descriptor as its client does,
 * and the process's open descriptors and gmb names in /dev/shm, to prove
 * that nothing leaks and nothing is named.
 */
#ifndef GMB_BROKER_FIXTURE_H
#define GMB_BROKER_FIXTURE_H

#include <check.h>
#include <dirent.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "broker.h"
#include "check_main.h"
#include "core.h"
#include "dispatch.h"
#include "gmb.h"
#include "locktab.h"
#include "session.h"
#include "statefile.h"
#include "tenant.h"
#include "util.h"

#define FX_MAX_SENT 256

struct fx_sent {
  enum gmb_socket sock;
  char rid[32];
  struct wire_reply rep;
};

struct fx {
  struct gmb_broker b;
  struct fx_sent sent[FX_MAX_SENT];
  size_t n_sent;
  uint64_t next_req;
  char dir[64]; /* scratch dir for config and state files */
};

static void fx_tap(void *ctx, enum gmb_socket sock, const uint8_t *rid,
                   size_t rid_len, const struct wire_reply *rep) {
  struct fx *f = ctx;
  ck_assert_msg(f->n_sent < FX_MAX_SENT, "the tap is full");
  struct fx_sent *s = &f->sent[f->n_sent++];
  s->sock = sock;
  snprintf(s->rid, sizeof s->rid, "%.*s", (int)rid_len, (const char *)rid);
  s->rep = *rep;
}

/* Writes `text` to the scratch dir's file `name`; its path in path. */
static inline void fx_write(struct fx *f, const char *name, const char *text,
                            char *path, size_t cap) {
  snprintf(path, cap, "%s/%s", f->dir, name);
  FILE *fp = fopen(path, "w");
  ck_assert_ptr_nonnull(fp);
  fputs(text, fp);
  ck_assert_int_eq(fclose(fp), 0);
}

/*
 * A broker on `device` ("host:64MiB") with the config text `ini` (NULL:
 * defaults only; "[broker]\ncompaction = off\n" and tenant sections are
 * typical).  A `state` line in the text may name "@STATE@", which becomes
 * a file in the fixture's scratch dir.
 */
static inline void fx_open_ini(struct fx *f, const char *device,
                               const char *ini) {
  memset(f, 0, sizeof *f);
  snprintf(f->dir, sizeof f->dir, "/tmp/gmb-fx-XXXXXX");
  ck_assert_ptr_nonnull(mkdtemp(f->dir));
  struct gmb_broker *b = &f->b;
  char err[1024];
  gmb__config_defaults(&b->cfg);
  if (ini) {
    /* "@STATE@" stands for DIR/state. */
    char text[4096], path[256];
    const char *at = strstr(ini, "@STATE@");
    if (at)
      snprintf(text, sizeof text, "%.*s%s/state%s", (int)(at - ini), ini,
               f->dir, at + 7);
    else
      snprintf(text, sizeof text, "%s", ini);
    fx_write(f, "gmb.ini", text, path, sizeof path);
    snprintf(b->config_path, sizeof b->config_path, "%s", path);
    ck_assert_msg(gmb__config_load(path, &b->cfg, err, sizeof err) == 0,
                  "config: %s", err);
  }
  snprintf(b->cfg.device, sizeof b->cfg.device, "%s", device);
  b->flag_log_level = -1;
  b->checks = 1;
  b->reply_tap = fx_tap;
  b->reply_tap_ctx = f;
  ck_assert_msg(gmb__core_open(b, err, sizeof err) == 0, "core: %s", err);
  ck_assert_msg(gmb__statefile_load(b, err, sizeof err) == 0, "state: %s",
                err);
  f->next_req = 1;
}

static inline void fx_open(struct fx *f) { fx_open_ini(f, "host:64MiB", NULL); }

static inline void fx_close(struct fx *f) {
  ck_assert_int_eq(gmb__core_check(&f->b), 0);
  gmb__core_close(&f->b);
  gmb__config_free(&f->b.cfg);
  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf %s", f->dir);
  ck_assert_int_eq(system(cmd), 0);
}

static inline struct gmb_peer fx_peer(const char *rid, uid_t uid) {
  struct gmb_peer p = {.rid = (const uint8_t *)rid, .rid_len = strlen(rid),
                       .uid = uid, .gid = uid, .pid = 0};
  return p;
}

/* Sends request `req` (its id is set here) from client `rid` as `uid`.
 * Returns what gmb__dispatch returned (1: *rep is the answer now). */
static inline int fx_request(struct fx *f, const char *rid, uid_t uid,
                             struct wire_request *req,
                             struct wire_reply *rep) {
  struct gmb_peer p = fx_peer(rid, uid);
  req->id = f->next_req++;
  int now = gmb__dispatch(&f->b, &p, req, rep);
  ck_assert_int_eq(gmb__core_check(&f->b), 0);
  return now;
}

/* Opens a session for client `rid` as `uid` in `tenant` ("" : uid-UID);
 * returns it. */
static inline struct gmb_session *fx_hello(struct fx *f, const char *rid,
                                           uid_t uid, const char *tenant) {
  struct wire_request req;
  memset(&req, 0, sizeof req);
  req.kind = WIRE_HELLO;
  req.u.hello.version = WIRE_PROTOCOL_VERSION;
  snprintf(req.u.hello.tenant, sizeof req.u.hello.tenant, "%s", tenant);
  snprintf(req.u.hello.client, sizeof req.u.hello.client, "fixture");
  struct wire_reply rep;
  ck_assert_int_eq(fx_request(f, rid, uid, &req, &rep), 1);
  ck_assert_msg(rep.status == 0, "hello: %s", rep.message);
  ck_assert_int_eq(rep.kind, WIRE_HELLO);
  struct gmb_session *s =
      gmb__session_find(f->b.sessions, (const uint8_t *)rid, strlen(rid));
  ck_assert_ptr_nonnull(s);
  return s;
}

/* Makes session s at least `ms` milliseconds old (its Hello that long ago,
 * or at the clock's start): the broker believes no idle time past a
 * session's age, and the fixture makes its sessions at once. */
static inline void fx_age(struct gmb_session *s, uint64_t ms) {
  uint64_t now = gmb__now_ns(), ns = ms * GMB_NS_PER_MS;
  uint64_t born = now > ns ? now - ns : 0;
  if (s->born_ns > born) s->born_ns = born;
}

/* An Alloc request; returns gmb__dispatch's answer-now flag. */
static inline int fx_alloc(struct fx *f, const char *rid, uid_t uid,
                           uint64_t size, uint32_t flags, int timeout_ms,
                           struct wire_reply *rep) {
  struct wire_request req;
  memset(&req, 0, sizeof req);
  req.kind = WIRE_ALLOC;
  req.u.alloc.size = size;
  req.u.alloc.flags = flags;
  req.u.alloc.timeout_ms = timeout_ms;
  return fx_request(f, rid, uid, &req, rep);
}

/* Frees allocation `id`; returns the reply's status. */
static inline int fx_free(struct fx *f, const char *rid, uid_t uid,
                          uint64_t id) {
  struct wire_request req;
  memset(&req, 0, sizeof req);
  req.kind = WIRE_FREE;
  req.u.free.id = id;
  struct wire_reply rep;
  ck_assert_int_eq(fx_request(f, rid, uid, &req, &rep), 1);
  return rep.status;
}

/* The last reply or event the tap recorded for client `rid`, or NULL. */
static inline const struct fx_sent *fx_last_to(const struct fx *f,
                                               const char *rid) {
  for (size_t i = f->n_sent; i-- > 0;)
    if (strcmp(f->sent[i].rid, rid) == 0) return &f->sent[i];
  return NULL;
}

/* --- shared helpers ----------------------------------------------------- */

/* Compaction off, so that a request that finds no room is answered (or
 * queued) without a compaction run. */
#define FX_INI_OFF "[broker]\ncompaction = off\n"

/* A broker on an 8 MiB host device with compaction off. */
static inline void fx_open_small(struct fx *f) {
  fx_open_ini(f, "host:8MiB", FX_INI_OFF);
}

/* A request of `kind` with no body; returns gmb__dispatch's answer-now
 * flag. */
static inline int fx_plain(struct fx *f, const char *rid, uid_t uid,
                           enum wire_kind kind, struct wire_reply *rep) {
  struct wire_request req;
  memset(&req, 0, sizeof req);
  req.kind = kind;
  return fx_request(f, rid, uid, &req, rep);
}

/* A Hello of protocol `version` that may be refused (fx_hello requires
 * success); returns gmb__dispatch's answer-now flag. */
static inline int fx_hello_as(struct fx *f, const char *rid, uid_t uid,
                              const char *tenant, uint32_t version,
                              struct wire_reply *rep) {
  struct wire_request req;
  memset(&req, 0, sizeof req);
  req.kind = WIRE_HELLO;
  req.u.hello.version = version;
  snprintf(req.u.hello.tenant, sizeof req.u.hello.tenant, "%s", tenant);
  snprintf(req.u.hello.client, sizeof req.u.hello.client, "check");
  return fx_request(f, rid, uid, &req, rep);
}

/* Allocates without waiting and requires success; returns the reply. */
static inline struct wire_reply fx_must_alloc(struct fx *f, const char *rid,
                                              uid_t uid, uint64_t size,
                                              uint32_t flags) {
  struct wire_reply rep;
  ck_assert_int_eq(fx_alloc(f, rid, uid, size, flags, 0, &rep), 1);
  ck_assert_msg(rep.status == 0, "alloc %" PRIu64 ": %s", size, rep.message);
  ck_assert_int_eq(rep.kind, WIRE_ALLOC);
  return rep;
}

/* A SleepNote from client `rid`: tag `tag` paused (or running again) with
 * `host` and `device` bytes; returns the reply's status. */
static inline int fx_sleep_note(struct fx *f, const char *rid, uid_t uid,
                                const char *tag, int paused, uint64_t host,
                                uint64_t device) {
  struct wire_request req;
  memset(&req, 0, sizeof req);
  req.kind = WIRE_SLEEP_NOTE;
  snprintf(req.u.sleep_note.tag, sizeof req.u.sleep_note.tag, "%s", tag);
  req.u.sleep_note.paused = paused;
  req.u.sleep_note.host_bytes = host;
  req.u.sleep_note.device_bytes = device;
  struct wire_reply rep;
  ck_assert_int_eq(fx_request(f, rid, uid, &req, &rep), 1);
  return rep.status;
}

/* The tenant called `name`, which must exist. */
static inline struct gmb_tenant *fx_tenant(struct fx *f, const char *name) {
  struct gmb_tenant *t = gmb__tenant_find(f->b.tenants, name);
  ck_assert_msg(t != NULL, "no tenant %s", name);
  return t;
}

/* Ends session s as the broker does, then checks the pool and tenants. */
static inline void fx_end(struct fx *f, struct gmb_session *s) {
  gmb__core_session_end(&f->b, s, "test");
  ck_assert_int_eq(gmb__core_check(&f->b), 0);
}

/* Maps `bytes` of descriptor fd read-write and shared, as a client maps
 * what the descriptor channel gave it. */
static inline void *fx_map_fd(int fd, uint64_t bytes) {
  void *p = mmap(NULL, (size_t)bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd,
                 0);
  ck_assert_msg(p != MAP_FAILED, "mmap fd %d (%" PRIu64 " bytes)", fd, bytes);
  return p;
}

/* Maps s's lock table from its descriptor (the one AUTH sends a copy
 * of). */
static inline struct gmb__lt_header *fx_map_locktab(struct gmb_session *s) {
  ck_assert_ptr_nonnull(s->lt);
  return fx_map_fd(gmb__locktab_fd(s->lt), gmb__locktab_bytes(s->lt));
}

static inline void fx_unmap_locktab(struct gmb__lt_header *h) {
  ck_assert_int_eq(munmap(h, gmb__lt_bytes(h->slots)), 0);
}

/* The number of descriptors this process has open (check_main.h). */
static inline int fx_count_fds(void) { return check_count_fds(); }

/* The number of gmb names in /dev/shm (check_main.h). */
static inline int fx_shm_names(void) { return check_shm_names(); }

#endif /* GMB_BROKER_FIXTURE_H */
