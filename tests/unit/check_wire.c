/*
 * check_wire.c - the codec of proto/wire.c and the error list of
 * proto/error.c.
 *
 * Every request and reply kind must come back from encode -> decode with
 * every field equal; the wire Status enum must be the GMB_ERRORS list, no
 * more and no less; and no input, however hostile, may crash the decoders
 * or make them return anything but 0 or GMB_E_PROTO.  Hostile messages are
 * written byte by byte with the small protobuf writer below, so the test
 * does not need the generated code (and can write what the encoder never
 * would: a 64-byte tenant name, a 257-byte token).  Run it under ASan too
 * (make check SAN=1): the decoders' frees on failure are part of the test.
 * ITER sets the number of random buffers (default 20000).
 */
#include <check.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check_main.h"
#include "gmb.h"
#include "wire.h"

#define WIRE_TEST_MIB (UINT64_C(1) << 20)

/* ---- a minimal protobuf writer for hand-made messages ------------------ */

struct pb {
  uint8_t b[4096];
  size_t n;
};

static void pb_varint(struct pb *p, uint64_t v) {
  do {
    ck_assert_uint_lt(p->n, sizeof p->b);
    uint8_t byte = v & 0x7f;
    v >>= 7;
    p->b[p->n++] = byte | (v ? 0x80 : 0);
  } while (v);
}

static void pb_uint(struct pb *p, unsigned field, uint64_t v) {
  pb_varint(p, (uint64_t)field << 3 | 0); /* wire type 0: varint */
  pb_varint(p, v);
}

static void pb_bytes(struct pb *p, unsigned field, const void *data,
                     size_t len) {
  pb_varint(p, (uint64_t)field << 3 | 2); /* wire type 2: length-delimited */
  pb_varint(p, len);
  ck_assert_uint_le(p->n + len, sizeof p->b);
  memcpy(p->b + p->n, data, len);
  p->n += len;
}

static void pb_sub(struct pb *p, unsigned field, const struct pb *sub) {
  pb_bytes(p, field, sub->b, sub->n);
}

/* A string of n copies of 'a'. */
static char *str_of(size_t n) {
  char *s = malloc(n + 1);
  ck_assert_ptr_nonnull(s);
  memset(s, 'a', n);
  s[n] = '\0';
  return s;
}

/* ---- round trips --------------------------------------------------------- */

static void req_roundtrip(const struct wire_request *in,
                          struct wire_request *out) {
  uint8_t *buf = NULL;
  size_t len = 0;
  ck_assert_int_eq(gmb__wire_request_encode(in, &buf, &len), 0);
  ck_assert_ptr_nonnull(buf);
  ck_assert_int_eq(gmb__wire_request_decode(buf, len, out), 0);
  free(buf);
  ck_assert_uint_eq(out->id, in->id);
  ck_assert_int_eq(out->kind, in->kind);
}

START_TEST(request_hello_roundtrip) {
  struct wire_request in, out;
  memset(&in, 0, sizeof in);
  in.id = UINT64_MAX;
  in.kind = WIRE_HELLO;
  in.u.hello.version = WIRE_PROTOCOL_VERSION;
  memset(in.u.hello.tenant, 'x', WIRE_NAME_MAX); /* the longest name */
  in.u.hello.token_len = WIRE_TOKEN_MAX;
  for (unsigned i = 0; i < WIRE_TOKEN_MAX; i++)
    in.u.hello.token[i] = (uint8_t)i; /* includes a 0 byte */
  in.u.hello.pid = -42;
  strcpy(in.u.hello.client, "libgmb 0.1.0");
  req_roundtrip(&in, &out);
  ck_assert_uint_eq(out.u.hello.version, WIRE_PROTOCOL_VERSION);
  ck_assert_str_eq(out.u.hello.tenant, in.u.hello.tenant);
  ck_assert_uint_eq(out.u.hello.token_len, WIRE_TOKEN_MAX);
  ck_assert_mem_eq(out.u.hello.token, in.u.hello.token, WIRE_TOKEN_MAX);
  ck_assert_int_eq(out.u.hello.pid, -42);
  ck_assert_str_eq(out.u.hello.client, "libgmb 0.1.0");
  ck_assert_mem_eq(&out, &in, sizeof in);
}
END_TEST

START_TEST(request_hello_empty_fields) {
  struct wire_request in, out;
  memset(&in, 0, sizeof in);
  in.id = 1;
  in.kind = WIRE_HELLO;
  req_roundtrip(&in, &out);
  ck_assert_str_eq(out.u.hello.tenant, "");
  ck_assert_uint_eq(out.u.hello.token_len, 0);
  ck_assert_mem_eq(&out, &in, sizeof in);
}
END_TEST

START_TEST(request_alloc_roundtrip) {
  struct wire_request in, out;
  memset(&in, 0, sizeof in);
  in.id = 7;
  in.kind = WIRE_ALLOC;
  in.u.alloc.size = UINT64_MAX;
  in.u.alloc.flags = GMB_MOVABLE;
  in.u.alloc.timeout_ms = -1;
  req_roundtrip(&in, &out);
  ck_assert_uint_eq(out.u.alloc.size, UINT64_MAX);
  ck_assert_uint_eq(out.u.alloc.flags, GMB_MOVABLE);
  ck_assert_int_eq(out.u.alloc.timeout_ms, -1);
  ck_assert_mem_eq(&out, &in, sizeof in);
}
END_TEST

/* A run-time tenant's host_quota: given (0 included, which is "no limit")
 * or not, which leaves the broker's default; both come back as sent. */
START_TEST(request_tenant_add_host_quota_roundtrip) {
  struct wire_request in, out;
  memset(&in, 0, sizeof in);
  in.id = 9;
  in.kind = WIRE_ADMIN_TENANT_ADD;
  snprintf(in.u.admin_tenant_add.tenant, sizeof in.u.admin_tenant_add.tenant,
           "slurm-1.0");
  in.u.admin_tenant_add.quota = 8 * WIRE_TEST_MIB;
  in.u.admin_tenant_add.n_uids = 1;
  in.u.admin_tenant_add.uids[0] = 1001;
  in.u.admin_tenant_add.has_host_quota = 1;
  in.u.admin_tenant_add.host_quota = UINT64_MAX;
  req_roundtrip(&in, &out);
  ck_assert_int_eq(out.u.admin_tenant_add.has_host_quota, 1);
  ck_assert_uint_eq(out.u.admin_tenant_add.host_quota, UINT64_MAX);
  ck_assert_mem_eq(&out, &in, sizeof in);
  in.u.admin_tenant_add.host_quota = 0; /* given: no limit */
  req_roundtrip(&in, &out);
  ck_assert_int_eq(out.u.admin_tenant_add.has_host_quota, 1);
  ck_assert_uint_eq(out.u.admin_tenant_add.host_quota, 0);
  in.u.admin_tenant_add.has_host_quota = 0; /* not given */
  req_roundtrip(&in, &out);
  ck_assert_int_eq(out.u.admin_tenant_add.has_host_quota, 0);
  ck_assert_mem_eq(&out, &in, sizeof in);
  /* A value without its flag is not sent... */
  uint8_t *buf = NULL;
  size_t len = 0;
  in.u.admin_tenant_add.host_quota = WIRE_TEST_MIB;
  ck_assert_int_eq(gmb__wire_request_encode(&in, &buf, &len), GMB_E_INVAL);
  ck_assert_ptr_null(buf);
  /* ...nor taken: AdminTenantAdd.host_quota (7) without has_host_quota (8). */
  struct pb add = {.n = 0}, p = {.n = 0};
  pb_bytes(&add, 1, "x", 1);
  pb_uint(&add, 7, WIRE_TEST_MIB);
  pb_uint(&p, 1, 1);
  pb_sub(&p, 28, &add);
  ck_assert_int_eq(gmb__wire_request_decode(p.b, p.n, &out), GMB_E_PROTO);
  pb_uint(&add, 8, 1);
  p.n = 0;
  pb_uint(&p, 1, 1);
  pb_sub(&p, 28, &add);
  ck_assert_int_eq(gmb__wire_request_decode(p.b, p.n, &out), 0);
  ck_assert_int_eq(out.u.admin_tenant_add.has_host_quota, 1);
  ck_assert_uint_eq(out.u.admin_tenant_add.host_quota, WIRE_TEST_MIB);
}
END_TEST

START_TEST(request_free_segment_closed_roundtrip) {
  struct wire_request in, out;
  memset(&in, 0, sizeof in);
  in.id = 8;
  in.kind = WIRE_FREE;
  in.u.free.id = UINT64_C(0x8000000000000001);
  req_roundtrip(&in, &out);
  ck_assert_uint_eq(out.u.free.id, UINT64_C(0x8000000000000001));

  memset(&in, 0, sizeof in);
  in.id = 9;
  in.kind = WIRE_SEGMENT_CLOSED;
  in.u.segment.segment = 12345;
  req_roundtrip(&in, &out);
  ck_assert_uint_eq(out.u.segment.segment, 12345);
  ck_assert_mem_eq(&out, &in, sizeof in);

  /* Vmm: the process's total, at its extremes. */
  const uint64_t totals[] = {0, 1, UINT64_MAX};
  for (size_t i = 0; i < 3; i++) {
    memset(&in, 0, sizeof in);
    in.id = 10 + i;
    in.kind = WIRE_VMM;
    in.u.vmm.bytes = totals[i];
    req_roundtrip(&in, &out);
    ck_assert_int_eq(out.kind, WIRE_VMM);
    ck_assert_uint_eq(out.u.vmm.bytes, totals[i]);
    ck_assert_mem_eq(&out, &in, sizeof in);
  }
  ck_assert_str_eq(gmb__wire_kind_name(WIRE_VMM), "vmm");
}
END_TEST

/* Kinds with no fields must still arrive as themselves, not as "no body". */
START_TEST(request_empty_bodies_roundtrip) {
  static const enum wire_kind kinds[] = {WIRE_STATS, WIRE_HEARTBEAT, WIRE_BYE,
                                         WIRE_ADMIN_STATUS};
  for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++) {
    struct wire_request in, out;
    memset(&in, 0, sizeof in);
    in.id = 100 + i;
    in.kind = kinds[i];
    req_roundtrip(&in, &out);
    ck_assert_mem_eq(&out, &in, sizeof in);
  }
}
END_TEST

START_TEST(request_encode_refuses) {
  struct wire_request in;
  uint8_t *buf = NULL;
  size_t len = 0;
  memset(&in, 0, sizeof in);
  in.kind = WIRE_NONE;
  ck_assert_int_eq(gmb__wire_request_encode(&in, &buf, &len), GMB_E_INVAL);
  in.kind = WIRE_EVENT; /* replies only */
  ck_assert_int_eq(gmb__wire_request_encode(&in, &buf, &len), GMB_E_INVAL);
  in.kind = WIRE_HELLO;
  in.u.hello.token_len = WIRE_TOKEN_MAX + 1;
  ck_assert_int_eq(gmb__wire_request_encode(&in, &buf, &len), GMB_E_INVAL);
  /* A name that fills its array with no NUL would be read past its end. */
  in.u.hello.token_len = 0;
  memset(in.u.hello.tenant, 'x', sizeof in.u.hello.tenant);
  ck_assert_int_eq(gmb__wire_request_encode(&in, &buf, &len), GMB_E_INVAL);
  ck_assert_ptr_null(buf);
}
END_TEST

static void rep_roundtrip(const struct wire_reply *in, struct wire_reply *out) {
  uint8_t *buf = NULL;
  size_t len = 0;
  ck_assert_int_eq(gmb__wire_reply_encode(in, &buf, &len), 0);
  ck_assert_int_eq(gmb__wire_reply_decode(buf, len, out), 0);
  free(buf);
  ck_assert_uint_eq(out->id, in->id);
  ck_assert_int_eq(out->status, in->status);
  ck_assert_str_eq(out->message, in->message);
  ck_assert_int_eq(out->kind, in->kind);
}

START_TEST(reply_status_only_every_code) {
  struct wire_reply in, out;
  memset(&in, 0, sizeof in);
  in.id = 3;
  rep_roundtrip(&in, &out);
  ck_assert_int_eq(out.status, GMB_OK);
#define WIRE_TEST_CODE_(name, code, text)                     \
  memset(&in, 0, sizeof in);                                  \
  in.id = 1000 + code;                                        \
  in.status = GMB_E_##name;                                   \
  snprintf(in.message, sizeof in.message, "%s", text);        \
  rep_roundtrip(&in, &out);                                   \
  ck_assert_int_eq(out.status, GMB_E_##name);                 \
  ck_assert_mem_eq(&out, &in, sizeof in);
  GMB_ERRORS(WIRE_TEST_CODE_)
#undef WIRE_TEST_CODE_
}
END_TEST

START_TEST(reply_hello_roundtrip) {
  struct wire_reply in, out;
  memset(&in, 0, sizeof in);
  in.id = 1;
  in.kind = WIRE_HELLO;
  in.u.hello.version = WIRE_PROTOCOL_VERSION;
  in.u.hello.session = UINT64_MAX - 1;
  memset(in.u.hello.tenant, 'y', WIRE_NAME_MAX);
  strcpy(in.u.hello.device, "cuda");
  strcpy(in.u.hello.device_uuid, "GPU-46414b45-4355-4441-0000-000000000001");
  strcpy(in.u.hello.device_pci, "0000:11:00.0");
  in.u.hello.heartbeat_ms = 1000;
  in.u.hello.lock_slots = 4096;
  in.u.hello.fd_secret_len = WIRE_SECRET_MAX;
  for (unsigned i = 0; i < WIRE_SECRET_MAX; i++)
    in.u.hello.fd_secret[i] = (uint8_t)(i * 37); /* includes a 0 byte */
  rep_roundtrip(&in, &out);
  ck_assert_uint_eq(out.u.hello.version, WIRE_PROTOCOL_VERSION);
  ck_assert_uint_eq(out.u.hello.session, UINT64_MAX - 1);
  ck_assert_str_eq(out.u.hello.tenant, in.u.hello.tenant);
  ck_assert_str_eq(out.u.hello.device, "cuda");
  ck_assert_str_eq(out.u.hello.device_uuid,
                   "GPU-46414b45-4355-4441-0000-000000000001");
  ck_assert_str_eq(out.u.hello.device_pci, "0000:11:00.0");
  ck_assert_uint_eq(out.u.hello.heartbeat_ms, 1000);
  ck_assert_uint_eq(out.u.hello.lock_slots, 4096);
  ck_assert_uint_eq(out.u.hello.fd_secret_len, WIRE_SECRET_MAX);
  ck_assert_mem_eq(out.u.hello.fd_secret, in.u.hello.fd_secret,
                   WIRE_SECRET_MAX);
  ck_assert_mem_eq(&out, &in, sizeof in);

  /* No secret (a broker without a descriptor channel): none arrives. */
  in.u.hello.fd_secret_len = 0;
  memset(in.u.hello.fd_secret, 0, sizeof in.u.hello.fd_secret);
  rep_roundtrip(&in, &out);
  ck_assert_uint_eq(out.u.hello.fd_secret_len, 0);
  ck_assert_mem_eq(&out, &in, sizeof in);

  /* The host device has no GPU identity: empty strings arrive empty. */
  memset(in.u.hello.device_uuid, 0, sizeof in.u.hello.device_uuid);
  memset(in.u.hello.device_pci, 0, sizeof in.u.hello.device_pci);
  rep_roundtrip(&in, &out);
  ck_assert_str_eq(out.u.hello.device_uuid, "");
  ck_assert_str_eq(out.u.hello.device_pci, "");
  ck_assert_mem_eq(&out, &in, sizeof in);

  /* A UUID that does not fit its field is not sent. */
  memset(in.u.hello.device_uuid, 'u', sizeof in.u.hello.device_uuid);
  uint8_t *buf = NULL;
  size_t len = 0;
  ck_assert_int_eq(gmb__wire_reply_encode(&in, &buf, &len), GMB_E_INVAL);
}
END_TEST

/* Version 2: segments and lock tables travel as descriptors (fd.sock); the
 * codec's constant, the .proto's enum and the fd channel agree. */
START_TEST(protocol_version_2) {
  ck_assert_int_eq(WIRE_PROTOCOL_VERSION, 2);
  ck_assert_int_eq(WIRE_SECRET_MAX, 32);
  /* A Hello of version 2 arrives as such. */
  struct wire_request r;
  struct pb hello = {.n = 0}, p = {.n = 0};
  pb_uint(&hello, 1, 2);
  pb_uint(&p, 1, 1);
  pb_sub(&p, 2, &hello);
  ck_assert_int_eq(gmb__wire_request_decode(p.b, p.n, &r), 0);
  ck_assert_int_eq(r.kind, WIRE_HELLO);
  ck_assert_uint_eq(r.u.hello.version, 2);
}
END_TEST

START_TEST(reply_alloc_roundtrip) {
  struct wire_reply in, out;
  memset(&in, 0, sizeof in);
  in.id = 2;
  in.kind = WIRE_ALLOC;
  in.u.alloc.id = 77;
  in.u.alloc.size = 512;
  in.u.alloc.segment = 5;
  in.u.alloc.offset = UINT64_C(1) << 40;
  in.u.alloc.slot = UINT32_MAX - 1;
  rep_roundtrip(&in, &out);
  ck_assert_uint_eq(out.u.alloc.id, 77);
  ck_assert_uint_eq(out.u.alloc.size, 512);
  ck_assert_uint_eq(out.u.alloc.segment, 5);
  ck_assert_uint_eq(out.u.alloc.offset, UINT64_C(1) << 40);
  ck_assert_uint_eq(out.u.alloc.slot, UINT32_MAX - 1);
  ck_assert_mem_eq(&out, &in, sizeof in);
}
END_TEST

START_TEST(reply_stats_roundtrip) {
  struct wire_reply in, out;
  memset(&in, 0, sizeof in);
  in.id = 4;
  in.kind = WIRE_STATS;
  in.u.stats.quota = 20 * (UINT64_C(1) << 30);
  in.u.stats.used = 1;
  in.u.stats.peak = UINT64_MAX;
  in.u.stats.segments = 2 << 20;
  in.u.stats.device_capacity = UINT64_C(70) << 30;
  in.u.stats.device_segments = 6 << 20;
  in.u.stats.device_used = 3;
  in.u.stats.free_in_segments = (2 << 20) - 1;
  in.u.stats.cached = 5 << 20; /* field 5 beside main's 16-19 */
  in.u.stats.vmm = UINT64_C(3) << 40;
  rep_roundtrip(&in, &out);
  ck_assert_uint_eq(out.u.stats.quota, 20 * (UINT64_C(1) << 30));
  ck_assert_uint_eq(out.u.stats.used, 1);
  ck_assert_uint_eq(out.u.stats.peak, UINT64_MAX);
  ck_assert_uint_eq(out.u.stats.segments, 2 << 20);
  ck_assert_uint_eq(out.u.stats.device_capacity, UINT64_C(70) << 30);
  ck_assert_uint_eq(out.u.stats.device_segments, 6 << 20);
  ck_assert_uint_eq(out.u.stats.device_used, 3);
  ck_assert_uint_eq(out.u.stats.free_in_segments, (2 << 20) - 1);
  ck_assert_uint_eq(out.u.stats.cached, 5 << 20);
  ck_assert_uint_eq(out.u.stats.vmm, UINT64_C(3) << 40);
  ck_assert_mem_eq(&out, &in, sizeof in);
}
END_TEST

START_TEST(reply_event_roundtrip) {
  struct wire_reply in, out;
  memset(&in, 0, sizeof in);
  in.id = 0; /* events travel with id 0 */
  in.kind = WIRE_EVENT;
  in.u.event.kind = WIRE_EVENT_SEGMENT_RETIRED;
  in.u.event.segment = 31;
  strcpy(in.message, "segment 31 retired");
  rep_roundtrip(&in, &out);
  ck_assert_int_eq(out.u.event.kind, WIRE_EVENT_SEGMENT_RETIRED);
  ck_assert_uint_eq(out.u.event.segment, 31);
  ck_assert_mem_eq(&out, &in, sizeof in);

  in.u.event.kind = WIRE_EVENT_SESSION_ENDED;
  in.status = GMB_E_EVICTED;
  strcpy(in.message, "evicted by an operator");
  rep_roundtrip(&in, &out);
  ck_assert_int_eq(out.u.event.kind, WIRE_EVENT_SESSION_ENDED);
  ck_assert_int_eq(out.status, GMB_E_EVICTED);
  ck_assert_mem_eq(&out, &in, sizeof in);
}
END_TEST

/* The cache's report rides on any request; the tenant's sum comes back
 * in Stats; a trim event says how many bytes. */
START_TEST(cache_fields_roundtrip) {
  struct wire_request in, out;
  memset(&in, 0, sizeof in);
  in.id = 9;
  in.kind = WIRE_HEARTBEAT;
  in.cached_free = (UINT64_C(3) << 30) + 512;
  req_roundtrip(&in, &out);
  ck_assert_uint_eq(out.cached_free, (UINT64_C(3) << 30) + 512);
  ck_assert_mem_eq(&out, &in, sizeof in);
  in.kind = WIRE_ALLOC;
  in.u.alloc.size = 4096;
  req_roundtrip(&in, &out);
  ck_assert_uint_eq(out.cached_free, (UINT64_C(3) << 30) + 512);

  struct wire_reply r, o;
  memset(&r, 0, sizeof r);
  r.id = 5;
  r.kind = WIRE_STATS;
  r.u.stats.used = 10 << 20;
  r.u.stats.cached = 6 << 20;
  rep_roundtrip(&r, &o);
  ck_assert_uint_eq(o.u.stats.cached, 6 << 20);
  ck_assert_mem_eq(&o, &r, sizeof r);
  memset(&r, 0, sizeof r);
  r.kind = WIRE_EVENT;
  r.u.event.kind = WIRE_EVENT_TRIM;
  r.u.event.bytes = UINT64_MAX;
  rep_roundtrip(&r, &o);
  ck_assert_int_eq(o.u.event.kind, WIRE_EVENT_TRIM);
  ck_assert_uint_eq(o.u.event.bytes, UINT64_MAX);
  ck_assert_mem_eq(&o, &r, sizeof r);
}
END_TEST

/* A trim's answer rides on a Heartbeat; a quota refusal says, in a field
 * and not only in its text, how many cached bytes were asked back. */
/* A cache's pages: an Alloc of pages, its reply of each page's id and
 * segment, a Free of several; past WIRE_PAGES_MAX neither side builds
 * one. */
START_TEST(pages_roundtrip) {
  struct wire_request in, out;
  memset(&in, 0, sizeof in);
  in.id = 5;
  in.kind = WIRE_ALLOC;
  in.u.alloc.size = 3 * (UINT64_C(2) << 20);
  in.u.alloc.pages = 3;
  req_roundtrip(&in, &out);
  ck_assert_mem_eq(&out, &in, sizeof in);
  memset(&in, 0, sizeof in);
  in.id = 6;
  in.kind = WIRE_FREE;
  in.u.free.id = 11;
  in.u.free.n_more = WIRE_PAGES_MAX - 1;
  for (unsigned i = 0; i < WIRE_PAGES_MAX - 1; i++) in.u.free.more[i] = 12 + i;
  req_roundtrip(&in, &out);
  ck_assert_mem_eq(&out, &in, sizeof in);
  uint8_t *buf = NULL;
  size_t len = 0;
  in.u.free.n_more = WIRE_PAGES_MAX;
  ck_assert_int_eq(gmb__wire_request_encode(&in, &buf, &len), GMB_E_INVAL);

  struct wire_reply r, o;
  memset(&r, 0, sizeof r);
  r.id = 9;
  r.kind = WIRE_ALLOC;
  r.u.alloc.size = 2 * (UINT64_C(2) << 20);
  r.u.alloc.n_pages = 2;
  r.u.alloc.page_id[0] = r.u.alloc.id = 40;
  r.u.alloc.page_id[1] = 41;
  r.u.alloc.page_seg[0] = r.u.alloc.segment = 7;
  r.u.alloc.page_seg[1] = 8;
  rep_roundtrip(&r, &o);
  ck_assert_mem_eq(&o, &r, sizeof r);
  r.u.alloc.n_pages = WIRE_PAGES_MAX + 1;
  ck_assert_int_eq(gmb__wire_reply_encode(&r, &buf, &len), GMB_E_INVAL);
}
END_TEST

START_TEST(trim_answer_and_asked_back_roundtrip) {
  struct wire_request in, out;
  memset(&in, 0, sizeof in);
  in.id = 3;
  in.kind = WIRE_HEARTBEAT;
  in.cached_free = 512;
  in.cached_holes = UINT64_C(3) << 40; /* the holes between its blocks */
  in.trim_answered = 1;
  req_roundtrip(&in, &out);
  ck_assert_int_eq(out.trim_answered, 1);
  ck_assert_uint_eq(out.cached_holes, UINT64_C(3) << 40);
  ck_assert_mem_eq(&out, &in, sizeof in);
  in.trim_answered = 0;
  req_roundtrip(&in, &out);
  ck_assert_int_eq(out.trim_answered, 0);

  struct wire_reply r, o;
  memset(&r, 0, sizeof r);
  r.id = 8;
  r.status = GMB_E_QUOTA;
  strcpy(r.message, "over quota; 1 cached bytes asked back");
  r.asked_back = (UINT64_C(3) << 29) + 512;
  rep_roundtrip(&r, &o);
  ck_assert_int_eq(o.status, GMB_E_QUOTA);
  ck_assert_uint_eq(o.asked_back, (UINT64_C(3) << 29) + 512);
  ck_assert_mem_eq(&o, &r, sizeof r);
  /* Absent (an older broker): 0, whatever the text says. */
  r.asked_back = 0;
  rep_roundtrip(&r, &o);
  ck_assert_uint_eq(o.asked_back, 0);
}
END_TEST

START_TEST(reply_admin_status_rows_roundtrip) {
  struct wire_tenant_row rows[3];
  struct wire_reply in, out;
  memset(rows, 0, sizeof rows);
  for (unsigned i = 0; i < 3; i++) {
    snprintf(rows[i].name, sizeof rows[i].name, "tenant-%u", i);
    rows[i].quota = i * 1000 + 1;
    rows[i].used = i * 1000 + 2;
    rows[i].peak = i * 1000 + 3;
    rows[i].segments = i * 1000 + 4;
    rows[i].allocations = i * 1000 + 5;
    rows[i].sessions = i + 6;
    rows[i].vmm = i * 1000 + 7;
  }
  memset(rows[2].name, 'z', WIRE_NAME_MAX);
  memset(&in, 0, sizeof in);
  in.id = 6;
  in.kind = WIRE_ADMIN_STATUS;
  strcpy(in.u.admin_status.device, "host:1GiB");
  in.u.admin_status.capacity = UINT64_C(1) << 30;
  in.u.admin_status.in_segments = 6 << 20;
  in.u.admin_status.in_use = 3 << 20;
  in.u.admin_status.sessions = 4;
  in.u.admin_status.n_tenants = 3;
  in.u.admin_status.tenants = rows;
  in.u.admin_status.offload_job_requests = UINT32_MAX;
  in.u.admin_status.offload_slices = UINT64_MAX;
  in.u.admin_status.offload_jobs = UINT64_MAX - 1;
  in.u.admin_status.offload_pauses = UINT32_MAX - 2;
  rep_roundtrip(&in, &out);
  ck_assert_uint_eq(out.u.admin_status.offload_job_requests, UINT32_MAX);
  ck_assert_uint_eq(out.u.admin_status.offload_slices, UINT64_MAX);
  ck_assert_uint_eq(out.u.admin_status.offload_jobs, UINT64_MAX - 1);
  ck_assert_uint_eq(out.u.admin_status.offload_pauses, UINT32_MAX - 2);
  ck_assert_str_eq(out.u.admin_status.device, "host:1GiB");
  ck_assert_uint_eq(out.u.admin_status.capacity, UINT64_C(1) << 30);
  ck_assert_uint_eq(out.u.admin_status.in_segments, 6 << 20);
  ck_assert_uint_eq(out.u.admin_status.in_use, 3 << 20);
  ck_assert_uint_eq(out.u.admin_status.sessions, 4);
  ck_assert_uint_eq(out.u.admin_status.n_tenants, 3);
  ck_assert_ptr_nonnull(out.u.admin_status.tenants);
  ck_assert_ptr_ne(out.u.admin_status.tenants, rows);
  for (unsigned i = 0; i < 3; i++) {
    const struct wire_tenant_row *r = &out.u.admin_status.tenants[i];
    ck_assert_str_eq(r->name, rows[i].name);
    ck_assert_uint_eq(r->quota, rows[i].quota);
    ck_assert_uint_eq(r->used, rows[i].used);
    ck_assert_uint_eq(r->peak, rows[i].peak);
    ck_assert_uint_eq(r->segments, rows[i].segments);
    ck_assert_uint_eq(r->allocations, rows[i].allocations);
    ck_assert_uint_eq(r->sessions, rows[i].sessions);
    ck_assert_uint_eq(r->vmm, rows[i].vmm);
  }
  ck_assert_mem_eq(out.u.admin_status.tenants, rows, sizeof rows);
  gmb__wire_reply_clear(&out);
  ck_assert_ptr_null(out.u.admin_status.tenants);
  ck_assert_uint_eq(out.u.admin_status.n_tenants, 0);
  gmb__wire_reply_clear(&out); /* twice is harmless */
}
END_TEST

/* A snapshot page's cursor and limit, at their extremes, arrive as sent;
 * a request from a version without them (an empty body, as an old gmbctl
 * sends) reads as the first page at the default limit. */
START_TEST(request_snapshot_cursor_roundtrip) {
  struct wire_request in, out;
  memset(&in, 0, sizeof in);
  in.id = 11;
  in.kind = WIRE_ADMIN_SNAPSHOT;
  in.u.admin_snapshot.segment = UINT64_MAX;
  in.u.admin_snapshot.offset = UINT64_C(1) << 40;
  in.u.admin_snapshot.limit = UINT32_MAX;
  req_roundtrip(&in, &out);
  ck_assert_uint_eq(out.u.admin_snapshot.segment, UINT64_MAX);
  ck_assert_uint_eq(out.u.admin_snapshot.offset, UINT64_C(1) << 40);
  ck_assert_uint_eq(out.u.admin_snapshot.limit, UINT32_MAX);
  ck_assert_mem_eq(&out, &in, sizeof in);

  struct pb body = {.n = 0}, p = {.n = 0};
  pb_uint(&p, 1, 12);
  pb_sub(&p, 26, &body); /* AdminSnapshot {} */
  ck_assert_int_eq(gmb__wire_request_decode(p.b, p.n, &out), 0);
  ck_assert_int_eq(out.kind, WIRE_ADMIN_SNAPSHOT);
  ck_assert_uint_eq(out.u.admin_snapshot.segment, 0);
  ck_assert_uint_eq(out.u.admin_snapshot.offset, 0);
  ck_assert_uint_eq(out.u.admin_snapshot.limit, 0);
}
END_TEST

/* Pages of a snapshot: the first carries the status, a later one none
 * (and decodes without it); segments, ranges and the page's cursor, change
 * counter and limit arrive as sent. */
START_TEST(reply_snapshot_pages_roundtrip) {
  struct wire_range_info r0[2] = {
      {.offset = 0, .size = 4096, .id = UINT64_C(0x100000002), .session = 9,
       .movable = 1, .locked = 1},
      {.offset = 4096, .size = (2u << 20) - 4096}};
  struct wire_segment_info seg[2];
  memset(seg, 0, sizeof seg);
  seg[0] = (struct wire_segment_info){.id = 3, .size = 2u << 20, .used = 4096,
                                      .small = 1, .n_ranges = 2,
                                      .ranges = r0};
  strcpy(seg[0].tenant, "llm-a");
  seg[1] = (struct wire_segment_info){.id = 4, .size = 2u << 20,
                                      .used = 1u << 20, .small = 1};
  strcpy(seg[1].tenant, "llm-a"); /* no range in this page: all next page */
  struct wire_tenant_row row;
  memset(&row, 0, sizeof row);
  strcpy(row.name, "llm-a");
  struct wire_reply in, out;
  memset(&in, 0, sizeof in);
  in.id = 21;
  in.kind = WIRE_ADMIN_SNAPSHOT;
  in.u.snapshot.has_status = 1;
  strcpy(in.u.snapshot.status.device, "host:1GiB");
  in.u.snapshot.status.n_tenants = 1;
  in.u.snapshot.status.tenants = &row;
  in.u.snapshot.segments = seg;
  in.u.snapshot.n_segments = 2;
  in.u.snapshot.next_segment = 4;
  in.u.snapshot.next_offset = 512;
  in.u.snapshot.changes = UINT64_MAX;
  in.u.snapshot.limit = 3;
  rep_roundtrip(&in, &out);
  ck_assert_int_eq(out.u.snapshot.has_status, 1);
  ck_assert_str_eq(out.u.snapshot.status.device, "host:1GiB");
  ck_assert_uint_eq(out.u.snapshot.status.n_tenants, 1);
  ck_assert_uint_eq(out.u.snapshot.next_segment, 4);
  ck_assert_uint_eq(out.u.snapshot.next_offset, 512);
  ck_assert_uint_eq(out.u.snapshot.changes, UINT64_MAX);
  ck_assert_uint_eq(out.u.snapshot.limit, 3);
  ck_assert_uint_eq(out.u.snapshot.n_segments, 2);
  for (int i = 0; i < 2; i++) {
    const struct wire_segment_info *o = &out.u.snapshot.segments[i];
    ck_assert_uint_eq(o->id, seg[i].id);
    ck_assert_uint_eq(o->size, seg[i].size);
    ck_assert_uint_eq(o->used, seg[i].used);
    ck_assert_int_eq(o->small, 1);
    ck_assert_str_eq(o->tenant, "llm-a");
    ck_assert_uint_eq(o->n_ranges, seg[i].n_ranges);
  }
  ck_assert_mem_eq(out.u.snapshot.segments[0].ranges, r0, sizeof r0);
  ck_assert_ptr_null(out.u.snapshot.segments[1].ranges);
  gmb__wire_reply_clear(&out);

  /* The last page: no status, no next cursor. */
  in.u.snapshot.has_status = 0;
  in.u.snapshot.status.n_tenants = 0;
  in.u.snapshot.status.tenants = NULL;
  in.u.snapshot.next_segment = in.u.snapshot.next_offset = 0;
  in.u.snapshot.n_segments = 1;
  rep_roundtrip(&in, &out);
  ck_assert_int_eq(out.u.snapshot.has_status, 0);
  ck_assert_str_eq(out.u.snapshot.status.device, "");
  ck_assert_ptr_null(out.u.snapshot.status.tenants);
  ck_assert_uint_eq(out.u.snapshot.next_segment, 0);
  ck_assert_uint_eq(out.u.snapshot.n_segments, 1);
  ck_assert_uint_eq(out.u.snapshot.segments[0].n_ranges, 2);
  gmb__wire_reply_clear(&out);
  ck_assert_ptr_null(out.u.snapshot.segments);
}
END_TEST

START_TEST(reply_admin_status_no_rows) {
  struct wire_reply in, out;
  memset(&in, 0, sizeof in);
  in.id = 6;
  in.kind = WIRE_ADMIN_STATUS;
  strcpy(in.u.admin_status.device, "cuda:0");
  rep_roundtrip(&in, &out);
  ck_assert_uint_eq(out.u.admin_status.n_tenants, 0);
  ck_assert_ptr_null(out.u.admin_status.tenants);
  gmb__wire_reply_clear(&out);
}
END_TEST

/* Cached bytes per tenant and a row per session travel in the
 * admin status, in a snapshot's status too; every field survives. */
static void fill_sessions(struct wire_session_row *srows, size_t n) {
  memset(srows, 0, n * sizeof *srows);
  for (unsigned i = 0; i < n; i++) {
    srows[i].id = 100 + i;
    snprintf(srows[i].tenant, sizeof srows[i].tenant, "tenant-%u", i % 2);
    srows[i].uid = 1000 + i;
    srows[i].pid = i == 0 ? 0 : (int32_t)(4000 + i); /* 0: not visible */
    snprintf(srows[i].client, sizeof srows[i].client, "libgmb 0.%u", i);
    srows[i].allocations = i * 10 + 1;
    srows[i].used = (i + 1) * (UINT64_C(1) << 32);
    srows[i].cached = i * (UINT64_C(1) << 31);
    srows[i].trim_asks = i * 7 + 2;
    srows[i].trim_ignored = i;
    srows[i].waiting = i + 3;
    srows[i].fd_unread = 64 - i; /* the descriptor channel's figures */
    srows[i].fd_refused = UINT64_MAX - i;
  }
  memset(srows[n - 1].client, 'c', WIRE_DEVICE_MAX - 1); /* the longest */
}

START_TEST(reply_admin_status_sessions_roundtrip) {
  struct wire_tenant_row rows[2];
  struct wire_session_row srows[3];
  memset(rows, 0, sizeof rows);
  for (unsigned i = 0; i < 2; i++) {
    snprintf(rows[i].name, sizeof rows[i].name, "tenant-%u", i);
    rows[i].used = UINT64_C(9) << 32;
    rows[i].cached = (i + 1) * (UINT64_C(1) << 31);
    rows[i].trim_asks = UINT64_MAX - i;
    rows[i].trim_ignored = i + 1;
    rows[i].fd_unread = UINT64_MAX - i;
    rows[i].fd_kept = UINT32_MAX - i;
    rows[i].fd_refused = i + 5;
  }
  fill_sessions(srows, 3);
  struct wire_reply in, out;
  memset(&in, 0, sizeof in);
  in.kind = WIRE_ADMIN_STATUS;
  strcpy(in.u.admin_status.device, "host:64GiB");
  in.u.admin_status.sessions = 3;
  in.u.admin_status.cached = UINT64_C(3) << 31;
  in.u.admin_status.n_tenants = 2;
  in.u.admin_status.tenants = rows;
  in.u.admin_status.n_sessions = 3;
  in.u.admin_status.session_rows = srows;
  in.u.admin_status.fd_unread = UINT64_MAX;
  in.u.admin_status.fd_kept = UINT32_MAX;
  in.u.admin_status.fd_refused = UINT64_MAX - 1;
  rep_roundtrip(&in, &out);
  ck_assert_uint_eq(out.u.admin_status.cached, UINT64_C(3) << 31);
  ck_assert_uint_eq(out.u.admin_status.fd_unread, UINT64_MAX);
  ck_assert_uint_eq(out.u.admin_status.fd_kept, UINT32_MAX);
  ck_assert_uint_eq(out.u.admin_status.fd_refused, UINT64_MAX - 1);
  ck_assert_uint_eq(out.u.admin_status.n_tenants, 2);
  ck_assert_mem_eq(out.u.admin_status.tenants, rows, sizeof rows);
  ck_assert_uint_eq(out.u.admin_status.n_sessions, 3);
  ck_assert_ptr_ne(out.u.admin_status.session_rows, srows);
  for (unsigned i = 0; i < 3; i++) {
    const struct wire_session_row *r = &out.u.admin_status.session_rows[i];
    ck_assert_uint_eq(r->id, srows[i].id);
    ck_assert_str_eq(r->tenant, srows[i].tenant);
    ck_assert_str_eq(r->client, srows[i].client);
    ck_assert_int_eq(r->pid, srows[i].pid);
    ck_assert_uint_eq(r->used, srows[i].used);
    ck_assert_uint_eq(r->cached, srows[i].cached);
    ck_assert_uint_eq(r->trim_asks, srows[i].trim_asks);
    ck_assert_uint_eq(r->trim_ignored, srows[i].trim_ignored);
    ck_assert_uint_eq(r->fd_unread, srows[i].fd_unread);
    ck_assert_uint_eq(r->fd_refused, srows[i].fd_refused);
  }
  for (unsigned i = 0; i < 2; i++) {
    const struct wire_tenant_row *r = &out.u.admin_status.tenants[i];
    ck_assert_uint_eq(r->fd_unread, rows[i].fd_unread);
    ck_assert_uint_eq(r->fd_kept, rows[i].fd_kept);
    ck_assert_uint_eq(r->fd_refused, rows[i].fd_refused);
  }
  ck_assert_mem_eq(out.u.admin_status.session_rows, srows, sizeof srows);
  gmb__wire_reply_clear(&out);
  ck_assert_ptr_null(out.u.admin_status.session_rows);
  ck_assert_uint_eq(out.u.admin_status.n_sessions, 0);

  /* The snapshot's status (on its first page) is the same message. */
  memset(&in, 0, sizeof in);
  in.kind = WIRE_ADMIN_SNAPSHOT;
  in.u.snapshot.has_status = 1;
  strcpy(in.u.snapshot.status.device, "host:64GiB");
  in.u.snapshot.status.n_sessions = 3;
  in.u.snapshot.status.session_rows = srows;
  in.u.snapshot.status.cached = 5;
  rep_roundtrip(&in, &out);
  ck_assert_uint_eq(out.u.snapshot.status.cached, 5);
  ck_assert_uint_eq(out.u.snapshot.status.n_sessions, 3);
  ck_assert_mem_eq(out.u.snapshot.status.session_rows, srows, sizeof srows);
  gmb__wire_reply_clear(&out);
  ck_assert_ptr_null(out.u.snapshot.status.session_rows);
}
END_TEST

START_TEST(reply_encode_refuses_bad_session_rows) {
  struct wire_session_row srow;
  fill_sessions(&srow, 1);
  struct wire_reply in;
  uint8_t *buf = NULL;
  size_t len = 0;
  memset(&in, 0, sizeof in);
  in.kind = WIRE_ADMIN_STATUS;
  in.u.admin_status.n_sessions = 1;
  in.u.admin_status.session_rows = NULL; /* rows promised, none given */
  ck_assert_int_eq(gmb__wire_reply_encode(&in, &buf, &len), GMB_E_INVAL);
  in.u.admin_status.session_rows = &srow;
  memset(srow.client, 'c', sizeof srow.client); /* no NUL */
  ck_assert_int_eq(gmb__wire_reply_encode(&in, &buf, &len), GMB_E_INVAL);
  fill_sessions(&srow, 1);
  memset(srow.tenant, 't', sizeof srow.tenant);
  ck_assert_int_eq(gmb__wire_reply_encode(&in, &buf, &len), GMB_E_INVAL);
  ck_assert_ptr_null(buf);
  fill_sessions(&srow, 1);
  ck_assert_int_eq(gmb__wire_reply_encode(&in, &buf, &len), 0);
  free(buf);
}
END_TEST

START_TEST(reply_encode_refuses) {
  struct wire_reply in;
  uint8_t *buf = NULL;
  size_t len = 0;
  memset(&in, 0, sizeof in);
  in.status = 1; /* codes are negative */
  ck_assert_int_eq(gmb__wire_reply_encode(&in, &buf, &len), GMB_E_INVAL);
  in.status = GMB_E_SYSTEM - 1; /* not in GMB_ERRORS */
  ck_assert_int_eq(gmb__wire_reply_encode(&in, &buf, &len), GMB_E_INVAL);
  in.status = 0;
  in.kind = (enum wire_kind)99;
  ck_assert_int_eq(gmb__wire_reply_encode(&in, &buf, &len), GMB_E_INVAL);
  /* A secret longer than its array would read past it. */
  in.kind = WIRE_HELLO;
  in.u.hello.fd_secret_len = WIRE_SECRET_MAX + 1;
  ck_assert_int_eq(gmb__wire_reply_encode(&in, &buf, &len), GMB_E_INVAL);
  in.u.hello.fd_secret_len = UINT32_MAX;
  ck_assert_int_eq(gmb__wire_reply_encode(&in, &buf, &len), GMB_E_INVAL);
  /* Strings that fill their arrays with no NUL. */
  memset(&in.u, 0, sizeof in.u);
  memset(in.message, 'm', sizeof in.message);
  ck_assert_int_eq(gmb__wire_reply_encode(&in, &buf, &len), GMB_E_INVAL);
  in.message[0] = '\0';
  in.kind = WIRE_HELLO;
  memset(in.u.hello.device, 'd', sizeof in.u.hello.device);
  ck_assert_int_eq(gmb__wire_reply_encode(&in, &buf, &len), GMB_E_INVAL);
  struct wire_tenant_row row;
  memset(&row, 'r', sizeof row);
  memset(&in.u, 0, sizeof in.u);
  in.kind = WIRE_ADMIN_STATUS;
  in.u.admin_status.n_tenants = 1;
  in.u.admin_status.tenants = &row;
  ck_assert_int_eq(gmb__wire_reply_encode(&in, &buf, &len), GMB_E_INVAL);
  in.u.admin_status.tenants = NULL; /* rows promised, none given */
  ck_assert_int_eq(gmb__wire_reply_encode(&in, &buf, &len), GMB_E_INVAL);
  ck_assert_ptr_null(buf);
}
END_TEST

/* ---- the Status enum is the GMB_ERRORS list ------------------------------ */

START_TEST(status_enum_matches_errors) {
  size_t n = 0;
  ck_assert_int_eq(gmb__wire_status_value("GMB_OK"), 0);
#define WIRE_TEST_STATUS_(name, code, text)                             \
  ck_assert_int_eq(gmb__wire_status_value("GMB_E_" #name), code);       \
  ck_assert_int_eq(GMB_E_##name, -(code));                              \
  n++;
  GMB_ERRORS(WIRE_TEST_STATUS_)
#undef WIRE_TEST_STATUS_
  /* A Status the C list lacks would pass the loop above: count them. */
  ck_assert_uint_eq(gmb__wire_status_count(), n + 1);
  ck_assert_int_eq(gmb__wire_status_value("GMB_E_NOSUCH"), INT32_MIN);
  ck_assert_int_eq(gmb__wire_status_value(""), INT32_MIN);
}
END_TEST

START_TEST(status_unknown_from_wire_is_proto) {
  struct wire_reply out;
  struct pb p = {.n = 0};
  pb_uint(&p, 1, 7);   /* id */
  pb_uint(&p, 2, 99);  /* status: from a newer broker */
  pb_bytes(&p, 3, "why", 3);
  ck_assert_int_eq(gmb__wire_reply_decode(p.b, p.n, &out), 0);
  ck_assert_uint_eq(out.id, 7);
  ck_assert_int_eq(out.status, GMB_E_PROTO);
  ck_assert_str_eq(out.message, "why");

  /* The first code past the list, exactly. */
  p.n = 0;
  pb_uint(&p, 2, gmb__wire_status_count());
  ck_assert_int_eq(gmb__wire_reply_decode(p.b, p.n, &out), 0);
  ck_assert_int_eq(out.status, GMB_E_PROTO);

  /* A negative enum value: ten bytes of varint. */
  p.n = 0;
  pb_uint(&p, 2, UINT64_MAX);
  ck_assert_int_eq(gmb__wire_reply_decode(p.b, p.n, &out), 0);
  ck_assert_int_eq(out.status, GMB_E_PROTO);
}
END_TEST

/* ---- hostile input ------------------------------------------------------- */

/* What a successful decode must promise whatever the input was. */
static void req_sane(const struct wire_request *r) {
  ck_assert_int_ge(r->kind, WIRE_HELLO);
  ck_assert_int_lt(r->kind, WIRE_KIND_COUNT);
  /* Kinds only replies have never come out of a request. */
  ck_assert_int_ne(r->kind, WIRE_EVENT);
  ck_assert_int_ne(r->kind, WIRE_NOMEM);
  ck_assert_int_ne(r->kind, WIRE_TENANT_ROW);
  if (r->kind == WIRE_HELLO) {
    ck_assert_uint_lt(strnlen(r->u.hello.tenant, sizeof r->u.hello.tenant),
                      sizeof r->u.hello.tenant);
    ck_assert_uint_lt(strnlen(r->u.hello.client, sizeof r->u.hello.client),
                      sizeof r->u.hello.client);
    ck_assert_uint_le(r->u.hello.token_len, WIRE_TOKEN_MAX);
  }
}

static void rep_sane(const struct wire_reply *r) {
  ck_assert_int_le(r->status, 0);
  ck_assert_int_ge(r->status, GMB_E_SYSTEM);
  ck_assert_uint_lt(strnlen(r->message, sizeof r->message), sizeof r->message);
  switch (r->kind) {
    case WIRE_HELLO:
      ck_assert_uint_le(r->u.hello.fd_secret_len, WIRE_SECRET_MAX);
      break;
    case WIRE_ADMIN_STATUS:
      ck_assert(r->u.admin_status.n_tenants == 0 ||
                r->u.admin_status.tenants != NULL);
      for (size_t i = 0; i < r->u.admin_status.n_tenants; i++)
        ck_assert_uint_lt(strnlen(r->u.admin_status.tenants[i].name,
                                  WIRE_NAME_MAX + 1),
                          WIRE_NAME_MAX + 1);
      break;
    default:
      break;
  }
}

static int decode_req_any(const uint8_t *b, size_t n) {
  struct wire_request r;
  int rc = gmb__wire_request_decode(b, n, &r);
  ck_assert(rc == 0 || rc == GMB_E_PROTO);
  if (rc == 0) req_sane(&r);
  return rc;
}

static int decode_rep_any(const uint8_t *b, size_t n) {
  struct wire_reply r;
  int rc = gmb__wire_reply_decode(b, n, &r);
  ck_assert(rc == 0 || rc == GMB_E_PROTO);
  if (rc == 0) rep_sane(&r);
  gmb__wire_reply_clear(&r);
  return rc;
}

START_TEST(decode_empty_buffer) {
  static const uint8_t none[1] = {0};
  struct wire_request r;
  /* An empty Request has no body. */
  ck_assert_int_eq(gmb__wire_request_decode(none, 0, &r), GMB_E_PROTO);
  /* An empty Reply is a valid one: id 0, GMB_OK, no body. */
  struct wire_reply rep;
  ck_assert_int_eq(gmb__wire_reply_decode(none, 0, &rep), 0);
  ck_assert_uint_eq(rep.id, 0);
  ck_assert_int_eq(rep.status, GMB_OK);
  ck_assert_int_eq(rep.kind, WIRE_NONE);
}
END_TEST

START_TEST(decode_request_without_body) {
  struct wire_request r;
  struct pb p = {.n = 0};
  pb_uint(&p, 1, 42); /* an id and nothing else */
  ck_assert_int_eq(gmb__wire_request_decode(p.b, p.n, &r), GMB_E_PROTO);
  /* A body this version does not know is no body either. */
  pb_bytes(&p, 99, "", 0);
  ck_assert_int_eq(gmb__wire_request_decode(p.b, p.n, &r), GMB_E_PROTO);
  /* ...but an unknown field beside a known body is ignored. */
  struct pb free_body = {.n = 0};
  pb_uint(&free_body, 1, 5);
  pb_sub(&p, 4, &free_body);
  ck_assert_int_eq(gmb__wire_request_decode(p.b, p.n, &r), 0);
  ck_assert_int_eq(r.kind, WIRE_FREE);
  ck_assert_uint_eq(r.u.free.id, 5);
}
END_TEST

static int hello_with(const char *tenant, size_t token_len,
                      struct wire_request *r) {
  struct pb hello = {.n = 0}, p = {.n = 0};
  uint8_t token[WIRE_TOKEN_MAX + 8];
  memset(token, 0xab, sizeof token);
  ck_assert_uint_le(token_len, sizeof token);
  pb_uint(&hello, 1, WIRE_PROTOCOL_VERSION);
  pb_bytes(&hello, 2, tenant, strlen(tenant));
  if (token_len) pb_bytes(&hello, 3, token, token_len);
  pb_uint(&p, 1, 1);
  pb_sub(&p, 2, &hello);
  return gmb__wire_request_decode(p.b, p.n, r);
}

START_TEST(decode_tenant_name_64_refused) {
  struct wire_request r;
  char *name = str_of(WIRE_NAME_MAX);
  ck_assert_int_eq(hello_with(name, 0, &r), 0);
  ck_assert_str_eq(r.u.hello.tenant, name);
  free(name);
  name = str_of(WIRE_NAME_MAX + 1);
  ck_assert_int_eq(hello_with(name, 0, &r), GMB_E_PROTO);
  free(name);
  name = str_of(1000);
  ck_assert_int_eq(hello_with(name, 0, &r), GMB_E_PROTO);
  free(name);
}
END_TEST

/* A NUL inside a name was read as a shorter name
 * ("alice\0x" became "alice").  Names are bytes on the wire: refused. */
START_TEST(decode_nul_in_names_refused) {
  struct pb hello = {.n = 0}, p = {.n = 0};
  pb_uint(&hello, 1, WIRE_PROTOCOL_VERSION);
  pb_bytes(&hello, 2, "alice\0x", 7);
  pb_uint(&p, 1, 1);
  pb_sub(&p, 2, &hello);
  struct wire_request r;
  ck_assert_int_eq(gmb__wire_request_decode(p.b, p.n, &r), GMB_E_PROTO);
  /* In the client's free text too. */
  struct pb h2 = {.n = 0}, p2 = {.n = 0};
  pb_uint(&h2, 1, WIRE_PROTOCOL_VERSION);
  pb_bytes(&h2, 2, "alice", 5);
  pb_bytes(&h2, 5, "lib\0gmb", 7);
  pb_uint(&p2, 1, 1);
  pb_sub(&p2, 2, &h2);
  ck_assert_int_eq(gmb__wire_request_decode(p2.b, p2.n, &r), GMB_E_PROTO);
  /* The same names without the NUL decode, as strings did. */
  ck_assert_int_eq(hello_with("alice", 0, &r), 0);
  ck_assert_str_eq(r.u.hello.tenant, "alice");
}
END_TEST

/* A SleepNote's tag: 63 bytes decode, 64 bytes or a NUL inside do not
 * (GMB_E_PROTO before the broker sees it); huge figures pass the codec as
 * sent (the broker bounds them, check_sleep note_claims_bounded). */
START_TEST(decode_sleep_note_tag_bounds) {
  char *tag = str_of(WIRE_TAG_MAX + 1);
  struct wire_request r;
  for (size_t len = WIRE_TAG_MAX; len <= WIRE_TAG_MAX + 1; len++) {
    struct pb sn = {.n = 0}, p = {.n = 0};
    pb_bytes(&sn, 1, tag, len);
    pb_uint(&sn, 2, 1);
    pb_uint(&sn, 4, UINT64_MAX);
    pb_uint(&p, 1, 1);
    pb_sub(&p, 30, &sn);
    int rc = gmb__wire_request_decode(p.b, p.n, &r);
    if (len == WIRE_TAG_MAX) {
      ck_assert_int_eq(rc, 0);
      ck_assert_uint_eq(strlen(r.u.sleep_note.tag), WIRE_TAG_MAX);
      ck_assert_uint_eq(r.u.sleep_note.host_bytes, UINT64_MAX);
    } else {
      ck_assert_int_eq(rc, GMB_E_PROTO);
    }
  }
  free(tag);
  struct pb sn = {.n = 0}, p = {.n = 0};
  pb_bytes(&sn, 1, "w\0x", 3);
  pb_uint(&p, 1, 1);
  pb_sub(&p, 30, &sn);
  ck_assert_int_eq(gmb__wire_request_decode(p.b, p.n, &r), GMB_E_PROTO);
}
END_TEST

START_TEST(decode_token_257_refused) {
  struct wire_request r;
  ck_assert_int_eq(hello_with("t", WIRE_TOKEN_MAX, &r), 0);
  ck_assert_uint_eq(r.u.hello.token_len, WIRE_TOKEN_MAX);
  ck_assert_uint_eq(r.u.hello.token[WIRE_TOKEN_MAX - 1], 0xab);
  ck_assert_int_eq(hello_with("t", WIRE_TOKEN_MAX + 1, &r), GMB_E_PROTO);
}
END_TEST

/* A HelloReply whose fd_secret (field 8) is secret_len bytes. */
static int hello_reply_with(size_t secret_len) {
  uint8_t sec[WIRE_SECRET_MAX + 8];
  struct pb hello = {.n = 0}, p = {.n = 0};
  struct wire_reply r;
  memset(sec, 0x5a, sizeof sec);
  ck_assert_uint_le(secret_len, sizeof sec);
  pb_uint(&hello, 1, WIRE_PROTOCOL_VERSION);
  pb_uint(&hello, 2, 42);
  pb_uint(&hello, 7, 64);
  pb_bytes(&hello, 8, sec, secret_len);
  pb_uint(&p, 1, 11);
  pb_sub(&p, 4, &hello);
  int rc = gmb__wire_reply_decode(p.b, p.n, &r);
  if (rc == 0) {
    ck_assert_int_eq(r.kind, WIRE_HELLO);
    ck_assert_uint_eq(r.u.hello.session, 42);
    ck_assert_uint_eq(r.u.hello.lock_slots, 64);
    ck_assert_uint_eq(r.u.hello.fd_secret_len, secret_len);
    ck_assert_mem_eq(r.u.hello.fd_secret, sec, secret_len);
  }
  gmb__wire_reply_clear(&r);
  return rc;
}

START_TEST(decode_secret_33_refused) {
  ck_assert_int_eq(hello_reply_with(0), 0);
  ck_assert_int_eq(hello_reply_with(1), 0);
  ck_assert_int_eq(hello_reply_with(WIRE_SECRET_MAX), 0);
  ck_assert_int_eq(hello_reply_with(WIRE_SECRET_MAX + 1), GMB_E_PROTO);
  ck_assert_int_eq(hello_reply_with(WIRE_SECRET_MAX + 8), GMB_E_PROTO);
}
END_TEST

/* What version 1 sent is gone from version 2: a Segment request (Request
 * field 6) is a request without a body; a SegmentHandle reply (Reply field
 * 7), an Alloc reply's handle (AllocReply field 5) and a Hello reply's shm
 * name (HelloReply field 6) are unknown fields, ignored. */
START_TEST(decode_version_1_messages) {
  struct wire_request q;
  struct pb seg = {.n = 0}, p = {.n = 0};
  pb_uint(&seg, 1, 3);
  pb_uint(&p, 1, 9);
  pb_sub(&p, 6, &seg);
  ck_assert_int_eq(gmb__wire_request_decode(p.b, p.n, &q), GMB_E_PROTO);

  struct pb sh = {.n = 0}, alloc = {.n = 0}, hello = {.n = 0};
  pb_uint(&sh, 1, 3);
  pb_uint(&sh, 2, 2 << 20);
  pb_bytes(&sh, 3, "/gmb-1-3", 8);
  struct wire_reply r;
  p.n = 0;
  pb_uint(&p, 1, 11);
  pb_sub(&p, 7, &sh);
  ck_assert_int_eq(gmb__wire_reply_decode(p.b, p.n, &r), 0);
  ck_assert_uint_eq(r.id, 11);
  ck_assert_int_eq(r.kind, WIRE_NONE);

  pb_uint(&alloc, 1, 99);
  pb_uint(&alloc, 3, 3);
  pb_sub(&alloc, 5, &sh);
  p.n = 0;
  pb_uint(&p, 1, 12);
  pb_sub(&p, 5, &alloc);
  ck_assert_int_eq(gmb__wire_reply_decode(p.b, p.n, &r), 0);
  ck_assert_int_eq(r.kind, WIRE_ALLOC);
  ck_assert_uint_eq(r.u.alloc.id, 99);
  ck_assert_uint_eq(r.u.alloc.segment, 3);

  pb_uint(&hello, 1, 1);
  pb_bytes(&hello, 6, "/gmb-lt-1-1", 11);
  pb_uint(&hello, 7, 8);
  p.n = 0;
  pb_uint(&p, 1, 13);
  pb_sub(&p, 4, &hello);
  ck_assert_int_eq(gmb__wire_reply_decode(p.b, p.n, &r), 0);
  ck_assert_int_eq(r.kind, WIRE_HELLO);
  ck_assert_uint_eq(r.u.hello.version, 1);
  ck_assert_uint_eq(r.u.hello.lock_slots, 8);
  ck_assert_uint_eq(r.u.hello.fd_secret_len, 0);
}
END_TEST

/* A session row whose client name is too long, after good ones: refused,
 * and what was copied is freed (ASan). */
START_TEST(decode_session_row_client_too_long_frees_rows) {
  struct pb as = {.n = 0}, p = {.n = 0};
  char *longname = str_of(WIRE_DEVICE_MAX);
  pb_bytes(&as, 1, "host:1GiB", 9);
  for (int i = 0; i < 3; i++) {
    struct pb row = {.n = 0};
    const char *client = i == 2 ? longname : "ok";
    pb_uint(&row, 1, (uint64_t)i + 1);
    pb_bytes(&row, 2, "t", 1);
    pb_bytes(&row, 5, client, strlen(client));
    pb_sub(&as, 12, &row);
  }
  pb_uint(&p, 1, 1);
  pb_sub(&p, 20, &as);
  struct wire_reply r;
  ck_assert_int_eq(gmb__wire_reply_decode(p.b, p.n, &r), GMB_E_PROTO);
  ck_assert_ptr_null(r.u.admin_status.session_rows);
  free(longname);
}
END_TEST

/* A bad row after good ones: the rows already copied must be freed (ASan). */
START_TEST(decode_admin_row_name_too_long_frees_rows) {
  struct pb as = {.n = 0}, p = {.n = 0};
  char *longname = str_of(WIRE_NAME_MAX + 1);
  pb_bytes(&as, 1, "host:1GiB", 9);
  for (int i = 0; i < 3; i++) {
    struct pb row = {.n = 0};
    const char *name = i == 2 ? longname : "ok";
    pb_bytes(&row, 1, name, strlen(name));
    pb_uint(&row, 2, 1);
    pb_sub(&as, 6, &row);
  }
  pb_uint(&p, 1, 1);
  pb_sub(&p, 20, &as);
  struct wire_reply r;
  ck_assert_int_eq(gmb__wire_reply_decode(p.b, p.n, &r), GMB_E_PROTO);
  ck_assert_ptr_null(r.u.admin_status.tenants);
  free(longname);
}
END_TEST

START_TEST(decode_long_message_is_cut) {
  struct pb p = {.n = 0};
  struct wire_reply r;
  char *msg = str_of(2000);
  pb_uint(&p, 2, 2);
  pb_bytes(&p, 3, msg, 2000);
  ck_assert_int_eq(gmb__wire_reply_decode(p.b, p.n, &r), 0);
  ck_assert_int_eq(r.status, GMB_E_QUOTA);
  ck_assert_uint_eq(strlen(r.message), WIRE_MESSAGE_MAX - 1);
  free(msg);
}
END_TEST

START_TEST(decode_truncated_messages) {
  /* A full Hello request and a full admin-status reply, cut at every
   * length: each prefix is refused or decodes to something sane. */
  struct wire_request req;
  memset(&req, 0, sizeof req);
  req.id = 0x0123456789abcdefu;
  req.kind = WIRE_HELLO;
  strcpy(req.u.hello.tenant, "llm-a");
  req.u.hello.token_len = 40;
  memset(req.u.hello.token, 0xee, 40);
  strcpy(req.u.hello.client, "libgmb 0.1.0");
  uint8_t *buf;
  size_t len;
  ck_assert_int_eq(gmb__wire_request_encode(&req, &buf, &len), 0);
  size_t refused = 0;
  for (size_t n = 0; n < len; n++) refused += decode_req_any(buf, n) != 0;
  ck_assert_int_eq(decode_req_any(buf, len), 0);
  ck_assert_uint_gt(refused, len / 2);
  free(buf);

  struct wire_tenant_row rows[4];
  memset(rows, 0, sizeof rows);
  for (int i = 0; i < 4; i++) {
    snprintf(rows[i].name, sizeof rows[i].name, "tenant-%d", i);
    rows[i].quota = UINT64_MAX - (uint64_t)i;
  }
  struct wire_reply rep;
  memset(&rep, 0, sizeof rep);
  rep.id = 99;
  rep.kind = WIRE_ADMIN_STATUS;
  strcpy(rep.message, "all well");
  strcpy(rep.u.admin_status.device, "host:8GiB");
  rep.u.admin_status.n_tenants = 4;
  rep.u.admin_status.tenants = rows;
  ck_assert_int_eq(gmb__wire_reply_encode(&rep, &buf, &len), 0);
  refused = 0;
  for (size_t n = 0; n < len; n++) refused += decode_rep_any(buf, n) != 0;
  ck_assert_int_eq(decode_rep_any(buf, len), 0);
  ck_assert_uint_gt(refused, 0);
  free(buf);
}
END_TEST

/* xorshift64*: the same bytes on every run and machine. */
static uint64_t rnd_next(uint64_t *s) {
  *s ^= *s >> 12;
  *s ^= *s << 25;
  *s ^= *s >> 27;
  return *s * UINT64_C(2685821657736338717);
}

static unsigned long env_ulong(const char *name, unsigned long dflt) {
  const char *v = getenv(name);
  return v && *v ? strtoul(v, NULL, 10) : dflt;
}

START_TEST(decode_random_bytes) {
  uint64_t seed = UINT64_C(0x9e3779b97f4a7c15);
  unsigned long iter = env_ulong("ITER", 20000);
  uint8_t b[256];
  for (unsigned long i = 0; i < iter; i++) {
    size_t n = rnd_next(&seed) % sizeof b;
    for (size_t k = 0; k < n; k++) b[k] = (uint8_t)rnd_next(&seed);
    decode_req_any(b, n);
    decode_rep_any(b, n);
  }
}
END_TEST

/* Random bytes rarely parse; mutate valid messages instead, so that the
 * decoders' copying code runs on odd but well-formed input. */
START_TEST(decode_mutated_messages) {
  uint64_t seed = 12345;
  unsigned long iter = env_ulong("ITER", 20000);
  struct wire_tenant_row rows[2] = {{.name = "a", .quota = 1},
                                    {.name = "b", .used = 2}};
  struct wire_reply rep;
  memset(&rep, 0, sizeof rep);
  rep.id = 5;
  rep.status = GMB_E_NOMEM;
  rep.kind = WIRE_ADMIN_STATUS;
  rep.u.admin_status.n_tenants = 2;
  rep.u.admin_status.tenants = rows;
  uint8_t *rbuf;
  size_t rlen;
  ck_assert_int_eq(gmb__wire_reply_encode(&rep, &rbuf, &rlen), 0);
  struct wire_request req;
  memset(&req, 0, sizeof req);
  req.id = 6;
  req.kind = WIRE_HELLO;
  strcpy(req.u.hello.tenant, "tenant");
  req.u.hello.token_len = 8;
  uint8_t *qbuf;
  size_t qlen;
  ck_assert_int_eq(gmb__wire_request_encode(&req, &qbuf, &qlen), 0);
  /* A Hello reply with its secret: a length byte mutated may claim more
   * bytes than fd_secret holds. */
  struct wire_reply hrep;
  memset(&hrep, 0, sizeof hrep);
  hrep.id = 7;
  hrep.kind = WIRE_HELLO;
  hrep.u.hello.version = WIRE_PROTOCOL_VERSION;
  hrep.u.hello.session = 3;
  strcpy(hrep.u.hello.tenant, "t");
  strcpy(hrep.u.hello.device, "host");
  hrep.u.hello.lock_slots = 64;
  hrep.u.hello.fd_secret_len = WIRE_SECRET_MAX;
  memset(hrep.u.hello.fd_secret, 0xcd, WIRE_SECRET_MAX);
  uint8_t *hbuf;
  size_t hlen;
  ck_assert_int_eq(gmb__wire_reply_encode(&hrep, &hbuf, &hlen), 0);
  uint8_t b[256];
  ck_assert_uint_le(rlen, sizeof b);
  ck_assert_uint_le(qlen, sizeof b);
  ck_assert_uint_le(hlen, sizeof b);
  for (unsigned long i = 0; i < iter; i++) {
    memcpy(b, rbuf, rlen);
    for (int k = 0; k < 3; k++)
      b[rnd_next(&seed) % rlen] = (uint8_t)rnd_next(&seed);
    decode_rep_any(b, rlen);
    memcpy(b, qbuf, qlen);
    for (int k = 0; k < 3; k++)
      b[rnd_next(&seed) % qlen] = (uint8_t)rnd_next(&seed);
    decode_req_any(b, qlen);
    memcpy(b, hbuf, hlen);
    for (int k = 0; k < 3; k++)
      b[rnd_next(&seed) % hlen] = (uint8_t)rnd_next(&seed);
    decode_rep_any(b, hlen);
  }
  free(rbuf);
  free(qbuf);
  free(hbuf);
}
END_TEST

START_TEST(reply_clear_on_other_kinds_is_noop) {
  struct wire_reply r;
  memset(&r, 0, sizeof r);
  r.kind = WIRE_STATS;
  r.u.stats.used = 5;
  gmb__wire_reply_clear(&r);
  ck_assert_uint_eq(r.u.stats.used, 5);
}
END_TEST

START_TEST(kind_names) {
  for (int k = WIRE_NONE; k < WIRE_KIND_COUNT; k++) {
    const char *n = gmb__wire_kind_name((enum wire_kind)k);
    ck_assert_ptr_nonnull(n);
    ck_assert_str_ne(n, "unknown");
    for (int j = WIRE_NONE; j < k; j++)
      ck_assert_str_ne(n, gmb__wire_kind_name((enum wire_kind)j));
  }
  ck_assert_str_eq(gmb__wire_kind_name(WIRE_ALLOC), "alloc");
  ck_assert_str_eq(gmb__wire_kind_name((enum wire_kind)1000), "unknown");
}
END_TEST

/* ---- proto/error.c ------------------------------------------------------ */

START_TEST(error_names_and_texts) {
  ck_assert_str_eq(gmb_err_name(GMB_OK), "GMB_OK");
  ck_assert_str_eq(gmb_strerror(GMB_OK), "success");
#define WIRE_TEST_ERR_(name, code, text)                       \
  ck_assert_str_eq(gmb_err_name(GMB_E_##name), "GMB_E_" #name); \
  ck_assert_str_eq(gmb_strerror(GMB_E_##name), text);
  GMB_ERRORS(WIRE_TEST_ERR_)
#undef WIRE_TEST_ERR_
  ck_assert_str_eq(gmb_err_name(GMB_E_QUOTA), "GMB_E_QUOTA");
}
END_TEST

START_TEST(error_unknown_code) {
  static const int bad[] = {1, 12, GMB_E_SYSTEM - 1, -1000, INT_MIN, INT_MAX};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    ck_assert_str_eq(gmb_err_name(bad[i]), "GMB_E_UNKNOWN");
    ck_assert_str_eq(gmb_strerror(bad[i]), "unknown error");
  }
}
END_TEST

START_TEST(version_string) {
  ck_assert_str_eq(gmb_version(), GMB_VERSION_STRING);
}
END_TEST

static Suite *wire_suite(void) {
  Suite *s = suite_create("wire");
  TCase *tc = tcase_create("roundtrip");
  tcase_add_test(tc, request_hello_roundtrip);
  tcase_add_test(tc, request_hello_empty_fields);
  tcase_add_test(tc, request_alloc_roundtrip);
  tcase_add_test(tc, request_free_segment_closed_roundtrip);
  tcase_add_test(tc, request_tenant_add_host_quota_roundtrip);
  tcase_add_test(tc, request_empty_bodies_roundtrip);
  tcase_add_test(tc, request_encode_refuses);
  tcase_add_test(tc, reply_status_only_every_code);
  tcase_add_test(tc, reply_hello_roundtrip);
  tcase_add_test(tc, protocol_version_2);
  tcase_add_test(tc, reply_alloc_roundtrip);
  tcase_add_test(tc, reply_stats_roundtrip);
  tcase_add_test(tc, reply_event_roundtrip);
  tcase_add_test(tc, cache_fields_roundtrip);
  tcase_add_test(tc, trim_answer_and_asked_back_roundtrip);
  tcase_add_test(tc, pages_roundtrip);
  tcase_add_test(tc, reply_admin_status_rows_roundtrip);
  tcase_add_test(tc, reply_admin_status_no_rows);
  tcase_add_test(tc, reply_admin_status_sessions_roundtrip);
  tcase_add_test(tc, reply_encode_refuses_bad_session_rows);
  tcase_add_test(tc, request_snapshot_cursor_roundtrip);
  tcase_add_test(tc, reply_snapshot_pages_roundtrip);
  tcase_add_test(tc, reply_encode_refuses);
  tcase_add_test(tc, reply_clear_on_other_kinds_is_noop);
  tcase_add_test(tc, kind_names);
  suite_add_tcase(s, tc);

  tc = tcase_create("status");
  tcase_add_test(tc, status_enum_matches_errors);
  tcase_add_test(tc, status_unknown_from_wire_is_proto);
  tcase_add_test(tc, error_names_and_texts);
  tcase_add_test(tc, error_unknown_code);
  tcase_add_test(tc, version_string);
  suite_add_tcase(s, tc);

  tc = tcase_create("hostile");
  tcase_add_test(tc, decode_empty_buffer);
  tcase_add_test(tc, decode_request_without_body);
  tcase_add_test(tc, decode_tenant_name_64_refused);
  tcase_add_test(tc, decode_nul_in_names_refused);
  tcase_add_test(tc, decode_sleep_note_tag_bounds);
  tcase_add_test(tc, decode_token_257_refused);
  tcase_add_test(tc, decode_secret_33_refused);
  tcase_add_test(tc, decode_version_1_messages);
  tcase_add_test(tc, decode_admin_row_name_too_long_frees_rows);
  tcase_add_test(tc, decode_session_row_client_too_long_frees_rows);
  tcase_add_test(tc, decode_long_message_is_cut);
  tcase_add_test(tc, decode_truncated_messages);
  tcase_add_test(tc, decode_random_bytes);
  tcase_add_test(tc, decode_mutated_messages);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) { return check_run(wire_suite()); }
