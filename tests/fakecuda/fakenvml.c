/*
 * fakenvml.c - a TEST DOUBLE of NVML (libnvidia-ml.so.1), not a product:
 * what tests need to see libgmb-preload.so's NVML figures replace the
 * device's.  Built into build/fakecuda/libnvidia-ml.so.1 (mk/cuda.mk).
 *
 * Devices are those of the fake CUDA driver (tests/fakecuda/fakecuda.c):
 * $FAKECUDA_DEVICES of them (default 1), index i being physical device i
 * (NVML does not renumber with CUDA_VISIBLE_DEVICES), with the driver's
 * UUIDs (GPU-46414b45-4355-4441-0000-00000000000i).  Memory figures are
 * fixed, so a test can tell whose answer it got: total FAKENVML_TOTAL
 * (80 GiB), free FAKENVML_FREE (60 GiB), reserved 1 GiB in the _v2 form.
 * A call before nvmlInit is NVML_ERROR_UNINITIALIZED; nvmlMemory_v2_t of
 * another version is NVML_ERROR_ARGUMENT_VERSION_MISMATCH, as in NVML.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define API __attribute__((visibility("default")))

#define FAKENVML_TOTAL (80ULL << 30)
#define FAKENVML_FREE (60ULL << 30)
#define FAKENVML_RESERVED (1ULL << 30)

enum {
  NVML_SUCCESS = 0,
  NVML_ERROR_UNINITIALIZED = 1,
  NVML_ERROR_INVALID_ARGUMENT = 2,
  NVML_ERROR_INSUFFICIENT_SIZE = 7,
  NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25,
};

typedef struct {
  unsigned long long total, free, used;
} nvmlMemory_t;
typedef struct {
  unsigned int version;
  unsigned long long total, reserved, free, used;
} nvmlMemory_v2_t;
#define NVML_MEMORY_V2 ((unsigned)sizeof(nvmlMemory_v2_t) | (2u << 24))

struct fake_dev {
  int index;
};
static struct fake_dev fake_devs[8] = {{0}, {1}, {2}, {3},
                                       {4}, {5}, {6}, {7}};
static int fake_inited;

static int fake_count(void) {
  const char *s = getenv("FAKECUDA_DEVICES");
  int n = s ? atoi(s) : 1;
  return n < 0 ? 0 : n > 8 ? 8 : n;
}

static int fake_dev_ok(const struct fake_dev *d) {
  return d >= fake_devs && d < fake_devs + fake_count();
}

API int nvmlInit_v2(void) {
  fake_inited = 1;
  return NVML_SUCCESS;
}
API int nvmlShutdown(void) {
  fake_inited = 0;
  return NVML_SUCCESS;
}
API int nvmlDeviceGetCount_v2(unsigned int *n) {
  if (!fake_inited) return NVML_ERROR_UNINITIALIZED;
  if (!n) return NVML_ERROR_INVALID_ARGUMENT;
  *n = (unsigned)fake_count();
  return NVML_SUCCESS;
}
API int nvmlDeviceGetHandleByIndex_v2(unsigned int i, struct fake_dev **d) {
  if (!fake_inited) return NVML_ERROR_UNINITIALIZED;
  if (!d || i >= (unsigned)fake_count()) return NVML_ERROR_INVALID_ARGUMENT;
  *d = &fake_devs[i];
  return NVML_SUCCESS;
}
API int nvmlDeviceGetUUID(struct fake_dev *d, char *uuid, unsigned int len) {
  if (!fake_inited) return NVML_ERROR_UNINITIALIZED;
  if (!fake_dev_ok(d) || !uuid) return NVML_ERROR_INVALID_ARGUMENT;
  int n = snprintf(uuid, len, "GPU-46414b45-4355-4441-0000-%012x",
                   d->index);
  return n < 0 || (unsigned)n >= len ? NVML_ERROR_INSUFFICIENT_SIZE
                                     : NVML_SUCCESS;
}
API int nvmlDeviceGetMemoryInfo(struct fake_dev *d, nvmlMemory_t *m) {
  if (!fake_inited) return NVML_ERROR_UNINITIALIZED;
  if (!fake_dev_ok(d) || !m) return NVML_ERROR_INVALID_ARGUMENT;
  m->total = FAKENVML_TOTAL;
  m->free = FAKENVML_FREE;
  m->used = FAKENVML_TOTAL - FAKENVML_FREE;
  return NVML_SUCCESS;
}
API int nvmlDeviceGetMemoryInfo_v2(struct fake_dev *d, nvmlMemory_v2_t *m) {
  if (!fake_inited) return NVML_ERROR_UNINITIALIZED;
  if (!fake_dev_ok(d) || !m) return NVML_ERROR_INVALID_ARGUMENT;
  if (m->version != NVML_MEMORY_V2)
    return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
  m->total = FAKENVML_TOTAL;
  m->reserved = FAKENVML_RESERVED;
  m->free = FAKENVML_FREE;
  m->used = FAKENVML_TOTAL - FAKENVML_FREE - FAKENVML_RESERVED;
  return NVML_SUCCESS;
}
API const char *nvmlErrorString(int r) {
  return r == NVML_SUCCESS ? "Success" : "fake NVML error";
}
