/*
 * fakecuda.c - a TEST DOUBLE of the CUDA driver (libcuda.so.1), not a
 * product.  It lets gmb's cuda device and its CUDA client path run, across
 * processes, on machines without a GPU.  Built into
 * build/fakecuda/libcuda.so.1 (mk/cuda.mk) and loaded through
 * $GMB_LIBCUDA.
 *
 * What it models, and how:
 * - Device memory is POSIX shared memory.  cuMemAlloc creates an object
 *   /fakecuda-<pid>-<n> of one header page plus the size, and maps it; the
 *   "device pointer" is the host address of the data in this process, so a
 *   test may read and write device memory with plain loads and stores.
 * - cuIpcGetMemHandle writes the object's name and size into the 64 bytes;
 *   cuIpcOpenMemHandle maps it in the opening process and, like the real
 *   driver, refuses to open one handle twice in one process
 *   (CUDA_ERROR_ALREADY_MAPPED) or to open the process's own allocation.
 * - Misuse the design guards against is caught loudly: freeing an
 *   allocation that another living process still has open is undefined
 *   behaviour with the real driver.  The header page keeps the pids that
 *   have the allocation open; cuMemFree prints
 *   "FAKECUDA: freed while still open in pid N" on stderr, appends the line
 *   to $FAKECUDA_LOG when set, and makes the process exit with status 86 at
 *   exit.  A pid that is gone (or a zombie) no longer holds it: a dead
 *   process's mappings die with it, as with the real driver.
 * - cuMemcpyDtoD/DtoDAsync are memcpy over ranges that must lie inside one
 *   known allocation or import each, and must not overlap
 *   (CUDA_ERROR_INVALID_VALUE): the real driver does not promise memmove.
 * - Async work (cuMemcpyDtoDAsync, cuLaunchHostFunc) runs later, in order,
 *   on one helper thread; cuStreamSynchronize and the synchronous copies
 *   wait for it.  Streams are otherwise dummies (one queue for all).
 * - cuMemGetInfo reports $FAKECUDA_TOTAL (default 1GiB, suffixes k/m/g)
 *   minus what this process allocated.  $FAKECUDA_DEVICES (default 1) is
 *   the device count; 0 makes cuInit fail with CUDA_ERROR_NO_DEVICE.
 *   $FAKECUDA_MISSING names one entry point cuGetProcAddress pretends not
 *   to have (tests of the loader's error path).
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef void (*CUhostFn)(void *);
typedef struct {
  char reserved[64];
} CUipcMemHandle;

enum {
  CUDA_SUCCESS = 0,
  CUDA_ERROR_INVALID_VALUE = 1,
  CUDA_ERROR_OUT_OF_MEMORY = 2,
  CUDA_ERROR_NOT_INITIALIZED = 3,
  CUDA_ERROR_NO_DEVICE = 100,
  CUDA_ERROR_INVALID_DEVICE = 101,
  CUDA_ERROR_ALREADY_MAPPED = 208,
  CUDA_ERROR_INVALID_HANDLE = 400,
  CUDA_ERROR_NOT_FOUND = 500,
};

#define FAKE_HDR 4096u
#define FAKE_OPENERS 64
#define FAKE_MAX 8192
#define FAKE_EXIT_BAD 86
#define FAKE_MAGIC 0x4b41464544554341ULL /* "ACUDEFAK" */

struct fake_hdr {
  uint64_t magic;
  uint64_t size;
  int32_t owner;
  int32_t openers[FAKE_OPENERS]; /* pids that have it open; 0: free slot */
};

struct fake_map {
  int used;
  int imported;      /* 1: cuIpcOpenMemHandle, 0: cuMemAlloc */
  char *base;        /* the mapping, header first */
  uint64_t size;     /* data bytes */
  char name[48];
};

static pthread_mutex_t fake_mu = PTHREAD_MUTEX_INITIALIZER;
static struct fake_map fake_maps[FAKE_MAX];
static uint64_t fake_allocated;
static unsigned long fake_seq;
static int fake_inited;
static int fake_bad;
static void *fake_ctx_current;

/* --- the async queue -------------------------------------------------- */

struct fake_work {
  CUhostFn fn; /* NULL: a copy */
  void *user;
  void *dst;
  const void *src;
  size_t n;
  struct fake_work *next;
};

static pthread_mutex_t fake_qmu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t fake_qcv = PTHREAD_COND_INITIALIZER;
static struct fake_work *fake_qhead, *fake_qtail;
static int fake_qbusy;
static int fake_qthread; /* started in this process */

static void *fake_worker(void *arg) {
  (void)arg;
  pthread_mutex_lock(&fake_qmu);
  for (;;) {
    while (!fake_qhead) pthread_cond_wait(&fake_qcv, &fake_qmu);
    struct fake_work *w = fake_qhead;
    fake_qhead = w->next;
    if (!fake_qhead) fake_qtail = NULL;
    fake_qbusy = 1;
    pthread_mutex_unlock(&fake_qmu);
    if (w->fn)
      w->fn(w->user);
    else
      memcpy(w->dst, w->src, w->n);
    free(w);
    pthread_mutex_lock(&fake_qmu);
    fake_qbusy = 0;
    pthread_cond_broadcast(&fake_qcv);
  }
  return NULL;
}

/* A forked child has no worker and must not inherit a held lock.  It also
 * forgets its parent's allocations and imports (their pages stay mapped but
 * are not its own): the real driver cannot be used across fork() at all, so
 * a child that uses the fake starts afresh, like a new process. */
static void fake_atfork_child(void) {
  memset(fake_maps, 0, sizeof fake_maps);
  fake_allocated = 0;
  pthread_mutex_init(&fake_qmu, NULL);
  pthread_cond_init(&fake_qcv, NULL);
  pthread_mutex_init(&fake_mu, NULL);
  fake_qhead = fake_qtail = NULL;
  fake_qbusy = 0;
  fake_qthread = 0;
}

static CUresult fake_enqueue(struct fake_work *w) {
  pthread_mutex_lock(&fake_qmu);
  if (!fake_qthread) {
    pthread_t t;
    pthread_attr_t a;
    pthread_attr_init(&a);
    pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
    if (pthread_create(&t, &a, fake_worker, NULL) != 0) {
      pthread_attr_destroy(&a);
      pthread_mutex_unlock(&fake_qmu);
      free(w);
      return CUDA_ERROR_OUT_OF_MEMORY;
    }
    pthread_attr_destroy(&a);
    fake_qthread = 1;
  }
  w->next = NULL;
  if (fake_qtail)
    fake_qtail->next = w;
  else
    fake_qhead = w;
  fake_qtail = w;
  pthread_cond_broadcast(&fake_qcv);
  pthread_mutex_unlock(&fake_qmu);
  return CUDA_SUCCESS;
}

static void fake_drain(void) {
  pthread_mutex_lock(&fake_qmu);
  while (fake_qhead || fake_qbusy) pthread_cond_wait(&fake_qcv, &fake_qmu);
  pthread_mutex_unlock(&fake_qmu);
}

/* --- helpers ---------------------------------------------------------- */

static void fake_exit_check(void) {
  if (fake_bad) {
    fflush(stderr);
    _exit(FAKE_EXIT_BAD);
  }
}

static void fake_report(const char *fmt, long a, const char *name) {
  char line[256];
  snprintf(line, sizeof line, fmt, a, name);
  fprintf(stderr, "%s\n", line);
  const char *log = getenv("FAKECUDA_LOG");
  if (log && *log) {
    FILE *f = fopen(log, "a");
    if (f) {
      fprintf(f, "%s (in pid %ld)\n", line, (long)getpid());
      fclose(f);
    }
  }
}

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

/* 1 when pid is alive and not a zombie. */
static int fake_pid_alive(int pid) {
  if (kill(pid, 0) != 0 && errno == ESRCH) return 0;
  char path[64], buf[256];
  snprintf(path, sizeof path, "/proc/%d/stat", pid);
  FILE *f = fopen(path, "r");
  if (!f) return 0;
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[n] = '\0';
  const char *p = strrchr(buf, ')');
  return !(p && p[1] == ' ' && (p[2] == 'Z' || p[2] == 'X'));
}

/* The map holding [p, p+n) in this process; NULL when none does.  Called
 * with fake_mu held. */
static struct fake_map *fake_find(uintptr_t p, size_t n) {
  for (int i = 0; i < FAKE_MAX; i++) {
    struct fake_map *m = &fake_maps[i];
    if (!m->used) continue;
    uintptr_t lo = (uintptr_t)m->base + FAKE_HDR;
    if (p >= lo && p - lo <= m->size && n <= m->size - (p - lo)) return m;
  }
  return NULL;
}

static struct fake_map *fake_slot(void) {
  for (int i = 0; i < FAKE_MAX; i++)
    if (!fake_maps[i].used) return &fake_maps[i];
  return NULL;
}

static int fake_valid(CUdeviceptr p, size_t n) {
  pthread_mutex_lock(&fake_mu);
  int ok = fake_find((uintptr_t)p, n) != NULL;
  pthread_mutex_unlock(&fake_mu);
  return ok;
}

/* --- the API ---------------------------------------------------------- */

static CUresult fake_cuInit(unsigned flags) {
  if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
  if (fake_env_size("FAKECUDA_DEVICES", 1) == 0) return CUDA_ERROR_NO_DEVICE;
  fake_inited = 1;
  return CUDA_SUCCESS;
}

static CUresult fake_cuDriverGetVersion(int *v) {
  *v = 12000;
  return CUDA_SUCCESS;
}

static CUresult fake_cuDeviceGetCount(int *n) {
  if (!fake_inited) return CUDA_ERROR_NOT_INITIALIZED;
  *n = (int)fake_env_size("FAKECUDA_DEVICES", 1);
  return CUDA_SUCCESS;
}

static CUresult fake_cuDeviceGet(int *d, int ordinal) {
  int n;
  CUresult r = fake_cuDeviceGetCount(&n);
  if (r) return r;
  if (ordinal < 0 || ordinal >= n) return CUDA_ERROR_INVALID_DEVICE;
  *d = ordinal;
  return CUDA_SUCCESS;
}

static CUresult fake_cuDeviceGetName(char *name, int len, int d) {
  if (len <= 0) return CUDA_ERROR_INVALID_VALUE;
  snprintf(name, (size_t)len, "fakecuda %d", d);
  return CUDA_SUCCESS;
}

static char fake_ctx_obj;
static CUresult fake_cuDevicePrimaryCtxRetain(void **c, int d) {
  (void)d;
  if (!fake_inited) return CUDA_ERROR_NOT_INITIALIZED;
  *c = &fake_ctx_obj;
  return CUDA_SUCCESS;
}
static CUresult fake_cuDevicePrimaryCtxRelease(int d) {
  (void)d;
  return CUDA_SUCCESS;
}
static CUresult fake_cuCtxSetCurrent(void *c) {
  fake_ctx_current = c;
  return CUDA_SUCCESS;
}
static CUresult fake_cuCtxGetCurrent(void **c) {
  *c = fake_ctx_current;
  return CUDA_SUCCESS;
}

static CUresult fake_cuMemGetInfo(size_t *free_b, size_t *total) {
  uint64_t t = fake_env_size("FAKECUDA_TOTAL", UINT64_C(1) << 30);
  pthread_mutex_lock(&fake_mu);
  uint64_t a = fake_allocated;
  pthread_mutex_unlock(&fake_mu);
  *total = (size_t)t;
  *free_b = (size_t)(t > a ? t - a : 0);
  return CUDA_SUCCESS;
}

static CUresult fake_cuMemAlloc(CUdeviceptr *p, size_t bytes) {
  if (!fake_inited) return CUDA_ERROR_NOT_INITIALIZED;
  if (bytes == 0) return CUDA_ERROR_INVALID_VALUE;
  uint64_t t = fake_env_size("FAKECUDA_TOTAL", UINT64_C(1) << 30);
  pthread_mutex_lock(&fake_mu);
  struct fake_map *m = fake_slot();
  if (!m || fake_allocated + bytes > t) {
    pthread_mutex_unlock(&fake_mu);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  snprintf(m->name, sizeof m->name, "/fakecuda-%ld-%lu", (long)getpid(),
           ++fake_seq);
  int fd = shm_open(m->name, O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) {
    pthread_mutex_unlock(&fake_mu);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  void *b = MAP_FAILED;
  if (ftruncate(fd, (off_t)(FAKE_HDR + bytes)) == 0)
    b = mmap(NULL, FAKE_HDR + bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd,
             0);
  close(fd);
  if (b == MAP_FAILED) {
    shm_unlink(m->name);
    pthread_mutex_unlock(&fake_mu);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  struct fake_hdr *h = b;
  h->magic = FAKE_MAGIC;
  h->size = bytes;
  h->owner = (int32_t)getpid();
  m->used = 1;
  m->imported = 0;
  m->base = b;
  m->size = bytes;
  fake_allocated += bytes;
  *p = (CUdeviceptr)(uintptr_t)(m->base + FAKE_HDR);
  pthread_mutex_unlock(&fake_mu);
  return CUDA_SUCCESS;
}

static CUresult fake_cuMemFree(CUdeviceptr p) {
  fake_drain();
  pthread_mutex_lock(&fake_mu);
  struct fake_map *m = fake_find((uintptr_t)p, 0);
  if (!m || m->imported || (uintptr_t)p != (uintptr_t)m->base + FAKE_HDR) {
    pthread_mutex_unlock(&fake_mu);
    return CUDA_ERROR_INVALID_VALUE;
  }
  struct fake_hdr *h = (struct fake_hdr *)m->base;
  for (int i = 0; i < FAKE_OPENERS; i++) {
    int pid = __atomic_load_n(&h->openers[i], __ATOMIC_SEQ_CST);
    if (pid && fake_pid_alive(pid)) {
      fake_report("FAKECUDA: freed while still open in pid %ld (%s)", pid,
                  m->name);
      fake_bad = 1;
    }
  }
  shm_unlink(m->name);
  munmap(m->base, FAKE_HDR + m->size);
  fake_allocated -= m->size;
  memset(m, 0, sizeof *m);
  pthread_mutex_unlock(&fake_mu);
  return CUDA_SUCCESS;
}

static CUresult fake_cuIpcGetMemHandle(CUipcMemHandle *hd, CUdeviceptr p) {
  pthread_mutex_lock(&fake_mu);
  struct fake_map *m = fake_find((uintptr_t)p, 0);
  if (!m || m->imported || (uintptr_t)p != (uintptr_t)m->base + FAKE_HDR) {
    pthread_mutex_unlock(&fake_mu);
    return CUDA_ERROR_INVALID_VALUE;
  }
  memset(hd, 0, sizeof *hd);
  memcpy(hd->reserved, m->name, strlen(m->name));
  memcpy(hd->reserved + 48, &m->size, sizeof m->size);
  pthread_mutex_unlock(&fake_mu);
  return CUDA_SUCCESS;
}

static CUresult fake_cuIpcOpenMemHandle(CUdeviceptr *p, CUipcMemHandle hd,
                                        unsigned flags) {
  (void)flags;
  if (!fake_inited) return CUDA_ERROR_NOT_INITIALIZED;
  char name[48];
  memcpy(name, hd.reserved, sizeof name);
  name[sizeof name - 1] = '\0';
  uint64_t size;
  memcpy(&size, hd.reserved + 48, sizeof size);
  if (strncmp(name, "/fakecuda-", 10) != 0) return CUDA_ERROR_INVALID_HANDLE;
  pthread_mutex_lock(&fake_mu);
  for (int i = 0; i < FAKE_MAX; i++)
    if (fake_maps[i].used && strcmp(fake_maps[i].name, name) == 0) {
      pthread_mutex_unlock(&fake_mu);
      return CUDA_ERROR_ALREADY_MAPPED;
    }
  struct fake_map *m = fake_slot();
  if (!m) {
    pthread_mutex_unlock(&fake_mu);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  int fd = shm_open(name, O_RDWR, 0);
  if (fd < 0) {
    pthread_mutex_unlock(&fake_mu);
    return CUDA_ERROR_INVALID_HANDLE; /* freed already, or never existed */
  }
  void *b = mmap(NULL, FAKE_HDR + size, PROT_READ | PROT_WRITE, MAP_SHARED,
                 fd, 0);
  close(fd);
  if (b == MAP_FAILED) {
    pthread_mutex_unlock(&fake_mu);
    return CUDA_ERROR_INVALID_HANDLE;
  }
  struct fake_hdr *h = b;
  int slot = -1;
  for (int i = 0; i < FAKE_OPENERS && slot < 0; i++) {
    int32_t zero = 0;
    if (__atomic_compare_exchange_n(&h->openers[i], &zero,
                                    (int32_t)getpid(), 0, __ATOMIC_SEQ_CST,
                                    __ATOMIC_SEQ_CST))
      slot = i;
  }
  if (h->magic != FAKE_MAGIC || h->size != size || slot < 0) {
    if (slot >= 0) __atomic_store_n(&h->openers[slot], 0, __ATOMIC_SEQ_CST);
    munmap(b, FAKE_HDR + size);
    pthread_mutex_unlock(&fake_mu);
    return slot < 0 ? CUDA_ERROR_OUT_OF_MEMORY : CUDA_ERROR_INVALID_HANDLE;
  }
  m->used = 1;
  m->imported = 1;
  m->base = b;
  m->size = size;
  snprintf(m->name, sizeof m->name, "%s", name);
  *p = (CUdeviceptr)(uintptr_t)(m->base + FAKE_HDR);
  pthread_mutex_unlock(&fake_mu);
  return CUDA_SUCCESS;
}

static CUresult fake_cuIpcCloseMemHandle(CUdeviceptr p) {
  fake_drain();
  pthread_mutex_lock(&fake_mu);
  struct fake_map *m = fake_find((uintptr_t)p, 0);
  if (!m || !m->imported || (uintptr_t)p != (uintptr_t)m->base + FAKE_HDR) {
    pthread_mutex_unlock(&fake_mu);
    return CUDA_ERROR_INVALID_VALUE;
  }
  struct fake_hdr *h = (struct fake_hdr *)m->base;
  int32_t me = (int32_t)getpid();
  for (int i = 0; i < FAKE_OPENERS; i++) {
    int32_t want = me;
    if (__atomic_compare_exchange_n(&h->openers[i], &want, 0, 0,
                                    __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
      break;
  }
  munmap(m->base, FAKE_HDR + m->size);
  memset(m, 0, sizeof *m);
  pthread_mutex_unlock(&fake_mu);
  return CUDA_SUCCESS;
}

static int fake_overlap(CUdeviceptr a, CUdeviceptr b, size_t n) {
  return a < b + n && b < a + n;
}

static CUresult fake_cuMemcpyDtoD(CUdeviceptr dst, CUdeviceptr src, size_t n) {
  if (n == 0) return CUDA_SUCCESS;
  if (!fake_valid(dst, n) || !fake_valid(src, n) || fake_overlap(dst, src, n))
    return CUDA_ERROR_INVALID_VALUE;
  fake_drain();
  memcpy((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n);
  return CUDA_SUCCESS;
}

static CUresult fake_cuMemcpyDtoDAsync(CUdeviceptr dst, CUdeviceptr src,
                                       size_t n, void *stream) {
  (void)stream;
  if (n == 0) return CUDA_SUCCESS;
  if (!fake_valid(dst, n) || !fake_valid(src, n) || fake_overlap(dst, src, n))
    return CUDA_ERROR_INVALID_VALUE;
  struct fake_work *w = calloc(1, sizeof *w);
  if (!w) return CUDA_ERROR_OUT_OF_MEMORY;
  w->dst = (void *)(uintptr_t)dst;
  w->src = (const void *)(uintptr_t)src;
  w->n = n;
  return fake_enqueue(w);
}

static CUresult fake_cuMemcpyHtoD(CUdeviceptr dst, const void *src, size_t n) {
  if (n == 0) return CUDA_SUCCESS;
  if (!fake_valid(dst, n)) return CUDA_ERROR_INVALID_VALUE;
  fake_drain();
  memcpy((void *)(uintptr_t)dst, src, n);
  return CUDA_SUCCESS;
}

static CUresult fake_cuMemcpyDtoH(void *dst, CUdeviceptr src, size_t n) {
  if (n == 0) return CUDA_SUCCESS;
  if (!fake_valid(src, n)) return CUDA_ERROR_INVALID_VALUE;
  fake_drain();
  memcpy(dst, (const void *)(uintptr_t)src, n);
  return CUDA_SUCCESS;
}

static char fake_stream_obj;
static CUresult fake_cuStreamCreate(void **s, unsigned flags) {
  (void)flags;
  *s = &fake_stream_obj;
  return CUDA_SUCCESS;
}
static CUresult fake_cuStreamSynchronize(void *s) {
  (void)s;
  fake_drain();
  return CUDA_SUCCESS;
}
static CUresult fake_cuStreamDestroy(void *s) {
  (void)s;
  fake_drain();
  return CUDA_SUCCESS;
}

static CUresult fake_cuLaunchHostFunc(void *s, CUhostFn fn, void *user) {
  (void)s;
  if (!fn) return CUDA_ERROR_INVALID_VALUE;
  struct fake_work *w = calloc(1, sizeof *w);
  if (!w) return CUDA_ERROR_OUT_OF_MEMORY;
  w->fn = fn;
  w->user = user;
  return fake_enqueue(w);
}

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
    {CUDA_ERROR_ALREADY_MAPPED, "CUDA_ERROR_ALREADY_MAPPED",
     "resource already mapped"},
    {CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE",
     "invalid resource handle"},
    {CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
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

#define FAKE_FN(name) {#name, (void *)(uintptr_t)fake_##name}
static const struct {
  const char *name;
  void *fn;
} fake_table[] = {
    FAKE_FN(cuInit),
    FAKE_FN(cuDriverGetVersion),
    FAKE_FN(cuDeviceGetCount),
    FAKE_FN(cuDeviceGet),
    FAKE_FN(cuDeviceGetName),
    FAKE_FN(cuDevicePrimaryCtxRetain),
    FAKE_FN(cuDevicePrimaryCtxRelease),
    FAKE_FN(cuCtxSetCurrent),
    FAKE_FN(cuCtxGetCurrent),
    FAKE_FN(cuMemGetInfo),
    FAKE_FN(cuMemAlloc),
    FAKE_FN(cuMemFree),
    FAKE_FN(cuMemcpyDtoD),
    FAKE_FN(cuMemcpyDtoDAsync),
    FAKE_FN(cuMemcpyHtoD),
    FAKE_FN(cuMemcpyDtoH),
    FAKE_FN(cuStreamCreate),
    FAKE_FN(cuStreamSynchronize),
    FAKE_FN(cuStreamDestroy),
    FAKE_FN(cuLaunchHostFunc),
    FAKE_FN(cuIpcGetMemHandle),
    FAKE_FN(cuIpcOpenMemHandle),
    FAKE_FN(cuIpcCloseMemHandle),
    FAKE_FN(cuGetErrorName),
    FAKE_FN(cuGetErrorString),
};

EXPORT CUresult cuGetProcAddress_v2(const char *sym, void **pfn, int ver,
                                    unsigned long long flags, int *status) {
  (void)flags;
  *pfn = NULL;
  const char *missing = getenv("FAKECUDA_MISSING");
  /* Only the 12.0 ABI is modelled: an older request would expect other
   * prototypes (cuMemAlloc with a 32-bit size). */
  if (ver < 12000 || (missing && strcmp(missing, sym) == 0)) {
    if (status) *status = 1; /* CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND */
    return CUDA_ERROR_NOT_FOUND;
  }
  for (size_t i = 0; i < sizeof fake_table / sizeof fake_table[0]; i++)
    if (strcmp(fake_table[i].name, sym) == 0) {
      *pfn = fake_table[i].fn;
      if (status) *status = 0;
      return CUDA_SUCCESS;
    }
  if (status) *status = 1;
  return CUDA_ERROR_NOT_FOUND;
}

EXPORT CUresult cuGetProcAddress(const char *sym, void **pfn, int ver,
                                 unsigned long long flags) {
  return cuGetProcAddress_v2(sym, pfn, ver, flags, NULL);
}

__attribute__((constructor)) static void fake_load(void) {
  pthread_atfork(NULL, NULL, fake_atfork_child);
  atexit(fake_exit_check);
}
