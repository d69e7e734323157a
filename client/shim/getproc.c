/*
 * getproc.c - the ways a program reaches the driver without linking it,
 * and how libgmb-preload.so stays in the path: cuGetProcAddress /
 * cuGetProcAddress_v2 (how the static CUDA runtime, which nvcc links by
 * default, and libraries such as PyTorch find every driver entry point),
 * cudaGetDriverEntryPoint / cudaGetDriverEntryPointByVersion (and their
 * _ptsz forms: the runtime's way to the same), and dlsym on a handle of
 * libcuda or libnvidia-ml (how the runtimes, static and shared, find
 * cuGetProcAddress in the first place, and how NVML's Python binding
 * finds NVML's functions: LD_PRELOAD does not reach a lookup on a
 * library's own handle).
 *
 * The rule, the same on every path: the driver is asked first, and its
 * answer is replaced only when it is the very function gmb wraps.  For
 * each routed entry point the driver's function at a reference version
 * (one whose ABI gmb's wrapper has: cuMemAlloc at 3.2 is cuMemAlloc_v2)
 * is looked up once, for the legacy and the per-thread default stream;
 * an answer equal to it becomes gmb's wrapper, whatever version or flags
 * the caller asked with.  Anything else goes back untouched: a symbol gmb
 * does not route, a version whose answer is another ABI (cuMemAlloc below
 * 3.2, or a _v3 a later driver may add), a failure (with the driver's
 * code, status and NULL).  So a caller never gets a NULL the driver would
 * not have given, nor a wrapper of another ABI.
 *
 * dlsym: only lookups on a library's handle are looked at (RTLD_DEFAULT
 * already finds this library's definitions first, and RTLD_NEXT is passed
 * on untouched: on x86-64 by a jump, so that glibc still sees the
 * caller's return address and "next" means next after the caller), only
 * for the names of the table below, only when that library defines the
 * name, and never for this library's own lookups (its client library
 * loads the driver through dlsym too and must get the real one).
 */
#include <dlfcn.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "preload.h"

typedef CUresult (*gp_gpa2_fn)(const char *sym, void **pfn, int ver,
                               unsigned long long flags, int *status);
typedef CUresult (*gp_gpa1_fn)(const char *sym, void **pfn, int ver,
                               unsigned long long flags);

#define GP_LEGACY_STREAM 1ULL     /* CU_GET_PROC_ADDRESS_LEGACY_STREAM */
#define GP_PER_THREAD_STREAM 2ULL /* CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM */

GMB_SHIM_API CUresult cuGetProcAddress(const char *sym, void **pfn, int ver,
                                       unsigned long long flags);
GMB_SHIM_API CUresult cuGetProcAddress_v2(const char *sym, void **pfn,
                                          int ver, unsigned long long flags,
                                          int *status);
GMB_SHIM_API cudaError_t cudaGetDriverEntryPoint(const char *sym, void **fn,
                                                 unsigned long long flags,
                                                 int *status);
GMB_SHIM_API cudaError_t cudaGetDriverEntryPoint_ptsz(
    const char *sym, void **fn, unsigned long long flags, int *status);
GMB_SHIM_API cudaError_t cudaGetDriverEntryPointByVersion(
    const char *sym, void **fn, unsigned int ver, unsigned long long flags,
    int *status);
GMB_SHIM_API cudaError_t cudaGetDriverEntryPointByVersion_ptsz(
    const char *sym, void **fn, unsigned int ver, unsigned long long flags,
    int *status);

static int gp_from_us(const void *addr);

/* --- the table of routed driver entry points ------------------------------ */

#define GP_FN(f) ((void *)(uintptr_t)(f))

/*
 * One ABI of one entry point: the base name cuGetProcAddress takes, a
 * version whose answer is that ABI, gmb's wrapper for the legacy and the
 * per-thread default stream, and the names a real libcuda exports them
 * by (for dlsym).  `drv` is its pre_drv slot, or -1 (cuGetProcAddress
 * itself).  `ref` caches the driver's functions at `version`, [0] legacy,
 * [1] per-thread; `tried` says they were looked up.
 */
struct gp_entry {
  const char *name;
  int version;
  int drv;
  void *mine[2];
  const char *exported[2];
  _Atomic(void *) ref[2];
  atomic_int tried;
};

static struct gp_entry gp_table[] = {
    {"cuGetProcAddress", 11030, -1,
     {GP_FN(cuGetProcAddress), GP_FN(cuGetProcAddress)},
     {"cuGetProcAddress", NULL}, {NULL, NULL}, 0},
    {"cuGetProcAddress", 12000, -1,
     {GP_FN(cuGetProcAddress_v2), GP_FN(cuGetProcAddress_v2)},
     {"cuGetProcAddress_v2", NULL}, {NULL, NULL}, 0},
    {"cuMemAlloc", 3020, PRE_DRV_MEM_ALLOC,
     {GP_FN(cuMemAlloc_v2), GP_FN(cuMemAlloc_v2)},
     {"cuMemAlloc_v2", NULL}, {NULL, NULL}, 0},
    {"cuMemFree", 3020, PRE_DRV_MEM_FREE,
     {GP_FN(cuMemFree_v2), GP_FN(cuMemFree_v2)},
     {"cuMemFree_v2", NULL}, {NULL, NULL}, 0},
    {"cuMemGetInfo", 3020, PRE_DRV_MEM_GET_INFO,
     {GP_FN(cuMemGetInfo_v2), GP_FN(cuMemGetInfo_v2)},
     {"cuMemGetInfo_v2", NULL}, {NULL, NULL}, 0},
    {"cuDeviceTotalMem", 3020, PRE_DRV_DEVICE_TOTAL_MEM,
     {GP_FN(cuDeviceTotalMem_v2), GP_FN(cuDeviceTotalMem_v2)},
     {"cuDeviceTotalMem_v2", NULL}, {NULL, NULL}, 0},
    {"cuMemAllocAsync", 11020, PRE_DRV_MEM_ALLOC_ASYNC,
     {GP_FN(cuMemAllocAsync), GP_FN(cuMemAllocAsync_ptsz)},
     {"cuMemAllocAsync", "cuMemAllocAsync_ptsz"}, {NULL, NULL}, 0},
    {"cuMemFreeAsync", 11020, PRE_DRV_MEM_FREE_ASYNC,
     {GP_FN(cuMemFreeAsync), GP_FN(cuMemFreeAsync_ptsz)},
     {"cuMemFreeAsync", "cuMemFreeAsync_ptsz"}, {NULL, NULL}, 0},
    {"cuMemCreate", 10020, PRE_DRV_MEM_CREATE,
     {GP_FN(cuMemCreate), GP_FN(cuMemCreate)},
     {"cuMemCreate", NULL}, {NULL, NULL}, 0},
    {"cuMemRelease", 10020, PRE_DRV_MEM_RELEASE,
     {GP_FN(cuMemRelease), GP_FN(cuMemRelease)},
     {"cuMemRelease", NULL}, {NULL, NULL}, 0},
    {"cuIpcGetMemHandle", 4010, PRE_DRV_IPC_GET_MEM_HANDLE,
     {GP_FN(cuIpcGetMemHandle), GP_FN(cuIpcGetMemHandle)},
     {"cuIpcGetMemHandle", NULL}, {NULL, NULL}, 0},
};
#define GP_ENTRIES (sizeof gp_table / sizeof gp_table[0])

/* Names dlsym hands this library's function for, beside the table's
 * exported names: NVML's, which its Python binding looks up on the
 * library's handle.  The runtime's are not among them: a program linked
 * against cudart reaches them through LD_PRELOAD, and one that opens
 * cudart itself and looks them up on its handle is left alone (its
 * driver calls still come through cuGetProcAddress). */
static const char *const gp_other_names[] = {
    "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetMemoryInfo_v2",
};
#define GP_OTHERS (sizeof gp_other_names / sizeof gp_other_names[0])
/* What the library behind a handle defined for each of them, when a
 * lookup on its handle was answered with this library's function: the
 * real one, for pass-through (NVML is loaded RTLD_LOCAL by ctypes). */
static _Atomic(void *) gp_other_real[GP_OTHERS];
/* And the handle it was looked up on, for its neighbours (NVML's
 * nvmlDeviceGetUUID, which gmb needs and the program never asked for). */
static _Atomic(void *) gp_other_handle[GP_OTHERS];

/* --- the real dlsym and the real cuGetProcAddress -------------------------- */

typedef void *(*gp_dlsym_fn)(void *handle, const char *name);

/* glibc's dlsym (what RTLD_NEXT gives from here); read by the x86-64
 * entry below without a lock, set once. */
__attribute__((visibility("hidden"))) void *gmb__gp_next_dlsym;

__attribute__((no_sanitize("address", "undefined")))
static gp_dlsym_fn gp_real_dlsym(void) {
  void *f = __atomic_load_n(&gmb__gp_next_dlsym, __ATOMIC_ACQUIRE);
  if (f == NULL) {
    /* dlsym's default version on x86-64 since glibc 2.34, then the
     * first one of each architecture. */
    static const char *const vers[] = {"GLIBC_2.34", "GLIBC_2.2.5",
                                       "GLIBC_2.17", "GLIBC_2.0"};
    for (size_t i = 0; f == NULL && i < sizeof vers / sizeof vers[0]; i++)
      f = dlvsym(RTLD_NEXT, "dlsym", vers[i]);
    __atomic_store_n(&gmb__gp_next_dlsym, f, __ATOMIC_RELEASE);
  }
  return (gp_dlsym_fn)(uintptr_t)f;
}

/* The driver's cuGetProcAddress_v2 / cuGetProcAddress, as seen through a
 * dlsym of a driver handle, after this library, or in the driver this
 * process already loaded. */
static _Atomic(void *) gp_drv_gpa2, gp_drv_gpa1;

static void gp_find_driver(void) {
  if (atomic_load(&gp_drv_gpa2) || atomic_load(&gp_drv_gpa1)) return;
  gp_dlsym_fn real = gp_real_dlsym();
  if (real == NULL) return;
  void *g2 = real(RTLD_NEXT, "cuGetProcAddress_v2");
  void *g1 = real(RTLD_NEXT, "cuGetProcAddress");
  if (g2 == NULL && g1 == NULL) {
    /* Loaded RTLD_LOCAL (the runtime does): find it without loading it. */
    const char *path = getenv("GMB_LIBCUDA");
    void *h = dlopen(path && *path ? path : "libcuda.so.1",
                     RTLD_NOW | RTLD_NOLOAD | RTLD_LOCAL);
    if (h) {
      g2 = real(h, "cuGetProcAddress_v2");
      g1 = real(h, "cuGetProcAddress");
      dlclose(h);
    }
  }
  void *none = NULL;
  if (g2) atomic_compare_exchange_strong(&gp_drv_gpa2, &none, g2);
  none = NULL;
  if (g1) atomic_compare_exchange_strong(&gp_drv_gpa1, &none, g1);
}

/* Asks the driver (never this library) for sym: its CUresult. */
static CUresult gp_ask_driver(const char *sym, void **pfn, int ver,
                              unsigned long long flags, int *status) {
  gp_find_driver();
  gp_gpa2_fn g2 = (gp_gpa2_fn)(uintptr_t)atomic_load(&gp_drv_gpa2);
  gp_gpa1_fn g1 = (gp_gpa1_fn)(uintptr_t)atomic_load(&gp_drv_gpa1);
  if (g2) return g2(sym, pfn, ver, flags, status);
  if (g1) {
    /* The first cuGetProcAddress has no status: a failure is "not
     * found", the one it can tell. */
    CUresult r = g1(sym, pfn, ver, flags);
    if (status) *status = r == 0 ? 0 : 1;
    return r;
  }
  if (pfn) *pfn = NULL;
  if (status) *status = 1; /* CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND */
  return PRE_CUDA_NOT_FOUND;
}

/* The driver's functions for entry e at its reference version, looked up
 * once (again while the driver was not found). */
static void gp_refs(struct gp_entry *e) {
  if (atomic_load_explicit(&e->tried, memory_order_acquire)) return;
  gp_find_driver();
  if (!atomic_load(&gp_drv_gpa2) && !atomic_load(&gp_drv_gpa1)) return;
  static const unsigned long long flags[2] = {GP_LEGACY_STREAM,
                                              GP_PER_THREAD_STREAM};
  for (int k = 0; k < 2; k++) {
    void *fn = NULL;
    int st = 0;
    if (gp_ask_driver(e->name, &fn, e->version, flags[k], &st) == 0 && fn)
      atomic_store(&e->ref[k], fn);
  }
  atomic_store_explicit(&e->tried, 1, memory_order_release);
}

/* gmb's function for the driver's answer fn to a request of sym, or NULL
 * when fn is not a function gmb wraps. */
static void *gp_mine(const char *sym, void *fn) {
  if (sym == NULL || fn == NULL) return NULL;
  for (size_t i = 0; i < GP_ENTRIES; i++) {
    struct gp_entry *e = &gp_table[i];
    if (strcmp(e->name, sym) != 0) continue;
    gp_refs(e);
    for (int k = 0; k < 2; k++)
      if (fn == atomic_load(&e->ref[k])) return e->mine[k];
  }
  return NULL;
}

void *gmb__pre_drv_real(enum pre_drv which) {
  for (size_t i = 0; i < GP_ENTRIES; i++) {
    struct gp_entry *e = &gp_table[i];
    if (e->drv != (int)which &&
        !(e->drv == PRE_DRV_MEM_ALLOC_ASYNC &&
          which == PRE_DRV_MEM_ALLOC_ASYNC_PTSZ) &&
        !(e->drv == PRE_DRV_MEM_FREE_ASYNC &&
          which == PRE_DRV_MEM_FREE_ASYNC_PTSZ))
      continue;
    int k = which == PRE_DRV_MEM_ALLOC_ASYNC_PTSZ ||
            which == PRE_DRV_MEM_FREE_ASYNC_PTSZ;
    gp_dlsym_fn real = gp_real_dlsym();
    void *fn = real ? real(RTLD_NEXT, e->exported[k]) : NULL;
    if (fn == NULL) {
      gp_refs(e);
      fn = atomic_load(&e->ref[k]);
    }
    /* Never one of ours: a caller would loop. */
    return fn == e->mine[0] || fn == e->mine[1] ? NULL : fn;
  }
  return NULL;
}

void *gmb__pre_drv_lookup(const char *name, int version) {
  void *fn = NULL;
  int st = 0;
  if (gp_ask_driver(name, &fn, version, GP_LEGACY_STREAM, &st) != 0) return NULL;
  /* Never one of ours: a caller would loop. */
  return fn && !gp_from_us(fn) ? fn : NULL;
}

/* --- cuGetProcAddress ------------------------------------------------------- */

/* With GMB_PRELOAD_VERBOSE=1, one line per replaced answer: which
 * lookups of a program gmb answered (the static runtime asks once per
 * entry point and stream kind). */
static void gp_say(const char *door, const char *sym, int ver,
                   unsigned long long flags, void *mine) {
  if (!gmb__shim_env_flag("GMB_PRELOAD_VERBOSE")) return;
  Dl_info di;
  const char *name = dladdr(mine, &di) && di.dli_sname ? di.dli_sname : "?";
  fprintf(stderr, "gmb-preload: %s(%s, %d, %llu): gmb's %s\n", door, sym,
          ver, flags, name);
}

/* Replaces *pfn, the driver's answer for sym, with gmb's function when it
 * is one gmb wraps. */
static void gp_replace(const char *door, const char *sym, int ver,
                       unsigned long long flags, void **pfn) {
  void *mine = gp_mine(sym, *pfn);
  if (mine == NULL) return;
  *pfn = mine;
  gp_say(door, sym, ver, flags, mine);
}

CUresult cuGetProcAddress_v2(const char *sym, void **pfn, int ver,
                             unsigned long long flags, int *status) {
  CUresult r = gp_ask_driver(sym, pfn, ver, flags, status);
  if (r == 0 && pfn) gp_replace("cuGetProcAddress_v2", sym, ver, flags, pfn);
  return r;
}

CUresult cuGetProcAddress(const char *sym, void **pfn, int ver,
                          unsigned long long flags) {
  gp_find_driver();
  CUresult r;
  gp_gpa1_fn g1 = (gp_gpa1_fn)(uintptr_t)atomic_load(&gp_drv_gpa1);
  if (g1)
    r = g1(sym, pfn, ver, flags);
  else
    r = gp_ask_driver(sym, pfn, ver, flags, NULL);
  if (r == 0 && pfn) gp_replace("cuGetProcAddress", sym, ver, flags, pfn);
  return r;
}

/* --- the runtime's cudaGetDriverEntryPoint* ------------------------------------ */

typedef cudaError_t (*gp_rt_fn)(const char *, void **, unsigned long long,
                                int *);
typedef cudaError_t (*gp_rt_ver_fn)(const char *, void **, unsigned int,
                                    unsigned long long, int *);

/* Without a runtime after this library (a test, or a program that
 * defines the call itself): the driver's answer, at `ver`, as the
 * runtime would give it. */
static cudaError_t gp_rt_emulate(const char *sym, void **fn, int ver,
                                 unsigned long long flags, int *status) {
  if (sym == NULL || fn == NULL) return PRE_CUDA_INVALID_VALUE;
  CUresult r = cuGetProcAddress_v2(sym, fn, ver, flags, status);
  /* CUDA_ERROR_NOT_FOUND is cudaErrorSymbolNotFound (500) too. */
  return r;
}

static cudaError_t gp_rt(const char *name, int ptsz, const char *sym,
                         void **fn, int has_ver, unsigned int ver,
                         unsigned long long flags, int *status) {
  gp_dlsym_fn real = gp_real_dlsym();
  void *next = real ? real(RTLD_NEXT, name) : NULL;
  cudaError_t r;
  if (next && has_ver)
    r = ((gp_rt_ver_fn)(uintptr_t)next)(sym, fn, ver, flags, status);
  else if (next)
    r = ((gp_rt_fn)(uintptr_t)next)(sym, fn, flags, status);
  else
    /* The runtime asks at its own version; 12.0 is the ABI gmb knows.
     * A _ptsz call's default flags mean the per-thread stream. */
    r = gp_rt_emulate(sym, fn, has_ver ? (int)ver : 12000,
                      ptsz && flags == 0 ? GP_PER_THREAD_STREAM : flags,
                      status);
  if (r == 0 && fn) gp_replace(name, sym, has_ver ? (int)ver : 0, flags, fn);
  return r;
}

cudaError_t cudaGetDriverEntryPoint(const char *sym, void **fn,
                                    unsigned long long flags, int *status) {
  return gp_rt("cudaGetDriverEntryPoint", 0, sym, fn, 0, 0, flags, status);
}

cudaError_t cudaGetDriverEntryPoint_ptsz(const char *sym, void **fn,
                                         unsigned long long flags,
                                         int *status) {
  return gp_rt("cudaGetDriverEntryPoint_ptsz", 1, sym, fn, 0, 0, flags,
               status);
}

cudaError_t cudaGetDriverEntryPointByVersion(const char *sym, void **fn,
                                             unsigned int ver,
                                             unsigned long long flags,
                                             int *status) {
  return gp_rt("cudaGetDriverEntryPointByVersion", 0, sym, fn, 1, ver, flags,
               status);
}

cudaError_t cudaGetDriverEntryPointByVersion_ptsz(const char *sym, void **fn,
                                                  unsigned int ver,
                                                  unsigned long long flags,
                                                  int *status) {
  return gp_rt("cudaGetDriverEntryPointByVersion_ptsz", 1, sym, fn, 1, ver,
               flags, status);
}

/* --- dlsym ------------------------------------------------------------------------ */

/* 1 when addr lies in this library. */
static int gp_from_us(const void *addr) {
  static void *self_base;
  Dl_info me, them;
  if (self_base == NULL) {
    if (dladdr(GP_FN(gp_from_us), &me) == 0) return 0;
    self_base = me.dli_fbase;
  }
  return dladdr(addr, &them) != 0 && them.dli_fbase == self_base;
}

/* This library's function of that name when dlsym should give it
 * instead of `found` (what the library behind the handle defines). */
static void *gp_dlsym_mine(void *handle, const char *name, void *found) {
  for (size_t i = 0; i < GP_ENTRIES; i++) {
    struct gp_entry *e = &gp_table[i];
    for (int k = 0; k < 2; k++) {
      if (e->exported[k] == NULL || strcmp(e->exported[k], name) != 0)
        continue;
      if (e->drv < 0) {
        /* The driver's cuGetProcAddress: remember it, it is how every
         * other lookup reaches the driver. */
        void *none = NULL;
        atomic_compare_exchange_strong(k == 0 && e->version >= 12000
                                           ? &gp_drv_gpa2
                                           : &gp_drv_gpa1,
                                       &none, found);
      }
      return found == e->mine[k] ? NULL : e->mine[k];
    }
  }
  for (size_t i = 0; i < GP_OTHERS; i++)
    if (strcmp(gp_other_names[i], name) == 0) {
      gp_dlsym_fn real = gp_real_dlsym();
      /* This library's definition: the first in the global scope. */
      void *mine = real ? real(RTLD_DEFAULT, name) : NULL;
      if (!mine || mine == found || !gp_from_us(mine)) return NULL;
      void *none = NULL;
      atomic_compare_exchange_strong(&gp_other_real[i], &none, found);
      atomic_store(&gp_other_handle[i], handle);
      return mine;
    }
  return NULL;
}

void *gmb__pre_named_real(const char *name) {
  gp_dlsym_fn real = gp_real_dlsym();
  void *fn = real ? real(RTLD_NEXT, name) : NULL;
  if (fn) return fn;
  for (size_t i = 0; i < GP_OTHERS; i++)
    if (strcmp(gp_other_names[i], name) == 0)
      return atomic_load(&gp_other_real[i]);
  return NULL;
}

void *gmb__pre_sibling_real(const char *known, const char *name) {
  gp_dlsym_fn real = gp_real_dlsym();
  if (real == NULL) return NULL;
  void *fn = real(RTLD_NEXT, name);
  if (fn) return fn;
  for (size_t i = 0; i < GP_OTHERS; i++) {
    if (strcmp(gp_other_names[i], known) != 0) continue;
    void *h = atomic_load(&gp_other_handle[i]);
    return h ? real(h, name) : NULL;
  }
  return NULL;
}

/* dlsym as `caller` asked it. */
__attribute__((no_sanitize("address", "undefined")))
static void *gp_dlsym_from(void *handle, const char *name, void *caller) {
  gp_dlsym_fn real = gp_real_dlsym();
  if (real == NULL) return NULL;
  void *found = real(handle, name);
  if (found == NULL || name == NULL || handle == RTLD_NEXT ||
      handle == RTLD_DEFAULT)
    return found;
  /* The name first (a few string compares): most lookups are not ours,
   * and telling the caller's library costs a walk of the loaded ones. */
  void *mine = gp_dlsym_mine(handle, name, found);
  if (mine == NULL || gp_from_us(caller)) return found;
  return mine;
}

__attribute__((visibility("hidden"), no_sanitize("address", "undefined")))
void *gmb__gp_dlsym(void *handle, const char *name);

__attribute__((no_sanitize("address", "undefined")))
void *gmb__gp_dlsym(void *handle, const char *name) {
  /* Reached by a jump from dlsym (x86-64): the return address is the
   * program's. */
  return gp_dlsym_from(handle, name, __builtin_return_address(0));
}

#if defined(__x86_64__)
/* dlsym(RTLD_NEXT, ...) must reach glibc with the caller's return address
 * (it finds "next" from it): jumped to, not called.  Every other handle
 * goes to gmb__gp_dlsym, also by a jump. */
__asm__(".text\n"
        ".globl dlsym\n"
        ".type dlsym, @function\n"
        "dlsym:\n"
        "  endbr64\n"
        "  cmpq $-1, %rdi\n"
        "  jne 1f\n"
        "  movq gmb__gp_next_dlsym(%rip), %rax\n"
        "  testq %rax, %rax\n"
        "  jz 1f\n"
        "  jmp *%rax\n"
        "1:\n"
        "  jmp gmb__gp_dlsym\n"
        ".size dlsym, .-dlsym\n");
#else
/* Elsewhere a call: RTLD_NEXT then means "next after libgmb-preload.so",
 * which differs only for a library preloaded after it that looks its
 * own definitions' next up. */
GMB_SHIM_API void *dlsym(void *handle, const char *name);
void *dlsym(void *handle, const char *name) {
  return gp_dlsym_from(handle, name, __builtin_return_address(0));
}
#endif

/* Early, so that RTLD_NEXT takes the jump from the first lookup of the
 * program on. */
__attribute__((constructor)) static void gp_init(void) { gp_real_dlsym(); }
