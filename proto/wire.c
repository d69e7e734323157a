/*
 * wire.c - encodes and decodes gmb's messages with protobuf-c.
 *
 * This is the only file that sees the generated Gmb__* types.  Encoding
 * builds the protobuf structs on the stack, pointing into the caller's
 * plain struct, so no field is copied twice.  Decoding unpacks with
 * protobuf-c (which checks the wire format), then copies into the plain
 * struct with bounds checks; anything that does not fit is GMB_E_PROTO.
 */
#include "wire.h"

#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "gmb.h"
#include "gmb.pb-c.h"

/* Copies a protobuf string into a fixed field; refuses one that is too long
 * or holds a NUL (protobuf strings may). */
static int wire_str_copy(char *dst, size_t cap, const char *src) {
  if (src == NULL) {
    dst[0] = '\0';
    return 0;
  }
  size_t n = strnlen(src, cap);
  if (n >= cap) return GMB_E_PROTO;
  memcpy(dst, src, n + 1);
  return 0;
}

/* A name sent as bytes (gmb.proto): it must fit `cap` with its NUL and
 * hold no NUL of its own, or a longer name would pass for a shorter one. */
static int wire_name_copy(char *dst, size_t cap, ProtobufCBinaryData src) {
  if (src.len == 0 || src.data == NULL) {
    dst[0] = '\0';
    return 0;
  }
  if (src.len >= cap || memchr(src.data, '\0', src.len) != NULL)
    return GMB_E_PROTO;
  memcpy(dst, src.data, src.len);
  dst[src.len] = '\0';
  return 0;
}

static ProtobufCBinaryData wire_name(const char *s) {
  ProtobufCBinaryData b;
  b.data = (uint8_t *)s;
  b.len = strlen(s);
  return b;
}

/* A fixed string field the caller filled must end inside its array, or
 * strlen() in the packer would read past it. */
#define WIRE_FITS(field) (strnlen((field), sizeof(field)) < sizeof(field))

static int wire_pack(const ProtobufCMessage *m, uint8_t **buf, size_t *len) {
  size_t n = protobuf_c_message_get_packed_size(m);
  uint8_t *b = malloc(n ? n : 1);
  if (b == NULL) return GMB_E_SYSTEM;
  protobuf_c_message_pack(m, b);
  *buf = b;
  *len = n;
  return 0;
}

int gmb__wire_request_encode(const struct wire_request *req, uint8_t **buf,
                             size_t *len) {
  Gmb__Request r = GMB__REQUEST__INIT;
  Gmb__Hello hello = GMB__HELLO__INIT;
  Gmb__Alloc alloc = GMB__ALLOC__INIT;
  Gmb__Free fr = GMB__FREE__INIT;
  Gmb__Stats stats = GMB__STATS__INIT;
  Gmb__Heartbeat hb = GMB__HEARTBEAT__INIT;
  Gmb__Bye bye = GMB__BYE__INIT;
  Gmb__SegmentClosed sc = GMB__SEGMENT_CLOSED__INIT;
  Gmb__Vmm vmm = GMB__VMM__INIT;
  Gmb__Lock lk = GMB__LOCK__INIT;
  Gmb__AdminStatus as = GMB__ADMIN_STATUS__INIT;
  Gmb__AdminCompact ac = GMB__ADMIN_COMPACT__INIT;
  Gmb__AdminLimit al = GMB__ADMIN_LIMIT__INIT;
  Gmb__AdminEvict ae = GMB__ADMIN_EVICT__INIT;
  Gmb__AdminReload ar = GMB__ADMIN_RELOAD__INIT;
  Gmb__AdminSnapshot asn = GMB__ADMIN_SNAPSHOT__INIT;
  Gmb__AdminMetrics am = GMB__ADMIN_METRICS__INIT;
  Gmb__AdminTenantAdd ata = GMB__ADMIN_TENANT_ADD__INIT;
  Gmb__AdminTenantRemove atr = GMB__ADMIN_TENANT_REMOVE__INIT;
  Gmb__SleepNote sn = GMB__SLEEP_NOTE__INIT;
  Gmb__AdminPause ap = GMB__ADMIN_PAUSE__INIT;

  r.id = req->id;
  switch (req->kind) {
    case WIRE_HELLO:
      if (req->u.hello.token_len > WIRE_TOKEN_MAX ||
          !WIRE_FITS(req->u.hello.tenant) || !WIRE_FITS(req->u.hello.client))
        return GMB_E_INVAL;
      hello.version = req->u.hello.version;
      hello.tenant = wire_name(req->u.hello.tenant);
      hello.token.data = (uint8_t *)req->u.hello.token;
      hello.token.len = req->u.hello.token_len;
      hello.pid = req->u.hello.pid;
      hello.client = wire_name(req->u.hello.client);
      r.body_case = GMB__REQUEST__BODY_HELLO;
      r.hello = &hello;
      break;
    case WIRE_ALLOC:
      alloc.size = req->u.alloc.size;
      alloc.flags = req->u.alloc.flags;
      alloc.timeout_ms = req->u.alloc.timeout_ms;
      alloc.pages = req->u.alloc.pages;
      alloc.ahead = req->u.alloc.ahead;
      r.body_case = GMB__REQUEST__BODY_ALLOC;
      r.alloc = &alloc;
      break;
    case WIRE_FREE:
      fr.id = req->u.free.id;
      if (req->u.free.n_more >= WIRE_PAGES_MAX) return GMB_E_INVAL;
      fr.n_more = req->u.free.n_more;
      fr.more = (uint64_t *)req->u.free.more;
      r.body_case = GMB__REQUEST__BODY_FREE;
      r.free = &fr;
      break;
    case WIRE_STATS:
      r.body_case = GMB__REQUEST__BODY_STATS;
      r.stats = &stats;
      break;
    case WIRE_HEARTBEAT:
      r.body_case = GMB__REQUEST__BODY_HEARTBEAT;
      r.heartbeat = &hb;
      break;
    case WIRE_BYE:
      r.body_case = GMB__REQUEST__BODY_BYE;
      r.bye = &bye;
      break;
    case WIRE_SEGMENT_CLOSED:
      sc.segment = req->u.segment.segment;
      r.body_case = GMB__REQUEST__BODY_SEGMENT_CLOSED;
      r.segment_closed = &sc;
      break;
    case WIRE_VMM:
      vmm.bytes = req->u.vmm.bytes;
      r.body_case = GMB__REQUEST__BODY_VMM;
      r.vmm = &vmm;
      break;
    case WIRE_LOCK:
      lk.id = req->u.lock.id;
      lk.timeout_ms = req->u.lock.timeout_ms;
      r.body_case = GMB__REQUEST__BODY_LOCK;
      r.lock = &lk;
      break;
    case WIRE_ADMIN_STATUS:
      r.body_case = GMB__REQUEST__BODY_ADMIN_STATUS;
      r.admin_status = &as;
      break;
    case WIRE_ADMIN_COMPACT:
      if (!WIRE_FITS(req->u.admin_compact.tenant)) return GMB_E_INVAL;
      ac.tenant = wire_name(req->u.admin_compact.tenant);
      r.body_case = GMB__REQUEST__BODY_ADMIN_COMPACT;
      r.admin_compact = &ac;
      break;
    case WIRE_ADMIN_QUOTA:
    case WIRE_ADMIN_RESERVE:
      if (!WIRE_FITS(req->u.admin_limit.tenant)) return GMB_E_INVAL;
      al.tenant = wire_name(req->u.admin_limit.tenant);
      al.set = req->u.admin_limit.set != 0;
      al.value = req->u.admin_limit.value;
      if (req->kind == WIRE_ADMIN_QUOTA) {
        r.body_case = GMB__REQUEST__BODY_ADMIN_QUOTA;
        r.admin_quota = &al;
      } else {
        r.body_case = GMB__REQUEST__BODY_ADMIN_RESERVE;
        r.admin_reserve = &al;
      }
      break;
    case WIRE_ADMIN_EVICT:
      if (!WIRE_FITS(req->u.admin_evict.tenant)) return GMB_E_INVAL;
      ae.tenant = wire_name(req->u.admin_evict.tenant);
      r.body_case = GMB__REQUEST__BODY_ADMIN_EVICT;
      r.admin_evict = &ae;
      break;
    case WIRE_ADMIN_RELOAD:
      r.body_case = GMB__REQUEST__BODY_ADMIN_RELOAD;
      r.admin_reload = &ar;
      break;
    case WIRE_ADMIN_SNAPSHOT:
      asn.segment = req->u.admin_snapshot.segment;
      asn.offset = req->u.admin_snapshot.offset;
      asn.limit = req->u.admin_snapshot.limit;
      r.body_case = GMB__REQUEST__BODY_ADMIN_SNAPSHOT;
      r.admin_snapshot = &asn;
      break;
    case WIRE_ADMIN_METRICS:
      r.body_case = GMB__REQUEST__BODY_ADMIN_METRICS;
      r.admin_metrics = &am;
      break;
    case WIRE_ADMIN_TENANT_ADD:
      if (!WIRE_FITS(req->u.admin_tenant_add.tenant) ||
          req->u.admin_tenant_add.n_uids > WIRE_UIDS_MAX ||
          (!req->u.admin_tenant_add.has_host_quota &&
           req->u.admin_tenant_add.host_quota != 0))
        return GMB_E_INVAL;
      ata.tenant = wire_name(req->u.admin_tenant_add.tenant);
      ata.quota = req->u.admin_tenant_add.quota;
      ata.reserve = req->u.admin_tenant_add.reserve;
      if (req->u.admin_tenant_add.has_token) {
        ata.token_sha256.data = (uint8_t *)req->u.admin_tenant_add.token_sha256;
        ata.token_sha256.len = sizeof req->u.admin_tenant_add.token_sha256;
      }
      ata.n_uids = req->u.admin_tenant_add.n_uids;
      ata.uids = (uint32_t *)req->u.admin_tenant_add.uids;
      ata.priority = req->u.admin_tenant_add.priority;
      ata.has_host_quota = req->u.admin_tenant_add.has_host_quota != 0;
      ata.host_quota = req->u.admin_tenant_add.host_quota;
      r.body_case = GMB__REQUEST__BODY_ADMIN_TENANT_ADD;
      r.admin_tenant_add = &ata;
      break;
    case WIRE_ADMIN_TENANT_REMOVE:
      if (!WIRE_FITS(req->u.admin_tenant_remove.tenant)) return GMB_E_INVAL;
      atr.tenant = wire_name(req->u.admin_tenant_remove.tenant);
      atr.evict = req->u.admin_tenant_remove.evict != 0;
      r.body_case = GMB__REQUEST__BODY_ADMIN_TENANT_REMOVE;
      r.admin_tenant_remove = &atr;
      break;
    case WIRE_SLEEP_NOTE:
      if (!WIRE_FITS(req->u.sleep_note.tag)) return GMB_E_INVAL;
      sn.tag = wire_name(req->u.sleep_note.tag);
      sn.paused = req->u.sleep_note.paused != 0;
      sn.mode = req->u.sleep_note.mode;
      sn.by = req->u.sleep_note.by;
      sn.host_bytes = req->u.sleep_note.host_bytes;
      sn.device_bytes = req->u.sleep_note.device_bytes;
      r.body_case = GMB__REQUEST__BODY_SLEEP_NOTE;
      r.sleep_note = &sn;
      break;
    case WIRE_ADMIN_PAUSE:
    case WIRE_ADMIN_RESUME:
      if (!WIRE_FITS(req->u.admin_pause.tenant) ||
          !WIRE_FITS(req->u.admin_pause.tag))
        return GMB_E_INVAL;
      ap.tenant = wire_name(req->u.admin_pause.tenant);
      ap.tag = wire_name(req->u.admin_pause.tag);
      ap.discard = req->u.admin_pause.discard != 0;
      if (req->kind == WIRE_ADMIN_PAUSE) {
        r.body_case = GMB__REQUEST__BODY_ADMIN_PAUSE;
        r.admin_pause = &ap;
      } else {
        r.body_case = GMB__REQUEST__BODY_ADMIN_RESUME;
        r.admin_resume = &ap;
      }
      break;
    default:
      return GMB_E_INVAL;
  }
  r.cached_free = req->cached_free;
  r.trim_answered = req->trim_answered != 0;
  r.sleep_pausable = req->sleep_pausable;
  r.sleep_idle_ms = req->sleep_idle_ms;
  r.sleep_idle = req->sleep_idle != 0;
  r.cached_holes = req->cached_holes;
  return wire_pack(&r.base, buf, len);
}

int gmb__wire_request_decode(const uint8_t *buf, size_t len,
                             struct wire_request *out) {
  memset(out, 0, sizeof *out);
  Gmb__Request *r = gmb__request__unpack(NULL, len, buf);
  if (r == NULL) return GMB_E_PROTO;
  int rc = 0;
  out->id = r->id;
  out->cached_free = r->cached_free;
  out->trim_answered = r->trim_answered != 0;
  out->sleep_pausable = r->sleep_pausable;
  out->sleep_idle_ms = r->sleep_idle_ms;
  out->sleep_idle = r->sleep_idle != 0;
  out->cached_holes = r->cached_holes;
  switch (r->body_case) {
    case GMB__REQUEST__BODY_HELLO:
      out->kind = WIRE_HELLO;
      out->u.hello.version = r->hello->version;
      out->u.hello.pid = r->hello->pid;
      rc = wire_name_copy(out->u.hello.tenant, sizeof out->u.hello.tenant,
                          r->hello->tenant);
      if (rc == 0)
        rc = wire_name_copy(out->u.hello.client, sizeof out->u.hello.client,
                            r->hello->client);
      if (rc == 0) {
        if (r->hello->token.len > WIRE_TOKEN_MAX) {
          rc = GMB_E_PROTO;
        } else {
          out->u.hello.token_len = (uint32_t)r->hello->token.len;
          if (r->hello->token.len)
            memcpy(out->u.hello.token, r->hello->token.data,
                   r->hello->token.len);
        }
      }
      break;
    case GMB__REQUEST__BODY_ALLOC:
      out->kind = WIRE_ALLOC;
      out->u.alloc.size = r->alloc->size;
      out->u.alloc.flags = r->alloc->flags;
      out->u.alloc.timeout_ms = r->alloc->timeout_ms;
      out->u.alloc.pages = r->alloc->pages;
      out->u.alloc.ahead = r->alloc->ahead;
      break;
    case GMB__REQUEST__BODY_FREE:
      out->kind = WIRE_FREE;
      out->u.free.id = r->free->id;
      if (r->free->n_more >= WIRE_PAGES_MAX) {
        rc = GMB_E_PROTO;
        break;
      }
      out->u.free.n_more = (uint32_t)r->free->n_more;
      for (size_t i = 0; i < r->free->n_more; i++)
        out->u.free.more[i] = r->free->more[i];
      break;
    case GMB__REQUEST__BODY_STATS:
      out->kind = WIRE_STATS;
      break;
    case GMB__REQUEST__BODY_HEARTBEAT:
      out->kind = WIRE_HEARTBEAT;
      break;
    case GMB__REQUEST__BODY_BYE:
      out->kind = WIRE_BYE;
      break;
    case GMB__REQUEST__BODY_SEGMENT_CLOSED:
      out->kind = WIRE_SEGMENT_CLOSED;
      out->u.segment.segment = r->segment_closed->segment;
      break;
    case GMB__REQUEST__BODY_VMM:
      out->kind = WIRE_VMM;
      out->u.vmm.bytes = r->vmm->bytes;
      break;
    case GMB__REQUEST__BODY_LOCK:
      out->kind = WIRE_LOCK;
      out->u.lock.id = r->lock->id;
      out->u.lock.timeout_ms = r->lock->timeout_ms;
      break;
    case GMB__REQUEST__BODY_ADMIN_STATUS:
      out->kind = WIRE_ADMIN_STATUS;
      break;
    case GMB__REQUEST__BODY_ADMIN_COMPACT:
      out->kind = WIRE_ADMIN_COMPACT;
      rc = wire_name_copy(out->u.admin_compact.tenant,
                          sizeof out->u.admin_compact.tenant,
                          r->admin_compact->tenant);
      break;
    case GMB__REQUEST__BODY_ADMIN_QUOTA:
    case GMB__REQUEST__BODY_ADMIN_RESERVE: {
      const Gmb__AdminLimit *l = r->body_case == GMB__REQUEST__BODY_ADMIN_QUOTA
                                     ? r->admin_quota
                                     : r->admin_reserve;
      out->kind = r->body_case == GMB__REQUEST__BODY_ADMIN_QUOTA
                      ? WIRE_ADMIN_QUOTA
                      : WIRE_ADMIN_RESERVE;
      out->u.admin_limit.set = l->set;
      out->u.admin_limit.value = l->value;
      rc = wire_name_copy(out->u.admin_limit.tenant,
                          sizeof out->u.admin_limit.tenant, l->tenant);
      break;
    }
    case GMB__REQUEST__BODY_ADMIN_EVICT:
      out->kind = WIRE_ADMIN_EVICT;
      rc = wire_name_copy(out->u.admin_evict.tenant,
                          sizeof out->u.admin_evict.tenant,
                          r->admin_evict->tenant);
      break;
    case GMB__REQUEST__BODY_ADMIN_RELOAD:
      out->kind = WIRE_ADMIN_RELOAD;
      break;
    case GMB__REQUEST__BODY_ADMIN_SNAPSHOT:
      out->kind = WIRE_ADMIN_SNAPSHOT;
      out->u.admin_snapshot.segment = r->admin_snapshot->segment;
      out->u.admin_snapshot.offset = r->admin_snapshot->offset;
      out->u.admin_snapshot.limit = r->admin_snapshot->limit;
      break;
    case GMB__REQUEST__BODY_ADMIN_METRICS:
      out->kind = WIRE_ADMIN_METRICS;
      break;
    case GMB__REQUEST__BODY_ADMIN_TENANT_ADD: {
      const Gmb__AdminTenantAdd *a = r->admin_tenant_add;
      out->kind = WIRE_ADMIN_TENANT_ADD;
      out->u.admin_tenant_add.quota = a->quota;
      out->u.admin_tenant_add.reserve = a->reserve;
      out->u.admin_tenant_add.priority = a->priority;
      out->u.admin_tenant_add.has_host_quota = a->has_host_quota;
      out->u.admin_tenant_add.host_quota = a->host_quota;
      /* A value without its flag: which one was meant is unknown. */
      if (!a->has_host_quota && a->host_quota != 0) {
        rc = GMB_E_PROTO;
        break;
      }
      rc = wire_name_copy(out->u.admin_tenant_add.tenant,
                          sizeof out->u.admin_tenant_add.tenant, a->tenant);
      /* A hash is exactly 32 bytes or absent; too many uids is refused
       * rather than cut, so that no uid is silently left out. */
      if (rc == 0 && a->token_sha256.len != 0) {
        if (a->token_sha256.len != sizeof out->u.admin_tenant_add.token_sha256)
          rc = GMB_E_PROTO;
        else {
          out->u.admin_tenant_add.has_token = 1;
          memcpy(out->u.admin_tenant_add.token_sha256, a->token_sha256.data,
                 a->token_sha256.len);
        }
      }
      if (rc == 0 && a->n_uids > WIRE_UIDS_MAX) rc = GMB_E_PROTO;
      if (rc == 0) {
        out->u.admin_tenant_add.n_uids = (uint32_t)a->n_uids;
        for (size_t i = 0; i < a->n_uids; i++)
          out->u.admin_tenant_add.uids[i] = a->uids[i];
      }
      break;
    }
    case GMB__REQUEST__BODY_ADMIN_TENANT_REMOVE:
      out->kind = WIRE_ADMIN_TENANT_REMOVE;
      out->u.admin_tenant_remove.evict = r->admin_tenant_remove->evict;
      rc = wire_name_copy(out->u.admin_tenant_remove.tenant,
                          sizeof out->u.admin_tenant_remove.tenant,
                          r->admin_tenant_remove->tenant);
      break;
    case GMB__REQUEST__BODY_SLEEP_NOTE:
      out->kind = WIRE_SLEEP_NOTE;
      out->u.sleep_note.paused = r->sleep_note->paused;
      out->u.sleep_note.mode = r->sleep_note->mode;
      out->u.sleep_note.by = r->sleep_note->by;
      out->u.sleep_note.host_bytes = r->sleep_note->host_bytes;
      out->u.sleep_note.device_bytes = r->sleep_note->device_bytes;
      rc = wire_name_copy(out->u.sleep_note.tag, sizeof out->u.sleep_note.tag,
                          r->sleep_note->tag);
      break;
    case GMB__REQUEST__BODY_ADMIN_PAUSE:
    case GMB__REQUEST__BODY_ADMIN_RESUME: {
      const Gmb__AdminPause *a = r->body_case == GMB__REQUEST__BODY_ADMIN_PAUSE
                                     ? r->admin_pause
                                     : r->admin_resume;
      out->kind = r->body_case == GMB__REQUEST__BODY_ADMIN_PAUSE
                      ? WIRE_ADMIN_PAUSE
                      : WIRE_ADMIN_RESUME;
      out->u.admin_pause.discard = a->discard;
      rc = wire_name_copy(out->u.admin_pause.tenant,
                          sizeof out->u.admin_pause.tenant, a->tenant);
      if (rc == 0)
        rc = wire_name_copy(out->u.admin_pause.tag,
                            sizeof out->u.admin_pause.tag, a->tag);
      break;
    }
    default:
      rc = GMB_E_PROTO; /* no body, or one this version does not know */
      break;
  }
  gmb__request__free_unpacked(r, NULL);
  return rc;
}

static void wire_compact_out(const struct wire_compact_stats *c,
                             Gmb__CompactStats *m) {
  m->moves = c->moves;
  m->bytes_moved = c->bytes_moved;
  m->segments_released = c->segments_released;
  m->bytes_released = c->bytes_released;
  m->skipped_locked = c->skipped_locked;
  m->skipped_pinned = c->skipped_pinned;
  m->seconds = c->seconds;
  m->runs = c->runs;
}

static void wire_compact_in(const Gmb__CompactStats *m,
                            struct wire_compact_stats *c) {
  if (m == NULL) return;
  c->moves = m->moves;
  c->bytes_moved = m->bytes_moved;
  c->segments_released = m->segments_released;
  c->bytes_released = m->bytes_released;
  c->skipped_locked = m->skipped_locked;
  c->skipped_pinned = m->skipped_pinned;
  c->seconds = m->seconds;
  c->runs = m->runs;
}

static void wire_row_out(const struct wire_tenant_row *t, Gmb__TenantRow *r) {
  gmb__tenant_row__init(r);
  r->name = (char *)t->name;
  r->quota = t->quota;
  r->used = t->used;
  r->peak = t->peak;
  r->segments = t->segments;
  r->sessions = t->sessions;
  r->allocations = t->allocations;
  r->free_in_segments = t->free_in_segments;
  r->largest_free = t->largest_free;
  r->fragmentation = t->fragmentation;
  r->reserve = t->reserve;
  r->priority = t->priority;
  r->waiting = t->waiting;
  r->cached = t->cached;
  r->trim_asks = t->trim_asks;
  r->trim_ignored = t->trim_ignored;
  r->host_bytes = t->host_bytes;
  r->paused_bytes = t->paused_bytes;
  r->paused_tags = t->paused_tags;
  r->host_quota = t->host_quota;
  r->pauses = t->pauses;
  r->resumes = t->resumes;
  r->paused_seconds = t->paused_seconds;
  r->sleep_asks = t->sleep_asks;
  r->vmm = t->vmm;
  r->fd_unread = t->fd_unread;
  r->fd_kept = t->fd_kept;
  r->fd_refused = t->fd_refused;
}

static int wire_row_in(const Gmb__TenantRow *r, struct wire_tenant_row *t) {
  int rc = wire_str_copy(t->name, sizeof t->name, r->name);
  t->quota = r->quota;
  t->used = r->used;
  t->peak = r->peak;
  t->segments = r->segments;
  t->sessions = r->sessions;
  t->allocations = r->allocations;
  t->free_in_segments = r->free_in_segments;
  t->largest_free = r->largest_free;
  t->fragmentation = r->fragmentation;
  t->reserve = r->reserve;
  t->priority = r->priority;
  t->waiting = r->waiting;
  t->cached = r->cached;
  t->trim_asks = r->trim_asks;
  t->trim_ignored = r->trim_ignored;
  t->host_bytes = r->host_bytes;
  t->paused_bytes = r->paused_bytes;
  t->paused_tags = r->paused_tags;
  t->host_quota = r->host_quota;
  t->pauses = r->pauses;
  t->resumes = r->resumes;
  t->paused_seconds = r->paused_seconds;
  t->sleep_asks = r->sleep_asks;
  t->vmm = r->vmm;
  t->fd_unread = r->fd_unread;
  t->fd_kept = r->fd_kept;
  t->fd_refused = r->fd_refused;
  return rc;
}

static void wire_session_out(const struct wire_session_row *w,
                             Gmb__SessionRow *r) {
  gmb__session_row__init(r);
  r->id = w->id;
  r->tenant = (char *)w->tenant;
  r->uid = w->uid;
  r->pid = w->pid;
  r->client = (char *)w->client;
  r->allocations = w->allocations;
  r->used = w->used;
  r->cached = w->cached;
  r->trim_asks = w->trim_asks;
  r->trim_ignored = w->trim_ignored;
  r->waiting = w->waiting;
  r->host_bytes = w->host_bytes;
  r->paused_bytes = w->paused_bytes;
  r->paused = (char *)w->paused;
  r->sleep_pausable = w->sleep_pausable;
  r->sleep_idle_ms = w->sleep_idle_ms;
  r->fd_unread = w->fd_unread;
  r->fd_refused = w->fd_refused;
}

static int wire_session_in(const Gmb__SessionRow *r,
                           struct wire_session_row *w) {
  int rc = wire_str_copy(w->tenant, sizeof w->tenant, r->tenant);
  if (rc == 0) rc = wire_str_copy(w->client, sizeof w->client, r->client);
  if (rc == 0) rc = wire_str_copy(w->paused, sizeof w->paused, r->paused);
  w->host_bytes = r->host_bytes;
  w->paused_bytes = r->paused_bytes;
  w->sleep_pausable = r->sleep_pausable;
  w->sleep_idle_ms = r->sleep_idle_ms;
  w->id = r->id;
  w->uid = r->uid;
  w->pid = r->pid;
  w->allocations = r->allocations;
  w->used = r->used;
  w->cached = r->cached;
  w->trim_asks = r->trim_asks;
  w->trim_ignored = r->trim_ignored;
  w->waiting = r->waiting;
  w->fd_unread = r->fd_unread;
  w->fd_refused = r->fd_refused;
  return rc;
}

/* The protobuf side of an admin status: arrays the encoder frees after
 * packing (wire_status_out_free). */
struct wire_status_arrays {
  Gmb__TenantRow *rows, **rowp;
  Gmb__SessionRow *srows, **srowp;
};

static void wire_status_out_free(struct wire_status_arrays *o) {
  free(o->rows);
  free(o->rowp);
  free(o->srows);
  free(o->srowp);
  memset(o, 0, sizeof *o);
}

/* Builds the protobuf of an admin status; what it allocates is in *o, the
 * caller's to free (even on failure). */
static int wire_status_out(const struct wire_admin_status *st,
                           Gmb__AdminStatusReply *as, Gmb__CompactStats *cs,
                           struct wire_status_arrays *o) {
  size_t n = st->n_tenants, ns = st->n_sessions;
  if (!WIRE_FITS(st->device) || (n && st->tenants == NULL) ||
      (ns && st->session_rows == NULL))
    return GMB_E_INVAL;
  for (size_t i = 0; i < n; i++)
    if (!WIRE_FITS(st->tenants[i].name)) return GMB_E_INVAL;
  for (size_t i = 0; i < ns; i++)
    if (!WIRE_FITS(st->session_rows[i].tenant) ||
        !WIRE_FITS(st->session_rows[i].client) ||
        !WIRE_FITS(st->session_rows[i].paused))
      return GMB_E_INVAL;
  as->device = (char *)st->device;
  as->capacity = st->capacity;
  as->in_segments = st->in_segments;
  as->in_use = st->in_use;
  as->sessions = st->sessions;
  if (n) {
    o->rows = calloc(n, sizeof *o->rows);
    o->rowp = calloc(n, sizeof *o->rowp);
    if (o->rows == NULL || o->rowp == NULL) return GMB_E_SYSTEM;
    for (size_t i = 0; i < n; i++) {
      wire_row_out(&st->tenants[i], &o->rows[i]);
      o->rowp[i] = &o->rows[i];
    }
  }
  as->n_tenants = n;
  as->tenants = o->rowp;
  if (ns) {
    o->srows = calloc(ns, sizeof *o->srows);
    o->srowp = calloc(ns, sizeof *o->srowp);
    if (o->srows == NULL || o->srowp == NULL) return GMB_E_SYSTEM;
    for (size_t i = 0; i < ns; i++) {
      wire_session_out(&st->session_rows[i], &o->srows[i]);
      o->srowp[i] = &o->srows[i];
    }
  }
  as->n_session_rows = ns;
  as->session_rows = o->srowp;
  as->cached = st->cached;
  as->fragmentation = st->fragmentation;
  as->largest_free = st->largest_free;
  as->retiring = st->retiring;
  as->host_bytes = st->host_bytes;
  as->paused_bytes = st->paused_bytes;
  as->offload_job_requests = st->offload_job_requests;
  as->offload_slices = st->offload_slices;
  as->offload_jobs = st->offload_jobs;
  as->offload_pauses = st->offload_pauses;
  as->fd_unread = st->fd_unread;
  as->fd_kept = st->fd_kept;
  as->fd_refused = st->fd_refused;
  wire_compact_out(&st->compaction, cs);
  as->compaction = cs;
  return 0;
}

/* The protobuf side of a snapshot: arrays the encoder frees after packing. */
struct wire_snap_out {
  Gmb__SegmentInfo *segs;
  Gmb__SegmentInfo **segp;
  Gmb__RangeInfo **ranges;  /* per segment */
  Gmb__RangeInfo ***rangep; /* per segment */
  size_t n;
};

static void wire_snapshot_out_free(struct wire_snap_out *o) {
  for (size_t i = 0; i < o->n; i++) {
    if (o->ranges) free(o->ranges[i]);
    if (o->rangep) free(o->rangep[i]);
  }
  free(o->segs);
  free(o->segp);
  free(o->ranges);
  free(o->rangep);
  memset(o, 0, sizeof *o);
}

static int wire_snapshot_out(const struct wire_reply *rep,
                             Gmb__SnapshotReply *sn, struct wire_snap_out *o) {
  size_t n = rep->u.snapshot.n_segments;
  if (n && rep->u.snapshot.segments == NULL) return GMB_E_INVAL;
  if (n == 0) return 0;
  o->segs = calloc(n, sizeof *o->segs);
  o->segp = calloc(n, sizeof *o->segp);
  o->ranges = calloc(n, sizeof *o->ranges);
  o->rangep = calloc(n, sizeof *o->rangep);
  o->n = n;
  if (!o->segs || !o->segp || !o->ranges || !o->rangep) return GMB_E_SYSTEM;
  for (size_t i = 0; i < n; i++) {
    const struct wire_segment_info *si = &rep->u.snapshot.segments[i];
    if (!WIRE_FITS(si->tenant) || (si->n_ranges && si->ranges == NULL))
      return GMB_E_INVAL;
    Gmb__SegmentInfo *m = &o->segs[i];
    gmb__segment_info__init(m);
    m->id = si->id;
    m->size = si->size;
    m->tenant = (char *)si->tenant;
    m->small = si->small != 0;
    m->used = si->used;
    if (si->n_ranges) {
      o->ranges[i] = calloc(si->n_ranges, sizeof *o->ranges[i]);
      o->rangep[i] = calloc(si->n_ranges, sizeof *o->rangep[i]);
      if (!o->ranges[i] || !o->rangep[i]) return GMB_E_SYSTEM;
      for (size_t k = 0; k < si->n_ranges; k++) {
        const struct wire_range_info *ri = &si->ranges[k];
        Gmb__RangeInfo *rm = &o->ranges[i][k];
        gmb__range_info__init(rm);
        rm->offset = ri->offset;
        rm->size = ri->size;
        rm->id = ri->id;
        rm->movable = ri->movable != 0;
        rm->locked = ri->locked != 0;
        rm->session = ri->session;
        rm->tail = ri->tail != 0;
        o->rangep[i][k] = rm;
      }
    }
    m->n_ranges = si->n_ranges;
    m->ranges = o->rangep[i];
    o->segp[i] = m;
  }
  sn->n_segments = n;
  sn->segments = o->segp;
  return 0;
}

/* The page's own fields (the segments are wire_snapshot_out's). */
static void wire_page_out(const struct wire_reply *rep,
                          Gmb__SnapshotReply *sn) {
  sn->next_segment = rep->u.snapshot.next_segment;
  sn->next_offset = rep->u.snapshot.next_offset;
  sn->changes = rep->u.snapshot.changes;
  sn->limit = rep->u.snapshot.limit;
}

int gmb__wire_reply_encode(const struct wire_reply *rep, uint8_t **buf,
                           size_t *len) {
  Gmb__Reply r = GMB__REPLY__INIT;
  Gmb__HelloReply hello = GMB__HELLO_REPLY__INIT;
  Gmb__AllocReply alloc = GMB__ALLOC_REPLY__INIT;
  Gmb__StatsReply stats = GMB__STATS_REPLY__INIT;
  Gmb__Event ev = GMB__EVENT__INIT;
  Gmb__AdminStatusReply as = GMB__ADMIN_STATUS_REPLY__INIT;
  Gmb__CompactStats cs = GMB__COMPACT_STATS__INIT;
  Gmb__NoMemory nm = GMB__NO_MEMORY__INIT;
  Gmb__TenantRow row = GMB__TENANT_ROW__INIT;
  Gmb__EvictReply ev_rep = GMB__EVICT_REPLY__INIT;
  Gmb__TenantRemoveReply trm = GMB__TENANT_REMOVE_REPLY__INIT;
  Gmb__PauseReply pr = GMB__PAUSE_REPLY__INIT;
  Gmb__LockReply lr = GMB__LOCK_REPLY__INIT;
  Gmb__MetricsReply mr = GMB__METRICS_REPLY__INIT;
  Gmb__SnapshotReply sn = GMB__SNAPSHOT_REPLY__INIT;
  struct wire_snap_out snap = {0};
  char *holders[WIRE_HOLDERS_MAX];
  struct wire_status_arrays sta = {0};
  int rc;

  if (rep->status > 0 || rep->status < -(int)GMB__STATUS__GMB_E_SYSTEM)
    return GMB_E_INVAL;
  if (!WIRE_FITS(rep->message)) return GMB_E_INVAL;
  r.id = rep->id;
  r.status = (Gmb__Status)(-rep->status);
  r.message = (char *)rep->message;
  r.asked_back = rep->asked_back;
  switch (rep->kind) {
    case WIRE_NONE:
      break;
    case WIRE_HELLO:
      if (!WIRE_FITS(rep->u.hello.tenant) || !WIRE_FITS(rep->u.hello.device) ||
          !WIRE_FITS(rep->u.hello.device_uuid) ||
          !WIRE_FITS(rep->u.hello.device_pci))
        return GMB_E_INVAL;
      hello.version = rep->u.hello.version;
      hello.session = rep->u.hello.session;
      hello.tenant = (char *)rep->u.hello.tenant;
      hello.device = (char *)rep->u.hello.device;
      hello.device_uuid = (char *)rep->u.hello.device_uuid;
      hello.device_pci = (char *)rep->u.hello.device_pci;
      hello.heartbeat_ms = rep->u.hello.heartbeat_ms;
      if (rep->u.hello.fd_secret_len > WIRE_SECRET_MAX) return GMB_E_INVAL;
      hello.lock_slots = rep->u.hello.lock_slots;
      hello.fd_secret.data = (uint8_t *)rep->u.hello.fd_secret;
      hello.fd_secret.len = rep->u.hello.fd_secret_len;
      hello.host_quota = rep->u.hello.host_quota;
      r.body_case = GMB__REPLY__BODY_HELLO;
      r.hello = &hello;
      break;
    case WIRE_ALLOC:
      alloc.id = rep->u.alloc.id;
      alloc.size = rep->u.alloc.size;
      alloc.segment = rep->u.alloc.segment;
      alloc.offset = rep->u.alloc.offset;
      alloc.slot = rep->u.alloc.slot;
      alloc.pinned = rep->u.alloc.pinned != 0;
      alloc.tail_segment = rep->u.alloc.tail_segment;
      alloc.tail_offset = rep->u.alloc.tail_offset;
      alloc.tail_size = rep->u.alloc.tail_size;
      if (rep->u.alloc.n_pages > WIRE_PAGES_MAX) return GMB_E_INVAL;
      alloc.n_page_ids = alloc.n_page_segments = rep->u.alloc.n_pages;
      alloc.page_ids = (uint64_t *)rep->u.alloc.page_id;
      alloc.page_segments = (uint64_t *)rep->u.alloc.page_seg;
      r.body_case = GMB__REPLY__BODY_ALLOC;
      r.alloc = &alloc;
      break;
    case WIRE_STATS:
      stats.quota = rep->u.stats.quota;
      stats.used = rep->u.stats.used;
      stats.peak = rep->u.stats.peak;
      stats.segments = rep->u.stats.segments;
      stats.cached = rep->u.stats.cached;
      stats.vmm = rep->u.stats.vmm;
      stats.device_capacity = rep->u.stats.device_capacity;
      stats.device_segments = rep->u.stats.device_segments;
      stats.device_used = rep->u.stats.device_used;
      stats.free_in_segments = rep->u.stats.free_in_segments;
      r.body_case = GMB__REPLY__BODY_STATS;
      r.stats = &stats;
      break;
    case WIRE_EVENT:
      ev.kind = (Gmb__EventKind)rep->u.event.kind;
      ev.segment = rep->u.event.segment;
      ev.bytes = rep->u.event.bytes;
      if (!WIRE_FITS(rep->u.event.tag)) return GMB_E_INVAL;
      ev.tag = (char *)rep->u.event.tag;
      ev.mode = rep->u.event.mode;
      ev.message = (char *)rep->message;
      r.body_case = GMB__REPLY__BODY_EVENT;
      r.event = &ev;
      break;
    case WIRE_ADMIN_STATUS:
      rc = wire_status_out(&rep->u.admin_status, &as, &cs, &sta);
      if (rc) {
        wire_status_out_free(&sta);
        return rc;
      }
      r.body_case = GMB__REPLY__BODY_ADMIN_STATUS;
      r.admin_status = &as;
      break;
    case WIRE_ADMIN_COMPACT:
      wire_compact_out(&rep->u.compact, &cs);
      r.body_case = GMB__REPLY__BODY_COMPACT;
      r.compact = &cs;
      break;
    case WIRE_NOMEM:
      if (rep->u.nomem.n_holders > WIRE_HOLDERS_MAX) return GMB_E_INVAL;
      for (size_t i = 0; i < rep->u.nomem.n_holders; i++) {
        if (!WIRE_FITS(rep->u.nomem.holders[i])) return GMB_E_INVAL;
        holders[i] = (char *)rep->u.nomem.holders[i];
      }
      nm.request = rep->u.nomem.request;
      nm.free_total = rep->u.nomem.free_total;
      nm.largest_free = rep->u.nomem.largest_free;
      nm.unmovable = rep->u.nomem.unmovable;
      nm.n_holders = rep->u.nomem.n_holders;
      nm.holders = holders;
      r.body_case = GMB__REPLY__BODY_NOMEM;
      r.nomem = &nm;
      break;
    case WIRE_TENANT_ROW:
      if (!WIRE_FITS(rep->u.tenant_row.name)) return GMB_E_INVAL;
      wire_row_out(&rep->u.tenant_row, &row);
      r.body_case = GMB__REPLY__BODY_TENANT;
      r.tenant = &row;
      break;
    case WIRE_ADMIN_EVICT:
      ev_rep.sessions = rep->u.evict.sessions;
      ev_rep.bytes_freed = rep->u.evict.bytes_freed;
      r.body_case = GMB__REPLY__BODY_EVICT;
      r.evict = &ev_rep;
      break;
    case WIRE_ADMIN_TENANT_REMOVE:
      trm.removed = rep->u.tenant_remove.removed != 0;
      trm.sessions = rep->u.tenant_remove.sessions;
      trm.evicted = rep->u.tenant_remove.evicted;
      trm.bytes_freed = rep->u.tenant_remove.bytes_freed;
      r.body_case = GMB__REPLY__BODY_TENANT_REMOVE;
      r.tenant_remove = &trm;
      break;
    case WIRE_ADMIN_PAUSE:
    case WIRE_ADMIN_RESUME:
      pr.sessions = rep->u.pause.sessions;
      pr.movable = rep->u.pause.movable;
      pr.movable_bytes = rep->u.pause.movable_bytes;
      r.body_case = GMB__REPLY__BODY_PAUSE;
      r.pause = &pr;
      break;
    case WIRE_LOCK:
      lr.held = rep->u.lock.held != 0;
      lr.segment = rep->u.lock.segment;
      lr.offset = rep->u.lock.offset;
      r.body_case = GMB__REPLY__BODY_LOCK;
      r.lock = &lr;
      break;
    case WIRE_ADMIN_METRICS:
      if (rep->u.metrics.text == NULL) return GMB_E_INVAL;
      mr.text = rep->u.metrics.text;
      r.body_case = GMB__REPLY__BODY_METRICS;
      r.metrics = &mr;
      break;
    case WIRE_ADMIN_SNAPSHOT:
      rc = 0;
      if (rep->u.snapshot.has_status)
        rc = wire_status_out(&rep->u.snapshot.status, &as, &cs, &sta);
      if (rc == 0) rc = wire_snapshot_out(rep, &sn, &snap);
      if (rc) {
        wire_status_out_free(&sta);
        wire_snapshot_out_free(&snap);
        return rc;
      }
      if (rep->u.snapshot.has_status) sn.status = &as;
      wire_page_out(rep, &sn);
      r.body_case = GMB__REPLY__BODY_SNAPSHOT;
      r.snapshot = &sn;
      break;
    default:
      return GMB_E_INVAL;
  }
  rc = wire_pack(&r.base, buf, len);
  wire_status_out_free(&sta);
  wire_snapshot_out_free(&snap);
  return rc;
}

static int wire_status_in(const Gmb__AdminStatusReply *as,
                          struct wire_admin_status *st) {
  if (as == NULL) return GMB_E_PROTO;
  int rc = wire_str_copy(st->device, sizeof st->device, as->device);
  if (rc) return rc;
  st->capacity = as->capacity;
  st->in_segments = as->in_segments;
  st->in_use = as->in_use;
  st->sessions = as->sessions;
  st->fragmentation = as->fragmentation;
  st->largest_free = as->largest_free;
  st->retiring = as->retiring;
  st->cached = as->cached;
  st->host_bytes = as->host_bytes;
  st->paused_bytes = as->paused_bytes;
  st->offload_job_requests = as->offload_job_requests;
  st->offload_slices = as->offload_slices;
  st->offload_jobs = as->offload_jobs;
  st->offload_pauses = as->offload_pauses;
  st->fd_unread = as->fd_unread;
  st->fd_kept = as->fd_kept;
  st->fd_refused = as->fd_refused;
  wire_compact_in(as->compaction, &st->compaction);
  if (as->n_tenants) {
    st->tenants = calloc(as->n_tenants, sizeof *st->tenants);
    if (st->tenants == NULL) return GMB_E_SYSTEM;
    st->n_tenants = as->n_tenants;
    for (size_t i = 0; i < as->n_tenants; i++) {
      rc = wire_row_in(as->tenants[i], &st->tenants[i]);
      if (rc) return rc;
    }
  }
  if (as->n_session_rows) {
    st->session_rows = calloc(as->n_session_rows, sizeof *st->session_rows);
    if (st->session_rows == NULL) return GMB_E_SYSTEM;
    st->n_sessions = as->n_session_rows;
    for (size_t i = 0; i < as->n_session_rows; i++) {
      rc = wire_session_in(as->session_rows[i], &st->session_rows[i]);
      if (rc) return rc;
    }
  }
  return 0;
}

static int wire_snapshot_in(const Gmb__SnapshotReply *sn,
                            struct wire_reply *out) {
  out->u.snapshot.next_segment = sn->next_segment;
  out->u.snapshot.next_offset = sn->next_offset;
  out->u.snapshot.changes = sn->changes;
  out->u.snapshot.limit = sn->limit;
  int rc = 0;
  if (sn->status) { /* the first page */
    out->u.snapshot.has_status = 1;
    rc = wire_status_in(sn->status, &out->u.snapshot.status);
  }
  if (rc || sn->n_segments == 0) return rc;
  struct wire_segment_info *segs = calloc(sn->n_segments, sizeof *segs);
  if (segs == NULL) return GMB_E_SYSTEM;
  out->u.snapshot.segments = segs;
  out->u.snapshot.n_segments = sn->n_segments;
  for (size_t i = 0; i < sn->n_segments; i++) {
    const Gmb__SegmentInfo *m = sn->segments[i];
    segs[i].id = m->id;
    segs[i].size = m->size;
    segs[i].small = m->small;
    segs[i].used = m->used;
    rc = wire_str_copy(segs[i].tenant, sizeof segs[i].tenant, m->tenant);
    if (rc) return rc;
    if (m->n_ranges == 0) continue;
    segs[i].ranges = calloc(m->n_ranges, sizeof *segs[i].ranges);
    if (segs[i].ranges == NULL) return GMB_E_SYSTEM;
    segs[i].n_ranges = m->n_ranges;
    for (size_t k = 0; k < m->n_ranges; k++) {
      const Gmb__RangeInfo *r = m->ranges[k];
      segs[i].ranges[k] = (struct wire_range_info){
          r->offset, r->size, r->id, r->session, r->movable, r->locked,
          r->tail};
    }
  }
  return 0;
}

int gmb__wire_reply_decode(const uint8_t *buf, size_t len,
                           struct wire_reply *out) {
  memset(out, 0, sizeof *out);
  Gmb__Reply *r = gmb__reply__unpack(NULL, len, buf);
  if (r == NULL) return GMB_E_PROTO;
  int rc = 0;
  out->id = r->id;
  /* A status this version does not know is still a failure; keep it one. */
  if ((int)r->status < 0 || r->status > GMB__STATUS__GMB_E_SYSTEM)
    out->status = GMB_E_PROTO;
  else
    out->status = -(int)r->status;
  if (r->message) {
    /* Reasons are for people: cut a long one rather than refuse it. */
    strncpy(out->message, r->message, sizeof out->message - 1);
  }
  out->asked_back = r->asked_back;
  switch (r->body_case) {
    case GMB__REPLY__BODY__NOT_SET:
      out->kind = WIRE_NONE;
      break;
    case GMB__REPLY__BODY_HELLO:
      out->kind = WIRE_HELLO;
      out->u.hello.version = r->hello->version;
      out->u.hello.session = r->hello->session;
      out->u.hello.heartbeat_ms = r->hello->heartbeat_ms;
      rc = wire_str_copy(out->u.hello.tenant, sizeof out->u.hello.tenant,
                         r->hello->tenant);
      if (rc == 0)
        rc = wire_str_copy(out->u.hello.device, sizeof out->u.hello.device,
                           r->hello->device);
      if (rc == 0)
        rc = wire_str_copy(out->u.hello.device_uuid,
                           sizeof out->u.hello.device_uuid,
                           r->hello->device_uuid);
      if (rc == 0)
        rc = wire_str_copy(out->u.hello.device_pci,
                           sizeof out->u.hello.device_pci,
                           r->hello->device_pci);
      out->u.hello.lock_slots = r->hello->lock_slots;
      out->u.hello.host_quota = r->hello->host_quota;
      if (r->hello->fd_secret.len > WIRE_SECRET_MAX) {
        rc = GMB_E_PROTO;
      } else {
        out->u.hello.fd_secret_len = (uint32_t)r->hello->fd_secret.len;
        if (r->hello->fd_secret.len)
          memcpy(out->u.hello.fd_secret, r->hello->fd_secret.data,
                 r->hello->fd_secret.len);
      }
      break;
    case GMB__REPLY__BODY_ALLOC:
      out->kind = WIRE_ALLOC;
      out->u.alloc.id = r->alloc->id;
      out->u.alloc.size = r->alloc->size;
      out->u.alloc.segment = r->alloc->segment;
      out->u.alloc.offset = r->alloc->offset;
      out->u.alloc.slot = r->alloc->slot;
      out->u.alloc.pinned = r->alloc->pinned;
      out->u.alloc.tail_segment = r->alloc->tail_segment;
      out->u.alloc.tail_offset = r->alloc->tail_offset;
      out->u.alloc.tail_size = r->alloc->tail_size;
      if (r->alloc->n_page_ids > WIRE_PAGES_MAX ||
          r->alloc->n_page_ids != r->alloc->n_page_segments) {
        rc = GMB_E_PROTO;
        break;
      }
      out->u.alloc.n_pages = (uint32_t)r->alloc->n_page_ids;
      for (size_t i = 0; i < r->alloc->n_page_ids; i++) {
        out->u.alloc.page_id[i] = r->alloc->page_ids[i];
        out->u.alloc.page_seg[i] = r->alloc->page_segments[i];
      }
      break;
    case GMB__REPLY__BODY_STATS:
      out->kind = WIRE_STATS;
      out->u.stats.quota = r->stats->quota;
      out->u.stats.used = r->stats->used;
      out->u.stats.peak = r->stats->peak;
      out->u.stats.segments = r->stats->segments;
      out->u.stats.cached = r->stats->cached;
      out->u.stats.vmm = r->stats->vmm;
      out->u.stats.device_capacity = r->stats->device_capacity;
      out->u.stats.device_segments = r->stats->device_segments;
      out->u.stats.device_used = r->stats->device_used;
      out->u.stats.free_in_segments = r->stats->free_in_segments;
      break;
    case GMB__REPLY__BODY_EVENT:
      out->kind = WIRE_EVENT;
      out->u.event.kind = (enum wire_event)r->event->kind;
      out->u.event.segment = r->event->segment;
      out->u.event.bytes = r->event->bytes;
      out->u.event.mode = r->event->mode;
      if (rc == 0)
        rc = wire_str_copy(out->u.event.tag, sizeof out->u.event.tag,
                           r->event->tag);
      if (r->event->message && out->message[0] == '\0')
        strncpy(out->message, r->event->message, sizeof out->message - 1);
      break;
    case GMB__REPLY__BODY_ADMIN_STATUS:
      out->kind = WIRE_ADMIN_STATUS;
      rc = wire_status_in(r->admin_status, &out->u.admin_status);
      break;
    case GMB__REPLY__BODY_TENANT:
      out->kind = WIRE_TENANT_ROW;
      rc = wire_row_in(r->tenant, &out->u.tenant_row);
      break;
    case GMB__REPLY__BODY_EVICT:
      out->kind = WIRE_ADMIN_EVICT;
      out->u.evict.sessions = r->evict->sessions;
      out->u.evict.bytes_freed = r->evict->bytes_freed;
      break;
    case GMB__REPLY__BODY_TENANT_REMOVE:
      out->kind = WIRE_ADMIN_TENANT_REMOVE;
      out->u.tenant_remove.removed = r->tenant_remove->removed;
      out->u.tenant_remove.sessions = r->tenant_remove->sessions;
      out->u.tenant_remove.evicted = r->tenant_remove->evicted;
      out->u.tenant_remove.bytes_freed = r->tenant_remove->bytes_freed;
      break;
    case GMB__REPLY__BODY_PAUSE:
      out->kind = WIRE_ADMIN_PAUSE;
      out->u.pause.sessions = r->pause->sessions;
      out->u.pause.movable = r->pause->movable;
      out->u.pause.movable_bytes = r->pause->movable_bytes;
      break;
    case GMB__REPLY__BODY_LOCK:
      out->kind = WIRE_LOCK;
      out->u.lock.held = r->lock->held;
      out->u.lock.segment = r->lock->segment;
      out->u.lock.offset = r->lock->offset;
      break;
    case GMB__REPLY__BODY_METRICS:
      out->kind = WIRE_ADMIN_METRICS;
      out->u.metrics.text = strdup(r->metrics->text ? r->metrics->text : "");
      if (out->u.metrics.text == NULL) rc = GMB_E_SYSTEM;
      break;
    case GMB__REPLY__BODY_SNAPSHOT:
      out->kind = WIRE_ADMIN_SNAPSHOT;
      rc = wire_snapshot_in(r->snapshot, out);
      break;
    case GMB__REPLY__BODY_COMPACT:
      out->kind = WIRE_ADMIN_COMPACT;
      wire_compact_in(r->compact, &out->u.compact);
      break;
    case GMB__REPLY__BODY_NOMEM:
      out->kind = WIRE_NOMEM;
      out->u.nomem.request = r->nomem->request;
      out->u.nomem.free_total = r->nomem->free_total;
      out->u.nomem.largest_free = r->nomem->largest_free;
      out->u.nomem.unmovable = r->nomem->unmovable;
      if (r->nomem->n_holders > WIRE_HOLDERS_MAX) {
        rc = GMB_E_PROTO;
        break;
      }
      out->u.nomem.n_holders = r->nomem->n_holders;
      for (size_t i = 0; rc == 0 && i < r->nomem->n_holders; i++)
        rc = wire_str_copy(out->u.nomem.holders[i],
                           sizeof out->u.nomem.holders[i],
                           r->nomem->holders[i]);
      break;
    default:
      rc = GMB_E_PROTO;
      break;
  }
  gmb__reply__free_unpacked(r, NULL);
  if (rc) gmb__wire_reply_clear(out);
  return rc;
}

static void wire_status_clear(struct wire_admin_status *st) {
  free(st->tenants);
  st->tenants = NULL;
  st->n_tenants = 0;
  free(st->session_rows);
  st->session_rows = NULL;
  st->n_sessions = 0;
}

void gmb__wire_reply_clear(struct wire_reply *rep) {
  switch (rep->kind) {
    case WIRE_ADMIN_STATUS:
      wire_status_clear(&rep->u.admin_status);
      break;
    case WIRE_ADMIN_SNAPSHOT:
      wire_status_clear(&rep->u.snapshot.status);
      for (size_t i = 0; i < rep->u.snapshot.n_segments; i++)
        free(rep->u.snapshot.segments[i].ranges);
      free(rep->u.snapshot.segments);
      rep->u.snapshot.segments = NULL;
      rep->u.snapshot.n_segments = 0;
      break;
    case WIRE_ADMIN_METRICS:
      free(rep->u.metrics.text);
      rep->u.metrics.text = NULL;
      break;
    default:
      break;
  }
}

const char *gmb__wire_kind_name(enum wire_kind kind) {
  switch (kind) {
    case WIRE_NONE: return "none";
    case WIRE_HELLO: return "hello";
    case WIRE_ALLOC: return "alloc";
    case WIRE_FREE: return "free";
    case WIRE_STATS: return "stats";
    case WIRE_VMM: return "vmm";
    case WIRE_LOCK: return "lock";
    case WIRE_HEARTBEAT: return "heartbeat";
    case WIRE_BYE: return "bye";
    case WIRE_EVENT: return "event";
    case WIRE_ADMIN_STATUS: return "admin-status";
    case WIRE_ADMIN_COMPACT: return "admin-compact";
    case WIRE_NOMEM: return "nomem";
    case WIRE_ADMIN_QUOTA: return "admin-quota";
    case WIRE_ADMIN_RESERVE: return "admin-reserve";
    case WIRE_TENANT_ROW: return "tenant";
    case WIRE_ADMIN_EVICT: return "admin-evict";
    case WIRE_ADMIN_RELOAD: return "admin-reload";
    case WIRE_ADMIN_SNAPSHOT: return "admin-snapshot";
    case WIRE_ADMIN_METRICS: return "admin-metrics";
    case WIRE_SEGMENT_CLOSED: return "segment-closed";
    case WIRE_ADMIN_TENANT_ADD: return "admin-tenant-add";
    case WIRE_ADMIN_TENANT_REMOVE: return "admin-tenant-remove";
    case WIRE_SLEEP_NOTE: return "sleep-note";
    case WIRE_ADMIN_PAUSE: return "admin-pause";
    case WIRE_ADMIN_RESUME: return "admin-resume";
    case WIRE_KIND_COUNT: break;
  }
  return "unknown";
}

int gmb__wire_status_value(const char *name) {
  const ProtobufCEnumValue *v =
      protobuf_c_enum_descriptor_get_value_by_name(&gmb__status__descriptor,
                                                   name);
  return v ? v->value : INT_MIN;
}

size_t gmb__wire_status_count(void) {
  return gmb__status__descriptor.n_values;
}
