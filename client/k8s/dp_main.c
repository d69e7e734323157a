/*
 * dp_main.c - gmb-device-plugin's command line, config and loop.
 *
 *   gmb-device-plugin [--config FILE] [--kubelet-dir DIR]
 *     [--pod-resources SOCKET] [--run-dir DIR] [--run-dir-per-gpu]
 *     [--unit SIZE] [--resource NAME]
 *
 * One thread, one loop: it serves the kubelet's calls as they come
 * (dp_grpc.c), and every poll_ms looks at the kubelet's socket (a kubelet
 * that restarted recreates DIR/kubelet.sock and deletes ours: the plugin
 * serves again and registers again), asks each broker how it is, and sends
 * the device list to the kubelet when it changed; every gc_ms it asks the
 * pod-resources API which units are still held.  SIGTERM and SIGINT stop
 * it: the tenants stay (their pods still run), the state file keeps them.
 */
#include <errno.h>
#include <ini.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <deviceplugin.pb-c.h> /* generated: BUILD/gen/k8s */
#include "dp.h"
#include "dp_grpc.h"
#include "gmb.h"
#include "util.h"

static volatile sig_atomic_t dp_stop;
static void dp_on_signal(int sig) {
  (void)sig;
  dp_stop = 1;
}

void dp_log(const char *fmt, ...) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  struct tm tm;
  gmtime_r(&ts.tv_sec, &tm);
  char line[2048];
  int n = (int)strftime(line, sizeof line, "%Y-%m-%dT%H:%M:%S", &tm);
  n += snprintf(line + n, sizeof line - (size_t)n, ".%03ldZ gmb-device-plugin: ",
                ts.tv_nsec / 1000000);
  va_list ap;
  va_start(ap, fmt);
  if (n > 0 && (size_t)n < sizeof line)
    vsnprintf(line + n, sizeof line - (size_t)n, fmt, ap);
  va_end(ap);
  fprintf(stderr, "%s\n", line);
}

static void dp_usage(FILE *f) {
  fprintf(f,
          "usage: gmb-device-plugin [--config FILE] [--kubelet-dir DIR]\n"
          "         [--pod-resources SOCKET] [--run-dir DIR] "
          "[--run-dir-per-gpu]\n"
          "         [--unit SIZE] [--resource NAME]\n"
          "Advertises each GPU's gmb broker capacity to the kubelet as "
          "countable\nunits (gmb.io/memory); Allocate makes the pod's tenant "
          "(docs/kubernetes.md).\n");
}

/* --- config ----------------------------------------------------------- */

struct dp_ini {
  struct dp_conf *c;
  char err[512];
};

static int dp_ms(const char *v, int *out) {
  char *end;
  long x = strtol(v, &end, 10);
  if (*v == '\0' || *end || x < 10 || x > 3600 * 1000) return -1;
  *out = (int)x;
  return 0;
}

static int dp_ini_kv(void *ctx, const char *section, const char *key,
                     const char *v) {
  struct dp_ini *d = ctx;
  struct dp_conf *c = d->c;
  if (strcmp(section, "device-plugin") != 0) return 1; /* the broker's */
  int bad = 0;
  if (strcmp(key, "unit") == 0) {
    bad = gmb__size_parse(v, &c->unit) != 0 || c->unit < GMB_MIB;
  } else if (strcmp(key, "reserve") == 0) {
    char *end;
    long p = strtol(v, &end, 10);
    bad = *v == '\0' || (*end && strcmp(end, "%") != 0) || p < 0 || p > 100;
    c->reserve_pct = (unsigned)p;
  } else if (strcmp(key, "gpus") == 0) {
    char tmp[DP_GPUS_MAX * DP_KEY_MAX];
    snprintf(tmp, sizeof tmp, "%s", v);
    char *save = NULL;
    c->n_gpus = 0;
    for (char *t = strtok_r(tmp, ", ", &save); t && !bad;
         t = strtok_r(NULL, ", ", &save)) {
      bad = !gmb__gpu_uuid_valid(t) || c->n_gpus >= DP_GPUS_MAX;
      if (!bad) snprintf(c->gpus[c->n_gpus++], DP_KEY_MAX, "%s", t);
    }
  } else if (strcmp(key, "token") == 0) {
    bad = strcmp(v, "file") != 0 && strcmp(v, "env") != 0;
    c->token_env = strcmp(v, "env") == 0;
  } else if (strcmp(key, "state_dir") == 0) {
    bad = v[0] != '/' || strlen(v) >= sizeof c->state_dir;
    snprintf(c->state_dir, sizeof c->state_dir, "%s", v);
  } else if (strcmp(key, "preload") == 0) {
    bad = (v[0] && v[0] != '/') || strlen(v) >= sizeof c->preload;
    snprintf(c->preload, sizeof c->preload, "%s", v);
  } else if (strcmp(key, "container_run_dir") == 0) {
    bad = v[0] != '/' || strlen(v) >= sizeof c->container_run_dir;
    snprintf(c->container_run_dir, sizeof c->container_run_dir, "%s", v);
  } else if (strcmp(key, "poll_ms") == 0) {
    bad = dp_ms(v, &c->poll_ms);
  } else if (strcmp(key, "gc_ms") == 0) {
    bad = dp_ms(v, &c->gc_ms);
  } else if (strcmp(key, "grace_s") == 0) {
    char *end;
    long x = strtol(v, &end, 10);
    bad = *v == '\0' || *end || x < 0 || x > 86400;
    c->grace_s = (int)x;
  } else {
    snprintf(d->err, sizeof d->err, "[device-plugin] %s: unknown key", key);
    return 0;
  }
  if (bad) {
    snprintf(d->err, sizeof d->err, "[device-plugin] %s: bad value '%.80s'",
             key, v);
    return 0;
  }
  return 1;
}

static void dp_defaults(struct dp_conf *c) {
  memset(c, 0, sizeof *c);
  snprintf(c->kubelet_dir, sizeof c->kubelet_dir,
           "/var/lib/kubelet/device-plugins");
  snprintf(c->pod_resources, sizeof c->pod_resources,
           "/var/lib/kubelet/pod-resources/kubelet.sock");
  char rd[DP_PATH_MAX];
  snprintf(c->run_dir, sizeof c->run_dir, "%s",
           gmb__run_dir(rd, sizeof rd) ? rd : "/run/gmb");
  c->unit = GMB_GIB;
  snprintf(c->resource, sizeof c->resource, "gmb.io/memory");
  snprintf(c->endpoint, sizeof c->endpoint, "gmb-memory.sock");
  snprintf(c->state_dir, sizeof c->state_dir, "/var/lib/gmb/device-plugin");
  snprintf(c->container_run_dir, sizeof c->container_run_dir, "/run/gmb");
  c->poll_ms = 1000;
  c->gc_ms = 10000;
  c->grace_s = 30;
}

/* A resource name as the kubelet wants it: DOMAIN/NAME. */
static int dp_resource_valid(const char *s) {
  const char *slash = strchr(s, '/');
  if (slash == NULL || slash == s || slash[1] == '\0' || strchr(slash + 1, '/'))
    return 0;
  for (const char *p = s; *p; p++)
    if (!(*p == '/' || *p == '.' || *p == '-' || *p == '_' ||
          (*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') ||
          (*p >= '0' && *p <= '9')))
      return 0;
  return strlen(s) < 128;
}

static int dp_args(int argc, char **argv, struct dp_conf *c) {
  const char *config = NULL;
  for (int i = 1; i < argc; i++)
    if (strcmp(argv[i], "--config") == 0 && i + 1 < argc) config = argv[i + 1];
  dp_defaults(c);
  if (config) {
    struct dp_ini d = {.c = c};
    int line = ini_parse(config, dp_ini_kv, &d);
    if (line != 0) {
      if (line < 0)
        fprintf(stderr, "gmb-device-plugin: cannot read %s\n", config);
      else
        fprintf(stderr, "gmb-device-plugin: %s:%d: %s\n", config, line,
                d.err[0] ? d.err : "not an INI line");
      return 2;
    }
  }
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (strcmp(a, "--run-dir-per-gpu") == 0) {
      c->per_gpu = 1;
      continue;
    }
    if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
      dp_usage(stdout);
      exit(0);
    }
    static const char *const valued[] = {"--config", "--kubelet-dir",
        "--pod-resources", "--run-dir", "--unit", "--resource"};
    int k = -1;
    for (int j = 0; j < 6; j++)
      if (strcmp(a, valued[j]) == 0) k = j;
    if (k < 0 || i + 1 >= argc) {
      fprintf(stderr, "gmb-device-plugin: %s: %s\n", a,
              k < 0 ? "unknown option" : "needs a value");
      dp_usage(stderr);
      return 2;
    }
    const char *v = argv[++i];
    char *dst = NULL;
    size_t cap = DP_PATH_MAX;
    switch (k) {
      case 0: break;
      case 1: dst = c->kubelet_dir; break;
      case 2: dst = c->pod_resources; break;
      case 3: dst = c->run_dir; break;
      case 4:
        if (gmb__size_parse(v, &c->unit) || c->unit < GMB_MIB) {
          fprintf(stderr, "gmb-device-plugin: --unit %s: want a size of "
                  "1MiB or more (1GiB)\n", v);
          return 2;
        }
        break;
      case 5:
        if (!dp_resource_valid(v)) {
          fprintf(stderr, "gmb-device-plugin: --resource %s: want "
                  "DOMAIN/NAME (gmb.io/memory)\n", v);
          return 2;
        }
        dst = c->resource;
        cap = sizeof c->resource;
        break;
    }
    if (dst) {
      if (strlen(v) >= cap) {
        fprintf(stderr, "gmb-device-plugin: %s: too long\n", a);
        return 2;
      }
      snprintf(dst, cap, "%s", v);
    }
  }
  return 0;
}

/* --- registration ------------------------------------------------------ */

static int dp_register(struct dp *dp, struct dpg *g) {
  V1beta1__DevicePluginOptions o = V1BETA1__DEVICE_PLUGIN_OPTIONS__INIT;
  o.get_preferred_allocation_available = 1;
  V1beta1__RegisterRequest r = V1BETA1__REGISTER_REQUEST__INIT;
  r.version = "v1beta1";
  r.endpoint = dp->conf.endpoint;
  r.resource_name = dp->conf.resource;
  r.options = &o;
  uint8_t buf[512];
  size_t n = v1beta1__register_request__pack(&r, buf);
  char path[DP_PATH_MAX + 32], why[1024];
  snprintf(path, sizeof path, "%s/kubelet.sock", dp->conf.kubelet_dir);
  uint8_t *resp = NULL;
  size_t rlen = 0;
  if (dpg_unary(g, path, "/v1beta1.Registration/Register", buf, n, 5000,
                &resp, &rlen, why, sizeof why) != 0) {
    dp_log("not registered with the kubelet: %s", why);
    return -1;
  }
  free(resp);
  dp_log("registered %s with the kubelet as %s/%s", dp->conf.resource,
         dp->conf.kubelet_dir, dp->conf.endpoint);
  return 0;
}

static uint64_t dp_now_ms(void) { return gmb__now_ns() / GMB_NS_PER_MS; }

int main(int argc, char **argv) {
  static struct dp dp;
  int rc = dp_args(argc, argv, &dp.conf);
  if (rc) return rc;
  signal(SIGPIPE, SIG_IGN);
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = dp_on_signal;
  sigaction(SIGTERM, &sa, NULL);
  sigaction(SIGINT, &sa, NULL);
  char why[1024];
  if (mkdir(dp.conf.state_dir, 0711) != 0 && errno != EEXIST) {
    dp_log("cannot make %s: %s", dp.conf.state_dir, strerror(errno));
    return 1;
  }
  if (dp_state_dir_check(&dp, why, sizeof why) != 0 ||
      dp_state_load(&dp, why, sizeof why) != 0) {
    dp_log("%s", why);
    return 1;
  }
  dp_log("started: %zu allocations kept from %s/state; brokers in %s%s, "
         "unit %llu bytes, resource %s", dp.n_allocs, dp.conf.state_dir,
         dp.conf.run_dir, dp.conf.per_gpu ? "/UUID" : "",
         (unsigned long long)dp.conf.unit, dp.conf.resource);
  struct dpg *g;
  if (dpg_new(&g, why, sizeof why) != 0) {
    dp_log("%s", why);
    return 1;
  }
  char sock[DP_PATH_MAX + 80], ksock[DP_PATH_MAX + 32];
  snprintf(sock, sizeof sock, "%s/%s", dp.conf.kubelet_dir, dp.conf.endpoint);
  snprintf(ksock, sizeof ksock, "%s/kubelet.sock", dp.conf.kubelet_dir);
  int serving = 0, registered = 0;
  ino_t kubelet_ino = 0;
  uint64_t next_poll = 0, next_gc = dp_now_ms() + (uint64_t)dp.conf.gc_ms;
  while (!dp_stop) {
    uint64_t now = dp_now_ms();
    if (now >= next_poll) {
      struct stat st, ks;
      int have_k = stat(ksock, &ks) == 0;
      /* A kubelet that restarts deletes our socket and makes its own
       * again: serve again and register again. */
      if (serving && stat(sock, &st) != 0) {
        dp_log("%s is gone (the kubelet restarted?): serving it again", sock);
        serving = registered = 0;
      }
      if (registered && have_k && ks.st_ino != kubelet_ino) {
        dp_log("%s was made again (the kubelet restarted): registering "
               "again", ksock);
        registered = 0;
      }
      if (!serving) {
        if (dpg_serve(g, sock, why, sizeof why) != 0) dp_log("%s", why);
        else serving = 1;
      }
      dp_brokers_poll(&dp);
      if (serving && !registered && have_k && dp_register(&dp, g) == 0) {
        registered = 1;
        kubelet_ino = ks.st_ino;
      }
      if (dp.list_changed) {
        uint8_t *buf;
        size_t len;
        if (dp_list_encode(&dp, &buf, &len) == 0) {
          dpg_broadcast(g, buf, len);
          free(buf);
          dp.list_changed = 0;
        }
      }
      next_poll = dp_now_ms() + (uint64_t)dp.conf.poll_ms;
    }
    if (now >= next_gc) {
      dp_collect(&dp, g);
      next_gc = dp_now_ms() + (uint64_t)dp.conf.gc_ms;
    }
    now = dp_now_ms();
    uint64_t wait = next_poll > now ? next_poll - now : 0;
    if (wait > 200) wait = 200; /* a signal is seen within 200 ms */
    struct dpg_call *call;
    enum dpg_method m;
    const uint8_t *req;
    size_t len;
    /* A bounded number of calls a round, so that the polls go on. */
    for (int k = 0; k < 64 && dpg_next(g, (int)wait, &call, &m, &req, &len);
         k++) {
      dp_handle(&dp, g, call, (int)m, req, len);
      wait = 0;
    }
  }
  dp_log("stopping: %zu allocations kept in %s/state", dp.n_allocs,
         dp.conf.state_dir);
  dpg_destroy(g);
  unlink(sock);
  if (dp_state_save(&dp, why, sizeof why)) dp_log("%s", why);
  dp_free(&dp);
  return 0;
}
