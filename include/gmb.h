/*
 * gmb.h - client library of gmb, the GPU memory broker.
 *
 * A process connects to the broker once (gmb_connect), then allocates device
 * memory through it.  The broker owns the memory; the library maps the
 * segments that hold this session's allocations into the process and turns
 * an allocation id into a pointer (gmb_lock).  Every function returns 0 or a
 * negative GMB_E_* code; gmb_last_error() explains the last failure of the
 * calling thread in one line.  A gmb_client may be shared by threads.
 *
 * The library never aborts on what the broker sends: a reply it cannot
 * understand is GMB_E_PROTO.
 */
#ifndef GMB_H
#define GMB_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(GMB_BUILDING) && defined(__GNUC__)
#define GMB_EXPORT __attribute__((visibility("default")))
#else
#define GMB_EXPORT
#endif

#define GMB_VERSION_MAJOR 0
#define GMB_VERSION_MINOR 1
#define GMB_VERSION_PATCH 0
#define GMB_VERSION_STRING "0.1.0"

/*
 * The one list of error codes.  It generates the enum below, gmb_strerror()
 * and gmb_err_name(); the wire protocol's Status enum (proto/gmb.proto) is
 * checked against it by tests/unit/check_wire.c.  Codes are stable: append,
 * never renumber.
 */
#define GMB_ERRORS(X)                                                        \
  X(INVAL, 1, "invalid argument")                                            \
  X(QUOTA, 2, "the tenant's quota does not allow this allocation")           \
  X(NOMEM, 3, "the device has no room for this allocation")                  \
  X(AUTH, 4, "not allowed to act as this tenant")                            \
  X(NOENT, 5, "no such allocation, segment or tenant")                       \
  X(CONN, 6, "no connection to the broker")                                  \
  X(TIMEOUT, 7, "timed out")                                                 \
  X(PROTO, 8, "protocol error: a message could not be understood")           \
  X(DEVICE, 9, "device error")                                               \
  X(EVICTED, 10, "the session was evicted by an operator")                   \
  X(LIMIT, 11, "a broker limit was reached")                                 \
  X(SYSTEM, 12, "a system call failed")

enum gmb_error {
  GMB_OK = 0,
#define GMB_ERROR_ENUM_(name, code, text) GMB_E_##name = -(code),
  GMB_ERRORS(GMB_ERROR_ENUM_)
#undef GMB_ERROR_ENUM_
};

typedef struct gmb_client gmb_client; /* one session; thread-safe */
typedef uint64_t gmb_id;              /* an allocation; 0 is never valid */

typedef struct gmb_stats { /* one tenant, as the broker sees it now */
  uint64_t quota;          /* bytes it may hold; 0 = no limit */
  uint64_t used;           /* bytes of its live allocations (the pages of
                              caches included) */
  uint64_t peak;           /* highest `used` since the broker started */
  uint64_t segments;       /* bytes of device segments held for it */
  uint64_t cached;         /* of `used`: idle pages in the caches of the
                              tenant's sessions (gmb_malloc_async), as each
                              last reported it: what they can give back;
                              gmb_trim gives back this session's */
} gmb_stats;

#define GMB_MOVABLE 0x1u /* the broker may move it while unlocked */
#define GMB_UNTAGGED 0x2u /* no tag, whatever the thread's current tag
                            (gmb_cache_tag): memory locked for good, such
                            as the preload shim's cudaMalloc, must not
                            keep the tag from pausing */

typedef struct gmb_device_info { /* the broker's device, as this process sees it */
  char kind[16];       /* "cuda" (a GPU) or "host" (shared host memory) */
  int ordinal;         /* cuda: the GPU's ordinal in this process (it may
                          differ from the broker's); -1 on the host device */
  char uuid[48];       /* cuda: "GPU-xxxxxxxx-...", as nvidia-smi -L shows */
  char pci_bus_id[32]; /* cuda: "0000:17:00.0" */
} gmb_device_info;

/*
 * Connects to the broker at `endpoint` (NULL: $GMB_ENDPOINT, else
 * ipc://$GMB_RUN_DIR/broker.sock) as `tenant` (NULL: $GMB_TENANT, else the
 * broker names it uid-UID).  On success *out is a new session the caller
 * owns and releases with gmb_disconnect().  GMB_E_CONN when no broker
 * answers, GMB_E_AUTH when this process may not act as the tenant.
 */
GMB_EXPORT int gmb_connect(const char *endpoint, const char *tenant,
                           gmb_client **out);

/*
 * Connects to the broker of one GPU, on a host that runs one broker per GPU
 * (docs/deploy.md).  `gpu` names the GPU: its UUID ("GPU-xxxxxxxx-..."),
 * or its CUDA ordinal in this process ("cuda:N" or "N", mapped to its
 * UUID through the driver), or NULL for the calling thread's current
 * device (gmb_gpu_current).  The broker is looked for at
 * $GMB_RUN_DIR/UUID/broker.sock (a broker started with
 * --run-dir-per-gpu), then at the default endpoint ($GMB_ENDPOINT, else
 * $GMB_RUN_DIR/broker.sock), which is kept only when its broker serves that
 * GPU.  GMB_E_CONN when no broker serves it (the message names where it
 * looked and what the default broker serves), GMB_E_DEVICE when the GPU
 * cannot be found (no driver, no such ordinal) or a broker in the GPU's
 * own run dir serves another one; else as gmb_connect.
 */
GMB_EXPORT int gmb_connect_gpu(const char *gpu, const char *tenant,
                               gmb_client **out);

/* The calling thread's current CUDA device as this process numbers it:
 * the device of its current context (cuCtxGetDevice), or 0 when it has
 * none, as the CUDA runtime would use.  0, or GMB_E_DEVICE (no driver). */
GMB_EXPORT int gmb_gpu_current(int *ordinal);

/* Ends the session: the broker frees every allocation it still holds and
 * the segments mapped into this process are unmapped.  Accepts NULL. */
GMB_EXPORT void gmb_disconnect(gmb_client *c);

/*
 * Allocates `size` bytes (rounded up to 512).  GMB_E_QUOTA when the
 * tenant's quota would be passed by memory in use, at once.  When the
 * bytes missing are held free in the caches of the tenant's other
 * sessions (gmb_malloc_async in other processes), the broker asks them to
 * give the bytes back and holds the request until they arrive, then
 * serves it; it answers GMB_E_QUOTA, saying so, when they did not come
 * within the broker's trim_wait_ms (100 ms by default; at once when the
 * sessions asked answered without them).  When the device has no room
 * while other sessions' caches hold free memory, the broker likewise asks
 * them first and holds the request for trim_wait_ms at most.  When the
 * device's free total would hold the request but no free range does, the
 * broker compacts (moves unlocked movable allocations) and answers after
 * that; GMB_E_NOMEM when there is still no room, with gmb_last_error()
 * giving the free total, the largest free range and the bytes that could
 * not be moved.  With flags GMB_MOVABLE the broker may move the allocation
 * while it is not locked: use it only through gmb_lock/gmb_unlock.
 * GMB_E_LIMIT when the session holds 65536 movable allocations.  The
 * allocation belongs to the thread's current tag (gmb_cache_tag, paused
 * and resumed with it by gmb_pause/gmb_resume) unless flags hold
 * GMB_UNTAGGED; GMB_E_INVAL when that tag's allocations are paused.
 */
GMB_EXPORT int gmb_alloc(gmb_client *c, size_t size, unsigned flags,
                         gmb_id *out);

/* As gmb_alloc, but when the device has no room the request waits up to
 * timeout_ms (negative: forever) for memory to be freed; GMB_E_TIMEOUT then.
 * A quota is waited on only as gmb_alloc does, while the tenant's other
 * sessions' caches give back the bytes it lacks (trim_wait_ms at most, or
 * timeout_ms when shorter): then GMB_E_QUOTA, never GMB_E_TIMEOUT.
 *
 * The waiting thread does not hold the client while it waits: other
 * threads' calls on c go on meanwhile (a gmb_free that makes the room
 * waited for serves the wait), and several threads may wait at once, up
 * to the broker's max_waiters_per_session (GMB_E_LIMIT past it, or past
 * 64 in one client, nothing sent).  A broker that dies ends every wait
 * with GMB_E_CONN.  A tagged wait that is served after another thread or
 * an operator paused its tag's allocations is answered as a call made
 * after the pause: the memory goes back, GMB_E_INVAL. */
GMB_EXPORT int gmb_alloc_wait(gmb_client *c, size_t size, unsigned flags,
                              int timeout_ms, gmb_id *out);

/* Frees an allocation of this session.  GMB_E_NOENT if it is not one.  On
 * a GPU it first waits for the device as cudaFree does (cuCtxSynchronize
 * in the GPU's primary context and in each other context of that GPU
 * that was current on a thread calling gmb), since kernels still queued
 * may use the memory and the broker may hand it to another tenant or move
 * its neighbours once it has it back.  When that wait fails (the context
 * faulted) or cannot be made (a CUDA graph capture is underway in the
 * process, on any thread: the driver would refuse the wait and break the
 * capture, so none is made) nothing is freed: GMB_E_DEVICE, explained;
 * gmb_free it again after the capture, or the memory goes back when the
 * session ends. */
GMB_EXPORT int gmb_free(gmb_client *c, gmb_id id);

/*
 * Returns in *ptr the address of the allocation in this process.  For a
 * pinned allocation the address never changes while it lives.  A movable
 * allocation stays at that address until the matching gmb_unlock (locks
 * nest: n locks need n unlocks); the broker moves it only while nobody
 * holds it.  Locking sends no message to the broker (an atomic
 * compare-and-swap on this session's lock table), except the first time
 * the allocation sits in a segment this process has not mapped yet.  If
 * the broker is moving it right now, gmb_lock waits for the move to end,
 * up to $GMB_LOCK_TIMEOUT_MS (default 10000): GMB_E_TIMEOUT then.  If the
 * broker offloaded it to its host memory (an idle session that opted in
 * to sleep, or an operator's gmbctl pause), gmb_lock asks the broker to
 * bring it back (one request; the address may differ from the last one)
 * and waits for room up to the broker's restore_wait_ms (and
 * $GMB_LOCK_TIMEOUT_MS): GMB_E_TIMEOUT then (GMB_E_NOMEM or GMB_E_QUOTA
 * when it could not wait), its bytes still kept by the broker.
 * GMB_E_NOENT for an id that is not this session's, GMB_E_LIMIT when 2^29-1
 * locks are held on one allocation.
 */
GMB_EXPORT int gmb_lock(gmb_client *c, gmb_id id, void **ptr);

/*
 * Releases a lock taken with gmb_lock, at once, on the CPU: the broker may
 * move a movable allocation from then on.  The caller's contract: every
 * use of the pointer is finished, including GPU work (kernels, copies)
 * queued on it, or the move would copy stale bytes while a kernel writes
 * the old place.  With work still queued use gmb_unlock_on_stream, or
 * synchronise the stream first.  GMB_E_INVAL when the movable allocation
 * is not locked (the count never goes below zero).
 */
GMB_EXPORT int gmb_unlock(gmb_client *c, gmb_id id);

/* Releases the lock when `cuda_stream` reaches this point (a host function
 * queued with cuLaunchHostFunc), so the CPU never waits for the GPU.  CUDA
 * device only; GMB_E_DEVICE elsewhere.  GMB_E_INVAL while the stream is
 * being captured into a CUDA graph: the release would be recorded into
 * the graph and run at every replay, never now; unlock after the capture.
 * If the context faults before the stream reaches the release, the driver
 * never runs it: the hold stays until the session ends, and the
 * allocation does not move meanwhile. */
GMB_EXPORT int gmb_unlock_on_stream(gmb_client *c, gmb_id id,
                                    void *cuda_stream);

/*
 * The fast path: a stream-ordered cache in this process, like
 * cudaMallocAsync.  gmb_malloc_async returns in *ptr a block of at least
 * `size` bytes (rounded up to 512), usable on `stream` (a CUstream; NULL
 * or CU_STREAM_LEGACY: the legacy default stream; CU_STREAM_PER_THREAD:
 * the calling thread's default stream, a different one on each thread;
 * ignored on the host device).  It comes from
 * the session's cache: reserved address ranges with pages of 2 MiB from
 * the broker mapped behind them (each page one pinned allocation, counted
 * against the tenant's quota like any allocation), as PyTorch's expandable
 * segments do.  Blocks of any size are cut from those ranges and cross
 * page boundaries, so no request needs contiguous physical memory; a page
 * that holds no block in use goes back to the broker on its own, whatever
 * its neighbours hold (gmb_trim, the broker's ask), or is moved to where a
 * new block needs one.  A request the cache can serve sends no message.
 * When a new page meets the quota or a full device, the cache first gives
 * its idle pages back and tries once more: GMB_E_QUOTA or GMB_E_NOMEM
 * then, explained.  GMB_E_INVAL for size 0.  The block is the caller's
 * until gmb_free_async; the session's end frees it with everything else.
 * Blocks are pinned (they never move) and are not gmb_id allocations:
 * gmb_lock, gmb_free and gmb_read/write do not take them.
 */
GMB_EXPORT int gmb_malloc_async(gmb_client *c, size_t size, void *stream,
                                void **ptr);

/*
 * Gives a block of gmb_malloc_async back to the cache, never waiting and
 * making no driver call: it is reusable at once by requests on `stream`,
 * and by requests on other streams once the work queued on `stream`
 * finished (an event is recorded on `stream` when another stream first
 * wants the block; on CU_STREAM_PER_THREAD at the free).  So the caller
 * may free as soon as the work that uses the block is queued on
 * `stream`.  0 for ptr NULL.  GMB_E_NOENT for
 * a pointer the cache did not give; GMB_E_INVAL for one already freed, or
 * (on a GPU) for a stream that takes no event (destroyed): the block is
 * then still the caller's.  Nothing changes on an error.
 */
GMB_EXPORT int gmb_free_async(gmb_client *c, void *ptr, void *stream);

/*
 * Says that work queued on `stream` uses a block of gmb_malloc_async too,
 * besides the stream it will be freed on (as torch.Tensor.record_stream,
 * for a tensor made on one stream and used on another).  Its
 * gmb_free_async then records an event on each such stream as well, and
 * the block is reused by no stream, its own included, until the work
 * queued on each of them before the free has finished; after that it is
 * as any block freed on the free's stream.  Recording the stream the
 * block is then freed on, or one stream twice, adds nothing.  Never waits
 * and sends no message.  0 (also on the host device, where streams do
 * not count); GMB_E_NOENT for a pointer the cache did not give,
 * GMB_E_INVAL for one already freed or for the per-thread default stream
 * (CU_STREAM_PER_THREAD: which thread's it is cannot be told at the free;
 * name the stream itself).  At the free, a recorded stream that takes no
 * event (destroyed) makes gmb_free_async fail with GMB_E_INVAL, and the
 * block is still the caller's.
 */
GMB_EXPORT int gmb_record_stream(gmb_client *c, void *ptr, void *stream);

/*
 * Gives back to the broker the cache's idle pages (pages that hold no
 * block in use, whatever their neighbours hold), until at most keep_bytes
 * of them stay; like cudaMemPoolTrimTo, or torch.cuda.empty_cache() with
 * keep_bytes 0.  A page whose free memory a stream's work may still use
 * is given back once that work finished: when some remain, gmb_trim
 * waits for the device once (as empty_cache does) and gives back what
 * that freed.  While a CUDA graph capture is underway in the process
 * (on any thread) it does not wait, which would break the capture: it
 * gives back what is done, and the library's thread gives back the rest
 * once the capture ended.  Returns 0 (what could not be given back shows
 * in gmb_cache_stats.idle).
 */
GMB_EXPORT int gmb_trim(gmb_client *c, size_t keep_bytes);

/*
 * Tells the broker the cache's figures now (its idle bytes, the holes
 * between its blocks) and answers the broker's asks to give cached memory
 * back that reached this session before the call: one round trip, plus a
 * Free per page an ask takes.  When it returns, the broker knows the
 * cache as it stands, and no ask made before the call waits on this
 * session.  Programs need not call it: the library reports a change
 * within milliseconds and answers asks from its own thread.  It is for
 * tools that sequence several processes and must not race those moments
 * (gmb-replay --cache).  0, or the request's failure (GMB_E_CONN).
 */
GMB_EXPORT int gmb_cache_report(gmb_client *c);

typedef struct gmb_cache_stats { /* this session's cache (gmb_malloc_async) */
  uint64_t hits;        /* requests served from mapped pages: no message */
  uint64_t misses;      /* requests that needed pages mapped */
  uint64_t slab_allocs; /* pages the broker gave (each one request) */
  uint64_t slab_frees;  /* pages given back (trims, quota or device full) */
  uint64_t held;        /* bytes of the pages mapped now: the tenant's */
  uint64_t in_use;      /* bytes handed out now, each request rounded to 512 */
  uint64_t cached;      /* of `held`: free (beside blocks in use or not) */
  uint64_t peak_held, peak_in_use; /* the highest since the session began */
  uint64_t idle;        /* of `cached`: bytes of pages that hold no block in
                           use, what gmb_trim gives back */
  uint64_t page_moves;  /* idle pages moved under a new block instead of
                           asking the broker for new ones */
  uint64_t host;        /* bytes of host memory holding paused tags' pages
                           and gmb_alloc allocations (gmb_pause's offload;
                           GMB_HOST_QUOTA bounds it) */
  uint64_t paused;      /* bytes of pages and gmb_alloc allocations paused
                           tags gave back, that gmb_resume maps again */
} gmb_cache_stats;

/* Fills *out with the figures of this session's cache, as this process
 * counts them (no message).  0, or GMB_E_INVAL for a NULL argument. */
GMB_EXPORT int gmb_cache_stats_get(gmb_client *c, gmb_cache_stats *out);

/* One block of the session's cache as gmb_cache_visit gives it: the piece
 * of the block that lies in one run of consecutive mapped pages (the
 * "segment" of a PyTorch-style snapshot); a free block that crosses
 * unmapped pages is given piece by piece, and unmapped address space is
 * not given at all. */
typedef struct gmb_cache_block {
  uint64_t seg_address, seg_size; /* the run of mapped pages */
  uint64_t address, size;         /* the block (its piece in the run) */
  uint64_t requested; /* LIVE, PENDING: the request rounded to 512 */
  void *stream;       /* FREE, PENDING: the stream of its free */
  int state;          /* GMB_BLOCK_* */
} gmb_cache_block;
#define GMB_BLOCK_FREE 0    /* free in the cache */
#define GMB_BLOCK_LIVE 1    /* handed out (gmb_malloc_async) */
#define GMB_BLOCK_PENDING 2 /* freed, waiting for another stream's work */
typedef int (*gmb_cache_visit_fn)(void *arg, const gmb_cache_block *b);
/* Calls fn for every block of the session's cache on mapped pages, in
 * address order within each arena, holding each arena's lock in turn
 * (fn must not call into the cache).  Stops when fn returns non-zero and
 * returns that; else 0, or GMB_E_SYSTEM out of host memory.  A
 * diagnostic: a consistent view of each arena, not of all at once. */
GMB_EXPORT int gmb_cache_visit(gmb_client *c, gmb_cache_visit_fn fn,
                               void *arg);

/*
 * Sleep and wake by tag, as vLLM's sleep mode and torch_memory_saver.
 *
 * gmb_cache_tag makes `tag` the calling thread's current tag on c (NULL
 * or "": none, the default): the thread's gmb_malloc_async blocks then
 * come from the tag's own part of the cache (its own address ranges and
 * pages), made at the first use of the name; the thread's gmb_alloc and
 * gmb_alloc_wait allocations belong to the tag too.  Freeing needs no
 * tag.  0; GMB_E_INVAL for a name of more than 63 bytes, GMB_E_LIMIT past
 * 64 tags in the process.
 *
 * gmb_pause gives the device pages of the tag back to the broker, where
 * other tenants may use them; the tenant's quota then counts only what it
 * still has on the device.  The blocks and their addresses stay: the
 * address ranges stay reserved, with nothing mapped (a kernel that touches
 * a paused block faults: the caller's bug).  GMB_PAUSE_OFFLOAD first
 * copies the bytes of every page holding a block in use to host memory of
 * this process (freed with it if it exits paused); GMB_PAUSE_DISCARD
 * keeps nothing (a KV cache).  It waits for the device's work first (a
 * block still used on a stream is copied once that work finished) and
 * for allocations of the tag in progress.  While paused the tag's blocks
 * may be freed (gmb_free_async); allocating with the tag current fails
 * with GMB_E_INVAL.  0, also for a tag already paused: nothing of its
 * memory changes, but a pause an operator or the broker made is the
 * application's from then on (gmbctl resume of every tag leaves it, and
 * its allocations refuse a lock rather than resume themselves);
 * GMB_E_NOENT for a tag never set; GMB_E_LIMIT when the copy would pass
 * $GMB_HOST_QUOTA (a size, such as 16GiB; unset: no limit beyond what
 * malloc gives), GMB_E_SYSTEM out of host memory, GMB_E_DEVICE when the
 * device failed: then the tag runs on, nothing changed.
 *
 * The tag's gmb_alloc allocations pause with it (after its cache part):
 * each one's bytes copied to host memory (offload) or dropped (discard),
 * then freed at the broker.  A tag with one of them locked (gmb_lock
 * without its gmb_unlock, pinned or movable) is not paused: GMB_E_INVAL,
 * naming it, nothing changed.  While the application or an operator
 * keeps them paused, gmb_lock, gmb_read and gmb_write of them fail with
 * GMB_E_INVAL, and so does gmb_alloc with the tag current; paused for
 * another job (the broker's ask, gmb_sleep_policy_set) these calls resume
 * the tag first, as gmb_malloc_async does.  gmb_free drops a paused one
 * (and its host copy).
 * gmb_resume allocates each anew (same size and flags) and writes its
 * bytes back: its gmb_id stays the program's, but the address gmb_lock
 * gives may differ from before the pause (lock again after a resume).
 * Their host bytes count in gmb_cache_stats.host and $GMB_HOST_QUOTA, their
 * device bytes in gmb_cache_stats.paused.  The broker's asks and gmbctl
 * pause pause them with the cache part, as gmb_pause does.  When the
 * allocations cannot pause, the cache part resumes again only if this
 * call paused it: one paused before (by an operator, the broker or the
 * application) stays paused.
 *
 * gmb_resume maps new pages from the broker at the same addresses and
 * copies the offloaded bytes back (discarded ones read as whatever the
 * new pages hold).  0, also for a tag not paused; GMB_E_NOENT for a tag
 * never set; GMB_E_QUOTA or GMB_E_NOMEM (explained) when the broker has
 * no room now: the tag stays paused with its bytes kept, and a later
 * call may succeed.  The tag's gmb_alloc allocations resume first, then
 * its cache part, each all or nothing: a refusal of the cache part leaves
 * the allocations running, and a later call finishes.  Pauses and
 * resumes of a process run one at a time.
 */
#define GMB_PAUSE_OFFLOAD 0
#define GMB_PAUSE_DISCARD 1
GMB_EXPORT int gmb_cache_tag(gmb_client *c, const char *tag);
GMB_EXPORT int gmb_pause(gmb_client *c, const char *tag, int mode);
GMB_EXPORT int gmb_resume(gmb_client *c, const char *tag);

/*
 * Sleep across processes: opts this session in to being asked to pause
 * when another job's request finds the device full (docs/sleep.md), as
 * $GMB_SLEEP_POLICY does at connect.  `policy`: comma-separated items,
 * "idle=SECONDS" (how long the process must have allocated and freed
 * nothing through gmb_malloc_async, gmb_alloc or gmb_free, and locked or
 * copied no tagged gmb_alloc allocation, before it is offered; default 0)
 * and tags, "NAME", "NAME:offload" or "NAME:discard" (none named: every
 * tag, offloaded).  NULL, "" or "off": opted out.  The broker asks only
 * sessions of tenants whose priority is not above the requester's, lowest
 * priority first, then the longest idle, then the largest offer, and never
 * below a tenant's reservation; the library's thread pauses the tags,
 * cache part and gmb_alloc allocations (largest first; a tag with a locked
 * allocation is neither offered nor paused) and answers.  A tag paused so
 * resumes at the process's next gmb_resume, or by itself at the next
 * gmb_malloc_async or gmb_alloc with that tag current or gmb_lock,
 * gmb_read or gmb_write of one of its allocations, waiting for room up to
 * $GMB_RESUME_WAIT_MS (default 10000); past that the call fails with the
 * broker's refusal and the tag stays paused.  A tag an operator paused (gmbctl pause) resumes with
 * gmbctl resume or gmb_resume; allocating in it fails with GMB_E_INVAL
 * meanwhile.  0, or GMB_E_INVAL for a policy that does not parse (the
 * previous one stays).
 */
GMB_EXPORT int gmb_sleep_policy_set(gmb_client *c, const char *policy);

/* Copies n bytes from host memory `src` into the allocation at byte `off`
 * (gmb_write), or from it into `dst` (gmb_read), holding it locked for the
 * copy: memcpy on the host device, cuMemcpyHtoD/DtoH on a GPU, whose memory
 * the CPU cannot touch through the pointer.  Synchronous: the bytes are
 * in place for every stream, context and process when it returns (a copy
 * from pageable memory is waited for).  GMB_E_INVAL
 * when [off, off+n) is not inside the allocation, GMB_E_DEVICE when the
 * driver refused the copy. */
GMB_EXPORT int gmb_write(gmb_client *c, gmb_id id, size_t off,
                         const void *src, size_t n);
GMB_EXPORT int gmb_read(gmb_client *c, gmb_id id, size_t off, void *dst,
                        size_t n);

/* 1 when `cuda_stream` (NULL: the legacy default stream) is being captured
 * into a CUDA graph (cuStreamIsCapturing), 0 when not; GMB_E_DEVICE on the
 * host device or when the driver cannot tell.  Synchronising during a
 * capture invalidates it, and memory freed during one may be used by the
 * graph at every replay: callers that free on behalf of others (the torch
 * allocator) ask first. */
GMB_EXPORT int gmb_stream_capturing(gmb_client *c, void *cuda_stream);

/* What the broker's device is, and which GPU of this process it is. */
GMB_EXPORT int gmb_device_get(gmb_client *c, gmb_device_info *out);

typedef struct gmb_device_stats { /* the broker's device, as its pool sees it */
  uint64_t capacity;  /* bytes the broker may hold on the device */
  uint64_t segments;  /* bytes of device segments it holds, all tenants,
                         and of clients' own VMM memory (gmb_vmm_report) */
  uint64_t used;      /* bytes of live allocations, all tenants */
  uint64_t free_in_segments; /* free bytes inside this tenant's segments
                                (segments serve one tenant each) */
} gmb_device_stats;

/* Fills *out with the figures of the broker's device.  What this session's
 * tenant could still get, quota aside, is about capacity - segments (room
 * for new segments) + free_in_segments; other tenants' reservations may
 * take some of the room.  A broker older than these fields answers 0s. */
GMB_EXPORT int gmb_device_stats_get(gmb_client *c, gmb_device_stats *out);

/*
 * Device memory this process made itself, outside gmb (the CUDA VMM API:
 * cuMemCreate), counted by the broker against the tenant's quota: `bytes`
 * is what the process holds so made now, in total, on the session's
 * device (the preload shim reports its cuMemCreate/cuMemRelease so).  More
 * than last reported is charged to the tenant and the device's room, or
 * refused with nothing changed: GMB_E_QUOTA past the quota (counting the
 * tenant's allocations and every one of its processes' reports),
 * GMB_E_NOMEM when the device has no room; less is given back at once,
 * and all of it when the session ends.  The tenant's `used` includes
 * these bytes.  0 or a GMB_E_* code; *out (may be NULL) receives the
 * tenant's figures after it.
 */
GMB_EXPORT int gmb_vmm_report(gmb_client *c, uint64_t bytes, gmb_stats *out);

/* Fills *out with the figures of this session's tenant, as the broker
 * sees them (`cached`: with this session's figure as of this call). */
GMB_EXPORT int gmb_tenant_stats(gmb_client *c, gmb_stats *out);

/* A static sentence for an error code ("the tenant's quota ..."). */
GMB_EXPORT const char *gmb_strerror(int err);

/* The code's name ("GMB_E_QUOTA"); "GMB_OK" for 0, "GMB_E_UNKNOWN" else. */
GMB_EXPORT const char *gmb_err_name(int err);

/* The calling thread's last failure on any client, explained in one line
 * (the broker's own message where it sent one).  Valid until the thread's
 * next call into the library.  `c` may be NULL (a failed gmb_connect). */
GMB_EXPORT const char *gmb_last_error(gmb_client *c);

/* "0.1.0" */
GMB_EXPORT const char *gmb_version(void);

#ifdef __cplusplus
}
#endif
#endif /* GMB_H */
