/*
 * wire.h - the codec between gmb's plain C messages and the bytes of
 * proto/gmb.proto.
 *
 * Broker and client work on the structs below; only wire.c includes the
 * generated protobuf-c code.  Decoding never trusts its input: a buffer that
 * does not parse, a request with no body, a string longer than its field
 * here or a handle longer than WIRE_HANDLE_MAX is refused with GMB_E_PROTO,
 * and whatever the decoder allocated is released.
 */
#ifndef GMB_WIRE_H
#define GMB_WIRE_H

#include <stddef.h>
#include <stdint.h>

#define WIRE_PROTOCOL_VERSION 2
#define WIRE_NAME_MAX 63      /* tenant names */
#define WIRE_TOKEN_MAX 256    /* secret tokens */
#define WIRE_MESSAGE_MAX 512  /* human-readable reasons, with the NUL */
#define WIRE_SECRET_MAX 32    /* HelloReply.fd_secret (GMB_FD_SECRET_LEN) */
#define WIRE_DEVICE_MAX 64
#define WIRE_UIDS_MAX 16      /* AdminTenantAdd.uids */

enum wire_kind {
  WIRE_NONE = 0,
  WIRE_HELLO,
  WIRE_ALLOC,
  WIRE_FREE,
  WIRE_STATS,
  WIRE_HEARTBEAT,
  WIRE_BYE,
  WIRE_EVENT, /* replies only */
  WIRE_ADMIN_STATUS,
  WIRE_ADMIN_COMPACT, /* request: AdminCompact; reply: CompactStats */
  WIRE_NOMEM,         /* replies only: why GMB_E_NOMEM */
  WIRE_ADMIN_QUOTA,   /* request: AdminLimit; reply: WIRE_TENANT_ROW */
  WIRE_ADMIN_RESERVE, /* request: AdminLimit; reply: WIRE_TENANT_ROW */
  WIRE_TENANT_ROW,    /* replies only: one tenant's row */
  WIRE_ADMIN_EVICT,   /* request: AdminEvict; reply: EvictReply */
  WIRE_ADMIN_RELOAD,  /* request; the reply is a status and a message */
  WIRE_ADMIN_SNAPSHOT, /* request; reply: SnapshotReply */
  WIRE_ADMIN_METRICS, /* request; reply: MetricsReply */
  WIRE_SEGMENT_CLOSED, /* request: SegmentClosed; no reply */
  WIRE_ADMIN_TENANT_ADD,    /* request: AdminTenantAdd; reply: TENANT_ROW */
  WIRE_ADMIN_TENANT_REMOVE, /* request and reply: AdminTenantRemove,
                               TenantRemoveReply */
  WIRE_SLEEP_NOTE,    /* request: SleepNote; the reply is a status */
  WIRE_ADMIN_PAUSE,   /* request: AdminPause; reply: PauseReply */
  WIRE_ADMIN_RESUME,  /* request: AdminPause (admin_resume); reply: as pause */
  WIRE_VMM,           /* request: Vmm; reply: WIRE_STATS */
  WIRE_LOCK,          /* request: Lock; reply: LockReply */
  WIRE_KIND_COUNT     /* not a kind: how many there are */
};

#define WIRE_HOLDERS_MAX 8 /* tenants named in a NoMemory reply */
/* Pages in one Alloc (Alloc.pages) and allocations in one Free. */
#define WIRE_PAGES_MAX 64

enum wire_event {
  WIRE_EVENT_NONE = 0,
  WIRE_EVENT_SEGMENT_RETIRED = 1,
  WIRE_EVENT_SHUTDOWN = 2,
  WIRE_EVENT_SESSION_ENDED = 3,
  WIRE_EVENT_EVICTED = 4,
  WIRE_EVENT_TRIM = 5, /* give u.event.bytes of cached memory back */
  WIRE_EVENT_SLEEP = 30, /* pause tags (u.event.tag, mode; or bytes) */
  WIRE_EVENT_WAKE = 31,  /* resume u.event.tag ("": every tag paused so) */
};

#define WIRE_TAG_MAX 63      /* a tag's name (sleep and wake) */
#define WIRE_PAUSED_MAX 256  /* SessionRow.paused, with its NUL */
/* EVENT_SLEEP's modes: GMB_PAUSE_OFFLOAD, GMB_PAUSE_DISCARD, or the
 * broker's ask (the session's policy chooses). */
#define WIRE_SLEEP_ASK 2
/* SleepNote.by */
enum { WIRE_BY_APP = 0, WIRE_BY_BROKER = 1, WIRE_BY_OPERATOR = 2 };

/* AdminTenantAdd: a tenant made at run time (admin socket). */
struct wire_tenant_add {
  char tenant[WIRE_NAME_MAX + 1];
  uint64_t quota, reserve; /* bytes; quota 0: no limit */
  int has_token;           /* token_sha256 is set */
  uint8_t token_sha256[32];
  uint32_t n_uids;
  uint32_t uids[WIRE_UIDS_MAX];
  int32_t priority;
  int has_host_quota;  /* host_quota is given; else the default applies */
  uint64_t host_quota; /* bytes; 0: no limit */
};

struct wire_request {
  uint64_t id;
  enum wire_kind kind;
  uint64_t cached_free; /* the sender's cache's free bytes (any kind) */
  int trim_answered;    /* this answers the last EVENT_TRIM (a Heartbeat) */
  uint64_t sleep_pausable; /* its sleep policy's offer (any kind) */
  uint64_t sleep_idle_ms;  /* idle for this long when it sent it */
  int sleep_idle;          /* its policy deems it idle (offloadable) */
  uint64_t cached_holes;   /* its cache's free bytes on pages in use */
  union {
    struct {
      uint32_t version;
      char tenant[WIRE_NAME_MAX + 1];
      uint32_t token_len;
      uint8_t token[WIRE_TOKEN_MAX];
      int32_t pid;
      char client[WIRE_DEVICE_MAX];
    } hello;
    struct {
      uint64_t size;
      uint32_t flags;
      int32_t timeout_ms;
      uint32_t pages; /* 0, or pages of 2 MiB each in a segment of its own */
      uint64_t ahead; /* pages: bytes of the same miss asked for next */
    } alloc;
    struct {
      uint64_t id;
      uint32_t n_more; /* more ids freed with it, < WIRE_PAGES_MAX */
      uint64_t more[WIRE_PAGES_MAX - 1];
    } free;
    struct {
      uint64_t segment;
    } segment; /* WIRE_SEGMENT and WIRE_SEGMENT_CLOSED */
    struct {
      uint64_t bytes; /* the process's VMM bytes now, in total */
    } vmm;
    struct {
      uint64_t id;
      int32_t timeout_ms;
    } lock;
    struct {
      char tenant[WIRE_NAME_MAX + 1]; /* "": every tenant */
    } admin_compact;
    struct {
      char tenant[WIRE_NAME_MAX + 1];
      int set;        /* 0: read only */
      uint64_t value; /* the new quota or reservation */
    } admin_limit;    /* WIRE_ADMIN_QUOTA, WIRE_ADMIN_RESERVE */
    struct {
      char tenant[WIRE_NAME_MAX + 1];
    } admin_evict;
    struct {
      uint64_t segment, offset; /* the cursor; (0, 0): the first page */
      uint32_t limit;           /* ranges per page; 0: the default */
    } admin_snapshot;
    struct wire_tenant_add admin_tenant_add;
    struct {
      char tenant[WIRE_NAME_MAX + 1];
      int evict; /* end its sessions now */
    } admin_tenant_remove;
    struct {
      char tag[WIRE_TAG_MAX + 1];
      int paused;
      uint32_t mode, by;
      uint64_t host_bytes, device_bytes;
    } sleep_note;
    struct {
      char tenant[WIRE_NAME_MAX + 1];
      char tag[WIRE_TAG_MAX + 1]; /* "": every tag */
      int discard;
    } admin_pause; /* WIRE_ADMIN_PAUSE, WIRE_ADMIN_RESUME */
  } u;
};

struct wire_tenant_row {
  char name[WIRE_NAME_MAX + 1];
  uint64_t quota, used, peak, segments, allocations;
  uint32_t sessions;
  uint64_t free_in_segments, largest_free;
  double fragmentation;
  uint64_t reserve, waiting;
  int32_t priority;
  uint64_t cached; /* of used: free in its sessions' caches */
  uint64_t trim_asks, trim_ignored; /* since start, ended sessions too */
  /* Sleep and wake: now, then totals since start. */
  uint64_t host_bytes, paused_bytes, host_quota;
  uint32_t paused_tags;
  uint64_t pauses, resumes, sleep_asks;
  double paused_seconds;
  uint64_t vmm;    /* of used: its processes' own VMM memory */
  /* The descriptor channel: descriptors not seen read on its channels
   * (live and kept), channels kept for its ended sessions, requests
   * refused at a bound since start. */
  uint64_t fd_unread, fd_refused;
  uint32_t fd_kept;
};

/* One session in the admin status. */
struct wire_session_row {
  uint64_t id;
  char tenant[WIRE_NAME_MAX + 1];
  uint32_t uid;
  int32_t pid; /* in the broker's pid namespace; 0: unknown */
  char client[WIRE_DEVICE_MAX];
  uint64_t allocations, used;
  uint64_t cached; /* of used: free in its cache, as last reported */
  uint64_t trim_asks, trim_ignored;
  uint32_t waiting;
  uint64_t host_bytes, paused_bytes;
  char paused[WIRE_PAUSED_MAX]; /* its paused tags, comma-separated */
  uint64_t sleep_pausable, sleep_idle_ms;
  uint32_t fd_unread;  /* descriptors on its channel not seen read */
  uint64_t fd_refused; /* its descriptor requests refused at a bound */
};

struct wire_compact_stats {
  uint64_t moves, bytes_moved, segments_released, bytes_released;
  uint64_t skipped_locked, skipped_pinned, runs;
  double seconds;
};

struct wire_admin_status {
  char device[WIRE_DEVICE_MAX];
  uint64_t capacity, in_segments, in_use;
  uint32_t sessions;
  size_t n_tenants;
  struct wire_tenant_row *tenants; /* owned; wire_reply_clear frees */
  double fragmentation;
  uint64_t largest_free;
  struct wire_compact_stats compaction;
  uint64_t retiring; /* bytes parked until clients close them (cuda) */
  uint64_t cached;   /* of in_use: free in the clients' caches */
  size_t n_sessions;
  struct wire_session_row *session_rows; /* owned; wire_reply_clear frees */
  uint64_t host_bytes, paused_bytes; /* of paused tags, all tenants */
  uint32_t offload_job_requests;     /* held for the broker's offload job */
  uint64_t offload_slices, offload_jobs; /* since start */
  uint32_t offload_pauses; /* tenants an operator's pause still offloads */
  /* The descriptor channel: descriptors not seen read on every channel,
   * channels kept for ended sessions, requests refused at a bound. */
  uint64_t fd_unread, fd_refused;
  uint32_t fd_kept;
};

struct wire_range_info {
  uint64_t offset, size, id, session; /* id 0: free */
  int movable, locked;
  int tail; /* a large allocation's tail: its id has another range */
};

struct wire_segment_info {
  uint64_t id, size;
  uint64_t used; /* bytes of all its allocations, in this page or not */
  char tenant[WIRE_NAME_MAX + 1];
  int small;
  size_t n_ranges;
  struct wire_range_info *ranges; /* owned */
};

struct wire_reply {
  uint64_t id;
  int status; /* 0 or a negative GMB_E_* */
  char message[WIRE_MESSAGE_MAX];
  uint64_t asked_back; /* GMB_E_QUOTA: cached bytes asked of other sessions */
  enum wire_kind kind; /* WIRE_NONE: status (and message) only */
  union {
    struct {
      uint32_t version;
      uint64_t session;
      char tenant[WIRE_NAME_MAX + 1];
      char device[WIRE_DEVICE_MAX];
      char device_uuid[WIRE_DEVICE_MAX]; /* cuda: "GPU-..."; else "" */
      char device_pci[WIRE_DEVICE_MAX];  /* cuda: "0000:17:00.0"; else "" */
      uint32_t heartbeat_ms;
      uint32_t lock_slots;
      uint32_t fd_secret_len; /* WIRE_SECRET_MAX, or 0: none */
      uint8_t fd_secret[WIRE_SECRET_MAX];
      uint64_t host_quota; /* the tenant's; 0: no limit */
    } hello;
    struct {
      uint64_t id, size, segment, offset;
      uint32_t slot;             /* movable: lock table slot */
      uint32_t pinned;           /* the broker made it pinned (large) */
      /* A large allocation's tail: tail_size bytes at tail_offset of
       * tail_segment follow the segment's pages (0: none). */
      uint64_t tail_segment, tail_offset, tail_size;
      uint32_t n_pages;          /* Alloc.pages: each page's id, segment */
      uint64_t page_id[WIRE_PAGES_MAX], page_seg[WIRE_PAGES_MAX];
    } alloc;
    struct {
      uint64_t quota, used, peak, segments;
      uint64_t cached; /* of used: free in the tenant's sessions' caches */
      uint64_t vmm;    /* of used: its processes' own VMM memory */
      uint64_t device_capacity, device_segments, device_used,
          free_in_segments;
    } stats;
    struct {
      enum wire_event kind;
      uint64_t segment;
      uint64_t bytes; /* WIRE_EVENT_TRIM, WIRE_EVENT_SLEEP */
      char tag[WIRE_TAG_MAX + 1]; /* SLEEP/WAKE from an operator */
      uint32_t mode; /* SLEEP: GMB_PAUSE_*, or WIRE_SLEEP_ASK */
    } event; /* the reason is in `message` */
    struct wire_admin_status admin_status;
    struct wire_compact_stats compact;
    struct {
      uint64_t request, free_total, largest_free, unmovable;
      size_t n_holders;
      char holders[WIRE_HOLDERS_MAX][WIRE_NAME_MAX + 1];
    } nomem; /* status GMB_E_NOMEM, with the reason in `message` */
    struct wire_tenant_row tenant_row;
    struct {
      uint32_t sessions;
      uint64_t bytes_freed;
    } evict;
    struct {
      int has_status; /* the first page: `status` is filled */
      struct wire_admin_status status;
      size_t n_segments;
      struct wire_segment_info *segments; /* owned */
      uint64_t next_segment, next_offset; /* next_segment 0: the last */
      uint64_t changes; /* the pool's change counter at this page */
      uint32_t limit;   /* ranges per page, as applied */
    } snapshot; /* one page of a snapshot */
    struct {
      char *text; /* owned, NUL-terminated */
    } metrics;
    struct {
      int removed;           /* gone now; else when `sessions` end */
      uint32_t sessions;     /* still open */
      uint32_t evicted;      /* ended by `evict` */
      uint64_t bytes_freed;  /* by `evict` */
    } tenant_remove;
    struct {
      uint32_t sessions; /* told */
      uint32_t movable;  /* movable allocations offloaded / brought back */
      uint64_t movable_bytes;
    } pause; /* WIRE_ADMIN_PAUSE, WIRE_ADMIN_RESUME */
    struct {
      int held;
      uint64_t segment, offset;
    } lock;
  } u;
};

/*
 * Encoders write into a malloc'd buffer the caller frees; they return 0, or
 * GMB_E_INVAL when a field does not fit the protocol.  Decoders fill *out
 * and return 0 or GMB_E_PROTO.
 */
int gmb__wire_request_encode(const struct wire_request *req, uint8_t **buf,
                             size_t *len);
int gmb__wire_request_decode(const uint8_t *buf, size_t len,
                             struct wire_request *out);
int gmb__wire_reply_encode(const struct wire_reply *rep, uint8_t **buf,
                           size_t *len);
int gmb__wire_reply_decode(const uint8_t *buf, size_t len,
                           struct wire_reply *out);
/* Frees what a decoded or built reply owns (the admin status's tenant and
 * session rows, a snapshot's segments, the metrics text). */
void gmb__wire_reply_clear(struct wire_reply *rep);

/* The request's kind as a word, for logs: "alloc". */
const char *gmb__wire_kind_name(enum wire_kind kind);

/* For the test that compares the wire Status enum with GMB_ERRORS: the value
 * of the Status named `name` ("GMB_E_QUOTA"), or INT32_MIN when none. */
int gmb__wire_status_value(const char *name);

/* The number of values of the wire Status enum (GMB_OK included), so that
 * the same test sees a Status the C list lacks. */
size_t gmb__wire_status_count(void);

#endif /* GMB_WIRE_H */
