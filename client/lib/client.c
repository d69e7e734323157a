/*
 * client.c - a session with the broker: gmb_connect, the request/reply
 * exchange, events, heartbeats, and the public calls built on them.
 *
 * One DEALER socket per client, in a ZeroMQ context of its own.  ZeroMQ
 * sockets are not thread-safe, so `io` guards the socket: it is used only
 * by the thread holding io.  An ordinary request holds io from send to
 * reply, and a reply is matched to it by id (ids increase from 1).  A
 * request that may wait at the broker for seconds (gmb_alloc_wait, a
 * gmb_lock that brings an offloaded allocation back) releases io while
 * it waits (client_call_wait): its reply is handed to it by whichever
 * thread reads the socket, and a reply that belongs to no request is late
 * for one that gave up, and is dropped.  Replies with id 0 are the
 * broker's events, handled by whoever reads them.
 *
 * A client becomes dead, for good, when the broker says it is shutting
 * down or ended the session, when the connection drops (seen through a
 * socket monitor), or when a reply does not come in time: after that every
 * call fails at once with GMB_E_CONN and the reason (GMB_E_EVICTED when
 * the broker said an operator evicted the tenant).  Nothing the broker
 * sends can make the library abort: what does not decode or does not fit
 * the request is GMB_E_PROTO.
 *
 * Lock order: restore_mu or trim_mu (never both), then io, then the
 * segment map's writer mutex (segmap.c), then hb_mu.  gmb_lock and
 * gmb_unlock take no lock (the segment map's readers are lock-free),
 * unless a segment has to be fetched again.
 *
 * Segments and the lock table come as descriptors over the descriptor
 * channel (fdclient.c, beside the ZeroMQ socket), proved at connect with
 * the secret of the Hello reply; the channel is used under `io` like the
 * socket.
 *
 * Movable allocations are locked through the session's lock table (the
 * layout and protocol are in locktab_layout.h), mapped at connect: gmb_lock is a
 * CAS on the allocation's slot and sends no message, except the first time
 * the allocation lands in a segment this process has not mapped.  While a
 * slot is MOVING the caller waits, holding none of the client's mutexes,
 * so a thread waiting for a move never delays another thread's call.
 *
 * On the cuda device (cuimport.c) the session attaches to the driver and the
 * device's primary context at connect, segments are virtual-memory imports
 * cached in the segment map like host mappings, and gmb_lock returns device
 * pointers.  A retired cuda segment is unmapped and then reported with a
 * SegmentClosed request, since the broker counts it as in use until every
 * session it was given to has unmapped it.  gmb_unlock_on_stream queues the
 * release of a hold on a stream; the lock table then outlives the client
 * until every such release ran (cuimport.c, gmb__cuda_unmap_later).
 *
 * gmb_malloc_async/gmb_free_async go through the session's cache
 * (cache.c), whose pages are pinned allocations of this session made and
 * freed with the ordinary requests and mapped into address space the
 * cache reserved; a hit takes no mutex of the client's and sends nothing.
 * On a GPU the cache records and queries events (cuimport.c).  A page
 * given back by the cache is not waited for (the cache gives back only
 * pages no stream's work can still use); the cache's records and mappings
 * are freed at disconnect, after the Bye that frees its pages.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "alloc_tags.h"
#include "cache.h"
#include "client.h"
#include "cuimport.h"
#include "endpoint.h"
#include "fdclient.h"
#include "fdpass.h"
#include "hostbuf.h"
#include "gmb.h"
#include "locktab_layout.h"
#include "segmap.h"
#include "sleep_policy.h"
#include "util.h"
#include "wire.h"

#define CLIENT_WHY_MAX (WIRE_MESSAGE_MAX + 256)
#define CLIENT_ENDPOINT_MAX 512
/* How often a cuda session without heartbeats reads its events: a retired
 * segment stays on the device until this process closed it, and an
 * application that only locks and unlocks sends nothing that would read
 * the retirement otherwise. */
#define CLIENT_CUDA_DRAIN_MS 100u
/* The library thread's longest period: how often it reads events (a TRIM
 * is answered within about this) and reports a change of the cache's
 * free bytes when nothing else carried it (at most one Heartbeat per
 * period: the report is rate-limited by this). */
#define CLIENT_REPORT_MS 20u
/* A trim ask on a GPU: tries of the trim, this far apart, while pages wait
 * for their streams' events (at most 25 ms, a quarter of the broker's
 * default bound). */
#define CLIENT_TRIM_TRIES 11
/* gmb_free_async reports a new idle page itself at most this often. */
#define CLIENT_SYNC_REPORT_NS (1000 * 1000u)
/* Idle bytes not reported yet past which a free reports them itself,
 * waiting a little for the socket if it must (client_io_lock_briefly): at
 * most one report per this many bytes freed, not left to the thread. */
#define CLIENT_SYNC_REPORT_BYTES (UINT64_C(8) << 20)
#define CLIENT_TRIM_RETRY_NS (2500 * 1000L)
/* The longest a request's receive waits before the socket monitor is
 * read (client_call): how late a broker that vanished without a word is
 * noticed by a request waiting for it. */
#define CLIENT_WAIT_TICK_MS 100
/* Requests of one client that may wait at the broker at once without
 * holding io (client_call_wait): the broker's default
 * max_waiters_per_session.  One more is refused with GMB_E_LIMIT before
 * it is sent. */
#define CLIENT_WAITERS_MAX 64

struct gmb_client {
  pthread_mutex_t io; /* the socket, next_id, hb_last_ns, dead_why */
  void *ctx, *sock;
  void *mon; /* PAIR end of the socket monitor; NULL if none */
  int lost;  /* the monitor saw the connection drop */
  int rcvtimeo_ms; /* the socket's ZMQ_RCVTIMEO now (client_rcvtimeo) */
  uint64_t next_id;
  atomic_int dead;
  char dead_why[CLIENT_WHY_MAX]; /* written once, before dead is set */
  int dead_code; /* what every call returns once dead: GMB_E_CONN, or
                    GMB_E_EVICTED when an operator evicted the tenant */
  int request_timeout_ms;
  char endpoint[CLIENT_ENDPOINT_MAX];
  char tenant[WIRE_NAME_MAX + 1];
  char device[WIRE_DEVICE_MAX];
  int cuda; /* device is "cuda": attached to the driver (cuimport.c) */
  int cuda_ordinal; /* cuda: the broker's GPU as this process numbers it */
  char device_uuid[WIRE_DEVICE_MAX]; /* cuda: "GPU-..." */
  char device_pci[WIRE_DEVICE_MAX];
  uint64_t session;
  int fdsock; /* the descriptor channel (fdclient.c); -1: none */
  struct gmb_segmap *map;
  struct gmb_cache *cache; /* gmb_malloc_async's; made at connect */

  /* The lock table; NULL when the broker gave none (movable allocations
   * are then never moved, and locked like pinned ones). */
  struct gmb__lt_header *lt;
  struct gmb__lt_slot *lt_slot;
  uint32_t lt_slots;
  size_t lt_bytes;
  int lock_timeout_ms; /* $GMB_LOCK_TIMEOUT_MS: longest wait for a move */

  /* Bytes a TRIM event asked for, not given back yet: the event is read
   * holding io, and giving pages back needs io, so the library thread
   * does it after (client_trim_asked). */
  _Atomic uint64_t trim_want;
  /* Held while an ask is answered (client_trim_asked), from taking
   * trim_want to the answer: gmb_cache_report waits on it for an answer
   * the library thread has begun. */
  pthread_mutex_t trim_mu;
  /* A trim that left idle pages while a CUDA graph capture was underway
   * (client_trim_settle): the bytes to keep, plus one (0: none).  The
   * library thread finishes it once no capture is seen. */
  _Atomic uint64_t trim_deferred;
  /* The cached_free the last request carried; written under io, read
   * without it by gmb_free_async (a hint whether to wake the thread). */
  _Atomic uint64_t reported;
  atomic_int wake_pending; /* gmb_free_async woke the thread, which has not
                              reported since */
  _Atomic uint64_t sync_report_ns; /* gmb_free_async's last report of its
                                      own (see there) */
  atomic_int cache_thread; /* the library thread runs for the cache */
  /* The sleep policy and the pauses asked of this session
   * (sleep_policy.h); the offer the last request carried (under io). */
  struct gmb_sleep_policy *pol;
  uint64_t offer_reported;
  int idle_reported; /* the policy's idle flag, as last sent */
  int resume_wait_ms; /* $GMB_RESUME_WAIT_MS: an allocation's auto-resume */
  /* Tagged gmb_alloc allocations (alloc_tags.c), and what the broker is
   * told of each tag: the cache's part (absolute, from its note) and the
   * allocations' part (added and taken by alloc_tags.c), summed in one
   * SleepNote per tag (under note_mu, taken before io). */
  struct gmb_atags *atags;
  pthread_mutex_t note_mu;
  struct client_tag_part {
    uint64_t host, device;
    int paused, mode, by;
  } tag_part[2][64]; /* [0] the cache's, [1] the allocations' */
  /* gmb_alloc, gmb_free and gmb_lock calls: with the tagged allocations'
   * uses, the sleep policy's sign of activity (client_sleep_activity). */
  atomic_uint_fast64_t alloc_calls;
  /* Reply routing: requests that wait at the broker (gmb_alloc_wait, the
   * Lock that brings an offloaded allocation back) do not hold io while
   * they wait (client_call_wait).  Each registers here the id of its
   * request and where its reply goes; whoever holds io and receives hands
   * that reply over (client_route).  When nobody else holds io, one of
   * the waiters reads the socket for all of them (`reader`), polling it
   * with `evfd`, which a thread that wants io writes (client_io_lock):
   * the reader then releases io at once.  Under io, except `reading` and
   * `io_want`, which are atomics so that a thread can see without io
   * whether it must wake the reader. */
  struct client_waiter {
    uint64_t id;            /* the request's id; 0: a free slot */
    struct wire_reply *rep; /* where its reply goes */
    int done;               /* the reply is in *rep */
  } waiter[CLIENT_WAITERS_MAX];
  unsigned n_waiters;   /* slots in use */
  unsigned n_ready;     /* replies handed over and not taken yet */
  unsigned io_sleepers; /* waiters in pthread_cond_wait on io_cv */
  int reader;           /* a waiter reads the socket holding io */
  pthread_cond_t io_cv; /* with io: a reply handed over, io released */
  atomic_int reading;   /* the reader is in zmq_poll: wake it by evfd */
  atomic_int io_want;   /* threads blocked in client_io_lock */
  int evfd;             /* eventfd; -1: none (no waiting without io) */
  /* The broker takes one Lock that brings an allocation back per session
   * at a time (a second is refused): client_restore sends them one by
   * one, holding this (taken before io) but not io while one waits. */
  pthread_mutex_t restore_mu;

  uint32_t hb_ms; /* 0: no heartbeats */
  uint32_t tick_ms; /* the heartbeat thread's period; 0: no thread */
  uint64_t hb_last_ns;
  pthread_t hb_thread;
  int hb_running;
  pthread_mutex_t hb_mu;
  pthread_cond_t hb_cv;
  int hb_stop;
};

/* --- the calling thread's last failure ------------------------------------ */

static _Thread_local char client_err[CLIENT_WHY_MAX + 32];

static int client_fail(int code, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

static int client_fail(int code, const char *fmt, ...) {
  char why[CLIENT_WHY_MAX];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(why, sizeof why, fmt, ap);
  va_end(ap);
  snprintf(client_err, sizeof client_err, "%s: %s", gmb_err_name(code),
           why[0] ? why : gmb_strerror(code));
  return code;
}

int gmb__client_fail(int code, const char *fmt, ...) {
  char why[CLIENT_WHY_MAX];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(why, sizeof why, fmt, ap);
  va_end(ap);
  return client_fail(code, "%s", why);
}

GMB_EXPORT const char *gmb_last_error(gmb_client *c) {
  (void)c; /* per thread, not per client: a failed connect has no client */
  return client_err[0] ? client_err : "no error";
}

/* --- small helpers ---------------------------------------------------------- */

static int client_env_ms(const char *name, int def) {
  const char *s = getenv(name);
  if (s == NULL || *s == '\0') return def;
  char *end;
  errno = 0;
  long v = strtol(s, &end, 10);
  if (errno || *end != '\0' || v <= 0 || v > 24L * 3600 * 1000) return def;
  return (int)v;
}

/* Marks the client dead with the first reason given; later ones are
 * dropped so the message names the cause, not a consequence.  Holds io. */
static void client_kill(gmb_client *c, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

static void client_kill(gmb_client *c, const char *fmt, ...) {
  if (atomic_load(&c->dead)) return;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(c->dead_why, sizeof c->dead_why, fmt, ap);
  va_end(ap);
  if (c->dead_code == 0) c->dead_code = GMB_E_CONN;
  atomic_store(&c->dead, 1);
  pthread_cond_broadcast(&c->io_cv); /* every waiter fails now */
}

/* Wakes the reader from zmq_poll.  Its failure (the counter full) still
 * leaves evfd readable. */
static void client_io_poke(gmb_client *c) {
  uint64_t one = 1;
  ssize_t n = write(c->evfd, &one, sizeof one);
  (void)n;
}

/* The time `ns` from now on `clock`, for the timed waits of pthreads. */
static struct timespec client_ts_in(clockid_t clock, uint64_t ns) {
  struct timespec ts;
  clock_gettime(clock, &ts);
  ns += (uint64_t)ts.tv_nsec;
  ts.tv_sec += (time_t)(ns / GMB_NS_PER_S);
  ts.tv_nsec = (long)(ns % GMB_NS_PER_S);
  return ts;
}

/* Takes io, by `until` (CLOCK_REALTIME) when not NULL: 0, or the
 * failure of pthread_mutex_timedlock. */
static int client_io_lock_until(gmb_client *c, const struct timespec *until) {
  if (pthread_mutex_trylock(&c->io) == 0) return 0;
  /* Sequentially consistent with the reader's store to `reading` and
   * load of io_want: either it sees this thread, or this thread sees it
   * polling and wakes it. */
  atomic_fetch_add(&c->io_want, 1);
  if (atomic_load(&c->reading)) client_io_poke(c);
  int rc = until ? pthread_mutex_timedlock(&c->io, until)
                 : pthread_mutex_lock(&c->io);
  atomic_fetch_sub(&c->io_want, 1);
  return rc;
}

/* Takes io for a request or the library thread's work. */
static void client_io_lock(gmb_client *c) { client_io_lock_until(c, NULL); }

/* Releases io, waking the waiters that sleep for it. */
static void client_io_unlock(gmb_client *c) {
  if (c->io_sleepers) pthread_cond_broadcast(&c->io_cv);
  pthread_mutex_unlock(&c->io);
}

static int client_dead_fail(gmb_client *c) {
  return client_fail(c->dead_code ? c->dead_code : GMB_E_CONN, "%s",
                     c->dead_why);
}

/* Sends one encoded request.  Returns 0; 1 with errno set when zmq_send
 * failed; a GMB_E_* code (explained) when it does not encode.  Holds io. */
static int client_send(gmb_client *c, struct wire_request *req, int flags) {
  uint8_t *buf;
  size_t len;
  req->id = ++c->next_id;
  /* The cache's free bytes ride on every request (heartbeats included):
   * the broker learns them without a message of their own. */
  req->cached_free = gmb__cache_cached(c->cache);
  c->reported = req->cached_free;
  /* And the holes between its blocks, which the broker does not charge to
   * the quota up to a bound.  They change with nearly every block, so no
   * report is sent for them alone: a page request carries them fresh. */
  req->cached_holes = gmb__cache_holes(c->cache);
  /* So does the sleep policy's offer, with how long the session idled. */
  if (gmb__sleep_policy_on(c->pol)) {
    req->sleep_pausable =
        gmb__sleep_policy_offer(c->pol, gmb__now_ns(), &req->sleep_idle_ms);
    c->offer_reported = req->sleep_pausable;
    req->sleep_idle = gmb__sleep_policy_idle(c->pol);
    c->idle_reported = req->sleep_idle;
  }
  int rc = gmb__wire_request_encode(req, &buf, &len);
  if (rc) return client_fail(rc, "cannot encode a %s request",
                             gmb__wire_kind_name(req->kind));
  rc = zmq_send(c->sock, buf, len, flags);
  int err = errno;
  free(buf);
  errno = err;
  return rc < 0 ? 1 : 0;
}

/* Holds io.  Heartbeats are sent by whoever holds the socket when one is
 * due: the heartbeat thread between calls, the waiting thread during a
 * long gmb_alloc_wait (which would otherwise starve the heartbeat thread
 * and get the session ended for silence). */
static void client_heartbeat_due(gmb_client *c) {
  if (c->hb_ms == 0 || atomic_load(&c->dead)) return;
  uint64_t now = gmb__now_ns();
  if (now - c->hb_last_ns < (uint64_t)c->hb_ms * GMB_NS_PER_MS) return;
  struct wire_request req = {.kind = WIRE_HEARTBEAT};
  /* A heartbeat that cannot go out now is not a reason to end the client:
   * a lost connection is reported by the monitor, with its cause. */
  if (client_send(c, &req, ZMQ_DONTWAIT) == 0) c->hb_last_ns = now;
}

/* Tells the broker the cache's free bytes when they changed since the
 * last request carried them: a Heartbeat (no reply) with the figure.
 * Holds io. */
static void client_report_due(gmb_client *c) {
  if (atomic_load(&c->dead)) return;
  uint64_t idle_ms;
  uint64_t offer = gmb__sleep_policy_on(c->pol)
                       ? gmb__sleep_policy_offer(c->pol, gmb__now_ns(),
                                                 &idle_ms)
                       : 0;
  if (gmb__cache_cached(c->cache) == c->reported &&
      offer == c->offer_reported &&
      gmb__sleep_policy_idle(c->pol) == c->idle_reported)
    return;
  struct wire_request req = {.kind = WIRE_HEARTBEAT};
  if (client_send(c, &req, ZMQ_DONTWAIT) == 0 && c->hb_ms)
    c->hb_last_ns = gmb__now_ns();
}

/* An event pushed by the broker.  Holds io. */
static void client_event(gmb_client *c, const struct wire_reply *ev) {
  switch (ev->u.event.kind) {
    case WIRE_EVENT_SEGMENT_RETIRED:
      gmb__segmap_retire(c->map, ev->u.event.segment);
      if (c->cuda && !atomic_load(&c->dead)) {
        /* Sent even for a segment never imported here: the broker counts
         * every session it gave the segment to.  No reply comes.  A send
         * that fails leaves the segment to be freed when the session
         * ends, which is the broker's fallback anyway. */
        struct wire_request closed = {.kind = WIRE_SEGMENT_CLOSED};
        closed.u.segment.segment = ev->u.event.segment;
        client_send(c, &closed, 0);
      }
      break;
    case WIRE_EVENT_SHUTDOWN:
      client_kill(c, "%s", ev->message[0] ? ev->message
                                          : "the broker is shutting down");
      break;
    case WIRE_EVENT_SESSION_ENDED:
      client_kill(c, "the broker ended this session: %s",
                  ev->message[0] ? ev->message : "no reason given");
      break;
    case WIRE_EVENT_EVICTED:
      /* Not a lost connection: an operator ended the session on purpose,
       * and the caller should not simply reconnect and retry. */
      if (!atomic_load(&c->dead)) c->dead_code = GMB_E_EVICTED;
      client_kill(c, "evicted: %s",
                  ev->message[0] ? ev->message : "by an operator");
      break;
    case WIRE_EVENT_SLEEP:
    case WIRE_EVENT_WAKE:
      /* Pause or resume tags: the broker's ask (answered like a trim) or
       * an operator's.  Done by the library thread, as a trim. */
      gmb__sleep_policy_event(c->pol, ev->u.event.kind == WIRE_EVENT_WAKE,
                              (int)ev->u.event.mode, ev->u.event.tag,
                              ev->u.event.bytes);
      if (c->hb_running) {
        pthread_mutex_lock(&c->hb_mu);
        pthread_cond_signal(&c->hb_cv);
        pthread_mutex_unlock(&c->hb_mu);
      }
      break;
    case WIRE_EVENT_TRIM:
      /* The broker wants cached memory back for another request.  Done
       * by the library thread once io is free; woken now. */
      atomic_store(&c->trim_want, ev->u.event.bytes ? ev->u.event.bytes : 1);
      if (c->hb_running) {
        pthread_mutex_lock(&c->hb_mu);
        pthread_cond_signal(&c->hb_cv);
        pthread_mutex_unlock(&c->hb_mu);
      }
      break;
    default:
      break; /* a kind from a newer broker: nothing this client must do */
  }
}

/* Reads what the socket monitor reported.  Holds io. */
static void client_monitor(gmb_client *c) {
  for (;;) {
    zmq_msg_t m;
    zmq_msg_init(&m);
    if (zmq_msg_recv(&m, c->mon, ZMQ_DONTWAIT) < 0) {
      zmq_msg_close(&m);
      return;
    }
    uint16_t event = 0;
    int first = zmq_msg_size(&m) >= 6;
    if (first) memcpy(&event, zmq_msg_data(&m), sizeof event);
    int more = zmq_msg_more(&m);
    zmq_msg_close(&m);
    while (more) { /* the second frame: the endpoint */
      zmq_msg_init(&m);
      if (zmq_msg_recv(&m, c->mon, 0) < 0) more = 0;
      else more = zmq_msg_more(&m);
      zmq_msg_close(&m);
    }
    if (first && event == ZMQ_EVENT_DISCONNECTED) c->lost = 1;
  }
}

/* 1 when a message waits on the socket.  ZMQ_EVENTS makes the socket
 * process its pending commands first: a message the I/O thread read
 * before it saw the connection drop is visible after this. */
static int client_readable(gmb_client *c) {
  int ev = 0;
  size_t len = sizeof ev;
  return zmq_getsockopt(c->sock, ZMQ_EVENTS, &ev, &len) == 0 &&
         (ev & ZMQ_POLLIN);
}

/* A dropped connection ends the client once everything the broker sent
 * before it went was read: its last words (SHUTDOWN) explain better. */
static void client_lost_check(gmb_client *c) {
  if (c->lost && !client_readable(c))
    client_kill(c, "the broker closed the connection");
}

/* Takes one message off the socket: without waiting (ZMQ_DONTWAIT in
 * flags), or waiting up to the socket's ZMQ_RCVTIMEO.  Returns 1 when
 * there was none (errno says why), 0 with *rep decoded, GMB_E_PROTO when
 * it did not decode.  Holds io. */
static int client_recv(gmb_client *c, struct wire_reply *rep, int flags) {
  zmq_msg_t m;
  zmq_msg_init(&m);
  if (zmq_msg_recv(&m, c->sock, flags) < 0) {
    int err = errno;
    zmq_msg_close(&m);
    errno = err;
    return 1;
  }
  /* One frame per message; anything else is not ours to understand. */
  int multi = zmq_msg_more(&m);
  int rc = multi ? GMB_E_PROTO
                 : gmb__wire_reply_decode(zmq_msg_data(&m), zmq_msg_size(&m),
                                          rep);
  zmq_msg_close(&m);
  while (multi) { /* drop the rest of a multi-frame message */
    zmq_msg_init(&m);
    if (zmq_msg_recv(&m, c->sock, 0) < 0) multi = 0;
    else multi = zmq_msg_more(&m);
    zmq_msg_close(&m);
  }
  if (rc) memset(rep, 0, sizeof *rep);
  return rc;
}

/* A reply that is not the one the caller waits for: a waiter's
 * (client_call_wait), handed over with what it owns, or late for a request
 * that gave up (dropped).  *rep is left empty.  Holds io. */
static void client_route(gmb_client *c, struct wire_reply *rep) {
  for (unsigned i = 0; c->n_waiters && rep->id && i < CLIENT_WAITERS_MAX;
       i++) {
    struct client_waiter *w = &c->waiter[i];
    if (w->id != rep->id || w->done) continue;
    *w->rep = *rep;
    w->done = 1;
    c->n_ready++;
    pthread_cond_broadcast(&c->io_cv);
    memset(rep, 0, sizeof *rep);
    return;
  }
  gmb__wire_reply_clear(rep);
  memset(rep, 0, sizeof *rep);
}

/* Handles what arrived since the last call: events, waiters' replies
 * (client_route), and late replies to requests that gave up (dropped).
 * Queued messages count before a dropped connection, so a broker that
 * said "shutting down" and then closed is reported as shutting down.
 * Holds io. */
static void client_drain(gmb_client *c) {
  struct wire_reply rep;
  int rc;
  if (c->mon) client_monitor(c);
  while ((rc = client_recv(c, &rep, ZMQ_DONTWAIT)) != 1) {
    if (rc == 0 && rep.id == 0 && rep.kind == WIRE_EVENT) client_event(c, &rep);
    if (rc == 0) client_route(c, &rep);
  }
  client_lost_check(c);
}

/* Sets the socket's receive timeout for the next wait, when it changed
 * (a setsockopt is no system call, but most waits use the same value).
 * Holds io. */
static void client_rcvtimeo(gmb_client *c, int ms) {
  if (ms == c->rcvtimeo_ms) return;
  if (zmq_setsockopt(c->sock, ZMQ_RCVTIMEO, &ms, sizeof ms) == 0)
    c->rcvtimeo_ms = ms;
}

/* Sends a request whose reply is to be waited for; on success its id is
 * req->id.  Holds io.  0 or the failure, explained (the client is dead
 * after a send that failed). */
static int client_call_send(gmb_client *c, struct wire_request *req) {
  if (atomic_load(&c->dead)) return client_dead_fail(c);
  int rc = client_send(c, req, 0);
  if (rc < 0) return rc; /* did not encode */
  if (rc == 1) {
    int err = errno;
    client_drain(c); /* the reason may have arrived meanwhile */
    if (err == EAGAIN)
      client_kill(c, "could not reach the broker at %s", c->endpoint);
    else
      client_kill(c, "send to the broker failed: %s", zmq_strerror(err));
    return client_dead_fail(c);
  }
  if (c->hb_ms) c->hb_last_ns = gmb__now_ns();
  return 0;
}

/* The reply to `req` arrived in *rep: 0 when it succeeded with body
 * `expect`, else the failure, explained (*rep cleared).  Holds io. */
static int client_reply_check(gmb_client *c, const struct wire_request *req,
                              enum wire_kind expect, struct wire_reply *rep) {
  if (rep->status != 0) {
    int rc = rep->status;
    if (rc == GMB_E_CONN && c->mon) {
      /* "No session on this connection": a broker that restarted
       * answers so on the connection libzmq made again. */
      client_monitor(c);
      if (c->lost) client_kill(c, "the broker closed the connection");
    }
    client_fail(rc, "%s", rep->message);
    gmb__wire_reply_clear(rep);
    if (atomic_load(&c->dead) && c->lost) return client_dead_fail(c);
    return rc;
  }
  if (rep->kind != expect) {
    client_fail(GMB_E_PROTO, "the broker answered a %s request with a %s "
                "reply", gmb__wire_kind_name(req->kind),
                gmb__wire_kind_name(rep->kind));
    gmb__wire_reply_clear(rep);
    return GMB_E_PROTO;
  }
  return 0;
}

/* The deadline of a request sent now that may wait wait_ms (negative: for
 * ever), and the receive tick left before it: at most CLIENT_WAIT_TICK_MS
 * or the heartbeat period.  0 when the deadline passed. */
static uint64_t client_deadline(int wait_ms) {
  return wait_ms < 0 ? UINT64_MAX
                     : gmb__now_ns() + (uint64_t)wait_ms * GMB_NS_PER_MS;
}

static long client_tick(const gmb_client *c, uint64_t deadline) {
  long timeout = CLIENT_WAIT_TICK_MS;
  if (c->hb_ms && (long)c->hb_ms < timeout) timeout = c->hb_ms;
  if (deadline != UINT64_MAX) {
    uint64_t now = gmb__now_ns();
    if (now >= deadline) return 0;
    long left = (long)((deadline - now + GMB_NS_PER_MS - 1) / GMB_NS_PER_MS);
    if (left < timeout) timeout = left;
  }
  return timeout;
}

/*
 * Sends `req` and waits up to wait_ms (negative: for ever) for its reply,
 * which must have body `expect` when it succeeds.  Holds io.  Returns 0
 * with *rep filled (the caller clears it), or the failure, explained.
 *
 * The request path is a send and a blocking receive, as a bare ZeroMQ
 * round trip is: each libzmq call that finds no message costs a poll()
 * and a getpid() (its fork check), so nothing is read before the send
 * (events, waiting requests' replies and late replies queued since the
 * last call are read by the receive, in order, before the reply; a
 * waiting request's is handed over, client_route), and the monitor is read
 * only when a receive times out.  A receive waits at most
 * CLIENT_WAIT_TICK_MS (or the heartbeat period, when shorter) before the
 * monitor is looked at: a broker that died without a word is noticed
 * within that, where a request it had been sent waited for its whole
 * timeout before.  A reply that says the session is gone (GMB_E_CONN)
 * also looks at the monitor, so a broker that restarted between calls
 * ends the client as one that closed the connection.
 */
static int client_call(gmb_client *c, struct wire_request *req,
                       enum wire_kind expect, int wait_ms,
                       struct wire_reply *rep) {
  memset(rep, 0, sizeof *rep);
  int rc = client_call_send(c, req);
  if (rc) return rc;
  uint64_t deadline = client_deadline(wait_ms);
  for (;;) {
    long timeout = client_tick(c, deadline);
    if (timeout == 0) {
      client_kill(c, "the broker did not answer within %d ms", wait_ms);
      return client_dead_fail(c);
    }
    client_rcvtimeo(c, (int)timeout);
    rc = client_recv(c, rep, 0);
    if (c->hb_ms) client_heartbeat_due(c);
    if (rc == 1) {
      if (errno != EAGAIN && errno != EINTR) {
        client_kill(c, "receive failed: %s", zmq_strerror(errno));
        return client_dead_fail(c);
      }
      /* Nothing within the tick: only now, with the socket empty, is a
       * dropped connection the answer (a reply or event queued before it
       * dropped is read first). */
      if (c->mon) client_monitor(c);
      client_lost_check(c);
      if (atomic_load(&c->dead)) return client_dead_fail(c);
      continue;
    }
    if (rc)
      return client_fail(GMB_E_PROTO,
                         "a reply from the broker could not be decoded");
    if (rep->id == 0) {
      if (rep->kind == WIRE_EVENT) client_event(c, rep);
      /* else: the broker's notice that it could not decode something. */
      gmb__wire_reply_clear(rep);
      memset(rep, 0, sizeof *rep);
      if (atomic_load(&c->dead)) return client_dead_fail(c);
      continue;
    }
    if (rep->id != req->id) { /* a waiter's, or late */
      client_route(c, rep);
      continue;
    }
    return client_reply_check(c, req, expect, rep);
  }
}

/* --- waiting without the socket -------------------------------------------
 *
 * A request that may wait at the broker for seconds (for room) must not
 * keep io: the memory it waits for may be what another thread of the
 * process frees, and the library thread needs io for its trims, pauses
 * and heartbeats.  client_call_wait sends under io, registers the
 * request (struct client_waiter), and then, while its reply has not been
 * handed over, either sleeps on io_cv (io released) or, when nobody else
 * needs io, reads the socket for every waiter (the leader of a
 * leader/follower scheme).  The reader polls the socket and `evfd`; a
 * thread that wants io while it polls writes evfd (client_io_lock), and
 * the reader releases io at once.  Since pthread mutexes are not fair, a
 * waiter does not take the reader's part again while a thread wants io
 * (io_want) or a reply waits for its waiter (n_ready): it sleeps on
 * io_cv, which every release of io wakes while it has sleepers
 * (client_io_unlock).
 *
 * The ordinary request path does not change: client_io_lock is a
 * trylock, and a write to evfd only happens while a waiter polls.
 */

/* The reader's part: waits up to timeout_ms for a message or for a thread
 * that wants io, then reads what came (client_drain: replies handed to
 * their waiters, events), sends a heartbeat when one is due, and notices
 * a dropped connection.  Holds io, and keeps it. */
static void client_wait_read(gmb_client *c, long timeout_ms) {
  c->reader = 1;
  atomic_store(&c->reading, 1);
  if (atomic_load(&c->io_want) == 0) {
    zmq_pollitem_t it[2] = {{c->sock, 0, ZMQ_POLLIN, 0},
                            {NULL, c->evfd, ZMQ_POLLIN, 0}};
    if (zmq_poll(it, 2, timeout_ms) > 0 && (it[1].revents & ZMQ_POLLIN)) {
      uint64_t v; /* a wake meant for an earlier poll is taken too */
      ssize_t n = read(c->evfd, &v, sizeof v);
      (void)n;
    }
  }
  atomic_store(&c->reading, 0);
  c->reader = 0;
  client_drain(c); /* and the monitor, and a dropped connection */
  if (c->hb_ms) client_heartbeat_due(c);
}

/*
 * client_call for a request that may wait at the broker: the same
 * contract (called holding io, returns holding io, *rep filled on
 * success), but io is released while the reply is awaited.  GMB_E_LIMIT
 * when CLIENT_WAITERS_MAX requests of this client wait already (nothing
 * sent).
 */
static int client_call_wait(gmb_client *c, struct wire_request *req,
                            enum wire_kind expect, int wait_ms,
                            struct wire_reply *rep) {
  memset(rep, 0, sizeof *rep);
  if (c->evfd < 0) return client_call(c, req, expect, wait_ms, rep);
  if (atomic_load(&c->dead)) return client_dead_fail(c);
  struct client_waiter *w = NULL;
  for (unsigned i = 0; i < CLIENT_WAITERS_MAX && w == NULL; i++)
    if (c->waiter[i].id == 0) w = &c->waiter[i];
  if (w == NULL)
    return client_fail(GMB_E_LIMIT, "%u requests of this process wait for "
                       "the broker already", CLIENT_WAITERS_MAX);
  int rc = client_call_send(c, req);
  if (rc) return rc;
  *w = (struct client_waiter){.id = req->id, .rep = rep};
  c->n_waiters++;
  uint64_t deadline = client_deadline(wait_ms);
  for (;;) {
    if (w->done) {
      c->n_ready--;
      rc = client_reply_check(c, req, expect, rep);
      break;
    }
    if (atomic_load(&c->dead)) {
      rc = client_dead_fail(c);
      break;
    }
    long timeout = client_tick(c, deadline);
    if (timeout == 0) {
      client_kill(c, "the broker did not answer within %d ms", wait_ms);
      rc = client_dead_fail(c);
      break;
    }
    if (c->reader || c->n_ready || atomic_load(&c->io_want)) {
      struct timespec ts =
          client_ts_in(CLOCK_MONOTONIC, (uint64_t)timeout * GMB_NS_PER_MS);
      c->io_sleepers++;
      pthread_cond_timedwait(&c->io_cv, &c->io, &ts);
      c->io_sleepers--;
      continue;
    }
    client_wait_read(c, timeout);
  }
  w->id = 0;
  w->rep = NULL;
  c->n_waiters--;
  return rc;
}

static struct gmb_cache *client_cache_new(gmb_client *c);
static struct gmb_atags *client_atags_new(gmb_client *c);
static struct gmb_sleep_policy *client_sleep_policy_new(gmb_client *c);

/* Trims the cache down to `keep` idle bytes without waiting for the
 * device.  On a GPU a page whose free memory was last used on a stream
 * goes back once an event recorded on that stream now has completed: the
 * first trim records, the next ones find it done.  A few short tries,
 * well inside the broker's bound.  Holds nothing. */
static void client_trim_to(gmb_client *c, uint64_t keep) {
  for (int i = 0; i < CLIENT_TRIM_TRIES; i++) {
    gmb__cache_trim(c->cache, keep, 0, NULL);
    if (!c->cuda || gmb__cache_cached(c->cache) <= keep) break;
    struct timespec ts = {0, CLIENT_TRIM_RETRY_NS};
    nanosleep(&ts, NULL);
  }
}

/* After a trim down to `keep`: when idle pages are left and a CUDA graph
 * capture is (or may be) underway in the process, the rest is deferred
 * to the library thread (client_trim_later), since what keeps them is
 * stream work that cannot be waited for now (no event can be recorded
 * on a capturing stream, and cuCtxSynchronize would break the capture).
 * The smallest `keep` asked wins. */
static void client_trim_settle(gmb_client *c, uint64_t keep) {
  if (!c->cuda || gmb__cache_cached(c->cache) <= keep) return;
  char why[256];
  if (gmb__cuda_capture_underway(c->cuda_ordinal, why, sizeof why) == 0)
    return;
  uint64_t want = keep == UINT64_MAX ? keep : keep + 1,
           cur = atomic_load(&c->trim_deferred);
  while ((cur == 0 || want < cur) &&
         !atomic_compare_exchange_weak(&c->trim_deferred, &cur, want)) {
  }
}

/* The library thread, at each tick: a deferred trim is done once no
 * capture is seen (in one round of tries, as a TRIM event's), or
 * deferred again when a capture is still, or again, underway.  Never a
 * wait for the device: this thread does not know the program's
 * captures. */
static void client_trim_later(gmb_client *c) {
  uint64_t want = atomic_load(&c->trim_deferred);
  if (want == 0 || c->cache == NULL) return;
  char why[256];
  if (gmb__cuda_capture_underway(c->cuda_ordinal, why, sizeof why) != 0)
    return;
  if (!atomic_compare_exchange_strong(&c->trim_deferred, &want, 0)) return;
  client_trim_to(c, want - 1);
  client_trim_settle(c, want - 1);
}

/* Tells the broker this session answered its last ask (trim or sleep),
 * whatever it could give: a Heartbeat with trim_answered, never waiting
 * for the socket. */
static void client_trim_answer(gmb_client *c) {
  struct wire_request req = {.kind = WIRE_HEARTBEAT, .trim_answered = 1};
  client_io_lock(c);
  if (!atomic_load(&c->dead) && client_send(c, &req, ZMQ_DONTWAIT) == 0 &&
      c->hb_ms)
    c->hb_last_ns = gmb__now_ns();
  client_io_unlock(c);
}

/* Answers a TRIM event: gives back up to the bytes asked of what the
 * cache holds free (idle pages).  Takes trim_mu (before io), so that
 * gmb_cache_report returns only after an answer begun here. */
static void client_trim_asked(gmb_client *c) {
  pthread_mutex_lock(&c->trim_mu);
  uint64_t want = atomic_exchange(&c->trim_want, 0);
  if (want == 0) {
    pthread_mutex_unlock(&c->trim_mu);
    return;
  }
  if (c->cache) {
    uint64_t cached = gmb__cache_cached(c->cache);
    uint64_t keep = cached > want ? cached - want : 0;
    client_trim_to(c, keep);
    client_trim_settle(c, keep);
  }
  /* The answer, after the pages' Frees (each waited for its reply): the
   * broker stops waiting for this session, whatever it could give (a
   * page with a block in use, or stream work not done, stays).  A
   * request it holds meanwhile is then served or falls through at once,
   * not at the end of the broker's bound. */
  client_trim_answer(c);
  pthread_mutex_unlock(&c->trim_mu);
}

/* Carries out pauses and resumes asked of this session, and answers the
 * broker's ask to sleep as a trim's (after the pages' and allocations'
 * Frees).  A thread waiting for memory meanwhile does not hold io
 * (client_call_wait), so a pause is not put off for it: its pages and
 * copies may be what the wait needs.  Holds nothing. */
static void client_sleep_asked(gmb_client *c) {
  if (!gmb__sleep_policy_pending(c->pol)) return;
  if (gmb__sleep_policy_run(c->pol, gmb__now_ns())) client_trim_answer(c);
}

/* --- heartbeats ------------------------------------------------------------- */

static void *client_heartbeat_main(void *arg) {
  gmb_client *c = arg;
  pthread_mutex_lock(&c->hb_mu);
  while (!c->hb_stop) {
    /* A wake that came while the thread was busy is not lost: it is
     * looked at here, under hb_mu, before waiting. */
    if (atomic_load(&c->trim_want) == 0 && !atomic_load(&c->wake_pending) &&
        !gmb__sleep_policy_pending(c->pol)) {
    struct timespec ts =
        client_ts_in(CLOCK_MONOTONIC, (uint64_t)c->tick_ms * GMB_NS_PER_MS);
    pthread_cond_timedwait(&c->hb_cv, &c->hb_mu, &ts);
    }
    if (c->hb_stop) break;
    pthread_mutex_unlock(&c->hb_mu);
    gmb__sleep_policy_look(c->pol, gmb__now_ns());
    client_io_lock(c);
    client_drain(c); /* events that came between calls */
    client_heartbeat_due(c);
    /* Cleared before the report: a page that goes idle after it wakes
     * the thread again. */
    atomic_store_explicit(&c->wake_pending, 0, memory_order_release);
    client_report_due(c);
    client_io_unlock(c);
    client_trim_asked(c);
    client_trim_later(c);
    client_sleep_asked(c);
    pthread_mutex_lock(&c->hb_mu);
  }
  pthread_mutex_unlock(&c->hb_mu);
  return NULL;
}

static int client_heartbeat_start(gmb_client *c) {
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  int rc = pthread_cond_init(&c->hb_cv, &ca);
  pthread_condattr_destroy(&ca);
  if (rc) return client_fail(GMB_E_SYSTEM, "pthread_cond_init: %s",
                             strerror(rc));
  pthread_mutex_init(&c->hb_mu, NULL);
  c->hb_last_ns = gmb__now_ns();
  rc = pthread_create(&c->hb_thread, NULL, client_heartbeat_main, c);
  if (rc) {
    pthread_cond_destroy(&c->hb_cv);
    pthread_mutex_destroy(&c->hb_mu);
    return client_fail(GMB_E_SYSTEM, "cannot start the heartbeat thread: %s",
                       strerror(rc));
  }
  c->hb_running = 1;
  return 0;
}

static void client_heartbeat_stop(gmb_client *c) {
  if (!c->hb_running) return;
  pthread_mutex_lock(&c->hb_mu);
  c->hb_stop = 1;
  pthread_cond_signal(&c->hb_cv);
  pthread_mutex_unlock(&c->hb_mu);
  pthread_join(c->hb_thread, NULL);
  pthread_cond_destroy(&c->hb_cv);
  pthread_mutex_destroy(&c->hb_mu);
  c->hb_running = 0;
}

/* --- connect and disconnect ------------------------------------------------- */

/* The token from $GMB_TOKEN or the file $GMB_TOKEN_FILE (one trailing
 * newline, as editors write it, is not part of the token). */
static int client_token(uint8_t *tok, uint32_t *len) {
  *len = 0;
  const char *s = getenv("GMB_TOKEN");
  if (s && *s) {
    size_t n = strlen(s);
    if (n > WIRE_TOKEN_MAX)
      return client_fail(GMB_E_INVAL, "GMB_TOKEN is longer than %d bytes",
                         WIRE_TOKEN_MAX);
    memcpy(tok, s, n);
    *len = (uint32_t)n;
    return 0;
  }
  const char *path = getenv("GMB_TOKEN_FILE");
  if (path == NULL || *path == '\0') return 0;
  FILE *f = fopen(path, "rb");
  if (f == NULL)
    return client_fail(GMB_E_INVAL, "GMB_TOKEN_FILE %s: %s", path,
                       strerror(errno));
  char buf[WIRE_TOKEN_MAX + 2];
  size_t n = fread(buf, 1, sizeof buf, f);
  int bad = ferror(f);
  fclose(f);
  if (bad)
    return client_fail(GMB_E_INVAL, "GMB_TOKEN_FILE %s: read error", path);
  if (n && buf[n - 1] == '\n') n--;
  if (n && buf[n - 1] == '\r') n--;
  if (n > WIRE_TOKEN_MAX)
    return client_fail(GMB_E_INVAL, "GMB_TOKEN_FILE %s: token longer than %d "
                       "bytes", path, WIRE_TOKEN_MAX);
  memcpy(tok, buf, n);
  *len = (uint32_t)n;
  return 0;
}

static void client_free(gmb_client *c) {
  if (c->sock) {
    if (c->mon) zmq_socket_monitor(c->sock, NULL, 0);
    zmq_close(c->sock);
  }
  if (c->mon) zmq_close(c->mon);
  if (c->ctx) zmq_ctx_term(c->ctx);
  if (c->fdsock >= 0) close(c->fdsock);
  /* Host functions queued by gmb_unlock_on_stream may still write into
   * the lock table; cuimport.c unmaps it once they all ran. */
  if (c->lt && c->cuda)
    gmb__cuda_unmap_later(c->lt, c->lt_bytes);
  else if (c->lt)
    munmap(c->lt, c->lt_bytes);
  gmb__segmap_destroy(c->map);
  gmb__cache_destroy(c->cache);
  gmb__atags_destroy(c->atags);
  /* Host buffers kept for a next pause (pinned memory, on a GPU, is the
   * host's to share) go with the session; another session of the process
   * keeps what it holds and keeps from then on. */
  gmb__hostbuf_release();
  gmb__sleep_policy_destroy(c->pol);
  pthread_mutex_destroy(&c->io);
  pthread_mutex_destroy(&c->note_mu);
  pthread_mutex_destroy(&c->restore_mu);
  pthread_mutex_destroy(&c->trim_mu);
  pthread_cond_destroy(&c->io_cv);
  if (c->evfd >= 0) close(c->evfd);
  free(c);
}

/* Opens the socket and its monitor.  The monitor is what tells a client
 * blocked in gmb_alloc_wait for ever that the broker is gone. */
static int client_open(gmb_client *c, int connect_ms) {
  int zero = 0;
  c->ctx = zmq_ctx_new();
  if (c->ctx == NULL) return client_fail(GMB_E_SYSTEM, "zmq_ctx_new failed");
  c->sock = zmq_socket(c->ctx, ZMQ_DEALER);
  if (c->sock == NULL)
    return client_fail(GMB_E_SYSTEM, "zmq_socket: %s", zmq_strerror(errno));
  zmq_setsockopt(c->sock, ZMQ_LINGER, &zero, sizeof zero);
  c->rcvtimeo_ms = -1; /* libzmq's default: client_rcvtimeo sets it */
  /* Not ZMQ_IMMEDIATE: with it, libzmq terminates the pipe when the
   * connection drops and discards what this side had not read yet, which
   * loses the broker's last words (SHUTDOWN, or the reply to the request
   * in flight).  The endpoint probe and the monitor do what IMMEDIATE
   * would: no request waits on a broker that is not there. */
  zmq_setsockopt(c->sock, ZMQ_IMMEDIATE, &zero, sizeof zero);
  zmq_setsockopt(c->sock, ZMQ_SNDTIMEO, &connect_ms, sizeof connect_ms);
  char mon_ep[64];
  snprintf(mon_ep, sizeof mon_ep, "inproc://gmb-monitor-%p", (void *)c);
  if (zmq_socket_monitor(c->sock, mon_ep, ZMQ_EVENT_DISCONNECTED) == 0) {
    c->mon = zmq_socket(c->ctx, ZMQ_PAIR);
    if (c->mon) {
      zmq_setsockopt(c->mon, ZMQ_LINGER, &zero, sizeof zero);
      if (zmq_connect(c->mon, mon_ep) != 0) {
        zmq_close(c->mon);
        c->mon = NULL;
      }
    }
    if (c->mon == NULL) zmq_socket_monitor(c->sock, NULL, 0);
  }
  /* Without it a waiting request holds io as any other (client_call_wait). */
  c->evfd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (zmq_connect(c->sock, c->endpoint) != 0)
    return client_fail(GMB_E_CONN, "cannot connect to %s: %s", c->endpoint,
                       zmq_strerror(errno));
  return 0;
}

/*
 * Maps the lock table whose descriptor the descriptor channel gave (of
 * `bytes` bytes, as the broker said) and checks that it is the table of
 * this session with `slots` slots.  Returns 0 or the failure, explained:
 * GMB_E_PROTO for a size or header that is not what the broker announced;
 * GMB_E_SYSTEM when it cannot be mapped.  The caller closes fd.
 */
static int client_locktab_map(gmb_client *c, int fd, uint64_t bytes,
                              uint32_t slots) {
  if (slots == 0)
    return client_fail(GMB_E_PROTO, "the lock table has 0 slots");
  if (bytes != gmb__lt_bytes(slots) || bytes > SIZE_MAX)
    return client_fail(GMB_E_PROTO, "a lock table of %llu bytes cannot "
                       "hold %u slots", (unsigned long long)bytes, slots);
  struct stat st;
  /* Checked before mmap: touching a mapping past the end of a short file
   * raises SIGBUS in the application. */
  int seals = fcntl(fd, F_GET_SEALS);
  if (fstat(fd, &st) != 0 || st.st_size < 0 ||
      (uint64_t)st.st_size < bytes || seals < 0 || !(seals & F_SEAL_SHRINK))
    return client_fail(GMB_E_PROTO, "the lock table's descriptor is shorter "
                       "than %u slots or not sealed", slots);
  void *p = mmap(NULL, (size_t)bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd,
                 0);
  if (p == MAP_FAILED)
    return client_fail(GMB_E_SYSTEM, "lock table: mmap: %s",
                       strerror(errno));
  struct gmb__lt_header *h = p;
  const char *bad = NULL;
  if (__atomic_load_n(&h->magic, __ATOMIC_ACQUIRE) != GMB_LT_MAGIC)
    bad = "magic";
  else if (h->version != GMB_LT_VERSION)
    bad = "version";
  else if (h->slots != slots)
    bad = "slot count";
  else if (h->session != c->session)
    bad = "session";
  if (bad) {
    munmap(p, (size_t)bytes);
    return client_fail(GMB_E_PROTO, "lock table: wrong %s in its header",
                       bad);
  }
  c->lt = h;
  c->lt_slot = gmb__lt_slots(h);
  c->lt_slots = slots;
  c->lt_bytes = (size_t)bytes;
  return 0;
}

GMB_EXPORT int gmb_connect(const char *endpoint, const char *tenant,
                           gmb_client **out) {
  if (out == NULL) return client_fail(GMB_E_INVAL, "out is NULL");
  *out = NULL;

  char hint[CLIENT_ENDPOINT_MAX + 64] = "";
  char ep[CLIENT_ENDPOINT_MAX];
  if (endpoint == NULL) endpoint = getenv("GMB_ENDPOINT");
  if (endpoint == NULL || *endpoint == '\0') {
    char dir[CLIENT_ENDPOINT_MAX - 32];
    if (gmb__run_dir(dir, sizeof dir) == NULL ||
        gmb__endpoint_default(dir, "broker.sock", ep, sizeof ep) == NULL)
      return client_fail(GMB_E_INVAL, "the run directory's name is too long");
    snprintf(hint, sizeof hint, "is gmb-broker running? GMB_RUN_DIR=%s", dir);
    endpoint = ep;
  } else {
    snprintf(hint, sizeof hint, "is gmb-broker running?");
  }
  if (strlen(endpoint) >= CLIENT_ENDPOINT_MAX)
    return client_fail(GMB_E_INVAL, "endpoint is too long");

  if (tenant == NULL) tenant = getenv("GMB_TENANT");
  if (tenant == NULL) tenant = "";
  if (*tenant && !gmb__name_valid(tenant))
    return client_fail(GMB_E_INVAL, "bad tenant name \"%.80s\" (1..63 of "
                       "A-Z a-z 0-9 . _ -, not starting with . or -)", tenant);

  struct wire_request hello = {.kind = WIRE_HELLO};
  int rc = client_token(hello.u.hello.token, &hello.u.hello.token_len);
  if (rc) return rc;
  hello.u.hello.version = WIRE_PROTOCOL_VERSION;
  snprintf(hello.u.hello.tenant, sizeof hello.u.hello.tenant, "%s", tenant);
  hello.u.hello.pid = (int32_t)getpid();
  snprintf(hello.u.hello.client, sizeof hello.u.hello.client, "libgmb %s",
           GMB_VERSION_STRING);

  char why[CLIENT_WHY_MAX];
  rc = gmb__endpoint_probe(endpoint, hint, why, sizeof why);
  if (rc) return client_fail(rc, "%s", why);
  /* Only a broker this uid can trust to be the broker gets its token or
   * its memory: the run dir and socket are root's, ours, or the broker
   * user's that root made, and nobody else may put a socket there. */
  rc = gmb__endpoint_trusted(endpoint, geteuid(), why, sizeof why);
  if (rc) {
    int had_token = hello.u.hello.token_len > 0;
    explicit_bzero(hello.u.hello.token, sizeof hello.u.hello.token);
    return client_fail(rc, "%s%s", had_token ? "token not sent: " :
                       "not connecting: ", why);
  }

  gmb_client *c = calloc(1, sizeof *c);
  if (c == NULL) return client_fail(GMB_E_SYSTEM, "out of memory");
  pthread_mutex_init(&c->io, NULL);
  pthread_mutex_init(&c->note_mu, NULL);
  pthread_mutex_init(&c->restore_mu, NULL);
  pthread_mutex_init(&c->trim_mu, NULL);
  c->evfd = -1;
  c->fdsock = -1;
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&c->io_cv, &ca);
  pthread_condattr_destroy(&ca);
  snprintf(c->endpoint, sizeof c->endpoint, "%s", endpoint);
  c->request_timeout_ms = client_env_ms("GMB_REQUEST_TIMEOUT_MS", 10000);
  c->lock_timeout_ms = client_env_ms("GMB_LOCK_TIMEOUT_MS", 10000);
  c->resume_wait_ms = client_env_ms("GMB_RESUME_WAIT_MS", 10000);
  c->map = gmb__segmap_new();
  c->pol = client_sleep_policy_new(c);
  if (c->map == NULL || c->pol == NULL) {
    client_free(c);
    return client_fail(GMB_E_SYSTEM, "out of memory");
  }
  int connect_ms = client_env_ms("GMB_CONNECT_TIMEOUT_MS", 5000);
  rc = client_open(c, connect_ms);
  struct wire_reply rep;
  if (rc == 0) {
    client_io_lock(c);
    rc = client_call(c, &hello, WIRE_HELLO, connect_ms, &rep);
    client_io_unlock(c);
  }
  if (rc == 0 && rep.u.hello.version != WIRE_PROTOCOL_VERSION)
    rc = client_fail(GMB_E_PROTO, "the broker speaks protocol %u, libgmb %s "
                     "speaks %d", rep.u.hello.version, GMB_VERSION_STRING,
                     WIRE_PROTOCOL_VERSION);
  if (rc) {
    client_free(c);
    return rc;
  }
  snprintf(c->tenant, sizeof c->tenant, "%s", rep.u.hello.tenant);
  snprintf(c->device, sizeof c->device, "%s", rep.u.hello.device);
  snprintf(c->device_uuid, sizeof c->device_uuid, "%s",
           rep.u.hello.device_uuid);
  snprintf(c->device_pci, sizeof c->device_pci, "%s", rep.u.hello.device_pci);
  c->cuda_ordinal = -1;
  c->session = rep.u.hello.session;
  uint32_t hb_ms = rep.u.hello.heartbeat_ms;
  uint32_t lt_slots = rep.u.hello.lock_slots;
  uint64_t host_quota = rep.u.hello.host_quota;
  uint8_t secret[GMB_FD_SECRET_LEN];
  int have_secret = rep.u.hello.fd_secret_len == sizeof secret;
  if (have_secret) memcpy(secret, rep.u.hello.fd_secret, sizeof secret);
  gmb__wire_reply_clear(&rep);
  zmq_setsockopt(c->sock, ZMQ_SNDTIMEO, &c->request_timeout_ms,
                 sizeof c->request_timeout_ms);
  if (strcmp(c->device, "cuda") == 0) {
    /* Before anything is imported, and before the lock table is mapped,
     * so that a table of a cuda session is always unmapped through
     * cuimport.c.  The GPU is found by the UUID the broker gave: its
     * ordinal here may differ from the broker's. */
    rc = gmb__cuda_attach(c->device_uuid, &c->cuda_ordinal, why, sizeof why);
    if (rc) {
      client_fail(rc, "the broker's device is cuda (%s%s%s): %s",
                  c->device_uuid[0] ? c->device_uuid : "no UUID",
                  c->device_pci[0] ? ", PCI " : "", c->device_pci, why);
      gmb_disconnect(c);
      return rc;
    }
    c->cuda = 1;
    gmb__segmap_set_cuda(c->map, c->cuda_ordinal);
  }
  /* The descriptor channel: the lock table now, segments as they come. */
  int lt_fd = -1;
  uint64_t lt_bytes = 0;
  rc = have_secret ? gmb__fdclient_connect(c->endpoint, c->session, secret,
                                           connect_ms, &c->fdsock, &lt_fd,
                                           &lt_bytes, why, sizeof why)
                   : GMB_E_PROTO;
  if (!have_secret) snprintf(why, sizeof why, "the Hello reply has no secret "
                             "for the descriptor channel");
  if (rc == 0) {
    /* From now on its requests wait as long as the socket's. */
    gmb__fdclient_timeout(c->fdsock, c->request_timeout_ms);
    rc = client_locktab_map(c, lt_fd, lt_bytes, lt_slots);
    close(lt_fd);
  } else {
    client_fail(rc, "%s", why);
  }
  if (rc) {
    gmb_disconnect(c); /* says Bye; keeps this thread's last error */
    return rc;
  }
  c->cache = client_cache_new(c);
  c->atags = c->cache ? client_atags_new(c) : NULL;
  if (c->cache == NULL || c->atags == NULL) {
    client_fail(GMB_E_SYSTEM, "out of memory");
    gmb_disconnect(c);
    return GMB_E_SYSTEM;
  }
  /* The host memory that gmb_pause may hold for this process. */
  const char *hq = getenv("GMB_HOST_QUOTA");
  if (hq && hq[0]) {
    uint64_t bytes;
    if (gmb__size_parse(hq, &bytes) != 0) {
      client_fail(GMB_E_INVAL, "GMB_HOST_QUOTA=%s is not a size (such as "
                  "512MiB or 20GiB)", hq);
      gmb_disconnect(c);
      return GMB_E_INVAL;
    }
    if (bytes && (host_quota == 0 || bytes < host_quota)) host_quota = bytes;
  }
  /* The tenant's host_quota (the broker's, for all its processes) bounds
   * this process too; the broker checks the sum at each pause. */
  gmb__cache_host_quota_set(c->cache, host_quota);
  const char *pol = getenv("GMB_SLEEP_POLICY");
  if (pol && pol[0]) {
    rc = gmb__sleep_policy_set(c->pol, pol, why, sizeof why);
    if (rc) {
      client_fail(rc, "GMB_SLEEP_POLICY=%s: %s", pol, why);
      gmb_disconnect(c);
      return rc;
    }
  }
  /* A cuda session runs the thread without heartbeats too (the broker
   * watches its pid), only to read events: see CLIENT_CUDA_DRAIN_MS.  A
   * session that uses the cache gets it at its first gmb_malloc_async
   * (client_cache_thread), and not before: a process that never caches
   * keeps the threads it had (fewer threads to be caught by a fork). */
  c->hb_ms = hb_ms;
  uint32_t tick_ms = hb_ms ? hb_ms : c->cuda ? CLIENT_CUDA_DRAIN_MS : 0;
  if (tick_ms) {
    c->hb_ms = hb_ms;
    c->tick_ms = tick_ms;
    rc = client_heartbeat_start(c);
    if (rc) {
      gmb_disconnect(c);
      return rc;
    }
  }
  *out = c;
  return 0;
}

GMB_EXPORT void gmb_disconnect(gmb_client *c) {
  if (c == NULL) return;
  client_heartbeat_stop(c);
  /* Saying Bye frees the session's memory at once rather than when the
   * broker notices the process is gone; a broker that does not answer
   * within a second is not worth waiting for.  The caller's last error
   * stays what it was: this function cannot fail. */
  char saved[sizeof client_err];
  memcpy(saved, client_err, sizeof saved);
  client_io_lock(c);
  /* Imports are closed before Bye: once the session is over the broker
   * may free the segments, and freeing memory another process still has
   * open is undefined behaviour in CUDA. */
  gmb__segmap_unmap_all(c->map);
  if (!atomic_load(&c->dead)) {
    struct wire_request bye = {.kind = WIRE_BYE};
    struct wire_reply rep;
    int bye_ms = 1000;
    zmq_setsockopt(c->sock, ZMQ_SNDTIMEO, &bye_ms, sizeof bye_ms);
    if (client_call(c, &bye, WIRE_NONE, bye_ms, &rep) == 0)
      gmb__wire_reply_clear(&rep);
  }
  client_io_unlock(c);
  memcpy(client_err, saved, sizeof saved);
  client_free(c);
}

/* --- allocations -------------------------------------------------------------- */

/* Gets a segment's descriptor from the descriptor channel and maps it.
 * Holds io. */
static int client_fetch_segment(gmb_client *c, uint64_t segment) {
  char why[CLIENT_WHY_MAX];
  int fd = -1;
  uint64_t size = 0;
  int rc = gmb__fdclient_segment(&c->fdsock, segment, &fd, &size, why,
                                 sizeof why);
  if (rc == 0) {
    rc = gmb__segmap_map(c->map, c->device, segment, size, fd, why,
                         sizeof why);
    close(fd);
  }
  return rc ? client_fail(rc, "%s", why) : 0;
}

/* A large allocation with a tail (the broker's pool.h, rule 1): the pages
 * of its own segment and the small segment that holds its tail, mapped
 * side by side in a view (segmap.h) whose id it is recorded in (*seg), at
 * *off.  The tail at the small segment's start: that segment after the
 * pages; at its end: before them.  Holds io. */
static int client_map_large(gmb_client *c, const struct wire_reply *rep,
                            uint64_t *seg, uint64_t *off) {
  const uint64_t id = rep->u.alloc.id, size = rep->u.alloc.size,
                 tail = rep->u.alloc.tail_size, toff = rep->u.alloc.tail_offset;
  if (tail >= GMB_SEGMAP_PAGE || tail >= size || rep->u.alloc.offset != 0 ||
      (toff != 0 && toff != GMB_SEGMAP_PAGE - tail) ||
      rep->u.alloc.tail_segment == 0 ||
      rep->u.alloc.tail_segment == rep->u.alloc.segment)
    return client_fail(GMB_E_PROTO, "allocation %llu: a tail of %llu bytes "
                       "at %llu of segment %llu is impossible",
                       (unsigned long long)id, (unsigned long long)tail,
                       (unsigned long long)rep->u.alloc.tail_offset,
                       (unsigned long long)rep->u.alloc.tail_segment);
  char why[CLIENT_WHY_MAX];
  int fd[2] = {-1, -1};
  uint64_t got[2] = {0, 0};
  const uint64_t segs[2] = {rep->u.alloc.segment, rep->u.alloc.tail_segment};
  const uint64_t want[2] = {size - tail, GMB_SEGMAP_PAGE};
  int rc = 0;
  for (int i = 0; i < 2 && rc == 0; i++) {
    rc = gmb__fdclient_segment(&c->fdsock, segs[i], &fd[i], &got[i], why,
                               sizeof why);
    if (rc == 0 && got[i] != want[i]) {
      snprintf(why, sizeof why, "allocation %llu: segment %llu has %llu "
               "bytes, not %llu", (unsigned long long)id,
               (unsigned long long)segs[i], (unsigned long long)got[i],
               (unsigned long long)want[i]);
      rc = GMB_E_PROTO;
    }
  }
  if (rc == 0)
    rc = gmb__segmap_view(c->map, c->device, want[0], fd[0], fd[1], toff != 0,
                          seg, why, sizeof why);
  *off = toff;
  for (int i = 0; i < 2; i++)
    if (fd[i] >= 0) close(fd[i]);
  return rc ? client_fail(rc, "%s", why) : 0;
}

/* Frees allocations ids[0..n) (n <= WIRE_PAGES_MAX) in one Free message,
 * without waiting for the device.  Holds io.  0 or the failure. */
static int client_free_ids(gmb_client *c, const uint64_t *ids, unsigned n) {
  struct wire_request req = {.kind = WIRE_FREE};
  struct wire_reply rep;
  req.u.free.id = ids[0];
  req.u.free.n_more = n - 1;
  for (unsigned i = 1; i < n; i++) req.u.free.more[i - 1] = ids[i];
  int rc = client_call(c, &req, WIRE_NONE, c->request_timeout_ms, &rep);
  if (rc == 0) gmb__wire_reply_clear(&rep);
  return rc;
}

/* Gives back allocations ids[0..n) this client could not use, so that
 * they do not count against the tenant until the session ends.  Best
 * effort; the failure the caller reports is the one that made it
 * necessary.  Holds io. */
static void client_undo_alloc(gmb_client *c, const uint64_t *ids, unsigned n) {
  if (n == 0 || ids[0] == 0 || atomic_load(&c->dead)) return;
  char saved[sizeof client_err];
  memcpy(saved, client_err, sizeof saved);
  client_free_ids(c, ids, n);
  memcpy(client_err, saved, sizeof saved);
}

static int client_free_id(gmb_client *c, gmb_id id, int sync);

/* 1 when the allocation of slot s is not in segment `seg` any more: being
 * moved, offloaded, or moved elsewhere. */
static int client_slot_left(struct gmb__lt_slot *s, uint64_t seg) {
  uint32_t st = atomic_load_explicit(&s->state, memory_order_acquire);
  return (st & GMB_LT_MOVING) ||
         __atomic_load_n(&s->segment, __ATOMIC_RELAXED) != seg;
}

/* An allocation at the broker, with no tag. */
static int client_alloc_raw(gmb_client *c, size_t size, unsigned flags,
                            int timeout_ms, gmb_id *out) {
  *out = 0;
  if (size == 0) return client_fail(GMB_E_INVAL, "size 0");
  if (flags & ~GMB_MOVABLE)
    return client_fail(GMB_E_INVAL, "unknown flags 0x%x", flags & ~GMB_MOVABLE);
  if (timeout_ms < 0) timeout_ms = -1;

  struct wire_request req = {.kind = WIRE_ALLOC};
  req.u.alloc.size = size;
  req.u.alloc.flags = flags;
  req.u.alloc.timeout_ms = timeout_ms;
  /* A waiting request may take its whole wait before the broker answers. */
  int wait_ms = timeout_ms < 0 ? -1
                : timeout_ms > INT32_MAX - c->request_timeout_ms
                    ? INT32_MAX
                    : timeout_ms + c->request_timeout_ms;
  struct wire_reply rep;
  char why[CLIENT_WHY_MAX];
  client_io_lock(c);
  int rc = timeout_ms == 0
               ? client_call(c, &req, WIRE_ALLOC, wait_ms, &rep)
               : client_call_wait(c, &req, WIRE_ALLOC, wait_ms, &rep);
  if (rc) goto out;
  const uint64_t id = rep.u.alloc.id, asize = rep.u.alloc.size;
  uint64_t seg = rep.u.alloc.segment, off = rep.u.alloc.offset;
  /* A large allocation never moves: the broker gives it no slot. */
  if (rep.u.alloc.pinned) flags &= ~(unsigned)GMB_MOVABLE;
  if (id == 0 || asize < size) {
    rc = client_fail(GMB_E_PROTO, "the broker answered an alloc of %zu bytes "
                     "with id %llu of %llu bytes", size,
                     (unsigned long long)id, (unsigned long long)asize);
    goto undo;
  }
  /* A segment this process has not mapped yet: its descriptor now (the
   * range is checked against the segment's size by gmb__segmap_add).  A
   * large allocation with a tail gets a view of its two segments. */
  uint32_t slot = GMB_SEGMAP_NO_SLOT;
  if ((flags & GMB_MOVABLE) && c->lt) {
    slot = rep.u.alloc.slot;
    uint64_t sid = slot < c->lt_slots
                       ? __atomic_load_n(&c->lt_slot[slot].id, __ATOMIC_RELAXED)
                       : 0;
    if (sid != id) {
      rc = client_fail(GMB_E_PROTO, "movable allocation %llu: lock table slot "
                       "%u %s", (unsigned long long)id, slot,
                       slot < c->lt_slots ? "serves another allocation"
                                          : "is out of range");
      goto undo;
    }
  }
  if (rep.u.alloc.tail_size) {
    rc = client_map_large(c, &rep, &seg, &off);
    if (rc) goto undo;
  } else if (!gmb__segmap_has_segment(c->map, seg)) {
    rc = client_fetch_segment(c, seg);
    /* A movable allocation may leave its segment between the reply and
     * the descriptor's request (a compaction, an operator's pause that
     * offloads it), and the segment, emptied, may be gone: its slot then
     * says where it is, and gmb_lock maps that. */
    if (rc == GMB_E_NOENT && slot != GMB_SEGMAP_NO_SLOT &&
        client_slot_left(&c->lt_slot[slot], seg))
      rc = 0;
    if (rc) goto undo;
  }
  rc = gmb__segmap_add(c->map, id, seg, off, asize, flags, slot, why,
                       sizeof why);
  if (rc) {
    client_fail(rc, "%s", why);
    if (seg & GMB_SEGMAP_VIEW) gmb__segmap_view_drop(c->map, seg);
    goto undo;
  }
  *out = id;
  goto out;
undo:
  client_undo_alloc(c, &id, 1);
out:
  client_io_unlock(c);
  return rc;
}

static int client_tag_wake(gmb_client *c, const char *tag, const char *what,
                           int *by);
static int client_cache_thread(gmb_client *c);

/* A tagged allocation's tries: each one that completes after its tag's
 * allocations paused meanwhile is given back and asked again, once the
 * tag resumed (client_alloc). */
#define CLIENT_ALLOC_ROUNDS 8

/* The thread's tag `tag` before an allocation into it: paused for another
 * job, it resumes now; one whose allocations the application or an
 * operator paused refuses it (explained). */
static int client_tag_admits(gmb_client *c, int tag) {
  int apaused = gmb__atags_paused(c->atags, tag);
  if (!apaused && !gmb__cache_tag_paused(c->cache)) return 0;
  char what[CLIENT_WHY_MAX];
  snprintf(what, sizeof what, "the thread's tag \"%s\"",
           gmb__cache_tag_name(c->cache, tag));
  int by, wrc = client_tag_wake(c, gmb__cache_tag_name(c->cache, tag), what,
                                &by);
  /* Only the cache part paused by the application or an operator: an
   * allocation of its own may still be made, as before any pause. */
  return wrc && (apaused || by == GMB_CACHE_BY_BROKER) ? wrc : 0;
}

/* An allocation, recorded under the thread's current tag if it has one
 * (alloc_tags.c).  A tag paused for another job resumes first; one whose
 * allocations the application or an operator paused refuses it.  An
 * allocation that completes after its tag's allocations were paused
 * meanwhile (a gmb_alloc_wait pending at the broker while another thread,
 * an operator or the broker paused the tag) is treated as one asked after
 * the pause: given back, and asked again as such (refused, or made once
 * the tag resumed), so that a paused tag never holds device memory. */
static int client_alloc(gmb_client *c, size_t size, unsigned flags,
                        int timeout_ms, gmb_id *out) {
  if (c == NULL) return client_fail(GMB_E_INVAL, "client is NULL");
  if (out == NULL) return client_fail(GMB_E_INVAL, "out is NULL");
  *out = 0;
  atomic_fetch_add_explicit(&c->alloc_calls, 1, memory_order_relaxed);
  int tag = flags & GMB_UNTAGGED ? -1 : gmb__cache_tag_now(c->cache);
  flags &= ~GMB_UNTAGGED;
  if (tag < 0) return client_alloc_raw(c, size, flags, timeout_ms, out);
  const uint64_t deadline =
      timeout_ms > 0 ? gmb__now_ns() + (uint64_t)timeout_ms * GMB_NS_PER_MS
                     : 0;
  for (int round = 0;; round++) {
    int rc = client_tag_admits(c, tag);
    /* The library thread carries out what the broker or an operator asks
     * of a tag (sleep_policy.c): it runs once the process tags memory. */
    if (rc == 0) rc = client_cache_thread(c);
    if (rc == 0) rc = client_alloc_raw(c, size, flags, timeout_ms, out);
    if (rc) return rc; /* explained */
    struct gmb_segmap_entry e;
    uint64_t asize = gmb__segmap_get(c->map, *out, NULL, 0, &e) == 0 ? e.size
                                                                     : size;
    rc = gmb__atags_add(c->atags, *out, asize, flags, tag);
    if (rc == 0) return 0;
    int frc = client_free_id(c, *out, 0);
    *out = 0;
    if (rc != 1)
      return client_fail(rc, "out of host memory for a tagged allocation");
    if (frc) return frc; /* explained: the session is lost */
    if (round + 1 == CLIENT_ALLOC_ROUNDS)
      return client_fail(GMB_E_INVAL, "the thread's tag \"%s\" was paused "
                         "each time an allocation into it completed",
                         gmb__cache_tag_name(c->cache, tag));
    if (deadline) { /* the wait goes on with what is left of it */
      uint64_t now = gmb__now_ns();
      timeout_ms = now >= deadline ? 0
                   : (int)((deadline - now + GMB_NS_PER_MS - 1) /
                           GMB_NS_PER_MS);
    }
  }
}

GMB_EXPORT int gmb_alloc(gmb_client *c, size_t size, unsigned flags,
                         gmb_id *out) {
  return client_alloc(c, size, flags, 0, out);
}

GMB_EXPORT int gmb_alloc_wait(gmb_client *c, size_t size, unsigned flags,
                              int timeout_ms, gmb_id *out) {
  return client_alloc(c, size, flags, timeout_ms, out);
}

/* Frees allocation id; waits for the device first when `sync` (see
 * gmb_free). */
static int client_free_id(gmb_client *c, gmb_id id, int sync) {
  if (sync && c->cuda) {
    /* As cudaFree: kernels queued on the memory may still use it, and
     * once the broker has it back it may copy it or give it to another
     * tenant.  A wait that failed (a fault, a graph capture in progress)
     * keeps the allocation: it goes back when the session ends. */
    char why[256];
    int rc = gmb__cuda_sync(c->cuda_ordinal, why, sizeof why);
    if (rc)
      return client_fail(rc, "allocation %llu not freed: the device's work "
                         "could not be waited for (%s)",
                         (unsigned long long)id, why);
  }
  client_io_lock(c);
  /* A large allocation's view goes first: the broker may retire its
   * segments while it answers, and this session's SegmentClosed must not
   * leave a mapping of them behind (on a GPU, memory the broker counts as
   * freed).  A free that then fails loses the view, not the memory: a
   * gmb_free again gives it back. */
  struct gmb_segmap_entry e;
  if (gmb__segmap_get(c->map, id, NULL, 0, &e) == 0 &&
      (e.segment & GMB_SEGMAP_VIEW))
    gmb__segmap_remove(c->map, id);
  int rc = client_free_ids(c, &id, 1);
  if (rc == 0) gmb__segmap_remove(c->map, id);
  client_io_unlock(c);
  return rc;
}

GMB_EXPORT int gmb_free(gmb_client *c, gmb_id id) {
  if (c == NULL) return client_fail(GMB_E_INVAL, "client is NULL");
  atomic_fetch_add_explicit(&c->alloc_calls, 1, memory_order_relaxed);
  uint64_t cur, host;
  int rc = gmb__atags_free(c->atags, id, &cur, &host);
  if (rc == GMB_E_INVAL)
    return client_fail(rc, "allocation %llu is being paused, resumed or "
                       "freed", (unsigned long long)id);
  if (rc == 2) return 0; /* paused: its host copy went, nothing at the broker */
  int frc = client_free_id(c, cur, 1);
  if (rc == 1) gmb__atags_remove(c->atags, id, frc == 0);
  return frc;
}

/* --- locks ---------------------------------------------------------------- */

/* Pinned allocations (and movable ones without a lock table): the address
 * is where the allocation was made and never changes.  gmb_lock has already
 * resolved it when the segment is mapped (e->ptr); this is the rest. */
static int client_lock_pinned(gmb_client *c, const struct gmb_segmap_entry *e,
                              void **ptr) {
  if (e->ptr) {
    *ptr = e->ptr;
    return 0;
  }
  const gmb_id id = e->id;
  uint64_t seg = 0;
  int rc = gmb__segmap_lookup(c->map, id, ptr, &seg);
  if (rc == 1) { /* its segment was retired here: map it again */
    client_io_lock(c);
    rc = gmb__segmap_has_segment(c->map, seg) ? 0
                                               : client_fetch_segment(c, seg);
    client_io_unlock(c);
    if (rc) return rc; /* explained by client_fetch_segment */
    rc = gmb__segmap_lookup(c->map, id, ptr, &seg);
    if (rc == 1)
      return client_fail(GMB_E_PROTO, "segment %llu was retired again while "
                         "it was being mapped", (unsigned long long)seg);
  }
  if (rc == GMB_E_NOENT)
    return client_fail(rc, "allocation %llu is not one of this session",
                       (unsigned long long)id);
  if (rc == GMB_E_PROTO)
    return client_fail(rc, "allocation %llu does not fit its segment",
                       (unsigned long long)id);
  return rc;
}

static inline void client_cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

/* Spins a little while the broker moves the allocation, then sleeps on
 * the slot's word (a futex, proto/locktab_layout.h) until the broker's
 * publish wakes it: a lock that lands mid-move returns when the move ends
 * plus one wake-up, whatever the move's length, and burns no core
 * meanwhile.  Each sleep is bounded (GMB_LT_WAIT_SLICE_NS, and what is
 * left of lock_timeout_ms), so a broker that never wakes (one that
 * predates the futex, or a stopped one) costs a slice, never a hang. */
#define CLIENT_SPINS 64

/*
 * Takes one hold on slot `s`: CAS state n -> n+1 for any n that is not
 * MOVING, acquire, so that the position read afterwards is the one the
 * broker published with its release.  Holds no mutex: waiting for a move
 * delays nobody else.  Returns 0, or 1 when the slot says OFFLOADED (the
 * broker holds the bytes: client_restore), GMB_E_TIMEOUT after
 * lock_timeout_ms of MOVING, GMB_E_LIMIT at GMB_LT_MAX_HOLDERS, GMB_E_CONN
 * when the session ended meanwhile, GMB_E_PROTO for a state no broker
 * writes.
 */
static int client_hold(gmb_client *c, struct gmb__lt_slot *s, gmb_id id) {
  uint32_t st = atomic_load_explicit(&s->state, memory_order_acquire);
  unsigned waits = 0;
  uint64_t deadline = 0;
  for (;;) {
    if (!(st & GMB_LT_MOVING)) {
      if (st == GMB_LT_MAX_HOLDERS)
        return client_fail(GMB_E_LIMIT, "allocation %llu is locked %u times",
                           (unsigned long long)id, st);
      if (st > GMB_LT_MAX_HOLDERS)
        return client_fail(GMB_E_PROTO, "allocation %llu: lock table state "
                           "0x%x is impossible", (unsigned long long)id, st);
      /* On failure st is reloaded (acquire) and the loop decides again. */
      if (atomic_compare_exchange_weak_explicit(&s->state, &st, st + 1,
                                                memory_order_acq_rel,
                                                memory_order_acquire))
        return 0;
      continue;
    }
    /* Offloaded by the broker: only a Lock request brings it back. */
    if ((st & ~GMB_LT_WAITERS) == GMB_LT_OFFLOADED) return 1;
    if (st != GMB_LT_MOVING && st != (GMB_LT_MOVING | GMB_LT_WAITERS))
      return client_fail(GMB_E_PROTO, "allocation %llu: lock table state "
                         "0x%x is impossible", (unsigned long long)id, st);
    if (waits < CLIENT_SPINS) {
      client_cpu_relax();
    } else {
      uint64_t now = gmb__now_ns();
      if (deadline == 0) {
        deadline = now + (uint64_t)c->lock_timeout_ms * GMB_NS_PER_MS;
      } else if (now >= deadline) {
        return client_fail(GMB_E_TIMEOUT, "allocation %llu was still being "
                           "moved after %d ms", (unsigned long long)id,
                           c->lock_timeout_ms);
      }
      if (atomic_load(&c->dead)) return client_dead_fail(c);
      /* Announce the sleeper, so that the broker's publish wakes it; a
       * failed CAS means the state changed: look again. */
      uint32_t want = GMB_LT_MOVING | GMB_LT_WAITERS;
      if (st == want ||
          atomic_compare_exchange_strong_explicit(&s->state, &st, want,
                                                  memory_order_acq_rel,
                                                  memory_order_acquire)) {
        uint64_t left = deadline > now ? deadline - now : 1;
        if (left > GMB_LT_WAIT_SLICE_NS) left = GMB_LT_WAIT_SLICE_NS;
        gmb__lt_futex_wait(&s->state, want, left);
      }
    }
    waits++;
    st = atomic_load_explicit(&s->state, memory_order_acquire);
  }
}

/*
 * Gives back one hold: CAS n -> n-1 with release, so that the caller's
 * accesses to the allocation happen before a move that claims the slot
 * next.  Never below 0: 1 when there was no hold to give back (a caller's
 * unbalanced gmb_unlock, or a slot the broker freed), else 0.
 */
static int client_unhold(struct gmb__lt_slot *s) {
  uint32_t st = atomic_load_explicit(&s->state, memory_order_relaxed);
  for (;;) {
    if (st == 0 || st > GMB_LT_MAX_HOLDERS) return 1;
    if (atomic_compare_exchange_weak_explicit(&s->state, &st, st - 1,
                                              memory_order_release,
                                              memory_order_relaxed))
      return 0;
  }
}

/*
 * A movable allocation: take a hold, then read where the broker last put
 * it.  The only message is a request for a segment's descriptor on the
 * descriptor channel, the first time the allocation sits in a segment
 * this process has not mapped; the io mutex is taken for it only after
 * the hold, never while waiting for one.
 *
 * Why a segment we point into is never unmapped under us: the client
 * unmaps a segment only on EVENT_SEGMENT_RETIRED, and the broker retires
 * a segment only once it holds no allocation.  Our allocation is in
 * segment S from our CAS until our unlock: a move needs the CAS 0 ->
 * MOVING, impossible while our hold keeps the state above 0.  So S is not
 * empty, hence not retired, during the hold.  Could a retirement of S
 * from *before* our CAS still be pending in our socket?  Only if S had
 * been emptied and released before, and then held our allocation again;
 * but a released segment is never used again (segment ids are not
 * reused: the pool numbers segments from a counter), so the position we
 * read names a live segment, and a pending retirement names another one.
 * The lookup below therefore cannot race with an unmap of the segment it
 * returns a pointer into.
 */
/*
 * The slot said OFFLOADED: a Lock request asks the broker to bring the
 * allocation back (it finds room as for an allocation, waiting up to
 * lock_timeout_ms, or its restore_wait_ms if less).  0 when the broker
 * took the hold for us (state 1: ours, released by gmb_unlock); 1 when it
 * was not offloaded any more (take the hold as usual); else the refusal,
 * explained (GMB_E_TIMEOUT, GMB_E_NOMEM, GMB_E_QUOTA: it stays offloaded,
 * its bytes kept at the broker).
 */
static int client_restore(gmb_client *c, gmb_id id) {
  struct wire_request req = {.kind = WIRE_LOCK};
  req.u.lock.id = id;
  req.u.lock.timeout_ms = c->lock_timeout_ms;
  int wait_ms = c->lock_timeout_ms > INT32_MAX - c->request_timeout_ms
                    ? INT32_MAX
                    : c->lock_timeout_ms + c->request_timeout_ms;
  struct wire_reply rep;
  pthread_mutex_lock(&c->restore_mu);
  client_io_lock(c);
  int rc = client_call_wait(c, &req, WIRE_LOCK, wait_ms, &rep);
  client_io_unlock(c);
  pthread_mutex_unlock(&c->restore_mu);
  if (rc) return rc; /* explained by client_call */
  int held = rep.u.lock.held;
  gmb__wire_reply_clear(&rep);
  return held ? 0 : 1;
}

/* client_hold, bringing an offloaded allocation back first. */
static int client_hold_restore(gmb_client *c, struct gmb__lt_slot *s,
                               gmb_id id) {
  /* Each round trip either gets the hold or finds the allocation on the
   * device; another offload in between needs another request for room,
   * so a few rounds are plenty. */
  for (int round = 0; round < 8; round++) {
    int rc = client_hold(c, s, id);
    if (rc != 1) return rc;
    rc = client_restore(c, id);
    if (rc != 1) return rc;
  }
  return client_fail(GMB_E_TIMEOUT, "allocation %llu was offloaded again "
                     "each time it was brought back", (unsigned long long)id);
}

static int client_lock_movable(gmb_client *c, const struct gmb_segmap_entry *e,
                               void **ptr) {
  struct gmb__lt_slot *s = &c->lt_slot[e->slot];
  int rc = client_hold_restore(c, s, e->id);
  if (rc) return rc;
  /* Read once: the table is writable by this process, and a value read
   * twice could differ between the check and the use. */
  uint64_t sid = __atomic_load_n(&s->id, __ATOMIC_RELAXED);
  uint64_t seg = __atomic_load_n(&s->segment, __ATOMIC_RELAXED);
  uint64_t off = __atomic_load_n(&s->offset, __ATOMIC_RELAXED);
  if (sid != e->id) { /* freed by another thread meanwhile: the caller's bug */
    client_unhold(s);
    return client_fail(GMB_E_NOENT, "allocation %llu was freed",
                       (unsigned long long)e->id);
  }
  /* The usual case: the segment gmb__segmap_get saw the slot name is the
   * one it names under our hold, and its mapping from that lookup is still
   * the mapping (by the argument above, a segment that holds our held
   * allocation was never retired, so never unmapped since it was mapped).
   * The range is checked against the mapped size as gmb__segmap_ptr does. */
  if (e->guess_base && seg == e->guess_segment && off <= e->guess_size &&
      e->size <= e->guess_size - off) {
    *ptr = e->guess_base + off;
    return 0;
  }
  for (int fetched = 0;; fetched = 1) {
    rc = gmb__segmap_ptr(c->map, seg, off, e->size, ptr);
    if (rc == 0) return 0;
    if (rc != 1) {
      rc = client_fail(GMB_E_PROTO, "allocation %llu: [%llu, +%llu) does not "
                       "fit segment %llu", (unsigned long long)e->id,
                       (unsigned long long)off, (unsigned long long)e->size,
                       (unsigned long long)seg);
      break;
    }
    if (fetched) {
      rc = client_fail(GMB_E_PROTO, "segment %llu was retired while "
                       "allocation %llu was locked in it",
                       (unsigned long long)seg, (unsigned long long)e->id);
      break;
    }
    client_io_lock(c);
    rc = gmb__segmap_has_segment(c->map, seg) ? 0
                                               : client_fetch_segment(c, seg);
    client_io_unlock(c);
    if (rc) break; /* explained by client_fetch_segment */
  }
  client_unhold(s);
  return rc;
}

static int client_lock_raw(gmb_client *c, gmb_id id, void **ptr) {
  /* An eviction is seen here before (or without) its event: the broker
   * set the word in the lock table before it ended the session. */
  if (c->lt && atomic_load_explicit(&c->lt->evicted, memory_order_acquire))
    return client_fail(GMB_E_EVICTED, "this session was evicted by an "
                       "operator: its memory is no longer its own");
  struct gmb_segmap_entry e;
  if (gmb__segmap_get(c->map, id, c->lt_slot, c->lt_slots, &e) != 0)
    return client_fail(GMB_E_NOENT, "allocation %llu is not one of this "
                       "session", (unsigned long long)id);
  if (e.slot == GMB_SEGMAP_NO_SLOT) return client_lock_pinned(c, &e, ptr);
  return client_lock_movable(c, &e, ptr);
}

/* The broker id behind the program's id (alloc_tags.c), held when `hold`:
 * 0, or GMB_E_INVAL for a paused allocation, explained.  With `wake` (a
 * lock or a copy) an allocation paused for another job resumes its tag
 * first (client_tag_wake). */
static int client_id(gmb_client *c, gmb_id id, int hold, int wake,
                     uint64_t *cur) {
  int tag = -1;
  if (gmb__atags_get(c->atags, id, hold, cur, &tag) == 0) return 0;
  const char *name = gmb__cache_tag_name(c->cache, tag);
  char what[CLIENT_WHY_MAX];
  snprintf(what, sizeof what, "allocation %llu of tag \"%s\"",
           (unsigned long long)id, name ? name : "?");
  int by;
  if (wake && name) {
    int rc = client_tag_wake(c, name, what, &by);
    if (rc) return rc;
    if (gmb__atags_get(c->atags, id, hold, cur, &tag) == 0) return 0;
  }
  return client_fail(GMB_E_INVAL, "%s is paused (or being paused or "
                     "resumed): gmb_resume it first", what);
}

GMB_EXPORT int gmb_lock(gmb_client *c, gmb_id id, void **ptr) {
  if (c == NULL) return client_fail(GMB_E_INVAL, "client is NULL");
  if (ptr == NULL) return client_fail(GMB_E_INVAL, "ptr is NULL");
  if (atomic_load(&c->dead)) return client_dead_fail(c);
  uint64_t cur;
  int rc = client_id(c, id, 1, 1, &cur);
  if (rc) return rc;
  rc = client_lock_raw(c, cur, ptr);
  if (rc) gmb__atags_unhold(c->atags, id);
  else atomic_fetch_add_explicit(&c->alloc_calls, 1, memory_order_relaxed);
  return rc;
}

/* The lock-table slot of one of this session's allocations
 * (GMB_SEGMAP_NO_SLOT for a pinned one): 0 or GMB_E_NOENT, explained. */
static int client_slot_of(gmb_client *c, gmb_id id, uint32_t *slot) {
  if (gmb__segmap_slot(c->map, id, slot) != 0)
    return client_fail(GMB_E_NOENT, "allocation %llu is not one of this "
                       "session", (unsigned long long)id);
  return 0;
}

static int client_unlock_raw(gmb_client *c, gmb_id id) {
  uint32_t slot;
  int rc = client_slot_of(c, id, &slot);
  if (rc) return rc;
  if (slot == GMB_SEGMAP_NO_SLOT) return 0; /* pinned: nothing to release */
  if (client_unhold(&c->lt_slot[slot]))
    return client_fail(GMB_E_INVAL, "allocation %llu is not locked",
                       (unsigned long long)id);
  return 0;
}

GMB_EXPORT int gmb_unlock(gmb_client *c, gmb_id id) {
  if (c == NULL) return client_fail(GMB_E_INVAL, "client is NULL");
  if (atomic_load(&c->dead)) return client_dead_fail(c);
  uint64_t cur;
  int rc = client_id(c, id, 0, 0, &cur);
  if (rc == 0) rc = client_unlock_raw(c, cur);
  if (rc == 0) gmb__atags_unhold(c->atags, id);
  return rc;
}

/*
 * The hold is given back by a host function on the stream (cuimport.c), which
 * points at the slot's state word; the lock table stays mapped until it
 * ran, even when the client is disconnected first.  The caller must not
 * free the allocation before the stream reaches the release: the broker
 * may give the slot to a new allocation, whose hold the late release
 * would then drop (as cudaFree of memory a queued kernel still uses is
 * the caller's bug).
 */
GMB_EXPORT int gmb_unlock_on_stream(gmb_client *c, gmb_id id,
                                    void *cuda_stream) {
  if (c == NULL) return client_fail(GMB_E_INVAL, "client is NULL");
  if (!c->cuda)
    return client_fail(GMB_E_DEVICE, "gmb_unlock_on_stream needs the CUDA "
                       "device");
  if (atomic_load(&c->dead)) return client_dead_fail(c);
  const gmb_id prog = id;
  int rc = client_id(c, prog, 0, 0, &id);
  if (rc) return rc;
  uint32_t slot;
  rc = client_slot_of(c, id, &slot);
  if (rc) return rc;
  /* A tagged allocation counts as unlocked now: a pause waits for the
   * device before it copies, and so for this release. */
  gmb__atags_unhold(c->atags, prog);
  if (slot == GMB_SEGMAP_NO_SLOT) return 0; /* pinned: nothing to release */
  struct gmb__lt_slot *s = &c->lt_slot[slot];
  if (__atomic_load_n(&s->id, __ATOMIC_RELAXED) != id)
    return client_fail(GMB_E_NOENT, "allocation %llu was freed",
                       (unsigned long long)id);
  /* A check, not a claim: releases already queued may take the holds the
   * caller still counts on, which is the caller's own imbalance. */
  uint32_t st = atomic_load_explicit(&s->state, memory_order_relaxed);
  if (st == 0 || st > GMB_LT_MAX_HOLDERS)
    return client_fail(GMB_E_INVAL, "allocation %llu is not locked",
                       (unsigned long long)id);
  char why[256];
  gmb__cuda_stream_note(cuda_stream);
  rc = gmb__cuda_release_on_stream(c->cuda_ordinal, &s->state, cuda_stream,
                                   why, sizeof why);
  return rc ? client_fail(rc, "allocation %llu: %s", (unsigned long long)id,
                          why)
            : 0;
}

/* One Stats request: the tenant's and the device's figures in *rep (the
 * caller clears it), or the failure, explained. */
static int client_stats(gmb_client *c, const void *out,
                        struct wire_reply *rep) {
  if (c == NULL) return client_fail(GMB_E_INVAL, "client is NULL");
  if (out == NULL) return client_fail(GMB_E_INVAL, "out is NULL");
  struct wire_request req = {.kind = WIRE_STATS};
  client_io_lock(c);
  int rc = client_call(c, &req, WIRE_STATS, c->request_timeout_ms, rep);
  client_io_unlock(c);
  return rc;
}

/* The tenant's figures of a StatsReply (Stats, Vmm) into *out. */
static void client_tenant_stats(gmb_client *c, const struct wire_reply *rep,
                                gmb_stats *out) {
  out->quota = rep->u.stats.quota;
  out->used = rep->u.stats.used;
  out->peak = rep->u.stats.peak;
  out->segments = rep->u.stats.segments;
  /* The broker's sum over the tenant's sessions (this one's as this
   * request reported it); an older broker sends 0: this session's then. */
  out->cached = rep->u.stats.cached ? rep->u.stats.cached
                                    : gmb__cache_cached(c->cache);
}

GMB_EXPORT int gmb_tenant_stats(gmb_client *c, gmb_stats *out) {
  struct wire_reply rep;
  int rc = client_stats(c, out, &rep);
  if (rc) return rc;
  client_tenant_stats(c, &rep, out);
  gmb__wire_reply_clear(&rep);
  return 0;
}

GMB_EXPORT int gmb_vmm_report(gmb_client *c, uint64_t bytes, gmb_stats *out) {
  if (c == NULL) return client_fail(GMB_E_INVAL, "client is NULL");
  struct wire_request req = {.kind = WIRE_VMM};
  req.u.vmm.bytes = bytes;
  struct wire_reply rep;
  client_io_lock(c);
  int rc = client_call(c, &req, WIRE_STATS, c->request_timeout_ms, &rep);
  client_io_unlock(c);
  if (rc) return rc;
  if (out) client_tenant_stats(c, &rep, out);
  gmb__wire_reply_clear(&rep);
  return 0;
}

GMB_EXPORT int gmb_device_stats_get(gmb_client *c, gmb_device_stats *out) {
  struct wire_reply rep;
  int rc = client_stats(c, out, &rep);
  if (rc) return rc;
  out->capacity = rep.u.stats.device_capacity;
  out->segments = rep.u.stats.device_segments;
  out->used = rep.u.stats.device_used;
  out->free_in_segments = rep.u.stats.free_in_segments;
  gmb__wire_reply_clear(&rep);
  return 0;
}

/* --- copies and the device ------------------------------------------------ */

/* Copies between host memory and [off, off+n) of allocation id, locked for
 * the copy: memcpy on the host device, cuMemcpyHtoD/DtoH on a GPU (device
 * memory cannot be touched by the CPU). */
static int client_copy_raw(gmb_client *c, gmb_id id, size_t off, void *host,
                           size_t n, int to_device);

static int client_copy(gmb_client *c, gmb_id id, size_t off, void *host,
                       size_t n, int to_device) {
  if (c == NULL) return client_fail(GMB_E_INVAL, "client is NULL");
  if (host == NULL && n) return client_fail(GMB_E_INVAL, "buffer is NULL");
  if (atomic_load(&c->dead)) return client_dead_fail(c);
  const gmb_id prog = id;
  int rc = client_id(c, prog, 1, 1, &id);
  if (rc) return rc;
  rc = client_copy_raw(c, id, off, host, n, to_device);
  gmb__atags_unhold(c->atags, prog);
  return rc;
}

/* client_copy of broker allocation id. */
static int client_copy_raw(gmb_client *c, gmb_id id, size_t off, void *host,
                           size_t n, int to_device) {
  struct gmb_segmap_entry e;
  if (gmb__segmap_get(c->map, id, c->lt_slot, c->lt_slots, &e) != 0)
    return client_fail(GMB_E_NOENT, "allocation %llu is not one of this "
                       "session", (unsigned long long)id);
  if (off > e.size || n > e.size - off)
    return client_fail(GMB_E_INVAL, "[%zu, +%zu) is not inside allocation "
                       "%llu of %llu bytes", off, n, (unsigned long long)id,
                       (unsigned long long)e.size);
  void *p;
  int rc = client_lock_raw(c, id, &p);
  if (rc) return rc;
  if (n && c->cuda) {
    char why[256];
    rc = gmb__cuda_copy(c->cuda_ordinal, (uint64_t)(uintptr_t)p + off, host,
                        n, to_device, why, sizeof why);
    if (rc)
      client_fail(rc, "allocation %llu: %s", (unsigned long long)id, why);
  } else if (n) {
    if (to_device)
      memcpy((char *)p + off, host, n);
    else
      memcpy(host, (const char *)p + off, n);
  }
  client_unlock_raw(c, id);
  return rc;
}

GMB_EXPORT int gmb_write(gmb_client *c, gmb_id id, size_t off,
                         const void *src, size_t n) {
  return client_copy(c, id, off, (void *)(uintptr_t)src, n, 1);
}

GMB_EXPORT int gmb_read(gmb_client *c, gmb_id id, size_t off, void *dst,
                        size_t n) {
  return client_copy(c, id, off, dst, n, 0);
}

GMB_EXPORT int gmb_device_get(gmb_client *c, gmb_device_info *out) {
  if (c == NULL) return client_fail(GMB_E_INVAL, "client is NULL");
  if (out == NULL) return client_fail(GMB_E_INVAL, "out is NULL");
  memset(out, 0, sizeof *out);
  snprintf(out->kind, sizeof out->kind, "%.15s", c->device);
  out->ordinal = c->cuda ? c->cuda_ordinal : -1;
  snprintf(out->uuid, sizeof out->uuid, "%.47s", c->device_uuid);
  snprintf(out->pci_bus_id, sizeof out->pci_bus_id, "%.31s", c->device_pci);
  return 0;
}

GMB_EXPORT int gmb_stream_capturing(gmb_client *c, void *cuda_stream) {
  if (c == NULL) return client_fail(GMB_E_INVAL, "client is NULL");
  if (!c->cuda)
    return client_fail(GMB_E_DEVICE, "gmb_stream_capturing needs the CUDA "
                       "device");
  char why[256];
  gmb__cuda_stream_note(cuda_stream);
  int rc = gmb__cuda_capturing(c->cuda_ordinal, cuda_stream, why, sizeof why);
  if (rc < 0) return client_fail(rc, "%s", why);
  return rc;
}

/* --- the stream-ordered cache ---------------------------------------------- */

/* The cache's backend (cache.c): address space reserved in this process,
 * and pages of GMB_CACHE_PAGE bytes from the broker mapped into it.  A
 * page is a pinned allocation of exactly one page, which the broker
 * places in a segment of its own (its rule for requests past the small
 * size); its descriptor is mapped at the address the cache chose: a memfd
 * mapped MAP_FIXED over the reservation on the host device, a VMM import
 * mapped into the reserved range on a GPU (the imported handle kept, so
 * that the page can be moved).  Pages are not in the segment map: nothing
 * but the cache knows them, and a retirement event for one (the cache
 * unmapped it before giving it back) finds nothing to unmap. */

static int client_reserve(void *ctx, uint64_t size, uintptr_t *base) {
  gmb_client *c = ctx;
  char why[256];
  if (c->cuda) {
    uint64_t va;
    int rc = gmb__cuda_reserve(c->cuda_ordinal, size, &va, why, sizeof why);
    if (rc) return client_fail(rc, "reserving %llu bytes of device address "
                               "space for the cache: %s",
                               (unsigned long long)size, why);
    *base = (uintptr_t)va;
    return 0;
  }
  /* Aligned to the page: reserve a page more and cut the ends off. */
  const uint64_t page = GMB_CACHE_PAGE;
  if (size > SIZE_MAX - page)
    return client_fail(GMB_E_INVAL, "a reservation of %llu bytes",
                       (unsigned long long)size);
  char *p = mmap(NULL, (size_t)(size + page), PROT_NONE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED)
    return client_fail(GMB_E_NOMEM, "reserving %llu bytes of address space "
                       "for the cache: %s", (unsigned long long)size,
                       strerror(errno));
  uintptr_t b = ((uintptr_t)p + page - 1) & ~(uintptr_t)(page - 1);
  if (b > (uintptr_t)p) munmap(p, b - (uintptr_t)p);
  uintptr_t e = (uintptr_t)p + size + page;
  if (e > b + size) munmap((void *)(b + size), e - (b + size));
  *base = b;
  return 0;
}

static void client_unreserve(void *ctx, uintptr_t base, uint64_t size) {
  gmb_client *c = ctx;
  if (c->cuda)
    gmb__cuda_unreserve(c->cuda_ordinal, base, size);
  else
    munmap((void *)base, (size_t)size);
}

/* Maps one page of a pages reply at `addr` from its segment's descriptor
 * `fd` of `size` bytes (checked to be one page), the imported handle kept
 * on a GPU.  The caller closes fd. */
static int client_page_attach(gmb_client *c, uint64_t seg, int fd,
                              uint64_t size, uintptr_t addr,
                              struct gmb_cache_page *pg) {
  char why[CLIENT_WHY_MAX];
  int rc = 0;
  if (size != GMB_CACHE_PAGE) {
    rc = client_fail(GMB_E_PROTO, "segment %llu of a page has %llu bytes",
                     (unsigned long long)seg, (unsigned long long)size);
  } else if (c->cuda) {
    rc = gmb__cuda_map_at(c->cuda_ordinal, fd, addr, GMB_CACHE_PAGE, 1,
                          &pg->h, why, sizeof why);
    if (rc) rc = client_fail(rc, "mapping a page of the cache: %s", why);
  } else {
    struct stat st;
    pg->h = 0;
    if (fstat(fd, &st) != 0 || (uint64_t)st.st_size != GMB_CACHE_PAGE)
      rc = client_fail(GMB_E_PROTO, "the descriptor of segment %llu is not "
                       "a page", (unsigned long long)seg);
    else if (mmap((void *)addr, GMB_CACHE_PAGE, PROT_READ | PROT_WRITE,
                  MAP_SHARED | MAP_FIXED, fd, 0) == MAP_FAILED)
      rc = client_fail(GMB_E_SYSTEM, "mapping a page of the cache: %s",
                       strerror(errno));
  }
  return rc;
}

static void client_page_unmap(void *ctx, uintptr_t addr,
                              const struct gmb_cache_page *pg);

/* `n` pages from the broker in one request, mapped at addr, addr + page,
 * ...  All or nothing: a page that cannot be mapped unmaps the ones
 * before it and gives all of them back.  Holds io from the request to the
 * mappings, as client_alloc does.  A quota held by the tenant's other
 * caches is waited for by the broker itself (trim_wait_ms), not here. */
static int client_page_map(void *ctx, uintptr_t addr, unsigned n,
                           uint64_t ahead, struct gmb_cache_page *pg) {
  gmb_client *c = ctx;
  if (n == 0 || n > WIRE_PAGES_MAX)
    return client_fail(GMB_E_INVAL, "%u pages in one request", n);
  struct wire_request req = {.kind = WIRE_ALLOC};
  req.u.alloc.size = (uint64_t)n * GMB_CACHE_PAGE;
  req.u.alloc.pages = n;
  req.u.alloc.ahead = ahead;
  struct wire_reply rep;
  client_io_lock(c);
  int rc = client_call(c, &req, WIRE_ALLOC, c->request_timeout_ms, &rep);
  if (rc) goto out;
  /* What the broker says it gave, checked before anything is mapped. */
  unsigned got = rep.u.alloc.n_pages;
  for (unsigned i = 0; i < got && rc == 0; i++)
    if (rep.u.alloc.page_id[i] == 0) rc = GMB_E_PROTO;
  if (rc || got != n || rep.u.alloc.size != req.u.alloc.size) {
    rc = client_fail(GMB_E_PROTO, "the broker answered a request for %u "
                     "pages with %u of %llu bytes", n, got,
                     (unsigned long long)rep.u.alloc.size);
    goto undo;
  }
  /* Every page's descriptor in one exchange on the channel, then the
   * mappings. */
  int fds[WIRE_PAGES_MAX];
  uint64_t sizes[WIRE_PAGES_MAX];
  char why[CLIENT_WHY_MAX];
  _Static_assert(WIRE_PAGES_MAX <= GMB_FDCLIENT_BATCH,
                 "a batch of pages fits one exchange of descriptors");
  rc = gmb__fdclient_segments(&c->fdsock, rep.u.alloc.page_seg, n, fds, sizes,
                              why, sizeof why);
  if (rc) {
    client_fail(rc, "%s", why);
    goto undo;
  }
  unsigned mapped = 0;
  for (; mapped < n && rc == 0; mapped++) {
    rc = client_page_attach(c, rep.u.alloc.page_seg[mapped], fds[mapped],
                            sizes[mapped],
                            addr + (uintptr_t)mapped * GMB_CACHE_PAGE,
                            &pg[mapped]);
    if (rc == 0) pg[mapped].id = rep.u.alloc.page_id[mapped];
  }
  for (unsigned i = 0; i < n; i++) close(fds[i]);
  if (rc == 0) goto out;
  for (unsigned i = 0; i + 1 < mapped; i++)
    client_page_unmap(c, addr + (uintptr_t)i * GMB_CACHE_PAGE, &pg[i]);
undo:
  if (got <= WIRE_PAGES_MAX) client_undo_alloc(c, rep.u.alloc.page_id, got);
out:
  client_io_unlock(c);
  return rc;
}

/* The address stays reserved: PROT_NONE over the page (one call, so the
 * range is never a hole another mapping could take). */
static void client_page_unmap(void *ctx, uintptr_t addr,
                              const struct gmb_cache_page *pg) {
  gmb_client *c = ctx;
  if (c->cuda)
    gmb__cuda_unmap_at(c->cuda_ordinal, addr, GMB_CACHE_PAGE, pg->h);
  else
    mmap((void *)addr, GMB_CACHE_PAGE, PROT_NONE,
         MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
}

/* No wait for the device: the cache gives back only pages that no
 * stream's work can use any more.  One message for all of them.  A
 * failure keeps the pages until the session's end, as the broker frees
 * them then. */
static void client_page_free(void *ctx, const struct gmb_cache_page *pg,
                             unsigned n) {
  gmb_client *c = ctx;
  uint64_t ids[WIRE_PAGES_MAX];
  char saved[sizeof client_err];
  memcpy(saved, client_err, sizeof saved);
  for (unsigned done = 0; done < n;) {
    unsigned k = n - done < WIRE_PAGES_MAX ? n - done : WIRE_PAGES_MAX;
    for (unsigned i = 0; i < k; i++) ids[i] = pg[done + i].id;
    client_io_lock(c);
    if (!atomic_load(&c->dead)) client_free_ids(c, ids, k);
    client_io_unlock(c);
    done += k;
  }
  memcpy(client_err, saved, sizeof saved);
}

_Static_assert(GMB_CACHE_BATCH <= WIRE_PAGES_MAX,
               "the cache asks for more pages at once than a message holds");

/* Moves a page's mapping within the process, with no message.  On the
 * host device the old address becomes a hole for a moment (mremap), and
 * is reserved again only if no other mapping took it meanwhile. */
static int client_page_move(void *ctx, uintptr_t from, uintptr_t to,
                            struct gmb_cache_page *pg) {
  gmb_client *c = ctx;
  char why[256];
  if (c->cuda) {
    int rc = gmb__cuda_move(c->cuda_ordinal, from, to, GMB_CACHE_PAGE, pg->h,
                            why, sizeof why);
    return rc ? client_fail(rc, "moving a page of the cache: %s", why) : 0;
  }
  if (mremap((void *)from, GMB_CACHE_PAGE, GMB_CACHE_PAGE,
             MREMAP_MAYMOVE | MREMAP_FIXED, (void *)to) == MAP_FAILED)
    return client_fail(GMB_E_SYSTEM, "moving a page of the cache: %s",
                       strerror(errno));
  void *q = mmap((void *)from, GMB_CACHE_PAGE, PROT_NONE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE |
                     MAP_FIXED_NOREPLACE,
                 -1, 0);
  if (q == (void *)from) return 0;
  if (q != MAP_FAILED) munmap(q, GMB_CACHE_PAGE); /* an old kernel's hint */
  return 1;
}

/* The bytes of pages a tag pauses and resumes: memcpy on the host device
 * (the pages are the process's own mappings), cuMemcpyDtoH/HtoD on a
 * GPU. */
static int client_page_copy(void *ctx, uintptr_t dev, void *host,
                            uint64_t n, int to_device) {
  gmb_client *c = ctx;
  char why[256];
  if (!c->cuda) {
    /* The broker's new pages are touched for the first time here: have
     * the kernel fault them in at once rather than a trap per 4 KiB page
     * (a kernel without MADV_POPULATE_WRITE faults them in the copy). */
#ifdef MADV_POPULATE_WRITE
    if (to_device) (void)madvise((void *)dev, (size_t)n, MADV_POPULATE_WRITE);
#endif
    if (to_device)
      memcpy((void *)dev, host, n);
    else
      memcpy(host, (const void *)dev, n);
    return 0;
  }
  int rc = gmb__cuda_copy(c->cuda_ordinal, dev, host, n, to_device, why,
                          sizeof why);
  return rc ? client_fail(rc, "copying a paused page: %s", why) : 0;
}

/* Set by client_note when the broker refused a pause on this thread: the
 * refusal's message is the broker's, and gmb_pause keeps it. */
static _Thread_local int client_note_refused;

/* One SleepNote, answered with a status. */
static int client_note_send(gmb_client *c, const char *tag, int paused,
                            int mode, uint64_t host, uint64_t device, int by) {
  struct wire_request req = {.kind = WIRE_SLEEP_NOTE};
  snprintf(req.u.sleep_note.tag, sizeof req.u.sleep_note.tag, "%s", tag);
  req.u.sleep_note.paused = paused;
  req.u.sleep_note.mode = (uint32_t)mode;
  req.u.sleep_note.host_bytes = host;
  req.u.sleep_note.device_bytes = device;
  req.u.sleep_note.by = (uint32_t)by;
  struct wire_reply rep;
  client_io_lock(c);
  int rc = client_call(c, &req, WIRE_NONE, c->request_timeout_ms, &rep);
  if (rc == 0) gmb__wire_reply_clear(&rep);
  client_io_unlock(c);
  client_note_refused = rc != 0;
  return rc; /* explained */
}

/* Sets part `part` of tag `ord` to *p and tells the broker the tag's sum;
 * a refused pause leaves the part as it was.  Holds note_mu. */
static int client_note_part(gmb_client *c, int ord, int part,
                            const struct client_tag_part *p) {
  struct client_tag_part *q = c->tag_part[part], old = q[ord];
  const struct client_tag_part *o = &c->tag_part[!part][ord];
  q[ord] = *p;
  int paused = p->paused || o->paused;
  int rc = client_note_send(c, gmb__cache_tag_name(c->cache, ord), paused,
                            p->paused ? p->mode : o->mode,
                            paused ? p->host + o->host : 0,
                            paused ? p->device + o->device : 0,
                            p->paused ? p->by : o->by);
  if (rc && p->paused) q[ord] = old;
  return rc;
}

/* The cache's note (cache.h): its part of the tag's SleepNote. */
static int client_note(void *ctx, const char *tag, int paused, int mode,
                       uint64_t host, uint64_t device, int by) {
  gmb_client *c = ctx;
  int ord = gmb__cache_tag_find(c->cache, tag);
  if (ord < 0 || ord >= 64)
    return client_note_send(c, tag, paused, mode, host, device, by);
  struct client_tag_part p = {.host = host, .device = device,
                              .paused = paused, .mode = mode, .by = by};
  if (!paused) p = (struct client_tag_part){0};
  pthread_mutex_lock(&c->note_mu);
  int rc = client_note_part(c, ord, 0, &p);
  pthread_mutex_unlock(&c->note_mu);
  return rc;
}

/* Tag `ord`'s paused parts that `by` outranks were claimed by `by`
 * (gmb__cache_claim, gmb__atags_claim): the broker hears who keeps the
 * tag paused now in one SleepNote, with the same bytes. */
static void client_note_claim(gmb_client *c, int ord, int by) {
  pthread_mutex_lock(&c->note_mu);
  int part = -1;
  for (int i = 0; i < 2; i++) {
    struct client_tag_part *p = &c->tag_part[i][ord];
    if (p->paused && gmb__cache_by_rank(by) > gmb__cache_by_rank(p->by)) {
      p->by = by;
      part = i;
    }
  }
  if (part >= 0) {
    struct client_tag_part p = c->tag_part[part][ord];
    (void)client_note_part(c, ord, part, &p);
  }
  pthread_mutex_unlock(&c->note_mu);
}

static int client_sync(void *ctx) {
  gmb_client *c = ctx;
  char why[256];
  int rc = gmb__cuda_sync(c->cuda_ordinal, why, sizeof why);
  return rc ? client_fail(rc, "%s", why) : 0;
}

static int client_ev_new(void *ctx, void **ev) {
  gmb_client *c = ctx;
  char why[256];
  int rc = gmb__cuda_event_new(c->cuda_ordinal, ev, why, sizeof why);
  return rc ? client_fail(rc, "%s", why) : 0;
}

static int client_ev_record(void *ctx, void *ev, void *stream) {
  gmb_client *c = ctx;
  char why[256];
  int rc = gmb__cuda_event_record(c->cuda_ordinal, ev, stream, why,
                                  sizeof why);
  if (rc == 1) {
    client_fail(GMB_E_INVAL, "%s", why);
    return GMB_CACHE_CAPTURING;
  }
  return rc ? client_fail(rc, "%s", why) : 0;
}

static int client_ev_query(void *ctx, void *ev) {
  return gmb__cuda_event_query(((gmb_client *)ctx)->cuda_ordinal, ev);
}

static void client_ev_destroy(void *ctx, void *ev) {
  gmb__cuda_event_destroy(((gmb_client *)ctx)->cuda_ordinal, ev);
}

static struct gmb_cache *client_cache_new(gmb_client *c) {
  struct gmb_cache_ops ops = {.ctx = c,
                              .reserve = client_reserve,
                              .unreserve = client_unreserve,
                              .page_map = client_page_map,
                              .page_unmap = client_page_unmap,
                              .page_free = client_page_free,
                              .page_move = client_page_move,
                              .copy = client_page_copy,
                              .note = client_note};
  if (c->cuda) {
    ops.sync = client_sync;
    ops.event_new = client_ev_new;
    ops.event_record = client_ev_record;
    ops.event_query = client_ev_query;
    ops.event_destroy = client_ev_destroy;
  }
  return gmb__cache_new(&ops, 0);
}

/* --- the tagged allocations' callbacks (alloc_tags.h) ------------------- */

static int client_atag_alloc(void *ctx, uint64_t size, unsigned flags,
                             uint64_t *id) {
  return client_alloc_raw(ctx, (size_t)size, flags, 0, id);
}

static int client_atag_free(void *ctx, uint64_t id) {
  return client_free_id(ctx, id, 0); /* the pause waited for the device */
}

static int client_atag_copy(void *ctx, uint64_t id, void *host, uint64_t n,
                            int to_device) {
  return client_copy_raw(ctx, id, 0, host, (size_t)n, to_device);
}

/* The broker offloaded it itself (its lock-table slot says so). */
static int client_atag_away(void *ctx, uint64_t id) {
  gmb_client *c = ctx;
  uint32_t slot;
  if (gmb__segmap_slot(c->map, id, &slot) != 0 || slot == GMB_SEGMAP_NO_SLOT)
    return 0;
  uint32_t st = atomic_load_explicit(&c->lt_slot[slot].state,
                                     memory_order_acquire);
  return (st & ~GMB_LT_WAITERS) == GMB_LT_OFFLOADED;
}

/* Host bytes in the cache's figure and quota, then the broker's note. */
static int client_atag_admit(void *ctx, int tag, int paused, int mode, int by,
                             uint64_t host, uint64_t device) {
  gmb_client *c = ctx;
  if (tag < 0 || tag >= 64) return GMB_E_INVAL;
  if (paused && host && gmb__cache_host_take(c->cache, host))
    return GMB_E_LIMIT;
  pthread_mutex_lock(&c->note_mu);
  struct client_tag_part p = c->tag_part[1][tag];
  if (paused) {
    p.host += host;
    p.device += device;
    p.mode = mode;
    p.by = by;
  } else {
    p.host -= host < p.host ? host : p.host;
    p.device -= device < p.device ? device : p.device;
  }
  p.paused = p.device > 0;
  int rc = client_note_part(c, tag, 1, &p);
  pthread_mutex_unlock(&c->note_mu);
  if (paused && rc && host) gmb__cache_host_give(c->cache, host);
  if (!paused && host) gmb__cache_host_give(c->cache, host);
  return paused ? rc : 0;
}

static struct gmb_atags *client_atags_new(gmb_client *c) {
  struct gmb_atag_ops ops = {.ctx = c,
                             .alloc = client_atag_alloc,
                             .free = client_atag_free,
                             .copy = client_atag_copy,
                             .sync = c->cuda ? client_sync : NULL,
                             .admit = client_atag_admit,
                             .away = client_atag_away};
  return gmb__atags_new(&ops);
}

/* The library thread, at most every CLIENT_REPORT_MS, for a session that
 * caches or tags memory: it reports the cache's free bytes and answers
 * TRIM events while the application is idle, and carries out the pauses
 * the broker and operators ask.  Started once, at the first
 * gmb_malloc_async, tagged gmb_alloc or sleep policy (a flag read without
 * a lock makes the usual case free). */
static int client_cache_thread(gmb_client *c) {
  if (atomic_load_explicit(&c->cache_thread, memory_order_acquire)) return 0;
  int rc = 0;
  client_io_lock(c);
  if (!atomic_load(&c->cache_thread)) {
    if (c->hb_running) {
      pthread_mutex_lock(&c->hb_mu);
      if (c->tick_ms > CLIENT_REPORT_MS) c->tick_ms = CLIENT_REPORT_MS;
      pthread_mutex_unlock(&c->hb_mu);
    } else {
      c->tick_ms = CLIENT_REPORT_MS;
      rc = client_heartbeat_start(c);
    }
    if (rc == 0) atomic_store_explicit(&c->cache_thread, 1,
                                       memory_order_release);
  }
  client_io_unlock(c);
  return rc;
}

GMB_EXPORT int gmb_malloc_async(gmb_client *c, size_t size, void *stream,
                                void **ptr) {
  if (c == NULL) return client_fail(GMB_E_INVAL, "client is NULL");
  if (ptr == NULL) return client_fail(GMB_E_INVAL, "ptr is NULL");
  *ptr = NULL;
  if (size == 0) return client_fail(GMB_E_INVAL, "size 0");
  if (atomic_load(&c->dead)) return client_dead_fail(c);
  int trc = client_cache_thread(c);
  if (trc) return trc; /* explained */
  if (c->cuda) gmb__cuda_stream_note(stream);
  int rc = gmb__cache_alloc(c->cache, size, stream, ptr);
  const char *tag;
  if (rc == GMB_E_INVAL && (tag = gmb__cache_tag_paused(c->cache)) != NULL) {
    /* Paused for another job's request (the broker's ask): the tag
     * resumes now, waiting for room up to GMB_RESUME_WAIT_MS. */
    char what[CLIENT_WHY_MAX];
    snprintf(what, sizeof what, "the thread's tag \"%s\"", tag);
    int by;
    rc = client_tag_wake(c, tag, what, &by);
    if (rc) return rc;
    rc = gmb__cache_alloc(c->cache, size, stream, ptr);
  }
  if (rc == GMB_E_INVAL) {
    return client_fail(rc, "%zu bytes is more than the cache serves", size);
  }
  if (rc == GMB_E_SYSTEM)
    return client_fail(rc, "out of host memory for the cache's records");
  return rc; /* a page's failure, explained by client_page_get */
}

/* Takes io when it is free within CLIENT_SYNC_REPORT_WAIT_NS: 1 taken, 0
 * not.  Never an unbounded wait: a free of the cache must not wait for
 * another thread's round trip (a waiting request does not hold io, and
 * releases it at once when it reads for the others). */
#define CLIENT_SYNC_REPORT_WAIT_NS (2 * 1000 * 1000L)
static int client_io_lock_briefly(gmb_client *c) {
  struct timespec until =
      client_ts_in(CLOCK_REALTIME, CLIENT_SYNC_REPORT_WAIT_NS);
  return client_io_lock_until(c, &until) == 0;
}

GMB_EXPORT int gmb_free_async(gmb_client *c, void *ptr, void *stream) {
  if (c == NULL) return client_fail(GMB_E_INVAL, "client is NULL");
  if (ptr == NULL) return 0; /* as free(NULL) */
  if (c->cuda) gmb__cuda_stream_note(stream);
  int rc = gmb__cache_free(c->cache, ptr, stream);
  if (rc == GMB_E_NOENT)
    return client_fail(rc, "%p is not a block gmb_malloc_async gave", ptr);
  if (rc == GMB_E_INVAL && !c->cuda)
    return client_fail(rc, "%p is already free (a double free)", ptr);
  if (rc == GMB_E_INVAL)
    return client_fail(rc, "%p is already free, or the stream took no event "
                       "(%s)", ptr, gmb_last_error(c));
  if (rc) return client_fail(rc, "%p not freed: %s", ptr, gmb_last_error(c));
  /* A page went idle that the broker does not know of yet: the library
   * thread reports it now rather than at its next tick, so that another
   * process's request that needs it, refused or held meanwhile, finds it.
   * Most frees leave no page idle and cost one load here; a burst of
   * frees wakes it once until it has reported. */
  uint64_t cached = gmb__cache_cached(c->cache),
           reported = atomic_load_explicit(&c->reported, memory_order_relaxed);
  if (cached > reported &&
      atomic_load_explicit(&c->cache_thread, memory_order_acquire)) {
    /* The first idle page after a quiet while is reported by this call
     * itself (a Heartbeat sent without waiting, when the socket is free),
     * so that a request another process makes right after it is held for
     * it; later ones, within CLIENT_SYNC_REPORT_NS, by the thread; but
     * CLIENT_SYNC_REPORT_BYTES unreported by this call, waiting a little
     * for the socket (the thread may hold it, and be late). */
    uint64_t now = gmb__now_ns(),
             last = atomic_load_explicit(&c->sync_report_ns,
                                         memory_order_relaxed);
    int big = cached - reported >= CLIENT_SYNC_REPORT_BYTES;
    if (big && client_io_lock_briefly(c)) {
      atomic_store_explicit(&c->sync_report_ns, now, memory_order_relaxed);
      client_report_due(c);
      client_io_unlock(c);
    } else if (now - last >= CLIENT_SYNC_REPORT_NS &&
        atomic_compare_exchange_strong(&c->sync_report_ns, &last, now) &&
        pthread_mutex_trylock(&c->io) == 0) {
      client_report_due(c);
      client_io_unlock(c);
    } else if (!atomic_exchange_explicit(&c->wake_pending, 1,
                                         memory_order_acq_rel)) {
      pthread_mutex_lock(&c->hb_mu);
      pthread_cond_signal(&c->hb_cv);
      pthread_mutex_unlock(&c->hb_mu);
    }
  }
  return 0;
}

GMB_EXPORT int gmb_record_stream(gmb_client *c, void *ptr, void *stream) {
  if (c == NULL) return client_fail(GMB_E_INVAL, "client is NULL");
  if (c->cuda) gmb__cuda_stream_note(stream);
  int rc = gmb__cache_record_stream(c->cache, ptr, stream);
  if (rc == GMB_E_NOENT)
    return client_fail(rc, "%p is not a block gmb_malloc_async gave", ptr);
  if (rc == GMB_E_INVAL)
    return client_fail(rc, "%p is already free, or the stream is the "
                       "per-thread default stream (name the stream itself)",
                       ptr);
  if (rc) return client_fail(rc, "out of host memory for the cache's records");
  return 0;
}

GMB_EXPORT int gmb_trim(gmb_client *c, size_t keep_bytes) {
  if (c == NULL) return client_fail(GMB_E_INVAL, "client is NULL");
  /* During a CUDA graph capture the wait for the device is not made
   * (gmb__cuda_sync): what is idle and done goes back now, the rest once
   * the capture ended (client_trim_settle). */
  int rc = gmb__cache_trim(c->cache, keep_bytes, GMB_CACHE_TRIM_SYNC, NULL);
  if (rc == 0) client_trim_settle(c, keep_bytes);
  return rc;
}

GMB_EXPORT int gmb_cache_report(gmb_client *c) {
  if (c == NULL) return client_fail(GMB_E_INVAL, "client is NULL");
  /* A request with a reply carries the figures (client_send), and its
   * receive reads the events the broker sent before the reply: an ask
   * sent before this call is read by now, if the thread had not. */
  gmb_stats st;
  struct wire_reply rep;
  int rc = client_stats(c, &st, &rep);
  if (rc) return rc;
  gmb__wire_reply_clear(&rep);
  /* Answered here, or by the library thread, which holds trim_mu until
   * its answer is sent. */
  client_trim_asked(c);
  return atomic_load(&c->dead) ? client_dead_fail(c) : 0;
}

GMB_EXPORT int gmb_cache_stats_get(gmb_client *c, gmb_cache_stats *out) {
  if (c == NULL || out == NULL)
    return client_fail(GMB_E_INVAL, "client or out is NULL");
  struct gmb_cache_counters k;
  gmb__cache_counters(c->cache, &k);
  *out = (gmb_cache_stats){.hits = k.hits, .misses = k.misses,
                           .slab_allocs = k.slab_allocs,
                           .slab_frees = k.slab_frees, .held = k.slab_bytes,
                           .in_use = k.in_use, .cached = k.cached,
                           .peak_held = k.peak_slab_bytes,
                           .peak_in_use = k.peak_in_use, .idle = k.idle,
                           .page_moves = k.page_moves, .host = k.host,
                           .paused = k.paused};
  struct gmb_atags_counts a;
  gmb__atags_counts(c->atags, &a);
  out->paused += a.device; /* `host` counts both already */
  return 0;
}

uint64_t gmb__client_cache_in_use(gmb_client *c) {
  return c ? gmb__cache_in_use(c->cache) : 0;
}

int gmb__client_capture_underway(gmb_client *c) {
  char why[256];
  if (c == NULL || !c->cuda) return 0;
  return gmb__cuda_capture_underway(c->cuda_ordinal, why, sizeof why) != 0;
}

/* --- sleep and wake: tags of the cache ---------------------------------- */

GMB_EXPORT int gmb_cache_tag(gmb_client *c, const char *tag) {
  if (c == NULL) return client_fail(GMB_E_INVAL, "client is NULL");
  int rc = gmb__cache_tag_set(c->cache, tag);
  if (rc == GMB_E_INVAL)
    return client_fail(rc, "a tag has at most %d bytes", GMB_CACHE_TAG_MAX);
  if (rc == GMB_E_LIMIT)
    return client_fail(rc, "a process uses at most 64 tags");
  return rc;
}

/* Pauses tag `tag` as a whole for `by` (GMB_CACHE_BY_*): its cache part,
 * then its gmb_alloc allocations.  A tag with a locked allocation is
 * refused before anything moves.  When the allocations cannot pause after
 * all (one locked meanwhile, host_quota, a copy), the cache part resumes
 * only when this call paused it: a part that was paused already (by an
 * operator, the broker or the application) stays as it was.  Best effort:
 * without room it stays paused.  0 or the failure, explained. */
static int client_tag_pause(void *ctx, const char *tag, int mode, int by) {
  gmb_client *c = ctx;
  int ord = gmb__cache_tag_find(c->cache, tag);
  uint64_t locked = 0;
  if (ord >= 0 && ord < GMB_ATAGS_TAGS) {
    struct gmb_atags_tag a[GMB_ATAGS_TAGS];
    gmb__atags_tags(c->atags, a);
    locked = a[ord].held;
  }
  client_note_refused = 0;
  int rc = locked ? GMB_E_INVAL : 0, paused_now = 0;
  if (rc == 0) rc = gmb__cache_pause_by(c->cache, tag, mode, by, &paused_now);
  if (rc == 0 && ord >= 0) {
    client_note_refused = 0;
    rc = gmb__atags_pause(c->atags, ord, mode, by, &locked);
    if (rc && paused_now) {
      char saved[sizeof client_err];
      memcpy(saved, client_err, sizeof saved);
      int refused = client_note_refused;
      (void)gmb__cache_resume(c->cache, tag);
      memcpy(client_err, saved, sizeof saved);
      client_note_refused = refused;
    }
  }
  /* Paused before by someone this caller outranks (the application over
   * an operator over the broker): the pause is the caller's now, so that
   * gmbctl resume of every tag leaves one the application paused, and
   * the broker's auto-resume one an operator paused. */
  if (rc == 0) {
    int claimed = gmb__cache_claim(c->cache, tag, by) > 0;
    if (ord >= 0) claimed |= gmb__atags_claim(c->atags, ord, by);
    if (claimed && ord >= 0 && ord < 64) client_note_claim(c, ord, by);
  }
  if (rc == GMB_E_INVAL && locked)
    return client_fail(rc, "tag \"%s\" not paused: its allocation %llu "
                       "is locked (gmb_unlock it first)", tag,
                       (unsigned long long)locked);
  if (client_note_refused && rc) return rc; /* the broker's, explained */
  if (rc == GMB_E_NOENT)
    return client_fail(rc, "no tag \"%s\" in this process", tag);
  if (rc == GMB_E_LIMIT) {
    struct gmb_cache_counters k;
    gmb__cache_counters(c->cache, &k);
    return client_fail(rc, "offloading tag \"%s\" would pass this "
                       "process's host quota (the smaller of GMB_HOST_QUOTA "
                       "and the tenant's host_quota; %llu bytes held)", tag,
                       (unsigned long long)k.host);
  }
  if (rc == GMB_E_SYSTEM)
    return client_fail(rc, "out of host memory offloading tag \"%s\"", tag);
  return rc; /* 0, or the device's failure, explained */
}

/* Resumes tag `tag` as a whole: its gmb_alloc allocations first, then its
 * cache part, each all or nothing, so a refusal of the cache part leaves
 * the allocations running, and a resume again finishes.  0 or the
 * failure, explained (still paused: nothing lost). */
static int client_tag_resume(void *ctx, const char *tag) {
  gmb_client *c = ctx;
  if (atomic_load(&c->dead)) return client_dead_fail(c);
  int ord = gmb__cache_tag_find(c->cache, tag);
  int rc = ord >= 0 ? gmb__atags_resume(c->atags, ord) : 0; /* explained */
  if (rc == 0) rc = gmb__cache_resume(c->cache, tag);
  if (rc == GMB_E_NOENT)
    return client_fail(rc, "no tag \"%s\" in this process", tag);
  if (rc == GMB_E_SYSTEM)
    return client_fail(rc, "out of host memory resuming tag \"%s\"", tag);
  return rc; /* the broker's refusal (still paused), explained */
}

/* Tag `tag` (`what` names what of it the program touched, for the
 * message) is paused: when the broker paused it for another job it
 * resumes, waiting for room up to GMB_RESUME_WAIT_MS
 * (gmb__sleep_policy_auto_resume).  0, or the failure explained, with *by
 * who paused it. */
static int client_tag_wake(gmb_client *c, const char *tag, const char *what,
                           int *by) {
  int rc = gmb__sleep_policy_auto_resume(c->pol, tag, c->resume_wait_ms, by);
  if (rc == 0) return 0;
  if (*by == GMB_CACHE_BY_BROKER)
    return client_fail(rc, "%s, paused for another job, could not resume "
                       "within %d ms: %s", what, c->resume_wait_ms,
                       gmb_last_error(c));
  if (*by == GMB_CACHE_BY_OPERATOR)
    return client_fail(rc, "%s was paused by an operator: it resumes with "
                       "gmbctl resume", what);
  return client_fail(rc, "%s is paused: gmb_resume it first", what);
}

/* Who must resume a tag whose parts were paused by the `mask` of
 * GMB_CACHE_BY_*: the application before an operator before the broker
 * (the broker's pause alone resumes by itself). */
static int client_by_first(unsigned mask) {
  return mask & (1u << GMB_CACHE_BY_APP)        ? GMB_CACHE_BY_APP
         : mask & (1u << GMB_CACHE_BY_OPERATOR) ? GMB_CACHE_BY_OPERATOR
                                                : GMB_CACHE_BY_BROKER;
}

/* The sleep policy's view of the tags (sleep_policy.h): each tag's cache
 * part and allocations together. */
static unsigned client_sleep_tags(void *ctx, struct gmb_sleep_tag *out,
                                  unsigned cap) {
  gmb_client *c = ctx;
  struct gmb_cache_tag_info info[GMB_ATAGS_TAGS];
  struct gmb_atags_tag a[GMB_ATAGS_TAGS];
  unsigned n = gmb__cache_tag_info(c->cache, info, GMB_ATAGS_TAGS);
  if (n > GMB_ATAGS_TAGS) n = GMB_ATAGS_TAGS;
  gmb__atags_tags(c->atags, a);
  for (unsigned i = 0; i < n && i < cap; i++) {
    unsigned mask =
        (info[i].running ? 0u : 1u << info[i].by) | a[i].by_mask;
    _Static_assert(sizeof out[i].name == sizeof info[i].tag, "tag names");
    memcpy(out[i].name, info[i].tag, sizeof out[i].name);
    out[i].running = info[i].running || a[i].n_running > 0;
    out[i].paused = mask != 0;
    out[i].by = client_by_first(mask);
    out[i].pausable =
        a[i].held ? 0 : (info[i].running ? info[i].mapped : 0) + a[i].running;
  }
  return n;
}

static void client_sleep_activity(void *ctx, uint64_t v[4]) {
  gmb_client *c = ctx;
  struct gmb_cache_counters k;
  gmb__cache_counters(c->cache, &k);
  v[0] = k.hits;
  v[1] = k.misses;
  v[2] = k.in_use;
  v[3] = gmb__atags_uses(c->atags) +
         atomic_load_explicit(&c->alloc_calls, memory_order_relaxed);
}

static uint64_t client_sleep_trim(void *ctx) {
  gmb_client *c = ctx;
  uint64_t given = 0;
  (void)gmb__cache_trim(c->cache, 0, 0, &given);
  return given;
}

static struct gmb_sleep_policy *client_sleep_policy_new(gmb_client *c) {
  struct gmb_sleep_ops ops = {.ctx = c,
                              .tags = client_sleep_tags,
                              .activity = client_sleep_activity,
                              .trim = client_sleep_trim,
                              .pause = client_tag_pause,
                              .resume = client_tag_resume};
  return gmb__sleep_policy_new(&ops);
}

GMB_EXPORT int gmb_pause(gmb_client *c, const char *tag, int mode) {
  if (c == NULL) return client_fail(GMB_E_INVAL, "client is NULL");
  if (tag == NULL || tag[0] == '\0')
    return client_fail(GMB_E_INVAL, "only a tag's memory pauses");
  if (mode != GMB_PAUSE_OFFLOAD && mode != GMB_PAUSE_DISCARD)
    return client_fail(GMB_E_INVAL, "mode %d is neither GMB_PAUSE_OFFLOAD "
                       "nor GMB_PAUSE_DISCARD", mode);
  _Static_assert(GMB_PAUSE_OFFLOAD == GMB_CACHE_OFFLOAD &&
                     GMB_PAUSE_DISCARD == GMB_CACHE_DISCARD,
                 "gmb.h's modes are the cache's");
  return client_tag_pause(c, tag, mode, GMB_CACHE_BY_APP);
}

GMB_EXPORT int gmb_resume(gmb_client *c, const char *tag) {
  if (c == NULL) return client_fail(GMB_E_INVAL, "client is NULL");
  if (tag == NULL || tag[0] == '\0')
    return client_fail(GMB_E_INVAL, "only a tag's memory pauses");
  return client_tag_resume(c, tag);
}

GMB_EXPORT int gmb_sleep_policy_set(gmb_client *c, const char *policy) {
  if (c == NULL) return client_fail(GMB_E_INVAL, "client is NULL");
  char why[256];
  int rc = gmb__sleep_policy_set(c->pol, policy, why, sizeof why);
  if (rc) return client_fail(rc, "%s", why);
  /* The library thread reports the offer; it runs for a cache's user. */
  return gmb__sleep_policy_on(c->pol) ? client_cache_thread(c) : 0;
}

/* For tests and benchmarks (not exported): the cache's counters. */
void gmb__client_cache_counters(gmb_client *c,
                                struct gmb_cache_counters *out) {
  gmb__cache_counters(c ? c->cache : NULL, out);
}

struct client_visit {
  gmb_cache_visit_fn fn;
  void *arg;
};

static int client_visit_block(void *arg, const struct gmb_cache_block_info *b) {
  const struct client_visit *v = arg;
  gmb_cache_block out = {
      .seg_address = b->seg_base, .seg_size = b->seg_size,
      .address = b->ptr, .size = b->size, .requested = b->req,
      .stream = b->stream,
      .state = b->state == GMB_CACHE_BLOCK_LIVE      ? GMB_BLOCK_LIVE
               : b->state == GMB_CACHE_BLOCK_PENDING ? GMB_BLOCK_PENDING
                                                     : GMB_BLOCK_FREE};
  return v->fn(v->arg, &out);
}

GMB_EXPORT int gmb_cache_visit(gmb_client *c, gmb_cache_visit_fn fn,
                               void *arg) {
  if (c == NULL || fn == NULL)
    return client_fail(GMB_E_INVAL, "client or function is NULL");
  struct client_visit v = {fn, arg};
  int rc = gmb__cache_blocks(c->cache, client_visit_block, &v);
  if (rc == GMB_E_SYSTEM)
    return client_fail(rc, "out of host memory for the walk");
  return rc;
}
