/*
 * check_admin.c - broker/admin.c's run-time tenants: `tenant add` and
 * `tenant remove`, what the scheduler components (gmb_spank.so, the
 * Kubernetes device plugin) use over the admin socket.
 *
 * Pinned down: a tenant added with a token hash admits that token only and
 * holds its quota; what add refuses (an existing name, one that proves no
 * one, a quota past the device, reservations past it, a non-admin uid,
 * the overflow uid among its uids); the overflow uid is no operator;
 * removal at once when idle, deferred while sessions remain (no new one is
 * admitted meanwhile) and done by the reaper when the last one ends, or
 * forced with evict; a configured tenant is not removed; an added tenant
 * is never reaped as idle.
 */
#include <check.h>
#include <openssl/evp.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "admin.h"
#include "broker_fixture.h"
#include "check_main.h"
#include "core.h"
#include "defrag.h"
#include "session.h"
#include "tenant.h"
#include "util.h"

#define MIB GMB_MIB
#define TOKEN "0123456789abcdef-the-step-token"

static void sha256(const char *s, uint8_t out[32]) {
  unsigned n = 0;
  ck_assert_int_eq(EVP_Digest(s, strlen(s), out, &n, EVP_sha256(), NULL), 1);
  ck_assert_uint_eq(n, 32);
}

/* An admin request from `uid`; returns the reply (status and message). */
static struct wire_reply admin(struct fx *f, uid_t uid,
                               struct wire_request *req) {
  struct gmb_peer peer = fx_peer("ctl", uid);
  struct wire_reply rep;
  req->id = 99;
  ck_assert_int_eq(gmb__admin(&f->b, &peer, req, &rep), 1);
  ck_assert_int_eq(gmb__core_check(&f->b), 0);
  return rep;
}

/* A tenant add of `name` (no uids; `token`'s hash unless NULL). */
static struct wire_request add_req(const char *name, uint64_t quota,
                                   uint64_t reserve, const char *token) {
  struct wire_request req;
  memset(&req, 0, sizeof req);
  req.kind = WIRE_ADMIN_TENANT_ADD;
  snprintf(req.u.admin_tenant_add.tenant, sizeof req.u.admin_tenant_add.tenant,
           "%s", name);
  req.u.admin_tenant_add.quota = quota;
  req.u.admin_tenant_add.reserve = reserve;
  if (token) {
    req.u.admin_tenant_add.has_token = 1;
    sha256(token, req.u.admin_tenant_add.token_sha256);
  }
  return req;
}

static struct wire_reply add(struct fx *f, const char *name, uint64_t quota,
                             uint64_t reserve, const char *token) {
  struct wire_request req = add_req(name, quota, reserve, token);
  return admin(f, geteuid(), &req);
}

static struct wire_reply removal(struct fx *f, const char *name, int evict) {
  struct wire_request req;
  memset(&req, 0, sizeof req);
  req.kind = WIRE_ADMIN_TENANT_REMOVE;
  snprintf(req.u.admin_tenant_remove.tenant,
           sizeof req.u.admin_tenant_remove.tenant, "%s", name);
  req.u.admin_tenant_remove.evict = evict;
  return admin(f, geteuid(), &req);
}

/* A Hello as `tenant` with `token`; returns the reply's status. */
static int hello_token(struct fx *f, const char *rid, uid_t uid,
                       const char *tenant, const char *token) {
  struct wire_request req;
  memset(&req, 0, sizeof req);
  req.kind = WIRE_HELLO;
  req.u.hello.version = WIRE_PROTOCOL_VERSION;
  snprintf(req.u.hello.tenant, sizeof req.u.hello.tenant, "%s", tenant);
  snprintf(req.u.hello.client, sizeof req.u.hello.client, "check");
  req.u.hello.token_len = (uint32_t)strlen(token);
  memcpy(req.u.hello.token, token, strlen(token));
  struct wire_reply rep;
  ck_assert_int_eq(fx_request(f, rid, uid, &req, &rep), 1);
  return rep.status;
}

static struct gmb_session *session_of_rid(struct fx *f, const char *rid) {
  struct gmb_session *s =
      gmb__session_find(f->b.sessions, (const uint8_t *)rid, strlen(rid));
  ck_assert_ptr_nonnull(s);
  return s;
}

static int exists(struct fx *f, const char *name) {
  return gmb__tenant_find(f->b.tenants, name) != NULL;
}

START_TEST(add_token_quota) {
  struct fx f;
  fx_open(&f);
  struct wire_reply rep = add(&f, "slurm-7.0", 8 * MIB, 0, TOKEN);
  ck_assert_msg(rep.status == 0, "%s", rep.message);
  ck_assert_int_eq(rep.kind, WIRE_TENANT_ROW);
  ck_assert_str_eq(rep.u.tenant_row.name, "slurm-7.0");
  ck_assert_uint_eq(rep.u.tenant_row.quota, 8 * MIB);
  /* The token proves it, for any uid; another token or none does not. */
  ck_assert_int_eq(hello_token(&f, "a", 1001, "slurm-7.0", TOKEN), 0);
  ck_assert_int_eq(hello_token(&f, "b", 1002, "slurm-7.0", "other"),
                   GMB_E_AUTH);
  struct wire_reply r;
  ck_assert_int_eq(fx_hello_as(&f, "c", 1001, "slurm-7.0",
                               WIRE_PROTOCOL_VERSION, &r), 1);
  ck_assert_int_eq(r.status, GMB_E_AUTH);
  /* Held to its quota. */
  fx_must_alloc(&f, "a", 1001, 6 * MIB, 0);
  ck_assert_int_eq(fx_alloc(&f, "a", 1001, 4 * MIB, 0, 0, &r), 1);
  ck_assert_int_eq(r.status, GMB_E_QUOTA);
  fx_close(&f);
}
END_TEST

START_TEST(add_refusals) {
  struct fx f;
  fx_open(&f); /* host:64MiB */
  ck_assert_int_eq(add(&f, "t", 8 * MIB, 0, TOKEN).status, 0);
  struct wire_reply rep = add(&f, "t", 8 * MIB, 0, TOKEN);
  ck_assert_int_eq(rep.status, GMB_E_INVAL);
  ck_assert_ptr_nonnull(strstr(rep.message, "exists already"));
  rep = add(&f, "u", 8 * MIB, 0, NULL);
  ck_assert_int_eq(rep.status, GMB_E_INVAL);
  ck_assert_ptr_nonnull(strstr(rep.message, "would prove no one"));
  rep = add(&f, "u", 65 * MIB, 0, TOKEN);
  ck_assert_int_eq(rep.status, GMB_E_INVAL);
  ck_assert_ptr_nonnull(strstr(rep.message, "more than the device's 64MiB"));
  rep = add(&f, "u", 8 * MIB, 9 * MIB, TOKEN);
  ck_assert_int_eq(rep.status, GMB_E_INVAL);
  ck_assert_ptr_nonnull(strstr(rep.message, "above its quota"));
  rep = add(&f, "-u", 8 * MIB, 0, TOKEN);
  ck_assert_int_eq(rep.status, GMB_E_INVAL);
  ck_assert_ptr_nonnull(strstr(rep.message, "bad tenant name"));
  /* Reservations: 40 + 30 > 64. */
  ck_assert_int_eq(add(&f, "r1", 40 * MIB, 40 * MIB, TOKEN).status, 0);
  rep = add(&f, "r2", 30 * MIB, 30 * MIB, TOKEN);
  ck_assert_int_eq(rep.status, GMB_E_NOMEM);
  ck_assert_ptr_nonnull(strstr(rep.message, "reservations"));
  ck_assert_int_eq(exists(&f, "u") + exists(&f, "-u") + exists(&f, "r2"), 0);
  /* Not an admin. */
  struct wire_request req = add_req("v", 0, 0, TOKEN);
  rep = admin(&f, geteuid() + 4242, &req);
  ck_assert_int_eq(rep.status, GMB_E_AUTH);
  ck_assert_int_eq(exists(&f, "v"), 0);
  fx_close(&f);
}
END_TEST

/*
 * The overflow uid is what SO_PEERCRED says of every peer whose uid has no
 * mapping in the broker's user namespace: never an operator, even when
 * admin_uids names it (the config refuses that, so it is set here by hand)
 * or the broker runs as it; never a run-time tenant's uid; never listed
 * in a tenant's uids.
 */
START_TEST(overflow_uid_never_operator_or_tenant_uid) {
  struct fx f;
  fx_open(&f);
  uid_t ov = gmb__config_overflow_uid();
  f.b.cfg.admin_uids[f.b.cfg.n_admin_uids++] = ov;
  f.b.cfg.admin_uids[f.b.cfg.n_admin_uids++] = 4242;
  ck_assert_int_eq(gmb__admin_allowed(&f.b, ov), 0);
  ck_assert_int_eq(gmb__admin_allowed(&f.b, 4242), 1);
  ck_assert_int_eq(gmb__admin_allowed(&f.b, 4241), ov == 4241);
  ck_assert_int_eq(gmb__admin_allowed(&f.b, geteuid()), geteuid() != ov);
  /* A broker run as the overflow uid: its own uid is no operator. */
  ck_assert_int_eq(gmb__config_operator(NULL, 0, geteuid(), geteuid()), 0);
  ck_assert_int_eq(gmb__config_operator(NULL, 0, geteuid() + 1, geteuid()),
                   1);
  uid_t admins[] = {4242};
  ck_assert_int_eq(gmb__config_operator(admins, 1, geteuid(), 4242), 1);
  ck_assert_int_eq(gmb__config_operator(admins, 1, 4242, 4242), 0);
  /* Its admin request is refused as any other uid's. */
  struct wire_request req = add_req("v", 0, 0, TOKEN);
  ck_assert_int_eq(admin(&f, ov, &req).status, GMB_E_AUTH);
  ck_assert_int_eq(exists(&f, "v"), 0);
  /* tenant add naming it: refused, nothing made. */
  req.u.admin_tenant_add.n_uids = 2;
  req.u.admin_tenant_add.uids[0] = 4242;
  req.u.admin_tenant_add.uids[1] = ov;
  struct wire_reply rep = admin(&f, geteuid(), &req);
  ck_assert_int_eq(rep.status, GMB_E_INVAL);
  ck_assert_msg(strstr(rep.message, "is the overflow uid"), "%s", rep.message);
  ck_assert_int_eq(exists(&f, "v"), 0);
  req.u.admin_tenant_add.n_uids = 1;
  ck_assert_int_eq(admin(&f, geteuid(), &req).status, 0);
  /* Listed all the same (by hand): not the tenant's. */
  struct gmb_tenant *t = gmb__tenant_find(f.b.tenants, "v");
  ck_assert_ptr_nonnull(t);
  t->uids[t->n_uids++] = ov;
  ck_assert_int_eq(gmb__tenant_uid_listed(t, 4242), 1);
  ck_assert_int_eq(gmb__tenant_uid_listed(t, ov), 0);
  fx_close(&f);
}
END_TEST

START_TEST(remove_idle_at_once) {
  struct fx f;
  fx_open(&f);
  ck_assert_int_eq(add(&f, "t", 8 * MIB, 4 * MIB, TOKEN).status, 0);
  ck_assert_uint_eq(gmb__tenants_reserving(f.b.tenants), 1);
  struct wire_reply rep = removal(&f, "t", 0);
  ck_assert_msg(rep.status == 0, "%s", rep.message);
  ck_assert_int_eq(rep.kind, WIRE_ADMIN_TENANT_REMOVE);
  ck_assert_int_eq(rep.u.tenant_remove.removed, 1);
  ck_assert_int_eq(exists(&f, "t"), 0);
  /* Its reservation went with it. */
  ck_assert_uint_eq(gmb__tenants_reserving(f.b.tenants), 0);
  ck_assert_uint_eq(gmb__tenants_reserve_short(f.b.tenants), 0);
  rep = removal(&f, "t", 0);
  ck_assert_int_eq(rep.status, GMB_E_NOENT);
  fx_close(&f);
}
END_TEST

START_TEST(remove_waits_for_sessions) {
  struct fx f;
  fx_open(&f);
  ck_assert_int_eq(add(&f, "t", 8 * MIB, 0, TOKEN).status, 0);
  ck_assert_int_eq(hello_token(&f, "a", 1001, "t", TOKEN), 0);
  fx_must_alloc(&f, "a", 1001, 4 * MIB, 0);
  struct wire_reply rep = removal(&f, "t", 0);
  ck_assert_int_eq(rep.status, 0);
  ck_assert_int_eq(rep.u.tenant_remove.removed, 0);
  ck_assert_uint_eq(rep.u.tenant_remove.sessions, 1);
  ck_assert_ptr_nonnull(strstr(rep.message, "goes when its 1 sessions end"));
  /* Meanwhile no new session, even with the token. */
  ck_assert_int_eq(hello_token(&f, "b", 1001, "t", TOKEN), GMB_E_AUTH);
  /* Its last session ends: the reaper takes it, and its memory is free. */
  fx_end(&f, session_of_rid(&f, "a"));
  ck_assert_int_eq(exists(&f, "t"), 1);
  ck_assert_uint_ge(gmb__core_reap(&f.b, 0), 1);
  ck_assert_int_eq(exists(&f, "t"), 0);
  ck_assert_uint_eq(f.b.dev->in_use, 0);
  fx_close(&f);
}
END_TEST

START_TEST(remove_evict) {
  struct fx f;
  fx_open(&f);
  ck_assert_int_eq(add(&f, "t", 8 * MIB, 0, TOKEN).status, 0);
  ck_assert_int_eq(hello_token(&f, "a", 1001, "t", TOKEN), 0);
  fx_must_alloc(&f, "a", 1001, 4 * MIB, 0);
  struct wire_reply rep = removal(&f, "t", 1);
  ck_assert_msg(rep.status == 0, "%s", rep.message);
  ck_assert_int_eq(rep.u.tenant_remove.removed, 1);
  ck_assert_uint_eq(rep.u.tenant_remove.evicted, 1);
  ck_assert_uint_eq(rep.u.tenant_remove.bytes_freed, 4 * MIB);
  ck_assert_int_eq(exists(&f, "t"), 0);
  ck_assert_uint_eq(f.b.dev->in_use, 0);
  fx_close(&f);
}
END_TEST

START_TEST(configured_not_removed_added_not_reaped) {
  struct fx f;
  fx_open_ini(&f, "host:64MiB", "[tenant:cfg]\nuids = 1001\n");
  struct wire_reply rep = removal(&f, "cfg", 0);
  ck_assert_int_eq(rep.status, GMB_E_INVAL);
  ck_assert_ptr_nonnull(strstr(rep.message, "named in the config file"));
  ck_assert_int_eq(exists(&f, "cfg"), 1);
  /* An added tenant with the default quota (no limit) and no session is
   * idle by every other measure: it stays until removed. */
  ck_assert_int_eq(add(&f, "keep", 0, 0, TOKEN).status, 0);
  ck_assert_int_eq(hello_token(&f, "a", 1001, "keep", TOKEN), 0);
  fx_end(&f, session_of_rid(&f, "a"));
  gmb__core_reap(&f.b, 1);
  ck_assert_int_eq(exists(&f, "keep"), 1);
  fx_close(&f);
}
END_TEST

/* --- revocation by reload ------------------------------------------------- */

static struct wire_reply reload(struct fx *f, const char *ini) {
  char path[256];
  fx_write(f, "gmb.ini", ini, path, sizeof path);
  struct wire_request req;
  memset(&req, 0, sizeof req);
  req.kind = WIRE_ADMIN_RELOAD;
  return admin(f, geteuid(), &req);
}

/* The segment that holds allocation `id` now. */
static uint64_t seg_of(struct fx *f, uint64_t id) {
  struct gmb_alloc_info info;
  ck_assert_int_eq(gmb__pool_find(f->b.pool, id, &info), 0);
  return info.dseg->id;
}

/* Drives the loop's ticks (one move each: a deadline already past) and
 * its once-a-second timer until t's revocation ends, checking the broker
 * between them. */
static void revoke_run(struct fx *f, struct gmb_tenant *t) {
  for (int i = 0; i < 1000 && t->revoking; i++) {
    gmb__defrag_tick(&f->b, 0);
    gmb__defrag_timer(&f->b, gmb__now_ns());
    ck_assert_int_eq(gmb__core_check(&f->b), 0);
  }
  ck_assert_int_eq(t->revoking, 0);
}

/* A uid that a reload removes from `uids` may still map the tenant's
 * segments from a session that ended before the reload: every segment the
 * tenant had is sealed, movable bytes leave them, pinned ones stay, and
 * nothing new lands in them.  A token rotated the same way. */
START_TEST(reload_revokes_sessions_that_ended_before) {
  struct fx f;
  const char *ini = "[broker]\ncompaction = off\n"
                    "[tenant:shared]\nuids = 1001,1002\n";
  fx_open_ini(&f, "host:64MiB", ini);
  fx_hello(&f, "a", 1001, "shared");
  fx_hello(&f, "b", 1002, "shared");
  uint64_t mv = fx_must_alloc(&f, "a", 1001, 64 * 1024, GMB_MOVABLE).u.alloc.id;
  uint64_t pin = fx_must_alloc(&f, "a", 1001, 64 * 1024, 0).u.alloc.id;
  uint64_t more[40];
  for (int i = 0; i < 40; i++) /* a second segment, and many ticks */
    more[i] = fx_must_alloc(&f, "a", 1001, 64 * 1024, GMB_MOVABLE).u.alloc.id;
  fx_must_alloc(&f, "b", 1002, 4096, GMB_MOVABLE);
  uint64_t mv_seg = seg_of(&f, mv), pin_seg = seg_of(&f, pin);
  struct wire_reply rep;
  ck_assert_int_eq(fx_plain(&f, "b", 1002, WIRE_BYE, &rep), 1);
  struct gmb_tenant *t = fx_tenant(&f, "shared");
  /* A reload that changes nothing of who proves it revokes nobody. */
  ck_assert_int_eq(reload(&f, ini).status, 0);
  ck_assert_int_eq(t->revoking, 0);
  ck_assert_uint_eq(seg_of(&f, mv), mv_seg);
  /* 1002 goes: though it has no session now. */
  ck_assert_int_eq(reload(&f, "[broker]\ncompaction = off\n"
                                  "[tenant:shared]\nuids = 1001\n")
                       .status,
                   0);
  ck_assert_int_eq(t->revoking, 1);
  revoke_run(&f, t);
  ck_assert_uint_ne(seg_of(&f, mv), mv_seg);
  ck_assert_uint_ne(seg_of(&f, mv), pin_seg);
  ck_assert_uint_eq(seg_of(&f, pin), pin_seg); /* pinned: stays */
  for (int i = 0; i < 40; i++) {
    ck_assert_uint_ne(seg_of(&f, more[i]), mv_seg);
    ck_assert_uint_ne(seg_of(&f, more[i]), pin_seg);
  }
  for (int i = 0; i < 40; i++) {
    uint64_t id = fx_must_alloc(&f, "a", 1001, 16 * 1024, i & 1).u.alloc.id;
    ck_assert_uint_ne(seg_of(&f, id), pin_seg);
    ck_assert_uint_ne(seg_of(&f, id), mv_seg);
  }
  fx_close(&f);
}
END_TEST

START_TEST(reload_rotated_token_revokes) {
  struct fx f;
  uint8_t h1[32], h2[32];
  sha256("token-one", h1);
  sha256("token-two", h2);
  char ini[512], hex1[65], hex2[65];
  for (int i = 0; i < 32; i++) {
    snprintf(hex1 + 2 * i, 3, "%02x", h1[i]);
    snprintf(hex2 + 2 * i, 3, "%02x", h2[i]);
  }
  snprintf(ini, sizeof ini, "[broker]\ncompaction = off\n[tenant:tok]\n"
           "token_sha256 = %s\n", hex1);
  fx_open_ini(&f, "host:64MiB", ini);
  ck_assert_int_eq(hello_token(&f, "a", 1001, "tok", "token-one"), 0);
  uint64_t mv = fx_must_alloc(&f, "a", 1001, 64 * 1024, GMB_MOVABLE).u.alloc.id;
  uint64_t mv_seg = seg_of(&f, mv);
  ck_assert_int_eq(hello_token(&f, "b", 1001, "tok", "token-one"), 0);
  snprintf(ini, sizeof ini, "[broker]\ncompaction = off\n[tenant:tok]\n"
           "token_sha256 = %s\n", hex2);
  ck_assert_int_eq(reload(&f, ini).status, 0);
  /* Both sessions proved the old token: they end, and their tenant's
   * memory goes with them; the new token's session starts afresh. */
  struct gmb_tenant *t = fx_tenant(&f, "tok");
  ck_assert_uint_eq(t->n_sessions, 0);
  ck_assert_ptr_null(gmb__pool_segment(f.b.pool, mv_seg, NULL));
  revoke_run(&f, t);
  ck_assert_int_eq(hello_token(&f, "c", 1001, "tok", "token-two"), 0);
  fx_must_alloc(&f, "c", 1001, 4096, GMB_MOVABLE);
  fx_close(&f);
}
END_TEST

/* --- default_host_quota ------------------------------------------------- */

/* Tenants the config does not name (made by first use, or by tenant add
 * without a host quota of its own) take default_host_quota, and follow
 * it at reload; a tenant section's host_quota (none: no limit) is the
 * tenant's own, and a tenant that leaves the config keeps what it had. */
START_TEST(default_host_quota_follows_reload) {
  struct fx f;
  fx_open_ini(&f, "host:64MiB",
              "[broker]\ndefault_host_quota = 4MiB\n"
              "[tenant:cfg]\nuids = 1001\nhost_quota = 1MiB\n"
              "[tenant:open]\nuids = 1003\n");
  fx_hello(&f, "x", 1002, "adhoc");
  ck_assert_int_eq(add(&f, "added", 0, 0, TOKEN).status, 0);
  ck_assert_uint_eq(fx_tenant(&f, "adhoc")->host_quota, 4 * MIB);
  ck_assert_uint_eq(fx_tenant(&f, "added")->host_quota, 4 * MIB);
  ck_assert_uint_eq(fx_tenant(&f, "cfg")->host_quota, MIB);
  ck_assert_uint_eq(fx_tenant(&f, "open")->host_quota, 0);
  /* A new default: the tenants that have the default take it. */
  struct wire_reply rep =
      reload(&f, "[broker]\ndefault_host_quota = 2MiB\n"
                 "[tenant:cfg]\nuids = 1001\nhost_quota = 1MiB\n"
                 "[tenant:open]\nuids = 1003\n");
  ck_assert_msg(rep.status == 0, "%s", rep.message);
  ck_assert_uint_eq(fx_tenant(&f, "adhoc")->host_quota, 2 * MIB);
  ck_assert_uint_eq(fx_tenant(&f, "added")->host_quota, 2 * MIB);
  ck_assert_uint_eq(fx_tenant(&f, "cfg")->host_quota, MIB);
  ck_assert_uint_eq(fx_tenant(&f, "open")->host_quota, 0);
  /* Named, a tenant has its section's; named no more, it keeps it. */
  rep = reload(&f, "[broker]\ndefault_host_quota = 2MiB\n"
                   "[tenant:adhoc]\nhost_quota = 8MiB\n");
  ck_assert_msg(rep.status == 0, "%s", rep.message);
  ck_assert_uint_eq(fx_tenant(&f, "adhoc")->host_quota, 8 * MIB);
  rep = reload(&f, "[broker]\noffload_host_max = 12MiB\n");
  ck_assert_msg(rep.status == 0, "%s", rep.message);
  ck_assert_uint_eq(fx_tenant(&f, "adhoc")->host_quota, 8 * MIB);
  ck_assert_uint_eq(fx_tenant(&f, "cfg")->host_quota, MIB);
  /* auto: a quarter of offload_host_max. */
  ck_assert_uint_eq(fx_tenant(&f, "added")->host_quota, 3 * MIB);
  /* A tenant made after the reload has the new default too. */
  fx_hello(&f, "y", 1004, "later");
  ck_assert_uint_eq(fx_tenant(&f, "later")->host_quota, 3 * MIB);
  fx_close(&f);
}
END_TEST

/* A tenant added with a host_quota has it as its own, as a config
 * section's: shown in its row and status, kept across reloads that change
 * default_host_quota; 0 given is "no limit", not the default.  One added
 * without follows the default, as above.  The broker's admin handler
 * takes any size, as a config section does. */
START_TEST(add_host_quota_kept_across_reload) {
  struct fx f;
  fx_open_ini(&f, "host:64MiB", "[broker]\ndefault_host_quota = 4MiB\n");
  struct wire_request req = add_req("own", 8 * MIB, 0, TOKEN);
  req.u.admin_tenant_add.has_host_quota = 1;
  req.u.admin_tenant_add.host_quota = 6 * MIB;
  struct wire_reply rep = admin(&f, geteuid(), &req);
  ck_assert_msg(rep.status == 0, "%s", rep.message);
  ck_assert_uint_eq(rep.u.tenant_row.host_quota, 6 * MIB);
  ck_assert_ptr_nonnull(strstr(rep.message, "host_quota 6MiB"));
  req = add_req("nolimit", 0, 0, TOKEN);
  req.u.admin_tenant_add.has_host_quota = 1;
  rep = admin(&f, geteuid(), &req);
  ck_assert_msg(rep.status == 0, "%s", rep.message);
  ck_assert_uint_eq(rep.u.tenant_row.host_quota, 0);
  ck_assert_ptr_nonnull(strstr(rep.message, "host_quota unlimited"));
  rep = add(&f, "dflt", 0, 0, TOKEN);
  ck_assert_msg(rep.status == 0, "%s", rep.message);
  ck_assert_uint_eq(rep.u.tenant_row.host_quota, 4 * MIB);
  ck_assert_ptr_nonnull(strstr(rep.message, "host_quota 4MiB (default)"));
  /* Status shows each one's. */
  memset(&req, 0, sizeof req);
  req.kind = WIRE_ADMIN_STATUS;
  rep = admin(&f, geteuid(), &req);
  ck_assert_int_eq(rep.status, 0);
  const char *names[] = {"own", "nolimit", "dflt"};
  const uint64_t want[] = {6 * MIB, 0, 4 * MIB};
  int seen = 0;
  for (size_t i = 0; i < rep.u.admin_status.n_tenants; i++) {
    const struct wire_tenant_row *r = &rep.u.admin_status.tenants[i];
    for (int k = 0; k < 3; k++) {
      if (strcmp(r->name, names[k]) != 0) continue;
      ck_assert_uint_eq(r->host_quota, want[k]);
      seen++;
    }
  }
  ck_assert_int_eq(seen, 3);
  gmb__wire_reply_clear(&rep);
  /* A new default: only the tenant without its own follows it. */
  rep = reload(&f, "[broker]\ndefault_host_quota = 2MiB\n");
  ck_assert_msg(rep.status == 0, "%s", rep.message);
  ck_assert_uint_eq(fx_tenant(&f, "own")->host_quota, 6 * MIB);
  ck_assert_uint_eq(fx_tenant(&f, "nolimit")->host_quota, 0);
  ck_assert_uint_eq(fx_tenant(&f, "dflt")->host_quota, 2 * MIB);
  rep = reload(&f, "[broker]\ndefault_host_quota = 0\n");
  ck_assert_msg(rep.status == 0, "%s", rep.message);
  ck_assert_uint_eq(fx_tenant(&f, "own")->host_quota, 6 * MIB);
  ck_assert_uint_eq(fx_tenant(&f, "dflt")->host_quota, 0);
  /* Any size, as a config section's host_quota. */
  req = add_req("huge", 0, 0, TOKEN);
  req.u.admin_tenant_add.has_host_quota = 1;
  req.u.admin_tenant_add.host_quota = UINT64_MAX;
  rep = admin(&f, geteuid(), &req);
  ck_assert_msg(rep.status == 0, "%s", rep.message);
  ck_assert_uint_eq(fx_tenant(&f, "huge")->host_quota, UINT64_MAX);
  fx_close(&f);
}
END_TEST

static Suite *admin_suite(void) {
  Suite *s = suite_create("admin");
  TCase *tc = tcase_create("tenant_add");
  tcase_add_test(tc, add_token_quota);
  tcase_add_test(tc, add_refusals);
  tcase_add_test(tc, overflow_uid_never_operator_or_tenant_uid);
  suite_add_tcase(s, tc);
  tc = tcase_create("tenant_remove");
  tcase_add_test(tc, remove_idle_at_once);
  tcase_add_test(tc, remove_waits_for_sessions);
  tcase_add_test(tc, remove_evict);
  tcase_add_test(tc, configured_not_removed_added_not_reaped);
  tcase_add_test(tc, reload_revokes_sessions_that_ended_before);
  tcase_add_test(tc, reload_rotated_token_revokes);
  tcase_add_test(tc, default_host_quota_follows_reload);
  tcase_add_test(tc, add_host_quota_kept_across_reload);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) { return check_run(admin_suite()); }
