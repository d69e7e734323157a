/*
 * cudrv.c - loads the CUDA driver API at run time (see cudrv.h).
 *
 * One path in: dlopen() the library, find cuGetProcAddress and ask it for
 * every entry point by its base name ("cuMemAlloc") with cudaVersion 12000.
 * The driver then hands back the ABI that a program built against the 12.0
 * header would have called (cuMemAlloc_v2, cuMemGetInfo_v2,
 * cuDevicePrimaryCtxRelease_v2, ...; the VMM entry points have one version), which is the ABI the prototypes in
 * cudrv.h describe.  Looking names up with dlsym() instead would give the
 * oldest ABI (cuMemAlloc with a 32-bit size), so dlsym() is used only for
 * cuGetProcAddress itself.
 *
 * Invariant: after a failed gmb__cudrv_load() the struct is zeroed and the
 * library closed, so callers never see a half-loaded driver; after a
 * successful one every function pointer is non-NULL.
 */
#include "cudrv.h"

#include <dlfcn.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gmb.h"

/* The header version whose ABI cudrv.h describes. */
#define CUDRV_CUDA_VERSION 12000
#define CUDRV_GET_PROC_ADDRESS_DEFAULT 0ULL

/* cuGetProcAddress_v2 (CUDA 12.0+) takes a fifth argument, the query
 * status; the first version (11.3) does not. */
typedef gmb_cu_result (*cudrv_gpa2_fn)(const char *sym, void **pfn, int ver,
                                        unsigned long long flags, int *status);
typedef gmb_cu_result (*cudrv_gpa1_fn)(const char *sym, void **pfn, int ver,
                                        unsigned long long flags);

/* The table of names: base name, where the pointer goes, and the version
 * to ask for when it is not CUDRV_CUDA_VERSION: the driver hands back the
 * newest ABI at or below the version asked, and an entry point whose
 * signature changed after the one cudrv.h declares is asked for at a
 * version where that one is still the newest. */
#define CUDRV_ENTRY(name) {#name, offsetof(struct gmb_cudrv, name), 0}
#define CUDRV_ENTRY_AT(name, ver) {#name, offsetof(struct gmb_cudrv, name), ver}
static const struct {
  const char *name;
  size_t off;
  int ver;
} cudrv_entries[] = {
    CUDRV_ENTRY(cuInit),
    CUDRV_ENTRY(cuDriverGetVersion),
    CUDRV_ENTRY(cuDeviceGetCount),
    CUDRV_ENTRY(cuDeviceGet),
    CUDRV_ENTRY(cuDeviceGetName),
    CUDRV_ENTRY(cuDeviceGetUuid),
    CUDRV_ENTRY(cuDeviceGetPCIBusId),
    CUDRV_ENTRY(cuDevicePrimaryCtxRetain),
    CUDRV_ENTRY(cuDevicePrimaryCtxRelease),
    CUDRV_ENTRY(cuCtxSetCurrent),
    CUDRV_ENTRY(cuCtxGetCurrent),
    CUDRV_ENTRY(cuCtxGetDevice),
    CUDRV_ENTRY(cuCtxSynchronize),
    /* _v3 (11.4) and _v4 (12.5) take other arguments: ask for _v2. */
    CUDRV_ENTRY_AT(cuCtxCreate, 3020),
    CUDRV_ENTRY(cuCtxDestroy),
    CUDRV_ENTRY(cuMemGetInfo),
    CUDRV_ENTRY(cuMemAlloc),
    CUDRV_ENTRY(cuMemFree),
    CUDRV_ENTRY(cuMemcpyDtoD),
    CUDRV_ENTRY(cuMemcpyDtoDAsync),
    CUDRV_ENTRY(cuMemcpyHtoD),
    CUDRV_ENTRY(cuMemcpyDtoH),
    CUDRV_ENTRY(cuMemsetD8),
    CUDRV_ENTRY(cuMemHostAlloc),
    CUDRV_ENTRY(cuMemFreeHost),
    CUDRV_ENTRY(cuStreamCreate),
    CUDRV_ENTRY(cuStreamSynchronize),
    CUDRV_ENTRY(cuStreamDestroy),
    CUDRV_ENTRY(cuStreamIsCapturing),
    CUDRV_ENTRY(cuLaunchHostFunc),
    CUDRV_ENTRY(cuEventCreate),
    CUDRV_ENTRY(cuEventRecord),
    CUDRV_ENTRY(cuEventQuery),
    CUDRV_ENTRY(cuEventDestroy),
    CUDRV_ENTRY(cuDeviceGetAttribute),
    CUDRV_ENTRY(cuMemGetAllocationGranularity),
    CUDRV_ENTRY(cuMemCreate),
    CUDRV_ENTRY(cuMemRelease),
    CUDRV_ENTRY(cuMemExportToShareableHandle),
    CUDRV_ENTRY(cuMemImportFromShareableHandle),
    CUDRV_ENTRY(cuMemAddressReserve),
    CUDRV_ENTRY(cuMemAddressFree),
    CUDRV_ENTRY(cuMemMap),
    CUDRV_ENTRY(cuMemUnmap),
    CUDRV_ENTRY(cuMemSetAccess),
    CUDRV_ENTRY(cuGetErrorName),
    CUDRV_ENTRY(cuGetErrorString),
    CUDRV_ENTRY(cuThreadExchangeStreamCaptureMode),
    CUDRV_ENTRY(cuDeviceCanAccessPeer),
};

static int cudrv_fail(struct gmb_cudrv *d, char *err, size_t errcap,
                      const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static int cudrv_fail(struct gmb_cudrv *d, char *err, size_t errcap,
                      const char *fmt, ...) {
  if (err && errcap) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errcap, fmt, ap);
    va_end(ap);
    /* One line: dlerror() texts do not end in a newline, but be sure. */
    for (char *p = err; *p; p++)
      if (*p == '\n') *p = ' ';
  }
  gmb__cudrv_unload(d);
  return GMB_E_DEVICE;
}

int gmb__cudrv_load(struct gmb_cudrv *d, char *err, size_t errcap) {
  memset(d, 0, sizeof *d);
  if (err && errcap) err[0] = '\0';
  const char *path = getenv("GMB_LIBCUDA");
  if (!path || !*path) path = "libcuda.so.1";
  snprintf(d->path, sizeof d->path, "%s", path);

  dlerror();
  d->lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!d->lib) {
    const char *why = dlerror();
    /* dlerror() usually names the library already ("libcuda.so.1: cannot
     * open shared object file: ..."); say it ourselves when it does not. */
    if (why && strstr(why, path))
      return cudrv_fail(d, err, errcap, "no CUDA driver: %s", why);
    return cudrv_fail(d, err, errcap, "no CUDA driver: %s: %s", path,
                      why ? why : "cannot be loaded");
  }

  cudrv_gpa2_fn gpa2 = (cudrv_gpa2_fn)(uintptr_t)dlsym(d->lib,
                                                       "cuGetProcAddress_v2");
  cudrv_gpa1_fn gpa1 = NULL;
  if (!gpa2)
    gpa1 = (cudrv_gpa1_fn)(uintptr_t)dlsym(d->lib, "cuGetProcAddress");
  if (!gpa2 && !gpa1)
    return cudrv_fail(d, err, errcap,
                      "%s lacks cuGetProcAddress: a CUDA 11.3 or newer "
                      "driver is needed",
                      path);

  for (size_t i = 0; i < sizeof cudrv_entries / sizeof cudrv_entries[0]; i++) {
    void *fn = NULL;
    int status = 0;
    int ver = cudrv_entries[i].ver ? cudrv_entries[i].ver : CUDRV_CUDA_VERSION;
    gmb_cu_result r =
        gpa2 ? gpa2(cudrv_entries[i].name, &fn, ver,
                    CUDRV_GET_PROC_ADDRESS_DEFAULT, &status)
             : gpa1(cudrv_entries[i].name, &fn, ver,
                    CUDRV_GET_PROC_ADDRESS_DEFAULT);
    if (r != GMB_CU_SUCCESS || fn == NULL)
      return cudrv_fail(d, err, errcap, "the driver %s lacks %s (error %d)",
                        path, cudrv_entries[i].name, r);
    memcpy((char *)d + cudrv_entries[i].off, &fn, sizeof fn);
  }

  gmb_cu_result r = d->cuInit(0);
  if (r != GMB_CU_SUCCESS) {
    char why[160];
    gmb__cudrv_strerror(d, r, why, sizeof why);
    return cudrv_fail(d, err, errcap, "cuInit: %s", why);
  }
  if (d->cuDriverGetVersion(&d->version) != GMB_CU_SUCCESS) d->version = 0;
  return 0;
}

void gmb__cudrv_unload(struct gmb_cudrv *d) {
  if (!d) return;
  /* dlclose() only drops a reference: the real driver (and the fake one,
   * linked -z nodelete) stays mapped, so threads it started are safe. */
  if (d->lib) dlclose(d->lib);
  memset(d, 0, sizeof *d);
}

const char *gmb__cudrv_strerror(const struct gmb_cudrv *d, gmb_cu_result r,
                                char *buf, size_t cap) {
  const char *name = NULL, *text = NULL;
  if (d && d->cuGetErrorName && d->cuGetErrorName(r, &name) != GMB_CU_SUCCESS)
    name = NULL;
  if (d && d->cuGetErrorString &&
      d->cuGetErrorString(r, &text) != GMB_CU_SUCCESS)
    text = NULL;
  if (name && text)
    snprintf(buf, cap, "%s: %s", name, text);
  else if (name)
    snprintf(buf, cap, "%s", name);
  else
    snprintf(buf, cap, "CUDA error %d", r);
  return buf;
}

const char *gmb__cudrv_uuid_str(const struct gmb_cu_uuid *u, char *buf,
                                size_t cap) {
  const unsigned char *b = (const unsigned char *)u->bytes;
  snprintf(buf, cap,
           "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-"
           "%02x%02x%02x%02x%02x%02x",
           b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10],
           b[11], b[12], b[13], b[14], b[15]);
  return buf;
}
