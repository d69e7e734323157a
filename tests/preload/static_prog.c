/*
 * static_prog.c - a CUDA program as the static CUDA runtime makes it, for
 * tests/integration/test_preload.c: it links nothing of CUDA and names
 * no CUDA function (nvcc's default, libcudart_static.a, has cudaMalloc
 * inside the program).  It reaches the driver as that runtime does:
 * dlopen of the driver (RTLD_LOCAL), dlsym of cuGetProcAddress_v2 on its
 * handle, then cuGetProcAddress for cuGetProcAddress itself and every
 * other entry point, by base name and version.  It also opens NVML as
 * NVML's Python binding does (dlopen + dlsym on its handle).
 *
 * One command a line on stdin, one answer a line on stdout:
 *   open                     the driver ($STATIC_PROG_LIBCUDA): "RC KIND"
 *                            (KIND of the cuGetProcAddress it then uses)
 *   init N                   cuInit, primary context of ordinal N current
 *   resolve NAME VER FLAGS   cuGetProcAddress_v2 -> "RC STATUS KIND"; the
 *                            function is kept as NAME's for the calls below
 *   resolve1 NAME VER FLAGS  the same through the v1 cuGetProcAddress
 *   rt_entry NAME FLAGS | rt_entry_ver NAME VER FLAGS
 *                            cudaGetDriverEntryPoint(ByVersion) as a
 *                            program built with a dynamic runtime would call
 *                            it (found with RTLD_DEFAULT) -> "RC STATUS KIND"
 *   dlsym NAME               dlsym on the driver's handle -> "KIND"; a
 *                            function found is kept as its base name's
 *   global NAME              the same with RTLD_DEFAULT (the preload's own
 *                            definitions, whatever the driver has)
 *   alloc SLOT SIZE | free SLOT | info        cuMemAlloc / cuMemFree /
 *                            cuMemGetInfo as resolved -> "RC" / "RC FREE TOTAL"
 *   aalloc SLOT SIZE | afree SLOT   cuMemAllocAsync / cuMemFreeAsync on the
 *                            legacy stream, as resolved -> "RC"
 *   total DEV                cuDeviceTotalMem as resolved -> "RC BYTES"
 *   fill SLOT SIZE SEED | check SLOT SIZE SEED  through cuMemcpyHtoD/DtoH
 *   create SLOT SIZE | release SLOT           cuMemCreate (device 0, pinned,
 *                            POSIX fd) / cuMemRelease as resolved -> "RC"
 *   vreserve SIZE            cuMemAddressReserve of the VMM range -> "RC"
 *   vmap PAGE SLOT | vunmap PAGE   map (and make accessible) / unmap a
 *                            created handle at the range's PAGE-th 2 MiB -> "RC"
 *   vfill OFF SIZE SEED | vcheck OFF SIZE SEED  bytes through the range
 *   vfree                    cuMemAddressFree -> "RC"
 *   ipc SLOT                 cuIpcGetMemHandle as resolved -> "RC"
 *   slow MS                  work of MS ms queued on a non-blocking stream
 *                            of the current context (a host function that
 *                            sleeps, then marks itself done) -> "RC"
 *   slowdone                 "1" when that work ran, else "0"
 *   nvml_open                NVML ($STATIC_PROG_NVML) as pynvml opens it
 *   nvml_info IDX | nvml_info2 IDX   nvmlDeviceGetMemoryInfo(_v2) ->
 *                            "RC FREE TOTAL USED"
 *   nvml_info2_v1 IDX        the _v2 call with a struct of version 1 -> "RC"
 * KIND: "gmb:NAME" (a function of libgmb-preload.so, by its name), "drv"
 * (the driver's), "null", or "other".
 */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int (*gpa2_fn)(const char *, void **, int, unsigned long long, int *);
typedef int (*gpa1_fn)(const char *, void **, int, unsigned long long);

#define SLOTS 64
#define PAGE (2u << 20)
#define NAMES 64

static void *drv;        /* the driver's handle */
static gpa2_fn gpa;      /* what cuGetProcAddress("cuGetProcAddress") gave */
static gpa1_fn gpa1;
static unsigned long long slot[SLOTS]; /* device pointers or handles */
static unsigned long long vbase, vsize;
static struct {
  char name[64];
  void *fn;
} kept[NAMES];

static void kind(void *fn, char *out, size_t cap) {
  Dl_info di;
  if (fn == NULL)
    snprintf(out, cap, "null");
  else if (dladdr(fn, &di) && di.dli_fname &&
           strstr(di.dli_fname, "libgmb-preload"))
    snprintf(out, cap, "gmb:%s", di.dli_sname ? di.dli_sname : "?");
  else if (dladdr(fn, &di) && di.dli_fname && strstr(di.dli_fname, "libcuda"))
    snprintf(out, cap, "drv");
  else
    snprintf(out, cap, "other");
}

static void keep(const char *name, void *fn) {
  for (int i = 0; i < NAMES; i++)
    if (kept[i].name[0] == '\0' || strcmp(kept[i].name, name) == 0) {
      snprintf(kept[i].name, sizeof kept[i].name, "%s", name);
      kept[i].fn = fn;
      return;
    }
}

static void *fn_of(const char *name) {
  for (int i = 0; i < NAMES && kept[i].name[0]; i++)
    if (strcmp(kept[i].name, name) == 0) return kept[i].fn;
  /* Not resolved by the test: at the 12.0 ABI, as the runtime would. */
  void *fn = NULL;
  if (gpa) gpa(name, &fn, 12000, 0, NULL);
  return fn;
}

#define CALL(type, name, ...) \
  (fn_of(name) ? ((type)(uintptr_t)fn_of(name))(__VA_ARGS__) : -1)

typedef int (*alloc_fn)(unsigned long long *, size_t);
typedef int (*free_fn)(unsigned long long);
typedef int (*aalloc_fn)(unsigned long long *, size_t, void *);
typedef int (*afree_async_fn)(unsigned long long, void *);
typedef int (*info_fn)(size_t *, size_t *);
typedef int (*htod_fn)(unsigned long long, const void *, size_t);
typedef int (*dtoh_fn)(void *, unsigned long long, size_t);
typedef int (*create_fn)(unsigned long long *, size_t, const void *,
                         unsigned long long);
typedef int (*release_fn)(unsigned long long);
typedef int (*reserve_fn)(unsigned long long *, size_t, size_t,
                          unsigned long long, unsigned long long);
typedef int (*afree_fn)(unsigned long long, size_t);
typedef int (*map_fn)(unsigned long long, size_t, size_t, unsigned long long,
                      unsigned long long);
typedef int (*unmap_fn)(unsigned long long, size_t);
typedef int (*access_fn)(unsigned long long, size_t, const void *, size_t);
typedef int (*ipc_fn)(void *, unsigned long long);

/* The work of "slow": a host function that sleeps, then says it ran. */
static volatile int slow_done;
static void slow_fn(void *arg) {
  struct timespec ts = {0, (long)(uintptr_t)arg * 1000000L};
  nanosleep(&ts, NULL);
  __atomic_store_n(&slow_done, 1, __ATOMIC_RELEASE);
}

static unsigned char byte_at(size_t i, unsigned long seed) {
  uint64_t x = (i + 1) * UINT64_C(0x9E3779B97F4A7C15) ^ seed;
  return (unsigned char)(x >> 29);
}

/* Writes or checks size bytes at device address d: "0", "bad OFF", "RC". */
static void fill_check(unsigned long long d, size_t size, unsigned long seed,
                       int check) {
  unsigned char *buf = malloc(size ? size : 1);
  if (!buf) {
    printf("nomem\n");
    return;
  }
  int rc;
  if (!check) {
    for (size_t i = 0; i < size; i++) buf[i] = byte_at(i, seed);
    rc = CALL(htod_fn, "cuMemcpyHtoD", d, buf, size);
    /* Landed before another process may look (from pageable memory the
     * copy returns before it does). */
    if (rc == 0) rc = CALL(int (*)(void *), "cuStreamSynchronize", NULL);
    printf("%d\n", rc);
  } else {
    rc = CALL(dtoh_fn, "cuMemcpyDtoH", buf, d, size);
    size_t i = 0;
    while (rc == 0 && i < size && buf[i] == byte_at(i, seed)) i++;
    if (rc)
      printf("%d\n", rc);
    else if (i < size)
      printf("bad %zu\n", i);
    else
      printf("0\n");
  }
  free(buf);
}

/* CUmemAllocationProp / CUmemAccessDesc as cuda.h lays them out. */
struct prop {
  int type, handle_types, loc_type, loc_id;
  void *win32;
  unsigned char compression, rdma;
  unsigned short usage;
  unsigned char reserved[4];
};
struct access {
  int loc_type, loc_id, flags;
};

/* NVML, as pynvml uses it. */
static void *nvml;
typedef struct {
  unsigned long long total, free, used;
} nvml_mem;
typedef struct {
  unsigned int version;
  unsigned long long total, reserved, free, used;
} nvml_mem2;

/* v2: 0 nvmlDeviceGetMemoryInfo, 1 its _v2, 2 its _v2 with a struct of
 * another version (NVML refuses it). */
static void nvml_info(unsigned idx, int v2) {
  int (*get)(unsigned, void **) = NULL;
  int (*info)(void *, void *) = NULL;
  if (nvml) {
    *(void **)&get = dlsym(nvml, "nvmlDeviceGetHandleByIndex_v2");
    *(void **)&info = dlsym(nvml, v2 ? "nvmlDeviceGetMemoryInfo_v2"
                                     : "nvmlDeviceGetMemoryInfo");
  }
  void *dev = NULL;
  int rc = get && info ? get(idx, &dev) : -1;
  if (rc) {
    printf("%d\n", rc);
    return;
  }
  if (v2 == 2) {
    nvml_mem2 m = {(unsigned)sizeof(nvml_mem2) | (1u << 24), 0, 0, 0, 0};
    printf("%d\n", info(dev, &m));
  } else if (v2) {
    nvml_mem2 m = {(unsigned)sizeof(nvml_mem2) | (2u << 24),
                   0, 0, 0, 0};
    rc = info(dev, &m);
    printf("%d %llu %llu %llu\n", rc, m.free, m.total, m.used);
  } else {
    nvml_mem m = {0, 0, 0};
    rc = info(dev, &m);
    printf("%d %llu %llu %llu\n", rc, m.free, m.total, m.used);
  }
}

int main(void) {
  char line[256], cmd[32], name[96];
  setvbuf(stdout, NULL, _IOLBF, 0);
  while (fgets(line, sizeof line, stdin)) {
    unsigned long long a = 0, b = 0, c = 0;
    name[0] = '\0';
    if (sscanf(line, "%31s", cmd) != 1) continue;
    char k[96];
    if (!strcmp(cmd, "open")) {
      const char *lib = getenv("STATIC_PROG_LIBCUDA");
      drv = dlopen(lib ? lib : "libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
      gpa2_fn boot = NULL;
      if (drv) *(void **)&boot = dlsym(drv, "cuGetProcAddress_v2");
      int rc = boot ? boot("cuGetProcAddress", (void **)&gpa, 12000, 0, NULL)
                    : -1;
      if (rc == 0) rc = gpa("cuGetProcAddress", (void **)&gpa1, 11030, 0, NULL);
      kind((void *)(uintptr_t)gpa, k, sizeof k);
      printf("%d %s\n", rc, k);
    } else if (!strcmp(cmd, "init")) {
      sscanf(line, "%*s %llu", &a);
      int dev = 0;
      void *ctx = NULL;
      int rc = CALL(int (*)(unsigned), "cuInit", 0);
      if (!rc) rc = CALL(int (*)(int *, int), "cuDeviceGet", &dev, (int)a);
      if (!rc)
        rc = CALL(int (*)(void **, int), "cuDevicePrimaryCtxRetain", &ctx, dev);
      if (!rc) rc = CALL(int (*)(void *), "cuCtxSetCurrent", ctx);
      printf("%d\n", rc);
    } else if (!strcmp(cmd, "resolve") || !strcmp(cmd, "resolve1")) {
      sscanf(line, "%*s %95s %llu %llu", name, &a, &b);
      void *fn = (void *)1;
      int st = -1, rc;
      if (cmd[7] == '1') {
        rc = gpa1 ? gpa1(name, &fn, (int)a, b) : -1;
        st = 0;
      } else {
        rc = gpa ? gpa(name, &fn, (int)a, b, &st) : -1;
      }
      keep(name, fn);
      kind(fn, k, sizeof k);
      printf("%d %d %s\n", rc, st, k);
    } else if (!strcmp(cmd, "rt_entry") || !strcmp(cmd, "rt_entry_ver")) {
      int ver = !strcmp(cmd, "rt_entry_ver");
      if (ver)
        sscanf(line, "%*s %95s %llu %llu", name, &a, &b);
      else
        sscanf(line, "%*s %95s %llu", name, &b);
      void *fn = (void *)1;
      int st = -1, rc = -1;
      void *rt = dlsym(RTLD_DEFAULT, ver ? "cudaGetDriverEntryPointByVersion"
                                         : "cudaGetDriverEntryPoint");
      if (rt && ver)
        rc = ((int (*)(const char *, void **, unsigned, unsigned long long,
                       int *))(uintptr_t)rt)(name, &fn, (unsigned)a, b, &st);
      else if (rt)
        rc = ((int (*)(const char *, void **, unsigned long long,
                       int *))(uintptr_t)rt)(name, &fn, b, &st);
      keep(name, fn);
      kind(fn, k, sizeof k);
      printf("%d %d %s\n", rc, st, k);
    } else if (!strcmp(cmd, "dlsym") || !strcmp(cmd, "global")) {
      sscanf(line, "%*s %95s", name);
      void *fn = cmd[0] == 'g' ? dlsym(RTLD_DEFAULT, name)
                 : drv        ? dlsym(drv, name)
                              : NULL;
      kind(fn, k, sizeof k);
      /* Kept under its base name ("cuMemAlloc" for cuMemAlloc_v2). */
      char *v = strstr(name, "_v2");
      if (v && v[3] == '\0') *v = '\0';
      if (fn) keep(name, fn);
      printf("%s\n", k);
    } else if (!strcmp(cmd, "alloc")) {
      sscanf(line, "%*s %llu %llu", &a, &b);
      printf("%d\n", CALL(alloc_fn, "cuMemAlloc", &slot[a % SLOTS], (size_t)b));
    } else if (!strcmp(cmd, "free")) {
      sscanf(line, "%*s %llu", &a);
      printf("%d\n", CALL(free_fn, "cuMemFree", slot[a % SLOTS]));
    } else if (!strcmp(cmd, "aalloc")) {
      sscanf(line, "%*s %llu %llu", &a, &b);
      printf("%d\n", CALL(aalloc_fn, "cuMemAllocAsync", &slot[a % SLOTS],
                          (size_t)b, NULL));
    } else if (!strcmp(cmd, "afree")) {
      sscanf(line, "%*s %llu", &a);
      printf("%d\n", CALL(afree_async_fn, "cuMemFreeAsync", slot[a % SLOTS],
                          NULL));
    } else if (!strcmp(cmd, "slow")) {
      sscanf(line, "%*s %llu", &a);
      void *st = NULL;
      __atomic_store_n(&slow_done, 0, __ATOMIC_RELEASE);
      int rc = CALL(int (*)(void **, unsigned), "cuStreamCreate", &st, 1u);
      if (!rc)
        rc = CALL(int (*)(void *, void (*)(void *), void *), "cuLaunchHostFunc",
                  st, slow_fn, (void *)(uintptr_t)(a < 999 ? a : 999));
      printf("%d\n", rc);
    } else if (!strcmp(cmd, "slowdone")) {
      printf("%d\n", __atomic_load_n(&slow_done, __ATOMIC_ACQUIRE));
    } else if (!strcmp(cmd, "info")) {
      size_t fr = 1, tot = 1;
      int rc = CALL(info_fn, "cuMemGetInfo", &fr, &tot);
      printf("%d %zu %zu\n", rc, fr, tot);
    } else if (!strcmp(cmd, "total")) {
      sscanf(line, "%*s %llu", &a);
      size_t tot = 1;
      int rc = CALL(int (*)(size_t *, int), "cuDeviceTotalMem", &tot, (int)a);
      printf("%d %zu\n", rc, tot);
    } else if (!strcmp(cmd, "fill") || !strcmp(cmd, "check")) {
      sscanf(line, "%*s %llu %llu %llu", &a, &b, &c);
      fill_check(slot[a % SLOTS], (size_t)b, (unsigned long)c,
                 cmd[0] == 'c');
    } else if (!strcmp(cmd, "create")) {
      sscanf(line, "%*s %llu %llu", &a, &b);
      struct prop p = {1, 1, 1, 0, NULL, 0, 0, 0, {0}};
      printf("%d\n", CALL(create_fn, "cuMemCreate", &slot[a % SLOTS],
                          (size_t)b, &p, 0));
    } else if (!strcmp(cmd, "release")) {
      sscanf(line, "%*s %llu", &a);
      printf("%d\n", CALL(release_fn, "cuMemRelease", slot[a % SLOTS]));
    } else if (!strcmp(cmd, "vreserve")) {
      sscanf(line, "%*s %llu", &a);
      vsize = a;
      printf("%d\n", CALL(reserve_fn, "cuMemAddressReserve", &vbase,
                          (size_t)a, PAGE, 0, 0));
    } else if (!strcmp(cmd, "vmap")) {
      sscanf(line, "%*s %llu %llu", &a, &b);
      unsigned long long at = vbase + a * PAGE;
      int rc = CALL(map_fn, "cuMemMap", at, PAGE, 0, slot[b % SLOTS], 0);
      struct access ac = {1, 0, 3};
      if (!rc) rc = CALL(access_fn, "cuMemSetAccess", at, PAGE, &ac, 1);
      printf("%d\n", rc);
    } else if (!strcmp(cmd, "vunmap")) {
      sscanf(line, "%*s %llu", &a);
      printf("%d\n", CALL(unmap_fn, "cuMemUnmap", vbase + a * PAGE, PAGE));
    } else if (!strcmp(cmd, "vfill") || !strcmp(cmd, "vcheck")) {
      sscanf(line, "%*s %llu %llu %llu", &a, &b, &c);
      fill_check(vbase + a, (size_t)b, (unsigned long)c, cmd[1] == 'c');
    } else if (!strcmp(cmd, "vfree")) {
      printf("%d\n", CALL(afree_fn, "cuMemAddressFree", vbase, (size_t)vsize));
    } else if (!strcmp(cmd, "ipc")) {
      sscanf(line, "%*s %llu", &a);
      unsigned char h[64];
      printf("%d\n", CALL(ipc_fn, "cuIpcGetMemHandle", h, slot[a % SLOTS]));
    } else if (!strcmp(cmd, "nvml_open")) {
      const char *lib = getenv("STATIC_PROG_NVML");
      nvml = dlopen(lib ? lib : "libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
      int (*init)(void) = NULL;
      if (nvml) *(void **)&init = dlsym(nvml, "nvmlInit_v2");
      printf("%d\n", init ? init() : -1);
    } else if (!strcmp(cmd, "nvml_info") || !strcmp(cmd, "nvml_info2") ||
               !strcmp(cmd, "nvml_info2_v1")) {
      sscanf(line, "%*s %llu", &a);
      nvml_info((unsigned)a, cmd[9] != '2' ? 0 : cmd[10] == '_' ? 2 : 1);
    } else {
      printf("unknown %s\n", cmd);
    }
  }
  return 0;
}
