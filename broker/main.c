/*
 * main.c - gmb-broker: the command line, start-up and a clean stop.
 *
 * Order of settings: built-in defaults, then the config file, then flags.
 * Exit status: 0 after a clean stop, 1 when the broker cannot start (device,
 * run dir, sockets), 2 for a usage or config error.
 */
#include <errno.h>
#include <getopt.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "broker.h"
#include "core.h"
#include "cudrv.h"
#include "gmb.h"
#include "log.h"
#include "loop.h"
#include "statefile.h"
#include "util.h"

/* systemd's readiness protocol (sd_notify(3)) written out, so that the
 * broker needs no libsystemd: one datagram to the Unix socket that
 * $NOTIFY_SOCKET names ('@' first: the abstract namespace).  Without the
 * variable it does nothing; a failure is logged and otherwise ignored
 * (systemd then reports that the service never became ready). */
static void main_notify(const char *msg) {
  const char *path = getenv("NOTIFY_SOCKET");
  if (path == NULL || *path == '\0') return;
  struct sockaddr_un sa;
  memset(&sa, 0, sizeof sa);
  sa.sun_family = AF_UNIX;
  size_t n = strlen(path);
  if ((path[0] != '/' && path[0] != '@') || n >= sizeof sa.sun_path) {
    log_warn("NOTIFY_SOCKET=%s: not a Unix socket path; not notifying", path);
    return;
  }
  memcpy(sa.sun_path, path, n);
  if (path[0] == '@') sa.sun_path[0] = '\0';
  int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0 ||
      sendto(fd, msg, strlen(msg), MSG_NOSIGNAL, (struct sockaddr *)&sa,
             (socklen_t)(offsetof(struct sockaddr_un, sun_path) + n)) < 0)
    log_warn("sd_notify %s to %s: %s", msg, path, strerror(errno));
  if (fd >= 0) close(fd);
}

static void main_usage(FILE *f) {
  fprintf(f,
          "usage: gmb-broker [--config FILE] [--device auto|cuda:N|host:SIZE]\n"
          "                  [--run-dir DIR] [--run-dir-per-gpu]\n"
          "                  [--log-level error|warn|info|debug]\n"
          "       gmb-broker --list-gpus\n"
          "\n"
          "The GPU memory broker: owns a device's memory and hands it to client\n"
          "processes, enforcing per-tenant quotas.  Runs in the foreground, logs\n"
          "to stderr, stops cleanly on SIGTERM or SIGINT.\n"
          "\n"
          "  -c, --config FILE     INI config (see deploy/gmb.ini.example)\n"
          "  -d, --device SPEC     auto (default), cuda:N, or host:SIZE for the\n"
          "                        embedded shared-memory device (host:8GiB)\n"
          "  -r, --run-dir DIR     where broker.sock and admin.sock are made\n"
          "                        (default: $GMB_RUN_DIR, /run/gmb for root,\n"
          "                        else $XDG_RUNTIME_DIR/gmb or /tmp/gmb-UID)\n"
          "  -g, --run-dir-per-gpu sockets in RUN_DIR/UUID (the GPU's UUID), state\n"
          "                        file STATE.UUID, metrics port + N for cuda:N:\n"
          "                        one broker per GPU on a host with several\n"
          "  -L, --list-gpus       print each GPU the driver sees (ordinal, UUID,\n"
          "                        PCI bus id, name), one a line, and exit\n"
          "  -l, --log-level LVL   error, warn, info (default) or debug\n"
          "  -h, --help            this text\n"
          "  -V, --version         print the version\n"
          "\n"
          "Flags override the config file.\n");
}

/* --list-gpus: what the entrypoint of a host with several GPUs starts a
 * broker for.  One line per GPU: "N UUID PCI NAME". */
static int main_list_gpus(void) {
  struct gmb_cudrv d;
  char err[512];
  if (gmb__cudrv_load(&d, err, sizeof err) != 0) {
    fprintf(stderr, "gmb-broker: %s\n", err);
    return 1;
  }
  int n = 0;
  if (d.cuDeviceGetCount(&n) != GMB_CU_SUCCESS) n = 0;
  for (int i = 0; i < n; i++) {
    gmb_cu_device dev;
    struct gmb_cu_uuid u;
    char uuid[GMB_CU_UUID_STR], pci[32] = "?", name[96] = "?";
    if (d.cuDeviceGet(&dev, i) != GMB_CU_SUCCESS ||
        d.cuDeviceGetUuid(&u, dev) != GMB_CU_SUCCESS) {
      fprintf(stderr, "gmb-broker: cuda:%d: cannot read its UUID\n", i);
      gmb__cudrv_unload(&d);
      return 1;
    }
    d.cuDeviceGetPCIBusId(pci, (int)sizeof pci, dev);
    d.cuDeviceGetName(name, (int)sizeof name, dev);
    printf("%d %s %s %s\n", i, gmb__cudrv_uuid_str(&u, uuid, sizeof uuid),
           pci, name);
  }
  gmb__cudrv_unload(&d);
  return 0;
}

/*
 * One broker per GPU (--run-dir-per-gpu): once the device is open and its
 * UUID known, the sockets go to RUN_DIR/UUID, where clients look for the
 * broker of that GPU (gmb_connect_gpu); a state file is kept per GPU
 * (STATE.UUID), since brokers sharing one config would otherwise
 * overwrite each other's; the metrics port is shifted by the GPU's
 * ordinal (cuda:N listens on PORT + N).  GMB_E_INVAL, explained, for a
 * device that is not a GPU.
 */
static int main_per_gpu(struct gmb_broker *b, char *err, size_t cap) {
  const char *uuid = b->dev->uuid;
  if (!gmb__gpu_uuid_valid(uuid)) {
    snprintf(err, cap, "run_dir_per_gpu needs a GPU (--device cuda:N): the "
             "device %s has no GPU UUID", b->dev->desc);
    return GMB_E_INVAL;
  }
  char dir[sizeof b->run_dir];
  if (gmb__run_dir_gpu(b->run_dir, uuid, dir, sizeof dir) == NULL) {
    snprintf(err, cap, "run dir path too long");
    return GMB_E_INVAL;
  }
  memcpy(b->run_dir, dir, sizeof dir);
  if (b->cfg.state[0]) {
    size_t n = strlen(b->cfg.state);
    if (n + 1 + strlen(uuid) >= sizeof b->cfg.state) {
      snprintf(err, cap, "state path too long");
      return GMB_E_INVAL;
    }
    snprintf(b->cfg.state + n, sizeof b->cfg.state - n, ".%s", uuid);
  }
  int ordinal = 0;
  if (strncmp(b->cfg.device, "cuda:", 5) == 0)
    ordinal = atoi(b->cfg.device + 5);
  char *colon = strrchr(b->cfg.metrics_listen, ':');
  if (b->cfg.metrics_listen[0] && colon) {
    long port = strtol(colon + 1, NULL, 10) + ordinal;
    if (port > 65535) {
      snprintf(err, cap, "metrics_listen %s: port + %d is past 65535",
               b->cfg.metrics_listen, ordinal);
      return GMB_E_INVAL;
    }
    snprintf(colon + 1,
             sizeof b->cfg.metrics_listen - (size_t)(colon + 1 -
                                                     b->cfg.metrics_listen),
             "%ld", port);
  }
  log_info("one broker per GPU: %s, run dir %s%s%s", uuid, b->run_dir,
           b->cfg.state[0] ? ", state " : "", b->cfg.state);
  return 0;
}

int main(int argc, char **argv) {
  static const struct option opts[] = {
      {"config", required_argument, NULL, 'c'},
      {"device", required_argument, NULL, 'd'},
      {"run-dir", required_argument, NULL, 'r'},
      {"log-level", required_argument, NULL, 'l'},
      {"run-dir-per-gpu", no_argument, NULL, 'g'},
      {"list-gpus", no_argument, NULL, 'L'},
      {"help", no_argument, NULL, 'h'},
      {"version", no_argument, NULL, 'V'},
      {NULL, 0, NULL, 0},
  };
  const char *config = NULL, *device = NULL, *run_dir = NULL, *level = NULL;
  int c, per_gpu = 0, list = 0;
  opterr = 0;
  while ((c = getopt_long(argc, argv, ":c:d:r:l:gLhV", opts, NULL)) != -1) {
    switch (c) {
      case 'c': config = optarg; break;
      case 'd': device = optarg; break;
      case 'r': run_dir = optarg; break;
      case 'l': level = optarg; break;
      case 'g': per_gpu = 1; break;
      case 'L': list = 1; break;
      case 'h': main_usage(stdout); return 0;
      case 'V': printf("gmb-broker %s\n", gmb_version()); return 0;
      case ':':
        fprintf(stderr, "gmb-broker: %s needs a value (see --help)\n",
                argv[optind - 1]);
        return 2;
      default:
        fprintf(stderr, "gmb-broker: unknown option '%s' (see --help)\n",
                argv[optind - 1]);
        return 2;
    }
  }
  if (optind < argc) {
    fprintf(stderr, "gmb-broker: unexpected argument '%s' (see --help)\n",
            argv[optind]);
    return 2;
  }

  if (list) return main_list_gpus();

  static struct gmb_broker broker;
  struct gmb_broker *b = &broker;
  char err[1024];
  gmb__config_defaults(&b->cfg);
  if (config) {
    snprintf(b->config_path, sizeof b->config_path, "%s", config);
    if (gmb__config_load(config, &b->cfg, err, sizeof err) != 0) {
      fprintf(stderr, "gmb-broker: %s\n", err);
      return 2;
    }
  }
  if (device) snprintf(b->cfg.device, sizeof b->cfg.device, "%s", device);
  if (run_dir) snprintf(b->cfg.run_dir, sizeof b->cfg.run_dir, "%s", run_dir);
  if (per_gpu) b->cfg.run_dir_per_gpu = 1;
  if (level && gmb__log_level_parse(level, &b->cfg.log_level) != 0) {
    fprintf(stderr, "gmb-broker: bad --log-level '%s': want error, warn, "
            "info or debug\n", level);
    return 2;
  }
  b->flag_log_level = level ? b->cfg.log_level : -1;
  gmb__log_set_level(b->cfg.log_level);
  const char *chk = getenv("GMB_BROKER_CHECKS");
  b->checks = chk && strcmp(chk, "1") == 0;

  if (b->cfg.run_dir[0]) {
    if (strlen(b->cfg.run_dir) >= sizeof b->run_dir) {
      fprintf(stderr, "gmb-broker: run dir path too long\n");
      return 2;
    }
    memcpy(b->run_dir, b->cfg.run_dir, strlen(b->cfg.run_dir) + 1);
  } else if (gmb__run_dir(b->run_dir, sizeof b->run_dir) == NULL) {
    fprintf(stderr, "gmb-broker: run dir path too long\n");
    return 2;
  }

  int rc = gmb__core_open(b, err, sizeof err);
  if (rc == 0 && b->cfg.run_dir_per_gpu) rc = main_per_gpu(b, err, sizeof err);
  if (rc == 0) {
    /* Limits an operator set at run time win over the config; a state
     * file that does not read is a reason not to start, not to drop them. */
    char why[sizeof err - 16];
    rc = gmb__statefile_load(b, why, sizeof why);
    if (rc) {
      snprintf(err, sizeof err, "state: %s", why);
      rc = GMB_E_INVAL;
    } else if (gmb__core_reservations(b, why, sizeof why) != 0) {
      /* After the state file: its overrides count too.  A warning, not a
       * refusal: a GPU's capacity can be less than at the last start. */
      log_warn("%s", why);
    }
  }
  if (rc) {
    fprintf(stderr, "gmb-broker: %s\n", err);
    gmb__core_close(b);
    gmb__config_free(&b->cfg);
    return rc == GMB_E_INVAL ? 2 : 1;
  }
  b->start_ns = gmb__now_ns();
  int status = 0;
  if (gmb__loop_open(b, err, sizeof err) != 0) {
    fprintf(stderr, "gmb-broker: %s\n", err);
    status = 1;
  } else {
    char cap[GMB_SIZE_BUFSZ];
    log_info("gmb-broker %s ready: device %s (%s), %zu configured tenants, "
             "clients ipc://%s, admin ipc://%s%s%s", gmb_version(),
             b->dev->desc, gmb__size_format(b->dev->capacity, cap, sizeof cap),
             b->cfg.n_tenants, b->client_path, b->admin_path,
             b->admin_http_path[0] ? ", operators' HTTP unix:" : "",
             b->admin_http_path);
    main_notify("READY=1");
    status = gmb__loop_run(b);
    main_notify("STOPPING=1");
  }
  /* Sessions were told; now end them, release every segment, and remove
   * the socket files. */
  gmb__core_close(b);
  gmb__loop_close(b);
  gmb__config_free(&b->cfg);
  log_info("stopped");
  return status;
}
