/*
 * admin.c - requests on the admin socket: what operators (gmbctl) ask.
 *
 * The admin socket is a separate ROUTER so that its file mode keeps jobs
 * out; each message is still checked against the uid that sent it, since
 * the mode alone cannot express `admin_uids`.  Every admin action that
 * changes something is logged with the uid that asked.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "broker.h"
#include "compact.h"
#include "observe.h"
#include "gmb.h"
#include "log.h"
#include "session.h"

int gmb__admin_reload(struct gmb_broker *b, char *err, size_t errcap) {
  (void)b;
  snprintf(err, errcap, "configuration reload is not implemented yet");
  return GMB_E_INVAL;
}

int gmb__admin_allowed(const struct gmb_broker *b, uid_t uid) {
  if (uid == geteuid()) return 1;
  for (size_t i = 0; i < b->cfg.n_admin_uids; i++)
    if (b->cfg.admin_uids[i] == uid) return 1;
  return 0;
}

struct admin_rows {
  struct wire_tenant_row *rows;
  size_t n, cap;
};

static int admin_row(void *ctx, struct gmb_tenant *t) {
  struct admin_rows *r = ctx;
  if (r->n == r->cap) return 1;
  struct gmb_arena_stats as;
  gmb__pool_arena_stats(t->arena, &as);
  struct wire_tenant_row *row = &r->rows[r->n++];
  snprintf(row->name, sizeof row->name, "%s", t->name);
  row->quota = t->quota;
  row->used = t->used;
  row->peak = t->peak;
  row->segments = as.segment_bytes;
  row->sessions = t->n_sessions;
  row->allocations = as.allocations;
  row->free_in_segments = as.free_total;
  row->largest_free = as.largest_free;
  row->fragmentation = gmb__fragmentation(as.largest_free, as.free_total);
  return 0;
}

static void admin_status(struct gmb_broker *b, struct wire_reply *rep) {
  struct gmb_pool_stats ps;
  gmb__pool_stats(b->pool, &ps);
  rep->kind = WIRE_ADMIN_STATUS;
  snprintf(rep->u.admin_status.device, sizeof rep->u.admin_status.device,
           "%s", b->dev->desc);
  rep->u.admin_status.capacity = ps.capacity;
  rep->u.admin_status.in_segments = ps.segment_bytes;
  rep->u.admin_status.in_use = ps.used;
  rep->u.admin_status.sessions = (uint32_t)gmb__sessions_count(b->sessions);
  rep->u.admin_status.fragmentation = gmb__defrag_device_fragmentation(
      b, &rep->u.admin_status.largest_free, NULL);
  rep->u.admin_status.compaction = b->compact_totals;
  struct admin_rows r = {0};
  r.cap = gmb__tenants_count(b->tenants);
  if (r.cap) {
    r.rows = calloc(r.cap, sizeof *r.rows);
    if (r.rows == NULL) {
      rep->kind = WIRE_NONE;
      rep->status = GMB_E_SYSTEM;
      snprintf(rep->message, sizeof rep->message, "out of host memory");
      return;
    }
    gmb__tenants_each(b->tenants, admin_row, &r);
  }
  rep->u.admin_status.tenants = r.rows; /* freed by gmb__wire_reply_clear */
  rep->u.admin_status.n_tenants = r.n;
}

int gmb__admin(struct gmb_broker *b, const struct gmb_peer *peer,
               const struct wire_request *req, struct wire_reply *rep) {
  memset(rep, 0, sizeof *rep);
  rep->id = req->id;
  if (!gmb__admin_allowed(b, peer->uid)) {
    log_warn("admin request from uid %u refused: not an admin uid",
             (unsigned)peer->uid);
    rep->status = GMB_E_AUTH;
    snprintf(rep->message, sizeof rep->message,
             "uid %u is not an admin of this broker (see admin_uids)",
             (unsigned)peer->uid);
    return 1;
  }
  switch (req->kind) {
    case WIRE_ADMIN_STATUS:
      admin_status(b, rep);
      return 1;
    case WIRE_ADMIN_COMPACT:
      gmb__defrag_admin(b, peer, req); /* answered when the run ends */
      return 0;
    case WIRE_ADMIN_SNAPSHOT:
      gmb__observe_snapshot(b, rep);
      return 1;
    case WIRE_ADMIN_METRICS:
      rep->u.metrics.text = gmb__observe_metrics(b);
      if (rep->u.metrics.text == NULL) {
        rep->status = GMB_E_PROTO;
        snprintf(rep->message, sizeof rep->message,
                 "metrics are not implemented by this broker yet");
      } else {
        rep->kind = WIRE_ADMIN_METRICS;
      }
      return 1;
    default:
      rep->status = GMB_E_PROTO;
      snprintf(rep->message, sizeof rep->message,
               "%s is not an admin request", gmb__wire_kind_name(req->kind));
      return 1;
  }
}
