/*
 * test_preload.c - libgmb-preload.so in an unmodified program: build/
 * preload/cuda_prog (tests/preload/cuda_prog.c) declares the CUDA
 * functions and links nothing that defines them; run with LD_PRELOAD, its
 * cudaMalloc / cuMemAlloc_v2 and the rest reach a real broker on the host
 * device.  The test talks to the program line by line through pipes
 * (commands in, return codes out) and checks the broker's admin figures
 * between steps.
 *
 * The pass-through cases preload build/preload/libfakecudart.so second:
 * it stands for libcudart/libcuda, so dlsym(RTLD_NEXT) finds "real"
 * functions.  Real cudart interposition needs a GPU (docs/preload.md).
 *
 * Under SAN=1 the program and the library carry ASan, whose runtime must
 * come first in the process: the test finds the libasan it runs with
 * itself and puts it first in LD_PRELOAD.
 */
#include <check.h>
#include <fcntl.h>
#include <link.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "gmb.h"
#include "harness.h"

#define MIB (UINT64_C(1) << 20)
#define PRE_QUOTA (8 * MIB)
#define FAKE_FREE (UINT64_C(3) << 30) /* tests/preload/fake_cudart.c */
#define FAKE_TOTAL (UINT64_C(5) << 30)

static const char *pre_config = "[tenant:pre]\nquota = 8MiB\n";

struct prog {
  const char *name; /* under build/preload/: NULL for cuda_prog */
  pid_t pid;
  int in, out; /* its stdin (we write), its stdout (we read) */
  char err_path[128];
};

/* --- the LD_PRELOAD line ---------------------------------------------------- */

#if defined(__SANITIZE_ADDRESS__)
static int pre_find_asan(struct dl_phdr_info *info, size_t size, void *data) {
  (void)size;
  if (info->dlpi_name && strstr(info->dlpi_name, "libasan.so")) {
    snprintf(data, PATH_MAX, "%s", info->dlpi_name);
    return 1;
  }
  return 0;
}
#endif

/* "[libasan] build/libgmb-preload.so [fake]": with_fake 1 the stand-in
 * cudart, 2 the stand-in driver ($GMB_LIBCUDA), whose functions (its
 * cuCtxSynchronize, with the capture rules) the shim then finds next. */
static void pre_preload_line(char *buf, size_t cap, int with_fake) {
  const char *bd = harness_build_dir();
  char asan[PATH_MAX] = "", fake[PATH_MAX] = "";
#if defined(__SANITIZE_ADDRESS__)
  dl_iterate_phdr(pre_find_asan, asan);
#endif
  if (with_fake == 1)
    snprintf(fake, sizeof fake, " %s/preload/libfakecudart.so", bd);
  else if (with_fake == 2 && getenv("GMB_LIBCUDA"))
    snprintf(fake, sizeof fake, " %s", getenv("GMB_LIBCUDA"));
  snprintf(buf, cap, "%s%s%s/libgmb-preload.so%s", asan, asan[0] ? " " : "",
           bd, fake);
}

/* --- the program -------------------------------------------------------------- */

/* Starts cuda_prog with LD_PRELOAD and the env pairs given (NULL value:
 * unset), stderr to a file of its own under /tmp. */
static void prog_start(struct prog *p, int with_fake,
                       const char *const env[]) {
  static int seq;
  int to[2], from[2];
  ck_assert_int_eq(pipe(to), 0);
  ck_assert_int_eq(pipe(from), 0);
  snprintf(p->err_path, sizeof p->err_path, "/tmp/gmbp-%d-%d.err",
           (int)getpid(), seq++);
  char preload[2 * PATH_MAX + 128];
  pre_preload_line(preload, sizeof preload, with_fake);
  char prog[PATH_MAX], fake[PATH_MAX];
  snprintf(prog, sizeof prog, "%s/preload/%s", harness_build_dir(),
           p->name ? p->name : "cuda_prog");
  snprintf(fake, sizeof fake, "%s/preload/libfakecudart.so", harness_build_dir());
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    dup2(to[0], 0);
    dup2(from[1], 1);
    int e = open(p->err_path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (e >= 0) dup2(e, 2);
    close(to[1]);
    close(from[0]);
    unsetenv("GMB_PRELOAD_FALLBACK");
    unsetenv("GMB_PRELOAD_VERBOSE");
    /* The brokers here serve the host device, which the shim refuses
     * unless told it is a test (preload_host_broker_refused unsets it). */
    setenv("GMB_SHIM_ALLOW_HOST", "1", 1);
    setenv("CUDA_PROG_REAL", fake, 1);
    for (int i = 0; env[i]; i += 2) {
      if (env[i + 1])
        setenv(env[i], env[i + 1], 1);
      else
        unsetenv(env[i]);
    }
    setenv("LD_PRELOAD", preload, 1);
    execl(prog, prog, (char *)NULL);
    _exit(127);
  }
  close(to[0]);
  close(from[1]);
  p->pid = pid;
  p->in = to[1];
  p->out = from[0];
}

/* Sends one command and returns its one-line answer (static buffer). */
static const char *prog_cmd(struct prog *p, const char *cmd) {
  static char line[256];
  char buf[128];
  int n = snprintf(buf, sizeof buf, "%s\n", cmd);
  ck_assert_int_eq(write(p->in, buf, (size_t)n), n);
  size_t len = 0;
  for (;;) {
    struct pollfd pf = {p->out, POLLIN, 0};
    int r = poll(&pf, 1, HARNESS_WAIT_MS);
    ck_assert_msg(r == 1, "%s did not answer \"%s\"",
                  p->name ? p->name : "cuda_prog", cmd);
    char c;
    ssize_t k = read(p->out, &c, 1);
    ck_assert_msg(k == 1, "%s ended during \"%s\" (see %s)",
                  p->name ? p->name : "cuda_prog", cmd, p->err_path);
    if (c == '\n') break;
    if (len + 1 < sizeof line) line[len++] = c;
  }
  line[len] = '\0';
  return line;
}

static void prog_expect(struct prog *p, const char *cmd, const char *want) {
  const char *got = prog_cmd(p, cmd);
  ck_assert_msg(strcmp(got, want) == 0, "\"%s\" answered \"%s\", want \"%s\"",
                cmd, got, want);
}

/* Ends the program (closing stdin, or "exit": no frees), waits for it, and
 * returns its stderr (the caller frees). */
static char *prog_end(struct prog *p, int abrupt) {
  if (abrupt) ck_assert_int_eq(write(p->in, "exit\n", 5), 5);
  close(p->in);
  int st = harness_wait(p->pid);
  close(p->out);
  ck_assert_msg(st == 0, "cuda_prog exited with %d", st);
  FILE *f = fopen(p->err_path, "r");
  ck_assert_ptr_nonnull(f);
  char *text = calloc(1, 8192);
  size_t n = fread(text, 1, 8191, f);
  text[n] = '\0';
  fclose(f);
  unlink(p->err_path);
  return text;
}

static uint64_t pre_used(const struct harness_broker *b, const char *tenant) {
  struct wire_tenant_row row;
  int rc = harness_tenant_row(b, tenant, &row);
  ck_assert_msg(rc == 0, "tenant row of %s: %s", tenant, gmb_err_name(rc));
  return row.used;
}

/* --- static_prog on the fake driver ---------------------------------------- */

/* The fake driver's and NVML's paths, for static_prog. */
static void static_paths(char *nvml, size_t cap) {
  snprintf(nvml, cap, "%s/fakecuda/libnvidia-ml.so.1", harness_build_dir());
}

/* n fake GPUs, and (with_broker) a broker of the test's config on GPU 0. */
static void static_gpus(struct harness_gpus *g, int n, struct harness_broker *b) {
  harness_fake_gpus(g, n);
  if (b)
    harness_broker_start_gpu(b, g->base, "cuda:0", HARNESS_FAKE_UUID(0),
                             pre_config);
}

/* Starts static_prog as tenant pre on the fake driver, with the pairs of
 * `extra` (NULL-ended) too; with `init`, opens the driver as the static
 * runtime does and makes ordinal 0 current. */
static void static_start(struct prog *p, const char *const extra[],
                         int init) {
  const char *env[32] = {"GMB_TENANT", "pre", "GMB_SHIM_ALLOW_HOST", NULL,
                         "STATIC_PROG_LIBCUDA", getenv("GMB_LIBCUDA")};
  int n = 6;
  for (int i = 0; extra && extra[i] && n < 30; i += 2, n += 2) {
    env[n] = extra[i];
    env[n + 1] = extra[i + 1];
  }
  env[n] = NULL;
  p->name = "static_prog";
  prog_start(p, 0, env);
  if (!init) return;
  prog_expect(p, "open", "0 gmb:cuGetProcAddress_v2");
  prog_expect(p, "init 0", "0");
}

/* One GPU of the stand-in, its broker, and static_prog on it (opened and
 * ordinal 0 current); static_end checks the program's exit and stops all
 * three. */
static void static_begin(struct harness_gpus *g, struct harness_broker *b,
                         struct prog *p) {
  static_gpus(g, 1, b);
  *p = (struct prog){0};
  static_start(p, NULL, 1);
}

static void static_end(struct harness_gpus *g, struct harness_broker *b,
                       struct prog *p) {
  free(prog_end(p, 0));
  harness_broker_stop(b);
  harness_fake_gpus_done(g);
}

/* --- with a broker --------------------------------------------------------------- */

START_TEST(preload_alloc_free_both_apis) {
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", pre_config);
  struct prog p = {0};
  prog_start(&p, 0, (const char *const[]){
      "GMB_ENDPOINT", b.endpoint, "GMB_TENANT", "pre", NULL});
  prog_expect(&p, "rt_malloc 0 1048576", "0");
  prog_expect(&p, "drv_malloc 1 2097152", "0");
  ck_assert_uint_eq(pre_used(&b, "pre"), 3 * MIB);
  prog_expect(&p, "fill 0 1048576 7", "0");
  prog_expect(&p, "fill 1 2097152 9", "0");
  prog_expect(&p, "check 0 1048576 7", "0");
  prog_expect(&p, "check 1 2097152 9", "0");
  /* Quota as total, quota - used as free, through both APIs. */
  char want[64];
  snprintf(want, sizeof want, "0 %llu %llu",
           (unsigned long long)(PRE_QUOTA - 3 * MIB),
           (unsigned long long)PRE_QUOTA);
  prog_expect(&p, "rt_info", want);
  prog_expect(&p, "drv_info", want);
  prog_expect(&p, "rt_free 0", "0");
  ck_assert_uint_eq(pre_used(&b, "pre"), 2 * MIB);
  prog_expect(&p, "drv_free 1", "0");
  ck_assert_uint_eq(pre_used(&b, "pre"), 0);
  prog_expect(&p, "rt_free_null", "0");
  /* cudaMalloc(0) succeeds with no memory; freeing its NULL is fine. */
  prog_expect(&p, "rt_malloc 2 0", "0");
  prog_expect(&p, "rt_free 2", "0");
  free(prog_end(&p, 0));
  harness_broker_stop(&b);
}
END_TEST

START_TEST(preload_quota_refusal_is_error_2) {
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", pre_config);
  struct prog p = {0};
  prog_start(&p, 0, (const char *const[]){
      "GMB_ENDPOINT", b.endpoint, "GMB_TENANT", "pre",
      "GMB_PRELOAD_VERBOSE", "1", NULL});
  prog_expect(&p, "rt_malloc 0 6291456", "0");
  prog_expect(&p, "rt_malloc 1 4194304", "2"); /* cudaErrorMemoryAllocation */
  prog_expect(&p, "drv_malloc 1 4194304", "2"); /* CUDA_ERROR_OUT_OF_MEMORY */
  char want[64];
  snprintf(want, sizeof want, "0 %llu %llu", (unsigned long long)(2 * MIB),
           (unsigned long long)PRE_QUOTA);
  prog_expect(&p, "rt_info", want);
  prog_expect(&p, "rt_malloc 1 2097152", "0"); /* exactly up to the quota */
  ck_assert_uint_eq(pre_used(&b, "pre"), PRE_QUOTA);
  /* Exit without freeing: the broker takes the memory back. */
  char *err = prog_end(&p, 1);
  ck_assert_msg(harness_count(err, "GMB_E_QUOTA") == 2,
                "want two quota lines on stderr, got:\n%s", err);
  free(err);
  int freed = 0;
  for (int i = 0; i < HARNESS_WAIT_MS / 20 && !freed; i++) {
    freed = pre_used(&b, "pre") == 0;
    if (!freed) harness_sleep_ms(20);
  }
  ck_assert_msg(freed, "the dead program's memory was not returned");
  harness_broker_stop(&b);
}
END_TEST

START_TEST(preload_foreign_pointer_and_unlimited_info) {
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", pre_config);
  /* An unlimited tenant, and no real function: the broker's figures, its
   * capacity as total and what the tenant could still get as free. */
  struct prog p = {0};
  prog_start(&p, 0, (const char *const[]){
      "GMB_ENDPOINT", b.endpoint, "GMB_TENANT", "open", NULL});
  char want[64];
  snprintf(want, sizeof want, "0 %llu %llu", (unsigned long long)(64 * MIB),
           (unsigned long long)(64 * MIB));
  prog_expect(&p, "rt_info", want);
  prog_expect(&p, "rt_malloc 0 4096", "0");
  ck_assert_uint_eq(pre_used(&b, "open"), 4096);
  /* A 2 MiB segment holds the 4 KiB: the rest of it is still the
   * tenant's to use. */
  snprintf(want, sizeof want, "0 %llu %llu",
           (unsigned long long)(64 * MIB - 4096),
           (unsigned long long)(64 * MIB));
  prog_expect(&p, "drv_info", want);
  free(prog_end(&p, 0));
  /* With a "real" library behind: its figures (the device's free memory
   * is more than the broker's room, which caps it), and its pointers go
   * back to it. */
  prog_start(&p, 1, (const char *const[]){
      "GMB_ENDPOINT", b.endpoint, "GMB_TENANT", "open", NULL});
  snprintf(want, sizeof want, "0 %llu %llu",
           (unsigned long long)(64 * MIB), (unsigned long long)FAKE_TOTAL);
  prog_expect(&p, "rt_info", want);
  prog_expect(&p, "drv_info", want);
  prog_expect(&p, "real_malloc 0 4096", "0");
  prog_expect(&p, "rt_malloc 1 8192", "0");
  prog_expect(&p, "rt_free 0", "0"); /* the fake's: passed through */
  ck_assert_uint_eq(pre_used(&b, "open"), 8192);
  prog_expect(&p, "rt_free 1", "0");
  ck_assert_uint_eq(pre_used(&b, "open"), 0);
  /* cudaFree(NULL) creates cudart's context: the real one must get it. */
  prog_expect(&p, "rt_free_null", "0");
  char *err = prog_end(&p, 0);
  ck_assert_msg(harness_count(err, "fake-cudart: cudaFree(NULL)") == 1,
                "cudaFree(NULL) not passed through:\n%s", err);
  free(err);
  harness_broker_stop(&b);
}
END_TEST

/* A tenant without a quota sizes itself from free memory: the device's
 * free memory (here the stand-in cudart's 3 GiB, less than the broker's
 * room) plus what the tenant's segments hold free, which the device's
 * figure does not count.  With a quota: the quota's view. */
START_TEST(preload_meminfo_device_free_plus_pool) {
  struct harness_broker b;
  harness_broker_start(&b, "host:4GiB", pre_config);
  struct prog p = {0};
  prog_start(&p, 1, (const char *const[]){
      "GMB_ENDPOINT", b.endpoint, "GMB_TENANT", "open", NULL});
  char want[64];
  snprintf(want, sizeof want, "0 %llu %llu", (unsigned long long)FAKE_FREE,
           (unsigned long long)FAKE_TOTAL);
  prog_expect(&p, "rt_info", want);
  prog_expect(&p, "rt_malloc 0 4096", "0");
  prog_expect(&p, "drv_malloc 1 8192", "0");
  snprintf(want, sizeof want, "0 %llu %llu",
           (unsigned long long)(FAKE_FREE + 2 * MIB - 4096 - 8192),
           (unsigned long long)FAKE_TOTAL);
  prog_expect(&p, "rt_info", want);
  prog_expect(&p, "drv_info", want);
  prog_expect(&p, "rt_free 0", "0");
  prog_expect(&p, "drv_free 1", "0");
  free(prog_end(&p, 0));
  /* The quota's view wins over every device figure. */
  prog_start(&p, 1, (const char *const[]){
      "GMB_ENDPOINT", b.endpoint, "GMB_TENANT", "pre", NULL});
  prog_expect(&p, "rt_malloc 0 4096", "0");
  snprintf(want, sizeof want, "0 %llu %llu",
           (unsigned long long)(PRE_QUOTA - 4096),
           (unsigned long long)PRE_QUOTA);
  prog_expect(&p, "rt_info", want);
  free(prog_end(&p, 0));
  harness_broker_stop(&b);
}
END_TEST

/* A broker on the host device hands out host memory: not for cudaMalloc.
 * Refused as if there were no broker, or passed through when the
 * fallback says so. */
START_TEST(preload_host_broker_refused) {
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", pre_config);
  struct prog p = {0};
  prog_start(&p, 0, (const char *const[]){
      "GMB_ENDPOINT", b.endpoint, "GMB_TENANT", "open",
      "GMB_SHIM_ALLOW_HOST", NULL, NULL});
  prog_expect(&p, "rt_malloc 0 4096", "2");
  prog_expect(&p, "drv_malloc 1 4096", "2");
  ck_assert_uint_eq(pre_used(&b, "open"), 0);
  char *err = prog_end(&p, 0);
  ck_assert_msg(harness_count(err, "gmb-preload: no broker") == 1 &&
                    strstr(err, "the broker serves the host device, not a GPU"),
                "want one line saying why, got:\n%s", err);
  free(err);
  prog_start(&p, 1, (const char *const[]){
      "GMB_ENDPOINT", b.endpoint, "GMB_TENANT", "open",
      "GMB_SHIM_ALLOW_HOST", NULL, "GMB_PRELOAD_FALLBACK", "passthrough",
      NULL});
  prog_expect(&p, "rt_malloc 0 4096", "0"); /* the fake's */
  ck_assert_uint_eq(pre_used(&b, "open"), 0);
  prog_expect(&p, "rt_free 0", "0");
  err = prog_end(&p, 0);
  ck_assert_msg(strstr(err, "pass through"), "%s", err);
  free(err);
  harness_broker_stop(&b);
}
END_TEST

/* --- the stream-ordered calls -------------------------------------------------------- */

/*
 * cudaMallocAsync / cuMemAllocAsync (and the _ptsz variants) come from the
 * session's cache: 2 MiB pages of the tenant serve them, a free gives
 * the block back to the cache (the tenant keeps the page), a hit sends
 * nothing.  Either kind of pointer may be freed either way.  At the quota
 * the cache gives its idle pages back before it refuses.
 */
START_TEST(preload_async_alloc_free) {
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", pre_config);
  struct prog p = {0};
  prog_start(&p, 0, (const char *const[]){
      "GMB_ENDPOINT", b.endpoint, "GMB_TENANT", "pre", NULL});
  prog_expect(&p, "rt_malloc_async 0 4096 0", "0");
  ck_assert_uint_eq(pre_used(&b, "pre"), 2 * MIB); /* a page */
  prog_expect(&p, "fill 0 4096 5", "0");
  prog_expect(&p, "check 0 4096 5", "0");
  prog_expect(&p, "dup 0 9", "0");
  prog_expect(&p, "rt_free_async 0 0", "0");
  ck_assert_uint_eq(pre_used(&b, "pre"), 2 * MIB); /* cached */
  /* Freed twice: not ours any more, and no real function: error 1. */
  prog_expect(&p, "rt_free_async 9 0", "1");
  prog_expect(&p, "rt_malloc_async_ptsz 1 8192 0", "0"); /* a hit */
  /* A block past a page: it starts in the first page, beside the 8 KiB
   * block, and takes one page more. */
  prog_expect(&p, "drv_malloc_async 2 2097153 1", "0");
  ck_assert_uint_eq(pre_used(&b, "pre"), 4 * MIB);
  prog_expect(&p, "fill 2 2097153 6", "0");
  prog_expect(&p, "check 2 2097153 6", "0");
  prog_expect(&p, "rt_free_async_ptsz 1 0", "0");
  prog_expect(&p, "drv_free_async 2 2", "0");
  ck_assert_uint_eq(pre_used(&b, "pre"), 4 * MIB);
  /* cudaMalloc's memory freed with cudaFreeAsync: back to the broker at
   * once; cudaMallocAsync's freed with cudaFree: back to the cache. */
  prog_expect(&p, "rt_malloc 3 1048576", "0");
  ck_assert_uint_eq(pre_used(&b, "pre"), 5 * MIB);
  prog_expect(&p, "rt_free_async 3 0", "0");
  ck_assert_uint_eq(pre_used(&b, "pre"), 4 * MIB);
  prog_expect(&p, "rt_malloc_async 4 4096 0", "0");
  prog_expect(&p, "rt_free 4", "0");
  prog_expect(&p, "drv_malloc_async 4 4096 0", "0");
  prog_expect(&p, "drv_free 4", "0");
  ck_assert_uint_eq(pre_used(&b, "pre"), 4 * MIB);
  /* Size 0 as the synchronous calls; a NULL free is a success. */
  prog_expect(&p, "rt_malloc_async 5 0 0", "0");
  prog_expect(&p, "drv_malloc_async 5 0 0", "1");
  prog_expect(&p, "rt_free_async_null", "0");
  /* 7 MiB: the two cached pages serve its first 4 MiB and two more pages
   * the rest, at the 8 MiB quota; then 2 MiB more is over the quota. */
  prog_expect(&p, "rt_malloc_async 6 7340032 0", "0");
  ck_assert_uint_eq(pre_used(&b, "pre"), 8 * MIB);
  prog_expect(&p, "rt_malloc_async 7 2097152 0", "2");
  prog_expect(&p, "fill 6 7340032 8", "0");
  prog_expect(&p, "check 6 7340032 8", "0");
  /* Exit holding it: the broker takes it back. */
  free(prog_end(&p, 1));
  int freed = 0;
  for (int i = 0; i < HARNESS_WAIT_MS / 20 && !freed; i++) {
    freed = pre_used(&b, "pre") == 0;
    if (!freed) harness_sleep_ms(20);
  }
  ck_assert_msg(freed, "the dead program's cache was not returned");
  harness_broker_stop(&b);
}
END_TEST

/* With a real library behind: a foreign pointer's stream-ordered free
 * reaches it, cudaFree of cudaMallocAsync's memory first waits for the
 * device through it (cudaDeviceSynchronize, or cuCtxSynchronize for
 * cuMemFree), and without a broker the passthrough fallback uses its
 * cudaMallocAsync. */
START_TEST(preload_async_real_functions) {
  struct harness_broker b;
  harness_broker_start(&b, "host:64MiB", pre_config);
  struct prog p = {0};
  prog_start(&p, 1, (const char *const[]){
      "GMB_ENDPOINT", b.endpoint, "GMB_TENANT", "pre", NULL});
  prog_expect(&p, "real_malloc 0 4096", "0");
  /* dlsym(RTLD_NEXT) from a library after the shim (whose dlsym it
   * calls) still means "after that library". */
  prog_expect(&p, "next_probe", "0");
  prog_expect(&p, "rt_free_async 0 0", "0");
  prog_expect(&p, "rt_malloc_async 1 4096 0", "0");
  ck_assert_uint_eq(pre_used(&b, "pre"), 2 * MIB);
  prog_expect(&p, "rt_free 1", "0");
  prog_expect(&p, "drv_malloc_async 2 4096 0", "0");
  prog_expect(&p, "drv_free 2", "0");
  ck_assert_uint_eq(pre_used(&b, "pre"), 2 * MIB);
  char *err = prog_end(&p, 0);
  ck_assert_msg(harness_count(err, "fake-cudart: cudaFreeAsync") == 1 &&
                    harness_count(err, "fake-cudart: cudaDeviceSynchronize") ==
                        1 &&
                    harness_count(err, "fake-cudart: cuCtxSynchronize") == 1 &&
                    harness_count(err, "fake-cudart: cudaMallocAsync") == 0,
                "stderr:\n%s", err);
  free(err);
  prog_start(&p, 1, (const char *const[]){
      "GMB_ENDPOINT", "ipc:///nonexistent-gmb/broker.sock",
      "GMB_PRELOAD_FALLBACK", "passthrough", NULL});
  prog_expect(&p, "rt_malloc_async 0 4096 0", "0");
  prog_expect(&p, "fill 0 4096 3", "0");
  prog_expect(&p, "rt_free_async 0 0", "0");
  err = prog_end(&p, 0);
  ck_assert_msg(harness_count(err, "fake-cudart: cudaMallocAsync") == 1 &&
                    harness_count(err, "fake-cudart: cudaFreeAsync") == 1 &&
                    strstr(err, "pass through"),
                "stderr:\n%s", err);
  free(err);
  harness_broker_stop(&b);
}
END_TEST

/* On a (fake) GPU: memory cudaMallocAsync gave while its stream was being
 * captured into a graph is kept after its free (the graph uses it at
 * every replay), so it is never handed out again; so is memory freed
 * during a capture.  Outside a capture a freed block is reused. */
START_TEST(preload_async_graph_capture_keeps) {
  struct harness_gpus g;
  struct harness_broker b;
  static_gpus(&g, 1, &b);
  struct prog p = {0};
  prog_start(&p, 0, (const char *const[]){
      "GMB_TENANT", "pre", "GMB_SHIM_ALLOW_HOST", NULL, NULL});
  prog_expect(&p, "set_device 0", "0");
  prog_expect(&p, "rt_malloc_async 0 4096 0", "0");
  prog_expect(&p, "dup 0 10", "0");
  prog_expect(&p, "rt_free_async 0 0", "0");
  prog_expect(&p, "rt_malloc_async 1 4096 0", "0");
  prog_expect(&p, "same 1 10", "1"); /* same stream: reused at once */
  prog_expect(&p, "capture on", "0");
  prog_expect(&p, "rt_malloc_async 2 4096 0", "0");
  prog_expect(&p, "dup 2 11", "0");
  prog_expect(&p, "rt_free_async 1 0", "0"); /* during the capture: kept */
  prog_expect(&p, "capture off", "0");
  prog_expect(&p, "rt_free_async 2 0", "0"); /* a graph's: kept */
  prog_expect(&p, "rt_malloc_async 3 4096 0", "0");
  prog_expect(&p, "same 3 10", "0");
  prog_expect(&p, "same 3 11", "0");
  prog_expect(&p, "rt_malloc_async 4 4096 0", "0");
  prog_expect(&p, "same 4 10", "0");
  prog_expect(&p, "same 4 11", "0");
  prog_expect(&p, "rt_free_async 3 0", "0");
  prog_expect(&p, "rt_free_async 4 0", "0");
  ck_assert_uint_eq(pre_used(&b, "pre"), 2 * MIB);
  free(prog_end(&p, 0));
  harness_broker_stop(&b);
  harness_fake_gpus_done(&g);
}
END_TEST

/* On a (fake) GPU whose driver is the "real" one next to the shim: a
 * cudaFree of cudaMallocAsync's memory waits for the device first, as
 * cudaFree does, but not while a graph capture runs on another stream
 * (non-blocking: the legacy stream does not show it), which the wait
 * (cuCtxSynchronize) would invalidate.  Freed during that capture, the
 * block is kept, and the capture ends whole. */
START_TEST(preload_free_during_capture_does_not_sync) {
  struct harness_gpus g;
  struct harness_broker b;
  static_gpus(&g, 1, &b);
  struct prog p = {0};
  prog_start(&p, 2, (const char *const[]){
      "GMB_TENANT", "pre", "GMB_SHIM_ALLOW_HOST", NULL, NULL});
  prog_expect(&p, "set_device 0", "0");
  prog_expect(&p, "graph begin", "0");
  prog_expect(&p, "graph end", "0");
  prog_expect(&p, "rt_malloc_async 0 4096 3", "0");
  prog_expect(&p, "rt_malloc_async 1 4096 3", "0");
  prog_expect(&p, "drv_free 1", "0"); /* no capture: waits, then frees */
  prog_expect(&p, "graph begin", "0");
  prog_expect(&p, "drv_free 0", "0"); /* during the capture: kept */
  prog_expect(&p, "graph end", "0");  /* the capture was not broken */
  ck_assert_uint_eq(pre_used(&b, "pre"), 2 * MIB);
  char *err = prog_end(&p, 0);
  ck_assert_msg(strstr(err, "invalidated") == NULL, "stderr:\n%s", err);
  free(err);
  harness_broker_stop(&b);
  harness_fake_gpus_done(&g);
}
END_TEST

/* --- without a broker --------------------------------------------------------------- */

static const char *no_endpoint = "ipc:///nonexistent-gmb/broker.sock";

START_TEST(preload_no_broker_refuses) {
  struct prog p = {0};
  prog_start(&p, 0, (const char *const[]){"GMB_ENDPOINT", no_endpoint,
                                               NULL});
  prog_expect(&p, "rt_malloc 0 4096", "2");
  prog_expect(&p, "drv_malloc 0 4096", "2");
  prog_expect(&p, "rt_info", "2 1 1");
  char *err = prog_end(&p, 0);
  ck_assert_msg(harness_count(err, "gmb-preload: no broker") == 1 &&
                    strstr(err, "GMB_PRELOAD_FALLBACK=refuse"),
                "want one line naming the fallback, got:\n%s", err);
  free(err);
}
END_TEST

START_TEST(preload_passthrough_without_real_refuses) {
  struct prog p = {0};
  prog_start(&p, 0, (const char *const[]){
      "GMB_ENDPOINT", no_endpoint, "GMB_PRELOAD_FALLBACK", "passthrough",
      NULL});
  prog_expect(&p, "rt_malloc 0 4096", "2");
  char *err = prog_end(&p, 0);
  ck_assert_msg(strstr(err, "no real function"),
                "want a line saying there is nothing to pass to, got:\n%s",
                err);
  free(err);
  /* With a real library behind, the same program runs on it. */
  prog_start(&p, 1, (const char *const[]){
      "GMB_ENDPOINT", no_endpoint, "GMB_PRELOAD_FALLBACK", "passthrough",
      NULL});
  prog_expect(&p, "rt_malloc 0 4096", "0");
  prog_expect(&p, "drv_malloc 1 4096", "0");
  prog_expect(&p, "fill 0 4096 3", "0");
  prog_expect(&p, "rt_free 0", "0");
  prog_expect(&p, "drv_free 1", "0");
  char want[64];
  snprintf(want, sizeof want, "0 %llu %llu", (unsigned long long)FAKE_FREE,
           (unsigned long long)FAKE_TOTAL);
  prog_expect(&p, "rt_info", want);
  err = prog_end(&p, 0);
  ck_assert_msg(strstr(err, "pass through"), "stderr:\n%s", err);
  free(err);
}
END_TEST

/* --- several GPUs: one broker each -------------------------------------------- */

/*
 * Two fake GPUs, a broker on each (--run-dir-per-gpu), and the program
 * sees them renumbered ("1,0"): each cudaMalloc / cuMemAlloc goes to the
 * broker of the device current at the call (cudaSetDevice), each free to
 * the broker that gave the pointer, whatever device is current then.  A
 * third GPU has no broker: refused with error 2 and a line naming it, or
 * passed through when the fallback says so.
 */
START_TEST(preload_routes_by_current_device) {
  struct harness_gpus g;
  harness_fake_gpus(&g, 3);
  struct harness_broker b0, b1;
  harness_broker_start_gpu(&b0, g.base, "cuda:0", HARNESS_FAKE_UUID(0),
                           pre_config);
  harness_broker_start_gpu(&b1, g.base, "cuda:1", HARNESS_FAKE_UUID(1),
                           pre_config);
  struct prog p = {0};
  prog_start(&p, 0, (const char *const[]){
      "GMB_TENANT", "pre", "FAKECUDA_VISIBLE", "1,0,2",
      "GMB_SHIM_ALLOW_HOST", NULL, NULL});
  prog_expect(&p, "set_device 0", "0"); /* physical 1 */
  prog_expect(&p, "rt_malloc 0 4096", "0");
  ck_assert_uint_eq(pre_used(&b1, "pre"), 4096);
  prog_expect(&p, "set_device 1", "0"); /* physical 0 */
  prog_expect(&p, "drv_malloc 1 8192", "0");
  prog_expect(&p, "rt_malloc 2 512", "0");
  ck_assert_uint_eq(pre_used(&b0, "pre"), 8192 + 512);
  ck_assert_uint_eq(pre_used(&b1, "pre"), 4096);
  /* Freed while the other device is current: back to its own broker. */
  prog_expect(&p, "rt_free 0", "0");
  ck_assert_uint_eq(pre_used(&b1, "pre"), 0);
  ck_assert_uint_eq(pre_used(&b0, "pre"), 8192 + 512);
  prog_expect(&p, "set_device 2", "0"); /* physical 2: no broker */
  prog_expect(&p, "rt_malloc 3 4096", "2");
  prog_expect(&p, "set_device 0", "0");
  prog_expect(&p, "drv_free 1", "0");
  prog_expect(&p, "rt_free 2", "0");
  ck_assert_uint_eq(pre_used(&b0, "pre"), 0);
  char *err = prog_end(&p, 0);
  ck_assert_msg(harness_count(err, "gmb-preload: no broker") == 1 &&
                    strstr(err, "no broker for GPU " HARNESS_FAKE_UUID(2)),
                "want one line naming the GPU without a broker, got:\n%s",
                err);
  free(err);
  /* The same GPU with the fallback on pass-through: the real function. */
  prog_start(&p, 1, (const char *const[]){
      "GMB_TENANT", "pre", "GMB_PRELOAD_FALLBACK", "passthrough",
      "GMB_SHIM_ALLOW_HOST", NULL, NULL});
  prog_expect(&p, "set_device 2", "0");
  prog_expect(&p, "rt_malloc 0 4096", "0"); /* the fake cudart's */
  prog_expect(&p, "set_device 0", "0");
  prog_expect(&p, "rt_malloc 1 4096", "0"); /* the broker's */
  ck_assert_uint_eq(pre_used(&b0, "pre"), 4096);
  prog_expect(&p, "set_device 2", "0");
  prog_expect(&p, "rt_free 0", "0");
  prog_expect(&p, "rt_free 1", "0");
  ck_assert_uint_eq(pre_used(&b0, "pre"), 0);
  err = prog_end(&p, 0);
  ck_assert_msg(strstr(err, "pass through"), "%s", err);
  free(err);
  harness_broker_stop(&b0);
  harness_broker_stop(&b1);
  harness_fake_gpus_done(&g);
}
END_TEST

/*
 * The current device is read before the shim connects anywhere, and no
 * context is made current behind the program's back.  The default broker
 * (GMB_ENDPOINT) serves GPU 1, and the program's thread has no context
 * (device 0, as cudart): its first allocation goes to GPU 0's broker, and
 * the thread still has no context after it.
 */
START_TEST(preload_routes_before_connecting) {
  struct harness_gpus g;
  harness_fake_gpus(&g, 2);
  struct harness_broker b0, b1;
  harness_broker_start_gpu(&b0, g.base, "cuda:0", HARNESS_FAKE_UUID(0),
                           pre_config);
  harness_broker_start_gpu(&b1, g.base, "cuda:1", HARNESS_FAKE_UUID(1),
                           pre_config);
  struct prog p = {0};
  prog_start(&p, 0, (const char *const[]){
      "GMB_TENANT", "pre", "GMB_ENDPOINT", b1.endpoint,
      "GMB_SHIM_ALLOW_HOST", NULL, NULL});
  prog_expect(&p, "current", "none");
  prog_expect(&p, "drv_malloc 0 4096", "0");
  ck_assert_uint_eq(pre_used(&b0, "pre"), 4096);
  ck_assert_uint_eq(pre_used(&b1, "pre"), 0);
  prog_expect(&p, "current", "none");
  prog_expect(&p, "set_device 1", "0");
  prog_expect(&p, "drv_malloc 1 8192", "0");
  ck_assert_uint_eq(pre_used(&b1, "pre"), 8192);
  prog_expect(&p, "current", "1");
  prog_expect(&p, "drv_free 0", "0");
  prog_expect(&p, "drv_free 1", "0");
  ck_assert_uint_eq(pre_used(&b0, "pre"), 0);
  ck_assert_uint_eq(pre_used(&b1, "pre"), 0);
  free(prog_end(&p, 0));
  harness_broker_stop(&b0);
  harness_broker_stop(&b1);
  harness_fake_gpus_done(&g);
}
END_TEST

/* --- programs that find the driver themselves (the static runtime) ---------- */

/* A program on the static runtime's path: cuGetProcAddress_v2 from a
 * dlsym of the driver's handle, then every entry point by base name at
 * several versions and flags.  The memory calls it gets are gmb's and
 * hold it to the tenant's quota; the calls gmb does not route are the
 * driver's; cudaGetDriverEntryPoint* gives gmb's too. */
START_TEST(preload_getproc_static_runtime) {
  struct harness_gpus g;
  struct harness_broker b;
  static_gpus(&g, 1, &b);
  struct prog p = {0};
  static_start(&p, NULL, 1);
  prog_expect(&p, "resolve cuDeviceGetCount 12000 0", "0 0 drv");
  /* cuMemAlloc's _v2 ABI from 3.2 on, whatever the flags. */
  prog_expect(&p, "resolve cuMemAlloc 3020 0", "0 0 gmb:cuMemAlloc_v2");
  prog_expect(&p, "alloc 0 2097152", "0");
  ck_assert_uint_eq(pre_used(&b, "pre"), 2 * MIB);
  prog_expect(&p, "resolve cuMemAlloc 12000 1", "0 0 gmb:cuMemAlloc_v2");
  prog_expect(&p, "alloc 1 2097152", "0");
  prog_expect(&p, "resolve cuMemAlloc 13000 2", "0 0 gmb:cuMemAlloc_v2");
  prog_expect(&p, "alloc 2 2097152", "0");
  prog_expect(&p, "resolve1 cuMemAlloc 12080 0", "0 0 gmb:cuMemAlloc_v2");
  prog_expect(&p, "alloc 3 2097152", "0");
  ck_assert_uint_eq(pre_used(&b, "pre"), 8 * MIB);
  prog_expect(&p, "alloc 4 512", "2"); /* past the quota */
  ck_assert_uint_eq(pre_used(&b, "pre"), 8 * MIB);
  prog_expect(&p, "resolve cuMemGetInfo 11040 0", "0 0 gmb:cuMemGetInfo_v2");
  prog_expect(&p, "info", "0 0 8388608");
  /* Bytes through the pointers, with the driver's own copies. */
  prog_expect(&p, "fill 0 2097152 5", "0");
  prog_expect(&p, "check 0 2097152 5", "0");
  prog_expect(&p, "resolve cuMemFree 12000 0", "0 0 gmb:cuMemFree_v2");
  prog_expect(&p, "free 0", "0");
  prog_expect(&p, "free 1", "0");
  ck_assert_uint_eq(pre_used(&b, "pre"), 4 * MIB);
  prog_expect(&p, "info", "0 4194304 8388608");
  /* cuGetProcAddress itself, at both of its ABIs. */
  prog_expect(&p, "resolve cuGetProcAddress 11030 0",
              "0 0 gmb:cuGetProcAddress");
  prog_expect(&p, "resolve cuGetProcAddress 12000 0",
              "0 0 gmb:cuGetProcAddress_v2");
  prog_expect(&p, "resolve cuMemCreate 12000 0", "0 0 gmb:cuMemCreate");
  prog_expect(&p, "resolve cuMemRelease 10020 0", "0 0 gmb:cuMemRelease");
  /* By name on the driver's handle, as a real libcuda exports them. */
  prog_expect(&p, "dlsym cuMemAlloc_v2", "gmb:cuMemAlloc_v2");
  prog_expect(&p, "dlsym cuMemCreate", "gmb:cuMemCreate");
  prog_expect(&p, "alloc 5 4194304", "0");
  ck_assert_uint_eq(pre_used(&b, "pre"), 8 * MIB);
  prog_expect(&p, "alloc 6 512", "2"); /* still held to the quota */
  prog_expect(&p, "dlsym cuMemGetInfo_v2", "gmb:cuMemGetInfo_v2");
  prog_expect(&p, "info", "0 0 8388608");
  prog_expect(&p, "dlsym cuMemFree_v2", "gmb:cuMemFree_v2");
  prog_expect(&p, "free 5", "0");
  ck_assert_uint_eq(pre_used(&b, "pre"), 4 * MIB);
  /* The runtime's way to the same. */
  prog_expect(&p, "rt_entry cuMemAlloc 0", "0 0 gmb:cuMemAlloc_v2");
  prog_expect(&p, "rt_entry_ver cuMemFree 12000 0", "0 0 gmb:cuMemFree_v2");
  prog_expect(&p, "free 2", "0");
  prog_expect(&p, "free 3", "0");
  ck_assert_uint_eq(pre_used(&b, "pre"), 0);
  free(prog_end(&p, 0));
  harness_broker_stop(&b);
  harness_fake_gpus_done(&g);
}
END_TEST

/* What gmb does not route goes back as the driver gave it: unknown
 * symbols, versions below an ABI gmb wraps (another function, or none),
 * a symbol the driver lacks; dlsym of names the driver lacks. */
START_TEST(preload_getproc_unknown_passes_through) {
  struct harness_gpus g;
  struct harness_broker b;
  static_gpus(&g, 1, &b);
  struct prog p = {0};
  static_start(&p, NULL, 1);
  prog_expect(&p, "resolve cuNoSuchFunction 12000 0", "500 1 null");
  prog_expect(&p, "resolve cuMemAlloc 2000 0", "0 0 drv"); /* legacy ABI */
  prog_expect(&p, "alloc 0 4096", "801"); /* the fake's legacy answer */
  prog_expect(&p, "resolve cuMemCreate 10010 0", "500 2 null");
  prog_expect(&p, "resolve cuGetProcAddress 11000 0", "500 2 null");
  prog_expect(&p, "resolve1 cuNoSuchFunction 12000 0", "500 0 null");
  prog_expect(&p, "rt_entry cuNoSuchFunction 0", "500 1 null");
  prog_expect(&p, "dlsym cuNoSuchFunction", "null");
  /* The driver exports the legacy cuMemAlloc (which the shim does not
   * route) and every entry point it has, as a real libcuda.so.1 does. */
  prog_expect(&p, "dlsym cuMemAlloc", "drv");
  prog_expect(&p, "dlsym cuMemcpyHtoD_v2", "drv");
  prog_expect(&p, "dlsym cuGetProcAddress", "gmb:cuGetProcAddress");
  ck_assert_uint_eq(pre_used(&b, "pre"), 0);
  free(prog_end(&p, 0));
  static_start(&p, (const char *const[]){"FAKECUDA_MISSING", "cuMemAlloc",
                                         NULL}, 0);
  prog_expect(&p, "open", "0 gmb:cuGetProcAddress_v2");
  prog_expect(&p, "resolve cuMemAlloc 12000 0", "500 1 null");
  prog_expect(&p, "resolve cuMemFree 12000 0", "0 0 gmb:cuMemFree_v2");
  free(prog_end(&p, 0));
  harness_broker_stop(&b);
  harness_fake_gpus_done(&g);
}
END_TEST

/* No broker for the GPU: the driver's memory calls the program found
 * through cuGetProcAddress are refused with out-of-memory and one line
 * (GMB_PRELOAD_FALLBACK=refuse, the default), or reach the driver's own
 * (GMB_PRELOAD_FALLBACK=passthrough, or GMB_PRELOAD_STRICT=0), which
 * also exports its own memory with legacy IPC as before. */
START_TEST(preload_getproc_no_broker) {
  struct harness_gpus g;
  static_gpus(&g, 1, NULL);
  struct prog p = {0};
  static_start(&p, NULL, 1);
  prog_expect(&p, "resolve cuMemAlloc 12000 0", "0 0 gmb:cuMemAlloc_v2");
  prog_expect(&p, "alloc 0 4096", "2");
  prog_expect(&p, "create 1 2097152", "2");
  char *err = prog_end(&p, 0);
  ck_assert_msg(harness_count(err, "gmb-preload: no broker") == 1 &&
                    strstr(err, "GMB_PRELOAD_FALLBACK=refuse"),
                "stderr:\n%s", err);
  free(err);
  for (int strict = 0; strict < 2; strict++) {
    static_start(&p, (const char *const[]){
        strict ? "GMB_PRELOAD_STRICT" : "GMB_PRELOAD_FALLBACK",
        strict ? "0" : "passthrough", NULL}, 1);
    prog_expect(&p, "alloc 0 4096", "0"); /* the driver's */
    prog_expect(&p, "fill 0 4096 3", "0");
    prog_expect(&p, "check 0 4096 3", "0");
    prog_expect(&p, "ipc 0", "0");
    prog_expect(&p, "free 0", "0");
    prog_expect(&p, "create 1 2097152", "0");
    prog_expect(&p, "release 1", "0");
    err = prog_end(&p, 0);
    ck_assert_msg(strstr(err, "pass through"), "stderr:\n%s", err);
    free(err);
  }
  harness_fake_gpus_done(&g);
}
END_TEST

/*
 * The VMM calls as PyTorch's expandable segments use them: a reserved
 * range, 2 MiB handles made with cuMemCreate and mapped one after another,
 * bytes across their boundary, the tail unmapped and released as the
 * segment shrinks.  cuMemCreate is charged to the tenant at the broker,
 * beside its broker memory (the tenant's row says how much of `used` is
 * VMM memory), and refused past the quota; cuMemGetInfo's figure is the
 * broker's; release gives the room back.
 */
START_TEST(preload_vmm_expandable_segments) {
  struct harness_gpus g;
  struct harness_broker b;
  static_gpus(&g, 1, &b);
  struct prog p = {0};
  static_start(&p, (const char *const[]){"GMB_PRELOAD_VERBOSE", "1", NULL},
               1);
  prog_expect(&p, "resolve cuMemCreate 12000 0", "0 0 gmb:cuMemCreate");
  prog_expect(&p, "resolve cuMemRelease 12000 0", "0 0 gmb:cuMemRelease");
  prog_expect(&p, "resolve cuMemMap 12000 0", "0 0 drv");
  prog_expect(&p, "alloc 9 2097152", "0"); /* broker memory */
  prog_expect(&p, "vreserve 16777216", "0");
  prog_expect(&p, "create 0 2097152", "0");
  prog_expect(&p, "vmap 0 0", "0");
  prog_expect(&p, "create 1 2097152", "0");
  prog_expect(&p, "vmap 1 1", "0");
  ck_assert_uint_eq(pre_used(&b, "pre"), 6 * MIB);
  struct wire_tenant_row row;
  ck_assert_int_eq(harness_tenant_row(&b, "pre", &row), 0);
  ck_assert_uint_eq(row.vmm, 4 * MIB);
  prog_expect(&p, "vfill 1048576 2097152 7", "0"); /* across the boundary */
  prog_expect(&p, "vcheck 1048576 2097152 7", "0");
  prog_expect(&p, "info", "0 2097152 8388608");
  prog_expect(&p, "create 2 2097152", "0");
  prog_expect(&p, "vmap 2 2", "0");
  prog_expect(&p, "create 3 2097152", "2"); /* 2 + 3 x 2 MiB held */
  prog_expect(&p, "info", "0 0 8388608");
  ck_assert_uint_eq(pre_used(&b, "pre"), PRE_QUOTA);
  prog_expect(&p, "vunmap 2", "0"); /* the segment shrinks */
  prog_expect(&p, "release 2", "0");
  ck_assert_uint_eq(pre_used(&b, "pre"), 6 * MIB);
  prog_expect(&p, "create 3 2097152", "0");
  prog_expect(&p, "vmap 2 3", "0");
  prog_expect(&p, "vcheck 1048576 2097152 7", "0");
  /* Broker memory and VMM memory share the quota both ways. */
  prog_expect(&p, "alloc 8 2097152", "2");
  prog_expect(&p, "free 9", "0");
  prog_expect(&p, "create 4 2097152", "0");
  prog_expect(&p, "info", "0 0 8388608");
  for (int i = 0; i < 3; i++) {
    char cmd[32];
    snprintf(cmd, sizeof cmd, "vunmap %d", i);
    prog_expect(&p, cmd, "0");
  }
  prog_expect(&p, "release 0", "0");
  prog_expect(&p, "release 1", "0");
  prog_expect(&p, "release 3", "0");
  prog_expect(&p, "release 4", "0");
  prog_expect(&p, "vfree", "0");
  prog_expect(&p, "info", "0 8388608 8388608");
  ck_assert_uint_eq(pre_used(&b, "pre"), 0);
  char *err = prog_end(&p, 0);
  ck_assert_msg(harness_count(err, "cuMemCreate(2097152) refused: "
                                   "GMB_E_QUOTA") == 1,
                "stderr:\n%s", err);
  free(err);
  harness_broker_stop(&b);
  harness_fake_gpus_done(&g);
}
END_TEST

/* A cuMemCreate refused for the quota while the process's own cache holds
 * idle pages of it (cuMemAllocAsync's, freed): the cache gives them back
 * and the report is made again, which the broker then allows. */
START_TEST(preload_vmm_refusal_trims_own_cache) {
  struct harness_gpus g;
  struct harness_broker b;
  struct prog p;
  static_begin(&g, &b, &p);
  prog_expect(&p, "resolve cuMemCreate 12000 0", "0 0 gmb:cuMemCreate");
  prog_expect(&p, "resolve cuMemRelease 12000 0", "0 0 gmb:cuMemRelease");
  /* The stand-in driver has no stream-ordered allocator: the preload's. */
  prog_expect(&p, "global cuMemAllocAsync", "gmb:cuMemAllocAsync");
  prog_expect(&p, "global cuMemFreeAsync", "gmb:cuMemFreeAsync");
  prog_expect(&p, "aalloc 0 6291456", "0");
  prog_expect(&p, "afree 0", "0");
  /* The cache keeps the 6 MiB of pages: the tenant holds them. */
  ck_assert_uint_eq(pre_used(&b, "pre"), 6 * MIB);
  prog_expect(&p, "create 1 4194304", "0");
  ck_assert_uint_eq(pre_used(&b, "pre"), 4 * MIB);
  prog_expect(&p, "release 1", "0");
  ck_assert_uint_eq(pre_used(&b, "pre"), 0);
  static_end(&g, &b, &p);
}
END_TEST

/* cuMemFree of cuMemAllocAsync's memory in a program of the static
 * runtime, which opened the driver itself (RTLD_LOCAL, so no
 * cuCtxSynchronize is in the global scope): the free still waits for the
 * work queued in the context, as cuMemFree does, before the block can be
 * used again. */
START_TEST(preload_free_of_async_memory_waits_static_runtime) {
  struct harness_gpus g;
  struct harness_broker b;
  struct prog p;
  static_begin(&g, &b, &p);
  prog_expect(&p, "global cuMemAllocAsync", "gmb:cuMemAllocAsync");
  prog_expect(&p, "resolve cuMemFree 12000 0", "0 0 gmb:cuMemFree_v2");
  prog_expect(&p, "aalloc 0 2097152", "0");
  prog_expect(&p, "slow 300", "0");
  prog_expect(&p, "free 0", "0");
  prog_expect(&p, "slowdone", "1");
  static_end(&g, &b, &p);
}
END_TEST

/*
 * Two processes of one tenant (quota 8 MiB): the first's cache holds 6 MiB
 * of idle pages (cuMemAllocAsync's, freed) and has said so to the broker;
 * the second, whose own cache is empty, makes 4 MiB with cuMemCreate.
 * That would pass the quota: the broker asks the first process's cache
 * for the 2 MiB missing (EVENT_TRIM, answered by its library's thread),
 * holds the second's report until they are back, and the cuMemCreate
 * succeeds.  Without the ask it would be CUDA_ERROR_OUT_OF_MEMORY.
 */
START_TEST(preload_vmm_asks_other_process_cache) {
  struct harness_gpus g;
  struct harness_broker b;
  /* The hold at its longest: the first process's library thread answers
   * within a tick when it gets a core, which a loaded machine may not
   * give it within the default 100 ms. */
  harness_fake_gpus(&g, 1);
  harness_broker_start_gpu(&b, g.base, "cuda:0", HARNESS_FAKE_UUID(0),
                           "[broker]\ntrim_wait_ms = 5000\n"
                           "[tenant:pre]\nquota = 8MiB\n");
  struct prog p1 = {0}, p2 = {0};
  static_start(&p1, NULL, 1);
  static_start(&p2, (const char *const[]){"GMB_PRELOAD_VERBOSE", "1", NULL},
               1);
  prog_expect(&p1, "global cuMemAllocAsync", "gmb:cuMemAllocAsync");
  prog_expect(&p1, "global cuMemFreeAsync", "gmb:cuMemFreeAsync");
  prog_expect(&p1, "aalloc 0 6291456", "0");
  prog_expect(&p1, "afree 0", "0");
  /* A request of p1's that carries its cache's idle bytes to the broker. */
  prog_cmd(&p1, "info");
  ck_assert_uint_eq(pre_used(&b, "pre"), 6 * MIB);
  prog_expect(&p2, "resolve cuMemCreate 12000 0", "0 0 gmb:cuMemCreate");
  prog_expect(&p2, "resolve cuMemRelease 12000 0", "0 0 gmb:cuMemRelease");
  prog_expect(&p2, "create 0 4194304", "0");
  struct wire_tenant_row row;
  ck_assert_int_eq(harness_tenant_row(&b, "pre", &row), 0);
  ck_assert_uint_eq(row.vmm, 4 * MIB);
  ck_assert_uint_le(row.used, PRE_QUOTA);
  prog_expect(&p2, "release 0", "0");
  /* p1's cache gave back at least what was missing. */
  ck_assert_uint_le(pre_used(&b, "pre"), 4 * MIB);
  /* p2 first: it inherited the write end of p1's stdin. */
  char *err = prog_end(&p2, 0);
  ck_assert_msg(harness_count(err, "refused") == 0, "stderr:\n%s", err);
  free(err);
  free(prog_end(&p1, 0));
  harness_broker_stop(&b);
  harness_fake_gpus_done(&g);
}
END_TEST

/* Waits until the broker counts `want` bytes used by tenant pre. */
static void pre_wait_used(const struct harness_broker *b, uint64_t want) {
  uint64_t got = 0;
  for (int i = 0; i < HARNESS_WAIT_MS / 20; i++) {
    got = pre_used(b, "pre");
    if (got == want) return;
    harness_sleep_ms(20);
  }
  ck_abort_msg("tenant pre uses %llu bytes, want %llu",
               (unsigned long long)got, (unsigned long long)want);
}

/*
 * Two processes of one tenant under one quota (48 MiB), with the sizes
 * expandable segments ask for (20 MiB for large pools, 2 MiB for small):
 * the second is refused where the two together would pass the quota, not
 * where it alone would; the broker's figures and cuMemGetInfo's agree in
 * both.  The first is killed holding its handles: the broker gives its
 * VMM bytes back when its session ends, and the second gets them.
 */
START_TEST(preload_vmm_two_processes_one_quota) {
  struct harness_gpus g;
  struct harness_broker b;
  harness_fake_gpus(&g, 1);
  harness_broker_start_gpu(&b, g.base, "cuda:0", HARNESS_FAKE_UUID(0),
                           "[tenant:pre]\nquota = 48MiB\n");
  struct prog p1 = {0}, p2 = {0};
  static_start(&p1, NULL, 1);
  static_start(&p2, (const char *const[]){"GMB_PRELOAD_VERBOSE", "1", NULL},
               1);
  prog_expect(&p1, "resolve cuMemCreate 12000 0", "0 0 gmb:cuMemCreate");
  prog_expect(&p2, "resolve cuMemCreate 12000 0", "0 0 gmb:cuMemCreate");
  prog_expect(&p2, "resolve cuMemRelease 12000 0", "0 0 gmb:cuMemRelease");
  prog_expect(&p1, "create 0 20971520", "0");
  prog_expect(&p1, "create 1 2097152", "0");
  prog_expect(&p1, "create 2 2097152", "0");
  ck_assert_uint_eq(pre_used(&b, "pre"), 24 * MIB);
  prog_expect(&p2, "create 0 20971520", "0");
  prog_expect(&p2, "info", "0 4194304 50331648");
  prog_expect(&p1, "info", "0 4194304 50331648");
  prog_expect(&p2, "create 1 2097152", "0");
  prog_expect(&p2, "create 2 2097152", "0");
  prog_expect(&p2, "create 3 2097152", "2"); /* 24 + 24 held: the quota */
  prog_expect(&p2, "create 3 20971520", "2");
  ck_assert_uint_eq(pre_used(&b, "pre"), 48 * MIB);
  /* Killed with its three handles live: they are given back. */
  kill(p1.pid, SIGKILL);
  harness_wait(p1.pid);
  close(p1.in);
  close(p1.out);
  unlink(p1.err_path);
  pre_wait_used(&b, 24 * MIB);
  prog_expect(&p2, "create 3 20971520", "0");
  prog_expect(&p2, "info", "0 4194304 50331648");
  for (int i = 0; i < 4; i++) {
    char cmd[32];
    snprintf(cmd, sizeof cmd, "release %d", i);
    prog_expect(&p2, cmd, "0");
  }
  ck_assert_uint_eq(pre_used(&b, "pre"), 0);
  prog_expect(&p2, "release 0", "1"); /* twice: the driver's refusal */
  ck_assert_uint_eq(pre_used(&b, "pre"), 0);
  char *err = prog_end(&p2, 0);
  ck_assert_msg(harness_count(err, "refused: GMB_E_QUOTA") == 2,
                "stderr:\n%s", err);
  free(err);
  harness_broker_stop(&b);
  harness_fake_gpus_done(&g);
}
END_TEST

/* One figure everywhere: NVML (opened as pynvml opens it) reports the
 * tenant's quota as total, what it can still get as free, as the driver's
 * cuMemGetInfo does, and as the broker counts the tenant (gmbctl's
 * figures); a GPU without a broker keeps NVML's own figures.  A process
 * that only uses NVML gets the same figure. */
START_TEST(preload_nvml_reports_quota) {
  struct harness_gpus g;
  struct harness_broker b;
  static_gpus(&g, 2, &b);
  char nvml[PATH_MAX];
  static_paths(nvml, sizeof nvml);
  struct prog p = {0};
  static_start(&p, (const char *const[]){"STATIC_PROG_NVML", nvml, NULL}, 1);
  prog_expect(&p, "alloc 0 3145728", "0");
  prog_expect(&p, "nvml_open", "0");
  prog_expect(&p, "nvml_info 0", "0 5242880 8388608 3145728");
  prog_expect(&p, "nvml_info2 0", "0 5242880 8388608 3145728");
  prog_expect(&p, "nvml_info2_v1 0", "25"); /* NVML's own refusal */
  /* The device's size as the driver gives it (cudaGetDeviceProperties'
   * totalGlobalMem): the quota too; a GPU without a broker: its own. */
  prog_expect(&p, "resolve cuDeviceTotalMem 12000 0",
              "0 0 gmb:cuDeviceTotalMem_v2");
  prog_expect(&p, "total 0", "0 8388608");
  prog_expect(&p, "total 1", "0 134217728"); /* FAKECUDA_TOTAL */
  prog_expect(&p, "resolve cuDeviceTotalMem 3000 0", "0 0 drv");
  prog_expect(&p, "info", "0 5242880 8388608");
  struct wire_tenant_row row;
  ck_assert_int_eq(harness_tenant_row(&b, "pre", &row), 0);
  ck_assert_uint_eq(row.quota, 8 * MIB);
  ck_assert_uint_eq(row.used, 3 * MIB);
  /* GPU 1 has no broker: NVML's own figures (tests/fakecuda/fakenvml.c). */
  prog_expect(&p, "nvml_info 1", "0 64424509440 85899345920 21474836480");
  prog_expect(&p, "nvml_info2 1", "0 64424509440 85899345920 20401094656");
  free(prog_end(&p, 0));
  /* NVML alone, no CUDA call: its session is made by the GPU's UUID. */
  static_start(&p, (const char *const[]){"STATIC_PROG_NVML", nvml, NULL}, 0);
  prog_expect(&p, "nvml_open", "0");
  prog_expect(&p, "nvml_info2 0", "0 8388608 8388608 0");
  free(prog_end(&p, 0));
  harness_broker_stop(&b);
  harness_fake_gpus_done(&g);
}
END_TEST

/* Legacy CUDA IPC of gmb's memory is refused with not-supported and one
 * line that names the alternative; the broker's memory is untouched. */
START_TEST(preload_ipc_of_gmb_memory_refused) {
  struct harness_gpus g;
  struct harness_broker b;
  static_gpus(&g, 1, &b);
  struct prog p = {0};
  static_start(&p, NULL, 1);
  prog_expect(&p, "resolve cuIpcGetMemHandle 12000 0",
              "0 0 gmb:cuIpcGetMemHandle");
  prog_expect(&p, "alloc 0 4096", "0");
  prog_expect(&p, "ipc 0", "801");
  prog_expect(&p, "ipc 0", "801");
  prog_expect(&p, "check 0 0 0", "0");
  ck_assert_uint_eq(pre_used(&b, "pre"), 4096);
  prog_expect(&p, "free 0", "0");
  char *err = prog_end(&p, 0);
  ck_assert_msg(harness_count(err, "cannot be shared with legacy CUDA IPC") ==
                    1,
                "stderr:\n%s", err);
  free(err);
  harness_broker_stop(&b);
  harness_fake_gpus_done(&g);
}
END_TEST

/*
 * A real program on nvcc's default static runtime (tests/preload/
 * static_cudart.cu, built where nvcc is installed), on the stand-in
 * driver: the runtime opens the driver and asks cuGetProcAddress for
 * every entry point at the version its ABI appeared in; it is handed
 * gmb's for the memory calls (GMB_PRELOAD_VERBOSE names each).  It stops
 * there (the stand-in has no cuGetExportTable, NVIDIA's private table),
 * so allocation itself is left to tests/gpu/run.sh.
 */
/* Runs build/preload/NAME under the preload on the stand-in driver with
 * the environment a real CUDA runtime needs there; its output in out.
 * 0, or 1 (with a line saying so) when NAME was not built (no nvcc). */
static int real_cudart_run(const char *name, char *out, size_t cap) {
  char prog[PATH_MAX];
  snprintf(prog, sizeof prog, "%s/preload/%s", harness_build_dir(), name);
  if (access(prog, X_OK) != 0) {
    printf("%s: skipped: %s is not built (no nvcc here)\n", name, prog);
    return 1;
  }
  char preload[2 * PATH_MAX + 128], libdir[PATH_MAX];
  pre_preload_line(preload, sizeof preload, 0);
  /* The stand-in for the runtime's dlopen("libcuda.so.1"); the shared
   * build finds the toolkit's libcudart by its rpath (mk/shim.mk). */
  snprintf(libdir, sizeof libdir, "%s/fakecuda", harness_build_dir());
  setenv("LD_LIBRARY_PATH", libdir, 1);
  setenv("FAKECUDA_DRIVER_VERSION", "99000", 1); /* newer than the runtime */
  setenv("GMB_PRELOAD_VERBOSE", "1", 1);
  setenv("GMB_TENANT", "pre", 1);
#if defined(__SANITIZE_ADDRESS__)
  /* The runtime is not ours to hold to LeakSanitizer's rules. */
  setenv("ASAN_OPTIONS", "detect_leaks=0", 1);
#endif
  setenv("LD_PRELOAD", preload, 1);
  char *argv[] = {prog, NULL};
  int rc = harness_run(argv, out, cap);
  unsetenv("LD_PRELOAD");
  unsetenv("LD_LIBRARY_PATH");
  unsetenv("FAKECUDA_DRIVER_VERSION");
  unsetenv("GMB_PRELOAD_VERBOSE");
  ck_assert_msg(rc == 0, "%s exited with %d:\n%s", name, rc, out);
  return 0;
}

START_TEST(preload_real_static_cudart_lookups) {
  struct harness_gpus g;
  struct harness_broker b;
  static_gpus(&g, 1, &b);
  char out[16384];
  if (real_cudart_run("static_cudart", out, sizeof out) == 0) {
    static const char *const want[] = {
        "(cuGetProcAddress, 12000, 0): gmb's cuGetProcAddress_v2",
        "(cuMemAlloc, 3020, 0): gmb's cuMemAlloc_v2",
        "(cuMemFree, 3020, 0): gmb's cuMemFree_v2",
        "(cuMemGetInfo, 3020, 0): gmb's cuMemGetInfo_v2",
        "(cuDeviceTotalMem, 3020, 0): gmb's cuDeviceTotalMem_v2",
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++)
      ck_assert_msg(strstr(out, want[i]), "no \"%s\" in:\n%s", want[i],
                    out);
  }
  harness_broker_stop(&b);
  harness_fake_gpus_done(&g);
}
END_TEST

/* The same program linked against the toolkit's shared runtime
 * (nvcc -cudart shared: versioned references, cudaMalloc@libcudart.so.13,
 * which the preload's definitions satisfy): its calls are gmb's, held to
 * the quota, whatever the runtime behind would do. */
START_TEST(preload_real_shared_cudart) {
#if defined(__SANITIZE_ADDRESS__)
  /* The sanitized library links libzmq's whole chain (gnutls, p11-kit):
   * at the program's exit p11-kit's destructor waits in freelocale() for
   * glibc's locale lock forever beside the toolkit's libcudart (seen with
   * gdb).  The plain build runs this case. */
  printf("shared_cudart: skipped under AddressSanitizer (p11-kit's exit "
         "handler deadlocks beside libcudart)\n");
  return;
#endif
  struct harness_gpus g;
  struct harness_broker b;
  static_gpus(&g, 1, &b);
  char out[16384];
  if (real_cudart_run("shared_cudart", out, sizeof out) == 0) {
    ck_assert_msg(strstr(out, "cudaMalloc: 0\n") &&
                      strstr(out, "cudaMemGetInfo: 0 7340032 8388608\n") &&
                      strstr(out, "cudaFree: 0\n"),
                  "%s", out);
  }
  ck_assert_uint_eq(pre_used(&b, "pre"), 0);
  harness_broker_stop(&b);
  harness_fake_gpus_done(&g);
}
END_TEST

int main(void) {
  return harness_main(HARNESS_SUITE(
      "preload", "preload", 60,
      preload_getproc_static_runtime,
      preload_real_static_cudart_lookups,
      preload_real_shared_cudart,
      preload_getproc_unknown_passes_through,
      preload_getproc_no_broker,
      preload_vmm_expandable_segments, preload_vmm_two_processes_one_quota,
      preload_vmm_refusal_trims_own_cache,
      preload_free_of_async_memory_waits_static_runtime,
      preload_vmm_asks_other_process_cache,
      preload_nvml_reports_quota,
      preload_ipc_of_gmb_memory_refused,
      preload_routes_by_current_device,
      preload_routes_before_connecting,
      preload_async_alloc_free,
      preload_async_real_functions,
      preload_async_graph_capture_keeps,
      preload_free_during_capture_does_not_sync,
      preload_meminfo_device_free_plus_pool,
      preload_alloc_free_both_apis,
      preload_quota_refusal_is_error_2,
      preload_foreign_pointer_and_unlimited_info, preload_host_broker_refused,
      preload_no_broker_refuses,
      preload_passthrough_without_real_refuses));
}
