/*
 * main.c - gmb-broker: the command line, start-up and a clean stop.
 *
 * Order of settings: built-in defaults, then the config file, then flags.
 * Exit status: 0 after a clean stop, 1 when the broker cannot start (device,
 * run dir, sockets), 2 for a usage or config error.
 */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "broker.h"
#include "gmb.h"
#include "log.h"
#include "observe.h"
#include "state.h"
#include "session.h"
#include "util.h"

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

int gmb__broker_check(struct gmb_broker *b) {
  return gmb__pool_check(b->pool) + gmb__tenant_check(b->tenants);
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
  b->sigfd = -1;
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

  int rc = gmb__device_open(b->cfg.device, b->cfg.capacity,
                            b->cfg.device_reserve, &b->dev, err, sizeof err);
  if (rc) {
    fprintf(stderr, "gmb-broker: device %s: %s\n", b->cfg.device, err);
    gmb__config_free(&b->cfg);
    return rc == GMB_E_INVAL ? 2 : 1;
  }
  b->pool = gmb__pool_new(b->dev, gmb__dispatch_retire, b);
  b->tenants = b->pool ? gmb__tenants_new(b->pool, &b->cfg) : NULL;
  b->sessions = gmb__sessions_new();
  b->observe = gmb__observe_new();
  if (b->pool == NULL || b->tenants == NULL || b->sessions == NULL ||
      b->observe == NULL) {
    fprintf(stderr, "gmb-broker: out of memory at start-up\n");
    return 1;
  }
  char msg[256];
  if (gmb__tenants_check_reservations(b->tenants, b->dev->capacity, msg,
                                      sizeof msg) != 0)
    log_warn("%s", msg);
  /* Limits an operator set at run time win over the config; a state file
   * that does not read is a reason not to start, not to drop them. */
  if (gmb__state_load(b, err, sizeof err) != 0) {
    fprintf(stderr, "gmb-broker: state: %s\n", err);
    return 2;
  }
  b->start_ns = gmb__now_ns();
  int status = 0;
  if (gmb__loop_open(b, err, sizeof err) != 0) {
    fprintf(stderr, "gmb-broker: %s\n", err);
    status = 1;
  } else if (gmb__observe_serve(b, err, sizeof err) != 0) {
    /* metrics_listen was asked for and cannot be served: say so now
     * rather than run without the endpoint an operator relies on. */
    fprintf(stderr, "gmb-broker: %s\n", err);
    status = 1;
  } else {
    char cap[GMB_SIZE_BUFSZ];
    log_info("gmb-broker %s ready: device %s (%s), %zu configured tenants, "
             "clients ipc://%s, admin ipc://%s", gmb_version(), b->dev->desc,
             gmb__size_format(b->dev->capacity, cap, sizeof cap),
             b->cfg.n_tenants, b->client_path, b->admin_path);
    status = gmb__loop_run(b);
  }
  /* Sessions were told; now end them, release every segment, and remove
   * the socket files. */
  gmb__sessions_destroy(b, b->sessions);
  b->sessions = NULL;
  gmb__tenants_destroy(b->tenants);
  gmb__pool_destroy(b->pool);
  gmb__device_close(b->dev);
  gmb__loop_close(b);
  gmb__observe_destroy(b->observe);
  gmb__state_free();
  gmb__config_free(&b->cfg);
  log_info("stopped");
  return status;
}
