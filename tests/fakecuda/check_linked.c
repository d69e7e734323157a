/*
 * check_linked.c - the stand-in driver (fakecuda.c) seen as a program built
 * against the toolkit sees a real libcuda.so.1: compiled with cuda.h (its
 * names: cuMemAlloc is cuMemAlloc_v2, cuCtxDestroy cuCtxDestroy_v2) and
 * linked with -lcuda against build/fakecuda, so that the suite does not
 * even load on a stand-in that lacks an exported entry point.  Each case
 * holds the stand-in to a rule of the real driver that gmb's code can get
 * wrong:
 *
 * - versioned entry points: cuGetProcAddress gives the ABI of the version
 *   asked for (CUDA 13's cuCtxGetDevice and cuCtxSynchronize take a
 *   context; cuCtxCreate has three ABIs);
 * - stream capture: potentially unsafe calls (memory management, waits,
 *   event queries) refused, and the capture invalidated, by the rules of
 *   the global, thread-local and relaxed modes; waits for the capturing
 *   stream, queries of events recorded in it and work on the legacy stream
 *   refused in every mode; a graph replays what was captured;
 * - CU_STREAM_PER_THREAD: each thread's own stream, not the legacy one;
 * - fresh memory is not zeros;
 * - pinned host memory (cuMemHostAlloc, cuMemAllocHost) is CPU memory the
 *   copies take, freed by cuMemFreeHost only;
 * - access is per device: cuMemSetAccess for one device grants no other,
 *   and peer access does not extend to memory of the virtual memory API.
 *
 * It runs with two fake devices in a directory of its own.  Where the real
 * driver is installed instead (LD_LIBRARY_PATH), the same cases state what
 * the stand-in claims of it.
 */
#include <check.h>
#include <cuda.h>
#include <cudaTypedefs.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define MIB (1u << 20)

static CUcontext ctx0, ctx1;

/* cuInit, and device d's primary context current on this thread. */
static void up(int d) {
  ck_assert_int_eq(cuInit(0), CUDA_SUCCESS);
  CUdevice dev;
  ck_assert_int_eq(cuDeviceGet(&dev, 0), CUDA_SUCCESS);
  ck_assert_int_eq(cuDevicePrimaryCtxRetain(&ctx0, dev), CUDA_SUCCESS);
  ck_assert_int_eq(cuDeviceGet(&dev, 1), CUDA_SUCCESS);
  ck_assert_int_eq(cuDevicePrimaryCtxRetain(&ctx1, dev), CUDA_SUCCESS);
  ck_assert_int_eq(cuCtxSetCurrent(d ? ctx1 : ctx0), CUDA_SUCCESS);
}

/* Exportable memory of `size` bytes on device `dev`, mapped, with
 * read/write access for device `dev` only. */
static CUdeviceptr vmm_map(int dev, size_t size, CUmemGenericAllocationHandle *h) {
  CUmemAllocationProp prop;
  memset(&prop, 0, sizeof prop);
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = dev;
  CUdeviceptr va;
  ck_assert_int_eq(cuMemCreate(h, size, &prop, 0), CUDA_SUCCESS);
  ck_assert_int_eq(cuMemAddressReserve(&va, size, 0, 0, 0), CUDA_SUCCESS);
  ck_assert_int_eq(cuMemMap(va, size, 0, *h, 0), CUDA_SUCCESS);
  CUmemAccessDesc rw = {{CU_MEM_LOCATION_TYPE_DEVICE, dev},
                        CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
  ck_assert_int_eq(cuMemSetAccess(va, size, &rw, 1), CUDA_SUCCESS);
  return va;
}

static int all_zero(const unsigned char *b, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (b[i]) return 0;
  return 1;
}

/* A program linked with -lcuda runs: the calls below are the exported
 * _v2 names cuda.h gives them. */
START_TEST(linked_program_copies_bytes) {
  up(0);
  CUdeviceptr p;
  ck_assert_int_eq(cuMemAlloc(&p, 4096), CUDA_SUCCESS);
  unsigned char in[4096], out[4096];
  for (size_t i = 0; i < sizeof in; i++) in[i] = (unsigned char)(i * 13 + 1);
  ck_assert_int_eq(cuMemcpyHtoD(p, in, sizeof in), CUDA_SUCCESS);
  ck_assert_int_eq(cuMemcpyDtoH(out, p, sizeof out), CUDA_SUCCESS);
  ck_assert_int_eq(memcmp(in, out, sizeof in), 0);
  size_t fr, tot;
  ck_assert_int_eq(cuMemGetInfo(&fr, &tot), CUDA_SUCCESS);
  ck_assert_uint_gt(tot, fr);
  ck_assert_int_eq(cuMemFree(p), CUDA_SUCCESS);
  CUstream s;
  ck_assert_int_eq(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING), CUDA_SUCCESS);
  ck_assert_int_eq(cuStreamDestroy(s), CUDA_SUCCESS);
}
END_TEST

/* Fresh memory holds what it held (garbage), not zeros: code that reads
 * memory it never wrote must not pass here by luck. */
START_TEST(fresh_memory_is_not_zeros) {
  up(0);
  unsigned char out[4096];
  CUdeviceptr p;
  ck_assert_int_eq(cuMemAlloc(&p, sizeof out), CUDA_SUCCESS);
  ck_assert_int_eq(cuMemcpyDtoH(out, p, sizeof out), CUDA_SUCCESS);
  ck_assert_msg(!all_zero(out, sizeof out), "cuMemAlloc gave zeros");
  ck_assert_int_eq(cuMemFree(p), CUDA_SUCCESS);
  CUmemGenericAllocationHandle h;
  CUdeviceptr va = vmm_map(0, 2 * MIB, &h);
  ck_assert_int_eq(cuMemcpyDtoH(out, va + MIB, sizeof out), CUDA_SUCCESS);
  ck_assert_msg(!all_zero(out, sizeof out), "cuMemCreate gave zeros");
  ck_assert_int_eq(cuMemUnmap(va, 2 * MIB), CUDA_SUCCESS);
  ck_assert_int_eq(cuMemAddressFree(va, 2 * MIB), CUDA_SUCCESS);
  ck_assert_int_eq(cuMemRelease(h), CUDA_SUCCESS);
}
END_TEST

/* Pinned host memory is host memory: the CPU reads and writes it at the
 * address the driver gives, the copies move it to and from device memory
 * (where the CPU cannot reach), and cuMemFreeHost takes only what
 * cuMemHostAlloc or cuMemAllocHost gave. */
START_TEST(pinned_host_memory_is_cpu_memory) {
  up(0);
  const size_t n = 3 * MIB + 512;
  unsigned char *a = NULL, *b = NULL;
  ck_assert_int_eq(cuMemHostAlloc((void **)&a, n, CU_MEMHOSTALLOC_PORTABLE),
                   CUDA_SUCCESS);
  ck_assert_int_eq(cuMemAllocHost((void **)&b, n), CUDA_SUCCESS);
  ck_assert_ptr_nonnull(a);
  ck_assert_ptr_nonnull(b);
  for (size_t i = 0; i < n; i++) a[i] = (unsigned char)(i * 7 + 3);
  CUdeviceptr d;
  ck_assert_int_eq(cuMemAlloc(&d, n), CUDA_SUCCESS);
  ck_assert_int_eq(cuMemcpyHtoD(d, a, n), CUDA_SUCCESS);
  ck_assert_int_eq(cuMemcpyDtoH(b, d, n), CUDA_SUCCESS);
  ck_assert_int_eq(memcmp(a, b, n), 0);
  ck_assert_int_eq(cuMemFree(d), CUDA_SUCCESS);
  void *plain = malloc(64);
  ck_assert_int_eq(cuMemFreeHost(plain), CUDA_ERROR_INVALID_VALUE);
  free(plain);
  ck_assert_int_eq(cuMemFreeHost(a), CUDA_SUCCESS);
  ck_assert_int_eq(cuMemFreeHost(b), CUDA_SUCCESS);
}
END_TEST

/* cuGetProcAddress hands out the ABI of the version asked for. */
START_TEST(getproc_gives_the_abi_of_the_version) {
  up(0);
  CUdriverProcAddressQueryResult q;
  PFN_cuCtxGetDevice_v2000 get_old = NULL;
  PFN_cuCtxGetDevice_v13000 get_new = NULL;
  ck_assert_int_eq(cuGetProcAddress("cuCtxGetDevice", (void **)&get_old,
                                    12000, 0, &q), CUDA_SUCCESS);
  ck_assert_int_eq(cuGetProcAddress("cuCtxGetDevice", (void **)&get_new,
                                    13000, 0, &q), CUDA_SUCCESS);
  ck_assert_ptr_ne((void *)get_old, (void *)get_new);
  CUdevice d = -1;
  ck_assert_int_eq(get_old(&d), CUDA_SUCCESS);
  ck_assert_int_eq(d, 0); /* the current context's */
  ck_assert_int_eq(get_new(&d, ctx1), CUDA_SUCCESS);
  ck_assert_int_eq(d, 1); /* the context passed */
  PFN_cuCtxSynchronize_v13000 sync_new = NULL;
  ck_assert_int_eq(cuGetProcAddress("cuCtxSynchronize", (void **)&sync_new,
                                    13000, 0, &q), CUDA_SUCCESS);
  ck_assert_int_eq(sync_new(ctx1), CUDA_SUCCESS);
  /* cuCtxCreate: _v2 below 11.4, _v3 (affinity) up to 12.5, then _v4. */
  PFN_cuCtxCreate_v3020 create2 = NULL;
  PFN_cuCtxCreate_v11040 create3 = NULL;
  PFN_cuCtxCreate_v12050 create4 = NULL;
  ck_assert_int_eq(cuGetProcAddress("cuCtxCreate", (void **)&create2, 11000,
                                    0, &q), CUDA_SUCCESS);
  ck_assert_int_eq(cuGetProcAddress("cuCtxCreate", (void **)&create3, 12000,
                                    0, &q), CUDA_SUCCESS);
  ck_assert_int_eq(cuGetProcAddress("cuCtxCreate", (void **)&create4, 13000,
                                    0, &q), CUDA_SUCCESS);
  ck_assert_ptr_ne((void *)create2, (void *)create3);
  ck_assert_ptr_ne((void *)create3, (void *)create4);
  CUcontext c2, c3, c4;
  ck_assert_int_eq(create2(&c2, 0, 1), CUDA_SUCCESS);
  ck_assert_int_eq(create3(&c3, NULL, 0, 0, 1), CUDA_SUCCESS);
  ck_assert_int_eq(create4(&c4, NULL, 0, 1), CUDA_SUCCESS);
  ck_assert_int_eq(cuCtxDestroy(c2), CUDA_SUCCESS);
  ck_assert_int_eq(cuCtxDestroy(c3), CUDA_SUCCESS);
  ck_assert_int_eq(cuCtxDestroy(c4), CUDA_SUCCESS);
}
END_TEST

static atomic_int gate;
static void gate_fn(void *arg) {
  (void)arg;
  while (!atomic_load(&gate)) {
    struct timespec ts = {0, 1000000};
    nanosleep(&ts, NULL);
  }
}

static atomic_int other_queued;
static void *block_own_stream(void *arg) {
  (void)arg;
  cuCtxSetCurrent(ctx0);
  int r = cuLaunchHostFunc(CU_STREAM_PER_THREAD, gate_fn, NULL);
  atomic_store(&other_queued, 1);
  if (r == CUDA_SUCCESS) r = cuStreamSynchronize(CU_STREAM_PER_THREAD);
  return (void *)(intptr_t)r;
}

/* CU_STREAM_PER_THREAD is the calling thread's own stream: another
 * thread's work on its own is not waited for (on a stand-in where it is
 * the legacy stream, the wait below never ends and the case times out). */
START_TEST(per_thread_stream_is_the_threads_own) {
  up(0);
  atomic_store(&gate, 0);
  pthread_t t;
  ck_assert_int_eq(pthread_create(&t, NULL, block_own_stream, NULL), 0);
  while (!atomic_load(&other_queued)) {
    struct timespec ts = {0, 1000000};
    nanosleep(&ts, NULL);
  }
  ck_assert_int_eq(cuStreamSynchronize(CU_STREAM_PER_THREAD), CUDA_SUCCESS);
  ck_assert_int_eq(cuStreamSynchronize(CU_STREAM_LEGACY), CUDA_SUCCESS);
  atomic_store(&gate, 1);
  void *rv;
  ck_assert_int_eq(pthread_join(t, &rv), 0);
  ck_assert_int_eq((int)(intptr_t)rv, CUDA_SUCCESS);
  /* A capture of this thread's per-thread stream is its own too. */
  CUstreamCaptureStatus st;
  ck_assert_int_eq(cuStreamBeginCapture(CU_STREAM_PER_THREAD,
                                        CU_STREAM_CAPTURE_MODE_RELAXED),
                   CUDA_SUCCESS);
  ck_assert_int_eq(cuStreamIsCapturing(CU_STREAM_PER_THREAD, &st),
                   CUDA_SUCCESS);
  ck_assert_int_eq(st, CU_STREAM_CAPTURE_STATUS_ACTIVE);
  CUgraph g;
  ck_assert_int_eq(cuStreamEndCapture(CU_STREAM_PER_THREAD, &g), CUDA_SUCCESS);
  ck_assert_int_eq(cuGraphDestroy(g), CUDA_SUCCESS);
}
END_TEST

/* Ends s's capture and says whether it was invalidated. */
static int capture_broken(CUstream s) {
  CUgraph g = NULL;
  CUresult r = cuStreamEndCapture(s, &g);
  if (r == CUDA_SUCCESS) {
    ck_assert_ptr_nonnull(g);
    ck_assert_int_eq(cuGraphDestroy(g), CUDA_SUCCESS);
    return 0;
  }
  ck_assert_int_eq(r, CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
  ck_assert_ptr_null(g);
  return 1;
}

/* The thread's own capture in the global (or thread-local) mode: a
 * potentially unsafe call is refused and breaks the capture; in the
 * relaxed mode it is allowed. */
START_TEST(capture_refuses_unsafe_calls_unless_relaxed) {
  up(0);
  CUstream s;
  CUdeviceptr p;
  CUevent before;
  ck_assert_int_eq(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING), CUDA_SUCCESS);
  ck_assert_int_eq(cuEventCreate(&before, CU_EVENT_DISABLE_TIMING),
                   CUDA_SUCCESS);
  ck_assert_int_eq(cuEventRecord(before, s), CUDA_SUCCESS);
  ck_assert_int_eq(cuStreamSynchronize(s), CUDA_SUCCESS);

  ck_assert_int_eq(cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_GLOBAL),
                   CUDA_SUCCESS);
  ck_assert_int_eq(cuMemAlloc(&p, 4096),
                   CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
  ck_assert_int_eq(capture_broken(s), 1);

  ck_assert_int_eq(cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
                   CUDA_SUCCESS);
  ck_assert_int_eq(cuEventQuery(before), CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
  ck_assert_int_eq(capture_broken(s), 1);

  ck_assert_int_eq(cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_GLOBAL),
                   CUDA_SUCCESS);
  CUstreamCaptureMode mode = CU_STREAM_CAPTURE_MODE_RELAXED;
  ck_assert_int_eq(cuThreadExchangeStreamCaptureMode(&mode), CUDA_SUCCESS);
  ck_assert_int_eq(mode, CU_STREAM_CAPTURE_MODE_GLOBAL);
  ck_assert_int_eq(cuMemAlloc(&p, 4096), CUDA_SUCCESS);
  ck_assert_int_eq(cuEventQuery(before), CUDA_SUCCESS);
  ck_assert_int_eq(cuMemFree(p), CUDA_SUCCESS);
  /* Waiting for the capturing stream is illegal in every mode. */
  ck_assert_int_eq(cuStreamSynchronize(s),
                   CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
  ck_assert_int_eq(cuThreadExchangeStreamCaptureMode(&mode), CUDA_SUCCESS);
  ck_assert_int_eq(capture_broken(s), 1);

  ck_assert_int_eq(cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_RELAXED),
                   CUDA_SUCCESS);
  ck_assert_int_eq(cuMemAlloc(&p, 4096), CUDA_SUCCESS); /* its own mode */
  ck_assert_int_eq(cuMemFree(p), CUDA_SUCCESS);
  ck_assert_int_eq(capture_broken(s), 0);
  ck_assert_int_eq(cuEventDestroy(before), CUDA_SUCCESS);
  ck_assert_int_eq(cuStreamDestroy(s), CUDA_SUCCESS);
}
END_TEST

struct other {
  CUstreamCaptureMode mode;
  CUresult r;
};
static void *alloc_in_other_thread(void *arg) {
  struct other *o = arg;
  cuCtxSetCurrent(ctx0);
  CUstreamCaptureMode m = o->mode;
  cuThreadExchangeStreamCaptureMode(&m);
  CUdeviceptr p;
  o->r = cuMemAlloc(&p, 4096);
  if (o->r == CUDA_SUCCESS) cuMemFree(p);
  return NULL;
}
static CUresult other_thread_alloc(CUstreamCaptureMode mode) {
  struct other o = {mode, CUDA_ERROR_UNKNOWN};
  pthread_t t;
  ck_assert_int_eq(pthread_create(&t, NULL, alloc_in_other_thread, &o), 0);
  ck_assert_int_eq(pthread_join(t, NULL), 0);
  return o.r;
}

/* Another thread's call breaks a global capture unless that thread is
 * relaxed; a thread-local or relaxed capture ignores other threads (a
 * library's background thread must not break a program's capture). */
START_TEST(capture_and_other_threads) {
  up(0);
  CUstream s;
  ck_assert_int_eq(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING), CUDA_SUCCESS);
  ck_assert_int_eq(cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_GLOBAL),
                   CUDA_SUCCESS);
  ck_assert_int_eq(other_thread_alloc(CU_STREAM_CAPTURE_MODE_RELAXED),
                   CUDA_SUCCESS);
  ck_assert_int_eq(other_thread_alloc(CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
                   CUDA_SUCCESS);
  ck_assert_int_eq(capture_broken(s), 0);
  ck_assert_int_eq(cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_GLOBAL),
                   CUDA_SUCCESS);
  ck_assert_int_eq(other_thread_alloc(CU_STREAM_CAPTURE_MODE_GLOBAL),
                   CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
  ck_assert_int_eq(capture_broken(s), 1);
  ck_assert_int_eq(cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
                   CUDA_SUCCESS);
  ck_assert_int_eq(other_thread_alloc(CU_STREAM_CAPTURE_MODE_GLOBAL),
                   CUDA_SUCCESS);
  ck_assert_int_eq(capture_broken(s), 0);
  ck_assert_int_eq(cuStreamDestroy(s), CUDA_SUCCESS);
}
END_TEST

/* An event recorded in a capture may not be queried; the legacy stream
 * while a blocking stream captures answers
 * CUDA_ERROR_STREAM_CAPTURE_IMPLICIT, and using it breaks the capture. */
START_TEST(capture_events_and_the_legacy_stream) {
  up(0);
  CUstream s;
  CUevent e;
  CUstreamCaptureStatus st;
  ck_assert_int_eq(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING), CUDA_SUCCESS);
  ck_assert_int_eq(cuEventCreate(&e, CU_EVENT_DISABLE_TIMING), CUDA_SUCCESS);
  ck_assert_int_eq(cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_RELAXED),
                   CUDA_SUCCESS);
  ck_assert_int_eq(cuEventRecord(e, s), CUDA_SUCCESS);
  ck_assert_int_eq(cuEventQuery(e), CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
  ck_assert_int_eq(capture_broken(s), 1);
  /* A non-blocking stream's capture leaves the legacy stream alone. */
  ck_assert_int_eq(cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_RELAXED),
                   CUDA_SUCCESS);
  ck_assert_int_eq(cuStreamIsCapturing(NULL, &st), CUDA_SUCCESS);
  ck_assert_int_eq(st, CU_STREAM_CAPTURE_STATUS_NONE);
  ck_assert_int_eq(capture_broken(s), 0);
  ck_assert_int_eq(cuStreamDestroy(s), CUDA_SUCCESS);

  CUstream b;
  ck_assert_int_eq(cuStreamCreate(&b, CU_STREAM_DEFAULT), CUDA_SUCCESS);
  ck_assert_int_eq(cuStreamBeginCapture(b, CU_STREAM_CAPTURE_MODE_RELAXED),
                   CUDA_SUCCESS);
  ck_assert_int_eq(cuStreamIsCapturing(NULL, &st),
                   CUDA_ERROR_STREAM_CAPTURE_IMPLICIT);
  ck_assert_int_eq(capture_broken(b), 0);
  ck_assert_int_eq(cuStreamBeginCapture(b, CU_STREAM_CAPTURE_MODE_RELAXED),
                   CUDA_SUCCESS);
  unsigned char byte = 1;
  CUdeviceptr p;
  ck_assert_int_eq(cuMemAlloc(&p, 4096), CUDA_SUCCESS);
  ck_assert_int_eq(cuMemcpyHtoD(p, &byte, 1),
                   CUDA_ERROR_STREAM_CAPTURE_IMPLICIT);
  ck_assert_int_eq(capture_broken(b), 1);
  ck_assert_int_eq(cuMemFree(p), CUDA_SUCCESS);
  ck_assert_int_eq(cuEventDestroy(e), CUDA_SUCCESS);
  ck_assert_int_eq(cuStreamDestroy(b), CUDA_SUCCESS);
}
END_TEST

/* Captured work runs at each launch of the graph, not at capture. */
START_TEST(graph_replays_captured_copies) {
  up(0);
  CUstream s;
  CUdeviceptr a, b;
  unsigned char in[256], out[256];
  memset(in, 0x5a, sizeof in);
  ck_assert_int_eq(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING), CUDA_SUCCESS);
  ck_assert_int_eq(cuMemAlloc(&a, sizeof in), CUDA_SUCCESS);
  ck_assert_int_eq(cuMemAlloc(&b, sizeof in), CUDA_SUCCESS);
  ck_assert_int_eq(cuMemsetD8(b, 0, sizeof in), CUDA_SUCCESS);
  ck_assert_int_eq(cuMemcpyHtoD(a, in, sizeof in), CUDA_SUCCESS);
  ck_assert_int_eq(cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_GLOBAL),
                   CUDA_SUCCESS);
  ck_assert_int_eq(cuMemcpyDtoDAsync(b, a, sizeof in, s), CUDA_SUCCESS);
  CUgraph g;
  ck_assert_int_eq(cuStreamEndCapture(s, &g), CUDA_SUCCESS);
  ck_assert_int_eq(cuStreamSynchronize(s), CUDA_SUCCESS);
  ck_assert_int_eq(cuMemcpyDtoH(out, b, sizeof out), CUDA_SUCCESS);
  ck_assert_msg(all_zero(out, sizeof out), "the capture ran the copy");
  CUgraphExec x;
  ck_assert_int_eq(cuGraphInstantiate(&x, g, 0), CUDA_SUCCESS);
  ck_assert_int_eq(cuGraphLaunch(x, s), CUDA_SUCCESS);
  ck_assert_int_eq(cuStreamSynchronize(s), CUDA_SUCCESS);
  ck_assert_int_eq(cuMemcpyDtoH(out, b, sizeof out), CUDA_SUCCESS);
  ck_assert_int_eq(memcmp(in, out, sizeof in), 0);
  ck_assert_int_eq(cuGraphExecDestroy(x), CUDA_SUCCESS);
  ck_assert_int_eq(cuGraphDestroy(g), CUDA_SUCCESS);
  ck_assert_int_eq(cuMemFree(a), CUDA_SUCCESS);
  ck_assert_int_eq(cuMemFree(b), CUDA_SUCCESS);
  ck_assert_int_eq(cuStreamDestroy(s), CUDA_SUCCESS);
}
END_TEST

/* Access is granted per device; peer access between contexts does not
 * reach memory of the virtual memory API. */
START_TEST(access_is_per_device) {
  up(0);
  CUmemGenericAllocationHandle h;
  CUdeviceptr va = vmm_map(0, 2 * MIB, &h);
  unsigned char out[64];
  ck_assert_int_eq(cuMemcpyDtoH(out, va, sizeof out), CUDA_SUCCESS);
  int can = 0;
  ck_assert_int_eq(cuDeviceCanAccessPeer(&can, 1, 0), CUDA_SUCCESS);
  ck_assert_int_eq(can, 1);
  ck_assert_int_eq(cuCtxSetCurrent(ctx1), CUDA_SUCCESS);
  ck_assert_int_eq(cuMemcpyDtoH(out, va, sizeof out),
                   CUDA_ERROR_INVALID_VALUE);
  ck_assert_int_eq(cuCtxEnablePeerAccess(ctx0, 0), CUDA_SUCCESS);
  ck_assert_int_eq(cuCtxEnablePeerAccess(ctx0, 0),
                   CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED);
  ck_assert_int_eq(cuMemcpyDtoH(out, va, sizeof out),
                   CUDA_ERROR_INVALID_VALUE);
  CUmemAccessDesc rw1 = {{CU_MEM_LOCATION_TYPE_DEVICE, 1},
                         CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
  ck_assert_int_eq(cuMemSetAccess(va, 2 * MIB, &rw1, 1), CUDA_SUCCESS);
  ck_assert_int_eq(cuMemcpyDtoH(out, va, sizeof out), CUDA_SUCCESS);
  /* Device 0 kept its access. */
  ck_assert_int_eq(cuCtxSetCurrent(ctx0), CUDA_SUCCESS);
  ck_assert_int_eq(cuMemcpyDtoH(out, va, sizeof out), CUDA_SUCCESS);
  ck_assert_int_eq(cuMemUnmap(va, 2 * MIB), CUDA_SUCCESS);
  ck_assert_int_eq(cuMemAddressFree(va, 2 * MIB), CUDA_SUCCESS);
  ck_assert_int_eq(cuMemRelease(h), CUDA_SUCCESS);
}
END_TEST

int main(void) {
  char dir[] = "/tmp/gmb-linked-XXXXXX";
  if (!mkdtemp(dir)) return 2;
  setenv("FAKECUDA_DIR", dir, 1);
  setenv("FAKECUDA_DEVICES", "2", 1);
  /* Misuse is expected here (the refused calls): its log goes with the
   * directory. */
  char log[64];
  snprintf(log, sizeof log, "%s/misuse.log", dir);
  setenv("FAKECUDA_LOG", log, 1);
  Suite *s = suite_create("fakecuda_linked");
  TCase *tc = tcase_create("driver");
  tcase_add_test(tc, linked_program_copies_bytes);
  tcase_add_test(tc, fresh_memory_is_not_zeros);
  tcase_add_test(tc, getproc_gives_the_abi_of_the_version);
  tcase_add_test(tc, per_thread_stream_is_the_threads_own);
  tcase_add_test(tc, capture_refuses_unsafe_calls_unless_relaxed);
  tcase_add_test(tc, capture_and_other_threads);
  tcase_add_test(tc, capture_events_and_the_legacy_stream);
  tcase_add_test(tc, graph_replays_captured_copies);
  tcase_add_test(tc, access_is_per_device);
  tcase_add_test(tc, pinned_host_memory_is_cpu_memory);
  suite_add_tcase(s, tc);
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  char cmd[96];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
  if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", dir);
  return failed ? 1 : 0;
}
