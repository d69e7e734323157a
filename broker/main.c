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
          "                  [--run-dir DIR] [--log-level error|warn|info|debug]\n"
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
          "  -l, --log-level LVL   error, warn, info (default) or debug\n"
          "  -h, --help            this text\n"
          "  -V, --version         print the version\n"
          "\n"
          "Flags override the config file.\n");
}

int main(int argc, char **argv) {
  static const struct option opts[] = {
      {"config", required_argument, NULL, 'c'},
      {"device", required_argument, NULL, 'd'},
      {"run-dir", required_argument, NULL, 'r'},
      {"log-level", required_argument, NULL, 'l'},
      {"help", no_argument, NULL, 'h'},
      {"version", no_argument, NULL, 'V'},
      {NULL, 0, NULL, 0},
  };
  const char *config = NULL, *device = NULL, *run_dir = NULL, *level = NULL;
  int c;
  opterr = 0;
  while ((c = getopt_long(argc, argv, ":c:d:r:l:hV", opts, NULL)) != -1) {
    switch (c) {
      case 'c': config = optarg; break;
      case 'd': device = optarg; break;
      case 'r': run_dir = optarg; break;
      case 'l': level = optarg; break;
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
  if (rc == 0) {
    /* Limits an operator set at run time win over the config; a state
     * file that does not read is a reason not to start, not to drop them. */
    char why[sizeof err - 16];
    rc = gmb__statefile_load(b, why, sizeof why);
    if (rc) {
      snprintf(err, sizeof err, "state: %s", why);
      rc = GMB_E_INVAL;
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
             "clients ipc://%s, admin ipc://%s", gmb_version(), b->dev->desc,
             gmb__size_format(b->dev->capacity, cap, sizeof cap),
             b->cfg.n_tenants, b->client_path, b->admin_path);
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
