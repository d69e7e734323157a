/*
 * job.c - a small client of the broker, for the demo and the tests.
 *
 *   job [--tenant T] [--endpoint E] [--hold-ms N] [--touch] SIZE...
 *
 * Connects, allocates each SIZE in turn ("256MiB"), optionally writes a
 * pattern with gmb_write and reads it back with gmb_read (--touch), prints one line per
 * allocation and the tenant's figures, holds the memory for --hold-ms
 * (-1: until SIGTERM or SIGINT, or until killed, which is how the demo
 * shows the broker reclaiming a dead job's memory), then frees and
 * disconnects.
 *
 * SIGTERM and SIGINT end the hold at once: the job frees, disconnects and
 * exits with the status below, as after its hold time.  Run as a
 * container's PID 1 (which the kernel gives no default action for these
 * signals), `docker stop` and a pod's deletion so end it in 0 (or 3), not
 * in a SIGKILL after the grace period.
 *
 * Exit status: 0 every allocation succeeded; 3 some were refused (quota,
 * no memory); 1 the broker could not be reached or the session broke, or a
 * touched allocation did not read back; 2 usage.
 */
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "gmb.h"
#include "size.h"

/* Set by SIGTERM/SIGINT: the hold ends. */
static volatile sig_atomic_t job_stop;
static void job_on_signal(int sig) {
  (void)sig;
  job_stop = 1;
}

static void job_usage(FILE *f) {
  fprintf(f,
          "usage: job [--tenant T] [--endpoint E] [--hold-ms N] [--touch] "
          "SIZE...\n"
          "  --tenant T     act as tenant T (default $GMB_TENANT, else the\n"
          "                 broker's uid-UID)\n"
          "  --endpoint E   the broker (default $GMB_ENDPOINT, else\n"
          "                 ipc://$GMB_RUN_DIR/broker.sock)\n"
          "  --hold-ms N    keep the memory N ms before freeing it; -1: until\n"
          "                 SIGTERM or SIGINT (default 0); either signal\n"
          "                 ends the hold: free, disconnect, exit\n"
          "  --touch        write a pattern into each allocation, read it "
          "back\n"
          "SIZE: 512MiB, 2GiB, 4096 ...\n"
          "exit: 0 all allocated, 3 some refused, 1 connection error, 2 "
          "usage\n");
}

/* Writes a pattern that depends on the offset and the id, so that two
 * allocations mapped onto the same bytes would not both read back.  The
 * bytes travel by gmb_write/gmb_read, 4 MiB at a time: on a GPU the
 * allocation's address is a device address, which the CPU cannot touch. */
#define JOB_CHUNK ((uint64_t)4 << 20)
static int job_touch(gmb_client *c, gmb_id id, uint64_t size) {
  uint64_t *w = malloc(JOB_CHUNK);
  if (w == NULL) return -1;
  int bad = 0;
  for (int check = 0; check < 2 && !bad; check++)
    for (uint64_t at = 0; at + sizeof *w <= size && !bad; at += JOB_CHUNK) {
      uint64_t len = size - at < JOB_CHUNK ? size - at : JOB_CHUNK;
      uint64_t n = len / sizeof *w, first = at / sizeof *w;
      len = n * sizeof *w;
      if (!check) {
        for (uint64_t i = 0; i < n; i++)
          w[i] = ((first + i) * 0x9E3779B97F4A7C15ull) ^ id;
        bad = gmb_write(c, id, (size_t)at, w, (size_t)len) != 0;
      } else {
        bad = gmb_read(c, id, (size_t)at, w, (size_t)len) != 0;
        for (uint64_t i = 0; i < n && !bad; i++)
          bad = w[i] != (((first + i) * 0x9E3779B97F4A7C15ull) ^ id);
      }
    }
  free(w);
  return bad ? -1 : 0;
}

int main(int argc, char **argv) {
  /* Caught from the start, so that a stop during the allocations ends
   * them and still frees what was allocated. */
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = job_on_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGTERM, &sa, NULL);
  sigaction(SIGINT, &sa, NULL);

  const char *tenant = NULL, *endpoint = NULL;
  long hold_ms = 0;
  int touch = 0, first = argc;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
      job_usage(stdout);
      return 0;
    } else if (strcmp(argv[i], "--tenant") == 0 && i + 1 < argc) {
      tenant = argv[++i];
    } else if (strcmp(argv[i], "--endpoint") == 0 && i + 1 < argc) {
      endpoint = argv[++i];
    } else if (strcmp(argv[i], "--hold-ms") == 0 && i + 1 < argc) {
      char *end;
      hold_ms = strtol(argv[++i], &end, 10);
      if (*end != '\0' || hold_ms < -1) {
        fprintf(stderr, "job: bad --hold-ms '%s'\n", argv[i]);
        return 2;
      }
    } else if (strcmp(argv[i], "--touch") == 0) {
      touch = 1;
    } else if (argv[i][0] == '-' && argv[i][1] != '\0') {
      fprintf(stderr, "job: unknown option '%s' (see job --help)\n", argv[i]);
      return 2;
    } else {
      first = i;
      break;
    }
  }
  int n = argc - first;
  if (n <= 0) {
    fprintf(stderr, "job: no SIZE given (see job --help)\n");
    return 2;
  }
  uint64_t *sizes = calloc((size_t)n, sizeof *sizes);
  gmb_id *ids = calloc((size_t)n, sizeof *ids);
  int rc = sizes && ids ? 0 : 1;
  for (int k = 0; k < n && rc == 0; k++)
    if (size_parse(argv[first + k], &sizes[k]) != 0 || sizes[k] == 0) {
      fprintf(stderr, "job: bad SIZE '%s'\n", argv[first + k]);
      rc = 2;
    }
  if (rc) {
    free(sizes);
    free(ids);
    return rc;
  }

  /* The name to print: what we ask for, else what the broker will call us. */
  char name[80];
  const char *t = tenant ? tenant : getenv("GMB_TENANT");
  if (t && *t)
    snprintf(name, sizeof name, "%s", t);
  else
    snprintf(name, sizeof name, "uid-%u", (unsigned)getuid());
  int pid = (int)getpid();

  gmb_client *c;
  rc = gmb_connect(endpoint, tenant, &c);
  if (rc != 0) {
    fprintf(stderr, "job[%d] tenant=%s connect -> %s\n", pid, name,
           gmb_last_error(NULL));
    fflush(stdout);
    free(sizes);
    free(ids);
    return 1;
  }
  int refused = 0, broken = 0;
  for (int k = 0; k < n && !job_stop; k++) {
    char sz[SIZE_BUFSZ];
    size_format(sizes[k], sz, sizeof sz);
    rc = gmb_alloc(c, (size_t)sizes[k], 0, &ids[k]);
    if (rc != 0) {
      printf("job[%d] tenant=%s alloc %s -> %s\n", pid, name, sz,
             gmb_last_error(c));
      if (rc == GMB_E_CONN || rc == GMB_E_PROTO)
        broken = 1;
      else
        refused = 1;
      ids[k] = 0;
    } else if (touch && job_touch(c, ids[k], sizes[k]) != 0) {
      printf("job[%d] tenant=%s alloc %s -> id=%llu touch FAILED: %s\n", pid,
             name, sz, (unsigned long long)ids[k], gmb_last_error(c));
      broken = 1;
    } else {
      printf("job[%d] tenant=%s alloc %s -> id=%llu ok%s\n", pid, name, sz,
             (unsigned long long)ids[k], touch ? " (touched)" : "");
    }
    fflush(stdout);
  }

  gmb_stats st;
  if (gmb_tenant_stats(c, &st) == 0) {
    char q[SIZE_BUFSZ], u[SIZE_BUFSZ], p[SIZE_BUFSZ],
        s[SIZE_BUFSZ];
    printf("job[%d] tenant=%s stats quota=%s used=%s peak=%s segments=%s\n",
           pid, name,
           st.quota ? size_format(st.quota, q, sizeof q) : "unlimited",
           size_format(st.used, u, sizeof u),
           size_format(st.peak, p, sizeof p),
           size_format(st.segments, s, sizeof s));
  } else {
    printf("job[%d] tenant=%s stats -> %s\n", pid, name, gmb_last_error(c));
  }
  fflush(stdout);

  /* The hold.  SIGTERM and SIGINT are blocked from the test of job_stop
   * on and taken by sigtimedwait, so one that comes just before the wait
   * is not lost. */
  sigset_t stop_sigs;
  sigemptyset(&stop_sigs);
  sigaddset(&stop_sigs, SIGTERM);
  sigaddset(&stop_sigs, SIGINT);
  sigprocmask(SIG_BLOCK, &stop_sigs, NULL);
  if (!job_stop && hold_ms != 0) {
    struct timespec now, end;
    clock_gettime(CLOCK_MONOTONIC, &end);
    end.tv_sec += hold_ms / 1000;
    end.tv_nsec += (hold_ms % 1000) * 1000000L;
    if (end.tv_nsec >= 1000000000L) {
      end.tv_sec++;
      end.tv_nsec -= 1000000000L;
    }
    for (;;) {
      struct timespec left = {0, 0};
      if (hold_ms > 0) {
        clock_gettime(CLOCK_MONOTONIC, &now);
        left.tv_sec = end.tv_sec - now.tv_sec;
        left.tv_nsec = end.tv_nsec - now.tv_nsec;
        if (left.tv_nsec < 0) {
          left.tv_sec--;
          left.tv_nsec += 1000000000L;
        }
        if (left.tv_sec < 0) break; /* the hold is over */
      }
      int sig = sigtimedwait(&stop_sigs, NULL, hold_ms > 0 ? &left : NULL);
      if (sig == SIGTERM || sig == SIGINT) {
        job_stop = 1;
        break;
      }
      /* EAGAIN: the time is up (checked above); EINTR: another signal. */
    }
  }
  if (job_stop) {
    printf("job[%d] tenant=%s stopped by a signal: freeing\n", pid, name);
    fflush(stdout);
  }
  for (int k = 0; k < n; k++)
    if (ids[k] && gmb_free(c, ids[k]) != 0) {
      printf("job[%d] tenant=%s free id=%llu -> %s\n", pid, name,
             (unsigned long long)ids[k], gmb_last_error(c));
      broken = 1;
    }
  gmb_disconnect(c);
  free(sizes);
  free(ids);
  return broken ? 1 : refused ? 3 : 0;
}
