/*
 * fakecuda.c - a TEST DOUBLE of the CUDA driver (libcuda.so.1), not a
 * product.  It lets gmb's cuda device and its CUDA client path run, across
 * processes, on machines without a GPU, and it behaves like the real driver
 * where code can go wrong.  Built into build/fakecuda/libcuda.so.1
 * (mk/cuda.mk) and loaded through $GMB_LIBCUDA, or found by a program
 * linked with -lcuda.  Every entry point it implements is exported under
 * the names a real libcuda.so.1 exports it by (the versioned ones cuda.h
 * calls, cuMemAlloc_v2, cuCtxDestroy_v2, ..., and the legacy base names,
 * whose pre-3.2 ABI answers CUDA_ERROR_NOT_SUPPORTED); the _ptsz/_ptds
 * variants are not.  Its own types are those of the CUDA 12.0 ABI;
 * cuGetProcAddress also hands out the later ABIs (below).
 *
 * What it models, and how:
 *
 * - Physical memory is a memfd.  cuMemCreate makes one of a header page
 *   (magic, allocation id, size, device, handle types) plus the size,
 *   sealed against growing and shrinking; the generic allocation handle is
 *   a number of this process that names it.  cuMemExportToShareableHandle
 *   (CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, requested at create) gives a
 *   dup of the memfd, which the caller owns; cuMemImportFromShareableHandle
 *   (the fd passed as (void *)(uintptr_t)fd, kept by the caller) reads the
 *   header and gives a new handle.  An fd that is not such a memfd is
 *   CUDA_ERROR_INVALID_VALUE.
 *
 * - Device addresses are NOT CPU addresses.  cuMemAddressReserve reserves a
 *   range of this process's address space with PROT_NONE (so a CPU load or
 *   store at a device address faults, as it would on a GPU); cuMemMap
 *   records that [ptr, ptr+size) shows an allocation and maps the memfd's
 *   data privately elsewhere in the fake (a "view"); cuMemSetAccess grants
 *   access.  Data moves only through cuMemcpy* (HtoD, DtoH, DtoD, DtoDAsync),
 *   which translate device addresses through the table of mappings to the
 *   views.  A copy must lie in mapped memory with access all along (read
 *   for a source, read/write for a destination): one mapping, or mappings
 *   side by side in the address space (the driver copies across them, as
 *   PyTorch's expandable segments rely on), never across a hole; and a
 *   device-to-device copy's ranges must not overlap in memory (the driver
 *   does not promise memmove): CUDA_ERROR_INVALID_VALUE otherwise.
 *   cuMemAlloc/cuMemFree are scratch memory made the same way (not
 *   exportable).  Tests may count a process's mappings of an allocation:
 *   each view shows in
 *   /proc/<pid>/maps as "/memfd:fakecuda-<id>", the name the allocation's
 *   descriptors link to in /proc/<pid>/fd.
 *
 * - Pinned host memory (cuMemHostAlloc, cuMemAllocHost, cuMemFreeHost) is
 *   CPU memory, touched whole at allocation as pinning does, bounded per
 *   process by $FAKECUDA_PINNED_LIMIT (default none): past it
 *   CUDA_ERROR_OUT_OF_MEMORY, as a real host refuses to lock more.
 *
 * - Release is reference counted, as in the real driver: an allocation
 *   lives in a process while a handle to it is unreleased or a mapping of it
 *   exists; cuMemRelease of a mapped allocation is fine, the mapping keeps
 *   the memory.  Across processes the memfd lives while any process maps it
 *   or holds a descriptor of it (the kernel does that).
 *
 * - cuMemGetInfo is device-wide: what every process using the fake device
 *   holds.  Each device is a small accounting file, $FAKECUDA_DIR/device<N>
 *   (default directory /tmp/fakecuda-<uid>, made 0700), mapped shared by
 *   every process: a table of allocations (id, size, the processes holding
 *   it).  A process holds an allocation while it has a handle or mapping of
 *   it.  Processes are told apart by slots in that file, each held with a
 *   POSIX record lock for the life of the process: the kernel drops the
 *   lock when the process dies, so a killed process's memory comes back
 *   without anyone's help, in any PID namespace that shares the directory.
 *   The table is changed under a record lock on its first byte.  One known
 *   gap: memory only a descriptor refers to (an fd in flight on a socket)
 *   is not counted until a process imports it again.  $FAKECUDA_TOTAL
 *   (default 1GiB, suffixes k/m/g) is each device's size; cuMemCreate
 *   beyond it is CUDA_ERROR_OUT_OF_MEMORY.  Tests point $FAKECUDA_DIR at a
 *   directory of their own, so that suites do not share a device.
 *
 * - The current context is per thread (cuCtxSetCurrent/cuCtxGetCurrent are
 *   thread-local).  Every call that needs a context (memory, copies,
 *   streams) fails with CUDA_ERROR_INVALID_CONTEXT on a thread with none
 *   current; that includes the VMM calls, which may be stricter than the
 *   real driver, never laxer.  cuCtxCreate/cuCtxDestroy make contexts other
 *   than the primary one (tests stand for an application's own context).
 *
 * - cuInit records the pid.  In a child forked after the parent called
 *   cuInit, every call (cuInit included) fails with
 *   CUDA_ERROR_NOT_INITIALIZED: the real driver cannot be used across
 *   fork(), so code must fork before touching CUDA, or exec.
 *
 * - Each stream has its own queue and worker thread: work on one stream
 *   runs in order, streams are independent, cuStreamSynchronize waits for
 *   its stream only.  The NULL (legacy) stream is one more such queue; the
 *   synchronous copies wait for it first.  Not modelled: the legacy
 *   stream's implicit synchronisation with other blocking streams.
 *
 * - cuMemcpyHtoD from pageable memory (anything but cuMemHostAlloc's)
 *   returns before the bytes land, as the driver's does once they are in
 *   its staging buffer: they are staged and the copy queued on the
 *   current context's legacy stream, which later synchronous copies and
 *   a synchronize of that stream (or of the context) wait for, and
 *   nothing else: another context, another process or a non-blocking
 *   stream may read the old bytes meanwhile.  $FAKECUDA_HTOD_DELAY_MS
 *   (default 0) holds each such copy back that long, so that a test can
 *   show the race.  From pinned memory the copy is done when it returns.
 *   cuMemsetD8 of device memory is queued the same way (and held back
 *   alike): done once the legacy stream or the context is synchronised.
 *   cuStreamDestroy waits for its stream's work.  An async copy keeps the
 *   view it copies from and to, so an unmap that races it is harmless here.
 *
 * - Misuse the real driver answers with an error or undefined behaviour is
 *   caught loudly: cuMemRelease of an unknown or released handle, cuMemMap
 *   at a misaligned address or size, over a mapped range or outside a
 *   reservation, cuMemUnmap or cuMemSetAccess of a range that is not whole
 *   mappings, cuMemAddressFree of a range still mapped or not reserved, a
 *   copy outside mapped, accessible memory.  Each returns
 *   CUDA_ERROR_INVALID_VALUE and writes "FAKECUDA: misuse: ..." to
 *   $FAKECUDA_LOG (appended) when set, else to stderr.
 *
 * - Device attributes: CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
 *   and CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED are
 *   1, or 0 with $FAKECUDA_NO_VMM=1 / $FAKECUDA_NO_POSIX_FD=1 (cuMemCreate
 *   then answers CUDA_ERROR_NOT_SUPPORTED); other attributes are
 *   CUDA_ERROR_INVALID_VALUE.  The allocation granularity is 2 MiB, or
 *   $FAKECUDA_GRANULARITY (a multiple of the page size).
 *   $FAKECUDA_DEVICES (default 1, at most 8) is the device count; 0 makes
 *   cuInit fail with CUDA_ERROR_NO_DEVICE.  $FAKECUDA_MISSING names one
 *   entry point cuGetProcAddress pretends not to have.
 *
 * - cuGetProcAddress / _v2 answer by base name and version as the real
 *   driver does: each entry point has the version its 12.0 ABI appeared
 *   in (cuMemAlloc's _v2 ABI 3.2, as cuMemFree's, cuMemGetInfo's and
 *   cuDeviceTotalMem's, the VMM calls 10.2, cuGetProcAddress
 *   11.3, its _v2 12.0, the capture calls 10.0/10.1, the peer calls 4.0,
 *   the others 12.0 here); a request below it is
 *   CUDA_ERROR_NOT_FOUND with CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT,
 *   except cuMemAlloc / cuMemFree / cuMemGetInfo / cuDeviceTotalMem, which
 *   below 3.2 give a
 *   legacy entry point of their own (32-bit sizes in the real driver;
 *   here it answers CUDA_ERROR_NOT_SUPPORTED): a caller can tell it from
 *   the 12.0 one.  Asked for a version at or past a later ABI, it gives
 *   that ABI, as the real driver does: cuCtxGetDevice_v2 and
 *   cuCtxSynchronize_v2 (a context argument) from 13000, cuCtxCreate_v3
 *   from 11040 and _v4 from 12050, cuStreamBeginCapture_v2 (a mode) from
 *   10010.  "cuGetProcAddress" itself is found (v1 below 12.0, the
 *   _v2 from 12.0), as cudart asks for it.  cuIpcGetMemHandle exports
 *   only cuMemAlloc's memory (its base), as the real one; nothing opens
 *   the handle.  $FAKECUDA_DRIVER_VERSION is what cuDriverGetVersion
 *   claims (12000 by default: a real CUDA runtime refuses a driver older
 *   than itself); $FAKECUDA_TRACE_GPA=1 writes each symbol cuGetProcAddress
 *   does not have to stderr (what a real runtime asks for).
 *
 * - Device identity, as containers see it.  Each physical device p has its
 *   own UUID (cuDeviceGetUuid: "FAKECUDA" then p in the last bytes, shown
 *   as GPU-46414b45-4355-4441-0000-00000000000p) and PCI bus id
 *   (cuDeviceGetPCIBusId: 0000:1p:00.0).  $FAKECUDA_VISIBLE, a comma list
 *   of physical devices ("1,0"), renumbers them as CUDA_VISIBLE_DEVICES
 *   does: ordinal i is physical device VISIBLE[i], and the others are not
 *   seen at all (the count is the list's length).  A CUdevice is the
 *   physical index; contexts, accounting files and memory are per
 *   physical device, so two processes with different lists share the same
 *   device memory.  Memory of a device this process cannot see does not
 *   import (CUDA_ERROR_INVALID_DEVICE).  $FAKECUDA_COMPUTE_MODE (0 default,
 *   2 prohibited, 3 exclusive process) is every device's
 *   CU_DEVICE_ATTRIBUTE_COMPUTE_MODE (only reported, not enforced).
 *   New memory holds 0xa5 bytes, as a real GPU's may hold a previous
 *   user's data; $FAKECUDA_GARBAGE=0 leaves it zeros (a memfd).
 *
 * - Access is per device.  cuMemSetAccess sets the access of each device
 *   it names, leaving the others as they were; a copy through a mapping
 *   needs access for the device of the current context.  cuMemAlloc's
 *   memory is reachable by copies from every device (unified addressing).
 *   cuDeviceCanAccessPeer answers 1 for two different visible devices
 *   (0 with $FAKECUDA_NO_PEER=1); cuCtxEnablePeerAccess/Disable keep the
 *   driver's state and errors, and grant nothing to memory of the virtual
 *   memory API, as on a GPU.
 *
 * - Streams belong to a context: a created stream to the context current
 *   where it was made, and each context has its own legacy (NULL) stream
 *   (the handles NULL, 0x1 and 0x2 name the current context's).
 *   cuCtxSynchronize waits for the current context's streams only, as the
 *   real one does: work queued in another context of the process (an
 *   application's own cuCtxCreate context) goes on.  Synchronous copies
 *   wait for the current context's legacy stream.
 *
 * - A context costs device memory: $FAKECUDA_CTX_COST (suffixes k/m/g,
 *   default 0: no cost) is counted on the device as held by the process
 *   from a device's first cuDevicePrimaryCtxRetain, and from cuCtxCreate
 *   to cuCtxDestroy; cuMemGetInfo shows it, and it comes back when the
 *   process dies.  A real context costs hundreds of MiB (tests/gpu/run.sh
 *   measures it); a context that does not fit is CUDA_ERROR_OUT_OF_MEMORY.
 *
 * - $FAKECUDA_FAIL_SET_CURRENT=N: the N-th cuCtxSetCurrent, counted from
 *   the first call that sees the variable set (and again from zero once it
 *   is unset), fails with CUDA_ERROR_INVALID_CONTEXT, as the real one does
 *   when the context went away or the device fell off the bus under it.
 *
 * - cuCtxSynchronize: while $FAKECUDA_CAPTURING is set it fails with
 *   CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, as the real one does during a
 *   capture.  cuStreamIsCapturing answers ACTIVE for the streams named in
 *   $FAKECUDA_CAPTURING ("all", or "null" for the legacy stream): tests
 *   stand for a graph capture with it, without the rules below.
 *
 * - Stream capture (cuStreamBeginCapture_v2 .. cuStreamEndCapture), with
 *   the driver's rules.  A potentially unsafe call (every memory-management
 *   call, the VMM ones included: maybe stricter than the driver; waits;
 *   synchronous copies; event queries) is refused with
 *   CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, and the captures it conflicts
 *   with invalidated, when the calling thread's mode
 *   (cuThreadExchangeStreamCaptureMode) is global and it has a capture
 *   that is not relaxed or another thread has a global one, or when its
 *   mode is thread-local and it has one that is not relaxed; never in the
 *   relaxed mode.  In every mode: a wait for a capturing stream, a query
 *   of an event recorded in a capture, and cuCtxSynchronize are refused;
 *   the legacy stream, while a blocking stream captures, answers
 *   CUDA_ERROR_STREAM_CAPTURE_IMPLICIT (cuStreamIsCapturing; and work or a
 *   synchronous copy on it, which also invalidates).  Each invalidation is
 *   written to the misuse log.  Copies, host functions and event records
 *   on a capturing stream are taken into the capture; cuStreamEndCapture
 *   gives a graph of them (CUDA_ERROR_STREAM_CAPTURE_INVALIDATED when the
 *   capture was broken), cuGraphInstantiateWithFlags and cuGraphLaunch
 *   replay them (copies checked again at each launch).
 *
 * - CU_STREAM_PER_THREAD is each thread's own default stream (made at its
 *   first use), distinct from the legacy stream and from other threads'.
 *
 * - Events: cuEventRecord queues a mark on its stream (the NULL stream or
 *   a live created one; CUDA_ERROR_INVALID_HANDLE for a destroyed one, or
 *   for a stream of another context than the event's, the legacy stream
 *   counting as the current context's);
 *   cuEventQuery answers CUDA_ERROR_NOT_READY until the stream ran past
 *   the event's last record.  An event destroyed with records pending is
 *   freed when they ran.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))

/* The CUDA 12.0 types this double implements (cuda.h spells them the same
 * way; proto/cudrv.h's mirror of them is checked against cuda.h). */
typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef void (*CUhostFn)(void *);
typedef struct {
  int type;
  int id;
} CUmemLocation;
typedef struct {
  int type;
  int requestedHandleTypes;
  CUmemLocation location;
  void *win32HandleMetaData;
  struct {
    unsigned char compressionType;
    unsigned char gpuDirectRDMACapable;
    unsigned short usage;
    unsigned char reserved[4];
  } allocFlags;
} CUmemAllocationProp;
typedef struct {
  CUmemLocation location;
  int flags;
} CUmemAccessDesc;

enum {
  CUDA_SUCCESS = 0,
  CUDA_ERROR_INVALID_VALUE = 1,
  CUDA_ERROR_OUT_OF_MEMORY = 2,
  CUDA_ERROR_NOT_INITIALIZED = 3,
  CUDA_ERROR_NO_DEVICE = 100,
  CUDA_ERROR_INVALID_DEVICE = 101,
  CUDA_ERROR_PEER_ACCESS_UNSUPPORTED = 217,
  CUDA_ERROR_INVALID_CONTEXT = 201,
  CUDA_ERROR_OPERATING_SYSTEM = 304,
  CUDA_ERROR_INVALID_HANDLE = 400,
  CUDA_ERROR_ILLEGAL_STATE = 401,
  CUDA_ERROR_NOT_FOUND = 500,
  CUDA_ERROR_NOT_READY = 600,
  CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED = 704,
  CUDA_ERROR_PEER_ACCESS_NOT_ENABLED = 705,
  CUDA_ERROR_NOT_SUPPORTED = 801,
  CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900,
  CUDA_ERROR_STREAM_CAPTURE_INVALIDATED = 901,
  CUDA_ERROR_STREAM_CAPTURE_IMPLICIT = 906,
  CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD = 908,
};

enum {
  FAKE_ALLOC_PINNED = 1,       /* CU_MEM_ALLOCATION_TYPE_PINNED */
  FAKE_HANDLE_POSIX_FD = 1,    /* CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR */
  FAKE_LOCATION_DEVICE = 1,    /* CU_MEM_LOCATION_TYPE_DEVICE */
  FAKE_ACCESS_READ = 1,        /* CU_MEM_ACCESS_FLAGS_PROT_READ */
  FAKE_ACCESS_READWRITE = 3,   /* CU_MEM_ACCESS_FLAGS_PROT_READWRITE */
  FAKE_ATTR_COMPUTE_MODE = 20, /* CU_DEVICE_ATTRIBUTE_COMPUTE_MODE */
  FAKE_ATTR_VMM = 102,         /* ..._VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED */
  FAKE_ATTR_POSIX_FD = 103,    /* ..._HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_... */
};

#define FAKE_MAX_DEV 8
#define FAKE_MAX_CTX 64
#define FAKE_HDR 4096u                      /* memfd header page */
#define FAKE_MAGIC 0x4b41464544554341ULL    /* "ACUDEFAK" */
#define FAKE_DEFAULT_GRANULARITY (UINT64_C(2) << 20)

/* --- environment and reports ------------------------------------------ */

static uint64_t fake_env_size(const char *name, uint64_t dflt) {
  const char *v = getenv(name);
  if (!v || !*v) return dflt;
  char *end;
  unsigned long long n = strtoull(v, &end, 10);
  switch (*end) {
    case 'k': case 'K': n <<= 10; break;
    case 'm': case 'M': n <<= 20; break;
    case 'g': case 'G': n <<= 30; break;
    default: break;
  }
  return n;
}

static int fake_env_flag(const char *name) {
  const char *v = getenv(name);
  return v && *v && strcmp(v, "0") != 0;
}

/* 1 unless $FAKECUDA_GARBAGE is "0": new memory is not zeros. */
static int fake_garbage(void) {
  const char *v = getenv("FAKECUDA_GARBAGE");
  return !(v && strcmp(v, "0") == 0);
}

static uint64_t fake_total(void) {
  return fake_env_size("FAKECUDA_TOTAL", UINT64_C(1) << 30);
}

static uint64_t fake_granularity(void) {
  uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE);
  uint64_t g = fake_env_size("FAKECUDA_GRANULARITY", FAKE_DEFAULT_GRANULARITY);
  if (g < page) g = page;
  return g - g % page;
}

/* Physical devices: $FAKECUDA_DEVICES. */
static int fake_phys_devices(void) {
  uint64_t n = fake_env_size("FAKECUDA_DEVICES", 1);
  return n > FAKE_MAX_DEV ? FAKE_MAX_DEV : (int)n;
}

/* The physical devices this process sees, in ordinal order: map[i] for
 * ordinal i.  Returns the count.  $FAKECUDA_VISIBLE stops at the first
 * entry that names no physical device, as CUDA_VISIBLE_DEVICES does. */
static int fake_visible(int map[FAKE_MAX_DEV]) {
  int phys = fake_phys_devices();
  const char *v = getenv("FAKECUDA_VISIBLE");
  if (!v) {
    for (int i = 0; i < phys; i++) map[i] = i;
    return phys;
  }
  int n = 0;
  while (*v && n < FAKE_MAX_DEV) {
    char *end;
    long p = strtol(v, &end, 10);
    if (end == v || p < 0 || p >= phys) break;
    for (int i = 0; i < n; i++)
      if (map[i] == p) return n; /* a repeat ends the list */
    map[n++] = (int)p;
    v = *end == ',' ? end + 1 : end;
    if (*end != ',') break;
  }
  return n;
}

/* Devices this process sees (the count cuDeviceGetCount gives). */
static int fake_devices(void) {
  int map[FAKE_MAX_DEV];
  return fake_visible(map);
}

/* The physical device of ordinal `o`, or -1. */
static int fake_ordinal_phys(int o) {
  int map[FAKE_MAX_DEV];
  int n = fake_visible(map);
  return o >= 0 && o < n ? map[o] : -1;
}

/* 1 when physical device `p` is visible here. */
static int fake_phys_visible(int p) {
  int map[FAKE_MAX_DEV];
  int n = fake_visible(map);
  for (int i = 0; i < n; i++)
    if (map[i] == p) return 1;
  return 0;
}

static void fake_misuse(const char *fmt, ...)
    __attribute__((format(printf, 1, 2)));
static void fake_misuse(const char *fmt, ...) {
  char line[320];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(line, sizeof line, fmt, ap);
  va_end(ap);
  const char *log = getenv("FAKECUDA_LOG");
  FILE *f = log && *log ? fopen(log, "a") : NULL;
  fprintf(f ? f : stderr, "FAKECUDA: misuse: %s (pid %ld)\n", line,
          (long)getpid());
  if (f) fclose(f);
}

/* --- initialisation, fork and contexts -------------------------------- */

/* Everything below is guarded by fake_mu, except the streams (their own
 * locks), the views' reference counts (atomic) and fake_cur (per thread). */
static pthread_mutex_t fake_mu = PTHREAD_MUTEX_INITIALIZER;
static pid_t fake_pid; /* cuInit's process; 0 before cuInit */

struct fake_ctx {
  int live;
  int dev;
  unsigned peers; /* devices whose contexts it enabled peer access to */
  uint64_t mem; /* the accounting id of what it costs; 0: nothing */
};
/* [0, FAKE_MAX_DEV): the primary contexts; the rest cuCtxCreate's. */
static struct fake_ctx fake_ctxs[FAKE_MAX_CTX];
static __thread struct fake_ctx *fake_cur;

/* CUDA_SUCCESS when this process called cuInit and is not a child forked
 * since: the real driver refuses a forked child everything. */
static CUresult fake_ready(void) {
  pid_t p = __atomic_load_n(&fake_pid, __ATOMIC_ACQUIRE);
  if (p == 0 || p != getpid()) return CUDA_ERROR_NOT_INITIALIZED;
  return CUDA_SUCCESS;
}

/* fake_ready, and a context current on this thread (*dev: its device). */
static CUresult fake_need_ctx(int *dev) {
  CUresult r = fake_ready();
  if (r) return r;
  struct fake_ctx *c = fake_cur;
  if (c == NULL || !__atomic_load_n(&c->live, __ATOMIC_ACQUIRE))
    return CUDA_ERROR_INVALID_CONTEXT;
  if (dev) *dev = c->dev;
  return CUDA_SUCCESS;
}

static int fake_ctx_valid(const struct fake_ctx *c) {
  return c >= fake_ctxs && c < fake_ctxs + FAKE_MAX_CTX &&
         __atomic_load_n(&c->live, __ATOMIC_ACQUIRE);
}

/* --- the device-wide accounting file ---------------------------------- */

#define ACCT_MAGIC 0x31544341454b4146ULL /* "FAKEACT1" */
#define ACCT_PROCS 1024
#define ACCT_RECS 4096
#define ACCT_HOLDERS 32
#define ACCT_MUTEX_BYTE 0
#define ACCT_SLOT_BYTE 4096 /* + slot: locked by the process in that slot */
#define ACCT_MAX_FILES 8

struct acct_rec {
  uint64_t id;   /* 0: free */
  uint64_t size;
  uint64_t holders[ACCT_HOLDERS]; /* (slot + 1) << 32 | generation; 0 free */
};

struct acct_file {
  uint64_t magic;
  uint64_t next_id;
  uint32_t gen[ACCT_PROCS]; /* bumped each time a process takes the slot */
  struct acct_rec rec[ACCT_RECS];
};

struct fake_acct {
  char path[256];
  int fd;              /* never closed: that would drop our record locks */
  struct acct_file *f;
  int slot;
  uint32_t gen;
};

static struct fake_acct fake_accts[ACCT_MAX_FILES];
static int fake_naccts;

static int acct_lock_byte(int fd, int cmd, short type, off_t at) {
  struct flock l = {.l_type = type, .l_whence = SEEK_SET, .l_start = at,
                    .l_len = 1};
  int rc;
  do rc = fcntl(fd, cmd, &l);
  while (rc != 0 && errno == EINTR && cmd == F_SETLKW);
  return rc;
}

static void acct_lock(struct fake_acct *a) {
  acct_lock_byte(a->fd, F_SETLKW, F_WRLCK, ACCT_MUTEX_BYTE);
}
static void acct_unlock(struct fake_acct *a) {
  acct_lock_byte(a->fd, F_SETLK, F_UNLCK, ACCT_MUTEX_BYTE);
}

/* The accounting file of device `dev`, opened (and a process slot taken in
 * it) on first use.  NULL, said on stderr, when it cannot be. */
static struct fake_acct *acct_get(int dev) {
  char path[256];
  const char *dir = getenv("FAKECUDA_DIR");
  char dflt[64];
  if (!dir || !*dir) {
    snprintf(dflt, sizeof dflt, "/tmp/fakecuda-%ld", (long)getuid());
    dir = dflt;
  }
  snprintf(path, sizeof path, "%s/device%d", dir, dev);
  for (int i = 0; i < fake_naccts; i++)
    if (strcmp(fake_accts[i].path, path) == 0) return &fake_accts[i];
  if (fake_naccts == ACCT_MAX_FILES) {
    fprintf(stderr, "FAKECUDA: too many accounting files\n");
    return NULL;
  }
  if (mkdir(dir, 0700) != 0 && errno != EEXIST) {
    fprintf(stderr, "FAKECUDA: mkdir %s: %s\n", dir, strerror(errno));
    return NULL;
  }
  int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) {
    fprintf(stderr, "FAKECUDA: open %s: %s\n", path, strerror(errno));
    return NULL;
  }
  struct fake_acct *a = &fake_accts[fake_naccts];
  snprintf(a->path, sizeof a->path, "%s", path);
  a->fd = fd;
  acct_lock(a);
  struct stat st;
  if (fstat(fd, &st) != 0 ||
      ((size_t)st.st_size < sizeof(struct acct_file) &&
       ftruncate(fd, (off_t)sizeof(struct acct_file)) != 0)) {
    fprintf(stderr, "FAKECUDA: size %s: %s\n", path, strerror(errno));
    acct_unlock(a);
    close(fd); /* nothing of ours is locked in it yet */
    return NULL;
  }
  void *m = mmap(NULL, sizeof(struct acct_file), PROT_READ | PROT_WRITE,
                 MAP_SHARED, fd, 0);
  if (m == MAP_FAILED) {
    fprintf(stderr, "FAKECUDA: mmap %s: %s\n", path, strerror(errno));
    acct_unlock(a);
    close(fd);
    return NULL;
  }
  a->f = m;
  if (a->f->magic != ACCT_MAGIC) {
    memset(a->f, 0, sizeof *a->f);
    a->f->magic = ACCT_MAGIC;
  }
  a->slot = -1;
  for (int i = 0; i < ACCT_PROCS && a->slot < 0; i++)
    if (acct_lock_byte(fd, F_SETLK, F_WRLCK, ACCT_SLOT_BYTE + i) == 0) {
      a->slot = i;
      a->gen = ++a->f->gen[i];
      if (a->gen == 0) a->gen = ++a->f->gen[i];
    }
  acct_unlock(a);
  if (a->slot < 0) {
    fprintf(stderr, "FAKECUDA: %s: more than %d processes\n", path,
            ACCT_PROCS);
    munmap(m, sizeof(struct acct_file));
    close(fd);
    return NULL;
  }
  fake_naccts++;
  return a;
}

static uint64_t acct_me(const struct fake_acct *a) {
  return (uint64_t)(a->slot + 1) << 32 | a->gen;
}

/* 1 when the process `holder` names is alive.  `seen` caches the answer
 * per slot for one pass (0 unknown, 1 alive, 2 dead).  Under acct_lock. */
static int acct_alive(struct fake_acct *a, uint64_t holder, uint8_t *seen) {
  uint32_t slot = (uint32_t)(holder >> 32) - 1;
  uint32_t gen = (uint32_t)holder;
  if (slot >= ACCT_PROCS || a->f->gen[slot] != gen) return 0;
  if ((int)slot == a->slot) return 1;
  if (seen[slot] == 0) {
    struct flock l = {.l_type = F_WRLCK, .l_whence = SEEK_SET,
                      .l_start = ACCT_SLOT_BYTE + slot, .l_len = 1};
    int locked = fcntl(a->fd, F_GETLK, &l) == 0 && l.l_type != F_UNLCK;
    seen[slot] = locked ? 1 : 2;
  }
  return seen[slot] == 1;
}

/* Drops dead holders and records nobody holds; returns the bytes held on
 * the device.  Under acct_lock. */
static uint64_t acct_prune(struct fake_acct *a) {
  static uint8_t seen[ACCT_PROCS]; /* under fake_mu */
  memset(seen, 0, sizeof seen);
  uint64_t used = 0;
  for (int i = 0; i < ACCT_RECS; i++) {
    struct acct_rec *r = &a->f->rec[i];
    if (r->id == 0) continue;
    int n = 0;
    for (int h = 0; h < ACCT_HOLDERS; h++) {
      if (r->holders[h] && !acct_alive(a, r->holders[h], seen))
        r->holders[h] = 0;
      n += r->holders[h] != 0;
    }
    if (n == 0)
      memset(r, 0, sizeof *r);
    else
      used += r->size;
  }
  return used;
}

static struct acct_rec *acct_find(struct fake_acct *a, uint64_t id) {
  for (int i = 0; i < ACCT_RECS; i++)
    if (a->f->rec[i].id == id) return &a->f->rec[i];
  return NULL;
}

/* Adds this process as a holder of allocation `id` (recording the
 * allocation when nobody holds it any more).  0 or -1 (table full). */
static int acct_hold(struct fake_acct *a, uint64_t id, uint64_t size) {
  struct acct_rec *r = acct_find(a, id);
  if (!r) {
    r = acct_find(a, 0);
    if (!r) return -1;
    r->id = id;
    r->size = size;
  }
  uint64_t me = acct_me(a);
  for (int h = 0; h < ACCT_HOLDERS; h++)
    if (r->holders[h] == me) return 0;
  for (int h = 0; h < ACCT_HOLDERS; h++)
    if (r->holders[h] == 0) {
      r->holders[h] = me;
      return 0;
    }
  return -1;
}

static void acct_drop(struct fake_acct *a, uint64_t id) {
  acct_lock(a);
  struct acct_rec *r = acct_find(a, id);
  if (r) {
    uint64_t me = acct_me(a);
    int n = 0;
    for (int h = 0; h < ACCT_HOLDERS; h++) {
      if (r->holders[h] == me) r->holders[h] = 0;
      n += r->holders[h] != 0;
    }
    if (n == 0) memset(r, 0, sizeof *r);
  }
  acct_unlock(a);
}

/* --- allocations, handles, reservations, mappings --------------------- */

struct fake_hdr { /* the first bytes of each memfd */
  uint64_t magic;
  uint64_t id;
  uint64_t size;
  int32_t dev;
  int32_t handle_types;
};

struct fake_alloc { /* physical memory this process holds */
  struct fake_alloc *next;
  struct fake_acct *acct;
  uint64_t id, size;
  int dev, handle_types;
  int fd;        /* the memfd (private to the fake) */
  unsigned refs; /* unreleased handles + mappings */
};

struct fake_handle {
  struct fake_handle *next;
  CUmemGenericAllocationHandle value;
  struct fake_alloc *a;
};

struct fake_res {
  struct fake_res *next;
  uintptr_t base;
  size_t size;
};

struct fake_view { /* the fake's own CPU mapping of a mapped allocation */
  char *cpu;
  size_t len;
  atomic_uint refs; /* the mapping + queued async copies */
};

struct fake_map {
  struct fake_map *next;
  uintptr_t base;
  size_t size;
  struct fake_alloc *a;
  struct fake_view *view;
  /* CUmemAccess_flags granted to each physical device; 0 until
   * cuMemSetAccess names that device (access for one device does not
   * grant another). */
  int access[FAKE_MAX_DEV];
};

struct fake_scratch { /* cuMemAlloc */
  struct fake_scratch *next;
  uintptr_t ptr;
  size_t size;
};

static struct fake_alloc *fake_allocs;
static struct fake_handle *fake_handles;
static struct fake_res *fake_reservations;
static struct fake_map *fake_maps;
static struct fake_scratch *fake_scratches;
static CUmemGenericAllocationHandle fake_next_handle = 0x1000;

static void view_unref(struct fake_view *v) {
  if (atomic_fetch_sub_explicit(&v->refs, 1, memory_order_acq_rel) == 1) {
    munmap(v->cpu, v->len);
    free(v);
  }
}

static void alloc_unref(struct fake_alloc *a) {
  if (--a->refs > 0) return;
  for (struct fake_alloc **p = &fake_allocs; *p; p = &(*p)->next)
    if (*p == a) {
      *p = a->next;
      break;
    }
  close(a->fd);
  acct_drop(a->acct, a->id);
  free(a);
}

static struct fake_handle *handle_find(CUmemGenericAllocationHandle v) {
  for (struct fake_handle *h = fake_handles; h; h = h->next)
    if (h->value == v) return h;
  return NULL;
}

static CUresult handle_new(struct fake_alloc *a,
                           CUmemGenericAllocationHandle *out) {
  struct fake_handle *h = calloc(1, sizeof *h);
  if (!h) return CUDA_ERROR_OUT_OF_MEMORY;
  h->value = fake_next_handle++;
  h->a = a;
  a->refs++;
  h->next = fake_handles;
  fake_handles = h;
  *out = h->value;
  return CUDA_SUCCESS;
}

/* A new allocation of `size` bytes on `dev`, counted on the device. */
static CUresult alloc_create(int dev, uint64_t size, int types,
                             struct fake_alloc **out) {
  struct fake_acct *acct = acct_get(dev);
  if (!acct) return CUDA_ERROR_OPERATING_SYSTEM;
  struct fake_alloc *a = calloc(1, sizeof *a);
  if (!a) return CUDA_ERROR_OUT_OF_MEMORY;
  acct_lock(acct);
  uint64_t used = acct_prune(acct);
  uint64_t total = fake_total();
  if (used > total || size > total - used) {
    acct_unlock(acct);
    free(a);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  uint64_t id = ++acct->f->next_id;
  if (acct_hold(acct, id, size) != 0) {
    acct_unlock(acct);
    free(a);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  acct_unlock(acct);
  a->acct = acct;
  a->id = id;
  a->size = size;
  a->dev = dev;
  a->handle_types = types;
  char name[48];
  snprintf(name, sizeof name, "fakecuda-%llu", (unsigned long long)id);
  a->fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
  struct fake_hdr hdr = {FAKE_MAGIC, id, size, dev, types};
  if (a->fd < 0 || ftruncate(a->fd, (off_t)(FAKE_HDR + size)) != 0 ||
      pwrite(a->fd, &hdr, sizeof hdr, 0) != (ssize_t)sizeof hdr ||
      fcntl(a->fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) !=
          0) {
    if (a->fd >= 0) close(a->fd);
    acct_drop(acct, id);
    free(a);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  /* New memory holds garbage, as a real GPU's may hold what its last
   * user left (a memfd is zeros); $FAKECUDA_GARBAGE=0 keeps the zeros. */
  if (fake_garbage()) {
    char junk[65536];
    memset(junk, 0xa5, sizeof junk);
    for (uint64_t off = 0; off < size; off += sizeof junk) {
      size_t k = size - off < sizeof junk ? (size_t)(size - off) : sizeof junk;
      if (pwrite(a->fd, junk, k, (off_t)(FAKE_HDR + off)) != (ssize_t)k) break;
    }
  }
  a->next = fake_allocs;
  fake_allocs = a;
  *out = a;
  return CUDA_SUCCESS;
}

static struct fake_res *res_containing(uintptr_t p, size_t n) {
  for (struct fake_res *r = fake_reservations; r; r = r->next)
    if (p >= r->base && p - r->base <= r->size && n <= r->size - (p - r->base))
      return r;
  return NULL;
}

/* The mapping that holds all of [p, p+n); NULL when none does. */
static struct fake_map *map_containing(uintptr_t p, size_t n) {
  for (struct fake_map *m = fake_maps; m; m = m->next)
    if (p >= m->base && p - m->base < m->size && n <= m->size - (p - m->base))
      return m;
  return NULL;
}

/* 1 when [p, p+n) is exactly a run of whole mappings. */
static int maps_cover_exactly(uintptr_t p, size_t n) {
  size_t covered = 0;
  for (struct fake_map *m = fake_maps; m; m = m->next) {
    if (m->base + m->size <= p || m->base >= p + n) continue;
    if (m->base < p || m->base + m->size > p + n) return 0; /* partial */
    covered += m->size;
  }
  return covered == n && n > 0;
}

static CUresult reserve(size_t size, size_t align, uintptr_t *out) {
  size_t span = size + align;
  char *p = mmap(NULL, span, PROT_NONE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  uintptr_t base = ((uintptr_t)p + align - 1) & ~(uintptr_t)(align - 1);
  if (base > (uintptr_t)p) munmap(p, base - (uintptr_t)p);
  uintptr_t end = (uintptr_t)p + span;
  if (end > base + size) munmap((void *)(base + size), end - (base + size));
  struct fake_res *r = calloc(1, sizeof *r);
  if (!r) {
    munmap((void *)base, size);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  r->base = base;
  r->size = size;
  r->next = fake_reservations;
  fake_reservations = r;
  *out = base;
  return CUDA_SUCCESS;
}

static CUresult map_new(uintptr_t p, size_t size, struct fake_alloc *a) {
  struct fake_map *m = calloc(1, sizeof *m);
  struct fake_view *v = calloc(1, sizeof *v);
  void *cpu = MAP_FAILED;
  if (m && v)
    cpu = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, a->fd,
               FAKE_HDR);
  if (cpu == MAP_FAILED) {
    free(m);
    free(v);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  v->cpu = cpu;
  v->len = size;
  atomic_init(&v->refs, 1);
  m->base = p;
  m->size = size;
  m->a = a;
  m->view = v;
  a->refs++;
  m->next = fake_maps;
  fake_maps = m;
  return CUDA_SUCCESS;
}

static void map_remove(struct fake_map *m) {
  for (struct fake_map **p = &fake_maps; *p; p = &(*p)->next)
    if (*p == m) {
      *p = m->next;
      break;
    }
  view_unref(m->view);
  alloc_unref(m->a);
  free(m);
}

static CUresult unmap_range(uintptr_t p, size_t n) {
  if (!maps_cover_exactly(p, n)) {
    fake_misuse("cuMemUnmap(%#lx, %zu): not a run of whole mappings",
                (unsigned long)p, n);
    return CUDA_ERROR_INVALID_VALUE;
  }
  for (struct fake_map *m = fake_maps, *next; m; m = next) {
    next = m->next;
    if (m->base >= p && m->base < p + n) map_remove(m);
  }
  return CUDA_SUCCESS;
}

static CUresult address_free(uintptr_t p, size_t n) {
  struct fake_res **pp = &fake_reservations;
  for (; *pp; pp = &(*pp)->next)
    if ((*pp)->base == p) break;
  if (!*pp || (*pp)->size != n) {
    fake_misuse("cuMemAddressFree(%#lx, %zu): no such reservation",
                (unsigned long)p, n);
    return CUDA_ERROR_INVALID_VALUE;
  }
  for (struct fake_map *m = fake_maps; m; m = m->next)
    if (m->base >= p && m->base < p + n) {
      fake_misuse("cuMemAddressFree(%#lx, %zu): still mapped at %#lx",
                  (unsigned long)p, n, (unsigned long)m->base);
      return CUDA_ERROR_INVALID_VALUE;
    }
  struct fake_res *r = *pp;
  *pp = r->next;
  munmap((void *)r->base, r->size);
  free(r);
  return CUDA_SUCCESS;
}

static CUresult release(CUmemGenericAllocationHandle v) {
  for (struct fake_handle **p = &fake_handles; *p; p = &(*p)->next)
    if ((*p)->value == v) {
      struct fake_handle *h = *p;
      *p = h->next;
      alloc_unref(h->a);
      free(h);
      return CUDA_SUCCESS;
    }
  fake_misuse("cuMemRelease(%#llx): not a live handle (released twice?)", v);
  return CUDA_ERROR_INVALID_VALUE;
}

/* --- streams ------------------------------------------------------------ */

struct fake_event;
struct fake_work {
  struct fake_work *next;
  struct fake_event *ev; /* an event's record: completes it */
  uint64_t gen;
  CUhostFn fn; /* NULL: a copy (or an event's record) */
  void *user;
  char *dst;
  const char *src;
  size_t n;
  struct fake_view *vdst, *vsrc; /* held until the copy ran; may be NULL */
  /* A copy from pageable host memory (cuMemcpyHtoD): the bytes staged
   * here, freed by the worker after the copy (the last piece owns it),
   * and the DMA's delay ($FAKECUDA_HTOD_DELAY_MS). */
  char *stage;
  unsigned delay_ms;
  int fill; /* a memset of n bytes at dst to fill_v, not a copy */
  unsigned char fill_v;
  /* A node of a captured graph: a device-to-device copy (ddst, dsrc, n),
   * a host function (fn) or an event's record (ev, holding a reference). */
  CUdeviceptr ddst, dsrc;
};

struct fake_stream {
  struct fake_stream *next; /* fake_streams, under fake_mu */
  pthread_mutex_t mu;
  pthread_cond_t cv;
  struct fake_work *head, *tail;
  int busy, stop, started;
  pthread_t thread;
  unsigned flags; /* CU_STREAM_NON_BLOCKING (1) or 0 */
  /* Stream capture, under fake_mu: cap_mode (a CUstreamCaptureMode) and
   * the thread that began it; cap_invalid once an illegal call broke it;
   * the work captured so far (the graph's nodes, in order). */
  int cap, cap_mode, cap_invalid;
  pthread_t cap_thread;
  struct fake_work *cap_head, *cap_tail;
  struct fake_ctx *ctx; /* a created stream's context */
};

static struct fake_stream fake_null_stream = {
    .mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};
static struct fake_stream *fake_streams; /* created ones, under fake_mu */
/* Each context's legacy stream (fake_null_stream: a thread with none). */
static struct fake_stream fake_ctx_null[FAKE_MAX_CTX] = {
    [0 ... FAKE_MAX_CTX - 1] = {.mu = PTHREAD_MUTEX_INITIALIZER,
                                .cv = PTHREAD_COND_INITIALIZER}};

/* The legacy stream of the context current on this thread. */
static struct fake_stream *ctx_null_stream(void) {
  struct fake_ctx *c = fake_cur;
  return c ? &fake_ctx_null[c - fake_ctxs] : &fake_null_stream;
}

static int is_null_stream(const struct fake_stream *s) {
  return s == &fake_null_stream ||
         (s >= fake_ctx_null && s < fake_ctx_null + FAKE_MAX_CTX);
}

/* An event: the generation of its last record, and the highest one a
 * stream reached.  Referenced by its handle and by every queued record,
 * so destroying it with records pending is safe (as in CUDA). */
struct fake_event {
  uint32_t magic;
  _Atomic uint64_t recorded, completed;
  _Atomic int refs;
  /* Under fake_mu: the stream whose capture took its last record (NULL
   * when that record was real work). */
  struct fake_stream *captured;
  struct fake_ctx *ctx; /* the context current where it was made */
};
#define FAKE_EVENT_MAGIC 0x45564e54u

static void event_unref(struct fake_event *e) {
  if (atomic_fetch_sub(&e->refs, 1) == 1) {
    e->magic = 0;
    free(e);
  }
}

static void event_fire(struct fake_event *e, uint64_t gen) {
  uint64_t c = atomic_load(&e->completed);
  while (c < gen && !atomic_compare_exchange_weak(&e->completed, &c, gen)) {
  }
  event_unref(e);
}

static void *stream_worker(void *arg) {
  struct fake_stream *s = arg;
  pthread_mutex_lock(&s->mu);
  for (;;) {
    while (!s->head && !s->stop) pthread_cond_wait(&s->cv, &s->mu);
    if (!s->head) break; /* stopped and drained */
    struct fake_work *w = s->head;
    s->head = w->next;
    if (!s->head) s->tail = NULL;
    s->busy = 1;
    pthread_mutex_unlock(&s->mu);
    if (w->ev) {
      event_fire(w->ev, w->gen);
    } else if (w->fn) {
      w->fn(w->user);
    } else {
      if (w->delay_ms) {
        struct timespec ts = {w->delay_ms / 1000,
                              (long)(w->delay_ms % 1000) * 1000000L};
        nanosleep(&ts, NULL);
      }
      if (w->fill)
        memset(w->dst, w->fill_v, w->n);
      else
        memcpy(w->dst, w->src, w->n);
    }
    if (w->vdst) view_unref(w->vdst);
    if (w->vsrc) view_unref(w->vsrc);
    free(w->stage);
    free(w);
    pthread_mutex_lock(&s->mu);
    s->busy = 0;
    pthread_cond_broadcast(&s->cv);
  }
  pthread_mutex_unlock(&s->mu);
  return NULL;
}

static CUresult stream_enqueue(struct fake_stream *s, struct fake_work *w) {
  pthread_mutex_lock(&s->mu);
  if (!s->started) {
    if (pthread_create(&s->thread, NULL, stream_worker, s) != 0) {
      pthread_mutex_unlock(&s->mu);
      return CUDA_ERROR_OUT_OF_MEMORY;
    }
    s->started = 1;
  }
  w->next = NULL;
  if (s->tail)
    s->tail->next = w;
  else
    s->head = w;
  s->tail = w;
  pthread_cond_broadcast(&s->cv);
  pthread_mutex_unlock(&s->mu);
  return CUDA_SUCCESS;
}

static void stream_sync(struct fake_stream *s) {
  pthread_mutex_lock(&s->mu);
  while (s->head || s->busy) pthread_cond_wait(&s->cv, &s->mu);
  pthread_mutex_unlock(&s->mu);
}

static struct fake_stream *stream_per_thread(void);

/* The stream a handle names: NULL and CU_STREAM_LEGACY (0x1) are the
 * legacy stream, CU_STREAM_PER_THREAD (0x2) the calling thread's own
 * default stream; otherwise a live created stream. */
static struct fake_stream *stream_of(void *handle) {
  if ((uintptr_t)handle <= 1) return ctx_null_stream();
  if ((uintptr_t)handle == 2) return stream_per_thread();
  pthread_mutex_lock(&fake_mu);
  struct fake_stream *s = fake_streams;
  while (s && s != handle) s = s->next;
  pthread_mutex_unlock(&fake_mu);
  return s;
}

/* --- the per-thread default stream and stream capture ------------------- */

/* CU_STREAM_PER_THREAD: each thread's own default stream, made at its
 * first use and kept for the life of the process (a blocking stream, in
 * fake_streams, so cuCtxSynchronize waits for it). */
static __thread struct fake_stream *fake_pt_stream;

static struct fake_stream *stream_per_thread(void) {
  if (fake_pt_stream) return fake_pt_stream;
  struct fake_stream *s = calloc(1, sizeof *s);
  if (!s) return NULL;
  pthread_mutex_init(&s->mu, NULL);
  pthread_cond_init(&s->cv, NULL);
  s->ctx = fake_cur; /* the context it was first used in waits for it */
  pthread_mutex_lock(&fake_mu);
  s->next = fake_streams;
  fake_streams = s;
  pthread_mutex_unlock(&fake_mu);
  fake_pt_stream = s;
  return s;
}

enum { /* CUstreamCaptureMode */
  FAKE_CAP_GLOBAL = 0,
  FAKE_CAP_THREAD_LOCAL = 1,
  FAKE_CAP_RELAXED = 2,
};

/* This thread's capture mode (cuThreadExchangeStreamCaptureMode). */
static __thread int fake_tmode = FAKE_CAP_GLOBAL;

/* Frees a list of captured work (graph nodes), with the references they
 * hold. */
static void work_list_free(struct fake_work *w) {
  while (w) {
    struct fake_work *next = w->next;
    if (w->ev) event_unref(w->ev);
    free(w);
    w = next;
  }
}

/* Invalidates s's capture, said once in the misuse log.  Under fake_mu. */
static void cap_break(struct fake_stream *s, const char *call) {
  if (!s->cap || s->cap_invalid) return;
  s->cap_invalid = 1;
  fake_misuse("%s during a stream capture: the capture is invalidated", call);
}

/* The gate of a potentially unsafe call (memory management, a wait, an
 * event query), as cuThreadExchangeStreamCaptureMode documents it: in
 * the global mode a thread may not make one while it has a capture of
 * its own that is not relaxed, nor while another thread has a global
 * one; in the thread-local mode only its own captures count; in the
 * relaxed mode none does.  A call refused invalidates the captures it
 * conflicts with (as the driver does) and returns
 * CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED.  Takes fake_mu. */
static CUresult cap_unsafe(const char *call) {
  if (fake_tmode == FAKE_CAP_RELAXED) return CUDA_SUCCESS;
  pthread_t me = pthread_self();
  int hit = 0;
  pthread_mutex_lock(&fake_mu);
  for (struct fake_stream *s = fake_streams; s; s = s->next) {
    if (!s->cap) continue;
    int mine = pthread_equal(s->cap_thread, me);
    if ((mine && s->cap_mode != FAKE_CAP_RELAXED) ||
        (!mine && fake_tmode == FAKE_CAP_GLOBAL &&
         s->cap_mode == FAKE_CAP_GLOBAL)) {
      cap_break(s, call);
      hit = 1;
    }
  }
  pthread_mutex_unlock(&fake_mu);
  return hit ? CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED : CUDA_SUCCESS;
}

/* 1 when a blocking stream (not CU_STREAM_NON_BLOCKING; the per-thread
 * streams are blocking) captures: the legacy stream synchronises with it
 * implicitly.  With `call`, those captures are invalidated.  Under
 * fake_mu. */
static int cap_blocking_locked(const char *call) {
  int hit = 0;
  for (struct fake_stream *s = fake_streams; s; s = s->next)
    if (s->cap && !(s->flags & 1u)) {
      if (call) cap_break(s, call);
      hit = 1;
    }
  return hit;
}

/* Work on the legacy stream (or a synchronous call, which is ordered on
 * it) while a blocking stream captures would join that capture: refused
 * with CUDA_ERROR_STREAM_CAPTURE_IMPLICIT, the capture invalidated.
 * Takes fake_mu. */
static CUresult cap_legacy(const char *call) {
  pthread_mutex_lock(&fake_mu);
  int hit = cap_blocking_locked(call);
  pthread_mutex_unlock(&fake_mu);
  return hit ? CUDA_ERROR_STREAM_CAPTURE_IMPLICIT : CUDA_SUCCESS;
}

/* Appends w to s's capture.  Under fake_mu, s capturing. */
static void cap_append(struct fake_stream *s, struct fake_work *w) {
  w->next = NULL;
  if (s->cap_tail)
    s->cap_tail->next = w;
  else
    s->cap_head = w;
  s->cap_tail = w;
}

/* Work for stream s: on the legacy stream, cap_legacy's check; on a
 * capturing stream, taken into the capture (1 with *took).  Takes
 * fake_mu. */
static CUresult cap_or_queue(struct fake_stream *s, struct fake_work *w,
                             const char *call, int *took) {
  *took = 0;
  if (is_null_stream(s)) return cap_legacy(call);
  pthread_mutex_lock(&fake_mu);
  if (s->cap) {
    cap_append(s, w);
    *took = 1;
  }
  pthread_mutex_unlock(&fake_mu);
  return CUDA_SUCCESS;
}

/* A graph: the captured work, replayed in order by cuGraphLaunch.  An
 * executable graph is a copy of it. */
#define FAKE_GRAPH_MAGIC 0x47524150u
struct fake_graph {
  uint32_t magic;
  struct fake_work *nodes;
};

/* Waits for context c's work: its legacy stream and the streams made in
 * it.  Under fake_mu for the list, so that no stream is destroyed
 * meanwhile; the stream workers never take it. */
static void ctx_sync(struct fake_ctx *c) {
  stream_sync(&fake_ctx_null[c - fake_ctxs]);
  pthread_mutex_lock(&fake_mu);
  for (struct fake_stream *s = fake_streams; s; s = s->next)
    if (s->ctx == c) stream_sync(s);
  pthread_mutex_unlock(&fake_mu);
}

/* --- copies ------------------------------------------------------------- */

/* Where device range [p, p+n) lies in the fake's views, for reading
 * (want = FAKE_ACCESS_READ) or writing (FAKE_ACCESS_READWRITE): all of it
 * inside one mapping.  With `hold`, *view is referenced for the caller.
 * Under fake_mu. */
static CUresult translate(CUdeviceptr p, size_t n, int want, const char *call,
                          char **cpu, struct fake_map **map,
                          struct fake_view **hold) {
  struct fake_map *m = map_containing((uintptr_t)p, n);
  if (!m) {
    fake_misuse("%s: [%#llx, +%zu) is not inside one mapping", call, p, n);
    return CUDA_ERROR_INVALID_VALUE;
  }
  /* Access is per device: the copy runs on the current context's. */
  int dev = fake_cur ? fake_cur->dev : 0;
  if ((m->access[dev] & want) != want) {
    fake_misuse("%s: [%#llx, +%zu) is mapped without %s access for "
                "device %d (cuMemSetAccess)", call, p, n,
                want == FAKE_ACCESS_READ ? "read" : "read/write", dev);
    return CUDA_ERROR_INVALID_VALUE;
  }
  *cpu = m->view->cpu + ((uintptr_t)p - m->base);
  if (map) *map = m;
  if (hold) {
    atomic_fetch_add_explicit(&m->view->refs, 1, memory_order_relaxed);
    *hold = m->view;
  }
  return CUDA_SUCCESS;
}

/* How much of [p, p+n) lies in the mapping that holds p; 0 when none
 * does.  Under fake_mu. */
static size_t piece_of(uintptr_t p, size_t n) {
  for (struct fake_map *m = fake_maps; m; m = m->next)
    if (p >= m->base && p - m->base < m->size) {
      size_t left = m->size - (p - m->base);
      return left < n ? left : n;
    }
  return 0;
}

/* Checks that [p, p+n) is mapped with `want` access all along, in one
 * mapping or in mappings side by side: the driver copies across the
 * mappings of a contiguous range (PyTorch's expandable segments rely on
 * it), never across a hole.  Under fake_mu. */
static CUresult check_run(CUdeviceptr p, size_t n, int want, const char *call) {
  uintptr_t a = (uintptr_t)p;
  while (n) {
    size_t k = piece_of(a, n);
    if (k == 0) {
      fake_misuse("%s: [%#llx, +%zu) is not mapped at %#lx", call, p, n,
                  (unsigned long)a);
      return CUDA_ERROR_INVALID_VALUE;
    }
    char *cpu;
    CUresult r = translate(a, k, want, call, &cpu, NULL, NULL);
    if (r) return r;
    a += k;
    n -= k;
  }
  return CUDA_SUCCESS;
}

/* 1 when two device ranges share memory (the same allocation, overlapping
 * offsets, through whichever mappings). */
static int overlap(const struct fake_map *a, CUdeviceptr pa,
                   const struct fake_map *b, CUdeviceptr pb, size_t n) {
  if (a->a->acct != b->a->acct || a->a->id != b->a->id) return 0;
  uint64_t oa = pa - a->base, ob = pb - b->base; /* both views start at 0 */
  return oa < ob + n && ob < oa + n;
}

/* Copies host memory to device memory (to_device) or back, piece by
 * piece of the mappings the device range crosses, after the legacy
 * stream's work.  The range was checked (check_run). */
static void copy_host(uintptr_t dev, char *host, size_t n, int to_device) {
  stream_sync(ctx_null_stream());
  while (n) {
    char *cpu;
    pthread_mutex_lock(&fake_mu);
    size_t k = piece_of(dev, n);
    CUresult r = k ? translate(dev, k, to_device ? FAKE_ACCESS_READWRITE
                                                 : FAKE_ACCESS_READ,
                               "copy", &cpu, NULL, NULL)
                   : CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_unlock(&fake_mu);
    if (r) return; /* unmapped meanwhile: the application's own race */
    if (to_device)
      memcpy(cpu, host, k);
    else
      memcpy(host, cpu, k);
    dev += k;
    host += k;
    n -= k;
  }
}

static CUresult copy_dtod(CUdeviceptr dst, CUdeviceptr src, size_t n,
                          void *stream, int async) {
  int dev;
  CUresult r = fake_need_ctx(&dev);
  if (r) return r;
  if (n == 0) return CUDA_SUCCESS;
  struct fake_stream *s = stream_of(async ? stream : NULL);
  if (!s) return CUDA_ERROR_INVALID_HANDLE;
  const char *call = async ? "cuMemcpyDtoDAsync" : "cuMemcpyDtoD";
  if (!async && (r = cap_unsafe(call)) != 0) return r;
  if (is_null_stream(s) && (r = cap_legacy(call)) != 0) return r;
  pthread_mutex_lock(&fake_mu);
  r = check_run(dst, n, FAKE_ACCESS_READWRITE, call);
  if (!r) r = check_run(src, n, FAKE_ACCESS_READ, call);
  /* Overlap, piece by piece (the pieces split at the mappings of both). */
  for (size_t done = 0; !r && done < n;) {
    size_t k = piece_of(dst + done, n - done);
    size_t ks = piece_of(src + done, n - done);
    if (ks < k) k = ks;
    char *d, *sp;
    struct fake_map *md, *ms;
    translate(dst + done, k, FAKE_ACCESS_READWRITE, call, &d, &md, NULL);
    translate(src + done, k, FAKE_ACCESS_READ, call, &sp, &ms, NULL);
    if (overlap(md, dst + done, ms, src + done, k)) {
      fake_misuse("%s: [%#llx, +%zu) and [%#llx, +%zu) overlap", call, dst,
                  n, src, n);
      r = CUDA_ERROR_INVALID_VALUE;
    }
    done += k;
  }
  if (r || !async) {
    pthread_mutex_unlock(&fake_mu);
    if (r) return r;
    /* Synchronous copies are ordered after the legacy stream's work; the
     * mappings cannot go meanwhile but by the application's own race. */
    stream_sync(ctx_null_stream());
    for (size_t done = 0; done < n;) {
      char *d, *sp;
      pthread_mutex_lock(&fake_mu);
      size_t k = piece_of(dst + done, n - done);
      size_t ks = piece_of(src + done, n - done);
      if (ks < k) k = ks;
      r = k ? translate(dst + done, k, FAKE_ACCESS_READWRITE, call, &d, NULL,
                        NULL)
            : CUDA_ERROR_INVALID_VALUE;
      if (!r) r = translate(src + done, k, FAKE_ACCESS_READ, call, &sp, NULL,
                            NULL);
      pthread_mutex_unlock(&fake_mu);
      if (r) return r;
      memcpy(d, sp, k);
      done += k;
    }
    return CUDA_SUCCESS;
  }
  /* Captured: a node of the graph, its ranges checked again at each
   * launch. */
  if (s->cap) {
    struct fake_work *w = calloc(1, sizeof *w);
    if (!w) {
      pthread_mutex_unlock(&fake_mu);
      return CUDA_ERROR_OUT_OF_MEMORY;
    }
    w->ddst = dst;
    w->dsrc = src;
    w->n = n;
    cap_append(s, w);
    pthread_mutex_unlock(&fake_mu);
    return CUDA_SUCCESS;
  }
  /* Asynchronous: one work item a piece, each holding its views, so that
   * an unmap that races the copy is harmless here. */
  for (size_t done = 0; !r && done < n;) {
    size_t k = piece_of(dst + done, n - done);
    size_t ks = piece_of(src + done, n - done);
    if (ks < k) k = ks;
    struct fake_work *w = calloc(1, sizeof *w);
    if (!w) {
      r = CUDA_ERROR_OUT_OF_MEMORY;
      break;
    }
    translate(dst + done, k, FAKE_ACCESS_READWRITE, call, &w->dst, NULL,
              &w->vdst);
    char *sp;
    translate(src + done, k, FAKE_ACCESS_READ, call, &sp, NULL, &w->vsrc);
    w->src = sp;
    w->n = k;
    r = stream_enqueue(s, w);
    if (r) {
      view_unref(w->vdst);
      view_unref(w->vsrc);
      free(w);
    }
    done += k;
  }
  pthread_mutex_unlock(&fake_mu);
  return r;
}

/* --- the API: initialisation, devices, contexts ------------------------ */

static CUresult fake_cuInit(unsigned flags) {
  pid_t me = getpid();
  pid_t p = __atomic_load_n(&fake_pid, __ATOMIC_ACQUIRE);
  if (p != 0 && p != me) return CUDA_ERROR_NOT_INITIALIZED; /* forked */
  if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
  if (fake_devices() == 0) return CUDA_ERROR_NO_DEVICE;
  __atomic_store_n(&fake_pid, me, __ATOMIC_RELEASE);
  return CUDA_SUCCESS;
}

/* 12000, or $FAKECUDA_DRIVER_VERSION (a CUDA runtime refuses a driver
 * older than itself: tests that run a real runtime on the fake say which
 * version it should claim). */
static CUresult fake_cuDriverGetVersion(int *v) {
  if (!v) return CUDA_ERROR_INVALID_VALUE;
  const char *s = getenv("FAKECUDA_DRIVER_VERSION");
  *v = s && atoi(s) > 0 ? atoi(s) : 12000;
  return CUDA_SUCCESS;
}

static CUresult fake_cuDeviceGetCount(int *n) {
  CUresult r = fake_ready();
  if (r) return r;
  *n = fake_devices();
  return CUDA_SUCCESS;
}

static CUresult fake_device_ok(int d) {
  CUresult r = fake_ready();
  if (r) return r;
  return fake_phys_visible(d) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_DEVICE;
}

static CUresult fake_cuDeviceGet(int *d, int ordinal) {
  CUresult r = fake_ready();
  if (r) return r;
  int p = fake_ordinal_phys(ordinal);
  if (p < 0) return CUDA_ERROR_INVALID_DEVICE;
  *d = p; /* a CUdevice is the physical device */
  return CUDA_SUCCESS;
}

/* CUuuid: 16 bytes. */
static CUresult fake_cuDeviceGetUuid(unsigned char *uuid, int d) {
  CUresult r = fake_device_ok(d);
  if (r) return r;
  if (!uuid) return CUDA_ERROR_INVALID_VALUE;
  memset(uuid, 0, 16);
  memcpy(uuid, "FAKECUDA", 8);
  uuid[15] = (unsigned char)d;
  return CUDA_SUCCESS;
}

static CUresult fake_cuDeviceGetPCIBusId(char *bus, int len, int d) {
  CUresult r = fake_device_ok(d);
  if (r) return r;
  if (!bus || len <= 0) return CUDA_ERROR_INVALID_VALUE;
  snprintf(bus, (size_t)len, "0000:%02x:00.0", 0x10 + d);
  return CUDA_SUCCESS;
}

static CUresult fake_cuDeviceGetName(char *name, int len, int d) {
  CUresult r = fake_device_ok(d);
  if (r) return r;
  if (len <= 0) return CUDA_ERROR_INVALID_VALUE;
  snprintf(name, (size_t)len, "fakecuda %d", d);
  return CUDA_SUCCESS;
}

/* cuDeviceTotalMem (the _v2 ABI): the device's size, $FAKECUDA_TOTAL. */
static CUresult fake_cuDeviceTotalMem(size_t *bytes, int d) {
  CUresult r = fake_device_ok(d);
  if (r) return r;
  if (!bytes) return CUDA_ERROR_INVALID_VALUE;
  *bytes = (size_t)fake_total();
  return CUDA_SUCCESS;
}

static CUresult fake_cuDeviceGetAttribute(int *v, int attr, int d) {
  CUresult r = fake_device_ok(d);
  if (r) return r;
  switch (attr) {
    case FAKE_ATTR_VMM:
      *v = !fake_env_flag("FAKECUDA_NO_VMM");
      return CUDA_SUCCESS;
    case FAKE_ATTR_POSIX_FD:
      *v = !fake_env_flag("FAKECUDA_NO_POSIX_FD");
      return CUDA_SUCCESS;
    case FAKE_ATTR_COMPUTE_MODE:
      *v = (int)fake_env_size("FAKECUDA_COMPUTE_MODE", 0);
      return CUDA_SUCCESS;
    default:
      return CUDA_ERROR_INVALID_VALUE; /* not modelled */
  }
}

/* What a context costs on its device ($FAKECUDA_CTX_COST), counted as
 * held by this process from now on (once per context).  CUDA_SUCCESS, or
 * CUDA_ERROR_OUT_OF_MEMORY when the device has no room for it. */
static CUresult ctx_mem_take(struct fake_ctx *c, int dev) {
  uint64_t cost = fake_env_size("FAKECUDA_CTX_COST", 0);
  pthread_mutex_lock(&fake_mu);
  CUresult r = CUDA_SUCCESS;
  struct fake_acct *a = cost && !c->mem ? acct_get(dev) : NULL;
  if (a) {
    acct_lock(a);
    uint64_t used = acct_prune(a), total = fake_total();
    uint64_t id = ++a->f->next_id;
    if (used > total || cost > total - used || acct_hold(a, id, cost) != 0)
      r = CUDA_ERROR_OUT_OF_MEMORY;
    else
      c->mem = id;
    acct_unlock(a);
  } else if (cost && !c->mem) {
    r = CUDA_ERROR_OPERATING_SYSTEM;
  }
  pthread_mutex_unlock(&fake_mu);
  return r;
}

/* Gives a destroyed context's memory back to its device. */
static void ctx_mem_drop(struct fake_ctx *c) {
  pthread_mutex_lock(&fake_mu);
  struct fake_acct *a = c->mem ? acct_get(c->dev) : NULL;
  if (a) acct_drop(a, c->mem);
  c->mem = 0;
  pthread_mutex_unlock(&fake_mu);
}

static CUresult fake_cuDevicePrimaryCtxRetain(void **c, int d) {
  CUresult r = fake_device_ok(d);
  if (r) return r;
  /* The context is made (and costs) at the first retain only. */
  if (!__atomic_load_n(&fake_ctxs[d].live, __ATOMIC_ACQUIRE) &&
      (r = ctx_mem_take(&fake_ctxs[d], d)) != CUDA_SUCCESS)
    return r;
  __atomic_store_n(&fake_ctxs[d].live, 1, __ATOMIC_RELEASE);
  fake_ctxs[d].dev = d;
  *c = &fake_ctxs[d];
  return CUDA_SUCCESS;
}

static CUresult fake_cuDevicePrimaryCtxRelease(int d) {
  /* The primary context stays usable: gmb never resets it, and a count of
   * retains would only matter to a reset. */
  return fake_device_ok(d);
}

static CUresult fake_cuCtxCreate(void **c, unsigned flags, int d) {
  (void)flags;
  CUresult r = fake_device_ok(d);
  if (r) return r;
  pthread_mutex_lock(&fake_mu);
  struct fake_ctx *found = NULL;
  for (int i = FAKE_MAX_DEV; i < FAKE_MAX_CTX && !found; i++)
    if (!fake_ctxs[i].live) found = &fake_ctxs[i];
  if (found) {
    found->dev = d;
    __atomic_store_n(&found->live, 1, __ATOMIC_RELEASE);
  }
  pthread_mutex_unlock(&fake_mu);
  if (!found) return CUDA_ERROR_OUT_OF_MEMORY;
  if ((r = ctx_mem_take(found, d)) != CUDA_SUCCESS) {
    __atomic_store_n(&found->live, 0, __ATOMIC_RELEASE);
    return r;
  }
  fake_cur = found; /* a new context is made current, as cuCtxCreate does */
  *c = found;
  return CUDA_SUCCESS;
}

static CUresult fake_cuCtxDestroy(void *c) {
  CUresult r = fake_ready();
  if (r) return r;
  struct fake_ctx *x = c;
  if (!fake_ctx_valid(x) || x < fake_ctxs + FAKE_MAX_DEV)
    return CUDA_ERROR_INVALID_CONTEXT;
  __atomic_store_n(&x->live, 0, __ATOMIC_RELEASE);
  if (fake_cur == x) fake_cur = NULL;
  ctx_mem_drop(x);
  return CUDA_SUCCESS;
}

static CUresult fake_cuCtxSetCurrent(void *c) {
  CUresult r = fake_ready();
  if (r) return r;
  static _Atomic uint64_t set_calls; /* since FAKECUDA_FAIL_SET_CURRENT */
  uint64_t fail_at = fake_env_size("FAKECUDA_FAIL_SET_CURRENT", 0);
  if (fail_at == 0) atomic_store(&set_calls, 0);
  else if (atomic_fetch_add(&set_calls, 1) + 1 == fail_at)
    return CUDA_ERROR_INVALID_CONTEXT;
  if (c != NULL && !fake_ctx_valid(c)) return CUDA_ERROR_INVALID_CONTEXT;
  fake_cur = c;
  return CUDA_SUCCESS;
}

static CUresult fake_cuCtxGetCurrent(void **c) {
  CUresult r = fake_ready();
  if (r) return r;
  *c = fake_cur;
  return CUDA_SUCCESS;
}

/* The current context's CUdevice (the physical device, as cuDeviceGet
 * gives it); CUDA_ERROR_INVALID_CONTEXT on a thread with none. */
static CUresult fake_cuCtxGetDevice(int *d) {
  int dev;
  CUresult r = fake_need_ctx(&dev);
  if (r) return r;
  *d = dev;
  return CUDA_SUCCESS;
}

/* --- the API: memory ----------------------------------------------------- */

static CUresult fake_cuMemGetInfo(size_t *free_b, size_t *total) {
  int dev;
  CUresult r = fake_need_ctx(&dev);
  if (r) return r;
  pthread_mutex_lock(&fake_mu);
  struct fake_acct *a = acct_get(dev);
  if (!a) {
    pthread_mutex_unlock(&fake_mu);
    return CUDA_ERROR_OPERATING_SYSTEM;
  }
  acct_lock(a);
  uint64_t used = acct_prune(a);
  acct_unlock(a);
  pthread_mutex_unlock(&fake_mu);
  uint64_t t = fake_total();
  *total = (size_t)t;
  *free_b = (size_t)(t > used ? t - used : 0);
  return CUDA_SUCCESS;
}

static CUresult fake_prop_ok(const CUmemAllocationProp *prop) {
  if (!prop || prop->type != FAKE_ALLOC_PINNED ||
      prop->location.type != FAKE_LOCATION_DEVICE)
    return CUDA_ERROR_INVALID_VALUE;
  if (fake_ordinal_phys(prop->location.id) < 0)
    return CUDA_ERROR_INVALID_DEVICE;
  return CUDA_SUCCESS;
}

static CUresult fake_cuMemGetAllocationGranularity(
    size_t *g, const CUmemAllocationProp *prop, int option) {
  CUresult r = fake_ready();
  if (r) return r;
  if (!g || (option != 0 && option != 1)) return CUDA_ERROR_INVALID_VALUE;
  if ((r = fake_prop_ok(prop)) != 0) return r;
  *g = (size_t)fake_granularity();
  return CUDA_SUCCESS;
}

static CUresult fake_cuMemCreate(CUmemGenericAllocationHandle *h, size_t size,
                                 const CUmemAllocationProp *prop,
                                 unsigned long long flags) {
  CUresult r = fake_need_ctx(NULL);
  if (r) return r;
  if ((r = cap_unsafe("cuMemCreate")) != 0) return r;
  if (!h || flags != 0) return CUDA_ERROR_INVALID_VALUE;
  if ((r = fake_prop_ok(prop)) != 0) return r;
  if (fake_env_flag("FAKECUDA_NO_VMM")) return CUDA_ERROR_NOT_SUPPORTED;
  int types = prop->requestedHandleTypes;
  if (types & ~FAKE_HANDLE_POSIX_FD) return CUDA_ERROR_NOT_SUPPORTED;
  if ((types & FAKE_HANDLE_POSIX_FD) && fake_env_flag("FAKECUDA_NO_POSIX_FD"))
    return CUDA_ERROR_NOT_SUPPORTED;
  uint64_t g = fake_granularity();
  if (size == 0 || size % g != 0) {
    fake_misuse("cuMemCreate(%zu): not a multiple of the granularity %llu",
                size, (unsigned long long)g);
    return CUDA_ERROR_INVALID_VALUE;
  }
  pthread_mutex_lock(&fake_mu);
  struct fake_alloc *a;
  r = alloc_create(fake_ordinal_phys(prop->location.id), size, types, &a);
  if (!r) {
    r = handle_new(a, h);
    if (r) {
      a->refs = 1;
      alloc_unref(a);
    }
  }
  pthread_mutex_unlock(&fake_mu);
  return r;
}

static CUresult fake_cuMemRelease(CUmemGenericAllocationHandle h) {
  CUresult r = fake_need_ctx(NULL);
  if (r) return r;
  if ((r = cap_unsafe("cuMemRelease")) != 0) return r;
  pthread_mutex_lock(&fake_mu);
  r = release(h);
  pthread_mutex_unlock(&fake_mu);
  return r;
}

static CUresult fake_cuMemExportToShareableHandle(
    void *out, CUmemGenericAllocationHandle h, int type,
    unsigned long long flags) {
  CUresult r = fake_need_ctx(NULL);
  if (r) return r;
  if (!out || flags != 0 || type != FAKE_HANDLE_POSIX_FD)
    return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&fake_mu);
  struct fake_handle *x = handle_find(h);
  if (!x) {
    fake_misuse("cuMemExportToShareableHandle(%#llx): not a live handle", h);
    r = CUDA_ERROR_INVALID_VALUE;
  } else if (!(x->a->handle_types & FAKE_HANDLE_POSIX_FD)) {
    r = CUDA_ERROR_INVALID_VALUE; /* not requested at cuMemCreate */
  } else {
    int fd = fcntl(x->a->fd, F_DUPFD_CLOEXEC, 0);
    if (fd < 0)
      r = CUDA_ERROR_OPERATING_SYSTEM;
    else
      *(int *)out = fd;
  }
  pthread_mutex_unlock(&fake_mu);
  return r;
}

static CUresult fake_cuMemImportFromShareableHandle(
    CUmemGenericAllocationHandle *h, void *os_handle, int type) {
  CUresult r = fake_need_ctx(NULL);
  if (r) return r;
  if ((r = cap_unsafe("cuMemImportFromShareableHandle")) != 0) return r;
  if (!h || type != FAKE_HANDLE_POSIX_FD) return CUDA_ERROR_INVALID_VALUE;
  if (fake_env_flag("FAKECUDA_NO_VMM")) return CUDA_ERROR_NOT_SUPPORTED;
  int fd = (int)(uintptr_t)os_handle;
  struct fake_hdr hdr;
  struct stat st;
  if (fd < 0 || fstat(fd, &st) != 0 ||
      pread(fd, &hdr, sizeof hdr, 0) != (ssize_t)sizeof hdr ||
      hdr.magic != FAKE_MAGIC || hdr.dev < 0 ||
      hdr.dev >= fake_phys_devices() ||
      (uint64_t)st.st_size != FAKE_HDR + hdr.size)
    return CUDA_ERROR_INVALID_VALUE; /* not memory of this driver */
  if (!fake_phys_visible(hdr.dev))
    return CUDA_ERROR_INVALID_DEVICE; /* a GPU this process cannot see */
  pthread_mutex_lock(&fake_mu);
  struct fake_acct *acct = acct_get(hdr.dev);
  if (!acct) {
    pthread_mutex_unlock(&fake_mu);
    return CUDA_ERROR_OPERATING_SYSTEM;
  }
  struct fake_alloc *a = fake_allocs;
  while (a && !(a->acct == acct && a->id == hdr.id)) a = a->next;
  if (a) {
    r = handle_new(a, h);
    pthread_mutex_unlock(&fake_mu);
    return r;
  }
  a = calloc(1, sizeof *a);
  if (!a) {
    pthread_mutex_unlock(&fake_mu);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  a->fd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
  acct_lock(acct);
  acct_prune(acct);
  int held = a->fd >= 0 ? acct_hold(acct, hdr.id, hdr.size) : -1;
  acct_unlock(acct);
  if (held != 0) {
    if (a->fd >= 0) close(a->fd);
    free(a);
    pthread_mutex_unlock(&fake_mu);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  a->acct = acct;
  a->id = hdr.id;
  a->size = hdr.size;
  a->dev = hdr.dev;
  a->handle_types = hdr.handle_types;
  a->next = fake_allocs;
  fake_allocs = a;
  r = handle_new(a, h);
  if (r) {
    a->refs = 1;
    alloc_unref(a);
  }
  pthread_mutex_unlock(&fake_mu);
  return r;
}

static CUresult fake_cuMemAddressReserve(CUdeviceptr *p, size_t size,
                                         size_t align, CUdeviceptr addr,
                                         unsigned long long flags) {
  (void)addr; /* a hint; the kernel picks */
  CUresult r = fake_need_ctx(NULL);
  if (r) return r;
  if ((r = cap_unsafe("cuMemAddressReserve")) != 0) return r;
  size_t page = (size_t)sysconf(_SC_PAGESIZE);
  if (!p || flags != 0 || size == 0 || size % page != 0 ||
      (align & (align - 1)) != 0)
    return CUDA_ERROR_INVALID_VALUE;
  size_t g = (size_t)fake_granularity();
  if (align < g) align = g;
  uintptr_t base;
  pthread_mutex_lock(&fake_mu);
  r = reserve(size, align, &base);
  pthread_mutex_unlock(&fake_mu);
  if (!r) *p = (CUdeviceptr)base;
  return r;
}

static CUresult fake_cuMemAddressFree(CUdeviceptr p, size_t size) {
  CUresult r = fake_need_ctx(NULL);
  if (r) return r;
  if ((r = cap_unsafe("cuMemAddressFree")) != 0) return r;
  pthread_mutex_lock(&fake_mu);
  r = address_free((uintptr_t)p, size);
  pthread_mutex_unlock(&fake_mu);
  return r;
}

static CUresult fake_cuMemMap(CUdeviceptr p, size_t size, size_t offset,
                              CUmemGenericAllocationHandle h,
                              unsigned long long flags) {
  CUresult r = fake_need_ctx(NULL);
  if (r) return r;
  if ((r = cap_unsafe("cuMemMap")) != 0) return r;
  if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
  uint64_t g = fake_granularity();
  pthread_mutex_lock(&fake_mu);
  struct fake_handle *x = handle_find(h);
  if (!x) {
    fake_misuse("cuMemMap(%#llx): %#llx is not a live handle", p, h);
    r = CUDA_ERROR_INVALID_VALUE;
  } else if (p % g || size % g || size == 0 || offset != 0) {
    fake_misuse("cuMemMap(%#llx, %zu, offset %zu): address and size must be "
                "multiples of the granularity %llu, offset 0",
                p, size, offset, (unsigned long long)g);
    r = CUDA_ERROR_INVALID_VALUE;
  } else if (size > x->a->size) {
    fake_misuse("cuMemMap(%#llx, %zu): the allocation has %llu bytes", p,
                size, (unsigned long long)x->a->size);
    r = CUDA_ERROR_INVALID_VALUE;
  } else if (!res_containing((uintptr_t)p, size)) {
    fake_misuse("cuMemMap(%#llx, %zu): not inside one reservation", p, size);
    r = CUDA_ERROR_INVALID_VALUE;
  } else {
    for (struct fake_map *m = fake_maps; m && !r; m = m->next)
      if (m->base < p + size && p < m->base + m->size) {
        fake_misuse("cuMemMap(%#llx, %zu): already mapped at %#lx", p, size,
                    (unsigned long)m->base);
        r = CUDA_ERROR_INVALID_VALUE;
      }
    if (!r) r = map_new((uintptr_t)p, size, x->a);
  }
  pthread_mutex_unlock(&fake_mu);
  return r;
}

static CUresult fake_cuMemUnmap(CUdeviceptr p, size_t size) {
  CUresult r = fake_need_ctx(NULL);
  if (r) return r;
  if ((r = cap_unsafe("cuMemUnmap")) != 0) return r;
  pthread_mutex_lock(&fake_mu);
  r = unmap_range((uintptr_t)p, size);
  pthread_mutex_unlock(&fake_mu);
  return r;
}

static CUresult fake_cuMemSetAccess(CUdeviceptr p, size_t size,
                                    const CUmemAccessDesc *desc,
                                    size_t count) {
  CUresult r = fake_need_ctx(NULL);
  if (r) return r;
  if ((r = cap_unsafe("cuMemSetAccess")) != 0) return r;
  if (!desc || count == 0) return CUDA_ERROR_INVALID_VALUE;
  int flags[FAKE_MAX_DEV], set[FAKE_MAX_DEV] = {0};
  for (size_t i = 0; i < count; i++) {
    if (desc[i].location.type != FAKE_LOCATION_DEVICE)
      return CUDA_ERROR_INVALID_VALUE;
    if (fake_ordinal_phys(desc[i].location.id) < 0)
      return CUDA_ERROR_INVALID_DEVICE;
    if (desc[i].flags != 0 && desc[i].flags != FAKE_ACCESS_READ &&
        desc[i].flags != FAKE_ACCESS_READWRITE)
      return CUDA_ERROR_INVALID_VALUE;
    int phys = fake_ordinal_phys(desc[i].location.id);
    flags[phys] = desc[i].flags; /* each device its own; the last wins */
    set[phys] = 1;
  }
  pthread_mutex_lock(&fake_mu);
  if (!maps_cover_exactly((uintptr_t)p, size)) {
    fake_misuse("cuMemSetAccess(%#llx, %zu): not a run of whole mappings", p,
                size);
    r = CUDA_ERROR_INVALID_VALUE;
  } else {
    for (struct fake_map *m = fake_maps; m; m = m->next)
      if (m->base >= p && m->base < p + size)
        for (int d = 0; d < FAKE_MAX_DEV; d++)
          if (set[d]) m->access[d] = flags[d];
  }
  pthread_mutex_unlock(&fake_mu);
  return r;
}

/* cuMemAlloc: a mapped, accessible allocation that is never exported. */
static CUresult fake_cuMemAlloc(CUdeviceptr *p, size_t bytes) {
  int dev;
  CUresult r = fake_need_ctx(&dev);
  if (r) return r;
  if ((r = cap_unsafe("cuMemAlloc")) != 0) return r;
  if (!p || bytes == 0) return CUDA_ERROR_INVALID_VALUE;
  uint64_t g = fake_granularity();
  size_t size = (size_t)((bytes + g - 1) / g * g);
  struct fake_scratch *s = calloc(1, sizeof *s);
  if (!s) return CUDA_ERROR_OUT_OF_MEMORY;
  pthread_mutex_lock(&fake_mu);
  struct fake_alloc *a = NULL;
  uintptr_t base = 0;
  r = alloc_create(dev, size, 0, &a);
  if (!r) {
    a->refs = 1; /* the handle's reference, released below */
    r = reserve(size, (size_t)g, &base);
    if (!r) r = map_new(base, size, a);
    if (r && base) address_free(base, size);
    alloc_unref(a);
  }
  if (!r) {
    /* The new mapping: cuMemAlloc's memory is reachable from every device
     * by copies (unified addressing); peer access (cuCtxEnablePeerAccess)
     * is what kernels would need, and no kernel runs here. */
    for (int d = 0; d < FAKE_MAX_DEV; d++)
      fake_maps->access[d] = FAKE_ACCESS_READWRITE;
    s->ptr = base;
    s->size = size;
    s->next = fake_scratches;
    fake_scratches = s;
    *p = base;
  } else {
    free(s);
  }
  pthread_mutex_unlock(&fake_mu);
  return r;
}

static CUresult fake_cuMemFree(CUdeviceptr p) {
  CUresult r = fake_need_ctx(NULL);
  if (r) return r;
  if ((r = cap_unsafe("cuMemFree")) != 0) return r;
  if (p == 0) return CUDA_SUCCESS;
  pthread_mutex_lock(&fake_mu);
  struct fake_scratch **pp = &fake_scratches;
  while (*pp && (*pp)->ptr != p) pp = &(*pp)->next;
  if (!*pp) {
    fake_misuse("cuMemFree(%#llx): not from cuMemAlloc", p);
    r = CUDA_ERROR_INVALID_VALUE;
  } else {
    struct fake_scratch *s = *pp;
    *pp = s->next;
    unmap_range(s->ptr, s->size);
    address_free(s->ptr, s->size);
    free(s);
  }
  pthread_mutex_unlock(&fake_mu);
  return r;
}

/* cuIpcGetMemHandle: the real driver exports only cuMemAlloc's memory,
 * and only its base address; anything else (VMM mappings included) is
 * CUDA_ERROR_INVALID_VALUE.  The handle (64 bytes) carries the address;
 * nothing here opens it. */
static CUresult fake_cuIpcGetMemHandle(void *handle, CUdeviceptr p) {
  CUresult r = fake_need_ctx(NULL);
  if (r) return r;
  if (!handle) return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&fake_mu);
  struct fake_scratch *s = fake_scratches;
  while (s && s->ptr != p) s = s->next;
  if (s) {
    memset(handle, 0, 64);
    memcpy(handle, "FAKEIPC", 8);
    memcpy((char *)handle + 8, &p, sizeof p);
  }
  pthread_mutex_unlock(&fake_mu);
  return s ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* --- the API: copies ----------------------------------------------------- */

static CUresult fake_cuMemcpyDtoD(CUdeviceptr dst, CUdeviceptr src, size_t n) {
  return copy_dtod(dst, src, n, NULL, 0);
}

static CUresult fake_cuMemcpyDtoDAsync(CUdeviceptr dst, CUdeviceptr src,
                                       size_t n, void *stream) {
  return copy_dtod(dst, src, n, stream, 1);
}

static int pinned_holds(const void *p, size_t n);

/* Work of the legacy stream that writes device memory: a copy from
 * pageable memory (src; the bytes staged first) or a memset (src NULL,
 * every byte v).  Queued on the current context's legacy stream, one work
 * item a piece of the mappings it crosses (each holding its view); it
 * returns before they land, as the real driver does once its staging
 * buffer holds the bytes, or once the memset is queued.
 * $FAKECUDA_HTOD_DELAY_MS holds the first piece back.  Under fake_mu, the
 * range checked (check_run). */
static CUresult legacy_write(CUdeviceptr dst, const void *src, size_t n,
                             unsigned char v) {
  size_t pieces = 0;
  for (size_t done = 0; done < n; pieces++) done += piece_of(dst + done, n - done);
  struct fake_work **w = calloc(pieces, sizeof *w);
  char *stage = w && src ? malloc(n) : NULL;
  int ok = w && (stage || !src);
  for (size_t i = 0; ok && i < pieces; i++)
    if ((w[i] = calloc(1, sizeof **w)) == NULL) {
      while (i) free(w[--i]);
      ok = 0;
    }
  if (!ok) {
    free(stage);
    free(w);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  if (src) memcpy(stage, src, n);
  unsigned delay = (unsigned)fake_env_size("FAKECUDA_HTOD_DELAY_MS", 0);
  struct fake_stream *s = ctx_null_stream();
  size_t done = 0;
  for (size_t i = 0; i < pieces; i++) {
    size_t k = piece_of(dst + done, n - done);
    translate(dst + done, k, FAKE_ACCESS_READWRITE,
              src ? "cuMemcpyHtoD" : "cuMemsetD8", &w[i]->dst, NULL,
              &w[i]->vdst);
    w[i]->src = stage ? stage + done : NULL;
    w[i]->fill = src == NULL;
    w[i]->fill_v = v;
    w[i]->n = k;
    w[i]->delay_ms = i == 0 ? delay : 0;
    if (i == pieces - 1) w[i]->stage = stage; /* freed after the last */
    done += k;
    if (stream_enqueue(s, w[i]) != CUDA_SUCCESS) {
      /* No worker for the stream: this piece now, the rest likewise. */
      stream_sync(s);
      if (src)
        memcpy(w[i]->dst, w[i]->src, k);
      else
        memset(w[i]->dst, v, k);
      view_unref(w[i]->vdst);
      free(w[i]->stage);
      free(w[i]);
    }
  }
  free(w);
  return CUDA_SUCCESS;
}

static CUresult fake_cuMemcpyHtoD(CUdeviceptr dst, const void *src, size_t n) {
  CUresult r = fake_need_ctx(NULL);
  if (r) return r;
  if (n == 0) return CUDA_SUCCESS;
  if (!src) return CUDA_ERROR_INVALID_VALUE;
  if ((r = cap_unsafe("cuMemcpyHtoD")) != 0 ||
      (r = cap_legacy("cuMemcpyHtoD")) != 0)
    return r;
  int pinned = pinned_holds(src, n);
  pthread_mutex_lock(&fake_mu);
  r = check_run(dst, n, FAKE_ACCESS_READWRITE, "cuMemcpyHtoD");
  if (!r && !pinned) r = legacy_write(dst, src, n, 0);
  pthread_mutex_unlock(&fake_mu);
  if (r || !pinned) return r;
  copy_host((uintptr_t)dst, (char *)(uintptr_t)src, n, 1);
  return CUDA_SUCCESS;
}

/* Sets n bytes at dst to v: queued on the legacy stream, done when that
 * stream (or the context) is synchronised, as the driver's memset of
 * device memory is asynchronous with respect to the host. */
static CUresult fake_cuMemsetD8(CUdeviceptr dst, unsigned char v, size_t n) {
  CUresult r = fake_need_ctx(NULL);
  if (r) return r;
  if (n == 0) return CUDA_SUCCESS;
  if ((r = cap_unsafe("cuMemsetD8")) != 0 ||
      (r = cap_legacy("cuMemsetD8")) != 0)
    return r;
  pthread_mutex_lock(&fake_mu);
  r = check_run(dst, n, FAKE_ACCESS_READWRITE, "cuMemsetD8");
  if (!r) r = legacy_write(dst, NULL, n, v);
  pthread_mutex_unlock(&fake_mu);
  return r;
}

static CUresult fake_cuMemcpyDtoH(void *dst, CUdeviceptr src, size_t n) {
  CUresult r = fake_need_ctx(NULL);
  if (r) return r;
  if (n == 0) return CUDA_SUCCESS;
  if (!dst) return CUDA_ERROR_INVALID_VALUE;
  if ((r = cap_unsafe("cuMemcpyDtoH")) != 0 ||
      (r = cap_legacy("cuMemcpyDtoH")) != 0)
    return r;
  pthread_mutex_lock(&fake_mu);
  r = check_run(src, n, FAKE_ACCESS_READ, "cuMemcpyDtoH");
  pthread_mutex_unlock(&fake_mu);
  if (r) return r;
  copy_host((uintptr_t)src, dst, n, 0);
  return CUDA_SUCCESS;
}

/* --- the API: pinned host memory ------------------------------------------ */

/* cuMemHostAlloc / cuMemAllocHost: page-locked host memory, which the CPU
 * reaches at its own address (unlike device memory) and the copies take
 * as any host pointer.  Each allocation is a memfd named
 * "fakecuda-pinned" (tests may find it in /proc/<pid>/maps), touched
 * whole at once, as pinning faults in and locks every page; not zeros
 * (fake_garbage).
 * $FAKECUDA_PINNED_LIMIT (default no limit) bounds the bytes a process
 * holds pinned, as RLIMIT_MEMLOCK and the host's RAM bound the real
 * driver's: past it CUDA_ERROR_OUT_OF_MEMORY.  cuMemFreeHost of a pointer
 * these did not give is misuse. */
struct fake_pinned {
  void *p;
  size_t size;
  struct fake_pinned *next;
};
static struct fake_pinned *fake_pinned_list; /* under fake_mu */
static uint64_t fake_pinned_bytes;           /* under fake_mu */

/* 1 when [p, p+n) lies in one pinned allocation.  Takes fake_mu. */
static int pinned_holds(const void *p, size_t n) {
  uintptr_t a = (uintptr_t)p;
  int in = 0;
  pthread_mutex_lock(&fake_mu);
  for (struct fake_pinned *e = fake_pinned_list; e && !in; e = e->next)
    in = a >= (uintptr_t)e->p && a - (uintptr_t)e->p <= e->size &&
         n <= e->size - (a - (uintptr_t)e->p);
  pthread_mutex_unlock(&fake_mu);
  return in;
}

static CUresult fake_cuMemHostAlloc(void **pp, size_t bytes, unsigned flags) {
  CUresult r = fake_need_ctx(NULL);
  if (r) return r;
  if ((r = cap_unsafe("cuMemHostAlloc")) != 0) return r;
  /* PORTABLE, DEVICEMAP, WRITECOMBINED: the last two change nothing here. */
  if (!pp || bytes == 0 || (flags & ~7u)) return CUDA_ERROR_INVALID_VALUE;
  *pp = NULL;
  uint64_t limit = fake_env_size("FAKECUDA_PINNED_LIMIT", 0);
  struct fake_pinned *e = calloc(1, sizeof *e);
  if (!e) return CUDA_ERROR_OUT_OF_MEMORY;
  pthread_mutex_lock(&fake_mu);
  int over = limit && (bytes > limit || fake_pinned_bytes > limit - bytes);
  if (!over) fake_pinned_bytes += bytes;
  pthread_mutex_unlock(&fake_mu);
  if (over) {
    free(e);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  int fd = memfd_create("fakecuda-pinned", MFD_CLOEXEC);
  void *p = MAP_FAILED;
  if (fd >= 0 && ftruncate(fd, (off_t)bytes) == 0)
    p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (fd >= 0) close(fd);
  if (p == MAP_FAILED) {
    pthread_mutex_lock(&fake_mu);
    fake_pinned_bytes -= bytes;
    pthread_mutex_unlock(&fake_mu);
    free(e);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  /* Pinning touches every page; what it leaves there is no promise. */
  memset(p, fake_garbage() ? 0xa5 : 0, bytes);
  e->p = p;
  e->size = bytes;
  pthread_mutex_lock(&fake_mu);
  e->next = fake_pinned_list;
  fake_pinned_list = e;
  pthread_mutex_unlock(&fake_mu);
  *pp = p;
  return CUDA_SUCCESS;
}

static CUresult fake_cuMemAllocHost(void **pp, size_t bytes) {
  return fake_cuMemHostAlloc(pp, bytes, 0);
}

static CUresult fake_cuMemFreeHost(void *p) {
  CUresult r = fake_need_ctx(NULL);
  if (r) return r;
  if ((r = cap_unsafe("cuMemFreeHost")) != 0) return r;
  pthread_mutex_lock(&fake_mu);
  struct fake_pinned **pp = &fake_pinned_list;
  while (*pp && (*pp)->p != p) pp = &(*pp)->next;
  struct fake_pinned *e = *pp;
  if (e) {
    *pp = e->next;
    fake_pinned_bytes -= e->size;
  } else {
    fake_misuse("cuMemFreeHost(%p): not from cuMemHostAlloc", p);
  }
  pthread_mutex_unlock(&fake_mu);
  if (!e) return CUDA_ERROR_INVALID_VALUE;
  munmap(e->p, e->size);
  free(e);
  return CUDA_SUCCESS;
}

/* --- the API: streams ---------------------------------------------------- */

static CUresult fake_cuStreamCreate(void **out, unsigned flags) {
  CUresult r = fake_need_ctx(NULL);
  if (r) return r;
  if (!out || (flags & ~1u)) return CUDA_ERROR_INVALID_VALUE;
  struct fake_stream *s = calloc(1, sizeof *s);
  if (!s) return CUDA_ERROR_OUT_OF_MEMORY;
  pthread_mutex_init(&s->mu, NULL);
  pthread_cond_init(&s->cv, NULL);
  s->flags = flags;
  s->ctx = fake_cur;
  pthread_mutex_lock(&fake_mu);
  s->next = fake_streams;
  fake_streams = s;
  pthread_mutex_unlock(&fake_mu);
  *out = s;
  return CUDA_SUCCESS;
}

static CUresult fake_cuStreamSynchronize(void *h) {
  CUresult r = fake_need_ctx(NULL);
  if (r) return r;
  struct fake_stream *s = stream_of(h);
  if (!s) return CUDA_ERROR_INVALID_HANDLE;
  /* A wait for a capturing stream is illegal in every mode. */
  pthread_mutex_lock(&fake_mu);
  int capturing = s->cap;
  if (capturing) cap_break(s, "cuStreamSynchronize of the capturing stream");
  pthread_mutex_unlock(&fake_mu);
  if (capturing) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
  if (is_null_stream(s) && (r = cap_legacy("cuStreamSynchronize")) != 0)
    return r;
  if ((r = cap_unsafe("cuStreamSynchronize")) != 0) return r;
  stream_sync(s);
  return CUDA_SUCCESS;
}

static CUresult fake_cuStreamDestroy(void *h) {
  CUresult r = fake_need_ctx(NULL);
  if (r) return r;
  if ((uintptr_t)h <= 2) return CUDA_ERROR_INVALID_HANDLE;
  pthread_mutex_lock(&fake_mu);
  struct fake_stream **pp = &fake_streams;
  while (*pp && *pp != h) pp = &(*pp)->next;
  struct fake_stream *s = *pp;
  if (s) *pp = s->next;
  pthread_mutex_unlock(&fake_mu);
  if (!s) return CUDA_ERROR_INVALID_HANDLE;
  /* The real driver lets queued work finish after it returns; here it
   * finishes before. */
  pthread_mutex_lock(&s->mu);
  s->stop = 1;
  pthread_cond_broadcast(&s->cv);
  int started = s->started;
  pthread_mutex_unlock(&s->mu);
  if (started) pthread_join(s->thread, NULL);
  pthread_mutex_destroy(&s->mu);
  pthread_cond_destroy(&s->cv);
  free(s);
  return CUDA_SUCCESS;
}

static CUresult fake_cuLaunchHostFunc(void *h, CUhostFn fn, void *user) {
  CUresult r = fake_need_ctx(NULL);
  if (r) return r;
  if (!fn) return CUDA_ERROR_INVALID_VALUE;
  struct fake_stream *s = stream_of(h);
  if (!s) return CUDA_ERROR_INVALID_HANDLE;
  struct fake_work *w = calloc(1, sizeof *w);
  if (!w) return CUDA_ERROR_OUT_OF_MEMORY;
  w->fn = fn;
  w->user = user;
  int took;
  r = cap_or_queue(s, w, "cuLaunchHostFunc", &took);
  if (!r && !took) r = stream_enqueue(s, w);
  if (r) free(w);
  return r;
}

/* Events: cuEventRecord queues a mark on the stream; cuEventQuery is
 * CUDA_SUCCESS once the stream ran past the last record (or when the
 * event was never recorded), CUDA_ERROR_NOT_READY before. */
static CUresult fake_cuEventCreate(void **out, unsigned flags) {
  CUresult r = fake_need_ctx(NULL);
  if (r) return r;
  if (!out || (flags & ~0xfu)) return CUDA_ERROR_INVALID_VALUE;
  struct fake_event *e = calloc(1, sizeof *e);
  if (!e) return CUDA_ERROR_OUT_OF_MEMORY;
  e->magic = FAKE_EVENT_MAGIC;
  e->ctx = fake_cur;
  atomic_store(&e->refs, 1);
  *out = e;
  return CUDA_SUCCESS;
}

static CUresult fake_cuEventRecord(void *h, void *stream) {
  CUresult r = fake_need_ctx(NULL);
  if (r) return r;
  struct fake_event *e = h;
  if (!e || e->magic != FAKE_EVENT_MAGIC) return CUDA_ERROR_INVALID_HANDLE;
  struct fake_stream *s = stream_of(stream);
  if (!s) return CUDA_ERROR_INVALID_HANDLE;
  /* The event and the stream must be of one context (the legacy stream:
   * the current one's), as the driver requires. */
  struct fake_ctx *sc = s >= fake_ctx_null && s < fake_ctx_null + FAKE_MAX_CTX
                            ? &fake_ctxs[s - fake_ctx_null]
                            : s->ctx;
  if (sc != e->ctx) return CUDA_ERROR_INVALID_HANDLE;
  struct fake_work *w = calloc(1, sizeof *w);
  if (!w) return CUDA_ERROR_OUT_OF_MEMORY;
  w->ev = e;
  atomic_fetch_add(&e->refs, 1);
  int took;
  r = cap_or_queue(s, w, "cuEventRecord", &took);
  if (!r && took) {
    pthread_mutex_lock(&fake_mu);
    e->captured = s; /* a node of the graph, not work now */
    pthread_mutex_unlock(&fake_mu);
    return CUDA_SUCCESS;
  }
  if (!r) {
    pthread_mutex_lock(&fake_mu);
    e->captured = NULL;
    pthread_mutex_unlock(&fake_mu);
    w->gen = atomic_fetch_add(&e->recorded, 1) + 1;
    r = stream_enqueue(s, w);
  }
  if (r) {
    atomic_fetch_sub(&e->refs, 1);
    free(w);
  }
  return r;
}

static CUresult fake_cuEventQuery(void *h) {
  CUresult r = fake_need_ctx(NULL);
  if (r) return r;
  struct fake_event *e = h;
  if (!e || e->magic != FAKE_EVENT_MAGIC) return CUDA_ERROR_INVALID_HANDLE;
  /* An event last recorded inside a capture that is still going on may
   * not be queried, whatever the mode; others are potentially unsafe. */
  pthread_mutex_lock(&fake_mu);
  struct fake_stream *cs = e->captured, *x = fake_streams;
  while (cs && x && x != cs) x = x->next;
  int in_capture = cs && x == cs && cs->cap;
  if (in_capture) cap_break(cs, "cuEventQuery of an event recorded in it");
  pthread_mutex_unlock(&fake_mu);
  if (in_capture) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
  if ((r = cap_unsafe("cuEventQuery")) != 0) return r;
  return atomic_load(&e->completed) >= atomic_load(&e->recorded)
             ? CUDA_SUCCESS
             : CUDA_ERROR_NOT_READY;
}

static CUresult fake_cuEventDestroy(void *h) {
  CUresult r = fake_need_ctx(NULL);
  if (r) return r;
  struct fake_event *e = h;
  if (!e || e->magic != FAKE_EVENT_MAGIC) return CUDA_ERROR_INVALID_HANDLE;
  event_unref(e);
  return CUDA_SUCCESS;
}

/* Waits for the current context's streams: its legacy one and those
 * created in it.  Another context's work goes on. */
static CUresult fake_cuCtxSynchronize(void) {
  CUresult r = fake_need_ctx(NULL);
  if (r) return r;
  /* As the real driver in the global capture mode: no synchronising while
   * a stream captures. */
  const char *cap = getenv("FAKECUDA_CAPTURING");
  if (cap && *cap) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
  /* A stream of the context captures: refused in every mode, and every
   * such capture invalidated. */
  int hit = 0;
  pthread_mutex_lock(&fake_mu);
  for (struct fake_stream *s = fake_streams; s; s = s->next)
    if (s->cap) {
      cap_break(s, "cuCtxSynchronize");
      hit = 1;
    }
  pthread_mutex_unlock(&fake_mu);
  if (hit) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
  ctx_sync(fake_cur);
  return CUDA_SUCCESS;
}

/* CUstreamCaptureStatus: 0 none, 1 active. */
static CUresult fake_cuStreamIsCapturing(void *h, int *status) {
  CUresult r = fake_need_ctx(NULL);
  if (r) return r;
  if (!status) return CUDA_ERROR_INVALID_VALUE;
  struct fake_stream *s = stream_of(h);
  if (!s) return CUDA_ERROR_INVALID_HANDLE;
  const char *v = getenv("FAKECUDA_CAPTURING");
  *status = v && (strcmp(v, "all") == 0 ||
                  (strcmp(v, "null") == 0 && is_null_stream(s)));
  pthread_mutex_lock(&fake_mu);
  /* The legacy stream while a blocking stream captures: the driver says
   * CUDA_ERROR_STREAM_CAPTURE_IMPLICIT (using it would join the capture),
   * which callers must read as "capturing". */
  int implicit = is_null_stream(s) && cap_blocking_locked(NULL);
  if (s->cap) *status = s->cap_invalid ? 2 : 1;
  pthread_mutex_unlock(&fake_mu);
  return implicit ? CUDA_ERROR_STREAM_CAPTURE_IMPLICIT : CUDA_SUCCESS;
}

/* --- the API: stream capture and graphs ---------------------------------- */

static CUresult fake_cuThreadExchangeStreamCaptureMode(int *mode) {
  CUresult r = fake_ready();
  if (r) return r;
  if (!mode || *mode < FAKE_CAP_GLOBAL || *mode > FAKE_CAP_RELAXED)
    return CUDA_ERROR_INVALID_VALUE;
  int old = fake_tmode;
  fake_tmode = *mode;
  *mode = old;
  return CUDA_SUCCESS;
}

/* cuStreamBeginCapture_v2: the legacy stream cannot be captured; a
 * stream captures once at a time. */
static CUresult fake_cuStreamBeginCapture(void *h, int mode) {
  CUresult r = fake_need_ctx(NULL);
  if (r) return r;
  if (mode < FAKE_CAP_GLOBAL || mode > FAKE_CAP_RELAXED)
    return CUDA_ERROR_INVALID_VALUE;
  if ((uintptr_t)h <= 1) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
  struct fake_stream *s = stream_of(h);
  if (!s) return CUDA_ERROR_INVALID_HANDLE;
  pthread_mutex_lock(&fake_mu);
  if (s->cap) {
    r = CUDA_ERROR_ILLEGAL_STATE;
  } else {
    s->cap = 1;
    s->cap_mode = mode;
    s->cap_invalid = 0;
    s->cap_thread = pthread_self();
    s->cap_head = s->cap_tail = NULL;
  }
  pthread_mutex_unlock(&fake_mu);
  return r;
}

/* cuStreamBeginCapture (10.0): the global mode. */
static CUresult fake_cuStreamBeginCapture_v1(void *h) {
  return fake_cuStreamBeginCapture(h, FAKE_CAP_GLOBAL);
}

/* Ends s's capture: a graph of what it took, or
 * CUDA_ERROR_STREAM_CAPTURE_INVALIDATED (no graph) when an illegal call
 * broke it.  Only the thread that began a capture that is not relaxed
 * may end it. */
static CUresult fake_cuStreamEndCapture(void *h, void **graph) {
  CUresult r = fake_need_ctx(NULL);
  if (r) return r;
  if (!graph) return CUDA_ERROR_INVALID_VALUE;
  *graph = NULL;
  struct fake_stream *s = stream_of(h);
  if (!s) return CUDA_ERROR_INVALID_HANDLE;
  pthread_mutex_lock(&fake_mu);
  if (!s->cap) {
    pthread_mutex_unlock(&fake_mu);
    return CUDA_ERROR_ILLEGAL_STATE;
  }
  if (s->cap_mode != FAKE_CAP_RELAXED &&
      !pthread_equal(s->cap_thread, pthread_self())) {
    cap_break(s, "cuStreamEndCapture in another thread");
    pthread_mutex_unlock(&fake_mu);
    return CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD;
  }
  struct fake_work *nodes = s->cap_head;
  int bad = s->cap_invalid;
  s->cap = s->cap_invalid = 0;
  s->cap_head = s->cap_tail = NULL;
  pthread_mutex_unlock(&fake_mu);
  if (bad) {
    work_list_free(nodes);
    return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
  }
  struct fake_graph *g = calloc(1, sizeof *g);
  if (!g) {
    work_list_free(nodes);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  g->magic = FAKE_GRAPH_MAGIC;
  g->nodes = nodes;
  *graph = g;
  return CUDA_SUCCESS;
}

static CUresult fake_cuGraphDestroy(void *graph) {
  struct fake_graph *g = graph;
  if (!g || g->magic != FAKE_GRAPH_MAGIC) return CUDA_ERROR_INVALID_VALUE;
  g->magic = 0;
  work_list_free(g->nodes);
  free(g);
  return CUDA_SUCCESS;
}

/* An executable graph: a copy of the graph's nodes. */
static CUresult fake_cuGraphInstantiateWithFlags(void **exec, void *graph,
                                                 unsigned long long flags) {
  CUresult r = fake_need_ctx(NULL);
  if (r) return r;
  struct fake_graph *g = graph;
  if (!exec || !g || g->magic != FAKE_GRAPH_MAGIC || flags != 0)
    return CUDA_ERROR_INVALID_VALUE;
  struct fake_graph *x = calloc(1, sizeof *x);
  if (!x) return CUDA_ERROR_OUT_OF_MEMORY;
  x->magic = FAKE_GRAPH_MAGIC;
  struct fake_work **tail = &x->nodes;
  for (struct fake_work *n = g->nodes; n; n = n->next) {
    struct fake_work *c = malloc(sizeof *c);
    if (!c) {
      fake_cuGraphDestroy(x);
      return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *c = *n;
    c->next = NULL;
    if (c->ev) atomic_fetch_add(&c->ev->refs, 1);
    *tail = c;
    tail = &c->next;
  }
  *exec = x;
  return CUDA_SUCCESS;
}

static CUresult fake_cuGraphExecDestroy(void *exec) {
  return fake_cuGraphDestroy(exec);
}

static CUresult fake_cuEventRecord(void *h, void *stream);
static CUresult fake_cuLaunchHostFunc(void *h, CUhostFn fn, void *user);

/* Replays the graph's work on `stream`, in order: copies (their ranges
 * checked again now: memory unmapped since the capture is misuse, as a
 * fault would be on a GPU), host functions, event records. */
static CUresult fake_cuGraphLaunch(void *exec, void *stream) {
  CUresult r = fake_need_ctx(NULL);
  if (r) return r;
  struct fake_graph *x = exec;
  if (!x || x->magic != FAKE_GRAPH_MAGIC) return CUDA_ERROR_INVALID_VALUE;
  for (struct fake_work *n = x->nodes; n && !r; n = n->next) {
    if (n->ev)
      r = fake_cuEventRecord(n->ev, stream);
    else if (n->fn)
      r = fake_cuLaunchHostFunc(stream, n->fn, n->user);
    else
      r = copy_dtod(n->ddst, n->dsrc, n->n, stream, 1);
  }
  return r;
}

/* --- the API: peers and the CUDA 13 variants ----------------------------- */

/* Any two different visible devices can reach each other, unless
 * $FAKECUDA_NO_PEER=1. */
static CUresult fake_cuDeviceCanAccessPeer(int *can, int d, int peer) {
  CUresult r = fake_device_ok(d);
  if (!r) r = fake_device_ok(peer);
  if (r) return r;
  if (!can) return CUDA_ERROR_INVALID_VALUE;
  *can = d != peer && !fake_env_flag("FAKECUDA_NO_PEER");
  return CUDA_SUCCESS;
}

/* Peer access is recorded per context (the current one may use the
 * peer context's cuMemAlloc memory in kernels).  It grants nothing to
 * memory of the virtual memory API: that takes cuMemSetAccess for each
 * device, here as on a GPU. */
static CUresult fake_peer(void *peer_ctx, unsigned flags, int enable) {
  int dev;
  CUresult r = fake_need_ctx(&dev);
  if (r) return r;
  if (enable && flags != 0) return CUDA_ERROR_INVALID_VALUE;
  struct fake_ctx *p = peer_ctx;
  if (!fake_ctx_valid(p)) return CUDA_ERROR_INVALID_CONTEXT;
  int can = 0;
  if ((r = fake_cuDeviceCanAccessPeer(&can, dev, p->dev)) != 0) return r;
  if (!can) return CUDA_ERROR_PEER_ACCESS_UNSUPPORTED;
  unsigned bit = 1u << p->dev;
  unsigned was = __atomic_fetch_or(&fake_cur->peers, enable ? bit : 0,
                                   __ATOMIC_ACQ_REL);
  if (enable) return was & bit ? CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED : 0;
  if (!(was & bit)) return CUDA_ERROR_PEER_ACCESS_NOT_ENABLED;
  __atomic_fetch_and(&fake_cur->peers, ~bit, __ATOMIC_ACQ_REL);
  return CUDA_SUCCESS;
}

static CUresult fake_cuCtxEnablePeerAccess(void *peer_ctx, unsigned flags) {
  return fake_peer(peer_ctx, flags, 1);
}

static CUresult fake_cuCtxDisablePeerAccess(void *peer_ctx) {
  return fake_peer(peer_ctx, 0, 0);
}

/* cuCtxGetDevice_v2 (13.0): the device of `ctx`, or of the current
 * context when ctx is NULL. */
static CUresult fake_cuCtxGetDevice_v2(int *d, void *ctx) {
  if (ctx == NULL) return fake_cuCtxGetDevice(d);
  CUresult r = fake_ready();
  if (r) return r;
  if (!d) return CUDA_ERROR_INVALID_VALUE;
  if (!fake_ctx_valid(ctx)) return CUDA_ERROR_INVALID_CONTEXT;
  *d = ((struct fake_ctx *)ctx)->dev;
  return CUDA_SUCCESS;
}

/* cuCtxSynchronize_v2 (13.0): waits for `ctx` (NULL: the current one);
 * the work of every context is waited for here, as cuCtxSynchronize
 * does. */
static CUresult fake_cuCtxSynchronize_v2(void *ctx) {
  CUresult r = fake_ready();
  if (r) return r;
  if (ctx != NULL && !fake_ctx_valid(ctx)) return CUDA_ERROR_INVALID_CONTEXT;
  struct fake_ctx *was = fake_cur;
  if (ctx) fake_cur = ctx;
  r = fake_cuCtxSynchronize();
  fake_cur = was;
  return r;
}

/* cuCtxCreate_v3 (11.4, execution affinity) and _v4 (12.5, creation
 * parameters): without those parameters, cuCtxCreate_v2; with them,
 * not modelled. */
static CUresult fake_cuCtxCreate_v3(void **c, void *affinity, int n,
                                    unsigned flags, int d) {
  if (affinity != NULL || n != 0) return CUDA_ERROR_NOT_SUPPORTED;
  return fake_cuCtxCreate(c, flags, d);
}

static CUresult fake_cuCtxCreate_v4(void **c, void *params, unsigned flags,
                                    int d) {
  if (params != NULL) return CUDA_ERROR_NOT_SUPPORTED;
  return fake_cuCtxCreate(c, flags, d);
}

/* --- error strings and the entry-point table ----------------------------- */

static const struct {
  CUresult r;
  const char *name, *text;
} fake_errors[] = {
    {CUDA_SUCCESS, "CUDA_SUCCESS", "no error"},
    {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED",
     "initialization error"},
    {CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE",
     "no CUDA-capable device is detected"},
    {CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE",
     "invalid device ordinal"},
    {CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT",
     "invalid device context"},
    {CUDA_ERROR_OPERATING_SYSTEM, "CUDA_ERROR_OPERATING_SYSTEM",
     "OS call failed or operation not supported on this OS"},
    {CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE",
     "invalid resource handle"},
    {CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {CUDA_ERROR_NOT_READY, "CUDA_ERROR_NOT_READY",
     "device not ready"},
    {CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED",
     "operation not supported"},
    {CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
     "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
     "operation not permitted when stream is capturing"},
    {CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
     "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED",
     "operation failed due to a previous error during capture"},
    {CUDA_ERROR_STREAM_CAPTURE_IMPLICIT, "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT",
     "operation would make the legacy stream depend on a capturing blocking "
     "stream"},
    {CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD,
     "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD",
     "attempt to terminate a thread-local capture sequence from another "
     "thread"},
    {CUDA_ERROR_ILLEGAL_STATE, "CUDA_ERROR_ILLEGAL_STATE",
     "the operation cannot be performed in the present state"},
    {CUDA_ERROR_PEER_ACCESS_UNSUPPORTED, "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED",
     "peer access is not supported between these two devices"},
    {CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED,
     "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED",
     "peer access is already enabled"},
    {CUDA_ERROR_PEER_ACCESS_NOT_ENABLED, "CUDA_ERROR_PEER_ACCESS_NOT_ENABLED",
     "peer access has not been enabled"},
};

static CUresult fake_error_lookup(CUresult r, const char **s, int text) {
  for (size_t i = 0; i < sizeof fake_errors / sizeof fake_errors[0]; i++)
    if (fake_errors[i].r == r) {
      *s = text ? fake_errors[i].text : fake_errors[i].name;
      return CUDA_SUCCESS;
    }
  *s = NULL;
  return CUDA_ERROR_INVALID_VALUE;
}
static CUresult fake_cuGetErrorName(CUresult r, const char **s) {
  return fake_error_lookup(r, s, 0);
}
static CUresult fake_cuGetErrorString(CUresult r, const char **s) {
  return fake_error_lookup(r, s, 1);
}

/* The legacy (pre-3.2) entry points a request below 3020 gets. */
static CUresult fake_legacy(void) { return CUDA_ERROR_NOT_SUPPORTED; }

EXPORT CUresult cuGetProcAddress_v2(const char *sym, void **pfn, int ver,
                                    unsigned long long flags, int *status);
EXPORT CUresult cuGetProcAddress(const char *sym, void **pfn, int ver,
                                 unsigned long long flags);

/* name, the entry point, the version its (12.0) ABI appeared in (0: 12000),
 * and the entry point below that version (NULL: none). */
#define FAKE_FN(name) {#name, (void *)(uintptr_t)fake_##name, 0, NULL}
#define FAKE_FN_SINCE(name, v, old) \
  {#name, (void *)(uintptr_t)fake_##name, v, old}
static const struct {
  const char *name;
  void *fn;
  int since;
  void *older;
} fake_table[] = {
    FAKE_FN_SINCE(cuInit, 2000, NULL),
    FAKE_FN_SINCE(cuDriverGetVersion, 2020, NULL),
    FAKE_FN_SINCE(cuDeviceGetCount, 2000, NULL),
    FAKE_FN_SINCE(cuDeviceGet, 2000, NULL),
    FAKE_FN(cuDeviceGetName),
    FAKE_FN_SINCE(cuDeviceTotalMem, 3020, (void *)(uintptr_t)fake_legacy),
    FAKE_FN(cuDeviceGetUuid),
    FAKE_FN(cuDeviceGetPCIBusId),
    FAKE_FN(cuCtxSynchronize),
    FAKE_FN(cuStreamIsCapturing),
    FAKE_FN(cuDeviceGetAttribute),
    FAKE_FN(cuDevicePrimaryCtxRetain),
    FAKE_FN(cuDevicePrimaryCtxRelease),
    FAKE_FN_SINCE(cuCtxCreate, 3020, NULL),
    FAKE_FN_SINCE(cuCtxDestroy, 4000, NULL),
    FAKE_FN(cuCtxSetCurrent),
    FAKE_FN(cuCtxGetCurrent),
    FAKE_FN(cuCtxGetDevice),
    FAKE_FN_SINCE(cuMemGetInfo, 3020, (void *)(uintptr_t)fake_legacy),
    FAKE_FN_SINCE(cuMemGetAllocationGranularity, 10020, NULL),
    FAKE_FN_SINCE(cuMemCreate, 10020, NULL),
    FAKE_FN_SINCE(cuMemRelease, 10020, NULL),
    FAKE_FN_SINCE(cuMemExportToShareableHandle, 10020, NULL),
    FAKE_FN_SINCE(cuMemImportFromShareableHandle, 10020, NULL),
    FAKE_FN_SINCE(cuMemAddressReserve, 10020, NULL),
    FAKE_FN_SINCE(cuMemAddressFree, 10020, NULL),
    FAKE_FN_SINCE(cuMemMap, 10020, NULL),
    FAKE_FN_SINCE(cuMemUnmap, 10020, NULL),
    FAKE_FN_SINCE(cuMemSetAccess, 10020, NULL),
    FAKE_FN_SINCE(cuMemAlloc, 3020, (void *)(uintptr_t)fake_legacy),
    FAKE_FN_SINCE(cuMemFree, 3020, (void *)(uintptr_t)fake_legacy),
    FAKE_FN_SINCE(cuIpcGetMemHandle, 4010, NULL),
    FAKE_FN(cuMemcpyDtoD),
    FAKE_FN(cuMemcpyDtoDAsync),
    FAKE_FN(cuMemcpyHtoD),
    FAKE_FN(cuMemcpyDtoH),
    FAKE_FN(cuMemsetD8),
    FAKE_FN(cuMemHostAlloc),
    FAKE_FN_SINCE(cuMemAllocHost, 3020, (void *)(uintptr_t)fake_legacy),
    FAKE_FN(cuMemFreeHost),
    FAKE_FN(cuStreamCreate),
    FAKE_FN(cuStreamSynchronize),
    FAKE_FN(cuStreamDestroy),
    FAKE_FN(cuLaunchHostFunc),
    FAKE_FN(cuEventCreate),
    FAKE_FN(cuEventRecord),
    FAKE_FN(cuEventQuery),
    FAKE_FN(cuEventDestroy),
    FAKE_FN(cuGetErrorName),
    FAKE_FN(cuGetErrorString),
    FAKE_FN_SINCE(cuThreadExchangeStreamCaptureMode, 10010, NULL),
    FAKE_FN_SINCE(cuStreamBeginCapture_v1, 10000, NULL),
    FAKE_FN_SINCE(cuStreamEndCapture, 10000, NULL),
    FAKE_FN_SINCE(cuGraphInstantiateWithFlags, 11040, NULL),
    FAKE_FN_SINCE(cuGraphLaunch, 10000, NULL),
    FAKE_FN_SINCE(cuGraphDestroy, 10000, NULL),
    FAKE_FN_SINCE(cuGraphExecDestroy, 10000, NULL),
    FAKE_FN_SINCE(cuDeviceCanAccessPeer, 4000, NULL),
    FAKE_FN_SINCE(cuCtxEnablePeerAccess, 4000, NULL),
    FAKE_FN_SINCE(cuCtxDisablePeerAccess, 4000, NULL),
    {"cuGetProcAddress", (void *)(uintptr_t)cuGetProcAddress_v2, 12000,
     (void *)(uintptr_t)cuGetProcAddress},
};

/* The later ABIs of an entry point, as the real driver hands them out:
 * asked for version `ver`, cuGetProcAddress gives the newest ABI whose
 * version is at most ver (a program built against the 13.0 header asks
 * 13000 and calls cuCtxSynchronize with a context argument).  The table
 * above holds each name's first ABI here. */
static const struct {
  const char *name;
  int since;
  void *fn;
} fake_versions[] = {
    {"cuStreamBeginCapture", 10010, (void *)(uintptr_t)fake_cuStreamBeginCapture},
    {"cuCtxCreate", 11040, (void *)(uintptr_t)fake_cuCtxCreate_v3},
    {"cuCtxCreate", 12050, (void *)(uintptr_t)fake_cuCtxCreate_v4},
    {"cuCtxGetDevice", 13000, (void *)(uintptr_t)fake_cuCtxGetDevice_v2},
    {"cuCtxSynchronize", 13000, (void *)(uintptr_t)fake_cuCtxSynchronize_v2},
};

/* The table's name of `sym` ("cuStreamBeginCapture" is listed by its
 * first ABI's name). */
static int fake_name_is(const char *entry, const char *sym) {
  if (strcmp(entry, sym) == 0) return 1;
  size_t n = strlen(sym);
  return strncmp(entry, sym, n) == 0 && strcmp(entry + n, "_v1") == 0;
}

EXPORT CUresult cuGetProcAddress_v2(const char *sym, void **pfn, int ver,
                                    unsigned long long flags, int *status) {
  (void)flags;
  if (!sym || !pfn) return CUDA_ERROR_INVALID_VALUE;
  *pfn = NULL;
  const char *missing = getenv("FAKECUDA_MISSING");
  if (missing && strcmp(missing, sym) == 0) {
    if (status) *status = 1; /* CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND */
    return CUDA_ERROR_NOT_FOUND;
  }
  for (size_t i = 0; i < sizeof fake_table / sizeof fake_table[0]; i++) {
    if (!fake_name_is(fake_table[i].name, sym)) continue;
    int since = fake_table[i].since ? fake_table[i].since : 12000;
    void *fn = fake_table[i].fn;
    /* cuGetProcAddress (v1) itself appeared in 11.3. */
    int floor = strcmp(sym, "cuGetProcAddress") == 0 ? 11030 : 0;
    if (ver < since) fn = ver >= floor ? fake_table[i].older : NULL;
    if (fn == NULL) {
      if (status) *status = 2; /* CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT */
      return CUDA_ERROR_NOT_FOUND;
    }
    for (size_t v = 0; v < sizeof fake_versions / sizeof fake_versions[0]; v++)
      if (strcmp(fake_versions[v].name, sym) == 0 &&
          ver >= fake_versions[v].since)
        fn = fake_versions[v].fn; /* listed oldest first */
    *pfn = fn;
    if (status) *status = 0;
    return CUDA_SUCCESS;
  }
  if (status) *status = 1;
  if (getenv("FAKECUDA_TRACE_GPA"))
    fprintf(stderr, "FAKECUDA: cuGetProcAddress(%s, %d): not here\n", sym,
            ver);
  return CUDA_ERROR_NOT_FOUND;
}

EXPORT CUresult cuGetProcAddress(const char *sym, void **pfn, int ver,
                                 unsigned long long flags) {
  return cuGetProcAddress_v2(sym, pfn, ver, flags, NULL);
}

/* The versioned names a real libcuda.so.1 exports, for the routed memory
 * entry points (see the top). */
EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t bytes) {
  return fake_cuMemAlloc(p, bytes);
}
EXPORT CUresult cuMemFree_v2(CUdeviceptr p) { return fake_cuMemFree(p); }
EXPORT CUresult cuMemGetInfo_v2(size_t *free_b, size_t *total) {
  return fake_cuMemGetInfo(free_b, total);
}
EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *h, size_t size,
                            const CUmemAllocationProp *prop,
                            unsigned long long flags) {
  return fake_cuMemCreate(h, size, prop, flags);
}
EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle h) {
  return fake_cuMemRelease(h);
}
EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, int d) {
  return fake_cuDeviceTotalMem(bytes, d);
}
EXPORT CUresult cuIpcGetMemHandle(void *handle, CUdeviceptr p) {
  return fake_cuIpcGetMemHandle(handle, p);
}

/* Every other entry point, under the names a real libcuda.so.1 exports
 * them by, so that a program linked with -lcuda (its calls renamed by
 * cuda.h: cuMemcpyHtoD is cuMemcpyHtoD_v2, cuCtxDestroy cuCtxDestroy_v2)
 * loads and runs on the fake.  A name whose first ABI differs from the
 * one implemented here (the 32-bit cuMemAlloc, cuMemGetInfo,
 * cuDeviceTotalMem and copies of CUDA 3.1 and before) is the legacy entry
 * point, which answers CUDA_ERROR_NOT_SUPPORTED.  The per-thread-stream
 * variants (_ptsz, _ptds) are not exported. */
#define FAKE_EXPORT(name, impl) \
  extern __typeof__(impl) name  \
      __attribute__((alias(#impl), visibility("default")))
FAKE_EXPORT(cuInit, fake_cuInit);
FAKE_EXPORT(cuDriverGetVersion, fake_cuDriverGetVersion);
FAKE_EXPORT(cuDeviceGetCount, fake_cuDeviceGetCount);
FAKE_EXPORT(cuDeviceGet, fake_cuDeviceGet);
FAKE_EXPORT(cuDeviceGetName, fake_cuDeviceGetName);
FAKE_EXPORT(cuDeviceTotalMem, fake_legacy);
FAKE_EXPORT(cuDeviceGetUuid, fake_cuDeviceGetUuid);
FAKE_EXPORT(cuDeviceGetUuid_v2, fake_cuDeviceGetUuid);
FAKE_EXPORT(cuDeviceGetPCIBusId, fake_cuDeviceGetPCIBusId);
FAKE_EXPORT(cuDeviceGetAttribute, fake_cuDeviceGetAttribute);
FAKE_EXPORT(cuDeviceCanAccessPeer, fake_cuDeviceCanAccessPeer);
FAKE_EXPORT(cuDevicePrimaryCtxRetain, fake_cuDevicePrimaryCtxRetain);
FAKE_EXPORT(cuDevicePrimaryCtxRelease, fake_cuDevicePrimaryCtxRelease);
FAKE_EXPORT(cuDevicePrimaryCtxRelease_v2, fake_cuDevicePrimaryCtxRelease);
FAKE_EXPORT(cuCtxCreate, fake_cuCtxCreate);
FAKE_EXPORT(cuCtxCreate_v2, fake_cuCtxCreate);
FAKE_EXPORT(cuCtxCreate_v3, fake_cuCtxCreate_v3);
FAKE_EXPORT(cuCtxCreate_v4, fake_cuCtxCreate_v4);
FAKE_EXPORT(cuCtxDestroy, fake_cuCtxDestroy);
FAKE_EXPORT(cuCtxDestroy_v2, fake_cuCtxDestroy);
FAKE_EXPORT(cuCtxSetCurrent, fake_cuCtxSetCurrent);
FAKE_EXPORT(cuCtxGetCurrent, fake_cuCtxGetCurrent);
FAKE_EXPORT(cuCtxGetDevice, fake_cuCtxGetDevice);
FAKE_EXPORT(cuCtxGetDevice_v2, fake_cuCtxGetDevice_v2);
FAKE_EXPORT(cuCtxSynchronize, fake_cuCtxSynchronize);
FAKE_EXPORT(cuCtxSynchronize_v2, fake_cuCtxSynchronize_v2);
FAKE_EXPORT(cuCtxEnablePeerAccess, fake_cuCtxEnablePeerAccess);
FAKE_EXPORT(cuCtxDisablePeerAccess, fake_cuCtxDisablePeerAccess);
FAKE_EXPORT(cuMemGetInfo, fake_legacy);
FAKE_EXPORT(cuMemAlloc, fake_legacy);
FAKE_EXPORT(cuMemFree, fake_legacy);
FAKE_EXPORT(cuMemGetAllocationGranularity,
            fake_cuMemGetAllocationGranularity);
FAKE_EXPORT(cuMemExportToShareableHandle, fake_cuMemExportToShareableHandle);
FAKE_EXPORT(cuMemImportFromShareableHandle,
            fake_cuMemImportFromShareableHandle);
FAKE_EXPORT(cuMemAddressReserve, fake_cuMemAddressReserve);
FAKE_EXPORT(cuMemAddressFree, fake_cuMemAddressFree);
FAKE_EXPORT(cuMemMap, fake_cuMemMap);
FAKE_EXPORT(cuMemUnmap, fake_cuMemUnmap);
FAKE_EXPORT(cuMemSetAccess, fake_cuMemSetAccess);
FAKE_EXPORT(cuMemcpyDtoD, fake_legacy);
FAKE_EXPORT(cuMemcpyDtoD_v2, fake_cuMemcpyDtoD);
FAKE_EXPORT(cuMemcpyDtoDAsync, fake_legacy);
FAKE_EXPORT(cuMemcpyDtoDAsync_v2, fake_cuMemcpyDtoDAsync);
FAKE_EXPORT(cuMemcpyHtoD, fake_legacy);
FAKE_EXPORT(cuMemcpyHtoD_v2, fake_cuMemcpyHtoD);
FAKE_EXPORT(cuMemcpyDtoH, fake_legacy);
FAKE_EXPORT(cuMemcpyDtoH_v2, fake_cuMemcpyDtoH);
FAKE_EXPORT(cuMemsetD8, fake_legacy);
FAKE_EXPORT(cuMemsetD8_v2, fake_cuMemsetD8);
FAKE_EXPORT(cuMemHostAlloc, fake_cuMemHostAlloc);
FAKE_EXPORT(cuMemAllocHost, fake_legacy);
FAKE_EXPORT(cuMemAllocHost_v2, fake_cuMemAllocHost);
FAKE_EXPORT(cuMemFreeHost, fake_cuMemFreeHost);
FAKE_EXPORT(cuStreamCreate, fake_cuStreamCreate);
FAKE_EXPORT(cuStreamSynchronize, fake_cuStreamSynchronize);
FAKE_EXPORT(cuStreamDestroy, fake_cuStreamDestroy);
FAKE_EXPORT(cuStreamDestroy_v2, fake_cuStreamDestroy);
FAKE_EXPORT(cuStreamIsCapturing, fake_cuStreamIsCapturing);
FAKE_EXPORT(cuStreamBeginCapture, fake_cuStreamBeginCapture_v1);
FAKE_EXPORT(cuStreamBeginCapture_v2, fake_cuStreamBeginCapture);
FAKE_EXPORT(cuStreamEndCapture, fake_cuStreamEndCapture);
FAKE_EXPORT(cuThreadExchangeStreamCaptureMode,
            fake_cuThreadExchangeStreamCaptureMode);
FAKE_EXPORT(cuGraphInstantiateWithFlags, fake_cuGraphInstantiateWithFlags);
FAKE_EXPORT(cuGraphLaunch, fake_cuGraphLaunch);
FAKE_EXPORT(cuGraphDestroy, fake_cuGraphDestroy);
FAKE_EXPORT(cuGraphExecDestroy, fake_cuGraphExecDestroy);
FAKE_EXPORT(cuLaunchHostFunc, fake_cuLaunchHostFunc);
FAKE_EXPORT(cuEventCreate, fake_cuEventCreate);
FAKE_EXPORT(cuEventRecord, fake_cuEventRecord);
FAKE_EXPORT(cuEventQuery, fake_cuEventQuery);
FAKE_EXPORT(cuEventDestroy, fake_cuEventDestroy);
FAKE_EXPORT(cuEventDestroy_v2, fake_cuEventDestroy);
FAKE_EXPORT(cuGetErrorName, fake_cuGetErrorName);
FAKE_EXPORT(cuGetErrorString, fake_cuGetErrorString);
